/* dt_conv2d_relu and dt_nn_conv2d_relu_forward (the bias and the ReLU applied
 * by the GEMM's epilogue tile by tile, or by Winograd's output transform;
 * backward's mask and bias sum channel by channel in one pass): gradients
 * against finite differences; the same values and gradients as
 * dt_relu_inplace(dt_conv2d), bit for bit, on every GEMM path the CPU has and
 * at 1-3 intra-op threads, for shapes that take each way through the
 * convolution (one image at a time, images grouped, 1x1 direct, stride 2,
 * Winograd, the GEMM's column and row thread splits), with NaN, -0 and zero
 * planes, a bias that wants no gradient and none at all; both against a
 * double-precision reference (dt_conv2d's bias goes through the epilogue
 * too); the epilogue's per-row bias (dt__sgemm_epi) on every way through
 * dt_sgemm, the unpacked dot kernels included; refusals; and a small CNN
 * trained fused and unfused. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static const char *const isa_names[] = {"portable", "avx2", "avx512", "neon"};

static dt_tensor *f_fused(dt_graph *g, dt_tensor **in, void *ctx) {
  int *sp = (int *)ctx;
  return dt_conv2d_relu(g, in[0], in[1], in[2], sp[0], sp[1]);
}
static dt_tensor *f_fused_nobias(dt_graph *g, dt_tensor **in, void *ctx) {
  int *sp = (int *)ctx;
  return dt_conv2d_relu(g, in[0], in[1], NULL, sp[0], sp[1]);
}

/* The smallest |pre-activation| of conv(x, w, b): finite differences of
 * step 1e-3 across a ReLU's kink measure neither side's slope, so the
 * gradchecks take inputs whose pre-activations all keep clear of 0. */
static double min_preact(float *x, const int64_t *sx, float *w, const int64_t *sw, float *b, int stride, int pad) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t sb[1] = {sw[0]};
  dt_tensor *y = dt_conv2d(g, dt_tensor_from(g, 4, sx, x), dt_tensor_from(g, 4, sw, w),
                           b ? dt_tensor_from(g, 1, sb, b) : NULL, stride, pad);
  double m = y ? INFINITY : 0;
  for (int64_t i = 0; y && i < y->size; i++) m = fmin(m, fabs((double)y->data[i]));
  dt_graph_destroy(g);
  return m;
}

/* x, w and b filled from the first seed from 100 up whose pre-activations
 * (with and without b) keep margin clear of 0 under both (stride, padding):
 * more than a step of the gradcheck moves any of them. */
static int fill_clear(float *x, const int64_t *sx, float *w, const int64_t *sw, float *b, const int *sp,
                      const int *sp2, double margin) {
  int64_t nx = sx[0] * sx[1] * sx[2] * sx[3], nw = sw[0] * sw[1] * sw[2] * sw[3];
  for (uint64_t seed = 100; seed < 5000; seed++) {
    th_seed(seed);
    th_fill(x, (int)nx, -1, 1);
    th_fill(w, (int)nw, -0.5f, 0.5f);
    th_fill(b, (int)sw[0], -0.3f, 0.3f);
    if (min_preact(x, sx, w, sw, b, sp[0], sp[1]) > margin && min_preact(x, sx, w, sw, NULL, sp[0], sp[1]) > margin &&
        min_preact(x, sx, w, sw, b, sp2[0], sp2[1]) > margin)
      return 1;
  }
  return 0;
}

