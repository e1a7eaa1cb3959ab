/* Data-parallel strategies: the communicator's collectives, mirrored /
 * central_storage equal to one_device, async lock-step equal to a
 * synchronous step, async convergence on logistic regression, the
 * staleness bound under stress, failures returned on every replica without
 * a deadlock (a watchdog alarm fails the program on a hang), statistics.
 * Only the main thread runs CHECKs; worker threads record into atomics. */
#include "harness.h"
#include <float.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

/* ---- watchdog: a hang fails the program ------------------------------------------ */
static void watchdog_fired(int sig) {
  static const char msg[] = "FAIL watchdog: test_strategy hung (deadlock?)\n";
  (void)sig;
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}
/* seconds is what a section needs on a loaded native machine; the cross lanes
 * run it under qemu beside three other lanes on two cores (a section there has
 * taken over 120 s), so the alarm allows four times that: still a hang
 * detector, and the runner's 600 s limit stays the outer one. */
static void watchdog(unsigned seconds) {
  signal(SIGALRM, watchdog_fired);
  alarm(seconds * 4);
}

/* Replica threads log errors concurrently: keep the last one under a lock
 * (the harness logger writes a shared buffer without one). */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_last[512];
static void quiet_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)user;
  pthread_mutex_lock(&log_mu);
  snprintf(log_last, sizeof log_last, "%s %s", dt_result_name(code), msg);
  pthread_mutex_unlock(&log_mu);
}
static void quiet(void) { dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR); }

/* ---- a fixed synthetic task (synth_task.h) ---------------------------------------------- */
#include "synth_task.h"
static void make_data(void) { make_data_seeded(99); }

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2, l3, reg;
  int fail_replica;      /* inject an error on this replica ... */
  int64_t fail_step;     /* ... at this batch number (-1: never) */
  int fail_kind;         /* 0: a shape error, 1: NaN loss, 2: Inf gradient (sqrt at 0) */
  int fail_from;         /* fail at every batch number >= fail_step */
  float sleep_max;       /* seconds of random sleep per step (stress) */
} model;

static void model_init(model *m, uint64_t seed) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 16, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 16, 12, 1);
  dt_nn_linear_init(&m->l3, m->P, "l3", 12, NC, 1);
  dt_nn_linear_init(&m->reg, m->P, "reg", 12, 1, 1);
  m->fail_replica = -1;
  m->fail_step = -1;
}

static dt_optim *make_opt(dt_params *P, dt_optim_kind kind, float lr, float momentum, float clip) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = lr;
  d.momentum = momentum;
  d.clip_norm = clip;
  return dt_optim_create(P, &d);
}

/* A thread-safe pseudo-random number in [0, 1) from a key. */
static double hash01(uint64_t k) {
  k += 0x9e3779b97f4a7c15ULL;
  k = (k ^ (k >> 30)) * 0xbf58476d1ce4e5b9ULL;
  k = (k ^ (k >> 27)) * 0x94d049bb133111ebULL;
  k ^= k >> 31;
  return (double)(k >> 11) / 9007199254740992.0;
}

/* The user's step: classification + regression, mean over the shard. */
static dt_tensor *model_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  int64_t xs[2];
  xs[0] = b->rows;
  xs[1] = b->x_cols;
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, x));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  dt_tensor *ce = dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l3, h), b->y);
  int64_t ts[2];
  ts[0] = b->rows;
  ts[1] = 1;
  dt_tensor *t = dt_tensor_wrap(g, 2, ts, (float *)b->t);
  dt_tensor *loss = dt_add(g, ce, dt_mul_scalar(g, dt_mse(g, dt_nn_linear_forward(g, &m->reg, h), t), 0.1f));
  if (replica == m->fail_replica && (b->step == m->fail_step || (m->fail_from && b->step >= m->fail_step))) {
    if (m->fail_kind == 0) return dt_matmul(g, t, t); /* [r,1] @ [r,1]: a shape error */
    if (m->fail_kind == 1) return dt_mul_scalar(g, loss, NAN);
    /* finite loss, infinite gradient: d sqrt(u)/du at u = 0 */
    dt_tensor *w = dt_param(g, m->l1.w);
    dt_tensor *z = dt_mul_scalar(g, dt_sum(g, w), 0.0f);
    return dt_add(g, loss, dt_sqrt(g, z));
  }
  if (m->sleep_max > 0.0f) dt_sleep((double)m->sleep_max * hash01((uint64_t)replica * 7919u + (uint64_t)b->step));
  return loss;
}


static double rel_err(const float *a, const float *b, size_t n) {
  double d = 0.0, m = 0.0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)a[i] - (double)b[i]);
    if (e > d || e != e) d = e;
    if (fabs((double)b[i]) > m) m = fabs((double)b[i]);
  }
  return m > 0.0 ? d / m : d;
}

/* Train a fresh model K steps with `sd` and global batch B; copies the
 * final parameters into out (dt_params_size floats). Returns the last loss. */
static float train_with(const dt_strategy_options *sd, dt_optim_kind kind, float lr, float mom, float clip, int K,
                        int64_t B, float *out, size_t *n) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, kind, lr, mom, clip);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, sd);
  float loss = NAN;
  if (s) {
    for (int k = 0; k < K; k++) {
      dt_minibatch b = batch_at(k, B);
      if (dt_strategy_step(s, &b, &loss) != DTRAIN_OK) {
        fprintf(stderr, "step failed: %s\n", dt_last_error());
        loss = NAN;
        break;
      }
    }
  } else {
    fprintf(stderr, "create failed: %s\n", dt_last_error());
  }
  *n = dt_params_size(m.P);
  memcpy(out, dt_params_data(m.P), *n * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  return loss;
}

/* The same training written by hand, as in the README (no strategy). */
static void train_by_hand(dt_optim_kind kind, float lr, float mom, float clip, int K, int64_t B, float *out) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, kind, lr, mom, clip);
  dt_graph *g = dt_graph_create(m.P, NULL);
  for (int k = 0; k < K; k++) {
    dt_minibatch b = batch_at(k, B);
    b.step = k;
    dt_graph_reset(g);
    dt_params_zero_grad(m.P);
    dt_tensor *L = model_step(g, 0, &b, &m);
    if (dt_backward(g, L) != DTRAIN_OK) break;
    dt_optim_step(opt);
  }
  memcpy(out, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

#define PMAX 4096
static float ref[PMAX], got[PMAX], got2[PMAX];

/* ---- communicator ------------------------------------------------------------------ */

static void test_comm_slices(void) {
  const size_t ns[] = {0, 1, 15, 16, 17, 100, 1000, 4099, 65536};
  for (int w = 1; w <= 7; w++)
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
      size_t n = ns[k], prev = 0, maxs = 0, mins = (size_t)-1;
      for (int r = 0; r < w; r++) {
        size_t b, e;
        dt_comm_slice(n, w, r, &b, &e);
        CHECK_MSG(b == prev && e >= b && e <= n, "n=%zu w=%d r=%d [%zu,%zu)", n, w, r, b, e);
        CHECK(b % 16 == 0);
        if (e - b > maxs) maxs = e - b;
        if (e - b < mins) mins = e - b;
        prev = e;
      }
      CHECK_MSG(prev == n, "slices of n=%zu over %d cover %zu", n, w, prev);
      CHECK_MSG(maxs - mins <= 16, "n=%zu w=%d unbalanced %zu..%zu", n, w, mins, maxs);
    }
  size_t b = 7, e = 7;
  dt_comm_slice(10, 2, 5, &b, &e);
  CHECK(b == 0 && e == 0);
}

typedef struct comm_job {
  dt_comm *c;
  int rank, world;
  size_t n;
  float *buf;
  int op;            /* 0 allreduce, 1 reduce_scatter, 2 allgather, 3 reduce, 4 broadcast, 5 barrier */
  int root;
  int reps;
  dt_result rc;
  int finite;        /* op 6: dt__comm_reduce_scatter_finite's answer */
  size_t poison;     /* op 6: this rank's buf[poison] becomes NaN (n or more: none) */
  int handoff;       /* op 6: the cache hand-off (two ranks: the slice of the sum into the other's buffer too) */
  float poison_val;
} comm_job;

static float comm_val(int rank, size_t i) { return (float)((int)((i * 7 + (size_t)rank * 13) % 31) - 15) * 0.37f; }

static void *comm_thread(void *arg) {
  comm_job *j = (comm_job *)arg;
  j->rc = DTRAIN_OK;
  for (int rep = 0; rep < j->reps && j->rc == DTRAIN_OK; rep++) {
    for (size_t i = 0; i < j->n; i++) j->buf[i] = comm_val(j->rank, i + (size_t)rep);
    if (j->op == 6 && j->poison < j->n) j->buf[j->poison] = j->poison_val;
    switch (j->op) {
      case 6: j->rc = dt__comm_reduce_scatter_finite(j->c, j->rank, j->buf, j->n, &j->finite, j->handoff); break;
      case 0: j->rc = dt_comm_allreduce(j->c, j->rank, j->buf, j->n); break;
      case 1: j->rc = dt_comm_reduce_scatter(j->c, j->rank, j->buf, j->n); break;
      case 2: j->rc = dt_comm_allgather(j->c, j->rank, j->buf, j->n); break;
      case 3: j->rc = dt_comm_reduce(j->c, j->rank, j->buf, j->n, j->root); break;
      case 4: j->rc = dt_comm_broadcast(j->c, j->rank, j->buf, j->n, j->root); break;
      default: j->rc = dt_comm_barrier(j->c, j->rank); break;
    }
  }
  return NULL;
}

/* Runs op on `world` threads; fills bufs. Returns the number of failed ranks. */
static int comm_run(dt_comm *c, int world, size_t n, int op, int root, int reps, float **bufs, dt_result *rcs) {
  pthread_t th[8];
  comm_job jobs[8];
  for (int r = 0; r < world; r++) {
    jobs[r].c = c; jobs[r].rank = r; jobs[r].world = world; jobs[r].n = n; jobs[r].buf = bufs[r];
    jobs[r].op = op; jobs[r].root = root; jobs[r].reps = reps;
    pthread_create(&th[r], NULL, comm_thread, &jobs[r]);
  }
  int bad = 0;
  for (int r = 0; r < world; r++) {
    pthread_join(th[r], NULL);
    if (rcs) rcs[r] = jobs[r].rc;
    bad += jobs[r].rc != DTRAIN_OK;
  }
  return bad;
}

static void test_comm_collectives(void) {
  const size_t ns[] = {0, 1, 17, 1000, 4099, 70000};
  float *bufs[8];
  for (int r = 0; r < 8; r++) bufs[r] = (float *)malloc(70000 * sizeof(float));
  for (int world = 1; world <= 5; world++) {
    dt_comm *c = dt_comm_create_threads(world, 0);
    CHECK(c != NULL);
    if (!c) continue;
    CHECK(dt_comm_world(c) == world && strcmp(dt_comm_name(c), "threads") == 0);
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
      size_t n = ns[k];
      for (int op = 0; op <= 5; op++) {
        int root = world - 1;
        int reps = 3;
        CHECK_MSG(comm_run(c, world, n, op, root, reps, bufs, NULL) == 0, "op %d world %d n %zu", op, world, n);
        int rep = reps - 1, errs = 0;
        for (int r = 0; r < world; r++) {
          for (size_t i = 0; i < n; i++) {
            float sum = comm_val(0, i + (size_t)rep); /* rank order, as documented */
            for (int q = 1; q < world; q++) sum += comm_val(q, i + (size_t)rep);
            size_t sb, se, ob, oe;
            dt_comm_slice(n, world, r, &sb, &se);
            float want = bufs[r][i];
            int owner = 0;
            for (int q = 0; q < world; q++) {
              dt_comm_slice(n, world, q, &ob, &oe);
              if (i >= ob && i < oe) owner = q;
            }
            switch (op) {
              case 0: want = sum; break;
              case 1: if (i >= sb && i < se) want = sum; break;
              case 2: want = comm_val(owner, i + (size_t)rep); break;
              case 3: want = r == root ? sum : comm_val(r, i + (size_t)rep); break;
              case 4: want = comm_val(root, i + (size_t)rep); break;
              default: want = comm_val(r, i + (size_t)rep); break;
            }
            if (memcmp(&want, &bufs[r][i], sizeof(float)) != 0) errs++;
          }
        }
        CHECK_MSG(errs == 0, "op %d world %d n %zu: %d wrong values", op, world, n, errs);
      }
    }
    dt_comm_stats st;
    CHECK(dt_comm_stats_get(c, 0, &st) == DTRAIN_OK);
    CHECK(st.calls == (int64_t)(6 * 6 * 3));
    dt_comm_reset_stats(c);
    CHECK(dt_comm_stats_get(c, 0, &st) == DTRAIN_OK && st.calls == 0);
    dt_comm_destroy(c);
  }
  for (int r = 0; r < 8; r++) free(bufs[r]);
}

