/* tests/test_compress.c -- gradients compressed on the wire: float <-> fp16
 * against its definition (every one of the 65536 halves round-trips; random
 * floats go to the nearest half, ties to even; overflow, underflow,
 * subnormals, Inf and NaN), float <-> bf16 likewise; a message's scale keeps
 * the precision of gradients far below fp16's range; a decoder fed bad
 * headers refuses them; the ring all-reduce over 2-5 threads ranks gives
 * every rank the same bytes, exact sums where the values allow, and sums
 * within the rounding bound otherwise; the names and the parser. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

static uint32_t bits_of(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  return x;
}

static void test_fp16_exhaustive(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = dt__f32_of_f16((uint16_t)h);
    int nan = ((h >> 10) & 0x1F) == 31 && (h & 0x3FF);
    if (nan) {
      bad += f == f;                              /* decodes to a NaN */
      bad += (dt__f16_of(f) & 0x7FFF) <= 0x7C00;  /* and encodes to one */
      continue;
    }
    bad += dt__f16_of(f) != h; /* every other half round-trips exactly */
  }
  CHECK(bad == 0);
  CHECK(dt__f32_of_f16(0x3C00) == 1.0f && dt__f32_of_f16(0x7BFF) == 65504.0f && dt__f32_of_f16(0xC000) == -2.0f);
  CHECK(dt__f32_of_f16(0x0001) == ldexpf(1.0f, -24) && dt__f32_of_f16(0x0400) == ldexpf(1.0f, -14));
  CHECK(isinf(dt__f32_of_f16(0x7C00)) && dt__f32_of_f16(0xFC00) < 0);
}

/* The nearest half to f by brute force over the neighbours of the encoder's answer. */
static int nearest_ok(float f) {
  uint16_t h = dt__f16_of(f);
  double want = (double)f, got = (double)dt__f32_of_f16(h), err = fabs(got - want);
  if (fabs(want) >= 65520.0) return (h & 0x7FFF) == 0x7C00;
  for (int d = -2; d <= 2; d++) {
    int o = (int)(h & 0x7FFF) + d;
    if (d == 0 || o < 0 || o > 0x7BFF) continue;
    double alt = (double)dt__f32_of_f16((uint16_t)((h & 0x8000) | o));
    if (fabs(alt - want) < err) return 0;
    if (fabs(alt - want) == err && (h & 1)) return 0; /* a tie goes to the even one */
  }
  return 1;
}

static void test_fp16_rounding(void) {
  th_seed(3);
  int bad = 0;
  for (int i = 0; i < 200000; i++) {
    float f = ldexpf(th_uniform(-1, 1), (int)(th_rand() * 50) - 30); /* 2^-30 .. 2^20 */
    bad += !nearest_ok(f);
  }
  CHECK(bad == 0);
  /* Ties to even, the edges. */
  CHECK(dt__f16_of(1.0f + ldexpf(1.0f, -11)) == 0x3C00);     /* halfway to 0x3C01: even stays */
  CHECK(dt__f16_of(1.0f + 3 * ldexpf(1.0f, -11)) == 0x3C02); /* halfway 0x3C01..02: up to even */
  CHECK(dt__f16_of(65504.0f) == 0x7BFF && dt__f16_of(65519.0f) == 0x7BFF && dt__f16_of(65520.0f) == 0x7C00);
  CHECK(dt__f16_of(-1e9f) == 0xFC00);
  CHECK(dt__f16_of(ldexpf(1.0f, -25)) == 0 && dt__f16_of(ldexpf(1.5f, -25)) == 1 && dt__f16_of(ldexpf(3.0f, -25)) == 2);
  CHECK(dt__f16_of(-0.0f) == 0x8000 && dt__f16_of(ldexpf(1.0f, -14) * 0.9999f) == 0x0400);
  CHECK(dt__f16_of(INFINITY) == 0x7C00 && (dt__f16_of(NAN) & 0x7C00) == 0x7C00 && (dt__f16_of(NAN) & 0x3FF));
}

