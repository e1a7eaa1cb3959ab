/* tests/test_compress_ef.c -- top-k and PowerSGD with error feedback, over
 * 2-4 threads ranks of the in-process communicator:
 *  - the parser and formatter (topk:F, powersgd:R, bad numbers refused);
 *  - selection: the k-th largest key against a sort, with many ties;
 *  - top-k sends exactly the k largest |g + e| (ties: lowest index; NaN and
 *    Inf first) and keeps the rest as error; F = 1 equals the plain sum
 *    (bitwise for 2 ranks, within a sum's rounding for more);
 *  - on large inputs (a sampled first threshold) the same choice as a brute
 *    force, also when the sample misleads and with many ties;
 *  - a top-k decoder fed bad bytes (falling index, index of an untrained
 *    value, index past the end) refuses them, naming the sender;
 *  - PowerSGD of full rank equals the plain sum within float rounding, for
 *    tall, wide and square matrices beside vectors sent as floats, and which
 *    parameters it factors and the bytes it sends follow from the shapes;
 *  - error feedback conserves: over several steps, what every rank received
 *    plus what all ranks still hold as error equals the sum of all the
 *    gradients (top-k and PowerSGD); every rank receives the same bytes;
 *  - a step that is not committed, or whose error is not finite, leaves the
 *    kept error as it was. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

static void test_parse_format(void) {
  dt_compress c;
  char b[64];
  /* (float) casts: where floats are evaluated in double (FLT_EVAL_METHOD 1, s390x), 0.01f is 0.01 */
  CHECK(dt_compress_parse("topk:0.01", &c) == DTRAIN_OK && c.kind == DTRAIN_COMPRESS_TOPK &&
        c.fraction == (float)0.01);
  CHECK(strcmp(dt_compress_name(c), "topk") == 0);
  CHECK(strcmp(dt_compress_format(c, b, sizeof b), "topk:0.01") == 0);
  CHECK(dt_compress_parse("topk:1", &c) == DTRAIN_OK && c.fraction == 1.0f);
  CHECK(dt_compress_parse("topk:.5", &c) == DTRAIN_OK && c.fraction == 0.5f);
  CHECK(dt_compress_parse("powersgd:4", &c) == DTRAIN_OK && c.kind == DTRAIN_COMPRESS_POWERSGD && c.rank == 4);
  CHECK(strcmp(dt_compress_name(c), "powersgd") == 0);
  CHECK(strcmp(dt_compress_format(c, b, sizeof b), "powersgd:4") == 0);
  CHECK(dt_compress_parse("fp16", &c) == DTRAIN_OK && strcmp(dt_compress_format(c, b, sizeof b), "fp16") == 0);
  CHECK(strcmp(dt_compress_format(c, b, 3), "fp") == 0); /* cut, terminated */
  const char *bad_topk[] = {"topk", "topk:", "topk:0", "topk:1.5", "topk:-0.1", "topk:abc", "topk:0.1x", "topk:nan",
                            "topk: 0.1", "topk:inf"};
  for (size_t i = 0; i < sizeof bad_topk / sizeof bad_topk[0]; i++)
    CHECK_ERR(dt_compress_parse(bad_topk[i], &c), DTRAIN_ERR_INVALID_ARG,
              !strcmp(bad_topk[i], "topk") ? "expected none, fp16, bf16, topk:F or powersgd:R" : "fraction F in (0, 1]");
  const char *bad_psgd[] = {"powersgd:", "powersgd:0", "powersgd:-2", "powersgd:1.5", "powersgd:2000", "powersgd:x"};
  for (size_t i = 0; i < sizeof bad_psgd / sizeof bad_psgd[0]; i++)
    CHECK_ERR(dt_compress_parse(bad_psgd[i], &c), DTRAIN_ERR_INVALID_ARG, "rank R in 1..1024");
}

#if !defined(DTRAIN_NO_DIST)
static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

