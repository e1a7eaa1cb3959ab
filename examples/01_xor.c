/* 01_xor.c -- the smallest complete dtrain program: a 2-8-1 network learns XOR.
 *
 * Shows: parameters, layers, the per-step graph, backward, an optimizer.
 * Build: cc -std=c11 -O2 -I. examples/01_xor.c -o xor -lm -lpthread   (or: make demo)
 * Prints the loss every 500 steps, then the four predictions (near 0 1 1 0). */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h" /* ex_log_init */
#include <stdio.h>

int main(void) {
  ex_log_init(); /* an error is printed once, below, not by dtrain's logger too */
  static const float X[8] = {0, 0, 0, 1, 1, 0, 1, 1}, Y[4] = {0, 1, 1, 0};
  static const int64_t xs[2] = {4, 2}, ys[2] = {4, 1};
  dt_params *P = dt_params_create(42);            /* all weights live in one flat buffer */
  dt_nn_linear hidden, out;
  dt_nn_linear_init(&hidden, P, "hidden", 2, 8, 1);
  dt_nn_linear_init(&out, P, "out", 8, 1, 1);
  dt_optim_options od = dt_optim_defaults(DTRAIN_OPTIM_ADAM); /* zero fields take defaults */
  od.lr = 0.05f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);         /* arena + tape for one step */
  dt_tensor *pred = NULL;
  float loss = 1.0f;
  for (int step = 0; step <= 2000; step++) {
    dt_graph_reset(g);                            /* forget the last step, keep the memory */
    dt_params_zero_grad(P);
    dt_tensor *x = dt_tensor_from(g, 2, xs, X), *y = dt_tensor_from(g, 2, ys, Y);
    dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &hidden, x));
    pred = dt_sigmoid(g, dt_nn_linear_forward(g, &out, h));
    dt_tensor *L = dt_mse(g, pred, y);
    if (dt_backward(g, L) != DTRAIN_OK) {         /* errors are sticky: one check per step */
      fprintf(stderr, "error: %s\n", dt_graph_message(g));
      return 1;
    }
    dt_optim_step(opt);
    loss = dt_item(L);
    if (step % 500 == 0) printf("step %4d  loss %.6f\n", step, loss);
  }
  for (int i = 0; i < 4; i++)                     /* predictions of the last forward pass */
    printf("%g xor %g -> %.3f\n", X[2 * i], X[2 * i + 1], pred->data[i]);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return loss < 1e-3f ? 0 : 1;
}
