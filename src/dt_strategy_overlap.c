/* ===========================================================================
 * dt_strategy_overlap.c -- gradients all-reduced in buckets while backward
 * goes on (multi_worker_mirrored, desc.overlap)
 * ===========================================================================
 * The flat gradient is cut into buckets of about desc.bucket_bytes, taken
 * from the end (the last layers' parameters, whose gradients backward makes
 * first): bucket 0 covers [cut[1], size), bucket 1 [cut[2], cut[1]), ...,
 * each a run of whole parameters with their padding and any buffers between
 * them. backward announces each parameter whose gradient is final
 * (dt__graph_on_grad_ready); when a bucket's last trained parameter is in, a
 * communication thread all-reduces that range of the buffer in place, in
 * bucket order (every rank issues the same collectives in the same order),
 * while backward computes the earlier layers. What no announcement reached
 * (unused parameters, a failed step) goes when backward is over.
 *
 * The communicator sums every element in rank order whatever the range, so
 * the result is bitwise the one all-reduce of the whole buffer. Buffers
 * (batch-norm statistics) are zero in the gradient and sum to zero here;
 * their values go with the bookkeeping after backward, as before.
 * check_numerics: the thread scans each bucket's local values before sending
 * them (afterwards they are sums) and keeps the first non-finite index.
 */
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST)

struct dt__overlap {
  dt_strategy *s;
  dt_comm *x;
  float *buf;
  int nb;                /* buckets */
  size_t *lo, *hi;       /* bucket b: [lo[b], hi[b]) */
  int *need, *left;      /* trained parameters per bucket: all, not yet final this step */
  int np;                /* parameters */
  int *pbucket;          /* parameter -> its bucket (-1: a buffer) */
  dt__mutex mu;
  dt__cond cv;
  dt__thread th;
  int started, quit;
  int64_t armed, served; /* steps begun, steps the thread has finished */
  int done;              /* backward is over: send the rest */
  dt_result rc;          /* the first failure of this step's all-reduces */
  char msg[DT__MSG_CAP]; /* its message (dt_last_error is the thread's own) */
  size_t bad;            /* check_numerics: the first non-finite local index (SIZE_MAX: none) */
  int bad_nan;
  uint64_t sent;
  int scan;
};

static size_t dt__ov_bytes(int nb) { return (size_t)(nb > 0 ? nb : 1) * sizeof(size_t); }
static size_t dt__ov_ibytes(int n) { return (size_t)(n > 0 ? n : 1) * sizeof(int); }

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
        float *p = o->buf + o->lo[b];
        size_t n = o->hi[b] - o->lo[b];
        if (o->scan) {
          size_t bad = dt__strategy_nonfinite(p, 0, n);
          if (bad < n && o->lo[b] + bad < o->bad) o->bad = o->lo[b] + bad, o->bad_nan = isnan(p[bad]) != 0;
        }
        /* summed in the floating-point mode of the plain path (a replica's
         * job: dt_set_flush_denormals), so the bits agree */
        unsigned long fp = dt__fp_enter();
        dt_result rc = dt_comm_allreduce(o->x, rank, p, n);
        dt__fp_leave(fp);
        o->sent += dt__ring_bytes(n, dt_comm_world(o->x));
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
  if (o->left[b] > 0 && --o->left[b] == 0) dt__cond_broadcast(&o->cv);
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
  dt__free(o, sizeof *o);
}

DTRAIN_PRIVATE dt_result dt__overlap_create(dt_strategy *s, dt_comm *x, float *buf, size_t bucket_bytes,
                                            dt__overlap **out) {
  *out = NULL;
  dt__overlap *o = (dt__overlap *)dt__calloc(sizeof *o);
  if (!o) return dt__error(DTRAIN_ERR_NOMEM, "overlap: out of memory");
  o->s = s, o->x = x, o->buf = buf;
  o->started = -1; /* nothing to destroy yet */
  o->np = dt_params_count(s->params);
  o->scan = s->desc.check_numerics != 0;
  size_t cap = bucket_bytes / sizeof(float);
  if (cap < 1) cap = 1;
  /* cut from the last parameter down: a bucket closes once it holds cap floats */
  int nb = 0;
  size_t end = s->size, acc = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1) {
      o->lo = (size_t *)dt__calloc(dt__ov_bytes(nb));
      o->hi = (size_t *)dt__calloc(dt__ov_bytes(nb));
      o->need = (int *)dt__calloc(dt__ov_ibytes(nb));
      o->left = (int *)dt__calloc(dt__ov_ibytes(nb));
      o->pbucket = (int *)dt__calloc(dt__ov_ibytes(o->np));
      o->nb = nb;
      if (!o->lo || !o->hi || !o->need || !o->left || !o->pbucket) {
        dt__overlap_destroy(o);
        return dt__error(DTRAIN_ERR_NOMEM, "overlap: out of memory for %d buckets", nb);
      }
    }
    nb = 0, end = s->size, acc = 0;
    for (int p = o->np - 1; p >= 0; p--) {
      size_t b = 0, e = 0;
      int tr = 0, dec = 0;
      if (!dt__params_range(s->params, p, &b, &e, &tr, &dec)) continue;
      acc += e - b;
      if (pass == 1) {
        o->pbucket[p] = tr ? nb : -1;
        o->need[nb] += tr ? 1 : 0;
      }
      if (acc >= cap || p == 0) { /* this bucket ends here, down to b (to 0 for the last one) */
        if (pass == 1) o->lo[nb] = p == 0 ? 0 : b, o->hi[nb] = end;
        end = p == 0 ? 0 : b;
        nb++;
        acc = 0;
      }
    }
    if (o->np == 0) nb = 0;
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

DTRAIN_PRIVATE void dt__overlap_begin(dt__overlap *o, dt_graph *g) {
  dt__mutex_lock(&o->mu);
  for (int b = 0; b < o->nb; b++) o->left[b] = o->need[b];
  o->done = 0;
  o->rc = DTRAIN_OK;
  o->bad = SIZE_MAX;
  o->bad_nan = 0;
  o->sent = 0;
  o->armed++;
  dt__cond_broadcast(&o->cv);
  dt__mutex_unlock(&o->mu);
  dt__graph_on_grad_ready(g, dt__ov_ready, o);
}

DTRAIN_PRIVATE const char *dt__overlap_error(const dt__overlap *o) { return o->msg; }

DTRAIN_PRIVATE dt_result dt__overlap_end(dt__overlap *o, dt_graph *g, size_t *bad, int *bad_nan, uint64_t *sent) {
  dt__graph_on_grad_ready(g, NULL, NULL);
  dt__mutex_lock(&o->mu);
  o->done = 1;
  dt__cond_broadcast(&o->cv);
  while (o->served != o->armed) dt__cond_wait(&o->cv, &o->mu);
  dt_result rc = o->rc;
  *bad = o->bad;
  *bad_nan = o->bad_nan;
  *sent += o->sent;
  dt__mutex_unlock(&o->mu);
  return rc;
}

#endif /* DTRAIN_NO_DIST */