static void test_select(void) {
  th_seed(3);
  size_t sizes[] = {1, 2, 3, 7, 64, 1001};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
    for (int ties = 0; ties < 3; ties++) {
      size_t n = sizes[si];
      float *a = (float *)malloc(n * sizeof(float)), *s = (float *)malloc(n * sizeof(float));
      float *w = (float *)malloc(n * sizeof(float));
      for (size_t i = 0; i < n; i++) /* ties 1: few distinct values; 2: all equal */
        a[i] = ties == 0 ? th_uniform(0, 1) : ties == 1 ? (float)(int)(th_rand() * 4) : 2.0f;
      memcpy(s, a, n * sizeof(float));
      qsort(s, n, sizeof(float), cmp_float);
      int ok = 1;
      for (size_t want = 0; want < n; want += (n > 50 ? 37 : 1)) {
        memcpy(w, a, n * sizeof(float));
        ok &= dt__ef_select(w, n, want) == s[want];
      }
      memcpy(w, a, n * sizeof(float));
      ok &= dt__ef_select(w, n, n - 1) == s[n - 1];
      CHECK_MSG(ok, "n %zu ties %d: selection differs from the sort", n, ties);
      free(a), free(s), free(w);
    }
}

/* ---- ranks on threads ---- */
#  if !defined(DTRAIN_NO_THREADS)
#    define MAXR 4
#    define STEPS 6

typedef struct rank_arg {
  dt_comm *c;
  dt__ef *e;
  int rank, W, steps, commit;
  size_t n;
  float *g;   /* steps x n: this rank's gradients */
  float *out; /* steps x n: what it received */
  uint64_t sent;
  dt_result rc;
} rank_arg;

static void rank_main(void *p) {
  rank_arg *a = (rank_arg *)p;
  a->rc = DTRAIN_OK;
  for (int t = 0; t < a->steps && a->rc == DTRAIN_OK; t++) {
    float *buf = a->out + (size_t)t * a->n;
    memcpy(buf, a->g + (size_t)t * a->n, a->n * sizeof(float));
    a->rc = dt__ef_allreduce(a->e, a->c, a->rank, buf, &a->sent);
    if (a->commit) dt__ef_commit(a->e);
  }
}

/* The value rank r has at step t, float i. */
static float gval(int r, int t, size_t i) {
  uint64_t s = (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)r * 7919 + (uint64_t)t * 104729 + 1;
  return (float)((double)(dt__splitmix64(&s) >> 11) / 9007199254740992.0 - 0.5);
}

/* W ranks run `steps` steps of compressor c over the parts; a[r] holds the
 * results (the caller frees with free_ranks). */
static void run_ranks(rank_arg *a, int W, dt_compress c, size_t n, const dt__ef_part *parts, int np, int lowrank_all,
                      int steps, int commit) {
  dt_comm *comm = dt_comm_create_threads(W, -1);
  dt__thread th[MAXR];
  for (int r = 0; r < W; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].c = comm, a[r].rank = r, a[r].W = W, a[r].steps = steps, a[r].n = n, a[r].commit = commit;
    CHECK(dt__ef_create(c, n, parts, np, W, lowrank_all, &a[r].e) == DTRAIN_OK);
    a[r].g = (float *)calloc((size_t)steps * n, sizeof(float));
    a[r].out = (float *)calloc((size_t)steps * n, sizeof(float));
    for (int t = 0; t < steps; t++)
      for (int p = 0; p < np; p++)
        for (size_t i = parts[p].off; i < parts[p].off + parts[p].rows * parts[p].cols; i++)
          a[r].g[(size_t)t * n + i] = gval(r, t, i);
  }
  for (int r = 0; r < W; r++) dt__thread_start(&th[r], rank_main, &a[r]);
  for (int r = 0; r < W; r++) dt__thread_join(&th[r]);
  for (int r = 0; r < W; r++) CHECK_MSG(a[r].rc == DTRAIN_OK, "rank %d: %s", r, dt_last_error());
  dt_comm_destroy(comm);
}

static void free_ranks(rank_arg *a, int W) {
  for (int r = 0; r < W; r++) {
    dt__ef_destroy(a[r].e);
    free(a[r].g), free(a[r].out);
  }
}

/* Every rank received the same bytes. */
static int same_everywhere(const rank_arg *a, int W, int steps) {
  int ok = 1;
  for (int r = 1; r < W; r++) ok &= memcmp(a[r].out, a[0].out, (size_t)steps * a[0].n * sizeof(float)) == 0;
  return ok;
}

