/* dt_relu_inplace: gradients against finite differences after a convolution,
 * a linear layer and an add; the same values and gradients as dt_relu, bit
 * for bit, in a small CNN step and on NaN and signed zeros; the memory it saves;
 * and every refusal: views, parameters, ops whose backward reads their
 * result, a result another op already took, and any use of x afterwards. */
#include "harness.h"

static dt_tensor *f_conv(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_relu_inplace(g, dt_conv2d(g, in[0], in[1], in[2], 1, 1));
}
static dt_tensor *f_linear(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_relu_inplace(g, dt_linear(g, in[0], in[1], in[2]));
}
static dt_tensor *f_add(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  /* the in-place result feeds a second op, as in a network */
  return dt_mul(g, dt_relu_inplace(g, dt_add(g, in[0], in[1])), in[1]);
}

static void test_gradcheck(void) {
  th_seed(5);
  float x[2 * 3 * 5 * 5], w[4 * 3 * 3 * 3], b[4];
  th_fill(x, 150, -1, 1);
  th_fill(w, 108, -0.5f, 0.5f);
  th_fill(b, 4, -0.2f, 0.2f);
  int64_t sx[4] = {2, 3, 5, 5}, sw[4] = {4, 3, 3, 3}, sb[1] = {4};
  th_input ins[3] = {th_in(x, 4, sx, 1), th_in(w, 4, sw, 1), th_in(b, 1, sb, 1)};
  CHECK(th_gradcheck("relu_inplace(conv2d)", f_conv, NULL, ins, 3) == 0);

  float lx[6 * 7], lw[5 * 7], lb[5];
  th_fill(lx, 42, -1, 1);
  th_fill(lw, 35, -1, 1);
  th_fill(lb, 5, -0.3f, 0.3f);
  int64_t slx[2] = {6, 7}, slw[2] = {5, 7}, slb[1] = {5};
  th_input li[3] = {th_in(lx, 2, slx, 1), th_in(lw, 2, slw, 1), th_in(lb, 1, slb, 1)};
  CHECK(th_gradcheck("relu_inplace(linear)", f_linear, NULL, li, 3) == 0);

  float a[24], c[24];
  th_fill(a, 24, -1, 1);
  th_fill(c, 24, -1, 1);
  int64_t s2[2] = {4, 6};
  th_input ai[2] = {th_in(a, 2, s2, 1), th_in(c, 2, s2, 1)};
  CHECK(th_gradcheck("mul(relu_inplace(add), b)", f_add, NULL, ai, 2) == 0);
}

/* A small CNN: conv -> relu -> pool -> conv -> relu -> linear -> cross-entropy. */
typedef struct {
  dt_params *P;
  dt_nn_conv2d c1, c2;
  dt_nn_linear fc;
} cnn;

static void cnn_init(cnn *m) {
  m->P = dt_params_create(3);
  dt_nn_conv2d_init(&m->c1, m->P, "c1", 2, 8, 3, 1, 1, 1);
  dt_nn_conv2d_init(&m->c2, m->P, "c2", 8, 8, 5, 1, 2, 1); /* 5x5, 8 channels: the Winograd path */
  dt_nn_linear_init(&m->fc, m->P, "fc", 8 * 6 * 6, 3, 1);
}

#define NB 4
static float cx[NB * 2 * 12 * 12];
static int32_t cy[NB];

