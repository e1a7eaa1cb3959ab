/* Fixed-memory mode: dtrain works inside one user buffer, fails cleanly when
 * it is full, returns every byte, and coalesces freed blocks. The same test
 * runs against a DTRAIN_NO_MALLOC build in tests/compile_checks.sh. */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <signal.h>
#include <unistd.h>

static unsigned char big[32u << 20];
static unsigned char small_buf[96u << 10];

static int inside(const void *p, const unsigned char *buf, size_t n) {
  return (const unsigned char *)p >= buf && (const unsigned char *)p < buf + n;
}

static float train_steps(dt_params *P, dt_nn_linear *l1, dt_nn_linear *l2, dt_graph *g, dt_optim *o, int steps) {
  static float x[16 * 8];
  static int32_t y[16];
  for (int i = 0; i < 16 * 8; i++) x[i] = (float)((i * 37) % 11) / 11.0f;
  for (int i = 0; i < 16; i++) y[i] = i % 4;
  int64_t xs[2] = {16, 8};
  float loss = NAN;
  for (int s = 0; s < steps; s++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, l1, dt_tensor_from(g, 2, xs, x)));
    dt_tensor *L = dt_cross_entropy(g, dt_nn_linear_forward(g, l2, h), y);
    if (dt_backward(g, L) != DTRAIN_OK) return NAN;
    dt_optim_step(o);
    loss = dt_item(L);
  }
  return loss;
}

