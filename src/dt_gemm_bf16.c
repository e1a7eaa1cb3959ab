/* ===========================================================================
 * dt_gemm_bf16.c -- dt_sgemm in bfloat16 with float accumulation (ops layer)
 * ===========================================================================
 * The "avx512-bf16" path of dt_gemm.c, taken by every dt_sgemm while
 * dt_set_matmul_precision(DTRAIN_MATMUL_BF16) is on (x86-64 CPUs with
 * AVX512_BF16 and AVX512BW): op(A) and op(B) are rounded to bfloat16 (round
 * to nearest even, as VCVTNE2PS2BF16 does: subnormals become signed zeros,
 * a NaN stays a quiet NaN) as they are packed, and the 6x32 micro-kernel
 * multiplies pairs of them with VDPBF16PS into float accumulators, two
 * products per lane and instruction; alpha, beta and C stay float. This is
 * what PyTorch's CPU autocast does to matrix products (bf16 inputs, float
 * accumulation, float weights kept by the optimizer).
 *
 * Packed layout (in the float panels of dt_gemm.c: one pair of bfloat16 per
 * float slot; slivers as far apart as on the float paths, each half full):
 * A slivers 6 tall,
 * ap[q*6 + r] = (op(A)[r][2q], op(A)[r][2q+1]); B slivers 32 wide,
 * bp[q*32 + j] = (op(B)[2q][j], op(B)[2q+1][j]); the first of a pair in the
 * low 16 bits, a missing second (odd k) zero.
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

#ifdef DT__X86_SIMD
#  include <immintrin.h>
#  if defined(__clang__)
#    define DT__GEMM_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))
#  else
#    define DT__GEMM_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma,tune=generic")))
#  endif

/* One float to bfloat16 bits, as VCVTNE2PS2BF16 rounds it. */
static uint32_t dt__bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0) return (u >> 16) & 0x8000u;                /* zero or subnormal: signed zero */
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu; /* NaN: quiet */
  return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;             /* nearest even (Inf stays Inf) */
}
static uint32_t dt__bf16_pair(float lo, float hi) { return dt__bf16_bits(lo) | dt__bf16_bits(hi) << 16; }
static void dt__bf16_store(float *slot, uint32_t pair) { memcpy(slot, &pair, sizeof pair); }

/* n floats of x (contiguous) as n/2 (rounded up) pairs into out[q*stride]:
 * 32 at a time by the instruction, the rest one by one the same way. */
DT__GEMM_BF16 static void dt__bf16_pairs(const float *x, int64_t n, float *out, int64_t stride) {
  int64_t i = 0;
  uint32_t t[16];
  for (; i + 32 <= n; i += 32) {
    __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512((void *)t, v);
    for (int q = 0; q < 16; q++) dt__bf16_store(out + (i / 2 + q) * stride, t[q]);
  }
  for (; i < n; i += 2) dt__bf16_store(out + (i / 2) * stride, dt__bf16_pair(x[i], i + 1 < n ? x[i + 1] : 0.0f));
}

/* op(X)[i][p] of a row-major X. */
static float dt__bf16_at(const float *x, int64_t ld, int trans, int64_t i, int64_t p) {
  return trans ? x[p * ld + i] : x[i * ld + p];
}

DT__GEMM_BF16 DTRAIN_PRIVATE void dt__gemm_pack_a_bf16(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0,
                                                       int64_t mc, int64_t kc, float *ap) {
  const int64_t q_n = (kc + 1) / 2;
  for (int64_t s = 0; s < mc; s += 6, ap += 6 * kc) { /* slivers 6*kc slots apart, as on the float paths */
    for (int64_t r = 0; r < 6; r++) {
      if (s + r >= mc) {
        for (int64_t q = 0; q < q_n; q++) dt__bf16_store(ap + q * 6 + r, 0);
      } else if (!trans) {
        dt__bf16_pairs(a + (i0 + s + r) * lda + p0, kc, ap + r, 6);
      } else {
        for (int64_t q = 0; q < q_n; q++) {
          int64_t p = 2 * q;
          float hi = p + 1 < kc ? dt__bf16_at(a, lda, 1, i0 + s + r, p0 + p + 1) : 0.0f;
          dt__bf16_store(ap + q * 6 + r, dt__bf16_pair(dt__bf16_at(a, lda, 1, i0 + s + r, p0 + p), hi));
        }
      }
    }
  }
}

