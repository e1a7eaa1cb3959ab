/* ===========================================================================
 * dt_device.c -- the device hook, graph side: device arena, checked
 * transfers and kernel runs, the list of ops with device paths
 * ===========================================================================
 * On a device graph tensor headers come from the host arena (dt__arena_alloc)
 * and tensor data from the device arena below (dt__arena_floats switches on
 * g->device). This file is the tensor layer's use of a dt_device: it calls
 * only the device's function table (dt_device.h) and the graph internals,
 * never an op, so dt_tensor.c can call it without calling up a layer.
 * The device twins of the ops (dt__dev_binary, dt__dev_conv2d, ...) are in
 * dt_device_ops.c and dt_device_nn.c (ops layer); the device copy of the
 * params (dt_graph_params_upload, ...) is in dt_graph_params.c (params
 * layer). Each op with a device path calls its dt__dev_* twin right after
 * dt__begin; every other op is refused by dt__begin (dt__dev_op_ok) with
 * DTRAIN_ERR_UNSUPPORTED, so no CPU loop ever reads device memory.
 * Nothing here runs on a CPU graph: the CPU ops only test `g->device`.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_maps.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"

struct dt__dchunk {
  dt__dchunk *next;
  void *base; /* device memory */
  size_t cap, used;
};

/* Device allocations are 256-byte aligned (what cudaMalloc gives, and what
 * coalesced loads like). */
#define DT__DEV_ALIGN 256

/* Ops with a device path (dt__begin refuses every other op on a device):
 * every elementwise map of DT__MAP_LIST (dt_maps.h), and these. */
#define DT__DEVICE_MAP_OP(name, NAME, args, domain) "dt_" #name,
static const char *const dt__device_ops[] = {
  DT__MAP_LIST(DT__DEVICE_MAP_OP)
  "dt_tensor_new", "dt_tensor_from", "dt_tensor_wrap", "dt_detach", "dt_param", "dt_backward", "dt_backward_grad",
  "dt_add", "dt_sub", "dt_mul", "dt_div", "dt_sum", "dt_mean", "dt_sum_axis", "dt_mean_axis", "dt_transpose",
  "dt_dropout", "dt_layer_norm", "dt_embedding", "dt_matmul", "dt_linear",
  "dt_softmax", "dt_log_softmax", "dt_cross_entropy", "dt_mse", "dt_reshape", "dt_reshape2", "dt_flatten",
  "dt_conv2d", "dt_max_pool2d", "dt_avg_pool2d", "dt_nn_linear_forward", "dt_nn_conv2d_forward", "dt_nn_embedding_forward",
  "dt_nn_layer_norm_forward", "dt_permute", "dt_concat", "dt_slice", "dt_split", "dt_bmm", "dt_causal_mask",
  "dt_batch_norm", "dt_nn_batch_norm_forward", "dt_nn_attention_forward", "dt_nn_lstm_cell_forward",
  "dt_nn_gru_cell_forward", NULL
};
#undef DT__DEVICE_MAP_OP

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

DTRAIN_PRIVATE void dt__dev_args0(dt_kernel_args *a) { memset(a, 0, sizeof *a); }

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

DTRAIN_PRIVATE dt_result dt__dev_graph_check(dt_graph *g) {
  dt_device *d = g->device;
  if (!d->alloc || !d->free || !d->zero || !d->copy || !d->sync || !d->run)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_graph_create: device %s has a NULL function", d->name ? d->name : "?");
  return DTRAIN_OK;
}

DTRAIN_API dt_device *dt_graph_device(const dt_graph *g) { return g ? g->device : NULL; }

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
  dt__dev_args0(&a);
  a.p[0] = gx;
  a.p[1] = (float *)(uintptr_t)gy;
  a.n[0] = n;
  a.f[0] = 1.0f;
  dt__dev_run(g, op, DTRAIN_K_ACC, &a);
}

#undef DT__DEV_ALIGN
