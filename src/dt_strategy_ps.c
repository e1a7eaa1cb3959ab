/* ===========================================================================
 * dt_strategy_ps.c -- parameter_server, the worker side: the async replica
 * loop (dt_strategy_async.c) against a store that takes gradients
 * (dt_pstore_create_tcp, dt_ps.c)
 * ===========================================================================
 * No local optimizer step: the vector pushed holds the (clipped) gradient
 * for trainable parameters and the current values of buffers; the servers
 * apply their optimizer to their shard. One replica per process: the
 * replica is this process's worker of the store, which is borrowed.
 *
 * desc.overlap (dt_strategy_run): a communication thread pushes step t's
 * gradient and pulls the parameters for step t + 1 while this thread
 * computes step t + 1 on the last parameters it has, those of the pull
 * before (two copies of the parameters and of the gradient take turns). So
 * the wire and the servers' optimizer overlap the forward and backward
 * pass, and each step lacks this worker's own last update (one clock more
 * staleness, which the servers count). The requests are those of the plain
 * loop (push t, then pull t + 1, from one thread at a time), so the
 * servers' staleness bound holds for them; a step computes on parameters
 * one clock older than its pull's bound (hence no overlap with
 * max_staleness 0, which would not be lock-step any more). At the end of a
 * run the params hold the last pull: every push of the run applied.
 *
 * desc.push_early (a TCP store): each step's push goes in parts while
 * backward runs. Backward announces each parameter whose gradient is final
 * (dt__graph_on_grad_ready); a server's part can go once its parameters from
 * some index to the last are all final (buffers count as final from the
 * start: forward wrote them) and about bucket_bytes of them wait; a thread
 * sends it (dt__ps_client_push_part, a PUSHP frame) while backward computes
 * the earlier layers. The push after backward sends each server the rest of
 * its shard as the last part, and the servers apply the push only then: the
 * same floats as the plain push, so bitwise the same result, with the same
 * staleness. A skipped step's push discards the parts; a failed step leaves
 * them, and the next request drops them.
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
  if (d->push_early && d->overlap)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: parameter_server with both push_early and overlap (overlap "
                     "pushes a step's gradient while the next step computes; choose one)", fn);
  if (d->push_early && d->compress.kind != DTRAIN_COMPRESS_NONE)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: push_early with compress %s (the parts carry floats; the "
                     "compressed forms encode the whole push at once)", fn, dt_compress_name(d->compress));
  if (d->overlap && d->max_staleness == 0)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: parameter_server overlap computes each step on the parameters of "
                     "the pull before (one clock older), which max_staleness 0 (lock-step) does not allow; use a "
                     "bound of 1 or more, or no overlap", fn);
  return DTRAIN_OK;
}

/* desc.overlap: the communication thread and the second copies (see the top). */
typedef struct dt__ps_comm {
  dt_strategy *s;
  float *data2, *grad2;    /* the other copy of the parameters, of the gradient */
  dt__mutex mu;
  dt__cond cv;
  dt__thread th;
  int sync_ok;             /* mu and cv made */
  int quit;
  int busy;                /* a job was posted and is not done */
  int64_t t;               /* the job: push(t) of push (NULL: empty), then pull(t + 1) into dst */
  const float *push;
  float *dst;
  int64_t rows;            /* its step's rows, skip and loss, counted when it is done */
  int skipped;
  float loss;
  dt_result rc;            /* what it did */
  dt_pstore_ticket tk_push, tk_pull;
  char msg[DT__MSG_CAP];
} dt__ps_comm;

static void dt__ps_comm_main(void *arg) {
  dt__ps_comm *C = (dt__ps_comm *)arg;
  dt_strategy *s = C->s;
  dt__mutex_lock(&C->mu);
  for (;;) {
    while (!C->busy && !C->quit) dt__cond_wait(&C->cv, &C->mu);
    if (!C->busy) break; /* quit, with nothing posted */
    int64_t t = C->t;
    const float *push = C->push;
    float *dst = C->dst;
    dt__mutex_unlock(&C->mu);
    dt_pstore_ticket a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    dt__ps_client_push_basis(s->pstore, t > 0 ? t - 1 : 0); /* step t computed on the pull of t - 1 */
    dt_result rc = dt_pstore_push(s->pstore, 0, t, push, s->size, &a);
    if (rc == DTRAIN_OK) rc = dt_pstore_pull(s->pstore, 0, t + 1, dst, s->size, &b);
    dt__mutex_lock(&C->mu);
    C->rc = rc;
    if (rc != DTRAIN_OK) snprintf(C->msg, sizeof C->msg, "%s", dt_last_error()); /* this thread's */
    C->tk_push = a;
    C->tk_pull = b;
    C->busy = 0;
    dt__cond_broadcast(&C->cv);
  }
  dt__mutex_unlock(&C->mu);
}

