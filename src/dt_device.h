/* ===========================================================================
 * dt_device.h -- running a graph on an accelerator (the device hook)
 * ===========================================================================
 * A graph created with dt_graph_options.device set runs on that device: the
 * SAME model code (dt_linear, dt_relu, dt_cross_entropy, ... on the graph)
 * works unchanged, but every tensor's `data` and `grad` point into device
 * memory. Tensor headers (shape, flags, the tape) stay in host memory.
 *
 *   dt_device *dev = dt_cuda_device_create(0);     (dtrain_cuda.h)
 *   dt_graph_options gd = {0};
 *   gd.device = dev;                                the one-line switch
 *   dt_graph *g = dt_graph_create(params, &gd);     uploads the params
 *   ... forward with the usual ops, dt_backward(g, loss) ...
 *   dt_optim_step_graph(opt, g);                    update on the device
 *   dt_graph_zero_grad(g);
 *   dt_graph_params_download(g);                    device -> params (host)
 *
 * What moves, and what does not:
 *   - dt_tensor_from() copies host data to the device; dt_tensor_new() and
 *     gradients are zeroed on the device; dt_tensor_wrap() takes a DEVICE
 *     pointer on a device graph. Read results with dt_tensor_to_host() /
 *     dt_tensor_grad_to_host() (dt_item() copies the one float itself).
 *     Never read t->data of a device tensor on the host.
 *   - A device graph with params holds its own device copy of the params'
 *     flat data and grad buffers (dt_graph_param_data/grad). The host params
 *     are not updated until dt_graph_params_download(); after changing the
 *     host params (dt_load, an initialiser) call dt_graph_params_upload().
 *     dt_graph_bind() on a device graph takes device pointers.
 *   - Label arrays (dt_cross_entropy) are host memory: they are checked on
 *     the host and copied to the device.
 *   - check_numerics on a device graph copies every op output to the host to
 *     check it (slow: for debugging).
 *
 * Ops that run on a device (an op without a device path would fail on a
 * device graph with DTRAIN_ERR_UNSUPPORTED naming the op and the device,
 * before touching any data -- never a silent host read of device memory;
 * today every op of dtrain has one):
 *   dt_add, dt_sub, dt_mul, dt_div  (same shapes, or b broadcast over a's
 *                            leading dims, e.g. [N,C] + [C]; other broadcasts
 *                            are DTRAIN_ERR_UNSUPPORTED on a device)
 *   dt_add_scalar, dt_mul_scalar, dt_rsub_scalar, dt_neg, dt_exp,
 *   dt_leaky_relu, dt_gelu, dt_pow_scalar, dt_log, dt_sqrt (log, sqrt and
 *   non-integer powers check their domain on the device as the CPU op does,
 *   failing with the same DTRAIN_ERR_INVALID_ARG message; the check waits
 *   for one float from the device),
 *   dt_relu, dt_relu_inplace (computed out of place there), dt_sigmoid, dt_tanh, dt_sum, dt_mean, dt_sum_axis, dt_mean_axis,
 *   dt_transpose (any rank >= 2: the last two dims),
 *   dt_dropout (the mask is drawn on the host from the graph's RNG exactly as
 *   the CPU op draws it, then copied to the device: same seed, same result),
 *   dt_layer_norm, dt_embedding (ids are host memory: checked on the host,
 *   copied to the device),
 *   dt_matmul (2-D), dt_linear, dt_softmax, dt_log_softmax,
 *   dt_cross_entropy, dt_mse, dt_reshape, dt_reshape2, dt_flatten (no-copy
 *   views), dt_conv2d (im2col + GEMM), dt_max_pool2d, dt_avg_pool2d,
 *   dt_permute (any rank), dt_concat, dt_slice, dt_split (strided copies),
 *   dt_bmm (one strided-batched GEMM; b batched or 2-D shared, trans_b),
 *   dt_causal_mask (check_numerics checks the kept entries on the host),
 *   dt_batch_norm (training: batch statistics, the running mean/var updated
 *   in place on the device as the CPU op does; eval: the running stats --
 *   the running_var + eps > 0 check copies C floats to the host),
 *   dt_nn_linear_forward, dt_nn_conv2d_forward, dt_nn_embedding_forward,
 *   dt_nn_layer_norm_forward, dt_nn_batch_norm_forward,
 *   dt_nn_attention_forward, dt_nn_lstm_cell_forward, dt_nn_gru_cell_forward,
 *   dt_detach, dt_param, dt_tensor_new/from/wrap, dt_scalar, dt_item,
 *   dt_backward, dt_backward_grad.
 * Optimizers on a device (dt_optim_step_graph): SGD (momentum, Nesterov,
 * weight decay), Adam, AdamW, RMSprop (momentum, weight decay), clip_norm.
 * Their state lives on the device; dt_optim_state copies it to the host for
 * checkpoints and dt_checkpoint_save/load with the device graph in the
 * dt_train_state move the params too (see dt_io.h): a device run saves and
 * resumes (on the device or on the CPU) without losing anything.
 *
 * ---- the backend interface --------------------------------------------------
 * A device is a table of functions filled by a backend (dtrain_cuda.h is the
 * one shipped). The core never calls a device API directly: it allocates,
 * zeroes and copies through these functions and asks `run` for each kernel.
 * Every function returns DTRAIN_OK or an error code after recording a message
 * with dt_device_error() (e.g. "cuda:0: cudaMalloc of 4096 bytes: out of
 * memory"); the core then fails the graph with that message.
 */
