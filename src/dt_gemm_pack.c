/* ===========================================================================
 * dt_gemm_pack.c -- dt_sgemm's portable packing (ops layer)
 * ===========================================================================
 * Copies of op(A) and op(B) blocks into the order the micro-kernels read
 * (dt_gemm.c's header: mr-tall A slivers, nr-wide B slivers, zero-padded to
 * whole tiles), in plain C for any tile size: the portable and NEON paths'
 * packing, and the odd slivers at the edges for the x86 packers
 * (dt_gemm_avx2.c), which both dt_gemm.c and dt_gemm_avx2.c call, hence a
 * file of their own below both.
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

/* Generic packing for an mr-tall A sliver layout. op(A)[i][p] is a[i*lda + p],
 * or a[p*lda + i] when transposed. */
DTRAIN_PRIVATE void dt__gemm_pack_a_n(int mr, int trans, const float *a, int64_t lda, int64_t i0, int64_t p0,
                                      int64_t mc, int64_t kc, float *DT__RESTRICT ap) {
  for (int64_t s = 0; s < mc; s += mr) {
    int64_t rows = DT__MIN(mr, mc - s);
    if (!trans) {
      for (int64_t r = 0; r < rows; r++) {
        const float *src = a + (i0 + s + r) * lda + p0;
        for (int64_t p = 0; p < kc; p++) ap[p * mr + r] = src[p];
      }
    } else {
      for (int64_t p = 0; p < kc; p++) {
        const float *src = a + (p0 + p) * lda + i0 + s;
        for (int64_t r = 0; r < rows; r++) ap[p * mr + r] = src[r];
      }
    }
    for (int64_t r = rows; r < mr; r++)
      for (int64_t p = 0; p < kc; p++) ap[p * mr + r] = 0.0f;
    ap += mr * kc;
  }
}

/* Generic packing for an nr-wide B sliver layout. op(B)[p][j] is
 * b[p*ldb + j], or b[j*ldb + p] when transposed: an nr-wide B sliver is an
 * nr-tall sliver of op(B)^T, so this is A's packing with the transpose
 * flipped (the same stores, zero padding included). */
DTRAIN_PRIVATE void dt__gemm_pack_b_n(int nr, int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                      int64_t kc, int64_t nc, float *DT__RESTRICT bp) {
  dt__gemm_pack_a_n(nr, !trans, b, ldb, j0, p0, nc, kc, bp);
}
