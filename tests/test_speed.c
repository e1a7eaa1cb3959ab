/* The speed work: the run-time GEMM dispatch (SIMD and portable kernels agree
 * with a double reference and with each other, both paths deterministic, the
 * portable path can be forced by environment or call), the SIMD fast paths
 * of Adam, ReLU, 2x2 max pooling and the im2col span copy (same results as
 * the plain definitions), dt_memory_stats, and the intra-op threads
 * (dt_set_threads: GEMM, Adam, Winograd, bias gradients, ReLU in place
 * and max pooling bit for bit as with one thread, the DTRAIN_THREADS
 * variable, one thread inside strategy replicas, concurrent callers). */
#define _POSIX_C_SOURCE 200809L /* setenv */
/* A private copy of the implementation: the intra-op tests look at the
 * replica mark (dt__par_set_replica / dt__par_threads). */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#include <float.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- GEMM dispatch ------------------------------------------------------------------- */

/* The kernel this build should pick on this CPU. */
static const char *expected_kernel(void) {
  unsigned f = dt_build_features();
  if (f & DTRAIN_FEATURE_CBLAS) return "cblas";
  if (!(f & DTRAIN_FEATURE_SIMD)) return "portable";
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return "portable";
  return __builtin_cpu_supports("avx512f") ? "avx512" : "avx2+fma";
#elif defined(__aarch64__) && defined(__ARM_NEON)
  return "neon";
#else
  return "portable";
#endif
}

static int is_cblas(void) { return (dt_build_features() & DTRAIN_FEATURE_CBLAS) != 0; }

/* The GEMM paths this build and CPU have, portable first (dt_sgemm_use_isa
 * accepts them); returns their count. The others are reported once as
 * skipped, with the reason, never counted as passed. */
static const char *const isa_names[] = {"portable", "avx2", "avx512", "neon"};
static const char *const isa_kernels[] = {"portable", "avx2+fma", "avx512", "neon"};
static int gemm_isas(int *out) {
  static int reported = 0;
  int n = 0;
  for (int i = 0; i < 4; i++) {
    if (dt_sgemm_use_isa(isa_names[i]) == DTRAIN_OK) out[n++] = i;
    else if (!reported) th_skip_item(isa_names[i], "GEMM path: %s", dt_last_error());
  }
  reported = 1;
  dt_sgemm_use_isa("best");
  return n;
}

/* In a fresh process: DTRAIN_ISA names the path (here the narrowest SIMD
 * one the CPU has, else portable); dt_sgemm_use_isa("best") goes back. */
static void test_gemm_isa_env(void) {
  const char *want = "portable";
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
  if (!is_cblas() && (dt_build_features() & DTRAIN_FEATURE_SIMD) && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma"))
    want = "avx2";
#endif
  setenv("DTRAIN_ISA", want, 1);
  const char *got = dt_sgemm_kernel();
  CHECK_MSG(strcmp(got, is_cblas() ? "cblas" : strcmp(want, "avx2") == 0 ? "avx2+fma" : "portable") == 0,
            "DTRAIN_ISA=%s: kernel %s", want, got);
  unsetenv("DTRAIN_ISA");
  CHECK(dt_sgemm_use_isa("best") == DTRAIN_OK);
  CHECK_MSG(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0, "kernel %s", dt_sgemm_kernel());
}

/* In a fresh process: a DTRAIN_ISA that is no path, or one this CPU lacks,
 * leaves the best path and says so in the log. */
static int isa_warnings;
static void isa_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)code;
  (void)user;
  if (level == DTRAIN_LOG_WARN && strstr(msg, "DTRAIN_ISA=avx1024")) isa_warnings++;
}
static void test_gemm_isa_env_bad(void) {
  dt_set_logger(isa_log, NULL, DTRAIN_LOG_WARN);
  setenv("DTRAIN_ISA", "avx1024", 1);
  CHECK_MSG(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0, "kernel %s", dt_sgemm_kernel());
  CHECK(isa_warnings == 1);
  unsetenv("DTRAIN_ISA");
  dt_set_logger(NULL, NULL, DTRAIN_LOG_WARN);
}

/* dt_sgemm_use_isa refuses names it does not know and paths the CPU lacks,
 * changing nothing; every path it accepts is the one dt_sgemm_kernel names. */
static void test_gemm_use_isa(void) {
  CHECK(dt_sgemm_use_isa(NULL) == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_sgemm_use_isa("avx1024") == DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "avx1024") != NULL);
  CHECK(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0);
  int have[4], n = gemm_isas(have), accepted = 0;
  for (int i = 0; i < 4; i++) {
    dt_result r = dt_sgemm_use_isa(isa_names[i]);
    if (r == DTRAIN_OK) {
      accepted++;
      CHECK_MSG(strcmp(dt_sgemm_kernel(), is_cblas() ? "cblas" : isa_kernels[i]) == 0, "%s: kernel %s",
                isa_names[i], dt_sgemm_kernel());
    } else {
      CHECK(r == DTRAIN_ERR_UNSUPPORTED);
    }
  }
  CHECK(accepted == n);
  CHECK(dt_sgemm_use_isa("best") == DTRAIN_OK);
  CHECK(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0);
  printf("gemm paths here: %d (best %s)\n", n, dt_sgemm_kernel());
}

/* In a fresh process (FRESH_RUN: nothing called dt_sgemm there yet):
 * DTRAIN_GEMM=portable in the environment selects the portable kernel;
 * dt_sgemm_use_portable(0) goes back to the best one and reports that the
 * override was on. */
static void test_gemm_env_override(void) {
  setenv("DTRAIN_GEMM", "portable", 1);
  CHECK_MSG(strcmp(dt_sgemm_kernel(), is_cblas() ? "cblas" : "portable") == 0, "kernel %s", dt_sgemm_kernel());
  unsetenv("DTRAIN_GEMM");
  CHECK(dt_sgemm_use_portable(0) == 1);
  CHECK_MSG(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0, "kernel %s, expected %s", dt_sgemm_kernel(),
            expected_kernel());
  printf("sgemm kernel: %s\n", dt_sgemm_kernel());
}

static void test_gemm_use_portable_switch(void) {
  dt_sgemm_use_portable(0); /* from the best kernel, whatever ran before */
  CHECK(dt_sgemm_use_portable(1) == 0);
  CHECK(strcmp(dt_sgemm_kernel(), is_cblas() ? "cblas" : "portable") == 0);
  CHECK(dt_sgemm_use_portable(1) == 1);
  CHECK(dt_sgemm_use_portable(0) == 1);
  CHECK(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0);
  CHECK(dt_sgemm_use_portable(0) == 0);
}

typedef struct gemm_case { int ta, tb; int64_t m, n, k, pad; float alpha, beta; } gemm_case;

/* op(X)[i][j] of a row-major X with leading dim ld. */
static double at(const float *x, int64_t ld, int trans, int64_t i, int64_t j) {
  return trans ? (double)x[j * ld + i] : (double)x[i * ld + j];
}

/* One case on both paths: each against the double reference (with the
 * float-error bound of a k-term sum), the two against each other, and each
 * path twice (bitwise the same). A and B carry NaN in their padding so that a
 * stray read shows; C's padding must survive. Returns the number of bad
 * elements. */
static int run_gemm_case(const gemm_case *t) {
  int64_t ar = t->ta ? t->k : t->m, ac = t->ta ? t->m : t->k, br = t->tb ? t->n : t->k, bc = t->tb ? t->k : t->n;
  int64_t lda = ac + t->pad, ldb = bc + t->pad, ldc = t->n + t->pad;
  size_t na = (size_t)(ar * lda), nb = (size_t)(br * ldb), nc = (size_t)(t->m * ldc);
  float *a = (float *)malloc(na * sizeof(float)), *b = (float *)malloc(nb * sizeof(float));
  float *c0 = (float *)malloc(nc * sizeof(float)), *c[4][2];
  int isa[4], np = gemm_isas(isa);
  for (int64_t i = 0; i < ar; i++)
    for (int64_t j = 0; j < lda; j++) a[i * lda + j] = j < ac ? th_uniform(-1, 1) : NAN;
  for (int64_t i = 0; i < br; i++)
    for (int64_t j = 0; j < ldb; j++) b[i * ldb + j] = j < bc ? th_uniform(-1, 1) : NAN;
  for (int64_t i = 0; i < t->m; i++)
    for (int64_t j = 0; j < ldc; j++) c0[i * ldc + j] = j < t->n ? th_uniform(-1, 1) : 777.0f;
  for (int p = 0; p < np; p++) {
    dt_sgemm_use_isa(isa_names[isa[p]]);
    for (int r = 0; r < 2; r++) {
      c[p][r] = (float *)malloc(nc * sizeof(float));
      memcpy(c[p][r], c0, nc * sizeof(float));
      dt_sgemm(t->ta, t->tb, t->m, t->n, t->k, t->alpha, a, lda, b, ldb, t->beta, c[p][r], ldc);
    }
  }
  dt_sgemm_use_isa("best");
  int bad = 0;
  for (int p = 0; p < np; p++)
    if (memcmp(c[p][0], c[p][1], nc * sizeof(float)) != 0) {
      fprintf(stderr, "gemm %s path not deterministic\n", isa_names[isa[p]]);
      bad++;
    }
  /* each path against the double reference and against the portable one (p = 0) */
  for (int p = np > 1 ? 1 : 0; p < np; p++)
  for (int64_t i = 0; i < t->m; i++) {
    for (int64_t j = 0; j < ldc; j++) {
      float g0 = c[p][0][i * ldc + j], g1 = c[0][0][i * ldc + j];
      if (j >= t->n) {
        if (g0 != 777.0f || g1 != 777.0f) bad++;
        continue;
      }
      double s = 0, sabs = 0;
      for (int64_t q = 0; q < t->k; q++) {
        double v = at(a, lda, t->ta, i, q) * at(b, ldb, t->tb, q, j);
        s += v;
        sabs += fabs(v);
      }
      double cin = t->beta == 0.0f ? 0.0 : (double)c0[i * ldc + j];
      double want = (double)t->alpha * s + (double)t->beta * cin;
      double tol = 2.0 * (double)(t->k + 3) * FLT_EPSILON * (fabs((double)t->alpha) * sabs + fabs(t->beta * cin)) + 1e-30;
      if (!(fabs(g0 - want) <= tol) || !(fabs(g1 - want) <= tol) || !(fabs((double)g0 - (double)g1) <= tol)) {
        if (bad < 3)
          fprintf(stderr, "gemm t%d%d %lldx%lldx%lld: C[%lld][%lld] %s %.9g portable %.9g want %.9g\n", t->ta,
                  t->tb, (long long)t->m, (long long)t->n, (long long)t->k, (long long)i, (long long)j,
                  isa_names[isa[p]], (double)g0, (double)g1, want);
        bad++;
      }
    }
  }
  for (int p = 0; p < np; p++)
    for (int r = 0; r < 2; r++) free(c[p][r]);
  free(a);
  free(b);
  free(c0);
  return bad;
}

