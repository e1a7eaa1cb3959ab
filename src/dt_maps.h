/* ===========================================================================
 * dt_maps.h -- the elementwise maps: the one list of unary elementwise ops
 * ===========================================================================
 * Every unary elementwise op (dt_relu, dt_gelu, dt_add_scalar, ...) is one
 * line of DT__MAP_LIST below plus its two formulas. That line alone gives
 * the op its dt_map_fn id (DTRAIN_MAP_<NAME>, the map of the device's
 * DTRAIN_K_MAP kernel), its public function (defined in dt_ops_elem.c), its
 * CPU forward and backward loops (dt_ops_elem.c), its device path
 * (dt_device_ops.c, and its place in the device's list of ops), its CUDA
 * kernel (dtrain_cuda.h runs the same formulas), its gradcheck
 * (tests/test_ops_elem.c) and its PyTorch parity check (tests/torch_dump.c;
 * tests/torch_parity.py then needs the torch expression).
 *
 * The formulas are the one definition of each op's math: the CPU loops and
 * the CUDA kernels (DT__HD: host and device code under nvcc) call the same
 * functions, so the two compute the same float expressions.
 *   dt__map_<name>(x, s)             -> y, the forward value of one element
 *   dt__map_<name>_grad(x, y, go, s) -> what the backward adds to dL/dx,
 *                                      given the input x, the output y and
 *                                      the output's gradient go
 * s is the op's scalar (0 for the ops that take none).
 *
 * Private to dtrain (names dt__*); public only so that a backend compiled
 * apart from the implementation (dtrain_cuda.h) sees the same formulas.
 *
 * Adding an op (e.g. softplus): one line in DT__MAP_LIST, its two formulas
 * below, its declaration in dt_ops.h; then its torch expression in
 * tests/torch_parity.py. See CONTRIBUTING.md.
 */
#ifndef DTRAIN_MAPS_H
#define DTRAIN_MAPS_H

#include <math.h>

/* X(name, NAME, args, domain), one line per op:
 *   name    the op is dt_<name>, its formulas dt__map_<name>[_grad]
 *   NAME    its id is DTRAIN_MAP_<NAME>
 *   args    UNARY: dt_<name>(g, x); SCALAR: dt_<name>(g, x, float s)
 *   domain  the inputs it accepts, checked before it runs (on the CPU and on
 *           a device, with the same message): ANY; POS (x > 0); NONNEG
 *           (x >= 0); POW (x > 0 when s is not an integer). A number
 *           below the domain (-Inf included; 0 for POS and POW) is refused
 *           with an error naming the element. NaN is not refused: it goes
 *           through as in PyTorch (NaN out, NaN gradient), so a divergence
 *           shows where it starts; +Inf gives PyTorch's value (log and
 *           sqrt of +Inf are +Inf).
 * The order is the order of the DTRAIN_MAP_* ids: append new ops at the end. */
#define DT__MAP_LIST(X)                     \
  X(add_scalar, ADD_SCALAR, SCALAR, ANY)    \
  X(mul_scalar, MUL_SCALAR, SCALAR, ANY)    \
  X(rsub_scalar, RSUB_SCALAR, SCALAR, ANY)  \
  X(pow_scalar, POW_SCALAR, SCALAR, POW)    \
  X(neg, NEG, UNARY, ANY)                   \
  X(exp, EXP, UNARY, ANY)                   \
  X(leaky_relu, LEAKY_RELU, SCALAR, ANY)    \
  X(gelu, GELU, UNARY, ANY)                 \
  X(log, LOG, UNARY, POS)                   \
  X(sqrt, SQRT, UNARY, NONNEG)              \
  X(relu, RELU, UNARY, ANY)                 \
  X(sigmoid, SIGMOID, UNARY, ANY)           \
  X(tanh, TANH, UNARY, ANY)

/* The maps of DTRAIN_K_MAP / DTRAIN_K_MAP_BWD (dt_device.h), one per op of
 * the list, then two maps of DTRAIN_K_MAP only that write 1 where x is
 * below a domain, else 0: x <= 0 (log, non-integer powers) and x < 0
 * (sqrt); 0 for NaN, which is not refused (see domain above).
 * DTRAIN_MAP_COUNT: the number of maps. */
typedef enum dt_map_fn {
#define DT__MAP_ENUM(name, NAME, args, domain) DTRAIN_MAP_##NAME,
  DT__MAP_LIST(DT__MAP_ENUM)
#undef DT__MAP_ENUM
  DTRAIN_MAP_DOMAIN_POS,
  DTRAIN_MAP_DOMAIN_NONNEG,
  DTRAIN_MAP_COUNT
} dt_map_fn;

/* The domains of the list (see domain above). dt__map_below(domain, x):
 * x is below the domain, so refused; false for NaN, which goes through. */
#define DT__MAP_DOMAIN_ANY 0
#define DT__MAP_DOMAIN_POS 1
#define DT__MAP_DOMAIN_NONNEG 2
#define DT__MAP_DOMAIN_POW 3

