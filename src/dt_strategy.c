/* ===========================================================================
 * dt_strategy.c -- the strategies' front door: the table of modules, the
 * public functions (check, then dispatch), and the helpers that several
 * kinds share (shards, forward/backward, clipping, failures, statistics)
 * ===========================================================================
 * Each strategy kind is a module with its own file and table (see
 * dt_strategy_impl.h). What every kind shares lives here:
 *
 *   create   check the desc (common rules + the table's flags and hooks);
 *            non-trainable runs; one graph per replica (bound by the
 *            module's replica hook, or to device copies); the in-process
 *            communicator for the lock-step kinds; the thread pool
 *   step     one job on the pool: each replica thread runs s->job
 *            (mod->job, or the device job); the first failure wins and
 *            breaks the barrier or store so that nobody waits; then the
 *            totals (global steps for lock-step kinds, pushes for async)
 *   run      the module's run, or `steps` steps from the batch function
 *
 * A synchronous replica's job, whatever the kind: its shard of the batch ->
 * zero own gradient -> step fn + backward (the loss gradient weighted by the
 * shard's share) -> the kind's reduction -> (clip: partial norms, a barrier,
 * the total in rank order) -> (numerics check, a barrier, so that a bad
 * gradient stops every replica before any update) -> dt_optim_update on the
 * replica's slice (one optimizer, disjoint ranges: its state is sharded by
 * slice) -> the kind's spreading of the result. The caller advances the
 * optimizer once per step after the pool joins.
 */
#include "dt_strategy_impl.h"

/* ---- the modules ------------------------------------------------------------------------ */

/* Indexed by dt_strategy_kind (DT__STRATEGY_MODULES in dt_strategy_impl.h). */
#define DT__STRATEGY_ENTRY(getter) getter,
static const dt__strategy_module *(*const dt__strategy_modules[])(void) = {DT__STRATEGY_MODULES(DT__STRATEGY_ENTRY)};
#undef DT__STRATEGY_ENTRY
#define DT__STRATEGY_KINDS ((int)(sizeof dt__strategy_modules / sizeof dt__strategy_modules[0]))

/* The module of `kind`, or NULL for an unknown kind. */
static const dt__strategy_module *dt__strategy_module_of(int kind) {
  return kind >= 0 && kind < DT__STRATEGY_KINDS ? dt__strategy_modules[kind]() : NULL;
}

/* ---- small utilities, names, descs ----------------------------------------------------------- */

DTRAIN_API void dt_sleep(double seconds) { dt__sleep(seconds); }
DTRAIN_API int dt_cpu_count(void) { return dt__cpu_count(); }

DTRAIN_API const char *dt_strategy_kind_name(dt_strategy_kind kind) {
  const dt__strategy_module *m = dt__strategy_module_of((int)kind);
  return m ? m->name : "unknown";
}

DTRAIN_PRIVATE dt_strategy_desc dt__strategy_desc(dt_strategy_kind kind, int replicas, int max_staleness) {
  dt_strategy_desc d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.replicas = replicas;
  d.max_staleness = max_staleness;
  return d;
}

