/* ===========================================================================
 * dt_ps_apply.c -- parameter servers: what a push does to the shard: applied
 * as it comes (one optimizer step a push), or held in synchronous rounds with
 * backup workers (dt_ps_options.aggregate; Chen et al., "Revisiting
 * distributed synchronous SGD", as TF's SyncReplicasOptimizer does it on its
 * parameter servers)
 * ===========================================================================
 * With aggregate = R, a server does not apply each push as it comes: it
 * holds the pushes computed on its current version (the open round) and,
 * once R are in, sums them in rank order, averages (divides by how many),
 * and takes one optimizer step (buffers get the pushes' mean); the version
 * moves on and the round is closed. A push computed on an older version
 * comes after its round closed without it: it is dropped (answered at once,
 * counted, not applied). A worker's pull waits while its push is held, so
 * the R fastest workers go on as soon as their round closes, and a slow
 * worker's late push costs nobody a wait: with W workers, W - R are backups.
 * The staleness bound (max_staleness) is not used: a round is its own bound.
 *
 * Each server closes its own rounds (as SyncReplicasOptimizer's accumulators
 * do, one per variable): with several servers the R pushes of one server's
 * round may be other workers' than another's, each an average of R
 * gradients of that version, and a push may be held by one server and
 * dropped by another; the servers' versions (rounds closed) may then differ
 * by a few. A round is full at R: the next push of its version is late. A round also closes with fewer than R when no
 * worker that counts can add one (the others died, or left with BYE): the
 * job goes on with the workers it has. A held push whose worker is lost or
 * leaves stays in its round (it was answered).
 */
#include "dt_internal.h"
#include "dt_strategy.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_optim_internal.h"
#include "dt_ps_core.h"

#if !defined(DTRAIN_NO_NET)

DTRAIN_PRIVATE int dt__ps_apply(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  const uint64_t before = S->version;
  float *data = dt_params_data(S->params), *grad = dt_params_grad(S->params);
  const unsigned char *in = w->rx + DT__PS_FIX;
  size_t off = 0, b, e;
  int tr, dec;
  /* staleness_lr: this push's step is divided by 1 + the updates applied since its pull */
  uint64_t s = w->pend_version <= before ? before - w->pend_version : 0;
  float scale = S->before && s > 0 ? (float)(1.0 / (1.0 + (double)s)) : 1.0f;
  if (w->pend_z && dt__ps_decode_push(S->params, S->owner, S->me, w->rx, w->pend_len, grad, data, &S->zscratch,
                                      &S->zscratch_cap) != DTRAIN_OK)
    return -1;
  for (int p = 0; dt__params_range(S->params, p, &b, &e, &tr, &dec); p++) {
    if (S->owner[p] != S->me) continue;
    if (tr) {
      /* A float push's gradient is used where it lies in the frame on a little-endian host (rx is
       * from dt__alloc, its floats 4-byte aligned); else its bytes are read into grad first. */
      const float *g = grad + b;
      if (!w->pend_z && DT__HOST_LE) g = (const float *)(const void *)(in + 4 * off);
      else if (!w->pend_z) dt__get_f32le(grad + b, in + 4 * off, e - b);
      if (scale != 1.0f) memcpy(S->before, data + b, (e - b) * sizeof(float));
      if (dt__optim_update_from(S->opt, data, g, b, e) != DTRAIN_OK) return -2;
      if (scale != 1.0f)
        for (size_t j = b; j < e; j++) data[j] = S->before[j - b] + (data[j] - S->before[j - b]) * scale;
    } else if (!w->pend_z) {
      dt__get_f32le(data + b, in + 4 * off, e - b);
    }
    off += e - b;
  }
  dt_optim_advance(S->opt);
  return 1;
}

