/* ===========================================================================
 * dt_strategy.c -- one_device, mirrored, central_storage, async; the
 * in-process lock-free parameter store
 * ===========================================================================
 * A synchronous step (dt__strategy_sync_job, run by every replica's thread):
 *
 *   shard r of the batch -> zero own gradient -> step fn + backward (the
 *   loss gradient weighted by the shard's share) -> [mirrored]
 *   reduce-scatter of the gradients: replica r owns slice r of the sum ->
 *   [central] reduce into the centre's gradient, replica r summing slice r ->
 *   (clip: partial norms, a barrier, the total in rank order) -> (numerics
 *   check, a barrier, so that a bad gradient stops every replica before any
 *   update) -> dt_optim_update on slice r (one optimizer, disjoint ranges:
 *   its state is sharded by slice) -> [mirrored] each replica copies
 *   replica 0's buffers (batch-norm statistics) within its slice, then the
 *   all-gather of the parameters.
 *
 * The caller advances the optimizer once per step after the pool joins.
 * one_device is the same code with one replica and no threads, so mirrored(1)
 * equals it bitwise.
 *
 * An async replica (dt__strategy_async_job) loops: take a ticket, get a
 * batch, pull from the store, forward/backward on its own copy, its own
 * optimizer step, push the difference. See dt_strategy.h for the rules.
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

/* ---- the in-process parameter store --------------------------------------------------- */

#define DT__PSTORE_DONE ((int64_t)1 << 60) /* the clock of a worker that left */

typedef union dt__pstore_clock {
  struct {
    DT__ATOMIC(int64_t) pulled; /* pulls made (steps started) */
    DT__ATOMIC(int64_t) pushed; /* pushes made (steps finished) */
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
  return dt__event_wait(&l->ev, dt__pstore_ready, &w, l->spin_s);
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
  dt__afloat *src = (dt__afloat *)l->data;
  for (size_t i = 0; i < n; i++) dst[i] = dt__afloat_load(src + i);
  DT__ASTORE(&l->clocks[worker].c.pulled, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
  return DTRAIN_OK;
}

static dt_result dt__pstore_local_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                       dt_pstore_ticket *tk) {
  dt__pstore_local *l = dt__pstore_of(ps);
  int k = ps->max_staleness;
  tk->wait_s = 0.0;
  if (k >= 0) tk->wait_s = dt__pstore_wait_for(l, 1, clock - k + 1, 0);
  /* Lock-step: the pushes of a round go in worker order (deterministic sums). */
  if (k == 0)
    tk->wait_s += dt__pstore_wait_for(l, 2, 0, l->base + (uint64_t)clock * (uint64_t)ps->workers + (uint64_t)worker);
  if (DT__ALOAD(&l->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  dt__afloat *dst = (dt__afloat *)l->data;
  if (delta) {
    if (l->update == DTRAIN_ASYNC_ATOMIC) {
      for (size_t i = 0; i < n; i++)
        if (delta[i] != 0.0f) dt__afloat_add(dst + i, delta[i]);
    } else {
      for (size_t i = 0; i < n; i++)
        if (delta[i] != 0.0f) dt__afloat_store(dst + i, dt__afloat_load(dst + i) + delta[i]);
    }
  }
  /* Release: a puller that sees this version sees these stores. */
  uint64_t before = DT__AFETCH_ADD(&l->version, (uint64_t)1, DT__MO_SEQ_CST);
  tk->staleness = (int64_t)(before - tk->version);
  DT__ASTORE(&l->clocks[worker].c.pushed, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
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
  dt__pstore_local_destroy
};

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
  dt__quiet_push();
  return dt__quiet_pop(ps->vtable->pull(ps, worker, clock, dst, n, tk));
}

DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  dt_result r = dt__pstore_check(ps, "dt_pstore_push", worker, clock, n, tk);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(ps->vtable->push(ps, worker, clock, delta, n, tk));
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

/* ---- strategy state ---------------------------------------------------------------------- */

typedef struct dt__strategy_replica {
  dt_graph *g;
  float *data, *grad;      /* what the graph is bound to */
  float *own_data, *own_grad, *old; /* allocated here (NULL when borrowed) */
  dt_optim *opt;           /* async: this replica's optimizer */
  int updating;            /* devices: this step reached the update */
  /* the current step */
  float loss;
  int64_t rows;
  double ss_part;          /* clipping: sum of squares of this replica's slice */
  dt_result result;
  /* statistics */
  int64_t steps, samples;
  double compute_s, wait_s, loss_sum;
  int64_t loss_count;
  float last_loss;
  double last_time;        /* async: when the last push finished */
  int64_t hist[DTRAIN_STALENESS_BINS];
  int64_t stale_max, stale_sum, gap_max;
  char pad[DT__ALIGN];     /* keeps the next replica's hot fields off these cache lines */
} dt__strategy_replica;

enum { DT__STRATEGY_JOB_SYNC = 0, DT__STRATEGY_JOB_ASYNC };

struct dt_strategy {
  dt_strategy_desc desc;
  dt_params *params;
  dt_optim *opt;
  dt_step_fn step;
  void *user;
  int n;
  size_t size;             /* floats in the flat buffers */
  size_t fbytes;           /* size * sizeof(float) */
  dt__strategy_replica *rep;
  size_t rep_bytes;
  dt__pool *pool;
  dt_comm *comm;           /* sync strategies */
  dt_pstore *pstore;       /* async */
  size_t *bufr;            /* non-trainable runs [begin, end) pairs */
  int nbufr;
  /* the current job */
  const dt_minibatch *batch;   /* step(): the global batch */
  dt_minibatch_fn next;        /* run(): the batch source (async) */
  void *next_user;
  int64_t job_steps;       /* async: steps per replica (lock-step) or total pushes */
  int64_t ticket_base;
  DT__ATOMIC(int64_t) ticket;
  DT__ATOMIC(int) failed;  /* -1, or the first replica that failed */
  dt_result err;
  char msg[DT__MSG_CAP];
  /* totals */
  int64_t steps, samples, tickets;
  double seconds, loss_sum;
  int64_t loss_count;
  float last_loss;
  int last_failed;
  /* multi_worker_mirrored (see its section) */
  float *mwm_buf;          /* replica 0's gradient + DT__MWM_TAIL floats: what crosses processes */
  size_t mwm_bytes;
  double mwm_rows;         /* the global batch's rows (this step) */
  double mwm_loss;         /* the global batch's loss (this step) */
  /* devices (desc.devices) */
  int dev;                 /* nonzero: replica r runs on desc.devices[r] */
  dt_device_group *dgroup; /* the all-reduce over the replicas' devices */
  float **dgrad, **ddata;  /* each replica's device gradient / parameters */
  float *dhost;            /* host copy of replica 0's reduced gradient (checks) */
  int64_t dev_opt_steps;   /* the optimizer's steps before the current step */
};

/* ---- small helpers -------------------------------------------------------------------------- */

DTRAIN_API void dt_sleep(double seconds) { dt__sleep(seconds); }
DTRAIN_API int dt_cpu_count(void) { return dt__cpu_count(); }

DTRAIN_API const char *dt_strategy_kind_name(dt_strategy_kind kind) {
  switch (kind) {
    case DTRAIN_STRATEGY_ONE_DEVICE: return "one_device";
    case DTRAIN_STRATEGY_MIRRORED: return "mirrored";
    case DTRAIN_STRATEGY_CENTRAL_STORAGE: return "central_storage";
    case DTRAIN_STRATEGY_ASYNC: return "async";
    case DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED: return "multi_worker_mirrored";
    case DTRAIN_STRATEGY_PARAMETER_SERVER: return "parameter_server";
    default: return "unknown";
  }
}

static dt_strategy_desc dt__strategy_desc(dt_strategy_kind kind, int replicas, int max_staleness) {
  dt_strategy_desc d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.replicas = replicas;
  d.max_staleness = max_staleness;
  return d;
}

DTRAIN_API dt_strategy_desc dt_one_device(void) { return dt__strategy_desc(DTRAIN_STRATEGY_ONE_DEVICE, 1, 0); }
DTRAIN_API dt_strategy_desc dt_mirrored(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_MIRRORED, replicas, 0);
}
DTRAIN_API dt_strategy_desc dt_central_storage(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_CENTRAL_STORAGE, replicas, 0);
}
DTRAIN_API dt_strategy_desc dt_async(int replicas, int max_staleness) {
  return dt__strategy_desc(DTRAIN_STRATEGY_ASYNC, replicas, max_staleness);
}
DTRAIN_API dt_strategy_desc dt_multi_worker_mirrored(dt_comm *comm, int replicas) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED, replicas, 0);
  d.comm = comm;
  return d;
}