DTRAIN_API dt_result dt_strategy_parse(const char *name, int replicas, int max_staleness, dt_strategy_desc *out) {
  if (!name || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_parse: %s is NULL", !name ? "name" : "out");
  for (int k = 0; k < DT__STRATEGY_KINDS; k++) {
    const dt__strategy_module *m = dt__strategy_module_of(k);
    if (strcmp(name, m->name) == 0) {
      *out = dt__strategy_desc((dt_strategy_kind)k, (m->flags & DT__STRATEGY_ONE_REPLICA) ? 1 : replicas,
                               max_staleness);
      return DTRAIN_OK;
    }
  }
  /* The names come from the table, so a new module is listed here too. */
  char known[256];
  size_t used = 0;
  known[0] = '\0';
  for (int k = 0; k < DT__STRATEGY_KINDS && used < sizeof known; k++) {
    int w = snprintf(known + used, sizeof known - used, "%s%s", k ? ", " : "", dt__strategy_module_of(k)->name);
    if (w < 0) break;
    used += (size_t)w;
  }
  return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_strategy_parse: unknown strategy '%s' (%s)", name, known);
}

/* ---- failures -------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__strategy_fail(dt_strategy *s, int r, dt_result code, const char *what) {
  int expected = -1;
  s->rep[r].result = code;
  if (DT__ACAS(&s->failed, &expected, r, DT__MO_SEQ_CST)) {
    s->err = code;
    snprintf(s->msg, sizeof s->msg, "replica %d: %s", r, what);
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

DTRAIN_PRIVATE size_t dt__strategy_nonfinite(const float *x, size_t b, size_t e) {
  for (size_t i = b; i < e; i++)
    if (!isfinite(x[i])) return i;
  return e;
}

DTRAIN_PRIVATE const char *dt__strategy_param_at(dt_strategy *s, size_t i) {
  dt_param_info info;
  for (int p = 0; p < dt_params_count(s->params); p++)
    if (dt_params_info(s->params, p, &info) == DTRAIN_OK && i >= info.offset && i < info.offset + info.size)
      return info.name;
  return "(padding)";
}

DTRAIN_PRIVATE int dt__strategy_compute(dt_strategy *s, int r, const dt_minibatch *b) {
  dt__strategy_replica *R = &s->rep[r];
  char what[DT__MSG_CAP];
  if (s->dev) {
    dt_result zr = dt_graph_zero_grad(R->g);
    if (zr != DTRAIN_OK) {
      dt__strategy_fail(s, r, zr, dt_last_error());
      return 0;
    }
  } else {
    memset(R->grad, 0, s->fbytes);
  }
  R->rows = b->rows;
  R->loss = 0.0f;
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
    snprintf(what, sizeof what, "loss is %s", isnan(lv) ? "NaN" : "Inf");
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
  float w = b->weight;
  rc = dt_backward_grad(R->g, L, &w);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_graph_message(R->g));
    return 0;
  }
  R->loss = lv;
  if (s->desc.check_numerics) {
    /* Before any reduction or optimizer state sees it, and where the
     * culprit is still known. On a device: a host copy is scanned. */
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
    if (bad < s->size) {
      snprintf(what, sizeof what, "gradient of '%s' is %s at flat index %zu", dt__strategy_param_at(s, bad),
               isnan(hg[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
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
    char what[96];
    snprintf(what, sizeof what, "gradient norm is %s; no update made", isnan(norm) ? "NaN" : "Inf");
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
  } else {
    s->rep[r].result = DTRAIN_ERR_ABORTED;
  }
  return 0;
}

DTRAIN_PRIVATE int dt__strategy_update_slice(dt_strategy *s, int r, float *data, float *grad, size_t lo, size_t hi) {
  if (!dt__strategy_clip_slice(s, r, grad, lo, hi)) return 0;
  dt_result rc;
  if (s->desc.check_numerics) {
    size_t bad = dt__strategy_nonfinite(grad, lo, hi);
    if (bad < hi) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "reduced gradient of '%s' is %s at flat index %zu; no update made",
               dt__strategy_param_at(s, bad), isnan(grad[bad]) ? "NaN" : "Inf", bad);
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
  s->job(s, r);
  dt__par_set_replica(was);
}

DTRAIN_PRIVATE dt_result dt__strategy_launch(dt_strategy *s, const char *fn) {
  DT__ASTORE(&s->failed, -1, DT__MO_RELAXED);
  s->err = DTRAIN_OK;
  s->msg[0] = '\0';
  if (s->pstore) dt_pstore_begin(s->pstore);
  dt__pool_run(s->pool, dt__strategy_job, s);
  int f = DT__ALOAD(&s->failed, DT__MO_ACQUIRE);
  s->last_failed = f;
  if (f < 0) return DTRAIN_OK;
  if (s->comm) dt_comm_recover(s->comm);
  if (s->dev) dt__strategy_dev_restore(s, s->dev_opt_steps);
  return dt__error(s->err, "%s: %s", fn, s->msg);
}

DTRAIN_API dt_result dt_strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss) {
  const char *fn = "dt_strategy_step";
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: strategy is NULL", fn);
  dt_result rc = dt__strategy_check_batch(batch, fn);
  if (rc != DTRAIN_OK) return rc;
  const int sync = (s->mod->flags & DT__STRATEGY_SYNC) != 0;
  double t0 = dt__now();
  dt_minibatch gb = *batch;
  gb.step = sync ? s->steps : s->tickets;
  s->batch = &gb;
  s->next = NULL;
  s->job_steps = 1; /* async: one round, one step per replica */
  s->ticket_base = s->tickets;
  int64_t before = 0;
  for (int r = 0; r < s->n; r++) before += s->rep[r].steps;
  if (s->dev) s->dev_opt_steps = dt_optim_steps(s->opt);
  rc = dt__strategy_launch(s, fn);
  s->batch = NULL;
  if (rc == DTRAIN_OK && s->dev) {
    /* dt_optim_step_graph advanced the optimizer; the params get replica 0's values */
    rc = dt_graph_params_download(s->rep[0].g);
    if (rc != DTRAIN_OK) rc = dt__error(rc, "%s: replica 0's parameters to the host: %s", fn, dt_last_error());
  }
  s->seconds += dt__now() - t0;
  if (rc != DTRAIN_OK) return rc;
  /* The batch's loss: shard losses weighted by their share, in rank order
   * (or the module's: multi_worker_mirrored's comes from the all-reduce). */
  double L = 0.0;
  if (s->mod->loss) {
    L = s->mod->loss(s, &gb);
  } else {
    for (int r = 0; r < s->n; r++) {
      double w = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0 : (gb.rows ? (double)s->rep[r].rows / (double)gb.rows : 0.0);
      L += w * (double)s->rep[r].loss;
    }
  }
  if (sync) {
    if (!s->dev) dt_optim_advance(s->opt);
    for (int r = 0; r < s->n; r++) {
      s->rep[r].steps++;
      s->rep[r].samples += s->rep[r].rows;
    }
    s->steps++;
  } else {
    int64_t after = 0;
    for (int r = 0; r < s->n; r++) after += s->rep[r].steps;
    s->steps += after - before;
    s->tickets += s->n;
  }
  s->samples += gb.rows;
  s->last_loss = (float)L;
  s->loss_sum += L;
  s->loss_count++;
  if (loss) *loss = (float)L;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_strategy_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                     float *mean_loss) {
  const char *fn = "dt_strategy_run";
  if (mean_loss) *mean_loss = NAN;
  if (!s || !next) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !s ? "strategy" : "next");
  if (steps < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: steps %lld < 0", fn, (long long)steps);
  if (s->mod->run) return s->mod->run(s, steps, next, next_user, mean_loss);
  double sum = 0.0;
  for (int64_t t = 0; t < steps; t++) {
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    int64_t id = s->steps;
    dt_result rc = next(next_user, -1, id, &b);
    if (rc != DTRAIN_OK)
      return dt__error(rc, "%s: the batch function failed for step %lld (%s)", fn, (long long)id, dt_result_name(rc));
    float L;
    rc = dt_strategy_step(s, &b, &L);
    if (rc != DTRAIN_OK) return rc;
    sum += L;
  }
  if (mean_loss && steps > 0) *mean_loss = (float)(sum / (double)steps);
  return DTRAIN_OK;
}

/* ---- create / destroy -------------------------------------------------------------------------- */

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

DTRAIN_PRIVATE dt_result dt__strategy_bind(dt_strategy *s, int r, int own_data, int own_grad, float *grad0) {
  dt__strategy_replica *R = &s->rep[r];
  float *pdata = dt_params_data(s->params);
  if (own_data && !(R->own_data = dt__strategy_floats(s, pdata))) return dt__strategy_nomem(s);
  if (own_grad && !(R->own_grad = dt__strategy_floats(s, NULL))) return dt__strategy_nomem(s);
  R->data = own_data ? R->own_data : pdata;
  R->grad = grad0 ? grad0 : own_grad ? R->own_grad : dt_params_grad(s->params);
  return dt_graph_bind(R->g, R->data, R->grad);
}

#if defined(DTRAIN_NO_DIST)
DTRAIN_PRIVATE dt_result dt__strategy_compiled_out(dt_strategy_desc *d) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_strategy_create: %s is compiled out (DTRAIN_NO_DIST); use one_device",
                   dt_strategy_kind_name(d->kind));
}
#endif

