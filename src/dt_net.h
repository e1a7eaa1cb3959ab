/* ===========================================================================
 * dt_net.h -- training across processes and machines: the cluster
 * description, the TCP transport's options, the TCP (and MPI) communicators,
 * and parameter servers
 * ===========================================================================
 * A cluster is W worker processes (ranks 0..W-1) and, for parameter-server
 * training, M server processes. Every process learns the cluster and its own
 * place in it from DTRAIN_CONFIG (JSON in the style of TF_CONFIG) or from
 * flags:
 *
 *   DTRAIN_CONFIG='{"cluster": {"worker": ["10.0.0.1:7000", "10.0.0.2:7000"],
 *                               "ps": ["10.0.0.3:7100"]},
 *                   "task": {"type": "worker", "index": 0}}'
 *
 *   prog --rank 0 --world 2 --peers 10.0.0.1:7000,10.0.0.2:7000 [--ps host:port,...] [--role worker|ps]
 *
 * tools/dtrain-launch -n N [--ps M] -- prog args starts N workers (and M
 * servers) on this machine with the right DTRAIN_CONFIG.
 *
 * Every blocking call has a deadline (dt_net_options.timeout_s, default 30 s,
 * env DTRAIN_TIMEOUT). When a peer dies or stalls, every rank returns an
 * error naming the lost rank, the operation and its sequence number: nothing
 * hangs. The wire format is in docs/wire_protocol.md.
 *
 * Without networking (DTRAIN_NO_NET) the create functions fail with
 * DTRAIN_ERR_UNSUPPORTED; the cluster parser still works.
 */
#ifndef DTRAIN_NET_H
#define DTRAIN_NET_H

#include "dt_comm.h"
#include "dt_optim.h"

/* The parameter store (dt_pstore, dt_strategy.h) is the one type this header
 * takes from the strategy layer above it: dt_pstore_create_tcp returns one.
 * It is named by its struct tag (the same type as the typedef), so the
 * transport's options and the communicators here do not pull in the
 * strategies. */
struct dt_pstore;

DTRAIN_EXTERN_C_BEGIN

#define DTRAIN_MAX_PEERS 1024
#define DTRAIN_NET_VERSION 4 /* 2: the hello says whether the job id was given (DTRAIN_JOB_ID);
                                3: JOINED carries the clocks a (re)joining worker starts from;
                                4: READY carries the acceptor's clock readings (the traces' offsets) */

typedef enum dt_role {
  DTRAIN_ROLE_WORKER = 0,
  DTRAIN_ROLE_PS = 1
} dt_role;

/* ---- the cluster description ---------------------------------------------------------- */
typedef struct dt_cluster {
  int workers;         /* worker processes (>= 1) */
  int servers;         /* parameter-server processes (>= 0) */
  char **worker_addr;  /* "host:port" of each worker ("[::1]:7000" for IPv6) */
  char **server_addr;  /* "host:port" of each server */
  dt_role role;        /* this process */
  int index;           /* this process's index within its role */
  /* Model-parallel layout of the workers (dt_layout_from_cluster): pipeline
   * stages and tensor-parallel ranks; the rest are data-parallel replicas.
   * 0 or 1: none (a cluster built by hand before these existed has 0). */
  int pipeline, tensor;
} dt_cluster;

/* Parse DTRAIN_CONFIG-style JSON. On success *out owns a new cluster (free it
 * with dt_cluster_destroy); on failure *out is NULL. The text must be one
 * JSON object (RFC 8259, UTF-8) with "cluster": {"worker": [...], "ps": [...]}
 * ("ps" may be absent or empty) and "task": {"type": "worker" | "ps",
 * "index": N}, and optionally "layout": {"pipeline": P, "tensor": T} (both
 * optional integers >= 1 whose product divides the workers: dt_cluster.pipeline
 * and .tensor, 1 when absent); other keys, also inside "cluster" and "task" (e.g. "chief"),
 * are checked as JSON and ignored. Addresses are "host:port" (a host name or
 * IPv4) or "[v6]:port", port 0..65535, at most 255 bytes. Nesting is limited
 * to 32 levels. Errors: DTRAIN_ERR_FORMAT for bad JSON, a duplicate or
 * missing key or a non-integer index, naming the byte offset (from 0) and
 * what was expected ("cluster JSON: byte 11: expected ':' after the object
 * key, found '{'"); DTRAIN_ERR_INVALID_ARG for a bad address, an unknown task
 * type, no workers, more than DTRAIN_MAX_PEERS per role, an index out of
 * range or two processes with the same address (host compared ignoring case). */
