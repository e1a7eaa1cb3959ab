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
 */
#ifndef DTRAIN_COMM_H
#define DTRAIN_COMM_H

#include "dt_base.h"

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_comm dt_comm;

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

/* The communicator object. Backends fill it; users only pass it around. */
struct dt_comm {
  const dt_comm_vtable *vtable;
  int world;  /* number of ranks (>= 1) */
  int rank;   /* one-rank-per-process backends (tcp, mpi): this process's rank; threads: 0 */
  void *impl; /* the backend's state */
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

/* Slice `rank` of n floats split over `world` ranks: [*begin, *end). */
DTRAIN_API void dt_comm_slice(size_t n, int world, int rank, size_t *begin, size_t *end);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_COMM_H */
