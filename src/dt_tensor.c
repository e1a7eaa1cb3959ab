/* ===========================================================================
 * dt_tensor.c -- the graph: arena (host and device), tape, sticky errors,
 * tensors, backward
 * ===========================================================================
 * The tensor layer: it calls the base and a dt_device's function table
 * (dt_device.h), nothing above. What needs the params (dt_graph_create,
 * dt_param, the device copy of the params) is in dt_graph_params.c.
 *
 * On a device graph tensor headers come from the host arena (dt__arena_alloc)
 * and tensor data from the device arena (the last section here:
 * dt__arena_floats switches on g->device), with checked transfers and
 * kernel runs that fail the graph with the op's name. The device twins of
 * the ops (dt__dev_binary, dt__dev_conv2d, ...) are in dt_device_ops.c and
 * dt_device_nn.c (ops layer). Each op with a device path calls its dt__dev_*
 * twin right after dt__begin; every other op is refused by dt__begin
 * (dt__dev_op_ok) with DTRAIN_ERR_UNSUPPORTED, so no CPU loop ever reads
 * device memory. Nothing of that section runs on a CPU graph.
 * (The device side was a file of its own, dt_device.c, which called back
 * into the graph for its errors: one concept, the graph's memory, in two
 * files that called each other.)
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_maps.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"

/* ---- arena ---------------------------------------------------------------------- */

struct dt__chunk {
  dt__chunk *next;
  size_t cap;   /* usable bytes after the header */
  size_t used;
};
#define DT__CHUNK_HDR ((sizeof(dt__chunk) + DT__ALIGN - 1) & ~(size_t)(DT__ALIGN - 1))

static dt__chunk *dt__tensor_chunk_new(size_t cap) {
  dt__chunk *c = (dt__chunk *)dt__alloc(DT__CHUNK_HDR + cap);
  if (!c) return NULL;
  c->next = NULL;
  c->cap = cap;
  c->used = 0;
  return c;
}

static void dt__tensor_chunks_free(dt__chunk *c) {
  while (c) {
    dt__chunk *n = c->next;
    dt__free(c, DT__CHUNK_HDR + c->cap);
    c = n;
  }
}

DTRAIN_PRIVATE void *dt__arena_alloc(dt_graph *g, size_t bytes) {
  size_t need = (bytes + DT__ALIGN - 1) & ~(size_t)(DT__ALIGN - 1);
  if (need < bytes) return dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: request of %zu bytes overflows", bytes);
  dt__chunk *c = g->chunks;
  if (!c || c->cap - c->used < need) {
    /* On a device graph arena_bytes sizes the device arena (dt__dev_arena),
     * where tensor data lives; this one holds only tensor headers. */
    size_t cap = c ? c->cap * 2 : (g->device ? ((size_t)1 << 20) : g->first_block);
    if (cap < need) cap = need;
    dt__chunk *n = dt__tensor_chunk_new(cap);
    if (!n) return dt__fail(g, DTRAIN_ERR_NOMEM, "arena: cannot allocate a block of %zu bytes", cap);
    n->next = c;
    g->chunks = n;
    g->reserved += cap;
    c = n;
  }
  void *p = (unsigned char *)c + DT__CHUNK_HDR + c->used;
  c->used += need;
  g->used += need;
  if (g->used > g->peak) g->peak = g->used;
  return p;
}

DTRAIN_PRIVATE dt__arena_pos dt__arena_mark(dt_graph *g) {
  dt__arena_pos m;
  m.chunk = g->chunks;
  m.used = g->chunks ? g->chunks->used : 0;
  m.graph_used = g->used;
  return m;
}

DTRAIN_PRIVATE void dt__arena_release(dt_graph *g, dt__arena_pos m) {
  if (g->device) return; /* tensor data lives in the device arena there */
  /* Blocks added since the mark hold only scratch: emptied, and the newest
   * stays the one allocations go to (the older ones' tails are idle until the
   * next merge, as when a block fills up). */
  for (dt__chunk *c = g->chunks; c && c != (dt__chunk *)m.chunk; c = c->next) c->used = 0;
  if (m.chunk) ((dt__chunk *)m.chunk)->used = m.used;
  g->used = m.graph_used;
}

