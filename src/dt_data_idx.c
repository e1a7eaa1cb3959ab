/* ===========================================================================
 * dt_data_idx.c -- IDX files and Fashion-MNIST
 * ===========================================================================
 * IDX (the MNIST format): magic 00 00 08 NDIM, NDIM big-endian u32 sizes,
 * then the unsigned bytes. Datasets from an image file and a label file;
 * Fashion-MNIST found in the usual places.
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

#define DT__DATA_FM_SYSTEM "/usr/share/datasets/fashion-mnist"
#define DT__DATA_FM_SHIPPED "data/fashion-mnist"

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

/* The IDX header's size check for dt__data_load (dt_data_core.h): the
 * header's own errors, then the bytes the file must have. */
DTRAIN_PRIVATE dt_result dt__data_idx_size(const char *ctx, const unsigned char *p, size_t len, uint64_t *need) {
  *need = 0;
  if (len < 4) return DTRAIN_OK; /* the parser names the truncation */
  if (p[0] != 0 || p[1] != 0 || p[2] != 0x08 || p[3] < 1 || p[3] > DTRAIN_MAX_DIMS) {
    int nd;
    int64_t shape[DTRAIN_MAX_DIMS], size;
    size_t off;
    return dt__data_idx_header(ctx, p, len, &nd, shape, &size, &off); /* its FORMAT error */
  }
  size_t hdr = 4 + 4 * (size_t)p[3];
  if (len < hdr) return DTRAIN_OK;
  uint64_t total = 1;
  for (int d = 0; d < p[3]; d++) {
    uint64_t v = dt__get_be32(p + 4 + 4 * d);
    if (v == 0) return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX dimension %d is 0", ctx, d);
    if (total > (UINT64_MAX - hdr) / v)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: IDX header claims a size that overflows", ctx);
    total *= v;
  }
  *need = (uint64_t)hdr + total;
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
  dt_result r = dt__data_load("dt_idx_read", path, 1, dt__data_idx_size, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_idx_read: '%s'", path);
  r = dt__data_idx_parse(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
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

/* who: the public function called, for the messages. */
static dt_result dt__data_parse_idx(const char *who, dt_dataset **out, const void *images, size_t images_len,
                                    const void *labels, size_t labels_len, unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!images) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: images is NULL", who);
  if (!labels && labels_len) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: labels is NULL", who);
  char ictx[DT__DATA_CTX], lctx[DT__DATA_CTX];
  snprintf(ictx, sizeof ictx, "%s: images", who);
  snprintf(lctx, sizeof lctx, "%s: labels", who);
  return dt__data_from_idx(ictx, lctx, out,
                           (const unsigned char *)images, images_len, (const unsigned char *)labels, labels_len,
                           labels != NULL && labels_len > 0, flags);
}

DTRAIN_API dt_dataset *dt_dataset_from_idx(const void *images, size_t images_len, const void *labels,
                                           size_t labels_len, unsigned flags) {
  dt_dataset *ds;
  return dt__data_parse_idx("dt_dataset_from_idx", &ds, images, images_len, labels, labels_len, flags) == DTRAIN_OK
             ? ds
             : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len, const void *labels,
                                          size_t labels_len, unsigned flags) {
  return dt__data_parse_idx("dt_dataset_parse_idx", out, images, images_len, labels, labels_len, flags);
}

/* who: the public function called, for the messages. */
static dt_result dt__data_read_idx(const char *who, dt_dataset **out, const char *images_path,
                                   const char *labels_path, unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!images_path) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: images_path is NULL", who);
  dt_bytes ib, lb;
  memset(&lb, 0, sizeof lb);
  dt_result r = dt__data_load(who, images_path, 1, dt__data_idx_size, &ib);
  if (r != DTRAIN_OK) return r;
  if (labels_path) r = dt__data_load(who, labels_path, 1, dt__data_idx_size, &lb);
  if (r == DTRAIN_OK) {
    char ictx[DT__DATA_CTX], lctx[DT__DATA_CTX];
    snprintf(ictx, sizeof ictx, "%s: '%s'", who, images_path);
    snprintf(lctx, sizeof lctx, "%s: '%s'", who, labels_path ? labels_path : "");
    r = dt__data_from_idx(ictx, lctx, out, ib.data, ib.size, lb.data, lb.size, labels_path != NULL, flags);
  }
  dt_bytes_free(&ib);
  dt_bytes_free(&lb);
  return r;
}

DTRAIN_API dt_dataset *dt_dataset_load_idx(const char *images_path, const char *labels_path, unsigned flags) {
  dt_dataset *ds;
  return dt__data_read_idx("dt_dataset_load_idx", &ds, images_path, labels_path, flags) == DTRAIN_OK ? ds : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path,
                                         unsigned flags) {
  return dt__data_read_idx("dt_dataset_read_idx", out, images_path, labels_path, flags);
}

/* ---- Fashion-MNIST ------------------------------------------------------------------------------ */

#ifndef DTRAIN_NO_STDIO
/* Path of dir/base.gz or dir/base, whichever exists (gz first); 0 if neither. */
static int dt__data_fm_file(const char *dir, const char *base, char *path, size_t cap) {
  for (int gz = 1; gz >= 0; gz--) {
    int n = snprintf(path, cap, "%s/%s%s", dir, base, gz ? ".gz" : "");
    if (n < 0 || (size_t)n >= cap) return 0;
    /* A regular file only: opening a FIFO planted here must not block. */
    FILE *f;
    uint64_t size;
    char why[160];
    if (dt__file_open_read(path, &f, &size, why, sizeof why) == DTRAIN_OK) {
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
  r = dt__data_read_idx("dt_fashion_mnist_load", test, ip, lp, 0);
  if (r == DTRAIN_OK && train && has_train) {
    dt__data_fm_file(d, "train-images-idx3-ubyte", ip, sizeof ip);
    dt__data_fm_file(d, "train-labels-idx1-ubyte", lp, sizeof lp);
    r = dt__data_read_idx("dt_fashion_mnist_load", train, ip, lp, 0);
    if (r != DTRAIN_OK) {
      dt_dataset_destroy(*test);
      *test = NULL;
    }
  }
  return r;
#endif
}

#undef DT__DATA_FM_SYSTEM
#undef DT__DATA_FM_SHIPPED

#else /* DTRAIN_NO_DATA: every entry point says so */

DTRAIN_API void dt_idx_free(dt_idx *a) { (void)a; }
DTRAIN_API dt_result dt_idx_parse(const void *buf, size_t len, dt_idx *out) {
  (void)buf; (void)len; (void)out;
  return dt__data_compiled_out("dt_idx_parse");
}
DTRAIN_API dt_result dt_idx_read(const char *path, dt_idx *out) {
  (void)path; (void)out;
  return dt__data_compiled_out("dt_idx_read");
}
DTRAIN_API dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len, const void *labels,
                                          size_t labels_len, unsigned flags) {
  (void)images; (void)images_len; (void)labels; (void)labels_len; (void)flags;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_parse_idx");
}
DTRAIN_API dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path,
                                         unsigned flags) {
  (void)images_path; (void)labels_path; (void)flags;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_read_idx");
}
DTRAIN_API dt_dataset *dt_dataset_from_idx(const void *images, size_t images_len, const void *labels,
                                           size_t labels_len, unsigned flags) {
  (void)images; (void)images_len; (void)labels; (void)labels_len; (void)flags;
  dt__data_compiled_out("dt_dataset_from_idx");
  return NULL;
}
DTRAIN_API dt_dataset *dt_dataset_load_idx(const char *images_path, const char *labels_path, unsigned flags) {
  (void)images_path; (void)labels_path; (void)flags;
  dt__data_compiled_out("dt_dataset_load_idx");
  return NULL;
}
DTRAIN_API dt_result dt_fashion_mnist_find(const char *dir, char *out, size_t cap, int *has_train) {
  (void)dir; (void)out; (void)cap; (void)has_train;
  return dt__data_compiled_out("dt_fashion_mnist_find");
}
DTRAIN_API dt_result dt_fashion_mnist_load(const char *dir, dt_dataset **train, dt_dataset **test) {
  (void)dir;
  if (train) *train = NULL;
  if (test) *test = NULL;
  return dt__data_compiled_out("dt_fashion_mnist_load");
}

#endif /* DTRAIN_NO_DATA */
