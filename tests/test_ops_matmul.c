/* dt_sgemm against a double-precision reference; matmul, bmm and linear:
 * values, gradients against finite differences, error paths. Also prints a
 * rough single-thread GFLOP/s of dt_sgemm (informational, not checked). */
#include "harness.h"

#include <float.h>
#include <time.h>

/* ---- sgemm ------------------------------------------------------------------ */

/* op(X)[i][j] of a row-major X with leading dim ld. */
static double ref_at(const float *x, int64_t ld, int trans, int64_t i, int64_t j) {
  return trans ? (double)x[j * ld + i] : (double)x[i * ld + j];
}

/* One sgemm against the double reference. A and B get NaN in their padding
 * (columns past the logical width) so that any stray read shows; C's padding
 * holds a sentinel that must survive. Returns the number of bad elements. */
static int check_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, float beta, int64_t pad,
                       int nan_c) {
  int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
  int64_t lda = ac + pad, ldb = bc + pad, ldc = n + pad;
  size_t na = (size_t)(ar * lda) + 1, nb = (size_t)(br * ldb) + 1, nc = (size_t)(m * ldc) + 1;
  float *a = (float *)malloc(na * sizeof(float)), *b = (float *)malloc(nb * sizeof(float));
  float *c = (float *)malloc(nc * sizeof(float)), *c0 = (float *)malloc(nc * sizeof(float));
  for (int64_t i = 0; i < ar; i++)
    for (int64_t j = 0; j < lda; j++) a[i * lda + j] = j < ac ? th_uniform(-1, 1) : NAN;
  for (int64_t i = 0; i < br; i++)
    for (int64_t j = 0; j < ldb; j++) b[i * ldb + j] = j < bc ? th_uniform(-1, 1) : NAN;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < ldc; j++) c[i * ldc + j] = j < n ? (nan_c ? NAN : th_uniform(-1, 1)) : 12345.0f;
  memcpy(c0, c, nc * sizeof(float));
  dt_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  int bad = 0;
  for (int64_t i = 0; i < m; i++) {
    for (int64_t j = 0; j < ldc; j++) {
      double got = c[i * ldc + j];
      if (j >= n) { /* padding of C: untouched */
        if (got != 12345.0) bad++;
        continue;
      }
      double s = 0, sabs = 0;
      for (int64_t p = 0; p < k; p++) {
        double t = ref_at(a, lda, ta, i, p) * ref_at(b, ldb, tb, p, j);
        s += t;
        sabs += fabs(t);
      }
      double cin = beta == 0.0f ? 0.0 : (double)c0[i * ldc + j];
      double want = (double)alpha * s + (double)beta * cin;
      double tol = 2.0 * (double)(k + 3) * FLT_EPSILON * (fabs((double)alpha) * sabs + fabs((double)beta * cin)) + 1e-30;
      if (!(fabs(got - want) <= tol)) {
        if (bad < 3)
          fprintf(stderr, "sgemm t%d%d m=%lld n=%lld k=%lld alpha=%g beta=%g pad=%lld: C[%lld][%lld] = %.9g, want %.9g\n",
                  ta, tb, (long long)m, (long long)n, (long long)k, (double)alpha, (double)beta, (long long)pad,
                  (long long)i, (long long)j, got, want);
        bad++;
      }
    }
  }
  free(a);
  free(b);
  free(c);
  free(c0);
  return bad;
}

static const int64_t gemm_dims[] = {1, 7, 17, 33, 64, 100, 257};
#define N_GEMM_DIMS 7

static void test_sgemm_shapes(void) {
  th_seed(11);
  static const float alphas[] = {1.0f, -0.5f, 2.5f};
  static const float betas[] = {0.0f, 1.0f, 0.75f};
  int cases = 0, failed = 0, emu = th_emulated();
  /* Every (m, n) pair of the list with a k cycling through it, all four
   * transpose combinations, varying alpha, beta and padding (under an
   * emulator, th_emulated, each pair in one of the four, in turn). */
  for (int t = 0; t < 4; t++) {
    for (int im = 0; im < N_GEMM_DIMS; im++) {
      for (int in = 0; in < N_GEMM_DIMS; in++) {
        if (emu && (im + in) % 4 != t) continue;
        int64_t m = gemm_dims[im], n = gemm_dims[in], k = gemm_dims[(im + 2 * in + t) % N_GEMM_DIMS];
        if (m * n * k > 2000000) k = 33; /* keep the double reference quick */
        int v = im + in + t;
        float alpha = alphas[v % 3], beta = betas[(v / 3) % 3];
        int64_t pad = (v % 4 == 0) ? 0 : v % 5 + 1;
        int bad = check_sgemm(t >> 1, t & 1, m, n, k, alpha, beta, pad, 0);
        cases++;
        if (bad) failed++;
      }
    }
  }
  /* Shapes that cross the block sizes in every dimension (KC 256, MC 96, NC
   * 768; the stack's 192 and the loop orders: test_gemm_panels). */
  /* ... and the small-batch A @ B^T products that skip packing on AVX2
   * (m <= 32 with k >= 256, m <= 64 with k >= 512; odd k for the tail),
   * with their neighbours just outside. */
  static const int64_t big[][3] = {{257, 257, 257}, {100, 300, 513}, {150, 520, 40}, {73, 129, 260}, {1, 600, 300},
                                   {600, 1, 300}, {5, 5, 1000}, {32, 300, 257}, {61, 129, 515}, {33, 70, 256},
                                   {64, 40, 511}, {65, 33, 600}, {100, 900, 20}, {200, 900, 12}};
  for (int i = 0; i < 14; i++)
    for (int t = 0; t < 4; t++) {
      if (emu && t != i % 4) continue; /* under an emulator each in one transpose, in turn */
      int bad = check_sgemm(t >> 1, t & 1, big[i][0], big[i][1], big[i][2], t == 2 ? -1.0f : 1.0f,
                            t == 1 ? 0.5f : 0.0f, t, 0);
      cases++;
      if (bad) failed++;
    }
  /* Random small shapes. */
  for (int i = 0; i < 200; i++) {
    int64_t m = 1 + (int64_t)(th_rand() * 40), n = 1 + (int64_t)(th_rand() * 40), k = 1 + (int64_t)(th_rand() * 40);
    int t = (int)(th_rand() * 4);
    int bad = check_sgemm(t >> 1, t & 1, m, n, k, th_uniform(-2, 2), i % 3 ? th_uniform(-2, 2) : 0.0f,
                          (int64_t)(th_rand() * 3), 0);
    cases++;
    if (bad) failed++;
  }
  CHECK_MSG(failed == 0, "%d of %d sgemm cases wrong", failed, cases);
}

