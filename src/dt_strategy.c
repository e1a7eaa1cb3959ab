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

/* ---- running jobs ------------------------------------------------------------------------------ */

static dt_result dt__strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss);

DTRAIN_API dt_result dt_strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss) {
  int64_t t0 = dt__trace_t0();
  dt_result rc = dt__strategy_step(s, batch, loss);
  dt__trace_end("dt_strategy_step", DT__TRACE_STEP, t0);
  return rc;
}

static dt_result dt__strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss) {
  const char *fn = "dt_strategy_step";
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: strategy is NULL", fn);
  if (loss) *loss = NAN;
  dt_result rc = dt__strategy_check_batch(batch, fn);
  if (rc != DTRAIN_OK) return rc;
  if (s->backup)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: backup workers (desc.backup_workers %d) need dt_strategy_run: a "
                     "step must not wait for its slowest replica, and one call cannot return before it", fn,
                     s->desc.backup_workers);
  const int sync = (s->mod->flags & DT__STRATEGY_SYNC) != 0;
  /* No rows, no gradient: yet the optimizer would move the parameters
   * (momentum, weight decay). Refused before anything runs.
   * multi_worker_mirrored: a rank's local batch may be empty; the exchange
   * refuses a global batch of 0 rows on every rank. */
  if (batch->rows == 0 && !(s->mod->flags & DT__STRATEGY_ROW_SUMS))
    return dt__error(DTRAIN_ERR_EMPTY, "%s: step %lld: the batch has 0 rows; nothing to train on, no update made", fn,
                     (long long)(sync ? s->steps : s->tickets));
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
#if !defined(DTRAIN_NO_DIST)
  if (s->ov) dt__overlap_arm(s->ov);
#endif
  rc = dt__strategy_launch(s, fn);
  s->batch = NULL;
  if (rc == DTRAIN_OK && s->dev) {
    /* dt_optim_step_graph advanced the optimizer; the params get replica 0's values */
    rc = dt_graph_params_download(s->rep[0].g);
    if (rc != DTRAIN_OK) rc = dt__error(rc, "%s: replica 0's parameters to the host: %s", fn, dt_last_error());
  }
  s->seconds += dt__now() - t0;
  if (rc == DTRAIN_ERR_NONFINITE && sync && s->desc.skip_nonfinite) {
    /* The failed step changed no parameter and no optimizer state: skip it.
     * It keeps its number (the next batch is the next step). */
    s->skipped++;
    s->steps++;
    s->last_failed = -1;
    return DTRAIN_OK;
  }
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
  int skipped = 0; /* async family: some replica skipped its push (skip_nonfinite) */
  for (int r = 0; r < s->n && !sync; r++) skipped |= s->rep[r].skipped;
  if (skipped) return DTRAIN_OK; /* *loss stays NaN, the mean leaves it out */
  s->last_loss = (float)L;
  s->loss_sum += L;
  s->loss_count++;
  if (loss) *loss = (float)L;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__strategy_run_steps(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                               float *mean_loss) {
  const char *fn = "dt_strategy_run";
  double sum = 0.0;
  int64_t counted = 0;
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
    if (L == L) { /* a skipped step (NaN) is left out */
      sum += L;
      counted++;
    }
  }
  if (mean_loss && counted > 0) *mean_loss = (float)(sum / (double)counted);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_strategy_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                     float *mean_loss) {
  const char *fn = "dt_strategy_run";
  if (mean_loss) *mean_loss = NAN;
  if (!s || !next) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !s ? "strategy" : "next");
  if (steps < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: steps %lld < 0", fn, (long long)steps);
  if (s->mod->run) return s->mod->run(s, steps, next, next_user, mean_loss);
  return dt__strategy_run_steps(s, steps, next, next_user, mean_loss);
}

