/* ===========================================================================
 * dt_handshake.c -- the handshake: hello, checks that name both sides,
 * token authentication (HMAC-SHA256 challenge-response), dial and admit
 * (see dt_net_core.h and docs/wire_protocol.md)
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
#    include <fcntl.h>
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <unistd.h>
#  endif

/* ---- the hello and the proof ------------------------------------------------------------------
 * hello payload (little-endian, 128 bytes):
 *   0 u32 role   4 u32 index   8 u32 workers   12 u32 servers
 *  16 u64 model hash   24 u32 flags (bit 0: I have a token; bit 1: my job id was given,
 *         DTRAIN_JOB_ID / options.job_id, not derived from the addresses; version 2)
 *  28 u32 lane (0; 1: the second connection between the two workers of a
 *         2-worker collective, which carries one direction of the ring)
 *  32 nonce[32]   64 addr[64] (NUL-padded: the address the sender believes it has)
 * The proof (AUTH) is HMAC-SHA256(token, "dtrain-auth-1" | side byte ('C' or 'A') |
 * job (8) | connector hello (128) | acceptor hello (128)): it binds both nonces
 * and both identities, so a recorded proof cannot be replayed. (dt__hello, its flags and
 * these functions are declared in dt_net_core.h, for the tests.) */

/* ---- nonces ----------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n) {
  size_t got = 0;
#  if defined(_WIN32) /* the system's generator (advapi32, linked by default) */
  if (n <= 0xffffffffu && RtlGenRandom(out, (ULONG)n)) got = n;
#  else
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    while (got < n) {
      ssize_t k = read(fd, out + got, n - got);
      if (k > 0) got += (size_t)k;
      else if (k < 0 && errno == EINTR) continue;
      else break;
    }
    close(fd);
  }
#  endif
  if (got < n) {
    /* No /dev/urandom: a hash of the time, the pid and a counter (weaker, documented). */
    static DT__ATOMIC(uint64_t) counter;
    unsigned char seed[32];
    double t = dt__now();
#  if defined(_WIN32)
    uint64_t pid = (uint64_t)GetCurrentProcessId();
#  else
    uint64_t pid = (uint64_t)getpid();
#  endif
    uint64_t c = DT__AFETCH_ADD(&counter, (uint64_t)1, DT__MO_RELAXED);
    memcpy(seed, &t, sizeof t);
    memcpy(seed + 8, &pid, 8);
    memcpy(seed + 16, &c, 8);
    memset(seed + 24, 0x5a, 8);
    for (size_t off = got; off < n; off += 32) {
      unsigned char h[32];
      dt__sha256 s;
      dt__sha256_init(&s);
      dt__sha256_update(&s, seed, sizeof seed);
      dt__sha256_update(&s, &off, sizeof off);
      dt__sha256_final(&s, h);
      memcpy(out + off, h, n - off < 32 ? n - off : 32);
    }
  }
}

