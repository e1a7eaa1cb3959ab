/* ===========================================================================
 * dt_strategy_common.c -- what the strategy modules share: failures,
 * shards of a batch, forward/backward of a replica, clipping and the update
 * of a slice, running a job on the replicas' threads, replica buffers
 * ===========================================================================
 * The modules (dt_strategy_<kind>.c) and the front door (dt_strategy.c)
 * call these; these call neither (a module is reached only through its
 * table), so the strategy files form no loop. Declared in
 * dt_strategy_impl.h.
 */
#include "dt_strategy_impl.h"

DTRAIN_PRIVATE dt_strategy_desc dt__strategy_desc(dt_strategy_kind kind, int replicas, int max_staleness) {
  dt_strategy_desc d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.replicas = replicas;
  d.max_staleness = max_staleness;
  return d;
}

/* ---- failures -------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__strategy_fail(dt_strategy *s, int r, dt_result code, const char *what) {
  int expected = -1;
  s->rep[r].result = code;
  if (DT__ACAS(&s->failed, &expected, r, DT__MO_SEQ_CST)) {
    s->err = code;
    snprintf(s->msg, sizeof s->msg, "replica %d: %.*s", r, (int)sizeof s->msg - 24, what); /* (room for the prefix: no -Wformat-truncation) */
  }
  if (s->comm) dt_comm_abort(s->comm, r);
  if (s->pstore) dt_pstore_abort(s->pstore);
}

DTRAIN_PRIVATE int dt__strategy_failed(dt_strategy *s) { return DT__ALOAD(&s->failed, DT__MO_ACQUIRE) >= 0; }

DTRAIN_PRIVATE void dt__strategy_comm_failed(dt_strategy *s, int r, dt_result rc) {
  if (rc == DTRAIN_ERR_ABORTED) s->rep[r].result = DTRAIN_ERR_ABORTED;
  else dt__strategy_fail(s, r, rc, dt_last_error());
}

/* ---- batches ---------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__strategy_shard(const dt_minibatch *gb, int n, int r, dt_minibatch *out) {
  int64_t base = gb->rows / n, extra = gb->rows % n;
  int64_t first = base * r + DT__MIN((int64_t)r, extra);
  int64_t rows = base + (r < extra ? 1 : 0);
  *out = *gb;
  out->rows = rows;
  out->first = first;
  out->global_rows = gb->rows;
  out->x = gb->x ? gb->x + first * gb->x_cols : NULL;
  out->y = gb->y ? gb->y + first * (gb->y_cols > 0 ? gb->y_cols : 1) : NULL;
  out->t = gb->t ? gb->t + first * gb->t_cols : NULL;
}

DTRAIN_PRIVATE void dt__strategy_sync_shard(dt_strategy *s, int r, dt_minibatch *b) {
  dt__strategy_shard(s->batch, s->n, r, b);
  if (s->mod->flags & DT__STRATEGY_ROW_SUMS) /* the division by the global rows comes later */
    b->weight = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0f : (float)b->rows;
  else
    b->weight = (s->desc.loss == DTRAIN_LOSS_SUM || b->global_rows == 0)
                    ? 1.0f
                    : (float)((double)b->rows / (double)b->global_rows);
  b->replica_step = 0;
}

