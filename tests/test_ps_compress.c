/* tests/test_ps_compress.c -- parameter servers over slow links: compressed
 * pushes (fp16, bf16, topk:F, powersgd:R) and 16-bit difference pulls
 * (dt_ps_codec.c):
 *   - the push codec round trip over a model of matrices, vectors and a
 *     buffer sharded on two servers: 16-bit values within their rounding,
 *     buffers exact; top-k with F = 1 is the gradient bitwise, with F < 1 the
 *     k largest exactly and the error kept is the rest, sent at the next
 *     push; PowerSGD sends P Q^T (exact on a rank-1 gradient), and what it
 *     left is kept; the bytes are what dt_net.h says;
 *   - pulls: server and worker copies stay bitwise equal over rounds, and
 *     near the weights;
 *   - every decoder against bad bytes (each field, then random mutations):
 *     DTRAIN_ERR_PROTOCOL naming the fault, the weights untouched;
 *   - over TCP with forked servers: one worker, each form, the exact bytes
 *     per step, training converging like floats, the worker's copy near the
 *     server's weights; 2 workers x 2 servers converging with top-k and
 *     PowerSGD; a worker sending bad compressed frames is dropped with the
 *     reason while the other trains on;
 *   - the strategy: compress accepted for parameter_server over TCP,
 *     refused for an in-process store. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(DTRAIN_NO_DIST)

/* ---- codec tests (no network) ---------------------------------------------------------- */

typedef struct cmodel {
  dt_params *P;
  int owner[8];
  size_t n;
} cmodel;

static void cmodel_init(cmodel *m) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(8);
  int64_t w1[2] = {16, 8}, b1[1] = {8}, bn[1] = {5}, w2[2] = {8, 3}, w3[2] = {12, 12};
  dt_params_add(m->P, "w1", 2, w1, dt_init_zeros());
  dt_params_add(m->P, "b1", 1, b1, dt_init_zeros());
  dt_params_add_buffer(m->P, "bn", 1, bn, dt_init_zeros());
  dt_params_add(m->P, "w2", 2, w2, dt_init_zeros());
  dt_params_add(m->P, "w3", 2, w3, dt_init_zeros());
  dt_ps_shard(m->P, 2, m->owner);
  m->n = dt_params_size(m->P);
}

static float urand(uint64_t *st) { return (float)((double)(dt__splitmix64(st) >> 11) / 4503599627370496.0 * 2.0 - 1.0); }

/* A push vector: gradients of mixed sizes, w3 the outer product u v^T (rank 1), buffer values. */
static void fill_push(const cmodel *m, uint64_t seed, float *g) {
  uint64_t st = seed;
  for (size_t i = 0; i < m->n; i++) g[i] = urand(&st) * (i % 7 == 0 ? 3.0f : 0.2f);
  size_t b = 0, e = 0;
  int tr, dec;
  dt__params_range(m->P, 4, &b, &e, &tr, &dec);
  float u[12], v[12];
  for (int i = 0; i < 12; i++) u[i] = urand(&st), v[i] = urand(&st);
  for (int i = 0; i < 12; i++)
    for (int j = 0; j < 12; j++) g[b + (size_t)i * 12 + (size_t)j] = u[i] * v[j];
}

static int is_trained(const cmodel *m, size_t at) {
  size_t b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(m->P, i, &b, &e, &tr, &dec); i++)
    if (at >= b && at < e) return tr;
  return -1; /* padding */
}

/* Encode g for both servers and decode: dec gets the trained values, buffers in data. Returns total bytes. */
static size_t roundtrip(const cmodel *m, dt_compress c, dt__ef *ef, const float *g, float *dec, float *data) {
  size_t total = 0;
  float *scratch = NULL;
  size_t scap = 0;
  for (int s = 0; s < 2; s++) {
    size_t cap = dt__ps_pushz_cap(m->P, m->owner, s);
    unsigned char *buf = (unsigned char *)malloc(cap);
    size_t len = dt__ps_encode_push(c, ef, m->P, m->owner, s, g, buf);
    CHECK_MSG(len <= cap, "server %d: %zu bytes past the cap %zu", s, len, cap);
    dt_result rc = dt__ps_decode_push(m->P, m->owner, s, buf, len, dec, data, &scratch, &scap);
    CHECK_MSG(rc == DTRAIN_OK, "%s", dt_last_error());
    total += len;
    free(buf);
  }
  dt__free(scratch, scap * sizeof(float));
  return total;
}

