/* dt_sgemm's packed panels: a scratch slot (dt_base.c, B panels of NC = 768
 * columns, kept between calls) or, when none can be had, the stack (B panels
 * of 192 columns, other loop orders). The two ways must give the same bits:
 * shapes that cross KC (256), MC (96) and both panel widths, every transpose,
 * alpha/beta, the epilogue (bias, row bias, ReLU), on every GEMM path the CPU
 * has, at 1 and 3 intra-op threads, with all 32 slots held by the test (the
 * stack) against none held (a slot); both against a double reference. And the
 * slots themselves: aligned, kept and reused, grown, exhausted, refused under
 * a user's allocator and under fixed memory. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#define SLOTS 32 /* dt_base.c's DT__SCRATCH_SLOTS */

static int held[SLOTS + 1];

/* Claim every slot (small claims: a slot's block is kept and only grows). */
static int hold_all(void) {
  int n = 0;
  for (int i = 0; i < SLOTS + 1; i++) {
    held[i] = -1;
    if (dt__scratch_claim(64, &held[i])) n++;
  }
  return n;
}

static void release_all(void) {
  for (int i = 0; i < SLOTS + 1; i++) dt__scratch_release(held[i]);
}

static void test_slots(void) {
  int s1, s2, s3;
  float *a = (float *)dt__scratch_claim(1000, &s1);
  CHECK(a != NULL && s1 >= 0);
  CHECK(((uintptr_t)a % 64) == 0);
  if (!a) return;
  for (int i = 0; i < 250; i++) a[i] = (float)i; /* the claim is usable */
  float *b = (float *)dt__scratch_claim(1000, &s2);
  CHECK(b != NULL && s2 != s1 && b != a); /* a busy slot is not handed out twice */
  dt__scratch_release(s1);
  float *c = (float *)dt__scratch_claim(800, &s3);
  CHECK(c == a && s3 == s1); /* released: the same block again, kept */
  dt__scratch_release(s3);
  float *d = (float *)dt__scratch_claim((size_t)1 << 20, &s3); /* more than slot s1 has: grown */
  CHECK(d != NULL && s3 == s1);
  if (d) d[((size_t)1 << 18) - 1] = 1.0f;
  dt__scratch_release(s3);
  dt__scratch_release(s2);

  /* All held: the next claim gets nothing, and says so with slot -1. */
  CHECK(hold_all() == SLOTS);
  int s4 = 7;
  CHECK(dt__scratch_claim(64, &s4) == NULL && s4 == -1);
  dt__scratch_release(-1); /* a no-op */
  release_all();
  CHECK(dt__scratch_claim(64, &s4) != NULL && s4 >= 0);
  dt__scratch_release(s4);
}

/* A user's allocator (aligned by hand over malloc). */
static void *user_alloc(size_t size, size_t align, void *user) {
  ++*(int *)user;
  unsigned char *raw = (unsigned char *)malloc(size + align + sizeof(void *));
  if (!raw) return NULL;
  uintptr_t p = ((uintptr_t)(raw + sizeof(void *)) + align - 1) & ~(uintptr_t)(align - 1);
  memcpy((void *)(p - sizeof(void *)), &raw, sizeof raw);
  return (void *)p;
}

static void user_free(void *ptr, size_t size, void *user) {
  (void)size;
  (void)user;
  void *raw;
  memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
  free(raw);
}

static void test_user_allocators(void) {
  /* A user's allocator or fixed memory: no slot (it would keep their block
   * for good); dt_sgemm then works from the stack and still gets it right. */
  int calls = 0;
  dt_allocator al;
  al.alloc = user_alloc;
  al.free = user_free;
  al.user = &calls;
  dt_set_allocator(&al);
  int s = 0;
  CHECK(dt__scratch_claim(64, &s) == NULL && s == -1);
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, c[4] = {0, 0, 0, 0};
  dt_sgemm(0, 0, 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2);
  CHECK(c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11);
  dt_set_allocator(NULL);
  static unsigned char fixed[1 << 16];
  CHECK(dt_use_fixed_memory(fixed, sizeof fixed) == DTRAIN_OK);
  CHECK(dt__scratch_claim(64, &s) == NULL && s == -1);
  dt_set_allocator(NULL);
  CHECK(dt__scratch_claim(64, &s) != NULL);
  dt__scratch_release(s);
}

/* ---- the same bits from a slot and from the stack ------------------------------------ */

typedef struct shape {
  int64_t m, n, k;
  int full; /* 1: panels filled to the end of their buffer: one product, for the bound (ASan);
             * 2: a large shape: two products (plain, beta 0; row bias + ReLU), one thread */
  const char *why;
} shape;

/* KC 256, MC 96, NC 768 (a slot) or 192 (the stack); MR 6 or 8, NR 8-32 by path;
 * a slot holds all of A's rows (up to 1024) for more than 2 MC rows and B
 * wider than a panel (dt_gemm.c's whole-A order). Kept small (the suite runs
 * under qemu and the sanitizers too). In this order: a slot only grows, so
 * each panels-full shape comes before any shape that claims a larger slot
 * (the whole-A ones last, all of them 204 rows of A). */