/* ---- hellos ----------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__hello_pack(const dt__hello *h, unsigned char b[DT__HELLO]) {
  memset(b, 0, DT__HELLO);
  dt__put_le32(b, h->role);
  dt__put_le32(b + 4, h->index);
  dt__put_le32(b + 8, h->workers);
  dt__put_le32(b + 12, h->servers);
  dt__put_le64(b + 16, h->model_hash);
  dt__put_le32(b + 24, h->flags);
  dt__put_le32(b + 28, h->lane);
  memcpy(b + 32, h->nonce, DT__NET_NONCE);
  size_t al = strlen(h->addr);
  memcpy(b + 64, h->addr, al < 63 ? al : 63);
}

DTRAIN_PRIVATE void dt__hello_unpack(const unsigned char b[DT__HELLO], dt__hello *h) {
  h->role = dt__get_le32(b);
  h->index = dt__get_le32(b + 4);
  h->workers = dt__get_le32(b + 8);
  h->servers = dt__get_le32(b + 12);
  h->model_hash = dt__get_le64(b + 16);
  h->flags = dt__get_le32(b + 24);
  h->lane = dt__get_le32(b + 28);
  memcpy(h->nonce, b + 32, DT__NET_NONCE);
  memcpy(h->addr, b + 64, 63);
  h->addr[63] = '\0';
  for (int i = 0; i < 63 && h->addr[i]; i++)
    if ((unsigned char)h->addr[i] < 0x20 || (unsigned char)h->addr[i] > 0x7e) h->addr[i] = '?';
}

static const char *dt__net_role_name(uint32_t role) { return role == DTRAIN_ROLE_PS ? "ps" : "worker"; }

DTRAIN_PRIVATE void dt__hello_self(const dt__net_self *self, dt__hello *h) {
  const dt_cluster *c = self->cluster;
  memset(h, 0, sizeof *h);
  h->role = (uint32_t)c->role;
  h->index = (uint32_t)c->index;
  h->workers = (uint32_t)c->workers;
  h->servers = (uint32_t)c->servers;
  h->model_hash = self->opt.model_hash;
  h->flags = (self->opt.token && self->opt.token[0]) ? DT__HELLO_F_TOKEN : 0u;
  if (self->opt.job_id) h->flags |= DT__HELLO_F_JOB;
  dt__net_random(h->nonce, DT__NET_NONCE);
  const char *a = c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index];
  snprintf(h->addr, sizeof h->addr, "%s", a ? a : "");
}

DTRAIN_PRIVATE void dt__net_proof(const dt__net_self *self, char side, const unsigned char conn_hello[DT__HELLO],
                                  const unsigned char acc_hello[DT__HELLO], unsigned char out[32]) {
  unsigned char msg[14 + 1 + 8 + 2 * DT__HELLO];
  memcpy(msg, "dtrain-auth-1", 13);
  msg[13] = 0;
  msg[14] = (unsigned char)side;
  dt__put_le64(msg + 15, self->job);
  memcpy(msg + 23, conn_hello, DT__HELLO);
  memcpy(msg + 23 + DT__HELLO, acc_hello, DT__HELLO);
  dt__hmac_sha256(self->opt.token, strlen(self->opt.token), msg, sizeof msg, out);
}

static void dt__net_describe(const dt__hello *h, char *buf, size_t cap) {
  snprintf(buf, cap, "%s %u (%.63s)", dt__net_role_name(h->role), (unsigned)h->index, h->addr[0] ? h->addr : "?");
}

/* Compare the peer's hello with ours; "" when compatible, else the reason naming both. */
static void dt__net_compare(const dt__net_self *self, const dt__hello *me, const dt__hello *peer, char *why,
                            size_t cap) {
  char a[128], b[128];
  dt__net_describe(me, a, sizeof a);
  dt__net_describe(peer, b, sizeof b);
  why[0] = '\0';
  if (peer->role > 1) snprintf(why, cap, "%.100s claims an unknown role %u", b, (unsigned)peer->role);
  else if (peer->workers != me->workers || peer->servers != me->servers)
    snprintf(why, cap, "%.100s has a cluster of %u workers and %u servers, %.100s has %u and %u", b, (unsigned)peer->workers,
             (unsigned)peer->servers, a, (unsigned)me->workers, (unsigned)me->servers);
  else if ((peer->role == DTRAIN_ROLE_WORKER && peer->index >= (uint32_t)self->cluster->workers) ||
           (peer->role == DTRAIN_ROLE_PS && peer->index >= (uint32_t)self->cluster->servers))
    snprintf(why, cap, "%.100s has an index out of range", b);
  else if (peer->role == me->role && peer->index == me->index)
    snprintf(why, cap, "%.100s claims the same rank as %.100s (duplicate rank)", b, a);
  else if (self->opt.model_hash && peer->model_hash && peer->model_hash != self->opt.model_hash)
    snprintf(why, cap, "%.100s has model hash %016llx, %.100s has %016llx (different models)", b,
             (unsigned long long)peer->model_hash, a, (unsigned long long)self->opt.model_hash);
  else if (!!self->opt.model_hash != !!peer->model_hash)
    snprintf(why, cap, "%.100s %s a model hash, %.100s %s", b, peer->model_hash ? "sends" : "does not send", a,
             self->opt.model_hash ? "requires one" : "does not check one");
}

static void dt__net_refuse(dt__conn *c, dt_result code, const char *why, double deadline) {
  unsigned char buf[4 + 256];
  size_t tl = strlen(why);
  if (tl > 256) tl = 256;
  dt__put_le32(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  dt__conn_send(c, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), deadline, "refuse");
  dt__error(code, "%s", keep);
}

DTRAIN_PRIVATE dt_result dt__net_dial(const dt__net_self *self, dt_role role, int index, dt__conn *c) {
  return dt__net_dial_lane(self, role, index, 0, c);
}