static void test_codec_16bit(void) {
  cmodel m;
  cmodel_init(&m);
  float *g = calloc(m.n, 4), *dec = calloc(m.n, 4), *data = calloc(m.n, 4);
  fill_push(&m, 7, g);
  for (int k = 0; k < 2; k++) {
    dt_compress c = {k ? DTRAIN_COMPRESS_BF16 : DTRAIN_COMPRESS_FP16, 0, 0};
    size_t bytes = roundtrip(&m, c, NULL, g, dec, data);
    double worst = 0;
    float gmax = 0;
    for (size_t i = 0; i < m.n; i++)
      if (is_trained(&m, i) == 1) gmax = fmaxf(gmax, fabsf(g[i]));
    size_t ntr = 0, nbuf = 0;
    for (size_t i = 0; i < m.n; i++) {
      int t = is_trained(&m, i);
      if (t == 1) {
        ntr++;
        /* fp16: half a unit of the 11-bit significand, relative to the value (all of the
         * shard's are far above 2^-14 of the largest); bf16: of the 8-bit one */
        double tol = k ? fabs(g[i]) * 0x1p-8 : fabs(g[i]) * 0x1p-11 + gmax * 0x1p-24;
        worst = fmax(worst, fabs(dec[i] - g[i]) - tol);
      } else if (t == 0) {
        nbuf++;
        CHECK_MSG(data[i] == g[i], "buffer value %zu: %g, pushed %g", i, data[i], g[i]);
      }
    }
    CHECK_MSG(worst <= 0, "%s: a value off by %g past its rounding", dt_compress_name(c), worst);
    CHECK_MSG(bytes == 2 * 24 + 2 * ntr + 4 * nbuf, "%s: %zu bytes, expected %zu", dt_compress_name(c), bytes,
              2 * 24 + 2 * ntr + 4 * nbuf);
  }
  free(g), free(dec), free(data);
  dt_params_destroy(m.P);
}

static void test_codec_topk(void) {
  cmodel m;
  cmodel_init(&m);
  float *g = calloc(m.n, 4), *dec = calloc(m.n, 4), *data = calloc(m.n, 4), *dec2 = calloc(m.n, 4);
  fill_push(&m, 11, g);
  size_t ntr = 0;
  for (size_t i = 0; i < m.n; i++) ntr += is_trained(&m, i) == 1;
  /* F = 1: the gradient itself */
  dt__ef *ef = NULL;
  dt_compress all = {DTRAIN_COMPRESS_TOPK, 1.0f, 0};
  CHECK(dt__ef_create_params(all, m.P, 1, &ef) == DTRAIN_OK);
  dt__ef_local(ef, g);
  roundtrip(&m, all, ef, g, dec, data);
  int same = 1;
  for (size_t i = 0; i < m.n; i++)
    if (is_trained(&m, i) == 1) same &= memcmp(&dec[i], &g[i], 4) == 0;
  CHECK_MSG(same, "topk:1 is not the gradient bitwise");
  dt__ef_destroy(ef);
  /* F = 0.1: the k largest, the rest kept and sent next */
  dt_compress c = {DTRAIN_COMPRESS_TOPK, 0.1f, 0};
  CHECK(dt__ef_create_params(c, m.P, 1, &ef) == DTRAIN_OK);
  dt__ef_local(ef, g);
  size_t bytes = roundtrip(&m, c, ef, g, dec, data);
  dt__ef_commit(ef);
  size_t k = (size_t)ceil(0.1 * (double)ntr), sent = 0;
  float least_sent = INFINITY, most_left = 0;
  const float *err = dt__ef_error(ef);
  int exact = 1, kept = 1;
  for (size_t i = 0; i < m.n; i++) {
    if (is_trained(&m, i) != 1) continue;
    if (dec[i] != 0.0f) {
      sent++;
      exact &= dec[i] == g[i];
      least_sent = fminf(least_sent, fabsf(g[i]));
      kept &= err[i] == 0.0f;
    } else {
      most_left = fmaxf(most_left, fabsf(g[i]));
      kept &= err[i] == g[i];
    }
  }
  CHECK_MSG(sent == k, "%zu values sent, k = %zu", sent, k);
  CHECK(exact);
  CHECK_MSG(least_sent >= most_left, "sent down to %g, left %g", least_sent, most_left);
  CHECK_MSG(kept, "the error kept is not what was left out");
  size_t nbuf = 5;
  CHECK_MSG(bytes == 2 * 24 + 8 * k + 4 * nbuf, "%zu bytes, expected %zu", bytes, 2 * 24 + 8 * k + 4 * nbuf);
  /* the next push of a zero gradient sends the largest of what was left */
  float *zero = calloc(m.n, 4);
  for (size_t i = 0; i < m.n; i++)
    if (is_trained(&m, i) == 0) zero[i] = g[i];
  dt__ef_local(ef, zero);
  roundtrip(&m, c, ef, zero, dec2, data);
  size_t again = 0;
  int from_left = 1;
  for (size_t i = 0; i < m.n; i++) {
    if (is_trained(&m, i) != 1 || dec2[i] == 0.0f) continue;
    again++;
    from_left &= dec[i] == 0.0f && dec2[i] == g[i];
  }
  CHECK_MSG(again == k && from_left, "second push: %zu values, all from the error: %d", again, from_left);
  dt__ef_destroy(ef);
  free(zero), free(g), free(dec), free(dec2), free(data);
  dt_params_destroy(m.P);
}

