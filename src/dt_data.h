/* ===========================================================================
 * dt_data.h -- data: gzip/inflate, IDX, CSV, NPY, text corpora, datasets,
 *              the batch loader (shuffle, batches, split, shards)
 * ===========================================================================
 * Readers come in two forms: dt_*_read(path, ...) reads a file and
 * dt_*_parse(buf, len, ...) parses bytes already in memory; for datasets,
 * which are returned as new objects, dt_dataset_load_*(path, ...) and
 * dt_dataset_from_*(buf, len, ...). With
 * DTRAIN_NO_STDIO the file forms return DTRAIN_ERR_UNSUPPORTED; the parse
 * forms always work. Every reader checks sizes claimed by a header against
 * the bytes actually there BEFORE allocating (a file reader opens regular
 * files only -- a FIFO, a device or a directory is DTRAIN_ERR_IO at once --
 * and reads the first 64 KiB first: an IDX or NPY file longer than its header
 * describes is refused before the rest is read, a gzip one is inflated no
 * further than its header's size, DTRAIN_ERR_OVERFLOW past it), and reports
 * malformed input as
 * DTRAIN_ERR_FORMAT (not this kind of file), DTRAIN_ERR_CORRUPT (truncated or
 * damaged) or DTRAIN_ERR_IO (with the path and the system's reason), with a
 * message in dt_last_error().
 *
 * gzip: every reader accepts gzip-compressed input (data starting with the
 * magic 1f 8b, whatever the file is called), decompressed by a small built-in
 * inflater (RFC 1951/1952, CRC-32 and length checked) or by zlib when
 * DTRAIN_USE_ZLIB is defined (link -lz).
 *
 * Ownership: every struct filled by a reader owns its memory until the
 * matching *_free / *_destroy (which zero the struct; freeing a zeroed
 * struct or NULL is a no-op). Functions that return a new dataset or loader
 * return NULL on failure, with the reason in dt_last_error() and
 * dt_last_result(). A loader borrows its dataset: the dataset must
 * outlive the loader.
 */
#ifndef DTRAIN_DATA_H
#define DTRAIN_DATA_H

#include "dt_params.h"

DTRAIN_EXTERN_C_BEGIN

/* ---- byte buffers, files, gzip ---------------------------------------------- */
typedef struct dt_bytes {
  unsigned char *data; /* `size` bytes (plus a 0 byte after them) */
  size_t size;
  size_t cap;          /* private: allocated bytes */
} dt_bytes;

DTRAIN_API void dt_bytes_free(dt_bytes *b);
/* Whole file into memory, as stored (no decompression). */
DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out);
/* Whole file; gzip data (magic 1f 8b) is decompressed, anything else is
 * returned as is. */
DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out);
/* Decompress a gzip file image (one or more members; header flags FTEXT,
 * FHCRC, FEXTRA, FNAME, FCOMMENT; CRC-32 and ISIZE verified). max_out caps
 * the output size (0: 4 GiB). */
DTRAIN_API dt_result dt_gunzip(const void *in, size_t len, size_t max_out, dt_bytes *out);
/* Decompress a raw deflate stream (RFC 1951, no header). */
DTRAIN_API dt_result dt_inflate(const void *in, size_t len, size_t max_out, dt_bytes *out);
/* CRC-32 (ISO-HDLC, as gzip and zlib); pass 0 as crc to start. NULL data or
 * len 0: returns crc unchanged. */
DTRAIN_API uint32_t dt_crc32(uint32_t crc, const void *data, size_t len);

/* ---- IDX (the MNIST file format) ------------------------------------------------
 * Magic 00 00 08 NDIM (unsigned bytes only), NDIM big-endian u32 dimensions,
 * then the bytes. At most DTRAIN_MAX_DIMS dimensions, each at least 1. */
typedef struct dt_idx {
  unsigned char *data;             /* size bytes, row-major */
  int64_t size;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  size_t bytes_;                   /* private */
} dt_idx;

DTRAIN_API dt_result dt_idx_read(const char *path, dt_idx *out);
DTRAIN_API dt_result dt_idx_parse(const void *buf, size_t len, dt_idx *out);
DTRAIN_API void dt_idx_free(dt_idx *a);

