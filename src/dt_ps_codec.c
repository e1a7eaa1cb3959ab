/* ===========================================================================
 * dt_ps_codec.c -- parameter servers over slow links: pushes compressed as
 * the strategy's dt_compress says, pulls as 16-bit deltas against a copy
 * both ends keep (the messages: dt_ps_core.h)
 * ===========================================================================
 * A push to server s carries its shard's part of the worker's push vector:
 * gradients of trained parameters, values of buffers. Buffers always go as
 * floats (they are values, set as they come); the trained part as
 *   fp16 / bf16: a 16-bit value each (fp16: times 2^e, e from the largest);
 *   topk:F: the worker's k largest |g + error| over all its trained values
 *     (dt__ef_local), each server receiving those of its shard: their
 *     positions among the shard's trained values (rising) and values;
 *   powersgd:R: per trained parameter (a rows x cols matrix) P and Q, the
 *     server adding P Q^T, or its values where the factors are no smaller.
 * top-k and PowerSGD keep what they left out for the next push (error
 * feedback, in the worker's dt__ef), committed once every server took it.
 *
 * A pull asks for its weights as floats, or as the difference from the copy
 * of them this worker was last sent, in 16 bits with a power-of-two scale
 * (fp16) or in bf16: both ends add the decoded difference to their copy, the
 * same floats from the same bytes (both in dtrain's floating-point mode, see
 * dt__fp_enter), so the two copies stay bitwise equal; what
 * the rounding lost is in the next difference. The worker trains on that
 * copy: at most one rounding of the last difference from the server's
 * weights. The first pull after a join sends floats (and starts the copy).
 */
#include "dt_strategy_impl.h"
#include "dt_ps_core.h"

#if !defined(DTRAIN_NO_DIST)

/* The shard's trained floats and buffer floats. */
static void dt__ps_counts_of(const dt_params *p, const int *owner, int s, size_t *ntr, size_t *nbuf) {
  size_t b, e;
  int tr, dec;
  *ntr = *nbuf = 0;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    if (tr) *ntr += e - b;
    else *nbuf += e - b;
  }
}

DTRAIN_PRIVATE size_t dt__ps_pushz_cap(const dt_params *p, const int *owner, int s) {
  size_t ntr, nbuf;
  dt__ps_counts_of(p, owner, s, &ntr, &nbuf);
  /* top-k with F near 1 is the largest: an index and a value per trained float */
  return DT__PS_ZFIX + 8 * ntr + 4 * nbuf;
}

/* The 16-bit header word: fp16's exponent, checked (bf16: 0). */
static dt_result dt__ps_h16_header(dt_compress_kind kind, uint32_t word, float *unscale, const char *what) {
  int32_t e = (int32_t)word;
  if (e < -126 || e > 127 || (kind == DTRAIN_COMPRESS_BF16 && e != 0))
    return dt__error(DTRAIN_ERR_PROTOCOL, "%s: %s scale exponent %d", what, kind == DTRAIN_COMPRESS_FP16 ? "fp16" : "bf16",
                     (int)e);
  *unscale = ldexpf(1.0f, -(int)e);
  return DTRAIN_OK;
}

/* ---- pushes --------------------------------------------------------------------------- */

/* The buffers of shard s from full into out (floats). */
static unsigned char *dt__ps_put_buffers(const dt_params *p, const int *owner, int s, const float *full,
                                         unsigned char *out) {
  size_t b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s || tr) continue;
    dt__put_f32le(out, full + b, e - b);
    out += 4 * (e - b);
  }
  return out;
}

