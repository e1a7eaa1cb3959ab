/* Optimizers against hand-computed double-precision references, range updates,
 * Adam's SIMD path against the shared formula, one step of every kind,
 * schedules, gradient clipping, gradient accumulation and error paths. */
#include "harness.h"

/* ---- a tiny parameter set --------------------------------------------------------
 * w [1,3] trainable with decay (2-D), b [2] trainable without decay (1-D),
 * rm [2] a non-trainable buffer. */
typedef struct tiny {
  dt_params *p;
  int iw, ib, irm;
  size_t ow, ob, orm;
} tiny;

static const float tiny_w0[3] = {0.5f, -1.25f, 2.0f};
static const float tiny_b0[2] = {0.1f, -0.3f};
static const float tiny_rm0[2] = {7.0f, -3.0f};
/* Gradient of each element (w0..2, b0..1) at steps 1..3. */
static const float tiny_g[3][5] = {
    {0.2f, -0.4f, 1.0f, 0.05f, -2.0f},
    {-0.1f, 0.3f, 0.8f, 0.5f, 1.5f},
    {0.4f, 0.0f, -0.6f, -0.25f, 0.7f},
};

static size_t tiny_off(dt_params *p, int idx) {
  dt_param_info info;
  if (dt_params_info(p, idx, &info) != DTRAIN_OK) return 0;
  return info.offset;
}

static tiny tiny_make(void) {
  tiny t;
  int64_t s13[2] = {1, 3}, s2[1] = {2};
  t.p = dt_params_create(7);
  t.iw = dt_params_add(t.p, "w", 2, s13, dt_init_zeros());
  t.ib = dt_params_add(t.p, "b", 1, s2, dt_init_zeros());
  t.irm = dt_params_add_buffer(t.p, "rm", 1, s2, dt_init_zeros());
  t.ow = tiny_off(t.p, t.iw);
  t.ob = tiny_off(t.p, t.ib);
  t.orm = tiny_off(t.p, t.irm);
  float *d = dt_params_data(t.p);
  for (int i = 0; i < 3; i++) d[t.ow + (size_t)i] = tiny_w0[i];
  for (int i = 0; i < 2; i++) d[t.ob + (size_t)i] = tiny_b0[i];
  for (int i = 0; i < 2; i++) d[t.orm + (size_t)i] = tiny_rm0[i];
  return t;
}

/* Element e (0..4) of the trainable values: w0..2 then b0..1. */
static float *tiny_elem(tiny *t, float *buf, int e) { return e < 3 ? buf + t->ow + e : buf + t->ob + (e - 3); }

static void tiny_set_grads(tiny *t, int step) {
  float *g = dt_params_grad(t->p);
  for (int e = 0; e < 5; e++) *tiny_elem(t, g, e) = tiny_g[step][e];
  /* Garbage in the buffer's gradient: the optimizer must ignore it. */
  g[t->orm] = 100.0f;
  g[t->orm + 1] = -100.0f;
}

/* ---- double-precision references (written from the published update rules) ---- */
typedef struct ref_cfg {
  int kind; /* 0 SGD, 1 Adam, 2 AdamW, 3 RMSprop */
  double lr, mom, wd, b1, b2, eps, alpha;
  int nesterov;
  int warmup; /* linear warm-up steps (constant schedule) */
} ref_cfg;

typedef struct ref_state { double p[5], s0[5], s1[5]; } ref_state;

static void ref_step(const ref_cfg *c, ref_state *st, int t /* 1-based */, const int *decay) {
  double lr = c->lr;
  if (c->warmup > 0 && t - 1 < c->warmup) lr = c->lr * (double)t / (double)c->warmup;
  for (int e = 0; e < 5; e++) {
    double wd = decay[e] ? c->wd : 0.0;
    double p = st->p[e], g = (double)tiny_g[t - 1][e];
    if (c->kind == 0) {
      g += wd * p;
      if (c->mom > 0) {
        st->s0[e] = t == 1 ? g : c->mom * st->s0[e] + g;
        g = c->nesterov ? g + c->mom * st->s0[e] : st->s0[e];
      }
      p -= lr * g;
    } else if (c->kind == 1 || c->kind == 2) {
      if (c->kind == 2) p *= 1.0 - lr * wd;
      else g += wd * p;
      st->s0[e] = c->b1 * st->s0[e] + (1 - c->b1) * g;
      st->s1[e] = c->b2 * st->s1[e] + (1 - c->b2) * g * g;
      double mhat = st->s0[e] / (1 - pow(c->b1, t));
      double vhat = st->s1[e] / (1 - pow(c->b2, t));
      p -= lr * mhat / (sqrt(vhat) + c->eps);
    } else {
      g += wd * p;
      st->s0[e] = c->alpha * st->s0[e] + (1 - c->alpha) * g * g;
      if (c->mom > 0) {
        st->s1[e] = c->mom * st->s1[e] + g / (sqrt(st->s0[e]) + c->eps);
        p -= lr * st->s1[e];
      } else {
        p -= lr * g / (sqrt(st->s0[e]) + c->eps);
      }
    }
    st->p[e] = p;
  }
}

static dt_optim_options desc_from(const ref_cfg *c) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = c->kind == 0 ? DTRAIN_OPTIM_SGD : c->kind == 1 ? DTRAIN_OPTIM_ADAM : c->kind == 2 ? DTRAIN_OPTIM_ADAMW
                                                                                        : DTRAIN_OPTIM_RMSPROP;
  d.lr = (float)c->lr;
  d.momentum = (float)c->mom;
  d.nesterov = c->nesterov;
  d.weight_decay = (float)c->wd;
  d.beta1 = (float)c->b1;
  d.beta2 = (float)c->b2;
  d.eps = (float)c->eps;
  d.alpha = (float)c->alpha;
  d.schedule.warmup_steps = c->warmup;
  return d;
}