static void test_train_inside_buffer(void) {
  CHECK(dt_use_fixed_memory(big, sizeof big) == DTRAIN_OK);
  dt_params *P = dt_params_create(3);
  dt_nn_linear l1, l2;
  dt_nn_linear_init(&l1, P, "l1", 8, 32, 1);
  dt_nn_linear_init(&l2, P, "l2", 32, 4, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.01f;
  dt_optim *o = dt_optim_create(P, &d);
  dt_graph *g = dt_graph_create(P, NULL);
  CHECK(P && o && g);
  CHECK(inside(P, big, sizeof big) && inside(dt_params_data(P), big, sizeof big) && inside(g, big, sizeof big));
  float first = train_steps(P, &l1, &l2, g, o, 1);
  float last = train_steps(P, &l1, &l2, g, o, 200);
  CHECK_MSG(isfinite(first) && last < first * 0.5f, "loss %g -> %g", first, last);
  CHECK(dt_fixed_memory_used() > 0 && dt_fixed_memory_peak() >= dt_fixed_memory_used());
  size_t during = dt_fixed_memory_used();
  train_steps(P, &l1, &l2, g, o, 5);
  CHECK(dt_fixed_memory_used() == during); /* steady state: nothing allocated */
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  dt_params_destroy(P);
  CHECK_MSG(dt_fixed_memory_used() == 0, "%zu bytes still in use", dt_fixed_memory_used());
  dt_set_allocator(NULL);
}

static void test_full_buffer_fails_cleanly(void) {
  CHECK(dt_use_fixed_memory(small_buf, sizeof small_buf) == DTRAIN_OK);
  dt_params *P = dt_params_create(1);
  CHECK(P != NULL);
  int64_t huge[2] = {1000, 1000};
  dt_clear_error();
  CHECK(dt_params_add(P, "w", 2, huge, dt_init_zeros()) == DTRAIN_ERR_NOMEM);
  CHECK(strstr(dt_last_error(), "out of memory") != NULL);
  int64_t ok[2] = {16, 16};
  CHECK(dt_params_add(P, "w", 2, ok, dt_init_zeros()) >= 0); /* the failed add left no trace */
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.arena_bytes = 4096;
  dt_graph *g = dt_graph_create(P, &gd);
  CHECK(g != NULL);
  dt_tensor *t = dt_tensor_new2(g, 200, 200); /* 160 KB: more than the buffer */
  CHECK(t == NULL && dt_graph_error(g) == DTRAIN_ERR_NOMEM);
  CHECK(strstr(dt_graph_message(g), "arena") != NULL);
  dt_graph_reset(g);
  CHECK(dt_tensor_new2(g, 8, 8) != NULL); /* small tensors still work */
  dt_graph_destroy(g);
  dt_params_destroy(P);
  CHECK(dt_fixed_memory_used() == 0);
  dt_set_allocator(NULL);
}

static void test_coalescing(void) {
  CHECK(dt_use_fixed_memory(small_buf, sizeof small_buf) == DTRAIN_OK);
  /* Fragment the buffer with many objects, free them in mixed order ... */
  dt_params *ps[12];
  for (int i = 0; i < 12; i++) {
    ps[i] = dt_params_create((uint64_t)i);
    int64_t s[1] = {100 + 37 * i};
    CHECK(ps[i] && dt_params_add(ps[i], "v", 1, s, dt_init_zeros()) >= 0);
  }
  for (int i = 0; i < 12; i += 2) dt_params_destroy(ps[i]);
  for (int i = 11; i > 0; i -= 2) dt_params_destroy(ps[i]);
  CHECK(dt_fixed_memory_used() == 0);
  /* ... then one allocation of most of the buffer must fit again. */
  dt_params *p = dt_params_create(1);
  int64_t s[1] = {(int64_t)(sizeof small_buf / sizeof(float) / 2 - 4096)};
  CHECK(p && dt_params_add(p, "big", 1, s, dt_init_zeros()) >= 0);
  dt_params_destroy(p);
  CHECK(dt_fixed_memory_used() == 0);
  dt_set_allocator(NULL);
}

static void test_bad_buffers(void) {
  unsigned char tiny[100];
  CHECK_ERR(dt_use_fixed_memory(NULL, 1 << 20), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR(dt_use_fixed_memory(tiny, sizeof tiny), DTRAIN_ERR_INVALID_ARG, "too small");
}

/* Issue 17: saving a checkpoint with a buffer too small at any point of the
 * save returns DTRAIN_ERR_NOMEM (it used to spin forever when the header
 * could not grow), never hangs, and gives every byte back. Every budget from
 * 8 KiB to 136 KiB in 512-byte steps. */
static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL: dt_checkpoint_save hung in fixed-memory mode\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}

static void test_checkpoint_budgets(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_STDIO)) TH_SKIP("built without stdio");
  char path[128];
  snprintf(path, sizeof path, "/tmp/dtrain_fixed_%ld.safetensors", (long)getpid());
  int saved = 0, nomem = 0;
  signal(SIGALRM, on_alarm);
  for (size_t budget = 8u << 10; budget <= (136u << 10); budget += 512) {
    CHECK(dt_use_fixed_memory(big, budget) == DTRAIN_OK);
    dt_params *P = dt_params_create(3);
    dt_nn_linear l1, l2;
    dt_optim *o = NULL;
    int ok = P && dt_nn_linear_init(&l1, P, "l1", 8, 32, 1) == DTRAIN_OK &&
             dt_nn_linear_init(&l2, P, "l2", 32, 4, 1) == DTRAIN_OK;
    if (ok) {
      dt_optim_options d;
      memset(&d, 0, sizeof d);
      d.kind = DTRAIN_OPTIM_ADAM;
      d.lr = 0.01f;
      o = dt_optim_create(P, &d);
    }
    if (ok && o) {
      dt_train_state st;
      memset(&st, 0, sizeof st);
      st.params = P;
      st.optim = o;
      alarm(20);
      dt_result r = dt_checkpoint_save(path, &st);
      alarm(0);
      CHECK_MSG(r == DTRAIN_OK || r == DTRAIN_ERR_NOMEM, "budget %zu: %s", budget, dt_last_error());
      saved += r == DTRAIN_OK;
      nomem += r == DTRAIN_ERR_NOMEM;
    }
    dt_optim_destroy(o);
    dt_params_destroy(P);
    CHECK_MSG(dt_fixed_memory_used() == 0, "budget %zu: %zu bytes still in use", budget, dt_fixed_memory_used());
    dt_set_allocator(NULL);
  }
  CHECK_MSG(saved > 0 && nomem > 0, "%d budgets saved, %d ran out of memory", saved, nomem);
  remove(path);
}

int main(void) {
  printf("%s\n", dt_build_info());
  TH_RUN(test_train_inside_buffer);
  TH_RUN(test_full_buffer_fails_cleanly);
  TH_RUN(test_coalescing);
  TH_RUN(test_bad_buffers);
  TH_RUN(test_checkpoint_budgets);
  return th_summary("fixed_memory");
}
