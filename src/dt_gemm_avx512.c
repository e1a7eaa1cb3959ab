/* ===========================================================================
 * dt_gemm_avx512.c -- the AVX-512 micro-kernels of dt_sgemm (ops layer)
 * ===========================================================================
 * The "avx512" path of dt_gemm.c (chosen at run time on x86-64 CPUs with
 * AVX-512F, or by DTRAIN_ISA / dt_sgemm_use_isa): a 6x32 tile, 12 zmm
 * accumulators, two B vectors and one broadcast A value per k step (12 FMAs
 * for 2 loads and 6 broadcasts), and its first-4-rows variant for the 4-row
 * edge of 64-row batches, both also reading A where it lies (strided, for
 * products with n <= 256; dt_gemm.c). It is the AVX2 path's tile twice as wide: the
 * slivers are packed by dt_gemm_avx2.c's routines (6-tall A, 32-wide B),
 * and every element gets the same operations as on the AVX2 path (FMAs in
 * increasing p, then alpha and beta), so a full tile's results are those of
 * the AVX2 path bit for bit; edge tiles round as dt_gemm.c's edge code does.
 * Compiled for AVX-512F with a function attribute, so a plain -O2 build has
 * it; gcc keeps generic tuning here for the reason dt_gemm.c gives.
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

#ifdef DT__X86_SIMD
#  include <immintrin.h>
#  if defined(__clang__)
#    define DT__GEMM_AVX512 __attribute__((target("avx512f,fma")))
#  else
#    define DT__GEMM_AVX512 __attribute__((target("avx512f,fma,tune=generic")))
#  endif

#define DT__Z_FMA2(r)                                 \
  do {                                                \
    __m512 a_ = _mm512_set1_ps(a[(r) * ars]);         \
    c##r##0 = _mm512_fmadd_ps(a_, b0, c##r##0);       \
    c##r##1 = _mm512_fmadd_ps(a_, b1, c##r##1);       \
  } while (0)

/* The 6x32 tile: op(A)[r][p] at a[r * ars + p * aks] (packed: 1 and 6),
 * op(B)[p][j] at bp[p * bks + j] (packed: 32). */
DT__GEMM_AVX512 static inline __attribute__((always_inline)) void
dt__gemm_micro6_z(int64_t kc, const float *DT__RESTRICT a, int64_t ars, int64_t aks, const float *DT__RESTRICT bp,
                  int64_t bks, float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps();
  __m512 c11 = _mm512_setzero_ps(), c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps();
  __m512 c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps(), c40 = _mm512_setzero_ps();
  __m512 c41 = _mm512_setzero_ps(), c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
  for (int r = 0; r < 6; r++) { /* C is needed at the end: start fetching it now */
    _mm_prefetch((const char *)(c + r * ldc), _MM_HINT_T0);
    _mm_prefetch((const char *)(c + r * ldc + 31), _MM_HINT_T0);
  }
  for (int64_t p = 0; p < kc; p++) {
    __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
    DT__Z_FMA2(0);
    DT__Z_FMA2(1);
    DT__Z_FMA2(2);
    DT__Z_FMA2(3);
    DT__Z_FMA2(4);
    DT__Z_FMA2(5);
    a += aks;
    bp += bks;
  }
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  DT__GEMM_Z_STORE(0);
  DT__GEMM_Z_STORE(1);
  DT__GEMM_Z_STORE(2);
  DT__GEMM_Z_STORE(3);
  DT__GEMM_Z_STORE(4);
  DT__GEMM_Z_STORE(5);
}

/* The first 4 rows of a 6x32 tile, straight to C (A as above). */
DT__GEMM_AVX512 static inline __attribute__((always_inline)) void
dt__gemm_micro4_z(int64_t kc, const float *DT__RESTRICT a, int64_t ars, int64_t aks, const float *DT__RESTRICT bp,
                  int64_t bks, float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps();
  __m512 c11 = _mm512_setzero_ps(), c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps();
  __m512 c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; p++) {
    __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
    DT__Z_FMA2(0);
    DT__Z_FMA2(1);
    DT__Z_FMA2(2);
    DT__Z_FMA2(3);
    a += aks;
    bp += bks;
  }
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  DT__GEMM_Z_STORE(0);
  DT__GEMM_Z_STORE(1);
  DT__GEMM_Z_STORE(2);
  DT__GEMM_Z_STORE(3);
}

