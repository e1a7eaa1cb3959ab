/* 02_fashion_mnist.c -- train an MLP or a CNN on Fashion-MNIST.
 *
 * Shows: loading IDX data (gzip read directly), a seeded loader, a model
 * written once as a forward function and a step function, a strategy chosen
 * by one flag (one_device, mirrored, central_storage, async), the dt_fit loop
 * with a progress bar, evaluation every epoch, a metrics CSV and an SVG chart,
 * checkpoints and bitwise resume, and a final JSON line for scripts.
 *
 * Build: make (-> build/examples/02_fashion_mnist), or
 *        cc -std=c11 -O2 -I. examples/02_fashion_mnist.c -o fmnist -lm -lpthread
 * Run:   build/examples/02_fashion_mnist --model mlp --epochs 10
 *        build/examples/02_fashion_mnist --model cnn --epochs 3 --checkpoint cnn.safetensors
 *        build/examples/02_fashion_mnist --resume cnn.safetensors --epochs 5
 *        build/examples/02_fashion_mnist --strategy mirrored --replicas 2
 *        build/examples/02_fashion_mnist --init-weights torch.safetensors --evaluate --json
 *   (--init-weights: start from weights trained elsewhere: a dtrain checkpoint,
 *   or PyTorch's through tools/dtrain_torch.py, whose FashionMLP / FashionCNN
 *   are these two models with the same names and layouts; --evaluate: only
 *   the test set's accuracy and loss of those weights)
 *   On GPUs (build/examples/02_fashion_mnist_cuda, built where nvcc is;
 *   NOT YET RUN ON A GPU; evaluation runs on the CPU on the parameters the
 *   strategy copies back after each step; --checkpoint/--resume work as on
 *   the CPU, and a checkpoint of a GPU run resumes on the CPU and the other
 *   way round):
 *        build/examples/02_fashion_mnist_cuda --device cuda --model cnn
 *        build/examples/02_fashion_mnist_cuda --device cuda --strategy mirrored   (every GPU)
 *        build/examples/02_fashion_mnist_cuda --device cuda --strategy mirrored --replicas 2
 *   (the same strategy code: desc.devices puts one replica on each GPU)
 *   Across processes (the cluster from DTRAIN_CONFIG or --rank/--world/--peers):
 *        tools/dtrain-launch -n 2 -- build/examples/02_fashion_mnist --strategy multi_worker_mirrored
 *        tools/dtrain-launch -n 2 --ps 1 -- build/examples/02_fashion_mnist --strategy parameter_server
 *   (--batch is the global batch under every strategy, as in TensorFlow: each
 *   of W workers reads --batch/W rows of its shard per step and each of its
 *   R replicas takes --batch/(W*R), so one command trains on the same samples
 *   per step whichever strategy runs it; a batch that does not divide is
 *   refused before any data is loaded; worker 0 prints, writes the CSV, the chart and the checkpoints; servers write
 *   shard checkpoints into --checkpoint-dir)
 * Data:  --data DIR, else /usr/share/datasets/fashion-mnist (Debian package
 *        dataset-fashion-mnist), else the test split shipped in data/ (then
 *        8000 of its images train and 2000 test).
 * Prints the progress, the test accuracy each epoch, where the chart went,
 * and with --json one final line of JSON. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h"
#include <errno.h>
#ifdef FMNIST_CUDA /* the _cuda build: linked with the CUDA backend (dtrain_cuda.h) */
#  include "dtrain_cuda.h"
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct options {
  const char *model, *optimizer, *data, *checkpoint, *resume, *csv, *svg, *schedule, *strategy, *checkpoint_dir;
  const char *device; /* "cpu", "cuda", "cuda:N" */
  const char *precision; /* --precision: fp32, or bf16 (dt_set_matmul_precision) */
  const char *compress_text; /* --compress */
  int overlap;               /* --overlap */
  int push_early;            /* --push-early */
  const char *init_weights;  /* --init-weights: a safetensors file of the model's weights */
  int evaluate;              /* --evaluate: test-set accuracy of the weights, no training */
  int bucket_kb;             /* --bucket-kb */
  dt_compress compress;
  int epochs, batch, json, quiet, replicas, max_staleness;
  int profile;
  const char *trace; /* --trace FILE: the run's timeline (dt_trace_start) */
  int plan;          /* --plan: predict every strategy's speed for this model and link, then exit */
  const char *link;  /* --link: the link between processes for --plan (rate=...,delay=...) */
  int plan_workers;  /* --plan-workers: rows up to this many workers */
  int plan_one_machine; /* --plan-one-machine: the processes share this machine's cores */
  int plan_weak;     /* --plan-weak: --batch is each worker's (the global batch grows with the workers) */
  int plan_servers;  /* --plan-servers: parameter servers M in the parameter_server rows */
  int staleness_lr; /* --staleness-lr: async updates (or, on parameter servers, pushes) scaled by 1/(1+staleness) */
  int async_in_place; /* --async-in-place: async replicas compute on the store itself (dt_strategy_options) */
  int async_sharded;  /* --async-sharded: each async replica updates its own slice of the parameters */
  int batch_worker; /* not a flag: --batch over the worker processes, the rows this process loads per step */
  int64_t limit; /* train on the first `limit` samples only (0: all) */
  float lr;
  float target_accuracy; /* --target-accuracy: 0 off */
  uint64_t seed;
} options;

/* ---- the model: layers plus one forward function (examples/fashion_model.h) ------- */
#include "fashion_model.h"

/* Rows whose largest logit is at their label (dt_count_correct; the labels are the data's, in range). */
static int64_t count_correct_rows(const float *rows, int64_t n, int64_t c, const int32_t *y) {
  int64_t ok = dt_count_correct(rows, y, n, c);
  return ok > 0 ? ok : 0;
}

static int64_t count_correct(const dt_tensor *logits, const int32_t *y) {
  return count_correct_rows(logits->data, logits->shape[0], logits->shape[1], y);
}

/* ---- training state shared by the callbacks ----------------------------------------- */
typedef struct app {
  options o;
  model m;
  dt_params *P;
  dt_optim *opt;
  dt_strategy *strategy;
  dt_graph *eval_g;
  dt_device *devs[DTRAIN_MAX_REPLICAS]; /* --device: the replicas' devices (none on the CPU) */
  int ndev;
  float *logits_h[DTRAIN_MAX_REPLICAS]; /* per replica on a device: its logits copied back, for the accuracy */
  int64_t correct[DTRAIN_MAX_REPLICAS]; /* per replica: each writes only its own */
  dt_dataset *train, *test;
  dt_loader *loader;
  double last_test_acc, last_test_loss, last_train_loss;
  double train_so_far;                 /* --target-accuracy: training seconds over the epochs so far */
  double seconds_to_target;            /* the training seconds when the target was first met (-1: not met) */
  int64_t epochs_to_target;
  int stop_at_target;                  /* every worker decides alike (not with parameter servers) */
} app;

/* The step every replica runs on its shard of the batch (concurrently, on
 * its own graph bound to its own parameters): the loss of the shard. */
static dt_tensor *replica_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  app *a = (app *)user;
  int64_t xs[2] = {b->rows, 784};
  const int on_device = dt_graph_device(g) != NULL; /* the shard goes to the replica's device */
  dt_tensor *x = on_device ? dt_tensor_from(g, 2, xs, b->x) : dt_tensor_wrap(g, 2, xs, (float *)b->x);
  dt_tensor *logits = model_forward(g, &a->m, x);
  dt_tensor *loss = dt_cross_entropy(g, logits, b->y);
  if (loss && !on_device) a->correct[replica] = count_correct(logits, b->y);
  if (loss && on_device && dt_tensor_to_host(logits, a->logits_h[replica]) == DTRAIN_OK)
    a->correct[replica] = count_correct_rows(a->logits_h[replica], b->rows, 10, b->y);
  return loss;
}

