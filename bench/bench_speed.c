/* bench_speed.c -- the dtrain side of `make bench` (bench/run_speed.sh runs it).
 *
 *   bench_speed gemm [seconds [threads]]       sgemm GFLOP/s, dtrain and OpenBLAS
 *                                     side by side (threads: dt_set_threads and
 *                                     openblas_set_num_threads; default 1), square
 *                                     64..2048 and the shapes of the MLP and CNN steps
 *   bench_speed mlp BATCH [seconds [threads]]  Fashion-MNIST MLP 784-256-128-10, Adam
 *   bench_speed cnn BATCH [seconds [threads]]  conv5x5-32 pool conv5x5-64 pool fc1024 fc10
 *                                     (BENCH_PROFILE=1: and the per-op profile of
 *                                     the timed steps, dt_profile_format)
 *   bench_speed peak [seconds]        this core's FMA peak, GFLOP/s, for each
 *                                     instruction set the CPU has: 12 independent
 *                                     chains of multiply-adds (portable: GCC vectors
 *                                     of 4 floats, the width the portable kernels
 *                                     are compiled for; avx2+fma: 8; avx512f: 16)
 *   bench_speed adam [seconds]        Adam over the MLP's 235,146 parameters, and
 *                                     the same update 8,192 floats at a time (in L2),
 *                                     scaled: what bounds the update on this core
 *   bench_speed cblas BATCH [seconds]  (built with DTRAIN_USE_CBLAS, linked with
 *                                     OpenBLAS) the GEMM calls of one MLP step,
 *                                     recorded, then timed through dt_sgemm and
 *                                     through cblas_sgemm directly (one thread)
 *
 * Built with the flags users build with (-O2, no -march), so the GEMM kernel is
 * the one picked at run time. OpenBLAS is loaded with dlopen (libopenblas.so.0,
 * or the library named by BENCH_OPENBLAS) only in gemm mode; if it is missing
 * that column says "skipped". Training runs use synthetic data of the right
 * shape (throughput only) and print one line "result samples_per_s=...
 * peak_rss_kb=..." for the driver; peak RSS is VmHWM of this process, so each
 * run needs its own process.
 *
 * Timing: the machine may be shared, so every figure is the best of several
 * short windows (the least disturbed one), for both sides alike. */
#ifdef DTRAIN_USE_CBLAS
/* dtrain's dt_sgemm calls cblas_sgemm: renamed here to a hook that records
 * each call's shape (while `record_on`) and passes it on to OpenBLAS. */
#  define cblas_sgemm bench_cblas_hook
#endif
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#ifdef DTRAIN_USE_CBLAS
#  undef cblas_sgemm
void cblas_sgemm(const enum CBLAS_ORDER, const enum CBLAS_TRANSPOSE, const enum CBLAS_TRANSPOSE, const blasint,
                 const blasint, const blasint, const float, const float *, const blasint, const float *,
                 const blasint, const float, float *, const blasint);
#endif
#include <dlfcn.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- peak RSS -------------------------------------------------------------------- */
static long peak_rss_kb(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "VmHWM:", 6) == 0) kb = strtol(line + 6, NULL, 10);
  fclose(f);
  return kb;
}

/* ---- sgemm ------------------------------------------------------------------------ */
typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                               float *, int);
static cblas_sgemm_fn blas_sgemm;
static const char *blas_why = "";
static const char *blas_core = "?"; /* openblas_get_corename(): the kernel OpenBLAS picked */

static void load_openblas(int threads) {
  const char *names[] = {"libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0"};
  const char *env = getenv("BENCH_OPENBLAS"); /* a path or name to use instead */
  void *h = NULL;
  if (env && *env) h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
  for (int i = 0; i < 3 && !h && !(env && *env); i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    blas_why = env && *env ? "BENCH_OPENBLAS library not found" : "libopenblas.so.0 not found";
    return;
  }
  void (*set_threads)(int) = NULL;
  *(void **)&set_threads = dlsym(h, "openblas_set_num_threads");
  *(void **)&blas_sgemm = dlsym(h, "cblas_sgemm");
  if (!blas_sgemm) {
    blas_why = "no cblas_sgemm in libopenblas";
    return;
  }
  if (set_threads) set_threads(threads);
  char *(*corename)(void) = NULL;
  *(void **)&corename = dlsym(h, "openblas_get_corename");
  if (corename && corename()) blas_core = corename();
}

