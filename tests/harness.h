/* tests/harness.h -- the one tiny test harness of dtrain's suite.
 *
 *   static void test_something(void) { CHECK(x == 1); CHECK_NEAR(a, b, 1e-6); }
 *   int main(void) { TH_RUN(test_something); return th_summary("suite_name"); }
 *
 * A test passes when none of its checks fail. A test that cannot run here
 * (no python3, no pseudo-terminal, a build without threads, ...) says so:
 *   TH_SKIP("no gzip command");        marks the test skipped and returns
 *   th_skip("no %s", what);            marks it skipped and goes on (a part)
 *   th_skip_item("name", "why");       outside a test: a group not run
 * A failed check always wins over a skip: a skip never hides a failure.
 * th_summary prints one "skip NAME: reason" line per skip, then
 * "suite_name: N passed, N failed, N skipped", and returns the exit code
 * (tools/run_tests.sh reads both).
 * Logging from dtrain is captured (th_last_log) instead of printed, unless
 * DTRAIN_TEST_VERBOSE is set in the environment.
 */
#ifndef DTRAIN_TEST_HARNESS_H
#define DTRAIN_TEST_HARNESS_H

#include "dtrain.h"

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>
#include "win_compat.h"

static int th_passed, th_failed, th_skipped, th_cur_failed, th_cur_skipped;
static const char *th_cur = "";
static char th_last_log[512];

/* The reasons, kept for th_summary (printed at the end, not when they happen:
 * a test that forks would otherwise print them again from a child's copy of
 * the stdio buffer). Past TH_MAX_SKIPS reasons only the count goes on. */
#define TH_MAX_SKIPS 64
static char th_skip_why[TH_MAX_SKIPS][240];
static int th_skip_n;

static void th_skip_vnote(const char *name, const char *fmt, va_list ap) {
  if (th_skip_n < TH_MAX_SKIPS) {
    char why[200];
    vsnprintf(why, sizeof why, fmt, ap);
    snprintf(th_skip_why[th_skip_n++], sizeof th_skip_why[0], "skip %s: %s", name, why);
    if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "%s\n", th_skip_why[th_skip_n - 1]);
  }
}

/* Marks the running test skipped (once: its first reason is the one kept). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 1, 2)))
#endif
static void th_skip(const char *fmt, ...) {
  va_list ap;
  if (th_cur_skipped++) return;
  va_start(ap, fmt);
  th_skip_vnote(th_cur, fmt, ap);
  va_end(ap);
}

/* Counts one skipped item outside any test: tests this build leaves out. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
static void th_skip_item(const char *name, const char *fmt, ...) {
  va_list ap;
  th_skipped++;
  va_start(ap, fmt);
  th_skip_vnote(name, fmt, ap);
  va_end(ap);
}

#define TH_SKIP(...)                                                                  \
  do {                                                                                \
    th_skip(__VA_ARGS__);                                                             \
    return;                                                                           \
  } while (0)

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      th_cur_failed++;                                                                \
      fprintf(stderr, "FAIL %s:%d [%s]: %s\n", __FILE__, __LINE__, th_cur, #cond);    \
    }                                                                                 \
  } while (0)

#define CHECK_MSG(cond, ...)                                                          \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      th_cur_failed++;                                                                \
      fprintf(stderr, "FAIL %s:%d [%s]: %s: ", __FILE__, __LINE__, th_cur, #cond);    \
      fprintf(stderr, __VA_ARGS__);                                                   \
      fputc('\n', stderr);                                                            \
    }                                                                                 \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                         \
  do {                                                                                \
    double th_a_ = (double)(a), th_b_ = (double)(b);                                  \
    if (!(fabs(th_a_ - th_b_) <= (double)(tol))) {                                    \
      th_cur_failed++;                                                                \
      fprintf(stderr, "FAIL %s:%d [%s]: %s = %.9g, %s = %.9g (tol %g)\n", __FILE__,   \
              __LINE__, th_cur, #a, th_a_, #b, th_b_, (double)(tol));                 \
    }                                                                                 \
  } while (0)

/* The dt_result of a call that returns a new object: DTRAIN_OK when p is not
 * NULL, else the code the failure left (for CHECK_ERR). */
