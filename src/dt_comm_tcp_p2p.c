/* ===========================================================================
 * dt_comm_tcp_p2p.c -- the TCP communicator's point-to-point messages and
 * groups: a progress engine over the mesh's connections
 * ===========================================================================
 * A message of n floats travels as one or more P2P frames (0x43) on the
 * connection to its receiver, each with a 32-byte subheader and at most
 * DT__P2P_FRAME_FLOATS floats (docs/wire_protocol.md):
 *
 *   off size
 *    0   8   context  0: the communicator itself; a group's (dt_comm_group.c)
 *    8   4   tag
 *   12   4   reserved (0)
 *   16   8   n        floats in the whole message
 *   24   8   offset   index of this frame's first float
 *
 * A message's frames are consecutive on its connection (a sender sends its
 * messages to one peer one after the other). Nothing moves in the
 * background: dt_comm_wait runs the engine, which moves every connection's
 * frames as its socket allows -- the queued sends, and whatever P2P frames
 * arrive, into the receive posted for them or, when none is, into a buffer
 * of their own (dt__alloc'd, so a memory cap applies) that a later receive
 * copies from -- until the awaited request is done and no frame is half
 * moved. Sending and receiving at once is what keeps two ranks that send
 * each other large messages from deadlocking on full socket buffers.
 *
 * The collectives share the connections. A collective first finishes this
 * rank's queued sends (so no frame of a message is cut by a collective's),
 * and a P2P frame that reaches a collective's receive is taken by
 * dt__tcp_p2p_in (dt__conn.p2p_in) before it reads on. The engine, for its
 * part, peeks at the header of a connection's next frame and leaves a
 * collective's frame where it is (that peer is "blocked" until a collective
 * reads it); a receive from a peer whose next frame is a collective's is a
 * mismatch of the program (the peer called a collective, this rank waits for
 * its message) and fails at once instead of at the deadline.
 *
 * Failure: the collectives' (dt__tcp_fail): a transport error or the
 * deadline (timeout_s per wait) breaks the communicator, tells the peers and
 * names the lost one; every request still queued then ends with
 * DTRAIN_ERR_ABORTED.
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
#include "dt_comm_core.h"

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#  endif
#  include <sched.h>
#  if !defined(_WIN32)
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <sys/uio.h>
#  endif

#  define DT__P2P_SUB 32
#  define DT__P2P_HEAD (DT__NET_HDR + DT__P2P_SUB)
#  define DT__P2P_FRAME_FLOATS ((size_t)1 << 20) /* 4 MiB of floats per frame at most */
#  define DT__P2P_MAX_FLOATS ((uint64_t)1 << 40)  /* a message announcing more is refused */

/* A message that arrived before its receive was posted. */
struct dt__p2p_msg {
  dt__p2p_msg *next;
  int src;
  uint64_t ctx;
  uint32_t tag;
  float *data;
  size_t n, got, bytes;
  dt_comm_request *claim; /* a receive that matched it before it was complete */
};

/* Per peer: the send queue, the frame being sent, the frame and message being received. */
struct dt__p2p_peer {
  dt_comm_request *sq;
  unsigned char so[DT__P2P_HEAD];
  size_t sdone, sdata, sk;
  int sactive;
  unsigned char ri[DT__P2P_HEAD];
  size_t rdone;
  dt__frame rf;
  int ractive;
  size_t roff, rk; /* this frame's first float and floats */
  /* the message being received (rn > 0 or a frame in flight) */
  int rmsg_on;
  int gone; /* the peer closed or said goodbye: nothing more comes from it */
  dt_comm_request *rreq;
  dt__p2p_msg *rmsg;
  uint64_t rctx;
  uint32_t rtag;
  size_t rn, rgot;
  int blocked;
};

static dt__comm_tcp *dt__tcpp_of(dt_comm *c) { return (dt__comm_tcp *)c->impl; }

/* The per-peer table, made on first use. */
static dt_result dt__tcp_p2p_ready(dt__comm_tcp *t) {
  if (t->pp) return DTRAIN_OK;
  t->pp_bytes = (size_t)t->comm.world * sizeof(dt__p2p_peer);
  t->pp = (dt__p2p_peer *)dt__calloc(t->pp_bytes);
  if (!t->pp) return dt__error(DTRAIN_ERR_NOMEM, "worker %d: out of memory for point-to-point state", t->comm.rank);
  return DTRAIN_OK;
}

