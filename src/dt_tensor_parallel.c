/* ===========================================================================
 * dt_tensor_parallel.c -- tensor-parallel operators and layers (see
 * dt_tensor_parallel.h): autograd nodes that all-reduce on a communicator
 * ===========================================================================
 * A node keeps its communicator in aux and the caller's rank in iaux[0]; its
 * backward runs inside dt_backward, where every rank reaches the same nodes
 * in the same (reverse) order, so the all-reduces pair up.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_tensor_parallel.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"

/* Argument checks shared by the operators; 0 (graph failed) when bad. */
static int dt__tp_begin(dt_graph *g, const char *op, dt_tensor *x, dt_comm *c, int rank) {
  if (!dt__begin(g, op, 1, x)) return 0;
  if (g->device) {
    dt__fail(g, DTRAIN_ERR_UNSUPPORTED, "%s: tensor parallelism runs on CPU graphs only", op);
    return 0;
  }
  if (!c) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: communicator is NULL", op);
    return 0;
  }
  if (rank < 0 || rank >= dt_comm_world(c)) {
    dt__fail(g, DTRAIN_ERR_INDEX, "%s: rank %d outside [0, %d)", op, rank, dt_comm_world(c));
    return 0;
  }
  return 1;
}

/* In-place all-reduce of n floats; on failure the graph fails with the communicator's error. */
static int dt__tp_allreduce(dt_graph *g, const char *op, dt_comm *c, int rank, float *buf, int64_t n) {
  dt_result rc = dt_comm_allreduce(c, rank, buf, (size_t)n);
  if (rc == DTRAIN_OK) return 1;
  if (rc == DTRAIN_ERR_ABORTED)
    dt__fail(g, rc, "%s: rank %d: the communicator was aborted (another rank failed)", op, rank);
  else
    dt__fail(g, rc, "%s: rank %d: %s", op, rank, dt_last_error());
  return 0;
}

/* ---- copy: identity forward, all-reduce backward ------------------------------------------ */

static void dt__tp_copy_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  float *sum = dt__arena_floats(g, y->size);
  if (!sum) return;
  memcpy(sum, y->grad, (size_t)y->size * sizeof(float));
  if (!dt__tp_allreduce(g, "dt_tp_copy (backward)", (dt_comm *)y->aux, (int)y->iaux[0], sum, y->size)) return;
  for (int64_t i = 0; i < y->size; i++) gx[i] += sum[i];
}