DTRAIN_PRIVATE size_t dt__ps_encode_push(dt_compress c, const struct dt__ef *ef, const dt_params *p, const int *owner,
                                         int s, const float *g, unsigned char *out) {
  size_t b, e;
  int tr, dec;
  unsigned char *o = out + DT__PS_ZFIX;
  uint32_t arg = 0;
  if (c.kind == DTRAIN_COMPRESS_FP16 || c.kind == DTRAIN_COMPRESS_BF16) {
    float m = 0.0f, scale = 1.0f;
    int finite = 1;
    if (c.kind == DTRAIN_COMPRESS_FP16) {
      for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
        if (owner[i] == s && tr) m = DT__MAX(m, dt__h16_absmax(g + b, NULL, e - b, &finite));
      int ex = dt__f16_exponent(m, finite);
      scale = ldexpf(1.0f, ex);
      arg = (uint32_t)(int32_t)ex;
    }
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
      if (owner[i] == s && tr) {
        dt__h16_encode(c.kind, g + b, NULL, scale, o, e - b);
        o += 2 * (e - b);
      }
  } else if (c.kind == DTRAIN_COMPRESS_TOPK) {
    /* the entries (rising flat indices) of this shard's parameters, as positions among its trained values */
    const size_t k = dt__ef_topk_count(ef);
    size_t cnt = 0;
    for (int pass = 0; pass < 2; pass++) {
      size_t j = 0, pos = 0, got = 0;
      for (int i = 0; j < k && dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
        if (!tr) continue;
        uint32_t idx = 0;
        float v = 0.0f;
        for (; j < k; j++) {
          dt__ef_topk_entry(ef, j, &idx, &v);
          if ((size_t)idx >= e) break;
          if (owner[i] != s || (size_t)idx < b) continue;
          if (pass == 1) {
            dt__put_le32(o + 4 * got, (uint32_t)(pos + ((size_t)idx - b)));
            dt__put_f32le(o + 4 * cnt + 4 * got, &v, 1);
          }
          got++;
        }
        if (owner[i] == s) pos += e - b;
      }
      cnt = got;
    }
    arg = (uint32_t)cnt;
    o += 8 * cnt;
  } else { /* POWERSGD */
    int part = 0;
    arg = (uint32_t)c.rank;
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
      if (!tr || e == b) continue;
      size_t r = 0;
      const float *Q = NULL, *P = dt__ef_factors(ef, part++, &r, &Q);
      if (owner[i] != s) continue;
      size_t rows, cols;
      dt__ef_param_matrix(p, i, &rows, &cols);
      if (!r) {
        dt__put_f32le(o, P, e - b);
        o += 4 * (e - b);
        continue;
      }
      dt__put_f32le(o, P, rows * r);
      o += 4 * rows * r;
      dt__put_f32le(o, Q, cols * r);
      o += 4 * cols * r;
    }
  }
  o = dt__ps_put_buffers(p, owner, s, g, o);
  dt__put_le32(out + DT__PS_FIX, (uint32_t)c.kind);
  dt__put_le32(out + DT__PS_FIX + 4, arg);
  return (size_t)(o - out);
}

/* Scratch floats of at least n (grown; the server's). */
static float *dt__ps_scratch(float **buf, size_t *cap, size_t n) {
  if (n <= *cap) return *buf;
  float *nb = (float *)dt__alloc(n * sizeof(float));
  if (!nb) return NULL;
  dt__free(*buf, *cap * sizeof(float));
  *buf = nb;
  *cap = n;
  return nb;
}

DTRAIN_PRIVATE dt_result dt__ps_decode_push(const dt_params *p, const int *owner, int s, const unsigned char *in,
                                            size_t len, float *grad, float *data, float **scratch, size_t *scap) {
  const char *what = "compressed push";
  size_t b, e, ntr, nbuf, want;
  int tr, dec;
  if (len < DT__PS_ZFIX) return dt__error(DTRAIN_ERR_PROTOCOL, "%s of %zu bytes (under %d)", what, len, DT__PS_ZFIX);
  uint32_t kind = dt__get_le32(in + DT__PS_FIX), arg = dt__get_le32(in + DT__PS_FIX + 4);
  const unsigned char *q = in + DT__PS_ZFIX;
  dt__ps_counts_of(p, owner, s, &ntr, &nbuf);
  if (kind == DTRAIN_COMPRESS_FP16 || kind == DTRAIN_COMPRESS_BF16) {
    float unscale = 1.0f; /* set by dt__ps_h16_header */
    dt_result rc = dt__ps_h16_header((dt_compress_kind)kind, arg, &unscale, what);
    if (rc != DTRAIN_OK) return rc;
    want = DT__PS_ZFIX + 2 * ntr + 4 * nbuf;
    if (len != want) return dt__error(DTRAIN_ERR_PROTOCOL, "%s (16-bit): %zu bytes, its shard needs %zu", what, len, want);
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
      if (owner[i] == s && tr) {
        dt__h16_decode((dt_compress_kind)kind, q, unscale, grad + b, e - b, 0);
        q += 2 * (e - b);
      }
  } else if (kind == DTRAIN_COMPRESS_TOPK) {
    if (arg > ntr) return dt__error(DTRAIN_ERR_PROTOCOL, "%s (top-k): %u values of a shard of %zu trained", what, arg, ntr);
    want = DT__PS_ZFIX + 8 * (size_t)arg + 4 * nbuf;
    if (len != want) return dt__error(DTRAIN_ERR_PROTOCOL, "%s (top-k): %zu bytes, %u values need %zu", what, len, arg, want);
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
      if (owner[i] == s && tr) memset(grad + b, 0, (e - b) * sizeof(float));
    const unsigned char *vals = q + 4 * (size_t)arg;
    size_t pos = 0; /* the first trained position of parameter i */
    int i = 0;
    int have = dt__params_range(p, i, &b, &e, &tr, &dec);
    for (uint32_t j = 0; j < arg; j++) {
      uint32_t at = dt__get_le32(q + 4 * (size_t)j);
      if (j > 0 && at <= dt__get_le32(q + 4 * (size_t)(j - 1)))
        return dt__error(DTRAIN_ERR_PROTOCOL, "%s (top-k): position %u after %u (they must rise)", what, at,
                         dt__get_le32(q + 4 * (size_t)(j - 1)));
      if ((size_t)at >= ntr)
        return dt__error(DTRAIN_ERR_PROTOCOL, "%s (top-k): position %u of a shard of %zu trained values", what, at, ntr);
      /* the parameter holding position at */
      while (have && (owner[i] != s || !tr || (size_t)at >= pos + (e - b))) {
        if (owner[i] == s && tr) pos += e - b;
        have = dt__params_range(p, ++i, &b, &e, &tr, &dec);
      }
      if (!have) return dt__error(DTRAIN_ERR_INTERNAL, "%s (top-k): position %u not found", what, at);
      dt__get_f32le(grad + b + ((size_t)at - pos), vals + 4 * (size_t)j, 1);
    }
    q += 8 * (size_t)arg;
  } else if (kind == DTRAIN_COMPRESS_POWERSGD) {
    if (arg < 1 || arg > 1024) return dt__error(DTRAIN_ERR_PROTOCOL, "%s (PowerSGD): rank %u outside 1..1024", what, arg);
    size_t most = 0;
    want = DT__PS_ZFIX + 4 * nbuf;
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
      if (owner[i] != s || !tr) continue;
      size_t rows, cols, r;
      dt__ef_param_matrix(p, i, &rows, &cols);
      r = e > b ? dt__ef_lowrank((int)arg, rows, cols, 0) : 0;
      want += 4 * (r ? (rows + cols) * r : e - b);
      if (r) most = DT__MAX(most, (rows + 2 * cols) * r);
    }
    if (len != want)
      return dt__error(DTRAIN_ERR_PROTOCOL, "%s (PowerSGD rank %u): %zu bytes, its shard needs %zu", what, arg, len, want);
    float *w = most ? dt__ps_scratch(scratch, scap, most) : NULL;
    if (most && !w) return dt__error(DTRAIN_ERR_NOMEM, "%s (PowerSGD): out of memory for %zu floats", what, most);
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
      if (owner[i] != s || !tr) continue;
      size_t rows, cols, r;
      dt__ef_param_matrix(p, i, &rows, &cols);
      r = e > b ? dt__ef_lowrank((int)arg, rows, cols, 0) : 0;
      if (!r) {
        dt__get_f32le(grad + b, q, e - b);
        q += 4 * (e - b);
        continue;
      }
      float *P = w, *Q = w + rows * r, *qt = Q + cols * r;
      dt__get_f32le(P, q, rows * r);
      dt__get_f32le(Q, q + 4 * rows * r, cols * r);
      q += 4 * (rows + cols) * r;
      dt__ef_expand(P, Q, grad + b, rows, cols, r, qt);
    }
  } else {
    return dt__error(DTRAIN_ERR_PROTOCOL, "%s of kind %u (none of fp16 1, bf16 2, topk 3, powersgd 4)", what, kind);
  }
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s || tr) continue;
    dt__get_f32le(data + b, q, e - b);
    q += 4 * (e - b);
  }
  return DTRAIN_OK;
}