static void test_sgemm_beta0_nan(void) {
  th_seed(12);
  /* beta == 0: C holds NaN and must be overwritten, never read. */
  for (int t = 0; t < 4; t++) {
    CHECK(check_sgemm(t >> 1, t & 1, 33, 17, 100, 1.0f, 0.0f, 3, 1) == 0);
    CHECK(check_sgemm(t >> 1, t & 1, 7, 257, 7, -2.0f, 0.0f, 0, 1) == 0);
    CHECK(check_sgemm(t >> 1, t & 1, 1, 1, 1, 1.0f, 0.0f, 1, 1) == 0);
  }
  /* alpha == 0 or k == 0: C = beta * C, and with beta == 0 zeros even over NaN. */
  float a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4}, c[4];
  for (int i = 0; i < 4; i++) c[i] = NAN;
  dt_sgemm(0, 0, 2, 2, 2, 0.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 0.0f && c[1] == 0.0f && c[2] == 0.0f && c[3] == 0.0f);
  for (int i = 0; i < 4; i++) c[i] = NAN;
  dt_sgemm(0, 0, 2, 2, 0, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 0.0f && c[3] == 0.0f);
  for (int i = 0; i < 4; i++) c[i] = (float)(i + 1);
  dt_sgemm(1, 1, 2, 2, 0, 1.0f, a, 2, b, 2, 2.0f, c, 2);
  CHECK(c[0] == 2.0f && c[1] == 4.0f && c[2] == 6.0f && c[3] == 8.0f);
  /* m == 0 or n == 0: nothing is touched. */
  c[0] = NAN;
  dt_sgemm(0, 0, 0, 1, 2, 1.0f, a, 2, b, 1, 0.0f, c, 1);
  dt_sgemm(0, 0, 1, 0, 2, 1.0f, a, 2, b, 1, 0.0f, c, 1);
  CHECK(isnan(c[0]));
  /* Hand-computed: [1 2; 3 4] @ [1 2; 3 4] = [7 10; 15 22]. */
  dt_sgemm(0, 0, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 7.0f && c[1] == 10.0f && c[2] == 15.0f && c[3] == 22.0f);
  /* A^T @ B = [1 3; 2 4] @ [1 2; 3 4] = [10 14; 14 20]; A @ B^T = [5 11; 11 25]. */
  dt_sgemm(1, 0, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 10.0f && c[1] == 14.0f && c[2] == 14.0f && c[3] == 20.0f);
  dt_sgemm(0, 1, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 5.0f && c[1] == 11.0f && c[2] == 11.0f && c[3] == 25.0f);
}

/* The AVX-512 path against the AVX2 path, bit for bit: with alpha 1 and
 * beta 0 or 1 every element gets the same FMAs in the same order on both
 * (full tiles, edges, k blocks). Shapes of up to 8 B slivers, where the
 * AVX-512 kernel reads A where it lies (rows of 6, of 4, and the packed
 * short sliver; both transposes of A; padded leading dimensions), and
 * wider ones, where it packs A. Skipped without both paths. */