/* Random shapes around the tile and block edges (6, 8, 12, 16; 48, 96, 192,
 * 256), every transpose combination, several alpha/beta, padded leading dims,
 * including the few-row blocking (m <= 96 with n > 192). */
static void test_gemm_paths_agree(void) {
  static const int64_t dims[] = {1, 2, 5, 6, 7, 8, 11, 12, 13, 16, 17, 31, 47, 48, 49, 64, 95, 96, 97, 130, 193, 260};
  static const int64_t ks[] = {1, 3, 8, 9, 25, 64, 255, 256, 257, 300};
  static const float alphas[] = {1.0f, -0.5f, 2.0f};
  static const float betas[] = {0.0f, 1.0f, 0.5f};
  int nd = (int)(sizeof dims / sizeof dims[0]), nk = (int)(sizeof ks / sizeof ks[0]);
  th_seed(101);
  int cases = 0, failed = 0;
  for (int i = 0; i < (th_emulated() ? 16 : 48); i++) { /* under an emulator the first 16 */
    gemm_case t;
    t.ta = i & 1;
    t.tb = (i >> 1) & 1;
    t.m = dims[(int)(th_rand() * nd)];
    t.n = dims[(int)(th_rand() * nd)];
    t.k = ks[(int)(th_rand() * nk)];
    t.pad = (int64_t)(th_rand() * 3);
    t.alpha = alphas[i % 3];
    t.beta = betas[(i / 3) % 3];
    if (run_gemm_case(&t) != 0) failed++;
    cases++;
  }
  /* The shapes of the training steps, and the few-row blocking. */
  static const gemm_case fixed[] = {
      {0, 1, 64, 256, 784, 0, 1.0f, 1.0f}, {1, 0, 256, 784, 64, 0, 1.0f, 1.0f}, {0, 0, 64, 588, 300, 1, 1.0f, 0.0f},
      {0, 1, 64, 300, 200, 0, 1.0f, 0.0f}, {1, 0, 7, 500, 33, 2, 1.0f, 1.0f},   {0, 0, 96, 400, 257, 0, -1.0f, 0.5f},
      {1, 1, 97, 401, 40, 1, 1.0f, 0.0f},  {0, 0, 200, 200, 520, 0, 1.0f, 0.0f}};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
    if (run_gemm_case(&fixed[i]) != 0) failed++;
    cases++;
  }
  CHECK_MSG(failed == 0, "%d of %d gemm cases wrong", failed, cases);
}

/* bfloat16 rounding as the bf16 path does it (nearest even; subnormals to
 * signed zero; NaN stays NaN). */
static float bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  else if ((u & 0x7fffffffu) <= 0x7f800000u) u = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* dt_set_matmul_precision(DTRAIN_MATMUL_BF16): where the CPU has AVX512_BF16
 * every product equals the double product of the bf16-rounded inputs to
 * float accumulation error (so the packing rounds every element, in every
 * transpose, edge and odd k, exactly once and right), it is deterministic
 * and the same at 1..3 threads; elsewhere it is refused with a reason and
 * nothing changes (reported as skipped, the refusal checked). */
static void test_gemm_bf16(void) {
  CHECK(dt_set_matmul_precision((dt_matmul_precision)7) == DTRAIN_ERR_INVALID_ARG);
  dt_result r = dt_set_matmul_precision(DTRAIN_MATMUL_BF16);
  if (r != DTRAIN_OK) {
    CHECK(r == DTRAIN_ERR_UNSUPPORTED);
    CHECK(strstr(dt_last_error(), "AVX512_BF16") != NULL || strstr(dt_last_error(), "BLAS") != NULL);
    CHECK(dt_get_matmul_precision() == DTRAIN_MATMUL_FP32);
    CHECK(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0);
    th_skip_item("test_gemm_bf16", "bf16 products: %s", dt_last_error());
    return;
  }
  CHECK(dt_get_matmul_precision() == DTRAIN_MATMUL_BF16);
  CHECK_MSG(strcmp(dt_sgemm_kernel(), "avx512-bf16") == 0, "kernel %s", dt_sgemm_kernel());
  static const gemm_case cases[] = {{0, 0, 7, 33, 5, 1, 1.0f, 0.0f},    {0, 1, 64, 256, 784, 0, 1.0f, 1.0f},
                                    {1, 0, 13, 70, 257, 2, 0.5f, 1.0f},  {1, 1, 100, 31, 64, 0, 1.0f, 0.5f},
                                    {0, 0, 6, 32, 2, 0, -1.0f, 0.0f},    {0, 1, 1, 1, 1, 0, 1.0f, 0.0f},
                                    {1, 0, 200, 97, 300, 1, 1.0f, 0.0f}, {0, 1, 2, 65, 33, 3, 2.0f, 1.0f}};
  th_seed(77);
  int bad = 0;
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const gemm_case *t = &cases[ci];
    int64_t ar = t->ta ? t->k : t->m, ac = t->ta ? t->m : t->k, br = t->tb ? t->n : t->k, bc = t->tb ? t->k : t->n;
    int64_t lda = ac + t->pad, ldb = bc + t->pad, ldc = t->n + t->pad;
    float *a = (float *)malloc((size_t)(ar * lda) * sizeof(float)), *b = (float *)malloc((size_t)(br * ldb) * sizeof(float));
    float *c0 = (float *)malloc((size_t)(t->m * ldc) * sizeof(float)), *c1 = (float *)malloc((size_t)(t->m * ldc) * sizeof(float));
    float *c2 = (float *)malloc((size_t)(t->m * ldc) * sizeof(float)), *cin = (float *)malloc((size_t)(t->m * ldc) * sizeof(float));
    th_fill(a, ar * lda, -1, 1);
    th_fill(b, br * ldb, -1, 1);
    th_fill(cin, t->m * ldc, -1, 1);
    memcpy(c0, cin, (size_t)(t->m * ldc) * sizeof(float));
    memcpy(c1, cin, (size_t)(t->m * ldc) * sizeof(float));
    memcpy(c2, cin, (size_t)(t->m * ldc) * sizeof(float));
    dt_sgemm(t->ta, t->tb, t->m, t->n, t->k, t->alpha, a, lda, b, ldb, t->beta, c0, ldc);
    dt_sgemm(t->ta, t->tb, t->m, t->n, t->k, t->alpha, a, lda, b, ldb, t->beta, c1, ldc);
    if (dt_set_threads(3) == DTRAIN_OK) {
      dt_sgemm(t->ta, t->tb, t->m, t->n, t->k, t->alpha, a, lda, b, ldb, t->beta, c2, ldc);
      dt_set_threads(1);
      bad += memcmp(c0, c2, (size_t)(t->m * ldc) * sizeof(float)) != 0;
    }
    bad += memcmp(c0, c1, (size_t)(t->m * ldc) * sizeof(float)) != 0;
    for (int64_t i = 0; i < t->m; i++)
      for (int64_t j = 0; j < t->n; j++) {
        double s = 0, sabs = 0;
        for (int64_t q = 0; q < t->k; q++) {
          double v = (double)bf16_round((float)at(a, lda, t->ta, i, q)) * (double)bf16_round((float)at(b, ldb, t->tb, q, j));
          s += v;
          sabs += fabs(v);
        }
        double want = (double)t->alpha * s + (t->beta == 0.0f ? 0.0 : (double)t->beta * cin[i * ldc + j]);
        double tol = 2.0 * (double)(t->k + 3) * FLT_EPSILON * (fabs((double)t->alpha) * sabs + fabs(t->beta * cin[i * ldc + j])) + 1e-30;
        if (!(fabs((double)c0[i * ldc + j] - want) <= tol)) {
          if (bad < 3)
            fprintf(stderr, "bf16 gemm t%d%d %lldx%lldx%lld: C[%lld][%lld] %.9g want %.9g\n", t->ta, t->tb,
                    (long long)t->m, (long long)t->n, (long long)t->k, (long long)i, (long long)j, (double)c0[i * ldc + j], want);
          bad++;
        }
      }
    free(a);
    free(b);
    free(c0);
    free(c1);
    free(c2);
    free(cin);
  }
  CHECK_MSG(bad == 0, "%d bf16 gemm elements or repeats wrong", bad);
  /* a float product differs from the bf16 one (the rounding is really there) */
  float x[2] = {1.0f + 1.0f / 1024.0f, 1.0f}, y[2] = {1.0f, 1.0f}, got = 0.0f;
  dt_sgemm(0, 0, 1, 1, 1, 1.0f, x, 1, y, 1, 0.0f, &got, 1);
  CHECK_MSG(got == 1.0f, "bf16 of 1+2^-10 times 1: %.9g", (double)got);
  CHECK(dt_set_matmul_precision(DTRAIN_MATMUL_FP32) == DTRAIN_OK);
  dt_sgemm(0, 0, 1, 1, 1, 1.0f, x, 1, y, 1, 0.0f, &got, 1);
  CHECK(got == x[0]);
  CHECK(strcmp(dt_sgemm_kernel(), expected_kernel()) == 0);
}

