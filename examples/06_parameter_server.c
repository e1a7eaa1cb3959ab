/* 06_parameter_server.c -- asynchronous training against parameter servers.
 *
 * Shows: one program for both roles (the cluster says which), the model's
 * variables sharded over M server processes that run the optimizer and
 * checkpoint their shards, W workers that pull parameters and push gradients
 * at their own pace with a staleness bound, a worker that dies without
 * stopping the others, and servers resuming from their checkpoints.
 *
 * Build: make (-> build/examples/06_parameter_server), or
 *        cc -std=c11 -O2 -I. examples/06_parameter_server.c -o ps -lm -lpthread
 * Run on one machine (2 workers, 2 servers):
 *        tools/dtrain-launch -n 2 --ps 2 -- build/examples/06_parameter_server --epochs 2
 * By hand across machines: every process gets the same cluster and its own role, e.g.
 *        DTRAIN_CONFIG='{"cluster":{"worker":["10.0.0.1:7000","10.0.0.2:7000"],"ps":["10.0.0.3:7100"]},
 *                        "task":{"type":"ps","index":0}}' ps --checkpoint-dir /var/tmp/ps
 *    and "task":{"type":"worker","index":0} / 1 on the worker machines.
 *
 * Options: --epochs E (each worker makes E passes over its shard), --batch B
 * (the global batch, as in examples/02 and 05: each of W workers pushes the
 * gradient of B/W rows a step; B must divide by W, default 64),
 * --batch-per-worker B (the old meaning of --batch: B rows a worker; not
 * together with --batch),
 * --lr X, --max-staleness K (default 2), --limit N, --data DIR, --seed S,
 * --checkpoint-dir DIR (servers), --checkpoint-every N (updates), --quiet,
 * --overlap (workers: a second thread pushes each step's gradient and pulls
 * the next weights while the next step computes, on the weights of the pull
 * before: one clock more staleness; not with --max-staleness 0),
 * --push-early (workers: each step's push goes to the servers in parts while
 * backward computes the earlier layers, --bucket-kb K of gradient a part,
 * default 2048; the same result as without, no more staleness; not with
 * --overlap, --compress),
 * --compress none|fp16|bf16|topk:F|powersgd:R (workers: the pushes' form on
 * the wire; pulls then come as 16-bit differences from the worker's copy);
 * servers: --min-workers N (start training once N workers joined; the
 * others may join later), --rejoin-timeout S (when every worker is gone
 * but one was lost less than S seconds ago, wait for it to come back) and
 * --staleness-lr (a push of staleness s moves the shard 1/(1+s) of its step);
 * for experiments --crash-at RANK:STEP (that worker kills itself: the others
 * and the servers go on) and --slow RANK:FACTOR (a straggler).
 * --rounds (every process): synchronous rounds; the servers average each
 * round's pushes into one step (a round is the global batch: --batch/W rows
 * a worker); --backup-workers B: rounds of W - B pushes, the B slowest
 * workers' late pushes dropped instead of waited for (Chen et al. 2016;
 * each worker takes --batch/(W - B) rows, and works until the servers
 * closed the job's rounds). Not with --work-queue, --staleness-lr, --overlap.
 * --work-queue (every process): dynamic data sharding. Instead of a fixed
 * shard each, the workers take batches from a queue that server 0 keeps
 * (epochs x batches of the whole training set, in one shuffled order per
 * epoch): a straggler takes fewer, the batch a worker died holding goes to
 * another, and every batch is trained on exactly once; server 0 prints what
 * its queue did. It implies --max-staleness -1 (a bound would make the fast
 * workers wait for the straggler's clock again).
 * Workers print their progress; worker 0 ends with the test accuracy of the
 * parameters it pulls after everybody is done.
 *
 * A worker that died can be started again, with the same command and
 * environment: it rejoins the servers under its rank, gets the current
 * parameters, skips the steps its rank had pushed (its data too: the same
 * shuffled order) and trains the rest. tools/dtrain-launch --max-restarts K
 * does that by itself (then --crash-at acts in the first run only). */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h"
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct options {
  int epochs, batch, max_staleness, quiet, crash_rank, slow_rank, min_workers, staleness_lr, work_queue, overlap;
  int push_early, bucket_kb; /* --push-early, --bucket-kb */
  int rounds, backup;        /* --rounds, --backup-workers B (implies --rounds) */
  double rejoin_timeout;
  int batch_per_worker; /* --batch-per-worker B, 0 when not given; then --batch (global) decides */
  int batch_given;      /* --batch was on the command line (the two flags together are refused) */
  int staleness_given;  /* --max-staleness was (--work-queue needs it unbounded) */
  int64_t limit, crash_step, checkpoint_every;
  float lr, slow_factor;
  uint64_t seed;
  const char *data, *checkpoint_dir;
  dt_compress compress; /* --compress: pushes (and pulls) on the wire */
} options;

