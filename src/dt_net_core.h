/* ===========================================================================
 * dt_net_core.h -- private: the TCP transport shared by the communicator and
 * the parameter servers (sockets with deadlines, connections, handshake)
 * ===========================================================================
 * Built on the wire format of dt_wire.h (byte order, checksums, frames);
 * docs/wire_protocol.md describes both. Everything here is DTRAIN_PRIVATE.
 */
#ifndef DTRAIN_NET_CORE_H
#define DTRAIN_NET_CORE_H

#include "dt_internal.h"
#include "dt_wire.h"
#include "dt_net.h"

#define DT__NET_SERVER_ID0 0x10000u /* sender id of server 0 */
#define DT__NET_NONCE 32
#define DT__NET_ADDR 96

#ifndef DTRAIN_NO_NET /* the socket layer exists only with networking */
#  if defined(_WIN32)
/* ---- Winsock (dt_socket.c): the POSIX names the transport is written in --------------------
 * <winsock2.h> and <ws2tcpip.h> came with dt_internal.h. A socket is held in
 * an int as a descriptor is (Windows keeps SOCKET values below 2^31: they are
 * kernel handles, 32-bit significant). The dt__sk_* calls are the system's
 * under POSIX; under Winsock (dt_sock.c) they start Winsock once and turn a failure's
 * WSAGetLastError() into the errno the transport tests (WSAEWOULDBLOCK is
 * EAGAIN, and EINPROGRESS after a connect). */
struct iovec {
  void *iov_base;
  size_t iov_len;
};
struct msghdr { /* the two fields sendmsg() is given here */
  struct iovec *msg_iov;
  size_t msg_iovlen;
};
typedef unsigned long nfds_t;
#    define DT__NET_SEND_FLAGS 0 /* Windows raises no SIGPIPE */
DTRAIN_PRIVATE int dt__sk_ready(void); /* Winsock started (once a process); 0: it cannot start (errno ENETDOWN) */
DTRAIN_PRIVATE int dt__sk_errno(int wsa_error); /* WSAE* -> E* */
DTRAIN_PRIVATE const char *dt__sk_strerror(int err); /* strerror, with text for the socket errors */
DTRAIN_PRIVATE int dt__sk_socket(int family, int type, int proto);
DTRAIN_PRIVATE int dt__sk_connect(int fd, const struct sockaddr *a, size_t len);
DTRAIN_PRIVATE int dt__sk_accept(int fd, struct sockaddr *a, socklen_t *len);
DTRAIN_PRIVATE int dt__sk_close(int fd);
DTRAIN_PRIVATE ssize_t dt__sk_send(int fd, const void *p, size_t n, int flags);
DTRAIN_PRIVATE ssize_t dt__sk_recv(int fd, void *p, size_t n, int flags);
DTRAIN_PRIVATE ssize_t dt__sk_sendmsg(int fd, const struct msghdr *mh, int flags);
DTRAIN_PRIVATE int dt__sk_poll(struct pollfd *p, nfds_t n, int ms);
#  else
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <sys/uio.h>
#    include <unistd.h>
#    ifdef MSG_NOSIGNAL /* send flags of every send(): a closed peer is an error, not a SIGPIPE */
#      define DT__NET_SEND_FLAGS MSG_NOSIGNAL
#    else
#      define DT__NET_SEND_FLAGS 0 /* the socket has SO_NOSIGPIPE instead (dt_socket.c) */
#    endif
#    define dt__sk_strerror(err) strerror(err)
#    define dt__sk_socket(family, type, proto) socket(family, type, proto)
#    define dt__sk_connect(fd, a, len) connect(fd, a, (socklen_t)(len))
#    define dt__sk_accept(fd, a, len) accept(fd, a, len)
#    define dt__sk_close(fd) close(fd)
#    define dt__sk_send(fd, p, n, flags) send(fd, p, n, flags)
#    define dt__sk_recv(fd, p, n, flags) recv(fd, p, n, flags)
#    define dt__sk_sendmsg(fd, mh, flags) sendmsg(fd, mh, flags)
#    define dt__sk_poll(p, n, ms) poll(p, n, ms)
#  endif