DTRAIN_API dt_result dt_cluster_parse_json(const char *json, dt_cluster **out);
/* From the environment variable DTRAIN_CONFIG (messages say "DTRAIN_CONFIG:
 * byte N: ..."); DTRAIN_ERR_NOT_FOUND when unset or empty. */
DTRAIN_API dt_result dt_cluster_from_env(dt_cluster **out);
/* From flags --rank R --world W --peers a,b,... [--ps a,b,...] [--role worker|ps]
 * (also --flag=value). The flags it used are removed from argv (and *argc
 * updated; argv[*argc] becomes NULL) so the program can parse the rest;
 * scanning stops at "--". DTRAIN_ERR_NOT_FOUND when none of them is present
 * (then argv is untouched): fall back to the environment. --rank is required
 * (the index within --role, default worker). --world without --peers means
 * 127.0.0.1 ports 29500.. (--port P for the first); then --ps M (a count)
 * puts M servers on the ports after the workers'. --world with --peers must
 * equal the number of peers. On an error (DTRAIN_ERR_INVALID_ARG naming the
 * flag) argv is untouched. */
DTRAIN_API dt_result dt_cluster_from_args(int *argc, char **argv, dt_cluster **out);
/* Flags first, then DTRAIN_CONFIG; neither: a one-worker cluster (*out is a
 * cluster of one worker at 127.0.0.1:0). Bad flags or a bad DTRAIN_CONFIG
 * are errors, not a reason to fall back. argc/argv may be NULL (no flags). */
DTRAIN_API dt_result dt_cluster_discover(int *argc, char **argv, dt_cluster **out);
/* A copy in one allocation, owned by the caller (NULL on failure: out of
 * memory, or c is not a valid cluster as dt_cluster_parse_json would accept;
 * c may be built by hand). */
DTRAIN_API dt_cluster *dt_cluster_clone(const dt_cluster *c);
/* Frees a cluster made by the functions above (never one built by hand); NULL is a no-op. */
DTRAIN_API void dt_cluster_destroy(dt_cluster *c);
/* dt_layout_create (dt_comm.h) with the cluster's layout: P = cl->pipeline,
 * T = cl->tensor (0 counts as 1); c is the workers' communicator. */
DTRAIN_API dt_result dt_layout_from_cluster(dt_comm *c, int rank, const dt_cluster *cl, dt_layout *out);
/* "worker 1 (127.0.0.1:7001)" into buf (truncated to cap); "worker 7" when c
 * is NULL or has no such process; returns buf. */
DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap);
/* JSON text of c (the DTRAIN_CONFIG that reproduces it, on one line, e.g.
 * {"cluster":{"worker":["a:1"],"ps":[]},"task":{"type":"worker","index":0}})
 * into buf; DTRAIN_ERR_OVERFLOW (buf set to "") if cap is too small, the
 * message naming the bytes needed; DTRAIN_ERR_INVALID_ARG if c is not valid. */
DTRAIN_API dt_result dt_cluster_to_json(const dt_cluster *c, char *buf, size_t cap);

