/* dtrain_cuda.h -- the optional CUDA backend of dtrain (a device for dt_graph).
 * ===========================================================================
 * Hand-kept single file (not generated from src/: it is one file already, and
 * it needs nvcc, so it stays out of dtrain.h). Same stb pattern as dtrain.h:
 *
 *   // in exactly ONE .cu file, compiled with nvcc, linked with -lcublas:
 *   #define DTRAIN_IMPLEMENTATION        (or in a separate .c file)
 *   #define DTRAIN_CUDA_IMPLEMENTATION
 *   #include "dtrain_cuda.h"
 *
 * Other files include "dtrain_cuda.h" (or only dtrain.h: the device hook is
 * part of the core, see dt_device.h in dtrain.h) without the define.
 *
 * Use (the one-line switch is dt_graph_options.device):
 *
 *   dt_device *dev = dt_cuda_device_create(0);   NULL + dt_last_error() on failure
 *   dt_graph_options gd = {0}; gd.device = dev;
 *   dt_graph *g = dt_graph_create(params, &gd);  params copied to the GPU
 *   ... the same model code ...; dt_backward(g, loss);
 *   dt_optim_step_graph(opt, g); dt_graph_zero_grad(g);
 *   dt_graph_params_download(g);                 GPU -> params (host)
 *   dt_graph_destroy(g); dt_cuda_device_destroy(dev);
 *
 * Several GPUs, one replica each (see "Devices" in dt_strategy.h):
 *
 *   dt_device *gpu[2] = {dt_cuda_device_create(0), dt_cuda_device_create(1)};
 *   dt_strategy_options sd = dt_strategy_mirrored(0); sd.devices = gpu; sd.ndevices = 2;
 *   dt_strategy *s = dt_strategy_create(params, opt, step, user, &sd);
 *   ... dt_strategy_step(s, &batch, &loss) ...   params (host) updated each step
 *   dt_strategy_destroy(s); dt_optim_destroy(opt); then destroy the devices
 *   (the optimizer's state lives on gpu[0]).
 *
 * STATUS: this backend has been compiled with nvcc (CUDA 13.0) but NOT YET RUN
 * ON A GPU. The per-element math of every kernel is shared with a host
 * emulation (DTRAIN_CUDA_HOST_EMULATION) that tests/test_cuda_emu.cc runs on
 * the CPU against dtrain's CPU ops, also on a guarded emulation whose memory
 * the host cannot read or write (as on a GPU: a host read of device memory
 * crashes there); tests/test_cuda.cu is the real GPU parity test (it skips
 * where there is no GPU).
 *
 * Kernels (dt_kernel in dt_device.h), all with forward and backward:
 * add/sub/mul/div (+ row broadcast), the scalar ops (add/mul/rsub/pow),
 * neg, exp, log, sqrt, relu, leaky_relu, gelu, sigmoid, tanh,
 * sum/mean (all, or over one axis), transpose (last two dims), permute (a
 * gather, any rank), concat/slice/split (strided row copies), dropout (mask
 * drawn on the host from the graph RNG, as the CPU op: same seed, same
 * result), layer_norm, batch_norm (batch or running statistics; running
 * mean/var updated on the device), causal_mask, embedding,
 * softmax/log_softmax, cross_entropy, mse, GEMM through cuBLAS (matmul,
 * linear; bmm as one cublasSgemmStridedBatched), conv2d (im2col, then each
 * product one cublasSgemmStridedBatched over the batch; col2im gather), max/avg pooling; so also the attention, LSTM-cell
 * and GRU-cell modules; SGD (momentum, Nesterov, weight decay), Adam/AdamW,
 * RMSprop, clipping (sum of squares, scale). Checkpoints of a device run
 * hold the optimizer's device state (see dt_optim_state, dt_io.h).
 * log, sqrt and non-integer powers check their domain on the device (a 0/1
 * map summed, one float read back), failing as the CPU op does; a NaN goes
 * through as on the CPU (dt_maps.h).
 * Several GPUs: dt_strategy_options.devices puts one replica on each GPU
 * (one_device, mirrored, multi_worker_mirrored: see "Devices" in
 * dt_strategy.h); the gradients are all-reduced on the GPUs by
 * dt_device_group (dt_device.h): a ring of cudaMemcpyPeerAsync copies (peer
 * access enabled at a pair's first copy where the GPUs allow it) and the
 * accumulate kernel, or, compiled with -DDTRAIN_USE_NCCL (link -lnccl),
 * ncclAllReduce (and ncclBroadcast for the parameters) in group calls over
 * communicators from ncclCommInitAll; NCCL errors carry ncclGetErrorString.
 * GPU replicas join the TCP/MPI multi-worker all-reduce through host memory
 * (device -> host -> the cross-process ring -> device). Like the rest of
 * this backend, the multi-GPU path is NOT YET RUN ON GPUs: it is tested on
 * the host emulation (several emulated devices, tests/test_cuda_strategy.cc)
 * and compiled with nvcc (with and without NCCL); tests/test_cuda.cu checks
 * mirrored over every GPU against the CPU where there are two or more.
 * examples/02_fashion_mnist --device cuda trains through the strategy
 * (one_device, mirrored over every GPU or --replicas N, multi_worker_mirrored).
 * Not tuned: sums are one-block reductions, softmax / cross entropy / layer
 * and batch norm use one thread per row or channel, conv runs one cuBLAS call
 * per image; nvcc's default architecture is used (PTX JIT-compiled on newer
 * GPUs; set NVCCFLAGS, e.g. -arch=sm_90).
 *
 * Errors: every CUDA runtime and cuBLAS call is checked; a failure becomes a
 * dt_result with a message naming the device, the call and cudaGetErrorString
 * (or the cuBLAS status name); cudaErrorMemoryAllocation becomes
 * DTRAIN_ERR_NOMEM with the byte count. The graph then fails like any op.
 *
 * Streams: each device has one non-blocking stream; kernels, cuBLAS and
 * copies run on it in order. Device -> host copies wait for the stream.
 */
#ifndef DTRAIN_CUDA_H
#define DTRAIN_CUDA_H

#include "dtrain.h"

DTRAIN_EXTERN_C_BEGIN

/* Number of CUDA devices: >= 0, or -1 with dt_last_error() set (no driver,
 * e.g. "cudaGetDeviceCount: CUDA driver version is insufficient ..."). */
DTRAIN_API int dt_cuda_device_count(void);
/* A device for dt_graph_options.device on GPU `index` (its own stream and cuBLAS
 * handle). NULL on failure (dt_last_error()). Destroy after every graph and
 * optimizer that uses it. */
DTRAIN_API dt_device *dt_cuda_device_create(int index);
DTRAIN_API void dt_cuda_device_destroy(dt_device *d);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_CUDA_H */

/* ===========================================================================
 * The kernels' math, shared by the GPU and the host emulation
 * =========================================================================== */
#if (defined(DTRAIN_CUDA_IMPLEMENTATION) || defined(DTRAIN_CUDA_HOST_EMULATION)) && !defined(DTRAIN_CUDA__MATH_DONE)
#define DTRAIN_CUDA__MATH_DONE

#ifndef __cplusplus
#  error "dtrain_cuda.h implementation must be compiled as CUDA C++ (nvcc) or, for the host emulation, as C++"
#endif

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#if defined(__CUDACC__)
#  define DT__CU_HD __host__ __device__
#else
#  define DT__CU_HD
#endif

/* Each function computes one output element (or one row) of a kernel; the
 * __global__ kernels are grid-stride loops over them, the host emulation a
 * plain loop. Arguments as documented with dt_kernel in dt_device.h. */
typedef void (*dt__cu_fn)(int64_t i, const dt_kernel_args &a);

DT__CU_HD inline void dt__cu_add_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = a.p[1][i] + a.p[2][i % a.n[1]]; }
DT__CU_HD inline void dt__cu_sub_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = a.p[1][i] - a.p[2][i % a.n[1]]; }
DT__CU_HD inline void dt__cu_mul_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = a.p[1][i] * a.p[2][i % a.n[1]]; }
DT__CU_HD inline void dt__cu_acc_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] += a.f[0] * a.p[1][i]; }
DT__CU_HD inline void dt__cu_acc_mul_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] += a.p[1][i] * a.p[2][i % a.n[1]];
}
/* One column j of the row sums; rows in ascending order (deterministic). */
DT__CU_HD inline void dt__cu_acc_rows_at(int64_t j, const dt_kernel_args &a) {
  int64_t rows = a.n[0] / a.n[1];
  float s = a.p[0][j];
  for (int64_t r = 0; r < rows; r++) s += a.f[0] * a.p[1][r * a.n[1] + j];
  a.p[0][j] = s;
}
DT__CU_HD inline void dt__cu_acc_mul_rows_at(int64_t j, const dt_kernel_args &a) {
  int64_t rows = a.n[0] / a.n[1];
  float s = a.p[0][j];
  for (int64_t r = 0; r < rows; r++) s += a.p[1][r * a.n[1] + j] * a.p[2][r * a.n[1] + j];
  a.p[0][j] = s;
}
DT__CU_HD inline void dt__cu_acc_scalar_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] += a.f[0] * a.p[1][0]; }
DT__CU_HD inline void dt__cu_rows_copy_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = a.p[1][i % a.n[1]]; }
/* ReLU, sigmoid, tanh: their own kernels, the formulas of dt_maps.h (the
 * CPU ops' own). The backward kernels get x (ReLU) or y (sigmoid, tanh) as p2
 * and the output's gradient as p1; the formula ignores the other input. */