DTRAIN_PRIVATE dt_result dt__ps_agg_setup(dt__ps_server *S, const char *fn) {
  const int R = S->po.aggregate;
  if (R < 0 || R > S->W)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: ps %d: aggregate %d outside [0, %d] (the workers)", fn, S->me, R,
                     S->W);
  if (R > 0 && (S->po.work_items > 0 || S->po.staleness_lr))
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: ps %d: aggregate %d with %s", fn, S->me, R,
                     S->po.work_items > 0 ? "a work queue (a dropped push would leave its item not trained on)"
                                          : "staleness_lr (the pushes of a round are never stale)");
  S->agg = R;
  if (R > 0 && !(S->agg_sum = (float *)dt__alloc(dt_params_size(S->params) * sizeof(float) + 4)))
    return dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory for a round's sum", fn, S->me);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__ps_agg_hold(dt__ps_server *S, int i, int64_t *stale) {
  dt__ps_worker *w = &S->w[i];
  const uint64_t v = S->version;
  *stale = w->pend_version < v ? (int64_t)(v - w->pend_version) : 0;
  if (*stale > 0) { /* its round closed without it */
    S->dropped++;
    return 0;
  }
  if (w->pend_empty) return 0; /* a skipped step: nothing to add, nothing to wait for */
  if (!w->hrx && !(w->hrx = (unsigned char *)dt__alloc(S->shard * 4 + 4))) {
    dt__error(DTRAIN_ERR_NOMEM, "out of memory for its push in the open round");
    return -1;
  }
  if (w->pend_z) { /* decoded now: a push that does not decode is refused before it counts */
    float *grad = dt_params_grad(S->params);
    if (dt__ps_decode_push(S->params, S->owner, S->me, w->rx, w->pend_len, grad, grad, &S->zscratch,
                           &S->zscratch_cap) != DTRAIN_OK)
      return -1;
    dt__ps_gather(S->params, S->owner, S->me, grad, w->hrx);
  } else {
    memcpy(w->hrx, w->rx + DT__PS_FIX, S->shard * 4);
  }
  w->held = 1;
  S->nheld++;
  S->held_total++;
  return 1;
}

DTRAIN_PRIVATE int dt__ps_agg_due(const dt__ps_server *S) {
  if (S->nheld == 0) return 0;
  if (S->nheld >= S->agg) return 1;
  for (int j = 0; j < S->W; j++)
    if (!S->w[j].held && dt__ps_counts(S, &S->w[j])) return 0; /* one more may come */
  return 1;
}

DTRAIN_PRIVATE dt_result dt__ps_agg_close(dt__ps_server *S) {
  float *data = dt_params_data(S->params), *grad = dt_params_grad(S->params), *sum = S->agg_sum;
  const float inv = 1.0f / (float)S->nheld;
  size_t b, e;
  int tr, dec, first = 1;
  for (int j = 0; j < S->W; j++) { /* rank order: the sum does not depend on who came first */
    dt__ps_worker *w = &S->w[j];
    if (!w->held) continue;
    size_t off = 0;
    for (int p = 0; dt__params_range(S->params, p, &b, &e, &tr, &dec); p++) {
      if (S->owner[p] != S->me) continue;
      const float *g = grad + b;
      if (DT__HOST_LE) g = (const float *)(const void *)(w->hrx + 4 * off); /* (hrx is from dt__alloc: aligned) */
      else dt__get_f32le(grad + b, w->hrx + 4 * off, e - b);
      if (first) memcpy(sum + b, g, (e - b) * sizeof(float));
      else
        for (size_t k = b; k < e; k++) sum[k] += g[k - b];
      off += e - b;
    }
    first = 0;
    w->held = 0;
    if (w->state != DT__PSW_LIVE) { /* gone since: its push was the last use of its buffer */
      dt__free(w->hrx, S->shard * 4 + 4);
      w->hrx = NULL;
    }
  }
  for (int p = 0; dt__params_range(S->params, p, &b, &e, &tr, &dec); p++) {
    if (S->owner[p] != S->me) continue;
    for (size_t k = b; k < e; k++) sum[k] *= inv;
    if (!tr) memcpy(data + b, sum + b, (e - b) * sizeof(float)); /* buffers: the pushes' mean */
    else if (dt__optim_update_from(S->opt, data, sum + b, b, e) != DTRAIN_OK) return dt_last_result();
  }
  dt_optim_advance(S->opt);
  S->nheld = 0;
  S->rounds++;
  S->version++;
  S->since_ckpt++;
  dt__ps_maybe_ckpt(S);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__ps_agg_free(dt__ps_server *S, dt__ps_worker *w) {
  if (w->held || !w->hrx) return; /* (the close frees it) */
  dt__free(w->hrx, S->shard * 4 + 4);
  w->hrx = NULL;
}

#endif /* DTRAIN_NO_NET */