static void test_sgemm_paths_agree(void) {
  if (strcmp(dt_sgemm_kernel(), "cblas") == 0) {
    th_skip("a BLAS build (DTRAIN_USE_CBLAS): dt_sgemm is the library's");
    return;
  }
  if (dt_sgemm_use_isa("avx512") != DTRAIN_OK || dt_sgemm_use_isa("avx2") != DTRAIN_OK) {
    dt_sgemm_use_isa("best");
    th_skip("this CPU or build lacks the avx512 or avx2 path");
    return;
  }
  th_seed(17);
  static const int64_t shapes[][3] = {{64, 32, 196}, {64, 196, 32}, {32, 196, 64}, {6, 32, 5},  {4, 32, 300},
                                      {10, 64, 40},  {11, 33, 700}, {13, 256, 17}, {5, 250, 9}, {70, 200, 257},
                                      {1, 31, 3},    {64, 257, 64}, {9, 500, 100}, {64, 64, 64}, {32, 256, 300},
                                      {16, 96, 260}};
  int bad = 0, cases = 0;
  for (int si = 0; si < 16; si++)
    for (int t = 0; t < 4; t++)
      for (int bi = 0; bi < 2; bi++) {
        int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2], pad = (si + t) % 3;
        int ta = t >> 1, tb = t & 1;
        /* A @ B^T that dt_gemm.c gives a dot-product kernel on either path (other
         * sums) is left out, unless it runs flipped on both (16 or 32 rows, beta
         * 0: the packed product's bits on each path, so they agree). */
        int flipped = !ta && tb && bi == 0 && (m == 16 || m == 32) && n >= 64 && k >= 128;
        if (!ta && tb && k >= 16 && (n < 32 || (m <= 32 && k >= 256) || (m <= 64 && k >= 512)) && !flipped) continue;
        int64_t lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
        int64_t na = (ta ? k : m) * lda, nb = (tb ? n : k) * ldb;
        float *a = (float *)malloc((size_t)na * sizeof(float)), *b = (float *)malloc((size_t)nb * sizeof(float));
        float *c[2];
        c[0] = (float *)malloc((size_t)(m * ldc) * sizeof(float));
        c[1] = (float *)malloc((size_t)(m * ldc) * sizeof(float));
        th_fill(a, na, -1, 1);
        th_fill(b, nb, -1, 1);
        th_fill(c[0], m * ldc, -1, 1);
        memcpy(c[1], c[0], (size_t)(m * ldc) * sizeof(float));
        for (int p = 0; p < 2; p++) {
          dt_sgemm_use_isa(p ? "avx2" : "avx512");
          dt_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, (float)bi, c[p], ldc);
        }
        int diff = memcmp(c[0], c[1], (size_t)(m * ldc) * sizeof(float)) != 0;
        if (diff && bad < 3)
          fprintf(stderr, "avx512 != avx2: t%d%d m=%lld n=%lld k=%lld beta=%d pad=%lld\n", ta, tb, (long long)m,
                  (long long)n, (long long)k, bi, (long long)pad);
        bad += diff;
        cases++;
        free(a);
        free(b);
        free(c[0]);
        free(c[1]);
      }
  dt_sgemm_use_isa("best");
  CHECK_MSG(bad == 0, "%d of %d products differ between the avx512 and avx2 paths", bad, cases);
}

/* On each x86 path, a product narrow enough to read A unpacked against the
 * first columns of a wide one (A packed): the same bits (alpha 1, beta 0),
 * both transposes of A, rows of 6, 4 and shorter. */
static void test_sgemm_unpacked_a(void) {
  static const char *const isas[2] = {"avx512", "avx2"};
  int ran = 0;
  if (strcmp(dt_sgemm_kernel(), "cblas") == 0) {
    th_skip("a BLAS build (DTRAIN_USE_CBLAS): dt_sgemm is the library's");
    return;
  }
  th_seed(19);
  for (int ii = 0; ii < 2; ii++) {
    if (dt_sgemm_use_isa(isas[ii]) != DTRAIN_OK) continue;
    ran++;
    static const int64_t mk[][2] = {{64, 196}, {64, 32}, {13, 300}, {6, 9}, {4, 700}, {32, 64}, {1, 17}};
    int bad = 0;
    for (int si = 0; si < 7; si++)
      for (int ta = 0; ta < 2; ta++)
        for (int64_t n1 = 16; n1 <= 256; n1 *= 2) {
          int64_t m = mk[si][0], k = mk[si][1], n2 = 600, lda = (ta ? m : k) + 1;
          float *a = (float *)malloc((size_t)((ta ? k : m) * lda) * sizeof(float));
          float *b = (float *)malloc((size_t)(k * n2) * sizeof(float));
          float *c1 = (float *)malloc((size_t)(m * n1) * sizeof(float));
          float *c2 = (float *)malloc((size_t)(m * n2) * sizeof(float));
          th_fill(a, (ta ? k : m) * lda, -1, 1);
          th_fill(b, k * n2, -1, 1);
          dt_sgemm(ta, 0, m, n1, k, 1.0f, a, lda, b, n2, 0.0f, c1, n1);
          dt_sgemm(ta, 0, m, n2, k, 1.0f, a, lda, b, n2, 0.0f, c2, n2);
          for (int64_t i = 0; i < m; i++) bad += memcmp(c1 + i * n1, c2 + i * n2, (size_t)n1 * sizeof(float)) != 0;
          free(a);
          free(b);
          free(c1);
          free(c2);
        }
    CHECK_MSG(bad == 0, "%s: %d rows of narrow products differ from the wide product's", isas[ii], bad);
  }
  dt_sgemm_use_isa("best");
  if (!ran) th_skip("no x86 SIMD path");
}

/* A @ B^T with 16 or 32 rows, many columns and a long k (a linear layer's
 * forward on a small batch), which the x86 paths run flipped, as
 * (B @ A^T)^T through a tile on the stack in blocks of 8192 / m rows of B:
 * against the double reference (NaN-padded A and B, C's padding kept, a NaN
 * C ignored with beta 0), and bit for bit the same as the first m rows of
 * the product with 24 more rows of A (m + 24 rows and k < 512 run the
 * packed kernels unflipped on every path), on every path the CPU has.
 * n = 300 and 600 take two blocks (252 rows of B a block at m = 32, 510
 * at 16); 64 x 1024 x 1024 (big weights) flips on the x86 paths. Under an
 * emulator (th_emulated: qemu, the portable path, which does not flip) two
 * of the shapes. */
