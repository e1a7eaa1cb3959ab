/* ===========================================================================
 * dt_comm_tcp.c -- the TCP communicator's calls: the agreement round,
 * recursive doubling, the ring, reduce and broadcast chains, the vtable (see
 * dt_comm_tcp_core.h for the design and the messages; start-up is
 * dt_comm_tcp_setup.c, the failure path dt_comm_tcp_fail.c)
 * ===========================================================================
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
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_comm_tcp_core.h"

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#  endif

static const char *dt__tcp_op_name(uint32_t op) {
  switch (op) {
    case DT__TCP_OP_ALLREDUCE: return "allreduce";
    case DT__TCP_OP_REDUCE_SCATTER: return "reduce_scatter";
    case DT__TCP_OP_ALLGATHER: return "allgather";
    case DT__TCP_OP_REDUCE: return "reduce";
    case DT__TCP_OP_BROADCAST: return "broadcast";
    case DT__TCP_OP_BARRIER: return "barrier";
    default: return "?";
  }
}

static dt__comm_tcp *dt__tcp_of(dt_comm *c) { return (dt__comm_tcp *)c->impl; }

/* ---- transport wrappers (time accounted to wait_s) ------------------------------------- */

/* The connection an exchange sends on / receives from: with two lanes,
 * worker 0 sends on lane 0 and receives on lane 1, worker 1 the other way
 * round, so each socket carries one direction. */
static dt__conn *dt__tcp_out(dt__comm_tcp *t, int to) {
  return (t->lanes == 2 && t->comm.rank == 1) ? &t->lane2 : &t->conns[to];
}
static dt__conn *dt__tcp_in(dt__comm_tcp *t, int from) {
  return (t->lanes == 2 && t->comm.rank == 0) ? &t->lane2 : &t->conns[from];
}

