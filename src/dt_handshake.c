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
#  include <fcntl.h>
#  include <unistd.h>

/* ---- the hello and the proof ------------------------------------------------------------------
 * hello payload (little-endian, 128 bytes):
 *   0 u32 role   4 u32 index   8 u32 workers   12 u32 servers
 *  16 u64 model hash   24 u32 flags (bit 0: I have a token)
 *  28 u32 lane (0; 1: the second connection between the two workers of a
 *         2-worker collective, which carries one direction of the ring)
 *  32 nonce[32]   64 addr[64] (NUL-padded: the address the sender believes it has)
 * The proof (AUTH) is HMAC-SHA256(token, "dtrain-auth-1" | side byte ('C' or 'A') |
 * job (8) | connector hello (128) | acceptor hello (128)): it binds both nonces
 * and both identities, so a recorded proof cannot be replayed. */
#  define DT__HELLO 128
#  define DT__HELLO_F_TOKEN 1u

typedef struct dt__hello {
  uint32_t role, index, workers, servers;
  uint64_t model_hash;
  uint32_t flags;
  uint32_t lane;
  unsigned char nonce[DT__NET_NONCE];
  char addr[64];
} dt__hello;

/* ---- nonces ----------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n) {
  size_t got = 0;
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
  if (got < n) {
    /* No /dev/urandom: a hash of the time, the pid and a counter (weaker, documented). */
    static DT__ATOMIC(uint64_t) counter;
    unsigned char seed[32];
    double t = dt__now();
    uint64_t pid = (uint64_t)getpid(), c = DT__AFETCH_ADD(&counter, (uint64_t)1, DT__MO_RELAXED);
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