DTRAIN_PRIVATE dt_result dt__strategy_check_batch(const dt_minibatch *b, const char *fn) {
  if (!b) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: batch is NULL", fn);
  if (b->rows < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: batch has %lld rows", fn, (long long)b->rows);
  if (b->x_cols < 0 || b->y_cols < 0 || b->t_cols < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: negative column count (x %lld, y %lld, t %lld)", fn,
                     (long long)b->x_cols, (long long)b->y_cols, (long long)b->t_cols);
  return DTRAIN_OK;
}

/* ---- forward / backward ------------------------------------------------------------------------ */

/* A float is NaN or Inf when its exponent bits are all ones. Blocks of 256
 * are tested with an OR of integer compares (no branch per element, so the
 * compiler vectorises it: the per-step check costs a fraction of the
 * optimizer's own pass); only a block that has one is searched again. The
 * full blocks' loop has a constant count, so that gcc vectorises it at -O2
 * too (its cheap cost model at -O2 takes no loop that needs an epilogue:
 * with a variable count the scan was 28% of a small-batch step). */
#define DT__NONFINITE_BLOCK 256
static uint32_t dt__nonfinite_block(const float *DT__RESTRICT x) {
  uint32_t any = 0;
  for (size_t j = 0; j < DT__NONFINITE_BLOCK; j++) {
    uint32_t u;
    memcpy(&u, x + j, sizeof u);
    any |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
  }
  return any;
}

DTRAIN_PRIVATE size_t dt__strategy_nonfinite(const float *x, size_t b, size_t e) {
  for (size_t i = b; i < e; i += DT__NONFINITE_BLOCK) {
    size_t n = DT__MIN(e - i, (size_t)DT__NONFINITE_BLOCK);
    int any = n == DT__NONFINITE_BLOCK ? dt__nonfinite_block(x + i) != 0 : 1; /* a short tail: searched */
    if (any)
      for (size_t j = 0; j < n; j++)
        if (!isfinite(x[i + j])) return i + j;
  }
  return e;
}
#undef DT__NONFINITE_BLOCK

DTRAIN_PRIVATE size_t dt__strategy_nonfinite_trainable(dt_strategy *s, const float *x, size_t b, size_t e) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    if (lo < hi) {
      size_t bad = dt__strategy_nonfinite(x, lo, hi);
      if (bad < hi) return bad;
    }
  }
  return e;
}

DTRAIN_PRIVATE int dt__strategy_bad_step(dt_strategy *s, int r, const char *what) {
  /* backup workers: the replica's gradient stays out of its step, as a late one would */
  if (s->desc.skip_nonfinite && (!(s->mod->flags & DT__STRATEGY_SYNC) || s->backup)) {
    s->rep[r].skipped = 1;
    return 1;
  }
  dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
  return 0;
}

/* check_numerics found a local gradient's flat index `bad` not finite (a
 * NaN when nan): dt__strategy_bad_step with the message naming it. */
DTRAIN_PRIVATE int dt__strategy_grad_bad(dt_strategy *s, int r, int64_t step, size_t bad, int nan) {
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "step %lld: gradient of '%s' is %s at flat index %zu", (long long)step,
           dt__strategy_param_at(s, bad), nan ? "NaN" : "Inf", bad);
  return dt__strategy_bad_step(s, r, what);
}

DTRAIN_PRIVATE const char *dt__strategy_param_at(dt_strategy *s, size_t i) {
  dt_param_info info;
  for (int p = 0; p < dt_params_count(s->params); p++)
    if (dt_params_info(s->params, p, &info) == DTRAIN_OK && i >= info.offset && i < info.offset + info.size)
      return info.name;
  return "(padding)";
}

static int dt__strategy_compute_run(dt_strategy *s, int r, const dt_minibatch *b);

/* A replica's forward and backward into its own gradient. On the CPU the
 * gradient is not zeroed first: its zeroing is deferred to each parameter's
 * first use (dt__graph_grad_defer: a linear layer writes its weight
 * gradient instead of adding it to zeros) and whatever no op wrote is zeroed
 * after backward, or on the way out (dt__graph_grad_settle): on every
 * return the buffer holds the step's gradient, zeros where none flowed. */
DTRAIN_PRIVATE int dt__strategy_compute(dt_strategy *s, int r, const dt_minibatch *b) {
  dt__strategy_replica *R = &s->rep[r];
  if (s->dev) {
    dt_result zr = dt_graph_zero_grad(R->g);
    if (zr != DTRAIN_OK) {
      dt__strategy_fail(s, r, zr, dt_last_error());
      return 0;
    }
    return dt__strategy_compute_run(s, r, b);
  }
  (void)dt__graph_grad_defer(R->g); /* (a CPU graph's falls back to zeroing: it cannot fail) */
  int ok = dt__strategy_compute_run(s, r, b);
  dt__graph_grad_settle(R->g);
  return ok;
}

