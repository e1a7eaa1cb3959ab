/* 07_model_parallel.c -- one model too large for one worker, spread over
 * several: pipeline stages or tensor-parallel shards, with data parallelism
 * on top, on threads or processes -- and the one_device reference beside it.
 *
 * Shows: cutting a model into stages (dt_pipeline.h: micro-batches, GPipe or
 * 1F1B, the bubble measured against (P-1)/(M+P-1)); splitting each layer over
 * shards (dt_tensor_parallel.h: column- and row-parallel layers); the
 * pipeline x data and tensor x data layouts of a communicator (dt_layout);
 * that every layout computes what one device computes on the same batches.
 *
 * Build: make (-> build/examples/07_model_parallel), or
 *        cc -std=c11 -O2 -I. examples/07_model_parallel.c -o mp -lm -lpthread
 * Run:   build/examples/07_model_parallel [--parallel none|pipeline|tensor] [--stages P]
 *            [--microbatches M] [--schedule gpipe|1f1b] [--replicas R] [--steps N] [--batch B]
 *            [--layers L] [--hidden H] [--lr X] [--seed S] [--model mlp] [--json]
 *        As processes (one rank each; P stages or shards times R replicas):
 *            tools/dtrain-launch -n 4 -- build/examples/07_model_parallel --parallel pipeline --stages 2
 *            tools/dtrain-launch -n 4 --pipeline 2 -- build/examples/07_model_parallel   (the same: the
 *            launcher's layout, from DTRAIN_CONFIG, picks the mode and the stages; or --tensor 2)
 *
 * --stages P is the number of pipeline stages (--parallel pipeline) or of
 * tensor-parallel shards (--parallel tensor). --replicas R runs R copies of
 * the whole arrangement, each on its part of the global batch (threads; as
 * processes R is the world divided by P). --parallel none is one_device on
 * the same data with the same initial parameters, so its --json line can be
 * compared with the others' directly: final_loss and params_checksum (the
 * sum of every parameter plus the sum of their squares, in double) agree to
 * about 6 digits (float rounding), peak_bytes_per_worker shows the saving.
 *
 * The model: an MLP of L hidden layers of H units (tanh) on a synthetic task
 * (a random teacher network labels Gaussian points; 64 features, 8 classes).
 * Pipeline: the L+1 layers in P contiguous groups. Tensor: hidden layers
 * alternate column-parallel and row-parallel (one all-reduce each way per
 * pair); the output layer is row-parallel after a column layer, else whole
 * on every shard. (--model transformer, the character model of
 * examples/03, is not built yet: issue 18 is in progress.)
 *
 * --json prints one line: parallel, stages, microbatches, schedule, replicas,
 * workers, steps, batch, final_loss, params_checksum, peak_bytes_per_worker
 * (parameters, gradients, optimizer state and activation arenas of the
 * largest worker), bubble_measured (the stages' mean idle share of a step),
 * bubble_theory, samples_per_s, seconds. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NIN 64
#define NCLS 8
#define NDATA 8192
#define MAXL 64
#define MAXW 64

static float data_x[NDATA * NIN];
static int32_t data_y[NDATA];

typedef struct options {
  int parallel; /* 0 none, 1 pipeline, 2 tensor */
  int parallel_set, stages_set; /* given as flags (else the launcher's layout may set them) */
  int stages, microbatches, schedule, replicas, layers, hidden, json;
  int64_t steps, batch;
  float lr;
  uint64_t seed;
} options;

static const char *const k_parallel[3] = {"none", "pipeline", "tensor"};

/* ---- data: a random teacher labels Gaussian points ------------------------------------------- */
static void make_data(uint64_t seed) {
  dt_rng r;
  dt_rng_seed(&r, seed);
  enum { TH = 32 };
  static float w1[TH * NIN], w2[NCLS * TH];
  for (int i = 0; i < TH * NIN; i++) w1[i] = dt_rng_normal(&r) / 8.0f;
  for (int i = 0; i < NCLS * TH; i++) w2[i] = dt_rng_normal(&r) / 4.0f;
  for (int i = 0; i < NDATA; i++) {
    float *x = data_x + i * NIN, h[TH];
    for (int f = 0; f < NIN; f++) x[f] = dt_rng_normal(&r);
    for (int j = 0; j < TH; j++) {
      float s = 0.0f;
      for (int f = 0; f < NIN; f++) s += w1[j * NIN + f] * x[f];
      h[j] = s > 0.0f ? s : 0.0f;
    }
    int best = 0;
    float bv = -1e30f;
    for (int c = 0; c < NCLS; c++) {
      float s = 0.0f;
      for (int j = 0; j < TH; j++) s += w2[c * TH + j] * h[j];
      if (s > bv) bv = s, best = c;
    }
    data_y[i] = best;
  }
}

