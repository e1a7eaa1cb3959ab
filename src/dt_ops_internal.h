/* ===========================================================================
 * dt_ops_internal.h -- the device twins of the ops (ops layer)
 * ===========================================================================
 * Private: part of the implementation, not of the API. See dt_internal.h.
 */
#ifndef DTRAIN_OPS_INTERNAL_H
#define DTRAIN_OPS_INTERNAL_H

#include "dt_tensor_internal.h"
#include "dt_ops.h"

/* ---- device twins of the ops (dt_device_ops.c, dt_device_nn.c: ops layer) -----------
 * Every op that has a device path calls its dt__dev_* twin right after
 * dt__begin when g->device is set; dt__begin already refused (with
 * DTRAIN_ERR_UNSUPPORTED) every op that has none. */
/* dt_device_ops.c: elementwise, reductions, shapes */
DTRAIN_PRIVATE dt_tensor *dt__dev_binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op);
/* fn: a dt_map_fn of DT__MAP_LIST (dt_maps.h); checks the op's domain as the CPU op does */
DTRAIN_PRIVATE dt_tensor *dt__dev_map(dt_graph *g, dt_tensor *x, int fn, float s, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_axis(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t outer,
                                              int64_t len, int64_t inner, int mean, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_transpose(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t batch,
                                            int64_t m, int64_t n);
DTRAIN_PRIVATE dt_tensor *dt__dev_permute(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const int64_t *perm);
DTRAIN_PRIVATE dt_tensor *dt__dev_slice(dt_graph *g, dt_tensor *x, const char *op, int ndim, const int64_t *shape,
                                        int64_t outer, int64_t dim, int64_t inner, int64_t start, int64_t len);
DTRAIN_PRIVATE dt_tensor *dt__dev_concat(dt_graph *g, dt_tensor *const *xs, int n, dt_tensor **list, int ndim,
                                         const int64_t *shape, int64_t outer, int64_t inner, int ax);
DTRAIN_PRIVATE dt_tensor *dt__dev_causal_mask(dt_graph *g, dt_tensor *x, int64_t t);
/* dt_device_nn.c: GEMM-based, losses, norms, conv, pooling */
DTRAIN_PRIVATE dt_tensor *dt__dev_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int64_t rows,
                                         int64_t in, int64_t out, int ndim, const int64_t *shape);
DTRAIN_PRIVATE dt_tensor *dt__dev_bmm(dt_graph *g, dt_tensor *y, dt_tensor *a, dt_tensor *b, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_softmax(dt_graph *g, dt_tensor *x, int ax, int is_log, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_xent(dt_graph *g, dt_tensor *x, const int32_t *labels, int64_t rows, int64_t c);
DTRAIN_PRIVATE dt_tensor *dt__dev_mse(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_PRIVATE dt_tensor *dt__dev_dropout(dt_graph *g, dt_tensor *x, float p);
DTRAIN_PRIVATE dt_tensor *dt__dev_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps,
                                             int64_t rows, int64_t d);
DTRAIN_PRIVATE dt_tensor *dt__dev_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, int64_t d);
DTRAIN_PRIVATE dt_tensor *dt__dev_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                             dt_tensor *running_mean, dt_tensor *running_var, float momentum,
                                             float eps, int64_t nb, int64_t c, int64_t hw, int batch);
DTRAIN_PRIVATE dt_tensor *dt__dev_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding);
DTRAIN_PRIVATE dt_tensor *dt__dev_pool(dt_graph *g, dt_tensor *x, int kernel, int stride, int is_max, const char *op);

/* ---- instruction set (dt_gemm.c) ----------------------------------------------
 * The vector width kernels with their own SIMD paths use: the GEMM's path
 * (the best the CPU has, or DTRAIN_ISA / dt_sgemm_use_isa). BASE: the
 * build's baseline (SSE2 on x86-64, NEON on aarch64, or plain C). */
#define DT__SIMD_BASE 0
#define DT__SIMD_AVX2 1   /* AVX2 + FMA (kernels may use AVX only) */
#define DT__SIMD_AVX512 2 /* AVX-512F */
DTRAIN_PRIVATE int dt__simd_level(void);

