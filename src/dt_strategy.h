/* ===========================================================================
 * dt_strategy.h -- data-parallel training in one process: one_device,
 * mirrored, central_storage and async (Hogwild) behind one API; the
 * in-process parameter store
 * ===========================================================================
 * Write the model and a step function once; pick a strategy in one line:
 *
 *   static dt_tensor *step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
 *     model *m = (model *)user;              // read-only here: replicas share it
 *     int64_t xs[2] = {b->rows, 784};
 *     dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
 *     return dt_cross_entropy(g, model_forward(g, m, x), b->y);   // mean over the shard
 *   }
 *   ...
 *   dt_strategy_options sd = dt_strategy_mirrored(4);    // or dt_strategy_one_device(), dt_strategy_central_storage(4), dt_strategy_async(4, 2)
 *   dt_strategy *s = dt_strategy_create(P, opt, step, &m, &sd);
 *   for (...) { dt_minibatch b = {...}; dt_strategy_step(s, &b, &loss); }
 *
 * | strategy            | parameters                   | per step                                                |
 * |---------------------|------------------------------|---------------------------------------------------------|
 * | one_device          | the params' own buffers      | forward/backward on the whole batch, one update          |
 * | mirrored(N)         | one copy per replica         | N shards; reduce-scatter of the gradients; each replica  |
 * |                     |                              | updates its slice; all-gather of the parameters          |
 * | central_storage(N)  | one copy read by all (*)     | N shards; gradients reduced into the centre; one update  |
 * |                     |                              | (each replica applies it to its slice of the centre)     |
 * | async(N, k)         | a lock-free store + a copy   | replicas run free: pull, forward/backward on their own   |
 * |                     | per replica                  | batch, local optimizer step, push the update             |
 * | multi_worker_       | one copy per replica in      | each process: its own batch in N shards; threads reduce  |
 * | mirrored(comm, N)   | every process                | to replica 0; ONE all-reduce across processes on comm;   |
 * |                     |                              | each replica updates its slice; all-gather (threads)     |
 * | parameter_server    | sharded over server          | this process is one worker: pull from every server,      |
 * |   (store, k)        | processes (dt_net.h)         | forward/backward on its own batch, push the (clipped)    |
 * |                     |                              | gradient; the servers apply the optimizer to their shard |
 *
 * (*) Non-trainable buffers (batch-norm running statistics) are written by
 * the forward pass, so with such a model each central_storage replica works
 * on a private copy of the centre, refreshed every step. Buffers follow
 * replica 0 in every strategy (mirrored hands replica 0's to every replica
 * after each step, within the all-gather, like PyTorch DDP's
 * broadcast_buffers; multi_worker_mirrored: rank 0's replica 0); async
 * pushes their change like any other update.
 *
 * After a step the params' data buffer holds the trained parameters under
 * every strategy (mirrored: replica 0's copy, equal to the others). Its grad
 * buffer holds the reduced gradient of the whole batch for one_device and
 * central_storage; for mirrored only replica 0's slice of it (the
 * reduce-scatter leaves each slice with its owner; the rest is scratch).
 *
 * The synchronous strategies compute exactly what one_device computes on the
 * same global batch (up to float rounding: the gradient sums run in rank
 * order) and repeat bitwise. async trades that for never waiting for the
 * slowest replica; max_staleness bounds how far it may drift (0 = lock-step).
 *
 * Batches and loss scaling. The global batch of a synchronous step is split
 * into N contiguous shards; with B rows, shard r has B/N rows plus one when
 * r < B % N (shards may be empty when B < N; an empty replica computes
 * nothing). The step function returns the loss of its shard as it would for
 * one device -- with DTRAIN_LOSS_MEAN (the default) the mean over the shard's
 * rows -- and the strategy weights its gradient by rows/B (the dt_minibatch
 * field `weight`), so the summed gradient is exactly the gradient of the mean
 * over the whole batch, for any split. DTRAIN_LOSS_SUM: the step returns a
 * sum over its rows and the weights are 1.
 * In async, each replica's step is an optimizer step of its own on its own
 * batch (weight 1), like N single-device trainers sharing the parameters.
 *
 * multi_worker_mirrored (hierarchical, across processes). desc.comm connects
 * W processes, one rank each (dt_comm_create_tcp or dt_comm_create_mpi in
 * dt_net.h; borrowed: destroy it after the strategy); desc.replicas threads
 * run inside each process. Every process calls dt_strategy_step with its OWN
 * local batch (its shard of the data, like TF's MultiWorkerMirroredStrategy);
 * the global batch is the concatenation of the local batches in rank order,
 * and local batches may differ in rows (or be empty). Per step: the local
 * replicas compute on shards of the local batch (loss gradients weighted by
 * their rows: row sums), reduce to replica 0 in rank order, replica 0 runs ONE
 * all-reduce on desc.comm of the gradient with a small tail appended (rows,
 * loss sum, failure flags: one collective carries them all), the gradient is
 * divided by the global rows -- so it is exactly the gradient of the mean
 * loss over the global batch, up to float rounding -- and shared back: each
 * local replica updates its slice, an all-gather spreads the parameters.
 * W processes x N threads equal mirrored(W*N) on the concatenated batch
 * (float tolerance) and repeat bitwise. *loss gets the global batch's loss,
 * the same on every rank. At create (and at dt_strategy_sync, which is then a
 * collective: every process calls it) the processes check that they built
 * the same model (dt_params_hash; else DTRAIN_ERR_MISMATCH on every rank
 * naming the one that differs) and rank 0 broadcasts its parameters and
 * buffers, so all start equal whatever each initialised. Buffers (batch-norm
 * statistics) follow rank 0's replica 0 (carried by the same all-reduce).
 * shard.first and shard.global_rows are relative to the local batch. The
 * params' grad buffer gets the reduced gradient of the global batch (after
 * clipping). Failures: a communicator error (a lost or stalled rank) ends the
 * step on every local replica with the communicator's message (it names the
 * lost rank, the operation and its sequence number) and changes no
 * parameter; a local failure on one rank (NaN loss, a failing op) fails the
 * step on every rank: that rank reports its own error, the others
 * DTRAIN_ERR_PEER "rank k failed its part of step s". Every process must call
 * dt_strategy_step the same number of times.
 *
 * Async update rule. Each replica pulls the parameters into its own copy
 * (no lock; a version number says how fresh), runs forward/backward, and
 * pushes the difference its own optimizer step makes (new - pulled; its own
 * optimizer state, a clone of the given optimizer) into the store. The push
 * makes that difference block by block and adds each block at once (no
 * full-length copy; the next pull is copied by the same sweep when no other
 * push finished meanwhile); the floats are those of the step made whole. The
 * default push, DTRAIN_ASYNC_HOGWILD, is Hogwild's unsynchronised
 * per-element update: each element read and written whole, in no order, no
 * lock, no read-modify-write instruction; two replicas writing the same
 * element at the same instant may lose one of the two additions -- rare
 * (each replica starts its sweep at its own place in the vector) and
 * harmless for SGD, as the Hogwild paper shows. Pull and push are vector
 * loops on x86-64 and AArch64 (each aligned element of a vector access is
 * one untorn access there, as a relaxed atomic one is) and relaxed C11
 * atomic loops elsewhere, under DTRAIN_NO_SIMD and under ThreadSanitizer.
 * DTRAIN_ASYNC_ATOMIC adds with a compare-and-swap loop per element: no
 * update is ever lost, at several times the cost of the push.
 *
 * Staleness. max_staleness k is bounded staleness (SSP) on step clocks: a
 * replica starts (pulls for) its step t only after every replica finished
 * step t-k-1, and pushes step t only after every replica started step t-k;
 * so a replica is never more than k steps ahead of the slowest one, and the
 * parameters it computes on miss at most (N-1)(2k+1) updates. k = 0 is
 * lock-step: every replica reads the same parameters in a round, and the
 * pushes are applied in replica order, so async(N, 0) is deterministic and
 * equals a synchronous step with DTRAIN_LOSS_SUM. DTRAIN_STALENESS_UNBOUNDED
 * (-1) is fully asynchronous. The staleness recorded for each push (the
 * histogram in dt_strategy_stats) is the number of updates other replicas
 * pushed between its pull and its push.
 *
 * Failures. An error in one replica (a failing op, a non-finite loss or
 * gradient (see Non-finite steps), with check_numerics also a NaN/Inf
 * update) stops the step on every
 * replica: the barrier or the store is broken, the others return at once
 * with DTRAIN_ERR_ABORTED, and dt_strategy_step/run returns the failing
 * replica's code with a message naming it ("replica 2: dt_matmul: ...").
 * Nothing is left waiting. A failed synchronous step changes no parameter
 * (the check happens before any update; batch-norm statistics excepted);
 * dt_strategy_stats.failed_replica and each dt_replica_stats.result say who
 * failed and who was aborted. The strategy stays usable.
 *
 * Non-finite steps. Every step checks its loss (one float per replica) and,
 * on the CPU, its gradient before any update: synchronous kinds scan each
 * replica's slice of the reduced gradient (one pass over the trainable
 * elements, then a barrier, so that nobody updates before everybody
 * checked; with clip_norm the global norm is that check; in process,
 * mirrored checks every element as the reduce-scatter sums it and its
 * closing barrier tells everybody, and only a step with a non-finite
 * element scans again, the trainable ones), the async family
 * each replica's own gradient before its optimizer step or push. On
 * devices the gradient is checked only when asked (check_numerics or
 * clip_norm: a host copy). By default such a step fails with
 * DTRAIN_ERR_NONFINITE and a message naming the replica, the step and what
 * ("replica 1: step 41: loss is NaN; no update made") and changes no
 * parameter. With desc.skip_nonfinite it is skipped instead: the call
 * returns DTRAIN_OK, no parameter and no optimizer state changes (batch-norm
 * statistics excepted), *loss gets NaN, dt_strategy_run leaves it out of
 * the mean, and stats.skipped_steps counts it; in the async family only the
 * failing replica's push is left empty (the clock moves), the others go
 * on. multi_worker_mirrored: every process must set the same value; a rank
 * whose step was not finite makes every rank skip it.
 *
 * Backup workers. mirrored with desc.backup_workers = B > 0 (Chen et al.,
 * 2016, "Revisiting distributed synchronous SGD"), in dt_strategy_run only
 * (dt_strategy_step refuses: one call cannot return before its slowest
 * replica): the replicas run free against the params' buffer. Each step
 * updates it with the first N-B replica gradients to arrive, averaged over
 * their rows (LOSS_SUM: summed) in rank order; a gradient that arrives after
 * its step closed is dropped (dt_replica_stats.dropped) and its replica goes
 * on with the step then open. So a straggler no longer sets the pace; the
 * price is N-B shards' rows per step instead of N (stats.samples counts the
 * rows that were aggregated). Batches come as async's do: next(user, r,
 * ticket) on replica r's thread, tickets handed out in the order replicas
 * start (so each replica's batch is the per-replica one: batch / (N-B)
 * rows keeps a step at the global batch, as Chen et al.'s N+b workers);
 * the ticket of a dropped gradient is handed out again, to another replica,
 * so its rows are trained on later (the function must return the same rows
 * for the same ticket), except at the end of the run.
 * A non-finite loss or gradient of one replica fails the run, or with
 * skip_nonfinite stays out of its step; a non-finite average is the step's.
 *
 * Empty batches. A step on a batch of 0 rows is refused (DTRAIN_ERR_EMPTY,
 * nothing touched): there is no gradient, and the optimizer would still
 * move the parameters (momentum, weight decay). multi_worker_mirrored
 * refuses only when the global batch is empty (a rank's local batch may be
 * empty). An async batch function may return 0 rows: that replica's push is
 * empty, nothing is updated.
 *
 * Cache hand-off (mirrored on the CPU, x86-64; DTRAIN_CACHE_HANDOFF=1). On
 * some hosts a core's write to a cache line that another core holds shared
 * costs several times a write to one the other core modified (a Zen 5 whose
 * two vCPUs sit on different L3s: 88-108 us against 18 us for 512 KiB), and
 * a mirrored step does that twice: each replica updates its slice of
 * parameters the others read in their forward, and rewrites in backward the
 * gradient lines another replica read in the reduce-scatter. With the
 * hand-off, each replica writes its slice of the parameters out of every
 * cache (clflushopt) before its update, and with two replicas the
 * reduce-scatter also writes each slice of the sum into the other replica's
 * gradient buffer (scratch there), so those lines go back modified. The
 * values are the same either way. Off unless asked: where cores share their
 * caches it costs a trip to memory per step. `make bench`'s bench_strategy
 * prints both ways; dt_strategy_stats.cache_handoff says which ran.
 *
 * Threads: the pool of N-1 worker threads is created with the strategy and
 * lives until it is destroyed (the calling thread is replica 0); no thread
 * is created per step. Who touches what:
 *
 * | object                      | touched by                                                        |
 * |-----------------------------|-------------------------------------------------------------------|
 * | dt_strategy                 | one calling thread at a time (step, run, stats, sync, destroy)     |
 * | the step function           | replica r's thread, concurrently for different r; `user` must be   |
 * |                             | read-only or per-replica                                           |
 * | the batch function (run)    | sync: the calling thread; async: replica r's thread, concurrently  |
 * | replica r's graph           | replica r's thread during a step; the caller between steps         |
 * | the params and optimizer    | the strategy during step/run; the caller between them              |
 * | params data during async    | read and written by every replica with atomic accesses             |
 *
 * Without threads (DTRAIN_NO_THREADS) only one_device works; the other
 * strategies return DTRAIN_ERR_UNSUPPORTED from dt_strategy_create.
 *
 * Devices (GPUs). desc.devices / desc.ndevices put the replicas on devices,
 * one replica per device (dt_device.h; dtrain_cuda.h makes CUDA ones):
 *
 *   dt_device *gpu[2] = {dt_cuda_device_create(0), dt_cuda_device_create(1)};
 *   dt_strategy_options sd = dt_strategy_mirrored(0);   the replica count follows the devices
 *   sd.devices = gpu; sd.ndevices = 2;      the one-line switch (one_device: 1 device)
 *
 * The step function is unchanged: replica r's graph is created with
 * dt_graph_options.device = devices[r], so dt_tensor_from() copies its shard of
 * the host batch to that device and the ops run there (the ops a device
 * lacks fail the step with DTRAIN_ERR_UNSUPPORTED; dt_tensor_wrap takes
 * device pointers there, so wrap host data only on the CPU). A step: every
 * replica zeroes its device gradient and runs forward/backward on its shard
 * (the same loss weights as on the CPU: MEAN rows/B, SUM 1); the gradients
 * are all-reduced ON THE DEVICES (dt_device_group in dt_device.h: NCCL
 * where the backend has it, else a ring over peer copies; afterwards every
 * replica's dt_graph_param_grad holds the reduced gradient); replica 0
 * checks it on a host copy when asked (check_numerics: NaN/Inf; clip_norm:
 * a finite norm), so a bad gradient stops the step before any update; then
 * device 0 alone updates with dt_optim_step_graph and the optimizer given
 * to dt_strategy_create (clipping the reduced gradient; the optimizer state
 * lives on device 0 only) and broadcasts its parameters (buffers included:
 * batch-norm statistics follow replica 0) to the other devices (ncclBroadcast
 * with NCCL, else peer copies). Why not
 * every device updating its own copy: one optimizer state instead of N, and
 * the replicas can never drift apart (see Failures); the price is one
 * broadcast of the parameters per step. Last, replica 0's parameters are
 * copied to the params' data buffer (one device -> host copy per step), so
 * dt_save / evaluation on the host see the trained values as with the CPU
 * strategies; the params' grad buffer is NOT written with devices.
 * mirrored(N) on N devices equals CPU mirrored(N) and one_device on the
 * whole batch within float tolerance (the all-reduce sums in ring order),
 * and repeats bitwise; one_device with one device is the same code without
 * the all-reduce.
 * Failures: as on the CPU ("replica 1: dt_relu: device cuda:1: ..."; a
 * failing all-reduce, update or broadcast is reported by replica 0 and
 * names the device); stats.failed_replica says who. A failed step leaves
 * the params' values intact, and when it failed in the update or the
 * broadcast the strategy uploads them to every device again, so the
 * replicas stay equal; the optimizer's state and step count on device 0
 * may then keep that step (as a failing dt_optim_step_graph would).
 * multi_worker_mirrored with devices: each process's replicas run on its
 * devices; the local gradients are all-reduced on the devices, replica 0's
 * copy comes to the host (device -> host), joins the cross-process
 * all-reduce on desc.comm as above, and goes back to device 0 (host ->
 * device), which updates and broadcasts to the other local devices as in
 * mirrored; W processes x N devices equal CPU mirrored(W*N) within float
 * tolerance (every process's device 0 updates; the processes stay equal as
 * on the CPU: same sum, same update).
 * dt_strategy_sync uploads the params' values to every device (mwm: rank
 * 0's, as above). central_storage, async and parameter_server keep their
 * parameters in host memory and refuse devices (DTRAIN_ERR_UNSUPPORTED at
 * dt_strategy_create).
 */