/* ---- datasets ----------------------------------------------------------------------
 * n samples held in memory: features as float32 with a per-sample shape, and
 * optionally one int32 label per sample. Fields may be read directly; sample
 * i starts at x + i * sample_size. */
typedef struct dt_dataset {
  float *x;                        /* n * sample_size floats */
  int32_t *y;                      /* n labels, or NULL */
  int64_t n;
  int64_t sample_size;             /* product of shape[0..ndim) */
  int ndim;                        /* per-sample dims, 1..DTRAIN_MAX_DIMS-1 */
  int64_t shape[DTRAIN_MAX_DIMS];
  int num_classes;                 /* max label + 1 when loaded; 0 without labels */
} dt_dataset;

/* Flags for loaders that read bytes (IDX, NPY uint8). */
#define DTRAIN_DATA_RAW 0x01u      /* keep byte values 0..255 (default: scale to [0,1]) */

/* New zero-filled dataset of n samples of the given shape, with labels if
 * with_labels (num_classes then 0: set it). */
DTRAIN_API dt_dataset *dt_dataset_new(int64_t n, int ndim, const int64_t *sample_shape, int with_labels);
DTRAIN_API void dt_dataset_destroy(dt_dataset *ds);
/* Copy samples idx[0..count) into a new dataset (same shape, labels, classes). */
DTRAIN_API dt_dataset *dt_dataset_select(const dt_dataset *ds, const int64_t *idx, int64_t count);
/* Deprecated: the out-parameter forms, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_new, which returns the dataset")
dt_result dt_dataset_create(dt_dataset **out, int64_t n, int ndim, const int64_t *sample_shape, int with_labels);
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_select, which returns the dataset")
dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out);
/* Seeded disjoint split: round(n * val_fraction) samples (at least 1, at most
 * n-1) go to *val, the rest to *train; both keep the original order. */
DTRAIN_API dt_result dt_dataset_split(const dt_dataset *ds, double val_fraction, uint64_t seed,
                                      dt_dataset **train, dt_dataset **val);
/* Reinterpret the per-sample shape (same number of values), e.g. [28,28] -> [1,28,28]. */
DTRAIN_API dt_result dt_dataset_reshape(dt_dataset *ds, int ndim, const int64_t *sample_shape);

/* IDX images (n, dims...) + IDX labels (n): pixels / 255 (or raw with
 * DTRAIN_DATA_RAW), labels as int32, num_classes = max label + 1. Either
 * file may be gzipped. labels_path NULL (or labels NULL / 0 bytes): no labels. */
DTRAIN_API dt_dataset *dt_dataset_load_idx(const char *images_path, const char *labels_path, unsigned flags);
DTRAIN_API dt_dataset *dt_dataset_from_idx(const void *images, size_t images_len, const void *labels,
                                           size_t labels_len, unsigned flags);
/* Deprecated: the out-parameter forms, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_load_idx, which returns the dataset")
dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path, unsigned flags);
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_from_idx, which returns the dataset")
dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len, const void *labels,
                               size_t labels_len, unsigned flags);

/* Fashion-MNIST: find the directory holding its IDX files (.gz or not).
 * Looks at `dir` if non-NULL (which must hold at least the test split), else
 * /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist), else
 * data/fashion-mnist relative to the working directory (the shipped test
 * split only). Writes the directory used to out (cap bytes) and whether it
 * has the 60000-image train split to *has_train (may be NULL). */
DTRAIN_API dt_result dt_fashion_mnist_find(const char *dir, char *out, size_t cap, int *has_train);
/* Load the splits from `dir` (found as above). train may be NULL (not
 * wanted); *train is set to NULL when the directory has no train split. */
DTRAIN_API dt_result dt_fashion_mnist_load(const char *dir, dt_dataset **train, dt_dataset **test);

/* ---- CSV ----------------------------------------------------------------------------
 * Numeric CSV: every field a finite number (C locale: '.' decimal point);
 * blank lines are skipped; "\r\n" line ends are fine; every row must have the
 * same number of fields. Zeroed options (or NULL) mean: no header, no labels, ','. */