DTRAIN_PRIVATE float *dt__arena_floats(dt_graph *g, int64_t n) {
  size_t bytes;
  if (n < 0 || !dt__mul_size((size_t)n, sizeof(float), &bytes))
    return (float *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: %lld floats overflow", (long long)n);
  if (g->device) return (float *)dt__dev_arena(g, bytes); /* tensor data lives on the device */
  return (float *)dt__arena_alloc(g, bytes);
}

DTRAIN_PRIVATE float *dt__arena_zeros(dt_graph *g, int64_t n) {
  float *p = dt__arena_floats(g, n);
  if (p && g->device) return dt__dev_zero(g, "arena", p, (size_t)n * sizeof(float)) ? p : NULL;
  if (p) memset(p, 0, (size_t)n * sizeof(float));
  return p;
}

/* ---- graph ------------------------------------------------------------------------ */

/* The graph without its params: dt_graph_create (dt_graph_params.c, the
 * params layer) sets g->params and makes the params' device copy, so that
 * nothing here calls into the params. */
DTRAIN_PRIVATE dt_graph *dt__graph_new(const dt_graph_desc *desc) {
  dt_graph *g = (dt_graph *)dt__calloc(sizeof *g);
  if (!g) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_graph_create: out of memory");
    return NULL;
  }
  g->bound_own = 1;
  g->first_block = (desc && desc->arena_bytes) ? desc->arena_bytes : ((size_t)1 << 20);
  g->training = 1;
  g->grad_enabled = 1;
  g->check_numerics = desc ? desc->check_numerics : 0;
  dt_rng_seed(&g->rng, (desc && desc->seed) ? desc->seed : 1);
  if (desc && desc->device) {
    g->device = desc->device;
    if (dt__dev_graph_check(g) != DTRAIN_OK) {
      dt_graph_destroy(g);
      return NULL;
    }
  }
  return g;
}

DTRAIN_API void dt_graph_destroy(dt_graph *g) {
  if (!g) return;
  if (g->device) dt__dev_free_chunks(g);
  dt__tensor_chunks_free(g->chunks);
  dt__free(g->tape, (size_t)g->tape_cap * sizeof(dt_tensor *));
  dt__free(g->pviews, g->pviews_bytes);
  dt__free(g->gstale, (size_t)g->gstale_cap);
  dt__free(g, sizeof *g);
}

DTRAIN_API void dt_graph_reset(dt_graph *g) {
  if (!g) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_reset: graph is NULL");
    return;
  }
  if (g->chunks && g->chunks->next) {
    /* Several blocks: replace them by one that holds the whole step, so that
     * the next step of the same size allocates nothing. The step's peak is
     * what it used (the blocks' sizes, doubling, add up to nearly twice
     * that); on a device graph the peak counts device bytes too, and the host
     * blocks hold only headers, so there the blocks' sum. The old blocks go
     * first, so the two are never held at once; if the new block cannot be
     * had, the old sum is tried back, and failing that the graph starts the
     * next step from an empty arena (it grows again as it does at first). */
    size_t total = 0;
    for (dt__chunk *c = g->chunks; c; c = c->next) total += c->cap;
    size_t want = (!g->device && g->peak > 0 && g->peak < total) ? g->peak : total;
    dt__tensor_chunks_free(g->chunks);
    g->chunks = NULL;
    g->reserved = 0;
    dt__heap_trim();
    dt__chunk *one = dt__tensor_chunk_new(want);
    if (!one && want != total) one = dt__tensor_chunk_new(want = total);
    if (one) {
      g->chunks = one;
      g->reserved = want;
    }
  }
  for (dt__chunk *c = g->chunks; c; c = c->next) c->used = 0;
  if (g->device) dt__dev_reset(g);
  g->used = 0;
  g->ntape = 0;
  g->err = DTRAIN_OK;
  g->msg[0] = '\0';
  g->backward_done = 0;
}