#ifndef DTRAIN_DEVICE_H
#define DTRAIN_DEVICE_H

#include "dt_tensor.h"
#include "dt_maps.h"

DTRAIN_EXTERN_C_BEGIN

typedef enum dt_copy_kind {
  DTRAIN_COPY_H2D = 0, /* host -> device */
  DTRAIN_COPY_D2H = 1, /* device -> host (returns when the data is on the host) */
  DTRAIN_COPY_D2D = 2  /* device -> device */
} dt_copy_kind;

/* Kernels the core asks for, with their arguments in dt_kernel_args. p[] are
 * device pointers, i64 counts, f scalars. "+=" kernels accumulate. A pointer
 * named "scalar pointer" is a 1-float device buffer read by the kernel (so
 * that the host never waits on a gradient). Row-major everywhere. */
typedef enum dt_kernel {
  /* p0[i] = p1[i] op p2[i % n1], i < n0 (n1 divides n0: b over a's leading dims) */
  DTRAIN_K_ADD = 1, DTRAIN_K_SUB, DTRAIN_K_MUL,
  DTRAIN_K_ACC,          /* p0[i] += f0 * p1[i], i < n0 */
  DTRAIN_K_ACC_MUL,      /* p0[i] += p1[i] * p2[i % n1], i < n0 */
  DTRAIN_K_ACC_ROWS,     /* p0[j] += f0 * sum_r p1[r*n1 + j], j < n1, r < n0/n1 */
  DTRAIN_K_ACC_MUL_ROWS, /* p0[j] += sum_r p1[r*n1 + j] * p2[r*n1 + j] */
  DTRAIN_K_ACC_SCALAR,   /* p0[i] += f0 * p1[0], i < n0 (p1 a scalar pointer) */
  DTRAIN_K_ROWS_COPY,    /* p0[i] = p1[i % n1], i < n0 (bias rows) */
  DTRAIN_K_RELU, DTRAIN_K_SIGMOID, DTRAIN_K_TANH,             /* p0[i] = f(p1[i]), i < n0 */
  DTRAIN_K_RELU_BWD,     /* p0[i] += p1[i] * (p2[i] > 0): p0 gx, p1 gy, p2 x */
  DTRAIN_K_SIGMOID_BWD,  /* p0[i] += p1[i] * p2[i] * (1 - p2[i]): p2 y */
  DTRAIN_K_TANH_BWD,     /* p0[i] += p1[i] * (1 - p2[i]^2): p2 y */
  DTRAIN_K_SUM,          /* p0[0] = f0 * sum p1[0..n0) (accumulated in double) */
  DTRAIN_K_SUMSQ,        /* p0[0] = sum p1[i]^2 (double) */
  DTRAIN_K_SCALE,        /* p0[i] *= f0, i < n0 */
  DTRAIN_K_SQDIFF,       /* p0[i] = (p1[i] - p2[i])^2 */
  DTRAIN_K_MSE_BWD,      /* d = 2*p4[0]/n0 * (p2[i]-p3[i]); p0 += d, p1 -= d (either NULL) */
  /* C = alpha op(A) op(B) + beta C: p0 C [m,n], p1 A, p2 B; n0 m, n1 n, n2 k,
   * n3 = trans_a | trans_b << 1; f0 alpha, f1 beta; packed (lda = cols).
   * Batched when n4 > 1: n4 products, the i-th at p1 + i*n5, p2 + i*n6,
   * p0 + i*n7 (strides in floats; n6 = 0 shares B). n4 0 or 1: one. */
  DTRAIN_K_GEMM,
  /* Softmax over an axis: rows r < n0 (outer*inner), n1 = axis length,
   * n2 = inner stride, n3 = 1 for log-softmax. Fwd: p0 y, p1 x. Bwd: p0 gx,
   * p1 gy, p2 y. */
  DTRAIN_K_SOFTMAX, DTRAIN_K_SOFTMAX_BWD,
  /* Cross entropy, r < n0 rows of n1 classes, labels in `labels` (device):
   * fwd p0 row loss, p1 logits, p2 row max, p3 row log-sum-exp(x - max);
   * bwd (i < n0*n1) p0 gx += p4[0]*f0 * (softmax - onehot), p1 logits, p2, p3. */
  DTRAIN_K_XENT, DTRAIN_K_XENT_BWD,
  /* Optimizers over i < n0 elements: p0 param, p1 grad.
   * SGD: p2 momentum buffer or NULL; f0 lr, f1 weight decay, f2 momentum,
   *      n1 nesterov.
   * ADAM: p2 m, p3 v; f0 step_size, f1 weight decay, f2 sqrt(bias corr. 2),
   *      f3 eps, f4 1-beta1, f5 1-beta2, f6 beta2, f7 shrink (AdamW
   *      1 - lr*wd); n1 decoupled (AdamW). Same float operations as the CPU. */
  DTRAIN_K_SGD, DTRAIN_K_ADAM,
  /* Convolution, NCHW: n0 N, n1 C, n2 H, n3 W, n4 kh, n5 kw, n6 stride,
   * n7 padding, n8 Ho, n9 Wo, n10 O. Columns are [N][K][P] (K = C*kh*kw,
   * P = Ho*Wo), one K x P matrix per image.
   * IM2COL: p0 col, p1 x. COL2IM_ACC: p0 gx += the columns p1 fold back.
   * CONV_BIAS: p0 y [N,O,P] = p1 b[o]. CONV_BIAS_BWD: p0 gb[o] += sum of
   * p1 gy over images and positions; p2 (N*O floats) scratch for the
   * per-(image, channel) sums. */
  DTRAIN_K_IM2COL, DTRAIN_K_COL2IM_ACC, DTRAIN_K_CONV_BIAS, DTRAIN_K_CONV_BIAS_BWD,
  /* Pooling, no padding: n0 planes (N*C), n1 H, n2 W, n3 Ho, n4 Wo,
   * n5 kernel, n6 stride. Fwd p0 y, p1 x. Bwd p0 gx, p1 gy, p2 x, p3 y (max:
   * the gradient goes to the first maximum of each window, a NaN wins). */
  DTRAIN_K_MAXPOOL, DTRAIN_K_MAXPOOL_BWD, DTRAIN_K_AVGPOOL, DTRAIN_K_AVGPOOL_BWD,
  /* Division, b over a's leading dims as DTRAIN_K_ADD: DIV p0[i] = p1[i] /
   * p2[i % n1]; ACC_DIV p0[i] += p1[i] / p2[i % n1] (ga += gy / b);
   * DIV_BWD_ROWS p0[j] -= sum_r p1[r*n1+j] * p3[r*n1+j] / (p2[j] * p2[j]),
   * j < n1, rows r < n0/n1 ascending (gb from gy p1, b p2, a p3). */
  DTRAIN_K_DIV, DTRAIN_K_ACC_DIV, DTRAIN_K_DIV_BWD_ROWS,
  /* Elementwise maps, i < n0, n1 a dt_map_fn, f0 its scalar: MAP p0[i] =
   * f(p1[i]); MAP_BWD p0[i] += p1[i] * f'(...) with p2 x, p3 y. */
  DTRAIN_K_MAP, DTRAIN_K_MAP_BWD,
  /* Sum over one axis, x viewed as [outer n0, len n1, inner n2]: SUM_AXIS
   * p0[o*n2 + i] = sum_k p1[(o*n1 + k)*n2 + i] (in double, k ascending;
   * divided by n1 when n3 = 1: the mean); SUM_AXIS_BWD p0[(o*n1 + k)*n2 + i]
   * += p1[o*n2 + i] * f0. */
  DTRAIN_K_SUM_AXIS, DTRAIN_K_SUM_AXIS_BWD,
  /* Batched transpose: p1 is n0 matrices of n1 rows x n2 cols; p0 gets
   * their transposes (n2 x n1 each), p0 = when n3 = 0, p0 += when n3 = 1. */
  DTRAIN_K_TRANSPOSE,
  /* Layer norm over rows r < n0 of n1 floats, f0 eps. p4 stats: mean[n0]
   * then rstd[n0] (written by the forward, read by the backward).
   * LAYER_NORM (per row): p0 y, p1 x, p2 gamma, p3 beta (either NULL).
   * LAYER_NORM_BWD (per row): p0 gx +=, p1 gy, p2 x, p3 gamma (or NULL).
   * LAYER_NORM_BWD_PARAMS (per column j < n1, rows ascending): p0 ggamma
   * +=, p1 gbeta += (either NULL), p2 gy, p3 x. */
  DTRAIN_K_LAYER_NORM, DTRAIN_K_LAYER_NORM_BWD, DTRAIN_K_LAYER_NORM_BWD_PARAMS,
  /* Embedding, n0 ids (in `labels`, device, already range-checked), rows of
   * n1 floats: EMBED p0[i*n1 + j] = p1[ids[i]*n1 + j]; EMBED_BWD (one
   * column j < n1, ids in order) p0[ids[i]*n1 + j] += p1[i*n1 + j]. */
  DTRAIN_K_EMBED, DTRAIN_K_EMBED_BWD,
  /* Permute, i < n0 (the output's size): n1 rank (<= 6), n2..n7 the output
   * shape, n8 the permutation packed 4 bits a dim (perm[d] at bits 4d: the
   * output's dim d is the input's dim perm[d]). n9 = 0: p0 y[i] = p1
   * x[off(i)]; n9 = 1 (backward): p0 gx[off(i)] += p1 gy[i]. */
  DTRAIN_K_PERMUTE,
  /* Strided rows (slice, split, concat): i < n0*n1, row o = i / n1, column
   * c = i % n1: p0[o*n2 + c] = p1[o*n3 + c] (+= when n4 = 1); p0 and p1
   * already offset to the first row's block. */
  DTRAIN_K_COPY_ROWS,
  /* Causal mask over n0 elements of [..., T, T] matrices, n1 T. n2 = 0: p0
   * y[i] = col <= row ? p1 x[i] : -inf; n2 = 1: p0 gx[i] += p1 gy[i] where
   * col <= row. */
  DTRAIN_K_CAUSAL_MASK,
  /* RMSprop over i < n0: p0 param, p1 grad, p2 square average, p3 momentum
   * buffer or NULL; f0 lr, f1 weight decay, f2 alpha, f3 1 - alpha, f4
   * momentum, f5 eps. Same float operations as the CPU. */
  DTRAIN_K_RMSPROP,
  /* Batch norm, x [n0 N, n1 C, n2 HW], p-stats = mean[C] then rstd[C].
   * BN_STATS (per channel): p0 stats, p1 x, p2 running mean, p3 running var
   * (both NULL: none); n3 = 1 batch statistics (the CPU's double sums; the
   * running stats updated with f1 momentum, unbiased variance), n3 = 0 from
   * the running stats; f0 eps.
   * BN (per element): p0 y, p1 x, p2 stats, p3 gamma, p4 beta (either NULL).
   * BN_BWD_CH (per channel): p0 ggamma +=, p1 gbeta += (either NULL), p2 gy,
   * p3 x, p4 stats, p5 red: writes mean(gy)[C] then mean(gy * xhat)[C].
   * BN_BWD (per element): p0 gx +=, p1 gy, p2 x, p3 stats, p4 gamma (or
   * NULL), p5 red; n3 as in BN_STATS (0: gx += gy * gamma * rstd). */
  DTRAIN_K_BN_STATS, DTRAIN_K_BN, DTRAIN_K_BN_BWD_CH, DTRAIN_K_BN_BWD,
  DTRAIN_K_COUNT
} dt_kernel;