/* Runs 3 steps of the optimizer and of the reference and compares every value. */
static void run_three(const char *name, ref_cfg c, const int *decay_override) {
  tiny t = tiny_make();
  int decay[5] = {1, 1, 1, 0, 0};
  if (decay_override) memcpy(decay, decay_override, sizeof decay);
  /* The reference must see the float values of the descriptor. */
  c.lr = (double)(float)c.lr;
  c.mom = (double)(float)c.mom;
  c.wd = (double)(float)c.wd;
  c.b1 = (double)(float)c.b1;
  c.b2 = (double)(float)c.b2;
  c.eps = (double)(float)c.eps;
  c.alpha = (double)(float)c.alpha;
  dt_optim_options d = desc_from(&c);
  dt_optim *o = dt_optim_create(t.p, &d);
  CHECK_MSG(o != NULL, "%s: %s", name, dt_last_error());
  if (!o) {
    dt_params_destroy(t.p);
    return;
  }
  ref_state st;
  memset(&st, 0, sizeof st);
  float *data = dt_params_data(t.p);
  for (int e = 0; e < 5; e++) st.p[e] = (double)*tiny_elem(&t, data, e);
  for (int step = 1; step <= 3; step++) {
    tiny_set_grads(&t, step - 1);
    CHECK(dt_optim_steps(o) == step - 1);
    CHECK(dt_optim_step(o) == DTRAIN_OK);
    ref_step(&c, &st, step, decay);
    for (int e = 0; e < 5; e++) {
      double got = (double)*tiny_elem(&t, data, e);
      double err = fabs(got - st.p[e]) / fmax(1.0, fabs(st.p[e]));
      CHECK_MSG(err < 2e-6, "%s step %d element %d: got %.9g, want %.9g", name, step, e, got, st.p[e]);
    }
    /* The buffer is never touched, whatever its gradient holds. */
    CHECK(data[t.orm] == tiny_rm0[0] && data[t.orm + 1] == tiny_rm0[1]);
  }
  CHECK(dt_optim_steps(o) == 3);
  dt_optim_destroy(o);
  dt_params_destroy(t.p);
}

static ref_cfg cfg(int kind, double lr) {
  ref_cfg c;
  memset(&c, 0, sizeof c);
  c.kind = kind;
  c.lr = lr;
  c.b1 = 0.9;
  c.b2 = 0.999;
  c.eps = 1e-8;
  c.alpha = 0.99;
  return c;
}

static void test_sgd(void) {
  ref_cfg c = cfg(0, 0.1);
  run_three("sgd", c, NULL);
  c.wd = 0.05;
  run_three("sgd wd", c, NULL);
  c.mom = 0.9;
  run_three("sgd momentum wd", c, NULL);
  c.nesterov = 1;
  run_three("sgd nesterov wd", c, NULL);
  c.warmup = 2;
  run_three("sgd nesterov warmup", c, NULL);
}

static void test_adam(void) {
  ref_cfg c = cfg(1, 0.01);
  run_three("adam", c, NULL);
  c.wd = 0.1;
  run_three("adam wd", c, NULL);
  c.b1 = 0.8;
  c.b2 = 0.95;
  c.eps = 1e-3; /* large eps makes the eps placement matter */
  run_three("adam betas eps", c, NULL);
  c.warmup = 3;
  run_three("adam warmup", c, NULL);
}

static void test_adamw(void) {
  ref_cfg c = cfg(2, 0.05);
  c.wd = 0.2;
  run_three("adamw", c, NULL);
  c.eps = 1e-2;
  run_three("adamw eps", c, NULL);
  /* AdamW must differ from Adam with the same weight decay. */
  tiny a = tiny_make(), w = tiny_make();
  dt_optim_options da, dw;
  memset(&da, 0, sizeof da);
  da.kind = DTRAIN_OPTIM_ADAM;
  da.lr = 0.05f;
  da.weight_decay = 0.2f;
  dw = da;
  dw.kind = DTRAIN_OPTIM_ADAMW;
  dt_optim *oa = dt_optim_create(a.p, &da), *ow = dt_optim_create(w.p, &dw);
  tiny_set_grads(&a, 0);
  tiny_set_grads(&w, 0);
  CHECK(dt_optim_step(oa) == DTRAIN_OK && dt_optim_step(ow) == DTRAIN_OK);
  CHECK(dt_params_data(a.p)[a.ow] != dt_params_data(w.p)[w.ow]);
  /* No decay on the bias: Adam and AdamW agree there. */
  CHECK(dt_params_data(a.p)[a.ob] == dt_params_data(w.p)[w.ob]);
  dt_optim_destroy(oa);
  dt_optim_destroy(ow);
  dt_params_destroy(a.p);
  dt_params_destroy(w.p);
}

static void test_rmsprop(void) {
  ref_cfg c = cfg(3, 0.01);
  run_three("rmsprop", c, NULL);
  c.wd = 0.1;
  c.alpha = 0.9;
  run_three("rmsprop wd alpha", c, NULL);
  c.mom = 0.5;
  run_three("rmsprop momentum", c, NULL);
  c.eps = 0.1;
  run_three("rmsprop momentum eps", c, NULL);
}

/* One step of a hand-checked case, to make sure the reference itself is right. */
static void test_reference_sanity(void) {
  /* SGD, lr 0.1, no momentum: w0 = 0.5 - 0.1 * 0.2 = 0.48 exactly in decimal. */
  tiny t = tiny_make();
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 0.1f;
  dt_optim *o = dt_optim_create(t.p, &d);
  tiny_set_grads(&t, 0);
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK_NEAR(dt_params_data(t.p)[t.ow], 0.48, 1e-7);
  dt_optim_destroy(o);
  dt_params_destroy(t.p);
  /* Adam's first step moves every element by lr * sign(g) (|g| >> eps). */
  t = tiny_make();
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.01f;
  o = dt_optim_create(t.p, &d);
  tiny_set_grads(&t, 0);
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  float *p = dt_params_data(t.p);
  CHECK_NEAR(p[t.ow + 0], 0.5 - 0.01, 1e-6);
  CHECK_NEAR(p[t.ow + 1], -1.25 + 0.01, 1e-6);
  CHECK_NEAR(p[t.ob + 1], -0.3 + 0.01, 1e-6);
  dt_optim_destroy(o);
  dt_params_destroy(t.p);
}

