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

/* ---- async_sharded: each slice of the parameters has one owner ---------------------------
 * Replica r owns the store's blocks [r B / N, (r+1) B / N) of B (the block
 * its push's sweep starts at, dt__pstore_first_block). After its backward a
 * replica hands each other slice of its gradient to that slice's owner
 * through a box (below), then takes what the others handed it, averages
 * it with its own slice of the gradient and pushes the update of its slice
 * alone (its optimizer's step on those blocks; the fill and step callbacks
 * skip every other block). Only the owner writes a slice, so no update is
 * lost whatever the rule, and each gradient is applied once: by its owner's
 * next step, or, if the run ends first, by dt__async_drain. */

/* The gradients of replica src for the slice of replica dst: a pair of
 * buffers, one being summed into by src (fill), the other handed to dst
 * (ready), held by dst while it sums it, or given back (spare). src hands
 * its buffer over when the other one is back (spare >= 0: then ready is -1,
 * dst having cleared it before giving the buffer back), else it goes on
 * summing into it. A single producer and a single consumer, no lock, nobody
 * waits: release/acquire on ready carries the buffer's floats and count to
 * dst, on spare the end of dst's reads back to src. */
typedef struct dt__async_box {
  float *buf[2];
  int64_t count[2];      /* gradients summed into each; changed only by whoever holds it */
  int fill;              /* src's: the buffer it sums into */
  DT__ATOMIC(int) ready; /* -1, or the buffer handed to dst (src sets it, dst clears it) */
  DT__ATOMIC(int) spare; /* -1, or the buffer dst gave back (dst sets it, src clears it) */
  char pad[DT__ALIGN];   /* the next box's words off these lines */
} dt__async_box;

/* A slice's version: its owner adds 1 (release) after each update of it. */
typedef struct dt__async_version {
  DT__ATOMIC(uint64_t) v;
  char pad[DT__ALIGN];
} dt__async_version;

typedef struct dt__async_owners {
  int n;
  size_t lo[DTRAIN_MAX_REPLICAS + 1]; /* replica r's slice: [lo[r], lo[r + 1]) */
  /* Replicas on copies: each copies, as it pulls, only the slices updated
   * since it last copied them (seen[q * n + r]: replica q's copy of slice r
   * is at least that version), and after its own update its own slice;
   * whole[q] 0: its next pull copies everything (the first of a job: the
   * params may have been changed between jobs). */
  dt__async_version version[DTRAIN_MAX_REPLICAS];
  uint64_t *seen;
  size_t seen_bytes;
  int whole[DTRAIN_MAX_REPLICAS];
  dt__async_box *box;                 /* [src * n + dst]; the diagonal has no buffers */
  size_t box_bytes;
  int64_t merged[DTRAIN_MAX_REPLICAS];  /* gradients applied to each slice (owner's steps and drains) */
  int64_t updates[DTRAIN_MAX_REPLICAS]; /* the updates that applied them */
} dt__async_owners;

static dt__async_owners *dt__async_owners_of(dt_strategy *s) {
  return s->desc.async_sharded && s->desc.kind == DTRAIN_STRATEGY_ASYNC ? (dt__async_owners *)s->kind_state : NULL;
}

static void dt__async_box_reset(dt__async_box *x) {
  x->count[0] = x->count[1] = 0;
  x->fill = 0;
  DT__ASTORE(&x->ready, -1, DT__MO_RELAXED);
  DT__ASTORE(&x->spare, 1, DT__MO_RELAXED);
}

