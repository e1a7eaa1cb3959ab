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
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &md->fc1, x));
    h = dt_relu(g, dt_nn_linear_forward(g, &md->fc2, h));
    return dt_nn_linear_forward(g, &md->fc3, h);
  }
  dt_tensor *h = dt_max_pool2d(g, dt_relu(g, dt_nn_conv2d_forward(g, &md->c1, x)), 2, 2);
  h = dt_max_pool2d(g, dt_relu(g, dt_nn_conv2d_forward(g, &md->c2, h)), 2, 2);
  h = dt_relu(g, dt_nn_linear_forward(g, &md->fc1, dt_flatten(g, h)));
  return dt_nn_linear_forward(g, &md->fc2, h);
}

/* NSAMPLES x 784 inputs and NSAMPLES labels. */
static void synthetic_data(float *xs, int32_t *ys) {
  dt_rng rng;
  dt_rng_seed(&rng, 7);
  for (int i = 0; i < NSAMPLES * 784; i++) xs[i] = dt_rng_uniform(&rng);
  for (int i = 0; i < NSAMPLES; i++) ys[i] = (int32_t)dt_rng_below(&rng, 10);
}

#endif /* BENCH_MODELS_H */
