/* tests/test_parallel_ckpt.c -- model-parallel checkpoints (dt_io.h:
 * dt_checkpoint_save_part, _gather, _split): a 2-stage pipeline (threads,
 * 1F1B, Adam) saves a part per stage; loading the parts into a freshly built
 * pipeline resumes bitwise; the gathered file loads into one_device (the
 * very values) and trains on within 1e-5 of the pipeline; splitting it again
 * for 2 stages resumes bitwise, for 3 stages (another layout) within 1e-5; a
 * plain one_device checkpoint splits into stages too. Tensor parallel (2
 * shards on threads): shards save with their split kinds, the gather equals
 * one_device's parameters, a split for 4 shards trains on like the 2. Hostile
 * parts: missing, doubled, from another step, corrupt, not a part, a
 * replicated tensor that differs, bad plans: each refused with its code and
 * no file written. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include "harness.h"
#include "mp_common.h"
#if !defined(DTRAIN_NO_THREADS)
#  include <pthread.h>
#endif

static char tmpdir[256];
static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }
#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_STDIO)
static int exists(const char *name) {
  char p[512];
  struct stat sb;
  path_of(p, sizeof p, name);
  return stat(p, &sb) == 0;
}

/* ---- the pipeline model: 4 linear layers w0 b0 .. w3 b3 ------------------------------ */
#define L 4
static const int dims[L + 1] = {6, 16, 16, 12, 3};
#define ROWS 480
#define B 24
#define K1 6 /* steps before the checkpoint */
#define K2 6 /* and after */
static float data_x[ROWS * 8];
static int32_t data_y[ROWS];

static void make_data(void) {
  lcg_fill(data_x, ROWS * 8, 4242);
  for (int r = 0; r < ROWS; r++) {
    float a = data_x[r * 8] + 0.5f * data_x[r * 8 + 1] - data_x[r * 8 + 4];
    data_y[r] = a > 0.3f ? 2 : a > -0.3f ? 1 : 0;
  }
}

/* Batch of step k with `cols` features per row (6: the pipeline, 8: the tensor-parallel MLP). */
static dt_minibatch batch_at(int k, int cols) {
  (void)cols; /* rows are 8 floats apart either way: x_cols is the stride */
  return batch_from(data_x, data_y, ROWS, B, 8, k);
}

static void add_layers(dt_params *p, int l0, int l1) {
  for (int l = l0; l < l1; l++) {
    char name[16];
    int64_t ws[2] = {dims[l + 1], dims[l]}, bs[1] = {dims[l + 1]};
    snprintf(name, sizeof name, "w%d", l);
    dt_params_add(p, name, 2, ws, dt_init_glorot_uniform());
    snprintf(name, sizeof name, "b%d", l);
    dt_params_add(p, name, 1, bs, dt_init_uniform(-0.1f, 0.1f));
  }
}

/* x: rows of 8 floats, the first 6 used (a strided view is not needed: copy). */
static dt_tensor *input6(dt_graph *g, const dt_minibatch *mb) {
  int64_t xs[2] = {mb->rows, 6};
  dt_tensor *x = dt_tensor_new(g, 2, xs);
  for (int64_t r = 0; x && r < mb->rows; r++) memcpy(x->data + r * 6, mb->x + r * 8, 6 * sizeof(float));
  return x;
}

static dt_tensor *run_layers(dt_graph *g, dt_tensor *x, int l0, int l1) {
  for (int l = l0; l < l1; l++) {
    x = dt_linear(g, x, dt_param(g, 2 * (l - l0)), dt_param(g, 2 * (l - l0) + 1));
    if (l < L - 1) x = dt_tanh(g, x);
  }
  return x;
}

static dt_tensor *full_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  (void)user;
  return dt_cross_entropy(g, run_layers(g, input6(g, b), 0, L), b->y);
}

typedef struct cut {
  int stages, first[L + 1];
} cut;