typedef struct model {
  dt_nn_linear fc1, fc2, fc3;
} model;

static dt_tensor *forward(dt_graph *g, const model *m, dt_tensor *x) {
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->fc1, x));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->fc2, h));
  return dt_nn_linear_forward(g, &m->fc3, h);
}

static dt_tensor *step_fn(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  int64_t xs[2] = {b->rows, 784};
  return dt_cross_entropy(g, forward(g, (const model *)user, dt_tensor_wrap(g, 2, xs, (float *)b->x)), b->y);
}

/* The worker's batches: its loader, plus the experiment hooks. */
typedef struct feed {
  dt_loader *loader;
  const options *o;
  int rank;
  int64_t first; /* the run's step 0 is this worker's step `first` (a rejoined worker resumes) */
  /* --work-queue: item = epoch * per_epoch + batch of the whole set, in epoch's shuffled order */
  const dt_dataset *set;
  int64_t per_epoch, rows, epoch, taken;
  int64_t *order;                  /* the permutation of the current epoch */
  float *bx;                       /* the batch gathered */
  int32_t *by;
} feed;

/* --work-queue: batch `item` (see feed). Every worker computes the same order for an epoch. */
static dt_result queue_batch(feed *f, int64_t item, dt_minibatch *out) {
  int64_t e = item / f->per_epoch, j = item % f->per_epoch, n = f->set->n;
  if (e != f->epoch) { /* Fisher-Yates with the epoch's seed */
    dt_rng r;
    dt_rng_seed(&r, f->o->seed * 1000003u + (uint64_t)e);
    for (int64_t i = 0; i < n; i++) f->order[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
      int64_t k = (int64_t)dt_rng_below(&r, (uint64_t)(i + 1)), t = f->order[i];
      f->order[i] = f->order[k];
      f->order[k] = t;
    }
    f->epoch = e;
  }
  int64_t first = j * f->rows, rows = first + f->rows <= n ? f->rows : n - first;
  for (int64_t i = 0; i < rows; i++) {
    int64_t src = f->order[first + i];
    memcpy(f->bx + i * 784, f->set->x + src * 784, 784 * sizeof(float));
    f->by[i] = f->set->y[src];
  }
  memset(out, 0, sizeof *out);
  out->rows = rows;
  out->x = f->bx;
  out->x_cols = 784;
  out->y = f->by;
  return DTRAIN_OK;
}

static dt_result next_batch(void *user, int replica, int64_t step, dt_minibatch *out) {
  feed *f = (feed *)user;
  (void)replica;
  int64_t mine = f->set ? f->taken++ : f->first + step; /* this worker's steps so far */
  if (f->rank == f->o->crash_rank && mine == f->o->crash_step) {
    fflush(stdout);
#if defined(_WIN32) /* no SIGKILL there: end at once all the same, no goodbye, no exit handlers */
    _Exit(137);
#else
    raise(SIGKILL); /* a crash: no goodbye to the servers (with --work-queue: holding an item) */
#endif
  }
  if (f->set) return queue_batch(f, step, out);
  dt_batch b;
  int got = dt_loader_next(f->loader, &b);
  if (got == 0) got = dt_loader_next(f->loader, &b); /* the end of an epoch: the next one starts */
  if (got <= 0) return got < 0 ? (dt_result)got : DTRAIN_ERR_STATE;
  memset(out, 0, sizeof *out);
  out->rows = b.size;
  out->x = b.x;
  out->x_cols = 784;
  out->y = b.y;
  return DTRAIN_OK;
}

