/* ===========================================================================
 * dt_ops.h -- differentiable operations
 * ===========================================================================
 * Every op takes the graph first, allocates its result in the graph's arena,
 * records itself on the tape (unless no-grad mode or no input needs a
 * gradient), and returns the result. On bad input an op records a sticky error
 * on the graph ("dt_add: shapes [2,3] and [4] cannot broadcast") and returns
 * NULL; an op given a NULL input or called on a failed graph returns NULL.
 *
 * Broadcasting follows NumPy: shapes are aligned at the right; a dimension of
 * 1 stretches. Axes may be negative (-1 is the last).
 */
#ifndef DTRAIN_OPS_H
#define DTRAIN_OPS_H

#include "dt_tensor.h"

DTRAIN_EXTERN_C_BEGIN

/* ---- elementwise, binary with broadcasting ---------------------------------- */
DTRAIN_API dt_tensor *dt_add(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_sub(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_mul(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_div(dt_graph *g, dt_tensor *a, dt_tensor *b);

/* ---- scalar ops ------------------------------------------------------------- */
DTRAIN_API dt_tensor *dt_add_scalar(dt_graph *g, dt_tensor *x, float s);  /* x + s */
DTRAIN_API dt_tensor *dt_mul_scalar(dt_graph *g, dt_tensor *x, float s);  /* x * s */
DTRAIN_API dt_tensor *dt_pow_scalar(dt_graph *g, dt_tensor *x, float p);  /* x ^ p (x > 0 unless p is an integer) */
DTRAIN_API dt_tensor *dt_rsub_scalar(dt_graph *g, dt_tensor *x, float s); /* s - x */

/* ---- elementwise, unary ----------------------------------------------------- */
DTRAIN_API dt_tensor *dt_neg(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_exp(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_log(dt_graph *g, dt_tensor *x);   /* error if any x <= 0 (a NaN gives NaN) */
DTRAIN_API dt_tensor *dt_sqrt(dt_graph *g, dt_tensor *x);  /* error if any x < 0 (a NaN gives NaN) */
DTRAIN_API dt_tensor *dt_relu(dt_graph *g, dt_tensor *x);
/* dt_relu in place (PyTorch's inplace=True), for memory: x's data becomes
 * relu(x) and is returned as a new tensor sharing it, and backward hands x
 * the result's gradient buffer, masked, instead of a second one. A CNN's
 * conv -> ReLU pairs so keep one activation and one gradient each instead of
 * two. Allowed on the output of dt_conv2d, dt_linear (dt_nn_*_forward),
 * dt_matmul, dt_bmm, dt_add or dt_sub (whose backward never reads its own
 * result) that no op has used yet; anything else fails with
 * DTRAIN_ERR_INVALID_ARG naming the reason. Afterwards x is spent: an op
 * given x fails (DTRAIN_ERR_STATE, "overwritten by dt_relu_inplace"), so a
 * stale x can never feed a wrong value in silently. Values and gradients are
 * dt_relu's, bit for bit; after backward the result's grad (shared with x)
 * holds x's gradient. On a device graph it computes out of place (same
 * results, and x is spent alike). */
DTRAIN_API dt_tensor *dt_relu_inplace(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_leaky_relu(dt_graph *g, dt_tensor *x, float slope);
DTRAIN_API dt_tensor *dt_sigmoid(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_tanh(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_gelu(dt_graph *g, dt_tensor *x);  /* tanh approximation */

/* ---- reductions ------------------------------------------------------------- */
DTRAIN_API dt_tensor *dt_sum(dt_graph *g, dt_tensor *x);   /* all elements -> scalar */
DTRAIN_API dt_tensor *dt_mean(dt_graph *g, dt_tensor *x);
/* Over one axis; keepdim keeps it as size 1. */
DTRAIN_API dt_tensor *dt_sum_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim);
DTRAIN_API dt_tensor *dt_mean_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim);

/* ---- shape ------------------------------------------------------------------ */
/* Same data, new shape (one dim may be -1: inferred). No copy. */
DTRAIN_API dt_tensor *dt_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape);
DTRAIN_API dt_tensor *dt_reshape2(dt_graph *g, dt_tensor *x, int64_t d0, int64_t d1);
DTRAIN_API dt_tensor *dt_flatten(dt_graph *g, dt_tensor *x); /* [N, ...] -> [N, rest] */
/* Swap the last two dims (rank >= 2). */
DTRAIN_API dt_tensor *dt_transpose(dt_graph *g, dt_tensor *x);
/* Output dim i is input dim perm[i]. */
DTRAIN_API dt_tensor *dt_permute(dt_graph *g, dt_tensor *x, const int *perm);
/* Join n tensors along `axis`; other dims must agree. */
DTRAIN_API dt_tensor *dt_concat(dt_graph *g, dt_tensor *const *xs, int n, int axis);
/* Elements [start, start+len) of `axis`. */
DTRAIN_API dt_tensor *dt_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len);
/* Split `axis` into n equal parts (size must divide); outs receives n tensors.
 * Returns the graph's error code (DTRAIN_OK on success). */
DTRAIN_API dt_result dt_split(dt_graph *g, dt_tensor *x, int axis, int n, dt_tensor **outs);

/* ---- linear algebra --------------------------------------------------------- */
/* [M,K] @ [K,N] -> [M,N]. */
DTRAIN_API dt_tensor *dt_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b);
/* Batched: [...,M,K] @ [...,K,N] -> [...,M,N]; leading dims equal, or b is 2-D
 * and shared by every batch. trans_b uses b as [...,N,K]. */
DTRAIN_API dt_tensor *dt_bmm(dt_graph *g, dt_tensor *a, dt_tensor *b, int trans_b);
/* x [N,in] @ w[out,in]^T + b[out] -> [N,out]; b may be NULL. (PyTorch layout.) */
DTRAIN_API dt_tensor *dt_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b);
/* relu(dt_linear(x, w, b)) in one op (b may be NULL): the GEMM adds the bias and applies the
 * ReLU to each tile of the result while it is in cache, and backward masks
 * the gradient and sums the bias gradient in one pass. Values and gradients
 * are those of dt_relu_inplace(g, dt_linear(g, x, w, b)) bit for bit; as
 * there, after backward the result's grad holds the gradient before the
 * ReLU (masked). */
DTRAIN_API dt_tensor *dt_linear_relu(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b);

/* ---- softmax and losses ----------------------------------------------------- */
DTRAIN_API dt_tensor *dt_softmax(dt_graph *g, dt_tensor *x, int axis);
DTRAIN_API dt_tensor *dt_log_softmax(dt_graph *g, dt_tensor *x, int axis);
/* Mean over rows of -log softmax(logits)[label]; logits [N,C] (or [...,C],
 * rows = product of leading dims), labels: one int32 per row in [0,C).
 * Labels are copied. Fused and numerically stable. */
DTRAIN_API dt_tensor *dt_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels);
/* Mean of (a - b)^2 over all elements; shapes equal. */
DTRAIN_API dt_tensor *dt_mse(dt_graph *g, dt_tensor *a, dt_tensor *b);

/* ---- metrics on plain arrays (no graph) ---------------------------------------- */
/* out[r] = the column of the largest value of row r of x [rows, cols]
 * (row-major; the first on ties; NaN never wins, a row of NaN gives 0).
 * DTRAIN_ERR_NULL_ARG / _INVALID_ARG (rows < 0, cols < 1 or > INT32_MAX). */
DTRAIN_API dt_result dt_argmax_rows(const float *x, int64_t rows, int64_t cols, int32_t *out);
/* How many rows of logits [rows, classes] have their argmax (as above) equal
 * to labels[r]: the correct predictions of a classifier (dt_fit_batch.correct;
 * divide by rows for the accuracy). A negative dt_result on error: a NULL
 * pointer, bad sizes, or a label outside [0, classes) (named with its row). */
DTRAIN_API int64_t dt_count_correct(const float *logits, const int32_t *labels, int64_t rows, int64_t classes);

/* ---- nn ----------------------------------------------------------------------- */
/* Rows of table [V,D] picked by n ids -> [n,D]; ids copied, each in [0,V). */
DTRAIN_API dt_tensor *dt_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n);
/* Inverted dropout with probability p from the graph's RNG; identity when the
 * graph is not training or p == 0. */