static void test_codec_powersgd(void) {
  cmodel m;
  cmodel_init(&m);
  float *g = calloc(m.n, 4), *dec = calloc(m.n, 4), *data = calloc(m.n, 4);
  fill_push(&m, 5, g);
  dt__ef *ef = NULL;
  dt_compress c = {DTRAIN_COMPRESS_POWERSGD, 0, 2};
  CHECK(dt__ef_create_params(c, m.P, 1, &ef) == DTRAIN_OK);
  dt__ef_local(ef, g);
  size_t bytes = roundtrip(&m, c, ef, g, dec, data);
  dt__ef_commit(ef);
  const float *err = dt__ef_error(ef);
  /* the bytes: w1 16x8 and w3 12x12 factored at rank 2, b1 and w2 (8x3: (8+3)2 < 24 -> factored) */
  size_t want = 2 * 24 + 4 * ((16 + 8) * 2 + 8 + (8 + 3) * 2 + (12 + 12) * 2) + 4 * 5;
  CHECK_MSG(bytes == want, "%zu bytes, expected %zu", bytes, want);
  size_t b, e;
  int tr, dec_;
  double worst = 0, rank1 = 0, gmax = 0;
  for (int p = 0; dt__params_range(m.P, p, &b, &e, &tr, &dec_); p++) {
    if (!tr) continue;
    for (size_t i = b; i < e; i++) {
      gmax = fmax(gmax, fabs(g[i]));
      worst = fmax(worst, fabs((double)dec[i] + (double)err[i] - (double)g[i])); /* sent + kept = all */
      if (p == 4) rank1 = fmax(rank1, fabs((double)dec[i] - (double)g[i]));
      if (p == 1) CHECK(dec[i] == g[i] && err[i] == 0.0f); /* a vector goes as floats */
    }
  }
  CHECK_MSG(worst <= 1e-5 * gmax, "sent + kept differs from the gradient by %g", worst);
  CHECK_MSG(rank1 <= 1e-5 * gmax, "a rank-1 gradient off by %g", rank1);
  dt__ef_destroy(ef);
  free(g), free(dec), free(data);
  dt_params_destroy(m.P);
}

