/* ===========================================================================
 * dt_net.c -- the TCP transport: CRC-32C, SHA-256/HMAC, frames, sockets with
 * deadlines, connections, the handshake (see dt_net_core.h and
 * docs/wire_protocol.md)
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

/* ---- little-endian helpers (used by the frame code, also without networking) -------- */

DTRAIN_PRIVATE void dt__le32_put(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
DTRAIN_PRIVATE void dt__le64_put(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
DTRAIN_PRIVATE uint32_t dt__le32_get(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
DTRAIN_PRIVATE uint64_t dt__le64_get(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
DTRAIN_PRIVATE void dt__net_f32_le(float *p, size_t n) {
#if DT__NET_HOST_LE
  (void)p;
  (void)n;
#else
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &p[i], 4);
    u = (u >> 24) | ((u >> 8) & 0xFF00u) | ((u << 8) & 0xFF0000u) | (u << 24);
    memcpy(&p[i], &u, 4);
  }
#endif
}

static uint16_t dt__net_le16_get(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---- CRC-32C (Castagnoli), four bits at a time: it only covers headers and control frames ---- */

/* dt__crc32c_nib[i]: the reflected polynomial 0x82F63B78 applied to the
 * four bits i (the bitwise loop's four steps folded into one lookup). */
static const uint32_t dt__crc32c_nib[16] = {0x00000000u, 0x105EC76Fu, 0x20BD8EDEu, 0x30E349B1u,
                                            0x417B1DBCu, 0x5125DAD3u, 0x61C69362u, 0x7198540Du,
                                            0x82F63B78u, 0x92A8FC17u, 0xA24BB5A6u, 0xB21572C9u,
                                            0xC38D26C4u, 0xD3D3E1ABu, 0xE330A81Au, 0xF36E6F75u};

DTRAIN_PRIVATE uint32_t dt__crc32c(uint32_t crc, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  crc = ~crc;
  for (size_t i = 0; i < n; i++) {
    crc ^= b[i];
    crc = (crc >> 4) ^ dt__crc32c_nib[crc & 15u];
    crc = (crc >> 4) ^ dt__crc32c_nib[crc & 15u];
  }
  return ~crc;
}

/* ---- SHA-256 (FIPS 180-4) and HMAC (RFC 2104) ---------------------------------------- */

static const uint32_t dt__sha256_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

static uint32_t dt__sha256_ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void dt__sha256_block(dt__sha256 *s, const unsigned char *p) {
  uint32_t w[64], a[8];
  for (int i = 0; i < 16; i++)
    w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = dt__sha256_ror(w[i - 15], 7) ^ dt__sha256_ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = dt__sha256_ror(w[i - 2], 17) ^ dt__sha256_ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(a, s->h, sizeof a);
  for (int i = 0; i < 64; i++) {
    uint32_t S1 = dt__sha256_ror(a[4], 6) ^ dt__sha256_ror(a[4], 11) ^ dt__sha256_ror(a[4], 25);
    uint32_t ch = (a[4] & a[5]) ^ (~a[4] & a[6]);
    uint32_t t1 = a[7] + S1 + ch + dt__sha256_k[i] + w[i];
    uint32_t S0 = dt__sha256_ror(a[0], 2) ^ dt__sha256_ror(a[0], 13) ^ dt__sha256_ror(a[0], 22);
    uint32_t maj = (a[0] & a[1]) ^ (a[0] & a[2]) ^ (a[1] & a[2]);
    uint32_t t2 = S0 + maj;
    memmove(a + 1, a, 7 * sizeof(uint32_t));
    a[4] += t1;
    a[0] = t1 + t2;
  }
  for (int i = 0; i < 8; i++) s->h[i] += a[i];
}

DTRAIN_PRIVATE void dt__sha256_init(dt__sha256 *s) {
  static const uint32_t h0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
  memcpy(s->h, h0, sizeof h0);
  s->len = 0;
  s->fill = 0;
}

DTRAIN_PRIVATE void dt__sha256_update(dt__sha256 *s, const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  s->len += (uint64_t)n;
  while (n > 0) {
    size_t take = 64 - s->fill < n ? 64 - s->fill : n;
    memcpy(s->buf + s->fill, p, take);
    s->fill += take;
    p += take;
    n -= take;
    if (s->fill == 64) {
      dt__sha256_block(s, s->buf);
      s->fill = 0;
    }
  }
}

DTRAIN_PRIVATE void dt__sha256_final(dt__sha256 *s, unsigned char out[32]) {
  uint64_t bits = s->len * 8;
  unsigned char pad = 0x80, zero = 0, lenb[8];
  dt__sha256_update(s, &pad, 1);
  while (s->fill != 56) dt__sha256_update(s, &zero, 1);
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)(bits >> (56 - 8 * i));
  dt__sha256_update(s, lenb, 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (unsigned char)(s->h[i] >> 24);
    out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
    out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
    out[4 * i + 3] = (unsigned char)s->h[i];
  }
}

DTRAIN_PRIVATE void dt__hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen, unsigned char out[32]) {
  unsigned char k[64], pad[64], inner[32];
  dt__sha256 s;
  memset(k, 0, sizeof k);
  if (klen > 64) {
    dt__sha256_init(&s);
    dt__sha256_update(&s, key, klen);
    dt__sha256_final(&s, k);
  } else if (klen > 0) {
    memcpy(k, key, klen);
  }
  for (int i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x36);
  dt__sha256_init(&s);
  dt__sha256_update(&s, pad, 64);
  dt__sha256_update(&s, msg, mlen);
  dt__sha256_final(&s, inner);
  for (int i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x5c);
  dt__sha256_init(&s);
  dt__sha256_update(&s, pad, 64);
  dt__sha256_update(&s, inner, 32);
  dt__sha256_final(&s, out);
}

DTRAIN_PRIVATE int dt__net_ct_equal(const unsigned char *a, const unsigned char *b, size_t n) {
  unsigned d = 0;
  for (size_t i = 0; i < n; i++) d |= (unsigned)(a[i] ^ b[i]);
  return d == 0;
}

/* ---- frames -------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length) {
  uint32_t flags = type < DT__MSG_DATA0 ? DT__NET_F_PAYLOAD_CRC : 0u;
  dt__le32_put(h, DT__NET_MAGIC);
  h[4] = (unsigned char)(DTRAIN_NET_VERSION & 0xFF);
  h[5] = (unsigned char)(DTRAIN_NET_VERSION >> 8);
  h[6] = (unsigned char)(type & 0xFF);
  h[7] = (unsigned char)(type >> 8);
  dt__le64_put(h + 8, job);
  dt__le32_put(h + 16, sender);
  dt__le32_put(h + 20, flags);
  dt__le64_put(h + 24, seq);
  dt__le32_put(h + 32, length);
  uint32_t crc = dt__crc32c(0, h, 36);
  if ((flags & DT__NET_F_PAYLOAD_CRC) && length > 0 && payload) crc = dt__crc32c(crc, payload, length);
  dt__le32_put(h + 36, crc);
}

DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap) {
  memset(f, 0, sizeof *f);
  why[0] = '\0';
  f->magic = dt__le32_get(h);
  if (f->magic != DT__NET_MAGIC) {
    /* Say what it looks like: a stray HTTP client or TLS is common. */
    const char *kind = (memcmp(h, "GET ", 4) == 0 || memcmp(h, "POST", 4) == 0 || memcmp(h, "HEAD", 4) == 0 ||
                        memcmp(h, "PUT ", 4) == 0)
                           ? " (an HTTP request?)"
                       : (h[0] == 0x16 && h[1] == 0x03) ? " (a TLS handshake?)"
                                                        : "";
    snprintf(why, cap, "bad magic 0x%08x, not a dtrain frame%s", (unsigned)f->magic, kind);
    return DTRAIN_ERR_PROTOCOL;
  }
  f->version = dt__net_le16_get(h + 4);
  f->type = dt__net_le16_get(h + 6);
  f->job = dt__le64_get(h + 8);
  f->sender = dt__le32_get(h + 16);
  f->flags = dt__le32_get(h + 20);
  f->seq = dt__le64_get(h + 24);
  f->length = dt__le32_get(h + 32);
  f->checksum = dt__le32_get(h + 36);
  uint32_t crc = dt__crc32c(0, h, 36);
  int covers = (f->flags & DT__NET_F_PAYLOAD_CRC) != 0;
  if (!covers && crc != f->checksum) {
    snprintf(why, cap, "header checksum mismatch (0x%08x, computed 0x%08x)", (unsigned)f->checksum, (unsigned)crc);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->version != DTRAIN_NET_VERSION) {
    snprintf(why, cap, "protocol version %u, this build speaks %d", (unsigned)f->version, DTRAIN_NET_VERSION);
    return DTRAIN_ERR_MISMATCH;
  }
  if ((f->flags & ~DT__NET_F_PAYLOAD_CRC) != 0) {
    snprintf(why, cap, "unknown flags 0x%x", (unsigned)f->flags);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type < DT__MSG_DATA0 && !covers) {
    snprintf(why, cap, "control frame (type %u) without a payload checksum", (unsigned)f->type);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type == 0 || (f->type > DT__MSG_BYE && f->type < DT__MSG_DATA0)) {
    snprintf(why, cap, "unknown frame type %u", (unsigned)f->type);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type < DT__MSG_DATA0 && f->length > 4096) {
    snprintf(why, cap, "control frame (type %u) of %u bytes (at most 4096)", (unsigned)f->type, (unsigned)f->length);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->length > max_payload) {
    snprintf(why, cap, "frame length %u exceeds the limit of %u bytes", (unsigned)f->length, (unsigned)max_payload);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (job != 0 && f->job != job) {
    snprintf(why, cap, "frame of job %016llx, this is job %016llx", (unsigned long long)f->job,
             (unsigned long long)job);
    return DTRAIN_ERR_MISMATCH;
  }
  /* A covered header's checksum is checked with the payload (dt__frame_payload_ok). */
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__frame_payload_ok(const unsigned char h[DT__NET_HDR], const dt__frame *f, const void *payload) {
  uint32_t crc = dt__crc32c(0, h, 36);
  if (f->flags & DT__NET_F_PAYLOAD_CRC) {
    if (f->length > 0) crc = dt__crc32c(crc, payload, f->length);
  }
  return crc == f->checksum;
}

DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index) {
  return role == DTRAIN_ROLE_PS ? DT__NET_SERVER_ID0 + (uint32_t)index : (uint32_t)index;
}