DT__CU_HD inline void dt__cu_relu_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = dt__map_relu(a.p[1][i], 0.0f); }
DT__CU_HD inline void dt__cu_sigmoid_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] = dt__map_sigmoid(a.p[1][i], 0.0f);
}
DT__CU_HD inline void dt__cu_tanh_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = dt__map_tanh(a.p[1][i], 0.0f); }
DT__CU_HD inline void dt__cu_relu_bwd_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] += dt__map_relu_grad(a.p[2][i], 0.0f, a.p[1][i], 0.0f);
}
DT__CU_HD inline void dt__cu_sigmoid_bwd_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] += dt__map_sigmoid_grad(0.0f, a.p[2][i], a.p[1][i], 0.0f);
}
DT__CU_HD inline void dt__cu_tanh_bwd_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] += dt__map_tanh_grad(0.0f, a.p[2][i], a.p[1][i], 0.0f);
}
DT__CU_HD inline void dt__cu_scale_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] *= a.f[0]; }
DT__CU_HD inline void dt__cu_sqdiff_at(int64_t i, const dt_kernel_args &a) {
  float d = a.p[1][i] - a.p[2][i];
  a.p[0][i] = d * d;
}
DT__CU_HD inline void dt__cu_mse_bwd_at(int64_t i, const dt_kernel_args &a) {
  float k = 2.0f * a.p[4][0] / (float)a.n[0];
  float d = k * (a.p[2][i] - a.p[3][i]);
  if (a.p[0]) a.p[0][i] += d;
  if (a.p[1]) a.p[1][i] -= d;
}
/* Softmax: row r of n0 = outer*inner rows; elements base + k*inner. */
DT__CU_HD inline void dt__cu_softmax_row(int64_t r, const dt_kernel_args &a) {
  int64_t n = a.n[1], inner = a.n[2], base = (r / inner) * n * inner + r % inner;
  const float *x = a.p[1];
  float *y = a.p[0];
  float m = x[base];
  for (int64_t k = 1; k < n; k++) m = x[base + k * inner] > m ? x[base + k * inner] : m;
  double s = 0.0;
  if (a.n[3]) {
    for (int64_t k = 0; k < n; k++) s += (double)expf(x[base + k * inner] - m);
    float ls = (float)log(s);
    for (int64_t k = 0; k < n; k++) y[base + k * inner] = (x[base + k * inner] - m) - ls;
  } else {
    for (int64_t k = 0; k < n; k++) {
      float e = expf(x[base + k * inner] - m);
      y[base + k * inner] = e;
      s += (double)e;
    }
    float inv = (float)(1.0 / s);
    for (int64_t k = 0; k < n; k++) y[base + k * inner] *= inv;
  }
}
DT__CU_HD inline void dt__cu_softmax_bwd_row(int64_t r, const dt_kernel_args &a) {
  int64_t n = a.n[1], inner = a.n[2], base = (r / inner) * n * inner + r % inner;
  float *gx = a.p[0];
  const float *go = a.p[1], *y = a.p[2];
  double s = 0.0;
  if (a.n[3]) {
    for (int64_t k = 0; k < n; k++) s += (double)go[base + k * inner];
    float fs = (float)s;
    for (int64_t k = 0; k < n; k++) {
      int64_t j = base + k * inner;
      gx[j] += go[j] - expf(y[j]) * fs;
    }
  } else {
    for (int64_t k = 0; k < n; k++) s += (double)go[base + k * inner] * (double)y[base + k * inner];
    float fs = (float)s;
    for (int64_t k = 0; k < n; k++) {
      int64_t j = base + k * inner;
      gx[j] += y[j] * (go[j] - fs);
    }
  }
}
/* Cross entropy, one row: loss = log-sum-exp - x[label]. */
DT__CU_HD inline void dt__cu_xent_row(int64_t r, const dt_kernel_args &a) {
  int64_t c = a.n[1];
  const float *x = a.p[1] + r * c;
  float m = x[0];
  for (int64_t j = 1; j < c; j++) m = x[j] > m ? x[j] : m;
  double s = 0.0;
  for (int64_t j = 0; j < c; j++) s += (double)expf(x[j] - m);
  double l = log(s);
  a.p[2][r] = m;
  a.p[3][r] = (float)l;
  a.p[0][r] = (float)(l + ((double)m - (double)x[a.labels[r]]));
}
DT__CU_HD inline void dt__cu_xent_bwd_at(int64_t i, const dt_kernel_args &a) {
  int64_t c = a.n[1], r = i / c, j = i % c;
  float scale = a.p[4][0] / (float)a.n[0];
  float v = a.p[0][i] + expf((a.p[1][i] - a.p[2][r]) - a.p[3][r]) * scale;
  if (j == (int64_t)a.labels[r]) v -= scale;
  a.p[0][i] = v;
}
/* The optimizers: the per-element formulas of dt_optim_math.h that the
 * CPU loops (dt_optim.c) run, with the scalars the core packed. */
DT__CU_HD inline void dt__cu_sgd_at(int64_t i, const dt_kernel_args &a) {
  dt__optim_sgd_at(dt__optim_sgd_unpack(a.f, a.n[1]), a.p[0], a.p[1], a.p[2], (size_t)i);
}
DT__CU_HD inline void dt__cu_adam_at(int64_t i, const dt_kernel_args &a) {
  dt__optim_adam_at(dt__optim_adam_unpack(a.f, a.n[1]), a.p[0], a.p[1], a.p[2], a.p[3], (size_t)i);
}

/* Division (b over a's leading dims) and its backward, in the CPU's order. */
DT__CU_HD inline void dt__cu_div_at(int64_t i, const dt_kernel_args &a) { a.p[0][i] = a.p[1][i] / a.p[2][i % a.n[1]]; }
DT__CU_HD inline void dt__cu_acc_div_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] += a.p[1][i] / a.p[2][i % a.n[1]];
}
DT__CU_HD inline void dt__cu_div_bwd_rows_at(int64_t j, const dt_kernel_args &a) {
  int64_t rows = a.n[0] / a.n[1];
  float b = a.p[2][j], s = a.p[0][j];
  for (int64_t r = 0; r < rows; r++) s -= a.p[1][r * a.n[1] + j] * a.p[3][r * a.n[1] + j] / (b * b);
  a.p[0][j] = s;
}
/* Elementwise maps (dt_map_fn in n1, scalar f0): one case per op of
 * DT__MAP_LIST, generated from the list, each the formula of dt_maps.h that
 * the CPU op runs. So an op of the list always has its kernel; an id outside
 * the list is refused by dt__cu_dispatch before it gets here. */
DT__CU_HD inline void dt__cu_map_at(int64_t i, const dt_kernel_args &a) {
  const float v = a.p[1][i], s = a.f[0];
  float y = 0.0f;
  switch ((int)a.n[1]) {
#define DT__CU_MAP_CASE(name, NAME, args, domain) \
    case DTRAIN_MAP_##NAME: y = dt__map_##name(v, s); break;
    DT__MAP_LIST(DT__CU_MAP_CASE)
#undef DT__CU_MAP_CASE
    /* 1 below the domain, the CPU's test; 0 for NaN, which goes through */
    case DTRAIN_MAP_DOMAIN_POS: y = dt__map_below(DT__MAP_DOMAIN_POS, v) ? 1.0f : 0.0f; break;
    case DTRAIN_MAP_DOMAIN_NONNEG: y = dt__map_below(DT__MAP_DOMAIN_NONNEG, v) ? 1.0f : 0.0f; break;
    default: break;
  }
  a.p[0][i] = y;
}
DT__CU_HD inline void dt__cu_map_bwd_at(int64_t i, const dt_kernel_args &a) {
  const float go = a.p[1][i], s = a.f[0];
  float *gx = a.p[0] + i;
  switch ((int)a.n[1]) {
#define DT__CU_MAP_BWD_CASE(name, NAME, args, domain) \
    case DTRAIN_MAP_##NAME: *gx += dt__map_##name##_grad(a.p[2][i], a.p[3][i], go, s); break;
    DT__MAP_LIST(DT__CU_MAP_BWD_CASE)
#undef DT__CU_MAP_BWD_CASE
    default: break;
  }
}

/* One output element of a one-axis sum (the CPU's double accumulation). */
DT__CU_HD inline void dt__cu_sum_axis_at(int64_t j, const dt_kernel_args &a) {
  const int64_t len = a.n[1], inner = a.n[2];
  const float *x = a.p[1] + (j / inner) * len * inner + j % inner;
  double s = 0.0;
  for (int64_t k = 0; k < len; k++) s += (double)x[k * inner];
  a.p[0][j] = (float)(a.n[3] ? s / (double)len : s);
}
DT__CU_HD inline void dt__cu_sum_axis_bwd_at(int64_t i, const dt_kernel_args &a) {
  const int64_t len = a.n[1], inner = a.n[2];
  a.p[0][i] += a.p[1][(i / (len * inner)) * inner + i % inner] * a.f[0];
}

/* One output element of a batched transpose (= or += by n3). */
DT__CU_HD inline void dt__cu_transpose_at(int64_t i, const dt_kernel_args &a) {
  const int64_t rows = a.n[1], cols = a.n[2], mn = rows * cols;
  int64_t b = i / mn, rem = i % mn, c = rem / rows, r = rem % rows;
  float v = a.p[1][b * mn + r * cols + c];
  if (a.n[3]) a.p[0][i] += v;
  else a.p[0][i] = v;
}

/* Layer norm, one row (or one column for the parameter gradients): the
 * CPU's sums in double and its float expressions. */
DT__CU_HD inline void dt__cu_layer_norm_row(int64_t r, const dt_kernel_args &a) {
  const int64_t d = a.n[1];
  const float *xr = a.p[1] + r * d, *gm = a.p[2], *bt = a.p[3];
  float *yr = a.p[0] + r * d;
  double s = 0.0, v = 0.0;
  for (int64_t j = 0; j < d; j++) s += (double)xr[j];
  double mu = s / (double)d;
  for (int64_t j = 0; j < d; j++) {
    double t = (double)xr[j] - mu;
    v += t * t;
  }
  float fmu = (float)mu, rs = (float)(1.0 / sqrt(v / (double)d + (double)a.f[0]));
  for (int64_t j = 0; j < d; j++) {
    float h = (xr[j] - fmu) * rs;
    if (gm) h *= gm[j];
    if (bt) h += bt[j];
    yr[j] = h;
  }
  a.p[4][r] = fmu;
  a.p[4][a.n[0] + r] = rs;
}
DT__CU_HD inline void dt__cu_layer_norm_bwd_row(int64_t r, const dt_kernel_args &a) {
  const int64_t d = a.n[1];
  const float *gr = a.p[1] + r * d, *xr = a.p[2] + r * d, *gm = a.p[3];
  const float mu = a.p[4][r], rs = a.p[4][a.n[0] + r];
  double s1 = 0.0, s2 = 0.0;
  for (int64_t j = 0; j < d; j++) {
    double dxh = (double)gr[j] * (gm ? (double)gm[j] : 1.0);
    s1 += dxh;
    s2 += dxh * (double)((xr[j] - mu) * rs);
  }
  float m1 = (float)(s1 / (double)d), m2 = (float)(s2 / (double)d);
  float *gxr = a.p[0] + r * d;
  for (int64_t j = 0; j < d; j++) {
    float dxh = gr[j] * (gm ? gm[j] : 1.0f);
    gxr[j] += rs * (dxh - m1 - (xr[j] - mu) * rs * m2);
  }
}
DT__CU_HD inline void dt__cu_layer_norm_bwd_params_at(int64_t j, const dt_kernel_args &a) {
  const int64_t rows = a.n[0], d = a.n[1];
  float *gg = a.p[0], *gb = a.p[1];
  const float *go = a.p[2], *x = a.p[3], *mean = a.p[4], *rstd = a.p[4] + rows;
  float sg = gg ? gg[j] : 0.0f, sb = gb ? gb[j] : 0.0f;
  for (int64_t r = 0; r < rows; r++) {
    float gr = go[r * d + j];
    sg += gr * (x[r * d + j] - mean[r]) * rstd[r];
    sb += gr;
  }
  if (gg) gg[j] = sg;
  if (gb) gb[j] = sb;
}

/* Embedding: a gather; the backward by column, ids in order (the CPU's
 * order for repeated ids, and no two threads touch one element). */
