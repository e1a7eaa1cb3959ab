/* tests/test_strategy_multi.c -- multi_worker_mirrored without sockets: each
 * "process" is a thread with its own model, optimizer and strategy, and the
 * cross-process communicator is a one-rank-per-process wrapper around a
 * shared in-process communicator (dt_comm_create_threads(W)) with a fixed
 * rank. Checks: W x 1 equals mirrored(W), 2 x 2 equals mirrored(4), uneven
 * local batches equal one_device on the concatenated batch, repeats are
 * bitwise, the initial broadcast makes differently initialised ranks equal,
 * batch-norm buffers follow rank 0, an injected communicator failure fails
 * the step on every rank with its message and changes no parameter, a local
 * failure on one rank fails the step everywhere, a different model on one
 * rank is refused at create, dt_params_hash, names. A watchdog fails the
 * program on a hang. */
/* The wrapper sets errors with the private dt__error: compile the library
 * into this test (all static, so it does not clash with build/dtrain.o). */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

static void watchdog_fired(int sig) {
  static const char msg[] = "FAIL watchdog: test_strategy_multi hung (deadlock?)\n";
  (void)sig;
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}
static void watchdog(unsigned seconds) {
  signal(SIGALRM, watchdog_fired);
  alarm(seconds);
}

/* Threads log concurrently: keep the logger quiet and thread-safe. */
static void quiet_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

/* ---- the one-rank-per-process wrapper ----------------------------------------------- */
#define MAXW 4

typedef struct wrap_shared {
  dt_comm *inner;     /* dt_comm_create_threads(W) */
  int64_t fail_at;    /* every rank's wrapper fails its call number fail_at (1-based; 0: never) */
  int sticky;         /* after that failure every call returns DTRAIN_ERR_ABORTED (like tcp) */
} wrap_shared;

typedef struct wrap {
  dt_comm comm;
  wrap_shared *sh;
  int64_t calls;
} wrap;

static wrap *wrap_of(dt_comm *c) { return (wrap *)c->impl; }

/* Nonzero when this call fails: DTRAIN_ERR_PEER (the injected failure,
 * with its message) or DTRAIN_ERR_ABORTED (sticky: broken since). */
static dt_result wrap_fails(dt_comm *c, const char *op) {
  wrap *w = wrap_of(c);
  w->calls++;
  if (w->sh->sticky && w->sh->fail_at > 0 && w->calls > w->sh->fail_at) return DTRAIN_ERR_ABORTED;
  if (w->sh->fail_at > 0 && w->calls == w->sh->fail_at) {
    return dt__error(DTRAIN_ERR_PEER, "wrap: %s #%lld: lost rank %d (injected)", op, (long long)w->calls,
                     (c->rank + 1) % c->world);
  }
  return DTRAIN_OK;
}

static dt_result wrap_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  if (rank != c->rank) return dt__error(DTRAIN_ERR_INDEX, "wrap: rank %d is not mine (%d)", rank, c->rank);
  dt_result f = wrap_fails(c, "allreduce");
  if (f != DTRAIN_OK) return f;
  return dt_comm_allreduce(wrap_of(c)->sh->inner, c->rank, buf, n);
}
static dt_result wrap_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  (void)rank;
  dt_result f = wrap_fails(c, "reduce_scatter");
  if (f != DTRAIN_OK) return f;
  return dt_comm_reduce_scatter(wrap_of(c)->sh->inner, c->rank, buf, n);
}
static dt_result wrap_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  (void)rank;
  dt_result f = wrap_fails(c, "allgather");
  if (f != DTRAIN_OK) return f;
  return dt_comm_allgather(wrap_of(c)->sh->inner, c->rank, buf, n);
}
static dt_result wrap_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  (void)rank;
  dt_result f = wrap_fails(c, "reduce");
  if (f != DTRAIN_OK) return f;
  return dt_comm_reduce(wrap_of(c)->sh->inner, c->rank, buf, n, root);
}
static dt_result wrap_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  (void)rank;
  dt_result f = wrap_fails(c, "broadcast");
  if (f != DTRAIN_OK) return f;
  return dt_comm_broadcast(wrap_of(c)->sh->inner, c->rank, buf, n, root);
}
static dt_result wrap_barrier(dt_comm *c, int rank) {
  (void)rank;
  dt_result f = wrap_fails(c, "barrier");
  if (f != DTRAIN_OK) return f;
  return dt_comm_barrier(wrap_of(c)->sh->inner, c->rank);
}
static void wrap_abort(dt_comm *c, int rank) { (void)rank; dt_comm_abort(wrap_of(c)->sh->inner, c->rank); }
static dt_result wrap_recover(dt_comm *c) { return dt_comm_recover(wrap_of(c)->sh->inner); }
static void wrap_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  dt_comm_stats_get(wrap_of(c)->sh->inner, c->rank, out);
}
static void wrap_reset_stats(dt_comm *c) { (void)c; }
static void wrap_destroy(dt_comm *c) { free(wrap_of(c)); }