DTRAIN_API dt_result dt_strategy_parse(const char *name, int replicas, int max_staleness, dt_strategy_desc *out) {
  if (!name || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_parse: %s is NULL", !name ? "name" : "out");
  for (int k = DTRAIN_STRATEGY_ONE_DEVICE; k <= DTRAIN_STRATEGY_PARAMETER_SERVER; k++) {
    if (strcmp(name, dt_strategy_kind_name((dt_strategy_kind)k)) == 0) {
      *out = dt__strategy_desc((dt_strategy_kind)k, k == DTRAIN_STRATEGY_ONE_DEVICE ? 1 : replicas, max_staleness);
      return DTRAIN_OK;
    }
  }
  return dt__error(DTRAIN_ERR_INVALID_ARG,
                   "dt_strategy_parse: unknown strategy '%s' (one_device, mirrored, central_storage, async, "
                   "multi_worker_mirrored, parameter_server)", name);
}

static int dt__strategy_sync(const dt_strategy *s) {
  return s->desc.kind != DTRAIN_STRATEGY_ASYNC && s->desc.kind != DTRAIN_STRATEGY_PARAMETER_SERVER;
}

/* Record replica r's failure; the first one wins. Breaks the barrier or the
 * store so that nobody waits for r. */
static void dt__strategy_fail(dt_strategy *s, int r, dt_result code, const char *what) {
  int expected = -1;
  s->rep[r].result = code;
  if (DT__ACAS(&s->failed, &expected, r, DT__MO_SEQ_CST)) {
    s->err = code;
    snprintf(s->msg, sizeof s->msg, "replica %d: %s", r, what);
  }
  if (s->comm) dt_comm_abort(s->comm, r);
  if (s->pstore) dt_pstore_abort(s->pstore);
}

static int dt__strategy_failed(dt_strategy *s) { return DT__ALOAD(&s->failed, DT__MO_ACQUIRE) >= 0; }

/* A collective or the store returned rc: aborted by someone else, or a
 * failure of this replica's own. */
static void dt__strategy_comm_failed(dt_strategy *s, int r, dt_result rc) {
  if (rc == DTRAIN_ERR_ABORTED) s->rep[r].result = DTRAIN_ERR_ABORTED;
  else dt__strategy_fail(s, r, rc, dt_last_error());
}

/* Shard r of the global batch (see "Batches" in dt_strategy.h). */
static void dt__strategy_shard(const dt_minibatch *gb, int n, int r, dt_minibatch *out) {
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

static dt_result dt__strategy_check_batch(const dt_minibatch *b, const char *fn) {
  if (!b) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: batch is NULL", fn);
  if (b->rows < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: batch has %lld rows", fn, (long long)b->rows);
  if (b->x_cols < 0 || b->y_cols < 0 || b->t_cols < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: negative column count (x %lld, y %lld, t %lld)", fn,
                     (long long)b->x_cols, (long long)b->y_cols, (long long)b->t_cols);
  return DTRAIN_OK;
}

/* Index of the first non-finite value in x[b, e), or e. */
static size_t dt__strategy_nonfinite(const float *x, size_t b, size_t e) {
  for (size_t i = b; i < e; i++)
    if (!isfinite(x[i])) return i;
  return e;
}

/* Name of the parameter holding flat index i (for messages). */
static const char *dt__strategy_param_at(dt_strategy *s, size_t i) {
  dt_param_info info;
  for (int p = 0; p < dt_params_count(s->params); p++)
    if (dt_params_info(s->params, p, &info) == DTRAIN_OK && i >= info.offset && i < info.offset + info.size)
      return info.name;
  return "(padding)";
}

/* Forward + backward of replica r on its shard. Returns 0 on failure (recorded). */
static int dt__strategy_compute(dt_strategy *s, int r, const dt_minibatch *b) {
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

/* Sum of squares of the trainable elements of grad in [b, e), in index order. */
static double dt__strategy_sumsq(dt_strategy *s, const float *grad, size_t b, size_t e) {
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

static void dt__strategy_scale(dt_strategy *s, float *grad, size_t b, size_t e, float coef) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    for (size_t j = lo; j < hi; j++) grad[j] *= coef;
  }
}

/* Replica r's part of gradient clipping over the slice [b, e) of grad. */
static int dt__strategy_clip(dt_strategy *s, int r, float *grad, size_t b, size_t e) {
  float clip = dt_optim_get_desc(s->opt)->clip_norm;
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
  if (!isfinite(norm)) {
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
  if (norm > (double)clip) dt__strategy_scale(s, grad, b, e, (float)((double)clip / (norm + 1e-6)));
  return 1;
}

/* Replica r's checks of its slice [lo, hi) of the reduced gradient before
 * the update (mirrored, multi_worker_mirrored): clipping, then with
 * check_numerics a NaN/Inf scan and a barrier, so that nobody updates before
 * everybody checked. 0: the step stops (the failure is recorded). */
static int dt__strategy_clip_check(dt_strategy *s, int r, float *grad, size_t lo, size_t hi) {
  if (!dt__strategy_clip(s, r, grad, lo, hi)) return 0;
  if (!s->desc.check_numerics) return 1;
  size_t bad = dt__strategy_nonfinite(grad, lo, hi);
  if (bad < hi) {
    char what[DT__MSG_CAP];
    snprintf(what, sizeof what, "reduced gradient of '%s' is %s at flat index %zu; no update made",
             dt__strategy_param_at(s, bad), isnan(grad[bad]) ? "NaN" : "Inf", bad);
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
  dt_result rc = dt_comm_barrier(s->comm, r);
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    return 0;
  }
  return 1;
}

/* Copies the non-trainable runs (buffers) of src within [b, e) to dst. */
static void dt__strategy_copy_buffers(dt_strategy *s, float *dst, const float *src, size_t b, size_t e) {
  for (int i = 0; i < s->nbufr; i++) {
    size_t lo = DT__MAX(s->bufr[2 * i], b), hi = DT__MIN(s->bufr[2 * i + 1], e);
    if (lo < hi) memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float));
  }
}

/* ---- the synchronous step ------------------------------------------------------------------ */

static void dt__strategy_sync_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int mirrored = s->desc.kind == DTRAIN_STRATEGY_MIRRORED;
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  b.weight = (s->desc.loss == DTRAIN_LOSS_SUM || b.global_rows == 0) ? 1.0f
                                                                    : (float)((double)b.rows / (double)b.global_rows);
  b.replica_step = 0;
  /* central storage with buffers: every replica reads a private copy of
   * the centre, so that forward passes writing batch-norm statistics do not
   * race; replica 0's statistics go back to the centre after the reduce. */
  if (R->own_data && !mirrored) memcpy(R->own_data, dt_params_data(s->params), s->fbytes);
  if (!dt__strategy_compute(s, r, &b)) return;

  size_t lo, hi;
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  float *grad, *data;
  dt_result rc;
  double w0 = 0.0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  w0 = cs.wait_s;
  if (mirrored) {
    rc = dt_comm_reduce_scatter(s->comm, r, R->grad, s->size);
    grad = R->grad;
    data = R->data;
  } else {
    rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
    grad = s->rep[0].grad;
    data = dt_params_data(s->params);
  }
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  if (!dt__strategy_clip_check(s, r, grad, lo, hi)) goto done;
  rc = dt_optim_update(s->opt, data, grad, lo, hi);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    goto done;
  }
  /* The optimizer never touches the buffer ranges: replica 0 may write them
   * while the others update their slices. */
  if (!mirrored && r == 0 && R->own_data)
    for (int i = 0; i < s->nbufr; i++)
      memcpy(data + s->bufr[2 * i], R->own_data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  if (mirrored) {
    /* Buffers follow replica 0: each replica puts replica 0's values into
     * its own slice before the all-gather spreads the slices (the optimizer
     * never writes the buffer ranges, so replica 0's stay still meanwhile). */
    if (r > 0) dt__strategy_copy_buffers(s, R->data, s->rep[0].data, lo, hi);
    rc = dt_comm_allgather(s->comm, r, R->data, s->size);
    if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
  }
done:
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
}

/* ==== multi_worker_mirrored ============================================================
 * Lock-step data parallelism across processes, hierarchical inside each:
 * desc.comm connects the processes (one rank each: TCP, MPI); the process's
 * own replicas (threads) use the in-process communicator s->comm. A step
 * (dt__strategy_mwm_job, run by every local replica):
 *
 *   shard r of this process's batch -> forward/backward with the loss
 *   gradient weighted by the shard's rows (MEAN; 1 for SUM), so gradients
 *   are row sums -> reduce to replica 0 (threads, rank order) -> replica 0
 *   appends a tail (rows, loss sum, failure flags) and writes rank 0's
 *   buffers (batch-norm statistics; zeros elsewhere) into their ranges of the
 *   gradient -> ONE all-reduce of the whole buffer on desc.comm -> a barrier
 *   (replica 0's result is everybody's) -> each replica scales its slice by
 *   1/global rows, then clipping / numerics / the optimizer on its slice as
 *   in mirrored, and the slice of the buffers from the all-reduce (= rank 0
 *   replica 0's) into its copy -> all-gather of the parameters.
 *
 * Replica 0 always joins the cross-process all-reduce, even after a local
 * failure (it then sends zeros with the failure flag set), so that no other
 * process waits for it: every rank sees the flag and fails the step too.
 * After the all-reduce every rank holds the same numbers, so clipping and
 * numerics checks decide the same everywhere without further messages.
 */

/* Floats after the gradient in the cross-process buffer:
 * [0, 1] global rows (hi + lo), [2, 3] loss sum (hi + lo),
 * [4] ranks that failed locally, [5] sum of (failed rank + 1). */
#define DT__MWM_TAIL 8

static dt_result dt__strategy_mwm_check(const dt_strategy_desc *d) {
  const char *fn = "dt_strategy_create";
  dt_comm *c = d->comm;
  if (!c || !c->vtable)
    return dt__error(DTRAIN_ERR_NULL_ARG,
                     "%s: multi_worker_mirrored needs desc.comm (dt_comm_create_tcp or dt_comm_create_mpi)", fn);
  if (c->world < 1 || c->rank < 0 || c->rank >= c->world)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: multi_worker_mirrored: communicator '%s' has rank %d of world %d",
                     fn, dt_comm_name(c), c->rank, c->world);
  return DTRAIN_OK;
}

