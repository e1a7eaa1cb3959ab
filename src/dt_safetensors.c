/* ===========================================================================
 * dt_safetensors.c -- reading safetensors files: the checksum, the strict
 * index (dt_checkpoint_open and friends)
 * ===========================================================================
 * A file's header is read first (its length checked against the file's size
 * and the limit), parsed by the strict JSON reader (dt_json.c) and every
 * entry checked: known dtype, a shape that matches its byte range, ranges
 * that tile the data exactly, unique names. Only then is the data read, and
 * the checksum verified whenever the metadata has one. Checkpoint save and load (dt_checkpoint.c)
 * build on this index.
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
#include "dt_json.h"
#include "dt_safetensors.h"
#include "dt_file.h"

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <sys/stat.h>
#    include <sys/types.h>
#  endif
#endif

#ifndef DTRAIN_NO_STDIO

/* ---- checksum (the format is described in dt_safetensors.h) --------------------------------- */

DTRAIN_PRIVATE void dt__io_hash_init(dt__io_hasher *s) {
  s->h = DT__FNV64_OFFSET;
  s->nc = 0;
}

static void dt__io_hash_word(dt__io_hasher *s, uint64_t w) {
  s->h = (s->h ^ w) * DT__FNV64_PRIME;
  s->h ^= s->h >> 32;
}

DTRAIN_PRIVATE void dt__io_hash(dt__io_hasher *s, const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  while (n > 0 && s->nc > 0) {
    s->carry[s->nc & 7] = *p++; /* nc < 8 always: the carry is hashed when full */
    s->nc++;
    n--;
    if (s->nc == 8) {
      dt__io_hash_word(s, dt__get_le64(s->carry));
      s->nc = 0;
    }
  }
  while (n >= 8) {
    dt__io_hash_word(s, dt__get_le64(p));
    p += 8;
    n -= 8;
  }
  if (n > 0) { /* fewer than 8 left, and the carry is empty (the first loop emptied it or n was 0) */
    memcpy(s->carry, p, n);
    s->nc = (int)n;
  }
}

DTRAIN_PRIVATE void dt__io_hash_u64(dt__io_hasher *s, uint64_t v) {
  unsigned char le[8];
  dt__put_le64(le, v);
  dt__io_hash(s, le, 8);
}

DTRAIN_PRIVATE uint64_t dt__io_hash_final(dt__io_hasher *s) {
  s->h = dt__fnv1a64(s->h, s->carry, (size_t)s->nc); /* the tail bytes one by one */
  s->nc = 0;
  return s->h;
}

/* ---- error context ----------------------------------------------------------------- */

