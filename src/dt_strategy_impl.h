/* ===========================================================================
 * dt_strategy_impl.h -- private: the strategy object, the table each
 * strategy kind (module) fills, and the helpers the modules share
 * ===========================================================================
 * Every strategy kind is a module: one file (dt_strategy_<kind>.c) that
 * fills one dt__strategy_module table, returned by its getter, which is
 * listed in DT__STRATEGY_MODULES below at the place of its dt_strategy_kind.
 * dt_strategy.c is the front door: it checks the arguments, builds what
 * every kind needs (replica graphs, the thread pool, statistics) and calls
 * the table. Adding a kind is one new file (listed in src/MANIFEST) and one
 * line in that list. Everything here is DTRAIN_PRIVATE.
 *
 *   file                          what
 *   dt_strategy.c                 front door; the helpers below
 *   dt_strategy_one_device.c      one replica; central_storage's step
 *   dt_strategy_mirrored.c        reduce-scatter, slice updates, all-gather
 *   dt_strategy_central.c         reduce into the centre, slice updates
 *   dt_strategy_async.c           the async replica loop (also parameter_server's), run()
 *   dt_strategy_ps.c              parameter_server: the push of (clipped) gradients
 *   dt_strategy_mwm.c             multi_worker_mirrored: the cross-process all-reduce
 *   dt_strategy_backup.c          mirrored's backup workers: a step takes the first N-B gradients
 *   dt_strategy_device.c          replicas on devices: a mode of the kinds with
 *                                 DT__STRATEGY_DEVICES, not a kind
 */
#ifndef DTRAIN_STRATEGY_IMPL_H
#define DTRAIN_STRATEGY_IMPL_H

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
#include "dt_comm_core.h"
#include "dt_strategy.h"
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_platform.h"

typedef struct dt__strategy_replica {
  dt_graph *g;
  float *data, *grad;      /* what the graph is bound to */
  float *own_data, *own_grad, *old; /* allocated here (NULL when borrowed) */
  dt_optim *opt;           /* async: this replica's optimizer */
  int updating;            /* devices: this step reached the update */
  int push_fill;           /* async: this step's update is made during the push (dt__pstore_push_blocks) */
  /* the current step */
  int64_t clock;           /* async family: the clock its pull and push have (the job's t) */
  float loss;
  int64_t rows;
  double ss_part;          /* clipping: sum of squares of this replica's slice */
  int skipped;             /* async family, skip_nonfinite: this step's loss or gradient was not
                              finite, its push is left empty */
  dt_result result;
  /* statistics */
  int64_t steps, samples;
  double compute_s, wait_s, comm_s, loss_sum;
  int64_t loss_count;
  float last_loss;
  double last_time;        /* async: when the last push finished */
  int64_t hist[DTRAIN_STALENESS_BINS];
  int64_t stale_max, stale_sum, gap_max;
  int64_t skips;           /* steps skipped for a non-finite loss or gradient */
  int64_t dropped;         /* backup workers: gradients that came after their step closed */
  char pad[DT__ALIGN];     /* keeps the next replica's hot fields off these cache lines */
} dt__strategy_replica;

typedef struct dt__strategy_module dt__strategy_module;
typedef struct dt__backup dt__backup; /* dt_strategy_backup.c */
typedef struct dt__overlap dt__overlap; /* dt_strategy_overlap.c */