/* Server and worker copies over rounds of moving weights: bitwise equal, near the weights. */
static void test_codec_pulls(void) {
  cmodel m;
  cmodel_init(&m);
  for (int k = 0; k < 2; k++) {
    dt_compress_kind kind = k ? DTRAIN_COMPRESS_BF16 : DTRAIN_COMPRESS_FP16;
    for (int s = 0; s < 2; s++) {
      size_t n = dt__ps_shard_floats(m.P, m.owner, s);
      float *full = calloc(m.n, 4), *vs = calloc(n, 4), *vw = calloc(n, 4);
      unsigned char *buf = malloc(8 + 2 * n);
      uint64_t st = 99 + (uint64_t)s;
      for (size_t i = 0; i < m.n; i++) full[i] = urand(&st);
      int equal = 1;
      double worst = 0;
      for (int round = 0; round < 6; round++) {
        float step = round == 0 ? 1.0f : 1e-3f; /* from zero, then small updates */
        for (size_t i = 0; round > 0 && i < m.n; i++) full[i] += step * urand(&st);
        size_t b, e, j = 0;
        int tr, dec;
        double dmax = 0, most = 0;
        for (int p = 0; dt__params_range(m.P, p, &b, &e, &tr, &dec); p++)
          if (m.owner[p] == s)
            for (size_t i = b; i < e; i++, j++) dmax = fmax(dmax, fabs(full[i] - vs[j]));
        dt__ps_delta_encode(kind, m.P, m.owner, s, full, vs, buf);
        CHECK(dt__ps_delta_apply(kind, buf, vw, n) == DTRAIN_OK);
        equal &= memcmp(vs, vw, n * 4) == 0;
        /* the copy vs the weights: one rounding of this round's difference (fp16: half a unit
         * of 11 bits of the largest; bf16: of 8 bits of each), and the float addition's */
        j = 0;
        for (int p = 0; dt__params_range(m.P, p, &b, &e, &tr, &dec); p++)
          if (m.owner[p] == s)
            for (size_t i = b; i < e; i++, j++) most = fmax(most, fabs(full[i] - vw[j]));
        double bound = dmax * (k ? 0x1p-8 : 0x1p-11) + 4e-7;
        worst = fmax(worst, most / bound);
      }
      CHECK_MSG(equal, "%s shard %d: the copies differ", k ? "bf16" : "fp16", s);
      CHECK_MSG(worst <= 1.0, "%s shard %d: the copy is %.3g bounds from the weights", k ? "bf16" : "fp16", s, worst);
      free(full), free(vs), free(vw), free(buf);
    }
  }
  dt_params_destroy(m.P);
}

/* A valid push of kind c for server s into buf (cap bytes); returns its length. */
static size_t valid_push(const cmodel *m, dt_compress c, int s, const float *g, unsigned char *buf, dt__ef **ef) {
  *ef = NULL;
  if (c.kind == DTRAIN_COMPRESS_TOPK || c.kind == DTRAIN_COMPRESS_POWERSGD) {
    dt__ef_create_params(c, m->P, 1, ef);
    dt__ef_local(*ef, g);
  }
  return dt__ps_encode_push(c, *ef, m->P, m->owner, s, g, buf);
}

static void expect_bad(const cmodel *m, int s, unsigned char *buf, size_t len, const char *needle, const float *data0,
                       float *data, float *grad) {
  float *scratch = NULL;
  size_t scap = 0;
  memcpy(data, data0, m->n * 4);
  dt_result rc = dt__ps_decode_push(m->P, m->owner, s, buf, len, grad, data, &scratch, &scap);
  CHECK_MSG(rc == DTRAIN_ERR_PROTOCOL && strstr(dt_last_error(), needle), "%s (%s), expected '%s'",
            dt_result_name(rc), dt_last_error(), needle);
  CHECK_MSG(memcmp(data, data0, m->n * 4) == 0, "a bad push ('%s') changed the buffers", needle);
  dt__free(scratch, scap * sizeof(float));
}