static void test_gradcheck(void) {
  /* im2col: 2x3x6x6, 4 kernels 3x3, stride 1 padding 1, and stride 2 padding 0 */
  float x[2 * 3 * 6 * 6], w[4 * 3 * 3 * 3], b[4];
  int64_t sx[4] = {2, 3, 6, 6}, sw[4] = {4, 3, 3, 3}, sb[1] = {4};
  int sp[2] = {1, 1}, sp2[2] = {2, 0};
  CHECK(fill_clear(x, sx, w, sw, b, sp, sp2, 0.01)); /* steps of 1e-3 times |x|, |w| <= 1 */
  th_input in[3] = {th_in(x, 4, sx, 1), th_in(w, 4, sw, 1), th_in(b, 1, sb, 1)};
  CHECK(th_gradcheck("conv2d_relu", f_fused, sp, in, 3) == 0);
  CHECK(th_gradcheck("conv2d_relu, no bias", f_fused_nobias, sp, in, 2) == 0);
  CHECK(th_gradcheck("conv2d_relu, stride 2", f_fused, sp2, in, 3) == 0);
  /* Winograd (5x5 kernels, 8 channels in and out), which rounds more: a step
   * of 5e-2 (test_ops_conv's) divides that noise, so a wider margin */
  static float xw[1 * 8 * 4 * 5], ww[8 * 8 * 5 * 5], bw[8];
  int64_t sxw[4] = {1, 8, 4, 5}, sww[4] = {8, 8, 5, 5}, sbw[1] = {8};
  int spw[2] = {1, 2};
  CHECK(fill_clear(xw, sxw, ww, sww, bw, spw, spw, 0.06));
  th_input inw[3] = {th_in(xw, 4, sxw, 1), th_in(ww, 4, sww, 1), th_in(bw, 1, sbw, 1)};
  double eps = th_gc_eps;
  th_gc_eps = 5e-2;
  CHECK(th_gradcheck("conv2d_relu, Winograd", f_fused, spw, inw, 3) == 0);
  th_gc_eps = eps;
}

/* One convolution (N,C,H,W -> O channels, k x k, stride, padding) and its
 * special inputs. bias: 0 none, 1 wanting a gradient, 2 wanting none. */
typedef struct shape {
  int64_t n, c, h, w, o, k;
  int stride, pad, bias, nan_plane, zero_plane;
  const char *why;
} shape;

static int64_t out_size(const shape *s) {
  int64_t ho = (s->h + 2 * s->pad - s->k) / s->stride + 1, wo = (s->w + 2 * s->pad - s->k) / s->stride + 1;
  return s->n * s->o * ho * wo;
}

/* One forward and backward with r as y's gradient, fused or not, on fresh
 * copies of the inputs: y, dx, dw, db into out. */
static int run_once(const shape *s, const float *x, const float *w, const float *b, const float *r, int fused,
                    float *out) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t sx[4] = {s->n, s->c, s->h, s->w}, sw[4] = {s->o, s->c, s->k, s->k}, sb[1] = {s->o};
  dt_tensor *tx = dt_tensor_from(g, 4, sx, x), *tw = dt_tensor_from(g, 4, sw, w);
  dt_tensor *tb = s->bias ? dt_tensor_from(g, 1, sb, b) : NULL;
  dt_tensor_set_requires_grad(tx, 1);
  dt_tensor_set_requires_grad(tw, 1);
  if (tb && s->bias == 1) dt_tensor_set_requires_grad(tb, 1);
  dt_tensor *y = fused ? dt_conv2d_relu(g, tx, tw, tb, s->stride, s->pad)
                       : dt_relu_inplace(g, dt_conv2d(g, tx, tw, tb, s->stride, s->pad));
  int ok = y != NULL && dt_backward_grad(g, y, r) == DTRAIN_OK && tx->grad && tw->grad && (s->bias != 1 || tb->grad);
  CHECK_MSG(ok, "%s: %s: %s", s->why, fused ? "fused" : "unfused", dt_graph_message(g));
  if (ok) {
    size_t ny = (size_t)out_size(s), nx = (size_t)(s->n * s->c * s->h * s->w), nw = (size_t)(s->o * s->c * s->k * s->k);
    memcpy(out, y->data, ny * sizeof(float));
    memcpy(out + ny, tx->grad, nx * sizeof(float));
    memcpy(out + ny + nx, tw->grad, nw * sizeof(float));
    if (s->bias == 1) memcpy(out + ny + nx + nw, tb->grad, (size_t)s->o * sizeof(float));
  }
  dt_graph_destroy(g);
  return ok;
}