/* dt__comm_reduce_scatter_finite (a mirrored step's sum and its check of
 * every element, with no barrier of its own): the same sums as
 * dt_comm_reduce_scatter, and every rank told "finite" exactly when no rank's
 * slice of the sum has an infinite or NaN element, wherever the bad value is
 * (any rank's buffer, any rank's slice, first or last element), for NaN, Inf
 * and a sum that overflows, on 1 to 5 ranks. */
static void test_comm_reduce_scatter_finite(void) {
  watchdog(120);
  enum { NMAX = 4099 };
  const size_t ns[] = {0, 1, 17, 1000, NMAX};
  float *bufs[5], *want[5];
  for (int r = 0; r < 5; r++) {
    bufs[r] = (float *)malloc(NMAX * sizeof(float));
    want[r] = (float *)malloc(NMAX * sizeof(float));
  }
  int wrong = 0, cases = 0;
  for (int world = 1; world <= 5; world++) {
    dt_comm *c = dt_comm_create_threads(world, 0);
    CHECK(c != NULL);
    if (!c) continue;
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
      size_t n = ns[k];
      /* the plain collective's sums */
      CHECK(comm_run(c, world, n, 1, 0, 1, want, NULL) == 0);
      /* where: none, or the first / last element of each rank's slice, in one rank's buffer */
      for (int ho = 0; ho < 2; ho++)
      for (int where = -1; where < 2 * world; where++) {
        size_t sb, se;
        dt_comm_slice(n, world, where < 0 ? 0 : where / 2, &sb, &se);
        if (where >= 0 && sb == se) continue;
        size_t at = where < 0 ? n : where % 2 == 0 ? sb : se - 1;
        for (int kind = 0; kind < (where < 0 ? 1 : 3); kind++) {
          int holder = where < 0 ? 0 : (where + kind) % world; /* whose buffer holds it */
          pthread_t th[5];
          comm_job jobs[5];
          for (int r = 0; r < world; r++) {
            memset(&jobs[r], 0, sizeof jobs[r]);
            jobs[r].c = c; jobs[r].rank = r; jobs[r].world = world; jobs[r].n = n; jobs[r].buf = bufs[r];
            jobs[r].op = 6; jobs[r].reps = 1; jobs[r].finite = -1; jobs[r].handoff = ho;
            /* kind 2: FLT_MAX in every rank's buffer, a sum that overflows (one rank: Inf itself) */
            jobs[r].poison = r == holder || (kind == 2 && world > 1) ? at : n;
            jobs[r].poison_val = kind == 0 ? NAN : kind == 1 || world == 1 ? INFINITY : FLT_MAX;
            pthread_create(&th[r], NULL, comm_thread, &jobs[r]);
          }
          for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
          int expect = where < 0; /* finite only without the bad value */
          for (int r = 0; r < world; r++) {
            wrong += jobs[r].rc != DTRAIN_OK || jobs[r].finite != expect;
            size_t b, e;
            dt_comm_slice(n, world, r, &b, &e);
            if (where < 0) wrong += memcmp(bufs[r] + b, want[r] + b, (e - b) * sizeof(float)) != 0;
            /* the hand-off: rank r's slice of the sum in the other rank's buffer too */
            if (where < 0 && ho && world == 2)
              wrong += memcmp(bufs[1 - r] + b, want[r] + b, (e - b) * sizeof(float)) != 0;
          }
          cases++;
        }
      }
    }
    dt_comm_destroy(c);
  }
  CHECK_MSG(wrong == 0, "%d wrong answers or sums in %d reduce-scatter-with-check cases", wrong, cases);
  for (int r = 0; r < 5; r++) {
    free(bufs[r]);
    free(want[r]);
  }
  alarm(0);
}

typedef struct abort_job {
  dt_comm *c;
  int rank;
  dt_result rc;
} abort_job;

static void *abort_thread(void *arg) {
  abort_job *j = (abort_job *)arg;
  float x[4] = {1, 2, 3, 4};
  if (j->rank == 2) {
    dt_sleep(0.02); /* the others are waiting by now */
    dt_comm_abort(j->c, j->rank);
    j->rc = DTRAIN_ERR_ABORTED;
  } else {
    j->rc = dt_comm_allreduce(j->c, j->rank, x, 4);
  }
  return NULL;
}

static int mismatch_mode;
static void *mismatch_thread(void *arg) {
  abort_job *j = (abort_job *)arg;
  float x[8] = {0};
  if (mismatch_mode == 0) j->rc = dt_comm_allreduce(j->c, j->rank, x, j->rank == 0 ? 8 : 4);
  else if (j->rank == 0) j->rc = dt_comm_barrier(j->c, j->rank);
  else j->rc = dt_comm_broadcast(j->c, j->rank, x, 8, 0);
  return NULL;
}

static void test_comm_errors(void) {
  quiet();
  watchdog(60);
  float x[4] = {0};
  CHECK_ERR(dt_comm_allreduce(NULL, 0, x, 4), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK(dt_comm_create_threads(0, 0) == NULL);
  CHECK(dt_comm_create_threads(257, 0) == NULL);
  dt_comm *c = dt_comm_create_threads(3, 0);
  CHECK_ERR(dt_comm_allreduce(c, 3, x, 4), DTRAIN_ERR_INDEX, "rank 3");
  CHECK_ERR(dt_comm_allreduce(c, -1, x, 4), DTRAIN_ERR_INDEX, "rank -1");
  CHECK_ERR(dt_comm_allreduce(c, 0, NULL, 4), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR(dt_comm_broadcast(c, 0, x, 4, 5), DTRAIN_ERR_INDEX, "root 5");
  /* an abort releases the waiting ranks */
  pthread_t th[3];
  abort_job jobs[3];
  for (int r = 0; r < 3; r++) {
    jobs[r].c = c; jobs[r].rank = r;
    pthread_create(&th[r], NULL, abort_thread, &jobs[r]);
  }
  for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
  CHECK(jobs[0].rc == DTRAIN_ERR_ABORTED && jobs[1].rc == DTRAIN_ERR_ABORTED);
  /* still broken until recovered */
  CHECK(dt_comm_barrier(c, 0) == DTRAIN_ERR_ABORTED);
  CHECK(dt_comm_recover(c) == DTRAIN_OK);
  float *bufs[3];
  for (int r = 0; r < 3; r++) bufs[r] = (float *)calloc(64, sizeof(float));
  CHECK(comm_run(c, 3, 64, 0, 0, 2, bufs, NULL) == 0);
  for (int r = 0; r < 3; r++) free(bufs[r]);
  dt_comm_destroy(c);
  /* ranks that disagree on n, or on the call, all get MISMATCH, and nobody hangs */
  c = dt_comm_create_threads(2, 0);
  for (mismatch_mode = 0; mismatch_mode < 2; mismatch_mode++) {
    for (int r = 0; r < 2; r++) {
      jobs[r].c = c; jobs[r].rank = r;
      pthread_create(&th[r], NULL, mismatch_thread, &jobs[r]);
    }
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    CHECK_MSG(jobs[0].rc == DTRAIN_ERR_MISMATCH && jobs[1].rc == DTRAIN_ERR_MISMATCH, "mode %d: %s %s",
              mismatch_mode, dt_result_name(jobs[0].rc), dt_result_name(jobs[1].rc));
  }
  /* and the communicator still works */
  float *bb[2];
  for (int r = 0; r < 2; r++) bb[r] = (float *)calloc(16, sizeof(float));
  CHECK(comm_run(c, 2, 16, 0, 0, 2, bb, NULL) == 0);
  for (int r = 0; r < 2; r++) free(bb[r]);
  dt_comm_destroy(c);
  alarm(0);
}

/* ---- synchronous strategies equal one_device ---------------------------------------- */

static void test_one_device_equals_hand_loop(void) {
  const dt_optim_kind kinds[2] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM};
  for (int k = 0; k < 2; k++) {
    for (int clip = 0; clip < 2; clip++) {
      float lr = k == 0 ? 0.05f : 0.01f, cl = clip ? 0.5f : 0.0f;
      size_t n;
      dt_strategy_options sd = dt_strategy_one_device();
      train_with(&sd, kinds[k], lr, 0.9f, cl, 12, 30, got, &n);
      train_by_hand(kinds[k], lr, 0.9f, cl, 12, 30, ref);
      CHECK_MSG(memcmp(got, ref, n * sizeof(float)) == 0, "one_device differs from the hand loop (opt %d clip %d)",
                k, clip);
      /* mirrored(1) is the same code: bitwise equal too */
      if (!(dt_build_features() & DTRAIN_FEATURE_DIST)) {
        th_skip("mirrored(1) is compiled out (DTRAIN_NO_DIST); one_device was checked");
        continue;
      }
      sd = dt_strategy_mirrored(1);
      train_with(&sd, kinds[k], lr, 0.9f, cl, 12, 30, got2, &n);
      CHECK_MSG(memcmp(got2, ref, n * sizeof(float)) == 0, "mirrored(1) differs from one_device");
    }
  }
}

static void test_mirrored_equals_one_device(void) {
  watchdog(120);
  const dt_optim_kind kinds[3] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_SGD};
  const float clips[3] = {0.0f, 0.0f, 0.3f};
  const int64_t Bs[2] = {30, 64};
  for (int k = 0; k < 3; k++) {
    for (int bi = 0; bi < 2; bi++) {
      float lr = kinds[k] == DTRAIN_OPTIM_SGD ? 0.05f : 0.01f;
      size_t n;
      dt_strategy_options sd = dt_strategy_one_device();
      float l1 = train_with(&sd, kinds[k], lr, 0.9f, clips[k], 10, Bs[bi], ref, &n);
      CHECK(n <= PMAX && isfinite(l1));
      for (int N = 1; N <= 4; N++) {
        sd = dt_strategy_mirrored(N);
        float lN = train_with(&sd, kinds[k], lr, 0.9f, clips[k], 10, Bs[bi], got, &n);
        double e = rel_err(got, ref, n);
        CHECK_MSG(e <= 1e-5, "mirrored(%d) opt %d clip %g B %lld: relative error %g", N, k, (double)clips[k],
                  (long long)Bs[bi], e);
        CHECK_MSG(fabs((double)lN - (double)l1) <= 1e-5 * fabs((double)l1) + 1e-6, "loss %g vs %g", (double)lN,
                  (double)l1);
        /* a repeat is bitwise identical */
        train_with(&sd, kinds[k], lr, 0.9f, clips[k], 10, Bs[bi], got2, &n);
        CHECK_MSG(memcmp(got, got2, n * sizeof(float)) == 0, "mirrored(%d) does not repeat bitwise", N);
      }
    }
  }
  alarm(0);
}

/* A model without buffers: every mirrored replica reads the params' one copy
 * (no copies, no all-gather); with a buffer each has its own. Trained alike,
 * the two agree bit for bit (the same additions, the same elementwise update). */
