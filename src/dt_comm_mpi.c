/* ===========================================================================
 * dt_comm_mpi.c -- the MPI communicator (DTRAIN_USE_MPI): dtrain's
 * collectives carried by MPI's on a duplicate of MPI_COMM_WORLD
 * ===========================================================================
 * One rank per process (rank and world from MPI_COMM_WORLD). The mapping:
 *
 *   allreduce       MPI_Allreduce (MPI_IN_PLACE, MPI_SUM)
 *   reduce_scatter  MPI_Reduce_scatter with dt_comm_slice counts (in place:
 *                   MPI leaves the slice at the start, moved to its place)
 *   allgather       MPI_Allgatherv in place with dt_comm_slice counts/displs
 *   reduce          MPI_Reduce (MPI_IN_PLACE at the root)
 *   broadcast       MPI_Bcast
 *   barrier         MPI_Barrier
 *
 * Counts above INT_MAX floats go in pieces (all-reduce, reduce, broadcast;
 * reduce-scatter falls back to a whole all-reduce, all-gather to one
 * broadcast per slice). The duplicate communicator has MPI_ERRORS_RETURN, so
 * a failing call returns DTRAIN_ERR_NET with MPI_Error_string's text, the
 * operation and its sequence number instead of killing the job (what MPI
 * itself can report about a lost process depends on the MPI library: many
 * still abort the whole job). dt_comm_abort only breaks this process's
 * communicator (later calls return DTRAIN_ERR_ABORTED): MPI has no way to
 * interrupt the other ranks short of MPI_Abort.
 *
 * Compiled only with DTRAIN_USE_MPI (and <mpi.h>: build with mpicc);
 * otherwise dt_comm_create_mpi fails with DTRAIN_ERR_UNSUPPORTED.
 */
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
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_platform.h"

#if defined(DTRAIN_USE_MPI)
/* C only: the deprecated MPI C++ bindings do not compile warning-free. */
#if defined(__cplusplus) && !defined(OMPI_SKIP_MPICXX)
#  define OMPI_SKIP_MPICXX 1
#endif
#if defined(__cplusplus) && !defined(MPICH_SKIP_MPICXX)
#  define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#define DT__MPI_PIECE ((size_t)1 << 30) /* floats per MPI call when n exceeds INT_MAX */

typedef struct dt__comm_mpi {
  dt_comm comm;
  MPI_Comm mc;          /* a duplicate of MPI_COMM_WORLD: our traffic never meets the user's */
  int finalize;         /* we called MPI_Init_thread: MPI_Finalize at destroy */
  int aborted;
  int *counts, *displs; /* dt_comm_slice sizes for the current n */
  size_t slices_n;      /* the n they were computed for ((size_t)-1: none) */
  uint64_t seq;         /* collectives started */
  dt_comm_stats stats;
} dt__comm_mpi;

static dt__comm_mpi *dt__comm_mpi_of(dt_comm *c) { return (dt__comm_mpi *)c->impl; }