static void dt__tcp_p2p_op(dt__comm_tcp *t, const char *what, int peer, uint32_t tag) {
  t->p2p_seq++;
  snprintf(t->op, sizeof t->op, "worker %d: %s #%llu %s worker %d (tag %u)", t->comm.rank, what,
           (unsigned long long)t->p2p_seq, strcmp(what, "send") == 0 ? "to" : "from", peer, (unsigned)tag);
}

/* Every request still queued or posted ends with ABORTED (the communicator broke). */
static void dt__tcp_p2p_abort_all(dt__comm_tcp *t) {
  for (dt_comm_request *r = t->posted; r; r = r->next) r->done = 1, r->rc = DTRAIN_ERR_ABORTED, r->why[0] = '\0';
  t->posted = NULL;
  for (int j = 0; t->pp && j < t->comm.world; j++) {
    dt__p2p_peer *P = &t->pp[j];
    for (dt_comm_request *r = P->sq; r; r = r->next) r->done = 1, r->rc = DTRAIN_ERR_ABORTED, r->why[0] = '\0';
    P->sq = NULL;
    P->sactive = P->ractive = 0;
    if (P->rreq) P->rreq->done = 1, P->rreq->rc = DTRAIN_ERR_ABORTED;
    P->rreq = NULL;
    P->rmsg = NULL;
    P->rmsg_on = 0;
  }
  for (dt__p2p_msg *m = t->unexp; m; m = m->next)
    if (m->claim) m->claim->done = 1, m->claim->rc = DTRAIN_ERR_ABORTED, m->claim = NULL;
  t->queued = 0;
}

/* A transport error: break the communicator (naming the lost peer). */
static dt_result dt__tcp_p2p_fail(dt__comm_tcp *t, dt_result rc) {
  if (!t->broken && (rc == DTRAIN_ERR_MISMATCH || rc == DTRAIN_ERR_PROTOCOL)) {
    /* Nobody was lost: the error stands as it is; the peers hear it. */
    char first[DT__MSG_CAP];
    snprintf(first, sizeof first, "%s", dt_last_error());
    t->broken = 1;
    for (int j = 0; j < t->comm.world; j++)
      if (j != t->comm.rank && t->conns[j].fd >= 0) dt__conn_abort(&t->conns[j], rc, first);
    if (t->lane2.fd >= 0) dt__conn_abort(&t->lane2, rc, first);
    dt__error(rc, "%s", first);
  } else if (!t->broken) {
    rc = dt__tcp_fail(t, rc);
  }
  dt__tcp_p2p_abort_all(t);
  return rc;
}

static void dt__tcp_msg_free(dt__p2p_msg *m) {
  dt__free(m->data, m->bytes);
  dt__free(m, sizeof *m);
}

/* Copy a complete message into receive r and finish r. */
static void dt__tcp_p2p_fill(dt_comm_request *r, const float *data, size_t n) {
  r->done = 1;
  if (n == r->n) {
    if (n && data) memcpy(r->buf, data, n * sizeof(float));
    r->rc = DTRAIN_OK;
    return;
  }
  r->rc = DTRAIN_ERR_MISMATCH;
  snprintf(r->why, sizeof r->why,
           "dt_comm_recv: worker %d: the message from worker %d (tag %u) has %zu floats, the receive wants %zu",
           r->rank, r->peer, (unsigned)r->tag, n, r->n);
}

/* ---- receiving ------------------------------------------------------------------------------ */

/* The first frame of a message from peer j: find its receive or buffer it. */
static dt_result dt__tcp_p2p_begin(dt__comm_tcp *t, int j, uint64_t ctx, uint32_t tag, size_t n) {
  dt__p2p_peer *P = &t->pp[j];
  P->rmsg_on = 1;
  P->rctx = ctx;
  P->rtag = tag;
  P->rn = n;
  P->rgot = 0;
  P->rreq = NULL;
  P->rmsg = NULL;
  for (dt_comm_request **p = &t->posted; *p; p = &(*p)->next) {
    dt_comm_request *r = *p;
    if (r->peer != j || r->ctx != ctx || r->tag != tag) continue;
    *p = r->next;
    r->next = NULL;
    if (r->n != n) {
      dt__tcp_p2p_fill(r, NULL, n); /* MISMATCH now; the frames are read and dropped */
    } else {
      P->rreq = r;
    }
    return DTRAIN_OK;
  }
  dt__p2p_msg *m = (dt__p2p_msg *)dt__calloc(sizeof *m);
  size_t bytes = (n ? n : 1) * sizeof(float);
  float *d = m ? (float *)dt__alloc(bytes) : NULL;
  if (!m || !d) {
    dt__free(m, sizeof *m);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: no memory to hold a message of %zu floats from %s that came before its "
                     "receive", t->op, n, t->conns[j].peer);
  }
  m->src = j;
  m->ctx = ctx;
  m->tag = tag;
  m->data = d;
  m->bytes = bytes;
  m->n = n;
  dt__p2p_msg **p = &t->unexp;
  while (*p) p = &(*p)->next;
  *p = m;
  P->rmsg = m;
  return DTRAIN_OK;
}

