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
 *       (N-B)-th closes the step: the joined gradients averaged weighted by
 *       their rows (MEAN; SUM: summed), in rank order, so that the result
 *       does not depend on who came first; clipping and the non-finite check
 *       on that; the optimizer's update of the centre; buffers (batch-norm
 *       statistics) from the lowest-ranked contributor; t advances and
 *       everybody waiting is woken. The others wait for the close.
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
  bk->acc = dt__strategy_floats(s, NULL);
  if (!bk->in || !bk->redo || !bk->redo_by || !bk->acc) return dt__strategy_nomem(s);
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
  dt__free(bk->acc, s->fbytes ? s->fbytes : sizeof(float));
  dt__free(bk, sizeof *bk);
  s->backup = NULL;
}

/* Under the lock, by the replica whose gradient completed the step: the
 * update of the centre. 0: the step failed (recorded). */
static int dt__backup_close(dt_strategy *s, dt__backup *bk, int r) {
  const int sum = s->desc.loss == DTRAIN_LOSS_SUM;
  int64_t rows = 0;
  int first = -1;
  for (int j = 0; j < s->n; j++)
    if (bk->in[j]) {
      rows += s->rep[j].rows;
      if (first < 0) first = j;
    }
  float *acc = bk->acc;
  memset(acc, 0, s->fbytes);
  double loss = 0.0;
  for (int j = 0; j < s->n; j++) {
    if (!bk->in[j]) continue;
    const dt__strategy_replica *J = &s->rep[j];
    float w = sum ? 1.0f : rows > 0 ? (float)((double)J->rows / (double)rows) : 0.0f;
    for (size_t i = 0; i < s->size; i++) acc[i] += w * J->grad[i];
    loss += (double)w * (double)J->loss;
  }
  float *P = dt_params_data(s->params);
  char what[DT__MSG_CAP];
  int64_t step = s->steps + bk->step;
  if (rows > 0) {
    float clip = dt_optim_get_options(s->opt)->clip_norm;
    size_t bad = s->desc.check_numerics ? dt__strategy_nonfinite(acc, 0, s->size)
                                        : dt__strategy_nonfinite_trainable(s, acc, 0, s->size);
    int ok = bad == s->size;
    if (!ok) {
      snprintf(what, sizeof what, "step %lld: averaged gradient of '%s' is %s at flat index %zu; no update made",
               (long long)step, dt__strategy_param_at(s, bad), isnan(acc[bad]) ? "NaN" : "Inf", bad);
    } else if (clip > 0.0f) {
      double norm = sqrt(dt__strategy_sumsq(s, acc, 0, s->size));
      ok = dt__strategy_clip_scale(s, acc, 0, s->size, norm, clip);
      if (!ok) snprintf(what, sizeof what, "step %lld: gradient norm is %s; no update made", (long long)step,
                        isnan(norm) ? "NaN" : "Inf");
    }
    if (!ok) {
      if (!s->desc.skip_nonfinite) {
        dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
        return 0;
      }
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_NONFINITE, "dt_strategy_run: skipped: %s", what);
      bk->skipped++;
      rows = 0; /* nothing trained on */
    } else {
      dt_result rc = dt_optim_update(s->opt, P, acc, 0, s->size);
      if (rc != DTRAIN_OK) {
        dt__strategy_fail(s, r, rc, dt_last_error());
        return 0;
      }
      dt_optim_advance(s->opt);
      dt__strategy_copy_buffers(s, P, s->rep[first].data, 0, s->size);
      bk->loss_sum += loss;
      bk->loss_count++;
      bk->last_loss = (float)loss;
    }
  }
  bk->rows += rows;
  bk->step++;
  bk->joined = 0;
  memset(bk->in, 0, (size_t)s->n);
  return 1;
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
        (void)dt__backup_close(s, bk, r); /* a failure is recorded and seen below */
        dt__cond_broadcast(&bk->cv);
      } else {
        while (bk->step == t && !dt__strategy_failed(s)) dt__cond_wait(&bk->cv, &bk->mu);
      }
    } else {
      R->dropped++;
      if (bk->step < bk->end && bk->nredo < s->n) { /* its rows are not lost: another replica takes them */
        bk->redo[bk->nredo] = own;
        bk->redo_by[bk->nredo++] = r;
      }
    }
    dt__mutex_unlock(&bk->mu);
    R->wait_s += dt__now() - w0;
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
