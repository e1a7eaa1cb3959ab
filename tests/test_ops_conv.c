/* Convolution and pooling: values against a naive reference, gradients against
 * finite differences, hand-checked cases, error paths. */
#include "harness.h"

/* ---- naive reference --------------------------------------------------------------- */

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Backward from y with d(loss)/dy = 1 everywhere (loss = sum(y)). */
static dt_result backward_ones(dt_graph *g, dt_tensor *y) {
  if (!y) return dt_graph_error(g);
  float *ones = (float *)malloc((size_t)y->size * sizeof(float));
  for (int64_t i = 0; i < y->size; i++) ones[i] = 1.0f;
  dt_result r = dt_backward_grad(g, y, ones);
  free(ones);
  return r;
}

static int64_t ref_out(int64_t in, int64_t k, int s, int p) { return (in + 2 * p - k) / s + 1; }

/* Direct 7-loop convolution in double; y is [n,o,ho,wo]; mag gets the sum of
 * the magnitudes of the terms of each output (scale for the float error). */
static void ref_conv(const float *x, const float *w, const float *b, float *y, double *mag, int64_t n, int64_t c, int64_t h,
                     int64_t wd, int64_t o, int64_t kh, int64_t kw, int s, int p) {
  int64_t ho = ref_out(h, kh, s, p), wo = ref_out(wd, kw, s, p);
  for (int64_t in = 0; in < n; in++)
    for (int64_t io = 0; io < o; io++)
      for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow++) {
          double acc = b ? (double)b[io] : 0.0, m = fabs(acc);
          for (int64_t ic = 0; ic < c; ic++)
            for (int64_t i = 0; i < kh; i++)
              for (int64_t j = 0; j < kw; j++) {
                int64_t ih = oh * s - p + i, iw = ow * s - p + j;
                if (ih < 0 || ih >= h || iw < 0 || iw >= wd) continue;
                double t = (double)x[((in * c + ic) * h + ih) * wd + iw] * (double)w[((io * c + ic) * kh + i) * kw + j];
                acc += t;
                m += fabs(t);
              }
          y[((in * o + io) * ho + oh) * wo + ow] = (float)acc;
          mag[((in * o + io) * ho + oh) * wo + ow] = m;
        }
}

typedef struct conv_case {
  int64_t n, c, h, w, o, kh, kw;
  int s, p, bias;
} conv_case;

/* Runs one case through dt_conv2d and the reference; returns the worst error
 * relative to the float rounding scale (1e-6 per unit of term magnitude, >= 1e-5);
 * a value below 1 passes. */
static double conv_forward_err(const conv_case *k) {
  int64_t xs[4] = {k->n, k->c, k->h, k->w}, ws[4] = {k->o, k->c, k->kh, k->kw}, bs[1] = {k->o};
  int64_t nx = k->n * k->c * k->h * k->w, nw = k->o * k->c * k->kh * k->kw;
  int64_t ho = ref_out(k->h, k->kh, k->s, k->p), wo = ref_out(k->w, k->kw, k->s, k->p);
  int64_t ny = k->n * k->o * ho * wo;
  float *x = (float *)malloc((size_t)nx * sizeof(float)), *w = (float *)malloc((size_t)nw * sizeof(float));
  float *b = (float *)malloc((size_t)k->o * sizeof(float)), *y = (float *)malloc((size_t)ny * sizeof(float));
  double *mag = (double *)malloc((size_t)ny * sizeof(double));
  th_fill(x, nx, -1, 1);
  th_fill(w, nw, -1, 1);
  th_fill(b, k->o, -1, 1);
  ref_conv(x, w, k->bias ? b : NULL, y, mag, k->n, k->c, k->h, k->w, k->o, k->kh, k->kw, k->s, k->p);
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *tx = dt_tensor_from(g, 4, xs, x), *tw = dt_tensor_from(g, 4, ws, w);
  dt_tensor *tb = k->bias ? dt_tensor_from(g, 1, bs, b) : NULL;
  dt_tensor *out = dt_conv2d(g, tx, tw, tb, k->s, k->p);
  double err = 1e30;
  if (!out) {
    fprintf(stderr, "conv forward failed: %s\n", dt_graph_message(g));
  } else if (out->ndim != 4 || out->shape[0] != k->n || out->shape[1] != k->o || out->shape[2] != ho ||
             out->shape[3] != wo) {
    char sb[64];
    fprintf(stderr, "conv output shape %s, expected [%lld,%lld,%lld,%lld]\n", dt_shape_str(out, sb, sizeof sb),
            (long long)k->n, (long long)k->o, (long long)ho, (long long)wo);
  } else {
    err = 0;
    for (int64_t i = 0; i < ny; i++)
      err = fmax(err, fabs((double)out->data[i] - (double)y[i]) / (1e-5 + 1e-6 * mag[i]));
  }
  dt_graph_destroy(g);
  free(x);
  free(w);
  free(b);
  free(y);
  free(mag);
  return err;
}