static dt_tensor *cnn_loss(dt_graph *g, const cnn *m, int inplace) {
  int64_t s[4] = {NB, 2, 12, 12};
  dt_tensor *x = dt_tensor_wrap(g, 4, s, cx);
  dt_tensor *h = dt_nn_conv2d_forward(g, &m->c1, x);
  h = inplace ? dt_relu_inplace(g, h) : dt_relu(g, h);
  h = dt_max_pool2d(g, h, 2, 2);
  h = dt_nn_conv2d_forward(g, &m->c2, h);
  h = inplace ? dt_relu_inplace(g, h) : dt_relu(g, h);
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->fc, dt_flatten(g, h)), cy);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static void test_same_as_relu(void) {
  th_seed(9);
  th_fill(cx, NB * 2 * 144, -1, 1);
  for (int i = 0; i < NB; i++) cy[i] = i % 3;
  cnn m;
  cnn_init(&m);
  size_t np = dt_params_size(m.P);
  float *g1 = (float *)malloc(np * sizeof(float)), *g2 = (float *)malloc(np * sizeof(float));
  size_t peak[2];
  float loss[2];
  for (int inplace = 0; inplace < 2; inplace++) {
    dt_graph *g = dt_graph_create(m.P, NULL);
    dt_params_zero_grad(m.P);
    dt_tensor *l = cnn_loss(g, &m, inplace);
    CHECK(l != NULL && dt_backward(g, l) == DTRAIN_OK);
    loss[inplace] = l ? l->data[0] : 0.0f;
    memcpy(inplace ? g2 : g1, dt_params_grad(m.P), np * sizeof(float));
    peak[inplace] = dt_graph_bytes_peak(g);
    dt_graph_destroy(g);
  }
  CHECK(isfinite(loss[0]) && same_bits(&loss[0], &loss[1], 1));
  CHECK(same_bits(g1, g2, np));
  /* the two activations [4,8,12,12] and [4,8,6,6] are not kept (their
   * gradients are shared too: test_nan_and_zeros; the peak may come before
   * the first layer's gradient is made, so only the activations are sure) */
  size_t saved = sizeof(float) * (4 * 8 * 144 + 4 * 8 * 36);
  CHECK_MSG(peak[0] >= peak[1] + saved, "peak %zu with dt_relu, %zu in place, want %zu less", peak[0], peak[1], saved);
  free(g1);
  free(g2);
  dt_params_destroy(m.P);
}

/* NaN, -0 and +0 in x: the values and the gradients are dt_relu's, bit for
 * bit, with y's gradient written by a GEMM (a linear layer's backward, with
 * zero and with nonzero weights). (dt_relu_inplace also turns a -0 in y's
 * gradient into +0, as dt_relu's adding into zeros does; no op here writes a
 * -0 gradient -- accumulators start at +0 -- so that line is defensive.) */
static void test_nan_and_zeros(void) {
  float v[8] = {1.5f, -2.0f, 0.0f, -0.0f, NAN, 3.0f, -1e-30f, 1e-30f};
  float w0[4] = {0, 0, 0, 0}, w1[4] = {0.5f, -1, 2, 0};
  float seed[2] = {-1, -1};
  float out[2][8], gx[2][8], ga[2][8];
  for (int pass = 0; pass < 2; pass++) {
    for (int inplace = 0; inplace < 2; inplace++) {
      dt_graph *g = dt_graph_create(NULL, NULL);
      int64_t s[2] = {2, 4}, sw[2] = {1, 4};
      dt_tensor *a = dt_tensor_from(g, 2, s, v), *z = dt_tensor_new(g, 2, s);
      dt_tensor *w = dt_tensor_from(g, 2, sw, pass ? w1 : w0);
      dt_tensor_set_requires_grad(a, 1);
      memset(z->data, 0, sizeof(float) * 8);
      dt_tensor *x = dt_add(g, a, z); /* exact: x == v, including -0 + 0 = +0 */
      dt_tensor *y = inplace ? dt_relu_inplace(g, x) : dt_relu(g, x);
      CHECK(y != NULL);
      if (!y) {
        dt_graph_destroy(g);
        return;
      }
      memcpy(out[inplace], y->data, sizeof out[0]);
      CHECK(dt_backward_grad(g, dt_linear(g, y, w, NULL), seed) == DTRAIN_OK);
      CHECK(x->grad != NULL && a->grad != NULL);
      if (x->grad) memcpy(gx[inplace], x->grad, sizeof gx[0]);
      if (inplace) CHECK(x->grad == y->grad && x->data == y->data); /* one buffer each, not two */
      if (a->grad) memcpy(ga[inplace], a->grad, sizeof ga[0]);
      dt_graph_destroy(g);
    }
    CHECK(same_bits(out[0], out[1], 8));
    CHECK(same_bits(gx[0], gx[1], 8)); /* x's own gradient */
    CHECK(same_bits(ga[0], ga[1], 8));
    CHECK(isnan(out[1][4]));
    if (pass) CHECK(gx[1][4] == -1 * w1[0] && gx[1][1] == 0); /* passes where x is NaN, stops where x < 0 */
  }
}

