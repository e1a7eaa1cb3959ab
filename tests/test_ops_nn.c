/* NN ops: softmax, log_softmax, cross_entropy, mse, embedding, dropout,
 * layer_norm, batch_norm, causal_mask -- values, gradients against finite
 * differences, and error paths. */
#include "harness.h"

static int64_t numel(int nd, const int64_t *s) {
  int64_t n = 1;
  for (int d = 0; d < nd; d++) n *= s[d];
  return n;
}

/* ---- softmax / log_softmax ----------------------------------------------------------- */

typedef struct { int log, axis; } sm_ctx;

static dt_tensor *f_softmax(dt_graph *g, dt_tensor **in, void *ctx) {
  sm_ctx *c = (sm_ctx *)ctx;
  return c->log ? dt_log_softmax(g, in[0], c->axis) : dt_softmax(g, in[0], c->axis);
}

static void test_softmax_grads(void) {
  static const int64_t shapes[][3] = {{3, 5, 1}, {2, 3, 4}};
  static const int nds[] = {2, 3};
  static const int axes[][5] = {{-1, 1, 0, -2, 99}, {0, 1, 2, -1, -2}};
  float x[64];
  for (int s = 0; s < 2; s++) {
    for (int a = 0; a < 5; a++) {
      if (axes[s][a] == 99) continue;
      for (int lg = 0; lg < 2; lg++) {
        th_fill(x, numel(nds[s], shapes[s]), -3, 3);
        th_input in = th_in(x, nds[s], shapes[s], 1);
        sm_ctx c = {lg, axes[s][a]};
        int bad = th_gradcheck(lg ? "log_softmax" : "softmax", f_softmax, &c, &in, 1);
        CHECK_MSG(bad == 0, "%s shape %d axis %d: %d mismatches", lg ? "log_softmax" : "softmax", s, axes[s][a], bad);
      }
    }
  }
}

static void test_softmax_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[3] = {2, 3, 4};
  float xv[24];
  th_fill(xv, 24, -4, 4);
  dt_tensor *x = dt_tensor_from(g, 3, s, xv);
  for (int axis = -3; axis < 3; axis++) {
    int ax = axis < 0 ? axis + 3 : axis;
    dt_tensor *y = dt_softmax(g, x, axis), *ly = dt_log_softmax(g, x, axis);
    CHECK(y && ly && dt_same_shape(y, x) && dt_same_shape(ly, x));
    if (!y || !ly) continue;
    /* naive reference: for every element, sum exp over the axis */
    int64_t st[3] = {12, 4, 1};
    for (int64_t i = 0; i < 24; i++) {
      int64_t idx = (i / st[ax]) % s[ax];
      int64_t first = i - idx * st[ax];
      double den = 0, rowsum = 0;
      for (int64_t k = 0; k < s[ax]; k++) den += exp((double)xv[first + k * st[ax]]);
      for (int64_t k = 0; k < s[ax]; k++) rowsum += (double)y->data[first + k * st[ax]];
      CHECK_NEAR(y->data[i], exp((double)xv[i]) / den, 1e-6);
      CHECK_NEAR(ly->data[i], (double)xv[i] - log(den), 1e-5);
      CHECK_NEAR(rowsum, 1.0, 1e-6);
    }
  }
  /* stability: huge logits */
  float big[3] = {1000.0f, 1001.0f, 1002.0f};
  int64_t s3[1] = {3};
  dt_tensor *b = dt_tensor_from(g, 1, s3, big);
  dt_tensor *lb = dt_log_softmax(g, b, 0), *sb = dt_softmax(g, b, -1);
  CHECK(lb && sb);
  if (lb && sb) {
    double lse = log(exp(-2.0) + exp(-1.0) + 1.0);
    for (int i = 0; i < 3; i++) {
      CHECK(isfinite(lb->data[i]) && isfinite(sb->data[i]));
      CHECK_NEAR(lb->data[i], (double)(i - 2) - lse, 1e-5);
      CHECK_NEAR(sb->data[i], exp((double)(i - 2) - lse), 1e-6);
    }
  }
  float neg[2] = {-1000.0f, 0.0f};
  int64_t s2[1] = {2};
  dt_tensor *nb = dt_log_softmax(g, dt_tensor_from(g, 1, s2, neg), 0);
  CHECK(nb && nb->data[0] == -1000.0f && nb->data[1] == 0.0f);
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  dt_graph_destroy(g);
}

/* ---- cross entropy ---------------------------------------------------------------------- */

typedef struct { const int32_t *labels; } ce_ctx;

static dt_tensor *f_xent(dt_graph *g, dt_tensor **in, void *ctx) {
  return dt_cross_entropy(g, in[0], ((ce_ctx *)ctx)->labels);
}

static void test_cross_entropy_grads(void) {
  static const int64_t shapes[][3] = {{4, 5, 1}, {2, 3, 6}, {7, 2, 1}};
  static const int nds[] = {2, 3, 2};
  float x[64];
  int32_t lab[16];
  for (int s = 0; s < 3; s++) {
    int64_t c = shapes[s][nds[s] - 1], rows = numel(nds[s], shapes[s]) / c;
    for (int64_t r = 0; r < rows; r++) lab[r] = (int32_t)(th_rand() * (double)c);
    th_fill(x, rows * c, -3, 3);
    th_input in = th_in(x, nds[s], shapes[s], 1);
    ce_ctx ctx = {lab};
    int bad = th_gradcheck("cross_entropy", f_xent, &ctx, &in, 1);
    CHECK_MSG(bad == 0, "shape %d: %d mismatches", s, bad);
  }
}