static void test_conv_forward_random(void) {
  static const int ks[3] = {1, 3, 5};
  th_seed(11);
  for (int t = 0; t < 60; t++) {
    conv_case k;
    k.n = 1 + (int64_t)(th_rand() * 4);
    k.c = 1 + (int64_t)(th_rand() * 4);
    k.o = 1 + (int64_t)(th_rand() * 5);
    k.kh = ks[(int)(th_rand() * 3)];
    k.kw = (t % 3 == 0) ? ks[(int)(th_rand() * 3)] : k.kh; /* a third with kh != kw likely */
    k.s = 1 + (int)(th_rand() * 2);
    k.p = (int)(th_rand() * 3);
    k.bias = t % 2;
    /* input at least as large as the padded kernel needs, non-square */
    k.h = max_i64(1, k.kh - 2 * k.p) + (int64_t)(th_rand() * 9);
    k.w = max_i64(1, k.kw - 2 * k.p) + (int64_t)(th_rand() * 9);
    double err = conv_forward_err(&k);
    CHECK_MSG(err < 1, "case %d: n%lld c%lld h%lld w%lld o%lld k%lldx%lld s%d p%d bias%d: err %g", t,
              (long long)k.n, (long long)k.c, (long long)k.h, (long long)k.w, (long long)k.o, (long long)k.kh,
              (long long)k.kw, k.s, k.p, k.bias, err);
  }
}

/* Shapes that reach each code path: images grouped per GEMM (small outputs,
 * with a partial last group), one image per GEMM (large outputs), the 1x1
 * direct path, a scratch-capped group, and kernel equal to the padded input. */
static void test_conv_forward_paths(void) {
  static const conv_case cases[] = {
      {13, 3, 7, 7, 4, 3, 3, 1, 1, 1},   /* P = 49: 11 images per GEMM, then 2 */
      {5, 2, 9, 6, 3, 3, 1, 2, 1, 0},    /* grouped, stride 2, kh != kw */
      {2, 3, 26, 25, 4, 3, 3, 1, 0, 1},  /* P = 24*23 >= 512: one image per GEMM */
      {2, 3, 23, 23, 5, 1, 1, 1, 0, 1},  /* 1x1 direct path */
      {3, 4, 24, 22, 2, 1, 1, 1, 0, 0},  /* 1x1 direct path, no bias */
      {4, 3, 5, 5, 2, 1, 1, 1, 0, 1},    /* 1x1 but grouped (P = 25) */
      {3, 128, 24, 24, 2, 5, 5, 1, 0, 1},/* K = 3200, P = 400: scratch cap forces 1 image */
      {2, 2, 3, 4, 3, 5, 6, 1, 1, 1},    /* kernel equals the padded input: 1x1 output */
      {3, 2, 1, 1, 2, 3, 3, 2, 1, 1},    /* 1x1 input, all but the centre is padding */
      {2, 1, 8, 8, 1, 2, 2, 3, 2, 1},    /* stride larger than the kernel: skipped inputs */
      {5, 8, 14, 14, 16, 5, 5, 1, 2, 1}, /* Winograd F(2x2,5x5): "same", even output */
      {3, 9, 9, 8, 10, 5, 5, 1, 0, 0},   /* Winograd: odd output height, no padding, no bias */
      {2, 8, 5, 7, 8, 5, 5, 1, 1, 1},    /* Winograd: padding 1, odd width */
      {2, 8, 3, 4, 9, 5, 5, 1, 3, 1},    /* Winograd: padding 3 > half the kernel, output larger than input */
      {70, 8, 7, 7, 8, 5, 5, 1, 2, 1},   /* Winograd: several groups of images, a partial last one */
  };
  th_seed(12);
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    double err = conv_forward_err(&cases[t]);
    /* Winograd (5x5, stride 1, >= 8 channels in and out) rounds more than a
     * direct sum: up to a few float ulps per unit of term magnitude. */
    int wino = cases[t].kh == 5 && cases[t].kw == 5 && cases[t].s == 1 && cases[t].c >= 8 && cases[t].o >= 8;
    CHECK_MSG(err < (wino ? 4 : 1), "path case %d: err %g", (int)t, err);
  }
}