/* The domain of map fn; -1 for an id not in the list. */
static inline int dt__map_domain(int fn) {
  switch (fn) {
#define DT__MAP_DOMAIN_CASE(name, NAME, args, domain) \
    case DTRAIN_MAP_##NAME: return DT__MAP_DOMAIN_##domain;
    DT__MAP_LIST(DT__MAP_DOMAIN_CASE)
#undef DT__MAP_DOMAIN_CASE
    default: return -1;
  }
}

#if defined(__CUDACC__)
#  define DT__HD __host__ __device__
#else
#  define DT__HD
#endif

/* POS and POW refuse x <= 0, NONNEG x < 0; an ordered comparison is false
 * for NaN, so a NaN is never below. (POW only applies when s is not an
 * integer; the callers check s.) */
DT__HD static inline int dt__map_below(int domain, float x) {
  if (domain == DT__MAP_DOMAIN_NONNEG) return x < 0.0f;
  return (domain == DT__MAP_DOMAIN_POS || domain == DT__MAP_DOMAIN_POW) && x <= 0.0f;
}

/* ---- the formulas, in the order of the list ------------------------------------------ */

DT__HD static inline float dt__map_add_scalar(float x, float s) { return x + s; }
DT__HD static inline float dt__map_add_scalar_grad(float x, float y, float go, float s) {
  (void)x, (void)y, (void)s;
  return go;
}
DT__HD static inline float dt__map_mul_scalar(float x, float s) { return x * s; }
DT__HD static inline float dt__map_mul_scalar_grad(float x, float y, float go, float s) {
  (void)x, (void)y;
  return go * s;
}
DT__HD static inline float dt__map_rsub_scalar(float x, float s) { return s - x; }
/* gx += -go is gx -= go bit for bit (IEEE subtraction adds the negation). */
DT__HD static inline float dt__map_rsub_scalar_grad(float x, float y, float go, float s) {
  (void)x, (void)y, (void)s;
  return -go;
}
DT__HD static inline float dt__map_pow_scalar(float x, float s) { return powf(x, s); }
/* x^0 has PyTorch's gradient 0 everywhere (pow_backward): not 0 * x^-1,
 * which is NaN at x = 0 and at a NaN. */
DT__HD static inline float dt__map_pow_scalar_grad(float x, float y, float go, float s) {
  (void)y;
  if (s == 0.0f) return 0.0f;
  return go * s * powf(x, s - 1.0f);
}
DT__HD static inline float dt__map_neg(float x, float s) {
  (void)s;
  return -x;
}
DT__HD static inline float dt__map_neg_grad(float x, float y, float go, float s) {
  (void)x, (void)y, (void)s;
  return -go;
}
DT__HD static inline float dt__map_exp(float x, float s) {
  (void)s;
  return expf(x);
}
DT__HD static inline float dt__map_exp_grad(float x, float y, float go, float s) {
  (void)x, (void)s;
  return go * y;
}
DT__HD static inline float dt__map_leaky_relu(float x, float s) { return x > 0.0f ? x : s * x; }
DT__HD static inline float dt__map_leaky_relu_grad(float x, float y, float go, float s) {
  (void)y;
  return x > 0.0f ? go : s * go;
}
/* GELU, tanh form: 0.5 x (1 + tanh(c (x + k x^3))), c = sqrt(2/pi), k = 0.044715. */
DT__HD static inline float dt__map_gelu(float x, float s) {
  (void)s;
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
DT__HD static inline float dt__map_gelu_grad(float x, float y, float go, float s) {
  (void)y, (void)s;
  float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  float t = tanhf(u);
  float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
  return go * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
}
DT__HD static inline float dt__map_log(float x, float s) {
  (void)s;
  return logf(x);
}
DT__HD static inline float dt__map_log_grad(float x, float y, float go, float s) {
  (void)y, (void)s;
  return go / x;
}
DT__HD static inline float dt__map_sqrt(float x, float s) {
  (void)s;
  return sqrtf(x);
}
DT__HD static inline float dt__map_sqrt_grad(float x, float y, float go, float s) {
  (void)x, (void)s;
  return go * 0.5f / y;
}
/* max(x, 0) as x <= 0 ? 0 : x: a NaN stays NaN (as in PyTorch, so that a
 * divergence shows in the activations, not only later in the parameters),
 * -0 gives +0. The gradient passes go where x is NaN (PyTorch's
 * threshold_backward: zero only where x <= 0) and adds +0 where x <= 0. */
DT__HD static inline float dt__map_relu(float x, float s) {
  (void)s;
  return x <= 0.0f ? 0.0f : x;
}
DT__HD static inline float dt__map_relu_grad(float x, float y, float go, float s) {
  (void)y, (void)s;
  return x <= 0.0f ? 0.0f : go;
}
/* Stable in both tails: exp of a non-positive number only. */
DT__HD static inline float dt__map_sigmoid(float x, float s) {
  (void)s;
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  float e = expf(x);
  return e / (1.0f + e);
}
DT__HD static inline float dt__map_sigmoid_grad(float x, float y, float go, float s) {
  (void)x, (void)s;
  return go * y * (1.0f - y);
}
DT__HD static inline float dt__map_tanh(float x, float s) {
  (void)s;
  return tanhf(x);
}
DT__HD static inline float dt__map_tanh_grad(float x, float y, float go, float s) {
  (void)x, (void)s;
  return go * (1.0f - y * y);
}

#endif /* DTRAIN_MAPS_H */
