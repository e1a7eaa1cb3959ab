/* tests/test_overlap.c -- desc.overlap in one process: mirrored's replicas
 * sum their gradients in buckets while backward goes on
 * (dt_strategy_overlap.c). Checked: bitwise the plain mirrored run for 2-4
 * replicas and any bucket size (each parameter its own, odd sizes, one
 * bucket), SGD with momentum and Adam with clipping, batch-norm buffers, a
 * parameter the loss never uses; every replica's copy stays equal to the
 * params. A failure on any replica (a shape error, a NaN loss, a NaN
 * gradient found by the overlap thread's scan, a replica's own scan or the
 * update's check) fails the step alike, changes nothing, and the run goes on
 * equal to a plain run that met the same failures; skip_nonfinite skips
 * alike. The options' checks. (Across processes: test_mwm_tcp.c.) */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if defined(DTRAIN_NO_DIST) || defined(DTRAIN_NO_THREADS)
static dt_tensor *no_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)g, (void)replica, (void)b, (void)user;
  return NULL;
}

/* mirrored with overlap is refused by name, not run half-way */
static void test_unavailable(void) {
  dt_params *P = dt_params_create(1);
  int64_t shape[1] = {4};
  dt_params_add(P, "w", 1, shape, dt_init_zeros());
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.1f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  sd.overlap = 1;
  CHECK(dt_strategy_create(P, opt, no_step, NULL, &sd) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  th_skip_item("test_overlap", "mirrored needs threads and the distributed kinds");
  TH_RUN(test_unavailable);
  return th_summary("overlap");
}
#else

#  define K 7
#  define PMAX 4096
#  define RMAX 4
#  include "synth_task.h"

static void quiet_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level, (void)code, (void)msg, (void)user;
}

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2, l3, reg;
  dt_nn_batch_norm bn;
  int use_bn;
  int spare;             /* a trained parameter the loss never uses */
  int fail_replica;      /* inject a failure on this replica ... */
  int64_t fail_step;     /* ... at this step (read and cleared by that replica only) */
  int fail_kind;         /* 0: a shape error, 1: NaN loss, 2: NaN gradient of l1.w (sqrt at 0, times 0) */
} model;

static void model_init(model *m, int use_bn) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(5);
  m->use_bn = use_bn;
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 16, 1);
  if (use_bn) dt_nn_batch_norm_init(&m->bn, m->P, "bn", 16);
  int64_t ss[1] = {5};
  m->spare = dt_params_add(m->P, "spare", 1, ss, dt_init_zeros());
  dt_nn_linear_init(&m->l2, m->P, "l2", 16, 12, 1);
  dt_nn_linear_init(&m->l3, m->P, "l3", 12, NC, 1);
  dt_nn_linear_init(&m->reg, m->P, "reg", 12, 1, 1);
  m->fail_replica = -1;
  m->fail_step = -1;
}

static dt_tensor *model_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  int64_t xs[2] = {b->rows, NF};
  dt_tensor *h = dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x));
  if (m->use_bn) h = dt_nn_batch_norm_forward(g, &m->bn, h);
  h = dt_tanh(g, h);
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  dt_tensor *ce = dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l3, h), b->y);
  int64_t ts[2] = {b->rows, 1};
  dt_tensor *t = dt_tensor_wrap(g, 2, ts, (float *)b->t);
  dt_tensor *loss = dt_add(g, ce, dt_mul_scalar(g, dt_mse(g, dt_nn_linear_forward(g, &m->reg, h), t), 0.1f));
  if (replica == m->fail_replica && b->step == m->fail_step) { /* once (a failed step keeps its number) */
    m->fail_step = -1;
    if (m->fail_kind == 0) return dt_matmul(g, t, t); /* [r,1] @ [r,1]: a shape error */
    if (m->fail_kind == 1) return dt_mul_scalar(g, loss, NAN);
    dt_tensor *z = dt_mul_scalar(g, dt_sum(g, dt_param(g, m->l1.w)), 0.0f);
    return dt_add(g, loss, dt_sqrt(g, z)); /* finite loss, infinite gradient */
  }
  return loss;
}

/* Adam with clipping, or SGD with momentum */
static dt_optim *make_opt(dt_params *P, int adam) {
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = adam ? DTRAIN_OPTIM_ADAM : DTRAIN_OPTIM_SGD;
  od.lr = adam ? 0.01f : 0.05f;
  od.momentum = adam ? 0.0f : 0.9f;
  od.clip_norm = adam ? 0.5f : 0.0f;
  return dt_optim_create(P, &od);
}