static void test_cross_entropy_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[6] = {1, 2, 3, 1, 1, 1};
  int32_t lab[2] = {2, 0};
  int64_t s[2] = {2, 3};
  dt_tensor *x = dt_tensor_from(g, 2, s, xv);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *l = dt_cross_entropy(g, x, lab);
  CHECK(l && l->ndim == 0 && l->size == 1);
  double l0 = log(exp(1.0) + exp(2.0) + exp(3.0)) - 3.0, l1 = log(3.0);
  CHECK_NEAR(dt_item(l), (l0 + l1) / 2, 1e-6);
  lab[0] = 1; /* labels were copied: changing them now has no effect on backward */
  CHECK(dt_backward(g, l) == DTRAIN_OK);
  if (x->grad) {
    double den = exp(1.0) + exp(2.0) + exp(3.0);
    for (int j = 0; j < 3; j++) {
      CHECK_NEAR(x->grad[j], (exp(1.0 + j) / den - (j == 2)) / 2, 1e-6);
      CHECK_NEAR(x->grad[3 + j], (1.0 / 3 - (j == 0)) / 2, 1e-6);
    }
  } else {
    CHECK(x->grad != NULL);
  }
  dt_graph_reset(g);
  /* huge logits stay finite; [2,2,3] logits have 4 rows */
  float big[12] = {1000, 0, -1000, 5, 5, 5, 0, 1000, 0, 1, 2, 3};
  int32_t lab4[4] = {0, 1, 1, 0};
  int64_t s3[3] = {2, 2, 3};
  dt_tensor *lb = dt_cross_entropy(g, dt_tensor_from(g, 3, s3, big), lab4);
  CHECK(lb && isfinite(dt_item(lb)));
  /* rows: label at a 1000 margin (loss ~0), uniform (log 3), ~0 again, then [1,2,3] with label 0 */
  double want = (0.0 + log(3.0) + 0.0 + (log(exp(1.0) + exp(2.0) + exp(3.0)) - 1.0)) / 4;
  CHECK_NEAR(dt_item(lb), want, 1e-5);
  /* a wrong class at huge margin: loss is the margin */
  float far[2] = {0.0f, 1000.0f};
  int32_t l0lab[1] = {0};
  int64_t s12[2] = {1, 2};
  dt_tensor *lf = dt_cross_entropy(g, dt_tensor_from(g, 2, s12, far), l0lab);
  CHECK(lf && fabsf(dt_item(lf) - 1000.0f) < 1e-3f);
  dt_graph_destroy(g);
}

/* ---- mse -------------------------------------------------------------------------------- */

static dt_tensor *f_mse(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_mse(g, in[0], in[1]);
}

static void test_mse(void) {
  float a[30], b[30];
  int64_t s[3] = {2, 3, 5};
  th_fill(a, 30, -2, 2);
  th_fill(b, 30, -2, 2);
  th_input ins[2] = {th_in(a, 3, s, 1), th_in(b, 3, s, 1)};
  CHECK(th_gradcheck("mse", f_mse, NULL, ins, 2) == 0);
  dt_graph *g = dt_graph_create(NULL, NULL);
  float av[4] = {1, 2, 3, 4}, bv[4] = {1, 0, 4, 8};
  int64_t s22[2] = {2, 2};
  dt_tensor *ta = dt_tensor_from(g, 2, s22, av), *tb = dt_tensor_from(g, 2, s22, bv);
  dt_tensor_set_requires_grad(ta, 1);
  dt_tensor_set_requires_grad(tb, 1);
  dt_tensor *l = dt_mse(g, ta, tb);
  CHECK_NEAR(dt_item(l), (0.0 + 4 + 1 + 16) / 4, 1e-6);
  CHECK(dt_backward(g, l) == DTRAIN_OK);
  CHECK(ta->grad && tb->grad);
  if (ta->grad && tb->grad) {
    CHECK_NEAR(ta->grad[1], 2.0 * 2 / 4, 1e-6);
    CHECK_NEAR(tb->grad[3], -2.0 * -4 / 4, 1e-6);
  }
  dt_graph_destroy(g);
}

/* ---- embedding ---------------------------------------------------------------------------- */

typedef struct { const int32_t *ids; int64_t n; } emb_ctx;

static dt_tensor *f_emb(dt_graph *g, dt_tensor **in, void *ctx) {
  emb_ctx *c = (emb_ctx *)ctx;
  return dt_embedding(g, in[0], c->ids, c->n);
}

static void test_embedding(void) {
  float t[7 * 4];
  int64_t s[2] = {7, 4};
  int32_t ids[9] = {3, 0, 3, 6, 1, 3, 0, 5, 2}; /* repeats */
  th_fill(t, 28, -1, 1);
  th_input in = th_in(t, 2, s, 1);
  emb_ctx c = {ids, 9};
  CHECK(th_gradcheck("embedding", f_emb, &c, &in, 1) == 0);

  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *tab = dt_tensor_from(g, 2, s, t);
  dt_tensor_set_requires_grad(tab, 1);
  dt_tensor *y = dt_embedding(g, tab, ids, 9);
  CHECK(y && y->ndim == 2 && y->shape[0] == 9 && y->shape[1] == 4);
  if (!y) { dt_graph_destroy(g); return; }
  for (int i = 0; i < 9; i++)
    for (int j = 0; j < 4; j++) CHECK(y->data[i * 4 + j] == t[ids[i] * 4 + j]);
  float ones[36];
  for (int i = 0; i < 36; i++) ones[i] = 1.0f;
  CHECK(dt_backward_grad(g, y, ones) == DTRAIN_OK);
  if (tab->grad) {
    /* row r's gradient counts how many times r was picked */
    static const float counts[7] = {2, 1, 1, 3, 0, 1, 1};
    for (int r = 0; r < 7; r++)
      for (int j = 0; j < 4; j++) CHECK(tab->grad[r * 4 + j] == counts[r]);
  } else {
    CHECK(tab->grad != NULL);
  }
  dt_graph_destroy(g);
}