DTRAIN_API dt_tensor *dt_dropout(dt_graph *g, dt_tensor *x, float p);
/* Normalise over the last dim; gamma, beta [D] (either may be NULL). */
DTRAIN_API dt_tensor *dt_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps);
/* Over the channel dim 1 of [N,C] or [N,C,H,W]. Training: batch statistics,
 * and running_mean/running_var (each [C], may be NULL) are updated with
 * `momentum` (PyTorch convention, unbiased variance). Eval: running stats. */
DTRAIN_API dt_tensor *dt_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                    dt_tensor *running_mean, dt_tensor *running_var,
                                    float momentum, float eps);
/* For attention scores [..., T, T]: entries above the diagonal become -inf
 * (their softmax weight 0); gradient passes below and on the diagonal. */
DTRAIN_API dt_tensor *dt_causal_mask(dt_graph *g, dt_tensor *x);

/* ---- convolution and pooling (NCHW) ------------------------------------------- */
/* x [N,C,H,W], w [O,C,kh,kw], b [O] or NULL -> [N,O,Ho,Wo].
 * Ho = (H + 2*padding - kh)/stride + 1, likewise Wo. Computed as im2col +
 * GEMM, except 5x5 kernels with stride 1 and at least 8 channels in and out,
 * which use Winograd F(2x2,5x5) (2.8x fewer multiplications; results differ
 * from a direct sum by a few float roundings per unit of term magnitude).
 * Either way deterministic, and the same bits with any dt_set_threads. */