static void test_decay_flag(void) {
  /* SGD with zero gradients: only weight decay moves the values. */
  tiny t = tiny_make();
  dt_param_info info;
  CHECK(dt_params_info(t.p, t.iw, &info) == DTRAIN_OK && info.decay == 1);
  CHECK(dt_params_info(t.p, t.ib, &info) == DTRAIN_OK && info.decay == 0);
  CHECK(dt_params_info(t.p, t.irm, &info) == DTRAIN_OK && info.decay == 0);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 0.1f;
  d.weight_decay = 0.5f;
  dt_optim *o = dt_optim_create(t.p, &d);
  float *p = dt_params_data(t.p);
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK_NEAR(p[t.ow], 0.5 * (1 - 0.05), 1e-7);
  CHECK(p[t.ob] == tiny_b0[0] && p[t.ob + 1] == tiny_b0[1]);
  /* Flip the flags. */
  CHECK(dt_params_set_decay(t.p, t.iw, 0) == DTRAIN_OK);
  CHECK(dt_params_set_decay(t.p, t.ib, 1) == DTRAIN_OK);
  CHECK(dt_params_set_decay(t.p, t.irm, 1) == DTRAIN_OK); /* buffers never decay */
  float w_before = p[t.ow];
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK(p[t.ow] == w_before);
  CHECK_NEAR(p[t.ob], 0.1 * (1 - 0.05), 1e-7);
  CHECK_NEAR(p[t.ob + 1], -0.3 * (1 - 0.05), 1e-7);
  CHECK(p[t.orm] == tiny_rm0[0] && p[t.orm + 1] == tiny_rm0[1]);
  dt_optim_destroy(o);
  /* AdamW with zero gradients: decoupled decay only where the flag is set. */
  dt_params_destroy(t.p);
  t = tiny_make();
  p = dt_params_data(t.p);
  d.kind = DTRAIN_OPTIM_ADAMW;
  o = dt_optim_create(t.p, &d);
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK_NEAR(p[t.ow + 2], 2.0 * (1 - 0.05), 1e-6);
  CHECK(p[t.ob] == tiny_b0[0]);
  dt_optim_destroy(o);
  dt_params_destroy(t.p);
  /* Adam (L2 decay) for 3 steps with the flags flipped: bias decays, weight does not. */
  int dec[5] = {0, 0, 0, 1, 1};
  ref_cfg c = cfg(1, 0.01);
  c.wd = 0.3;
  {
    tiny u = tiny_make();
    dt_params_set_decay(u.p, u.iw, 0);
    dt_params_set_decay(u.p, u.ib, 1);
    c.lr = (double)(float)c.lr;
    c.wd = (double)(float)c.wd;
    c.b1 = (double)(float)c.b1;
    c.b2 = (double)(float)c.b2;
    c.eps = (double)(float)c.eps;
    dt_optim_options dd = desc_from(&c);
    dt_optim *oo = dt_optim_create(u.p, &dd);
    ref_state st;
    memset(&st, 0, sizeof st);
    float *data = dt_params_data(u.p);
    for (int e = 0; e < 5; e++) st.p[e] = (double)*tiny_elem(&u, data, e);
    for (int step = 1; step <= 3; step++) {
      tiny_set_grads(&u, step - 1);
      CHECK(dt_optim_step(oo) == DTRAIN_OK);
      ref_step(&c, &st, step, dec);
      for (int e = 0; e < 5; e++) CHECK_NEAR(*tiny_elem(&u, data, e), st.p[e], 2e-6);
    }
    dt_optim_destroy(oo);
    dt_params_destroy(u.p);
  }
}

/* ---- range updates ------------------------------------------------------------------ */

static dt_params *range_params(void) {
  dt_params *p = dt_params_create(99);
  int64_t s45[2] = {4, 5}, s5[1] = {5}, s3[1] = {3}, s33[2] = {3, 3};
  dt_params_add(p, "w1", 2, s45, dt_init_glorot_uniform());
  dt_params_add(p, "b1", 1, s5, dt_init_uniform(-0.5f, 0.5f));
  dt_params_add_buffer(p, "stat", 1, s3, dt_init_constant(1.0f));
  dt_params_add(p, "w2", 2, s33, dt_init_normal(0.0f, 1.0f));
  return p;
}

static void range_grads(dt_params *p, int step) {
  float *g = dt_params_grad(p);
  th_seed(1000 + (uint64_t)step);
  size_t n = dt_params_size(p);
  for (size_t i = 0; i < n; i++) g[i] = th_uniform(-1.0f, 1.0f);
}

static void range_case(const char *name, dt_optim_options d) {
  dt_params *p1 = range_params(), *p2 = range_params(), *p3 = range_params();
  size_t n = dt_params_size(p1);
  CHECK(dt_params_checksum(p1) == dt_params_checksum(p2));
  dt_optim *o1 = dt_optim_create(p1, &d), *o2 = dt_optim_create(p2, &d), *o3 = dt_optim_create(p3, &d);
  CHECK_MSG(o1 && o2 && o3, "%s: %s", name, dt_last_error());
  if (!o1 || !o2 || !o3) return;
  /* p3's optimizer updates an outside copy of the values (a replica's buffer). */
  float *copy = (float *)malloc(n * sizeof(float));
  memcpy(copy, dt_params_data(p3), n * sizeof(float));
  dt_param_info info;
  dt_params_info(p1, 1, &info);
  size_t k = info.offset + 2; /* cuts b1 in the middle */
  for (int step = 0; step < 3; step++) {
    range_grads(p1, step);
    range_grads(p2, step);
    range_grads(p3, step);
    CHECK(dt_optim_step(o1) == DTRAIN_OK);
    CHECK(dt_optim_update(o2, dt_params_data(p2), dt_params_grad(p2), 0, k) == DTRAIN_OK);
    CHECK(dt_optim_update(o2, dt_params_data(p2), dt_params_grad(p2), k, n) == DTRAIN_OK);
    dt_optim_advance(o2);
    /* Three uneven pieces in reverse order, plus an empty range. */
    CHECK(dt_optim_update(o3, copy, dt_params_grad(p3), 40, n) == DTRAIN_OK);
    CHECK(dt_optim_update(o3, copy, dt_params_grad(p3), 5, 40) == DTRAIN_OK);
    CHECK(dt_optim_update(o3, copy, dt_params_grad(p3), 5, 5) == DTRAIN_OK);
    CHECK(dt_optim_update(o3, copy, dt_params_grad(p3), 0, 5) == DTRAIN_OK);
    dt_optim_advance(o3);
  }
  CHECK_MSG(memcmp(dt_params_data(p1), dt_params_data(p2), n * sizeof(float)) == 0, "%s: halves differ", name);
  CHECK_MSG(memcmp(dt_params_data(p1), copy, n * sizeof(float)) == 0, "%s: outside copy differs", name);
  CHECK(dt_params_checksum(p1) == dt_params_checksum(p2));
  /* p3's own data was not touched by updates of the copy. */
  dt_params *fresh = range_params();
  CHECK(dt_params_checksum(p3) == dt_params_checksum(fresh));
  CHECK(dt_params_checksum(p1) != dt_params_checksum(fresh));
  dt_params_destroy(fresh);
  CHECK(dt_optim_state_slots(o1) == dt_optim_state_slots(o2));
  for (int s = 0; s < dt_optim_state_slots(o1); s++) {
    CHECK(memcmp(dt_optim_state(o1, s), dt_optim_state(o2, s), n * sizeof(float)) == 0);
    CHECK(memcmp(dt_optim_state(o1, s), dt_optim_state(o3, s), n * sizeof(float)) == 0);
  }
  CHECK(dt_optim_steps(o1) == 3 && dt_optim_steps(o2) == 3 && dt_optim_steps(o3) == 3);
  free(copy);
  dt_optim_destroy(o1);
  dt_optim_destroy(o2);
  dt_optim_destroy(o3);
  dt_params_destroy(p1);
  dt_params_destroy(p2);
  dt_params_destroy(p3);
}