/* Whether A @ B^T with m rows differs in any bit from the first m rows of the
 * same product with 24 more rows of A (random operands, lda and ldb given);
 * says which on stderr while *shown < 3. */
static int flipped_differs(const char *isa, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int *shown) {
  int64_t mw = m + 24;
  float *a = (float *)malloc((size_t)(mw * lda) * sizeof(float)), *b = (float *)malloc((size_t)(n * ldb) * sizeof(float));
  float *c = (float *)malloc((size_t)(m * n) * sizeof(float)), *cw = (float *)malloc((size_t)(mw * n) * sizeof(float));
  th_fill(a, mw * lda, -1, 1);
  th_fill(b, n * ldb, -1, 1);
  dt_sgemm(0, 1, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, n);
  dt_sgemm(0, 1, mw, n, k, 1.0f, a, lda, b, ldb, 0.0f, cw, n);
  int d = memcmp(c, cw, (size_t)(m * n) * sizeof(float)) != 0;
  if (d && (*shown)++ < 3)
    fprintf(stderr, "%s: %lldx%lldx%lld differs from the first rows of the %lld-row product\n", isa, (long long)m,
            (long long)n, (long long)k, (long long)mw);
  free(a), free(b), free(c), free(cw);
  return d;
}

static void test_sgemm_flipped(void) {
  static const char *const isas[3] = {"avx512", "avx2", "portable"}; /* those the CPU has */
  if (strcmp(dt_sgemm_kernel(), "cblas") == 0) {
    th_skip("a BLAS build (DTRAIN_USE_CBLAS): dt_sgemm is the library's");
    return;
  }
  static const int64_t ms[2] = {16, 32}, ns[4] = {64, 100, 300, 600}, ks[2] = {128, 301};
  int bad = 0, diff = 0, cases = 0, shown = 0;
  th_seed(23);
  for (int ii = 0; ii < 3; ii++) {
    if (dt_sgemm_use_isa(isas[ii]) != DTRAIN_OK) continue;
    for (int mi = 0; mi < 2; mi++)
      for (int ni = 0; ni < 4; ni++)
        for (int ki = 0; ki < 2; ki++) {
          if (th_emulated() && !(ni == 2 && ki == 0)) continue; /* qemu: portable only, two shapes */
          int64_t m = ms[mi], n = ns[ni], k = ks[ki], pad = (mi + ni + ki) % 3;
          bad += check_sgemm(0, 1, m, n, k, ni % 2 ? -0.5f : 1.0f, 0.0f, pad, ki);
          diff += flipped_differs(isas[ii], m, n, k, k + pad, k + pad + 1, &shown);
          cases++;
        }
  }
  /* 64 rows with weights of 2^20 floats and k >= 1024 flip too (x86 paths only: the
   * portable one does not flip, and its reference would be slow under qemu) */
  for (int ii = 0; ii < 2; ii++) {
    if (dt_sgemm_use_isa(isas[ii]) != DTRAIN_OK) continue;
    diff += flipped_differs(isas[ii], 64, 1024, 1024, 1025, 1024, &shown);
    cases++;
    bad += check_sgemm(0, 1, 64, 1024, 1024, 1.0f, 0.0f, 1, 1);
  }
  dt_sgemm_use_isa("best");
  CHECK_MSG(bad == 0, "%d elements of flipped-shape products wrong", bad);
  CHECK_MSG(diff == 0, "%d of %d products differ from the unflipped product's rows", diff, cases);
}

static void test_sgemm_deterministic(void) {
  th_seed(13);
  int64_t m = 150, n = 270, k = 600;
  float *a = (float *)malloc((size_t)(m * k) * sizeof(float)), *b = (float *)malloc((size_t)(k * n) * sizeof(float));
  float *c1 = (float *)malloc((size_t)(m * n) * sizeof(float)), *c2 = (float *)malloc((size_t)(m * n) * sizeof(float));
  th_fill(a, m * k, -1, 1);
  th_fill(b, k * n, -1, 1);
  for (int t = 0; t < 4; t++) {
    dt_sgemm(t >> 1, t & 1, m, n, k, 1.0f, a, (t >> 1) ? m : k, b, (t & 1) ? k : n, 0.0f, c1, n);
    th_fill(c2, m * n, -1, 1);
    dt_sgemm(t >> 1, t & 1, m, n, k, 1.0f, a, (t >> 1) ? m : k, b, (t & 1) ? k : n, 0.0f, c2, n);
    CHECK(memcmp(c1, c2, (size_t)(m * n) * sizeof(float)) == 0);
  }
  free(a);
  free(b);
  free(c1);
  free(c2);
}

