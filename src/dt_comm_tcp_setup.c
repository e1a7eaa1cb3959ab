/* ===========================================================================
 * dt_comm_tcp_setup.c -- the TCP communicator's start-up: the rendezvous of
 * the workers (dial the lower ranks, admit the higher ones), create and free
 * (dt_comm_create_tcp; see dt_comm_tcp_core.h)
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

#if !defined(DTRAIN_NO_NET)
#  if !defined(_WIN32)
#    include <fcntl.h>
#    include <sys/socket.h>
#    include <unistd.h>
#  endif

/* tools/dtrain-launch binds every process's port and hands the listening
 * socket over (DTRAIN_LISTEN_FD) for the one world the process joins. Left
 * open after that world has formed, the kernel would go on completing
 * connections into its backlog that nobody accepts: a stranger, a scanner or
 * a restarted peer dialing the port would hang there until its own timeout.
 * So it is closed here -- by putting a fresh, unbound socket in its place
 * (dup2), which drops the listener (connections are refused, and the ones
 * waiting in the backlog are reset) while the descriptor number stays taken:
 * a later dt_net_defaults() still reads DTRAIN_LISTEN_FD and must not pick up
 * whatever file would reuse the number (it finds a socket that does not
 * listen: nothing to accept, and this function leaves it alone). A listen_fd
 * the caller passed itself, not the environment's, stays the caller's. */
DTRAIN_PRIVATE void dt__net_retire_handed_listener(const dt__net_self *self) {
#  if !defined(DTRAIN_NO_STDIO) && !defined(_WIN32) /* (Windows: the launcher hands no socket over) */
  int fd = self->opt.listen_fd, listening = 0, stand_in;
  socklen_t len = sizeof listening;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  const char *e = getenv("DTRAIN_LISTEN_FD");
  if (fd < 0 || !e || !*e || atoi(e) != fd) return; /* none, or the caller's own */
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) return;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) return;
  stand_in = socket(ss.ss_family, SOCK_STREAM, 0);
  if (stand_in < 0 || dup2(stand_in, fd) < 0) {
    /* no descriptor to spare: at least stop listening (Linux resets the backlog) */
    shutdown(fd, SHUT_RDWR);
  } else {
    fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  if (stand_in >= 0) close(stand_in);
#  else
  (void)self; /* no environment read: a listen_fd is always the caller's */
#  endif
}
#endif /* DTRAIN_NO_NET */

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#  endif

/* A handshake finished (r: DT__HS_DONE or _FAILED, already logged): keep the
 * peer when it is one this rank waits for. 1 when it was kept. */
static int dt__tcp_admitted(dt__comm_tcp *t, dt__hs *h, int r, unsigned char *seen) {
  const int rank = t->self.cluster->index, world = t->self.cluster->workers;
  if (r != DT__HS_DONE) return 0;
  dt__conn c = h->conn;
  if (c.peer_role != DTRAIN_ROLE_WORKER || c.peer_index <= rank) {
    /* Lower ranks are dialed by this rank; servers do not belong here. */
    if (!t->self.opt.quiet)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "worker %d: refused %s: it should not dial this rank", rank,
              c.peer);
    if (c.peer_role == DTRAIN_ROLE_WORKER && c.peer_index >= 0 && c.peer_index < world)
      seen[c.peer_index] &= (unsigned char)~(1u << c.lane);
    dt__conn_close(&c);
    return 0;
  }
  if (c.lane == 1) t->lane2 = c; /* admitted only with 2 workers: from worker 1 */
  else t->conns[c.peer_index] = c;
  return 1;
}

/* Rank r dials ranks 0..r-1, then admits r+1..world-1. The handshakes of
 * the admitted run side by side, non-blocking (dt__hs): strangers that say
 * nothing, or a byte a second, or a hello and then nothing, hold a slot until
 * their short handshake deadline and never delay the real peers. */
