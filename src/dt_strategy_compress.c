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
#include "dt_ops_internal.h"

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

/* ---- arrays of 16-bit floats ---------------------------------------------------------------
 * The wire's 16-bit values are little-endian pairs of bytes. On x86-64 the
 * conversions go 4 at a time in SSE2 (baseline there), with the scalar
 * functions' own steps in integer lanes (and the same float addition for
 * fp16's subnormals, the same products), so every value has the bits the
 * scalar function gives it, in any floating-point mode: both ends of a wire
 * may convert with either. */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__) && defined(DT__CPU_X86)
#  define DT__H16_SSE 1
#  include <emmintrin.h>
/* (inlined: as calls, the lanes go through memory) */
#  define DT__H16_IN static inline __attribute__((always_inline))

DT__H16_IN __m128i dt__h16_sel(__m128i mask, __m128i a, __m128i b) { /* mask ? a : b */
  return _mm_or_si128(_mm_and_si128(mask, a), _mm_andnot_si128(mask, b));
}

/* dt__f16_of, 4 lanes (32-bit results). */
DT__H16_IN __m128i dt__h16_f16_sse(__m128 f) {
  const __m128i x = _mm_castps_si128(f), magic = _mm_set1_epi32(126 << 23);
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(0x8000));
  const __m128i ax = _mm_and_si128(x, _mm_set1_epi32(0x7FFFFFFF));
  __m128i big = _mm_cmpgt_epi32(ax, _mm_set1_epi32(0x477FFFFF)), nan = _mm_cmpgt_epi32(ax, _mm_set1_epi32(0x7F800000));
  __m128i small = _mm_cmplt_epi32(ax, _mm_set1_epi32(0x38800000));
  __m128i inf = dt__h16_sel(nan, _mm_set1_epi32(0x7E00), _mm_set1_epi32(0x7C00));
  __m128i sub = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(ax), _mm_castsi128_ps(magic))), magic);
  __m128i odd = _mm_and_si128(_mm_srli_epi32(ax, 13), _mm_set1_epi32(1));
  __m128i nor = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(ax, _mm_set1_epi32((int)0xC8000FFFu)), odd), 13);
  return _mm_or_si128(sign, dt__h16_sel(big, inf, dt__h16_sel(small, sub, nor)));
}

/* dt__bf16_of, 4 lanes. */
DT__H16_IN __m128i dt__h16_bf16_sse(__m128 f) {
  const __m128i x = _mm_castps_si128(f);
  __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(x, _mm_set1_epi32(0x7FFFFFFF)), _mm_set1_epi32(0x7F800000));
  __m128i top = _mm_srli_epi32(x, 16);
  __m128i half = _mm_add_epi32(_mm_set1_epi32(0x7FFF), _mm_and_si128(top, _mm_set1_epi32(1)));
  __m128i rnd = _mm_srli_epi32(_mm_add_epi32(x, half), 16);
  return dt__h16_sel(nan, _mm_or_si128(top, _mm_set1_epi32(0x40)), rnd);
}

/* dt__f32_of_f16, 4 lanes (the 16-bit values in the low halves). */
DT__H16_IN __m128 dt__h16_f32_sse(__m128i h) {
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  const __m128i e = _mm_and_si128(_mm_srli_epi32(h, 10), _mm_set1_epi32(0x1F));
  const __m128i m = _mm_and_si128(h, _mm_set1_epi32(0x3FF));
  __m128i zero = _mm_cmpeq_epi32(e, _mm_setzero_si128()), top = _mm_cmpeq_epi32(e, _mm_set1_epi32(31));
  __m128i nor = _mm_or_si128(_mm_slli_epi32(_mm_add_epi32(e, _mm_set1_epi32(112)), 23), _mm_slli_epi32(m, 13));
  __m128i inf = _mm_or_si128(_mm_set1_epi32(0x7F800000), _mm_slli_epi32(m, 13));
  __m128i sub = _mm_castps_si128(_mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(5.9604644775390625e-8f)));
  return _mm_castsi128_ps(_mm_or_si128(sign, dt__h16_sel(zero, sub, dt__h16_sel(top, inf, nor))));
}

/* 8 32-bit lanes (values < 2^16) to 8 16-bit values. */
DT__H16_IN __m128i dt__h16_pack(__m128i a, __m128i b) {
  a = _mm_srai_epi32(_mm_slli_epi32(a, 16), 16); /* sign-extended: packs keeps the bits */
  b = _mm_srai_epi32(_mm_slli_epi32(b, 16), 16);
  return _mm_packs_epi32(a, b);
}
#endif

/* With AVX2 (dt__simd_level; such CPUs have F16C): 16 values at a time,
 * fp16 through the F16C conversions, which round as dt__f16_of does and
 * are exact the other way. A NaN encodes with another payload there, so a
 * block holding one is encoded the scalar way. Each returns how many values
 * it did (whole blocks of 16). */