DTRAIN_API dt_tensor *dt_tp_copy(dt_graph *g, dt_tensor *x, dt_comm *c, int rank) {
  if (!dt__tp_begin(g, "dt_tp_copy", x, c, rank)) return NULL;
  dt_tensor *y = dt__new_view(g, "dt_tp_copy", x->ndim, x->shape, x->data);
  if (!y) return NULL;
  y->aux = c;
  y->iaux[0] = rank;
  dt__record(g, y, "dt_tp_copy", dt__tp_copy_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- reduce: all-reduce forward, identity backward ----------------------------------------- */

static void dt__tp_pass_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  for (int64_t i = 0; i < y->size; i++) gx[i] += y->grad[i];
}

DTRAIN_API dt_tensor *dt_tp_reduce(dt_graph *g, dt_tensor *x, dt_comm *c, int rank) {
  if (!dt__tp_begin(g, "dt_tp_reduce", x, c, rank)) return NULL;
  dt_tensor *y = dt__new_like(g, "dt_tp_reduce", x);
  if (!y) return NULL;
  memcpy(y->data, x->data, (size_t)x->size * sizeof(float));
  if (!dt__tp_allreduce(g, "dt_tp_reduce", c, rank, y->data, y->size)) return NULL;
  dt__record(g, y, "dt_tp_reduce", dt__tp_pass_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- gather along the last axis --------------------------------------------------------------- */

static void dt__tp_gather_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t k = x->shape[x->ndim - 1], rows = x->size / k, T = y->iaux[1], r = y->iaux[0];
  for (int64_t i = 0; i < rows; i++) {
    const float *src = y->grad + i * T * k + r * k;
    for (int64_t j = 0; j < k; j++) gx[i * k + j] += src[j];
  }
}

DTRAIN_API dt_tensor *dt_tp_gather(dt_graph *g, dt_tensor *x, dt_comm *c, int rank) {
  if (!dt__tp_begin(g, "dt_tp_gather", x, c, rank)) return NULL;
  if (x->ndim < 1) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_tp_gather: input is a scalar");
  int64_t T = dt_comm_world(c), k = x->shape[x->ndim - 1], rows = x->size / k;
  int64_t shape[DTRAIN_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
  shape[x->ndim - 1] = T * k;
  dt_tensor *y = dt__new(g, "dt_tp_gather", x->ndim, shape);
  float *blocks = y ? dt__arena_zeros(g, T * x->size) : NULL;
  if (!y || !blocks) return NULL;
  /* Rank-major blocks, the others zero: an all-reduce leaves every rank's block
   * exactly (x + 0 == x) on every rank. */
  memcpy(blocks + rank * x->size, x->data, (size_t)x->size * sizeof(float));
  if (!dt__tp_allreduce(g, "dt_tp_gather", c, rank, blocks, T * x->size)) return NULL;
  for (int64_t r = 0; r < T; r++)
    for (int64_t i = 0; i < rows; i++)
      memcpy(y->data + i * T * k + r * k, blocks + r * x->size + i * k, (size_t)k * sizeof(float));
  y->iaux[0] = rank;
  y->iaux[1] = T;
  dt__record(g, y, "dt_tp_gather", dt__tp_gather_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- layers ----------------------------------------------------------------------------------- */

DTRAIN_API dt_tensor *dt_tp_column_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, dt_comm *c,
                                          int rank, int gather) {
  if (!dt__tp_begin(g, "dt_tp_column_linear", x, c, rank)) return NULL;
  dt_tensor *xc = dt_tp_copy(g, x, c, rank);
  dt_tensor *y = dt_linear(g, xc, w, b);
  return gather ? dt_tp_gather(g, y, c, rank) : y;
}

DTRAIN_API dt_tensor *dt_tp_row_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, dt_comm *c, int rank) {
  if (!dt__tp_begin(g, "dt_tp_row_linear", x, c, rank)) return NULL;
  dt_tensor *y = dt_tp_reduce(g, dt_linear(g, x, w, NULL), c, rank);
  return b ? dt_add(g, y, b) : y;
}

/* ---- shards ----------------------------------------------------------------------------------- */

static dt_result dt__tp_shard_check(const char *fn, const void *a, const void *b, int64_t rows, int64_t cols, int T,
                                    int rank, int64_t split) {
  if (!a || !b) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: a buffer is NULL", fn);
  if (rows < 1 || cols < 1 || T < 1 || rank < 0 || rank >= T)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: rows %lld, cols %lld, T %d, rank %d", fn, (long long)rows,
                     (long long)cols, T, rank);
  if (split % T != 0)
    return dt__error(DTRAIN_ERR_SHAPE, "%s: %lld does not divide into %d equal parts", fn, (long long)split, T);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tp_shard_rows(const float *full, int64_t rows, int64_t cols, int T, int rank, float *out) {
  dt_result rc = dt__tp_shard_check("dt_tp_shard_rows", full, out, rows, cols, T, rank, rows);
  if (rc != DTRAIN_OK) return rc;
  int64_t k = rows / T;
  memcpy(out, full + rank * k * cols, (size_t)(k * cols) * sizeof(float));
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tp_unshard_rows(float *full, int64_t rows, int64_t cols, int T, int rank, const float *part) {
  dt_result rc = dt__tp_shard_check("dt_tp_unshard_rows", full, part, rows, cols, T, rank, rows);
  if (rc != DTRAIN_OK) return rc;
  int64_t k = rows / T;
  memcpy(full + rank * k * cols, part, (size_t)(k * cols) * sizeof(float));
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tp_shard_cols(const float *full, int64_t rows, int64_t cols, int T, int rank, float *out) {
  dt_result rc = dt__tp_shard_check("dt_tp_shard_cols", full, out, rows, cols, T, rank, cols);
  if (rc != DTRAIN_OK) return rc;
  int64_t k = cols / T;
  for (int64_t i = 0; i < rows; i++) memcpy(out + i * k, full + i * cols + rank * k, (size_t)k * sizeof(float));
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tp_unshard_cols(float *full, int64_t rows, int64_t cols, int T, int rank, const float *part) {
  dt_result rc = dt__tp_shard_check("dt_tp_unshard_cols", full, part, rows, cols, T, rank, cols);
  if (rc != DTRAIN_OK) return rc;
  int64_t k = cols / T;
  for (int64_t i = 0; i < rows; i++) memcpy(full + i * cols + rank * k, part + i * k, (size_t)k * sizeof(float));
  return DTRAIN_OK;
}