DT__CU_HD inline void dt__cu_embed_at(int64_t i, const dt_kernel_args &a) {
  const int64_t d = a.n[1];
  a.p[0][i] = a.p[1][(int64_t)a.labels[i / d] * d + i % d];
}
DT__CU_HD inline void dt__cu_embed_bwd_at(int64_t j, const dt_kernel_args &a) {
  const int64_t n = a.n[0], d = a.n[1];
  for (int64_t i = 0; i < n; i++) a.p[0][(int64_t)a.labels[i] * d + j] += a.p[1][i * d + j];
}

/* Convolution (see dt_kernel): columns [N][K][P], one K x P matrix per image.
 * im2col: one thread per (image, channel, output pixel) writes that pixel's
 * kh*kw column entries (neighbouring threads write neighbouring floats);
 * col2im: one thread per input element. The place is worked out once with
 * 64-bit divisions, the windows with int (planes past INT_MAX elements are
 * refused: dt__cu_rows_fit). One thread per column entry, six 64-bit
 * divisions each, spent 414 us on conv2's im2col at batch 256 on an H200. */
DT__CU_HD inline void dt__cu_im2col_at(int64_t i, const dt_kernel_args &a) {
  const int64_t C = a.n[1], kh = a.n[4], kw = a.n[5], P = a.n[8] * a.n[9], K = C * kh * kw;
  const int H = (int)a.n[2], W = (int)a.n[3], s = (int)a.n[6], pad = (int)a.n[7], wo = (int)a.n[9];
  const int64_t ic = i / P, img = ic / C, c = ic % C;
  const int p = (int)(i % P), h0 = (p / wo) * s - pad, w0 = (p % wo) * s - pad;
  const float *src = a.p[1] + ic * H * W;
  float *dst = a.p[0] + (img * K + c * kh * kw) * P + p;
  for (int ki = 0; ki < (int)kh; ki++) {
    const int ih = h0 + ki;
    for (int kj = 0; kj < (int)kw; kj++, dst += P) {
      const int iw = w0 + kj;
      *dst = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? src[ih * W + iw] : 0.0f;
    }
  }
}
/* One input element gathers its column entries, kernel rows then columns
 * ascending (the order the CPU's col2im adds them in). */
DT__CU_HD inline void dt__cu_col2im_at(int64_t i, const dt_kernel_args &a) {
  const int64_t C = a.n[1], kh = a.n[4], kw = a.n[5], P = a.n[8] * a.n[9], K = C * kh * kw;
  const int H = (int)a.n[2], W = (int)a.n[3], s = (int)a.n[6], pad = (int)a.n[7], ho = (int)a.n[8],
            wo = (int)a.n[9];
  const int64_t plane = i / ((int64_t)H * W), img = plane / C, c = plane % C;
  const int q = (int)(i % ((int64_t)H * W)), ih = q / W, iw = q % W;
  const float *col = a.p[1] + (img * K + c * kh * kw) * P;
  float acc = a.p[0][i];
  for (int ki = 0; ki < (int)kh; ki++) {
    int oh = ih + pad - ki;
    if (oh < 0 || (s != 1 && oh % s != 0)) continue;
    if ((oh /= s) >= ho) continue;
    for (int kj = 0; kj < (int)kw; kj++) {
      int ow = iw + pad - kj;
      if (ow < 0 || (s != 1 && ow % s != 0)) continue;
      if ((ow /= s) >= wo) continue;
      acc += col[(int64_t)(ki * (int)kw + kj) * P + (int64_t)oh * wo + ow];
    }
  }
  a.p[0][i] = acc;
}
DT__CU_HD inline void dt__cu_conv_bias_at(int64_t i, const dt_kernel_args &a) {
  a.p[0][i] = a.p[1][(i / (a.n[8] * a.n[9])) % a.n[10]];
}
/* Pooling: the CPU's rules (first maximum; a NaN wins, the last NaN of a
 * window takes the gradient), window order. */
DT__CU_HD inline void dt__cu_maxpool_at(int64_t i, const dt_kernel_args &a) {
  const int64_t H = a.n[1], W = a.n[2], ho = a.n[3], wo = a.n[4], k = a.n[5], s = a.n[6];
  int64_t ow = i % wo, oh = (i / wo) % ho, pl = i / (wo * ho);
  const float *win = a.p[1] + pl * H * W + oh * s * W + ow * s;
  float best = win[0];
  for (int64_t r = 0; r < k; r++)
    for (int64_t c = 0; c < k; c++) {
      float v = win[r * W + c];
      if (v > best || (v != v && best == best)) best = v;
    }
  a.p[0][i] = best;
}
DT__CU_HD inline void dt__cu_avgpool_at(int64_t i, const dt_kernel_args &a) {
  const int64_t H = a.n[1], W = a.n[2], ho = a.n[3], wo = a.n[4], k = a.n[5], s = a.n[6];
  int64_t ow = i % wo, oh = (i / wo) % ho, pl = i / (wo * ho);
  const float *win = a.p[1] + pl * H * W + oh * s * W + ow * s;
  float sum = 0.0f;
  for (int64_t r = 0; r < k; r++)
    for (int64_t c = 0; c < k; c++) sum += win[r * W + c];
  a.p[0][i] = sum / (float)(k * k);
}
/* The windows [lo,hi] along one axis that contain input position x. */
DT__CU_HD inline void dt__cu_pool_span(int64_t x, int64_t k, int64_t s, int64_t n, int64_t *lo, int64_t *hi) {
  int64_t first = x - k + 1;
  *lo = first > 0 ? (first + s - 1) / s : 0;
  *hi = x / s < n - 1 ? x / s : n - 1;
}
/* Windows that do not overlap (stride >= kernel): one thread per window
 * adds its gradient to its (first) maximum, or its last NaN, as on the CPU;
 * no input is in two windows, so no two threads touch one element. (The
 * gather below spent 142 us on the CNN's first pool at batch 256 on an
 * H200.) */
DT__CU_HD inline void dt__cu_maxpool_bwd_win_at(int64_t i, const dt_kernel_args &a) {
  const int64_t H = a.n[1], W = a.n[2], ho = a.n[3], wo = a.n[4], pl = i / (ho * wo);
  const int k = (int)a.n[5], s = (int)a.n[6], o = (int)(i % (ho * wo)), oh = o / (int)wo, ow = o % (int)wo;
  const float *xp = a.p[2] + pl * H * W;
  const float best = a.p[3][i];
  const int nan = best != best;
  int64_t at = -1;
  for (int r = 0; r < k && (nan || at < 0); r++)
    for (int c = 0; c < k && (nan || at < 0); c++) {
      const int64_t e = (int64_t)(oh * s + r) * W + ow * s + c;
      float v = xp[e];
      if (nan ? v != v : v == best) at = e;
    }
  if (at >= 0) a.p[0][pl * H * W + at] += a.p[1][i];
}
/* One input element: the gradient of every window whose (first) maximum it
 * is (the last NaN when the window's output is NaN, as on the CPU), windows
 * in row-major order (the order the CPU adds them in). */
DT__CU_HD inline void dt__cu_maxpool_bwd_at(int64_t i, const dt_kernel_args &a) {
  const int64_t H = a.n[1], W = a.n[2], ho = a.n[3], wo = a.n[4], k = a.n[5], s = a.n[6];
  int64_t iw = i % W, ih = (i / W) % H, pl = i / (W * H), hlo, hhi, wlo, whi;
  dt__cu_pool_span(ih, k, s, ho, &hlo, &hhi);
  dt__cu_pool_span(iw, k, s, wo, &wlo, &whi);
  const float *xp = a.p[2] + pl * H * W;
  float acc = a.p[0][i];
  for (int64_t oh = hlo; oh <= hhi; oh++)
    for (int64_t ow = wlo; ow <= whi; ow++) {
      int64_t o = (pl * ho + oh) * wo + ow, at = -1;
      float best = a.p[3][o];
      int nan = best != best;
      for (int64_t r = 0; r < k && (nan || at < 0); r++)
        for (int64_t c = 0; c < k && (nan || at < 0); c++) {
          float v = xp[(oh * s + r) * W + ow * s + c];
          if (nan ? v != v : v == best) at = (oh * s + r) * W + ow * s + c;
        }
      if (at == ih * W + iw) acc += a.p[1][o];
    }
  a.p[0][i] = acc;
}
DT__CU_HD inline void dt__cu_avgpool_bwd_at(int64_t i, const dt_kernel_args &a) {
  const int64_t H = a.n[1], W = a.n[2], ho = a.n[3], wo = a.n[4], k = a.n[5], s = a.n[6];
  int64_t iw = i % W, ih = (i / W) % H, pl = i / (W * H), hlo, hhi, wlo, whi;
  dt__cu_pool_span(ih, k, s, ho, &hlo, &hhi);
  dt__cu_pool_span(iw, k, s, wo, &wlo, &whi);
  const float kk = (float)(k * k);
  float acc = a.p[0][i];
  for (int64_t oh = hlo; oh <= hhi; oh++)
    for (int64_t ow = wlo; ow <= whi; ow++) acc += a.p[1][(pl * ho + oh) * wo + ow] / kk;
  a.p[0][i] = acc;
}

/* Permute: one output element; the input's shape and strides rebuilt from
 * the output shape and the packed permutation (n1 <= 6 dims). */
DT__CU_HD inline void dt__cu_permute_at(int64_t i, const dt_kernel_args &a) {
  const int nd = (int)a.n[1];
  int64_t xs[6], st[6];
  int pm[6];
  for (int d = 0; d < nd; d++) {
    pm[d] = (int)((a.n[8] >> (4 * d)) & 15);
    xs[pm[d]] = a.n[2 + d];
  }
  int64_t s = 1;
  for (int d = nd - 1; d >= 0; d--) {
    st[d] = s;
    s *= xs[d];
  }
  int64_t rem = i, off = 0;
  for (int d = nd - 1; d >= 0; d--) {
    const int64_t yd = a.n[2 + d];
    off += (rem % yd) * st[pm[d]];
    rem /= yd;
  }
  if (a.n[9]) a.p[0][off] += a.p[1][i];
  else a.p[0][i] = a.p[1][off];
}
/* Strided rows: slice / split / concat forward (=) and backward (+=). */
DT__CU_HD inline void dt__cu_copy_rows_at(int64_t i, const dt_kernel_args &a) {
  const int64_t o = i / a.n[1], c = i % a.n[1];
  if (a.n[4]) a.p[0][o * a.n[2] + c] += a.p[1][o * a.n[3] + c];
  else a.p[0][o * a.n[2] + c] = a.p[1][o * a.n[3] + c];
}
DT__CU_HD inline void dt__cu_causal_mask_at(int64_t i, const dt_kernel_args &a) {
  const int64_t t = a.n[1], col = i % t, row = (i / t) % t;
  if (a.n[2]) {
    if (col <= row) a.p[0][i] += a.p[1][i];
  } else {
    a.p[0][i] = col <= row ? a.p[1][i] : -INFINITY;
  }
}
DT__CU_HD inline void dt__cu_rmsprop_at(int64_t i, const dt_kernel_args &a) {
  dt__optim_rmsprop_at(dt__optim_rmsprop_unpack(a.f), a.p[0], a.p[1], a.p[2], a.p[3], (size_t)i);
}
/* Batch norm (x [N, C, HW]): per channel statistics and gradient sums in
 * the CPU's order (double sums over images then positions), per element
 * normalisation and input gradient with the CPU's float expressions. */
