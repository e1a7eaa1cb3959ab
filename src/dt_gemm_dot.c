/* ===========================================================================
 * dt_gemm_dot.c -- dt_sgemm's unpacked dot-product kernels (ops layer)
 * ===========================================================================
 * For A @ B^T where packing costs as much as the product (dt_gemm.c picks
 * them: few columns on both x86 paths, few rows with a long k on AVX2):
 * each element of C is a dot product of a row of A and a row of B^T, both
 * contiguous in p. Compiled with function attributes (AVX2+FMA, AVX-512F),
 * so a plain -O2 build has them; generic tuning for the reason dt_gemm.c
 * gives.
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

#ifdef DT__X86_SIMD
#  include <immintrin.h>
#  if defined(__clang__)
#    define DT__DOT_AVX2 __attribute__((target("avx2,fma")))
#    define DT__DOT_AVX512 __attribute__((target("avx512f,fma")))
#  else
#    define DT__DOT_AVX2 __attribute__((target("avx2,fma,tune=generic")))
#    define DT__DOT_AVX512 __attribute__((target("avx512f,fma,tune=generic")))
#  endif

/* C = alpha * A @ B^T + beta * C (A untransposed, B transposed) without
 * packing, for products with few columns (n < 32, less than two B slivers),
 * where packing both operands costs as much as the product and the 16-wide
 * tile would be mostly padding (the weight gradient of a first convolution
 * layer: 32 x 25 x 784). Rows of A and rows of B^T are both contiguous in
 * p, so each element is a dot product: 8 lanes of FMAs over p in steps of 8,
 * the lanes summed in a fixed tree, the remaining p added by scalar FMAs in
 * order, then alpha and beta. Every element gets exactly these operations
 * wherever it sits, so results do not depend on how rows are blocked or
 * split over threads. Blocks of 3 rows x 4 columns, columns outside; a
 * partial block repeats its last row or column and stores only the valid
 * ones. */
DT__DOT_AVX2 DTRAIN_PRIVATE void dt__gemm_dot_avx2(int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                                            int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                            int64_t ldc) {
  int64_t k8 = k - k % 8;
  for (int64_t j0 = 0; j0 < n; j0 += 4) { /* 4 rows of B^T stay in L1 while A streams past */
    int64_t nr = DT__MIN(4, n - j0);
    const float *br[4];
    for (int j = 0; j < 4; j++) br[j] = b + (j0 + DT__MIN(j, nr - 1)) * ldb;
    for (int64_t i0 = 0; i0 < m; i0 += 3) {
      int64_t mr = DT__MIN(3, m - i0);
      const float *ar[3];
      for (int r = 0; r < 3; r++) ar[r] = a + (i0 + DT__MIN(r, mr - 1)) * lda;
      /* Twelve named accumulators (an array would live in memory). */
      __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c02 = _mm256_setzero_ps();
      __m256 c03 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
      __m256 c12 = _mm256_setzero_ps(), c13 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps();
      __m256 c21 = _mm256_setzero_ps(), c22 = _mm256_setzero_ps(), c23 = _mm256_setzero_ps();
      for (int64_t p = 0; p < k8; p += 8) {
        __m256 a0 = _mm256_loadu_ps(ar[0] + p), a1 = _mm256_loadu_ps(ar[1] + p), a2 = _mm256_loadu_ps(ar[2] + p), bv;
#define DT__DOT_COL(j)                         \
  bv = _mm256_loadu_ps(br[j] + p);             \
  c0##j = _mm256_fmadd_ps(a0, bv, c0##j);      \
  c1##j = _mm256_fmadd_ps(a1, bv, c1##j);      \
  c2##j = _mm256_fmadd_ps(a2, bv, c2##j)
        DT__DOT_COL(0);
        DT__DOT_COL(1);
        DT__DOT_COL(2);
        DT__DOT_COL(3);
#undef DT__DOT_COL
      }
      __m256 acc[3][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
      for (int64_t r = 0; r < mr; r++) {
        for (int64_t j = 0; j < nr; j++) {
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r][j]), _mm256_extractf128_ps(acc[r][j], 1));
          h = _mm_add_ps(h, _mm_movehl_ps(h, h));
          h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
          for (int64_t p = k8; p < k; p++) h = _mm_fmadd_ss(_mm_set_ss(ar[r][p]), _mm_set_ss(br[j][p]), h);
          float v = _mm_cvtss_f32(h), *cp = c + (i0 + r) * ldc + j0 + j;
          if (beta == 0.0f) *cp = alpha * v;
          else if (beta == 1.0f) *cp += alpha * v;
          else *cp = alpha * v + beta * *cp;
        }
      }
    }
  }
}