typedef struct gemm_case { const char *what; int ta, tb, m, n, k; } gemm_case;

/* Seconds per call: best window over about `budget` seconds. */
static double time_gemm(int blas, const gemm_case *c, const float *a, const float *b, float *out, double budget) {
  int lda = c->ta ? c->m : c->k, ldb = c->tb ? c->k : c->n;
  double flop = 2.0 * c->m * c->n * c->k, best = 1e30, t_end = dt_time_now() + budget;
  int per_window = (int)(2e7 / flop) + 1; /* ~ a quarter millisecond of work or more */
  do {
    double t0 = dt_time_now();
    for (int r = 0; r < per_window; r++) {
      if (blas)
        blas_sgemm(101, c->ta ? 112 : 111, c->tb ? 112 : 111, c->m, c->n, c->k, 1.0f, a, lda, b, ldb, 0.0f, out, c->n);
      else
        dt_sgemm(c->ta, c->tb, c->m, c->n, c->k, 1.0f, a, lda, b, ldb, 0.0f, out, c->n);
    }
    double t = (dt_time_now() - t0) / per_window;
    if (t < best) best = t;
  } while (dt_time_now() < t_end);
  return best;
}

static double peak_for_kernel(const char *kernel, double seconds);

static int run_gemm(double seconds, int threads) {
  static const gemm_case cases[] = {
      {"square", 0, 0, 64, 64, 64},       {"square", 0, 0, 128, 128, 128},  {"square", 0, 0, 256, 256, 256},
      {"square", 0, 0, 512, 512, 512},    {"square", 0, 0, 1024, 1024, 1024}, {"square", 0, 0, 2048, 2048, 2048},
      /* MLP step, batch 64: forward x @ W^T, backward dx = dy @ W, dW = dy^T @ x */
      {"mlp64 fc1 fwd", 0, 1, 64, 256, 784}, {"mlp64 fc2 fwd", 0, 1, 64, 128, 256},
      {"mlp64 fc2 dx", 0, 0, 64, 256, 128},  {"mlp64 fc1 dW", 1, 0, 256, 784, 64},
      {"mlp64 fc2 dW", 1, 0, 128, 256, 64},
      /* MLP step, batch 256 */
      {"mlp256 fc1 fwd", 0, 1, 256, 256, 784}, {"mlp256 fc1 dW", 1, 0, 256, 784, 256},
      /* CNN step, batch 64 (28x28, padding 2): conv as W [O,K] @ col [K, positions], one image
       * per call (dt_ops_conv.c groups images only below 192 positions) */
      {"cnn conv1 fwd", 0, 0, 32, 784, 25},     {"cnn conv1 dW", 0, 1, 32, 25, 784},
      {"cnn conv2 fwd", 0, 0, 64, 196, 800},    {"cnn conv2 dW", 0, 1, 64, 800, 196},
      {"cnn conv2 dcol", 1, 0, 800, 196, 64},   {"cnn fc1 fwd", 0, 1, 64, 1024, 3136},
      {"cnn fc1 dW", 1, 0, 1024, 3136, 64},     {"cnn fc1 dx", 0, 0, 64, 3136, 1024},
      /* conv2 of the CNN step now runs as Winograd F(2x2,5x5) (the im2col rows above are
       * its former shapes, still those of other convolutions): per group of 4 images
       * (196 tiles) and per each of the 36 transformed positions, M = U [O,C] @ V [C,T],
       * dU = dM @ V^T, dV = U^T @ dM */
      {"cnn wino fwd", 0, 0, 64, 196, 32},      {"cnn wino dU", 0, 1, 64, 32, 196},
      {"cnn wino dV", 1, 0, 32, 196, 64},
  };
  int ncases = (int)(sizeof cases / sizeof cases[0]);
  load_openblas(threads);
  if (dt_set_threads(threads) != DTRAIN_OK) {
    fprintf(stderr, "bench_speed: dt_set_threads(%d): %s\n", threads, dt_last_error());
    return 1;
  }
  /* the share of the measured peak: the kernel's path, times the threads (one core each) */
  double peak = peak_for_kernel(dt_sgemm_kernel(), 0.3) * threads;
  printf("sgemm kernel: %s, threads: %d, FMA peak of that path %.1f GFLOP/s%s; OpenBLAS kernel: %s\n",
         dt_sgemm_kernel(), threads, peak, peak > 0 ? "" : " (not measured for this path)",
         blas_sgemm ? blas_core : "-");
  printf("%-16s %-16s %10s %10s %7s %8s %8s\n", "shape", "m x n x k", "dtrain", "OpenBLAS", "ratio", "dt/peak",
         "ob/peak");
  for (int i = 0; i < ncases; i++) {
    const gemm_case *c = &cases[i];
    size_t na = (size_t)c->m * c->k, nb = (size_t)c->k * c->n, nc = (size_t)c->m * c->n;
    float *a = (float *)malloc(na * sizeof(float)), *b = (float *)malloc(nb * sizeof(float));
    float *out = (float *)malloc(nc * sizeof(float));
    if (!a || !b || !out) return 1;
    for (size_t j = 0; j < na; j++) a[j] = (float)((j * 7) % 13) * 0.1f - 0.6f;
    for (size_t j = 0; j < nb; j++) b[j] = (float)((j * 5) % 11) * 0.1f - 0.5f;
    double budget = seconds * (c->m >= 2048 ? 2.0 : 1.0);
    double flop = 2.0 * c->m * c->n * c->k, td = 1e30, tb = 1e30;
    /* Alternate the two sides in rounds so that both see the same noise. */
    for (int round = 0; round < 3; round++) {
      double t = time_gemm(0, c, a, b, out, budget / 3);
      if (t < td) td = t;
      if (blas_sgemm) {
        t = time_gemm(1, c, a, b, out, budget / 3);
        if (t < tb) tb = t;
      }
    }
    char dims[48];
    snprintf(dims, sizeof dims, "%dx%dx%d%s", c->m, c->n, c->k, c->ta ? " (A^T)" : c->tb ? " (B^T)" : "");
    double pd = peak > 0 ? 100 * flop / td * 1e-9 / peak : 0, pb = peak > 0 ? 100 * flop / tb * 1e-9 / peak : 0;
    if (blas_sgemm)
      printf("%-16s %-16s %10.1f %10.1f %7.2f %7.0f%% %7.0f%%\n", c->what, dims, flop / td * 1e-9, flop / tb * 1e-9,
             tb / td, pd, pb);
    else
      printf("%-16s %-16s %10.1f %10s %7s %7.0f%% %8s   skipped (%s)\n", c->what, dims, flop / td * 1e-9, "-", "-", pd,
             "-", blas_why);
    fflush(stdout);
    free(a);
    free(b);
    free(out);
  }
  return 0;
}