static void test_same_as_unfused(void) {
  static const shape shapes[] = {
      {3, 1, 28, 28, 32, 5, 1, 2, 1, 0, 2, "the CNN's conv1: one image at a time, over the threads"},
      {4, 8, 9, 9, 8, 5, 1, 2, 1, 3, 1, "Winograd, odd width, a NaN and a zero plane"},
      {2, 16, 14, 14, 16, 5, 1, 2, 0, 0, 0, "Winograd, no bias"},
      {5, 3, 6, 6, 7, 3, 1, 1, 1, 0, 4, "images grouped (nb > 1)"},
      {1, 6, 16, 16, 9, 1, 1, 0, 1, 0, 0, "1x1: x is the column matrix"},
      {3, 4, 15, 15, 10, 3, 2, 1, 2, 0, 0, "stride 2; the bias wants no gradient"},
      {2, 8, 32, 32, 16, 3, 1, 1, 1, 0, 0, "one GEMM split over the threads by columns"},
      {1, 8, 14, 14, 96, 3, 1, 1, 1, 0, 0, "one GEMM split over the threads by rows"},
      {2, 8, 12, 12, 8, 5, 1, 2, 2, 0, 0, "Winograd; the bias wants no gradient"},
  };
  int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  for (int si = 0; si < nshapes; si++) {
    const shape *s = &shapes[si];
    size_t nx = (size_t)(s->n * s->c * s->h * s->w), nw = (size_t)(s->o * s->c * s->k * s->k);
    size_t ny = (size_t)out_size(s), total = ny + nx + nw + (size_t)s->o;
    float *x = (float *)malloc(nx * sizeof(float)), *w = (float *)malloc(nw * sizeof(float));
    float *b = (float *)malloc((size_t)s->o * sizeof(float)), *r = (float *)malloc(ny * sizeof(float));
    float *ref = (float *)calloc(total, sizeof(float)), *got = (float *)calloc(total, sizeof(float));
    th_seed((uint64_t)(31 + si));
    th_fill(x, (int)nx, -1, 1);
    th_fill(w, (int)nw, -0.3f, 0.3f);
    th_fill(b, (int)s->o, -0.5f, 0.5f);
    th_fill(r, (int)ny, -1, 1);
    b[0] = -0.0f; /* with a zero plane: -0 pre-activations */
    int64_t hw = s->h * s->w;
    if (s->zero_plane) memset(x + s->zero_plane * hw, 0, (size_t)hw * sizeof(float)); /* image 0 (or 1), a channel */
    if (s->nan_plane) x[s->nan_plane * hw + 5] = NAN;
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue; /* test_speed reports the paths it lacks */
      for (int threads = 1; threads <= th_sweep_threads(3); threads++) {
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        memset(ref, 0, total * sizeof(float));
        memset(got, 0, total * sizeof(float));
        if (!run_once(s, x, w, b, r, 0, ref) || !run_once(s, x, w, b, r, 1, got)) continue;
        CHECK_MSG(same_bits(ref, got, ny), "y: %s, %s, %d threads", s->why, isa_names[ii], threads);
        CHECK_MSG(same_bits(ref + ny, got + ny, total - ny), "gradients: %s, %s, %d threads", s->why, isa_names[ii],
                  threads);
        int64_t neg = 0, nan = 0, negzero = 0;
        for (size_t i = 0; i < ny; i++) {
          neg += got[i] < 0;
          nan += isnan(got[i]) != 0;
          negzero += got[i] == 0 && signbit(got[i]);
        }
        CHECK_MSG(neg == 0 && negzero == 0, "%s: %lld negative, %lld -0 outputs", s->why, (long long)neg,
                  (long long)negzero);
        CHECK(s->nan_plane ? nan > 0 : nan == 0); /* a NaN input stays NaN through the ReLU */
      }
    }
    dt_set_threads(1);
    dt_sgemm_use_isa("best");
    free(x), free(w), free(b), free(r), free(ref), free(got);
  }
}