/* One training step for dt_fit: the next batch from the loader, through the strategy. */
static dt_result train_step(dt_fit_batch *fb, void *user) {
  app *a = (app *)user;
  dt_batch b;
  int64_t ep, idx, want = fb->index * a->o.batch_worker;
  dt_loader_position(a->loader, &ep, &idx);
  if (ep != fb->epoch || idx != want) { /* a resumed run, or the wrap into a new epoch */
    dt_result r = dt_loader_set_position(a->loader, fb->epoch, want);
    if (r != DTRAIN_OK) return r;
  }
  int got = dt_loader_next(a->loader, &b);
  if (got <= 0) return got < 0 ? (dt_result)got : DTRAIN_ERR_STATE;
  dt_minibatch mb;
  memset(&mb, 0, sizeof mb);
  mb.rows = b.size;
  mb.x = b.x;
  mb.x_cols = 784;
  mb.y = b.y;
  memset(a->correct, 0, sizeof a->correct);
  float loss = 0;
  dt_result r = dt_strategy_step(a->strategy, &mb, &loss);
  if (r != DTRAIN_OK) return r;
  fb->loss = loss;
  fb->samples = b.size;
  fb->correct = 0;
  for (int i = 0; i < DTRAIN_MAX_REPLICAS; i++) fb->correct += a->correct[i];
  a->last_train_loss = fb->loss;
  return DTRAIN_OK;
}

/* Test-set loss and accuracy, in chunks, without gradients, on its own graph
 * (so the training graph's arena stays sized for a training step). */
static dt_result evaluate_run(dt_fit_eval *e, app *a) {
  const int64_t chunk = 500;
  double loss_sum = 0;
  int64_t correct = 0;
  for (int64_t s = 0; s < a->test->n; s += chunk) {
    int64_t n = a->test->n - s < chunk ? a->test->n - s : chunk;
    int64_t xs[2] = {n, 784};
    dt_graph_reset(a->eval_g);
    dt_tensor *logits = model_forward(a->eval_g, &a->m, dt_tensor_wrap(a->eval_g, 2, xs, a->test->x + s * 784));
    dt_tensor *loss = dt_cross_entropy(a->eval_g, logits, a->test->y + s);
    if (!loss) return dt_graph_error(a->eval_g);
    loss_sum += dt_item(loss) * (double)n;
    correct += count_correct(logits, a->test->y + s);
  }
  e->loss = a->last_test_loss = loss_sum / (double)a->test->n;
  e->accuracy = a->last_test_acc = (double)correct / (double)a->test->n;
  return DTRAIN_OK;
}

static dt_result evaluate(dt_fit_eval *e, void *user) {
  app *a = (app *)user;
  if (a->o.profile) dt_profile_stop(); /* --profile: the training steps only */
  dt_result r = evaluate_run(e, a);
  if (a->o.profile) dt_profile_resume();
  return r;
}

/* --profile: the table (steps: those this run made; wall: their seconds). */
static void print_profile(int64_t steps, double wall) {
  int64_t need = dt_profile_format(NULL, 0, steps > 0 ? steps : 0, wall > 0 ? wall : 0);
  char *buf = need > 0 ? (char *)malloc((size_t)need + 1) : NULL;
  if (buf && dt_profile_format(buf, (size_t)need + 1, steps > 0 ? steps : 0, wall > 0 ? wall : 0) >= 0) fputs(buf, stdout);
  free(buf);
}

/* --profile --json: ,"profile":[{"op":...,"phase":...,"calls":...,"seconds":...},...] (longest first) */
static const char *profile_json(void) {
  static char out[8192];
  dt_profile_entry e[64];
  int n = dt_profile_read(e, 64);
  size_t len = (size_t)snprintf(out, sizeof out, ",\"profile\":[");
  for (int i = 0; i < n && i < 64 && len < sizeof out; i++)
    len += (size_t)snprintf(out + len, sizeof out - len, "%s{\"op\":\"%s\",\"phase\":\"%s\",\"calls\":%lld,\"seconds\":%.6f}",
                            i ? "," : "", e[i].name, dt_profile_phase_name(e[i].phase), (long long)e[i].calls,
                            e[i].seconds);
  if (len + 2 >= sizeof out) return ""; /* cannot happen with 64 entries; never a cut JSON */
  snprintf(out + len, sizeof out - len, "]");
  return out;
}

/* --target-accuracy: after each epoch's evaluation, note the first epoch that
 * met the target and stop there. Synchronous workers hold equal weights, so
 * each decides alike; parameter-server workers differ (a stopped one would
 * leave the others short of its pushes), so there the time is noted and
 * training goes on. */
static int epoch_end(const dt_fit_epoch *e, void *user) {
  app *a = (app *)user;
  a->train_so_far += e->train_seconds;
  if (a->o.target_accuracy <= 0 || a->seconds_to_target >= 0 || !(e->val_acc >= a->o.target_accuracy)) return 0;
  a->seconds_to_target = a->train_so_far;
  a->epochs_to_target = e->epoch;
  return a->stop_at_target;
}

/* Bytes this process sent to (received: from) the others per step
 * (multi_worker_mirrored, a parameter_server worker; 0 in one process). */
static double wire_per_step(dt_strategy *s, int received) {
  dt_strategy_stats st;
  if (dt_strategy_stats_get(s, &st) != DTRAIN_OK || st.steps == 0) return 0.0;
  return (double)(received ? st.wire_bytes_received : st.wire_bytes) / (double)st.steps;
}

/* The --json fields of the async kinds (async, parameter_server): each push's
 * staleness (updates by others between its pull and its push) as mean, max and
 * histogram (counts for 0, 1, 2, ...; the last bin counts that many or more),
 * whether --staleness-lr scaled the updates and (async) whether --async-in-place
 * and --async-sharded were asked for. "" for the others. */
static const char *staleness_json(dt_strategy *s, int staleness_lr, int in_place, int sharded) {
  static char buf[2048];
  dt_strategy_stats st;
  buf[0] = '\0';
  if (dt_strategy_stats_get(s, &st) != DTRAIN_OK ||
      (st.kind != DTRAIN_STRATEGY_ASYNC && st.kind != DTRAIN_STRATEGY_PARAMETER_SERVER))
    return buf;
  int last = 0;
  for (int i = 0; i < DTRAIN_STALENESS_BINS; i++)
    if (st.staleness_hist[i]) last = i;
  size_t n = (size_t)snprintf(buf, sizeof buf, ",\"staleness_mean\":%.3f,\"staleness_max\":%lld,\"staleness_lr\":%s,%s%s"
                              "\"staleness_hist\":[", st.staleness_mean, (long long)st.staleness_max,
                              staleness_lr ? "true" : "false",
                              st.kind != DTRAIN_STRATEGY_ASYNC ? "" : in_place ? "\"async_in_place\":true," :
                                                                             "\"async_in_place\":false,",
                              st.kind != DTRAIN_STRATEGY_ASYNC ? "" : sharded ? "\"async_sharded\":true," :
                                                                            "\"async_sharded\":false,");
  for (int i = 0; i <= last && n < sizeof buf - 24; i++)
    n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%lld", i ? "," : "", (long long)st.staleness_hist[i]);
  snprintf(buf + n, sizeof buf - n, "]");
  return buf;
}

/* ---- --plan: should I distribute? -------------------------------------------------------- */
/* Measures this model (dt_plan_measure on one batch of the training set),
 * predicts every strategy (dt_plan_predict) over the link and prints the
 * table and the recommendation, or one JSON line. The link: --link, else the
 * one workers 0 and 1 probed (probed: under the launcher; one_host: both on
 * one machine), else DTRAIN_NETEM's first clause, else loopback. */
