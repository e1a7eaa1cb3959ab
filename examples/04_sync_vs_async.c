/* 04_sync_vs_async.c -- the same model and step function under every
 * data-parallel strategy, side by side: synchronous or asynchronous?
 *
 * Shows: writing the step once and changing the strategy in one line
 * (dt_strategy_one_device, dt_strategy_mirrored, dt_strategy_central_storage, dt_strategy_async), dt_strategy_run
 * with a batch function, the statistics (samples/s, barrier wait, staleness).
 *
 * Build: cc -std=c11 -O2 -I. examples/04_sync_vs_async.c -o sync_vs_async -lm -lpthread   (or: make)
 * Run:   build/examples/04_sync_vs_async [--replicas N] [--steps S] [--batch B] [--lr LR]
 *                                        [--max-staleness K] [--straggler R:F] [--backup-workers B]
 *                                        [--async-in-place] [--seed S]
 *
 * The task: a random "teacher" network labels Gaussian inputs (32 features,
 * 10 classes); a student MLP 32-256-256-10 learns it with Adam. Every
 * strategy sees the same samples: S steps of a global batch of B (async: S*N
 * pushes of B/N rows each). Prints one row per strategy: samples/s, the
 * final loss on the training set, test accuracy, the share of time the
 * replicas waited for each other, and the staleness of async updates.
 *
 * Try --straggler 1:4 (replica 1 is 4 times slower): the synchronous
 * strategies wait for it at every step, async without a bound keeps its
 * throughput (the fast replica does most of the steps), and a bound k sits
 * in between -- the seeds' trade-off, at some cost in loss per sample.
 * Add --backup-workers B (B < N) for one more row: mirrored whose steps
 * close with the first N-B gradients to arrive (of B/(N-B) rows each: a
 * step is still a global batch) and drop the late ones (Chen et al., 2016),
 * so the straggler no longer sets the pace either. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NIN 32
#define NHID 64   /* the teacher's hidden units */
#define WIDTH 256 /* the student's */
#define NCLS 10
#define NTRAIN 16384
#define NTEST 4096

static float train_x[NTRAIN * NIN], test_x[NTEST * NIN];
static int32_t train_y[NTRAIN], test_y[NTEST];

/* ---- data: a random teacher network labels Gaussian points ---------------------- */
static void make_data(uint64_t seed) {
  dt_rng r;
  dt_rng_seed(&r, seed);
  static float w1[NHID * NIN], w2[NCLS * NHID];
  for (int i = 0; i < NHID * NIN; i++) w1[i] = dt_rng_normal(&r) / 4.0f;
  for (int i = 0; i < NCLS * NHID; i++) w2[i] = dt_rng_normal(&r) / 4.0f;
  for (int i = 0; i < NTRAIN + NTEST; i++) {
    float *x = i < NTRAIN ? train_x + i * NIN : test_x + (i - NTRAIN) * NIN;
    float h[NHID];
    for (int f = 0; f < NIN; f++) x[f] = dt_rng_normal(&r);
    for (int j = 0; j < NHID; j++) {
      float s = 0.0f;
      for (int f = 0; f < NIN; f++) s += w1[j * NIN + f] * x[f];
      h[j] = s > 0.0f ? s : 0.0f;
    }
    int best = 0;
    float bv = -1e30f;
    for (int c = 0; c < NCLS; c++) {
      float s = 0.0f;
      for (int j = 0; j < NHID; j++) s += w2[c * NHID + j] * h[j];
      if (s > bv) { bv = s; best = c; }
    }
    if (i < NTRAIN) train_y[i] = best;
    else test_y[i - NTRAIN] = best;
  }
}

/* ---- the model and its step: written once, run by every strategy --------------- */
typedef struct model {
  dt_nn_linear l1, l2, l3;
} model;

static dt_tensor *forward(dt_graph *g, const model *m, dt_tensor *x) {
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, x));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  return dt_nn_linear_forward(g, &m->l3, h);
}