/* beta == 0 never reads C (NaN there must not leak), on both paths. */
static void test_gemm_beta0_ignores_c(void) {
  int64_t m = 13, n = 37, k = 29;
  float *a = (float *)malloc((size_t)(m * k) * sizeof(float)), *b = (float *)malloc((size_t)(k * n) * sizeof(float));
  float *c = (float *)malloc((size_t)(m * n) * sizeof(float));
  th_seed(5);
  th_fill(a, m * k, -1, 1);
  th_fill(b, k * n, -1, 1);
  for (int p = 0; p < 2; p++) {
    dt_sgemm_use_portable(p);
    for (int64_t i = 0; i < m * n; i++) c[i] = NAN;
    dt_sgemm(0, 0, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);
    int nan = 0;
    for (int64_t i = 0; i < m * n; i++) nan += isnan(c[i]) != 0;
    CHECK_MSG(nan == 0, "%s path: %d NaN", p ? "portable" : "default", nan);
  }
  dt_sgemm_use_portable(0);
  free(a);
  free(b);
  free(c);
}

/* The kernel is picked on the first call; several threads making their first
 * calls at once must agree on it (and be race-free under ThreadSanitizer). */
typedef struct gemm_thread_arg { const float *a, *b, *want; int ok; } gemm_thread_arg;

static void *gemm_thread(void *p) {
  gemm_thread_arg *t = (gemm_thread_arg *)p;
  float c[40 * 30];
  dt_sgemm(0, 0, 40, 30, 50, 1.0f, t->a, 50, t->b, 30, 0.0f, c, 30);
  t->ok = memcmp(c, t->want, sizeof c) == 0 && strcmp(dt_sgemm_kernel(), expected_kernel()) == 0;
  return NULL;
}

