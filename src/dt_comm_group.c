/* ===========================================================================
 * dt_comm_group.c -- a group communicator built from point-to-point
 * messages: what dt_comm_split makes on backends without groups of their own
 * (tcp), over the base communicator's connections
 * ===========================================================================
 * A group is a list of base ranks and a context: a 64-bit number every
 * message of the group carries, so that its traffic never meets the base's
 * or another group's. Contexts are derived from the parent's context, the
 * number of splits the parent has made and the colour (FNV-1a), the same on
 * every member without any communication.
 *
 * Collectives, each started by an agreement: every member sends every other
 * its (op, root, n, call number) with DT__TAG_CALL and compares what it gets,
 * so disagreement is DTRAIN_ERR_MISMATCH on every member, and the group stays
 * usable. Then the data, with DT__TAG_DATA:
 *   reduce_scatter  member j gets everyone's slice j (dt_comm_slice) and sums
 *                   them in rank order (rank 0 + rank 1 + ...: the threads
 *                   backend's order, so the two agree bitwise)
 *   allgather       every member sends its slice to every other
 *   allreduce       the two
 *   reduce          everyone sends the root its buffer; the root sums in rank order
 *   broadcast       the root sends everyone its buffer
 *   barrier         the agreement alone
 * Every message of a call is posted before any is waited on, so no member
 * waits for another's receive. Direct exchanges: (g-1) messages per member
 * and call, which suits the small groups of model parallelism (a tensor- or
 * pipeline-parallel group of 2-8 members).
 *
 * Failure: the base's. A transport error breaks the base communicator (and so
 * every group on it); dt_comm_abort on a group aborts the base.
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

#if !defined(DTRAIN_NO_DIST)

enum { DT__G_ALLREDUCE = 1, DT__G_REDUCE_SCATTER, DT__G_ALLGATHER, DT__G_REDUCE, DT__G_BROADCAST, DT__G_BARRIER };

typedef struct dt__comm_group {
  dt_comm comm;
  dt_comm *base;
  const dt__p2p_ops *ops;
  uint64_t ctx;
  uint64_t splits;
  uint64_t seq; /* collectives called */
  int *members; /* base rank of each group rank */
  dt_comm_stats st;
  /* Kept between calls (a tensor-parallel step makes several collectives):
   * the requests of one call (2 per member) and float scratch, grown on demand. */
  dt_comm_request **q;
  float *scr;
  size_t scr_bytes;
} dt__comm_group;

static dt__comm_group *dt__group_of(dt_comm *c) { return (dt__comm_group *)c->impl; }

static const char *dt__group_op_name(int op) {
  static const char *const names[] = {"?", "allreduce", "reduce_scatter", "allgather", "reduce", "broadcast",
                                      "barrier"};
  return op >= 1 && op <= 6 ? names[op] : names[0];
}

/* The group's request slots (all NULL) and at least `floats` floats of scratch. */
static dt_result dt__group_bufs(dt__comm_group *g, size_t floats, float **scr, const char *op) {
  memset(g->q, 0, (size_t)g->comm.world * 2 * sizeof(dt_comm_request *));
  size_t bytes = (floats ? floats : 1) * sizeof(float);
  if (bytes > g->scr_bytes) {
    dt__free(g->scr, g->scr_bytes);
    g->scr_bytes = 0;
    g->scr = (float *)dt__alloc(bytes);
    if (!g->scr) return dt__error(DTRAIN_ERR_NOMEM, "dt_comm_%s: rank %d: out of memory", op, g->comm.rank);
    g->scr_bytes = bytes;
  }
  if (scr) *scr = g->scr;
  return DTRAIN_OK;
}

/* Wait for every request of q (n of them); the first error wins. */
static dt_result dt__group_waitall(dt_comm_request **q, int n) { return dt_comm_waitall(q, n); }

static dt_result dt__group_rank_ok(dt__comm_group *g, int rank, const char *what) {
  if (rank != g->comm.rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_%s: called with rank %d, but this member is rank %d of its group",
                     what, rank, g->comm.rank);
  if (g->ops->broken(g->base)) return DTRAIN_ERR_ABORTED;
  return DTRAIN_OK;
}