static void test_range_updates(void) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 0.1f;
  d.momentum = 0.9f;
  d.nesterov = 1;
  d.weight_decay = 0.01f;
  d.schedule.warmup_steps = 2;
  range_case("sgd", d);
  d.nesterov = 0;
  d.kind = DTRAIN_OPTIM_ADAM;
  d.momentum = 0;
  range_case("adam", d);
  d.kind = DTRAIN_OPTIM_ADAMW;
  range_case("adamw", d);
  d.kind = DTRAIN_OPTIM_RMSPROP;
  d.momentum = 0.5f;
  range_case("rmsprop", d);
}

/* ---- the SIMD paths of Adam against the shared formula --------------------------------
 * dt_optim.c updates Adam 16 (AVX-512), 8 (AVX) or 4 (SSE) floats at a time
 * and the rest with dt__optim_adam_at (dt_optim_math.h); the intrinsics must
 * be the same operations as that formula. Lengths 45 (AVX-512 32 + AVX 8 + a
 * tail of 5; AVX 40 + 5; SSE 44 + 1), 7 (SSE 4 + 3 after the wider paths
 * found nothing to do) and 3 (the formula alone), run through dt_optim_step
 * and, element by element, through the formula with the scalars computed
 * here the way dt_optim.c does (Python's arithmetic, in double): params and
 * moments must agree bit for bit. Once per instruction set the CPU has
 * (dt_sgemm_use_isa picks it for the optimizer too); one it lacks is skipped. */
static dt__optim_adam_k adam_scalars(const dt_optim_options *d, int64_t step, float wd) {
  const double b1 = (double)d->beta1, b2 = (double)d->beta2, t = (double)(step + 1);
  dt__optim_adam_k k;
  k.step_size = (float)((double)d->lr / (1.0 - pow(b1, t)));
  k.wd = wd;
  k.bc2_sqrt = (float)sqrt(1.0 - pow(b2, t));
  k.eps = d->eps;
  k.w1 = (float)(1.0 - b1);
  k.w2 = (float)(1.0 - b2);
  k.beta2 = d->beta2;
  k.shrink = (float)(1.0 - (double)d->lr * (double)wd);
  k.decoupled = d->kind == DTRAIN_OPTIM_ADAMW;
  return k;
}

static void adam_simd_case(const char *name, dt_optim_kind kind, float wd) {
  dt_params *p = dt_params_create(5);
  int64_t s45[2] = {5, 9}, s7[1] = {7}, s3[2] = {1, 3};
  dt_params_add(p, "w", 2, s45, dt_init_uniform(-1.0f, 1.0f));  /* decay on (2-D) */
  dt_params_add(p, "b", 1, s7, dt_init_uniform(-1.0f, 1.0f));   /* decay off (1-D) */
  dt_params_add(p, "c", 2, s3, dt_init_uniform(-1.0f, 1.0f));
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = 0.05f;
  d.weight_decay = wd;
  dt_optim *o = dt_optim_create(p, &d);
  CHECK_MSG(o != NULL, "%s: %s", name, dt_last_error());
  if (!o) return;
  const dt_optim_options *full = dt_optim_get_options(o);
  size_t n = dt_params_size(p);
  float *rp = (float *)malloc(n * sizeof(float)), *rm = (float *)calloc(n, sizeof(float));
  float *rv = (float *)calloc(n, sizeof(float));
  memcpy(rp, dt_params_data(p), n * sizeof(float));
  for (int step = 0; step < 4; step++) {
    range_grads(p, step);
    const float *g = dt_params_grad(p);
    for (int i = 0; i < dt_params_count(p); i++) {
      dt_param_info info;
      dt_params_info(p, i, &info);
      dt__optim_adam_k k = adam_scalars(full, step, info.decay ? wd : 0.0f);
      for (size_t j = info.offset; j < info.offset + info.size; j++) dt__optim_adam_at(k, rp, g, rm, rv, j);
    }
    CHECK(dt_optim_step(o) == DTRAIN_OK);
    /* After every step: a last-bit difference can be rounded away by the
     * next one (v * beta2), so the end state alone would miss it. */
    int same = memcmp(rp, dt_params_data(p), n * sizeof(float)) == 0 &&
               memcmp(rm, dt_optim_state(o, 0), n * sizeof(float)) == 0 &&
               memcmp(rv, dt_optim_state(o, 1), n * sizeof(float)) == 0;
    CHECK_MSG(same, "%s: step %d: params or moments differ from dt__optim_adam_at", name, step + 1);
    if (!same) break;
  }
  free(rp);
  free(rm);
  free(rv);
  dt_optim_destroy(o);
  dt_params_destroy(p);
}

static void test_adam_simd_matches_formula(void) {
  static const char *const isas[] = {"portable", "avx2", "avx512"};
  for (int i = 0; i < 3; i++) {
    if (dt_sgemm_use_isa(isas[i]) != DTRAIN_OK) {
      th_skip("the %s path: %s", isas[i], dt_last_error());
      continue;
    }
    char name[48];
    snprintf(name, sizeof name, "adam %s", isas[i]);
    adam_simd_case(name, DTRAIN_OPTIM_ADAM, 0.0f);
    snprintf(name, sizeof name, "adam_l2 %s", isas[i]);
    adam_simd_case(name, DTRAIN_OPTIM_ADAM, 0.1f);
    snprintf(name, sizeof name, "adamw %s", isas[i]);
    adam_simd_case(name, DTRAIN_OPTIM_ADAMW, 0.1f);
  }
  CHECK(dt_sgemm_use_isa("best") == DTRAIN_OK);
}