#ifndef DTRAIN_STRATEGY_H
#define DTRAIN_STRATEGY_H

#include "dt_optim.h"
#include "dt_comm.h"

DTRAIN_EXTERN_C_BEGIN

#define DTRAIN_MAX_REPLICAS 64
#define DTRAIN_STALENESS_UNBOUNDED (-1)
#define DTRAIN_STALENESS_BINS 64

/* Gradients compressed on the wire (multi_worker_mirrored). Every kind keeps
 * the workers' replicas bitwise equal (all decode the same bytes).
 *   fp16, bf16: 16-bit values (fp16 with a power-of-two scale per message so
 *     small gradients keep their digits; bf16 float's range with 8 bits of
 *     mantissa): half the bytes of a float ring all-reduce; sums made in float
 *     and rounded once.
 *   topk (fraction F in (0, 1]): each worker sends only its ceil(F x values)
 *     largest gradient values (index and value, 8 bytes each); what it did not
 *     send is kept and added to its next gradient (error feedback), so nothing
 *     is lost, only delayed. Bytes per step: (W-1) x 8 x F x values.
 *   powersgd (rank R >= 1): each weight of shape [rows, ...] (a rows x cols
 *     matrix) travels as two factors, P (rows x R) and Q (cols x R), from one
 *     step of subspace iteration warm-started with the last step's Q (Vogels
 *     et al., 2019), with error feedback as topk. Vectors, and matrices whose
 *     factors would be no smaller, go as floats. R >= min(rows, cols) is exact
 *     up to rounding.
 * The error feedback state lives in the strategy (n floats per process, twice
 * for the step being made); dt_strategy_sync and a failed step leave nothing
 * of it behind. */