struct dt_strategy {
  dt_strategy_desc desc;
  const dt__strategy_module *mod; /* the kind's table */
  void (*job)(dt_strategy *s, int r); /* replica r's part of the current job: mod->job, or
                                         dt__strategy_dev_job on devices */
  dt_params *params;
  dt_optim *opt;
  dt_step_fn step;
  void *user;
  int n;
  size_t size;             /* floats in the flat buffers */
  size_t fbytes;           /* size * sizeof(float) */
  dt__strategy_replica *rep;
  size_t rep_bytes;
  dt__pool *pool;
  dt_comm *comm;           /* sync strategies */
  dt_pstore *pstore;       /* async */
  int own_pstore;          /* the strategy made the store (async's local one): its replicas leave it
                              after a job and destroy frees it; a borrowed one is the user's */
  void *kind_state;        /* the module's own state (its create allocates it, its destroy frees it) */
  dt__backup *backup;      /* mirrored with desc.backup_workers > 0 (dt_strategy_backup.c) */
  size_t *bufr;            /* non-trainable runs [begin, end) pairs */
  int nbufr;
  /* the current job */
  const dt_minibatch *batch;   /* step(): the global batch */
  dt_minibatch_fn next;        /* run(): the batch source (async) */
  void *next_user;
  int64_t job_steps;       /* async: steps per replica (lock-step) or total pushes */
  int64_t ticket_base;
  DT__ATOMIC(int64_t) ticket;
  DT__ATOMIC(int) failed;  /* -1, or the first replica that failed */
  dt_result err;
  char msg[DT__MSG_CAP];
  /* totals */
  int64_t steps, samples, tickets;
  int64_t skipped;         /* sync steps skipped for a non-finite loss or gradient */
  uint64_t wire_bytes;     /* multi_worker_mirrored: bytes sent to the other processes (stats) */
  uint64_t wire_base[2];   /* the store's wire_sent / wire_received when the stats were reset */
  dt__overlap *ov;         /* desc.overlap: gradients summed in buckets during backward; replica
                              0's numerics are scanned before its values are summed
                              (dt_strategy_overlap.c) */
  int handoff;             /* mirrored on the CPU with DTRAIN_CACHE_HANDOFF=1: each replica writes
                              the lines of its slice out of every cache before its update and
                              hands the other replica's gradient lines back modified
                              (dt__comm_reduce_scatter_finite; dt_strategy_mirrored.c) */
  double seconds, loss_sum;
  int64_t loss_count;
  float last_loss;
  int last_failed;
  /* devices (desc.devices; dt_strategy_device.c) */
  int dev;                 /* nonzero: replica r runs on desc.devices[r] */
  dt_device_group *dgroup; /* the all-reduce over the replicas' devices */
  float **dgrad, **ddata;  /* each replica's device gradient / parameters */
  float *dhost;            /* host copy of replica 0's reduced gradient (checks) */
  int64_t dev_opt_steps;   /* the optimizer's steps before the current step */
};

/* ---- the module table ------------------------------------------------------------------ */

/* Flags: what the front door needs to know about a kind, as data. */
enum {
  /* Lock-step: a step is one global step over shards of one batch, on the
   * in-process communicator s->comm (barriers, reductions). Without it the
   * kind is of the async family: replicas push to s->pstore, steps count
   * pushes, max_staleness applies. */
  DT__STRATEGY_SYNC = 1 << 0,
  /* Exactly one replica: desc.replicas 0 or 1 becomes 1 (parse and create)
   * and the kind runs on the calling thread alone, so it is the kind that
   * works without threads (DTRAIN_NO_THREADS). */
  DT__STRATEGY_ONE_REPLICA = 1 << 1,
  /* May put its replicas on devices (desc.devices): dt_strategy_device.c. */
  DT__STRATEGY_DEVICES = 1 << 2,
  /* Loss gradients are weighted by the shard's rows (row sums, MEAN) and
   * divided by the global rows only after a cross-process reduction. */
  DT__STRATEGY_ROW_SUMS = 1 << 3
};

struct dt__strategy_module {
  const char *name;        /* dt_strategy_kind_name, dt_strategy_parse */
  unsigned flags;          /* DT__STRATEGY_* */
  /* Optional. First of the checks of dt_strategy_create: settles the desc
   * fields the kind decides itself (e.g. from desc.store). */
  dt_result (*prepare)(dt_strategy_desc *d);
  /* Optional. After the common checks of the desc, before the device ones. */
  dt_result (*check)(const dt_strategy_desc *d);
  /* Optional. Before the replicas are made: the kind's own state and
   * resources (kind_state, the store). Errors recorded; destroy cleans up. */
  dt_result (*create)(dt_strategy *s);
  /* Replica r on the CPU: its buffers (dt__strategy_bind and more). Not
   * called on devices (dt__strategy_dev_bind). */
  dt_result (*replica)(dt_strategy *s, int r);
  /* Optional. The last step of dt_strategy_create (a collective for
   * multi_worker_mirrored). fn names the caller for messages. */
  dt_result (*start)(dt_strategy *s, const char *fn);
  /* Replica r's part of a step (sync) or its loop of steps (async), on its
   * own thread; failures go through dt__strategy_fail. */
  void (*job)(dt_strategy *s, int r);
  /* Optional. dt_strategy_run after the argument checks; NULL: `steps`
   * calls of dt_strategy_step on next(user, -1, step). */
  dt_result (*run)(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user, float *mean_loss);
  /* Optional. dt_strategy_sync: the params' values into every replica. */
  dt_result (*sync)(dt_strategy *s, const char *fn);
  /* Optional. The loss of the global batch after a good synchronous step;
   * NULL: the shard losses weighted by their share, in rank order. */
  double (*loss)(dt_strategy *s, const dt_minibatch *gb);
  /* Async family: replica r's own step after its pull (R->data holds the
   * pulled parameters): forward/backward on b and the vector to push in
   * *push (NULL: an empty push). 0: failed (recorded). */
  int (*local_step)(dt_strategy *s, int r, const dt_minibatch *b, const float **push);
  /* Devices: replica 0's part after the all-reduce over the devices
   * (multi_worker_mirrored: the exchange across processes). ok: the local
   * part succeeded. 1: the update goes on. NULL: only the checks of the
   * reduced gradient (dt__strategy_dev_checks on a host copy, when asked). */
  int (*dev_exchange)(dt_strategy *s, int ok);
  /* Optional. Frees what create made (after the replicas are gone). */
  void (*destroy)(dt_strategy *s);
  /* Optional. After every job (dt_strategy_run, dt_strategy_step), once all
   * replicas have returned, before a failure is reported: async_sharded's
   * owners apply the gradients still on their way to them. */
  void (*after_job)(dt_strategy *s);
};

