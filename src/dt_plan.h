/* ===========================================================================
 * dt_plan.h -- should I distribute? The planner: each strategy's speed and
 * memory predicted from the model's measured cost and the link's
 * ===========================================================================
 * dt_plan_measure runs the user's own step function for a few steps, on a
 * scratch optimizer and with the parameters restored afterwards, and fits
 * the step's time as fixed + per-sample (two batch sizes), times the
 * optimizer over all parameters, and counts the bytes of parameters,
 * gradients, optimizer state and activations. dt_plan_predict turns that
 * and a link (latency and bandwidth: given, parsed from a DTRAIN_NETEM-style
 * spec with dt_plan_link_parse, or the loopback defaults) into one row per
 * strategy and worker count:
 *
 *   one_device                     B / t(B)
 *   mirrored(N) (threads)          t(B/N) x ceil(N / cores) + update/N + an in-process
 *                                  reduction (2 x gradient bytes / N at memory speed)
 *   async(N) (threads, Hogwild)    each replica: t(B/N) + update + pull and push
 *                                  copies; replicas on min(N, cores) cores
 *   multi_worker_mirrored(N) ring  t(B/N) + update + ring all-reduce of the gradient:
 *                                  2(N-1) alpha + 2 (N-1)/N x bytes / beta
 *     ... recursive doubling       log2(N) (alpha + bytes / beta)  (N a power of 2)
 *     ... with compression         bytes x compress_ratio (fp16: 0.5)
 *     ... with overlap             all-reduce hidden behind backward up to
 *                                  overlap_fraction of t(B/N)
 *   parameter_server(N, M)         each worker: t(B/N) + 2 alpha + (gradient +
 *                                  parameter bytes) / beta + update / M (the servers
 *                                  apply the push before the pull is answered); on a
 *                                  switch the round is a fluid of N such workers, all
 *                                  starting in step: the servers' full-duplex ports,
 *                                  M links wide, share their bandwidth equally among the
 *                                  pushes (and, apart, the pulls) in them, each at most
 *                                  its worker's link; the updates (update / M a push)
 *                                  one at a time in arrival order; the rate over the
 *                                  later half of 128 rounds (links_per_connection: a
 *                                  port per connection, only the updates shared; a
 *                                  shared medium: N x (gradient + parameter bytes) /
 *                                  beta + N x update / M); expected staleness N - 1
 *   pipeline(P) (1F1B, m micro)    (m + P - 1) x (t(B)/(P m) + boundary transfer);
 *                                  bubble (P - 1)/(m + P - 1); memory 1/P of the weights
 *   tensor_parallel(T)             every rank the whole batch: fixed + B x per-sample x
 *                                  (1 - s + s/T) + update x (1 - q + q/T) + k ring
 *                                  all-reduces of B x tp_bytes_per_sample / k over T
 *                                  (on the critical path: nothing overlaps them) + the
 *                                  wait for the slowest at each (sqrt(k) x one wait on
 *                                  the whole step's spread); s = tp_split_share, q =
 *                                  tp_param_share, k = tp_allreduces; weights,
 *                                  gradients and optimizer state x (1 - q + q/T), the
 *                                  activations whole
 *
 * t(b) is the measured step time at batch b (fixed + b x per-sample), B the
 * global batch (every worker takes B/N: dtrain's rule). Data loading, when
 * measured (dt_plan_measure_loader: ld per sample), is added where it runs:
 * one_device and the thread strategies load the global batch on the
 * caller's thread before the replicas start (+ ld x B a step, not divided),
 * each worker process loads its own B/N (+ ld x B/N, taking turns with the
 * others where the cores are shared). Replicas beyond the
 * cores take turns: their compute counts ceil(N / cores) times (threads
 * always; processes with shared_cores, a rehearsal on one machine), and
 * replicas computing at once on one machine are each busy_slowdown slower
 * (dt_plan_measure times it with every core busy). On one machine
 * (shared_cores) a step of N processes also takes at least all their CPU work
 * over the cores: N x (t(B/N) + loading + update), the all-reduce's
 * additions (the ring's (N-1) x gradient bytes, recursive doubling's
 * N log2 N x gradient bytes, at memory_Bps), and 2 x every byte sent at
 * loopback_Bps (the kernel copies it at both ends of a local socket: what
 * bounds a loopback stream). Each row has its
 * samples/s, time per epoch, memory per worker, its share of the step spent
 * communicating, the bubble and the expected staleness; dt_plan_recommend
 * picks the fastest row that fits the memory limit, and says "do not
 * distribute" when one_device is within 10% of it, with its reasons. These
 * are models: the README's table says how close they come to measured runs.
 */
#ifndef DTRAIN_PLAN_H
#define DTRAIN_PLAN_H

typedef struct dt_plan_link {
  double latency_s;     /* one way, per message */
  double bandwidth_Bps; /* payload bytes per second, each direction */
  int shared;           /* 1: one medium that every transfer shares (Wi-Fi, a hub): k transfers at
                           once get bandwidth_Bps / k each; 0: each machine its own (a switch) */
} dt_plan_link;