/* dt_gemm_neon.c: the NEON path's micro-kernel (aarch64) */
#if !defined(DTRAIN_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
#  define DT__NEON_GEMM 1
DTRAIN_PRIVATE void dt__gemm_micro_neon(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                        float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
#endif

/* ---- GEMM with an epilogue (dt_gemm.c; dt_linear(_relu), dt_conv2d(_relu)) --------
 * dt__sgemm_epi: C = op(A) @ op(B) (alpha 1, beta 0), with bias [n] added to
 * every row (a linear layer's) or row_bias [m] to every column (a
 * convolution's, one value per output channel; at most one of the two)
 * and/or ReLU applied on the way, tile by tile while each tile of C is in
 * L1 (bias before its first k block, ReLU after its last), not in passes
 * over C. Bit for bit what C filled with the bias, dt_sgemm with beta 1 and
 * dt_relu_inplace give. dt__relu_rows: ReLU (x <= 0 -> +0, NaN kept, as
 * dt_relu) over rows x cols at stride ld (dt_ops_elem.c). The device paths
 * compute the fused ops' ReLU as a second kernel. */
typedef struct dt__gemm_epi {
  const float *bias; /* [n] or NULL */
  int relu;
  const float *row_bias; /* [m] or NULL (then bias is NULL) */
} dt__gemm_epi;
DTRAIN_PRIVATE void dt__sgemm_epi(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                                  int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc,
                                  const dt__gemm_epi *ep);
DTRAIN_PRIVATE void dt__relu_rows(float *c, int64_t rows, int64_t cols, int64_t ld);
/* go [rows, cols] masked in place where y <= 0 (dt_relu_inplace's backward),
 * and each masked row added into gb [cols] in row order, when gb is not NULL
 * (dt_ops_elem.c). */
DTRAIN_PRIVATE void dt__relu_mask_rows(float *go, const float *y, int64_t rows, int64_t cols, float *gb);

/* dt_gemm_pack.c: the portable packing into mr-tall A / nr-wide B slivers (zero
 * past mc / nc), which the SIMD packers use for the odd slivers at the edges. */
DTRAIN_PRIVATE void dt__gemm_pack_a_n(int mr, int trans, const float *a, int64_t lda, int64_t i0, int64_t p0,
                                      int64_t mc, int64_t kc, float *DT__RESTRICT ap);
DTRAIN_PRIVATE void dt__gemm_pack_b_n(int nr, int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                      int64_t kc, int64_t nc, float *DT__RESTRICT bp);

/* ---- GEMM (dt_gemm.c, dt_gemm_avx2.c, dt_gemm_avx512.c) -----------------------------------------
 * dt_sgemm is the public entry; ops call it directly. DT__X86_SIMD: x86-64
 * with GCC or clang, where the AVX2 and AVX-512 kernels are compiled (with
 * function attributes) and picked at run time. */
#ifdef DT__CPU_X86 /* dt_internal.h */
#  define DT__X86_SIMD 1
DTRAIN_PRIVATE void dt__gemm_micro_avx512(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                          float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_micro4_avx512(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                           float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_micro_avx512_ua(int rows, int64_t kc, const float *DT__RESTRICT a, int64_t ars,
                                             int64_t aks, const float *DT__RESTRICT bp, int64_t bks, float alpha,
                                             float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_edge16_avx512(int rows, int64_t kc, const float *DT__RESTRICT a, int64_t ars,
                                           int64_t aks, const float *DT__RESTRICT bp, int64_t bks,
                                           float *DT__RESTRICT t, int64_t ldt);
/* dt_gemm_avx2.c: the AVX2+FMA tile and the x86 packing (dt_gemm.c's path table) */
DTRAIN_PRIVATE void dt__gemm_micro_avx2(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                        float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_micro4_avx2(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                         float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_micro_avx2_ua(int rows, int64_t kc, const float *DT__RESTRICT a, int64_t ars,
                                           int64_t aks, const float *DT__RESTRICT bp, int64_t bks, float alpha,
                                           float beta, float *DT__RESTRICT c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_pack_a_avx2(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                                         int64_t kc, float *ap);
DTRAIN_PRIVATE void dt__gemm_pack_b_avx2(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                                         int64_t nc, float *bp);
DTRAIN_PRIVATE void dt__gemm_pack_b_avx512(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                           int64_t kc, int64_t nc, float *bp);
/* dt_gemm_dot.c: the unpacked dot-product kernels (A @ B^T) */
DTRAIN_PRIVATE void dt__gemm_dot_avx2(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                                      const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_dot_avx512(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                                        const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
DTRAIN_PRIVATE void dt__gemm_pack_bt_avx512(const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                                            int64_t full, float *bp);
/* dt_gemm_bf16.c: the bfloat16 path (dt_set_matmul_precision) */
DTRAIN_PRIVATE void dt__gemm_pack_a_bf16(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                                         int64_t kc, float *ap);
DTRAIN_PRIVATE void dt__gemm_pack_b_bf16(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                                         int64_t nc, float *bp);
DTRAIN_PRIVATE void dt__gemm_micro_bf16(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                        float alpha, float beta, float *DT__RESTRICT c, int64_t ldc);
/* One row r of a 6x32 AVX-512 tile into C (dt_gemm_avx512.c, dt_gemm_bf16.c):
 * c[r] = alpha*acc (+ beta*c[r]) as the AVX2 path stores, from the
 * accumulators c<r>0, c<r>1 and va = alpha, vb = beta broadcast; the caller
 * has c, ldc and beta in scope and is compiled for AVX-512F. */
#define DT__GEMM_Z_STORE(r)                                                                                \
  do {                                                                                                \
    float *cr_ = c + (r) * ldc;                                                                       \
    if (beta == 0.0f) {                                                                               \
      _mm512_storeu_ps(cr_, _mm512_mul_ps(va, c##r##0));                                              \
      _mm512_storeu_ps(cr_ + 16, _mm512_mul_ps(va, c##r##1));                                         \
    } else if (beta == 1.0f) {                                                                        \
      _mm512_storeu_ps(cr_, _mm512_fmadd_ps(va, c##r##0, _mm512_loadu_ps(cr_)));                      \
      _mm512_storeu_ps(cr_ + 16, _mm512_fmadd_ps(va, c##r##1, _mm512_loadu_ps(cr_ + 16)));            \
    } else {                                                                                          \
      _mm512_storeu_ps(cr_, _mm512_fmadd_ps(va, c##r##0, _mm512_mul_ps(vb, _mm512_loadu_ps(cr_))));   \
      _mm512_storeu_ps(cr_ + 16,                                                                      \
                       _mm512_fmadd_ps(va, c##r##1, _mm512_mul_ps(vb, _mm512_loadu_ps(cr_ + 16)))); \
    }                                                                                                 \
  } while (0)
#endif

#endif /* DTRAIN_OPS_INTERNAL_H */