/* Layout used below: a gap (an untrained buffer) between parts, odd sizes. */
static const dt__ef_part parts3[] = {{0, 7, 5, }, {40, 1, 9}, {52, 3, 11}};
#    define N3 90 /* 85 .. 90: past the last part */

static void test_topk_selects(void) {
  /* one part of 10, k = 3: the three largest |g + e|; ties go to the lowest index; NaN first */
  dt__ef_part one = {0, 10, 1};
  dt_compress c = {DTRAIN_COMPRESS_TOPK, 0.3f, 0};
  dt__ef *e = NULL;
  CHECK(dt__ef_create(c, 10, &one, 1, 2, 0, &e) == DTRAIN_OK);
  if (!e) return;
  CHECK(e->k == 3);
  float g[10] = {0.1f, -5.0f, 2.0f, 2.0f, -2.0f, 0.0f, 1.0f, 0.5f, -0.25f, 3.0f};
  float m[6];
  dt__ef_topk_encode(e, g, m);
  CHECK(dt__ef_get_u32(m, 0) == 1 && dt__ef_get_u32(m, 1) == 2 && dt__ef_get_u32(m, 2) == 9);
  CHECK(m[3] == -5.0f && m[4] == 2.0f && m[5] == 3.0f);
  CHECK(e->next[1] == 0.0f && e->next[3] == 2.0f && e->next[4] == -2.0f && e->next_ok);
  dt__ef_commit(e);
  /* the kept error joins the next gradient: 2 + 2 at 3 and -2 - 2 at 4 now beat 3.5 at 9, 1 at 6 stays */
  float g2[10] = {0, 0, 0, 2.0f, -2.0f, 0, 0, 0, 0, 3.5f};
  dt__ef_topk_encode(e, g2, m);
  CHECK(dt__ef_get_u32(m, 0) == 3 && dt__ef_get_u32(m, 1) == 4 && dt__ef_get_u32(m, 2) == 9);
  CHECK(m[3] == 4.0f && m[4] == -4.0f && m[5] == 3.5f);
  CHECK(e->next[6] == 1.0f && e->next[0] == (float)0.1 && e->next[3] == 0.0f);
  /* a NaN is sent first; a non-finite value left behind makes the error not worth keeping */
  dt__ef_reset(e);
  float g3[10] = {NAN, 1, 2, 3, 4, 5, 6, INFINITY, -INFINITY, 7};
  dt__ef_topk_encode(e, g3, m);
  CHECK(dt__ef_get_u32(m, 0) == 0 && dt__ef_get_u32(m, 1) == 7 && dt__ef_get_u32(m, 2) == 8);
  CHECK(isnan(m[3]) && e->next_ok == 1);
  float g4[10] = {NAN, NAN, NAN, NAN, 0, 0, 0, 0, 0, 0};
  dt__ef_topk_encode(e, g4, m);
  CHECK(e->next_ok == 0);
  dt__ef_commit(e);
  CHECK(dt__ef_error(e)[3] == 0.0f); /* not kept */
  dt__ef_destroy(e);
}

/* Large inputs take the sampled threshold: the same choice as a brute
 * force (the k largest |v|, ties to the lowest index), also where the sample
 * misses (the sampled positions hold the largest values) and with ties. */
static int by_key(const void *a, const void *b) {
  const float *x = (const float *)a, *y = (const float *)b; /* {key, index}: key down, index up */
  if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
  return x[1] < y[1] ? -1 : x[1] > y[1];
}

