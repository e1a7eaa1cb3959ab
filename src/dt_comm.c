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
#include "dt_comm_core.h"

enum {
  DT__COMM_OP_ALLREDUCE = 1,
  DT__COMM_OP_REDUCE_SCATTER,
  DT__COMM_OP_ALLGATHER,
  DT__COMM_OP_REDUCE,
  DT__COMM_OP_BROADCAST,
  DT__COMM_OP_BARRIER,
  DT__COMM_OP_SPLIT
};

static const char *dt__comm_op_name(int op) {
  switch (op) {
    case DT__COMM_OP_ALLREDUCE: return "allreduce";
    case DT__COMM_OP_REDUCE_SCATTER: return "reduce_scatter";
    case DT__COMM_OP_ALLGATHER: return "allgather";
    case DT__COMM_OP_REDUCE: return "reduce";
    case DT__COMM_OP_BROADCAST: return "broadcast";
    case DT__COMM_OP_BARRIER: return "barrier";
    case DT__COMM_OP_SPLIT: return "split";
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
  int color, key;  /* dt_comm_split's arguments */
  dt_comm *child;  /* the group a split's lowest rank of a colour made */
  int finite;      /* dt__comm_reduce_scatter_finite: this rank's slice of the sum is */
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
  int spin_us;
  DT__ATOMIC(int) refs; /* 1, or a group's size: the last member's destroy frees it */
  /* Point-to-point: sends not yet taken and receives not yet matched (FIFO,
   * every rank's), under pm; pc wakes the waiters. */
  dt__mutex pm;
  dt__cond pc;
  dt_comm_request *sends, *recvs;
  int p2p_broken;
} dt__comm_threads;

#define DT__COMM_BLOCK 1024

static dt__comm_threads *dt__comm_threads_of(dt_comm *c) { return (dt__comm_threads *)c->impl; }

/* Barrier that accounts the wait to the rank. */
static dt_result dt__comm_threads_meet(dt__comm_threads *t, int rank) {
  double w = 0.0;
  dt_result r = dt__barrier_wait(&t->bar, &w);
  t->slots[rank].d.st.wait_s += w;
  dt__trace_wait("barrier wait", w);
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
  dt__vec_add(acc, a, t->slots[1].d.buf + off, m);
  for (int r = 2; r < world; r++) dt__vec_add(acc, acc, t->slots[r].d.buf + off, m);
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
  if (c->world == 2) { /* in place: the same sum (rank 0's + rank 1's), one pass less */
    if (e > b) dt__vec_add(buf + b, t->slots[0].d.buf + b, t->slots[1].d.buf + b, e - b);
    return dt__comm_threads_leave(t, rank, n);
  }
  float acc[DT__COMM_BLOCK];
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    memcpy(buf + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

/* 1 when no element of x[0..n) is infinite or NaN (exponent bits checked, as
 * integers). */
static int dt__comm_all_finite(const float *x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, x + i, sizeof u);
    bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
  }
  return !bad;
}

/* The reduce-scatter above, each rank checking its slice of the sum as it
 * makes it (two ranks: in the sum's own pass) and leaving its answer in its
 * slot before the closing meet; after it every rank reads them all. (A rank
 * reads the others' answers before its next collective's first meet, and
 * nobody writes one again before that meet: no race.) */
static dt_result dt__comm_threads_reduce_scatter_finite(dt_comm *c, int rank, float *buf, size_t n, int *finite,
                                                        int handoff) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_REDUCE_SCATTER, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  int ok = 1;
  if (c->world == 2 && handoff) { /* block by block: each block copied while it is in L1 */
    float *peer = t->slots[1 - rank].d.buf;
    for (size_t off = b; off < e; off += DT__COMM_BLOCK) {
      size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
      ok &= dt__vec_add_finite(buf + off, t->slots[0].d.buf + off, t->slots[1].d.buf + off, m);
      memcpy(peer + off, buf + off, m * sizeof(float));
    }
  } else if (c->world == 2) {
    if (e > b) ok = dt__vec_add_finite(buf + b, t->slots[0].d.buf + b, t->slots[1].d.buf + b, e - b);
  } else {
    float acc[DT__COMM_BLOCK];
    for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
      size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
      dt__comm_threads_sum(t, off, m, acc);
      memcpy(buf + off, acc, m * sizeof(float));
    }
    ok = dt__comm_all_finite(buf + b, e - b);
  }
  t->slots[rank].d.finite = ok;
  r = dt__comm_threads_leave(t, rank, n);
  if (r != DTRAIN_OK) return r;
  for (int j = 0; j < c->world; j++) ok &= t->slots[j].d.finite;
  *finite = ok;
  return DTRAIN_OK;
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
  dt__comm_threads *t = dt__comm_threads_of(c);
  (void)rank;
  dt__barrier_break(&t->bar);
  dt__mutex_lock(&t->pm);
  t->p2p_broken = 1;
  dt__cond_broadcast(&t->pc);
  dt__mutex_unlock(&t->pm);
}