/* The modules, in dt_strategy_kind order: X(getter) each, where the module's
 * file defines `const dt__strategy_module *getter(void)` (a function, not
 * an object: C++ has no forward declaration of a static const object). This
 * list yields both the declarations below and dt_strategy.c's table. */
#define DT__STRATEGY_MODULES(X)                                   \
  X(dt__strategy_one_device_module) /* ONE_DEVICE */              \
  X(dt__strategy_mirrored_module)   /* MIRRORED */                \
  X(dt__strategy_central_module)    /* CENTRAL_STORAGE */         \
  X(dt__strategy_async_module)      /* ASYNC */                   \
  X(dt__strategy_mwm_module)        /* MULTI_WORKER_MIRRORED */   \
  X(dt__strategy_ps_module)         /* PARAMETER_SERVER */

#define DT__STRATEGY_DECLARE(getter) DTRAIN_PRIVATE const dt__strategy_module *getter(void);
DT__STRATEGY_MODULES(DT__STRATEGY_DECLARE)
#undef DT__STRATEGY_DECLARE

#if defined(DTRAIN_NO_DIST)
/* DTRAIN_NO_DIST: every kind but one_device is compiled out. Its module
 * keeps its name and flags (dt_strategy_parse, dt_strategy_kind_name and the
 * messages still know it) and only a prepare hook, which fails: the first
 * check of dt_strategy_create says the kind is compiled out. */
DTRAIN_PRIVATE dt_result dt__strategy_compiled_out(dt_strategy_desc *d);
#  define DT__STRATEGY_COMPILED_OUT(var, name, flags)                                                   \
    static const dt__strategy_module var = {name, flags, dt__strategy_compiled_out, NULL, NULL, NULL, NULL, \
                                            NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}
#endif

/* ---- shared helpers (dt_strategy.c) ------------------------------------------------------ */

/* async_sharded (dt_strategy_async.c): the gradients applied to replica
 * r's slice so far and the updates that applied them (-1: not
 * async_sharded; tests). */
DTRAIN_PRIVATE int64_t dt__strategy_async_merged(dt_strategy *s, int r, int64_t *updates);
/* A desc with only kind, replicas and max_staleness set (the one-line choices). */
DTRAIN_PRIVATE dt_strategy_desc dt__strategy_desc(dt_strategy_kind kind, int replicas, int max_staleness);
/* Records replica r's failure; the first one wins. Breaks the barrier or the
 * store so that nobody waits for r. */
DTRAIN_PRIVATE void dt__strategy_fail(dt_strategy *s, int r, dt_result code, const char *what);
DTRAIN_PRIVATE int dt__strategy_failed(dt_strategy *s);
/* A collective or the store returned rc: aborted by someone else, or a
 * failure of replica r's own. */
DTRAIN_PRIVATE void dt__strategy_comm_failed(dt_strategy *s, int r, dt_result rc);
/* Shard r of n of the global batch gb (see "Batches" in dt_strategy.h). */
DTRAIN_PRIVATE void dt__strategy_shard(const dt_minibatch *gb, int n, int r, dt_minibatch *out);
/* Replica r's shard of s->batch for a synchronous step, with its loss
 * weight (DT__STRATEGY_ROW_SUMS: rows; else rows / global rows; SUM: 1). */
DTRAIN_PRIVATE void dt__strategy_sync_shard(dt_strategy *s, int r, dt_minibatch *b);
DTRAIN_PRIVATE dt_result dt__strategy_check_batch(const dt_minibatch *b, const char *fn);
/* Index of the first non-finite value in x[b, e), or e. */
DTRAIN_PRIVATE size_t dt__strategy_nonfinite(const float *x, size_t b, size_t e);
/* Index of the first non-finite value among the trainable elements of
 * x[b, e) (the ones an update reads), or e. */
