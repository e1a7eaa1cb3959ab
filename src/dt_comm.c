/* ===========================================================================
 * dt_comm.c -- the communicator front end and the in-process threads backend
 * ===========================================================================
 * Threads backend. Each rank owns a 64-byte slot where it publishes the
 * buffer of the collective it is in. A collective is:
 *
 *   publish slot -> barrier -> check that every rank called the same thing
 *   -> work on this rank's slice of every buffer -> barrier
 *
 * The first barrier makes every buffer ready and visible; the second keeps
 * every buffer untouched until nobody reads it any more (the caller may
 * reuse it as soon as the call returns). Between them only the owner of a
 * slice touches that slice of any buffer, so the work needs no atomics. The
 * sums run over a block of the slice at a time, rank 0 first, into a small
 * stack buffer, then go where they belong: the result never depends on which
 * thread came first.
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

enum {
  DT__COMM_OP_ALLREDUCE = 1,
  DT__COMM_OP_REDUCE_SCATTER,
  DT__COMM_OP_ALLGATHER,
  DT__COMM_OP_REDUCE,
  DT__COMM_OP_BROADCAST,
  DT__COMM_OP_BARRIER
};

static const char *dt__comm_op_name(int op) {
  switch (op) {
    case DT__COMM_OP_ALLREDUCE: return "allreduce";
    case DT__COMM_OP_REDUCE_SCATTER: return "reduce_scatter";
    case DT__COMM_OP_ALLGATHER: return "allgather";
    case DT__COMM_OP_REDUCE: return "reduce";
    case DT__COMM_OP_BROADCAST: return "broadcast";
    case DT__COMM_OP_BARRIER: return "barrier";
    default: return "?";
  }
}

/* ---- slices -------------------------------------------------------------------------- */

DTRAIN_API void dt_comm_slice(size_t n, int world, int rank, size_t *begin, size_t *end) {
  if (!begin || !end) dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_slice: %s is NULL", !begin ? "begin" : "end");
  size_t b = 0, e = 0;
  if (world >= 1 && rank >= 0 && rank < world) {
    size_t chunks = (n + 15) / 16, w = (size_t)world, r = (size_t)rank;
    b = chunks * r / w * 16;
    e = chunks * (r + 1) / w * 16;
    if (b > n) b = n;
    if (e > n) e = n;
  }
  if (begin) *begin = b;
  if (end) *end = e;
}

/* ---- the threads backend ---------------------------------------------------------------- */

typedef struct dt__comm_slot_data {
  float *buf;
  size_t n;
  int op, root;
  dt_comm_stats st;
} dt__comm_slot_data;

typedef union dt__comm_slot {
  dt__comm_slot_data d;
  char align[2 * DT__ALIGN]; /* one slot per cache line pair: no false sharing */
} dt__comm_slot;

typedef struct dt__comm_threads {
  dt_comm comm;
  dt__barrier bar;
  dt__comm_slot *slots;
  size_t slots_bytes;
} dt__comm_threads;

#define DT__COMM_BLOCK 1024

static dt__comm_threads *dt__comm_threads_of(dt_comm *c) { return (dt__comm_threads *)c->impl; }

/* Barrier that accounts the wait to the rank. */
static dt_result dt__comm_threads_meet(dt__comm_threads *t, int rank) {
  double w = 0.0;
  dt_result r = dt__barrier_wait(&t->bar, &w);
  t->slots[rank].d.st.wait_s += w;
  return r;
}

/* Publish, meet, check agreement. On success the caller does its work and
 * then dt__comm_threads_leave(). */