DTRAIN_API dt_result dt_graph_bind(dt_graph *g, float *data, float *grad) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_bind: graph is NULL");
  if (!g->params && data) return dt__error(DTRAIN_ERR_STATE, "dt_graph_bind: graph has no params");
  if (!data && grad) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_graph_bind: grad without data");
  g->bound_own = data == NULL;
  g->bound_data = data;
  g->bound_grad = grad;
  return DTRAIN_OK;
}

DTRAIN_API void dt_graph_set_training(dt_graph *g, int training) {
  if (!g) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_set_training: graph is NULL");
  else g->training = training != 0;
}
DTRAIN_API int dt_graph_training(const dt_graph *g) { return g ? g->training : 0; }

DTRAIN_API int dt_graph_set_grad_enabled(dt_graph *g, int enabled) {
  if (!g) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_set_grad_enabled: graph is NULL");
    return 0;
  }
  int old = g->grad_enabled;
  g->grad_enabled = enabled != 0;
  return old;
}

DTRAIN_API dt_result dt_graph_error(const dt_graph *g) {
  return g ? g->err : dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_error: graph is NULL");
}
DTRAIN_API const char *dt_graph_message(const dt_graph *g) { return g ? g->msg : "graph is NULL"; }

DTRAIN_API void dt_graph_fail(dt_graph *g, dt_result code, const char *msg) {
  if (!g) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_fail: graph is NULL (%s)", msg ? msg : "user error");
  else dt__fail(g, code == DTRAIN_OK ? DTRAIN_ERR_INVALID_ARG : code, "%s", msg ? msg : "user error");
}

DTRAIN_API size_t dt_graph_bytes_used(const dt_graph *g) { return g ? g->used : 0; }
DTRAIN_API size_t dt_graph_bytes_peak(const dt_graph *g) { return g ? g->peak : 0; }
DTRAIN_API size_t dt_graph_bytes_reserved(const dt_graph *g) { return g ? g->reserved : 0; }

DTRAIN_API void dt_graph_rng_state(const dt_graph *g, uint64_t out[4]) {
  if (!g || !out) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_rng_state: %s is NULL", g ? "out" : "graph");
  else memcpy(out, g->rng.s, sizeof g->rng.s);
}
DTRAIN_API void dt_graph_set_rng_state(dt_graph *g, const uint64_t s[4]) {
  if (!g || !s) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_set_rng_state: %s is NULL", g ? "state" : "graph");
  else memcpy(g->rng.s, s, sizeof g->rng.s);
}

/* ---- errors and op plumbing --------------------------------------------------------- */

DTRAIN_PRIVATE void *dt__fail(dt_graph *g, dt_result code, const char *fmt, ...) {
  char buf[DT__MSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (g && g->err == DTRAIN_OK) {
    g->err = code;
    memcpy(g->msg, buf, sizeof buf);
    dt__error(code, "%s", buf);
  } else if (!g) {
    dt__error(code, "%s", buf);
  }
  return NULL;
}

static int dt__begin_v(dt_graph *g, const char *op, int n, va_list ap) {
  if (!g) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: graph is NULL", op);
    return 0;
  }
  if (g->err != DTRAIN_OK) return 0;
  if (g->device && !dt__dev_op_ok(op)) {
    dt__fail(g, DTRAIN_ERR_UNSUPPORTED, "%s: not supported on device %s (no device kernel; see dt_device.h)", op,
             g->device->name);
    return 0;
  }
  int ok = 1;
  for (int i = 0; i < n && ok; i++) ok = dt__take_input(g, op, va_arg(ap, dt_tensor *), i + 1);
  return ok;
}

DTRAIN_PRIVATE int dt__take_input(dt_graph *g, const char *op, dt_tensor *t, int argno) {
  if (!t) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: tensor argument %d is NULL", op, argno);
    return 0;
  }
  if (t->graph != g) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: tensor argument %d belongs to another graph", op, argno);
    return 0;
  }
  if (t->flags & DT__TENSOR_OVERWRITTEN) {
    dt__fail(g, DTRAIN_ERR_STATE,
             "%s: tensor argument %d (a %s result) was overwritten by dt_relu_inplace: use the tensor that returned", op,
             argno, t->op ? t->op : "tensor");
    return 0;
  }
  t->flags |= DT__TENSOR_USED;
  return 1;
}

