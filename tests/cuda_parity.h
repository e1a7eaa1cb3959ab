/* tests/cuda_parity.h -- device-vs-CPU parity checks shared by
 * tests/test_cuda_emu.cc (the host emulation of the CUDA kernels) and
 * tests/test_cuda.cu (a real GPU). The including file sets cp_dev and calls
 * cp_run_all(). Every op with a device path is run forward and backward on
 * the CPU and on cp_dev from the same inputs and output gradient; outputs and
 * input gradients must agree within float tolerance. Then a small MLP trains
 * a few steps on both (SGD with momentum, Adam, AdamW with clipping,
 * RMSprop) and the parameters must agree; the attention / LSTM / GRU / batch
 * norm modules agree in loss and parameter gradients. Also: broadcasts the
 * device does not do fail cleanly with DTRAIN_ERR_UNSUPPORTED naming the op
 * and the device. */
#ifndef DTRAIN_TEST_CUDA_PARITY_H
#define DTRAIN_TEST_CUDA_PARITY_H

#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

static dt_device *cp_dev;
static int cp_compared; /* floats compared, for the report */

typedef dt_tensor *(*cp_op)(dt_graph *g, dt_tensor **in);

typedef struct cp_case {
  const char *name;
  cp_op fn;
  int nin;
  int ndim[3];
  int64_t shape[3][4];
  float lo, hi;  /* input range */
  int positive_tail; /* 0 */
} cp_case;

/* Runs c on device dev (NULL: CPU); out receives the output then every input
 * gradient (host floats); returns the count written, -1 on failure. */
static int64_t cp_eval(const cp_case *c, dt_device *dev, float *const *in_data, const float *seed, float *out,
                       int64_t cap) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  dt_graph *g = dt_graph_create(NULL, &gd);
  if (!g) return -1;
  dt_tensor *in[3] = {NULL, NULL, NULL};
  for (int i = 0; i < c->nin; i++) {
    in[i] = dt_tensor_from(g, c->ndim[i], c->shape[i], in_data[i]);
    dt_tensor_set_requires_grad(in[i], 1);
  }
  dt_tensor *y = c->fn(g, in);
  int64_t n = -1;
  if (y && dt_backward_grad(g, y, seed) == DTRAIN_OK) {
    n = 0;
    if (y->size <= cap && dt_tensor_to_host(y, out) == DTRAIN_OK) n = y->size;
    for (int i = 0; i < c->nin && n >= 0; i++) {
      if (n + in[i]->size > cap || dt_tensor_grad_to_host(in[i], out + n) != DTRAIN_OK) n = -1;
      else n += in[i]->size;
    }
  } else {
    fprintf(stderr, "cp_eval %s on %s: %s\n", c->name, dev ? dev->name : "cpu", dt_graph_message(g));
  }
  dt_graph_destroy(g);
  return n;
}

static void cp_check_case(const cp_case *c) {
  enum { CAP = 8192 };
  static float data[3][CAP], cpu[4 * CAP], dev[4 * CAP], seed[CAP];
  float *in[3] = {data[0], data[1], data[2]};
  for (int i = 0; i < c->nin; i++) {
    int64_t n = 1;
    for (int d = 0; d < c->ndim[i]; d++) n *= c->shape[i][d];
    th_fill(data[i], n, c->lo, c->hi);
  }
  th_fill(seed, CAP, -1.0f, 1.0f);
  int64_t a = cp_eval(c, NULL, in, seed, cpu, 4 * CAP);
  int64_t b = cp_eval(c, cp_dev, in, seed, dev, 4 * CAP);
  CHECK_MSG(a > 0 && a == b, "%s: cpu gave %lld floats, device %lld", c->name, (long long)a, (long long)b);
  if (a <= 0 || a != b) return;
  double worst = 0.0;
  int64_t at = 0;
  for (int64_t i = 0; i < a; i++) {
    double d = fabs((double)cpu[i] - (double)dev[i]) / (1.0 + fabs((double)cpu[i]));
    if (!(d <= worst)) { worst = d; at = i; }
  }
  cp_compared += (int)a;
  CHECK_MSG(worst <= 2e-5, "%s: element %lld cpu %.9g device %.9g", c->name, (long long)at, (double)cpu[at],
            (double)dev[at]);
}

static const int32_t cp_labels[16] = {3, 0, 4, 1, 2, 4, 0, 3, 1, 1, 2, 0, 4, 3, 2, 0};

static dt_tensor *cp_add(dt_graph *g, dt_tensor **x) { return dt_add(g, x[0], x[1]); }
static dt_tensor *cp_sub(dt_graph *g, dt_tensor **x) { return dt_sub(g, x[0], x[1]); }
static dt_tensor *cp_mul(dt_graph *g, dt_tensor **x) { return dt_mul(g, x[0], x[1]); }
static dt_tensor *cp_div(dt_graph *g, dt_tensor **x) { return dt_div(g, x[0], x[1]); }
static dt_tensor *cp_add_scalar(dt_graph *g, dt_tensor **x) { return dt_add_scalar(g, x[0], 0.75f); }
static dt_tensor *cp_mul_scalar(dt_graph *g, dt_tensor **x) { return dt_mul_scalar(g, x[0], -1.5f); }
static dt_tensor *cp_rsub_scalar(dt_graph *g, dt_tensor **x) { return dt_rsub_scalar(g, x[0], 2.0f); }
static dt_tensor *cp_pow2(dt_graph *g, dt_tensor **x) { return dt_pow_scalar(g, x[0], 2.0f); }
static dt_tensor *cp_pow3(dt_graph *g, dt_tensor **x) { return dt_pow_scalar(g, x[0], 3.0f); }
static dt_tensor *cp_pow_half(dt_graph *g, dt_tensor **x) { return dt_pow_scalar(g, x[0], 0.5f); }
static dt_tensor *cp_pow_m15(dt_graph *g, dt_tensor **x) { return dt_pow_scalar(g, x[0], -1.5f); }
static dt_tensor *cp_log(dt_graph *g, dt_tensor **x) { return dt_log(g, x[0]); }
static dt_tensor *cp_sqrt(dt_graph *g, dt_tensor **x) { return dt_sqrt(g, x[0]); }
static dt_tensor *cp_neg(dt_graph *g, dt_tensor **x) { return dt_neg(g, x[0]); }
static dt_tensor *cp_exp(dt_graph *g, dt_tensor **x) { return dt_exp(g, x[0]); }
static dt_tensor *cp_leaky_relu(dt_graph *g, dt_tensor **x) { return dt_leaky_relu(g, x[0], 0.1f); }
static dt_tensor *cp_gelu(dt_graph *g, dt_tensor **x) { return dt_gelu(g, x[0]); }
static dt_tensor *cp_relu(dt_graph *g, dt_tensor **x) { return dt_relu(g, x[0]); }
static dt_tensor *cp_sigmoid(dt_graph *g, dt_tensor **x) { return dt_sigmoid(g, x[0]); }
static dt_tensor *cp_tanh(dt_graph *g, dt_tensor **x) { return dt_tanh(g, x[0]); }
static dt_tensor *cp_sum(dt_graph *g, dt_tensor **x) { return dt_sum(g, x[0]); }
static dt_tensor *cp_mean(dt_graph *g, dt_tensor **x) { return dt_mean(g, x[0]); }
static dt_tensor *cp_sum_axis1(dt_graph *g, dt_tensor **x) { return dt_sum_axis(g, x[0], 1, 0); }
static dt_tensor *cp_sum_axis_last_keep(dt_graph *g, dt_tensor **x) { return dt_sum_axis(g, x[0], -1, 1); }
static dt_tensor *cp_mean_axis0(dt_graph *g, dt_tensor **x) { return dt_mean_axis(g, x[0], 0, 0); }
static dt_tensor *cp_mean_axis1_keep(dt_graph *g, dt_tensor **x) { return dt_mean_axis(g, x[0], 1, 1); }
static dt_tensor *cp_transpose(dt_graph *g, dt_tensor **x) { return dt_transpose(g, x[0]); }
static dt_tensor *cp_dropout(dt_graph *g, dt_tensor **x) { /* two draws: the RNG advances between them */
  return dt_dropout(g, dt_dropout(g, x[0], 0.3f), 0.5f);
}
static dt_tensor *cp_layer_norm(dt_graph *g, dt_tensor **x) { return dt_layer_norm(g, x[0], x[1], x[2], 1e-5f); }
static dt_tensor *cp_layer_norm_gamma(dt_graph *g, dt_tensor **x) { return dt_layer_norm(g, x[0], x[1], NULL, 1e-3f); }
static dt_tensor *cp_layer_norm_plain(dt_graph *g, dt_tensor **x) { return dt_layer_norm(g, x[0], NULL, NULL, 1e-5f); }
static const int32_t cp_ids[9] = {2, 0, 5, 2, 2, 6, 0, 3, 2}; /* repeats: the backward adds them in order */
static dt_tensor *cp_embedding(dt_graph *g, dt_tensor **x) { return dt_embedding(g, x[0], cp_ids, 9); }
static dt_tensor *cp_matmul(dt_graph *g, dt_tensor **x) { return dt_matmul(g, x[0], x[1]); }
static dt_tensor *cp_linear(dt_graph *g, dt_tensor **x) { return dt_linear(g, x[0], x[1], x[2]); }
static dt_tensor *cp_linear_nob(dt_graph *g, dt_tensor **x) { return dt_linear(g, x[0], x[1], NULL); }
static dt_tensor *cp_softmax(dt_graph *g, dt_tensor **x) { return dt_softmax(g, x[0], -1); }
static dt_tensor *cp_softmax0(dt_graph *g, dt_tensor **x) { return dt_softmax(g, x[0], 0); }
static dt_tensor *cp_log_softmax(dt_graph *g, dt_tensor **x) { return dt_log_softmax(g, x[0], 1); }
static dt_tensor *cp_xent(dt_graph *g, dt_tensor **x) { return dt_cross_entropy(g, x[0], cp_labels); }
static dt_tensor *cp_mse(dt_graph *g, dt_tensor **x) { return dt_mse(g, x[0], x[1]); }
static dt_tensor *cp_flatten(dt_graph *g, dt_tensor **x) { return dt_relu(g, dt_flatten(g, x[0])); }
static dt_tensor *cp_reshape(dt_graph *g, dt_tensor **x) {
  int64_t s[2] = {-1, 6};
  return dt_mul(g, dt_reshape(g, x[0], 2, s), x[1]);
}
static dt_tensor *cp_conv(dt_graph *g, dt_tensor **x) { return dt_conv2d(g, x[0], x[1], x[2], 1, 1); }
static dt_tensor *cp_conv_s2(dt_graph *g, dt_tensor **x) { return dt_conv2d(g, x[0], x[1], NULL, 2, 2); }
static dt_tensor *cp_maxpool(dt_graph *g, dt_tensor **x) { return dt_max_pool2d(g, x[0], 2, 2); }
static dt_tensor *cp_maxpool_overlap(dt_graph *g, dt_tensor **x) { return dt_max_pool2d(g, x[0], 3, 1); }
static dt_tensor *cp_avgpool(dt_graph *g, dt_tensor **x) { return dt_avg_pool2d(g, x[0], 3, 2); }
static dt_tensor *cp_cnn(dt_graph *g, dt_tensor **x) { /* conv -> relu -> pool -> flatten -> tanh */
  dt_tensor *h = dt_max_pool2d(g, dt_relu(g, dt_conv2d(g, x[0], x[1], x[2], 1, 1)), 2, 2);
  return dt_tanh(g, dt_flatten(g, h));
}
static dt_tensor *cp_chain(dt_graph *g, dt_tensor **x) { /* a view feeding two consumers, a scalar broadcast */
  dt_tensor *h = dt_tanh(g, dt_linear(g, x[0], x[1], x[2]));
  return dt_mean(g, dt_mul(g, dt_add(g, h, h), dt_scalar(g, 0.5f)));
}