/* ---- pulls --------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__ps_delta_encode(dt_compress_kind kind, const dt_params *p, const int *owner, int s,
                                        const float *full, float *view, unsigned char *out) {
  size_t b, e;
  int tr, dec, finite = 1;
  float m = 0.0f, scale = 1.0f, unscale = 1.0f;
  unsigned long fp = dt__fp_enter(); /* as the worker's dt__ps_delta_apply: the same floats */
  if (kind == DTRAIN_COMPRESS_FP16) {
    const float *v = view;
    for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
      if (owner[i] == s) {
        m = DT__MAX(m, dt__h16_absmax(full + b, v, e - b, &finite));
        v += e - b;
      }
  }
  int ex = kind == DTRAIN_COMPRESS_FP16 ? dt__f16_exponent(m, finite) : 0;
  scale = ldexpf(1.0f, ex);
  unscale = ldexpf(1.0f, -ex);
  dt__put_le32(out, (uint32_t)kind);
  dt__put_le32(out + 4, (uint32_t)(int32_t)ex);
  unsigned char *o = out + 8;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
    if (owner[i] == s) { /* the difference's 16 bits, then the copy plus what they say (the worker's sum) */
      dt__h16_encode(kind, full + b, view, scale, o, e - b);
      dt__h16_decode(kind, o, unscale, view, e - b, 1);
      view += e - b;
      o += 2 * (e - b);
    }
  dt__fp_leave(fp);
}

DTRAIN_PRIVATE dt_result dt__ps_delta_apply(dt_compress_kind kind, const unsigned char *in, float *view, size_t n) {
  const char *what = "compressed weights";
  uint32_t k = dt__get_le32(in);
  float unscale = 1.0f; /* set by dt__ps_h16_header */
  if (k != (uint32_t)kind)
    return dt__error(DTRAIN_ERR_PROTOCOL, "%s of kind %u, asked for %u", what, k, (unsigned)kind);
  dt_result rc = dt__ps_h16_header(kind, dt__get_le32(in + 4), &unscale, what);
  if (rc != DTRAIN_OK) return rc;
  in += 8;
  unsigned long fp = dt__fp_enter();
  dt__h16_decode(kind, in, unscale, view, n, 1);
  dt__fp_leave(fp);
  return DTRAIN_OK;
}

#endif /* DTRAIN_NO_DIST */