DTRAIN_PRIVATE dt_result dt__net_dial_lane(const dt__net_self *self, dt_role role, int index, int lane, dt__conn *c) {
  const dt_cluster *cl = self->cluster;
  const char *addr = role == DTRAIN_ROLE_PS ? cl->server_addr[index] : cl->worker_addr[index];
  double start = dt__now(), deadline = start + self->opt.connect_timeout_s;
  char want[128];
  snprintf(want, sizeof want, "%s %d (%.100s)", dt__net_role_name((uint32_t)role), index, addr);
  int fd;
  dt_result rc = dt__net_connect(addr, deadline, &fd);
  if (rc != DTRAIN_OK) return dt__error(rc, "handshake with %s: %s", want, dt_last_error());
  dt__conn_init(c, fd, self->job, self->id, (uint32_t)self->opt.max_payload);
  snprintf(c->peer, sizeof c->peer, "%.95s", want);
  deadline = dt__now() + self->opt.timeout_s;
  dt__hello me, peer;
  unsigned char mine[DT__HELLO], theirs[DT__HELLO], proof[32], expect[32];
  dt__hello_self(self, &me);
  me.lane = (uint32_t)lane;
  dt__hello_pack(&me, mine);
  uint32_t len = 0;
  int have, they;
  char why[DT__MSG_CAP];
  double t0 = dt_time_now(), t3 = 0;
  rc = dt__conn_send(c, DT__MSG_HELLO, mine, DT__HELLO, deadline, "handshake");
  if (rc == DTRAIN_OK) rc = dt__conn_recv(c, DT__MSG_WELCOME, theirs, DT__HELLO, &len, deadline, "handshake");
  t3 = dt_time_now();
  if (rc == DTRAIN_OK && len != DT__HELLO) rc = dt__error(DTRAIN_ERR_PROTOCOL, "handshake: short welcome from %s", want);
  if (rc != DTRAIN_OK) goto fail;
  dt__hello_unpack(theirs, &peer);
  dt__net_compare(self, &me, &peer, why, sizeof why);
  if (!why[0] && (peer.role != (uint32_t)role || peer.index != (uint32_t)index)) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s answered as %s", want, b);
  }
  if (why[0]) {
    rc = dt__error(DTRAIN_ERR_MISMATCH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_MISMATCH, why, deadline);
    goto fail;
  }
  c->peer_role = (int)role;
  c->peer_index = index;
  c->lane = lane;
  have = (me.flags & DT__HELLO_F_TOKEN) != 0;
  they = (peer.flags & DT__HELLO_F_TOKEN) != 0;
  if (have != they) {
    snprintf(why, sizeof why, "%s %s a token, %s %s", want, they ? "requires" : "does not use", "this worker",
             have ? "requires one" : "has none (set DTRAIN_TOKEN)");
    rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_AUTH, why, deadline);
    goto fail;
  }
  if (have) {
    dt__net_proof(self, 'C', mine, theirs, proof);
    rc = dt__conn_send(c, DT__MSG_AUTH, proof, 32, deadline, "handshake");
    if (rc == DTRAIN_OK) rc = dt__conn_recv(c, DT__MSG_AUTH, proof, 32, &len, deadline, "handshake");
    if (rc != DTRAIN_OK) goto fail;
    dt__net_proof(self, 'A', mine, theirs, expect);
    if (len != 32 || !dt__net_ct_equal(proof, expect, 32)) {
      rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s failed to prove it knows the token", want);
      dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication failed", deadline);
      goto fail;
    }
  }
  unsigned char ready[DT__READY_LEN];
  rc = dt__conn_recv(c, DT__MSG_READY, ready, DT__READY_LEN, &len, deadline, "handshake");
  if (rc == DTRAIN_OK) {
    double offset, delay;
    char bad[160];
    if (dt__hs_clock_read(ready, len, t0, t3, &offset, &delay, bad, sizeof bad) != DTRAIN_OK) {
      snprintf(why, sizeof why, "%s sent a READY %s", want, bad);
      rc = dt__error(DTRAIN_ERR_PROTOCOL, "handshake: %s", why);
      goto fail;
    }
    dt__trace_clock_note(role == DTRAIN_ROLE_PS, index, offset, delay);
    rc = dt__netem_attach(c->fd, c->self_id, (int)role, index); /* DTRAIN_NETEM */
  }
  if (rc != DTRAIN_OK) goto fail;
  return DTRAIN_OK;
fail:
  dt__conn_close(c);
  return rc;
}