/* The checks; then the op is the thread's running one for the profile. */
DTRAIN_PRIVATE int dt__begin(dt_graph *g, const char *op, int n, ...) {
  va_list ap;
  va_start(ap, n);
  int ok = dt__begin_v(g, op, n, ap);
  va_end(ap);
  if (ok) dt__prof_fwd_begin(op);
  return ok;
}

/* The checks only (dt_backward: not an op of the forward pass). */
static int dt__begin_quiet(dt_graph *g, const char *op, int n, ...) {
  va_list ap;
  va_start(ap, n);
  int ok = dt__begin_v(g, op, n, ap);
  va_end(ap);
  return ok;
}

DTRAIN_PRIVATE int dt__axis(int axis, int ndim) {
  if (axis < 0) axis += ndim;
  return (axis >= 0 && axis < ndim) ? axis : -1;
}

DTRAIN_PRIVATE void dt__strides(const dt_tensor *t, int64_t *st) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    st[i] = s;
    s *= t->shape[i];
  }
}

DTRAIN_PRIVATE const char *dt__shape_text(int ndim, const int64_t *shape, char *buf, size_t cap) {
  size_t k = 0;
  if (!buf || cap == 0) return "";
  buf[0] = '\0';
  k += (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < ndim && k < cap; i++)
    k += (size_t)snprintf(buf + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

DTRAIN_API const char *dt_shape_str(const dt_tensor *t, char *buf, size_t cap) {
  if (!buf || cap == 0) return "";
  if (!t) {
    snprintf(buf, cap, "(null)");
    return buf;
  }
  return dt__shape_text(t->ndim, t->shape, buf, cap);
}

DTRAIN_API int dt_same_shape(const dt_tensor *a, const dt_tensor *b) {
  if (!a || !b || a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

DTRAIN_PRIVATE void dt__header_init(dt_tensor *t, dt_graph *g, int ndim, const int64_t *shape, int64_t size) {
  memset(t, 0, sizeof *t);
  t->graph = g;
  t->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) t->shape[i] = i < ndim ? shape[i] : 1;
  t->size = size;
  t->param_index = -1;
}

/* Validates a shape and returns its element count, or -1 with an error. */
static int64_t dt__tensor_count(dt_graph *g, const char *op, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS) {
    dt__fail(g, DTRAIN_ERR_RANK, "%s: %d dimensions (allowed 0..%d)", op, ndim, DTRAIN_MAX_DIMS);
    return -1;
  }
  if (ndim > 0 && !shape) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", op);
    return -1;
  }
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] <= 0) {
      dt__fail(g, shape[i] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
               "%s: dimension %d is %lld (must be >= 1)", op, i, (long long)shape[i]);
      return -1;
    }
    if (n > INT64_MAX / shape[i] || dt__too_many((uint64_t)(n * shape[i]))) {
      dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: shape too large", op);
      return -1;
    }
    n *= shape[i];
  }
  return n;
}

DTRAIN_PRIVATE dt_tensor *dt__new_view(dt_graph *g, const char *op, int ndim, const int64_t *shape, float *data) {
  int64_t n = dt__tensor_count(g, op, ndim, shape);
  if (n < 0) return NULL;
  dt_tensor *t = (dt_tensor *)dt__arena_alloc(g, sizeof(dt_tensor));
  if (!t) return NULL;
  dt__header_init(t, g, ndim, shape, n);
  t->data = data;
  t->flags = DTRAIN_TENSOR_VIEW;
  t->op = op;
  return t;
}

DTRAIN_PRIVATE dt_tensor *dt__new(dt_graph *g, const char *op, int ndim, const int64_t *shape) {
  int64_t n = dt__tensor_count(g, op, ndim, shape);
  if (n < 0) return NULL;
  dt_tensor *t = (dt_tensor *)dt__arena_alloc(g, sizeof(dt_tensor));
  if (!t) return NULL;
  float *d = dt__arena_floats(g, n);
  if (!d) return NULL;
  dt__header_init(t, g, ndim, shape, n);
  t->data = d;
  t->op = op;
  return t;
}

