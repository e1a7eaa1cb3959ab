/* ===========================================================================
 * dt_data_text.c -- text formats: CSV tables and character corpora
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

#if !defined(DTRAIN_NO_DATA) /* the whole file; the stubs at the end stand in without it */

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
    const char *hint = (row == 0 && !c->header) ? " (is it a header? set dt_csv_options.header)" : "";
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

/* who: the public function called, for the messages. */
static dt_result dt__data_parse_csv(const char *who, dt_dataset **out, const char *text, size_t len,
                                    const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!text) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: text is NULL", who);
  return dt__data_csv_parse(who, out, text, len, desc);
}

DTRAIN_API dt_dataset *dt_dataset_from_csv(const char *text, size_t len, const dt_csv_options *opts) {
  dt_dataset *ds;
  return dt__data_parse_csv("dt_dataset_from_csv", &ds, text, len, opts) == DTRAIN_OK ? ds : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_desc *desc) {
  return dt__data_parse_csv("dt_dataset_parse_csv", out, text, len, desc);
}

/* who: the public function called, for the messages. */
static dt_result dt__data_read_csv(const char *who, dt_dataset **out, const char *path, const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  dt_bytes b;
  dt_result r = dt__data_load(who, path, 1, NULL, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "%s: '%s'", who, path);
  r = dt__data_csv_parse(ctx, out, (const char *)b.data, b.size, desc);
  dt_bytes_free(&b);
  return r;
}

DTRAIN_API dt_dataset *dt_dataset_load_csv(const char *path, const dt_csv_options *opts) {
  dt_dataset *ds;
  return dt__data_read_csv("dt_dataset_load_csv", &ds, path, opts) == DTRAIN_OK ? ds : NULL;
}

/* Deprecated name, removed in the next release. */
DTRAIN_API dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_desc *desc) {
  return dt__data_read_csv("dt_dataset_read_csv", out, path, desc);
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
  dt_result r = dt__data_load("dt_text_read", path, 1, NULL, &b);
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

#else /* DTRAIN_NO_DATA: every entry point says so */

DTRAIN_API dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_desc *desc) {
  (void)text; (void)len; (void)desc;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_parse_csv");
}
DTRAIN_API dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_desc *desc) {
  (void)path; (void)desc;
  if (out) *out = NULL;
  return dt__data_compiled_out("dt_dataset_read_csv");
}
DTRAIN_API dt_dataset *dt_dataset_from_csv(const char *text, size_t len, const dt_csv_options *opts) {
  (void)text; (void)len; (void)opts;
  dt__data_compiled_out("dt_dataset_from_csv");
  return NULL;
}
DTRAIN_API dt_dataset *dt_dataset_load_csv(const char *path, const dt_csv_options *opts) {
  (void)path; (void)opts;
  dt__data_compiled_out("dt_dataset_load_csv");
  return NULL;
}
DTRAIN_API void dt_text_free(dt_text *t) { (void)t; }
DTRAIN_API dt_result dt_text_parse(const void *buf, size_t len, dt_text *out) {
  (void)buf; (void)len; (void)out;
  return dt__data_compiled_out("dt_text_parse");
}
DTRAIN_API dt_result dt_text_read(const char *path, dt_text *out) {
  (void)path; (void)out;
  return dt__data_compiled_out("dt_text_read");
}
DTRAIN_API dt_result dt_text_encode(const dt_text *t, const char *s, size_t len, int32_t *ids) {
  (void)t; (void)s; (void)len; (void)ids;
  return dt__data_compiled_out("dt_text_encode");
}
DTRAIN_API dt_result dt_text_decode(const dt_text *t, const int32_t *ids, int64_t n, char *out, size_t cap) {
  (void)t; (void)ids; (void)n;
  if (out && cap) out[0] = 0;
  return dt__data_compiled_out("dt_text_decode");
}
DTRAIN_API dt_result dt_text_sample(const dt_text *t, int64_t begin, int64_t end, dt_rng *rng, int64_t batch,
                                    int64_t seq_len, int32_t *x, int32_t *y) {
  (void)t; (void)begin; (void)end; (void)rng; (void)batch; (void)seq_len; (void)x; (void)y;
  return dt__data_compiled_out("dt_text_sample");
}

#endif /* DTRAIN_NO_DATA */
