/* 01b_fashion_mnist_loop.c -- a Fashion-MNIST training loop written out by hand.
 *
 * Shows: what dt_fit (examples/02) does for you, in plain sight: load the
 * data, build a 784-128-10 MLP, and for each batch: forward, loss, backward,
 * optimizer step; then count the right answers on the test images. Read it
 * after 01_xor.c and before 02_fashion_mnist.c.
 * Build: make build/examples/01b_fashion_mnist_loop, or
 *        cc -std=c11 -O2 -I. examples/01b_fashion_mnist_loop.c -o loop -lm -lpthread
 * Run:   build/examples/01b_fashion_mnist_loop [--epochs N] [--limit N]
 *        (--limit N trains on the first N training images only: a quick run)
 * Data:  /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist),
 *        else the test split shipped in data/fashion-mnist, split 8000 to
 *        train and 2000 to test (run it from the repository root).
 * Prints the data used, one line per epoch (mean training loss and test
 * accuracy), and "test accuracy 0.xxxx" last. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h" /* ex_log_init */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A whole decimal number in [lo, hi], or -1 (this example's numbers are >= 1). */
static long number(const char *s, long lo, long hi) {
  char *end;
  long v = strtol(s, &end, 10);
  return (end != s && *end == '\0' && v >= lo && v <= hi) ? v : -1;
}

/* The fraction of test images whose largest logit is at their label. */
static double test_accuracy(dt_graph *g, const dt_nn_linear *l1, const dt_nn_linear *l2, const dt_dataset *test) {
  int64_t correct = 0;
  for (int64_t s = 0; s < test->n; s += 500) { /* 500 images per forward pass */
    int64_t n = test->n - s < 500 ? test->n - s : 500, xs[2] = {n, 784};
    dt_graph_reset(g);
    dt_tensor *x = dt_tensor_wrap(g, 2, xs, test->x + s * 784);
    dt_tensor *logits = dt_nn_linear_forward(g, l2, dt_relu(g, dt_nn_linear_forward(g, l1, x)));
    int64_t ok = logits ? dt_count_correct(logits->data, test->y + s, n, 10) : -1; /* argmax == label */
    if (ok < 0) return -1.0;
    correct += ok;
  }
  return (double)correct / (double)test->n;
}

int main(int argc, char **argv) {
  ex_log_init(); /* errors are printed once, below, not by dtrain's logger too */
  long epochs = 3, limit = 0;
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      printf("usage: 01b_fashion_mnist_loop [--epochs N] [--limit N]\n"
             "  --epochs N   passes over the training set [3]\n"
             "  --limit N    train on the first N images only [0: all]\n");
      return 0;
    }
  for (int i = 1; i < argc; i += 2) {
    long *slot = !strcmp(argv[i], "--epochs") ? &epochs : !strcmp(argv[i], "--limit") ? &limit : NULL;
    if (!slot || i + 1 >= argc || (*slot = number(argv[i + 1], 1, 1000000)) < 0) {
      fprintf(stderr, "usage: 01b_fashion_mnist_loop [--epochs N] [--limit N]   (N a whole number >= 1)\n");
      return 2;
    }
  }
  /* 1. Data: [28,28] images with pixels in [0,1], read as rows of 784. */
  char dir[512];
  int has_train = 0;
  dt_dataset *train = NULL, *test = NULL;
  dt_result r = dt_fashion_mnist_find(NULL, dir, sizeof dir, &has_train);
  if (r == DTRAIN_OK) r = dt_fashion_mnist_load(dir, has_train ? &train : NULL, &test);
  if (r == DTRAIN_OK && !train) { /* only the shipped test split: keep 2000 of it for testing */
    dt_dataset *all = test;
    r = dt_dataset_split(all, 0.2, 12345, &train, &test);
    dt_dataset_destroy(all);
  }
  if (r == DTRAIN_OK && limit > 0 && limit < train->n) { /* the first `limit` images: a quick run */
    int64_t *idx = (int64_t *)malloc((size_t)limit * sizeof(int64_t));
    dt_dataset *part = NULL;
    for (long i = 0; idx && i < limit; i++) idx[i] = i;
    part = idx ? dt_dataset_select(train, idx, limit) : NULL;
    if (!part) r = idx ? dt_last_result() : DTRAIN_ERR_NOMEM;
    free(idx);
    dt_dataset_destroy(train);
    train = part;
  }
  int64_t row = 784;
  if (r == DTRAIN_OK) r = dt_dataset_reshape(train, 1, &row);
  if (r == DTRAIN_OK) r = dt_dataset_reshape(test, 1, &row);
  if (r != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }
  printf("data: %s (%lld train, %lld test)\n", dir, (long long)train->n, (long long)test->n);

  /* 2. The model: 784 -> 128 (ReLU) -> 10 logits; Adam; a graph per step and one to test with. */
  dt_params *P = dt_params_create(1);
  dt_nn_linear l1, l2;
  dt_nn_linear_init(&l1, P, "fc1", 784, 128, 1);
  dt_nn_linear_init(&l2, P, "fc2", 128, 10, 1);
  dt_optim_options od = dt_optim_defaults(DTRAIN_OPTIM_ADAM); /* other fields zero: the defaults */
  od.lr = 1e-3f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL), *eval = dt_graph_create(P, NULL);
  dt_graph_set_grad_enabled(eval, 0); /* testing records no tape */
  dt_loader_options ld;
  memset(&ld, 0, sizeof ld); /* zero fields take defaults */
  ld.batch_size = 64;
  ld.shuffle = 1; /* a new order every epoch, the same for the same seed */
  ld.seed = 1;
  dt_loader *loader = dt_loader_new(train, &ld);
  if (!opt || !g || !eval || !loader) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }

  /* 3. Training: the loop dt_fit runs for you in 02_fashion_mnist.c. */
  double acc = 0.0;
  for (long epoch = 1; epoch <= epochs; epoch++) {
    dt_batch b;
    double loss_sum = 0.0;
    int64_t batches = 0;
    while (dt_loader_next(loader, &b) > 0) {    /* 0 at the end of the epoch */
      dt_graph_reset(g);                        /* forget the last step, keep the memory */
      dt_params_zero_grad(P);
      dt_tensor *x = dt_tensor_wrap(g, b.ndim, b.shape, b.x);
      dt_tensor *logits = dt_nn_linear_forward(g, &l2, dt_relu(g, dt_nn_linear_forward(g, &l1, x)));
      dt_tensor *loss = dt_cross_entropy(g, logits, b.y);
      if (dt_backward(g, loss) != DTRAIN_OK) {  /* errors are sticky: one check per step */
        fprintf(stderr, "error: %s\n", dt_graph_message(g));
        return 1;
      }
      dt_optim_step(opt);                       /* params -= what Adam makes of the gradients */
      loss_sum += dt_item(loss);
      batches++;
    }
    acc = test_accuracy(eval, &l1, &l2, test);
    if (acc < 0.0) {
      fprintf(stderr, "error: %s\n", dt_last_error());
      return 1;
    }
    printf("epoch %ld  train loss %.4f  test accuracy %.4f\n", epoch, loss_sum / (double)batches, acc);
  }
  printf("test accuracy %.4f\n", acc);
  dt_loader_destroy(loader);
  dt_graph_destroy(eval);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  dt_dataset_destroy(train);
  dt_dataset_destroy(test);
  return acc >= 0.0 ? 0 : 1;
}
