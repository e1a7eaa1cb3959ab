/* ===========================================================================
 * dt_ops_elem.c -- elementwise ops: broadcasting binary ops, scalar ops, unary
 * ===========================================================================
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__ELEM_SSE 1
#  include <emmintrin.h>
#endif

/* ---- broadcasting -------------------------------------------------------------------
 * Output shape is the NumPy broadcast of a and b; sa/sb are the element
 * strides of a and b along each output dim (0 where that input is stretched).
 */
typedef struct dt__bcast {
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t sa[DTRAIN_MAX_DIMS], sb[DTRAIN_MAX_DIMS];
} dt__bcast;

static int dt__elem_broadcast(dt_graph *g, const char *op, const dt_tensor *a, const dt_tensor *b, dt__bcast *bc) {
  int nd = DT__MAX(a->ndim, b->ndim);
  int64_t sta[DTRAIN_MAX_DIMS], stb[DTRAIN_MAX_DIMS];
  dt__strides(a, sta);
  dt__strides(b, stb);
  bc->ndim = nd;
  for (int d = 0; d < nd; d++) {
    int ia = d - (nd - a->ndim), ib = d - (nd - b->ndim);
    int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      char s1[96], s2[96];
      dt__fail(g, DTRAIN_ERR_SHAPE, "%s: shapes %s and %s cannot broadcast (dim %d: %lld vs %lld)", op,
               dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2), d, (long long)da, (long long)db);
      return 0;
    }
    bc->shape[d] = DT__MAX(da, db);
    bc->sa[d] = (ia >= 0 && da != 1) ? sta[ia] : 0;
    bc->sb[d] = (ib >= 0 && db != 1) ? stb[ib] : 0;
  }
  return 1;
}

/* Walk every output element i with the matching offsets oa, ob. */
#define DT__BCAST_LOOP(bc, n, BODY)                                        \
  do {                                                                     \
    int64_t idx_[DTRAIN_MAX_DIMS] = {0};                                   \
    int64_t oa = 0, ob = 0;                                                \
    for (int64_t i = 0; i < (n); i++) {                                    \
      BODY;                                                                \
      for (int d_ = (bc)->ndim - 1; d_ >= 0; d_--) {                       \
        idx_[d_]++;                                                        \
        oa += (bc)->sa[d_];                                                \
        ob += (bc)->sb[d_];                                                \
        if (idx_[d_] < (bc)->shape[d_]) break;                             \
        oa -= (bc)->sa[d_] * (bc)->shape[d_];                              \
        ob -= (bc)->sb[d_] * (bc)->shape[d_];                              \
        idx_[d_] = 0;                                                      \
      }                                                                    \
    }                                                                      \
  } while (0)

enum { DT__ADD, DT__SUB, DT__MUL, DT__DIV };

static void dt__binary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  const dt__bcast *bc = (const dt__bcast *)y->aux;
  int kind = (int)y->iaux[0];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  const float *go = y->grad, *ad = a->data, *bd = b->data;
  if (g->err != DTRAIN_OK) return;
  switch (kind) {
    case DT__ADD:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i]; if (gb) gb[ob] += go[i]; });
      break;
    case DT__SUB:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i]; if (gb) gb[ob] -= go[i]; });
      break;
    case DT__MUL:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i] * bd[ob]; if (gb) gb[ob] += go[i] * ad[oa]; });
      break;
    default:
      DT__BCAST_LOOP(bc, y->size, {
        if (ga) ga[oa] += go[i] / bd[ob];
        if (gb) gb[ob] -= go[i] * ad[oa] / (bd[ob] * bd[ob]);
      });
      break;
  }
}

static dt_tensor *dt__binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op) {
  if (!dt__begin(g, op, 2, a, b)) return NULL;
  if (g->device)
    return dt__dev_binary(g, a, b,
                          kind == DT__ADD   ? DTRAIN_K_ADD
                          : kind == DT__SUB ? DTRAIN_K_SUB
                          : kind == DT__MUL ? DTRAIN_K_MUL
                                            : DTRAIN_K_DIV,
                          op);
  dt__bcast *bc = (dt__bcast *)dt__arena_alloc(g, sizeof(dt__bcast));
  if (!bc || !dt__elem_broadcast(g, op, a, b, bc)) return NULL;
  dt_tensor *y = dt__new(g, op, bc->ndim, bc->shape);
  if (!y) return NULL;
  const float *ad = a->data, *bd = b->data;
  float *yd = y->data;
  int same = dt_same_shape(a, b);
  switch (kind) {
    case DT__ADD:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] + bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] + bd[ob]);
      break;
    case DT__SUB:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] - bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] - bd[ob]);
      break;
    case DT__MUL:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] * bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] * bd[ob]);
      break;
    default:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] / bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] / bd[ob]);
      break;
  }
  y->aux = bc;
  y->iaux[0] = kind;
  dt__record(g, y, op, dt__binary_backward, a, b, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_add(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__ADD, "dt_add"); }
