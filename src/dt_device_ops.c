/* ===========================================================================
 * dt_device_ops.c -- device twins of the elementwise, reduction and shape
 * ops (see dt_device.h for the list)
 * ===========================================================================
 * Ops layer. An op with a device path (dt_ops_elem.c, dt_ops_reduce.c,
 * dt_ops_shape.c) calls its twin here right after dt__begin when g->device
 * is set; the twin checks what the device supports, allocates its output
 * from the device arena, asks the device to run the kernel(s) through
 * dt__dev_run (dt_tensor.c) and records a device backward function. The
 * GEMM-based and nn twins are in dt_device_nn.c.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_maps.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* ---- elementwise binary: same shapes, or b over a's leading dims ---------------------- */

static void dt__device_binary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel k = (dt_kernel)y->iaux[0];
  dt_kernel_args r;
  if (ga) {
    dt__dev_args0(&r);
    r.p[0] = ga;
    r.p[1] = y->grad;
    r.p[2] = b->data;
    r.n[0] = y->size;
    r.n[1] = b->size;
    r.f[0] = 1.0f;
    if (!dt__dev_run(g, y->op,
                     k == DTRAIN_K_MUL ? DTRAIN_K_ACC_MUL : k == DTRAIN_K_DIV ? DTRAIN_K_ACC_DIV : DTRAIN_K_ACC, &r))
      return;
  }
  if (gb) { /* summed over the rows b was repeated over (one row when shapes agree) */
    dt__dev_args0(&r);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.p[2] = a->data;
    r.n[0] = y->size;
    r.n[1] = b->size;
    r.f[0] = k == DTRAIN_K_SUB ? -1.0f : 1.0f;
    if (k == DTRAIN_K_DIV) { /* gb -= gy * a / b^2 */
      r.p[2] = b->data;
      r.p[3] = a->data;
    }
    dt__dev_run(g, y->op,
                k == DTRAIN_K_MUL   ? DTRAIN_K_ACC_MUL_ROWS
                : k == DTRAIN_K_DIV ? DTRAIN_K_DIV_BWD_ROWS
                                    : DTRAIN_K_ACC_ROWS,
                &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op) {
  /* b must match a's trailing dims; b's leading dims of 1 stretch. Then b's
   * flat index is i % b->size. */
  int lead = 0;
  while (lead < b->ndim && b->shape[lead] == 1) lead++;
  int ok = b->ndim <= a->ndim;
  for (int d = 0; ok && d < b->ndim - lead; d++)
    if (b->shape[b->ndim - 1 - d] != a->shape[a->ndim - 1 - d]) ok = 0;
  if (!ok) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_UNSUPPORTED,
                                 "%s: shapes %s and %s on device %s: only equal shapes or b over a's leading dims "
                                 "(e.g. [N,C] and [C]) are supported on a device",
                                 op, dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2), g->device->name);
  }
  dt_tensor *y = dt__new_like(g, op, a);
  if (!y) return NULL;
  dt_kernel k = (dt_kernel)kind;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = a->data;
  r.p[2] = b->data;
  r.n[0] = y->size;
  r.n[1] = b->size;
  if (!dt__dev_run(g, op, k, &r)) return NULL;
  y->iaux[0] = k;
  dt__record(g, y, op, dt__device_binary_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- elementwise maps (every op of DT__MAP_LIST in dt_maps.h) ------------------------------
 * All run the DTRAIN_K_MAP kernel with their dt_map_fn, except ReLU, sigmoid
 * and tanh, which keep their own kernels (DTRAIN_K_RELU, ...: part of the
 * device interface, which a backend may implement faster). */

/* The own forward kernel of map fn, or DTRAIN_K_MAP. */
static dt_kernel dt__device_map_kernel(int fn) {
  switch (fn) {
    case DTRAIN_MAP_RELU: return DTRAIN_K_RELU;
    case DTRAIN_MAP_SIGMOID: return DTRAIN_K_SIGMOID;
    case DTRAIN_MAP_TANH: return DTRAIN_K_TANH;
    default: return DTRAIN_K_MAP;
  }
}

static void dt__device_map_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int fn = (int)y->iaux[0];
  dt_kernel k = dt__device_map_kernel(fn);
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->size;
  if (k != DTRAIN_K_MAP) { /* the own kernels read x (ReLU) or y (sigmoid, tanh) as p2 */
    r.p[2] = k == DTRAIN_K_RELU ? x->data : y->data;
    dt__dev_run(g, y->op,
                k == DTRAIN_K_RELU ? DTRAIN_K_RELU_BWD : k == DTRAIN_K_SIGMOID ? DTRAIN_K_SIGMOID_BWD : DTRAIN_K_TANH_BWD,
                &r);
    return;
  }
  r.p[2] = x->data;
  r.p[3] = y->data;
  r.n[1] = fn;
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_MAP_BWD, &r);
}

/* The CPU op's domain check, on the device: a 0/1 map of the elements
 * outside the domain, summed, one float read back. Only on failure does the
 * map come to the host, to name the first bad element as the CPU op does. */