typedef enum dt_compress_kind {
  DTRAIN_COMPRESS_NONE = 0,
  DTRAIN_COMPRESS_FP16 = 1,
  DTRAIN_COMPRESS_BF16 = 2,
  DTRAIN_COMPRESS_TOPK = 3,
  DTRAIN_COMPRESS_POWERSGD = 4
} dt_compress_kind;
typedef struct dt_compress {
  dt_compress_kind kind; /* [none] */
  float fraction;        /* topk: the fraction F of the values each worker sends, (0, 1] */
  int rank;              /* powersgd: the factors' rank R, 1..1024 */
} dt_compress;
/* "none", "fp16", "bf16", "topk:F" (F in (0, 1], e.g. topk:0.01) or
 * "powersgd:R" (R in 1..1024) -- the examples' --compress -- into *out; else
 * DTRAIN_ERR_INVALID_ARG naming the text. */
DTRAIN_API dt_result dt_compress_parse(const char *text, dt_compress *out);
/* The kind's name: "none", "fp16", "bf16", "topk", "powersgd". */
DTRAIN_API const char *dt_compress_name(dt_compress c);
/* The whole spec as dt_compress_parse reads it ("topk:0.01", "powersgd:4",
 * "fp16") into out (cap bytes, always terminated); returns out (NULL, with
 * dt_last_error set, for a NULL out or cap 0). */