static const dt_comm_vtable wrap_vtable = {
  "wrap", wrap_allreduce, wrap_reduce_scatter, wrap_allgather, wrap_reduce, wrap_broadcast, wrap_barrier,
  wrap_abort, wrap_recover, wrap_stats, wrap_reset_stats, wrap_destroy
};

static dt_comm *wrap_create(wrap_shared *sh, int rank, int world) {
  wrap *w = (wrap *)calloc(1, sizeof *w);
  if (!w) return NULL;
  w->sh = sh;
  w->comm.vtable = &wrap_vtable;
  w->comm.world = world;
  w->comm.rank = rank;
  w->comm.impl = w;
  return &w->comm;
}

/* ---- a fixed synthetic task (synth_task.h, as in test_strategy.c) ------------------------ */
#include "synth_task.h"
static void make_data(void) { make_data_seeded(99); }

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2, l3, reg;
  dt_nn_batch_norm bn;
  int use_bn;
  int nan_step;      /* replica 0 returns a NaN loss at this batch number (-1: never) */
} model;

static void model_init(model *m, uint64_t seed, int use_bn, int variant) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(seed);
  m->use_bn = use_bn;
  m->nan_step = -1;
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, variant ? 15 : 16, 1);
  if (use_bn) dt_nn_batch_norm_init(&m->bn, m->P, "bn", 16);
  dt_nn_linear_init(&m->l2, m->P, "l2", variant ? 15 : 16, 12, 1);
  dt_nn_linear_init(&m->l3, m->P, "l3", 12, NC, 1);
  dt_nn_linear_init(&m->reg, m->P, "reg", 12, 1, 1);
}

static dt_tensor *model_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  int64_t xs[2] = {b->rows, b->x_cols};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  dt_tensor *h = dt_nn_linear_forward(g, &m->l1, x);
  if (m->use_bn) h = dt_nn_batch_norm_forward(g, &m->bn, h);
  h = dt_tanh(g, h);
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  dt_tensor *ce = dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l3, h), b->y);
  int64_t ts[2] = {b->rows, 1};
  dt_tensor *t = dt_tensor_wrap(g, 2, ts, (float *)b->t);
  dt_tensor *loss = dt_add(g, ce, dt_mul_scalar(g, dt_mse(g, dt_nn_linear_forward(g, &m->reg, h), t), 0.1f));
  if (replica == 0 && b->step == m->nan_step) {
    m->nan_step = -1; /* once (a failed step keeps its number) */
    return dt_mul_scalar(g, loss, NAN);
  }
  return loss;
}

static dt_optim *make_opt(dt_params *P, dt_optim_kind kind, float lr, float clip) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = lr;
  d.momentum = 0.9f;
  d.clip_norm = clip;
  return dt_optim_create(P, &d);
}

/* Rows [first, first + rows) of the data set as a batch. */
static dt_minibatch rows_at(int64_t first, int64_t rows) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = rows;
  b.x = data_x + first * NF;
  b.x_cols = NF;
  b.y = data_y + first;
  b.y_cols = 1;
  b.t = data_t + first;
  b.t_cols = 1;
  return b;
}
/* Global batch k of B rows starts here. */
static int64_t batch_first(int64_t k, int64_t B) { return (k * B) % (NS - B); }

/* ---- one configuration -------------------------------------------------------------- */
#define PMAX 4096

typedef struct config {
  int W, N, K;
  int64_t B;
  int64_t split[MAXW];   /* rows of each rank's local batch (sum B); all 0: mirrored(W*N)'s split */
  dt_optim_kind opt;
  float lr, clip;
  dt_loss_reduction loss;
  int use_bn;
  int seeds_differ;      /* rank r's model is initialised with seed 5 + 100 r */
  int variant_rank;      /* this rank builds a different model (-1: none) */
  int nan_rank;          /* this rank's replica 0 returns NaN at step nan_step (-1: none) */
  int64_t nan_step;
  int64_t fail_at;       /* the wrapper fails this call number on every rank (0: never) */
  int sticky;            /* ... and every later call with DTRAIN_ERR_ABORTED */
} config;

typedef struct proc {
  const config *cf;
  int rank;
  dt_comm *comm;
  /* results */
  int created;
  dt_result create_rc;
  char create_msg[512];
  dt_result step_rc[64];
  char step_msg[64][512];
  float loss[64];
  float params[PMAX];
  float before_fail[PMAX]; /* the parameters before the first failing step */
  int fail_step;           /* the first failing step (-1: none) */
  int failed_unchanged;    /* that step changed no parameter */
  float replica_copy[PMAX];/* the last local replica's copy after the run */
  float grad[PMAX];
  size_t n;
} proc;

static void local_rows(const config *cf, int rank, int64_t *first, int64_t *rows) {
  int64_t off = 0;
  int custom = 0;
  for (int p = 0; p < cf->W; p++) custom |= cf->split[p] != 0;
  for (int p = 0; p < cf->W; p++) {
    int64_t rp;
    if (custom) {
      rp = cf->split[p];
    } else {
      /* the rows of mirrored(W*N)'s shards p*N .. p*N+N-1 */
      int R = cf->W * cf->N;
      int64_t base = cf->B / R, extra = cf->B % R;
      rp = 0;
      for (int r = p * cf->N; r < (p + 1) * cf->N; r++) rp += base + (r < extra ? 1 : 0);
    }
    if (p == rank) {
      *first = off;
      *rows = rp;
      return;
    }
    off += rp;
  }
}

