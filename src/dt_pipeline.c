/* ===========================================================================
 * dt_pipeline.c -- pipeline parallelism over point-to-point messages: GPipe
 * and 1F1B schedules, stages on threads or processes (see dt_pipeline.h)
 * ===========================================================================
 * Each stage keeps one graph per micro-batch it may hold at once (GPipe: M;
 * 1F1B: min(M, P-s)); micro-batch m uses slot m % slots, whose previous
 * micro-batch finished its backward before m's forward starts, so a slot is
 * reset only when its sends are done (waited on first).
 *
 * Messages (tags below DT_COMM_TAG_MAX): micro-batch m's activations go
 * forward with tag 2m -- first an 8-float header (int32 bits: ndim, then the
 * shape), then the floats -- and its gradient goes back with tag 2m+1 (the
 * sender of the activations knows their shape). Receives are posted only
 * when the schedule needs them and sends never block (isend, waited on when
 * the slot is reused or at the end of the step), so neither schedule can
 * deadlock, on the threads backend's rendezvous or on TCP.
 *
 * The end of a step is one all-reduce of two floats over the stages (the
 * loss, from the last stage, and a failure count): every stage applies its
 * optimizer only when no stage failed, so a failed step changes no
 * parameters anywhere (processes: unless one dies between the all-reduce and
 * its update).
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
#include "dt_pipeline.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_platform.h"
#include "dt_strategy_impl.h"

#define DT__PIPE_MAX_M 16383
#define DT__PIPE_HDR 8

typedef struct dt__pipe_slot {
  dt_graph *g;
  dt_tensor *x, *out;       /* the micro-batch's input (stage > 0) and output (last stage: its loss) */
  dt_comm_request *req[2];  /* its sends: header + activations forward, or the input gradient back */
  float hdr[DT__PIPE_HDR];  /* the header sent */
  int m;                    /* micro-batch in the slot, -1: none */
} dt__pipe_slot;

typedef struct dt__pipe_stage {
  int s, r;          /* stage, replica */
  dt_comm *pp, *dp;  /* this stage's pipeline (rank s) and data-parallel group (rank r; NULL: none) */
  int own_groups;    /* threads with replicas: pp and dp are our groups */
  dt_minibatch local; /* during a step: this replica's batch */
  double global_rows;
  dt_params *P;
  dt_optim *opt;
  dt__pipe_slot *slots;
  int nslots;
  dt_pipeline_stats st;
  int in_flight;
  dt_result rc;
  char why[DT__MSG_CAP];
  double loss; /* last stage: the weighted losses of the step, in micro-batch order */
} dt__pipe_stage;

struct dt_pipeline {
  dt_pipeline_options o;
  int R;          /* replicas */
  dt_comm *comm; /* threads: our own (P*R ranks) */
  int own_comm;
  int first, local; /* this process's stages: [first, first + local) */
  dt__pipe_stage *st;
  dt__pool *pool;
  dt_stage_fn fn;
  void *user;
  const dt_minibatch *batch; /* during a step */
  float loss;
};

DTRAIN_API dt_pipeline_options dt_pipeline_defaults(int stages, int microbatches) {
  dt_pipeline_options o;
  memset(&o, 0, sizeof o);
  o.stages = stages;
  o.microbatches = microbatches;
  o.schedule = DTRAIN_PIPE_GPIPE;
  o.seed = 1;
  return o;
}

/* ---- one stage's step ------------------------------------------------------------------------ */

static int dt__pipe_tag(int m, int back) { return 2 * m + back; }

/* Record the stage's first error and break the communicator so that no other stage waits for it. */
static dt_result dt__pipe_fail(dt_pipeline *p, dt__pipe_stage *S, dt_result rc) {
  if (S->rc == DTRAIN_OK) {
    S->rc = rc;
    snprintf(S->why, sizeof S->why, "%s", rc == DTRAIN_ERR_ABORTED ? "" : dt_last_error());
  }
  if (rc != DTRAIN_ERR_ABORTED) {
    dt_comm_abort(S->pp, S->s);
    if (S->dp) dt_comm_abort(S->dp, S->r);
  }
  (void)p;
  return rc;
}

