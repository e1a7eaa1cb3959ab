/* ===========================================================================
 * dt_ops_elem.c -- elementwise ops: broadcasting binary ops, scalar ops, unary
 * ===========================================================================
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_maps.h"
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

/* ---- unary and scalar ops: the maps of dt_maps.h ----------------------------------------
 * One forward/backward pair for every op of DT__MAP_LIST, switched on its
 * dt_map_fn (iaux[0]); faux[0] holds the scalar. Each case is a plain loop
 * over the op's formula, which the compiler inlines. */

/* ReLU forward and backward without branches (a mispredicted branch per
 * element costs more than the whole SSE loop). Same values as the formulas
 * dt__map_relu[_grad]: x <= 0 ? 0 : x (a NaN stays NaN; not _mm_max_ps,
 * which returns its second operand for a NaN), and adding the masked
 * gradient adds +0 where x <= 0 and go where x is NaN. */
static void dt__elem_relu(const float *DT__RESTRICT x, float *DT__RESTRICT y, int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 v = _mm_loadu_ps(x + i);
    _mm_storeu_ps(y + i, _mm_andnot_ps(_mm_cmple_ps(v, z), v));
  }
#endif
  for (; i < n; i++) y[i] = dt__map_relu(x[i], 0.0f);
}

static void dt__elem_relu_backward(const float *DT__RESTRICT x, const float *DT__RESTRICT go, float *DT__RESTRICT gx,
                                   int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 keep = _mm_cmpnle_ps(_mm_loadu_ps(x + i), z); /* true for NaN, as the formula */
    _mm_storeu_ps(gx + i, _mm_add_ps(_mm_loadu_ps(gx + i), _mm_and_ps(keep, _mm_loadu_ps(go + i))));
  }
#endif
  for (; i < n; i++) gx[i] += dt__map_relu_grad(x[i], 0.0f, go[i], 0.0f);
}

static void dt__unary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const float *go = y->grad, *xd = x->data, *yd = y->data;
  float s = y->faux[0];
  int64_t n = y->size;
  if (y->iaux[0] == DTRAIN_MAP_RELU) { /* the SIMD fast path */
    dt__elem_relu_backward(xd, go, gx, n);
    return;
  }
  switch ((int)y->iaux[0]) {
#define DT__MAP_BWD_CASE(name, NAME, args, domain) \
    case DTRAIN_MAP_##NAME: for (int64_t i = 0; i < n; i++) gx[i] += dt__map_##name##_grad(xd[i], yd[i], go[i], s); break;
    DT__MAP_LIST(DT__MAP_BWD_CASE)
#undef DT__MAP_BWD_CASE
    default: dt__fail(g, DTRAIN_ERR_INTERNAL, "unary backward: unknown map %lld", (long long)y->iaux[0]); break;
  }
}

static dt_tensor *dt__unary(dt_graph *g, dt_tensor *x, int fn, float s, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (g->device) return dt__dev_map(g, x, fn, s, op); /* the device checks the domain itself */
  const float *xd = x->data;
  int64_t n = x->size;
  int domain = dt__map_domain(fn);
  if (domain == DT__MAP_DOMAIN_POS || domain == DT__MAP_DOMAIN_NONNEG) {
    for (int64_t i = 0; i < n; i++) {
      if (dt__map_below(domain, xd[i])) /* a NaN goes through (dt_maps.h) */
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op,
                                     (long long)i, (double)xd[i], domain == DT__MAP_DOMAIN_POS ? ">" : ">=");
    }
  }
  if (domain == DT__MAP_DOMAIN_POW && s != floorf(s)) {
    for (int64_t i = 0; i < n; i++)
      if (dt__map_below(domain, xd[i]))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                     "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                                     (long long)i, (double)xd[i]);
  }
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  float *yd = y->data;
  if (fn == DTRAIN_MAP_RELU) {
    dt__elem_relu(xd, yd, n); /* the SIMD fast path */
  } else {
    switch (fn) {
#define DT__MAP_FWD_CASE(name, NAME, args, domain) \
      case DTRAIN_MAP_##NAME: for (int64_t i = 0; i < n; i++) yd[i] = dt__map_##name(xd[i], s); break;
      DT__MAP_LIST(DT__MAP_FWD_CASE)
#undef DT__MAP_FWD_CASE
      default: return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INTERNAL, "%s: unknown map %d", op, fn);
    }
  }
  y->iaux[0] = fn;
  y->faux[0] = s;
  dt__record(g, y, op, dt__unary_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- ReLU in place ------------------------------------------------------------------
 * y shares x's data. Backward: y's gradient is final when this node runs (x
 * had no other consumer, and none can come after), so it is masked where it
 * stands and becomes x's gradient: 0 + go as dt_relu's backward adds it into
 * a zeroed buffer (the + 0.0f turns a -0 into +0 alike). */
/* Large tensors are cut over the intra-op threads (each element alone). */
#define DT__RELU_PAR_MIN ((int64_t)1 << 18)

/* The mask above over rows x cols (dt_ops_internal.h): also dt_linear_relu's
 * backward, which adds each masked row into gb. */
DTRAIN_PRIVATE void dt__relu_mask_rows(float *go, const float *y, int64_t rows, int64_t cols, float *gb) {
  for (int64_t r = 0; r < rows; r++) {
    float *gr = go + r * cols;
    const float *yr = y + r * cols;
    int64_t i = 0;
#ifdef DT__ELEM_SSE
    const __m128 z = _mm_setzero_ps();
    for (; i + 4 <= cols; i += 4) { /* keep where y > 0 or NaN, as dt__elem_relu_backward */
      __m128 v = _mm_add_ps(_mm_and_ps(_mm_cmpnle_ps(_mm_loadu_ps(yr + i), z), _mm_loadu_ps(gr + i)), z);
      _mm_storeu_ps(gr + i, v);
      if (gb) _mm_storeu_ps(gb + i, _mm_add_ps(_mm_loadu_ps(gb + i), v));
    }
#endif
    for (; i < cols; i++) {
      gr[i] = yr[i] <= 0.0f ? 0.0f : gr[i] + 0.0f;
      if (gb) gb[i] += gr[i];
    }
  }
}

static void dt__relu_inplace_bwd_range(void *arg, int64_t lo, int64_t hi) {
  dt_tensor *y = (dt_tensor *)arg;
  dt__relu_mask_rows(y->grad + lo, y->data + lo, 1, hi - lo, NULL);
}

static void dt__relu_inplace_fwd_range(void *arg, int64_t lo, int64_t hi) {
  float *d = (float *)arg + lo;
  int64_t i = 0, n = hi - lo;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) { /* dt__elem_relu's loop, in place */
    __m128 v = _mm_loadu_ps(d + i);
    _mm_storeu_ps(d + i, _mm_andnot_ps(_mm_cmple_ps(v, z), v));
  }
#endif
  for (; i < n; i++) d[i] = dt__map_relu(d[i], 0.0f);
}