static dt_result dt__async_owners_create(dt_strategy *s) {
  dt__async_owners *O = (dt__async_owners *)dt__calloc(sizeof *O);
  if (!O) return dt__strategy_nomem(s);
  s->kind_state = O;
  const int n = s->n;
  const size_t blocks = (s->size + DT__PSTORE_BLOCK - 1) / DT__PSTORE_BLOCK;
  O->n = n;
  for (int r = 0; r <= n; r++)
    O->lo[r] = DT__MIN(s->size, (size_t)((uint64_t)blocks * (uint64_t)r / (uint64_t)n) * DT__PSTORE_BLOCK);
  O->box_bytes = (size_t)n * (size_t)n * sizeof(dt__async_box);
  if (!(O->box = (dt__async_box *)dt__calloc(O->box_bytes))) return dt__strategy_nomem(s);
  O->seen_bytes = (size_t)n * (size_t)n * sizeof(uint64_t);
  if (!(O->seen = (uint64_t *)dt__calloc(O->seen_bytes))) return dt__strategy_nomem(s);
  for (int src = 0; src < n; src++)
    for (int dst = 0; dst < n; dst++) {
      dt__async_box *x = &O->box[src * n + dst];
      dt__async_box_reset(x);
      size_t len = O->lo[dst + 1] - O->lo[dst];
      for (int b = 0; b < 2 && src != dst; b++)
        if (!(x->buf[b] = (float *)dt__alloc((len ? len : 1) * sizeof(float)))) return dt__strategy_nomem(s);
    }
  return DTRAIN_OK;
}

static void dt__async_destroy(dt_strategy *s) {
  dt__async_owners *O = dt__async_owners_of(s);
  if (!O) return;
  for (int src = 0; O->box && src < O->n; src++)
    for (int dst = 0; dst < O->n; dst++) {
      size_t len = O->lo[dst + 1] - O->lo[dst];
      for (int b = 0; b < 2; b++) dt__free(O->box[src * O->n + dst].buf[b], (len ? len : 1) * sizeof(float));
    }
  dt__free(O->box, O->box_bytes);
  dt__free(O->seen, O->seen_bytes);
  dt__free(O, sizeof *O);
  s->kind_state = NULL;
}

/* src's gradient for dst's slice (len floats at g) into the box, handed
 * over if dst gave the other buffer back. */
static void dt__async_box_put(dt__async_box *x, const float *g, size_t len) {
  float *b = x->buf[x->fill];
  if (x->count[x->fill] == 0) memcpy(b, g, len * sizeof(float));
  else dt__vec_add(b, b, g, len);
  x->count[x->fill]++;
  int sp = DT__ALOAD(&x->spare, DT__MO_ACQUIRE);
  if (sp >= 0) {
    DT__ASTORE(&x->spare, -1, DT__MO_RELAXED); /* (before ready: dst gives the buffer back only after taking it) */
    DT__ASTORE(&x->ready, x->fill, DT__MO_RELEASE);
    x->fill = sp;
  }
}

/* g[0, len) = ((own ? g : 0) + the sum of the np parts) / count: the mean
 * of the count gradients they hold (nothing is divided when count is 1);
 * the division rides on the last sum (vector loops: dt__vec_add*). */
static void dt__async_mean(float *g, int own, const float *const *parts, int np, size_t len, int64_t count) {
  const float inv = count > 1 ? (float)(1.0 / (double)count) : 1.0f;
  if (!own && np == 0) {
    memset(g, 0, len * sizeof(float));
    return;
  }
  const float *first = own ? g : parts[0];
  int q = own ? 0 : 1;
  if (q == np) { /* one term: g is it, divided */
    if (inv != 1.0f || first != g) dt__vec_add_scale(g, first, NULL, inv, len);
    return;
  }
  for (; q < np - 1; q++, first = g) dt__vec_add(g, first, parts[q], len);
  if (inv != 1.0f) dt__vec_add_scale(g, first, parts[q], inv, len);
  else dt__vec_add(g, first, parts[q], len);
}

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
  if (d->async_sharded) {
    const char *fn = "dt_strategy_create";
    if (d->max_staleness == 0)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_sharded in lock-step (max_staleness 0): which gradients "
                       "an owner's step sums depends on timing; use max_staleness >= 1 or unbounded", fn);
    if (s->nbufr > 0)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_sharded with buffers or frozen parameters (the first at "
                       "flat index %zu): a buffer's values are what each replica's forward makes of them, not a "
                       "gradient an owner can sum; use async_sharded 0", fn, s->bufr[0]);
    if (d->check_numerics)
      return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: async_sharded with check_numerics (the update of a slice is "
                       "made in the push, not checked before it); each gradient is still checked before it is "
                       "handed over (skip_nonfinite applies)", fn);
  }
  s->pstore = dt_pstore_create_local(dt_params_data(s->params), s->size, s->n, d->max_staleness, d->async_update,
                                     d->spin_us);
  if (!s->pstore) return dt_last_result();
  s->own_pstore = 1;
  s->pstore->staleness_lr = d->staleness_lr != 0;
  if (d->async_sharded) return dt__async_owners_create(s);
  return DTRAIN_OK;
}

