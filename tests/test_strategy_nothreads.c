/* A build without threads (DTRAIN_NO_THREADS): one_device trains, every
 * other strategy and the threaded communicator refuse with
 * DTRAIN_ERR_UNSUPPORTED. This file compiles its own private (static) copy of
 * the implementation with the flag set. */
#ifndef DTRAIN_NO_THREADS
#define DTRAIN_NO_THREADS
#endif
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "harness.h"

static float X[8] = {0, 0, 0, 1, 1, 0, 1, 1};
static float Y[4] = {0, 1, 1, 0};

typedef struct net { dt_nn_linear a, b; } net;

static dt_tensor *xor_step(dt_graph *g, int replica, const dt_minibatch *bt, void *user) {
  net *n = (net *)user;
  int64_t xs[2], ys[2];
  (void)replica;
  xs[0] = bt->rows; xs[1] = 2;
  ys[0] = bt->rows; ys[1] = 1;
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &n->a, dt_tensor_wrap(g, 2, xs, (float *)bt->x)));
  return dt_mse(g, dt_sigmoid(g, dt_nn_linear_forward(g, &n->b, h)), dt_tensor_wrap(g, 2, ys, (float *)bt->t));
}

static void test_no_threads(void) {
  CHECK((dt_build_features() & DTRAIN_FEATURE_THREADS) == 0);
  dt_params *P = dt_params_create(42);
  net n;
  dt_nn_linear_init(&n.a, P, "a", 2, 8, 1);
  dt_nn_linear_init(&n.b, P, "b", 8, 1, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.05f;
  dt_optim *opt = dt_optim_create(P, &od);
  const dt_strategy_kind others[3] = {DTRAIN_STRATEGY_MIRRORED, DTRAIN_STRATEGY_CENTRAL_STORAGE,
                                      DTRAIN_STRATEGY_ASYNC};
  for (int k = 0; k < 3; k++) {
    dt_strategy_options sd;
    memset(&sd, 0, sizeof sd);
    sd.kind = others[k];
    sd.replicas = 1;
    CHECK(dt_strategy_create(P, opt, xor_step, &n, &sd) == NULL);
#ifdef DTRAIN_NO_DIST /* the kinds are compiled out: that is what the first check says */
    CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "DTRAIN_NO_DIST"));
#else
    CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "DTRAIN_NO_THREADS"));
#endif
  }
  CHECK(dt_comm_create_threads(2, 0) == NULL && dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
  float st[4];
  CHECK(dt_pstore_create_local(st, 4, 2, 0, DTRAIN_ASYNC_HOGWILD, 0) == NULL &&
        dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
  /* a world of one needs no thread */
  dt_comm *c = dt_comm_create_threads(1, 0);
  CHECK(c != NULL && dt_comm_allreduce(c, 0, st, 4) == DTRAIN_OK && dt_comm_barrier(c, 0) == DTRAIN_OK);
  dt_comm_destroy(c);
  /* one_device trains */
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(P, opt, xor_step, &n, &sd);
  CHECK(s != NULL);
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = 4; b.x = X; b.x_cols = 2; b.t = Y; b.t_cols = 1;
  float loss = 1.0f;
  for (int i = 0; i < 1500 && s; i++) CHECK(dt_strategy_step(s, &b, &loss) == DTRAIN_OK);
  CHECK_MSG(loss < 0.01f, "xor loss %g", (double)loss);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  TH_RUN(test_no_threads);
  return th_summary("strategy_nothreads");
}
