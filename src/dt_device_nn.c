/* ===========================================================================
 * dt_device_nn.c -- device twins of the GEMM-based and nn ops: matmul,
 * linear, bmm, softmax, losses, dropout, norms, embedding, conv, pooling
 * ===========================================================================
 * Ops layer, as dt_device_ops.c (which explains the pattern): an op with a
 * device path (dt_ops_matmul.c, dt_ops_nn.c, dt_ops_conv.c, dt_ops_pool.c)
 * calls its twin here right after dt__begin when g->device is set.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* ---- GEMM-based: matmul (2-D), linear --------------------------------------------------------- */

/* `batch` products C_i [m,n] (+)= op(A_i) op(B_i), packed row-major, the
 * i-th at A + i*sa, B + i*sb, C + i*sc. */
static int dt__device_gemm_batched(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                   const float *A, int64_t sa, const float *B, int64_t sb, float beta, float *C,
                                   int64_t sc, int64_t batch) {
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = C;
  r.p[1] = (float *)(uintptr_t)A;
  r.p[2] = (float *)(uintptr_t)B;
  r.n[0] = m;
  r.n[1] = n;
  r.n[2] = k;
  r.n[3] = ta | (tb << 1);
  r.n[4] = batch;
  r.n[5] = sa;
  r.n[6] = sb;
  r.n[7] = sc;
  r.f[0] = 1.0f;
  r.f[1] = beta;
  return dt__dev_run(g, op, DTRAIN_K_GEMM, &r);
}

/* C [m,n] (+)= op(A) op(B), packed row-major. */
static int dt__device_gemm(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                           const float *A, const float *B, float beta, float *C) {
  return dt__device_gemm_batched(g, op, ta, tb, m, n, k, A, 0, B, 0, beta, C, 0, 1);
}

static void dt__device_matmul_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t m = y->iaux[0], k = y->iaux[1], n = y->iaux[2];
  if (ga && !dt__device_gemm(g, y->op, 0, 1, m, k, n, y->grad, b->data, 1.0f, ga)) return; /* dA += dC B^T */
  if (gb) dt__device_gemm(g, y->op, 1, 0, k, n, m, a->data, y->grad, 1.0f, gb);            /* dB += A^T dC */
}

DTRAIN_PRIVATE dt_tensor *dt__dev_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1];
  if (b->shape[0] != k) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: inner dims differ (%s @ %s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  int64_t shape[2];
  shape[0] = m;
  shape[1] = n;
  dt_tensor *y = dt__new(g, op, 2, shape);
  if (!y) return NULL;
  if (!dt__device_gemm(g, op, 0, 0, m, n, k, a->data, b->data, 0.0f, y->data)) return NULL;
  y->iaux[0] = m;
  y->iaux[1] = k;
  y->iaux[2] = n;
  dt__record(g, y, op, dt__device_matmul_backward, a, b, NULL);
  return dt__finish(g, y);
}

