/* ===========================================================================
 * dt_memory.h -- where the memory of a training set-up goes
 * ===========================================================================
 * dt_memory_stats() adds up the bytes of a params / optimizer / graph triple:
 * parameter values, gradients, optimizer state and the step's activations
 * (the graph arena's peak: activations, their gradients and op scratch).
 * After the first step a training step allocates nothing more, so these
 * figures are the steady state.
 */
#ifndef DTRAIN_MEMORY_H
#define DTRAIN_MEMORY_H

#include "dt_optim.h"

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_memory_info {
  size_t params_bytes;      /* parameter values (the flat data buffer, buffers included) */
  size_t grads_bytes;       /* the flat gradient buffer */
  size_t optim_bytes;       /* optimizer state: momentum, Adam moments (0 without an optimizer) */
  size_t activations_bytes; /* peak arena use of one step so far (dt_graph_bytes_peak) */
  size_t arena_bytes;       /* arena memory the graph holds now (dt_graph_bytes_reserved) */
  size_t tape_bytes;        /* the graph's autograd tape and parameter views */
  size_t total_bytes;       /* params + grads + optim + arena + tape */
} dt_memory_info;

/* Fills *out for the params p, the optimizer o created on p, and the graph g;
 * any of them may be NULL (its figures are 0), except that an optimizer needs
 * its params (its state has their size). DTRAIN_ERR_NULL_ARG when out is NULL
 * or o is given without p. */
DTRAIN_API dt_result dt_memory_stats(const dt_params *p, const dt_optim *o, const dt_graph *g, dt_memory_info *out);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_MEMORY_H */