static dt_minibatch batch_at(const options *o, int64_t step) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  int64_t first = (step * o->batch) % (NDATA - o->batch + 1);
  b.rows = o->batch;
  b.x = data_x + first * NIN;
  b.x_cols = NIN;
  b.y = data_y + first;
  return b;
}

/* Rows [r*B/R, (r+1)*B/R) of b: replica r's part (the global batch is the parts in order). */
static dt_minibatch part_of(dt_minibatch b, int r, int R) {
  int64_t lo = b.rows * r / R, hi = b.rows * (r + 1) / R;
  b.x += lo * NIN;
  b.y += lo;
  b.rows = hi - lo;
  return b;
}

/* ---- the model ---------------------------------------------------------------------------------- */
static int in_of(const options *o, int l) { return l == 0 ? NIN : o->hidden; }
static int out_of(const options *o, int l) { return l == o->layers ? NCLS : o->hidden; }

/* The whole model's parameters (w0 b0 w1 b1 ...), initialised from the seed. */
static dt_params *full_params(const options *o) {
  dt_params *p = dt_params_create(o->seed);
  for (int l = 0; l <= o->layers; l++) {
    char n[16];
    int64_t ws[2] = {out_of(o, l), in_of(o, l)}, bs[1] = {out_of(o, l)};
    snprintf(n, sizeof n, "w%d", l);
    dt_params_add(p, n, 2, ws, dt_init_glorot_uniform());
    snprintf(n, sizeof n, "b%d", l);
    dt_params_add(p, n, 1, bs, dt_init_zeros());
  }
  return p;
}

/* Tensor parallel: how layer l is split: 1 column (rows of W), 2 row (columns), 0 whole. */
static int tp_kind(const options *o, int l) {
  if (l < o->layers) return l % 2 == 0 ? 1 : 2;
  return o->layers % 2 == 1 ? 2 : 0; /* after a column layer the output layer is row-parallel */
}

/* Layers [l0, l1) of the whole model's initial values, as shard t of T (T = 1: whole). */
static dt_params *part_params(const options *o, int l0, int l1, int T, int t) {
  dt_params *full = full_params(o), *p = dt_params_create(1);
  for (int l = l0; l < l1; l++) {
    int k = T > 1 ? tp_kind(o, l) : 0;
    for (int wb = 0; wb < 2; wb++) {
      char n[16];
      int64_t s[2] = {out_of(o, l), in_of(o, l)};
      int nd = wb == 0 ? 2 : 1;
      if (wb == 1) s[0] = out_of(o, l);
      if (k == 1) s[0] /= T;                     /* column: rows of W and the bias */
      if (k == 2 && wb == 0) s[1] /= T;          /* row: columns of W; the bias whole */
      snprintf(n, sizeof n, "%c%d", wb == 0 ? 'w' : 'b', l);
      int i = dt_params_add(p, n, nd, s, dt_init_zeros());
      dt_param_info pi, fi;
      dt_params_info(p, i, &pi);
      dt_params_info(full, dt_params_find(full, n), &fi);
      const float *src = dt_params_data(full) + fi.offset;
      float *dst = dt_params_data(p) + pi.offset;
      int64_t rows = nd == 2 ? out_of(o, l) : out_of(o, l), cols = nd == 2 ? in_of(o, l) : 1;
      if (k == 1) dt_tp_shard_rows(src, rows, cols, T, t, dst);
      else if (k == 2 && wb == 0) dt_tp_shard_cols(src, rows, cols, T, t, dst);
      else memcpy(dst, src, fi.size * sizeof(float));
    }
  }
  dt_params_destroy(full);
  return p;
}

