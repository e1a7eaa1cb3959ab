/* Single-device training: an MLP learns a fixed synthetic task, runs repeat
 * bitwise, steps allocate nothing after the first, no-grad mode, gradient
 * accumulation, and the XOR example's network. */
#include "harness.h"

/* ---- counting allocator -------------------------------------------------------- */
static long alloc_calls, free_calls;
static void *count_alloc(size_t size, size_t align, void *user) {
  (void)user;
  alloc_calls++;
  void *p = NULL;
  size_t rounded = (size + align - 1) / align * align;
  p = th_aligned_alloc(align, rounded);
  return p;
}
static void count_free(void *p, size_t size, void *user) {
  (void)size; (void)user;
  free_calls++;
  th_aligned_free(p);
}

/* ---- a fixed synthetic classification task ---------------------------------------
 * 3 classes in 8-D: class c has mean 1.5 on features 2c, 2c+1 plus noise. */
#define NS 256
#define NF 8
#define NC 3
static float data_x[NS * NF];
static int32_t data_y[NS];

static void make_data(void) {
  th_seed(1234);
  for (int i = 0; i < NS; i++) {
    int c = i % NC;
    data_y[i] = c;
    for (int f = 0; f < NF; f++) data_x[i * NF + f] = th_uniform(-1, 1) + ((f / 2 == c) ? 1.5f : 0.0f);
  }
}

typedef struct {
  dt_params *P;
  dt_nn_linear l1, l2, l3;
  dt_optim *opt;
  dt_graph *g;
} mlp;

static void mlp_init(mlp *m, uint64_t seed, dt_optim_kind kind, float lr) {
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 32, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 32, 16, 1);
  dt_nn_linear_init(&m->l3, m->P, "l3", 16, NC, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = lr;
  d.momentum = kind == DTRAIN_OPTIM_SGD ? 0.9f : 0.0f;
  m->opt = dt_optim_create(m->P, &d);
  m->g = dt_graph_create(m->P, NULL);
}

static void mlp_free(mlp *m) {
  dt_graph_destroy(m->g);
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

static dt_tensor *mlp_loss(mlp *m, int start, int batch) {
  dt_graph *g = m->g;
  int64_t xs[2];
  xs[0] = batch; xs[1] = NF;
  dt_tensor *x = dt_tensor_from(g, 2, xs, data_x + start * NF);
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, x));
  h = dt_gelu(g, dt_nn_linear_forward(g, &m->l2, h));
  dt_tensor *logits = dt_nn_linear_forward(g, &m->l3, h);
  return dt_cross_entropy(g, logits, data_y + start);
}

/* One optimizer step on rows [start, start+batch). Returns the loss (NaN on error). */
static float mlp_step(mlp *m, int start, int batch) {
  dt_graph_reset(m->g);
  dt_params_zero_grad(m->P);
  dt_tensor *L = mlp_loss(m, start, batch);
  if (dt_backward(m->g, L) != DTRAIN_OK) return NAN;
  if (dt_optim_step(m->opt) != DTRAIN_OK) return NAN;
  return dt_item(L);
}

static float train(mlp *m, int epochs, int batch) {
  float last = NAN;
  for (int e = 0; e < epochs; e++)
    for (int s = 0; s + batch <= NS; s += batch) last = mlp_step(m, s, batch);
  return last;
}

static double accuracy(mlp *m) {
  dt_graph_reset(m->g);
  int old = dt_graph_set_grad_enabled(m->g, 0);
  int64_t xs[2] = {NS, NF};
  dt_tensor *x = dt_tensor_from(m->g, 2, xs, data_x);
  dt_tensor *h = dt_relu(m->g, dt_nn_linear_forward(m->g, &m->l1, x));
  h = dt_gelu(m->g, dt_nn_linear_forward(m->g, &m->l2, h));
  dt_tensor *lg = dt_nn_linear_forward(m->g, &m->l3, h);
  dt_graph_set_grad_enabled(m->g, old);
  if (!lg) return 0;
  int ok = 0;
  for (int i = 0; i < NS; i++) {
    int best = 0;
    for (int c = 1; c < NC; c++)
      if (lg->data[i * NC + c] > lg->data[i * NC + best]) best = c;
    ok += best == data_y[i];
  }
  return (double)ok / NS;
}