/* ---- the FMA peak ------------------------------------------------------------------------
 * 12 independent accumulator chains hide the multiply-add latency (4-5 cycles
 * at 2 per cycle needs 8-10 in flight); the best of windows of 2^22 rounds.
 * The result is kept in a volatile sink so that nothing is optimised away. */
static volatile float peak_sink;

/* 12 chains as 12 named variables: an array would live on the stack at -O2 */
#define PEAK_CHAINS(T, INIT, STEP, SUM)                                                        \
  T c0 = INIT(0), c1 = INIT(1), c2 = INIT(2), c3 = INIT(3), c4 = INIT(4), c5 = INIT(5);       \
  T c6 = INIT(6), c7 = INIT(7), c8 = INIT(8), c9 = INIT(9), c10 = INIT(10), c11 = INIT(11);   \
  for (long r = 0; r < rounds; r++) {                                                         \
    c0 = STEP(c0); c1 = STEP(c1); c2 = STEP(c2); c3 = STEP(c3); c4 = STEP(c4); c5 = STEP(c5);  \
    c6 = STEP(c6); c7 = STEP(c7); c8 = STEP(c8); c9 = STEP(c9); c10 = STEP(c10); c11 = STEP(c11); \
  }                                                                                           \
  c0 = SUM(c0, c1); c2 = SUM(c2, c3); c4 = SUM(c4, c5); c6 = SUM(c6, c7); c8 = SUM(c8, c9);   \
  c10 = SUM(c10, c11); c0 = SUM(c0, c2); c4 = SUM(c4, c6); c8 = SUM(c8, c10); c0 = SUM(c0, c4); \
  c0 = SUM(c0, c8)

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#  define BENCH_X86 1
#  include <immintrin.h>
__attribute__((target("avx2,fma"))) static double peak_avx2(long rounds) {
  const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
#  define P8_INIT(i) _mm256_set1_ps((float)(i))
#  define P8_STEP(x) _mm256_fmadd_ps(x, m, a)
  PEAK_CHAINS(__m256, P8_INIT, P8_STEP, _mm256_add_ps);
  peak_sink = _mm256_cvtss_f32(c0);
  return (double)rounds * 12 * 8 * 2;
}
__attribute__((target("avx512f"))) static double peak_avx512(long rounds) {
  const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-7f);