/* The maps of DTRAIN_K_MAP / DTRAIN_K_MAP_BWD (dt_map_fn: x + s, x * s, s - x,
 * x^s, -x, exp(x), leaky ReLU with slope s, GELU (tanh form), log(x),
 * sqrt(x), ReLU, sigmoid, tanh, and the two domain maps) are listed once,
 * with the formulas the CPU ops and a backend share, in dt_maps.h. */

typedef struct dt_kernel_args {
  float *p[6];
  const int32_t *labels;
  int64_t n[12];
  float f[8];
} dt_kernel_args;

typedef struct dt_device dt_device;
struct dt_device {
  const char *name;   /* "cuda:0": used in messages */
  void *impl;         /* the backend's state */
  dt_result (*alloc)(dt_device *d, size_t bytes, void **out);
  void (*free)(dt_device *d, void *p, size_t bytes);
  dt_result (*zero)(dt_device *d, void *p, size_t bytes);
  dt_result (*copy)(dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_kind kind);
  dt_result (*sync)(dt_device *d);
  /* DTRAIN_ERR_UNSUPPORTED for a kernel the backend lacks. */
  dt_result (*run)(dt_device *d, dt_kernel k, const dt_kernel_args *a);
  /* ---- several devices (dt_device_group, dt_strategy with desc.devices) ----
   * All optional: a backend that leaves them NULL (zero-initialised) still
   * works, through host memory.
   * peer_copy: `bytes` from `src` (memory of device `from`) to `dst` (memory
   * of d), ordered after the work already queued on both devices; it may
   * return once the copy is queued on d (later work on d sees the data).
   * It may still be reading src then: the caller queues no work on `from`
   * that writes src before d->sync (dt_device_group syncs every device at
   * the end of each round).
   * NULL: the core stages the copy through host memory (D2H on `from`, then
   * H2D on d). */
  dt_result (*peer_copy)(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes);
  /* A collective library (NCCL): group_create makes one communicator over
   * devs[0..n) (called on devs[0]; every device of the group has the same
   * hooks), group_allreduce sums bufs[i] (count floats on devs[i]) in place
   * so that every device holds the same sum, queued on the devices' streams;
   * group_destroy frees it. NULL group_create, or group_create returning
   * DTRAIN_ERR_UNSUPPORTED (not for these devices, e.g. NCCL given one GPU
   * twice): dt_device_group uses a ring over peer_copy and the DTRAIN_K_ACC
   * kernel instead. */
  dt_result (*group_create)(dt_device *const *devs, int n, void **out);
  dt_result (*group_allreduce)(void *group, float *const *bufs, size_t count);
  void (*group_destroy)(void *group);
  /* Optional with the group hooks: bufs[root] (count floats) to every
   * other bufs[i] (ncclBroadcast). NULL: peer copies from the root. */
  dt_result (*group_broadcast)(void *group, float *const *bufs, size_t count, int root);
};