/* ---- link emulation (dt_netem.c) -------------------------------------------------------------
 * DTRAIN_NETEM="rate=100mbit,delay=2ms,jitter=1ms,loss=0.5%,cut=30s;rank1:rate=10mbit"
 * (clauses split by ';', a clause "rankN:"/"workerN:"/"psN:" for one
 * member). A link's spec: each end's defaults with its own clause over them,
 * then field by field the slower end. dt__netem_attach gives a connected
 * socket a line (a thread that writes its sends when they are due) when the
 * spec names anything for it; dt__net_close detaches it. The dt__sock_*
 * calls are the system calls for every socket of the transport: with no
 * line anywhere, one atomic load more. */
enum { DT__NE_RATE = 1, DT__NE_DELAY = 2, DT__NE_JITTER = 4, DT__NE_LOSS = 8, DT__NE_CUT = 16 };
typedef struct dt__netem_spec {
  unsigned set;  /* DT__NE_* fields given */
  double rate;   /* bytes per second on the wire (headers included) */
  double delay;  /* one way, seconds */
  double jitter; /* +- seconds on each segment's delay */
  double loss;   /* fraction of 1448-byte segments lost (each stalls the link one round trip) */
  double cut;    /* seconds after the process's first emulated link that it is severed */
} dt__netem_spec;
typedef struct dt__netem_stats {
  uint64_t bytes_in, bytes_out, bytes_dropped; /* sent into the line; written to the socket; lost to a cut or failure */
  uint64_t segments_in, segments_out, lost, early; /* early: segments written before due (never, by design) */
  double first_depart, last_free; /* the schedule: first departure, when the link is free again */
  double busy_s;                  /* the link's busy time: serialisation and loss stalls */
  uint64_t wire_bytes;            /* bytes on the wire: payload + 66 header bytes per 1448-byte segment */
  double min_latency;             /* least time from a segment's serialisation to its write */
  double rate, delay;             /* the line's spec */
  size_t queued;                  /* bytes not yet written */
} dt__netem_stats;
/* Parse text for the link between (role, index) and (peer_role, peer_index)
 * (-1: validate only). DTRAIN_ERR_INVALID_ARG naming the bad clause. */
DTRAIN_PRIVATE dt_result dt__netem_parse(const char *text, int role, int index, int peer_role, int peer_index,
                                         dt__netem_spec *out);
DTRAIN_PRIVATE dt_result dt__netem_check_env(void); /* DTRAIN_NETEM, validated */
DTRAIN_PRIVATE dt_result dt__netem_attach(int fd, uint32_t self_id, int peer_role, int peer_index);
DTRAIN_PRIVATE void dt__netem_detach(int fd); /* lets queued bytes arrive (at most 2 s), then frees the line */
DTRAIN_PRIVATE int dt__netem_stats_of(int fd, dt__netem_stats *st); /* 0: no line on fd */
DTRAIN_PRIVATE long dt__netem_lines_made(void);
/* Lines in the table now (0: no emulation anywhere). */
DTRAIN_PRIVATE int dt__netem_lines_live(void);
/* A forked child's cut clock starts again with its own first link, not the parent's (tests). */
DTRAIN_PRIVATE void dt__netem_clock_restart(void);
DTRAIN_PRIVATE ssize_t dt__sock_sendmsg(int fd, const struct msghdr *mh, int flags);
DTRAIN_PRIVATE ssize_t dt__sock_send(int fd, const void *p, size_t n, int flags);
DTRAIN_PRIVATE ssize_t dt__sock_recv(int fd, void *p, size_t n, int flags);
DTRAIN_PRIVATE int dt__sock_poll(struct pollfd *p, nfds_t n, int ms);

/* ---- sockets (dt_socket.c) ------------------------------------------------------------------
 * Every socket is non-blocking; every call takes an absolute deadline
 * (dt__now() seconds) and returns DTRAIN_ERR_TIMEOUT past it. EINTR is
 * retried; SIGPIPE never raised. Messages are set with dt__error. */
