/* ===========================================================================
 * dt_strategy_mwm.c -- multi_worker_mirrored: lock-step data parallelism
 * across processes, hierarchical inside each
 * ===========================================================================
 * desc.comm connects the processes (one rank each: TCP, MPI); the process's
 * own replicas (threads) use the in-process communicator s->comm. A step
 * (dt__mwm_job, run by every local replica):
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
 * On devices (dt_strategy_device.c) the same exchange runs between the
 * all-reduce over the local devices and device 0's update (dt__mwm_dev_exchange).
 */
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST)

/* Floats after the gradient in the cross-process buffer:
 * [0, 1] global rows (hi + lo), [2, 3] loss sum (hi + lo),
 * [4] ranks that failed locally, [5] sum of (failed rank + 1), [6] ranks
 * whose failure was a non-finite loss or gradient (skip_nonfinite). */
#define DT__MWM_TAIL 8

/* The module's state (s->kind_state). */
typedef struct dt__mwm {
  float *buf;              /* replica 0's gradient + DT__MWM_TAIL floats: what crosses processes */
  size_t bytes;
  float *scratch, *side;   /* fp16/bf16: the ring's messages; compress or overlap: the tail and buffers */
  dt__ef *ef;              /* compress topk / powersgd: the compressor and its error feedback */
  size_t *blo, *bhi;       /* fp16/bf16 with desc.bucket_bytes, no overlap: the ring runs per bucket */
  int nbk;
  size_t scratch_n, side_n;
  double rows;             /* the global batch's rows (this step) */
  double loss;             /* the global batch's loss (this step) */
} dt__mwm;

static dt__mwm *dt__mwm_of(dt_strategy *s) { return (dt__mwm *)s->kind_state; }

#endif /* DTRAIN_NO_DIST */

/* An options struct is plain data: it stays in every build. */
DTRAIN_API dt_strategy_options dt_strategy_multi_worker_mirrored(dt_comm *comm, int replicas) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED, replicas, 0);
  d.comm = comm;
  return d;
}
/* Deprecated name, removed in the next release. */
DTRAIN_API dt_strategy_options dt_multi_worker_mirrored(dt_comm *comm, int replicas) {
  return dt_strategy_multi_worker_mirrored(comm, replicas);
}

#if !defined(DTRAIN_NO_DIST)

static dt_result dt__mwm_check(const dt_strategy_desc *d) {
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

/* A helper's failure (its message in dt_last_error) as dt_strategy_create's. */
static dt_result dt__mwm_create_error(dt_result rc) {
  if (rc == DTRAIN_OK) return rc;
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "%.250s", dt_last_error());
  return dt__error(rc, "dt_strategy_create: multi_worker_mirrored: %s", what);
}

/* The compressor over the trained parameters. */
static dt_result dt__mwm_ef_create(dt_strategy *s, dt__mwm *st) {
  return dt__mwm_create_error(dt__ef_create_params(s->desc.compress, s->params, dt_comm_world(s->desc.comm), &st->ef));
}

static dt_result dt__mwm_create(dt_strategy *s) {
  dt__mwm *st = (dt__mwm *)dt__calloc(sizeof *st);
  if (!st) return dt__strategy_nomem(s);
  s->kind_state = st;
  st->bytes = (s->size + DT__MWM_TAIL) * sizeof(float);
  st->buf = (float *)dt__calloc(st->bytes);
  if (!st->buf) return dt__strategy_nomem(s);
  dt_compress_kind ck = s->desc.compress.kind;
  if (ck != DTRAIN_COMPRESS_NONE || s->desc.overlap) { /* the tail and buffers go on their own */
    st->side_n = DT__MWM_TAIL;
    for (int i = 0; i < s->nbufr; i++) st->side_n += s->bufr[2 * i + 1] - s->bufr[2 * i];
    st->side = (float *)dt__calloc(st->side_n * sizeof(float));
    if (!st->side) return dt__strategy_nomem(s);
  }
  if (ck == DTRAIN_COMPRESS_FP16 || ck == DTRAIN_COMPRESS_BF16) { /* the 16-bit ring's messages */
    st->scratch_n = dt__compress_scratch(s->size, dt_comm_world(s->desc.comm));
    st->scratch = (float *)dt__calloc(st->scratch_n * sizeof(float));
    if (!st->scratch) return dt__strategy_nomem(s);
    if (s->desc.bucket_bytes && !s->desc.overlap) { /* the buckets overlap would sum, one after the other */
      st->nbk = dt__bucket_cuts(s->params, s->size, s->desc.bucket_bytes, NULL, NULL, NULL, NULL);
      st->blo = (size_t *)dt__calloc((size_t)(st->nbk > 0 ? st->nbk : 1) * sizeof(size_t));
      st->bhi = (size_t *)dt__calloc((size_t)(st->nbk > 0 ? st->nbk : 1) * sizeof(size_t));
      if (!st->blo || !st->bhi) return dt__strategy_nomem(s);
      dt__bucket_cuts(s->params, s->size, s->desc.bucket_bytes, st->blo, st->bhi, NULL, NULL);
    }
  }
  if (ck == DTRAIN_COMPRESS_TOPK || ck == DTRAIN_COMPRESS_POWERSGD) return dt__mwm_ef_create(s, st);
  return DTRAIN_OK;
}

