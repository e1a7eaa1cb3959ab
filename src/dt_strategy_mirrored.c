/* ===========================================================================
 * dt_strategy_mirrored.c -- mirrored: one copy of the parameters per replica
 * (replica 0's is the params' own), kept equal by collectives
 * ===========================================================================
 * A step (dt__mirrored_job, every replica): its shard -> forward/backward
 * into its own gradient -> reduce-scatter: replica r owns slice r of the sum
 * -> clipping / numerics on that slice -> dt_optim_update of slice r of its
 * own copy -> replica 0's buffers (batch-norm statistics) into slice r ->
 * all-gather of the parameters. Buffers follow replica 0, like PyTorch
 * DDP's broadcast_buffers. A model without buffers (nothing its forward
 * writes) keeps one copy that every replica reads (dt__strategy_shared):
 * each replica updates its slice in place after every replica's backward is
 * over (the update's barrier), and no all-gather is needed: the end of the
 * step's jobs comes before the next forward. On devices see
 * dt_strategy_device.c.
 * desc.overlap: instead of the reduce-scatter, the replicas sum the
 * gradients into replica 0's in buckets while backward goes on
 * (dt_strategy_overlap.c); each replica then updates its slice from that sum
 * (the same additions in the same order: bitwise the same parameters).
 * Cache hand-off (s->handoff, DTRAIN_CACHE_HANDOFF=1): where writing a
 * line the other core holds shared is slow (dt_platform.c: 5x on a Zen 5
 * whose two vCPUs sit on different L3s), each replica writes its slice of
 * the parameters out of every cache before updating it (the other replica
 * read it in its forward), and the reduce-scatter hands the gradient lines
 * a replica read in the other's buffer back modified. The same values
 * either way. Off unless asked: a probe at the first step (time a write
 * pass after the other core read the lines, plain and after an eviction)
 * was tried and did not see on this Zen 5 what the steps see (2-3 us plain
 * against 17 us evicting, where the hand-off makes the steps 1.22x faster).
 */
#include "dt_strategy_impl.h"

DTRAIN_API dt_strategy_options dt_strategy_mirrored(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_MIRRORED, replicas, 0);
}
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_mirrored(int replicas) { return dt_strategy_mirrored(replicas); }

#if !defined(DTRAIN_NO_DIST)

/* Replica 0 trains the params' buffers; the others their own copies, or
 * the params' own too when the model has no buffers (dt__strategy_shared).
 * With backup workers every replica has its own: the params' are the
 * centre. */
static dt_result dt__mirrored_replica(dt_strategy *s, int r) {
  int own = r > 0 || s->desc.backup_workers > 0;
  return dt__strategy_bind(s, r, own && !dt__strategy_shared(s), own, NULL);
}

/* DTRAIN_CACHE_HANDOFF: "1" asks for the hand-off, unset, empty or "0"
 * does not; anything else is warned about and taken as "0". It applies to
 * replicas on the CPU without backup workers, where lines can be evicted. */
static dt_result dt__mirrored_create(dt_strategy *s) {
  const char *e = getenv("DTRAIN_CACHE_HANDOFF");
  int asked = e && !strcmp(e, "1");
  if (e && *e && !asked && strcmp(e, "0"))
    dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_INVALID_ARG, "DTRAIN_CACHE_HANDOFF=\"%.40s\" is not 0 or 1: using 0", e);
  s->handoff = asked && s->n >= 2 && !s->desc.devices && s->desc.backup_workers == 0 && dt__cache_evict_ok();
  return s->desc.backup_workers > 0 ? dt__strategy_backup_create(s) : DTRAIN_OK;
}

static void dt__mirrored_job(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_sync_shard(s, r, &b);
  float *grad = R->grad;
  size_t lo, hi;
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  double w0 = dt__strategy_comm_wait(s, r);
  dt_result rc;
  int finite = 0; /* every element of the summed gradient known to be finite */
  if (s->ov) {
    if (!dt__overlap_compute(s, r, &b)) goto done;
    grad = s->rep[0].grad; /* the sum */
  } else {
    if (!dt__strategy_compute(s, r, &b)) return;
    rc = dt__comm_reduce_scatter_finite(s->comm, r, R->grad, s->size, &finite, s->handoff);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      goto done;
    }
  }
  if (s->handoff) dt__cache_evict(R->data + lo, (hi - lo) * sizeof(float));
  if (!dt__strategy_update_slice(s, r, R->data, grad, lo, hi, finite)) goto done;
  /* Buffers follow replica 0: each replica puts replica 0's values into its
   * own slice before the all-gather spreads the slices (the optimizer never
   * writes the buffer ranges, so replica 0's stay still meanwhile). */
  if (r > 0) dt__strategy_copy_buffers(s, R->data, s->rep[0].data, lo, hi);
  if (!dt__strategy_shared(s)) { /* (one shared copy: each slice updated in place is everybody's) */
    rc = dt_comm_allgather(s->comm, r, R->data, s->size);
    if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
  }
done:
  R->wait_s += dt__strategy_comm_wait(s, r) - w0;
}

static dt_result dt__mirrored_sync(dt_strategy *s, const char *fn) {
  if (s->dev) return dt__strategy_dev_upload(s, fn);
  const float *src = dt_params_data(s->params);
  for (int r = 1; r < s->n; r++)
    if (s->rep[r].data != src) memcpy(s->rep[r].data, src, s->fbytes);
  return DTRAIN_OK;
}

static dt_result dt__mirrored_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                  float *mean_loss) {
  if (s->backup) return dt__strategy_backup_run(s, steps, next, next_user, mean_loss);
  return dt__strategy_run_steps(s, steps, next, next_user, mean_loss);
}

static const dt__strategy_module dt__mirrored_module = {
  "mirrored",
  DT__STRATEGY_SYNC | DT__STRATEGY_DEVICES,
  NULL,                 /* prepare */
  NULL,                 /* check */
  dt__mirrored_create,  /* create: backup workers' state */
  dt__mirrored_replica, /* replica */
  NULL,                 /* start: the copies were made from the params */
  dt__mirrored_job,     /* job */
  dt__mirrored_run,     /* run: steps, or backup workers' free run */
  dt__mirrored_sync,    /* sync */
  NULL,                 /* loss: the shards' */
  NULL,                 /* local_step */
  NULL,                 /* dev_exchange: the checks */
  dt__strategy_backup_destroy, /* destroy: backup workers' state */
  NULL                         /* after_job */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__mirrored_module, "mirrored", DT__STRATEGY_SYNC | DT__STRATEGY_DEVICES);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_mirrored_module(void) { return &dt__mirrored_module; }