#  define P16_INIT(i) _mm512_set1_ps((float)(i))
#  define P16_STEP(x) _mm512_fmadd_ps(x, m, a)
  PEAK_CHAINS(__m512, P16_INIT, P16_STEP, _mm512_add_ps);
  peak_sink = _mm512_reduce_add_ps(c0);
  return (double)rounds * 12 * 16 * 2;
}
#endif

typedef float v4f __attribute__((vector_size(16)));
static double peak_portable(long rounds) {
  const v4f m = {0.999999f, 0.999999f, 0.999999f, 0.999999f}, a = {1e-7f, 1e-7f, 1e-7f, 1e-7f};
#define P4_INIT(i) ((v4f){(float)(i), (float)(i), (float)(i), (float)(i)})
#define P4_STEP(x) ((x) * m + a)
#define P4_SUM(x, y) ((x) + (y))
  PEAK_CHAINS(v4f, P4_INIT, P4_STEP, P4_SUM);
  peak_sink = c0[0] + c0[1] + c0[2] + c0[3];
  return (double)rounds * 12 * 4 * 2;
}

/* GFLOP/s of fn, best of windows for `seconds` */
static double peak_of(double (*fn)(long), double seconds) {
  double best = 0, t_end = dt_time_now() + seconds;
  fn(1 << 16); /* warm-up: clocks up */
  do {
    double t0 = dt_time_now(), flop = fn(1L << 22), t = dt_time_now() - t0;
    if (t > 0 && flop / t > best) best = flop / t;
  } while (dt_time_now() < t_end);
  return best * 1e-9;
}

/* The peak of the path dt_sgemm uses (0 when unknown), as the share's base. */
static double peak_for_kernel(const char *kernel, double seconds) {
#ifdef BENCH_X86
  if (strcmp(kernel, "avx2+fma") == 0) return peak_of(peak_avx2, seconds);
  if (strcmp(kernel, "avx512") == 0) return peak_of(peak_avx512, seconds);
#endif
  if (strcmp(kernel, "portable") == 0) return peak_of(peak_portable, seconds);
  return 0;
}

/* Adam's own floor on this core (`bench_speed adam`): dtrain's Adam update
 * (dt_optim_step) over the MLP's 235,146 parameters, and the same update over
 * 8,192 floats at a time (its four arrays, 128 KiB, stay in L2; fewer floats
 * a call and the call's own cost shows), scaled to 235,146: the
 * first is what a training step pays, the second what the arithmetic alone
 * costs (one square root and two divides an element, as PyTorch computes
 * them). Where the two are close the divider binds it, where the whole run is
 * much slower the memory does. Best of short windows, one thread. */
static double adam_step_us(int64_t floats, int calls, double seconds) {
  dt_params *P = dt_params_create(3);
  int64_t shape[1] = {floats};
  dt_params_add(P, "p", 1, shape, dt_init_uniform(-0.1f, 0.1f));
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 1e-3f;
  dt_optim *o = dt_optim_create(P, &od);
  double best = -1;
  if (o) {
    float *g = dt_params_grad(P);
    for (int64_t i = 0; i < floats; i++) g[i] = 1e-3f * (float)(i % 17) - 8e-3f;
    double t_end = dt_time_now() + seconds;
    do {
      double t0 = dt_time_now();
      for (int c = 0; c < calls; c++) dt_optim_step(o);
      double t = (dt_time_now() - t0) / calls;
      if (best < 0 || t < best) best = t;
    } while (dt_time_now() < t_end);
    dt_optim_destroy(o);
  }
  dt_params_destroy(P);
  return best * 1e6;
}

