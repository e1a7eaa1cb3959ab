/* 05_multi_worker.c -- one program, several processes: synchronous
 * data-parallel training across processes (multi_worker_mirrored) over TCP,
 * or over MPI when built with DTRAIN_USE_MPI.
 *
 * Shows: where a process learns its place in the cluster (flags or
 * DTRAIN_CONFIG), the communicator, each worker reading its own shard of the
 * data, threads inside each process (hierarchical all-reduce), checkpoints
 * written by rank 0, what happens when a worker dies (every other worker
 * stops with an error naming it, within the deadline), and resuming from the
 * last checkpoint.
 *
 * Build: make (-> build/examples/05_multi_worker), or
 *        cc -std=c11 -O2 -I. examples/05_multi_worker.c -o mw -lm -lpthread
 * Run on one machine (the launcher gives every worker its DTRAIN_CONFIG):
 *        tools/dtrain-launch -n 2 -- build/examples/05_multi_worker --epochs 3
 * Run by hand across machines (one line per machine; same flags everywhere):
 *        mw --rank 0 --world 2 --peers 10.0.0.1:7000,10.0.0.2:7000 --checkpoint /shared/mw.safetensors
 *        mw --rank 1 --world 2 --peers 10.0.0.1:7000,10.0.0.2:7000 --checkpoint /shared/mw.safetensors
 *    (with DTRAIN_TOKEN=... in every environment to refuse strangers)
 * After a failure, run the same command lines with --resume /shared/mw.safetensors.
 * With MPI: mpicc -DDTRAIN_USE_MPI -std=c11 -O2 -I. examples/05_multi_worker.c -o mw && mpirun -n 2 ./mw
 *    and there, --servers M: ranks 0..M-1 are asynchronous parameter servers
 *    (MPI messages; below, before ps_serve), the others workers; rank 0 ends
 *    with "parameter servers: last epoch X samples/s (all workers) step_ms=...
 *    compute_ms=... comm_ms=..." and the final weights' checksum and accuracy.
 *
 * Options: --epochs E, --batch B (the global batch, as in TensorFlow and in
 * examples/02: each of W workers reads B/W rows per step and each of its N
 * threads takes B/(W*N); B must divide by W*N, default 64), --batch-per-worker B
 * (the old meaning of --batch, kept for scripts: every worker reads B rows, the
 * global batch is B*W; not together with --batch), --threads N (replicas in each
 * process), --lr X, --limit N (train on the first N samples), --eval-limit N
 * (test on the first N test samples), --data DIR, --checkpoint PATH (rank 0
 * writes it after every epoch, and with --checkpoint-every N also after every
 * N steps), --resume PATH, --seed S, --quiet, --model mlp|cnn (02's models;
 * default mlp); for experiments --crash-at RANK:STEP (that worker kills itself
 * with SIGKILL before the step, as a crashed machine would) and --stall-at
 * RANK:STEP (it stops itself with SIGSTOP: a hung machine whose connections
 * stay open); under tools/dtrain-launch --max-restarts these act in the
 * first run only (DTRAIN_RESTART=0).
 * Automatic restart: tools/dtrain-launch --max-restarts K -- ... --checkpoint
 * PATH --checkpoint-every N. When a worker dies the launcher stops the others
 * and starts every worker again with DTRAIN_RESTART=1, 2, ...; then each
 * resumes from PATH when it exists (its step, epoch, parameters, optimizer
 * state and data position), so the run ends with the parameters an
 * undisturbed run has, bit for bit.
 * Rank 0 prints one line per epoch; every rank ends with
 * "rank R: final params_checksum=... test_accuracy=..." (equal on all ranks),
 * then wire_bytes_per_step and the last epoch's step_ms, compute_ms (forward
 * and backward), comm_ms (the cross-process all-reduce, with the wait for the
 * slowest worker in it) and wait_ms (barriers among its threads), a step. */
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
  int epochs, batch, threads, quiet, crash_rank, stall_rank;
  int batch_per_worker; /* --batch-per-worker B, 0 when not given; then --batch (global) decides */
  int batch_given;      /* --batch was on the command line (the two flags together are refused) */
  int64_t limit, eval_limit, crash_step, stall_step, checkpoint_every;
  float lr;
  uint64_t seed;
  const char *data, *checkpoint, *resume;
  dt_compress compress; /* --compress: the gradients on the wire */
  int overlap;          /* --overlap: buckets all-reduced during backward */
  const char *model;    /* --model: mlp or cnn */
  int ps;               /* --servers M (MPI only): ranks 0..M-1 are parameter servers, 0: none */
  float sim_compute_ms, sim_update_ms; /* --sim-compute-ms, --sim-update-ms (SimGrid builds): spent, not measured */
} options;

/* Under SimGrid's smpicc (which includes smpi_helpers.h), the simulation can
 * take its compute from a measurement instead of from this machine's core:
 * smpirun --cfg=smpi/simulate-computation:no makes the real compute cost no
 * simulated time, and each step spends what --sim-compute-ms says (a worker's
 * forward, backward and loading; with the all-reduce also its optimizer step,
 * --sim-update-ms), each parameter server --sim-update-ms a push. SMPI runs
 * every rank in turn on one core, each finding its data evicted by the rank
 * before; a measurement of one worker alone is what a machine of its own
 * does. The real compute still runs: the weights learn as ever. */
