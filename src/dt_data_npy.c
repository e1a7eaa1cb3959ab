/* ===========================================================================
 * dt_data_npy.c -- NumPy .npy arrays: parse, encode, read, write, datasets
 * ===========================================================================
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_data_core.h"
#include "dt_file.h"

#if !defined(DTRAIN_NO_DATA) /* the whole file; the stubs at the end stand in without it */

#ifndef DTRAIN_NO_STDIO
#  include <errno.h>
#endif

/* ---- NPY ---------------------------------------------------------------------------------------------
 *   "\x93NUMPY" major minor HEADER_LEN (u16 LE in 1.0, u32 LE in 2.0/3.0)
 *   header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *           padded with spaces and ended by '\n'; then the data, C order. */

DTRAIN_API size_t dt_npy_dtype_size(dt_npy_dtype dtype) {
  switch (dtype) {
    case DTRAIN_NPY_F32: return 4;
    case DTRAIN_NPY_U8: return 1;
    case DTRAIN_NPY_I32: return 4;
    case DTRAIN_NPY_I64: return 8;
    default: return 0;
  }
}

static const char *dt__data_npy_descr(dt_npy_dtype t) {
  switch (t) {
    case DTRAIN_NPY_F32: return "<f4";
    case DTRAIN_NPY_U8: return "|u1";
    case DTRAIN_NPY_I32: return "<i4";
    case DTRAIN_NPY_I64: return "<i8";
    default: return "?";
  }
}

typedef struct dt__data_npyp {
  const char *ctx;
  const char *p, *end;
} dt__data_npyp;

static void dt__data_npy_ws(dt__data_npyp *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static int dt__data_npy_eat(dt__data_npyp *s, char ch) {
  dt__data_npy_ws(s);
  if (s->p < s->end && *s->p == ch) {
    s->p++;
    return 1;
  }
  return 0;
}

/* A quoted Python string into buf; 0 if there is none (or it is too long). */
static int dt__data_npy_str(dt__data_npyp *s, char *buf, size_t cap) {
  dt__data_npy_ws(s);
  if (s->p >= s->end || (*s->p != '\'' && *s->p != '"')) return 0;
  char q = *s->p++;
  size_t n = 0;
  while (s->p < s->end && *s->p != q) {
    if (n + 1 >= cap) return 0;
    buf[n++] = *s->p++;
  }
  if (s->p >= s->end) return 0;
  s->p++;
  buf[n] = '\0';
  return 1;
}

static dt_result dt__data_npy_bad(dt__data_npyp *s, const char *what) {
  return dt__error(DTRAIN_ERR_FORMAT, "%s: bad NPY header: %s", s->ctx, what);
}

static dt_result dt__data_npy_header(dt__data_npyp *s, dt_npy *a, int *swap) {
  int have_descr = 0, have_fortran = 0, have_shape = 0;
  if (!dt__data_npy_eat(s, '{')) return dt__data_npy_bad(s, "expected '{'");
  for (;;) {
    if (dt__data_npy_eat(s, '}')) break;
    char key[32], val[32];
    if (!dt__data_npy_str(s, key, sizeof key)) return dt__data_npy_bad(s, "expected a quoted key");
    if (!dt__data_npy_eat(s, ':')) return dt__data_npy_bad(s, "expected ':' after a key");
    if (!strcmp(key, "descr")) {
      if (!dt__data_npy_str(s, val, sizeof val)) return dt__data_npy_bad(s, "'descr' is not a simple dtype string");
      char bo = val[0];
      const char *ty = val + 1;
      if (bo != '<' && bo != '>' && bo != '|' && bo != '=') return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY dtype '%s' is not supported (float32 '<f4', uint8 '|u1', int32 '<i4', int64 '<i8')", s->ctx, val);
      if (!strcmp(ty, "u1")) a->dtype = DTRAIN_NPY_U8;
      else if (!strcmp(ty, "f4") && bo != '|') a->dtype = DTRAIN_NPY_F32;
      else if (!strcmp(ty, "i4") && bo != '|') a->dtype = DTRAIN_NPY_I32;
      else if (!strcmp(ty, "i8") && bo != '|') a->dtype = DTRAIN_NPY_I64;
      else
        return dt__error(DTRAIN_ERR_FORMAT,
                         "%s: NPY dtype '%s' is not supported (float32 '<f4', uint8 '|u1', int32 '<i4', int64 '<i8')",
                         s->ctx, val);
      int file_le = bo == '<' || (bo == '=' && dt__host_le());
      *swap = a->dtype != DTRAIN_NPY_U8 && file_le != dt__host_le();
      have_descr = 1;
    } else if (!strcmp(key, "fortran_order")) {
      dt__data_npy_ws(s);
      if ((size_t)(s->end - s->p) >= 5 && !strncmp(s->p, "False", 5)) {
        s->p += 5;
      } else if ((size_t)(s->end - s->p) >= 4 && !strncmp(s->p, "True", 4)) {
        return dt__error(DTRAIN_ERR_FORMAT,
                         "%s: NPY array is in Fortran order, which is not supported (save np.ascontiguousarray(a))",
                         s->ctx);
      } else {
        return dt__data_npy_bad(s, "'fortran_order' is not True or False");
      }
      have_fortran = 1;
    } else if (!strcmp(key, "shape")) {
      if (!dt__data_npy_eat(s, '(')) return dt__data_npy_bad(s, "'shape' is not a tuple");
      a->ndim = 0;
      for (;;) {
        if (dt__data_npy_eat(s, ')')) break;
        dt__data_npy_ws(s);
        if (s->p >= s->end || *s->p < '0' || *s->p > '9') return dt__data_npy_bad(s, "'shape' holds something other than integers");
        uint64_t v = 0;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
          v = v * 10 + (uint64_t)(*s->p - '0');
          if (v > (uint64_t)INT64_MAX / 16) return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY shape has an absurd dimension", s->ctx);
          s->p++;
        }
        if (a->ndim == DTRAIN_MAX_DIMS)
          return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY array has more than %d dimensions", s->ctx, DTRAIN_MAX_DIMS);
        a->shape[a->ndim++] = (int64_t)v;
        if (!dt__data_npy_eat(s, ',')) {
          if (!dt__data_npy_eat(s, ')')) return dt__data_npy_bad(s, "'shape' tuple is not closed");
          break;
        }
      }
      have_shape = 1;
    } else {
      char msg[96];
      snprintf(msg, sizeof msg, "unexpected key '%s'", key);
      return dt__data_npy_bad(s, msg);
    }
    if (!dt__data_npy_eat(s, ',')) {
      if (!dt__data_npy_eat(s, '}')) return dt__data_npy_bad(s, "expected ',' or '}'");
      break;
    }
  }
  if (!have_descr || !have_fortran || !have_shape)
    return dt__data_npy_bad(s, !have_descr ? "no 'descr'" : !have_fortran ? "no 'fortran_order'" : "no 'shape'");
  return DTRAIN_OK;
}