DTRAIN_PRIVATE dt_result dt__io_err(const dt__io_ctx *c, dt_result code, const char *fmt, ...) {
  char buf[DT__MSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return dt__error(code, "%s: '%s': %s", c->fn, c->path, buf);
}

/* ---- the safetensors index ----------------------------------------------------------- */

typedef struct dt__io_dtype {
  const char *name;
  int size;
} dt__io_dtype;

static const dt__io_dtype dt__io_dtypes[] = {
  {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F64", 8}, {"I8", 1}, {"U8", 1}, {"I16", 2}, {"U16", 2},
  {"I32", 4}, {"U32", 4}, {"I64", 8}, {"U64", 8}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

static int dt__io_cmp_entry_off(const void *a, const void *b) {
  const dt__io_entry *x = (const dt__io_entry *)a, *y = (const dt__io_entry *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* qsort context for sorting index arrays by name (qsort has no user pointer). */
static DT__TLS const char *const *dt__io_sort_names;
static int dt__io_cmp_idx_name(const void *a, const void *b) {
  return strcmp(dt__io_sort_names[*(const int *)a], dt__io_sort_names[*(const int *)b]);
}

/* Indices 0..n-1 sorted by names[i]; NULL when out of memory. */
DTRAIN_PRIVATE int *dt__io_sorted_index(const char *const *names, int n) {
  int *idx = (int *)dt__alloc((size_t)(n > 0 ? n : 1) * sizeof(int));
  if (!idx) return NULL;
  for (int i = 0; i < n; i++) idx[i] = i;
  dt__io_sort_names = names;
  if (n > 1) qsort(idx, (size_t)n, sizeof(int), dt__io_cmp_idx_name);
  dt__io_sort_names = NULL;
  return idx;
}

DTRAIN_API void dt_checkpoint_close(dt_checkpoint *c) {
  if (!c) return;
  dt__free(c->file, c->file_cap);
  dt__free(c->data_buf, c->data_cap);
  dt__json_free(&c->json);
  dt__free(c->entries, (size_t)(c->nentries > 0 ? c->nentries : 1) * sizeof(dt__io_entry));
  dt__free(c->by_name, (size_t)(c->nentries > 0 ? c->nentries : 1) * sizeof(int));
  dt__free((void *)c->mkeys, (size_t)(c->nmeta > 0 ? c->nmeta : 1) * sizeof(char *));
  dt__free((void *)c->mvals, (size_t)(c->nmeta > 0 ? c->nmeta : 1) * sizeof(char *));
  dt__free(c, sizeof *c);
}

DTRAIN_PRIVATE const char *dt__io_meta_get(const dt_checkpoint *c, const char *key) {
  for (int i = 0; i < c->nmeta; i++)
    if (strcmp(c->mkeys[i], key) == 0) return c->mvals[i];
  return NULL;
}

DTRAIN_PRIVATE int dt__io_find(const dt_checkpoint *c, const char *name) {
  int lo = 0, hi = c->nentries - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2;
    int r = strcmp(c->entries[c->by_name[mid]].name, name);
    if (r == 0) return c->by_name[mid];
    if (r < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

DTRAIN_PRIVATE void dt__io_hash_index(dt__io_hasher *h, const dt_checkpoint *c, const int *meta_order) {
  for (int k = 0; k < c->nentries; k++) {
    const dt__io_entry *e = &c->entries[c->by_name[k]];
    dt__io_hash(h, e->name, strlen(e->name) + 1);
    dt__io_hash(h, e->dtype, strlen(e->dtype) + 1);
    dt__io_hash_u64(h, (uint64_t)e->ndim);
    for (int d = 0; d < e->ndim; d++) dt__io_hash_u64(h, (uint64_t)e->shape[d]);
    dt__io_hash_u64(h, e->begin);
    dt__io_hash_u64(h, e->end);
  }
  for (int k = 0; k < c->nmeta; k++) {
    int i = meta_order[k];
    if (strcmp(c->mkeys[i], "checksum") == 0) continue;
    dt__io_hash(h, c->mkeys[i], strlen(c->mkeys[i]) + 1);
    dt__io_hash(h, c->mvals[i], strlen(c->mvals[i]) + 1);
  }
}

/* Checksum of an opened file: its index, then its data. */
static uint64_t dt__io_checksum(const dt_checkpoint *c, const int *meta_order) {
  dt__io_hasher h;
  dt__io_hash_init(&h);
  dt__io_hash_index(&h, c, meta_order);
  dt__io_hash(&h, c->data, c->data_size);
  return dt__io_hash_final(&h);
}

DTRAIN_PRIVATE int dt__io_parse_hex64(const char *s, uint64_t *out) {
  uint64_t v = 0;
  if (strlen(s) != 16) return 0;
  for (int i = 0; i < 16; i++) {
    char ch = s[i];
    int d = (ch >= '0' && ch <= '9') ? ch - '0' : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10 : -1;
    if (d < 0) return 0;
    v = (v << 4) | (uint64_t)d;
  }
  *out = v;
  return 1;
}

/* Builds the index of c->file (already read). need_f32: refuse other dtypes
 * at once (FORMAT) instead of listing them. */
static dt_result dt__io_index(dt_checkpoint *c, const dt__io_ctx *ctx, int need_f32) {
  if (c->file_size < 8)
    return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "truncated: %zu bytes, a safetensors file has at least 8", c->file_size);
  uint64_t n = dt__get_le64(c->file);
  if ((n > (uint64_t)(c->file_size - 8) || n > (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER) && c->file_size > 8 &&
      c->file[8] != '{')
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "not a safetensors file (no 8-byte header length followed by '{'; "
                      "read as one, its header length %llu exceeds the file of %zu bytes)", (unsigned long long)n,
                      c->file_size);
  if (n > (uint64_t)(c->file_size - 8))
    return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "header length %llu exceeds the file (%zu bytes: at most %zu)",
                      (unsigned long long)n, c->file_size, c->file_size - 8);
  if (n > (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER)
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "header length %llu exceeds the limit of %d bytes",
                      (unsigned long long)n, DTRAIN_CHECKPOINT_MAX_HEADER);
  if (n < 2 || c->file[8] != '{')
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "not a safetensors file: the header does not start with '{'");
  c->header_len = (size_t)n;
  c->data_size = c->file_size - 8 - c->header_len; /* not read yet: the index is checked against its size */
  dt__json *j = &c->json;
  if (!dt__json_parse(j, c->file + 8, c->header_len, DT__IO_JSON_DEPTH, 0))
    return dt__io_err(ctx, j->nomem ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_FORMAT, "header JSON: %s", j->err);
  const dt__json_val *top = &j->v[0];
  if (top->type != DT__JSON_OBJ) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "header is not a JSON object");

  /* Count members. */
  int nent = 0, nmeta = 0, seen_meta = 0;
  for (int32_t k = top->child; k >= 0; k = j->v[j->v[k].next].next) {
    int32_t val = j->v[k].next;
    if (strcmp(dt__json_str(j, k), "__metadata__") == 0) {
      if (seen_meta++) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate key '__metadata__'");
      if (j->v[val].type != DT__JSON_OBJ)
        return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "'__metadata__' is not an object of strings");
      nmeta = j->v[val].count / 2;
    } else {
      nent++;
    }
  }
  c->entries = (dt__io_entry *)dt__calloc((size_t)(nent > 0 ? nent : 1) * sizeof(dt__io_entry));
  c->mkeys = (const char **)dt__calloc((size_t)(nmeta > 0 ? nmeta : 1) * sizeof(char *));
  c->mvals = (const char **)dt__calloc((size_t)(nmeta > 0 ? nmeta : 1) * sizeof(char *));
  c->nentries = nent;
  c->nmeta = nmeta;
  if (!c->entries || !c->mkeys || !c->mvals) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");

  int ie = 0;
  for (int32_t k = top->child; k >= 0; k = j->v[j->v[k].next].next) {
    const char *key = dt__json_str(j, k);
    int32_t val = j->v[k].next;
    if (strcmp(key, "__metadata__") == 0) {
      int im = 0;
      for (int32_t mk = j->v[val].child; mk >= 0; mk = j->v[j->v[mk].next].next) {
        int32_t mv = j->v[mk].next;
        if (j->v[mv].type != DT__JSON_STR)
          return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata '%s' is not a string", dt__json_str(j, mk));
        c->mkeys[im] = dt__json_str(j, mk);
        c->mvals[im] = dt__json_str(j, mv);
        im++;
      }
      continue;
    }
    dt__io_entry *e = &c->entries[ie++];
    e->name = key;
    if (j->v[val].type != DT__JSON_OBJ)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': entry is not an object", key);
    int32_t fdtype = -1, fshape = -1, foffs = -1;
    for (int32_t fk = j->v[val].child; fk >= 0; fk = j->v[j->v[fk].next].next) {
      const char *f = dt__json_str(j, fk);
      int32_t *slot = strcmp(f, "dtype") == 0 ? &fdtype : strcmp(f, "shape") == 0 ? &fshape
                    : strcmp(f, "data_offsets") == 0 ? &foffs : NULL;
      if (!slot) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': unknown field '%s'", key, f);
      if (*slot >= 0) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': duplicate field '%s'", key, f);
      *slot = j->v[fk].next;
    }
    if (fdtype < 0 || fshape < 0 || foffs < 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': missing field '%s'", key,
                        fdtype < 0 ? "dtype" : fshape < 0 ? "shape" : "data_offsets");
    /* dtype */
    if (j->v[fdtype].type != DT__JSON_STR)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': dtype is not a string", key);
    const char *dt = dt__json_str(j, fdtype);
    e->dtype = NULL;
    for (size_t t = 0; t < sizeof dt__io_dtypes / sizeof dt__io_dtypes[0]; t++)
      if (strcmp(dt, dt__io_dtypes[t].name) == 0) {
        e->dtype = dt__io_dtypes[t].name;
        e->dsize = dt__io_dtypes[t].size;
      }
    if (!e->dtype) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': unknown dtype '%s'", key, dt);
    if (need_f32 && strcmp(e->dtype, "F32") != 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s' has dtype %s; dtrain loads F32 only", key, e->dtype);
    /* shape */
    if (j->v[fshape].type != DT__JSON_ARR)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': shape is not an array", key);
    if (j->v[fshape].count > DTRAIN_MAX_DIMS)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s' has %d dimensions (dtrain reads at most %d)", key,
                        (int)j->v[fshape].count, DTRAIN_MAX_DIMS);
    e->ndim = (int)j->v[fshape].count;
    uint64_t nel = 1;
    int overflow = 0, d = 0;
    for (int32_t sv = j->v[fshape].child; sv >= 0; sv = j->v[sv].next, d++) {
      uint64_t dim;
      if (!dt__json_uint(j, sv, &dim) || dim > (uint64_t)INT64_MAX)
        return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': shape holds a value that is not a size", key);
      e->shape[d] = (int64_t)dim;
      if (dim != 0 && nel > UINT64_MAX / dim) overflow = 1;
      else nel *= dim;
    }
    for (; d < DTRAIN_MAX_DIMS; d++) e->shape[d] = 1;
    /* offsets */
    if (j->v[foffs].type != DT__JSON_ARR || j->v[foffs].count != 2)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': data_offsets is not [begin, end]", key);
    int32_t b0 = j->v[foffs].child, b1 = j->v[b0].next;
    if (!dt__json_uint(j, b0, &e->begin) || !dt__json_uint(j, b1, &e->end))
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': data_offsets hold a value that is not an offset", key);
    if (e->begin > e->end)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': data_offsets [%llu, %llu] end before they begin", key,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > (uint64_t)c->data_size)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT,
                        "tensor '%s': data_offsets [%llu, %llu] out of bounds (the data has %zu bytes; truncated?)",
                        key, (unsigned long long)e->begin, (unsigned long long)e->end, c->data_size);
    if (overflow || nel > UINT64_MAX / (uint64_t)e->dsize || nel * (uint64_t)e->dsize != e->end - e->begin)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': shape of %s needs %s bytes but data_offsets give %llu",
                        key, e->dtype, overflow ? "too many" : "a different number of",
                        (unsigned long long)(e->end - e->begin));
    e->nelem = nel;
  }

  /* Names unique (sorted index), metadata keys unique. */
  {
    const char **names = (const char **)dt__alloc((size_t)(nent > 0 ? nent : 1) * sizeof(char *));
    if (!names) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
    /* Sort entries by offset first, so by_name refers to the final order. */
    if (nent > 1) qsort(c->entries, (size_t)nent, sizeof(dt__io_entry), dt__io_cmp_entry_off);
    for (int i = 0; i < nent; i++) names[i] = c->entries[i].name;
    c->by_name = dt__io_sorted_index(names, nent);
    dt__free((void *)names, (size_t)(nent > 0 ? nent : 1) * sizeof(char *));
    if (!c->by_name) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
  }
  for (int i = 1; i < nent; i++)
    if (strcmp(c->entries[c->by_name[i - 1]].name, c->entries[c->by_name[i]].name) == 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate tensor '%s'", c->entries[c->by_name[i]].name);
  int *morder = dt__io_sorted_index(c->mkeys, nmeta);
  if (!morder) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
  dt_result r = DTRAIN_OK;
  for (int i = 1; i < nmeta && r == DTRAIN_OK; i++)
    if (strcmp(c->mkeys[morder[i - 1]], c->mkeys[morder[i]]) == 0)
      r = dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate metadata key '%s'", c->mkeys[morder[i]]);

  /* Contiguous and covering: sorted by offset, each begins where the last ended. */
  uint64_t at = 0;
  for (int i = 0; i < nent && r == DTRAIN_OK; i++) {
    const dt__io_entry *e = &c->entries[i];
    if (e->begin < at)
      r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s'", e->name,
                     (unsigned long long)e->begin, (unsigned long long)e->end, c->entries[i - 1].name);
    else if (e->begin > at)
      r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "gap in the data: bytes [%llu, %llu) belong to no tensor (before '%s')",
                     (unsigned long long)at, (unsigned long long)e->begin, e->name);
    at = e->end;
  }
  if (r == DTRAIN_OK && at != (uint64_t)c->data_size)
    r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "the tensors cover %llu bytes of data but the file holds %zu",
                   (unsigned long long)at, c->data_size);

  const char *fmt = dt__io_meta_get(c, "format");
  c->is_dtrain = fmt && strcmp(fmt, "dtrain") == 0;
  if (r == DTRAIN_OK && c->is_dtrain && !dt__io_meta_get(c, "checksum"))
    r = dt__io_err(ctx, DTRAIN_ERR_FORMAT, "dtrain checkpoint without metadata 'checksum'");
  dt__free(morder, (size_t)(nmeta > 0 ? nmeta : 1) * sizeof(int));
  return r;
}