DTRAIN_API char *dt_compress_format(dt_compress c, char *out, size_t cap);

typedef enum dt_strategy_kind {
  DTRAIN_STRATEGY_ONE_DEVICE = 0,
  DTRAIN_STRATEGY_MIRRORED,
  DTRAIN_STRATEGY_CENTRAL_STORAGE,
  DTRAIN_STRATEGY_ASYNC,
  DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED, /* lock-step across processes (dt_net.h); desc.comm */
  DTRAIN_STRATEGY_PARAMETER_SERVER       /* async against server processes (dt_net.h); desc.store */
} dt_strategy_kind;

typedef enum dt_loss_reduction {
  DTRAIN_LOSS_MEAN = 0, /* the step returns the mean over its shard (default) */
  DTRAIN_LOSS_SUM       /* the step returns the sum over its shard */
} dt_loss_reduction;

typedef enum dt_async_update {
  DTRAIN_ASYNC_HOGWILD = 0, /* an untorn load + store per element, no lock (default) */
  DTRAIN_ASYNC_ATOMIC       /* compare-and-swap add per element: no lost update */
} dt_async_update;

/* A batch (or a shard of one): arrays with `rows` rows, row-major. The
 * strategy never copies the data; shards point into the global batch. */
typedef struct dt_minibatch {
  int64_t rows;          /* samples */
  const float *x;        /* rows * x_cols inputs (may be NULL) */
  int64_t x_cols;
  const int32_t *y;      /* rows * y_cols integer labels (may be NULL) */
  int64_t y_cols;        /* 0 means 1 */
  const float *t;        /* rows * t_cols float targets (may be NULL) */
  int64_t t_cols;
  void *user;            /* passed unchanged to every shard */
  /* Filled by the strategy in what the step function receives: */
  int64_t step;          /* the batch's number: sync, the global step; async, a ticket unique across replicas */
  int64_t replica_step;  /* steps this replica made before this one in the current call */
  int64_t first;         /* the shard's first row in the global batch */
  int64_t global_rows;   /* rows of the global batch */
  float weight;          /* factor applied to this shard's loss gradient */
} dt_minibatch;

/* Builds replica `replica`'s loss on graph g (bound to that replica's
 * parameters: use dt_param(g, i) / the dt_nn_* layers) for its shard and
 * returns it (one element), or NULL after a failed op (the graph's error is
 * reported). Called concurrently from the replicas' threads. */
typedef dt_tensor *(*dt_step_fn)(dt_graph *g, int replica, const dt_minibatch *shard, void *user);