static void test_bf16(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = dt__f32_of_bf16((uint16_t)h);
    if (f != f) bad += dt__f32_of_bf16(dt__bf16_of(f)) == dt__f32_of_bf16(dt__bf16_of(f));
    else bad += dt__bf16_of(f) != h;
  }
  CHECK(bad == 0);
  CHECK(dt__bf16_of(1.0f) == 0x3F80);
  CHECK(dt__bf16_of(1.0f + ldexpf(1.0f, -8)) == 0x3F80);      /* tie: even */
  CHECK(dt__bf16_of(1.0f + 3 * ldexpf(1.0f, -8)) == 0x3F82);  /* tie: up to even */
  CHECK(dt__bf16_of(1.0f + ldexpf(1.5f, -8)) == 0x3F81);
  CHECK(dt__bf16_of(FLT_MAX) == 0x7F80);                      /* rounds up to Inf */
  CHECK(isnan(dt__f32_of_bf16(dt__bf16_of(NAN))));
  /* nearest, by the neighbours */
  th_seed(4);
  for (int i = 0; i < 100000; i++) {
    float f = ldexpf(th_uniform(-1, 1), (int)(th_rand() * 200) - 100);
    uint16_t h = dt__bf16_of(f);
    double e = fabs((double)dt__f32_of_bf16(h) - f);
    bad += fabs((double)dt__f32_of_bf16((uint16_t)(h + 1)) - f) < e;
    bad += fabs((double)dt__f32_of_bf16((uint16_t)(h - 1)) - f) < e;
  }
  CHECK(bad == 0);
}

#if !defined(DTRAIN_NO_DIST)
static void test_messages(void) {
  /* Gradients far below fp16's range keep 11 bits, thanks to the scale. */
  float x[9], y[9], slots[8];
  for (int i = 0; i < 9; i++) x[i] = (float)((i * 37) % 19 - 9) * 1e-9f;
  CHECK(dt__cmsg_slots(9) == 6);
  dt__cmsg_encode(DTRAIN_COMPRESS_FP16, x, 9, slots);
  CHECK(dt__cmsg_decode(DTRAIN_COMPRESS_FP16, slots, 9, y, 0) == DTRAIN_OK);
  for (int i = 0; i < 9; i++) CHECK(fabsf(y[i] - x[i]) <= fabsf(x[i]) * ldexpf(1.0f, -11));
  /* and so do large ones (70000 is past fp16's 65504) */
  for (int i = 0; i < 9; i++) x[i] = 70000.0f * (float)(i - 4);
  dt__cmsg_encode(DTRAIN_COMPRESS_FP16, x, 9, slots);
  CHECK(dt__cmsg_decode(DTRAIN_COMPRESS_FP16, slots, 9, y, 0) == DTRAIN_OK);
  for (int i = 0; i < 9; i++) CHECK(fabsf(y[i] - x[i]) <= fabsf(x[i]) * ldexpf(1.0f, -11));
  /* a non-finite value goes through (the strategy's checks see it) */
  for (int i = 0; i < 9; i++) x[i] = (float)(i - 4);
  x[3] = INFINITY;
  x[5] = NAN;
  dt__cmsg_encode(DTRAIN_COMPRESS_FP16, x, 9, slots);
  CHECK(dt__cmsg_decode(DTRAIN_COMPRESS_FP16, slots, 9, y, 0) == DTRAIN_OK);
  CHECK(isinf(y[3]) && isnan(y[5]) && y[1] == x[1]);
  /* add */
  for (int i = 0; i < 9; i++) x[i] = (float)i, y[i] = 0.5f;
  dt__cmsg_encode(DTRAIN_COMPRESS_BF16, x, 9, slots);
  CHECK(dt__cmsg_decode(DTRAIN_COMPRESS_BF16, slots, 9, y, 1) == DTRAIN_OK);
  for (int i = 0; i < 9; i++) CHECK(y[i] == (float)i + 0.5f);
  /* Bad headers from the wire: refused, nothing written. */
  const float heads[] = {0.5f, 200.0f, -127.0f, NAN, INFINITY};
  for (int k = 0; k < 5; k++) {
    dt__cmsg_encode(DTRAIN_COMPRESS_FP16, x, 9, slots);
    slots[0] = heads[k];
    for (int i = 0; i < 9; i++) y[i] = -1.0f;
    CHECK_ERR(dt__cmsg_decode(DTRAIN_COMPRESS_FP16, slots, 9, y, 0), DTRAIN_ERR_PROTOCOL, "compressed gradient");
    CHECK(y[0] == -1.0f && y[8] == -1.0f);
  }
  dt__cmsg_encode(DTRAIN_COMPRESS_FP16, x, 9, slots);
  CHECK_ERR(dt__cmsg_decode(DTRAIN_COMPRESS_BF16, slots, 9, y, 0), DTRAIN_ERR_PROTOCOL, "header");
}
#endif

