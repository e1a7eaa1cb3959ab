/* Backup workers (mirrored with desc.backup_workers, dt_strategy_backup.c):
 * every step applies exactly one average of N-B gradients (a model whose
 * gradient is the same constant whatever the rows gives the exact final
 * parameters), the counts add up, no ticket's rows are lost (a dropped one
 * is handed out again), a straggler does not stop training, failures and
 * non-finite batches end or skip without a hang, clipping uses the norm of
 * the whole average (a watchdog alarm fails the
 * program on one), and the arguments are checked. Only the main thread runs
 * CHECKs; replica threads record into atomics. */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"
#include <signal.h>
#include <time.h>
#include <unistd.h>

static void watchdog_fired(int sig) {
  static const char msg[] = "FAIL watchdog: test_strategy_backup hung (deadlock?)\n";
  (void)sig;
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}
static void watchdog(unsigned seconds) {
  signal(SIGALRM, watchdog_fired);
  alarm(seconds);
}

#define NF 4
#define MAXT 4096
static const float C[NF] = {0.5f, -1.0f, 0.25f, 2.0f};
static float X[8 * NF];  /* 8 rows, each C */
static float XN[8 * NF]; /* 8 rows of NaN */

/* ---- the task: loss = mean over rows of x . w, so the gradient is C for any rows ------ */
typedef struct task {
  int rows_of[3];                 /* ticket k has rows_of[k % 3] rows */
  int64_t fail_at, nan_at;        /* the batch function fails / hands out NaN rows at this ticket (-1: never) */
  int asked[MAXT];                /* requests per ticket (atomic builtins: replica threads) */
  int by[MAXT];                   /* bit r: replica r asked for it */
  int beyond;                     /* requests for tickets >= MAXT */
  dt_strategy *s;                 /* the strategy the tickets are for (fail_at: its failure is waited for) */
} task;

static dt_result next_batch(void *user, int replica, int64_t ticket, dt_minibatch *out) {
  task *tk = (task *)user;
  if (ticket < 0 || ticket >= MAXT || replica < 0 || replica > 30) {
    __atomic_fetch_add(&tk->beyond, 1, __ATOMIC_RELAXED);
    return DTRAIN_ERR_INDEX;
  }
  __atomic_fetch_add(&tk->asked[ticket], 1, __ATOMIC_RELAXED);
  __atomic_fetch_or(&tk->by[ticket], 1 << replica, __ATOMIC_RELAXED);
  if (ticket == tk->fail_at) return DTRAIN_ERR_IO;
  /* a later ticket waits (20 s at most) until the strategy has recorded the failure
     (dt__strategy_failed: this test links the library, Makefile's LINKED_TESTS): whatever
     the scheduling, no gradient drawn after the failing ticket is ready before it */
  for (int ms = 0; tk->fail_at >= 0 && ticket > tk->fail_at && tk->s && ms < 20000; ms++) {
    if (dt__strategy_failed(tk->s)) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  memset(out, 0, sizeof *out);
  out->rows = tk->rows_of[ticket % 3];
  out->x = ticket == tk->nan_at ? XN : X;
  out->x_cols = NF;
  return DTRAIN_OK;
}

static dt_tensor *lin_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  int64_t xs[2] = {b->rows, NF};
  (void)replica; (void)user;
  return dt_mean(g, dt_matmul(g, dt_tensor_wrap(g, 2, xs, (float *)b->x), dt_param(g, 0)));
}

typedef struct rig {
  dt_params *P;
  dt_optim *opt;
  dt_strategy *s;
  task tk;
} rig;

static float rig_clip; /* clip_norm of the next rig's optimizer */

static int rig_make(rig *R, int N, int B, int straggler, float factor, int skip_nonfinite) {
  memset(R, 0, sizeof *R);
  R->tk.rows_of[0] = 1;
  R->tk.rows_of[1] = 2;
  R->tk.rows_of[2] = 5;
  R->tk.fail_at = R->tk.nan_at = -1;
  R->P = dt_params_create(3);
  int64_t ws[2] = {NF, 1};
  dt_params_add(R->P, "w", 2, ws, dt_init_constant(0.0f));
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.125f;
  od.clip_norm = rig_clip;
  R->opt = dt_optim_create(R->P, &od);
  dt_strategy_options sd = dt_strategy_mirrored(N);
  sd.backup_workers = B;
  sd.skip_nonfinite = skip_nonfinite;
  if (factor > 1.0f) {
    sd.straggler = straggler;
    sd.straggler_factor = factor;
  }
  R->s = dt_strategy_create(R->P, R->opt, lin_step, NULL, &sd);
  return R->s != NULL;
}

static void rig_free(rig *R) {
  dt_strategy_destroy(R->s);
  dt_optim_destroy(R->opt);
  dt_params_destroy(R->P);
}