/* "host:port" or "[v6]:port" -> host and port strings. */
DTRAIN_PRIVATE dt_result dt__net_split(const char *hostport, char *host, size_t hcap, char *port, size_t pcap);
DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd);
DTRAIN_PRIVATE int dt__net_port(int fd); /* the bound port, -1 on error */
/* The bound address of fd into addr ("host:port"; may be NULL): 1 when it is a
 * loopback address (127.0.0.0/8, ::1) that only this machine can reach, 0 when
 * not (0.0.0.0 included), -1 when unknown. */
DTRAIN_PRIVATE int dt__net_local(int fd, char *addr, size_t cap);
/* Connect, retrying refused/unreachable with backoff (10 ms doubling to 0.5 s) until the deadline. */
DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd);
/* Wait for one connection; *fd gets it, addr (may be NULL) the peer's "host:port". */
DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd, char *addr, size_t cap);
DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline);
/* Writes iov[0..n) in order (gathered, DT__NET_IOV_MAX pieces a call); consumes iov. */
#define DT__NET_IOV_MAX 64
DTRAIN_PRIVATE dt_result dt__net_writev(int fd, struct iovec *iov, int n, double deadline);
/* Moves iov[at..n) past k bytes sent (whole pieces emptied); the first piece with bytes left. */
DTRAIN_PRIVATE int dt__net_iov_advance(struct iovec *iov, int n, int at, size_t k);
DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline);
/* The same, but when nothing has arrived it polls the socket (yielding the
 * CPU between tries) for up to spin_s seconds before sleeping in poll(). */
DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s);
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes); /* SO_SNDBUF/SO_RCVBUF; <= 0: the kernel's */
DTRAIN_PRIVATE void dt__net_close(int fd);
/* Non-blocking and close-on-exec (every socket we hold is both). */
DTRAIN_PRIVATE void dt__net_nonblock(int fd);
/* Wait until fd is readable: 1 readable, 0 timed out (after `seconds`), -1 error. */
DTRAIN_PRIVATE int dt__net_poll_in(int fd, double seconds);

/* ---- connections (dt_conn.c): a socket plus both directions' sequence numbers ------------ */
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
  /* Frames of type p2p_type (0: none) that arrive where a receive expects
   * another frame go to p2p_in (the communicator's point-to-point messages
   * met by a collective): it reads the payload and the receive goes on with
   * the next frame. */
  uint16_t p2p_type;
  dt_result (*p2p_in)(void *arg, struct dt__conn *c, const dt__frame *f, double deadline);
  void *p2p_arg;
} dt__conn;

DTRAIN_PRIVATE void dt__conn_init(dt__conn *c, int fd, uint64_t job, uint32_t self_id, uint32_t max_payload);
/* Send one frame (header + payload, gathered). op names the operation for
 * errors: "worker 0: allreduce #12: send to worker 1 (127.0.0.1:7001): connection reset". */
DTRAIN_PRIVATE dt_result dt__conn_send(dt__conn *c, uint16_t type, const void *payload, uint32_t n, double deadline,
                                       const char *op);
/* The same for a data frame (type >= DT__MSG_DATA0, whose checksum covers
 * the header only) whose payload is parts[0..nparts) in order, sent from
 * where they lie (no copy); scratch has room for nparts + 1 entries. */
DTRAIN_PRIVATE dt_result dt__conn_sendv(dt__conn *c, uint16_t type, const struct iovec *parts, int nparts,
                                        struct iovec *scratch, double deadline, const char *op);
/* Receive one frame's header (checked: sequence number, sender when known)
 * into *f. ABORT and REFUSE frames are read whole and turned into
 * DTRAIN_ERR_PEER / the refusal's code with the peer's reason. Then the
 * caller reads f->length payload bytes with dt__conn_recv_payload (which
 * checks the payload checksum when the frame carries one). */
DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op);
DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op);
/* The payload of the frame whose header dt__conn_recv_header read, into
 * parts[0..nparts) in order (their lengths add up to f->length): read where
 * it goes, no copy; checked as dt__conn_recv_payload checks it. A failure
 * may leave the parts partly written. */
DTRAIN_PRIVATE dt_result dt__conn_recv_payloadv(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                                const struct iovec *parts, int nparts, double deadline,
                                                const char *op);