static dt_tensor *cp_permute_3d(dt_graph *g, dt_tensor **x) {
  static const int p[3] = {2, 0, 1};
  return dt_permute(g, x[0], p);
}
static dt_tensor *cp_permute_heads(dt_graph *g, dt_tensor **x) {
  static const int p[4] = {0, 2, 1, 3};
  return dt_permute(g, x[0], p);
}
static dt_tensor *cp_permute_2d(dt_graph *g, dt_tensor **x) {
  static const int p[2] = {-1, 0};
  return dt_permute(g, x[0], p);
}
static dt_tensor *cp_permute_4d(dt_graph *g, dt_tensor **x) {
  static const int p[4] = {3, 1, 0, 2};
  return dt_permute(g, x[0], p);
}
static dt_tensor *cp_permute_5d(dt_graph *g, dt_tensor **x) { /* two permutes: a 5-D gather of a gather */
  static const int p[5] = {4, 2, 0, 3, 1}, q[5] = {1, 0, 4, 2, 3};
  int64_t s[5] = {2, 3, 1, 5, 2};
  return dt_permute(g, dt_permute(g, dt_reshape(g, x[0], 5, s), p), q);
}
static dt_tensor *cp_concat2_mid(dt_graph *g, dt_tensor **x) { return dt_concat(g, x, 2, 1); }
static dt_tensor *cp_concat3_first(dt_graph *g, dt_tensor **x) { return dt_concat(g, x, 3, 0); }
static dt_tensor *cp_concat3_last(dt_graph *g, dt_tensor **x) { /* one input twice: its gradient from both places */
  dt_tensor *xs[3] = {x[0], x[1], x[0]};
  return dt_concat(g, xs, 3, -1);
}
static dt_tensor *cp_slice_mid(dt_graph *g, dt_tensor **x) { return dt_slice(g, x[0], 1, 2, 3); }
static dt_tensor *cp_slice_first(dt_graph *g, dt_tensor **x) { return dt_slice(g, x[0], 0, 1, 4); }
static dt_tensor *cp_slice_last_twice(dt_graph *g, dt_tensor **x) { /* overlapping slices of one input */
  return dt_mul(g, dt_slice(g, x[0], -1, 0, 5), dt_slice(g, x[0], -1, 2, 5));
}
static dt_tensor *cp_split3(dt_graph *g, dt_tensor **x) {
  dt_tensor *p[3] = {NULL, NULL, NULL};
  if (dt_split(g, x[0], 1, 3, p) != DTRAIN_OK) return NULL;
  return dt_add(g, dt_mul(g, p[0], p[2]), dt_tanh(g, p[1]));
}
static dt_tensor *cp_split_axis0(dt_graph *g, dt_tensor **x) {
  dt_tensor *p[2] = {NULL, NULL};
  if (dt_split(g, x[0], 0, 2, p) != DTRAIN_OK) return NULL;
  return dt_sub(g, p[1], dt_sigmoid(g, p[0]));
}
static dt_tensor *cp_bmm(dt_graph *g, dt_tensor **x) { return dt_bmm(g, x[0], x[1], 0); }
static dt_tensor *cp_bmm_tb(dt_graph *g, dt_tensor **x) { return dt_bmm(g, x[0], x[1], 1); }
static dt_tensor *cp_causal(dt_graph *g, dt_tensor **x) { return dt_softmax(g, dt_causal_mask(g, x[0]), -1); }
static dt_tensor *cp_causal_raw(dt_graph *g, dt_tensor **x) { /* -inf masked out again: finite output */
  return dt_mul(g, dt_exp(g, dt_causal_mask(g, x[0])), x[0]);
}
static dt_tensor *cp_batch_norm(dt_graph *g, dt_tensor **x) {
  return dt_batch_norm(g, x[0], x[1], x[2], NULL, NULL, 0.1f, 1e-5f);
}
static dt_tensor *cp_batch_norm_plain(dt_graph *g, dt_tensor **x) {
  return dt_batch_norm(g, x[0], NULL, NULL, NULL, NULL, 0.1f, 1e-3f);
}
static dt_tensor *cp_batch_norm_gamma(dt_graph *g, dt_tensor **x) {
  return dt_batch_norm(g, x[0], x[1], NULL, NULL, NULL, 0.1f, 1e-5f);
}

