/* ===========================================================================
 * dt_memory.c -- dt_memory_stats: bytes of params, gradients, optimizer state
 * and activations
 * ===========================================================================
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_memory.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"

DTRAIN_API dt_result dt_memory_stats(const dt_params *p, const dt_optim *o, const dt_graph *g, dt_memory_info *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_memory_stats: out is NULL");
  memset(out, 0, sizeof *out);
  if (o && !p)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_memory_stats: an optimizer needs its params (p is NULL)");
  if (p) {
    size_t n = dt_params_size(p);
    out->params_bytes = n * sizeof(float);
    out->grads_bytes = n * sizeof(float);
    if (o) out->optim_bytes = (size_t)dt_optim_state_slots(o) * n * sizeof(float);
  }
  if (g) {
    out->activations_bytes = g->peak;
    out->arena_bytes = g->reserved;
    out->tape_bytes = (size_t)g->tape_cap * sizeof(dt_tensor *) + g->pviews_bytes;
  }
  out->total_bytes = out->params_bytes + out->grads_bytes + out->optim_bytes + out->arena_bytes + out->tape_bytes;
  return DTRAIN_OK;
}