static void test_topk_large(void) {
  const size_t n = 40000;
  th_seed(11);
  for (int kind = 0; kind < 3; kind++)
    for (int fi = 0; fi < 2; fi++) {
      dt__ef_part one = {0, n, 1};
      dt_compress c = {DTRAIN_COMPRESS_TOPK, fi ? 0.1f : 0.003f, 0};
      dt__ef *e = NULL;
      CHECK(dt__ef_create(c, n, &one, 1, 2, 0, &e) == DTRAIN_OK);
      if (!e) return;
      float *g = (float *)malloc(n * sizeof(float)), *m = (float *)malloc(2 * e->k * sizeof(float));
      float *pair = (float *)malloc(2 * n * sizeof(float));
      for (size_t i = 0; i < n; i++) {
        if (kind == 0) g[i] = th_uniform(-1, 1);
        else if (kind == 1) g[i] = i % 19 == 0 ? 1000.0f : th_uniform(-1, 1); /* the sample sees only the big ones */
        else g[i] = (float)((int)(th_rand() * 7) - 3);                         /* 7 values: ties everywhere */
        pair[2 * i] = fabsf(g[i]), pair[2 * i + 1] = (float)i;
      }
      qsort(pair, n, 2 * sizeof(float), by_key);
      unsigned char *want = (unsigned char *)calloc(n, 1);
      for (size_t j = 0; j < e->k; j++) want[(size_t)pair[2 * j + 1]] = 1;
      dt__ef_topk_encode(e, g, m);
      int ok = e->next_ok, order = 1;
      for (size_t j = 0; j < e->k; j++) {
        uint32_t i = dt__ef_get_u32(m, j);
        ok &= i < n && want[i] && m[e->k + j] == g[i] && e->next[i] == 0.0f;
        if (j) order &= i > dt__ef_get_u32(m, j - 1);
      }
      CHECK_MSG(ok && order, "kind %d F %g: not the brute force's choice", kind, (double)c.fraction);
      free(g), free(m), free(pair), free(want);
      dt__ef_destroy(e);
    }
}

static void test_topk_bad_bytes(void) {
  dt_compress c = {DTRAIN_COMPRESS_TOPK, 0.05f, 0};
  dt__ef *e = NULL;
  CHECK(dt__ef_create(c, N3, parts3, 3, 2, 0, &e) == DTRAIN_OK);
  if (!e) return;
  CHECK(e->k == 4); /* ceil(0.05 x 77) */
  float buf[N3], m[8];
  memset(buf, 0, sizeof buf);
  uint32_t good[4] = {0, 34, 40, 84};
  for (int j = 0; j < 4; j++) dt__ef_put_u32(m, (size_t)j, good[j]), m[4 + j] = 1.0f;
  CHECK(dt__ef_topk_add(e, m, 1, buf) == DTRAIN_OK);
  CHECK(buf[0] == 1.0f && buf[34] == 1.0f && buf[40] == 1.0f && buf[84] == 1.0f);
  struct { uint32_t idx[4]; const char *needle; } bad[] = {
      {{0, 34, 34, 84}, "rank 1: index 34 after 34 (they must rise)"},
      {{5, 3, 40, 84}, "index 3 after 5"},
      {{0, 35, 40, 84}, "index 35 is not a trained value (of 90 floats)"}, /* in the gap */
      {{0, 34, 49, 84}, "index 49 is not a trained value"},
      {{0, 34, 40, 85}, "index 85 is not a trained value"},
      {{0, 34, 40, 0xFFFFFFFFu}, "index 4294967295 is not a trained value"},
  };
  for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
    for (int j = 0; j < 4; j++) dt__ef_put_u32(m, (size_t)j, bad[b].idx[j]);
    CHECK_ERR(dt__ef_topk_add(e, m, 1, buf), DTRAIN_ERR_PROTOCOL, bad[b].needle);
  }
  dt__ef_destroy(e);
  /* parts out of order or past the buffer are refused at creation */
  dt__ef_part wrong[2] = {{10, 2, 2}, {12, 1, 4}};
  CHECK_ERR(dt__ef_create(c, 40, wrong, 2, 2, 0, &e), DTRAIN_ERR_INVALID_ARG, "part 1 [12, +4) out of order");
  dt__ef_part past = {38, 1, 4};
  CHECK_ERR(dt__ef_create(c, 40, &past, 1, 2, 0, &e), DTRAIN_ERR_INVALID_ARG, "past 40 floats");
  c.fraction = 0.0f;
  CHECK_ERR(dt__ef_create(c, 40, &past, 0, 2, 0, &e), DTRAIN_ERR_INVALID_ARG, "fraction 0 outside (0, 1]");
}

/* The plain sum of the ranks' gradients at step t, float i (in double). */
static double plain_sum(int W, int t, size_t i) {
  double s = 0.0;
  for (int r = 0; r < W; r++) s += gval(r, t, i);
  return s;
}