/* The common rules of a desc, and the kind's (its flags and hooks), in an
 * order that decides which error a desc with several gets. Fills defaults. */
static dt_result dt__strategy_check_desc(dt_strategy_desc *d, const dt__strategy_module **out) {
  const char *fn = "dt_strategy_create";
  const dt__strategy_module *m = dt__strategy_module_of((int)d->kind);
  if (!m) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown strategy kind %d", fn, (int)d->kind);
  *out = m;
  dt_result rc;
  if (m->prepare && (rc = m->prepare(d)) != DTRAIN_OK) return rc;
  const char *name = m->name;
#if defined(DTRAIN_NO_THREADS)
  if (!(m->flags & DT__STRATEGY_ONE_REPLICA))
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %s needs threads (built with DTRAIN_NO_THREADS); use one_device",
                     fn, name);
#endif
  if (d->devices && d->replicas == 0) d->replicas = d->ndevices;
  if (m->flags & DT__STRATEGY_ONE_REPLICA) {
    if (d->replicas > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s has 1 replica, not %d", fn, name, d->replicas);
    d->replicas = 1;
  }
  if (d->replicas == 0) d->replicas = DT__MIN(dt__cpu_count(), DTRAIN_MAX_REPLICAS);
  if (d->replicas < 1 || d->replicas > DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s with %d replicas (need 1..%d)", fn, name, d->replicas,
                     DTRAIN_MAX_REPLICAS);
  if (!(m->flags & DT__STRATEGY_SYNC) && d->max_staleness < DTRAIN_STALENESS_UNBOUNDED)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
                     d->max_staleness);
  if (d->async_update != DTRAIN_ASYNC_HOGWILD && d->async_update != DTRAIN_ASYNC_ATOMIC)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown async update rule %d", fn, (int)d->async_update);
  if (d->loss != DTRAIN_LOSS_MEAN && d->loss != DTRAIN_LOSS_SUM)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown loss reduction %d", fn, (int)d->loss);
  if (!(d->straggler_factor >= 0.0f) || !isfinite(d->straggler_factor))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: straggler_factor %g must be finite and >= 0", fn,
                     (double)d->straggler_factor);
  if (d->straggler_factor > 1.0f && (d->straggler < 0 || d->straggler >= d->replicas))
    return dt__error(DTRAIN_ERR_INDEX, "%s: straggler replica %d outside [0, %d)", fn, d->straggler, d->replicas);
  if (m->check && (rc = m->check(d)) != DTRAIN_OK) return rc;
  if (d->devices || d->ndevices) {
    if (!(m->flags & DT__STRATEGY_DEVICES))
      return dt__error(DTRAIN_ERR_UNSUPPORTED,
                       "%s: %s cannot run on devices (its parameters live in host memory); use one_device, "
                       "mirrored or multi_worker_mirrored with desc.devices", fn, name);
    if (!d->devices) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: desc.ndevices is %d but desc.devices is NULL", fn,
                                      d->ndevices);
    if (d->ndevices < 1 || d->ndevices > DTRAIN_MAX_REPLICAS)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: desc.ndevices %d (need 1..%d with desc.devices)", fn, d->ndevices,
                       DTRAIN_MAX_REPLICAS);
    if (d->replicas != d->ndevices)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s with %d replicas on %d devices (one replica per device; "
                       "replicas 0 takes the device count)", fn, name, d->replicas, d->ndevices);
    for (int i = 0; i < d->ndevices; i++) {
      const dt_device *dv = d->devices[i];
      if (!dv || !dv->alloc || !dv->free || !dv->zero || !dv->copy || !dv->sync || !dv->run)
        return dt__error(DTRAIN_ERR_NULL_ARG, "%s: desc.devices[%d] is NULL or has a NULL function", fn, i);
    }
  }
  if (d->seed == 0) d->seed = 1;
  return DTRAIN_OK;
}