/* Waits on the neighbouring stages are communication on the profile and the
 * timeline (dt_pipeline_recv, dt_pipeline_send_wait), not time of the graph
 * op that ran last (the op running when a receive blocks is ended first). */
static dt_result dt__pipe_wait_slot(dt__pipe_slot *sl) {
  dt__prof_fwd_end();
  int64_t t0 = dt__prof_t0();
  dt_result rc = dt_comm_waitall(sl->req, 2);
  dt__prof_add("dt_pipeline_send_wait", DTRAIN_PROFILE_COMM, t0);
  return rc;
}

static dt_result dt__pipe_recv(dt__pipe_stage *S, int from, int tag, float *buf, size_t n) {
  dt__prof_fwd_end();
  int64_t t0 = dt__prof_t0();
  dt_result rc = dt_comm_recv(S->pp, S->s, from, tag, buf, n);
  dt__prof_add("dt_pipeline_recv", DTRAIN_PROFILE_COMM, t0);
  return rc;
}

/* The shape header of t as int32 bits in 8 floats. */
static void dt__pipe_pack(float *h, const dt_tensor *t) {
  int32_t v[DT__PIPE_HDR];
  memset(v, 0, sizeof v);
  v[0] = t->ndim;
  for (int d = 0; d < t->ndim && d < DTRAIN_MAX_DIMS; d++) v[1 + d] = (int32_t)t->shape[d];
  memcpy(h, v, sizeof v);
}

static dt_result dt__pipe_forward(dt_pipeline *p, dt__pipe_stage *S, int m) {
  int s = S->s, P = p->o.stages, M = p->o.microbatches;
  dt__pipe_slot *sl = &S->slots[m % S->nslots];
  dt_result rc = dt__pipe_wait_slot(sl);
  if (rc != DTRAIN_OK) return rc;
  dt_graph_reset(sl->g);
  sl->m = m;
  sl->x = sl->out = NULL;
  dt_minibatch mb;
  dt__strategy_shard(&S->local, M, m, &mb);
  mb.step = S->st.steps;
  mb.weight = (float)((double)mb.rows / S->global_rows);
  if (s > 0) {
    float hf[DT__PIPE_HDR];
    int32_t h[DT__PIPE_HDR];
    rc = dt__pipe_recv(S, s - 1, dt__pipe_tag(m, 0), hf, DT__PIPE_HDR);
    if (rc != DTRAIN_OK) return rc;
    memcpy(h, hf, sizeof h);
    int64_t shape[DTRAIN_MAX_DIMS], size = 1;
    int ok = h[0] >= 1 && h[0] <= DTRAIN_MAX_DIMS;
    for (int d = 0; ok && d < h[0]; d++) {
      shape[d] = h[1 + d];
      ok = shape[d] >= 1 && shape[d] <= ((int64_t)1 << 40) / size;
      if (ok) size *= shape[d];
    }
    if (!ok)
      return dt__error(DTRAIN_ERR_PROTOCOL, "dt_pipeline_step: stage %d: micro-batch %d: a bad shape header from "
                       "stage %d (ndim %d)", s, m, s - 1, (int)h[0]);
    sl->x = dt_tensor_new(sl->g, h[0], shape);
    if (!sl->x) return dt__error(dt_graph_error(sl->g), "dt_pipeline_step: stage %d: %s", s,
                                 dt_graph_message(sl->g));
    rc = dt__pipe_recv(S, s - 1, dt__pipe_tag(m, 0), sl->x->data, (size_t)size);
    if (rc != DTRAIN_OK) return rc;
    dt_tensor_set_requires_grad(sl->x, 1);
  }
  double t0 = dt__now();
  sl->out = p->fn(sl->g, s, sl->x, &mb, p->user);
  S->st.busy_s += dt__now() - t0;
  if (!sl->out || dt_graph_error(sl->g) != DTRAIN_OK) {
    dt_result ge = dt_graph_error(sl->g);
    return dt__error(ge != DTRAIN_OK ? ge : DTRAIN_ERR_NULL_ARG, "dt_pipeline_step: stage %d: micro-batch %d: %s",
                     s, m, ge != DTRAIN_OK ? dt_graph_message(sl->g) : "the stage function returned NULL");
  }
  S->in_flight++;
  if (S->in_flight > S->st.max_in_flight) S->st.max_in_flight = S->in_flight;
  size_t used = 0;
  for (int k = 0; k < S->nslots; k++)
    if (S->slots[k].m >= 0) used += dt_graph_bytes_used(S->slots[k].g);
  if (used > S->st.act_bytes_peak) S->st.act_bytes_peak = used;
  if (s == P - 1) {
    if (sl->out->size != 1)
      return dt__error(DTRAIN_ERR_SHAPE, "dt_pipeline_step: the last stage (%d) returned %lld elements, not a loss",
                       s, (long long)sl->out->size);
    S->loss += (double)mb.weight * (double)sl->out->data[0];
    return DTRAIN_OK;
  }
  dt__pipe_pack(sl->hdr, sl->out);
  rc = dt_comm_isend(S->pp, s, s + 1, dt__pipe_tag(m, 0), sl->hdr, DT__PIPE_HDR, &sl->req[0]);
  if (rc == DTRAIN_OK)
    rc = dt_comm_isend(S->pp, s, s + 1, dt__pipe_tag(m, 0), sl->out->data, (size_t)sl->out->size, &sl->req[1]);
  return rc;
}