DTRAIN_API dt_tensor *dt_sub(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__SUB, "dt_sub"); }
DTRAIN_API dt_tensor *dt_mul(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__MUL, "dt_mul"); }
DTRAIN_API dt_tensor *dt_div(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__DIV, "dt_div"); }

/* ---- unary and scalar ops -------------------------------------------------------------
 * One forward/backward pair, switched on the kind; faux[0] holds the scalar. */
enum {
  DT__U_ADDS, DT__U_MULS, DT__U_POWS, DT__U_RSUBS, DT__U_NEG, DT__U_EXP, DT__U_LOG, DT__U_SQRT,
  DT__U_RELU, DT__U_LRELU, DT__U_SIGMOID, DT__U_TANH, DT__U_GELU
};

#define DT__GELU_C 0.7978845608028654f /* sqrt(2/pi) */
#define DT__GELU_K 0.044715f

/* ReLU forward and backward without branches (a mispredicted branch per
 * element costs more than the whole SSE loop). Same values as the scalar
 * forms: max(x, 0) is x > 0 ? x : 0 (NaN gives 0), and adding the masked
 * gradient adds +0 where x <= 0. */
static void dt__elem_relu(const float *DT__RESTRICT x, float *DT__RESTRICT y, int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_max_ps(_mm_loadu_ps(x + i), z));
#endif
  for (; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void dt__elem_relu_backward(const float *DT__RESTRICT x, const float *DT__RESTRICT go, float *DT__RESTRICT gx,
                                   int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 keep = _mm_cmpgt_ps(_mm_loadu_ps(x + i), z);
    _mm_storeu_ps(gx + i, _mm_add_ps(_mm_loadu_ps(gx + i), _mm_and_ps(keep, _mm_loadu_ps(go + i))));
  }
#endif
  for (; i < n; i++) gx[i] += x[i] > 0.0f ? go[i] : 0.0f;
}

static void dt__unary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const float *go = y->grad, *xd = x->data, *yd = y->data;
  float s = y->faux[0];
  int64_t n = y->size;
  switch ((int)y->iaux[0]) {
    case DT__U_ADDS: for (int64_t i = 0; i < n; i++) gx[i] += go[i]; break;
    case DT__U_MULS: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * s; break;
    case DT__U_POWS: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * s * powf(xd[i], s - 1.0f); break;
    case DT__U_RSUBS:
    case DT__U_NEG: for (int64_t i = 0; i < n; i++) gx[i] -= go[i]; break;
    case DT__U_EXP: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * yd[i]; break;
    case DT__U_LOG: for (int64_t i = 0; i < n; i++) gx[i] += go[i] / xd[i]; break;
    case DT__U_SQRT: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * 0.5f / yd[i]; break;
    case DT__U_RELU: dt__elem_relu_backward(xd, go, gx, n); break;
    case DT__U_LRELU: for (int64_t i = 0; i < n; i++) gx[i] += xd[i] > 0.0f ? go[i] : s * go[i]; break;
    case DT__U_SIGMOID: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * yd[i] * (1.0f - yd[i]); break;
    case DT__U_TANH: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * (1.0f - yd[i] * yd[i]); break;
    case DT__U_GELU:
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i], u = DT__GELU_C * (v + DT__GELU_K * v * v * v);
        float t = tanhf(u);
        float du = DT__GELU_C * (1.0f + 3.0f * DT__GELU_K * v * v);
        gx[i] += go[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
      }
      break;
    default: dt__fail(g, DTRAIN_ERR_INTERNAL, "unary backward: unknown kind %lld", (long long)y->iaux[0]); break;
  }
}