static void *proc_main(void *arg) {
  proc *pr = (proc *)arg;
  const config *cf = pr->cf;
  model m;
  model_init(&m, cf->seeds_differ ? 5 + 100 * (uint64_t)pr->rank : 5, cf->use_bn, pr->rank == cf->variant_rank);
  if (pr->rank == cf->nan_rank) m.nan_step = cf->nan_step;
  dt_optim *opt = make_opt(m.P, cf->opt, cf->lr, cf->clip);
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(pr->comm, cf->N);
  sd.loss = cf->loss;
  sd.spin_us = -1;
  pr->fail_step = -1;
  pr->n = dt_params_size(m.P);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  pr->created = s != NULL;
  if (!s) {
    pr->create_rc = dt_last_result();
    snprintf(pr->create_msg, sizeof pr->create_msg, "%s", dt_last_error());
  }
  for (int k = 0; s && k < cf->K; k++) {
    int64_t first = 0, rows = 0;
    local_rows(cf, pr->rank, &first, &rows);
    dt_minibatch b = rows_at(batch_first(k, cf->B) + first, rows);
    float before[PMAX];
    memcpy(before, dt_params_data(m.P), pr->n * sizeof(float));
    pr->loss[k] = NAN;
    pr->step_rc[k] = dt_strategy_step(s, &b, &pr->loss[k]);
    if (pr->step_rc[k] != DTRAIN_OK) {
      snprintf(pr->step_msg[k], sizeof pr->step_msg[k], "%s", dt_last_error());
      if (pr->fail_step < 0) {
        pr->fail_step = k;
        memcpy(pr->before_fail, before, pr->n * sizeof(float));
        /* trainable parameters unchanged (batch-norm statistics excepted) */
        pr->failed_unchanged = 1;
        for (int i = 0; i < dt_params_count(m.P); i++) {
          dt_param_info info;
          dt_params_info(m.P, i, &info);
          if (info.trainable &&
              memcmp(before + info.offset, dt_params_data(m.P) + info.offset, info.size * sizeof(float)) != 0)
            pr->failed_unchanged = 0;
        }
      }
    }
  }
  memcpy(pr->params, dt_params_data(m.P), pr->n * sizeof(float));
  memcpy(pr->grad, dt_params_grad(m.P), pr->n * sizeof(float));
  if (s) {
    dt_graph *g = dt_strategy_graph(s, cf->N - 1);
    dt_graph_reset(g);
    memcpy(pr->replica_copy, dt_param(g, 0)->data, pr->n * sizeof(float));
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  return NULL;
}

static proc procs[MAXW];

/* Runs W "processes"; results in procs[]. */
static void run_multi(const config *cf) {
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR); /* TH_RUN installs the harness's, not thread-safe */
  wrap_shared sh;
  sh.inner = dt_comm_create_threads(cf->W, -1);
  sh.fail_at = cf->fail_at;
  sh.sticky = cf->sticky;
  pthread_t th[MAXW];
  for (int p = 0; p < cf->W; p++) {
    memset(&procs[p], 0, sizeof procs[p]);
    procs[p].cf = cf;
    procs[p].rank = p;
    procs[p].comm = wrap_create(&sh, p, cf->W);
  }
  for (int p = 0; p < cf->W; p++) pthread_create(&th[p], NULL, proc_main, &procs[p]);
  for (int p = 0; p < cf->W; p++) pthread_join(th[p], NULL);
  for (int p = 0; p < cf->W; p++) dt_comm_destroy(procs[p].comm);
  dt_comm_destroy(sh.inner);
}

/* A single-process reference: `sd` on the global batches. */
static void run_single(const config *cf, const dt_strategy_options *sd0, float *out, float *losses, float *grad) {
  model m;
  model_init(&m, 5, cf->use_bn, 0);
  dt_optim *opt = make_opt(m.P, cf->opt, cf->lr, cf->clip);
  dt_strategy_options sd = *sd0;
  sd.loss = cf->loss;
  sd.spin_us = -1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  for (int k = 0; s && k < cf->K; k++) {
    dt_minibatch b = rows_at(batch_first(k, cf->B), cf->B);
    CHECK(dt_strategy_step(s, &b, &losses[k]) == DTRAIN_OK);
  }
  memcpy(out, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
  if (grad) memcpy(grad, dt_params_grad(m.P), dt_params_size(m.P) * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static double rel_err(const float *a, const float *b, size_t n) {
  double d = 0.0, mx = 0.0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)a[i] - (double)b[i]);
    if (e > d || e != e) d = e;
    if (fabs((double)b[i]) > mx) mx = fabs((double)b[i]);
  }
  return mx > 0.0 ? d / mx : d;
}

