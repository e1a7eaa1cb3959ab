/* ===========================================================================
 * dt_socket.c -- sockets with deadlines: addresses, listen, connect
 * (with retries), accept, read, write (see dt_net_core.h; Winsock: dt_sock.c)
 * ===========================================================================
 * Every socket is non-blocking and every call takes an absolute deadline;
 * EINTR is retried and SIGPIPE never raised (MSG_NOSIGNAL, or SO_NOSIGPIPE
 * where that is what the system has).
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
#  include <sched.h>
#  if !defined(_WIN32)
#    include <fcntl.h>
#    include <netdb.h>
#    if !defined(AI_PASSIVE) /* <netdb.h> came first in strict ISO mode: its POSIX part is hidden for good */
#      error "dtrain: <netdb.h> was included before the implementation under a strict ISO mode (-std=c11) without a feature macro, which hides getaddrinfo; define _POSIX_C_SOURCE 200809L before the first #include (or include dtrain.h first, or build with DTRAIN_NO_NET)"
#    endif
#    include <netinet/in.h>
#    include <netinet/tcp.h>
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <unistd.h>
#    include <arpa/inet.h>
#  endif

#  if defined(_WIN32)
static void dt__sk_setint(int fd, int level, int name, int v) {
  (void)setsockopt((SOCKET)fd, level, name, (const char *)&v, (int)sizeof v);
}
#  else
static void dt__sk_setint(int fd, int level, int name, int v) { (void)setsockopt(fd, level, name, &v, sizeof v); }
#  endif

DTRAIN_PRIVATE dt_result dt__net_split(const char *hostport, char *host, size_t hcap, char *port, size_t pcap) {
  if (!hostport || !*hostport) return dt__error(DTRAIN_ERR_INVALID_ARG, "address is empty");
  const char *colon, *hs = hostport, *he;
  if (hostport[0] == '[') {
    he = strchr(hostport, ']');
    if (!he || he[1] != ':') return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': expected [v6]:port", hostport);
    hs = hostport + 1;
    colon = he + 1;
  } else {
    colon = strrchr(hostport, ':');
    if (!colon) return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': expected host:port", hostport);
    he = colon;
  }
  size_t hl = (size_t)(he - hs), pl = strlen(colon + 1);
  if (hl == 0 || hl >= hcap || pl == 0 || pl >= pcap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': bad host or port", hostport);
  for (size_t i = 0; i < pl; i++)
    if (colon[1 + i] < '0' || colon[1 + i] > '9')
      return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': port is not a number", hostport);
  memcpy(host, hs, hl);
  host[hl] = '\0';
  memcpy(port, colon + 1, pl + 1);
  if (atol(port) > 65535) return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': port out of range", hostport);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__net_nonblock(int fd) {
#  if defined(_WIN32)
  u_long on = 1; /* not inherited: dt__sk_socket and dt__sk_accept cleared that */
  (void)ioctlsocket((SOCKET)fd, FIONBIO, &on);
#  else
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
#  endif
}

static void dt__net_tune(int fd) {
  dt__sk_setint(fd, IPPROTO_TCP, TCP_NODELAY, 1);
#  ifdef SO_NOSIGPIPE
  dt__sk_setint(fd, SOL_SOCKET, SO_NOSIGPIPE, 1);
#  endif
  dt__net_nonblock(fd);
}

/* SO_SNDBUF/SO_RCVBUF of a connected socket (bytes <= 0: left to the kernel).
 * Best effort: the kernel caps the sizes, and a refusal changes nothing. */
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes) {
  if (fd < 0 || bytes <= 0) return;
  int b = bytes > (int64_t)(1 << 30) ? (1 << 30) : (int)bytes;
  dt__sk_setint(fd, SOL_SOCKET, SO_SNDBUF, b);
  dt__sk_setint(fd, SOL_SOCKET, SO_RCVBUF, b);
}

static dt_result dt__net_resolve(const char *hostport, int passive, struct addrinfo **res) {
  char host[256], port[16];
  dt_result rc = dt__net_split(hostport, host, sizeof host, port, sizeof port);
  if (rc != DTRAIN_OK) return rc;
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
#  if defined(_WIN32)
  if (!dt__sk_ready()) return dt__error(DTRAIN_ERR_NET, "cannot resolve '%s': Winsock did not start", hostport);
  int e = getaddrinfo(host, port, &hints, res);
  if (e != 0) return dt__error(DTRAIN_ERR_NET, "cannot resolve '%s': %s", hostport, gai_strerrorA(e));
#  else
  int e = getaddrinfo(host, port, &hints, res);
  if (e != 0) return dt__error(DTRAIN_ERR_NET, "cannot resolve '%s': %s", hostport, gai_strerror(e));
#  endif
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd_out) {
  struct addrinfo *res = NULL;
  *fd_out = -1;
  dt_result rc = dt__net_resolve(hostport, 1, &res);
  if (rc != DTRAIN_OK) return rc;
  int err = 0;
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = dt__sk_socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
#  if defined(_WIN32)
    /* No option: SO_REUSEADDR there lets another socket take a port in use,
     * and SO_EXCLUSIVEADDRUSE keeps a restarted process off its own port while
     * its old connections linger; the default refuses a second listener and
     * lets a restart bind past TIME_WAIT. */
    if (bind((SOCKET)fd, a->ai_addr, (int)a->ai_addrlen) == 0 && listen((SOCKET)fd, 128) == 0) {
#  else
    dt__sk_setint(fd, SOL_SOCKET, SO_REUSEADDR, 1);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
#  endif
      dt__net_nonblock(fd);
      freeaddrinfo(res);
      *fd_out = fd;
      return DTRAIN_OK;
    }
#  if defined(_WIN32)
    err = dt__sk_errno(WSAGetLastError());
#  else
    err = errno;
#  endif
    dt__sk_close(fd);
  }
  freeaddrinfo(res);
  return dt__error(DTRAIN_ERR_NET, "cannot listen on %s: %s", hostport, dt__sk_strerror(err));
}

