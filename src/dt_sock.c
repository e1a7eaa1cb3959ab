/* ===========================================================================
 * dt_sock.c -- the transport's socket calls on Windows: Winsock 2 behind the
 * POSIX names (the dt__sk_* of dt_net_core.h; on POSIX they are the system's)
 * ===========================================================================
 * Below dt_netem.c and dt_socket.c, which both call them.
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

#if !defined(DTRAIN_NO_NET) && defined(_WIN32)
#  include <errno.h>

static INIT_ONCE dt__sk_once = INIT_ONCE_STATIC_INIT;
static int dt__sk_started; /* WSAStartup succeeded (written once, under dt__sk_once) */

static BOOL CALLBACK dt__sk_start(PINIT_ONCE once, PVOID arg, PVOID *ctx) {
  WSADATA wd;
  (void)once;
  (void)arg;
  (void)ctx;
  dt__sk_started = WSAStartup(MAKEWORD(2, 2), &wd) == 0;
  return TRUE;
}

DTRAIN_PRIVATE int dt__sk_ready(void) {
  InitOnceExecuteOnce(&dt__sk_once, dt__sk_start, NULL, NULL);
  if (!dt__sk_started) errno = ENETDOWN;
  return dt__sk_started;
}

DTRAIN_PRIVATE int dt__sk_errno(int e) {
  switch (e) {
    case WSAEWOULDBLOCK: return EAGAIN;
    case WSAEINPROGRESS: return EINPROGRESS;
    case WSAEALREADY: return EALREADY;
    case WSAEINTR: return EINTR;
    case WSAEBADF: case WSAENOTSOCK: return EBADF;
    case WSAEACCES: return EACCES;
    case WSAEFAULT: return EFAULT;
    case WSAEINVAL: return EINVAL;
    case WSAEMFILE: return EMFILE;
    case WSAEMSGSIZE: return EMSGSIZE;
    case WSAEAFNOSUPPORT: return EAFNOSUPPORT;
    case WSAEADDRINUSE: return EADDRINUSE;
    case WSAEADDRNOTAVAIL: return EADDRNOTAVAIL;
    case WSAENETDOWN: return ENETDOWN;
    case WSAENETUNREACH: return ENETUNREACH;
    case WSAENETRESET: return ENETRESET;
    case WSAECONNABORTED: return ECONNABORTED;
    case WSAECONNRESET: return ECONNRESET;
    case WSAENOBUFS: return ENOBUFS;
    case WSAEISCONN: return EISCONN;
    case WSAENOTCONN: return ENOTCONN;
    case WSAESHUTDOWN: return EPIPE;
    case WSAETIMEDOUT: return ETIMEDOUT;
    case WSAECONNREFUSED: return ECONNREFUSED;
    case WSAEHOSTUNREACH: return EHOSTUNREACH;
    case WSAEOPNOTSUPP: return EOPNOTSUPP;
    case WSAEDISCON: return ECONNRESET;
    case WSANOTINITIALISED: case WSASYSNOTREADY: return ENETDOWN;
    default: return e ? EIO : 0;
  }
}

/* The C runtime knows the ISO errors only: the socket ones get their text here. */
DTRAIN_PRIVATE const char *dt__sk_strerror(int err) {
  switch (err) {
    case EAGAIN: return "Resource temporarily unavailable";
    case EINPROGRESS: return "Operation now in progress";
    case EALREADY: return "Operation already in progress";
    case EMSGSIZE: return "Message too long";
    case EAFNOSUPPORT: return "Address family not supported";
    case EADDRINUSE: return "Address already in use";
    case EADDRNOTAVAIL: return "Cannot assign requested address";
    case ENETDOWN: return "Network is down (or Winsock did not start)";
    case ENETUNREACH: return "Network is unreachable";
    case ENETRESET: return "Network dropped connection on reset";
    case ECONNABORTED: return "Software caused connection abort";
    case ECONNRESET: return "Connection reset by peer";
    case ENOBUFS: return "No buffer space available";
    case EISCONN: return "Transport endpoint is already connected";
    case ENOTCONN: return "Transport endpoint is not connected";
    case EPIPE: return "Broken pipe";
    case ETIMEDOUT: return "Connection timed out";
    case ECONNREFUSED: return "Connection refused";
    case EHOSTUNREACH: return "No route to host";
    default: return strerror(err);
  }
}

