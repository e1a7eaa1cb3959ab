/* ===========================================================================
 * dt_strategy_compress.c -- gradients compressed on the wire: half-precision
 * values (fp16 with a power-of-two scale per message, bf16) in a ring
 * all-reduce over the communicator's point-to-point messages
 * ===========================================================================
 * The ring: reduce-scatter then all-gather over W chunks, 2(W-1) messages per
 * rank, each a chunk encoded in 16-bit values (half the bytes of the float
 * ring). Sums are made in float; a chunk's owner rounds its sum once, and that
 * message is forwarded as it is: every rank decodes the same bytes, so the
 * replicas stay bitwise equal. fp16 messages carry a power-of-two scale
 * chosen from their largest finite value (gradients far below fp16's range
 * keep their precision; a non-finite value goes through as Inf/NaN).
 */
#include "dt_strategy_impl.h"

/* ---- the names --------------------------------------------------------------------------- */

DTRAIN_API const char *dt_compress_name(dt_compress c) {
  switch (c.kind) {
  case DTRAIN_COMPRESS_NONE: return "none";
  case DTRAIN_COMPRESS_FP16: return "fp16";
  case DTRAIN_COMPRESS_BF16: return "bf16";
  case DTRAIN_COMPRESS_TOPK: return "topk";
  case DTRAIN_COMPRESS_POWERSGD: return "powersgd";
  }
  return "?";
}

DTRAIN_API char *dt_compress_format(dt_compress c, char *out, size_t cap) {
  if (!out || cap == 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_compress_format: %s", !out ? "out is NULL" : "cap is 0");
    return NULL;
  }
  if (c.kind == DTRAIN_COMPRESS_TOPK) snprintf(out, cap, "topk:%g", (double)c.fraction);
  else if (c.kind == DTRAIN_COMPRESS_POWERSGD) snprintf(out, cap, "powersgd:%d", c.rank);
  else snprintf(out, cap, "%s", dt_compress_name(c));
  return out;
}

/* The number after "topk:" / "powersgd:": all of it, finite. */
static int dt__compress_number(const char *t, double *v) {
  char *end = NULL;
  if (!((*t >= '0' && *t <= '9') || *t == '.')) return 0; /* no sign, space, inf or nan */
  *v = strtod(t, &end);
  return end && *end == '\0' && isfinite(*v);
}

DTRAIN_API dt_result dt_compress_parse(const char *text, dt_compress *out) {
  if (!text || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_compress_parse: %s is NULL", !text ? "text" : "out");
  memset(out, 0, sizeof *out);
  double v = 0.0;
  if (!strcmp(text, "none")) out->kind = DTRAIN_COMPRESS_NONE;
  else if (!strcmp(text, "fp16")) out->kind = DTRAIN_COMPRESS_FP16;
  else if (!strcmp(text, "bf16")) out->kind = DTRAIN_COMPRESS_BF16;
  else if (!strncmp(text, "topk:", 5)) {
    if (!dt__compress_number(text + 5, &v) || !(v > 0.0 && v <= 1.0))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_compress_parse: '%s': topk:F needs a fraction F in (0, 1], "
                       "e.g. topk:0.01", text);
    out->kind = DTRAIN_COMPRESS_TOPK;
    out->fraction = (float)v;
  } else if (!strncmp(text, "powersgd:", 9)) {
    if (!dt__compress_number(text + 9, &v) || v != floor(v) || v < 1.0 || v > 1024.0)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_compress_parse: '%s': powersgd:R needs a rank R in 1..1024, "
                       "e.g. powersgd:4", text);
    out->kind = DTRAIN_COMPRESS_POWERSGD;
    out->rank = (int)v;
  } else
    return dt__error(DTRAIN_ERR_INVALID_ARG,
                     "dt_compress_parse: '%s': expected none, fp16, bf16, topk:F or powersgd:R", text);
  return DTRAIN_OK;
}

/* The bytes a float ring all-reduce of n values sends from one of W ranks. */
DTRAIN_PRIVATE uint64_t dt__ring_bytes(size_t n, int W) {
  return W > 1 ? (uint64_t)(2.0 * (double)(W - 1) / (double)W * (double)n * sizeof(float)) : 0;
}

/* ---- 16-bit floats --------------------------------------------------------------------------- */