/* For backends: record `msg` as this thread's error (dt_last_error) and
 * return code. */
DTRAIN_API dt_result dt_device_error(dt_result code, const char *msg);

/* The device of a graph (NULL: the CPU). */
DTRAIN_API dt_device *dt_graph_device(const dt_graph *g);
/* The flat parameter buffers the graph's dt_param views use (device memory
 * on a device graph); NULL without params. */
DTRAIN_API float *dt_graph_param_data(dt_graph *g);
DTRAIN_API float *dt_graph_param_grad(dt_graph *g);
/* Host params -> the graph's device copy, and back (data only; upload also
 * zeroes the device gradient). DTRAIN_OK and nothing done on a CPU graph. */
DTRAIN_API dt_result dt_graph_params_upload(dt_graph *g);
DTRAIN_API dt_result dt_graph_params_download(dt_graph *g);
/* Zero the gradient buffer bound to the graph (device or host). */
DTRAIN_API dt_result dt_graph_zero_grad(dt_graph *g);

/* Copy t->size floats of a tensor's data (or gradient: zeros when it has
 * none) to host memory `dst`. Works for CPU tensors too (memcpy). */
DTRAIN_API dt_result dt_tensor_to_host(const dt_tensor *t, float *dst);
DTRAIN_API dt_result dt_tensor_grad_to_host(const dt_tensor *t, float *dst);