DTRAIN_API dt_tensor *dt_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                                int stride, int padding);
/* relu(dt_conv2d(...)) in one op (b may be NULL): the bias and the ReLU are
 * applied to each tile of the GEMM's result while it is in cache (or by
 * Winograd's output transform), and backward masks the gradient channel by
 * channel with the bias sum. Values and gradients are those of
 * dt_relu_inplace(g, dt_conv2d(...)) bit for bit; as there, after backward
 * the result's grad holds the gradient before the ReLU (masked). */
DTRAIN_API dt_tensor *dt_conv2d_relu(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                                     int stride, int padding);
DTRAIN_API dt_tensor *dt_max_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride);
DTRAIN_API dt_tensor *dt_avg_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride);

/* ---- GEMM ----------------------------------------------------------------------
 * C = alpha * op(A) @ op(B) + beta * C, row-major; op(X) = X or X^T. The
 * kernel under every matmul, exposed for users and benchmarks. m or n <= 0:
 * nothing to do. A NULL C (or A or B with k > 0) does nothing and sets
 * DTRAIN_ERR_NULL_ARG in dt_last_error(). */
DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc);
/* The micro-kernel dt_sgemm runs on this CPU: "avx512" or "avx2+fma"
 * (x86-64, picked at run time: the widest the CPU has), "neon" (aarch64),
 * "portable" (plain C; always under DTRAIN_NO_SIMD), or "cblas"
 * (DTRAIN_USE_CBLAS). */
DTRAIN_API const char *dt_sgemm_kernel(void);
/* on = 1 forces the portable C kernel, 0 returns to the best one (the
 * environment variable DTRAIN_GEMM=portable sets 1 at start). Returns the
 * previous setting (1: the portable kernel was forced). For tests and
 * benchmarks: call it while no other thread runs dt_sgemm. The kernels agree
 * to rounding, not bit for bit. */
DTRAIN_API int dt_sgemm_use_portable(int on);
/* Forces dt_sgemm's path: "portable", "avx2", "avx512" (x86-64), "neon"
 * (aarch64), or "best" (the widest this CPU has, the default). The
 * optimizer's update and the Winograd transforms follow the same choice
 * (portable: the build's baseline vectors, SSE2 on x86-64). The
 * environment variable DTRAIN_ISA (the same names) sets it at start; a path
 * the CPU lacks is refused there with a warning in the log and the best one
 * used. Returns DTRAIN_OK; DTRAIN_ERR_UNSUPPORTED when this build or CPU
 * lacks the path (nothing changes), DTRAIN_ERR_INVALID_ARG for another name,
 * DTRAIN_ERR_NULL_ARG for NULL. Call it while no other thread runs dt_sgemm
 * (as dt_sgemm_use_portable). Under DTRAIN_USE_CBLAS, BLAS runs whatever the
 * path. */