/* ---- dropout ------------------------------------------------------------------------------ */

typedef struct {
  uint64_t rng[4];
  float p;
  unsigned char pattern[64]; /* kept (1) / dropped (0) from the first build */
  int builds, changed;
} do_ctx;

static dt_tensor *f_dropout(dt_graph *g, dt_tensor **in, void *ctx) {
  do_ctx *c = (do_ctx *)ctx;
  dt_graph_set_rng_state(g, c->rng); /* the same mask on every rebuild */
  dt_tensor *y = dt_dropout(g, in[0], c->p);
  if (!y) return NULL;
  for (int64_t i = 0; i < y->size && i < 64; i++) {
    unsigned char kept = y->data[i] != 0.0f;
    if (c->builds == 0) c->pattern[i] = kept;
    else if (c->pattern[i] != kept) c->changed++;
  }
  c->builds++;
  return y;
}

static void test_dropout_grad(void) {
  dt_graph_options d;
  memset(&d, 0, sizeof d);
  d.seed = 1234;
  dt_graph *g = dt_graph_create(NULL, &d);
  do_ctx c;
  memset(&c, 0, sizeof c);
  dt_graph_rng_state(g, c.rng);
  dt_graph_destroy(g);
  c.p = 0.4f;
  float x[48];
  int64_t s[2] = {6, 8};
  th_fill_away0(x, 48, -2, 2, 0.1f); /* nonzero, so a kept element reads as nonzero */
  th_input in = th_in(x, 2, s, 1);
  CHECK(th_gradcheck("dropout", f_dropout, &c, &in, 1) == 0);
  CHECK(c.builds > 2);
  CHECK_MSG(c.changed == 0, "mask changed %d times across rebuilds", c.changed);
  int kept = 0;
  for (int i = 0; i < 48; i++) kept += c.pattern[i];
  CHECK(kept > 0 && kept < 48); /* both kinds present: the check means something */
}

static void test_dropout_values(void) {
  enum { N = 20000 };
  float *xv = (float *)malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) xv[i] = 1.0f + (float)(i % 7);
  int64_t s[1] = {N};
  dt_graph_options d;
  memset(&d, 0, sizeof d);
  d.seed = 99;
  dt_graph *g = dt_graph_create(NULL, &d), *g2 = dt_graph_create(NULL, &d);
  d.seed = 100;
  dt_graph *g3 = dt_graph_create(NULL, &d);
  float p = 0.3f;
  dt_tensor *x = dt_tensor_from(g, 1, s, xv);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *y = dt_dropout(g, x, p);
  dt_tensor *y2 = dt_dropout(g2, dt_tensor_from(g2, 1, s, xv), p);
  dt_tensor *y3 = dt_dropout(g3, dt_tensor_from(g3, 1, s, xv), p);
  CHECK(y && y2 && y3);
  if (y && y2 && y3) {
    int kept = 0, bad_scale = 0, same = 1, same3 = 1;
    for (int i = 0; i < N; i++) {
      if (y->data[i] != 0.0f) {
        kept++;
        if (fabsf(y->data[i] - xv[i] / (1.0f - p)) > 1e-5f * y->data[i]) bad_scale++;
      }
      if (y->data[i] != y2->data[i]) same = 0;
      if (y->data[i] != y3->data[i]) same3 = 0;
    }
    double frac = (double)kept / N;
    CHECK_MSG(fabs(frac - (1.0 - p)) < 0.02, "kept fraction %g", frac);
    CHECK(bad_scale == 0);
    CHECK(same);   /* same seed, same mask */
    CHECK(!same3); /* another seed, another mask */
    /* backward: the gradient is the mask */
    float *ones = (float *)malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) ones[i] = 1.0f;
    CHECK(dt_backward_grad(g, y, ones) == DTRAIN_OK);
    int gbad = 0;
    if (x->grad)
      for (int i = 0; i < N; i++)
        if (x->grad[i] != (y->data[i] != 0.0f ? (float)(1.0f / (1.0f - p)) : 0.0f)) gbad++; /* (float): see FLT_EVAL_METHOD */
    CHECK(x->grad && gbad == 0);
    free(ones);
    /* a second call on the same graph draws a new mask */
    dt_graph_reset(g);
    dt_tensor *y4 = dt_dropout(g, dt_tensor_from(g, 1, s, xv), p);
    int diff = 0;
    if (y4)
      for (int i = 0; i < N; i++) diff += (y4->data[i] != 0.0f) != (y2->data[i] != 0.0f);
    CHECK(y4 && diff > 0);
  }
  /* identity when not training or p == 0 */
  dt_graph_reset(g);
  x = dt_tensor_from(g, 1, s, xv);
  dt_tensor *z = dt_dropout(g, x, 0.0f);
  CHECK(z && (z == x || memcmp(z->data, xv, N * sizeof(float)) == 0));
  dt_graph_set_training(g, 0);
  z = dt_dropout(g, x, 0.5f);
  CHECK(z && (z == x || memcmp(z->data, xv, N * sizeof(float)) == 0));
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  dt_graph_destroy(g);
  dt_graph_destroy(g2);
  dt_graph_destroy(g3);
  free(xv);
}