/* The agreement round of a collective (see the top of the file). */
static dt_result dt__group_enter(dt__comm_group *g, int rank, int op, size_t n, int root) {
  dt_result rc = dt__group_rank_ok(g, rank, dt__group_op_name(op));
  if (rc != DTRAIN_OK) return rc;
  g->seq++;
  int world = g->comm.world, me = g->comm.rank;
  if (world == 1) return DTRAIN_OK;
  /* Four u32 words as floats' bits: op, root, n (two halves); the call number too. */
  uint32_t mine[6] = {(uint32_t)op, (uint32_t)root, (uint32_t)((uint64_t)n & 0xffffffffu),
                      (uint32_t)((uint64_t)n >> 32), (uint32_t)(g->seq & 0xffffffffu), (uint32_t)(g->seq >> 32)};
  float *tf = NULL;
  rc = dt__group_bufs(g, (size_t)world * 6, &tf, dt__group_op_name(op));
  if (rc != DTRAIN_OK) return rc;
  uint32_t *theirs = (uint32_t *)(void *)tf;
  dt_comm_request **q = g->q;
  float mf[6];
  memcpy(mf, mine, sizeof mf);
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    rc = g->ops->irecv(g->base, g->ctx, g->members[j], DT__TAG_CALL, (float *)(void *)(theirs + 6 * j), 6, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
    if (rc == DTRAIN_OK) rc = g->ops->isend(g->base, g->ctx, g->members[j], DT__TAG_CALL, mf, 6, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt__group_waitall(q, nq);
  if (rc == DTRAIN_OK) rc = wr;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    const uint32_t *o = theirs + 6 * j;
    if (memcmp(o, mine, sizeof mine) == 0) continue;
    uint64_t on = (uint64_t)o[2] | ((uint64_t)o[3] << 32);
    if (o[0] != (uint32_t)op)
      rc = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d of the group: rank %d called %s instead",
                     dt__group_op_name(op), me, j, dt__group_op_name((int)o[0]));
    else if (on != (uint64_t)n)
      rc = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d of the group passed n=%zu but rank %d passed n=%llu",
                     dt__group_op_name(op), me, n, j, (unsigned long long)on);
    else if (o[1] != (uint32_t)root)
      rc = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d of the group passed root %d but rank %d passed root %u",
                     dt__group_op_name(op), me, root, j, (unsigned)o[1]);
    else
      rc = dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d of the group is at call #%llu, rank %d at #%llu",
                     dt__group_op_name(op), me, (unsigned long long)g->seq, j,
                     (unsigned long long)((uint64_t)o[4] | ((uint64_t)o[5] << 32)));
  }
  return rc;
}