static int dt__device_domain(dt_graph *g, const dt_tensor *x, int domain, const char *op) {
  float *bad = dt__arena_floats(g, x->size);
  float *count = bad ? dt__arena_floats(g, 1) : NULL;
  if (!count) return 0;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = bad;
  r.p[1] = x->data;
  r.n[0] = x->size;
  r.n[1] = domain == DT__MAP_DOMAIN_NONNEG ? DTRAIN_MAP_DOMAIN_NONNEG : DTRAIN_MAP_DOMAIN_POS;
  if (!dt__dev_run(g, op, DTRAIN_K_MAP, &r)) return 0;
  dt__dev_args0(&r);
  r.p[0] = count;
  r.p[1] = bad;
  r.n[0] = x->size;
  r.f[0] = 1.0f;
  float h = 0.0f;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r) || !dt__dev_copy(g, op, &h, count, sizeof h, DTRAIN_COPY_D2H)) return 0;
  if (h == 0.0f) return 1;
  size_t bytes = (size_t)x->size * sizeof(float);
  float *hb = (float *)dt__alloc(bytes);
  if (!hb) {
    dt__fail(g, DTRAIN_ERR_NOMEM, "%s: an input element is outside the op's domain (out of host memory to find it)", op);
    return 0;
  }
  int64_t at = 0;
  float v = 0.0f;
  if (dt__dev_copy(g, op, hb, bad, bytes, DTRAIN_COPY_D2H)) {
    while (at < x->size - 1 && hb[at] == 0.0f) at++;
    if (dt__dev_copy(g, op, &v, x->data + at, sizeof v, DTRAIN_COPY_D2H)) {
      if (domain == DT__MAP_DOMAIN_POW)
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                 (long long)at, (double)v);
      else
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op, (long long)at,
                 (double)v, domain == DT__MAP_DOMAIN_POS ? ">" : ">=");
    }
  }
  dt__free(hb, bytes);
  return 0;
}