static dt_result dt__pipe_backward(dt_pipeline *p, dt__pipe_stage *S, int m) {
  int s = S->s, P = p->o.stages;
  dt__pipe_slot *sl = &S->slots[m % S->nslots];
  dt_result rc;
  if (sl->m != m) return dt__error(DTRAIN_ERR_INTERNAL, "dt_pipeline_step: stage %d: slot of micro-batch %d holds %d",
                                   s, m, sl->m);
  rc = dt__pipe_wait_slot(sl); /* the activations went out: their buffer is the graph's again */
  if (rc != DTRAIN_OK) return rc;
  if (s == P - 1) {
    dt_minibatch mb;
    dt__strategy_shard(&S->local, p->o.microbatches, m, &mb);
    float w = (float)((double)mb.rows / S->global_rows);
    double t0 = dt__now();
    rc = dt_backward_grad(sl->g, sl->out, &w);
    S->st.busy_s += dt__now() - t0;
  } else {
    dt_tensor *gout = dt_tensor_new(sl->g, sl->out->ndim, sl->out->shape);
    if (!gout) return dt__error(dt_graph_error(sl->g), "dt_pipeline_step: stage %d: %s", s, dt_graph_message(sl->g));
    rc = dt__pipe_recv(S, s + 1, dt__pipe_tag(m, 1), gout->data, (size_t)gout->size);
    if (rc != DTRAIN_OK) return rc;
    double t0 = dt__now();
    rc = dt_backward_grad(sl->g, sl->out, gout->data);
    S->st.busy_s += dt__now() - t0;
  }
  if (rc != DTRAIN_OK)
    return dt__error(rc, "dt_pipeline_step: stage %d: micro-batch %d: backward: %s", s, m, dt_last_error());
  S->in_flight--;
  if (s == 0) return DTRAIN_OK;
  const float *dx = sl->x->grad;
  if (!dx) { /* the stage's output does not depend on its input: a zero gradient */
    dt_tensor *z = dt_tensor_new(sl->g, sl->x->ndim, sl->x->shape);
    if (!z) return dt__error(dt_graph_error(sl->g), "dt_pipeline_step: stage %d: %s", s, dt_graph_message(sl->g));
    dx = z->data;
  }
  return dt_comm_isend(S->pp, s, s - 1, dt__pipe_tag(m, 1), dx, (size_t)sl->x->size, &sl->req[0]);
}