static void test_ops_parity(void) {
  static const cp_case cases[] = {
    {"add", cp_add, 2, {2, 2, 0}, {{7, 5}, {7, 5}}, -2, 2, 0},
    {"add_row_bcast", cp_add, 2, {2, 1, 0}, {{7, 5}, {5}}, -2, 2, 0},
    {"add_lead1_bcast", cp_add, 2, {3, 2, 0}, {{2, 3, 4}, {1, 4}}, -2, 2, 0},
    {"sub_bcast", cp_sub, 2, {3, 2, 0}, {{2, 3, 4}, {3, 4}}, -2, 2, 0},
    {"sub", cp_sub, 2, {1, 1, 0}, {{33}, {33}}, -2, 2, 0},
    {"mul", cp_mul, 2, {2, 2, 0}, {{6, 4}, {6, 4}}, -2, 2, 0},
    {"mul_bcast", cp_mul, 2, {2, 1, 0}, {{6, 4}, {4}}, -2, 2, 0},
    {"div", cp_div, 2, {2, 2, 0}, {{6, 4}, {6, 4}}, 0.5f, 2, 0},
    {"div_bcast", cp_div, 2, {3, 1, 0}, {{2, 3, 4}, {4}}, 0.5f, 2, 0},
    {"add_scalar", cp_add_scalar, 1, {2, 0, 0}, {{5, 7}}, -2, 2, 0},
    {"mul_scalar", cp_mul_scalar, 1, {2, 0, 0}, {{5, 7}}, -2, 2, 0},
    {"rsub_scalar", cp_rsub_scalar, 1, {1, 0, 0}, {{37}}, -2, 2, 0},
    {"pow_scalar_2", cp_pow2, 1, {2, 0, 0}, {{5, 7}}, -2, 2, 0},
    {"pow_scalar_3", cp_pow3, 1, {2, 0, 0}, {{5, 7}}, -2, 2, 0},
    {"pow_scalar_half", cp_pow_half, 1, {2, 0, 0}, {{5, 7}}, 0.1f, 3, 0},
    {"pow_scalar_neg_frac", cp_pow_m15, 1, {2, 0, 0}, {{5, 7}}, 0.5f, 3, 0},
    {"log", cp_log, 1, {2, 0, 0}, {{9, 13}}, 0.05f, 4, 0},
    {"sqrt", cp_sqrt, 1, {2, 0, 0}, {{9, 13}}, 0.05f, 4, 0},
    {"neg", cp_neg, 1, {3, 0, 0}, {{2, 3, 5}}, -2, 2, 0},
    {"exp", cp_exp, 1, {2, 0, 0}, {{9, 13}}, -3, 3, 0},
    {"leaky_relu", cp_leaky_relu, 1, {2, 0, 0}, {{9, 13}}, -1, 1, 0},
    {"gelu", cp_gelu, 1, {2, 0, 0}, {{9, 13}}, -4, 4, 0},
    {"relu", cp_relu, 1, {2, 0, 0}, {{9, 13}}, -1, 1, 0},
    {"sigmoid", cp_sigmoid, 1, {2, 0, 0}, {{9, 13}}, -12, 12, 0},
    {"tanh", cp_tanh, 1, {1, 0, 0}, {{100}}, -4, 4, 0},
    {"sum", cp_sum, 1, {2, 0, 0}, {{31, 7}}, -1, 1, 0},
    {"mean", cp_mean, 1, {3, 0, 0}, {{3, 5, 7}}, -1, 1, 0},
    {"sum_axis_mid", cp_sum_axis1, 1, {3, 0, 0}, {{3, 5, 4}}, -1, 1, 0},
    {"sum_axis_last_keepdim", cp_sum_axis_last_keep, 1, {3, 0, 0}, {{3, 5, 4}}, -1, 1, 0},
    {"mean_axis0", cp_mean_axis0, 1, {2, 0, 0}, {{7, 6}}, -1, 1, 0},
    {"mean_axis_mid_keepdim", cp_mean_axis1_keep, 1, {4, 0, 0}, {{2, 3, 2, 5}}, -1, 1, 0},
    {"transpose", cp_transpose, 1, {2, 0, 0}, {{7, 5}}, -1, 1, 0},
    {"transpose_batched", cp_transpose, 1, {4, 0, 0}, {{2, 3, 4, 5}}, -1, 1, 0},
    {"dropout", cp_dropout, 1, {2, 0, 0}, {{16, 33}}, -1, 1, 0},
    {"layer_norm", cp_layer_norm, 3, {2, 1, 1}, {{6, 8}, {8}, {8}}, -2, 2, 0},
    {"layer_norm_gamma_3d", cp_layer_norm_gamma, 2, {3, 1, 0}, {{2, 3, 7}, {7}}, -2, 2, 0},
    {"layer_norm_plain", cp_layer_norm_plain, 1, {2, 0, 0}, {{5, 16}}, -2, 2, 0},
    {"embedding", cp_embedding, 1, {2, 0, 0}, {{7, 5}}, -1, 1, 0},
    {"matmul", cp_matmul, 2, {2, 2, 0}, {{7, 5}, {5, 3}}, -1, 1, 0},
    {"linear", cp_linear, 3, {2, 2, 1}, {{6, 5}, {4, 5}, {4}}, -1, 1, 0},
    {"linear_3d_nobias", cp_linear_nob, 2, {3, 2, 0}, {{2, 3, 5}, {4, 5}}, -1, 1, 0},
    {"softmax", cp_softmax, 1, {2, 0, 0}, {{6, 9}}, -5, 5, 0},
    {"softmax_axis0", cp_softmax0, 1, {2, 0, 0}, {{6, 9}}, -5, 5, 0},
    {"log_softmax_mid", cp_log_softmax, 1, {3, 0, 0}, {{2, 5, 3}}, -5, 5, 0},
    {"cross_entropy", cp_xent, 1, {2, 0, 0}, {{16, 5}}, -4, 4, 0},
    {"mse", cp_mse, 2, {2, 2, 0}, {{8, 3}, {8, 3}}, -2, 2, 0},
    {"flatten", cp_flatten, 1, {4, 0, 0}, {{2, 3, 2, 2}}, -1, 1, 0},
    {"reshape", cp_reshape, 2, {3, 2, 0}, {{2, 3, 4}, {4, 6}}, -1, 1, 0},
    {"chain", cp_chain, 3, {2, 2, 1}, {{5, 4}, {3, 4}, {3}}, -1, 1, 0},
    {"conv2d_pad1_bias", cp_conv, 3, {4, 4, 1}, {{2, 3, 6, 5}, {4, 3, 3, 3}, {4}}, -1, 1, 0},
    {"conv2d_bias_big_plane", cp_conv, 3, {4, 4, 1}, {{3, 2, 18, 17}, {3, 2, 3, 3}, {3}}, -1, 1, 0},
    {"conv2d_stride2_pad2", cp_conv_s2, 2, {4, 4, 0}, {{2, 2, 7, 6}, {3, 2, 3, 2}}, -1, 1, 0},
    {"max_pool2d", cp_maxpool, 1, {4, 0, 0}, {{2, 3, 6, 8}}, -1, 1, 0},
    {"max_pool2d_overlap", cp_maxpool_overlap, 1, {4, 0, 0}, {{2, 2, 5, 6}}, -1, 1, 0},
    {"avg_pool2d", cp_avgpool, 1, {4, 0, 0}, {{2, 2, 7, 6}}, -1, 1, 0},
    {"cnn_chain", cp_cnn, 3, {4, 4, 1}, {{2, 3, 4, 4}, {2, 3, 3, 3}, {2}}, -1, 1, 0},
    {"permute_3d", cp_permute_3d, 1, {3, 0, 0}, {{3, 4, 5}}, -1, 1, 0},
    {"permute_heads", cp_permute_heads, 1, {4, 0, 0}, {{2, 3, 5, 4}}, -1, 1, 0},
    {"permute_2d", cp_permute_2d, 1, {2, 0, 0}, {{7, 3}}, -1, 1, 0},
    {"permute_4d_odd", cp_permute_4d, 1, {4, 0, 0}, {{3, 2, 5, 7}}, -1, 1, 0},
    {"permute_5d", cp_permute_5d, 1, {2, 0, 0}, {{6, 10}}, -1, 1, 0},
    {"concat2_mid", cp_concat2_mid, 2, {3, 3, 0}, {{3, 4, 5}, {3, 2, 5}}, -1, 1, 0},
    {"concat3_first", cp_concat3_first, 3, {2, 2, 2}, {{2, 3}, {1, 3}, {4, 3}}, -1, 1, 0},
    {"concat3_last_repeat", cp_concat3_last, 2, {3, 3, 0}, {{2, 3, 5}, {2, 3, 1}}, -1, 1, 0},
    {"slice_mid", cp_slice_mid, 1, {3, 0, 0}, {{3, 7, 5}}, -1, 1, 0},
    {"slice_first", cp_slice_first, 1, {2, 0, 0}, {{6, 5}}, -1, 1, 0},
    {"slice_last_overlap", cp_slice_last_twice, 1, {3, 0, 0}, {{2, 3, 7}}, -1, 1, 0},
    {"split3", cp_split3, 1, {3, 0, 0}, {{2, 9, 3}}, -1, 1, 0},
    {"split_axis0", cp_split_axis0, 1, {2, 0, 0}, {{6, 5}}, -1, 1, 0},
    {"bmm", cp_bmm, 2, {4, 4, 0}, {{2, 3, 5, 4}, {2, 3, 4, 6}}, -1, 1, 0},
    {"bmm_trans_b", cp_bmm_tb, 2, {3, 3, 0}, {{3, 5, 4}, {3, 7, 4}}, -1, 1, 0},
    {"bmm_shared_b", cp_bmm, 2, {3, 2, 0}, {{2, 5, 4}, {4, 3}}, -1, 1, 0},
    {"bmm_shared_b_trans", cp_bmm_tb, 2, {3, 2, 0}, {{3, 5, 4}, {6, 4}}, -1, 1, 0},
    {"bmm_one", cp_bmm, 2, {2, 2, 0}, {{1, 7}, {7, 1}}, -1, 1, 0},
    {"causal_mask_softmax", cp_causal, 1, {4, 0, 0}, {{2, 3, 5, 5}}, -2, 2, 0},
    {"causal_mask_2d", cp_causal_raw, 1, {2, 0, 0}, {{7, 7}}, -2, 2, 0},
    {"causal_mask_1x1", cp_causal, 1, {3, 0, 0}, {{3, 1, 1}}, -2, 2, 0},
    {"batch_norm_2d", cp_batch_norm, 3, {2, 1, 1}, {{7, 5}, {5}, {5}}, -2, 2, 0},
    {"batch_norm_4d", cp_batch_norm, 3, {4, 1, 1}, {{3, 4, 3, 5}, {4}, {4}}, -2, 2, 0},
    /* planes larger than a block's 256 threads (the per-channel sums' walk steps by pixels only) */
    {"batch_norm_4d_big_plane", cp_batch_norm, 3, {4, 1, 1}, {{3, 2, 17, 19}, {2}, {2}}, -2, 2, 0},
    {"batch_norm_plain", cp_batch_norm_plain, 1, {4, 0, 0}, {{2, 3, 2, 3}}, -2, 2, 0},
    {"batch_norm_gamma", cp_batch_norm_gamma, 2, {2, 1, 0}, {{9, 3}, {3}}, -2, 2, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    th_cur = cases[i].name;
    cp_check_case(&cases[i]);
  }
  th_cur = "test_ops_parity";
}

/* Every op of DT__MAP_LIST (dt_maps.h, through th_map_ops): an op added to
 * the list is compared here, forward and backward, without an edit. */
static const th_map_op *cp_map_cur;
static dt_tensor *cp_map(dt_graph *g, dt_tensor **x) { return th_map_apply(g, cp_map_cur, x[0]); }

static void test_maps_parity(void) {
  int n;
  const th_map_op *ops = th_map_ops(&n);
  for (int i = 0; i < n; i++) {
    cp_map_cur = &ops[i];
    int any = ops[i].domain == DT__MAP_DOMAIN_ANY;
    cp_case c = {ops[i].name, cp_map, 1, {2, 0, 0}, {{9, 13}}, any ? -4.0f : 0.05f, 4.0f, 0};
    th_cur = ops[i].name;
    cp_check_case(&c);
  }
  th_cur = "test_maps_parity";
}

/* Broadcasts the device does not do fail with DTRAIN_ERR_UNSUPPORTED naming
 * the op and the device; argument errors are the CPU op's. */
static void test_unsupported(void) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = cp_dev;
  dt_graph *g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (!g) return;
  dt_tensor *x = NULL;
  x = dt_tensor_new2(g, 4, 3);
  dt_tensor *col = dt_tensor_new2(g, 4, 1);
  CHECK(dt_add(g, x, col) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_UNSUPPORTED);
  CHECK(strstr(dt_graph_message(g), "dt_add") != NULL);
  dt_graph_reset(g);
  /* batch statistics of one value per channel: the CPU op's argument error, on a device too */
  x = dt_tensor_new4(g, 1, 2, 1, 1);
  CHECK(dt_batch_norm(g, x, NULL, NULL, NULL, NULL, 0.1f, 1e-5f) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG);
  dt_graph_reset(g);
  /* embedding ids are host memory, range-checked on the host as on the CPU */
  static const int32_t bad_ids[3] = {0, 7, 1};
  CHECK(dt_embedding(g, dt_tensor_new2(g, 4, 3), bad_ids, 3) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INDEX);
  dt_graph_reset(g);
  /* dt_item and dt_scalar move one float; a NaN is caught by check_numerics. */
  dt_tensor *s = dt_scalar(g, 2.5f);
  CHECK_NEAR(dt_item(s), 2.5, 0.0);
  dt_graph_destroy(g);
  gd.check_numerics = 1;
  g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (!g) return;
  float big[2] = {1e30f, -1e30f};
  int64_t two = 2;
  dt_tensor *b = dt_tensor_from(g, 1, &two, big);
  CHECK(dt_mul(g, b, b) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NONFINITE);
  dt_graph_destroy(g);
}