static void test_conv_values_by_hand(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, wv[4] = {1, 1, 1, 1}, bv[1] = {0.5f};
  int64_t xs[4] = {1, 1, 3, 3}, ws[4] = {1, 1, 2, 2}, bs[1] = {1};
  dt_tensor *x = dt_tensor_from(g, 4, xs, xv), *w = dt_tensor_from(g, 4, ws, wv), *b = dt_tensor_from(g, 1, bs, bv);
  dt_tensor *y = dt_conv2d(g, x, w, b, 1, 0);
  CHECK(y && y->shape[2] == 2 && y->shape[3] == 2);
  if (y) { CHECK(y->data[0] == 12.5f && y->data[1] == 16.5f && y->data[2] == 24.5f && y->data[3] == 28.5f); }
  /* padding 1, stride 2: windows at (-1,-1), (-1,1), (1,-1), (1,1) */
  dt_tensor *z = dt_conv2d(g, x, w, NULL, 2, 1);
  CHECK(z && z->shape[2] == 2 && z->shape[3] == 2);
  if (z) { CHECK(z->data[0] == 1.0f && z->data[1] == 5.0f && z->data[2] == 11.0f && z->data[3] == 28.0f); }
  /* gradient of sum(conv(x, ones 2x2)) w.r.t. x counts the windows covering each pixel */
  dt_graph_reset(g);
  x = dt_tensor_from(g, 4, xs, xv);
  w = dt_tensor_from(g, 4, ws, wv);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor_set_requires_grad(w, 1);
  y = dt_conv2d(g, x, w, NULL, 1, 0);
  CHECK(y && backward_ones(g, y) == DTRAIN_OK);
  static const float cover[9] = {1, 2, 1, 2, 4, 2, 1, 2, 1};
  if (x && x->grad) for (int i = 0; i < 9; i++) CHECK_NEAR(x->grad[i], cover[i], 0);
  /* dL/dw[i,j] = sum of the pixels under tap (i,j) */
  static const float taps[4] = {1 + 2 + 4 + 5, 2 + 3 + 5 + 6, 4 + 5 + 7 + 8, 5 + 6 + 8 + 9};
  if (w && w->grad) for (int i = 0; i < 4; i++) CHECK_NEAR(w->grad[i], taps[i], 0);
  CHECK(x && x->grad && w && w->grad);
  dt_graph_destroy(g);
}

/* ---- gradients ----------------------------------------------------------------------- */

typedef struct { int s, p, bias, twice; } conv_ctx;

static dt_tensor *f_conv(dt_graph *g, dt_tensor **in, void *ctx) {
  conv_ctx *c = (conv_ctx *)ctx;
  dt_tensor *y = dt_conv2d(g, in[0], in[1], c->bias ? in[2] : NULL, c->s, c->p);
  /* twice: x, w and b used by two convs, so backward must accumulate */
  if (c->twice) y = dt_add(g, y, dt_conv2d(g, in[0], in[1], c->bias ? in[2] : NULL, c->s, c->p));
  return y;
}

