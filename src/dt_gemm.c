/* ===========================================================================
 * dt_gemm.c -- single-precision GEMM
 * ===========================================================================
 */
#include "dt_internal.h"

DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    for (int64_t j = 0; j < n; j++) {
      float s = 0.0f;
      for (int64_t p = 0; p < k; p++) {
        float av = trans_a ? a[p * lda + i] : a[i * lda + p];
        float bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        s += av * bv;
      }
      c[i * ldc + j] = alpha * s + (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]);
    }
  }
}
