/* ===========================================================================
 * dt_pstore.c -- the parameter store's front door (dt_pstore_*) and its
 * in-process, lock-free backend (dt_pstore_create_local)
 * ===========================================================================
 * The async strategy's replicas train against a local store; a networked
 * store (dt_ps.c, parameter-server shards) implements the same table. See
 * "Staleness" and "the parameter store" in dt_strategy.h for the rules.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_strategy.h"
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_platform.h"
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST) /* the whole file; the stubs at the end stand in without it */


/* ---- the in-process parameter store --------------------------------------------------- */

#define DT__PSTORE_DONE ((int64_t)1 << 60) /* the clock of a worker that left */

typedef union dt__pstore_clock {
  struct {
    DT__ATOMIC(int64_t) pulled; /* pulls made (steps started) */
    DT__ATOMIC(int64_t) pushed; /* pushes made (steps finished) */
    /* The worker's own: after dt__pstore_push_blocks copied the store into
     * fresh_dst as it went, the version that copy is whole for (0: none). */
    uint64_t fresh;
    const float *fresh_dst;
  } c;
  char align[2 * DT__ALIGN];
} dt__pstore_clock;

typedef struct dt__pstore_local {
  dt_pstore ps;
  float *data;
  dt_async_update update;
  double spin_s;
  DT__ATOMIC(uint64_t) version;
  uint64_t base;           /* version at dt_pstore_begin (lock-step turns count from it) */
  DT__ATOMIC(int) aborted;
  dt__pstore_clock *clocks;
  dt__event ev;
} dt__pstore_local;

static dt__pstore_local *dt__pstore_of(dt_pstore *ps) { return (dt__pstore_local *)ps->impl; }

static int64_t dt__pstore_min(dt__pstore_local *l, int pushed) {
  int64_t m = DT__PSTORE_DONE;
  for (int j = 0; j < l->ps.workers; j++) {
    int64_t v = pushed ? DT__ALOAD(&l->clocks[j].c.pushed, DT__MO_SEQ_CST)
                       : DT__ALOAD(&l->clocks[j].c.pulled, DT__MO_SEQ_CST);
    if (v < m) m = v;
  }
  return m;
}

typedef struct dt__pstore_wait {
  dt__pstore_local *l;
  int kind;         /* 0: pull rule, 1: push rule, 2: lock-step turn */
  int64_t need;     /* pull: min pushed >= need; push: min pulled >= need */
  uint64_t turn;    /* lock-step: version == turn */
} dt__pstore_wait;

static int dt__pstore_ready(void *arg) {
  dt__pstore_wait *w = (dt__pstore_wait *)arg;
  if (DT__ALOAD(&w->l->aborted, DT__MO_SEQ_CST)) return 1;
  switch (w->kind) {
    case 0: return dt__pstore_min(w->l, 1) >= w->need;
    case 1: return dt__pstore_min(w->l, 0) >= w->need;
    default: return DT__ALOAD(&w->l->version, DT__MO_SEQ_CST) == w->turn;
  }
}

static double dt__pstore_wait_for(dt__pstore_local *l, int kind, int64_t need, uint64_t turn) {
  dt__pstore_wait w;
  w.l = l;
  w.kind = kind;
  w.need = need;
  w.turn = turn;
  double s = dt__event_wait(&l->ev, dt__pstore_ready, &w, l->spin_s);
  dt__trace_wait(kind == 0 ? "staleness wait (pull)" : kind == 1 ? "staleness wait (push)" : "lock-step turn", s);
  return s;
}

/* The blocks a worker's pull and push go through, starting at its own
 * place (worker * blocks / workers) and wrapping: replicas that pull or
 * push at the same time sweep different parts of the vector, so fewer
 * cache lines move between cores mid-sweep and fewer Hogwild writes meet. */
static size_t dt__pstore_first_block(const dt__pstore_local *l, int worker, size_t blocks) {
  return (size_t)((uint64_t)blocks * (uint64_t)worker / (uint64_t)l->ps.workers);
}