static void test_conv_grads(void) {
  static const conv_case cases[] = {
      {2, 3, 6, 5, 4, 3, 3, 1, 1, 1},
      {3, 2, 7, 8, 3, 3, 3, 2, 1, 1},
      {2, 2, 6, 7, 3, 3, 5, 1, 2, 1},   /* kh != kw, padding 2 */
      {2, 3, 9, 6, 2, 5, 1, 2, 0, 0},   /* kh != kw, stride 2, no bias */
      {3, 4, 5, 5, 2, 1, 1, 1, 0, 1},   /* 1x1 grouped */
      {2, 3, 23, 23, 3, 1, 1, 1, 0, 1}, /* 1x1 direct path */
      {2, 2, 26, 25, 2, 3, 3, 1, 0, 1}, /* one image per GEMM */
      {13, 2, 7, 7, 2, 3, 3, 1, 1, 1},  /* grouped with a partial last group */
      {2, 2, 8, 8, 2, 2, 2, 3, 2, 1},   /* stride > kernel */
      {2, 8, 6, 5, 8, 5, 5, 1, 2, 1},   /* Winograd F(2x2,5x5), odd width */
      {3, 8, 5, 6, 8, 5, 5, 1, 1, 0},   /* Winograd, padding 1, odd height, no bias */
  };
  th_seed(21);
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const conv_case *k = &cases[t];
    int64_t xs[4] = {k->n, k->c, k->h, k->w}, ws[4] = {k->o, k->c, k->kh, k->kw}, bs[1] = {k->o};
    int64_t nx = k->n * k->c * k->h * k->w, nw = k->o * k->c * k->kh * k->kw;
    float *x = (float *)malloc((size_t)nx * sizeof(float)), *w = (float *)malloc((size_t)nw * sizeof(float));
    float b[8];
    th_fill(x, nx, -1, 1);
    th_fill(w, nw, -1, 1);
    th_fill(b, k->o, -1, 1);
    for (int twice = 0; twice < 2; twice++) {
      th_input ins[3] = {th_in(x, 4, xs, 1), th_in(w, 4, ws, 1), th_in(b, 1, bs, 1)};
      conv_ctx ctx = {k->s, k->p, k->bias, twice};
      /* The loss is linear in each single element of x, w or b, so central
       * differences are exact up to rounding at any step; the Winograd path
       * (5x5, stride 1, >= 8 channels) rounds more, so it gets a larger
       * step, which divides that rounding noise. */
      double eps = th_gc_eps;
      if (k->kh == 5 && k->kw == 5 && k->s == 1 && k->c >= 8 && k->o >= 8) th_gc_eps = 5e-2;
      int bad = th_gradcheck("conv2d", f_conv, &ctx, ins, k->bias ? 3 : 2);
      th_gc_eps = eps;
      CHECK_MSG(bad == 0, "conv case %d twice %d: %d mismatches", (int)t, twice, bad);
    }
    free(x);
    free(w);
  }
}

/* Only some inputs need a gradient: x alone, w alone, b alone. */
static void test_conv_partial_grads(void) {
  int64_t xs[4] = {2, 2, 6, 5}, ws[4] = {3, 2, 3, 3}, bs[1] = {3};
  float x[120], w[54], b[3];
  th_seed(22);
  th_fill(x, 120, -1, 1);
  th_fill(w, 54, -1, 1);
  th_fill(b, 3, -1, 1);
  for (int which = 0; which < 3; which++) {
    th_input ins[3] = {th_in(x, 4, xs, which == 0), th_in(w, 4, ws, which == 1), th_in(b, 1, bs, which == 2)};
    conv_ctx ctx = {1, 1, 1, 0};
    int bad = th_gradcheck("conv2d partial", f_conv, &ctx, ins, 3);
    CHECK_MSG(bad == 0, "only input %d: %d mismatches", which, bad);
  }
}