/* What one channel's statistics become, from its sums s (of x) and v (of
 * (x - mean)^2, around s / m): mean and 1/std, running statistics. Shared by
 * the per-channel loop below and the GPU's one-block-per-channel kernel. */
DT__CU_HD inline void dt__cu_bn_stats_fin(int64_t ch, const dt_kernel_args &a, double s, double v) {
  const int64_t c = a.n[1], m = a.n[0] * a.n[2];
  float *rm = a.p[2], *rv = a.p[3];
  float mu, rs;
  if (a.n[3]) {
    double dmu = s / (double)m;
    mu = (float)dmu;
    rs = (float)(1.0 / sqrt(v / (double)m + (double)a.f[0]));
    if (rm && rv) {
      double mom = (double)a.f[1];
      rm[ch] = (float)((1.0 - mom) * (double)rm[ch] + mom * dmu);
      rv[ch] = (float)((1.0 - mom) * (double)rv[ch] + mom * v / (double)(m - 1));
    }
  } else {
    mu = rm[ch];
    rs = (float)(1.0 / sqrt((double)rv[ch] + (double)a.f[0]));
  }
  a.p[0][ch] = mu;
  a.p[0][c + ch] = rs;
}
DT__CU_HD inline void dt__cu_bn_stats_at(int64_t ch, const dt_kernel_args &a) {
  const int64_t nb = a.n[0], c = a.n[1], hw = a.n[2], m = nb * hw;
  const float *xd = a.p[1];
  double s = 0.0, v = 0.0;
  if (a.n[3]) {
    for (int64_t n = 0; n < nb; n++) {
      const float *p = xd + (n * c + ch) * hw;
      for (int64_t t = 0; t < hw; t++) s += (double)p[t];
    }
    double dmu = s / (double)m;
    for (int64_t n = 0; n < nb; n++) {
      const float *p = xd + (n * c + ch) * hw;
      for (int64_t t = 0; t < hw; t++) {
        double e = (double)p[t] - dmu;
        v += e * e;
      }
    }
  }
  dt__cu_bn_stats_fin(ch, a, s, v);
}
DT__CU_HD inline void dt__cu_bn_at(int64_t i, const dt_kernel_args &a) {
  const int64_t c = a.n[1], hw = a.n[2], ch = (i / hw) % c;
  const float mu = a.p[2][ch], rs = a.p[2][c + ch];
  const float gam = a.p[3] ? a.p[3][ch] : 1.0f, bet = a.p[4] ? a.p[4][ch] : 0.0f;
  a.p[0][i] = (a.p[1][i] - mu) * rs * gam + bet;
}
DT__CU_HD inline void dt__cu_bn_bwd_ch_fin(int64_t ch, const dt_kernel_args &a, double sg, double sgx) {
  const int64_t c = a.n[1];
  const double m = (double)(a.n[0] * a.n[2]);
  if (a.p[0]) a.p[0][ch] += (float)sgx;
  if (a.p[1]) a.p[1][ch] += (float)sg;
  a.p[5][ch] = (float)(sg / m);
  a.p[5][c + ch] = (float)(sgx / m);
}
DT__CU_HD inline void dt__cu_bn_bwd_ch_at(int64_t ch, const dt_kernel_args &a) {
  const int64_t nb = a.n[0], c = a.n[1], hw = a.n[2];
  const float *go = a.p[2], *xd = a.p[3];
  const float mu = a.p[4][ch], rs = a.p[4][c + ch];
  double sg = 0.0, sgx = 0.0;
  for (int64_t n = 0; n < nb; n++) {
    const int64_t base = (n * c + ch) * hw;
    for (int64_t s = 0; s < hw; s++) {
      sg += (double)go[base + s];
      sgx += (double)go[base + s] * (double)((xd[base + s] - mu) * rs);
    }
  }
  dt__cu_bn_bwd_ch_fin(ch, a, sg, sgx);
}
DT__CU_HD inline void dt__cu_bn_bwd_at(int64_t i, const dt_kernel_args &a) {
  const int64_t c = a.n[1], hw = a.n[2], ch = (i / hw) % c;
  const float mu = a.p[3][ch], rs = a.p[3][c + ch], gam = a.p[4] ? a.p[4][ch] : 1.0f;
  const float k = gam * rs, go = a.p[1][i];
  if (!a.n[3]) {
    a.p[0][i] += go * k;
    return;
  }
  const float m1 = a.p[5][ch], m2 = a.p[5][c + ch];
  float xh = (a.p[2][i] - mu) * rs;
  a.p[0][i] += k * (go - m1 - xh * m2);
}

/* GEMM: dtrain is row-major, cuBLAS column-major. Row-major C = op(A) op(B)
 * is column-major C^T = op(B)^T op(A)^T: swap the operands and m/n, keep the
 * transpose flags. This mapping is the part the host emulation checks. */
typedef struct dt__cu_gemm {
  int ta, tb;          /* column-major transposes of the first/second operand */
  int64_t m, n, k;     /* column-major C is m x n */
  float alpha, beta;
  const float *A, *B;  /* first, second operand (column-major) */
  int64_t lda, ldb, ldc;
  float *C;
  int64_t batch;                  /* >= 1 products */
  int64_t stride_a, stride_b, stride_c; /* between products, in floats */
} dt__cu_gemm;

static inline dt__cu_gemm dt__cu_gemm_map(const dt_kernel_args &a) {
  dt__cu_gemm g;
  int row_ta = (int)(a.n[3] & 1), row_tb = (int)((a.n[3] >> 1) & 1);
  int64_t M = a.n[0], N = a.n[1], K = a.n[2];
  g.ta = row_tb;
  g.tb = row_ta;
  g.m = N;
  g.n = M;
  g.k = K;
  g.alpha = a.f[0];
  g.beta = a.f[1];
  g.A = a.p[2];
  g.lda = row_tb ? K : N;
  g.B = a.p[1];
  g.ldb = row_ta ? M : K;
  g.C = a.p[0];
  g.ldc = N;
  /* cuBLAS wants every leading dimension >= 1, even where a dimension is 0. */
  if (g.lda < 1) g.lda = 1;
  if (g.ldb < 1) g.ldb = 1;
  if (g.ldc < 1) g.ldc = 1;
  g.batch = a.n[4] > 1 ? a.n[4] : 1;
  g.stride_a = a.n[6]; /* the first column-major operand is row-major B */
  g.stride_b = a.n[5];
  g.stride_c = a.n[7];
  return g;
}

/* What cuBLAS would refuse (CUBLAS_STATUS_INVALID_VALUE: a leading
 * dimension below the rows of its column-major operand) or leave undefined
 * (products of one strided batch writing overlapping outputs: they run
 * concurrently on a GPU, one after another in the host emulation), checked
 * the same way on both so that the emulation cannot pass what the GPU does
 * not do. NULL: fine. Nothing to check where C is empty (no call is made). */
static inline const char *dt__cu_gemm_invalid(const dt__cu_gemm &g) {
  if (g.m < 0 || g.n < 0 || g.k < 0) return "a negative dimension";
  if (g.m == 0 || g.n == 0) return NULL;
  const int64_t arows = g.ta ? g.k : g.m, brows = g.tb ? g.n : g.k;
  if (g.lda < arows || g.ldb < brows || g.ldc < g.m) return "a leading dimension below its operand's rows";
  if (g.batch > 1 && g.stride_c < g.ldc * g.n) return "the products of the batch write overlapping outputs";
  return NULL;
}

/* Every kernel of dt_kernel (dt_device.h) needs its case in the switch
 * below, or a caller gets DTRAIN_ERR_UNSUPPORTED at run time: a kernel added
 * to dt_device.h stops this build here until it has one (then count it). */
static_assert(DTRAIN_K_COUNT == 57, "a new dt_kernel needs its case in dt__cu_dispatch (then update this count)");

/* The one switch from kernel id to launch, over a launcher L (GPU or host):
 * L::each<F>(n, a) runs F for i in [0,n); L::acc_rows(a) is
 * DTRAIN_K_ACC_ROWS; L::sum(a, squares) a reduction;
 * L::gemm(g) a column-major SGEMM; L::conv_bias_bwd, bn_stats, bn_bwd_ch the
 * per-channel sums over [N][C][HW] (on a GPU: the bias gradient in two warp
 * passes through a scratch, the batch-norm sums one block per channel; one
 * thread per channel summing N*HW values alone took 4 ms a step for a CNN). */
/* The convolution and max-pool kernels index within a plane with int:
 * planes past INT_MAX elements are refused (as no kernel, below). */
static inline bool dt__cu_rows_fit(int64_t in_plane, int64_t out_plane) {
  return in_plane >= 0 && in_plane <= INT_MAX && out_plane >= 0 && out_plane <= INT_MAX;
}

