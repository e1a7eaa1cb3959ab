/* ===========================================================================
 * dt_strategy_overlap.c -- gradients summed in buckets while backward goes
 * on (mirrored and multi_worker_mirrored, desc.overlap)
 * ===========================================================================
 * The flat gradient is cut into buckets of about desc.bucket_bytes, taken
 * from the end (the last layers' parameters, whose gradients backward makes
 * first): bucket 0 covers [cut[1], size), bucket 1 [cut[2], cut[1]), ...,
 * each a run of whole parameters with their padding and any buffers between
 * them. Each replica's backward announces each parameter whose gradient is
 * final (dt__graph_on_grad_ready); when every replica has announced a
 * bucket's last trained parameter, a communication thread sums that range
 * over the replicas into replica 0's gradient (rank order, as the
 * in-process communicator does) and, with a cross-process communicator,
 * all-reduces it there in place, in bucket order (every rank issues the same
 * collectives in the same order), while backward computes the earlier
 * layers. What no announcement reached (unused parameters, a failed step)
 * goes when every replica's backward is over.
 *
 * In one process (mirrored: no communicator across processes) there is no
 * thread (it would only take a core from the replicas): a replica whose
 * backward is over, if another's is not, sums the buckets completed by then
 * while the others still compute, time it would otherwise spend waiting. What is
 * left when every backward is over (the first layers' bucket, usually the
 * largest) is summed by all the replicas at once, each the part in its own
 * update slice, which is the part it reads next.
 *
 * Both sums add every element in rank order whatever the range, so the
 * result is bitwise the plain path's: the in-process reduction of whole
 * buffers, then the one all-reduce. Buffers (batch-norm statistics) are zero
 * in the gradient and sum to zero here; their values go with the
 * bookkeeping after backward, as before. check_numerics: whoever sums a
 * range scans replica 0's local values there first (afterwards they are
 * sums) and keeps the first non-finite index; the other replicas' gradients
 * are only read, and scanned by their own compute as before.
 */
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST)

struct dt__overlap {
  dt_strategy *s;
  dt_comm *x;            /* across processes (NULL: the local sum only) */
  int nrep;              /* the replicas whose gradients are summed */
  int nb;                /* buckets */
  size_t *lo, *hi;       /* bucket b: [lo[b], hi[b]) */
  int *need, *left;      /* trained parameters per bucket: all, not yet final this step */
  int np;                /* parameters */
  int *pbucket;          /* parameter -> its bucket (-1: a buffer) */
  int *state;            /* in one process: bucket incomplete (0), complete (1), taken to be summed (2) */
  dt__mutex mu;
  dt__cond cv;
  dt__thread th;
  int started, quit;
  int64_t armed, served; /* steps begun, steps the thread has finished */
  int ended;             /* replicas whose backward is over this step */
  int done;              /* every replica's backward is over: the rest goes */
  dt_result rc;          /* the first failure of this step's all-reduces */
  char msg[DT__MSG_CAP]; /* its message (dt_last_error is the thread's own) */
  size_t bad;            /* check_numerics: the first non-finite local index (SIZE_MAX: none) */
  int bad_nan;
  uint64_t sent;
  int scan;
  dt_compress_kind ck;   /* fp16 / bf16: each bucket summed by the 16-bit ring (none: floats) */
  float *scratch;        /* ... its messages */
  size_t scratch_n;
};

static size_t dt__ov_bytes(int nb) { return (size_t)(nb > 0 ? nb : 1) * sizeof(size_t); }
static size_t dt__ov_ibytes(int n) { return (size_t)(n > 0 ? n : 1) * sizeof(int); }

/* check_numerics: replica 0's local values in [lo, hi) scanned (into
 * *bad, the smallest index, and *bad_nan); then replica 0's [lo, hi) += the
 * other replicas', in rank order: the additions of the in-process
 * communicator's reduction, element by element. */
static void dt__ov_scan_sum(dt__overlap *o, size_t lo, size_t hi, size_t *bad, int *bad_nan) {
  float *a = o->s->rep[0].grad;
  if (o->scan && lo < hi) {
    size_t i = dt__strategy_nonfinite(a, lo, hi);
    if (i < hi && i < *bad) *bad = i, *bad_nan = isnan(a[i]) != 0;
  }
  for (int r = 1; r < o->nrep && lo < hi; r++) dt__vec_add(a + lo, a + lo, o->s->rep[r].grad + lo, hi - lo);
}

/* The first non-finite value found so far: the smallest index. Under the mutex. */
static void dt__ov_merge_bad(dt__overlap *o, size_t bad, int bad_nan) {
  if (bad < o->bad) o->bad = bad, o->bad_nan = bad_nan;
}