static void dt__device_linear_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t rows = y->iaux[0], in = y->iaux[1], out = y->iaux[2];
  if (gx && !dt__device_gemm(g, y->op, 0, 0, rows, in, out, y->grad, w->data, 1.0f, gx)) return; /* dx += dy w */
  if (gw && !dt__device_gemm(g, y->op, 1, 0, out, in, rows, y->grad, x->data, 1.0f, gw)) return; /* dw += dy^T x */
  if (gb) {
    dt_kernel_args r;
    dt__dev_args0(&r);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.n[0] = rows * out;
    r.n[1] = out;
    r.f[0] = 1.0f;
    dt__dev_run(g, y->op, DTRAIN_K_ACC_ROWS, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int64_t rows,
                                         int64_t in, int64_t out, int ndim, const int64_t *shape) {
  const char *op = "dt_linear";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  if (b) { /* rows of bias, then GEMM with beta = 1: the CPU's order */
    dt_kernel_args r;
    dt__dev_args0(&r);
    r.p[0] = y->data;
    r.p[1] = b->data;
    r.n[0] = rows * out;
    r.n[1] = out;
    if (!dt__dev_run(g, op, DTRAIN_K_ROWS_COPY, &r)) return NULL;
  }
  if (!dt__device_gemm(g, op, 0, 1, rows, out, in, x->data, w->data, b ? 1.0f : 0.0f, y->data)) return NULL;
  y->iaux[0] = rows;
  y->iaux[1] = in;
  y->iaux[2] = out;
  dt__record(g, y, op, dt__device_linear_backward, x, w, b);
  return dt__finish(g, y);
}

/* ---- softmax / log_softmax over any axis ---------------------------------------------------- */

static void dt__device_softmax_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__dev_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_softmax_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = y->data;
  dt__dev_run(g, y->op, DTRAIN_K_SOFTMAX_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_softmax(dt_graph *g, dt_tensor *x, int ax, int is_log, const char *op) {
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t outer = 1, inner = 1, n = x->shape[ax];
  for (int d = 0; d < ax; d++) outer *= x->shape[d];
  for (int d = ax + 1; d < x->ndim; d++) inner *= x->shape[d];
  y->iaux[0] = outer * inner;
  y->iaux[1] = n;
  y->iaux[2] = inner;
  y->iaux[3] = is_log;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_SOFTMAX, &r)) return NULL;
  dt__record(g, y, op, dt__device_softmax_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- cross entropy ----------------------------------------------------------------------------
 * aux (host arena): the device labels and the per-row max / log-sum-exp. */
typedef struct dt__device_xent {
  int32_t *labels;
  float *rowloss, *mx, *ls;
} dt__device_xent;

static void dt__device_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const dt__device_xent *s = (const dt__device_xent *)y->aux;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.p[4] = y->grad;
  r.labels = s->labels;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[1];
  dt__dev_run(g, y->op, DTRAIN_K_XENT_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_xent(dt_graph *g, dt_tensor *x, const int32_t *labels, int64_t rows, int64_t c) {
  const char *op = "dt_cross_entropy";
  dt__device_xent *s = (dt__device_xent *)dt__arena_alloc(g, sizeof *s);
  if (!s) return NULL;
  s->labels = (int32_t *)dt__dev_arena(g, (size_t)rows * sizeof(int32_t));
  s->rowloss = dt__arena_floats(g, 3 * rows);
  if (!s->labels || !s->rowloss) return NULL;
  s->mx = s->rowloss + rows;
  s->ls = s->mx + rows;
  if (!dt__dev_copy(g, op, s->labels, labels, (size_t)rows * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = s->rowloss;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.labels = s->labels;
  r.n[0] = rows;
  r.n[1] = c;
  if (!dt__dev_run(g, op, DTRAIN_K_XENT, &r)) return NULL;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = s->rowloss;
  r.n[0] = rows;
  r.f[0] = (float)(1.0 / (double)rows);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  y->aux = s;
  y->iaux[0] = rows;
  y->iaux[1] = c;
  dt__record(g, y, op, dt__device_xent_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- mean squared error ------------------------------------------------------------------------- */

static void dt__device_mse_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = ga;
  r.p[1] = gb;
  r.p[2] = a->data;
  r.p[3] = b->data;
  r.p[4] = y->grad;
  r.n[0] = a->size;
  dt__dev_run(g, y->op, DTRAIN_K_MSE_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_mse(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  const char *op = "dt_mse";
  float *sq = dt__arena_floats(g, a->size);
  dt_tensor *y = sq ? dt__new(g, op, 0, NULL) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = sq;
  r.p[1] = a->data;
  r.p[2] = b->data;
  r.n[0] = a->size;
  if (!dt__dev_run(g, op, DTRAIN_K_SQDIFF, &r)) return NULL;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = sq;
  r.n[0] = a->size;
  r.f[0] = (float)(1.0 / (double)a->size);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  dt__record(g, y, op, dt__device_mse_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- convolution (im2col + one batched GEMM) and pooling -----------------------------
 * The forward keeps the column matrices of the whole batch ([N][K][P], in the
 * device arena) for the backward, which also needs one gradient column
 * buffer of the same size and, for the weight gradient, the N per-image
 * products [N][O][K] before they are summed. Each product is one strided
 * batched GEMM over the batch (the weight's stride 0), not one GEMM per image:
 * per-image launches left a GPU idle (8k CNN samples/s on an H100 whatever
 * the batch). */

static void dt__device_conv_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *w, const dt_tensor *y) {
  dt__dev_args0(r);
  r->n[0] = x->shape[0];
  r->n[1] = x->shape[1];
  r->n[2] = x->shape[2];
  r->n[3] = x->shape[3];
  r->n[4] = w->shape[2];
  r->n[5] = w->shape[3];
  r->n[6] = y->iaux[0];
  r->n[7] = y->iaux[1];
  r->n[8] = y->shape[2];
  r->n[9] = y->shape[3];
  r->n[10] = w->shape[0];
}

static void dt__device_conv_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  const float *col = (const float *)y->aux;
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t pp = y->shape[2] * y->shape[3];
  dt_kernel_args r;
  if (gb) {
    float *part = dt__arena_floats(g, n * o); /* per (image, channel) sums */
    if (!part) return;
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.p[2] = part;
    if (!dt__dev_run(g, y->op, DTRAIN_K_CONV_BIAS_BWD, &r)) return;
  }
  if (gw) {
    float *gwi = dt__arena_floats(g, n * o * k);
    if (!gwi) return;
    /* gwi_i [O,K] = gy_i [O,P] @ col_i^T, then gw += sum_i gwi_i */
    if (!dt__device_gemm_batched(g, y->op, 0, 1, o, k, pp, y->grad, o * pp, col, k * pp, 0.0f, gwi, o * k, n)) return;
    dt__dev_args0(&r);
    r.p[0] = gw;
    r.p[1] = gwi;
    r.n[0] = n * o * k;
    r.n[1] = o * k;
    r.f[0] = 1.0f;
    if (!dt__dev_run(g, y->op, DTRAIN_K_ACC_ROWS, &r)) return;
  }
  if (gx) {
    float *gcol = dt__arena_floats(g, n * k * pp);
    if (!gcol) return;
    /* gcol_i [K,P] = w^T @ gy_i */
    if (!dt__device_gemm_batched(g, y->op, 1, 0, k, pp, o, w->data, 0, y->grad, o * pp, 0.0f, gcol, k * pp, n)) return;
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gx;
    r.p[1] = gcol;
    dt__dev_run(g, y->op, DTRAIN_K_COL2IM_ACC, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  const char *op = "dt_conv2d";
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t ho = (x->shape[2] + 2 * (int64_t)padding - w->shape[2]) / stride + 1;
  int64_t wo = (x->shape[3] + 2 * (int64_t)padding - w->shape[3]) / stride + 1, pp = ho * wo;
  int64_t shape[4];
  shape[0] = n;
  shape[1] = o;
  shape[2] = ho;
  shape[3] = wo;
  size_t cols;
  if (!dt__mul_size((size_t)n, (size_t)k, &cols) || !dt__mul_size(cols, (size_t)pp, &cols) || dt__too_many(cols)) {
    char sx[96], sw[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrices of x %s, w %s too large", op,
                                 dt_shape_str(x, sx, sizeof sx), dt_shape_str(w, sw, sizeof sw));
  }
  dt_tensor *y = dt__new(g, op, 4, shape);
  float *col = y ? dt__arena_floats(g, (int64_t)cols) : NULL;
  if (!col) return NULL;
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt_kernel_args r;
  dt__device_conv_args(&r, x, w, y);
  r.p[0] = col;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_IM2COL, &r)) return NULL;
  if (b) {
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = y->data;
    r.p[1] = b->data;
    if (!dt__dev_run(g, op, DTRAIN_K_CONV_BIAS, &r)) return NULL;
  }
  /* y_i [O,P] = w [O,K] @ col_i [K,P] (+ bias) */
  if (!dt__device_gemm_batched(g, op, 0, 0, o, pp, k, w->data, 0, col, k * pp, b ? 1.0f : 0.0f, y->data, o * pp, n))
    return NULL;
  y->aux = col;
  dt__record(g, y, op, dt__device_conv_backward, x, w, b);
  return dt__finish(g, y);
}

static void dt__device_pool_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *y) {
  dt__dev_args0(r);
  r->n[0] = x->shape[0] * x->shape[1];
  r->n[1] = x->shape[2];
  r->n[2] = x->shape[3];
  r->n[3] = y->shape[2];
  r->n[4] = y->shape[3];
  r->n[5] = y->iaux[0];
  r->n[6] = y->iaux[1];
}

static void dt__device_pool_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = y->data;
  dt__dev_run(g, y->op, y->iaux[2] ? DTRAIN_K_MAXPOOL_BWD : DTRAIN_K_AVGPOOL_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_pool(dt_graph *g, dt_tensor *x, int kernel, int stride, int is_max, const char *op) {
  int64_t shape[4];
  shape[0] = x->shape[0];
  shape[1] = x->shape[1];
  shape[2] = (x->shape[2] - kernel) / stride + 1;
  shape[3] = (x->shape[3] - kernel) / stride + 1;
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  y->iaux[0] = kernel;
  y->iaux[1] = stride;
  y->iaux[2] = is_max;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, is_max ? DTRAIN_K_MAXPOOL : DTRAIN_K_AVGPOOL, &r)) return NULL;
  dt__record(g, y, op, dt__device_pool_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- batched matmul: one strided-batched GEMM per product --------------------------------
 * y's iaux is dt_ops_matmul.c's layout: 0 batch, 1 M, 2 K, 3 N, 4 trans_b,
 * 5 shared (b 2-D: the batch folds into the rows, one GEMM). The products
 * and their backward are the CPU's, with the batch as one GEMM call. */

static void dt__device_bmm_dims(const dt_tensor *y, int64_t *nb, int64_t *m) {
  int shared = (int)y->iaux[5];
  *nb = shared ? 1 : y->iaux[0];
  *m = shared ? y->iaux[0] * y->iaux[1] : y->iaux[1];
}

static void dt__device_bmm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  int64_t sa = m * k, sb = shared ? 0 : k * n, sc = m * n;
  if (ga) { /* dA += dC @ op(B)^T */
    if (!dt__device_gemm_batched(g, y->op, 0, trans_b ? 0 : 1, m, k, n, y->grad, sc, b->data, sb, 1.0f, ga, sa, nb))
      return;
  }
  if (gb) { /* dB += A^T @ dC, or dB^T += dC^T @ A when B is used transposed */
    if (trans_b) dt__device_gemm_batched(g, y->op, 1, 0, n, k, m, y->grad, sc, a->data, sa, 1.0f, gb, sb, nb);
    else dt__device_gemm_batched(g, y->op, 1, 0, k, n, m, a->data, sa, y->grad, sc, 1.0f, gb, sb, nb);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_bmm(dt_graph *g, dt_tensor *y, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  if (!dt__device_gemm_batched(g, op, 0, trans_b, m, n, k, a->data, m * k, b->data, shared ? 0 : k * n, 0.0f, y->data,
                               m * n, nb))
    return NULL;
  dt__record(g, y, op, dt__device_bmm_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- dropout: the mask drawn on the host from the graph's RNG (the CPU op's
 * draws, in the same order), copied to the device; y = x * mask, and the
 * backward gx += gy * mask. ------------------------------------------------------------------ */

static void dt__device_dropout_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = (float *)y->aux;
  r.n[0] = y->size;
  r.n[1] = y->size;
  dt__dev_run(g, y->op, DTRAIN_K_ACC_MUL, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_dropout(dt_graph *g, dt_tensor *x, float p) {
  const char *op = "dt_dropout";
  size_t bytes;
  if (!dt__mul_size((size_t)x->size, sizeof(float), &bytes))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: mask of %lld floats overflows", op, (long long)x->size);
  float *host = (float *)dt__arena_alloc(g, bytes); /* host arena: no allocation in steady state */
  float *mask = host ? dt__arena_floats(g, x->size) : NULL;
  dt_tensor *y = mask ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < x->size; i++) host[i] = dt_rng_uniform(&g->rng) >= p ? scale : 0.0f;
  if (!dt__dev_copy(g, op, mask, host, bytes, DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = mask;
  r.n[0] = y->size;
  r.n[1] = y->size;
  if (!dt__dev_run(g, op, DTRAIN_K_MUL, &r)) return NULL;
  y->aux = mask;
  y->faux[0] = p;
  dt__record(g, y, op, dt__device_dropout_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- layer norm over the last dim ------------------------------------------------------------
 * aux: the device stats [mean[rows], rstd[rows]]; iaux 0 rows, 1 d. */

static void dt__device_layer_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  if (gg || gb) {
    dt__dev_args0(&r);
    r.p[0] = gg;
    r.p[1] = gb;
    r.p[2] = y->grad;
    r.p[3] = x->data;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    if (!dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD_PARAMS, &r)) return;
  }
  if (gx) {
    dt__dev_args0(&r);
    r.p[0] = gx;
    r.p[1] = y->grad;
    r.p[2] = x->data;
    r.p[3] = gamma ? gamma->data : NULL;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps,
                                             int64_t rows, int64_t d) {
  const char *op = "dt_layer_norm";
  float *stats = dt__arena_floats(g, 2 * rows);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = gamma ? gamma->data : NULL;
  r.p[3] = beta ? beta->data : NULL;
  r.p[4] = stats;
  r.n[0] = rows;
  r.n[1] = d;
  r.f[0] = eps;
  if (!dt__dev_run(g, op, DTRAIN_K_LAYER_NORM, &r)) return NULL;
  y->aux = stats;
  y->iaux[0] = rows;
  y->iaux[1] = d;
  dt__record(g, y, op, dt__device_layer_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* ---- embedding: ids checked on the host (by dt_embedding), copied to the device ------------
 * aux: the device ids. */

static void dt__device_embedding_backward(dt_graph *g, dt_tensor *y) {
  float *gt = dt__grad(g, y->src[0]);
  if (!gt) return;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = gt;
  r.p[1] = y->grad;
  r.labels = (const int32_t *)y->aux;
  r.n[0] = y->shape[0];
  r.n[1] = y->shape[1];
  dt__dev_run(g, y->op, DTRAIN_K_EMBED_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, int64_t d) {
  const char *op = "dt_embedding";
  int64_t shape[2];
  shape[0] = n;
  shape[1] = d;
  dt_tensor *y = dt__new(g, op, 2, shape); /* validates the size, so n * 4 bytes cannot overflow */
  int32_t *dids = y ? (int32_t *)dt__dev_arena(g, (size_t)n * sizeof(int32_t)) : NULL;
  if (!dids) return NULL;
  if (!dt__dev_copy(g, op, dids, ids, (size_t)n * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__dev_args0(&r);
  r.p[0] = y->data;
  r.p[1] = table->data;
  r.labels = dids;
  r.n[0] = n;
  r.n[1] = d;
  if (!dt__dev_run(g, op, DTRAIN_K_EMBED, &r)) return NULL;
  y->aux = dids;
  dt__record(g, y, op, dt__device_embedding_backward, table, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- batch norm ------------------------------------------------------------------------------
 * aux: the device stats [mean[C], rstd[C]]; iaux as the CPU op: 0 N, 1 C, 2 hw,
 * 3 batch statistics used. */

static void dt__device_bn_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__dev_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_bn_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  float *red = dt__arena_floats(g, 2 * y->iaux[1]);
  if (!red) return;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = gg;
  r.p[1] = gb;
  r.p[2] = y->grad;
  r.p[3] = x->data;
  r.p[4] = (float *)y->aux;
  r.p[5] = red;
  if (!dt__dev_run(g, y->op, DTRAIN_K_BN_BWD_CH, &r) || !gx) return;
  dt__device_bn_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = (float *)y->aux;
  r.p[4] = gamma ? gamma->data : NULL;
  r.p[5] = red;
  dt__dev_run(g, y->op, DTRAIN_K_BN_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                             dt_tensor *running_mean, dt_tensor *running_var, float momentum,
                                             float eps, int64_t nb, int64_t c, int64_t hw, int batch) {
  const char *op = "dt_batch_norm";
  if (!batch) { /* the CPU op's check of the running variance: c floats come to the host */
    float *h = (float *)dt__arena_alloc(g, (size_t)c * sizeof(float));
    if (!h || !dt__dev_copy(g, op, h, running_var->data, (size_t)c * sizeof(float), DTRAIN_COPY_D2H)) return NULL;
    for (int64_t ch = 0; ch < c; ch++)
      if (!(h[ch] + eps > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: running_var[%lld] + eps is %g (must be > 0)", op,
                                     (long long)ch, (double)(h[ch] + eps));
  }
  float *stats = dt__arena_floats(g, 2 * c);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  y->aux = stats;
  y->iaux[0] = nb;
  y->iaux[1] = c;
  y->iaux[2] = hw;
  y->iaux[3] = batch;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = stats;
  r.p[1] = x->data;
  r.p[2] = running_mean ? running_mean->data : NULL;
  r.p[3] = running_var ? running_var->data : NULL;
  r.f[0] = eps;
  r.f[1] = momentum;
  if (!dt__dev_run(g, op, DTRAIN_K_BN_STATS, &r)) return NULL;
  dt__device_bn_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = stats;
  r.p[3] = gamma ? gamma->data : NULL;
  r.p[4] = beta ? beta->data : NULL;
  if (!dt__dev_run(g, op, DTRAIN_K_BN, &r)) return NULL;
  dt__record(g, y, op, dt__device_bn_backward, x, gamma, beta);
  return dt__finish(g, y);
}
