/* ===========================================================================
 * dt_comm.h -- communicators: all-reduce, reduce-scatter, all-gather,
 * reduce, broadcast and barrier over flat float buffers, behind a vtable
 * ===========================================================================
 * A communicator connects `world` ranks. Every collective is called by every
 * rank with the same n (and root); each rank passes its own buffer. Sums run
 * in rank order (rank 0 + rank 1 + ...), so results never depend on timing
 * and repeat bitwise.
 *
 * Backends implement dt_comm_vtable. The in-process backend
 * (dt_comm_create_threads) connects threads of one process: each call names
 * the calling thread's rank. Backends with one rank per process (TCP, MPI)
 * implement the same table and take the rank argument as a check.
 *
 * Slices: reduce-scatter and all-gather split a buffer of n floats into
 * `world` contiguous slices given by dt_comm_slice(): boundaries on multiples
 * of 16 floats (64 bytes, no false sharing), sizes differing by at most 16.
 *
 * Failure: dt_comm_abort() breaks the communicator; every collective in
 * progress or later returns DTRAIN_ERR_ABORTED on every rank (no rank is left
 * waiting) until dt_comm_recover(), which is called when no rank is inside.
 * DTRAIN_ERR_ABORTED comes without a message or log line of its own: the
 * rank that aborted reports the cause.
 *
 * Threads: a rank's calls come from one thread at a time; different ranks
 * call concurrently. Buffers must not be touched by anyone else while a
 * collective on them runs; when a call returns, the buffer is the caller's.
 *
 * Point-to-point (dt_comm_send / _recv / _isend / _irecv / _wait): tagged
 * messages of floats between two ranks, for pipeline stages and anything
 * else that is not a collective. Tags are 0..DT_COMM_TAG_MAX. Messages from
 * one rank to another with the same tag are received in the order they were
 * sent. A receive takes exactly n floats: a message of another length is
 * consumed and the receive returns DTRAIN_ERR_MISMATCH naming both lengths
 * (the communicator stays usable). dt_comm_isend / dt_comm_irecv start a
 * transfer and give a request; dt_comm_wait finishes it, frees it and
 * returns its result; every request must be waited on, and until then its
 * buffer belongs to the communicator. dt_comm_send / _recv are a start and
 * a wait. As in MPI, a program must not rely on buffering: a blocking send
 * may wait until the receiver posts its receive (threads: always --
 * messages are copied straight from the sender's buffer into the
 * receiver's; tcp: when the message does not fit the sockets' buffers).
 * Failure is the collectives': dt_comm_abort ends every wait with
 * DTRAIN_ERR_ABORTED; on TCP each wait has the communicator's deadline and a
 * lost or stalled peer breaks the communicator with an error naming it.
 *
 * Groups (dt_comm_split): like MPI_Comm_split, every rank calls it with a
 * colour and a key; the ranks of one colour get a new communicator, ranked
 * by (key, old rank); a negative colour gets none. The group has every call
 * of its parent (collectives, point-to-point, split) and is destroyed by
 * each member (dt_comm_destroy), before its parent. threads: a threads
 * communicator of its own; mpi: MPI_Comm_split; tcp: a group over the
 * parent's connections (its messages carry the group's context), whose
 * collectives are built from point-to-point messages: a failure of the
 * transport breaks the parent and every group with it.
 */
#ifndef DTRAIN_COMM_H
#define DTRAIN_COMM_H

#include "dt_base.h"

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_comm dt_comm;
/* A point-to-point transfer in flight (dt_comm_isend / dt_comm_irecv). */
typedef struct dt_comm_request dt_comm_request;

/* Largest point-to-point tag (the smallest upper bound MPI guarantees). */
#define DT_COMM_TAG_MAX 32767

/* Per-rank counters (since creation or dt_comm_reset_stats). */
typedef struct dt_comm_stats {
  int64_t calls;       /* collectives completed by this rank */
  double wait_s;       /* seconds this rank spent waiting for the others */
  uint64_t bytes;      /* bytes of buffer this rank passed to collectives */
} dt_comm_stats;