#if defined(DTRAIN_USE_MPI) && defined(SMPI_HELPERS_H)
#  define EX_SMPI 1
static double sim_step_s, sim_serve_s; /* simulated seconds a worker's step, a server's push */
static void sim_spend(double s) {
  if (s > 0) smpi_execute_benched(s);
}
#else
#  define EX_SMPI 0
#endif

#include "fashion_model.h" /* 02's two models: model, model_init, model_forward */

/* What every replica runs on its shard of this process's batch. */
static dt_tensor *step_fn(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
#if EX_SMPI
  sim_spend(sim_step_s);
#endif
  int64_t xs[2] = {b->rows, 784};
  return dt_cross_entropy(g, model_forward(g, (const model *)user, dt_tensor_wrap(g, 2, xs, (float *)b->x)), b->y);
}

/* The loader's next batch as the strategy's minibatch; 0 after printing why not. */
static int next_minibatch(dt_loader *loader, int rank, dt_minibatch *mb) {
  dt_batch b;
  if (dt_loader_next(loader, &b) <= 0) {
    fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
    return 0;
  }
  memset(mb, 0, sizeof *mb);
  mb->rows = b.size;
  mb->x = b.x;
  mb->x_cols = 784;
  mb->y = b.y;
  return 1;
}

/* The share of the first `limit` test samples (0: all) classified right. */
static double test_accuracy(dt_graph *g, const model *m, const dt_dataset *test, int64_t limit) {
  int64_t correct = 0, total = limit > 0 && limit < test->n ? limit : test->n;
  for (int64_t s = 0; s < total; s += 1000) {
    int64_t n = total - s < 1000 ? total - s : 1000, xs[2] = {n, 784};
    dt_graph_reset(g);
    dt_tensor *logits = model_forward(g, m, dt_tensor_wrap(g, 2, xs, test->x + s * 784));
    if (!logits) return -1;
    for (int64_t i = 0; i < n; i++) {
      const float *row = logits->data + i * 10;
      int best = 0;
      for (int k = 1; k < 10; k++)
        if (row[k] > row[best]) best = k;
      correct += best == test->y[s + i];
    }
  }
  return (double)correct / (double)total;
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

#if defined(DTRAIN_USE_MPI)
/* --servers M: asynchronous parameter servers on MPI (built for the simulation of
 * `make simulate`: SimGrid's SMPI runs MPI programs, not dtrain's TCP
 * parameter servers). The data flow is that of examples/06 over TCP: ranks
 * 0..M-1 each hold a slice of the parameters (dt_comm_slice) and the
 * optimizer's state for it; every worker (ranks M..world-1, each on its own
 * shard) computes its gradient on the parameters it has, sends each server
 * its slice of it and takes back that server's slice of the parameters,
 * updated. A server applies the pushes one by one, as they arrive, from
 * whichever worker (unbounded staleness: nobody waits for anybody), one
 * optimizer step each; it receives from every worker at once. When every
 * worker has said it is done, the servers gather the parameters on rank 0,
 * which tests them; every rank then gives its figures to rank 0, which prints
 * the job's samples/s (the workers' last epochs: their samples over the
 * longest of them) and the mean step split. */
enum { PS_TAG_GRAD = 11, PS_TAG_PARAMS = 12, PS_TAG_DONE = 13, PS_TAG_FINAL = 14 };

/* Rank r < servers: serve pushes until every worker is done. As a TCP server
 * reads every connection at once (the kernel takes a push's bytes whatever
 * the server is doing), a receive is posted for every worker at all times, so
 * pushes arrive side by side, each at its worker's pace; they are applied one
 * at a time, as they complete. Each worker has two buffers here: its push
 * lands in one while its last answer (a copy of the slice as that push left
 * it) goes out of the other, and its next receive is posted as soon as its
 * push has been applied. (With one buffer, the next push of a worker could
 * not begin to flow until the server, busy with other workers' pushes, saw
 * that the answer had gone: large messages wait for their receive.) Each
 * buffer holds the slice only; with several servers the optimizer gets the
 * gradient in its place in the whole layout (one copy of the slice).
 * win: a span of this server's clock in which every worker trains, and the
 * pushes applied at each end: from the push that brings the slowest worker
 * past the first half of its pushes (`first`; at least its first epoch) to
 * the latest push of the slowest worker before any worker has made its last
 * (`last`). Both ends are the slowest worker's pushes, so workers in
 * lock-step (pushes in bursts) are measured over whole rounds. The job's
 * steady rate, free of the start (all workers in step, which they leave only
 * over tens of rounds) and of the end (fewer and fewer workers). */
static int ps_serve(int r, int servers, int workers, dt_params *P, dt_optim *opt, int64_t *pushes, int64_t first,
                    int64_t last, double *win) {
  const size_t n = dt_params_size(P);
  size_t b, e;
  dt_comm_slice(n, servers, r, &b, &e);
  const size_t len = e - b; /* each buffer: this server's slice */
  const int whole = b == 0 && e == n; /* one server: the slice is the whole layout the optimizer wants */
  float *data = dt_params_data(P), *bufs = (float *)malloc(2 * (size_t)workers * len * sizeof(float));
  float *full = whole ? NULL : (float *)malloc(n * sizeof(float)); /* else a gradient in its place, for the update */
  MPI_Request *q = (MPI_Request *)malloc(2 * (size_t)workers * sizeof(MPI_Request)); /* 2w: receive, 2w+1: send */
  int64_t *seen = (int64_t *)calloc((size_t)workers, sizeof(int64_t)); /* pushes applied, by worker */
  int rc = 0, live = workers, ended = 0; /* ended: a worker has made its last push */
  int64_t lowest = 0;                     /* the fewest pushes of any worker */
  win[0] = win[1] = win[2] = win[3] = 0;
  if (!bufs || (!whole && !full) || !q || !seen) {
    fprintf(stderr, "rank %d: error: out of memory (%d buffers of %zu floats)\n", r, 2 * workers, len);
    rc = 1;
    live = 0;
  }
  for (int w = 0; w < live; w++) {
    q[2 * w + 1] = MPI_REQUEST_NULL;
    MPI_Irecv(bufs + (size_t)(2 * w) * len, (int)len, MPI_FLOAT, servers + w, MPI_ANY_TAG, MPI_COMM_WORLD, &q[2 * w]);
  }
  while (live > 0) {
    MPI_Status st;
    int i = MPI_UNDEFINED, count = 0;
    if (MPI_Waitany(2 * workers, q, &i, &st) != MPI_SUCCESS || i == MPI_UNDEFINED) {
      fprintf(stderr, "rank %d: error: MPI_Waitany failed\n", r);
      rc = 1;
      break;
    }
    if (i % 2) continue; /* an answer has gone: its buffer is free */
    const int w = i / 2;
    float *g = bufs + (size_t)(2 * w) * len, *out = g + len;
    MPI_Get_count(&st, MPI_FLOAT, &count);
    if (st.MPI_TAG == PS_TAG_DONE) { /* q[2w] is MPI_REQUEST_NULL now */
      live--;
      continue;
    }
    if (st.MPI_TAG != PS_TAG_GRAD || (size_t)count != len) {
      fprintf(stderr, "rank %d: error: rank %d sent tag %d with %d floats, not a gradient slice of %zu\n", r,
              st.MPI_SOURCE, st.MPI_TAG, count, len);
      rc = 1;
      break;
    }
    if (!whole) memcpy(full + b, g, len * sizeof(float));
#if EX_SMPI
    sim_spend(sim_serve_s);
#endif
    if (dt_optim_update(opt, data, whole ? g : full, b, e) != DTRAIN_OK) {
      fprintf(stderr, "rank %d: error: %s\n", r, dt_last_error());
      rc = 1;
      break;
    }
    dt_optim_advance(opt);
    ++*pushes;
    /* the window in which every worker trains (see above) */
    if (++seen[w] == last) ended = 1;
    if (!ended && first < last && seen[w] - 1 == lowest) { /* (only a slowest worker can raise the fewest) */
      int64_t low = seen[0];
      for (int k = 1; k < workers; k++) low = seen[k] < low ? seen[k] : low;
      if (low > lowest) { /* the slowest worker has pushed once more */
        lowest = low;
        const int at = low == first ? 0 : low > first ? 1 : -1;
        if (at >= 0) {
          win[at] = dt_time_now();
          win[at + 2] = (double)*pushes;
        }
      }
    }
    /* the worker has its last answer (it pushed after it): that send is done */
    MPI_Wait(&q[2 * w + 1], MPI_STATUS_IGNORE);
    memcpy(out, data + b, len * sizeof(float));
    MPI_Isend(out, (int)len, MPI_FLOAT, servers + w, PS_TAG_PARAMS, MPI_COMM_WORLD, &q[2 * w + 1]);
    MPI_Irecv(g, (int)len, MPI_FLOAT, servers + w, MPI_ANY_TAG, MPI_COMM_WORLD, &q[2 * w]);
  }
  if (!rc && q) MPI_Waitall(2 * workers, q, MPI_STATUSES_IGNORE); /* the last answers (each worker had its own) */
  free(bufs);
  free(full);
  free(q);
  free(seen);
  if (rc) return rc;
  /* The final parameters on rank 0, slice by slice. */
  for (int k = 1; k < servers; k++) {
    size_t kb, ke;
    dt_comm_slice(n, servers, k, &kb, &ke);
    if (r == k) MPI_Send(data + kb, (int)(ke - kb), MPI_FLOAT, 0, PS_TAG_FINAL, MPI_COMM_WORLD);
    if (r == 0) MPI_Recv(data + kb, (int)(ke - kb), MPI_FLOAT, k, PS_TAG_FINAL, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  return 0;
}

/* Rank r >= servers: train on its shard; fig[0..4]: the last epoch's samples,
 * its seconds, and the steps, compute and communication seconds of it. */
static int ps_work(int r, int servers, int workers, const options *o, dt_params *P, model *m, dt_dataset *train,
                   double *fig) {
  const int w = r - servers, batch = o->batch_per_worker ? o->batch_per_worker : o->batch / workers;
  const size_t n = dt_params_size(P);
  dt_loader_options ld;
  memset(&ld, 0, sizeof ld);
  ld.batch_size = batch;
  ld.shuffle = 1;
  ld.seed = o->seed;
  ld.shard_index = w;
  ld.shard_count = workers;
  dt_loader *loader = dt_loader_new(train, &ld);
  dt_graph *g = dt_graph_create(P, NULL);
  MPI_Request *q = (MPI_Request *)malloc(2 * (size_t)servers * sizeof(MPI_Request));
  if (!loader || !g || !q) {
    fprintf(stderr, "rank %d: error: %s\n", r, q ? dt_last_error() : "out of memory");
    for (int s = 0; s < servers; s++) /* the servers wait for this worker's word */
      MPI_Send(dt_params_grad(P), 0, MPI_FLOAT, s, PS_TAG_DONE, MPI_COMM_WORLD);
    dt_loader_destroy(loader);
    dt_graph_destroy(g);
    free(q);
    return 1;
  }
  const int64_t steps = (train->n / workers) / batch;
  float *data = dt_params_data(P), *grad = dt_params_grad(P);
  int rc = 0;
  for (int64_t ep = 0; ep < o->epochs && !rc; ep++) {
    double t0 = dt_time_now(), compute = 0, comm = 0, loss_sum = 0;
    dt_loader_set_position(loader, ep, 0);
    for (int64_t k = 0; k < steps; k++) {
      dt_minibatch mb;
      if (!next_minibatch(loader, r, &mb)) {
        rc = 1;
        break;
      }
      double c0 = dt_time_now();
      dt_graph_reset(g);
      dt_params_zero_grad(P);
      dt_tensor *loss = step_fn(g, 0, &mb, m);
      if (!loss || dt_backward(g, loss) != DTRAIN_OK) {
        fprintf(stderr, "rank %d: step %lld: error: %s\n", r, (long long)k, dt_last_error());
        rc = 1;
        break;
      }
      loss_sum += loss->data[0];
      double c1 = dt_time_now();
      for (int s = 0; s < servers; s++) { /* push each server its slice, take back its parameters */
        size_t b, e;
        dt_comm_slice(n, servers, s, &b, &e);
        MPI_Irecv(data + b, (int)(e - b), MPI_FLOAT, s, PS_TAG_PARAMS, MPI_COMM_WORLD, &q[2 * s]);
        MPI_Isend(grad + b, (int)(e - b), MPI_FLOAT, s, PS_TAG_GRAD, MPI_COMM_WORLD, &q[2 * s + 1]);
      }
      if (MPI_Waitall(2 * servers, q, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
        fprintf(stderr, "rank %d: step %lld: error: the exchange with the servers failed\n", r, (long long)k);
        rc = 1;
        break;
      }
      compute += c1 - c0;
      comm += dt_time_now() - c1;
    }
    if (rc) break;
    const double secs = dt_time_now() - t0;
    fig[0] = (double)(steps * batch);
    fig[1] = secs;
    fig[2] = (double)steps;
    fig[3] = compute;
    fig[4] = comm;
    if (w == 0 && !o->quiet)
      printf("epoch %lld: worker 0: train loss %.4f, %.0f samples/s (this worker)\n", (long long)ep + 1,
             loss_sum / (double)(steps > 0 ? steps : 1), (double)(steps * batch) / secs);
    fflush(stdout);
  }
  for (int s = 0; s < servers; s++) MPI_Send(grad, 0, MPI_FLOAT, s, PS_TAG_DONE, MPI_COMM_WORLD); /* done, or failed */
  dt_loader_destroy(loader);
  dt_graph_destroy(g);
  free(q);
  return rc;
}

/* The whole --servers run on this rank; 0 when it went well. */
static int ps_run(const options *o, int rank, int world, dt_params *P, dt_optim *opt, model *m, dt_dataset *train,
                  const dt_dataset *test) {
  const int servers = o->ps, workers = world - o->ps;
  const int batch = o->batch_per_worker ? o->batch_per_worker : o->batch / workers;
  double fig[5] = {0, 0, 0, 0, 0}, sum[5] = {0, 0, 0, 0, 0}, longest = 0;
  int64_t pushes = 0;
  const long long steps = (long long)((train->n / workers) / batch);
  if (steps < 1) { /* (every rank finds the same, so none waits for another) */
    if (rank == 0)
      fprintf(stderr, "error: %lld samples in %d shards leave a worker fewer than the %d rows of its batch\n",
              (long long)train->n, workers, batch);
    return 2;
  }
  if (rank == 0 && !o->quiet)
    printf("%d parameter server%s + %d worker%s (asynchronous, MPI), %lld samples in %d shard%s, batch %d per "
           "worker, %lld steps per epoch\n", servers, servers == 1 ? "" : "s", workers, workers == 1 ? "" : "s",
           (long long)train->n, workers, workers == 1 ? "" : "s", batch, steps);
  fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD); /* all start together (06 over TCP: once every worker has joined) */
  double win[4] = {0, 0, 0, 0}; /* a server's window with every worker training: start, end, pushes at each */
  const int64_t half = steps * o->epochs / 2 > steps ? steps * o->epochs / 2 : steps; /* the window's start */
  int rc = rank < servers ? ps_serve(rank, servers, workers, P, opt, &pushes, half, steps * o->epochs, win)
                          : ps_work(rank, servers, workers, o, P, m, train, fig);
  if (rc && rank < servers) MPI_Abort(MPI_COMM_WORLD, 1); /* its workers wait for answers that will not come */
  /* Everyone's word on how it went, then the job's figures (rank 0). */
  int bad = rc != 0, any_bad = 0;
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Reduce(fig, sum, 5, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
  MPI_Reduce(&fig[1], &longest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (any_bad) {
    if (!rc) fprintf(stderr, "rank %d: stopped: another rank failed\n", rank);
    return 1;
  }
  if (rank < servers) printf("rank %d: server: %lld pushes applied\n", rank, (long long)pushes);
  if (rank == 0) {
    dt_graph *eval = dt_graph_create(P, NULL);
    if (eval) dt_graph_set_grad_enabled(eval, 0);
    double acc = eval ? test_accuracy(eval, m, test, o->eval_limit) : -1;
    dt_graph_destroy(eval);
    if (acc < 0) {
      fprintf(stderr, "rank 0: error: %s\n", dt_last_error());
      return 1;
    }
    const double st = sum[2] > 0 ? 1e3 / sum[2] : 0; /* ms a step, over all workers' steps */
    printf("parameter servers: last epoch %.0f samples/s (all workers) step_ms=%.3f compute_ms=%.3f comm_ms=%.3f\n",
           longest > 0 ? sum[0] / longest : 0.0, sum[1] * st, sum[3] * st, sum[4] * st);
    if (win[1] > win[0] && win[3] > win[2]) /* (one epoch, or a worker done before the last began: none) */
      printf("parameter servers: while every worker trained: %.0f samples/s (%.0f pushes in %.6f s of server 0's "
             "clock)\n", (win[3] - win[2]) * batch / (win[1] - win[0]), win[3] - win[2], win[1] - win[0]);
    printf("rank 0: final params_checksum=%016llx test_accuracy=%.4f\n", (unsigned long long)dt_params_checksum(P), acc);
  }
  return 0;
}
#endif

/* Returns 1 to go on, 0 after printing what is wrong and the usage (exit 2),
 * -1 after the help (exit 0). */
static int parse(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  o->epochs = 2;
  o->batch = 64;
  o->threads = 1;
  o->lr = 1e-3f;
  o->seed = 1;
  o->crash_rank = -1;
  o->stall_rank = -1;
  const char *crash = NULL, *stall = NULL, *compress = "none";
  const char *trace = NULL; /* --trace */
  const ex_flag flags[] = {
      {"epochs", 'i', &o->epochs, 1, 1e6, "passes over the training set"},
      {"batch", 'i', &o->batch, 1, 1e7, "the global batch: each of W workers takes batch/W"},
      {"batch-per-worker", 'i', &o->batch_per_worker, 1, 1e7, "rows per worker instead (the global batch: W times it)"},
      {"threads", 'i', &o->threads, 1, 1024, "compute threads per worker"},
      {"lr", 'f', &o->lr, 0, 100, "Adam's learning rate"},
      {"limit", 'l', &o->limit, 0, 1e12, "train on the first N samples only (0: all)"},
      {"eval-limit", 'l', &o->eval_limit, 0, 1e12, "test on the first N test samples only (0: all)"},
      {"seed", 'u', &o->seed, 0, 1.8e19, "seed of the weights and the shuffling"},
      {"data", 's', &o->data, 0, 0, "directory of the Fashion-MNIST files (none: the usual places)"},
      {"checkpoint", 's', &o->checkpoint, 0, 0, "rank 0 saves the training state here"},
      {"checkpoint-every", 'l', &o->checkpoint_every, 1, 1e12, "save every N steps too (needs --checkpoint)"},
      {"resume", 's', &o->resume, 0, 0, "continue from this checkpoint"},
      {"crash-at", 's', &crash, 0, 0, "RANK:STEP -- that rank exits at that step (a failure to recover from)"},
      {"stall-at", 's', &stall, 0, 0, "RANK:STEP -- that rank stops responding at that step"},
      {"compress", 's', &compress, 0, 0, "gradients on the wire: none, fp16 or bf16 (half the bytes), topk:F (a fraction F of the values), powersgd:R (rank-R factors)"},
      {"overlap", 'b', &o->overlap, 0, 0, "all-reduce the gradient in buckets during backward (2 MiB)"},
      {"quiet", 'b', &o->quiet, 0, 0, "no progress lines"},
      {"model", 's', &o->model, 0, 0, "mlp (784-256-128-10) or cnn (two 5x5 convolutions, 02's CNN)"},
      {"trace", 's', &trace, 0, 0, EX_TRACE_HELP},
      {"servers", 'i', &o->ps, 1, 1024, "MPI builds: ranks 0..M-1 are asynchronous parameter servers, the rest workers"},
      {"sim-compute-ms", 'f', &o->sim_compute_ms, 0, 1e6, "SimGrid builds, with smpirun --cfg=smpi/simulate-computation:no: a worker's step computes this long"},
      {"sim-update-ms", 'f', &o->sim_update_ms, 0, 1e6, "SimGrid builds, likewise: an optimizer step (a worker's, or a server's a push) takes this long"},
  };
  const int n = (int)(sizeof flags / sizeof flags[0]);
  const char *extra = "  Across processes: --rank R --world W --peers host:port,... (or DTRAIN_CONFIG; see tools/dtrain-launch)\n";
  int r = ex_parse("05_multi_worker", argc, argv, flags, n, extra);
  if (r == 0) ex_usage(stderr, "05_multi_worker", flags, n, extra);
  if (r <= 0) return r;
  if (!ex_trace_begin(trace)) return 0;
  o->batch_given = ex_given(argc, argv, "batch");
  for (int k = 0; k < 2; k++) {
    const char *v = k ? stall : crash;
    long long st;
    char tail;
    if (!v) continue;
    if (sscanf(v, "%d:%lld%c", k ? &o->stall_rank : &o->crash_rank, &st, &tail) != 2 || st < 0) {
      fprintf(stderr, "error: --%s wants RANK:STEP, not '%s'\n", k ? "stall-at" : "crash-at", v);
      goto bad;
    }
    if (k) o->stall_step = st;
    else o->crash_step = st;
  }
  if (!o->model) o->model = "mlp";
  if (strcmp(o->model, "mlp") && strcmp(o->model, "cnn")) {
    fprintf(stderr, "error: --model is mlp or cnn, not '%s'\n", o->model);
    goto bad;
  }
  if (dt_compress_parse(compress, &o->compress) != DTRAIN_OK) {
    fprintf(stderr, "error: --compress: %s\n", dt_last_error());
    goto bad;
  }
#if !defined(DTRAIN_USE_MPI)
  if (o->ps) {
    fprintf(stderr, "error: --servers is the MPI build's (mpicc -DDTRAIN_USE_MPI); over TCP, parameter servers are "
                    "examples/06_parameter_server's\n");
    goto bad;
  }
#endif
  if (o->ps && (o->threads > 1 || o->compress.kind != DTRAIN_COMPRESS_NONE || o->overlap || o->checkpoint || o->resume ||
                crash || stall || o->checkpoint_every)) {
    fprintf(stderr, "error: --servers trains with one thread a worker and plain floats, without checkpoints, crashes or "
                    "stalls (examples/06_parameter_server has those over TCP)\n");
    goto bad;
  }
  if ((o->sim_compute_ms > 0 || o->sim_update_ms > 0) && (!EX_SMPI || o->threads > 1)) {
    fprintf(stderr, "error: --sim-compute-ms and --sim-update-ms are for a build under SimGrid (smpicc "
                    "-DDTRAIN_USE_MPI), one thread a rank\n");
    goto bad;
  }
  if (o->batch_given && o->batch_per_worker) {
    fprintf(stderr, "error: --batch (global) and --batch-per-worker are two meanings of one number; give one\n");
    goto bad;
  }
  return 1;
bad:
  ex_usage(stderr, "05_multi_worker", flags, n, extra);
  return 0;
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, below, not by dtrain's logger too */
  /* 1. Where am I? Flags (--rank/--world/--peers, removed from argv), else
   *    DTRAIN_CONFIG, else a cluster of one. */
  dt_cluster *cl = NULL;
  if (dt_cluster_discover(&argc, argv, &cl) != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 2;
  }
  options o;
  int pr = parse(argc, argv, &o);
  if (pr <= 0) return pr < 0 ? 0 : 2;
  if (!output_ok("--checkpoint", o.checkpoint, 0)) return 2; /* rank 0 writes it; all stop at once */
  if (o.checkpoint_every && !o.checkpoint) {
    fprintf(stderr, "error: --checkpoint-every needs --checkpoint PATH\n");
    return 2;
  }
  /* Started again by tools/dtrain-launch --max-restarts: resume from the
   * checkpoint when there is one (none yet: from the start, which is the
   * same), and the experiment's crash or stall happened already. */
  const char *restart_env = getenv("DTRAIN_RESTART");
  int restart = restart_env ? atoi(restart_env) : 0;
  if (restart > 0) {
    o.crash_rank = o.stall_rank = -1;
    FILE *probe = o.checkpoint && !o.resume ? fopen(o.checkpoint, "rb") : NULL;
    if (probe) {
      fclose(probe);
      o.resume = o.checkpoint;
    }
  }

  /* 2. The same model everywhere (the handshake compares its hash). */
  dt_params *P = dt_params_create(o.seed);
  model m;
  if (!P || model_init(&m, P, !strcmp(o.model, "cnn")) != DTRAIN_OK) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    dt_params_destroy(P);
    return 1;
  }
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = o.lr;
  dt_optim *opt = dt_optim_create(P, &od);

  /* 3. The communicator: TCP to every other worker (retrying while they
   *    start), or MPI_COMM_WORLD. */
#if defined(DTRAIN_USE_MPI)
  dt_comm *comm = dt_comm_create_mpi();
#else
  /* The cluster knows the world already: a --batch that cannot divide is said
   * before any connection, so that no rank waits for one that has given up. */
  if (!o.batch_per_worker && o.batch % (cl->workers * o.threads) != 0) {
    fprintf(stderr, "error: --batch %d does not divide over %d worker%s x %d replica%s = %d\n", o.batch, cl->workers,
            cl->workers == 1 ? "" : "s", o.threads, o.threads == 1 ? "" : "s", cl->workers * o.threads);
    return 2;
  }
  dt_net_options no = dt_net_defaults(); /* DTRAIN_TIMEOUT, DTRAIN_TOKEN, DTRAIN_LISTEN_FD from the environment */
  no.model_hash = dt_params_hash(P);
  dt_comm *comm = dt_comm_create_tcp(cl, &no);
#endif
  if (!comm) {
    fprintf(stderr, "error: %s\n", dt_last_error());
    return 1;
  }
  int rank = dt_comm_rank(comm), world = dt_comm_world(comm);
  const int dp = world - o.ps; /* the ranks that train on data (--servers: the rest serve) */
  if (dp < 1) {
    fprintf(stderr, "error: --servers %d leaves no worker among %d ranks\n", o.ps, world);
    return 2;
  }
#if EX_SMPI
  sim_step_s = 1e-3 * ((double)o.sim_compute_ms + (o.ps ? 0.0 : (double)o.sim_update_ms));
  sim_serve_s = o.ps ? 1e-3 * (double)o.sim_update_ms : 0.0;
  if (o.sim_compute_ms > 0 || o.sim_update_ms > 0) { /* then the real compute must cost no simulated time */
    const double t0 = dt_time_now();
    volatile double x = 0;
    for (int i = 0; i < 4000000; i++) x = x + 1e-9 * (double)i;
    if (dt_time_now() - t0 > 1e-4) {
      if (rank == 0)
        fprintf(stderr, "error: --sim-compute-ms and --sim-update-ms need smpirun --cfg=smpi/simulate-computation:no "
                        "(else the real compute is counted as well)\n");
      return 2;
    }
  }
#endif
  /* --batch is global: W workers x N threads each take batch/(W*N) rows, so it
   * must divide (said before any data is loaded; every rank says the same;
   * over TCP already before connecting, above).
   * --batch-per-worker keeps the old meaning: B rows a worker, split over its
   * threads as the strategy splits any batch. */
  if (!o.batch_per_worker && o.batch % (dp * o.threads) != 0) {
    fprintf(stderr, "error: --batch %d does not divide over %d worker%s x %d replica%s = %d\n", o.batch, dp, dp == 1 ? "" : "s", o.threads,
            o.threads == 1 ? "" : "s", dp * o.threads);
    return 2;
  }
  const int batch_worker = o.batch_per_worker ? o.batch_per_worker : o.batch / dp; /* the rows this worker loads per step */

  /* 4. Data: each worker reads its own shard (the loader's shard_index/count). */
  char dir[512];
  int has_train = 0;
  dt_dataset *train = NULL, *test = NULL;
  dt_result r = dt_fashion_mnist_find(o.data, dir, sizeof dir, &has_train);
  if (r == DTRAIN_OK) r = dt_fashion_mnist_load(dir, has_train ? &train : NULL, &test);
  if (r == DTRAIN_OK && !train) { /* only the shipped test split: 8000 train / 2000 test */
    dt_dataset *all = test;
    r = dt_dataset_split(all, 0.2, 12345, &train, &test);
    dt_dataset_destroy(all);
  }
  int64_t flat = 784;
  if (r == DTRAIN_OK) r = dt_dataset_reshape(train, 1, &flat);
  if (r == DTRAIN_OK) r = dt_dataset_reshape(test, 1, &flat);
  if (r != DTRAIN_OK) {
    fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
    return 1;
  }
  int64_t n_train = o.limit > 0 && o.limit < train->n ? o.limit : train->n;
  dt_dataset *part = NULL;
  if (n_train < train->n) {
    int64_t *idx = (int64_t *)malloc((size_t)n_train * sizeof(int64_t));
    for (int64_t i = 0; idx && i < n_train; i++) idx[i] = i;
    part = idx ? dt_dataset_select(train, idx, n_train) : NULL;
    if (!part) {
      fprintf(stderr, "rank %d: error: %s\n", rank, idx ? dt_last_error() : "out of memory");
      return 1;
    }
    free(idx);
  }
#if defined(DTRAIN_USE_MPI)
  if (o.ps) {
    int prc = ps_run(&o, rank, world, P, opt, &m, part ? part : train, test);
    dt_comm_destroy(comm);
    dt_dataset_destroy(part);
    dt_dataset_destroy(train);
    dt_dataset_destroy(test);
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    dt_cluster_destroy(cl);
    return prc;
  }
#endif
  dt_loader_options ld;
  memset(&ld, 0, sizeof ld);
  ld.batch_size = batch_worker;
  ld.shuffle = 1;
  ld.seed = o.seed; /* the same seed everywhere: one permutation per epoch, cut into disjoint shards */
  ld.shard_index = rank;
  ld.shard_count = world;
  dt_loader *loader = dt_loader_new(part ? part : train, &ld);
  if (!loader) {
    fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
    return 1;
  }
  /* Every worker must make the same number of steps: shards differ by at most one sample. */
  int64_t steps_per_epoch = (n_train / world) / batch_worker;

  /* 5. The strategy: lock-step across processes, o.threads replicas in each.
   *    Creating it checks the model hash and broadcasts rank 0's parameters. */
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(comm, o.threads);
  sd.compress = o.compress;
  sd.overlap = o.overlap;
  dt_strategy *s = dt_strategy_create(P, opt, step_fn, &m, &sd);
  if (!s) {
    fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
    return 1;
  }
  int64_t first_epoch = 0, step = 0, first_k = 0;
  if (o.resume) { /* every rank reads the same checkpoint, then all agree again */
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = P;
    st.optim = opt;
    if (dt_checkpoint_load(o.resume, &st) != DTRAIN_OK || dt_strategy_sync(s) != DTRAIN_OK) {
      fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
      return 1;
    }
    first_epoch = st.epoch;
    step = st.step;
    first_k = step - first_epoch * steps_per_epoch; /* steps of that epoch already made (--checkpoint-every) */
    if (first_k < 0 || first_k >= steps_per_epoch) {
      fprintf(stderr, "rank %d: error: %s holds step %lld of epoch %lld: not this run's data (%lld steps an epoch)\n",
              rank, o.resume, (long long)step, (long long)first_epoch, (long long)steps_per_epoch);
      return 1;
    }
    if (rank == 0 && !o.quiet) printf("resumed from %s at epoch %lld, step %lld\n", o.resume, (long long)st.epoch, (long long)st.step);
  }
  if (rank == 0 && !o.quiet)
    printf("%d workers x %d threads, %s, %lld samples in %d shards, batch %d per worker (global %d), %lld steps per epoch\n",
           world, o.threads, dt_comm_name(comm), (long long)n_train, world, batch_worker, batch_worker * world,
           (long long)steps_per_epoch);

  dt_graph *eval = dt_graph_create(P, NULL);
  dt_graph_set_grad_enabled(eval, 0);
  int rc = 0;
  double acc = 0;
  dt_strategy_stats ep0; /* the stats as the last epoch began */
  memset(&ep0, 0, sizeof ep0);
  for (int64_t e = first_epoch; e < o.epochs && !rc; e++) {
    dt_strategy_stats_get(s, &ep0); /* the final line's times: the last epoch's steps */
    double t0 = dt_time_now(), loss_sum = 0;
    int64_t k0 = e == first_epoch ? first_k : 0;
    dt_loader_set_position(loader, e, k0 * batch_worker);
    for (int64_t k = k0; k < steps_per_epoch; k++, step++) {
      if (rank == o.crash_rank && step == o.crash_step) {
        fflush(stdout);
#if defined(_WIN32) /* no SIGKILL there: end at once all the same, no goodbye, no exit handlers */
        _Exit(137);
#else
        raise(SIGKILL); /* a crash, not an exit: no goodbye to the peers */
#endif
      }
      if (rank == o.stall_rank && step == o.stall_step) {
        fflush(stdout);
#if defined(_WIN32) /* no SIGSTOP there: this thread stops for good, its connections stay open */
        for (;;) dt_sleep(3600.0);
#else
        raise(SIGSTOP); /* a hung machine: connections stay open, nothing arrives */
#endif
      }
      dt_minibatch mb;
      if (!next_minibatch(loader, rank, &mb)) {
        rc = 1;
        break;
      }
      float loss;
      if (dt_strategy_step(s, &mb, &loss) != DTRAIN_OK) {
        /* a lost or stalled worker: the message names it, the operation and its number */
        fprintf(stderr, "rank %d: step %lld failed: %s\n", rank, (long long)step, dt_last_error());
        rc = 1;
        break;
      }
      loss_sum += loss;
      if (o.checkpoint_every && rank == 0 && (step + 1) % o.checkpoint_every == 0 && k + 1 < steps_per_epoch) {
        /* mid-epoch: the epoch in progress and the steps made (the position in it follows) */
        dt_train_state st;
        memset(&st, 0, sizeof st);
        st.params = P;
        st.optim = opt;
        st.step = step + 1;
        st.epoch = e;
        if (dt_checkpoint_save(o.checkpoint, &st) != DTRAIN_OK) {
          fprintf(stderr, "rank 0: checkpoint: %s\n", dt_last_error());
          rc = 1;
          break;
        }
      }
    }
    if (rc) break;
    const double secs = dt_time_now() - t0; /* the epoch's training, not the evaluation after it */
    acc = test_accuracy(eval, &m, test, o.eval_limit);
    if (acc < 0) {
      fprintf(stderr, "rank %d: error: %s\n", rank, dt_last_error());
      rc = 1;
      break;
    }
    if (rank == 0) {
      if (!o.quiet)
        printf("epoch %lld: train loss %.4f, test accuracy %.4f, %.0f samples/s (all workers)\n", (long long)e + 1,
               loss_sum / (double)(steps_per_epoch - k0), acc, (double)(steps_per_epoch * batch_worker * world) / secs);
      if (o.checkpoint) { /* rank 0 writes (atomically); the parameters are the same everywhere */
        dt_train_state st;
        memset(&st, 0, sizeof st);
        st.params = P;
        st.optim = opt;
        st.step = step;
        st.epoch = e + 1;
        if (dt_checkpoint_save(o.checkpoint, &st) != DTRAIN_OK) {
          fprintf(stderr, "rank 0: checkpoint: %s\n", dt_last_error());
          rc = 1;
        }
      }
    }
    fflush(stdout);
  }
  if (!rc) {
    dt_strategy_stats ss;
    char cspec[48];
    dt_strategy_stats_get(s, &ss);
    /* the last epoch's steps (less the stats at its start): ms a step */
    const int64_t es = ss.steps - ep0.steps;
    const double ps = es > 0 ? 1e3 / (double)es : 0.0;
    printf("rank %d: final params_checksum=%016llx test_accuracy=%.4f compress=%s wire_bytes_per_step=%.0f "
           "step_ms=%.3f compute_ms=%.3f comm_ms=%.3f wait_ms=%.3f\n",
           rank, (unsigned long long)dt_params_checksum(P), acc, dt_compress_format(o.compress, cspec, sizeof cspec),
           ss.steps ? (double)ss.wire_bytes / (double)ss.steps : 0.0, (ss.seconds - ep0.seconds) * ps,
           (ss.compute_s_mean - ep0.compute_s_mean) * ps, (ss.comm_s_mean - ep0.comm_s_mean) * ps,
           (ss.wait_s_mean - ep0.wait_s_mean) * ps);
  }
  dt_graph_destroy(eval);
  dt_strategy_destroy(s);
  dt_comm_destroy(comm);
  dt_loader_destroy(loader);
  dt_dataset_destroy(part);
  dt_dataset_destroy(train);
  dt_dataset_destroy(test);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  dt_cluster_destroy(cl);
  return rc;
}