/* The subheader of a frame from peer j (in P->ri after the frame header):
 * checked, and the message begun or continued. */
static dt_result dt__tcp_p2p_sub(dt__comm_tcp *t, int j) {
  dt__p2p_peer *P = &t->pp[j];
  const unsigned char *s = P->ri + DT__NET_HDR;
  uint64_t ctx = dt__get_le64(s), n = dt__get_le64(s + 16), off = dt__get_le64(s + 24);
  uint32_t tag = dt__get_le32(s + 8), resv = dt__get_le32(s + 12);
  uint64_t k = (P->rf.length - DT__P2P_SUB) / sizeof(float);
  const char *bad = NULL;
  if (resv != 0) bad = "reserved field not zero";
  else if (n > DT__P2P_MAX_FLOATS || n > (uint64_t)(SIZE_MAX / sizeof(float) / 2))
    bad = "message longer than this machine can address (2^40 floats at most)"; /* 32-bit: n would be cut by size_t */
  else if (off > n || k > n - off) bad = "frame runs past the end of its message";
  else if (k == 0 && n != 0) bad = "empty frame of a non-empty message";
  else if (off == 0 && P->rmsg_on) bad = "a new message before the last one ended";
  else if (off != 0 && (!P->rmsg_on || ctx != P->rctx || tag != P->rtag || n != P->rn || off != P->rgot))
    bad = "a frame that does not continue the message in progress";
  if (bad) {
    dt__error(DTRAIN_ERR_PROTOCOL, "%s: point-to-point frame from %s: %s", t->op, t->conns[j].peer, bad);
    return DTRAIN_ERR_PROTOCOL;
  }
  P->roff = (size_t)off;
  P->rk = (size_t)k;
  if (off == 0) return dt__tcp_p2p_begin(t, j, ctx, tag, (size_t)n);
  return DTRAIN_OK;
}

/* Where the frame's data byte `at` (from the start of its data) goes; *cap:
 * how many bytes may go there in one piece. NULL: dropped (read into scratch). */
static unsigned char *dt__tcp_p2p_dst(dt__comm_tcp *t, dt__p2p_peer *P, size_t at, size_t *cap) {
  size_t left = P->rk * sizeof(float) - at;
  float *base = P->rreq ? P->rreq->buf : P->rmsg ? P->rmsg->data : NULL;
  if (!base) {
    *cap = DT__MIN(left, t->scratch_bytes);
    return (unsigned char *)t->scratch;
  }
  *cap = left;
  return (unsigned char *)(base + P->roff) + at;
}

/* The frame is in: move the message on; finish it when it is whole. */
static void dt__tcp_p2p_frame_done(dt__comm_tcp *t, int j) {
  dt__p2p_peer *P = &t->pp[j];
  t->conns[j].recv_seq++;
  P->ractive = 0;
  P->rgot += P->rk;
  if (P->rgot < P->rn) return;
  if (P->rreq) {
    P->rreq->done = 1;
    P->rreq->rc = DTRAIN_OK;
    t->st.bytes += (uint64_t)P->rn * sizeof(float);
  } else if (P->rmsg) {
    dt__p2p_msg *m = P->rmsg;
    m->got = m->n;
    if (m->claim) {
      /* A receive matched it while it arrived: hand it over now. */
      dt__tcp_p2p_fill(m->claim, m->data, m->n);
      m->claim = NULL;
      for (dt__p2p_msg **p = &t->unexp; *p; p = &(*p)->next)
        if (*p == m) {
          *p = m->next;
          break;
        }
      dt__tcp_msg_free(m);
    }
  }
  P->rreq = NULL;
  P->rmsg = NULL;
  P->rmsg_on = 0;
}

/* dt__conn.p2p_in: a collective's receive met a P2P frame (header checked,
 * in f): read the rest of it now, blocking until the deadline -- its sender
 * finished writing it before it entered the collective. */