/* ---- every optimizer kind -----------------------------------------------------------------
 * The kinds are probed from DTRAIN_OPTIM_SGD upwards until dt_optim_create
 * answers "unknown optimizer kind": so an optimizer added later (a kind with
 * a row in dt_optim.c) is checked here without touching this test, and the
 * public enum needs no count entry that is not a kind. Each kind, with its
 * defaults and with momentum, weight decay and clipping, must make one
 * finite step that lowers L = sum (p - t)^2 / 2 (gradient p - t). */
static double quad_loss(const float *p, const float *t, size_t n) {
  double l = 0.0;
  for (size_t i = 0; i < n; i++) l += 0.5 * ((double)p[i] - (double)t[i]) * ((double)p[i] - (double)t[i]);
  return l;
}

static int every_kind_case(int kind, int variant) {
  dt_params *p = dt_params_create(11);
  int64_t s[2] = {4, 5}, sb[1] = {5};
  dt_params_add(p, "w", 2, s, dt_init_uniform(-1.0f, 1.0f));
  dt_params_add(p, "b", 1, sb, dt_init_uniform(-1.0f, 1.0f));
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = (dt_optim_kind)kind;
  if (variant) {
    d.momentum = 0.9f;
    d.weight_decay = 1e-3f;
    d.clip_norm = 1.0f;
  }
  dt_optim *o = dt_optim_create(p, &d);
  if (!o) {
    dt_params_destroy(p);
    return 0;
  }
  size_t n = dt_params_size(p);
  float *t = (float *)malloc(n * sizeof(float)), *x = dt_params_data(p), *g = dt_params_grad(p);
  th_seed(77 + (uint64_t)kind);
  for (size_t i = 0; i < n; i++) t[i] = x[i] + (th_rand() < 0.5 ? -1.0f : 1.0f) * th_uniform(0.5f, 1.0f);
  for (size_t i = 0; i < n; i++) g[i] = x[i] - t[i];
  double before = quad_loss(x, t, n);
  CHECK_MSG(dt_optim_step(o) == DTRAIN_OK, "kind %d: %s", kind, dt_last_error());
  double after = quad_loss(x, t, n);
  int finite = 1;
  for (size_t i = 0; i < n; i++) finite = finite && isfinite(x[i]);
  for (int sl = 0; sl < dt_optim_state_slots(o); sl++)
    for (size_t i = 0; i < n; i++) finite = finite && isfinite(dt_optim_state(o, sl)[i]);
  CHECK_MSG(finite, "kind %d (variant %d): a parameter or state value is not finite", kind, variant);
  CHECK_MSG(after < before, "kind %d (variant %d): loss %g -> %g did not go down", kind, variant, before, after);
  CHECK(dt_optim_steps(o) == 1);
  free(t);
  dt_optim_destroy(o);
  dt_params_destroy(p);
  return 1;
}

static void test_every_kind_steps(void) {
  int kind = DTRAIN_OPTIM_SGD;
  while (every_kind_case(kind, 0)) {
    CHECK_MSG(every_kind_case(kind, 1), "kind %d: %s", kind, dt_last_error());
    kind++;
  }
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_INVALID_ARG && strstr(dt_last_error(), "unknown optimizer kind"),
            "kind %d: %s", kind, dt_last_error());
  /* Every kind named in dt_optim.h was found (the probe did not stop early). */
  CHECK_MSG(kind > DTRAIN_OPTIM_RMSPROP, "only kinds below %d work", kind);
}

static void test_state_slots(void) {
  dt_params *p = range_params();
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  dt_optim *o = dt_optim_create(p, &d);
  CHECK(dt_optim_state_slots(o) == 0);
  CHECK(dt_optim_state(o, 0) == NULL && dt_last_result() == DTRAIN_ERR_INDEX);
  dt_optim_destroy(o);
  d.momentum = 0.9f;
  o = dt_optim_create(p, &d);
  CHECK(dt_optim_state_slots(o) == 1);
  dt_optim_destroy(o);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.momentum = 0;
  o = dt_optim_create(p, &d);
  CHECK(dt_optim_state_slots(o) == 2);
  float *m = dt_optim_state(o, 0), *v = dt_optim_state(o, 1);
  CHECK(m && v && m != v && m[0] == 0.0f && v[0] == 0.0f);
  CHECK(dt_optim_state(o, 2) == NULL && strstr(dt_last_error(), "slot 2") != NULL);
  CHECK(dt_optim_state(o, -1) == NULL);
  /* After a step with grad g on element 0: m = 0.1 g, v = 0.001 g^2. */
  dt_params_zero_grad(p);
  dt_params_grad(p)[0] = 2.0f;
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK_NEAR(m[0], 0.2, 1e-7);
  CHECK_NEAR(v[0], (1.0 - (double)(float)0.999f) * 4.0, 1e-9); /* (float): FLT_EVAL_METHOD 1 targets (s390x) keep literals in double */
  CHECK(m[1] == 0.0f);
  dt_optim_destroy(o);
  d.kind = DTRAIN_OPTIM_RMSPROP;
  o = dt_optim_create(p, &d);
  CHECK(dt_optim_state_slots(o) == 1);
  dt_optim_destroy(o);
  d.momentum = 0.3f;
  o = dt_optim_create(p, &d);
  CHECK(dt_optim_state_slots(o) == 2);
  dt_optim_destroy(o);
  dt_params_destroy(p);
}