/* ---- transport options ---------------------------------------------------------------- */
/* Zero fields take the defaults in brackets (most also from the environment). */
typedef struct dt_net_options {
  double timeout_s;          /* deadline for every blocking call [env DTRAIN_TIMEOUT, else 30] */
  double connect_timeout_s;  /* how long to retry connecting while peers start [timeout_s] */
  const char *token;         /* shared secret: peers must prove they know it (HMAC-SHA256
                                challenge-response; it never crosses the wire)
                                [env DTRAIN_TOKEN; NULL or "": no authentication] */
  uint64_t job_id;           /* frames of another job are refused [env DTRAIN_JOB_ID, else a
                                hash of the cluster's addresses] */
  uint64_t model_hash;       /* checked in the handshake; 0: not checked (see dt_params_hash) */
  int listen_fd;             /* an already bound, listening socket to use instead of binding
                                this process's address [env DTRAIN_LISTEN_FD; 0 means none:
                                to pass fd 0 itself, use the environment] */
  size_t max_payload;        /* largest frame payload accepted [256 MiB] */
  size_t chunk_bytes;        /* ring all-reduce pipelining chunk [512 KiB] */
  size_t small_bytes;        /* all-reduce of at most this many bytes uses recursive doubling [64 KiB] */
  int quiet;                 /* nonzero: no log lines for refused connections */
  double spin_us;            /* a collective waiting for a peer's frame retries the socket
                                (sched_yield() between tries) this long before sleeping in
                                poll(), whose wake-up costs a few microseconds per message
                                [env DTRAIN_SPIN_US, else 20; 0 here means the default,
                                negative: never spin] */
  int64_t sock_buf_bytes;    /* SO_SNDBUF and SO_RCVBUF of every collective connection: large
                                buffers let a peer send the next ring part while this rank
                                sums the last one (on loopback, 4 MiB ran 1-4 MiB all-reduces
                                about 20-50% faster than autotuning). The kernel caps it
                                (net.core.wmem_max / rmem_max) [env DTRAIN_SOCKBUF, else
                                4 MiB; 0 here means the default; negative (or 0 in the
                                environment): the kernel's own sizes and autotuning] */
  double handshake_timeout_s; /* an accepted connection must finish its handshake within this
                                long, else it is dropped (and logged); handshakes run beside the
                                serving and the start-up of the real peers, never blocking
                                them, at most 32 at a time (then the oldest silent one, or
                                the oldest, is dropped)
                                [env DTRAIN_HANDSHAKE_TIMEOUT, else 3; at most timeout_s] */
} dt_net_options;

DTRAIN_API dt_net_options dt_net_defaults(void);

/* A hash of the parameters' names, shapes and order (not values; a NULL p
 * hashes as an empty model), for
 * dt_net_options.model_hash: processes that built different models refuse
 * to train together. */
DTRAIN_API uint64_t dt_params_hash(const dt_params *p);

/* ---- communicators across processes ------------------------------------------------------
 * One rank per worker process (rank = cluster index); the rank argument of
 * the dt_comm_* calls must equal it. Creating connects to every peer it needs
 * (retrying with backoff until connect_timeout_s while peers start), runs the
 * handshake (version, job, world size, unique ranks, model hash, token) and
 * fails naming both sides when they differ. All-reduce: ring (reduce-scatter
 * + all-gather, chunked and pipelined) above small_bytes, recursive doubling
 * at or below it. Sums are in a fixed order per element (not rank order), so
 * results repeat bitwise and equal the threads backend within float rounding.
 * Failure: a dead or stalled peer makes the call return DTRAIN_ERR_PEER or
 * DTRAIN_ERR_TIMEOUT within the deadline, with a message naming the peer,
 * the operation and its sequence number; this rank then tells the peers it
 * can still reach (an abort frame) so they fail fast too.
 *
 * Details of the tcp communicator:
 * - Every call has a sequence number (#1, #2, ...) and starts with a small
 *   agreement round (recursive doubling, log2(world) round trips) that
 *   compares the operation, n, root, sequence number and the chunk_bytes /
 *   small_bytes options of every rank: when they differ, every rank returns
 *   DTRAIN_ERR_MISMATCH naming two ranks and what they called, and the
 *   communicator stays usable. A barrier is that round alone.
 * - Sum order: at or below small_bytes, recursive doubling over the largest
 *   power of two p <= world (ranks p.. fold into rank r-p first), i.e. a
 *   fixed tree of ranks; above it, slice j (dt_comm_slice) is summed in ring
 *   order starting after its owner: x[j+1] + x[j+2] + ... + x[j] (mod world).
 *   reduce sums x[root+1] + ... + x[root] along a chain. The order depends
 *   only on n, world and the options, so results repeat bitwise.
 * - Failure messages name the lost rank, not just the neighbour a rank was
 *   waiting for: after a failure each rank listens up to min(timeout_s/4,
 *   2 s) for the others' abort frames; peers that closed their connection
 *   are reported as "worker 2 (host:port) closed the connection"
 *   (DTRAIN_ERR_PEER), peers that sent nothing as "... sent nothing before
 *   the deadline (stalled?)" (DTRAIN_ERR_TIMEOUT). A peer's dt_comm_abort
 *   reaches the others as DTRAIN_ERR_ABORTED. After any failure the
 *   communicator is broken: later calls return DTRAIN_ERR_ABORTED and
 *   dt_comm_recover returns DTRAIN_ERR_UNSUPPORTED -- destroy it, restart the
 *   processes and resume from the last checkpoint.
 * - Setup: rank r dials ranks 0..r-1 and accepts r+1..world-1 until
 *   connect_timeout_s + timeout_s; connections that are not a valid peer
 *   (garbage, another job, a wrong token) are refused, logged and do not
 *   delay the real peers. A socket passed in listen_fd stays the caller's;
 *   one the communicator bound itself, or the launcher's (DTRAIN_LISTEN_FD),
 *   is closed once every peer is in, so that a later dialer is refused at
 *   once instead of waiting in a backlog nobody accepts from.
 * - Memory: buffers of max(chunk_bytes, small_bytes) are allocated at
 *   creation; calls allocate nothing. dt_comm_destroy says goodbye (a BYE
 *   frame) to every peer and closes every socket. */
DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *c, const dt_net_options *o);
/* MPI_COMM_WORLD (DTRAIN_USE_MPI only; otherwise NULL with
 * DTRAIN_ERR_UNSUPPORTED). Calls MPI_Init_thread (MPI_THREAD_SERIALIZED) if
 * MPI is not initialized yet and MPI_Finalize at destroy in that case; a
 * program that initialized MPI itself keeps it. Rank and world are MPI's.
 * Works on a duplicate of MPI_COMM_WORLD (the program's own MPI traffic never
 * mixes with dtrain's) with MPI_ERRORS_RETURN: a failing MPI call returns
 * DTRAIN_ERR_NET with MPI_Error_string's text, the operation and its sequence
 * number (whether MPI reports a lost process or ends the job is up to the
 * MPI library). The collectives map to MPI_Allreduce, MPI_Reduce_scatter,
 * MPI_Allgatherv (dt_comm_slice slices), MPI_Reduce, MPI_Bcast and
 * MPI_Barrier; sums follow MPI's order, so results equal the other backends'
 * within float rounding. dt_comm_abort breaks only this process's
 * communicator. Build and run:
 *
 *   mpicc -O2 -DDTRAIN_USE_MPI prog.c -o prog -lm -lpthread
 *   mpirun -n 4 ./prog                      (or the cluster's scheduler: srun, ...)
 *
 *   dt_comm *c = dt_comm_create_mpi();
 *   dt_strategy_options sd = dt_strategy_multi_worker_mirrored(c, 2);   // 4 processes x 2 threads
 */
DTRAIN_API dt_comm *dt_comm_create_mpi(void);