static dt_result dt__tcp_p2p_in(void *arg, dt__conn *c, const dt__frame *f, double deadline) {
  dt__comm_tcp *t = (dt__comm_tcp *)arg;
  int j = (int)(c - t->conns);
  if (j < 0 || j >= t->comm.world || dt__tcp_p2p_ready(t) != DTRAIN_OK) return DTRAIN_ERR_NOMEM;
  dt__p2p_peer *P = &t->pp[j];
  dt_result rc = DTRAIN_OK;
  if (f->length < DT__P2P_SUB || (f->length - DT__P2P_SUB) % sizeof(float) != 0)
    rc = dt__error(DTRAIN_ERR_PROTOCOL, "%s: point-to-point frame of %u bytes from %s", t->op, (unsigned)f->length,
                   c->peer);
  P->rf = *f;
  if (rc == DTRAIN_OK) rc = dt__net_read(c->fd, P->ri + DT__NET_HDR, DT__P2P_SUB, deadline);
  if (rc == DTRAIN_OK) rc = dt__tcp_p2p_sub(t, j);
  for (size_t at = 0; rc == DTRAIN_OK && at < P->rk * sizeof(float);) {
    size_t cap;
    unsigned char *d = dt__tcp_p2p_dst(t, P, at, &cap);
    rc = dt__net_read(c->fd, d, cap, deadline);
    at += cap;
  }
  if (rc != DTRAIN_OK) return rc;
  dt__tcp_p2p_frame_done(t, j);
  return DTRAIN_OK;
}

/* Start receiving peer j's next frame if it is a P2P one (peeked at). */
static dt_result dt__tcp_p2p_peek(dt__comm_tcp *t, int j, int *moved, int *partial) {
  dt__p2p_peer *P = &t->pp[j];
  dt__conn *c = &t->conns[j];
  unsigned char h[DT__NET_HDR];
  ssize_t k = dt__sock_recv(c->fd, h, sizeof h, MSG_PEEK);
  if (k == 0) {
    P->gone = 1; /* an error only for a transfer with this peer (dt__tcp_p2p_run) */
    return DTRAIN_OK;
  }
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return DTRAIN_OK;
    dt__error(DTRAIN_ERR_PEER, "%s: receive from %s failed: %s", t->op, c->peer, dt__sk_strerror(errno));
    return DTRAIN_ERR_PEER;
  }
  if ((size_t)k < sizeof h) {
    *partial = 1;
    return DTRAIN_OK;
  }
  uint16_t type = dt__get_le16(h + 6);
  if (type == DT__TCP_MSG_P2P) {
    P->ractive = 1;
    P->rdone = 0;
    *moved = 1;
    return DTRAIN_OK;
  }
  if (type == DT__MSG_ABORT || type == DT__MSG_REFUSE) {
    dt__frame f;
    unsigned char hh[DT__NET_HDR];
    dt_result rc = dt__conn_recv_header(c, &f, hh, dt__now() + 1.0, t->op);
    return rc != DTRAIN_OK ? rc : dt__error(DTRAIN_ERR_PROTOCOL, "%s: unexpected notice from %s", t->op, c->peer);
  }
  if (type == DT__MSG_BYE) {
    P->gone = 1; /* it left after its last message: fine unless we still need it */
    return DTRAIN_OK;
  }
  P->blocked = 1; /* a collective's frame: it stays for the collective */
  return DTRAIN_OK;
}