static dt_result dt__comm_threads_enter(dt__comm_threads *t, int rank, int op, float *buf, size_t n, int root) {
  dt__comm_slot_data *me = &t->slots[rank].d;
  me->buf = buf;
  me->n = n;
  me->op = op;
  me->root = root;
  /* An aborted collective returns DTRAIN_ERR_ABORTED without a message or a
   * log line: the rank that aborted reports the cause. */
  dt_result r = dt__comm_threads_meet(t, rank);
  if (r != DTRAIN_OK) return r;
  int world = t->comm.world;
  for (int j = 0; j < world; j++) {
    const dt__comm_slot_data *o = &t->slots[j].d;
    if (o->op != op || o->n != n || o->root != root) {
      /* Every rank sees the same slots, so every rank takes this branch;
       * leave together so that nobody rewrites its slot while it is read. */
      int bad_op = o->op;
      size_t bad_n = o->n;
      int bad_root = o->root;
      dt__comm_threads_meet(t, rank);
      if (bad_op != op)
        return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d: rank %d called %s instead", dt__comm_op_name(op),
                         rank, j, dt__comm_op_name(bad_op));
      if (bad_n != n)
        return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d passed n=%zu but rank %d passed n=%zu",
                         dt__comm_op_name(op), rank, n, j, bad_n);
      return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d passed root %d but rank %d passed root %d",
                       dt__comm_op_name(op), rank, root, j, bad_root);
    }
  }
  return DTRAIN_OK;
}

static dt_result dt__comm_threads_leave(dt__comm_threads *t, int rank, size_t n) {
  dt_result r = dt__comm_threads_meet(t, rank);
  if (r != DTRAIN_OK) return r;
  t->slots[rank].d.st.calls++;
  t->slots[rank].d.st.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

/* acc[0..m) = sum over ranks of buf_r[off..off+m), in rank order. */
static void dt__comm_threads_sum(dt__comm_threads *t, size_t off, size_t m, float *acc) {
  int world = t->comm.world;
  const float *a = t->slots[0].d.buf + off;
  if (world == 1) {
    memcpy(acc, a, m * sizeof(float));
    return;
  }
  const float *b = t->slots[1].d.buf + off;
  for (size_t i = 0; i < m; i++) acc[i] = a[i] + b[i];
  for (int r = 2; r < world; r++) {
    const float *c = t->slots[r].d.buf + off;
    for (size_t i = 0; i < m; i++) acc[i] += c[i];
  }
}

static dt_result dt__comm_threads_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_ALLREDUCE, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    for (int j = 0; j < c->world; j++) memcpy(t->slots[j].d.buf + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_REDUCE_SCATTER, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    memcpy(buf + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_ALLGATHER, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  for (int j = 0; j < c->world; j++) {
    if (j == rank) continue;
    size_t b, e;
    dt_comm_slice(n, c->world, j, &b, &e);
    if (e > b) memcpy(buf + b, t->slots[j].d.buf + b, (e - b) * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_REDUCE, buf, n, root);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  float *out = t->slots[root].d.buf;
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    memcpy(out + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_BROADCAST, buf, n, root);
  if (r != DTRAIN_OK) return r;
  const float *src = t->slots[root].d.buf;
  if (rank != root && n > 0 && src != buf) memcpy(buf, src, n * sizeof(float));
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_barrier(dt_comm *c, int rank) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  /* Two meetings like every collective, so that a rank calling barrier while
   * another calls something else is caught (MISMATCH) instead of pairing
   * meetings of different calls. */
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_BARRIER, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  return dt__comm_threads_leave(t, rank, 0);
}

static void dt__comm_threads_abort(dt_comm *c, int rank) {
  (void)rank;
  dt__barrier_break(&dt__comm_threads_of(c)->bar);
}

static dt_result dt__comm_threads_recover(dt_comm *c) {
  dt__barrier_reset(&dt__comm_threads_of(c)->bar);
  return DTRAIN_OK;
}

static void dt__comm_threads_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  *out = dt__comm_threads_of(c)->slots[rank].d.st;
}

static void dt__comm_threads_reset_stats(dt_comm *c) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  for (int j = 0; j < c->world; j++) memset(&t->slots[j].d.st, 0, sizeof(dt_comm_stats));
}

static void dt__comm_threads_destroy(dt_comm *c) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt__barrier_destroy(&t->bar);
  dt__free(t->slots, t->slots_bytes);
  dt__free(t, sizeof *t);
}

static const dt_comm_vtable dt__comm_threads_vtable = {
  "threads",
  dt__comm_threads_allreduce,
  dt__comm_threads_reduce_scatter,
  dt__comm_threads_allgather,
  dt__comm_threads_reduce,
  dt__comm_threads_broadcast,
  dt__comm_threads_barrier,
  dt__comm_threads_abort,
  dt__comm_threads_recover,
  dt__comm_threads_stats,
  dt__comm_threads_reset_stats,
  dt__comm_threads_destroy
};