DTRAIN_PRIVATE dt_tensor *dt__new_like(dt_graph *g, const char *op, const dt_tensor *x) {
  return dt__new(g, op, x->ndim, x->shape);
}

DTRAIN_PRIVATE void dt__record(dt_graph *g, dt_tensor *out, const char *op, dt_backward_fn fn,
                               dt_tensor *a, dt_tensor *b, dt_tensor *c) {
  out->op = op;
  out->src[0] = a;
  out->src[1] = b;
  out->src[2] = c;
  for (int i = 0; i < 3; i++)
    if (out->src[i]) out->src[i]->flags |= DT__TENSOR_USED; /* also inputs dt__begin was not shown */
  if (!g->grad_enabled || !fn) return;
  int need = 0;
  for (int i = 0; i < 3; i++)
    if (out->src[i] && (out->src[i]->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) need = 1;
  if (!need) return;
  if (g->ntape == g->tape_cap) {
    int64_t cap = g->tape_cap ? g->tape_cap * 2 : 256;
    dt_tensor **nt = (dt_tensor **)dt__realloc(g->tape, (size_t)g->tape_cap * sizeof(dt_tensor *),
                                               (size_t)cap * sizeof(dt_tensor *));
    if (!nt) {
      dt__fail(g, DTRAIN_ERR_NOMEM, "%s: cannot grow the tape to %lld entries", op, (long long)cap);
      return;
    }
    g->tape = nt;
    g->tape_cap = cap;
  }
  out->flags |= DTRAIN_TENSOR_REQUIRES_GRAD;
  out->backward = fn;
  g->tape[g->ntape++] = out;
}

DTRAIN_PRIVATE dt_tensor *dt__finish(dt_graph *g, dt_tensor *out) {
  dt__prof_fwd_end();
  if (g->err != DTRAIN_OK) return NULL;
  if (g->check_numerics && g->device) return dt__dev_check_numerics(g, out);
  if (g->check_numerics) {
    for (int64_t i = 0; i < out->size; i++) {
      if (!isfinite(out->data[i])) {
        char sb[96];
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", out->op,
                                     dt_shape_str(out, sb, sizeof sb), isnan(out->data[i]) ? "NaN" : "Inf",
                                     (long long)i);
      }
    }
  }
  return out;
}

/* Parameter view t's gradient deferred (dt__graph_grad_defer) and not yet
 * used this step: 1, and it is no longer marked. */
static int dt__grad_take_stale(dt_graph *g, const dt_tensor *t) {
  int p = t->param_index;
  if (!(t->flags & DTRAIN_TENSOR_PARAM) || p < 0 || p >= g->ngstale || !g->gstale[p]) return 0;
  g->gstale[p] = 0;
  return 1;
}