static config base_config(int W, int N) {
  config cf;
  memset(&cf, 0, sizeof cf);
  cf.W = W;
  cf.N = N;
  cf.K = 8;
  cf.B = 30;
  cf.opt = DTRAIN_OPTIM_SGD;
  cf.lr = 0.05f;
  cf.variant_rank = -1;
  cf.nan_rank = -1;
  return cf;
}

/* Every rank ended with the same parameters, and the same loss at every step. */
static void check_ranks_agree(const config *cf) {
  for (int p = 0; p < cf->W; p++) {
    CHECK_MSG(procs[p].created, "rank %d: create failed: %s", p, procs[p].create_msg);
    for (int k = 0; k < cf->K; k++)
      CHECK_MSG(procs[p].step_rc[k] == DTRAIN_OK, "rank %d step %d: %s", p, k, procs[p].step_msg[k]);
    if (p == 0) continue;
    CHECK_MSG(memcmp(procs[p].params, procs[0].params, procs[0].n * sizeof(float)) == 0,
              "rank %d's parameters differ from rank 0's", p);
    CHECK_MSG(memcmp(procs[p].loss, procs[0].loss, (size_t)cf->K * sizeof(float)) == 0,
              "rank %d's losses differ from rank 0's", p);
  }
  /* the local replicas hold the same copy */
  for (int p = 0; p < cf->W; p++)
    CHECK_MSG(memcmp(procs[p].replica_copy, procs[p].params, procs[p].n * sizeof(float)) == 0,
              "rank %d: the last replica's copy differs", p);
}

static float ref[PMAX], ref_grad[PMAX], ref_loss[64], keep[PMAX];

/* W x N == mirrored(W*N) on the global batch (SGD, Adam, clipping, SUM). */
static void test_equals_mirrored(void) {
  watchdog(120);
  static const int shapes[4][2] = {{2, 1}, {2, 2}, {3, 1}, {1, 2}};
  for (int si = 0; si < 4; si++) {
    for (int v = 0; v < 4; v++) {
      config cf = base_config(shapes[si][0], shapes[si][1]);
      if (v == 1) { cf.opt = DTRAIN_OPTIM_ADAM; cf.lr = 0.01f; }
      if (v == 2) cf.clip = 0.3f;
      if (v == 3) { cf.loss = DTRAIN_LOSS_SUM; cf.lr = 0.01f; }
      if (v == 0) cf.B = 31; /* odd */
      dt_strategy_options md = dt_strategy_mirrored(cf.W * cf.N);
      run_single(&cf, &md, ref, ref_loss, ref_grad);
      run_multi(&cf);
      check_ranks_agree(&cf);
      size_t n = procs[0].n;
      double e = rel_err(procs[0].params, ref, n);
      CHECK_MSG(e <= 1e-5, "%d x %d variant %d vs mirrored(%d): relative error %g", cf.W, cf.N, v, cf.W * cf.N, e);
      for (int k = 0; k < cf.K; k++)
        CHECK_MSG(fabs((double)procs[0].loss[k] - (double)ref_loss[k]) <= 1e-5 * fabs((double)ref_loss[k]) + 1e-6,
                  "%d x %d variant %d step %d: loss %.9g vs %.9g", cf.W, cf.N, v, k, (double)procs[0].loss[k],
                  (double)ref_loss[k]);
      /* the params' grad: the reduced gradient of the last global batch */
      if (cf.clip == 0.0f && cf.loss == DTRAIN_LOSS_MEAN) {
        dt_strategy_options od = dt_strategy_one_device();
        float g1[PMAX], l1[64];
        run_single(&cf, &od, g1, l1, ref_grad);
        CHECK_MSG(rel_err(procs[0].grad, ref_grad, n) <= 1e-4, "%d x %d: grad buffer differs from one_device's: %g",
                  cf.W, cf.N, rel_err(procs[0].grad, ref_grad, n));
      }
    }
  }
  alarm(0);
}

/* A repeat is bitwise identical. */
static void test_repeats_bitwise(void) {
  watchdog(60);
  config cf = base_config(2, 2);
  cf.opt = DTRAIN_OPTIM_ADAM;
  cf.lr = 0.01f;
  run_multi(&cf);
  check_ranks_agree(&cf);
  memcpy(keep, procs[0].params, procs[0].n * sizeof(float));
  float l0[64];
  memcpy(l0, procs[0].loss, sizeof l0);
  run_multi(&cf);
  CHECK(memcmp(keep, procs[0].params, procs[0].n * sizeof(float)) == 0);
  CHECK(memcmp(l0, procs[0].loss, (size_t)cf.K * sizeof(float)) == 0);
  alarm(0);
}

