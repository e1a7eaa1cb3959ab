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
/* dt_params_layout_hash's step for one parameter (start from DT__FNV64_OFFSET):
 * a layout hash of tensors that are not in a dt_params (checkpoint parts). */
DTRAIN_PRIVATE uint64_t dt__layout_hash_add(uint64_t h, const char *name, int ndim, const int64_t *shape, int trainable);

#endif /* DTRAIN_PARAMS_INTERNAL_H */