/* The non-trainable runs (batch-norm statistics) into s->bufr, adjacent
 * ones (up to 16-float alignment padding apart) merged. */
static dt_result dt__strategy_find_buffers(dt_strategy *s) {
  int count = dt_params_count(s->params);
  size_t pb, pe;
  int tr, dec;
  for (int pass = 0; pass < 2; pass++) {
    int nr = 0;
    size_t cur_b = 0, cur_e = 0;
    int open = 0;
    for (int i = 0; i <= count; i++) {
      int have = i < count && dt__params_range(s->params, i, &pb, &pe, &tr, &dec);
      if (have && !tr) {
        if (open && pb <= ((cur_e + 15) / 16) * 16) {
          cur_e = pe;
        } else {
          if (open) {
            if (pass) { s->bufr[2 * nr] = cur_b; s->bufr[2 * nr + 1] = cur_e; }
            nr++;
          }
          cur_b = pb;
          cur_e = pe;
          open = 1;
        }
      } else if (open) {
        if (pass) { s->bufr[2 * nr] = cur_b; s->bufr[2 * nr + 1] = cur_e; }
        nr++;
        open = 0;
      }
    }
    if (pass == 0) {
      s->nbufr = nr;
      if (nr > 0) {
        s->bufr = (size_t *)dt__alloc((size_t)nr * 2 * sizeof(size_t));
        if (!s->bufr) return dt__strategy_nomem(s);
      }
    }
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_strategy *dt_strategy_create(dt_params *params, dt_optim *opt, dt_step_fn step, void *user,
                                           const dt_strategy_desc *desc) {
  const char *fn = "dt_strategy_create";
  if (!params || !opt || !step) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !params ? "params" : !opt ? "opt" : "step");
    return NULL;
  }
  dt_strategy_desc d = desc ? *desc : dt_strategy_one_device();
  const dt__strategy_module *m = NULL;
  if (dt__strategy_check_desc(&d, &m) != DTRAIN_OK) return NULL;
  if (dt_params_trainable_size(params) == 0) {
    dt__error(DTRAIN_ERR_STATE, "%s: the params have no trainable parameter", fn);
    return NULL;
  }
  dt_strategy *s = (dt_strategy *)dt__calloc(sizeof *s);
  if (!s) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  s->desc = d;
  s->mod = m;
  s->job = d.devices ? dt__strategy_dev_job : m->job; /* devices: one job for every kind that allows them */
  s->params = params;
  s->opt = opt;
  s->step = step;
  s->user = user;
  s->n = d.replicas;
  s->size = dt_params_size(params);
  s->fbytes = s->size * sizeof(float);
  s->last_failed = -1;
  DT__ASTORE(&s->failed, -1, DT__MO_RELAXED);
  DT__ASTORE(&s->ticket, (int64_t)0, DT__MO_RELAXED);
  if (dt__strategy_find_buffers(s) != DTRAIN_OK) goto fail;
  s->rep_bytes = (size_t)s->n * sizeof(dt__strategy_replica);
  s->rep = (dt__strategy_replica *)dt__calloc(s->rep_bytes);
  if (!s->rep) {
    dt__strategy_nomem(s);
    goto fail;
  }
  if (d.devices && dt__strategy_dev_create(s) != DTRAIN_OK) goto fail;
  if (m->create && m->create(s) != DTRAIN_OK) goto fail;
  for (int r = 0; r < s->n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    dt_graph_desc gd;
    memset(&gd, 0, sizeof gd);
    gd.arena_bytes = d.arena_bytes;
    gd.seed = d.seed + (uint64_t)r;
    gd.check_numerics = d.check_numerics;
    if (s->dev) gd.device = d.devices[r]; /* the graph holds its own device copy of the params */
    R->g = dt_graph_create(params, &gd);
    if (!R->g) {
      if (s->dev) {
        char what[DT__MSG_CAP];
        snprintf(what, sizeof what, "%.300s", dt_last_error());
        dt__error(dt_last_result(), "%s: replica %d on device %s: %s", fn, r, d.devices[r]->name, what);
      }
      goto fail;
    }
    R->result = DTRAIN_OK;
    if ((s->dev ? dt__strategy_dev_bind(s, r) : m->replica(s, r)) != DTRAIN_OK) goto fail;
  }
  /* The lock-step kinds meet their replicas on an in-process communicator. */
  if ((m->flags & DT__STRATEGY_SYNC) && !(s->comm = dt_comm_create_threads(s->n, d.spin_us))) goto fail;
  if (s->dev && dt__strategy_dev_start(s) != DTRAIN_OK) goto fail;
  s->pool = dt__pool_create(s->n, dt__spin_seconds(d.spin_us, s->n));
  if (!s->pool) goto fail;
  if (m->start && m->start(s, fn) != DTRAIN_OK) goto fail;
  return s;
fail:
  dt_strategy_destroy(s);
  return NULL;
}

