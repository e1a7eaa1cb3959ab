/* ===========================================================================
 * dt_data_core.h -- what the data files share: whole files (gunzipped when
 * they are gzip data) and new datasets
 * ===========================================================================
 * dt_data.c: files, datasets, the loader; dt_data_idx.c: IDX and
 * Fashion-MNIST; dt_data_npy.c: NPY; dt_data_text.c: CSV and text corpora;
 * dt_inflate.c: gzip.
 */
#ifndef DTRAIN_DATA_CORE_H
#define DTRAIN_DATA_CORE_H

#include "dt_internal.h"

#define DT__DATA_CTX 384 /* a message prefix: "<function>: '<path>'" */

#if !defined(DTRAIN_NO_DATA) /* declared only where defined: gcc warns of a static never defined */
/* From dt_inflate.c: gunzip `in` appending to `out`, messages prefixed by ctx. */
DTRAIN_PRIVATE dt_result dt__gunzip_ctx(const char *ctx, const unsigned char *in, size_t len, size_t max_out,
                                        dt_bytes *out);
#ifndef DTRAIN_NO_STDIO
/* From dt_inflate.c: the gzip file f (a regular file of size bytes, read
 * from its start in chunks, never whole) inflated into out (empty), as
 * dt__gunzip_ctx. */
DTRAIN_PRIVATE dt_result dt__gunzip_file(const char *ctx, FILE *f, uint64_t size, size_t max_out, dt_bytes *out);
#endif
/* A format's size from its header: given the first bytes of a file (or of
 * what a .gz decompresses to), *need = the bytes the whole file must have
 * (0: cannot tell from these bytes), or the parser's own error for a bad
 * header. dt__data_load checks the file (or caps the decompression) against
 * it before it reads or inflates the rest. */
typedef dt_result (*dt__data_sizer)(const char *ctx, const unsigned char *p, size_t len, uint64_t *need);
DTRAIN_PRIVATE dt_result dt__data_idx_size(const char *ctx, const unsigned char *p, size_t len, uint64_t *need);
DTRAIN_PRIVATE dt_result dt__data_npy_size(const char *ctx, const unsigned char *p, size_t len, uint64_t *need);
DTRAIN_PRIVATE dt_result dt__gunzip_prefix(const unsigned char *in, size_t len, size_t max_out, dt_bytes *out);
/* The whole file at path into *out (who: the public function, for messages;
 * a regular file only); gunzipped when gz and the data has the gzip magic;
 * sizer (NULL: none) checks the header first (above). UNSUPPORTED with
 * DTRAIN_NO_STDIO. */
DTRAIN_PRIVATE dt_result dt__data_load(const char *who, const char *path, int gz, dt__data_sizer sizer, dt_bytes *out);
/* Bytes of a parse_* input, gunzipped into tmp when they are gzip data
 * (*p and *len then point at tmp's bytes; free tmp after use). */
DTRAIN_PRIVATE dt_result dt__data_maybe_gunzip(const char *ctx, const unsigned char **p, size_t *len, dt_bytes *tmp);
/* A zeroed dataset of n samples of the given shape (and n labels when
 * with_labels), all sizes checked; who names the caller in messages. */
DTRAIN_PRIVATE dt_result dt__data_ds_new(const char *who, dt_dataset **out, int64_t n, int ndim, const int64_t *shape,
                                         int with_labels);
/* Labels must be >= 0; sets num_classes to max + 1. */
DTRAIN_PRIVATE dt_result dt__data_set_classes(const char *who, dt_dataset *ds);

#else
/* "fn: the data loaders are compiled out (DTRAIN_NO_DATA)" as the error (dt_data.c's stubs). */
DTRAIN_PRIVATE dt_result dt__data_compiled_out(const char *fn);
#endif

#endif /* DTRAIN_DATA_CORE_H */