static dt_tensor *stage_fn(dt_graph *g, int stage, dt_tensor *x, const dt_minibatch *mb, void *user) {
  const cut *c = (const cut *)user;
  if (stage == 0) x = input6(g, mb);
  x = run_layers(g, x, c->first[stage], c->first[stage + 1]);
  return stage == c->stages - 1 ? dt_cross_entropy(g, x, mb->y) : x;
}

static dt_optim_options adam(void) {
  dt_optim_options o;
  memset(&o, 0, sizeof o);
  o.kind = DTRAIN_OPTIM_ADAM;
  o.lr = 0.01f;
  o.beta1 = 0.9f;
  o.beta2 = 0.999f;
  o.eps = 1e-8f;
  return o;
}



#define NFULL (16 * 6 + 16 + 16 * 16 + 16 + 12 * 16 + 12 + 3 * 12 + 3)

/* A pipeline of c->stages stages (seed: the params' init), stage s's part
 * loaded from parts[s] when parts; trains steps k0..k1-1, saves parts to
 * save[s] after step save_at - 1 when save; out: the stages' values packed. */
static void run_pipeline(const cut *c, uint64_t seed, char parts[][512], int k0, int k1, int save_at,
                         char save[][512], float *out) {
  dt_params *ps[4];
  for (int s = 0; s < c->stages; s++) {
    ps[s] = dt_params_create(seed + (uint64_t)s);
    add_layers(ps[s], c->first[s], c->first[s + 1]);
  }
  dt_pipeline_options po = dt_pipeline_defaults(c->stages, 4);
  po.schedule = DTRAIN_PIPE_1F1B;
  dt_optim_options oo = adam();
  dt_pipeline *pl = dt_pipeline_create(ps, &oo, stage_fn, (void *)(uintptr_t)c, &po);
  CHECK(pl != NULL);
  if (!pl) return;
  for (int s = 0; parts && s < c->stages; s++) {
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = ps[s];
    st.optim = dt_pipeline_optim(pl, s);
    CHECK_MSG(dt_checkpoint_load(parts[s], &st) == DTRAIN_OK, "load %s: %s", parts[s], dt_last_error());
    CHECK(st.step == k0);
  }
  for (int k = k0; k < k1; k++) {
    dt_minibatch b = batch_at(k, 6);
    CHECK(dt_pipeline_step(pl, &b, NULL) == DTRAIN_OK);
    for (int s = 0; save && k + 1 == save_at && s < c->stages; s++) {
      dt_train_state st;
      memset(&st, 0, sizeof st);
      st.params = ps[s];
      st.optim = dt_pipeline_optim(pl, s);
      st.data_index = (k + 1) * B;
      dt_part part;
      memset(&part, 0, sizeof part);
      part.stage = s;
      part.stages = c->stages;
      CHECK_MSG(dt_checkpoint_save_part(save[s], &st, &part) == DTRAIN_OK, "%s", dt_last_error());
    }
  }
  size_t off = 0;
  for (int s = 0; s < c->stages; s++) off += pack(ps[s], out + off);
  CHECK(off == NFULL);
  dt_pipeline_destroy(pl);
  for (int s = 0; s < c->stages; s++) dt_params_destroy(ps[s]);
}