DTRAIN_PRIVATE dt_result dt__hs_clock_read(const unsigned char *p, uint32_t len, double t0, double t3, double *offset,
                                           double *delay, char *why, size_t cap) {
  *offset = 0;
  *delay = 0;
  if (len != DT__READY_LEN) {
    snprintf(why, cap, "of %u bytes (its clock readings are %d)", (unsigned)len, DT__READY_LEN);
    return DTRAIN_ERR_PROTOCOL;
  }
  uint64_t b1 = dt__get_le64(p), b2 = dt__get_le64(p + 8);
  double t1, t2;
  memcpy(&t1, &b1, sizeof t1);
  memcpy(&t2, &b2, sizeof t2);
  if (!isfinite(t1) || !isfinite(t2) || t1 < 0 || t2 < 0 || t1 > 1e12 || t2 > 1e12) { /* 1e12 s: 30,000 years */
    snprintf(why, cap, "whose clock readings are not times (%g, %g)", t1, t2);
    return DTRAIN_ERR_PROTOCOL;
  }
  /* the acceptor's own time between the hello and the welcome cannot be
   * negative, nor longer than the whole round trip (1 ms of slack for clocks
   * that tick at slightly different rates) */
  if (t2 < t1 || t2 - t1 > (t3 - t0) + 1e-3) {
    snprintf(why, cap, "whose clock readings cannot be (%.6f s between the hello and the welcome, in a round trip of "
             "%.6f s)", t2 - t1, t3 - t0);
    return DTRAIN_ERR_PROTOCOL;
  }
  *offset = 0.5 * ((t1 - t0) + (t2 - t3));
  *delay = (t3 - t0) - (t2 - t1);
  if (*delay < 0) *delay = 0;
  return DTRAIN_OK;
}

/* ---- the acceptor: a non-blocking state machine ----------------------------------------------
 * HELLO: reading the client's hello frame. AUTH: WELCOME queued, reading its
 * proof. SEND: the last answers (AUTH, READY) are queued; done once they are
 * out. REFUSING: a REFUSE frame is queued; failed once it is out (or cannot
 * go). Every check of the blocking handshake is made, in the same order, so
 * the client sees the same answers. (The states, DT__HSS_*: dt_net_core.h.) */

DTRAIN_PRIVATE double dt__net_hs_timeout(const dt__net_self *self) {
  double t = self->opt.handshake_timeout_s > 0 ? self->opt.handshake_timeout_s : 3.0;
  return t < self->opt.timeout_s ? t : self->opt.timeout_s;
}

DTRAIN_PRIVATE void dt__hs_start(dt__hs *h, const dt__net_self *self, int fd, const char *addr, double deadline) {
  memset(h, 0, sizeof *h);
  if (fd >= 0) dt__net_nonblock(fd); /* every step must return at once (sockets we accept already are) */
  dt__conn_init(&h->conn, fd, self->job, self->id, (uint32_t)self->opt.max_payload);
  snprintf(h->addr, sizeof h->addr, "%.80s", addr ? addr : "?");
  snprintf(h->conn.peer, sizeof h->conn.peer, "a client at %.80s", h->addr);
  h->state = DT__HSS_HELLO;
  h->started = dt__now();
  h->deadline = deadline;
}

DTRAIN_PRIVATE short dt__hs_events(const dt__hs *h) {
  return (short)(h->out_off < h->out_len ? POLLOUT : POLLIN);
}

static void dt__hs_queue(dt__hs *h, uint16_t type, const void *p, uint32_t n) {
  if (h->out_len + DT__NET_HDR + n > DT__HS_OUT) return; /* cannot happen: sized for the longest answer */
  dt__frame_pack(h->out + h->out_len, type, h->conn.job, h->conn.self_id, h->conn.send_seq, p, n);
  if (n) memcpy(h->out + h->out_len + DT__NET_HDR, p, n);
  h->out_len += DT__NET_HDR + n;
  h->conn.send_seq++;
}

/* Refuse with the reason already in h->why; tell (may be NULL) is what the client is told. */
static void dt__hs_refuse(dt__hs *h, dt_result code, const char *tell) {
  h->rc = code;
  h->state = DT__HSS_REFUSING;
  if (!tell) return;
  unsigned char buf[4 + 256];
  size_t tl = strlen(tell);
  if (tl > 256) tl = 256;
  dt__put_le32(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, tell, tl);
  dt__hs_queue(h, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl));
}

/* Bytes the current frame still needs (its header first, then the payload it announced). */
static uint32_t dt__hs_want(const dt__hs *h) {
  if (h->in_len < DT__NET_HDR) return DT__NET_HDR - h->in_len;
  return DT__NET_HDR + h->f.length - h->in_len;
}