DTRAIN_PRIVATE float *dt__grad(dt_graph *g, dt_tensor *t) {
  if (!t || !(t->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) return NULL;
  if (!t->grad) t->grad = dt__arena_zeros(g, t->size);
  else if (g->ngstale > 0 && dt__grad_take_stale(g, t)) memset(t->grad, 0, (size_t)t->size * sizeof(float));
  return t->grad;
}

DTRAIN_PRIVATE float *dt__grad_first(dt_graph *g, dt_tensor *t, int *overwrite) {
  *overwrite = 0;
  if (!t || !(t->flags & DTRAIN_TENSOR_REQUIRES_GRAD) || g->device) return dt__grad(g, t);
  if (!t->grad) {
    t->grad = dt__arena_floats(g, t->size);
    *overwrite = t->grad != NULL;
    return t->grad;
  }
  *overwrite = g->ngstale > 0 && dt__grad_take_stale(g, t);
  return t->grad;
}

/* ---- public tensor constructors ---------------------------------------------------- */

DTRAIN_API dt_tensor *dt_tensor_new(dt_graph *g, int ndim, const int64_t *shape) {
  if (!dt__begin(g, "dt_tensor_new", 0)) return NULL;
  dt_tensor *t = dt__new(g, "dt_tensor_new", ndim, shape);
  if (t && g->device)
    return dt__dev_zero(g, "dt_tensor_new", t->data, (size_t)t->size * sizeof(float)) ? t : NULL;
  if (t) memset(t->data, 0, (size_t)t->size * sizeof(float));
  return t;
}

DTRAIN_API dt_tensor *dt_tensor_from(dt_graph *g, int ndim, const int64_t *shape, const float *data) {
  if (!dt__begin(g, "dt_tensor_from", 0)) return NULL;
  if (!data) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_tensor_from: data is NULL");
  dt_tensor *t = dt__new(g, "dt_tensor_from", ndim, shape);
  if (t && g->device)
    return dt__dev_copy(g, "dt_tensor_from", t->data, data, (size_t)t->size * sizeof(float), DTRAIN_COPY_H2D) ? t
                                                                                                              : NULL;
  if (t) memcpy(t->data, data, (size_t)t->size * sizeof(float));
  return t;
}

DTRAIN_API dt_tensor *dt_tensor_wrap(dt_graph *g, int ndim, const int64_t *shape, float *data) {
  if (!dt__begin(g, "dt_tensor_wrap", 0)) return NULL;
  if (!data) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_tensor_wrap: data is NULL");
  return dt__new_view(g, "dt_tensor_wrap", ndim, shape, data);
}

DTRAIN_API dt_tensor *dt_tensor_new1(dt_graph *g, int64_t d0) { return dt_tensor_new(g, 1, &d0); }
DTRAIN_API dt_tensor *dt_tensor_new2(dt_graph *g, int64_t d0, int64_t d1) {
  int64_t s[2];
  s[0] = d0; s[1] = d1;
  return dt_tensor_new(g, 2, s);
}
DTRAIN_API dt_tensor *dt_tensor_new3(dt_graph *g, int64_t d0, int64_t d1, int64_t d2) {
  int64_t s[3];
  s[0] = d0; s[1] = d1; s[2] = d2;
  return dt_tensor_new(g, 3, s);
}
DTRAIN_API dt_tensor *dt_tensor_new4(dt_graph *g, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  int64_t s[4];
  s[0] = d0; s[1] = d1; s[2] = d2; s[3] = d3;
  return dt_tensor_new(g, 4, s);
}

DTRAIN_API dt_tensor *dt_scalar(dt_graph *g, float value) {
  if (g && g->device) return dt_tensor_from(g, 0, NULL, &value);
  dt_tensor *t = dt_tensor_new(g, 0, NULL);
  if (t) t->data[0] = value;
  return t;
}

DTRAIN_API void dt_tensor_set_requires_grad(dt_tensor *t, int on) {
  if (!t) dt__error(DTRAIN_ERR_NULL_ARG, "dt_tensor_set_requires_grad: tensor is NULL");
  if (!t || (t->flags & DTRAIN_TENSOR_PARAM)) return;
  if (on) t->flags |= DTRAIN_TENSOR_REQUIRES_GRAD;
  else t->flags &= ~DTRAIN_TENSOR_REQUIRES_GRAD;
}

DTRAIN_API dt_tensor *dt_detach(dt_graph *g, dt_tensor *t) {
  if (!dt__begin(g, "dt_detach", 1, t)) return NULL;
  dt_tensor *d = dt__new_like(g, "dt_detach", t);
  if (d && g->device)
    return dt__dev_copy(g, "dt_detach", d->data, t->data, (size_t)t->size * sizeof(float), DTRAIN_COPY_D2D) ? d : NULL;
  if (d) memcpy(d->data, t->data, (size_t)t->size * sizeof(float));
  return d;
}

DTRAIN_API float dt_item(const dt_tensor *t) {
  if (!t) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_item: tensor is NULL");
    return NAN;
  }
  if (t->size != 1) return NAN;
  if (t->graph && t->graph->device) {
    float v;
    dt_device *d = t->graph->device;
    return d->copy(d, &v, t->data, sizeof v, DTRAIN_COPY_D2H) == DTRAIN_OK ? v : NAN;
  }
  return t->data[0];
}