static int run_plan(app *a, int64_t train_n, const dt_plan_link *probed, int one_host) {
  dt_plan_link link;
  char spec[256];
  const char *env = getenv("DTRAIN_NETEM");
  if (a->o.link) snprintf(spec, sizeof spec, "%s", a->o.link);
  else if (probed) snprintf(spec, sizeof spec, "probed");
  else if (env && *env) snprintf(spec, sizeof spec, "%.*s", (int)strcspn(env, ";"), env);
  else snprintf(spec, sizeof spec, "loopback");
  if (!a->o.link && probed) link = *probed;
  else if (dt_plan_link_parse(spec, &link) != DTRAIN_OK) { fprintf(stderr, "error: --link: %s\n", dt_last_error()); return 2; }
  dt_batch b;
  if (dt_loader_next(a->loader, &b) <= 0) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
  dt_minibatch mb;
  memset(&mb, 0, sizeof mb);
  mb.rows = b.size;
  mb.x = b.x;
  mb.x_cols = 784;
  mb.y = b.y;
  dt_plan_model m;
  if (dt_plan_measure(a->P, a->opt, replica_step, a, &mb, 30, &m) != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }
  if (dt_plan_measure_loader(a->loader, 30, &m) != DTRAIN_OK) { /* the loader's time per sample, in the model too */
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }
  if (!a->m.cnn) { /* the MLP can be cut between its 3 layers; a cut carries at most 256 floats a sample */
    m.pipeline_max_stages = 3;
    m.boundary_bytes_per_sample = 256 * (int64_t)sizeof(float);
    /* tensor parallel (Megatron): 784 -> 256 column-parallel, 256 -> 128 row-parallel (its output all-reduced
     * forward; nothing backward: the first layer's input is the data), the 128 -> 10 layer whole on every rank */
    m.tp_max_ranks = 256;
    m.tp_param_share = (784.0 * 256 + 256 + 256.0 * 128) / (double)m.params;
    m.tp_split_share = m.tp_param_share; /* the work by the weights: the linear layers are nearly all of it (the
                                            ReLU after the column layer splits too, the last layer's is whole) */
    m.tp_allreduces = 1;
    m.tp_bytes_per_sample = 128 * (int64_t)sizeof(float);
  }
  dt_plan_options po;
  memset(&po, 0, sizeof po);
  po.batch = a->o.batch;
  po.epoch_samples = train_n;
  po.max_workers = a->o.plan_workers;
  po.link = link;
  po.shared_cores = a->o.plan_one_machine || (probed && !a->o.link ? one_host : !a->o.link);
  /* two workers on this host, no emulation between them: the probe measured this machine's loopback, whose
   * copies the processes also pay (dt_plan_options.loopback_Bps) */
  if (probed && !a->o.link && one_host && !(env && *env)) po.loopback_Bps = probed->bandwidth_Bps;
  po.links_per_connection = po.shared_cores; /* a rehearsal here: loopback, or DTRAIN_NETEM's link per connection */
  po.weak_scaling = a->o.plan_weak;
  po.servers = a->o.plan_servers;
  dt_plan_row rows[256];
  int n = dt_plan_predict(&m, &po, rows, 256);
  if (n < 0) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
  if (n > 256) n = 256;
  char why[512];
  int best = dt_plan_recommend(rows, n, why, sizeof why);
  if (a->o.json) {
    printf("{\"model\":\"%s\",\"batch\":%d,\"link\":{\"spec\":\"%s\",\"latency_s\":%.3g,\"bandwidth_Bps\":%.4g,\"shared\":%s,\"probed\":%s},"
           "\"measured\":{\"fixed_s\":%.4g,\"per_sample_s\":%.4g,\"update_s\":%.4g,\"params\":%lld,"
           "\"activation_bytes_per_sample\":%lld,\"load_per_sample_s\":%.4g,\"busy_slowdown\":%.3f,\"busy_cores\":%d,\"jitter\":%.3f,\"memory_Bps\":%.4g},"
           "\"loopback_Bps\":%.4g,\"shared_cores\":%d,\"weak_scaling\":%d,\"strategies\":[",
           a->o.model, a->o.batch, spec, link.latency_s, link.bandwidth_Bps, link.shared ? "true" : "false",
           probed && !a->o.link ? "true" : "false",
           m.fixed_s, m.per_sample_s, m.update_s,
           (long long)m.params, (long long)m.activation_bytes_per_sample, m.load_per_sample_s,
           m.busy_slowdown, m.busy_cores, m.jitter, m.memory_Bps, po.loopback_Bps > 0 ? po.loopback_Bps : 2.5e9,
           po.shared_cores, po.weak_scaling);
    for (int i = 0; i < n; i++)
      printf("%s{\"name\":\"%s\",\"family\":\"%s\",\"workers\":%d,\"samples_per_sec\":%.0f,\"epoch_seconds\":%.3f,"
             "\"memory_bytes_per_worker\":%.0f,\"comm_share\":%.3f,\"bubble\":%.3f,\"staleness\":%.1f,"
             "\"speedup\":%.3f}", i ? "," : "", rows[i].name, rows[i].family, rows[i].workers, rows[i].samples_per_sec,
             rows[i].epoch_s, rows[i].memory_bytes, rows[i].comm_share, rows[i].bubble, rows[i].staleness,
             rows[i].speedup);
    printf("],\"recommendation\":{\"name\":\"%s\",\"workers\":%d,\"distribute\":%s,\"why\":\"%s\"}}\n",
           best >= 0 ? rows[best].name : "", best >= 0 ? rows[best].workers : 0,
           best >= 0 && strcmp(rows[best].family, "one_device") != 0 ? "true" : "false", why);
    return 0;
  }
  printf("plan: %s, batch %d%s, link %s (latency %.3g ms, %.4g MB/s%s%s), %s\n", a->o.model, a->o.batch,
         po.weak_scaling ? " a worker (weak scaling)" : "", spec, link.latency_s * 1e3, link.bandwidth_Bps / 1e6,
         link.shared ? " shared by every transfer" : "",
         probed && !a->o.link ? ", measured between workers 0 and 1" : "",
         po.shared_cores ? "the workers sharing this machine's cores" : "a machine per worker");
  printf("measured: %.3g ms + %.3g us per sample a step, optimizer %.3g ms, loading %.3g us per sample, %lld "
         "parameters, %.1f KiB of activations per sample, a pass over the gradient at %.3g GB/s\n", m.fixed_s * 1e3,
         m.per_sample_s * 1e6, m.update_s * 1e3, m.load_per_sample_s * 1e6, (long long)m.params,
         (double)m.activation_bytes_per_sample / 1024.0, m.memory_Bps / 1e9);
  if (m.busy_cores >= 2)
    printf("with %d replicas computing at once each is %.2fx slower than alone (shared caches and memory)\n",
           m.busy_cores, m.busy_slowdown);
  if (m.jitter > 0)
    printf("step to step the compute varies by %.1f%% (sigma): a synchronous step waits for the slowest worker\n",
           m.jitter * 100.0);
  printf("%-36s %7s %12s %9s %9s %8s %7s %8s\n", "strategy", "workers", "samples/s", "speedup", "epoch s", "MiB/wkr",
         "comm %", "stale");
  for (int i = 0; i < n; i++)
    printf("%-36s %7d %12.0f %8.2fx %9.2f %8.1f %6.0f%% %8.1f%s\n", rows[i].name, rows[i].workers,
           rows[i].samples_per_sec, rows[i].speedup, rows[i].epoch_s, rows[i].memory_bytes / 1048576.0,
           100 * rows[i].comm_share, rows[i].staleness, i == best ? "  <- recommended" : "");
  printf("recommendation: %s\n", why);
  return 0;
}

/* ---- command line ------------------------------------------------------------------------ */
/* An output flag is checked at start, before any data loads: a path whose
 * directory does not exist or takes no new file would otherwise fail only
 * when the first file is written, after the training it was to keep
 * (dt_check_writable; is_dir: path is the directory itself). */
static int output_ok(const char *flag, const char *path, int is_dir) {
  if (!path || dt_check_writable(path, is_dir) == DTRAIN_OK) return 1;
  fprintf(stderr, "error: %s %s: %s\n", flag, path, dt_last_error());
  return 0;
}

