/* dt_linear_relu and dt_nn_linear_relu_forward (the bias and the ReLU
 * applied by the GEMM, tile by tile; backward's mask and bias sum in one
 * pass): gradients against finite differences; the same values and
 * gradients as dt_relu_inplace(dt_linear), bit for bit, on every GEMM path
 * the CPU has and at 1-3 intra-op threads, for shapes that take each way
 * through dt_sgemm (full and edge tiles, several k blocks, the few-rows and
 * the many-panels loops, the unpacked dot kernels, 3-D inputs, no bias);
 * NaN, -0 and exact zeros among the pre-activations; both against a plain
 * reference (dt_linear's bias is added by the GEMM's tiles too); refusals;
 * and an MLP trained fused and unfused. */
#include "harness.h"

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static dt_tensor *f_fused(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_linear_relu(g, in[0], in[1], in[2]);
}
static dt_tensor *f_fused_nobias(dt_graph *g, dt_tensor **in, void *ctx) {
  (void)ctx;
  return dt_linear_relu(g, in[0], in[1], NULL);
}

static void test_gradcheck(void) {
  th_seed(3);
  float x[6 * 7], w[5 * 7], b[5];
  th_fill(x, 42, -1, 1);
  th_fill(w, 35, -1, 1);
  th_fill(b, 5, -0.3f, 0.3f);
  int64_t sx[2] = {6, 7}, sw[2] = {5, 7}, sb[1] = {5};
  th_input in[3] = {th_in(x, 2, sx, 1), th_in(w, 2, sw, 1), th_in(b, 1, sb, 1)};
  CHECK(th_gradcheck("linear_relu", f_fused, NULL, in, 3) == 0);
  CHECK(th_gradcheck("linear_relu, no bias", f_fused_nobias, NULL, in, 2) == 0);
  int64_t s3[3] = {2, 3, 7}; /* [..., in] */
  th_input in3[3] = {th_in(x, 3, s3, 1), th_in(w, 2, sw, 1), th_in(b, 1, sb, 1)};
  CHECK(th_gradcheck("linear_relu, 3-D x", f_fused, NULL, in3, 3) == 0);
}

/* One forward and backward of f(x @ w^T + b) with r as y's gradient, fused or not, on
 * fresh copies of the inputs: y, dx, dw, db into out (y->size + x + w + b). */
typedef struct shape {
  int64_t rows, in, out;
  int bias, nan_row, zero_row;
  int x86_only; /* a way only the x86 paths take (the flipped product): not under an emulator */
} shape;

static int run_once(const shape *s, const float *x, const float *w, const float *b, const float *r, int fused,
                    float *out) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t sx[2] = {s->rows, s->in}, sw[2] = {s->out, s->in}, sb[1] = {s->out};
  dt_tensor *tx = dt_tensor_from(g, 2, sx, x), *tw = dt_tensor_from(g, 2, sw, w);
  dt_tensor *tb = s->bias ? dt_tensor_from(g, 1, sb, b) : NULL;
  dt_tensor_set_requires_grad(tx, 1);
  dt_tensor_set_requires_grad(tw, 1);
  if (tb) dt_tensor_set_requires_grad(tb, 1);
  dt_tensor *y = fused ? dt_linear_relu(g, tx, tw, tb) : dt_relu_inplace(g, dt_linear(g, tx, tw, tb));
  int ok = y != NULL && dt_backward_grad(g, y, r) == DTRAIN_OK && tx->grad && tw->grad &&
           (!tb || tb->grad);
  CHECK_MSG(ok, "%s: %s", fused ? "fused" : "unfused", dt_graph_message(g));
  if (ok) {
    size_t ny = (size_t)(s->rows * s->out), nx = (size_t)(s->rows * s->in), nw = (size_t)(s->out * s->in);
    memcpy(out, y->data, ny * sizeof(float));
    memcpy(out + ny, tx->grad, nx * sizeof(float));
    memcpy(out + ny + nx, tw->grad, nw * sizeof(float));
    if (tb) memcpy(out + ny + nx + nw, tb->grad, (size_t)s->out * sizeof(float));
  }
  dt_graph_destroy(g);
  return ok;
}

