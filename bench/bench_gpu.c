/* bench_gpu.c -- the dtrain side of `make bench-gpu` (bench/run_gpu.sh runs it):
 * the MLP and CNN of bench_speed.c trained on one GPU through dtrain_cuda.h.
 *
 *   bench_gpu mlp BATCH [seconds]   Fashion-MNIST MLP 784-256-128-10, Adam
 *   bench_gpu cnn BATCH [seconds]   conv5x5-32 pool conv5x5-64 pool fc1024 fc10
 *
 * A C file holding DTRAIN_IMPLEMENTATION, linked with the CUDA backend
 * (examples/cuda_backend.cu, nvcc: build/bench/bench_gpu) or with its host
 * emulation (tests/cuda_emu_backend.cc: build/bench/bench_gpu_emu, which
 * tests/example_checks.sh runs for a few steps to keep this program working on
 * machines without a GPU; its timings mean nothing).
 *
 * Same models, optimizer (Adam, lr 1e-3), synthetic data set (4096 samples,
 * cycled) and timing as bench_speed.c and torch_speed.py: the best of short
 * windows after 3 warm-up steps. The whole data set is copied to the device
 * once, as torch_speed.py does with `cuda` (each step wraps its batch in
 * place); labels stay in host memory (dt_cross_entropy copies the batch's
 * labels to the device). A window ends with the device synchronised, so it
 * times the work done, not the work queued.
 * Prints "result samples_per_s=... median_samples_per_s=... loss=...
 * device=..." and exits 0; without a device: "skipped: <why>" and exit 3. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "dtrain_cuda.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "bench_models.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int run(int cnn, int batch, double seconds) {
  int n = dt_cuda_device_count();
  if (n < 1) {
    printf("skipped: no CUDA device (%s)\n", n < 0 ? dt_last_error() : "none found");
    return 3;
  }
  dt_device *dev = dt_cuda_device_create(0);
  if (!dev) {
    printf("skipped: dt_cuda_device_create(0): %s\n", dt_last_error());
    return 3;
  }
  dt_params *P = dt_params_create(1);
  model md;
  model_init(&md, P, cnn);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 1e-3f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev; /* the one-line switch */
  dt_graph *g = dt_graph_create(P, &gd);
  float *xs = (float *)malloc(sizeof(float) * NSAMPLES * 784);
  int32_t *ys = (int32_t *)malloc(sizeof(int32_t) * NSAMPLES);
  void *dxs = NULL;
  if (!P || !opt || !g || !xs || !ys) {
    fprintf(stderr, "bench_gpu: set-up failed: %s\n", dt_last_error());
    return 1;
  }
  synthetic_data(xs, ys);
  const size_t xbytes = sizeof(float) * NSAMPLES * 784;
  if (dev->alloc(dev, xbytes, &dxs) != DTRAIN_OK || dev->copy(dev, dxs, xs, xbytes, DTRAIN_COPY_H2D) != DTRAIN_OK) {
    fprintf(stderr, "bench_gpu: the data set to %s: %s\n", dev->name, dt_last_error());
    return 1;
  }
  int64_t shape_mlp[2] = {batch, 784}, shape_cnn[4] = {batch, 1, 28, 28};
  int nbatches = NSAMPLES / batch, window = 0, nrates = 0;
  int per_window = cnn ? 1 : (batch >= 256 ? 4 : 10);
  static double rates[1 << 14];
  double t_end = 0.0, tw = 0.0;
  float last_loss = 0.0f;
  for (int s = 0;; s++) {
    if (s == 3) { /* warm-up steps excluded (cuBLAS handles, first allocations) */
      if (dev->sync(dev) != DTRAIN_OK) break;
      tw = dt_time_now();
      t_end = tw + seconds;
    }
    int bi = s % nbatches;
    dt_graph_reset(g);
    if (dt_graph_zero_grad(g) != DTRAIN_OK) break;
    /* dt_tensor_wrap on a device graph takes a device pointer: the batch in place */
    dt_tensor *x = dt_tensor_wrap(g, cnn ? 4 : 2, cnn ? shape_cnn : shape_mlp, (float *)dxs + (size_t)bi * batch * 784);
    dt_tensor *loss = dt_cross_entropy(g, forward(g, &md, x), ys + (size_t)bi * batch);
    if (dt_backward(g, loss) != DTRAIN_OK || dt_optim_step_graph(opt, g) != DTRAIN_OK) {
      fprintf(stderr, "bench_gpu: %s\n", dt_graph_message(g) ? dt_graph_message(g) : dt_last_error());
      return 1;
    }
    if (s >= 3 && ++window == per_window) {
      if (dev->sync(dev) != DTRAIN_OK) break;
      double now = dt_time_now();
      if (nrates < (int)(sizeof rates / sizeof rates[0])) rates[nrates++] = window * (double)batch / (now - tw);
      window = 0;
      tw = now;
      if (now > t_end && nrates >= 3) {
        last_loss = dt_item(loss);
        break;
      }
    }
  }
  if (nrates < 3) {
    fprintf(stderr, "bench_gpu: %s: %s\n", dev->name, dt_last_error());
    return 1;
  }
  qsort(rates, (size_t)nrates, sizeof rates[0], cmp_double);
  printf("result samples_per_s=%.1f median_samples_per_s=%.1f windows=%d loss=%.4f device=%s\n", rates[nrates - 1],
         rates[nrates / 2], nrates, (double)last_loss, dev->name);
  int ok = isfinite(last_loss);
  dev->free(dev, dxs, xbytes);
  dt_graph_destroy(g);
  dt_optim_destroy(opt); /* its state lives on the device: before the device */
  dt_params_destroy(P);
  dt_cuda_device_destroy(dev);
  free(xs);
  free(ys);
  return ok ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc >= 3 && (strcmp(argv[1], "mlp") == 0 || strcmp(argv[1], "cnn") == 0)) {
    int batch = atoi(argv[2]);
    if (batch < 1 || batch > NSAMPLES) return 2;
    return run(argv[1][0] == 'c', batch, argc >= 4 ? atof(argv[3]) : 3.0);
  }
  fprintf(stderr, "usage: bench_gpu mlp|cnn BATCH [seconds]\n");
  return 2;
}