/* Fills *out with batch number `step` for dt_strategy_run: replica -1 asks
 * for the global batch of a synchronous step (called on the calling
 * thread); replica r >= 0 for async replica r's own batch (called on that
 * replica's thread, concurrently with other replicas). The data must stay
 * valid until the step is done (the next call for the same replica). Return
 * DTRAIN_OK or an error code, which stops the run. */
typedef dt_result (*dt_minibatch_fn)(void *user, int replica, int64_t step, dt_minibatch *out);

typedef struct dt_pstore dt_pstore; /* the parameter store (below) */

/* Zero fields take the defaults in brackets. */
typedef struct dt_strategy_options {
  dt_strategy_kind kind;         /* [one_device] */
  int replicas;                  /* N [one_device: 1; others: the number of CPUs] */
  int max_staleness;             /* async: 0 lock-step, k > 0 bounded, DTRAIN_STALENESS_UNBOUNDED */
  dt_async_update async_update;  /* async: [HOGWILD] */
  dt_loss_reduction loss;        /* [MEAN] */
  int check_numerics;            /* nonzero: every op checks for NaN/Inf, and so do the reduced
                                    gradients (sync) and the pushed updates (async) */
  size_t arena_bytes;            /* first arena block of each replica's graph [1 MiB] */
  uint64_t seed;                 /* replica r's graph RNG (dropout) gets seed + r [1] */
  int spin_us;                   /* waiting threads spin this long before sleeping
                                    [50 when N <= CPUs, else 0.5]; < 0: never spin */
  int straggler;                 /* for experiments: this replica ... */
  float straggler_factor;        /* ... runs this many times slower (> 1: after computing it
                                    sleeps factor-1 times its compute time) [off] */
  dt_comm *comm;                 /* multi_worker_mirrored: the cross-process communicator, one
                                    rank per process (dt_comm_create_tcp/_mpi); borrowed */
  dt_pstore *store;              /* parameter_server: the store (dt_pstore_create_tcp); borrowed */
  int staleness_lr;              /* async: nonzero scales each update by 1/(1+staleness): the
                                    learning rate of a push computed on parameters that s others
                                    have updated since is divided by 1+s (Zhang et al., 2016,
                                    "Staleness-aware async-SGD"). parameter_server: set it on the
                                    servers (dt_ps_options.staleness_lr), which apply the updates */
  dt_device **devices;           /* one_device, mirrored, multi_worker_mirrored: replica r runs on
                                    devices[r] (dt_device.h, e.g. dt_cuda_device_create(r)); the
                                    array and the devices are borrowed [NULL: the CPU] */
  int ndevices;                  /* entries in devices; replicas 0 means ndevices, else it must
                                    equal ndevices (one replica per device) */
  int skip_nonfinite;            /* a step whose loss or gradient is NaN/Inf: 0 fails it with
                                    DTRAIN_ERR_NONFINITE naming the step; nonzero skips it (no
                                    update, stats.skipped_steps; see "Non-finite steps") [0] */
  int work_queue;                /* parameter_server, dt_strategy_run: nonzero takes each step's work
                                    item from the servers' queue (dt_pstore_take) and passes it to
                                    the batch function as the ticket; the run ends early (DTRAIN_OK)
                                    when the queue is done. Needs max_staleness
                                    DTRAIN_STALENESS_UNBOUNDED. 0: tickets 0, 1, ... [0] */
  dt_compress compress;          /* multi_worker_mirrored: the gradients' form on the wire (above),
                                    sent as point-to-point messages of tag DT_COMM_TAG_MAX on the
                                    communicator [none: the float all-reduce]; parameter_server:
                                    the pushes' form, pulls as 16-bit differences (dt_net.h,
                                    "Compressed pushes and pulls") [none: floats both ways] */
  int backup_workers;            /* mirrored, dt_strategy_run: B in [0, replicas). B > 0: each step
                                    updates with the first N-B replica gradients to arrive, averaged
                                    over their rows, and drops the later ones (Chen et al., 2016;
                                    see "Backup workers") [0] */
  int overlap;                   /* mirrored and multi_worker_mirrored (any replicas, compress none,
                                    fp16 or bf16, not on devices, no backup workers): nonzero sums the gradient in
                                    buckets as backward makes them, while it computes the earlier
                                    layers: across processes a thread all-reduces each bucket; in
                                    one process a replica that finished its backward sums the
                                    buckets the others completed (bitwise the same result; see
                                    "Overlapping communication"). parameter_server (max_staleness
                                    not 0; needs threads): in dt_strategy_run a second thread
                                    pushes step t's gradient and pulls the weights for t + 1 while
                                    step t + 1 computes on the weights of the pull before, so each
                                    step lacks this worker's last update (one clock more staleness,
                                    which the push reports); dt_strategy_step is not overlapped
                                    (nothing to overlap a single step with) [0] */
  size_t bucket_bytes;           /* overlap: bytes of gradient per bucket, cut at parameter
                                    boundaries from the last layer down [0: 2 MiB].
                                    multi_worker_mirrored with compress fp16/bf16 and no overlap:
                                    nonzero runs the 16-bit ring per bucket of this size, one after
                                    the other, which overlap does during backward: the same bits
                                    with and without overlap at the same size [0: one ring]; push_early:
                                    the parts' size [0: 2 MiB] */
  int push_early;                /* parameter_server over TCP (dt_pstore_create_tcp; needs threads; not
                                    with overlap, compress or the optimizer's clip_norm): nonzero
                                    sends each step's push in parts while backward goes on: a thread
                                    sends a server its parameters' part once their gradients are
                                    final and about bucket_bytes of them wait (from the last layer
                                    down); the push then sends only the rest. The servers apply
                                    nothing before the push is whole, so the result is bitwise the
                                    plain push's, with no more staleness (unlike overlap); a step
                                    skipped for a non-finite gradient discards the parts (see
                                    "Pushed early to the servers") [0] */
  int async_in_place;            /* async: nonzero: the replicas compute on the store itself, as
                                    Hogwild's threads do, instead of each on its own copy pulled as
                                    its step starts: no copy of the parameters per replica, nor
                                    (without check_numerics) a vector of old values, nothing copied
                                    per step; each replica's optimizer steps the store's values in
                                    place (with the Hogwild rule and no staleness_lr; otherwise it
                                    adds new - old), and an op may see another replica's update
                                    made during the step. Refused in
                                    lock-step (max_staleness 0) and with buffers or frozen
                                    parameters; where the store's sweeps are not vector loops
                                    (ThreadSanitizer, DTRAIN_NO_SIMD, CPUs other than x86-64 and
                                    AArch64) the copies are kept, with a warning. Slower than the
                                    copies where the cores hand cache lines over slowly (a VM's
                                    vCPUs on two core complexes; see "Async data path") [0] */
  int async_sharded;             /* async: nonzero: each replica owns a slice of the parameters
                                    (replica r the store's 2048-float blocks [r B / N, (r+1) B / N)
                                    of B) and is the only one to update it: a step hands the other
                                    slices of its gradient to their owners (a pair of buffers per
                                    replica pair, no lock, no wait) and applies its optimizer to its
                                    own slice once, with the mean of its gradient and every gradient
                                    handed to it since its last step (as a mirrored step averages
                                    its replicas'). Each gradient is applied exactly once (no update
                                    lost, under either async_update rule), and the optimizer runs
                                    over 1/N of the parameters a step instead of all of them. What
                                    is still in the buffers when a run or step ends is applied by
                                    its owner then. A slow replica's slice is updated at its pace,
                                    with the mean of more gradients a step; bound the staleness
                                    (max_staleness) to keep the owners in step. Refused in
                                    lock-step (max_staleness 0), with buffers or frozen
                                    parameters, with check_numerics, and for other kinds; combines
                                    with async_in_place (see "Async with owners") [0] */
} dt_strategy_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_strategy_options dt_strategy_desc;