#define TH_RESULT(p) ((p) != NULL ? DTRAIN_OK : dt_last_result())

/* Expect a dt_result code, and a non-empty message containing `needle`. */
#define CHECK_ERR(expr, code, needle)                                                 \
  do {                                                                                \
    dt_result th_r_ = (expr);                                                         \
    if (th_r_ != (code)) {                                                            \
      th_cur_failed++;                                                                \
      fprintf(stderr, "FAIL %s:%d [%s]: %s gave %s, expected %s\n", __FILE__,         \
              __LINE__, th_cur, #expr, dt_result_name(th_r_), dt_result_name(code));  \
    } else if (!strstr(dt_last_error(), (needle))) {                                  \
      th_cur_failed++;                                                                \
      fprintf(stderr, "FAIL %s:%d [%s]: message '%s' lacks '%s'\n", __FILE__,         \
              __LINE__, th_cur, dt_last_error(), (needle));                           \
    }                                                                                 \
  } while (0)

/* Threads of a test (ranks, a server, a worker) may log at once: one at a
 * time writes the last line (a spin lock on a GCC/Clang builtin, which C and
 * C++ tests alike have, and ThreadSanitizer understands). */
static void th_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  static char busy;
  (void)user;
  while (__atomic_test_and_set(&busy, __ATOMIC_ACQUIRE)) {
  }
  snprintf(th_last_log, sizeof th_last_log, "%d %s %s", (int)level, dt_result_name(code), msg);
  if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "[log] %s\n", th_last_log);
  __atomic_clear(&busy, __ATOMIC_RELEASE);
}

#define TH_RUN(fn)                                                                    \
  do {                                                                                \
    th_cur = #fn;                                                                     \
    th_cur_failed = 0;                                                                \
    th_cur_skipped = 0;                                                               \
    dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG);                                    \
    dt_clear_error();                                                                 \
    clock_t th_c0 = clock();                                                          \
    fn();                                                                             \
    if (th_cur_failed) th_failed++; else if (th_cur_skipped) th_skipped++; else th_passed++; \
    if (getenv("DTRAIN_TEST_VERBOSE")) /* with the processor seconds it took */      \
      fprintf(stderr, "%s %s (%.2f cpu s)\n", th_cur_failed ? "FAILED" : th_cur_skipped ? "skipped" : "ok", #fn, \
              (double)(clock() - th_c0) / CLOCKS_PER_SEC);                            \
  } while (0)

static int th_summary(const char *suite) {
  for (int i = 0; i < th_skip_n; i++) printf("%s\n", th_skip_why[i]);
  printf("%s: %d passed, %d failed, %d skipped\n", suite, th_passed, th_failed, th_skipped);
  return th_failed ? 1 : 0;
}

/* ---- deterministic random numbers for tests --------------------------------- */
static uint64_t th_rng_state = 0x1234567ULL;
static void th_seed(uint64_t s) { th_rng_state = s ? s : 1; }

/* Under an emulator (make test-cross sets RUNNER to a qemu command line), the
 * heaviest sweeps run a named subset of their cases: the same checks of the same
 * arithmetic on fewer shapes, steps or thread counts (under qemu-s390x a GEMM sweep
 * with its double reference took 20 s of CPU). Natively and under the sanitizers they
 * run in full. */
static int th_emulated(void) {
  const char *r = getenv("RUNNER");
  return r != NULL && strstr(r, "qemu") != NULL;
}
/* The most intra-op threads a sweep that checks how products split should use:
 * `most`, but 1 in a build without threads (dt_set_threads refuses more there)
 * and 1 under an emulator: the split is the same C on every architecture,
 * checked at 1..most by the host, ASan and TSan runs; an emulated run adds the
 * architecture's kernels, which one thread exercises. */