/* dt_conv2d's and dt_conv2d_relu's forward against a plain double-precision
 * sum, on each path at 1-3 threads: fused and unfused could otherwise agree
 * on a wrong bias. A large bias makes about half the outputs negative. */
static void test_against_reference(void) {
  static const shape shapes[] = {
      {2, 1, 20, 20, 12, 5, 1, 2, 1, 0, 0, "one image at a time"},
      {2, 8, 10, 10, 8, 5, 1, 2, 1, 0, 0, "Winograd"},
      {3, 4, 7, 7, 20, 3, 1, 1, 1, 0, 0, "grouped"},
      {1, 8, 14, 14, 96, 3, 1, 1, 1, 0, 0, "rows split over the threads"},
  };
  for (int si = 0; si < 4; si++) {
    const shape *s = &shapes[si];
    int64_t ho = (s->h + 2 * s->pad - s->k) / s->stride + 1, wo = (s->w + 2 * s->pad - s->k) / s->stride + 1;
    size_t nx = (size_t)(s->n * s->c * s->h * s->w), nw = (size_t)(s->o * s->c * s->k * s->k), ny = (size_t)out_size(s);
    float *x = (float *)malloc(nx * sizeof(float)), *w = (float *)malloc(nw * sizeof(float));
    float *b = (float *)malloc((size_t)s->o * sizeof(float));
    double *ref = (double *)malloc(ny * sizeof(double));
    th_seed((uint64_t)(41 + si));
    th_fill(x, (int)nx, -1, 1);
    th_fill(w, (int)nw, -0.3f, 0.3f);
    th_fill(b, (int)s->o, -3, 3);
    for (int64_t n = 0; n < s->n; n++)
      for (int64_t o = 0; o < s->o; o++)
        for (int64_t i = 0; i < ho; i++)
          for (int64_t j = 0; j < wo; j++) {
            double sum = b[o];
            for (int64_t c = 0; c < s->c; c++)
              for (int64_t ki = 0; ki < s->k; ki++)
                for (int64_t kj = 0; kj < s->k; kj++) {
                  int64_t ih = i * s->stride - s->pad + ki, iw = j * s->stride - s->pad + kj;
                  if (ih < 0 || ih >= s->h || iw < 0 || iw >= s->w) continue;
                  sum += (double)x[((n * s->c + c) * s->h + ih) * s->w + iw] * w[((o * s->c + c) * s->k + ki) * s->k + kj];
                }
            ref[((n * s->o + o) * ho + i) * wo + j] = sum;
          }
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue;
      for (int threads = 1; threads <= th_sweep_threads(3); threads++) {
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        for (int relu = 0; relu < 2; relu++) {
          dt_graph *g = dt_graph_create(NULL, NULL);
          int64_t sx[4] = {s->n, s->c, s->h, s->w}, sw[4] = {s->o, s->c, s->k, s->k}, sb[1] = {s->o};
          dt_tensor *tx = dt_tensor_from(g, 4, sx, x), *tw = dt_tensor_from(g, 4, sw, w);
          dt_tensor *tb = dt_tensor_from(g, 1, sb, b);
          dt_tensor *y = relu ? dt_conv2d_relu(g, tx, tw, tb, s->stride, s->pad)
                              : dt_conv2d(g, tx, tw, tb, s->stride, s->pad);
          CHECK(y != NULL);
          double worst = 0;
          for (size_t i = 0; y && i < ny; i++) {
            double want = relu && ref[i] < 0 ? 0.0 : ref[i], e = fabs(y->data[i] - want);
            if (e > worst) worst = e;
          }
          CHECK_MSG(worst < 1e-3, "%s, %s, %s, %d threads: worst error %g", relu ? "dt_conv2d_relu" : "dt_conv2d",
                    s->why, isa_names[ii], threads, worst);
          dt_graph_destroy(g);
        }
      }
    }
    dt_set_threads(1);
    dt_sgemm_use_isa("best");
    free(x), free(w), free(b), free(ref);
  }
}