/* ---- layer norm ----------------------------------------------------------------------------- */

typedef struct { int gamma, beta; float eps; } ln_ctx;

static dt_tensor *f_ln(dt_graph *g, dt_tensor **in, void *ctx) {
  ln_ctx *c = (ln_ctx *)ctx;
  return dt_layer_norm(g, in[0], c->gamma ? in[1] : NULL, c->beta ? in[2] : NULL, c->eps);
}

static void test_layer_norm_grads(void) {
  static const int64_t shapes[][3] = {{4, 6, 1}, {2, 3, 5}};
  static const int nds[] = {2, 3};
  float x[64], ga[8], be[8];
  for (int s = 0; s < 2; s++) {
    int64_t d = shapes[s][nds[s] - 1];
    for (int variant = 0; variant < 3; variant++) {
      th_fill(x, numel(nds[s], shapes[s]), -2, 2);
      th_fill(ga, d, 0.5f, 1.5f);
      th_fill(be, d, -1, 1);
      ln_ctx c = {variant != 1, variant != 2, 1e-5f};
      th_input ins[3] = {th_in(x, nds[s], shapes[s], 1), th_in(ga, 1, &d, c.gamma), th_in(be, 1, &d, c.beta)};
      int bad = th_gradcheck("layer_norm", f_ln, &c, ins, 3);
      CHECK_MSG(bad == 0, "shape %d variant %d: %d mismatches", s, variant, bad);
    }
  }
}

static void test_layer_norm_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[8] = {1, 2, 3, 4, 10, 10, 10, 14}, gv[4] = {1, 2, 1, 1}, bv[4] = {0, 0, 5, 0};
  int64_t s[2] = {2, 4}, s4[1] = {4};
  dt_tensor *x = dt_tensor_from(g, 2, s, xv);
  dt_tensor *y = dt_layer_norm(g, x, NULL, NULL, 0.0f);
  CHECK(y != NULL);
  if (y) {
    double r = 1.0 / sqrt(1.25); /* row 0: mean 2.5, biased var 1.25 */
    CHECK_NEAR(y->data[0], -1.5 * r, 1e-5);
    CHECK_NEAR(y->data[3], 1.5 * r, 1e-5);
    double r1 = 1.0 / sqrt(3.0); /* row 1: mean 11, var (1+1+1+9)/4 = 3 */
    CHECK_NEAR(y->data[4], -1.0 * r1, 1e-5);
    CHECK_NEAR(y->data[7], 3.0 * r1, 1e-5);
  }
  dt_tensor *ga = dt_tensor_from(g, 1, s4, gv), *be = dt_tensor_from(g, 1, s4, bv);
  dt_tensor *z = dt_layer_norm(g, x, ga, be, 1e-5f);
  CHECK(z != NULL);
  if (z) {
    double r = 1.0 / sqrt(1.25 + 1e-5);
    CHECK_NEAR(z->data[1], -0.5 * r * 2, 1e-5);
    CHECK_NEAR(z->data[2], 0.5 * r + 5, 1e-5);
  }
  dt_graph_destroy(g);
}

/* ---- batch norm ------------------------------------------------------------------------------ */

typedef struct { int eval; float *rm, *rv; } bn_ctx;

static dt_tensor *f_bn(dt_graph *g, dt_tensor **in, void *ctx) {
  bn_ctx *c = (bn_ctx *)ctx;
  dt_tensor *rm = NULL, *rv = NULL;
  if (c->rm) {
    int64_t ch = in[1]->shape[0];
    rm = dt_tensor_from(g, 1, &ch, c->rm);
    rv = dt_tensor_from(g, 1, &ch, c->rv);
  }
  dt_graph_set_training(g, !c->eval);
  return dt_batch_norm(g, in[0], in[1], in[2], rm, rv, 0.1f, 1e-5f);
}

static void test_batch_norm_grads(void) {
  static const int64_t shapes[][4] = {{5, 3, 1, 1}, {2, 3, 2, 2}, {3, 2, 3, 2}};
  static const int nds[] = {2, 4, 4};
  float x[64], ga[4], be[4], rm[4], rv[4];
  for (int s = 0; s < 3; s++) {
    int64_t c = shapes[s][1];
    for (int mode = 0; mode < 3; mode++) { /* training, training + running stats, eval */
      th_fill(x, numel(nds[s], shapes[s]), -2, 2);
      th_fill(ga, c, 0.5f, 1.5f);
      th_fill(be, c, -1, 1);
      th_fill(rm, c, -0.5f, 0.5f);
      th_fill(rv, c, 0.5f, 2.0f);
      bn_ctx ctx = {mode == 2, mode ? rm : NULL, mode ? rv : NULL};
      th_input ins[3] = {th_in(x, nds[s], shapes[s], 1), th_in(ga, 1, &c, 1), th_in(be, 1, &c, 1)};
      int bad = th_gradcheck("batch_norm", f_bn, &ctx, ins, 3);
      CHECK_MSG(bad == 0, "shape %d mode %d: %d mismatches", s, mode, bad);
    }
  }
}

