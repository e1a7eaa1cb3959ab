/* ===========================================================================
 * dt_strategy_one_device.c -- one_device: one replica on the calling thread
 * (or on one device)
 * ===========================================================================
 * The replica trains the params' own buffers. Its step is central_storage's
 * with one replica (the reduction and barriers of one are no-ops), so that
 * one_device, mirrored(1) and central_storage(1) run the same arithmetic and
 * agree bitwise. It is the one kind that works without threads.
 */
#include "dt_strategy_impl.h"

DTRAIN_API dt_strategy_options dt_strategy_one_device(void) { return dt__strategy_desc(DTRAIN_STRATEGY_ONE_DEVICE, 1, 0); }
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_one_device(void) { return dt_strategy_one_device(); }

/* The params' own data and gradient. */
static dt_result dt__one_device_replica(dt_strategy *s, int r) { return dt__strategy_bind(s, r, 0, 0, NULL); }

static dt_result dt__one_device_sync(dt_strategy *s, const char *fn) {
  /* On the CPU the replica is the params; a device holds a copy. */
  return s->dev ? dt__strategy_dev_upload(s, fn) : DTRAIN_OK;
}

static const dt__strategy_module dt__one_device_module = {
  "one_device",
  DT__STRATEGY_SYNC | DT__STRATEGY_ONE_REPLICA | DT__STRATEGY_DEVICES,
  NULL,                     /* prepare */
  NULL,                     /* check */
  NULL,                     /* create */
  dt__one_device_replica,   /* replica */
  NULL,                     /* start */
  dt__strategy_central_job, /* job */
  NULL,                     /* run: steps */
  dt__one_device_sync,      /* sync */
  NULL,                     /* loss: the shards' */
  NULL,                     /* local_step */
  NULL,                     /* dev_exchange */
  NULL,                     /* destroy */
  NULL                      /* after_job */
};

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_one_device_module(void) { return &dt__one_device_module; }
