/* ===========================================================================
 * dt_conn.c -- connections: a socket that carries frames, with both
 * directions' sequence numbers, errors that name the peer and the operation,
 * and the two-way exchange of the ring collectives (see dt_net_core.h)
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
#include "dt_net_core.h"
#include "dt_platform.h"

#ifndef DTRAIN_NO_NET
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

DTRAIN_PRIVATE void dt__conn_init(dt__conn *c, int fd, uint64_t job, uint32_t self_id, uint32_t max_payload) {
  memset(c, 0, sizeof *c);
  c->fd = fd;
  c->job = job;
  c->self_id = self_id;
  c->max_payload = max_payload;
  c->peer_role = -1;
  c->peer_index = -1;
  c->lane = 0;
  snprintf(c->peer, sizeof c->peer, "an unidentified peer");
}

/* Rewrites the thread's last error as "<op>: <verb> <peer>: <detail>". */
static dt_result dt__conn_fail(dt__conn *c, dt_result rc, const char *op, const char *verb) {
  char detail[DT__MSG_CAP];
  snprintf(detail, sizeof detail, "%s", dt_last_error());
  return dt__error(rc, "%s: %s %s: %s", op ? op : "tcp", verb, c->peer, detail);
}

DTRAIN_PRIVATE dt_result dt__conn_send(dt__conn *c, uint16_t type, const void *payload, uint32_t n, double deadline,
                                       const char *op) {
  unsigned char h[DT__NET_HDR];
  dt__frame_pack(h, type, c->job, c->self_id, c->send_seq, payload, n);
  /* Header and payload in one gathered send when the socket takes it all. */
  struct iovec iov[2];
  iov[0].iov_base = h;
  iov[0].iov_len = DT__NET_HDR;
  iov[1].iov_base = (void *)(uintptr_t)payload;
  iov[1].iov_len = payload ? n : 0;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = iov;
  mh.msg_iovlen = 2;
  size_t total = DT__NET_HDR + (size_t)(payload ? n : 0);
  ssize_t k;
  do {
    k = dt__sock_sendmsg(c->fd, &mh, DT__NET_SEND_FLAGS);
  } while (k < 0 && errno == EINTR);
  if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    dt__error(DTRAIN_ERR_PEER, "send failed: %s", dt__sk_strerror(errno));
    return dt__conn_fail(c, DTRAIN_ERR_PEER, op, "send to");
  }
  size_t sent = k > 0 ? (size_t)k : 0;
  dt_result rc = DTRAIN_OK;
  if (sent < DT__NET_HDR) rc = dt__net_write(c->fd, h + sent, DT__NET_HDR - sent, deadline);
  if (rc == DTRAIN_OK && sent < total) {
    size_t po = sent > DT__NET_HDR ? sent - DT__NET_HDR : 0;
    rc = dt__net_write(c->fd, (const unsigned char *)payload + po, n - po, deadline);
  }
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "send to");
  c->send_seq++;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_sendv(dt__conn *c, uint16_t type, const struct iovec *parts, int nparts,
                                        struct iovec *scratch, double deadline, const char *op) {
  size_t n = 0;
  for (int i = 0; i < nparts; i++) n += parts[i].iov_len;
  if (type < DT__MSG_DATA0 || n > c->max_payload) /* control frames checksum their payload: dt__conn_send */
    return dt__error(DTRAIN_ERR_INTERNAL, "%s: a gathered frame of type 0x%02x and %zu bytes", op ? op : "tcp",
                     (unsigned)type, n);
  unsigned char h[DT__NET_HDR];
  dt__frame_pack(h, type, c->job, c->self_id, c->send_seq, NULL, (uint32_t)n);
  scratch[0].iov_base = h;
  scratch[0].iov_len = DT__NET_HDR;
  memcpy(scratch + 1, parts, (size_t)nparts * sizeof *parts);
  dt_result rc = dt__net_writev(c->fd, scratch, nparts + 1, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "send to");
  c->send_seq++;
  return DTRAIN_OK;
}

/* An ABORT or REFUSE frame's payload (u32 code, then text; f->length <=
 * DT__NET_NOTICE_MAX, checked with the header) as the peer's error. */