static int optimizer_kind(const char *s, dt_optim_kind *k) {
  static const char *names[] = {"sgd", "adam", "adamw", "rmsprop"};
  static const dt_optim_kind kinds[] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_ADAMW, DTRAIN_OPTIM_RMSPROP};
  for (int i = 0; i < 4; i++)
    if (!strcmp(s, names[i])) { *k = kinds[i]; return 1; }
  return 0;
}

/* Returns 1 to go on, 0 after printing an error and the usage (exit 2), -1
 * after printing the help (exit 0). */
static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->model = "mlp";
  o->optimizer = "adam";
  o->epochs = 5;
  o->batch = 64;
  o->seed = 1;
  o->csv = "build/fashion_mnist.csv";
  o->plan_workers = 16;
  o->plan_servers = 1;
  o->svg = "build/fashion_mnist.svg";
  o->schedule = "constant";
  o->strategy = "one_device";
  o->device = "cpu";
  o->precision = "fp32";
  o->compress_text = "none";
  o->max_staleness = DTRAIN_STALENESS_UNBOUNDED;
  const ex_flag flags[] = {
      {"model", 's', &o->model, 0, 0, "mlp (784-256-128-10) or cnn (two 5x5 convolutions)"},
      {"epochs", 'i', &o->epochs, 1, 1e6, "passes over the training set"},
      {"batch", 'i', &o->batch, 1, 1e7, "the global batch: every replica and worker takes batch/N"},
      {"lr", 'f', &o->lr, 0, 100, "learning rate (0: the optimizer's default)"},
      {"optimizer", 's', &o->optimizer, 0, 0, "sgd, adam, adamw or rmsprop"},
      {"schedule", 's', &o->schedule, 0, 0, "learning-rate schedule: constant or cosine"},
      {"seed", 'u', &o->seed, 0, 1.8e19, "seed of the weights and the shuffling"},
      {"data", 's', &o->data, 0, 0,
       "directory of the Fashion-MNIST files (none: /usr/share/datasets/fashion-mnist, else data/fashion-mnist)"},
      {"limit", 'l', &o->limit, 0, 1e12, "train on the first N samples only (0: all)"},
      {"strategy", 's', &o->strategy, 0, 0,
       "one_device, mirrored, central_storage, async, multi_worker_mirrored or parameter_server"},
      {"replicas", 'i', &o->replicas, 0, 1024, "replicas in this process (0: the strategy's default)"},
      {"max-staleness", 'i', &o->max_staleness, -1, 1e9, "async: most steps a replica may lag (-1: unbounded)"},
      {"staleness-lr", 'b', &o->staleness_lr, 0, 0, "async / parameter servers: scale updates by 1/(1+staleness)"},
      {"async-in-place", 'b', &o->async_in_place, 0, 0,
       "async: the replicas compute on the shared parameters themselves (Hogwild's way; no copy per replica)"},
      {"async-sharded", 'b', &o->async_sharded, 0, 0,
       "async: each replica alone updates its own slice of the parameters, with the mean of the gradients the "
       "others hand it (no update lost, the optimizer over 1/N a step)"},
      {"checkpoint", 's', &o->checkpoint, 0, 0, "save the training state here after every epoch"},
      {"resume", 's', &o->resume, 0, 0, "continue from this checkpoint"},
      {"init-weights", 's', &o->init_weights, 0, 0,
       "start from these weights: a safetensors file with the model's names and shapes (a dtrain checkpoint, "
       "or PyTorch's via tools/dtrain_torch.py save)"},
      {"evaluate", 'b', &o->evaluate, 0, 0,
       "only evaluate the weights (--init-weights or --resume) on the test set and report, no training"},
      {"checkpoint-dir", 's', &o->checkpoint_dir, 0, 0, "parameter servers: their shards' checkpoints here"},
      {"csv", 's', &o->csv, 0, 0, "per-epoch metrics"},
      {"svg", 's', &o->svg, 0, 0, "the loss and accuracy chart"},
      {"device", 's', &o->device, 0, 0, "cpu, cuda (one replica per GPU) or cuda:N"},
      {"precision", 's', &o->precision, 0, 0,
       "matrix products in fp32, or bf16 (bfloat16 inputs, float accumulation and weights, as PyTorch's CPU "
       "autocast; CPUs with AVX512_BF16)"},
      {"compress", 's', &o->compress_text, 0, 0, "multi_worker_mirrored, parameter_server: gradients on the wire as none, fp16, bf16, topk:F or powersgd:R (parameter_server: pulls as 16-bit differences)"},
      {"overlap", 'b', &o->overlap, 0, 0, "mirrored, multi_worker_mirrored: sum gradient buckets during backward (parameter_server: examples/06)"},
      {"push-early", 'b', &o->push_early, 0, 0, "parameter_server: send each push to the servers in parts during backward (the same result; not with --compress)"},
      {"bucket-kb", 'i', &o->bucket_kb, 0, 1 << 21, "--overlap, --push-early, or --compress fp16/bf16 without overlap: KiB of gradient per bucket (0: 2048 with --overlap or --push-early, one ring without)"},
      {"target-accuracy", 'f', &o->target_accuracy, 0, 1,
       "time-to-accuracy: note the training time when test accuracy first reaches this, then stop (0: off)"},
      {"json", 'b', &o->json, 0, 0, "print one JSON line of results"},
      {"profile", 'b', &o->profile, 0, 0,
       "where the training steps' time goes: a table per op (forward, backward), the optimizer, the loader and "
       "the collectives (with --json: a \"profile\" list)"},
      {"plan", 'b', &o->plan, 0, 0,
       "should I distribute? measure this model for a few steps, predict samples/s, epoch time and memory per "
       "worker of every strategy for 1 to --plan-workers workers over --link, recommend one, and exit (with "
       "--json: one line with a \"strategies\" list and a \"recommendation\")"},
      {"link", 's', &o->link, 0, 0,
       "--plan: the link between processes, rate=100mbit,delay=2ms[,jitter=1ms] (an emulated link, "
       "DTRAIN_NETEM's units), bandwidth=10gbit,latency=11us (the link as it is), either with ,shared=1 (one "
       "medium every transfer shares: Wi-Fi, a hub), or loopback (default: "
       "DTRAIN_NETEM's first clause when set, else loopback)"},
      {"plan-workers", 'i', &o->plan_workers, 1, 64, "--plan: the most workers to predict for"},
      {"plan-one-machine", 'b', &o->plan_one_machine, 0, 0,
       "--plan: the worker processes share this machine's cores (a rehearsal here over loopback or an emulated "
       "link; the default without --link), rather than a machine each"},
      {"plan-servers", 'i', &o->plan_servers, 1, 64, "--plan: parameter servers in the parameter_server rows"},
      {"plan-weak", 'b', &o->plan_weak, 0, 0,
       "--plan: weak scaling: every worker keeps --batch rows a step and the global batch grows with the workers "
       "(default: --batch is the global batch, split over them)"},
      {"trace", 's', &o->trace, 0, 0,
       "write the training's timeline (every thread's ops, collectives, pushes, pulls, waits) to FILE as Chrome "
       "trace-event JSON (ui.perfetto.dev, chrome://tracing; tools/dtrain-trace merges workers and draws an SVG); "
       "worker N of a multi-process run writes FILE.workerN.json (the extension kept)"},
      {"quiet", 'b', &o->quiet, 0, 0, "no progress lines"},
  };
  const int n = (int)(sizeof flags / sizeof flags[0]);
  const char *extra = "  Across processes: --rank R --world W --peers host:port,... [--ps host:port,... --role worker|ps],\n"
                      "  or DTRAIN_CONFIG (tools/dtrain-launch -n N [--ps M] -- build/examples/02_fashion_mnist ...)\n";
  int r = ex_parse("02_fashion_mnist", argc, argv, flags, n, extra);
  if (r == 0) ex_usage(stderr, "02_fashion_mnist", flags, n, extra);
  if (r <= 0) return r;
  if (strcmp(o->model, "mlp") && strcmp(o->model, "cnn")) { fprintf(stderr, "error: --model is mlp or cnn\n"); goto bad; }
  {
    /* Every flag is checked here, before any data loads. */
    static const char *const strategies[] = {"one_device", "mirrored", "central_storage", "async",
                                             "multi_worker_mirrored", "parameter_server"};
    int known = 0;
    for (int k = 0; k < 6; k++) known |= !strcmp(o->strategy, strategies[k]);
    if (!known) {
      fprintf(stderr, "error: --strategy %s: one_device, mirrored, central_storage, async, multi_worker_mirrored "
                      "or parameter_server\n", o->strategy);
      goto bad;
    }
    dt_optim_kind kind;
    if (!optimizer_kind(o->optimizer, &kind)) {
      fprintf(stderr, "error: --optimizer %s: sgd, adam, adamw or rmsprop\n", o->optimizer);
      goto bad;
    }
    const char *d = o->device;
    int dev_ok = !strcmp(d, "cpu") || !strcmp(d, "cuda") || (!strncmp(d, "cuda:", 5) && d[5] && strspn(d + 5, "0123456789") == strlen(d + 5));
    if (!dev_ok) {
      fprintf(stderr, "error: --device %s: cpu, cuda or cuda:N\n", d);
      goto bad;
    }
    if (o->replicas > 1 && (!strcmp(o->strategy, "one_device") || !strcmp(o->strategy, "parameter_server"))) {
      fprintf(stderr, "error: --replicas %d: %s trains one replica per process (--strategy mirrored for several)\n",
              o->replicas, !strcmp(o->strategy, "one_device") ? "one_device" : "each parameter_server worker");
      goto bad;
    }
  }
  if (dt_compress_parse(o->compress_text, &o->compress) != DTRAIN_OK) {
    fprintf(stderr, "error: --compress: %s\n", dt_last_error());
    goto bad;
  }
  if (o->compress.kind != DTRAIN_COMPRESS_NONE && strcmp(o->strategy, "multi_worker_mirrored") &&
      strcmp(o->strategy, "parameter_server")) {
    fprintf(stderr, "error: --compress %s is for --strategy multi_worker_mirrored or parameter_server (%s sends no "
            "gradients over a wire)\n", o->compress_text, o->strategy);
    goto bad;
  }
  if (strcmp(o->schedule, "constant") && strcmp(o->schedule, "cosine")) {
    fprintf(stderr, "error: --schedule is constant or cosine\n");
    goto bad;
  }
  if (o->epochs < 1 || o->batch < 1 || o->lr < 0 || o->limit < 0) {
    fprintf(stderr, "error: --epochs and --batch must be >= 1, --lr and --limit >= 0\n");
    goto bad;
  }
  if (strcmp(o->device, "cpu") && strcmp(o->strategy, "one_device") && strcmp(o->strategy, "mirrored") &&
      strcmp(o->strategy, "multi_worker_mirrored")) {
    fprintf(stderr, "error: --device %s trains with one_device, mirrored or multi_worker_mirrored (%s keeps the parameters in host memory)\n",
            o->device, o->strategy);
    goto bad;
  }
  if (o->init_weights && o->resume) {
    fprintf(stderr, "error: --init-weights and --resume both give the weights: one of them\n");
    goto bad;
  }
  if (o->evaluate && !o->init_weights && !o->resume) {
    fprintf(stderr, "error: --evaluate needs the weights to evaluate: --init-weights FILE or --resume FILE\n");
    goto bad;
  }
  if (o->evaluate && (!strcmp(o->strategy, "multi_worker_mirrored") || !strcmp(o->strategy, "parameter_server"))) {
    fprintf(stderr, "error: --evaluate runs in one process (not with --strategy %s)\n", o->strategy);
    goto bad;
  }
  if (strcmp(o->precision, "fp32") && strcmp(o->precision, "bf16")) {
    fprintf(stderr, "error: --precision %s: fp32 or bf16\n", o->precision);
    goto bad;
  }
  if (!strcmp(o->precision, "bf16") && strcmp(o->device, "cpu")) {
    fprintf(stderr, "error: --precision bf16 is for the CPU (the CUDA backend computes in fp32)\n");
    goto bad;
  }
  if (!strncmp(o->device, "cuda:", 5) && o->replicas > 1) {
    fprintf(stderr, "error: --device %s is one GPU; use --device cuda for one replica per GPU\n", o->device);
    goto bad;
  }
  return 1;