static void test_batch_norm_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  /* x [4,2]: channel 0 = 1,2,3,4 (mean 2.5, var 1.25, unbiased 5/3); channel 1 = 0,0,0,8 (mean 2, var 12, unbiased 16) */
  float xv[8] = {1, 0, 2, 0, 3, 0, 4, 8};
  float rmv[2] = {0, 1}, rvv[2] = {1, 2}, gv[2] = {2, 1}, bv[2] = {0, -1};
  int64_t s[2] = {4, 2}, s2[1] = {2};
  dt_tensor *x = dt_tensor_from(g, 2, s, xv);
  dt_tensor *rm = dt_tensor_from(g, 1, s2, rmv), *rv = dt_tensor_from(g, 1, s2, rvv);
  dt_tensor *ga = dt_tensor_from(g, 1, s2, gv), *be = dt_tensor_from(g, 1, s2, bv);
  dt_tensor *y = dt_batch_norm(g, x, ga, be, rm, rv, 0.1f, 0.0f);
  CHECK(y != NULL);
  if (y) {
    CHECK_NEAR(y->data[0], (1 - 2.5) / sqrt(1.25) * 2, 1e-5);
    CHECK_NEAR(y->data[6], (4 - 2.5) / sqrt(1.25) * 2, 1e-5);
    CHECK_NEAR(y->data[1], (0 - 2.0) / sqrt(12.0) - 1, 1e-5);
    CHECK_NEAR(y->data[7], (8 - 2.0) / sqrt(12.0) - 1, 1e-5);
  }
  CHECK_NEAR(rm->data[0], 0.9 * 0 + 0.1 * 2.5, 1e-6);
  CHECK_NEAR(rm->data[1], 0.9 * 1 + 0.1 * 2.0, 1e-6);
  CHECK_NEAR(rv->data[0], 0.9 * 1 + 0.1 * (5.0 / 3.0), 1e-6);
  CHECK_NEAR(rv->data[1], 0.9 * 2 + 0.1 * 16.0, 1e-6);
  /* eval mode: running statistics, nothing updated */
  float rm0 = rm->data[0], rv1 = rv->data[1];
  dt_graph_set_training(g, 0);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *z = dt_batch_norm(g, x, ga, be, rm, rv, 0.1f, 1e-3f);
  CHECK(z != NULL);
  if (z) {
    for (int n = 0; n < 4; n++)
      for (int c = 0; c < 2; c++)
        CHECK_NEAR(z->data[n * 2 + c], (xv[n * 2 + c] - rm->data[c]) / sqrt(rv->data[c] + 1e-3) * gv[c] + bv[c], 1e-5);
    float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK(dt_backward_grad(g, z, ones) == DTRAIN_OK);
    if (x->grad) {
      CHECK_NEAR(x->grad[2], gv[0] / sqrt(rv->data[0] + 1e-3), 1e-5);
      CHECK_NEAR(x->grad[3], gv[1] / sqrt(rv->data[1] + 1e-3), 1e-5);
    } else {
      CHECK(x->grad != NULL);
    }
  }
  CHECK(rm->data[0] == rm0 && rv->data[1] == rv1);
  dt_graph_reset(g);
  dt_graph_set_training(g, 1);
  /* 4-D [2,2,1,2]: channel 0 = {1,3, 5,7} (mean 4, unbiased var 20/3), channel 1 = {2,2, 2,2} */
  float x4[8] = {1, 3, 2, 2, 5, 7, 2, 2};
  int64_t s4[4] = {2, 2, 1, 2};
  float rz[2] = {0, 0}, ro[2] = {1, 1};
  dt_tensor *rm4 = dt_tensor_from(g, 1, s2, rz), *rv4 = dt_tensor_from(g, 1, s2, ro);
  dt_tensor *y4 = dt_batch_norm(g, dt_tensor_from(g, 4, s4, x4), NULL, NULL, rm4, rv4, 0.5f, 1e-5f);
  CHECK(y4 != NULL);
  if (y4) {
    CHECK_NEAR(y4->data[0], (1 - 4) / sqrt(5.0 + 1e-5), 1e-5);
    CHECK_NEAR(y4->data[2], 0.0, 1e-6);
  }
  CHECK_NEAR(rm4->data[0], 2.0, 1e-6);
  CHECK_NEAR(rm4->data[1], 1.0, 1e-6);
  CHECK_NEAR(rv4->data[0], 0.5 + 0.5 * 20.0 / 3.0, 1e-5);
  CHECK_NEAR(rv4->data[1], 0.5, 1e-6);
  dt_graph_destroy(g);
}

/* ---- causal mask ------------------------------------------------------------------------------ */

static dt_tensor *f_causal_softmax(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_softmax(g, dt_causal_mask(g, in[0]), -1);
}