static void test_codec_bad_bytes(void) {
  cmodel m;
  cmodel_init(&m);
  float *g = calloc(m.n, 4), *data0 = calloc(m.n, 4), *data = calloc(m.n, 4), *grad = calloc(m.n, 4);
  fill_push(&m, 3, g);
  for (size_t i = 0; i < m.n; i++) data0[i] = (float)i;
  const int s = m.owner[2]; /* the buffer's server: a push changes its data */
  size_t cap = dt__ps_pushz_cap(m.P, m.owner, s) + 64;
  unsigned char *buf = calloc(cap, 1), *keep = calloc(cap, 1);
  dt__ef *ef;
  dt_compress kinds[4] = {{DTRAIN_COMPRESS_FP16, 0, 0}, {DTRAIN_COMPRESS_BF16, 0, 0}, {DTRAIN_COMPRESS_TOPK, 0.2f, 0},
                          {DTRAIN_COMPRESS_POWERSGD, 0, 2}};
  for (int k = 0; k < 4; k++) {
    size_t len = valid_push(&m, kinds[k], s, g, keep, &ef);
#define FRESH memcpy(buf, keep, cap)
    FRESH;
    expect_bad(&m, s, buf, len - 1, "bytes", data0, data, grad);
    FRESH;
    expect_bad(&m, s, buf, len + 1, "bytes", data0, data, grad);
    FRESH;
    expect_bad(&m, s, buf, 20, "under 24", data0, data, grad);
    FRESH;
    dt__put_le32(buf + 16, 0);
    expect_bad(&m, s, buf, len, "of kind 0", data0, data, grad);
    FRESH;
    dt__put_le32(buf + 16, 5);
    expect_bad(&m, s, buf, len, "of kind 5", data0, data, grad);
    FRESH;
    if (kinds[k].kind == DTRAIN_COMPRESS_FP16) {
      dt__put_le32(buf + 20, 128);
      expect_bad(&m, s, buf, len, "exponent 128", data0, data, grad);
      FRESH;
      dt__put_le32(buf + 20, (uint32_t)-127);
      expect_bad(&m, s, buf, len, "exponent -127", data0, data, grad);
    } else if (kinds[k].kind == DTRAIN_COMPRESS_BF16) {
      dt__put_le32(buf + 20, 1);
      expect_bad(&m, s, buf, len, "bf16 scale exponent 1", data0, data, grad);
    } else if (kinds[k].kind == DTRAIN_COMPRESS_TOPK) {
      uint32_t c = dt__get_le32(buf + 20);
      CHECK(c >= 3);
      size_t ntr = 0, nb = 0;
      for (int p = 0; p < dt_params_count(m.P); p++) {
        size_t b, e;
        int tr, dec;
        dt__params_range(m.P, p, &b, &e, &tr, &dec);
        if (m.owner[p] == s) tr ? (ntr += e - b) : (nb += e - b);
      }
      dt__put_le32(buf + 20, (uint32_t)ntr + 1);
      expect_bad(&m, s, buf, 24 + 8 * (ntr + 1) + 4 * nb, "values of a shard of", data0, data, grad);
      FRESH;
      uint32_t a = dt__get_le32(buf + 24), b2 = dt__get_le32(buf + 28);
      dt__put_le32(buf + 24, b2);
      dt__put_le32(buf + 28, a);
      expect_bad(&m, s, buf, len, "they must rise", data0, data, grad);
      FRESH;
      dt__put_le32(buf + 24, 0);
      dt__put_le32(buf + 28, 0);
      expect_bad(&m, s, buf, len, "they must rise", data0, data, grad);
      FRESH;
      dt__put_le32(buf + 24 + 4 * (c - 1), (uint32_t)ntr);
      expect_bad(&m, s, buf, len, "trained values", data0, data, grad);
    } else {
      dt__put_le32(buf + 20, 0);
      expect_bad(&m, s, buf, len, "rank 0 outside", data0, data, grad);
      FRESH;
      dt__put_le32(buf + 20, 1025);
      expect_bad(&m, s, buf, len, "rank 1025 outside", data0, data, grad);
      FRESH;
      dt__put_le32(buf + 20, 1);
      expect_bad(&m, s, buf, len, "PowerSGD rank 1", data0, data, grad);
    }
    /* random mutations: a clear error or a decode, never a crash or a read past len */
    uint64_t st = 1234 + (uint64_t)k;
    int ok = 0, bad = 0, other = 0;
    for (int it = 0; it < 1500; it++) {
      FRESH;
      size_t l = len;
      int flips = 1 + (int)(dt__splitmix64(&st) % 4);
      for (int f = 0; f < flips; f++) {
        size_t at = dt__splitmix64(&st) % (f == 0 ? 32 : len);
        buf[at] ^= (unsigned char)(1u << (dt__splitmix64(&st) % 8));
      }
      if (dt__splitmix64(&st) % 4 == 0) l = (size_t)(dt__splitmix64(&st) % (len + 8));
      unsigned char *copy = malloc(l ? l : 1); /* exactly l bytes: ASan sees any read past them */
      memcpy(copy, buf, l);
      float *scratch = NULL;
      size_t scap = 0;
      memcpy(data, data0, m.n * 4);
      dt_result rc = dt__ps_decode_push(m.P, m.owner, s, copy, l, grad, data, &scratch, &scap);
      if (rc == DTRAIN_OK) ok++;
      else if (rc == DTRAIN_ERR_PROTOCOL) {
        bad++;
        if (memcmp(data, data0, m.n * 4) != 0) other++;
      } else other++;
      dt__free(scratch, scap * sizeof(float));
      free(copy);
    }
    CHECK_MSG(bad > 500 && other == 0, "%s: %d decoded, %d refused, %d otherwise", dt_compress_name(kinds[k]), ok, bad,
              other);
    dt__ef_destroy(ef);
#undef FRESH
  }
  /* pulls: the kind asked for and the exponent's range */
  size_t n = dt__ps_shard_floats(m.P, m.owner, s);
  float *view = calloc(n, 4), *view0 = calloc(n, 4);
  unsigned char *pb = calloc(8 + 2 * n, 1);
  dt__ps_delta_encode(DTRAIN_COMPRESS_FP16, m.P, m.owner, s, g, view0, pb);
  memset(view0, 0, n * 4);
  CHECK_ERR(dt__ps_delta_apply(DTRAIN_COMPRESS_BF16, pb, view, n), DTRAIN_ERR_PROTOCOL, "of kind 1, asked for 2");
  dt__put_le32(pb + 4, 300);
  CHECK_ERR(dt__ps_delta_apply(DTRAIN_COMPRESS_FP16, pb, view, n), DTRAIN_ERR_PROTOCOL, "exponent 300");
  CHECK(memcmp(view, view0, n * 4) == 0);
  free(view), free(view0), free(pb);
  free(g), free(data0), free(data), free(grad), free(buf), free(keep);
  dt_params_destroy(m.P);
}