#if defined(DT__H16_SSE)
#  define DT__H16_AVX2 1
#  include <immintrin.h>
__attribute__((target("avx2,f16c"))) static size_t dt__h16_encode_avx2(int f16, const float *x, const float *sub,
                                                                       float scale, unsigned char *out, size_t n) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000), one = _mm256_set1_epi32(1);
  const __m256i half = _mm256_set1_epi32(0x7FFF), quiet = _mm256_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    if (sub) {
      a = _mm256_sub_ps(a, _mm256_loadu_ps(sub + i));
      b = _mm256_sub_ps(b, _mm256_loadu_ps(sub + i + 8));
    }
    if (f16) {
      a = _mm256_mul_ps(a, vs);
      b = _mm256_mul_ps(b, vs);
      if (_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q))) { /* a NaN: this block the scalar way */
        for (size_t j = i; j < i + 16; j++)
          dt__put_le16(out + 2 * j, dt__f16_of((sub ? x[j] - sub[j] : x[j]) * scale));
        continue;
      }
      _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128((__m128i *)(void *)(out + 2 * i + 16), _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
      continue;
    }
    __m256i h[2];
    for (int k = 0; k < 2; k++) {
      __m256i v = _mm256_castps_si256(k ? b : a), top = _mm256_srli_epi32(v, 16);
      __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, mag), inf);
      __m256i rnd = _mm256_srli_epi32(_mm256_add_epi32(v, _mm256_add_epi32(half, _mm256_and_si256(top, one))), 16);
      h[k] = _mm256_blendv_epi8(rnd, _mm256_or_si256(top, quiet), nan);
    }
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
    _mm256_storeu_si256((__m256i *)(void *)(out + 2 * i), p);
  }
  return i;
}

/* dt__h16_absmax's body, 16 at a time (in two chains: the max's latency) into m[0..7]. */
__attribute__((target("avx2"))) static size_t dt__h16_absmax_avx2(const float *x, const float *sub, size_t n,
                                                                  float *m, int *finite) {
  const __m256 big = _mm256_set1_ps(FLT_MAX), mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    if (sub) {
      a = _mm256_sub_ps(a, _mm256_loadu_ps(sub + i));
      b = _mm256_sub_ps(b, _mm256_loadu_ps(sub + i + 8));
    }
    a = _mm256_and_ps(a, mag);
    b = _mm256_and_ps(b, mag);
    __m256 oka = _mm256_cmp_ps(a, big, _CMP_LE_OQ), okb = _mm256_cmp_ps(b, big, _CMP_LE_OQ); /* false: Inf, NaN */
    bad = _mm256_or_ps(bad, _mm256_xor_ps(_mm256_and_ps(oka, okb), _mm256_castsi256_ps(_mm256_set1_epi32(-1))));
    m0 = _mm256_max_ps(m0, _mm256_and_ps(a, oka));
    m1 = _mm256_max_ps(m1, _mm256_and_ps(b, okb));
  }
  _mm256_storeu_ps(m, _mm256_max_ps(m0, m1));
  if (!_mm256_testz_ps(bad, bad)) *finite = 0;
  return i;
}

__attribute__((target("avx2,f16c"))) static size_t dt__h16_decode_avx2(int f16, const unsigned char *in, float unscale,
                                                                       float *y, size_t n, int add) {
  const __m256 vu = _mm256_set1_ps(unscale);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i h0 = _mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i));
    __m128i h1 = _mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i + 16));
    __m256 a, b;
    if (f16) { /* (F16C quiets a NaN that dt__f32_of_f16 keeps signalling; the product quiets both alike) */
      a = _mm256_mul_ps(_mm256_cvtph_ps(h0), vu);
      b = _mm256_mul_ps(_mm256_cvtph_ps(h1), vu);
    } else {
      a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
      b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
    }
    if (add) {
      a = _mm256_add_ps(_mm256_loadu_ps(y + i), a);
      b = _mm256_add_ps(_mm256_loadu_ps(y + i + 8), b);
    }
    _mm256_storeu_ps(y + i, a);
    _mm256_storeu_ps(y + i + 8, b);
  }
  return i;
}
#endif

DTRAIN_PRIVATE float dt__h16_absmax(const float *x, const float *sub, size_t n, int *finite) {
  float m = 0.0f;
  size_t i = 0;
#ifdef DT__H16_AVX2
  if (dt__simd_level() >= DT__SIMD_AVX2) {
    float l[8];
    i = dt__h16_absmax_avx2(x, sub, n, l, finite);
    for (int j = 0; j < 8; j++) m = l[j] > m ? l[j] : m;
  }
#endif
#ifdef DT__H16_SSE
  const __m128 big = _mm_set1_ps(FLT_MAX), mag = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
  __m128 vm = _mm_setzero_ps(), bad = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 v = _mm_loadu_ps(x + i);
    if (sub) v = _mm_sub_ps(v, _mm_loadu_ps(sub + i));
    v = _mm_and_ps(v, mag);
    __m128 ok = _mm_cmple_ps(v, big); /* false for Inf and NaN */
    bad = _mm_or_ps(bad, _mm_andnot_ps(ok, mag));
    vm = _mm_max_ps(vm, _mm_and_ps(v, ok));
  }
  float l[4];
  _mm_storeu_ps(l, vm);
  for (int j = 0; j < 4; j++) m = l[j] > m ? l[j] : m;
  if (_mm_movemask_ps(_mm_cmpneq_ps(bad, _mm_setzero_ps()))) *finite = 0;