/* Step t's job: push its gradient (push, NULL: empty), pull clock t + 1 into dst. */
static void dt__ps_comm_post(dt__ps_comm *C, int64_t t, const float *push, float *dst, const dt_minibatch *b,
                             const dt__strategy_replica *R) {
  dt__mutex_lock(&C->mu);
  C->t = t;
  C->push = push;
  C->dst = dst;
  C->rows = b->rows;
  C->skipped = R->skipped;
  C->loss = R->loss;
  C->busy = 1;
  dt__cond_broadcast(&C->cv);
  dt__mutex_unlock(&C->mu);
}

/* Waits for the posted job and books it for replica r: its wait, the
 * buffers' places of the gradient it pushed zeroed again, its statistics.
 * 0 when it failed (the strategy's failure is set). */
static int dt__ps_comm_reap(dt_strategy *s, int r, dt__ps_comm *C) {
  dt__strategy_replica *R = &s->rep[r];
  double t0 = dt__now();
  dt__mutex_lock(&C->mu);
  while (C->busy) dt__cond_wait(&C->cv, &C->mu);
  dt__mutex_unlock(&C->mu); /* (the thread waits for the next post: C is this thread's now) */
  R->comm_s += dt__now() - t0;
  if (C->push) dt__strategy_bufs_zero(s, (float *)(uintptr_t)C->push);
  if (C->rc != DTRAIN_OK) {
    dt__error(C->rc, "%s", C->msg);
    dt__strategy_comm_failed(s, r, C->rc);
    return 0;
  }
  if (C->tk_pull.clock_gap > R->gap_max) R->gap_max = C->tk_pull.clock_gap;
  dt__strategy_async_count(s, r, C->rows, C->skipped, C->loss, &C->tk_push);
  return 1;
}

/* desc.push_early: the thread that sends the parts, and what backward made final (see the top). */
typedef struct dt__ps_early {
  dt_strategy *s;
  const int *owner;        /* parameter -> its server (the store's) */
  int np, M;
  size_t cap;              /* floats a part waits for (bucket_bytes) */
  unsigned char *ready;    /* per parameter: final this step (the compute thread's) */
  int *front;              /* per server: its parameters from this index on are all final (np: none yet) */
  size_t *acc;             /* per server: floats final since its last part was posted */
  int *want, *sent;        /* per server: a part posted from parameter want; sent from `sent` on (np: none) */
  int64_t clock;           /* this step's */
  const float *g, *d;      /* its gradient, its values (buffers) */
  dt__mutex mu;
  dt__cond cv;
  dt__thread th;
  int sync_ok, quit, busy;
  dt_result rc;            /* the first failure of this step's parts */
  char msg[DT__MSG_CAP];
} dt__ps_early;

static size_t dt__ps_early_ibytes(int n) { return (size_t)(n > 0 ? n : 1) * sizeof(int); }

/* The server with a part posted and not yet sent (-1: none). Under the mutex. */
static int dt__ps_early_posted(const dt__ps_early *E) {
  for (int k = 0; k < E->M; k++)
    if (E->want[k] < E->sent[k]) return k;
  return -1;
}

static void dt__ps_early_main(void *arg) {
  dt__ps_early *E = (dt__ps_early *)arg;
  dt__mutex_lock(&E->mu);
  for (;;) {
    int k = -1;
    while (!E->quit && (k = dt__ps_early_posted(E)) < 0) dt__cond_wait(&E->cv, &E->mu);
    if (k < 0) break; /* quit */
    int from = E->want[k];
    E->busy = 1;
    dt__mutex_unlock(&E->mu);
    dt_result rc = dt__ps_client_push_part(E->s->pstore, E->clock, k, from, E->g, E->d);
    dt__mutex_lock(&E->mu);
    E->busy = 0;
    E->sent[k] = from;
    if (rc != DTRAIN_OK && E->rc == DTRAIN_OK) {
      E->rc = rc;
      snprintf(E->msg, sizeof E->msg, "%s", dt_last_error()); /* this thread's */
    }
    dt__cond_broadcast(&E->cv);
  }
  dt__mutex_unlock(&E->mu);
}

/* Backward's announcement (the compute thread): parameter p is final. Its
 * server's final run grows down from the last parameter; a part is posted
 * once about cap floats of it wait. */