template <class L> static dt_result dt__cu_dispatch(L &l, dt_kernel k, const dt_kernel_args &a) {
  switch (k) {
    case DTRAIN_K_ADD: return l.template each<dt__cu_add_at>(a.n[0], a);
    case DTRAIN_K_SUB: return l.template each<dt__cu_sub_at>(a.n[0], a);
    case DTRAIN_K_MUL: return l.template each<dt__cu_mul_at>(a.n[0], a);
    case DTRAIN_K_ACC: return l.template each<dt__cu_acc_at>(a.n[0], a);
    case DTRAIN_K_ACC_MUL: return l.template each<dt__cu_acc_mul_at>(a.n[0], a);
    case DTRAIN_K_ACC_ROWS: return l.acc_rows(a);
    case DTRAIN_K_ACC_MUL_ROWS: return l.template each<dt__cu_acc_mul_rows_at>(a.n[1], a);
    case DTRAIN_K_ACC_SCALAR: return l.template each<dt__cu_acc_scalar_at>(a.n[0], a);
    case DTRAIN_K_ROWS_COPY: return l.template each<dt__cu_rows_copy_at>(a.n[0], a);
    case DTRAIN_K_RELU: return l.template each<dt__cu_relu_at>(a.n[0], a);
    case DTRAIN_K_SIGMOID: return l.template each<dt__cu_sigmoid_at>(a.n[0], a);
    case DTRAIN_K_TANH: return l.template each<dt__cu_tanh_at>(a.n[0], a);
    case DTRAIN_K_RELU_BWD: return l.template each<dt__cu_relu_bwd_at>(a.n[0], a);
    case DTRAIN_K_SIGMOID_BWD: return l.template each<dt__cu_sigmoid_bwd_at>(a.n[0], a);
    case DTRAIN_K_TANH_BWD: return l.template each<dt__cu_tanh_bwd_at>(a.n[0], a);
    case DTRAIN_K_SUM: return l.sum(a, 0);
    case DTRAIN_K_SUMSQ: return l.sum(a, 1);
    case DTRAIN_K_SCALE: return l.template each<dt__cu_scale_at>(a.n[0], a);
    case DTRAIN_K_SQDIFF: return l.template each<dt__cu_sqdiff_at>(a.n[0], a);
    case DTRAIN_K_MSE_BWD: return l.template each<dt__cu_mse_bwd_at>(a.n[0], a);
    case DTRAIN_K_GEMM: {
      const dt__cu_gemm g = dt__cu_gemm_map(a);
      const char *why = dt__cu_gemm_invalid(g);
      if (!why) return l.gemm(g);
      char msg[160];
      snprintf(msg, sizeof msg, "GEMM (%lld x %lld x %lld, batch %lld): %s", (long long)a.n[0], (long long)a.n[1],
               (long long)a.n[2], (long long)g.batch, why);
      return dt_device_error(DTRAIN_ERR_INVALID_ARG, msg);
    }
    case DTRAIN_K_SOFTMAX: return l.template each<dt__cu_softmax_row>(a.n[0], a);
    case DTRAIN_K_SOFTMAX_BWD: return l.template each<dt__cu_softmax_bwd_row>(a.n[0], a);
    case DTRAIN_K_XENT: return l.template each<dt__cu_xent_row>(a.n[0], a);
    case DTRAIN_K_XENT_BWD: return l.template each<dt__cu_xent_bwd_at>(a.n[0] * a.n[1], a);
    case DTRAIN_K_SGD: return l.template each<dt__cu_sgd_at>(a.n[0], a);
    case DTRAIN_K_ADAM: return l.template each<dt__cu_adam_at>(a.n[0], a);
    case DTRAIN_K_IM2COL:
      if (!dt__cu_rows_fit(a.n[2] * a.n[3], a.n[8] * a.n[9])) break;
      return l.template each<dt__cu_im2col_at>(a.n[0] * a.n[1] * a.n[8] * a.n[9], a);
    case DTRAIN_K_COL2IM_ACC:
      if (!dt__cu_rows_fit(a.n[2] * a.n[3], a.n[8] * a.n[9])) break;
      return l.template each<dt__cu_col2im_at>(a.n[0] * a.n[1] * a.n[2] * a.n[3], a);
    case DTRAIN_K_CONV_BIAS: return l.template each<dt__cu_conv_bias_at>(a.n[0] * a.n[10] * a.n[8] * a.n[9], a);
    case DTRAIN_K_CONV_BIAS_BWD:
      if (!a.p[2]) return dt_device_error(DTRAIN_ERR_INVALID_ARG, "conv bias gradient: no scratch (p2, N*O floats)");
      return l.conv_bias_bwd(a);
    case DTRAIN_K_MAXPOOL: return l.template each<dt__cu_maxpool_at>(a.n[0] * a.n[3] * a.n[4], a);
    case DTRAIN_K_AVGPOOL: return l.template each<dt__cu_avgpool_at>(a.n[0] * a.n[3] * a.n[4], a);
    case DTRAIN_K_MAXPOOL_BWD:
      if (!dt__cu_rows_fit(a.n[1] * a.n[2], a.n[3] * a.n[4])) break;
      if (a.n[6] >= a.n[5]) return l.template each<dt__cu_maxpool_bwd_win_at>(a.n[0] * a.n[3] * a.n[4], a);
      return l.template each<dt__cu_maxpool_bwd_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_AVGPOOL_BWD: return l.template each<dt__cu_avgpool_bwd_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_DIV: return l.template each<dt__cu_div_at>(a.n[0], a);
    case DTRAIN_K_ACC_DIV: return l.template each<dt__cu_acc_div_at>(a.n[0], a);
    case DTRAIN_K_DIV_BWD_ROWS: return l.template each<dt__cu_div_bwd_rows_at>(a.n[1], a);
    case DTRAIN_K_MAP:
    case DTRAIN_K_MAP_BWD:
      /* an unknown map (the domain maps have no backward): refused below */
      if (a.n[1] < 0 || a.n[1] >= (k == DTRAIN_K_MAP ? DTRAIN_MAP_COUNT : DTRAIN_MAP_DOMAIN_POS)) break;
      if (k == DTRAIN_K_MAP) return l.template each<dt__cu_map_at>(a.n[0], a);
      return l.template each<dt__cu_map_bwd_at>(a.n[0], a);
    case DTRAIN_K_SUM_AXIS: return l.template each<dt__cu_sum_axis_at>(a.n[0] * a.n[2], a);
    case DTRAIN_K_SUM_AXIS_BWD: return l.template each<dt__cu_sum_axis_bwd_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_TRANSPOSE: return l.template each<dt__cu_transpose_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_LAYER_NORM: return l.template each<dt__cu_layer_norm_row>(a.n[0], a);
    case DTRAIN_K_LAYER_NORM_BWD: return l.template each<dt__cu_layer_norm_bwd_row>(a.n[0], a);
    case DTRAIN_K_LAYER_NORM_BWD_PARAMS: return l.template each<dt__cu_layer_norm_bwd_params_at>(a.n[1], a);
    case DTRAIN_K_EMBED: return l.template each<dt__cu_embed_at>(a.n[0] * a.n[1], a);
    case DTRAIN_K_EMBED_BWD: return l.template each<dt__cu_embed_bwd_at>(a.n[1], a);
    case DTRAIN_K_PERMUTE:
      if (a.n[1] < 0 || a.n[1] > 6) break; /* more dims than the kernel holds: refused below */
      return l.template each<dt__cu_permute_at>(a.n[0], a);
    case DTRAIN_K_COPY_ROWS: return l.template each<dt__cu_copy_rows_at>(a.n[0] * a.n[1], a);
    case DTRAIN_K_CAUSAL_MASK: return l.template each<dt__cu_causal_mask_at>(a.n[0], a);
    case DTRAIN_K_RMSPROP: return l.template each<dt__cu_rmsprop_at>(a.n[0], a);
    case DTRAIN_K_BN_STATS: return l.bn_stats(a);
    case DTRAIN_K_BN: return l.template each<dt__cu_bn_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_BN_BWD_CH: return l.bn_bwd_ch(a);
    case DTRAIN_K_BN_BWD: return l.template each<dt__cu_bn_bwd_at>(a.n[0] * a.n[1] * a.n[2], a);
    case DTRAIN_K_COUNT:
    default: break;
  }
  char msg[96];
  snprintf(msg, sizeof msg, "kernel %d has no implementation in this backend", (int)k);
  return dt_device_error(DTRAIN_ERR_UNSUPPORTED, msg);
}

#endif /* math */

/* ===========================================================================
 * Host emulation: a dt_device whose "device memory" is host memory and whose
 * kernels are the functions above run in plain loops. For tests without a
 * GPU (tests/test_cuda_emu.cc): it runs the core's whole device path.
 * =========================================================================== */
#if defined(DTRAIN_CUDA_HOST_EMULATION) && !defined(DTRAIN_CUDA__EMU_DONE)
#define DTRAIN_CUDA__EMU_DONE
#include <stdlib.h>

struct dt__cu_host_launcher {
  template <dt__cu_fn F> dt_result each(int64_t n, const dt_kernel_args &a) {
    for (int64_t i = 0; i < n; i++) F(i, a);
    return DTRAIN_OK;
  }
  dt_result acc_rows(const dt_kernel_args &a) { return each<dt__cu_acc_rows_at>(a.n[1], a); }
  dt_result sum(const dt_kernel_args &a, int squares) {
    double s = 0.0;
    for (int64_t i = 0; i < a.n[0]; i++) s += squares ? (double)a.p[1][i] * (double)a.p[1][i] : (double)a.p[1][i];
    a.p[0][0] = squares ? (float)s : (float)(s * (double)a.f[0]);
    return DTRAIN_OK;
  }
  /* The GPU's two passes (rows into the scratch p2, then each channel's
   * partial sums over the images), in plain loops. */
  dt_result conv_bias_bwd(const dt_kernel_args &a) {
    const int64_t n = a.n[0], o = a.n[10], len = a.n[8] * a.n[9];
    for (int64_t r = 0; r < n * o; r++) {
      double s = 0.0;
      for (int64_t q = 0; q < len; q++) s += (double)a.p[1][r * len + q];
      a.p[2][r] = (float)s;
    }
    for (int64_t ch = 0; ch < o; ch++) {
      double s = 0.0;
      for (int64_t img = 0; img < n; img++) s += (double)a.p[2][img * o + ch];
      a.p[0][ch] += (float)s;
    }
    return DTRAIN_OK;
  }
  dt_result bn_stats(const dt_kernel_args &a) { return each<dt__cu_bn_stats_at>(a.n[1], a); }
  dt_result bn_bwd_ch(const dt_kernel_args &a) { return each<dt__cu_bn_bwd_ch_at>(a.n[1], a); }
  /* Reference column-major SGEMM with cuBLAS's semantics (beta 0: C is not read). */
  dt_result gemm(const dt__cu_gemm &g) {
    for (int64_t b = 0; b < g.batch; b++) { /* cublasSgemmStridedBatched: one product after another */
      const float *A = g.A + b * g.stride_a, *B = g.B + b * g.stride_b;
      float *C = g.C + b * g.stride_c;
      for (int64_t j = 0; j < g.n; j++)
        for (int64_t i = 0; i < g.m; i++) {
          double s = 0.0;
          for (int64_t l = 0; l < g.k; l++) {
            float x = g.ta ? A[l + i * g.lda] : A[i + l * g.lda];
            float y = g.tb ? B[j + l * g.ldb] : B[l + j * g.ldb];
            s += (double)x * (double)y;
          }
          float *c = &C[i + j * g.ldc];
          *c = g.beta == 0.0f ? g.alpha * (float)s : g.alpha * (float)s + g.beta * *c;
        }
    }
    return DTRAIN_OK;
  }
};

static dt_result dt__cu_emu_alloc(dt_device *d, size_t bytes, void **out) {
  (void)d;
  *out = malloc(bytes ? bytes : 1);
  if (!*out) {
    char msg[96];
    snprintf(msg, sizeof msg, "emulated alloc of %zu bytes: out of memory", bytes);
    return dt_device_error(DTRAIN_ERR_NOMEM, msg);
  }
  return DTRAIN_OK;
}
static void dt__cu_emu_free(dt_device *d, void *p, size_t bytes) {
  (void)d;
  (void)bytes;
  free(p);
}
static dt_result dt__cu_emu_zero(dt_device *d, void *p, size_t bytes) {
  (void)d;
  memset(p, 0, bytes);
  return DTRAIN_OK;
}
static dt_result dt__cu_emu_copy(dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_kind kind) {
  (void)d;
  (void)kind;
  memcpy(dst, src, bytes);
  return DTRAIN_OK;
}
static dt_result dt__cu_emu_sync(dt_device *d) {
  (void)d;
  return DTRAIN_OK;
}
static dt_result dt__cu_emu_run(dt_device *d, dt_kernel k, const dt_kernel_args *a) {
  (void)d;
  dt__cu_host_launcher l;
  return dt__cu_dispatch(l, k, *a);
}