static const char *const isa_names[] = {"portable", "avx2", "avx512", "neon"};

static void test_same_as_unfused(void) {
  /* KC is 256, MC 96, NC 768 (192 on the stack: test_gemm_panels); MR 6 or 8, NR 8-32 by path */
  static const shape shapes[] = {
      {64, 784, 256, 1, 0, 0, 0}, /* an MLP's first layer: full tiles, 4 k blocks (the AVX2 dot kernel) */
      {256, 256, 128, 1, 0, 5, 0}, /* b256: 4-row edges on no path, a zero row (pre-activation = bias) */
      {7, 300, 10, 1, 0, 0, 0},   /* few columns: the unpacked dot kernels */
      {13, 5, 37, 1, 0, 0, 0},    /* edge tiles, one short k block */
      {100, 9, 900, 1, 0, 0, 0},  /* few rows, B wider than NC: the pc -> jc loop */
      {200, 8, 1700, 1, 0, 0, 0}, /* more than 2 MC rows, three B panels */
      {31, 257, 70, 0, 0, 0, 0},  /* no bias; a k block of 1 */
      {24, 200, 600, 1, 0, 0, 0}, /* more column tiles than row tiles: threads split the columns */
      {12, 20, 40, 1, 3, 4, 0},   /* a NaN row and a zero row */
      {32, 784, 256, 1, 0, 2, 1}, /* 32 or 16 rows: flipped on x86 ((W @ x^T)^T, dt_gemm.c) */
      {16, 300, 600, 1, 5, 0, 1}, /* flipped in two blocks of W's rows, a NaN row */
  };
  int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  for (int si = 0; si < nshapes; si++) {
    const shape *s = &shapes[si];
    if (s->x86_only && th_emulated()) continue; /* qemu runs the portable path: nothing new there */
    size_t nx = (size_t)(s->rows * s->in), nw = (size_t)(s->out * s->in), ny = (size_t)(s->rows * s->out);
    size_t total = ny + nx + nw + (size_t)s->out;
    float *x = (float *)malloc(nx * sizeof(float)), *w = (float *)malloc(nw * sizeof(float));
    float *b = (float *)malloc((size_t)s->out * sizeof(float)), *r = (float *)malloc(ny * sizeof(float));
    float *ref = (float *)calloc(total, sizeof(float)), *got = (float *)calloc(total, sizeof(float));
    th_seed((uint64_t)(11 + si));
    th_fill(x, (int)nx, -1, 1);
    th_fill(w, (int)nw, -0.2f, 0.2f);
    th_fill(b, (int)s->out, -0.5f, 0.5f);
    th_fill(r, (int)ny, -1, 1);
    b[0] = -0.0f; /* with a zero row: a -0 pre-activation */
    if (s->zero_row) memset(x + s->zero_row * s->in, 0, (size_t)s->in * sizeof(float));
    if (s->nan_row) x[s->nan_row * s->in + 1] = NAN;
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue; /* test_speed reports the paths it lacks */
      for (int threads = 1; threads <= th_sweep_threads(3); threads++) {
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        memset(ref, 0, total * sizeof(float));
        memset(got, 0, total * sizeof(float));
        if (!run_once(s, x, w, b, r, 0, ref) || !run_once(s, x, w, b, r, 1, got)) continue;
        CHECK_MSG(same_bits(ref, got, ny), "y: %lldx%lld->%lld, %s, %d threads", (long long)s->rows,
                  (long long)s->in, (long long)s->out, isa_names[ii], threads);
        CHECK_MSG(same_bits(ref + ny, got + ny, total - ny), "gradients: %lldx%lld->%lld, %s, %d threads",
                  (long long)s->rows, (long long)s->in, (long long)s->out, isa_names[ii], threads);
        /* the ReLU happened: no negative output; the NaN row is NaN; the zero row is relu(bias) */
        int64_t neg = 0;
        for (size_t i = 0; i < ny; i++) neg += got[i] < 0;
        CHECK(neg == 0);
        if (s->nan_row) CHECK(isnan(got[s->nan_row * s->out]));
        if (s->zero_row)
          for (int64_t o = 0; o < s->out; o++)
            CHECK(got[s->zero_row * s->out + o] == (b[o] > 0 ? b[o] : 0.0f) &&
                  !signbit(got[s->zero_row * s->out + o]));
      }
    }
    dt_set_threads(1);
    dt_sgemm_use_isa("best");
    free(x), free(w), free(b), free(r), free(ref), free(got);
  }
}

