/* Layers (linear, conv2d, embedding, layer/batch norm, LSTM, GRU, attention):
 * gradients w.r.t. parameters and inputs against finite differences, values
 * against direct computations, and error paths. */
#include "harness.h"

/* ---- parameter gradient check -----------------------------------------------------
 * build(g, ctx) makes the output from the graph's bound params (and its own
 * inputs). Probes up to 40 elements of every trainable parameter. */
typedef dt_tensor *(*build_fn)(dt_graph *g, void *ctx);

static int param_gradcheck(const char *name, dt_params *P, build_fn build, void *ctx) {
  dt_graph *g = dt_graph_create(P, NULL);
  float *data = dt_params_data(P);
  size_t n = dt_params_size(P);
  int bad = 0;
  dt_params_zero_grad(P);
  dt_tensor *out = build(g, ctx);
  if (!out) {
    fprintf(stderr, "%s: forward failed: %s\n", name, dt_graph_message(g));
    dt_graph_destroy(g);
    return 1;
  }
  int64_t no = out->size;
  float *r = (float *)malloc((size_t)no * sizeof(float));
  for (int64_t i = 0; i < no; i++) r[i] = th_uniform(-1, 1);
  if (dt_backward_grad(g, out, r) != DTRAIN_OK) {
    fprintf(stderr, "%s: backward failed: %s\n", name, dt_graph_message(g));
    free(r);
    dt_graph_destroy(g);
    return 1;
  }
  float *an = (float *)malloc(n * sizeof(float));
  memcpy(an, dt_params_grad(P), n * sizeof(float));
  for (int pi = 0; pi < dt_params_count(P); pi++) {
    dt_param_info info;
    dt_params_info(P, pi, &info);
    if (!info.trainable) continue;
    size_t step = info.size > 40 ? info.size / 40 : 1;
    for (size_t j = info.offset; j < info.offset + info.size; j += step) {
      float keep = data[j];
      double l[2], h[2];
      for (int s = 0; s < 2; s++) {
        data[j] = (float)(keep + (s ? -th_gc_eps : th_gc_eps));
        h[s] = data[j];
        dt_graph_reset(g);
        dt_tensor *o = build(g, ctx);
        l[s] = 0;
        for (int64_t i = 0; o && i < no; i++) l[s] += (double)o->data[i] * r[i];
      }
      data[j] = keep;
      double fd = (l[0] - l[1]) / (h[0] - h[1]), a = an[j];
      if (!(fabs(a - fd) <= th_gc_atol + th_gc_rtol * fmax(fabs(a), fabs(fd)))) {
        if (bad < 5) fprintf(stderr, "%s: %s[%zu]: analytic %.7g numeric %.7g\n", name, info.name, j - info.offset, a, fd);
        bad++;
      }
    }
  }
  free(an);
  free(r);
  dt_graph_destroy(g);
  return bad;
}

typedef struct {
  const void *layer;
  float *x;
  int ndim;
  int64_t shape[4];
  const int32_t *ids;
  int64_t nids;
} lctx;

static dt_tensor *x_of(dt_graph *g, lctx *c) { return dt_tensor_from(g, c->ndim, c->shape, c->x); }