/* C = alpha * A @ B^T + beta * C without packing, the AVX-512 twin of
 * dt__gemm_dot_avx2 above (the same cases): 16 lanes of FMAs over p in
 * steps of 16, the lanes summed in a fixed tree, the remaining p added by
 * scalar FMAs in order, then alpha and beta. Every element gets exactly these
 * operations wherever it sits, so results do not depend on how rows are
 * blocked or split over threads. Blocks of 4 rows x 5 columns (20 of the 32
 * registers: 9 loads for 20 FMAs; a first convolution layer's 32 x 25 weight
 * gradient in whole blocks): on a Zen 5 that product ran at 210 GFLOP/s,
 * against 86 in blocks of 3 x 4 (the AVX2 path's, for its 16 registers). */
DT__DOT_AVX512 DTRAIN_PRIVATE void dt__gemm_dot_avx512(int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                                                        int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                                        int64_t ldc) {
  int64_t k16 = k - k % 16;
  for (int64_t j0 = 0; j0 < n; j0 += 5) { /* 5 rows of B^T stay in L1 while A streams past */
    int64_t nr = DT__MIN(5, n - j0);
    const float *br[5];
    for (int j = 0; j < 5; j++) br[j] = b + (j0 + DT__MIN(j, nr - 1)) * ldb;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      int64_t mr = DT__MIN(4, m - i0);
      const float *ar[4];
      for (int r = 0; r < 4; r++) ar[r] = a + (i0 + DT__MIN(r, mr - 1)) * lda;
      /* Twenty named accumulators (an array would live in memory). */
#define DT__Z_DOT_ROW(r)                                                                            \
  __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps(), c##r##2 = _mm512_setzero_ps(); \
  __m512 c##r##3 = _mm512_setzero_ps(), c##r##4 = _mm512_setzero_ps()
      DT__Z_DOT_ROW(0);
      DT__Z_DOT_ROW(1);
      DT__Z_DOT_ROW(2);
      DT__Z_DOT_ROW(3);
#undef DT__Z_DOT_ROW
      for (int64_t p = 0; p < k16; p += 16) {
        __m512 a0 = _mm512_loadu_ps(ar[0] + p), a1 = _mm512_loadu_ps(ar[1] + p);
        __m512 a2 = _mm512_loadu_ps(ar[2] + p), a3 = _mm512_loadu_ps(ar[3] + p), bv;
#define DT__Z_DOT_COL(j)                       \
  bv = _mm512_loadu_ps(br[j] + p);             \
  c0##j = _mm512_fmadd_ps(a0, bv, c0##j);      \
  c1##j = _mm512_fmadd_ps(a1, bv, c1##j);      \
  c2##j = _mm512_fmadd_ps(a2, bv, c2##j);      \
  c3##j = _mm512_fmadd_ps(a3, bv, c3##j)
        DT__Z_DOT_COL(0);
        DT__Z_DOT_COL(1);
        DT__Z_DOT_COL(2);
        DT__Z_DOT_COL(3);
        DT__Z_DOT_COL(4);
#undef DT__Z_DOT_COL
      }
      __m512 acc[4][5] = {
          {c00, c01, c02, c03, c04}, {c10, c11, c12, c13, c14}, {c20, c21, c22, c23, c24}, {c30, c31, c32, c33, c34}};
      for (int64_t r = 0; r < mr; r++) {
        for (int64_t j = 0; j < nr; j++) {
          /* the lanes in a fixed tree, 16 -> 8 -> 4 -> 2 -> 1, through memory: gcc 12's
           * AVX-512 casts and extracts warn (maybe-uninitialized) in C++ builds */
          float lanes[16];
          _mm512_storeu_ps(lanes, acc[r][j]);
          __m256 o = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
          h = _mm_add_ps(h, _mm_movehl_ps(h, h));
          h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
          for (int64_t p = k16; p < k; p++) h = _mm_fmadd_ss(_mm_set_ss(ar[r][p]), _mm_set_ss(br[j][p]), h);
          float v = _mm_cvtss_f32(h), *cp = c + (i0 + r) * ldc + j0 + j;
          if (beta == 0.0f) *cp = alpha * v;
          else if (beta == 1.0f) *cp += alpha * v;
          else *cp = alpha * v + beta * *cp;
        }
      }
    }
  }
}

#  undef DT__DOT_AVX2
#  undef DT__DOT_AVX512
#endif /* DT__X86_SIMD */
