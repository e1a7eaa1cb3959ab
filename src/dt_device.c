/* ===========================================================================
 * dt_device.c -- the device hook: device arena, transfers, and the device
 * twins of the ops that have kernels (see dt_device.h for the list)
 * ===========================================================================
 * On a device graph tensor headers come from the host arena (dt__arena_alloc)
 * and tensor data from the device arena below (dt__arena_floats switches on
 * g->device). Each op with a device path calls its dt__dev_* twin here right
 * after dt__begin; the twin checks what the device supports, allocates its
 * output, asks the device to run the kernel(s) and records a device backward
 * function. Every other op is refused by dt__begin (dt__dev_op_ok) with
 * DTRAIN_ERR_UNSUPPORTED, so no CPU loop ever reads device memory.
 * Nothing here runs on a CPU graph: the CPU ops only test `g->device`.
 */
#include "dt_internal.h"

struct dt__dchunk {
  dt__dchunk *next;
  void *base; /* device memory */
  size_t cap, used;
};

/* Device allocations are 256-byte aligned (what cudaMalloc gives, and what
 * coalesced loads like). */
#define DT__DEV_ALIGN 256

/* Ops with a device path (dt__begin refuses every other op on a device). */
static const char *const dt__device_ops[] = {
  "dt_tensor_new", "dt_tensor_from", "dt_tensor_wrap", "dt_detach", "dt_param", "dt_backward", "dt_backward_grad",
  "dt_add", "dt_sub", "dt_mul", "dt_div", "dt_add_scalar", "dt_mul_scalar", "dt_rsub_scalar", "dt_pow_scalar",
  "dt_neg", "dt_exp", "dt_log", "dt_sqrt", "dt_leaky_relu", "dt_gelu", "dt_relu", "dt_sigmoid", "dt_tanh", "dt_sum", "dt_mean", "dt_sum_axis", "dt_mean_axis", "dt_transpose", "dt_dropout", "dt_layer_norm", "dt_embedding", "dt_matmul", "dt_linear",
  "dt_softmax", "dt_log_softmax", "dt_cross_entropy", "dt_mse", "dt_reshape", "dt_reshape2", "dt_flatten",
  "dt_conv2d", "dt_max_pool2d", "dt_avg_pool2d", "dt_nn_linear_forward", "dt_nn_conv2d_forward", "dt_nn_embedding_forward",
  "dt_nn_layer_norm_forward", "dt_permute", "dt_concat", "dt_slice", "dt_split", "dt_bmm", "dt_causal_mask",
  "dt_batch_norm", "dt_nn_batch_norm_forward", "dt_nn_attention_forward", "dt_nn_lstm_cell_forward",
  "dt_nn_gru_cell_forward", NULL
};

DTRAIN_PRIVATE int dt__dev_op_ok(const char *op) {
  for (int i = 0; dt__device_ops[i]; i++)
    if (strcmp(op, dt__device_ops[i]) == 0) return 1;
  return 0;
}

DTRAIN_API dt_result dt_device_error(dt_result code, const char *msg) {
  return dt__error(code == DTRAIN_OK ? DTRAIN_ERR_INTERNAL : code, "%s", msg ? msg : "device error");
}

/* ---- plumbing: every device call checked, failures fail the graph ------------------ */

