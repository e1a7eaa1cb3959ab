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

#endif /* DTRAIN_OPTIM_INTERNAL_H */