typedef struct cfg {
  int replicas;
  size_t bucket;         /* 0: the default */
  int adam;              /* Adam with clipping, else SGD with momentum */
  int use_bn;
  int check_numerics, skip_nonfinite;
  int fail_replica, fail_kind; /* at step 3 (-1: none) */
} cfg;

/* One run of K steps: params after each step, each step's result and loss. */
typedef struct trace {
  float p[K][PMAX];
  dt_result rc[K];
  float loss[K];
  int copies_equal;      /* every replica's copy equalled the params after every step */
  int buckets, nparams;
  size_t n;
} trace;

static trace tr[2];

static void run_one(const cfg *c, int overlap, trace *out) {
  memset(out, 0, sizeof *out);
  model m;
  model_init(&m, c->use_bn);
  dt_optim *opt = make_opt(m.P, c->adam);
  dt_strategy_options sd = dt_strategy_mirrored(c->replicas);
  sd.spin_us = -1;
  sd.overlap = overlap;
  sd.bucket_bytes = c->bucket;
  sd.check_numerics = c->check_numerics;
  sd.skip_nonfinite = c->skip_nonfinite;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK_MSG(s != NULL, "create: %s", dt_last_error());
  out->n = dt_params_size(m.P);
  out->nparams = dt_params_count(m.P);
  out->copies_equal = 1;
  if (s) {
    out->buckets = dt__overlap_buckets(s->ov);
    m.fail_replica = c->fail_replica;
    m.fail_kind = c->fail_kind;
    m.fail_step = 3;
    for (int k = 0; k < K; k++) {
      dt_minibatch b = batch_at(k, 13 * c->replicas + 1); /* uneven shards */
      out->rc[k] = dt_strategy_step(s, &b, &out->loss[k]);
      memcpy(out->p[k], dt_params_data(m.P), out->n * sizeof(float));
      for (int r = 1; r < c->replicas; r++) {
        dt_graph *g = dt_strategy_graph(s, r);
        dt_graph_reset(g);
        out->copies_equal &= memcmp(dt_param(g, 0)->data, dt_params_data(m.P), out->n * sizeof(float)) == 0;
      }
    }
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* Both runs; 1 when they agree bit for bit at every step. */
static int compare(const cfg *c, const char *what) {
  run_one(c, 0, &tr[0]);
  run_one(c, 1, &tr[1]);
  int same = tr[0].n == tr[1].n && tr[1].copies_equal && tr[0].copies_equal;
  for (int k = 0; k < K; k++) {
    int step_same = tr[0].rc[k] == tr[1].rc[k] && memcmp(tr[0].p[k], tr[1].p[k], tr[0].n * sizeof(float)) == 0 &&
                    (memcmp(&tr[0].loss[k], &tr[1].loss[k], sizeof(float)) == 0 ||
                     (tr[0].loss[k] != tr[0].loss[k] && tr[1].loss[k] != tr[1].loss[k]));
    CHECK_MSG(step_same, "%s (replicas %d bucket %zu): step %d differs: plain %s loss %.9g, overlap %s loss %.9g", what,
              c->replicas, c->bucket, k, dt_result_name(tr[0].rc[k]), (double)tr[0].loss[k],
              dt_result_name(tr[1].rc[k]), (double)tr[1].loss[k]);
    same &= step_same;
  }
  CHECK_MSG(tr[1].copies_equal, "%s: a replica's copy differs from the params", what);
  if (getenv("DTRAIN_TEST_VERBOSE"))
    fprintf(stderr, "%s: replicas %d bucket %zu: %d buckets, bitwise %s\n", what, c->replicas, c->bucket,
            tr[1].buckets, same ? "yes" : "NO");
  return same;
}

static void test_bitwise_the_plain_path(void) {
  alarm(120);
  const size_t buckets[4] = {4, 100, 64, 0};
  for (int R = 2; R <= RMAX; R++)
    for (int i = 0; i < 4; i++) {
      cfg c;
      memset(&c, 0, sizeof c);
      c.replicas = R;
      c.bucket = buckets[i];
      c.adam = (R + i) % 2;
      c.use_bn = R == 3;
      c.check_numerics = buckets[i] == 64;
      c.fail_replica = -1;
      compare(&c, "train");
      /* one float per bucket: each parameter (buffers too) its own; the default: one */
      if (buckets[i] == 4) CHECK(tr[1].buckets == tr[1].nparams);
      if (buckets[i] == 0) CHECK(tr[1].buckets == 1);
      CHECK(tr[1].buckets >= 1 && tr[1].buckets <= tr[1].nparams);
      for (int k = 0; k < K; k++) CHECK(tr[1].rc[k] == DTRAIN_OK);
      /* training moved the parameters */
      CHECK(memcmp(tr[1].p[0], tr[1].p[K - 1], tr[1].n * sizeof(float)) != 0);
    }
  alarm(0);
}

static void test_failures_alike(void) {
  alarm(180);
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR);
  for (int fr = 0; fr < 2; fr++)
    for (int fk = 0; fk < 3; fk++)
      for (int cn = 0; cn < 2; cn++)
        for (int skip = 0; skip < 2; skip++) {
          cfg c;
          memset(&c, 0, sizeof c);
          c.replicas = 3;
          c.bucket = 100;
          c.check_numerics = cn;
          c.skip_nonfinite = skip;
          c.fail_replica = fr ? 2 : 0;
          c.fail_kind = fk;
          char what[96];
          snprintf(what, sizeof what, "fail replica %d kind %d numerics %d skip %d", c.fail_replica, fk, cn, skip);
          compare(&c, what);
          dt_result want = fk == 0 ? DTRAIN_ERR_SHAPE : skip ? DTRAIN_OK : DTRAIN_ERR_NONFINITE;
          CHECK_MSG(tr[1].rc[3] == want, "%s: step 3 gave %s, want %s", what, dt_result_name(tr[1].rc[3]),
                    dt_result_name(want));
          /* the failed or skipped step changed nothing; the next ones train */
          CHECK(memcmp(tr[1].p[2], tr[1].p[3], tr[1].n * sizeof(float)) == 0);
          CHECK(tr[1].rc[4] == DTRAIN_OK && memcmp(tr[1].p[3], tr[1].p[4], tr[1].n * sizeof(float)) != 0);
        }
  dt_set_logger(NULL, NULL, DTRAIN_LOG_WARN);
  alarm(0);
}

/* the overlap thread's own scan names the parameter, as the plain path does */
static void test_thread_scan_message(void) {
  alarm(60);
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR);
  model m;
  model_init(&m, 0);
  dt_optim *opt = make_opt(m.P, 0);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  sd.overlap = 1;
  sd.bucket_bytes = 4;
  sd.check_numerics = 1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  if (s) {
    m.fail_replica = 0;
    m.fail_kind = 2;
    m.fail_step = 0;
    dt_minibatch b = batch_at(0, 20);
    CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_ERR_NONFINITE);
    CHECK_MSG(strstr(dt_last_error(), "replica 0: step 0: gradient of 'l1.weight' is NaN") != NULL, "message: %s",
              dt_last_error());
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  dt_set_logger(NULL, NULL, DTRAIN_LOG_WARN);
  alarm(0);
}