static void test_conv_deterministic(void) {
  int64_t xs[4] = {13, 3, 7, 7}, ws[4] = {4, 3, 3, 3};
  float x[13 * 3 * 49], w[108];
  th_seed(23);
  th_fill(x, 13 * 3 * 49, -1, 1);
  th_fill(w, 108, -1, 1);
  float *first = NULL;
  int same = 1;
  for (int rep = 0; rep < 2; rep++) {
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *tx = dt_tensor_from(g, 4, xs, x), *tw = dt_tensor_from(g, 4, ws, w);
    dt_tensor_set_requires_grad(tx, 1);
    dt_tensor_set_requires_grad(tw, 1);
    dt_tensor *y = dt_conv2d(g, tx, tw, NULL, 1, 1);
    /* loss = sum(y^2)/2: seed with y itself */
    CHECK(y && dt_backward_grad(g, y, y->data) == DTRAIN_OK);
    if (!y || !tx->grad || !tw->grad) { dt_graph_destroy(g); break; }
    size_t bytes = (size_t)(y->size + tx->size + tw->size) * sizeof(float);
    float *buf = (float *)malloc(bytes);
    memcpy(buf, y->data, (size_t)y->size * sizeof(float));
    memcpy(buf + y->size, tx->grad, (size_t)tx->size * sizeof(float));
    memcpy(buf + y->size + tx->size, tw->grad, (size_t)tw->size * sizeof(float));
    if (first) { same = memcmp(first, buf, bytes) == 0; free(buf); }
    else first = buf;
    dt_graph_destroy(g);
  }
  CHECK(first != NULL && same);
  free(first);
}

/* ---- pooling ----------------------------------------------------------------------------- */

/* A random permutation of well-separated values (gap 0.05 >> 2 * eps). */
static void fill_distinct(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = -2.0f + 0.05f * (float)i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)(th_rand() * (double)(i + 1));
    float t = x[i];
    x[i] = x[j];
    x[j] = t;
  }
}

typedef struct { int kind, k, s; } pool_ctx; /* kind 0 max, 1 avg, 2 max + avg */

static dt_tensor *f_pool(dt_graph *g, dt_tensor **in, void *ctx) {
  pool_ctx *c = (pool_ctx *)ctx;
  if (c->kind == 0) return dt_max_pool2d(g, in[0], c->k, c->s);
  if (c->kind == 1) return dt_avg_pool2d(g, in[0], c->k, c->s);
  return dt_add(g, dt_max_pool2d(g, in[0], c->k, c->s), dt_avg_pool2d(g, in[0], c->k, c->s));
}

static void test_pool_grads(void) {
  static const int64_t shapes[][4] = {{2, 3, 6, 6}, {3, 2, 7, 5}, {2, 2, 5, 8}, {2, 1, 4, 4}, {2, 2, 9, 7}};
  static const int kk[][2] = {{2, 2}, {3, 1}, {3, 2}, {1, 1}, {2, 3}}; /* kernel, stride */
  float x[2 * 3 * 9 * 9];
  th_seed(31);
  for (int t = 0; t < 5; t++) {
    int64_t n = shapes[t][0] * shapes[t][1] * shapes[t][2] * shapes[t][3];
    for (int kind = 0; kind < 3; kind++) {
      fill_distinct(x, n);
      th_input in = th_in(x, 4, shapes[t], 1);
      pool_ctx ctx = {kind, kk[t][0], kk[t][1]};
      int bad = th_gradcheck(kind == 0 ? "max_pool2d" : kind == 1 ? "avg_pool2d" : "max+avg", f_pool, &ctx, &in, 1);
      CHECK_MSG(bad == 0, "pool case %d kind %d: %d mismatches", t, kind, bad);
    }
  }
}

static void test_pool_values_by_hand(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[16];
  for (int i = 0; i < 16; i++) xv[i] = (float)(i + 1);
  int64_t xs[4] = {1, 1, 4, 4};
  dt_tensor *x = dt_tensor_from(g, 4, xs, xv);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *mx = dt_max_pool2d(g, x, 2, 2);
  dt_tensor *av = dt_avg_pool2d(g, x, 2, 2);
  CHECK(mx && mx->ndim == 4 && mx->shape[0] == 1 && mx->shape[1] == 1 && mx->shape[2] == 2 && mx->shape[3] == 2);
  CHECK(av && av->shape[2] == 2 && av->shape[3] == 2);
  if (mx) { CHECK(mx->data[0] == 6 && mx->data[1] == 8 && mx->data[2] == 14 && mx->data[3] == 16); }
  if (av) { CHECK(av->data[0] == 3.5f && av->data[1] == 5.5f && av->data[2] == 11.5f && av->data[3] == 13.5f); }
  /* overlapping 3x3 windows, stride 1 */
  dt_tensor *m3 = dt_max_pool2d(g, x, 3, 1), *a3 = dt_avg_pool2d(g, x, 3, 1);
  if (m3) { CHECK(m3->shape[2] == 2 && m3->data[0] == 11 && m3->data[1] == 12 && m3->data[2] == 15 && m3->data[3] == 16); }
  if (a3) { CHECK(a3->shape[2] == 2 && a3->data[0] == 6 && a3->data[3] == 11); }
  /* stride 3 with kernel 2: rows/cols 0-1 only ((4-2)/3+1 = 1) */
  dt_tensor *ms = dt_max_pool2d(g, x, 2, 3);
  CHECK(ms && ms->shape[2] == 1 && ms->shape[3] == 1 && ms->data[0] == 6);
  /* backward of sum(max) + sum(avg): 1 at each max, 1/4 everywhere */
  CHECK(backward_ones(g, dt_add(g, mx, av)) == DTRAIN_OK);
  if (x->grad) {
    for (int i = 0; i < 16; i++) {
      float want = 0.25f + ((i == 5 || i == 7 || i == 13 || i == 15) ? 1.0f : 0.0f);
      CHECK_NEAR(x->grad[i], want, 0);
    }
  }
  CHECK(x->grad != NULL);
  dt_graph_destroy(g);
}

