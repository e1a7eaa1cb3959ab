/* ===========================================================================
 * dt_params.c -- flat parameter and gradient buffers, initializers
 * ===========================================================================
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_nn.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"

#define DT__NAME_MAX 127
#define DT__PARAM_ALIGN_FLOATS 16 /* 64 bytes */

typedef struct dt__param {
  char name[DT__NAME_MAX + 1];
  size_t offset, size;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int trainable, decay;
} dt__param;

struct dt_params {
  dt__param *items;
  int count, cap;
  float *data, *grad;
  size_t size;       /* floats used (end of the last parameter) */
  size_t capacity;   /* floats allocated */
  dt_rng rng;
};

/* ---- initializers ------------------------------------------------------------------- */

DTRAIN_API dt_init dt_init_zeros(void) { dt_init i; i.kind = DTRAIN_INIT_ZEROS; i.a = 0; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_constant(float v) { dt_init i; i.kind = DTRAIN_INIT_CONSTANT; i.a = v; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_uniform(float lo, float hi) { dt_init i; i.kind = DTRAIN_INIT_UNIFORM; i.a = lo; i.b = hi; return i; }
DTRAIN_API dt_init dt_init_normal(float mean, float std) { dt_init i; i.kind = DTRAIN_INIT_NORMAL; i.a = mean; i.b = std; return i; }
DTRAIN_API dt_init dt_init_glorot_uniform(void) { dt_init i; i.kind = DTRAIN_INIT_GLOROT_UNIFORM; i.a = 1; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_glorot_normal(void) { dt_init i; i.kind = DTRAIN_INIT_GLOROT_NORMAL; i.a = 1; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_he_uniform(void) { dt_init i; i.kind = DTRAIN_INIT_HE_UNIFORM; i.a = 0; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_he_normal(void) { dt_init i; i.kind = DTRAIN_INIT_HE_NORMAL; i.a = 0; i.b = 0; return i; }

static void dt__params_fans(int ndim, const int64_t *shape, double *fan_in, double *fan_out) {
  if (ndim <= 1) {
    *fan_in = *fan_out = ndim == 1 ? (double)shape[0] : 1.0;
    return;
  }
  double rf = 1.0;
  for (int i = 2; i < ndim; i++) rf *= (double)shape[i];
  *fan_in = (double)shape[1] * rf;
  *fan_out = (double)shape[0] * rf;
}

DTRAIN_API dt_result dt_init_fill(float *dst, int ndim, const int64_t *shape, dt_init init, dt_rng *rng) {
  if (!dst || (ndim > 0 && !shape) || !rng) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_init_fill: NULL argument");
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS) return dt__error(DTRAIN_ERR_RANK, "dt_init_fill: %d dimensions", ndim);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double fi, fo;
  dt__params_fans(ndim, shape, &fi, &fo);
  double gain = init.a != 0.0f ? (double)init.a : 1.0;
  switch (init.kind) {
    case DTRAIN_INIT_ZEROS: memset(dst, 0, (size_t)n * sizeof(float)); break;
    case DTRAIN_INIT_ONES: for (int64_t i = 0; i < n; i++) dst[i] = 1.0f; break;
    case DTRAIN_INIT_CONSTANT: for (int64_t i = 0; i < n; i++) dst[i] = init.a; break;
    case DTRAIN_INIT_UNIFORM:
      if (!(init.b >= init.a)) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: uniform range [%g,%g) is empty", init.a, init.b);
      for (int64_t i = 0; i < n; i++) dst[i] = init.a + (init.b - init.a) * dt_rng_uniform(rng);
      break;
    case DTRAIN_INIT_NORMAL:
      if (!(init.b >= 0)) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: normal std %g < 0", init.b);
      for (int64_t i = 0; i < n; i++) dst[i] = init.a + init.b * dt_rng_normal(rng);
      break;
    case DTRAIN_INIT_GLOROT_UNIFORM:
    case DTRAIN_INIT_HE_UNIFORM: {
      double l = init.kind == DTRAIN_INIT_GLOROT_UNIFORM ? gain * sqrt(6.0 / (fi + fo)) : sqrt(6.0 / fi);
      for (int64_t i = 0; i < n; i++) dst[i] = (float)(l * (2.0 * (double)dt_rng_uniform(rng) - 1.0));
      break;
    }
    case DTRAIN_INIT_GLOROT_NORMAL:
    case DTRAIN_INIT_HE_NORMAL: {
      double s = init.kind == DTRAIN_INIT_GLOROT_NORMAL ? gain * sqrt(2.0 / (fi + fo)) : sqrt(2.0 / fi);
      for (int64_t i = 0; i < n; i++) dst[i] = (float)(s * (double)dt_rng_normal(rng));
      break;
    }
    default: return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: unknown initializer %d", (int)init.kind);
  }
  return DTRAIN_OK;
}

/* ---- params --------------------------------------------------------------------------- */

DTRAIN_API dt_params *dt_params_create(uint64_t seed) {
  dt_params *p = (dt_params *)dt__calloc(sizeof *p);
  if (!p) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_params_create: out of memory");
    return NULL;
  }
  dt_rng_seed(&p->rng, seed);
  return p;
}

DTRAIN_API void dt_params_destroy(dt_params *p) {
  if (!p) return;
  dt__free(p->items, (size_t)p->cap * sizeof(dt__param));
  dt__free(p->data, p->capacity * sizeof(float));
  dt__free(p->grad, p->capacity * sizeof(float));
  dt__free(p, sizeof *p);
}

static int dt__params_add(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init, int trainable) {
  const char *fn = trainable ? "dt_params_add" : "dt_params_add_buffer";
  if (!p || !name || (ndim > 0 && !shape)) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  size_t nlen = strlen(name);
  if (nlen == 0 || nlen > DT__NAME_MAX)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name must have 1..%d bytes", fn, DT__NAME_MAX);
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_RANK, "%s('%s'): %d dimensions (allowed 0..%d)", fn, name, ndim, DTRAIN_MAX_DIMS);
  if (dt_params_find(p, name) >= 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name '%s' already used", fn, name);
  size_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] <= 0)
      return dt__error(shape[i] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                       "%s('%s'): dimension %d is %lld (must be >= 1)", fn, name, i, (long long)shape[i]);
    if (!dt__mul_size(n, (size_t)shape[i], &n) || dt__too_many(n))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): shape too large", fn, name);
  }
  size_t off = (p->size + DT__PARAM_ALIGN_FLOATS - 1) / DT__PARAM_ALIGN_FLOATS * DT__PARAM_ALIGN_FLOATS;
  if (n > SIZE_MAX - off) return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): parameters would exceed the address space", fn, name);
  size_t end = off + n;
  if (p->count == p->cap) {
    int ncap = p->cap ? p->cap * 2 : 16;
    dt__param *ni = (dt__param *)dt__realloc(p->items, (size_t)p->cap * sizeof(dt__param), (size_t)ncap * sizeof(dt__param));
    if (!ni) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory", fn, name);
    p->items = ni;
    p->cap = ncap;
  }
  if (end > p->capacity) {
    size_t ncap = DT__MAX(end, p->capacity * 2), bytes;
    if (!dt__mul_size(ncap, sizeof(float), &bytes)) ncap = end; /* doubling overflowed: grow exactly */
    if (!dt__mul_size(ncap, sizeof(float), &bytes))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): parameters would exceed the address space", fn, name);
    float *nd = (float *)dt__realloc(p->data, p->capacity * sizeof(float), ncap * sizeof(float));
    if (!nd) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory for %zu floats", fn, name, ncap);
    p->data = nd;
    float *ng = (float *)dt__realloc(p->grad, p->capacity * sizeof(float), ncap * sizeof(float));
    if (!ng) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory for %zu floats", fn, name, ncap);
    p->grad = ng;
    p->capacity = ncap;
  }
  /* The spare capacity is not written until a parameter claims it: untouched
   * pages take no memory (a CNN's 3.3M parameters grew to 6.5M floats of
   * capacity, and zeroing it all cost 26 MB of resident memory). */
  memset(p->data + p->size, 0, (end - p->size) * sizeof(float));
  memset(p->grad + p->size, 0, (end - p->size) * sizeof(float));
  dt_result r = dt_init_fill(p->data + off, ndim, shape, init, &p->rng);
  if (r != DTRAIN_OK) return r;
  dt__param *it = &p->items[p->count];
  memset(it, 0, sizeof *it);
  memcpy(it->name, name, nlen + 1);
  it->offset = off;
  it->size = n;
  it->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) it->shape[i] = i < ndim ? shape[i] : 1;
  it->trainable = trainable;
  it->decay = trainable && ndim >= 2;
  p->size = end;
  return p->count++;
}