DTRAIN_API dt_result dt_sgemm_use_isa(const char *isa);

/* Matrix products in bfloat16 (mixed precision, as PyTorch's CPU autocast):
 * with DTRAIN_MATMUL_BF16 every dt_sgemm (so every matmul, linear layer and
 * convolution, forward and backward) rounds its two inputs to bfloat16 and
 * accumulates in float (AVX512_BF16's VDPBF16PS); parameters, gradients,
 * the optimizer and every other op stay float. Process-wide, like
 * dt_set_threads; DTRAIN_MATMUL_FP32 (the default) goes back. Returns
 * DTRAIN_OK, DTRAIN_ERR_UNSUPPORTED (nothing changes) where the CPU lacks
 * AVX512_BF16 and AVX512BW or the build has no SIMD or uses BLAS,
 * DTRAIN_ERR_INVALID_ARG for another value. Results differ from float by
 * bfloat16's 8-bit mantissa (relative 2^-9 per input); each product is still
 * deterministic and the same at any thread count. dt_sgemm_kernel() says
 * "avx512-bf16" while it is on. */
typedef enum dt_matmul_precision { DTRAIN_MATMUL_FP32 = 0, DTRAIN_MATMUL_BF16 = 1 } dt_matmul_precision;
DTRAIN_API dt_result dt_set_matmul_precision(dt_matmul_precision precision);
DTRAIN_API dt_matmul_precision dt_get_matmul_precision(void);

/* ---- threads inside one replica (intra-op) ----------------------------------------
 * dt_set_threads(n) lets the big kernels of a step split their work over n
 * threads: dt_sgemm (by blocks of rows or columns of C, each element computed
 * by one thread in the same order as with one thread, so results are bit for
 * bit those of n = 1), and the Adam/AdamW update of large buffers. n = 1 (the
 * default) runs everything on the calling thread; n = 0 means one thread per
 * online CPU. Without a call, the environment variable DTRAIN_THREADS (a
 * number, or "auto" for the CPU count) is read once, at the first use.
 * The n - 1 extra threads are created once, at the first kernel big enough
 * to use them, and live until the process exits or dt_set_threads(1); no
 * thread is created per call (a child of fork() starts its own). GEMMs below about a million multiply-adds stay
 * on one thread. Inside the replicas of a strategy with more than one replica
 * (mirrored, central_storage, async) kernels always use one thread: the
 * replicas already occupy the cores. When two user threads run kernels at the
 * same time, one gets the pool and the other runs alone (same results).
 * Returns DTRAIN_OK, DTRAIN_ERR_INVALID_ARG for n < 0, or
 * DTRAIN_ERR_UNSUPPORTED for n > 1 in a build without threads
 * (DTRAIN_NO_THREADS, where it stays 1). Safe to call from any thread at any
 * time (it waits for a kernel running on the pool to finish). */
DTRAIN_API dt_result dt_set_threads(int n);
/* The current setting (reads DTRAIN_THREADS if nothing set it yet): >= 1. */
DTRAIN_API int dt_get_threads(void);

/* ---- subnormal floats --------------------------------------------------------------
 * As training converges, gradients and optimizer moments fall below FLT_MIN
 * (1.2e-38), and x86 CPUs handle each such subnormal number in slow
 * microcode: a long run of the Fashion-MNIST MLP slowed 2.6x per step. So
 * dtrain runs its own work (strategy steps, backward, optimizer updates,
 * its threads) with subnormals flushed to zero (x86: MXCSR FTZ and DAZ;
 * AArch64: FPCR.FZ; elsewhere nothing changes), and puts the calling
 * thread's floating-point environment back before it returns: your own code
 * is not affected. Values that small are below any effect on training.
 * dt_set_flush_denormals(0) (or DTRAIN_FLUSH_DENORMALS=0, read at the first
 * use) keeps IEEE subnormals everywhere. Returns the previous setting. */
DTRAIN_API int dt_set_flush_denormals(int on);
DTRAIN_API int dt_get_flush_denormals(void);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_OPS_H */