static void test_shared_copy(void) {
  watchdog(60);
  for (int opt_i = 0; opt_i < 2; opt_i++) {
    float p[2][PMAX];
    size_t ntrain = 0;
    for (int withbuf = 0; withbuf < 2; withbuf++) {
      model m;
      model_init(&m, 5);
      ntrain = dt_params_size(m.P); /* the trained parameters come first */
      if (withbuf) {
        int64_t bs[1] = {4};
        CHECK(dt_params_add_buffer(m.P, "spare", 1, bs, dt_init_zeros()) >= 0);
      }
      dt_optim *opt = make_opt(m.P, opt_i ? DTRAIN_OPTIM_ADAM : DTRAIN_OPTIM_SGD, opt_i ? 0.01f : 0.05f, 0.9f, 0.0f);
      dt_strategy_options sd = dt_strategy_mirrored(3);
      dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
      CHECK(s != NULL);
      for (int r = 1; s && r < 3; r++) {
        dt_graph *g = dt_strategy_graph(s, r);
        dt_graph_reset(g);
        int shared = dt_param(g, 0)->data == dt_params_data(m.P);
        CHECK_MSG(shared == !withbuf, "buffer %d: replica %d %s the params' copy", withbuf, r,
                  shared ? "shares" : "does not share");
      }
      for (int k = 0; s && k < 8; k++) {
        dt_minibatch b = batch_at(k, 31);
        CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
      }
      memcpy(p[withbuf], dt_params_data(m.P), ntrain * sizeof(float));
      dt_strategy_destroy(s);
      dt_optim_destroy(opt);
      dt_params_destroy(m.P);
    }
    CHECK_MSG(memcmp(p[0], p[1], ntrain * sizeof(float)) == 0, "optimizer %d: shared and own copies differ", opt_i);
  }
  alarm(0);
}

/* The cache hand-off (dt_strategy_mirrored.c): unset, "0", "1" and a bad
 * value ("yes": a warning naming the variable, then off), mirrored(2) and
 * mirrored(3) train the same bits, on the shared copy and on own copies (a
 * buffer), with SGD and Adam; stats.cache_handoff says which way ran (on
 * only with "1" and where lines can be evicted: x86-64). */
static void set_env(const char *k, const char *v) {
#ifdef _WIN32
  _putenv_s(k, v ? v : "");
#else
  if (v) setenv(k, v, 1);
  else unsetenv(k);
#endif
}

static void test_cache_handoff(void) {
  watchdog(120);
  const char *modes[4] = {"0", "1", NULL, "yes"};
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_WARN);
  int x86 = 0;
#if defined(__x86_64__) && !defined(DTRAIN_NO_SIMD)
  x86 = 1;
#endif
  for (int reps = 2; reps <= 3; reps++)
    for (int opt_i = 0; opt_i < 2; opt_i++)
      for (int withbuf = 0; withbuf < 2; withbuf++) {
        float p[4][PMAX];
        size_t np = 0;
        for (int mi = 0; mi < 4; mi++) {
          set_env("DTRAIN_CACHE_HANDOFF", modes[mi]);
          log_last[0] = '\0';
          model m;
          model_init(&m, 7);
          if (withbuf) {
            int64_t bs[1] = {4};
            CHECK(dt_params_add_buffer(m.P, "spare", 1, bs, dt_init_zeros()) >= 0);
          }
          np = dt_params_size(m.P);
          dt_optim *opt = make_opt(m.P, opt_i ? DTRAIN_OPTIM_ADAM : DTRAIN_OPTIM_SGD, opt_i ? 0.01f : 0.05f, 0.9f, 0.0f);
          dt_strategy_options sd = dt_strategy_mirrored(reps);
          dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
          CHECK(s != NULL);
          if (mi == 3)
            CHECK_MSG(strstr(log_last, "DTRAIN_CACHE_HANDOFF=\"yes\" is not 0 or 1") != NULL,
                      "a bad DTRAIN_CACHE_HANDOFF: logged \"%s\"", log_last);
          else
            CHECK_MSG(log_last[0] == '\0', "DTRAIN_CACHE_HANDOFF=%s: logged \"%s\"", modes[mi] ? modes[mi] : "(unset)",
                      log_last);
          for (int k = 0; s && k < 6; k++) {
            dt_minibatch b = batch_at(k, 29);
            CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
          }
          dt_strategy_stats st;
          memset(&st, 0xff, sizeof st);
          CHECK(s && dt_strategy_stats_get(s, &st) == DTRAIN_OK);
          CHECK_MSG(st.cache_handoff == (x86 && mi == 1), "DTRAIN_CACHE_HANDOFF=%s: stats say %d",
                    modes[mi] ? modes[mi] : "(unset)", st.cache_handoff);
          memcpy(p[mi], dt_params_data(m.P), np * sizeof(float));
          dt_strategy_destroy(s);
          dt_optim_destroy(opt);
          dt_params_destroy(m.P);
        }
        set_env("DTRAIN_CACHE_HANDOFF", NULL);
        CHECK_MSG(memcmp(p[0], p[1], np * sizeof(float)) == 0 && memcmp(p[0], p[2], np * sizeof(float)) == 0 &&
                      memcmp(p[0], p[3], np * sizeof(float)) == 0,
                  "mirrored(%d), optimizer %d, buffer %d: the hand-off changed the parameters", reps, opt_i, withbuf);
      }
  quiet(); /* as the tests before left it */
  alarm(0);
}

static void test_central_storage_equals_mirrored(void) {
  watchdog(120);
  for (int k = 0; k < 2; k++) {
    dt_optim_kind kind = k ? DTRAIN_OPTIM_ADAM : DTRAIN_OPTIM_SGD;
    float lr = k ? 0.01f : 0.05f;
    for (int N = 1; N <= 4; N++) {
      size_t n;
      dt_strategy_options sd = dt_strategy_mirrored(N);
      train_with(&sd, kind, lr, 0.9f, 0.0f, 10, 30, ref, &n);
      sd = dt_strategy_central_storage(N);
      train_with(&sd, kind, lr, 0.9f, 0.0f, 10, 30, got, &n);
      double e = rel_err(got, ref, n);
      CHECK_MSG(e <= 1e-5, "central_storage(%d) vs mirrored: relative error %g", N, e);
      train_with(&sd, kind, lr, 0.9f, 0.0f, 10, 30, got2, &n);
      CHECK_MSG(memcmp(got, got2, n * sizeof(float)) == 0, "central_storage(%d) does not repeat bitwise", N);
      /* the same arithmetic as mirrored: bitwise equal in fact */
      CHECK_MSG(memcmp(got, ref, n * sizeof(float)) == 0, "central_storage(%d) differs from mirrored", N);
    }
  }
  alarm(0);
}

/* Batches smaller than the replica count, and SUM reduction. */
static void test_uneven_and_empty_shards(void) {
  size_t n;
  dt_strategy_options sd = dt_strategy_one_device();
  train_with(&sd, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f, 6, 3, ref, &n);
  sd = dt_strategy_mirrored(4); /* 3 rows over 4 replicas: replica 3 has nothing */
  train_with(&sd, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f, 6, 3, got, &n);
  CHECK_MSG(rel_err(got, ref, n) <= 1e-5, "B=3 over 4 replicas: %g", rel_err(got, ref, n));
  /* LOSS_SUM: the weights are 1, so mirrored(N) with SUM is N times... the sum of shard means */
  sd = dt_strategy_mirrored(2);
  sd.loss = DTRAIN_LOSS_SUM;
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.1f, 0.0f, 0.0f);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  dt_minibatch b = batch_at(0, 20);
  float L = 0.0f;
  CHECK(dt_strategy_step(s, &b, &L) == DTRAIN_OK);
  /* loss = sum of the two shard means: compare against a one_device step on each half */
  model m2;
  model_init(&m2, 5);
  dt_graph *g = dt_graph_create(m2.P, NULL);
  dt_minibatch h = batch_at(0, 20);
  h.rows = 10;
  float a = dt_item(model_step(g, 0, &h, &m2));
  dt_graph_reset(g);
  h.x += 10 * NF; h.y += 10; h.t += 10;
  float c2 = dt_item(model_step(g, 0, &h, &m2));
  CHECK_NEAR(L, a + c2, 1e-5);
  dt_graph_destroy(g);
  dt_params_destroy(m2.P);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* ---- async ------------------------------------------------------------------------------ */

/* async(N, 0) with per-replica batches of b rows equals mirrored(N) with
 * LOSS_SUM on the concatenated batch (SGD with momentum, no weight decay). */
static void test_async_lockstep_equals_sync(void) {
  watchdog(120);
  for (int N = 1; N <= 4; N++) {
    for (int upd = 0; upd < 2; upd++) {
      size_t n;
      dt_strategy_options sd = dt_strategy_mirrored(N);
      sd.loss = DTRAIN_LOSS_SUM;
      train_with(&sd, DTRAIN_OPTIM_SGD, 0.02f, 0.9f, 0.0f, 10, 8 * N, ref, &n);
      sd = dt_strategy_async(N, 0);
      sd.async_update = upd ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
      train_with(&sd, DTRAIN_OPTIM_SGD, 0.02f, 0.9f, 0.0f, 10, 8 * N, got, &n);
      double e = rel_err(got, ref, n);
      CHECK_MSG(e <= 1e-5, "async(%d, 0) update %d vs lock-step sync: relative error %g", N, upd, e);
      train_with(&sd, DTRAIN_OPTIM_SGD, 0.02f, 0.9f, 0.0f, 10, 8 * N, got2, &n);
      CHECK_MSG(memcmp(got, got2, n * sizeof(float)) == 0, "async(%d, 0) does not repeat bitwise", N);
    }
  }
  alarm(0);
}

/* The same through dt_strategy_run: replica r's batch for ticket q is rows
 * [q*b, q*b+b); the sync global batch of step t is the N tickets of round t. */
typedef struct feed {
  int n;
  int64_t b;
  model *m;
} feed;

static dt_result feed_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  feed *f = (feed *)user;
  if (replica < 0) *out = batch_at(step, f->b * f->n);
  else {
    /* ticket q = t*N + r: the rows of shard r of global batch t */
    int64_t t = step / f->n, r = step % f->n;
    *out = batch_at(t, f->b * f->n);
    out->rows = f->b;
    out->x += r * f->b * NF; out->y += r * f->b; out->t += r * f->b;
  }
  return DTRAIN_OK;
}

static void test_async_run_lockstep(void) {
  watchdog(120);
  const int N = 3;
  for (int which = 0; which < 2; which++) {
    model m;
    model_init(&m, 5);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.02f, 0.9f, 0.0f);
    dt_strategy_options sd = which ? dt_strategy_async(N, 0) : dt_strategy_mirrored(N);
    if (!which) sd.loss = DTRAIN_LOSS_SUM;
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    feed f;
    f.n = N; f.b = 6; f.m = &m;
    float ml = NAN;
    CHECK(dt_strategy_run(s, 12, feed_next, &f, &ml) == DTRAIN_OK);
    CHECK(isfinite(ml));
    memcpy(which ? got : ref, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    if (which) {
      CHECK(st.steps == 12 * N);
      CHECK(st.samples == 12 * N * 6);
      int64_t tot = 0;
      for (int i = 0; i < DTRAIN_STALENESS_BINS; i++) tot += st.staleness_hist[i];
      CHECK(tot == st.steps);
      CHECK(st.staleness_max == N - 1); /* lock-step: replica r's push follows r others of its round */
      CHECK(st.clock_gap_max == 0);
    } else {
      CHECK(st.steps == 12 && st.samples == 12 * N * 6);
    }
    CHECK(st.steps_per_s > 0 && st.samples_per_s > 0 && st.seconds > 0);
    CHECK(st.failed_replica == -1);
    if (which) {
      size_t n = dt_params_size(m.P);
      double e = rel_err(got, ref, n);
      CHECK_MSG(e <= 1e-5, "async run lock-step vs mirrored SUM: %g", e);
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* ---- logistic regression: fully async converges to the optimum ------------------------- */
#define LN 1024
#define LF 6
static float lr_x[LN * LF];
static int32_t lr_y[LN];

typedef struct logreg {
  dt_params *P;
  dt_nn_linear lin;
} logreg;

static dt_tensor *logreg_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  logreg *m = (logreg *)user;
  (void)replica;
  int64_t xs[2];
  xs[0] = b->rows;
  xs[1] = LF;
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->lin, dt_tensor_wrap(g, 2, xs, (float *)b->x)), b->y);
}

static dt_result logreg_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user;
  (void)replica;
  memset(out, 0, sizeof *out);
  int64_t first = (step * 16) % LN;
  out->rows = 16;
  out->x = lr_x + first * LF;
  out->x_cols = LF;
  out->y = lr_y + first;
  return DTRAIN_OK;
}

static double logreg_full_loss(logreg *m) {
  dt_graph *g = dt_graph_create(m->P, NULL);
  dt_graph_set_grad_enabled(g, 0);
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = LN;
  b.x = lr_x;
  b.y = lr_y;
  double L = dt_item(logreg_step(g, 0, &b, m));
  dt_graph_destroy(g);
  return L;
}