DTRAIN_API void dt_strategy_destroy(dt_strategy *s) {
  if (!s) return;
  dt__pool_destroy(s->pool);
  dt_comm_destroy(s->comm);
  dt__strategy_dev_destroy(s);
  if (s->own_pstore) dt_pstore_destroy(s->pstore);
  if (s->rep) {
    for (int r = 0; r < s->n; r++) {
      dt__strategy_replica *R = &s->rep[r];
      dt_graph_destroy(R->g);
      dt_optim_destroy(R->opt);
      dt__free(R->own_data, s->fbytes ? s->fbytes : sizeof(float));
      dt__free(R->own_grad, s->fbytes ? s->fbytes : sizeof(float));
      dt__free(R->old, s->fbytes ? s->fbytes : sizeof(float));
    }
    dt__free(s->rep, s->rep_bytes);
  }
  dt__free(s->bufr, (size_t)s->nbufr * 2 * sizeof(size_t));
  if (s->mod && s->mod->destroy) s->mod->destroy(s);
  dt__free(s, sizeof *s);
}

DTRAIN_API dt_result dt_strategy_sync(dt_strategy *s) {
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_sync: strategy is NULL");
  return s->mod->sync ? s->mod->sync(s, "dt_strategy_sync") : DTRAIN_OK;
}