static void test_mlp_learns(void) {
  const dt_optim_kind kinds[4] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_ADAMW, DTRAIN_OPTIM_RMSPROP};
  const float lrs[4] = {0.05f, 0.01f, 0.01f, 0.005f};
  for (int k = 0; k < 4; k++) {
    mlp m;
    mlp_init(&m, 7, kinds[k], lrs[k]);
    float first = mlp_step(&m, 0, 32);
    float last = train(&m, 30, 32);
    double acc = accuracy(&m);
    CHECK_MSG(first > 0.9f && last < 0.15f && acc > 0.95, "optimizer %d: first loss %g, last %g, accuracy %g", k,
              first, last, acc);
    mlp_free(&m);
  }
}

static void test_bitwise_repeatable(void) {
  mlp a, b, c;
  mlp_init(&a, 99, DTRAIN_OPTIM_ADAM, 0.01f);
  mlp_init(&b, 99, DTRAIN_OPTIM_ADAM, 0.01f);
  mlp_init(&c, 100, DTRAIN_OPTIM_ADAM, 0.01f);
  CHECK(dt_params_checksum(a.P) == dt_params_checksum(b.P));
  CHECK(dt_params_checksum(a.P) != dt_params_checksum(c.P));
  train(&a, 3, 16);
  train(&b, 3, 16);
  CHECK(dt_params_checksum(a.P) == dt_params_checksum(b.P));
  CHECK(memcmp(dt_params_data(a.P), dt_params_data(b.P), dt_params_size(a.P) * sizeof(float)) == 0);
  mlp_free(&a);
  mlp_free(&b);
  mlp_free(&c);
}

/* A step with conv, pooling, batch norm, dropout, LSTM and attention too. */
typedef struct {
  dt_params *P;
  dt_nn_conv2d conv;
  dt_nn_batch_norm bn;
  dt_nn_linear fc;
  dt_nn_lstm_cell lstm;
  dt_nn_attention att;
  dt_nn_layer_norm ln;
  dt_optim *opt;
  dt_graph *g;
} big;

static float big_step(big *m, const float *img, const float *seq) {
  dt_graph *g = m->g;
  dt_graph_reset(g);
  dt_params_zero_grad(m->P);
  int64_t is[4] = {4, 1, 8, 8}, ss[3] = {2, 4, 8}, xs[2] = {2, 8};
  static const int32_t labels[4] = {0, 1, 2, 1};
  dt_tensor *x = dt_tensor_from(g, 4, is, img);
  dt_tensor *h = dt_relu(g, dt_nn_batch_norm_forward(g, &m->bn, dt_nn_conv2d_forward(g, &m->conv, x)));
  h = dt_dropout(g, dt_max_pool2d(g, h, 2, 2), 0.1f);
  dt_tensor *loss1 = dt_cross_entropy(g, dt_nn_linear_forward(g, &m->fc, dt_flatten(g, h)), labels);
  dt_tensor *s = dt_tensor_from(g, 3, ss, seq);
  dt_tensor *a = dt_nn_layer_norm_forward(g, &m->ln, dt_nn_attention_forward(g, &m->att, s));
  dt_tensor *hh = NULL, *cc = NULL;
  for (int t = 0; t < 3; t++) {
    dt_tensor *h2 = NULL, *c2 = NULL;
    dt_nn_lstm_cell_forward(g, &m->lstm, dt_tensor_from(g, 2, xs, seq + t * 16), hh, cc, &h2, &c2);
    hh = h2;
    cc = c2;
  }
  dt_tensor *loss = dt_add(g, loss1, dt_add(g, dt_mean(g, dt_mul(g, a, a)), dt_mean(g, hh)));
  if (dt_backward(g, loss) != DTRAIN_OK) {
    fprintf(stderr, "big_step: %s\n", dt_graph_message(g));
    return NAN;
  }
  dt_optim_step(m->opt);
  return dt_item(loss);
}