static double test_accuracy(const model *m, dt_params *P, const dt_dataset *test) {
  dt_graph *g = dt_graph_create(P, NULL);
  dt_graph_set_grad_enabled(g, 0);
  int64_t correct = 0;
  for (int64_t s = 0; s < test->n; s += 1000) {
    int64_t n = test->n - s < 1000 ? test->n - s : 1000, xs[2] = {n, 784};
    dt_graph_reset(g);
    dt_tensor *logits = forward(g, m, dt_tensor_wrap(g, 2, xs, test->x + s * 784));
    if (!logits) {
      correct = -1; /* the caller prints dt_last_error() */
      break;
    }
    for (int64_t i = 0; i < n; i++) {
      const float *row = logits->data + i * 10;
      int best = 0;
      for (int k = 1; k < 10; k++)
        if (row[k] > row[best]) best = k;
      correct += best == test->y[s + i];
    }
  }
  dt_graph_destroy(g);
  return correct < 0 ? -1.0 : (double)correct / (double)test->n;
}

/* An output flag is checked at start, before any data loads: a path whose
 * directory does not exist or takes no new file would otherwise fail only
 * when the first file is written, after the training it was to keep
 * (dt_check_writable; is_dir: path is the directory itself). */
static int output_ok(const char *flag, const char *path, int is_dir) {
  if (!path || dt_check_writable(path, is_dir) == DTRAIN_OK) return 1;
  fprintf(stderr, "error: %s %s: %s\n", flag, path, dt_last_error());
  return 0;
}