/* check_numerics with a causal mask: the -inf it writes above the diagonal
 * is intended and passes; a NaN in a kept entry fails with the CPU op's
 * message (a NaN above the diagonal is masked away). */
static void cp_causal_numerics(dt_device *dev, int nan_at, char *msg, size_t cap) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  gd.check_numerics = 1;
  dt_graph *g = dt_graph_create(NULL, &gd);
  float x[2 * 4 * 4];
  for (int i = 0; i < 32; i++) x[i] = 0.1f * (float)i;
  if (nan_at >= 0) x[nan_at] = NAN;
  int64_t s[3] = {2, 4, 4};
  dt_tensor *y = g ? dt_causal_mask(g, dt_tensor_from(g, 3, s, x)) : NULL;
  snprintf(msg, cap, "%d %.200s", (int)(g ? dt_graph_error(g) : DTRAIN_ERR_NOMEM), y ? "ok" : dt_graph_message(g));
  dt_graph_destroy(g);
}

static void test_causal_numerics(void) {
  static const int at[3] = {-1, 16 + 2 * 4 + 3, 16 + 2 * 4 + 1}; /* none; above the diagonal; kept */
  for (int i = 0; i < 3; i++) {
    char mc[256], md[256];
    cp_causal_numerics(NULL, at[i], mc, sizeof mc);
    cp_causal_numerics(cp_dev, at[i], md, sizeof md);
    CHECK_MSG(strcmp(mc, md) == 0, "cpu '%s' device '%s'", mc, md);
    CHECK_MSG(i < 2 ? strcmp(md, "0 ok") == 0 : strstr(md, "NaN at element 25") != NULL, "case %d: %s", i, md);
  }
}

/* Batch norm with running statistics (dt_nn_batch_norm): training steps
 * update the running mean and variance on the device as the CPU op does
 * (they are params: compared after dt_graph_params_download), then eval mode
 * normalises with them; forward and parameter gradients vs the CPU. A
 * running variance that makes var + eps <= 0 fails in eval mode with the
 * CPU op's error. */