/* one_device from the checkpoint `full` (when given) for steps k0..k1-1. */
static void run_one_device(const char *full, int k0, int k1, float *at_load, float *out) {
  dt_params *P = dt_params_create(31337);
  add_layers(P, 0, L);
  dt_optim_options oo = adam();
  dt_optim *opt = dt_optim_create(P, &oo);
  if (full) {
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = P;
    st.optim = opt;
    CHECK_MSG(dt_checkpoint_load(full, &st) == DTRAIN_OK, "load %s: %s", full, dt_last_error());
    CHECK(st.step == k0 && st.data_index == (int64_t)k0 * B);
    if (at_load) pack(P, at_load);
  }
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(P, opt, full_step, NULL, &sd);
  for (int k = k0; s && k < k1; k++) {
    dt_minibatch b = batch_at(k, 6);
    CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
  }
  pack(P, out);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

static const cut cut2 = {2, {0, 2, 4}}, cut3 = {3, {0, 1, 3, 4}};

static void test_pipeline_parts(void) {
  static float uninterrupted[NFULL], resumed[NFULL], at_save[NFULL], loaded[NFULL], other[NFULL];
  char parts[2][512], full[512], again[2][512], three[3][512], plain[512], plain_parts[2][512];
  path_of(parts[0], 512, "stage0.safetensors");
  path_of(parts[1], 512, "stage1.safetensors");
  path_of(full, 512, "full.safetensors");
  /* The run that saves at K1 and goes on; a run that stops at K1 (its values there). */
  run_pipeline(&cut2, 1, NULL, 0, K1 + K2, K1, parts, uninterrupted);
  run_pipeline(&cut2, 1, NULL, 0, K1, 0, NULL, at_save);
  /* Resume from the parts in a pipeline built from another seed: bitwise. */
  run_pipeline(&cut2, 777, parts, K1, K1 + K2, 0, NULL, resumed);
  CHECK_MSG(memcmp(resumed, uninterrupted, sizeof resumed) == 0, "resumed from parts: max rel %.3g",
            max_rel(resumed, uninterrupted, NFULL));
  /* Gather: one_device loads the very values, and trains on like the pipeline. */
  const char *pp[2] = {parts[1], parts[0]}; /* any order */
  CHECK_MSG(dt_checkpoint_gather(pp, 2, full) == DTRAIN_OK, "%s", dt_last_error());
  run_one_device(full, K1, K1 + K2, loaded, other);
  CHECK(memcmp(loaded, at_save, sizeof loaded) == 0);
  CHECK_MSG(max_rel(other, uninterrupted, NFULL) <= 1e-5, "one_device after the gather: %.3g",
            max_rel(other, uninterrupted, NFULL));
  /* Split for the same layout: the parts come back, and resume bitwise. */
  dt_split_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.stages = 2;
  for (int s = 0; s < 2; s++) {
    char nm[48];
    snprintf(nm, sizeof nm, "again%d.safetensors", s);
    path_of(again[s], 512, nm);
    CHECK_MSG(dt_checkpoint_split(full, &plan, s, 0, again[s]) == DTRAIN_OK, "%s", dt_last_error());
  }
  run_pipeline(&cut2, 99, again, K1, K1 + K2, 0, NULL, resumed);
  CHECK_MSG(memcmp(resumed, uninterrupted, sizeof resumed) == 0, "resumed from split parts: max rel %.3g",
            max_rel(resumed, uninterrupted, NFULL));
  /* Another layout: 3 stages {w0 b0} {w1 b1 w2 b2} {w3 b3}. */
  const char *starts3[2] = {"w1", "w3"};
  plan.stages = 3;
  plan.stage_starts = starts3;
  for (int s = 0; s < 3; s++) {
    char nm[48];
    snprintf(nm, sizeof nm, "three%d.safetensors", s);
    path_of(three[s], 512, nm);
    CHECK_MSG(dt_checkpoint_split(full, &plan, s, 0, three[s]) == DTRAIN_OK, "%s", dt_last_error());
  }
  run_pipeline(&cut3, 5, three, K1, K1 + K2, 0, NULL, resumed);
  CHECK_MSG(max_rel(resumed, uninterrupted, NFULL) <= 1e-5, "3 stages from 2: %.3g",
            max_rel(resumed, uninterrupted, NFULL));
  /* A one_device checkpoint (no part metadata) splits into stages too. */
  {
    dt_params *P = dt_params_create(3);
    add_layers(P, 0, L);
    dt_optim_options oo = adam();
    dt_optim *opt = dt_optim_create(P, &oo);
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = P;
    st.optim = opt;
    CHECK(dt_checkpoint_load(full, &st) == DTRAIN_OK);
    path_of(plain, 512, "plain.safetensors");
    CHECK(dt_checkpoint_save(plain, &st) == DTRAIN_OK);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    const char *starts2[1] = {"w2"};
    plan.stages = 2;
    plan.stage_starts = NULL;
    CHECK_ERR(dt_checkpoint_split(plain, &plan, 0, 0, parts[0]), DTRAIN_ERR_INVALID_ARG, "stage_starts");
    plan.stage_starts = starts2;
    for (int s = 0; s < 2; s++) {
      char nm[48];
      snprintf(nm, sizeof nm, "plain%d.safetensors", s);
      path_of(plain_parts[s], 512, nm);
      CHECK_MSG(dt_checkpoint_split(plain, &plan, s, 0, plain_parts[s]) == DTRAIN_OK, "%s", dt_last_error());
    }
    run_pipeline(&cut2, 8, plain_parts, K1, K1 + K2, 0, NULL, resumed);
    CHECK_MSG(max_rel(resumed, uninterrupted, NFULL) <= 1e-5, "2 stages from one_device's file: %.3g",
              max_rel(resumed, uninterrupted, NFULL));
  }
}

/* ---- tensor parallel: IN -> HID (column) -> tanh -> MID (row) -> OUT (column, gathered) -- */
#define IN 8
#define HID 16
#define MID 6
#define OUT 3
static const char *const tp_names[6] = {"w1", "b1", "w2", "b2", "w3", "b3"};
static const int64_t tp_shp[6][2] = {{HID, IN}, {HID, 1}, {MID, HID}, {MID, 1}, {OUT * 4, MID}, {OUT * 4, 1}};
static const int tp_nd[6] = {2, 1, 2, 1, 2, 1};
static const int tp_how[6] = {DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_COLS, DTRAIN_SPLIT_NONE,
                              DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_ROWS};
#define TP_N (HID * IN + HID + MID * HID + MID + OUT * 4 * MID + OUT * 4)

static dt_params *tp_params(int T, uint64_t seed) {
  dt_params *p = dt_params_create(seed);
  for (int i = 0; i < 6; i++) {
    int64_t s[2] = {tp_shp[i][0], tp_shp[i][1]};
    if (tp_how[i] == DTRAIN_SPLIT_ROWS) s[0] /= T;
    if (tp_how[i] == DTRAIN_SPLIT_COLS) s[1] /= T;
    dt_params_add(p, tp_names[i], tp_nd[i], s, tp_nd[i] == 2 ? dt_init_glorot_uniform() : dt_init_uniform(-0.2f, 0.2f));
  }
  return p;
}

static dt_tensor *tp_forward(dt_graph *g, const dt_minibatch *b, dt_comm *c, int rank) {
  int64_t xs[2] = {b->rows, IN};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)(uintptr_t)b->x);
  dt_tensor *h = dt_tanh(g, dt_tp_column_linear(g, x, dt_param(g, 0), dt_param(g, 1), c, rank, 0));
  dt_tensor *y = dt_tp_row_linear(g, h, dt_param(g, 2), dt_param(g, 3), c, rank);
  return dt_cross_entropy(g, dt_tp_column_linear(g, y, dt_param(g, 4), dt_param(g, 5), c, rank, 1), b->y);
}