static void test_gemm_first_call_threads(void) {
  static float a[40 * 50], b[50 * 30], want[40 * 30];
  th_seed(17);
  th_fill(a, 40 * 50, -1, 1);
  th_fill(b, 50 * 30, -1, 1);
  dt_sgemm(0, 0, 40, 30, 50, 1.0f, a, 50, b, 30, 0.0f, want, 30);
  dt_sgemm_use_portable(0); /* forget the choice: the threads' calls pick again */
  pthread_t th[4];
  gemm_thread_arg args[4];
  for (int i = 0; i < 4; i++) {
    args[i].a = a;
    args[i].b = b;
    args[i].want = want;
    args[i].ok = 0;
    CHECK(pthread_create(&th[i], NULL, gemm_thread, &args[i]) == 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    CHECK_MSG(args[i].ok, "thread %d: result or kernel differs", i);
  }
}

/* ---- Adam: the SIMD update is the scalar update, bit for bit -------------------------- */

/* The scalar definition (dt_optim.c's loop, PyTorch's single-tensor Adam). */
static void ref_adam(float *p, const float *g, float *m, float *v, size_t n, int64_t step, float lr, float wd,
                     int decoupled) {
  const double b1 = (double)0.9f, b2 = (double)0.999f, t = (double)(step + 1); /* the desc holds floats */
  const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
  const float step_size = (float)((double)lr / bc1), bc2_sqrt = (float)sqrt(bc2);
  const float w1 = (float)(1.0 - b1), w2 = (float)(1.0 - b2), fb2 = 0.999f, eps = 1e-8f;
  const float shrink = (float)(1.0 - (double)lr * (double)wd);
  for (size_t i = 0; i < n; i++) {
    float d = g[i];
    if (wd != 0.0f) {
      if (decoupled) p[i] = p[i] * shrink;
      else d = d + wd * p[i];
    }
    m[i] = m[i] + w1 * (d - m[i]);
    v[i] = v[i] * fb2 + w2 * d * d;
    float denom = sqrtf(v[i]) / bc2_sqrt + eps;
    p[i] = p[i] - step_size * (m[i] / denom);
  }
}

/* Bit for bit where float expressions round at every step (FLT_EVAL_METHOD
 * 0: x86-64 SSE, ARM); where they are evaluated in double (s390x GCC uses
 * FLT_EVAL_METHOD 1) the test's reference and the library's code may round
 * differently (excess precision in products like d * d), so there they must
 * agree to 1e-4 relative: still Adam, just not the same rounding. */
static int buffers_match(const float *a, const float *b, size_t n) {
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
  return memcmp(a, b, n * sizeof(float)) == 0;
#else
  float scale = 0.0f; /* differences are relative to the buffer's magnitude (cancellation in d - m) */
  for (size_t i = 0; i < n; i++) scale = fmaxf(scale, fabsf(a[i]));
  for (size_t i = 0; i < n; i++)
    if (!(fabsf(a[i] - b[i]) <= 1e-4f * fabsf(a[i]) + 1e-5f * scale)) {
      fprintf(stderr, "element %zu: %.9g vs %.9g (scale %g)\n", i, (double)a[i], (double)b[i], (double)scale);
      return 0;
    }
  return 1;
#endif
}

static void test_adam_simd_matches_scalar(void) {
  static const int64_t sizes[] = {1, 7, 8, 9, 4103, 33};
  for (int kind = 0; kind < 3; kind++) { /* Adam, Adam + L2, AdamW */
    dt_params *P = dt_params_create(3);
    for (int i = 0; i < 6; i++) {
      char name[16];
      snprintf(name, sizeof name, "p%d", i);
      int idx = dt_params_add(P, name, 1, &sizes[i], dt_init_uniform(-1, 1));
      dt_params_set_decay(P, idx, i % 2); /* weight decay on some of them */
    }
    dt_optim_options od;
    memset(&od, 0, sizeof od);
    od.kind = kind == 2 ? DTRAIN_OPTIM_ADAMW : DTRAIN_OPTIM_ADAM;
    od.lr = 0.01f;
    od.weight_decay = kind ? 0.05f : 0.0f;
    dt_optim *o = dt_optim_create(P, &od);
    CHECK(o != NULL);
    if (!o) return;
    size_t n = dt_params_size(P);
    float *p = (float *)malloc(n * sizeof(float)), *m = (float *)calloc(n, sizeof(float));
    float *v = (float *)calloc(n, sizeof(float));
    memcpy(p, dt_params_data(P), n * sizeof(float));
    th_seed(77 + (uint64_t)kind);
    int same = 1;
    for (int step = 0; step < 5; step++) {
      float *g = dt_params_grad(P);
      for (size_t i = 0; i < n; i++) g[i] = th_uniform(-2, 2) * (i % 5 == 0 ? 1e-4f : 1.0f);
      for (int i = 0; i < 6; i++) { /* each parameter's range (the layout may pad between them) */
        dt_param_info pi;
        memset(&pi, 0, sizeof pi);
        dt_params_info(P, i, &pi);
        ref_adam(p + pi.offset, g + pi.offset, m + pi.offset, v + pi.offset, pi.size, step, 0.01f,
                 pi.decay ? od.weight_decay : 0.0f, kind == 2);
      }
      dt_optim_step(o);
      same &= buffers_match(p, dt_params_data(P), n);
      same &= buffers_match(m, dt_optim_state(o, 0), n);
      same &= buffers_match(v, dt_optim_state(o, 1), n);
    }
    CHECK_MSG(same, "Adam kind %d differs from the scalar definition", kind);
    free(p);
    free(m);
    free(v);
    dt_optim_destroy(o);
    dt_params_destroy(P);
  }
}

/* ---- ReLU: the SIMD loops give the scalar definition exactly (NaN kept) ------------------ */

static void test_relu_exact(void) {
  enum { N = 1003 };
  static float x[N], gy[N];
  th_seed(9);
  for (int i = 0; i < N; i++) {
    x[i] = th_uniform(-3, 3);
    gy[i] = th_uniform(-1, 1);
  }
  x[0] = NAN;
  x[1] = -0.0f;
  x[2] = 0.0f;
  x[3] = INFINITY;
  x[4] = -INFINITY;
  x[N - 1] = NAN;
  x[5] = 1e-40f; /* subnormal */
  gy[7] = INFINITY;
  /* IEEE subnormals kept: backward with them flushed (the default) reads
   * x[5] as 0 and passes no gradient (tests/test_flush.c) */
  int was = dt_set_flush_denormals(0);
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t shape[1] = {N};
  dt_tensor *xt = dt_tensor_from(g, 1, shape, x);
  dt_tensor_set_requires_grad(xt, 1);
  dt_tensor *y = dt_relu(g, xt);
  CHECK(y != NULL && dt_backward_grad(g, y, gy) == DTRAIN_OK);
  int bad = 0;
  for (int i = 0; y && xt->grad && i < N; i++) {
    /* x <= 0 ? 0 : x: a NaN stays NaN and passes its gradient (PyTorch's rule) */
    float want = x[i] <= 0.0f ? 0.0f : x[i], wg = 0.0f + (x[i] <= 0.0f ? 0.0f : gy[i]);
    if (memcmp(&y->data[i], &want, sizeof want) != 0 || memcmp(&xt->grad[i], &wg, sizeof wg) != 0) bad++;
  }
  CHECK_MSG(bad == 0, "%d relu elements differ", bad);
  dt_graph_destroy(g);
  dt_set_flush_denormals(was);
}

/* ---- max pooling 2x2 stride 2 (the SIMD path: 4 windows at a time) -------------------- */

/* First maximum of the window wins; a NaN wins over numbers. */
static int64_t ref_argmax(const float *plane, int64_t w, int64_t oh, int64_t ow, int k, int s) {
  int64_t at = oh * s * w + ow * s;
  float best = plane[at];
  for (int i = 0; i < k; i++)
    for (int j = 0; j < k; j++) {
      int64_t t = (oh * s + i) * w + ow * s + j;
      float v = plane[t];
      if (v > best || (v != v && best == best)) {
        best = v;
        at = t;
      }
    }
  return at;
}

/* Each shape twice in one graph, reset in between: the second backward's
 * x gradient lands in arena memory that held the first run's values, so a
 * cell the pooling's backward writes no value to (the columns and rows no
 * 2x2 window covers, with odd sizes) would show the stale one. */
static void test_max_pool_fast_path(void) {
  /* output widths 5 (4 + a last 4 that overlaps), 8 (AVX2), 4, 14 (AVX2 + 4 + overlap), 3 (scalar) */
  static const int64_t shapes[][4] = {{2, 3, 8, 11}, {1, 2, 10, 16}, {2, 2, 5, 9}, {1, 3, 6, 29}, {2, 2, 4, 7}};
  int isas[4], nisa = gemm_isas(isas); /* the pooling's SIMD width follows the GEMM's path */
  th_seed(21);
  for (int t = 0; t < 5 * nisa; t++) {
    CHECK(dt_sgemm_use_isa(isa_names[isas[t / 5]]) == DTRAIN_OK);
    const int64_t *shape = shapes[t % 5];
    int64_t n = shape[0] * shape[1] * shape[2] * shape[3];
    float *x = (float *)malloc((size_t)n * sizeof(float));
    dt_graph *g = dt_graph_create(NULL, NULL);
    for (int rep = 0; rep < 2; rep++) {
      dt_graph_reset(g);
      for (int64_t i = 0; i < n; i++) x[i] = (float)(int)th_uniform(-3, 3); /* many ties */
      x[5] = NAN;
      x[n / 2] = NAN;
      x[n - 3] = NAN;
      dt_tensor *xt = dt_tensor_from(g, 4, shape, x);
      dt_tensor_set_requires_grad(xt, 1);
      dt_tensor *y = dt_max_pool2d(g, xt, 2, 2);
      CHECK(y != NULL);
      if (!y) continue;
      float *gy = (float *)malloc((size_t)y->size * sizeof(float));
      for (int64_t i = 0; i < y->size; i++) gy[i] = th_uniform(-1, 1);
      CHECK(dt_backward_grad(g, y, gy) == DTRAIN_OK);
      float *want = (float *)calloc((size_t)n, sizeof(float));
      int64_t planes = shape[0] * shape[1], h = shape[2], w = shape[3], ho = h / 2, wo = w / 2;
      int bad = 0;
      for (int64_t pl = 0; pl < planes; pl++)
        for (int64_t oh = 0; oh < ho; oh++)
          for (int64_t ow = 0; ow < wo; ow++) {
            int64_t a = ref_argmax(x + pl * h * w, w, oh, ow, 2, 2), o = (pl * ho + oh) * wo + ow;
            float v = x[pl * h * w + a], got = y->data[o];
            if (!(got == v || (got != got && v != v))) bad++;
            want[pl * h * w + a] += gy[o];
          }
      CHECK(xt->grad != NULL);
      for (int64_t i = 0; xt->grad && i < n; i++) bad += memcmp(&xt->grad[i], &want[i], sizeof(float)) != 0;
      CHECK_MSG(bad == 0, "max_pool2d 2x2 case %d (%s), run %d: %d mismatches", t % 5, isa_names[isas[t / 5]], rep, bad);
      free(want);
      free(gy);
    }
    free(x);
    dt_graph_destroy(g);
  }
  dt_sgemm_use_isa("best");
}

/* ---- convolution: the im2col span copy and col2im (stride 1, "same" width) ------------ */

typedef struct { int s, p; } conv_ctx;

static dt_tensor *f_conv(dt_graph *g, dt_tensor **in, void *ctx) {
  const conv_ctx *c = (const conv_ctx *)ctx;
  return dt_conv2d(g, in[0], in[1], in[2], c->s, c->p);
}

/* Direct convolution in double; returns the number of outputs off by more
 * than the float error of their sum. */
static int conv_check_values(const float *x, const float *w, const float *b, const dt_tensor *y, const int64_t *xs,
                             const int64_t *ws, int s, int p) {
  int64_t n = xs[0], c = xs[1], h = xs[2], wd = xs[3], o = ws[0], kh = ws[2], kw = ws[3];
  int64_t ho = (h + 2 * p - kh) / s + 1, wo = (wd + 2 * p - kw) / s + 1;
  int bad = 0;
  for (int64_t in = 0; in < n; in++)
    for (int64_t io = 0; io < o; io++)
      for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow++) {
          double acc = b[io], mag = fabs(acc);
          for (int64_t ic = 0; ic < c; ic++)
            for (int64_t i = 0; i < kh; i++)
              for (int64_t j = 0; j < kw; j++) {
                int64_t ih = oh * s - p + i, iw = ow * s - p + j;
                if (ih < 0 || ih >= h || iw < 0 || iw >= wd) continue;
                double t = (double)x[((in * c + ic) * h + ih) * wd + iw] * (double)w[((io * c + ic) * kh + i) * kw + j];
                acc += t;
                mag += fabs(t);
              }
          double got = y->data[((in * o + io) * ho + oh) * wo + ow];
          if (!(fabs(got - acc) <= 4.0 * (double)(c * kh * kw + 2) * FLT_EPSILON * mag + 1e-6)) bad++;
        }
  return bad;
}

static void test_conv_span_paths(void) {
  /* x shape, w shape, stride, padding: "same" convolutions (Wo == W, the
   * span copy), kh != kw, stride 2, and a valid one; small and large planes
   * (images grouped per GEMM or not). */
  static const int64_t cfg[][10] = {
      {3, 2, 9, 9, 4, 2, 5, 5, 1, 2},   {2, 3, 6, 7, 3, 3, 3, 3, 1, 1}, {2, 2, 7, 8, 3, 2, 3, 5, 1, 2},
      {2, 2, 9, 9, 3, 2, 3, 3, 2, 1},   {2, 1, 24, 24, 2, 1, 5, 5, 1, 2}, {2, 2, 6, 6, 2, 2, 3, 3, 1, 0},
  };
  th_seed(61);
  for (int t = 0; t < 6; t++) {
    const int64_t *q = cfg[t];
    int64_t xs[4] = {q[0], q[1], q[2], q[3]}, ws[4] = {q[4], q[5], q[6], q[7]}, bs[1] = {q[4]};
    int s = (int)q[8], p = (int)q[9];
    int64_t nx = xs[0] * xs[1] * xs[2] * xs[3], nw = ws[0] * ws[1] * ws[2] * ws[3];
    float *x = (float *)malloc((size_t)nx * sizeof(float)), *w = (float *)malloc((size_t)nw * sizeof(float));
    float b[8];
    th_fill(x, nx, -1, 1);
    th_fill(w, nw, -1, 1);
    th_fill(b, ws[0], -1, 1);
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *y = dt_conv2d(g, dt_tensor_from(g, 4, xs, x), dt_tensor_from(g, 4, ws, w), dt_tensor_from(g, 1, bs, b), s, p);
    CHECK(y != NULL);
    if (y) CHECK_MSG(conv_check_values(x, w, b, y, xs, ws, s, p) == 0, "conv case %d values", t);
    dt_graph_destroy(g);
    th_input in[3] = {th_in(x, 4, xs, 1), th_in(w, 4, ws, 1), th_in(b, 1, bs, 1)};
    conv_ctx ctx = {s, p};
    int bad = th_gradcheck("conv2d", f_conv, &ctx, in, 3);
    CHECK_MSG(bad == 0, "conv case %d: %d gradient mismatches", t, bad);
    free(x);
    free(w);
  }
}

/* ---- dt_memory_stats ------------------------------------------------------------------------ */