/* Move peer j's incoming frame as far as the socket allows. */
static dt_result dt__tcp_p2p_recv_step(dt__comm_tcp *t, int j, int *moved) {
  dt__p2p_peer *P = &t->pp[j];
  dt__conn *c = &t->conns[j];
  for (;;) {
    unsigned char *d;
    size_t want;
    if (P->rdone < DT__P2P_HEAD) {
      d = P->ri + P->rdone;
      want = (P->rdone < DT__NET_HDR ? DT__NET_HDR : DT__P2P_HEAD) - P->rdone;
    } else {
      d = dt__tcp_p2p_dst(t, P, P->rdone - DT__P2P_HEAD, &want);
    }
    ssize_t k = want ? dt__sock_recv(c->fd, d, want, 0) : 0;
    if (want && k == 0) {
      dt__error(DTRAIN_ERR_PEER, "%s: %s closed the connection", t->op, c->peer);
      return DTRAIN_ERR_PEER;
    }
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return DTRAIN_OK;
      dt__error(DTRAIN_ERR_PEER, "%s: receive from %s failed: %s", t->op, c->peer, dt__sk_strerror(errno));
      return DTRAIN_ERR_PEER;
    }
    if (k > 0) *moved = 1;
    size_t was = P->rdone;
    P->rdone += (size_t)k;
    if (was < DT__NET_HDR && P->rdone == DT__NET_HDR) {
      dt_result rc = dt__conn_check_header(c, P->ri, &P->rf, t->op);
      if (rc != DTRAIN_OK) return rc;
      if (P->rf.type != DT__TCP_MSG_P2P || P->rf.length < DT__P2P_SUB ||
          (P->rf.length - DT__P2P_SUB) % sizeof(float) != 0) {
        dt__error(DTRAIN_ERR_PROTOCOL, "%s: point-to-point frame of type %u and %u bytes from %s", t->op,
                  (unsigned)P->rf.type, (unsigned)P->rf.length, c->peer);
        return DTRAIN_ERR_PROTOCOL;
      }
      continue;
    }
    if (was < DT__P2P_HEAD && P->rdone == DT__P2P_HEAD) {
      dt_result rc = dt__tcp_p2p_sub(t, j);
      if (rc != DTRAIN_OK) return rc;
    }
    if (P->rdone >= DT__P2P_HEAD && P->rdone == DT__P2P_HEAD + P->rk * sizeof(float)) {
      dt__tcp_p2p_frame_done(t, j);
      return DTRAIN_OK;
    }
    if (k <= 0 && want) return DTRAIN_OK;
  }
}

/* ---- sending -------------------------------------------------------------------------------- */

static void dt__tcp_p2p_start_frame(dt__comm_tcp *t, int j) {
  dt__p2p_peer *P = &t->pp[j];
  dt__conn *c = &t->conns[j];
  dt_comm_request *r = P->sq;
  size_t k = DT__MIN(r->n - r->moved, DT__P2P_FRAME_FLOATS);
  size_t maxk = c->max_payload > DT__P2P_SUB + 64 ? (c->max_payload - DT__P2P_SUB) / sizeof(float) : 16;
  if (k > maxk) k = maxk;
  dt__frame_pack(P->so, DT__TCP_MSG_P2P, c->job, c->self_id, c->send_seq, NULL,
                 (uint32_t)(DT__P2P_SUB + k * sizeof(float)));
  unsigned char *s = P->so + DT__NET_HDR;
  dt__put_le64(s, r->ctx);
  dt__put_le32(s + 8, r->tag);
  dt__put_le32(s + 12, 0);
  dt__put_le64(s + 16, (uint64_t)r->n);
  dt__put_le64(s + 24, (uint64_t)r->moved);
  P->sk = k;
  P->sdata = k * sizeof(float);
  P->sdone = 0;
  P->sactive = 1;
}

static dt_result dt__tcp_p2p_send_step(dt__comm_tcp *t, int j, int *moved) {
  dt__p2p_peer *P = &t->pp[j];
  dt__conn *c = &t->conns[j];
  dt_comm_request *r = P->sq;
  size_t total = DT__P2P_HEAD + P->sdata;
  while (P->sdone < total) {
    struct iovec iov[2];
    int cnt = 0;
    if (P->sdone < DT__P2P_HEAD) {
      iov[cnt].iov_base = P->so + P->sdone;
      iov[cnt].iov_len = DT__P2P_HEAD - P->sdone;
      cnt++;
    }
    if (P->sdata) {
      size_t po = P->sdone > DT__P2P_HEAD ? P->sdone - DT__P2P_HEAD : 0;
      iov[cnt].iov_base = (unsigned char *)(r->buf + r->moved) + po;
      iov[cnt].iov_len = P->sdata - po;
      cnt++;
    }
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)cnt;
    ssize_t k = dt__sock_sendmsg(c->fd, &mh, DT__NET_SEND_FLAGS);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return DTRAIN_OK;
      dt__error(DTRAIN_ERR_PEER, "%s: send to %s failed: %s", t->op, c->peer, dt__sk_strerror(errno));
      return DTRAIN_ERR_PEER;
    }
    if (k == 0) return DTRAIN_OK;
    P->sdone += (size_t)k;
    *moved = 1;
  }
  c->send_seq++;
  P->sactive = 0;
  r->moved += P->sk;
  if (r->moved == r->n) {
    P->sq = r->next;
    r->next = NULL;
    r->done = 1;
    r->rc = DTRAIN_OK;
    t->queued--;
    t->st.bytes += (uint64_t)r->n * sizeof(float);
  }
  return DTRAIN_OK;
}

