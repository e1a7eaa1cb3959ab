/* ===========================================================================
 * dt_data.c -- files, IDX, datasets, Fashion-MNIST, CSV, NPY, text, loader
 * ===========================================================================
 * Parsers work on bytes in memory; the file functions read the whole file
 * (decompressing gzip with dt_inflate.c) and hand the bytes to them. Every
 * size a header claims is checked against the bytes that are really there
 * before anything is allocated for it.
 */
#include "dt_internal.h"

#ifndef DTRAIN_NO_STDIO
#  include <errno.h>
#endif

/* From dt_inflate.c: gunzip `in` appending to `out`, messages prefixed by ctx. */
DTRAIN_PRIVATE dt_result dt__gunzip_ctx(const char *ctx, const unsigned char *in, size_t len, size_t max_out,
                                        dt_bytes *out);

#define DT__DATA_CTX 384

static int dt__data_is_gzip(const unsigned char *p, size_t len) { return len >= 2 && p[0] == 0x1f && p[1] == 0x8b; }

/* ---- files ---------------------------------------------------------------------------- */

#ifndef DTRAIN_NO_STDIO
static dt_result dt__data_read_raw(const char *who, const char *path, dt_bytes *out) {
  memset(out, 0, sizeof *out);
  FILE *f = fopen(path, "rb");
  if (!f) return dt__error(DTRAIN_ERR_IO, "%s: cannot open '%s': %s", who, path, strerror(errno));
  /* Probe one byte first: a directory (or another unreadable thing) fails
   * here, before its bogus size could be trusted for an allocation. */
  int c0 = fgetc(f);
  if (c0 == EOF && ferror(f)) {
    int e = errno;
    fclose(f);
    return dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, e ? strerror(e) : "read error");
  }
  size_t cap = 1 << 16;
  if (fseek(f, 0, SEEK_END) == 0) {
    long end = ftell(f);
    if (end > 0 && (unsigned long)end < (unsigned long)(SIZE_MAX - 1)) cap = (size_t)end + 1;
  }
  rewind(f);
  unsigned char *buf = (unsigned char *)dt__alloc(cap);
  if (!buf) {
    fclose(f);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory (%zu bytes)", who, path, cap);
  }
  size_t size = 0;
  for (;;) {
    if (size + 1 >= cap) { /* keep room for the terminating 0 */
      size_t ncap = cap > SIZE_MAX / 2 ? SIZE_MAX : cap * 2;
      unsigned char *nb = ncap > cap ? (unsigned char *)dt__realloc(buf, cap, ncap) : NULL;
      if (!nb) {
        dt__free(buf, cap);
        fclose(f);
        return dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory reading the file", who, path);
      }
      buf = nb;
      cap = ncap;
    }
    size_t got = fread(buf + size, 1, cap - 1 - size, f);
    size += got;
    if (got == 0) {
      if (ferror(f)) {
        int e = errno;
        dt__free(buf, cap);
        fclose(f);
        return dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, e ? strerror(e) : "read error");
      }
      break;
    }
  }
  fclose(f);
  buf[size] = 0;
  out->data = buf;
  out->size = size;
  out->cap = cap;
  return DTRAIN_OK;
}
#endif

/* Whole file; gunzipped when gz and the data has the gzip magic. */
static dt_result dt__data_load(const char *who, const char *path, int gz, dt_bytes *out) {
  memset(out, 0, sizeof *out);
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: path is NULL", who);
#ifdef DTRAIN_NO_STDIO
  (void)gz;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "%s: file I/O is not available in this build (DTRAIN_NO_STDIO); parse from memory instead", who);
#else
  dt_bytes raw;
  dt_result r = dt__data_read_raw(who, path, &raw);
  if (r != DTRAIN_OK || !gz || !dt__data_is_gzip(raw.data, raw.size)) {
    *out = raw;
    return r;
  }
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "%s: '%s'", who, path);
  r = dt__gunzip_ctx(ctx, raw.data, raw.size, 0, out);
  dt_bytes_free(&raw);
  if (r != DTRAIN_OK) dt_bytes_free(out);
  return r;
#endif
}

DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file: out is NULL");
  return dt__data_load("dt_read_file", path, 0, out);
}

DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file_gz: out is NULL");
  return dt__data_load("dt_read_file_gz", path, 1, out);
}

/* Bytes of a parse_* input, gunzipped into tmp when they are gzip data. */
static dt_result dt__data_maybe_gunzip(const char *ctx, const unsigned char **p, size_t *len, dt_bytes *tmp) {
  memset(tmp, 0, sizeof *tmp);
  if (!dt__data_is_gzip(*p, *len)) return DTRAIN_OK;
  dt_result r = dt__gunzip_ctx(ctx, *p, *len, 0, tmp);
  if (r != DTRAIN_OK) {
    dt_bytes_free(tmp);
    return r;
  }
  *p = tmp->data;
  *len = tmp->size;
  return DTRAIN_OK;
}

/* ---- IDX -------------------------------------------------------------------------------- */

