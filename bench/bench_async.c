/* bench_async.c -- asynchronous training against the synchronous kind, side
 * by side in one run (issue 26's goals), and the staleness-bound curve.
 *
 *   make bench-strategy   (or: make build/bench/bench_async && build/bench/bench_async [--quick])
 *
 * The model: the Fashion-MNIST MLP (784-256-128-10, Adam lr 1e-3) on a
 * teacher-student task of Fashion-MNIST's shape (a random 784-64-10 ReLU
 * network labels Gaussian inputs: 8192 to train on, 2048 held out), so that
 * a loss means something.
 *
 * 1. Throughput, no straggler: one_device, mirrored(2), async(2, unbounded)
 *    at global batch 64 and 256 (async: each replica's push is half of it, so
 *    a round of 2 pushes sees a global batch). Rounds of 0.5 s alternate
 *    between the kinds; the best round of each counts (a shared, noisy
 *    machine: the best round is the one in which the threads had the cores).
 *    Goal: async / mirrored >= 1.0. Beside them async with async_in_place
 *    (the replicas computing on the store itself) and its 1:4 run, and
 *    async with async_sharded (each replica updates only its own slice of
 *    the parameters, with the mean of the gradients handed to it) and its
 *    1:4 run, in the same rounds.
 * 2. With replica 1 four times slower (desc.straggler 1, factor 4: it sleeps
 *    3x its compute after each step): what async(2, unbounded) keeps of the
 *    best it could do, the fast replica's own speed (one_device at half the
 *    batch, measured in the same rounds) plus a quarter of it. Goals: 90% at
 *    batch 64, 95% at 256.
 * 3. The staleness-bound curve: k = 0, 1, 2, 4, 8, 16 and unbounded, with and
 *    without the 1:4 straggler: samples/s and the held-out loss and accuracy
 *    after the same number of samples (STEPS global steps of 64 from the same
 *    fresh weights; mirrored(2) beside them), then async_sharded at k = 4
 *    and unbounded.
 * 4. Parameter servers over loopback TCP: 2 worker processes and 1 server
 *    process (forked here, the server's socket bound before the fork), the
 *    same model, Adam on the server, each worker pushing B/2 rows a step, no
 *    staleness bound; against async(2, unbounded) in this process in the
 *    same rounds. Each round the workers connect, make 5 steps, wait for each
 *    other, then train for 1 s; total samples/s = the sum of the workers'.
 *    Plain (pull, step, push) and with overlap (sd.overlap: a second thread
 *    pushes and pulls while the next step computes). Also: the share of a
 *    worker's time waiting in pull and push (sends, waits, copies; with
 *    overlap, waiting for the thread) and the bytes on the wire a step.
 *    Then plain with bf16 pushes and pulls (sd.compress; half the bytes, a
 *    conversion at each end). Goal: >= 0.9x in-process.
 * Timings only: nothing is asserted. --quick: fewer rounds and steps; --ps:
 * section 4 only; --throughput: sections 1 and 2 only. BENCH_ASYNC_ROUNDS=R
 * in the environment: R rounds (at most 64) instead of 6. Sections 1 and 2
 * also print the median over the rounds of each round's async / mirrored
 * (the kinds alternate within a round, so a host that slows down for a
 * while slows all of them): on a noisy host a steadier figure than the
 * ratio of the best rounds. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "bench_cores.h"

#define NIN 784
#define NHID 64
#define NCLS 10
#define NTRAIN 8192
#define NTEST 2048

static float *X, *TX;
static int32_t *Y, *TY;

/* A random teacher (seed 5) labels Gaussian points. */
static void make_data(void) {
  dt_rng r;
  dt_rng_seed(&r, 5);
  X = (float *)malloc(sizeof(float) * NTRAIN * NIN);
  TX = (float *)malloc(sizeof(float) * NTEST * NIN);
  Y = (int32_t *)malloc(sizeof(int32_t) * NTRAIN);
  TY = (int32_t *)malloc(sizeof(int32_t) * NTEST);
  float *w1 = (float *)malloc(sizeof(float) * NHID * NIN), w2[NCLS * NHID];
  for (int i = 0; i < NHID * NIN; i++) w1[i] = dt_rng_normal(&r) / 16.0f;
  for (int i = 0; i < NCLS * NHID; i++) w2[i] = dt_rng_normal(&r) / 4.0f;
  for (int i = 0; i < NTRAIN + NTEST; i++) {
    float *x = i < NTRAIN ? X + (size_t)i * NIN : TX + (size_t)(i - NTRAIN) * NIN;
    float h[NHID];
    for (int f = 0; f < NIN; f++) x[f] = dt_rng_normal(&r);
    for (int j = 0; j < NHID; j++) {
      float s = 0.0f;
      for (int f = 0; f < NIN; f++) s += w1[(size_t)j * NIN + f] * x[f];
      h[j] = s > 0.0f ? s : 0.0f;
    }
    int best = 0;
    float bv = -1e30f;
    for (int c = 0; c < NCLS; c++) {
      float s = 0.0f;
      for (int j = 0; j < NHID; j++) s += w2[c * NHID + j] * h[j];
      if (s > bv) {
        bv = s;
        best = c;
      }
    }
    if (i < NTRAIN) Y[i] = best;
    else TY[i - NTRAIN] = best;
  }
  free(w1);
}