/* The same checks without reading or waiting, for a caller that receives a
 * frame piecewise as its socket allows (the parameter server's loop): a
 * whole header (the checks of dt__conn_recv_header; an ABORT or REFUSE
 * longer than DT__NET_NOTICE_MAX is refused here), then, once f->length
 * payload bytes are in, the payload (checksum; an ABORT or REFUSE becomes
 * the peer's error as in dt__conn_recv_header; the sequence number moves on). */
#  define DT__NET_NOTICE_MAX 512
DTRAIN_PRIVATE dt_result dt__conn_check_header(dt__conn *c, const unsigned char h[DT__NET_HDR], dt__frame *f,
                                               const char *op);
DTRAIN_PRIVATE dt_result dt__conn_check_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                                const void *payload, const char *op);
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

/* ---- who we are (dt_net.c), and the handshake (dt_handshake.c) --------------------------- */
typedef struct dt__net_self {
  const dt_cluster *cluster;
  dt_net_options opt;    /* with defaults filled */
  uint64_t job;
  uint32_t id;           /* dt__net_id(role, index) */
} dt__net_self;

#if !defined(DTRAIN_NO_DIST)
DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index);
/* Fill self from the cluster and options (NULL: defaults); job id from the
 * options or a hash of the cluster's addresses. */
DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o);
#endif /* DTRAIN_NO_DIST */
#ifndef DTRAIN_NO_NET
/* This process's listening socket: options.listen_fd, or bind its own address from the cluster. */
DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd);
/* Once this process needs no more connections (its collective mesh is up, or
 * it is a parameter-server worker, which only dials): close the listening
 * socket the launcher handed it (DTRAIN_LISTEN_FD), so that later
 * connections to the port are refused instead of hanging in a backlog nobody
 * accepts from (dt_comm_tcp_setup.c). A listen_fd the caller passed stays its own. */
DTRAIN_PRIVATE void dt__net_retire_handed_listener(const dt__net_self *self);
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
/* ---- the acceptor's handshake as a non-blocking state machine ----------------------------
 * What dt__net_admit does, but never blocking: a server or a rank at start-up
 * keeps many handshakes (and its real work) going in one poll loop, so a
 * silent or slow client costs a slot in that loop, not the loop's time.
 * dt__hs_start takes the accepted fd; dt__hs_step moves what the socket
 * allows without waiting (read only as many bytes as the current frame
 * needs, so nothing after the handshake is consumed) and returns
 * DT__HS_DONE (h->conn is ready: the caller owns it; `seen` marked),
 * DT__HS_FAILED (closed, the reason set with dt__error and logged unless
 * opt.quiet) or DT__HS_BUSY; poll the fd for dt__hs_events. Past h->deadline
 * it fails. dt__hs_feed is the byte-level core (also what the fuzz target
 * drives): it takes the bytes of the client's frames in any chunks, returns
 * how many it used and appends its answers to h->out. */
#  define DT__HELLO 128
/* The hello's fields (the layout: dt_handshake.c) and its flags. */
#  define DT__HELLO_F_TOKEN 1u
#  define DT__HELLO_F_JOB 2u /* the job id was given (DTRAIN_JOB_ID, set by dtrain-launch), not derived */
typedef struct dt__hello {
  uint32_t role, index, workers, servers;
  uint64_t model_hash;
  uint32_t flags;
  uint32_t lane;
  unsigned char nonce[DT__NET_NONCE];
  char addr[64];
} dt__hello;
/* A hello to and from its 128 bytes; this process's own (a fresh nonce). */
DTRAIN_PRIVATE void dt__hello_pack(const dt__hello *h, unsigned char b[DT__HELLO]);
DTRAIN_PRIVATE void dt__hello_unpack(const unsigned char b[DT__HELLO], dt__hello *h);
DTRAIN_PRIVATE void dt__hello_self(const dt__net_self *self, dt__hello *h);
/* The proof of side 'C' (connector) or 'A' (acceptor): HMAC-SHA256 of the token over
 * both hellos and the job (dt_handshake.c). */
DTRAIN_PRIVATE void dt__net_proof(const dt__net_self *self, char side, const unsigned char conn_hello[DT__HELLO],
                                  const unsigned char acc_hello[DT__HELLO], unsigned char out[32]);