static void test_memory_stats(void) {
  dt_params *P = dt_params_create(1);
  dt_nn_linear l1, l2;
  dt_nn_linear_init(&l1, P, "fc1", 20, 16, 1);
  dt_nn_linear_init(&l2, P, "fc2", 16, 3, 1);
  size_t floats = 20 * 16 + 16 + 16 * 3 + 3;
  CHECK(dt_params_size(P) == floats);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  dt_optim *adam = dt_optim_create(P, &od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.momentum = 0.9f;
  dt_optim *sgdm = dt_optim_create(P, &od);
  od.momentum = 0.0f;
  dt_optim *sgd = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);
  dt_memory_info mi;

  CHECK(dt_memory_stats(P, adam, NULL, &mi) == DTRAIN_OK);
  CHECK(mi.params_bytes == floats * 4 && mi.grads_bytes == floats * 4 && mi.optim_bytes == 2 * floats * 4);
  CHECK(mi.activations_bytes == 0 && mi.arena_bytes == 0 && mi.tape_bytes == 0);
  CHECK(mi.total_bytes == 4 * floats * 4);
  CHECK(dt_memory_stats(P, sgdm, NULL, &mi) == DTRAIN_OK && mi.optim_bytes == floats * 4);
  CHECK(dt_memory_stats(P, sgd, NULL, &mi) == DTRAIN_OK && mi.optim_bytes == 0);

  /* One step: the activations are the arena's peak. */
  float xv[5 * 20];
  int32_t labels[5] = {0, 1, 2, 1, 0};
  th_seed(3);
  th_fill(xv, 5 * 20, -1, 1);
  int64_t xs[2] = {5, 20};
  for (int step = 0; step < 2; step++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &l1, dt_tensor_wrap(g, 2, xs, xv)));
    CHECK(dt_backward(g, dt_cross_entropy(g, dt_nn_linear_forward(g, &l2, h), labels)) == DTRAIN_OK);
    dt_optim_step(adam);
  }
  CHECK(dt_memory_stats(P, adam, g, &mi) == DTRAIN_OK);
  CHECK(mi.activations_bytes == dt_graph_bytes_peak(g) && mi.activations_bytes >= 5 * 16 * 4);
  CHECK(mi.arena_bytes == dt_graph_bytes_reserved(g) && mi.arena_bytes >= mi.activations_bytes);
  CHECK(mi.tape_bytes > 0);
  CHECK(mi.total_bytes ==
        mi.params_bytes + mi.grads_bytes + mi.optim_bytes + mi.arena_bytes + mi.tape_bytes);

  /* A graph alone, or nothing. */
  CHECK(dt_memory_stats(NULL, NULL, g, &mi) == DTRAIN_OK && mi.params_bytes == 0 && mi.activations_bytes > 0);
  CHECK(dt_memory_stats(NULL, NULL, NULL, &mi) == DTRAIN_OK && mi.total_bytes == 0);
  /* Errors. */
  CHECK(dt_memory_stats(P, adam, g, NULL) == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_last_error(), "out is NULL") != NULL);
  CHECK(dt_memory_stats(NULL, adam, g, &mi) == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_last_error(), "needs its params") != NULL);

  dt_graph_destroy(g);
  dt_optim_destroy(adam);
  dt_optim_destroy(sgdm);
  dt_optim_destroy(sgd);
  dt_params_destroy(P);
}


/* ---- intra-op threads ------------------------------------------------------------------ */

static int have_threads(void) { return (dt_build_features() & DTRAIN_FEATURE_THREADS) != 0; }

/* In a fresh process (FRESH_RUN), where nothing has read DTRAIN_THREADS yet. */
static void test_threads_env_and_api(void) {
  setenv("DTRAIN_THREADS", "3", 1); /* read once, at the first use */
  CHECK_MSG(dt_get_threads() == (have_threads() ? 3 : 1), "dt_get_threads %d", dt_get_threads());
  CHECK_ERR(dt_set_threads(-1), DTRAIN_ERR_INVALID_ARG, "need >= 0");
  CHECK(dt_set_threads(0) == DTRAIN_OK); /* one per CPU */
  CHECK(dt_get_threads() >= 1);
  if (have_threads()) {
    CHECK(dt_set_threads(2) == DTRAIN_OK);
    CHECK(dt_get_threads() == 2);
    CHECK(dt__par_threads() == 2);
    int was = dt__par_set_replica(1); /* as the strategies mark their replica threads */
    CHECK(dt__par_threads() == 1);
    CHECK(dt_get_threads() == 2);
    dt__par_set_replica(was);
    CHECK(dt__par_threads() == 2);
  } else {
    CHECK_ERR(dt_set_threads(2), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_THREADS");
    CHECK(dt_get_threads() == 1);
  }
  CHECK(dt_set_threads(1) == DTRAIN_OK);
  CHECK(dt_get_threads() == 1);
}

/* dt__par_run: every part runs exactly once, for any number of parts and threads. */
typedef struct par_count { int hits[37]; } par_count;
static void par_count_part(void *arg, int part, int nparts) {
  par_count *pc = (par_count *)arg;
  if (nparts == 37) pc->hits[part]++;
}

static void test_par_run_parts(void) {
  for (int t = 1; t <= 4; t++) {
    dt_set_threads(t);
    par_count pc;
    memset(&pc, 0, sizeof pc);
    dt__par_run(37, par_count_part, &pc);
    int ok = 1;
    for (int i = 0; i < 37; i++) ok &= pc.hits[i] == 1;
    CHECK_MSG(ok, "threads %d: a part ran %s", t, "not exactly once");
  }
  dt_set_threads(1);
}

/* One product at 1..4 threads; 0 when every result equals the 1-thread one bit for bit. */
static int gemm_threads_case(const gemm_case *t) {
  int64_t ar = t->ta ? t->k : t->m, ac = t->ta ? t->m : t->k;
  int64_t br = t->tb ? t->n : t->k, bc = t->tb ? t->k : t->n;
  int64_t lda = ac + t->pad, ldb = bc + t->pad, ldc = t->n + t->pad;
  size_t csz = (size_t)(t->m * ldc);
  float *a = (float *)malloc((size_t)(ar * lda) * sizeof(float));
  float *b = (float *)malloc((size_t)(br * ldb) * sizeof(float));
  float *c0 = (float *)malloc(csz * sizeof(float)), *ref = (float *)malloc(csz * sizeof(float));
  float *c = (float *)malloc(csz * sizeof(float));
  th_fill(a, ar * lda, -1, 1);
  th_fill(b, br * ldb, -1, 1);
  th_fill(c0, (int64_t)csz, -1, 1);
  int bad = 0;
  for (int th = 1; th <= 4; th += th_emulated() ? 2 : 1) { /* under an emulator 1 and 3 */
    dt_result r = dt_set_threads(th);
    if (r != DTRAIN_OK) {
      bad += have_threads() || r != DTRAIN_ERR_UNSUPPORTED;
      continue;
    }
    float *dst = th == 1 ? ref : c;
    memcpy(dst, c0, csz * sizeof(float));
    dt_sgemm(t->ta, t->tb, t->m, t->n, t->k, t->alpha, a, lda, b, ldb, t->beta, dst, ldc);
    if (th > 1 && memcmp(ref, c, csz * sizeof(float)) != 0) {
      fprintf(stderr, "gemm t%d%d %lldx%lldx%lld: %d threads differ from 1 (kernel %s)\n", t->ta, t->tb,
              (long long)t->m, (long long)t->n, (long long)t->k, th, dt_sgemm_kernel());
      bad++;
    }
  }
  dt_set_threads(1);
  free(a);
  free(b);
  free(c0);
  free(ref);
  free(c);
  return bad;
}

/* Splits by rows and by columns, all transposes, odd sizes, padded leading
 * dims, alpha/beta, the few-row blocking, and a product too small to split. */
static void test_gemm_threads_bitwise(void) {
  static const gemm_case cases[] = {
      {0, 0, 97, 203, 77, 0, 1.0f, 0.0f},    {1, 0, 784, 256, 64, 0, 1.0f, 1.0f}, {0, 1, 64, 784, 256, 1, 1.0f, 0.0f},
      {1, 1, 131, 67, 150, 2, -0.5f, 0.5f},  {0, 0, 5, 1000, 300, 0, 1.0f, 0.0f}, {0, 0, 2000, 7, 100, 1, 2.0f, 1.0f},
      {0, 1, 64, 256, 784, 0, 1.0f, 1.0f},   {1, 0, 257, 193, 31, 0, 1.0f, 0.5f}, {0, 0, 13, 13, 13, 0, 1.0f, 0.0f},
      {1, 1, 100, 401, 40, 3, 1.0f, 0.0f},   {0, 0, 50, 50, 600, 0, 1.0f, 1.0f},  {0, 0, 30, 333, 200, 0, 0.7f, 1.0f},
      {1, 1, 20, 517, 150, 1, -0.3f, 0.6f},  {0, 1, 301, 40, 190, 2, 1.0f, 1.0f}, {1, 0, 333, 33, 111, 0, 1.5f, 0.5f},
      /* few columns of A @ B^T: the unpacked dot-product kernel, split by rows */
      {0, 1, 2001, 25, 100, 1, 0.7f, 1.0f},  {0, 1, 334, 7, 501, 0, 1.0f, 0.0f},  {0, 1, 1000, 31, 37, 2, -1.5f, 0.5f},
      /* ... and with few rows and a long k (a small batch's forward) */
      {0, 1, 32, 300, 257, 1, 1.0f, 0.0f},   {0, 1, 61, 129, 515, 0, 0.5f, 1.0f},
      /* ... 16 or 32 rows with beta 0: flipped, (B @ A^T)^T, split by B's rows (two blocks at 16 x 600) */
      {0, 1, 16, 600, 784, 2, 1.0f, 0.0f},
      /* more row tiles than column tiles, but A @ B^T with 4 column tiles a thread: split by columns */
      {0, 1, 301, 450, 90, 1, 1.0f, 0.5f}};
  th_seed(4242);
  int failed = 0;
  int isa[4], np = gemm_isas(isa);
  for (int p = 0; p < np; p++) {
    dt_sgemm_use_isa(isa_names[isa[p]]);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) failed += gemm_threads_case(&cases[i]) != 0;
  }
  dt_sgemm_use_isa("best");
  CHECK_MSG(failed == 0, "%d gemm cases differ between thread counts", failed);
}