/* ---- the engine ----------------------------------------------------------------------------- */

/* Move frames until target is done (target NULL: until every queued send is
 * out) and no frame is half moved, or the deadline. */
static dt_result dt__tcp_p2p_run(dt__comm_tcp *t, dt_comm_request *target, double deadline) {
  int world = t->comm.world, me = t->comm.rank;
  double spin_until = -1.0, spin = t->lane2.spin_s;
  for (int j = 0; j < world; j++) t->pp[j].blocked = 0; /* a collective may have read what blocked it */
  for (;;) {
    int drain = target ? target->done : t->queued == 0, active = 0, moved = 0, partial = 0;
    for (int j = 0; j < world; j++) {
      dt__p2p_peer *P = &t->pp[j];
      if (j == me || t->conns[j].fd < 0) continue;
      dt_result rc = DTRAIN_OK;
      if (!P->sactive && P->sq && !drain) dt__tcp_p2p_start_frame(t, j);
      if (P->sactive) rc = dt__tcp_p2p_send_step(t, j, &moved);
      if (rc == DTRAIN_OK && !P->ractive && !drain && !P->blocked && !P->gone)
        rc = dt__tcp_p2p_peek(t, j, &moved, &partial);
      if (rc == DTRAIN_OK && P->ractive) rc = dt__tcp_p2p_recv_step(t, j, &moved);
      if (rc != DTRAIN_OK) return rc;
      active |= P->sactive | P->ractive;
    }
    drain = target ? target->done : t->queued == 0;
    if (drain && !active) return DTRAIN_OK;
    if (target && !target->done && target->peer != me) {
      const dt__p2p_peer *T = &t->pp[target->peer];
      if (T->gone && !T->ractive)
        return dt__error(DTRAIN_ERR_PEER, "%s: %s closed the connection", t->op, t->conns[target->peer].peer);
      if (!target->send && T->blocked && !T->ractive)
        return dt__error(DTRAIN_ERR_MISMATCH, "%s: %s called a collective while this rank waits for its message "
                         "(the ranks call different things)", t->op, t->conns[target->peer].peer);
    }
    if (moved) {
      spin_until = -1.0;
      continue;
    }
    double now = dt__now();
    if (now >= deadline) {
      int who = target && !target->done ? target->peer : -1;
      for (int j = 0; j < world && who < 0; j++)
        if (t->pp[j].sactive || t->pp[j].ractive) who = j;
      if (who < 0 || who == me) who = me == 0 ? 1 : 0;
      return dt__error(DTRAIN_ERR_TIMEOUT, "%s: %s: nothing moved before the deadline (stalled?)", t->op,
                       t->conns[who].peer);
    }
    if (spin > 0) {
      if (spin_until < 0) spin_until = DT__MIN(now + spin, deadline);
      if (now < spin_until) {
        sched_yield();
        continue;
      }
    }
    struct pollfd *pf = t->pfd;
    int np = 0;
    for (int j = 0; j < world; j++) {
      dt__p2p_peer *P = &t->pp[j];
      if (j == me || t->conns[j].fd < 0) continue;
      short ev = 0;
      if (P->sactive || (P->sq && !drain)) ev |= POLLOUT;
      if (P->ractive || (!drain && !P->blocked && !P->gone)) ev |= POLLIN;
      if (!ev) continue;
      pf[np].fd = t->conns[j].fd;
      pf[np].events = ev;
      pf[np].revents = 0;
      np++;
    }
    double left = deadline - now;
    int ms = partial ? 1 : left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
    if (np == 0) {
      dt__sleep(DT__MIN(left, 0.001 * ms));
      continue;
    }
    if (dt__sock_poll(pf, (nfds_t)np, ms) < 0 && errno != EINTR) {
      dt__error(DTRAIN_ERR_NET, "%s: poll: %s", t->op, dt__sk_strerror(errno));
      return DTRAIN_ERR_NET;
    }
  }
}

/* A collective's first step: every queued send out (dt_comm_tcp.c). */
DTRAIN_PRIVATE dt_result dt__tcp_p2p_flush(dt__comm_tcp *t) {
  if (!t->pp || t->queued == 0) return DTRAIN_OK;
  double t0 = dt__now();
  dt_result rc = dt__tcp_p2p_run(t, NULL, t0 + t->timeout_s);
  t->st.wait_s += dt__now() - t0;
  return rc == DTRAIN_OK ? rc : dt__tcp_p2p_fail(t, rc);
}