DT__GEMM_BF16 DTRAIN_PRIVATE void dt__gemm_pack_b_bf16(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                                       int64_t kc, int64_t nc, float *bp) {
  const int64_t q_n = (kc + 1) / 2;
  /* pairs of rows to pairs per column: word t of the result takes word t/2
   * of x (even t) or of y (odd t); the upper half of the sliver from 16 on */
  __m512i lo_idx, hi_idx;
  {
    int16_t l[32], h[32];
    for (int t = 0; t < 16; t++) {
      l[2 * t] = (int16_t)t;
      l[2 * t + 1] = (int16_t)(32 + t);
      h[2 * t] = (int16_t)(16 + t);
      h[2 * t + 1] = (int16_t)(48 + t);
    }
    lo_idx = _mm512_loadu_si512((const void *)l);
    hi_idx = _mm512_loadu_si512((const void *)h);
  }
  for (int64_t s = 0; s < nc; s += 32, bp += 32 * kc) {
    int64_t cols = DT__MIN(32, nc - s);
    if (!trans && cols == 32) {
      for (int64_t q = 0; q < q_n; q++) {
        const float *r0 = b + (p0 + 2 * q) * ldb + j0 + s;
        __m512i x = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r0 + 16), _mm512_loadu_ps(r0)), y;
        if (2 * q + 1 < kc) y = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r0 + ldb + 16), _mm512_loadu_ps(r0 + ldb));
        else y = _mm512_setzero_si512();
        _mm512_storeu_si512((void *)(bp + q * 32), _mm512_permutex2var_epi16(x, lo_idx, y));
        _mm512_storeu_si512((void *)(bp + q * 32 + 16), _mm512_permutex2var_epi16(x, hi_idx, y));
      }
      continue;
    }
    for (int64_t j = 0; j < 32; j++) {
      if (j >= cols) {
        for (int64_t q = 0; q < q_n; q++) dt__bf16_store(bp + q * 32 + j, 0);
      } else if (trans) { /* column j of op(B) is a contiguous row of b */
        dt__bf16_pairs(b + (j0 + s + j) * ldb + p0, kc, bp + j, 32);
      } else {
        for (int64_t q = 0; q < q_n; q++) {
          int64_t p = 2 * q;
          float hi = p + 1 < kc ? b[(p0 + p + 1) * ldb + j0 + s + j] : 0.0f;
          dt__bf16_store(bp + q * 32 + j, dt__bf16_pair(b[(p0 + p) * ldb + j0 + s + j], hi));
        }
      }
    }
  }
}

#define DT__BF_ROW(r)                                                        \
  do {                                                                       \
    uint32_t w_;                                                             \
    memcpy(&w_, ap + (r), sizeof w_);                                        \
    __m512bh a_ = (__m512bh)_mm512_set1_epi32((int)w_);                      \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, a_, b0);                             \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, a_, b1);                             \
  } while (0)
/* kc counts floats of k (the panel holds (kc+1)/2 pairs). */
DT__GEMM_BF16 DTRAIN_PRIVATE void dt__gemm_micro_bf16(int64_t kc, const float *DT__RESTRICT ap,
                                                      const float *DT__RESTRICT bp, float alpha, float beta,
                                                      float *DT__RESTRICT c, int64_t ldc) {
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps();
  __m512 c11 = _mm512_setzero_ps(), c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps();
  __m512 c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps(), c40 = _mm512_setzero_ps();
  __m512 c41 = _mm512_setzero_ps(), c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
  for (int64_t q = 0, q_n = (kc + 1) / 2; q < q_n; q++) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)bp);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(bp + 16));
    DT__BF_ROW(0);
    DT__BF_ROW(1);
    DT__BF_ROW(2);
    DT__BF_ROW(3);
    DT__BF_ROW(4);
    DT__BF_ROW(5);
    ap += 6;
    bp += 32;
  }
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  DT__GEMM_Z_STORE(0);
  DT__GEMM_Z_STORE(1);
  DT__GEMM_Z_STORE(2);
  DT__GEMM_Z_STORE(3);
  DT__GEMM_Z_STORE(4);
  DT__GEMM_Z_STORE(5);
}

#undef DT__BF_ROW
#undef DT__GEMM_BF16
#endif /* DT__X86_SIMD */