/* A step that outgrows the first arena block: the next reset merges the
 * blocks into one of the step's peak (not the doubling blocks' sum, nearly
 * twice it), and the steps after allocate nothing and stay that size. */
static void test_arena_merges_to_peak(void) {
  mlp m;
  mlp_init(&m, 5, DTRAIN_OPTIM_ADAM, 0.01f);
  dt_graph_destroy(m.g);
  dt_graph_desc gd;
  memset(&gd, 0, sizeof gd);
  gd.arena_bytes = 1024; /* many blocks in the first step */
  m.g = dt_graph_create(m.P, &gd);
  mlp_step(&m, 0, 64);
  size_t first = dt_graph_bytes_reserved(m.g), peak = dt_graph_bytes_peak(m.g);
  CHECK_MSG(first > peak, "first step: %zu reserved, peak %zu", first, peak);
  for (int i = 0; i < 3; i++) {
    mlp_step(&m, 64, 64);
    CHECK_MSG(dt_graph_bytes_reserved(m.g) == peak && dt_graph_bytes_peak(m.g) == peak, "%zu reserved, peak %zu",
              dt_graph_bytes_reserved(m.g), dt_graph_bytes_peak(m.g));
  }
  mlp_free(&m);
}

static void test_no_allocation_after_first_step(void) {
  dt_allocator al = {count_alloc, count_free, NULL};
  dt_set_allocator(&al);
  alloc_calls = free_calls = 0;
  {
    mlp m;
    mlp_init(&m, 5, DTRAIN_OPTIM_ADAM, 0.01f);
    CHECK(alloc_calls > 0); /* the hook really is in use */
    mlp_step(&m, 0, 32);
    mlp_step(&m, 32, 32);   /* the first reset may merge arena blocks */
    long before = alloc_calls;
    for (int i = 0; i < 10; i++) mlp_step(&m, (i % 8) * 32, 32);
    CHECK_MSG(alloc_calls == before, "MLP steps allocated %ld times", alloc_calls - before);
    mlp_free(&m);
  }
  {
    big m;
    m.P = dt_params_create(3);
    dt_nn_conv2d_init(&m.conv, m.P, "conv", 1, 4, 3, 1, 1, 1);
    dt_nn_batch_norm_init(&m.bn, m.P, "bn", 4);
    dt_nn_linear_init(&m.fc, m.P, "fc", 4 * 4 * 4, 3, 1);
    dt_nn_lstm_cell_init(&m.lstm, m.P, "lstm", 8, 6);
    dt_nn_attention_init(&m.att, m.P, "att", 8, 2);
    dt_nn_layer_norm_init(&m.ln, m.P, "ln", 8);
    dt_optim_options d;
    memset(&d, 0, sizeof d);
    d.kind = DTRAIN_OPTIM_ADAMW;
    d.weight_decay = 0.01f;
    d.clip_norm = 1.0f;
    m.opt = dt_optim_create(m.P, &d);
    m.g = dt_graph_create(m.P, NULL);
    float img[4 * 64], seq[2 * 4 * 8];
    th_fill(img, 256, -1, 1);
    th_fill(seq, 64, -1, 1);
    float l0 = big_step(&m, img, seq);
    big_step(&m, img, seq);
    long before = alloc_calls;
    float l = 0;
    for (int i = 0; i < 5; i++) l = big_step(&m, img, seq);
    CHECK(isfinite(l0) && isfinite(l) && l < l0);
    CHECK_MSG(alloc_calls == before, "conv/lstm/attention steps allocated %ld times", alloc_calls - before);
    dt_graph_destroy(m.g);
    dt_optim_destroy(m.opt);
    dt_params_destroy(m.P);
  }
  CHECK_MSG(alloc_calls == free_calls, "%ld allocations, %ld frees", alloc_calls, free_calls);
  dt_set_allocator(NULL);
}