DTRAIN_PRIVATE void dt__relu_rows(float *c, int64_t rows, int64_t cols, int64_t ld) {
  for (int64_t r = 0; r < rows; r++) dt__relu_inplace_fwd_range(c + r * ld, 0, cols);
}

static void dt__relu_inplace_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  if (!(x->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) return;
  dt__par_range(y->size, 1024, DT__RELU_PAR_MIN, dt__relu_inplace_bwd_range, y);
  (void)g;
  x->grad = y->grad;
}

/* ops whose backward reads their inputs only, never their own result */
static int dt__result_free_to_overwrite(const char *op) {
  static const char *const ok[] = {"dt_conv2d", "dt_linear", "dt_matmul", "dt_bmm", "dt_add", "dt_sub"};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
    if (op && strcmp(op, ok[i]) == 0) return 1;
  return 0;
}

DTRAIN_API dt_tensor *dt_relu_inplace(dt_graph *g, dt_tensor *x) {
  static const char *op = "dt_relu_inplace";
  int used = x && (x->flags & DT__TENSOR_USED); /* read before dt__begin, which marks x used */
  if (!dt__begin(g, op, 1, x)) return NULL;
  char sx[96];
  dt_shape_str(x, sx, sizeof sx);
  if ((x->flags & (DTRAIN_TENSOR_VIEW | DTRAIN_TENSOR_PARAM)) || !dt__result_free_to_overwrite(x->op))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: x %s is %s, not the result of dt_conv2d, dt_linear, dt_matmul, dt_bmm, dt_add or "
                                 "dt_sub: use dt_relu", op, sx,
                                 (x->flags & DTRAIN_TENSOR_PARAM) ? "a parameter"
                                 : (x->flags & DTRAIN_TENSOR_VIEW) ? "a view of other memory"
                                 : x->op ? x->op : "an input");
  if (used)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: x %s (a %s result) is already an input of another op, which may need its values: "
                                 "use dt_relu", op, sx, x->op);
  dt_tensor *y;
  if (g->device) {
    y = dt__dev_map(g, x, DTRAIN_MAP_RELU, 0.0f, "dt_relu"); /* out of place there */
    if (!y) return NULL;
  } else {
    float *d = x->data;
    dt__par_range(x->size, 1024, DT__RELU_PAR_MIN, dt__relu_inplace_fwd_range, d);
    y = dt__new_view(g, op, x->ndim, x->shape, d);
    if (!y) return NULL;
    dt__record(g, y, op, dt__relu_inplace_backward, x, NULL, NULL);
    y = dt__finish(g, y);
  }
  x->flags |= DT__TENSOR_OVERWRITTEN;
  return y;
}

/* The public functions, one per line of DT__MAP_LIST (declared in dt_ops.h):
 * args UNARY gives dt_<name>(g, x), SCALAR gives dt_<name>(g, x, s). */
#define DT__MAP_API_UNARY(name, NAME) \
  DTRAIN_API dt_tensor *dt_##name(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DTRAIN_MAP_##NAME, 0.0f, "dt_" #name); }
#define DT__MAP_API_SCALAR(name, NAME)                                \
  DTRAIN_API dt_tensor *dt_##name(dt_graph *g, dt_tensor *x, float s) { \
    return dt__unary(g, x, DTRAIN_MAP_##NAME, s, "dt_" #name);   \
  }
#define DT__MAP_API(name, NAME, args, domain) DT__MAP_API_##args(name, NAME)
DT__MAP_LIST(DT__MAP_API)
#undef DT__MAP_API
#undef DT__MAP_API_UNARY
#undef DT__MAP_API_SCALAR

#undef DT__BCAST_LOOP
#ifdef DT__ELEM_SSE
#  undef DT__ELEM_SSE
#endif
#undef DT__RELU_PAR_MIN