static dt_result dt__tcp_connect_all(dt__comm_tcp *t) {
  const dt_cluster *cl = t->self.cluster;
  int world = cl->workers, r = cl->index, lfd = -1, own_lfd = 0, np = 0;
  const unsigned all = t->lanes == 2 ? 3u : 1u; /* the lanes' bits in seen[] */
  int need = (world - 1 - r) * t->lanes;
  double start = dt__now();
  double deadline = start + t->self.opt.connect_timeout_s + t->self.opt.timeout_s;
  unsigned char *seen = NULL;
  dt__hs *pend = NULL;
  struct pollfd pf[DT__NET_PENDING_MAX + 1];
  dt_result rc = DTRAIN_OK;
  if (need > 0) {
    /* Listen before dialing so higher ranks' connections wait in the backlog. */
    rc = dt__net_self_listen(&t->self, &lfd);
    if (rc != DTRAIN_OK) goto done;
    own_lfd = t->self.opt.listen_fd < 0;
    seen = (unsigned char *)dt__calloc((size_t)world);
    pend = (dt__hs *)dt__alloc((size_t)DT__NET_PENDING_MAX * sizeof(dt__hs));
    if (!seen || !pend) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "out of memory");
      goto done;
    }
  }
  for (int j = 0; j < r; j++) {
    rc = dt__net_dial(&t->self, DTRAIN_ROLE_WORKER, j, &t->conns[j]);
    if (rc != DTRAIN_OK) goto done;
  }
  if (t->lanes == 2 && r == 1) {
    rc = dt__net_dial_lane(&t->self, DTRAIN_ROLE_WORKER, 0, 1, &t->lane2);
    if (rc != DTRAIN_OK) goto done;
  }
  while (need > 0) {
    double now = dt__now();
    if (now >= deadline) {
      char miss[200];
      size_t used = 0;
      miss[0] = '\0';
      for (int j = r + 1; j < world; j++) {
        if (seen[j] == all) continue;
        int k = snprintf(miss + used, sizeof miss - used, "%s%d", used ? ", " : "", j);
        if (k < 0 || (size_t)k >= sizeof miss - used) break;
        used += (size_t)k;
      }
      rc = dt__error(DTRAIN_ERR_TIMEOUT, "worker %s did not connect before the deadline (%.1f s)", miss,
                     deadline - start);
      goto done;
    }
    pf[0].fd = lfd;
    pf[0].events = POLLIN;
    pf[0].revents = 0;
    int ms = (int)((deadline - now) * 1000.0) + 1;
    if (ms > 100) ms = 100; /* also re-checks the handshakes' deadlines */
    for (int q = 0; q < np; q++) {
      pf[1 + q].fd = pend[q].conn.fd;
      pf[1 + q].events = dt__hs_events(&pend[q]);
      pf[1 + q].revents = 0;
    }
    if (dt__sock_poll(pf, (nfds_t)(1 + np), ms) < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "poll: %s", dt__sk_strerror(errno));
      goto done;
    }
    /* Move every handshake that can move, or is past its deadline (from the
     * last, so that a finished one's slot takes an already visited one). */
    now = dt__now();
    for (int q = np - 1; q >= 0 && need > 0; q--) {
      if (!pf[1 + q].revents && now < pend[q].deadline) continue;
      int st = dt__hs_step(&pend[q], &t->self, seen);
      if (st == DT__HS_BUSY) continue;
      if (dt__tcp_admitted(t, &pend[q], st, seen)) need--;
      pend[q] = pend[--np];
    }
    /* New connections: every one waiting, each into a handshake. */
    for (int k = 0; need > 0 && (pf[0].revents & POLLIN) && k < DT__NET_PENDING_MAX; k++) {
      int fd;
      char addr[DT__NET_ADDR];
      if (dt__net_accept(lfd, 0.0, &fd, addr, sizeof addr) != DTRAIN_OK) break;
      if (np == DT__NET_PENDING_MAX) {
        int old = dt__hs_victim(pend, np);
        char why[96];
        snprintf(why, sizeof why, "too many connections in the handshake (%d); the oldest %sis dropped",
                 DT__NET_PENDING_MAX, pend[old].in_len == 0 ? "silent one " : "");
        dt__hs_drop(&pend[old], &t->self, DTRAIN_ERR_PROTOCOL, why);
        pend[old] = pend[--np];
      }
      double dl = dt__now() + dt__net_hs_timeout(&t->self);
      dt__hs_start(&pend[np], &t->self, fd, addr, dl < deadline ? dl : deadline);
      int st = dt__hs_step(&pend[np], &t->self, seen);
      if (st == DT__HS_BUSY) {
        np++;
        continue;
      }
      if (dt__tcp_admitted(t, &pend[np], st, seen)) need--;
    }
  }
  rc = DTRAIN_OK;
done:
  if (np > 0) {
    char keep[DT__MSG_CAP]; /* dropping logs and sets the thread's error: keep this call's own */
    snprintf(keep, sizeof keep, "%s", dt_last_error());
    for (int q = 0; q < np; q++)
      dt__hs_drop(&pend[q], &t->self, DTRAIN_ERR_PROTOCOL, "setup ended before its handshake");
    if (rc != DTRAIN_OK) dt__error(rc, "%s", keep);
  }
  if (own_lfd) dt__net_close(lfd);
  dt__free(seen, (size_t)world);
  dt__free(pend, (size_t)DT__NET_PENDING_MAX * sizeof(dt__hs));
  return rc;
}