#endif /* !DTRAIN_NO_DIST */

#if !defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "ps_harness.h"

/* Payload floats of the harness model: n, of which t are trained (no buffers there). */
static void model_counts(model *m, uint64_t *n, uint64_t *t) {
  dt_param_info info;
  *n = *t = 0;
  for (int p = 0; dt_params_info(m->P, p, &info) == DTRAIN_OK; p++) {
    *n += info.size;
    if (info.trainable) *t += info.size;
  }
}

/* The payload bytes one step of form c sends to M servers (dt_net.h's count). */
static uint64_t step_bytes(model *m, dt_compress c, int M) {
  uint64_t n, t, body = 0;
  model_counts(m, &n, &t);
  if (c.kind == DTRAIN_COMPRESS_NONE) return (uint64_t)M * 32 + 4 * n;
  if (c.kind == DTRAIN_COMPRESS_FP16 || c.kind == DTRAIN_COMPRESS_BF16) body = 2 * t;
  if (c.kind == DTRAIN_COMPRESS_TOPK) body = 8 * (uint64_t)ceil((double)c.fraction * (double)t - 1e-6);
  if (c.kind == DTRAIN_COMPRESS_POWERSGD)
    for (int p = 0; p < dt_params_count(m->P); p++) {
      size_t rows, cols;
      dt__ef_param_matrix(m->P, p, &rows, &cols);
      size_t r = dt__ef_lowrank(c.rank, rows, cols, 0);
      body += 4 * (r ? (rows + cols) * r : rows * cols);
    }
  return (uint64_t)M * (16 + 24) + body + 4 * (n - t);
}

/* One in-process worker against M forked servers, max_staleness 0, `steps`
 * steps of form `text`: its final loss, wire bytes, and the worker's copy
 * against the server's weights at the end. */
typedef struct run_out {
  float loss;
  uint64_t sent, received;
  double copy_gap; /* max |server weight - worker's copy| */
  double wmax;     /* max |weight| */
} run_out;

static int run_one(const char *text, int M, int steps, run_out *out) {
  memset(out, 0, sizeof *out);
  int lfd[2], ports[2];
  if (!listen_fds(M, lfd, ports)) return 0;
  child srv[2];
  spawn_servers(1, M, ports, lfd, 0.05f, srv);
  for (int i = 0; i < M; i++) close(lfd[i]);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, 1, M, ports, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(2.0, NULL);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  int good = ps != NULL;
  if (ps) {
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    CHECK(dt_compress_parse(text, &sd.compress) == DTRAIN_OK);
    dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    for (int t = 0; s && t < steps; t++) {
      dt_minibatch b = batch_at(t, 24);
      dt_result rc = dt_strategy_step(s, &b, NULL);
      CHECK_MSG(rc == DTRAIN_OK, "%s: step %d: %s", text, t, dt_last_error());
      good &= rc == DTRAIN_OK;
    }
    dt_strategy_stats st;
    if (s && dt_strategy_stats_get(s, &st) == DTRAIN_OK) {
      out->sent = st.wire_bytes;
      out->received = st.wire_bytes_received;
    }
    /* the last push is on the servers: one more pull in the form, then one of floats */
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    size_t n = dt_params_size(m.P);
    float *copy = malloc(n * 4);
    CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 0, 0, dt_params_data(m.P), n, &tk) == DTRAIN_OK);
    out->loss = full_loss(&m);
    memcpy(copy, dt_params_data(m.P), n * 4);
    memset(&ps->compress, 0, sizeof ps->compress);
    CHECK_MSG(dt_pstore_pull(ps, 0, 0, dt_params_data(m.P), n, &tk) == DTRAIN_OK, "%s", dt_last_error());
    for (size_t i = 0; i < n; i++) {
      out->copy_gap = fmax(out->copy_gap, fabs((double)copy[i] - dt_params_data(m.P)[i]));
      out->wmax = fmax(out->wmax, fabs(dt_params_data(m.P)[i]));
    }
    free(copy);
    dt_pstore_leave(ps, 0);
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
  }
  model_free(&m);
  for (int i = 0; i < M; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0 && !strstr(srv[i].out, "lost"), "server %d status %d: %s", i, srv[i].status,
              srv[i].out);
  }
  return good;
}