DTRAIN_PRIVATE dt_tensor *dt__dev_map(dt_graph *g, dt_tensor *x, int fn, float s, const char *op) {
  int domain = dt__map_domain(fn);
  if (domain == DT__MAP_DOMAIN_POS || domain == DT__MAP_DOMAIN_NONNEG ||
      (domain == DT__MAP_DOMAIN_POW && s != floorf(s)))
    if (!dt__device_domain(g, x, domain, op)) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel k = dt__device_map_kernel(fn);
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  if (k == DTRAIN_K_MAP) {
    r.n[1] = fn;
    r.f[0] = s;
  }
  if (!dt__dev_run(g, op, k, &r)) return NULL;
  y->iaux[0] = fn;
  y->faux[0] = s;
  dt__record(g, y, op, dt__device_map_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- sum / mean ---------------------------------------------------------------------------- */

static void dt__device_reduce_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = x->size;
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_ACC_SCALAR, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op) {
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = x->size;
  r.f[0] = mean ? (float)(1.0 / (double)x->size) : 1.0f;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  y->faux[0] = r.f[0];
  dt__record(g, y, op, dt__device_reduce_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- sum / mean over one axis ---------------------------------------------------------------- */

static void dt__device_reduce_axis_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[1];
  r.n[2] = y->iaux[2];
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_SUM_AXIS_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_axis(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t outer,
                                              int64_t len, int64_t inner, int mean, const char *op) {
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = outer;
  r.n[1] = len;
  r.n[2] = inner;
  r.n[3] = mean;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM_AXIS, &r)) return NULL;
  y->iaux[0] = outer;
  y->iaux[1] = len;
  y->iaux[2] = inner;
  y->iaux[3] = mean;
  y->faux[0] = mean ? (float)(1.0 / (double)len) : 1.0f;
  dt__record(g, y, op, dt__device_reduce_axis_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- transpose (last two dims) ----------------------------------------------------------------- */

static void dt__device_transpose_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r; /* gx [b, m, n] += (gy [b, n, m])^T */
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[2];
  r.n[2] = y->iaux[1];
  r.n[3] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_TRANSPOSE, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_transpose(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t batch,
                                            int64_t m, int64_t n) {
  const char *op = "dt_transpose";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = batch;
  r.n[1] = m;
  r.n[2] = n;
  if (!dt__dev_run(g, op, DTRAIN_K_TRANSPOSE, &r)) return NULL;
  y->iaux[0] = batch;
  y->iaux[1] = m;
  y->iaux[2] = n;
  dt__record(g, y, op, dt__device_transpose_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- permute: one gather kernel (and its scatter-add backward) --------------------------------
 * iaux[0..ndim): the permutation, as the CPU op keeps it. */

static void dt__device_permute_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__dev_args0(r);
  r->n[0] = y->size;
  r->n[1] = y->ndim;
  int64_t packed = 0;
  for (int d = 0; d < y->ndim; d++) {
    r->n[2 + d] = y->shape[d];
    packed |= y->iaux[d] << (4 * d);
  }
  r->n[8] = packed;
}

static void dt__device_permute_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_permute_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[9] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_PERMUTE, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_permute(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const int64_t *perm) {
  const char *op = "dt_permute";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  for (int d = 0; d < ndim; d++) y->iaux[d] = perm[d];
  dt_kernel_args r;
  dt__device_permute_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_PERMUTE, &r)) return NULL;
  dt__record(g, y, op, dt__device_permute_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- slice / split / concat: strided row copies --------------------------------------------- */

static int dt__device_copy_rows(dt_graph *g, const char *op, float *dst, const float *src, int64_t rows, int64_t chunk,
                                int64_t dst_stride, int64_t src_stride, int acc) {
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = dst;
  r.p[1] = (float *)(uintptr_t)src;
  r.n[0] = rows;
  r.n[1] = chunk;
  r.n[2] = dst_stride;
  r.n[3] = src_stride;
  r.n[4] = acc;
  return dt__dev_run(g, op, DTRAIN_K_COPY_ROWS, &r);
}

/* iaux as the CPU op: 0 outer, 1 dim, 2 inner, 3 start, 4 len. */
static void dt__device_slice_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], dim = y->iaux[1], inner = y->iaux[2], start = y->iaux[3], len = y->iaux[4];
  dt__device_copy_rows(g, y->op, gx + start * inner, y->grad, outer, len * inner, dim * inner, len * inner, 1);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_slice(dt_graph *g, dt_tensor *x, const char *op, int ndim, const int64_t *shape,
                                        int64_t outer, int64_t dim, int64_t inner, int64_t start, int64_t len) {
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  if (!dt__device_copy_rows(g, op, y->data, x->data + start * inner, outer, len * inner, len * inner, dim * inner, 0))
    return NULL;
  y->iaux[0] = outer;
  y->iaux[1] = dim;
  y->iaux[2] = inner;
  y->iaux[3] = start;
  y->iaux[4] = len;
  dt__record(g, y, op, dt__device_slice_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* aux: the n inputs (host arena); iaux 0 n, 1 outer, 2 inner (the CPU op's layout). */
static void dt__device_concat_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *const *xs = (dt_tensor *const *)y->aux;
  int n = (int)y->iaux[0];
  int64_t outer = y->iaux[1], row = y->size / outer, base = 0;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->size / outer;
    float *gx = dt__grad(g, x);
    if (g->err != DTRAIN_OK) return;
    if (gx && !dt__device_copy_rows(g, y->op, gx, y->grad + base, outer, chunk, chunk, row, 1)) return;
    base += chunk;
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_concat(dt_graph *g, dt_tensor *const *xs, int n, dt_tensor **list, int ndim,
                                         const int64_t *shape, int64_t outer, int64_t inner, int ax) {
  const char *op = "dt_concat";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  int64_t row = shape[ax] * inner, base = 0;
  dt_tensor *first_rg = NULL;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->shape[ax] * inner;
    if (!dt__device_copy_rows(g, op, y->data + base, x->data, outer, chunk, row, chunk, 0)) return NULL;
    base += chunk;
    list[j] = x;
    if (!first_rg && (x->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) first_rg = x;
  }
  y->aux = list;
  y->iaux[0] = n;
  y->iaux[1] = outer;
  y->iaux[2] = inner;
  dt__record(g, y, op, dt__device_concat_backward, first_rg ? first_rg : list[0], NULL, NULL);
  for (int j = 0; j < 4; j++) y->src[j] = j < n ? list[j] : NULL;
  return dt__finish(g, y);
}

/* ---- causal mask ---------------------------------------------------------------------------- */

static void dt__device_causal_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->size;
  r.n[1] = y->shape[y->ndim - 1];
  r.n[2] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_CAUSAL_MASK, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_causal_mask(dt_graph *g, dt_tensor *x, int64_t t) {
  const char *op = "dt_causal_mask";
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  r.n[1] = t;
  if (!dt__dev_run(g, op, DTRAIN_K_CAUSAL_MASK, &r)) return NULL;
  dt__record(g, y, op, dt__device_causal_backward, x, NULL, NULL);
  if (g->err != DTRAIN_OK) return NULL;
  if (!g->check_numerics) return y;
  /* The -inf entries are intended: check only the kept ones, on the host. */
  size_t bytes = (size_t)y->size * sizeof(float);
  float *h = (float *)dt__alloc(bytes);
  if (!h) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "%s: check_numerics: out of host memory", op);
  dt_tensor *res = y;
  if (!dt__dev_copy(g, op, h, y->data, bytes, DTRAIN_COPY_D2H)) {
    res = NULL;
  } else {
    for (int64_t i = 0; i < y->size && res; i++) {
      if (i % t > (i / t) % t || isfinite(h[i])) continue;
      char sb[96];
      dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", op, dt_shape_str(y, sb, sizeof sb),
               isnan(h[i]) ? "NaN" : "Inf", (long long)i);
      res = NULL;
    }
  }
  dt__free(h, bytes);
  return res;
}