/* Peer copies between emulated devices: their memory is all host memory. */
static dt_result dt__cu_emu_peer_copy(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes) {
  (void)d;
  (void)from;
  memcpy(dst, src, bytes);
  return DTRAIN_OK;
}

/* A process-wide emulated device named "cuda-emu". */
static dt_device *dt_cuda_emu_device(void) {
  static dt_device dev = {"cuda-emu", NULL, dt__cu_emu_alloc, dt__cu_emu_free, dt__cu_emu_zero,
                          dt__cu_emu_copy, dt__cu_emu_sync, dt__cu_emu_run, dt__cu_emu_peer_copy,
                          NULL, NULL, NULL, NULL};
  return &dev;
}

/* Several emulated devices (multi-device tests: mirrored over devices): a
 * new one named "cuda-emu:<index>" with the same functions (peer copies,
 * no group hooks: the core's ring runs). NULL when out of memory. Free with
 * dt_cuda_emu_device_free. */
struct dt__cu_emu_dev {
  dt_device d;
  char name[32];
};
static inline dt_device *dt_cuda_emu_device_create(int index) {
  dt__cu_emu_dev *e = (dt__cu_emu_dev *)calloc(1, sizeof(dt__cu_emu_dev));
  if (!e) {
    dt_device_error(DTRAIN_ERR_NOMEM, "dt_cuda_emu_device_create: out of memory");
    return NULL;
  }
  e->d = *dt_cuda_emu_device();
  snprintf(e->name, sizeof e->name, "cuda-emu:%d", index);
  e->d.name = e->name;
  e->d.impl = e;
  return &e->d;
}
static inline void dt_cuda_emu_device_free(dt_device *d) {
  if (d && d != dt_cuda_emu_device()) free(d->impl);
}

/* A guarded emulated device, "cuda-emu-guarded" (tests): the same kernels,
 * but its memory is handed out with bit 55 of the address set, where no
 * host load or store can go on a 64-bit host (non-canonical on x86-64,
 * kernel half on aarch64): the core reading or writing device memory on the
 * host -- which the plain emulation, whose memory is host memory, lets pass
 * and a GPU would not -- crashes (SIGSEGV / ASan) instead of passing. Its
 * functions take the bit off the pointers they are given (kernel arguments
 * too) before touching memory. On 32-bit hosts it is the plain emulation. */
static inline void *dt__cu_guard_off(const void *p) {
#if UINTPTR_MAX > 0xFFFFFFFFu
  return (void *)((uintptr_t)p & ~((uintptr_t)1 << 55));
#else
  return (void *)(uintptr_t)p;
#endif
}
static dt_result dt__cu_guard_alloc(dt_device *d, size_t bytes, void **out) {
  dt_result r = dt__cu_emu_alloc(d, bytes, out);
#if UINTPTR_MAX > 0xFFFFFFFFu
  if (r == DTRAIN_OK) *out = (void *)((uintptr_t)*out | ((uintptr_t)1 << 55));
#endif
  return r;
}
static void dt__cu_guard_free(dt_device *d, void *p, size_t bytes) { dt__cu_emu_free(d, dt__cu_guard_off(p), bytes); }
static dt_result dt__cu_guard_zero(dt_device *d, void *p, size_t bytes) {
  return dt__cu_emu_zero(d, dt__cu_guard_off(p), bytes);
}
static dt_result dt__cu_guard_copy(dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_kind kind) {
  return dt__cu_emu_copy(d, dt__cu_guard_off(dst), dt__cu_guard_off(src), bytes, kind);
}
static dt_result dt__cu_guard_run(dt_device *d, dt_kernel k, const dt_kernel_args *a) {
  dt_kernel_args b = *a;
  for (int i = 0; i < 6; i++)
    if (b.p[i]) b.p[i] = (float *)dt__cu_guard_off(b.p[i]);
  if (b.labels) b.labels = (const int32_t *)dt__cu_guard_off(b.labels);
  return dt__cu_emu_run(d, k, &b);
}
static dt_result dt__cu_guard_peer_copy(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes) {
  return dt__cu_emu_peer_copy(d, dt__cu_guard_off(dst), from, dt__cu_guard_off(src), bytes);
}
/* Makes a device of dt_cuda_emu_device_create guarded (before it allocates
 * anything); returns it. */
static inline dt_device *dt_cuda_emu_guard(dt_device *d) {
  if (!d || d == dt_cuda_emu_device()) return d;
  d->alloc = dt__cu_guard_alloc;
  d->free = dt__cu_guard_free;
  d->zero = dt__cu_guard_zero;
  d->copy = dt__cu_guard_copy;
  d->run = dt__cu_guard_run;
  d->peer_copy = dt__cu_guard_peer_copy;
  return d;
}
/* A new guarded device "cuda-emu-guarded:<index>"; NULL when out of
 * memory. Free with dt_cuda_emu_device_free. */
static inline dt_device *dt_cuda_emu_guarded_device_create(int index) {
  dt_device *d = dt_cuda_emu_device_create(index);
  if (!d) return NULL;
  dt__cu_emu_dev *e = (dt__cu_emu_dev *)d->impl;
  snprintf(e->name, sizeof e->name, "cuda-emu-guarded:%d", index);
  return dt_cuda_emu_guard(d);
}
#endif /* host emulation */

/* ===========================================================================
 * The CUDA implementation
 * =========================================================================== */
#if defined(DTRAIN_CUDA_IMPLEMENTATION) && !defined(DTRAIN_CUDA__IMPL_DONE)
#define DTRAIN_CUDA__IMPL_DONE
#ifndef __CUDACC__
#  error "DTRAIN_CUDA_IMPLEMENTATION needs nvcc (compile this file as .cu)"
#endif
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdlib.h>
#ifdef DTRAIN_USE_NCCL
#  include <nccl.h>
#endif

#define DT__CUDA_MAX_PEERS 64

typedef struct dt__cuda {
  int index;
  cudaStream_t stream;
  cublasHandle_t blas;
  char name[32];
  /* peer[j]: peer access from this GPU to GPU j was tried (at the first
   * peer copy from j; only the thread that runs the copies touches it). */
  unsigned char peer[DT__CUDA_MAX_PEERS];
} dt__cuda;

static const char *dt__cuda_blas_str(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

/* A CUDA runtime error as a dt_result: out of memory is DTRAIN_ERR_NOMEM,
 * the rest DTRAIN_ERR_IO ("the device failed"), with the CUDA error string. */
static dt_result dt__cuda_fail(const char *dev, const char *what, cudaError_t e) {
  char msg[320];
  snprintf(msg, sizeof msg, "%.31s: %.120s: %.90s (%.40s)", dev, what, cudaGetErrorString(e), cudaGetErrorName(e));
  (void)cudaGetLastError(); /* clear a non-sticky error */
  return dt_device_error(e == cudaErrorMemoryAllocation ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO, msg);
}

#define DT__CUDA_CHECK(dev, what, call)                              \
  do {                                                               \
    cudaError_t dt__e_ = (call);                                     \
    if (dt__e_ != cudaSuccess) return dt__cuda_fail(dev, what, dt__e_); \
  } while (0)

#define DT__CU_THREADS 256

template <dt__cu_fn F> __global__ void dt__cu_each_kernel(int64_t n, dt_kernel_args a) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x)
    F(i, a);
}

/* One block: each thread sums a strided part in double, then a tree in
 * shared memory. (Fine for losses and norms; not a fast large reduction.) */
__global__ void dt__cu_sum_kernel(dt_kernel_args a, int squares) {
  __shared__ double part[DT__CU_THREADS];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < a.n[0]; i += blockDim.x) {
    double v = (double)a.p[1][i];
    s += squares ? v * v : v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = DT__CU_THREADS / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) a.p[0][0] = squares ? (float)part[0] : (float)(part[0] * (double)a.f[0]);
}

/* Per-channel sums over x [N][C][HW] (channel = blockIdx.x): each thread
 * sums a strided part of the channel's N*HW values in double, then a tree in
 * shared memory; the results go through the same finalizers as the
 * per-channel loops above (same formulas, another order of the sums). */
__device__ void dt__cu_block_sum2(double *s0, double *s1) {
  __shared__ double part[2][DT__CU_THREADS];
  part[0][threadIdx.x] = *s0;
  part[1][threadIdx.x] = *s1;
  __syncthreads();
  for (int w = DT__CU_THREADS / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) {
      part[0][threadIdx.x] += part[0][threadIdx.x + w];
      part[1][threadIdx.x] += part[1][threadIdx.x + w];
    }
    __syncthreads();
  }
  *s0 = part[0][0];
  *s1 = part[1][0];
  __syncthreads(); /* part is reused by the caller's next sum */
}
/* A thread's walk over one channel of x [N][C][HW]: elements threadIdx.x,
 * threadIdx.x + blockDim.x, ... of the channel's N*HW, the (image, pixel)
 * place moved by additions: a 64-bit division per element (e / HW, e % HW)
 * made these kernels slow on a GPU (conv1's bias gradient at batch 256: 454
 * us for 32 channels on an H200). */
struct dt__cu_chan_walk {
  int64_t img, q, hw, c, step_img, step_q;
  __device__ dt__cu_chan_walk(int64_t n_hw, int64_t n_c) : hw(n_hw), c(n_c) {
    if (hw <= 0) { /* no pixels: nothing to walk */
      img = INT64_MAX;
      q = step_img = step_q = 0;
      return;
    }
    img = (int64_t)threadIdx.x / hw;
    q = (int64_t)threadIdx.x % hw;
    step_img = (int64_t)blockDim.x / hw;
    step_q = (int64_t)blockDim.x % hw;
  }
  __device__ int64_t at(int64_t ch) const { return (img * c + ch) * hw + q; }
  __device__ void next() {
    img += step_img;
    q += step_q;
    if (q >= hw) {
      q -= hw;
      img++;
    }
  }
};
__global__ void dt__cu_bn_stats_kernel(dt_kernel_args a) {
  const int64_t ch = blockIdx.x, c = a.n[1], hw = a.n[2], m = a.n[0] * hw;
  const float *xd = a.p[1];
  double s = 0.0, v = 0.0, unused = 0.0;
  if (a.n[3]) {
    for (dt__cu_chan_walk w(hw, c); w.img < a.n[0]; w.next()) s += (double)xd[w.at(ch)];
    dt__cu_block_sum2(&s, &unused);
    const double dmu = s / (double)m;
    for (dt__cu_chan_walk w(hw, c); w.img < a.n[0]; w.next()) {
      double d = (double)xd[w.at(ch)] - dmu;
      v += d * d;
    }
    dt__cu_block_sum2(&v, &unused);
  }
  if (threadIdx.x == 0) dt__cu_bn_stats_fin(ch, a, s, v);
}
__global__ void dt__cu_bn_bwd_ch_kernel(dt_kernel_args a) {
  const int64_t ch = blockIdx.x, c = a.n[1], hw = a.n[2];
  const float *go = a.p[2], *xd = a.p[3];
  const float mu = a.p[4][ch], rs = a.p[4][c + ch];
  double sg = 0.0, sgx = 0.0;
  for (dt__cu_chan_walk w(hw, c); w.img < a.n[0]; w.next()) {
    const int64_t at = w.at(ch);
    sg += (double)go[at];
    sgx += (double)go[at] * (double)((xd[at] - mu) * rs);
  }
  dt__cu_block_sum2(&sg, &sgx);
  if (threadIdx.x == 0) dt__cu_bn_bwd_ch_fin(ch, a, sg, sgx);
}

