/* ===========================================================================
 * dt_gemm_avx2.c -- the AVX2+FMA micro-kernel and the x86 packing of dt_sgemm (ops layer)
 * ===========================================================================
 * The "avx2+fma" path of dt_gemm.c (chosen at run time on x86-64 CPUs with
 * AVX2 and FMA, or by DTRAIN_ISA / dt_sgemm_use_isa): a 6x16 tile, 12 ymm
 * accumulators, two B vectors and one broadcast A value per k step (12 FMAs
 * for 2 loads and 6 broadcasts), its first-4-rows variant, and the same
 * tile reading A and B at strides. Also the packing both x86 paths share:
 * 6-tall A slivers, 16-wide (AVX2) and 32-wide (AVX-512) B slivers; the
 * portable packers (dt_gemm_pack.c) take the odd slivers at the edges.
 * Compiled for AVX2+FMA with a function attribute, so a plain -O2 build has
 * it. gcc tuning for AMD Zen (-march=native or -mtune=znver*) folds the
 * kernels' loads into the FMAs and loads each A row again for every FMA
 * instead of keeping it in a register: twice the loads, and the GEMM ran
 * 2.5-3x slower (25-28 GFLOP/s against 70-78 on an EPYC, 64x256x784). The
 * kernels keep generic tuning whatever the build's; clang (which does not
 * know tune=generic here) keeps its loads in registers either way.
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

#ifdef DT__X86_SIMD
#  include <immintrin.h>
#  if defined(__clang__)
#    define DT__GEMM_AVX2 __attribute__((target("avx2,fma")))
#  else
#    define DT__GEMM_AVX2 __attribute__((target("avx2,fma,tune=generic")))
#  endif


#define DT__AVX_FMA2(r)                                          \
  do {                                                           \
    __m256 a_ = _mm256_broadcast_ss(a + (r) * ars);              \
    c##r##0 = _mm256_fmadd_ps(a_, b0, c##r##0);                  \
    c##r##1 = _mm256_fmadd_ps(a_, b1, c##r##1);                  \
  } while (0)

/* One row of the tile: c[r] = alpha*acc (+ beta*c[r]). */
#define DT__AVX_STORE(r)                                                                            \
  do {                                                                                              \
    float *cr_ = c + (r) * ldc;                                                                     \
    if (beta == 0.0f) {                                                                             \
      _mm256_storeu_ps(cr_, _mm256_mul_ps(va, c##r##0));                                            \
      _mm256_storeu_ps(cr_ + 8, _mm256_mul_ps(va, c##r##1));                                        \
    } else if (beta == 1.0f) {                                                                      \
      _mm256_storeu_ps(cr_, _mm256_fmadd_ps(va, c##r##0, _mm256_loadu_ps(cr_)));                    \
      _mm256_storeu_ps(cr_ + 8, _mm256_fmadd_ps(va, c##r##1, _mm256_loadu_ps(cr_ + 8)));            \
    } else {                                                                                        \
      _mm256_storeu_ps(cr_, _mm256_fmadd_ps(va, c##r##0, _mm256_mul_ps(vb, _mm256_loadu_ps(cr_)))); \
      _mm256_storeu_ps(cr_ + 8,                                                                     \
                       _mm256_fmadd_ps(va, c##r##1, _mm256_mul_ps(vb, _mm256_loadu_ps(cr_ + 8))));  \
    }                                                                                               \
  } while (0)

/* The 6x16 tile (rows 6) or its first 4 rows (rows 4: the edge tile of the
 * 64-row batches of training steps, 64 = 10 x 6 + 4, written straight to C
 * like a full tile, with the same arithmetic per element): op(A)[r][p] at
 * a[r * ars + p * aks] (packed slivers, 6 tall: 1 and 6), op(B)[p][j] at
 * bp[p * bks + j] (packed: 16). */
DT__GEMM_AVX2 static inline __attribute__((always_inline)) void
dt__gemm_tile_avx2(int rows, int64_t kc, const float *DT__RESTRICT a, int64_t ars, int64_t aks,
                   const float *DT__RESTRICT bp, int64_t bks, float alpha, float beta, float *DT__RESTRICT c,
                   int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps();
  __m256 c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps();
  __m256 c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int r = 0; r < rows; r++) { /* C is needed at the end: start fetching it now */
    _mm_prefetch((const char *)(c + r * ldc), _MM_HINT_T0);
    _mm_prefetch((const char *)(c + r * ldc + 15), _MM_HINT_T0);
  }
  for (int64_t p = 0; p < kc; p++) {
    __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
    DT__AVX_FMA2(0);
    DT__AVX_FMA2(1);
    DT__AVX_FMA2(2);
    DT__AVX_FMA2(3);
    if (rows == 6) {
      DT__AVX_FMA2(4);
      DT__AVX_FMA2(5);
    }
    a += aks;
    bp += bks;
  }
  __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  DT__AVX_STORE(0);
  DT__AVX_STORE(1);
  DT__AVX_STORE(2);
  DT__AVX_STORE(3);
  if (rows == 6) {
    DT__AVX_STORE(4);
    DT__AVX_STORE(5);
  }
}

DT__GEMM_AVX2 DTRAIN_PRIVATE void dt__gemm_micro_avx2(int64_t kc, const float *DT__RESTRICT ap,
                                                      const float *DT__RESTRICT bp, float alpha, float beta,
                                                      float *DT__RESTRICT c, int64_t ldc) {
  dt__gemm_tile_avx2(6, kc, ap, 1, 6, bp, 16, alpha, beta, c, ldc);
}

DT__GEMM_AVX2 DTRAIN_PRIVATE void dt__gemm_micro4_avx2(int64_t kc, const float *DT__RESTRICT ap,
                                                       const float *DT__RESTRICT bp, float alpha, float beta,
                                                       float *DT__RESTRICT c, int64_t ldc) {
  dt__gemm_tile_avx2(4, kc, ap, 1, 6, bp, 16, alpha, beta, c, ldc);
}

/* A and B at strides (dt__gemm_macro): rows 6 or 4. */
DT__GEMM_AVX2 DTRAIN_PRIVATE void dt__gemm_micro_avx2_ua(int rows, int64_t kc, const float *DT__RESTRICT a,
                                                         int64_t ars, int64_t aks, const float *DT__RESTRICT bp,
                                                         int64_t bks, float alpha, float beta, float *DT__RESTRICT c,
                                                         int64_t ldc) {
  if (rows == 6) dt__gemm_tile_avx2(6, kc, a, ars, aks, bp, bks, alpha, beta, c, ldc);
  else dt__gemm_tile_avx2(4, kc, a, ars, aks, bp, bks, alpha, beta, c, ldc);
}

/* In-register transpose of 8 rows of 8: on return r[p] holds column p. */
#define DT__AVX_T8(r)                                                                          \
  do {                                                                                         \
    __m256 t0_ = _mm256_unpacklo_ps(r[0], r[1]), t1_ = _mm256_unpackhi_ps(r[0], r[1]);         \
    __m256 t2_ = _mm256_unpacklo_ps(r[2], r[3]), t3_ = _mm256_unpackhi_ps(r[2], r[3]);         \
    __m256 t4_ = _mm256_unpacklo_ps(r[4], r[5]), t5_ = _mm256_unpackhi_ps(r[4], r[5]);         \
    __m256 t6_ = _mm256_unpacklo_ps(r[6], r[7]), t7_ = _mm256_unpackhi_ps(r[6], r[7]);         \
    __m256 u0_ = _mm256_shuffle_ps(t0_, t2_, 0x44), u1_ = _mm256_shuffle_ps(t0_, t2_, 0xEE);   \
    __m256 u2_ = _mm256_shuffle_ps(t1_, t3_, 0x44), u3_ = _mm256_shuffle_ps(t1_, t3_, 0xEE);   \
    __m256 u4_ = _mm256_shuffle_ps(t4_, t6_, 0x44), u5_ = _mm256_shuffle_ps(t4_, t6_, 0xEE);   \
    __m256 u6_ = _mm256_shuffle_ps(t5_, t7_, 0x44), u7_ = _mm256_shuffle_ps(t5_, t7_, 0xEE);   \
    r[0] = _mm256_permute2f128_ps(u0_, u4_, 0x20);                                             \
    r[1] = _mm256_permute2f128_ps(u1_, u5_, 0x20);                                             \
    r[2] = _mm256_permute2f128_ps(u2_, u6_, 0x20);                                             \
    r[3] = _mm256_permute2f128_ps(u3_, u7_, 0x20);                                             \
    r[4] = _mm256_permute2f128_ps(u0_, u4_, 0x31);                                             \
    r[5] = _mm256_permute2f128_ps(u1_, u5_, 0x31);                                             \
    r[6] = _mm256_permute2f128_ps(u2_, u6_, 0x31);                                             \
    r[7] = _mm256_permute2f128_ps(u3_, u7_, 0x31);                                             \
  } while (0)

/* 6-tall A slivers. Untransposed A: 8 columns of 6 rows at a time through an
 * 8x8 transpose; each 6-float column is stored with an 8-float store whose
 * 2 extra zeros the next store overwrites (the panel has slack for the last).
 * The rows are prefetched by hand: the loads of a training batch fresh from
 * memory were 10% of the MLP's batch-256 step (Zen 5; 4-5% faster with it).
 * The sliver after next is fetched into L2 as well: in a large product each
 * of A's rows is a page of its own, and packing A took 6.2% of sgemm
 * n=2048's time by perf, 3.9% with it. */
DT__GEMM_AVX2 DTRAIN_PRIVATE void dt__gemm_pack_a_avx2(int trans, const float *a, int64_t lda, int64_t i0,
                                                       int64_t p0, int64_t mc, int64_t kc, float *ap) {
  int64_t full = mc - mc % 6;
  if (!trans) {
    for (int64_t s = 0; s < full; s += 6, ap += 6 * kc) {
      const float *src = a + (i0 + s) * lda + p0;
      int64_t p = 0;
      for (; p + 8 <= kc; p += 8) {
        __m256 r[8];
        if ((p & 15) == 0) /* four lines ahead: A is often a batch fresh from memory; and the */
          for (int i = 0; i < 6; i++) { /* sliver after next into L2 (its rows far apart: one page each) */
            _mm_prefetch((const char *)(src + i * lda + p + 64), _MM_HINT_T0);
            if (s + 18 <= full) _mm_prefetch((const char *)(src + (i + 12) * lda + p), _MM_HINT_T1);
          }
        for (int i = 0; i < 6; i++) r[i] = _mm256_loadu_ps(src + i * lda + p);
        r[6] = r[7] = _mm256_setzero_ps();
        DT__AVX_T8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(ap + (p + i) * 6, r[i]);
      }
      for (; p < kc; p++)
        for (int i = 0; i < 6; i++) ap[p * 6 + i] = src[i * lda + p];
    }
  } else {
    for (int64_t s = 0; s < full; s += 6, ap += 6 * kc) {
      const float *src = a + p0 * lda + i0 + s;
      for (int64_t p = 0; p < kc; p++) {
        const float *x = src + p * lda;
        float *d = ap + p * 6;
        _mm_storeu_ps(d, _mm_loadu_ps(x));
        d[4] = x[4];
        d[5] = x[5];
      }
    }
  }
  if (full < mc) dt__gemm_pack_a_n(6, trans, a, lda, i0 + full, p0, mc - full, kc, ap);
}

/* w-wide B slivers (16: the AVX2 path, 32: the AVX-512 one). Transposed B
 * (rows of op(B)^T contiguous in p): w/8 8x8 transposes per 8 values of p,
 * each row's cache line two ahead prefetched by hand (a linear layer's
 * weights read this way from memory: the CNN's 3136-wide layer 4% faster). */
DT__GEMM_AVX2 static void dt__gemm_pack_b_avx2w(int w, int trans, const float *b, int64_t ldb, int64_t p0,
                                                int64_t j0, int64_t kc, int64_t nc, float *bp) {
  int64_t full = nc - nc % w;
  if (!trans) {
    /* Eight slivers at a time, row by row: each row of the group one run of
     * 8w floats through memory, the row two ahead prefetched by hand. (One
     * sliver at a time, its rows were 256 streams of 4w bytes: the CNN's
     * 64x3136x1024 dx product, its weights cold, ran at 135-147 GFLOP/s on
     * a Zen 5, 175 this way; whole rows at once were as fast cold but 5-10%
     * slower warm: the 24 slivers' rows, 32 KiB apart, share an L1 set.) */
    for (int64_t g = 0; g < full; g += 8 * w) {
      int64_t ge = DT__MIN(g + 8 * w, full);
      for (int64_t p = 0; p < kc; p++) {
        const float *src = b + (p0 + p) * ldb + j0;
        if (p + 2 < kc)
          for (int64_t s = g; s < ge; s += 16) _mm_prefetch((const char *)(src + 2 * ldb + s), _MM_HINT_T0);
        for (int64_t s = g; s < ge; s += w)
          for (int h = 0; h < w; h += 8) _mm256_storeu_ps(bp + s * kc + p * w + h, _mm256_loadu_ps(src + s + h));
      }
    }
    bp += full * kc;
  } else {
    for (int64_t s = 0; s < full; s += w, bp += w * kc) {
      const float *src = b + (j0 + s) * ldb + p0;
      int64_t p = 0;
      for (; p + 8 <= kc; p += 8) {
        for (int h = 0; h < w; h += 8) {
          __m256 r[8];
          if ((p & 15) == 0) /* w rows at once are more streams than the prefetcher follows */
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(src + (h + i) * ldb + p + 32), _MM_HINT_T0);
          for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (h + i) * ldb + p);
          DT__AVX_T8(r);
          for (int i = 0; i < 8; i++) _mm256_storeu_ps(bp + (p + i) * w + h, r[i]);
        }
      }
      for (; p < kc; p++)
        for (int j = 0; j < w; j++) bp[p * w + j] = src[j * ldb + p];
    }
  }
  if (full < nc) dt__gemm_pack_b_n(w, trans, b, ldb, p0, j0 + full, kc, nc - full, bp);
}
DTRAIN_PRIVATE void dt__gemm_pack_b_avx2(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                         int64_t kc, int64_t nc, float *bp) {
  dt__gemm_pack_b_avx2w(16, trans, b, ldb, p0, j0, kc, nc, bp);
}
DTRAIN_PRIVATE void dt__gemm_pack_b_avx512(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                           int64_t kc, int64_t nc, float *bp) {
  if (!trans) {
    dt__gemm_pack_b_avx2w(32, trans, b, ldb, p0, j0, kc, nc, bp);
    return;
  }
  int64_t full = nc - nc % 32;
  dt__gemm_pack_bt_avx512(b, ldb, p0, j0, kc, full, bp);
  if (full < nc) dt__gemm_pack_b_n(32, trans, b, ldb, p0, j0 + full, kc, nc - full, bp + full * kc);
}

#undef DT__AVX_T8
#undef DT__AVX_FMA2
#undef DT__AVX_STORE

#undef DT__GEMM_AVX2
#endif /* DT__X86_SIMD */