static dt_result dt__group_leave(dt__comm_group *g, dt_result rc, size_t n, double t0) {
  g->st.wait_s += dt__now() - t0;
  if (rc != DTRAIN_OK) return rc;
  g->st.calls++;
  g->st.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

/* Everyone's slice `me` of buf summed in rank order into buf (reduce-scatter's data phase). */
static dt_result dt__group_rs(dt__comm_group *g, float *buf, size_t n) {
  int world = g->comm.world, me = g->comm.rank;
  size_t b, e;
  dt_comm_slice(n, world, me, &b, &e);
  size_t m = e - b;
  float *in = NULL;
  dt_result rc = dt__group_bufs(g, (size_t)world * m, &in, "reduce_scatter");
  if (rc != DTRAIN_OK) return rc;
  dt_comm_request **q = g->q;
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    size_t jb, je;
    dt_comm_slice(n, world, j, &jb, &je);
    rc = g->ops->irecv(g->base, g->ctx, g->members[j], DT__TAG_DATA, in + (size_t)j * m, m, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
    if (rc == DTRAIN_OK) rc = g->ops->isend(g->base, g->ctx, g->members[j], DT__TAG_DATA, buf + jb, je - jb, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt__group_waitall(q, nq);
  if (rc == DTRAIN_OK) rc = wr;
  if (rc == DTRAIN_OK && m > 0) {
    memcpy(in + (size_t)me * m, buf + b, m * sizeof(float));
    float *acc = buf + b;
    dt__vec_add(acc, in, in + m, m);
    for (int j = 2; j < world; j++) dt__vec_add(acc, acc, in + (size_t)j * m, m);
  }
  return rc;
}

/* Every member's slice into everyone's buf (all-gather's data phase). */
static dt_result dt__group_ag(dt__comm_group *g, float *buf, size_t n) {
  int world = g->comm.world, me = g->comm.rank;
  size_t b, e;
  dt_comm_slice(n, world, me, &b, &e);
  dt_result rc = dt__group_bufs(g, 0, NULL, "allgather");
  if (rc != DTRAIN_OK) return rc;
  dt_comm_request **q = g->q;
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    size_t jb, je;
    dt_comm_slice(n, world, j, &jb, &je);
    rc = g->ops->irecv(g->base, g->ctx, g->members[j], DT__TAG_DATA, buf + jb, je - jb, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
    if (rc == DTRAIN_OK) rc = g->ops->isend(g->base, g->ctx, g->members[j], DT__TAG_DATA, buf + b, e - b, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt__group_waitall(q, nq);
  return rc == DTRAIN_OK ? wr : rc;
}

static dt_result dt__group_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  dt_result rc = dt__group_enter(g, rank, DT__G_ALLREDUCE, n, 0);
  if (rc == DTRAIN_OK && c->world > 1) rc = dt__group_rs(g, buf, n);
  if (rc == DTRAIN_OK && c->world > 1) rc = dt__group_ag(g, buf, n);
  return dt__group_leave(g, rc, n, t0);
}

static dt_result dt__group_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  dt_result rc = dt__group_enter(g, rank, DT__G_REDUCE_SCATTER, n, 0);
  if (rc == DTRAIN_OK && c->world > 1) rc = dt__group_rs(g, buf, n);
  return dt__group_leave(g, rc, n, t0);
}

static dt_result dt__group_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  dt_result rc = dt__group_enter(g, rank, DT__G_ALLGATHER, n, 0);
  if (rc == DTRAIN_OK && c->world > 1) rc = dt__group_ag(g, buf, n);
  return dt__group_leave(g, rc, n, t0);
}

static dt_result dt__group_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  dt_result rc = dt__group_enter(g, rank, DT__G_REDUCE, n, root);
  int world = c->world, me = c->rank;
  if (rc != DTRAIN_OK || world == 1) return dt__group_leave(g, rc, n, t0);
  if (me != root) {
    dt_comm_request *q = NULL;
    rc = g->ops->isend(g->base, g->ctx, g->members[root], DT__TAG_DATA, buf, n, &q);
    if (rc == DTRAIN_OK) rc = dt_comm_wait(q);
    return dt__group_leave(g, rc, n, t0);
  }
  float *in = NULL;
  rc = dt__group_bufs(g, (size_t)world * n, &in, "reduce");
  if (rc != DTRAIN_OK) return dt__group_leave(g, rc, n, t0);
  dt_comm_request **q = g->q;
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    rc = g->ops->irecv(g->base, g->ctx, g->members[j], DT__TAG_DATA, in + (size_t)j * n, n, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt__group_waitall(q, nq);
  if (rc == DTRAIN_OK) rc = wr;
  if (rc == DTRAIN_OK && n > 0) {
    memcpy(in + (size_t)me * n, buf, n * sizeof(float));
    for (size_t i = 0; i < n; i++) buf[i] = in[i] + in[n + i];
    for (int j = 2; j < world; j++)
      for (size_t i = 0; i < n; i++) buf[i] += in[(size_t)j * n + i];
  }
  return dt__group_leave(g, rc, n, t0);
}

static dt_result dt__group_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  dt_result rc = dt__group_enter(g, rank, DT__G_BROADCAST, n, root);
  int world = c->world, me = c->rank;
  if (rc != DTRAIN_OK || world == 1) return dt__group_leave(g, rc, n, t0);
  if (me != root) {
    dt_comm_request *q = NULL;
    rc = g->ops->irecv(g->base, g->ctx, g->members[root], DT__TAG_DATA, buf, n, &q);
    if (rc == DTRAIN_OK) rc = dt_comm_wait(q);
    return dt__group_leave(g, rc, n, t0);
  }
  rc = dt__group_bufs(g, 0, NULL, "broadcast");
  if (rc != DTRAIN_OK) return dt__group_leave(g, rc, n, t0);
  dt_comm_request **q = g->q;
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    rc = g->ops->isend(g->base, g->ctx, g->members[j], DT__TAG_DATA, buf, n, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt__group_waitall(q, nq);
  return dt__group_leave(g, rc == DTRAIN_OK ? wr : rc, n, t0);
}

static dt_result dt__group_barrier(dt_comm *c, int rank) {
  dt__comm_group *g = dt__group_of(c);
  double t0 = dt__now();
  return dt__group_leave(g, dt__group_enter(g, rank, DT__G_BARRIER, 0, 0), 0, t0);
}

static void dt__group_abort(dt_comm *c, int rank) {
  dt__comm_group *g = dt__group_of(c);
  (void)rank;
  g->ops->abort(g->base);
}

static dt_result dt__group_recover(dt_comm *c) {
  dt__comm_group *g = dt__group_of(c);
  if (!g->ops->broken(g->base)) return DTRAIN_OK;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_recover: a group of a broken %s communicator cannot be repaired",
                   dt_comm_name(g->base));
}

static void dt__group_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  *out = dt__group_of(c)->st;
}

