/* ===========================================================================
 * dt_rng.c -- portable RNG: splitmix64 seeding, xoshiro256** stream
 * ===========================================================================
 * Integer arithmetic only, so every platform draws the same bits. Normal
 * deviates go through libm in double and are rounded to float, which agrees
 * across IEEE platforms in practice (last-bit libm differences vanish in the
 * rounding almost always).
 */
#include "dt_internal.h"

DTRAIN_PRIVATE uint64_t dt__splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

DTRAIN_API void dt_rng_seed(dt_rng *r, uint64_t seed) {
  if (!r) return;
  uint64_t st = seed;
  for (int i = 0; i < 4; i++) r->s[i] = dt__splitmix64(&st);
}

static uint64_t dt__rng_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* A NULL generator draws nothing: 0 (NaN for the float draws), with the
 * reason in dt_last_error(). The branch is never taken in a correct program
 * and costs nothing measurable next to the draw. */
static uint64_t dt__rng_null(const char *fn) {
  dt__error(DTRAIN_ERR_NULL_ARG, "%s: rng is NULL", fn);
  return 0;
}

DTRAIN_API uint64_t dt_rng_u64(dt_rng *r) {
  if (!r) return dt__rng_null("dt_rng_u64");
  uint64_t *s = r->s;
  uint64_t result = dt__rng_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = dt__rng_rotl(s[3], 45);
  return result;
}

DTRAIN_API uint64_t dt_rng_below(dt_rng *r, uint64_t n) {
  if (!r) return dt__rng_null("dt_rng_below");
  if (n <= 1) return 0;
  /* Rejection: accept draws below the largest multiple of n. */
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = dt_rng_u64(r); while (x >= limit);
  return x % n;
}

DTRAIN_API float dt_rng_uniform(dt_rng *r) {
  if (!r) {
    dt__rng_null("dt_rng_uniform");
    return NAN;
  }
  return (float)(dt_rng_u64(r) >> 40) * (1.0f / 16777216.0f);
}

DTRAIN_API float dt_rng_normal(dt_rng *r) {
  if (!r) {
    dt__rng_null("dt_rng_normal");
    return NAN;
  }
  /* Box-Muller; u1 in (0,1] so log is finite. One value per call keeps the
   * stream position simple to reason about (and to checkpoint). */
  double u1 = ((double)(dt_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  double u2 = (double)(dt_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2));
}

DTRAIN_API void dt_rng_shuffle(dt_rng *r, int32_t *idx, int64_t n) {
  if (!r || (!idx && n > 1)) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_rng_shuffle: %s is NULL", r ? "idx" : "rng");
    return;
  }
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)dt_rng_below(r, (uint64_t)i + 1);
    int32_t t = idx[i];
    idx[i] = idx[j];
    idx[j] = t;
  }
}