/* Layers [l0, l1) on x (params 2*(l-l0), 2*(l-l0)+1 of the graph's params). */
static dt_tensor *run_layers(const options *o, dt_graph *g, dt_tensor *x, int l0, int l1) {
  for (int l = l0; l < l1; l++) {
    x = dt_linear(g, x, dt_param(g, 2 * (l - l0)), dt_param(g, 2 * (l - l0) + 1));
    if (l < o->layers) x = dt_tanh(g, x);
  }
  return x;
}

static dt_tensor *input_of(dt_graph *g, const dt_minibatch *b) {
  int64_t xs[2] = {b->rows, NIN};
  return dt_tensor_wrap(g, 2, xs, (float *)(uintptr_t)b->x);
}

/* ---- one_device ------------------------------------------------------------------------------- */
typedef struct result {
  double loss, checksum, peak_bytes, bubble, seconds;
} result;

static double checksum_of(const dt_params *p, int skip_replicated, const options *o, int T) {
  double s = 0.0;
  const float *d = dt_params_data((dt_params *)(uintptr_t)p);
  for (int i = 0; i < dt_params_count(p); i++) {
    dt_param_info in;
    dt_params_info(p, i, &in);
    if (skip_replicated) { /* a replicated tensor-parallel parameter counts once (shard 0) */
      int l = atoi(in.name + 1), k = T > 1 ? tp_kind(o, l) : 0;
      if (k == 0 || (k == 2 && in.name[0] == 'b')) continue;
    }
    for (size_t j = 0; j < in.size; j++) s += (double)d[in.offset + j] + (double)d[in.offset + j] * d[in.offset + j];
  }
  return s;
}

static double state_bytes(dt_optim *opt, const dt_params *p) {
  return (double)dt_params_size(p) * sizeof(float) * (2.0 + dt_optim_state_slots(opt));
}

static dt_tensor *full_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  const options *o = (const options *)user;
  (void)replica;
  return dt_cross_entropy(g, run_layers(o, g, input_of(g, b), 0, o->layers + 1), b->y);
}

static dt_optim_options adam(const options *o) {
  dt_optim_options oo;
  memset(&oo, 0, sizeof oo);
  oo.kind = DTRAIN_OPTIM_ADAM;
  oo.lr = o->lr;
  oo.beta1 = 0.9f;
  oo.beta2 = 0.999f;
  oo.eps = 1e-8f;
  return oo;
}

