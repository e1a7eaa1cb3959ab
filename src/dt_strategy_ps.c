/* ===========================================================================
 * dt_strategy_ps.c -- parameter_server, the worker side: the async replica
 * loop (dt_strategy_async.c) against a store that takes gradients
 * (dt_pstore_create_tcp, dt_ps.c)
 * ===========================================================================
 * No local optimizer step: the vector pushed holds the (clipped) gradient
 * for trainable parameters and the current values of buffers; the servers
 * apply their optimizer to their shard. One replica per process: the
 * replica is this process's worker of the store, which is borrowed.
 */
#include "dt_strategy_impl.h"

DTRAIN_API dt_strategy_options dt_strategy_parameter_server(dt_pstore *store, int max_staleness) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_PARAMETER_SERVER, 1, max_staleness);
  d.store = store;
  return d;
}
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_parameter_server(dt_pstore *store, int max_staleness) {
  return dt_strategy_parameter_server(store, max_staleness);
}

#if !defined(DTRAIN_NO_DIST)

/* The store decides: one replica (this worker), its max_staleness. */
static dt_result dt__ps_prepare(dt_strategy_desc *d) {
  const char *fn = "dt_strategy_create";
  if (!d->store) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: parameter_server needs desc.store (dt_pstore_create_tcp)", fn);
  if (d->replicas > 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: parameter_server runs 1 replica per process (the process is "
                     "one worker of the store), not %d", fn, d->replicas);
  d->replicas = 1;
  d->max_staleness = d->store->max_staleness;
  return DTRAIN_OK;
}

static dt_result dt__ps_create(dt_strategy *s) {
  dt_pstore *st = s->desc.store;
  if (st->size != s->size)
    return dt__error(DTRAIN_ERR_SHAPE, "dt_strategy_create: the store holds %zu floats, the params %zu", st->size,
                     s->size);
  s->pstore = st; /* borrowed */
  st->compress = s->desc.compress; /* the store's pushes and pulls (dt_ps_codec.c) */
  return DTRAIN_OK;
}

/* Pulls go into the params' data; the push goes from the gradient buffer. */
static dt_result dt__ps_replica(dt_strategy *s, int r) { return dt__strategy_bind(s, r, 0, r > 0, NULL); }

/* Forward/backward, then the push vector: the replica's gradient buffer,
 * the clipped gradient (clip_norm of the optimizer given to
 * dt_strategy_create) with the buffers' values written into the buffers'
 * places (no gradient flows there; the replica loop zeroes them again after
 * the push: R->bufs_in_grad). No copy of the whole vector. */
static int dt__ps_local_step(dt_strategy *s, int r, const dt_minibatch *b, const float **push) {
  dt__strategy_replica *R = &s->rep[r];
  if (!dt__strategy_compute(s, r, b)) return 0;
  *push = NULL;
  if (b->rows == 0 || R->skipped) return 1; /* an empty push: only the clock moves */
  if (!s->desc.check_numerics && !dt__strategy_own_grad_ok(s, r, b->step)) return R->skipped; /* compute checked */
  if (!dt__strategy_clip_own(s, r, dt_optim_get_options(s->opt)->clip_norm, "nothing pushed")) return 0;
  for (int i = 0; i < s->nbufr; i++)
    memcpy(R->grad + s->bufr[2 * i], R->data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  R->bufs_in_grad = s->nbufr > 0;
  *push = R->grad;
  return 1;
}

static const dt__strategy_module dt__ps_module = {
  "parameter_server",
  0,                      /* flags: the async family */
  dt__ps_prepare,         /* prepare */
  NULL,                   /* check */
  dt__ps_create,          /* create: borrow the store */
  dt__ps_replica,         /* replica */
  NULL,                   /* start */
  dt__strategy_async_job, /* job */
  dt__strategy_async_run, /* run */
  NULL,                   /* sync: the next pull brings the servers' values */
  NULL,                   /* loss: the shard's */
  dt__ps_local_step,      /* local_step */
  NULL,                   /* dev_exchange: no devices */
  NULL                    /* destroy: the store is the user's */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__ps_module, "parameter_server", 0);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_ps_module(void) { return &dt__ps_module; }
