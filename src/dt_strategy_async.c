/* ===========================================================================
 * dt_strategy_async.c -- async (Hogwild with bounded staleness) against the
 * in-process parameter store; the replica loop and dt_strategy_run of the
 * async family (parameter_server uses them too)
 * ===========================================================================
 * A replica (dt__strategy_async_job) loops: take a ticket, get a batch, pull
 * from the store into its own copy, its own step (the module's local_step:
 * here forward/backward and the checks), push. The async module's push is
 * made block by block: each block of the update (its own optimizer step on
 * the pulled values, new - pulled) is computed and added to the store while
 * it is in the cache, so no full-length copy of the old values or of the
 * update is written (dt__pstore_push_blocks). See "Async update rule" and "Staleness" in
 * dt_strategy.h for the rules.
 */
#include "dt_strategy_impl.h"
#include "dt_optim_internal.h"

DTRAIN_API dt_strategy_options dt_strategy_async(int replicas, int max_staleness) {
  return dt__strategy_desc(DTRAIN_STRATEGY_ASYNC, replicas, max_staleness);
}
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_async(int replicas, int max_staleness) {
  return dt_strategy_async(replicas, max_staleness);
}

#if !defined(DTRAIN_NO_DIST) /* the module and the async family's replica loop */

/* The store over the params' data: replicas pull from it and push to it. */
static dt_result dt__async_create(dt_strategy *s) {
  const dt_strategy_desc *d = &s->desc;
  if (d->async_in_place) {
    const char *fn = "dt_strategy_create";
    /* Lock-step's pushes are sums in replica order (deterministic), and a
     * buffer's push is what the forward wrote into the replica's values. */
    if (d->max_staleness == 0)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_in_place in lock-step (max_staleness 0): its steps are "
                       "deterministic only on copies; use max_staleness >= 1 or unbounded", fn);
    if (s->nbufr > 0)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_in_place with buffers or frozen parameters (the first at "
                       "flat index %zu): the forward writes a buffer's new values into the parameters a replica "
                       "computes on, and the push adds what changed; use copies (async_in_place 0)", fn, s->bufr[0]);
    if (!dt__shared_direct())
      dt__log(DTRAIN_LOG_WARN, DTRAIN_OK, "%s: async_in_place: this build or CPU reads the store element by "
              "element (ThreadSanitizer, DTRAIN_NO_SIMD or not x86-64/AArch64); the replicas keep their copies", fn);
  }
  s->pstore = dt_pstore_create_local(dt_params_data(s->params), s->size, s->n, d->max_staleness, d->async_update,
                                     d->spin_us);
  if (!s->pstore) return dt_last_result();
  s->own_pstore = 1;
  s->pstore->staleness_lr = d->staleness_lr != 0;
  return DTRAIN_OK;
}

/* Whether the replicas compute on the store itself (async_in_place in
 * dt_strategy.h; dt__async_create refused it where it cannot be): only
 * where the store's sweeps are vector loops (dt__shared_direct). */
static int dt__async_direct(const dt_strategy *s) { return s->desc.async_in_place && dt__shared_direct(); }

/* Every replica: its gradient and optimizer (a clone of the given one, at
 * its step count); unless it computes on the store, its own copy of the
 * parameters and a vector for the buffers' pulled values; the vector for
 * a checked update (check_numerics) either way. */
static dt_result dt__async_replica(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  const int direct = dt__async_direct(s);
  dt_result rc = dt__strategy_bind(s, r, !direct, 1, NULL);
  if (rc != DTRAIN_OK) return rc;
  if ((!direct || s->desc.check_numerics) && !(R->old = dt__strategy_floats(s, NULL)))
    return dt__strategy_nomem(s);
  R->opt = dt_optim_create(s->params, dt_optim_get_options(s->opt));
  if (!R->opt) return dt_last_result();
  dt_optim_set_steps(R->opt, dt_optim_steps(s->opt));
  return DTRAIN_OK;
}