/* Validate an IDX image; fills ndim/shape/size and the data offset. */
static dt_result dt__data_idx_header(const char *ctx, const unsigned char *p, size_t len, int *ndim, int64_t *shape,
                                     int64_t *size, size_t *offset) {
  if (len < 4)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated IDX file (%zu bytes; the header alone needs at least 4)", ctx, len);
  if (p[0] != 0 || p[1] != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: bad magic %02x %02x %02x %02x: not an IDX file (expected 00 00 08 NDIM)", ctx,
                     p[0], p[1], p[2], p[3]);
  if (p[2] != 0x08)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX data type 0x%02x is not supported (only 0x08, unsigned byte)", ctx, p[2]);
  int nd = p[3];
  if (nd < 1 || nd > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX file has %d dimensions (supported: 1 to %d)", ctx, nd, DTRAIN_MAX_DIMS);
  size_t hdr = 4 + 4 * (size_t)nd;
  if (len < hdr)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated IDX header (%zu bytes, %zu needed for %d dimensions)", ctx, len, hdr,
                     nd);
  size_t total = 1;
  int overflow = 0;
  for (int d = 0; d < nd; d++) {
    uint32_t v = dt__get_be32(p + 4 + 4 * d);
    shape[d] = (int64_t)v;
    if (v == 0) return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX dimension %d is 0", ctx, d);
    if (!dt__mul_size(total, (size_t)v, &total)) overflow = 1;
  }
  char sh[160];
  dt__shape_text(nd, shape, sh, sizeof sh);
  size_t avail = len - hdr;
  if (overflow || total > avail || total > (size_t)INT64_MAX)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: IDX header claims shape %s but only %zu data bytes follow (truncated or corrupt)",
                     ctx, sh, avail);
  if (total < avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: IDX file has %zu bytes after the data of shape %s", ctx, avail - total, sh);
  for (int d = nd; d < DTRAIN_MAX_DIMS; d++) shape[d] = 1;
  *ndim = nd;
  *size = (int64_t)total;
  *offset = hdr;
  return DTRAIN_OK;
}

static dt_result dt__data_idx_parse(const char *ctx, const unsigned char *p, size_t len, dt_idx *out) {
  dt_bytes tmp;
  dt_result r = dt__data_maybe_gunzip(ctx, &p, &len, &tmp);
  if (r != DTRAIN_OK) return r;
  size_t off = 0;
  r = dt__data_idx_header(ctx, p, len, &out->ndim, out->shape, &out->size, &off);
  if (r == DTRAIN_OK) {
    out->bytes_ = (size_t)out->size;
    out->data = (unsigned char *)dt__alloc(out->bytes_);
    if (!out->data) r = dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, out->bytes_);
    else memcpy(out->data, p + off, out->bytes_);
  }
  dt_bytes_free(&tmp);
  if (r != DTRAIN_OK) dt_idx_free(out);
  return r;
}

DTRAIN_API void dt_idx_free(dt_idx *a) {
  if (!a) return;
  dt__free(a->data, a->bytes_);
  memset(a, 0, sizeof *a);
}

DTRAIN_API dt_result dt_idx_parse(const void *buf, size_t len, dt_idx *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_parse: buf is NULL");
  return dt__data_idx_parse("dt_idx_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_idx_read(const char *path, dt_idx *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_idx_read", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_idx_read: '%s'", path);
  r = dt__data_idx_parse(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

/* ---- datasets -------------------------------------------------------------------------------
 * The public struct is the first member of a private one that remembers the
 * allocation sizes, so a user who edits the fields cannot break the free. */
typedef struct dt__data_ds {
  dt_dataset pub;
  size_t xbytes, ybytes;
} dt__data_ds;

DTRAIN_API void dt_dataset_destroy(dt_dataset *ds) {
  if (!ds) return;
  dt__data_ds *d = (dt__data_ds *)ds;
  dt__free(ds->x, d->xbytes);
  dt__free(ds->y, d->ybytes);
  dt__free(d, sizeof *d);
}

static dt_result dt__data_ds_new(const char *who, dt_dataset **out, int64_t n, int ndim, const int64_t *shape,
                                 int with_labels) {
  *out = NULL;
  if (n < 1) return dt__error(DTRAIN_ERR_EMPTY, "%s: a dataset needs at least 1 sample (got %lld)", who, (long long)n);
  if (ndim < 1 || ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_RANK, "%s: a sample has %d dims (supported: 1 to %d)", who, ndim, DTRAIN_MAX_DIMS - 1);
  if (!shape) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: sample_shape is NULL", who);
  size_t per = 1, total, xbytes, ybytes = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 1) return dt__error(DTRAIN_ERR_SHAPE, "%s: sample dim %d is %lld (must be >= 1)", who, d, (long long)shape[d]);
    if ((uint64_t)shape[d] > SIZE_MAX || !dt__mul_size(per, (size_t)shape[d], &per))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s: sample size overflows", who);
  }
  if ((uint64_t)n > SIZE_MAX || !dt__mul_size(per, (size_t)n, &total) || !dt__mul_size(total, sizeof(float), &xbytes) ||
      (with_labels && !dt__mul_size((size_t)n, sizeof(int32_t), &ybytes)))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: %lld samples of %zu values overflow memory sizes", who, (long long)n, per);
  dt__data_ds *d = (dt__data_ds *)dt__calloc(sizeof *d);
  if (!d) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", who);
  d->xbytes = xbytes;
  d->ybytes = ybytes;
  d->pub.x = (float *)dt__calloc(xbytes);
  d->pub.y = with_labels ? (int32_t *)dt__calloc(ybytes) : NULL;
  if (!d->pub.x || (with_labels && !d->pub.y)) {
    dt_dataset_destroy(&d->pub);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes for %lld samples)", who, xbytes + ybytes, (long long)n);
  }
  d->pub.n = n;
  d->pub.sample_size = (int64_t)per;
  d->pub.ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) d->pub.shape[i] = i < ndim ? shape[i] : 1;
  *out = &d->pub;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_create(dt_dataset **out, int64_t n, int ndim, const int64_t *sample_shape,
                                       int with_labels) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_create: out is NULL");
  return dt__data_ds_new("dt_dataset_create", out, n, ndim, sample_shape, with_labels);
}