DTRAIN_PRIVATE size_t dt__strategy_nonfinite_trainable(dt_strategy *s, const float *x, size_t b, size_t e);
/* Replica r's step met a non-finite loss or gradient (what: the message,
 * naming the step). The async family with skip_nonfinite: r skips its step
 * (R->skipped) and 1 is returned. Otherwise the step fails with
 * DTRAIN_ERR_NONFINITE (dt_strategy_step turns that into a skip for the
 * synchronous kinds with skip_nonfinite) and 0 is returned. */
DTRAIN_PRIVATE int dt__strategy_bad_step(dt_strategy *s, int r, const char *what);
DTRAIN_PRIVATE int dt__strategy_grad_bad(dt_strategy *s, int r, int64_t step, size_t bad, int nan);
/* Async family: replica r's own gradient has only finite trainable
 * elements. 1: go on; 0: failed (recorded) or skipped (R->skipped). */
DTRAIN_PRIVATE int dt__strategy_own_grad_ok(dt_strategy *s, int r, int64_t step);
/* Name of the parameter holding flat index i (for messages). */
DTRAIN_PRIVATE const char *dt__strategy_param_at(dt_strategy *s, size_t i);
/* Forward + backward of replica r on b. 0 on failure (recorded). */
DTRAIN_PRIVATE int dt__strategy_compute(dt_strategy *s, int r, const dt_minibatch *b);
/* Sum of squares of the trainable elements of grad in [b, e), in index order. */
DTRAIN_PRIVATE double dt__strategy_sumsq(dt_strategy *s, const float *grad, size_t b, size_t e);
/* grad[j] *= coef for the trainable j in [b, e). */
DTRAIN_PRIVATE void dt__strategy_scale(dt_strategy *s, float *grad, size_t b, size_t e, float coef);
/* The clipping rule: given the global L2 norm of the gradient, scales the
 * trainable elements of grad[b, e) when the norm exceeds clip. 0: the norm
 * is not finite (nothing scaled; the caller fails the step). */
DTRAIN_PRIVATE int dt__strategy_clip_scale(dt_strategy *s, float *grad, size_t b, size_t e, double norm, float clip);
/* Clipping of replica r's whole gradient R->grad with `clip` (async,
 * parameter_server); a non-finite norm fails r with "gradient norm is not
 * finite; <what_not>". 0: failed. */
DTRAIN_PRIVATE int dt__strategy_clip_own(dt_strategy *s, int r, float clip, const char *what_not);
/* Replica r's checks of its slice [lo, hi) of the reduced gradient, then
 * dt_optim_update of data on that slice (synchronous kinds). 0: the step
 * stops (the failure is recorded). */
DTRAIN_PRIVATE int dt__strategy_update_slice(dt_strategy *s, int r, float *data, float *grad, size_t lo, size_t hi,
                                             int finite);
/* Copies the non-trainable runs (buffers) of src within [b, e) to dst. */
DTRAIN_PRIVATE void dt__strategy_copy_buffers(dt_strategy *s, float *dst, const float *src, size_t b, size_t e);
/* Seconds replica r has waited in s->comm so far. */
DTRAIN_PRIVATE double dt__strategy_comm_wait(dt_strategy *s, int r);
/* size floats (at least one), a copy of init or zeros; NULL when out of memory. */
DTRAIN_PRIVATE float *dt__strategy_floats(dt_strategy *s, const float *init);
/* dt_strategy_create's out-of-memory error. */
DTRAIN_PRIVATE dt_result dt__strategy_nomem(dt_strategy *s);
/* Replica r's host buffers: private copies of the params' data / a private
 * gradient when asked (else the params' own), grad0 (if not NULL) as its
 * gradient, bound to its graph. */
DTRAIN_PRIVATE int dt__strategy_shared(const dt_strategy *s);
DTRAIN_PRIVATE dt_result dt__strategy_bind(dt_strategy *s, int r, int own_data, int own_grad, float *grad0);

/* dt_strategy_run's loop of dt_strategy_step on next(user, -1, step), for
 * the kinds without a run hook (or whose hook falls back to it). */
DTRAIN_PRIVATE dt_result dt__strategy_run_steps(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                               float *mean_loss);

/* Runs the current job (s->batch or s->next, s->job_steps) on every
 * replica's thread; returns the first failure, with the thread's error set
 * on the calling thread. */