static void dt__mwm_destroy(dt_strategy *s) {
  dt__mwm *st = dt__mwm_of(s);
  if (!st) return;
  dt__free(st->buf, st->bytes);
  dt__free(st->scratch, st->scratch_n * sizeof(float));
  dt__free(st->side, st->side_n * sizeof(float));
  dt__ef_destroy(st->ef);
  dt__free(st->blo, (size_t)(st->nbk > 0 ? st->nbk : 1) * sizeof(size_t));
  dt__free(st->bhi, (size_t)(st->nbk > 0 ? st->nbk : 1) * sizeof(size_t));
  dt__free(st, sizeof *st);
  s->kind_state = NULL;
}

/* The tail and the buffers' values between buf and side (in that order):
 * out != 0 copies them out of buf (zeroing the buffers there), else back in. */
static void dt__mwm_side(dt_strategy *s, float *buf, float *side, int out) {
  size_t k = DT__MWM_TAIL;
  if (out) memcpy(side, buf + s->size, DT__MWM_TAIL * sizeof(float));
  else memcpy(buf + s->size, side, DT__MWM_TAIL * sizeof(float));
  for (int i = 0; i < s->nbufr; i++) {
    size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
    if (out) {
      memcpy(side + k, buf + b, (e - b) * sizeof(float));
      memset(buf + b, 0, (e - b) * sizeof(float));
    } else {
      memcpy(buf + b, side + k, (e - b) * sizeof(float));
    }
    k += e - b;
  }
}

/* The gradient and the rest apart. compress: the gradient [0, size) in
 * 16-bit values, or top-k / PowerSGD over the trained parameters (buffers
 * zeroed there); overlap: nothing more (the buckets were summed during
 * backward). Then the tail and the buffers' values exactly, in one small
 * float all-reduce. */
static dt_result dt__mwm_allreduce_split(dt_strategy *s, dt_comm *x, int rank, float *buf) {
  dt__mwm *st = dt__mwm_of(s);
  dt__mwm_side(s, buf, st->side, 1);
  dt_result rc = DTRAIN_OK;
  if (s->ov) {
    /* summed during backward */
  } else if (st->ef) {
    rc = dt__ef_allreduce(st->ef, x, rank, buf, &s->wire_bytes);
  } else if (st->nbk > 0) { /* per bucket, in bucket order: as overlap would (the same bits) */
    for (int b = 0; b < st->nbk && rc == DTRAIN_OK; b++)
      rc = dt__compress_allreduce(x, rank, s->desc.compress.kind, buf + st->blo[b], st->bhi[b] - st->blo[b],
                                  st->scratch, &s->wire_bytes);
  } else {
    rc = dt__compress_allreduce(x, rank, s->desc.compress.kind, buf, s->size, st->scratch, &s->wire_bytes);
  }
  if (rc == DTRAIN_OK) rc = dt_comm_allreduce(x, rank, st->side, st->side_n);
  s->wire_bytes += dt__ring_bytes(st->side_n, x->world);
  if (rc != DTRAIN_OK) return rc;
  dt__mwm_side(s, buf, st->side, 0);
  return DTRAIN_OK;
}

/* As mirrored; replica 0's gradient is the head of the cross-process buffer. */
static dt_result dt__mwm_replica(dt_strategy *s, int r) {
  return dt__strategy_bind(s, r, r > 0 && !dt__strategy_shared(s), r > 0, r == 0 ? dt__mwm_of(s)->buf : NULL);
}

static dt_result dt__mwm_comm_error(dt_strategy *s, const char *fn, dt_result rc) {
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "%.300s", dt_last_error());
  return dt__error(rc, "%s: multi_worker_mirrored: initial broadcast from rank 0 (rank %d of %d): %s", fn,
                   dt_comm_rank(s->desc.comm), dt_comm_world(s->desc.comm), what);
}