static void test_topk_full(void) {
  dt_compress c = {DTRAIN_COMPRESS_TOPK, 1.0f, 0};
  for (int W = 2; W <= 4; W++) {
    rank_arg a[MAXR];
    run_ranks(a, W, c, N3, parts3, 3, 0, 2, 1);
    int bitwise = 1, near = 1, zero_err = 1, untouched = 1;
    for (int t = 0; t < 2; t++)
      for (int p = 0; p < 3; p++)
        for (size_t i = parts3[p].off; i < parts3[p].off + parts3[p].rows * parts3[p].cols; i++) {
          float got = a[0].out[(size_t)t * N3 + i];
          float f = 0.0f; /* rank order, as the decoder adds */
          for (int r = 0; r < W; r++) f += gval(r, t, i);
          bitwise &= got == f;
          near &= fabs((double)got - plain_sum(W, t, i)) <= 1e-6 * W;
        }
    for (int r = 0; r < W; r++)
      for (size_t i = 0; i < N3; i++) zero_err &= dt__ef_error(a[r].e)[i] == 0.0f;
    for (size_t i = 35; i < 40; i++) untouched &= a[0].out[i] == 0.0f; /* the gap: nobody wrote it */
    CHECK(same_everywhere(a, W, 2));
    CHECK_MSG(bitwise, "W %d: F = 1 is not the sum in rank order", W);
    CHECK(near && zero_err && untouched);
    if (W == 2) { /* two floats add the same either way: the float ring's result, bitwise */
      int ring = 1;
      for (size_t i = 0; i < 35; i++) {
        float sum = gval(0, 0, i) + gval(1, 0, i); /* rounded to float here */
        ring &= a[0].out[i] == sum;
      }
      CHECK(ring);
    }
    /* (W-1) messages of 2k floats per step */
    CHECK(a[0].sent == (uint64_t)2 * (W - 1) * 2 * 77 * sizeof(float));
    free_ranks(a, W);
  }
}

/* Error feedback: after every step, received + sum of errors = sum of gradients. */
static void check_conservation(dt_compress c, int W, const dt__ef_part *parts, int np, size_t n, double tol) {
  rank_arg a[MAXR];
  run_ranks(a, W, c, n, parts, np, 0, STEPS, 1);
  CHECK_MSG(same_everywhere(a, W, STEPS), "%s W %d: ranks received different sums", dt_compress_name(c), W);
  double worst = 0.0, moved = 0.0;
  for (int p = 0; p < np; p++)
    for (size_t i = parts[p].off; i < parts[p].off + parts[p].rows * parts[p].cols; i++) {
      double got = 0.0, want = 0.0, left = 0.0;
      for (int t = 0; t < STEPS; t++) got += a[0].out[(size_t)t * n + i], want += plain_sum(W, t, i);
      for (int r = 0; r < W; r++) left += dt__ef_error(a[r].e)[i];
      worst = fmax(worst, fabs(got + left - want));
      moved = fmax(moved, fabs(left)); /* something was held back: the check means something */
    }
  CHECK_MSG(worst <= tol, "%s W %d: received + error differs from the gradients' sum by %g", dt_compress_name(c), W,
            worst);
  CHECK_MSG(moved > 0.05, "%s W %d: no error was kept (%g)", dt_compress_name(c), W, moved);
  free_ranks(a, W);
}

static void test_conservation(void) {
  dt_compress tk = {DTRAIN_COMPRESS_TOPK, 0.1f, 0}, ps = {DTRAIN_COMPRESS_POWERSGD, 0.0f, 1};
  dt__ef_part big[] = {{0, 16, 24}, {384, 1, 24}, {416, 24, 8}};
  for (int W = 2; W <= 4; W++) {
    check_conservation(tk, W, parts3, 3, N3, 1e-5);
    check_conservation(ps, W, big, 3, 608, 1e-4);
  }
}