/* A warp's double sum, lanes combined in a fixed order (deterministic). */
__device__ inline double dt__cu_warp_sum(double s) {
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  return s;
}
/* The conv bias gradient in two passes, both deterministic: one warp per
 * (image, channel) row of gy [N][O][P] sums its P values into part[N][O];
 * then one warp per channel sums its N partial sums into gb. (One block per
 * channel walking all N*P values kept 32 of 132 multiprocessors busy: 310 us
 * for conv1 at batch 256 on an H200.) */
__global__ void dt__cu_conv_bias_rows_kernel(const float *gy, int64_t rows, int64_t len, float *part) {
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x & 31);
  if (row >= rows) return; /* a whole warp: row is the warp's */
  const float *x = gy + row * len;
  double s = 0.0;
  for (int64_t q = lane; q < len; q += 32) s += (double)x[q];
  s = dt__cu_warp_sum(s);
  if (lane == 0) part[row] = (float)s;
}
__global__ void dt__cu_conv_bias_cols_kernel(const float *part, int64_t n, int64_t channels, float *gb) {
  const int64_t ch = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x & 31);
  if (ch >= channels) return;
  double s = 0.0;
  for (int64_t img = lane; img < n; img += 32) s += (double)part[img * channels + ch];
  s = dt__cu_warp_sum(s);
  if (lane == 0) gb[ch] += (float)s;
}

/* DTRAIN_K_ACC_ROWS, p0[j] += f0 * sum_r p1[r*n1 + j]: a block of 32 columns
 * by 8 row lanes; lane y sums rows y, y+8, ... of its column, then the 8
 * lanes are added in order (deterministic). (One thread per column walking
 * every row: 31 us for 800 columns of 256 rows on an H200.) */
#define DT__CU_ROW_LANES 8
__global__ void dt__cu_acc_rows_kernel(dt_kernel_args a) {
  __shared__ float part[DT__CU_ROW_LANES][32];
  const int64_t cols = a.n[1], rows = a.n[0] / a.n[1];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (j < cols)
    for (int64_t r = threadIdx.y; r < rows; r += DT__CU_ROW_LANES) s += a.p[1][r * cols + j];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float t = part[0][threadIdx.x];
    for (int y = 1; y < DT__CU_ROW_LANES; y++) t += part[y][threadIdx.x];
    a.p[0][j] += a.f[0] * t;
  }
}

struct dt__cu_gpu_launcher {
  dt__cuda *c;
  template <dt__cu_fn F> dt_result each(int64_t n, const dt_kernel_args &a) {
    if (n <= 0) return DTRAIN_OK;
    int64_t blocks = (n + DT__CU_THREADS - 1) / DT__CU_THREADS;
    if (blocks > 65535) blocks = 65535; /* grid-stride loop covers the rest */
    dt__cu_each_kernel<F><<<(unsigned)blocks, DT__CU_THREADS, 0, c->stream>>>(n, a);
    DT__CUDA_CHECK(c->name, "kernel launch", cudaGetLastError());
    return DTRAIN_OK;
  }
  dt_result sum(const dt_kernel_args &a, int squares) {
    dt__cu_sum_kernel<<<1, DT__CU_THREADS, 0, c->stream>>>(a, squares);
    DT__CUDA_CHECK(c->name, "reduction kernel launch", cudaGetLastError());
    return DTRAIN_OK;
  }
  /* One block per channel (a grid's x dimension holds 2^31 - 1 channels). */
  dt_result per_channel(void (*kernel)(dt_kernel_args), int64_t channels, const dt_kernel_args &a) {
    if (channels <= 0) return DTRAIN_OK;
    if (channels > 2147483647) return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "per-channel sums: more than 2^31 - 1 channels");
    kernel<<<(unsigned)channels, DT__CU_THREADS, 0, c->stream>>>(a);
    DT__CUDA_CHECK(c->name, "per-channel kernel launch", cudaGetLastError());
    return DTRAIN_OK;
  }
  /* p2 the scratch [N][O] (dt_device.h). */
  dt_result conv_bias_bwd(const dt_kernel_args &a) {
    const int64_t n = a.n[0], o = a.n[10], rows = n * o;
    if (rows <= 0) return DTRAIN_OK;
    const int64_t b1 = (rows + 7) / 8, b2 = (o + 7) / 8; /* 8 warps a block */
    if (b1 > 2147483647) return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "conv bias gradient: too many rows");
    dt__cu_conv_bias_rows_kernel<<<(unsigned)b1, 256, 0, c->stream>>>(a.p[1], rows, a.n[8] * a.n[9], a.p[2]);
    DT__CUDA_CHECK(c->name, "kernel launch", cudaGetLastError());
    dt__cu_conv_bias_cols_kernel<<<(unsigned)b2, 256, 0, c->stream>>>(a.p[2], n, o, a.p[0]);
    DT__CUDA_CHECK(c->name, "kernel launch", cudaGetLastError());
    return DTRAIN_OK;
  }
  dt_result acc_rows(const dt_kernel_args &a) {
    if (a.n[1] <= 0) return DTRAIN_OK;
    const int64_t blocks = (a.n[1] + 31) / 32;
    if (blocks > 2147483647) return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "row sums: too many columns");
    dt__cu_acc_rows_kernel<<<(unsigned)blocks, dim3(32, DT__CU_ROW_LANES), 0, c->stream>>>(a);
    DT__CUDA_CHECK(c->name, "kernel launch", cudaGetLastError());
    return DTRAIN_OK;
  }
  dt_result bn_stats(const dt_kernel_args &a) { return per_channel(dt__cu_bn_stats_kernel, a.n[1], a); }
  dt_result bn_bwd_ch(const dt_kernel_args &a) { return per_channel(dt__cu_bn_bwd_ch_kernel, a.n[1], a); }
  dt_result gemm(const dt__cu_gemm &g) {
    if (g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX || g.lda > INT_MAX || g.ldb > INT_MAX)
      return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "cublasSgemm: a dimension exceeds INT_MAX");
    if (g.batch > INT_MAX)
      return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "cublasSgemmStridedBatched: the batch exceeds INT_MAX");
    if (g.m == 0 || g.n == 0) return DTRAIN_OK;
    cublasOperation_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    int lda = (int)(g.lda > 0 ? g.lda : 1), ldb = (int)(g.ldb > 0 ? g.ldb : 1);
    cublasStatus_t s =
        g.batch > 1 ? cublasSgemmStridedBatched(c->blas, ta, tb, (int)g.m, (int)g.n, (int)g.k, &g.alpha, g.A, lda,
                                                (long long)g.stride_a, g.B, ldb, (long long)g.stride_b, &g.beta, g.C,
                                                (int)g.ldc, (long long)g.stride_c, (int)g.batch)
                    : cublasSgemm(c->blas, ta, tb, (int)g.m, (int)g.n, (int)g.k, &g.alpha, g.A, lda, g.B, ldb,
                                  &g.beta, g.C, (int)g.ldc);
    if (s != CUBLAS_STATUS_SUCCESS) {
      char msg[160];
      snprintf(msg, sizeof msg, "%.31s: cublasSgemm%s(%lld x %lld x %lld): %s", c->name,
               g.batch > 1 ? "StridedBatched" : "", (long long)g.m, (long long)g.n, (long long)g.k,
               dt__cuda_blas_str(s));
      return dt_device_error(s == CUBLAS_STATUS_ALLOC_FAILED ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO, msg);
    }
    return DTRAIN_OK;
  }
};

static dt_result dt__cuda_select(dt__cuda *c) {
  DT__CUDA_CHECK(c->name, "cudaSetDevice", cudaSetDevice(c->index));
  return DTRAIN_OK;
}

static dt_result dt__cuda_alloc(dt_device *d, size_t bytes, void **out) {
  dt__cuda *c = (dt__cuda *)d->impl;
  *out = NULL;
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    char what[80];
    snprintf(what, sizeof what, "cudaMalloc of %zu bytes", bytes);
    *out = NULL;
    return dt__cuda_fail(c->name, what, e);
  }
  return DTRAIN_OK;
}

static void dt__cuda_free(dt_device *d, void *p, size_t bytes) {
  dt__cuda *c = (dt__cuda *)d->impl;
  (void)bytes;
  if (!p) return;
  /* Work queued on the stream may still use p. */
  if (dt__cuda_select(c) == DTRAIN_OK) (void)cudaStreamSynchronize(c->stream);
  (void)cudaFree(p);
}

static dt_result dt__cuda_zero(dt_device *d, void *p, size_t bytes) {
  dt__cuda *c = (dt__cuda *)d->impl;
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  DT__CUDA_CHECK(c->name, "cudaMemsetAsync", cudaMemsetAsync(p, 0, bytes, c->stream));
  return DTRAIN_OK;
}

static dt_result dt__cuda_copy(dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_kind kind) {
  dt__cuda *c = (dt__cuda *)d->impl;
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  cudaMemcpyKind k = kind == DTRAIN_COPY_H2D   ? cudaMemcpyHostToDevice
                     : kind == DTRAIN_COPY_D2H ? cudaMemcpyDeviceToHost
                                               : cudaMemcpyDeviceToDevice;
  DT__CUDA_CHECK(c->name, "cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, k, c->stream));
  /* The host may reuse or read its buffer as soon as we return. */
  if (kind != DTRAIN_COPY_D2D) DT__CUDA_CHECK(c->name, "cudaStreamSynchronize", cudaStreamSynchronize(c->stream));
  return DTRAIN_OK;
}

static dt_result dt__cuda_sync(dt_device *d) {
  dt__cuda *c = (dt__cuda *)d->impl;
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  DT__CUDA_CHECK(c->name, "cudaStreamSynchronize", cudaStreamSynchronize(c->stream));
  return DTRAIN_OK;
}

static dt_result dt__cuda_run(dt_device *d, dt_kernel k, const dt_kernel_args *a) {
  dt__cuda *c = (dt__cuda *)d->impl;
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  dt__cu_gpu_launcher l;
  l.c = c;
  return dt__cu_dispatch(l, k, *a);
}

/* ---- several GPUs: peer copies and (DTRAIN_USE_NCCL) the NCCL group ---------------- */

static dt_result dt__cuda_peer_copy(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes);

/* `from` must be a device of this backend (it has our peer_copy). */
static dt__cuda *dt__cuda_of(dt_device *d) { return d && d->peer_copy == dt__cuda_peer_copy ? (dt__cuda *)d->impl : NULL; }

/* Peer access from GPU c (the current device) to GPU j, tried once per
 * pair, at the pair's first peer copy: not at dt_cuda_device_create, which
 * would create a context (and take memory) on every GPU of the machine and
 * fail where some unrelated GPU is busy (exclusive-process mode). Without
 * peer access (not possible, too many peers, any other refusal) the copies
 * still work, staged by the driver, so nothing here fails; the error the
 * runtime records is cleared so that a later check does not see it. */
static void dt__cuda_enable_peer(dt__cuda *c, int j) {
  if (j == c->index || j < 0 || j >= DT__CUDA_MAX_PEERS || c->peer[j]) return;
  c->peer[j] = 1;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, c->index, j) != cudaSuccess || !can) {
    (void)cudaGetLastError();
    return;
  }
  if (cudaDeviceEnablePeerAccess(j, 0) != cudaSuccess) (void)cudaGetLastError(); /* e.g. already enabled */
}