static void test_max_pool_ties_and_nan(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float xv[8] = {3, 3, 1, 2, 3, 3, 2, 2}; /* two 2x2 planes; ties in both */
  int64_t xs[4] = {1, 2, 2, 2};
  dt_tensor *x = dt_tensor_from(g, 4, xs, xv);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *m = dt_max_pool2d(g, x, 2, 2);
  CHECK(m && m->data[0] == 3 && m->data[1] == 3);
  CHECK(m && backward_ones(g, m) == DTRAIN_OK);
  static const float want[8] = {1, 0, 0, 0, 1, 0, 0, 0}; /* first maximum of each window */
  if (x->grad) for (int i = 0; i < 8; i++) CHECK_NEAR(x->grad[i], want[i], 0);
  CHECK(x->grad != NULL);
  /* a NaN in the window propagates */
  dt_graph_reset(g);
  float nv[4] = {1, NAN, 5, 2};
  int64_t ns[4] = {1, 1, 2, 2};
  dt_tensor *y = dt_max_pool2d(g, dt_tensor_from(g, 4, ns, nv), 2, 1);
  CHECK(y && isnan(y->data[0]));
  /* no gradient wanted: forward still works, nothing on the tape */
  dt_graph_reset(g);
  dt_tensor *z = dt_max_pool2d(g, dt_tensor_from(g, 4, xs, xv), 2, 2);
  CHECK(z && z->aux == NULL && z->backward == NULL && z->data[1] == 3);
  dt_graph_destroy(g);
}

/* ---- errors -------------------------------------------------------------------------------- */

#define EXPECT_FAIL(g, expr, code, needle)                                                      \
  do {                                                                                          \
    CHECK((expr) == NULL);                                                                      \
    CHECK_MSG(dt_graph_error(g) == (code), "code %s", dt_result_name(dt_graph_error(g)));       \
    CHECK_MSG(strstr(dt_graph_message(g), (needle)) != NULL, "message '%s' lacks '%s'",         \
              dt_graph_message(g), (needle));                                                   \
    dt_graph_reset(g);                                                                          \
  } while (0)

static void test_conv_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL), *g2 = dt_graph_create(NULL, NULL);
  int64_t xs[4] = {2, 3, 5, 5}, ws[4] = {4, 3, 3, 3}, w2s[4] = {4, 2, 3, 3}, x3s[3] = {3, 5, 5};
  int64_t b4[1] = {4}, b5[1] = {5}, b41[2] = {4, 1}, wbig[4] = {4, 3, 8, 3}, wwide[4] = {4, 3, 3, 9};