static int dt__strategy_compute_run(dt_strategy *s, int r, const dt_minibatch *b) {
  dt__strategy_replica *R = &s->rep[r];
  char what[DT__MSG_CAP];
  R->rows = b->rows;
  R->loss = 0.0f;
  R->skipped = 0;
  if (b->rows == 0) return 1;
  double t0 = dt__now();
  dt_graph_reset(R->g);
  dt_tensor *L = s->step(R->g, r, b, s->user);
  dt_result rc = dt_graph_error(R->g);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_graph_message(R->g));
    return 0;
  }
  if (!L) {
    dt__strategy_fail(s, r, DTRAIN_ERR_NULL_ARG, "the step function returned NULL without a graph error");
    return 0;
  }
  if (L->size != 1) {
    char sb[96];
    snprintf(what, sizeof what, "the step function's loss must have one element, got %s",
             dt_shape_str(L, sb, sizeof sb));
    dt__strategy_fail(s, r, DTRAIN_ERR_SHAPE, what);
    return 0;
  }
  float lv;
  if (!s->dev) {
    lv = L->data[0];
  } else if ((rc = dt_tensor_to_host(L, &lv)) != DTRAIN_OK) { /* the loss comes from the device */
    dt__strategy_fail(s, r, rc, dt_last_error());
    return 0;
  }
  if (!isfinite(lv)) {
    snprintf(what, sizeof what, "step %lld: loss is %s; no update made", (long long)b->step, isnan(lv) ? "NaN" : "Inf");
    R->loss = lv;
    return dt__strategy_bad_step(s, r, what);
  }
  float w = b->weight;
  rc = dt_backward_grad(R->g, L, &w);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_graph_message(R->g));
    return 0;
  }
  if (!s->dev) dt__graph_grad_settle(R->g); /* before the scan below */
  R->loss = lv;
  if (s->desc.check_numerics && !(r == 0 && s->ov)) {
    /* Before any reduction or optimizer state sees it, and where the
     * culprit is still known. On a device: a host copy is scanned. (With
     * overlap, buckets are summed while backward runs: the overlap thread
     * scans each before it goes.) */
    const float *hg = R->grad;
    if (s->dev) {
      dt_device *d = s->desc.devices[r];
      rc = d->copy(d, R->old, R->grad, s->fbytes, DTRAIN_COPY_D2H);
      if (rc != DTRAIN_OK) {
        snprintf(what, sizeof what, "check_numerics: gradient to the host: device %.40s: %.200s", d->name,
                 dt_last_error());
        dt__strategy_fail(s, r, rc, what);
        return 0;
      }
      hg = R->old;
    }
    size_t bad = dt__strategy_nonfinite(hg, 0, s->size);
    if (bad < s->size && !dt__strategy_grad_bad(s, r, b->step, bad, isnan(hg[bad]) != 0)) return 0;
  }
  double dt = dt__now() - t0;
  if (r == s->desc.straggler && s->desc.straggler_factor > 1.0f) {
    double extra = dt * ((double)s->desc.straggler_factor - 1.0);
    dt__sleep(extra);
    dt += extra;
  }
  R->compute_s += dt;
  return 1;
}

/* ---- clipping and the update of a slice --------------------------------------------------------- */

DTRAIN_PRIVATE double dt__strategy_sumsq(dt_strategy *s, const float *grad, size_t b, size_t e) {
  double ss = 0.0;
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    for (size_t j = lo; j < hi; j++) ss += (double)grad[j] * (double)grad[j];
  }
  return ss;
}

DTRAIN_PRIVATE void dt__strategy_scale(dt_strategy *s, float *grad, size_t b, size_t e, float coef) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    for (size_t j = lo; j < hi; j++) grad[j] *= coef;
  }
}

/* PyTorch's clip_grad_norm_ through dt__clip_scale, the formula dt_optim.c
 * uses too, so that a strategy clips exactly as one_device's optimizer
 * would. 0: the norm is not finite (nothing scaled). */
DTRAIN_PRIVATE int dt__strategy_clip_scale(dt_strategy *s, float *grad, size_t b, size_t e, double norm, float clip) {
  if (!isfinite(norm)) return 0;
  float coef = dt__clip_scale(norm, clip);
  if (coef != 1.0f) dt__strategy_scale(s, grad, b, e, coef);
  return 1;
}

