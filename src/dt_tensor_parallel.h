/* ===========================================================================
 * dt_tensor_parallel.h -- tensor parallelism (Megatron style): a layer's
 * weight split over the ranks of a communicator, with the all-reduces that
 * keep forward and backward exact
 * ===========================================================================
 * T ranks (a dt_comm: threads, or one rank per process; usually a group from
 * dt_comm_split) each hold a slice of a layer's weight. Two operators carry
 * the communication, each the other's mirror image:
 *
 *   dt_tp_copy(x)    forward: x unchanged; backward: the gradient all-reduced
 *                    (every rank's part of d(loss)/dx summed)
 *   dt_tp_reduce(x)  forward: x all-reduced (the partial results summed);
 *                    backward: the gradient unchanged
 *
 * and the layers are built from them:
 *
 *   dt_tp_column_linear  W [out, in] split by rows (output features): rank r
 *                        holds rows [r*out/T, (r+1)*out/T) and its bias slice;
 *                        y_r = x W_r^T + b_r is the rank's slice of the
 *                        output (gather != 0: all-gathered into the whole
 *                        output on every rank)
 *   dt_tp_row_linear     W [out, in] split by columns (input features): rank r
 *                        holds columns [r*in/T, (r+1)*in/T) and takes the
 *                        matching slice of x (what a column-parallel layer
 *                        gave it); y = all-reduce(x_r W_r^T) + b, b whole on
 *                        every rank
 *
 * so a column-parallel layer, an element-wise activation and a row-parallel
 * layer cost one all-reduce forward (in dt_tp_row_linear) and one backward
 * (in dt_tp_copy), whatever their sizes. Every rank ends with the same output
 * and, computing the same loss from it, the same gradient for every
 * replicated parameter (the row-parallel bias): the optimizers of the ranks
 * stay in step without further communication. The results equal the unsplit
 * layer's up to float rounding (the partial sums run in rank order).
 *
 * Every rank must build the same graph (the same layers in the same order):
 * the all-reduces pair up in that order, forward and backward. The sizes
 * must divide by T. CPU graphs only (a graph on a device: DTRAIN_ERR_UNSUPPORTED).
 * A communication failure fails the graph (forward) or dt_backward with the
 * communicator's error.
 */
#ifndef DTRAIN_TENSOR_PARALLEL_H
#define DTRAIN_TENSOR_PARALLEL_H

#include "dt_base.h"
#include "dt_tensor.h"
#include "dt_comm.h"

DTRAIN_EXTERN_C_BEGIN

DTRAIN_API dt_tensor *dt_tp_copy(dt_graph *g, dt_tensor *x, dt_comm *c, int rank);
DTRAIN_API dt_tensor *dt_tp_reduce(dt_graph *g, dt_tensor *x, dt_comm *c, int rank);
/* [..., k] on each rank -> [..., T*k], the ranks' parts side by side in rank
 * order; backward: each rank keeps its own part of the gradient. */
DTRAIN_API dt_tensor *dt_tp_gather(dt_graph *g, dt_tensor *x, dt_comm *c, int rank);

/* x [N, in] (whole), w [out/T, in], b [out/T] -> [N, out/T], or [N, out]
 * when gather; b may be NULL. */
DTRAIN_API dt_tensor *dt_tp_column_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, dt_comm *c,
                                          int rank, int gather);
/* x [N, in/T] (this rank's slice), w [out, in/T], b [out] (whole) -> [N, out]; b may be NULL. */
DTRAIN_API dt_tensor *dt_tp_row_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, dt_comm *c, int rank);

/* Vocabulary-parallel embedding: rank r holds rows [r*V/T, (r+1)*V/T) of
 * the whole [V, D] table (table: [V/T, D]); ids (n of them, 0 <= id < V,
 * copied) -> [n, D] on every rank (each rank looks up the ids it holds,
 * zeros for the others, and one all-reduce adds them; backward: each rank's
 * rows get the gradient of its ids). */
DTRAIN_API dt_tensor *dt_tp_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, dt_comm *c,
                                      int rank);
/* Vocabulary-parallel cross-entropy: logits [N, V/T] are rank r's columns
 * [r*V/T, (r+1)*V/T) of the whole [N, V] logits (what a column-parallel
 * output layer without gather gives); labels: N whole-vocabulary ids in
 * [0, V). -> the mean over rows of -log softmax(whole logits)[label], one
 * element, on every rank, without gathering the logits: one all-reduce for
 * the rows' maxima, one for their sums of exponentials and target logits.
 * Backward: each rank's logits get their part of softmax - one-hot. */
DTRAIN_API dt_tensor *dt_tp_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels, dt_comm *c,
                                          int rank);

/* Causal multi-head self-attention (dt_nn_attention's, with its heads split
 * over the T ranks): x [B,S,C] whole on every rank; rank r computes heads
 * [r*H/T, (r+1)*H/T) from w_qkv [3C/T, C] (its rows of the Q, K and V blocks
 * of the whole [3C, C] weight, in that order: dt_tp_shard_qkv) and b_qkv
 * [3C/T], and projects them with w_proj [C, C/T] (its columns of the output
 * projection) and b_proj [C] (whole) -> [B,S,C] on every rank. One
 * all-reduce forward (the projection) and one backward (the input). heads
 * must divide by T and C by heads; b_qkv and b_proj may be NULL. */
DTRAIN_API dt_tensor *dt_tp_attention(dt_graph *g, dt_tensor *x, dt_tensor *w_qkv, dt_tensor *b_qkv,
                                      dt_tensor *w_proj, dt_tensor *b_proj, int heads, dt_comm *c, int rank);
/* Rank `rank`'s rows of each third of a whole [3C, cols] qkv weight (cols 1:
 * the bias) into out [3C/T, cols]; dt_tp_unshard_qkv the other way. */
DTRAIN_API dt_result dt_tp_shard_qkv(const float *full, int64_t rows3, int64_t cols, int T, int rank, float *out);
DTRAIN_API dt_result dt_tp_unshard_qkv(float *full, int64_t rows3, int64_t cols, int T, int rank, const float *part);

/* Rank `rank`'s slice of a whole weight [rows, cols] (row-major) into out:
 * by rows (a column-parallel weight or a bias: rows/T rows) or by columns (a
 * row-parallel weight: cols/T columns). DTRAIN_ERR_SHAPE when the size does
 * not divide by T. The unshard functions go the other way: rank `rank`'s
 * slice `part` into its place in `full` (gathering a checkpoint). */
DTRAIN_API dt_result dt_tp_shard_rows(const float *full, int64_t rows, int64_t cols, int T, int rank, float *out);
DTRAIN_API dt_result dt_tp_shard_cols(const float *full, int64_t rows, int64_t cols, int T, int rank, float *out);
DTRAIN_API dt_result dt_tp_unshard_rows(float *full, int64_t rows, int64_t cols, int T, int rank, const float *part);
DTRAIN_API dt_result dt_tp_unshard_cols(float *full, int64_t rows, int64_t cols, int T, int rank, const float *part);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_TENSOR_PARALLEL_H */