/* Stage s's schedule for one step. */
static dt_result dt__pipe_schedule(dt_pipeline *p, dt__pipe_stage *S) {
  int s = S->s, P = p->o.stages, M = p->o.microbatches;
  dt_result rc = DTRAIN_OK;
  if (p->o.schedule == DTRAIN_PIPE_GPIPE) {
    for (int m = 0; m < M && rc == DTRAIN_OK; m++) rc = dt__pipe_forward(p, S, m);
    for (int m = 0; m < M && rc == DTRAIN_OK; m++) rc = dt__pipe_backward(p, S, m);
    return rc;
  }
  int warm = DT__MIN(P - s - 1, M), f = 0, b = 0;
  for (; f < warm && rc == DTRAIN_OK; f++) rc = dt__pipe_forward(p, S, f);
  while (f < M && rc == DTRAIN_OK) {
    rc = dt__pipe_forward(p, S, f++);
    if (rc == DTRAIN_OK) rc = dt__pipe_backward(p, S, b++);
  }
  while (b < M && rc == DTRAIN_OK) rc = dt__pipe_backward(p, S, b++);
  return rc;
}

static void dt__pipe_stage_step(dt_pipeline *p, dt__pipe_stage *S) {
  int s = S->s, P = p->o.stages;
  double t0 = dt__now();
  dt_result rc = DTRAIN_OK;
  S->rc = DTRAIN_OK;
  S->why[0] = '\0';
  S->loss = 0.0;
  S->in_flight = 0;
  dt_params_zero_grad(S->P);
  /* This replica's batch and the global rows (the losses' weights). */
  if (p->own_comm && p->R > 1) dt__strategy_shard(p->batch, p->R, S->r, &S->local);
  else S->local = *p->batch;
  S->global_rows = (double)p->batch->rows;
  if (!p->own_comm && S->dp) {
    float rows = (float)S->local.rows;
    rc = dt_comm_allreduce(S->dp, S->r, &rows, 1);
    if (rc != DTRAIN_OK) dt__pipe_fail(p, S, rc);
    S->global_rows = rows;
  }
  if (S->rc == DTRAIN_OK && S->local.rows < p->o.microbatches)
    dt__pipe_fail(p, S, dt__error(DTRAIN_ERR_INVALID_ARG, "dt_pipeline_step: replica %d: a batch of %lld rows "
                                  "cannot make %d micro-batches", S->r, (long long)S->local.rows,
                                  p->o.microbatches));
  if (S->rc == DTRAIN_OK) {
    rc = dt__pipe_schedule(p, S);
    if (rc != DTRAIN_OK) dt__pipe_fail(p, S, rc);
  }
  /* Every send finished (or ended by the abort) before the graphs may go. */
  for (int k = 0; k < S->nslots; k++) {
    dt_result wr = dt__pipe_wait_slot(&S->slots[k]);
    if (wr != DTRAIN_OK && S->rc == DTRAIN_OK) dt__pipe_fail(p, S, wr);
  }
  /* Agree along the pipeline, then across the replicas: the loss and whether anyone failed. */
  float agree[2] = {s == P - 1 ? (float)S->loss : 0.0f, S->rc != DTRAIN_OK ? 1.0f : 0.0f};
  if (S->rc == DTRAIN_OK) {
    rc = dt_comm_allreduce(S->pp, s, agree, 2);
    if (rc != DTRAIN_OK) dt__pipe_fail(p, S, rc);
  }
  if (S->rc == DTRAIN_OK && S->dp) {
    rc = dt_comm_allreduce(S->dp, S->r, agree, 2);
    /* The stage's gradient summed over the replicas (each already weighted by
     * its rows over the global rows): every replica applies the same update. */
    if (rc == DTRAIN_OK && agree[1] == 0.0f)
      rc = dt_comm_allreduce(S->dp, S->r, dt_params_grad(S->P), dt_params_size(S->P));
    if (rc != DTRAIN_OK) dt__pipe_fail(p, S, rc);
  }
  if (S->rc == DTRAIN_OK && agree[1] == 0.0f) {
    rc = dt_optim_step(S->opt);
    if (rc != DTRAIN_OK) dt__pipe_fail(p, S, rc);
    else if (s == p->first && S->r == 0) p->loss = agree[0];
    else if (!p->own_comm) p->loss = agree[0];
  }
  S->st.steps++;
  S->st.step_s += dt__now() - t0;
}

static void dt__pipe_pool_fn(void *arg, int index) {
  dt_pipeline *p = (dt_pipeline *)arg;
  dt__pipe_stage_step(p, &p->st[index]);
}