static void dt__ps_early_ready(void *user, int p) {
  dt__ps_early *E = (dt__ps_early *)user;
  if (p < 0 || p >= E->np || E->ready[p]) return;
  E->ready[p] = 1;
  const int k = E->owner[p];
  int q = E->front[k];
  size_t got = 0, b = 0, e = 0;
  int tr, dec;
  for (int i = q - 1; i >= 0; i--) {
    if (E->owner[i] != k) continue;
    if (!E->ready[i]) break;
    (void)dt__params_range(E->s->params, i, &b, &e, &tr, &dec);
    got += e - b;
    q = i;
  }
  if (q == E->front[k]) return;
  E->front[k] = q;
  E->acc[k] += got;
  if (E->acc[k] < E->cap) return;
  E->acc[k] = 0;
  dt__mutex_lock(&E->mu);
  E->want[k] = q;
  dt__cond_broadcast(&E->cv);
  dt__mutex_unlock(&E->mu);
}

/* Replica r's step begins: nothing final but the buffers; backward announces. */
static void dt__ps_early_begin(dt__ps_early *E, dt__strategy_replica *R) {
  size_t b, e;
  int tr, dec;
  for (int p = 0; p < E->np; p++) E->ready[p] = dt__params_range(E->s->params, p, &b, &e, &tr, &dec) && !tr;
  for (int k = 0; k < E->M; k++) E->front[k] = E->np, E->acc[k] = 0;
  dt__mutex_lock(&E->mu);
  for (int k = 0; k < E->M; k++) E->want[k] = E->sent[k] = E->np;
  E->clock = R->clock;
  E->g = R->grad;
  E->d = R->data;
  E->rc = DTRAIN_OK;
  dt__mutex_unlock(&E->mu);
  dt__graph_on_grad_ready(R->g, dt__ps_early_ready, E);
}

/* Backward is over: every part posted sent. Its first failure. */
static dt_result dt__ps_early_end(dt__ps_early *E, dt__strategy_replica *R) {
  dt__graph_on_grad_ready(R->g, NULL, NULL);
  dt__mutex_lock(&E->mu);
  while (E->busy || dt__ps_early_posted(E) >= 0) dt__cond_wait(&E->cv, &E->mu);
  dt_result rc = E->rc;
  dt__mutex_unlock(&E->mu);
  if (rc != DTRAIN_OK) dt__error(rc, "%s", E->msg);
  return rc;
}

static void dt__ps_early_destroy(dt_strategy *s, dt__ps_early *E) {
  if (E->th.started) {
    dt__mutex_lock(&E->mu);
    E->quit = 1;
    dt__cond_broadcast(&E->cv);
    dt__mutex_unlock(&E->mu);
    dt__thread_join(&E->th);
  }
  if (E->sync_ok) {
    dt__cond_destroy(&E->cv);
    dt__mutex_destroy(&E->mu);
  }
  dt__free(E->ready, (size_t)(E->np > 0 ? E->np : 1));
  dt__free(E->front, dt__ps_early_ibytes(E->M));
  dt__free(E->want, dt__ps_early_ibytes(E->M));
  dt__free(E->sent, dt__ps_early_ibytes(E->M));
  dt__free(E->acc, (size_t)(E->M > 0 ? E->M : 1) * sizeof(size_t));
  dt__free(E, sizeof *E);
  s->kind_state = NULL;
}