/* dt_linear's forward (its bias now added to each tile before the tile's
 * product) and dt_linear_relu's against a plain double-precision reference,
 * on each path at 1-3 threads: both could otherwise agree on a wrong bias.
 * 24x200->600 splits the columns over the threads; 37x300->45 the rows;
 * 32x200->300 runs flipped on one thread, in two blocks. */
static void test_against_reference(void) {
  static const int64_t dims[3][3] = {{37, 300, 45}, {24, 200, 600}, {32, 200, 300}};
  for (int di = 0; di < (th_emulated() ? 2 : 3); di++) { /* the flipped one only where x86 paths run */
    int64_t R = dims[di][0], I = dims[di][1], O = dims[di][2];
    float *x = (float *)malloc((size_t)(R * I) * sizeof(float)), *w = (float *)malloc((size_t)(O * I) * sizeof(float));
    float *b = (float *)malloc((size_t)O * sizeof(float));
    double *ref = (double *)malloc((size_t)(R * O) * sizeof(double));
    th_seed((uint64_t)(21 + di));
    th_fill(x, R * I, -1, 1);
    th_fill(w, O * I, -1, 1);
    th_fill(b, O, -10, 10);
    for (int64_t i = 0; i < R; i++)
      for (int64_t o = 0; o < O; o++) {
        double sum = b[o];
        for (int64_t p = 0; p < I; p++) sum += (double)x[i * I + p] * w[o * I + p];
        ref[i * O + o] = sum;
      }
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue;
      for (int threads = 1; threads <= th_sweep_threads(3); threads++) {
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        for (int relu = 0; relu < 2; relu++) {
          dt_graph *g = dt_graph_create(NULL, NULL);
          int64_t sx[2] = {R, I}, sw[2] = {O, I}, sb[1] = {O};
          dt_tensor *tx = dt_tensor_from(g, 2, sx, x), *tw = dt_tensor_from(g, 2, sw, w);
          dt_tensor *tb = dt_tensor_from(g, 1, sb, b);
          dt_tensor *y = relu ? dt_linear_relu(g, tx, tw, tb) : dt_linear(g, tx, tw, tb);
          CHECK(y != NULL);
          double worst = 0;
          for (int64_t i = 0; y && i < R * O; i++) {
            double want = relu && ref[i] < 0 ? 0.0 : ref[i], e = fabs(y->data[i] - want);
            if (e > worst) worst = e;
          }
          CHECK_MSG(worst < 1e-3, "%s, %lldx%lld->%lld, %s, %d threads: worst error %g", relu ? "dt_linear_relu" : "dt_linear",
                    (long long)R, (long long)I, (long long)O, isa_names[ii], threads, worst);
          dt_graph_destroy(g);
        }
      }
    }
    dt_set_threads(1);
    dt_sgemm_use_isa("best");
    free(x), free(w), free(b), free(ref);
  }
}