static dt_result dt__tcp_exchange(dt__comm_tcp *t, int to, uint16_t stype, const void *s, size_t sn, int from,
                                  uint16_t rtype, void *r, size_t rn) {
  double t0 = dt__now();
  dt_result rc = dt__conn_exchange(dt__tcp_out(t, to), stype, s, (uint32_t)(sn * sizeof(float)), dt__tcp_in(t, from),
                                   rtype, r, (uint32_t)(rn * sizeof(float)), t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

static dt_result dt__tcp_send(dt__comm_tcp *t, int to, uint16_t type, const void *s, size_t bytes) {
  double t0 = dt__now();
  dt_result rc = dt__conn_send(&t->conns[to], type, s, (uint32_t)bytes, t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

static dt_result dt__tcp_recv(dt__comm_tcp *t, int from, uint16_t type, void *r, size_t bytes) {
  double t0 = dt__now();
  uint32_t len = 0;
  dt_result rc = dt__conn_recv(&t->conns[from], type, r, (uint32_t)bytes, &len, t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  if (rc == DTRAIN_OK && len != bytes)
    rc = dt__error(DTRAIN_ERR_PROTOCOL, "%s: receive from %s: %u bytes, expected %zu", t->op, t->conns[from].peer,
                   (unsigned)len, bytes);
  return rc;
}

/* ---- recursive doubling over a byte buffer --------------------------------------------- */

typedef void (*dt__tcp_combine_fn)(void *acc, const void *in, size_t bytes);

/* d[i] = in[i] + d[i] (float addition commutes: the same bits as d + in),
 * vectorised (dt__vec_add): the sums are memory-bound and otherwise a fifth
 * of a large all-reduce's time. */
static void dt__tcp_sum(float *d, const float *in, size_t n) { dt__vec_add(d, in, d, n); }

static void dt__tcp_add(void *acc, const void *in, size_t bytes) {
  dt__tcp_sum((float *)acc, (const float *)in, bytes / sizeof(float));
}

/* buf (bytes) becomes the combination over all ranks. Partial frames are
 * `part`, the fold-back `final`. */
static dt_result dt__tcp_rd(dt__comm_tcp *t, void *buf, size_t bytes, uint16_t part, uint16_t final,
                            dt__tcp_combine_fn combine) {
  int world = t->comm.world, r = t->comm.rank, p2 = 1;
  dt__conn *cs = t->conns;
  double dl;
  dt_result rc = DTRAIN_OK;
  while (p2 * 2 <= world) p2 *= 2;
  if (r >= p2) {
    /* Extra rank: hand the buffer to rank r - p2, get the result back. */
    rc = dt__tcp_send(t, r - p2, part, buf, bytes);
    if (rc == DTRAIN_OK) rc = dt__tcp_recv(t, r - p2, final, buf, bytes);
    return rc;
  }
  if (r + p2 < world) {
    rc = dt__tcp_recv(t, r + p2, part, t->scratch, bytes);
    if (rc != DTRAIN_OK) return rc;
    combine(buf, t->scratch, bytes);
  }
  for (int d = 1; d < p2; d *= 2) {
    int q = r ^ d;
    dl = dt__now();
    rc = dt__conn_exchange(&cs[q], part, buf, (uint32_t)bytes, &cs[q], part, t->scratch, (uint32_t)bytes,
                           dl + t->timeout_s, t->op);
    t->st.wait_s += dt__now() - dl;
    if (rc != DTRAIN_OK) return rc;
    combine(buf, t->scratch, bytes);
  }
  if (r + p2 < world) rc = dt__tcp_send(t, r + p2, final, buf, bytes);
  return rc;
}

/* ---- the agreement round ----------------------------------------------------------------- */

static void dt__tcp_call_put(unsigned char *p, const dt__tcp_call *c) {
  dt__put_le32(p, c->op);
  dt__put_le32(p + 4, c->root);
  dt__put_le64(p + 8, c->n);
  dt__put_le64(p + 16, c->seq);
  dt__put_le32(p + 24, c->chunk);
  dt__put_le32(p + 28, c->small);
  memcpy(p + 32, c->order, 4);
  memset(p + 36, 0, 4);
}

static void dt__tcp_call_get(const unsigned char *p, dt__tcp_call *c) {
  c->op = dt__get_le32(p);
  c->root = dt__get_le32(p + 4);
  c->n = dt__get_le64(p + 8);
  c->seq = dt__get_le64(p + 16);
  c->chunk = dt__get_le32(p + 24);
  c->small = dt__get_le32(p + 28);
  memcpy(c->order, p + 32, 4);
}

static int dt__tcp_call_eq(const dt__tcp_call *a, const dt__tcp_call *b) {
  return a->op == b->op && a->root == b->root && a->n == b->n && a->seq == b->seq && a->chunk == b->chunk &&
         a->small == b->small && memcmp(a->order, b->order, 4) == 0;
}

/* State: the lowest rank seen with its call, and (if any) a rank whose call
 * differs from it. Merging keeps "a differing call exists" exact, so every
 * rank ends knowing whether all ranks agree. */
static void dt__tcp_agree_combine(void *acc, const void *in, size_t bytes) {
  unsigned char *a = (unsigned char *)acc;
  const unsigned char *b = (const unsigned char *)in;
  (void)bytes;
  uint32_t af = dt__get_le32(a), ab = dt__get_le32(a + 4), bf = dt__get_le32(b), bb = dt__get_le32(b + 4);
  dt__tcp_call acf, acb, bcf, bcb;
  dt__tcp_call_get(a + 8, &acf);
  dt__tcp_call_get(a + 48, &acb);
  dt__tcp_call_get(b + 8, &bcf);
  dt__tcp_call_get(b + 48, &bcb);
  /* The new first: the lower of the two firsts. */
  uint32_t nf = af < bf ? af : bf, nb = DT__TCP_NONE;
  dt__tcp_call cf = af < bf ? acf : bcf, cb = cf;
  /* Candidates for a differing call, lowest rank first. */
  struct {
    uint32_t rank;
    dt__tcp_call call;
  } cand[4];
  int nc;
  cand[0].rank = af;
  cand[0].call = acf;
  cand[1].rank = bf;
  cand[1].call = bcf;
  nc = 2;
  if (ab != DT__TCP_NONE) {
    cand[nc].rank = ab;
    cand[nc].call = acb;
    nc++;
  }
  if (bb != DT__TCP_NONE) {
    cand[nc].rank = bb;
    cand[nc].call = bcb;
    nc++;
  }
  for (int i = 0; i < nc; i++)
    if (!dt__tcp_call_eq(&cand[i].call, &cf) && (nb == DT__TCP_NONE || cand[i].rank < nb)) {
      nb = cand[i].rank;
      cb = cand[i].call;
    }
  dt__put_le32(a, nf);
  dt__put_le32(a + 4, nb);
  dt__tcp_call_put(a + 8, &cf);
  dt__tcp_call_put(a + 48, &cb);
}

static const char *dt__tcp_call_text(const dt__tcp_call *c, int options, char *buf, size_t cap) {
  if (options)
    snprintf(buf, cap, "chunk_bytes %llu, small_bytes %u and %s-endian floats",
             (unsigned long long)c->chunk * sizeof(float), (unsigned)c->small, c->order[0] == 4 ? "little" : "big");
  else
    snprintf(buf, cap, "%s n=%llu root %u (call #%llu)", dt__tcp_op_name(c->op), (unsigned long long)c->n,
             (unsigned)c->root, (unsigned long long)c->seq);
  return buf;
}

/* One step of the agreement round: send our frame (state + data) to `to`,
 * receive one from `from` into t->fin; *len gets its length. Frames are at
 * most CALL_BYTES + fused_max (16 KiB + 88): both sides send before they
 * receive, which socket buffers always absorb. */
static dt_result dt__tcp_agree_xfer(dt__comm_tcp *t, int to, size_t out_bytes, int from, uint32_t *len) {
  double t0 = dt__now();
  dt_result rc = DTRAIN_OK;
  if (to >= 0) rc = dt__conn_send(&t->conns[to], DT__TCP_MSG_CALL, t->fout, (uint32_t)out_bytes, t0 + t->timeout_s, t->op);
  if (rc == DTRAIN_OK && from >= 0)
    rc = dt__conn_recv(&t->conns[from], DT__TCP_MSG_CALL, t->fin, (uint32_t)(DT__TCP_CALL_BYTES + t->fused_max), len,
                       t0 + t->timeout_s, t->op);
  if (rc == DTRAIN_OK && from >= 0 && *len < DT__TCP_CALL_BYTES)
    rc = dt__error(DTRAIN_ERR_PROTOCOL, "%s: receive from %s: a CALL frame of %u bytes", t->op, t->conns[from].peer,
                   (unsigned)*len);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

/* Folds a received frame (t->fin, len bytes) into ours (t->fout): the
 * agreement state always; the data (n floats) when the peer carried the same
 * amount -- summed (partial) or copied (final). A peer with another amount made
 * another call, which the state records, so the data are then not needed. */
static void dt__tcp_agree_fold(dt__comm_tcp *t, uint32_t len, size_t n, int final) {
  if (final) memcpy(t->fout, t->fin, DT__TCP_CALL_BYTES);
  else dt__tcp_agree_combine(t->fout, t->fin, DT__TCP_CALL_BYTES);
  if (n == 0 || len != DT__TCP_CALL_BYTES + n * sizeof(float)) return;
  float *acc = (float *)(void *)(t->fout + DT__TCP_CALL_BYTES);
  const float *in = (const float *)(const void *)(t->fin + DT__TCP_CALL_BYTES);
  if (final) memcpy(acc, in, n * sizeof(float));
  else dt__tcp_sum(acc, in, n);
}

/* The agreement round by recursive doubling (the same tree as dt__tcp_rd),
 * its frames carrying `n` floats of data (0: none) that are summed on the way. */
static dt_result dt__tcp_agree_rd(dt__comm_tcp *t, size_t n) {
  int world = t->comm.world, r = t->comm.rank, p2 = 1;
  size_t bytes = DT__TCP_CALL_BYTES + n * sizeof(float);
  uint32_t len = 0;
  dt_result rc;
  while (p2 * 2 <= world) p2 *= 2;
  if (r >= p2) {
    rc = dt__tcp_agree_xfer(t, r - p2, bytes, r - p2, &len);
    if (rc == DTRAIN_OK) dt__tcp_agree_fold(t, len, n, 1);
    return rc;
  }
  if (r + p2 < world) {
    rc = dt__tcp_agree_xfer(t, -1, 0, r + p2, &len);
    if (rc != DTRAIN_OK) return rc;
    dt__tcp_agree_fold(t, len, n, 0);
  }
  for (int d = 1; d < p2; d *= 2) {
    rc = dt__tcp_agree_xfer(t, r ^ d, bytes, r ^ d, &len);
    if (rc != DTRAIN_OK) return rc;
    dt__tcp_agree_fold(t, len, n, 0);
  }
  if (r + p2 < world) return dt__tcp_agree_xfer(t, r + p2, bytes, -1, &len);
  return DTRAIN_OK;
}

/* Start a call: checks, sequence number, the agreement round. fused (n
 * floats in buf, n * 4 <= fused_max): an all-reduce whose data ride in the
 * agreement round's frames; on success buf holds the sum, on a mismatch it is
 * restored. */
static dt_result dt__tcp_enter_fused(dt__comm_tcp *t, int rank, uint32_t op, size_t n, int root, float *fused) {
  if (rank != t->comm.rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_%s: called with rank %d, but this process is rank %d",
                     dt__tcp_op_name(op), rank, t->comm.rank);
  if (t->broken) return DTRAIN_ERR_ABORTED;
  t->seq++;
  snprintf(t->op, sizeof t->op, "worker %d: %s #%llu", t->comm.rank, dt__tcp_op_name(op), (unsigned long long)t->seq);
  if (t->comm.world == 1) return DTRAIN_OK;
  /* This rank's queued point-to-point sends go first: no message is cut by our frames. */
  dt_result flushed = dt__tcp_p2p_flush(t);
  if (flushed != DTRAIN_OK) return flushed;
  unsigned char st[DT__TCP_CALL_BYTES];
  dt__tcp_call me;
  me.op = op;
  me.root = (uint32_t)root;
  me.n = (uint64_t)n;
  me.seq = t->seq;
  me.chunk = (uint32_t)t->chunk_floats;
  me.small = (uint32_t)t->small_bytes;
  {
    uint32_t probe = 0x01020304u;
    memcpy(me.order, &probe, 4);
  }
  memset(st, 0, sizeof st);
  dt__put_le32(st, (uint32_t)t->comm.rank);
  dt__put_le32(st + 4, DT__TCP_NONE);
  dt__tcp_call_put(st + 8, &me);
  dt__tcp_call_put(st + 48, &me);
  size_t fn = fused ? n : 0;
  memcpy(t->fout, st, sizeof st);
  if (fn) {
    memcpy(t->fkeep, fused, fn * sizeof(float));
    memcpy(t->fout + DT__TCP_CALL_BYTES, fused, fn * sizeof(float));
  }
  dt_result rc = dt__tcp_agree_rd(t, fn);
  if (rc != DTRAIN_OK) return dt__tcp_fail(t, rc);
  memcpy(st, t->fout, sizeof st);
  uint32_t fr = dt__get_le32(st), br = dt__get_le32(st + 4);
  if (br != DT__TCP_NONE) {
    dt__tcp_call a, b;
    char ta[96], tb[96];
    dt__tcp_call_get(st + 8, &a);
    dt__tcp_call_get(st + 48, &b);
    /* Options differ only when the calls agree otherwise. */
    int opts = a.op == b.op && a.root == b.root && a.n == b.n && a.seq == b.seq;
    return dt__error(DTRAIN_ERR_MISMATCH, "%s: the ranks disagree: worker %u %s %s, worker %u %s %s", t->op,
                     (unsigned)fr, opts ? "uses" : "called", dt__tcp_call_text(&a, opts, ta, sizeof ta), (unsigned)br,
                     opts ? "uses" : "called", dt__tcp_call_text(&b, opts, tb, sizeof tb));
  }
  if (fn) memcpy(fused, t->fout + DT__TCP_CALL_BYTES, fn * sizeof(float));
  return DTRAIN_OK;
}

static dt_result dt__tcp_enter(dt__comm_tcp *t, int rank, uint32_t op, size_t n, int root) {
  return dt__tcp_enter_fused(t, rank, op, n, root, NULL);
}

static dt_result dt__tcp_leave(dt__comm_tcp *t, dt_result rc, size_t n) {
  if (rc != DTRAIN_OK) return t->broken ? rc : dt__tcp_fail(t, rc);
  t->st.calls++;
  t->st.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

/* ---- ring halves ---------------------------------------------------------------------------- */

static size_t dt__tcp_nparts(const dt__comm_tcp *t, size_t n) {
  size_t maxlen = 0;
  for (int j = 0; j < t->comm.world; j++) {
    size_t b, e;
    dt_comm_slice(n, t->comm.world, j, &b, &e);
    if (e - b > maxlen) maxlen = e - b;
  }
  size_t k = (maxlen + t->chunk_floats - 1) / t->chunk_floats;
  return k ? k : 1;
}

/* Part c of a slice of `len` floats cut into k parts. */
static void dt__tcp_part(size_t len, size_t k, size_t c, size_t *off, size_t *m) {
  uint64_t a = (uint64_t)len * c / k, b = (uint64_t)len * (c + 1) / k;
  *off = (size_t)a;
  *m = (size_t)(b - a);
}

static dt_result dt__tcp_ring(dt__comm_tcp *t, float *buf, size_t n, int gather) {
  int world = t->comm.world, r = t->comm.rank;
  int next = (r + 1) % world, prev = (r + world - 1) % world;
  size_t k = dt__tcp_nparts(t, n);
  for (int s = 0; s < world - 1; s++) {
    /* Reduce-scatter: send slice r-s-1, receive slice r-s-2 (rank r ends with
     * slice r). All-gather: send slice r-s, receive slice r-s-1. */
    int js = gather ? (r - s + world) % world : (r - s - 1 + 2 * world) % world;
    int jr = (js - 1 + world) % world;
    size_t sb, se, rb, re;
    dt_comm_slice(n, world, js, &sb, &se);
    dt_comm_slice(n, world, jr, &rb, &re);
    for (size_t c = 0; c < k; c++) {
      size_t so, sm, ro, rm;
      dt__tcp_part(se - sb, k, c, &so, &sm);
      dt__tcp_part(re - rb, k, c, &ro, &rm);
      dt_result rc;
      if (gather) {
        rc = dt__tcp_exchange(t, next, DT__TCP_MSG_COPY, buf + sb + so, sm, prev, DT__TCP_MSG_COPY, buf + rb + ro, rm);
      } else {
        rc = dt__tcp_exchange(t, next, DT__TCP_MSG_SUM, buf + sb + so, sm, prev, DT__TCP_MSG_SUM, t->scratch, rm);
        if (rc == DTRAIN_OK) {
          /* received partial (x[j+1] + ... ) + this rank's value */
          dt__tcp_sum(buf + rb + ro, t->scratch, rm);
        }
      }
      if (rc != DTRAIN_OK) return rc;
    }
  }
  return DTRAIN_OK;
}

/* ---- the vtable ------------------------------------------------------------------------------ */

static dt_result dt__tcp_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  if (n > 0 && n * sizeof(float) <= t->fused_max) {
    /* Small: the data ride in the agreement round (one round of messages). */
    dt_result rf = dt__tcp_enter_fused(t, rank, DT__TCP_OP_ALLREDUCE, n, 0, buf);
    if (rf != DTRAIN_OK) {
      if (rf == DTRAIN_ERR_MISMATCH) memcpy(buf, t->fkeep, n * sizeof(float));
      return rf;
    }
    return dt__tcp_leave(t, rf, n);
  }
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_ALLREDUCE, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  if (n * sizeof(float) <= t->small_bytes) {
    rc = dt__tcp_rd(t, buf, n * sizeof(float), DT__TCP_MSG_SUM, DT__TCP_MSG_COPY, dt__tcp_add);
  } else {
    rc = dt__tcp_ring(t, buf, n, 0);
    if (rc == DTRAIN_OK) rc = dt__tcp_ring(t, buf, n, 1);
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_REDUCE_SCATTER, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  return dt__tcp_leave(t, dt__tcp_ring(t, buf, n, 0), n);
}

static dt_result dt__tcp_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_ALLGATHER, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  return dt__tcp_leave(t, dt__tcp_ring(t, buf, n, 1), n);
}

static dt_result dt__tcp_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_REDUCE, n, root);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  int world = c->world, pos = (rank - root - 1 + 2 * world) % world; /* root is last */
  int prev = (rank + world - 1) % world, next = (rank + 1) % world;
  size_t k = (n + t->chunk_floats - 1) / t->chunk_floats;
  for (size_t p = 0; p < k && rc == DTRAIN_OK; p++) {
    size_t off, m;
    dt__tcp_part(n, k, p, &off, &m);
    if (pos == 0) {
      rc = dt__tcp_send(t, next, DT__TCP_MSG_SUM, buf + off, m * sizeof(float));
      continue;
    }
    rc = dt__tcp_recv(t, prev, DT__TCP_MSG_SUM, t->scratch, m * sizeof(float));
    if (rc != DTRAIN_OK) break;
    if (pos == world - 1) {
      dt__tcp_sum(buf + off, t->scratch, m); /* partial + this rank's value, into buf */
    } else {
      dt__tcp_sum(t->scratch, buf + off, m);
      rc = dt__tcp_send(t, next, DT__TCP_MSG_SUM, t->scratch, m * sizeof(float));
    }
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_BROADCAST, n, root);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  int world = c->world, pos = (rank - root + world) % world; /* root first */
  int prev = (rank + world - 1) % world, next = (rank + 1) % world;
  size_t k = (n + t->chunk_floats - 1) / t->chunk_floats;
  for (size_t p = 0; p < k && rc == DTRAIN_OK; p++) {
    size_t off, m;
    dt__tcp_part(n, k, p, &off, &m);
    if (pos > 0) rc = dt__tcp_recv(t, prev, DT__TCP_MSG_COPY, buf + off, m * sizeof(float));
    if (rc == DTRAIN_OK && pos < world - 1) rc = dt__tcp_send(t, next, DT__TCP_MSG_COPY, buf + off, m * sizeof(float));
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_barrier(dt_comm *c, int rank) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_BARRIER, 0, 0);
  return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, 0) : rc;
}

static void dt__tcp_abort(dt_comm *c, int rank) {
  dt__comm_tcp *t = dt__tcp_of(c);
  (void)rank;
  if (t->broken) return;
  t->broken = 1;
  char why[160];
  snprintf(why, sizeof why, "worker %d: the program aborted the communicator (dt_comm_abort)", c->rank);
  for (int j = 0; j < c->world; j++)
    if (j != c->rank && t->conns[j].fd >= 0) dt__conn_abort(&t->conns[j], DTRAIN_ERR_ABORTED, why);
  if (t->lane2.fd >= 0) dt__conn_abort(&t->lane2, DTRAIN_ERR_ABORTED, why);
}

static dt_result dt__tcp_recover(dt_comm *c) {
  dt__comm_tcp *t = dt__tcp_of(c);
  if (!t->broken) return DTRAIN_OK;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "dt_comm_recover: worker %d: a tcp communicator cannot be repaired after a failure; destroy it, "
                   "restart the processes and resume from the last checkpoint",
                   c->rank);
}

static void dt__tcp_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  *out = dt__tcp_of(c)->st;
}

static void dt__tcp_reset_stats(dt_comm *c) { memset(&dt__tcp_of(c)->st, 0, sizeof(dt_comm_stats)); }

static void dt__tcp_destroy(dt_comm *c) {
  dt__comm_tcp *t = dt__tcp_of(c);
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  for (int j = 0; j < c->world; j++)
    if (j != c->rank && t->conns[j].fd >= 0)
      dt__conn_send(&t->conns[j], DT__MSG_BYE, NULL, 0, dt__now() + 0.2, "bye");
  /* The second lane too: a peer still finishing its start-up (the acceptor
   * looks for an end of file right after its handshake, the sign of a client
   * that gave up in its backlog) must see a goodbye, not a bare close. */
  if (t->lane2.fd >= 0) dt__conn_send(&t->lane2, DT__MSG_BYE, NULL, 0, dt__now() + 0.2, "bye");
  dt__tcp_free(t);
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

DTRAIN_PRIVATE void dt__tcp_free(dt__comm_tcp *t) {
  dt__tcp_p2p_free(t);
  if (t->conns)
    for (int j = 0; j < t->comm.world; j++) dt__conn_close(&t->conns[j]);
  dt__conn_close(&t->lane2);
  dt__free(t->conns, t->conns_bytes);
  dt__free(t->peer_state, (size_t)t->comm.world);
  dt__free(t->pfd, (size_t)t->comm.world * sizeof(struct pollfd));
  dt__free(t->pidx, (size_t)t->comm.world * sizeof(int));
  dt__free(t->scratch, t->scratch_bytes);
  dt__free(t->fout, DT__TCP_CALL_BYTES + t->fused_max);
  dt__free(t->fin, DT__TCP_CALL_BYTES + t->fused_max);
  dt__free(t->fkeep, t->fused_max + sizeof(float));
  dt__free(t, sizeof *t);
}

static const dt_comm_vtable dt__comm_tcp_vtable = {
  "tcp",
  dt__tcp_allreduce,
  dt__tcp_reduce_scatter,
  dt__tcp_allgather,
  dt__tcp_reduce,
  dt__tcp_broadcast,
  dt__tcp_barrier,
  dt__tcp_abort,
  dt__tcp_recover,
  dt__tcp_stats,
  dt__tcp_reset_stats,
  dt__tcp_destroy
};

static const dt_comm_p2p_vtable dt__comm_tcp_p2p = {dt__tcp_isend, dt__tcp_irecv, dt__tcp_wait, dt__tcp_split};

DTRAIN_PRIVATE const dt_comm_vtable *dt__tcp_vtable(void) { return &dt__comm_tcp_vtable; }
DTRAIN_PRIVATE const dt_comm_p2p_vtable *dt__tcp_p2p_vtable(void) { return &dt__comm_tcp_p2p; }

#endif /* !DTRAIN_NO_NET && !DTRAIN_NO_THREADS */