static void dt__data_swap(unsigned char *p, size_t n, size_t w) {
  for (size_t i = 0; i < n; i++, p += w)
    for (size_t k = 0; k < w / 2; k++) {
      unsigned char t = p[k];
      p[k] = p[w - 1 - k];
      p[w - 1 - k] = t;
    }
}

/* need != NULL: only the header is checked (dt__data_npy_size); *need gets
 * the bytes the whole file must have (0 when the header is not all there). */
static dt_result dt__data_npy_parse2(const char *ctx, const unsigned char *p, size_t len, dt_npy *out, uint64_t *need);

DTRAIN_PRIVATE dt_result dt__data_npy_size(const char *ctx, const unsigned char *p, size_t len, uint64_t *need) {
  dt_npy a;
  *need = 0;
  if (len < 12) return DTRAIN_OK; /* the parser names the truncation */
  return dt__data_npy_parse2(ctx, p, len, &a, need);
}

static dt_result dt__data_npy_parse(const char *ctx, const unsigned char *p, size_t len, dt_npy *out) {
  return dt__data_npy_parse2(ctx, p, len, out, NULL);
}

static dt_result dt__data_npy_parse2(const char *ctx, const unsigned char *p, size_t len, dt_npy *out, uint64_t *need) {
  memset(out, 0, sizeof *out);
  if (len < 10 || memcmp(p, "\x93NUMPY", 6) != 0) {
    if (len >= 6 && memcmp(p, "\x93NUMPY", 6) == 0)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file (%zu bytes)", ctx, len);
    return dt__error(DTRAIN_ERR_FORMAT, "%s: not an NPY file (no \\x93NUMPY magic)", ctx);
  }
  unsigned major = p[6], minor = p[7];
  size_t hlen, hstart;
  if (major == 1) {
    hlen = dt__get_le16(p + 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (len < 12) return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file (%zu bytes)", ctx, len);
    hlen = dt__get_le32(p + 8);
    hstart = 12;
  } else {
    return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY format version %u.%u is not supported (1.0, 2.0, 3.0)", ctx, major, minor);
  }
  if (minor != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY format version %u.%u is not supported (1.0, 2.0, 3.0)", ctx, major, minor);
  if (need && hlen > len - hstart) return DTRAIN_OK; /* the header is longer than the bytes at hand */
  if (hlen > len - hstart)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file: header of %zu bytes, only %zu follow", ctx, hlen,
                     len - hstart);
  dt__data_npyp s;
  s.ctx = ctx;
  s.p = (const char *)p + hstart;
  s.end = s.p + hlen;
  int swap = 0;
  dt_npy a;
  memset(&a, 0, sizeof a);
  dt_result r = dt__data_npy_header(&s, &a, &swap);
  if (r != DTRAIN_OK) return r;
  /* Sizes in 64 bits: a shape such as [2^32,...] must not wrap a 32-bit size_t. */
  uint64_t w = dt_npy_dtype_size(a.dtype), count = 1, bytes64 = 0;
  int overflow = 0;
  for (int d = 0; d < a.ndim; d++) {
    uint64_t dim = (uint64_t)a.shape[d];
    if (dim != 0 && count > UINT64_MAX / dim) overflow = 1;
    else count *= dim;
  }
  if (!overflow && w != 0 && count > UINT64_MAX / w) overflow = 1;
  else bytes64 = count * w;
  if (need) {
    if (overflow || bytes64 > UINT64_MAX - hstart - hlen)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY header claims a size that overflows", ctx);
    *need = (uint64_t)(hstart + hlen) + bytes64;
    return DTRAIN_OK;
  }
  size_t avail = len - hstart - hlen;
  char sh[160];
  dt__shape_text(a.ndim, a.shape, sh, sizeof sh);
  if (overflow || bytes64 > (uint64_t)avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY header claims shape %s of '%s' but only %zu data bytes follow", ctx, sh,
                     dt__data_npy_descr(a.dtype), avail);
  size_t bytes = (size_t)bytes64; /* <= avail: fits */
  if (bytes < avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY file has %zu bytes after the data of shape %s", ctx, avail - bytes, sh);
  for (int d = a.ndim; d < DTRAIN_MAX_DIMS; d++) a.shape[d] = 1;
  a.size = (int64_t)count;
  a.bytes_ = bytes;
  a.data = dt__alloc(bytes);
  if (!a.data) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, bytes);
  if (bytes) memcpy(a.data, p + hstart + hlen, bytes);
  if (swap) dt__data_swap((unsigned char *)a.data, (size_t)count, (size_t)w);
  *out = a;
  return DTRAIN_OK;
}

DTRAIN_API void dt_npy_free(dt_npy *a) {
  if (!a) return;
  dt__free(a->data, a->bytes_);
  memset(a, 0, sizeof *a);
}

DTRAIN_API dt_result dt_npy_parse(const void *buf, size_t len, dt_npy *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_parse: buf is NULL");
  return dt__data_npy_parse("dt_npy_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_npy_read(const char *path, dt_npy *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_npy_read", path, 1, dt__data_npy_size, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_npy_read: '%s'", path);
  r = dt__data_npy_parse(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

/* Header text for an array, padded so that the data starts at a multiple
 * of 64 bytes (as NumPy writes it). Returns its length (0 if too long). */
static size_t dt__data_npy_make_header(char *h, size_t cap, dt_npy_dtype dtype, int ndim, const int64_t *shape) {
  char sh[200];
  size_t n = 0;
  sh[n++] = '(';
  for (int d = 0; d < ndim; d++)
    n += (size_t)snprintf(sh + n, sizeof sh - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (ndim == 1) sh[n++] = ',';
  sh[n++] = ')';
  sh[n] = '\0';
  int k = snprintf(h, cap, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", dt__data_npy_descr(dtype), sh);
  if (k < 0 || (size_t)k >= cap) return 0;
  size_t len = (size_t)k, total = 10 + len + 1;
  size_t pad = (64 - total % 64) % 64;
  if (len + pad + 1 >= cap) return 0;
  memset(h + len, ' ', pad);
  h[len + pad] = '\n';
  return len + pad + 1;
}

static dt_result dt__data_npy_check(const char *who, dt_npy_dtype dtype, int ndim, const int64_t *shape, const void *data,
                                    size_t *count) {
  if (dt_npy_dtype_size(dtype) == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown dtype %d", who, (int)dtype);
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_RANK, "%s: ndim %d is not in 0..%d", who, ndim, DTRAIN_MAX_DIMS);
  if (ndim > 0 && !shape) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", who);
  size_t c = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) return dt__error(DTRAIN_ERR_SHAPE, "%s: dim %d is negative (%lld)", who, d, (long long)shape[d]);
    if ((uint64_t)shape[d] > SIZE_MAX || !dt__mul_size(c, (size_t)shape[d], &c))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s: array size overflows", who);
  }
  if (c > 0 && !data) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: data is NULL", who);
  if (!dt__mul_size(c, dt_npy_dtype_size(dtype), count) || *count > SIZE_MAX - 512)
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: array size overflows", who);
  *count = c;
  return DTRAIN_OK;
}

static dt_result dt__data_npy_encode(const char *who, unsigned char *buf, size_t cap, size_t *len, dt_npy_dtype dtype,
                                     int ndim, const int64_t *shape, const void *data) {
  size_t count = 0;
  dt_result r = dt__data_npy_check(who, dtype, ndim, shape, data, &count);
  if (r != DTRAIN_OK) return r;
  char h[512];
  size_t hl = dt__data_npy_make_header(h, sizeof h, dtype, ndim, shape);
  if (hl == 0) return dt__error(DTRAIN_ERR_INTERNAL, "%s: NPY header does not fit", who);
  size_t w = dt_npy_dtype_size(dtype), bytes = count * w, total = 10 + hl + bytes;
  if (len) *len = total;
  if (!buf) return DTRAIN_OK;
  if (cap < total)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: buffer of %zu bytes is too small (%zu needed)", who, cap, total);
  memcpy(buf, "\x93NUMPY\x01\x00", 8);
  dt__put_le16(buf + 8, (uint16_t)hl);
  memcpy(buf + 10, h, hl);
  if (bytes) memcpy(buf + 10 + hl, data, bytes);
  if (w > 1 && !dt__host_le()) dt__data_swap(buf + 10 + hl, count, w);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_npy_encode(void *buf, size_t cap, size_t *len, dt_npy_dtype dtype, int ndim, const int64_t *shape,
                                   const void *data) {
  return dt__data_npy_encode("dt_npy_encode", (unsigned char *)buf, cap, len, dtype, ndim, shape, data);
}

DTRAIN_API dt_result dt_npy_write(const char *path, dt_npy_dtype dtype, int ndim, const int64_t *shape, const void *data) {
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_write: path is NULL");
#ifdef DTRAIN_NO_STDIO
  (void)dtype; (void)ndim; (void)shape; (void)data;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "dt_npy_write: file I/O is not available in this build (DTRAIN_NO_STDIO); use dt_npy_encode");
#else
  size_t total = 0;
  dt_result r = dt__data_npy_encode("dt_npy_write", NULL, 0, &total, dtype, ndim, shape, data);
  if (r != DTRAIN_OK) return r;
  unsigned char *buf = (unsigned char *)dt__alloc(total);
  if (!buf) return dt__error(DTRAIN_ERR_NOMEM, "dt_npy_write: out of memory (%zu bytes)", total);
  r = dt__data_npy_encode("dt_npy_write", buf, total, &total, dtype, ndim, shape, data);
  if (r == DTRAIN_OK) {
    /* The shared atomic writer (dt_file.h): exclusive temporary, fsync, rename. */
    dt__file_out fo;
    r = dt__file_create(&fo, path);
    if (r != DTRAIN_OK) {
      r = dt__error(r, "dt_npy_write: '%s': %s", path, fo.msg);
    } else if (fwrite(buf, 1, total, fo.f) != total) {
      int e = errno;
      dt__file_abort(&fo);
      r = dt__error(DTRAIN_ERR_IO, "dt_npy_write: cannot write '%s': %s", path, e ? strerror(e) : "write error");
    } else {
      r = dt__file_commit(&fo);
      if (r != DTRAIN_OK) r = dt__error(r, "dt_npy_write: cannot write '%s': %s", path, fo.msg);
    }
  }
  dt__free(buf, total);
  return r;
#endif
}

/* who: the public function called, for the messages. */
static dt_result dt__data_from_arrays(const char *who, dt_dataset **out, const dt_npy *x, const dt_npy *y,
                                      unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!x || !x->data) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: x is NULL or empty", who);
  if (x->ndim < 1) return dt__error(DTRAIN_ERR_RANK, "%s: x is a scalar; it needs a leading sample dimension", who);
  int64_t one = 1;
  int snd = x->ndim == 1 ? 1 : x->ndim - 1;
  const int64_t *ssh = x->ndim == 1 ? &one : x->shape + 1;
  if (y) {
    if (!y->data || y->ndim != 1 || y->shape[0] != x->shape[0]) {
      char a[160], b[160];
      return dt__error(DTRAIN_ERR_MISMATCH, "%s: labels of shape %s do not match samples of shape %s (need [%lld])", who,
                       dt__shape_text(y->ndim, y->shape, a, sizeof a),
                       dt__shape_text(x->ndim, x->shape, b, sizeof b), (long long)x->shape[0]);
    }
    if (y->dtype == DTRAIN_NPY_F32) return dt__error(DTRAIN_ERR_FORMAT, "%s: labels must be integers, not float32", who);
  }
  dt_dataset *ds;
  dt_result r = dt__data_ds_new(who, &ds, x->shape[0], snd, ssh, y != NULL);
  if (r != DTRAIN_OK) return r;
  size_t total = (size_t)x->size;
  float scale = (flags & DTRAIN_DATA_RAW) ? 1.0f : 1.0f / 255.0f;
  for (size_t i = 0; i < total; i++) {
    switch (x->dtype) {
      case DTRAIN_NPY_F32: ds->x[i] = ((const float *)x->data)[i]; break;
      case DTRAIN_NPY_U8: ds->x[i] = (float)((const unsigned char *)x->data)[i] * scale; break;
      case DTRAIN_NPY_I32: ds->x[i] = (float)((const int32_t *)x->data)[i]; break;
      default: ds->x[i] = (float)((const int64_t *)x->data)[i]; break;
    }
  }
  if (y) {
    for (int64_t i = 0; i < ds->n; i++) {
      int64_t v = y->dtype == DTRAIN_NPY_U8    ? ((const unsigned char *)y->data)[i]
                  : y->dtype == DTRAIN_NPY_I32 ? ((const int32_t *)y->data)[i]
                                               : ((const int64_t *)y->data)[i];
      if (v < 0 || v > INT32_MAX) {
        dt_dataset_destroy(ds);
        return dt__error(DTRAIN_ERR_INDEX, "%s: label %lld of sample %lld is out of range [0, %d]", who, (long long)v,
                         (long long)i, INT32_MAX);
      }
      ds->y[i] = (int32_t)v;
    }
    dt__data_set_classes(who, ds);
  }
  *out = ds;
  return DTRAIN_OK;
}

DTRAIN_API dt_dataset *dt_dataset_from_arrays(const dt_npy *x, const dt_npy *y, unsigned flags) {
  dt_dataset *ds;
  return dt__data_from_arrays("dt_dataset_from_arrays", &ds, x, y, flags) == DTRAIN_OK ? ds : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags) {
  return dt__data_from_arrays("dt_dataset_from_npy", out, x, y, flags);
}
#else /* DTRAIN_NO_DATA: every entry point says so */

DTRAIN_API size_t dt_npy_dtype_size(dt_npy_dtype dtype) {
  (void)dtype;
  return 0;
}
DTRAIN_API void dt_npy_free(dt_npy *a) { (void)a; }
DTRAIN_API dt_result dt_npy_parse(const void *buf, size_t len, dt_npy *out) {
  (void)buf; (void)len; (void)out;
  return dt__data_compiled_out("dt_npy_parse");
}
DTRAIN_API dt_result dt_npy_read(const char *path, dt_npy *out) {
  (void)path; (void)out;
  return dt__data_compiled_out("dt_npy_read");
}
DTRAIN_API dt_result dt_npy_encode(void *buf, size_t cap, size_t *len, dt_npy_dtype dtype, int ndim,
                                   const int64_t *shape, const void *data) {
  (void)buf; (void)cap; (void)len; (void)dtype; (void)ndim; (void)shape; (void)data;
  return dt__data_compiled_out("dt_npy_encode");
}
DTRAIN_API dt_result dt_npy_write(const char *path, dt_npy_dtype dtype, int ndim, const int64_t *shape,
                                  const void *data) {
  (void)path; (void)dtype; (void)ndim; (void)shape; (void)data;
  return dt__data_compiled_out("dt_npy_write");
}
DTRAIN_API dt_dataset *dt_dataset_from_arrays(const dt_npy *x, const dt_npy *y, unsigned flags) {
  (void)x; (void)y; (void)flags;
  dt__data_compiled_out("dt_dataset_from_arrays");
  return NULL;
}
DTRAIN_API dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags) {
  (void)x; (void)y; (void)flags;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_from_npy");
}

#endif /* DTRAIN_NO_DATA */
