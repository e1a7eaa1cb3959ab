/* ===========================================================================
 * dt_ops_shape.c -- shape ops: reshape, flatten, transpose, permute, concat,
 * slice, split
 * ===========================================================================
 * Reshape (and reshape2, flatten) returns a view: no copy, the output's data
 * is the input's data; its gradient is a separate buffer that backward adds
 * into the input's gradient. Every other op here copies.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* Tile edge of the blocked 2-D transpose. */
#define DT__SHAPE_TILE 32

/* "[2,3,4]" from a shape array into buf (cap >= 2). */
static const char *dt__shape_fmt(const int64_t *shape, int ndim, char *buf, size_t cap) {
  size_t k = (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < ndim && k < cap; i++)
    k += (size_t)snprintf(buf + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

/* Product of dims [from, to). */
static int64_t dt__shape_prod(const int64_t *shape, int from, int to) {
  int64_t p = 1;
  for (int d = from; d < to; d++) p *= shape[d];
  return p;
}

/* ---- reshape, reshape2, flatten ---------------------------------------------------------- */

/* y and x have the same number of elements in the same order. */
static void dt__shape_same_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  const float *go = y->grad;
  if (g->device) {
    dt__dev_acc(g, gx, go, y->size, y->op);
    return;
  }
  for (int64_t i = 0; i < y->size; i++) gx[i] += go[i];
}

static dt_tensor *dt__shape_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const char *op) {
  char s1[96], s2[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: %d dimensions (allowed 0..%d)", op, ndim, DTRAIN_MAX_DIMS);
  if (ndim > 0 && !shape) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", op);
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    s[d] = shape[d];
    if (shape[d] == -1) {
      if (infer >= 0)
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: new shape %s has more than one -1 (dims %d and %d)",
                                     op, dt__shape_fmt(shape, ndim, s2, sizeof s2), infer, d);
      infer = d;
    } else if (shape[d] <= 0) {
      return (dt_tensor *)dt__fail(g, shape[d] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                                   "%s: new shape %s: dimension %d is %lld (must be >= 1, or -1 to infer)", op,
                                   dt__shape_fmt(shape, ndim, s2, sizeof s2), d, (long long)shape[d]);
    }
  }
  /* Product of the known dims; stops growing (and mismatches) once past x->size. */
  int64_t known = 1;
  int fits = 1;
  for (int d = 0; d < ndim && fits; d++) {
    if (d == infer) continue;
    if (known > x->size / s[d]) fits = 0;
    else known *= s[d];
  }
  if (fits && infer >= 0) {
    if (x->size % known != 0) fits = 0;
    else s[infer] = x->size / known;
  } else if (fits && known != x->size) {
    fits = 0;
  }
  if (!fits)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: cannot reshape %s (%lld elements) into %s", op,
                                 dt_shape_str(x, s1, sizeof s1), (long long)x->size,
                                 dt__shape_fmt(shape, ndim, s2, sizeof s2));
  dt_tensor *y = dt__new_view(g, op, ndim, s, x->data);
  if (!y) return NULL;
  dt__record(g, y, op, dt__shape_same_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape) {
  return dt__shape_reshape(g, x, ndim, shape, "dt_reshape");
}

DTRAIN_API dt_tensor *dt_reshape2(dt_graph *g, dt_tensor *x, int64_t d0, int64_t d1) {
  int64_t s[2];
  s[0] = d0;
  s[1] = d1;
  return dt__shape_reshape(g, x, 2, s, "dt_reshape2");
}

/* [N] -> [N,1]; [N, ...] -> [N, rest]. */
DTRAIN_API dt_tensor *dt_flatten(dt_graph *g, dt_tensor *x) {
  if (!dt__begin(g, "dt_flatten", 1, x)) return NULL;
  if (x->ndim < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_flatten: input is a scalar (needs rank >= 1)");
  int64_t s[2];
  s[0] = x->shape[0];
  s[1] = x->size / x->shape[0];
  return dt__shape_reshape(g, x, 2, s, "dt_flatten");
}

/* ---- transpose ------------------------------------------------------------------------------ */

/* dst (cols x rows) = or += src (rows x cols)^T, in tiles. */
static void dt__shape_transpose2d(const float *src, float *dst, int64_t rows, int64_t cols, int acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += DT__SHAPE_TILE) {
    int64_t r1 = DT__MIN(rows, r0 + DT__SHAPE_TILE);
    for (int64_t c0 = 0; c0 < cols; c0 += DT__SHAPE_TILE) {
      int64_t c1 = DT__MIN(cols, c0 + DT__SHAPE_TILE);
      for (int64_t c = c0; c < c1; c++) {
        float *d = dst + c * rows;
        if (acc) for (int64_t r = r0; r < r1; r++) d[r] += src[r * cols + c];
        else for (int64_t r = r0; r < r1; r++) d[r] = src[r * cols + c];
      }
    }
  }
}