DTRAIN_PRIVATE int dt__strategy_clip_own(dt_strategy *s, int r, float clip, const char *what_not) {
  if (!(clip > 0.0f)) return 1;
  dt__strategy_replica *R = &s->rep[r];
  if (dt__strategy_clip_scale(s, R->grad, 0, s->size, sqrt(dt__strategy_sumsq(s, R->grad, 0, s->size)), clip))
    return 1;
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "gradient norm is not finite; %s", what_not);
  dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
  return 0;
}

DTRAIN_PRIVATE int dt__strategy_own_grad_ok(dt_strategy *s, int r, int64_t step) {
  const float *g = s->rep[r].grad;
  size_t bad = dt__strategy_nonfinite_trainable(s, g, 0, s->size);
  if (bad == s->size) return 1;
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "step %lld: gradient of '%s' is %s at flat index %zu; no update made", (long long)step,
           dt__strategy_param_at(s, bad), isnan(g[bad]) ? "NaN" : "Inf", bad);
  dt__strategy_bad_step(s, r, what);
  return 0;
}

/* Replica r's part of gradient clipping over the slice [b, e) of grad: the
 * global norm from every replica's partial sum (a barrier between). */
static int dt__strategy_clip_slice(dt_strategy *s, int r, float *grad, size_t b, size_t e) {
  float clip = dt_optim_get_options(s->opt)->clip_norm;
  if (!(clip > 0.0f)) return 1;
  s->rep[r].ss_part = dt__strategy_sumsq(s, grad, b, e);
  dt_result rc = dt_comm_barrier(s->comm, r);
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    return 0;
  }
  double ss = 0.0;
  for (int j = 0; j < s->n; j++) ss += s->rep[j].ss_part; /* rank order: the same total everywhere */
  double norm = sqrt(ss);
  if (dt__strategy_clip_scale(s, grad, b, e, norm, clip)) return 1;
  /* Every replica sees the same total; let replica 0 report it. */
  if (r == 0) {
    char what[128];
    snprintf(what, sizeof what, "step %lld: gradient norm is %s; no update made",
             (long long)(s->batch ? s->batch->step : -1), isnan(norm) ? "NaN" : "Inf");
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
  } else {
    s->rep[r].result = DTRAIN_ERR_ABORTED;
  }
  return 0;
}

/* The reduced gradient is checked before any update (see "Non-finite
 * steps" in dt_strategy.h): with clip_norm the global norm (computed
 * anyway) is that check; otherwise each replica scans the trainable
 * elements of its slice (check_numerics: every element), and a barrier
 * keeps everybody from updating before everybody checked. finite = 1: the
 * reduce-scatter already told every replica that every element of the sum
 * is finite (dt__comm_reduce_scatter_finite), so neither is needed. */
DTRAIN_PRIVATE int dt__strategy_update_slice(dt_strategy *s, int r, float *data, float *grad, size_t lo, size_t hi,
                                             int finite) {
  if (!dt__strategy_clip_slice(s, r, grad, lo, hi)) return 0;
  dt_result rc;
  if (!finite && (s->desc.check_numerics || !(dt_optim_get_options(s->opt)->clip_norm > 0.0f))) {
    size_t bad = s->desc.check_numerics ? dt__strategy_nonfinite(grad, lo, hi)
                                        : dt__strategy_nonfinite_trainable(s, grad, lo, hi);
    if (bad < hi) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "step %lld: reduced gradient of '%s' is %s at flat index %zu; no update made",
               (long long)(s->batch ? s->batch->step : -1), dt__strategy_param_at(s, bad),
               isnan(grad[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
    /* nobody updates before everybody checked */
    rc = dt_comm_barrier(s->comm, r);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      return 0;
    }
  }
  rc = dt_optim_update(s->opt, data, grad, lo, hi);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    return 0;
  }
  return 1;
}

DTRAIN_PRIVATE void dt__strategy_copy_buffers(dt_strategy *s, float *dst, const float *src, size_t b, size_t e) {
  for (int i = 0; i < s->nbufr; i++) {
    size_t lo = DT__MAX(s->bufr[2 * i], b), hi = DT__MIN(s->bufr[2 * i + 1], e);
    if (lo < hi) memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float));
  }
}

