/* ===========================================================================
 * dt_gemm.c -- single-precision GEMM
 * ===========================================================================
 * C = alpha * op(A) @ op(B) + beta * C, row-major, op(X) = X or X^T.
 *
 * The classic Goto/BLIS structure, in portable C:
 *
 *   for jc in n by NC:                      columns of C and B
 *     for pc in k by KC:                    the shared dimension
 *       pack op(B)[pc.., jc..] -> bp        KC x NC, NR-wide slivers
 *       for ic in m by MC:                  rows of C and A
 *         pack op(A)[ic.., pc..] -> ap      MC x KC, MR-tall slivers
 *         for jr, ir: micro-kernel          one MR x NR tile of C
 *
 * Packing copies each block into the order the micro-kernel reads it
 * (contiguous, zero-padded to whole tiles), so the transpose flags and the
 * leading dimensions only matter in the two packing routines. The
 * micro-kernel keeps an MR x NR accumulator tile in a local array that
 * gcc and clang keep in vector registers at -O2; partial tiles at the
 * edges go through a small buffer. The panels are automatic arrays of
 * fixed size (about 200 KiB of stack), so a call allocates nothing and
 * may run on any thread.
 *
 * Determinism: the blocking depends only on (m, n, k), and every element
 * of C is summed in the same order on every call: over k in KC blocks,
 * each block summed in increasing p.
 */
#include "dt_internal.h"
#ifdef DTRAIN_USE_CBLAS
#include <cblas.h>
#endif

/* Tile and block sizes. MR x NR is the register tile: 12 vector
 * accumulators, whether a vector holds 4 floats (SSE, NEON) or 8 (AVX).
 * A B sliver (KC x NR) should stay in L1 and the packed A block (MC x KC)
 * in L2. */
#define DT__GEMM_MR 6
#if defined(__AVX__)
#  define DT__GEMM_NR 16
#else
#  define DT__GEMM_NR 8
#endif
#define DT__GEMM_KC 256
#define DT__GEMM_MC 72
#define DT__GEMM_NC 128

/* Loop hints for the micro-kernel, so that the accumulator tile stays in
 * vector registers. gcc needs the loops over the rows of the tile fully
 * unrolled (DT__GEMM_UNROLL); clang unrolls and vectorises those loops best
 * on its own, but when it also unrolls the loop over k (as it does when
 * tuning for some CPUs, e.g. -march=znver3) the tile falls back to memory
 * and speed drops by 2.5x, hence DT__GEMM_KLOOP. */
#if defined(__clang__)
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP _Pragma("clang loop unroll(disable)")
#elif defined(__GNUC__) && __GNUC__ >= 8
#  define DT__GEMM_UNROLL _Pragma("GCC unroll 16")
#  define DT__GEMM_KLOOP
#else
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP
#endif

#if DT__GEMM_MC % DT__GEMM_MR != 0 || DT__GEMM_NC % DT__GEMM_NR != 0
#  error "dt_gemm.c: MC must be a multiple of MR and NC of NR"
#endif

/* Pack rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) into MR-tall slivers:
 * sliver s holds ap[s*MR*kc + p*MR + r] = op(A)[i0 + s*MR + r][p0 + p],
 * zero for rows past mc. op(A)[i][p] is a[i*lda + p], or a[p*lda + i]
 * when transposed. */
static void dt__gemm_pack_a(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                            int64_t kc, float *DT__RESTRICT ap) {
  for (int64_t s = 0; s < mc; s += DT__GEMM_MR) {
    int64_t rows = DT__MIN(DT__GEMM_MR, mc - s);
    if (!trans) {
      for (int64_t r = 0; r < rows; r++) {
        const float *src = a + (i0 + s + r) * lda + p0;
        for (int64_t p = 0; p < kc; p++) ap[p * DT__GEMM_MR + r] = src[p];
      }
    } else {
      for (int64_t p = 0; p < kc; p++) {
        const float *src = a + (p0 + p) * lda + i0 + s;
        for (int64_t r = 0; r < rows; r++) ap[p * DT__GEMM_MR + r] = src[r];
      }
    }
    for (int64_t r = rows; r < DT__GEMM_MR; r++)
      for (int64_t p = 0; p < kc; p++) ap[p * DT__GEMM_MR + r] = 0.0f;
    ap += DT__GEMM_MR * kc;
  }
}

/* Pack rows [p0, p0+kc) x cols [j0, j0+nc) of op(B) into NR-wide slivers:
 * bp[s*NR*kc + p*NR + j] = op(B)[p0 + p][j0 + s*NR + j], zero past nc.
 * op(B)[p][j] is b[p*ldb + j], or b[j*ldb + p] when transposed. */
static void dt__gemm_pack_b(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                            int64_t nc, float *DT__RESTRICT bp) {
  for (int64_t s = 0; s < nc; s += DT__GEMM_NR) {
    int64_t cols = DT__MIN(DT__GEMM_NR, nc - s);
    if (!trans) {
      for (int64_t p = 0; p < kc; p++) {
        const float *src = b + (p0 + p) * ldb + j0 + s;
        float *dst = bp + p * DT__GEMM_NR;
        int64_t j = 0;
        for (; j < cols; j++) dst[j] = src[j];
        for (; j < DT__GEMM_NR; j++) dst[j] = 0.0f;
      }
    } else {
      for (int64_t j = 0; j < cols; j++) {
        const float *src = b + (j0 + s + j) * ldb + p0;
        for (int64_t p = 0; p < kc; p++) bp[p * DT__GEMM_NR + j] = src[p];
      }
      for (int64_t j = cols; j < DT__GEMM_NR; j++)
        for (int64_t p = 0; p < kc; p++) bp[p * DT__GEMM_NR + j] = 0.0f;
    }
    bp += DT__GEMM_NR * kc;
  }
}