/* Labels must be >= 0; sets num_classes to max + 1. */
static dt_result dt__data_set_classes(const char *who, dt_dataset *ds) {
  int32_t mx = -1;
  for (int64_t i = 0; i < ds->n; i++) {
    if (ds->y[i] < 0)
      return dt__error(DTRAIN_ERR_INDEX, "%s: label %d of sample %lld is negative", who, (int)ds->y[i], (long long)i);
    if (ds->y[i] > mx) mx = ds->y[i];
  }
  ds->num_classes = mx == INT32_MAX ? INT32_MAX : mx + 1;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_subset: out is NULL");
  *out = NULL;
  if (!ds || !idx) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_subset: %s is NULL", ds ? "idx" : "ds");
  for (int64_t i = 0; i < count; i++)
    if (idx[i] < 0 || idx[i] >= ds->n)
      return dt__error(DTRAIN_ERR_INDEX, "dt_dataset_subset: idx[%lld] = %lld is out of range [0, %lld)", (long long)i,
                       (long long)idx[i], (long long)ds->n);
  dt_dataset *s;
  dt_result r = dt__data_ds_new("dt_dataset_subset", &s, count, ds->ndim, ds->shape, ds->y != NULL);
  if (r != DTRAIN_OK) return r;
  size_t row = (size_t)ds->sample_size;
  for (int64_t i = 0; i < count; i++) {
    memcpy(s->x + (size_t)i * row, ds->x + (size_t)idx[i] * row, row * sizeof(float));
    if (ds->y) s->y[i] = ds->y[idx[i]];
  }
  s->num_classes = ds->num_classes;
  *out = s;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_split(const dt_dataset *ds, double val_fraction, uint64_t seed, dt_dataset **train,
                                      dt_dataset **val) {
  if (!train || !val) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_split: train or val is NULL");
  *train = *val = NULL;
  if (!ds) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_split: ds is NULL");
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_dataset_split: val_fraction %g is not in (0, 1)", val_fraction);
  if (ds->n < 2)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_dataset_split: cannot split %lld sample(s) in two", (long long)ds->n);
  int64_t nval = (int64_t)floor((double)ds->n * val_fraction + 0.5);
  nval = DT__MAX(1, DT__MIN(nval, ds->n - 1));
  size_t n = (size_t)ds->n;
  int64_t *perm = (int64_t *)dt__alloc(n * sizeof(int64_t));
  int64_t *tr = (int64_t *)dt__alloc(n * sizeof(int64_t));
  unsigned char *is_val = (unsigned char *)dt__calloc(n);
  dt_result r = DTRAIN_OK;
  if (!perm || !tr || !is_val) {
    r = dt__error(DTRAIN_ERR_NOMEM, "dt_dataset_split: out of memory");
    goto done;
  }
  {
    /* The first nval entries of a seeded permutation go to validation; both
     * parts are then listed in the original order. */
    dt_rng rng;
    dt_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) perm[i] = (int64_t)i;
    for (size_t i = n - 1; i > 0; i--) {
      size_t j = (size_t)dt_rng_below(&rng, (uint64_t)i + 1);
      int64_t t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int64_t i = 0; i < nval; i++) is_val[perm[i]] = 1;
    int64_t nt = 0, nv = 0;
    for (size_t i = 0; i < n; i++) {
      if (is_val[i]) perm[nv++] = (int64_t)i; /* perm is free for reuse: nv <= i */
      else tr[nt++] = (int64_t)i;
    }
    r = dt_dataset_subset(ds, tr, nt, train);
    if (r == DTRAIN_OK) r = dt_dataset_subset(ds, perm, nv, val);
    if (r != DTRAIN_OK) {
      dt_dataset_destroy(*train);
      *train = NULL;
    }
  }
done:
  dt__free(perm, n * sizeof(int64_t));
  dt__free(tr, n * sizeof(int64_t));
  dt__free(is_val, n);
  return r;
}

DTRAIN_API dt_result dt_dataset_reshape(dt_dataset *ds, int ndim, const int64_t *sample_shape) {
  if (!ds || !sample_shape) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_reshape: %s is NULL", ds ? "sample_shape" : "ds");
  if (ndim < 1 || ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_RANK, "dt_dataset_reshape: %d dims (supported: 1 to %d)", ndim, DTRAIN_MAX_DIMS - 1);
  int64_t per = 1;
  for (int d = 0; d < ndim; d++) {
    if (sample_shape[d] < 1 || sample_shape[d] > ds->sample_size)
      return dt__error(DTRAIN_ERR_SHAPE, "dt_dataset_reshape: dim %d is %lld", d, (long long)sample_shape[d]);
    per *= sample_shape[d];
    if (per > ds->sample_size) break;
  }
  if (per != ds->sample_size) {
    char a[160], b[160];
    return dt__error(DTRAIN_ERR_SHAPE, "dt_dataset_reshape: shape %s does not hold the %lld values of %s",
                     dt__shape_text(ndim, sample_shape, a, sizeof a), (long long)ds->sample_size,
                     dt__shape_text(ds->ndim, ds->shape, b, sizeof b));
  }
  ds->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) ds->shape[i] = i < ndim ? sample_shape[i] : 1;
  return DTRAIN_OK;
}

/* ---- datasets from IDX ------------------------------------------------------------------------ */