static void test_train_forms(void) {
  alarm(120);
  const int steps = 30;
  run_out ref, r;
  CHECK(run_one("none", 1, steps, &ref));
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  float initial = full_loss(&m);
  uint64_t n, t;
  model_counts(&m, &n, &t);
  dt_compress none = {DTRAIN_COMPRESS_NONE, 0, 0};
  CHECK_MSG(ref.loss < 0.2f * initial, "floats: loss %g from %g", ref.loss, initial);
  CHECK(ref.sent == steps * step_bytes(&m, none, 1) && ref.received == ref.sent);
  CHECK(ref.copy_gap == 0.0);
  printf("  floats: loss %g -> %g, %llu bytes sent/step\n", initial, ref.loss, (unsigned long long)(ref.sent / steps));
  const char *forms[] = {"fp16", "bf16", "topk:0.25", "powersgd:1"};
  for (int f = 0; f < 4; f++) {
    for (int M = 1; M <= 2; M++) {
      if (f < 2 && M == 2) continue;
      CHECK(run_one(forms[f], M, steps, &r));
      printf("  %s x %d server%s: loss %g, %llu / %llu bytes sent / received per step, copy %.3g from the weights\n",
             forms[f], M, M > 1 ? "s" : "", r.loss, (unsigned long long)(r.sent / steps),
             (unsigned long long)(r.received / steps), r.copy_gap);
      fflush(stdout);
      /* converges like floats: within 1.5x of the floats' loss (far below the start); top-k,
       * sending a quarter of the gradient a step (the rest later), lags: under 1/20 of the start */
      if (f == 2) CHECK_MSG(r.loss < 0.05f * initial, "%s: loss %g from %g", forms[f], r.loss, initial);
      else CHECK_MSG(r.loss < 1.5f * ref.loss + 1e-3f * initial, "%s: loss %g, floats %g", forms[f], r.loss, ref.loss);
      /* the worker's copy: one rounding of the last difference away (and not the weights exactly) */
      CHECK_MSG(r.copy_gap <= (f == 1 ? 0x1p-7 : 0x1p-10) * fmax(r.wmax, 1.0), "%s: copy %g from the weights", forms[f],
                r.copy_gap);
      /* exact bytes: pushes of the form, pulls of 16-bit differences after one of floats */
      dt_compress c;
      CHECK(dt_compress_parse(forms[f], &c) == DTRAIN_OK);
      uint64_t sent = steps * step_bytes(&m, c, M);
      uint64_t recv = ((uint64_t)M * 32 + 4 * n) + (steps - 1) * ((uint64_t)M * (24 + 16) + 2 * n);
      CHECK_MSG(r.sent == sent && r.received == recv, "%s: sent %llu received %llu, expected %llu and %llu", forms[f],
                (unsigned long long)r.sent, (unsigned long long)r.received, (unsigned long long)sent,
                (unsigned long long)recv);
      CHECK(r.sent < ref.sent && r.received < ref.received);
    }
  }
  model_free(&m);
  alarm(0);
}

/* 2 workers x 2 servers, each form: every worker's loss falls below a tenth. */
static void test_converge_2x2_forms(void) {
  alarm(90);
  const char *forms[] = {"fp16", "topk:0.3", "powersgd:2"};
  for (int f = 0; f < 3; f++) converge_2x2(forms[f], 0.1f);
  alarm(0);
}