/* The epilogue's per-row bias (the library's own dt__sgemm_epi) against C
 * filled with the rows' bias, dt_sgemm with beta 1 and the ReLU after it, bit
 * for bit, through every way in dt_sgemm: both transposes (A @ B^T with few
 * columns takes the unpacked dot kernels), edge tiles, several k blocks, the
 * few-rows loop, threads split by rows and by columns; and k = 0. */
static void test_row_bias_epilogue(void) {
  static const int64_t dims[][4] = {
      /* m, n, k, B transposed */
      {7, 20, 300, 1},   /* few columns, A @ B^T: the dot kernels (rows in blocks of 3) */
      {2000, 20, 30, 1}, /* the same, its row blocks over the threads */
      {13, 37, 5, 0},    /* edge tiles, one short k block */
      {150, 450, 33, 0}, /* few rows, B wider than NC: the pc -> jc loop */
      {200, 900, 40, 0}, /* more than 2 MC rows, three B panels */
      {96, 196, 300, 0}, /* rows split over the threads, 3 k blocks */
      {24, 600, 200, 1}, /* columns split over the threads */
      {5, 6, 0, 0},      /* k = 0: the bias alone */
  };
  int nd = (int)(sizeof dims / sizeof dims[0]);
  for (int di = 0; di < nd; di++) {
    int64_t m = dims[di][0], n = dims[di][1], k = dims[di][2];
    int tb = (int)dims[di][3];
    size_t na = (size_t)(m * (k ? k : 1)), nb = (size_t)(n * (k ? k : 1)), nc = (size_t)(m * n);
    float *a = (float *)malloc(na * sizeof(float)), *b = (float *)malloc(nb * sizeof(float));
    float *rb = (float *)malloc((size_t)m * sizeof(float));
    float *want = (float *)malloc(nc * sizeof(float)), *got = (float *)malloc(nc * sizeof(float));
    th_seed((uint64_t)(51 + di));
    th_fill(a, (int)na, -1, 1);
    th_fill(b, (int)nb, -1, 1);
    th_fill(rb, (int)m, -4, 4);
    for (int ii = 0; ii < 4; ii++) {
      if (dt_sgemm_use_isa(isa_names[ii]) != DTRAIN_OK) continue;
      for (int threads = 1; threads <= th_sweep_threads(3); threads++) {
        CHECK(dt_set_threads(threads) == DTRAIN_OK);
        for (int relu = 0; relu < 2; relu++) {
          for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) want[i * n + j] = rb[i];
          dt_sgemm(0, tb, m, n, k, 1.0f, a, k, b, tb ? k : n, 1.0f, want, n);
          if (relu)
            for (size_t i = 0; i < nc; i++) want[i] = want[i] <= 0.0f ? 0.0f : want[i];
          for (size_t i = 0; i < nc; i++) got[i] = NAN; /* beta 0: C is written, never read */
          dt__gemm_epi ep = {NULL, relu, rb};
          dt__sgemm_epi(0, tb, m, n, k, a, k, b, tb ? k : n, got, n, &ep);
          CHECK_MSG(same_bits(want, got, nc), "%lldx%lldx%lld%s, %s, %d threads, relu %d", (long long)m, (long long)n,
                    (long long)k, tb ? " (B^T)" : "", isa_names[ii], threads, relu);
        }
      }
    }
    dt_set_threads(1);
    dt_sgemm_use_isa("best");
    free(a), free(b), free(rb), free(want), free(got);
  }
}