/* Returns 1 to go on, 0 after printing what is wrong (exit 2), -1 after the help (exit 0). */
static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->epochs = 2;
  o->batch = 64;
  o->lr = 1e-3f;
  o->max_staleness = 2;
  o->seed = 1;
  o->crash_rank = o->slow_rank = -1;
  const char *crash = NULL, *slow = NULL, *compress = "none";
  const char *trace = NULL; /* --trace */
  const ex_flag flags[] = {
      {"epochs", 'i', &o->epochs, 1, 1e6, "passes over the training set"},
      {"batch", 'i', &o->batch, 1, 1e7, "the global batch: each of W workers takes batch/W"},
      {"batch-per-worker", 'i', &o->batch_per_worker, 1, 1e7, "rows per worker instead (the global batch: W times it)"},
      {"lr", 'f', &o->lr, 0, 100, "the servers' Adam learning rate"},
      {"max-staleness", 'i', &o->max_staleness, -1, 1e9, "most steps a worker may run ahead (-1: unbounded)"},
      {"limit", 'l', &o->limit, 0, 1e12, "train on the first N samples only (0: all)"},
      {"seed", 'u', &o->seed, 0, 1.8e19, "seed of the weights and the shuffling"},
      {"data", 's', &o->data, 0, 0, "directory of the Fashion-MNIST files (none: the usual places)"},
      {"checkpoint-dir", 's', &o->checkpoint_dir, 0, 0, "servers: their shards' checkpoints here"},
      {"checkpoint-every", 'l', &o->checkpoint_every, 0, 1e12, "servers: save every N updates (0: at the end)"},
      {"min-workers", 'i', &o->min_workers, 0, 1e6, "servers: go on while this many workers remain (0: all)"},
      {"rejoin-timeout", 'd', &o->rejoin_timeout, 0, 1e6, "servers: seconds a lost worker may take to rejoin"},
      {"staleness-lr", 'b', &o->staleness_lr, 0, 0, "servers: scale each push by 1/(1+staleness)"},
      {"work-queue", 'b', &o->work_queue, 0, 0, "workers take batches from a shared queue (needs --max-staleness -1)"},
      {"overlap", 'b', &o->overlap, 0, 0, "workers: push and pull in a second thread while the next step computes (on the weights of the pull before; not with --max-staleness 0)"},
      {"push-early", 'b', &o->push_early, 0, 0, "workers: send each push in parts during backward (the same result; not with --overlap or --compress)"},
      {"bucket-kb", 'i', &o->bucket_kb, 0, 1 << 21, "--push-early: KiB of gradient a part (0: 2048)"},
      {"rounds", 'b', &o->rounds, 0, 0, "synchronous rounds: servers average a round's pushes into one step (the global batch)"},
      {"backup-workers", 'i', &o->backup, 0, 1e6, "rounds of W-B pushes: the B slowest workers' late pushes are dropped, not waited for"},
      {"compress", 's', &compress, 0, 0, "workers: pushes as none, fp16, bf16, topk:F or powersgd:R; pulls then come as 16-bit differences"},
      {"crash-at", 's', &crash, 0, 0, "RANK:STEP -- that worker exits at that step"},
      {"slow", 's', &slow, 0, 0, "RANK:FACTOR -- that worker is FACTOR times slower"},
      {"quiet", 'b', &o->quiet, 0, 0, "no progress lines"},
      {"trace", 's', &trace, 0, 0, EX_TRACE_HELP},
  };
  const int n = (int)(sizeof flags / sizeof flags[0]);
  const char *extra = "  The cluster: DTRAIN_CONFIG (tools/dtrain-launch -n N --ps M) or --rank/--world/--peers/--ps/--role\n";
  int r = ex_parse("06_parameter_server", argc, argv, flags, n, extra);
  if (r == 0) ex_usage(stderr, "06_parameter_server", flags, n, extra);
  if (r <= 0) return r;
  if (!ex_trace_begin(trace)) return 0;
  o->batch_given = ex_given(argc, argv, "batch");
  o->staleness_given = ex_given(argc, argv, "max-staleness");
  char tail;
  long long st;
  if (dt_compress_parse(compress, &o->compress) != DTRAIN_OK) {
    fprintf(stderr, "error: --compress: %s\n", dt_last_error());
    goto bad;
  }
  if (crash && (sscanf(crash, "%d:%lld%c", &o->crash_rank, &st, &tail) != 2 || st < 0)) {
    fprintf(stderr, "error: --crash-at wants RANK:STEP, not '%s'\n", crash);
    goto bad;
  }
  if (crash) o->crash_step = st;
  if (slow && (sscanf(slow, "%d:%f%c", &o->slow_rank, &o->slow_factor, &tail) != 2 || !(o->slow_factor > 0))) {
    fprintf(stderr, "error: --slow wants RANK:FACTOR, not '%s'\n", slow);
    goto bad;
  }
  if (o->work_queue) {
    if (o->staleness_given && o->max_staleness != -1) {
      fprintf(stderr, "error: --work-queue needs --max-staleness -1 (unbounded): a bound would hold the fast workers "
                      "at the straggler's clock\n");
      goto bad;
    }
    o->max_staleness = -1;
  }
  if (o->backup > 0) o->rounds = 1;
  if (o->rounds && (o->work_queue || o->staleness_lr || o->overlap || (o->staleness_given && o->max_staleness != 0))) {
    fprintf(stderr, "error: --rounds / --backup-workers: not with %s (a round is the bound: every push of a round is "
                    "computed on its weights)\n", o->work_queue ? "--work-queue" : o->staleness_lr ? "--staleness-lr"
                    : o->overlap ? "--overlap" : "a --max-staleness other than 0");
    goto bad;
  }
  if (o->rounds) o->max_staleness = 0;
  if (o->batch_given && o->batch_per_worker) {
    fprintf(stderr, "error: --batch (global) and --batch-per-worker are two meanings of one number; give one\n");
    goto bad;
  }
  return 1;
bad:
  ex_usage(stderr, "06_parameter_server", flags, n, extra);
  return 0;
}