static dt_result dt__strategy_mwm_alloc(dt_strategy *s) {
  s->mwm_bytes = (s->size + DT__MWM_TAIL) * sizeof(float);
  s->mwm_buf = (float *)dt__calloc(s->mwm_bytes);
  return s->mwm_buf ? DTRAIN_OK : DTRAIN_ERR_NOMEM;
}

static dt_result dt__strategy_mwm_comm_error(dt_strategy *s, const char *fn, dt_result rc) {
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "%.300s", dt_last_error());
  return dt__error(rc, "%s: multi_worker_mirrored: initial broadcast from rank 0 (rank %d of %d): %s", fn,
                   dt_comm_rank(s->desc.comm), dt_comm_world(s->desc.comm), what);
}

/* Rank 0's parameters and buffers to every process (after checking that all
 * built the same model), then into every local replica. Collective: every
 * process calls it (dt_strategy_create, dt_strategy_sync). */
static dt_result dt__strategy_mwm_start(dt_strategy *s, const char *fn) {
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *pdata = dt_params_data(s->params);
  /* The model hash in 16-bit pieces (exact in floats), from rank 0. */
  uint64_t h = dt_params_hash(s->params), h0 = 0;
  float hb[4], flag[2];
  for (int i = 0; i < 4; i++) hb[i] = (float)((h >> (16 * i)) & 0xffffu);
  dt_result rc = dt_comm_broadcast(x, rank, hb, 4, 0);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  for (int i = 0; i < 4; i++) h0 |= (uint64_t)hb[i] << (16 * i);
  /* Everybody learns whether somebody differs (so that all fail alike). */
  flag[0] = h0 != h ? 1.0f : 0.0f;
  flag[1] = h0 != h ? (float)(rank + 1) : 0.0f;
  rc = dt_comm_allreduce(x, rank, flag, 2);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  if (flag[0] > 0.5f) {
    if (flag[0] < 1.5f)
      return dt__error(DTRAIN_ERR_MISMATCH,
                       "%s: multi_worker_mirrored: rank %d built a different model than rank 0 (dt_params_hash "
                       "differs: names, shapes or order of the parameters)", fn, (int)flag[1] - 1);
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "%s: multi_worker_mirrored: %d ranks built a different model than rank 0 (dt_params_hash differs)",
                     fn, (int)(flag[0] + 0.5f));
  }
  rc = dt_comm_broadcast(x, rank, pdata, s->size, 0);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  if (s->dev) {
    for (int r = 0; r < s->n; r++) {
      rc = dt_graph_params_upload(s->rep[r].g);
      if (rc != DTRAIN_OK) return dt__error(rc, "%s: replica %d: %s", fn, r, dt_last_error());
    }
    return DTRAIN_OK;
  }
  for (int r = 1; r < s->n; r++) memcpy(s->rep[r].data, pdata, s->fbytes);
  return DTRAIN_OK;
}