DTRAIN_API dt_result dt_params_reserve(dt_params *p, int count, size_t floats) {
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_reserve: params is NULL");
  if (count < 0 || count > INT_MAX / 2 - p->count)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_params_reserve: count %d", count);
  size_t off = (p->size + DT__PARAM_ALIGN_FLOATS - 1) / DT__PARAM_ALIGN_FLOATS * DT__PARAM_ALIGN_FLOATS, pad, want,
         bytes;
  if (!dt__mul_size((size_t)count, DT__PARAM_ALIGN_FLOATS - 1, &pad) || floats > SIZE_MAX - off - pad ||
      !dt__mul_size(off + floats + pad, sizeof(float), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_params_reserve: %zu floats exceed the address space", floats);
  want = off + floats + pad;
  int icap = p->count + count;
  if (icap > p->cap) {
    dt__param *ni = (dt__param *)dt__realloc(p->items, (size_t)p->cap * sizeof(dt__param), (size_t)icap * sizeof(dt__param));
    if (!ni) return dt__error(DTRAIN_ERR_NOMEM, "dt_params_reserve: out of memory for %d parameters", icap);
    p->items = ni;
    p->cap = icap;
  }
  if (want > p->capacity) {
    /* New buffers, then the copy: on failure nothing has changed. */
    float *nd = (float *)dt__alloc(bytes), *ng = nd ? (float *)dt__alloc(bytes) : NULL;
    if (!nd || !ng) {
      dt__free(nd, bytes);
      return dt__error(DTRAIN_ERR_NOMEM, "dt_params_reserve: out of memory for 2 x %zu floats", want);
    }
    if (p->size) { /* what is in use: the rest is zeroed as parameters claim it */
      memcpy(nd, p->data, p->size * sizeof(float));
      memcpy(ng, p->grad, p->size * sizeof(float));
    }
    dt__free(p->data, p->capacity * sizeof(float));
    dt__free(p->grad, p->capacity * sizeof(float));
    p->data = nd;
    p->grad = ng;
    p->capacity = want;
  }
  return DTRAIN_OK;
}

DTRAIN_API int dt_params_add(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init) {
  return dt__params_add(p, name, ndim, shape, init, 1);
}
DTRAIN_API int dt_params_add_buffer(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init) {
  return dt__params_add(p, name, ndim, shape, init, 0);
}

DTRAIN_API int dt_params_count(const dt_params *p) { return p ? p->count : 0; }
DTRAIN_API size_t dt_params_size(const dt_params *p) { return p ? p->size : 0; }
DTRAIN_API size_t dt_params_trainable_size(const dt_params *p) {
  size_t n = 0;
  for (int i = 0; p && i < p->count; i++)
    if (p->items[i].trainable) n += p->items[i].size;
  return n;
}
/* A NULL p: NULL, with the reason in dt_last_error() (as every getter here). */
static void *dt__params_null(const char *fn) {
  dt__error(DTRAIN_ERR_NULL_ARG, "%s: params is NULL", fn);
  return NULL;
}

DTRAIN_API float *dt_params_data(dt_params *p) { return p ? p->data : (float *)dt__params_null("dt_params_data"); }
DTRAIN_API float *dt_params_grad(dt_params *p) { return p ? p->grad : (float *)dt__params_null("dt_params_grad"); }

DTRAIN_API dt_result dt_params_info(const dt_params *p, int index, dt_param_info *out) {
  if (!p || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_info: NULL argument");
  if (index < 0 || index >= p->count)
    return dt__error(DTRAIN_ERR_INDEX, "dt_params_info: index %d out of range (%d params)", index, p->count);
  const dt__param *it = &p->items[index];
  out->name = it->name;
  out->offset = it->offset;
  out->size = it->size;
  out->ndim = it->ndim;
  memcpy(out->shape, it->shape, sizeof it->shape);
  out->trainable = it->trainable;
  out->decay = it->decay;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__params_view(const dt_params *p, int index, size_t *offset, int *ndim,
                                   const int64_t **shape, int *trainable) {
  const dt__param *it = &p->items[index];
  *offset = it->offset;
  *ndim = it->ndim;
  *shape = it->shape;
  *trainable = it->trainable;
  return 1;
}

/* Trainable range i of the flat buffers, for the optimizer: returns 0 past the end. */
DTRAIN_PRIVATE int dt__params_range(const dt_params *p, int index, size_t *begin, size_t *end, int *trainable, int *decay) {
  if (!p || index < 0 || index >= p->count) return 0;
  const dt__param *it = &p->items[index];
  *begin = it->offset;
  *end = it->offset + it->size;
  *trainable = it->trainable;
  *decay = it->decay;
  return 1;
}

DTRAIN_PRIVATE int dt__params_first_after(const dt_params *p, size_t pos) {
  int lo = 0, hi = p ? p->count : 0; /* parameters are laid out in index order */
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (p->items[mid].offset + p->items[mid].size > pos) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

DTRAIN_API int dt_params_find(const dt_params *p, const char *name) {
  if (!p || !name) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_find: %s is NULL", p ? "name" : "params");
  for (int i = 0; i < p->count; i++)
    if (strcmp(p->items[i].name, name) == 0) return i;
  return DTRAIN_ERR_NOT_FOUND;
}

DTRAIN_API dt_result dt_params_set_decay(dt_params *p, int index, int decay) {
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_set_decay: params is NULL");
  if (index < 0 || index >= p->count)
    return dt__error(DTRAIN_ERR_INDEX, "dt_params_set_decay: index %d out of range (%d params)", index, p->count);
  p->items[index].decay = decay != 0 && p->items[index].trainable;
  return DTRAIN_OK;
}

DTRAIN_API void dt_params_zero_grad(dt_params *p) {
  if (!p) dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_zero_grad: params is NULL");
  if (p && p->grad) memset(p->grad, 0, p->size * sizeof(float));
}

DTRAIN_API void dt_params_scale_grad(dt_params *p, float s) {
  if (!p) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_scale_grad: params is NULL");
    return;
  }
  for (size_t i = 0; i < p->size; i++) p->grad[i] *= s;
}

DTRAIN_API dt_result dt_params_copy(dt_params *dst, const dt_params *src) {
  if (!dst || !src) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_copy: NULL argument");
  if (dt_params_layout_hash(dst) != dt_params_layout_hash(src))
    return dt__error(DTRAIN_ERR_MISMATCH, "dt_params_copy: layouts differ (%d vs %d params)", dst->count, src->count);
  if (src->size) memcpy(dst->data, src->data, src->size * sizeof(float));
  return DTRAIN_OK;
}

DTRAIN_API uint64_t dt_params_checksum(const dt_params *p) {
  uint64_t h = DT__FNV64_OFFSET;
  if (!p) return h;
  /* Hash values in little-endian byte order so the checksum is portable. */
  for (size_t i = 0; i < p->size; i++) {
    unsigned char le[4];
    dt__put_f32le(le, &p->data[i], 1);
    h = dt__fnv1a64(h, le, 4);
  }
  return h;
}

DTRAIN_PRIVATE uint64_t dt__layout_hash_add(uint64_t h, const char *name, int ndim, const int64_t *shape, int trainable) {
  h = dt__fnv1a64(h, name, strlen(name) + 1);
  for (int d = 0; d < ndim; d++) {
    unsigned char le[8];
    uint64_t v = (uint64_t)shape[d];
    dt__put_le64(le, v);
    h = dt__fnv1a64(h, le, 8);
  }
  return dt__fnv1a64(h, trainable ? "T" : "B", 1);
}

DTRAIN_API uint64_t dt_params_layout_hash(const dt_params *p) {
  uint64_t h = DT__FNV64_OFFSET;
  for (int i = 0; p && i < p->count; i++) {
    const dt__param *it = &p->items[i];
    h = dt__layout_hash_add(h, it->name, it->ndim, it->shape, it->trainable);
  }
  return h;
}

/* Declared in dt_net.h (the handshake's model check); FNV-1a 64 over a
 * version tag, the count, and per parameter its name, rank, shape (64-bit
 * little-endian) and trainable flag, in order. */
DTRAIN_API uint64_t dt_params_hash(const dt_params *p) {
  uint64_t h = dt__fnv1a64(DT__FNV64_OFFSET, "dtrain-model-1", 14);
  unsigned char le[8];
  uint64_t v = p ? (uint64_t)p->count : 0;
  dt__put_le64(le, v);
  h = dt__fnv1a64(h, le, 8);
  for (int i = 0; p && i < p->count; i++) {
    const dt__param *it = &p->items[i];
    h = dt__fnv1a64(h, it->name, strlen(it->name) + 1);
    le[0] = (unsigned char)it->ndim;
    h = dt__fnv1a64(h, le, 1);
    for (int d = 0; d < it->ndim; d++) {
      v = (uint64_t)it->shape[d];
      dt__put_le64(le, v);
      h = dt__fnv1a64(h, le, 8);
    }
    h = dt__fnv1a64(h, it->trainable ? "T" : "B", 1);
  }
  return h;
}

DTRAIN_API dt_rng *dt_params_rng(dt_params *p) { return p ? &p->rng : (dt_rng *)dt__params_null("dt_params_rng"); }

DTRAIN_API double dt_l2_norm(const float *x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; x && i < n; i++) s += (double)x[i] * (double)x[i];
  return sqrt(s);
}