/* iaux: 0 batch, 1 rows (M), 2 cols (N) of the input [..., M, N]. */
static void dt__shape_transpose_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t batch = y->iaux[0], m = y->iaux[1], n = y->iaux[2];
  for (int64_t b = 0; b < batch; b++) dt__shape_transpose2d(y->grad + b * m * n, gx + b * m * n, n, m, 1);
}

DTRAIN_API dt_tensor *dt_transpose(dt_graph *g, dt_tensor *x) {
  if (!dt__begin(g, "dt_transpose", 1, x)) return NULL;
  if (x->ndim < 2) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_transpose: input %s has rank %d (needs >= 2)",
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  int nd = x->ndim;
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) s[d] = x->shape[d];
  s[nd - 2] = x->shape[nd - 1];
  s[nd - 1] = x->shape[nd - 2];
  if (g->device)
    return dt__dev_transpose(g, x, nd, s, dt__shape_prod(x->shape, 0, nd - 2), x->shape[nd - 2], x->shape[nd - 1]);
  dt_tensor *y = dt__new(g, "dt_transpose", nd, s);
  if (!y) return NULL;
  int64_t m = x->shape[nd - 2], n = x->shape[nd - 1], batch = dt__shape_prod(x->shape, 0, nd - 2);
  for (int64_t b = 0; b < batch; b++) dt__shape_transpose2d(x->data + b * m * n, y->data + b * m * n, m, n, 0);
  y->iaux[0] = batch;
  y->iaux[1] = m;
  y->iaux[2] = n;
  dt__record(g, y, "dt_transpose", dt__shape_transpose_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- permute --------------------------------------------------------------------------------
 * iaux[0..ndim) holds the normalised perm. The output is walked in order with
 * the matching input offset; the last output dim is the inner loop. */

static void dt__shape_perm_walk(const dt_tensor *x, const dt_tensor *y, const int64_t *perm, const float *src,
                                float *dst, int backward) {
  int nd = y->ndim;
  if (nd == 0) {
    if (backward) dst[0] += src[0];
    else dst[0] = src[0];
    return;
  }
  int64_t xst[DTRAIN_MAX_DIMS], st[DTRAIN_MAX_DIMS], idx[DTRAIN_MAX_DIMS];
  dt__strides(x, xst);
  for (int d = 0; d < nd; d++) {
    st[d] = xst[perm[d]];
    idx[d] = 0;
  }
  int64_t last = y->shape[nd - 1], ls = st[nd - 1], off = 0;
  for (int64_t i = 0; i < y->size; i += last) {
    /* forward: dst = y, src = x; backward: dst = gx, src = gy */
    if (backward) for (int64_t j = 0; j < last; j++) dst[off + j * ls] += src[i + j];
    else for (int64_t j = 0; j < last; j++) dst[i + j] = src[off + j * ls];
    for (int d = nd - 2; d >= 0; d--) {
      idx[d]++;
      off += st[d];
      if (idx[d] < y->shape[d]) break;
      off -= st[d] * y->shape[d];
      idx[d] = 0;
    }
  }
}

static void dt__shape_permute_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt__shape_perm_walk(x, y, y->iaux, y->grad, gx, 1);
}

