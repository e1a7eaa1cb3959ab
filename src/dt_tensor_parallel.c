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

/* ---- vocabulary-parallel embedding and cross-entropy ------------------------------------------
 * embedding aux: the ids (int32, n); iaux: n, D, the rank's first id, its rows.
 * cross-entropy aux: labels (int32, rows, padded to 4), then per row the
 * global max m and log(sum exp(x - m)) over all ranks; iaux: rows, local
 * columns, the labels' padded floats, the rank's first column. */

static void dt__tp_emb_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *table = y->src[0];
  float *gt = dt__grad(g, table);
  if (!gt) return;
  const int32_t *ids = (const int32_t *)y->aux;
  int64_t n = y->iaux[0], D = y->iaux[1], first = y->iaux[2], rows = y->iaux[3];
  for (int64_t i = 0; i < n; i++) {
    int64_t r = (int64_t)ids[i] - first;
    if (r < 0 || r >= rows) continue;
    for (int64_t j = 0; j < D; j++) gt[r * D + j] += y->grad[i * D + j];
  }
}

DTRAIN_API dt_tensor *dt_tp_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, dt_comm *c,
                                      int rank) {
  const char *op = "dt_tp_embedding";
  if (!dt__tp_begin(g, op, table, c, rank)) return NULL;
  char sb[96];
  if (table->ndim != 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: table %s, expected [V/T, D]", op,
                                 dt_shape_str(table, sb, sizeof sb));
  if (!ids || n < 1) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: %s", op, !ids ? "ids is NULL" : "no ids");
  int64_t rows = table->shape[0], D = table->shape[1], V = rows * dt_comm_world(c), first = rows * rank;
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || (int64_t)ids[i] >= V)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: id %d at %lld is out of range [0,%lld)", op, (int)ids[i],
                                   (long long)i, (long long)V);
  int64_t shape[2] = {n, D};
  int32_t *keep = (int32_t *)dt__arena_alloc(g, (size_t)n * sizeof(int32_t));
  dt_tensor *part = keep ? dt__new(g, op, 2, shape) : NULL;
  if (!part) return NULL;
  memcpy(keep, ids, (size_t)n * sizeof(int32_t));
  for (int64_t i = 0; i < n; i++) {
    int64_t r = (int64_t)ids[i] - first;
    if (r >= 0 && r < rows) memcpy(part->data + i * D, table->data + r * D, (size_t)D * sizeof(float));
    else memset(part->data + i * D, 0, (size_t)D * sizeof(float));
  }
  part->aux = keep;
  part->iaux[0] = n;
  part->iaux[1] = D;
  part->iaux[2] = first;
  part->iaux[3] = rows;
  dt__record(g, part, op, dt__tp_emb_backward, table, NULL, NULL);
  if (!dt__finish(g, part)) return NULL;
  return dt_tp_reduce(g, part, c, rank);
}

static void dt__tp_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t rows = y->iaux[0], cl = y->iaux[1], first = y->iaux[3];
  const int32_t *labels = (const int32_t *)y->aux;
  const float *mx = (const float *)y->aux + y->iaux[2], *ls = mx + rows;
  float scale = y->grad[0] / (float)rows;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x->data + r * cl;
    float *gr = gx + r * cl;
    for (int64_t j = 0; j < cl; j++) gr[j] += expf((xr[j] - mx[r]) - ls[r]) * scale;
    int64_t t = (int64_t)labels[r] - first;
    if (t >= 0 && t < cl) gr[t] -= scale;
  }
}