DT__GEMM_AVX512 DTRAIN_PRIVATE void dt__gemm_micro_avx512(int64_t kc, const float *DT__RESTRICT ap,
                                                          const float *DT__RESTRICT bp, float alpha, float beta,
                                                          float *DT__RESTRICT c, int64_t ldc) {
  dt__gemm_micro6_z(kc, ap, 1, 6, bp, 32, alpha, beta, c, ldc);
}

DT__GEMM_AVX512 DTRAIN_PRIVATE void dt__gemm_micro4_avx512(int64_t kc, const float *DT__RESTRICT ap,
                                                           const float *DT__RESTRICT bp, float alpha, float beta,
                                                           float *DT__RESTRICT c, int64_t ldc) {
  dt__gemm_micro4_z(kc, ap, 1, 6, bp, 32, alpha, beta, c, ldc);
}

/* The same tiles with A and B read at strides (dt_gemm.c: products with
 * few columns or few rows, where a packed operand would be read a few
 * times): rows 4 or 6. */
DT__GEMM_AVX512 DTRAIN_PRIVATE void dt__gemm_micro_avx512_ua(int rows, int64_t kc, const float *DT__RESTRICT a,
                                                             int64_t ars, int64_t aks, const float *DT__RESTRICT bp,
                                                             int64_t bks, float alpha, float beta,
                                                             float *DT__RESTRICT c, int64_t ldc) {
  if (rows == 6) dt__gemm_micro6_z(kc, a, ars, aks, bp, bks, alpha, beta, c, ldc);
  else dt__gemm_micro4_z(kc, a, ars, aks, bp, bks, alpha, beta, c, ldc);
}

/* The first 16 columns of a tile of 6 (or 4) rows into t (alpha 1, beta 0),
 * A and B as above: dt_gemm.c's edge tiles at most 16 wide, half the work
 * of a full tile. Each element gets the full tile's FMAs. */
DT__GEMM_AVX512 DTRAIN_PRIVATE void dt__gemm_edge16_avx512(int rows, int64_t kc, const float *DT__RESTRICT a,
                                                           int64_t ars, int64_t aks, const float *DT__RESTRICT bp,
                                                           int64_t bks, float *DT__RESTRICT t, int64_t ldt) {
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
  __m512 c3 = _mm512_setzero_ps(), c4 = _mm512_setzero_ps(), c5 = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; p++) {
    __m512 b0 = _mm512_loadu_ps(bp);
    c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), b0, c0);
    c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[ars]), b0, c1);
    c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[2 * ars]), b0, c2);
    c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[3 * ars]), b0, c3);
    if (rows == 6) {
      c4 = _mm512_fmadd_ps(_mm512_set1_ps(a[4 * ars]), b0, c4);
      c5 = _mm512_fmadd_ps(_mm512_set1_ps(a[5 * ars]), b0, c5);
    }
    a += aks;
    bp += bks;
  }
  _mm512_storeu_ps(t, c0);
  _mm512_storeu_ps(t + ldt, c1);
  _mm512_storeu_ps(t + 2 * ldt, c2);
  _mm512_storeu_ps(t + 3 * ldt, c3);
  if (rows == 6) {
    _mm512_storeu_ps(t + 4 * ldt, c4);
    _mm512_storeu_ps(t + 5 * ldt, c5);
  }
}

/* Full 32-wide B slivers from a transposed B (rows of op(B)^T contiguous
 * in p), for the slivers [0, full) of a panel: rows h..h+7 and h+8..h+15 of
 * a sliver go through one 8x8 transpose together, one in each 256-bit half
 * of the registers (the AVX2 path's unpack and shuffle steps act on each
 * 128-bit lane alike; the last step takes its lanes with one two-source
 * permute), and each packed row leaves as one 16-float store. Half the
 * shuffles of two AVX2 transposes. The values are the AVX2 packing's.
 * The shuffles are the masked forms with every lane set (the same
 * instructions): gcc 12's plain forms start from an undefined vector, and
 * C++ builds warn (maybe-uninitialized) where they are inlined. */