DTRAIN_API dt_result dt_pipeline_step(dt_pipeline *p, const dt_minibatch *batch, float *loss) {
  if (loss) *loss = NAN;
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_step: pipeline is NULL");
  if (!batch) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_step: batch is NULL");
  if (batch->rows < (int64_t)p->o.microbatches * (p->own_comm ? p->R : 1))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_pipeline_step: a batch of %lld rows cannot make %d micro-batches%s",
                     (long long)batch->rows, p->o.microbatches, p->R > 1 ? " for every replica" : "");
  p->batch = batch;
  p->loss = NAN;
  dt__quiet_push();
  if (p->pool) dt__pool_run(p->pool, dt__pipe_pool_fn, p);
  else dt__pipe_stage_step(p, &p->st[0]);
  p->batch = NULL;
  /* The first real cause (another stage's ABORTED only says that someone failed). */
  dt_result rc = DTRAIN_OK;
  const dt__pipe_stage *who = NULL;
  for (int k = 0; k < p->local; k++) {
    const dt__pipe_stage *S = &p->st[k];
    if (S->rc == DTRAIN_OK) continue;
    if (!who || (who->rc == DTRAIN_ERR_ABORTED && S->rc != DTRAIN_ERR_ABORTED)) who = S;
  }
  if (who) {
    rc = who->rc == DTRAIN_ERR_ABORTED ? DTRAIN_ERR_ABORTED : dt__error(who->rc, "%s", who->why);
    if (p->own_comm) { /* threads: nobody is inside any more */
      dt_comm_recover(p->comm);
      for (int k = 0; k < p->local; k++) {
        dt_comm_recover(p->st[k].pp);
        if (p->st[k].dp) dt_comm_recover(p->st[k].dp);
      }
    }
  }
  dt__quiet_pop(rc);
  if (rc == DTRAIN_OK && loss) *loss = p->loss;
  return rc;
}

/* ---- creation ---------------------------------------------------------------------------------- */

DTRAIN_API void dt_pipeline_destroy(dt_pipeline *p) {
  if (!p) return;
  dt__pool_destroy(p->pool);
  for (int k = 0; p->st && k < p->local; k++) {
    dt__pipe_stage *S = &p->st[k];
    for (int j = 0; S->slots && j < S->nslots; j++) {
      dt_comm_waitall(S->slots[j].req, 2);
      dt_graph_destroy(S->slots[j].g);
    }
    dt__free(S->slots, (size_t)S->nslots * sizeof(dt__pipe_slot));
    dt_optim_destroy(S->opt);
    if (S->own_groups) {
      dt_comm_destroy(S->pp);
      dt_comm_destroy(S->dp);
    }
  }
  dt__free(p->st, (size_t)p->local * sizeof(dt__pipe_stage));
  if (p->own_comm) dt_comm_destroy(p->comm);
  dt__free(p, sizeof *p);
}

static dt_result dt__pipe_check(dt_params *const *params, const dt_optim_options *opt, dt_stage_fn fn,
                                const dt_pipeline_options *o) {
  const char *fn_name = "dt_pipeline_create";
  if (!params || !opt || !fn || !o)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn_name,
                     !params ? "params" : !opt ? "opt" : !fn ? "fn" : "options");
  if (o->stages < 1 || o->stages > 256)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d stages (1..256)", fn_name, o->stages);
  if (o->microbatches < 1 || o->microbatches > DT__PIPE_MAX_M)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d micro-batches (1..%d)", fn_name, o->microbatches,
                     DT__PIPE_MAX_M);
  if (o->schedule != DTRAIN_PIPE_GPIPE && o->schedule != DTRAIN_PIPE_1F1B)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: schedule %d (DTRAIN_PIPE_GPIPE or DTRAIN_PIPE_1F1B)", fn_name,
                     o->schedule);
  if (opt->clip_norm > 0.0f)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: clip_norm: the global gradient norm spans the stages; "
                     "clipping it is not supported by pipelines yet", fn_name);
  if (o->comm) {
    if (dt_comm_world(o->comm) != o->stages)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d stages but the communicator has %d ranks", fn_name,
                       o->stages, dt_comm_world(o->comm));
    if (strcmp(dt_comm_name(o->comm), "threads") == 0 && o->stages > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: a threads communicator runs many ranks in one process: leave "
                       "options.comm NULL and the pipeline runs its stages as threads", fn_name);
  }
  if (o->replicas < 0 || o->replicas > 256 || (o->replicas > 1 && o->comm))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: replicas %d (threads only; processes: options.dp_comm)", fn_name,
                     o->replicas);
  if (o->dp_comm && !o->comm)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: dp_comm is for stages in processes (options.comm); threads: "
                     "options.replicas", fn_name);
  int n = o->comm ? 1 : o->stages * (o->replicas > 1 ? o->replicas : 1);
  for (int k = 0; k < n; k++)
    if (!params[k]) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: params[%d] is NULL", fn_name, k);
  return DTRAIN_OK;
}

