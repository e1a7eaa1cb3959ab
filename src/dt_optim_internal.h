/* ===========================================================================
 * dt_optim_internal.h -- the optimizers' names, for the layers above (optim layer)
 * ===========================================================================
 * Private: part of the implementation, not of the API. See dt_internal.h.
 * The optimizers are listed once, in dt__optim_rules (dt_optim.c); what the
 * layers above need to know of each is asked here, so that a new optimizer
 * is not also a new case in their files.
 */
#ifndef DTRAIN_OPTIM_INTERNAL_H
#define DTRAIN_OPTIM_INTERNAL_H

#include "dt_internal.h"
#include "dt_optim.h"

/* "sgd", "adam", "adamw", "rmsprop": the name of an optimizer kind (as the
 * checkpoints write it); NULL for a kind that is not one. */
DTRAIN_PRIVATE const char *dt__optim_kind_name(dt_optim_kind kind);
/* PyTorch's name of state slot `slot` (0 or 1, as dt_optim_state) of an
 * optimizer of this kind ("momentum_buffer", "exp_avg", "exp_avg_sq",
 * "square_avg"); NULL where the kind has no such slot. */
DTRAIN_PRIVATE const char *dt__optim_slot_name(dt_optim_kind kind, int slot);
/* One step of the optimizer as a difference, on a block of values:
 * d[j] = (x[j] after the update) - x[j] for the trainable elements in
 * [begin, end) of the params' flat layout, where x[0] and d[0] are element
 * begin; grad and the optimizer's state are indexed as the params; the state
 * is updated, x is not, d's other elements are not written. The same floats
 * as dt_optim_update on a copy of x minus x (the arithmetic is element by
 * element, so blocks give what the whole vector gives); Adam and AdamW make
 * them in one pass. Without dt_optim_update's checks or its floating-point
 * mode: the caller checked the layout (dt_optim_update of an empty range
 * does) and holds dt__fp_enter. Returns 0 (nothing done) for a range outside
 * the params. Does not advance the step count (dt_optim_advance). */
DTRAIN_PRIVATE int dt__optim_delta_span(dt_optim *o, const float *x, float *d, const float *grad, size_t begin,
                                        size_t end);

/* One step of the optimizer in place on a block of values: x[j] (element
 * begin + j of the params' flat layout) becomes its update, for the
 * trainable elements in [begin, end); grad and the state are indexed as the
 * params; the other elements of x are not written. The same floats as
 * dt_optim_update over the same range. As dt__optim_delta_span: no checks,
 * no floating-point mode, no advance; 0 for a range outside the params. */
DTRAIN_PRIVATE int dt__optim_step_span(dt_optim *o, float *x, const float *grad, size_t begin, size_t end);

/* dt_optim_update (its checks, its floating-point mode) with the gradient
 * of [begin, end) at g: g[0] is element begin's (a received frame's floats,
 * used where they lie). */
DTRAIN_PRIVATE dt_result dt__optim_update_from(dt_optim *o, float *data, const float *g, size_t begin, size_t end);

#endif /* DTRAIN_OPTIM_INTERNAL_H */