#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
typedef struct ring_arg {
  dt_comm *c;
  int rank, world, kind, ints;
  size_t n;
  float *buf;
  uint64_t sent;
  dt_result rc;
} ring_arg;

static float val(int r, size_t i, int ints) {
  if (ints) return (float)((int)((i * 7 + (size_t)r * 13) % 41) - 20); /* sums stay exact in 11 bits */
  uint64_t s = (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)r * 7919 + 1;
  return (float)((double)(dt__splitmix64(&s) >> 11) / 9007199254740992.0 - 0.5) * 1e-3f;
}

static void ring_rank(void *p) {
  ring_arg *a = (ring_arg *)p;
  for (size_t i = 0; i < a->n; i++) a->buf[i] = val(a->rank, i, a->ints);
  float *scratch = (float *)malloc(dt__compress_scratch(a->n, a->world) * sizeof(float));
  a->rc = dt__compress_allreduce(a->c, a->rank, (dt_compress_kind)a->kind, a->buf, a->n, scratch, &a->sent);
  free(scratch);
}

static void test_ring(void) {
  size_t sizes[] = {1, 2, 3, 4, 5, 17, 1000, 4097};
  for (int W = 2; W <= 5; W++)
    for (int kind = 1; kind <= 2; kind++)
      for (int ints = 0; ints < 2; ints++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
          size_t n = sizes[si];
          dt_comm *c = dt_comm_create_threads(W, -1);
          ring_arg a[5];
          dt__thread th[5];
          for (int r = 0; r < W; r++) {
            a[r].c = c, a[r].rank = r, a[r].world = W, a[r].kind = kind, a[r].ints = ints, a[r].n = n;
            a[r].buf = (float *)malloc(n * sizeof(float));
            a[r].sent = 0;
            dt__thread_start(&th[r], ring_rank, &a[r]);
          }
          for (int r = 0; r < W; r++) dt__thread_join(&th[r]);
          int same = 1, exact = 1, near = 1;
          for (int r = 0; r < W; r++) {
            CHECK(a[r].rc == DTRAIN_OK);
            same &= memcmp(a[r].buf, a[0].buf, n * sizeof(float)) == 0;
          }
          for (size_t i = 0; i < n; i++) {
            double want = 0, mag = 0;
            for (int r = 0; r < W; r++) want += val(r, i, ints), mag += fabs(val(r, i, ints));
            exact &= a[0].buf[i] == (float)want;
            /* each of the W-1 hops and the final rounding: at most 2^-11 (fp16) / 2^-8 (bf16) of the message's scale */
            double u = kind == 1 ? ldexp(1.0, -10) : ldexp(1.0, -7);
            near &= fabs(a[0].buf[i] - want) <= (double)W * u * (mag + 1e-3 * W);
          }
          CHECK_MSG(same, "W %d kind %d n %zu: ranks differ", W, kind, n);
          if (ints && kind == 1) CHECK_MSG(exact, "W %d n %zu: small integers not exact", W, n);
          CHECK_MSG(near, "W %d kind %d ints %d n %zu: far from the sum", W, kind, ints, n);
          /* 2(W-1) messages of about n/W 16-bit values each */
          double want_bytes = 2.0 * (W - 1) * ((double)n / W / 2.0 + 1.0) * 4.0;
          CHECK(fabs((double)a[0].sent - want_bytes) <= 2.0 * (W - 1) * 8.0);
          for (int r = 0; r < W; r++) free(a[r].buf);
          dt_comm_destroy(c);
        }
}
#endif