static int cp_bn_run(dt_device *dev, float *out, float *params, size_t *np, size_t *stat_off, char *err,
                     size_t errcap) {
  dt_params *p = dt_params_create(3);
  dt_nn_batch_norm bn;
  int ok = p && dt_nn_batch_norm_init(&bn, p, "bn", 3) == DTRAIN_OK;
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  dt_graph *g = ok ? dt_graph_create(p, &gd) : NULL;
  ok = g != NULL;
  float x[2 * 3 * 4 * 5];
  th_seed(7);
  th_fill(x, 120, -2.0f, 3.0f);
  int64_t xs[4] = {2, 3, 4, 5};
  for (int step = 0; ok && step < 3; step++) { /* training: batch stats, running stats updated */
    dt_graph_reset(g);
    dt_tensor *in = dt_tensor_from(g, 4, xs, x);
    dt_tensor *y = dt_nn_batch_norm_forward(g, &bn, in);
    dt_tensor *l = dt_mean(g, dt_mul(g, y, dt_tanh(g, in)));
    ok = l && dt_backward(g, l) == DTRAIN_OK;
    for (int i = 0; i < 120; i++) x[i] = x[i] * 0.9f + 0.3f; /* another batch */
  }
  if (ok) { /* eval: the running stats */
    dt_graph_reset(g);
    dt_graph_set_training(g, 0);
    dt_tensor *y = dt_nn_batch_norm_forward(g, &bn, dt_tensor_from(g, 4, xs, x));
    ok = y && dt_tensor_to_host(y, out) == DTRAIN_OK;
  }
  if (ok) {
    dt_param_info mi, vi;
    memset(&mi, 0, sizeof mi);
    memset(&vi, 0, sizeof vi);
    *np = dt_params_size(p);
    ok = *np <= 64 && dt_params_info(p, bn.mean, &mi) == DTRAIN_OK && dt_params_info(p, bn.var, &vi) == DTRAIN_OK &&
         dt_graph_params_download(g) == DTRAIN_OK;
    stat_off[0] = mi.offset;
    stat_off[1] = vi.offset;
    if (ok) memcpy(params, dt_params_data(p), *np * sizeof(float));
  }
  if (ok) { /* a bad running variance */
    dt_param_info info;
    ok = dt_params_info(p, bn.var, &info) == DTRAIN_OK;
    if (ok) dt_params_data(p)[info.offset + 1] = -1.0f;
    ok = ok && dt_graph_params_upload(g) == DTRAIN_OK;
    dt_graph_reset(g);
    if (ok) ok = dt_nn_batch_norm_forward(g, &bn, dt_tensor_from(g, 4, xs, x)) == NULL;
    snprintf(err, errcap, "%d %.200s", (int)dt_graph_error(g), dt_graph_message(g));
  }
  if (!ok && g) fprintf(stderr, "cp_bn_run on %s: %s\n", dev ? dev->name : "cpu", dt_graph_message(g));
  dt_graph_destroy(g);
  dt_params_destroy(p);
  return ok;
}

static void test_batch_norm_running(void) {
  float yc[120], yd[120], pc[64], pd[64];
  size_t nc = 0, nd = 0, off[2] = {0, 0};
  char ec[256] = "", ed[256] = "";
  CHECK(cp_bn_run(NULL, yc, pc, &nc, off, ec, sizeof ec));
  CHECK(cp_bn_run(cp_dev, yd, pd, &nd, off, ed, sizeof ed));
  CHECK_MSG(nc >= 12 && nc == nd && nc <= 64, "%zu vs %zu params", nc, nd);
  double worst = 0.0;
  for (int i = 0; i < 120; i++) worst = fmax(worst, fabs((double)yc[i] - (double)yd[i]));
  for (size_t i = 0; i < nc && nc == nd; i++) worst = fmax(worst, fabs((double)pc[i] - (double)pd[i]));
  cp_compared += 120 + (int)nc;
  CHECK_MSG(worst <= 1e-5, "batch norm (running stats, eval) differs by %g", worst);
  CHECK(pc[off[0]] != 0.0f && pc[off[1]] != 1.0f); /* the running stats did move */
  CHECK_MSG(strcmp(ec, ed) == 0 && strstr(ec, "running_var[1]") != NULL, "cpu '%s' device '%s'", ec, ed);
}

/* log, sqrt and non-integer powers check their domain on the device: the
 * same error, with the same message (first bad element and its value), as
 * the CPU op; zero and numbers below are outside log's domain, zero inside
 * sqrt's. A NaN is not refused (issue 17): it goes through as in PyTorch, a
 * later bad element is still named; +Inf is inside every domain. When the op
 * runs, msg gets the output and the gradient at bad_at, so that CPU and
 * device are compared there too (NaN in, NaN out on both; a NaN prints as
 * "nan" whatever its sign bit, which IEEE leaves open). */
static void cp_domain_msg(dt_device *dev, int which, int64_t bad_at, float bad, char *msg, size_t cap,
                          dt_result *code) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  dt_graph *g = dt_graph_create(NULL, &gd);
  float x[40], go[40];
  for (int i = 0; i < 40; i++) x[i] = 0.5f + (float)i, go[i] = 0.25f;
  if (bad_at >= 0) x[bad_at] = bad;
  if (bad_at >= 0 && bad_at + 3 < 40) x[bad_at + 3] = -1.0f; /* a later one: not the one named */
  int64_t s[2] = {5, 8};
  dt_tensor *t = dt_tensor_from(g, 2, s, x);
  dt_tensor_set_requires_grad(t, 1);
  dt_tensor *y = which == 0 ? dt_log(g, t) : which == 1 ? dt_sqrt(g, t) : dt_pow_scalar(g, t, 1.5f);
  *code = dt_graph_error(g);
  float yh[40], gh[40];
  int64_t at = bad_at >= 0 ? bad_at : 0;
  if (y && dt_backward_grad(g, y, go) == DTRAIN_OK && dt_tensor_to_host(y, yh) == DTRAIN_OK &&
      dt_tensor_grad_to_host(t, gh) == DTRAIN_OK)
    snprintf(msg, cap, "ok %g %g", isnan(yh[at]) ? NAN : (double)yh[at], isnan(gh[at]) ? NAN : (double)gh[at]);
  else
    snprintf(msg, cap, "%.200s", y ? "backward failed" : dt_graph_message(g));
  dt_graph_destroy(g);
}

static void test_domain_checks(void) {
  static const struct { int which; int64_t at; float v; dt_result want; } cases[] = {
    {0, 17, 0.0f, DTRAIN_ERR_INVALID_ARG}, {0, 0, -2.0f, DTRAIN_ERR_INVALID_ARG},
    {0, 39, NAN, DTRAIN_OK},  {1, 17, 0.0f, DTRAIN_ERR_INVALID_ARG},
    {1, 22, -0.25f, DTRAIN_ERR_INVALID_ARG}, {2, 5, 0.0f, DTRAIN_ERR_INVALID_ARG},
    {0, 10, NAN, DTRAIN_ERR_INVALID_ARG}, {1, 4, NAN, DTRAIN_ERR_INVALID_ARG}, {2, 30, NAN, DTRAIN_ERR_INVALID_ARG},
    {1, 39, NAN, DTRAIN_OK}, {2, 39, NAN, DTRAIN_OK}, {0, 39, INFINITY, DTRAIN_OK}, {1, 39, INFINITY, DTRAIN_OK},
    {2, 39, INFINITY, DTRAIN_OK}, {0, 38, -INFINITY, DTRAIN_ERR_INVALID_ARG}, {1, 37, -INFINITY, DTRAIN_ERR_INVALID_ARG},
    {0, -1, 0.0f, DTRAIN_OK}, {1, -1, 0.0f, DTRAIN_OK}, {2, -1, 0.0f, DTRAIN_OK}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char mc[256], md[256];
    dt_result rc, rd;
    int which = cases[i].which;
    if ((which == 1 && cases[i].at == 17) || cases[i].v != cases[i].v) {
      /* sqrt(0) is fine, and a NaN goes through: only the later -1 is outside */
      cp_domain_msg(NULL, which, cases[i].at, cases[i].v, mc, sizeof mc, &rc);
      if (cases[i].at + 3 < 40) {
        char want[32];
        snprintf(want, sizeof want, "element %d ", (int)cases[i].at + 3);
        CHECK_MSG(strstr(mc, want) != NULL, "case %zu: %s", i, mc);
      } else {
        CHECK_MSG(strcmp(mc, "ok nan nan") == 0, "case %zu: %s", i, mc);
      }
    }
    cp_domain_msg(NULL, which, cases[i].at, cases[i].v, mc, sizeof mc, &rc);
    cp_domain_msg(cp_dev, which, cases[i].at, cases[i].v, md, sizeof md, &rd);
    CHECK_MSG(rc == cases[i].want && rd == rc, "case %zu: cpu %d device %d", i, (int)rc, (int)rd);
    CHECK_MSG(strcmp(mc, md) == 0, "case %zu: cpu '%s' device '%s'", i, mc, md);
  }
}