static int run_none(const options *o, result *res) {
  dt_params *P = part_params(o, 0, o->layers + 1, 1, 0);
  dt_optim_options oo = adam(o);
  dt_optim *opt = dt_optim_create(P, &oo);
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(P, opt, full_step, (void *)(uintptr_t)o, &sd);
  if (!s) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  float loss = 0;
  double t0 = dt_time_now();
  for (int64_t k = 0; k < o->steps; k++) {
    dt_minibatch b = batch_at(o, k);
    if (dt_strategy_step(s, &b, &loss) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  }
  res->seconds = dt_time_now() - t0;
  res->loss = loss;
  res->checksum = checksum_of(P, 0, o, 1);
  res->peak_bytes = state_bytes(opt, P) + (double)dt_graph_bytes_peak(dt_strategy_graph(s, 0));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return 1;
}

/* ---- pipeline ------------------------------------------------------------------------------------ */
typedef struct mp_ctx {
  const options *o;
  int first[MAXL + 2]; /* stage s: layers first[s] .. first[s+1]-1 */
  dt_comm *world;      /* processes: the whole job */
  int rank;
} mp_ctx;

static dt_tensor *stage_fn(dt_graph *g, int stage, dt_tensor *x, const dt_minibatch *mb, void *user) {
  const mp_ctx *c = (const mp_ctx *)user;
  const options *o = c->o;
  if (stage == 0) x = input_of(g, mb);
  x = run_layers(o, g, x, c->first[stage], c->first[stage + 1]);
  return stage == o->stages - 1 ? dt_cross_entropy(g, x, mb->y) : x;
}

/* Sum of v over the job's ranks (processes), or v (threads). */
static double job_sum(mp_ctx *c, double v) {
  if (!c->world) return v;
  float f = (float)v; /* the sums below need ~7 digits; a double would need two floats */
  double hi = (double)f, lo = v - hi;
  float b[2] = {(float)hi, (float)lo};
  dt_comm_allreduce(c->world, c->rank, b, 2);
  return (double)b[0] + (double)b[1];
}

/* Largest v over the job's ranks. */
static double job_max(mp_ctx *c, double v) {
  if (!c->world) return v;
  int W = dt_comm_world(c->world);
  float *b = (float *)calloc((size_t)W, sizeof(float));
  b[c->rank] = (float)v;
  dt_comm_allreduce(c->world, c->rank, b, (size_t)W);
  double m = 0;
  for (int i = 0; i < W; i++) m = b[i] > m ? b[i] : m;
  free(b);
  return m;
}

static int run_pipeline(const options *o, mp_ctx *c, result *res) {
  int P = o->stages, R = o->replicas, L = o->layers + 1;
  for (int s = 0; s <= P; s++) c->first[s] = L * s / P;
  dt_layout lay;
  memset(&lay, 0, sizeof lay);
  dt_params *ps[MAXW];
  int n = 0;
  dt_pipeline_options po = dt_pipeline_defaults(P, o->microbatches);
  po.schedule = o->schedule;
  if (c->world) {
    if (dt_layout_create(c->world, c->rank, P, 1, &lay) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
    R = lay.data;
    po.comm = lay.pp;
    po.dp_comm = R > 1 ? lay.dp : NULL;
    ps[n++] = part_params(o, c->first[lay.stage], c->first[lay.stage + 1], 1, 0);
  } else {
    po.replicas = R;
    for (int r = 0; r < R; r++)
      for (int s = 0; s < P; s++) ps[n++] = part_params(o, c->first[s], c->first[s + 1], 1, 0);
  }
  dt_optim_options oo = adam(o);
  dt_pipeline *pl = dt_pipeline_create(ps, &oo, stage_fn, c, &po);
  if (!pl) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  float loss = 0;
  double t0 = dt_time_now();
  for (int64_t k = 0; k < o->steps; k++) {
    dt_minibatch b = batch_at(o, k);
    if (c->world) b = part_of(b, lay.dp_rank, R);
    if (dt_pipeline_step(pl, &b, &loss) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  }
  res->seconds = dt_time_now() - t0;
  res->loss = loss;
  /* Replica 0's stages: the checksum, the largest worker, the mean bubble. */
  double cs = 0, peak = 0, bub = 0;
  int first = dt_pipeline_first_stage(pl), local = dt_pipeline_local_stages(pl);
  for (int s = first; s < first + local; s++) {
    dt_pipeline_stats st;
    dt_pipeline_stats_get(pl, s, &st);
    dt_params *p = ps[c->world ? 0 : s];
    double bytes = state_bytes(dt_pipeline_optim(pl, s), p) + (double)st.act_bytes_peak;
    peak = bytes > peak ? bytes : peak;
    if (!c->world || lay.dp_rank == 0) {
      cs += checksum_of(p, 0, o, 1);
      bub += st.bubble;
    }
  }
  res->checksum = job_sum(c, cs);
  res->peak_bytes = job_max(c, peak);
  res->bubble = job_sum(c, bub) / P;
  dt_pipeline_destroy(pl);
  for (int i = 0; i < n; i++) dt_params_destroy(ps[i]);
  dt_layout_destroy(&lay);
  return 1;
}

/* ---- tensor parallel ---------------------------------------------------------------------------- */
typedef struct tp_rank {
  const options *o;
  dt_comm *tp, *dp;     /* tensor group (rank t) and data-parallel group (rank d) */
  int t, d, T, R;
  int ok;
  float loss;
  double checksum, peak, seconds;
} tp_rank;

static dt_tensor *tp_forward(const options *o, dt_graph *g, dt_tensor *x, dt_comm *tp, int t) {
  for (int l = 0; l <= o->layers; l++) {
    dt_tensor *w = dt_param(g, 2 * l), *b = dt_param(g, 2 * l + 1);
    int k = tp_kind(o, l);
    x = k == 1 ? dt_tp_column_linear(g, x, w, b, tp, t, 0) : k == 2 ? dt_tp_row_linear(g, x, w, b, tp, t)
                                                                   : dt_linear(g, x, w, b);
    if (l < o->layers) x = dt_tanh(g, x);
  }
  return x;
}

/* One rank of T x R: its shards, its replica's part of each batch; the
 * gradient summed over the data-parallel group (each part's loss weighted by
 * its rows over the global rows). */
static void tp_train(tp_rank *r) {
  const options *o = r->o;
  dt_params *P = part_params(o, 0, o->layers + 1, r->T, r->t);
  dt_optim_options oo = adam(o);
  dt_optim *opt = dt_optim_create(P, &oo);
  dt_graph *g = dt_graph_create(P, NULL);
  r->ok = 1;
  double t0 = dt_time_now();
  for (int64_t k = 0; k < o->steps && r->ok; k++) {
    dt_minibatch gb = batch_at(o, k), b = part_of(gb, r->d, r->R);
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *l = dt_cross_entropy(g, tp_forward(o, g, input_of(g, &b), r->tp, r->t), b.y);
    float w = (float)b.rows / (float)gb.rows, lw[1];
    r->ok = l && dt_backward_grad(g, l, &w) == DTRAIN_OK;
    lw[0] = r->ok ? w * l->data[0] : 0.0f;
    if (r->ok && r->R > 1)
      r->ok = dt_comm_allreduce(r->dp, r->d, dt_params_grad(P), dt_params_size(P)) == DTRAIN_OK &&
              dt_comm_allreduce(r->dp, r->d, lw, 1) == DTRAIN_OK;
    if (r->ok) r->ok = dt_optim_step(opt) == DTRAIN_OK;
    r->loss = lw[0];
  }
  if (!r->ok) fprintf(stderr, "07: shard %d replica %d: %s\n", r->t, r->d, dt_last_error());
  r->seconds = dt_time_now() - t0;
  r->checksum = r->d == 0 ? checksum_of(P, r->t != 0, o, r->T) : 0.0;
  r->peak = state_bytes(opt, P) + (double)dt_graph_bytes_peak(g);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

typedef struct tp_thread {
  tp_rank r;
  dt_comm *all;
  int index;
  dt_layout lay;
} tp_thread;

static void *tp_thread_main(void *arg) {
  tp_thread *th = (tp_thread *)arg;
  if (dt_layout_create(th->all, th->index, 1, th->r.T, &th->lay) != DTRAIN_OK) {
    th->r.ok = 0;
    return NULL;
  }
  th->r.tp = th->lay.tp;
  th->r.dp = th->lay.dp;
  th->r.t = th->lay.tp_rank;
  th->r.d = th->lay.dp_rank;
  tp_train(&th->r);
  dt_layout_destroy(&th->lay);
  return NULL;
}

static int run_tensor(const options *o, mp_ctx *c, result *res) {
  int T = o->stages;
  if (o->hidden % T != 0) return fprintf(stderr, "07: --hidden %d does not divide into %d shards\n", o->hidden, T), 0;
  if (c->world) {
    dt_layout lay;
    if (dt_layout_create(c->world, c->rank, 1, T, &lay) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
    tp_rank r;
    memset(&r, 0, sizeof r);
    r.o = o;
    r.tp = lay.tp;
    r.dp = lay.dp;
    r.t = lay.tp_rank;
    r.d = lay.dp_rank;
    r.T = T;
    r.R = lay.data;
    tp_train(&r);
    dt_layout_destroy(&lay);
    if (!r.ok) return 0;
    res->loss = r.loss;
    res->seconds = r.seconds;
    res->checksum = job_sum(c, r.checksum);
    res->peak_bytes = job_max(c, r.peak);
    return 1;
  }
  int W = T * o->replicas;
  dt_comm *all = dt_comm_create_threads(W, 0);
  tp_thread *th = (tp_thread *)calloc((size_t)W, sizeof *th);
  pthread_t *tid = (pthread_t *)calloc((size_t)W, sizeof *tid);
  if (!all || !th || !tid) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  for (int i = 0; i < W; i++) {
    th[i].r.o = o;
    th[i].r.T = T;
    th[i].r.R = o->replicas;
    th[i].all = all;
    th[i].index = i;
    pthread_create(&tid[i], NULL, tp_thread_main, &th[i]);
  }
  int ok = 1;
  res->checksum = res->peak_bytes = res->seconds = 0;
  for (int i = 0; i < W; i++) {
    pthread_join(tid[i], NULL);
    ok &= th[i].r.ok;
    res->checksum += th[i].r.checksum;
    if (th[i].r.peak > res->peak_bytes) res->peak_bytes = th[i].r.peak;
    if (th[i].r.seconds > res->seconds) res->seconds = th[i].r.seconds;
  }
  res->loss = th[0].r.loss;
  free(th);
  free(tid);
  dt_comm_destroy(all);
  return ok;
}

/* ---- main --------------------------------------------------------------------------------------- */
static void usage(void) {
  fprintf(stderr,
          "usage: 07_model_parallel [--parallel none|pipeline|tensor] [--stages P] [--microbatches M]\n"
          "                         [--schedule gpipe|1f1b] [--replicas R] [--steps N] [--batch B]\n"
          "                         [--layers L] [--hidden H] [--lr X] [--seed S] [--model mlp] [--json]\n");
}

static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->parallel = 1;
  o->stages = 2;
  o->microbatches = 4;
  o->schedule = DTRAIN_PIPE_1F1B;
  o->replicas = 1;
  o->steps = 50;
  o->batch = 64;
  o->layers = 8;
  o->hidden = 256;
  o->lr = 0.002f;
  o->seed = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--json") == 0) { o->json = 1; continue; }
    if (!v) { usage(); return 0; }
    i++;
    if (strcmp(a, "--parallel") == 0) {
      o->parallel = strcmp(v, "none") == 0 ? 0 : strcmp(v, "pipeline") == 0 ? 1 : strcmp(v, "tensor") == 0 ? 2 : -1;
      if (o->parallel < 0) { fprintf(stderr, "--parallel: none, pipeline or tensor, not '%s'\n", v); return 0; }
      o->parallel_set = 1;
    } else if (strcmp(a, "--schedule") == 0) {
      o->schedule = strcmp(v, "gpipe") == 0 ? DTRAIN_PIPE_GPIPE : strcmp(v, "1f1b") == 0 ? DTRAIN_PIPE_1F1B : -1;
      if (o->schedule < 0) { fprintf(stderr, "--schedule: gpipe or 1f1b, not '%s'\n", v); return 0; }
    } else if (strcmp(a, "--model") == 0) {
      if (strcmp(v, "mlp") != 0) {
        fprintf(stderr, "--model %s: only the MLP is built yet (the character transformer: not yet)\n", v);
        return 0;
      }
    } else if (strcmp(a, "--stages") == 0) {
      o->stages = atoi(v);
      o->stages_set = 1;
    }
    else if (strcmp(a, "--microbatches") == 0) o->microbatches = atoi(v);
    else if (strcmp(a, "--replicas") == 0) o->replicas = atoi(v);
    else if (strcmp(a, "--steps") == 0) o->steps = atoll(v);
    else if (strcmp(a, "--batch") == 0) o->batch = atoll(v);
    else if (strcmp(a, "--layers") == 0) o->layers = atoi(v);
    else if (strcmp(a, "--hidden") == 0) o->hidden = atoi(v);
    else if (strcmp(a, "--lr") == 0) o->lr = (float)atof(v);
    else if (strcmp(a, "--seed") == 0) o->seed = (uint64_t)atoll(v);
    else { usage(); return 0; }
  }
  if (o->stages < 1 || o->stages > MAXW || o->replicas < 1 || o->stages * o->replicas > MAXW ||
      o->layers < 1 || o->layers > MAXL || o->hidden < 1 || o->steps < 1 || o->microbatches < 1 ||
      o->batch < (int64_t)o->microbatches * o->replicas || o->batch > NDATA) {
    fprintf(stderr, "07: need 1 <= stages, replicas; stages * replicas <= %d; 1 <= layers <= %d; "
            "microbatches * replicas <= batch <= %d\n", MAXW, MAXL, NDATA);
    return 0;
  }
  if (o->parallel == 1 && o->stages > o->layers + 1) {
    fprintf(stderr, "07: %d stages for %d layers\n", o->stages, o->layers + 1);
    return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, &o)) return 2;
  make_data(1234);
  mp_ctx c;
  memset(&c, 0, sizeof c);
  c.o = &o;
  dt_cluster *cl = NULL;
  /* Under dtrain-launch (DTRAIN_CONFIG): one rank per process over TCP. */
  if (getenv("DTRAIN_CONFIG") && o.parallel != 0) {
    if (dt_cluster_from_env(&cl) != DTRAIN_OK || !(c.world = dt_comm_create_tcp(cl, NULL))) {
      fprintf(stderr, "07: %s\n", dt_last_error());
      dt_cluster_destroy(cl);
      return 1;
    }
    c.rank = dt_comm_rank(c.world);
    int W = dt_comm_world(c.world);
    /* dtrain-launch --pipeline P / --tensor T: the cluster's layout picks the mode and the stages. */
    int cp = cl->pipeline > 1 ? cl->pipeline : 1, ct = cl->tensor > 1 ? cl->tensor : 1;
    if (cp > 1 && ct > 1) {
      fprintf(stderr, "07: a layout of %d stages x %d tensor ranks: this example runs one or the other\n", cp, ct);
      return 2;
    }
    if (cp > 1 || ct > 1) {
      int want = cp > 1 ? 1 : 2, k = cp > 1 ? cp : ct;
      if ((o.parallel_set && o.parallel != want) || (o.stages_set && o.stages != k)) {
        fprintf(stderr, "07: the launcher's layout (--%s %d) and this program's flags disagree\n",
                cp > 1 ? "pipeline" : "tensor", k);
        return 2;
      }
      o.parallel = want;
      o.stages = k;
    }
    if (W % o.stages != 0) {
      fprintf(stderr, "07: %d processes do not make replicas of %d stages/shards\n", W, o.stages);
      return 2;
    }
    o.replicas = W / o.stages;
  }
  result res;
  memset(&res, 0, sizeof res);
  int ok = o.parallel == 0 ? run_none(&o, &res) : o.parallel == 1 ? run_pipeline(&o, &c, &res) : run_tensor(&o, &c, &res);
  int P = o.parallel == 0 ? 1 : o.stages, M = o.parallel == 1 ? o.microbatches : 1;
  double theory = o.parallel == 1 ? (double)(P - 1) / (double)(M + P - 1) : 0.0;
  double sps = res.seconds > 0 ? (double)o.steps * (double)o.batch / res.seconds : 0.0;
  if (ok && c.rank == 0) {
    if (o.json)
      printf("{\"parallel\": \"%s\", \"stages\": %d, \"microbatches\": %d, \"schedule\": \"%s\", \"replicas\": %d, "
             "\"workers\": %d, \"steps\": %lld, \"batch\": %lld, \"final_loss\": %.7g, \"params_checksum\": %.10g, "
             "\"peak_bytes_per_worker\": %.0f, \"bubble_measured\": %.4f, \"bubble_theory\": %.4f, "
             "\"samples_per_s\": %.1f, \"seconds\": %.3f}\n",
             k_parallel[o.parallel], P, M, o.schedule == DTRAIN_PIPE_GPIPE ? "gpipe" : "1f1b", o.replicas,
             P * o.replicas, (long long)o.steps, (long long)o.batch, res.loss, res.checksum, res.peak_bytes,
             res.bubble, theory, sps, res.seconds);
    else
      printf("%s: %d worker(s) (%d x %d), %lld steps of %lld: loss %.5f, checksum %.8g, %.2f MB per worker at "
             "most, bubble %.3f (theory %.3f), %.0f samples/s\n",
             k_parallel[o.parallel], P * o.replicas, P, o.replicas, (long long)o.steps, (long long)o.batch,
             res.loss, res.checksum, res.peak_bytes / 1048576.0, res.bubble, theory, sps);
  }
  dt_comm_destroy(c.world);
  dt_cluster_destroy(cl);
  return ok ? 0 : 1;
}
