/* ===========================================================================
 * dt_strategy_backup.c -- backup workers for mirrored (Chen et al., 2016,
 * "Revisiting distributed synchronous SGD"): each step aggregates the first
 * N-B replica gradients to arrive and drops the rest
 * ===========================================================================
 * dt_strategy_run of mirrored with desc.backup_workers = B > 0. The
 * replicas run free, as async's do, against one centre: the params' own
 * buffer, which only the replica that closes a step writes. Replica r loops:
 *
 *   under the lock: the open step t, the next ticket k, and the centre
 *   copied into r's own buffer; its batch next(user, r, k) (as async's
 *   replicas get theirs); forward and backward into its own gradient; then
 *   under the lock again:
 *     step t still open with fewer than N-B gradients: r's joins. The
 *       (N-B)-th closes the step, and the N-B contributors do the close
 *       together, a slice of the parameters each (as mirrored's replicas
 *       do theirs): the joined gradients averaged weighted by their rows
 *       (MEAN; SUM: summed), in rank order, so that the result does not
 *       depend on who came first, and checked; once all have checked, the
 *       clipping (the norm from every slice's sum of squares) and the
 *       optimizer's update of the centre, buffers (batch-norm statistics)
 *       from the lowest-ranked contributor; the last one done advances t and
 *       wakes everybody. Nobody copies the centre while a close runs.
 *     step t closed already: r's gradient is dropped (dt_replica_stats
 *       .dropped) and r goes on at once with the step now open. Its ticket
 *       is handed out again, to another replica (the straggler would be
 *       late again), so the rows of a dropped gradient are trained on later
 *       instead of never: a straggler's data is not lost with its time.
 *
 * A straggler therefore never holds a step; the averaging counts only the
 * rows that were aggregated (the "corrected" average); with B = 0 this would
 * be plain synchronous SGD. The step's loss is the same weighted mean over
 * the contributors. A replica that fails wakes the others, who stop.
 */
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST)

struct dt__backup {
  dt__mutex mu;
  dt__cond cv;
  int64_t step;        /* the open step, counted from the start of the job */
  int64_t end;         /* the job's steps */
  int need;            /* N - B gradients close a step */
  int joined;          /* gradients in the open step */
  unsigned char *in;   /* in[r]: replica r's gradient is in the open step */
  int64_t tickets;     /* handed out in this job */
  int64_t *redo;       /* tickets whose gradients were dropped, to be handed out again ... */
  int *redo_by;        /* ... to another replica than the one that dropped it */
  int nredo;
  float *acc;          /* the averaged gradient of the step being closed */
  /* the close of a step, by its N-B contributors in parallel (one slice each): phase 1 averages
     and checks, phase 2 (once everybody checked) clips and updates */
  int closing, phase, arrived, ok, first;
  float *w;            /* each contributor's weight */
  int64_t crows;       /* rows of the step */
  double closs, ss;    /* its loss; the sum of squares of the average (clipping) */
  size_t bad;          /* the first non-finite element of the average, or size */
  /* the job's totals */
  int64_t rows, skipped, loss_count;
  double loss_sum;
  float last_loss;
};