/* Rank 0's parameters and buffers to every process (after checking that all
 * built the same model), then into every local replica. Collective: every
 * process calls it (dt_strategy_create, dt_strategy_sync). */
static dt_result dt__mwm_start(dt_strategy *s, const char *fn) {
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *pdata = dt_params_data(s->params);
  dt__ef_reset(dt__mwm_of(s)->ef); /* new parameters: the error of the old ones is no use */
  /* The model hash in 16-bit pieces (exact in floats), from rank 0. */
  uint64_t h = dt_params_hash(s->params), h0 = 0;
  float hb[4], flag[2];
  for (int i = 0; i < 4; i++) hb[i] = (float)((h >> (16 * i)) & 0xffffu);
  dt_result rc = dt_comm_broadcast(x, rank, hb, 4, 0);
  if (rc != DTRAIN_OK) return dt__mwm_comm_error(s, fn, rc);
  for (int i = 0; i < 4; i++) h0 |= (uint64_t)hb[i] << (16 * i);
  /* Everybody learns whether somebody differs (so that all fail alike). */
  flag[0] = h0 != h ? 1.0f : 0.0f;
  flag[1] = h0 != h ? (float)(rank + 1) : 0.0f;
  rc = dt_comm_allreduce(x, rank, flag, 2);
  if (rc != DTRAIN_OK) return dt__mwm_comm_error(s, fn, rc);
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
  if (rc != DTRAIN_OK) return dt__mwm_comm_error(s, fn, rc);
  if (s->dev) return dt__strategy_dev_upload(s, fn);
  for (int r = 1; r < s->n; r++)
    if (s->rep[r].data != pdata) memcpy(s->rep[r].data, pdata, s->fbytes);
  return DTRAIN_OK;
}

/* Replica 0's part: the one cross-process all-reduce of the buffer. ok: the
 * local part succeeded. Returns 1 when the step goes on (rows, loss set). */
static int dt__mwm_exchange(dt_strategy *s, int ok) {
  dt__mwm *st = dt__mwm_of(s);
  dt__strategy_replica *R = &s->rep[0];
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *buf = st->buf, *tail = buf + s->size; /* (replica 0's gradient on the CPU) */
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
    tail[6] = s->err == DTRAIN_ERR_NONFINITE ? 1.0f : 0.0f; /* the local failure, recorded before ok was 0 */
  }
  double t0 = dt__now();
  dt_result rc;
  if (s->desc.compress.kind != DTRAIN_COMPRESS_NONE || s->ov) {
    rc = dt__mwm_allreduce_split(s, x, rank, buf);
  } else {
    rc = dt_comm_allreduce(x, rank, buf, s->size + DT__MWM_TAIL);
    s->wire_bytes += dt__ring_bytes(s->size + DT__MWM_TAIL, x->world);
  }
  R->comm_s += dt__now() - t0;
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
  if (tail[4] > 0.5f && s->desc.skip_nonfinite && tail[6] > tail[4] - 0.5f) {
    /* every failing rank met a non-finite loss or gradient: all skip the step */
    snprintf(what, sizeof what, "step %lld: %s not finite on %s; no update made", (long long)s->batch->step,
             "the loss or gradient was", tail[4] < 1.5f ? "one rank" : "several ranks");
    dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
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
  st->rows = (double)tail[0] + (double)tail[1];
  if (st->rows == 0.0) { /* every rank's local batch was empty: nothing to train on (the same everywhere) */
    snprintf(what, sizeof what, "step %lld: the global batch has 0 rows (every rank's local batch is empty); "
             "no update made", (long long)s->batch->step);
    dt__strategy_fail(s, 0, DTRAIN_ERR_EMPTY, what);
    return 0;
  }
  dt__ef_commit(st->ef); /* the step goes on: its error feedback is kept */
  double L = (double)tail[2] + (double)tail[3];
  st->loss = s->desc.loss == DTRAIN_LOSS_SUM ? L : (st->rows > 0.0 ? L / st->rows : 0.0);
  return 1;
}

/* The global batch's loss, from the all-reduce (the same on every rank). */
static double dt__mwm_loss(dt_strategy *s, const dt_minibatch *gb) {
  (void)gb;
  return dt__mwm_of(s)->loss;
}

/* Copies the trainable elements of grad in [b, e) to dst (the params' grad). */
static void dt__mwm_copy_grad(dt_strategy *s, float *dst, const float *grad, size_t b, size_t e) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    if (lo < hi) memcpy(dst + lo, grad + lo, (hi - lo) * sizeof(float));
  }
}