/* The update of elements [lo, hi) into d (dt__pstore_fill_fn): the
 * replica's optimizer step on its pulled values minus those values
 * (dt__optim_delta_span; the pulled values are not changed) for the
 * trainable parameters, what the forward made of the pulled
 * values for the others (batch-norm statistics; R->old holds the pulled
 * ones), 0 in the padding between parameters. The same floats as a step on
 * the whole copy followed by new - pulled (the optimizer's arithmetic is
 * element by element). */
typedef struct dt__async_fill_ctx {
  dt_strategy *s;
  int r;
} dt__async_fill_ctx;

static int dt__async_fill(void *user, size_t lo, size_t hi, float *d) {
  const dt__async_fill_ctx *c = (const dt__async_fill_ctx *)user;
  dt_strategy *s = c->s;
  dt__strategy_replica *R = &s->rep[c->r];
  /* x[j]: element lo + j of the values the update starts from. A replica
   * computing on the store itself (the atomic rule, staleness_lr or
   * check_numerics) takes them from a copy of the block made now: the
   * optimizer reads an element more than once (new - pulled), and other
   * replicas' pushes change the store meanwhile. */
  float snap[DT__PSTORE_BLOCK];
  const float *x = R->data + lo;
  float *store = dt__pstore_local_data(s->pstore);
  if (R->data == store) {
    dt__shared_load(snap, (dt__afloat *)store + lo, hi - lo);
    x = snap;
  }
  size_t pb, pe, at = lo;
  int tr, dec, any = 0;
  for (int i = dt__params_first_after(s->params, lo); dt__params_range(s->params, i, &pb, &pe, &tr, &dec) && pb < hi;
       i++) {
    size_t a = DT__MAX(pb, lo), e = DT__MIN(pe, hi);
    if (a > at) memset(d + (at - lo), 0, (a - at) * sizeof(float));
    float *o = d + (a - lo);
    if (tr) {
      dt__optim_delta_span(R->opt, x + (a - lo), o, R->grad, a, e);
    } else {
      for (size_t j = 0; j < e - a; j++) o[j] = x[a - lo + j] - R->old[a + j];
    }
    any = 1;
    at = e;
  }
  if (at < hi) memset(d + (at - lo), 0, (hi - at) * sizeof(float));
  return any;
}

/* The in-place form of the same (dt__pstore_step_fn): the replica's
 * optimizer step on the store's elements [lo, hi) themselves, x[0] being
 * element lo. Only for a replica computing on the store, which has no
 * buffers: every element is a trainable parameter's or padding. */
static void dt__async_step(void *user, size_t lo, size_t hi, float *x) {
  const dt__async_fill_ctx *c = (const dt__async_fill_ctx *)user;
  dt__strategy_replica *R = &c->s->rep[c->r];
  dt__optim_step_span(R->opt, x, R->grad, lo, hi);
}

/* Forward/backward on the pulled copy and the checks. The update is made
 * during the push, block by block (dt__async_fill; R->push_fill), or here
 * whole into R->old when check_numerics must see all of it before anything
 * is pushed. */