/* float -> IEEE binary16, rounded to nearest, ties to even; Inf and NaN kept.
 * Normal results: rebias the exponent and round the 13 dropped bits in
 * integer arithmetic (half a unit minus one, plus the kept bit's parity: ties
 * go to even; a carry moves into the exponent and past 65504 to Inf).
 * Subnormal results: a float addition does the rounding -- adding 0.5 (bits
 * 126 << 23) leaves the value in units of 2^-24 in the low mantissa bits,
 * rounded by the FPU's nearest-even. */
DTRAIN_PRIVATE uint16_t dt__f16_of(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x47800000u) /* 65536 and up, Inf, NaN */
    return (uint16_t)(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax < 0x38800000u) { /* below 2^-14: subnormal or zero */
    const uint32_t magic = 126u << 23;
    float a, m;
    memcpy(&a, &ax, 4);
    memcpy(&m, &magic, 4);
    a += m;
    uint32_t r;
    memcpy(&r, &a, 4);
    return (uint16_t)(sign | (r - magic));
  }
  uint32_t odd = (ax >> 13) & 1u;
  ax += 0xC8000FFFu + odd; /* (15 - 127) << 23 (mod 2^32), plus the rounding */
  return (uint16_t)(sign | (ax >> 13));
}

DTRAIN_PRIVATE float dt__f32_of_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, x;
  float f;
  if (e == 0) {
    f = (float)m * 5.9604644775390625e-8f; /* m x 2^-24, exact */
    return sign ? -f : f;
  }
  if (e == 31) x = sign | 0x7F800000u | (m << 13);
  else x = sign | ((e + 112u) << 23) | (m << 13);
  memcpy(&f, &x, 4);
  return f;
}