typedef struct dt_csv_options {
  int header;          /* nonzero: the first line is a header and is skipped */
  int has_labels;      /* nonzero: one column holds integer labels >= 0 */
  int label_column;    /* 0-based; negative counts from the end (-1 = last) */
  char delimiter;      /* 0 means ',' */
} dt_csv_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_csv_options dt_csv_desc;

DTRAIN_API dt_dataset *dt_dataset_load_csv(const char *path, const dt_csv_options *opts);
DTRAIN_API dt_dataset *dt_dataset_from_csv(const char *text, size_t len, const dt_csv_options *opts);
/* Deprecated: the out-parameter forms, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_load_csv, which returns the dataset")
dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_options *desc);
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_from_csv, which returns the dataset")
dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_options *desc);

/* ---- NPY ----------------------------------------------------------------------------
 * NumPy .npy, format versions 1.0 and 2.0 (read), 1.0 (written). dtypes
 * '<f4', '<i4', '<i8', '|u1' (and big-endian '>f4', '>i4', '>i8', converted
 * on reading); C order only (fortran_order True is refused). */
typedef enum dt_npy_dtype {
  DTRAIN_NPY_F32 = 1,  /* float32 */
  DTRAIN_NPY_U8 = 2,   /* uint8 */
  DTRAIN_NPY_I32 = 3,  /* int32 */
  DTRAIN_NPY_I64 = 4   /* int64 */
} dt_npy_dtype;

typedef struct dt_npy {
  void *data;                      /* size elements of dtype, native byte order */
  dt_npy_dtype dtype;
  int ndim;                        /* 0 (scalar) .. DTRAIN_MAX_DIMS */
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t size;
  size_t bytes_;                   /* private */
} dt_npy;

DTRAIN_API dt_result dt_npy_read(const char *path, dt_npy *out);
DTRAIN_API dt_result dt_npy_parse(const void *buf, size_t len, dt_npy *out);
DTRAIN_API void dt_npy_free(dt_npy *a);
/* Bytes per element of a dtype (0 if unknown). */
DTRAIN_API size_t dt_npy_dtype_size(dt_npy_dtype dtype);
/* Encode into buf (cap bytes); *len receives the bytes needed. buf NULL or
 * cap too small: nothing written, DTRAIN_ERR_INVALID_ARG unless buf is NULL
 * (a size query returns DTRAIN_OK). */
DTRAIN_API dt_result dt_npy_encode(void *buf, size_t cap, size_t *len, dt_npy_dtype dtype, int ndim,
                                   const int64_t *shape, const void *data);
DTRAIN_API dt_result dt_npy_write(const char *path, dt_npy_dtype dtype, int ndim, const int64_t *shape,
                                  const void *data);
/* Dataset from arrays: x [n, ...] of any dtype (uint8 scaled to [0,1] unless
 * DTRAIN_DATA_RAW), y [n] integer labels >= 0 (or NULL). */
DTRAIN_API dt_dataset *dt_dataset_from_arrays(const dt_npy *x, const dt_npy *y, unsigned flags);
/* Deprecated: the out-parameter form, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("use dt_dataset_from_arrays, which returns the dataset")
dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags);

/* ---- text corpora (character models) ----------------------------------------------
 * The vocabulary is the set of distinct bytes of the text, in byte order:
 * id k is the k-th smallest byte value present. */
typedef struct dt_text {
  int32_t *ids;                    /* the text as ids, n of them */
  int64_t n;
  int vocab_size;                  /* 1..256 */
  unsigned char vocab[256];        /* id -> byte */
  int16_t id_of[256];              /* byte -> id, -1 if absent */
  size_t bytes_;                   /* private */
} dt_text;

DTRAIN_API dt_result dt_text_read(const char *path, dt_text *out);
DTRAIN_API dt_result dt_text_parse(const void *buf, size_t len, dt_text *out);
DTRAIN_API void dt_text_free(dt_text *t);
/* Bytes -> ids (len of them); a byte outside the vocabulary is an error. */
DTRAIN_API dt_result dt_text_encode(const dt_text *t, const char *s, size_t len, int32_t *ids);
/* ids -> bytes; writes n bytes and a terminating 0 (cap >= n + 1). */
DTRAIN_API dt_result dt_text_decode(const dt_text *t, const int32_t *ids, int64_t n, char *out, size_t cap);
/* `batch` random windows of ids[begin, end): x[b*seq_len + t] = ids[s + t],
 * y[...] = ids[s + t + 1] (next-character targets); needs end - begin > seq_len. */