#ifndef DTRAIN_NO_NET
/* ============================================================================================
 * Sockets (POSIX)
 * ============================================================================================ */
#  include <errno.h>
#  include <fcntl.h>
#  include <netdb.h>
#  include <netinet/in.h>
#  include <netinet/tcp.h>
#  include <poll.h>
#  include <sched.h>
#  include <sys/socket.h>
#  include <sys/types.h>
#  include <sys/uio.h>
#  include <unistd.h>
#  include <arpa/inet.h>

#  ifdef MSG_NOSIGNAL
#    define DT__NET_SEND_FLAGS MSG_NOSIGNAL
#  else
#    define DT__NET_SEND_FLAGS 0
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

static void dt__net_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static void dt__net_tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
#  ifdef SO_NOSIGPIPE
  setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#  endif
  dt__net_nonblock(fd);
}

/* SO_SNDBUF/SO_RCVBUF of a connected socket (bytes <= 0: left to the kernel).
 * Best effort: the kernel caps the sizes, and a refusal changes nothing. */
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes) {
  if (fd < 0 || bytes <= 0) return;
  int b = bytes > (int64_t)(1 << 30) ? (1 << 30) : (int)bytes;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
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
  int e = getaddrinfo(host, port, &hints, res);
  if (e != 0) return dt__error(DTRAIN_ERR_NET, "cannot resolve '%s': %s", hostport, gai_strerror(e));
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd_out) {
  struct addrinfo *res = NULL;
  *fd_out = -1;
  dt_result rc = dt__net_resolve(hostport, 1, &res);
  if (rc != DTRAIN_OK) return rc;
  int err = 0;
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      dt__net_nonblock(fd);
      freeaddrinfo(res);
      *fd_out = fd;
      return DTRAIN_OK;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  return dt__error(DTRAIN_ERR_NET, "cannot listen on %s: %s", hostport, strerror(err));
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
    int n = poll(&p, 1, ms);
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

DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd_out) {
  double backoff = 0.01;
  int err = 0;
  *fd_out = -1;
  for (;;) {
    struct addrinfo *res = NULL;
    dt_result rc = dt__net_resolve(hostport, 0, &res);
    if (rc != DTRAIN_OK) return rc;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
      int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) {
        err = errno;
        continue;
      }
      dt__net_tune(fd);
      int r = connect(fd, a->ai_addr, a->ai_addrlen);
      if (r != 0 && (errno == EINPROGRESS || errno == EINTR)) {
        int w = dt__net_wait(fd, POLLOUT, deadline);
        if (w == 1) {
          int so = 0;
          socklen_t sl = sizeof so;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
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
      close(fd);
    }
    freeaddrinfo(res);
    double now = dt__now();
    if (now + backoff > deadline)
      return dt__error(DTRAIN_ERR_TIMEOUT, "cannot connect to %s before the deadline: %s", hostport,
                       strerror(err ? err : ETIMEDOUT));
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

DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd_out, char *addr, size_t cap) {
  *fd_out = -1;
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int fd = accept(lfd, (struct sockaddr *)&ss, &len);
    if (fd >= 0) {
      dt__net_tune(fd);
      if (addr) dt__net_addr_text(&ss, addr, cap);
      *fd_out = fd;
      return DTRAIN_OK;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return dt__error(DTRAIN_ERR_NET, "accept: %s", strerror(errno));
    int w = dt__net_wait(lfd, POLLIN, deadline);
    if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "accept: no connection before the deadline");
    if (w < 0) return dt__error(DTRAIN_ERR_NET, "accept: poll: %s", strerror(errno));
  }
}

DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline) {
  const unsigned char *b = (const unsigned char *)p;
  while (n > 0) {
    ssize_t k = send(fd, b, n, DT__NET_SEND_FLAGS);
    if (k > 0) {
      b += k;
      n -= (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int w = dt__net_wait(fd, POLLOUT, deadline);
      if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "send timed out (the peer stopped reading)");
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "send failed: %s", k < 0 ? strerror(errno) : "connection closed");
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline) {
  return dt__net_read_spin(fd, p, n, deadline, 0.0);
}

DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s) {
  unsigned char *b = (unsigned char *)p;
  double spin_until = -1.0;
  while (n > 0) {
    ssize_t k = recv(fd, b, n, 0);
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
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "receive failed: %s", strerror(errno));
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__net_close(int fd) {
  if (fd >= 0) close(fd);
}

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

/* ============================================================================================
 * Connections
 * ============================================================================================ */

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
    k = sendmsg(c->fd, &mh, DT__NET_SEND_FLAGS);
  } while (k < 0 && errno == EINTR);
  if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    dt__error(DTRAIN_ERR_PEER, "send failed: %s", strerror(errno));
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

/* An ABORT or REFUSE frame's payload: u32 code, then text. */
static dt_result dt__conn_read_notice(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                      double deadline, const char *op) {
  char text[DT__MSG_CAP];
  unsigned char buf[512];
  uint32_t n = f->length;
  if (n > sizeof buf) {
    dt__error(DTRAIN_ERR_PROTOCOL, "notice of %u bytes", (unsigned)n);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  dt_result rc = dt__net_read(c->fd, buf, n, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  if (!dt__frame_payload_ok(h, f, buf) || n < 4) {
    dt__error(DTRAIN_ERR_PROTOCOL, "corrupt %s frame", f->type == DT__MSG_ABORT ? "abort" : "refusal");
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  uint32_t code = dt__le32_get(buf);
  size_t tl = n - 4 < sizeof text - 1 ? n - 4 : sizeof text - 1;
  memcpy(text, buf + 4, tl);
  text[tl] = '\0';
  for (size_t i = 0; i < tl; i++)
    if ((unsigned char)text[i] < 0x20) text[i] = ' ';
  c->recv_seq++;
  dt_result their = (dt_result)(-(int32_t)code);
  if (f->type == DT__MSG_ABORT)
    return dt__error(DTRAIN_ERR_PEER, "%s: %s aborted: %s", op ? op : "tcp", c->peer, text);
  if (their != DTRAIN_ERR_AUTH && their != DTRAIN_ERR_MISMATCH && their != DTRAIN_ERR_PROTOCOL) their = DTRAIN_ERR_NET;
  return dt__error(their, "%s: refused by %s: %s", op ? op : "tcp", c->peer, text);
}

/* A received header, decoded into *f and checked against the connection:
 * magic/version/checksum/job/length (dt__frame_unpack), the next sequence
 * number, the sender the handshake established; an ABORT or REFUSE frame is
 * read whole and becomes the peer's error. */
static dt_result dt__conn_header_ok(dt__conn *c, const unsigned char h[DT__NET_HDR], dt__frame *f, double deadline,
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
  if (f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE) return dt__conn_read_notice(c, f, h, deadline, op);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op) {
  dt_result rc = dt__net_read_spin(c->fd, h, DT__NET_HDR, deadline, c->spin_s);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  return dt__conn_header_ok(c, h, f, deadline, op);
}

DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op) {
  dt_result rc = dt__net_read(c->fd, buf, f->length, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  if (!dt__frame_payload_ok(h, f, buf)) {
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
    k = sendmsg(x->c->fd, &mh, DT__NET_SEND_FLAGS);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "send failed: %s", strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "send to");
    }
  } else {
    unsigned char *dst = x->done < DT__NET_HDR ? x->h + x->done : x->buf + (x->done - DT__NET_HDR);
    size_t want = x->done < DT__NET_HDR ? DT__NET_HDR - x->done : total - x->done;
    k = recv(x->c->fd, dst, want, 0);
    if (k == 0) {
      dt__error(DTRAIN_ERR_PEER, "connection closed by the peer");
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "receive failed: %s", strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
  }
  if (k <= 0) return DTRAIN_OK;
  x->done += (size_t)k;
  *moved = 1;
  if (x->recv && !x->checked && x->done >= DT__NET_HDR) {
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
  if (poll(p, np, ms) < 0 && errno != EINTR) {
    dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
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
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
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

/* ============================================================================================
 * The handshake
 * ============================================================================================
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

static void dt__hello_pack(const dt__hello *h, unsigned char b[DT__HELLO]) {
  memset(b, 0, DT__HELLO);
  dt__le32_put(b, h->role);
  dt__le32_put(b + 4, h->index);
  dt__le32_put(b + 8, h->workers);
  dt__le32_put(b + 12, h->servers);
  dt__le64_put(b + 16, h->model_hash);
  dt__le32_put(b + 24, h->flags);
  dt__le32_put(b + 28, h->lane);
  memcpy(b + 32, h->nonce, DT__NET_NONCE);
  size_t al = strlen(h->addr);
  memcpy(b + 64, h->addr, al < 63 ? al : 63);
}

static void dt__hello_unpack(const unsigned char b[DT__HELLO], dt__hello *h) {
  h->role = dt__le32_get(b);
  h->index = dt__le32_get(b + 4);
  h->workers = dt__le32_get(b + 8);
  h->servers = dt__le32_get(b + 12);
  h->model_hash = dt__le64_get(b + 16);
  h->flags = dt__le32_get(b + 24);
  h->lane = dt__le32_get(b + 28);
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
  dt__le64_put(msg + 15, self->job);
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
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  dt__conn_send(c, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), deadline, "refuse");
  dt__error(code, "%s", keep);
}

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
    d.quiet = o->quiet;
  }
  if (d.max_payload > 0xFFFFFFF0u) d.max_payload = 0xFFFFFFF0u;
  self->opt = d;
  if (d.job_id) {
    self->job = d.job_id;
  } else {
    /* FNV-1a over every address: processes of the same cluster agree. */
    uint64_t h = 1469598103934665603ULL;
    for (int r = 0; r < c->workers + c->servers; r++) {
      const char *a = r < c->workers ? c->worker_addr[r] : c->server_addr[r - c->workers];
      for (const char *p = a; p && *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ULL;
      h = (h ^ 0xFF) * 1099511628211ULL;
    }
    self->job = h ? h : 1;
  }
  self->id = dt__net_id(c->role, c->index);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd) {
  if (self->opt.listen_fd >= 0) {
    *fd = self->opt.listen_fd;
    dt__net_nonblock(*fd);
    return DTRAIN_OK;
  }
  const dt_cluster *c = self->cluster;
  return dt__net_listen(c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index], fd);
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

#else /* DTRAIN_NO_NET */

DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o) {
  (void)self;
  (void)c;
  (void)o;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "networking is not compiled in (DTRAIN_NO_NET)");
}

#endif /* DTRAIN_NO_NET */

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
  e = getenv("DTRAIN_LISTEN_FD");
  if (e && *e) o.listen_fd = atoi(e);
#endif
  o.connect_timeout_s = o.timeout_s;
  return o;
}