DTRAIN_PRIVATE dt_result dt__strategy_backup_create(dt_strategy *s) {
  dt__backup *bk = (dt__backup *)dt__calloc(sizeof *bk);
  if (!bk) return dt__strategy_nomem(s);
  s->backup = bk;
  bk->in = (unsigned char *)dt__calloc((size_t)s->n);
  bk->redo = (int64_t *)dt__calloc((size_t)s->n * sizeof(int64_t));
  bk->redo_by = (int *)dt__calloc((size_t)s->n * sizeof(int));
  bk->w = (float *)dt__calloc((size_t)s->n * sizeof(float));
  bk->acc = dt__strategy_floats(s, NULL);
  if (!bk->in || !bk->redo || !bk->redo_by || !bk->w || !bk->acc) return dt__strategy_nomem(s);
  if (dt__mutex_init(&bk->mu) != DTRAIN_OK) return dt_last_result();
  if (dt__cond_init(&bk->cv) != DTRAIN_OK) {
    dt__mutex_destroy(&bk->mu);
    return dt_last_result();
  }
  bk->need = s->n - s->desc.backup_workers;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__strategy_backup_destroy(dt_strategy *s) {
  dt__backup *bk = s->backup;
  if (!bk) return;
  if (bk->need > 0) { /* set once the mutex and the condition were made */
    dt__cond_destroy(&bk->cv);
    dt__mutex_destroy(&bk->mu);
  }
  dt__free(bk->in, (size_t)s->n);
  dt__free(bk->redo, (size_t)s->n * sizeof(int64_t));
  dt__free(bk->redo_by, (size_t)s->n * sizeof(int));
  dt__free(bk->w, (size_t)s->n * sizeof(float));
  dt__free(bk->acc, s->fbytes ? s->fbytes : sizeof(float));
  dt__free(bk, sizeof *bk);
  s->backup = NULL;
}

/* Under the lock, by the replica whose gradient completed the step: the
 * close begins (weights, rows, loss); every contributor then does its part. */
static void dt__backup_open(dt_strategy *s, dt__backup *bk) {
  const int sum = s->desc.loss == DTRAIN_LOSS_SUM;
  int64_t rows = 0;
  bk->first = -1;
  for (int j = 0; j < s->n; j++)
    if (bk->in[j]) {
      rows += s->rep[j].rows;
      if (bk->first < 0) bk->first = j;
    }
  double loss = 0.0;
  for (int j = 0; j < s->n; j++) {
    bk->w[j] = !bk->in[j] ? 0.0f : sum ? 1.0f : rows > 0 ? (float)((double)s->rep[j].rows / (double)rows) : 0.0f;
    if (bk->in[j]) loss += (double)bk->w[j] * (double)s->rep[j].loss;
  }
  bk->crows = rows;
  bk->closs = loss;
  bk->closing = 1;
  bk->phase = 1;
  bk->arrived = 0;
  bk->ss = 0.0;
  bk->bad = s->size;
  bk->ok = 1;
}

/* Under the lock, by the last contributor to finish phase 1: is the average
 * finite (and its norm)? Fails the run, or skips the step (skip_nonfinite). */
static void dt__backup_decide(dt_strategy *s, dt__backup *bk, int r) {
  char what[DT__MSG_CAP];
  int64_t step = s->steps + bk->step;
  float clip = dt_optim_get_options(s->opt)->clip_norm;
  if (bk->crows == 0) {
    bk->ok = 0; /* no rows: nothing to train on, no update */
    return;
  }
  if (bk->bad < s->size) {
    snprintf(what, sizeof what, "step %lld: averaged gradient of '%s' is %s at flat index %zu; no update made",
             (long long)step, dt__strategy_param_at(s, bk->bad), isnan(bk->acc[bk->bad]) ? "NaN" : "Inf", bk->bad);
  } else if (clip > 0.0f && !isfinite(sqrt(bk->ss))) {
    snprintf(what, sizeof what, "step %lld: gradient norm is %s; no update made", (long long)step,
             isnan(bk->ss) ? "NaN" : "Inf");
  } else {
    return;
  }
  bk->ok = 0;
  bk->crows = 0; /* nothing trained on */
  if (!s->desc.skip_nonfinite) {
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return;
  }
  dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_NONFINITE, "dt_strategy_run: skipped: %s", what);
  bk->skipped++;
}

/* Contributor r's part of the close of step t: entered and left under the
 * lock. Its slice of the average (and the checks), then, once every
 * contributor has checked, the clipping and the optimizer's update of its
 * slice of the centre; the last one out advances the step. */