/* The one-line choices: dt_strategy_<kind>() gives the options of that kind
 * with every other field at its default (as dt_init_<kind>() for dt_init). */
DTRAIN_API dt_strategy_options dt_strategy_one_device(void);
DTRAIN_API dt_strategy_options dt_strategy_mirrored(int replicas);
DTRAIN_API dt_strategy_options dt_strategy_central_storage(int replicas);
DTRAIN_API dt_strategy_options dt_strategy_async(int replicas, int max_staleness);
/* Across processes: comm has one rank per process (borrowed), `replicas`
 * threads in each (0: the number of CPUs). A NULL comm (or store, below) is
 * kept in the options and refused by dt_strategy_create. */
DTRAIN_API dt_strategy_options dt_strategy_multi_worker_mirrored(dt_comm *comm, int replicas);
/* Parameter-server training (dt_net.h): the store from dt_pstore_create_tcp
 * (borrowed: destroy it after the strategy; call dt_pstore_leave when this
 * worker is done). One replica per process; max_staleness is the store's
 * (the argument is ignored in favour of it). The optimizer given to
 * dt_strategy_create only lends its clip_norm (gradients are clipped before
 * the push); the servers run theirs. After a step the params' data holds
 * the parameters this step pulled (the last push is applied on the servers;
 * pull again to see it). */
DTRAIN_API dt_strategy_options dt_strategy_parameter_server(dt_pstore *store, int max_staleness);
/* Deprecated: the old names, removed in the next release. */
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_one_device") dt_strategy_options dt_one_device(void);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_mirrored") dt_strategy_options dt_mirrored(int replicas);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_central_storage")
dt_strategy_options dt_central_storage(int replicas);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_async")
dt_strategy_options dt_async(int replicas, int max_staleness);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_multi_worker_mirrored")
dt_strategy_options dt_multi_worker_mirrored(dt_comm *comm, int replicas);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_parameter_server")
dt_strategy_options dt_parameter_server(dt_pstore *store, int max_staleness);
/* From a name ("one_device", "mirrored", "central_storage", "async",
 * "multi_worker_mirrored", "parameter_server"), e.g. for a --strategy flag;
 * set desc.comm / desc.store yourself for the last two.
 * DTRAIN_ERR_INVALID_ARG for an unknown name. */
DTRAIN_API dt_result dt_strategy_parse(const char *name, int replicas, int max_staleness, dt_strategy_options *out);
DTRAIN_API const char *dt_strategy_kind_name(dt_strategy_kind kind);

typedef struct dt_strategy dt_strategy;

/* Create a strategy training `params` with `opt` (created on params) by
 * calling `step(g, replica, shard, user)`. desc NULL means one_device. The
 * params must not gain parameters afterwards. The strategy borrows params,
 * opt and user (they must outlive it) and owns its graphs, replica buffers
 * and threads. After creation the replicas hold the params' current values;
 * if you change them yourself later (loading a checkpoint), call
 * dt_strategy_sync(). NULL on failure (dt_last_error()). */
DTRAIN_API dt_strategy *dt_strategy_create(dt_params *params, dt_optim *opt, dt_step_fn step, void *user,
                                           const dt_strategy_options *desc);
/* Joins the threads and frees everything the strategy owns; NULL is a no-op. */
DTRAIN_API void dt_strategy_destroy(dt_strategy *s);

/* One step on a global batch: split into shards, forward/backward on every
 * replica, reduce, update. For async: one round -- replica r takes shard r
 * and makes one step of its own against the store. *loss (may be NULL) gets
 * the loss of the whole batch (MEAN: the rows-weighted mean of the shard
 * losses; SUM: their sum; NaN for a skipped step). Returns DTRAIN_OK or the
 * first failing replica's error (see Failures); a batch of 0 rows is
 * refused with DTRAIN_ERR_EMPTY and touches nothing; a non-finite loss or
 * gradient fails the step with DTRAIN_ERR_NONFINITE, or skips it with
 * desc.skip_nonfinite (see Non-finite steps). */
