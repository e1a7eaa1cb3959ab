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
 *    Goal: async / mirrored >= 1.0.
 * 2. With replica 1 four times slower (desc.straggler 1, factor 4: it sleeps
 *    3x its compute after each step): what async(2, unbounded) keeps of the
 *    best it could do, the fast replica's own speed (one_device at half the
 *    batch, measured in the same rounds) plus a quarter of it. Goals: 90% at
 *    batch 64, 95% at 256.
 * 3. The staleness-bound curve: k = 0, 1, 2, 4, 8, 16 and unbounded, with and
 *    without the 1:4 straggler: samples/s and the held-out loss and accuracy
 *    after the same number of samples (STEPS global steps of 64 from the same
 *    fresh weights; mirrored(2) beside them).
 * Timings only: nothing is asserted. --quick: fewer rounds and steps. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int main(int argc, char **argv) {
  int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 2 : 6;
  const int64_t steps = quick ? 150 : 600;
  char cpu[256];
  cpu_name(cpu, sizeof cpu);
  printf("%s, %d CPUs (%s)\n", dt_build_info(), dt_cpu_count(), cpu);
  make_data();

  /* 1 and 2: throughput */
  enum { NK = 5 };
  const char *names[NK] = {"one_device(B)", "one_device(B/2)", "mirrored(2)", "async(2,unb)", "async(2,unb) 1:4"};
  dt_strategy_options sds[NK];
  sds[0] = dt_strategy_one_device();
  sds[1] = dt_strategy_one_device();
  sds[2] = dt_strategy_mirrored(2);
  sds[3] = dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED);
  sds[4] = dt_strategy_async(2, DTRAIN_STALENESS_UNBOUNDED);
  sds[4].straggler = 1;
  sds[4].straggler_factor = 4.0f;
  printf("\nMLP 784-256-128-10, Adam; samples/s, best of %d rounds of 0.5 s; async: pushes of B/2 rows\n", rounds);
  printf("%6s", "B");
  for (int k = 0; k < NK; k++) printf("  %16s", names[k]);
  printf("  %-22s  %s\n", "async/mirrored", "1:4: async / (1.25 x one_device(B/2))");
  const int64_t batches[2] = {64, 256};
  for (int bi = 0; bi < 2; bi++) {
    double best[NK] = {0};
    for (int round = 0; round < rounds; round++)
      for (int k = 0; k < NK; k++) {
        double r = measure(&sds[k], k == 1 ? batches[bi] / 2 : batches[bi], 0.5);
        if (r > best[k]) best[k] = r;
      }
    printf("%6lld", (long long)batches[bi]);
    for (int k = 0; k < NK; k++) printf("  %16.0f", best[k]);
    printf("  %.2fx (goal >= 1.0)%4s", best[3] / best[2], "");
    printf("  %.0f%% (goal >= %d%%)\n", 100.0 * best[4] / (1.25 * best[1]), bi == 0 ? 90 : 95);
  }

  /* 3: the staleness-bound curve */
  printf("\nstaleness bound k: %lld global steps of 64 from the same fresh weights; held-out loss / accuracy "
         "(2048 samples)\n", (long long)steps);
  printf("%-16s  %12s %8s %7s   %12s %8s %7s\n", "", "samples/s", "loss", "acc", "1:4 samp/s", "loss", "acc");
  const int ks[7] = {0, 1, 2, 4, 8, 16, DTRAIN_STALENESS_UNBOUNDED};
  for (int ki = -1; ki < 7; ki++) {
    double rate[2], loss[2], acc[2];
    for (int slow = 0; slow < 2; slow++) {
      dt_strategy_options sd = ki < 0 ? dt_strategy_mirrored(2) : dt_strategy_async(2, ks[ki]);
      if (slow) {
        sd.straggler = 1;
        sd.straggler_factor = 4.0f;
      }
      curve_run(&sd, steps, &rate[slow], &loss[slow], &acc[slow]);
    }
    char label[32];
    if (ki < 0) snprintf(label, sizeof label, "mirrored(2)");
    else if (ks[ki] < 0) snprintf(label, sizeof label, "async k=unb");
    else snprintf(label, sizeof label, "async k=%d", ks[ki]);
    printf("%-16s  %12.0f %8.4f %7.4f   %12.0f %8.4f %7.4f\n", label, rate[0], loss[0], acc[0], rate[1], loss[1],
           acc[1]);
  }
  free(X);
  free(TX);
  free(Y);
  free(TY);
  return 0;
}