DTRAIN_PRIVATE void dt__tcp_p2p_hook(dt__comm_tcp *t) {
  for (int j = 0; j < t->comm.world; j++) {
    t->conns[j].p2p_type = DT__TCP_MSG_P2P;
    t->conns[j].p2p_in = dt__tcp_p2p_in;
    t->conns[j].p2p_arg = t;
  }
}

DTRAIN_PRIVATE void dt__tcp_p2p_free(dt__comm_tcp *t) {
  while (t->unexp) {
    dt__p2p_msg *m = t->unexp;
    t->unexp = m->next;
    dt__tcp_msg_free(m);
  }
  dt__free(t->pp, t->pp_bytes);
  t->pp = NULL;
}

/* ---- the calls ------------------------------------------------------------------------------ */

static dt_result dt__tcp_ctx_isend(dt_comm *c, uint64_t ctx, int dst, uint32_t tag, const float *buf, size_t n,
                                   dt_comm_request **req) {
  dt__comm_tcp *t = dt__tcpp_of(c);
  *req = NULL;
  if (t->broken) return DTRAIN_ERR_ABORTED;
  dt_result rc = dt__tcp_p2p_ready(t);
  if (rc != DTRAIN_OK) return rc;
  dt_comm_request *r = dt__req_new(c, sizeof(dt_comm_request), 1, c->rank, dst, tag, (float *)(uintptr_t)buf, n);
  if (!r) return DTRAIN_ERR_NOMEM;
  r->ctx = ctx;
  if (dst == c->rank) {
    /* To itself: straight into its receive, or kept until it is posted. */
    for (dt_comm_request **p = &t->posted; *p; p = &(*p)->next) {
      dt_comm_request *o = *p;
      if (o->peer != dst || o->ctx != ctx || o->tag != tag) continue;
      *p = o->next;
      dt__tcp_p2p_fill(o, buf, n);
      r->done = 1;
      *req = r;
      return DTRAIN_OK;
    }
    rc = dt__tcp_p2p_begin(t, dst, ctx, tag, n);
    if (rc != DTRAIN_OK) {
      dt__req_free(r);
      return rc;
    }
    dt__p2p_peer *P = &t->pp[dst];
    if (n) memcpy(P->rmsg->data, buf, n * sizeof(float));
    P->rmsg->got = n;
    P->rmsg = NULL;
    P->rmsg_on = 0;
    r->done = 1;
    *req = r;
    return DTRAIN_OK;
  }
  dt_comm_request **p = &t->pp[dst].sq;
  while (*p) p = &(*p)->next;
  *p = r;
  t->queued++;
  *req = r;
  /* What the socket takes now goes now: a pipeline stage's activations leave
   * while it computes its next micro-batch, not at its next wait (which came
   * a whole micro-batch later, and the next stage idled). Never blocks, never
   * reads; the rest (a full socket, a big message) moves at the next wait or
   * collective, and an error here is met and reported there: this call
   * returns OK and leaves the last error (and the log) as they were. */
  dt__p2p_peer *P = &t->pp[dst];
  const dt_result was = dt_last_result();
  char was_msg[DT__MSG_CAP];
  snprintf(was_msg, sizeof was_msg, "%s", dt_last_error());
  dt__quiet_push();
  for (int k = 0; k < 64 && P->sq && t->conns[dst].fd >= 0; k++) {
    int moved = 0;
    if (!P->sactive) dt__tcp_p2p_start_frame(t, dst);
    if (dt__tcp_p2p_send_step(t, dst, &moved) != DTRAIN_OK) {
      if (was == DTRAIN_OK && !was_msg[0]) dt_clear_error();
      else (void)dt__error(was, "%s", was_msg);
      break;
    }
    if (P->sactive) break;
  }
  (void)dt__quiet_pop(DTRAIN_OK);
  return DTRAIN_OK;
}