/* Threads with replicas: thread k = r*P + s splits the P*R communicator into
 * its pipeline (colour r, rank s) and its data-parallel group (colour s, rank r). */
static void dt__pipe_split_fn(void *arg, int index) {
  dt_pipeline *p = (dt_pipeline *)arg;
  dt__pipe_stage *S = &p->st[index];
  dt_comm *pp = NULL, *dp = NULL;
  S->rc = dt_comm_split(p->comm, index, S->r, S->s, &pp, NULL);
  if (S->rc == DTRAIN_OK) S->rc = dt_comm_split(p->comm, index, S->s, S->r, &dp, NULL);
  if (S->rc != DTRAIN_OK) snprintf(S->why, sizeof S->why, "%s", dt_last_error());
  S->pp = pp ? pp : p->comm;
  S->dp = dp;
  S->own_groups = pp != NULL;
}

static dt_result dt__pipe_groups(dt_pipeline *p) {
  dt__pool_run(p->pool, dt__pipe_split_fn, p);
  for (int k = 0; k < p->local; k++)
    if (p->st[k].rc != DTRAIN_OK) return dt__error(p->st[k].rc, "dt_pipeline_create: %s", p->st[k].why);
  return DTRAIN_OK;
}

DTRAIN_API dt_pipeline *dt_pipeline_create(dt_params *const *params, const dt_optim_options *opt, dt_stage_fn fn,
                                           void *user, const dt_pipeline_options *o) {
  if (dt__pipe_check(params, opt, fn, o) != DTRAIN_OK) return NULL;
  dt_pipeline *p = (dt_pipeline *)dt__calloc(sizeof *p);
  if (!p) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_pipeline_create: out of memory");
    return NULL;
  }
  p->o = *o;
  p->fn = fn;
  p->user = user;
  int P = o->stages, M = o->microbatches;
  p->R = o->replicas > 1 ? o->replicas : 1;
  if (o->comm) {
    p->comm = o->comm;
    p->first = dt_comm_rank(o->comm);
    p->local = 1;
  } else {
    p->comm = dt_comm_create_threads(P * p->R, o->spin_us);
    p->own_comm = p->comm != NULL;
    p->local = P * p->R;
    if (p->comm && p->local > 1) p->pool = dt__pool_create(p->local, dt__spin_seconds(o->spin_us, p->local));
    if (!p->comm || (p->local > 1 && !p->pool)) {
      dt_pipeline_destroy(p);
      return NULL;
    }
  }
  p->st = (dt__pipe_stage *)dt__calloc((size_t)p->local * sizeof(dt__pipe_stage));
  if (!p->st) {
    dt_pipeline_destroy(p);
    dt__error(DTRAIN_ERR_NOMEM, "dt_pipeline_create: out of memory");
    return NULL;
  }
  for (int k = 0; k < p->local; k++) {
    dt__pipe_stage *S = &p->st[k];
    int s = o->comm ? p->first : k % P;
    S->s = s;
    S->r = o->comm ? (o->dp_comm ? dt_comm_rank(o->dp_comm) : 0) : k / P;
    S->pp = p->comm;
    S->dp = o->comm ? o->dp_comm : NULL;
    S->P = params[k];
    S->nslots = o->schedule == DTRAIN_PIPE_1F1B ? DT__MIN(M, P - s) : M;
    S->st.bubble_theory = (double)(P - 1) / (double)(M + P - 1);
    S->slots = (dt__pipe_slot *)dt__calloc((size_t)S->nslots * sizeof(dt__pipe_slot));
    S->opt = dt_optim_create(S->P, opt);
    if (!S->slots || !S->opt) {
      if (!S->slots) dt__error(DTRAIN_ERR_NOMEM, "dt_pipeline_create: out of memory");
      if (!S->slots) S->nslots = 0;
      dt_pipeline_destroy(p);
      return NULL;
    }
    for (int j = 0; j < S->nslots; j++) {
      dt_graph_options go;
      memset(&go, 0, sizeof go);
      go.arena_bytes = o->arena_bytes;
      go.seed = o->seed + 7919u * (uint64_t)s + (uint64_t)j;
      S->slots[j].m = -1;
      S->slots[j].g = dt_graph_create(S->P, &go);
      if (!S->slots[j].g) {
        dt_pipeline_destroy(p);
        return NULL;
      }
    }
  }
  if (p->own_comm && p->R > 1 && dt__pipe_groups(p) != DTRAIN_OK) {
    dt_pipeline_destroy(p);
    return NULL;
  }
  return p;
}