/* Rough single-thread speed, printed for information. */
static void print_sgemm_speed(void) {
  static const int64_t sizes[] = {256, 512};
  if (th_emulated()) { /* an emulator's speed says nothing, and n = 512 costs seconds there */
    printf("dt_sgemm speed: not measured under an emulator\n");
    return;
  }
  for (int s = 0; s < 2; s++) {
    int64_t n = sizes[s];
    float *a = (float *)malloc((size_t)(n * n) * sizeof(float)), *b = (float *)malloc((size_t)(n * n) * sizeof(float));
    float *c = (float *)malloc((size_t)(n * n) * sizeof(float));
    th_fill(a, n * n, -1, 1);
    th_fill(b, n * n, -1, 1);
    /* Best of up to 5 timed calls, within about half a second (sanitizer builds are slow). */
    double best = 1e30, spent = 0;
    for (int trial = 0; trial < 5 && spent < 0.5; trial++) {
      clock_t t0 = clock();
      dt_sgemm(0, 0, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
      double dt = (double)(clock() - t0) / CLOCKS_PER_SEC;
      spent += dt;
      if (dt > 0 && dt < best) best = dt;
    }
    printf("dt_sgemm n=%lld: %.1f GFLOP/s (single thread, rough)\n", (long long)n,
           2.0 * (double)n * (double)n * (double)n / best * 1e-9);
    free(a);
    free(b);
    free(c);
  }
}

/* ---- forward values ------------------------------------------------------------ */

/* Naive [m,k] @ [k,n] (or [n,k] transposed) into out, in double. */
static void naive_mm(const float *a, const float *b, float *out, int64_t m, int64_t k, int64_t n, int trans_b) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++) s += (double)a[i * k + p] * (double)(trans_b ? b[j * k + p] : b[p * n + j]);
      out[i * n + j] = (float)s;
    }
}

static int close_all(const float *x, const float *y, int64_t n, double tol) {
  for (int64_t i = 0; i < n; i++)
    if (!(fabs((double)x[i] - (double)y[i]) <= tol)) return 0;
  return 1;
}

static void test_matmul_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {7, 8, 9, 10, 11, 12};
  int64_t s23[2] = {2, 3}, s32[2] = {3, 2};
  dt_tensor *a = dt_tensor_from(g, 2, s23, av), *b = dt_tensor_from(g, 2, s32, bv);
  dt_tensor *y = dt_matmul(g, a, b);
  CHECK(y && y->ndim == 2 && y->shape[0] == 2 && y->shape[1] == 2);
  /* [1 2 3; 4 5 6] @ [7 8; 9 10; 11 12] = [58 64; 139 154] */
  if (y) CHECK(y->data[0] == 58 && y->data[1] == 64 && y->data[2] == 139 && y->data[3] == 154);
  /* Backward by hand: loss = sum(y): dA[i][p] = sum_j B[p][j], dB[p][j] = sum_i A[i][p]. */
  dt_graph_reset(g);
  a = dt_tensor_from(g, 2, s23, av);
  b = dt_tensor_from(g, 2, s32, bv);
  dt_tensor_set_requires_grad(a, 1);
  dt_tensor_set_requires_grad(b, 1);
  y = dt_matmul(g, a, b);
  float ones[4] = {1, 1, 1, 1};
  CHECK(y && dt_backward_grad(g, y, ones) == DTRAIN_OK);
  CHECK(a->grad && a->grad[0] == 15 && a->grad[1] == 19 && a->grad[2] == 23 && a->grad[5] == 23);
  CHECK(b->grad && b->grad[0] == 5 && b->grad[1] == 5 && b->grad[2] == 7 && b->grad[5] == 9);
  dt_graph_destroy(g);
}

static void test_bmm_values(void) {
  th_seed(21);
  dt_graph *g = dt_graph_create(NULL, NULL);
  /* a [2,3,4,5]; b per batch [2,3,5,6] or [2,3,6,5] (trans), or shared [5,6] / [6,5]. */
  float av[2 * 3 * 4 * 5], bv[2 * 3 * 5 * 6], want[2 * 3 * 4 * 6];
  th_fill(av, 120, -1, 1);
  th_fill(bv, 180, -1, 1);
  int64_t sa[4] = {2, 3, 4, 5}, sb[4] = {2, 3, 5, 6}, sbt[4] = {2, 3, 6, 5}, s56[2] = {5, 6}, s65[2] = {6, 5};
  dt_tensor *a = dt_tensor_from(g, 4, sa, av);
  for (int trans = 0; trans < 2; trans++) {
    dt_tensor *b = dt_tensor_from(g, 4, trans ? sbt : sb, bv);
    dt_tensor *y = dt_bmm(g, a, b, trans);
    CHECK(y && y->ndim == 4 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == 4 && y->shape[3] == 6);
    for (int i = 0; i < 6; i++) naive_mm(av + i * 20, bv + i * 30, want + i * 24, 4, 5, 6, trans);
    if (y) CHECK(close_all(y->data, want, 144, 1e-5));
    dt_tensor *bs = dt_tensor_from(g, 2, trans ? s65 : s56, bv);
    dt_tensor *ys = dt_bmm(g, a, bs, trans);
    CHECK(ys && ys->ndim == 4 && ys->shape[2] == 4 && ys->shape[3] == 6);
    for (int i = 0; i < 6; i++) naive_mm(av + i * 20, bv, want + i * 24, 4, 5, 6, trans);
    if (ys) CHECK(close_all(ys->data, want, 144, 1e-5));
  }
  /* 2-D @ 2-D through dt_bmm is a plain matmul. */
  dt_tensor *a2 = dt_tensor_from(g, 2, s65, av), *b2 = dt_tensor_from(g, 2, s56, bv);
  dt_tensor *y2 = dt_bmm(g, a2, b2, 0);
  naive_mm(av, bv, want, 6, 5, 6, 0);
  CHECK(y2 && y2->ndim == 2 && close_all(y2->data, want, 36, 1e-5));
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  dt_graph_destroy(g);
}

