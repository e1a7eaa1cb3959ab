/* tests/mp_common.h -- helpers shared by the model-parallel tests
 * (test_pipeline.c, test_tensor_parallel.c, test_parallel_ckpt.c): the
 * synthetic data's values, a batch of it, parameters packed in order, and the
 * relative difference the tests compare with. */
#ifndef DTRAIN_TESTS_MP_COMMON_H
#define DTRAIN_TESTS_MP_COMMON_H
#include "dtrain.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* n values in [-1, 1] from a 64-bit LCG seeded with seed (the tests' labels
 * are their own functions of these). */
static void lcg_fill(float *x, size_t n, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = (float)((s >> 33) % 2001) / 1000.0f - 1.0f;
  }
}

/* Batch of step `step`: b rows from (step * b) % rows on, stride floats per row. */
static dt_minibatch batch_from(float *x, int32_t *y, int rows, int b, int stride, int step) {
  dt_minibatch m;
  memset(&m, 0, sizeof m);
  int first = (step * b) % rows;
  m.rows = b;
  m.x = x + (size_t)first * (size_t)stride;
  m.x_cols = stride; /* micro-batches start at row * x_cols */
  m.y = y + first;
  return m;
}

/* p's parameters packed in order (no alignment gaps) into out; returns the floats written. */
static size_t pack(const dt_params *p, float *out) {
  size_t k = 0;
  float *data = dt_params_data((dt_params *)(uintptr_t)p);
  for (int i = 0; i < dt_params_count(p); i++) {
    dt_param_info in;
    dt_params_info(p, i, &in);
    memcpy(out + k, data + in.offset, in.size * sizeof(float));
    k += in.size;
  }
  return k;
}

/* Largest |a - b| over the largest |b|. One loop of plain comparisons: aarch64
 * gcc 12 -O2 stops with an internal error vectorising two fmax reductions
 * here once this is inlined. */
static double max_rel(const float *a, const float *b, size_t n) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < n; i++) {
    double s = fabs((double)b[i]), d = fabs((double)a[i] - (double)b[i]);
    if (s > scale) scale = s;
    if (d > worst) worst = d;
  }
  return scale > 0 ? worst / scale : worst;
}
#endif