#define X dt_tensor_new(g, 4, xs)
#define W dt_tensor_new(g, 4, ws)
  EXPECT_FAIL(g, dt_conv2d(g, NULL, W, NULL, 1, 0), DTRAIN_ERR_NULL_ARG, "dt_conv2d: tensor argument 1 is NULL");
  EXPECT_FAIL(g, dt_conv2d(g, X, NULL, NULL, 1, 0), DTRAIN_ERR_NULL_ARG, "dt_conv2d: tensor argument 2 is NULL");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, dt_tensor_new(g2, 1, b4), 1, 0), DTRAIN_ERR_INVALID_ARG, "another graph");
  EXPECT_FAIL(g, dt_conv2d(g, dt_tensor_new(g, 3, x3s), W, NULL, 1, 0), DTRAIN_ERR_RANK,
              "dt_conv2d: x [3,5,5] must have rank 4");
  EXPECT_FAIL(g, dt_conv2d(g, X, dt_tensor_new(g, 3, x3s), NULL, 1, 0), DTRAIN_ERR_RANK,
              "dt_conv2d: w [3,5,5] must have rank 4");
  EXPECT_FAIL(g, dt_conv2d(g, X, dt_tensor_new(g, 4, w2s), NULL, 1, 0), DTRAIN_ERR_SHAPE,
              "dt_conv2d: channels differ (x [2,3,5,5] has 3, w [4,2,3,3] has 2)");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, dt_tensor_new(g, 1, b5), 1, 0), DTRAIN_ERR_SHAPE,
              "dt_conv2d: bias [5] must be [4] for w [4,3,3,3]");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, dt_tensor_new(g, 2, b41), 1, 0), DTRAIN_ERR_SHAPE,
              "dt_conv2d: bias [4,1] must be [4]");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, NULL, 0, 0), DTRAIN_ERR_INVALID_ARG, "dt_conv2d: stride 0 (must be >= 1)");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, NULL, -2, 0), DTRAIN_ERR_INVALID_ARG, "dt_conv2d: stride -2");
  EXPECT_FAIL(g, dt_conv2d(g, X, W, NULL, 1, -1), DTRAIN_ERR_INVALID_ARG, "dt_conv2d: padding -1 (must be >= 0)");
  EXPECT_FAIL(g, dt_conv2d(g, X, dt_tensor_new(g, 4, wbig), NULL, 1, 1), DTRAIN_ERR_SHAPE,
              "dt_conv2d: kernel 8x3 larger than the padded input 7x7 (x [2,3,5,5], w [4,3,8,3], padding 1)");
  EXPECT_FAIL(g, dt_conv2d(g, X, dt_tensor_new(g, 4, wwide), NULL, 1, 0), DTRAIN_ERR_SHAPE,
              "dt_conv2d: kernel 3x9 larger than the padded input 5x5");
  /* the same kernels fit with enough padding */
  CHECK(dt_conv2d(g, X, dt_tensor_new(g, 4, wwide), NULL, 1, 2) != NULL);
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  /* NULL graph, and a failed graph stays failed */
  CHECK(dt_conv2d(NULL, NULL, NULL, NULL, 1, 0) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_conv2d(g, X, W, NULL, 0, 0) == NULL);
  CHECK(dt_conv2d(g, X, W, NULL, 1, 0) == NULL && dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG);
#undef X
#undef W
  dt_graph_destroy(g);
  dt_graph_destroy(g2);
}

static void test_pool_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t xs[4] = {2, 3, 6, 4}, x3s[3] = {3, 6, 4};
  static const char *names[2] = {"dt_max_pool2d", "dt_avg_pool2d"};
  for (int kind = 0; kind < 2; kind++) {
    char want[160];
#define POOL(x, k, s) (kind == 0 ? dt_max_pool2d(g, (x), (k), (s)) : dt_avg_pool2d(g, (x), (k), (s)))
    snprintf(want, sizeof want, "%s: tensor argument 1 is NULL", names[kind]);
    EXPECT_FAIL(g, POOL(NULL, 2, 2), DTRAIN_ERR_NULL_ARG, want);
    snprintf(want, sizeof want, "%s: x [3,6,4] must have rank 4", names[kind]);
    EXPECT_FAIL(g, POOL(dt_tensor_new(g, 3, x3s), 2, 2), DTRAIN_ERR_RANK, want);
    snprintf(want, sizeof want, "%s: kernel 0 (must be >= 1), x [2,3,6,4]", names[kind]);
    EXPECT_FAIL(g, POOL(dt_tensor_new(g, 4, xs), 0, 2), DTRAIN_ERR_INVALID_ARG, want);
    snprintf(want, sizeof want, "%s: stride 0 (must be >= 1), x [2,3,6,4]", names[kind]);
    EXPECT_FAIL(g, POOL(dt_tensor_new(g, 4, xs), 2, 0), DTRAIN_ERR_INVALID_ARG, want);
    snprintf(want, sizeof want, "%s: kernel 5 larger than the input 6x4 (x [2,3,6,4])", names[kind]);
    EXPECT_FAIL(g, POOL(dt_tensor_new(g, 4, xs), 5, 1), DTRAIN_ERR_SHAPE, want);
    snprintf(want, sizeof want, "%s: kernel 7 larger than the input 6x4", names[kind]);
    EXPECT_FAIL(g, POOL(dt_tensor_new(g, 4, xs), 7, 1), DTRAIN_ERR_SHAPE, want);
    /* kernel equal to the smaller side is fine */
    dt_tensor *y = POOL(dt_tensor_new(g, 4, xs), 4, 1);
    CHECK(y && y->shape[2] == 3 && y->shape[3] == 1);
    dt_graph_reset(g);
#undef POOL
  }
  dt_graph_destroy(g);
}