static void test_powersgd_full_rank(void) {
  /* tall, wide, square, a vector; every matrix factored at full rank */
  dt__ef_part parts[] = {{0, 9, 4}, {48, 3, 10}, {80, 6, 6}, {120, 1, 7}};
  size_t n = 130;
  dt_compress c = {DTRAIN_COMPRESS_POWERSGD, 0.0f, 1024};
  for (int W = 2; W <= 3; W++) {
    rank_arg a[MAXR];
    run_ranks(a, W, c, n, parts, 4, 1, 3, 1);
    double worst = 0.0, err = 0.0;
    for (int t = 0; t < 3; t++)
      for (int p = 0; p < 4; p++)
        for (size_t i = parts[p].off; i < parts[p].off + parts[p].rows * parts[p].cols; i++) {
          worst = fmax(worst, fabs((double)a[0].out[(size_t)t * n + i] - plain_sum(W, t, i)));
          /* a rank's error is its M less its projection (not zero for a tall M);
           * at full rank the errors add up to nothing lost */
          double es = 0.0;
          for (int r = 0; r < W; r++) es += dt__ef_error(a[r].e)[i];
          err = fmax(err, fabs(es));
        }
    CHECK(same_everywhere(a, W, 3));
    CHECK_MSG(worst <= 2e-5, "W %d: full-rank PowerSGD %g from the sum", W, worst);
    CHECK_MSG(err <= 2e-5, "W %d: full rank left error %g", W, err);
    free_ranks(a, W);
  }
}

static void test_powersgd_layout(void) {
  /* rank 2: a 16 x 24 matrix is factored ((16 + 24) x 2 < 384), 3 x 3 and vectors go as floats */
  dt__ef_part parts[] = {{0, 16, 24}, {384, 3, 3}, {400, 1, 5}};
  dt_compress c = {DTRAIN_COMPRESS_POWERSGD, 0.0f, 2};
  dt__ef *e = NULL;
  CHECK(dt__ef_create(c, 410, parts, 3, 3, 0, &e) == DTRAIN_OK);
  if (!e) return;
  CHECK(e->run[0].r == 2 && e->run[1].r == 0 && e->run[2].r == 0);
  CHECK(e->npack == 16 * 2 + 9 + 5 && e->nq == 24 * 2);
  dt__ef_destroy(e);
  /* the bytes: two float all-reduces, of the P pack and of the Q's */
  rank_arg a[MAXR];
  run_ranks(a, 3, c, 410, parts, 3, 0, 2, 1);
  CHECK(a[1].sent == 2 * (dt__ring_bytes(46, 3) + dt__ring_bytes(48, 3)));
  /* far fewer than the float ring's */
  CHECK(a[1].sent / 2 < dt__ring_bytes(410, 3) / 3);
  free_ranks(a, 3);
}

static void test_uncommitted(void) {
  /* steps that are never committed: the kept error stays zero (k = 8 of 77) */
  dt_compress c = {DTRAIN_COMPRESS_TOPK, 0.1f, 0};
  rank_arg a[MAXR];
  run_ranks(a, 2, c, N3, parts3, 3, 0, 3, 0);
  int zero = 1;
  for (int r = 0; r < 2; r++)
    for (size_t i = 0; i < N3; i++) zero &= dt__ef_error(a[r].e)[i] == 0.0f;
  CHECK(zero);
  /* and without the error, each step's sum holds at most 2k values */
  for (int t = 0; t < 3; t++) {
    size_t nz = 0;
    for (size_t i = 0; i < N3; i++) nz += a[0].out[(size_t)t * N3 + i] != 0.0f;
    CHECK(nz <= 2 * 8);
  }
  free_ranks(a, 2);
}
#  endif /* threads */
#endif   /* DTRAIN_NO_DIST */

int main(void) {
  TH_RUN(test_parse_format);
#if !defined(DTRAIN_NO_DIST)
  TH_RUN(test_select);
#  if !defined(DTRAIN_NO_THREADS)
  TH_RUN(test_topk_selects);
  TH_RUN(test_topk_large);
  TH_RUN(test_topk_bad_bytes);
  TH_RUN(test_topk_full);
  TH_RUN(test_conservation);
  TH_RUN(test_powersgd_full_rank);
  TH_RUN(test_powersgd_layout);
  TH_RUN(test_uncommitted);
#  else
  th_skip_item("top-k and PowerSGD over ranks", "threads not compiled in");
#  endif
#else
  th_skip_item("top-k and PowerSGD", "DTRAIN_NO_DIST: no compressors");
#endif
  return th_summary("test_compress_ef");
}