DTRAIN_API dt_tensor *dt_permute(dt_graph *g, dt_tensor *x, const int *perm) {
  if (!dt__begin(g, "dt_permute", 1, x)) return NULL;
  int nd = x->ndim;
  if (nd > 0 && !perm) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_permute: perm is NULL");
  int64_t p[DTRAIN_MAX_DIMS] = {0}, s[DTRAIN_MAX_DIMS] = {0};
  int seen[DTRAIN_MAX_DIMS] = {0};
  int ok = 1;
  for (int d = 0; d < nd; d++) {
    int a = dt__axis(perm[d], nd);
    if (a < 0 || seen[a]) ok = 0;
    else seen[a] = 1;
    p[d] = a;
  }
  if (!ok) {
    char sb[96], pb[96];
    size_t k = (size_t)snprintf(pb, sizeof pb, "{");
    for (int d = 0; d < nd && k < sizeof pb; d++) k += (size_t)snprintf(pb + k, sizeof pb - k, d ? ",%d" : "%d", perm[d]);
    if (k < sizeof pb) snprintf(pb + k, sizeof pb - k, "}");
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_permute: perm %s is not a permutation of the %d dims of %s",
                                 pb, nd, dt_shape_str(x, sb, sizeof sb));
  }
  for (int d = 0; d < nd; d++) s[d] = x->shape[p[d]];
  if (g->device) return dt__dev_permute(g, x, nd, s, p);
  dt_tensor *y = dt__new(g, "dt_permute", nd, s);
  if (!y) return NULL;
  for (int d = 0; d < nd; d++) y->iaux[d] = p[d];
  dt__shape_perm_walk(x, y, y->iaux, x->data, y->data, 0);
  dt__record(g, y, "dt_permute", dt__shape_permute_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- concat ---------------------------------------------------------------------------------
 * Inputs are viewed as [outer, len_j, inner]. aux holds all n input pointers
 * (arena); src[0..3] the first four, for inspection only.
 * iaux: 0 n, 1 outer, 2 inner. */

static void dt__shape_concat_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *const *xs = (dt_tensor *const *)y->aux;
  int n = (int)y->iaux[0];
  int64_t outer = y->iaux[1];
  int64_t row = y->size / outer, base = 0; /* base: start of xs[j] within a y row */
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->size / outer;
    float *gx = dt__grad(g, x);
    if (g->err != DTRAIN_OK) return;
    if (gx) {
      for (int64_t o = 0; o < outer; o++) {
        const float *go = y->grad + o * row + base;
        float *gxo = gx + o * chunk;
        for (int64_t i = 0; i < chunk; i++) gxo[i] += go[i];
      }
    }
    base += chunk;
  }
}

DTRAIN_API dt_tensor *dt_concat(dt_graph *g, dt_tensor *const *xs, int n, int axis) {
  char s1[96], s2[96];
  if (!dt__begin(g, "dt_concat", 0)) return NULL;
  if (!xs) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs is NULL");
  if (n < 1) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: n is %d (needs >= 1)", n);
  for (int j = 0; j < n; j++) {
    if (!xs[j]) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs[%d] is NULL", j);
    if (xs[j]->graph != g)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: xs[%d] belongs to another graph", j);
    if (!dt__take_input(g, "dt_concat", xs[j], j + 1)) return NULL; /* spent by dt_relu_inplace */
  }
  const dt_tensor *x0 = xs[0];
  int nd = x0->ndim;
  int ax = dt__axis(axis, nd);
  if (ax < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "dt_concat: axis %d out of range for %s (rank %d)", axis,
                                 dt_shape_str(x0, s1, sizeof s1), nd);
  int64_t cat = 0;
  for (int j = 0; j < n; j++) {
    const dt_tensor *x = xs[j];
    int same = x->ndim == nd;
    for (int d = 0; d < nd && same; d++)
      if (d != ax && x->shape[d] != x0->shape[d]) same = 0;
    if (!same)
      return (dt_tensor *)dt__fail(g, x->ndim == nd ? DTRAIN_ERR_SHAPE : DTRAIN_ERR_RANK,
                                   "dt_concat: xs[%d] is %s but xs[0] is %s (all dims but axis %d must agree)", j,
                                   dt_shape_str(x, s1, sizeof s1), dt_shape_str(x0, s2, sizeof s2), ax);
    if (dt__too_many((uint64_t)cat)) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "dt_concat: result too large");
    cat += x->shape[ax];
  }
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) s[d] = x0->shape[d];
  s[ax] = cat;
  dt_tensor **list = (dt_tensor **)dt__arena_alloc(g, (size_t)n * sizeof(dt_tensor *));
  if (!list) return NULL;
  int64_t outer = dt__shape_prod(s, 0, ax), inner = dt__shape_prod(s, ax + 1, nd);
  if (g->device) return dt__dev_concat(g, xs, n, list, nd, s, outer, inner, ax);
  dt_tensor *y = dt__new(g, "dt_concat", nd, s);
  if (!y) return NULL;
  int64_t row = cat * inner, base = 0;
  dt_tensor *first_rg = NULL;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->shape[ax] * inner;
    for (int64_t o = 0; o < outer; o++)
      memcpy(y->data + o * row + base, x->data + o * chunk, (size_t)chunk * sizeof(float));
    base += chunk;
    list[j] = x;
    if (!first_rg && (x->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) first_rg = x;
  }
  y->aux = list;
  y->iaux[0] = n;
  y->iaux[1] = outer;
  y->iaux[2] = inner;
  /* dt__record decides from its three tensor arguments whether y goes on the
   * tape; give it the first input that needs a gradient (any of the n), then
   * show the first four inputs in src. Backward walks aux, all n inputs. */
  dt__record(g, y, "dt_concat", dt__shape_concat_backward, first_rg ? first_rg : list[0], NULL, NULL);
  for (int j = 0; j < 4; j++) y->src[j] = j < n ? list[j] : NULL;
  y->flags |= DT__TENSOR_AUX_INPUTS;
  return dt__finish(g, y);
}