/* ---- backward --------------------------------------------------------------------------- */

/* The parameters that take a gradient, by the tape node after whose backward
 * theirs is final (the first node, in forward order, with the parameter
 * among its inputs): head[i] starts node i's list, chain[p] goes on. */
static int dt__ready_ninputs(const dt_tensor *t) {
  return (t->flags & DT__TENSOR_AUX_INPUTS) ? (int)t->iaux[0] : 4;
}

/* Node t's input j as a parameter index (-1: not a parameter that takes a
 * gradient). Concat keeps its inputs in aux (DT__TENSOR_AUX_INPUTS). */
static int dt__ready_param(const dt_tensor *t, int j) {
  const dt_tensor *x = (t->flags & DT__TENSOR_AUX_INPUTS) ? ((dt_tensor *const *)t->aux)[j] : t->src[j];
  if (!x || !(x->flags & DTRAIN_TENSOR_PARAM) || !x->grad || x->param_index < 0) return -1;
  return x->param_index;
}

static int dt__ready_schedule(dt_graph *g, int32_t **head_out, int32_t **chain_out) {
  int32_t np = 0;
  for (int64_t i = 0; i < g->ntape; i++) /* the highest parameter index in use */
    for (int j = 0, n = dt__ready_ninputs(g->tape[i]); j < n; j++) {
      int p = dt__ready_param(g->tape[i], j);
      if (p >= np) np = p + 1;
    }
  int32_t *head = (int32_t *)dt__arena_alloc(g, (size_t)(g->ntape + 1) * sizeof(int32_t));
  int32_t *chain = (int32_t *)dt__arena_alloc(g, (size_t)(np + 1) * sizeof(int32_t));
  int8_t *seen = (int8_t *)dt__arena_alloc(g, (size_t)np + 1);
  if (!head || !chain || !seen) return 0; /* the arena failed the graph */
  memset(seen, 0, (size_t)np + 1);
  for (int64_t i = 0; i < g->ntape; i++) {
    head[i] = -1;
    for (int j = 0, n = dt__ready_ninputs(g->tape[i]); j < n; j++) {
      int p = dt__ready_param(g->tape[i], j);
      if (p < 0 || seen[p]) continue;
      seen[p] = 1;
      chain[p] = head[i];
      head[i] = p;
    }
  }
  *head_out = head;
  *chain_out = chain;
  return 1;
}

static dt_result dt__tensor_backward_run(dt_graph *g, dt_tensor *out, const float *seed, const char *fn);

/* Backward runs with subnormals flushed (dt_set_flush_denormals). */
static dt_result dt__tensor_backward(dt_graph *g, dt_tensor *out, const float *seed, const char *fn) {
  unsigned long fp = dt__fp_enter();
  dt_result r = dt__tensor_backward_run(g, out, seed, fn);
  dt__fp_leave(fp);
  return r;
}

