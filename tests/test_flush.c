/* tests/test_flush.c -- subnormal floats flushed to zero in dtrain's own work
 * (dt_set_flush_denormals): backward, optimizer updates and every replica of
 * a strategy step see subnormal values as zero where the CPU can flush them
 * (x86 SSE, AArch64), keep them with the setting off, and the caller's
 * floating-point environment is the same after each call as before (flush
 * off stays off; a caller's own flush stays on). */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if defined(__SSE2__) || defined(_M_X64) || (defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)))
#  define CAN_FLUSH 1
#else
#  define CAN_FLUSH 0
#endif
#if defined(__SSE2__) || defined(_M_X64)
#  include <xmmintrin.h>
#  define X86 1
#endif

/* 1e-30 * 1e-10 = 1e-40 is subnormal in float: zero where results are flushed. */
static int flushing_now(void) {
  volatile float a = 1e-30f, b = 1e-10f;
  float c = a * b;
  volatile float keep = c;
  return keep == 0.0f;
}

static void test_setting(void) {
  int was = dt_set_flush_denormals(1);
  CHECK(dt_get_flush_denormals() == 1);
  CHECK(dt_set_flush_denormals(0) == 1);
  CHECK(dt_get_flush_denormals() == 0);
  CHECK(dt_set_flush_denormals(1) == 0);
  dt_set_flush_denormals(was);
  CHECK(!flushing_now()); /* the test program itself runs with IEEE subnormals */
}

/* d(x * c)/dx seeded with s: s * c = 1e-20 * 1e-20 = 1e-40, computed in backward. */
static float backward_subnormal(void) {
  dt_params *P = dt_params_create(1);
  int64_t one[1] = {1};
  dt_params_add(P, "x", 1, one, dt_init_zeros());
  dt_params_data(P)[0] = 1.0f;
  dt_graph *g = dt_graph_create(P, NULL);
  float cv = 1e-20f, seed = 1e-20f;
  dt_tensor *c = dt_tensor_from(g, 1, one, &cv);
  dt_tensor *y = dt_mul(g, dt_param(g, 0), c);
  dt_params_zero_grad(P);
  CHECK(dt_backward_grad(g, y, &seed) == DTRAIN_OK);
  float gx = dt_params_grad(P)[0];
  dt_graph_destroy(g);
  dt_params_destroy(P);
  return gx;
}

static void test_backward(void) {
  int was = dt_set_flush_denormals(1);
  float gx = backward_subnormal();
  CHECK(CAN_FLUSH ? gx == 0.0f : gx > 0.0f);
  CHECK(!flushing_now()); /* put back */
  dt_set_flush_denormals(0);
  gx = backward_subnormal();
  CHECK(gx > 0.0f && gx < FLT_MIN); /* kept: IEEE */
  CHECK(!flushing_now());
#if defined(X86)
  /* A caller that flushes on its own keeps it, whatever the setting. */
  unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  gx = backward_subnormal();
  CHECK(gx == 0.0f);
  CHECK(_mm_getcsr() == (csr | 0x8040u));
  _mm_setcsr(csr);
#endif
  dt_set_flush_denormals(was);
}

/* SGD, lr 1: p = 0 - 1 * g with g = 1e-39 (subnormal): denormals-are-zero reads it as 0. */
static float sgd_subnormal(void) {
  dt_params *P = dt_params_create(1);
  int64_t n[1] = {20}; /* past the SIMD width, so the vector path runs too */
  dt_params_add(P, "p", 1, n, dt_init_zeros());
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 1.0f;
  dt_optim *o = dt_optim_create(P, &od);
  float data[20], grad[20];
  for (int i = 0; i < 20; i++) data[i] = 0.0f, grad[i] = 1e-39f;
  CHECK(dt_optim_update(o, data, grad, 0, 20) == DTRAIN_OK);
  float worst = 0.0f;
  for (int i = 0; i < 20; i++)
    if (fabsf(data[i]) > worst) worst = fabsf(data[i]);
  dt_optim_destroy(o);
  dt_params_destroy(P);
  return worst;
}

static void test_optimizer(void) {
  int was = dt_set_flush_denormals(1);
  float w = sgd_subnormal();
  CHECK(CAN_FLUSH ? w == 0.0f : w > 0.0f);
  CHECK(!flushing_now());
  dt_set_flush_denormals(0);
  w = sgd_subnormal();
  CHECK(w > 0.0f && w < FLT_MIN);
  CHECK(!flushing_now());
  dt_set_flush_denormals(was);
}

/* Each replica's step function notes whether it runs flushed. */
typedef struct seen {
  int flushed[4], calls[4];
} seen;

static dt_tensor *probe_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  seen *s = (seen *)user;
  (void)b;
  if (replica >= 0 && replica < 4) {
    s->flushed[replica] += flushing_now();
    s->calls[replica]++;
  }
  return dt_sum(g, dt_param(g, 0));
}

static void strategy_flushes(int replicas, int on) {
  int was = dt_set_flush_denormals(on);
  dt_params *P = dt_params_create(1);
  int64_t n[1] = {4};
  dt_params_add(P, "w", 1, n, dt_init_zeros());
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  dt_optim *o = dt_optim_create(P, &od);
  seen sn;
  memset(&sn, 0, sizeof sn);
  dt_strategy_options sd = replicas > 1 ? dt_strategy_mirrored(replicas) : dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(P, o, probe_step, &sn, &sd);
  CHECK(s != NULL);
  float x[8] = {0};
  int32_t y[2] = {0, 0};
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = 2;
  b.x = x;
  b.x_cols = 4;
  b.y = y;
  for (int k = 0; s && k < 3; k++) CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
  for (int r = 0; r < replicas; r++) {
    CHECK(sn.calls[r] == 3);
    CHECK(sn.flushed[r] == (on && CAN_FLUSH ? 3 : 0));
  }
  CHECK(!flushing_now());
  dt_strategy_destroy(s);
  dt_optim_destroy(o);
  dt_params_destroy(P);
  dt_set_flush_denormals(was);
}

static void test_strategy(void) {
  strategy_flushes(1, 1);
  strategy_flushes(1, 0);
#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
  strategy_flushes(2, 1); /* replica 1 on a pool thread */
  strategy_flushes(2, 0);
#endif
}

int main(void) {
  TH_RUN(test_setting);
  TH_RUN(test_backward);
  TH_RUN(test_optimizer);
  TH_RUN(test_strategy);
  return th_summary("flush");
}