static int dt__sk_fail(void) {
  errno = dt__sk_errno(WSAGetLastError());
  return -1;
}

/* A new socket as the int the transport holds, not inherited (as close-on-exec). */
static int dt__sk_own(SOCKET s) {
  if (s == INVALID_SOCKET) return dt__sk_fail();
  if (s > (SOCKET)INT_MAX) { /* never seen: handles stay far below */
    closesocket(s);
    errno = EMFILE;
    return -1;
  }
  SetHandleInformation((HANDLE)s, HANDLE_FLAG_INHERIT, 0);
  return (int)s;
}

DTRAIN_PRIVATE int dt__sk_socket(int family, int type, int proto) {
  if (!dt__sk_ready()) return -1;
  return dt__sk_own(socket(family, type, proto));
}

DTRAIN_PRIVATE int dt__sk_connect(int fd, const struct sockaddr *a, size_t len) {
  if (connect((SOCKET)fd, a, (int)len) == 0) return 0;
  int e = WSAGetLastError();
  errno = e == WSAEWOULDBLOCK ? EINPROGRESS : dt__sk_errno(e); /* a non-blocking connect under way */
  return -1;
}

DTRAIN_PRIVATE int dt__sk_accept(int fd, struct sockaddr *a, socklen_t *len) {
  return dt__sk_own(accept((SOCKET)fd, a, len));
}

DTRAIN_PRIVATE int dt__sk_close(int fd) { return closesocket((SOCKET)fd) == 0 ? 0 : dt__sk_fail(); }

DTRAIN_PRIVATE ssize_t dt__sk_send(int fd, const void *p, size_t n, int flags) {
  int k = send((SOCKET)fd, (const char *)p, n > INT_MAX ? INT_MAX : (int)n, flags);
  return k == SOCKET_ERROR ? dt__sk_fail() : (ssize_t)k;
}

DTRAIN_PRIVATE ssize_t dt__sk_recv(int fd, void *p, size_t n, int flags) {
  int k = recv((SOCKET)fd, (char *)p, n > INT_MAX ? INT_MAX : (int)n, flags);
  return k == SOCKET_ERROR ? dt__sk_fail() : (ssize_t)k;
}

/* Gathered, as sendmsg: WSASend over the pieces (at most DT__NET_IOV_MAX, each under 4 GiB). */
DTRAIN_PRIVATE ssize_t dt__sk_sendmsg(int fd, const struct msghdr *mh, int flags) {
  WSABUF b[DT__NET_IOV_MAX];
  DWORD nb = 0, sent = 0;
  for (size_t i = 0; i < mh->msg_iovlen && nb < DT__NET_IOV_MAX; i++) {
    size_t len = mh->msg_iov[i].iov_len;
    if (len == 0) continue;
    b[nb].buf = (char *)mh->msg_iov[i].iov_base;
    b[nb].len = len > 0x40000000u ? 0x40000000u : (ULONG)len;
    nb++;
    if (len > 0x40000000u) break; /* the rest follows in a later call */
  }
  if (nb == 0) return 0;
  if (WSASend((SOCKET)fd, b, nb, &sent, (DWORD)flags, NULL, NULL) != 0) return dt__sk_fail();
  return (ssize_t)sent;
}

/* WSAPoll refuses an array without one valid socket (WSAEINVAL at once,
 * where poll() sleeps): the link emulation polls such arrays (entries set to
 * -1 while their line has room), so with no socket this sleeps, as poll(). */
DTRAIN_PRIVATE int dt__sk_poll(struct pollfd *p, nfds_t n, int ms) {
  int any = 0;
  for (nfds_t i = 0; i < n; i++) {
    p[i].revents = 0;
    if ((int)p[i].fd >= 0) any = 1;
  }
  if (!any) {
    if (ms != 0) Sleep(ms < 0 ? INFINITE : (DWORD)ms);
    return 0;
  }
  int r = WSAPoll(p, (ULONG)n, ms);
  return r == SOCKET_ERROR ? dt__sk_fail() : r;
}

#endif /* !DTRAIN_NO_NET && _WIN32 */