static void test_linear_values(void) {
  th_seed(22);
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[2 * 3 * 7], wv[5 * 7], bv[5], want[30];
  th_fill(xv, 42, -1, 1);
  th_fill(wv, 35, -1, 1);
  th_fill(bv, 5, -1, 1);
  int64_t sx[3] = {2, 3, 7}, sw[2] = {5, 7}, sbias[1] = {5};
  dt_tensor *x = dt_tensor_from(g, 3, sx, xv), *w = dt_tensor_from(g, 2, sw, wv), *b = dt_tensor_from(g, 1, sbias, bv);
  dt_tensor *y = dt_linear(g, x, w, b), *y0 = dt_linear(g, x, w, NULL);
  CHECK(y && y->ndim == 3 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == 5);
  naive_mm(xv, wv, want, 6, 7, 5, 1);
  if (y0) CHECK(close_all(y0->data, want, 30, 1e-5));
  for (int i = 0; i < 30; i++) want[i] += bv[i % 5];
  if (y) CHECK(close_all(y->data, want, 30, 1e-5));
  /* 1-D x [in] -> [out]. */
  int64_t s7[1] = {7};
  dt_tensor *x1 = dt_tensor_from(g, 1, s7, xv);
  dt_tensor *y1 = dt_linear(g, x1, w, b);
  CHECK(y1 && y1->ndim == 1 && y1->shape[0] == 5 && close_all(y1->data, want, 5, 1e-5));
  dt_graph_destroy(g);
}

/* ---- gradients ------------------------------------------------------------------- */

typedef struct { int kind, trans; } mm_ctx; /* kind: 0 matmul, 1 bmm, 2 linear+bias, 3 linear, 4 a@a, 5 bmm(a,a,1) */

static dt_tensor *f_mm(dt_graph *g, dt_tensor **in, void *ctx) {
  mm_ctx *c = (mm_ctx *)ctx;
  switch (c->kind) {
    case 0: return dt_matmul(g, in[0], in[1]);
    case 1: return dt_bmm(g, in[0], in[1], c->trans);
    case 2: return dt_linear(g, in[0], in[1], in[2]);
    case 3: return dt_linear(g, in[0], in[1], NULL);
    case 4: return dt_matmul(g, in[0], in[0]);
    default: return dt_bmm(g, in[0], in[0], 1);
  }
}

static int64_t numel(const int64_t *s, int nd) {
  int64_t n = 1;
  for (int d = 0; d < nd; d++) n *= s[d];
  return n;
}

static void test_matmul_grads(void) {
  th_seed(31);
  static const int64_t shapes[][3] = {{3, 5, 4}, {1, 7, 1}, {6, 17, 9}, {4, 1, 3}, {2, 33, 2}};
  float a[6 * 33], b[33 * 9];
  for (int i = 0; i < 5; i++) {
    int64_t sa[2] = {shapes[i][0], shapes[i][1]}, sb[2] = {shapes[i][1], shapes[i][2]};
    th_fill(a, numel(sa, 2), -1, 1);
    th_fill(b, numel(sb, 2), -1, 1);
    th_input ins[2] = {th_in(a, 2, sa, 1), th_in(b, 2, sb, 1)};
    mm_ctx ctx = {0, 0};
    int bad = th_gradcheck("matmul", f_mm, &ctx, ins, 2);
    CHECK_MSG(bad == 0, "case %d: %d mismatches", i, bad);
  }
  /* The same tensor on both sides: both gradients accumulate into one buffer. */
  int64_t s44[2] = {4, 4};
  th_fill(a, 16, -1, 1);
  th_input one[1] = {th_in(a, 2, s44, 1)};
  mm_ctx ctx4 = {4, 0};
  CHECK(th_gradcheck("matmul a@a", f_mm, &ctx4, one, 1) == 0);
}

static void test_bmm_grads(void) {
  th_seed(32);
  float a[2 * 3 * 4 * 5], b[2 * 3 * 5 * 6];
  for (int trans = 0; trans < 2; trans++) {
    mm_ctx ctx = {1, trans};
    /* 3-D batch */
    int64_t sa3[3] = {3, 4, 5}, sb3[3] = {3, 5, 2}, sb3t[3] = {3, 2, 5};
    th_fill(a, 60, -1, 1);
    th_fill(b, 30, -1, 1);
    th_input i3[2] = {th_in(a, 3, sa3, 1), th_in(b, 3, trans ? sb3t : sb3, 1)};
    int bad = th_gradcheck("bmm 3-D", f_mm, &ctx, i3, 2);
    CHECK_MSG(bad == 0, "3-D trans_b=%d: %d mismatches", trans, bad);
    /* 4-D batch */
    int64_t sa4[4] = {2, 3, 4, 5}, sb4[4] = {2, 3, 5, 2}, sb4t[4] = {2, 3, 2, 5};
    th_fill(a, 120, -1, 1);
    th_fill(b, 60, -1, 1);
    th_input i4[2] = {th_in(a, 4, sa4, 1), th_in(b, 4, trans ? sb4t : sb4, 1)};
    bad = th_gradcheck("bmm 4-D", f_mm, &ctx, i4, 2);
    CHECK_MSG(bad == 0, "4-D trans_b=%d: %d mismatches", trans, bad);
    /* shared 2-D b: its gradient sums over the batch */
    int64_t sbs[2] = {5, 3}, sbst[2] = {3, 5};
    th_fill(a, 120, -1, 1);
    th_fill(b, 15, -1, 1);
    th_input is[2] = {th_in(a, 4, sa4, 1), th_in(b, 2, trans ? sbst : sbs, 1)};
    bad = th_gradcheck("bmm shared", f_mm, &ctx, is, 2);
    CHECK_MSG(bad == 0, "shared trans_b=%d: %d mismatches", trans, bad);
    /* only b needs a gradient */
    th_input ib[2] = {th_in(a, 4, sa4, 0), th_in(b, 2, trans ? sbst : sbs, 1)};
    CHECK(th_gradcheck("bmm shared b only", f_mm, &ctx, ib, 2) == 0);
  }
  /* a @ a^T with one tensor. */
  int64_t s3[3] = {2, 3, 4};
  th_fill(a, 24, -1, 1);
  th_input one[1] = {th_in(a, 3, s3, 1)};
  mm_ctx ctx5 = {5, 1};
  CHECK(th_gradcheck("bmm a@a^T", f_mm, &ctx5, one, 1) == 0);
}