static dt_result dt__data_from_idx(const char *ictx, const char *lctx, dt_dataset **out, const unsigned char *ip,
                                   size_t ilen, const unsigned char *lp, size_t llen, int has_labels, unsigned flags) {
  dt_bytes itmp, ltmp;
  int ind = 0, lnd = 0;
  int64_t ish[DTRAIN_MAX_DIMS], lsh[DTRAIN_MAX_DIMS], isize = 0, lsize = 0;
  size_t ioff = 0, loff = 0;
  memset(&ltmp, 0, sizeof ltmp);
  dt_result r = dt__data_maybe_gunzip(ictx, &ip, &ilen, &itmp);
  if (r != DTRAIN_OK) return r;
  r = dt__data_idx_header(ictx, ip, ilen, &ind, ish, &isize, &ioff);
  if (r == DTRAIN_OK && ind < 2)
    r = dt__error(DTRAIN_ERR_FORMAT, "%s: an images file needs at least 2 dimensions (count, values...), this one has 1",
                  ictx);
  if (r == DTRAIN_OK && has_labels) {
    r = dt__data_maybe_gunzip(lctx, &lp, &llen, &ltmp);
    if (r == DTRAIN_OK) r = dt__data_idx_header(lctx, lp, llen, &lnd, lsh, &lsize, &loff);
    if (r == DTRAIN_OK && lnd != 1) {
      char sh[160];
      r = dt__error(DTRAIN_ERR_FORMAT, "%s: a labels file must be 1-D, this one has shape %s", lctx,
                    dt__shape_text(lnd, lsh, sh, sizeof sh));
    }
    if (r == DTRAIN_OK && lsh[0] != ish[0])
      r = dt__error(DTRAIN_ERR_MISMATCH, "%s: %lld images but %lld labels", ictx, (long long)ish[0], (long long)lsh[0]);
  }
  dt_dataset *ds = NULL;
  if (r == DTRAIN_OK) r = dt__data_ds_new(ictx, &ds, ish[0], ind - 1, ish + 1, has_labels);
  if (r == DTRAIN_OK) {
    const unsigned char *px = ip + ioff;
    size_t total = (size_t)isize;
    float scale = (flags & DTRAIN_DATA_RAW) ? 1.0f : 1.0f / 255.0f;
    for (size_t i = 0; i < total; i++) ds->x[i] = (float)px[i] * scale;
    if (has_labels) {
      for (int64_t i = 0; i < ds->n; i++) ds->y[i] = lp[loff + (size_t)i];
      dt__data_set_classes(lctx, ds);
    }
    *out = ds;
  }
  dt_bytes_free(&itmp);
  dt_bytes_free(&ltmp);
  return r;
}

DTRAIN_API dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len, const void *labels,
                                          size_t labels_len, unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: out is NULL");
  *out = NULL;
  if (!images) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: images is NULL");
  if (!labels && labels_len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: labels is NULL");
  return dt__data_from_idx("dt_dataset_parse_idx: images", "dt_dataset_parse_idx: labels", out,
                           (const unsigned char *)images, images_len, (const unsigned char *)labels, labels_len,
                           labels != NULL && labels_len > 0, flags);
}

DTRAIN_API dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path,
                                         unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_idx: out is NULL");
  *out = NULL;
  if (!images_path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_idx: images_path is NULL");
  dt_bytes ib, lb;
  memset(&lb, 0, sizeof lb);
  dt_result r = dt__data_load("dt_dataset_read_idx", images_path, 0, &ib); /* gunzipped by the parser */
  if (r != DTRAIN_OK) return r;
  if (labels_path) r = dt__data_load("dt_dataset_read_idx", labels_path, 0, &lb);
  if (r == DTRAIN_OK) {
    char ictx[DT__DATA_CTX], lctx[DT__DATA_CTX];
    snprintf(ictx, sizeof ictx, "dt_dataset_read_idx: '%s'", images_path);
    snprintf(lctx, sizeof lctx, "dt_dataset_read_idx: '%s'", labels_path ? labels_path : "");
    r = dt__data_from_idx(ictx, lctx, out, ib.data, ib.size, lb.data, lb.size, labels_path != NULL, flags);
  }
  dt_bytes_free(&ib);
  dt_bytes_free(&lb);
  return r;
}

/* ---- Fashion-MNIST ------------------------------------------------------------------------------ */

#define DT__DATA_FM_SYSTEM "/usr/share/datasets/fashion-mnist"
#define DT__DATA_FM_SHIPPED "data/fashion-mnist"

#ifndef DTRAIN_NO_STDIO
/* Path of dir/base.gz or dir/base, whichever exists (gz first); 0 if neither. */
static int dt__data_fm_file(const char *dir, const char *base, char *path, size_t cap) {
  for (int gz = 1; gz >= 0; gz--) {
    int n = snprintf(path, cap, "%s/%s%s", dir, base, gz ? ".gz" : "");
    if (n < 0 || (size_t)n >= cap) return 0;
    FILE *f = fopen(path, "rb");
    if (f) {
      fclose(f);
      return 1;
    }
  }
  return 0;
}