bad:
  ex_usage(stderr, "02_fashion_mnist", flags, n, extra);
  return 0;
}

/* --device: no device for the CPU; "cuda:N" GPU N; "cuda" GPU 0 for one
 * replica, else one GPU per replica (`replicas` of them, 0: every GPU).
 * Returns the device count, -1 on failure (printed). */
static int open_devices(const char *name, int one, int replicas, dt_device **out) {
  if (!strcmp(name, "cpu")) return 0;
  if (!strncmp(name, "cuda", 4) && (name[4] == '\0' || name[4] == ':')) {
#ifdef FMNIST_CUDA
    int first = name[4] ? atoi(name + 5) : 0, n = 1;
    if (!name[4] && !one) {
      int have = dt_cuda_device_count();
      if (have < 0) { fprintf(stderr, "error: %s\n", dt_last_error()); return -1; }
      n = replicas > 0 ? replicas : have;
      if (n > DTRAIN_MAX_REPLICAS) n = DTRAIN_MAX_REPLICAS;
    }
    for (int i = 0; i < n; i++) {
      if (!(out[i] = dt_cuda_device_create(first + i))) {
        fprintf(stderr, "error: %s\n", dt_last_error());
        for (int j = 0; j < i; j++) dt_cuda_device_destroy(out[j]);
        return -1;
      }
    }
    return n;
#else
    (void)one;
    (void)replicas;
    (void)out;
    fprintf(stderr, "error: this build has no CUDA backend; build build/examples/02_fashion_mnist_cuda (needs nvcc)\n");
    return -1;
#endif
  }
  fprintf(stderr, "error: --device is cpu, cuda or cuda:N\n");
  return -1;
}

/* Loads the data; with only the shipped test split, splits it 8000/2000. */
static dt_result load_data(app *a, char *dir, size_t cap) {
  int has_train = 0;
  dt_result r = dt_fashion_mnist_find(a->o.data, dir, cap, &has_train);
  if (r != DTRAIN_OK) return r;
  dt_dataset *train = NULL, *test = NULL;
  if ((r = dt_fashion_mnist_load(dir, has_train ? &train : NULL, &test)) != DTRAIN_OK) return r;
  if (!train) {
    dt_dataset *all = test;
    r = dt_dataset_split(all, 0.2, 12345, &train, &test);
    dt_dataset_destroy(all);
    if (r != DTRAIN_OK) return r;
  }
  if (a->o.limit > 0 && a->o.limit < train->n) { /* the first `limit` samples: a quick run */
    int64_t *idx = (int64_t *)malloc((size_t)a->o.limit * sizeof(int64_t));
    dt_dataset *part = NULL;
    if (!idx) return DTRAIN_ERR_NOMEM;
    for (int64_t i = 0; i < a->o.limit; i++) idx[i] = i;
    part = dt_dataset_select(train, idx, a->o.limit);
    free(idx);
    dt_dataset_destroy(train);
    if (!part) { dt_dataset_destroy(test); return dt_last_result(); }
    train = part;
  }
  /* Images come as [28,28] samples; the model takes rows of 784 pixels. */
  int64_t flat = 784;
  if ((r = dt_dataset_reshape(train, 1, &flat)) == DTRAIN_OK) r = dt_dataset_reshape(test, 1, &flat);
  a->train = train;
  a->test = test;
  return r;
}

/* --evaluate: the test set's accuracy and loss of the weights loaded, on the
 * CPU (the printout, and the --json line with the training fields at 0). */