DTRAIN_PRIVATE dt_result dt__strategy_launch(dt_strategy *s, const char *fn);

/* ---- the async family (dt_strategy_async.c) ----------------------------------------------- */
#if !defined(DTRAIN_NO_DIST) /* compiled out with the kinds that use it */
/* The in-process store's push made block by block (dt_pstore.c): after
 * dt_pstore_push's waits, fill(user, lo, hi, d) writes the update of the
 * elements [lo, hi) into d[0 .. hi-lo) (at most DT__PSTORE_BLOCK of them) and returns 1,
 * or returns 0 for a block with nothing to add; each block goes into the
 * store (by the update rule, zeros not written) while it is in the cache.
 * The same push as dt_pstore_push of the whole vector of updates, without
 * that vector. With pull_into, each block of the store is also copied there
 * right after its add, and the worker's next dt_pstore_pull into the same
 * buffer copies nothing when no other push finished since (during the sweep
 * included): the pull that follows a push made by the push's sweep. The
 * caller must leave pull_into as it is until that pull; a pull_into that is
 * the store's own vector (a worker computing on the store itself) is not
 * copied into. With step, under the Hogwild rule and when the push is not
 * scaled (staleness_lr), each block is updated in place instead:
 * step(user, lo, hi, x) makes the update on the store's elements x[0 ..
 * hi-lo) themselves (an optimizer's step on them, racing other workers'
 * writes as Hogwild's threads do), without the block of differences.
 * DTRAIN_ERR_INTERNAL for a store that is not a local one. */
#define DT__PSTORE_BLOCK ((size_t)2048) /* floats: the block of a pull's and a push's sweep */
typedef int (*dt__pstore_fill_fn)(void *user, size_t lo, size_t hi, float *d);
typedef void (*dt__pstore_step_fn)(void *user, size_t lo, size_t hi, float *x);
DTRAIN_PRIVATE dt_result dt__pstore_push_blocks(dt_pstore *ps, int worker, int64_t clock, dt__pstore_fill_fn fill,
                                                dt__pstore_step_fn step, void *user, float *pull_into,
                                                dt_pstore_ticket *tk);
/* The local store's vector (what dt_pstore_create_local was given); NULL
 * for another kind of store. */
DTRAIN_PRIVATE float *dt__pstore_local_data(dt_pstore *ps);
/* The async family's replica loop (dt_strategy_async.c) and its parts:
 * replica r's batch for its step t (the ticket or the servers' work item,
 * the batch function's batch, b's fields; 0: stop, the job is over or
 * failed); a push's statistics (staleness, steps, samples, loss); the
 * buffers' places of a gradient copy zeroed again after a parameter_server
 * push, which carried their values there. */
DTRAIN_PRIVATE int dt__strategy_async_batch(dt_strategy *s, int r, int64_t t, dt_minibatch *b);
DTRAIN_PRIVATE void dt__strategy_async_count(dt_strategy *s, int r, int64_t rows, int skipped, float loss,
                                             const dt_pstore_ticket *tk);
DTRAIN_PRIVATE void dt__strategy_bufs_zero(dt_strategy *s, float *grad);
DTRAIN_PRIVATE void dt__strategy_async_job(dt_strategy *s, int r);
/* A TCP store (dt_ps_client.c; any other: nothing): the next push was
 * computed on the parameters of the pull of `clock` (as the pull's clock
 * argument; the last pull or the one before it), not necessarily the last
 * pull: the push tells the servers that one's version (its staleness, the
 * staleness-aware step). Set before each push by parameter_server's
 * overlapped loop. */
DTRAIN_PRIVATE void dt__ps_client_push_basis(dt_pstore *ps, int64_t clock);
/* A TCP store's servers (0: not a TCP store) and, owner not NULL, which
 * server holds each parameter (*owner: the store's, read only). */
DTRAIN_PRIVATE int dt__ps_client_servers(dt_pstore *ps, const int **owner);
/* Push in parts (parameter_server's push_early; a TCP store): server s's part
 * of the push of `clock`, its parameters from index `from` on not yet sent
 * (the first part of this push: to the shard's end), a trained parameter's
 * gradient from g, a buffer's values from d. The push of `clock`
 * (dt_pstore_push) then sends the rest and ends it (or discards the parts:
 * an empty push); any other request first tells the servers to drop them.
 * One thread at a time with the store's other calls of this worker. */
DTRAIN_PRIVATE dt_result dt__ps_client_push_part(dt_pstore *ps, int64_t clock, int s, int from, const float *g,
                                                 const float *d);