/* Local batches of different sizes (one empty) == one_device on their concatenation. */
static void test_uneven_local_batches(void) {
  watchdog(60);
  static const int64_t splits[3][3] = {{5, 23, 0}, {0, 12, 9}, {28, 0, 0}};
  for (int si = 0; si < 3; si++) {
    for (int N = 1; N <= 2; N++) {
      config cf = base_config(si == 2 ? 2 : 3, N);
      if (si == 0) cf.W = 2;
      cf.B = 0;
      for (int p = 0; p < cf.W; p++) {
        cf.split[p] = splits[si][p];
        cf.B += splits[si][p];
      }
      dt_strategy_options od = dt_strategy_one_device();
      run_single(&cf, &od, ref, ref_loss, NULL);
      run_multi(&cf);
      check_ranks_agree(&cf);
      double e = rel_err(procs[0].params, ref, procs[0].n);
      CHECK_MSG(e <= 1e-5, "split %d N %d vs one_device: relative error %g", si, N, e);
      for (int k = 0; k < cf.K; k++)
        CHECK_MSG(fabs((double)procs[0].loss[k] - (double)ref_loss[k]) <= 1e-5 * fabs((double)ref_loss[k]) + 1e-6,
                  "split %d step %d: loss %.9g vs %.9g", si, k, (double)procs[0].loss[k], (double)ref_loss[k]);
    }
  }
  alarm(0);
}

/* Ranks initialised differently start from rank 0's values. */
static void test_initial_broadcast(void) {
  watchdog(60);
  config cf = base_config(2, 2);
  run_multi(&cf);
  check_ranks_agree(&cf);
  memcpy(keep, procs[0].params, procs[0].n * sizeof(float));
  cf.seeds_differ = 1;
  run_multi(&cf);
  check_ranks_agree(&cf);
  CHECK_MSG(memcmp(keep, procs[1].params, procs[0].n * sizeof(float)) == 0,
            "rank 1 initialised differently did not follow rank 0");
  /* K = 0: right after create, rank 1 holds rank 0's initial values */
  cf.K = 0;
  run_multi(&cf);
  CHECK(memcmp(procs[0].params, procs[1].params, procs[0].n * sizeof(float)) == 0);
  alarm(0);
}

/* Batch-norm statistics follow rank 0's replica 0: 2 x 2 equals mirrored(4). */
static void test_batch_norm_buffers(void) {
  watchdog(60);
  config cf = base_config(2, 2);
  cf.use_bn = 1;
  dt_strategy_options md = dt_strategy_mirrored(4);
  run_single(&cf, &md, ref, ref_loss, NULL);
  run_multi(&cf);
  check_ranks_agree(&cf);
  double e = rel_err(procs[0].params, ref, procs[0].n);
  CHECK_MSG(e <= 1e-5, "with batch norm: relative error %g against mirrored(4)", e);
  alarm(0);
}

/* mirrored(N) itself: after a step the statistics are replica 0's, i.e. what
 * one_device computes on shard 0 alone (a fix made with this test: they used
 * to be those of whichever replica owned their slice). */
static void test_mirrored_buffers_follow_replica0(void) {
  watchdog(60);
  config cf = base_config(1, 4);
  cf.use_bn = 1;
  cf.K = 1;
  cf.B = 64; /* shards of 16 */
  dt_strategy_options md = dt_strategy_mirrored(4);
  run_single(&cf, &md, ref, ref_loss, NULL);
  config c1 = cf;
  c1.B = 16; /* one_device on shard 0 (batch_first(0, B) is 0 for both) */
  dt_strategy_options od = dt_strategy_one_device();
  run_single(&c1, &od, keep, ref_loss, NULL);
  model m;
  model_init(&m, 5, 1, 0);
  dt_param_info mi, vi;
  dt_params_info(m.P, m.bn.mean, &mi);
  dt_params_info(m.P, m.bn.var, &vi);
  CHECK(memcmp(ref + mi.offset, keep + mi.offset, mi.size * sizeof(float)) == 0);
  CHECK(memcmp(ref + vi.offset, keep + vi.offset, vi.size * sizeof(float)) == 0);
  dt_params_destroy(m.P);
  alarm(0);
}

/* The wrapper fails call number c on every rank: every rank's step fails with
 * its message, no trainable parameter changes, and the next steps work. */