static int run_adam(double seconds) {
  const int64_t whole = 235146, part = 8192;
  double w = adam_step_us(whole, 4, seconds / 2), c = adam_step_us(part, 64, seconds / 2);
  if (w < 0 || c < 0) {
    fprintf(stderr, "bench_speed adam: %s\n", dt_last_error());
    return 1;
  }
  double scaled = c * (double)whole / (double)part;
  printf("adam floats=%lld whole_us=%.1f cached_us=%.1f ns_per_float=%.3f cached_ns_per_float=%.3f kernel=%s\n",
         (long long)whole, w, scaled, w * 1e3 / (double)whole, scaled * 1e3 / (double)whole, dt_sgemm_kernel());
  return 0;
}

static int run_peak(double seconds) {
  printf("peak path=portable gflops=%.1f\n", peak_of(peak_portable, seconds));
#ifdef BENCH_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    printf("peak path=avx2+fma gflops=%.1f\n", peak_of(peak_avx2, seconds));
  else
    printf("peak path=avx2+fma skipped (the CPU has no AVX2+FMA)\n");
  if (__builtin_cpu_supports("avx512f"))
    printf("peak path=avx512 gflops=%.1f\n", peak_of(peak_avx512, seconds));
  else
    printf("peak path=avx512 skipped (the CPU has no AVX-512)\n");
#else
  printf("peak path=simd skipped (only x86 has a measured vector peak here)\n");
#endif
  /* the path dt_sgemm uses (DTRAIN_ISA may pick another): the shares' base */
  double in_use = peak_for_kernel(dt_sgemm_kernel(), seconds);
  if (in_use > 0) printf("peak in_use=%s gflops=%.1f\n", dt_sgemm_kernel(), in_use);
  else printf("peak in_use=%s not measured\n", dt_sgemm_kernel());
  return 0;
}

/* ---- training steps ---------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}


#include "bench_models.h"

static int run_train(int cnn, int batch, double seconds, int threads) {
  if (dt_set_threads(threads) != DTRAIN_OK) {
    fprintf(stderr, "bench_speed: dt_set_threads(%d): %s\n", threads, dt_last_error());
    return 1;
  }
  dt_params *P = dt_params_create(1);
  model md;
  model_init(&md, P, cnn);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 1e-3f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);
  if (!P || !opt || !g) {
    fprintf(stderr, "bench_speed: set-up failed: %s\n", dt_last_error());
    return 1;
  }
  float *xs = (float *)malloc(sizeof(float) * NSAMPLES * 784);
  int32_t *ys = (int32_t *)malloc(sizeof(int32_t) * NSAMPLES);
  synthetic_data(xs, ys);
  int64_t shape_mlp[2] = {batch, 784}, shape_cnn[4] = {batch, 1, 28, 28};
  int nbatches = NSAMPLES / batch, steps = 0, window = 0, nrates = 0;
  /* Windows of a few steps (~10 ms for the MLP, one step for the CNN): the
   * best window is the least disturbed one on a shared machine. */
  int per_window = cnn ? 1 : (batch >= 256 ? 4 : 10);
  static double rates[1 << 14];
  double t_end = 0.0, tw = 0.0, t_first = 0.0;
  clock_t c_first = 0;
  float last_loss = 0.0f;
  const char *pe = getenv("BENCH_PROFILE");
  const int profile = pe && *pe && strcmp(pe, "0") != 0;
  for (int s = 0;; s++) {
    if (s == 3) { /* warm-up steps excluded */
      if (profile) dt_profile_start();
      t_first = dt_time_now();
      c_first = clock();
      t_end = t_first + seconds;
      tw = t_first;
    }
    int bi = s % nbatches;
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *x = dt_tensor_wrap(g, cnn ? 4 : 2, cnn ? shape_cnn : shape_mlp, xs + (size_t)bi * batch * 784);
    dt_tensor *loss = dt_cross_entropy(g, forward(g, &md, x), ys + (size_t)bi * batch);
    if (dt_backward(g, loss) != DTRAIN_OK) {
      fprintf(stderr, "bench_speed: %s\n", dt_graph_message(g));
      return 1;
    }
    last_loss = loss->data[0];
    dt_optim_step(opt);
    if (s >= 3) {
      steps++;
      if (++window == per_window) {
        double now = dt_time_now();
        if (nrates < (int)(sizeof rates / sizeof rates[0])) rates[nrates++] = window * (double)batch / (now - tw);
        window = 0;
        tw = now;
        if (now > t_end && nrates >= 3) break;
      }
    }
  }
  double wall = dt_time_now() - t_first;
  if (profile) dt_profile_stop();
  double cpu = steps * (double)batch / ((double)(clock() - c_first) / CLOCKS_PER_SEC);
  qsort(rates, (size_t)nrates, sizeof rates[0], cmp_double);
  dt_memory_info mi;
  dt_memory_stats(P, opt, g, &mi);
  printf("result samples_per_s=%.1f median_samples_per_s=%.1f cpu_samples_per_s=%.1f windows=%d peak_rss_kb=%ld "
         "params_kb=%.0f optim_kb=%.0f activations_kb=%.0f loss=%.4f kernel=%s threads=%d flops_per_sample=%.0f\n",
         rates[nrates - 1], rates[nrates / 2], cpu, nrates, peak_rss_kb(), mi.params_bytes / 1024.0,
         mi.optim_bytes / 1024.0, mi.activations_bytes / 1024.0, (double)last_loss, dt_sgemm_kernel(), threads,
         model_flops_per_sample(&md));
  if (profile) {
    static char table[16384];
    dt_profile_format(table, sizeof table, steps, wall);
    fputs(table, stdout);
  }
  free(xs);
  free(ys);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return 0;
}