static dt_tensor *no_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)g, (void)replica, (void)b, (void)user;
  return NULL; /* never called: the strategy is refused */
}

static void test_names(void) {
  dt_compress c;
  CHECK(dt_compress_parse("fp16", &c) == DTRAIN_OK && c.kind == DTRAIN_COMPRESS_FP16);
  CHECK(strcmp(dt_compress_name(c), "fp16") == 0);
  CHECK(dt_compress_parse("bf16", &c) == DTRAIN_OK && c.kind == DTRAIN_COMPRESS_BF16);
  CHECK(dt_compress_parse("none", &c) == DTRAIN_OK && c.kind == DTRAIN_COMPRESS_NONE);
  CHECK_ERR(dt_compress_parse("fp8", &c), DTRAIN_ERR_INVALID_ARG, "'fp8': expected none, fp16, bf16, topk:F or powersgd:R");
  CHECK_ERR(dt_compress_parse(NULL, &c), DTRAIN_ERR_NULL_ARG, "text");
  /* The option is refused where no gradient crosses a wire. */
#if !defined(DTRAIN_NO_THREADS)
  dt_params *P = dt_params_create(1);
  int64_t sh[1] = {4};
  dt_params_add(P, "w", 1, sh, dt_init_zeros());
  dt_optim_options oo = dt_optim_defaults(DTRAIN_OPTIM_SGD);
  dt_optim *o = dt_optim_create(P, &oo);
  dt_strategy_options d = dt_strategy_one_device();
  d.compress.kind = DTRAIN_COMPRESS_FP16;
  dt_strategy *s = dt_strategy_create(P, o, no_step, NULL, &d);
  CHECK(s == NULL);
  CHECK_ERR(TH_RESULT(s), DTRAIN_ERR_UNSUPPORTED, "compress (fp16) is for multi_worker_mirrored and parameter_server, not one_device");
  d.compress.kind = (dt_compress_kind)7;
  s = dt_strategy_create(P, o, no_step, NULL, &d);
  CHECK_ERR(TH_RESULT(s), DTRAIN_ERR_INVALID_ARG, "compress.kind 7");
  dt_optim_destroy(o);
  dt_params_destroy(P);
#endif
}

/* The array conversions (SSE2 on x86-64) give every value the scalar
 * functions' bits: all 65536 halves decoded (with and without a scale, set or
 * added), and random bit patterns (NaNs, Inf, subnormals, the rounding
 * boundaries among them) encoded, with a difference and a scale, at lengths
 * and offsets that leave vector tails; in both floating-point modes. */