static void test_comm_failure(void) {
  watchdog(60);
  /* create makes 3 calls (hash broadcast, flag all-reduce, parameter
   * broadcast); each step 1: call 3 + 3 fails step 2 */
  for (int N = 1; N <= 2; N++) {
    config cf = base_config(2, N);
    cf.K = 5;
    cf.fail_at = 6;
    run_multi(&cf);
    for (int p = 0; p < cf.W; p++) {
      CHECK(procs[p].created);
      CHECK_MSG(procs[p].fail_step == 2, "rank %d: first failure at step %d", p, procs[p].fail_step);
      CHECK(procs[p].step_rc[2] == DTRAIN_ERR_PEER);
      CHECK_MSG(strstr(procs[p].step_msg[2], "allreduce #6: lost rank") != NULL, "rank %d: message '%s'", p,
                procs[p].step_msg[2]);
      CHECK_MSG(strstr(procs[p].step_msg[2], "dt_strategy_step") != NULL, "rank %d: message '%s'", p,
                procs[p].step_msg[2]);
      CHECK(procs[p].failed_unchanged);
      for (int k = 0; k < cf.K; k++)
        if (k != 2) CHECK_MSG(procs[p].step_rc[k] == DTRAIN_OK, "rank %d step %d: %s", p, k, procs[p].step_msg[k]);
    }
    CHECK(memcmp(procs[0].params, procs[1].params, procs[0].n * sizeof(float)) == 0);
    /* a communicator that stays broken (as tcp's does): the later steps fail
     * too, saying so, and the parameters stay those from before step 2 */
    cf.sticky = 1;
    run_multi(&cf);
    for (int p = 0; p < cf.W; p++) {
      CHECK(procs[p].fail_step == 2 && procs[p].step_rc[2] == DTRAIN_ERR_PEER && procs[p].failed_unchanged);
      for (int k = 3; k < cf.K; k++) {
        CHECK(procs[p].step_rc[k] == DTRAIN_ERR_ABORTED);
        CHECK_MSG(strstr(procs[p].step_msg[k], "broken by an earlier failure") != NULL, "'%s'", procs[p].step_msg[k]);
      }
      CHECK(memcmp(procs[p].params, procs[p].before_fail, procs[p].n * sizeof(float)) == 0);
    }
    cf.sticky = 0;
    /* a failure in create: every rank's create fails naming the broadcast */
    cf.fail_at = 3;
    run_multi(&cf);
    for (int p = 0; p < cf.W; p++) {
      CHECK(!procs[p].created && procs[p].create_rc == DTRAIN_ERR_PEER);
      CHECK_MSG(strstr(procs[p].create_msg, "initial broadcast") && strstr(procs[p].create_msg, "lost rank"),
                "create message '%s'", procs[p].create_msg);
    }
  }
  alarm(0);
}

/* A NaN loss on one rank's replica fails that step on every rank. */
static void test_local_failure(void) {
  watchdog(60);
  for (int N = 1; N <= 2; N++) {
    config cf = base_config(2, N);
    cf.K = 4;
    cf.nan_rank = 1;
    cf.nan_step = 1;
    run_multi(&cf);
    CHECK(procs[1].fail_step == 1 && procs[1].step_rc[1] == DTRAIN_ERR_NONFINITE);
    CHECK_MSG(strstr(procs[1].step_msg[1], "NaN") != NULL, "'%s'", procs[1].step_msg[1]);
    CHECK(procs[0].fail_step == 1 && procs[0].step_rc[1] == DTRAIN_ERR_PEER);
    CHECK_MSG(strstr(procs[0].step_msg[1], "rank 1 failed") != NULL, "'%s'", procs[0].step_msg[1]);
    for (int p = 0; p < 2; p++) {
      CHECK(procs[p].failed_unchanged);
      CHECK(procs[p].step_rc[2] == DTRAIN_OK && procs[p].step_rc[3] == DTRAIN_OK);
    }
    CHECK(memcmp(procs[0].params, procs[1].params, procs[0].n * sizeof(float)) == 0);
  }
  alarm(0);
}

/* A rank that built another model: every rank's create fails naming it. */
static void test_model_mismatch(void) {
  watchdog(60);
  config cf = base_config(3, 1);
  cf.variant_rank = 2;
  run_multi(&cf);
  for (int p = 0; p < 3; p++) {
    CHECK(!procs[p].created && procs[p].create_rc == DTRAIN_ERR_MISMATCH);
    CHECK_MSG(strstr(procs[p].create_msg, "rank 2 built a different model") != NULL, "'%s'", procs[p].create_msg);
  }
  alarm(0);
}

static void test_params_hash(void) {
  model a, b, c;
  model_init(&a, 1, 0, 0);
  model_init(&b, 2, 0, 0); /* other values, same layout */
  model_init(&c, 1, 0, 1); /* other shapes */
  CHECK(dt_params_hash(a.P) == dt_params_hash(b.P));
  CHECK(dt_params_hash(a.P) != dt_params_hash(c.P));
  uint64_t h = dt_params_hash(a.P);
  dt_params_data(a.P)[0] += 1.0f;
  CHECK(dt_params_hash(a.P) == h);
  int64_t sh[1] = {4};
  dt_params_add_buffer(a.P, "extra", 1, sh, dt_init_zeros());
  CHECK(dt_params_hash(a.P) != h);
  /* the trainable flag counts */
  dt_params_add(b.P, "extra", 1, sh, dt_init_zeros());
  CHECK(dt_params_hash(a.P) != dt_params_hash(b.P));
  CHECK(dt_params_hash(NULL) != 0);
  dt_params_destroy(a.P);
  dt_params_destroy(b.P);
  dt_params_destroy(c.P);
}