#endif
  for (; i < n; i++) {
    float a = fabsf(sub ? x[i] - sub[i] : x[i]);
    if (!(a <= FLT_MAX)) *finite = 0;
    else if (a > m) m = a;
  }
  return m;
}

DTRAIN_PRIVATE void dt__h16_encode(dt_compress_kind kind, const float *x, const float *sub, float scale,
                                   unsigned char *out, size_t n) {
  const int f16 = kind == DTRAIN_COMPRESS_FP16;
  size_t i = 0;
#ifdef DT__H16_AVX2
  if (dt__simd_level() >= DT__SIMD_AVX2) i = dt__h16_encode_avx2(f16, x, sub, scale, out, n);
#endif
#ifdef DT__H16_SSE
  const __m128 vs = _mm_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
    if (sub) {
      a = _mm_sub_ps(a, _mm_loadu_ps(sub + i));
      b = _mm_sub_ps(b, _mm_loadu_ps(sub + i + 4));
    }
    __m128i h = f16 ? dt__h16_pack(dt__h16_f16_sse(_mm_mul_ps(a, vs)), dt__h16_f16_sse(_mm_mul_ps(b, vs)))
                    : dt__h16_pack(dt__h16_bf16_sse(a), dt__h16_bf16_sse(b));
    _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h);
  }
#endif
  for (; i < n; i++) {
    float v = sub ? x[i] - sub[i] : x[i];
    dt__put_le16(out + 2 * i, f16 ? dt__f16_of(v * scale) : dt__bf16_of(v));
  }
}

DTRAIN_PRIVATE void dt__h16_decode(dt_compress_kind kind, const unsigned char *in, float unscale, float *y, size_t n,
                                   int add) {
  const int f16 = kind == DTRAIN_COMPRESS_FP16;
  size_t i = 0;
#ifdef DT__H16_AVX2
  if (dt__simd_level() >= DT__SIMD_AVX2) i = dt__h16_decode_avx2(f16, in, unscale, y, n, add);
#endif
#ifdef DT__H16_SSE
  const __m128 vu = _mm_set1_ps(unscale);
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i)), z = _mm_setzero_si128();
    __m128i lo = _mm_unpacklo_epi16(h, z), hi = _mm_unpackhi_epi16(h, z);
    __m128 a, b;
    if (f16) {
      a = _mm_mul_ps(dt__h16_f32_sse(lo), vu);
      b = _mm_mul_ps(dt__h16_f32_sse(hi), vu);
    } else {
      a = _mm_castsi128_ps(_mm_slli_epi32(lo, 16));
      b = _mm_castsi128_ps(_mm_slli_epi32(hi, 16));
    }
    if (add) {
      a = _mm_add_ps(_mm_loadu_ps(y + i), a);
      b = _mm_add_ps(_mm_loadu_ps(y + i + 4), b);
    }
    _mm_storeu_ps(y + i, a);
    _mm_storeu_ps(y + i + 4, b);
  }
#endif
  for (; i < n; i++) {
    uint16_t h = dt__get_le16(in + 2 * i);
    float f = f16 ? dt__f32_of_f16(h) * unscale : dt__f32_of_bf16(h);
    y[i] = add ? y[i] + f : f;
  }
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

DTRAIN_PRIVATE void dt__cmsg_encode(dt_compress_kind kind, const float *x, size_t k, float *slots) {
  int e = 0, finite = 1;
  if (kind == DTRAIN_COMPRESS_FP16) e = dt__f16_exponent(dt__h16_absmax(x, NULL, k, &finite), finite);
  dt__h16_encode(kind, x, NULL, ldexpf(1.0f, e), (unsigned char *)(slots + 1), k);
  if (k % 2) dt__cmsg_put(slots, k, 0);
  slots[0] = (float)e;
}

/* Decoded values into y (add: y += them). DTRAIN_ERR_PROTOCOL for a header
 * no encoder writes. */
DTRAIN_PRIVATE dt_result dt__cmsg_decode(dt_compress_kind kind, const float *slots, size_t k, float *y, int add) {
  float h = slots[0];
  if (!(h >= -126.0f && h <= 127.0f) || h != (float)(int)h || (kind == DTRAIN_COMPRESS_BF16 && h != 0.0f))
    return dt__error(DTRAIN_ERR_PROTOCOL, "compressed gradient message with header %g", (double)h);
  dt__h16_decode(kind, (const unsigned char *)(slots + 1), ldexpf(1.0f, -(int)h), y, k, add);
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