static int dt__async_local_step(dt_strategy *s, int r, const dt_minibatch *b, const float **push) {
  dt__strategy_replica *R = &s->rep[r];
  for (int i = 0; i < s->nbufr; i++) /* the pulled statistics: their update is what the forward makes of them */
    memcpy(R->old + s->bufr[2 * i], R->data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  if (!dt__strategy_compute(s, r, b)) return 0;
  *push = NULL;
  if (b->rows == 0 || R->skipped) return 1; /* an empty push: only the clock moves */
  if (!s->desc.check_numerics && !dt__strategy_own_grad_ok(s, r, b->step)) return R->skipped; /* compute checked */
  if (!dt__strategy_clip_own(s, r, dt_optim_get_options(R->opt)->clip_norm, "no update made")) return 0;
  dt_result rc = dt_optim_update(R->opt, R->data, R->grad, 0, 0); /* its checks (the params' layout) */
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    return 0;
  }
  if (!s->desc.check_numerics) {
    R->push_fill = 1;
    return 1;
  }
  dt__async_fill_ctx c;
  c.s = s;
  c.r = r;
  float *d = R->old;
  unsigned long fp = dt__fp_enter();
  for (size_t lo = 0; lo < s->size; lo += DT__PSTORE_BLOCK) {
    size_t hi = DT__MIN(s->size, lo + DT__PSTORE_BLOCK);
    dt__async_fill(&c, lo, hi, d + lo); /* in place: element j of R->old is read before it is written */
  }
  dt__fp_leave(fp);
  dt_optim_advance(R->opt);
  size_t bad = dt__strategy_nonfinite(d, 0, s->size);
  if (bad < s->size) {
    char what[DT__MSG_CAP];
    snprintf(what, sizeof what, "step %lld: update of '%s' is %s at flat index %zu; not pushed", (long long)b->step,
             dt__strategy_param_at(s, bad), isnan(d[bad]) ? "NaN" : "Inf", bad);
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
  *push = d;
  return 1;
}

DTRAIN_PRIVATE int dt__strategy_async_batch(dt_strategy *s, int r, int64_t t, dt_minibatch *b) {
  dt__strategy_replica *R = &s->rep[r];
  const int lockstep = s->desc.max_staleness == 0 || s->batch != NULL;
  char what[DT__MSG_CAP];
  if (dt__strategy_failed(s)) {
    if (R->result == DTRAIN_OK) R->result = DTRAIN_ERR_ABORTED;
    return 0;
  }
  int64_t ticket;
  if (lockstep) {
    if (t >= s->job_steps) return 0;
    ticket = t * s->n + r;
  } else {
    ticket = DT__AFETCH_ADD(&s->ticket, (int64_t)1, DT__MO_RELAXED);
    if (ticket >= s->job_steps) return 0;
  }
  int64_t id = s->ticket_base + ticket; /* the batch function's ticket */
  if (s->desc.work_queue && !s->batch) { /* the servers' queue says which (see dt_pstore_take) */
    dt_result rc = dt_pstore_take(s->pstore, r, &id);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      return 0;
    }
    if (id < 0) return 0; /* every item is done */
  }
  if (s->batch) {
    dt__strategy_shard(s->batch, s->n, r, b);
  } else {
    memset(b, 0, sizeof *b);
    dt_result rc = s->next(s->next_user, r, id, b);
    if (rc == DTRAIN_OK) rc = dt__strategy_check_batch(b, "dt_strategy_run");
    if (rc != DTRAIN_OK) {
      snprintf(what, sizeof what, "the batch function failed for step %lld (%s)", (long long)id, dt_result_name(rc));
      dt__strategy_fail(s, r, rc, what);
      return 0;
    }
    b->first = 0;
    b->global_rows = b->rows;
  }
  b->step = id;
  b->replica_step = t;
  b->weight = 1.0f;
  return 1;
}

DTRAIN_PRIVATE void dt__strategy_async_count(dt_strategy *s, int r, int64_t rows, int skipped, float loss,
                                             const dt_pstore_ticket *tk) {
  dt__strategy_replica *R = &s->rep[r];
  int64_t st = tk->staleness < 0 ? 0 : tk->staleness;
  R->hist[DT__MIN(st, (int64_t)DTRAIN_STALENESS_BINS - 1)]++;
  R->stale_sum += st;
  if (st > R->stale_max) R->stale_max = st;
  R->steps++;
  if (tk->dropped) R->dropped++; /* parameter servers in rounds: its gradient came late */
  if (skipped) { /* skip_nonfinite: the push was empty */
    R->skips++;
    return;
  }
  R->samples += rows;
  if (rows > 0) {
    R->loss_sum += loss;
    R->loss_count++;
    R->last_loss = loss;
    R->last_time = dt__now();
  }
}