/* Every step: one average of C -> w = -lr * steps * C exactly (powers of two). */
static void check_exact(rig *R, int64_t steps) {
  const float *w = dt_params_data(R->P);
  for (int i = 0; i < NF; i++) CHECK_NEAR(w[i], -0.125 * (double)steps * C[i], 1e-5 * (double)steps);
}

static void test_each_step_one_average(void) {
  watchdog(120);
  const int cases[][4] = {{2, 1, 1, 8}, {3, 1, 2, 10}, {4, 2, 0, 6}, {4, 3, 3, 4}}; /* N, B, straggler, factor */
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int N = cases[c][0], B = cases[c][1];
    rig R;
    CHECK(rig_make(&R, N, B, cases[c][2], (float)cases[c][3], 0));
    if (!R.s) { rig_free(&R); continue; }
    const int64_t S = 24;
    float mean = 0.0f;
    CHECK(dt_strategy_run(R.s, S, next_batch, &R.tk, &mean) == DTRAIN_OK);
    check_exact(&R, S);
    dt_strategy_stats st;
    CHECK(dt_strategy_stats_get(R.s, &st) == DTRAIN_OK);
    CHECK(st.steps == S);
    int64_t used = 0, dropped = 0;
    for (int r = 0; r < N; r++) {
      dt_replica_stats rs;
      CHECK(dt_strategy_replica_stats(R.s, r, &rs) == DTRAIN_OK);
      CHECK(rs.result == DTRAIN_OK);
      used += rs.steps;
      dropped += rs.dropped;
    }
    CHECK_MSG(used == S * (N - B), "N %d B %d: %lld gradients used in %lld steps", N, B, (long long)used, (long long)S);
    CHECK(st.dropped_grads == dropped);
    /* tickets: none lost, asked again only after a drop */
    int64_t asked = 0, top = 0;
    for (int64_t k = 0; k < MAXT; k++) {
      int a = __atomic_load_n(&R.tk.asked[k], __ATOMIC_RELAXED);
      asked += a;
      if (a) top = k + 1;
    }
    int64_t never = 0, same = 0;
    for (int64_t k = 0; k < top; k++) {
      int a = __atomic_load_n(&R.tk.asked[k], __ATOMIC_RELAXED), by = __atomic_load_n(&R.tk.by[k], __ATOMIC_RELAXED);
      never += a == 0;
      same += a > 1 && __builtin_popcount((unsigned)by) < 2; /* a dropped ticket goes to another replica */
    }
    CHECK(never == 0);
    CHECK(same == 0);
    CHECK(__atomic_load_n(&R.tk.beyond, __ATOMIC_RELAXED) == 0);
    CHECK_MSG(asked - top <= dropped, "asked %lld for %lld tickets, %lld dropped", (long long)asked, (long long)top,
              (long long)dropped);
    /* the loss of each step is x . w at its pull: finite, and the mean of the run's */
    CHECK(isfinite(mean));
    /* the run goes on from where it stopped: 8 more steps, the same rule */
    CHECK(dt_strategy_run(R.s, 8, next_batch, &R.tk, NULL) == DTRAIN_OK);
    check_exact(&R, S + 8);
    CHECK(dt_strategy_stats_get(R.s, &st) == DTRAIN_OK && st.steps == S + 8);
    rig_free(&R);
  }
  alarm(0);
}

/* The samples counted are the rows of the gradients used. */
static void test_samples_are_rows_used(void) {
  watchdog(60);
  rig R;
  CHECK(rig_make(&R, 3, 2, 0, 1.0f, 0)); /* one gradient per step */
  if (R.s) {
    R.tk.rows_of[0] = R.tk.rows_of[1] = R.tk.rows_of[2] = 3;
    CHECK(dt_strategy_run(R.s, 10, next_batch, &R.tk, NULL) == DTRAIN_OK);
    dt_strategy_stats st;
    CHECK(dt_strategy_stats_get(R.s, &st) == DTRAIN_OK);
    CHECK(st.samples == 10 * 3);
    int64_t processed = 0;
    for (int r = 0; r < 3; r++) {
      dt_replica_stats rs;
      dt_strategy_replica_stats(R.s, r, &rs);
      processed += rs.samples;
    }
    CHECK(processed >= st.samples);
  }
  rig_free(&R);
  alarm(0);
}