typedef struct mlp {
  dt_nn_linear l1, l2, l3;
} mlp;

static dt_tensor *logits(dt_graph *g, mlp *m, const float *x, int64_t rows) {
  int64_t xs[2] = {rows, NIN};
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)x)));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  return dt_nn_linear_forward(g, &m->l3, h);
}

static dt_tensor *mlp_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  return dt_cross_entropy(g, logits(g, (mlp *)user, b->x, b->rows), b->y);
}

typedef struct feed {
  int64_t batch; /* rows per ticket */
} feed;

static dt_result feed_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  feed *f = (feed *)user;
  (void)replica;
  int64_t per = NTRAIN / f->batch;
  int64_t first = (step % per) * f->batch;
  memset(out, 0, sizeof *out);
  out->rows = f->batch;
  out->x = X + first * NIN;
  out->x_cols = NIN;
  out->y = Y + first;
  return DTRAIN_OK;
}

static dt_params *model_create(mlp *m, dt_optim **opt) {
  dt_params *P = dt_params_create(1);
  dt_nn_linear_init(&m->l1, P, "fc1", NIN, 256, 1);
  dt_nn_linear_init(&m->l2, P, "fc2", 256, 128, 1);
  dt_nn_linear_init(&m->l3, P, "fc3", 128, NCLS, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 1e-3f;
  *opt = dt_optim_create(P, &od);
  return P;
}

/* Held-out loss and accuracy of the params' current values. */
static void evaluate(dt_params *P, mlp *m, double *loss, double *acc) {
  dt_graph *g = dt_graph_create(P, NULL);
  double ls = 0.0;
  int64_t right = 0;
  for (int64_t at = 0; at < NTEST; at += 256) {
    dt_graph_reset(g);
    dt_tensor *z = logits(g, m, TX + at * NIN, 256);
    ls += (double)dt_item(dt_cross_entropy(g, z, TY + at)) * 256.0;
    for (int i = 0; i < 256; i++) {
      int best = 0;
      for (int c = 1; c < NCLS; c++)
        if (z->data[i * NCLS + c] > z->data[i * NCLS + best]) best = c;
      right += best == TY[at + i];
    }
  }
  dt_graph_destroy(g);
  *loss = ls / NTEST;
  *acc = (double)right / NTEST;
}

/* Rows per ticket: a synchronous kind takes the global batch, async half. */
static int64_t rows_for(const dt_strategy_options *sd, int64_t batch) {
  return sd->kind == DTRAIN_STRATEGY_ASYNC ? batch / sd->replicas : batch;
}

/* samples/s of one timed round of `seconds` after a warm-up. */
static double measure(const dt_strategy_options *sd, int64_t batch, double seconds) {
  mlp m;
  dt_optim *opt;
  dt_params *P = model_create(&m, &opt);
  dt_strategy *s = dt_strategy_create(P, opt, mlp_step, &m, sd);
  double rate = 0.0;
  if (!s) {
    fprintf(stderr, "%s\n", dt_last_error());
  } else {
    feed f;
    f.batch = rows_for(sd, batch);
    dt_strategy_run(s, 5, feed_next, &f, NULL);
    dt_strategy_reset_stats(s);
    double t0 = dt_time_now();
    /* chunks of 100 steps: a run ends when its last ticket is pushed, and a
     * straggler's last step can outlast the fast replica's by 4x a step */
    while (dt_time_now() - t0 < seconds)
      if (dt_strategy_run(s, 100, feed_next, &f, NULL) != DTRAIN_OK) {
        fprintf(stderr, "%s\n", dt_last_error());
        break;
      }
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    rate = st.samples_per_s;
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return rate;
}

/* STEPS global steps of 64 from fresh weights: samples/s, held-out loss, accuracy. */
static void curve_run(const dt_strategy_options *sd, int64_t steps, double *rate, double *loss, double *acc) {
  mlp m;
  dt_optim *opt;
  dt_params *P = model_create(&m, &opt);
  dt_strategy *s = dt_strategy_create(P, opt, mlp_step, &m, sd);
  *rate = *loss = *acc = 0.0;
  if (!s) {
    fprintf(stderr, "%s\n", dt_last_error());
  } else {
    feed f;
    f.batch = rows_for(sd, 64);
    if (dt_strategy_run(s, steps, feed_next, &f, NULL) != DTRAIN_OK) fprintf(stderr, "%s\n", dt_last_error());
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    *rate = st.samples_per_s;
    evaluate(P, &m, loss, acc);
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

/* ---- 4: parameter servers over loopback TCP ------------------------------------------------ */

typedef struct ps_result {
  double samples, seconds, comm_s; /* comm_s: inside pull and push */
  double wire_sent, wire_received; /* bytes a step */
} ps_result;

/* One process of the job: the server (index -1) or worker w, which trains
 * `seconds` after the start signal and writes its ps_result to out. */
static int ps_process(int w, int lfd, const char *saddr, int64_t rows, int overlap, dt_compress_kind z, double seconds,
                      int ready, int go, int out) {
  char waddr[2][32] = {"127.0.0.1:1", "127.0.0.1:2"}; /* workers do not listen in PS training */
  char *wa[2] = {waddr[0], waddr[1]}, *sa[1] = {(char *)saddr};
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = 2;
  c.servers = 1;
  c.worker_addr = wa;
  c.server_addr = sa;
  c.role = w < 0 ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER;
  c.index = w < 0 ? 0 : w;
  mlp m;
  dt_optim *opt;
  dt_params *P = model_create(&m, &opt);
  dt_net_options o = dt_net_defaults();
  o.job_id = 0x626173;
  o.listen_fd = w < 0 ? lfd : -1;
  o.quiet = 1;
  o.model_hash = dt_params_hash(P);
  if (w < 0) return dt_ps_serve(&c, P, opt, &o, NULL) == DTRAIN_OK ? 0 : 1;
  dt_pstore *store = dt_pstore_create_tcp(&c, P, &o, DTRAIN_STALENESS_UNBOUNDED);
  dt_strategy_options sd = dt_strategy_parameter_server(store, DTRAIN_STALENESS_UNBOUNDED);
  sd.overlap = overlap;
  sd.compress.kind = z;
  dt_strategy *s = store ? dt_strategy_create(P, opt, mlp_step, &m, &sd) : NULL;
  feed f;
  f.batch = rows;
  char b = 1;
  ps_result r;
  memset(&r, 0, sizeof r);
  int ok = s && dt_strategy_run(s, 5, feed_next, &f, NULL) == DTRAIN_OK;
  if (!ok) fprintf(stderr, "bench_async: worker %d: %s\n", w, dt_last_error());
  if (write(ready, &b, 1) != 1 || read(go, &b, 1) != 1) ok = 0;
  if (ok) {
    dt_strategy_reset_stats(s);
    double t0 = dt_time_now();
    while (ok && dt_time_now() - t0 < seconds) ok = dt_strategy_run(s, 20, feed_next, &f, NULL) == DTRAIN_OK;
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    r.samples = (double)st.samples;
    r.seconds = st.seconds;
    r.comm_s = st.comm_s_mean + st.wait_s_mean; /* (the pushes and pulls, and the bound's waits) */
    r.wire_sent = st.steps ? (double)st.wire_bytes / (double)st.steps : 0.0;
    r.wire_received = st.steps ? (double)st.wire_bytes_received / (double)st.steps : 0.0;
    if (!ok) fprintf(stderr, "bench_async: worker %d: %s\n", w, dt_last_error());
  }
  if (store) dt_pstore_leave(store, w);
  dt_strategy_destroy(s);
  dt_pstore_destroy(store);
  if (write(out, &r, sizeof r) != (ssize_t)sizeof r) ok = 0;
  return ok ? 0 : 1;
}

/* One round: total samples/s of the two workers (0 when the job failed); r[2] their results. */
static double measure_ps(int64_t batch, int overlap, dt_compress_kind z, double seconds, ps_result r[2]) {
  int lfd = -1, ready[2], go[2], out[2];
  char saddr[32];
  if (dt__net_listen("127.0.0.1:0", &lfd) != DTRAIN_OK) { /* a private helper of the header (bench_hostile too) */
    fprintf(stderr, "bench_async: %s\n", dt_last_error());
    return 0.0;
  }
  snprintf(saddr, sizeof saddr, "127.0.0.1:%d", dt__net_port(lfd));
  if (pipe(ready) != 0 || pipe(go) != 0 || pipe(out) != 0) return 0.0;
  pid_t pid[3];
  fflush(NULL);
  for (int p = 0; p < 3; p++) {
    pid[p] = fork();
    if (pid[p] == 0) {
      signal(SIGPIPE, SIG_IGN);
      if (p < 2) close(lfd);
      _exit(ps_process(p < 2 ? p : -1, lfd, saddr, batch / 2, overlap, z, seconds, ready[1], go[0], out[1]));
    }
  }
  close(lfd);
  char b[2] = {1, 1};
  int ok = read(ready[0], b, 1) == 1 && read(ready[0], b + 1, 1) == 1 && write(go[1], b, 2) == 2;
  memset(r, 0, 2 * sizeof *r);
  for (int w = 0; ok && w < 2; w++) ok = read(out[0], &r[w], sizeof r[w]) == (ssize_t)sizeof r[w];
  for (int p = 0; p < 3; p++) {
    int st = 0;
    waitpid(pid[p], &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  for (int i = 0; i < 2; i++) {
    close(ready[i]);
    close(go[i]);
    close(out[i]);
  }
  if (!ok || r[0].seconds <= 0.0 || r[1].seconds <= 0.0) return 0.0;
  return r[0].samples / r[0].seconds + r[1].samples / r[1].seconds;
}

static void cpu_name(char *out, size_t cap) {
  snprintf(out, cap, "unknown CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *c = strchr(line, ':');
      if (c) {
        c += 1 + (c[1] == ' ');
        c[strcspn(c, "\n")] = 0;
        snprintf(out, cap, "%s", c);
      }
      break;
    }
  }
  fclose(f);
}

#define MAX_ROUNDS 64
/* The median of x[0..n) (n <= MAX_ROUNDS; x is not changed). */
static double median(const double *x, int n) {
  double y[MAX_ROUNDS];
  memcpy(y, x, (size_t)n * sizeof(double));
  for (int i = 1; i < n; i++) /* insertion sort: a few dozen values */
    for (int j = i; j > 0 && y[j - 1] > y[j]; j--) {
      double t = y[j];
      y[j] = y[j - 1];
      y[j - 1] = t;
    }
  return n % 2 ? y[n / 2] : 0.5 * (y[n / 2 - 1] + y[n / 2]);
}

int main(int argc, char **argv) {
  int quick = 0, ps_only = 0, first_only = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) quick = 1;
    else if (strcmp(argv[i], "--ps") == 0) ps_only = 1;
    else if (strcmp(argv[i], "--throughput") == 0) first_only = 1;
    else {
      fprintf(stderr, "usage: bench_async [--quick] [--ps | --throughput]\n");
      return 2;
    }
  }
  const char *env_rounds = getenv("BENCH_ASYNC_ROUNDS"); /* more rounds where the host is noisy */
  int rounds = quick ? 2 : 6;
  if (env_rounds && atoi(env_rounds) >= 1) rounds = atoi(env_rounds) > MAX_ROUNDS ? MAX_ROUNDS : atoi(env_rounds);
  const int64_t steps = quick ? 150 : 600;
  char cpu[256];
  cpu_name(cpu, sizeof cpu);
  printf("%s, %d CPUs (%s)\n", dt_build_info(), dt_cpu_count(), cpu);
  make_data();

  /* 1 and 2: throughput */
  enum { NK = 9 };
  const char *names[NK] = {"one_device(B)", "one_device(B/2)",  "mirrored(2)",          "async(2,unb)",
                           "async(2,unb) 1:4", "async in place",  "in place 1:4",         "async owners",
                           "owners 1:4"};
  dt_strategy_options sds[NK];
  sds[0] = dt_strategy_one_device();
  sds[1] = dt_strategy_one_device();
  sds[2] = dt_strategy_mirrored(2);
  sds[3] = dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED);
  sds[4] = dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED);
  sds[4].straggler = 1;
  sds[4].straggler_factor = 4.0f;
  sds[5] = sds[3]; /* the replicas on the store itself (async_in_place) */
  sds[5].async_in_place = 1;
  sds[6] = sds[4];
  sds[6].async_in_place = 1;
  sds[7] = sds[3]; /* each replica updates its own slice (async_sharded) */
  sds[7].async_sharded = 1;
  sds[8] = sds[4];
  sds[8].async_sharded = 1;
  const int64_t batches[2] = {64, 256};
  if (!ps_only) {
    printf("\nMLP 784-256-128-10, Adam; samples/s, best of %d rounds of 0.5 s; async: pushes of B/2 rows\n", rounds);
    printf("%6s", "B");
    for (int k = 0; k < NK; k++) printf("  %16s", names[k]);
    printf("  %-22s  %-40s  %-26s  %s\n", "async/mirrored", "1:4: async / (1.25 x one_device(B/2))",
           "in place: /mirrored, 1:4", "owners: /mirrored, 1:4");
  }
  if (!ps_only) print_cores("before");
  double medians[2][3] = {{0}};
  for (int bi = 0; bi < 2 && !ps_only; bi++) {
    double best[NK] = {0}, ratio[3][MAX_ROUNDS];
    for (int round = 0; round < rounds; round++) {
      double got[NK];
      for (int k = 0; k < NK; k++) {
        got[k] = measure(&sds[k], k == 1 ? batches[bi] / 2 : batches[bi], 0.5);
        if (got[k] > best[k]) best[k] = got[k];
      }
      ratio[0][round] = got[3] / got[2]; /* the same round's: a host that slows down slows all three */
      ratio[1][round] = got[5] / got[2];
      ratio[2][round] = got[7] / got[2];
    }
    for (int q = 0; q < 3; q++) medians[bi][q] = median(ratio[q], rounds);
    printf("%6lld", (long long)batches[bi]);
    for (int k = 0; k < NK; k++) printf("  %16.0f", best[k]);
    printf("  %.2fx (goal >= 1.0)%4s", best[3] / best[2], "");
    printf("  %3.0f%% (goal >= %d%%)%23s", 100.0 * best[4] / (1.25 * best[1]), bi == 0 ? 90 : 95, "");
    printf("  %.2fx, %.0f%%%16s", best[5] / best[2], 100.0 * best[6] / (1.25 * best[1]), "");
    printf("  %.2fx, %.0f%%\n", best[7] / best[2], 100.0 * best[8] / (1.25 * best[1]));
  }
  if (!ps_only) {
    print_cores("after");
    printf("median over the rounds of each round's ratio to mirrored(2): async %.2fx at 64, %.2fx at 256; "
           "in place %.2fx, %.2fx; owners %.2fx, %.2fx\n", medians[0][0], medians[1][0], medians[0][1],
           medians[1][1], medians[0][2], medians[1][2]);
  }

  if (first_only) return 0;
  /* 3: the staleness-bound curve */
  if (!ps_only)
    printf("\nstaleness bound k: %lld global steps of 64 from the same fresh weights; held-out loss / accuracy "
           "(2048 samples)\n", (long long)steps);
  if (!ps_only) printf("%-16s  %12s %8s %7s   %12s %8s %7s\n", "", "samples/s", "loss", "acc", "1:4 samp/s", "loss", "acc");
  /* then async_sharded at k = 4 and unbounded */
  const int ks[9] = {0, 1, 2, 4, 8, 16, DTRAIN_STALENESS_UNBOUNDED, 4, DTRAIN_STALENESS_UNBOUNDED};
  for (int ki = -1; ki < 9 && !ps_only; ki++) {
    double rate[2], loss[2], acc[2];
    for (int slow = 0; slow < 2; slow++) {
      dt_strategy_options sd = ki < 0 ? dt_strategy_mirrored(2) : dt_strategy_async(2, ks[ki]);
      sd.async_sharded = ki >= 7;
      if (slow) {
        sd.straggler = 1;
        sd.straggler_factor = 4.0f;
      }
      curve_run(&sd, steps, &rate[slow], &loss[slow], &acc[slow]);
    }
    char label[32];
    if (ki < 0) snprintf(label, sizeof label, "mirrored(2)");
    else if (ks[ki] < 0) snprintf(label, sizeof label, "%s k=unb", ki >= 7 ? "owners" : "async");
    else snprintf(label, sizeof label, "%s k=%d", ki >= 7 ? "owners" : "async", ks[ki]);
    printf("%-16s  %12.0f %8.4f %7.4f   %12.0f %8.4f %7.4f\n", label, rate[0], loss[0], acc[0], rate[1], loss[1],
           acc[1]);
  }

  /* 4: parameter servers over loopback TCP */
  printf("\nparameter servers over loopback TCP: 2 workers + 1 server (processes), pushes of B/2 rows, unbounded; "
         "best of %d rounds\n", rounds);
  printf("%6s  %14s  %14s  %14s  %-24s  %-20s  %-30s  %10s  %s\n", "B", "async(2,unb)", "ps(2w,1s)", "ps overlap",
         "ps/async, overlap", "worker in pull+push", "wire bytes/step sent, received", "ps bf16", "bf16/async, bytes/step");
  for (int bi = 0; bi < 2; bi++) {
    double best_a = 0.0, best_p[3] = {0.0, 0.0, 0.0};
    ps_result at[3][2];
    memset(at, 0, sizeof at);
    for (int round = 0; round < rounds; round++) {
      double a = measure(&sds[3], batches[bi], 0.5);
      if (a > best_a) best_a = a;
      for (int ov = 0; ov < 3; ov++) { /* plain, overlap, plain with bf16 pushes and pulls */
        ps_result r[2];
        double p = measure_ps(batches[bi], ov == 1, ov == 2 ? DTRAIN_COMPRESS_BF16 : DTRAIN_COMPRESS_NONE, 1.0, r);
        if (p > best_p[ov]) {
          best_p[ov] = p;
          memcpy(at[ov], r, sizeof at[ov]);
        }
      }
    }
    double share[2];
    for (int ov = 0; ov < 2; ov++)
      share[ov] = at[ov][0].seconds > 0 && at[ov][1].seconds > 0
                      ? 0.5 * (at[ov][0].comm_s / at[ov][0].seconds + at[ov][1].comm_s / at[ov][1].seconds)
                      : 0.0;
    char wire[48];
    snprintf(wire, sizeof wire, "%.0f, %.0f", at[0][0].wire_sent, at[0][0].wire_received);
    printf("%6lld  %14.0f  %14.0f  %14.0f  %.2fx, %.2fx (goal >= 0.9)  %5.1f%%, %5.1f%%      %-30s  %10.0f  %.2fx, %.0f + %.0f\n",
           (long long)batches[bi], best_a, best_p[0], best_p[1], best_a > 0 ? best_p[0] / best_a : 0.0,
           best_a > 0 ? best_p[1] / best_a : 0.0, 100.0 * share[0], 100.0 * share[1], wire, best_p[2],
           best_a > 0 ? best_p[2] / best_a : 0.0, at[2][0].wire_sent, at[2][0].wire_received);
  }
  free(X);
  free(TX);
  free(Y);
  free(TY);
  return 0;
}