static dt_tensor *b_linear(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_nn_linear_forward(g, (const dt_nn_linear *)c->layer, x_of(g, c));
}
static dt_tensor *b_conv(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_nn_conv2d_forward(g, (const dt_nn_conv2d *)c->layer, x_of(g, c));
}
static dt_tensor *b_embed(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_tanh(g, dt_nn_embedding_forward(g, (const dt_nn_embedding *)c->layer, c->ids, c->nids));
}
static dt_tensor *b_layer_norm(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_nn_layer_norm_forward(g, (const dt_nn_layer_norm *)c->layer, x_of(g, c));
}
static dt_tensor *b_batch_norm(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_nn_batch_norm_forward(g, (const dt_nn_batch_norm *)c->layer, x_of(g, c));
}
/* Three LSTM steps from a zero state, output the last h and c. */
static dt_tensor *b_lstm(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  const dt_nn_lstm_cell *l = (const dt_nn_lstm_cell *)c->layer;
  dt_tensor *h = NULL, *cs = NULL;
  int64_t N = c->shape[1], I = c->shape[2];
  int64_t xs[2];
  xs[0] = N; xs[1] = I;
  for (int t = 0; t < c->shape[0]; t++) {
    dt_tensor *x = dt_tensor_from(g, 2, xs, c->x + t * N * I);
    dt_tensor *h2, *c2;
    if (dt_nn_lstm_cell_forward(g, l, x, h, cs, &h2, &c2) != DTRAIN_OK) return NULL;
    h = h2;
    cs = c2;
  }
  dt_tensor *both[2] = {h, cs};
  return dt_concat(g, both, 2, 1);
}
static dt_tensor *b_gru(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  const dt_nn_gru_cell *l = (const dt_nn_gru_cell *)c->layer;
  dt_tensor *h = NULL;
  int64_t N = c->shape[1], I = c->shape[2];
  int64_t xs[2];
  xs[0] = N; xs[1] = I;
  for (int t = 0; t < c->shape[0]; t++) h = dt_nn_gru_cell_forward(g, l, dt_tensor_from(g, 2, xs, c->x + t * N * I), h);
  return h;
}
static dt_tensor *b_attention(dt_graph *g, void *p) {
  lctx *c = (lctx *)p;
  return dt_nn_attention_forward(g, (const dt_nn_attention *)c->layer, x_of(g, c));
}