/* The header is complete: check it against what this state expects. 0 when refused. */
static int dt__hs_header(dt__hs *h) {
  char why[160];
  dt_result rc = dt__frame_unpack(h->in, 0, DT__HS_IN - DT__NET_HDR, &h->f, why, sizeof why);
  if (rc != DTRAIN_OK) {
    snprintf(h->why, sizeof h->why, "receive from %s: %s", h->conn.peer, why);
    dt__hs_refuse(h, rc, h->why);
    return 0;
  }
  const dt__frame *f = &h->f;
  const char *bad = NULL;
  if (f->seq != h->conn.recv_seq) bad = "wrong sequence number";
  else if (h->state == DT__HSS_HELLO && f->type != DT__MSG_HELLO) bad = "expected a hello";
  else if (h->state == DT__HSS_HELLO && f->length != DT__HELLO) bad = "short hello";
  else if (h->state == DT__HSS_AUTH && f->sender != dt__net_id((dt_role)h->conn.peer_role, h->conn.peer_index))
    bad = "sender differs from its hello";
  else if (h->state == DT__HSS_AUTH && f->type != DT__MSG_AUTH && f->type != DT__MSG_REFUSE && f->type != DT__MSG_ABORT)
    bad = "expected its proof";
  else if (h->state == DT__HSS_AUTH && f->type == DT__MSG_AUTH && f->length != 32) bad = "a proof is 32 bytes";
  else if (f->job != h->conn.job && f->type != DT__MSG_HELLO) bad = "frame of another job";
  if (bad) {
    snprintf(h->why, sizeof h->why, "receive from %s: %s (a frame of type %u, %u bytes, sequence number %llu)",
             h->conn.peer, bad, (unsigned)f->type, (unsigned)f->length, (unsigned long long)f->seq);
    dt__hs_refuse(h, f->job != h->conn.job ? DTRAIN_ERR_MISMATCH : DTRAIN_ERR_PROTOCOL, h->why);
    return 0;
  }
  return 1;
}

/* Everything checks: AUTH (with a token) is queued; READY goes now, and the peer is counted. */
static void dt__hs_ready(dt__hs *h, unsigned char *seen) {
  if (seen && h->conn.peer_role == DTRAIN_ROLE_WORKER) {
    /* Another handshake of the same rank may have finished while this one ran. */
    if (seen[h->conn.peer_index] & (1u << h->conn.lane)) {
      snprintf(h->why, sizeof h->why, "%s " DT__NET_ALREADY "%s)", h->conn.peer,
               h->conn.lane ? ", lane 1" : "");
      dt__hs_refuse(h, DTRAIN_ERR_MISMATCH, h->why);
      return;
    }
    seen[h->conn.peer_index] |= (unsigned char)(1u << h->conn.lane);
    h->marked = 1;
  }
  unsigned char ready[DT__READY_LEN];
  uint64_t b1, b2;
  memcpy(&b1, &h->clk_hello, sizeof b1);
  memcpy(&b2, &h->clk_welcome, sizeof b2);
  dt__put_le64(ready, b1);
  dt__put_le64(ready + 8, b2);
  dt__hs_queue(h, DT__MSG_READY, ready, DT__READY_LEN);
  h->state = DT__HSS_SEND;
}