/* ---- DTRAIN_USE_CBLAS: the step's GEMM time through dt_sgemm vs raw OpenBLAS ---------- */
#ifdef DTRAIN_USE_CBLAS
typedef struct gemm_call {
  int order, ta, tb, m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
} gemm_call;
static gemm_call calls[64];
static int ncalls, record_on;

void bench_cblas_hook(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb,
                      const blasint m, const blasint n, const blasint k, const float alpha, const float *a,
                      const blasint lda, const float *b, const blasint ldb, const float beta, float *c,
                      const blasint ldc) {
  if (record_on && ncalls < (int)(sizeof calls / sizeof calls[0])) {
    gemm_call *q = &calls[ncalls++];
    q->order = (int)order;
    q->ta = (int)ta;
    q->tb = (int)tb;
    q->m = m;
    q->n = n;
    q->k = k;
    q->lda = lda;
    q->ldb = ldb;
    q->ldc = ldc;
    q->alpha = alpha;
    q->beta = beta;
    q->a = a;
    q->b = b;
    q->c = c;
  }
  cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* Seconds for one pass over the recorded calls (best window of ~budget s). */
static double time_calls(int direct, const float *a, const float *b, float *c, double budget) {
  double best = 1e30, t_end = dt_time_now() + budget;
  do {
    double t0 = dt_time_now();
    for (int rep = 0; rep < 8; rep++)
      for (int i = 0; i < ncalls; i++) {
        const gemm_call *q = &calls[i];
        if (direct)
          cblas_sgemm((enum CBLAS_ORDER)q->order, (enum CBLAS_TRANSPOSE)q->ta, (enum CBLAS_TRANSPOSE)q->tb, q->m,
                      q->n, q->k, q->alpha, a, q->lda, b, q->ldb, q->beta, c, q->ldc);
        else
          dt_sgemm(q->ta == CblasTrans, q->tb == CblasTrans, q->m, q->n, q->k, q->alpha, a, q->lda, b, q->ldb,
                   q->beta, c, q->ldc);
      }
    double t = (dt_time_now() - t0) / 8;
    if (t < best) best = t;
  } while (dt_time_now() < t_end);
  return best;
}

static int run_cblas(int batch, double seconds) {
  openblas_set_num_threads(1);
  dt_params *P = dt_params_create(1);
  dt_nn_linear fc1, fc2, fc3;
  dt_nn_linear_init(&fc1, P, "fc1", 784, 256, 1);
  dt_nn_linear_init(&fc2, P, "fc2", 256, 128, 1);
  dt_nn_linear_init(&fc3, P, "fc3", 128, 10, 1);
  dt_graph *g = dt_graph_create(P, NULL);
  float *xs = (float *)calloc((size_t)batch * 784, sizeof(float));
  int32_t *ys = (int32_t *)calloc((size_t)batch, sizeof(int32_t));
  if (!P || !g || !xs || !ys) return 1;
  int64_t shape[2] = {batch, 784};
  record_on = 1; /* one training step: forward and backward */
  dt_tensor *x = dt_tensor_wrap(g, 2, shape, xs);
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &fc1, x));
  h = dt_relu(g, dt_nn_linear_forward(g, &fc2, h));
  dt_tensor *loss = dt_cross_entropy(g, dt_nn_linear_forward(g, &fc3, h), ys);
  if (dt_backward(g, loss) != DTRAIN_OK) {
    fprintf(stderr, "bench_speed: %s\n", dt_graph_message(g));
    return 1;
  }
  record_on = 0;
  /* Replay on scratch buffers big enough for every call (the shapes and
   * leading dimensions are the step's; the data does not change the time). */
  size_t most = 0;
  for (int i = 0; i < ncalls; i++) {
    const gemm_call *q = &calls[i];
    size_t sa = (size_t)q->lda * (size_t)(q->ta == CblasTrans ? q->k : q->m);
    size_t sb = (size_t)q->ldb * (size_t)(q->tb == CblasTrans ? q->n : q->k);
    size_t sc = (size_t)q->ldc * (size_t)q->m;
    if (sa > most) most = sa;
    if (sb > most) most = sb;
    if (sc > most) most = sc;
  }
  float *a = (float *)calloc(most, sizeof(float)), *b = (float *)calloc(most, sizeof(float));
  float *c = (float *)calloc(most, sizeof(float));
  if (!a || !b || !c) return 1;
  for (size_t i = 0; i < most; i++) {
    a[i] = (float)(i % 7) * 0.1f;
    b[i] = (float)(i % 5) * 0.1f;
  }
  double td = 1e30, tb = 1e30;
  for (int round = 0; round < 6; round++) { /* alternate the sides */
    double t = time_calls(0, a, b, c, seconds / 12);
    if (t < td) td = t;
    t = time_calls(1, a, b, c, seconds / 12);
    if (t < tb) tb = t;
  }
  printf("result gemm_calls=%d dt_sgemm_us=%.1f cblas_us=%.1f ratio=%.3f kernel=%s\n", ncalls, td * 1e6, tb * 1e6,
         td / tb, dt_sgemm_kernel());
  free(a);
  free(b);
  free(c);
  free(xs);
  free(ys);
  dt_graph_destroy(g);
  dt_params_destroy(P);
  return 0;
}
#endif