static void test_linear_layer(void) {
  dt_params *P = dt_params_create(1);
  dt_nn_linear l;
  CHECK(dt_nn_linear_init(&l, P, "fc", 5, 3, 1) == DTRAIN_OK);
  CHECK(dt_params_find(P, "fc.weight") == l.w && dt_params_find(P, "fc.bias") == l.b);
  dt_param_info wi;
  dt_params_info(P, l.w, &wi);
  CHECK(wi.ndim == 2 && wi.shape[0] == 3 && wi.shape[1] == 5);
  float x[4 * 5];
  th_fill(x, 20, -1, 1);
  /* nonzero bias so the check sees it */
  dt_param_info bi;
  dt_params_info(P, l.b, &bi);
  th_fill(dt_params_data(P) + bi.offset, 3, -1, 1);
  lctx c = {&l, x, 2, {4, 5}, NULL, 0};
  CHECK(param_gradcheck("linear", P, b_linear, &c) == 0);
  /* values: y = x W^T + b */
  dt_graph *g = dt_graph_create(P, NULL);
  dt_tensor *y = b_linear(g, &c);
  const float *W = dt_params_data(P) + wi.offset, *B = dt_params_data(P) + bi.offset;
  double maxerr = 0;
  for (int i = 0; y && i < 4; i++)
    for (int o = 0; o < 3; o++) {
      double s = B[o];
      for (int k = 0; k < 5; k++) s += (double)x[i * 5 + k] * W[o * 5 + k];
      maxerr = fmax(maxerr, fabs(s - y->data[i * 3 + o]));
    }
  CHECK(y && maxerr < 1e-5);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

static void test_conv_layer(void) {
  dt_params *P = dt_params_create(2);
  dt_nn_conv2d l;
  CHECK(dt_nn_conv2d_init(&l, P, "conv", 2, 3, 3, 1, 1, 1) == DTRAIN_OK);
  float x[2 * 2 * 5 * 5];
  th_fill(x, 100, -1, 1);
  lctx c = {&l, x, 4, {2, 2, 5, 5}, NULL, 0};
  CHECK(param_gradcheck("conv2d", P, b_conv, &c) == 0);
  dt_params_destroy(P);
}

static void test_embedding_layer(void) {
  dt_params *P = dt_params_create(3);
  dt_nn_embedding l;
  CHECK(dt_nn_embedding_init(&l, P, "emb", 7, 4) == DTRAIN_OK);
  int32_t ids[6] = {1, 3, 1, 6, 0, 3};
  lctx c = {&l, NULL, 0, {0}, ids, 6};
  CHECK(param_gradcheck("embedding", P, b_embed, &c) == 0);
  dt_params_destroy(P);
}

static void test_norm_layers(void) {
  dt_params *P = dt_params_create(4);
  dt_nn_layer_norm ln;
  CHECK(dt_nn_layer_norm_init(&ln, P, "ln", 6) == DTRAIN_OK);
  th_fill(dt_params_data(P), dt_params_size(P), 0.5f, 1.5f); /* move gamma/beta off 1/0 */
  float x[3 * 6];
  th_fill(x, 18, -2, 2);
  lctx c = {&ln, x, 2, {3, 6}, NULL, 0};
  CHECK(param_gradcheck("layer_norm", P, b_layer_norm, &c) == 0);
  dt_params_destroy(P);

  P = dt_params_create(5);
  dt_nn_batch_norm bn;
  CHECK(dt_nn_batch_norm_init(&bn, P, "bn", 3) == DTRAIN_OK);
  dt_param_info mi;
  dt_params_info(P, bn.mean, &mi);
  CHECK(!mi.trainable && strcmp(mi.name, "bn.running_mean") == 0);
  float xb[4 * 3 * 2 * 2];
  th_fill(xb, 48, -2, 2);
  lctx cb = {&bn, xb, 4, {4, 3, 2, 2}, NULL, 0};
  CHECK(param_gradcheck("batch_norm", P, b_batch_norm, &cb) == 0);
  /* running stats moved, and received no gradient */
  CHECK(dt_params_data(P)[mi.offset] != 0.0f);
  CHECK(dt_params_grad(P)[mi.offset] == 0.0f);
  dt_params_destroy(P);
}

static float sigm(float v) { return 1.0f / (1.0f + expf(-v)); }

static void test_lstm_cell(void) {
  dt_params *P = dt_params_create(6);
  dt_nn_lstm_cell l;
  CHECK(dt_nn_lstm_cell_init(&l, P, "lstm", 3, 4) == DTRAIN_OK);
  dt_param_info bi;
  dt_params_info(P, l.b, &bi);
  CHECK(dt_params_data(P)[bi.offset + 4] == 1.0f && dt_params_data(P)[bi.offset] == 0.0f); /* forget bias */
  th_fill(dt_params_data(P) + bi.offset, 16, -0.5f, 0.5f);
  float x[3 * 2 * 3];
  th_fill(x, 18, -1, 1);
  lctx c = {&l, x, 3, {3, 2, 3}, NULL, 0}; /* T=3, N=2, in=3 */
  CHECK(param_gradcheck("lstm", P, b_lstm, &c) == 0);
  /* One step from zero state against a direct computation (gate order i,f,g,o). */
  dt_graph *g = dt_graph_create(P, NULL);
  int64_t xs[2] = {2, 3};
  dt_tensor *h1, *c1;
  CHECK(dt_nn_lstm_cell_forward(g, &l, dt_tensor_from(g, 2, xs, x), NULL, NULL, &h1, &c1) == DTRAIN_OK);
  dt_param_info wi;
  dt_params_info(P, l.w_ih, &wi);
  const float *W = dt_params_data(P) + wi.offset, *B = dt_params_data(P) + bi.offset;
  double maxerr = 0;
  for (int n = 0; h1 && n < 2; n++)
    for (int j = 0; j < 4; j++) {
      float z[4];
      for (int q = 0; q < 4; q++) {
        double s = B[q * 4 + j];
        for (int k = 0; k < 3; k++) s += (double)W[(q * 4 + j) * 3 + k] * x[n * 3 + k];
        z[q] = (float)s;
      }
      float cc = sigm(z[0]) * tanhf(z[2]);
      float hh = sigm(z[3]) * tanhf(cc);
      maxerr = fmax(maxerr, fabs(cc - c1->data[n * 4 + j]) + fabs(hh - h1->data[n * 4 + j]));
    }
  CHECK(h1 && maxerr < 1e-5);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

static void test_gru_cell(void) {
  dt_params *P = dt_params_create(7);
  dt_nn_gru_cell l;
  CHECK(dt_nn_gru_cell_init(&l, P, "gru", 3, 4) == DTRAIN_OK);
  float x[3 * 2 * 3];
  th_fill(x, 18, -1, 1);
  lctx c = {&l, x, 3, {3, 2, 3}, NULL, 0};
  CHECK(param_gradcheck("gru", P, b_gru, &c) == 0);
  dt_params_destroy(P);
}

static void test_attention(void) {
  dt_params *P = dt_params_create(8);
  dt_nn_attention l;
  CHECK(dt_nn_attention_init(&l, P, "attn", 8, 2) == DTRAIN_OK);
  float x[2 * 5 * 8];
  th_fill(x, 80, -1, 1);
  lctx c = {&l, x, 3, {2, 5, 8}, NULL, 0};
  CHECK(param_gradcheck("attention", P, b_attention, &c) == 0);
  /* Causality: changing the last time step leaves earlier outputs unchanged. */
  dt_graph *g = dt_graph_create(P, NULL);
  dt_tensor *y1 = b_attention(g, &c);
  float before[2 * 5 * 8];
  if (y1) memcpy(before, y1->data, sizeof before);
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < 8; k++) x[(b * 5 + 4) * 8 + k] += 1.0f;
  dt_graph_reset(g);
  dt_tensor *y2 = b_attention(g, &c);
  int same_early = 1, last_changed = 0;
  for (int b = 0; y1 && y2 && b < 2; b++)
    for (int t = 0; t < 5; t++)
      for (int k = 0; k < 8; k++) {
        int i = (b * 5 + t) * 8 + k;
        if (t < 4 && before[i] != y2->data[i]) same_early = 0;
        if (t == 4 && before[i] != y2->data[i]) last_changed = 1;
      }
  CHECK(y1 && y2 && same_early && last_changed);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

static void test_layer_errors(void) {
  dt_params *P = dt_params_create(9);
  dt_nn_linear l;
  CHECK_ERR(dt_nn_linear_init(&l, P, "fc", 0, 3, 1), DTRAIN_ERR_INVALID_ARG, "in=0");
  CHECK_ERR(dt_nn_linear_init(NULL, P, "fc", 2, 3, 1), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK(dt_nn_linear_init(&l, P, "fc", 2, 3, 1) == DTRAIN_OK);
  CHECK_ERR(dt_nn_linear_init(&l, P, "fc", 2, 3, 1), DTRAIN_ERR_INVALID_ARG, "'fc.weight' already used");
  dt_nn_attention a;
  CHECK_ERR(dt_nn_attention_init(&a, P, "att", 10, 3), DTRAIN_ERR_INVALID_ARG, "multiple of heads");
  dt_nn_conv2d cv;
  CHECK_ERR(dt_nn_conv2d_init(&cv, P, "cv", 1, 1, 3, 0, 0, 1), DTRAIN_ERR_INVALID_ARG, "stride=0");
  dt_graph *g = dt_graph_create(P, NULL);
  dt_tensor *x = dt_tensor_new2(g, 4, 5); /* fc expects 2 features */
  CHECK(dt_nn_linear_forward(g, &l, x) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE);
  CHECK(strstr(dt_graph_message(g), "dt_linear") != NULL);
  dt_graph_reset(g);
  CHECK(dt_param(g, 99) == NULL && dt_graph_error(g) == DTRAIN_ERR_INDEX);
  CHECK(strstr(dt_graph_message(g), "index 99 out of range") != NULL);
  dt_graph_destroy(g);
  g = dt_graph_create(NULL, NULL);
  CHECK(dt_param(g, 0) == NULL && dt_graph_error(g) == DTRAIN_ERR_STATE);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

int main(void) {
  th_seed(11);
  TH_RUN(test_linear_layer);
  TH_RUN(test_conv_layer);
  TH_RUN(test_embedding_layer);
  TH_RUN(test_norm_layers);
  TH_RUN(test_lstm_cell);
  TH_RUN(test_gru_cell);
  TH_RUN(test_attention);
  TH_RUN(test_layer_errors);
  return th_summary("nn");
}