DTRAIN_API dt_result dt_text_sample(const dt_text *t, int64_t begin, int64_t end, dt_rng *rng, int64_t batch,
                                    int64_t seq_len, int32_t *x, int32_t *y);

/* ---- loader --------------------------------------------------------------------------
 * Iterates one shard of a dataset in batches, epoch after epoch.
 *
 * Order: epoch e visits the permutation P_e of 0..n-1, a pure function of
 * (seed, e) (identity when shuffle is 0). Shard k of K takes the positions
 * k, k+K, k+2K, ... of P_e: shards are disjoint and their union is the whole
 * set. When K does not divide n, shards 0..(n mod K)-1 hold one sample more
 * than the others (sizes floor(n/K) or ceil(n/K)); replicas that must take
 * the same number of steps should use drop_last with equal batch counts, or
 * a dataset size divisible by K * batch_size.
 *
 * Position: (epoch, index), index = samples of this shard already delivered
 * in this epoch. It is all the state there is: save it with
 * dt_loader_position and restore it with dt_loader_set_position to resume
 * the identical stream of batches.
 *
 * Batches live in buffers the loader allocated once at creation: a batch is
 * valid until the next dt_loader_next call. Stepping allocates nothing.
 */
typedef struct dt_loader dt_loader;

typedef struct dt_loader_options {
  int64_t batch_size;    /* required, >= 1 */
  uint64_t seed;         /* shuffle seed */
  int shuffle;           /* nonzero: a fresh permutation every epoch */
  int drop_last;         /* nonzero: skip the last partial batch of an epoch */
  int shard_index;       /* k in 0..shard_count-1 */
  int shard_count;       /* K; 0 means 1 (the whole set) */
} dt_loader_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_loader_options dt_loader_desc;

typedef struct dt_batch {
  float *x;                        /* size * sample_size floats (loader's buffer) */
  int32_t *y;                      /* size labels, NULL if the dataset has none */
  const int64_t *index;            /* dataset index of each sample */
  int64_t size;                    /* samples in this batch (<= batch_size) */
  int ndim;                        /* 1 + the sample ndim */
  int64_t shape[DTRAIN_MAX_DIMS];  /* [size, sample shape...]: for dt_tensor_wrap */
  int64_t epoch;                   /* where this batch came from */
  int64_t start;                   /* index of its first sample in the epoch's shard order */
} dt_batch;

/* A loader over ds (borrowed: it must outlive the loader); NULL on failure. */
DTRAIN_API dt_loader *dt_loader_new(const dt_dataset *ds, const dt_loader_options *opts);
/* Deprecated: the out-parameter form, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("use dt_loader_new, which returns the loader")
dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_options *desc);
DTRAIN_API void dt_loader_destroy(dt_loader *l);
/* Next batch: returns 1 and fills *b; at the end of the epoch returns 0
 * (b untouched) and moves to (epoch + 1, 0); a negative dt_result on error.
 *   while (dt_loader_next(L, &b) > 0) { ...train on b... }   // one epoch */
DTRAIN_API int dt_loader_next(dt_loader *l, dt_batch *b);
/* Where the next batch starts; epoch or index may be NULL (not wanted). A
 * NULL l reports (0, 0) with DTRAIN_ERR_NULL_ARG in dt_last_error(). */
DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index);
DTRAIN_API dt_result dt_loader_set_position(dt_loader *l, int64_t epoch, int64_t index);
/* Samples in this shard per epoch, and batches per epoch (honours drop_last);
 * 0 for a NULL loader. */
DTRAIN_API int64_t dt_loader_num_samples(const dt_loader *l);
DTRAIN_API int64_t dt_loader_num_batches(const dt_loader *l);
/* The dataset index at position `index` of epoch `epoch` in this shard's order
 * (-1 if out of range). Pure: does not move the loader. */
DTRAIN_API int64_t dt_loader_sample_at(dt_loader *l, int64_t epoch, int64_t index);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_DATA_H */