/* Dropout on a device draws its mask on the host from the graph's RNG as
 * the CPU op does: for a seed, the device output equals the CPU output bit
 * for bit (the mask is 0 or 1/(1-p) times x, one float multiply each), the
 * RNG ends in the same state, and another seed gives another mask. Off in
 * eval mode, on a device too. */
static int cp_dropout_run(dt_device *dev, uint64_t seed, int training, float *out, uint64_t rng[4]) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  gd.seed = seed;
  dt_graph *g = dt_graph_create(NULL, &gd);
  if (!g) return 0;
  dt_graph_set_training(g, training);
  float x[64];
  for (int i = 0; i < 64; i++) x[i] = 0.25f + (float)i;
  int64_t s[2] = {4, 16};
  dt_tensor *y = dt_dropout(g, dt_dropout(g, dt_tensor_from(g, 2, s, x), 0.25f), 0.5f);
  int ok = y && dt_tensor_to_host(y, out) == DTRAIN_OK;
  dt_graph_rng_state(g, rng);
  dt_graph_destroy(g);
  return ok;
}

static void test_dropout_seed(void) {
  float cpu[64], dev[64], other[64];
  uint64_t rc[4], rd[4], ro[4];
  CHECK(cp_dropout_run(NULL, 1234, 1, cpu, rc));
  CHECK(cp_dropout_run(cp_dev, 1234, 1, dev, rd));
  CHECK(memcmp(cpu, dev, sizeof cpu) == 0);
  CHECK(memcmp(rc, rd, sizeof rc) == 0);
  int zeros = 0;
  for (int i = 0; i < 64; i++) zeros += dev[i] == 0.0f;
  CHECK_MSG(zeros > 16 && zeros < 56, "%d of 64 dropped", zeros);
  CHECK(cp_dropout_run(cp_dev, 99, 1, other, ro));
  CHECK(memcmp(dev, other, sizeof dev) != 0);
  CHECK(cp_dropout_run(cp_dev, 1234, 0, other, ro)); /* eval: identity */
  for (int i = 0; i < 64; i++) CHECK_NEAR(other[i], 0.25f + (float)i, 0.0);
}

/* The embedding and layer-norm modules (compositions of the ops) on params:
 * embedding -> layer norm -> gelu -> mean, forward and the whole parameter
 * gradient, CPU vs device. */
static int cp_modules_run(dt_device *dev, float *loss, float *grad, size_t *n) {
  dt_params *p = dt_params_create(11);
  dt_nn_embedding emb;
  dt_nn_layer_norm ln;
  int ok = p && dt_nn_embedding_init(&emb, p, "emb", 7, 8) == DTRAIN_OK &&
           dt_nn_layer_norm_init(&ln, p, "ln", 8) == DTRAIN_OK;
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  dt_graph *g = ok ? dt_graph_create(p, &gd) : NULL;
  ok = g != NULL;
  if (ok) {
    dt_tensor *h = dt_nn_layer_norm_forward(g, &ln, dt_nn_embedding_forward(g, &emb, cp_ids, 9));
    dt_tensor *l = dt_mean(g, dt_gelu(g, dt_mul(g, h, h)));
    ok = l && dt_backward(g, l) == DTRAIN_OK;
    if (!ok) fprintf(stderr, "cp_modules_run on %s: %s\n", dev ? dev->name : "cpu", dt_graph_message(g));
    *n = dt_params_size(p);
    if (*n > 256) ok = 0; /* the callers' buffers */
    if (ok) *loss = dt_item(l);
    if (ok && dev) ok = dev->copy(dev, grad, dt_graph_param_grad(g), *n * sizeof(float), DTRAIN_COPY_D2H) == DTRAIN_OK;
    else if (ok) memcpy(grad, dt_params_grad(p), *n * sizeof(float));
  }
  dt_graph_destroy(g);
  dt_params_destroy(p);
  return ok;
}

static void test_modules_parity(void) {
  float lc = 0, ld = 1, gc[256], gdv[256];
  size_t nc = 0, nd = 0;
  CHECK(cp_modules_run(NULL, &lc, gc, &nc));
  CHECK(cp_modules_run(cp_dev, &ld, gdv, &nd));
  CHECK_MSG(nc == nd && nc >= 7 * 8 + 2 * 8 && nc <= 256, "%zu vs %zu params", nc, nd);
  CHECK_NEAR(ld, lc, 1e-5);
  double worst = 0.0;
  for (size_t i = 0; i < nc && nc == nd; i++) {
    double d = fabs((double)gc[i] - (double)gdv[i]);
    if (d > worst) worst = d;
  }
  cp_compared += (int)nc;
  CHECK_MSG(worst <= 1e-5, "module gradients differ by %g", worst);
}

/* The attention, LSTM-cell and GRU-cell modules (compositions of linear,
 * split, permute, bmm, causal mask, softmax and the elementwise ops): two
 * steps of a small sequence model, the loss and the whole parameter
 * gradient, CPU vs device. */
static int cp_seq_run(dt_device *dev, int which, float *loss, float *grad, size_t *n) {
  dt_params *p = dt_params_create(17);
  dt_nn_attention att;
  dt_nn_lstm_cell lstm;
  dt_nn_gru_cell gru;
  const int64_t B = 2, T = 5, C = 6, H = 7;
  dt_result r = !p ? DTRAIN_ERR_NOMEM
                : which == 0 ? dt_nn_attention_init(&att, p, "att", C, 2)
                : which == 1 ? dt_nn_lstm_cell_init(&lstm, p, "lstm", C, H)
                             : dt_nn_gru_cell_init(&gru, p, "gru", C, H);
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  dt_graph *g = r == DTRAIN_OK ? dt_graph_create(p, &gd) : NULL;
  int ok = g != NULL;
  float x[2 * 5 * 6];
  th_seed(31 + which);
  th_fill(x, B * T * C, -1.0f, 1.0f);
  if (ok) {
    dt_tensor *l = NULL;
    if (which == 0) {
      int64_t s[3] = {B, T, C};
      dt_tensor *y = dt_nn_attention_forward(g, &att, dt_tensor_from(g, 3, s, x));
      l = dt_mean(g, dt_mul(g, y, y));
    } else { /* T steps of the cell over x [T, B, C] */
      int64_t s[2] = {B, C};
      dt_tensor *h = NULL, *c = NULL;
      for (int64_t t = 0; t < T; t++) {
        dt_tensor *xt = dt_tensor_from(g, 2, s, x + t * B * C);
        if (which == 1) {
          dt_tensor *hn = NULL, *cn = NULL;
          if (dt_nn_lstm_cell_forward(g, &lstm, xt, h, c, &hn, &cn) != DTRAIN_OK) break;
          h = hn;
          c = cn;
        } else {
          h = dt_nn_gru_cell_forward(g, &gru, xt, h);
        }
      }
      l = dt_mean(g, dt_mul(g, h, h));
    }
    ok = l && dt_backward(g, l) == DTRAIN_OK;
    if (!ok) fprintf(stderr, "cp_seq_run %d on %s: %s\n", which, dev ? dev->name : "cpu", dt_graph_message(g));
    *n = dt_params_size(p);
    if (*n > 1024) ok = 0; /* the callers' buffers */
    if (ok) *loss = dt_item(l);
    if (ok && dev) ok = dev->copy(dev, grad, dt_graph_param_grad(g), *n * sizeof(float), DTRAIN_COPY_D2H) == DTRAIN_OK;
    else if (ok) memcpy(grad, dt_params_grad(p), *n * sizeof(float));
  }
  dt_graph_destroy(g);
  dt_params_destroy(p);
  return ok;
}