DTRAIN_PRIVATE dt_result dt__strategy_async_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                                float *mean_loss);
#endif

/* ---- backup workers (dt_strategy_backup.c): mirrored with desc.backup_workers > 0 ---------- */
#if !defined(DTRAIN_NO_DIST)
DTRAIN_PRIVATE dt_result dt__strategy_backup_create(dt_strategy *s);
DTRAIN_PRIVATE void dt__strategy_backup_destroy(dt_strategy *s);
/* dt_strategy_run: the replicas run free; each step closes with the first
 * N-B gradients, the later ones are dropped. */
DTRAIN_PRIVATE dt_result dt__strategy_backup_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                                 float *mean_loss);
#endif

/* ---- the synchronous step through a centre (dt_strategy_central.c; also one_device's) ------- */
DTRAIN_PRIVATE void dt__strategy_central_job(dt_strategy *s, int r);

/* ---- devices (dt_strategy_device.c) --------------------------------------------------------- */
DTRAIN_PRIVATE dt_result dt__strategy_dev_create(dt_strategy *s);
DTRAIN_PRIVATE void dt__strategy_dev_destroy(dt_strategy *s);
/* Replica r's buffers are its graph's device copies. */
DTRAIN_PRIVATE dt_result dt__strategy_dev_bind(dt_strategy *s, int r);
/* After the replicas and the pool: the group that all-reduces over the devices. */
DTRAIN_PRIVATE dt_result dt__strategy_dev_start(dt_strategy *s);
DTRAIN_PRIVATE void dt__strategy_dev_job(dt_strategy *s, int r);
/* After a failed step: when some replica reached the update, the params'
 * (pre-step) values go back to every device. */
DTRAIN_PRIVATE void dt__strategy_dev_restore(dt_strategy *s, int64_t opt_steps); /* dt_strategy_common.c */
/* The params' values to every replica's device ("fn: replica r: ..." on failure). */
DTRAIN_PRIVATE dt_result dt__strategy_dev_upload(dt_strategy *s, const char *fn);
/* Replica 0's checks of a host copy of the reduced gradient: NaN/Inf
 * (check_numerics) and a finite clipping norm. 0: the step stops. */
DTRAIN_PRIVATE int dt__strategy_dev_checks(dt_strategy *s, const float *g);
/* A failed device call of replica 0's reduce phase (recorded); returns 0. */
DTRAIN_PRIVATE int dt__strategy_dev_failed(dt_strategy *s, dt_result rc, const char *what);
/* Host <-> device copy of [b, e) between dst and src on replica r's device. */
DTRAIN_PRIVATE dt_result dt__strategy_dev_copy(dt_strategy *s, int r, float *dst, const float *src, size_t b, size_t e,
                                               dt_copy_kind kind);

/* ---- compressed gradients (dt_strategy_compress.c) ---- */
#define DT__COMPRESS_TAG DT_COMM_TAG_MAX
DTRAIN_PRIVATE uint16_t dt__f16_of(float f);
DTRAIN_PRIVATE float dt__f32_of_f16(uint16_t h);
DTRAIN_PRIVATE uint16_t dt__bf16_of(float f);
DTRAIN_PRIVATE float dt__f32_of_bf16(uint16_t h);
/* fp16 messages: values are multiplied by 2^e, e from the largest finite
 * |value| m (it lands in [2^14, 2^15]); 0 when m is 0 or a value is not finite. */
DTRAIN_PRIVATE int dt__f16_exponent(float m, int finite);
/* Arrays of them, as little-endian 16-bit values (SSE2 on x86-64, the same
 * bits as the functions above). encode: out[i] = x[i] - sub[i] (sub NULL: x[i]),
 * times scale for fp16 (bf16: no product). decode: y[i] = value times unscale
 * for fp16 (add: y[i] += it). absmax: the largest finite |x[i] - sub[i]|,
 * *finite set to 0 past a value that is not. */
DTRAIN_PRIVATE void dt__h16_encode(dt_compress_kind kind, const float *x, const float *sub, float scale,
                                   unsigned char *out, size_t n);
DTRAIN_PRIVATE void dt__h16_decode(dt_compress_kind kind, const unsigned char *in, float unscale, float *y, size_t n,
                                   int add);
DTRAIN_PRIVATE float dt__h16_absmax(const float *x, const float *sub, size_t n, int *finite);
/* The bytes a float ring all-reduce of n values sends from one of W ranks. */
DTRAIN_PRIVATE uint64_t dt__ring_bytes(size_t n, int W);
#if !defined(DTRAIN_NO_DIST)
/* One ring step: sn floats to `to` while rn arrive from `from` (p2p, the compression tag). */
DTRAIN_PRIVATE dt_result dt__cring_swap(dt_comm *x, int rank, int to, int from, const float *sb, size_t sn,
                                        float *rb, size_t rn);