static int dt__data_fm_has(const char *dir, int train) {
  char p[1024];
  return dt__data_fm_file(dir, train ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte", p, sizeof p) &&
         dt__data_fm_file(dir, train ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte", p, sizeof p);
}
#endif

DTRAIN_API dt_result dt_fashion_mnist_find(const char *dir, char *out, size_t cap, int *has_train) {
  if (has_train) *has_train = 0;
  if (!out || cap == 0) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fashion_mnist_find: out is NULL or cap is 0");
  out[0] = '\0';
#ifdef DTRAIN_NO_STDIO
  (void)dir;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fashion_mnist_find: file I/O is not available in this build (DTRAIN_NO_STDIO)");
#else
  const char *cands[2] = {DT__DATA_FM_SYSTEM, DT__DATA_FM_SHIPPED};
  const char *found = NULL;
  if (dir) {
    if (dt__data_fm_has(dir, 0)) found = dir;
  } else {
    for (int i = 0; i < 2 && !found; i++)
      if (dt__data_fm_has(cands[i], 0)) found = cands[i];
  }
  if (!found) {
    if (dir)
      return dt__error(DTRAIN_ERR_NOT_FOUND,
                       "dt_fashion_mnist_find: no Fashion-MNIST in '%s' (need t10k-images-idx3-ubyte[.gz] and "
                       "t10k-labels-idx1-ubyte[.gz])", dir);
    return dt__error(DTRAIN_ERR_NOT_FOUND,
                     "dt_fashion_mnist_find: no Fashion-MNIST found in " DT__DATA_FM_SYSTEM " (apt-get install "
                     "dataset-fashion-mnist) nor in " DT__DATA_FM_SHIPPED " (run from the dtrain directory)");
  }
  if (strlen(found) + 1 > cap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_fashion_mnist_find: out (%zu bytes) is too small for '%s'", cap, found);
  memcpy(out, found, strlen(found) + 1);
  int train = dt__data_fm_has(found, 1);
  if (has_train) *has_train = train;
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "Fashion-MNIST: using '%s' (%s)", found,
          train ? "train and test splits" : "test split only");
  return DTRAIN_OK;
#endif
}

DTRAIN_API dt_result dt_fashion_mnist_load(const char *dir, dt_dataset **train, dt_dataset **test) {
  if (train) *train = NULL;
  if (!test) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fashion_mnist_load: test is NULL");
  *test = NULL;
#ifdef DTRAIN_NO_STDIO
  (void)dir;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fashion_mnist_load: file I/O is not available in this build (DTRAIN_NO_STDIO)");
#else
  char d[1024], ip[1100], lp[1100];
  int has_train = 0;
  dt_result r = dt_fashion_mnist_find(dir, d, sizeof d, &has_train);
  if (r != DTRAIN_OK) return r;
  dt__data_fm_file(d, "t10k-images-idx3-ubyte", ip, sizeof ip);
  dt__data_fm_file(d, "t10k-labels-idx1-ubyte", lp, sizeof lp);
  r = dt_dataset_read_idx(test, ip, lp, 0);
  if (r == DTRAIN_OK && train && has_train) {
    dt__data_fm_file(d, "train-images-idx3-ubyte", ip, sizeof ip);
    dt__data_fm_file(d, "train-labels-idx1-ubyte", lp, sizeof lp);
    r = dt_dataset_read_idx(train, ip, lp, 0);
    if (r != DTRAIN_OK) {
      dt_dataset_destroy(*test);
      *test = NULL;
    }
  }
  return r;
#endif
}

/* ---- CSV ------------------------------------------------------------------------------------------ */

typedef struct dt__data_csv {
  const char *ctx;
  const char *p, *end, *next;
  char delim;
  int header, has_labels;
  int64_t label_col; /* resolved once the column count is known */
  int64_t rows, cols;
} dt__data_csv;

/* One pass over the text. With ds NULL it validates and counts rows and
 * columns; with ds it stores the values (the first pass succeeded, so every
 * row has c->cols fields). */
static dt_result dt__data_csv_pass(dt__data_csv *c, dt_dataset *ds) {
  const char *p = c->p;
  int64_t line = 0, row = 0, first_line = 0;
  int skipped_header = 0;
  if (c->end - p >= 3 && (unsigned char)p[0] == 0xEF && (unsigned char)p[1] == 0xBB && (unsigned char)p[2] == 0xBF)
    p += 3; /* UTF-8 byte order mark */
  for (; p < c->end; p = c->next) {
    const char *eol = (const char *)memchr(p, '\n', (size_t)(c->end - p));
    const char *le = eol ? eol : c->end;
    c->next = eol ? eol + 1 : c->end;
    line++;
    if (le > p && le[-1] == '\r') le--;
    const char *q = p;
    while (q < le && (*q == ' ' || *q == '\t')) q++;
    if (q == le) continue; /* blank line */
    if (c->header && !skipped_header) {
      skipped_header = 1;
      continue;
    }
    /* Same number of fields as the first row? */
    int64_t nfields = 1;
    for (q = p; q < le; q++) nfields += *q == c->delim;
    if (row == 0 && !ds) {
      c->cols = nfields;
      first_line = line;
    } else if (nfields != c->cols) {
      return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld has %lld fields, expected %lld (as on line %lld)", c->ctx,
                       (long long)line, (long long)nfields, (long long)c->cols, (long long)first_line);
    }
    const char *hint = (row == 0 && !c->header) ? " (is it a header? set dt_csv_desc.header)" : "";
    const char *f = p;
    for (int64_t col = 0; col < nfields; col++) {
      const char *fe = f;
      while (fe < le && *fe != c->delim) fe++;
      const char *a = f, *b = fe;
      f = fe + 1;
      while (a < b && (*a == ' ' || *a == '\t')) a++;
      while (b > a && (b[-1] == ' ' || b[-1] == '\t')) b--;
      char buf[72];
      size_t flen = (size_t)(b - a);
      if (flen == 0)
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: empty field%s", c->ctx, (long long)line,
                         (long long)col + 1, hint);
      if (flen >= sizeof buf)
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: a field of %zu characters is not a number",
                         c->ctx, (long long)line, (long long)col + 1, flen);
      memcpy(buf, a, flen);
      buf[flen] = '\0';
      char *stop = NULL;
      double v = strtod(buf, &stop);
      if (stop != buf + flen || !isfinite(v))
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: '%s' is not a finite number%s", c->ctx,
                         (long long)line, (long long)col + 1, buf, hint);
      if (!ds) continue;
      if (c->has_labels && col == c->label_col) {
        if (v < 0 || v > (double)INT32_MAX || v != floor(v))
          return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: label '%s' is not an integer in [0, %d]",
                           c->ctx, (long long)line, (long long)col + 1, buf, INT32_MAX);
        ds->y[row] = (int32_t)v;
      } else {
        int64_t fi = (c->has_labels && col > c->label_col) ? col - 1 : col;
        ds->x[row * ds->sample_size + fi] = (float)v;
      }
    }
    row++;
  }
  c->rows = row;
  return DTRAIN_OK;
}