static void dt__group_reset_stats(dt_comm *c) { memset(&dt__group_of(c)->st, 0, sizeof(dt_comm_stats)); }

static void dt__group_destroy(dt_comm *c) {
  dt__comm_group *g = dt__group_of(c);
  dt__free(g->members, (size_t)c->world * sizeof(int));
  dt__free(g->q, (size_t)c->world * 2 * sizeof(dt_comm_request *));
  dt__free(g->scr, g->scr_bytes);
  dt__free(g, sizeof *g);
}

static dt_result dt__group_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                 dt_comm_request **req) {
  dt__comm_group *g = dt__group_of(c);
  dt_result rc = dt__group_rank_ok(g, rank, "isend");
  if (rc != DTRAIN_OK) return rc;
  return g->ops->isend(g->base, g->ctx, g->members[dst], (uint32_t)tag, buf, n, req);
}

static dt_result dt__group_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                 dt_comm_request **req) {
  dt__comm_group *g = dt__group_of(c);
  dt_result rc = dt__group_rank_ok(g, rank, "irecv");
  if (rc != DTRAIN_OK) return rc;
  return g->ops->irecv(g->base, g->ctx, g->members[src], (uint32_t)tag, buf, n, req);
}

/* Requests belong to the base communicator: dt_comm_wait never comes here. */
static dt_result dt__group_wait(dt_comm *c, dt_comm_request *req) {
  (void)c;
  return req->comm->p2p->wait(req->comm, req);
}

static dt_result dt__group_split_call(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank) {
  dt__comm_group *g = dt__group_of(c);
  dt_result rc = dt__group_rank_ok(g, rank, "split");
  if (rc != DTRAIN_OK) return rc;
  return dt__group_split(g->base, g->ops, g->ctx, &g->splits, g->members, c->world, c->rank, color, key, out,
                         out_rank);
}

static const dt_comm_vtable dt__comm_group_vtable = {
  "group",
  dt__group_allreduce,
  dt__group_reduce_scatter,
  dt__group_allgather,
  dt__group_reduce,
  dt__group_broadcast,
  dt__group_barrier,
  dt__group_abort,
  dt__group_recover,
  dt__group_stats,
  dt__group_reset_stats,
  dt__group_destroy
};

static const dt_comm_p2p_vtable dt__comm_group_p2p = {dt__group_isend, dt__group_irecv, dt__group_wait,
                                                      dt__group_split_call};

