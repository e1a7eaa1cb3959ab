/* fashion_model.h -- the two Fashion-MNIST models of examples 02 and 05 (one
 * definition, so that 05's simulated and multi-process runs train exactly what
 * 02 and its planner measure): an MLP 784-256-128-10 and a CNN of two 5x5
 * convolutions (32 and 64 channels, each with ReLU and 2x2 max pooling) and
 * 3136-1024-10. Include after dtrain.h. */
#ifndef DTRAIN_FASHION_MODEL_H
#define DTRAIN_FASHION_MODEL_H

typedef struct model {
  int cnn;
  dt_nn_conv2d conv1, conv2;   /* CNN: 5x5 convs, 32 and 64 channels */
  dt_nn_linear fc1, fc2, fc3;  /* MLP: 784-256-128-10; CNN: 3136-1024-10 */
} model;

/* The layers' parameters into P, in the same order everywhere (workers
 * compare the model's hash). */
static dt_result model_init(model *m, dt_params *P, int cnn) {
  dt_result r = DTRAIN_OK;
  m->cnn = cnn;
  if (cnn) {
    if (!r) r = dt_nn_conv2d_init(&m->conv1, P, "conv1", 1, 32, 5, 1, 2, 1);
    if (!r) r = dt_nn_conv2d_init(&m->conv2, P, "conv2", 32, 64, 5, 1, 2, 1);
    if (!r) r = dt_nn_linear_init(&m->fc1, P, "fc1", 64 * 7 * 7, 1024, 1);
    if (!r) r = dt_nn_linear_init(&m->fc2, P, "fc2", 1024, 10, 1);
  } else {
    if (!r) r = dt_nn_linear_init(&m->fc1, P, "fc1", 784, 256, 1);
    if (!r) r = dt_nn_linear_init(&m->fc2, P, "fc2", 256, 128, 1);
    if (!r) r = dt_nn_linear_init(&m->fc3, P, "fc3", 128, 10, 1);
  }
  return r;
}

/* x: [N, 784] pixels in [0,1] -> logits [N, 10] */
static dt_tensor *model_forward(dt_graph *g, const model *m, dt_tensor *x) {
  if (m->cnn) {
    dt_tensor *h = dt_reshape(g, x, 4, (const int64_t[]){-1, 1, 28, 28});
    h = dt_max_pool2d(g, dt_nn_conv2d_relu_forward(g, &m->conv1, h), 2, 2); /* [N,32,14,14] */
    h = dt_max_pool2d(g, dt_nn_conv2d_relu_forward(g, &m->conv2, h), 2, 2); /* [N,64,7,7] */
    h = dt_nn_linear_relu_forward(g, &m->fc1, dt_flatten(g, h)); /* the ReLU fused into the GEMM */
    return dt_nn_linear_forward(g, &m->fc2, h);
  }
  dt_tensor *h = dt_nn_linear_relu_forward(g, &m->fc1, x);
  h = dt_nn_linear_relu_forward(g, &m->fc2, h);
  return dt_nn_linear_forward(g, &m->fc3, h);
}

#endif /* DTRAIN_FASHION_MODEL_H */