/* A message of k values: 1 + ceil(k/2) float slots. */
DTRAIN_PRIVATE size_t dt__cmsg_slots(size_t k);
DTRAIN_PRIVATE void dt__cmsg_encode(dt_compress_kind kind, const float *x, size_t k, float *slots);
DTRAIN_PRIVATE dt_result dt__cmsg_decode(dt_compress_kind kind, const float *slots, size_t k, float *y, int add);
/* Floats of scratch dt__compress_allreduce needs for n values over W ranks. */
DTRAIN_PRIVATE size_t dt__compress_scratch(size_t n, int W);
/* buf (n floats) gets the sum over the communicator's ranks, carried as 16-bit
 * values (the same result on every rank); *sent += the bytes this rank sent. */
DTRAIN_PRIVATE dt_result dt__compress_allreduce(dt_comm *x, int rank, dt_compress_kind kind, float *buf, size_t n,
                                                float *scratch, uint64_t *sent);

/* ---- error-feedback compressors: top-k and PowerSGD (dt_strategy_ef.c) ---- */
typedef struct dt__ef dt__ef;
/* A trainable run of the flat buffer: floats [off, off + rows x cols), a
 * rows x cols matrix (rows = the first dimension; vectors: cols 1). */
typedef struct dt__ef_part {
  size_t off, rows, cols;
} dt__ef_part;
#define DT__EF_SAMPLE 2048 /* top-k: keys sampled for a first threshold */

/* A part as the compressor holds it. */
typedef struct dt__ef_run {
  size_t off, rows, cols; /* the matrix */
  size_t r;               /* PowerSGD: its rank; 0: sent as floats */
  size_t poff, qoff;      /* PowerSGD: its P (or values) in the pack, its Q in q */
} dt__ef_run;

struct dt__ef { /* here, not in dt_strategy_ef.c, for tests/test_compress_ef.c */
  dt_compress c;
  int W;
  size_t n;             /* floats in the buffer */
  dt__ef_run *run;
  int nrun;
  float *err, *next;    /* the kept error and this step's, n floats each */
  int next_ok;          /* this step's error is complete and finite */
  /* top-k */
  size_t k, ntrain;
  float *key;           /* ntrain: what selection sorts */
  float *msg;           /* W messages of 2k slots */
  float sample[DT__EF_SAMPLE];
  /* PowerSGD */
  float *pack;          /* the P factors, then the float-sent parts' values */
  size_t npack;
  float *q;             /* every factored part's Q (cols x r), kept between steps */
  float *qloc;          /* this rank's M^T P before the all-reduce */
  size_t nq;
  float *qt, *recon;    /* scratch: a Q transposed (the largest), a matrix (the largest) */
  size_t nqt, nrecon;
  uint64_t seed;        /* draws Q's columns: the same sequence on every rank */
};

/* The value of rank `want` (0-based, ascending) of a[0, n): a[] reordered. */
DTRAIN_PRIVATE float dt__ef_select(float *a, size_t n, size_t want);
/* A top-k message's index slots: 32-bit little-endian in a float's bytes. */
DTRAIN_PRIVATE void dt__ef_put_u32(float *slots, size_t i, uint32_t v);
DTRAIN_PRIVATE uint32_t dt__ef_get_u32(const float *slots, size_t i);
/* This rank's top-k message into m: g + e staged in next, its k largest sent. */
DTRAIN_PRIVATE void dt__ef_topk_encode(dt__ef *e, const float *buf, float *m);
/* Rank `from`'s top-k message added into buf; DTRAIN_ERR_PROTOCOL for bad indices. */
DTRAIN_PRIVATE dt_result dt__ef_topk_add(const dt__ef *e, const float *m, int from, float *buf);
/* State for c (topk or powersgd) over n floats of which the parts are
 * trained, W ranks. lowrank_all: PowerSGD factors every matrix, even where
 * they are no smaller (tests). */
DTRAIN_PRIVATE dt_result dt__ef_create(dt_compress c, size_t n, const dt__ef_part *parts, int nparts, int W,
                                       int lowrank_all, dt__ef **out);
/* The same over P's trained parameters, each a matrix of its first
 * dimension's rows (dt__ef_param_matrix). */