static dt_comm *dt__tcp_create(const dt_cluster *cl, const dt_net_options *o) {
  dt__comm_tcp *t = NULL;
  dt_result rc;
  size_t world, scratch;
  if (!cl) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_create_tcp: cluster is NULL");
    return NULL;
  }
  if (cl->role != DTRAIN_ROLE_WORKER) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_comm_create_tcp: this process is a parameter server, not a worker");
    return NULL;
  }
  t = (dt__comm_tcp *)dt__calloc(sizeof *t);
  if (!t) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_tcp: out of memory");
    return NULL;
  }
  t->lane2.fd = -1; /* before anything can free it */
  rc = dt__net_self_init(&t->self, cl, o);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__error(rc, "dt_comm_create_tcp: %.290s", why);
    dt__free(t, sizeof *t);
    return NULL;
  }
  world = (size_t)cl->workers;
  t->comm.vtable = dt__tcp_vtable();
  t->comm.p2p = dt__tcp_p2p_vtable();
  t->comm.world = cl->workers;
  t->comm.rank = cl->index;
  t->comm.impl = t;
  t->timeout_s = t->self.opt.timeout_s;
  /* Frames must fit the receivers' payload limit. */
  t->chunk_floats = DT__MIN(t->self.opt.chunk_bytes, t->self.opt.max_payload) / sizeof(float);
  if (t->chunk_floats < 16) t->chunk_floats = 16;
  t->small_bytes = DT__MIN(t->self.opt.small_bytes, t->self.opt.max_payload);
  scratch = DT__MAX(t->chunk_floats * sizeof(float), t->small_bytes);
  scratch = DT__MAX(scratch, (size_t)DT__TCP_CALL_BYTES) + DT__TCP_CALL_BYTES + 64; /* + a fused CALL frame's header */
  t->conns_bytes = world * sizeof(dt__conn);
  t->conns = (dt__conn *)dt__calloc(t->conns_bytes);
  for (size_t j = 0; t->conns && j < world; j++) t->conns[j].fd = -1; /* before anything can free them */
  t->peer_state = (unsigned char *)dt__calloc(world);
  t->pfd = (struct pollfd *)dt__calloc(world * sizeof(struct pollfd));
  t->pidx = (int *)dt__calloc(world * sizeof(int));
  t->scratch = (float *)dt__alloc(scratch);
  t->scratch_bytes = t->scratch ? scratch : 0;
  t->fused_max = DT__MIN(t->small_bytes, (size_t)DT__TCP_FUSED_MAX) & ~(size_t)3;
  if (t->fused_max + DT__TCP_CALL_BYTES > t->self.opt.max_payload) t->fused_max = 0;
  t->fout = (unsigned char *)dt__alloc(DT__TCP_CALL_BYTES + t->fused_max);
  t->fin = (unsigned char *)dt__alloc(DT__TCP_CALL_BYTES + t->fused_max);
  t->fkeep = (float *)dt__alloc(t->fused_max + sizeof(float));
  if (!t->conns || !t->peer_state || !t->pfd || !t->pidx || !t->scratch || !t->fout || !t->fin || !t->fkeep) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_tcp: out of memory");
    dt__tcp_free(t);
    return NULL;
  }
  for (size_t j = 0; j < world; j++) {
    dt__conn_init(&t->conns[j], -1, t->self.job, t->self.id, (uint32_t)t->self.opt.max_payload);
    t->conns[j].fd = -1;
  }
  dt__conn_init(&t->lane2, -1, t->self.job, t->self.id, (uint32_t)t->self.opt.max_payload);
  t->lane2.fd = -1;
  t->lanes = world == 2 ? 2 : 1;
  rc = dt__tcp_connect_all(t);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__error(rc, "dt_comm_create_tcp: worker %d: %.280s", cl->index, why);
    dt__tcp_free(t);
    return NULL;
  }
  dt__net_retire_handed_listener(&t->self); /* the mesh is up: nobody else may connect */
  for (int j = 0; j < t->comm.world; j++) {
    t->conns[j].spin_s = t->self.opt.spin_us > 0 ? t->self.opt.spin_us * 1e-6 : 0.0;
    dt__net_set_bufs(t->conns[j].fd, t->self.opt.sock_buf_bytes);
  }
  t->lane2.spin_s = t->conns[0].spin_s;
  dt__net_set_bufs(t->lane2.fd, t->self.opt.sock_buf_bytes);
  dt__tcp_p2p_hook(t);
  t->self.cluster = NULL; /* the caller's; not needed after setup */
  t->self.opt.token = NULL;
  return &t->comm;
}

DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *cl, const dt_net_options *o) {
  if (cl && cl->workers > 1 && cl->role == DTRAIN_ROLE_WORKER) dt_trace_set_process("worker", cl->index);
  dt__trace_env(); /* DTRAIN_TRACE: this process's file is named after its role */
  dt__quiet_push(); /* one log line for a failure, with its whole context */
  dt_comm *c = dt__tcp_create(cl, o);
  dt__quiet_pop(c ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return c;
}


#else

DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *c, const dt_net_options *o) {
  (void)c;
  (void)o;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_create_tcp: networking is not compiled in (%s)",
#  if defined(DTRAIN_NO_DIST)
            "DTRAIN_NO_DIST"
#  elif defined(DTRAIN_NO_NET)
            "DTRAIN_NO_NET"
#  else
            "DTRAIN_NO_THREADS"
#  endif
  );
  return NULL;
}

#endif /* DTRAIN_NO_NET || DTRAIN_NO_THREADS */
