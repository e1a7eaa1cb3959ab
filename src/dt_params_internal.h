/* ===========================================================================
 * dt_params_internal.h -- parameter layouts (params layer)
 * ===========================================================================
 * Private: part of the implementation, not of the API. See dt_internal.h.
 */
#ifndef DTRAIN_PARAMS_INTERNAL_H
#define DTRAIN_PARAMS_INTERNAL_H

#include "dt_internal.h"
#include "dt_params.h"

/* ---- params internals (dt_params.c) ------------------------------------------------ */
/* Layout of parameter `index` (no checks: index must be valid). */
DTRAIN_PRIVATE int dt__params_view(const dt_params *p, int index, size_t *offset, int *ndim,
                                   const int64_t **shape, int *trainable);
/* Range [begin,end) of parameter `index` in the flat buffers; 0 past the end. */
DTRAIN_PRIVATE int dt__params_range(const dt_params *p, int index, size_t *begin, size_t *end,
                                    int *trainable, int *decay);
/* The first parameter whose range ends after flat index pos (the count when
 * none does): where a walk over the ranges that meet [pos, ...) starts. */
DTRAIN_PRIVATE int dt__params_first_after(const dt_params *p, size_t pos);
/* dt_params_layout_hash's step for one parameter (start from DT__FNV64_OFFSET):
 * a layout hash of tensors that are not in a dt_params (checkpoint parts). */
DTRAIN_PRIVATE uint64_t dt__layout_hash_add(uint64_t h, const char *name, int ndim, const int64_t *shape, int trainable);
/* The gradient of a CPU graph's params, zeroed lazily (dt_graph_params.c):
 * dt__graph_grad_defer zeroes what no op writes (the padding between
 * parameters, frozen ones) and marks each trainable parameter's range stale
 * instead of zeroing it: the first op to use it this step zeroes it, or
 * overwrites it (dt__grad_first: a linear layer's weight gradient as a GEMM
 * with beta 0, instead of zeros written and read back). After backward,
 * dt__graph_grad_settle zeroes the ranges no op used, so the whole buffer
 * then holds the step's gradient exactly as after dt_graph_zero_grad and a
 * backward. A device graph, or no memory for the marks: zeroed at once. */
DTRAIN_PRIVATE dt_result dt__graph_grad_defer(dt_graph *g);
DTRAIN_PRIVATE void dt__graph_grad_settle(dt_graph *g);

#endif /* DTRAIN_PARAMS_INTERNAL_H */