/* Replica 0's part: the one cross-process all-reduce. ok: the local part
 * succeeded. Returns 1 when the step goes on (s->mwm_rows/mwm_loss set). */
static int dt__strategy_mwm_exchange(dt_strategy *s, int ok) {
  dt__strategy_replica *R = &s->rep[0];
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *buf = s->mwm_buf, *tail = buf + s->size; /* (replica 0's gradient on the CPU) */
  char what[DT__MSG_CAP];
  memset(tail, 0, DT__MWM_TAIL * sizeof(float));
  if (ok) {
    double rows = 0.0, lsum = 0.0;
    for (int r = 0; r < s->n; r++) {
      rows += (double)s->rep[r].rows;
      lsum += (s->desc.loss == DTRAIN_LOSS_SUM ? 1.0 : (double)s->rep[r].rows) * (double)s->rep[r].loss;
    }
    tail[0] = (float)rows;
    tail[1] = (float)(rows - (double)tail[0]);
    tail[2] = (float)lsum;
    tail[3] = (float)(lsum - (double)tail[2]);
    /* Buffers follow rank 0: its values plus zeros from the others (with
     * devices the caller put them in buf). */
    for (int i = 0; i < s->nbufr && !s->dev; i++) {
      size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
      if (rank == 0) memcpy(buf + b, R->data + b, (e - b) * sizeof(float));
      else memset(buf + b, 0, (e - b) * sizeof(float));
    }
  } else {
    memset(buf, 0, s->fbytes);
    tail[4] = 1.0f;
    tail[5] = (float)(rank + 1);
  }
  double t0 = dt__now();
  dt_result rc = dt_comm_allreduce(x, rank, buf, s->size + DT__MWM_TAIL);
  R->wait_s += dt__now() - t0;
  if (rc != DTRAIN_OK) {
    if (ok) {
      /* ABORTED carries no message of its own: an earlier failure broke the communicator. */
      snprintf(what, sizeof what, "cross-process all-reduce (rank %d of %d): %.250s", rank, x->world,
               rc == DTRAIN_ERR_ABORTED ? "the communicator was broken by an earlier failure (see that error); "
                                          "recreate it (and the strategy) to go on"
                                        : dt_last_error());
      dt__strategy_fail(s, 0, rc, what);
    }
    return 0;
  }
  if (!ok) return 0; /* the local failure is already recorded */
  if (tail[4] > 0.5f) {
    if (tail[4] < 1.5f)
      snprintf(what, sizeof what, "rank %d failed its part of step %lld (its own error says why); no update made",
               (int)tail[5] - 1, (long long)s->batch->step);
    else
      snprintf(what, sizeof what, "%d ranks failed their part of step %lld; no update made", (int)(tail[4] + 0.5f),
               (long long)s->batch->step);
    dt__strategy_fail(s, 0, DTRAIN_ERR_PEER, what);
    return 0;
  }
  s->mwm_rows = (double)tail[0] + (double)tail[1];
  double L = (double)tail[2] + (double)tail[3];
  s->mwm_loss = s->desc.loss == DTRAIN_LOSS_SUM ? L : (s->mwm_rows > 0.0 ? L / s->mwm_rows : 0.0);
  return 1;
}

