/* ===========================================================================
 * dt_net.c -- the TCP transport's options and this process's identity in the
 * cluster: dt_net_defaults, the resolved options, the job id, sender ids
 * (see dt_net_core.h)
 * ===========================================================================
 * The transport itself is in dt_net_bytes.c, dt_hash.c and dt_frame.c (the
 * bytes on the wire), dt_socket.c, dt_conn.c and dt_handshake.c.
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

#if !defined(DTRAIN_NO_DIST) /* the peers' identity and set-up; only dt_net_defaults stays (plain values) */

DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index) {
  return role == DTRAIN_ROLE_PS ? DT__NET_SERVER_ID0 + (uint32_t)index : (uint32_t)index;
}

#ifndef DTRAIN_NO_NET

DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o) {
  memset(self, 0, sizeof *self);
  if (!c) return dt__error(DTRAIN_ERR_NULL_ARG, "cluster is NULL");
  if (c->workers < 1 || c->servers < 0 || c->workers + c->servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster of %d workers and %d servers", c->workers, c->servers);
  if (c->index < 0 || c->index >= (c->role == DTRAIN_ROLE_PS ? c->servers : c->workers))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "this process's index %d is out of range for its role", c->index);
  self->cluster = c;
  dt_net_options d = dt_net_defaults();
  if (o) {
    if (o->timeout_s > 0) d.timeout_s = o->timeout_s;
    if (o->connect_timeout_s > 0) d.connect_timeout_s = o->connect_timeout_s;
    else if (o->timeout_s > 0) d.connect_timeout_s = o->timeout_s;
    if (o->token) d.token = o->token;
    if (o->job_id) d.job_id = o->job_id;
    d.model_hash = o->model_hash;
    if (o->listen_fd > 0) d.listen_fd = o->listen_fd;
    if (o->max_payload) d.max_payload = o->max_payload;
    if (o->chunk_bytes) d.chunk_bytes = o->chunk_bytes;
    if (o->spin_us != 0) d.spin_us = o->spin_us;
    if (o->sock_buf_bytes != 0) d.sock_buf_bytes = o->sock_buf_bytes;
    if (o->small_bytes) d.small_bytes = o->small_bytes;
    if (o->handshake_timeout_s > 0) d.handshake_timeout_s = o->handshake_timeout_s;
    d.quiet = o->quiet;
  }
  if (d.max_payload > 0xFFFFFFF0u) d.max_payload = 0xFFFFFFF0u;
  self->opt = d;
  dt_result nrc = dt__netem_check_env(); /* a bad DTRAIN_NETEM fails here, before any connection */
  if (nrc != DTRAIN_OK) return nrc;
  if (d.job_id) {
    self->job = d.job_id;
  } else {
    /* FNV-1a over every address, each followed by a 0xFF byte: processes of
     * the same cluster agree. */
    static const unsigned char end = 0xFF;
    uint64_t h = DT__FNV64_OFFSET;
    for (int r = 0; r < c->workers + c->servers; r++) {
      const char *a = r < c->workers ? c->worker_addr[r] : c->server_addr[r - c->workers];
      if (a) h = dt__fnv1a64(h, a, strlen(a));
      h = dt__fnv1a64(h, &end, 1);
    }
    self->job = h ? h : 1;
  }
  self->id = dt__net_id(c->role, c->index);
  return DTRAIN_OK;
}

/* Listening where others can reach us without a token: say what that allows, once per socket. */
static void dt__net_warn_open(const dt__net_self *self, int fd) {
  char addr[DT__NET_ADDR];
  if (self->opt.token && self->opt.token[0]) return;
  if (dt__net_local(fd, addr, sizeof addr) != 0) return; /* loopback (or unknown): this machine only */
  const dt_cluster *c = self->cluster;
  dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_AUTH,
          "%s %d: listening on %s, which is not a loopback address, without a token (DTRAIN_TOKEN): anyone who can "
          "reach it can join the job as a peer, read the parameters and send updates; set DTRAIN_TOKEN (dtrain-launch "
          "makes one) or bind 127.0.0.1", c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->index, addr);
}

DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd) {
  if (self->opt.listen_fd >= 0) {
    *fd = self->opt.listen_fd;
    dt__net_nonblock(*fd);
    dt__net_warn_open(self, *fd);
    return DTRAIN_OK;
  }
  const dt_cluster *c = self->cluster;
  dt_result rc = dt__net_listen(c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index], fd);
  if (rc == DTRAIN_OK) dt__net_warn_open(self, *fd);
  return rc;
}

#else /* DTRAIN_NO_NET */

DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o) {
  (void)self;
  (void)c;
  (void)o;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "networking is not compiled in (DTRAIN_NO_NET)");
}

#endif /* DTRAIN_NO_NET */

#endif /* DTRAIN_NO_DIST */

/* ---- defaults ------------------------------------------------------------------------------ */
DTRAIN_API dt_net_options dt_net_defaults(void) {
  dt_net_options o;
  memset(&o, 0, sizeof o);
  o.timeout_s = 30.0;
  o.listen_fd = -1;
  o.max_payload = (size_t)256 << 20;
  o.chunk_bytes = (size_t)512 << 10;
  o.small_bytes = (size_t)64 << 10;
  o.spin_us = 20.0;
  o.sock_buf_bytes = (int64_t)4 << 20;
  o.handshake_timeout_s = 3.0;
#ifndef DTRAIN_NO_STDIO
  const char *e = getenv("DTRAIN_TIMEOUT");
  if (e && atof(e) > 0) o.timeout_s = atof(e);
  e = getenv("DTRAIN_TOKEN");
  if (e && *e) o.token = e;
  e = getenv("DTRAIN_JOB_ID");
  if (e && *e) o.job_id = (uint64_t)strtoull(e, NULL, 0);
  e = getenv("DTRAIN_SPIN_US");
  if (e && *e) o.spin_us = atof(e);
  e = getenv("DTRAIN_SOCKBUF");
  if (e && *e) o.sock_buf_bytes = atoll(e) > 0 ? (int64_t)atoll(e) : -1;
  e = getenv("DTRAIN_HANDSHAKE_TIMEOUT");
  if (e && atof(e) > 0) o.handshake_timeout_s = atof(e);
  e = getenv("DTRAIN_LISTEN_FD");
  if (e && *e) o.listen_fd = atoi(e);
#endif
  o.connect_timeout_s = o.timeout_s;
  return o;
}