/* The training rows (the first --limit of them: part, else train) and the test set. */
static dt_result load_data(const options *o, dt_dataset **train, dt_dataset **test, dt_dataset **part) {
  char dir[512];
  int has_train = 0;
  dt_result r = dt_fashion_mnist_find(o->data, dir, sizeof dir, &has_train);
  if (r == DTRAIN_OK) r = dt_fashion_mnist_load(dir, has_train ? train : NULL, test);
  if (r == DTRAIN_OK && !*train) {
    dt_dataset *all = *test;
    *test = NULL;
    r = dt_dataset_split(all, 0.2, 12345, train, test);
    dt_dataset_destroy(all);
  }
  int64_t flat = 784;
  if (r == DTRAIN_OK) r = dt_dataset_reshape(*train, 1, &flat);
  if (r == DTRAIN_OK) r = dt_dataset_reshape(*test, 1, &flat);
  if (r != DTRAIN_OK) return r;
  int64_t n_train = o->limit > 0 && o->limit < (*train)->n ? o->limit : (*train)->n;
  if (n_train < (*train)->n) {
    int64_t *idx = (int64_t *)malloc((size_t)n_train * sizeof(int64_t));
    if (!idx) return DTRAIN_ERR_NOMEM;
    for (int64_t i = 0; i < n_train; i++) idx[i] = i;
    *part = dt_dataset_select(*train, idx, n_train);
    if (!*part) r = dt_last_result();
    free(idx);
  }
  return r;
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, below, not by dtrain's logger too */
  dt_cluster *cl = NULL;
  if (dt_cluster_discover(&argc, argv, &cl) != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 2;
  }
  options o;
  int pr = parse(argc, argv, &o);
  if (pr <= 0) return pr < 0 ? 0 : 2;
  /* The servers write --checkpoint-dir; every process checks it (the launcher
   * runs them on one file system), so that the workers stop at once too. */
  if (!output_ok("--checkpoint-dir", o.checkpoint_dir, 1)) return 2;
  if (cl->servers < 1) {
    fprintf(stderr, "error: parameter-server training needs servers in the cluster (dtrain-launch --ps M)\n");
    return 2;
  }
  /* --batch is global: each of the W workers takes batch/W rows a step, so it
   * must divide (said by every process, servers too, before any data loads). */
  if (o.backup >= cl->workers) {
    fprintf(stderr, "error: --backup-workers %d: need fewer than the %d workers\n", o.backup, cl->workers);
    return 2;
  }
  /* In rounds of W - B pushes, each worker takes batch/(W - B): a round is the global batch. */
  const int per = cl->workers - o.backup;
  if (!o.batch_per_worker && o.batch % per != 0) {
    fprintf(stderr, "error: --batch %d does not divide over %d worker%s x 1 replica = %d%s\n", o.batch, per,
            per == 1 ? "" : "s", per, o.backup ? " (the workers but the backups: a round's pushes)" : "");
    return 2;
  }
  const int batch_worker = o.batch_per_worker ? o.batch_per_worker : o.batch / per; /* rows a worker loads per step */
  /* Started again by tools/dtrain-launch --max-restarts (DTRAIN_RESTART > 0):
   * the experiment's crash happened already. */
  const char *restart_env = getenv("DTRAIN_RESTART");
  if (restart_env && atoi(restart_env) > 0) o.crash_rank = -1;
  /* The same model and optimizer in every process: servers run the optimizer. */
  dt_params *P = dt_params_create(o.seed);
  model m;
  dt_nn_linear_init(&m.fc1, P, "fc1", 784, 256, 1);
  dt_nn_linear_init(&m.fc2, P, "fc2", 256, 128, 1);
  dt_nn_linear_init(&m.fc3, P, "fc3", 128, 10, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = o.lr;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_net_options no = dt_net_defaults();
  no.model_hash = dt_params_hash(P);

  if (cl->role == DTRAIN_ROLE_PS) { /* a server: serve the shard until every worker is done */
    dt_ps_options po;
    memset(&po, 0, sizeof po);
    po.checkpoint_dir = o.checkpoint_dir;
    po.checkpoint_every = o.checkpoint_every;
    po.min_workers = o.min_workers;
    po.rejoin_timeout_s = o.rejoin_timeout;
    po.staleness_lr = o.staleness_lr;
    po.aggregate = o.rounds ? cl->workers - o.backup : 0;
    dt_ps_work_stats ws;
    dt_result r = DTRAIN_OK;
    if (o.work_queue && cl->index == 0) { /* the queue: epochs x batches of the whole training set */
      dt_dataset *train = NULL, *test = NULL, *part = NULL;
      r = load_data(&o, &train, &test, &part);
      if (r == DTRAIN_OK) {
        int64_t n = (part ? part : train)->n;
        po.work_items = (int64_t)o.epochs * ((n + batch_worker - 1) / batch_worker);
        po.work_stats = &ws;
      } /* else: printed below, as dt_ps_serve's errors are */
      dt_dataset_destroy(part);
      dt_dataset_destroy(train);
      dt_dataset_destroy(test);
    }
    if (r == DTRAIN_OK) r = dt_ps_serve(cl, P, opt, &no, &po);
    if (r != DTRAIN_OK) fprintf(stderr, "ps %d: %s\n", cl->index, dt_last_error());
    else if (!o.quiet) printf("ps %d: done, %lld updates applied\n", cl->index, (long long)dt_optim_steps(opt));
    if (r == DTRAIN_OK && po.work_stats)
      printf("ps 0: work queue: %lld of %lld batches done, %lld handed out, %lld given back by workers that died\n",
             (long long)ws.done, (long long)ws.items, (long long)ws.handed_out, (long long)ws.returned);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    dt_cluster_destroy(cl);
    return r == DTRAIN_OK ? 0 : 1;
  }

  /* A worker. The store first: connections to every server (retrying while
   * they start); its heartbeats keep them alive while the data loads. */
  dt_pstore *store = dt_pstore_create_tcp(cl, P, &no, o.max_staleness);
  if (!store) {
    fprintf(stderr, "worker %d: error: %s\n", cl->index, dt_last_error());
    return 1;
  }
  /* Its shard of the data. */
  int rank = cl->index, world = cl->workers;
  dt_dataset *train = NULL, *test = NULL, *part = NULL;
  dt_result r = load_data(&o, &train, &test, &part);
  dt_loader_options ld;
  memset(&ld, 0, sizeof ld);
  ld.batch_size = batch_worker;
  ld.shuffle = 1;
  ld.seed = o.seed + (uint64_t)rank;
  ld.shard_index = rank;
  ld.shard_count = world;
  dt_loader *loader = r == DTRAIN_OK ? dt_loader_new(part ? part : train, &ld) : NULL;
  if (!loader) {
    fprintf(stderr, "worker %d: error: %s\n", rank, dt_last_error());
    return 1;
  }

  dt_strategy_options sd = dt_strategy_parameter_server(store, o.max_staleness);
  sd.work_queue = o.work_queue;
  sd.compress = o.compress;
  sd.overlap = o.overlap;
  sd.push_early = o.push_early;
  sd.bucket_bytes = (size_t)o.bucket_kb << 10;
  if (rank == o.slow_rank) {
    sd.straggler = 0; /* this process's replica 0 */
    sd.straggler_factor = o.slow_factor;
  }
  dt_strategy *s = dt_strategy_create(P, opt, step_fn, &m, &sd);
  if (!s) {
    fprintf(stderr, "worker %d: error: %s\n", rank, dt_last_error());
    return 1;
  }
  feed f;
  memset(&f, 0, sizeof f);
  f.loader = loader;
  f.o = &o;
  f.rank = rank;
  int64_t steps = (int64_t)o.epochs * dt_loader_num_batches(loader);
  if (o.work_queue) { /* batches of the whole set, handed out by server 0 */
    f.set = part ? part : train;
    f.rows = batch_worker;
    f.per_epoch = (f.set->n + batch_worker - 1) / batch_worker;
    f.epoch = -1;
    f.order = (int64_t *)malloc((size_t)f.set->n * sizeof(int64_t));
    f.bx = (float *)malloc((size_t)batch_worker * 784 * sizeof(float));
    f.by = (int32_t *)malloc((size_t)batch_worker * sizeof(int32_t));
    if (!f.order || !f.bx || !f.by) {
      fprintf(stderr, "worker %d: error: out of memory\n", rank);
      return 1;
    }
    steps = (int64_t)o.epochs * f.per_epoch; /* at most: the queue ends the run when it is done */
  }
  if (!o.quiet && rank == 0 && store->steps_done == 0 && o.rounds)
    printf("%d worker(s), %d server(s), synchronous rounds of %d pushes (%d backup), %lld rounds, batch %d per worker "
           "(global %d)\n", world, cl->servers, per, o.backup, (long long)steps, batch_worker, batch_worker * per);
  else if (!o.quiet && rank == 0 && store->steps_done == 0 && !o.work_queue)
    printf("%d worker(s), %d server(s), max staleness %d, %lld steps per worker, batch %d per worker (global %d)\n", world,
           cl->servers, o.max_staleness, (long long)steps, batch_worker, batch_worker * world);
  if (!o.quiet && rank == 0 && store->steps_done == 0 && o.work_queue)
    printf("%d worker(s), %d server(s), a work queue of %lld batches of %d on server 0 (%d epochs), unbounded staleness\n",
           world, cl->servers, (long long)steps, batch_worker, o.epochs);
  if (store->steps_done > 0 && !o.work_queue) { /* (with the queue it just takes the next items) */
    /* A restarted worker: its rank had pushed steps_done steps. Skip them,
     * and their batches (the loader's order is the same in every run; only an
     * epoch's last batch can be short, so the position is whole batches). */
    f.first = store->steps_done < steps ? store->steps_done : steps;
    int64_t per_epoch = dt_loader_num_batches(loader);
    if (f.first < steps &&
        dt_loader_set_position(loader, f.first / per_epoch, (f.first % per_epoch) * batch_worker) != DTRAIN_OK) {
      fprintf(stderr, "worker %d: error: %s\n", rank, dt_last_error());
      return 1;
    }
    if (!o.quiet)
      printf("worker %d: rejoined at clock %lld; %lld of %lld steps were done before, %lld to go\n", rank,
             (long long)store->start_clock, (long long)f.first, (long long)steps, (long long)(steps - f.first));
    steps -= f.first;
  }
  float loss = 0;
  double t0 = dt_time_now();
  if (o.rounds) { /* step by step, until the servers closed the job's rounds: a backup worker's late steps
                    are not trained on, and it stops when the others are done, not after all its own */
    uint64_t want = (uint64_t)(f.first + steps);
    double lsum = 0;
    int64_t n = 0;
    for (int64_t t = 0; r == DTRAIN_OK && t < steps && dt_pstore_version(store) < want; t++) {
      dt_minibatch b;
      float l = 0;
      r = next_batch(&f, 0, t, &b);
      if (r == DTRAIN_OK) r = dt_strategy_step(s, &b, &l);
      lsum += l;
      n++;
    }
    loss = n ? (float)(lsum / (double)n) : 0.0f;
  } else {
    r = steps > 0 ? dt_strategy_run(s, steps, next_batch, &f, &loss) : DTRAIN_OK; /* 0: it had done them all */
  }
  double secs = dt_time_now() - t0;
  int rc = 0;
  if (r != DTRAIN_OK) {
    fprintf(stderr, "worker %d: training stopped: %s\n", rank, dt_last_error());
    rc = 1;
  } else {
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    if (!o.quiet)
      printf("worker %d: %lld steps, mean loss %.4f, %.0f samples/s, staleness mean %.2f max %lld\n", rank,
             (long long)st.steps, loss, (double)st.samples / secs, st.staleness_mean, (long long)st.staleness_max);
    if (!o.quiet && o.rounds)
      printf("worker %d: %lld of its %lld pushes came after their round closed and were dropped\n", rank,
             (long long)st.dropped_grads, (long long)st.steps);
    if (!o.quiet && st.steps > 0)
      printf("worker %d: wire %.0f bytes/step sent, %.0f received (compress %s)\n", rank,
             (double)st.wire_bytes / (double)st.steps, (double)st.wire_bytes_received / (double)st.steps,
             dt_compress_name(o.compress));
    /* The latest parameters, for an evaluation (servers keep training for slower workers). */
    dt_pstore_ticket tk;
    double acc = -1;
    if (rank == 0 && (dt_pstore_pull(store, rank, steps, dt_params_data(P), dt_params_size(P), &tk) != DTRAIN_OK ||
                      (acc = test_accuracy(&m, P, test)) < 0))
      fprintf(stderr, "worker 0: no test accuracy: %s\n", dt_last_error()); /* training itself went well */
    else if (rank == 0)
      printf("worker 0: test accuracy %.4f\n", acc);
  }
  dt_pstore_leave(store, rank);
  free(f.order);
  free(f.bx);
  free(f.by);
  dt_strategy_destroy(s);
  dt_pstore_destroy(store);
  dt_loader_destroy(loader);
  dt_dataset_destroy(part);
  dt_dataset_destroy(train);
  dt_dataset_destroy(test);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  dt_cluster_destroy(cl);
  return rc;
}