/* dt__vec_add (the sums of gradients): bitwise the plain loop, for every
 * length around the vector widths, with dst one of the inputs or apart,
 * with NaN, Inf and -0 passing through as the scalar sum makes them. */
static void test_vec_add(void) {
  th_seed(14);
  enum { N = 1100 };
  static float a[N], b[N], d[N + 1], want[N];
  th_fill(a, N, -3, 3);
  th_fill(b, N, -3, 3);
  a[5] = NAN;
  b[17] = INFINITY;
  a[40] = -0.0f;
  b[40] = -0.0f;
  a[63] = FLT_MAX;
  b[63] = FLT_MAX;
  int bad = 0;
  for (size_t n = 0; n <= N; n = n < 80 ? n + 1 : n + 255) {
    for (int alias = 0; alias < 3; alias++) {
      for (size_t i = 0; i < n; i++) want[i] = a[i] + b[i];
      float *dst = d;
      if (alias == 1) dst = (float *)memcpy(d, a, n * sizeof(float)); /* dst is a */
      if (alias == 2) dst = (float *)memcpy(d, b, n * sizeof(float)); /* dst is b */
      const float *x = alias == 1 ? d : a, *y = alias == 2 ? d : b;
      if (n < N) d[n] = 7.0f; /* past the end: untouched */
      dt__vec_add(dst, x, y, n);
      bad += memcmp(dst, want, n * sizeof(float)) != 0;
      if (n < N) bad += d[n] != 7.0f;
    }
  }
  CHECK_MSG(bad == 0, "%d dt__vec_add cases differ from the plain loop", bad);
}

/* dt__vec_add_finite (a mirrored step's reduce-scatter and its check in one
 * pass): the same bits as the plain loop, and "finite" exactly when no sum
 * is infinite or NaN, for one bad sum at every place of lengths around the
 * vector widths (the 32-wide body, the 8-wide and 4-wide loops, the scalar
 * tail), for sums that overflow from finite inputs, for Inf - Inf, and for
 * the largest finite values and denormals (finite). */
static void test_vec_add_finite(void) {
  th_seed(15);
  enum { N = 300 };
  static float a[N], b[N], d[N], want[N];
  int bad = 0, cases = 0;
  for (size_t n = 0; n <= N; n = n < 80 ? n + 1 : n + 73) {
    th_fill(a, N, -3, 3);
    th_fill(b, N, -3, 3);
    if (n > 2) {
      a[0] = FLT_MAX; /* finite: the largest exponent short of Inf/NaN */
      b[0] = 0.0f;
      a[1] = 1e-40f; /* a denormal */
      b[1] = -0.0f;
    }
    for (size_t i = 0; i < n; i++) want[i] = a[i] + b[i];
    bad += dt__vec_add_finite(d, a, b, n) != 1;
    bad += memcmp(d, want, n * sizeof(float)) != 0;
    for (size_t at = 0; at < n; at++) {
      for (int kind = 0; kind < 3; kind++) {
        float sa = a[at], sb = b[at];
        if (kind == 0) a[at] = NAN;
        if (kind == 1) a[at] = FLT_MAX, b[at] = FLT_MAX;      /* overflows to Inf */
        if (kind == 2) a[at] = INFINITY, b[at] = -INFINITY; /* NaN */
        float w = a[at] + b[at];
        int got = dt__vec_add_finite(d, a, b, n);
        bad += got != 0;
        bad += memcmp(&d[at], &w, sizeof w) != 0 && !(isnan(d[at]) && isnan(w));
        a[at] = sa;
        b[at] = sb;
        cases++;
      }
    }
  }
  CHECK_MSG(bad == 0, "%d of %d dt__vec_add_finite cases wrong", bad, cases);
}

/* The parameter store's sweeps (dt__shared_load / dt__shared_add; vector
 * loops on x86-64 and AArch64) against the element-by-element rule: lengths
 * 0..80 and longer, misaligned starts, a zero update leaves the element's bits
 * as they are (-0, NaN), a NaN update is written, scales 1 and 1/3, nothing
 * past the end is touched. */
static void test_shared_sweeps(void) {
  th_seed(15);
  enum { N = 1100 };
  static float x0[N + 2], d[N + 2], got[N + 2], want[N + 2];
  th_fill(x0, N + 2, -3, 3);
  th_fill(d, N + 2, -1, 1);
  for (size_t i = 0; i < N + 2; i += 3) d[i] = 0.0f; /* zeros: not written */
  x0[6] = -0.0f;
  x0[9] = NAN;
  d[10] = NAN;
  x0[11] = INFINITY;
  d[12] = -0.0f;
  x0[12] = -0.0f;
  int bad = 0;
  for (size_t off = 0; off < 2; off++) {
    for (size_t n = 0; n <= N; n = n < 80 ? n + 1 : n + 255) {
      for (int si = 0; si < 2; si++) {
        float scale = si ? 1.0f / 3.0f : 1.0f;
        memcpy(got, x0, sizeof got);
        memcpy(want, x0, sizeof want);
        for (size_t i = 0; i < n; i++)
          if (d[off + i] != 0.0f) want[off + i] = want[off + i] + d[off + i] * scale;
        dt__shared_add((dt__afloat *)(got + off), d + off, scale, n);
        bad += memcmp(got, want, sizeof got) != 0; /* bits: -0 and NaN as they were, the end untouched */
      }
      float out[N + 1];
      out[n] = 7.0f;
      dt__shared_load(out, (dt__afloat *)(x0 + off), n);
      bad += memcmp(out, x0 + off, n * sizeof(float)) != 0 || out[n] != 7.0f;
    }
  }
  CHECK_MSG(bad == 0, "%d dt__shared_add/_load cases differ from the element-by-element loop", bad);
}

/* Two user threads multiply at once while a third changes the setting: one
 * of them gets the pool, the other runs alone, and both get the 1-thread
 * result (a TSan run checks the hand-over). */
typedef struct gemm_race_arg {
  const float *a, *b, *want;
  int ok;
} gemm_race_arg;

static void *gemm_race_thread(void *p) {
  gemm_race_arg *t = (gemm_race_arg *)p;
  static const size_t sz = 64 * 256;
  float *c = (float *)malloc(sz * sizeof(float));
  t->ok = 1;
  for (int it = 0; it < 12; it++) {
    dt_sgemm(0, 0, 64, 256, 100, 1.0f, t->a, 100, t->b, 256, 0.0f, c, 256);
    t->ok &= memcmp(c, t->want, sz * sizeof(float)) == 0;
  }
  free(c);
  return NULL;
}

static void *threads_toggle(void *p) {
  (void)p;
  for (int it = 0; it < 6; it++) dt_set_threads(2 + it % 2);
  return NULL;
}

static void test_gemm_threads_concurrent(void) {
  static float a[64 * 100], b[100 * 256], want[64 * 256];
  th_seed(99);
  th_fill(a, 64 * 100, -1, 1);
  th_fill(b, 100 * 256, -1, 1);
  dt_set_threads(1);
  dt_sgemm(0, 0, 64, 256, 100, 1.0f, a, 100, b, 256, 0.0f, want, 256);
  if (!have_threads()) TH_SKIP("built without threads");
  dt_set_threads(2);
  pthread_t th[3];
  gemm_race_arg args[2];
  for (int i = 0; i < 2; i++) {
    args[i].a = a;
    args[i].b = b;
    args[i].want = want;
    args[i].ok = 0;
    CHECK(pthread_create(&th[i], NULL, gemm_race_thread, &args[i]) == 0);
  }
  CHECK(pthread_create(&th[2], NULL, threads_toggle, NULL) == 0);
  for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) CHECK_MSG(args[i].ok, "thread %d: result differs from one thread", i);
  dt_set_threads(1);
}

/* Every optimizer over parameters big enough to be split: the same bits at
 * 1..4 threads, with a small tensor (one thread) and a buffer (never
 * updated) between large ones, decay on some only. */