static dt_result dt__tensor_backward_run(dt_graph *g, dt_tensor *out, const float *seed, const char *fn) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: graph is NULL", fn);
  if (g->err != DTRAIN_OK) return g->err;
  dt__prof_fwd_end(); /* the loss op, if it did not finish */
  if (!dt__begin_quiet(g, fn, 1, out)) return g->err;
  if (!seed) {
    if (out->size != 1) {
      char sb[96];
      dt__fail(g, DTRAIN_ERR_SHAPE, "%s: loss must have one element, got %s", fn, dt_shape_str(out, sb, sizeof sb));
      return g->err;
    }
    float v;
    if (!g->device) v = out->data[0];
    else if (!dt__dev_copy(g, fn, &v, out->data, sizeof v, DTRAIN_COPY_D2H)) return g->err; /* the device's error */
    if (!isfinite(v)) {
      dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: loss is %s", fn, isnan(v) ? "NaN" : "Inf");
      return g->err;
    }
  }
  if (g->backward_done) {
    dt__fail(g, DTRAIN_ERR_STATE, "%s: already called for this step (call dt_graph_reset first)", fn);
    return g->err;
  }
  if (!(out->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) {
    dt__fail(g, DTRAIN_ERR_STATE,
             "%s: the output does not depend on anything that needs a gradient (no-grad mode, or no parameters used)", fn);
    return g->err;
  }
  g->backward_done = 1;
  float *go = dt__grad(g, out);
  if (!go) return g->err;
  if (g->device) {
    /* The seed goes up to the device and is added there. */
    float one = 1.0f;
    float *tmp = dt__arena_floats(g, out->size);
    if (!tmp || !dt__dev_copy(g, fn, tmp, seed ? seed : &one, (size_t)out->size * sizeof(float), DTRAIN_COPY_H2D))
      return g->err;
    dt__dev_acc(g, go, tmp, out->size, fn);
    if (g->err != DTRAIN_OK) return g->err;
  } else if (seed) {
    for (int64_t i = 0; i < out->size; i++) go[i] += seed[i];
  } else {
    go[0] += 1.0f;
  }
  int32_t *head = NULL, *chain = NULL;
  if (g->ready && !dt__ready_schedule(g, &head, &chain)) return g->err;
  for (int64_t i = g->ntape - 1; i >= 0; i--) {
    dt_tensor *t = g->tape[i];
    if (t->grad && t->backward) {
      int64_t t0 = dt__prof_t0();
      t->backward(g, t);
      dt__prof_add(t->op, DTRAIN_PROFILE_BACKWARD, t0);
    }
    if (g->err != DTRAIN_OK) return g->err;
    for (int32_t p = head ? head[i] : -1; p >= 0; p = chain[p]) {
      /* a deferred gradient that this node's backward did not reach (no
       * gradient flowed to the node): zeros, before anyone reads it */
      if (p < g->ngstale && g->gstale[p]) (void)dt__grad(g, &g->pviews[p]);
      g->ready(g->ready_user, p);
    }
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__graph_on_grad_ready(dt_graph *g, void (*fn)(void *user, int param_index), void *user) {
  if (!g) return;
  g->ready = fn;
  g->ready_user = fn ? user : NULL;
}

DTRAIN_API dt_result dt_backward(dt_graph *g, dt_tensor *loss) {
  return dt__tensor_backward(g, loss, NULL, "dt_backward");
}

DTRAIN_API dt_result dt_backward_grad(dt_graph *g, dt_tensor *out, const float *grad) {
  if (g && g->err == DTRAIN_OK && !grad) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_backward_grad: grad is NULL");
    return g->err;
  }
  return dt__tensor_backward(g, out, grad, "dt_backward_grad");
}

/* ---- the graph on a device ----------------------------------------------------------------- */

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
  "dt_relu_inplace", "dt_tensor_new", "dt_tensor_from", "dt_tensor_wrap", "dt_detach", "dt_param", "dt_backward", "dt_backward_grad",
  "dt_add", "dt_sub", "dt_mul", "dt_div", "dt_sum", "dt_mean", "dt_sum_axis", "dt_mean_axis", "dt_transpose",
  "dt_dropout", "dt_layer_norm", "dt_embedding", "dt_matmul", "dt_linear", "dt_linear_relu",
  "dt_softmax", "dt_log_softmax", "dt_cross_entropy", "dt_mse", "dt_reshape", "dt_reshape2", "dt_flatten",
  "dt_conv2d", "dt_conv2d_relu", "dt_max_pool2d", "dt_avg_pool2d", "dt_nn_linear_forward", "dt_nn_linear_relu_forward", "dt_nn_conv2d_forward",
  "dt_nn_conv2d_relu_forward", "dt_nn_embedding_forward",
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

DTRAIN_API dt_device *dt_graph_device(const dt_graph *g) {
  if (!g) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_device: graph is NULL");
  return g ? g->device : NULL;
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
  dt__dev_args0(&a);
  a.p[0] = gx;
  a.p[1] = (float *)(uintptr_t)gy;
  a.n[0] = n;
  a.f[0] = 1.0f;
  dt__dev_run(g, op, DTRAIN_K_ACC, &a);
}

#undef DT__DEV_ALIGN
