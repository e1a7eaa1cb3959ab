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
 *   isend / irecv   MPI_Isend / MPI_Irecv (tags as given); wait polls MPI_Test
 *                   so that dt_comm_abort can end it (MPI_Cancel)
 *   split           MPI_Comm_split (a negative colour: MPI_UNDEFINED)
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
#include "dt_comm_core.h"

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

/* ---- point-to-point and groups -------------------------------------------------------------- */

typedef struct dt__mpi_req {
  dt_comm_request base;
  MPI_Request mr;
} dt__mpi_req;

static dt_result dt__comm_mpi_post(dt_comm *c, int send, int rank, int peer, int tag, float *buf, size_t n,
                                   dt_comm_request **req) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  const char *op = send ? "isend" : "irecv";
  if (rank != c->rank)
    return dt__error(DTRAIN_ERR_INDEX, "mpi: %s: rank %d is not this process's rank (%d)", op, rank, c->rank);
  if (m->aborted) return DTRAIN_ERR_ABORTED;
  if (n > (size_t)INT_MAX)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "mpi: %s: a message of %zu floats (MPI counts stop at INT_MAX)", op, n);
  dt__mpi_req *q = (dt__mpi_req *)dt__req_new(c, sizeof *q, send, rank, peer, (uint32_t)tag, buf, n);
  if (!q) return DTRAIN_ERR_NOMEM;
  int rc = send ? MPI_Isend(buf, (int)n, MPI_FLOAT, peer, tag, m->mc, &q->mr)
                : MPI_Irecv(buf, (int)n, MPI_FLOAT, peer, tag, m->mc, &q->mr);
  if (rc != MPI_SUCCESS) {
    dt__req_free(&q->base);
    m->seq++;
    return dt__comm_mpi_error(m, op, rc);
  }
  *req = &q->base;
  return DTRAIN_OK;
}

static dt_result dt__comm_mpi_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                    dt_comm_request **req) {
  return dt__comm_mpi_post(c, 1, rank, dst, tag, (float *)(uintptr_t)buf, n, req);
}

static dt_result dt__comm_mpi_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                    dt_comm_request **req) {
  return dt__comm_mpi_post(c, 0, rank, src, tag, buf, n, req);
}

static dt_result dt__comm_mpi_wait(dt_comm *c, dt_comm_request *r) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt__mpi_req *q = (dt__mpi_req *)r;
  MPI_Status st;
  int flag = 0, rc = MPI_SUCCESS;
  double t0 = dt__now(), nap = 1e-6;
  memset(&st, 0, sizeof st);
  /* MPI_Test with a growing nap (to 1 ms), so that dt_comm_abort can end the wait. */
  while ((rc = MPI_Test(&q->mr, &flag, &st)) == MPI_SUCCESS && !flag) {
    if (m->aborted) {
      MPI_Cancel(&q->mr);
      MPI_Request_free(&q->mr);
      dt__req_free(r);
      return DTRAIN_ERR_ABORTED;
    }
    if (nap > 2e-6) dt__sleep(nap);
    nap = DT__MIN(nap * 2, 1e-3);
  }
  m->stats.wait_s += dt__now() - t0;
  dt_result out = DTRAIN_OK;
  if (rc == MPI_SUCCESS && !r->send) {
    int got = 0;
    MPI_Get_count(&st, MPI_FLOAT, &got);
    if ((size_t)got != r->n)
      out = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_recv: mpi rank %d: the message from rank %d (tag %u) has %d "
                      "floats, the receive wants %zu", r->rank, r->peer, (unsigned)r->tag, got, r->n);
  } else if (rc != MPI_SUCCESS) {
    int cls = 0;
    MPI_Error_class(rc, &cls);
    m->seq++;
    if (cls == MPI_ERR_TRUNCATE)
      out = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_recv: mpi rank %d: the message from rank %d (tag %u) is longer "
                      "than the receive's %zu floats", r->rank, r->peer, (unsigned)r->tag, r->n);
    else
      out = dt__comm_mpi_error(m, r->send ? "send" : "recv", rc);
  }
  if (out == DTRAIN_OK) {
    m->stats.calls++;
    m->stats.bytes += (uint64_t)r->n * sizeof(float);
  }
  dt__req_free(r);
  return out;
}