/* The model's cost, as dt_plan_measure finds it (or filled by hand). */
typedef struct dt_plan_model {
  double fixed_s;          /* per step, whatever the batch (bookkeeping, the loss, ...) */
  double per_sample_s;     /* forward + backward per sample */
  double update_s;         /* the optimizer over all parameters, once */
  int64_t params;          /* floats */
  int64_t param_bytes, grad_bytes, optim_bytes;
  int64_t activation_bytes_per_sample; /* the graph's arena per sample of the batch */
  int64_t boundary_bytes_per_sample;   /* pipeline: what one stage hands the next per sample (0: no pipeline rows) */
  int pipeline_max_stages;             /* layers the model can be cut into (0: no pipeline rows) */
  int measured_batch;                  /* the batch dt_plan_measure ran */
  double load_per_sample_s;            /* data loading per sample (dt_plan_measure_loader; 0: not in the model) */
  double busy_slowdown;                /* forward + backward with busy_cores replicas running at once on this
                                          machine over one alone, >= 1 (caches and memory bandwidth are shared;
                                          0: not measured, taken as 1) */
  int busy_cores;                      /* how many ran at once (dt_plan_measure: min(cores, rows, replicas max)) */
  double jitter;                       /* forward + backward's spread from step to step over its median (1.4826 x
                                          the median absolute deviation: a normal's sigma; 0: none). A synchronous
                                          step across N processes waits for the slowest: the rows add jitter x
                                          compute x E[the largest of N standard normals] (0.56 at 2, 2.33 at 64) */
  /* tensor parallel (dt_tensor_parallel.h: column- then row-parallel layers over T ranks, each rank the
     whole batch); tp_max_ranks 0: no tensor-parallel rows */
  int tp_max_ranks;                    /* the largest T the split layers' sizes allow */
  double tp_split_share;               /* share of forward + backward in the split layers (1/T of it on each rank;
                                          the rest whole on every rank) */
  double tp_param_share;               /* share of the parameters (and so of the update) in the split layers
                                          (0: tp_split_share) */
  int tp_allreduces;                   /* all-reduces a step, forward and backward together (one each way per
                                          column/row pair; none backward into the input data) */
  int64_t tp_bytes_per_sample;         /* what they carry together, per sample of the batch */
  double memory_Bps;                   /* a pass over a gradient-sized buffer, read and written, in gradient
                                          bytes a second, as this machine runs it (dt_plan_measure: a scale and
                                          a copy, the passes a replica makes over its summed gradient; the
                                          gradient often stays in a core's cache: several times a memcpy's rate
                                          out of memory); the rows' in-process passes use it unless
                                          dt_plan_options.memory_Bps is set (0: not measured, 5e9) */
} dt_plan_model;

typedef struct dt_plan_options {
  int batch;                /* the global batch B (> 0); with weak_scaling each worker's */
  int weak_scaling;         /* 1: every worker keeps `batch` rows a step, the global batch grows with
                               N (B = N x batch; pipelines still share one batch); 0: B is fixed and
                               each of N workers takes B/N (dtrain's --batch) */
  int64_t epoch_samples;    /* samples per epoch (0: no epoch times) */
  int max_workers;          /* rows for N = 1, 2, 4, ... up to this (default 16, at most 64) */
  int cores;                /* cores of one machine, for the thread strategies (default: this machine's) */
  dt_plan_link link;        /* between processes (0 and 0: the loopback defaults) */
  double memory_Bps;        /* in-process passes over the gradient (0: the model's measured rate, else 5e9) */
  double thread_sync_s;     /* a barrier among threads (0: 20e-6) */
  int servers;              /* parameter servers M (0: 1) */
  double compress_ratio;    /* bytes on the wire per gradient byte with compression (0: 0.5, fp16) */
  double overlap_fraction;  /* share of the backward that can hide the all-reduce (0: 0.5) */
  int microbatches;         /* pipeline m (0: 4 per stage) */
  double memory_limit_bytes;/* per worker (0: no limit) */
  int links_per_connection; /* 1: every connection has a link of its own (DTRAIN_NETEM's emulation:
                               a parameter server's N workers do not share its link); 0: each
                               process's one link carries all its connections (a machine's NIC) */
  int shared_cores;         /* 1: the worker and server processes run on one machine and share its
                               `cores` (a rehearsal over loopback or an emulated link); 0: a machine each */
  double loopback_Bps;      /* one TCP loopback stream's payload rate on this machine, which the kernel's
                               copies at both ends of a local socket cost (shared_cores; 0: 2.5e9; a
                               machine's own differs by 3x and more: probe it, 02 --plan under the
                               launcher does); also the default link's bandwidth */
} dt_plan_options;