DT__GEMM_AVX512 DTRAIN_PRIVATE void dt__gemm_pack_bt_avx512(const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                                            int64_t kc, int64_t full, float *bp) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  int64_t k8 = kc - kc % 8;
  for (int64_t s = 0; s < full; s += 32, bp += 32 * kc) {
    const float *src = b + (j0 + s) * ldb + p0;
    for (int64_t p = 0; p < k8; p += 8) {
      if ((p & 15) == 0) /* 32 rows at once are more streams than the prefetcher follows */
        for (int i = 0; i < 32; i++) _mm_prefetch((const char *)(src + i * ldb + p + 32), _MM_HINT_T0);
      for (int h = 0; h < 32; h += 16) {
        __m512 r[8];
        for (int i = 0; i < 8; i++) {
          __m512d x = _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(src + (h + i) * ldb + p)));
          x = _mm512_mask_insertf64x4(x, (__mmask8)0xFF, x, _mm256_castps_pd(_mm256_loadu_ps(src + (h + 8 + i) * ldb + p)),
                                      1);
          r[i] = _mm512_castpd_ps(x);
        }
        const __mmask16 all = (__mmask16)0xFFFF; /* DT__ZM: see above */
#define DT__ZM(op, a, b) _mm512_mask_##op##_ps(a, all, a, b)
#define DT__ZS(a, b, imm) _mm512_mask_shuffle_ps(a, all, a, b, imm)
        __m512 t0 = DT__ZM(unpacklo, r[0], r[1]), t1 = DT__ZM(unpackhi, r[0], r[1]);
        __m512 t2 = DT__ZM(unpacklo, r[2], r[3]), t3 = DT__ZM(unpackhi, r[2], r[3]);
        __m512 t4 = DT__ZM(unpacklo, r[4], r[5]), t5 = DT__ZM(unpackhi, r[4], r[5]);
        __m512 t6 = DT__ZM(unpacklo, r[6], r[7]), t7 = DT__ZM(unpackhi, r[6], r[7]);
        __m512 u0 = DT__ZS(t0, t2, 0x44), u1 = DT__ZS(t0, t2, 0xEE);
        __m512 u2 = DT__ZS(t1, t3, 0x44), u3 = DT__ZS(t1, t3, 0xEE);
        __m512 u4 = DT__ZS(t4, t6, 0x44), u5 = DT__ZS(t4, t6, 0xEE);
        __m512 u6 = DT__ZS(t5, t7, 0x44), u7 = DT__ZS(t5, t7, 0xEE);
#undef DT__ZM
#undef DT__ZS
        float *d = bp + p * 32 + h;
        _mm512_storeu_ps(d + 0 * 32, _mm512_permutex2var_ps(u0, lo, u4));
        _mm512_storeu_ps(d + 1 * 32, _mm512_permutex2var_ps(u1, lo, u5));
        _mm512_storeu_ps(d + 2 * 32, _mm512_permutex2var_ps(u2, lo, u6));
        _mm512_storeu_ps(d + 3 * 32, _mm512_permutex2var_ps(u3, lo, u7));
        _mm512_storeu_ps(d + 4 * 32, _mm512_permutex2var_ps(u0, hi, u4));
        _mm512_storeu_ps(d + 5 * 32, _mm512_permutex2var_ps(u1, hi, u5));
        _mm512_storeu_ps(d + 6 * 32, _mm512_permutex2var_ps(u2, hi, u6));
        _mm512_storeu_ps(d + 7 * 32, _mm512_permutex2var_ps(u3, hi, u7));
      }
    }
    for (int64_t p = k8; p < kc; p++)
      for (int j = 0; j < 32; j++) bp[p * 32 + j] = src[j * ldb + p];
  }
}

#undef DT__Z_FMA2
#undef DT__GEMM_AVX512
#endif /* DT__X86_SIMD */