static void dt__ov_thread(void *arg) {
  dt__overlap *o = (dt__overlap *)arg;
  const int rank = dt_comm_rank(o->x);
  dt__mutex_lock(&o->mu);
  for (;;) {
    while (!o->quit && o->armed == o->served) dt__cond_wait(&o->cv, &o->mu);
    if (o->quit) break;
    for (int b = 0; b < o->nb; b++) {
      while (!o->done && o->left[b] > 0) dt__cond_wait(&o->cv, &o->mu);
      int go = o->rc == DTRAIN_OK;
      dt__mutex_unlock(&o->mu);
      if (go) {
        size_t lo = o->lo[b], n = o->hi[b] - o->lo[b], bad = SIZE_MAX;
        int bad_nan = 0;
        /* summed in the floating-point mode of the plain path (a replica's
         * job: dt_set_flush_denormals), so the bits agree */
        unsigned long fp = dt__fp_enter();
        dt__ov_scan_sum(o, lo, lo + n, &bad, &bad_nan);
        dt_result rc;
        if (o->ck != DTRAIN_COMPRESS_NONE) { /* as the plain path sums the same bucket */
          rc = dt__compress_allreduce(o->x, rank, o->ck, o->s->rep[0].grad + lo, n, o->scratch, &o->sent);
        } else {
          rc = dt_comm_allreduce(o->x, rank, o->s->rep[0].grad + lo, n);
          o->sent += dt__ring_bytes(n, dt_comm_world(o->x));
        }
        dt__fp_leave(fp);
        if (bad != SIZE_MAX) {
          dt__mutex_lock(&o->mu);
          dt__ov_merge_bad(o, bad, bad_nan);
          dt__mutex_unlock(&o->mu);
        }
        if (rc != DTRAIN_OK) {
          dt__mutex_lock(&o->mu);
          o->rc = rc;
          snprintf(o->msg, sizeof o->msg, "%s", rc == DTRAIN_ERR_ABORTED ? "" : dt_last_error());
          dt__mutex_unlock(&o->mu);
        }
      }
      dt__mutex_lock(&o->mu);
    }
    o->served = o->armed;
    dt__cond_broadcast(&o->cv);
  }
  dt__mutex_unlock(&o->mu);
}

/* backward's announcement: parameter p's gradient is final. */
static void dt__ov_ready(void *user, int p) {
  dt__overlap *o = (dt__overlap *)user;
  if (p < 0 || p >= o->np || o->pbucket[p] < 0) return;
  dt__mutex_lock(&o->mu);
  int b = o->pbucket[p];
  if (o->left[b] > 0 && --o->left[b] == 0) {
    if (o->x) dt__cond_broadcast(&o->cv); /* the thread's */
    else o->state[b] = 1;                 /* for the first replica to end */
  }
  dt__mutex_unlock(&o->mu);
}

DTRAIN_PRIVATE void dt__overlap_destroy(dt__overlap *o) {
  if (!o) return;
  if (o->started) {
    dt__mutex_lock(&o->mu);
    o->quit = 1;
    dt__cond_broadcast(&o->cv);
    dt__mutex_unlock(&o->mu);
    dt__thread_join(&o->th);
  }
  if (o->started >= 0) { /* the mutex and condition were made */
    dt__cond_destroy(&o->cv);
    dt__mutex_destroy(&o->mu);
  }
  dt__free(o->lo, dt__ov_bytes(o->nb));
  dt__free(o->hi, dt__ov_bytes(o->nb));
  dt__free(o->need, dt__ov_ibytes(o->nb));
  dt__free(o->left, dt__ov_ibytes(o->nb));
  dt__free(o->pbucket, dt__ov_ibytes(o->np));
  dt__free(o->scratch, o->scratch_n * sizeof(float));
  dt__free(o->state, dt__ov_ibytes(o->nb));
  dt__free(o, sizeof *o);
}

DTRAIN_PRIVATE int dt__bucket_cuts(const dt_params *P, size_t size, size_t bucket_bytes, size_t *lo, size_t *hi,
                                   int *pbucket, int *need) {
  size_t cap = bucket_bytes / sizeof(float), end = size, acc = 0;
  int np = dt_params_count(P), nb = 0;
  if (cap < 1) cap = 1;
  /* cut from the last parameter down: a bucket closes once it holds cap floats */
  for (int p = np - 1; p >= 0; p--) {
    size_t b = 0, e = 0;
    int tr = 0, dec = 0;
    if (!dt__params_range(P, p, &b, &e, &tr, &dec)) continue;
    acc += e - b;
    if (pbucket) pbucket[p] = tr ? nb : -1;
    if (need) need[nb] += tr ? 1 : 0;
    if (acc >= cap || p == 0) { /* this bucket ends here, down to b (to 0 for the last one) */
      if (lo) lo[nb] = p == 0 ? 0 : b;
      if (hi) hi[nb] = end;
      end = p == 0 ? 0 : b;
      nb++;
      acc = 0;
    }
  }
  return np == 0 ? 0 : nb;
}