static void test_linear_grads(void) {
  th_seed(33);
  float x[2 * 3 * 6], w[5 * 6], b[5];
  int64_t sx2[2] = {4, 6}, sx3[3] = {2, 3, 6}, sx1[1] = {6}, sw[2] = {5, 6}, sb[1] = {5};
  const int64_t *sxs[3] = {sx2, sx3, sx1};
  int nds[3] = {2, 3, 1};
  for (int c = 0; c < 3; c++) {
    th_fill(x, numel(sxs[c], nds[c]), -1, 1);
    th_fill(w, 30, -1, 1);
    th_fill(b, 5, -1, 1);
    th_input ins[3] = {th_in(x, nds[c], sxs[c], 1), th_in(w, 2, sw, 1), th_in(b, 1, sb, 1)};
    mm_ctx with_bias = {2, 0}, no_bias = {3, 0};
    int bad = th_gradcheck("linear", f_mm, &with_bias, ins, 3);
    CHECK_MSG(bad == 0, "x rank %d with bias: %d mismatches", nds[c], bad);
    bad = th_gradcheck("linear no bias", f_mm, &no_bias, ins, 2);
    CHECK_MSG(bad == 0, "x rank %d without bias: %d mismatches", nds[c], bad);
  }
}

/* ---- errors -------------------------------------------------------------------------- */

/* Expect the graph to hold `code` with `needle` in its message. */
static void expect_err(dt_graph *g, dt_tensor *y, dt_result code, const char *needle) {
  CHECK(y == NULL);
  CHECK_MSG(dt_graph_error(g) == code, "got %s, want %s", dt_result_name(dt_graph_error(g)), dt_result_name(code));
  CHECK_MSG(strstr(dt_graph_message(g), needle) != NULL, "message '%s' lacks '%s'", dt_graph_message(g), needle);
  dt_graph_reset(g);
}

static void test_matmul_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *a = dt_tensor_new2(g, 3, 4), *b = dt_tensor_new2(g, 5, 2);
  expect_err(g, dt_matmul(g, a, b), DTRAIN_ERR_SHAPE, "dt_matmul: inner dims differ ([3,4] @ [5,2])");
  a = dt_tensor_new3(g, 2, 3, 4);
  b = dt_tensor_new2(g, 4, 5);
  expect_err(g, dt_matmul(g, a, b), DTRAIN_ERR_RANK, "dt_matmul: operands must be 2-D ([2,3,4] @ [4,5])");
  a = dt_tensor_new2(g, 3, 4);
  b = dt_tensor_new1(g, 4);
  expect_err(g, dt_matmul(g, a, b), DTRAIN_ERR_RANK, "[3,4] @ [4]");
  b = dt_tensor_new2(g, 4, 5);
  expect_err(g, dt_matmul(g, NULL, b), DTRAIN_ERR_NULL_ARG, "dt_matmul: tensor argument 1 is NULL");
  a = dt_tensor_new2(g, 3, 4);
  expect_err(g, dt_matmul(g, a, NULL), DTRAIN_ERR_NULL_ARG, "dt_matmul: tensor argument 2 is NULL");
  /* NULL graph: thread error, no crash. */
  CHECK(dt_matmul(NULL, NULL, NULL) == NULL);
  CHECK(strstr(dt_last_error(), "dt_matmul") != NULL);
  /* Sticky: after a failure, a valid call does nothing. */
  a = dt_tensor_new2(g, 3, 4);
  b = dt_tensor_new2(g, 5, 2);
  CHECK(dt_matmul(g, a, b) == NULL);
  dt_tensor *ok = dt_tensor_new2(g, 2, 3);
  CHECK(ok == NULL && dt_matmul(g, a, a) == NULL);
  CHECK(strstr(dt_graph_message(g), "inner dims differ") != NULL);
  dt_graph_destroy(g);
}