int main(int argc, char **argv) {
  int threads = argc >= 4 ? atoi(argv[3]) : 1;
  if (threads < 1) threads = 1;
  if (argc >= 2 && strcmp(argv[1], "gemm") == 0) return run_gemm(argc >= 3 ? atof(argv[2]) : 0.6, threads);
  if (argc >= 2 && strcmp(argv[1], "peak") == 0) return run_peak(argc >= 3 ? atof(argv[2]) : 0.5);
  if (argc >= 2 && strcmp(argv[1], "adam") == 0) return run_adam(argc >= 3 ? atof(argv[2]) : 1.0);
  if (argc >= 3 && (strcmp(argv[1], "mlp") == 0 || strcmp(argv[1], "cnn") == 0)) {
    int batch = atoi(argv[2]);
    threads = argc >= 5 ? atoi(argv[4]) : 1;
    if (batch < 1 || batch > NSAMPLES || threads < 1) return 2;
    return run_train(argv[1][0] == 'c', batch, argc >= 4 ? atof(argv[3]) : 3.0, threads);
  }
#ifdef DTRAIN_USE_CBLAS
  if (argc >= 3 && strcmp(argv[1], "cblas") == 0) {
    int batch = atoi(argv[2]);
    if (batch < 1 || batch > NSAMPLES) return 2;
    return run_cblas(batch, argc >= 4 ? atof(argv[3]) : 2.0);
  }
#endif
  fprintf(stderr, "usage: bench_speed gemm [seconds [threads]] | peak [seconds] | adam [seconds] | mlp BATCH [seconds [threads]] | cnn BATCH [seconds "
                  "[threads]] | cblas BATCH [seconds] (DTRAIN_USE_CBLAS build)\n");
  return 2;
}