static void test_causal_mask(void) {
  float x[2 * 3 * 4 * 4];
  int64_t s[4] = {2, 3, 4, 4};
  th_fill(x, 96, -2, 2);
  th_input in = th_in(x, 4, s, 1);
  CHECK(th_gradcheck("causal_mask+softmax", f_causal_softmax, NULL, &in, 1) == 0);
  int64_t s2[2] = {5, 5};
  th_input in2 = th_in(x, 2, s2, 1);
  CHECK(th_gradcheck("causal_mask+softmax 2-D", f_causal_softmax, NULL, &in2, 1) == 0);

  dt_graph_options d;
  memset(&d, 0, sizeof d);
  d.check_numerics = 1; /* the -inf entries are intended, not a numeric error */
  dt_graph *g = dt_graph_create(NULL, &d);
  dt_tensor *t = dt_tensor_from(g, 4, s, x);
  dt_tensor_set_requires_grad(t, 1);
  dt_tensor *m = dt_causal_mask(g, t);
  dt_tensor *p = dt_softmax(g, m, -1);
  CHECK(m && p);
  if (m && p) {
    for (int b = 0; b < 6; b++)
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
          int k = (b * 4 + i) * 4 + j;
          if (j > i) CHECK(isinf(m->data[k]) && m->data[k] < 0 && p->data[k] == 0.0f);
          else CHECK(m->data[k] == x[k]);
        }
    CHECK_NEAR(p->data[0], 1.0, 0); /* first row: only the diagonal */
    float *ones = (float *)malloc(96 * sizeof(float));
    for (int i = 0; i < 96; i++) ones[i] = (float)(i % 5);
    dt_graph_reset(g);
    t = dt_tensor_from(g, 4, s, x);
    dt_tensor_set_requires_grad(t, 1);
    m = dt_causal_mask(g, t);
    CHECK(m && dt_backward_grad(g, m, ones) == DTRAIN_OK);
    if (t->grad)
      for (int k = 0; k < 96; k++) CHECK(t->grad[k] == ((k % 4) > ((k / 4) % 4) ? 0.0f : ones[k]));
    free(ones);
  }
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  dt_graph_destroy(g);
}

/* ---- errors -------------------------------------------------------------------------------------- */

#define EXPECT_FAIL(g, expr, code, needle)                                                      \
  do {                                                                                          \
    dt_graph_reset(g);                                                                          \
    void *r_ = (void *)(expr);                                                                  \
    CHECK_MSG(r_ == NULL, "%s returned non-NULL", #expr);                                       \
    CHECK_MSG(dt_graph_error(g) == (code), "%s: code %s", #expr, dt_result_name(dt_graph_error(g))); \
    CHECK_MSG(strstr(dt_graph_message(g), (needle)) != NULL, "%s: message '%s' lacks '%s'", #expr, \
              dt_graph_message(g), (needle));                                                   \
  } while (0)

static void test_errors_labels_ids(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[2] = {3, 4}, s1[1] = {4};
  int32_t lab[3] = {0, 3, 4}, labn[3] = {1, -1, 0}, ok3[3] = {0, 1, 2};
  EXPECT_FAIL(g, dt_cross_entropy(g, dt_tensor_new(g, 2, s), lab), DTRAIN_ERR_INDEX,
              "dt_cross_entropy: label 4 of row 2 is out of range [0,4)");
  EXPECT_FAIL(g, dt_cross_entropy(g, dt_tensor_new(g, 2, s), labn), DTRAIN_ERR_INDEX, "label -1 of row 1");
  EXPECT_FAIL(g, dt_cross_entropy(g, dt_tensor_new(g, 2, s), NULL), DTRAIN_ERR_NULL_ARG, "dt_cross_entropy: labels is NULL");
  EXPECT_FAIL(g, dt_cross_entropy(g, NULL, ok3), DTRAIN_ERR_NULL_ARG, "dt_cross_entropy: tensor argument 1 is NULL");
  EXPECT_FAIL(g, dt_cross_entropy(g, dt_scalar(g, 1.0f), ok3), DTRAIN_ERR_RANK, "dt_cross_entropy: logits must have");
  /* embedding */
  int32_t ids[4] = {0, 2, 3, 1}, idn[2] = {0, -2};
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 2, s), ids, 4), DTRAIN_ERR_INDEX,
              "dt_embedding: id 3 at position 2 is out of range [0,3)");
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 2, s), idn, 2), DTRAIN_ERR_INDEX, "id -2 at position 1");
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 2, s), NULL, 2), DTRAIN_ERR_NULL_ARG, "dt_embedding: ids is NULL");
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 2, s), ids, 0), DTRAIN_ERR_EMPTY, "dt_embedding: n is 0");
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 2, s), ids, -3), DTRAIN_ERR_INVALID_ARG, "dt_embedding: n is -3");
  EXPECT_FAIL(g, dt_embedding(g, dt_tensor_new(g, 1, s1), ids, 1), DTRAIN_ERR_RANK, "dt_embedding: table must be 2-D [V,D], got [4]");
  EXPECT_FAIL(g, dt_embedding(g, NULL, ids, 1), DTRAIN_ERR_NULL_ARG, "dt_embedding: tensor argument 1 is NULL");
  /* sticky: a later op on the failed graph does nothing */
  CHECK(dt_softmax(g, dt_tensor_new(g, 2, s), 0) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  dt_graph_destroy(g);
}

