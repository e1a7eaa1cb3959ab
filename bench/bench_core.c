/* bench_core.c -- where the core engine stands on this machine, one thread.
 *
 *   make bench
 *
 * Prints sgemm GFLOP/s for square sizes and the samples/s of a training step
 * of the Fashion-MNIST MLP (784-256-128-10, Adam) on synthetic data at batch
 * 64 and 256, plus the step's arena memory. The comparisons against OpenBLAS
 * and PyTorch come with the speed work (bench/ grows then); these numbers are
 * the baseline they will be measured from. Timings only: no pass/fail. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double gemm_gflops(int n) {
  float *a = (float *)malloc(sizeof(float) * n * n), *b = (float *)malloc(sizeof(float) * n * n),
        *c = (float *)malloc(sizeof(float) * n * n);
  for (int i = 0; i < n * n; i++) { a[i] = (float)(i % 7) * 0.1f; b[i] = (float)(i % 5) * 0.2f; }
  double flop = 2.0 * n * n * n, t0 = dt_time_now(), t;
  int reps = 0;
  do {
    dt_sgemm(0, 0, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
    reps++;
    t = dt_time_now() - t0;
  } while (t < 0.5 && reps < 1000);
  free(a); free(b); free(c);
  return flop * reps / t / 1e9;
}

static void mlp_bench(int batch) {
  dt_params *P = dt_params_create(1);
  dt_nn_linear l1, l2, l3;
  dt_nn_linear_init(&l1, P, "fc1", 784, 256, 1);
  dt_nn_linear_init(&l2, P, "fc2", 256, 128, 1);
  dt_nn_linear_init(&l3, P, "fc3", 128, 10, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);
  float *x = (float *)malloc(sizeof(float) * batch * 784);
  int32_t *y = (int32_t *)malloc(sizeof(int32_t) * batch);
  for (int i = 0; i < batch * 784; i++) x[i] = (float)((i * 37) % 255) / 255.0f;
  for (int i = 0; i < batch; i++) y[i] = i % 10;
  int64_t xs[2] = {batch, 784};
  double t0 = 0, t = 0;
  int steps = 0;
  for (int s = 0;; s++) {
    if (s == 3) t0 = dt_time_now(); /* warm-up steps excluded */
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *in = dt_tensor_wrap(g, 2, xs, x);
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &l1, in));
    h = dt_relu(g, dt_nn_linear_forward(g, &l2, h));
    dt_tensor *loss = dt_cross_entropy(g, dt_nn_linear_forward(g, &l3, h), y);
    if (dt_backward(g, loss) != DTRAIN_OK) { fprintf(stderr, "%s\n", dt_graph_message(g)); break; }
    dt_optim_step(opt);
    if (s >= 3) {
      steps++;
      t = dt_time_now() - t0;
      if (t > 2.0) break;
    }
  }
  printf("mlp 784-256-128-10 adam  batch %4d  %9.0f samples/s  (arena peak %.2f MiB)\n", batch,
         steps * (double)batch / t, dt_graph_bytes_peak(g) / 1048576.0);
  free(x); free(y);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  printf("%s\n", dt_build_info());
  int sizes[] = {64, 128, 256, 512, 1024};
  for (int i = 0; i < 5; i++) printf("sgemm n=%4d  %6.1f GFLOP/s\n", sizes[i], gemm_gflops(sizes[i]));
  mlp_bench(64);
  mlp_bench(256);
  return 0;
}