static int rank_fail;
#define RK(cond)                                                                                   \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      __atomic_fetch_add(&rank_fail, 1, __ATOMIC_RELAXED);                                         \
      fprintf(stderr, "RANK FAIL %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond, dt_last_error()); \
    }                                                                                              \
  } while (0)

typedef struct tjob {
  dt_comm *c;
  int rank, T, k0, k1, save_at;
  const char *load, *save; /* part files (NULL: none) */
  float out[TP_N];         /* this rank's values packed */
} tjob;

static void *tp_rank(void *arg) {
  tjob *j = (tjob *)arg;
  memset(j->out, 0, sizeof j->out);
  dt_params *P = tp_params(j->T, 100 + (uint64_t)j->rank);
  dt_optim_options oo = adam();
  dt_optim *opt = dt_optim_create(P, &oo);
  dt_graph *g = dt_graph_create(P, NULL);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = P;
  st.optim = opt;
  if (j->load) RK(dt_checkpoint_load(j->load, &st) == DTRAIN_OK);
  if (!j->load) {
    /* Every rank starts from its slices of one whole model (seed 1). */
    dt_params *whole = tp_params(1, 1);
    for (int i = 0; i < 6; i++) {
      dt_param_info wi, si;
      dt_params_info(whole, i, &wi);
      dt_params_info(P, i, &si);
      const float *src = dt_params_data(whole) + wi.offset;
      float *dst = dt_params_data(P) + si.offset;
      if (tp_how[i] == DTRAIN_SPLIT_ROWS) dt_tp_shard_rows(src, tp_shp[i][0], tp_shp[i][1], j->T, j->rank, dst);
      else if (tp_how[i] == DTRAIN_SPLIT_COLS) dt_tp_shard_cols(src, tp_shp[i][0], tp_shp[i][1], j->T, j->rank, dst);
      else memcpy(dst, src, wi.size * sizeof(float));
    }
    dt_params_destroy(whole);
  }
  for (int k = j->k0; k < j->k1; k++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_minibatch b = batch_at(k, IN);
    dt_tensor *l = tp_forward(g, &b, j->c, j->rank);
    RK(l != NULL);
    if (!l) break;
    RK(dt_backward(g, l) == DTRAIN_OK);
    RK(dt_optim_step(opt) == DTRAIN_OK);
    if (j->save && k + 1 == j->save_at) {
      const char *names[5] = {"w1", "b1", "w2", "w3", "b3"};
      const int kinds[5] = {DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_COLS, DTRAIN_SPLIT_ROWS,
                            DTRAIN_SPLIT_ROWS};
      dt_part part;
      memset(&part, 0, sizeof part);
      part.shard = j->rank;
      part.shards = j->T;
      part.nsplit = 5;
      part.split_names = names;
      part.split_kinds = kinds;
      st.data_index = (k + 1) * B;
      RK(dt_checkpoint_save_part(j->save, &st, &part) == DTRAIN_OK);
    }
  }
  pack(P, j->out);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return NULL;
}

/* T ranks on threads; loads[r] / saves[r] per rank (NULL: none); outs[r] their values. */
static void tp_run(int T, int k0, int k1, int save_at, char loads[][512], char saves[][512], tjob *jobs) {
  dt_comm *c = dt_comm_create_threads(T, 0);
  CHECK(c != NULL);
  if (!c) return;
  pthread_t th[4];
  __atomic_store_n(&rank_fail, 0, __ATOMIC_RELAXED);
  for (int r = 0; r < T; r++) {
    jobs[r].c = c;
    jobs[r].rank = r;
    jobs[r].T = T;
    jobs[r].k0 = k0;
    jobs[r].k1 = k1;
    jobs[r].save_at = save_at;
    jobs[r].load = loads ? loads[r] : NULL;
    jobs[r].save = saves ? saves[r] : NULL;
    pthread_create(&th[r], NULL, tp_rank, &jobs[r]);
  }
  for (int r = 0; r < T; r++) pthread_join(th[r], NULL);
  CHECK_MSG(__atomic_load_n(&rank_fail, __ATOMIC_RELAXED) == 0, "T=%d: failed checks in the ranks", T);
  dt_comm_destroy(c);
}

/* The whole model's values from full (a one_device layout: tp_params(1)). */
static void load_whole(const char *full, float *out) {
  dt_params *P = tp_params(1, 9);
  dt_optim_options oo = adam();
  dt_optim *opt = dt_optim_create(P, &oo);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = P;
  st.optim = opt;
  CHECK_MSG(dt_checkpoint_load(full, &st) == DTRAIN_OK, "%s", dt_last_error());
  pack(P, out);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

static void test_tensor_parallel_parts(void) {
  static tjob a[4], b[4];
  static float whole2[TP_N], whole4[TP_N], whole_ref[TP_N];
  char parts[4][512], full[512], four[4][512], full4[512];
  for (int r = 0; r < 2; r++) {
    char nm[48];
    snprintf(nm, sizeof nm, "shard%d.safetensors", r);
    path_of(parts[r], 512, nm);
  }
  path_of(full, 512, "tp_full.safetensors");
  path_of(full4, 512, "tp_full4.safetensors");
  /* 2 shards: save at K1, go on to K1 + K2. */
  tp_run(2, 0, K1 + K2, K1, NULL, parts, a);
  const char *pp[2] = {parts[0], parts[1]};
  CHECK_MSG(dt_checkpoint_gather(pp, 2, full) == DTRAIN_OK, "%s", dt_last_error());
  /* The gathered model equals a one_device run of K1 steps (1 "shard"). */
  tp_run(1, 0, K1, 0, NULL, NULL, b);
  load_whole(full, whole2);
  CHECK_MSG(max_rel(whole2, b[0].out, TP_N) <= 1e-5, "gathered shards vs one_device: %.3g",
            max_rel(whole2, b[0].out, TP_N));
  /* Resume on 2 shards from the split file: bitwise. */
  dt_split_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.shards = 2;
  char again[2][512];
  for (int r = 0; r < 2; r++) {
    char nm[48];
    snprintf(nm, sizeof nm, "shard_again%d.safetensors", r);
    path_of(again[r], 512, nm);
    CHECK_MSG(dt_checkpoint_split(full, &plan, 0, r, again[r]) == DTRAIN_OK, "%s", dt_last_error());
  }
  tp_run(2, K1, K1 + K2, 0, again, NULL, b);
  for (int r = 0; r < 2; r++)
    CHECK_MSG(memcmp(b[r].out, a[r].out, sizeof a[r].out) == 0, "shard %d resumed: max rel %.3g", r,
              max_rel(b[r].out, a[r].out, TP_N));
  /* 4 shards from the 2-shard file (its "split" metadata says how): trains on like the 2. */
  plan.shards = 4;
  for (int r = 0; r < 4; r++) {
    char nm[48];
    snprintf(nm, sizeof nm, "four%d.safetensors", r);
    path_of(four[r], 512, nm);
    CHECK_MSG(dt_checkpoint_split(full, &plan, 0, r, four[r]) == DTRAIN_OK, "%s", dt_last_error());
  }
  tp_run(4, K1, K1 + K2, K1 + K2, four, four, b); /* and save again at the end */
  const char *p4[4] = {four[0], four[1], four[2], four[3]};
  CHECK_MSG(dt_checkpoint_gather(p4, 4, full4) == DTRAIN_OK, "%s", dt_last_error());
  load_whole(full4, whole4);
  /* The 2-shard run's values at the end, whole: gather its end state the same way. */
  tp_run(2, K1, K1 + K2, K1 + K2, again, again, b);
  const char *pa[2] = {again[0], again[1]};
  CHECK(dt_checkpoint_gather(pa, 2, full) == DTRAIN_OK);
  load_whole(full, whole_ref);
  CHECK_MSG(max_rel(whole4, whole_ref, TP_N) <= 1e-5, "4 shards from 2: %.3g", max_rel(whole4, whole_ref, TP_N));
  /* A size that does not divide: OUT * 4 = 12 rows into 8 shards. */
  plan.shards = 8;
  CHECK_ERR(dt_checkpoint_split(full, &plan, 0, 0, four[0]), DTRAIN_ERR_SHAPE, "w3");
}

/* ---- hostile parts --------------------------------------------------------------------- */
static void test_bad_parts(void) {
  char p0[512], p1[512], out[512], bad[512], tp0[512], tp1[512];
  path_of(p0, 512, "stage0.safetensors"); /* from test_pipeline_parts */
  path_of(p1, 512, "stage1.safetensors");
  path_of(out, 512, "never.safetensors");
  path_of(bad, 512, "bad.safetensors");
  path_of(tp0, 512, "shard0.safetensors");
  path_of(tp1, 512, "shard1.safetensors");
  const char *one[1] = {p0}, *twice[2] = {p0, p0}, *mixed[2] = {p0, tp1};
  CHECK_ERR(dt_checkpoint_gather(one, 1, out), DTRAIN_ERR_MISMATCH, "but 1 were given");
  CHECK_ERR(dt_checkpoint_gather(twice, 2, out), DTRAIN_ERR_MISMATCH, "both stage 0");
  CHECK_ERR(dt_checkpoint_gather(mixed, 2, out), DTRAIN_ERR_MISMATCH, "part of");
  CHECK_ERR(dt_checkpoint_gather(NULL, 2, out), DTRAIN_ERR_NULL_ARG, "parts");
  CHECK_ERR(dt_checkpoint_gather(one, 0, out), DTRAIN_ERR_INVALID_ARG, "0 parts");
  /* Not a part: a full file. */
  char full[512];
  path_of(full, 512, "full.safetensors");
  const char *notpart[2] = {full, p1};
  CHECK_ERR(dt_checkpoint_gather(notpart, 2, out), DTRAIN_ERR_FORMAT, "not a checkpoint part");
  dt_split_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.stages = 2;
  CHECK_ERR(dt_checkpoint_split(p0, &plan, 0, 0, out), DTRAIN_ERR_FORMAT, "gather the parts first");
  CHECK_ERR(dt_checkpoint_split(full, &plan, 2, 0, out), DTRAIN_ERR_INVALID_ARG, "stage 2 of 2");
  const char *no_such[1] = {"nope"};
  plan.stage_starts = no_such;
  CHECK_ERR(dt_checkpoint_split(full, &plan, 0, 0, out), DTRAIN_ERR_INVALID_ARG, "no such parameter");
  const char *first[1] = {"w0"};
  plan.stage_starts = first;
  CHECK_ERR(dt_checkpoint_split(full, &plan, 0, 0, out), DTRAIN_ERR_INVALID_ARG, "increasing");
  /* A part from another step: stage 1 saved again one step later. */
  {
    char later[2][512];
    path_of(later[0], 512, "later0.safetensors");
    path_of(later[1], 512, "later1.safetensors");
    static float sink[NFULL];
    run_pipeline(&cut2, 1, NULL, 0, K1 + 1, K1 + 1, later, sink);
    const char *steps[2] = {p0, later[1]};
    CHECK_ERR(dt_checkpoint_gather(steps, 2, out), DTRAIN_ERR_MISMATCH, "different runs or steps");
  }
  /* A corrupt part: one byte of its data flipped. */
  {
    FILE *f = fopen(p1, "rb"), *g = fopen(bad, "wb");
    CHECK(f && g);
    int ch;
    long pos = 0, size;
    if (f) {
      fseek(f, 0, SEEK_END);
      size = ftell(f);
      fseek(f, 0, SEEK_SET);
      while (g && (ch = fgetc(f)) != EOF) fputc(pos++ == size - 5 ? ch ^ 0x10 : ch, g);
      fclose(f);
    }
    if (g) fclose(g);
    const char *corrupt[2] = {p0, bad};
    CHECK_ERR(dt_checkpoint_gather(corrupt, 2, out), DTRAIN_ERR_CORRUPT, "bad.safetensors");
  }
  /* A replicated tensor (b2) that differs between the shards. A second run
   * saves the same values (training is deterministic): that gathers; then its
   * shard 1's b2 is changed and saved again: refused, naming b2. */
  {
    static tjob jobs[2];
    char other[2][512];
    path_of(other[0], 512, "other0.safetensors");
    path_of(other[1], 512, "other1.safetensors");
    tp_run(2, 0, K1, K1, NULL, other, jobs);
    const char *diff[2] = {tp0, other[1]};
    CHECK_MSG(dt_checkpoint_gather(diff, 2, out) == DTRAIN_OK, "%s", dt_last_error());
    remove(out);
    dt_train_state st;
    memset(&st, 0, sizeof st);
    dt_params *P = tp_params(2, 1);
    dt_optim_options oo = adam();
    dt_optim *opt = dt_optim_create(P, &oo);
    st.params = P;
    st.optim = opt;
    CHECK(dt_checkpoint_load(other[1], &st) == DTRAIN_OK);
    {
      dt_param_info in;
      dt_params_info(P, dt_params_find(P, "b2"), &in);
      dt_params_data(P)[in.offset] += 0.25f;
    }
    dt_part part;
    memset(&part, 0, sizeof part);
    const char *names[5] = {"w1", "b1", "w2", "w3", "b3"};
    const int kinds[5] = {DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_COLS, DTRAIN_SPLIT_ROWS,
                          DTRAIN_SPLIT_ROWS};
    part.shard = 1;
    part.shards = 2;
    part.nsplit = 5;
    part.split_names = names;
    part.split_kinds = kinds;
    CHECK(dt_checkpoint_save_part(other[1], &st, &part) == DTRAIN_OK);
    CHECK_ERR(dt_checkpoint_gather(diff, 2, out), DTRAIN_ERR_MISMATCH, "b2");
    /* Bad part descriptions are refused at save. */
    part.shard = 2;
    CHECK_ERR(dt_checkpoint_save_part(bad, &st, &part), DTRAIN_ERR_INVALID_ARG, "shard 2 of 2");
    part.shard = 0;
    const char *unknown[1] = {"nope"};
    part.nsplit = 1;
    part.split_names = unknown;
    CHECK_ERR(dt_checkpoint_save_part(bad, &st, &part), DTRAIN_ERR_MISMATCH, "nope");
    const char *dup[2] = {"w1", "w1"};
    const int k2[2] = {DTRAIN_SPLIT_ROWS, DTRAIN_SPLIT_ROWS};
    part.nsplit = 2;
    part.split_names = dup;
    part.split_kinds = k2;
    CHECK_ERR(dt_checkpoint_save_part(bad, &st, &part), DTRAIN_ERR_INVALID_ARG, "split twice");
    dt_optim_destroy(opt);
    dt_params_destroy(P);
  }
  CHECK_MSG(!exists("never.safetensors"), "a failed gather or split left its output");
}
#endif

/* In every build: NULL arguments (or, without stdio, any call) refused cleanly. */
static void test_args(void) {
  dt_split_plan plan;
  memset(&plan, 0, sizeof plan);
#if defined(DTRAIN_NO_STDIO)
  CHECK_ERR(dt_checkpoint_save_part("x", NULL, NULL), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
  CHECK_ERR(dt_checkpoint_gather(NULL, 0, "x"), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
  CHECK_ERR(dt_checkpoint_split("x", &plan, 0, 0, "y"), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
#else
  dt_part part;
  memset(&part, 0, sizeof part);
  CHECK_ERR(dt_checkpoint_save_part("x", NULL, &part), DTRAIN_ERR_NULL_ARG, "state");
  CHECK_ERR(dt_checkpoint_gather(NULL, 1, "x"), DTRAIN_ERR_NULL_ARG, "parts");
  CHECK_ERR(dt_checkpoint_split("x", NULL, 0, 0, "y"), DTRAIN_ERR_NULL_ARG, "plan");
  plan.shards = 2;
  CHECK_ERR(dt_checkpoint_split("x", &plan, 0, 2, "y"), DTRAIN_ERR_INVALID_ARG, "shard 2 of 2");
#endif
}

static void cleanup(void) {
  DIR *d = opendir(tmpdir);
  struct dirent *de;
  char p[600];
  if (!d) return;
  while ((de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", tmpdir, de->d_name);
    remove(p);
  }
  closedir(d);
  rmdir(tmpdir);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dtrain_pckpt_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  TH_RUN(test_args);
#if defined(DTRAIN_NO_STDIO)
  th_skip_item("test_parallel_ckpt", "no file I/O (DTRAIN_NO_STDIO)");
#elif !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
  make_data();
  TH_RUN(test_pipeline_parts);
  TH_RUN(test_tensor_parallel_parts);
  TH_RUN(test_bad_parts);
#else
  th_skip_item("test_parallel_ckpt", "threads or distribution not compiled in");
#endif
  if (!getenv("DTRAIN_TEST_KEEP")) cleanup();
  else fprintf(stderr, "kept %s\n", tmpdir);
  return th_summary("test_parallel_ckpt");
}