/* The acceptor's states (dt__hs.state; the state machine: dt_handshake.c). */
enum { DT__HSS_HELLO = 0, DT__HSS_AUTH, DT__HSS_SEND, DT__HSS_REFUSING, DT__HSS_DONE, DT__HSS_FAILED };
#  define DT__HS_IN (DT__NET_HDR + 512)  /* a hello, a proof or a refusal's text */
#  define DT__HS_OUT 640                 /* WELCOME + AUTH + READY, or WELCOME + REFUSE */
#  define DT__NET_PENDING_MAX 32         /* connections in the handshake at a time (then the oldest goes) */
/* The refusal of a rank that is still connected (the words a restarted
 * parameter-server worker retries on: the server may not have noticed yet
 * that the old process is gone). */
#  define DT__NET_ALREADY "is already connected (duplicate rank"
/* A flag in the acceptor's seen[] beside the lane bits: that worker said BYE
 * (a parameter server's): a connection with its rank is refused as such. */
#  define DT__NET_SEEN_LEFT 0x80u

enum { DT__HS_BUSY = 0, DT__HS_DONE = 1, DT__HS_FAILED = -1 };
typedef struct dt__hs {
  dt__conn conn;
  int state;             /* private: dt_handshake.c's DT__HSS_* */
  double started, deadline;
  char addr[DT__NET_ADDR];
  unsigned char in[DT__HS_IN];
  uint32_t in_len;       /* bytes of the current frame so far */
  dt__frame f;           /* its header, once in_len >= DT__NET_HDR */
  unsigned char out[DT__HS_OUT];
  uint32_t out_len, out_off;
  unsigned char mine[DT__HELLO], theirs[DT__HELLO];
  int marked;            /* seen[] was set for this peer (undone when the last bytes cannot go) */
  double clk_hello, clk_welcome; /* our clock when the hello was in and when the welcome went (READY says them) */
  dt_result rc;
  char why[DT__MSG_CAP];
} dt__hs;
/* READY's payload (version 4): the acceptor's clock when the hello was in
 * and when its welcome went, two f64 LE. The connector read its own clock
 * just before its hello went (t0) and when the welcome was in (t3): the
 * acceptor's clock minus its own is ((t1 - t0) + (t2 - t3)) / 2, within half
 * the delay (t3 - t0) - (t2 - t1). Refuses a payload of another length and
 * readings that cannot be (not finite, t2 < t1, longer at the acceptor than
 * the whole round trip). */
#  define DT__READY_LEN 16
DTRAIN_PRIVATE dt_result dt__hs_clock_read(const unsigned char *p, uint32_t len, double t0, double t3, double *offset,
                                           double *delay, char *why, size_t cap);
DTRAIN_PRIVATE void dt__hs_start(dt__hs *h, const dt__net_self *self, int fd, const char *addr, double deadline);
DTRAIN_PRIVATE size_t dt__hs_feed(dt__hs *h, const dt__net_self *self, unsigned char *seen, const unsigned char *p,
                                  size_t n);
DTRAIN_PRIVATE int dt__hs_step(dt__hs *h, const dt__net_self *self, unsigned char *seen);
DTRAIN_PRIVATE short dt__hs_events(const dt__hs *h);
/* Which of n handshakes to drop when the table is full: the oldest that has
 * sent nothing yet, else the oldest (a real peer's hello arrives within a
 * round trip, so a flood of silent connections evicts its own kind first). */
DTRAIN_PRIVATE int dt__hs_victim(const dt__hs *h, int n);
/* Give up on h (fd closed, logged unless quiet): why names the reason ("too many ..."). */
DTRAIN_PRIVATE void dt__hs_drop(dt__hs *h, const dt__net_self *self, dt_result code, const char *why);
/* The handshake deadline: opt.handshake_timeout_s, at most timeout_s. */
DTRAIN_PRIVATE double dt__net_hs_timeout(const dt__net_self *self);
/* Read 32 bytes of randomness (/dev/urandom, else a hash of time and pid). */
DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n);
#endif /* DTRAIN_NO_NET */

#endif /* DTRAIN_NET_CORE_H */