/* ---- slice and split --------------------------------------------------------------------------
 * x viewed as [outer, dim, inner]; y = x[:, start:start+len, :].
 * iaux: 0 outer, 1 dim, 2 inner, 3 start, 4 len. */

static void dt__shape_slice_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], dim = y->iaux[1], inner = y->iaux[2], start = y->iaux[3], len = y->iaux[4];
  int64_t chunk = len * inner;
  for (int64_t o = 0; o < outer; o++) {
    float *gxo = gx + (o * dim + start) * inner;
    const float *go = y->grad + o * chunk;
    for (int64_t i = 0; i < chunk; i++) gxo[i] += go[i];
  }
}

static dt_tensor *dt__shape_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len, const char *op) {
  char sb[96];
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: axis %d out of range for %s (rank %d)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  int64_t dim = x->shape[ax];
  if (start < 0 || len < 1 || start >= dim || len > dim - start)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: start %lld, len %lld out of bounds for axis %d (size %lld) of %s",
                                 op, (long long)start, (long long)len, ax, (long long)dim,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < x->ndim; d++) s[d] = x->shape[d];
  s[ax] = len;
  int64_t outer = dt__shape_prod(x->shape, 0, ax), inner = dt__shape_prod(x->shape, ax + 1, x->ndim);
  if (g->device) return dt__dev_slice(g, x, op, x->ndim, s, outer, dim, inner, start, len);
  dt_tensor *y = dt__new(g, op, x->ndim, s);
  if (!y) return NULL;
  int64_t chunk = len * inner;
  for (int64_t o = 0; o < outer; o++)
    memcpy(y->data + o * chunk, x->data + (o * dim + start) * inner, (size_t)chunk * sizeof(float));
  y->iaux[0] = outer;
  y->iaux[1] = dim;
  y->iaux[2] = inner;
  y->iaux[3] = start;
  y->iaux[4] = len;
  dt__record(g, y, op, dt__shape_slice_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len) {
  if (!dt__begin(g, "dt_slice", 1, x)) return NULL;
  return dt__shape_slice(g, x, axis, start, len, "dt_slice");
}

DTRAIN_API dt_result dt_split(dt_graph *g, dt_tensor *x, int axis, int n, dt_tensor **outs) {
  char sb[96];
  if (outs)
    for (int i = 0; i < n; i++) outs[i] = NULL;
  if (!dt__begin(g, "dt_split", 1, x)) return g ? g->err : DTRAIN_ERR_NULL_ARG;
  if (!outs) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_split: outs is NULL");
    return g->err;
  }
  if (n < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_split: n is %d (needs >= 1)", n);
    return g->err;
  }
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    dt__fail(g, DTRAIN_ERR_INDEX, "dt_split: axis %d out of range for %s (rank %d)", axis,
             dt_shape_str(x, sb, sizeof sb), x->ndim);
    return g->err;
  }
  if (x->shape[ax] % n != 0) {
    dt__fail(g, DTRAIN_ERR_SHAPE, "dt_split: axis %d of %s (size %lld) does not split into %d equal parts", ax,
             dt_shape_str(x, sb, sizeof sb), (long long)x->shape[ax], n);
    return g->err;
  }
  int64_t part = x->shape[ax] / n;
  for (int i = 0; i < n; i++) {
    outs[i] = dt__shape_slice(g, x, ax, (int64_t)i * part, part, "dt_split");
    if (!outs[i]) {
      for (int j = 0; j < i; j++) outs[j] = NULL;
      return g->err != DTRAIN_OK ? g->err : DTRAIN_ERR_INTERNAL;
    }
  }
  return DTRAIN_OK;
}

#undef DT__SHAPE_TILE