static dt_result dt__data_csv_parse(const char *ctx, dt_dataset **out, const char *text, size_t len,
                                    const dt_csv_desc *desc) {
  dt__data_csv c;
  dt_csv_desc zero;
  memset(&zero, 0, sizeof zero);
  if (!desc) desc = &zero;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  c.p = text;
  c.end = text + len;
  c.delim = desc->delimiter ? desc->delimiter : ',';
  c.header = desc->header != 0;
  c.has_labels = desc->has_labels != 0;
  if (c.delim == '\n' || c.delim == '\r' || c.delim == ' ' || c.delim == '"' || c.delim == '.' || c.delim == '-' ||
      c.delim == '+' || (c.delim >= '0' && c.delim <= '9'))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: delimiter 0x%02x is not usable", ctx, (unsigned)(unsigned char)c.delim);
  dt_result r = dt__data_csv_pass(&c, NULL);
  if (r != DTRAIN_OK) return r;
  if (c.rows == 0) return dt__error(DTRAIN_ERR_EMPTY, "%s: no data rows", ctx);
  if (c.has_labels) {
    int64_t lc = desc->label_column < 0 ? c.cols + desc->label_column : desc->label_column;
    if (lc < 0 || lc >= c.cols)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: label_column %d is out of range for %lld columns", ctx,
                       desc->label_column, (long long)c.cols);
    if (c.cols < 2) return dt__error(DTRAIN_ERR_FORMAT, "%s: 1 column holds the labels, none is left for features", ctx);
    c.label_col = lc;
  }
  int64_t nf = c.cols - (c.has_labels ? 1 : 0);
  dt_dataset *ds;
  r = dt__data_ds_new(ctx, &ds, c.rows, 1, &nf, c.has_labels);
  if (r != DTRAIN_OK) return r;
  r = dt__data_csv_pass(&c, ds);
  if (r == DTRAIN_OK && c.has_labels) r = dt__data_set_classes(ctx, ds);
  if (r != DTRAIN_OK) {
    dt_dataset_destroy(ds);
    return r;
  }
  *out = ds;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_csv: out is NULL");
  *out = NULL;
  if (!text) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_csv: text is NULL");
  return dt__data_csv_parse("dt_dataset_parse_csv", out, text, len, desc);
}

DTRAIN_API dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_csv: out is NULL");
  *out = NULL;
  dt_bytes b;
  dt_result r = dt__data_load("dt_dataset_read_csv", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_dataset_read_csv: '%s'", path);
  r = dt__data_csv_parse(ctx, out, (const char *)b.data, b.size, desc);
  dt_bytes_free(&b);
  return r;
}

/* ---- NPY ---------------------------------------------------------------------------------------------
 *   "\x93NUMPY" major minor HEADER_LEN (u16 LE in 1.0, u32 LE in 2.0/3.0)
 *   header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *           padded with spaces and ended by '\n'; then the data, C order. */

static int dt__data_host_le(void) {
  uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

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
      int file_le = bo == '<' || (bo == '=' && dt__data_host_le());
      *swap = a->dtype != DTRAIN_NPY_U8 && file_le != dt__data_host_le();
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

static dt_result dt__data_npy_parse(const char *ctx, const unsigned char *p, size_t len, dt_npy *out) {
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
  dt_result r = dt__data_load("dt_npy_read", path, 1, &b);
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
  if (w > 1 && !dt__data_host_le()) dt__data_swap(buf + 10 + hl, count, w);
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
    FILE *f = fopen(path, "wb");
    if (!f) {
      r = dt__error(DTRAIN_ERR_IO, "dt_npy_write: cannot create '%s': %s", path, strerror(errno));
    } else {
      errno = 0;
      size_t put = fwrite(buf, 1, total, f);
      int e = errno;
      int bad = put != total || fflush(f) != 0;
      if (fclose(f) != 0) bad = 1;
      if (bad) {
        remove(path);
        r = dt__error(DTRAIN_ERR_IO, "dt_npy_write: cannot write '%s': %s", path, e ? strerror(e) : "write error");
      }
    }
  }
  dt__free(buf, total);
  return r;
#endif
}