/* ---- create / destroy -------------------------------------------------------------------------- */

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
  if (d->work_queue) {
    if (d->kind != DTRAIN_STRATEGY_PARAMETER_SERVER)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: work_queue is for parameter_server, not %s", fn, name);
    if (d->max_staleness != DTRAIN_STALENESS_UNBOUNDED)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: work_queue with max_staleness %d: the queue needs unbounded "
                       "staleness (a bound would hold the fast workers at the clock of a straggler, which takes "
                       "fewer items, or of a worker waiting for one)", fn, d->max_staleness);
    if (d->store && d->store->vtable && !d->store->vtable->take)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: work_queue: the %s store has no work queue", fn,
                       d->store->vtable->name ? d->store->vtable->name : "?");
  }
  if (d->compress.kind != DTRAIN_COMPRESS_NONE) {
    dt_compress_kind ck = d->compress.kind;
    if (ck != DTRAIN_COMPRESS_FP16 && ck != DTRAIN_COMPRESS_BF16 && ck != DTRAIN_COMPRESS_TOPK &&
        ck != DTRAIN_COMPRESS_POWERSGD)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: compress.kind %d is none of none, fp16, bf16, topk, powersgd",
                       fn, (int)ck);
    if (ck == DTRAIN_COMPRESS_TOPK && !(d->compress.fraction > 0.0f && d->compress.fraction <= 1.0f))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: compress topk: fraction %g outside (0, 1]", fn,
                       (double)d->compress.fraction);
    if (ck == DTRAIN_COMPRESS_POWERSGD && (d->compress.rank < 1 || d->compress.rank > 1024))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: compress powersgd: rank %d outside 1..1024", fn,
                       d->compress.rank);
    if (d->kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && d->kind != DTRAIN_STRATEGY_PARAMETER_SERVER)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: compress (%s) is for multi_worker_mirrored and parameter_server, "
                       "not %s (its gradients do not cross a wire)", fn, dt_compress_name(d->compress), name);
    if (d->kind == DTRAIN_STRATEGY_PARAMETER_SERVER && d->store && d->store->vtable &&
        (!d->store->vtable->name || strcmp(d->store->vtable->name, "tcp") != 0))
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: compress (%s) needs a store over TCP (dt_pstore_create_tcp), not "
                       "the %s store", fn, dt_compress_name(d->compress),
                       d->store->vtable->name ? d->store->vtable->name : "?");
  }
  if (d->overlap && d->kind != DTRAIN_STRATEGY_PARAMETER_SERVER) { /* parameter_server's: its module checks */
    if (d->kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && d->kind != DTRAIN_STRATEGY_MIRRORED)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: overlap is for mirrored, multi_worker_mirrored and "
                       "parameter_server, not %s", fn, name);
    if (d->compress.kind == DTRAIN_COMPRESS_TOPK || d->compress.kind == DTRAIN_COMPRESS_POWERSGD)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: overlap with compress %s (top-k selects over the whole "
                       "gradient and PowerSGD factors it in two rounds: neither can start before backward ends; "
                       "use fp16 or bf16, or no overlap)", fn, dt_compress_name(d->compress));
    if (d->devices || d->ndevices)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: overlap with replicas on devices", fn);
    if (d->backup_workers > 0)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: overlap with backup workers (a step sums the first replicas "
                       "to finish, which it knows only after their backward passes)", fn);
  }
  if (d->push_early) {
    if (d->kind != DTRAIN_STRATEGY_PARAMETER_SERVER)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: push_early is for parameter_server (its pushes go to the "
                       "servers in parts during backward), not %s; mirrored and multi_worker_mirrored have overlap",
                       fn, name);
  }
  if (d->async_in_place && d->kind != DTRAIN_STRATEGY_ASYNC)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_in_place is for async (its replicas and the store share "
                     "one process), not %s", fn, name);
  if (d->async_sharded && d->kind != DTRAIN_STRATEGY_ASYNC)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_sharded is for async (its replicas hand each other their "
                     "gradients in memory), not %s", fn, name);
  if (d->backup_workers != 0) {
    if (d->kind != DTRAIN_STRATEGY_MIRRORED)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: backup_workers is for mirrored, not %s", fn, name);
    if (d->backup_workers < 0 || d->backup_workers >= d->replicas)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: backup_workers %d outside [0, %d) (replicas %d)", fn,
                       d->backup_workers, d->replicas, d->replicas);
    if (d->devices || d->ndevices)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: backup_workers with replicas on devices", fn);
  }
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
#if !defined(DTRAIN_NO_DIST)
  /* Overlap: with something to sum (replicas here, or processes). */
  if (d.overlap && (s->n > 1 || d.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED)) {
    dt_comm *x = d.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED ? d.comm : NULL;
    if (dt__overlap_create(s, x, d.bucket_bytes ? d.bucket_bytes : (size_t)2 << 20, &s->ov) != DTRAIN_OK) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "%.300s", dt_last_error());
      dt__error(dt_last_result(), "%s: %s: %s", fn, m->name, what);
      goto fail;
    }
  }