static dt_result dt__ps_early_create(dt_strategy *s) {
  const char *fn = "dt_strategy_create";
  const int *owner = NULL;
  int M = dt__ps_client_servers(s->pstore, &owner);
  if (M <= 0)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: parameter_server push_early needs a store over TCP "
                     "(dt_pstore_create_tcp), not the %s store", fn,
                     s->pstore->vtable && s->pstore->vtable->name ? s->pstore->vtable->name : "?");
  if (dt_optim_get_options(s->opt)->clip_norm > 0.0f)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: parameter_server push_early with clip_norm %g (clipping needs the "
                     "whole gradient's norm, and the parts leave before backward ends; clip_norm 0, or no "
                     "push_early)", fn, (double)dt_optim_get_options(s->opt)->clip_norm);
  dt__ps_early *E = (dt__ps_early *)dt__calloc(sizeof *E);
  if (!E) return dt__strategy_nomem(s);
  s->kind_state = E;
  E->s = s;
  E->owner = owner;
  E->M = M;
  E->np = dt_params_count(s->params);
  E->cap = (s->desc.bucket_bytes ? s->desc.bucket_bytes : (size_t)2 << 20) / sizeof(float);
  if (E->cap < 1) E->cap = 1;
  E->ready = (unsigned char *)dt__calloc((size_t)(E->np > 0 ? E->np : 1));
  E->front = (int *)dt__calloc(dt__ps_early_ibytes(M));
  E->want = (int *)dt__calloc(dt__ps_early_ibytes(M));
  E->sent = (int *)dt__calloc(dt__ps_early_ibytes(M));
  E->acc = (size_t *)dt__calloc((size_t)M * sizeof(size_t));
  if (!E->ready || !E->front || !E->want || !E->sent || !E->acc) return dt__strategy_nomem(s);
  for (int k = 0; k < M; k++) E->want[k] = E->sent[k] = E->np;
  if (dt__mutex_init(&E->mu) != DTRAIN_OK) return dt_last_result();
  if (dt__cond_init(&E->cv) != DTRAIN_OK) {
    dt__mutex_destroy(&E->mu);
    return dt_last_result();
  }
  E->sync_ok = 1;
  if (dt__thread_start(&E->th, dt__ps_early_main, E) != DTRAIN_OK)
    return dt__error(dt_last_result(), "%s: parameter_server push_early needs a thread to send the parts: %s", fn,
                     dt_last_error());
  return DTRAIN_OK;
}

static void dt__ps_destroy(dt_strategy *s) {
  if (s->kind_state && s->desc.push_early) {
    dt__ps_early_destroy(s, (dt__ps_early *)s->kind_state);
    return;
  }
  dt__ps_comm *C = (dt__ps_comm *)s->kind_state;
  if (!C) return;
  if (C->th.started) {
    dt__mutex_lock(&C->mu);
    C->quit = 1;
    dt__cond_broadcast(&C->cv);
    dt__mutex_unlock(&C->mu);
    dt__thread_join(&C->th);
  }
  if (C->sync_ok) {
    dt__cond_destroy(&C->cv);
    dt__mutex_destroy(&C->mu);
  }
  dt__free(C->data2, s->fbytes ? s->fbytes : sizeof(float));
  dt__free(C->grad2, s->fbytes ? s->fbytes : sizeof(float));
  dt__free(C, sizeof *C);
  s->kind_state = NULL;
}

static dt_result dt__ps_create(dt_strategy *s) {
  dt_pstore *st = s->desc.store;
  if (st->size != s->size)
    return dt__error(DTRAIN_ERR_SHAPE, "dt_strategy_create: the store holds %zu floats, the params %zu", st->size,
                     s->size);
  s->pstore = st; /* borrowed */
  st->compress = s->desc.compress; /* the store's pushes and pulls (dt_ps_codec.c) */
  if (s->desc.push_early) return dt__ps_early_create(s);
  if (!s->desc.overlap) return DTRAIN_OK;
  dt__ps_comm *C = (dt__ps_comm *)dt__calloc(sizeof *C);
  if (!C) return dt__strategy_nomem(s);
  s->kind_state = C;
  C->s = s;
  C->data2 = dt__strategy_floats(s, dt_params_data(s->params));
  C->grad2 = dt__strategy_floats(s, NULL);
  if (!C->data2 || !C->grad2) return dt__strategy_nomem(s);
  if (dt__mutex_init(&C->mu) != DTRAIN_OK) return dt_last_result();
  if (dt__cond_init(&C->cv) != DTRAIN_OK) {
    dt__mutex_destroy(&C->mu);
    return dt_last_result();
  }
  C->sync_ok = 1;
  if (dt__thread_start(&C->th, dt__ps_comm_main, C) != DTRAIN_OK)
    return dt__error(dt_last_result(), "dt_strategy_create: parameter_server overlap needs a communication thread: "
                     "%s", dt_last_error());
  return DTRAIN_OK;
}

/* Pulls go into the params' data; the push goes from the gradient buffer. */
static dt_result dt__ps_replica(dt_strategy *s, int r) { return dt__strategy_bind(s, r, 0, r > 0, NULL); }

/* Forward/backward, then the push vector: the replica's gradient buffer,
 * the clipped gradient (clip_norm of the optimizer given to
 * dt_strategy_create) with the buffers' values written into the buffers'
 * places (no gradient flows there; the replica loop zeroes them again after
 * the push: dt__strategy_bufs_zero). No copy of the whole vector. */