DTRAIN_PRIVATE dt_result dt__ef_create_params(dt_compress c, const dt_params *P, int W, dt__ef **out);
/* Parameter i as a matrix: rows = its first dimension (vectors: all of it), cols = the rest. */
DTRAIN_PRIVATE void dt__ef_param_matrix(const dt_params *P, int i, size_t *rows, size_t *cols);
/* PowerSGD's rank for a rows x cols matrix at rank R: min(R, rows, cols), or 0
 * (sent as floats) where the factors would be no smaller or it is a vector. */
DTRAIN_PRIVATE size_t dt__ef_lowrank(int R, size_t rows, size_t cols, int lowrank_all);
/* out (rows x cols) = P Q^T, P rows x r, Q cols x r (qt: cols x r floats of
 * scratch); plain C in a fixed order: the same floats on every host. */
DTRAIN_PRIVATE void dt__ef_expand(const float *P, const float *Q, float *out, size_t rows, size_t cols, size_t r,
                                  float *qt);
DTRAIN_PRIVATE void dt__ef_destroy(dt__ef *e);
/* One rank's compression with no wire (a parameter-server push; W = 1): the
 * error staged as dt__ef_allreduce does; buf is left alone. top-k: the
 * message (dt__ef_topk_count entries, rising flat indices); PowerSGD: per
 * part, P orthonormalised and Q = M^T P (dt__ef_factors), P Q^T being what
 * the receiver adds. */
DTRAIN_PRIVATE void dt__ef_local(dt__ef *e, const float *buf);
DTRAIN_PRIVATE size_t dt__ef_topk_count(const dt__ef *e);
DTRAIN_PRIVATE void dt__ef_topk_entry(const dt__ef *e, size_t j, uint32_t *index, float *value);
/* Part `part` (the trained parameters in order) after dt__ef_local: *r its
 * rank and *Q its Q (cols x r), returning P (rows x r); *r 0: returns its
 * values (rows x cols), *Q NULL. */
DTRAIN_PRIVATE const float *dt__ef_factors(const dt__ef *e, int part, size_t *r, const float **Q);
/* buf's parts get the compressed sum over the ranks (the same bytes on every
 * rank); floats outside the parts are left alone. The step's error is staged:
 * dt__ef_commit keeps it (the step went on), otherwise the last one stays. */
DTRAIN_PRIVATE dt_result dt__ef_allreduce(dt__ef *e, dt_comm *x, int rank, float *buf, uint64_t *sent);
DTRAIN_PRIVATE void dt__ef_commit(dt__ef *e);
/* ---- gradients summed during backward (dt_strategy_overlap.c) ---- */
/* Buckets of about bucket_bytes over the flat gradient and the thread that
 * sums them over s's replicas into replica 0's and all-reduces them on x
 * (NULL: in-process only). After the replicas are bound. */
DTRAIN_PRIVATE dt_result dt__overlap_create(dt_strategy *s, dt_comm *x, size_t bucket_bytes, dt__overlap **out);
/* The buckets of P's flat gradient (size floats) for bucket_bytes: their
 * count; lo/hi (each bucket's range, from the end down), pbucket (parameter
 * -> bucket, -1 for a buffer) and need (trained parameters per bucket, added
 * to) are filled where not NULL. */
DTRAIN_PRIVATE int dt__bucket_cuts(const dt_params *P, size_t size, size_t bucket_bytes, size_t *lo, size_t *hi,
                                   int *pbucket, int *need);
DTRAIN_PRIVATE void dt__overlap_destroy(dt__overlap *o);
DTRAIN_PRIVATE int dt__overlap_buckets(const dt__overlap *o);
/* The driver, before a step's jobs (no replica runs): the step begins. */
DTRAIN_PRIVATE void dt__overlap_arm(dt__overlap *o);
/* Replica r's compute with desc.overlap: its backward starts the buckets'
 * sums; then the rest. 1 when this replica's part and every local
 * replica's went well: the sum is then in replica 0's gradient (across
 * processes: all-reduced; in one process: at least r's update slice).
 * Failures are recorded (the sums' and replica 0's numerics by replica 0). */
DTRAIN_PRIVATE int dt__overlap_compute(dt_strategy *s, int r, const dt_minibatch *b);
/* Forget the error (dt_strategy_sync: new parameters). */
DTRAIN_PRIVATE void dt__ef_reset(dt__ef *e);
/* The committed error (n floats; tests). */
DTRAIN_PRIVATE const float *dt__ef_error(const dt__ef *e);
#endif /* DTRAIN_NO_DIST */

#endif /* DTRAIN_STRATEGY_IMPL_H */