DTRAIN_PRIVATE double dt__strategy_comm_wait(dt_strategy *s, int r) {
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  return cs.wait_s;
}

/* ---- running jobs ------------------------------------------------------------------------------ */

static void dt__strategy_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  int was = dt__par_set_replica(s->n > 1); /* replicas fill the cores: kernels inside use one thread */
  if (dt__prof_tracing()) {
    char name[32];
    snprintf(name, sizeof name, "replica %d", r);
    dt_trace_name_thread(name);
  }
  s->job(s, r);
  dt__par_set_replica(was);
}

DTRAIN_PRIVATE void dt__strategy_dev_restore(dt_strategy *s, int64_t opt_steps) {
  int any = 0;
  for (int r = 0; r < s->n; r++) any |= s->rep[r].updating;
  if (!any) return;
  dt__quiet_push();
  for (int r = 0; r < s->n; r++) (void)dt_graph_params_upload(s->rep[r].g);
  dt__quiet_pop(DTRAIN_OK);
  dt_optim_set_steps(s->opt, opt_steps);
}

DTRAIN_PRIVATE dt_result dt__strategy_launch(dt_strategy *s, const char *fn) {
  DT__ASTORE(&s->failed, -1, DT__MO_RELAXED);
  s->err = DTRAIN_OK;
  s->msg[0] = '\0';
  if (s->pstore) dt_pstore_begin(s->pstore);
  dt__pool_run(s->pool, dt__strategy_job, s);
  if (s->mod->after_job) s->mod->after_job(s);
  int f = DT__ALOAD(&s->failed, DT__MO_ACQUIRE);
  s->last_failed = f;
  if (f < 0) return DTRAIN_OK;
  if (s->comm) dt_comm_recover(s->comm);
  if (s->dev) dt__strategy_dev_restore(s, s->dev_opt_steps);
  if (s->err == DTRAIN_ERR_NONFINITE && s->desc.skip_nonfinite && (s->mod->flags & DT__STRATEGY_SYNC)) {
    /* to be skipped by dt_strategy_step: a warning, not an error */
    dt__log(DTRAIN_LOG_WARN, s->err, "%s: skipped: %s", fn, s->msg);
    return s->err;
  }
  return dt__error(s->err, "%s: %s", fn, s->msg);
}

DTRAIN_PRIVATE float *dt__strategy_floats(dt_strategy *s, const float *init) {
  float *p = (float *)dt__alloc(s->fbytes ? s->fbytes : sizeof(float));
  if (p) {
    if (init) memcpy(p, init, s->fbytes);
    else memset(p, 0, s->fbytes);
  }
  return p;
}

DTRAIN_PRIVATE dt_result dt__strategy_nomem(dt_strategy *s) {
  return dt__error(DTRAIN_ERR_NOMEM, "dt_strategy_create: out of memory for %d replicas of %zu floats", s->n, s->size);
}

/* The lock-step kinds' CPU replicas share the params' one copy when the
 * model has no buffers (nothing a forward writes into the parameters; frozen
 * parameters count as buffers) and no replica keeps its own (backup
 * workers): forward and backward only read it, and the slices are updated
 * in place after every replica's backward is over. */
DTRAIN_PRIVATE int dt__strategy_shared(const dt_strategy *s) {
  return s->nbufr == 0 && s->desc.backup_workers == 0 && !s->desc.devices && (s->mod->flags & DT__STRATEGY_SYNC);
}

DTRAIN_PRIVATE dt_result dt__strategy_bind(dt_strategy *s, int r, int own_data, int own_grad, float *grad0) {
  dt__strategy_replica *R = &s->rep[r];
  float *pdata = dt_params_data(s->params);
  if (own_data && !(R->own_data = dt__strategy_floats(s, pdata))) return dt__strategy_nomem(s);
  if (own_grad && !(R->own_grad = dt__strategy_floats(s, NULL))) return dt__strategy_nomem(s);
  R->data = own_data ? R->own_data : pdata;
  R->grad = grad0 ? grad0 : own_grad ? R->own_grad : dt_params_grad(s->params);
  return dt_graph_bind(R->g, R->data, R->grad);
}