static void test_defaults(void) {
  dt_params *p = range_params();
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  dt_optim *o = dt_optim_create(p, &d);
  const dt_optim_options *f = dt_optim_get_options(o);
  CHECK(f && f->kind == DTRAIN_OPTIM_SGD && f->lr == (float)0.01f && f->momentum == (float)0.0f);
  CHECK(dt_optim_lr(o) == (float)0.01f);
  dt_optim_destroy(o);
  d.kind = DTRAIN_OPTIM_ADAM;
  o = dt_optim_create(p, &d);
  f = dt_optim_get_options(o);
  CHECK(f && f->lr == (float)0.001f && f->beta1 == (float)0.9f && f->beta2 == (float)0.999f && f->eps == (float)1e-8f);
  dt_optim_destroy(o);
  d.kind = DTRAIN_OPTIM_RMSPROP;
  d.schedule.kind = DTRAIN_SCHED_STEP;
  d.schedule.step_size = 3;
  o = dt_optim_create(p, &d);
  f = dt_optim_get_options(o);
  CHECK(f && f->lr == (float)0.001f && f->alpha == (float)0.99f && f->eps == (float)1e-8f && f->schedule.gamma == (float)0.1f);
  /* The descriptor passed in is not modified. */
  CHECK(d.lr == (float)0.0f && d.alpha == (float)0.0f);
  /* lr follows the step counter. */
  CHECK(dt_optim_lr(o) == (float)0.001f);
  dt_optim_set_steps(o, 3);
  CHECK(dt_optim_steps(o) == 3);
  CHECK_NEAR(dt_optim_lr(o), 0.0001, 1e-10);
  dt_optim_set_steps(o, -1);
  CHECK(dt_optim_steps(o) == 3 && dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  dt_optim_destroy(o);
  dt_params_destroy(p);
  /* No parameters at all is fine. */
  dt_params *e = dt_params_create(1);
  d.kind = DTRAIN_OPTIM_ADAM;
  o = dt_optim_create(e, &d);
  CHECK(o != NULL);
  CHECK(dt_optim_step(o) == DTRAIN_OK && dt_optim_steps(o) == 1);
  d.clip_norm = 1.0f;
  dt_optim_destroy(o);
  o = dt_optim_create(e, &d);
  CHECK(o && dt_optim_step(o) == DTRAIN_OK);
  dt_optim_destroy(o);
  dt_params_destroy(e);
  dt_optim_destroy(NULL);
  CHECK(dt_optim_steps(NULL) == 0 && dt_optim_get_options(NULL) == NULL && dt_optim_state_slots(NULL) == 0);
}

/* ---- schedules ---------------------------------------------------------------------- */

static void test_schedules(void) {
  dt_schedule s;
  memset(&s, 0, sizeof s);
  const float lr = 0.1f;
  CHECK(dt_schedule_lr(&s, lr, 0) == lr && dt_schedule_lr(&s, lr, 123456) == lr);
  CHECK(dt_schedule_lr(NULL, lr, 5) == lr);
  /* warm-up: lr * (step + 1) / warmup */
  s.warmup_steps = 4;
  CHECK_NEAR(dt_schedule_lr(&s, lr, 0), 0.025, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 1), 0.05, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 3), 0.1, 1e-8);
  CHECK(dt_schedule_lr(&s, lr, 4) == lr && dt_schedule_lr(&s, lr, 100) == lr);
  /* step: lr * gamma ^ floor(t / step_size), default gamma 0.1 */
  memset(&s, 0, sizeof s);
  s.kind = DTRAIN_SCHED_STEP;
  s.step_size = 10;
  CHECK(dt_schedule_lr(&s, lr, 0) == lr && dt_schedule_lr(&s, lr, 9) == lr);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 10), 0.01, 1e-9);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 19), 0.01, 1e-9);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 25), 0.001, 1e-10);
  s.gamma = 0.5f;
  CHECK_NEAR(dt_schedule_lr(&s, lr, 35), 0.1 * 0.125, 1e-9);
  /* with warm-up the step clock starts after it */
  s.warmup_steps = 5;
  CHECK_NEAR(dt_schedule_lr(&s, lr, 2), 0.1 * 3 / 5, 1e-8);
  CHECK(dt_schedule_lr(&s, lr, 5) == lr && dt_schedule_lr(&s, lr, 14) == lr);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 15), 0.05, 1e-9);
  /* cosine */
  memset(&s, 0, sizeof s);
  s.kind = DTRAIN_SCHED_COSINE;
  s.total_steps = 100;
  s.min_lr = 0.001f;
  const double pi = 3.14159265358979323846, mn = (double)0.001f, l = (double)lr;
  CHECK_NEAR(dt_schedule_lr(&s, lr, 0), l, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 25), mn + (l - mn) * (1 + cos(pi / 4)) / 2, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 50), (l + mn) / 2, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 99), mn + (l - mn) * (1 + cos(pi * 0.99)) / 2, 1e-8);
  CHECK(dt_schedule_lr(&s, lr, 100) == s.min_lr);
  CHECK(dt_schedule_lr(&s, lr, 1000) == s.min_lr);
  s.warmup_steps = 10;
  CHECK_NEAR(dt_schedule_lr(&s, lr, 4), 0.05, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 10), l, 1e-8);
  CHECK_NEAR(dt_schedule_lr(&s, lr, 60), (l + mn) / 2, 1e-8);
  CHECK(dt_schedule_lr(&s, lr, 110) == s.min_lr && dt_schedule_lr(&s, lr, 5000) == s.min_lr);
  /* The optimizer uses the lr of the current step: SGD, zero momentum, grad 1. */
  dt_params *p = dt_params_create(3);
  int64_t s1[1] = {1};
  dt_params_add(p, "x", 1, s1, dt_init_zeros());
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.lr = 1.0f;
  d.schedule.kind = DTRAIN_SCHED_STEP;
  d.schedule.step_size = 2;
  d.schedule.gamma = 0.5f;
  d.schedule.warmup_steps = 2;
  dt_optim *o = dt_optim_create(p, &d);
  /* lrs: 0.5, 1, 1, 1, 0.5, 0.5 -> x = -(sum) */
  const double want[6] = {-0.5, -1.5, -2.5, -3.5, -4.0, -4.5};
  for (int i = 0; i < 6; i++) {
    dt_params_grad(p)[0] = 1.0f;
    CHECK(dt_optim_step(o) == DTRAIN_OK);
    CHECK_NEAR(dt_params_data(p)[0], want[i], 1e-6);
  }
  dt_optim_destroy(o);
  dt_params_destroy(p);
}

/* ---- clipping ----------------------------------------------------------------------- */