static int th_sweep_threads(int most) {
  return (dt_build_features() & DTRAIN_FEATURE_THREADS) && !th_emulated() ? most : 1;
}
static double th_rand(void) { /* uniform [0,1) */
  th_rng_state ^= th_rng_state << 13;
  th_rng_state ^= th_rng_state >> 7;
  th_rng_state ^= th_rng_state << 17;
  return (double)(th_rng_state >> 11) * (1.0 / 9007199254740992.0);
}
static float th_uniform(float lo, float hi) { return lo + (hi - lo) * (float)th_rand(); }
static void th_fill(float *x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++) x[i] = th_uniform(lo, hi);
}
/* Values in [lo,hi] whose magnitude is at least `gap` (away from kinks at 0). */
static void th_fill_away0(float *x, int64_t n, float lo, float hi, float gap) {
  for (int64_t i = 0; i < n; i++) {
    float v;
    do v = th_uniform(lo, hi); while (fabsf(v) < gap);
    x[i] = v;
  }
}

/* ---- gradient check -----------------------------------------------------------
 * Checks the backward of a function of up to 4 tensor inputs against central
 * finite differences. The function builds its output from the inputs on the
 * given graph. The scalar probed is L = sum(out * R) for a fixed random R,
 * accumulated in double; its analytic gradient comes from dt_backward_grad
 * with R as the seed. FD: (L(x+e) - L(x-e)) / 2e in double, e = th_gc_eps.
 * At most th_gc_max elements per input are probed (spread over the input).
 * Passes when |analytic - fd| <= atol + rtol * max(|analytic|, |fd|).
 */
typedef dt_tensor *(*th_fn)(dt_graph *g, dt_tensor **in, void *ctx);

typedef struct th_input {
  float *data;          /* values (perturbed in place, restored) */
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int grad;             /* 1: check the gradient of this input */
} th_input;

static double th_gc_eps = 1e-3, th_gc_atol = 2e-3, th_gc_rtol = 2e-2;
static int th_gc_max = 48;

static int64_t th_numel(const th_input *in) {
  int64_t n = 1;
  for (int d = 0; d < in->ndim; d++) n *= in->shape[d];
  return n;
}

/* Builds the graph once from the current input values; returns out (or NULL). */
static dt_tensor *th_gc_build(dt_graph *g, th_fn f, void *ctx, th_input *ins, int nin, dt_tensor **ts) {
  dt_graph_reset(g);
  for (int i = 0; i < nin; i++) {
    ts[i] = dt_tensor_from(g, ins[i].ndim, ins[i].shape, ins[i].data);
    if (ts[i] && ins[i].grad) dt_tensor_set_requires_grad(ts[i], 1);
  }
  return f(g, ts, ctx);
}

static double th_gc_loss(const dt_tensor *out, const float *r) {
  double s = 0;
  for (int64_t i = 0; i < out->size; i++) s += (double)out->data[i] * (double)r[i];
  return s;
}