DTRAIN_PRIVATE dt_result dt__group_split(dt_comm *base, const dt__p2p_ops *ops, uint64_t ctx, uint64_t *splits,
                                         const int *members, int world, int me, int color, int key, dt_comm **out,
                                         int *out_rank) {
  /* Everyone's colour and key (as floats' bits), from everyone. */
  size_t ab = (size_t)world * 2 * sizeof(int32_t), qb = (size_t)world * 2 * sizeof(void *);
  int32_t *all = (int32_t *)dt__alloc(ab);
  dt_comm_request **q = (dt_comm_request **)dt__calloc(qb);
  if (!all || !q) {
    dt__free(all, ab);
    dt__free(q, qb);
    return dt__error(DTRAIN_ERR_NOMEM, "dt_comm_split: rank %d: out of memory", me);
  }
  all[2 * me] = color;
  all[2 * me + 1] = key;
  float mine[2];
  memcpy(mine, all + 2 * me, sizeof mine);
  dt_result rc = DTRAIN_OK;
  int nq = 0;
  for (int j = 0; j < world && rc == DTRAIN_OK; j++) {
    if (j == me) continue;
    int bj = members ? members[j] : j;
    rc = ops->irecv(base, ctx, bj, DT__TAG_SPLIT, (float *)(void *)(all + 2 * j), 2, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
    if (rc == DTRAIN_OK) rc = ops->isend(base, ctx, bj, DT__TAG_SPLIT, mine, 2, &q[nq]);
    if (rc == DTRAIN_OK) nq++;
  }
  dt_result wr = dt_comm_waitall(q, nq);
  if (rc == DTRAIN_OK) rc = wr;
  dt__free(q, qb);
  uint64_t nsplit = ++*splits;
  if (rc != DTRAIN_OK || color < 0) {
    dt__free(all, ab);
    return rc;
  }
  /* The members of my colour ordered by (key, rank). */
  int size = 0, pos = 0;
  for (int j = 0; j < world; j++) {
    if (all[2 * j] != color) continue;
    size++;
    if (all[2 * j + 1] < key || (all[2 * j + 1] == key && j < me)) pos++;
  }
  dt__comm_group *g = (dt__comm_group *)dt__calloc(sizeof *g);
  int *mem = (int *)dt__alloc((size_t)size * sizeof(int));
  dt_comm_request **rq = (dt_comm_request **)dt__calloc((size_t)size * 2 * sizeof(dt_comm_request *));
  if (!g || !mem || !rq) {
    dt__free(g, sizeof *g);
    dt__free(mem, (size_t)size * sizeof(int));
    dt__free(rq, (size_t)size * 2 * sizeof(dt_comm_request *));
    dt__free(all, ab);
    return dt__error(DTRAIN_ERR_NOMEM, "dt_comm_split: rank %d: out of memory", me);
  }
  for (int j = 0; j < world; j++) {
    if (all[2 * j] != color) continue;
    int p = 0;
    for (int i = 0; i < world; i++)
      if (all[2 * i] == color && (all[2 * i + 1] < all[2 * j + 1] || (all[2 * i + 1] == all[2 * j + 1] && i < j))) p++;
    mem[p] = members ? members[j] : j;
  }
  dt__free(all, ab);
  unsigned char id[20];
  dt__put_le64(id, ctx);
  dt__put_le64(id + 8, nsplit);
  dt__put_le32(id + 16, (uint32_t)color);
  uint64_t nctx = dt__fnv1a64(DT__FNV64_OFFSET, id, sizeof id);
  g->comm.vtable = &dt__comm_group_vtable;
  g->comm.p2p = &dt__comm_group_p2p;
  g->comm.world = size;
  g->comm.rank = pos;
  g->comm.impl = g;
  g->base = base;
  g->ops = ops;
  g->ctx = nctx ? nctx : 1; /* 0 is the base's own traffic */
  g->members = mem;
  g->q = rq;
  *out = &g->comm;
  if (out_rank) *out_rank = pos;
  return DTRAIN_OK;
}

#endif /* !DTRAIN_NO_DIST */
