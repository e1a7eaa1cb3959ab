/* ===========================================================================
 * dt_data.c -- files, datasets, the batch loader
 * ===========================================================================
 * The parsers (dt_data_idx.c, dt_data_npy.c, dt_data_text.c) work on bytes
 * in memory; the file functions here read the whole file (a .gz is inflated
 * as it is read, in chunks, by dt_inflate.c) and hand the bytes to them.
 * Every size a header claims is checked against the bytes that are really
 * there before anything is allocated for it.
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

static int dt__data_is_gzip(const unsigned char *p, size_t len) { return len >= 2 && p[0] == 0x1f && p[1] == 0x8b; }

/* ---- files ---------------------------------------------------------------------------- */

#ifndef DTRAIN_NO_STDIO
#define DT__DATA_PREFIX 65536 /* bytes read (or inflated) first, to check a header */

/* n bytes of f (from where it is) appended to a new buffer of cap n + 1. */
static dt_result dt__data_read_n(const char *who, const char *path, FILE *f, const unsigned char *head, size_t nhead,
                                 uint64_t n64, dt_bytes *out) {
  char why[200];
  if (n64 > (uint64_t)(SIZE_MAX - 1))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: '%s': file of %llu bytes is too large for memory", who, path,
                     (unsigned long long)n64);
  size_t n = (size_t)n64;
  out->cap = n + 1;
  out->data = (unsigned char *)dt__alloc(out->cap);
  if (!out->data) {
    out->cap = 0;
    return dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory (%zu bytes)", who, path, n + 1);
  }
  memcpy(out->data, head, nhead);
  if (!dt__file_read_exact(f, out->data + nhead, n - nhead, why, sizeof why)) {
    dt_bytes_free(out);
    return dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, why);
  }
  out->size = n;
  out->data[n] = 0;
  return DTRAIN_OK;
}

/* The file is opened as a regular file only (a FIFO, /dev/zero, a directory
 * are refused without blocking, dt_file.h); its first bytes are read first
 * and, with a sizer, the header they hold decides how much more may be read
 * (the rest of a raw file must be exactly what the header describes) or
 * inflated (a .gz never decompresses past the size its header describes). */
static dt_result dt__data_read(const char *who, const char *path, int gz, dt__data_sizer sizer, dt_bytes *out) {
  char why[200], ctx[DT__DATA_CTX];
  FILE *f;
  uint64_t size;
  unsigned char *head = NULL;
  uint64_t need = 0; /* the bytes the header describes (0: unknown) */
  int zipped = 0;
  dt_bytes pre;
  memset(&pre, 0, sizeof pre);
  dt_result r = dt__file_open_read(path, &f, &size, why, sizeof why);
  if (r != DTRAIN_OK) {
    if (strncmp(why, "cannot open: ", 13) == 0) return dt__error(r, "%s: cannot open '%s': %s", who, path, why + 13);
    return dt__error(r, "%s: '%s': %s", who, path, why);
  }
  snprintf(ctx, sizeof ctx, "%s: '%s'", who, path);
  size_t nhead = size < DT__DATA_PREFIX ? (size_t)size : DT__DATA_PREFIX;
  head = (unsigned char *)dt__alloc(nhead + 1);
  if (!head) {
    fclose(f);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", ctx);
  }
  if (!dt__file_read_exact(f, head, nhead, why, sizeof why)) {
    r = dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, why);
    goto done;
  }
  zipped = gz && dt__data_is_gzip(head, nhead);
  if (sizer && zipped) {
    r = dt__gunzip_prefix(head, nhead, DT__DATA_PREFIX, &pre);
    if (r != DTRAIN_OK) {
      r = dt__error(r, "%s: out of memory", ctx);
      goto done;
    }
    r = sizer(ctx, pre.data, pre.size, &need);
    /* Deflate never grows data by more than 5 bytes per 16 KiB stored block
     * (plus gzip's header and trailer): a .gz much larger than the bytes its
     * header describes is refused before the rest of it is read. */
    if (r == DTRAIN_OK && need > 0 && size > need + need / 64 + 65536)
      r = dt__error(DTRAIN_ERR_CORRUPT,
                    "%s: the compressed file has %llu bytes, more than the %llu bytes its header describes can take",
                    ctx, (unsigned long long)size, (unsigned long long)need);
  } else if (sizer) {
    r = sizer(ctx, head, nhead, &need);
    /* More bytes than the header describes: refused before reading them (a
     * huge or sparse file behind a small header). Fewer: the parser names
     * the truncation. */
    if (r == DTRAIN_OK && need > 0 && size > need)
      r = dt__error(DTRAIN_ERR_CORRUPT, "%s: the file has %llu bytes but its header describes %llu (%llu after the data)",
                    ctx, (unsigned long long)size, (unsigned long long)need, (unsigned long long)(size - need));
  }
  if (r != DTRAIN_OK) goto done;
  if (!zipped) {
    r = dt__data_read_n(who, path, f, head, nhead, size, out);
    goto done;
  }
  if (need > (uint64_t)(SIZE_MAX - 2)) {
    r = dt__error(DTRAIN_ERR_OVERFLOW, "%s: its header describes %llu bytes, too large for memory", ctx,
                  (unsigned long long)need);
    goto done;
  }
  /* The compressed bytes are streamed from the file (dt__gunzip_file reads
   * it again from the start, in chunks): only the output, capped at the
   * header's size, is held whole. The first bytes are not needed now. */
  dt__free(head, nhead + 1);
  head = NULL;
  dt_bytes_free(&pre);
  /* need 0 (no header, or none could be read): the default limit. */
  r = dt__gunzip_file(ctx, f, size, (size_t)need, out);
  if (r != DTRAIN_OK) dt_bytes_free(out);