/* Returns the number of mismatches (0 = pass); prints details of the first few. */
static int th_gradcheck(const char *name, th_fn f, void *ctx, th_input *ins, int nin) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *ts[4];
  int bad = 0;
  if (!g) return 1;
  dt_tensor *out = th_gc_build(g, f, ctx, ins, nin, ts);
  if (!out) {
    fprintf(stderr, "gradcheck %s: forward failed: %s\n", name, dt_graph_message(g));
    dt_graph_destroy(g);
    return 1;
  }
  int64_t nout = out->size;
  float *r = (float *)malloc((size_t)nout * sizeof(float));
  for (int64_t i = 0; i < nout; i++) r[i] = th_uniform(-1.0f, 1.0f);
  if (dt_backward_grad(g, out, r) != DTRAIN_OK) {
    fprintf(stderr, "gradcheck %s: backward failed: %s\n", name, dt_graph_message(g));
    free(r);
    dt_graph_destroy(g);
    return 1;
  }
  /* Copy the analytic gradients out before the graph is reused. */
  float *an[4] = {NULL, NULL, NULL, NULL};
  for (int i = 0; i < nin; i++) {
    if (!ins[i].grad) continue;
    int64_t n = th_numel(&ins[i]);
    an[i] = (float *)calloc((size_t)n, sizeof(float));
    if (ts[i]->grad) memcpy(an[i], ts[i]->grad, (size_t)n * sizeof(float));
  }
  for (int i = 0; i < nin; i++) {
    if (!ins[i].grad) continue;
    int64_t n = th_numel(&ins[i]);
    int64_t step = n > th_gc_max ? n / th_gc_max : 1;
    for (int64_t j = 0; j < n; j += step) {
      float keep = ins[i].data[j];
      ins[i].data[j] = (float)(keep + th_gc_eps);
      double hp = (double)ins[i].data[j];
      dt_tensor *o1 = th_gc_build(g, f, ctx, ins, nin, ts);
      double lp = o1 ? th_gc_loss(o1, r) : NAN;
      ins[i].data[j] = (float)(keep - th_gc_eps);
      double hm = (double)ins[i].data[j];
      dt_tensor *o2 = th_gc_build(g, f, ctx, ins, nin, ts);
      double lm = o2 ? th_gc_loss(o2, r) : NAN;
      ins[i].data[j] = keep;
      double fd = (lp - lm) / (hp - hm); /* the float step actually taken */
      double a = an[i][j];
      double tol = th_gc_atol + th_gc_rtol * fmax(fabs(a), fabs(fd));
      if (!(fabs(a - fd) <= tol)) {
        if (bad < 5)
          fprintf(stderr, "gradcheck %s: input %d element %lld: analytic %.7g, numeric %.7g\n", name, i,
                  (long long)j, a, fd);
        bad++;
      }
    }
  }
  for (int i = 0; i < nin; i++) free(an[i]);
  free(r);
  dt_graph_destroy(g);
  return bad;
}

/* Shorthand to describe an input. */
static th_input th_in(float *data, int ndim, const int64_t *shape, int grad) {
  th_input t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.ndim = ndim;
  for (int d = 0; d < ndim; d++) t.shape[d] = shape[d];
  t.grad = grad;
  return t;
}

/* ---- the elementwise maps, as a table for gradchecks and parity tests --------------------
 * One row per op of DT__MAP_LIST (dt_maps.h), generated from the list: a
 * test that iterates th_map_ops() checks an op added to the list without an
 * edit of its own. */
typedef struct th_map_op {
  const char *name;                                        /* "gelu": the op is dt_gelu */
  dt_tensor *(*unary)(dt_graph *g, dt_tensor *x);          /* args UNARY, else NULL */
  dt_tensor *(*scalar)(dt_graph *g, dt_tensor *x, float s); /* args SCALAR, else NULL */
  int domain;                                              /* DT__MAP_DOMAIN_* */
} th_map_op;

#define TH_MAP_FNS_UNARY(name) dt_##name, NULL
#define TH_MAP_FNS_SCALAR(name) NULL, dt_##name
#define TH_MAP_ROW(name, NAME, args, domain) {#name, TH_MAP_FNS_##args(name), DT__MAP_DOMAIN_##domain},
static const th_map_op *th_map_ops(int *n) {
  static const th_map_op ops[] = {DT__MAP_LIST(TH_MAP_ROW)};
  *n = (int)(sizeof ops / sizeof ops[0]);
  return ops;
}
#undef TH_MAP_ROW

/* The scalar the tests give an op that takes one: a non-integer power. */
static float th_map_scalar(const th_map_op *m) { return m->domain == DT__MAP_DOMAIN_POW ? 1.7f : 0.75f; }

static dt_tensor *th_map_apply(dt_graph *g, const th_map_op *m, dt_tensor *x) {
  return m->unary ? m->unary(g, x) : m->scalar(g, x, th_map_scalar(m));
}

/* n inputs inside the op's domain (positive where it has one), else in
 * [-3, 3] but at least 0.05 from 0 (the kink of ReLU and its kin). */
static void th_map_fill(const th_map_op *m, float *x, int64_t n) {
  if (m->domain != DT__MAP_DOMAIN_ANY) th_fill(x, n, 0.3f, 3.0f);
  else th_fill_away0(x, n, -3.0f, 3.0f, 0.05f);
}

#endif /* DTRAIN_TEST_HARNESS_H */