/* ---- several devices: the all-reduce of data-parallel training ----------------
 * A group of n devices, each holding a buffer of `count` floats (e.g. the
 * parameter gradients of a replica's graph: dt_graph_param_grad). What
 * dt_strategy uses for mirrored training over devices; usable directly.
 *
 *   dt_device_group *grp = dt_device_group_create(devs, n, count);
 *   float *bufs[n] = {dt_graph_param_grad(g0), dt_graph_param_grad(g1), ...};
 *   dt_device_group_allreduce(grp, bufs);      every buffer now holds the sum
 *
 * How: when the devices have group hooks (dtrain_cuda.h compiled with
 * DTRAIN_USE_NCCL: ncclAllReduce), one collective call; otherwise a ring
 * over peer copies: a reduce-scatter (n-1 rounds: device i sends chunk
 * (i-k) mod n to device i+1, which adds it to its own with DTRAIN_K_ACC)
 * then an all-gather (n-1 rounds of copies), chunks as dt_comm_slice. Each
 * chunk's sum is made once, on one device, and copied to the others, so
 * every device ends with the bitwise same values, and the same inputs give
 * the bitwise same sum on every call. Devices without peer_copy go through
 * host memory. Every device is synchronised at the end (the buffers may be
 * read or reused at once). The group keeps one chunk of scratch per device
 * (count/n floats, plus one). A failure returns the device's error code
 * with a message naming the device and the round; the buffers are then
 * undefined. n = 1 is a no-op. */
typedef struct dt_device_group dt_device_group;
/* NULL + dt_last_error() on failure. The devices are borrowed. */
DTRAIN_API dt_device_group *dt_device_group_create(dt_device *const *devs, int n, size_t count);
DTRAIN_API void dt_device_group_destroy(dt_device_group *g);
/* Sum bufs[i] (count floats on device i) in place on every device. */
DTRAIN_API dt_result dt_device_group_allreduce(dt_device_group *g, float *const *bufs);
/* bufs[root][begin, end) -> the same range of every other device's buffer
 * (the group_broadcast hook where the devices have one, else peer copies
 * from the root). */
DTRAIN_API dt_result dt_device_group_broadcast(dt_device_group *g, float *const *bufs, size_t begin, size_t end,
                                               int root);
/* "nccl-style collective (group hooks)", "ring over peer copies" or "ring
 * through host memory": what dt_device_group_allreduce uses. */
DTRAIN_API const char *dt_device_group_method(const dt_device_group *g);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_DEVICE_H */
