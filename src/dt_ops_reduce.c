/* ===========================================================================
 * dt_ops_reduce.c -- reductions: sum and mean, over everything or one axis
 * ===========================================================================
 * Sums are accumulated in double, always in the same order (ascending index
 * along the reduced elements), so results are accurate and deterministic.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* Doubles accumulated at once by the axis reduction (stack buffer). */
#define DT__REDUCE_BLOCK 256

/* ---- all elements -> scalar --------------------------------------------------------
 * faux[0] is the scale (1 for sum, 1/size for mean). */

static void dt__reduce_all_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  float v = y->grad[0] * y->faux[0];
  for (int64_t i = 0; i < x->size; i++) gx[i] += v;
}

static dt_tensor *dt__reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (g->device) return dt__dev_reduce_all(g, x, mean, op);
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  const float *xd = x->data;
  double acc = 0.0;
  for (int64_t i = 0; i < x->size; i++) acc += (double)xd[i];
  if (mean) acc /= (double)x->size;
  y->data[0] = (float)acc;
  y->faux[0] = mean ? (float)(1.0 / (double)x->size) : 1.0f;
  dt__record(g, y, op, dt__reduce_all_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_sum(dt_graph *g, dt_tensor *x) { return dt__reduce_all(g, x, 0, "dt_sum"); }
DTRAIN_API dt_tensor *dt_mean(dt_graph *g, dt_tensor *x) { return dt__reduce_all(g, x, 1, "dt_mean"); }

/* ---- one axis -------------------------------------------------------------------------
 * x is viewed as [outer, len, inner] with len the reduced dim; y as [outer, inner].
 * iaux: 0 outer, 1 len, 2 inner, 3 mean; faux[0] the scale. */

static void dt__reduce_axis_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t outer = y->iaux[0], len = y->iaux[1], inner = y->iaux[2];
  float s = y->faux[0];
  const float *go = y->grad;
  for (int64_t o = 0; o < outer; o++) {
    const float *gorow = go + o * inner;
    float *gxo = gx + o * len * inner;
    for (int64_t k = 0; k < len; k++) {
      float *gxr = gxo + k * inner;
      for (int64_t i = 0; i < inner; i++) gxr[i] += gorow[i] * s;
    }
  }
}

static dt_tensor *dt__reduce_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim, int mean, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: axis %d out of range for %s (rank %d)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  int64_t shape[DTRAIN_MAX_DIMS] = {0};
  int nd = 0;
  int64_t outer = 1, len = x->shape[ax], inner = 1;
  for (int d = 0; d < x->ndim; d++) {
    if (d < ax) outer *= x->shape[d];
    if (d > ax) inner *= x->shape[d];
    if (d != ax) shape[nd++] = x->shape[d];
    else if (keepdim) shape[nd++] = 1;
  }
  if (g->device) return dt__dev_reduce_axis(g, x, nd, shape, outer, len, inner, mean, op);
  dt_tensor *y = dt__new(g, op, nd, shape);
  if (!y) return NULL;
  const float *xd = x->data;
  float *yd = y->data;
  double dlen = (double)len;
  double acc[DT__REDUCE_BLOCK];
  for (int64_t o = 0; o < outer; o++) {
    const float *xo = xd + o * len * inner;
    for (int64_t i0 = 0; i0 < inner; i0 += DT__REDUCE_BLOCK) {
      int64_t nb = DT__MIN(inner - i0, (int64_t)DT__REDUCE_BLOCK);
      for (int64_t i = 0; i < nb; i++) acc[i] = 0.0;
      for (int64_t k = 0; k < len; k++) {
        const float *xr = xo + k * inner + i0;
        for (int64_t i = 0; i < nb; i++) acc[i] += (double)xr[i];
      }
      float *yr = yd + o * inner + i0;
      for (int64_t i = 0; i < nb; i++) yr[i] = (float)(mean ? acc[i] / dlen : acc[i]);
    }
  }
  y->iaux[0] = outer;
  y->iaux[1] = len;
  y->iaux[2] = inner;
  y->iaux[3] = mean;
  y->faux[0] = mean ? (float)(1.0 / dlen) : 1.0f;
  dt__record(g, y, op, dt__reduce_axis_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_sum_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim) {
  return dt__reduce_axis(g, x, axis, keepdim, 0, "dt_sum_axis");
}

DTRAIN_API dt_tensor *dt_mean_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim) {
  return dt__reduce_axis(g, x, axis, keepdim, 1, "dt_mean_axis");
}

#undef DT__REDUCE_BLOCK

/* ---- metrics on plain arrays -------------------------------------------------------- */

static int32_t dt__argmax_row(const float *row, int64_t cols) {
  int64_t best = 0;
  for (int64_t c = 1; c < cols; c++)
    if (row[c] > row[best] || (row[best] != row[best] && row[c] == row[c])) best = c; /* NaN never wins */
  return (int32_t)best;
}

static dt_result dt__metric_args(const char *fn, const void *x, const void *out, int64_t rows, int64_t cols) {
  if (!x || (!out && rows > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  if (rows < 0 || cols < 1 || cols > INT32_MAX)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %lld rows of %lld columns", fn, (long long)rows, (long long)cols);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_argmax_rows(const float *x, int64_t rows, int64_t cols, int32_t *out) {
  dt_result r = dt__metric_args("dt_argmax_rows", x, out, rows, cols);
  if (r != DTRAIN_OK) return r;
  for (int64_t i = 0; i < rows; i++) out[i] = dt__argmax_row(x + i * cols, cols);
  return DTRAIN_OK;
}

DTRAIN_API int64_t dt_count_correct(const float *logits, const int32_t *labels, int64_t rows, int64_t classes) {
  dt_result r = dt__metric_args("dt_count_correct", logits, labels, rows, classes);
  if (r != DTRAIN_OK) return r;
  int64_t ok = 0;
  for (int64_t i = 0; i < rows; i++) {
    if (labels[i] < 0 || labels[i] >= classes)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_count_correct: label %d at row %lld is outside [0, %lld)",
                       (int)labels[i], (long long)i, (long long)classes);
    ok += dt__argmax_row(logits + i * classes, classes) == labels[i];
  }
  return ok;
}