static void test_eval_mode(void) {
  cnn m;
  cnn_init(&m);
  dt_graph *g = dt_graph_create(m.P, NULL);
  dt_graph_set_grad_enabled(g, 0);
  int64_t s[4] = {NB, 2, 12, 12};
  dt_tensor *c = dt_nn_conv2d_forward(g, &m.c1, dt_tensor_wrap(g, 4, s, cx));
  CHECK(c != NULL);
  float *copy = (float *)malloc((size_t)c->size * sizeof(float));
  memcpy(copy, c->data, (size_t)c->size * sizeof(float));
  dt_tensor *r = dt_relu_inplace(g, c);
  CHECK(r != NULL && r->data == c->data); /* shares x's data */
  for (int64_t i = 0; r && i < r->size; i++) CHECK(r->data[i] == (copy[i] <= 0 ? 0.0f : copy[i]));
  free(copy);
  dt_graph_destroy(g);
  dt_params_destroy(m.P);
}

static void test_refusals(void) {
  cnn m;
  cnn_init(&m);
  dt_graph *g = dt_graph_create(m.P, NULL);
  int64_t s[4] = {NB, 2, 12, 12};
  float keep = cx[0];

  /* a wrapped user buffer: never written */
  dt_tensor *x = dt_tensor_wrap(g, 4, s, cx);
  CHECK(dt_relu_inplace(g, x) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "a view of other memory"));
  CHECK(cx[0] == keep);
  dt_graph_reset(g);

  /* a parameter */
  CHECK(dt_relu_inplace(g, dt_param(g, m.c1.w)) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "a parameter"));
  dt_graph_reset(g);

  /* an op whose backward reads its own result */
  x = dt_tensor_wrap(g, 4, s, cx);
  dt_tensor *e = dt_exp(g, dt_nn_conv2d_forward(g, &m.c1, x));
  CHECK(dt_relu_inplace(g, e) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "dt_exp"));
  dt_graph_reset(g);

  /* a result another op has already taken */
  x = dt_tensor_wrap(g, 4, s, cx);
  dt_tensor *c = dt_nn_conv2d_forward(g, &m.c1, x);
  dt_tensor *other = dt_sum(g, c);
  CHECK(other != NULL);
  CHECK(dt_relu_inplace(g, c) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "already an input"));
  dt_graph_reset(g);

  /* x used afterwards, by any op, or as the loss */
  x = dt_tensor_wrap(g, 4, s, cx);
  c = dt_nn_conv2d_forward(g, &m.c1, x);
  dt_tensor *r = dt_relu_inplace(g, c);
  CHECK(r != NULL);
  CHECK(dt_add(g, c, r) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_STATE && strstr(dt_graph_message(g), "overwritten by dt_relu_inplace"));
  dt_graph_reset(g);
  x = dt_tensor_wrap(g, 4, s, cx);
  c = dt_nn_conv2d_forward(g, &m.c1, x);
  r = dt_relu_inplace(g, c);
  dt_tensor *pieces[2] = {r, c};
  CHECK(dt_concat(g, pieces, 2, 1) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_STATE);
  dt_graph_reset(g);
  x = dt_tensor_wrap(g, 4, s, cx);
  c = dt_nn_conv2d_forward(g, &m.c1, x);
  r = dt_relu_inplace(g, c);
  CHECK(dt_relu_inplace(g, c) == NULL); /* twice */
  CHECK(dt_graph_error(g) == DTRAIN_ERR_STATE);
  dt_graph_reset(g);

  /* NULL */
  CHECK(dt_relu_inplace(g, NULL) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_relu_inplace(NULL, NULL) == NULL);
  dt_graph_destroy(g);
  dt_params_destroy(m.P);
}

int main(void) {
  TH_RUN(test_gradcheck);
  TH_RUN(test_same_as_relu);
  TH_RUN(test_nan_and_zeros);
  TH_RUN(test_eval_mode);
  TH_RUN(test_refusals);
  return th_summary("relu_inplace");
}