static void dt__hello_pack(const dt__hello *h, unsigned char b[DT__HELLO]) {
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

static void dt__hello_unpack(const unsigned char b[DT__HELLO], dt__hello *h) {
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

static void dt__hello_self(const dt__net_self *self, dt__hello *h) {
  const dt_cluster *c = self->cluster;
  memset(h, 0, sizeof *h);
  h->role = (uint32_t)c->role;
  h->index = (uint32_t)c->index;
  h->workers = (uint32_t)c->workers;
  h->servers = (uint32_t)c->servers;
  h->model_hash = self->opt.model_hash;
  h->flags = (self->opt.token && self->opt.token[0]) ? DT__HELLO_F_TOKEN : 0u;
  dt__net_random(h->nonce, DT__NET_NONCE);
  const char *a = c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index];
  snprintf(h->addr, sizeof h->addr, "%s", a ? a : "");
}

static void dt__net_proof(const dt__net_self *self, char side, const unsigned char conn_hello[DT__HELLO],
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
  rc = dt__conn_send(c, DT__MSG_HELLO, mine, DT__HELLO, deadline, "handshake");
  if (rc == DTRAIN_OK) rc = dt__conn_recv(c, DT__MSG_WELCOME, theirs, DT__HELLO, &len, deadline, "handshake");
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
  rc = dt__conn_recv(c, DT__MSG_READY, NULL, 0, &len, deadline, "handshake");
  if (rc != DTRAIN_OK) goto fail;
  return DTRAIN_OK;
fail:
  dt__conn_close(c);
  return rc;
}

DTRAIN_PRIVATE dt_result dt__net_admit(const dt__net_self *self, int fd, const char *addr, double deadline,
                                       unsigned char *seen, dt__conn *c) {
  dt__conn_init(c, fd, self->job, self->id, (uint32_t)self->opt.max_payload);
  snprintf(c->peer, sizeof c->peer, "a client at %.80s", addr ? addr : "?");
  dt__hello me, peer;
  unsigned char mine[DT__HELLO], theirs[DT__HELLO], proof[32], expect[32];
  uint32_t len = 0;
  int have, they;
  char why[DT__MSG_CAP];
  /* The hello is the first frame: a cap of one hello keeps strangers from making us allocate or read much. */
  uint32_t keep_max = c->max_payload;
  c->max_payload = DT__HELLO;
  dt_result rc = dt__conn_recv(c, DT__MSG_HELLO, theirs, DT__HELLO, &len, deadline, "handshake");
  c->max_payload = keep_max;
  if (rc == DTRAIN_OK && len != DT__HELLO) rc = dt__error(DTRAIN_ERR_PROTOCOL, "handshake: short hello from %s", c->peer);
  if (rc != DTRAIN_OK) {
    /* Garbage or a wrong version: answer once (best effort), so a confused client learns why. */
    snprintf(why, sizeof why, "%s", dt_last_error());
    if (rc == DTRAIN_ERR_PROTOCOL || rc == DTRAIN_ERR_MISMATCH) dt__net_refuse(c, rc, why, dt__now() + 0.2);
    goto refused;
  }
  dt__hello_unpack(theirs, &peer);
  dt__hello_self(self, &me);
  dt__hello_pack(&me, mine);
  dt__net_compare(self, &me, &peer, why, sizeof why);
  if (!why[0] && peer.lane > 1) {
    snprintf(why, sizeof why, "lane %u in the hello (only 0 and 1 exist)", (unsigned)peer.lane);
  } else if (!why[0] && peer.lane == 1 &&
             (peer.role != DTRAIN_ROLE_WORKER || me.role != DTRAIN_ROLE_WORKER || me.workers != 2)) {
    snprintf(why, sizeof why, "a second connection (lane 1) is only for the two workers of a 2-worker job");
  }
  if (!why[0] && seen && peer.role == DTRAIN_ROLE_WORKER && (seen[peer.index] & (1u << peer.lane))) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s is already connected (duplicate rank%s)", b, peer.lane ? ", lane 1" : "");
  }
  if (why[0]) {
    rc = dt__error(DTRAIN_ERR_MISMATCH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_MISMATCH, why, deadline);
    goto refused;
  }
  dt__net_describe(&peer, c->peer, sizeof c->peer);
  c->peer_role = (int)peer.role;
  c->peer_index = (int)peer.index;
  c->lane = (int)peer.lane;
  rc = dt__conn_send(c, DT__MSG_WELCOME, mine, DT__HELLO, deadline, "handshake");
  if (rc != DTRAIN_OK) goto refused;
  have = (me.flags & DT__HELLO_F_TOKEN) != 0;
  they = (peer.flags & DT__HELLO_F_TOKEN) != 0;
  if (have != they) {
    /* The connector sees the same difference in our welcome and refuses; when
     * it has no token we refuse here too, so a peer without one never gets in. */
    rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s %s, this process %s", c->peer,
                   they ? "uses a token" : "has no token", have ? "requires one" : "has none");
    dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication required", deadline);
    goto refused;
  }
  if (have) {
    rc = dt__conn_recv(c, DT__MSG_AUTH, proof, 32, &len, deadline, "handshake");
    if (rc != DTRAIN_OK) goto refused;
    dt__net_proof(self, 'C', theirs, mine, expect);
    if (len != 32 || !dt__net_ct_equal(proof, expect, 32)) {
      rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s failed to prove it knows the token", c->peer);
      dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication failed", deadline);
      goto refused;
    }
    dt__net_proof(self, 'A', theirs, mine, proof);
    rc = dt__conn_send(c, DT__MSG_AUTH, proof, 32, deadline, "handshake");
    if (rc != DTRAIN_OK) goto refused;
  }
  rc = dt__conn_send(c, DT__MSG_READY, NULL, 0, deadline, "handshake");
  if (rc != DTRAIN_OK) goto refused;
  if (seen && peer.role == DTRAIN_ROLE_WORKER) seen[peer.index] |= (unsigned char)(1u << peer.lane);
  return DTRAIN_OK;
refused:
  if (!self->opt.quiet) dt__log(DTRAIN_LOG_WARN, rc, "refused a connection: %s", dt_last_error());
  dt__conn_close(c);
  return rc;
}


#endif /* DTRAIN_NO_NET */