static dt_result dt__comm_threads_recover(dt_comm *c) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt__barrier_reset(&t->bar);
  dt__mutex_lock(&t->pm);
  t->p2p_broken = 0;
  dt__mutex_unlock(&t->pm);
  return DTRAIN_OK;
}

static void dt__comm_threads_free(dt__comm_threads *t);

/* ---- point-to-point between threads ----------------------------------------------------------
 * Rendezvous: a send waits in t->sends until its receive is posted (or the
 * other way round); whoever comes second copies the floats straight from the
 * sender's buffer into the receiver's, under pm, and finishes both. */

/* Unlink r from *list (if there). */
static void dt__comm_threads_unlink(dt_comm_request **list, dt_comm_request *r) {
  for (dt_comm_request **p = list; *p; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      r->next = NULL;
      return;
    }
}

static void dt__comm_threads_append(dt_comm_request **list, dt_comm_request *r) {
  dt_comm_request **p = list;
  while (*p) p = &(*p)->next;
  r->next = NULL;
  *p = r;
}

/* The message of send s goes into receive r (both unlinked); under pm. */
static void dt__comm_threads_deliver(dt__comm_threads *t, dt_comm_request *s, dt_comm_request *r) {
  s->done = 1;
  s->rc = DTRAIN_OK;
  if (s->n == r->n) {
    if (r->n) memcpy(r->buf, s->buf, r->n * sizeof(float));
    r->rc = DTRAIN_OK;
  } else {
    r->rc = DTRAIN_ERR_MISMATCH;
    snprintf(r->why, sizeof r->why,
             "dt_comm_recv: rank %d: the message from rank %d (tag %u) has %zu floats, the receive wants %zu",
             r->rank, r->peer, (unsigned)r->tag, s->n, r->n);
  }
  r->done = 1;
  dt__cond_broadcast(&t->pc);
}

static dt_result dt__comm_threads_post(dt_comm *c, int send, int rank, int peer, int tag, float *buf, size_t n,
                                       dt_comm_request **req) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_comm_request *me = dt__req_new(c, sizeof(dt_comm_request), send, rank, peer, (uint32_t)tag, buf, n);
  if (!me) return DTRAIN_ERR_NOMEM;
  dt__mutex_lock(&t->pm);
  if (t->p2p_broken) {
    dt__mutex_unlock(&t->pm);
    dt__req_free(me);
    return DTRAIN_ERR_ABORTED;
  }
  /* The first waiting counterpart, in the order they were posted. */
  dt_comm_request **other = send ? &t->recvs : &t->sends, *o = *other;
  while (o && !(o->rank == peer && o->peer == rank && o->tag == (uint32_t)tag)) o = o->next;
  if (o) {
    dt__comm_threads_unlink(other, o);
    if (send) dt__comm_threads_deliver(t, me, o);
    else dt__comm_threads_deliver(t, o, me);
  } else {
    dt__comm_threads_append(send ? &t->sends : &t->recvs, me);
  }
  dt__mutex_unlock(&t->pm);
  *req = me;
  return DTRAIN_OK;
}

static dt_result dt__comm_threads_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                        dt_comm_request **req) {
  return dt__comm_threads_post(c, 1, rank, dst, tag, (float *)(uintptr_t)buf, n, req);
}