DTRAIN_API dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags) {
  const char *who = "dt_dataset_from_npy";
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

/* ---- text corpora -------------------------------------------------------------------------------------- */

DTRAIN_API void dt_text_free(dt_text *t) {
  if (!t) return;
  dt__free(t->ids, t->bytes_);
  memset(t, 0, sizeof *t);
}

static dt_result dt__data_text(const char *ctx, const unsigned char *p, size_t len, dt_text *out) {
  memset(out, 0, sizeof *out);
  if (len == 0) return dt__error(DTRAIN_ERR_EMPTY, "%s: the text is empty", ctx);
  size_t bytes;
  if (len > (size_t)INT64_MAX || !dt__mul_size(len, sizeof(int32_t), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: text of %zu bytes is too long", ctx, len);
  int present[256] = {0};
  for (size_t i = 0; i < len; i++) present[p[i]] = 1;
  for (int b = 0; b < 256; b++) {
    out->id_of[b] = -1;
    if (present[b]) {
      out->id_of[b] = (int16_t)out->vocab_size;
      out->vocab[out->vocab_size++] = (unsigned char)b;
    }
  }
  out->ids = (int32_t *)dt__alloc(bytes);
  if (!out->ids) {
    memset(out, 0, sizeof *out);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, bytes);
  }
  for (size_t i = 0; i < len; i++) out->ids[i] = out->id_of[p[i]];
  out->n = (int64_t)len;
  out->bytes_ = bytes;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_parse(const void *buf, size_t len, dt_text *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_parse: buf is NULL");
  return dt__data_text("dt_text_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_text_read(const char *path, dt_text *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_text_read", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_text_read: '%s'", path);
  r = dt__data_text(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

DTRAIN_API dt_result dt_text_encode(const dt_text *t, const char *s, size_t len, int32_t *ids) {
  if (!t || (!s && len) || (!ids && len))
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_encode: %s is NULL", !t ? "t" : !s ? "s" : "ids");
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (t->id_of[c] < 0)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_encode: byte 0x%02x ('%c') at offset %zu is not in the vocabulary",
                       (unsigned)c, (c >= 32 && c < 127) ? (char)c : '?', i);
    ids[i] = t->id_of[c];
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_decode(const dt_text *t, const int32_t *ids, int64_t n, char *out, size_t cap) {
  if (!t || (!ids && n > 0) || !out)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_decode: %s is NULL", !t ? "t" : !out ? "out" : "ids");
  if (n < 0 || (uint64_t)n >= cap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_decode: %lld ids need %lld bytes, out has %zu", (long long)n,
                     (long long)n + 1, cap);
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= t->vocab_size) {
      out[0] = '\0';
      return dt__error(DTRAIN_ERR_INDEX, "dt_text_decode: id %d at %lld is not in [0, %d)", (int)ids[i], (long long)i,
                       t->vocab_size);
    }
    out[i] = (char)t->vocab[ids[i]];
  }
  out[n] = '\0';
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_sample(const dt_text *t, int64_t begin, int64_t end, dt_rng *rng, int64_t batch,
                                    int64_t seq_len, int32_t *x, int32_t *y) {
  if (!t || !rng || !x || !y)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_sample: %s is NULL", !t ? "t" : !rng ? "rng" : !x ? "x" : "y");
  if (batch < 1 || seq_len < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_sample: batch %lld and seq_len %lld must be >= 1", (long long)batch,
                     (long long)seq_len);
  if (begin < 0 || end > t->n || end - begin <= seq_len)
    return dt__error(DTRAIN_ERR_INDEX, "dt_text_sample: range [%lld, %lld) of a %lld-id text cannot hold a window of %lld + 1",
                     (long long)begin, (long long)end, (long long)t->n, (long long)seq_len);
  uint64_t starts = (uint64_t)(end - begin - seq_len);
  for (int64_t b = 0; b < batch; b++) {
    int64_t s = begin + (int64_t)dt_rng_below(rng, starts);
    memcpy(x + b * seq_len, t->ids + s, (size_t)seq_len * sizeof(int32_t));
    memcpy(y + b * seq_len, t->ids + s + 1, (size_t)seq_len * sizeof(int32_t));
  }
  return DTRAIN_OK;
}

/* ---- loader ----------------------------------------------------------------------------------------------- */

struct dt_loader {
  const dt_dataset *ds;
  int64_t batch_size;
  uint64_t seed;
  int shuffle, drop_last, shard, shards;
  int64_t shard_n;            /* samples of this shard per epoch */
  int64_t epoch, index;       /* the position */
  int64_t *perm;              /* the permutation of perm_epoch (shuffle only) */
  int64_t perm_epoch;
  size_t perm_bytes;
  float *bx;                  /* batch buffers, allocated once */
  int32_t *by;
  int64_t *bidx;
  size_t bx_bytes, by_bytes, bidx_bytes;
};

DTRAIN_API void dt_loader_destroy(dt_loader *l) {
  if (!l) return;
  dt__free(l->perm, l->perm_bytes);
  dt__free(l->bx, l->bx_bytes);
  dt__free(l->by, l->by_bytes);
  dt__free(l->bidx, l->bidx_bytes);
  dt__free(l, sizeof *l);
}

DTRAIN_API dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_desc *desc) {
  const char *who = "dt_loader_create";
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!ds || !desc) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", who, ds ? "desc" : "ds");
  if (!ds->x || ds->n < 1 || ds->sample_size < 1 || ds->ndim < 1 || ds->ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: the dataset is empty or malformed", who);
  int shards = desc->shard_count ? desc->shard_count : 1;
  if (desc->batch_size < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: batch_size %lld must be >= 1", who, (long long)desc->batch_size);
  if (shards < 1 || desc->shard_index < 0 || desc->shard_index >= shards)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: shard %d of %d is not valid (need 0 <= shard_index < shard_count)", who,
                     desc->shard_index, shards);
  if ((int64_t)shards > ds->n)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d shards of %lld samples would leave shard(s) empty", who, shards,
                     (long long)ds->n);
  size_t bs = (size_t)desc->batch_size, row = (size_t)ds->sample_size, bx_bytes;
  if ((uint64_t)desc->batch_size > SIZE_MAX / sizeof(int64_t) || !dt__mul_size(bs, row, &bx_bytes) ||
      !dt__mul_size(bx_bytes, sizeof(float), &bx_bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: batch of %lld samples overflows", who, (long long)desc->batch_size);
  dt_loader *l = (dt_loader *)dt__calloc(sizeof *l);
  if (!l) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", who);
  l->ds = ds;
  l->batch_size = desc->batch_size;
  l->seed = desc->seed;
  l->shuffle = desc->shuffle != 0;
  l->drop_last = desc->drop_last != 0;
  l->shard = desc->shard_index;
  l->shards = shards;
  l->shard_n = ds->n / shards + (desc->shard_index < ds->n % shards ? 1 : 0);
  l->perm_epoch = -1;
  l->bx_bytes = bx_bytes;
  l->by_bytes = ds->y ? bs * sizeof(int32_t) : 0;
  l->bidx_bytes = bs * sizeof(int64_t);
  l->perm_bytes = l->shuffle ? (size_t)ds->n * sizeof(int64_t) : 0;
  l->bx = (float *)dt__alloc(l->bx_bytes);
  l->by = ds->y ? (int32_t *)dt__alloc(l->by_bytes) : NULL;
  l->bidx = (int64_t *)dt__alloc(l->bidx_bytes);
  l->perm = l->shuffle ? (int64_t *)dt__alloc(l->perm_bytes) : NULL;
  if (!l->bx || (ds->y && !l->by) || !l->bidx || (l->shuffle && !l->perm)) {
    dt_loader_destroy(l);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory for batch buffers", who);
  }
  *out = l;
  return DTRAIN_OK;
}

/* The permutation of epoch e depends on (seed, e) only: the RNG is seeded
 * from a hash of both, then Fisher-Yates runs over 0..n-1. */
static void dt__data_loader_perm(dt_loader *l, int64_t epoch) {
  if (!l->shuffle || l->perm_epoch == epoch) return;
  uint64_t st = l->seed;
  uint64_t k = dt__splitmix64(&st);
  st = k ^ ((uint64_t)epoch * 0xD1B54A32D192ED03ULL);
  dt_rng rng;
  dt_rng_seed(&rng, dt__splitmix64(&st));
  int64_t n = l->ds->n;
  for (int64_t i = 0; i < n; i++) l->perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)dt_rng_below(&rng, (uint64_t)i + 1);
    int64_t t = l->perm[i];
    l->perm[i] = l->perm[j];
    l->perm[j] = t;
  }
  l->perm_epoch = epoch;
}

DTRAIN_API int64_t dt_loader_sample_at(dt_loader *l, int64_t epoch, int64_t index) {
  if (!l || epoch < 0 || index < 0 || index >= l->shard_n) return -1;
  int64_t g = (int64_t)l->shard + index * (int64_t)l->shards; /* position in the epoch's order */
  if (!l->shuffle) return g;
  dt__data_loader_perm(l, epoch);
  return l->perm[g];
}

DTRAIN_API int dt_loader_next(dt_loader *l, dt_batch *b) {
  if (!l || !b) return (int)dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_next: %s is NULL", l ? "b" : "l");
  int64_t left = l->shard_n - l->index;
  if (left <= 0 || (l->drop_last && left < l->batch_size)) {
    l->epoch++;
    l->index = 0;
    return 0;
  }
  const dt_dataset *ds = l->ds;
  int64_t cnt = DT__MIN(left, l->batch_size);
  size_t row = (size_t)ds->sample_size;
  dt__data_loader_perm(l, l->epoch);
  for (int64_t j = 0; j < cnt; j++) {
    int64_t g = (int64_t)l->shard + (l->index + j) * (int64_t)l->shards;
    int64_t s = l->shuffle ? l->perm[g] : g;
    memcpy(l->bx + (size_t)j * row, ds->x + (size_t)s * row, row * sizeof(float));
    if (l->by) l->by[j] = ds->y[s];
    l->bidx[j] = s;
  }
  b->x = l->bx;
  b->y = l->by;
  b->index = l->bidx;
  b->size = cnt;
  b->ndim = 1 + ds->ndim;
  b->shape[0] = cnt;
  for (int d = 1; d < DTRAIN_MAX_DIMS; d++) b->shape[d] = d - 1 < ds->ndim ? ds->shape[d - 1] : 1;
  b->epoch = l->epoch;
  b->start = l->index;
  l->index += cnt;
  return 1;
}

DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index) {
  if (epoch) *epoch = l ? l->epoch : 0;
  if (index) *index = l ? l->index : 0;
}

DTRAIN_API dt_result dt_loader_set_position(dt_loader *l, int64_t epoch, int64_t index) {
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_set_position: l is NULL");
  if (epoch < 0 || index < 0 || index > l->shard_n)
    return dt__error(DTRAIN_ERR_INDEX, "dt_loader_set_position: (epoch %lld, index %lld) is out of range (index 0..%lld)",
                     (long long)epoch, (long long)index, (long long)l->shard_n);
  l->epoch = epoch;
  l->index = index;
  return DTRAIN_OK;
}

DTRAIN_API int64_t dt_loader_num_samples(const dt_loader *l) { return l ? l->shard_n : 0; }

DTRAIN_API int64_t dt_loader_num_batches(const dt_loader *l) {
  if (!l) return 0;
  return l->drop_last ? l->shard_n / l->batch_size : (l->shard_n + l->batch_size - 1) / l->batch_size;
}

#undef DT__DATA_CTX
#undef DT__DATA_FM_SYSTEM
#undef DT__DATA_FM_SHIPPED