static dt__comm_mpi *dt__comm_mpi_wrap(MPI_Comm mc, int finalize);

static dt_result dt__comm_mpi_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "split", rank, 0);
  if (r != DTRAIN_OK) return r;
  MPI_Comm nc = MPI_COMM_NULL;
  int rc = MPI_Comm_split(m->mc, color < 0 ? MPI_UNDEFINED : color, key, &nc);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "split", rc);
  if (nc == MPI_COMM_NULL) return DTRAIN_OK;
  dt__comm_mpi *g = dt__comm_mpi_wrap(nc, 0);
  if (!g) {
    MPI_Comm_free(&nc);
    return dt_last_result();
  }
  *out = &g->comm;
  if (out_rank) *out_rank = g->comm.rank;
  return DTRAIN_OK;
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

static const dt_comm_p2p_vtable dt__comm_mpi_p2p = {dt__comm_mpi_isend, dt__comm_mpi_irecv, dt__comm_mpi_wait,
                                                    dt__comm_mpi_split};

/* A dt_comm around mc (ours from now on: freed by destroy; finalize: MPI_Finalize then too). */
static dt__comm_mpi *dt__comm_mpi_wrap(MPI_Comm mc, int finalize) {
  dt__comm_mpi *m = (dt__comm_mpi *)dt__calloc(sizeof *m);
  int world = 0, rank = 0, rc;
  if (!m) {
    dt__error(DTRAIN_ERR_NOMEM, "mpi: out of memory");
    return NULL;
  }
  m->mc = mc;
  m->finalize = finalize;
  m->slices_n = (size_t)-1;
  rc = MPI_Comm_set_errhandler(m->mc, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->mc, &world);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->mc, &rank);
  m->comm.vtable = &dt__comm_mpi_vtable;
  m->comm.p2p = &dt__comm_mpi_p2p;
  m->comm.world = world;
  m->comm.rank = rank;
  m->comm.impl = m;
  if (rc != MPI_SUCCESS) {
    dt__comm_mpi_error(m, "create (MPI_Comm_set_errhandler/size/rank)", rc);
    dt__comm_mpi_free(m);
    return NULL;
  }
  m->counts = (int *)dt__calloc((size_t)world * sizeof(int));
  m->displs = (int *)dt__calloc((size_t)world * sizeof(int));
  if (!m->counts || !m->displs) {
    dt__error(DTRAIN_ERR_NOMEM, "mpi: out of memory");
    dt__comm_mpi_free(m);
    return NULL;
  }
  return m;
}

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
  MPI_Comm mc = MPI_COMM_NULL;
  rc = MPI_Comm_dup(MPI_COMM_WORLD, &mc);
  if (rc != MPI_SUCCESS) {
    dt__error(DTRAIN_ERR_NET, "%s: MPI_Comm_dup failed (MPI error %d)", fn, rc);
    if (we_init) MPI_Finalize();
    return NULL;
  }
  dt__comm_mpi *m = dt__comm_mpi_wrap(mc, we_init);
  if (!m) {
    MPI_Comm_free(&mc);
    if (we_init) MPI_Finalize();
    return NULL;
  }
  if (m->comm.world > 1) dt_trace_set_process("worker", m->comm.rank);
  dt__trace_env();
  return &m->comm;
}

#undef DT__MPI_PIECE

#else /* !DTRAIN_USE_MPI */

DTRAIN_API dt_comm *dt_comm_create_mpi(void) {
  dt__error(DTRAIN_ERR_UNSUPPORTED,
            "dt_comm_create_mpi: built without DTRAIN_USE_MPI (compile with mpicc -DDTRAIN_USE_MPI)");
  return NULL;
}

#endif /* DTRAIN_USE_MPI */