static void test_names_and_args(void) {
  dt_strategy_options d;
  /* this build has no DTRAIN_USE_MPI (tests/mpi_checks.sh covers the backend) */
  CHECK(dt_comm_create_mpi() == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "DTRAIN_USE_MPI"));
  CHECK(dt_strategy_parse("multi_worker_mirrored", 3, 0, &d) == DTRAIN_OK);
  CHECK(d.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && d.replicas == 3 && d.comm == NULL);
  CHECK(dt_strategy_parse("parameter_server", 2, 1, &d) == DTRAIN_OK && d.kind == DTRAIN_STRATEGY_PARAMETER_SERVER);
  CHECK(strcmp(dt_strategy_kind_name(DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED), "multi_worker_mirrored") == 0);
  CHECK(strcmp(dt_strategy_kind_name(DTRAIN_STRATEGY_PARAMETER_SERVER), "parameter_server") == 0);
  CHECK_ERR(dt_strategy_parse("mwm", 1, 0, &d), DTRAIN_ERR_INVALID_ARG, "multi_worker_mirrored");
  model m;
  model_init(&m, 1, 0, 0);
  dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.1f, 0.0f);
  if (!(dt_build_features() & DTRAIN_FEATURE_THREADS) || !(dt_build_features() & DTRAIN_FEATURE_DIST)) {
    /* like the other strategies but one_device: unsupported without threads or DTRAIN_NO_DIST */
    d = dt_strategy_multi_worker_mirrored(NULL, 1);
    CHECK(dt_strategy_create(m.P, opt, model_step, &m, &d) == NULL && dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
    return;
  }
  d = dt_strategy_multi_worker_mirrored(NULL, 1);
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &d) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_NULL_ARG && strstr(dt_last_error(), "desc.comm"));
  /* a communicator whose rank is outside its world */
  wrap_shared sh;
  sh.inner = NULL;
  sh.fail_at = 0;
  sh.sticky = 0;
  dt_comm *bad = wrap_create(&sh, 2, 2);
  d = dt_strategy_multi_worker_mirrored(bad, 1);
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &d) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG && strstr(dt_last_error(), "rank 2 of world 2"));
  dt_comm_destroy(bad);
  /* world 1: a single process works like mirrored(N) */
  sh.inner = dt_comm_create_threads(1, -1);
  dt_comm *one = wrap_create(&sh, 0, 1);
  d = dt_strategy_multi_worker_mirrored(one, 2);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &d);
  CHECK(s != NULL);
  dt_minibatch b = rows_at(0, 10);
  float L = NAN;
  CHECK(dt_strategy_step(s, &b, &L) == DTRAIN_OK && isfinite(L));
  CHECK(dt_strategy_sync(s) == DTRAIN_OK);
  dt_strategy_stats st;
  memset(&st, 0, sizeof st);
  CHECK(dt_strategy_stats_get(s, &st) == DTRAIN_OK && st.steps == 1 && st.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED);
  dt_strategy_destroy(s);
  dt_comm_destroy(one);
  dt_comm_destroy(sh.inner);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* ---- the in-process store's push made block by block (dt__pstore_push_blocks) ------------ */
#if !defined(DTRAIN_NO_DIST) /* the store is compiled out with it; two workers need threads (main) */
/* The fill: +1 everywhere; at the block starting at `inner_at` it first makes
 * worker 1 push +10 everywhere (a push that finishes during worker 0's sweep). */
typedef struct blocks_fill {
  dt_pstore *ps;
  size_t inner_at;
  int calls;
} blocks_fill;

static int blocks_fill_fn(void *user, size_t lo, size_t hi, float *d) {
  blocks_fill *f = (blocks_fill *)user;
  f->calls++;
  if (lo == f->inner_at) {
    size_t n = f->ps->size;
    float *ten = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) ten[i] = 10.0f;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    CHECK(dt_pstore_pull(f->ps, 1, 0, ten, n, &tk) == DTRAIN_OK);
    for (size_t i = 0; i < n; i++) ten[i] = 10.0f;
    CHECK(dt_pstore_push(f->ps, 1, 0, ten, n, &tk) == DTRAIN_OK);
    free(ten);
  }
  for (size_t i = 0; i < hi - lo; i++) d[i] = 1.0f;
  return 1;
}

/* The push copies the store into pull_into as it goes; the next pull into
 * that buffer copies nothing only when no other push finished since the
 * sweep began. Otherwise it copies: a push by another worker after the sweep,
 * or one that finished during it (its adds to the blocks already copied are
 * not in the copy), a pull into another buffer. */
static void test_push_blocks(void) {
  watchdog(60);
  enum { N = 5000 }; /* three blocks */
  static float store[N], mine[N];
  for (int scene = 0; scene < 4; scene++) {
    memset(store, 0, sizeof store);
    dt_pstore *ps = dt_pstore_create_local(store, N, 2, DTRAIN_STALENESS_UNBOUNDED, DTRAIN_ASYNC_HOGWILD, 0);
    CHECK(ps != NULL);
    if (!ps) continue;
    blocks_fill f;
    f.ps = ps;
    f.inner_at = scene == 2 ? 2048 * 2 : (size_t)-1; /* worker 0 starts at block 0: block 2 is its last */
    f.calls = 0;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    CHECK(dt_pstore_pull(ps, 0, 0, mine, N, &tk) == DTRAIN_OK);
    CHECK(dt__pstore_push_blocks(ps, 0, 0, blocks_fill_fn, NULL, &f, mine, &tk) == DTRAIN_OK);
    CHECK(f.calls == 3);
    if (scene == 1) { /* worker 1 pushes +10 after the sweep */
      float ten[N];
      for (int i = 0; i < N; i++) ten[i] = 10.0f;
      dt_pstore_ticket t1;
      memset(&t1, 0, sizeof t1);
      CHECK(dt_pstore_pull(ps, 1, 0, ten, N, &t1) == DTRAIN_OK);
      for (int i = 0; i < N; i++) ten[i] = 10.0f;
      CHECK(dt_pstore_push(ps, 1, 0, ten, N, &t1) == DTRAIN_OK);
    }
    float want = scene == 1 || scene == 2 ? 11.0f : 1.0f;
    float other[N];
    float *dst = scene == 3 ? other : mine; /* scene 3: another buffer */
    if (scene == 3) memset(other, 0, sizeof other);
    CHECK(dt_pstore_pull(ps, 0, 1, dst, N, &tk) == DTRAIN_OK);
    int bad = 0;
    for (int i = 0; i < N; i++) bad += dst[i] != want || store[i] != want;
    CHECK_MSG(bad == 0, "scene %d: %d elements of the pull differ from the store's %g", scene, bad, (double)want);
    dt_pstore_destroy(ps);
  }
  /* only a local store's */
  CHECK(dt__pstore_push_blocks(NULL, 0, 0, blocks_fill_fn, NULL, NULL, NULL, NULL) == DTRAIN_ERR_INTERNAL);
  alarm(0);
}