static dt_result dt__conn_notice(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                 const unsigned char *buf, const char *op) {
  char text[DT__MSG_CAP];
  uint32_t n = f->length;
  if (!dt__frame_payload_ok(h, f, buf) || n < 4) {
    dt__error(DTRAIN_ERR_PROTOCOL, "corrupt %s frame", f->type == DT__MSG_ABORT ? "abort" : "refusal");
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  uint32_t code = dt__get_le32(buf);
  size_t tl = n - 4 < sizeof text - 1 ? n - 4 : sizeof text - 1;
  memcpy(text, buf + 4, tl);
  text[tl] = '\0';
  for (size_t i = 0; i < tl; i++)
    if ((unsigned char)text[i] < 0x20) text[i] = ' ';
  c->recv_seq++;
  dt_result their = (dt_result)(-(int32_t)code);
  if (f->type == DT__MSG_ABORT)
    return dt__error(DTRAIN_ERR_PEER, "%s: %s aborted: %s", op ? op : "tcp", c->peer, text);
  /* The peer's reason where it is one this side can act on (a server out of
   * memory is NOMEM here too, not a network failure); else NET. */
  if (their != DTRAIN_ERR_AUTH && their != DTRAIN_ERR_MISMATCH && their != DTRAIN_ERR_PROTOCOL &&
      their != DTRAIN_ERR_NOMEM)
    their = DTRAIN_ERR_NET;
  return dt__error(their, "%s: refused by %s: %s", op ? op : "tcp", c->peer, text);
}

DTRAIN_PRIVATE dt_result dt__conn_check_header(dt__conn *c, const unsigned char h[DT__NET_HDR], dt__frame *f,
                                               const char *op) {
  char why[160];
  dt_result rc = dt__frame_unpack(h, c->job, c->max_payload, f, why, sizeof why);
  if (rc != DTRAIN_OK) {
    dt__error(rc, "%s", why);
    return dt__conn_fail(c, rc, op, "receive from");
  }
  if (f->seq != c->recv_seq) {
    dt__error(DTRAIN_ERR_PROTOCOL, "sequence number %llu, expected %llu", (unsigned long long)f->seq,
              (unsigned long long)c->recv_seq);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  if (c->peer_role >= 0 && f->sender != dt__net_id((dt_role)c->peer_role, c->peer_index)) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame claims sender %u", (unsigned)f->sender);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  if ((f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE) && f->length > DT__NET_NOTICE_MAX) {
    dt__error(DTRAIN_ERR_PROTOCOL, "notice of %u bytes", (unsigned)f->length);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_check_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                                const void *payload, const char *op) {
  if (f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE)
    return dt__conn_notice(c, f, h, (const unsigned char *)payload, op);
  if (!dt__frame_payload_ok(h, f, payload)) {
    dt__error(DTRAIN_ERR_PROTOCOL, "checksum mismatch in a frame of type %u", (unsigned)f->type);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  c->recv_seq++;
  return DTRAIN_OK;
}

/* A received header, decoded into *f and checked against the connection
 * (dt__conn_check_header); an ABORT or REFUSE frame is read whole and becomes
 * the peer's error. */
static dt_result dt__conn_header_ok(dt__conn *c, const unsigned char h[DT__NET_HDR], dt__frame *f, double deadline,
                                    const char *op) {
  dt_result rc = dt__conn_check_header(c, h, f, op);
  if (rc != DTRAIN_OK) return rc;
  if (f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE) {
    unsigned char buf[DT__NET_NOTICE_MAX];
    rc = dt__net_read(c->fd, buf, f->length, deadline);
    if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
    return dt__conn_notice(c, f, h, buf, op);
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op) {
  for (;;) {
    dt_result rc = dt__net_read_spin(c->fd, h, DT__NET_HDR, deadline, c->spin_s);
    if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
    rc = dt__conn_header_ok(c, h, f, deadline, op);
    if (rc != DTRAIN_OK || !c->p2p_type || f->type != c->p2p_type || !c->p2p_in) return rc;
    rc = c->p2p_in(c->p2p_arg, c, f, deadline); /* a point-to-point message: its owner takes it */
    if (rc != DTRAIN_OK) return rc;
  }
}

DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op) {
  dt_result rc = dt__net_read(c->fd, buf, f->length, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  return dt__conn_check_payload(c, f, h, buf, op);
}

DTRAIN_PRIVATE dt_result dt__conn_recv_payloadv(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                                const struct iovec *parts, int nparts, double deadline,
                                                const char *op) {
  size_t n = 0;
  for (int i = 0; i < nparts; i++) n += parts[i].iov_len;
  if (n != f->length || f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE)
    return dt__error(DTRAIN_ERR_INTERNAL, "%s: %zu bytes of places for a frame of type 0x%02x and %u bytes",
                     op ? op : "tcp", n, (unsigned)f->type, (unsigned)f->length);
  uint32_t crc = dt__crc32c(0, h, 36);
  for (int i = 0; i < nparts; i++) {
    dt_result rc = dt__net_read(c->fd, parts[i].iov_base, parts[i].iov_len, deadline);
    if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
    if (f->flags & DT__NET_F_PAYLOAD_CRC) crc = dt__crc32c(crc, parts[i].iov_base, parts[i].iov_len);
  }
  if (crc != f->checksum) {
    dt__error(DTRAIN_ERR_PROTOCOL, "checksum mismatch in a frame of type %u", (unsigned)f->type);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  c->recv_seq++;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_recv(dt__conn *c, uint16_t type, void *buf, uint32_t cap, uint32_t *len,
                                       double deadline, const char *op) {
  dt__frame f;
  unsigned char h[DT__NET_HDR];
  dt_result rc = dt__conn_recv_header(c, &f, h, deadline, op);
  if (rc != DTRAIN_OK) return rc;
  if (f.type != type || f.length > cap) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame of type %u and %u bytes, expected type %u and at most %u bytes",
              (unsigned)f.type, (unsigned)f.length, (unsigned)type, (unsigned)cap);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  rc = dt__conn_recv_payload(c, &f, h, buf, deadline, op);
  if (rc == DTRAIN_OK && len) *len = f.length;
  return rc;
}

/* ---- frames moved piecewise on non-blocking sockets ------------------------------------
 * One frame in flight on a connection, moved as the socket allows: how
 * dt__conn_exchange keeps a send and a receive going at once. Start it with
 * dt__xfer_send / dt__xfer_recv (the buffers stay the caller's until it is
 * done); dt__xfer_step sends or receives what the socket takes without
 * blocking, sets *moved when bytes moved, checks a received header (as
 * dt__conn_recv_header, plus exactly the type and length expected) before any
 * payload, and bumps the connection's sequence number when the frame is
 * complete (active drops to 0). When nothing moved, dt__xfer_wait spins (the
 * receiving connection's spin_s, from *spin_until, which the caller resets to
 * -1 whenever bytes moved), then polls the active ones; past the deadline it
 * returns DTRAIN_ERR_TIMEOUT naming the stuck peer. */
typedef struct dt__xfer {
  dt__conn *c;
  unsigned char h[DT__NET_HDR];
  unsigned char *buf;
  uint32_t n;    /* payload bytes */
  uint16_t type; /* sent, or expected */
  int recv, active, checked;
  size_t done;   /* header + payload bytes moved */
} dt__xfer;

static void dt__xfer_send(dt__xfer *x, dt__conn *c, uint16_t type, const void *p, uint32_t n) {
  x->c = c;
  x->recv = 0;
  x->buf = (unsigned char *)(uintptr_t)p;
  x->n = n;
  x->type = type;
  x->done = 0;
  x->active = 1;
  x->checked = 0;
  dt__frame_pack(x->h, type, c->job, c->self_id, c->send_seq, p, n);
}

static void dt__xfer_recv(dt__xfer *x, dt__conn *c, uint16_t type, void *p, uint32_t n) {
  x->c = c;
  x->recv = 1;
  x->buf = (unsigned char *)p;
  x->n = n;
  x->type = type;
  x->done = 0;
  x->active = 1;
  x->checked = 0;
}

/* The header of a frame being received, checked before a byte of payload is read. */
static dt_result dt__xfer_check(dt__xfer *x, double deadline, const char *op) {
  dt__frame f;
  dt_result rc = dt__conn_header_ok(x->c, x->h, &f, deadline, op);
  if (rc != DTRAIN_OK) return rc;
  if (f.type != x->type || f.length != x->n) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame of type %u and %u bytes, expected type %u and %u bytes", (unsigned)f.type,
              (unsigned)f.length, (unsigned)x->type, (unsigned)x->n);
    return dt__conn_fail(x->c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  x->checked = 1;
  return DTRAIN_OK;
}

static dt_result dt__xfer_step(dt__xfer *x, double deadline, const char *op, int *moved) {
  if (!x->active) return DTRAIN_OK;
  size_t total = DT__NET_HDR + (size_t)x->n;
  ssize_t k;
  if (!x->recv) {
    struct iovec iov[2];
    int cnt = 0;
    if (x->done < DT__NET_HDR) {
      iov[cnt].iov_base = x->h + x->done;
      iov[cnt].iov_len = DT__NET_HDR - x->done;
      cnt++;
    }
    if (x->n) {
      size_t po = x->done > DT__NET_HDR ? x->done - DT__NET_HDR : 0;
      iov[cnt].iov_base = x->buf + po;
      iov[cnt].iov_len = x->n - po;
      cnt++;
    }
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)cnt;
    k = dt__sock_sendmsg(x->c->fd, &mh, DT__NET_SEND_FLAGS);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "send failed: %s", dt__sk_strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "send to");
    }
  } else {
    unsigned char *dst = x->done < DT__NET_HDR ? x->h + x->done : x->buf + (x->done - DT__NET_HDR);
    size_t want = x->done < DT__NET_HDR ? DT__NET_HDR - x->done : total - x->done;
    k = dt__sock_recv(x->c->fd, dst, want, 0);
    if (k == 0) {
      dt__error(DTRAIN_ERR_PEER, "connection closed by the peer");
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "receive failed: %s", dt__sk_strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
  }
  if (k <= 0) return DTRAIN_OK;
  x->done += (size_t)k;
  *moved = 1;
  if (x->recv && !x->checked && x->done >= DT__NET_HDR) {
    dt__conn *c = x->c;
    if (c->p2p_type && dt__get_le16(x->h + 6) == c->p2p_type && c->p2p_in) {
      /* A point-to-point message before the expected frame: its owner takes it. */
      dt__frame f;
      dt_result rc = dt__conn_check_header(c, x->h, &f, op);
      if (rc == DTRAIN_OK) rc = c->p2p_in(c->p2p_arg, c, &f, deadline);
      x->done = 0;
      return rc;
    }
    dt_result rc = dt__xfer_check(x, deadline, op);
    if (rc != DTRAIN_OK) return rc;
  }
  if (x->done == total) {
    x->active = 0;
    if (x->recv) x->c->recv_seq++;
    else x->c->send_seq++;
  }
  return DTRAIN_OK;
}

static dt_result dt__xfer_wait(dt__xfer *s, dt__xfer *r, double deadline, double *spin_until, const char *op) {
  double now = dt__now();
  double spin = r && r->active ? r->c->spin_s : s && s->active ? s->c->spin_s : 0.0;
  if (spin > 0) {
    /* As in dt__net_read_spin: the peer's next bytes are usually microseconds
     * away, and waking from poll() (on a VM, an idle vCPU that halted) costs
     * far more. spin_until is reset by the caller whenever data moved. */
    if (*spin_until < 0) *spin_until = DT__MIN(now + spin, deadline);
    if (now < *spin_until) {
      sched_yield();
      return DTRAIN_OK;
    }
  }
  double left = deadline - now;
  if (left <= 0) {
    int recv_stuck = r && r->active;
    dt__xfer *x = recv_stuck ? r : s;
    dt__error(DTRAIN_ERR_TIMEOUT, "%s", recv_stuck ? "nothing received before the deadline (the peer stalled?)"
                                                   : "send did not complete before the deadline");
    return dt__conn_fail(x->c, DTRAIN_ERR_TIMEOUT, op, recv_stuck ? "receive from" : "send to");
  }
  struct pollfd p[2];
  nfds_t np = 0;
  if (s && s->active) {
    p[np].fd = s->c->fd;
    p[np].events = POLLOUT;
    p[np].revents = 0;
    np++;
  }
  if (r && r->active) {
    p[np].fd = r->c->fd;
    p[np].events = POLLIN;
    p[np].revents = 0;
    np++;
  }
  int ms = left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
  if (dt__sock_poll(p, np, ms) < 0 && errno != EINTR) {
    dt__error(DTRAIN_ERR_NET, "poll: %s", dt__sk_strerror(errno));
    return dt__conn_fail(r && r->active ? r->c : s->c, DTRAIN_ERR_NET, op, "exchange with");
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_exchange(dt__conn *to, uint16_t stype, const void *sbuf, uint32_t sn, dt__conn *from,
                                           uint16_t rtype, void *rbuf, uint32_t rn, double deadline, const char *op) {
  dt__xfer s, r;
  dt__xfer_send(&s, to, stype, sbuf, sn);
  dt__xfer_recv(&r, from, rtype, rbuf, rn);
  double spin_until = -1.0;
  dt_result rc = DTRAIN_OK;
  while (rc == DTRAIN_OK && (s.active || r.active)) {
    /* Progress without blocking, then wait for whichever side is stuck. */
    int moved = 0;
    rc = dt__xfer_step(&s, deadline, op, &moved);
    if (rc == DTRAIN_OK) rc = dt__xfer_step(&r, deadline, op, &moved);
    if (rc == DTRAIN_OK && !moved) rc = dt__xfer_wait(&s, &r, deadline, &spin_until, op);
    if (moved) spin_until = -1.0;
  }
  return rc;
}

DTRAIN_PRIVATE void dt__conn_abort(dt__conn *c, dt_result code, const char *reason) {
  if (!c || c->fd < 0) return;
  unsigned char buf[4 + 256];
  size_t tl = reason ? strlen(reason) : 0;
  if (tl > 256) tl = 256;
  dt__put_le32(buf, (uint32_t)(-(int32_t)code));
  if (tl) memcpy(buf + 4, reason, tl);
  /* Best effort within 0.2 s; the error it may raise is not this thread's news. */
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  dt__conn_send(c, DT__MSG_ABORT, buf, (uint32_t)(4 + tl), dt__now() + 0.2, "abort");
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

DTRAIN_PRIVATE void dt__conn_close(dt__conn *c) {
  if (!c) return;
  dt__net_close(c->fd);
  c->fd = -1;
}

#endif /* DTRAIN_NO_NET */
