/* A tiny project that uses an installed or vendored dtrain: trains y = 2x + 1
 * and exits 0 when it learned it. Used by tests/install_checks.sh. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <string.h>

int main(void) {
  float x[8], y[8];
  for (int i = 0; i < 8; i++) { x[i] = (float)i / 8.0f; y[i] = 2.0f * x[i] + 1.0f; }
  dt_params *P = dt_params_create(1);
  dt_nn_linear l;
  dt_nn_linear_init(&l, P, "lin", 1, 1, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.5f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);
  int64_t s[2] = {8, 1};
  float loss = 1;
  for (int step = 0; step < 500; step++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *L = dt_mse(g, dt_nn_linear_forward(g, &l, dt_tensor_from(g, 2, s, x)), dt_tensor_from(g, 2, s, y));
    if (dt_backward(g, L) != DTRAIN_OK) return 2;
    dt_optim_step(opt);
    loss = dt_item(L);
  }
  printf("consumer: %s, loss %g\n", dt_build_info(), loss);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return loss < 1e-6f ? 0 : 1;
}