static void test_errors_params(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[2] = {3, 4}, s3[3] = {2, 3, 4}, s4v[1] = {4}, s3v[1] = {3}, s5v[1] = {5}, s44[2] = {4, 1};
  /* dropout p */
  EXPECT_FAIL(g, dt_dropout(g, dt_tensor_new(g, 2, s), 1.0f), DTRAIN_ERR_INVALID_ARG, "dt_dropout: p is 1 (must be in [0,1))");
  EXPECT_FAIL(g, dt_dropout(g, dt_tensor_new(g, 2, s), -0.1f), DTRAIN_ERR_INVALID_ARG, "dt_dropout: p is -0.1");
  EXPECT_FAIL(g, dt_dropout(g, dt_tensor_new(g, 2, s), NAN), DTRAIN_ERR_INVALID_ARG, "dt_dropout: p is");
  dt_graph_set_training(g, 0); /* p is checked in eval mode too */
  EXPECT_FAIL(g, dt_dropout(g, dt_tensor_new(g, 2, s), 2.0f), DTRAIN_ERR_INVALID_ARG, "dt_dropout: p is 2");
  dt_graph_set_training(g, 1);
  EXPECT_FAIL(g, dt_dropout(g, NULL, 0.5f), DTRAIN_ERR_NULL_ARG, "dt_dropout: tensor argument 1 is NULL");
  /* softmax axis / rank */
  EXPECT_FAIL(g, dt_softmax(g, dt_tensor_new(g, 2, s), 2), DTRAIN_ERR_INDEX, "dt_softmax: axis 2 out of range for input [3,4]");
  EXPECT_FAIL(g, dt_log_softmax(g, dt_tensor_new(g, 2, s), -3), DTRAIN_ERR_INDEX, "dt_log_softmax: axis -3 out of range");
  EXPECT_FAIL(g, dt_softmax(g, dt_scalar(g, 1.0f), 0), DTRAIN_ERR_RANK, "dt_softmax: axis 0 out of range for input []");
  EXPECT_FAIL(g, dt_log_softmax(g, NULL, 0), DTRAIN_ERR_NULL_ARG, "dt_log_softmax: tensor argument 1 is NULL");
  /* mse */
  EXPECT_FAIL(g, dt_mse(g, dt_tensor_new(g, 2, s), dt_tensor_new(g, 2, s44)), DTRAIN_ERR_SHAPE,
              "dt_mse: shapes [3,4] and [4,1] differ");
  EXPECT_FAIL(g, dt_mse(g, dt_tensor_new(g, 2, s), NULL), DTRAIN_ERR_NULL_ARG, "dt_mse: tensor argument 2 is NULL");
  /* layer norm */
  EXPECT_FAIL(g, dt_layer_norm(g, dt_tensor_new(g, 3, s3), dt_tensor_new(g, 1, s3v), NULL, 1e-5f), DTRAIN_ERR_SHAPE,
              "dt_layer_norm: gamma has shape [3], expected [4] (last dim of input [2,3,4])");
  EXPECT_FAIL(g, dt_layer_norm(g, dt_tensor_new(g, 3, s3), dt_tensor_new(g, 1, s4v), dt_tensor_new(g, 2, s), 1e-5f),
              DTRAIN_ERR_SHAPE, "dt_layer_norm: beta has shape [3,4], expected [4]");
  EXPECT_FAIL(g, dt_layer_norm(g, dt_tensor_new(g, 3, s3), NULL, NULL, -1.0f), DTRAIN_ERR_INVALID_ARG,
              "dt_layer_norm: eps is -1");
  EXPECT_FAIL(g, dt_layer_norm(g, dt_scalar(g, 1.0f), NULL, NULL, 1e-5f), DTRAIN_ERR_RANK, "dt_layer_norm: input must have");
  EXPECT_FAIL(g, dt_layer_norm(g, NULL, NULL, NULL, 1e-5f), DTRAIN_ERR_NULL_ARG, "dt_layer_norm: tensor argument 1 is NULL");
  /* batch norm */
  dt_tensor *v3 = NULL;
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 3, s3), NULL, NULL, NULL, NULL, 0.1f, 1e-5f), DTRAIN_ERR_RANK,
              "dt_batch_norm: input must be [N,C] or [N,C,H,W], got [2,3,4]");
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 2, s), dt_tensor_new(g, 1, s3v), NULL, NULL, NULL, 0.1f, 1e-5f),
              DTRAIN_ERR_SHAPE, "dt_batch_norm: gamma has shape [3], expected [4] (channel dim 1 of input [3,4])");
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, dt_tensor_new(g, 1, s5v), NULL, NULL, 0.1f, 1e-5f),
              DTRAIN_ERR_SHAPE, "dt_batch_norm: beta has shape [5]");
  EXPECT_FAIL(g, (v3 = dt_tensor_new(g, 1, s4v),
                  dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, NULL, v3, dt_tensor_new(g, 1, s3v), 0.1f, 1e-5f)),
              DTRAIN_ERR_SHAPE, "dt_batch_norm: running_var has shape [3]");
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, NULL, dt_tensor_new(g, 1, s4v), NULL, 0.1f, 1e-5f),
              DTRAIN_ERR_INVALID_ARG, "running_mean and running_var must both be given or both be NULL");
  EXPECT_FAIL(g, (v3 = dt_tensor_new(g, 1, s4v),
                  dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, NULL, v3, v3, 1.5f, 1e-5f)),
              DTRAIN_ERR_INVALID_ARG, "dt_batch_norm: momentum is 1.5");
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, NULL, NULL, NULL, 0.1f, NAN), DTRAIN_ERR_INVALID_ARG,
              "dt_batch_norm: eps is");
  int64_t s14[2] = {1, 4};
  EXPECT_FAIL(g, dt_batch_norm(g, dt_tensor_new(g, 2, s14), NULL, NULL, NULL, NULL, 0.1f, 1e-5f), DTRAIN_ERR_INVALID_ARG,
              "dt_batch_norm: batch statistics need more than 1 value per channel (input [1,4])");
  EXPECT_FAIL(g, dt_batch_norm(g, NULL, NULL, NULL, NULL, NULL, 0.1f, 1e-5f), DTRAIN_ERR_NULL_ARG,
              "dt_batch_norm: tensor argument 1 is NULL");
  dt_graph_set_training(g, 0); /* eval with a negative running variance */
  float neg[4] = {1, 1, -2, 1};
  EXPECT_FAIL(g, (v3 = dt_tensor_from(g, 1, s4v, neg),
                  dt_batch_norm(g, dt_tensor_new(g, 2, s), NULL, NULL, dt_tensor_new(g, 1, s4v), v3, 0.1f, 1e-5f)),
              DTRAIN_ERR_INVALID_ARG, "dt_batch_norm: running_var[2] + eps is");
  /* eval with one value per channel is fine when running stats are given */
  dt_graph_reset(g);
  float one4[4] = {1, 2, 3, 4}, rv4[4] = {4, 4, 4, 4};
  dt_tensor *y1 = dt_batch_norm(g, dt_tensor_from(g, 2, s14, one4), NULL, NULL, dt_tensor_new(g, 1, s4v),
                                dt_tensor_from(g, 1, s4v, rv4), 0.1f, 0.0f);
  CHECK(y1 && y1->data[0] == 0.5f && y1->data[3] == 2.0f);
  dt_graph_set_training(g, 1);
  /* causal mask */
  EXPECT_FAIL(g, dt_causal_mask(g, dt_tensor_new(g, 1, s4v)), DTRAIN_ERR_RANK, "dt_causal_mask: input must be [...,T,T], got [4]");
  EXPECT_FAIL(g, dt_causal_mask(g, dt_tensor_new(g, 3, s3)), DTRAIN_ERR_SHAPE,
              "dt_causal_mask: last two dims must be equal [...,T,T], got [2,3,4]");
  EXPECT_FAIL(g, dt_causal_mask(g, NULL), DTRAIN_ERR_NULL_ARG, "dt_causal_mask: tensor argument 1 is NULL");
  dt_graph_destroy(g);
  /* NULL graph */
  CHECK(dt_softmax(NULL, NULL, 0) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_last_error(), "dt_softmax: graph is NULL") != NULL);
  CHECK(dt_cross_entropy(NULL, NULL, NULL) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_batch_norm(NULL, NULL, NULL, NULL, NULL, NULL, 0.1f, 1e-5f) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  /* a gamma from another graph */
  dt_graph *g1 = dt_graph_create(NULL, NULL), *g2 = dt_graph_create(NULL, NULL);
  EXPECT_FAIL(g1, dt_layer_norm(g1, dt_tensor_new(g1, 2, s), dt_tensor_new1(g2, 4), NULL, 1e-5f), DTRAIN_ERR_INVALID_ARG,
              "dt_layer_norm: gamma belongs to another graph");
  dt_graph_destroy(g1);
  dt_graph_destroy(g2);
}