static void test_refusals(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t sx[2] = {4, 3}, sw[2] = {5, 3}, sw2[2] = {5, 4}, sb[1] = {5}, sb2[1] = {6};
  dt_tensor *x = dt_tensor_new(g, 2, sx), *w = dt_tensor_new(g, 2, sw);
  CHECK(dt_linear_relu(g, x, dt_tensor_new(g, 2, sw2), NULL) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE && strstr(dt_graph_message(g), "dt_linear_relu: weight [5,4]"));
  dt_graph_reset(g);
  x = dt_tensor_new(g, 2, sx);
  w = dt_tensor_new(g, 2, sw);
  CHECK(dt_linear_relu(g, x, w, dt_tensor_new(g, 1, sb2)) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE && strstr(dt_graph_message(g), "bias [6]"));
  dt_graph_reset(g);
  x = dt_tensor_new(g, 2, sx);
  w = dt_tensor_new(g, 2, sw);
  CHECK(dt_linear_relu(g, x, NULL, NULL) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  dt_graph_reset(g);
  /* its result is not free to overwrite: backward reads it */
  x = dt_tensor_new(g, 2, sx);
  w = dt_tensor_new(g, 2, sw);
  dt_tensor *y = dt_linear_relu(g, x, w, dt_tensor_new(g, 1, sb));
  CHECK(y != NULL);
  CHECK(dt_relu_inplace(g, y) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "dt_linear_relu"));
  dt_graph_reset(g);
  CHECK(dt_nn_linear_relu_forward(g, NULL, dt_tensor_new(g, 2, sx)) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  dt_graph_destroy(g);
}

/* An MLP 20-32-16-3 trained 20 Adam steps with dt_nn_linear_relu_forward and
 * with dt_nn_linear_forward + dt_relu_inplace: the same weights, bit for bit. */
static void test_training_same(void) {
  enum { N = 24 };
  static float xs[N * 20];
  static int32_t ys[N];
  th_seed(4);
  th_fill(xs, N * 20, -1, 1);
  for (int i = 0; i < N; i++) ys[i] = i % 3;
  float *final[2] = {NULL, NULL};
  size_t np = 0;
  for (int fused = 0; fused < 2; fused++) {
    dt_params *P = dt_params_create(7);
    dt_nn_linear l1, l2, l3;
    dt_nn_linear_init(&l1, P, "l1", 20, 32, 1);
    dt_nn_linear_init(&l2, P, "l2", 32, 16, 1);
    dt_nn_linear_init(&l3, P, "l3", 16, 3, 1);
    dt_optim_options oo = dt_optim_defaults(DTRAIN_OPTIM_ADAM);
    oo.lr = 0.01f;
    dt_optim *opt = dt_optim_create(P, &oo);
    for (int step = 0; step < 20; step++) {
      dt_graph *g = dt_graph_create(P, NULL);
      int64_t sx[2] = {N, 20};
      dt_tensor *h = dt_tensor_wrap(g, 2, sx, xs);
      h = fused ? dt_nn_linear_relu_forward(g, &l1, h) : dt_relu_inplace(g, dt_nn_linear_forward(g, &l1, h));
      h = fused ? dt_nn_linear_relu_forward(g, &l2, h) : dt_relu_inplace(g, dt_nn_linear_forward(g, &l2, h));
      dt_params_zero_grad(P);
      CHECK(dt_backward(g, dt_cross_entropy(g, dt_nn_linear_forward(g, &l3, h), ys)) == DTRAIN_OK);
      CHECK(dt_optim_step(opt) == DTRAIN_OK);
      dt_graph_destroy(g);
    }
    np = dt_params_size(P);
    final[fused] = (float *)malloc(np * sizeof(float));
    memcpy(final[fused], dt_params_data(P), np * sizeof(float));
    dt_optim_destroy(opt);
    dt_params_destroy(P);
  }
  CHECK(same_bits(final[0], final[1], np));
  free(final[0]);
  free(final[1]);
}

int main(void) {
  TH_RUN(test_gradcheck);
  TH_RUN(test_same_as_unfused);
  TH_RUN(test_against_reference);
  TH_RUN(test_refusals);
  TH_RUN(test_training_same);
  return th_summary("linear_relu");
}