/* ---- queries ----------------------------------------------------------------------------------- */

/* Stage `stage` of replica 0 (processes: this process's stage only). */
static const dt__pipe_stage *dt__pipe_find(const dt_pipeline *p, int stage) {
  if (!p) return NULL;
  if (p->own_comm) return stage >= 0 && stage < p->local ? &p->st[stage] : NULL; /* r * P + s: replica r's */
  return stage == p->first ? &p->st[0] : NULL;
}

DTRAIN_API dt_result dt_pipeline_stats_get(const dt_pipeline *p, int stage, dt_pipeline_stats *out) {
  if (!p || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_stats_get: %s is NULL", !p ? "p" : "out");
  const dt__pipe_stage *S = dt__pipe_find(p, stage);
  if (!S)
    return dt__error(DTRAIN_ERR_INDEX, "dt_pipeline_stats_get: stage %d does not run in this process (it runs "
                     "%d..%d)", stage, p->first, p->first + dt_pipeline_local_stages(p) - 1);
  *out = S->st;
  out->bubble = S->st.step_s > 0 ? 1.0 - S->st.busy_s / S->st.step_s : 0.0;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_pipeline_memory(const dt_pipeline *p, int stage, dt_memory_info *out) {
  if (!p || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_memory: %s is NULL", !p ? "p" : "out");
  memset(out, 0, sizeof *out);
  const dt__pipe_stage *S = dt__pipe_find(p, stage);
  if (!S) return dt__error(DTRAIN_ERR_INDEX, "dt_pipeline_memory: stage %d does not run in this process", stage);
  dt_result rc = dt_memory_stats(S->P, S->opt, NULL, out);
  for (int k = 0; rc == DTRAIN_OK && k < S->nslots; k++) {
    dt_memory_info gi;
    rc = dt_memory_stats(NULL, NULL, S->slots[k].g, &gi);
    out->arena_bytes += gi.arena_bytes;
    out->tape_bytes += gi.tape_bytes;
  }
  out->activations_bytes = S->st.act_bytes_peak;
  out->total_bytes = out->params_bytes + out->grads_bytes + out->optim_bytes + out->arena_bytes + out->tape_bytes;
  return rc;
}

DTRAIN_API dt_optim *dt_pipeline_optim(dt_pipeline *p, int stage) {
  if (!p) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_optim: p is NULL");
    return NULL;
  }
  const dt__pipe_stage *S = dt__pipe_find(p, stage);
  if (!S) dt__error(DTRAIN_ERR_INDEX, "dt_pipeline_optim: stage %d does not run in this process", stage);
  return S ? S->opt : NULL;
}

DTRAIN_API int dt_pipeline_first_stage(const dt_pipeline *p) {
  if (!p) dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_first_stage: p is NULL");
  return p ? p->first : 0;
}

DTRAIN_API int dt_pipeline_local_stages(const dt_pipeline *p) {
  if (!p) dt__error(DTRAIN_ERR_NULL_ARG, "dt_pipeline_local_stages: p is NULL");
  return p ? (p->own_comm ? p->o.stages : 1) : 0;
}
