/* ===========================================================================
 * dt_gemm_neon.c -- the NEON micro-kernel of dt_sgemm (ops layer)
 * ===========================================================================
 * The "neon" path of dt_gemm.c (aarch64): an 8x12 tile, 24 q-register
 * accumulators, three B vectors and two A vectors per k step, lane FMAs.
 * The slivers are packed by dt_gemm.c's generic routines (8-tall A,
 * 12-wide B).
 */
#include "dt_internal.h"
#include "dt_ops_internal.h"

#ifdef DT__NEON_GEMM /* dt_ops_internal.h */
#  include <arm_neon.h>

DTRAIN_PRIVATE void dt__gemm_micro_neon(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                        float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  float32x4_t acc[8][3];
  for (int r = 0; r < 8; r++)
    for (int j = 0; j < 3; j++) acc[r][j] = vdupq_n_f32(0.0f);
  for (int64_t p = 0; p < kc; p++) {
    float32x4_t a0 = vld1q_f32(ap), a1 = vld1q_f32(ap + 4);
    float32x4_t b0 = vld1q_f32(bp), b1 = vld1q_f32(bp + 4), b2 = vld1q_f32(bp + 8);
#define DT__NEON_ROW(r, av, lane)                         \
  acc[r][0] = vfmaq_laneq_f32(acc[r][0], b0, av, lane); \
  acc[r][1] = vfmaq_laneq_f32(acc[r][1], b1, av, lane); \
  acc[r][2] = vfmaq_laneq_f32(acc[r][2], b2, av, lane)
    DT__NEON_ROW(0, a0, 0);
    DT__NEON_ROW(1, a0, 1);
    DT__NEON_ROW(2, a0, 2);
    DT__NEON_ROW(3, a0, 3);
    DT__NEON_ROW(4, a1, 0);
    DT__NEON_ROW(5, a1, 1);
    DT__NEON_ROW(6, a1, 2);
    DT__NEON_ROW(7, a1, 3);
#undef DT__NEON_ROW
    ap += 8;
    bp += 12;
  }
  float32x4_t va = vdupq_n_f32(alpha), vb = vdupq_n_f32(beta);
  for (int r = 0; r < 8; r++) {
    float *cr = c + r * ldc;
    for (int j = 0; j < 3; j++) {
      float32x4_t v = vmulq_f32(va, acc[r][j]);
      if (beta == 1.0f) v = vaddq_f32(v, vld1q_f32(cr + 4 * j));
      else if (beta != 0.0f) v = vfmaq_f32(v, vb, vld1q_f32(cr + 4 * j));
      vst1q_f32(cr + 4 * j, v);
    }
  }
}
#endif /* DT__NEON_GEMM */