/* A worker whose compressed frames are bad is dropped with the reason; the other trains on. */
static void test_hostile_worker(void) {
  alarm(60);
  struct {
    int type;
    int form;        /* PULL: its form word */
    const char *why; /* in the server's log */
  } cases[] = {
    {DT__PS_PULL, 2, "before a pull that keeps a copy"},
    {DT__PS_PULL, 9, "form 9 (0-3)"},
    {DT__PS_PUSHZ, 0, "position"},
  };
  for (int c = 0; c < 3; c++) {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    child srv;
    server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
    srv = spawn_server(&sc, &lfd);
    worker_cfg wc = worker_defaults(2, 1, 0, &port);
    wc.steps = 30;
    wc.compress = "fp16";
    child good = spawn_worker(&wc, &lfd, 1);
    close(lfd);
    model m;
    model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
    pc x;
    pc_make(&x, 2, 1, &port, DTRAIN_ROLE_WORKER, 1);
    dt_net_options o = net_opts(2.0, NULL);
    o.quiet = 1;
    dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 1);
    CHECK_MSG(ps != NULL, "%s", dt_last_error());
    if (ps) {
      dt__ps_client *C = (dt__ps_client *)ps->impl;
      unsigned char b[64];
      memset(b, 0, sizeof b);
      uint32_t len = DT__PS_FIX;
      dt__put_le64(b, (uint64_t)C->base);
      if (cases[c].type == DT__PS_PULL) {
        dt__put_le64(b + 8, (uint64_t)cases[c].form);
      } else { /* top-k, two values at positions 3 then 1 */
        dt__put_le32(b + 16, DTRAIN_COMPRESS_TOPK);
        dt__put_le32(b + 20, 2);
        dt__put_le32(b + 24, 3);
        dt__put_le32(b + 28, 1);
        len = 24 + 16;
      }
      dt__mutex_lock(&C->mu); /* the heartbeat thread sends too */
      CHECK(dt__conn_send(&C->conn[0], (uint16_t)cases[c].type, b, len, dt__now() + 2, "test") == DTRAIN_OK);
      int closed = server_closes(C->conn[0].fd); /* the server drops it */
      dt__mutex_unlock(&C->mu);
      CHECK_MSG(closed, "%s: the server kept a worker that sent a bad frame", cases[c].why);
      dt_pstore_destroy(ps);
    }
    model_free(&m);
    child_wait(&good);
    CHECK_MSG(good.status == 0, "the good worker: status %d: %s", good.status, good.out);
    child_wait(&srv);
    CHECK_MSG(strstr(srv.out, "worker 1") && strstr(srv.out, "lost") && strstr(srv.out, cases[c].why), "%s: %s",
              cases[c].why, srv.out);
  }
  alarm(0);
}

static void test_strategy_refusals(void) {
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  dt_pstore *local = dt_pstore_create_local(dt_params_data(m.P), dt_params_size(m.P), 1, 0, DTRAIN_ASYNC_HOGWILD, 0);
  CHECK(local != NULL);
  dt_strategy_options sd = dt_strategy_parameter_server(local, 0);
  CHECK(dt_compress_parse("fp16", &sd.compress) == DTRAIN_OK);
  CHECK(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd) == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "needs a store over TCP"), "%s",
            dt_last_error());
  dt_strategy_options od = dt_strategy_one_device();
  od.compress = sd.compress;
  CHECK(dt_strategy_create(m.P, m.opt, step_fn, &m, &od) == NULL);
  CHECK_MSG(strstr(dt_last_error(), "multi_worker_mirrored and parameter_server"), "%s", dt_last_error());
  dt_pstore_destroy(local);
  model_free(&m);
}
#endif

#if defined(DTRAIN_NO_DIST)
static void test_compiled_out(void) {
  CHECK(dt_pstore_create_tcp(NULL, NULL, NULL, 0) == NULL && strstr(dt_last_error(), "DTRAIN_NO_DIST"));
}
#endif

int main(void) {
#if defined(DTRAIN_NO_DIST)
  TH_RUN(test_compiled_out);
  th_skip_item("test_ps_compress", "parameter servers are compiled out (DTRAIN_NO_DIST)");
#else
  TH_RUN(test_codec_16bit);
  TH_RUN(test_codec_topk);
  TH_RUN(test_codec_powersgd);
  TH_RUN(test_codec_pulls);
  TH_RUN(test_codec_bad_bytes);
#  if defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
  th_skip_item("test_ps_compress networked tests", "built without networking or threads");
#  else
  signal(SIGPIPE, SIG_DFL);
  make_data();
  TH_RUN(test_strategy_refusals);
  TH_RUN(test_train_forms);
  TH_RUN(test_converge_2x2_forms);
  TH_RUN(test_hostile_worker);
#  endif
#endif
  return th_summary("test_ps_compress");
}