static void test_async_converges(void) {
  watchdog(120);
  th_seed(7);
  for (int i = 0; i < LN; i++) {
    float s = 0.3f;
    for (int f = 0; f < LF; f++) {
      lr_x[i * LF + f] = th_uniform(-2, 2);
      s += lr_x[i * LF + f] * (float)(f % 3 - 1) * 0.8f;
    }
    float p = 1.0f / (1.0f + expf(-s));
    lr_y[i] = th_rand() < p; /* noisy labels: a finite optimum */
  }
  /* the optimum: long full-batch gradient descent on one thread */
  logreg opt_m;
  opt_m.P = dt_params_create(3);
  dt_nn_linear_init(&opt_m.lin, opt_m.P, "lin", LF, 2, 1);
  dt_optim *o = make_opt(opt_m.P, DTRAIN_OPTIM_SGD, 0.5f, 0.9f, 0.0f);
  dt_graph *g = dt_graph_create(opt_m.P, NULL);
  dt_minibatch all;
  memset(&all, 0, sizeof all);
  all.rows = LN;
  all.x = lr_x;
  all.y = lr_y;
  for (int k = 0; k < 1500; k++) {
    dt_graph_reset(g);
    dt_params_zero_grad(opt_m.P);
    dt_backward(g, logreg_step(g, 0, &all, &opt_m));
    dt_optim_step(o);
  }
  double best = logreg_full_loss(&opt_m);
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  /* fully async, 4 replicas, small batches, each update rule; then with owners (async_sharded) */
  for (int upd = 0; upd < 3; upd++) {
    logreg m;
    m.P = dt_params_create(3);
    dt_nn_linear_init(&m.lin, m.P, "lin", LF, 2, 1);
    double start = logreg_full_loss(&m);
    dt_optim_options od;
    memset(&od, 0, sizeof od);
    od.kind = DTRAIN_OPTIM_SGD;
    od.lr = 0.05f;
    od.schedule.kind = DTRAIN_SCHED_COSINE;
    od.schedule.total_steps = 600;
    od.schedule.min_lr = 0.002f;
    dt_optim *opt = dt_optim_create(m.P, &od);
    /* (owners bounded: the model is one block, all of it replica 3's, whose
     * steps must keep up for anything to be trained; see async_sharded) */
    dt_strategy_options sd = dt_strategy_async(4, upd == 2 ? 4 : DTRAIN_STALENESS_UNBOUNDED);
    sd.async_update = upd == 1 ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
    sd.async_sharded = upd == 2;
    dt_strategy *s = dt_strategy_create(m.P, opt, logreg_step, &m, &sd);
    CHECK(dt_strategy_run(s, 600, logreg_next, NULL, NULL) == DTRAIN_OK);
    double L = logreg_full_loss(&m);
    /* distance to the optimum's parameters, too */
    double d2 = 0.0, n2 = 0.0;
    const float *a = dt_params_data(m.P), *b = dt_params_data(opt_m.P);
    for (size_t i = 0; i < dt_params_size(m.P); i++) {
      d2 += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
      n2 += (double)b[i] * b[i];
    }
    CHECK_MSG(L - best <= 0.01, "async update %d: loss %g, optimum %g (start %g)", upd, L, best, start);
    /* The optimum is flat along some directions: runs 0.0005 from the best
     * loss ended 0.002-0.135 (relative) from its parameters (20 runs, before
     * and after 2026-11-27's changes; 0.112 failed a CI run at 0.1). */
    CHECK_MSG(sqrt(d2 / n2) <= 0.25, "async update %d: parameters %g (relative) from the optimum", upd,
              sqrt(d2 / n2));
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK(st.steps == 600 * 4);
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  dt_params_destroy(opt_m.P);
  alarm(0);
}

/* ---- the staleness bound under stress ---------------------------------------------------- */
#define SW 4
#define ST 150
typedef struct stress {
  dt_pstore *ps;
  int k, worker;
  float *mine;
  size_t n;
} stress;

static int stress_pushing[SW], stress_started[SW]; /* test-side clocks (atomic builtins) */
static int stress_bad_low, stress_bad_high, stress_bad_stale, stress_bad_gap, stress_bad_rc;

static void stress_check_bounds(int k, int64_t t) {
  if (k < 0) return;
  for (int j = 0; j < SW; j++) {
    int pushing = __atomic_load_n(&stress_pushing[j], __ATOMIC_SEQ_CST);
    int started = __atomic_load_n(&stress_started[j], __ATOMIC_SEQ_CST);
    if (pushing < t - k) __atomic_fetch_add(&stress_bad_low, 1, __ATOMIC_RELAXED);
    if (started > t + k + 1) __atomic_fetch_add(&stress_bad_high, 1, __ATOMIC_RELAXED);
  }
}

static void *stress_thread(void *arg) {
  stress *S = (stress *)arg;
  float *delta = (float *)malloc(S->n * sizeof(float));
  for (size_t i = 0; i < S->n; i++) delta[i] = 1.0f;
  for (int64_t t = 0; t < ST; t++) {
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    if (dt_pstore_pull(S->ps, S->worker, t, S->mine, S->n, &tk) != DTRAIN_OK)
      __atomic_fetch_add(&stress_bad_rc, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&stress_started[S->worker], 1, __ATOMIC_SEQ_CST);
    stress_check_bounds(S->k, t);
    if (S->k >= 0 && tk.clock_gap > S->k) __atomic_fetch_add(&stress_bad_gap, 1, __ATOMIC_RELAXED);
    /* random work: worker 3 is a straggler */
    double w = hash01((uint64_t)(S->worker * 100003 + t)) * 200e-6 * (S->worker == 3 ? 4 : 1);
    dt_sleep(w);
    stress_check_bounds(S->k, t);
    __atomic_fetch_add(&stress_pushing[S->worker], 1, __ATOMIC_SEQ_CST);
    if (dt_pstore_push(S->ps, S->worker, t, delta, S->n, &tk) != DTRAIN_OK)
      __atomic_fetch_add(&stress_bad_rc, 1, __ATOMIC_RELAXED);
    if (S->k >= 0 && tk.staleness > (int64_t)(SW - 1) * (2 * S->k + 1))
      __atomic_fetch_add(&stress_bad_stale, 1, __ATOMIC_RELAXED);
  }
  dt_pstore_leave(S->ps, S->worker);
  free(delta);
  return NULL;
}

static void test_staleness_bound_stress(void) {
  watchdog(120);
  const int ks[4] = {0, 1, 3, DTRAIN_STALENESS_UNBOUNDED};
  enum { n = 256 };
  static float store[n], mine[SW][n];
  for (int ki = 0; ki < 4; ki++) {
    for (int upd = 0; upd < 2; upd++) {
      int k = ks[ki];
      memset(store, 0, sizeof store);
      memset(stress_pushing, 0, sizeof stress_pushing);
      memset(stress_started, 0, sizeof stress_started);
      stress_bad_low = stress_bad_high = stress_bad_stale = stress_bad_gap = stress_bad_rc = 0;
      dt_pstore *ps = dt_pstore_create_local(store, n, SW, k, upd ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD, 0);
      CHECK(ps != NULL);
      if (!ps) continue;
      uint64_t v0 = dt_pstore_version(ps);
      pthread_t th[SW];
      stress S[SW];
      for (int w = 0; w < SW; w++) {
        S[w].ps = ps; S[w].k = k; S[w].worker = w; S[w].mine = mine[w]; S[w].n = n;
        pthread_create(&th[w], NULL, stress_thread, &S[w]);
      }
      for (int w = 0; w < SW; w++) pthread_join(th[w], NULL);
      CHECK_MSG(stress_bad_low == 0 && stress_bad_high == 0, "k=%d: a worker ran ahead of the bound (%d low, %d high)",
                k, stress_bad_low, stress_bad_high);
      CHECK_MSG(stress_bad_stale == 0, "k=%d: %d pushes beyond the staleness bound", k, stress_bad_stale);
      CHECK_MSG(stress_bad_gap == 0, "k=%d: %d pulls with a clock gap above k", k, stress_bad_gap);
      CHECK(stress_bad_rc == 0);
      CHECK(dt_pstore_version(ps) - v0 == (uint64_t)(SW * ST));
      /* no lost update with the atomic rule, nor in lock-step (pushes in turn) */
      if (upd || k == 0) {
        int wrong = 0;
        for (int i = 0; i < n; i++) wrong += store[i] != (float)(SW * ST);
        CHECK_MSG(wrong == 0, "k=%d update %d: %d elements lost updates", k, upd, wrong);
      }
      dt_pstore_destroy(ps);
    }
  }
  alarm(0);
}

/* The strategy enforces the bound too: step functions that sleep at random;
 * then the same bounds with owners (async_sharded; k >= 1). */
static void test_async_strategy_staleness(void) {
  watchdog(120);
  for (int c = 0; c < 5; c++) {
    const int k = c < 3 ? c : c - 2, sharded = c >= 3;
    model m;
    model_init(&m, 5);
    m.sleep_max = 300e-6f;
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.01f, 0.0f, 0.0f);
    dt_strategy_options sd = dt_strategy_async(4, k);
    sd.async_sharded = sharded;
    sd.straggler = 2;
    sd.straggler_factor = 3.0f;
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    feed f;
    f.n = 4; f.b = 8; f.m = &m;
    CHECK(dt_strategy_run(s, 40, feed_next, &f, NULL) == DTRAIN_OK);
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK(st.steps == 160);
    CHECK_MSG(st.clock_gap_max <= k, "k=%d, owners %d: clock gap %lld", k, sharded, (long long)st.clock_gap_max);
    CHECK_MSG(st.staleness_max <= 3 * (2 * k + 1), "k=%d, owners %d: staleness %lld", k, sharded,
              (long long)st.staleness_max);
    for (int r = 0; r < 4; r++) {
      dt_replica_stats rs;
      CHECK(dt_strategy_replica_stats(s, r, &rs) == DTRAIN_OK);
      CHECK(rs.result == DTRAIN_OK && rs.clock_gap_max <= k && rs.wait_s >= 0.0 && rs.compute_s > 0.0);
      if (k == 0) CHECK(rs.steps == 40);
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* ---- failures ------------------------------------------------------------------------------ */

static void test_errors_reach_every_replica(void) {
  quiet();
  watchdog(120);
  const dt_strategy_kind kinds[3] = {DTRAIN_STRATEGY_MIRRORED, DTRAIN_STRATEGY_CENTRAL_STORAGE, DTRAIN_STRATEGY_ASYNC};
  for (int ki = 0; ki < 3; ki++) {
    for (int fk = 0; fk < 3; fk++) {
      for (int stal = 0; stal < (kinds[ki] == DTRAIN_STRATEGY_ASYNC ? 3 : 1); stal++) {
        model m;
        model_init(&m, 5);
        dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0.0f);
        dt_strategy_options sd;
        memset(&sd, 0, sizeof sd);
        sd.kind = kinds[ki];
        sd.replicas = 3;
        sd.max_staleness = stal == 2 ? DTRAIN_STALENESS_UNBOUNDED : stal;
        sd.check_numerics = 1;
        dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
        CHECK(s != NULL);
        if (!s) continue;
        float before[PMAX];
        size_t n = dt_params_size(m.P);
        dt_minibatch b = batch_at(0, 24);
        CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
        memcpy(before, dt_params_data(m.P), n * sizeof(float));
        /* replica 1 fails at the next batch number */
        m.fail_replica = 1;
        m.fail_kind = fk;
        dt_strategy_stats st;
        dt_strategy_stats_get(s, &st);
        m.fail_step = kinds[ki] == DTRAIN_STRATEGY_ASYNC ? 3 + 1 : st.steps; /* async: ticket of replica 1, round 1 */
        b = batch_at(1, 24);
        dt_result want = fk == 0 ? DTRAIN_ERR_SHAPE : DTRAIN_ERR_NONFINITE;
        dt_result rc = dt_strategy_step(s, &b, NULL);
        CHECK_MSG(rc == want, "kind %d fail %d staleness %d: got %s", ki, fk, stal, dt_result_name(rc));
        CHECK_MSG(strstr(dt_last_error(), "replica 1:") != NULL, "message '%s' does not name the replica",
                  dt_last_error());
        if (fk == 0) CHECK_MSG(strstr(dt_last_error(), "dt_matmul") != NULL, "'%s'", dt_last_error());
        if (fk == 2) CHECK_MSG(strstr(dt_last_error(), "l1.weight") != NULL, "'%s'", dt_last_error());
        dt_strategy_stats_get(s, &st);
        CHECK(st.failed_replica == 1);
        for (int r = 0; r < 3; r++) {
          dt_replica_stats rs;
          dt_strategy_replica_stats(s, r, &rs);
          if (r == 1) CHECK(rs.result == want);
          else if (kinds[ki] != DTRAIN_STRATEGY_ASYNC)
            CHECK_MSG(rs.result == DTRAIN_ERR_ABORTED, "replica %d result %s", r, dt_result_name(rs.result));
          else /* an async replica may have finished its step before replica 1 failed */
            CHECK(rs.result == DTRAIN_ERR_ABORTED || rs.result == DTRAIN_OK);
        }
        /* a failed synchronous step changes nothing (in async the others may have pushed) */
        if (kinds[ki] != DTRAIN_STRATEGY_ASYNC)
          CHECK_MSG(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0, "kind %d fail %d changed params", ki,
                    fk);
        /* and the strategy goes on */
        m.fail_replica = -1;
        b = batch_at(2, 24);
        rc = dt_strategy_step(s, &b, NULL);
        CHECK_MSG(rc == DTRAIN_OK, "kind %d fail %d stal %d: the step after a failure: %s", ki, fk, stal, dt_last_error());
        dt_strategy_stats_get(s, &st);
        CHECK_MSG(st.failed_replica == -1, "kind %d fk %d stal %d failed %d", ki, fk, stal, st.failed_replica);
        dt_strategy_destroy(s);
        dt_optim_destroy(opt);
        dt_params_destroy(m.P);
      }
    }
  }
  alarm(0);
}

/* A failure in the middle of a free-running async run stops every replica. */
static void test_async_run_error(void) {
  quiet();
  watchdog(120);
  for (int stal = 0; stal < 3; stal++) {
    model m;
    model_init(&m, 5);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
    dt_strategy_options sd = dt_strategy_async(4, stal == 2 ? DTRAIN_STALENESS_UNBOUNDED : stal);
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    m.fail_replica = 2;
    m.fail_kind = 0;
    m.fail_step = 42;   /* lock-step: replica 2's ticket of round 10 */
    m.fail_from = stal != 0; /* free tickets: the first one >= 42 that replica 2 draws */
    feed f;
    f.n = 4; f.b = 8; f.m = &m;
    dt_result rc = dt_strategy_run(s, 1000, feed_next, &f, NULL);
    CHECK(rc == DTRAIN_ERR_SHAPE);
    CHECK_MSG(strstr(dt_last_error(), "replica 2:") != NULL, "'%s'", dt_last_error());
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK_MSG(st.steps < 1000 * 4, "the run went on after the failure (%lld pushes)", (long long)st.steps);
    CHECK(st.failed_replica == 2);
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

static dt_result failing_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user;
  *out = batch_at(step, 8);
  /* async: whichever replica draws ticket 150 or later (one replica may
   * draw every ticket: nothing makes the replicas take turns) */
  return (replica >= 0 && step >= 150) || (replica == -1 && step == 3) ? DTRAIN_ERR_IO : DTRAIN_OK;
}

static void test_batch_fn_errors(void) {
  quiet();
  watchdog(60);
  for (int a = 0; a < 2; a++) {
    model m;
    model_init(&m, 5);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
    dt_strategy_options sd = a ? dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED) : dt_strategy_mirrored(2);
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    CHECK_MSG(dt_strategy_run(s, 100, failing_next, NULL, NULL) == DTRAIN_ERR_IO, "a=%d", a);
    CHECK_MSG(strstr(dt_last_error(), "batch function") != NULL, "'%s'", dt_last_error());
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* ---- descriptors and argument errors ---------------------------------------------------- */

static void test_desc_and_args(void) {
  quiet();
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
  dt_strategy_options sd;
  CHECK(dt_strategy_parse("async", 3, 2, &sd) == DTRAIN_OK && sd.kind == DTRAIN_STRATEGY_ASYNC && sd.replicas == 3 &&
        sd.max_staleness == 2);
  CHECK(dt_strategy_parse("one_device", 3, 2, &sd) == DTRAIN_OK && sd.replicas == 1);
  CHECK_ERR(dt_strategy_parse("ring", 3, 0, &sd), DTRAIN_ERR_INVALID_ARG, "unknown strategy 'ring'");
  CHECK(strstr(dt_last_error(), "(one_device, mirrored, central_storage, async, multi_worker_mirrored, parameter_server)") != NULL);
  CHECK(strcmp(dt_strategy_kind_name(DTRAIN_STRATEGY_CENTRAL_STORAGE), "central_storage") == 0);
  CHECK(dt_strategy_create(NULL, opt, model_step, &m, NULL) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_strategy_create(m.P, NULL, model_step, &m, NULL) == NULL && strstr(dt_last_error(), "opt"));
  CHECK(dt_strategy_create(m.P, opt, NULL, &m, NULL) == NULL && strstr(dt_last_error(), "step"));
  sd = dt_strategy_mirrored(65);
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && strstr(dt_last_error(), "65 replicas"));
  sd = dt_strategy_one_device();
  sd.replicas = 2;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && strstr(dt_last_error(), "one_device"));
  sd = dt_strategy_async(2, -2);
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && strstr(dt_last_error(), "max_staleness -2"));
  sd = dt_strategy_mirrored(2);
  sd.straggler = 5;
  sd.straggler_factor = 2.0f;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && strstr(dt_last_error(), "straggler replica 5"));
  sd = dt_strategy_mirrored(2);
  sd.kind = (dt_strategy_kind)9;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && strstr(dt_last_error(), "unknown strategy"));
  /* replicas 0: as many as CPUs */
  sd = dt_strategy_mirrored(0);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s && dt_strategy_replicas(s) == (dt_cpu_count() < 64 ? dt_cpu_count() : 64));
  CHECK(dt_strategy_get_options(s)->replicas == dt_strategy_replicas(s));
  CHECK(dt_strategy_graph(s, 0) != NULL && dt_strategy_graph(s, 99) == NULL);
  CHECK_ERR(dt_strategy_step(s, NULL, NULL), DTRAIN_ERR_NULL_ARG, "batch");
  dt_minibatch b = batch_at(0, 8);
  b.rows = -1;
  CHECK_ERR(dt_strategy_step(s, &b, NULL), DTRAIN_ERR_INVALID_ARG, "rows");
  CHECK_ERR(dt_strategy_run(s, -1, feed_next, NULL, NULL), DTRAIN_ERR_INVALID_ARG, "steps");
  CHECK_ERR(dt_strategy_run(s, 1, NULL, NULL, NULL), DTRAIN_ERR_NULL_ARG, "next");
  dt_replica_stats rs;
  CHECK(dt_strategy_replica_stats(s, 99, &rs) == DTRAIN_ERR_INDEX);
  /* a loss with more than one element */
  dt_strategy_destroy(s);
  dt_strategy_destroy(NULL);
  /* no trainable parameter */
  dt_params *empty = dt_params_create(1);
  int64_t one = 4;
  dt_params_add_buffer(empty, "buf", 1, &one, dt_init_zeros());
  dt_optim *eo = make_opt(empty, DTRAIN_OPTIM_SGD, 0.1f, 0.0f, 0.0f);
  CHECK(dt_strategy_create(empty, eo, model_step, &m, NULL) == NULL && strstr(dt_last_error(), "no trainable"));
  dt_optim_destroy(eo);
  dt_params_destroy(empty);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  /* pstore arguments */
  float st[8];
  CHECK(dt_pstore_create_local(st, 8, 0, 0, DTRAIN_ASYNC_HOGWILD, 0) == NULL);
  CHECK(dt_pstore_create_local(st, 8, 2, -3, DTRAIN_ASYNC_HOGWILD, 0) == NULL);
  dt_pstore *ps = dt_pstore_create_local(st, 8, 2, 0, DTRAIN_ASYNC_HOGWILD, 0);
  dt_pstore_ticket tk;
  CHECK_ERR(dt_pstore_pull(ps, 2, 0, st, 8, &tk), DTRAIN_ERR_INDEX, "worker 2");
  CHECK_ERR(dt_pstore_pull(ps, 0, 0, st, 7, &tk), DTRAIN_ERR_SHAPE, "n=7");
  CHECK_ERR(dt_pstore_push(ps, 0, -1, st, 8, &tk), DTRAIN_ERR_INVALID_ARG, "clock -1");
  CHECK_ERR(dt_pstore_push(ps, 0, 0, st, 8, NULL), DTRAIN_ERR_NULL_ARG, "ticket");
  dt_pstore_abort(ps);
  CHECK(dt_pstore_pull(ps, 0, 0, st, 8, &tk) == DTRAIN_ERR_ABORTED);
  CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
  dt_pstore_destroy(ps);
}