static int dt__ps_local_step(dt_strategy *s, int r, const dt_minibatch *b, const float **push) {
  dt__strategy_replica *R = &s->rep[r];
  dt__ps_early *E = s->desc.push_early ? (dt__ps_early *)s->kind_state : NULL;
  if (E) dt__ps_early_begin(E, R);
  int ok = dt__strategy_compute(s, r, b);
  if (E) { /* the parts posted are sent (their wait: communication) */
    double t0 = dt__now();
    dt_result rc = dt__ps_early_end(E, R);
    R->comm_s += dt__now() - t0;
    if (rc != DTRAIN_OK) {
      if (ok) dt__strategy_comm_failed(s, r, rc);
      return 0;
    }
  }
  if (!ok) return 0;
  *push = NULL;
  if (b->rows == 0 || R->skipped) return 1; /* an empty push: only the clock moves */
  if (!s->desc.check_numerics && !dt__strategy_own_grad_ok(s, r, b->step)) return R->skipped; /* compute checked */
  if (!dt__strategy_clip_own(s, r, dt_optim_get_options(s->opt)->clip_norm, "nothing pushed")) return 0;
  for (int i = 0; i < s->nbufr; i++)
    memcpy(R->grad + s->bufr[2 * i], R->data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  *push = R->grad;
  return 1;
}

/* The overlapped loop (desc.overlap, dt_strategy_run; see the top). Step t
 * computes on D[cur] (the last pull that arrived) into G[t & 1]; then the
 * job of step t - 1 is waited for (its pull of clock t arrived in the other
 * copy, which becomes cur) and step t's is posted: push G[t & 1], pull
 * clock t + 1 into the copy step t read. */
static void dt__ps_job_overlap(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  dt__ps_comm *C = (dt__ps_comm *)s->kind_state;
  float *D[2], *G[2];
  D[0] = R->data;
  D[1] = C->data2;
  G[0] = R->grad;
  G[1] = C->grad2;
  R->result = DTRAIN_OK;
  dt_pstore_ticket tk;
  memset(&tk, 0, sizeof tk);
  dt_result rc = dt_pstore_pull(s->pstore, r, 0, D[0], s->size, &tk);
  R->wait_s += tk.wait_s;
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    return;
  }
  if (tk.clock_gap > R->gap_max) R->gap_max = tk.clock_gap;
  int cur = 0, held = 0;
  for (int64_t t = 0;; t++) {
    dt_minibatch b;
    if (!dt__strategy_async_batch(s, r, t, &b)) break;
    R->data = D[cur];
    R->grad = G[t & 1];
    (void)dt_graph_bind(R->g, R->data, R->grad); /* (cannot fail: the graph has params and data is set) */
    const float *push = NULL;
    R->push_fill = 0;
    if (!s->mod->local_step(s, r, &b, &push)) break;
    if (held) {
      held = 0;
      if (!dt__ps_comm_reap(s, r, C)) {
        if (push) dt__strategy_bufs_zero(s, R->grad); /* this step's, not pushed */
        break;
      }
      cur ^= 1; /* the pull of clock t */
    }
    dt__ps_comm_post(C, t, push, D[cur ^ 1], &b, R);
    held = 1;
  }
  if (held && dt__ps_comm_reap(s, r, C)) cur ^= 1;
  if (cur != 0) memcpy(D[0], D[1], s->fbytes); /* the params hold the last pull */
  R->data = D[0];
  R->grad = G[0];
  (void)dt_graph_bind(R->g, R->data, R->grad);
}

/* A run overlaps (desc.overlap); a step (dt_strategy_step) has nothing to overlap with. */
static void dt__ps_job(dt_strategy *s, int r) {
  if (s->kind_state && s->desc.overlap && !s->batch) dt__ps_job_overlap(s, r);
  else dt__strategy_async_job(s, r);
}

static const dt__strategy_module dt__ps_module = {
  "parameter_server",
  0,                      /* flags: the async family */
  dt__ps_prepare,         /* prepare */
  NULL,                   /* check */
  dt__ps_create,          /* create: borrow the store; overlap's thread and copies */
  dt__ps_replica,         /* replica */
  NULL,                   /* start */
  dt__ps_job,             /* job: async's, or overlapped */
  dt__strategy_async_run, /* run */
  NULL,                   /* sync: the next pull brings the servers' values */
  NULL,                   /* loss: the shard's */
  dt__ps_local_step,      /* local_step */
  NULL,                   /* dev_exchange: no devices */
  dt__ps_destroy,         /* destroy: overlap's thread and copies (the store is the user's) */
  NULL                    /* after_job */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__ps_module, "parameter_server", 0);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_ps_module(void) { return &dt__ps_module; }