/* Whether the replicas compute on the store itself (async_in_place in
 * dt_strategy.h; dt__async_create refused it where it cannot be): only
 * where the store's sweeps are vector loops (dt__shared_direct). */
static int dt__async_direct(const dt_strategy *s) { return s->desc.async_in_place && dt__shared_direct(); }

/* Every replica: its gradient and optimizer (a clone of the given one, at
 * its step count); unless it computes on the store, its own copy of the
 * parameters and (unless an owner) a vector for the buffers' pulled values;
 * the vector for a checked update (check_numerics) either way. */
static dt_result dt__async_replica(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  const int direct = dt__async_direct(s);
  dt_result rc = dt__strategy_bind(s, r, !direct, 1, NULL);
  if (rc != DTRAIN_OK) return rc;
  /* (the owners' replicas: no buffers, no check_numerics, so nothing to keep there) */
  if ((!direct || s->desc.check_numerics) && !s->desc.async_sharded && !(R->old = dt__strategy_floats(s, NULL)))
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
  size_t lo, hi; /* the blocks to update (async_sharded: the replica's slice; else all) */
} dt__async_fill_ctx;

static dt__async_fill_ctx dt__async_ctx(dt_strategy *s, int r, size_t lo, size_t hi) {
  dt__async_fill_ctx c;
  c.s = s;
  c.r = r;
  c.lo = lo;
  c.hi = hi;
  return c;
}

static int dt__async_fill(void *user, size_t lo, size_t hi, float *d) {
  const dt__async_fill_ctx *c = (const dt__async_fill_ctx *)user;
  dt_strategy *s = c->s;
  dt__strategy_replica *R = &s->rep[c->r];
  if (lo < c->lo || lo >= c->hi) return 0; /* another owner's block (async_sharded) */
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
  if (lo < c->lo || lo >= c->hi) return; /* another owner's block (async_sharded) */
  dt__optim_step_span(R->opt, x, R->grad, lo, hi);
}

/* async_sharded, an owner on a copy, where the store's sweeps are vector
 * loops (dt__shared_direct): its optimizer's step on its own copy of the
 * block, in place (the copy's block is the store's: nobody else writes
 * it), then the block written into the store x (whose values it does not
 * read: lines the other replicas' copies read stay theirs until written). */