DTRAIN_PRIVATE dt_result dt__overlap_create(dt_strategy *s, dt_comm *x, size_t bucket_bytes, dt__overlap **out) {
  *out = NULL;
  dt__overlap *o = (dt__overlap *)dt__calloc(sizeof *o);
  if (!o) return dt__error(DTRAIN_ERR_NOMEM, "overlap: out of memory");
  o->s = s, o->x = x, o->nrep = s->n;
  o->started = -1; /* nothing to destroy yet */
  o->np = dt_params_count(s->params);
  o->scan = s->desc.check_numerics != 0;
  int nb = dt__bucket_cuts(s->params, s->size, bucket_bytes, NULL, NULL, NULL, NULL);
  o->lo = (size_t *)dt__calloc(dt__ov_bytes(nb));
  o->hi = (size_t *)dt__calloc(dt__ov_bytes(nb));
  o->need = (int *)dt__calloc(dt__ov_ibytes(nb));
  o->left = (int *)dt__calloc(dt__ov_ibytes(nb));
  o->pbucket = (int *)dt__calloc(dt__ov_ibytes(o->np));
  o->state = (int *)dt__calloc(dt__ov_ibytes(nb));
  o->nb = nb;
  if (!o->lo || !o->hi || !o->need || !o->left || !o->pbucket || !o->state) {
    dt__overlap_destroy(o);
    return dt__error(DTRAIN_ERR_NOMEM, "overlap: out of memory for %d buckets", nb);
  }
  dt__bucket_cuts(s->params, s->size, bucket_bytes, o->lo, o->hi, o->pbucket, o->need);
  dt_compress_kind ck = s->desc.compress.kind;
  if (x && (ck == DTRAIN_COMPRESS_FP16 || ck == DTRAIN_COMPRESS_BF16)) {
    size_t most = 0;
    for (int b = 0; b < nb; b++) most = DT__MAX(most, o->hi[b] - o->lo[b]);
    o->ck = ck;
    o->scratch_n = dt__compress_scratch(most, dt_comm_world(x));
    if (!(o->scratch = (float *)dt__calloc(o->scratch_n * sizeof(float)))) {
      dt__overlap_destroy(o);
      return dt__error(DTRAIN_ERR_NOMEM, "overlap: out of memory for the 16-bit messages");
    }
  }
  dt_result rc = dt__mutex_init(&o->mu);
  if (rc == DTRAIN_OK) {
    rc = dt__cond_init(&o->cv);
    if (rc != DTRAIN_OK) dt__mutex_destroy(&o->mu);
  }
  if (rc != DTRAIN_OK) {
    dt__overlap_destroy(o);
    return dt__error(rc, "overlap: mutex or condition variable: %s", dt_last_error());
  }
  o->started = 0;
  o->bad = SIZE_MAX;
  if (!x) { /* in one process: the replicas sum */
    *out = o;
    return DTRAIN_OK;
  }
  rc = dt__thread_start(&o->th, dt__ov_thread, o);
  if (rc != DTRAIN_OK) {
    dt__overlap_destroy(o);
    return dt__error(rc, "overlap: the communication thread did not start (it needs threads)");
  }
  o->started = 1;
  *out = o;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__overlap_buckets(const dt__overlap *o) { return o ? o->nb : 0; }

/* The driver, before the replicas' jobs: a step begins. */
DTRAIN_PRIVATE void dt__overlap_arm(dt__overlap *o) {
  dt__mutex_lock(&o->mu);
  for (int b = 0; b < o->nb; b++) o->left[b] = o->need[b] * o->nrep, o->state[b] = 0;
  o->ended = 0;
  o->done = 0;
  o->rc = DTRAIN_OK;
  o->bad = SIZE_MAX;
  o->bad_nan = 0;
  o->sent = 0;
  o->armed++;
  dt__cond_broadcast(&o->cv);
  dt__mutex_unlock(&o->mu);
}

/* In one process, replica r once its backward is over: first, unless it is
 * the last, the buckets completed meanwhile and not yet taken (what the
 * others' backward completed while they still compute: it would wait for
 * them anyway); then, when every backward is over (the replicas'
 * barrier, which spins a while before it sleeps, as the plain path's
 * reduce-scatter does), the buckets left, each replica the part in its own
 * update slice. check_numerics: a second barrier, so that all see the same
 * verdict. */
static dt_result dt__ov_end_slices(dt__overlap *o, int r) {
  size_t bad = SIZE_MAX;
  int bad_nan = 0;
  dt__mutex_lock(&o->mu);
  int early = ++o->ended < o->nrep; /* the last to end sums nothing alone: all are ready to share */
  dt__mutex_unlock(&o->mu);
  for (int b = 0; early && b < o->nb; b++) {
    dt__mutex_lock(&o->mu);
    int mine = o->state[b] == 1;
    if (mine) o->state[b] = 2;
    dt__mutex_unlock(&o->mu);
    if (mine) dt__ov_scan_sum(o, o->lo[b], o->hi[b], &bad, &bad_nan);
  }
  dt_comm *c = o->s->comm;
  dt_result rc = dt_comm_barrier(c, r);
  if (rc != DTRAIN_OK) return rc; /* aborted: a replica failed (its error says why) */
  size_t slo, shi;
  dt_comm_slice(o->s->size, o->nrep, r, &slo, &shi);
  for (int b = 0; b < o->nb; b++) {
    if (o->state[b] == 2) continue; /* (no writer now: every backward is over) */
    size_t lo = DT__MAX(o->lo[b], slo), hi = DT__MIN(o->hi[b], shi);
    if (lo < hi) dt__ov_scan_sum(o, lo, hi, &bad, &bad_nan);
  }
  if (!o->scan) return DTRAIN_OK;
  dt__mutex_lock(&o->mu);
  dt__ov_merge_bad(o, bad, bad_nan);
  dt__mutex_unlock(&o->mu);
  return dt_comm_barrier(c, r);
}

/* Every replica r, after its compute (or its failure): once all have come
 * the rest goes; returns when every bucket is summed (across processes) or
 * when the part in r's update slice is (in one process), with the first
 * failure. *bad: the first non-finite local value's index in replica 0's
 * gradient (check_numerics; SIZE_MAX: none), *bad_nan whether it was a NaN;
 * *sent += the bytes sent (NULL: not wanted). */
static dt_result dt__overlap_end(dt__overlap *o, int r, dt_graph *g, size_t *bad, int *bad_nan, uint64_t *sent) {
  dt__graph_on_grad_ready(g, NULL, NULL);
  dt_result rc = o->x ? DTRAIN_OK : dt__ov_end_slices(o, r);
  dt__mutex_lock(&o->mu);
  if (o->x) {
    if (++o->ended == o->nrep) {
      o->done = 1;
      dt__cond_broadcast(&o->cv);
    }
    /* every replica's end too, not only the sums: the buckets may all be in
     * while a replica still checks its gradient or records its loss */
    while (o->served != o->armed || o->ended < o->nrep) dt__cond_wait(&o->cv, &o->mu);
    rc = o->rc;
  }
  *bad = o->bad;
  *bad_nan = o->bad_nan;
  if (sent) *sent += o->sent;
  dt__mutex_unlock(&o->mu);
  return rc;
}

DTRAIN_PRIVATE int dt__overlap_compute(dt_strategy *s, int r, const dt_minibatch *b) {
  dt__overlap *o = s->ov;
  dt__strategy_replica *R = &s->rep[r];
  dt__graph_on_grad_ready(R->g, dt__ov_ready, o);
  int ok = dt__strategy_compute(s, r, b);
  double t0 = dt__now();
  size_t bad = SIZE_MAX;
  int bad_nan = 0;
  dt_result rc = dt__overlap_end(o, r, R->g, &bad, &bad_nan, r == 0 ? &s->wire_bytes : NULL);
  if (o->x) R->comm_s += dt__now() - t0; /* (in one process the replicas' barrier counts itself, in wait_s) */
  if (rc != DTRAIN_OK) {
    if (!o->x) { /* the replicas' barrier broke: a replica failed */
      dt__strategy_comm_failed(s, r, rc);
    } else if (r == 0 && ok) { /* replica 0 reports the all-reduces' failure */
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "cross-process all-reduce (rank %d of %d, during backward): %.250s",
               dt_comm_rank(o->x), o->x->world,
               rc == DTRAIN_ERR_ABORTED ? "the communicator was broken by an earlier failure (see that error); "
                                          "recreate it (and the strategy) to go on"
                                        : o->msg);
      dt__strategy_fail(s, 0, rc, what);
    }
    return 0;
  }
  if (bad != SIZE_MAX) { /* replica 0's local values, scanned before their sum: every replica knows */
    if (ok && r == 0) (void)dt__strategy_grad_bad(s, 0, b->step, bad, bad_nan);
    return 0;
  }
  /* every replica has ended: a failure of any is recorded by now (across
   * processes replica 0 then sends the failure flag, so that the other
   * processes fail the step too) */
  return ok && !dt__strategy_failed(s);
}

#endif /* DTRAIN_NO_DIST */
