/* bench_models.h -- the models and synthetic data of the training benchmarks
 * (bench_speed.c on the CPU, bench_gpu.c on a GPU), so that both time the
 * same work as bench/torch_speed.py:
 *   MLP 784-256-128-10 (ReLU)
 *   CNN conv5x5-32 (pad 2), ReLU, pool 2; conv5x5-64, ReLU, pool 2; fc1024, ReLU; fc10
 * and 4096 samples of 784 uniform floats with labels in 0..9 (seed 7).
 * Include after dtrain.h. */
#ifndef BENCH_MODELS_H
#define BENCH_MODELS_H

#define NSAMPLES 4096 /* synthetic data set, cycled through */

typedef struct model {
  int cnn;
  dt_nn_linear fc1, fc2, fc3;
  dt_nn_conv2d c1, c2;
} model;

static void model_init(model *md, dt_params *P, int cnn) {
  memset(md, 0, sizeof *md);
  md->cnn = cnn;
  if (!cnn) {
    dt_nn_linear_init(&md->fc1, P, "fc1", 784, 256, 1);
    dt_nn_linear_init(&md->fc2, P, "fc2", 256, 128, 1);
    dt_nn_linear_init(&md->fc3, P, "fc3", 128, 10, 1);
  } else {
    dt_nn_conv2d_init(&md->c1, P, "conv1", 1, 32, 5, 1, 2, 1);
    dt_nn_conv2d_init(&md->c2, P, "conv2", 32, 64, 5, 1, 2, 1);
    dt_nn_linear_init(&md->fc1, P, "fc1", 64 * 7 * 7, 1024, 1);
    dt_nn_linear_init(&md->fc2, P, "fc2", 1024, 10, 1);
  }
}

static dt_tensor *forward(dt_graph *g, const model *md, dt_tensor *x) {
  if (!md->cnn) {
    dt_tensor *h = dt_nn_linear_relu_forward(g, &md->fc1, x);
    h = dt_nn_linear_relu_forward(g, &md->fc2, h);
    return dt_nn_linear_forward(g, &md->fc3, h);
  }
  dt_tensor *h = dt_max_pool2d(g, dt_nn_conv2d_relu_forward(g, &md->c1, x), 2, 2);
  h = dt_max_pool2d(g, dt_nn_conv2d_relu_forward(g, &md->c2, h), 2, 2);
  h = dt_nn_linear_relu_forward(g, &md->fc1, dt_flatten(g, h));
  return dt_nn_linear_forward(g, &md->fc2, h);
}

/* Floating-point operations of one training step per sample (multiply and
 * add count 2): the forward matrix products, the weights' gradients (as many
 * again) and the inputs' gradients of every layer but the first (nothing
 * flows back into the data). Element-wise ops, pooling and the optimizer are
 * left out (under 1% here). MLP: 1,007,104; CNN: 2 x (0.63 + 10.04 + 3.21 +
 * 0.01) M multiply-adds forward ... about 82.6 MFLOP. */
static inline double model_flops_per_sample(const model *md) {
  if (!md->cnn) {
    const double l1 = 784.0 * 256, l2 = 256.0 * 128, l3 = 128.0 * 10;
    return 2 * (l1 + l2 + l3) + 2 * (l1 + l2 + l3) + 2 * (l2 + l3);
  }
  const double c1 = 28.0 * 28 * 32 * 1 * 25, c2 = 14.0 * 14 * 64 * 32 * 25, f1 = 3136.0 * 1024, f2 = 1024.0 * 10;
  return 2 * (c1 + c2 + f1 + f2) + 2 * (c1 + c2 + f1 + f2) + 2 * (c2 + f1 + f2);
}

/* NSAMPLES x 784 inputs and NSAMPLES labels. */
static void synthetic_data(float *xs, int32_t *ys) {
  dt_rng rng;
  dt_rng_seed(&rng, 7);
  for (int i = 0; i < NSAMPLES * 784; i++) xs[i] = dt_rng_uniform(&rng);
  for (int i = 0; i < NSAMPLES; i++) ys[i] = (int32_t)dt_rng_below(&rng, 10);
}

#endif /* BENCH_MODELS_H */