/* The micro-kernel: one MR x NR tile.
 *   C[r][j] = alpha * sum_p ap[p*MR + r] * bp[p*NR + j]  + beta * C[r][j]
 * C is not read when beta == 0. Accumulates in increasing p. */
static void dt__gemm_micro(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                           float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  float acc[DT__GEMM_MR][DT__GEMM_NR];
  DT__GEMM_UNROLL
  for (int r = 0; r < DT__GEMM_MR; r++)
    for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] = 0.0f;
  DT__GEMM_KLOOP
  for (int64_t p = 0; p < kc; p++) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++) {
      float av = ap[r];
      for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] += av * bp[j];
    }
    ap += DT__GEMM_MR;
    bp += DT__GEMM_NR;
  }
  if (beta == 0.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j];
  } else if (beta == 1.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] += alpha * acc[r][j];
  } else {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j] + beta * c[r * ldc + j];
  }
}

/* A partial tile (mr < MR or nr < NR): run the kernel into a local tile,
 * then apply it to the valid mr x nr corner of C with the same arithmetic. */
static void dt__gemm_micro_edge(int64_t kc, const float *ap, const float *bp, float alpha, float beta, float *c,
                                int64_t ldc, int64_t mr, int64_t nr) {
  float t[DT__GEMM_MR * DT__GEMM_NR];
  dt__gemm_micro(kc, ap, bp, 1.0f, 0.0f, t, DT__GEMM_NR);
  for (int64_t r = 0; r < mr; r++) {
    float *cr = c + r * ldc;
    const float *tr = t + r * DT__GEMM_NR;
    if (beta == 0.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j];
    else if (beta == 1.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] += alpha * tr[j];
    else
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j] + beta * cr[j];
  }
}

/* C = beta * C over m x n (C not read when beta == 0): the k == 0 or
 * alpha == 0 case, where op(A) @ op(B) contributes nothing. */
static void dt__gemm_scale(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    float *ci = c + i * ldc;
    if (beta == 0.0f)
      for (int64_t j = 0; j < n; j++) ci[j] = 0.0f;
    else if (beta != 1.0f)
      for (int64_t j = 0; j < n; j++) ci[j] *= beta;
  }
}

DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
#ifdef DTRAIN_USE_CBLAS
  /* BLAS, like this kernel, never reads C when beta == 0. Sizes beyond int
   * (not reachable with the arena's limits) fall through to the C kernel. */
  if (m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX) {
    if (k <= 0) {
      dt__gemm_scale(m, n, beta, c, ldc);
      return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)m,
                (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
    return;
  }
#endif
  if (k <= 0 || alpha == 0.0f) {
    dt__gemm_scale(m, n, beta, c, ldc);
    return;
  }
  /* The packed panels, on the stack, aligned by hand to 64 bytes. */
  float abuf[DT__GEMM_MC * DT__GEMM_KC + 16];
  float bbuf[DT__GEMM_KC * DT__GEMM_NC + 16];
  float *ap = abuf + ((16 - ((uintptr_t)abuf / sizeof(float)) % 16) % 16);
  float *bp = bbuf + ((16 - ((uintptr_t)bbuf / sizeof(float)) % 16) % 16);

  for (int64_t jc = 0; jc < n; jc += DT__GEMM_NC) {
    int64_t nc = DT__MIN(DT__GEMM_NC, n - jc);
    for (int64_t pc = 0; pc < k; pc += DT__GEMM_KC) {
      int64_t kc = DT__MIN(DT__GEMM_KC, k - pc);
      float beta_blk = pc == 0 ? beta : 1.0f; /* later k blocks add to C */
      dt__gemm_pack_b(trans_b, b, ldb, pc, jc, kc, nc, bp);
      for (int64_t ic = 0; ic < m; ic += DT__GEMM_MC) {
        int64_t mc = DT__MIN(DT__GEMM_MC, m - ic);
        dt__gemm_pack_a(trans_a, a, lda, ic, pc, mc, kc, ap);
        for (int64_t jr = 0; jr < nc; jr += DT__GEMM_NR) {
          int64_t nr = DT__MIN(DT__GEMM_NR, nc - jr);
          const float *bs = bp + jr * kc;
          for (int64_t ir = 0; ir < mc; ir += DT__GEMM_MR) {
            int64_t mr = DT__MIN(DT__GEMM_MR, mc - ir);
            const float *as = ap + ir * kc;
            float *cs = c + (ic + ir) * ldc + jc + jr;
            if (mr == DT__GEMM_MR && nr == DT__GEMM_NR)
              dt__gemm_micro(kc, as, bs, alpha, beta_blk, cs, ldc);
            else
              dt__gemm_micro_edge(kc, as, bs, alpha, beta_blk, cs, ldc, mr, nr);
          }
        }
      }
    }
  }
}

#undef DT__GEMM_MR
#undef DT__GEMM_NR
#undef DT__GEMM_KC
#undef DT__GEMM_MC
#undef DT__GEMM_NC
#undef DT__GEMM_UNROLL
#undef DT__GEMM_KLOOP