static void test_seq_modules_parity(void) {
  static const char *const names[3] = {"attention", "lstm_cell", "gru_cell"};
  for (int which = 0; which < 3; which++) {
    static float gc[1024], gdv[1024];
    float lc = 0, ld = 1;
    size_t nc = 0, nd = 0;
    th_cur = names[which];
    CHECK(cp_seq_run(NULL, which, &lc, gc, &nc));
    CHECK(cp_seq_run(cp_dev, which, &ld, gdv, &nd));
    CHECK_MSG(nc == nd && nc > 100, "%zu vs %zu params", nc, nd);
    CHECK_NEAR(ld, lc, 1e-5);
    double worst = 0.0, big = 0.0;
    for (size_t i = 0; i < nc && nc == nd; i++) {
      worst = fmax(worst, fabs((double)gc[i] - (double)gdv[i]));
      big = fmax(big, fabs((double)gc[i]));
    }
    cp_compared += (int)nc;
    CHECK_MSG(big > 1e-4, "%s: the gradient is all zeros", names[which]);
    CHECK_MSG(worst <= 1e-5, "%s: parameter gradients differ by %g", names[which], worst);
  }
  th_cur = "test_seq_modules_parity";
}

/* A 2-layer MLP, a few steps on the CPU and on the device from the same
 * start: the parameters must agree after every step. */
static void cp_mlp_run(dt_device *dev, const dt_optim_options *od, float *params_out, size_t *n_out) {
  dt_params *p = dt_params_create(7);
  dt_nn_linear l1, l2;
  dt_nn_linear_init(&l1, p, "l1", 6, 16, 1);
  dt_nn_linear_init(&l2, p, "l2", 16, 5, 1);
  dt_optim *o = dt_optim_create(p, od);
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  gd.arena_bytes = 2048; /* several arena blocks in step 1, merged by the reset */
  dt_graph *g = dt_graph_create(p, &gd);
  CHECK(p && o && g);
  if (!p || !o || !g) return;
  float x[12 * 6];
  th_seed(99);
  th_fill(x, 12 * 6, -1.0f, 1.0f);
  int64_t xs[2] = {12, 6};
  for (int step = 0; step < 4; step++) {
    dt_graph_reset(g);
    CHECK(dt_graph_zero_grad(g) == DTRAIN_OK);
    dt_tensor *in = dt_tensor_from(g, 2, xs, x);
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &l1, in));
    dt_tensor *loss = dt_cross_entropy(g, dt_nn_linear_forward(g, &l2, h), cp_labels);
    CHECK(dt_backward(g, loss) == DTRAIN_OK);
    dt_result r = dt_optim_step_graph(o, g);
    CHECK_MSG(r == DTRAIN_OK, "step %d: %s", step, dt_last_error());
  }
  CHECK(dt_graph_params_download(g) == DTRAIN_OK);
  *n_out = dt_params_size(p);
  memcpy(params_out, dt_params_data(p), *n_out * sizeof(float));
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  dt_params_destroy(p);
}

static void cp_mlp_case(const dt_optim_options *od, const char *name) {
  static float a[1024], b[1024];
  size_t na = 0, nb = 0;
  cp_mlp_run(NULL, od, a, &na);
  cp_mlp_run(cp_dev, od, b, &nb);
  CHECK_MSG(na == nb && na > 0, "%s: %zu vs %zu params", name, na, nb);
  double worst = 0.0;
  for (size_t i = 0; i < na && na == nb; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > worst) worst = d;
  }
  cp_compared += (int)na;
  CHECK_MSG(worst <= 1e-5, "%s: params differ by %g after 4 steps", name, worst);
}

static void test_mlp_parity(void) {
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.1f;
  od.momentum = 0.9f;
  od.weight_decay = 1e-3f;
  cp_mlp_case(&od, "sgd_momentum");
  od.nesterov = 1;
  cp_mlp_case(&od, "sgd_nesterov");
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.01f;
  cp_mlp_case(&od, "adam");
  od.kind = DTRAIN_OPTIM_ADAMW;
  od.weight_decay = 0.01f;
  od.clip_norm = 0.05f;
  cp_mlp_case(&od, "adamw_clip");
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_RMSPROP;
  od.lr = 0.01f;
  cp_mlp_case(&od, "rmsprop");
  od.momentum = 0.8f;
  od.weight_decay = 1e-2f;
  od.alpha = 0.9f;
  cp_mlp_case(&od, "rmsprop_momentum_wd");
}

/* Checkpoints of a device run: train 3 steps on the device, save (the
 * device graph in the state: params and the optimizer's device state come
 * to the host), then resume from the file into a model built from another
 * seed, on the device and on the CPU, 3 more steps: the same parameters as
 * 6 uninterrupted steps on the device (bit for bit on the device: the same
 * kernels in the same order; within float tolerance on the CPU). AdamW with
 * dropout: the moments, the step count and the graph RNG all matter. */
static int cp_ck_steps(dt_graph *g, dt_optim *o, const dt_nn_linear *l1, const dt_nn_linear *l2, int steps) {
  float x[12 * 6];
  th_seed(99);
  th_fill(x, 12 * 6, -1.0f, 1.0f);
  int64_t xs[2] = {12, 6};
  int ok = 1;
  for (int step = 0; ok && step < steps; step++) {
    dt_graph_reset(g);
    ok = dt_graph_zero_grad(g) == DTRAIN_OK;
    dt_tensor *h = dt_dropout(g, dt_relu(g, dt_nn_linear_forward(g, l1, dt_tensor_from(g, 2, xs, x))), 0.25f);
    dt_tensor *loss = dt_cross_entropy(g, dt_nn_linear_forward(g, l2, h), cp_labels);
    ok = ok && loss && dt_backward(g, loss) == DTRAIN_OK && dt_optim_step_graph(o, g) == DTRAIN_OK;
    if (!ok) fprintf(stderr, "cp_ck_run step %d: %s / %s\n", step, dt_graph_message(g), dt_last_error());
  }
  return ok;
}

/* pre steps, load `load` (if given), `steps` steps, save to `save` (if
 * given), `post` steps; out: the params and Adam's first moment. */
static int cp_ck_run(dt_device *dev, uint64_t seed, int pre, const char *load, int steps, const char *save, int post,
                     float *out, size_t *n, float *m_out) {
  dt_params *p = dt_params_create(seed);
  dt_nn_linear l1, l2;
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAMW;
  od.lr = 0.02f;
  od.weight_decay = 0.01f;
  int ok = p && dt_nn_linear_init(&l1, p, "l1", 6, 16, 1) == DTRAIN_OK &&
           dt_nn_linear_init(&l2, p, "l2", 16, 5, 1) == DTRAIN_OK;
  dt_optim *o = ok ? dt_optim_create(p, &od) : NULL;
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = dev;
  gd.seed = seed * 3 + 1;
  dt_graph *g = o ? dt_graph_create(p, &gd) : NULL;
  ok = g != NULL;
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = p;
  st.optim = o;
  st.graph = g;
  ok = ok && cp_ck_steps(g, o, &l1, &l2, pre);
  if (ok && load) {
    ok = dt_checkpoint_load(load, &st) == DTRAIN_OK;
    if (!ok) fprintf(stderr, "cp_ck_run: load: %s\n", dt_last_error());
    if (ok) ok = dt_optim_steps(o) == 3;
  }
  ok = ok && cp_ck_steps(g, o, &l1, &l2, steps);
  if (ok && save) {
    ok = dt_checkpoint_save(save, &st) == DTRAIN_OK;
    if (!ok) fprintf(stderr, "cp_ck_run: save: %s\n", dt_last_error());
  }
  ok = ok && cp_ck_steps(g, o, &l1, &l2, post);
  if (ok) {
    *n = dt_params_size(p);
    ok = *n <= 1024 && dt_graph_params_download(g) == DTRAIN_OK;
    const float *m = ok ? dt_optim_state(o, 0) : NULL; /* on a device: copied from there */
    ok = m != NULL;
    if (ok) {
      memcpy(out, dt_params_data(p), *n * sizeof(float));
      memcpy(m_out, m, *n * sizeof(float));
    }
  }
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  dt_params_destroy(p);
  return ok;
}