typedef struct dt_comm_vtable {
  const char *name; /* "threads", "tcp", ... */
  /* Every buffer gets the element-wise sum over ranks. */
  dt_result (*allreduce)(dt_comm *c, int rank, float *buf, size_t n);
  /* The rank's slice (dt_comm_slice) of its buffer gets the sum over ranks of
   * that slice; the rest of its buffer is unspecified afterwards. */
  dt_result (*reduce_scatter)(dt_comm *c, int rank, float *buf, size_t n);
  /* Slice r of every buffer gets slice r of rank r's buffer. */
  dt_result (*allgather)(dt_comm *c, int rank, float *buf, size_t n);
  /* The root's buffer gets the sum; the others' buffers are unchanged. */
  dt_result (*reduce)(dt_comm *c, int rank, float *buf, size_t n, int root);
  /* Every buffer gets a copy of the root's. */
  dt_result (*broadcast)(dt_comm *c, int rank, float *buf, size_t n, int root);
  dt_result (*barrier)(dt_comm *c, int rank);
  /* Break the communicator (see above). Callable from any rank, any time. */
  void (*abort)(dt_comm *c, int rank);
  /* Make a broken communicator usable again; no rank may be inside a call. */
  dt_result (*recover)(dt_comm *c);
  void (*stats)(dt_comm *c, int rank, dt_comm_stats *out);
  void (*reset_stats)(dt_comm *c);
  void (*destroy)(dt_comm *c);
} dt_comm_vtable;

/* Point-to-point and groups: a second table, so that a backend written
 * before them (its dt_comm_vtable initialised in order) compiles unchanged
 * and simply has none (dt_comm.p2p NULL: the front end returns
 * DTRAIN_ERR_UNSUPPORTED). isend/irecv start a transfer and set *req (NULL
 * only on failure); wait finishes and frees it. */
typedef struct dt_comm_p2p_vtable {
  dt_result (*isend)(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n, dt_comm_request **req);
  dt_result (*irecv)(dt_comm *c, int rank, int src, int tag, float *buf, size_t n, dt_comm_request **req);
  dt_result (*wait)(dt_comm *c, dt_comm_request *req);
  dt_result (*split)(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank);
} dt_comm_p2p_vtable;

/* The communicator object. Backends fill it; users only pass it around. */
struct dt_comm {
  const dt_comm_vtable *vtable;
  int world;  /* number of ranks (>= 1) */
  int rank;   /* one-rank-per-process backends (tcp, mpi): this process's rank; threads: 0 */
  void *impl; /* the backend's state */
  const dt_comm_p2p_vtable *p2p; /* NULL: no point-to-point messages or groups */
};

/* In-process backend for `world` threads (1 <= world <= 256). spin_us: how
 * long a waiting rank spins before it sleeps (0: default, 50 us when the
 * ranks fit on the cores; < 0: never spin). NULL on failure; world > 1 needs
 * threads (DTRAIN_ERR_UNSUPPORTED with DTRAIN_NO_THREADS). Each collective:
 * ranks publish their buffers and meet at a barrier, each rank sums its slice
 * in rank order and writes the result where it belongs (for all-reduce: into
 * every rank's buffer -- reduce-scatter and all-gather fused), and they meet
 * again before returning. */
DTRAIN_API dt_comm *dt_comm_create_threads(int world, int spin_us);
/* Destroys any backend; NULL is a no-op. No rank may be inside a call. */
DTRAIN_API void dt_comm_destroy(dt_comm *c);

/* The collectives: check the arguments, then call the backend. They return
 * DTRAIN_ERR_NULL_ARG / DTRAIN_ERR_INDEX for bad arguments (without
 * communicating), DTRAIN_ERR_ABORTED when the communicator is broken, and
 * DTRAIN_ERR_MISMATCH (on every rank) when the ranks disagree on n or root. */