DTRAIN_API dt_result dt_strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss);

/* `steps` steps with batches from next(). Sync: `steps` global steps, each on
 * next(user, -1, step) (multi_worker_mirrored: this process's local batch).
 * Async: steps * N pushes in all, the replicas running free (with
 * max_staleness 0 exactly `steps` each); replica r gets its
 * batches from next(user, r, ticket). *mean_loss (may be NULL) gets the mean
 * loss over the steps (async: over the pushes). */
DTRAIN_API dt_result dt_strategy_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                     float *mean_loss);

/* Copy the params' current values into every replica's copy (mirrored).
 * multi_worker_mirrored: a collective (every process calls it): rank 0's
 * values go to every process and replica. */
DTRAIN_API dt_result dt_strategy_sync(dt_strategy *s);

/* 0 for a NULL s; the getters below return NULL for it, with dt_last_error() set. */
DTRAIN_API int dt_strategy_replicas(const dt_strategy *s);
DTRAIN_API const dt_strategy_options *dt_strategy_get_options(const dt_strategy *s);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_strategy_get_options")
const dt_strategy_options *dt_strategy_get_desc(const dt_strategy *s);
/* Replica r's graph (for inspection between steps: memory, RNG state). */
DTRAIN_API dt_graph *dt_strategy_graph(dt_strategy *s, int replica);

/* The device of replica r (NULL: the CPU, or r out of range). */
DTRAIN_API dt_device *dt_strategy_device(const dt_strategy *s, int replica);

/* ---- statistics (since creation or dt_strategy_reset_stats) ---------------------- */
typedef struct dt_replica_stats {
  int64_t steps;          /* steps completed (async: pushes) */
  int64_t samples;        /* rows processed */
  double compute_s;       /* forward + backward (+ straggler sleep) */
  double wait_s;          /* waiting for the others: barriers among a process's replicas (sync), the
                             staleness bound (async); not the time inside communication (comm_s) */
  double comm_s;          /* communication: multi_worker_mirrored's cross-process all-reduce (the wait
                             there for the slowest worker included: a collective cannot tell them
                             apart; before 2026-11-29 this was counted in wait_s), the pulls and
                             pushes of async and parameter_server (without the staleness bound's
                             wait; in one process the push also makes the replica's optimizer
                             step, block by block), and with parameter_server overlap the time a
                             step waits for the previous push and pull to finish */
  int64_t staleness_max;  /* async: most updates pushed by others between a pull and its push */
  double staleness_mean;
  int64_t clock_gap_max;  /* async: most steps this replica was ahead of the slowest at a pull */
  dt_result result;       /* of the last call: DTRAIN_OK, its own error, or DTRAIN_ERR_ABORTED */
  int64_t dropped;        /* backup workers: gradients that came after their step had its N-B
                             (steps counts the ones that joined) */
} dt_replica_stats;

typedef struct dt_strategy_stats {
  dt_strategy_kind kind;
  int replicas;
  int64_t steps;          /* sync: global steps; async: pushes by all replicas */
  int64_t samples;        /* rows processed by all replicas */
  double seconds;         /* wall time inside dt_strategy_step/run */
  double steps_per_s, samples_per_s;
  double wait_s_mean;     /* mean over replicas of dt_replica_stats.wait_s */
  double wait_s_max;
  double compute_s_mean;  /* mean over replicas of dt_replica_stats.compute_s */
  double comm_s_mean;     /* ... of dt_replica_stats.comm_s */
  float last_loss;        /* sync: the last step's loss; async: the last push's */
  double mean_loss;       /* mean over the steps (async: pushes) */
  int64_t staleness_hist[DTRAIN_STALENESS_BINS]; /* async: pushes by staleness; the last bin is ">=" */
  int64_t staleness_max;
  double staleness_mean;
  int64_t clock_gap_max;
  int failed_replica;     /* -1, or the replica whose error ended the last call */
  int64_t skipped_steps;  /* steps skipped for a non-finite loss or gradient (skip_nonfinite;
                             sync: also counted in steps; async: pushes left empty) */
  int64_t dropped_grads;  /* backup workers: replica gradients dropped as late, in all */
  uint64_t wire_bytes;    /* multi_worker_mirrored: bytes this process sent to the others for the
                             steps (gradients and their bookkeeping, as handed to the
                             communicator; frame headers not counted); parameter_server: the
                             bytes of this worker's pushes and pull requests (the store's
                             wire_sent); 0 in one process */
  uint64_t wire_bytes_received; /* the bytes received for the steps: multi_worker_mirrored's
                             collectives are symmetric (= wire_bytes); parameter_server: the
                             pulled parameters and the servers' answers */
  int cache_handoff;      /* mirrored on the CPU: 1 when the replicas hand their slices' cache
                             lines over (DTRAIN_CACHE_HANDOFF=1; see "Cache hand-off" above) */
} dt_strategy_stats;

DTRAIN_API dt_result dt_strategy_stats_get(const dt_strategy *s, dt_strategy_stats *out);
DTRAIN_API dt_result dt_strategy_replica_stats(const dt_strategy *s, int replica, dt_replica_stats *out);
DTRAIN_API void dt_strategy_reset_stats(dt_strategy *s); /* NULL: does nothing */