static void test_h16_arrays(void) {
  enum { N = 2 * 65536 + 13 };
  unsigned char *hb = (unsigned char *)malloc(2 * N + 2), *hs = (unsigned char *)malloc(2 * N + 2);
  float *x = (float *)malloc(N * sizeof(float)), *sub = (float *)malloc(N * sizeof(float));
  float *y = (float *)malloc(N * sizeof(float)), *ys = (float *)malloc(N * sizeof(float));
  if (!hb || !hs || !x || !sub || !y || !ys) {
    CHECK_MSG(0, "out of memory");
    goto out;
  }
  uint64_t r = 0x9E3779B97F4A7C15ull;
  for (int mode = 0; mode < 2; mode++) {
    dt_set_flush_denormals(mode);
    unsigned long fp = dt__fp_enter();
    int bad = 0;
    for (int k = 1; k <= 2; k++) {
      dt_compress_kind kind = (dt_compress_kind)k;
      const float unscales[3] = {1.0f, 0.125f, 1024.0f};
      for (size_t i = 0; i < N; i++) { /* every half, then more without Inf and NaN (a vector path may leave those) */
        uint16_t h = (uint16_t)(i * 7919u);
        dt__put_le16(hb + 2 * i, i >= 65536 && (h & 0x7C00) == 0x7C00 ? (uint16_t)(h & 0x83FF) : h);
      }
      for (int u = 0; u < (k == 1 ? 3 : 1); u++)
        for (int add = 0; add < 2; add++)
          for (size_t off = 0; off < 3; off++) {
            size_t n = N - off - (size_t)u;
            for (size_t i = 0; i < n; i++) y[i] = ys[i] = (float)i * 0.25f - 3.0f;
            dt__h16_decode(kind, hb + 2 * off, unscales[u], y, n, add);
            for (size_t i = 0; i < n; i++) {
              uint16_t h = dt__get_le16(hb + 2 * (off + i));
              float f = k == 1 ? dt__f32_of_f16(h) * unscales[u] : dt__f32_of_bf16(h);
              ys[i] = add ? ys[i] + f : f;
              bad += memcmp(&y[i], &ys[i], 4) != 0;
            }
          }
      const float scales[3] = {1.0f, 16.0f, ldexpf(1.0f, -20)};
      for (int sc = 0; sc < 3; sc++)
        for (int d = 0; d < 2; d++) {
          for (size_t i = 0; i < N; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            uint32_t a = (uint32_t)(r >> 32), b = (uint32_t)r;
            if (i % 5 == 1) /* near the halves' edges */
              a = (a & 0x80001FFFu) | (uint32_t)(0x33000000u + (i % 23u) * 0x00800000u);
            if (i % 5 == 2 && i / 4096 % 3 == 0) a = (a & 0x8000FFFFu) | 0x7F800000u; /* Inf and NaNs, in places */
            if (i % 5 == 3) a = (a & 0x80FFFFFFu) | 0x47000000u;  /* around 65504 */
            if (i % 7 == 4) a = a & 0x807FFFFFu;                  /* float subnormals */
            memcpy(&x[i], &a, 4);
            b &= 0x8FFFFFFFu;
            memcpy(&sub[i], &b, 4);
          }
          size_t off = (size_t)(sc + d) % 3, n = N - off;
          dt__h16_encode(kind, x + off, d ? sub + off : NULL, scales[sc], hb, n);
          for (size_t i = 0; i < n; i++) {
            float v = d ? x[off + i] - sub[off + i] : x[off + i];
            dt__put_le16(hs + 2 * i, k == 1 ? dt__f16_of(v * scales[sc]) : dt__bf16_of(v));
          }
          bad += memcmp(hb, hs, 2 * n) != 0;
          int fin = 1, fin_s = 1;
          float m = dt__h16_absmax(x + off, d ? sub + off : NULL, n, &fin), ms = 0.0f;
          for (size_t i = 0; i < n; i++) {
            float a = fabsf(d ? x[off + i] - sub[off + i] : x[off + i]);
            if (!(a <= FLT_MAX)) fin_s = 0;
            else if (a > ms) ms = a;
          }
          bad += m != ms || fin != fin_s;
        }
    }
    dt__fp_leave(fp);
    CHECK_MSG(bad == 0, "flush %d: %d arrays or values differ from the scalar conversions", mode, bad);
  }
  dt_set_flush_denormals(1);
out:
  free(hb);
  free(hs);
  free(x);
  free(sub);
  free(y);
  free(ys);
}

int main(void) {
  TH_RUN(test_fp16_exhaustive);
  TH_RUN(test_fp16_rounding);
  TH_RUN(test_bf16);
  TH_RUN(test_h16_arrays);
#if !defined(DTRAIN_NO_DIST)
  TH_RUN(test_messages);
#else
  th_skip_item("test_messages", "DTRAIN_NO_DIST: no gradient messages");
#endif
#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
  TH_RUN(test_ring);
#else
  th_skip_item("test_ring", "threads or the distributed parts not compiled in");
#endif
  TH_RUN(test_names);
  return th_summary("test_compress");
}