DTRAIN_PRIVATE int dt__net_port(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return -1;
}

/* poll one fd for `events` until the deadline: 1 ready, 0 timeout, -1 error (errno). */
static int dt__net_wait(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - dt__now();
    if (left <= 0) return 0;
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    int ms = left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
    int n = dt__sock_poll(&p, 1, ms);
    if (n > 0) return 1;
    if (n < 0 && errno != EINTR) return -1;
  }
}

DTRAIN_PRIVATE int dt__net_poll_in(int fd, double seconds) {
  int r = dt__net_wait(fd, POLLIN, dt__now() + seconds);
  return r;
}

/* 1 when a connected socket's two ends are the same address: nobody listened
 * on the port and the kernel happened to pick that very port for our end, so
 * TCP's simultaneous open connected the socket to itself (possible whenever a
 * peer's port lies in the ephemeral range and we dial before it listens). */
static int dt__net_self_connected(int fd) {
  struct sockaddr_storage a, b;
  socklen_t la = sizeof a, lb = sizeof b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  if (getsockname(fd, (struct sockaddr *)&a, &la) != 0 || getpeername(fd, (struct sockaddr *)&b, &lb) != 0) return 0;
  if (la != lb || a.ss_family != b.ss_family) return 0;
  if (a.ss_family == AF_INET) {
    const struct sockaddr_in *x = (const struct sockaddr_in *)&a, *y = (const struct sockaddr_in *)&b;
    return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)&a, *y = (const struct sockaddr_in6 *)&b;
    return x->sin6_port == y->sin6_port && memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) == 0;
  }
  return 0;
}

/* A socket's pending error (SO_ERROR) as an errno value; 0: none (or unreadable). */
static int dt__net_so_error(int fd) {
  int so = 0;
  socklen_t sl = sizeof so;
#  if defined(_WIN32)
  if (getsockopt((SOCKET)fd, SOL_SOCKET, SO_ERROR, (char *)&so, &sl) != 0) return 0;
  return dt__sk_errno(so);
#  else
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl) != 0) return 0;
  return so;
#  endif
}

DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd_out) {
  double backoff = 0.01;
  int err = 0;
  *fd_out = -1;
  for (;;) {
    struct addrinfo *res = NULL;
    dt_result rc = dt__net_resolve(hostport, 0, &res);
    if (rc != DTRAIN_OK) return rc;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
      int fd = dt__sk_socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) {
        err = errno;
        continue;
      }
      dt__net_tune(fd);
      int r = dt__sk_connect(fd, a->ai_addr, a->ai_addrlen);
      if (r != 0 && (errno == EINPROGRESS || errno == EINTR)) {
#  if defined(_WIN32)
        /* WSAPoll before Windows 10 2004 never reports a refused connect:
         * look at SO_ERROR every quarter second instead of only at the end. */
        int w;
        for (;;) {
          double until = DT__MIN(deadline, dt__now() + 0.25);
          w = dt__net_wait(fd, POLLOUT, until);
          if (w != 0 || until >= deadline) break;
          if (dt__net_so_error(fd) != 0) {
            w = 1; /* failed: read below */
            break;
          }
        }
#  else
        int w = dt__net_wait(fd, POLLOUT, deadline);
#  endif
        if (w == 1) {
          int so = dt__net_so_error(fd);
          if (so == 0) r = 0;
          else errno = so;
        } else if (w == 0) {
          errno = ETIMEDOUT;
        }
      }
      if (r == 0 && dt__net_self_connected(fd)) {
        r = -1; /* talking to ourselves: as good as refused, retry */
        errno = ECONNREFUSED;
      }
      if (r == 0) {
        freeaddrinfo(res);
        *fd_out = fd;
        return DTRAIN_OK;
      }
      err = errno;
      dt__sk_close(fd);
    }
    freeaddrinfo(res);
    double now = dt__now();
    if (now + backoff > deadline)
      return dt__error(DTRAIN_ERR_TIMEOUT, "cannot connect to %s before the deadline: %s", hostport,
                       dt__sk_strerror(err ? err : ETIMEDOUT));
    dt__sleep(backoff);
    backoff = backoff * 2 > 0.5 ? 0.5 : backoff * 2;
  }
}