/* Maps an MPI error code to a dt_result with MPI's own words. */
static dt_result dt__comm_mpi_error(dt__comm_mpi *m, const char *op, int code) {
  char text[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  if (len < 0) len = 0;
  if (len > MPI_MAX_ERROR_STRING) len = MPI_MAX_ERROR_STRING;
  text[len] = '\0';
  return dt__error(DTRAIN_ERR_NET, "mpi: %s #%llu (rank %d of %d) failed: %.200s (MPI error %d)", op,
                   (unsigned long long)m->seq, m->comm.rank, m->comm.world, len ? text : "unknown", code);
}

/* Common start of a collective: the rank check, the abort flag, counters. */
static dt_result dt__comm_mpi_begin(dt__comm_mpi *m, const char *op, int rank, size_t n) {
  if (rank != m->comm.rank)
    return dt__error(DTRAIN_ERR_INDEX, "mpi: %s: rank %d is not this process's rank (%d)", op, rank, m->comm.rank);
  if (m->aborted) return DTRAIN_ERR_ABORTED;
  m->seq++;
  m->stats.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

static dt_result dt__comm_mpi_end(dt__comm_mpi *m, double t0) {
  m->stats.calls++;
  m->stats.wait_s += dt__now() - t0;
  return DTRAIN_OK;
}

/* The slice counts and displacements for n floats (cached per n). */
static int dt__comm_mpi_slices(dt__comm_mpi *m, size_t n) {
  if (n > (size_t)INT_MAX) return 0;
  if (m->slices_n != n) {
    for (int r = 0; r < m->comm.world; r++) {
      size_t b, e;
      dt_comm_slice(n, m->comm.world, r, &b, &e);
      m->counts[r] = (int)(e - b);
      m->displs[r] = (int)b;
    }
    m->slices_n = n;
  }
  return 1;
}

static int dt__comm_mpi_bcast_pieces(dt__comm_mpi *m, float *buf, size_t n, int root) {
  for (size_t off = 0; off < n; off += DT__MPI_PIECE) {
    int rc = MPI_Bcast(buf + off, (int)DT__MIN(DT__MPI_PIECE, n - off), MPI_FLOAT, root, m->mc);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

static int dt__comm_mpi_allreduce_pieces(dt__comm_mpi *m, float *buf, size_t n) {
  for (size_t off = 0; off < n; off += DT__MPI_PIECE) {
    int rc = MPI_Allreduce(MPI_IN_PLACE, buf + off, (int)DT__MIN(DT__MPI_PIECE, n - off), MPI_FLOAT, MPI_SUM, m->mc);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

static dt_result dt__comm_mpi_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "allreduce", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = dt__comm_mpi_allreduce_pieces(m, buf, n);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "allreduce", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "reduce_scatter", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc;
  if (dt__comm_mpi_slices(m, n)) {
    rc = MPI_Reduce_scatter(MPI_IN_PLACE, buf, m->counts, MPI_FLOAT, MPI_SUM, m->mc);
    /* In place, MPI leaves this rank's slice at the start of buf. */
    if (rc == MPI_SUCCESS && m->displs[rank] > 0 && m->counts[rank] > 0)
      memmove(buf + m->displs[rank], buf, (size_t)m->counts[rank] * sizeof(float));
  } else {
    rc = dt__comm_mpi_allreduce_pieces(m, buf, n); /* every slice summed: more than asked */
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "reduce_scatter", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "allgather", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_SUCCESS;
  if (dt__comm_mpi_slices(m, n)) {
    rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, m->counts, m->displs, MPI_FLOAT, m->mc);
  } else {
    for (int q = 0; rc == MPI_SUCCESS && q < c->world; q++) {
      size_t b, e;
      dt_comm_slice(n, c->world, q, &b, &e);
      rc = dt__comm_mpi_bcast_pieces(m, buf + b, e - b, q);
    }
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "allgather", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "reduce", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_SUCCESS;
  for (size_t off = 0; rc == MPI_SUCCESS && off < n; off += DT__MPI_PIECE) {
    int cnt = (int)DT__MIN(DT__MPI_PIECE, n - off);
    if (rank == root) rc = MPI_Reduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, MPI_SUM, root, m->mc);
    else rc = MPI_Reduce(buf + off, NULL, cnt, MPI_FLOAT, MPI_SUM, root, m->mc);
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "reduce", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "broadcast", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = dt__comm_mpi_bcast_pieces(m, buf, n, root);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "broadcast", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_barrier(dt_comm *c, int rank) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "barrier", rank, 0);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_Barrier(m->mc);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "barrier", rc);
  return dt__comm_mpi_end(m, t0);
}

static void dt__comm_mpi_abort(dt_comm *c, int rank) {
  (void)rank;
  dt__comm_mpi_of(c)->aborted = 1;
}

static dt_result dt__comm_mpi_recover(dt_comm *c) {
  dt__comm_mpi_of(c)->aborted = 0;
  return DTRAIN_OK;
}

static void dt__comm_mpi_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  *out = dt__comm_mpi_of(c)->stats;
}

static void dt__comm_mpi_reset_stats(dt_comm *c) { memset(&dt__comm_mpi_of(c)->stats, 0, sizeof(dt_comm_stats)); }

static void dt__comm_mpi_free(dt__comm_mpi *m) {
  size_t ib = (size_t)(m->comm.world > 0 ? m->comm.world : 1) * sizeof(int);
  dt__free(m->counts, ib);
  dt__free(m->displs, ib);
  dt__free(m, sizeof *m);
}

static void dt__comm_mpi_destroy(dt_comm *c) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Comm_free(&m->mc);
    if (m->finalize) MPI_Finalize();
  }
  dt__comm_mpi_free(m);
}

static const dt_comm_vtable dt__comm_mpi_vtable = {
  "mpi",
  dt__comm_mpi_allreduce,
  dt__comm_mpi_reduce_scatter,
  dt__comm_mpi_allgather,
  dt__comm_mpi_reduce,
  dt__comm_mpi_broadcast,
  dt__comm_mpi_barrier,
  dt__comm_mpi_abort,
  dt__comm_mpi_recover,
  dt__comm_mpi_stats,
  dt__comm_mpi_reset_stats,
  dt__comm_mpi_destroy
};

DTRAIN_API dt_comm *dt_comm_create_mpi(void) {
  const char *fn = "dt_comm_create_mpi";
  int inited = 0, finalized = 0, rc, we_init = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    dt__error(DTRAIN_ERR_STATE, "%s: MPI was already finalized", fn);
    return NULL;
  }
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    /* The strategy calls its communicator from one thread at a time. */
    rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      dt__error(DTRAIN_ERR_NET, "%s: MPI_Init_thread failed (MPI error %d)", fn, rc);
      return NULL;
    }
    we_init = 1;
  }
  dt__comm_mpi *m = (dt__comm_mpi *)dt__calloc(sizeof *m);
  int world = 0, rank = 0;
  if (!m) goto nomem;
  m->mc = MPI_COMM_NULL;
  m->finalize = we_init;
  m->slices_n = (size_t)-1;
  rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->mc);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->mc, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->mc, &world);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->mc, &rank);
  if (rc != MPI_SUCCESS) {
    dt__comm_mpi_error(m, "create (MPI_Comm_dup/size/rank)", rc);
    goto fail;
  }
  m->comm.vtable = &dt__comm_mpi_vtable;
  m->comm.world = world;
  m->comm.rank = rank;
  m->comm.impl = m;
  m->counts = (int *)dt__calloc((size_t)world * sizeof(int));
  m->displs = (int *)dt__calloc((size_t)world * sizeof(int));
  if (!m->counts || !m->displs) goto nomem;
  return &m->comm;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
fail:
  if (m) {
    if (m->mc != MPI_COMM_NULL) MPI_Comm_free(&m->mc);
    dt__comm_mpi_free(m);
  }
  if (we_init) MPI_Finalize();
  return NULL;
}

#undef DT__MPI_PIECE

#else /* !DTRAIN_USE_MPI */

DTRAIN_API dt_comm *dt_comm_create_mpi(void) {
  dt__error(DTRAIN_ERR_UNSUPPORTED,
            "dt_comm_create_mpi: built without DTRAIN_USE_MPI (compile with mpicc -DDTRAIN_USE_MPI)");
  return NULL;
}

#endif /* DTRAIN_USE_MPI */