static void test_clip(void) {
  float g[3] = {3.0f, 4.0f, 0.0f};
  float norm = dt_clip_grad_norm(g, 3, 1.0f);
  CHECK(norm == 5.0f);
  CHECK_NEAR(g[0], 3.0 / (5.0 + 1e-6), 1e-7);
  CHECK_NEAR(g[1], 4.0 / (5.0 + 1e-6), 1e-7);
  CHECK(g[2] == 0.0f);
  CHECK_NEAR(sqrt((double)g[0] * g[0] + (double)g[1] * g[1]), 1.0, 1e-6);
  /* Small gradients, and a norm exactly at the limit, are left alone (bitwise). */
  float s[2] = {0.3f, 0.4f};
  float s0 = s[0], s1 = s[1];
  norm = dt_clip_grad_norm(s, 2, 1.0f);
  CHECK_NEAR(norm, 0.5, 1e-7);
  CHECK(s[0] == s0 && s[1] == s1);
  float e[2] = {3.0f, 4.0f};
  CHECK(dt_clip_grad_norm(e, 2, 5.0f) == 5.0f && e[0] == 3.0f && e[1] == 4.0f);
  /* Large vector: norm in double. */
  float *big = (float *)malloc(10000 * sizeof(float));
  for (int i = 0; i < 10000; i++) big[i] = 0.5f;
  CHECK_NEAR(dt_clip_grad_norm(big, 10000, 10.0f), 50.0, 1e-4);
  CHECK_NEAR(big[0], 0.5 * 10.0 / (50.0 + 1e-6), 1e-8);
  free(big);
  CHECK(dt_clip_grad_norm(NULL, 0, 1.0f) == 0.0f);
  /* errors */
  CHECK(dt_clip_grad_norm(NULL, 3, 1.0f) < 0 && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_clip_grad_norm(g, 3, 0.0f) < 0 && dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "max_norm") != NULL);

  /* Inside dt_optim_step: the norm covers trainable ranges only. */
  tiny t = tiny_make();
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 1.0f;
  d.clip_norm = 1.0f;
  dt_optim *o = dt_optim_create(t.p, &d);
  dt_params_zero_grad(t.p);
  float *gr = dt_params_grad(t.p), *p = dt_params_data(t.p);
  gr[t.ow] = 3.0f;
  gr[t.ob + 1] = 4.0f;
  gr[t.orm] = 1000.0f; /* must be ignored (buffers have no gradient) */
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  const double c = 1.0 / (5.0 + 1e-6);
  CHECK_NEAR(gr[t.ow], 3.0 * c, 1e-7); /* clipped in place, like PyTorch */
  CHECK_NEAR(gr[t.ob + 1], 4.0 * c, 1e-7);
  CHECK(gr[t.orm] == 1000.0f);
  CHECK_NEAR(p[t.ow], 0.5 - 3.0 * c, 1e-6);
  CHECK_NEAR(p[t.ob + 1], -0.3 - 4.0 * c, 1e-6);
  CHECK(p[t.ow + 1] == tiny_w0[1] && p[t.orm] == tiny_rm0[0]);
  /* below the limit: plain update */
  dt_params_zero_grad(t.p);
  gr[t.ow + 1] = 0.5f;
  CHECK(dt_optim_step(o) == DTRAIN_OK);
  CHECK(gr[t.ow + 1] == 0.5f);
  CHECK_NEAR(p[t.ow + 1], -1.25 - 0.5, 1e-6);
  /* a non-finite gradient refuses the step */
  float before = p[t.ow];
  gr[t.ow] = NAN;
  CHECK(dt_optim_step(o) == DTRAIN_ERR_NONFINITE);
  CHECK(strstr(dt_last_error(), "NaN") != NULL);
  CHECK(p[t.ow] == before && dt_optim_steps(o) == 2);
  dt_optim_destroy(o);
  dt_params_destroy(t.p);
}

/* ---- gradient accumulation ------------------------------------------------------------
 * Model: y = w * w * x (elementwise, broadcast over the batch), loss = mean over
 * the batch of sum(y). Full batch of 2 rows vs two micro-batches of 1 row each,
 * accumulated into the flat gradient and scaled by 1/2. */
static void test_grad_accumulation(void) {
  const float w0[4] = {0.5f, -1.5f, 2.0f, 0.25f};
  const float xs[2][4] = {{1.0f, 2.0f, -1.0f, 0.5f}, {3.0f, -0.5f, 0.25f, 2.0f}};
  dt_params *pf = dt_params_create(5), *pa = dt_params_create(5);
  int64_t s4[1] = {4};
  dt_params_add(pf, "w", 1, s4, dt_init_zeros());
  dt_params_add(pa, "w", 1, s4, dt_init_zeros());
  memcpy(dt_params_data(pf), w0, sizeof w0);
  memcpy(dt_params_data(pa), w0, sizeof w0);
  dt_graph *gf = dt_graph_create(pf, NULL), *ga = dt_graph_create(pa, NULL);
  /* full batch */
  int64_t s24[2] = {2, 4}, s14[2] = {1, 4};
  dt_tensor *w = dt_param(gf, 0);
  dt_tensor *x = dt_tensor_from(gf, 2, s24, &xs[0][0]);
  dt_tensor *y = dt_mul(gf, dt_mul(gf, w, w), x);
  float seed[8];
  for (int i = 0; i < 8; i++) seed[i] = 0.5f; /* d mean_batch(sum) / dy */
  CHECK(y != NULL && dt_backward_grad(gf, y, seed) == DTRAIN_OK);
  /* two micro-batches */
  for (int mb = 0; mb < 2; mb++) {
    dt_graph_reset(ga);
    dt_tensor *wa = dt_param(ga, 0);
    dt_tensor *xa = dt_tensor_from(ga, 2, s14, xs[mb]);
    dt_tensor *ya = dt_mul(ga, dt_mul(ga, wa, wa), xa);
    float ones[4] = {1, 1, 1, 1};
    CHECK(ya != NULL && dt_backward_grad(ga, ya, ones) == DTRAIN_OK);
  }
  float *gfull = dt_params_grad(pf), *gacc = dt_params_grad(pa);
  /* before scaling: the sum of both micro-batch gradients */
  for (int i = 0; i < 4; i++) CHECK_NEAR(gacc[i], 2.0 * w0[i] * (xs[0][i] + xs[1][i]), 1e-5);
  dt_params_scale_grad(pa, 0.5f);
  for (int i = 0; i < 4; i++) {
    double want = 2.0 * w0[i] * (xs[0][i] + xs[1][i]) / 2.0;
    CHECK_NEAR(gfull[i], want, 1e-5);
    CHECK_NEAR(gacc[i], want, 1e-5);
  }
  /* one optimizer step on each gives the same parameters */
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 0.1f;
  d.momentum = 0.9f;
  dt_optim *of = dt_optim_create(pf, &d), *oa = dt_optim_create(pa, &d);
  CHECK(dt_optim_step(of) == DTRAIN_OK && dt_optim_step(oa) == DTRAIN_OK);
  for (int i = 0; i < 4; i++) CHECK_NEAR(dt_params_data(pf)[i], dt_params_data(pa)[i], 1e-6);
  dt_optim_destroy(of);
  dt_optim_destroy(oa);
  dt_graph_destroy(gf);
  dt_graph_destroy(ga);
  dt_params_destroy(pf);
  dt_params_destroy(pa);
}