static void test_failures_end_the_run(void) {
  watchdog(60);
  rig R;
  CHECK(rig_make(&R, 3, 1, 1, 4.0f, 0));
  if (R.s) {
    R.tk.fail_at = 7;
    R.tk.s = R.s;
    CHECK_ERR(dt_strategy_run(R.s, 50, next_batch, &R.tk, NULL), DTRAIN_ERR_IO, "batch function failed");
    dt_strategy_stats st;
    dt_strategy_stats_get(R.s, &st);
    CHECK(st.failed_replica >= 0 && st.failed_replica < 3);
    /* the 7 tickets before the failing one make at most 3 steps of 2 gradients (a ticket
       is handed out again only when its gradient was dropped); a gradient drawn after it
       is ready only once the failure is recorded, which must keep it out of any step */
    CHECK_MSG(st.steps <= 3, "%lld steps closed", (long long)st.steps);
    for (int r = 0; r < 3; r++) {
      dt_replica_stats rs;
      dt_strategy_replica_stats(R.s, r, &rs);
      CHECK(rs.result == (r == st.failed_replica ? DTRAIN_ERR_IO : DTRAIN_ERR_ABORTED) || rs.result == DTRAIN_OK);
    }
    /* still usable: the parameters moved by whole steps only */
    R.tk.fail_at = -1;
    int64_t before = st.steps;
    CHECK(dt_strategy_run(R.s, 5, next_batch, &R.tk, NULL) == DTRAIN_OK);
    check_exact(&R, before + 5);
  }
  rig_free(&R);
  /* a NaN batch: fails the run, or with skip_nonfinite stays out of its step */
  for (int skip = 0; skip < 2; skip++) {
    CHECK(rig_make(&R, 3, 1, 0, 1.0f, skip));
    if (!R.s) { rig_free(&R); continue; }
    R.tk.nan_at = 4;
    dt_result rc = dt_strategy_run(R.s, 12, next_batch, &R.tk, NULL);
    dt_strategy_stats st;
    dt_strategy_stats_get(R.s, &st);
    if (skip) {
      CHECK(rc == DTRAIN_OK);
      CHECK(st.skipped_steps == 1 && st.steps == 12);
      check_exact(&R, 12); /* the NaN rows never reached the parameters */
    } else {
      CHECK(rc == DTRAIN_ERR_NONFINITE && strstr(dt_last_error(), "NaN"));
      const float *w = dt_params_data(R.P);
      for (int i = 0; i < NF; i++) CHECK(isfinite(w[i]));
    }
    rig_free(&R);
  }
  alarm(0);
}

/* clip_norm: the norm of each step's average (|C|, from every contributor's
 * slice) is clipped to 1: every step moves lr * C / |C|. */
static void test_clipping(void) {
  watchdog(60);
  rig R;
  rig_clip = 1.0f;
  CHECK(rig_make(&R, 4, 1, 3, 4.0f, 0));
  rig_clip = 0.0f;
  if (R.s) {
    CHECK(dt_strategy_run(R.s, 12, next_batch, &R.tk, NULL) == DTRAIN_OK);
    double n = 0;
    for (int i = 0; i < NF; i++) n += (double)C[i] * C[i];
    n = sqrt(n);
    const float *w = dt_params_data(R.P);
    for (int i = 0; i < NF; i++) CHECK_NEAR(w[i], -0.125 * 12 * C[i] / n, 1e-5);
  }
  rig_free(&R);
  alarm(0);
}

static void test_arguments(void) {
  rig R;
  CHECK(!rig_make(&R, 3, 3, 0, 1.0f, 0));
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG && strstr(dt_last_error(), "backup_workers 3"));
  rig_free(&R);
  CHECK(!rig_make(&R, 3, -1, 0, 1.0f, 0));
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  rig_free(&R);
  /* the other kinds say it is mirrored's */
  dt_params *P = dt_params_create(1);
  int64_t ws[2] = {NF, 1};
  dt_params_add(P, "w", 2, ws, dt_init_zeros());
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.1f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_strategy_options k[3] = {dt_strategy_central_storage(2), dt_strategy_async(2, 0), dt_strategy_one_device()};
  for (int i = 0; i < 3; i++) {
    k[i].backup_workers = 1;
    CHECK_ERR(TH_RESULT(dt_strategy_create(P, opt, lin_step, NULL, &k[i])),
              DTRAIN_ERR_UNSUPPORTED, "backup_workers");
  }
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  /* a step cannot return before its slowest replica: dt_strategy_step refuses */
  CHECK(rig_make(&R, 2, 1, 0, 1.0f, 0));
  if (R.s) {
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    b.rows = 2;
    b.x = X;
    b.x_cols = NF;
    CHECK_ERR(dt_strategy_step(R.s, &b, NULL), DTRAIN_ERR_UNSUPPORTED, "dt_strategy_run");
    const float *w = dt_params_data(R.P);
    for (int i = 0; i < NF; i++) CHECK(w[i] == 0.0f);
  }
  rig_free(&R);
}

int main(void) {
  for (int i = 0; i < 8 * NF; i++) {
    X[i] = C[i % NF];
    XN[i] = NAN;
  }
  if (!(dt_build_features() & DTRAIN_FEATURE_THREADS) || !(dt_build_features() & DTRAIN_FEATURE_DIST)) {
    th_skip_item("backup workers", "mirrored is compiled out (DTRAIN_NO_THREADS or DTRAIN_NO_DIST)");
    return th_summary("strategy_backup");
  }
  dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG);
  TH_RUN(test_each_step_one_average);
  TH_RUN(test_samples_are_rows_used);
  TH_RUN(test_failures_end_the_run);
  TH_RUN(test_clipping);
  TH_RUN(test_arguments);
  return th_summary("strategy_backup");
}