static void dt__mwm_job(dt_strategy *s, int r) {
  dt__mwm *st = dt__mwm_of(s);
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_sync_shard(s, r, &b); /* row sums now; the division by the global rows comes after the all-reduce */
  double w0 = dt__strategy_comm_wait(s, r);
  int ok = s->ov ? dt__overlap_compute(s, r, &b) : dt__strategy_compute(s, r, &b);
  dt_result rc;
  float *grad = s->rep[0].grad;
  size_t lo, hi;
  if (ok && !s->ov) { /* (overlap: summed during backward) */
    rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  if (r == 0) ok = dt__mwm_exchange(s, ok);
  if (!ok) goto done;
  rc = dt_comm_barrier(s->comm, r); /* replica 0's all-reduce is done */
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  if (s->desc.loss == DTRAIN_LOSS_MEAN && st->rows > 0.0) dt__strategy_scale(s, grad, lo, hi, (float)(1.0 / st->rows));
  if (!dt__strategy_update_slice(s, r, R->data, grad, lo, hi, 0)) goto done;
  dt__mwm_copy_grad(s, dt_params_grad(s->params), grad, lo, hi);
  /* The buffers: rank 0 replica 0's, carried by the all-reduce; each replica
   * puts its slice of them into its copy, the all-gather spreads them. */
  dt__strategy_copy_buffers(s, R->data, grad, lo, hi);
  if (!dt__strategy_shared(s)) { /* (one shared copy: as in mirrored) */
    rc = dt_comm_allgather(s->comm, r, R->data, s->size);
    if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
  }
done:
  R->wait_s += dt__strategy_comm_wait(s, r) - w0;
}

/* Devices, replica 0 after the all-reduce over the local devices: device 0's
 * sum (and rank 0's buffers) -> host -> the exchange across processes ->
 * scaled by 1/global rows, checked -> device 0, which then updates. */
static int dt__mwm_dev_exchange(dt_strategy *s, int ok) {
  float *buf = dt__mwm_of(s)->buf;
  dt_result rc;
  if (ok) {
    rc = dt__strategy_dev_copy(s, 0, buf, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
    for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) {
      size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
      if (dt_comm_rank(s->desc.comm) == 0) rc = dt__strategy_dev_copy(s, 0, buf, s->ddata[0], b, e, DTRAIN_COPY_D2H);
      else memset(buf + b, 0, (e - b) * sizeof(float));
    }
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "local gradient to the host");
  }
  if (!dt__mwm_exchange(s, ok)) return 0;
  double rows = dt__mwm_of(s)->rows;
  if (s->desc.loss == DTRAIN_LOSS_MEAN && rows > 0.0) dt__strategy_scale(s, buf, 0, s->size, (float)(1.0 / rows));
  if (!dt__strategy_dev_checks(s, buf)) return 0;
  rc = dt__strategy_dev_copy(s, 0, s->dgrad[0], buf, 0, s->size, DTRAIN_COPY_H2D);
  for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) /* rank 0 replica 0's buffers */
    rc = dt__strategy_dev_copy(s, 0, s->ddata[0], buf, s->bufr[2 * i], s->bufr[2 * i + 1], DTRAIN_COPY_H2D);
  if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the device");
  return 1;
}

static const dt__strategy_module dt__mwm_module = {
  "multi_worker_mirrored",
  DT__STRATEGY_SYNC | DT__STRATEGY_DEVICES | DT__STRATEGY_ROW_SUMS,
  NULL,                 /* prepare */
  dt__mwm_check,        /* check: desc.comm */
  dt__mwm_create,       /* create: the cross-process buffer */
  dt__mwm_replica,      /* replica */
  dt__mwm_start,        /* start: rank 0's parameters everywhere */
  dt__mwm_job,          /* job */
  NULL,                 /* run: steps */
  dt__mwm_start,        /* sync: the same collective */
  dt__mwm_loss,         /* loss: the global batch's */
  NULL,                 /* local_step */
  dt__mwm_dev_exchange, /* dev_exchange */
  dt__mwm_destroy,      /* destroy */
  NULL                  /* after_job */
};

#else /* DTRAIN_NO_DIST: the kind keeps its name; dt_strategy_create says it is compiled out */
DT__STRATEGY_COMPILED_OUT(dt__mwm_module, "multi_worker_mirrored",
                          DT__STRATEGY_SYNC | DT__STRATEGY_DEVICES | DT__STRATEGY_ROW_SUMS);
#endif /* DTRAIN_NO_DIST */

DTRAIN_PRIVATE const dt__strategy_module *dt__strategy_mwm_module(void) { return &dt__mwm_module; }

#undef DT__MWM_TAIL