/* The client's hello, complete and checksummed. */
static void dt__hs_on_hello(dt__hs *h, const dt__net_self *self, unsigned char *seen) {
  dt__hello me, peer;
  char why[DT__MSG_CAP];
  h->clk_hello = dt_time_now();
  memcpy(h->theirs, h->in + DT__NET_HDR, DT__HELLO);
  dt__hello_unpack(h->theirs, &peer);
  if (h->f.job != self->job) {
    /* Another job: say whether the client had a job id at all (a process
     * started outside this job's launcher has none) or a different one. */
    if (self->opt.job_id && !(peer.flags & DT__HELLO_F_JOB))
      snprintf(h->why, sizeof h->why, "%s has no job id (DTRAIN_JOB_ID is not set: not started by this job's "
               "launcher?); this job is %016llx", h->conn.peer, (unsigned long long)self->job);
    else
      snprintf(h->why, sizeof h->why, "%s belongs to job %016llx, this is job %016llx (a different DTRAIN_JOB_ID "
               "or cluster)", h->conn.peer, (unsigned long long)h->f.job, (unsigned long long)self->job);
    dt__hs_refuse(h, DTRAIN_ERR_MISMATCH, h->why);
    return;
  }
  dt__hello_self(self, &me);
  dt__hello_pack(&me, h->mine);
  dt__net_compare(self, &me, &peer, why, sizeof why);
  if (!why[0] && peer.lane > 1) {
    snprintf(why, sizeof why, "lane %u in the hello (only 0 and 1 exist)", (unsigned)peer.lane);
  } else if (!why[0] && peer.lane == 1 &&
             (peer.role != DTRAIN_ROLE_WORKER || me.role != DTRAIN_ROLE_WORKER || me.workers != 2)) {
    snprintf(why, sizeof why, "a second connection (lane 1) is only for the two workers of a 2-worker job");
  }
  if (!why[0] && seen && peer.role == DTRAIN_ROLE_WORKER && (seen[peer.index] & DT__NET_SEEN_LEFT)) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s already finished (it said BYE): its rank cannot join again", b);
  }
  if (!why[0] && seen && peer.role == DTRAIN_ROLE_WORKER && (seen[peer.index] & (1u << peer.lane))) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s " DT__NET_ALREADY "%s)", b, peer.lane ? ", lane 1" : "");
  }
  if (why[0]) {
    snprintf(h->why, sizeof h->why, "%s", why);
    dt__hs_refuse(h, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  dt__net_describe(&peer, h->conn.peer, sizeof h->conn.peer);
  h->conn.peer_role = (int)peer.role;
  h->conn.peer_index = (int)peer.index;
  h->conn.lane = (int)peer.lane;
  h->clk_welcome = dt_time_now();
  dt__hs_queue(h, DT__MSG_WELCOME, h->mine, DT__HELLO);
  int have = (me.flags & DT__HELLO_F_TOKEN) != 0, they = (peer.flags & DT__HELLO_F_TOKEN) != 0;
  if (have != they) {
    /* The connector sees the same difference in our welcome and refuses; when
     * it has no token we refuse here too, so a peer without one never gets in. */
    snprintf(h->why, sizeof h->why, "%s %s, this process %s", h->conn.peer, they ? "uses a token" : "has no token",
             have ? "requires one" : "has none");
    dt__hs_refuse(h, DTRAIN_ERR_AUTH, "authentication required");
    return;
  }
  if (have) {
    h->state = DT__HSS_AUTH;
    return;
  }
  dt__hs_ready(h, seen);
}

/* A complete frame (header checked, payload in h->in). */
static void dt__hs_on_frame(dt__hs *h, const dt__net_self *self, unsigned char *seen) {
  const unsigned char *pl = h->in + DT__NET_HDR;
  uint32_t n = h->f.length;
  if (!dt__frame_payload_ok(h->in, &h->f, pl)) {
    snprintf(h->why, sizeof h->why, "receive from %s: checksum mismatch in a frame of type %u", h->conn.peer,
             (unsigned)h->f.type);
    dt__hs_refuse(h, DTRAIN_ERR_PROTOCOL, h->why);
    return;
  }
  h->conn.recv_seq++;
  h->in_len = 0;
  if (h->f.type == DT__MSG_HELLO) {
    dt__hs_on_hello(h, self, seen);
    return;
  }
  if (h->f.type == DT__MSG_REFUSE || h->f.type == DT__MSG_ABORT) {
    /* The client gave up on us (it saw something in our welcome it refuses). */
    char text[257];
    size_t tl = n >= 4 ? n - 4 : 0;
    if (tl > 256) tl = 256;
    if (tl) memcpy(text, pl + 4, tl);
    text[tl] = '\0';
    for (size_t i = 0; i < tl; i++)
      if ((unsigned char)text[i] < 0x20 || (unsigned char)text[i] > 0x7e) text[i] = '?';
    dt_result their = n >= 4 ? (dt_result)(-(int32_t)dt__get_le32(pl)) : DTRAIN_ERR_PROTOCOL;
    if (their != DTRAIN_ERR_AUTH && their != DTRAIN_ERR_MISMATCH && their != DTRAIN_ERR_PROTOCOL) their = DTRAIN_ERR_PEER;
    snprintf(h->why, sizeof h->why, "refused by %s: %.200s", h->conn.peer, text);
    dt__hs_refuse(h, their, NULL);
    return;
  }
  /* The proof. */
  unsigned char expect[32], proof[32];
  dt__net_proof(self, 'C', h->theirs, h->mine, expect);
  if (!dt__net_ct_equal(pl, expect, 32)) {
    snprintf(h->why, sizeof h->why, "%s failed to prove it knows the token", h->conn.peer);
    dt__hs_refuse(h, DTRAIN_ERR_AUTH, "authentication failed");
    return;
  }
  dt__net_proof(self, 'A', h->theirs, h->mine, proof);
  dt__hs_queue(h, DT__MSG_AUTH, proof, 32);
  dt__hs_ready(h, seen);
}

DTRAIN_PRIVATE size_t dt__hs_feed(dt__hs *h, const dt__net_self *self, unsigned char *seen, const unsigned char *p,
                                  size_t n) {
  size_t used = 0;
  while (used < n && (h->state == DT__HSS_HELLO || h->state == DT__HSS_AUTH)) {
    uint32_t want = dt__hs_want(h);
    size_t k = n - used < want ? n - used : want;
    int had_hdr = h->in_len >= DT__NET_HDR;
    memcpy(h->in + h->in_len, p + used, k);
    h->in_len += (uint32_t)k;
    used += k;
    if (!had_hdr && h->in_len >= 4 && h->in_len < DT__NET_HDR && dt__get_le32(h->in) != DT__NET_MAGIC) {
      /* Not a dtrain frame: say so now, not after 40 bytes that may never come. */
      unsigned char pad[DT__NET_HDR];
      char why[160];
      dt__frame f;
      memset(pad, 0, sizeof pad);
      memcpy(pad, h->in, h->in_len);
      dt__frame_unpack(pad, 0, 0, &f, why, sizeof why);
      snprintf(h->why, sizeof h->why, "receive from %s: %s", h->conn.peer, why);
      dt__hs_refuse(h, DTRAIN_ERR_PROTOCOL, h->why);
      break;
    }
    if (!had_hdr && h->in_len == DT__NET_HDR && !dt__hs_header(h)) break;
    if (h->in_len >= DT__NET_HDR && h->in_len == DT__NET_HDR + h->f.length) dt__hs_on_frame(h, self, seen);
  }
  return used;
}

static int dt__hs_fail(dt__hs *h, const dt__net_self *self, unsigned char *seen) {
  if (h->marked && seen && h->conn.peer_index >= 0)
    seen[h->conn.peer_index] &= (unsigned char)~(1u << h->conn.lane);
  h->marked = 0;
  dt__conn_close(&h->conn);
  h->state = DT__HSS_FAILED;
  if (h->rc == DTRAIN_OK) h->rc = DTRAIN_ERR_PROTOCOL;
  dt__error(h->rc, "handshake: %s", h->why);
  if (!self->opt.quiet) dt__log(DTRAIN_LOG_WARN, h->rc, "refused a connection: handshake: %s", h->why);
  return DT__HS_FAILED;
}

DTRAIN_PRIVATE int dt__hs_victim(const dt__hs *h, int n) {
  int old = -1, silent = -1;
  for (int j = 0; j < n; j++) {
    if (old < 0 || h[j].started < h[old].started) old = j;
    int mute = h[j].state == DT__HSS_HELLO && h[j].in_len == 0;
    if (mute && (silent < 0 || h[j].started < h[silent].started)) silent = j;
  }
  return silent >= 0 ? silent : old;
}

DTRAIN_PRIVATE void dt__hs_drop(dt__hs *h, const dt__net_self *self, dt_result code, const char *why) {
  if (h->state == DT__HSS_DONE || h->state == DT__HSS_FAILED) return;
  h->rc = code;
  snprintf(h->why, sizeof h->why, "%s: %s", h->conn.peer, why);
  dt__hs_fail(h, self, NULL);
}

DTRAIN_PRIVATE int dt__hs_step(dt__hs *h, const dt__net_self *self, unsigned char *seen) {
  for (;;) {
    if (h->state == DT__HSS_DONE) return DT__HS_DONE;
    if (h->state == DT__HSS_FAILED) return DT__HS_FAILED;
    if (h->out_off < h->out_len) {
      ssize_t k = dt__sk_send(h->conn.fd, h->out + h->out_off, h->out_len - h->out_off, DT__NET_SEND_FLAGS);
      if (k > 0) {
        h->out_off += (uint32_t)k;
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (h->state != DT__HSS_REFUSING) {
        h->rc = DTRAIN_ERR_PEER;
        snprintf(h->why, sizeof h->why, "send to %s: %s", h->conn.peer, k < 0 ? dt__sk_strerror(errno) : "connection closed");
      }
      return dt__hs_fail(h, self, seen);
    }
    if (h->state == DT__HSS_REFUSING) return dt__hs_fail(h, self, seen);
    if (h->state == DT__HSS_SEND) {
      /* A client that gave up while its connection waited in our backlog
       * (its deadline passed, it was killed, it restarts) has sent its
       * hello and closed: its end-of-file already follows the hello. Without
       * a token nothing more is read from it, so look now: admitting it
       * would take its rank's place and refuse the live process that dials
       * next as a duplicate. (A real client's next frame may be there too:
       * peeked, not taken.) With a token it sent its proof after our
       * challenge, so it did not give up before we accepted it: a close now
       * is a client that finished its handshake (it may close as soon as it
       * has our READY), not one to refuse. */
      char b;
      const int proved = self->opt.token && self->opt.token[0];
      ssize_t k = proved ? -1 : dt__sk_recv(h->conn.fd, &b, 1, MSG_PEEK) /* the socket is non-blocking */;
      if (!proved && (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))) {
        h->rc = DTRAIN_ERR_PEER;
        snprintf(h->why, sizeof h->why, "%s closed the connection after its handshake (%s: a client that gave up "
                 "while it waited in the backlog)", h->conn.peer, k == 0 ? "end of file" : dt__sk_strerror(errno));
        return dt__hs_fail(h, self, seen);
      }
      if (dt__netem_attach(h->conn.fd, self->id, h->conn.peer_role, h->conn.peer_index) != DTRAIN_OK) {
        h->rc = dt_last_result();
        snprintf(h->why, sizeof h->why, "%s", dt_last_error());
        return dt__hs_fail(h, self, seen);
      }
      h->state = DT__HSS_DONE;
      h->marked = 0;
      return DT__HS_DONE;
    }
    unsigned char buf[DT__HS_IN];
    uint32_t want = dt__hs_want(h);
    ssize_t k = dt__sk_recv(h->conn.fd, buf, want, 0);
    if (k > 0) {
      dt__hs_feed(h, self, seen, buf, (size_t)k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    h->rc = k == 0 ? DTRAIN_ERR_PEER : DTRAIN_ERR_NET;
    snprintf(h->why, sizeof h->why, "receive from %s: %s after %u bytes of its %s", h->conn.peer,
             k == 0 ? "connection closed" : dt__sk_strerror(errno), (unsigned)h->in_len,
             h->state == DT__HSS_HELLO ? "hello" : "proof");
    return dt__hs_fail(h, self, seen);
  }
  double now = dt__now();
  if (now >= h->deadline) {
    h->rc = DTRAIN_ERR_TIMEOUT;
    if (h->state == DT__HSS_HELLO || h->state == DT__HSS_AUTH)
      snprintf(h->why, sizeof h->why, "%s sent %u bytes of its %s in %.1f s (handshake deadline; slow or silent)",
               h->conn.peer, (unsigned)h->in_len, h->state == DT__HSS_HELLO ? "hello" : "proof", now - h->started);
    else
      snprintf(h->why, sizeof h->why, "%s read nothing of our answer in %.1f s (handshake deadline)", h->conn.peer,
               now - h->started);
    return dt__hs_fail(h, self, seen);
  }
  return DT__HS_BUSY;
}

DTRAIN_PRIVATE dt_result dt__net_admit(const dt__net_self *self, int fd, const char *addr, double deadline,
                                       unsigned char *seen, dt__conn *c) {
  dt__hs h;
  dt__hs_start(&h, self, fd, addr, deadline);
  for (;;) {
    int r = dt__hs_step(&h, self, seen);
    if (r == DT__HS_DONE) {
      *c = h.conn;
      return DTRAIN_OK;
    }
    if (r == DT__HS_FAILED) {
      dt__conn_init(c, -1, self->job, self->id, (uint32_t)self->opt.max_payload);
      return h.rc;
    }
    struct pollfd p;
    p.fd = fd;
    p.events = dt__hs_events(&h);
    p.revents = 0;
    double left = h.deadline - dt__now();
    int ms = left > 0 ? (int)(left * 1000.0) + 1 : 0;
    if (dt__sk_poll(&p, 1, ms) < 0 && errno != EINTR) {
      h.rc = DTRAIN_ERR_NET;
      snprintf(h.why, sizeof h.why, "poll: %s", dt__sk_strerror(errno));
      dt__hs_fail(&h, self, seen);
      dt__conn_init(c, -1, self->job, self->id, (uint32_t)self->opt.max_payload);
      return h.rc;
    }
  }
}

#endif /* DTRAIN_NO_NET */