static dt_result dt__cuda_peer_copy(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes) {
  dt__cuda *c = (dt__cuda *)d->impl, *f = dt__cuda_of(from);
  if (!f) {
    char msg[160];
    snprintf(msg, sizeof msg, "%.31s: peer copy from %.60s: not a device of the CUDA backend", c->name,
             from && from->name ? from->name : "?");
    return dt_device_error(DTRAIN_ERR_UNSUPPORTED, msg);
  }
  if (bytes == 0) return DTRAIN_OK;
  /* The source's queued work (the kernels that wrote src) first. */
  DT__CUDA_CHECK(f->name, "cudaSetDevice", cudaSetDevice(f->index));
  DT__CUDA_CHECK(f->name, "cudaStreamSynchronize (before a peer copy)", cudaStreamSynchronize(f->stream));
  dt_result r = dt__cuda_select(c);
  if (r != DTRAIN_OK) return r;
  dt__cuda_enable_peer(c, f->index);
  /* Queued on d's stream: later kernels on d see the data. Direct over
   * NVLink/PCIe where peer access is enabled, else staged by the driver. */
  DT__CUDA_CHECK(c->name, "cudaMemcpyPeerAsync",
                 cudaMemcpyPeerAsync(dst, c->index, src, f->index, bytes, c->stream));
  return DTRAIN_OK;
}

#ifdef DTRAIN_USE_NCCL
/* One NCCL communicator per device of the group (ncclCommInitAll: one
 * process drives them all); the all-reduce is a group call queued on each
 * device's stream. */
typedef struct dt__nccl {
  int n;
  ncclComm_t *comms;
  dt__cuda **devs;
} dt__nccl;

static dt_result dt__nccl_fail(const char *what, ncclResult_t r) {
  char msg[256];
  snprintf(msg, sizeof msg, "%.100s: %.120s (ncclResult %d)", what, ncclGetErrorString(r), (int)r);
  return dt_device_error(r == ncclInvalidArgument || r == ncclInvalidUsage ? DTRAIN_ERR_INVALID_ARG : DTRAIN_ERR_IO,
                         msg);
}

static void dt__nccl_destroy(void *group) {
  dt__nccl *g = (dt__nccl *)group;
  if (!g) return;
  if (g->comms)
    for (int i = 0; i < g->n; i++)
      if (g->comms[i]) (void)ncclCommDestroy(g->comms[i]);
  free(g->comms);
  free(g->devs);
  free(g);
}

static dt_result dt__nccl_create(dt_device *const *devs, int n, void **out) {
  *out = NULL;
  dt__nccl *g = (dt__nccl *)calloc(1, sizeof(dt__nccl));
  int *list = (int *)calloc((size_t)(n > 0 ? n : 1), sizeof(int));
  if (g) {
    g->n = n;
    g->comms = (ncclComm_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(ncclComm_t));
    g->devs = (dt__cuda **)calloc((size_t)(n > 0 ? n : 1), sizeof(dt__cuda *));
  }
  if (!g || !list || !g->comms || !g->devs) {
    free(list);
    dt__nccl_destroy(g);
    return dt_device_error(DTRAIN_ERR_NOMEM, "ncclCommInitAll: out of memory");
  }
  for (int i = 0; i < n; i++) {
    g->devs[i] = dt__cuda_of(devs[i]);
    if (!g->devs[i]) {
      free(list);
      dt__nccl_destroy(g);
      return dt_device_error(DTRAIN_ERR_UNSUPPORTED, "ncclCommInitAll: a device of the group is not a CUDA device");
    }
    list[i] = g->devs[i]->index;
    for (int j = 0; j < i; j++)
      if (list[j] == list[i]) { /* NCCL: one rank per GPU ("may lead to hangs" otherwise) */
        char msg[160];
        snprintf(msg, sizeof msg, "ncclCommInitAll: GPU %d is in the group twice (%.31s and %.31s); NCCL needs one rank "
                 "per GPU", list[i], g->devs[j]->name, g->devs[i]->name);
        free(list);
        dt__nccl_destroy(g);
        return dt_device_error(DTRAIN_ERR_UNSUPPORTED, msg);
      }
  }
  ncclResult_t r = ncclCommInitAll(g->comms, n, list);
  free(list);
  if (r != ncclSuccess) {
    memset(g->comms, 0, (size_t)n * sizeof(ncclComm_t));
    dt__nccl_destroy(g);
    return dt__nccl_fail("ncclCommInitAll", r);
  }
  *out = g;
  return DTRAIN_OK;
}

/* One NCCL collective over the group, in place: root < 0 an all-reduce (sum),
 * else a broadcast from device `root`. One call per device, each with its
 * device current and on its stream, inside a group. */
static dt_result dt__nccl_collective(dt__nccl *g, float *const *bufs, size_t count, int root) {
  const char *name = root < 0 ? "ncclAllReduce" : "ncclBroadcast";
  char what[64];
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return dt__nccl_fail("ncclGroupStart", r);
  for (int i = 0; i < g->n; i++) {
    cudaError_t e = cudaSetDevice(g->devs[i]->index);
    if (e != cudaSuccess) {
      (void)ncclGroupEnd();
      snprintf(what, sizeof what, "cudaSetDevice (%s)", name);
      return dt__cuda_fail(g->devs[i]->name, what, e);
    }
    r = root < 0 ? ncclAllReduce(bufs[i], bufs[i], count, ncclFloat, ncclSum, g->comms[i], g->devs[i]->stream)
                 : ncclBroadcast(bufs[i], bufs[i], count, ncclFloat, root, g->comms[i], g->devs[i]->stream);
    if (r != ncclSuccess) {
      (void)ncclGroupEnd();
      snprintf(what, sizeof what, "%s on %.31s", name, g->devs[i]->name);
      return dt__nccl_fail(what, r);
    }
  }
  r = ncclGroupEnd();
  snprintf(what, sizeof what, "ncclGroupEnd (%s)", name);
  return r == ncclSuccess ? DTRAIN_OK : dt__nccl_fail(what, r);
}

static dt_result dt__nccl_allreduce(void *group, float *const *bufs, size_t count) {
  return dt__nccl_collective((dt__nccl *)group, bufs, count, -1);
}

static dt_result dt__nccl_broadcast(void *group, float *const *bufs, size_t count, int root) {
  if (root < 0) return dt_device_error(DTRAIN_ERR_INVALID_ARG, "ncclBroadcast: negative root");
  return dt__nccl_collective((dt__nccl *)group, bufs, count, root);
}
#endif /* DTRAIN_USE_NCCL */

DTRAIN_API int dt_cuda_device_count(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    char msg[200];
    snprintf(msg, sizeof msg, "cudaGetDeviceCount: %.120s (%.40s)", cudaGetErrorString(e), cudaGetErrorName(e));
    (void)cudaGetLastError();
    dt_device_error(e == cudaErrorMemoryAllocation ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO, msg);
    return -1;
  }
  return n;
}

DTRAIN_API dt_device *dt_cuda_device_create(int index) {
  int n = dt_cuda_device_count();
  if (n < 0) return NULL;
  if (index < 0 || index >= n) {
    char msg[96];
    snprintf(msg, sizeof msg, "dt_cuda_device_create: device %d out of range (%d CUDA devices)", index, n);
    dt_device_error(DTRAIN_ERR_INVALID_ARG, msg);
    return NULL;
  }
  dt_device *d = (dt_device *)calloc(1, sizeof(dt_device));
  dt__cuda *c = (dt__cuda *)calloc(1, sizeof(dt__cuda));
  if (!d || !c) {
    free(d);
    free(c);
    dt_device_error(DTRAIN_ERR_NOMEM, "dt_cuda_device_create: out of memory");
    return NULL;
  }
  c->index = index;
  snprintf(c->name, sizeof c->name, "cuda:%d", index);
  cudaError_t e = cudaSetDevice(index);
  const char *what = "cudaSetDevice";
  if (e == cudaSuccess) {
    what = "cudaStreamCreateWithFlags";
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
  }
  if (e != cudaSuccess) {
    dt__cuda_fail(c->name, what, e);
    free(d);
    free(c);
    return NULL;
  }
  cublasStatus_t s = cublasCreate(&c->blas);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(c->blas, c->stream);
  if (s != CUBLAS_STATUS_SUCCESS) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s: cublasCreate: %s", c->name, dt__cuda_blas_str(s));
    dt_device_error(s == CUBLAS_STATUS_ALLOC_FAILED ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO, msg);
    if (c->blas) cublasDestroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(d);
    free(c);
    return NULL;
  }
  d->name = c->name;
  d->impl = c;
  d->alloc = dt__cuda_alloc;
  d->free = dt__cuda_free;
  d->zero = dt__cuda_zero;
  d->copy = dt__cuda_copy;
  d->sync = dt__cuda_sync;
  d->run = dt__cuda_run;
  d->peer_copy = dt__cuda_peer_copy;
#ifdef DTRAIN_USE_NCCL
  d->group_create = dt__nccl_create;
  d->group_allreduce = dt__nccl_allreduce;
  d->group_destroy = dt__nccl_destroy;
  d->group_broadcast = dt__nccl_broadcast;
#endif
  return d;
}

DTRAIN_API void dt_cuda_device_destroy(dt_device *d) {
  if (!d) return;
  dt__cuda *c = (dt__cuda *)d->impl;
  if (c) {
    (void)cudaSetDevice(c->index);
    (void)cudaStreamSynchronize(c->stream);
    cublasDestroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
  }
  free(d);
}

#undef DT__CUDA_CHECK
#undef DT__CU_THREADS
#undef DT__CUDA_MAX_PEERS
#endif /* DTRAIN_CUDA_IMPLEMENTATION */