static const shape shapes[] = {
    {30, 800, 257, 0, "few rows, B wider than either panel: the pc -> jc loop both ways; k crosses KC"},
    {150, 500, 8, 0, "B wider than the stack's panel only: pc -> jc on the stack, jc -> pc in a slot"},
    {64, 800, 20, 0, "a training batch: B read unpacked, 4-row edge tiles"},
    {97, 257, 20, 0, "one row past MC, one column past 256 (A packed)"},
    {7, 780, 33, 0, "few rows, a last narrow sliver"},
    {193, 790, 256, 1, "the last sliver joins the one panel in a slot (800 columns on AVX-512), panels full"},
    {193, 400, 256, 1, "the last sliver joins the stack's second panel (208 columns on AVX-512), panels full"},
    {200, 1600, 8, 0, "more than 2 MC rows: 3 B panels from a slot (all of A packed at once), 9 from the stack"},
    {200, 820, 260, 2, "more than 2 MC rows, two panels: all of A packed per k block in a slot; k crosses KC"},
    {200, 1568, 256, 1, "all of A's rows and a joined second panel (800 columns on AVX-512) in a slot, panels full"},
};
#define NSHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const char *const isa_names[] = {"portable", "avx2", "avx512", "neon"};

/* mode 0: plain dt_sgemm (alpha, beta); 1: epilogue bias + ReLU; 2: row bias + ReLU */
static void run(const shape *s, int ta, int tb, int mode, const float *a, const float *b, const float *bias,
                const float *rbias, float alpha, float beta, const float *c0, float *c) {
  int64_t lda = ta ? s->m : s->k, ldb = tb ? s->k : s->n;
  memcpy(c, c0, (size_t)(s->m * s->n) * sizeof(float));
  if (mode == 0) {
    dt_sgemm(ta, tb, s->m, s->n, s->k, alpha, a, lda, b, ldb, beta, c, s->n);
  } else {
    dt__gemm_epi ep;
    ep.bias = mode == 1 ? bias : NULL;
    ep.row_bias = mode == 2 ? rbias : NULL;
    ep.relu = 1;
    dt__sgemm_epi(ta, tb, s->m, s->n, s->k, a, lda, b, ldb, c, s->n, &ep);
  }
}

/* The worst |got - ref| / (|ref| + 1) over C, the reference in double. */
static double ref_error(const shape *s, int ta, int tb, int mode, const float *a, const float *b, const float *bias,
                        const float *rbias, float alpha, float beta, const float *c0, const float *got) {
  int64_t lda = ta ? s->m : s->k, ldb = tb ? s->k : s->n;
  double worst = 0;
  for (int64_t i = 0; i < s->m; i++)
    for (int64_t j = 0; j < s->n; j++) {
      double acc = 0;
      for (int64_t p = 0; p < s->k; p++)
        acc += (double)(ta ? a[p * lda + i] : a[i * lda + p]) * (double)(tb ? b[j * ldb + p] : b[p * ldb + j]);
      double want;
      if (mode == 0) want = alpha * acc + (beta == 0.0f ? 0.0 : beta * (double)c0[i * s->n + j]);
      else {
        want = acc + (mode == 1 ? (double)bias[j] : (double)rbias[i]);
        if (want < 0) want = 0;
      }
      double e = fabs((double)got[i * s->n + j] - want) / (fabs(want) + 1.0);
      if (e > worst) worst = e;
    }
  return worst;
}