static void test_optim_threads_bitwise(void) {
  static const int64_t sizes[] = {70001, 5, 30000, 131072, 40000};
  static const dt_optim_kind kinds[] = {DTRAIN_OPTIM_ADAMW, DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_SGD,
                                        DTRAIN_OPTIM_RMSPROP};
  for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
    float *want[3] = {NULL, NULL, NULL};
    int same = 1, runs = 0;
    for (int th = 1; th <= 4; th++) {
      if (dt_set_threads(th) != DTRAIN_OK) continue;
      dt_params *P = dt_params_create(11);
      for (int i = 0; i < 5; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        if (i == 2) {
          dt_params_add_buffer(P, name, 1, &sizes[i], dt_init_uniform(-1, 1));
          continue;
        }
        dt_params_add(P, name, 1, &sizes[i], dt_init_uniform(-1, 1));
        dt_params_set_decay(P, i, i != 4);
      }
      dt_optim_options od;
      memset(&od, 0, sizeof od);
      od.kind = kinds[ki];
      od.lr = 0.01f;
      od.weight_decay = 0.05f;
      od.momentum = kinds[ki] == DTRAIN_OPTIM_SGD || kinds[ki] == DTRAIN_OPTIM_RMSPROP ? 0.9f : 0.0f;
      dt_optim *o = dt_optim_create(P, &od);
      CHECK(o != NULL);
      if (!o) {
        dt_params_destroy(P);
        break;
      }
      size_t n = dt_params_size(P);
      th_seed(5);
      for (int step = 0; step < 3; step++) {
        float *g = dt_params_grad(P);
        for (size_t i = 0; i < n; i++) g[i] = th_uniform(-2, 2);
        CHECK(dt_optim_step(o) == DTRAIN_OK);
      }
      const float *outs[3] = {dt_params_data(P), dt_optim_state(o, 0), dt_optim_state(o, 1)};
      for (int k = 0; k < 3; k++) {
        if (!outs[k]) continue; /* fewer state slots */
        if (th == 1) {
          want[k] = (float *)malloc(n * sizeof(float));
          memcpy(want[k], outs[k], n * sizeof(float));
        } else if (want[k]) {
          same &= memcmp(want[k], outs[k], n * sizeof(float)) == 0;
        }
      }
      runs++;
      dt_optim_destroy(o);
      dt_params_destroy(P);
    }
    dt_set_threads(1);
    CHECK_MSG(runs == (have_threads() ? 4 : 1), "optimizer %d: %d runs", (int)kinds[ki], runs);
    CHECK_MSG(same, "optimizer %d differs between thread counts", (int)kinds[ki]);
    for (int k = 0; k < 3; k++) free(want[k]);
  }
}

/* ---- results at 1..3 intra-op threads ------------------------------------------------
 * same_at_threads runs fn at 1, 2 and 3 threads (1 only without threads;
 * under an emulator 1 and 3: the uneven split, th_emulated);
 * fn builds its graph in g and returns a malloc'd copy of what it computed
 * (values and gradients), *bytes long, or NULL when the graph failed. Every
 * run must succeed and give the first run's bytes. */
typedef float *(*threads_case_fn)(dt_graph *g, const void *ctx, size_t *bytes);

static void same_at_threads(const char *what, threads_case_fn fn, const void *ctx) {
  float *want = NULL;
  size_t want_bytes = 0;
  int same = 1, runs = 0, emu = th_emulated();
  for (int th = 1; th <= 3; th += emu ? 2 : 1) {
    if (dt_set_threads(th) != DTRAIN_OK) continue;
    dt_graph *g = dt_graph_create(NULL, NULL);
    size_t bytes = 0;
    float *got = g ? fn(g, ctx, &bytes) : NULL;
    CHECK_MSG(got != NULL, "%s at %d threads: %s", what, th, dt_last_error());
    if (got) {
      runs++;
      if (!want) {
        want = got;
        want_bytes = bytes;
      } else {
        same &= bytes == want_bytes && memcmp(want, got, bytes) == 0;
        free(got);
      }
    }
    dt_graph_destroy(g);
  }
  dt_set_threads(1);
  CHECK_MSG(runs == (have_threads() ? (emu ? 2 : 3) : 1), "%s: %d runs", what, runs);
  CHECK_MSG(same, "%s differs between thread counts", what);
  free(want);
}

/* y, then the gradients of the inputs that have one (NULL: skipped), into one buffer. */
static float *collect(size_t *bytes, dt_tensor *y, dt_tensor *const *ins, int nins) {
  int64_t n = y->size;
  for (int i = 0; i < nins; i++) {
    if (!ins[i]->grad) return NULL;
    n += ins[i]->size;
  }
  float *buf = (float *)malloc((size_t)n * sizeof(float)), *p = buf;
  if (!buf) return NULL;
  memcpy(p, y->data, (size_t)y->size * sizeof(float));
  p += y->size;
  for (int i = 0; i < nins; i++) {
    memcpy(p, ins[i]->grad, (size_t)ins[i]->size * sizeof(float));
    p += ins[i]->size;
  }
  *bytes = (size_t)n * sizeof(float);
  return buf;
}

/* The inputs of the convolution cases: x, w, b and their shapes. */
typedef struct conv_case {
  int64_t xs[4], ws[4], bs[1];
  float *x, *w, *b;
} conv_case;

static void conv_case_fill(conv_case *c, uint64_t seed, float wscale) {
  int64_t nx = c->xs[0] * c->xs[1] * c->xs[2] * c->xs[3], nw = c->ws[0] * c->ws[1] * c->ws[2] * c->ws[3];
  c->x = (float *)malloc((size_t)nx * sizeof(float));
  c->w = (float *)malloc((size_t)nw * sizeof(float));
  c->b = (float *)malloc((size_t)c->bs[0] * sizeof(float));
  th_seed(seed);
  th_fill(c->x, nx, -1, 1);
  th_fill(c->w, nw, -wscale, wscale);
  th_fill(c->b, c->bs[0], -0.5f, 0.5f);
}

static void conv_case_free(conv_case *c) {
  free(c->x);
  free(c->w);
  free(c->b);
}

/* The Winograd convolution (5x5, stride 1, >= 8 channels), forward and
 * backward, split over 2 and 3 threads by planes and by transformed tile
 * positions: the same bits as one thread. 19 images in groups of 8, 8, 3;
 * odd output width (a partial last tile). */
static float *winograd_case(dt_graph *g, const void *ctx, size_t *bytes) {
  const conv_case *c = (const conv_case *)ctx;
  dt_tensor *in[3] = {dt_tensor_from(g, 4, c->xs, c->x), dt_tensor_from(g, 4, c->ws, c->w),
                      dt_tensor_from(g, 1, c->bs, c->b)};
  for (int i = 0; i < 3; i++) dt_tensor_set_requires_grad(in[i], 1);
  dt_tensor *y = dt_conv2d(g, in[0], in[1], in[2], 1, 2);
  if (!y || dt_backward_grad(g, y, y->data) != DTRAIN_OK) return NULL; /* loss = sum(y^2)/2 */
  return collect(bytes, y, in, 3);
}

static void test_conv_winograd_threads_bitwise(void) {
  conv_case c = {{19, 9, 10, 9}, {12, 9, 5, 5}, {12}, NULL, NULL, NULL};
  conv_case_fill(&c, 77, 1.0f);
  same_at_threads("Winograd convolution", winograd_case, &c);
  conv_case_free(&c);
}

/* Max pooling, forward and backward, split over 2 and 3 threads by planes:
 * the same bits as one thread, for 2x2/2 (the SIMD windows, an odd width
 * with a scalar tail), 3x3/2 (overlapping windows: the backward adds to one
 * input from two windows) and ties and NaNs (the first maximum, the last
 * NaN). 37 planes of 40x41 (above DT__POOL_PAR_MIN: split), so the parts
 * get uneven plane counts. */
typedef struct pool_case {
  const float *x;
  int k, s;
} pool_case;

static float *pool_case_run(dt_graph *g, const void *ctx, size_t *bytes) {
  const pool_case *c = (const pool_case *)ctx;
  int64_t xs[4] = {37, 1, 40, 41};
  dt_tensor *tx = dt_tensor_from(g, 4, xs, c->x);
  dt_tensor_set_requires_grad(tx, 1);
  dt_tensor *y = dt_max_pool2d(g, tx, c->k, c->s);
  if (!y) return NULL;
  float *gy = (float *)malloc((size_t)y->size * sizeof(float));
  if (!gy) return NULL;
  for (int64_t i = 0; i < y->size; i++) gy[i] = (float)(i % 7) - 3.0f;
  dt_result r = dt_backward_grad(g, y, gy);
  free(gy);
  return r == DTRAIN_OK ? collect(bytes, y, &tx, 1) : NULL;
}

static void test_pool_threads_bitwise(void) {
  int64_t nx = 37 * 40 * 41;
  float *x = (float *)malloc((size_t)nx * sizeof(float));
  th_seed(91);
  for (int64_t i = 0; i < nx; i++) x[i] = (float)(int)th_uniform(-4, 4); /* many ties */
  x[20] = NAN;
  x[nx - 3] = NAN;
  x[nx - 4] = NAN;
  pool_case c2 = {x, 2, 2}, c3 = {x, 3, 2};
  same_at_threads("max pool 2x2 stride 2", pool_case_run, &c2);
  same_at_threads("max pool 3x3 stride 2", pool_case_run, &c3);
  free(x);
}

/* A convolution block large enough that every piece is split: the Winograd
 * kernel transforms (512 kernels) and their adjoint, the bias gradient (a
 * 524,288-element output gradient, cut by channels), dt_relu_inplace forward
 * and backward, max pooling; and a one-channel 5x5 convolution on 28x28
 * images (im2col; each image's product too small to split, so the images
 * go to the threads: dt_conv2d's forward by images). Forward values and
 * every gradient are the same bits at 1..3 threads. */