/* Copies the trainable elements of grad in [b, e) to dst (the params' grad). */
static void dt__strategy_mwm_copy_grad(dt_strategy *s, float *dst, const float *grad, size_t b, size_t e) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    if (lo < hi) memcpy(dst + lo, grad + lo, (hi - lo) * sizeof(float));
  }
}

static void dt__strategy_mwm_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  /* Row sums now; the division by the global rows comes after the all-reduce. */
  b.weight = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0f : (float)b.rows;
  b.replica_step = 0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  double w0 = cs.wait_s;
  int ok = dt__strategy_compute(s, r, &b);
  dt_result rc;
  float *grad = s->rep[0].grad;
  size_t lo, hi;
  if (ok) {
    rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  if (r == 0) ok = dt__strategy_mwm_exchange(s, ok);
  if (!ok) goto done;
  rc = dt_comm_barrier(s->comm, r); /* replica 0's all-reduce is done */
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  if (s->desc.loss == DTRAIN_LOSS_MEAN && s->mwm_rows > 0.0)
    dt__strategy_scale(s, grad, lo, hi, (float)(1.0 / s->mwm_rows));
  if (!dt__strategy_clip_check(s, r, grad, lo, hi)) goto done;
  rc = dt_optim_update(s->opt, R->data, grad, lo, hi);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    goto done;
  }
  dt__strategy_mwm_copy_grad(s, dt_params_grad(s->params), grad, lo, hi);
  /* The buffers: rank 0 replica 0's, carried by the all-reduce; each replica
   * puts its slice of them into its copy, the all-gather spreads them. */
  dt__strategy_copy_buffers(s, R->data, grad, lo, hi);
  rc = dt_comm_allgather(s->comm, r, R->data, s->size);
  if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
done:
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
}

#undef DT__MWM_TAIL
/* ==== end of multi_worker_mirrored ============================================================ */

/* ==== replicas on devices (desc.devices) ======================================================
 * One replica per device; the same thread pool and in-process communicator
 * (a barrier) as on the CPU. A step (dt__strategy_dev_job, every replica):
 *
 *   shard r -> zero the device gradient -> step fn + backward on the device
 *   -> barrier -> replica 0 alone: dt_device_group_allreduce of the device
 *   gradients, [mwm: device 0's sum -> host -> the cross-process all-reduce
 *   -> scaled by 1/global rows -> device 0], the checks on a host copy
 *   (check_numerics, a finite clipping norm), dt_optim_step_graph on device
 *   0 with the strategy's optimizer (its state lives on device 0 only), and
 *   a broadcast of device 0's parameters (buffers included) to the others.
 * Updating on one device and broadcasting (rather than every device
 * updating its copy with its own optimizer state) keeps ONE optimizer state
 * (the given dt_optim's, so that checkpoints and dt_optim_* see it) and
 * makes a failure easy to undo: the replicas can never drift apart, because
 * whatever fails, every device gets the params' values again. The price is
 * one broadcast of the parameters per step on top of the all-reduce.
 * The caller then copies replica 0's parameters to the params (host). */

/* Replica 0's checks of a host copy of the reduced gradient: NaN/Inf
 * (check_numerics) and a finite clipping norm. 0: the step stops. */
