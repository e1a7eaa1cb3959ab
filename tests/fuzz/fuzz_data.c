/* libFuzzer target: the data loaders (`make fuzz`).
 *
 * The first input byte chooses how the rest is read:
 *   0  dt_idx_parse        (IDX in memory, gzip or not)
 *   1  dt_npy_parse        (NPY in memory, gzip or not)
 *   2  dt_gunzip           (output capped at 1 MiB)
 *   3  dt_idx_read         (from a file: the header is checked first, a .gz
 *                           inflated no further than its header describes)
 *   4  dt_npy_read         (from a file, likewise)
 *   5  dt_dataset_load_idx (from a file, images without labels)
 *   6  dt_dataset_load_csv (from a file; the next byte picks the options:
 *                           header, labels and their column, ';' or ',')
 *   7  dt_text_read        (from a file)
 * Each ends in success or an error with a message, never a crash, an
 * out-of-bounds read or a leak; what is accepted is consistent (sizes that
 * match shapes). */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>
#include <unistd.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_data: %s\n", msg); abort(); } while (0)

static char fz_path[64];

static void fz_quiet(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

static int64_t fz_count(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

static void fz_check_idx(const dt_idx *a) {
  if (a->ndim < 1 || a->ndim > DTRAIN_MAX_DIMS || fz_count(a->ndim, a->shape) != a->size) FZ_FAIL("idx shape/size");
  volatile unsigned char sink = 0;
  for (int64_t i = 0; i < a->size; i++) sink ^= a->data[i]; /* every byte readable */
  (void)sink;
}

static void fz_check_npy(const dt_npy *a) {
  if (a->ndim < 0 || a->ndim > DTRAIN_MAX_DIMS || fz_count(a->ndim, a->shape) != a->size) FZ_FAIL("npy shape/size");
  size_t w = dt_npy_dtype_size(a->dtype);
  if (w == 0) FZ_FAIL("npy dtype");
  volatile unsigned char sink = 0;
  const unsigned char *p = (const unsigned char *)a->data;
  for (int64_t i = 0; i < a->size * (int64_t)w; i++) sink ^= p[i];
  (void)sink;
}

static int fz_write(const uint8_t *data, size_t size) {
  FILE *f = fopen(fz_path, "wb");
  if (!f) return 0;
  if (size) fwrite(data, 1, size, f);
  fclose(f);
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int ready;
  if (!ready) {
    dt_set_logger(fz_quiet, NULL, DTRAIN_LOG_ERROR);
    snprintf(fz_path, sizeof fz_path, "/tmp/fuzz_data_%ld.bin", (long)getpid());
    ready = 1;
  }
  if (size < 1) return 0;
  int mode = data[0] % 8;
  data++;
  size--;
  dt_result r = DTRAIN_OK;
  switch (mode) {
    case 0: {
      dt_idx a;
      r = dt_idx_parse(data, size, &a);
      if (r == DTRAIN_OK) fz_check_idx(&a);
      dt_idx_free(&a);
      break;
    }
    case 1: {
      dt_npy a;
      r = dt_npy_parse(data, size, &a);
      if (r == DTRAIN_OK) fz_check_npy(&a);
      dt_npy_free(&a);
      break;
    }
    case 2: {
      dt_bytes b;
      r = dt_gunzip(data, size, 1u << 20, &b);
      if (r == DTRAIN_OK && b.size > (1u << 20)) FZ_FAIL("gunzip past its cap");
      dt_bytes_free(&b);
      break;
    }
    case 3: {
      dt_idx a;
      if (!fz_write(data, size)) return 0;
      r = dt_idx_read(fz_path, &a);
      if (r == DTRAIN_OK) fz_check_idx(&a);
      dt_idx_free(&a);
      break;
    }
    case 4: {
      dt_npy a;
      if (!fz_write(data, size)) return 0;
      r = dt_npy_read(fz_path, &a);
      if (r == DTRAIN_OK) fz_check_npy(&a);
      dt_npy_free(&a);
      break;
    }
    case 6: {
      if (size < 1) return 0;
      dt_csv_options co;
      memset(&co, 0, sizeof co);
      co.header = data[0] & 1;
      co.has_labels = (data[0] >> 1) & 1;
      co.label_column = (data[0] & 4) ? -1 : (int)((data[0] >> 4) & 3);
      co.delimiter = (data[0] & 8) ? ';' : 0;
      if (!fz_write(data + 1, size - 1)) return 0;
      dt_dataset *ds = dt_dataset_load_csv(fz_path, &co);
      if (!ds) {
        r = dt_last_result();
      } else {
        if (ds->n < 1 || ds->sample_size < 1) FZ_FAIL("csv dataset shape");
        volatile float sink = 0;
        for (int64_t i = 0; i < ds->n * ds->sample_size; i++) sink += ds->x[i]; /* every value readable */
        if (ds->y)
          for (int64_t i = 0; i < ds->n; i++)
            if (ds->y[i] < 0) FZ_FAIL("csv label < 0");
        (void)sink;
      }
      dt_dataset_destroy(ds);
      break;
    }
    case 7: {
      dt_text t;
      if (!fz_write(data, size)) return 0;
      r = dt_text_read(fz_path, &t);
      if (r == DTRAIN_OK) {
        if (t.vocab_size < 1 || t.vocab_size > 256 || t.n < 1) FZ_FAIL("text vocabulary");
        for (int64_t i = 0; i < t.n; i++)
          if (t.ids[i] < 0 || t.ids[i] >= t.vocab_size) FZ_FAIL("text id out of range");
        dt_text_free(&t);
      }
      break;
    }
    default: {
      if (!fz_write(data, size)) return 0;
      dt_dataset *ds = dt_dataset_load_idx(fz_path, NULL, 0);
      if (!ds) r = dt_last_result();
      else if (ds->n < 1 || fz_count(ds->ndim, ds->shape) != ds->sample_size) FZ_FAIL("dataset shape");
      dt_dataset_destroy(ds);
      break;
    }
  }
  if (r != DTRAIN_OK && dt_last_error()[0] == '\0') FZ_FAIL("refused without a message");
  if (mode >= 3) remove(fz_path);
  return 0;
}