static void dt__net_addr_text(const struct sockaddr_storage *ss, char *out, size_t cap) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    snprintf(out, cap, "%s:%d", host, port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    snprintf(out, cap, "[%s]:%d", host, port);
  } else {
    snprintf(out, cap, "unknown address");
  }
}

DTRAIN_PRIVATE int dt__net_local(int fd, char *addr, size_t cap) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  memset(&ss, 0, sizeof ss);
  if (addr && cap) addr[0] = '\0';
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return -1;
  if (addr) dt__net_addr_text(&ss, addr, cap);
  if (ss.ss_family == AF_INET) {
    const unsigned char *b = (const unsigned char *)&((const struct sockaddr_in *)&ss)->sin_addr;
    return b[0] == 127; /* 127.0.0.0/8 */
  }
  if (ss.ss_family == AF_INET6) {
    const unsigned char *b = (const unsigned char *)&((const struct sockaddr_in6 *)&ss)->sin6_addr;
    static const unsigned char one[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (memcmp(b, one, 16) == 0) return 1;                     /* ::1 */
    return memcmp(b, mapped, 12) == 0 && b[12] == 127;         /* ::ffff:127.x.y.z */
  }
#  if defined(AF_UNIX)
  return ss.ss_family == AF_UNIX; /* a socket pair or a local socket: this machine only */
#  else
  return 0;
#  endif
}

DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd_out, char *addr, size_t cap) {
  *fd_out = -1;
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int fd = dt__sk_accept(lfd, (struct sockaddr *)&ss, &len);
    if (fd >= 0) {
      dt__net_tune(fd);
      if (addr) dt__net_addr_text(&ss, addr, cap);
      *fd_out = fd;
      return DTRAIN_OK;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return dt__error(DTRAIN_ERR_NET, "accept: %s", dt__sk_strerror(errno));
    int w = dt__net_wait(lfd, POLLIN, deadline);
    if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "accept: no connection before the deadline");
    if (w < 0) return dt__error(DTRAIN_ERR_NET, "accept: poll: %s", dt__sk_strerror(errno));
  }
}

DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline) {
  struct iovec one;
  one.iov_base = (void *)(uintptr_t)p;
  one.iov_len = n;
  return dt__net_writev(fd, &one, 1, deadline);
}

DTRAIN_PRIVATE int dt__net_iov_advance(struct iovec *iov, int n, int at, size_t k) {
  while (k > 0 && at < n) { /* past the pieces sent whole, into the one sent in part */
    size_t t = DT__MIN(k, iov[at].iov_len);
    iov[at].iov_base = (unsigned char *)iov[at].iov_base + t;
    iov[at].iov_len -= t;
    k -= t;
    if (iov[at].iov_len == 0) at++;
  }
  return at;
}

/* iov[0..n) in order, as few sendmsg calls as the socket allows (at most
 * DT__NET_IOV_MAX pieces a call); iov is consumed (its entries advance). */
DTRAIN_PRIVATE dt_result dt__net_writev(int fd, struct iovec *iov, int n, double deadline) {
  int at = 0;
  for (;;) {
    while (at < n && iov[at].iov_len == 0) at++;
    if (at == n) return DTRAIN_OK;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov + at;
    mh.msg_iovlen = (size_t)DT__MIN(n - at, DT__NET_IOV_MAX);
    ssize_t k = dt__sock_sendmsg(fd, &mh, DT__NET_SEND_FLAGS);
    if (k > 0) {
      at = dt__net_iov_advance(iov, n, at, (size_t)k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int w = dt__net_wait(fd, POLLOUT, deadline);
      if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "send timed out (the peer stopped reading)");
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", dt__sk_strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "send failed: %s", k < 0 ? dt__sk_strerror(errno) : "connection closed");
  }
}

DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline) {
  return dt__net_read_spin(fd, p, n, deadline, 0.0);
}

DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s) {
  unsigned char *b = (unsigned char *)p;
  double spin_until = -1.0;
  while (n > 0) {
    ssize_t k = dt__sock_recv(fd, b, n, 0);
    if (k > 0) {
      b += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0) return dt__error(DTRAIN_ERR_PEER, "connection closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (spin_s > 0) {
        /* A reply due within microseconds: try again (giving the CPU away
         * in between) before sleeping in poll(), whose wake-up costs more. */
        double t = dt__now();
        if (spin_until < 0) spin_until = DT__MIN(t + spin_s, deadline);
        if (t < spin_until) {
          sched_yield();
          continue;
        }
      }
      int w = dt__net_wait(fd, POLLIN, deadline);
      if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "receive timed out (the peer sent nothing before the deadline)");
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", dt__sk_strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "receive failed: %s", dt__sk_strerror(errno));
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__net_close(int fd) {
  if (fd < 0) return;
  dt__netem_detach(fd);
  dt__sk_close(fd);
}

#endif /* DTRAIN_NO_NET */