DTRAIN_API int dt_strategy_replicas(const dt_strategy *s) { return s ? s->n : 0; }
DTRAIN_API const dt_strategy_options *dt_strategy_get_options(const dt_strategy *s) { return s ? &s->desc : NULL; }
/* Deprecated name, removed in the next release. */
DTRAIN_API const dt_strategy_options *dt_strategy_get_desc(const dt_strategy *s) { return dt_strategy_get_options(s); }

DTRAIN_API dt_device *dt_strategy_device(const dt_strategy *s, int replica) {
  if (!s || !s->dev || replica < 0 || replica >= s->n) return NULL;
  return s->desc.devices[replica];
}

DTRAIN_API dt_graph *dt_strategy_graph(dt_strategy *s, int replica) {
  if (!s) return NULL;
  if (replica < 0 || replica >= s->n) {
    dt__error(DTRAIN_ERR_INDEX, "dt_strategy_graph: replica %d outside [0, %d)", replica, s->n);
    return NULL;
  }
  return s->rep[replica].g;
}

/* ---- statistics ------------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_strategy_replica_stats(const dt_strategy *s, int replica, dt_replica_stats *out) {
  if (!s || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_replica_stats: %s is NULL", !s ? "strategy" : "out");
  memset(out, 0, sizeof *out);
  if (replica < 0 || replica >= s->n)
    return dt__error(DTRAIN_ERR_INDEX, "dt_strategy_replica_stats: replica %d outside [0, %d)", replica, s->n);
  const dt__strategy_replica *R = &s->rep[replica];
  out->steps = R->steps;
  out->samples = R->samples;
  out->compute_s = R->compute_s;
  out->wait_s = R->wait_s;
  out->staleness_max = R->stale_max;
  out->staleness_mean = R->steps ? (double)R->stale_sum / (double)R->steps : 0.0;
  out->clock_gap_max = R->gap_max;
  out->result = R->result;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_strategy_stats_get(const dt_strategy *s, dt_strategy_stats *out) {
  if (!s || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_stats_get: %s is NULL", !s ? "strategy" : "out");
  memset(out, 0, sizeof *out);
  out->kind = s->desc.kind;
  out->replicas = s->n;
  out->steps = s->steps;
  out->samples = s->samples;
  out->seconds = s->seconds;
  if (s->seconds > 0.0) {
    out->steps_per_s = (double)s->steps / s->seconds;
    out->samples_per_s = (double)s->samples / s->seconds;
  }
  int64_t pushes = 0, stale_sum = 0;
  for (int r = 0; r < s->n; r++) {
    const dt__strategy_replica *R = &s->rep[r];
    out->wait_s_mean += R->wait_s / (double)s->n;
    if (R->wait_s > out->wait_s_max) out->wait_s_max = R->wait_s;
    for (int b = 0; b < DTRAIN_STALENESS_BINS; b++) out->staleness_hist[b] += R->hist[b];
    if (R->stale_max > out->staleness_max) out->staleness_max = R->stale_max;
    if (R->gap_max > out->clock_gap_max) out->clock_gap_max = R->gap_max;
    stale_sum += R->stale_sum;
    if (!(s->mod->flags & DT__STRATEGY_SYNC)) pushes += R->steps; /* async: a step is a push */
  }
  out->staleness_mean = pushes ? (double)stale_sum / (double)pushes : 0.0;
  out->last_loss = s->last_loss;
  out->mean_loss = s->loss_count ? s->loss_sum / (double)s->loss_count : 0.0;
  out->failed_replica = s->last_failed;
  return DTRAIN_OK;
}

DTRAIN_API void dt_strategy_reset_stats(dt_strategy *s) {
  if (!s) return;
  for (int r = 0; r < s->n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    R->steps = R->samples = R->loss_count = 0;
    R->compute_s = R->wait_s = R->loss_sum = 0.0;
    memset(R->hist, 0, sizeof R->hist);
    R->stale_max = R->stale_sum = R->gap_max = 0;
  }
  s->steps = s->samples = s->loss_count = 0;
  s->seconds = s->loss_sum = 0.0;
  if (s->comm) dt_comm_reset_stats(s->comm);
}

#undef DT__STRATEGY_KINDS
