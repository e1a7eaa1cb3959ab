/* ===========================================================================
 * dt_ops_matmul.c -- matmul, batched matmul, linear (all on dt_sgemm)
 * ===========================================================================
 * Forward and backward are GEMM calls with the transpose flags; backward
 * passes beta = 1 so that it accumulates into the gradient buffers.
 *
 * dt_matmul and dt_bmm share one core over a batch of `nb` products
 * [M,K] @ op(B) -> [M,N]. When B is one 2-D matrix shared by the batch,
 * the batch folds into the rows: [nb*M, K] @ op(B) is a single GEMM, and
 * so are both backward products (the one for B sums over the batch).
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* iaux layout of a matmul/bmm output. */
enum { DT__MM_NB, DT__MM_M, DT__MM_K, DT__MM_N, DT__MM_TRANS_B, DT__MM_SHARED };

/* From y's iaux: the number of GEMMs (*nb) and the rows of A and C in each
 * (*m); a shared b makes it one GEMM over all the rows. */
static void dt__matmul_dims(const dt_tensor *y, int64_t *nb, int64_t *m) {
  int shared = (int)y->iaux[DT__MM_SHARED];
  *nb = shared ? 1 : y->iaux[DT__MM_NB];
  *m = shared ? y->iaux[DT__MM_NB] * y->iaux[DT__MM_M] : y->iaux[DT__MM_M];
}

static void dt__matmul_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t nb, m, k = y->iaux[DT__MM_K], n = y->iaux[DT__MM_N];
  int trans_b = (int)y->iaux[DT__MM_TRANS_B], shared = (int)y->iaux[DT__MM_SHARED];
  dt__matmul_dims(y, &nb, &m);
  int64_t sa = m * k, sb = shared ? 0 : k * n, sc = m * n;
  const float *gy = y->grad;
  for (int64_t i = 0; i < nb; i++) {
    const float *ai = a->data + i * sa, *bi = b->data + i * sb, *gyi = gy + i * sc;
    if (ga) { /* dA += dC @ op(B)^T */
      if (trans_b) dt_sgemm(0, 0, m, k, n, 1.0f, gyi, n, bi, k, 1.0f, ga + i * sa, k);
      else dt_sgemm(0, 1, m, k, n, 1.0f, gyi, n, bi, n, 1.0f, ga + i * sa, k);
    }
    if (gb) { /* dB += A^T @ dC, or dB^T += dC^T @ A when B is used transposed */
      if (trans_b) dt_sgemm(1, 0, n, k, m, 1.0f, gyi, n, ai, k, 1.0f, gb + i * sb, k);
      else dt_sgemm(1, 0, k, n, m, 1.0f, ai, k, gyi, n, 1.0f, gb + i * sb, n);
    }
  }
}

/* The shared core: a [..., M, K] @ b [..., K, N] (b [..., N, K] with
 * trans_b) with equal leading dims, or b 2-D and shared by the batch. */
static dt_tensor *dt__matmul(dt_graph *g, const char *op, dt_tensor *a, dt_tensor *b, int trans_b) {
  char s1[96], s2[96];
  int nd = a->ndim;
  if (a->ndim < 2 || b->ndim < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: operands must have at least 2 dims (%s @ %s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  int shared = b->ndim == 2;
  if (!shared) {
    int same = b->ndim == nd;
    for (int d = 0; same && d < nd - 2; d++) same = a->shape[d] == b->shape[d];
    if (!same)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE,
                                   "%s: batch dims differ (%s @ %s); b must have a's leading dims or be 2-D", op,
                                   dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  int64_t m = a->shape[nd - 2], k = a->shape[nd - 1];
  int64_t bk = trans_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2];
  int64_t n = trans_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
  if (bk != k)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: inner dims differ (%s @ %s%s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2),
                                 trans_b ? "^T" : "");
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t nb = 1;
  for (int d = 0; d < nd - 2; d++) {
    shape[d] = a->shape[d];
    nb *= a->shape[d];
  }
  shape[nd - 2] = m;
  shape[nd - 1] = n;
  dt_tensor *y = dt__new(g, op, nd, shape);
  if (!y) return NULL;
  y->iaux[DT__MM_NB] = nb;
  y->iaux[DT__MM_M] = m;
  y->iaux[DT__MM_K] = k;
  y->iaux[DT__MM_N] = n;
  y->iaux[DT__MM_TRANS_B] = trans_b;
  y->iaux[DT__MM_SHARED] = shared;
  if (g->device) return dt__dev_bmm(g, y, a, b, op);
  int64_t gemms, rows;
  dt__matmul_dims(y, &gemms, &rows);
  int64_t sa = rows * k, sb = shared ? 0 : k * n, sc = rows * n;
  for (int64_t i = 0; i < gemms; i++)
    dt_sgemm(0, trans_b, rows, n, k, 1.0f, a->data + i * sa, k, b->data + i * sb, trans_b ? k : n, 0.0f,
             y->data + i * sc, n);
  dt__record(g, y, op, dt__matmul_backward, a, b, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  if (!dt__begin(g, "dt_matmul", 2, a, b)) return NULL;
  if (a->ndim != 2 || b->ndim != 2) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_matmul: operands must be 2-D (%s @ %s); see dt_bmm",
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  if (g->device) return dt__dev_matmul(g, a, b, "dt_matmul");
  return dt__matmul(g, "dt_matmul", a, b, 0);
}

DTRAIN_API dt_tensor *dt_bmm(dt_graph *g, dt_tensor *a, dt_tensor *b, int trans_b) {
  if (!dt__begin(g, "dt_bmm", 2, a, b)) return NULL;
  return dt__matmul(g, "dt_bmm", a, b, trans_b != 0);
}

/* ---- linear, and linear + ReLU --------------------------------------------------
 * x [..., in] viewed as [rows, in]; y [rows, out] = x @ w^T + b, or relu of
 * it (dt_linear_relu: the bias and the ReLU applied by the GEMM tile by tile,
 * dt__sgemm_epi). iaux[0] = rows, iaux[1] = in, iaux[2] = out. */

/* dx and dw from gy, and db from gy when sum_bias (dt_linear_relu sums it
 * while it masks gy). */
static void dt__linear_grads(dt_graph *g, dt_tensor *y, const float *gy, int sum_bias) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  /* dx and dw are written, not added, when nothing was added to them yet
   * (dt__grad_first: a fresh activation gradient, a parameter's deferred
   * one); the sgemm's beta 0 then never reads them. */
  int new_x, new_w;
  float *gx = dt__grad_first(g, x, &new_x), *gw = dt__grad_first(g, w, &new_w), *gb = sum_bias ? dt__grad(g, b) : NULL;
  if (g->err != DTRAIN_OK) return;
  int64_t rows = y->iaux[0], in = y->iaux[1], out = y->iaux[2];
  if (gx) dt_sgemm(0, 0, rows, in, out, 1.0f, gy, out, w->data, in, new_x ? 0.0f : 1.0f, gx, in); /* dx += dy @ w */
  if (gw) dt_sgemm(1, 0, out, in, rows, 1.0f, gy, out, x->data, in, new_w ? 0.0f : 1.0f, gw, in); /* dw += dy^T @ x */
  if (gb)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t o = 0; o < out; o++) gb[o] += gy[r * out + o];
}