static dt_result dt__pstore_local_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                       dt_pstore_ticket *tk) {
  dt__pstore_local *l = dt__pstore_of(ps);
  int k = ps->max_staleness;
  tk->wait_s = 0.0;
  if (k >= 0) tk->wait_s = dt__pstore_wait_for(l, 0, clock - k, 0);
  if (DT__ALOAD(&l->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  int64_t slowest = dt__pstore_min(l, 1);
  tk->clock_gap = slowest >= DT__PSTORE_DONE ? 0 : DT__MAX(clock - slowest, (int64_t)0);
  /* Acquire: every update counted in the version is visible to the loads. */
  tk->version = DT__ALOAD(&l->version, DT__MO_ACQUIRE);
  dt__pstore_clock *me = &l->clocks[worker];
  int fresh = me->c.fresh != 0 && me->c.fresh == tk->version && me->c.fresh_dst == dst;
  me->c.fresh = 0;
  me->c.fresh_dst = NULL;
  if (fresh || dst == l->data) { /* no push finished since this worker's push copied the store into dst; or
                                    the worker computes on the store itself: nothing to copy */
    DT__ASTORE(&me->c.pulled, clock + 1, DT__MO_SEQ_CST);
    dt__event_notify(&l->ev);
    return DTRAIN_OK;
  }
  dt__afloat *src = (dt__afloat *)l->data;
  size_t blocks = (n + DT__PSTORE_BLOCK - 1) / DT__PSTORE_BLOCK, first = dt__pstore_first_block(l, worker, blocks);
  for (size_t q = 0; q < blocks; q++) {
    size_t lo = ((first + q) % blocks) * DT__PSTORE_BLOCK, hi = DT__MIN(n, lo + DT__PSTORE_BLOCK);
    dt__shared_load(dst + lo, src + lo, hi - lo);
  }
  DT__ASTORE(&l->clocks[worker].c.pulled, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
  return DTRAIN_OK;
}

/* A push's waits (the staleness bound; in lock-step the worker's turn) and
 * its staleness-aware scale; DTRAIN_ERR_ABORTED when the store broke. */
static dt_result dt__pstore_local_enter(dt__pstore_local *l, int worker, int64_t clock, dt_pstore_ticket *tk,
                                        float *scale) {
  int k = l->ps.max_staleness;
  tk->wait_s = 0.0;
  if (k >= 0) tk->wait_s = dt__pstore_wait_for(l, 1, clock - k + 1, 0);
  /* Lock-step: the pushes of a round go in worker order (deterministic sums). */
  if (k == 0)
    tk->wait_s +=
        dt__pstore_wait_for(l, 2, 0, l->base + (uint64_t)clock * (uint64_t)l->ps.workers + (uint64_t)worker);
  if (DT__ALOAD(&l->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  /* Staleness-aware: divided by 1 + the pushes others made since this
   * worker's pull (read now: pushes racing this one are not counted). */
  *scale = 1.0f;
  if (l->ps.staleness_lr) {
    uint64_t now = DT__ALOAD(&l->version, DT__MO_ACQUIRE);
    if (now > tk->version) *scale = (float)(1.0 / (1.0 + (double)(now - tk->version)));
  }
  return DTRAIN_OK;
}

/* Adds d[0..cnt) * scale into the store's elements [lo, lo+cnt) by the
 * update rule; a zero is not written (x * 1.0f is x exactly: without the
 * staleness option the scale changes nothing). */
static void dt__pstore_apply(dt__pstore_local *l, size_t lo, const float *d, size_t cnt, float scale) {
  dt__afloat *dst = (dt__afloat *)l->data + lo;
  if (l->update == DTRAIN_ASYNC_ATOMIC) {
    for (size_t i = 0; i < cnt; i++)
      if (d[i] != 0.0f) dt__afloat_add(dst + i, d[i] * scale);
  } else {
    dt__shared_add(dst, d, scale, cnt);
  }
}

/* After the adds: the version (release: a puller that sees it sees them),
 * the staleness of this push, the worker's clock. */
static uint64_t dt__pstore_local_exit(dt__pstore_local *l, int worker, int64_t clock, dt_pstore_ticket *tk) {
  uint64_t before = DT__AFETCH_ADD(&l->version, (uint64_t)1, DT__MO_SEQ_CST);
  tk->staleness = (int64_t)(before - tk->version);
  l->clocks[worker].c.fresh = 0;
  DT__ASTORE(&l->clocks[worker].c.pushed, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
  return before;
}

static dt_result dt__pstore_local_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                       dt_pstore_ticket *tk) {
  dt__pstore_local *l = dt__pstore_of(ps);
  float scale;
  dt_result rc = dt__pstore_local_enter(l, worker, clock, tk, &scale);
  if (rc != DTRAIN_OK) return rc;
  if (delta) {
    size_t blocks = (n + DT__PSTORE_BLOCK - 1) / DT__PSTORE_BLOCK, first = dt__pstore_first_block(l, worker, blocks);
    for (size_t q = 0; q < blocks; q++) {
      size_t lo = ((first + q) % blocks) * DT__PSTORE_BLOCK;
      dt__pstore_apply(l, lo, delta + lo, DT__MIN(n - lo, DT__PSTORE_BLOCK), scale);
    }
  }
  dt__pstore_local_exit(l, worker, clock, tk);
  return DTRAIN_OK;
}

static void dt__pstore_local_leave(dt_pstore *ps, int worker) {
  dt__pstore_local *l = dt__pstore_of(ps);
  DT__ASTORE(&l->clocks[worker].c.pulled, DT__PSTORE_DONE, DT__MO_SEQ_CST);
  DT__ASTORE(&l->clocks[worker].c.pushed, DT__PSTORE_DONE, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
}

static void dt__pstore_local_abort(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  DT__ASTORE(&l->aborted, 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
}

static dt_result dt__pstore_local_begin(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  for (int j = 0; j < ps->workers; j++) {
    DT__ASTORE(&l->clocks[j].c.pulled, (int64_t)0, DT__MO_RELAXED);
    DT__ASTORE(&l->clocks[j].c.pushed, (int64_t)0, DT__MO_RELAXED);
    l->clocks[j].c.fresh = 0;
    l->clocks[j].c.fresh_dst = NULL;
  }
  l->base = DT__ALOAD(&l->version, DT__MO_RELAXED);
  DT__ASTORE(&l->aborted, 0, DT__MO_SEQ_CST);
  return DTRAIN_OK;
}

static uint64_t dt__pstore_local_version(dt_pstore *ps) {
  return DT__ALOAD(&dt__pstore_of(ps)->version, DT__MO_ACQUIRE);
}

static void dt__pstore_local_destroy(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  dt__event_destroy(&l->ev);
  dt__free(l->clocks, (size_t)ps->workers * sizeof(dt__pstore_clock));
  dt__free(l, sizeof *l);
}

static const dt_pstore_vtable dt__pstore_local_vtable = {
  "local",
  dt__pstore_local_pull,
  dt__pstore_local_push,
  dt__pstore_local_leave,
  dt__pstore_local_abort,
  dt__pstore_local_begin,
  dt__pstore_local_version,
  dt__pstore_local_destroy,
  NULL /* take: no work queue in process */
};

DTRAIN_PRIVATE float *dt__pstore_local_data(dt_pstore *ps) {
  return ps && ps->vtable == &dt__pstore_local_vtable ? dt__pstore_of(ps)->data : NULL;
}

DTRAIN_PRIVATE dt_result dt__pstore_push_blocks(dt_pstore *ps, int worker, int64_t clock, dt__pstore_fill_fn fill,
                                                dt__pstore_step_fn step, void *user, float *pull_into,
                                                dt_pstore_ticket *tk) {
  if (!ps || ps->vtable != &dt__pstore_local_vtable || !fill || !tk || worker < 0 || worker >= ps->workers || clock < 0)
    return dt__error(DTRAIN_ERR_INTERNAL, "dt__pstore_push_blocks: not a local store's push");
  dt__pstore_local *l = dt__pstore_of(ps);
  float scale, block[DT__PSTORE_BLOCK];
  int64_t t0 = dt__trace_t0(); /* the timeline's span; the table has the update's blocks and no push */
  dt_result rc = dt__pstore_local_enter(l, worker, clock, tk, &scale);
  if (rc != DTRAIN_OK) return rc;
  /* Acquire: the pushes counted here are whole in the store, so in the copy. */
  uint64_t start = DT__ALOAD(&l->version, DT__MO_ACQUIRE);
  size_t n = ps->size, blocks = (n + DT__PSTORE_BLOCK - 1) / DT__PSTORE_BLOCK,
         first = dt__pstore_first_block(l, worker, blocks);
  if (pull_into == l->data) pull_into = NULL; /* the worker computes on the store itself */
  /* In place: the store's elements are the step's input and output (x * 1.0f
   * is x, so without the staleness scale nothing else differs). */
  const int in_place = step && l->update == DTRAIN_ASYNC_HOGWILD && scale == 1.0f;
  for (size_t q = 0; q < blocks; q++) {
    size_t lo = ((first + q) % blocks) * DT__PSTORE_BLOCK, cnt = DT__MIN(n - lo, DT__PSTORE_BLOCK);
    if (in_place) {
      step(user, lo, lo + cnt, l->data + lo);
      continue;
    }
    if (fill(user, lo, lo + cnt, block)) dt__pstore_apply(l, lo, block, cnt, scale);
    if (pull_into) dt__shared_load(pull_into + lo, (dt__afloat *)l->data + lo, cnt);
  }
  uint64_t before = dt__pstore_local_exit(l, worker, clock, tk);
  /* Whole for the version after this push only if no other push finished
   * during the sweep (its later writes may have missed the copy). */
  if (pull_into && before == start) {
    l->clocks[worker].c.fresh = before + 1;
    l->clocks[worker].c.fresh_dst = pull_into;
  }
  dt__trace_end("dt_pstore_push (with the update)", DTRAIN_PROFILE_COMM, t0);
  return DTRAIN_OK;
}

DTRAIN_API dt_pstore *dt_pstore_create_local(float *data, size_t n, int workers, int max_staleness,
                                             dt_async_update update, int spin_us) {
  const char *fn = "dt_pstore_create_local";
  if (!data && n > 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: data is NULL", fn);
    return NULL;
  }
  if (workers < 1 || workers > DTRAIN_MAX_REPLICAS) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: workers %d outside [1, %d]", fn, workers, DTRAIN_MAX_REPLICAS);
    return NULL;
  }
  if (max_staleness < DTRAIN_STALENESS_UNBOUNDED) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
              max_staleness);
    return NULL;
  }
  if (update != DTRAIN_ASYNC_HOGWILD && update != DTRAIN_ASYNC_ATOMIC) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown update rule %d", fn, (int)update);
    return NULL;
  }
#if defined(DTRAIN_NO_THREADS)
  if (workers > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %d workers need threads (built with DTRAIN_NO_THREADS)", fn, workers);
    return NULL;
  }
#endif
  dt__pstore_local *l = (dt__pstore_local *)dt__calloc(sizeof *l);
  if (!l) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  l->clocks = (dt__pstore_clock *)dt__calloc((size_t)workers * sizeof(dt__pstore_clock));
  if (!l->clocks || dt__event_init(&l->ev) != DTRAIN_OK) {
    if (l->clocks) dt__free(l->clocks, (size_t)workers * sizeof(dt__pstore_clock));
    dt__free(l, sizeof *l);
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  l->data = data;
  l->update = update;
  l->spin_s = dt__spin_seconds(spin_us, workers);
  l->ps.vtable = &dt__pstore_local_vtable;
  l->ps.workers = workers;
  l->ps.max_staleness = max_staleness;
  l->ps.size = n;
  l->ps.impl = l;
  dt__pstore_local_begin(&l->ps);
  return &l->ps;
}

/* ---- the front door: argument checks, then the backend's table ------------------------------ */

static dt_result dt__pstore_check(dt_pstore *ps, const char *fn, int worker, int64_t clock, size_t n,
                                  const dt_pstore_ticket *tk) {
  if (!ps || !ps->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: store is NULL", fn);
  if (!tk) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: ticket is NULL", fn);
  if (worker < 0 || worker >= ps->workers)
    return dt__error(DTRAIN_ERR_INDEX, "%s: worker %d outside [0, %d)", fn, worker, ps->workers);
  if (clock < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: worker %d: clock %lld < 0", fn, worker, (long long)clock);
  if (n != ps->size)
    return dt__error(DTRAIN_ERR_SHAPE, "%s: worker %d: n=%zu but the store holds %zu floats", fn, worker, n, ps->size);
  return DTRAIN_OK;
}

DTRAIN_API void dt_pstore_destroy(dt_pstore *ps) {
  dt__quiet_push();
  if (ps && ps->vtable && ps->vtable->destroy) ps->vtable->destroy(ps);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API dt_result dt_pstore_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk) {
  dt_result r = dt__pstore_check(ps, "dt_pstore_pull", worker, clock, n, tk);
  if (r != DTRAIN_OK) return r;
  if (!dst && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pstore_pull: worker %d: dst is NULL", worker);
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(ps->vtable->pull(ps, worker, clock, dst, n, tk));
  dt__prof_add("dt_pstore_pull", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  dt_result r = dt__pstore_check(ps, "dt_pstore_push", worker, clock, n, tk);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(ps->vtable->push(ps, worker, clock, delta, n, tk));
  dt__prof_add("dt_pstore_push", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API void dt_pstore_leave(dt_pstore *ps, int worker) {
  dt__quiet_push();
  if (ps && ps->vtable && worker >= 0 && worker < ps->workers) ps->vtable->leave(ps, worker);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API void dt_pstore_abort(dt_pstore *ps) {
  if (ps && ps->vtable) ps->vtable->abort(ps);
}

DTRAIN_API dt_result dt_pstore_begin(dt_pstore *ps) {
  if (!ps || !ps->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pstore_begin: store is NULL");
  return ps->vtable->begin(ps);
}

DTRAIN_API uint64_t dt_pstore_version(dt_pstore *ps) {
  return (ps && ps->vtable) ? ps->vtable->version(ps) : 0;
}

DTRAIN_API dt_result dt_pstore_take(dt_pstore *ps, int worker, int64_t *item) {
  const char *fn = "dt_pstore_take";
  if (item) *item = -1;
  if (!ps || !ps->vtable || !item) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !item ? "item" : "store");
  if (worker < 0 || worker >= ps->workers)
    return dt__error(DTRAIN_ERR_INDEX, "%s: worker %d outside [0, %d)", fn, worker, ps->workers);
  if (!ps->vtable->take)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: the %s store has no work queue (parameter servers with "
                     "dt_ps_options.work_items have one)", fn, ps->vtable->name ? ps->vtable->name : "?");
  dt__quiet_push();
  return dt__quiet_pop(ps->vtable->take(ps, worker, item));
}

#undef DT__PSTORE_DONE

#else /* DTRAIN_NO_DIST: every entry point says so */

DTRAIN_API dt_pstore *dt_pstore_create_local(float *data, size_t n, int workers, int max_staleness,
                                             dt_async_update update, int spin_us) {
  (void)data; (void)n; (void)workers; (void)max_staleness; (void)update; (void)spin_us;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_create_local: compiled out (DTRAIN_NO_DIST)");
  return NULL;
}
/* Nothing can have made a store: the calls without a result do nothing. */
DTRAIN_API void dt_pstore_destroy(dt_pstore *ps) { (void)ps; }
DTRAIN_API dt_result dt_pstore_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk) {
  (void)ps; (void)worker; (void)clock; (void)dst; (void)n; (void)tk;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_pull: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  (void)ps; (void)worker; (void)clock; (void)delta; (void)n; (void)tk;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_push: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API void dt_pstore_leave(dt_pstore *ps, int worker) { (void)ps; (void)worker; }
DTRAIN_API void dt_pstore_abort(dt_pstore *ps) { (void)ps; }
DTRAIN_API dt_result dt_pstore_begin(dt_pstore *ps) {
  (void)ps;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_begin: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API uint64_t dt_pstore_version(dt_pstore *ps) {
  (void)ps;
  return 0;
}
DTRAIN_API dt_result dt_pstore_take(dt_pstore *ps, int worker, int64_t *item) {
  (void)ps; (void)worker;
  if (item) *item = -1;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_take: compiled out (DTRAIN_NO_DIST)");
}

#endif /* DTRAIN_NO_DIST */