static dt_result dt__tcp_ctx_irecv(dt_comm *c, uint64_t ctx, int src, uint32_t tag, float *buf, size_t n,
                                   dt_comm_request **req) {
  dt__comm_tcp *t = dt__tcpp_of(c);
  *req = NULL;
  if (t->broken) return DTRAIN_ERR_ABORTED;
  dt_result rc = dt__tcp_p2p_ready(t);
  if (rc != DTRAIN_OK) return rc;
  dt_comm_request *r = dt__req_new(c, sizeof(dt_comm_request), 0, c->rank, src, tag, buf, n);
  if (!r) return DTRAIN_ERR_NOMEM;
  r->ctx = ctx;
  *req = r;
  for (dt__p2p_msg **p = &t->unexp; *p; p = &(*p)->next) {
    dt__p2p_msg *m = *p;
    if (m->src != src || m->ctx != ctx || m->tag != tag || m->claim) continue;
    if (m->got < m->n) {
      m->claim = r; /* still arriving: it finishes r when complete */
      return DTRAIN_OK;
    }
    *p = m->next;
    dt__tcp_p2p_fill(r, m->data, m->n);
    dt__tcp_msg_free(m);
    return DTRAIN_OK;
  }
  dt_comm_request **p = &t->posted;
  while (*p) p = &(*p)->next;
  *p = r;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__tcp_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                               dt_comm_request **req) {
  if (rank != c->rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_isend: called with rank %d, but this process is rank %d", rank,
                     c->rank);
  return dt__tcp_ctx_isend(c, 0, dst, (uint32_t)tag, buf, n, req);
}

DTRAIN_PRIVATE dt_result dt__tcp_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                               dt_comm_request **req) {
  if (rank != c->rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_irecv: called with rank %d, but this process is rank %d", rank,
                     c->rank);
  return dt__tcp_ctx_irecv(c, 0, src, (uint32_t)tag, buf, n, req);
}

/* Take r out of whatever list holds it (a request abandoned by a failed wait). */
static void dt__tcp_p2p_forget(dt__comm_tcp *t, dt_comm_request *r) {
  for (dt_comm_request **p = &t->posted; *p; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      return;
    }
  for (dt__p2p_msg *m = t->unexp; m; m = m->next)
    if (m->claim == r) m->claim = NULL;
  for (int j = 0; t->pp && j < t->comm.world; j++) {
    if (t->pp[j].rreq == r) t->pp[j].rreq = NULL; /* the rest of its frames are dropped */
    for (dt_comm_request **p = &t->pp[j].sq; *p; p = &(*p)->next)
      if (*p == r) {
        *p = r->next;
        t->queued--;
        return;
      }
  }
}

DTRAIN_PRIVATE dt_result dt__tcp_wait(dt_comm *c, dt_comm_request *r) {
  dt__comm_tcp *t = dt__tcpp_of(c);
  dt_result rc = DTRAIN_OK;
  if (!r->done && t->broken) {
    dt__tcp_p2p_forget(t, r);
    dt__req_free(r);
    return DTRAIN_ERR_ABORTED;
  }
  if (!r->done) {
    dt__tcp_p2p_op(t, r->send ? "send" : "recv", r->peer, r->tag);
    double t0 = dt__now();
    rc = dt__tcp_p2p_run(t, r, t0 + t->timeout_s);
    t->st.wait_s += dt__now() - t0;
    if (rc != DTRAIN_OK) {
      rc = dt__tcp_p2p_fail(t, rc);
      dt__tcp_p2p_forget(t, r);
      dt__req_free(r);
      return rc;
    }
  }
  rc = r->rc;
  if (rc == DTRAIN_OK) t->st.calls++;
  else if (rc != DTRAIN_ERR_ABORTED) rc = dt__error(rc, "%s", r->why);
  dt__req_free(r);
  return rc;
}

static void dt__tcp_ctx_abort(dt_comm *base) { dt_comm_abort(base, base->rank); }
static int dt__tcp_ctx_broken(dt_comm *base) { return dt__tcpp_of(base)->broken; }

static const dt__p2p_ops dt__tcp_p2p_ops = {dt__tcp_ctx_isend, dt__tcp_ctx_irecv, dt__tcp_ctx_abort,
                                            dt__tcp_ctx_broken};

DTRAIN_PRIVATE dt_result dt__tcp_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank) {
  dt__comm_tcp *t = dt__tcpp_of(c);
  if (rank != c->rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_split: called with rank %d, but this process is rank %d", rank,
                     c->rank);
  if (t->broken) return DTRAIN_ERR_ABORTED;
  return dt__group_split(c, &dt__tcp_p2p_ops, 0, &t->splits, NULL, c->world, c->rank, color, key, out, out_rank);
}

#endif /* !DTRAIN_NO_NET && !DTRAIN_NO_THREADS */