static void dt__linear_backward(dt_graph *g, dt_tensor *y) {
  dt__linear_grads(g, y, y->grad, 1);
}

/* y's gradient is final when this node runs (as in dt_relu_inplace's
 * backward): it is masked where it stands, the bias gradient summed in the
 * same pass, in dt_relu_inplace's and dt_linear's order. */
static void dt__linear_relu_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *b = y->src[2];
  float *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt__relu_mask_rows(y->grad, y->data, y->iaux[0], y->iaux[2], gb);
  dt__linear_grads(g, y, y->grad, 0);
}

static dt_tensor *dt__linear(dt_graph *g, const char *op, dt_tensor *x, dt_tensor *w, dt_tensor *b, int relu) {
  if (b && b->graph != g) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: bias belongs to another graph", op);
  char s1[96], s2[96], s3[96];
  if (x->ndim < 1 || w->ndim != 2 || (b && b->ndim != 1))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK,
                                 "%s: expects x [...,in], weight [out,in], bias [out] (x %s, weight %s, bias %s)", op,
                                 dt_shape_str(x, s1, sizeof s1), dt_shape_str(w, s2, sizeof s2),
                                 b ? dt_shape_str(b, s3, sizeof s3) : "NULL");
  int64_t in = x->shape[x->ndim - 1], out = w->shape[0];
  if (w->shape[1] != in)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: weight %s does not match x %s (expected [out,%lld])",
                                 op, dt_shape_str(w, s2, sizeof s2), dt_shape_str(x, s1, sizeof s1),
                                 (long long)in);
  if (b && b->shape[0] != out)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: bias %s does not match weight %s (expected [%lld])", op,
                                 dt_shape_str(b, s3, sizeof s3), dt_shape_str(w, s2, sizeof s2),
                                 (long long)out);
  int64_t shape[DTRAIN_MAX_DIMS];
  for (int d = 0; d < x->ndim - 1; d++) shape[d] = x->shape[d];
  shape[x->ndim - 1] = out;
  int64_t rows = x->size / in;
  if (g->device) {
    dt_tensor *y = dt__dev_linear(g, x, w, b, rows, in, out, x->ndim, shape);
    return relu ? dt_relu_inplace(g, y) : y; /* on a device, two kernels */
  }
  dt_tensor *y = dt__new(g, op, x->ndim, shape);
  if (!y) return NULL;
  dt__gemm_epi ep = {b ? b->data : NULL, relu, NULL};
  dt__sgemm_epi(0, 1, rows, out, in, x->data, in, w->data, in, y->data, out, &ep);
  y->iaux[0] = rows;
  y->iaux[1] = in;
  y->iaux[2] = out;
  dt__record(g, y, op, relu ? dt__linear_relu_backward : dt__linear_backward, x, w, b);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
  if (!dt__begin(g, "dt_linear", 2, x, w)) return NULL;
  return dt__linear(g, "dt_linear", x, w, b, 0);
}

DTRAIN_API dt_tensor *dt_linear_relu(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
  if (!dt__begin(g, "dt_linear_relu", 2, x, w)) return NULL;
  return dt__linear(g, "dt_linear_relu", x, w, b, 1);
}
