/* ===========================================================================
 * dt_safetensors.h -- what the safetensors reader (dt_safetensors.c) shares
 * with checkpoint save and load (dt_checkpoint.c)
 * ===========================================================================
 */
#ifndef DTRAIN_SAFETENSORS_H
#define DTRAIN_SAFETENSORS_H

#include "dt_internal.h"
#include "dt_json.h"

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

#endif /* DTRAIN_NO_STDIO */
#endif /* DTRAIN_SAFETENSORS_H */