static dt_tensor *dt__unary(dt_graph *g, dt_tensor *x, int kind, float s, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (g->device) { /* the device checks the domain of log, sqrt and pow itself */
    if (kind == DT__U_RELU || kind == DT__U_SIGMOID || kind == DT__U_TANH)
      return dt__dev_unary(g, x, kind == DT__U_RELU ? DTRAIN_K_RELU : kind == DT__U_SIGMOID ? DTRAIN_K_SIGMOID : DTRAIN_K_TANH,
                           op);
    static const int map_fn[] = {DTRAIN_MAP_ADD_SCALAR, DTRAIN_MAP_MUL_SCALAR, DTRAIN_MAP_POW_SCALAR,
                                 DTRAIN_MAP_RSUB_SCALAR, DTRAIN_MAP_NEG, DTRAIN_MAP_EXP};
    int fn = kind == DT__U_LRELU  ? DTRAIN_MAP_LEAKY_RELU
             : kind == DT__U_GELU ? DTRAIN_MAP_GELU
             : kind == DT__U_LOG  ? DTRAIN_MAP_LOG
             : kind == DT__U_SQRT ? DTRAIN_MAP_SQRT
                                  : -1;
    if (kind >= DT__U_ADDS && kind <= DT__U_EXP) fn = map_fn[kind];
    if (fn < 0) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INTERNAL, "%s: no device map for kind %d", op, kind);
    return dt__dev_map(g, x, fn, s, op);
  }
  const float *xd = x->data;
  int64_t n = x->size;
  if (kind == DT__U_LOG || kind == DT__U_SQRT) {
    for (int64_t i = 0; i < n; i++) {
      if (kind == DT__U_LOG ? !(xd[i] > 0.0f) : !(xd[i] >= 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op,
                                     (long long)i, (double)xd[i], kind == DT__U_LOG ? ">" : ">=");
    }
  }
  if (kind == DT__U_POWS && s != floorf(s)) {
    for (int64_t i = 0; i < n; i++)
      if (!(xd[i] > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                     "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                                     (long long)i, (double)xd[i]);
  }
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  float *yd = y->data;
  switch (kind) {
    case DT__U_ADDS: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] + s; break;
    case DT__U_MULS: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] * s; break;
    case DT__U_POWS: for (int64_t i = 0; i < n; i++) yd[i] = powf(xd[i], s); break;
    case DT__U_RSUBS: for (int64_t i = 0; i < n; i++) yd[i] = s - xd[i]; break;
    case DT__U_NEG: for (int64_t i = 0; i < n; i++) yd[i] = -xd[i]; break;
    case DT__U_EXP: for (int64_t i = 0; i < n; i++) yd[i] = expf(xd[i]); break;
    case DT__U_LOG: for (int64_t i = 0; i < n; i++) yd[i] = logf(xd[i]); break;
    case DT__U_SQRT: for (int64_t i = 0; i < n; i++) yd[i] = sqrtf(xd[i]); break;
    case DT__U_RELU: dt__elem_relu(xd, yd, n); break;
    case DT__U_LRELU: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] > 0.0f ? xd[i] : s * xd[i]; break;
    case DT__U_SIGMOID:
      /* Stable in both tails: exp of a non-positive number only. */
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i];
        if (v >= 0.0f) yd[i] = 1.0f / (1.0f + expf(-v));
        else { float e = expf(v); yd[i] = e / (1.0f + e); }
      }
      break;
    case DT__U_TANH: for (int64_t i = 0; i < n; i++) yd[i] = tanhf(xd[i]); break;
    case DT__U_GELU:
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i];
        yd[i] = 0.5f * v * (1.0f + tanhf(DT__GELU_C * (v + DT__GELU_K * v * v * v)));
      }
      break;
    default: return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INTERNAL, "%s: unknown kind %d", op, kind);
  }
  y->iaux[0] = kind;
  y->faux[0] = s;
  dt__record(g, y, op, dt__unary_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_add_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_ADDS, s, "dt_add_scalar"); }
DTRAIN_API dt_tensor *dt_mul_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_MULS, s, "dt_mul_scalar"); }
DTRAIN_API dt_tensor *dt_pow_scalar(dt_graph *g, dt_tensor *x, float p) { return dt__unary(g, x, DT__U_POWS, p, "dt_pow_scalar"); }
DTRAIN_API dt_tensor *dt_rsub_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_RSUBS, s, "dt_rsub_scalar"); }
DTRAIN_API dt_tensor *dt_neg(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_NEG, 0.0f, "dt_neg"); }
DTRAIN_API dt_tensor *dt_exp(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_EXP, 0.0f, "dt_exp"); }
DTRAIN_API dt_tensor *dt_log(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_LOG, 0.0f, "dt_log"); }
DTRAIN_API dt_tensor *dt_sqrt(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_SQRT, 0.0f, "dt_sqrt"); }
DTRAIN_API dt_tensor *dt_relu(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_RELU, 0.0f, "dt_relu"); }
DTRAIN_API dt_tensor *dt_leaky_relu(dt_graph *g, dt_tensor *x, float slope) { return dt__unary(g, x, DT__U_LRELU, slope, "dt_leaky_relu"); }
DTRAIN_API dt_tensor *dt_sigmoid(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_SIGMOID, 0.0f, "dt_sigmoid"); }
DTRAIN_API dt_tensor *dt_tanh(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_TANH, 0.0f, "dt_tanh"); }
DTRAIN_API dt_tensor *dt_gelu(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_GELU, 0.0f, "dt_gelu"); }

#undef DT__BCAST_LOOP
#undef DT__GELU_C
#undef DT__GELU_K
#ifdef DT__ELEM_SSE
#  undef DT__ELEM_SSE
#endif