/* ---- parameter servers ---------------------------------------------------------------------
 * Parameter-server training: the model's variables are sharded over the M
 * server processes of the cluster; W worker processes pull the parameters,
 * compute gradients on their own batches and push them; each server applies
 * the optimizer to its shard. Every process runs the same program and builds
 * the same model (dt_params, same names, shapes and order) and optimizer:
 *
 *   dt_cluster *c;  dt_cluster_discover(&argc, argv, &c);
 *   ... build params P and optimizer opt ...
 *   if (c->role == DTRAIN_ROLE_PS) return dt_ps_serve(c, P, opt, NULL, &po) == DTRAIN_OK ? 0 : 1;
 *   dt_pstore *ps = dt_pstore_create_tcp(c, P, NULL, 2);    // max_staleness 2
 *   dt_strategy_options sd = dt_strategy_parameter_server(ps, 2);
 *   dt_strategy *s = dt_strategy_create(P, opt, step, &m, &sd);
 *   dt_strategy_run(s, steps, next_batch, &data, &loss);
 *   dt_pstore_leave(ps, c->index);                        // BYE: the servers stop waiting for us
 *   dt_strategy_destroy(s);  dt_pstore_destroy(ps);
 *
 * Sharding (dt_ps_shard): parameters are assigned whole, largest first (ties:
 * lower index first), each to the server with the least floats so far (ties:
 * lower server index); every process computes the same assignment. No
 * parameter is split, so one huge parameter makes its server the bottleneck.
 * Non-trainable buffers (batch-norm statistics) are sharded too; a push
 * carries their current value and the server keeps the last one.
 *
 * Staleness: the SSP rule of dt_pstore (dt_strategy.h) on each server, with
 * the bound the workers ask for (dt_pstore_create_tcp; all workers must ask
 * for the same, else the later one is refused). 0 is lock-step: a server
 * applies the pushes of a round in worker order, so 1 worker x 1 server with
 * bound 0 computes exactly what one_device computes with the same optimizer.
 *
 * Failures. A worker whose connection breaks, that sends a bad frame, or
 * from which a server hears nothing for timeout_s while the server owes it
 * no answer (workers send heartbeats every timeout_s/3 when idle; servers
 * send them every timeout_s/4 to a worker held back by the bound) is logged
 * ("ps 0: worker 1 (127.0.0.1:7001) lost: ...; going on with 1 worker"),
 * dropped from the staleness clocks, and training goes on with the rest. A
 * worker that never connects within connect_timeout_s is dropped the same
 * way, unless min_workers says it is optional (dt_ps_options).
 *
 * Membership. A lost worker may come back with its rank (a restarted
 * process: the same cluster entry, the same job and token): its slot is
 * free again once the server drops it, the handshake and JOIN run as on the
 * first day, and it gets the current parameters at its first pull. It
 * rejoins at the clock of the slowest live worker (or its own, if it was
 * ahead), so the others never wait for it to catch up; the store's
 * steps_done says how many steps its rank had pushed before (the servers
 * remember), so a program can resume its schedule and data where it left
 * (examples/06_parameter_server does). A worker that said BYE cannot come
 * back. With min_workers M < W, training starts once M workers joined; each
 * of the others may join mid-run, any time while the server runs, the same
 * way. A server ends when no worker is live; with rejoin_timeout_s it first
 * waits that long for a lost worker to come back.
 *
 * A server that dies or stalls makes every call of every worker's store
 * return DTRAIN_ERR_PEER or DTRAIN_ERR_TIMEOUT within about timeout_s, naming
 * it ("worker 0: push #12: receive from ps 1 (127.0.0.1:7101): ..."); the
 * error stays until the store is destroyed. Restart the job: each server
 * resumes from its last checkpoint (dt_ps_options).
 *
 * Compressed pushes and pulls (dt_strategy_options.compress, which the
 * strategy copies to the store's `compress`; --compress in the examples).
 * Pushes: fp16 or bf16 send each gradient value in 16 bits (fp16 scaled by a
 * power of two chosen from the largest value); topk:F sends the worker's
 * ceil(F x trained values) largest |gradient + error| (selected over all its
 * servers, each getting those of its shard as positions and values);
 * powersgd:R sends, per trained matrix, PowerSGD's factors P (rows x r,
 * orthonormal) and Q = M^T P (cols x r), r = min(R, rows, cols), the server
 * adding P Q^T (vectors and matrices whose factors would be no smaller go as
 * floats). top-k and PowerSGD keep what they left out and add it to the next
 * push (error feedback; PowerSGD's Q is the warm start of the next). Buffers
 * always go as floats. Pulls: after a first pull of floats, each server sends
 * the difference between its shard and the copy this worker holds, in 16
 * bits (bf16 with compress bf16, fp16 otherwise); both ends add the same
 * decoded values to their copies, which stay bitwise equal, and the worker
 * trains on its copy (the last difference's rounding from the server's
 * weights; what it lost comes with the next). A server keeps one such copy
 * per compressing worker (the shard's floats); a worker keeps one of the
 * model. Payload bytes per step with one server (n floats, t of them
 * trained): floats send 16 + 16 + 4n and receive as many; fp16/bf16 send
 * 16 + 24 + 2t + 4(n-t) and receive 24 + 2n + 16 (dt_strategy_stats'
 * wire_bytes and wire_bytes_received count them).
 *
 * Wire: after the transport handshake, message types 0x50..0x59 (see
 * docs/wire_protocol.md); parameters and gradients travel as little-endian
 * IEEE-754 floats, or 16-bit floats and top-k / low-rank messages when
 * compressed. */

/* What server 0's work queue did (dt_ps_options.work_stats). */
typedef struct dt_ps_work_stats {
  int64_t items;      /* in the queue */
  int64_t done;       /* items whose push arrived (each at most once) */
  int64_t handed_out; /* takes answered with an item (> done: some went to a worker that died) */
  int64_t returned;   /* items given back by workers lost or gone before their push */
} dt_ps_work_stats;

