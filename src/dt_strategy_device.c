/* ===========================================================================
 * dt_strategy_device.c -- replicas on devices (desc.devices): a mode of the
 * kinds with DT__STRATEGY_DEVICES (one_device, mirrored,
 * multi_worker_mirrored), one job for all of them
 * ===========================================================================
 * One replica per device; the same thread pool and in-process communicator
 * (a barrier) as on the CPU. A step (dt__strategy_dev_job, every replica):
 *
 *   shard r -> zero the device gradient -> step fn + backward on the device
 *   -> barrier -> replica 0 alone: dt_device_group_allreduce of the device
 *   gradients, the module's dev_exchange [mwm: device 0's sum -> host -> the
 *   cross-process all-reduce -> scaled by 1/global rows -> device 0], the
 *   checks on a host copy (check_numerics, a finite clipping norm),
 *   dt_optim_step_graph on device 0 with the strategy's optimizer (its state
 *   lives on device 0 only), and a broadcast of device 0's parameters
 *   (buffers included) to the others.
 * Updating on one device and broadcasting (rather than every device
 * updating its copy with its own optimizer state) keeps ONE optimizer state
 * (the given dt_optim's, so that checkpoints and dt_optim_* see it) and
 * makes a failure easy to undo: the replicas can never drift apart, because
 * whatever fails, every device gets the params' values again. The price is
 * one broadcast of the parameters per step on top of the all-reduce.
 * dt_strategy_step then copies replica 0's parameters to the params (host).
 */
#include "dt_strategy_impl.h"

DTRAIN_PRIVATE dt_result dt__strategy_dev_create(dt_strategy *s) {
  s->dev = 1;
  s->dgrad = (float **)dt__calloc((size_t)s->n * sizeof(float *));
  s->ddata = (float **)dt__calloc((size_t)s->n * sizeof(float *));
  if (!s->dgrad || !s->ddata || !(s->dhost = dt__strategy_floats(s, NULL))) return dt__strategy_nomem(s);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__strategy_dev_destroy(dt_strategy *s) {
  dt_device_group_destroy(s->dgroup);
  dt__free(s->dgrad, (size_t)s->n * sizeof(float *));
  dt__free(s->ddata, (size_t)s->n * sizeof(float *));
  dt__free(s->dhost, s->fbytes ? s->fbytes : sizeof(float));
}

DTRAIN_PRIVATE dt_result dt__strategy_dev_bind(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  R->data = s->ddata[r] = dt_graph_param_data(R->g);
  R->grad = s->dgrad[r] = dt_graph_param_grad(R->g);
  /* check_numerics scans a host copy of the gradient */
  if (s->desc.check_numerics && !(R->old = dt__strategy_floats(s, NULL))) return dt__strategy_nomem(s);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__strategy_dev_start(dt_strategy *s) {
  if (s->n > 1 && !(s->dgroup = dt_device_group_create(s->desc.devices, s->n, s->size))) return dt_last_result();
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__strategy_dev_upload(dt_strategy *s, const char *fn) {
  for (int r = 0; r < s->n; r++) {
    dt_result rc = dt_graph_params_upload(s->rep[r].g);
    if (rc != DTRAIN_OK) return dt__error(rc, "%s: replica %d: %s", fn, r, dt_last_error());
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__strategy_dev_checks(dt_strategy *s, const float *g) {
  char what[DT__MSG_CAP];
  if (s->desc.check_numerics) {
    size_t bad = dt__strategy_nonfinite(g, 0, s->size);
    if (bad < s->size) {
      snprintf(what, sizeof what, "step %lld: reduced gradient of '%s' is %s at flat index %zu; no update made",
               (long long)(s->batch ? s->batch->step : -1), dt__strategy_param_at(s, bad),
               isnan(g[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  if (dt_optim_get_options(s->opt)->clip_norm > 0.0f) {
    /* dt_optim_step_graph clips on the device; a non-finite norm must stop
     * the step here, before any update. */
    double norm = sqrt(dt__strategy_sumsq(s, g, 0, s->size));
    if (!isfinite(norm)) {
      snprintf(what, sizeof what, "step %lld: gradient norm is %s; no update made",
               (long long)(s->batch ? s->batch->step : -1), isnan(norm) ? "NaN" : "Inf");
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  return 1;
}

DTRAIN_PRIVATE int dt__strategy_dev_failed(dt_strategy *s, dt_result rc, const char *what) {
  char msg[DT__MSG_CAP];
  snprintf(msg, sizeof msg, "%.60s: %.250s", what, dt_last_error());
  dt__strategy_fail(s, 0, rc, msg);
  return 0;
}

DTRAIN_PRIVATE dt_result dt__strategy_dev_copy(dt_strategy *s, int r, float *dst, const float *src, size_t b, size_t e,
                                               dt_copy_kind kind) {
  dt_device *d = s->desc.devices[r];
  if (e <= b) return DTRAIN_OK;
  dt_result rc = d->copy(d, dst + b, src + b, (e - b) * sizeof(float), kind);
  if (rc != DTRAIN_OK) {
    char msg[DT__MSG_CAP];
    snprintf(msg, sizeof msg, "%.250s", dt_last_error());
    return dt__error(rc, "device %s: %s", d->name, msg);
  }
  return DTRAIN_OK;
}

/* Replica 0's part after the barrier. ok: the local part succeeded (the
 * module's exchange may need replica 0 even then). 1: the update goes on. */
static int dt__strategy_dev_reduce(dt_strategy *s, int ok) {
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_device_group_allreduce(s->dgroup, s->dgrad);
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "all-reduce of the gradients over the devices");
  }
  if (s->mod->dev_exchange) return s->mod->dev_exchange(s, ok);
  if (!ok) return 0;
  if (!s->desc.check_numerics && !(dt_optim_get_options(s->opt)->clip_norm > 0.0f)) return 1;
  rc = dt__strategy_dev_copy(s, 0, s->dhost, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
  if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the host");
  return dt__strategy_dev_checks(s, s->dhost);
}

DTRAIN_PRIVATE void dt__strategy_dev_job(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  R->updating = 0;
  dt_minibatch b;
  dt__strategy_sync_shard(s, r, &b); /* the same loss weights as on the CPU */
  double w0 = dt__strategy_comm_wait(s, r);
  int ok = dt__strategy_compute(s, r, &b);
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_comm_barrier(s->comm, r); /* every gradient is done */
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  R->wait_s += dt__strategy_comm_wait(s, r) - w0;
  if (r > 0) return;
  if (!dt__strategy_dev_reduce(s, ok)) return;
  R->updating = 1;
  rc = dt_optim_step_graph(s->opt, R->g);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, 0, rc, dt_last_error());
    return;
  }
  if (s->n > 1) {
    rc = dt_device_group_broadcast(s->dgroup, s->ddata, 0, s->size, 0);
    if (rc != DTRAIN_OK) dt__strategy_dev_failed(s, rc, "parameters of replica 0 to the devices");
  }
}