static void test_options(void) {
  model m;
  model_init(&m, 0);
  dt_optim *opt = make_opt(m.P, 0);
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR);
  /* kinds without a gradient sum */
  dt_strategy_options bad[3] = {dt_strategy_one_device(), dt_strategy_async(2, -1), dt_strategy_central_storage(2)};
  for (int i = 0; i < 3; i++) {
    bad[i].overlap = 1;
    CHECK(dt_strategy_create(m.P, opt, model_step, &m, &bad[i]) == NULL);
    CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "overlap") != NULL);
  }
  /* backup workers sum the first gradients to arrive, known only after backward */
  dt_strategy_options bw = dt_strategy_mirrored(3);
  bw.overlap = 1;
  bw.backup_workers = 1;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &bw) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "backup workers") != NULL);
  /* compression across processes: top-k and PowerSGD need the whole gradient (16-bit buckets
   * are test_mwm_tcp's) */
  dt_comm *x = dt_comm_create_threads(1, 0);
  CHECK(x != NULL);
  const char *whole[2] = {"topk:0.1", "powersgd:2"};
  for (int i = 0; x && i < 2; i++) {
    dt_strategy_options mw = dt_strategy_multi_worker_mirrored(x, 2);
    mw.overlap = 1;
    CHECK(dt_compress_parse(whole[i], &mw.compress) == DTRAIN_OK);
    CHECK(dt_strategy_create(m.P, opt, model_step, &m, &mw) == NULL);
    CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "before backward ends"), "%s",
              dt_last_error());
  }
  dt_comm_destroy(x);
  dt_set_logger(NULL, NULL, DTRAIN_LOG_WARN);
  /* one replica: nothing to sum, no thread; it trains as without */
  dt_strategy_options one = dt_strategy_mirrored(1);
  one.overlap = 1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &one);
  CHECK(s != NULL && s->ov == NULL);
  dt_minibatch b = batch_at(0, 20);
  CHECK(s && dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

int main(void) {
  make_data_seeded(31);
  TH_RUN(test_bitwise_the_plain_path);
  TH_RUN(test_failures_alike);
  TH_RUN(test_thread_scan_message);
  TH_RUN(test_options);
  return th_summary("overlap");
}
#endif