/* Zero fields take the defaults in brackets. */
typedef struct dt_ps_options {
  const char *checkpoint_dir;  /* shard checkpoints go to DIR/ps-<i>-of-<M>.ckpt (written to a
                                  temporary file, then renamed); on start the server resumes from
                                  it when it exists [NULL: no checkpoints] */
  int64_t checkpoint_every;    /* also write one after every this many updates [0: off] */
  double checkpoint_seconds;   /* also write one when this many seconds passed since the last [0: off] */
  int no_resume;               /* nonzero: start from the params' values even if a checkpoint exists */
  int min_workers;             /* training starts once this many workers joined; the others may
                                  join later (mid-run) and are not waited for [0: all of them] */
  int staleness_lr;            /* nonzero: a push of staleness s (updates applied since the pusher's
                                  pull) is applied with its learning rate divided by 1+s: the
                                  shard moves (new - old) / (1+s) of what the optimizer says [0] */
  double rejoin_timeout_s;     /* when no worker is live but one was lost less than this long ago,
                                  keep serving for its return (a restarted process)
                                  [env DTRAIN_REJOIN_TIMEOUT, else 0: end] */
  int64_t work_items;          /* server 0 (the others ignore it): a work queue of items 0 .. N-1
                                  that workers take one at a time (dt_pstore_take; dynamic data
                                  sharding), each done when its worker's next push arrives, handed
                                  out again when its worker dies first [0: no queue] */
  dt_ps_work_stats *work_stats; /* if not NULL, filled when dt_ps_serve returns (server 0 with a
                                  queue; zeros otherwise) */
  int aggregate;               /* R > 0: synchronous rounds with backup workers (Chen et al. 2016;
                                  TF's SyncReplicasOptimizer): the server holds the pushes computed on
                                  its current version and, with R of them (or every worker that can
                                  still push), applies their mean as one optimizer step; a push
                                  computed on an older version is dropped (its round closed: the
                                  worker's dt_pstore_ticket.dropped), and a worker's pull waits for
                                  the round of its push. W - R workers are backups: the slowest ones'
                                  pushes are dropped instead of waited for. Workers must ask for
                                  max_staleness 0 (others are refused: their pushes would all be
                                  late). Each server closes its own rounds (with several, one may
                                  hold a push another drops). A held push is in a checkpoint once
                                  its round closes (checkpoint_every counts rounds). Not with
                                  work_items or staleness_lr [0: each push applied as it comes] */
} dt_ps_options;

/* The server of each parameter: server_of[i] for i < dt_params_count(p)
 * (see Sharding above). */
DTRAIN_API dt_result dt_ps_shard(const dt_params *p, int servers, int *server_of);

/* Run server c->index (c->role must be DTRAIN_ROLE_PS) until every worker has
 * said BYE or was lost: owns its shard of params (their initial values are
 * the params' current values, or the checkpoint's) and applies opt to it.
 * The optimizer advances once per applied push; its clip_norm is not used
 * (workers clip their gradients before pushing). Writes a final checkpoint
 * when po->checkpoint_dir is set. Returns DTRAIN_OK when at least one worker
 * finished with BYE, DTRAIN_ERR_PEER when all were lost, or the error that
 * stopped it (listening, a bad checkpoint). On return the params' shard
 * holds the trained values. po may be NULL. */
DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po);

/* A parameter store (dt_strategy.h) backed by the cluster's servers, for
 * worker c->index: connects to every server (retrying until
 * connect_timeout_s), checks the model hash (o->model_hash) and the token, and
 * announces max_staleness. Pushes take gradients (store->gradients == 1):
 * the vector pushed has the params' layout, gradients for trainable
 * parameters and current values for buffers. The `worker` argument of the
 * dt_pstore_* calls is ignored (the store is worker c->index); clocks given
 * to pull/push count from dt_pstore_begin, which continues where the last
 * run stopped (the servers' clocks never go back). pull sends a request to
 * every server, then gathers the shards; push sends each server its slice.
 * A pull that fails (a server gone in the middle of its answer) may leave
 * dst partly written (floats are read where they go; with several servers a
 * shard may be new and another old): the servers hold the values, pull again
 * after a rejoin. dt_pstore_leave says BYE (later calls fail with DTRAIN_ERR_STATE);
 * dt_pstore_destroy says it too when leave was not called. A heartbeat
 * thread (not with DTRAIN_NO_THREADS) keeps idle connections alive. NULL on
 * failure (dt_last_error()). */
DTRAIN_API struct dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                                  int max_staleness);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_NET_H */