DTRAIN_API dt_result dt_comm_allreduce(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_allgather(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_reduce(dt_comm *c, int rank, float *buf, size_t n, int root);
DTRAIN_API dt_result dt_comm_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root);
DTRAIN_API dt_result dt_comm_barrier(dt_comm *c, int rank);
/* abort and reset_stats on a NULL c do nothing (cleanup paths call them);
 * world and rank of a NULL c are 0, its name "none". */
DTRAIN_API void dt_comm_abort(dt_comm *c, int rank);
DTRAIN_API dt_result dt_comm_recover(dt_comm *c);
DTRAIN_API int dt_comm_world(const dt_comm *c);
/* This process's rank in a one-rank-per-process communicator (tcp, mpi); 0 for threads. */
DTRAIN_API int dt_comm_rank(const dt_comm *c);
DTRAIN_API const char *dt_comm_name(const dt_comm *c);
DTRAIN_API dt_result dt_comm_stats_get(dt_comm *c, int rank, dt_comm_stats *out);
DTRAIN_API void dt_comm_reset_stats(dt_comm *c);

/* Point-to-point (see the top of this file). rank: the caller's rank (a
 * check on one-rank-per-process backends); dst / src: the peer's rank in c
 * (the caller itself is allowed with isend/irecv). Bad arguments return
 * DTRAIN_ERR_NULL_ARG / _INDEX / _INVALID_ARG without communicating;
 * dt_comm_wait(NULL) is DTRAIN_ERR_NULL_ARG. */
DTRAIN_API dt_result dt_comm_send(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n);
DTRAIN_API dt_result dt_comm_recv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                   dt_comm_request **req);
DTRAIN_API dt_result dt_comm_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                   dt_comm_request **req);
DTRAIN_API dt_result dt_comm_wait(dt_comm_request *req);
/* Waits for all n requests (NULL entries skipped; each is set to NULL) and
 * returns the first error, after waiting for the rest. */
DTRAIN_API dt_result dt_comm_waitall(dt_comm_request **reqs, int n);

/* Split c into groups (see the top of this file): a collective call of every
 * rank of c. *out gets the caller's group (NULL for a negative colour) and
 * *out_rank (may be NULL) its rank there (-1 for none). DTRAIN_ERR_ABORTED /
 * a transport error as for the collectives. */
DTRAIN_API dt_result dt_comm_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank);

/* ---- layouts: pipeline x tensor x data parallel ------------------------------------------
 * A communicator of W = P * T * R ranks seen as a grid (Megatron's order:
 * tensor fastest, then data, then pipeline stage):
 *   rank = t + T * (d + R * p)
 * so the T ranks of a tensor-parallel group are consecutive (one machine,
 * the most traffic), the R ranks of a data-parallel group hold the same part
 * of the model, and the P ranks of a pipeline are its stages in order.
 * dt_layout_create is a collective call of every rank of c (three splits);
 * each rank gets its coordinates and its three groups (world 1 when that
 * dimension is 1). dt_layout_destroy destroys the groups (each rank, before c). */
typedef struct dt_layout {
  int pipeline, tensor, data; /* P, T, R */
  int stage, tp_rank, dp_rank; /* this rank's p, t, d */
  dt_comm *pp; /* the P ranks of this rank's pipeline (same t, d), ranked by stage */
  dt_comm *tp; /* the T ranks of its tensor-parallel group (same p, d), ranked by t */
  dt_comm *dp; /* the R ranks holding the same part of the model (same p, t), ranked by d */
} dt_layout;

/* DTRAIN_ERR_INVALID_ARG (without communicating) when P or T is < 1 or P*T
 * does not divide the world. */
DTRAIN_API dt_result dt_layout_create(dt_comm *c, int rank, int pipeline, int tensor, dt_layout *out);
DTRAIN_API void dt_layout_destroy(dt_layout *l);

/* Slice `rank` of n floats split over `world` ranks: [*begin, *end). */
DTRAIN_API void dt_comm_slice(size_t n, int world, int rank, size_t *begin, size_t *end);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_COMM_H */