/* A convolution's temporaries (im2col columns; Winograd's U, V, M) are given
 * back when it returns, forward and backward: what stays in the arena is the
 * output (forward) and the input's gradient (backward), though the peak saw
 * the temporaries. Both paths: 3x3 (im2col) and 5x5 with 8 channels (Winograd). */
static void test_conv_scratch_released(void) {
  for (int wino = 0; wino < 2; wino++) {
    int k = wino ? 5 : 3, c = 8, o = 8;
    int64_t sx[4] = {4, c, 12, 12}, sw[4] = {o, c, k, k};
    float *xd = (float *)malloc(sizeof(float) * 4 * 8 * 144), *wd = (float *)malloc(sizeof(float) * 8 * 8 * 25);
    th_fill(xd, 4 * 8 * 144, -1, 1);
    th_fill(wd, o * c * k * k, -1, 1);
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *x = dt_tensor_from(g, 4, sx, xd), *w = dt_tensor_from(g, 4, sw, wd);
    dt_tensor_set_requires_grad(x, 1);
    dt_tensor_set_requires_grad(w, 1);
    size_t before = dt_graph_bytes_used(g), out_bytes = sizeof(float) * 4 * o * 144;
    dt_tensor *y = dt_conv2d(g, x, w, NULL, 1, k / 2);
    CHECK(y != NULL);
    size_t kept = dt_graph_bytes_used(g) - before;
    CHECK_MSG(kept >= out_bytes && kept < out_bytes + 1024, "%s forward kept %zu bytes, output %zu",
              wino ? "winograd" : "im2col", kept, out_bytes);
    CHECK(dt_graph_bytes_peak(g) > before + out_bytes + 1024); /* the temporaries were there */
    dt_tensor *l = dt_sum(g, y);
    size_t before_bw = dt_graph_bytes_used(g);
    CHECK(dt_backward(g, l) == DTRAIN_OK);
    /* the gradients of x, w, y and the loss: nothing else */
    size_t grads = sizeof(float) * (4 * c * 144 + o * c * k * k + 4 * o * 144 + 1);
    size_t kept_bw = dt_graph_bytes_used(g) - before_bw;
    CHECK_MSG(kept_bw >= grads && kept_bw < grads + 1024, "%s backward kept %zu bytes, gradients %zu",
              wino ? "winograd" : "im2col", kept_bw, grads);
    dt_graph_destroy(g);
    free(xd);
    free(wd);
  }
}

int main(void) {
  TH_RUN(test_conv_values_by_hand);
  TH_RUN(test_conv_forward_random);
  TH_RUN(test_conv_forward_paths);
  TH_RUN(test_conv_grads);
  TH_RUN(test_conv_partial_grads);
  TH_RUN(test_conv_deterministic);
  TH_RUN(test_pool_values_by_hand);
  TH_RUN(test_max_pool_ties_and_nan);
  TH_RUN(test_pool_grads);
  TH_RUN(test_conv_errors);
  TH_RUN(test_pool_errors);
  TH_RUN(test_conv_scratch_released);
  return th_summary("ops_conv");
}