static int dt__strategy_dev_checks(dt_strategy *s, const float *g) {
  char what[DT__MSG_CAP];
  if (s->desc.check_numerics) {
    size_t bad = dt__strategy_nonfinite(g, 0, s->size);
    if (bad < s->size) {
      snprintf(what, sizeof what, "reduced gradient of '%s' is %s at flat index %zu; no update made",
               dt__strategy_param_at(s, bad), isnan(g[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  if (dt_optim_get_desc(s->opt)->clip_norm > 0.0f) {
    double norm = sqrt(dt__strategy_sumsq(s, g, 0, s->size));
    if (!isfinite(norm)) {
      snprintf(what, sizeof what, "gradient norm is %s; no update made", isnan(norm) ? "NaN" : "Inf");
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  return 1;
}

/* A failed device call of replica 0's reduce phase. */
static int dt__strategy_dev_failed(dt_strategy *s, dt_result rc, const char *what) {
  char msg[DT__MSG_CAP];
  snprintf(msg, sizeof msg, "%.60s: %.250s", what, dt_last_error());
  dt__strategy_fail(s, 0, rc, msg);
  return 0;
}

/* Replica 0's host <-> device copy of [b, e) of replica r's buffer p. */
static dt_result dt__strategy_dev_copy(dt_strategy *s, int r, float *dst, const float *src, size_t b, size_t e,
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

/* Replica 0's part after the barrier. ok: the local part succeeded
 * (multi_worker_mirrored: replica 0 always joins the exchange). */
static int dt__strategy_dev_reduce(dt_strategy *s, int ok) {
  const int mwm = s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_device_group_allreduce(s->dgroup, s->dgrad);
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "all-reduce of the gradients over the devices");
  }
  if (!mwm) {
    if (!ok) return 0;
    if (!s->desc.check_numerics && !(dt_optim_get_desc(s->opt)->clip_norm > 0.0f)) return 1;
    rc = dt__strategy_dev_copy(s, 0, s->dhost, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
    if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the host");
    return dt__strategy_dev_checks(s, s->dhost);
  }
  /* multi_worker_mirrored: device 0 -> host -> across processes -> device 0 */
  float *buf = s->mwm_buf;
  if (ok) {
    rc = dt__strategy_dev_copy(s, 0, buf, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
    for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) {
      size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
      if (dt_comm_rank(s->desc.comm) == 0) rc = dt__strategy_dev_copy(s, 0, buf, s->ddata[0], b, e, DTRAIN_COPY_D2H);
      else memset(buf + b, 0, (e - b) * sizeof(float));
    }
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "local gradient to the host");
  }
  if (!dt__strategy_mwm_exchange(s, ok)) return 0;
  if (s->desc.loss == DTRAIN_LOSS_MEAN && s->mwm_rows > 0.0)
    dt__strategy_scale(s, buf, 0, s->size, (float)(1.0 / s->mwm_rows));
  if (!dt__strategy_dev_checks(s, buf)) return 0;
  rc = dt__strategy_dev_copy(s, 0, s->dgrad[0], buf, 0, s->size, DTRAIN_COPY_H2D);
  for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) /* rank 0 replica 0's buffers */
    rc = dt__strategy_dev_copy(s, 0, s->ddata[0], buf, s->bufr[2 * i], s->bufr[2 * i + 1], DTRAIN_COPY_H2D);
  if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the device");
  return 1;
}

static void dt__strategy_dev_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int mwm = s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
  R->result = DTRAIN_OK;
  R->updating = 0;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  if (mwm) b.weight = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0f : (float)b.rows; /* row sums, as on the CPU */
  else b.weight = (s->desc.loss == DTRAIN_LOSS_SUM || b.global_rows == 0)
                      ? 1.0f
                      : (float)((double)b.rows / (double)b.global_rows);
  b.replica_step = 0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  double w0 = cs.wait_s;
  int ok = dt__strategy_compute(s, r, &b);
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_comm_barrier(s->comm, r); /* every gradient is done */
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
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

/* After a failed step: when some replica reached the update, put the
 * params' (pre-step) values back on every device so the replicas stay
 * equal. */
static void dt__strategy_dev_restore(dt_strategy *s, int64_t opt_steps) {
  int any = 0;
  for (int r = 0; r < s->n; r++) any |= s->rep[r].updating;
  if (!any) return;
  dt__quiet_push();
  for (int r = 0; r < s->n; r++) (void)dt_graph_params_upload(s->rep[r].g);
  dt__quiet_pop(DTRAIN_OK);
  dt_optim_set_steps(s->opt, opt_steps);
}

/* ==== end of devices ======================================================================= */

/* ==== parameter_server (worker side) ==========================================================
 * The async replica's loop against a store that takes gradients (dt_pstore_create_tcp): no
 * local optimizer step; the vector pushed holds the (clipped) gradient for trainable
 * parameters and the current values of buffers. One replica per process: the replica is this
 * process's worker of the store. */

/* Replica r's push vector in R->old, or NULL after a recorded failure. */
static const float *dt__strategy_ps_gradient(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  float clip = dt_optim_get_desc(s->opt)->clip_norm;
  if (clip > 0.0f) {
    double norm = sqrt(dt__strategy_sumsq(s, R->grad, 0, s->size));
    if (!isfinite(norm)) {
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, "gradient norm is not finite; nothing pushed");
      return NULL;
    }
    if (norm > (double)clip) dt__strategy_scale(s, R->grad, 0, s->size, (float)((double)clip / (norm + 1e-6)));
  }
  memcpy(R->old, R->grad, s->fbytes);
  for (int i = 0; i < s->nbufr; i++)
    memcpy(R->old + s->bufr[2 * i], R->data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  return R->old;
}

DTRAIN_API dt_strategy_desc dt_parameter_server(dt_pstore *store, int max_staleness) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_PARAMETER_SERVER, 1, max_staleness);
  d.store = store;
  return d;
}

/* ==== end of parameter_server ================================================================= */

/* ---- the asynchronous replica -------------------------------------------------------------- */

static void dt__strategy_async_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int lockstep = s->desc.max_staleness == 0 || s->batch != NULL;
  const int ps_kind = s->desc.kind == DTRAIN_STRATEGY_PARAMETER_SERVER;
  R->result = DTRAIN_OK;
  char what[DT__MSG_CAP];
  for (int64_t t = 0;; t++) {
    if (dt__strategy_failed(s)) {
      if (R->result == DTRAIN_OK) R->result = DTRAIN_ERR_ABORTED;
      break;
    }
    int64_t ticket;
    if (lockstep) {
      if (t >= s->job_steps) break;
      ticket = t * s->n + r;
    } else {
      ticket = DT__AFETCH_ADD(&s->ticket, (int64_t)1, DT__MO_RELAXED);
      if (ticket >= s->job_steps) break;
    }
    dt_minibatch b;
    if (s->batch) {
      dt__strategy_shard(s->batch, s->n, r, &b);
    } else {
      memset(&b, 0, sizeof b);
      dt_result rc = s->next(s->next_user, r, s->ticket_base + ticket, &b);
      if (rc == DTRAIN_OK) rc = dt__strategy_check_batch(&b, "dt_strategy_run");
      if (rc != DTRAIN_OK) {
        snprintf(what, sizeof what, "the batch function failed for step %lld (%s)",
                 (long long)(s->ticket_base + ticket), dt_result_name(rc));
        dt__strategy_fail(s, r, rc, what);
        break;
      }
      b.first = 0;
      b.global_rows = b.rows;
    }
    b.step = s->ticket_base + ticket;
    b.replica_step = t;
    b.weight = 1.0f;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    dt_result rc = dt_pstore_pull(s->pstore, r, t, R->data, s->size, &tk);
    R->wait_s += tk.wait_s;
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    if (tk.clock_gap > R->gap_max) R->gap_max = tk.clock_gap;
    if (!ps_kind) memcpy(R->old, R->data, s->fbytes);
    if (!dt__strategy_compute(s, r, &b)) break;
    const float *delta = NULL;
    if (b.rows > 0 && ps_kind) {
      if (!(delta = dt__strategy_ps_gradient(s, r))) break;
    } else if (b.rows > 0) {
      float clip = dt_optim_get_desc(R->opt)->clip_norm;
      if (clip > 0.0f) {
        double norm = sqrt(dt__strategy_sumsq(s, R->grad, 0, s->size));
        if (!isfinite(norm)) {
          dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, "gradient norm is not finite; no update made");
          break;
        }
        if (norm > (double)clip) dt__strategy_scale(s, R->grad, 0, s->size, (float)((double)clip / (norm + 1e-6)));
      }
      rc = dt_optim_update(R->opt, R->data, R->grad, 0, s->size);
      if (rc != DTRAIN_OK) {
        dt__strategy_fail(s, r, rc, dt_last_error());
        break;
      }
      dt_optim_advance(R->opt);
      float *d = R->old;
      for (size_t i = 0; i < s->size; i++) d[i] = R->data[i] - d[i];
      if (s->desc.check_numerics) {
        size_t bad = dt__strategy_nonfinite(d, 0, s->size);
        if (bad < s->size) {
          snprintf(what, sizeof what, "update of '%s' is %s at flat index %zu; not pushed",
                   dt__strategy_param_at(s, bad), isnan(d[bad]) ? "NaN" : "Inf", bad);
          dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
          break;
        }
      }
      delta = d;
    }
    rc = dt_pstore_push(s->pstore, r, t, delta, s->size, &tk);
    R->wait_s += tk.wait_s;
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    int64_t st = tk.staleness < 0 ? 0 : tk.staleness;
    R->hist[DT__MIN(st, (int64_t)DTRAIN_STALENESS_BINS - 1)]++;
    R->stale_sum += st;
    if (st > R->stale_max) R->stale_max = st;
    R->steps++;
    R->samples += b.rows;
    if (b.rows > 0) {
      R->loss_sum += R->loss;
      R->loss_count++;
      R->last_loss = R->loss;
      R->last_time = dt__now();
    }
  }
  if (!ps_kind) dt_pstore_leave(s->pstore, r); /* a server store is left with dt_pstore_leave by the user */
}

/* ---- running jobs ------------------------------------------------------------------------------ */

static void dt__strategy_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  int was = dt__par_set_replica(s->n > 1); /* replicas fill the cores: kernels inside use one thread */
  if (s->dev) dt__strategy_dev_job(arg, r);
  else if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) dt__strategy_mwm_job(arg, r);
  else if (dt__strategy_sync(s)) dt__strategy_sync_job(arg, r);
  else dt__strategy_async_job(arg, r);
  dt__par_set_replica(was);
}