static void test_bmm_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *a = dt_tensor_new3(g, 2, 3, 4), *b = dt_tensor_new3(g, 3, 4, 5);
  expect_err(g, dt_bmm(g, a, b, 0), DTRAIN_ERR_SHAPE, "dt_bmm: batch dims differ ([2,3,4] @ [3,4,5])");
  a = dt_tensor_new4(g, 2, 2, 3, 4);
  b = dt_tensor_new3(g, 2, 4, 5);
  expect_err(g, dt_bmm(g, a, b, 0), DTRAIN_ERR_SHAPE, "batch dims differ ([2,2,3,4] @ [2,4,5])");
  a = dt_tensor_new3(g, 2, 3, 4);
  b = dt_tensor_new3(g, 2, 5, 6);
  expect_err(g, dt_bmm(g, a, b, 0), DTRAIN_ERR_SHAPE, "dt_bmm: inner dims differ ([2,3,4] @ [2,5,6])");
  a = dt_tensor_new3(g, 2, 3, 4);
  b = dt_tensor_new3(g, 2, 4, 6); /* fine untransposed, wrong as [...,N,K] */
  expect_err(g, dt_bmm(g, a, b, 1), DTRAIN_ERR_SHAPE, "dt_bmm: inner dims differ ([2,3,4] @ [2,4,6]^T)");
  a = dt_tensor_new1(g, 4);
  b = dt_tensor_new2(g, 4, 5);
  expect_err(g, dt_bmm(g, a, b, 0), DTRAIN_ERR_RANK, "dt_bmm: operands must have at least 2 dims ([4] @ [4,5])");
  a = dt_tensor_new3(g, 2, 3, 4);
  expect_err(g, dt_bmm(g, a, NULL, 1), DTRAIN_ERR_NULL_ARG, "dt_bmm: tensor argument 2 is NULL");
  /* a tensor of another graph */
  dt_graph *g2 = dt_graph_create(NULL, NULL);
  a = dt_tensor_new3(g, 2, 3, 4);
  dt_tensor *b2 = dt_tensor_new2(g2, 4, 5);
  expect_err(g, dt_bmm(g, a, b2, 0), DTRAIN_ERR_INVALID_ARG, "another graph");
  dt_graph_destroy(g2);
  dt_graph_destroy(g);
}

static void test_linear_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new2(g, 4, 6), *w = dt_tensor_new2(g, 5, 7);
  expect_err(g, dt_linear(g, x, w, NULL), DTRAIN_ERR_SHAPE, "dt_linear: weight [5,7] does not match x [4,6]");
  x = dt_tensor_new2(g, 4, 6);
  w = dt_tensor_new2(g, 5, 6);
  dt_tensor *b = dt_tensor_new1(g, 4);
  expect_err(g, dt_linear(g, x, w, b), DTRAIN_ERR_SHAPE, "dt_linear: bias [4] does not match weight [5,6]");
  x = dt_tensor_new2(g, 4, 6);
  w = dt_tensor_new2(g, 5, 6);
  b = dt_tensor_new2(g, 1, 5);
  expect_err(g, dt_linear(g, x, w, b), DTRAIN_ERR_RANK, "bias [1,5]");
  x = dt_tensor_new2(g, 4, 6);
  w = dt_tensor_new1(g, 6);
  expect_err(g, dt_linear(g, x, w, NULL), DTRAIN_ERR_RANK, "weight [6]");
  x = dt_scalar(g, 1.0f);
  w = dt_tensor_new2(g, 5, 1);
  expect_err(g, dt_linear(g, x, w, NULL), DTRAIN_ERR_RANK, "dt_linear: expects x [...,in]");
  w = dt_tensor_new2(g, 5, 6);
  expect_err(g, dt_linear(g, NULL, w, NULL), DTRAIN_ERR_NULL_ARG, "dt_linear: tensor argument 1 is NULL");
  x = dt_tensor_new2(g, 4, 6);
  expect_err(g, dt_linear(g, x, NULL, NULL), DTRAIN_ERR_NULL_ARG, "dt_linear: tensor argument 2 is NULL");
  dt_graph *g2 = dt_graph_create(NULL, NULL);
  x = dt_tensor_new2(g, 4, 6);
  w = dt_tensor_new2(g, 5, 6);
  b = dt_tensor_new1(g2, 5);
  expect_err(g, dt_linear(g, x, w, b), DTRAIN_ERR_INVALID_ARG, "dt_linear: bias belongs to another graph");
  dt_graph_destroy(g2);
  dt_graph_destroy(g);
}

/* No-grad mode: values only, nothing on the tape, no gradient buffers. */
static void test_no_grad(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_graph_set_grad_enabled(g, 0);
  dt_tensor *x = dt_tensor_new2(g, 4, 6), *w = dt_tensor_new2(g, 5, 6);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *y = dt_linear(g, x, w, NULL);
  CHECK(y && !(y->flags & DTRAIN_TENSOR_REQUIRES_GRAD) && y->backward == NULL);
  dt_graph_destroy(g);
}

int main(void) {
  printf("%s\n", dt_build_info());
  TH_RUN(test_sgemm_shapes);
  TH_RUN(test_sgemm_beta0_nan);
  TH_RUN(test_sgemm_deterministic);
  TH_RUN(test_sgemm_flipped);
  TH_RUN(test_sgemm_paths_agree);
  TH_RUN(test_sgemm_unpacked_a);
  TH_RUN(test_matmul_values);
  TH_RUN(test_bmm_values);
  TH_RUN(test_linear_values);
  TH_RUN(test_matmul_grads);
  TH_RUN(test_bmm_grads);
  TH_RUN(test_linear_grads);
  TH_RUN(test_matmul_errors);
  TH_RUN(test_bmm_errors);
  TH_RUN(test_linear_errors);
  TH_RUN(test_no_grad);
  print_sgemm_speed();
  return th_summary("ops_matmul");
}