/* replica r's loss on its shard: the mean over the shard, as for one device */
static dt_tensor *step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  int64_t xs[2];
  (void)replica;
  xs[0] = b->rows;
  xs[1] = NIN;
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  return dt_cross_entropy(g, forward(g, (const model *)user, x), b->y);
}

/* ---- data feeding: batch number `step` -> rows of the training set ------------- */
typedef struct feed {
  int64_t rows; /* rows per batch handed out */
} feed;

static dt_result next_batch(void *user, int replica, int64_t step, dt_minibatch *out) {
  const feed *f = (const feed *)user;
  (void)replica; /* sync: -1 (the global batch); async: the replica, whose ticket is `step` */
  int64_t per_epoch = NTRAIN / f->rows;
  int64_t first = (step % per_epoch) * f->rows;
  memset(out, 0, sizeof *out);
  out->rows = f->rows;
  out->x = train_x + first * NIN;
  out->x_cols = NIN;
  out->y = train_y + first;
  return DTRAIN_OK;
}

/* ---- evaluation ------------------------------------------------------------------- */
static void evaluate(dt_params *P, const model *m, const float *x, const int32_t *y, int n, double *loss,
                     double *acc) {
  dt_graph *g = dt_graph_create(P, NULL);
  dt_graph_set_grad_enabled(g, 0);
  int64_t xs[2] = {n, NIN};
  dt_tensor *logits = forward(g, m, dt_tensor_wrap(g, 2, xs, (float *)x));
  dt_tensor *L = dt_cross_entropy(g, logits, y);
  int64_t ok = logits ? dt_count_correct(logits->data, y, n, NCLS) : 0; /* argmax == label */
  if (ok < 0) ok = 0;
  *loss = L ? dt_item(L) : NAN;
  *acc = (double)ok / n;
  dt_graph_destroy(g);
}

typedef struct options {
  int replicas, max_staleness, straggler, backup, in_place, sharded;
  int64_t steps, batch;
  float lr, factor;
  uint64_t seed;
} options;