/* The checksum, verified whenever the metadata has one (any writer's file,
 * not only dtrain's), once the data is in memory. */
static dt_result dt__io_verify(const dt_checkpoint *c, const dt__io_ctx *ctx) {
  const char *cs = dt__io_meta_get(c, "checksum");
  uint64_t want = 0;
  if (!cs) return DTRAIN_OK;
  if (!dt__io_parse_hex64(cs, &want))
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata 'checksum' is not 16 lowercase hex digits");
  int *morder = dt__io_sorted_index(c->mkeys, c->nmeta);
  if (!morder) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
  uint64_t got = dt__io_checksum(c, morder);
  dt__free(morder, (size_t)(c->nmeta > 0 ? c->nmeta : 1) * sizeof(int));
  if (got != want) return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "checksum mismatch: the header or the data were changed");
  return DTRAIN_OK;
}

/* Opens the file and reads its length and header into c->file (8 + N bytes)
 * -- never more before the header is checked: the header length against the
 * file's size and the limit, then (dt__io_index) every entry against the
 * data's size. Only a regular file is read (a FIFO or a device is refused
 * without blocking). */
static dt_result dt__io_read_header(dt_checkpoint *c, const dt__io_ctx *ctx, FILE **fp) {
  char why[200];
  uint64_t size = 0;
  unsigned char len8[8];
  dt_result r = dt__file_open_read(ctx->path, fp, &size, why, sizeof why);
  if (r != DTRAIN_OK) return dt__io_err(ctx, r, "%s", why);
  if (size < 8) return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "truncated: %llu bytes, a safetensors file has at least 8",
                                  (unsigned long long)size);
  if (size > (uint64_t)(SIZE_MAX / 2))
    return dt__io_err(ctx, DTRAIN_ERR_OVERFLOW, "file of %llu bytes is too large", (unsigned long long)size);
  c->file_size = (size_t)size;
  if (!dt__file_read_exact(*fp, len8, 8, why, sizeof why)) return dt__io_err(ctx, DTRAIN_ERR_IO, "%s", why);
  uint64_t n = dt__get_le64(len8);
  if ((n > size - 8 || n > (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER) && size > 8) {
    /* A length that cannot be: a damaged safetensors file still has its '{'
     * next; anything else (a text file, an image, another format) is not one. */
    unsigned char b;
    if (!dt__file_read_exact(*fp, &b, 1, why, sizeof why)) return dt__io_err(ctx, DTRAIN_ERR_IO, "%s", why);
    if (b != '{')
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "not a safetensors file (no 8-byte header length followed by '{'; "
                        "read as one, its header length %llu exceeds the file of %llu bytes)",
                        (unsigned long long)n, (unsigned long long)size);
  }
  if (n > size - 8)
    return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "header length %llu exceeds the file (%zu bytes: at most %zu)",
                      (unsigned long long)n, c->file_size, c->file_size - 8);
  if (n > (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER)
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "header length %llu exceeds the limit of %d bytes",
                      (unsigned long long)n, DTRAIN_CHECKPOINT_MAX_HEADER);
  c->file_cap = 8 + (size_t)n + 1;
  c->file = (unsigned char *)dt__alloc(c->file_cap);
  if (!c->file) {
    c->file_cap = 0;
    return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for a header of %llu bytes", (unsigned long long)n);
  }
  memcpy(c->file, len8, 8);
  c->file[8] = 0;
  if (!dt__file_read_exact(*fp, c->file + 8, (size_t)n, why, sizeof why))
    return dt__io_err(ctx, DTRAIN_ERR_IO, "%s", why);
  c->file[8 + n] = 0;
  return DTRAIN_OK;
}