static void test_no_grad_mode(void) {
  mlp m;
  mlp_init(&m, 5, DTRAIN_OPTIM_SGD, 0.1f);
  dt_graph_reset(m.g);
  CHECK(dt_graph_set_grad_enabled(m.g, 0) == 1);
  dt_tensor *L = mlp_loss(&m, 0, 16);
  CHECK(L && isfinite(dt_item(L)));
  CHECK(dt_backward(m.g, L) == DTRAIN_ERR_STATE);
  CHECK(strstr(dt_graph_message(m.g), "no-grad") != NULL);
  dt_graph_set_grad_enabled(m.g, 1);
  /* backward twice in one step is refused */
  dt_graph_reset(m.g);
  L = mlp_loss(&m, 0, 16);
  CHECK(dt_backward(m.g, L) == DTRAIN_OK);
  CHECK(dt_backward(m.g, L) == DTRAIN_ERR_STATE);
  mlp_free(&m);
}

static void test_grad_accumulation(void) {
  /* grad of mean loss over 32 rows == average of grads of two 16-row halves */
  mlp a, b;
  mlp_init(&a, 21, DTRAIN_OPTIM_SGD, 0.1f);
  mlp_init(&b, 21, DTRAIN_OPTIM_SGD, 0.1f);
  dt_params_zero_grad(a.P);
  dt_graph_reset(a.g);
  CHECK(dt_backward(a.g, mlp_loss(&a, 0, 32)) == DTRAIN_OK);
  dt_params_zero_grad(b.P);
  for (int h = 0; h < 2; h++) {
    dt_graph_reset(b.g);
    CHECK(dt_backward(b.g, mlp_loss(&b, h * 16, 16)) == DTRAIN_OK);
  }
  dt_params_scale_grad(b.P, 0.5f);
  size_t n = dt_params_size(a.P);
  double maxd = 0, maxg = 0;
  for (size_t i = 0; i < n; i++) {
    maxd = fmax(maxd, fabs(dt_params_grad(a.P)[i] - dt_params_grad(b.P)[i]));
    maxg = fmax(maxg, fabs(dt_params_grad(a.P)[i]));
  }
  CHECK_MSG(maxg > 1e-3 && maxd <= 1e-6 * fmax(1.0, maxg) + 1e-7, "max diff %g (max grad %g)", maxd, maxg);
  mlp_free(&a);
  mlp_free(&b);
}

static void test_xor(void) {
  static const float X[8] = {0, 0, 0, 1, 1, 0, 1, 1}, Y[4] = {0, 1, 1, 0};
  dt_params *P = dt_params_create(42);
  dt_nn_linear h, o;
  dt_nn_linear_init(&h, P, "hidden", 2, 8, 1);
  dt_nn_linear_init(&o, P, "out", 8, 1, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.05f;
  dt_optim *opt = dt_optim_create(P, &d);
  dt_graph *g = dt_graph_create(P, NULL);
  int64_t xs[2] = {4, 2}, ys[2] = {4, 1};
  float loss = 1;
  dt_tensor *pred = NULL;
  for (int s = 0; s < 2000; s++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *x = dt_tensor_from(g, 2, xs, X), *y = dt_tensor_from(g, 2, ys, Y);
    pred = dt_sigmoid(g, dt_nn_linear_forward(g, &o, dt_tanh(g, dt_nn_linear_forward(g, &h, x))));
    dt_tensor *L = dt_mse(g, pred, y);
    if (dt_backward(g, L) != DTRAIN_OK) break;
    dt_optim_step(opt);
    loss = dt_item(L);
  }
  CHECK_MSG(loss < 1e-3f, "XOR loss %g", loss);
  for (int i = 0; pred && i < 4; i++) CHECK(fabsf(pred->data[i] - Y[i]) < 0.1f);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  make_data();
  TH_RUN(test_mlp_learns);
  TH_RUN(test_bitwise_repeatable);
  TH_RUN(test_no_allocation_after_first_step);
  TH_RUN(test_arena_merges_to_peak);
  TH_RUN(test_no_grad_mode);
  TH_RUN(test_grad_accumulation);
  TH_RUN(test_xor);
  return th_summary("train");
}
