/* ===========================================================================
 * dt_strategy_central.c -- central_storage: one copy of the parameters (the
 * params' own), read by every replica; the gradients reduced into the centre
 * ===========================================================================
 * A step (dt__strategy_central_job, every replica): its shard ->
 * forward/backward into its own gradient -> reduce to replica 0's gradient
 * (the params' grad, rank order) -> clipping / numerics on slice r of the
 * sum -> dt_optim_update of slice r of the centre. No all-gather: there is
 * one copy.
 *
 * Buffers (batch-norm statistics) are written by the forward pass, so with
 * such a model each replica works on a private copy of the centre,
 * refreshed at the start of every step, and replica 0's statistics go back
 * to the centre after the update (buffers follow replica 0).
 */
#include "dt_strategy_impl.h"

DTRAIN_API dt_strategy_options dt_strategy_central_storage(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_CENTRAL_STORAGE, replicas, 0);
}
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_central_storage(int replicas) { return dt_strategy_central_storage(replicas); }

#if !defined(DTRAIN_NO_DIST)
/* A private copy of the centre only when buffers need one; replicas
 * other than 0 sum into their own gradient. */
static dt_result dt__central_replica(dt_strategy *s, int r) { return dt__strategy_bind(s, r, s->nbufr > 0, r > 0, NULL); }
#endif

DTRAIN_PRIVATE void dt__strategy_central_job(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_sync_shard(s, r, &b);
  /* Forward passes writing batch-norm statistics must not race on the centre. */
  if (R->own_data) memcpy(R->own_data, dt_params_data(s->params), s->fbytes);
  if (!dt__strategy_compute(s, r, &b)) return;
  size_t lo, hi;
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  double w0 = dt__strategy_comm_wait(s, r);
  float *grad = s->rep[0].grad, *data = dt_params_data(s->params);
  dt_result rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  if (!dt__strategy_update_slice(s, r, data, grad, lo, hi, 0)) goto done;
  /* The optimizer never touches the buffer ranges: replica 0 may write them
   * while the others update their slices. */
  if (r == 0 && R->own_data)
    for (int i = 0; i < s->nbufr; i++)
      memcpy(data + s->bufr[2 * i], R->own_data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
done:
  R->wait_s += dt__strategy_comm_wait(s, r) - w0;
}

#if !defined(DTRAIN_NO_DIST) /* the job above stays: one_device runs it */
static const dt__strategy_module dt__central_module = {
  "central_storage",
  DT__STRATEGY_SYNC,
  NULL,                     /* prepare */
  NULL,                     /* check */
  NULL,                     /* create */
  dt__central_replica,      /* replica */
  NULL,                     /* start */
  dt__strategy_central_job, /* job */
  NULL,                     /* run: steps */
  NULL,                     /* sync: the replicas read the centre */
  NULL,                     /* loss: the shards' */
  NULL,                     /* local_step */
  NULL,                     /* dev_exchange */
  NULL,                     /* destroy */
  NULL                      /* after_job */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__central_module, "central_storage", DT__STRATEGY_SYNC);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_central_module(void) { return &dt__central_module; }