/* The data, after the index checked that its tensors cover data_size. */
static dt_result dt__io_read_data(dt_checkpoint *c, const dt__io_ctx *ctx, FILE *f) {
  char why[200];
  c->data_cap = c->data_size > 0 ? c->data_size : 1;
  c->data_buf = (unsigned char *)dt__alloc(c->data_cap);
  if (!c->data_buf) {
    c->data_cap = 0;
    return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for %zu bytes of data", c->data_size);
  }
  c->data = c->data_buf;
  if (!dt__file_read_exact(f, c->data_buf, c->data_size, why, sizeof why))
    return dt__io_err(ctx, DTRAIN_ERR_IO, "%s", why);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_checkpoint *dt__io_open(const dt__io_ctx *ctx, int need_f32, dt_result *res) {
  dt_checkpoint *c = (dt_checkpoint *)dt__calloc(sizeof *c);
  FILE *f = NULL;
  if (!c) {
    *res = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
    return NULL;
  }
  *res = dt__io_read_header(c, ctx, &f);
  if (*res == DTRAIN_OK) *res = dt__io_index(c, ctx, need_f32);
  if (*res == DTRAIN_OK) *res = dt__io_read_data(c, ctx, f);
  if (*res == DTRAIN_OK) *res = dt__io_verify(c, ctx);
  if (f) fclose(f);
  if (*res != DTRAIN_OK) {
    dt_checkpoint_close(c);
    return NULL;
  }
  return c;
}

DTRAIN_API dt_checkpoint *dt_checkpoint_open(const char *path) {
  dt_result r;
  if (!path) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_open: path is NULL");
    return NULL;
  }
  dt__io_ctx ctx;
  ctx.fn = "dt_checkpoint_open";
  ctx.path = path;
  return dt__io_open(&ctx, 0, &r);
}

DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c) { return c ? c->nentries : 0; }

DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out) {
  if (!c || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_entry_at: NULL argument");
  if (index < 0 || index >= c->nentries)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_entry_at: index %d out of range (%d tensors)", index,
                     c->nentries);
  const dt__io_entry *e = &c->entries[index];
  out->name = e->name;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  memcpy(out->shape, e->shape, sizeof e->shape);
  out->begin = e->begin;
  out->end = e->end;
  return DTRAIN_OK;
}

DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name) {
  if (!c || !name) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_find: %s is NULL", c ? "name" : "checkpoint");
  int i = dt__io_find(c, name);
  return i >= 0 ? i : DTRAIN_ERR_NOT_FOUND;
}

DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n) {
  if (!c || (!dst && n > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_read_f32: NULL argument");
  if (index < 0 || index >= c->nentries)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_read_f32: index %d out of range (%d tensors)", index,
                     c->nentries);
  const dt__io_entry *e = &c->entries[index];
  if (strcmp(e->dtype, "F32") != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "dt_checkpoint_read_f32: tensor '%s' has dtype %s, not F32", e->name,
                     e->dtype);
  if ((uint64_t)n != e->nelem)
    return dt__error(DTRAIN_ERR_SHAPE, "dt_checkpoint_read_f32: tensor '%s' has %llu elements, not %zu", e->name,
                     (unsigned long long)e->nelem, n);
  dt__get_f32le(dst, c->data + e->begin, n);
  return DTRAIN_OK;
}

DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c) { return c ? c->nmeta : 0; }

DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value) {
  if (!c) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_meta_at: checkpoint is NULL");
  if (index < 0 || index >= c->nmeta)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_meta_at: index %d out of range (%d entries)", index, c->nmeta);
  if (key) *key = c->mkeys[index];
  if (value) *value = c->mvals[index];
  return DTRAIN_OK;
}

DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key) {
  if (!c || !key) dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_meta: %s is NULL", c ? "key" : "checkpoint");
  return (c && key) ? dt__io_meta_get(c, key) : NULL;
}

DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c) { return c ? (uint64_t)c->file_size : 0; }
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c) { return c ? (uint64_t)c->header_len : 0; }

#else /* DTRAIN_NO_STDIO: no file I/O, every entry point says so */

struct dt_checkpoint {
  int unused;
};

static dt_result dt__safetensors_unsupported(const char *fn) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO (no file I/O)", fn);
}

DTRAIN_API dt_checkpoint *dt_checkpoint_open(const char *path) {
  (void)path;
  dt__safetensors_unsupported("dt_checkpoint_open");
  return NULL;
}
DTRAIN_API void dt_checkpoint_close(dt_checkpoint *c) { (void)c; }
DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out) {
  (void)c; (void)index; (void)out;
  return dt__safetensors_unsupported("dt_checkpoint_entry_at");
}
DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name) {
  (void)c; (void)name;
  return dt__safetensors_unsupported("dt_checkpoint_find");
}
DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n) {
  (void)c; (void)index; (void)dst; (void)n;
  return dt__safetensors_unsupported("dt_checkpoint_read_f32");
}
DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value) {
  (void)c; (void)index; (void)key; (void)value;
  return dt__safetensors_unsupported("dt_checkpoint_meta_at");
}
DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key) {
  (void)c; (void)key;
  dt__safetensors_unsupported("dt_checkpoint_meta");
  return NULL;
}
DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c) { (void)c; return 0; }

#endif /* DTRAIN_NO_STDIO */