/* With a step function (a worker computing on the store itself): under the
 * Hogwild rule each block is updated in place by step, given the store's
 * own elements, and fill is not called; under the atomic rule fill's
 * differences are added as before and step is not called. A pull_into that
 * is the store, and a pull into the store, copy nothing. */
typedef struct blocks_step {
  float *store;
  int calls, bad_at;
} blocks_step;

static void blocks_step_fn(void *user, size_t lo, size_t hi, float *x) {
  blocks_step *b = (blocks_step *)user;
  b->calls++;
  if (x != b->store + lo) b->bad_at++;
  for (size_t i = 0; i < hi - lo; i++) x[i] = x[i] * 2.0f + 2.0f;
}

static int blocks_step_fill(void *user, size_t lo, size_t hi, float *d) {
  (void)user;
  for (size_t i = 0; i < hi - lo; i++) d[i] = (float)((lo + i) % 7);
  return 1;
}

static void test_push_blocks_in_place(void) {
  watchdog(60);
  enum { N = 5000 };
  static float store[N];
  for (int rule = 0; rule < 2; rule++) {
    for (int i = 0; i < N; i++) store[i] = (float)(i % 5);
    dt_pstore *ps = dt_pstore_create_local(store, N, 2, DTRAIN_STALENESS_UNBOUNDED,
                                           rule ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD, 0);
    CHECK(ps != NULL);
    if (!ps) continue;
    CHECK(dt__pstore_local_data(ps) == store);
    blocks_step b;
    b.store = store;
    b.calls = b.bad_at = 0;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    CHECK(dt_pstore_pull(ps, 0, 0, store, N, &tk) == DTRAIN_OK); /* into the store: nothing to copy */
    CHECK(dt__pstore_push_blocks(ps, 0, 0, blocks_step_fill, blocks_step_fn, &b, store, &tk) == DTRAIN_OK);
    CHECK_MSG(b.calls == (rule ? 0 : 3) && b.bad_at == 0, "rule %d: step called %d times (%d not on the store)",
              rule, b.calls, b.bad_at);
    CHECK(dt_pstore_pull(ps, 0, 1, store, N, &tk) == DTRAIN_OK);
    int bad = 0;
    for (int i = 0; i < N; i++) {
      float x = (float)(i % 5), want = rule ? x + (float)(i % 7) : x * 2.0f + 2.0f;
      bad += store[i] != want;
    }
    CHECK_MSG(bad == 0, "rule %d: %d elements differ", rule, bad);
    CHECK(dt_pstore_version(ps) == 1);
    dt_pstore_destroy(ps);
  }
  CHECK(dt__pstore_local_data(NULL) == NULL);
  alarm(0);
}
#endif /* DTRAIN_NO_DIST */

int main(void) {
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR);
  make_data();
  TH_RUN(test_params_hash);
  TH_RUN(test_names_and_args);
  unsigned f = dt_build_features();
  if (!(f & DTRAIN_FEATURE_THREADS) || !(f & DTRAIN_FEATURE_DIST)) {
    th_skip_item("multi-process tests", "%s",
                 (f & DTRAIN_FEATURE_THREADS) ? "compiled out (DTRAIN_NO_DIST)" : "built without threads");
    return th_summary("strategy_multi");
  }
#if !defined(DTRAIN_NO_DIST)
  TH_RUN(test_push_blocks);
  TH_RUN(test_push_blocks_in_place);
#endif
  TH_RUN(test_equals_mirrored);
  TH_RUN(test_repeats_bitwise);
  TH_RUN(test_uneven_local_batches);
  TH_RUN(test_initial_broadcast);
  TH_RUN(test_mirrored_buffers_follow_replica0);
  TH_RUN(test_batch_norm_buffers);
  TH_RUN(test_comm_failure);
  TH_RUN(test_local_failure);
  TH_RUN(test_model_mismatch);
  return th_summary("strategy_multi");
}