#ifdef DTRAIN_NO_STDIO
/* No file I/O in this build (checkpoints refuse with DTRAIN_ERR_UNSUPPORTED,
 * which test_checkpoint checks): nothing to save or resume here. */
static void test_device_checkpoint(void) {
  TH_SKIP("DTRAIN_NO_STDIO build has no file I/O");
}
#else
static void test_device_checkpoint(void) {
  static float full[1024], dres[1024], cres[1024], m_full[1024], m_dev[1024], m_cpu[1024], m_mid[1024], mid[1024];
  static float cont[1024], m_cont[1024], late[1024], m_late[1024];
  size_t n0 = 0, n1 = 0, n2 = 0, n3 = 0, n4 = 0, n5 = 0;
  char path[] = "/tmp/dtrain_cuda_ckpt_XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  if (fd < 0) return;
  close(fd);
  CHECK(cp_ck_run(cp_dev, 5, 0, NULL, 6, NULL, 0, full, &n0, m_full));
  CHECK(cp_ck_run(cp_dev, 5, 0, NULL, 3, path, 0, mid, &n1, m_mid));
  CHECK(cp_ck_run(cp_dev, 5, 0, NULL, 3, path, 3, cont, &n4, m_cont));  /* saving changes nothing */
  CHECK(cp_ck_run(cp_dev, 77, 0, path, 3, NULL, 0, dres, &n2, m_dev));  /* a fresh optimizer */
  CHECK(cp_ck_run(cp_dev, 77, 2, path, 3, NULL, 0, late, &n5, m_late)); /* state already on the device */
  CHECK(cp_ck_run(NULL, 77, 0, path, 3, NULL, 0, cres, &n3, m_cpu));
  CHECK_MSG(n0 > 0 && n0 == n1 && n0 == n2 && n0 == n3 && n0 == n4 && n0 == n5, "%zu %zu %zu %zu %zu %zu params", n0,
            n1, n2, n3, n4, n5);
  double dd = 0.0, dc = 0.0, mm = 0.0, moved = 0.0;
  for (size_t i = 0; i < n0 && n0 == n2 && n0 == n3 && n0 == n4 && n0 == n5; i++) {
    dd = fmax(dd, fabs((double)full[i] - (double)dres[i]) + fabs((double)m_full[i] - (double)m_dev[i]));
    dd = fmax(dd, fabs((double)full[i] - (double)cont[i]) + fabs((double)m_full[i] - (double)m_cont[i]));
    dd = fmax(dd, fabs((double)full[i] - (double)late[i]) + fabs((double)m_full[i] - (double)m_late[i]));
    dc = fmax(dc, fabs((double)full[i] - (double)cres[i]));
    mm = fmax(mm, fabs((double)m_mid[i]));
    moved = fmax(moved, fabs((double)full[i] - (double)mid[i]));
  }
  cp_compared += 3 * (int)n0;
  CHECK_MSG(mm > 1e-4 && moved > 1e-3, "the optimizer state (%g) or the params (%g) did not move", mm, moved);
  CHECK_MSG(dd <= 1e-6, "resumed on the device: differs from the uninterrupted run by %g", dd);
  CHECK_MSG(dc <= 2e-5, "resumed on the CPU: differs from the uninterrupted device run by %g", dc);
  remove(path);
}
#endif /* DTRAIN_NO_STDIO */

/* Parameters move between the host params and the graph's device copy;
 * dt_graph_bind and dt_tensor_wrap take device memory on a device graph. */
static void test_param_transfers(void) {
  dt_params *p = dt_params_create(3);
  int64_t s[2] = {2, 3};
  int w = dt_params_add(p, "w", 2, s, dt_init_uniform(-1, 1));
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = cp_dev;
  dt_graph *g = dt_graph_create(p, &gd);
  CHECK(g != NULL);
  if (!g) return;
  float h[6], d[6];
  CHECK(dt_graph_param_data(g) != dt_params_data(p));
  CHECK(dt_tensor_to_host(dt_param(g, w), d) == DTRAIN_OK);
  CHECK(memcmp(d, dt_params_data(p), sizeof d) == 0);
  for (int i = 0; i < 6; i++) dt_params_data(p)[i] = (float)i; /* host change: invisible until upload */
  dt_graph_reset(g);
  CHECK(dt_tensor_to_host(dt_param(g, w), d) == DTRAIN_OK);
  CHECK(d[5] != 5.0f);
  CHECK(dt_graph_params_upload(g) == DTRAIN_OK);
  dt_graph_reset(g);
  CHECK(dt_tensor_to_host(dt_param(g, w), d) == DTRAIN_OK);
  CHECK(d[5] == 5.0f && d[0] == 0.0f);
  /* a gradient lands in the device grad buffer, and dt_graph_zero_grad clears it */
  dt_tensor *loss = dt_sum(g, dt_mul(g, dt_param(g, w), dt_param(g, w)));
  CHECK(dt_backward(g, loss) == DTRAIN_OK);
  CHECK(dt_tensor_grad_to_host(dt_param(g, w), h) == DTRAIN_OK);
  CHECK(h[5] == 10.0f && h[1] == 2.0f);
  CHECK(dt_graph_zero_grad(g) == DTRAIN_OK);
  CHECK(dt_tensor_grad_to_host(dt_param(g, w), h) == DTRAIN_OK);
  CHECK(h[5] == 0.0f);
  /* download: device -> host params */
  for (int i = 0; i < 6; i++) dt_params_data(p)[i] = -1.0f;
  CHECK(dt_graph_params_download(g) == DTRAIN_OK);
  CHECK(dt_params_data(p)[5] == 5.0f);
  /* wrap a device buffer: the graph's own parameter copy */
  dt_graph_reset(g);
  dt_tensor *t = dt_tensor_wrap(g, 2, s, dt_graph_param_data(g));
  CHECK(t != NULL && dt_tensor_to_host(t, d) == DTRAIN_OK && d[4] == 4.0f);
  /* params that grow after the graph was made are refused, not read past */
  int64_t one = 1;
  int b = dt_params_add(p, "b", 1, &one, dt_init_zeros());
  dt_graph_reset(g);
  CHECK(dt_param(g, b) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_STATE);
  dt_graph_destroy(g);
  dt_params_destroy(p);
}

/* On a CPU graph dt_optim_step_graph is dt_optim_step, bit for bit. */
static void test_step_graph_cpu_same(void) {
  float out[2][64];
  for (int way = 0; way < 2; way++) {
    dt_params *p = dt_params_create(5);
    int64_t s[1] = {64};
    dt_params_add(p, "w", 1, s, dt_init_uniform(-1, 1));
    for (int i = 0; i < 64; i++) dt_params_grad(p)[i] = (float)(i % 7) * 0.1f - 0.3f;
    dt_optim_options od;
    memset(&od, 0, sizeof od);
    od.kind = DTRAIN_OPTIM_ADAMW;
    od.weight_decay = 0.1f;
    od.clip_norm = 0.5f;
    dt_optim *o = dt_optim_create(p, &od);
    dt_graph *g = dt_graph_create(p, NULL);
    for (int k = 0; k < 3; k++) CHECK((way ? dt_optim_step_graph(o, g) : dt_optim_step(o)) == DTRAIN_OK);
    memcpy(out[way], dt_params_data(p), sizeof out[way]);
    dt_graph_destroy(g);
    dt_optim_destroy(o);
    dt_params_destroy(p);
  }
  CHECK(memcmp(out[0], out[1], sizeof out[0]) == 0);
}

static void cp_run_all(void) {
  TH_RUN(test_param_transfers);
  TH_RUN(test_step_graph_cpu_same);
  TH_RUN(test_ops_parity);
  TH_RUN(test_maps_parity);
  TH_RUN(test_unsupported);
  TH_RUN(test_batch_norm_running);
  TH_RUN(test_causal_numerics);
  TH_RUN(test_dropout_seed);
  TH_RUN(test_domain_checks);
  TH_RUN(test_modules_parity);
  TH_RUN(test_seq_modules_parity);
  TH_RUN(test_mlp_parity);
  TH_RUN(test_device_checkpoint);
}

#endif /* DTRAIN_TEST_CUDA_PARITY_H */