#endif
  /* The lock-step kinds meet their replicas on an in-process communicator. */
  if ((m->flags & DT__STRATEGY_SYNC) && !(s->comm = dt_comm_create_threads(s->n, d.spin_us))) goto fail;
  if (s->dev && dt__strategy_dev_start(s) != DTRAIN_OK) goto fail;
  s->pool = dt__pool_create(s->n, dt__spin_seconds(d.spin_us, s->n));
  if (!s->pool) goto fail;
  if (m->start && m->start(s, fn) != DTRAIN_OK) goto fail;
  dt_strategy_reset_stats(s); /* (the store's byte counts so far are not this strategy's) */
  return s;
fail:
  dt_strategy_destroy(s);
  return NULL;
}

DTRAIN_API void dt_strategy_destroy(dt_strategy *s) {
  if (!s) return;
#if !defined(DTRAIN_NO_DIST)
  dt__overlap_destroy(s->ov); /* its thread reads the replicas' gradients */
#endif
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
DTRAIN_API const dt_strategy_options *dt_strategy_get_options(const dt_strategy *s) {
  if (!s) dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_get_options: strategy is NULL");
  return s ? &s->desc : NULL;
}
/* Deprecated name, removed in the next release. */
DTRAIN_API const dt_strategy_options *dt_strategy_get_desc(const dt_strategy *s) { return dt_strategy_get_options(s); }

DTRAIN_API dt_device *dt_strategy_device(const dt_strategy *s, int replica) {
  if (!s) dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_device: strategy is NULL");
  if (!s || !s->dev || replica < 0 || replica >= s->n) return NULL;
  return s->desc.devices[replica];
}

DTRAIN_API dt_graph *dt_strategy_graph(dt_strategy *s, int replica) {
  if (!s) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_graph: strategy is NULL");
    return NULL;
  }
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
  out->comm_s = R->comm_s;
  out->staleness_max = R->stale_max;
  out->staleness_mean = R->steps ? (double)R->stale_sum / (double)R->steps : 0.0;
  out->clock_gap_max = R->gap_max;
  out->result = R->result;
  out->dropped = R->dropped;
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
    out->compute_s_mean += R->compute_s / (double)s->n;
    out->comm_s_mean += R->comm_s / (double)s->n;
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
  out->skipped_steps = s->skipped;
  out->wire_bytes = s->wire_bytes;
  out->wire_bytes_received = s->wire_bytes; /* (symmetric collectives) */
  out->cache_handoff = s->handoff;
  if (s->pstore) {
    out->wire_bytes += s->pstore->wire_sent - s->wire_base[0];
    out->wire_bytes_received += s->pstore->wire_received - s->wire_base[1];
  }
  for (int r = 0; r < s->n; r++) {
    out->skipped_steps += s->rep[r].skips;
    out->dropped_grads += s->rep[r].dropped;
  }
  return DTRAIN_OK;
}

DTRAIN_API void dt_strategy_reset_stats(dt_strategy *s) {
  if (!s) return;
  for (int r = 0; r < s->n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    R->steps = R->samples = R->loss_count = 0;
    R->compute_s = R->wait_s = R->comm_s = R->loss_sum = 0.0;
    memset(R->hist, 0, sizeof R->hist);
    R->stale_max = R->stale_sum = R->gap_max = R->skips = R->dropped = 0;
  }
  s->steps = s->samples = s->loss_count = s->skipped = 0;
  s->wire_bytes = 0;
  if (s->pstore) s->wire_base[0] = s->pstore->wire_sent, s->wire_base[1] = s->pstore->wire_received;
  s->seconds = s->loss_sum = 0.0;
  if (s->comm) dt_comm_reset_stats(s->comm);
}

#undef DT__STRATEGY_KINDS