static void dt__async_step_copy(void *user, size_t lo, size_t hi, float *x) {
  const dt__async_fill_ctx *c = (const dt__async_fill_ctx *)user;
  dt__strategy_replica *R = &c->s->rep[c->r];
  if (lo < c->lo || lo >= c->hi) return;
  dt__optim_step_span(R->opt, R->data + lo, R->grad, lo, hi);
  memcpy(x, R->data + lo, (hi - lo) * sizeof(float));
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
  dt__async_fill_ctx c = dt__async_ctx(s, r, 0, SIZE_MAX);
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

/* async_sharded, a replica on a copy, after the store's pull (which only
 * waited for the staleness bound and moved the clock): the slices other
 * owners updated since it last copied them, or, first in a job, all. */
static void dt__async_owner_pull(dt_strategy *s, int r) {
  dt__async_owners *O = (dt__async_owners *)s->kind_state;
  dt__strategy_replica *R = &s->rep[r];
  float *store = dt__pstore_local_data(s->pstore);
  const int n = O->n;
  for (int q = 0; q < n; q++) {
    if (q == r && O->whole[r]) continue; /* its own: copied after each of its updates */
    uint64_t v = DT__ALOAD(&O->version[q].v, DT__MO_ACQUIRE); /* (the values copied are at least this new) */
    if (O->whole[r] && O->seen[r * n + q] == v) continue;
    dt__shared_load(R->data + O->lo[q], (dt__afloat *)store + O->lo[q], O->lo[q + 1] - O->lo[q]);
    O->seen[r * n + q] = v;
  }
  O->whole[r] = 1;
}

/* async_sharded: replica r's push after its step (own: a gradient to apply,
 * 0 for an empty or skipped step): the other slices of its gradient into
 * their boxes, then its slice's update from the mean of its own slice and
 * what it takes from the boxes handed to it; without any, an empty push
 * (the clock moves). */
static dt_result dt__async_owner_push(dt_strategy *s, int r, int64_t t, int own, dt_pstore_ticket *tk) {
  dt__async_owners *O = (dt__async_owners *)s->kind_state;
  dt__strategy_replica *R = &s->rep[r];
  const int n = O->n;
  int64_t t0 = dt__trace_t0();
  if (own)
    for (int dst = 0; dst < n; dst++)
      if (dst != r) dt__async_box_put(&O->box[r * n + dst], R->grad + O->lo[dst], O->lo[dst + 1] - O->lo[dst]);
  int taken[DTRAIN_MAX_REPLICAS], np = 0;
  const float *parts[DTRAIN_MAX_REPLICAS];
  int64_t count = own;
  for (int src = 0; src < n; src++) {
    taken[src] = -1;
    if (src == r) continue;
    dt__async_box *x = &O->box[src * n + r];
    int b = DT__ALOAD(&x->ready, DT__MO_ACQUIRE);
    if (b < 0) continue;
    DT__ASTORE(&x->ready, -1, DT__MO_RELAXED); /* (src writes ready only once the buffer is back) */
    taken[src] = b;
    parts[np++] = x->buf[b];
    count += x->count[b];
  }
  const size_t lo = O->lo[r], hi = O->lo[r + 1];
  if (np > 0 || !own) dt__async_mean(R->grad + lo, own, parts, np, hi - lo, count);
  dt__trace_end("async: gradients to and from the owners", DTRAIN_PROFILE_COMM, t0);
  dt_result rc;
  if (count == 0) {
    rc = dt_pstore_push(s->pstore, r, t, NULL, s->size, tk);
  } else {
    dt__async_fill_ctx c = dt__async_ctx(s, r, lo, hi);
    unsigned long fp = dt__fp_enter();
    /* On a copy the owner steps its copy's block in place and writes it into
     * the store (dt__async_step_copy); measured on a 2-vCPU Zen 5 (async(2),
     * batch 64), its step on the store's block itself, which the other
     * replica's copies keep reading, lost to the differences made on the
     * copy and added (147-152k against 164-168k samples/s), and those lost
     * to the step on the copy with the 1:4 straggler (121-141k against
     * 139-151k). The atomic rule and a staleness scale take the differences. */
    float *store = dt__pstore_local_data(s->pstore);
    const int on_store = R->data == store;
    const int own_copy = !on_store && dt__shared_direct();
    rc = dt__pstore_push_blocks(s->pstore, r, t, dt__async_fill,
                                on_store ? dt__async_step : own_copy ? dt__async_step_copy : NULL, &c, NULL, tk);
    dt__fp_leave(fp);
    if (rc == DTRAIN_OK) {
      /* its slice, as updated (unless the step made it in its copy: the Hogwild rule, no staleness scale) */
      if (!on_store && !(own_copy && s->desc.async_update == DTRAIN_ASYNC_HOGWILD && !s->desc.staleness_lr))
        dt__shared_load(R->data + lo, (dt__afloat *)store + lo, hi - lo);
      DT__AFETCH_ADD(&O->version[r].v, (uint64_t)1, DT__MO_RELEASE);
      dt_optim_advance(R->opt);
      O->merged[r] += count;
      O->updates[r]++;
    }
  }
  for (int src = 0; src < n; src++) { /* the taken buffers back to their senders */
    if (taken[src] < 0) continue;
    dt__async_box *x = &O->box[src * n + r];
    x->count[taken[src]] = 0;
    DT__ASTORE(&x->spare, taken[src], DT__MO_RELEASE);
  }
  return rc;
}

/* async_sharded, after a job (every replica has returned): each owner
 * applies what is still in the boxes for its slice (handed over or still
 * being summed) as one more step of its optimizer, in place on the store,
 * and the boxes start empty again. */
static void dt__async_drain(dt_strategy *s) {
  dt__async_owners *O = dt__async_owners_of(s);
  if (!O || !s->pstore) return;
  float *store = dt__pstore_local_data(s->pstore);
  const int n = O->n;
  for (int r = 0; r < n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    const float *parts[2 * DTRAIN_MAX_REPLICAS];
    int np = 0;
    int64_t count = 0;
    for (int src = 0; src < n; src++) {
      dt__async_box *x = &O->box[src * n + r];
      if (src == r) continue;
      int b = DT__ALOAD(&x->ready, DT__MO_ACQUIRE);
      if (b >= 0 && x->count[b] > 0) parts[np++] = x->buf[b], count += x->count[b];
      if (x->count[x->fill] > 0) parts[np++] = x->buf[x->fill], count += x->count[x->fill];
      dt__async_box_reset(x);
    }
    if (count == 0 || !store || !R->opt) continue;
    const size_t lo = O->lo[r], hi = O->lo[r + 1];
    dt__async_mean(R->grad + lo, 0, parts, np, hi - lo, count);
    unsigned long fp = dt__fp_enter();
    dt__optim_step_span(R->opt, store + lo, R->grad, lo, hi);
    dt__fp_leave(fp);
    dt_optim_advance(R->opt);
    O->merged[r] += count;
    O->updates[r]++;
  }
  for (int r = 0; r < n; r++) O->whole[r] = 0; /* the next job's first pulls copy everything */
}

/* async_sharded: the gradients applied to replica r's slice so far, and in
 * how many updates (tests). */
DTRAIN_PRIVATE int64_t dt__strategy_async_merged(dt_strategy *s, int r, int64_t *updates) {
  dt__async_owners *O = dt__async_owners_of(s);
  int ok = O && r >= 0 && r < O->n;
  if (updates) *updates = ok ? O->updates[r] : -1;
  return ok ? O->merged[r] : -1;
}

DTRAIN_PRIVATE void dt__strategy_async_job(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  dt__async_owners *O = dt__async_owners_of(s);
  R->result = DTRAIN_OK;
  for (int64_t t = 0;; t++) {
    dt_minibatch b;
    if (!dt__strategy_async_batch(s, r, t, &b)) break;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    double c0 = dt__now();
    /* (an owner on a copy: the store's pull waits and moves the clock, the
     * owners' pull copies what changed) */
    float *store = O ? dt__pstore_local_data(s->pstore) : NULL;
    dt_result rc = dt_pstore_pull(s->pstore, r, t, O ? store : R->data, s->size, &tk);
    if (rc == DTRAIN_OK && O && R->data != store) dt__async_owner_pull(s, r);
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
    if (O) { /* async_sharded: the gradient's other slices to their owners, then this replica's slice */
      rc = dt__async_owner_push(s, r, t, R->push_fill, &tk);
    } else if (R->push_fill) { /* the update made block by block into the store */
      dt__async_fill_ctx c = dt__async_ctx(s, r, 0, SIZE_MAX);
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
  dt__async_destroy,      /* destroy: the owners' boxes (the store goes with own_pstore) */
  dt__async_drain         /* after_job: the owners apply what is still in their boxes */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__async_module, "async", 0);
DTRAIN_PRIVATE int64_t dt__strategy_async_merged(dt_strategy *s, int r, int64_t *updates) {
  (void)s, (void)r;
  if (updates) *updates = -1;
  return -1;
}
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_async_module(void) { return &dt__async_module; }