/* ---- errors ----------------------------------------------------------------------------- */

static void expect_create_error(dt_params *p, dt_optim_options d, dt_result code, const char *needle) {
  dt_clear_error();
  dt_optim *o = dt_optim_create(p, &d);
  CHECK(o == NULL);
  CHECK_MSG(dt_last_result() == code, "%s: got %s", needle, dt_result_name(dt_last_result()));
  CHECK_MSG(strstr(dt_last_error(), needle) != NULL, "message '%s' lacks '%s'", dt_last_error(), needle);
  CHECK(strstr(dt_last_error(), "dt_optim_create") != NULL);
  dt_optim_destroy(o);
}

static void test_errors(void) {
  dt_params *p = range_params();
  dt_optim_options d, z;
  memset(&z, 0, sizeof z);
  dt_clear_error();
  CHECK(dt_optim_create(NULL, &z) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_last_error(), "params is NULL") != NULL);
  CHECK(dt_optim_create(p, NULL) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_last_error(), "desc is NULL") != NULL);
  d = z; d.lr = -0.1f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "lr -0.1");
  d = z; d.lr = NAN; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "lr");
  d = z; d.momentum = -0.5f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "momentum -0.5");
  d = z; d.nesterov = 1; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "nesterov needs momentum");
  d = z; d.kind = DTRAIN_OPTIM_ADAM; d.nesterov = 1; d.momentum = 0.9f;
  expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "nesterov applies to SGD only");
  d = z; d.kind = DTRAIN_OPTIM_ADAM; d.beta1 = 1.0f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "betas");
  d = z; d.kind = DTRAIN_OPTIM_ADAM; d.beta2 = -0.1f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "betas");
  d = z; d.kind = DTRAIN_OPTIM_ADAMW; d.beta2 = 1.5f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "[0, 1)");
  d = z; d.kind = DTRAIN_OPTIM_ADAM; d.eps = -1e-8f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "eps");
  d = z; d.kind = DTRAIN_OPTIM_RMSPROP; d.alpha = 1.0f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "alpha");
  d = z; d.weight_decay = -1.0f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "weight_decay");
  d = z; d.clip_norm = -1.0f; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "clip_norm");
  d = z; d.kind = (dt_optim_kind)42; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "unknown optimizer kind 42");
  d = z; d.schedule.kind = DTRAIN_SCHED_STEP; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "step_size");
  d = z; d.schedule.kind = DTRAIN_SCHED_COSINE; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "total_steps");
  d = z; d.schedule.kind = DTRAIN_SCHED_COSINE; d.schedule.total_steps = 10; d.schedule.min_lr = -1.0f;
  expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "min_lr");
  d = z; d.schedule.warmup_steps = -1; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "warmup_steps");
  d = z; d.schedule.kind = (dt_schedule_kind)9; expect_create_error(p, d, DTRAIN_ERR_INVALID_ARG, "schedule kind 9");

  /* update / step argument errors */
  dt_optim *o = dt_optim_create(p, &z);
  size_t n = dt_params_size(p);
  float *data = dt_params_data(p), *grad = dt_params_grad(p);
  CHECK_ERR(dt_optim_step(NULL), DTRAIN_ERR_NULL_ARG, "dt_optim_step");
  CHECK_ERR(dt_optim_update(NULL, data, grad, 0, n), DTRAIN_ERR_NULL_ARG, "dt_optim_update");
  CHECK_ERR(dt_optim_update(o, NULL, grad, 0, n), DTRAIN_ERR_NULL_ARG, "data is NULL");
  CHECK_ERR(dt_optim_update(o, data, NULL, 0, n), DTRAIN_ERR_NULL_ARG, "grad is NULL");
  CHECK_ERR(dt_optim_update(o, data, grad, 0, n + 1), DTRAIN_ERR_INDEX, "outside");
  CHECK_ERR(dt_optim_update(o, data, grad, 5, 4), DTRAIN_ERR_INDEX, "[5,4)");
  CHECK(dt_optim_steps(o) == 0);
  dt_optim_advance(NULL); /* no-op */
  /* params that grow after create are refused */
  int64_t s2[1] = {2};
  dt_params_add(p, "late", 1, s2, dt_init_zeros());
  CHECK_ERR(dt_optim_step(o), DTRAIN_ERR_STATE, "changed size");
  CHECK(dt_optim_steps(o) == 0);
  dt_optim_destroy(o);
  dt_params_destroy(p);
}

/* dt_optim_defaults: the kind, every other field zero (the C and C++ idiom). */
static void test_defaults_ctor(void) {
  dt_optim_options a = dt_optim_defaults(DTRAIN_OPTIM_ADAMW), z;
  memset(&z, 0, sizeof z);
  z.kind = DTRAIN_OPTIM_ADAMW;
  CHECK(memcmp(&a, &z, sizeof a) == 0);
  dt_params *P = dt_params_create(1);
  int64_t s[1] = {4};
  dt_params_add(P, "w", 1, s, dt_init_zeros());
  dt_optim *o = dt_optim_create(P, &a);
  CHECK(o != NULL && dt_optim_lr(o) > 0.0f); /* lr 0: the kind's default */
  dt_optim_destroy(o);
  dt_params_destroy(P);
}

int main(void) {
  TH_RUN(test_reference_sanity);
  TH_RUN(test_sgd);
  TH_RUN(test_adam);
  TH_RUN(test_adamw);
  TH_RUN(test_rmsprop);
  TH_RUN(test_decay_flag);
  TH_RUN(test_range_updates);
  TH_RUN(test_adam_simd_matches_formula);
  TH_RUN(test_every_kind_steps);
  TH_RUN(test_state_slots);
  TH_RUN(test_defaults);
  TH_RUN(test_schedules);
  TH_RUN(test_clip);
  TH_RUN(test_grad_accumulation);
  TH_RUN(test_errors);
  TH_RUN(test_defaults_ctor);
  return th_summary("optim");
}
