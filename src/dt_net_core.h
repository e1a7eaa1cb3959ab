/* ===========================================================================
 * dt_net_core.h -- private: the TCP transport shared by the communicator and
 * the parameter servers (frames, sockets with deadlines, handshake, HMAC)
 * ===========================================================================
 * The wire format is written down in docs/wire_protocol.md; this is its one
 * implementation. Everything here is DTRAIN_PRIVATE.
 *
 * Frame: a 40-byte little-endian header, then `length` payload bytes.
 *
 *   off size field
 *    0   4   magic     0x4E525444 ("DTRN" as bytes 44 54 52 4E)
 *    4   2   version   DTRAIN_NET_VERSION
 *    6   2   type      DT__MSG_*
 *    8   8   job       job id; frames of another job are refused
 *   16   4   sender    the sender's id (dt__net_id: workers 0.., servers 0x10000+i)
 *   20   4   flags     bit 0: the checksum also covers the payload
 *   24   8   seq       per connection and direction, from 0, +1 per frame
 *   32   4   length    payload bytes (capped by the receiver before reading)
 *   36   4   checksum  CRC-32C of bytes 0..35 (and the payload when flags bit 0)
 *
 * Control frames (types below 0x40) always carry flags bit 0; bulk data
 * frames (0x40 and up) leave payload integrity to TCP, as checksumming
 * gigabytes per second would cost more than the transfer.
 */
#ifndef DTRAIN_NET_CORE_H
#define DTRAIN_NET_CORE_H

#include "dt_internal.h"
#include "dt_net.h"

#define DT__NET_MAGIC 0x4E525444u
#define DT__NET_HDR 40
#define DT__NET_F_PAYLOAD_CRC 1u
#define DT__NET_SERVER_ID0 0x10000u /* sender id of server 0 */
#define DT__NET_NONCE 32
#define DT__NET_ADDR 96

/* Message types. 0x01..0x3f: control (the transport's own); 0x40..: data,
 * owned by the backends (0x40..0x4f the communicator, 0x50..0x6f the
 * parameter servers). */
enum {
  DT__MSG_HELLO = 0x01,     /* connector -> acceptor: dt__hello */
  DT__MSG_WELCOME = 0x02,   /* acceptor -> connector: dt__hello */
  DT__MSG_AUTH = 0x03,      /* 32-byte HMAC-SHA256 proof */
  DT__MSG_READY = 0x04,     /* acceptor -> connector: handshake complete */
  DT__MSG_REFUSE = 0x05,    /* u32 code (dt_result, negated), then UTF-8 reason */
  DT__MSG_ABORT = 0x06,     /* u32 code, then UTF-8 reason: the sender's run failed */
  DT__MSG_HEARTBEAT = 0x07, /* empty */
  DT__MSG_BYE = 0x08,       /* empty: orderly close */
  DT__MSG_DATA0 = 0x40      /* first backend type */
};

typedef struct dt__frame {
  uint32_t magic;
  uint16_t version, type;
  uint64_t job;
  uint32_t sender, flags;
  uint64_t seq;
  uint32_t length, checksum;
} dt__frame;

/* ---- checksums and authentication --------------------------------------------------- */
DTRAIN_PRIVATE uint32_t dt__crc32c(uint32_t crc, const void *p, size_t n);
typedef struct dt__sha256 {
  uint32_t h[8];
  uint64_t len;
  unsigned char buf[64];
  size_t fill;
} dt__sha256;
DTRAIN_PRIVATE void dt__sha256_init(dt__sha256 *s);
DTRAIN_PRIVATE void dt__sha256_update(dt__sha256 *s, const void *p, size_t n);
DTRAIN_PRIVATE void dt__sha256_final(dt__sha256 *s, unsigned char out[32]);
DTRAIN_PRIVATE void dt__hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen, unsigned char out[32]);
/* Constant-time comparison: 1 when equal. */
DTRAIN_PRIVATE int dt__net_ct_equal(const unsigned char *a, const unsigned char *b, size_t n);

/* ---- frames ----------------------------------------------------------------------------- */
DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length);
/* Decode and check a header: magic, version, header checksum, job (unless
 * job is 0), length <= max_payload. DTRAIN_ERR_PROTOCOL (or _MISMATCH for a
 * wrong job/version) with the reason in why (never NULL; cap >= 1). */
DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap);
/* 1 when the payload matches the checksum (or the frame does not cover it). */
DTRAIN_PRIVATE int dt__frame_payload_ok(const unsigned char h[DT__NET_HDR], const dt__frame *f, const void *payload);

#ifndef DTRAIN_NO_NET /* the socket layer exists only with networking */
/* ---- sockets ------------------------------------------------------------------------------
 * Every socket is non-blocking; every call takes an absolute deadline
 * (dt__now() seconds) and returns DTRAIN_ERR_TIMEOUT past it. EINTR is
 * retried; SIGPIPE never raised. Messages are set with dt__error. */
/* "host:port" or "[v6]:port" -> host and port strings. */
DTRAIN_PRIVATE dt_result dt__net_split(const char *hostport, char *host, size_t hcap, char *port, size_t pcap);
DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd);
DTRAIN_PRIVATE int dt__net_port(int fd); /* the bound port, -1 on error */
/* Connect, retrying refused/unreachable with backoff (10 ms doubling to 0.5 s) until the deadline. */
DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd);
/* Wait for one connection; *fd gets it, addr (may be NULL) the peer's "host:port". */
DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd, char *addr, size_t cap);
DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline);
DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline);
/* The same, but when nothing has arrived it polls the socket (yielding the
 * CPU between tries) for up to spin_s seconds before sleeping in poll(). */
DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s);
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes); /* SO_SNDBUF/SO_RCVBUF; <= 0: the kernel's */
DTRAIN_PRIVATE void dt__net_close(int fd);
/* Wait until fd is readable: 1 readable, 0 timed out (after `seconds`), -1 error. */
DTRAIN_PRIVATE int dt__net_poll_in(int fd, double seconds);

/* ---- connections: a socket plus both directions' sequence numbers ---------------------- */
typedef struct dt__conn {
  int fd;
  uint64_t job;
  uint32_t self_id;      /* our sender id */
  uint32_t max_payload;
  double spin_s;         /* receiving here (dt__conn_recv_header, exchanges), spin this long
                            before sleeping in poll() (0: never) */
  uint64_t send_seq, recv_seq;
  int peer_role;         /* dt_role, -1 before the handshake */
  int peer_index;
  int lane;              /* 0, or 1: a 2-worker collective's second connection (hello offset 28) */
  char peer[DT__NET_ADDR]; /* "worker 1 (127.0.0.1:7001)" */
} dt__conn;

DTRAIN_PRIVATE void dt__conn_init(dt__conn *c, int fd, uint64_t job, uint32_t self_id, uint32_t max_payload);
/* Send one frame (header + payload, gathered). op names the operation for
 * errors: "worker 0: allreduce #12: send to worker 1 (127.0.0.1:7001): connection reset". */
DTRAIN_PRIVATE dt_result dt__conn_send(dt__conn *c, uint16_t type, const void *payload, uint32_t n, double deadline,
                                       const char *op);
/* Receive one frame's header (checked: sequence number, sender when known)
 * into *f. ABORT and REFUSE frames are read whole and turned into
 * DTRAIN_ERR_PEER / the refusal's code with the peer's reason. Then the
 * caller reads f->length payload bytes with dt__conn_recv_payload (which
 * checks the payload checksum when the frame carries one). */
DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op);
DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op);
/* Header + payload into buf (cap bytes); a frame of another type or longer
 * than cap is DTRAIN_ERR_PROTOCOL. *len (may be NULL) gets the length. */
DTRAIN_PRIVATE dt_result dt__conn_recv(dt__conn *c, uint16_t type, void *buf, uint32_t cap, uint32_t *len,
                                       double deadline, const char *op);
/* Send a frame to `to` while receiving one of `type` from `from` (possibly
 * the same connection), progressing both as the sockets allow, so two peers
 * exchanging in a ring never deadlock on full socket buffers. The received
 * payload must be exactly rn bytes, from the peer the connection belongs to.
 * When neither side can move it spins for from->spin_s, then polls. */
DTRAIN_PRIVATE dt_result dt__conn_exchange(dt__conn *to, uint16_t stype, const void *sbuf, uint32_t sn, dt__conn *from,
                                           uint16_t rtype, void *rbuf, uint32_t rn, double deadline, const char *op);
/* Best effort, short deadline: tell the peer our run failed (code + text). */
DTRAIN_PRIVATE void dt__conn_abort(dt__conn *c, dt_result code, const char *reason);
DTRAIN_PRIVATE void dt__conn_close(dt__conn *c);

#endif /* DTRAIN_NO_NET */

/* ---- who we are, and the handshake ----------------------------------------------------- */
typedef struct dt__net_self {
  const dt_cluster *cluster;
  dt_net_options opt;    /* with defaults filled */
  uint64_t job;
  uint32_t id;           /* dt__net_id(role, index) */
} dt__net_self;

DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index);
/* Fill self from the cluster and options (NULL: defaults); job id from the
 * options or a hash of the cluster's addresses. */
DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o);
#ifndef DTRAIN_NO_NET
/* This process's listening socket: options.listen_fd, or bind its own address from the cluster. */
DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd);
/* Connector side: connect to (role, index) with retries until connect_timeout,
 * handshake; on success *c is ready. */
DTRAIN_PRIVATE dt_result dt__net_dial(const dt__net_self *self, dt_role role, int index, dt__conn *c);
/* The same, announcing `lane` in the hello (1: the second connection of a 2-worker collective). */
DTRAIN_PRIVATE dt_result dt__net_dial_lane(const dt__net_self *self, dt_role role, int index, int lane, dt__conn *c);
/* Acceptor side on a fresh connection fd (ownership passes to *c or the fd
 * is closed): check the peer's hello (version, job, world, servers, model
 * hash, a valid and -- unless allow_dup -- not yet `seen` id), authenticate,
 * and send READY. On refusal the peer gets a REFUSE frame naming both sides,
 * the reason is logged (unless opt.quiet) and returned; the caller keeps
 * serving others. `seen` (may be NULL): per-worker flags set on success. */
DTRAIN_PRIVATE dt_result dt__net_admit(const dt__net_self *self, int fd, const char *addr, double deadline,
                                       unsigned char *seen, dt__conn *c);
/* Read 32 bytes of randomness (/dev/urandom, else a hash of time and pid). */
DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n);
#endif /* DTRAIN_NO_NET */

/* Floats travel little-endian. On a little-endian host this is a no-op
 * (buffers go out as they are, no copy); on a big-endian one it swaps the
 * bytes of each float in place (the same call converts back). */
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#  define DT__NET_HOST_LE 0
#else
#  define DT__NET_HOST_LE 1
#endif
DTRAIN_PRIVATE void dt__net_f32_le(float *p, size_t n);

/* Little-endian helpers. */
DTRAIN_PRIVATE void dt__le32_put(unsigned char *p, uint32_t v);
DTRAIN_PRIVATE void dt__le64_put(unsigned char *p, uint64_t v);
DTRAIN_PRIVATE uint32_t dt__le32_get(const unsigned char *p);
DTRAIN_PRIVATE uint64_t dt__le64_get(const unsigned char *p);

#endif /* DTRAIN_NET_CORE_H */