/* Runs the current job on every replica; returns the first failure, with
 * the thread's error set on the calling thread. */
static dt_result dt__strategy_launch(dt_strategy *s, const char *fn) {
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
  double t0 = dt__now();
  dt_minibatch gb = *batch;
  gb.step = dt__strategy_sync(s) ? s->steps : s->tickets;
  s->batch = &gb;
  s->next = NULL;
  s->job_steps = 1;
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
   * (multi_worker_mirrored: the global batch's, from the all-reduce). */
  double L = 0.0;
  if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) L = s->mwm_loss;
  for (int r = 0; r < s->n && s->desc.kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED; r++) {
    double w = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0 : (gb.rows ? (double)s->rep[r].rows / (double)gb.rows : 0.0);
    L += w * (double)s->rep[r].loss;
  }
  if (dt__strategy_sync(s)) {
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
  if (dt__strategy_sync(s)) {
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
  /* async: one job in which the replicas run free */
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

/* ---- create / destroy -------------------------------------------------------------------------- */

static float *dt__strategy_floats(dt_strategy *s, const float *init) {
  float *p = (float *)dt__alloc(s->fbytes ? s->fbytes : sizeof(float));
  if (p) {
    if (init) memcpy(p, init, s->fbytes);
    else memset(p, 0, s->fbytes);
  }
  return p;
}

static dt_result dt__strategy_check_desc(dt_strategy_desc *d) {
  const char *fn = "dt_strategy_create";
  if ((int)d->kind < (int)DTRAIN_STRATEGY_ONE_DEVICE || (int)d->kind > (int)DTRAIN_STRATEGY_PARAMETER_SERVER)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown strategy kind %d", fn, (int)d->kind);
  if (d->kind == DTRAIN_STRATEGY_PARAMETER_SERVER) {
    if (!d->store) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: parameter_server needs desc.store (dt_pstore_create_tcp)", fn);
    if (d->replicas > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: parameter_server runs 1 replica per process (the process is "
                       "one worker of the store), not %d", fn, d->replicas);
    d->replicas = 1;
    d->max_staleness = d->store->max_staleness;
  }
  const char *name = dt_strategy_kind_name(d->kind);
#if defined(DTRAIN_NO_THREADS)
  if (d->kind != DTRAIN_STRATEGY_ONE_DEVICE)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %s needs threads (built with DTRAIN_NO_THREADS); use one_device",
                     fn, name);
#endif
  if (d->devices && d->replicas == 0) d->replicas = d->ndevices;
  if (d->kind == DTRAIN_STRATEGY_ONE_DEVICE) {
    if (d->replicas > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: one_device has 1 replica, not %d", fn, d->replicas);
    d->replicas = 1;
  }
  if (d->replicas == 0) d->replicas = DT__MIN(dt__cpu_count(), DTRAIN_MAX_REPLICAS);
  if (d->replicas < 1 || d->replicas > DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s with %d replicas (need 1..%d)", fn, name, d->replicas,
                     DTRAIN_MAX_REPLICAS);
  if ((d->kind == DTRAIN_STRATEGY_ASYNC || d->kind == DTRAIN_STRATEGY_PARAMETER_SERVER) &&
      d->max_staleness < DTRAIN_STALENESS_UNBOUNDED)
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
  if (d->kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) {
    dt_result rc = dt__strategy_mwm_check(d);
    if (rc != DTRAIN_OK) return rc;
  }
  if (d->devices || d->ndevices) {
    if (d->kind != DTRAIN_STRATEGY_ONE_DEVICE && d->kind != DTRAIN_STRATEGY_MIRRORED &&
        d->kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED)
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

DTRAIN_API dt_strategy *dt_strategy_create(dt_params *params, dt_optim *opt, dt_step_fn step, void *user,
                                           const dt_strategy_desc *desc) {
  const char *fn = "dt_strategy_create";
  if (!params || !opt || !step) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !params ? "params" : !opt ? "opt" : "step");
    return NULL;
  }
  dt_strategy_desc d = desc ? *desc : dt_one_device();
  if (dt__strategy_check_desc(&d) != DTRAIN_OK) return NULL;
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
  const int kind = d.kind;
  float *pdata = dt_params_data(params), *pgrad = dt_params_grad(params);

  /* Non-trainable runs (batch-norm statistics), adjacent ones merged. */
  int count = dt_params_count(params);
  size_t pb, pe;
  int tr, dec;
  for (int pass = 0; pass < 2; pass++) {
    int nr = 0;
    size_t cur_b = 0, cur_e = 0;
    int open = 0;
    for (int i = 0; i <= count; i++) {
      int have = i < count && dt__params_range(params, i, &pb, &pe, &tr, &dec);
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
        if (!s->bufr) goto nomem;
      }
    }
  }

  s->rep_bytes = (size_t)s->n * sizeof(dt__strategy_replica);
  s->rep = (dt__strategy_replica *)dt__calloc(s->rep_bytes);
  if (!s->rep) goto nomem;
  if (d.devices) {
    s->dev = 1;
    s->dgrad = (float **)dt__calloc((size_t)s->n * sizeof(float *));
    s->ddata = (float **)dt__calloc((size_t)s->n * sizeof(float *));
    if (!s->dgrad || !s->ddata || !(s->dhost = dt__strategy_floats(s, NULL))) goto nomem;
    if (kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && dt__strategy_mwm_alloc(s) != DTRAIN_OK) goto nomem;
  }
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
    if (s->dev) {
      R->data = s->ddata[r] = dt_graph_param_data(R->g);
      R->grad = s->dgrad[r] = dt_graph_param_grad(R->g);
      if (d.check_numerics && !(R->old = dt__strategy_floats(s, NULL))) goto nomem;
      continue;
    }
    const int mwm = kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
    int own_data = ((kind == DTRAIN_STRATEGY_MIRRORED || mwm) && r > 0) || kind == DTRAIN_STRATEGY_ASYNC ||
                   (kind == DTRAIN_STRATEGY_CENTRAL_STORAGE && s->nbufr > 0);
    int own_grad = r > 0 || kind == DTRAIN_STRATEGY_ASYNC;
    if (own_data && !(R->own_data = dt__strategy_floats(s, pdata))) goto nomem;
    if (own_grad && !(R->own_grad = dt__strategy_floats(s, NULL))) goto nomem;
    R->data = own_data ? R->own_data : pdata;
    R->grad = own_grad ? R->own_grad : pgrad;
    if (mwm && r == 0) {
      if (dt__strategy_mwm_alloc(s) != DTRAIN_OK) goto nomem;
      R->grad = s->mwm_buf;
    }
    if (dt_graph_bind(R->g, R->data, R->grad) != DTRAIN_OK) goto fail;
    if (kind == DTRAIN_STRATEGY_PARAMETER_SERVER && !(R->old = dt__strategy_floats(s, NULL))) goto nomem;
    if (kind == DTRAIN_STRATEGY_ASYNC) {
      if (!(R->old = dt__strategy_floats(s, NULL))) goto nomem;
      R->opt = dt_optim_create(params, dt_optim_get_desc(opt));
      if (!R->opt) goto fail;
      dt_optim_set_steps(R->opt, dt_optim_steps(opt));
    }
  }
  if (kind == DTRAIN_STRATEGY_ASYNC) {
    s->pstore = dt_pstore_create_local(pdata, s->size, s->n, d.max_staleness, d.async_update, d.spin_us);
    if (!s->pstore) goto fail;
  } else if (kind == DTRAIN_STRATEGY_PARAMETER_SERVER) {
    if (d.store->size != s->size) {
      dt__error(DTRAIN_ERR_SHAPE, "%s: the store holds %zu floats, the params %zu", fn, d.store->size, s->size);
      goto fail;
    }
    s->pstore = d.store; /* borrowed */
  } else {
    s->comm = dt_comm_create_threads(s->n, d.spin_us);
    if (!s->comm) goto fail;
  }
  if (s->dev && s->n > 1) {
    s->dgroup = dt_device_group_create(d.devices, s->n, s->size);
    if (!s->dgroup) goto fail;
  }
  s->pool = dt__pool_create(s->n, dt__spin_seconds(d.spin_us, s->n));
  if (!s->pool) goto fail;
  if (kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && dt__strategy_mwm_start(s, fn) != DTRAIN_OK) goto fail;
  return s;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory for %d replicas of %zu floats", fn, s->n, s->size);
fail:
  dt_strategy_destroy(s);
  return NULL;
}

DTRAIN_API void dt_strategy_destroy(dt_strategy *s) {
  if (!s) return;
  dt__pool_destroy(s->pool);
  dt_comm_destroy(s->comm);
  dt_device_group_destroy(s->dgroup);
  dt__free(s->dgrad, (size_t)s->n * sizeof(float *));
  dt__free(s->ddata, (size_t)s->n * sizeof(float *));
  dt__free(s->dhost, s->fbytes ? s->fbytes : sizeof(float));
  if (s->desc.kind != DTRAIN_STRATEGY_PARAMETER_SERVER) dt_pstore_destroy(s->pstore);
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
  dt__free(s->mwm_buf, s->mwm_bytes);
  dt__free(s, sizeof *s);
}

DTRAIN_API dt_result dt_strategy_sync(dt_strategy *s) {
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_sync: strategy is NULL");
  if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) return dt__strategy_mwm_start(s, "dt_strategy_sync");
  if (s->dev) {
    for (int r = 0; r < s->n; r++) {
      dt_result rc = dt_graph_params_upload(s->rep[r].g);
      if (rc != DTRAIN_OK) return dt__error(rc, "dt_strategy_sync: replica %d: %s", r, dt_last_error());
    }
    return DTRAIN_OK;
  }
  if (s->desc.kind == DTRAIN_STRATEGY_MIRRORED) {
    const float *src = dt_params_data(s->params);
    for (int r = 1; r < s->n; r++) memcpy(s->rep[r].data, src, s->fbytes);
  }
  return DTRAIN_OK;
}

DTRAIN_API int dt_strategy_replicas(const dt_strategy *s) { return s ? s->n : 0; }
DTRAIN_API const dt_strategy_desc *dt_strategy_get_desc(const dt_strategy *s) { return s ? &s->desc : NULL; }

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
    if (!dt__strategy_sync(s)) pushes += R->steps;
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

#undef DT__PSTORE_DONE