static void test_slot_and_stack_same_bits(void) {
  int compared = 0, differ = 0, refs = 0;
  for (int si = 0; si < NSHAPES; si++) {
    const shape *s = &shapes[si];
    size_t na = (size_t)(s->m * s->k), nb = (size_t)(s->k * s->n), nc = (size_t)(s->m * s->n);
    float *a = (float *)malloc(na * sizeof(float)), *b = (float *)malloc(nb * sizeof(float));
    float *c0 = (float *)malloc(nc * sizeof(float)), *slot = (float *)malloc(nc * sizeof(float));
    float *stack = (float *)malloc(nc * sizeof(float));
    float *bias = (float *)malloc((size_t)s->n * sizeof(float)), *rbias = (float *)malloc((size_t)s->m * sizeof(float));
    th_seed((uint64_t)(101 + si));
    th_fill(a, (int)na, -1, 1);
    th_fill(b, (int)nb, -1, 1);
    th_fill(c0, (int)nc, -1, 1);
    th_fill(bias, (int)s->n, -0.5f, 0.5f);
    th_fill(rbias, (int)s->m, -0.5f, 0.5f);
    int first = -1;
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue; /* test_speed reports the paths it lacks */
      if (first < 0) first = ii;
      for (int threads = 1; threads <= th_sweep_threads(3); threads += 2) { /* 1 and 3 */
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        for (int t = 0; t < 4; t++)
          for (int mode = 0; mode < 3; mode++) {
            if (mode > 0 && t != 1) continue; /* the epilogue: A @ B^T, a linear layer's forward */
            if (threads > 1 && !(t == 0 && mode == 0) && !(t == 1 && mode == 2)) continue;
            if (s->full == 1 && (threads > 1 || t != 0 || mode != 0)) continue;
            if (s->full == 2 && (threads > 1 || !((t == 0 && mode == 0) || (t == 1 && mode == 2)))) continue;
            int ta = t >> 1, tb = t & 1;
            float alpha = t == 2 ? -1.5f : 1.0f, beta = t == 0 ? 0.0f : t == 1 ? 1.0f : 0.75f;
            run(s, ta, tb, mode, a, b, bias, rbias, alpha, beta, c0, slot);
            CHECK_MSG(hold_all() == SLOTS, "%s: could not hold every slot", s->why);
            run(s, ta, tb, mode, a, b, bias, rbias, alpha, beta, c0, stack);
            release_all();
            compared++;
            if (memcmp(slot, stack, nc * sizeof(float)) != 0) {
              differ++;
              CHECK_MSG(0, "%dx%dx%d (%s) on %s, %d threads, trans %d%d, mode %d: slot and stack differ",
                        (int)s->m, (int)s->n, (int)s->k, s->why, isa_names[ii], threads, ta, tb, mode);
            }
            /* against the double reference: each path once per shape, the epilogues on the first */
            if (threads == 1 && s->full != 1 && ((t == 0 && mode == 0) || (ii == first && mode > 0))) {
              double e = ref_error(s, ta, tb, mode, a, b, bias, rbias, alpha, beta, c0, stack);
              refs++;
              CHECK_MSG(e < 1e-4, "%dx%dx%d on %s, trans %d%d, mode %d: error %.3g against double",
                        (int)s->m, (int)s->n, (int)s->k, isa_names[ii], ta, tb, mode, e);
            }
          }
      }
    }
    free(a);
    free(b);
    free(c0);
    free(slot);
    free(stack);
    free(bias);
    free(rbias);
  }
  dt_sgemm_use_isa("best");
  CHECK(dt_set_threads(1) == DTRAIN_OK);
  CHECK(differ == 0);
  CHECK(compared >= NSHAPES && refs >= 6 * 3); /* at least the portable path: every shape, 3 references each */
}

/* The x86 A packer (6-tall slivers: both x86 paths use it) gives the
 * portable packer's bytes: its 8x8 transposes and their column tails, the
 * short last sliver, offsets into A, an odd stride, both transposes; every
 * float the kernels read (6 x kc per sliver, zero-padded in the short one). */
static void test_x86_pack_a(void) {
#ifdef DT__X86_SIMD
  if (!dt__cpu_avx2()) {
    th_skip("the x86 A packer: this CPU has no AVX2");
    return;
  }
  enum { LDA = 131, ROWS = 110 }; /* rows of a: i0 + mc, or p0 + kc when transposed */
  static float a[ROWS * LDA + 64], want[24 * 96], got[24 * 96 + 16];
  for (int i = 0; i < ROWS * LDA + 64; i++) a[i] = (float)(i % 1013) * 0.5f - 200.0f;
  static const int mcs[] = {1, 5, 6, 7, 12, 17, 24}, kcs[] = {1, 7, 8, 9, 15, 16, 17, 31, 40, 95};
  int cases = 0;
  for (int trans = 0; trans < 2; trans++)
    for (size_t x = 0; x < sizeof mcs / sizeof mcs[0]; x++)
      for (size_t y = 0; y < sizeof kcs / sizeof kcs[0]; y++) {
        int64_t mc = mcs[x], kc = kcs[y], i0 = trans ? 3 : 2, p0 = trans ? 5 : 9;
        int64_t padded = (mc + 5) / 6 * 6;
        memset(want, 0, sizeof want);
        for (int i = 0; i < (int)(sizeof got / sizeof got[0]); i++) got[i] = -1.0f; /* holes show */
        dt__gemm_pack_a_n(6, trans, a, LDA, i0, p0, mc, kc, want);
        dt__gemm_pack_a_avx2(trans, a, LDA, i0, p0, mc, kc, got);
        CHECK_MSG(memcmp(want, got, (size_t)(padded * kc) * sizeof(float)) == 0,
                  "trans %d, mc %d, kc %d: not the portable packer's bytes", trans, (int)mc, (int)kc);
        cases++;
      }
  CHECK(cases == 2 * 7 * 10);
#else
  th_skip("the x86 A packer: not an x86 build");
#endif
}

int main(void) {
  TH_RUN(test_x86_pack_a);
  TH_RUN(test_slot_and_stack_same_bits); /* first: before test_slots grows a slot past dt_sgemm's size */
  TH_RUN(test_slots);
  TH_RUN(test_user_allocators);
  return th_summary("gemm_panels");
}
