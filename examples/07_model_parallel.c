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
 *            [--layers L] [--hidden H] [--lr X] [--seed S] [--model mlp|transformer] [--json]
 *            [--heads N] [--seq S] [--data FILE]
 *            [--memory-cap MB] [--checkpoint DIR] [--resume DIR]
 *            [--plan [--link SPEC] [--plan-workers N] [--plan-one-machine]]
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
 * on every shard. --model transformer: the character model of examples/03
 * (embeddings, L pre-norm blocks of attention and MLP, the output layer;
 * defaults L 2, H 64, 4 heads, windows of 32 characters of
 * data/text/devils_dictionary.txt); pipeline stages take its units in order,
 * tensor parallel splits its embedding and output layer by vocabulary, its
 * attention by heads and its MLP column then row (see the section below).
 *
 * --json prints one line: model, parallel, stages, microbatches, schedule, replicas,
 * workers, steps, batch, final_loss, params_checksum, peak_bytes_per_worker
 * (parameters, gradients, optimizer state and activation arenas of the
 * largest worker), bubble_measured (the stages' mean idle share of a step),
 * bubble_theory, samples_per_s, seconds, memory_cap_mb and alloc_peak_bytes
 * (with --memory-cap: the largest process's high-water mark in its budget).
 *
 * --memory-cap MB gives each worker a fixed budget (dt_use_fixed_memory: every
 * allocation of the process, its communicator included, from MB per worker it
 * runs); a model over it fails with DTRAIN_ERR_NOMEM and a hint, and trains
 * when spread over more workers. --checkpoint DIR saves, at the end, a part
 * per stage or shard (DIR/part-<stage>-<shard>.safetensors, replica 0's);
 * --resume DIR loads this layout's parts and trains on from their step to
 * --steps (bitwise where one run of --steps ends). tools/dtrain-ckpt gathers
 * the parts into one checkpoint and splits it for another layout:
 *   tools/dtrain-ckpt gather -o full.safetensors ck/part-*
 *   tools/dtrain-ckpt split full.safetensors --tensor 2 -o ck2/part-{stage}-{shard}.safetensors */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#if defined(_WIN32)
#  include <direct.h>
#  define mkdir(path, mode) _mkdir(path) /* no permission bits there */
#endif
#include "example_flags.h"

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
  const char *ckpt_dir, *resume_dir; /* --checkpoint / --resume: a part file per stage or shard */
  int model;                         /* --model: 0 the MLP, 1 the character transformer */
  int heads, seq;                    /* the transformer's heads and window length */
  const char *data;                  /* its text */
  double memory_cap_mb;              /* --memory-cap: each worker's fixed-memory budget (0: none) */
  int plan, plan_workers, plan_one_machine; /* --plan: predict the layouts instead of training */
  const char *link;                  /* --plan's link (dt_plan_link_parse) */
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

/* The transformer's parts (below): its batches, parameters, split kinds and forward. */
static dt_minibatch tbatch_at(const options *o, int64_t step);
static dt_params *part_params(const options *o, int u0, int u1, int T, int t);
static int tkind_of(const options *o, const char *name);
static int units_of(const options *o);
static dt_tensor *tunits(const options *o, dt_graph *g, int u0, int u1, dt_tensor *x, const dt_minibatch *mb,
                         dt_comm *tp, int t);

static dt_minibatch batch_at(const options *o, int64_t step) {
  if (o->model) return tbatch_at(o, step);
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
  b.x += lo * b.x_cols;
  b.y += lo * (b.y_cols > 0 ? b.y_cols : 1);
  b.rows = hi - lo;
  return b;
}

/* ---- the model ---------------------------------------------------------------------------------- */
static int in_of(const options *o, int l) { return l == 0 ? NIN : o->hidden; }
static int out_of(const options *o, int l) { return l == o->layers ? NCLS : o->hidden; }

/* Layer l's whole weight and bias, initialised from the seed and l alone: a
 * worker builds only its own layers, with the values the whole model has. */
/* Tensor parallel: how layer l is split: 1 column (rows of W), 2 row (columns), 0 whole. */
static int tp_kind(const options *o, int l) {
  if (l < o->layers) return l % 2 == 0 ? 1 : 2;
  return o->layers % 2 == 1 ? 2 : 0; /* after a column layer the output layer is row-parallel */
}

/* ---- the character transformer (--model transformer) ------------------------------------------ */
/* 03's model: a token embedding and a learned position table, L pre-norm
 * blocks (causal self-attention, a ReLU MLP of 4C), a final layer norm and the
 * output layer; trained on windows of the Devil's Dictionary to predict every
 * next character. Cut into units -- 0: the embeddings, 1..L: the blocks, L+1:
 * the head -- that pipeline stages take in order. Tensor parallel (Megatron):
 * the embedding by vocabulary rows, each block's attention by heads (Q/K/V
 * rows, projection columns) and its MLP column then row, the output layer by
 * vocabulary with the cross-entropy computed without gathering the logits; the
 * layer norms and the biases after a row-parallel layer are whole on every
 * shard. */
#define TSEQ_MAX 64
#define NWIN 4096
static float win_x[NWIN * TSEQ_MAX];   /* window inputs: character ids as floats (a dt_minibatch carries floats) */
static int32_t win_y[NWIN * TSEQ_MAX]; /* and targets: the next characters */
static int t_vocab;                    /* the text's characters, padded to a multiple of 8 (shards) */

static int make_text(const options *o) {
  dt_text tx;
  if (dt_text_read(o->data, &tx) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  if (tx.n < (int64_t)o->seq + 2) {
    dt_text_free(&tx);
    return fprintf(stderr, "07: %s: too short for windows of %d\n", o->data, o->seq), 0;
  }
  t_vocab = (tx.vocab_size + 7) / 8 * 8;
  for (int64_t w = 0; w < NWIN; w++) {
    int64_t at = (w * 7919) % (tx.n - o->seq - 1);
    for (int t = 0; t < o->seq; t++) {
      win_x[w * o->seq + t] = (float)tx.ids[at + t];
      win_y[w * o->seq + t] = tx.ids[at + t + 1];
    }
  }
  dt_text_free(&tx);
  return 1;
}

static dt_minibatch tbatch_at(const options *o, int64_t step) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  int64_t first = (step * o->batch) % (NWIN - o->batch + 1);
  b.rows = o->batch;
  b.x = win_x + first * o->seq;
  b.x_cols = o->seq;
  b.y = win_y + first * o->seq;
  b.y_cols = o->seq;
  return b;
}

/* One parameter of a unit: its name, whole shape, tensor-parallel cut and initialiser. */
typedef struct tparam {
  char name[48];
  int nd, kind;
  int64_t shape[2];
  dt_init init;
} tparam;

static int units_of(const options *o) { return o->model ? o->layers + 2 : o->layers + 1; }

/* Unit u's parameters (whole shapes); returns how many. */
static int unit_params(const options *o, int u, tparam *t) {
  if (!o->model) { /* the MLP: layer u, W [out, in] and b [out], split as tp_kind says */
    int k = tp_kind(o, u);
    snprintf(t[0].name, sizeof t[0].name, "w%d", u);
    snprintf(t[1].name, sizeof t[1].name, "b%d", u);
    t[0].nd = 2, t[1].nd = 1;
    t[0].kind = k == 1 ? DTRAIN_SPLIT_ROWS : k == 2 ? DTRAIN_SPLIT_COLS : DTRAIN_SPLIT_NONE;
    t[1].kind = k == 1 ? DTRAIN_SPLIT_ROWS : DTRAIN_SPLIT_NONE;
    t[0].shape[0] = t[1].shape[0] = out_of(o, u);
    t[0].shape[1] = in_of(o, u), t[1].shape[1] = 1;
    t[0].init = dt_init_glorot_uniform();
    t[1].init = dt_init_zeros();
    return 2;
  }
  int64_t C = o->hidden, V = t_vocab;
  int n = 0;
#define TP_ADD(nm, d, k, r, c, in)                                            \
  do {                                                                       \
    snprintf(t[n].name, sizeof t[n].name, "%s%s", pre, nm);                  \
    t[n].nd = d, t[n].kind = k, t[n].shape[0] = r, t[n].shape[1] = c;        \
    t[n].init = in;                                                          \
    n++;                                                                     \
  } while (0)
  char pre[32] = "";
  if (u == 0) {
    TP_ADD("tok.weight", 2, DTRAIN_SPLIT_ROWS, V, C, dt_init_normal(0.0f, 1.0f));
    TP_ADD("pos.weight", 2, DTRAIN_SPLIT_NONE, o->seq, C, dt_init_normal(0.0f, 0.1f));
  } else if (u <= o->layers) {
    snprintf(pre, sizeof pre, "blocks.%d.", u - 1);
    TP_ADD("ln1.gamma", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_constant(1.0f));
    TP_ADD("ln1.beta", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_zeros());
    TP_ADD("attn.qkv.weight", 2, DTRAIN_SPLIT_QKV, 3 * C, C, dt_init_glorot_uniform());
    TP_ADD("attn.qkv.bias", 1, DTRAIN_SPLIT_QKV, 3 * C, 1, dt_init_zeros());
    TP_ADD("attn.proj.weight", 2, DTRAIN_SPLIT_COLS, C, C, dt_init_glorot_uniform());
    TP_ADD("attn.proj.bias", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_zeros());
    TP_ADD("ln2.gamma", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_constant(1.0f));
    TP_ADD("ln2.beta", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_zeros());
    TP_ADD("fc1.weight", 2, DTRAIN_SPLIT_ROWS, 4 * C, C, dt_init_glorot_uniform());
    TP_ADD("fc1.bias", 1, DTRAIN_SPLIT_ROWS, 4 * C, 1, dt_init_zeros());
    TP_ADD("fc2.weight", 2, DTRAIN_SPLIT_COLS, C, 4 * C, dt_init_glorot_uniform());
    TP_ADD("fc2.bias", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_zeros());
  } else {
    TP_ADD("ln_f.gamma", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_constant(1.0f));
    TP_ADD("ln_f.beta", 1, DTRAIN_SPLIT_NONE, C, 1, dt_init_zeros());
    TP_ADD("head.weight", 2, DTRAIN_SPLIT_ROWS, V, C, dt_init_glorot_uniform());
    TP_ADD("head.bias", 1, DTRAIN_SPLIT_ROWS, V, 1, dt_init_zeros());
  }
#undef TP_ADD
  return n;
}

/* The split kind of parameter `name` (DTRAIN_SPLIT_*), from the unit tables. */
static int tkind_of(const options *o, const char *name) {
  tparam t[12];
  for (int u = 0; u < units_of(o); u++)
    for (int i = 0, n = unit_params(o, u, t); i < n; i++)
      if (strcmp(t[i].name, name) == 0) return t[i].kind;
  return DTRAIN_SPLIT_NONE;
}

/* Units [u0, u1) (the MLP: layers) of the whole model's initial values as
 * shard t of T (T = 1: whole): each unit's whole values drawn from the seed and
 * the unit alone, then cut (dt_tp_shard_*), in buffers reserved at their exact
 * size (dt_params_reserve: a worker under --memory-cap holds its part, not
 * twice it). NULL when memory runs out. */
static dt_params *part_params(const options *o, int u0, int u1, int T, int t) {
  dt_params *p = dt_params_create(1);
  tparam tp[12];
  size_t floats = 0;
  int count = 0;
  for (int u = u0; u < u1; u++)
    for (int i = 0, n = unit_params(o, u, tp); i < n; i++, count++)
      floats += (size_t)tp[i].shape[0] * (size_t)tp[i].shape[1] / (T > 1 && tp[i].kind ? (size_t)T : 1);
  if (!p || dt_params_reserve(p, count, floats) != DTRAIN_OK) { dt_params_destroy(p); return NULL; }
  for (int u = u0; u < u1; u++) {
    int n = unit_params(o, u, tp);
    dt_params *whole = dt_params_create(o->seed * 1000003u + (o->model ? 7777u : 0u) + (uint64_t)u);
    for (int i = 0; whole && i < n; i++)
      if (dt_params_add(whole, tp[i].name, tp[i].nd, tp[i].shape, tp[i].init) < 0) { dt_params_destroy(whole); whole = NULL; }
    if (!whole) { dt_params_destroy(p); return NULL; }
    for (int i = 0; i < n; i++) {
      int64_t sh[2] = {tp[i].shape[0], tp[i].shape[1]}, rows = sh[0], cols = tp[i].nd == 2 ? sh[1] : 1;
      int k = T > 1 ? tp[i].kind : DTRAIN_SPLIT_NONE;
      if (k == DTRAIN_SPLIT_ROWS || k == DTRAIN_SPLIT_QKV) sh[0] /= T;
      if (k == DTRAIN_SPLIT_COLS) sh[1] /= T;
      int j = dt_params_add(p, tp[i].name, tp[i].nd, sh, dt_init_zeros());
      if (j < 0) { dt_params_destroy(whole); dt_params_destroy(p); return NULL; }
      dt_param_info pi, wi;
      dt_params_info(p, j, &pi);
      dt_params_info(whole, i, &wi);
      const float *src = dt_params_data(whole) + wi.offset;
      float *dst = dt_params_data(p) + pi.offset;
      if (k == DTRAIN_SPLIT_ROWS) dt_tp_shard_rows(src, rows, cols, T, t, dst);
      else if (k == DTRAIN_SPLIT_COLS) dt_tp_shard_cols(src, rows, cols, T, t, dst);
      else if (k == DTRAIN_SPLIT_QKV) dt_tp_shard_qkv(src, rows, cols, T, t, dst);
      else memcpy(dst, src, wi.size * sizeof(float));
    }
    dt_params_destroy(whole);
  }
  return p;
}

/* Units [u0, u1) on x (NULL for unit 0: mb's ids) with the graph's params
 * from index 0 (the units' parameters in order); tp == NULL: whole (T = 1).
 * The head unit returns the mean cross-entropy over mb's rows x seq. */
static dt_tensor *tunits(const options *o, dt_graph *g, int u0, int u1, dt_tensor *x, const dt_minibatch *mb,
                         dt_comm *tp, int t) {
  const int64_t B = mb->rows, S = o->seq, C = o->hidden, N = B * S;
  int64_t s3[3] = {B, S, C};
  int base = 0;
  for (int u = u0; u < u1; u++) {
#define PRM(i) dt_param(g, base + (i))
    if (u == 0) {
      int32_t *ids = (int32_t *)malloc((size_t)N * sizeof(int32_t));
      if (!ids) return NULL;
      for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)mb->x[i];
      dt_tensor *e = tp ? dt_tp_embedding(g, PRM(0), ids, N, tp, t) : dt_embedding(g, PRM(0), ids, N); /* ids copied */
      free(ids);
      x = dt_add(g, dt_reshape(g, e, 3, s3), dt_slice(g, PRM(1), 0, 0, S));
      base += 2;
    } else if (u <= o->layers) {
      dt_tensor *h = dt_layer_norm(g, x, PRM(0), PRM(1), 1e-5f), *a;
      if (tp) {
        a = dt_tp_attention(g, h, PRM(2), PRM(3), PRM(4), PRM(5), o->heads, tp, t);
      } else {
        dt_nn_attention at = {{base + 2, base + 3, C, 3 * C}, {base + 4, base + 5, C, C}, C, o->heads};
        a = dt_nn_attention_forward(g, &at, h);
      }
      x = dt_add(g, x, a);
      h = dt_reshape2(g, dt_layer_norm(g, x, PRM(6), PRM(7), 1e-5f), N, C);
      dt_tensor *m = tp ? dt_tp_column_linear(g, h, PRM(8), PRM(9), tp, t, 0) : dt_linear(g, h, PRM(8), PRM(9));
      m = dt_relu(g, m);
      m = tp ? dt_tp_row_linear(g, m, PRM(10), PRM(11), tp, t) : dt_linear(g, m, PRM(10), PRM(11));
      x = dt_add(g, x, dt_reshape(g, m, 3, s3));
      base += 12;
    } else {
      dt_tensor *h = dt_reshape2(g, dt_layer_norm(g, x, PRM(0), PRM(1), 1e-5f), N, C);
      dt_tensor *lg = tp ? dt_tp_column_linear(g, h, PRM(2), PRM(3), tp, t, 0) : dt_linear(g, h, PRM(2), PRM(3));
      x = tp ? dt_tp_cross_entropy(g, lg, mb->y, tp, t) : dt_cross_entropy(g, lg, mb->y);
      base += 4;
    }
#undef PRM
  }
  return x;
}

/* ---- checkpoints: one part per stage or shard (dt_checkpoint_save_part) ----------------------- */
static void part_path(char *out, size_t cap, const char *dir, int s, int t) {
  snprintf(out, cap, "%s/part-%d-%d.safetensors", dir, s, t);
}

/* Saves this worker's part (stage s of P, shard t of T) in --checkpoint DIR, with
 * every layer's tensor-parallel cut declared (also at T = 1), so that
 * tools/dtrain-ckpt can gather the parts and split them for any layout. */
static int save_part(const options *o, dt_params *p, dt_optim *opt, int s, int P, int t, int T) {
  const char *names[12 * (MAXL + 2)];
  int kinds[12 * (MAXL + 2)], n = 0;
  char path[1024];
  for (int i = 0; i < dt_params_count(p); i++) {
    dt_param_info in;
    dt_params_info(p, i, &in);
    int kind = tkind_of(o, in.name);
    if (kind != DTRAIN_SPLIT_NONE) names[n] = in.name, kinds[n++] = kind;
  }
  dt_part part = {s, P, t, T, n, names, kinds};
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = p;
  st.optim = opt;
  part_path(path, sizeof path, o->ckpt_dir, s, t);
  if (dt_checkpoint_save_part(path, &st, &part) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  return 1;
}

/* Loads this worker's part from --resume DIR; *k0: the step it was saved at. */
static int load_part(const options *o, dt_params *p, dt_optim *opt, int s, int t, int64_t *k0) {
  char path[1024];
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = p;
  st.optim = opt;
  part_path(path, sizeof path, o->resume_dir, s, t);
  if (dt_checkpoint_load(path, &st) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  *k0 = st.step;
  return 1;
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
  int64_t steps_run; /* steps this run made (a resumed run starts past 0) */
  int nomem;         /* a worker ran out of memory (--memory-cap) */
} result;

static double checksum_of(const dt_params *p, int skip_replicated, const options *o, int T) {
  double s = 0.0;
  const float *d = dt_params_data((dt_params *)(uintptr_t)p);
  for (int i = 0; i < dt_params_count(p); i++) {
    dt_param_info in;
    dt_params_info(p, i, &in);
    if (skip_replicated && o->model) { /* a replicated tensor-parallel parameter counts once (shard 0) */
      if (T > 1 && tkind_of(o, in.name) == DTRAIN_SPLIT_NONE) continue;
    } else if (skip_replicated) {
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
  if (o->model) return tunits(o, g, 0, units_of(o), NULL, b, NULL, 0);
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
  dt_params *P = part_params(o, 0, units_of(o), 1, 0);
  dt_optim_options oo = adam(o);
  dt_optim *opt = P ? dt_optim_create(P, &oo) : NULL;
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = opt ? dt_strategy_create(P, opt, full_step, (void *)(uintptr_t)o, &sd) : NULL;
  if (!s) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  float loss = 0;
  int64_t k0 = 0;
  if (o->resume_dir && !load_part(o, P, opt, 0, 0, &k0)) return 0;
  double t0 = dt_time_now();
  for (int64_t k = k0; k < o->steps; k++) {
    dt_minibatch b = batch_at(o, k);
    if (dt_strategy_step(s, &b, &loss) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  }
  res->seconds = dt_time_now() - t0;
  res->steps_run = o->steps > k0 ? o->steps - k0 : 0;
  if (o->ckpt_dir && !save_part(o, P, opt, 0, 1, 0, 1)) return 0;
  res->loss = loss;
  res->checksum = checksum_of(P, 0, o, 1);
  res->peak_bytes = state_bytes(opt, P) + (double)dt_graph_bytes_peak(dt_strategy_graph(s, 0));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return 1;
}

/* ---- --plan: what each layout would give, before training (the MLP) ---------------------------
 * dt_plan_measure times the whole model on this machine (one_device's step);
 * what the layouts split comes from the layers: tensor parallel splits the
 * hidden layers and, after a column layer, the output layer (tp_kind), a
 * row-parallel layer all-reduces its output forward and a column layer its
 * input's gradient backward (not the first: its input is the data); the
 * pipeline cuts between layers, each cut carrying H floats a sample. */
static int run_plan(const options *o) {
  if (o->model) return fprintf(stderr, "07: --plan is for the MLP (--model mlp)\n"), 2;
  dt_plan_link link;
  if (dt_plan_link_parse(o->link ? o->link : "loopback", &link) != DTRAIN_OK)
    return fprintf(stderr, "error: --link: %s\n", dt_last_error()), 2;
  dt_params *P = part_params(o, 0, units_of(o), 1, 0);
  dt_optim_options oo = adam(o);
  dt_optim *opt = P ? dt_optim_create(P, &oo) : NULL;
  dt_minibatch b = batch_at(o, 0);
  dt_plan_model m;
  if (!opt || dt_plan_measure(P, opt, full_step, (void *)(uintptr_t)o, &b, 30, &m) != DTRAIN_OK) {
    fprintf(stderr, "07: %s\n", dt_last_error());
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    return 1;
  }
  /* Which share of the step's work splits: the ops' own times (the profile,
   * 20 one_device steps), the linear layers' by their multiply-adds in split
   * layers, the tanh's by those after a column layer (on 1/T of the units;
   * after a row layer every rank applies it to the whole output); the loss
   * and the rest stay whole. */
  double split_macs = 0, all_macs = 0, sp = 0, ap = 0; /* sp, ap: split parameters, all (a column layer's W
                                                          * rows and bias, a row layer's W columns) */
  int k = 0, T = 1, tanh_split = 0;
  for (int l = 0; l <= o->layers; l++) {
    double in = l == 0 ? NIN : o->hidden, out = l == o->layers ? NCLS : o->hidden;
    int kind = tp_kind(o, l);
    all_macs += in * out;
    ap += in * out + out;
    sp += kind == 1 ? in * out + out : kind == 2 ? in * out : 0;
    if (kind) split_macs += in * out;
    if (kind == 1 && l < o->layers) tanh_split++;
    if (kind == 2) k++, m.tp_bytes_per_sample += (int64_t)out * (int64_t)sizeof(float);
    if (kind == 1 && l > 0) k++, m.tp_bytes_per_sample += (int64_t)in * (int64_t)sizeof(float);
  }
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *st = dt_strategy_create(P, opt, full_step, (void *)(uintptr_t)o, &sd);
  double t_lin = 0, t_tanh = 0, t_all = 0;
  float loss;
  int ok = st != NULL;
  /* (dt_profile_start clears the profile: this example has none of its own to lose) */
  for (int i = 0; ok && i < 25; i++) {
    if (i == 5) dt_profile_start();
    ok = dt_strategy_step(st, &b, &loss) == DTRAIN_OK;
  }
  dt_profile_stop();
  if (!ok) {
    fprintf(stderr, "07: %s\n", dt_last_error());
    dt_strategy_destroy(st);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    return 1;
  }
  dt_profile_entry pe[128];
  int np = dt_profile_read(pe, 128);
  for (int i = 0; i < np && i < 128; i++) {
    if (pe[i].phase != DTRAIN_PROFILE_FORWARD && pe[i].phase != DTRAIN_PROFILE_BACKWARD) continue;
    t_all += pe[i].seconds;
    if (strcmp(pe[i].name, "dt_linear") == 0) t_lin += pe[i].seconds;
    if (strcmp(pe[i].name, "dt_tanh") == 0) t_tanh += pe[i].seconds;
  }
  dt_strategy_destroy(st);
  double split = t_lin * split_macs / all_macs + (o->layers ? t_tanh * tanh_split / o->layers : 0.0);
  while (o->hidden % (2 * T) == 0 && 2 * T <= MAXW) T *= 2; /* the split sizes are all H */
  m.tp_max_ranks = o->hidden >= 2 ? T : 0;
  m.tp_split_share = t_all > 0 ? split / t_all : 0.0;
  m.tp_param_share = sp / ap;
  m.tp_allreduces = k;
  m.pipeline_max_stages = o->layers + 1;
  m.boundary_bytes_per_sample = (int64_t)o->hidden * (int64_t)sizeof(float);
  dt_plan_options po;
  memset(&po, 0, sizeof po);
  po.batch = (int)o->batch;
  po.max_workers = o->plan_workers;
  po.link = link;
  po.shared_cores = o->plan_one_machine || !o->link;
  po.links_per_connection = po.shared_cores;
  po.microbatches = o->microbatches;
  dt_plan_row rows[256];
  int n = dt_plan_predict(&m, &po, rows, 256), best = -1;
  char why[512];
  if (n > 256) n = 256;
  if (n > 0) best = dt_plan_recommend(rows, n, why, sizeof why);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  if (n < 0) return fprintf(stderr, "07: %s\n", dt_last_error()), 1;
  if (o->json) {
    printf("{\"model\": \"mlp\", \"layers\": %d, \"hidden\": %d, \"batch\": %lld, \"link\": {\"latency_s\": %.6g, "
           "\"bandwidth_Bps\": %.6g}, \"shared_cores\": %d, \"measured\": {\"per_sample_s\": %.6g, \"fixed_s\": %.6g, "
           "\"update_s\": %.6g, \"params\": %lld, \"busy_slowdown\": %.3f, \"busy_cores\": %d, \"jitter\": %.3f, "
           "\"tp_split_share\": %.6f, \"tp_param_share\": %.6f, \"tp_allreduces\": %d, \"tp_bytes_per_sample\": %lld, \"memory_Bps\": %.4g}, "
           "\"strategies\": [",
           o->layers, o->hidden, (long long)o->batch, link.latency_s, link.bandwidth_Bps, po.shared_cores,
           m.per_sample_s, m.fixed_s, m.update_s, (long long)m.params, m.busy_slowdown, m.busy_cores, m.jitter,
           m.tp_split_share, m.tp_param_share, m.tp_allreduces, (long long)m.tp_bytes_per_sample, m.memory_Bps);
    int first = 1;
    for (int i = 0; i < n; i++) {
      const dt_plan_row *r = &rows[i];
      if (strcmp(r->family, "one_device") && strcmp(r->family, "tensor") && strcmp(r->family, "pipeline")) continue;
      printf("%s{\"name\": \"%s\", \"workers\": %d, \"samples_per_sec\": %.1f, \"step_s\": %.6g, \"comm_share\": "
             "%.4f, \"bubble\": %.4f, \"memory_bytes_per_worker\": %.0f}", first ? "" : ", ", r->name, r->workers,
             r->samples_per_sec, r->step_s, r->comm_share, r->bubble, r->memory_bytes);
      first = 0;
    }
    printf("]}\n");
    return 0;
  }
  printf("plan: mlp, %d hidden layers of %d, batch %lld, link latency %.3g ms, %.4g MB/s, %s\n", o->layers,
         o->hidden, (long long)o->batch, link.latency_s * 1e3, link.bandwidth_Bps / 1e6,
         po.shared_cores ? "the ranks sharing this machine's cores" : "a machine per rank");
  printf("  measured: %.3g us a sample, update %.3g ms; tensor parallel splits %.1f%% of it, %d all-reduces a step of "
         "%lld bytes a sample together\n", m.per_sample_s * 1e6, m.update_s * 1e3, 100 * m.tp_split_share,
         m.tp_allreduces, (long long)m.tp_bytes_per_sample);
  printf("  %-26s %7s %12s %8s %7s %10s\n", "layout", "workers", "samples/s", "speedup", "comm", "MB/worker");
  for (int i = 0; i < n; i++) {
    const dt_plan_row *r = &rows[i];
    if (strcmp(r->family, "one_device") && strcmp(r->family, "tensor") && strcmp(r->family, "pipeline")) continue;
    printf("  %-26s %7d %12.0f %7.2fx %6.0f%% %10.2f\n", r->name, r->workers, r->samples_per_sec, r->speedup,
           100 * r->comm_share, r->memory_bytes / 1048576.0);
  }
  if (best >= 0) printf("fastest of all the planner's rows: %s\n", why);
  return 0;
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
  if (o->model) return tunits(o, g, c->first[stage], c->first[stage + 1], x, mb, NULL, 0);
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
  if (dt_comm_allreduce(c->world, c->rank, b, 2) != DTRAIN_OK) fprintf(stderr, "07: %s\n", dt_last_error());
  return (double)b[0] + (double)b[1];
}

/* Largest v over the job's ranks. */
static double job_max(mp_ctx *c, double v) {
  if (!c->world) return v;
  int W = dt_comm_world(c->world);
  float *b = (float *)calloc((size_t)W, sizeof(float));
  b[c->rank] = (float)v;
  if (dt_comm_allreduce(c->world, c->rank, b, (size_t)W) != DTRAIN_OK) fprintf(stderr, "07: %s\n", dt_last_error());
  double m = 0;
  for (int i = 0; i < W; i++) m = b[i] > m ? b[i] : m;
  free(b);
  return m;
}

static int run_pipeline(const options *o, mp_ctx *c, result *res) {
  int P = o->stages, R = o->replicas, L = units_of(o);
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
  for (int i = 0; i < n; i++)
    if (!ps[i]) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  dt_optim_options oo = adam(o);
  dt_pipeline *pl = dt_pipeline_create(ps, &oo, stage_fn, c, &po);
  if (!pl) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  float loss = 0;
  int64_t k0 = 0;
  /* --resume: every replica's stage s from part s (a process: its own stage). */
  for (int i = 0; o->resume_dir && i < n; i++) {
    int s = c->world ? lay.stage : i % P;
    if (!load_part(o, ps[i], dt_pipeline_optim(pl, c->world ? s : i), s, 0, &k0)) return 0;
  }
  double t0 = dt_time_now();
  for (int64_t k = k0; k < o->steps; k++) {
    dt_minibatch b = batch_at(o, k);
    if (c->world) b = part_of(b, lay.dp_rank, R);
    if (dt_pipeline_step(pl, &b, &loss) != DTRAIN_OK) return fprintf(stderr, "07: %s\n", dt_last_error()), 0;
  }
  res->seconds = dt_time_now() - t0;
  res->steps_run = o->steps > k0 ? o->steps - k0 : 0;
  /* --checkpoint: replica 0's stages, a part each. */
  for (int i = 0; o->ckpt_dir && i < (c->world ? (lay.dp_rank == 0) : P); i++) {
    int s = c->world ? lay.stage : i;
    if (!save_part(o, ps[i], dt_pipeline_optim(pl, s), s, P, 0, 1)) return 0;
  }
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
  int64_t steps_run;
  int nomem;
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
  dt_params *P = part_params(o, 0, units_of(o), r->T, r->t);
  dt_optim_options oo = adam(o);
  dt_optim *opt = P ? dt_optim_create(P, &oo) : NULL;
  dt_graph *g = opt ? dt_graph_create(P, NULL) : NULL;
  int64_t k0 = 0;
  r->ok = g != NULL;
  if (!r->ok) fprintf(stderr, "07: shard %d replica %d: %s\n", r->t, r->d, dt_last_error());
  else if (o->resume_dir) r->ok = load_part(o, P, opt, 0, r->t, &k0); /* prints its error */
  if (!r->ok) {
    /* The other ranks may be waiting in a collective for this one: break it. */
    r->nomem = dt_last_result() == DTRAIN_ERR_NOMEM;
    dt_comm_abort(r->tp, r->t);
    if (r->dp) dt_comm_abort(r->dp, r->d);
    dt_graph_destroy(g);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    return;
  }
  double t0 = dt_time_now();
  for (int64_t k = k0; k < o->steps && r->ok; k++) {
    dt_minibatch gb = batch_at(o, k), b = part_of(gb, r->d, r->R);
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *l = o->model ? tunits(o, g, 0, units_of(o), NULL, &b, r->T > 1 ? r->tp : NULL, r->t)
                            : dt_cross_entropy(g, tp_forward(o, g, input_of(g, &b), r->tp, r->t), b.y);
    float w = (float)b.rows / (float)gb.rows, lw[1];
    r->ok = l && dt_backward_grad(g, l, &w) == DTRAIN_OK;
    lw[0] = r->ok ? w * l->data[0] : 0.0f;
    if (r->ok && r->R > 1)
      r->ok = dt_comm_allreduce(r->dp, r->d, dt_params_grad(P), dt_params_size(P)) == DTRAIN_OK &&
              dt_comm_allreduce(r->dp, r->d, lw, 1) == DTRAIN_OK;
    if (r->ok) r->ok = dt_optim_step(opt) == DTRAIN_OK;
    r->loss = lw[0];
  }
  if (!r->ok) {
    fprintf(stderr, "07: shard %d replica %d: %s\n", r->t, r->d, dt_last_error());
    r->nomem = dt_last_result() == DTRAIN_ERR_NOMEM;
    dt_comm_abort(r->tp, r->t);
    if (r->dp) dt_comm_abort(r->dp, r->d);
  }
  r->seconds = dt_time_now() - t0;
  r->steps_run = o->steps > k0 ? o->steps - k0 : 0;
  if (r->ok && o->ckpt_dir && r->d == 0) r->ok = save_part(o, P, opt, 0, 1, r->t, r->T);
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
    fprintf(stderr, "07: worker %d: %s\n", th->index, dt_last_error()); /* this thread's error */
    th->r.ok = 0;
    dt_comm_abort(th->all, th->index); /* the others wait in the same split: end their wait too */
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
  if (o->model && (o->heads % T != 0 || t_vocab % T != 0))
    return fprintf(stderr, "07: %d heads and a vocabulary of %d do not divide into %d shards\n", o->heads, t_vocab, T), 0;
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
    res->nomem = r.nomem;
    if (!r.ok) return 0;
    res->loss = r.loss;
    res->seconds = r.seconds;
    res->steps_run = r.steps_run;
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
    res->nomem |= th[i].r.nomem;
    res->checksum += th[i].r.checksum;
    if (th[i].r.peak > res->peak_bytes) res->peak_bytes = th[i].r.peak;
    if (th[i].r.seconds > res->seconds) res->seconds = th[i].r.seconds;
  }
  res->loss = th[0].r.loss;
  res->steps_run = th[0].r.steps_run;
  free(th);
  free(tid);
  dt_comm_destroy(all);
  return ok;
}

/* ---- main --------------------------------------------------------------------------------------- */
static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->stages = 2;
  o->microbatches = 4;
  o->replicas = 1;
  o->steps = 50;
  o->batch = 64;
  o->layers = 8;
  o->hidden = 256;
  o->lr = 0.002f;
  o->seed = 1;
  o->heads = 4;
  o->seq = 32;
  o->plan_workers = 8;
  o->data = "data/text/devils_dictionary.txt";
  const char *parallel = "pipeline", *schedule = "1f1b", *model = "mlp";
  const char *trace = NULL; /* --trace */
  const ex_flag flags[] = {
      {"parallel", 's', &parallel, 0, 0, "none (one_device, the reference), pipeline or tensor"},
      {"stages", 'i', &o->stages, 1, MAXW, "pipeline stages or tensor-parallel shards (P)"},
      {"microbatches", 'i', &o->microbatches, 1, 16383, "pipeline micro-batches per step (M)"},
      {"schedule", 's', &schedule, 0, 0, "pipeline schedule: gpipe or 1f1b"},
      {"replicas", 'i', &o->replicas, 1, MAXW, "data-parallel copies on top (threads; processes: world / P)"},
      {"steps", 'l', &o->steps, 1, 1e12, "training steps in all (a resumed run goes on to this step)"},
      {"batch", 'l', &o->batch, 1, NDATA, "global batch: rows (mlp) or windows (transformer) per step"},
      {"model", 's', &model, 0, 0, "mlp or transformer (the character model of examples/03)"},
      {"layers", 'i', &o->layers, 1, MAXL, "hidden layers (mlp); blocks (transformer, default 2)"},
      {"hidden", 'i', &o->hidden, 1, 1 << 16, "hidden width (mlp); model width (transformer, default 64)"},
      {"heads", 'i', &o->heads, 1, 256, "attention heads (transformer)"},
      {"seq", 'i', &o->seq, 1, TSEQ_MAX, "characters per window (transformer)"},
      {"data", 's', &o->data, 0, 0, "the text (transformer)"},
      {"lr", 'f', &o->lr, 0, 100, "Adam's learning rate"},
      {"seed", 'u', &o->seed, 0, 1.8e19, "seed of the data and the initial parameters"},
      {"memory-cap", 'd', &o->memory_cap_mb, 1e-3, 1e7, "each worker's memory budget in MB (0: none)"},
      {"checkpoint", 's', &o->ckpt_dir, 0, 0, "save a part per stage or shard in this directory at the end"},
      {"resume", 's', &o->resume_dir, 0, 0, "load this layout's parts from this directory and train on"},
      {"json", 'b', &o->json, 0, 0, "print one JSON line"},
      {"trace", 's', &trace, 0, 0, EX_TRACE_HELP},
      {"plan", 'b', &o->plan, 0, 0, "predict one_device, the pipeline and tensor-parallel layouts (no training)"},
      {"plan-workers", 'i', &o->plan_workers, 1, MAXW, "--plan: the most stages or ranks to predict for"},
      {"link", 's', &o->link, 0, 0, "--plan: the link, rate=100mbit,delay=1ms or bandwidth=...,latency=... "
                                   "(default loopback, the ranks on this machine)"},
      {"plan-one-machine", 'b', &o->plan_one_machine, 0, 0, "--plan: with --link, the ranks still share this machine"},
  };
  int r = ex_parse("07_model_parallel", argc, argv, flags, (int)(sizeof flags / sizeof flags[0]),
                   "  Processes: tools/dtrain-launch -n W [--pipeline P | --tensor T] -- build/examples/07_model_parallel ...\n");
  if (r <= 0) return r;
  if (!ex_trace_begin(trace)) return 0;
  o->parallel = strcmp(parallel, "none") == 0 ? 0 : strcmp(parallel, "pipeline") == 0 ? 1 : strcmp(parallel, "tensor") == 0 ? 2 : -1;
  if (o->parallel < 0) { fprintf(stderr, "error: --parallel: none, pipeline or tensor, not '%s'\n", parallel); return 0; }
  o->schedule = strcmp(schedule, "gpipe") == 0 ? DTRAIN_PIPE_GPIPE : strcmp(schedule, "1f1b") == 0 ? DTRAIN_PIPE_1F1B : -1;
  if (o->schedule < 0) { fprintf(stderr, "error: --schedule: gpipe or 1f1b, not '%s'\n", schedule); return 0; }
  o->model = strcmp(model, "mlp") == 0 ? 0 : strcmp(model, "transformer") == 0 ? 1 : -1;
  if (o->model < 0) { fprintf(stderr, "error: --model: mlp or transformer, not '%s'\n", model); return 0; }
  o->parallel_set = ex_given(argc, argv, "parallel");
  o->stages_set = ex_given(argc, argv, "stages");
  int layers_set = ex_given(argc, argv, "layers"), hidden_set = ex_given(argc, argv, "hidden");
  if (o->model && !layers_set) o->layers = 2;  /* the transformer: 03's size */
  if (o->model && !hidden_set) o->hidden = 64;
  if (o->model && (o->heads < 1 || o->hidden % o->heads != 0 || o->seq < 1 || o->seq > TSEQ_MAX || o->batch > NWIN)) {
    fprintf(stderr, "07: the transformer needs --hidden a multiple of --heads, 1 <= --seq <= %d, --batch <= %d\n",
            TSEQ_MAX, NWIN);
    return 0;
  }
  if (o->stages < 1 || o->stages > MAXW || o->replicas < 1 || o->stages * o->replicas > MAXW ||
      o->layers < 1 || o->layers > MAXL || o->hidden < 1 || o->steps < 1 || o->microbatches < 1 ||
      o->batch < (int64_t)o->microbatches * o->replicas || o->batch > NDATA) {
    fprintf(stderr, "07: need 1 <= stages, replicas; stages * replicas <= %d; 1 <= layers <= %d; "
            "microbatches * replicas <= batch <= %d\n", MAXW, MAXL, NDATA);
    return 0;
  }
  if (o->parallel == 1 && o->stages > units_of(o)) {
    fprintf(stderr, "07: %d stages for %d %s\n", o->stages, units_of(o), o->model ? "units (embedding, blocks, head)" : "layers");
    return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, by the example, not by dtrain's logger too */
  options o;
  int pr = parse(argc, argv, &o);
  if (pr <= 0) return pr < 0 ? 0 : 2;
  /* An output that cannot be written fails now, not after the training. */
  if (o.ckpt_dir && mkdir(o.ckpt_dir, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "error: --checkpoint %s: cannot create the directory: %s\n", o.ckpt_dir, strerror(errno));
    return 2;
  }
  if (o.model ? !make_text(&o) : (make_data(1234), 0)) return 1;
  if (o.plan) return run_plan(&o);
  /* --memory-cap MB: every allocation of this process from one fixed buffer of
   * MB per worker it runs (threads: all of them; a process under
   * dtrain-launch: one), its communicator included. */
  void *cap_buf = NULL;
  size_t cap_bytes = 0;
  if (o.memory_cap_mb > 0) {
    int here = getenv("DTRAIN_CONFIG") && o.parallel != 0 ? 1 : o.parallel == 0 ? 1 : o.stages * o.replicas;
    cap_bytes = (size_t)(o.memory_cap_mb * 1048576.0) * (size_t)here;
    cap_buf = malloc(cap_bytes);
    if (!cap_buf || dt_use_fixed_memory(cap_buf, cap_bytes) != DTRAIN_OK) {
      fprintf(stderr, "07: --memory-cap: cannot set up %zu bytes: %s\n", cap_bytes, dt_last_error());
      return 1;
    }
  }
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
  if (!ok && cap_buf && (res.nomem || dt_last_result() == DTRAIN_ERR_NOMEM))
    fprintf(stderr, "07: the model does not fit --memory-cap %g MB per worker: spread it over more workers "
            "(--parallel pipeline --stages P, or --parallel tensor)\n", o.memory_cap_mb);
  double alloc_peak = cap_buf ? job_max(&c, (double)dt_fixed_memory_peak()) : 0.0;
  int P = o.parallel == 0 ? 1 : o.stages, M = o.parallel == 1 ? o.microbatches : 1;
  double theory = o.parallel == 1 ? (double)(P - 1) / (double)(M + P - 1) : 0.0;
  double sps = res.seconds > 0 ? (double)res.steps_run * (double)o.batch / res.seconds : 0.0;
  if (ok && c.rank == 0) {
    if (o.json)
      printf("{\"model\": \"%s\", \"parallel\": \"%s\", \"stages\": %d, \"microbatches\": %d, \"schedule\": \"%s\", \"replicas\": %d, "
             "\"workers\": %d, \"steps\": %lld, \"batch\": %lld, \"final_loss\": %.7g, \"params_checksum\": %.10g, "
             "\"peak_bytes_per_worker\": %.0f, \"bubble_measured\": %.4f, \"bubble_theory\": %.4f, "
             "\"samples_per_s\": %.1f, \"seconds\": %.3f, \"memory_cap_mb\": %g, \"alloc_peak_bytes\": %.0f}\n",
             o.model ? "transformer" : "mlp", k_parallel[o.parallel], P, M, o.schedule == DTRAIN_PIPE_GPIPE ? "gpipe" : "1f1b", o.replicas,
             P * o.replicas, (long long)o.steps, (long long)o.batch, res.loss, res.checksum, res.peak_bytes,
             res.bubble, theory, sps, res.seconds, o.memory_cap_mb, alloc_peak);
    else
      printf("%s: %d worker(s) (%d x %d), %lld steps of %lld: loss %.5f, checksum %.8g, %.2f MB per worker at "
             "most, bubble %.3f (theory %.3f), %.0f samples/s\n",
             k_parallel[o.parallel], P * o.replicas, P, o.replicas, (long long)o.steps, (long long)o.batch,
             res.loss, res.checksum, res.peak_bytes / 1048576.0, res.bubble, theory, sps);
  }
  dt_comm_destroy(c.world);
  dt_cluster_destroy(cl);
  if (cap_buf) {
    dt_set_allocator(NULL);
    free(cap_buf);
  }
  return ok ? 0 : 1;
}