static void dt__backup_part(dt_strategy *s, dt__backup *bk, int r, int64_t t) {
  int k = 0;
  for (int j = 0; j < r; j++) k += bk->in[j];
  size_t lo, hi;
  dt_comm_slice(s->size, bk->need, k, &lo, &hi);
  float *acc = bk->acc, *P = dt_params_data(s->params);
  float clip = dt_optim_get_options(s->opt)->clip_norm;
  dt__mutex_unlock(&bk->mu);
  /* phase 1: the weighted sum over the contributors, in rank order */
  memset(acc + lo, 0, (hi - lo) * sizeof(float));
  for (int j = 0; j < s->n; j++) {
    if (!bk->in[j]) continue;
    const float *g = s->rep[j].grad, wj = bk->w[j];
    for (size_t i = lo; i < hi; i++) acc[i] += wj * g[i];
  }
  size_t bad = s->desc.check_numerics ? dt__strategy_nonfinite(acc, lo, hi)
                                      : dt__strategy_nonfinite_trainable(s, acc, lo, hi);
  double part = clip > 0.0f && bad == hi ? dt__strategy_sumsq(s, acc, lo, hi) : 0.0;
  dt__mutex_lock(&bk->mu);
  bk->ss += part;
  if (bad < hi && bad < bk->bad) bk->bad = bad;
  if (++bk->arrived == bk->need) {
    dt__backup_decide(s, bk, r);
    bk->phase = 2;
    bk->arrived = 0;
    dt__cond_broadcast(&bk->cv);
  } else {
    while (bk->phase == 1 && !dt__strategy_failed(s)) dt__cond_wait(&bk->cv, &bk->mu);
  }
  if (dt__strategy_failed(s)) return;
  int ok = bk->ok;
  double norm = sqrt(bk->ss);
  dt__mutex_unlock(&bk->mu);
  /* phase 2: clipping and the update of this slice */
  dt_result rc = DTRAIN_OK;
  if (ok) {
    if (clip > 0.0f) (void)dt__strategy_clip_scale(s, acc, lo, hi, norm, clip); /* the norm is finite */
    rc = dt_optim_update(s->opt, P, acc, lo, hi);
    if (rc == DTRAIN_OK) dt__strategy_copy_buffers(s, P, s->rep[bk->first].data, lo, hi);
    else dt__strategy_fail(s, r, rc, dt_last_error());
  }
  dt__mutex_lock(&bk->mu);
  if (++bk->arrived == bk->need) {
    if (ok && !dt__strategy_failed(s)) {
      dt_optim_advance(s->opt);
      bk->loss_sum += bk->closs;
      bk->loss_count++;
      bk->last_loss = (float)bk->closs;
    }
    bk->rows += bk->crows;
    bk->step++;
    bk->joined = 0;
    bk->closing = 0;
    bk->phase = 0;
    memset(bk->in, 0, (size_t)s->n);
    dt__cond_broadcast(&bk->cv);
  } else {
    while (bk->step == t && !dt__strategy_failed(s)) dt__cond_wait(&bk->cv, &bk->mu);
  }
}

/* Replica r stops after a failure of its own: the others must not wait for it. */
static void dt__backup_wake(dt__backup *bk) {
  dt__mutex_lock(&bk->mu);
  dt__cond_broadcast(&bk->cv);
  dt__mutex_unlock(&bk->mu);
}

/* Under the lock: replica r's next ticket, a dropped one of another replica's first. */
static int64_t dt__backup_ticket(dt__backup *bk, int r) {
  for (int i = 0; i < bk->nredo; i++) {
    if (bk->redo_by[i] == r) continue;
    int64_t t = bk->redo[i];
    bk->nredo--;
    bk->redo[i] = bk->redo[bk->nredo];
    bk->redo_by[i] = bk->redo_by[bk->nredo];
    return t;
  }
  return bk->tickets++;
}