static dt_tensor *wide_loss_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  (void)replica;
  int64_t xs[2];
  xs[0] = b->rows;
  xs[1] = NF;
  return dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x));
}

static void test_loss_must_be_scalar(void) {
  quiet();
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  dt_strategy *s = dt_strategy_create(m.P, opt, wide_loss_step, &m, &sd);
  dt_minibatch b = batch_at(0, 8);
  CHECK_ERR(dt_strategy_step(s, &b, NULL), DTRAIN_ERR_SHAPE, "one element");
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* ---- batch norm: buffers follow replica 0; no races in central storage ------------------- */
typedef struct bn_model {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_nn_batch_norm bn;
} bn_model;

static dt_tensor *bn_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  bn_model *m = (bn_model *)user;
  (void)replica;
  int64_t xs[2];
  xs[0] = b->rows;
  xs[1] = NF;
  dt_tensor *h = dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x));
  h = dt_relu(g, dt_nn_batch_norm_forward(g, &m->bn, h));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

static void test_batch_norm_buffers(void) {
  watchdog(60);
  const dt_strategy_kind kinds[3] = {DTRAIN_STRATEGY_MIRRORED, DTRAIN_STRATEGY_CENTRAL_STORAGE, DTRAIN_STRATEGY_ASYNC};
  for (int ki = 0; ki < 3; ki++) {
    bn_model m;
    m.P = dt_params_create(11);
    dt_nn_linear_init(&m.l1, m.P, "l1", NF, 16, 1);
    dt_nn_batch_norm_init(&m.bn, m.P, "bn", 16);
    dt_nn_linear_init(&m.l2, m.P, "l2", 16, NC, 1);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
    dt_strategy_options sd;
    memset(&sd, 0, sizeof sd);
    sd.kind = kinds[ki];
    sd.replicas = 3;
    dt_strategy *s = dt_strategy_create(m.P, opt, bn_step, &m, &sd);
    for (int k = 0; k < 5; k++) {
      dt_minibatch b = batch_at(k, 30);
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    }
    /* the running mean moved away from its initial zeros */
    dt_param_info info;
    dt_params_info(m.P, m.bn.mean, &info);
    float moved = 0.0f;
    for (size_t i = 0; i < info.size; i++) moved += fabsf(dt_params_data(m.P)[info.offset + i]);
    CHECK(moved > 0.0f);
    if (kinds[ki] == DTRAIN_STRATEGY_MIRRORED) {
      /* every replica's copy is identical, buffers included */
      size_t n = dt_params_size(m.P);
      for (int r = 1; r < 3; r++) {
        dt_graph *g = dt_strategy_graph(s, r);
        dt_graph_reset(g);
        const float *copy = dt_param(g, 0)->data; /* parameter 0 starts the flat buffer */
        CHECK_MSG(memcmp(copy, dt_params_data(m.P), n * sizeof(float)) == 0, "replica %d's copy differs", r);
      }
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* ---- async's lean push ---------------------------------------------------------------- */
static void lean_model(bn_model *m, int64_t width) {
  m->P = dt_params_create(12);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, width, 1);
  dt_nn_batch_norm_init(&m->bn, m->P, "bn", width);
  dt_nn_linear_init(&m->l2, m->P, "l2", width, NC, 1);
}

/* The optimizers of the async bit-for-bit tests: Adam with L2 decay, AdamW,
 * SGD with Nesterov momentum, RMSprop with momentum. */
static dt_optim_options async_variant(int variant) {
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  const dt_optim_kind kinds[4] = {DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_ADAMW, DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_RMSPROP};
  od.kind = kinds[variant];
  od.lr = 0.01f;
  od.weight_decay = 0.05f;
  od.momentum = variant >= 2 ? 0.9f : 0.0f;
  od.nesterov = variant == 2;
  return od;
}

/* async(1)'s algorithm written out on a fresh model (P, step, user): K steps
 * of B rows (batch_at). In place, the one-device loop; on copies: pull,
 * forward/backward, the optimizer's step on the copy, store += new - pulled
 * where that is not 0. The final values into out (P's size). 1 on success. */
static int async_by_hand(dt_params *P, const dt_optim_options *od, dt_step_fn step, void *user, int K, int64_t B,
                         int in_place, float *out) {
  size_t n = dt_params_size(P);
  float *x = dt_params_data(P), *old = (float *)malloc(n * sizeof(float));
  memcpy(out, x, n * sizeof(float));
  dt_optim *o = dt_optim_create(P, od);
  dt_graph *g = dt_graph_create(P, NULL);
  int ok = old && o && g;
  for (int k = 0; k < K && ok; k++) {
    if (!in_place) {
      memcpy(x, out, n * sizeof(float));
      memcpy(old, out, n * sizeof(float));
    }
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_minibatch b = batch_at(k, B);
    b.step = k;
    ok = dt_backward(g, step(g, 0, &b, user)) == DTRAIN_OK && dt_optim_step(o) == DTRAIN_OK;
    for (size_t i = 0; !in_place && i < n; i++) {
      float d = x[i] - old[i];
      if (d != 0.0f) out[i] = out[i] + d;
    }
  }
  if (in_place) memcpy(out, x, n * sizeof(float));
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  free(old);
  return ok;
}

/* The same K steps through the strategy sd (async(1)) on a fresh model;
 * 1 when its parameters equal want bit for bit (else says how far, with
 * what). on_store >= 0: the replica must (1) or must not (0) compute on
 * the params' buffer. */
static int async_run_equals(dt_params *P, const dt_optim_options *od, dt_step_fn step, void *user,
                            const dt_strategy_options *sd, int K, int64_t B, int on_store, const float *want,
                            const char *what) {
  size_t n = dt_params_size(P);
  dt_optim *o = dt_optim_create(P, od);
  dt_strategy *s = dt_strategy_create(P, o, step, user, sd);
  int ok = s != NULL;
  if (s && on_store >= 0) {
    dt_graph *g = dt_strategy_graph(s, 0);
    dt_graph_reset(g);
    ok = (dt_param(g, 0)->data == dt_params_data(P)) == on_store;
    if (!ok) fprintf(stderr, "%s: the replica %s the store\n", what, on_store ? "does not compute on" : "computes on");
  }
  for (int k = 0; ok && k < K; k++) {
    dt_minibatch b = batch_at(k, B);
    ok = dt_strategy_step(s, &b, NULL) == DTRAIN_OK;
  }
  if (ok && memcmp(dt_params_data(P), want, n * sizeof(float)) != 0) {
    fprintf(stderr, "%s: differs from the loop by hand (relative %g)\n", what, rel_err(dt_params_data(P), want, n));
    ok = 0;
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(o);
  return ok;
}

/* async pushes block by block (the replica's optimizer step on each block of
 * its pulled copy, added to the store while in the cache, the next pull
 * copied by the same sweep); check_numerics makes the whole update first.
 * Both equal, bit for bit, the plain algorithm written out here: pull,
 * forward/backward, the optimizer's step on the copy, store += new - pulled
 * where that is not 0. A model of several 2048-float blocks with batch-norm
 * statistics (pushed as what the forward made of them) and padding between
 * parameters; Adam with L2 decay, AdamW, SGD with Nesterov momentum, RMSprop
 * with momentum. */
static void test_async_lean_push(void) {
  watchdog(120);
  enum { W = 600, K = 12, B = 24 };
  for (int variant = 0; variant < 4; variant++) {
    for (int numerics = 0; numerics < 2; numerics++) {
      dt_optim_options od = async_variant(variant);
      bn_model h, m;
      lean_model(&h, W);
      lean_model(&m, W);
      size_t n = dt_params_size(h.P);
      float *store = (float *)malloc(n * sizeof(float));
      CHECK(n > 4 * 2048 && store && async_by_hand(h.P, &od, bn_step, &h, K, B, 0, store));
      dt_strategy_options sd = dt_strategy_async(1, DTRAIN_STALENESS_UNBOUNDED);
      sd.check_numerics = numerics;
      char what[96];
      snprintf(what, sizeof what, "optimizer %d, check_numerics %d: async(1)", variant, numerics);
      CHECK_MSG(async_run_equals(m.P, &od, bn_step, &m, &sd, K, B, -1, store, what), "%s", what);
      dt_params_destroy(m.P);
      dt_params_destroy(h.P);
      free(store);
    }
  }
  alarm(0);
}

/* async_in_place: the replicas compute on the store itself. Their graphs
 * are bound to the params' own buffer (the store) where the build's sweeps
 * are vector loops (dt__shared_direct; else a warning, and copies), and not
 * without the option; refused in lock-step, with a buffer and for another
 * kind. async(1) in place makes each step in place, exactly the one-device
 * loop written by hand (dt_optim_step on the params), for every optimizer,
 * over several 2048-float blocks and the padding between parameters;
 * without the option it is the plain pull / step on the copy / store +=
 * new - pulled, by hand, and so it is in place with the atomic rule (an add
 * of new - old, from a copy of each block made as the push reaches it) and
 * with check_numerics (the whole update made and checked, then added).
 * With staleness_lr a push whose scale is 1 (async(1): nobody else pushes)
 * is made in place too. */
typedef struct wide_model {
  dt_params *P;
  dt_nn_linear l1, l2;
} wide_model;

static void wide_init(wide_model *m, int64_t width, int with_buffer) {
  m->P = dt_params_create(21);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, width, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", width, NC, 1);
  if (with_buffer) {
    int64_t bs[1] = {3};
    dt_params_add_buffer(m->P, "spare", 1, bs, dt_init_zeros());
  }
}

static dt_tensor *wide_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  wide_model *m = (wide_model *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, b->x_cols};
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

/* 1 when replica r of s computes on the params' buffer itself. */
static int async_on_store(dt_strategy *s, dt_params *P, int r) {
  dt_graph *g = dt_strategy_graph(s, r);
  dt_graph_reset(g);
  return dt_param(g, 0)->data == dt_params_data(P);
}

/* dt_strategy_create refuses sd for a wide model (with a buffer when
 * buffer): DTRAIN_ERR_UNSUPPORTED, the message naming what. */
static void async_refused(const dt_strategy_options *sd, int buffer, const char *what, int c) {
  wide_model m;
  wide_init(&m, 40, buffer);
  dt_optim *o = make_opt(m.P, DTRAIN_OPTIM_ADAM, 0.01f, 0.0f, 0.0f);
  CHECK(dt_strategy_create(m.P, o, wide_step, &m, sd) == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), what) != NULL, "%s, case %d: %s",
            what, c, dt_last_error());
  dt_optim_destroy(o);
  dt_params_destroy(m.P);
}

static void test_async_direct(void) {
  watchdog(120);
  enum { W = 1000, K = 10, B = 24 };
  const int direct = dt__shared_direct();
  /* where the replicas compute */
  for (int c = 0; c < 3; c++) {
    wide_model m;
    wide_init(&m, 40, 0);
    dt_optim *o = make_opt(m.P, DTRAIN_OPTIM_ADAM, 0.01f, 0.0f, 0.0f);
    dt_strategy_options sd = dt_strategy_async(2, c == 1 ? 3 : DTRAIN_STALENESS_UNBOUNDED);
    sd.async_in_place = c > 0;
    dt_strategy *s = dt_strategy_create(m.P, o, wide_step, &m, &sd);
    CHECK(s != NULL);
    const int want = direct && c > 0;
    for (int r = 0; s && r < 2; r++)
      CHECK_MSG(async_on_store(s, m.P, r) == want, "case %d: replica %d %s the store (direct %d)", c, r,
                want ? "does not compute on" : "computes on", direct);
    for (int k = 0; s && k < 3; k++) {
      dt_minibatch b = batch_at(k, B);
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(o);
    dt_params_destroy(m.P);
  }
  /* refused: lock-step, a buffer, another kind */
  quiet();
  for (int c = 0; c < 3; c++) {
    dt_strategy_options sd = c == 2 ? dt_strategy_mirrored(2) : dt_strategy_async(2, c == 0 ? 0 : 2);
    sd.async_in_place = 1;
    async_refused(&sd, c == 1, "async_in_place", c);
  }
  /* async(1) against the loops by hand */
  for (int variant = 0; variant < 4; variant++) {
    for (int mode = 0; mode < 5; mode++) { /* in place; copies; in place + staleness_lr, + atomic, + check_numerics */
      dt_optim_options od = async_variant(variant);
      const int in_place = direct && (mode == 0 || mode == 2); /* staleness_lr: one replica's scale is 1 */
      wide_model h, m;
      wide_init(&h, W, 0);
      wide_init(&m, W, 0);
      size_t n = dt_params_size(h.P);
      float *store = (float *)malloc(n * sizeof(float));
      CHECK(n > 4 * 2048 && store && async_by_hand(h.P, &od, wide_step, &h, K, B, in_place, store));
      dt_strategy_options sd = dt_strategy_async(1, DTRAIN_STALENESS_UNBOUNDED);
      sd.async_in_place = mode != 1;
      sd.staleness_lr = mode == 2;
      sd.async_update = mode == 3 ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
      sd.check_numerics = mode == 4;
      char what[96];
      snprintf(what, sizeof what, "optimizer %d, mode %d: async(1)", variant, mode);
      CHECK_MSG(async_run_equals(m.P, &od, wide_step, &m, &sd, K, B, direct && mode != 1, store, what), "%s", what);
      dt_params_destroy(m.P);
      dt_params_destroy(h.P);
      free(store);
    }
  }
  alarm(0);
}

/* No update is lost with DTRAIN_ASYNC_ATOMIC through the block-by-block push:
 * loss = sum(x @ W + b) with x all ones gives every parameter the gradient 1,
 * so SGD with lr 1 from integer values makes every update exactly -1, and
 * after P pushes from two free-running replicas every parameter is exactly
 * -P. Hogwild may lose some: each parameter is then an integer in [-P, 0]. */
typedef struct count_model {
  dt_params *P;
  dt_nn_linear lin;
} count_model;

static float count_ones[64];
static float count_wide[3 * 64]; /* rows of ones for dt_strategy_step's rounds */

static dt_tensor *count_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  count_model *m = (count_model *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, 64};
  return dt_sum(g, dt_nn_linear_forward(g, &m->lin, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
}

static dt_result count_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user; (void)replica; (void)step;
  memset(out, 0, sizeof *out);
  out->rows = 1;
  out->x = count_ones;
  out->x_cols = 64;
  return DTRAIN_OK;
}

static void test_async_no_lost_update(void) {
  watchdog(120);
  for (int i = 0; i < 64; i++) count_ones[i] = 1.0f;
  enum { STEPS = 400 };
  for (int c = 0; c < 4; c++) { /* each rule, on copies and in place (where the build can) */
    const int upd = c & 1;
    count_model m;
    m.P = dt_params_create(13);
    dt_nn_linear_init(&m.lin, m.P, "lin", 64, 40, 1); /* 2600 floats: two blocks */
    size_t n = dt_params_size(m.P);
    memset(dt_params_data(m.P), 0, n * sizeof(float));
    dt_optim *o = make_opt(m.P, DTRAIN_OPTIM_SGD, 1.0f, 0.0f, 0.0f);
    dt_strategy_options sd = dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED);
    sd.async_update = upd ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
    sd.async_in_place = c >> 1;
    dt_strategy *s = dt_strategy_create(m.P, o, count_step, &m, &sd);
    CHECK(s && dt_strategy_run(s, STEPS, count_next, NULL, NULL) == DTRAIN_OK);
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK(st.steps == 2 * STEPS);
    const float P = (float)(2 * STEPS);
    int wrong = 0, outside = 0;
    dt_param_info wi, bi;
    dt_params_info(m.P, m.lin.w, &wi);
    dt_params_info(m.P, m.lin.b, &bi);
    for (int which = 0; which < 2; which++) {
      const dt_param_info *pi = which ? &bi : &wi;
      for (size_t i = 0; i < pi->size; i++) {
        float v = dt_params_data(m.P)[pi->offset + i];
        wrong += v != -P;
        outside += !(v >= -P && v <= 0.0f && v == floorf(v));
      }
    }
    if (upd)
      CHECK_MSG(wrong == 0, "atomic rule, in place %d: %d of %zu parameters lost updates", c >> 1, wrong,
                wi.size + bi.size);
    CHECK_MSG(outside == 0, "update rule %d: %d parameters not an integer in [-%g, 0]", upd, outside, (double)P);
    dt_strategy_destroy(s);
    dt_optim_destroy(o);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* async_sharded: each replica owns a slice and alone updates it, with the
 * mean of its gradient and those the others handed it. Refused in
 * lock-step, with a buffer, with check_numerics and for another kind. No
 * gradient is lost, under either rule, on copies and in place, with 2 and 3
 * replicas (with 3, replica 0 owns no block: it only hands over), with a
 * 1:4 straggler (the fast replica's gradients pile up in the box to the
 * slow owner), through dt_strategy_run and dt_strategy_step: every slice's
 * updates took every push's gradient (dt__strategy_async_merged), and in
 * the count model (every gradient exactly 1, SGD lr 1: each update, a mean
 * of ones, is exactly -1) every element of a slice is exactly minus its
 * owner's number of updates, so no update was lost either. async(1)
 * sharded is the loop by hand, bit for bit (there is nobody to hand to). */
static void test_async_sharded(void) {
  watchdog(180);
  quiet();
  for (int c = 0; c < 4; c++) { /* lock-step, a buffer, check_numerics, another kind */
    dt_strategy_options sd = c == 3 ? dt_strategy_mirrored(2) : dt_strategy_async(2, c == 0 ? 0 : 2);
    sd.async_sharded = 1;
    sd.check_numerics = c == 2;
    async_refused(&sd, c == 1, "async_sharded", c);
  }
  const int direct = dt__shared_direct();
  enum { W = 1000, K = 10, B = 24 };
  for (int variant = 0; variant < 4; variant++) {
    for (int mode = 0; mode < 3; mode++) { /* on a copy; in place; on a copy with the atomic rule */
      const int in_place = mode == 1;
      dt_optim_options od = async_variant(variant);
      wide_model h, m;
      wide_init(&h, W, 0);
      wide_init(&m, W, 0);
      size_t n = dt_params_size(h.P);
      float *store = (float *)malloc(n * sizeof(float));
      /* (an owner on a copy steps its block in place too, where the sweeps are vector loops, except under the
       * atomic rule: differences added) */
      CHECK(store && async_by_hand(h.P, &od, wide_step, &h, K, B, direct && mode < 2, store));
      dt_strategy_options sd = dt_strategy_async(1, DTRAIN_STALENESS_UNBOUNDED);
      sd.async_sharded = 1;
      sd.async_in_place = in_place;
      sd.async_update = mode == 2 ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
      char what[96];
      snprintf(what, sizeof what, "optimizer %d, mode %d: async(1) sharded", variant, mode);
      CHECK_MSG(async_run_equals(m.P, &od, wide_step, &m, &sd, K, B, in_place && direct, store, what), "%s", what);
      dt_params_destroy(m.P);
      dt_params_destroy(h.P);
      free(store);
    }
  }
  for (int i = 0; i < 64; i++) count_ones[i] = 1.0f;
  for (int i = 0; i < 3 * 64; i++) count_wide[i] = 1.0f;
  enum { STEPS = 300 };
  for (int c = 0; c < 16; c++) {
    const int upd = c & 1, in_place = (c >> 1) & 1, N = (c >> 2) & 1 ? 3 : 2, slow = (c >> 3) & 1;
    count_model m;
    m.P = dt_params_create(13);
    /* 2 replicas: 6500 floats, four blocks, two each; 3: 2600 floats, two blocks, none for replica 0 */
    dt_nn_linear_init(&m.lin, m.P, "lin", 64, N == 2 ? 100 : 40, 1);
    size_t n = dt_params_size(m.P);
    memset(dt_params_data(m.P), 0, n * sizeof(float));
    dt_optim *o = make_opt(m.P, DTRAIN_OPTIM_SGD, 1.0f, 0.0f, 0.0f);
    dt_strategy_options sd = dt_strategy_async(N, DTRAIN_STALENESS_UNBOUNDED);
    sd.async_update = upd ? DTRAIN_ASYNC_ATOMIC : DTRAIN_ASYNC_HOGWILD;
    sd.async_in_place = in_place;
    sd.async_sharded = 1;
    if (slow) {
      sd.straggler = N - 1;
      sd.straggler_factor = 4.0f;
    }
    dt_strategy *s = dt_strategy_create(m.P, o, count_step, &m, &sd);
    CHECK(s && dt_strategy_run(s, STEPS, count_next, NULL, NULL) == DTRAIN_OK);
    int64_t pushes = (int64_t)N * STEPS;
    for (int k = 0; s && k < 3; k++) { /* and a few lock-step rounds of one row a replica */
      dt_minibatch b;
      CHECK(count_next(NULL, -1, k, &b) == DTRAIN_OK);
      b.rows = N;
      b.x = count_wide;
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
      pushes += N;
    }
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK(st.steps == pushes);
    const size_t blocks = (n + 2047) / 2048;
    for (int r = 0; s && r < N; r++) {
      int64_t updates, got = dt__strategy_async_merged(s, r, &updates);
      CHECK_MSG(got == pushes, "case %d (rule %d, in place %d, %d replicas, straggler %d): replica %d's slice took "
                "%lld gradients of %lld", c, upd, in_place, N, slow, r, (long long)got, (long long)pushes);
      size_t lo = DT__MIN(n, blocks * (size_t)r / (size_t)N * 2048);
      size_t hi = DT__MIN(n, blocks * (size_t)(r + 1) / (size_t)N * 2048);
      int wrong = 0;
      for (size_t i = lo; i < hi; i++) wrong += dt_params_data(m.P)[i] != -(float)updates;
      CHECK_MSG(updates >= 1 && wrong == 0, "case %d: %d of the %zu parameters of replica %d's slice are not -%lld "
                "(its updates; first: %g)", c, wrong, hi - lo, r, (long long)updates,
                (double)dt_params_data(m.P)[lo < n ? lo : 0]);
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(o);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* dt_strategy_sync: mirrored replicas pick up parameters changed by hand. */
static void test_sync_after_manual_change(void) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.0f, 0.0f);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  size_t n = dt_params_size(m.P);
  for (size_t i = 0; i < n; i++) dt_params_data(m.P)[i] *= 0.5f;
  CHECK(dt_strategy_sync(s) == DTRAIN_OK);
  dt_graph *g = dt_strategy_graph(s, 1);
  dt_graph_reset(g);
  CHECK(memcmp(dt_param(g, 0)->data, dt_params_data(m.P), n * sizeof(float)) == 0);
  dt_strategy_reset_stats(s);
  dt_strategy_stats st;
  dt_strategy_stats_get(s, &st);
  CHECK(st.steps == 0 && st.seconds == 0.0);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static void test_utilities(void) {
  CHECK(dt_cpu_count() >= 1);
  double t0 = dt_time_now();
  dt_sleep(0.01);
  CHECK(dt_time_now() - t0 >= 0.009);
  dt_sleep(-1.0);
}

/* A DTRAIN_NO_THREADS build: only one_device exists; the rest say so. */
static void test_no_threads_build(void) {
  dt_strategy_options sd = dt_strategy_mirrored(2);
  model m;
  model_init(&m, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  dt_optim *opt = dt_optim_create(m.P, &od);
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
  sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* Issue 17: a NaN loss or an Inf gradient stops the step without
 * check_numerics (the gradient used to reach the optimizer and make the
 * parameters Inf), with a message naming the replica and the step; with
 * skip_nonfinite the step is skipped: OK, NaN loss, nothing changed,
 * counted; the next step trains on. */
static int all_finite(const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

static void test_nonfinite_steps(void) {
  quiet();
  watchdog(120);
  const dt_strategy_kind kinds[4] = {DTRAIN_STRATEGY_ONE_DEVICE, DTRAIN_STRATEGY_MIRRORED,
                                     DTRAIN_STRATEGY_CENTRAL_STORAGE, DTRAIN_STRATEGY_ASYNC};
  for (int ki = 0; ki < 4; ki++)
    for (int fk = 1; fk <= 2; fk++)
      for (int skip = 0; skip < 2; skip++) {
        const int async = kinds[ki] == DTRAIN_STRATEGY_ASYNC, n_rep = ki == 0 ? 1 : 3;
        model m;
        model_init(&m, 5);
        dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0.0f);
        dt_strategy_options sd;
        memset(&sd, 0, sizeof sd);
        sd.kind = kinds[ki];
        sd.replicas = n_rep;
        sd.skip_nonfinite = skip;
        dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
        CHECK(s != NULL);
        if (!s) continue;
        size_t n = dt_params_size(m.P);
        float before[PMAX];
        dt_minibatch b = batch_at(0, 24);
        CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
        memcpy(before, dt_params_data(m.P), n * sizeof(float));
        dt_strategy_stats st;
        dt_strategy_stats_get(s, &st);
        m.fail_replica = n_rep - 1;
        m.fail_kind = fk;
        m.fail_step = async ? 1 * n_rep + (n_rep - 1) : st.steps; /* async: the ticket of round 1 */
        b = batch_at(1, 24);
        float L = 0.0f;
        dt_result rc = dt_strategy_step(s, &b, &L);
        char want[64];
        snprintf(want, sizeof want, "step %lld: ", (long long)m.fail_step);
        if (!skip) {
          CHECK_MSG(rc == DTRAIN_ERR_NONFINITE, "kind %d fail %d: got %s", ki, fk, dt_result_name(rc));
          CHECK_MSG(strstr(dt_last_error(), want) != NULL && strstr(dt_last_error(), fk == 1 ? "loss is NaN" : "gradient of"),
                    "kind %d fail %d: message '%s' does not name the step and what", ki, fk, dt_last_error());
        } else {
          CHECK_MSG(rc == DTRAIN_OK, "kind %d fail %d skip: got %s (%s)", ki, fk, dt_result_name(rc), dt_last_error());
          CHECK_MSG(L != L, "kind %d fail %d skip: loss %g, want NaN", ki, fk, (double)L);
          dt_strategy_stats_get(s, &st);
          CHECK_MSG(st.skipped_steps == 1, "kind %d fail %d: skipped_steps %lld", ki, fk, (long long)st.skipped_steps);
        }
        /* a synchronous step changes nothing; async: the others may have pushed, nothing is Inf */
        if (!async)
          CHECK_MSG(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0, "kind %d fail %d skip %d changed params",
                    ki, fk, skip);
        CHECK_MSG(all_finite(dt_params_data(m.P), n), "kind %d fail %d skip %d: params not finite", ki, fk, skip);
        m.fail_replica = -1;
        b = batch_at(2, 24);
        rc = dt_strategy_step(s, &b, &L);
        CHECK_MSG(rc == DTRAIN_OK && L == L, "kind %d fail %d skip %d: the next step: %s", ki, fk, skip,
                  dt_last_error());
        CHECK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) != 0 && all_finite(dt_params_data(m.P), n));
        dt_strategy_destroy(s);
        dt_optim_destroy(opt);
        dt_params_destroy(m.P);
      }
  alarm(0);
}

/* Issue 17: a batch of 0 rows is refused and touches nothing (it used to
 * return OK and let momentum move the parameters). */
static void test_empty_batch_refused(void) {
  quiet();
  watchdog(60);
  const dt_strategy_kind kinds[4] = {DTRAIN_STRATEGY_ONE_DEVICE, DTRAIN_STRATEGY_MIRRORED,
                                     DTRAIN_STRATEGY_CENTRAL_STORAGE, DTRAIN_STRATEGY_ASYNC};
  for (int ki = 0; ki < 4; ki++) {
    model m;
    model_init(&m, 5);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0.0f);
    dt_strategy_options sd;
    memset(&sd, 0, sizeof sd);
    sd.kind = kinds[ki];
    sd.replicas = ki == 0 ? 1 : 2;
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    CHECK(s != NULL);
    if (!s) continue;
    size_t n = dt_params_size(m.P);
    float before[PMAX];
    dt_minibatch b = batch_at(0, 16);
    CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK); /* momentum now holds a velocity */
    memcpy(before, dt_params_data(m.P), n * sizeof(float));
    int64_t steps = dt_optim_steps(opt);
    b.rows = 0;
    dt_result rc = dt_strategy_step(s, &b, NULL);
    CHECK_MSG(rc == DTRAIN_ERR_EMPTY, "kind %d: 0 rows gave %s", ki, dt_result_name(rc));
    CHECK_MSG(strstr(dt_last_error(), "0 rows") != NULL, "kind %d: '%s'", ki, dt_last_error());
    CHECK_MSG(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0, "kind %d: 0 rows changed params", ki);
    CHECK(dt_optim_steps(opt) == steps);
    b = batch_at(1, 16);
    CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* multi_worker_mirrored in one process (a world of 1 rank): an empty global
 * batch is refused, a NaN loss on a local replica is skipped with
 * skip_nonfinite (the exchange carries the reason). */
static void test_mwm_nonfinite_and_empty(void) {
  quiet();
  watchdog(60);
  for (int skip = 0; skip < 2; skip++) {
    model m;
    model_init(&m, 5);
    dt_optim *opt = make_opt(m.P, DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0.0f);
    dt_comm *world = dt_comm_create_threads(1, -1);
    CHECK(world != NULL);
    dt_strategy_options sd = dt_strategy_multi_worker_mirrored(world, 2);
    sd.skip_nonfinite = skip;
    dt_strategy *s = world ? dt_strategy_create(m.P, opt, model_step, &m, &sd) : NULL;
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    if (s) {
      size_t n = dt_params_size(m.P);
      float before[PMAX];
      dt_minibatch b = batch_at(0, 16);
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
      memcpy(before, dt_params_data(m.P), n * sizeof(float));
      b.rows = 0;
      dt_result rc = dt_strategy_step(s, &b, NULL);
      CHECK_MSG(rc == DTRAIN_ERR_EMPTY && strstr(dt_last_error(), "0 rows"), "empty global batch: %s (%s)",
                dt_result_name(rc), dt_last_error());
      m.fail_replica = 1;
      m.fail_kind = 1;
      m.fail_step = 1; /* a refused step does not count: this is step 1 again */
      b = batch_at(1, 16);
      float L = 0.0f;
      rc = dt_strategy_step(s, &b, &L);
      if (skip) CHECK_MSG(rc == DTRAIN_OK && L != L, "skip: %s (%s)", dt_result_name(rc), dt_last_error());
      else CHECK_MSG(rc == DTRAIN_ERR_NONFINITE && strstr(dt_last_error(), "step 1: loss is NaN"), "%s (%s)",
                     dt_result_name(rc), dt_last_error());
      CHECK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0);
      m.fail_replica = -1;
      b = batch_at(2, 16);
      CHECK_MSG(dt_strategy_step(s, &b, &L) == DTRAIN_OK && L == L, "after: %s", dt_last_error());
    }
    dt_strategy_destroy(s);
    dt_comm_destroy(world);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

/* ---- the gradient zeroed lazily ---------------------------------------------------------------
 * A strategy does not zero a replica's gradient before the step: each
 * parameter's is zeroed by its first use (a linear layer's weight gradient
 * written by the GEMM instead of added to zeros) and what no op touched is
 * zeroed after backward. A model with every case: weights written once
 * (l1, l3), a weight used twice (l2: written, then added to), a parameter
 * never used (idle) and one used by an op whose output leads nowhere
 * (dead: on the tape, no gradient flows to it). The replicas' gradients
 * are filled with NaN before each step: none of it may survive. */
typedef struct lazy_model {
  dt_params *P;
  dt_nn_linear l1, l2, l3, idle, dead;
} lazy_model;

static void lazy_init(lazy_model *m) {
  m->P = dt_params_create(7);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 10, 1);
  dt_nn_linear_init(&m->idle, m->P, "idle", 3, 5, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 10, 10, 1);
  dt_nn_linear_init(&m->dead, m->P, "dead", 10, 4, 1);
  dt_nn_linear_init(&m->l3, m->P, "l3", 10, NC, 1);
}

static dt_tensor *lazy_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  lazy_model *m = (lazy_model *)user;
  (void)replica;
  int64_t xs[2];
  xs[0] = b->rows;
  xs[1] = b->x_cols;
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
  h = dt_tanh(g, dt_nn_linear_forward(g, &m->l2, h));
  (void)dt_nn_linear_forward(g, &m->dead, h); /* computed, never used */
  h = dt_tanh(g, dt_nn_linear_forward(g, &m->l2, h));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l3, h), b->y);
}

/* The range of a linear layer's weight and bias in the flat buffer. */
static void lazy_range(dt_params *P, const dt_nn_linear *l, size_t *b, size_t *e) {
  dt_param_info w, bias;
  *b = *e = 0;
  if (dt_params_info(P, l->w, &w) == DTRAIN_OK && dt_params_info(P, l->b, &bias) == DTRAIN_OK) {
    *b = w.offset;
    *e = bias.offset + bias.size;
  }
}

static void test_lazy_grad_zeroing(void) {
  watchdog(60);
  enum { K = 6 };
  const int64_t B = 24;
  lazy_model h, m;
  lazy_init(&h);
  lazy_init(&m);
  size_t n = dt_params_size(h.P);
  CHECK(n <= PMAX && n == dt_params_size(m.P));
  /* by hand: zeroed, then backward */
  dt_optim *oh = make_opt(h.P, DTRAIN_OPTIM_ADAM, 0.01f, 0.0f, 0.0f);
  dt_graph *g = dt_graph_create(h.P, NULL);
  /* the strategy, its gradient poisoned before each step */
  dt_optim *om = make_opt(m.P, DTRAIN_OPTIM_ADAM, 0.01f, 0.0f, 0.0f);
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(m.P, om, lazy_step, &m, &sd);
  CHECK(s != NULL && g != NULL);
  size_t ib, ie, db, de;
  lazy_range(m.P, &m.idle, &ib, &ie);
  lazy_range(m.P, &m.dead, &db, &de);
  CHECK(ie > ib && de > db);
  int grads_differ = 0, nonzero = 0;
  for (int k = 0; s && g && k < K; k++) {
    dt_minibatch b = batch_at(k, B);
    b.step = k;
    dt_graph_reset(g);
    dt_params_zero_grad(h.P);
    CHECK(dt_backward(g, lazy_step(g, 0, &b, &h)) == DTRAIN_OK);
    float *gm = dt_params_grad(m.P);
    for (size_t i = 0; i < n; i++) gm[i] = NAN;
    CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    const float *gh = dt_params_grad(h.P);
    for (size_t i = 0; i < n; i++) grads_differ += !(gm[i] == gh[i]); /* (-0 == +0: a GEMM with beta 0 may write -0) */
    for (size_t i = ib; i < ie; i++) nonzero += gm[i] != 0.0f;
    for (size_t i = db; i < de; i++) nonzero += gm[i] != 0.0f;
    dt_optim_step(oh);
  }
  CHECK_MSG(grads_differ == 0, "%d gradient elements differ from zero_grad + backward", grads_differ);
  CHECK_MSG(nonzero == 0, "%d gradient elements of the idle and dead layers are not zero", nonzero);
  CHECK_MSG(memcmp(dt_params_data(m.P), dt_params_data(h.P), n * sizeof(float)) == 0,
            "one_device's parameters differ from the hand loop's");
  memcpy(ref, dt_params_data(m.P), n * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(om);
  dt_params_destroy(m.P);
  dt_graph_destroy(g);
  dt_optim_destroy(oh);
  dt_params_destroy(h.P);
  if (!(dt_build_features() & DTRAIN_FEATURE_DIST)) {
    th_skip("mirrored is compiled out (DTRAIN_NO_DIST); one_device was checked");
    alarm(0);
    return;
  }
  /* replicas (their gradients hold the last step's values at the start of
   * the next), plain and with overlap in small buckets: the same training,
   * the idle and dead weights never move */
  for (int ov = 0; ov < 2; ov++) {
    lazy_init(&m);
    float start[PMAX];
    memcpy(start, dt_params_data(m.P), n * sizeof(float));
    om = make_opt(m.P, DTRAIN_OPTIM_ADAM, 0.01f, 0.0f, 0.0f);
    sd = dt_strategy_mirrored(2);
    if (ov) {
      sd.overlap = 1;
      sd.bucket_bytes = 64;
    }
    s = dt_strategy_create(m.P, om, lazy_step, &m, &sd);
    CHECK(s != NULL);
    for (int k = 0; s && k < K; k++) {
      dt_minibatch b = batch_at(k, B);
      for (int r = 0; r < 2; r++) { /* every replica's gradient poisoned */
        float *gr = dt_graph_param_grad(dt_strategy_graph(s, r));
        for (size_t i = 0; gr && i < n; i++) gr[i] = NAN;
      }
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    }
    const float *p = dt_params_data(m.P);
    CHECK_MSG(memcmp(p + ib, start + ib, (ie - ib) * sizeof(float)) == 0, "overlap %d: the idle layer moved", ov);
    CHECK_MSG(memcmp(p + db, start + db, (de - db) * sizeof(float)) == 0, "overlap %d: the dead layer moved", ov);
    double e = rel_err(p, ref, n);
    CHECK_MSG(e <= 1e-5, "mirrored(2) overlap %d: relative error %g against one_device", ov, e);
    dt_strategy_destroy(s);
    dt_optim_destroy(om);
    dt_params_destroy(m.P);
  }
  alarm(0);
}

int main(void) {
  make_data();
  if (!(dt_build_features() & DTRAIN_FEATURE_THREADS)) {
    TH_RUN(test_no_threads_build);
    th_skip_item("strategy threaded tests", "built without threads (DTRAIN_NO_THREADS)");
    return th_summary("strategy");
  }
  if (!(dt_build_features() & DTRAIN_FEATURE_DIST)) {
    TH_RUN(test_no_threads_build); /* the same rule: one_device works, the other kinds say so */
    TH_RUN(test_utilities);
    TH_RUN(test_comm_slices);
    TH_RUN(test_one_device_equals_hand_loop);
    th_skip_item("strategy tests of the other kinds and communicators", "compiled out (DTRAIN_NO_DIST)");
    return th_summary("strategy");
  }
  TH_RUN(test_utilities);
  TH_RUN(test_comm_slices);
  TH_RUN(test_comm_collectives);
  TH_RUN(test_comm_reduce_scatter_finite);
  TH_RUN(test_comm_errors);
  TH_RUN(test_one_device_equals_hand_loop);
  TH_RUN(test_mirrored_equals_one_device);
  TH_RUN(test_shared_copy);
  TH_RUN(test_cache_handoff);
  TH_RUN(test_lazy_grad_zeroing);
  TH_RUN(test_central_storage_equals_mirrored);
  TH_RUN(test_uneven_and_empty_shards);
  TH_RUN(test_async_lockstep_equals_sync);
  TH_RUN(test_async_run_lockstep);
  TH_RUN(test_async_converges);
  TH_RUN(test_staleness_bound_stress);
  TH_RUN(test_async_strategy_staleness);
  TH_RUN(test_errors_reach_every_replica);
  TH_RUN(test_nonfinite_steps);
  TH_RUN(test_empty_batch_refused);
  TH_RUN(test_mwm_nonfinite_and_empty);
  TH_RUN(test_async_run_error);
  TH_RUN(test_batch_fn_errors);
  TH_RUN(test_desc_and_args);
  TH_RUN(test_loss_must_be_scalar);
  TH_RUN(test_batch_norm_buffers);
  TH_RUN(test_async_lean_push);
  TH_RUN(test_async_direct);
  TH_RUN(test_async_no_lost_update);
  TH_RUN(test_async_sharded);
  TH_RUN(test_sync_after_manual_change);
  return th_summary("strategy");
}