DTRAIN_PRIVATE int dt__dev_run(dt_graph *g, const char *op, dt_kernel k, const dt_kernel_args *a) {
  dt_result r = g->device->run(g->device, k, a);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

DTRAIN_PRIVATE int dt__dev_copy(dt_graph *g, const char *op, void *dst, const void *src, size_t bytes,
                                dt_copy_kind kind) {
  if (bytes == 0) return 1;
  dt_result r = g->device->copy(g->device, dst, src, bytes, kind);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

DTRAIN_PRIVATE int dt__dev_zero(dt_graph *g, const char *op, void *p, size_t bytes) {
  if (bytes == 0) return 1;
  dt_result r = g->device->zero(g->device, p, bytes);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

static void dt__device_args0(dt_kernel_args *a) { memset(a, 0, sizeof *a); }

/* ---- device arena ----------------------------------------------------------------- */

static dt__dchunk *dt__device_chunk_new(dt_graph *g, size_t cap) {
  dt__dchunk *c = (dt__dchunk *)dt__alloc(sizeof *c);
  if (!c) {
    dt__fail(g, DTRAIN_ERR_NOMEM, "arena: out of host memory");
    return NULL;
  }
  dt_result r = g->device->alloc(g->device, cap, &c->base);
  if (r != DTRAIN_OK) {
    dt__fail(g, r, "arena: device %s: %s", g->device->name, dt_last_error());
    dt__free(c, sizeof *c);
    return NULL;
  }
  c->next = NULL;
  c->cap = cap;
  c->used = 0;
  return c;
}

static void dt__device_chunks_free(dt_device *d, dt__dchunk *c) {
  while (c) {
    dt__dchunk *n = c->next;
    d->free(d, c->base, c->cap);
    dt__free(c, sizeof *c);
    c = n;
  }
}

DTRAIN_PRIVATE void *dt__dev_arena(dt_graph *g, size_t bytes) {
  size_t need = (bytes + DT__DEV_ALIGN - 1) & ~(size_t)(DT__DEV_ALIGN - 1);
  if (need < bytes) return dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: request of %zu bytes overflows", bytes);
  if (need == 0) need = DT__DEV_ALIGN;
  dt__dchunk *c = g->dchunks;
  if (!c || c->cap - c->used < need) {
    size_t cap = c ? c->cap * 2 : g->first_block;
    if (cap < need) cap = need;
    dt__dchunk *n = dt__device_chunk_new(g, cap);
    if (!n) return NULL;
    n->next = c;
    g->dchunks = n;
    g->dreserved += cap;
    c = n;
  }
  void *p = (unsigned char *)c->base + c->used;
  c->used += need;
  g->used += need;
  if (g->used > g->peak) g->peak = g->used;
  return p;
}

DTRAIN_PRIVATE void dt__dev_reset(dt_graph *g) {
  if (g->dchunks && g->dchunks->next) { /* merge into one block, as the host arena does */
    size_t total = 0;
    for (dt__dchunk *c = g->dchunks; c; c = c->next) total += c->cap;
    dt__dchunk *one = (dt__dchunk *)dt__alloc(sizeof *one);
    if (one && g->device->alloc(g->device, total, &one->base) == DTRAIN_OK) {
      dt__device_chunks_free(g->device, g->dchunks);
      one->next = NULL;
      one->cap = total;
      g->dchunks = one;
      g->dreserved = total;
    } else {
      dt__free(one, sizeof *one);
      dt_clear_error();
    }
  }
  for (dt__dchunk *c = g->dchunks; c; c = c->next) c->used = 0;
}

DTRAIN_PRIVATE void dt__dev_free_chunks(dt_graph *g) {
  dt_device *d = g->device;
  dt__device_chunks_free(d, g->dchunks);
  g->dchunks = NULL;
  if (g->dparam_data) d->free(d, g->dparam_data, g->dparam_n * sizeof(float));
  if (g->dparam_grad) d->free(d, g->dparam_grad, g->dparam_n * sizeof(float));
  g->dparam_data = g->dparam_grad = NULL;
}

/* ---- graph-level device API -------------------------------------------------------- */

DTRAIN_PRIVATE dt_result dt__dev_graph_init(dt_graph *g) {
  dt_device *d = g->device;
  if (!d->alloc || !d->free || !d->zero || !d->copy || !d->sync || !d->run)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_graph_create: device %s has a NULL function", d->name ? d->name : "?");
  size_t n = dt_params_size(g->params), bytes;
  if (n == 0) return DTRAIN_OK;
  if (!dt__mul_size(n, sizeof(float), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_graph_create: params too large");
  void *pd = NULL, *pg = NULL;
  dt_result r = d->alloc(d, bytes, &pd);
  if (r == DTRAIN_OK) r = d->alloc(d, bytes, &pg);
  if (r != DTRAIN_OK) {
    if (pd) d->free(d, pd, bytes);
    return dt__error(r, "dt_graph_create: device copy of the params (%zu bytes): %s", bytes, dt_last_error());
  }
  g->dparam_data = (float *)pd;
  g->dparam_grad = (float *)pg;
  g->dparam_n = n;
  return dt_graph_params_upload(g);
}

DTRAIN_API dt_device *dt_graph_device(const dt_graph *g) { return g ? g->device : NULL; }

DTRAIN_API float *dt_graph_param_data(dt_graph *g) {
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_data;
  return g->device ? g->dparam_data : dt_params_data(g->params);
}

DTRAIN_API float *dt_graph_param_grad(dt_graph *g) {
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_grad;
  return g->device ? g->dparam_grad : dt_params_grad(g->params);
}

DTRAIN_API dt_result dt_graph_params_upload(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_upload: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_upload: params changed size since the graph was created");
  size_t bytes = g->dparam_n * sizeof(float);
  dt_result r = d->copy(d, g->dparam_data, dt_params_data(g->params), bytes, DTRAIN_COPY_H2D);
  if (r == DTRAIN_OK) r = d->zero(d, g->dparam_grad, bytes);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_upload: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_params_download(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_download: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_download: params changed size since the graph was created");
  dt_result r = d->copy(d, dt_params_data(g->params), g->dparam_data, g->dparam_n * sizeof(float), DTRAIN_COPY_D2H);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_download: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_zero_grad(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_zero_grad: graph is NULL");
  float *grad = dt_graph_param_grad(g);
  size_t n = dt_params_size(g->params);
  if (!grad || n == 0) return DTRAIN_OK;
  if (!g->device) {
    memset(grad, 0, n * sizeof(float));
    return DTRAIN_OK;
  }
  dt_result r = g->device->zero(g->device, grad, n * sizeof(float));
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_zero_grad: device %s: %s", g->device->name, dt_last_error());
  return DTRAIN_OK;
}

static dt_result dt__device_to_host(const dt_tensor *t, const float *src, float *dst, const char *fn) {
  if (!t || !dst) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  size_t bytes = (size_t)t->size * sizeof(float);
  dt_device *d = t->graph ? t->graph->device : NULL;
  if (!src) {
    memset(dst, 0, bytes);
    return DTRAIN_OK;
  }
  if (!d) {
    memcpy(dst, src, bytes);
    return DTRAIN_OK;
  }
  dt_result r = d->copy(d, dst, src, bytes, DTRAIN_COPY_D2H);
  if (r != DTRAIN_OK) return dt__error(r, "%s: device %s: %s", fn, d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tensor_to_host(const dt_tensor *t, float *dst) {
  return dt__device_to_host(t, t ? t->data : NULL, dst, "dt_tensor_to_host");
}

DTRAIN_API dt_result dt_tensor_grad_to_host(const dt_tensor *t, float *dst) {
  return dt__device_to_host(t, t ? t->grad : NULL, dst, "dt_tensor_grad_to_host");
}

/* check_numerics on a device: the output comes to the host to be checked. */
DTRAIN_PRIVATE dt_tensor *dt__dev_check_numerics(dt_graph *g, dt_tensor *out) {
  size_t bytes = (size_t)out->size * sizeof(float);
  float *h = (float *)dt__alloc(bytes);
  if (!h) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "%s: check_numerics: out of host memory", out->op);
  dt_tensor *res = out;
  if (!dt__dev_copy(g, out->op, h, out->data, bytes, DTRAIN_COPY_D2H)) {
    res = NULL;
  } else {
    for (int64_t i = 0; i < out->size; i++) {
      if (!isfinite(h[i])) {
        char sb[96];
        dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", out->op,
                 dt_shape_str(out, sb, sizeof sb), isnan(h[i]) ? "NaN" : "Inf", (long long)i);
        res = NULL;
        break;
      }
    }
  }
  dt__free(h, bytes);
  return res;
}

DTRAIN_PRIVATE void dt__dev_acc(dt_graph *g, float *gx, const float *gy, int64_t n, const char *op) {
  dt_kernel_args a;
  dt__device_args0(&a);
  a.p[0] = gx;
  a.p[1] = (float *)(uintptr_t)gy;
  a.n[0] = n;
  a.f[0] = 1.0f;
  dt__dev_run(g, op, DTRAIN_K_ACC, &a);
}

/* ---- elementwise binary: same shapes, or b over a's leading dims ---------------------- */

static void dt__device_binary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel k = (dt_kernel)y->iaux[0];
  dt_kernel_args r;
  if (ga) {
    dt__device_args0(&r);
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
    dt__device_args0(&r);
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
  dt__device_args0(&r);
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

/* ---- unary ------------------------------------------------------------------------------ */

static void dt__device_unary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel k = (dt_kernel)y->iaux[0];
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = k == DTRAIN_K_RELU ? x->data : y->data;
  r.n[0] = y->size;
  dt__dev_run(g, y->op,
              k == DTRAIN_K_RELU ? DTRAIN_K_RELU_BWD : k == DTRAIN_K_SIGMOID ? DTRAIN_K_SIGMOID_BWD : DTRAIN_K_TANH_BWD,
              &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_unary(dt_graph *g, dt_tensor *x, dt_kernel fwd, const char *op) {
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  if (!dt__dev_run(g, op, fwd, &r)) return NULL;
  y->iaux[0] = fwd;
  dt__record(g, y, op, dt__device_unary_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- elementwise maps (scalar ops, neg, exp, leaky ReLU, GELU) ---------------------------- */

static void dt__device_map_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = y->data;
  r.n[0] = y->size;
  r.n[1] = y->iaux[0];
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_MAP_BWD, &r);
}

/* The CPU op's domain check, on the device: a 0/1 map of the elements
 * outside the domain, summed, one float read back. Only on failure does the
 * map come to the host, to name the first bad element as the CPU op does. */
static int dt__device_domain(dt_graph *g, const dt_tensor *x, int fn, const char *op) {
  float *bad = dt__arena_floats(g, x->size);
  float *count = bad ? dt__arena_floats(g, 1) : NULL;
  if (!count) return 0;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = bad;
  r.p[1] = x->data;
  r.n[0] = x->size;
  r.n[1] = fn == DTRAIN_MAP_SQRT ? DTRAIN_MAP_DOMAIN_NONNEG : DTRAIN_MAP_DOMAIN_POS;
  if (!dt__dev_run(g, op, DTRAIN_K_MAP, &r)) return 0;
  dt__device_args0(&r);
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
      if (fn == DTRAIN_MAP_POW_SCALAR)
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                 (long long)at, (double)v);
      else
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op, (long long)at,
                 (double)v, fn == DTRAIN_MAP_LOG ? ">" : ">=");
    }
  }
  dt__free(hb, bytes);
  return 0;
}

DTRAIN_PRIVATE dt_tensor *dt__dev_map(dt_graph *g, dt_tensor *x, int fn, float s, const char *op) {
  if ((fn == DTRAIN_MAP_POW_SCALAR && s != floorf(s)) || fn == DTRAIN_MAP_LOG || fn == DTRAIN_MAP_SQRT)
    if (!dt__device_domain(g, x, fn, op)) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  r.n[1] = fn;
  r.f[0] = s;
  if (!dt__dev_run(g, op, DTRAIN_K_MAP, &r)) return NULL;
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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

/* ---- dropout: the mask drawn on the host from the graph's RNG (the CPU op's
 * draws, in the same order), copied to the device; y = x * mask, and the
 * backward gx += gy * mask. ------------------------------------------------------------------ */

static void dt__device_dropout_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = (float *)y->aux;
  r.n[0] = y->size;
  r.n[1] = y->size;
  dt__dev_run(g, y->op, DTRAIN_K_ACC_MUL, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_dropout(dt_graph *g, dt_tensor *x, float p) {
  const char *op = "dt_dropout";
  size_t bytes;
  if (!dt__mul_size((size_t)x->size, sizeof(float), &bytes))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: mask of %lld floats overflows", op, (long long)x->size);
  float *host = (float *)dt__arena_alloc(g, bytes); /* host arena: no allocation in steady state */
  float *mask = host ? dt__arena_floats(g, x->size) : NULL;
  dt_tensor *y = mask ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < x->size; i++) host[i] = dt_rng_uniform(&g->rng) >= p ? scale : 0.0f;
  if (!dt__dev_copy(g, op, mask, host, bytes, DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = mask;
  r.n[0] = y->size;
  r.n[1] = y->size;
  if (!dt__dev_run(g, op, DTRAIN_K_MUL, &r)) return NULL;
  y->aux = mask;
  y->faux[0] = p;
  dt__record(g, y, op, dt__device_dropout_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- layer norm over the last dim ------------------------------------------------------------
 * aux: the device stats [mean[rows], rstd[rows]]; iaux 0 rows, 1 d. */

static void dt__device_layer_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  if (gg || gb) {
    dt__device_args0(&r);
    r.p[0] = gg;
    r.p[1] = gb;
    r.p[2] = y->grad;
    r.p[3] = x->data;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    if (!dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD_PARAMS, &r)) return;
  }
  if (gx) {
    dt__device_args0(&r);
    r.p[0] = gx;
    r.p[1] = y->grad;
    r.p[2] = x->data;
    r.p[3] = gamma ? gamma->data : NULL;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps,
                                             int64_t rows, int64_t d) {
  const char *op = "dt_layer_norm";
  float *stats = dt__arena_floats(g, 2 * rows);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = gamma ? gamma->data : NULL;
  r.p[3] = beta ? beta->data : NULL;
  r.p[4] = stats;
  r.n[0] = rows;
  r.n[1] = d;
  r.f[0] = eps;
  if (!dt__dev_run(g, op, DTRAIN_K_LAYER_NORM, &r)) return NULL;
  y->aux = stats;
  y->iaux[0] = rows;
  y->iaux[1] = d;
  dt__record(g, y, op, dt__device_layer_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* ---- embedding: ids checked on the host (by dt_embedding), copied to the device ------------
 * aux: the device ids. */

static void dt__device_embedding_backward(dt_graph *g, dt_tensor *y) {
  float *gt = dt__grad(g, y->src[0]);
  if (!gt) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gt;
  r.p[1] = y->grad;
  r.labels = (const int32_t *)y->aux;
  r.n[0] = y->shape[0];
  r.n[1] = y->shape[1];
  dt__dev_run(g, y->op, DTRAIN_K_EMBED_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, int64_t d) {
  const char *op = "dt_embedding";
  int64_t shape[2];
  shape[0] = n;
  shape[1] = d;
  dt_tensor *y = dt__new(g, op, 2, shape); /* validates the size, so n * 4 bytes cannot overflow */
  int32_t *dids = y ? (int32_t *)dt__dev_arena(g, (size_t)n * sizeof(int32_t)) : NULL;
  if (!dids) return NULL;
  if (!dt__dev_copy(g, op, dids, ids, (size_t)n * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = table->data;
  r.labels = dids;
  r.n[0] = n;
  r.n[1] = d;
  if (!dt__dev_run(g, op, DTRAIN_K_EMBED, &r)) return NULL;
  y->aux = dids;
  dt__record(g, y, op, dt__device_embedding_backward, table, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- GEMM-based: matmul (2-D), linear --------------------------------------------------------- */

/* `batch` products C_i [m,n] (+)= op(A_i) op(B_i), packed row-major, the
 * i-th at A + i*sa, B + i*sb, C + i*sc. */
static int dt__device_gemm_batched(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                   const float *A, int64_t sa, const float *B, int64_t sb, float beta, float *C,
                                   int64_t sc, int64_t batch) {
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = C;
  r.p[1] = (float *)(uintptr_t)A;
  r.p[2] = (float *)(uintptr_t)B;
  r.n[0] = m;
  r.n[1] = n;
  r.n[2] = k;
  r.n[3] = ta | (tb << 1);
  r.n[4] = batch;
  r.n[5] = sa;
  r.n[6] = sb;
  r.n[7] = sc;
  r.f[0] = 1.0f;
  r.f[1] = beta;
  return dt__dev_run(g, op, DTRAIN_K_GEMM, &r);
}

/* C [m,n] (+)= op(A) op(B), packed row-major. */
static int dt__device_gemm(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                           const float *A, const float *B, float beta, float *C) {
  return dt__device_gemm_batched(g, op, ta, tb, m, n, k, A, 0, B, 0, beta, C, 0, 1);
}

static void dt__device_matmul_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t m = y->iaux[0], k = y->iaux[1], n = y->iaux[2];
  if (ga && !dt__device_gemm(g, y->op, 0, 1, m, k, n, y->grad, b->data, 1.0f, ga)) return; /* dA += dC B^T */
  if (gb) dt__device_gemm(g, y->op, 1, 0, k, n, m, a->data, y->grad, 1.0f, gb);            /* dB += A^T dC */
}

DTRAIN_PRIVATE dt_tensor *dt__dev_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1];
  if (b->shape[0] != k) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: inner dims differ (%s @ %s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  int64_t shape[2];
  shape[0] = m;
  shape[1] = n;
  dt_tensor *y = dt__new(g, op, 2, shape);
  if (!y) return NULL;
  if (!dt__device_gemm(g, op, 0, 0, m, n, k, a->data, b->data, 0.0f, y->data)) return NULL;
  y->iaux[0] = m;
  y->iaux[1] = k;
  y->iaux[2] = n;
  dt__record(g, y, op, dt__device_matmul_backward, a, b, NULL);
  return dt__finish(g, y);
}

static void dt__device_linear_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t rows = y->iaux[0], in = y->iaux[1], out = y->iaux[2];
  if (gx && !dt__device_gemm(g, y->op, 0, 0, rows, in, out, y->grad, w->data, 1.0f, gx)) return; /* dx += dy w */
  if (gw && !dt__device_gemm(g, y->op, 1, 0, out, in, rows, y->grad, x->data, 1.0f, gw)) return; /* dw += dy^T x */
  if (gb) {
    dt_kernel_args r;
    dt__device_args0(&r);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.n[0] = rows * out;
    r.n[1] = out;
    r.f[0] = 1.0f;
    dt__dev_run(g, y->op, DTRAIN_K_ACC_ROWS, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int64_t rows,
                                         int64_t in, int64_t out, int ndim, const int64_t *shape) {
  const char *op = "dt_linear";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  if (b) { /* rows of bias, then GEMM with beta = 1: the CPU's order */
    dt_kernel_args r;
    dt__device_args0(&r);
    r.p[0] = y->data;
    r.p[1] = b->data;
    r.n[0] = rows * out;
    r.n[1] = out;
    if (!dt__dev_run(g, op, DTRAIN_K_ROWS_COPY, &r)) return NULL;
  }
  if (!dt__device_gemm(g, op, 0, 1, rows, out, in, x->data, w->data, b ? 1.0f : 0.0f, y->data)) return NULL;
  y->iaux[0] = rows;
  y->iaux[1] = in;
  y->iaux[2] = out;
  dt__record(g, y, op, dt__device_linear_backward, x, w, b);
  return dt__finish(g, y);
}

/* ---- softmax / log_softmax over any axis ---------------------------------------------------- */

static void dt__device_softmax_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_softmax_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = y->data;
  dt__dev_run(g, y->op, DTRAIN_K_SOFTMAX_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_softmax(dt_graph *g, dt_tensor *x, int ax, int is_log, const char *op) {
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t outer = 1, inner = 1, n = x->shape[ax];
  for (int d = 0; d < ax; d++) outer *= x->shape[d];
  for (int d = ax + 1; d < x->ndim; d++) inner *= x->shape[d];
  y->iaux[0] = outer * inner;
  y->iaux[1] = n;
  y->iaux[2] = inner;
  y->iaux[3] = is_log;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_SOFTMAX, &r)) return NULL;
  dt__record(g, y, op, dt__device_softmax_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- cross entropy ----------------------------------------------------------------------------
 * aux (host arena): the device labels and the per-row max / log-sum-exp. */
typedef struct dt__device_xent {
  int32_t *labels;
  float *rowloss, *mx, *ls;
} dt__device_xent;

static void dt__device_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const dt__device_xent *s = (const dt__device_xent *)y->aux;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.p[4] = y->grad;
  r.labels = s->labels;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[1];
  dt__dev_run(g, y->op, DTRAIN_K_XENT_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_xent(dt_graph *g, dt_tensor *x, const int32_t *labels, int64_t rows, int64_t c) {
  const char *op = "dt_cross_entropy";
  dt__device_xent *s = (dt__device_xent *)dt__arena_alloc(g, sizeof *s);
  if (!s) return NULL;
  s->labels = (int32_t *)dt__dev_arena(g, (size_t)rows * sizeof(int32_t));
  s->rowloss = dt__arena_floats(g, 3 * rows);
  if (!s->labels || !s->rowloss) return NULL;
  s->mx = s->rowloss + rows;
  s->ls = s->mx + rows;
  if (!dt__dev_copy(g, op, s->labels, labels, (size_t)rows * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = s->rowloss;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.labels = s->labels;
  r.n[0] = rows;
  r.n[1] = c;
  if (!dt__dev_run(g, op, DTRAIN_K_XENT, &r)) return NULL;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = s->rowloss;
  r.n[0] = rows;
  r.f[0] = (float)(1.0 / (double)rows);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  y->aux = s;
  y->iaux[0] = rows;
  y->iaux[1] = c;
  dt__record(g, y, op, dt__device_xent_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- mean squared error ------------------------------------------------------------------------- */

static void dt__device_mse_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = ga;
  r.p[1] = gb;
  r.p[2] = a->data;
  r.p[3] = b->data;
  r.p[4] = y->grad;
  r.n[0] = a->size;
  dt__dev_run(g, y->op, DTRAIN_K_MSE_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_mse(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  const char *op = "dt_mse";
  float *sq = dt__arena_floats(g, a->size);
  dt_tensor *y = sq ? dt__new(g, op, 0, NULL) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = sq;
  r.p[1] = a->data;
  r.p[2] = b->data;
  r.n[0] = a->size;
  if (!dt__dev_run(g, op, DTRAIN_K_SQDIFF, &r)) return NULL;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = sq;
  r.n[0] = a->size;
  r.f[0] = (float)(1.0 / (double)a->size);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  dt__record(g, y, op, dt__device_mse_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- convolution (im2col + GEMM per image) and pooling -------------------------------
 * The forward keeps the column matrices of the whole batch ([N][K][P], in the
 * device arena) for the backward, which also needs one gradient column
 * buffer of the same size. */

static void dt__device_conv_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *w, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = x->shape[0];
  r->n[1] = x->shape[1];
  r->n[2] = x->shape[2];
  r->n[3] = x->shape[3];
  r->n[4] = w->shape[2];
  r->n[5] = w->shape[3];
  r->n[6] = y->iaux[0];
  r->n[7] = y->iaux[1];
  r->n[8] = y->shape[2];
  r->n[9] = y->shape[3];
  r->n[10] = w->shape[0];
}

static void dt__device_conv_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  const float *col = (const float *)y->aux;
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t pp = y->shape[2] * y->shape[3];
  dt_kernel_args r;
  if (gb) {
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gb;
    r.p[1] = y->grad;
    if (!dt__dev_run(g, y->op, DTRAIN_K_CONV_BIAS_BWD, &r)) return;
  }
  if (gw)
    for (int64_t i = 0; i < n; i++) /* gw [O,K] += gy_i [O,P] @ col_i^T */
      if (!dt__device_gemm(g, y->op, 0, 1, o, k, pp, y->grad + i * o * pp, col + i * k * pp, 1.0f, gw)) return;
  if (gx) {
    float *gcol = dt__arena_floats(g, n * k * pp);
    if (!gcol) return;
    for (int64_t i = 0; i < n; i++) /* gcol_i [K,P] = w^T @ gy_i */
      if (!dt__device_gemm(g, y->op, 1, 0, k, pp, o, w->data, y->grad + i * o * pp, 0.0f, gcol + i * k * pp)) return;
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gx;
    r.p[1] = gcol;
    dt__dev_run(g, y->op, DTRAIN_K_COL2IM_ACC, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  const char *op = "dt_conv2d";
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t ho = (x->shape[2] + 2 * (int64_t)padding - w->shape[2]) / stride + 1;
  int64_t wo = (x->shape[3] + 2 * (int64_t)padding - w->shape[3]) / stride + 1, pp = ho * wo;
  int64_t shape[4];
  shape[0] = n;
  shape[1] = o;
  shape[2] = ho;
  shape[3] = wo;
  size_t cols;
  if (!dt__mul_size((size_t)n, (size_t)k, &cols) || !dt__mul_size(cols, (size_t)pp, &cols) || dt__too_many(cols)) {
    char sx[96], sw[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrices of x %s, w %s too large", op,
                                 dt_shape_str(x, sx, sizeof sx), dt_shape_str(w, sw, sizeof sw));
  }
  dt_tensor *y = dt__new(g, op, 4, shape);
  float *col = y ? dt__arena_floats(g, (int64_t)cols) : NULL;
  if (!col) return NULL;
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt_kernel_args r;
  dt__device_conv_args(&r, x, w, y);
  r.p[0] = col;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_IM2COL, &r)) return NULL;
  if (b) {
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = y->data;
    r.p[1] = b->data;
    if (!dt__dev_run(g, op, DTRAIN_K_CONV_BIAS, &r)) return NULL;
  }
  for (int64_t i = 0; i < n; i++) /* y_i [O,P] = w [O,K] @ col_i [K,P] (+ bias) */
    if (!dt__device_gemm(g, op, 0, 0, o, pp, k, w->data, col + i * k * pp, b ? 1.0f : 0.0f, y->data + i * o * pp))
      return NULL;
  y->aux = col;
  dt__record(g, y, op, dt__device_conv_backward, x, w, b);
  return dt__finish(g, y);
}

static void dt__device_pool_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = x->shape[0] * x->shape[1];
  r->n[1] = x->shape[2];
  r->n[2] = x->shape[3];
  r->n[3] = y->shape[2];
  r->n[4] = y->shape[3];
  r->n[5] = y->iaux[0];
  r->n[6] = y->iaux[1];
}

static void dt__device_pool_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = y->data;
  dt__dev_run(g, y->op, y->iaux[2] ? DTRAIN_K_MAXPOOL_BWD : DTRAIN_K_AVGPOOL_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_pool(dt_graph *g, dt_tensor *x, int kernel, int stride, int is_max, const char *op) {
  int64_t shape[4];
  shape[0] = x->shape[0];
  shape[1] = x->shape[1];
  shape[2] = (x->shape[2] - kernel) / stride + 1;
  shape[3] = (x->shape[3] - kernel) / stride + 1;
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  y->iaux[0] = kernel;
  y->iaux[1] = stride;
  y->iaux[2] = is_max;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, is_max ? DTRAIN_K_MAXPOOL : DTRAIN_K_AVGPOOL, &r)) return NULL;
  dt__record(g, y, op, dt__device_pool_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- batched matmul: one strided-batched GEMM per product --------------------------------
 * y's iaux is dt_ops_matmul.c's layout: 0 batch, 1 M, 2 K, 3 N, 4 trans_b,
 * 5 shared (b 2-D: the batch folds into the rows, one GEMM). The products
 * and their backward are the CPU's, with the batch as one GEMM call. */

static void dt__device_bmm_dims(const dt_tensor *y, int64_t *nb, int64_t *m) {
  int shared = (int)y->iaux[5];
  *nb = shared ? 1 : y->iaux[0];
  *m = shared ? y->iaux[0] * y->iaux[1] : y->iaux[1];
}

static void dt__device_bmm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  int64_t sa = m * k, sb = shared ? 0 : k * n, sc = m * n;
  if (ga) { /* dA += dC @ op(B)^T */
    if (!dt__device_gemm_batched(g, y->op, 0, trans_b ? 0 : 1, m, k, n, y->grad, sc, b->data, sb, 1.0f, ga, sa, nb))
      return;
  }
  if (gb) { /* dB += A^T @ dC, or dB^T += dC^T @ A when B is used transposed */
    if (trans_b) dt__device_gemm_batched(g, y->op, 1, 0, n, k, m, y->grad, sc, a->data, sa, 1.0f, gb, sb, nb);
    else dt__device_gemm_batched(g, y->op, 1, 0, k, n, m, a->data, sa, y->grad, sc, 1.0f, gb, sb, nb);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_bmm(dt_graph *g, dt_tensor *y, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  if (!dt__device_gemm_batched(g, op, 0, trans_b, m, n, k, a->data, m * k, b->data, shared ? 0 : k * n, 0.0f, y->data,
                               m * n, nb))
    return NULL;
  dt__record(g, y, op, dt__device_bmm_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- permute: one gather kernel (and its scatter-add backward) --------------------------------
 * iaux[0..ndim): the permutation, as the CPU op keeps it. */

static void dt__device_permute_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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
  dt__device_args0(&r);
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

/* ---- batch norm ------------------------------------------------------------------------------
 * aux: the device stats [mean[C], rstd[C]]; iaux as the CPU op: 0 N, 1 C, 2 hw,
 * 3 batch statistics used. */

static void dt__device_bn_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_bn_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  float *red = dt__arena_floats(g, 2 * y->iaux[1]);
  if (!red) return;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = gg;
  r.p[1] = gb;
  r.p[2] = y->grad;
  r.p[3] = x->data;
  r.p[4] = (float *)y->aux;
  r.p[5] = red;
  if (!dt__dev_run(g, y->op, DTRAIN_K_BN_BWD_CH, &r) || !gx) return;
  dt__device_bn_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = (float *)y->aux;
  r.p[4] = gamma ? gamma->data : NULL;
  r.p[5] = red;
  dt__dev_run(g, y->op, DTRAIN_K_BN_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                             dt_tensor *running_mean, dt_tensor *running_var, float momentum,
                                             float eps, int64_t nb, int64_t c, int64_t hw, int batch) {
  const char *op = "dt_batch_norm";
  if (!batch) { /* the CPU op's check of the running variance: c floats come to the host */
    float *h = (float *)dt__arena_alloc(g, (size_t)c * sizeof(float));
    if (!h || !dt__dev_copy(g, op, h, running_var->data, (size_t)c * sizeof(float), DTRAIN_COPY_D2H)) return NULL;
    for (int64_t ch = 0; ch < c; ch++)
      if (!(h[ch] + eps > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: running_var[%lld] + eps is %g (must be > 0)", op,
                                     (long long)ch, (double)(h[ch] + eps));
  }
  float *stats = dt__arena_floats(g, 2 * c);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  y->aux = stats;
  y->iaux[0] = nb;
  y->iaux[1] = c;
  y->iaux[2] = hw;
  y->iaux[3] = batch;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = stats;
  r.p[1] = x->data;
  r.p[2] = running_mean ? running_mean->data : NULL;
  r.p[3] = running_var ? running_var->data : NULL;
  r.f[0] = eps;
  r.f[1] = momentum;
  if (!dt__dev_run(g, op, DTRAIN_K_BN_STATS, &r)) return NULL;
  dt__device_bn_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = stats;
  r.p[3] = gamma ? gamma->data : NULL;
  r.p[4] = beta ? beta->data : NULL;
  if (!dt__dev_run(g, op, DTRAIN_K_BN, &r)) return NULL;
  dt__record(g, y, op, dt__device_bn_backward, x, gamma, beta);
  return dt__finish(g, y);
}

#undef DT__DEV_ALIGN