static void test_refusals(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t sx[4] = {2, 3, 8, 8}, sw[4] = {4, 3, 3, 3}, sw2[4] = {4, 2, 3, 3}, sb[1] = {4}, sb2[1] = {5};
  dt_tensor *x = dt_tensor_new(g, 4, sx);
  CHECK(dt_conv2d_relu(g, x, dt_tensor_new(g, 4, sw2), NULL, 1, 1) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE && strstr(dt_graph_message(g), "dt_conv2d_relu: channels differ"));
  dt_graph_reset(g);
  x = dt_tensor_new(g, 4, sx);
  CHECK(dt_conv2d_relu(g, x, dt_tensor_new(g, 4, sw), dt_tensor_new(g, 1, sb2), 1, 1) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE && strstr(dt_graph_message(g), "dt_conv2d_relu: bias [5]"));
  dt_graph_reset(g);
  x = dt_tensor_new(g, 4, sx);
  CHECK(dt_conv2d_relu(g, x, dt_tensor_new(g, 4, sw), NULL, 0, 1) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "dt_conv2d_relu: stride 0"));
  dt_graph_reset(g);
  x = dt_tensor_new(g, 4, sx);
  CHECK(dt_conv2d_relu(g, x, NULL, NULL, 1, 1) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  dt_graph_reset(g);
  /* its result is not free to overwrite: backward reads it */
  x = dt_tensor_new(g, 4, sx);
  dt_tensor *y = dt_conv2d_relu(g, x, dt_tensor_new(g, 4, sw), dt_tensor_new(g, 1, sb), 1, 1);
  CHECK(y != NULL);
  CHECK(dt_relu_inplace(g, y) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG && strstr(dt_graph_message(g), "dt_conv2d_relu"));
  dt_graph_reset(g);
  CHECK(dt_nn_conv2d_relu_forward(g, NULL, dt_tensor_new(g, 4, sx)) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG && strstr(dt_graph_message(g), "dt_nn_conv2d_relu_forward"));
  dt_graph_destroy(g);
}

/* A CNN (conv 1->8 5x5 -> pool, conv 8->8 5x5 (Winograd) -> pool, linear)
 * trained 8 Adam steps with dt_nn_conv2d_relu_forward and with
 * dt_nn_conv2d_forward + dt_relu_inplace: the same weights, bit for bit. */
static void test_training_same(void) {
  enum { N = 6 };
  static float xs[N * 16 * 16];
  static int32_t ys[N];
  th_seed(6);
  th_fill(xs, N * 256, 0, 1);
  for (int i = 0; i < N; i++) ys[i] = i % 3;
  float *final[2] = {NULL, NULL};
  size_t np = 0;
  for (int fused = 0; fused < 2; fused++) {
    dt_params *P = dt_params_create(8);
    dt_nn_conv2d c1 = {-1, -1, 0, 0, 0, 0, 0}, c2 = c1;
    dt_nn_linear l = {-1, -1, 0, 0};
    CHECK(dt_nn_conv2d_init(&c1, P, "c1", 1, 8, 5, 1, 2, 1) == DTRAIN_OK);
    CHECK(dt_nn_conv2d_init(&c2, P, "c2", 8, 8, 5, 1, 2, 1) == DTRAIN_OK);
    CHECK(dt_nn_linear_init(&l, P, "l", 8 * 4 * 4, 3, 1) == DTRAIN_OK);
    dt_optim_options oo = dt_optim_defaults(DTRAIN_OPTIM_ADAM);
    oo.lr = 0.01f;
    dt_optim *opt = dt_optim_create(P, &oo);
    for (int step = 0; step < 8; step++) {
      dt_graph *g = dt_graph_create(P, NULL);
      int64_t sx[4] = {N, 1, 16, 16};
      dt_tensor *h = dt_tensor_wrap(g, 4, sx, xs);
      h = fused ? dt_nn_conv2d_relu_forward(g, &c1, h) : dt_relu_inplace(g, dt_nn_conv2d_forward(g, &c1, h));
      h = dt_max_pool2d(g, h, 2, 2);
      h = fused ? dt_nn_conv2d_relu_forward(g, &c2, h) : dt_relu_inplace(g, dt_nn_conv2d_forward(g, &c2, h));
      h = dt_flatten(g, dt_max_pool2d(g, h, 2, 2));
      dt_params_zero_grad(P);
      CHECK(dt_backward(g, dt_cross_entropy(g, dt_nn_linear_forward(g, &l, h), ys)) == DTRAIN_OK);
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
  TH_RUN(test_row_bias_epilogue);
  TH_RUN(test_refusals);
  TH_RUN(test_training_same);
  return th_summary("conv_relu");
}