DTRAIN_API dt_comm *dt_comm_create_threads(int world, int spin_us) {
  if (world < 1 || world > 256) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_comm_create_threads: world %d outside [1, 256]", world);
    return NULL;
  }
#if defined(DTRAIN_NO_DIST)
  /* Only the communicator of one rank stays: one_device's step runs on it,
   * where every collective is a no-op. */
  if (world > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED,
              "dt_comm_create_threads: world %d: communicators are compiled out (DTRAIN_NO_DIST)", world);
    return NULL;
  }
#endif
#if defined(DTRAIN_NO_THREADS)
  if (world > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_create_threads: world %d needs threads (built with DTRAIN_NO_THREADS)",
              world);
    return NULL;
  }
#endif
  dt__comm_threads *t = (dt__comm_threads *)dt__calloc(sizeof *t);
  if (!t) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_threads: out of memory");
    return NULL;
  }
  t->slots_bytes = (size_t)world * sizeof(dt__comm_slot);
  t->slots = (dt__comm_slot *)dt__calloc(t->slots_bytes);
  if (!t->slots) {
    dt__free(t, sizeof *t);
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_threads: out of memory");
    return NULL;
  }
  if (dt__barrier_init(&t->bar, world, dt__spin_seconds(spin_us, world)) != DTRAIN_OK) {
    dt__free(t->slots, t->slots_bytes);
    dt__free(t, sizeof *t);
    return NULL;
  }
  t->comm.vtable = &dt__comm_threads_vtable;
  t->comm.world = world;
  t->comm.impl = t;
  return &t->comm;
}

/* ---- front end ------------------------------------------------------------------------------ */

static dt_result dt__comm_check(dt_comm *c, const char *fn, int rank, const float *buf, size_t n, int root) {
  if (!c || !c->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: communicator is NULL", fn);
  if (rank < 0 || rank >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d outside [0, %d)", fn, rank, c->world);
  if (root < 0 || root >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d: root %d outside [0, %d)", fn, rank, root, c->world);
  if (!buf && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: rank %d: buffer is NULL (n=%zu)", fn, rank, n);
  return DTRAIN_OK;
}

DTRAIN_API void dt_comm_destroy(dt_comm *c) {
  dt__quiet_push(); /* goodbyes to peers that are gone are not news */
  if (c && c->vtable && c->vtable->destroy) c->vtable->destroy(c);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API dt_result dt_comm_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_allreduce", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->allreduce(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce_scatter", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->reduce_scatter(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_allgather", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->allgather(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->reduce(c, rank, buf, n, root));
}

DTRAIN_API dt_result dt_comm_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_broadcast", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->broadcast(c, rank, buf, n, root));
}

DTRAIN_API dt_result dt_comm_barrier(dt_comm *c, int rank) {
  dt_result r = dt__comm_check(c, "dt_comm_barrier", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->barrier(c, rank));
}

DTRAIN_API void dt_comm_abort(dt_comm *c, int rank) {
  if (c && c->vtable && c->vtable->abort) c->vtable->abort(c, rank);
}

DTRAIN_API dt_result dt_comm_recover(dt_comm *c) {
  if (!c || !c->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_recover: communicator is NULL");
  return c->vtable->recover ? c->vtable->recover(c) : DTRAIN_OK;
}

DTRAIN_API int dt_comm_world(const dt_comm *c) { return c ? c->world : 0; }
DTRAIN_API int dt_comm_rank(const dt_comm *c) { return c ? c->rank : 0; }

DTRAIN_API const char *dt_comm_name(const dt_comm *c) {
  return (c && c->vtable && c->vtable->name) ? c->vtable->name : "none";
}

DTRAIN_API dt_result dt_comm_stats_get(dt_comm *c, int rank, dt_comm_stats *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_stats_get: out is NULL");
  memset(out, 0, sizeof *out);
  dt_result r = dt__comm_check(c, "dt_comm_stats_get", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  if (c->vtable->stats) c->vtable->stats(c, rank, out);
  return DTRAIN_OK;
}

DTRAIN_API void dt_comm_reset_stats(dt_comm *c) {
  if (c && c->vtable && c->vtable->reset_stats) c->vtable->reset_stats(c);
}

#undef DT__COMM_BLOCK