typedef struct dt_plan_row {
  char name[48];            /* "one_device", "mirrored", "multi_worker_mirrored ring fp16", ... */
  char family[24];          /* "one_device", "threads", "processes", "parameter_server", "pipeline", "tensor" */
  int workers;              /* N (pipeline: stages; tensor: ranks) */
  double step_s;            /* one global step (async: one round of all workers' pushes) */
  double samples_per_sec;   /* global */
  double epoch_s;           /* epoch_samples / samples_per_sec (0 without epoch_samples) */
  double memory_bytes;      /* per worker */
  double comm_share;        /* of the step: communication on its critical path */
  double bubble;            /* pipeline: idle share of each stage */
  double staleness;         /* async: expected updates by others between a pull and its push */
  double speedup;           /* samples_per_sec / one_device's */
  int fits;                 /* memory_bytes <= memory_limit (1 without a limit) */
} dt_plan_row;

/* Runs fn (the loss of one replica's batch, as for dt_strategy_create) for
 * `steps` steps (default 20 when <= 0) at batch b->rows and again at half of
 * it, forward, backward and an update by a scratch copy of opt's options,
 * then at b->rows over min(cores, rows) replicas at once (a mirrored strategy:
 * fn must take any replica index, as for dt_strategy_create) for
 * busy_slowdown, and times two passes over a buffer of the gradient's size
 * for memory_Bps; params are as they were afterwards and opt is untouched. */
DTRAIN_API dt_result dt_plan_measure(dt_params *params, const dt_optim *opt, dt_step_fn fn, void *user,
                                     const dt_minibatch *b, int steps, dt_plan_model *out);
/* Times `batches` calls of dt_loader_next on l (default 20 when <= 0; the
 * median, after 2 not counted) and sets out->load_per_sample_s, leaving the
 * rest of out as it was; l's position is put back afterwards. Call it after
 * dt_plan_measure (which clears out). */
DTRAIN_API dt_result dt_plan_measure_loader(dt_loader *l, int batches, dt_plan_model *out);
/* "rate=100mbit,delay=2ms[,jitter=1ms]" (DTRAIN_NETEM's units; rate counts
 * 66 header bytes per 1448-byte segment, as the emulation does, so the payload
 * gets 1448/1514 of it; the delay is added to loopback's 25 us; a jitter adds
 * half of itself to the latency), "bandwidth=10gbit,latency=11us" (the link as
 * it is: the payload's rate and the one-way latency, nothing added or taken
 * off, e.g. a simulator's platform; one spelling per quantity), or "loopback"
 * (the defaults); ",shared=1" adds that every transfer shares the one medium. */
DTRAIN_API dt_result dt_plan_link_parse(const char *spec, dt_plan_link *out);
/* Measures the link between ranks a and b of c (each of the two calls it,
 * with its own rank; no other message between them in flight on tag
 * DT_COMM_TAG_MAX): 3 + 21 round trips of one float (latency: half the
 * median), then transfers from a to b doubling from 256 KiB until one takes
 * 50 ms or reaches 16 MiB, and that size again up to 9 times in all (while
 * the repeats take under 250 ms); bandwidth: the median of their rates, each
 * its bytes over its time less a round trip, or, where the two ends' CPU
 * times (b reports its own; each at least 1/4 of that time) account for at
 * least 3/4 of it (copies,
 * not a wire, bound it: a loopback), 2 x its bytes over their sum, one end's
 * copy rate wherever the scheduler ran the two. Both get a's figures. Over
 * TCP with DTRAIN_NETEM set, the emulated link is what is measured. */
DTRAIN_API dt_result dt_plan_probe_link(dt_comm *c, int rank, int a, int b, dt_plan_link *out);
/* The rows (at most cap into rows); returns how many there are, -1 on bad arguments. */
DTRAIN_API int dt_plan_predict(const dt_plan_model *m, const dt_plan_options *o, dt_plan_row *rows, int cap);
/* The row to pick (an index into rows), with the reasons as text into why
 * (cap bytes; NULL for none); -1 when no row fits. */
DTRAIN_API int dt_plan_recommend(const dt_plan_row *rows, int n, char *why, size_t cap);
/* The models' pieces, for the tests and for people checking the arithmetic:
 * seconds to all-reduce `bytes` over n workers on link l. Ring: 2(n-1) steps
 * of bytes/n, each l.latency_s + bytes/n/bandwidth (on a shared medium the n
 * transfers of a step share it: + bytes/bandwidth); recursive doubling:
 * ceil(log2 n) rounds of all the bytes (shared: n transfers at once). */
DTRAIN_API double dt_plan_ring_allreduce_s(int n, double bytes, dt_plan_link l);
DTRAIN_API double dt_plan_doubling_allreduce_s(int n, double bytes, dt_plan_link l);
/* The pipeline's idle share with p stages and m microbatches: (p-1)/(m+p-1). */
DTRAIN_API double dt_plan_bubble(int p, int m);

#endif /* DTRAIN_PLAN_H */