DTRAIN_PRIVATE void dt__strategy_async_job(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  for (int64_t t = 0;; t++) {
    dt_minibatch b;
    if (!dt__strategy_async_batch(s, r, t, &b)) break;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    double c0 = dt__now();
    dt_result rc = dt_pstore_pull(s->pstore, r, t, R->data, s->size, &tk);
    R->wait_s += tk.wait_s;
    R->comm_s += DT__MAX(0.0, dt__now() - c0 - tk.wait_s);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    if (tk.clock_gap > R->gap_max) R->gap_max = tk.clock_gap;
    const float *push = NULL;
    R->push_fill = 0;
    R->clock = t;
    if (!s->mod->local_step(s, r, &b, &push)) break;
    c0 = dt__now();
    if (R->push_fill) { /* the update made block by block into the store */
      dt__async_fill_ctx c;
      c.s = s;
      c.r = r;
      unsigned long fp = dt__fp_enter();
      rc = dt__pstore_push_blocks(s->pstore, r, t, dt__async_fill,
                                  R->data == dt__pstore_local_data(s->pstore) ? dt__async_step : NULL, &c, R->data,
                                  &tk);
      dt__fp_leave(fp);
      if (rc == DTRAIN_OK) dt_optim_advance(R->opt);
    } else {
      rc = dt_pstore_push(s->pstore, r, t, push, s->size, &tk);
    }
    if (push == R->grad) dt__strategy_bufs_zero(s, R->grad); /* parameter_server: the buffers' values went there */
    R->wait_s += tk.wait_s;
    R->comm_s += DT__MAX(0.0, dt__now() - c0 - tk.wait_s);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    dt__strategy_async_count(s, r, b.rows, R->skipped, R->loss, &tk);
  }
  if (s->own_pstore) dt_pstore_leave(s->pstore, r); /* a borrowed store is left by its user (dt_pstore_leave) */
}

DTRAIN_PRIVATE void dt__strategy_bufs_zero(dt_strategy *s, float *grad) {
  for (int i = 0; i < s->nbufr; i++) /* the gradient buffer as it was: zeros where no gradient flows */
    memset(grad + s->bufr[2 * i], 0, (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
}

/* One job in which the replicas run free: steps * N pushes in all (steps
 * each in lock-step), batches from next(user, r, ticket). */
DTRAIN_PRIVATE dt_result dt__strategy_async_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                                float *mean_loss) {
  const char *fn = "dt_strategy_run";
  if (s->desc.max_staleness != 0 && steps > INT64_MAX / DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: %lld steps is too many", fn, (long long)steps);
  double t0 = dt__now();
  s->batch = NULL;
  s->next = next;
  s->next_user = next_user;
  s->job_steps = s->desc.max_staleness == 0 ? steps : steps * s->n;
  s->ticket_base = s->tickets;
  DT__ASTORE(&s->ticket, (int64_t)0, DT__MO_RELAXED);
  double lsum = 0.0;
  int64_t lcount = 0, before = 0, sbefore = 0;
  for (int r = 0; r < s->n; r++) {
    lsum -= s->rep[r].loss_sum;
    lcount -= s->rep[r].loss_count;
    before += s->rep[r].steps;
    sbefore += s->rep[r].samples;
  }
  dt_result rc = dt__strategy_launch(s, fn);
  s->seconds += dt__now() - t0;
  int64_t after = 0, safter = 0;
  double last_time = -1.0;
  for (int r = 0; r < s->n; r++) {
    lsum += s->rep[r].loss_sum;
    lcount += s->rep[r].loss_count;
    after += s->rep[r].steps;
    safter += s->rep[r].samples;
    if (s->rep[r].loss_count > 0 && s->rep[r].last_time > last_time) {
      last_time = s->rep[r].last_time;
      s->last_loss = s->rep[r].last_loss;
    }
  }
  s->steps += after - before;
  s->samples += safter - sbefore;
  s->tickets += s->job_steps;
  s->loss_sum += lsum;
  s->loss_count += lcount;
  if (mean_loss && lcount > 0) *mean_loss = (float)(lsum / (double)lcount);
  return rc;
}

static const dt__strategy_module dt__async_module = {
  "async",
  0,                      /* flags: the async family */
  NULL,                   /* prepare */
  NULL,                   /* check */
  dt__async_create,       /* create: the local store */
  dt__async_replica,      /* replica */
  NULL,                   /* start */
  dt__strategy_async_job, /* job */
  dt__strategy_async_run, /* run */
  NULL,                   /* sync: the replicas pull from the params' buffer */
  NULL,                   /* loss: the shards' */
  dt__async_local_step,   /* local_step */
  NULL,                   /* dev_exchange: no devices */
  NULL                    /* destroy: the store goes with own_pstore */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__async_module, "async", 0);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_async_module(void) { return &dt__async_module; }
