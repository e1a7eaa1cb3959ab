/* ===========================================================================
 * dt_optim_math.h -- the optimizers' per-element updates, written once
 * ===========================================================================
 * Each optimizer's update of one element is one DT__HD function here: the
 * CPU loops of dt_optim.c and the CUDA kernels of dtrain_cuda.h (host and
 * device code under nvcc) call the same function, so both compute the same
 * float expressions in the same order, and a fix to the math is made once.
 * The operations follow PyTorch's single-tensor optimizers step by step
 * (see dt_optim.c); no FMA: C11 does not contract a * b + c unless asked.
 *
 * Per optimizer:
 *   dt__optim_<name>_k                    its per-step scalars (computed once
 *                                         per step on the host by dt_optim.c)
 *   dt__optim_<name>_at(k, p, g, s.., i)  updates element i of the params p
 *                                         and of the state slots from grad g
 *   dt__optim_<name>_pack / _unpack       k to and from the kernel's scalars
 *                                         (dt_kernel_args f[] and n[1], see
 *                                         DTRAIN_K_SGD in dt_device.h), so
 *                                         their order is written once too
 * A state slot that is off (no momentum) is NULL.
 *
 * The SSE/AVX paths of Adam in dt_optim.c are a CPU speed path written with
 * intrinsics: they must stay the same operations as dt__optim_adam_at, in
 * the same order (tests/test_optim.c compares them bit for bit).
 *
 * Private to dtrain (names dt__*); public only so that a backend compiled
 * apart from the implementation (dtrain_cuda.h) sees the same formulas.
 */
#ifndef DTRAIN_OPTIM_MATH_H
#define DTRAIN_OPTIM_MATH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
/* DT__HD, the host and device marker, comes from dt_maps.h. */
#include "dt_maps.h"

/* ---- SGD: momentum, Nesterov, coupled (L2) weight decay ------------------------------- */

typedef struct dt__optim_sgd_k {
  float lr, wd, mom; /* wd: 0 where this parameter has no decay */
  int nesterov;
} dt__optim_sgd_k;

/* buf: the momentum buffer, NULL without momentum. */
DT__HD static inline void dt__optim_sgd_at(dt__optim_sgd_k k, float *p, const float *g, float *buf, size_t i) {
  float d = g[i];
  if (k.wd != 0.0f) d = d + k.wd * p[i];
  if (buf) {
    /* PyTorch starts buf at d on step 1; with dampening 0, mom*0 + d == d. */
    buf[i] = k.mom * buf[i] + d;
    d = k.nesterov ? d + k.mom * buf[i] : buf[i];
  }
  p[i] = p[i] - k.lr * d;
}

DT__HD static inline void dt__optim_sgd_pack(dt__optim_sgd_k k, float *f, int64_t *flag) {
  f[0] = k.lr;
  f[1] = k.wd;
  f[2] = k.mom;
  *flag = k.nesterov;
}

DT__HD static inline dt__optim_sgd_k dt__optim_sgd_unpack(const float *f, int64_t flag) {
  dt__optim_sgd_k k;
  k.lr = f[0];
  k.wd = f[1];
  k.mom = f[2];
  k.nesterov = flag != 0;
  return k;
}

/* ---- Adam (L2 weight decay in the gradient) and AdamW (decoupled) ----------------------- */

typedef struct dt__optim_adam_k {
  float step_size;  /* lr / (1 - beta1^t), in double then rounded */
  float wd;         /* 0 where this parameter has no decay */
  float bc2_sqrt;   /* sqrt(1 - beta2^t) */
  float eps;
  float w1, w2;     /* 1 - beta1, 1 - beta2 */
  float beta2;
  float shrink;     /* AdamW: 1 - lr * wd */
  int decoupled;    /* 1: AdamW */
} dt__optim_adam_k;

/* m, v: the first and second moments. */
DT__HD static inline void dt__optim_adam_at(dt__optim_adam_k k, float *p, const float *g, float *m, float *v,
                                            size_t i) {
  float d = g[i];
  if (k.wd != 0.0f) {
    if (k.decoupled) p[i] = p[i] * k.shrink; /* AdamW: param.mul_(1 - lr * weight_decay) first */
    else d = d + k.wd * p[i];
  }
  m[i] = m[i] + k.w1 * (d - m[i]);    /* exp_avg.lerp_(grad, 1 - beta1) */
  v[i] = v[i] * k.beta2 + k.w2 * d * d; /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2) */
  float denom = sqrtf(v[i]) / k.bc2_sqrt + k.eps;
  p[i] = p[i] - k.step_size * (m[i] / denom);
}

DT__HD static inline void dt__optim_adam_pack(dt__optim_adam_k k, float *f, int64_t *flag) {
  f[0] = k.step_size;
  f[1] = k.wd;
  f[2] = k.bc2_sqrt;
  f[3] = k.eps;
  f[4] = k.w1;
  f[5] = k.w2;
  f[6] = k.beta2;
  f[7] = k.shrink;
  *flag = k.decoupled;
}

DT__HD static inline dt__optim_adam_k dt__optim_adam_unpack(const float *f, int64_t flag) {
  dt__optim_adam_k k;
  k.step_size = f[0];
  k.wd = f[1];
  k.bc2_sqrt = f[2];
  k.eps = f[3];
  k.w1 = f[4];
  k.w2 = f[5];
  k.beta2 = f[6];
  k.shrink = f[7];
  k.decoupled = flag != 0;
  return k;
}

/* ---- RMSprop: optional momentum, coupled weight decay (PyTorch, centered=False) ------------ */

typedef struct dt__optim_rmsprop_k {
  float lr, wd;     /* wd: 0 where this parameter has no decay */
  float alpha, w;   /* smoothing and 1 - alpha */
  float mom, eps;
} dt__optim_rmsprop_k;

/* sq: the square average; buf: the momentum buffer, NULL without momentum. */
DT__HD static inline void dt__optim_rmsprop_at(dt__optim_rmsprop_k k, float *p, const float *g, float *sq, float *buf,
                                               size_t i) {
  float d = g[i];
  if (k.wd != 0.0f) d = d + k.wd * p[i];
  sq[i] = sq[i] * k.alpha + k.w * d * d;
  float avg = sqrtf(sq[i]) + k.eps;
  if (buf) {
    buf[i] = buf[i] * k.mom + d / avg;
    p[i] = p[i] - k.lr * buf[i];
  } else {
    p[i] = p[i] - k.lr * (d / avg);
  }
}

DT__HD static inline void dt__optim_rmsprop_pack(dt__optim_rmsprop_k k, float *f) {
  f[0] = k.lr;
  f[1] = k.wd;
  f[2] = k.alpha;
  f[3] = k.w;
  f[4] = k.mom;
  f[5] = k.eps;
}

DT__HD static inline dt__optim_rmsprop_k dt__optim_rmsprop_unpack(const float *f) {
  dt__optim_rmsprop_k k;
  k.lr = f[0];
  k.wd = f[1];
  k.alpha = f[2];
  k.w = f[3];
  k.mom = f[4];
  k.eps = f[5];
  return k;
}

#endif /* DTRAIN_OPTIM_MATH_H */