static dt_result dt__comm_threads_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                        dt_comm_request **req) {
  return dt__comm_threads_post(c, 0, rank, src, tag, buf, n, req);
}

static dt_result dt__comm_threads_wait(dt_comm *c, dt_comm_request *r) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result rc = DTRAIN_OK;
  dt__mutex_lock(&t->pm);
  while (!r->done) {
    if (t->p2p_broken) {
      rc = DTRAIN_ERR_ABORTED;
      break;
    }
    if (r->peer == r->rank) {
      /* Only this thread could post the counterpart: it never will. */
      rc = dt__error(DTRAIN_ERR_STATE, "dt_comm_wait: rank %d: a %s to itself (tag %u) without its %s posted first "
                     "would wait forever", r->rank, r->send ? "send" : "receive", (unsigned)r->tag,
                     r->send ? "receive" : "send");
      break;
    }
    dt__cond_wait(&t->pc, &t->pm);
  }
  if (!r->done) {
    dt__comm_threads_unlink(r->send ? &t->sends : &t->recvs, r);
  } else if (r->rc != DTRAIN_OK) {
    rc = dt__error(r->rc, "%s", r->why);
  }
  dt__mutex_unlock(&t->pm);
  dt__req_free(r);
  return rc;
}

/* ---- groups of threads: each colour gets a threads communicator of its own ------------------ */

static dt_result dt__comm_threads_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt__comm_slot_data *me = &t->slots[rank].d;
  me->color = color;
  me->key = key;
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_SPLIT, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  /* Every slot's colour and key is visible now. The lowest rank of a colour
   * makes its group; the others read it after the second meeting. */
  int world = c->world, lead = -1, size = 0, pos = 0;
  for (int j = 0; j < world && color >= 0; j++) {
    const dt__comm_slot_data *o = &t->slots[j].d;
    if (o->color != color) continue;
    if (lead < 0) lead = j;
    size++;
    if (o->key < key || (o->key == key && j < rank)) pos++;
  }
  dt_result made = DTRAIN_OK;
  if (lead == rank) {
    me->child = dt_comm_create_threads(size, t->spin_us);
    if (me->child) DT__ASTORE(&dt__comm_threads_of(me->child)->refs, size, DT__MO_RELAXED);
    else made = dt_last_result();
  }
  r = dt__comm_threads_leave(t, rank, 0);
  if (r != DTRAIN_OK) {
    if (lead == rank && me->child) {
      dt__comm_threads_free(dt__comm_threads_of(me->child));
      me->child = NULL;
    }
    return r;
  }
  if (color < 0) return DTRAIN_OK;
  dt_comm *g = t->slots[lead].d.child;
  if (!g) {
    if (made != DTRAIN_OK) return made;
    return dt__error(DTRAIN_ERR_NOMEM, "dt_comm_split: rank %d: rank %d could not make the group of colour %d",
                     rank, lead, color);
  }
  *out = g;
  if (out_rank) *out_rank = pos;
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
  /* A group is destroyed by each member: the last one frees it. */
  if (DT__AFETCH_SUB(&t->refs, 1, DT__MO_ACQ_REL) > 1) return;
  dt__comm_threads_free(t);
}