static int evaluate_only(app *a) {
  int rc = 0;
  a->eval_g = dt_graph_create(a->P, NULL);
  dt_fit_eval e;
  memset(&e, 0, sizeof e);
  if (!a->eval_g) rc = 1;
  if (!rc) {
    dt_graph_set_grad_enabled(a->eval_g, 0);
    dt_graph_set_training(a->eval_g, 0);
    if (evaluate(&e, a) != DTRAIN_OK) rc = 1;
  }
  if (rc) fprintf(stderr, "error: %s\n", dt_last_error());
  if (!rc && !a->o.quiet)
    printf("test accuracy %.4f (loss %.4f), %lld of %lld right\n", a->last_test_acc, a->last_test_loss,
           (long long)(a->last_test_acc * (double)a->test->n + 0.5), (long long)a->test->n);
  if (!rc && a->o.json)
    printf("{\"model\":\"%s\",\"optimizer\":\"%s\",\"epochs\":0,\"batch\":%d,\"seed\":%llu,\"train_samples\":%lld,"
           "\"test_samples\":%lld,\"test_accuracy\":%.4f,\"test_loss\":%.5f,\"final_loss\":0,"
           "\"train_seconds\":0,\"samples_per_sec\":0,\"params_checksum\":\"%016llx\",\"strategy\":\"%s\","
           "\"replicas\":1,\"device\":\"cpu\",\"batch_per_worker\":%d,\"compress\":\"none\","
           "\"wire_bytes_per_step\":0,\"wire_bytes_received_per_step\":0,\"overlap\":0,\"evaluate\":true,"
           "\"test_correct\":%lld}\n",
           a->o.model, a->o.optimizer, a->o.batch, (unsigned long long)a->o.seed, (long long)a->train->n,
           (long long)a->test->n, a->last_test_acc, a->last_test_loss, (unsigned long long)dt_params_checksum(a->P),
           a->o.strategy, a->o.batch_worker, (long long)(a->last_test_acc * (double)a->test->n + 0.5));
  dt_graph_destroy(a->eval_g);
  dt_params_destroy(a->P);
  dt_dataset_destroy(a->train);
  dt_dataset_destroy(a->test);
  return rc;
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, below, not by dtrain's logger too */
  app a;
  memset(&a, 0, sizeof a);
  /* Where this process is in a cluster (flags, removed from argv, or
   * DTRAIN_CONFIG); a cluster of one when neither is given. */
  dt_cluster *cl = NULL;
  if (dt_cluster_discover(&argc, argv, &cl) != DTRAIN_OK) { fprintf(stderr, "error: %s\n", dt_last_error()); return 2; }
  int pr = parse(argc, argv, &a.o);
  if (pr <= 0) return pr < 0 ? 0 : 2;
  if (!strcmp(a.o.precision, "bf16") && dt_set_matmul_precision(DTRAIN_MATMUL_BF16) != DTRAIN_OK) {
    fprintf(stderr, "error: --precision bf16: %s\n", dt_last_error());
    return 2;
  }
  const int mwm = !strcmp(a.o.strategy, "multi_worker_mirrored"), ps = !strcmp(a.o.strategy, "parameter_server");
  const int rank = (mwm || ps) ? cl->index : 0, world = (mwm || ps) ? cl->workers : 1;
  if (ps && cl->servers < 1) { fprintf(stderr, "error: parameter_server needs servers (dtrain-launch --ps M, or \"ps\" in DTRAIN_CONFIG)\n"); return 2; }
  if (ps && a.o.resume) { fprintf(stderr, "error: with parameter_server the servers resume from --checkpoint-dir; --resume is not used\n"); return 2; }
  /* The servers write --checkpoint-dir; every process checks it (the
   * launcher runs them on one file system), so that the workers stop at once
   * too instead of waiting for a server that is gone. */
  if (!output_ok("--checkpoint-dir", a.o.checkpoint_dir, 1)) return 2;
  /* --batch is global under every strategy: W workers x R replicas each take
   * batch/(W*R) rows, so the batch must divide; said before loading data. R is
   * what is known now: --replicas (1 when not given; one_device and the
   * parameter-server workers run one). */
  const int one = !strcmp(a.o.strategy, "one_device") || ps;
  const int per_worker_replicas = one || a.o.replicas < 1 ? 1 : a.o.replicas;
  if (a.o.batch % (world * per_worker_replicas) != 0) {
    fprintf(stderr, "error: --batch %d does not divide over %d worker%s x %d replica%s = %d\n", a.o.batch, world, world == 1 ? "" : "s",
            per_worker_replicas, per_worker_replicas == 1 ? "" : "s", world * per_worker_replicas);
    return 2;
  }
  a.o.batch_worker = a.o.batch / world;
  if (rank != 0 || (ps && cl->role == DTRAIN_ROLE_PS) || (a.o.plan && (cl->index != 0 || cl->role != DTRAIN_ROLE_WORKER))) { a.o.quiet = 1; a.o.json = 0; a.o.csv = a.o.svg = a.o.checkpoint = NULL; } /* worker 0 reports */
  /* The CSV and the chart go to build/ by default: run elsewhere (no build/
   * to write in), they are left out with a note, not an error for a flag the
   * user never gave; a path the user gave must be writable. */
  for (int k = 0; k < 2; k++) {
    const char **path = k ? &a.o.svg : &a.o.csv;
    if (!*path || ex_given(argc, argv, k ? "svg" : "csv")) continue;
    dt_set_logger(NULL, NULL, (dt_log_level)0); /* a probe: its failure is not an error to print */
    dt_result w = dt_check_writable(*path, 0);
    ex_log_init();                               /* the example's logger again */
    if (w != DTRAIN_OK) {
      if (!a.o.quiet) printf("note: no %s (%s is not writable here; --%s FILE to choose one)\n", k ? "chart" : "metrics CSV",
                             *path, k ? "svg" : "csv");
      *path = NULL;
    }
  }
  if (!output_ok("--checkpoint", a.o.checkpoint, 0) || !output_ok("--csv", a.o.csv, 0) || !output_ok("--svg", a.o.svg, 0)) return 2;
  dt_optim_kind kind;
  if (!optimizer_kind(a.o.optimizer, &kind)) { fprintf(stderr, "error: unknown optimizer %s\n", a.o.optimizer); return 2; }
  /* The model, and the weights it starts from, before the data loads (a bad or mismatched file is
   * said at once): --init-weights (every process of a cluster reads the same file), or --evaluate
   * --resume: the weights only; the optimizer state and the rest of a checkpoint are not used. */
  a.P = dt_params_create(a.o.seed);
  dt_result r = model_init(&a.m, a.P, !strcmp(a.o.model, "cnn"));
  const char *weights = a.o.init_weights ? a.o.init_weights : a.o.evaluate ? a.o.resume : NULL;
  if (r == DTRAIN_OK && weights) r = dt_checkpoint_load_weights(weights, a.P);
  if (r != DTRAIN_OK) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
  char dir[512];
  r = load_data(&a, dir, sizeof dir);
  if (r != DTRAIN_OK) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
  if (!a.o.quiet && (mwm || ps)) printf("cluster: %d worker%s, %d server%s (samples/s below: worker 0's own)\n", cl->workers,
                                         cl->workers == 1 ? "" : "s", cl->servers, cl->servers == 1 ? "" : "s");
  if (!a.o.quiet && a.o.evaluate)
    printf("data: %s (%lld test)\nmodel: %s, evaluation only\n", dir, (long long)a.test->n, a.o.model);
  else if (!a.o.quiet)
    printf("data: %s (%lld train, %lld test)\nmodel: %s, %s, batch %d (%d per worker), %d epochs, strategy %s\n", dir,
           (long long)a.train->n, (long long)a.test->n, a.o.model, a.o.optimizer, a.o.batch, a.o.batch_worker, a.o.epochs,
           a.o.strategy);

  /* One core of several (one_device, dt_get_threads() == 1): say so once, and how to use more. */
  if (!a.o.quiet && !a.o.evaluate && !strcmp(a.o.strategy, "one_device") && !strcmp(a.o.device, "cpu") && dt_get_threads() == 1 &&
      dt_cpu_count() > 1)
    printf("note: training on 1 of %d cores; DTRAIN_THREADS=%d (or auto) splits the big kernels over them, "
           "--strategy mirrored --replicas %d the batch\n", dt_cpu_count(), dt_cpu_count(), dt_cpu_count());
  if (weights && !a.o.quiet) printf("weights: %s\n", weights);
  if (a.o.evaluate) return evaluate_only(&a);
  a.ndev = open_devices(a.o.device, !strcmp(a.o.strategy, "one_device"), a.o.replicas, a.devs);
  if (a.ndev < 0) return 2;
  for (int i = 0; i < a.ndev; i++) {
    a.logits_h[i] = (float *)malloc((size_t)a.o.batch_worker * 10 * sizeof(float));
    if (!a.logits_h[i]) { fprintf(stderr, "error: out of memory\n"); return 1; }
  }
  if (!a.o.quiet && a.ndev > 0) printf("device: %s%s\n", a.devs[0]->name, a.ndev > 1 ? " and more, one replica each" : "");
  a.eval_g = dt_graph_create(a.P, NULL);
  dt_graph_set_grad_enabled(a.eval_g, 0);
  dt_graph_set_training(a.eval_g, 0);
  dt_loader_options ld;
  memset(&ld, 0, sizeof ld);
  ld.batch_size = a.o.batch_worker; /* this process's part of the global batch */
  ld.seed = a.o.seed;
  ld.shuffle = 1;
  ld.shard_index = rank; /* across processes, each worker reads its own shard */
  ld.shard_count = world;
  a.loader = dt_loader_new(a.train, &ld);
  if (!a.loader) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = kind;
  od.lr = a.o.lr;                              /* 0: the optimizer's default */
  if (kind == DTRAIN_OPTIM_SGD) { od.momentum = 0.9f; if (od.lr == 0) od.lr = 0.05f; }
  if (!strcmp(a.o.schedule, "cosine")) {       /* decay to 0 over the whole run */
    od.schedule.kind = DTRAIN_SCHED_COSINE;
    od.schedule.total_steps = (int64_t)a.o.epochs * dt_loader_num_batches(a.loader);
  }
  a.opt = dt_optim_create(a.P, &od);
  if (a.o.plan) {
    if (!a.opt) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
    /* Under the launcher (2 or more workers): workers 0 and 1 measure the
     * link between them (DTRAIN_NETEM's emulation included); worker 0 plans
     * with it, the others are done. */
    dt_plan_link probed;
    int probe = 0, one_host = 0;
    if (cl->workers > 1 && !a.o.link) {
      if (cl->role != DTRAIN_ROLE_WORKER) return 0; /* (parameter servers have nothing to plan) */
      dt_net_options pno = dt_net_defaults();
      dt_comm *pc = dt_comm_create_tcp(cl, &pno);
      dt_result pr = !pc ? dt_last_result() : cl->index <= 1 ? dt_plan_probe_link(pc, cl->index, 0, 1, &probed) : DTRAIN_OK;
      if (pr == DTRAIN_OK) pr = dt_comm_barrier(pc, cl->index);
      if (pr != DTRAIN_OK) fprintf(stderr, "error: --plan: probing the link: %s\n", dt_last_error());
      dt_comm_destroy(pc);
      if (pr != DTRAIN_OK) return 1;
      if (cl->index != 0) return 0;
      const char *h0 = cl->worker_addr[0], *h1 = cl->worker_addr[1];
      size_t l0 = h0[0] == '[' ? strcspn(h0, "]") : strcspn(h0, ":"), /* the host: "[v6]" or up to ":port" */
             l1 = h1[0] == '[' ? strcspn(h1, "]") : strcspn(h1, ":");
      one_host = l0 == l1 && strncmp(h0, h1, l0) == 0;
      probe = 1;
    }
    return run_plan(&a, a.train->n, probe ? &probed : NULL, one_host);
  }
  /* The one line that picks how training runs: */
  dt_strategy_options sd;
  if (dt_strategy_parse(a.o.strategy, a.o.replicas, a.o.max_staleness, &sd) != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 2;
  }
  /* Across processes: a communicator (lock-step) or a parameter store (async). */
  dt_net_options no = dt_net_defaults();
  no.model_hash = dt_params_hash(a.P);
  dt_comm *comm = NULL;
  dt_pstore *store = NULL;
  if (ps && cl->role == DTRAIN_ROLE_PS) { /* a server: hold a shard, run the optimizer, then exit */
    dt_ps_options po;
    memset(&po, 0, sizeof po);
    po.checkpoint_dir = a.o.checkpoint_dir;
    po.staleness_lr = a.o.staleness_lr;
    r = dt_ps_serve(cl, a.P, a.opt, &no, &po);
    if (r != DTRAIN_OK) fprintf(stderr, "error: %s\n", dt_last_error());
    return r == DTRAIN_OK ? 0 : 1;
  }
  if (mwm) {
    if (!(comm = dt_comm_create_tcp(cl, &no))) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
    sd = dt_strategy_multi_worker_mirrored(comm, a.ndev > 0 ? a.ndev : a.o.replicas > 0 ? a.o.replicas : 1);
    sd.compress = a.o.compress;
    sd.overlap = a.o.overlap;
    sd.bucket_bytes = (size_t)a.o.bucket_kb << 10;
  } else if (ps) {
    if (a.o.overlap) { /* (it was ignored here before: say so instead) */
      fprintf(stderr, "error: --overlap with parameter_server overlaps a run's steps (dt_strategy_run: "
                      "examples/06_parameter_server --overlap); dt_fit here takes one step at a time\n");
      return 2;
    }
    int k = a.o.max_staleness == DTRAIN_STALENESS_UNBOUNDED ? 2 : a.o.max_staleness;
    if (!(store = dt_pstore_create_tcp(cl, a.P, &no, k))) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
    sd = dt_strategy_parameter_server(store, k);
    sd.compress = a.o.compress;
    sd.push_early = a.o.push_early;
    sd.bucket_bytes = (size_t)a.o.bucket_kb << 10;
  } else if (a.o.push_early) {
    fprintf(stderr, "error: --push-early is for --strategy parameter_server (mirrored and multi_worker_mirrored: "
                    "--overlap)\n");
    return 2;
  }
  sd.seed = a.o.seed;
  sd.staleness_lr = a.o.staleness_lr;
  sd.async_in_place = a.o.async_in_place;
  sd.async_sharded = a.o.async_sharded;
  if (a.ndev > 0) { /* the one-line switch: one replica per device */
    sd.devices = a.devs;
    sd.ndevices = a.ndev;
    sd.replicas = a.ndev;
  }
  if (a.opt) a.strategy = dt_strategy_create(a.P, a.opt, replica_step, &a, &sd);
  if (!a.opt || !a.strategy || !a.eval_g) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }

  dt_fit_options fd;
  memset(&fd, 0, sizeof fd);
  fd.epochs = a.o.epochs;
  fd.steps_per_epoch = dt_loader_num_batches(a.loader);
  /* Every worker makes the same number of steps (shards differ by at most one sample). */
  if (mwm || ps) fd.steps_per_epoch = (a.train->n / world) / a.o.batch_worker;
  fd.batch_size = a.o.batch_worker; /* the rows this process trains on per step (its samples/s) */
  fd.train_step = train_step;
  fd.evaluate = evaluate;
  fd.user = &a;
  fd.on_epoch_end = epoch_end;
  a.seconds_to_target = -1;
  a.stop_at_target = !ps;
  fd.params = a.P;
  /* A parameter-server worker's optimizer lives on the servers: its local one
   * never steps, so dt_fit counts this worker's steps itself (and shows no lr). */
  fd.optim = ps ? NULL : a.opt;
  fd.graph = dt_strategy_graph(a.strategy, 0); /* its RNG goes into checkpoints */
  fd.progress = a.o.quiet ? DTRAIN_FIT_PROGRESS_QUIET : DTRAIN_FIT_PROGRESS_AUTO;
  fd.csv_path = a.o.csv;
  fd.svg_path = a.o.svg;
  fd.title = a.m.cnn ? "Fashion-MNIST CNN" : "Fashion-MNIST MLP";
  fd.checkpoint_path = a.o.checkpoint;
  char config[256];
  snprintf(config, sizeof config, "{\"model\":\"%s\",\"optimizer\":\"%s\",\"schedule\":\"%s\",\"batch\":%d,\"seed\":%llu}",
           a.o.model, a.o.optimizer, a.o.schedule, a.o.batch, (unsigned long long)a.o.seed);
  fd.config = config;
  if (a.o.resume) {
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = a.P;
    st.optim = a.opt;
    st.graph = fd.graph;
    if (dt_checkpoint_load(a.o.resume, &st) != DTRAIN_OK || dt_strategy_sync(a.strategy) != DTRAIN_OK) {
      fprintf(stderr, "error: %s\n", dt_last_error());
      return 1;
    }
    fd.start_epoch = st.data_epoch;
    fd.start_batch = st.data_index;
    if (!a.o.quiet) printf("resumed %s at epoch %lld, batch %lld (step %lld)\n", a.o.resume, (long long)st.data_epoch,
                           (long long)st.data_index, (long long)st.step);
    if (fd.start_epoch >= fd.epochs) { fprintf(stderr, "error: the checkpoint already has %lld epochs; ask for more with --epochs\n", (long long)fd.start_epoch); return 1; }
  }

  dt_fit_result res;
  const uint64_t pushes0 = store ? dt_pstore_version(store) : 0; /* the servers' count of applied pushes, now */
  if (a.o.trace && dt_trace_start(a.o.trace) != DTRAIN_OK) { fprintf(stderr, "error: --trace: %s\n", dt_last_error()); return 1; }
  if (a.o.profile) dt_profile_start();
  r = dt_fit(&fd, &res);
  if (a.o.profile) dt_profile_stop();
  if (a.o.trace) {
    dt_result tr = dt_trace_stop(); /* written whether or not the run succeeded: a failed run's timeline says why */
    if (r == DTRAIN_OK && tr != DTRAIN_OK) { fprintf(stderr, "error: --trace: %s\n", dt_last_error()); return 1; }
  }
  if (r != DTRAIN_OK) { fprintf(stderr, "error: %s\n", dt_last_error()); return 1; }
  /* All workers together (samples_per_sec is this worker's own): lock-step
   * workers each train batch_worker rows in every step, so the job trains
   * world times this worker's rate; parameter-server workers run free, so
   * the job's rate is every push the servers applied while this worker
   * trained (their version counts them), batch_worker rows each. */
  double global_sps = res.samples_per_sec;
  if (mwm) global_sps = res.samples_per_sec * world;
  else if (store && res.train_seconds > 0 && dt_pstore_version(store) >= pushes0) /* (a server restarted afresh: own) */
    global_sps = (double)(dt_pstore_version(store) - pushes0) * a.o.batch_worker / res.train_seconds;
  dt_strategy_stats sst;
  dt_strategy_stats_get(a.strategy, &sst);
  double T = res.train_seconds > 0 ? res.train_seconds : 1.0;
  double sh_compute = sst.compute_s_mean / T, sh_comm = sst.comm_s_mean / T, sh_wait = sst.wait_s_mean / T;
  double sh_other = 1.0 - sh_compute - sh_comm - sh_wait;
  if (sh_other < 0) sh_other = 0;
  if (!a.o.quiet) {
    printf("test accuracy %.4f (loss %.4f) after %lld epochs, %.0f samples/s", a.last_test_acc, a.last_test_loss,
           (long long)res.last.epoch, res.samples_per_sec);
    if (mwm || ps) printf(" (this worker), %.0f samples/s all %d workers together", global_sps, world);
    printf("\ntime: %.0f%% computing, %.0f%% communicating, %.0f%% waiting, %.0f%% else (loading, the optimizer, ...)\n",
           100 * sh_compute, 100 * sh_comm, 100 * sh_wait, 100 * sh_other);
    if (a.o.svg) printf("chart: %s   metrics: %s\n", a.o.svg, a.o.csv ? a.o.csv : "-");
  }
  if (a.o.profile && !a.o.quiet) print_profile(res.step - fd.start_epoch * fd.steps_per_epoch - fd.start_batch,
                                                res.train_seconds);
  char cspec[48], target[128] = "";
  if (a.o.target_accuracy > 0) /* seconds_to_target -1: not met in --epochs */
    snprintf(target, sizeof target, ",\"target_accuracy\":%.4f,\"seconds_to_target\":%.2f,\"epochs_to_target\":%lld",
             a.o.target_accuracy, a.seconds_to_target, (long long)(a.seconds_to_target >= 0 ? a.epochs_to_target : -1));
  if (a.o.json)
    printf("{\"model\":\"%s\",\"optimizer\":\"%s\",\"epochs\":%lld,\"batch\":%d,\"seed\":%llu,\"train_samples\":%lld,"
           "\"test_samples\":%lld,\"test_accuracy\":%.4f,\"test_loss\":%.5f,\"final_loss\":%.5f,"
           "\"train_seconds\":%.2f,\"samples_per_sec\":%.0f,\"params_checksum\":\"%016llx\",\"strategy\":\"%s\","
           "\"replicas\":%d,\"device\":\"%s\",\"batch_per_worker\":%d,\"compress\":\"%s\","
           "\"wire_bytes_per_step\":%.0f,\"wire_bytes_received_per_step\":%.0f,\"overlap\":%d,\"push_early\":%d,"
           "\"precision\":\"%s\",\"workers\":%d,\"global_batch\":%d,\"global_samples_per_sec\":%.0f,\"time_shares\":{\"compute\":%.4f,"
           "\"communication\":%.4f,\"waiting\":%.4f,\"other\":%.4f}%s%s%s}\n",
           a.o.model, a.o.optimizer, (long long)res.last.epoch, a.o.batch, (unsigned long long)a.o.seed,
           (long long)a.train->n, (long long)a.test->n, a.last_test_acc, a.last_test_loss, res.last.train_loss,
           res.train_seconds, res.samples_per_sec, (unsigned long long)dt_params_checksum(a.P), a.o.strategy,
           dt_strategy_replicas(a.strategy), a.ndev > 0 ? a.devs[0]->name : "cpu", a.o.batch_worker,
           dt_compress_format(a.o.compress, cspec, sizeof cspec), wire_per_step(a.strategy, 0),
           wire_per_step(a.strategy, 1), a.o.overlap, a.o.push_early, a.o.precision, world, a.o.batch, global_sps, sh_compute, sh_comm,
           sh_wait, sh_other, target,
           staleness_json(a.strategy, a.o.staleness_lr, a.o.async_in_place, a.o.async_sharded), a.o.profile ? profile_json() : "");
  if (store) dt_pstore_leave(store, rank);
  dt_loader_destroy(a.loader);
  dt_strategy_destroy(a.strategy);
  dt_comm_destroy(comm);
  dt_pstore_destroy(store);
  dt_cluster_destroy(cl);
  dt_graph_destroy(a.eval_g);
  dt_optim_destroy(a.opt); /* its state may live on device 0: before the devices */
  a.opt = NULL;
  for (int i = 0; i < a.ndev; i++) {
    free(a.logits_h[i]);
#ifdef FMNIST_CUDA
    dt_cuda_device_destroy(a.devs[i]);
#endif
  }
  dt_optim_destroy(a.opt);
  dt_params_destroy(a.P);
  dt_dataset_destroy(a.train);
  dt_dataset_destroy(a.test);
  return 0;
}