static void dt__backup_job(dt_strategy *s, int r) {
  dt__backup *bk = s->backup;
  dt__strategy_replica *R = &s->rep[r];
  const float *P = dt_params_data(s->params);
  R->result = DTRAIN_OK;
  char what[DT__MSG_CAP];
  for (;;) {
    dt__mutex_lock(&bk->mu);
    while (bk->closing && !dt__strategy_failed(s)) dt__cond_wait(&bk->cv, &bk->mu); /* the centre is being updated */
    int64_t t = bk->step;
    int stop = dt__strategy_failed(s) || t >= bk->end;
    int64_t own = 0;
    if (!stop) {
      own = dt__backup_ticket(bk, r);
      memcpy(R->data, P, s->fbytes);
    }
    dt__mutex_unlock(&bk->mu);
    if (stop) break;
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    int64_t ticket = s->ticket_base + own;
    dt_result rc = s->next(s->next_user, r, ticket, &b);
    if (rc == DTRAIN_OK) rc = dt__strategy_check_batch(&b, "dt_strategy_run");
    if (rc != DTRAIN_OK) {
      snprintf(what, sizeof what, "the batch function failed for step %lld (ticket %lld, %s)",
               (long long)(s->steps + t), (long long)ticket, dt_result_name(rc));
      dt__strategy_fail(s, r, rc, what);
      dt__backup_wake(bk);
      break;
    }
    b.first = 0;
    b.global_rows = b.rows;
    b.step = s->steps + t;
    b.replica_step = t;
    b.weight = 1.0f; /* its own mean (or sum): the close weights the contributions */
    if (!dt__strategy_compute(s, r, &b)) {
      dt__backup_wake(bk);
      break;
    }
    R->rows = b.rows;
    R->samples += b.rows;
    double w0 = dt__now();
    dt__mutex_lock(&bk->mu);
    if (R->skipped) { /* skip_nonfinite: a non-finite loss or gradient of its own stays out */
      R->skips++;
    } else if (bk->step == t && bk->joined < bk->need && !dt__strategy_failed(s)) {
      bk->in[r] = 1;
      bk->joined++;
      R->steps++;
      if (R->rows > 0) {
        R->loss_sum += R->loss;
        R->loss_count++;
        R->last_loss = R->loss;
      }
      if (bk->joined == bk->need) {
        dt__backup_open(s, bk);
        dt__cond_broadcast(&bk->cv);
      } else {
        while (bk->step == t && !bk->closing && !dt__strategy_failed(s)) dt__cond_wait(&bk->cv, &bk->mu);
      }
      if (bk->step == t && bk->closing && !dt__strategy_failed(s)) dt__backup_part(s, bk, r, t);
    } else {
      R->dropped++;
      if (bk->step < bk->end && bk->nredo < s->n) { /* its rows are not lost: another replica takes them */
        bk->redo[bk->nredo] = own;
        bk->redo_by[bk->nredo++] = r;
      }
    }
    dt__mutex_unlock(&bk->mu);
    R->wait_s += dt__now() - w0;
    dt__trace_wait("backup wait", dt__now() - w0);
  }
  if (dt__strategy_failed(s) && R->result == DTRAIN_OK && DT__ALOAD(&s->failed, DT__MO_ACQUIRE) != r)
    R->result = DTRAIN_ERR_ABORTED;
}

DTRAIN_PRIVATE dt_result dt__strategy_backup_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                                 float *mean_loss) {
  const char *fn = "dt_strategy_run";
  dt__backup *bk = s->backup;
  if (steps > INT64_MAX / DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: %lld steps is too many", fn, (long long)steps);
  double t0 = dt__now();
  bk->step = 0;
  bk->end = steps;
  bk->joined = 0;
  bk->closing = bk->phase = 0; /* a failed close left them set */
  bk->tickets = 0;
  bk->nredo = 0;
  memset(bk->in, 0, (size_t)s->n);
  bk->rows = bk->skipped = bk->loss_count = 0;
  bk->loss_sum = 0.0;
  s->batch = NULL;
  s->next = next;
  s->next_user = next_user;
  s->ticket_base = s->tickets;
  void (*job)(dt_strategy *, int) = s->job;
  s->job = dt__backup_job;
  dt_result rc = dt__strategy_launch(s, fn);
  s->job = job;
  s->seconds += dt__now() - t0;
  s->steps += bk->step;
  s->skipped += bk->skipped;
  s->samples += bk->rows;
  s->tickets += bk->tickets;
  s->loss_sum += bk->loss_sum;
  s->loss_count += bk->loss_count;
  if (bk->loss_count > 0) s->last_loss = bk->last_loss;
  if (mean_loss && bk->loss_count > 0) *mean_loss = (float)(bk->loss_sum / (double)bk->loss_count);
  return rc;
}

#endif /* DTRAIN_NO_DIST */