done:
  fclose(f);
  if (head) dt__free(head, nhead + 1);
  dt_bytes_free(&pre);
  return r;
}
#undef DT__DATA_PREFIX
#endif

/* Whole file; gunzipped when gz and the data has the gzip magic. */
DTRAIN_PRIVATE dt_result dt__data_load(const char *who, const char *path, int gz, dt__data_sizer sizer, dt_bytes *out) {
  memset(out, 0, sizeof *out);
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: path is NULL", who);
#ifdef DTRAIN_NO_STDIO
  (void)gz;
  (void)sizer;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "%s: file I/O is not available in this build (DTRAIN_NO_STDIO); parse from memory instead", who);
#else
  return dt__data_read(who, path, gz, sizer, out);
#endif
}

DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file: out is NULL");
  return dt__data_load("dt_read_file", path, 0, NULL, out);
}

DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file_gz: out is NULL");
  return dt__data_load("dt_read_file_gz", path, 1, NULL, out);
}

/* Bytes of a parse_* input, gunzipped into tmp when they are gzip data. */
DTRAIN_PRIVATE dt_result dt__data_maybe_gunzip(const char *ctx, const unsigned char **p, size_t *len, dt_bytes *tmp) {
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

DTRAIN_PRIVATE dt_result dt__data_ds_new(const char *who, dt_dataset **out, int64_t n, int ndim, const int64_t *shape,
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

DTRAIN_API dt_dataset *dt_dataset_new(int64_t n, int ndim, const int64_t *sample_shape, int with_labels) {
  dt_dataset *ds;
  return dt__data_ds_new("dt_dataset_new", &ds, n, ndim, sample_shape, with_labels) == DTRAIN_OK ? ds : NULL;
}

/* Labels must be >= 0; sets num_classes to max + 1. */
DTRAIN_PRIVATE dt_result dt__data_set_classes(const char *who, dt_dataset *ds) {
  int32_t mx = -1;
  for (int64_t i = 0; i < ds->n; i++) {
    if (ds->y[i] < 0)
      return dt__error(DTRAIN_ERR_INDEX, "%s: label %d of sample %lld is negative", who, (int)ds->y[i], (long long)i);
    if (ds->y[i] > mx) mx = ds->y[i];
  }
  ds->num_classes = mx == INT32_MAX ? INT32_MAX : mx + 1;
  return DTRAIN_OK;
}

/* who: the public function called, for the messages. */
static dt_result dt__data_subset(const char *who, const dt_dataset *ds, const int64_t *idx, int64_t count,
                                 dt_dataset **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!ds || !idx) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", who, ds ? "idx" : "ds");
  for (int64_t i = 0; i < count; i++)
    if (idx[i] < 0 || idx[i] >= ds->n)
      return dt__error(DTRAIN_ERR_INDEX, "%s: idx[%lld] = %lld is out of range [0, %lld)", who, (long long)i,
                       (long long)idx[i], (long long)ds->n);
  dt_dataset *s;
  dt_result r = dt__data_ds_new(who, &s, count, ds->ndim, ds->shape, ds->y != NULL);
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

DTRAIN_API dt_dataset *dt_dataset_select(const dt_dataset *ds, const int64_t *idx, int64_t count) {
  dt_dataset *s;
  return dt__data_subset("dt_dataset_select", ds, idx, count, &s) == DTRAIN_OK ? s : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out) {
  return dt__data_subset("dt_dataset_subset", ds, idx, count, out);
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
    r = dt__data_subset("dt_dataset_split", ds, tr, nt, train);
    if (r == DTRAIN_OK) r = dt__data_subset("dt_dataset_split", ds, perm, nv, val);
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

/* who: the public function called, for the messages. */
static dt_result dt__data_loader_create(const char *who, dt_loader **out, const dt_dataset *ds,
                                        const dt_loader_desc *desc) {
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

DTRAIN_API dt_loader *dt_loader_new(const dt_dataset *ds, const dt_loader_options *opts) {
  dt_loader *l;
  return dt__data_loader_create("dt_loader_new", &l, ds, opts) == DTRAIN_OK ? l : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_desc *desc) {
  return dt__data_loader_create("dt_loader_create", out, ds, desc);
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
  if (!l) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_sample_at: loader is NULL");
    return -1;
  }
  if (epoch < 0 || index < 0 || index >= l->shard_n) return -1;
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
  int64_t t0 = dt__prof_t0();
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
  dt__prof_add("dt_loader_next", DTRAIN_PROFILE_DATA, t0);
  return 1;
}

DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index) {
  if (!l) dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_position: loader is NULL");
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

#else /* DTRAIN_NO_DATA: every entry point says so */

DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out) {
  (void)path; (void)out;
  return dt__data_compiled_out("dt_read_file");
}
DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out) {
  (void)path; (void)out;
  return dt__data_compiled_out("dt_read_file_gz");
}
/* Nothing can have made a dataset or a loader: destroying one is a no-op. */
DTRAIN_API void dt_dataset_destroy(dt_dataset *ds) { (void)ds; }
DTRAIN_API dt_result dt_dataset_create(dt_dataset **out, int64_t n, int ndim, const int64_t *sample_shape,
                                       int with_labels) {
  (void)n; (void)ndim; (void)sample_shape; (void)with_labels;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_create");
}
DTRAIN_API dt_dataset *dt_dataset_new(int64_t n, int ndim, const int64_t *sample_shape, int with_labels) {
  (void)n; (void)ndim; (void)sample_shape; (void)with_labels;
  dt__data_compiled_out("dt_dataset_new");
  return NULL;
}
DTRAIN_API dt_dataset *dt_dataset_select(const dt_dataset *ds, const int64_t *idx, int64_t count) {
  (void)ds; (void)idx; (void)count;
  dt__data_compiled_out("dt_dataset_select");
  return NULL;
}
DTRAIN_API dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out) {
  (void)ds; (void)idx; (void)count;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_subset");
}
DTRAIN_API dt_result dt_dataset_split(const dt_dataset *ds, double val_fraction, uint64_t seed, dt_dataset **train,
                                      dt_dataset **val) {
  (void)ds; (void)val_fraction; (void)seed;
  if (train) *train = NULL;
  if (val) *val = NULL;
  return dt__data_compiled_out("dt_dataset_split");
}
DTRAIN_API dt_result dt_dataset_reshape(dt_dataset *ds, int ndim, const int64_t *sample_shape) {
  (void)ds; (void)ndim; (void)sample_shape;
  return dt__data_compiled_out("dt_dataset_reshape");
}
DTRAIN_API void dt_loader_destroy(dt_loader *l) { (void)l; }
DTRAIN_API dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_desc *desc) {
  (void)ds; (void)desc;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_loader_create");
}
DTRAIN_API dt_loader *dt_loader_new(const dt_dataset *ds, const dt_loader_options *opts) {
  (void)ds; (void)opts;
  dt__data_compiled_out("dt_loader_new");
  return NULL;
}
DTRAIN_API int64_t dt_loader_sample_at(dt_loader *l, int64_t epoch, int64_t index) {
  (void)l; (void)epoch; (void)index;
  dt__data_compiled_out("dt_loader_sample_at");
  return -1;
}
DTRAIN_API int dt_loader_next(dt_loader *l, dt_batch *b) {
  (void)l; (void)b;
  return (int)dt__data_compiled_out("dt_loader_next");
}
DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index) {
  (void)l;
  dt__data_compiled_out("dt_loader_position");
  if (epoch) *epoch = 0;
  if (index) *index = 0;
}
DTRAIN_API dt_result dt_loader_set_position(dt_loader *l, int64_t epoch, int64_t index) {
  (void)l; (void)epoch; (void)index;
  return dt__data_compiled_out("dt_loader_set_position");
}
DTRAIN_API int64_t dt_loader_num_samples(const dt_loader *l) {
  (void)l;
  return 0;
}
DTRAIN_API int64_t dt_loader_num_batches(const dt_loader *l) {
  (void)l;
  return 0;
}

#endif /* DTRAIN_NO_DATA */
