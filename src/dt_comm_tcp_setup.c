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
#  include <fcntl.h>
#  include <sys/socket.h>
#  include <unistd.h>

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
#  ifndef DTRAIN_NO_STDIO
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
#  include <poll.h>
#  include <sys/socket.h>
#  include <sys/types.h>

/* Accepted connections whose first frame has not fully arrived: strangers
 * that send a few bytes (or none) and stall must not hold up the real peers,
 * so a connection is admitted only once its hello is there (or its first
 * bytes are plainly not a frame, or it closed). */
#  define DT__TCP_PENDING 16
#  define DT__TCP_HELLO_FRAME (DT__NET_HDR + 128)

typedef struct dt__tcp_pending {
  int fd;
  int partial; /* some bytes arrived, not enough: polling would spin, so it is re-checked every 10 ms */
  double since;
  char addr[DT__NET_ADDR];
} dt__tcp_pending;

/* 1: admit now, 0: keep waiting, -1: closed without a byte (drop quietly),
 * 2: not a dtrain frame and too short for the handshake to read (refuse
 * here: why gets the reason). */
static int dt__tcp_pending_ready(int fd, int *partial, char *why, size_t cap) {
  unsigned char peek[DT__TCP_HELLO_FRAME];
  ssize_t k = recv(fd, peek, sizeof peek, MSG_PEEK);
  *partial = k > 0;
  if (k == 0) return -1;
  if (k < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
  if ((size_t)k >= sizeof peek) return 1;
  if (k >= 4 && dt__get_le32(peek) != DT__NET_MAGIC) {
    if (k >= DT__NET_HDR) return 1; /* the handshake reads the header and refuses it */
    dt__frame f;
    memset(peek + k, 0, sizeof peek - (size_t)k);
    dt__frame_unpack(peek, 0, 0, &f, why, cap);
    return 2;
  }
  /* Closed after a few bytes: the handshake reports the truncated frame. */
  struct pollfd p;
  p.fd = fd;
  p.events = POLLIN;
  p.revents = 0;
  if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR))) return 1;
  return 0;
}

static void dt__tcp_refuse_log(const dt__comm_tcp *t, const dt__tcp_pending *p, const char *why) {
  if (!t->self.opt.quiet)
    dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "worker %d: refused a connection from %.80s: %s", t->comm.rank,
            p->addr, why);
}

static dt_result dt__tcp_connect_all(dt__comm_tcp *t) {
  const dt_cluster *cl = t->self.cluster;
  int world = cl->workers, r = cl->index, lfd = -1, own_lfd = 0, np = 0;
  const unsigned all = t->lanes == 2 ? 3u : 1u; /* the lanes' bits in seen[] */
  int need = (world - 1 - r) * t->lanes;
  double start = dt__now();
  double deadline = start + t->self.opt.connect_timeout_s + t->self.opt.timeout_s;
  unsigned char *seen = NULL;
  dt__tcp_pending pend[DT__TCP_PENDING];
  dt_result rc = DTRAIN_OK;
  if (need > 0) {
    /* Listen before dialing so higher ranks' connections wait in the backlog. */
    rc = dt__net_self_listen(&t->self, &lfd);
    if (rc != DTRAIN_OK) goto done;
    own_lfd = t->self.opt.listen_fd < 0;
    seen = (unsigned char *)dt__calloc((size_t)world);
    if (!seen) {
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
    struct pollfd pf[DT__TCP_PENDING + 1];
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
    int npf = 1, ms = (int)((deadline - now) * 1000.0) + 1;
    if (ms > 100) ms = 100; /* also re-checks how long the pending ones have waited */
    for (int q = 0; q < np; q++) {
      if (pend[q].partial) {
        if (ms > 10) ms = 10;
        continue;
      }
      pf[npf].fd = pend[q].fd;
      pf[npf].events = POLLIN;
      pf[npf].revents = 0;
      npf++;
    }
    if (poll(pf, (nfds_t)npf, ms) < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      goto done;
    }
    if (pf[0].revents) {
      int fd;
      char addr[DT__NET_ADDR];
      rc = dt__net_accept(lfd, dt__now(), &fd, addr, sizeof addr);
      if (rc == DTRAIN_OK) {
        if (np == DT__TCP_PENDING) {
          dt__tcp_refuse_log(t, &pend[0], "too many connections waiting to say hello");
          dt__net_close(pend[0].fd);
          memmove(pend, pend + 1, (size_t)(np - 1) * sizeof pend[0]);
          np--;
        }
        pend[np].fd = fd;
        pend[np].partial = 0;
        pend[np].since = dt__now();
        snprintf(pend[np].addr, sizeof pend[np].addr, "%s", addr);
        np++;
      } else if (rc != DTRAIN_ERR_TIMEOUT) {
        goto done;
      }
      rc = DTRAIN_OK;
    }
    for (int q = 0; q < np && need > 0; q++) {
      char why[160];
      int ready = dt__tcp_pending_ready(pend[q].fd, &pend[q].partial, why, sizeof why);
      if (ready == 0 && dt__now() - pend[q].since > t->self.opt.timeout_s) {
        dt__tcp_refuse_log(t, &pend[q], "no hello before the deadline");
        ready = -1;
      }
      if (ready == 2) {
        dt__tcp_refuse_log(t, &pend[q], why);
        ready = -1;
      }
      if (ready == 0) continue;
      dt__tcp_pending p = pend[q];
      memmove(pend + q, pend + q + 1, (size_t)(np - q - 1) * sizeof pend[0]);
      np--;
      q--;
      if (ready < 0) {
        dt__net_close(p.fd);
        continue;
      }
      double dl = dt__now() + t->self.opt.timeout_s;
      dt__conn c;
      if (dl > deadline) dl = deadline;
      if (dt__net_admit(&t->self, p.fd, p.addr, dl, seen, &c) != DTRAIN_OK)
        continue; /* refused and logged; keep waiting for the real peers */
      if (c.peer_role != DTRAIN_ROLE_WORKER || c.peer_index <= r) {
        /* Lower ranks are dialed by this rank; servers do not belong here. */
        if (!t->self.opt.quiet)
          dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "worker %d: refused %s: it should not dial this rank", r,
                  c.peer);
        if (c.peer_role == DTRAIN_ROLE_WORKER && c.peer_index >= 0 && c.peer_index < world)
          seen[c.peer_index] &= (unsigned char)~(1u << c.lane);
        dt__conn_close(&c);
        continue;
      }
      if (c.lane == 1) t->lane2 = c; /* admitted only with 2 workers: from worker 1 */
      else t->conns[c.peer_index] = c;
      need--;
    }
  }
  rc = DTRAIN_OK;
done:
  for (int q = 0; q < np; q++) {
    dt__tcp_refuse_log(t, &pend[q], "setup ended before its hello");
    dt__net_close(pend[q].fd);
  }
  if (own_lfd) dt__net_close(lfd);
  dt__free(seen, (size_t)world);
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
  t->self.cluster = NULL; /* the caller's; not needed after setup */
  t->self.opt.token = NULL;
  return &t->comm;
}

DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *cl, const dt_net_options *o) {
  dt__quiet_push(); /* one log line for a failure, with its whole context */
  dt_comm *c = dt__tcp_create(cl, o);
  dt__quiet_pop(c ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return c;
}

#  undef DT__TCP_PENDING
#  undef DT__TCP_HELLO_FRAME

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