DTRAIN_API dt_tensor *dt_tp_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels, dt_comm *c,
                                          int rank) {
  const char *op = "dt_tp_cross_entropy";
  if (!dt__tp_begin(g, op, logits, c, rank)) return NULL;
  char sb[96];
  if (logits->ndim != 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: logits %s, expected [N, V/T]", op,
                                 dt_shape_str(logits, sb, sizeof sb));
  if (!labels) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: labels is NULL", op);
  int64_t T = dt_comm_world(c), rows = logits->shape[0], cl = logits->shape[1], V = cl * T, first = cl * rank;
  for (int64_t r = 0; r < rows; r++)
    if (labels[r] < 0 || (int64_t)labels[r] >= V)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: label %d of row %lld is out of range [0,%lld)", op,
                                   (int)labels[r], (long long)r, (long long)V);
  int64_t lab_floats = (rows + 3) / 4 * 4;
  float *aux = dt__arena_floats(g, lab_floats + 2 * rows);
  float *maxes = dt__arena_zeros(g, T * rows), *sums = dt__arena_floats(g, 2 * rows);
  dt_tensor *y = aux && maxes && sums ? dt__new(g, op, 0, NULL) : NULL;
  if (!y) return NULL;
  int32_t *lab = (int32_t *)(void *)aux;
  float *mx = aux + lab_floats, *ls = mx + rows;
  memcpy(lab, labels, (size_t)rows * sizeof(int32_t));
  /* Every rank's row maxima side by side (the others' blocks zero), summed: each rank sees all of them. */
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = logits->data + r * cl;
    float m = xr[0];
    for (int64_t j = 1; j < cl; j++) m = DT__MAX(m, xr[j]);
    maxes[rank * rows + r] = m;
  }
  if (!dt__tp_allreduce(g, op, c, rank, maxes, T * rows)) return NULL;
  for (int64_t r = 0; r < rows; r++) {
    float m = maxes[r];
    for (int64_t k = 1; k < T; k++) m = DT__MAX(m, maxes[k * rows + r]);
    mx[r] = m;
    const float *xr = logits->data + r * cl;
    double s = 0.0;
    for (int64_t j = 0; j < cl; j++) s += (double)expf(xr[j] - m);
    int64_t t = (int64_t)lab[r] - first;
    sums[r] = (float)s;
    sums[rows + r] = t >= 0 && t < cl ? xr[t] : 0.0f;
  }
  if (!dt__tp_allreduce(g, op, c, rank, sums, 2 * rows)) return NULL;
  double loss = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    double l = log((double)sums[r]);
    ls[r] = (float)l;
    loss += l + ((double)mx[r] - (double)sums[rows + r]);
  }
  y->data[0] = (float)(loss / (double)rows);
  y->aux = aux;
  y->iaux[0] = rows;
  y->iaux[1] = cl;
  y->iaux[2] = lab_floats;
  y->iaux[3] = first;
  dt__record(g, y, op, dt__tp_xent_backward, logits, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_tp_attention(dt_graph *g, dt_tensor *x, dt_tensor *w_qkv, dt_tensor *b_qkv,
                                      dt_tensor *w_proj, dt_tensor *b_proj, int heads, dt_comm *c, int rank) {
  const char *op = "dt_tp_attention";
  if (!dt__tp_begin(g, op, x, c, rank)) return NULL;
  int64_t T = dt_comm_world(c);
  if (x->ndim != 3) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: input %s, expected [B,S,C]", op, dt_shape_str(x, sb, sizeof sb));
  }
  int64_t B = x->shape[0], S = x->shape[1], C = x->shape[2];
  if (heads < 1 || heads % T != 0 || C % heads != 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: %d heads over %lld ranks and %lld features: heads must "
                                 "divide by the ranks and the features by the heads", op, heads, (long long)T,
                                 (long long)C);
  int64_t Hl = heads / T, D = C / heads, Cl = C / T;
  static const int to_heads[4] = {0, 2, 1, 3}; /* [B,S,H,D] <-> [B,H,S,D] */
  int64_t s2[2] = {B * S, C}, s3[3] = {B, S, 3 * Cl}, s4[4] = {B, S, Hl, D}, y2[2] = {B * S, Cl}, o3[3] = {B, S, C};
  dt_tensor *qkv = dt_reshape(g, dt_tp_column_linear(g, dt_reshape(g, x, 2, s2), w_qkv, b_qkv, c, rank, 0), 3, s3);
  dt_tensor *p[3] = {NULL, NULL, NULL};
  if (!qkv || dt_split(g, qkv, 2, 3, p) != DTRAIN_OK) return NULL;
  dt_tensor *q = dt_permute(g, dt_reshape(g, p[0], 4, s4), to_heads);
  dt_tensor *k = dt_permute(g, dt_reshape(g, p[1], 4, s4), to_heads);
  dt_tensor *v = dt_permute(g, dt_reshape(g, p[2], 4, s4), to_heads);
  dt_tensor *att = dt_mul_scalar(g, dt_bmm(g, q, k, 1), 1.0f / sqrtf((float)D)); /* [B,Hl,S,S] */
  att = dt_softmax(g, dt_causal_mask(g, att), -1);
  dt_tensor *y = dt_reshape(g, dt_permute(g, dt_bmm(g, att, v, 0), to_heads), 2, y2); /* [B*S, Cl] */
  return dt_reshape(g, dt_tp_row_linear(g, y, w_proj, b_proj, c, rank), 3, o3);
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

DTRAIN_API dt_result dt_tp_shard_qkv(const float *full, int64_t rows3, int64_t cols, int T, int rank, float *out) {
  if (rows3 % 3 != 0) return dt__error(DTRAIN_ERR_SHAPE, "dt_tp_shard_qkv: %lld rows are not three blocks", (long long)rows3);
  int64_t third = rows3 / 3;
  dt_result rc = dt__tp_shard_check("dt_tp_shard_qkv", full, out, rows3, cols, T, rank, third);
  for (int b = 0; b < 3 && rc == DTRAIN_OK; b++)
    rc = dt_tp_shard_rows(full + b * third * cols, third, cols, T, rank, out + b * (third / T) * cols);
  return rc;
}

DTRAIN_API dt_result dt_tp_unshard_qkv(float *full, int64_t rows3, int64_t cols, int T, int rank, const float *part) {
  if (rows3 % 3 != 0)
    return dt__error(DTRAIN_ERR_SHAPE, "dt_tp_unshard_qkv: %lld rows are not three blocks", (long long)rows3);
  int64_t third = rows3 / 3;
  dt_result rc = dt__tp_shard_check("dt_tp_unshard_qkv", full, part, rows3, cols, T, rank, third);
  for (int b = 0; b < 3 && rc == DTRAIN_OK; b++)
    rc = dt_tp_unshard_rows(full + b * third * cols, third, cols, T, rank, part + b * (third / T) * cols);
  return rc;
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