static void dt__comm_threads_free(dt__comm_threads *t) {
  dt__cond_destroy(&t->pc);
  dt__mutex_destroy(&t->pm);
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

static const dt_comm_p2p_vtable dt__comm_threads_p2p = {dt__comm_threads_isend, dt__comm_threads_irecv,
                                                        dt__comm_threads_wait, dt__comm_threads_split};

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
  if (dt__mutex_init(&t->pm) != DTRAIN_OK || dt__cond_init(&t->pc) != DTRAIN_OK) {
    dt__barrier_destroy(&t->bar);
    dt__free(t->slots, t->slots_bytes);
    dt__free(t, sizeof *t);
    return NULL;
  }
  t->spin_us = spin_us;
  DT__ASTORE(&t->refs, 1, DT__MO_RELAXED);
  t->comm.vtable = &dt__comm_threads_vtable;
  t->comm.p2p = &dt__comm_threads_p2p;
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
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->allreduce(c, rank, buf, n));
  dt__prof_add("dt_comm_allreduce", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_comm_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce_scatter", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->reduce_scatter(c, rank, buf, n));
  dt__prof_add("dt_comm_reduce_scatter", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_PRIVATE dt_result dt__comm_reduce_scatter_finite(dt_comm *c, int rank, float *buf, size_t n, int *finite,
                                                        int handoff) {
  *finite = 0;
  if (!c || c->vtable != &dt__comm_threads_vtable) return dt_comm_reduce_scatter(c, rank, buf, n);
  dt_result r = dt__comm_check(c, "dt_comm_reduce_scatter", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(dt__comm_threads_reduce_scatter_finite(c, rank, buf, n, finite, handoff));
  dt__prof_add("dt_comm_reduce_scatter", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_comm_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_allgather", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->allgather(c, rank, buf, n));
  dt__prof_add("dt_comm_allgather", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_comm_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->reduce(c, rank, buf, n, root));
  dt__prof_add("dt_comm_reduce", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_comm_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_broadcast", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->broadcast(c, rank, buf, n, root));
  dt__prof_add("dt_comm_broadcast", DTRAIN_PROFILE_COMM, t0);
  return r;
}

DTRAIN_API dt_result dt_comm_barrier(dt_comm *c, int rank) {
  dt_result r = dt__comm_check(c, "dt_comm_barrier", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  int64_t t0 = dt__prof_t0();
  dt__quiet_push();
  r = dt__quiet_pop(c->vtable->barrier(c, rank));
  dt__prof_add("dt_comm_barrier", DTRAIN_PROFILE_COMM, t0);
  return r;
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

/* ---- point-to-point and groups: requests and the front end --------------------------------- */

DTRAIN_PRIVATE dt_comm_request *dt__req_new(dt_comm *c, size_t bytes, int send, int rank, int peer, uint32_t tag,
                                            float *buf, size_t n) {
  dt_comm_request *r = (dt_comm_request *)dt__calloc(bytes);
  if (!r) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_%s: rank %d: out of memory for a request", send ? "isend" : "irecv", rank);
    return NULL;
  }
  r->comm = c;
  r->bytes = bytes;
  r->send = send;
  r->rank = rank;
  r->peer = peer;
  r->tag = tag;
  r->buf = buf;
  r->n = n;
  return r;
}

DTRAIN_PRIVATE void dt__req_free(dt_comm_request *r) {
  if (r) dt__free(r, r->bytes);
}

DTRAIN_PRIVATE void dt__req_fail(dt_comm_request *r, dt_result rc) {
  r->done = 1;
  r->rc = rc;
  snprintf(r->why, sizeof r->why, "%s", rc == DTRAIN_OK ? "" : dt_last_error());
}

static dt_result dt__comm_p2p_check(dt_comm *c, const char *fn, int rank, int peer, int tag, const float *buf,
                                    size_t n, dt_comm_request **req) {
  if (req) *req = NULL;
  if (!c || !c->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: communicator is NULL", fn);
  if (!req) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: req is NULL", fn);
  if (!c->p2p || !c->p2p->isend || !c->p2p->irecv || !c->p2p->wait)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: the %s communicator has no point-to-point messages", fn,
                     dt_comm_name(c));
  if (rank < 0 || rank >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d outside [0, %d)", fn, rank, c->world);
  if (peer < 0 || peer >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d: peer %d outside [0, %d)", fn, rank, peer, c->world);
  if (tag < 0 || tag > DT_COMM_TAG_MAX)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: rank %d: tag %d outside [0, %d]", fn, rank, tag, DT_COMM_TAG_MAX);
  if (!buf && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: rank %d: buffer is NULL (n=%zu)", fn, rank, n);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_comm_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                   dt_comm_request **req) {
  dt_result r = dt__comm_p2p_check(c, "dt_comm_isend", rank, dst, tag, buf, n, req);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->p2p->isend(c, rank, dst, tag, buf, n, req));
}

DTRAIN_API dt_result dt_comm_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                   dt_comm_request **req) {
  dt_result r = dt__comm_p2p_check(c, "dt_comm_irecv", rank, src, tag, buf, n, req);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->p2p->irecv(c, rank, src, tag, buf, n, req));
}

DTRAIN_API dt_result dt_comm_wait(dt_comm_request *req) {
  if (!req) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_wait: req is NULL");
  dt_comm *c = req->comm;
  dt__quiet_push();
  return dt__quiet_pop(c->p2p->wait(c, req));
}

DTRAIN_API dt_result dt_comm_waitall(dt_comm_request **reqs, int n) {
  if (!reqs && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_waitall: reqs is NULL");
  dt_result first = DTRAIN_OK;
  char why[DT__MSG_CAP];
  why[0] = '\0';
  for (int i = 0; i < n; i++) {
    if (!reqs[i]) continue;
    dt_result r = dt_comm_wait(reqs[i]);
    reqs[i] = NULL;
    if (r != DTRAIN_OK && first == DTRAIN_OK) {
      first = r;
      snprintf(why, sizeof why, "%s", dt_last_error());
    }
  }
  /* The first error's text again (the later waits may have overwritten it);
   * ABORTED comes without one. */
  if (first != DTRAIN_OK && first != DTRAIN_ERR_ABORTED) return dt__error(first, "%s", why);
  return first;
}

DTRAIN_API dt_result dt_comm_send(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n) {
  dt_comm_request *q = NULL;
  dt_result r = dt_comm_isend(c, rank, dst, tag, buf, n, &q);
  return r == DTRAIN_OK ? dt_comm_wait(q) : r;
}

DTRAIN_API dt_result dt_comm_recv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n) {
  dt_comm_request *q = NULL;
  dt_result r = dt_comm_irecv(c, rank, src, tag, buf, n, &q);
  return r == DTRAIN_OK ? dt_comm_wait(q) : r;
}

DTRAIN_API dt_result dt_comm_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank) {
  if (out) *out = NULL;
  if (out_rank) *out_rank = -1;
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_split: out is NULL");
  dt_result r = dt__comm_check(c, "dt_comm_split", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  if (!c->p2p || !c->p2p->split)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_split: the %s communicator cannot be split", dt_comm_name(c));
  dt__quiet_push();
  return dt__quiet_pop(c->p2p->split(c, rank, color < 0 ? -1 : color, key, out, out_rank));
}

/* ---- layouts -------------------------------------------------------------------------------- */

DTRAIN_API void dt_layout_destroy(dt_layout *l) {
  if (!l) return;
  dt_comm_destroy(l->pp);
  dt_comm_destroy(l->tp);
  dt_comm_destroy(l->dp);
  l->pp = l->tp = l->dp = NULL;
}

DTRAIN_API dt_result dt_layout_create(dt_comm *c, int rank, int pipeline, int tensor, dt_layout *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_layout_create: out is NULL");
  memset(out, 0, sizeof *out);
  dt_result r = dt__comm_check(c, "dt_layout_create", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  int W = c->world;
  if (pipeline < 1 || tensor < 1 || W % pipeline != 0 || (W / pipeline) % tensor != 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG,
                     "dt_layout_create: %d ranks do not make %d pipeline stages x %d tensor-parallel ranks x "
                     "data-parallel replicas", W, pipeline, tensor);
  int P = pipeline, T = tensor, R = W / (P * T);
  int t = rank % T, d = (rank / T) % R, p = rank / (T * R);
  out->pipeline = P;
  out->tensor = T;
  out->data = R;
  out->stage = p;
  out->tp_rank = t;
  out->dp_rank = d;
  int got = -1;
  r = dt_comm_split(c, rank, d * T + t, p, &out->pp, &got);
  if (r == DTRAIN_OK) r = dt_comm_split(c, rank, p * R + d, t, &out->tp, &got);
  if (r == DTRAIN_OK) r = dt_comm_split(c, rank, p * T + t, d, &out->dp, &got);
  if (r != DTRAIN_OK) dt_layout_destroy(out);
  return r;
}

#undef DT__COMM_BLOCK