/* ---- the parameter store -----------------------------------------------------------
 * What async replicas (workers) train against: pull the parameters, push an
 * update, each with a step clock that enforces the staleness bound (see
 * Staleness above). The in-process backend is lock-free; a networked one
 * (parameter-server shards) implements the same table.
 *
 *   for (t = 0; ; t++) {
 *     dt_pstore_pull(ps, w, t, mine, n, &tk);     // may wait for the bound
 *     ... compute delta ...
 *     dt_pstore_push(ps, w, t, delta, n, &tk);    // may wait; records tk.staleness
 *   }
 *   dt_pstore_leave(ps, w);                        // done: nobody waits for w any more
 *
 * With max_staleness 0 every worker must make the same number of steps.
 * dt_pstore_begin() starts a new run (clocks back to 0) when no worker is
 * inside; dt_pstore_abort() makes every waiting and later call return
 * DTRAIN_ERR_ABORTED until dt_pstore_begin(). */
typedef struct dt_pstore_ticket {
  uint64_t version;    /* pull: updates applied when the copy began (push reads it) */
  int64_t staleness;   /* push: updates pushed by others since the pull */
  int64_t clock_gap;   /* pull: steps this worker was ahead of the slowest */
  double wait_s;       /* seconds this call waited for the bound */
  int dropped;         /* push: a server dropped it as late, its round closed without it
                          (dt_ps_options.aggregate; staleness says how late; with several
                          servers, another may have held it) */
} dt_pstore_ticket;

typedef struct dt_pstore_vtable {
  const char *name;
  dt_result (*pull)(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n, dt_pstore_ticket *tk);
  /* delta NULL: an empty push that only advances the clock */
  dt_result (*push)(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n, dt_pstore_ticket *tk);
  void (*leave)(dt_pstore *ps, int worker);
  void (*abort)(dt_pstore *ps);
  dt_result (*begin)(dt_pstore *ps);
  uint64_t (*version)(dt_pstore *ps);
  void (*destroy)(dt_pstore *ps);
  /* Optional (NULL: no work queue): the next work item for worker, see dt_pstore_take. */
  dt_result (*take)(dt_pstore *ps, int worker, int64_t *item);
} dt_pstore_vtable;

struct dt_pstore {
  const dt_pstore_vtable *vtable;
  int workers;
  int max_staleness;
  size_t size;   /* floats in the store */
  int gradients; /* 0: push takes parameter deltas (the worker ran the optimizer);
                    1: push takes gradients and the store applies the optimizer */
  int staleness_lr; /* local stores: nonzero scales each pushed delta by 1/(1+s), s the
                       updates pushed by others since the pusher's pull (a staleness-aware
                       learning rate); set by the async strategy's option [0] */
  int64_t start_clock; /* tcp: the clock the first dt_pstore_begin continues from: 0 on a first
                          join, the slowest live worker's (or its own) when it rejoined [local: 0] */
  int64_t steps_done;  /* tcp: pushes this worker's rank made before it rejoined, as the servers
                          remember them (resume the schedule there) [first join, local: 0] */
  uint64_t wire_sent, wire_received; /* tcp: payload bytes of this worker's pulls and pushes sent
                          to / received from the servers, frame headers not counted (stats;
                          dt_strategy_stats reads them) [local: 0] */
  dt_compress compress; /* tcp: the form of pushes and pulls on the wire (set by the parameter_server
                          strategy from dt_strategy_options.compress; see "Compressed pushes and
                          pulls" in dt_net.h); takes effect at the next call [none: floats] */
  void *impl;
};

/* In-process store over `data` (n floats, borrowed: the params' buffer) for
 * `workers` threads. NULL on failure. */
DTRAIN_API dt_pstore *dt_pstore_create_local(float *data, size_t n, int workers, int max_staleness,
                                             dt_async_update update, int spin_us);
DTRAIN_API void dt_pstore_destroy(dt_pstore *ps);
DTRAIN_API dt_result dt_pstore_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk);
DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk);
/* leave and abort on a NULL ps do nothing (cleanup paths call them); the
 * version of a NULL ps is 0. */
DTRAIN_API void dt_pstore_leave(dt_pstore *ps, int worker);
DTRAIN_API void dt_pstore_abort(dt_pstore *ps);
DTRAIN_API dt_result dt_pstore_begin(dt_pstore *ps);
/* The store's version: in-process, the updates applied; over TCP, the
 * smallest of the servers' last words (a pull's version, a push's answer):
 * every server is at least there (in rounds, dt_ps_options.aggregate, each
 * server counts the rounds it closed). */
DTRAIN_API uint64_t dt_pstore_version(dt_pstore *ps);
/* Work queue (dynamic data sharding, as TF's ClusterCoordinator schedules
 * functions): the servers' first server hands out work items 0 .. N-1
 * (dt_ps_options.work_items; say item = epoch * batches + batch) to the
 * workers that ask, one at a time. *item gets the next one (>= 0), or -1
 * when every item is done (the job is over); the call waits while every
 * item left is held by another worker. An item is done when this worker's
 * next push reaches that server: the push and the record are one message,
 * so an item is trained on exactly once there. An item held by a worker
 * that dies (or leaves) before its push goes back to the queue, to the next
 * worker that asks. A straggler therefore takes fewer items instead of
 * setting the epoch's time. DTRAIN_ERR_UNSUPPORTED: the store has no queue
 * (an in-process store, or servers without work_items). Used by the
 * parameter_server strategy with dt_strategy_options.work_queue. The queue
 * needs unbounded staleness (servers refuse a worker with a bound): a bound
 * would hold the fast workers at the clock of the straggler the queue lets
 * fall behind. */
DTRAIN_API dt_result dt_pstore_take(dt_pstore *ps, int worker, int64_t *item);

/* ---- small utilities ------------------------------------------------------------------ */
/* Sleep for `seconds` (monotonic; restarts after signals). */
DTRAIN_API void dt_sleep(double seconds);
/* Number of online CPUs (>= 1). */
DTRAIN_API int dt_cpu_count(void);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_STRATEGY_H */