/* float -> bfloat16 (the top half of a float), rounded to nearest, ties to even. */
DTRAIN_PRIVATE uint16_t dt__bf16_of(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN stays NaN */
  x += 0x7FFFu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

DTRAIN_PRIVATE int dt__f16_exponent(float m, int finite) {
  int e = 0;
  if (finite && m > 0.0f) { /* the largest value lands in [2^14, 2^15] */
    int ex;
    (void)frexpf(m, &ex);
    e = 15 - ex;
    if (e > 127) e = 127;
    if (e < -126) e = -126;
  }
  return e;
}

DTRAIN_PRIVATE float dt__f32_of_bf16(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

#if !defined(DTRAIN_NO_DIST)
/* ---- messages ------------------------------------------------------------------------------ */
/* A message of k values: one float of header (fp16: the scale's exponent e,
 * values were multiplied by 2^e; bf16: 0), then the 16-bit values, two per
 * float slot, low half first (as bytes: the same on every host). */
DTRAIN_PRIVATE size_t dt__cmsg_slots(size_t k) { return 1 + (k + 1) / 2; }

static void dt__cmsg_put(float *slots, size_t i, uint16_t v) {
  unsigned char *b = (unsigned char *)(slots + 1) + 2 * i;
  b[0] = (unsigned char)(v & 0xFFu);
  b[1] = (unsigned char)(v >> 8);
}

static uint16_t dt__cmsg_get(const float *slots, size_t i) {
  const unsigned char *b = (const unsigned char *)(slots + 1) + 2 * i;
  return (uint16_t)(b[0] | (b[1] << 8));
}

DTRAIN_PRIVATE void dt__cmsg_encode(dt_compress_kind kind, const float *x, size_t k, float *slots) {
  int e = 0;
  if (kind == DTRAIN_COMPRESS_FP16) {
    float m = 0.0f;
    int finite = 1;
    for (size_t i = 0; i < k; i++) {
      float a = fabsf(x[i]);
      if (!(a <= FLT_MAX)) finite = 0;
      else if (a > m) m = a;
    }
    e = dt__f16_exponent(m, finite);
    float s = ldexpf(1.0f, e);
    for (size_t i = 0; i < k; i++) dt__cmsg_put(slots, i, dt__f16_of(x[i] * s));
  } else {
    for (size_t i = 0; i < k; i++) dt__cmsg_put(slots, i, dt__bf16_of(x[i]));
  }
  if (k % 2) dt__cmsg_put(slots, k, 0);
  slots[0] = (float)e;
}

/* Decoded values into y (add: y += them). DTRAIN_ERR_PROTOCOL for a header
 * no encoder writes. */
DTRAIN_PRIVATE dt_result dt__cmsg_decode(dt_compress_kind kind, const float *slots, size_t k, float *y, int add) {
  float h = slots[0];
  if (!(h >= -126.0f && h <= 127.0f) || h != (float)(int)h || (kind == DTRAIN_COMPRESS_BF16 && h != 0.0f))
    return dt__error(DTRAIN_ERR_PROTOCOL, "compressed gradient message with header %g", (double)h);
  float s = ldexpf(1.0f, -(int)h);
  for (size_t i = 0; i < k; i++) {
    uint16_t v = dt__cmsg_get(slots, i);
    float f = kind == DTRAIN_COMPRESS_FP16 ? dt__f32_of_f16(v) * s : dt__f32_of_bf16(v);
    y[i] = add ? y[i] + f : f;
  }
  return DTRAIN_OK;
}

/* ---- the ring ------------------------------------------------------------------------------ */

static void dt__cring_chunk(size_t n, int W, int c, size_t *b, size_t *e) {
  *b = (size_t)((uint64_t)n * (uint64_t)c / (uint64_t)W);
  *e = (size_t)((uint64_t)n * (uint64_t)(c + 1) / (uint64_t)W);
}

DTRAIN_PRIVATE dt_result dt__cring_swap(dt_comm *x, int rank, int to, int from, const float *sb, size_t sn,
                                        float *rb, size_t rn) {
  dt_comm_request *q[2] = {NULL, NULL};
  dt_result rc = dt_comm_irecv(x, rank, from, DT__COMPRESS_TAG, rb, rn, &q[0]);
  if (rc == DTRAIN_OK) rc = dt_comm_isend(x, rank, to, DT__COMPRESS_TAG, sb, sn, &q[1]);
  dt_result rw = dt_comm_waitall(q, q[1] ? 2 : 1);
  return rc != DTRAIN_OK ? rc : rw;
}

DTRAIN_PRIVATE size_t dt__compress_scratch(size_t n, int W) {
  size_t most = n / (size_t)W + 1;
  return 3 * dt__cmsg_slots(most);
}

DTRAIN_PRIVATE dt_result dt__compress_allreduce(dt_comm *x, int rank, dt_compress_kind kind, float *buf, size_t n,
                                                float *scratch, uint64_t *sent) {
  const int W = dt_comm_world(x);
  if (W < 2 || n == 0) return DTRAIN_OK;
  size_t cap = dt__cmsg_slots(n / (size_t)W + 1);
  float *sb = scratch, *rb[2] = {scratch + cap, scratch + 2 * cap};
  const int to = (rank + 1) % W, from = (rank + W - 1) % W;
  dt_result rc = DTRAIN_OK;
  /* reduce-scatter: at step s send chunk rank-s, add chunk rank-s-1 */
  for (int s = 0; s < W - 1 && rc == DTRAIN_OK; s++) {
    int cs = (rank - s + 2 * W) % W, cr = (rank - s - 1 + 2 * W) % W;
    size_t b, e, rb0, re;
    dt__cring_chunk(n, W, cs, &b, &e);
    dt__cring_chunk(n, W, cr, &rb0, &re);
    dt__cmsg_encode(kind, buf + b, e - b, sb);
    rc = dt__cring_swap(x, rank, to, from, sb, dt__cmsg_slots(e - b), rb[0], dt__cmsg_slots(re - rb0));
    if (rc == DTRAIN_OK) rc = dt__cmsg_decode(kind, rb[0], re - rb0, buf + rb0, 1);
    *sent += dt__cmsg_slots(e - b) * sizeof(float);
  }
  if (rc != DTRAIN_OK) return rc;
  /* this rank's chunk (rank+1) is summed: rounded once, the same bytes for everyone */
  int own = (rank + 1) % W;
  size_t ob, oe;
  dt__cring_chunk(n, W, own, &ob, &oe);
  dt__cmsg_encode(kind, buf + ob, oe - ob, sb);
  rc = dt__cmsg_decode(kind, sb, oe - ob, buf + ob, 0);
  /* all-gather: forward each message as received */
  const float *out = sb;
  for (int s = 0; s < W - 1 && rc == DTRAIN_OK; s++) {
    int cs = (rank + 1 - s + 2 * W) % W, cr = (rank - s + 2 * W) % W;
    size_t b, e, rb0, re;
    dt__cring_chunk(n, W, cs, &b, &e);
    dt__cring_chunk(n, W, cr, &rb0, &re);
    float *in = rb[s % 2];
    rc = dt__cring_swap(x, rank, to, from, out, dt__cmsg_slots(e - b), in, dt__cmsg_slots(re - rb0));
    if (rc == DTRAIN_OK) rc = dt__cmsg_decode(kind, in, re - rb0, buf + rb0, 0);
    *sent += dt__cmsg_slots(e - b) * sizeof(float);
    out = in;
  }
  return rc;
}
#endif /* DTRAIN_NO_DIST */
