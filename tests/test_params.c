/* Flat parameter buffers, the portable RNG, initializers, and parameter views in a graph. */
#include "harness.h"

/* ---- parameters ------------------------------------------------------------------ */

static void test_add_find_info(void) {
  dt_params *p = dt_params_create(1);
  CHECK(p && dt_params_count(p) == 0 && dt_params_size(p) == 0 && dt_params_trainable_size(p) == 0);
  int64_t s35[2] = {3, 5}, s5[1] = {5}, s73[2] = {7, 3}, s2333[4] = {2, 3, 3, 3};
  CHECK(dt_params_add(p, "w", 2, s35, dt_init_glorot_uniform()) == 0);
  CHECK(dt_params_add(p, "b", 1, s5, dt_init_zeros()) == 1);
  CHECK(dt_params_add_buffer(p, "running_mean", 1, s5, dt_init_constant(2.5f)) == 2);
  CHECK(dt_params_add(p, "emb", 2, s73, dt_init_normal(0.0f, 0.02f)) == 3);
  CHECK(dt_params_add(p, "scale", 0, NULL, dt_init_constant(3.0f)) == 4);
  CHECK(dt_params_add(p, "conv", 4, s2333, dt_init_he_normal()) == 5);
  CHECK(dt_params_count(p) == 6);
  const size_t sizes[6] = {15, 5, 5, 21, 1, 54};
  const int trainable[6] = {1, 1, 0, 1, 1, 1};
  const int decay[6] = {1, 0, 0, 1, 0, 1};
  const char *names[6] = {"w", "b", "running_mean", "emb", "scale", "conv"};
  size_t prev_end = 0, tsize = 0;
  for (int i = 0; i < 6; i++) {
    dt_param_info info;
    CHECK(dt_params_info(p, i, &info) == DTRAIN_OK);
    CHECK_MSG(info.offset % 16 == 0, "param %d offset %zu not 16-float aligned", i, info.offset);
    CHECK(((uintptr_t)(dt_params_data(p) + info.offset)) % 64 == 0);
    CHECK(((uintptr_t)(dt_params_grad(p) + info.offset)) % 64 == 0);
    CHECK(info.offset >= prev_end && info.offset < prev_end + 16); /* packed, no overlap */
    CHECK(info.size == sizes[i]);
    CHECK(strcmp(info.name, names[i]) == 0);
    CHECK(info.trainable == trainable[i] && info.decay == decay[i]);
    CHECK(dt_params_find(p, names[i]) == i);
    prev_end = info.offset + info.size;
    if (trainable[i]) tsize += info.size;
  }
  CHECK(dt_params_size(p) == prev_end);
  CHECK(dt_params_trainable_size(p) == tsize);
  dt_param_info info;
  CHECK(dt_params_info(p, 5, &info) == DTRAIN_OK);
  CHECK(info.ndim == 4 && info.shape[0] == 2 && info.shape[1] == 3 && info.shape[3] == 3);
  CHECK(dt_params_info(p, 4, &info) == DTRAIN_OK && info.ndim == 0 && info.size == 1);
  CHECK(dt_params_data(p)[info.offset] == 3.0f);
  CHECK(dt_params_info(p, 2, &info) == DTRAIN_OK);
  CHECK(dt_params_data(p)[info.offset] == 2.5f && dt_params_data(p)[info.offset + 4] == 2.5f);
  /* lookups that fail */
  CHECK(dt_params_find(p, "nope") == DTRAIN_ERR_NOT_FOUND);
  CHECK(dt_params_find(p, "W") == DTRAIN_ERR_NOT_FOUND);
  CHECK(dt_params_find(NULL, "w") == DTRAIN_ERR_NULL_ARG);
  CHECK_ERR(dt_params_info(p, 6, &info), DTRAIN_ERR_INDEX, "index 6 out of range");
  CHECK_ERR(dt_params_info(p, -1, &info), DTRAIN_ERR_INDEX, "out of range");
  CHECK_ERR(dt_params_info(p, 0, NULL), DTRAIN_ERR_NULL_ARG, "dt_params_info");
  /* decay flags */
  CHECK(dt_params_set_decay(p, 1, 1) == DTRAIN_OK);
  CHECK(dt_params_info(p, 1, &info) == DTRAIN_OK && info.decay == 1);
  CHECK(dt_params_set_decay(p, 0, 0) == DTRAIN_OK);
  CHECK(dt_params_info(p, 0, &info) == DTRAIN_OK && info.decay == 0);
  CHECK(dt_params_set_decay(p, 2, 1) == DTRAIN_OK);
  CHECK(dt_params_info(p, 2, &info) == DTRAIN_OK && info.decay == 0); /* buffers never decay */
  CHECK_ERR(dt_params_set_decay(p, 9, 1), DTRAIN_ERR_INDEX, "dt_params_set_decay");
  CHECK_ERR(dt_params_set_decay(NULL, 0, 1), DTRAIN_ERR_NULL_ARG, "dt_params_set_decay");
  dt_params_destroy(p);
  dt_params_destroy(NULL);
  CHECK(dt_params_count(NULL) == 0 && dt_params_size(NULL) == 0 && dt_params_data(NULL) == NULL);
}

