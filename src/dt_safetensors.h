/* ===========================================================================
 * dt_safetensors.h -- what the safetensors reader (dt_safetensors.c) shares
 * with checkpoint save and load (dt_checkpoint.c)
 * ===========================================================================
 */
#ifndef DTRAIN_SAFETENSORS_H
#define DTRAIN_SAFETENSORS_H

#include "dt_internal.h"
#include "dt_json.h"
#include "dt_io.h"

#ifndef DTRAIN_NO_STDIO

#define DT__IO_JSON_DEPTH 64 /* nesting allowed in a header (and its "optimizer" metadata) */

/* ---- the checksum ----------------------------------------------------------------------
 * A streaming 64-bit hash for corruption detection (not security): FNV-1a
 * style over little-endian 64-bit words, h = (h ^ w) * P; h ^= h >> 32, then
 * the tail bytes one by one. Each step is a bijection of h, so changing any
 * one word of the input always changes the result.
 *
 * A checkpoint's "checksum" covers, in this order: each tensor entry sorted
 * by name (name, 0, dtype, 0, then ndim, each dim, begin, end as u64 words),
 * each metadata pair sorted by key except "checksum" itself (key, 0, value,
 * 0), then the data bytes. It does not depend on the order of the JSON keys
 * or on whitespace. */
typedef struct dt__io_hasher {
  uint64_t h;
  unsigned char carry[8];
  int nc;
} dt__io_hasher;

DTRAIN_PRIVATE void dt__io_hash_init(dt__io_hasher *s);
DTRAIN_PRIVATE void dt__io_hash(dt__io_hasher *s, const void *data, size_t n);
DTRAIN_PRIVATE void dt__io_hash_u64(dt__io_hasher *s, uint64_t v);
DTRAIN_PRIVATE uint64_t dt__io_hash_final(dt__io_hasher *s);

/* ---- error context: "<fn>: '<path>': <message>" --------------------------------------- */

typedef struct dt__io_ctx {
  const char *fn;   /* public function name */
  const char *path;
} dt__io_ctx;

DTRAIN_PRIVATE dt_result dt__io_err(const dt__io_ctx *c, dt_result code, const char *fmt, ...) DT__PRINTF(3, 4);

/* ---- an opened file's index ------------------------------------------------------------ */

typedef struct dt__io_entry {
  const char *name;  /* in the JSON pool */
  const char *dtype; /* static table */
  int dsize, ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  uint64_t begin, end, nelem;
} dt__io_entry;

struct dt_checkpoint {
  unsigned char *file;
  size_t file_size, file_cap;
  size_t header_len;
  const unsigned char *data;
  size_t data_size;
  unsigned char *data_buf; /* the data, read after the header was checked */
  size_t data_cap;
  dt__json json;
  dt__io_entry *entries; /* sorted by data offset */
  int nentries;
  int *by_name;          /* entry indices sorted by name */
  const char **mkeys, **mvals;
  int nmeta;
  int is_dtrain;         /* metadata "format" is "dtrain" */
};

/* Hashes c's entries (in by_name order) and metadata (in meta_order, without
 * "checksum"): the checksum's first part, the data bytes follow. */
DTRAIN_PRIVATE void dt__io_hash_index(dt__io_hasher *h, const dt_checkpoint *c, const int *meta_order);
/* Indices 0..n-1 sorted by names[i]; NULL when out of memory. */
DTRAIN_PRIVATE int *dt__io_sorted_index(const char *const *names, int n);
DTRAIN_PRIVATE const char *dt__io_meta_get(const dt_checkpoint *c, const char *key);
/* Entry index of the tensor called name, -1 when there is none. */
DTRAIN_PRIVATE int dt__io_find(const dt_checkpoint *c, const char *name);
/* Exactly 16 lowercase hex digits into *out. */
DTRAIN_PRIVATE int dt__io_parse_hex64(const char *s, uint64_t *out);
/* Reads and indexes the file ctx->path (need_f32: refuse other dtypes at
 * once). NULL and *res set (with a message) on failure. */
DTRAIN_PRIVATE dt_checkpoint *dt__io_open(const dt__io_ctx *ctx, int need_f32, dt_result *res);

/* ---- writing (dt_checkpoint.c) ---------------------------------------------------------- */

/* A growable text buffer (the JSON writer); nomem is set, and further puts
 * ignored, once an allocation fails. */
typedef struct dt__io_buf {
  char *p;
  size_t len, cap;
  int nomem;
} dt__io_buf;

DTRAIN_PRIVATE void dt__io_buf_put(dt__io_buf *b, const void *s, size_t n);
DTRAIN_PRIVATE void dt__io_buf_str(dt__io_buf *b, const char *s);
DTRAIN_PRIVATE void dt__io_buf_u64(dt__io_buf *b, uint64_t v);
/* s quoted as a JSON string (s: valid UTF-8, dt__io_valid_utf8). */
DTRAIN_PRIVATE void dt__io_buf_jstr(dt__io_buf *b, const char *s);
DTRAIN_PRIVATE void dt__io_buf_free(dt__io_buf *b);
DTRAIN_PRIVATE int dt__io_valid_utf8(const char *s);

/* One tensor to write: n floats at src, named names[name_off]; begin and end
 * (its byte range in the data) are filled in by dt__io_write_file. */
typedef struct dt__io_out {
  size_t name_off;
  const float *src;
  size_t n;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  uint64_t begin, end;
} dt__io_out;

/* Most extra metadata entries dt__io_save takes. */
#define DT__IO_MAX_EXTRA 8

/* Writes tensors outs[0..nout) in that order and metadata mk/mv (nm entries,
 * no "checksum": it is added) as a safetensors file at ctx->path, atomically. */
DTRAIN_PRIVATE dt_result dt__io_write_file(const dt__io_ctx *ctx, dt__io_out *outs, int nout, const char *names,
                                           const char **mk, const char **mv, int nm);
/* dt_checkpoint_save as function fn, with nx (<= DT__IO_MAX_EXTRA) more metadata entries. */
DTRAIN_PRIVATE dt_result dt__io_save(const char *path, const dt_train_state *st, const char *fn, const char *const *xk,
                                     const char *const *xv, int nx);
/* "optim.<slot>.<param>": the param part and the slot's name, or NULL when name is not of that form. */
DTRAIN_PRIVATE const char *dt__io_split_optim(const char *name, const char **slot);
/* A decimal integer >= 0 without sign or leading zeros. */
DTRAIN_PRIVATE int dt__io_parse_i64(const char *s, int64_t *out);

#endif /* DTRAIN_NO_STDIO */
#endif /* DTRAIN_SAFETENSORS_H */