/* dt_argmax_rows / dt_count_correct: ties to the first, NaN never wins, a
 * row of NaN gives 0, labels out of range refused naming the row. */
static void test_argmax_and_correct(void) {
  const float x[4 * 3] = {0.1f, 0.7f, 0.2f,   /* 1 */
                          5.0f, 5.0f, -1.0f,  /* 0: a tie goes to the first */
                          NAN, -3.0f, -2.0f,  /* 2: NaN never wins */
                          NAN, NAN, NAN};     /* 0 */
  int32_t am[4] = {-1, -1, -1, -1};
  CHECK(dt_argmax_rows(x, 4, 3, am) == DTRAIN_OK);
  CHECK(am[0] == 1 && am[1] == 0 && am[2] == 2 && am[3] == 0);
  const int32_t y[4] = {1, 1, 2, 0};
  CHECK(dt_count_correct(x, y, 4, 3) == 3);
  CHECK(dt_count_correct(x, y, 0, 3) == 0);
  const int32_t bad[2] = {1, 3};
  CHECK_ERR((dt_result)dt_count_correct(x, bad, 2, 3), DTRAIN_ERR_INVALID_ARG, "row 1");
  CHECK_ERR(dt_argmax_rows(NULL, 1, 3, am), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR(dt_argmax_rows(x, 1, 0, am), DTRAIN_ERR_INVALID_ARG, "columns");
  CHECK_ERR((dt_result)dt_count_correct(x, y, -1, 3), DTRAIN_ERR_INVALID_ARG, "rows");
  /* Against a hand count on random logits. */
  uint64_t s = 99;
  float big[200 * 10];
  int32_t lab[200];
  int64_t want = 0;
  for (int i = 0; i < 200; i++) {
    int best = 0;
    for (int c = 0; c < 10; c++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      big[i * 10 + c] = (float)((s >> 33) % 1000) / 100.0f;
      if (big[i * 10 + c] > big[i * 10 + best]) best = c;
    }
    lab[i] = (int32_t)((s >> 40) % 10);
    want += best == lab[i];
  }
  CHECK(dt_count_correct(big, lab, 200, 10) == want);
}

int main(void) {
  TH_RUN(test_softmax_values);
  TH_RUN(test_softmax_grads);
  TH_RUN(test_cross_entropy_values);
  TH_RUN(test_cross_entropy_grads);
  TH_RUN(test_mse);
  TH_RUN(test_embedding);
  TH_RUN(test_dropout_grad);
  TH_RUN(test_dropout_values);
  TH_RUN(test_layer_norm_values);
  TH_RUN(test_layer_norm_grads);
  TH_RUN(test_batch_norm_values);
  TH_RUN(test_batch_norm_grads);
  TH_RUN(test_causal_mask);
  TH_RUN(test_errors_labels_ids);
  TH_RUN(test_errors_params);
  TH_RUN(test_argmax_and_correct);
  return th_summary("ops_nn");
}