/* Returns 1 to go on, 0 after printing what is wrong (exit 2), -1 after the help (exit 0). */
static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->replicas = 2;
  o->max_staleness = 4;
  o->steps = 200;
  o->batch = 256;
  o->lr = 0.003f;
  o->seed = 1;
  const char *straggler = NULL;
  const char *trace = NULL; /* --trace */
  const ex_flag flags[] = {
      {"replicas", 'i', &o->replicas, 1, DTRAIN_MAX_REPLICAS, "replicas (threads) of every strategy but one_device"},
      {"steps", 'l', &o->steps, 1, 1e9, "training steps of each strategy"},
      {"batch", 'l', &o->batch, 1, NTRAIN, "the global batch (each replica takes batch/replicas)"},
      {"lr", 'f', &o->lr, 0, 100, "Adam's learning rate"},
      {"max-staleness", 'i', &o->max_staleness, -1, 1e9, "the bounded async run's staleness bound"},
      {"straggler", 's', &straggler, 0, 0, "R:F -- replica R takes F times as long per step (e.g. 1:4)"},
      {"backup-workers", 'i', &o->backup, 0, DTRAIN_MAX_REPLICAS, "mirrored with B backup replicas (0: not run)"},
      {"async-in-place", 'b', &o->in_place, 0, 0, "the async replicas compute on the shared parameters themselves"},
      {"async-sharded", 'b', &o->sharded, 0, 0,
       "each async replica alone updates its own slice of the parameters (the mean of the gradients handed to it)"},
      {"seed", 'u', &o->seed, 0, 1.8e19, "seed of the data and the weights"},
      {"trace", 's', &trace, 0, 0, EX_TRACE_HELP},
  };
  const int n = (int)(sizeof flags / sizeof flags[0]);
  int r = ex_parse("04_sync_vs_async", argc, argv, flags, n, NULL);
  if (r == 0) ex_usage(stderr, "04_sync_vs_async", flags, n, NULL);
  if (r <= 0) return r;
  if (!ex_trace_begin(trace)) return 0;
  o->straggler = -1;
  o->factor = 1.0f;
  if (straggler) {
    char tail;
    if (sscanf(straggler, "%d:%f%c", &o->straggler, &o->factor, &tail) != 2 || o->straggler < 0 || !(o->factor >= 1.0f)) {
      fprintf(stderr, "error: --straggler wants R:F with F >= 1, e.g. 1:4, not '%s'\n", straggler);
      return 0;
    }
  }
  if (o->replicas < 1 || o->replicas > DTRAIN_MAX_REPLICAS || o->steps < 1 || o->batch < o->replicas ||
      o->batch > NTRAIN) {
    fprintf(stderr, "need 1 <= replicas <= %d, steps >= 1, replicas <= batch <= %d\n", DTRAIN_MAX_REPLICAS, NTRAIN);
    return 0;
  }
  if (o->in_place && o->max_staleness == 0) {
    fprintf(stderr, "error: --async-in-place needs --max-staleness other than 0 (lock-step async runs on copies)\n");
    return 0;
  }
  if (o->sharded && o->max_staleness == 0) {
    fprintf(stderr, "error: --async-sharded needs --max-staleness other than 0 (lock-step async steps in turns)\n");
    return 0;
  }
  if (o->backup < 0 || (o->backup > 0 && o->backup >= o->replicas)) {
    fprintf(stderr, "--backup-workers: B = %d, need 0 <= B < replicas (%d)\n", o->backup, o->replicas);
    return 0;
  }
  if (o->straggler >= o->replicas) {
    fprintf(stderr, "--straggler: replica %d does not exist (replicas: %d)\n", o->straggler, o->replicas);
    return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, below, not by dtrain's logger too */
  options o;
  int pr = parse(argc, argv, &o);
  if (pr <= 0) return pr < 0 ? 0 : 2;
  make_data(1234);
  int N = o.replicas;
  enum { NSTRAT = 6 };
  dt_strategy_options sds[NSTRAT];
  char names[NSTRAT][48];
  sds[0] = dt_strategy_one_device();
  sds[1] = dt_strategy_mirrored(N);
  sds[2] = dt_strategy_central_storage(N);
  sds[3] = dt_strategy_async(N, o.max_staleness);
  sds[4] = dt_strategy_async(N, DTRAIN_STALENESS_UNBOUNDED);
  sds[3].async_in_place = sds[4].async_in_place = o.in_place;
  sds[3].async_sharded = sds[4].async_sharded = o.sharded;
  snprintf(names[0], sizeof names[0], "one_device");
  snprintf(names[1], sizeof names[1], "mirrored(%d)", N);
  snprintf(names[2], sizeof names[2], "central_storage(%d)", N);
  if (o.max_staleness < 0) snprintf(names[3], sizeof names[3], "async(%d, unbounded)", N);
  else snprintf(names[3], sizeof names[3], "async(%d, %d)", N, o.max_staleness);
  snprintf(names[4], sizeof names[4], "async(%d, unbounded)", N);
  sds[5] = dt_strategy_mirrored(N);
  sds[5].backup_workers = o.backup;
  snprintf(names[5], sizeof names[5], "mirrored(%d), %d backup", N, o.backup);

  printf("teacher-student task: %d inputs, %d classes, %d train / %d test; MLP %d-%d-%d-%d, Adam lr %g\n", NIN,
         NCLS, NTRAIN, NTEST, NIN, WIDTH, WIDTH, NCLS, (double)o.lr);
  printf("%lld steps of a global batch of %lld (async: %lld pushes of %lld rows); %d replicas on %d CPUs",
         (long long)o.steps, (long long)o.batch, (long long)(o.steps * N), (long long)(o.batch / N), N,
         dt_cpu_count());
  if (o.straggler >= 0 && o.factor > 1.0f)
    printf("; replica %d is %gx slower (one_device, a single replica, is not slowed)", o.straggler, (double)o.factor);
  printf("\n\n%-22s %11s %9s %11s %9s %10s %s\n", "strategy", "samples/s", "steps/s", "train loss", "test acc", "wait",
         "staleness (mean / max)");
  for (int k = 0; k < NSTRAT; k++) {
    dt_strategy_options sd = sds[k]; /* <- the one line that picks the strategy */
    if (k == 4 && o.max_staleness < 0) continue; /* already shown */
    if (k == 5 && o.backup == 0) continue;       /* asked for with --backup-workers */
    if (o.straggler >= 0 && sd.replicas > 1) {
      sd.straggler = o.straggler;
      sd.straggler_factor = o.factor;
    }
    dt_params *P = dt_params_create(o.seed); /* the same initial weights for everyone */
    model m;
    dt_nn_linear_init(&m.l1, P, "l1", NIN, WIDTH, 1);
    dt_nn_linear_init(&m.l2, P, "l2", WIDTH, WIDTH, 1);
    dt_nn_linear_init(&m.l3, P, "l3", WIDTH, NCLS, 1);
    dt_optim_options od;
    memset(&od, 0, sizeof od);
    od.kind = DTRAIN_OPTIM_ADAM;
    od.lr = o.lr;
    dt_optim *opt = dt_optim_create(P, &od);
    dt_strategy *s = dt_strategy_create(P, opt, step, &m, &sd);
    if (!s) {
      fprintf(stderr, "%s: %s\n", names[k], dt_last_error());
      return 1;
    }
    feed f;
    /* async: replica r asks for its own B/N rows; backup workers for B/(N-b), so that the
     * N-b gradients of a step hold a global batch, as mirrored's do (Chen et al.'s N+b) */
    f.rows = sd.kind == DTRAIN_STRATEGY_ASYNC ? o.batch / N : sd.backup_workers > 0 ? o.batch / (N - o.backup) : o.batch;
    if (dt_strategy_run(s, o.steps, next_batch, &f, NULL) != DTRAIN_OK) {
      fprintf(stderr, "%s: %s\n", names[k], dt_last_error());
      return 1;
    }
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    double train_loss, train_acc, test_loss, test_acc;
    evaluate(P, &m, train_x, train_y, NTRAIN, &train_loss, &train_acc);
    evaluate(P, &m, test_x, test_y, NTEST, &test_loss, &test_acc);
    char stale[48] = "-";
    if (sd.kind == DTRAIN_STRATEGY_ASYNC)
      snprintf(stale, sizeof stale, "%.2f / %lld", st.staleness_mean, (long long)st.staleness_max);
    double steps_s = sd.kind == DTRAIN_STRATEGY_ASYNC ? st.steps_per_s / N : st.steps_per_s; /* pushes / N */
    printf("%-22s %11.0f %9.1f %11.4f %9.4f %9.1f%% %s\n", names[k], st.samples_per_s, steps_s, train_loss, test_acc,
           st.seconds > 0 ? 100.0 * st.wait_s_mean / st.seconds : 0.0, stale);
    if ((sd.kind == DTRAIN_STRATEGY_ASYNC || sd.backup_workers > 0) && N > 1) {
      printf("%-22s   %s per replica:", "", sd.backup_workers > 0 ? "gradients used (dropped)" : "steps");
      for (int r = 0; r < N; r++) {
        dt_replica_stats rs;
        dt_strategy_replica_stats(s, r, &rs);
        printf(" %lld", (long long)rs.steps);
        if (sd.backup_workers > 0) printf(" (%lld)", (long long)rs.dropped);
      }
      printf("\n");
    }
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
  }
  printf("\nsamples/s: rows trained on per second (backup workers: the rows of the gradients used, not the dropped).\n"
         "steps/s: global steps per second (async: pushes per second / N).\n"
         "wait: mean share of the run a replica spent waiting for the others (barriers, or the staleness bound).\n"
         "staleness: updates other replicas pushed between a replica's pull and its push.\n");
  return 0;
}