static void test_add_errors(void) {
  dt_params *p = dt_params_create(1);
  int64_t s3[1] = {3}, s30[2] = {3, 0}, sneg[2] = {2, -1}, s7[7] = {1, 1, 1, 1, 1, 1, 1};
  CHECK(dt_params_add(p, "a", 1, s3, dt_init_zeros()) == 0);
  CHECK_ERR((dt_result)dt_params_add(p, "a", 1, s3, dt_init_zeros()), DTRAIN_ERR_INVALID_ARG, "name 'a' already used");
  CHECK_ERR((dt_result)dt_params_add_buffer(p, "a", 1, s3, dt_init_zeros()), DTRAIN_ERR_INVALID_ARG, "already used");
  CHECK_ERR((dt_result)dt_params_add(p, "z", 2, s30, dt_init_zeros()), DTRAIN_ERR_EMPTY, "dimension 1 is 0");
  CHECK_ERR((dt_result)dt_params_add(p, "n", 2, sneg, dt_init_zeros()), DTRAIN_ERR_INVALID_ARG, "dimension 1 is -1");
  CHECK_ERR((dt_result)dt_params_add(p, "r", 7, s7, dt_init_zeros()), DTRAIN_ERR_RANK, "7 dimensions");
  CHECK_ERR((dt_result)dt_params_add(p, "r", -1, s7, dt_init_zeros()), DTRAIN_ERR_RANK, "-1 dimensions");
  CHECK_ERR((dt_result)dt_params_add(p, "", 1, s3, dt_init_zeros()), DTRAIN_ERR_INVALID_ARG, "name must have");
  char longname[140];
  memset(longname, 'x', 128);
  longname[128] = '\0';
  CHECK_ERR((dt_result)dt_params_add(p, longname, 1, s3, dt_init_zeros()), DTRAIN_ERR_INVALID_ARG, "1..127 bytes");
  longname[127] = '\0'; /* 127 bytes is fine */
  CHECK(dt_params_add(p, longname, 1, s3, dt_init_zeros()) == 1);
  CHECK_ERR((dt_result)dt_params_add(p, NULL, 1, s3, dt_init_zeros()), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR((dt_result)dt_params_add(NULL, "q", 1, s3, dt_init_zeros()), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR((dt_result)dt_params_add(p, "q", 1, NULL, dt_init_zeros()), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR((dt_result)dt_params_add(p, "u", 1, s3, dt_init_uniform(1.0f, 0.0f)), DTRAIN_ERR_INVALID_ARG, "empty");
  CHECK_ERR((dt_result)dt_params_add(p, "v", 1, s3, dt_init_normal(0.0f, -1.0f)), DTRAIN_ERR_INVALID_ARG, "std");
  /* failed adds leave nothing behind */
  CHECK(dt_params_count(p) == 2);
  CHECK(dt_params_find(p, "z") == DTRAIN_ERR_NOT_FOUND && dt_params_find(p, "u") == DTRAIN_ERR_NOT_FOUND);
  dt_params_destroy(p);
}

static dt_params *make_model(uint64_t seed) {
  dt_params *p = dt_params_create(seed);
  int64_t s45[2] = {4, 5}, s5[1] = {5};
  dt_params_add(p, "w", 2, s45, dt_init_glorot_uniform());
  dt_params_add(p, "b", 1, s5, dt_init_uniform(-1.0f, 1.0f));
  dt_params_add_buffer(p, "rv", 1, s5, dt_init_constant(1.0f));
  return p;
}

static void test_checksum_layout(void) {
  dt_params *a = make_model(11), *b = make_model(11), *c = make_model(12);
  CHECK(dt_params_checksum(a) == dt_params_checksum(b));
  CHECK(dt_params_checksum(a) != dt_params_checksum(c));
  CHECK(dt_params_layout_hash(a) == dt_params_layout_hash(c)); /* same names and shapes */
  float *d = dt_params_data(a);
  float keep = d[3];
  d[3] = nextafterf(keep, 10.0f); /* the smallest possible change */
  CHECK(dt_params_checksum(a) != dt_params_checksum(b));
  d[3] = keep;
  CHECK(dt_params_checksum(a) == dt_params_checksum(b));
  /* the checksum covers buffers too */
  dt_param_info info;
  dt_params_info(a, 2, &info);
  d[info.offset + 4] = 0.5f;
  CHECK(dt_params_checksum(a) != dt_params_checksum(b));
  d[info.offset + 4] = 1.0f;
  /* grads do not change the checksum */
  dt_params_grad(a)[0] = 123.0f;
  CHECK(dt_params_checksum(a) == dt_params_checksum(b));
  /* layout hash: names, shapes and kinds, not values */
  dt_params_destroy(a);
  dt_params_destroy(b);
  dt_params_destroy(c);
  int64_t s5[1] = {5}, s6[1] = {6}, s23[2] = {2, 3}, s32[2] = {3, 2};
  dt_params *l[6];
  for (int i = 0; i < 6; i++) l[i] = dt_params_create((uint64_t)i + 1);
  dt_params_add(l[0], "x", 1, s5, dt_init_zeros());
  dt_params_add(l[1], "x", 1, s5, dt_init_normal(0.0f, 1.0f)); /* other values */
  dt_params_add(l[2], "y", 1, s5, dt_init_zeros());            /* other name */
  dt_params_add(l[3], "x", 1, s6, dt_init_zeros());            /* other size */
  dt_params_add_buffer(l[4], "x", 1, s5, dt_init_zeros());     /* buffer, not trainable */
  dt_params_add(l[5], "x", 1, s5, dt_init_zeros());
  for (int i = 0; i < 6; i++) dt_params_add(l[i], "m", 2, i == 5 ? s32 : s23, dt_init_zeros());
  CHECK(dt_params_layout_hash(l[0]) == dt_params_layout_hash(l[1]));
  CHECK(dt_params_checksum(l[0]) != dt_params_checksum(l[1]));
  for (int i = 2; i < 6; i++) CHECK_MSG(dt_params_layout_hash(l[0]) != dt_params_layout_hash(l[i]), "layout %d", i);
  /* copy: same layout copies values (buffers included); a different layout is refused */
  CHECK(dt_params_copy(l[1], l[0]) == DTRAIN_OK);
  CHECK(dt_params_checksum(l[0]) == dt_params_checksum(l[1]));
  uint64_t before = dt_params_checksum(l[3]);
  CHECK_ERR(dt_params_copy(l[3], l[0]), DTRAIN_ERR_MISMATCH, "layouts differ");
  CHECK_ERR(dt_params_copy(l[5], l[0]), DTRAIN_ERR_MISMATCH, "dt_params_copy");
  CHECK(dt_params_checksum(l[3]) == before);
  CHECK_ERR(dt_params_copy(NULL, l[0]), DTRAIN_ERR_NULL_ARG, "dt_params_copy");
  CHECK_ERR(dt_params_copy(l[0], NULL), DTRAIN_ERR_NULL_ARG, "dt_params_copy");
  for (int i = 0; i < 6; i++) dt_params_destroy(l[i]);
  dt_params *m1 = make_model(5), *m2 = make_model(6);
  CHECK(dt_params_copy(m2, m1) == DTRAIN_OK);
  CHECK(memcmp(dt_params_data(m1), dt_params_data(m2), dt_params_size(m1) * sizeof(float)) == 0);
  dt_params_destroy(m1);
  dt_params_destroy(m2);
}

static void test_grad_helpers(void) {
  dt_params *p = make_model(3);
  size_t n = dt_params_size(p);
  float *g = dt_params_grad(p);
  for (size_t i = 0; i < n; i++) CHECK(g[i] == 0.0f); /* grads start at zero */
  for (size_t i = 0; i < n; i++) g[i] = (float)i - 7.0f;
  dt_params_scale_grad(p, 0.5f);
  int ok = 1;
  for (size_t i = 0; i < n; i++) ok &= g[i] == ((float)i - 7.0f) * 0.5f;
  CHECK(ok);
  uint64_t cs = dt_params_checksum(p);
  dt_params_zero_grad(p);
  ok = 1;
  for (size_t i = 0; i < n; i++) ok &= g[i] == 0.0f;
  CHECK(ok);
  CHECK(dt_params_checksum(p) == cs); /* values untouched */
  dt_params_zero_grad(NULL);
  dt_params_scale_grad(NULL, 2.0f);
  CHECK_NEAR(dt_l2_norm(NULL, 0), 0.0, 0.0);
  float v[3] = {1.0f, 2.0f, 2.0f};
  CHECK(dt_l2_norm(v, 3) == 3.0);
  dt_params_destroy(p);
}

/* ---- RNG ------------------------------------------------------------------------------
 * An independent implementation of the published algorithms (Steele/Lea/Flood
 * SplitMix64 and Blackman/Vigna xoshiro256**), to check the library against. */
typedef struct ref_rng { uint64_t a, b, c, d; } ref_rng;

static uint64_t ref_splitmix(uint64_t *x) {
  uint64_t z = *x = *x + UINT64_C(0x9E3779B97F4A7C15);
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

static ref_rng ref_seed(uint64_t seed) {
  ref_rng r;
  r.a = ref_splitmix(&seed);
  r.b = ref_splitmix(&seed);
  r.c = ref_splitmix(&seed);
  r.d = ref_splitmix(&seed);
  return r;
}

static uint64_t ref_rotl(uint64_t x, unsigned k) { return (x << k) | (x >> (64u - k)); }

static uint64_t ref_next(ref_rng *r) {
  const uint64_t out = ref_rotl(r->b * 5u, 7) * 9u;
  const uint64_t t = r->b << 17;
  r->c ^= r->a;
  r->d ^= r->b;
  r->b ^= r->c;
  r->a ^= r->d;
  r->c ^= t;
  r->d = ref_rotl(r->d, 45);
  return out;
}

static void test_rng_golden(void) {
  /* First outputs for seed 42. Fixed here so that any change in the stream is caught. */
  static const uint64_t golden[5] = {
      UINT64_C(0x15780b2e0c2ec716), UINT64_C(0x6104d9866d113a7e), UINT64_C(0xae17533239e499a1),
      UINT64_C(0xecb8ad4703b360a1), UINT64_C(0xfde6dc7fe2ec5e64)};
  /* The seeding state: the first splitmix64 output for 42 is the well-known 0xbdd732262feb6e95. */
  dt_rng r;
  dt_rng_seed(&r, 42);
  CHECK(r.s[0] == UINT64_C(0xbdd732262feb6e95));
  ref_rng q = ref_seed(42);
  CHECK(r.s[0] == q.a && r.s[1] == q.b && r.s[2] == q.c && r.s[3] == q.d);
  for (int i = 0; i < 5; i++) {
    uint64_t got = dt_rng_u64(&r), want = ref_next(&q);
    CHECK_MSG(got == golden[i], "draw %d: 0x%016llx", i, (unsigned long long)got);
    CHECK(want == golden[i]);
  }
  /* A long run and other seeds (0 included) agree with the reference. */
  const uint64_t seeds[4] = {0, 1, 42, UINT64_C(0xffffffffffffffff)};
  for (int s = 0; s < 4; s++) {
    dt_rng_seed(&r, seeds[s]);
    q = ref_seed(seeds[s]);
    int same = 1;
    for (int i = 0; i < 10000; i++) same &= dt_rng_u64(&r) == ref_next(&q);
    CHECK_MSG(same, "seed %llu", (unsigned long long)seeds[s]);
  }
  /* uniform: the top 24 bits over 2^24 */
  dt_rng_seed(&r, 42);
  q = ref_seed(42);
  for (int i = 0; i < 100; i++) {
    float u = dt_rng_uniform(&r);
    CHECK(u == (float)((double)(ref_next(&q) >> 40) / 16777216.0));
  }
  dt_rng_seed(&r, 42);
  CHECK_NEAR(dt_rng_uniform(&r), 0.0838629603, 1e-9);
  /* normal: Box-Muller on two 53-bit uniforms, u1 in (0,1] */
  dt_rng_seed(&r, 42);
  q = ref_seed(42);
  for (int i = 0; i < 100; i++) {
    double u1 = ((double)(ref_next(&q) >> 11) + 1.0) / 9007199254740992.0;
    double u2 = (double)(ref_next(&q) >> 11) / 9007199254740992.0;
    double want = sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
    CHECK_NEAR(dt_rng_normal(&r), want, 1e-6);
  }
  dt_rng_seed(&r, 42);
  CHECK_NEAR(dt_rng_normal(&r), -1.61322379, 1e-7);
  CHECK_NEAR(dt_rng_normal(&r), 0.781692028, 1e-7);
}

static void test_rng_distributions(void) {
  dt_rng r;
  dt_rng_seed(&r, 7);
  /* below: range and rough uniformity */
  int counts[7] = {0, 0, 0, 0, 0, 0, 0};
  int in_range = 1;
  for (int i = 0; i < 70000; i++) {
    uint64_t v = dt_rng_below(&r, 7);
    if (v >= 7) in_range = 0;
    else counts[v]++;
  }
  CHECK(in_range);
  for (int i = 0; i < 7; i++) CHECK_MSG(counts[i] > 9500 && counts[i] < 10500, "value %d: %d", i, counts[i]);
  CHECK(dt_rng_below(&r, 1) == 0 && dt_rng_below(&r, 0) == 0);
  const uint64_t big = (UINT64_C(1) << 63) + 12345;
  in_range = 1;
  for (int i = 0; i < 1000; i++) in_range &= dt_rng_below(&r, big) < big;
  CHECK(in_range);
  /* uniform in [0,1) */
  double sum = 0, mn = 1, mx = 0;
  for (int i = 0; i < 100000; i++) {
    float u = dt_rng_uniform(&r);
    sum += u;
    if (u < mn) mn = u;
    if (u > mx) mx = u;
  }
  CHECK(mn >= 0.0 && mx < 1.0 && mn < 1e-3 && mx > 0.999);
  CHECK_NEAR(sum / 100000, 0.5, 0.005);
  /* normal: mean 0, std 1 */
  double s1 = 0, s2 = 0;
  for (int i = 0; i < 100000; i++) {
    double x = dt_rng_normal(&r);
    s1 += x;
    s2 += x * x;
  }
  double mean = s1 / 100000, sd = sqrt(s2 / 100000 - mean * mean);
  CHECK_NEAR(mean, 0.0, 0.015);
  CHECK_NEAR(sd, 1.0, 0.015);
  /* shuffle: a permutation, not the identity, reproducible */
  int32_t idx[100], idx2[100];
  int seen[100];
  for (int i = 0; i < 100; i++) idx[i] = idx2[i] = i;
  dt_rng a, b;
  dt_rng_seed(&a, 3);
  dt_rng_seed(&b, 3);
  dt_rng_shuffle(&a, idx, 100);
  dt_rng_shuffle(&b, idx2, 100);
  memset(seen, 0, sizeof seen);
  int perm = 1, moved = 0;
  for (int i = 0; i < 100; i++) {
    if (idx[i] < 0 || idx[i] >= 100 || seen[idx[i]]) perm = 0;
    else seen[idx[i]] = 1;
    moved += idx[i] != i;
  }
  CHECK(perm && moved > 50);
  CHECK(memcmp(idx, idx2, sizeof idx) == 0);
  dt_rng_shuffle(&a, idx, 1);
  dt_rng_shuffle(&a, idx, 0);
  dt_rng_shuffle(NULL, idx, 100);
}

/* ---- initializers ------------------------------------------------------------------------- */

static void stats(const float *x, size_t n, double *mean, double *sd, double *amax) {
  double s1 = 0, s2 = 0, m = 0;
  for (size_t i = 0; i < n; i++) {
    s1 += x[i];
    s2 += (double)x[i] * x[i];
    if (fabs(x[i]) > m) m = fabs(x[i]);
  }
  *mean = s1 / (double)n;
  *sd = sqrt(s2 / (double)n - *mean * *mean);
  *amax = m;
}

static void check_init(const char *name, dt_init init, int ndim, const int64_t *shape, double fan_in, double fan_out,
                       int uniform, int he) {
  dt_params *p = dt_params_create(123);
  CHECK(dt_params_add(p, name, ndim, shape, init) == 0);
  dt_param_info info;
  dt_params_info(p, 0, &info);
  const float *x = dt_params_data(p) + info.offset;
  double mean, sd, amax;
  stats(x, info.size, &mean, &sd, &amax);
  double gain = init.a != 0.0f ? (double)init.a : 1.0;
  double want_sd = he ? sqrt(2.0 / fan_in) : gain * sqrt(2.0 / (fan_in + fan_out));
  if (uniform) {
    double bound = he ? sqrt(6.0 / fan_in) : gain * sqrt(6.0 / (fan_in + fan_out));
    CHECK_MSG(amax <= bound * (1 + 1e-6), "%s: |x| %g > bound %g", name, amax, bound);
    CHECK_MSG(amax > 0.99 * bound, "%s: max %g far below bound %g", name, amax, bound);
    /* U(-l,l) has std l/sqrt(3) == the normal variant's std */
    CHECK_NEAR(bound / sqrt(3.0), want_sd, 1e-12);
  }
  CHECK_MSG(fabs(sd - want_sd) < 0.05 * want_sd, "%s: std %g, want %g", name, sd, want_sd);
  CHECK_MSG(fabs(mean) < 0.05 * want_sd, "%s: mean %g", name, mean);
  dt_params_destroy(p);
}

static void test_initializers(void) {
  int64_t s256[2] = {256, 256}, s128x64[2] = {128, 64}, conv[4] = {64, 32, 3, 3};
  check_init("glorot_uniform", dt_init_glorot_uniform(), 2, s256, 256, 256, 1, 0);
  check_init("glorot_normal", dt_init_glorot_normal(), 2, s256, 256, 256, 0, 0);
  check_init("he_uniform", dt_init_he_uniform(), 2, s256, 256, 256, 1, 1);
  check_init("he_normal", dt_init_he_normal(), 2, s256, 256, 256, 0, 1);
  /* [out, in]: fan_in = 64, fan_out = 128 */
  check_init("glorot_uniform_rect", dt_init_glorot_uniform(), 2, s128x64, 64, 128, 1, 0);
  check_init("glorot_normal_rect", dt_init_glorot_normal(), 2, s128x64, 64, 128, 0, 0);
  check_init("he_uniform_rect", dt_init_he_uniform(), 2, s128x64, 64, 128, 1, 1);
  check_init("he_normal_rect", dt_init_he_normal(), 2, s128x64, 64, 128, 0, 1);
  /* conv [O, C, kh, kw]: fan_in = C*9 = 288, fan_out = O*9 = 576 */
  check_init("he_normal_conv", dt_init_he_normal(), 4, conv, 288, 576, 0, 1);
  check_init("glorot_uniform_conv", dt_init_glorot_uniform(), 4, conv, 288, 576, 1, 0);
  /* gain in a */
  dt_init gu = dt_init_glorot_uniform();
  gu.a = 2.0f;
  check_init("glorot_uniform_gain", gu, 2, s256, 256, 256, 1, 0);
  /* plain uniform / normal / constant */
  dt_params *p = dt_params_create(9);
  CHECK(dt_params_add(p, "u", 2, s256, dt_init_uniform(-0.5f, 1.5f)) == 0);
  CHECK(dt_params_add(p, "n", 2, s256, dt_init_normal(3.0f, 0.5f)) == 1);
  CHECK(dt_params_add(p, "c", 2, s128x64, dt_init_constant(-2.0f)) == 2);
  dt_param_info iu, in, ic;
  dt_params_info(p, 0, &iu);
  dt_params_info(p, 1, &in);
  dt_params_info(p, 2, &ic);
  const float *d = dt_params_data(p);
  double mean, sd, amax, lo = 10, hi = -10;
  for (size_t i = 0; i < iu.size; i++) {
    lo = fmin(lo, d[iu.offset + i]);
    hi = fmax(hi, d[iu.offset + i]);
  }
  CHECK(lo >= -0.5 && hi < 1.5 && lo < -0.49 && hi > 1.49);
  stats(d + in.offset, in.size, &mean, &sd, &amax);
  CHECK_NEAR(mean, 3.0, 0.01);
  CHECK_NEAR(sd, 0.5, 0.025);
  int all = 1;
  for (size_t i = 0; i < ic.size; i++) all &= d[ic.offset + i] == -2.0f;
  CHECK(all);
  dt_params_destroy(p);
  /* dt_init_fill directly, and its errors */
  dt_rng r;
  dt_rng_seed(&r, 1);
  float buf[6];
  int64_t s23[2] = {2, 3};
  CHECK(dt_init_fill(buf, 2, s23, dt_init_constant(4.0f), &r) == DTRAIN_OK && buf[5] == 4.0f);
  CHECK_ERR(dt_init_fill(NULL, 2, s23, dt_init_zeros(), &r), DTRAIN_ERR_NULL_ARG, "dt_init_fill");
  CHECK_ERR(dt_init_fill(buf, 2, s23, dt_init_zeros(), NULL), DTRAIN_ERR_NULL_ARG, "dt_init_fill");
  dt_init bad;
  bad.kind = (dt_init_kind)77;
  bad.a = bad.b = 0;
  CHECK_ERR(dt_init_fill(buf, 2, s23, bad, &r), DTRAIN_ERR_INVALID_ARG, "unknown initializer 77");
}

static void test_init_determinism(void) {
  dt_params *a = make_model(2024), *b = make_model(2024), *c = make_model(2025);
  size_t n = dt_params_size(a);
  CHECK(memcmp(dt_params_data(a), dt_params_data(b), n * sizeof(float)) == 0);
  CHECK(dt_params_checksum(a) == dt_params_checksum(b));
  CHECK(memcmp(dt_params_data(a), dt_params_data(c), n * sizeof(float)) != 0);
  /* Every random element differs with another seed (w and b; rv is constant). */
  dt_param_info info;
  dt_params_info(a, 0, &info);
  int differ = 0;
  for (size_t i = 0; i < info.size; i++) differ += dt_params_data(a)[info.offset + i] != dt_params_data(c)[info.offset + i];
  CHECK(differ == (int)info.size);
  /* The RNG state is the params' own: same seed, same state after the same adds. */
  dt_rng *ra = dt_params_rng(a), *rb = dt_params_rng(b);
  CHECK(ra && rb && memcmp(ra->s, rb->s, sizeof ra->s) == 0);
  CHECK(dt_params_rng(NULL) == NULL);
  /* Values come from the params' RNG in add order: re-seeding by hand reproduces them. */
  dt_rng r;
  dt_rng_seed(&r, 2024);
  float w[20];
  int64_t s45[2] = {4, 5};
  dt_init_fill(w, 2, s45, dt_init_glorot_uniform(), &r);
  CHECK(memcmp(w, dt_params_data(a) + info.offset, sizeof w) == 0);
  dt_params_destroy(a);
  dt_params_destroy(b);
  dt_params_destroy(c);
}

/* ---- parameter views in a graph ------------------------------------------------------------- */

static void test_graph_views(void) {
  dt_params *p = dt_params_create(5);
  int64_t s23[2] = {2, 3}, s3[1] = {3};
  dt_params_add(p, "w", 2, s23, dt_init_normal(0.0f, 1.0f));
  dt_params_add_buffer(p, "rm", 1, s3, dt_init_constant(1.0f));
  dt_params_add(p, "b", 1, s3, dt_init_uniform(-1.0f, 1.0f));
  size_t n = dt_params_size(p);
  dt_param_info iw, irm, ib;
  dt_params_info(p, 0, &iw);
  dt_params_info(p, 1, &irm);
  dt_params_info(p, 2, &ib);
  dt_graph *g = dt_graph_create(p, NULL);
  dt_tensor *w = dt_param(g, 0), *rm = dt_param(g, 1), *b = dt_param(g, 2);
  CHECK(w && rm && b);
  if (!w || !rm || !b) return;
  CHECK(w->data == dt_params_data(p) + iw.offset && w->grad == dt_params_grad(p) + iw.offset);
  CHECK(b->data == dt_params_data(p) + ib.offset && b->grad == dt_params_grad(p) + ib.offset);
  CHECK(rm->data == dt_params_data(p) + irm.offset && rm->grad == NULL);
  CHECK(w->ndim == 2 && w->shape[0] == 2 && w->shape[1] == 3 && w->size == 6);
  CHECK((w->flags & DTRAIN_TENSOR_PARAM) && (w->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  CHECK((rm->flags & DTRAIN_TENSOR_PARAM) && !(rm->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  CHECK(w->param_index == 0 && b->param_index == 2);
  /* grads of y = 3 w land at w's offset and nowhere else */
  const float seed[6] = {1, -2, 0.5f, 4, -1, 0.25f};
  dt_tensor *y = dt_mul_scalar(g, w, 3.0f);
  CHECK(y && dt_backward_grad(g, y, seed) == DTRAIN_OK);
  float *gr = dt_params_grad(p);
  for (size_t i = 0; i < n; i++) {
    double want = (i >= iw.offset && i < iw.offset + 6) ? 3.0 * seed[i - iw.offset] : 0.0;
    CHECK_MSG(gr[i] == (float)want, "grad[%zu] = %g, want %g", i, gr[i], want);
  }
  /* a second step accumulates */
  dt_graph_reset(g);
  w = dt_param(g, 0);
  y = dt_mul_scalar(g, w, 3.0f);
  CHECK(y && dt_backward_grad(g, y, seed) == DTRAIN_OK);
  CHECK(gr[iw.offset + 1] == -12.0f);
  /* b: gradient through dt_add with another tensor */
  dt_graph_reset(g);
  dt_params_zero_grad(p);
  b = dt_param(g, 2);
  rm = dt_param(g, 1);
  dt_tensor *z = dt_mul(g, b, rm); /* rm is a constant here */
  const float s3v[3] = {1, 2, 3};
  CHECK(z && dt_backward_grad(g, z, s3v) == DTRAIN_OK);
  CHECK(gr[ib.offset] == 1.0f && gr[ib.offset + 2] == 3.0f && gr[irm.offset] == 0.0f);

  /* bind to other buffers: data and grads follow */
  float *data2 = (float *)calloc(n, sizeof(float)), *grad2 = (float *)calloc(n, sizeof(float));
  for (size_t i = 0; i < n; i++) data2[i] = (float)i;
  dt_graph_reset(g);
  dt_params_zero_grad(p);
  CHECK(dt_graph_bind(g, data2, grad2) == DTRAIN_OK);
  w = dt_param(g, 0);
  CHECK(w->data == data2 + iw.offset && w->grad == grad2 + iw.offset);
  y = dt_mul_scalar(g, w, 2.0f);
  CHECK(y && y->data[1] == 2.0f * (float)(iw.offset + 1));
  CHECK(y && dt_backward_grad(g, y, seed) == DTRAIN_OK);
  CHECK(grad2[iw.offset] == 2.0f && grad2[iw.offset + 3] == 8.0f);
  int own_zero = 1;
  for (size_t i = 0; i < n; i++) own_zero &= gr[i] == 0.0f;
  CHECK(own_zero);
  /* data only: views have no gradient */
  dt_graph_reset(g);
  CHECK(dt_graph_bind(g, data2, NULL) == DTRAIN_OK);
  w = dt_param(g, 0);
  CHECK(w->data == data2 + iw.offset && w->grad == NULL && !(w->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  /* NULL restores the params' own buffers */
  dt_graph_reset(g);
  CHECK(dt_graph_bind(g, NULL, NULL) == DTRAIN_OK);
  w = dt_param(g, 0);
  CHECK(w->data == dt_params_data(p) + iw.offset && w->grad == dt_params_grad(p) + iw.offset);
  /* errors */
  CHECK_ERR(dt_graph_bind(g, NULL, grad2), DTRAIN_ERR_INVALID_ARG, "grad without data");
  CHECK_ERR(dt_graph_bind(NULL, data2, grad2), DTRAIN_ERR_NULL_ARG, "dt_graph_bind");
  CHECK(dt_param(g, 3) == NULL && dt_graph_error(g) == DTRAIN_ERR_INDEX);
  CHECK(strstr(dt_graph_message(g), "index 3 out of range") != NULL);
  dt_graph *g0 = dt_graph_create(NULL, NULL);
  CHECK_ERR(dt_graph_bind(g0, data2, grad2), DTRAIN_ERR_STATE, "no params");
  CHECK(dt_param(g0, 0) == NULL && dt_graph_error(g0) == DTRAIN_ERR_STATE);
  dt_graph_destroy(g0);
  free(data2);
  free(grad2);
  dt_graph_destroy(g);
  dt_params_destroy(p);
}

/* dt_params_reserve: the buffers allocated once at the reserved size (the
 * adds that follow keep them), the same values as without it, a smaller
 * high-water mark under a fixed budget, and errors that change nothing. */
static void build(dt_params *p, int n) {
  for (int i = 0; i < n; i++) {
    char name[16];
    int64_t s[2] = {33 + i, 17};
    snprintf(name, sizeof name, "w%d", i);
    dt_params_add(p, name, 2, s, dt_init_glorot_uniform());
  }
}

static void test_reserve(void) {
  const int n = 12;
  size_t floats = 0;
  for (int i = 0; i < n; i++) floats += (size_t)(33 + i) * 17;
  dt_params *a = dt_params_create(3), *b = dt_params_create(3);
  build(a, n);
  CHECK(dt_params_reserve(b, n, floats) == DTRAIN_OK);
  float *d0 = dt_params_data(b), *g0 = dt_params_grad(b);
  build(b, n);
  CHECK(dt_params_data(b) == d0 && dt_params_grad(b) == g0); /* never grown */
  CHECK(dt_params_size(a) == dt_params_size(b));
  CHECK(memcmp(dt_params_data(a), dt_params_data(b), dt_params_size(a) * sizeof(float)) == 0);
  CHECK(dt_params_layout_hash(a) == dt_params_layout_hash(b));
  /* Reserving less than is there, or 0, changes nothing. */
  CHECK(dt_params_reserve(b, 0, 0) == DTRAIN_OK && dt_params_data(b) == d0);
  /* More room keeps the values. */
  CHECK(dt_params_reserve(b, 1, 1000) == DTRAIN_OK);
  CHECK(memcmp(dt_params_data(a), dt_params_data(b), dt_params_size(a) * sizeof(float)) == 0);
  CHECK_ERR(dt_params_reserve(NULL, 1, 1), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR(dt_params_reserve(b, -1, 1), DTRAIN_ERR_INVALID_ARG, "count");
  CHECK_ERR(dt_params_reserve(b, 1, SIZE_MAX - 8), DTRAIN_ERR_OVERFLOW, "address space");
  dt_params_destroy(a);
  dt_params_destroy(b);
  /* Under a fixed budget: the high-water mark of a reserved build is about
   * the buffers themselves; growing by doubling needs more. */
  size_t cap = (size_t)8 << 20;
  void *buf = malloc(cap);
  size_t peak[2];
  for (int r = 0; r < 2; r++) {
    CHECK(dt_use_fixed_memory(buf, cap) == DTRAIN_OK);
    dt_params *p = dt_params_create(3);
    if (r) CHECK(dt_params_reserve(p, n, floats) == DTRAIN_OK);
    build(p, n);
    peak[r] = dt_fixed_memory_peak();
    dt_params_destroy(p);
    dt_set_allocator(NULL);
  }
  size_t need = 2 * (floats + (size_t)n * 15) * sizeof(float);
  CHECK_MSG(peak[1] < peak[0] && peak[1] <= need + 16384, "peak %zu reserved, %zu grown, buffers %zu", peak[1], peak[0],
            need);
  /* A budget too small for the reservation: NOMEM, and the params still work. */
  CHECK(dt_use_fixed_memory(buf, 65536) == DTRAIN_OK);
  dt_params *p = dt_params_create(3);
  CHECK_ERR(dt_params_reserve(p, n, floats), DTRAIN_ERR_NOMEM, "out of memory");
  CHECK(dt_params_count(p) == 0 && dt_params_size(p) == 0);
  int64_t s1[1] = {10};
  CHECK(dt_params_add(p, "small", 1, s1, dt_init_zeros()) == 0);
  dt_params_destroy(p);
  CHECK(dt_fixed_memory_used() == 0);
  dt_set_allocator(NULL);
  free(buf);
}

int main(void) {
  TH_RUN(test_add_find_info);
  TH_RUN(test_add_errors);
  TH_RUN(test_checksum_layout);
  TH_RUN(test_grad_helpers);
  TH_RUN(test_rng_golden);
  TH_RUN(test_rng_distributions);
  TH_RUN(test_initializers);
  TH_RUN(test_init_determinism);
  TH_RUN(test_graph_views);
  TH_RUN(test_reserve);
  return th_summary("params");
}