static float *conv_block_case(dt_graph *g, const void *ctx, size_t *bytes) {
  const conv_case *c = (const conv_case *)ctx;
  dt_tensor *in[3] = {dt_tensor_from(g, 4, c->xs, c->x), dt_tensor_from(g, 4, c->ws, c->w),
                      dt_tensor_from(g, 1, c->bs, c->b)};
  for (int i = 0; i < 3; i++) dt_tensor_set_requires_grad(in[i], 1);
  dt_tensor *y = dt_max_pool2d(g, dt_relu_inplace(g, dt_conv2d(g, in[0], in[1], in[2], 1, 2)), 2, 2);
  if (!y || dt_backward_grad(g, y, y->data) != DTRAIN_OK) return NULL; /* loss = sum(y^2)/2 */
  /* the one-channel layer: images of 28x28 from x's data, 8 filters (w's first) */
  int64_t x1s[4] = {9, 1, 28, 28}, w1s[4] = {8, 1, 5, 5}, b1s[1] = {8};
  dt_tensor *y1 = dt_conv2d(g, dt_tensor_from(g, 4, x1s, c->x), dt_tensor_from(g, 4, w1s, c->w),
                            dt_tensor_from(g, 1, b1s, c->b), 1, 2);
  size_t nb = 0;
  float *block = collect(&nb, y, in, 3);
  if (!y1 || !block) {
    free(block);
    return NULL;
  }
  float *all = (float *)realloc(block, nb + (size_t)y1->size * sizeof(float));
  if (!all) {
    free(block);
    return NULL;
  }
  memcpy((char *)all + nb, y1->data, (size_t)y1->size * sizeof(float));
  *bytes = nb + (size_t)y1->size * sizeof(float);
  return all;
}

static void test_conv_block_threads_bitwise(void) {
  /* The block is sized so that every piece splits (a smaller one would not),
   * and under qemu it costs 26 s of CPU at 1 and 3 threads on each of CI's
   * three emulated architectures: there it is skipped. The split is the
   * same C code on every architecture; the host, ASan and TSan runs check
   * it, and the emulated runs still run the smaller Winograd and pooling
   * thread cases above. */
  if (th_emulated()) TH_SKIP("under an emulator: the host, ASan and TSan builds run it (the same C everywhere)");
  conv_case c = {{16, 16, 32, 32}, {32, 16, 5, 5}, {32}, NULL, NULL, NULL};
  conv_case_fill(&c, 78, 0.2f);
  same_at_threads("conv + relu_inplace + max pool, and a one-channel conv", conv_block_case, &c);
  conv_case_free(&c);
}

/* A child of fork() after the pool started has none of its threads: its
 * first parallel GEMM must start a pool of its own, not wait forever. */
#if defined(__SANITIZE_THREAD__)
#  define TSAN_BUILD 1
#elif defined(__has_feature)
#  if __has_feature(thread_sanitizer)
#    define TSAN_BUILD 1
#  endif
#endif
static void test_threads_after_fork(void) {
  static float a[64 * 300], b[300 * 256], want[64 * 256], c[64 * 256];
  if (!have_threads()) TH_SKIP("built without threads");
#ifdef TSAN_BUILD
  TH_SKIP("ThreadSanitizer cannot start threads in a child of a threaded fork");
#endif
  {
    /* qemu-user itself asserts (cpu_exec: cpu == current_cpu) when the child
     * of a threaded fork starts threads: make test-cross runs us with
     * RUNNER="qemu-<arch> ..." in the environment. */
    const char *runner = getenv("RUNNER");
    if (runner && strstr(runner, "qemu")) {
      TH_SKIP("qemu-user cannot start threads in a child of a threaded fork");
    }
  }
  th_seed(7);
  th_fill(a, 64 * 300, -1, 1);
  th_fill(b, 300 * 256, -1, 1);
  dt_set_threads(1);
  dt_sgemm(0, 0, 64, 256, 300, 1.0f, a, 300, b, 256, 0.0f, want, 256);
  dt_set_threads(2);
  dt_sgemm(0, 0, 64, 256, 300, 1.0f, a, 300, b, 256, 0.0f, c, 256); /* the pool runs now */
  CHECK(memcmp(c, want, sizeof c) == 0);
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    alarm(20); /* a hang is a failure, not a stuck test run */
    memset(c, 0, sizeof c);
    dt_sgemm(0, 0, 64, 256, 300, 1.0f, a, 300, b, 256, 0.0f, c, 256);
    _exit(memcmp(c, want, sizeof c) == 0 ? 0 : 1);
  }
  int status = 0;
  if (pid > 0) CHECK(waitpid(pid, &status, 0) == pid);
  CHECK_MSG(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
  dt_set_threads(1);
}

/* ---- tests that need a process of their own -------------------------------------------
 * DTRAIN_THREADS and DTRAIN_GEMM are read once, at their first use in a
 * process, so their tests need a process where nothing used them yet,
 * wherever they stand in main(). main() forks a "fresh" process first thing,
 * before it calls the library; for each such test the fresh process forks
 * once more, the grandchild runs the test and says 'P' or 'F' on a pipe (its
 * FAIL lines go to stderr as usual), and the fresh process waits for it
 * (a crash is an 'F'). fork only: no exec, so it works under qemu-user too. */
typedef void (*test_fn)(void);
static const struct fresh_test {
  const char *name;
  test_fn fn;
} fresh_tests[] = {{"test_threads_env_and_api", test_threads_env_and_api},
                   {"test_gemm_env_override", test_gemm_env_override},
                   {"test_gemm_isa_env", test_gemm_isa_env},
                   {"test_gemm_isa_env_bad", test_gemm_isa_env_bad}};
static int fresh_req = -1, fresh_resp = -1;
static pid_t fresh_pid = -1;

static void fresh_serve(int req, int resp) {
  int i;
  while (read(req, &i, sizeof i) == (ssize_t)sizeof i) {
    char verdict = 'F';
    int p[2];
    if (i < 0 || i >= (int)(sizeof fresh_tests / sizeof fresh_tests[0]) || pipe(p) != 0) {
      if (write(resp, &verdict, 1) != 1) break;
      continue;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      TH_RUN(fresh_tests[i].fn);
      verdict = th_failed ? 'F' : 'P';
      fflush(NULL);
      _exit(write(p[1], &verdict, 1) == 1 ? 0 : 1);
    }
    close(p[1]);
    char got = 'F';
    if (pid < 0 || read(p[0], &got, 1) != 1) got = 'F';
    close(p[0]);
    int st = 0;
    if (pid > 0 && (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)) got = 'F';
    if (write(resp, &got, 1) != 1) break;
  }
  _exit(0);
}

static void fresh_start(void) {
  int req[2], resp[2];
  if (pipe(req) != 0 || pipe(resp) != 0) return;
  fflush(NULL);
  fresh_pid = fork();
  if (fresh_pid == 0) {
    close(req[1]);
    close(resp[0]);
    fresh_serve(req[0], resp[1]);
  }
  close(req[0]);
  close(resp[1]);
  if (fresh_pid < 0) {
    close(req[1]);
    close(resp[0]);
    return;
  }
  fresh_req = req[1];
  fresh_resp = resp[0];
}

static void fresh_run(const char *name) {
  int i = 0, n = (int)(sizeof fresh_tests / sizeof fresh_tests[0]);
  while (i < n && strcmp(fresh_tests[i].name, name) != 0) i++;
  char got = 'F';
  fflush(NULL); /* our output so far comes before the test's */
  if (fresh_req >= 0 && write(fresh_req, &i, sizeof i) == (ssize_t)sizeof i && read(fresh_resp, &got, 1) != 1)
    got = 'F';
  if (got == 'P') th_passed++;
  else {
    th_failed++;
    fprintf(stderr, "FAIL %s (in a fresh process)%s\n", name, fresh_req < 0 ? ": could not fork one" : "");
  }
}

static void fresh_stop(void) {
  if (fresh_req < 0) return;
  close(fresh_req);
  close(fresh_resp);
  waitpid(fresh_pid, NULL, 0);
}

/* Every test starts from the same state: one intra-op thread, the best GEMM
 * kernel (tests that change either put it back, but none relies on that). */
#define RUN(fn)                                                                       \
  do {                                                                                \
    dt_set_threads(1);                                                                \
    dt_sgemm_use_isa("best");                                                         \
    TH_RUN(fn);                                                                       \
  } while (0)
#define FRESH_RUN(fn) fresh_run(#fn)

int main(void) {
  fresh_start(); /* before anything touches the library */
  printf("%s\n", dt_build_info());
  FRESH_RUN(test_threads_env_and_api);
  FRESH_RUN(test_gemm_env_override);
  FRESH_RUN(test_gemm_isa_env);
  FRESH_RUN(test_gemm_isa_env_bad);
  RUN(test_gemm_use_portable_switch);
  RUN(test_gemm_use_isa);
  RUN(test_gemm_paths_agree);
  RUN(test_gemm_beta0_ignores_c);
  RUN(test_gemm_bf16);
  RUN(test_gemm_first_call_threads);
  RUN(test_adam_simd_matches_scalar);
  RUN(test_relu_exact);
  RUN(test_max_pool_fast_path);
  RUN(test_conv_span_paths);
  RUN(test_memory_stats);
  RUN(test_par_run_parts);
  RUN(test_gemm_threads_bitwise);
  RUN(test_vec_add);
  RUN(test_vec_add_finite);
  RUN(test_shared_sweeps);
  RUN(test_gemm_threads_concurrent);
  RUN(test_optim_threads_bitwise);
  RUN(test_conv_winograd_threads_bitwise);
  RUN(test_pool_threads_bitwise);
  RUN(test_conv_block_threads_bitwise);
  RUN(test_threads_after_fork);
  fresh_stop();
  return th_summary("speed");
}
