/* libFuzzer target: the acceptor's side of the handshake (`make fuzz`).
 *
 * The input is what a client sends after connecting. Its first byte picks:
 * bit 0 a token on the acceptor (and in the fake hello), bit 1 a genuine
 * hello first (worker 1 of this cluster) whose fields the next 8 input
 * bytes change -- so the fuzzer gets past the checksum to the field checks
 * and the authentication step --, bit 2 the path: the non-blocking state
 * machine (dt__hs_feed) fed the bytes in arbitrary chunks (sizes 0..31 from
 * a generator seeded by the input), else the socket path (dt__net_admit
 * over a socket pair whose far end is then shut); bit 3 a well-formed AUTH
 * frame with a wrong proof after the genuine hello (reaches the proof
 * check); the rest of the input follows as raw bytes.
 *
 * Properties: nothing crashes or reads out of bounds; dt__net_admit never
 * hangs past its deadline and always says why it refused; the state
 * machine never consumes more than the frame in progress needs, never takes
 * a byte after it has decided, keeps its answers within its buffer, and
 * every answer is a well-formed frame of this job; a client is admitted
 * only when its hello matches this process (same world, job, model), is
 * marked as seen, and -- with a token -- never without a proof (which the
 * fuzzer cannot forge). */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_handshake: %s\n", msg); abort(); } while (0)

static void fz_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

/* Every frame the acceptor queued must decode (this job, our sender id, sequence 0, 1, ...). */
static void fz_check_out(const dt__hs *h, const dt__net_self *self) {
  uint32_t off = 0;
  uint64_t seq = 0;
  if (h->out_len > DT__HS_OUT || h->out_off > h->out_len) FZ_FAIL("answer buffer overrun");
  while (off < h->out_len) {
    dt__frame f;
    char why[160];
    if (h->out_len - off < DT__NET_HDR) FZ_FAIL("a truncated answer frame");
    if (dt__frame_unpack(h->out + off, self->job, DT__HS_OUT, &f, why, sizeof why) != DTRAIN_OK) FZ_FAIL(why);
    if (f.sender != self->id || f.seq != seq) FZ_FAIL("answer frame with a wrong sender or sequence number");
    if (h->out_len - off - DT__NET_HDR < f.length) FZ_FAIL("answer frame longer than the buffer");
    if (!dt__frame_payload_ok(h->out + off, &f, h->out + off + DT__NET_HDR)) FZ_FAIL("answer frame checksum");
    off += DT__NET_HDR + f.length;
    seq++;
  }
  if (seq != h->conn.send_seq) FZ_FAIL("send sequence number does not count the answers");
}

static void fz_check_admitted(const dt__conn *c, const unsigned char *seen, int with_token) {
  if (with_token) FZ_FAIL("admitted a client with a token-protected process without a proof");
  if (c->peer_role != DTRAIN_ROLE_WORKER || c->peer_index < 1 || c->peer_index > 2) FZ_FAIL("admitted an impossible peer");
  if (!seen[c->peer_index]) FZ_FAIL("admitted peer not marked as seen");
  if (c->lane != 0) FZ_FAIL("admitted a second connection (lane 1) outside a 2-worker job");
}

/* The state machine alone, fed msg in chunks: no socket, no time. */
static void fz_feed(const dt__net_self *self, const unsigned char *msg, size_t len, uint64_t seed, int with_token) {
  dt__hs h;
  unsigned char seen[3] = {0, 0, 0};
  dt__hs_start(&h, self, -1, "fuzz", dt__now() + 1.0);
  size_t off = 0;
  int rounds = 0;
  while (off < len && rounds++ < 100000) {
    size_t k = (size_t)(dt__splitmix64(&seed) % 32); /* 0 too: an empty feed must change nothing */
    if (k > len - off) k = len - off;
    int busy = h.state == DT__HSS_HELLO || h.state == DT__HSS_AUTH;
    uint32_t before = h.in_len;
    size_t used = dt__hs_feed(&h, self, seen, msg + off, k);
    if (used > k) FZ_FAIL("consumed more than it was given");
    if (!busy && used) FZ_FAIL("consumed bytes after it had decided");
    if (busy && used < k && (h.state == DT__HSS_HELLO || h.state == DT__HSS_AUTH)) FZ_FAIL("left bytes while still reading");
    if (k == 0 && (used || h.in_len != before)) FZ_FAIL("an empty feed changed something");
    if (h.in_len > DT__HS_IN) FZ_FAIL("input buffer overrun");
    fz_check_out(&h, self);
    off += used;
    if (!busy || (used < k)) break;
  }
  if (h.state == DT__HSS_SEND) { /* answers queued: admitted once they are out */
    fz_check_admitted(&h.conn, seen, with_token);
  } else if (h.state == DT__HSS_REFUSING && !h.why[0]) {
    FZ_FAIL("refused without a reason");
  }
}

/* The socket path: dt__net_admit (the same machine, polled) over a socket pair. */
static void fz_socket(const dt__net_self *self, const unsigned char *msg, size_t len, int with_token) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(sv[1], msg + off, len - off);
    if (w <= 0) break;
    off += (size_t)w;
  }
  shutdown(sv[1], SHUT_WR);
  dt__net_nonblock(sv[0]);
  unsigned char seen[3] = {0, 0, 0};
  dt__conn c;
  double t0 = dt__now();
  dt_result rc = dt__net_admit(self, sv[0], "fuzz", t0 + 0.5, seen, &c);
  if (dt__now() - t0 > 5.0) FZ_FAIL("admit ran far past its deadline");
  if (rc == DTRAIN_OK) {
    fz_check_admitted(&c, seen, with_token);
    dt__conn_close(&c);
  } else if (!dt_last_error()[0]) {
    FZ_FAIL("refused without a message");
  }
  close(sv[1]);
}

int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n);
int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n) {
  static int once = 0;
  if (!once) { dt_set_logger(fz_log, NULL, DTRAIN_LOG_ERROR); once = 1; }
  if (n < 2 || n > 16384) return 0;
  int with_token = d[0] & 1, genuine = (d[0] & 2) != 0, feed = (d[0] & 4) != 0, auth = (d[0] & 8) != 0;
  uint64_t seed = 0x9E3779B97F4A7C15ull ^ ((uint64_t)d[0] << 32) ^ (uint64_t)n;
  d++; n--;

  char a0[] = "127.0.0.1:1", a1[] = "127.0.0.1:2", a2[] = "127.0.0.1:3";
  char *addrs[3] = {a0, a1, a2};
  dt_cluster cl;
  memset(&cl, 0, sizeof cl);
  cl.workers = 3;
  cl.worker_addr = addrs;
  cl.role = DTRAIN_ROLE_WORKER;
  cl.index = 0;
  dt_net_options o = dt_net_defaults();
  o.token = with_token ? "fuzz-secret" : NULL;
  o.model_hash = 0x1234;
  o.job_id = 0x51;
  o.quiet = 1;
  dt__net_self self;
  if (dt__net_self_init(&self, &cl, &o) != DTRAIN_OK) FZ_FAIL("self_init failed");

  static unsigned char msg[2 * DT__NET_HDR + DT__HELLO + 32 + 16384];
  size_t len = 0;
  if (genuine && n >= 8) {
    /* a real client's hello (worker 1 of this cluster), then fields overwritten by the input */
    dt__net_self peer;
    cl.index = 1;
    if (dt__net_self_init(&peer, &cl, &o) != DTRAIN_OK) FZ_FAIL("peer self_init failed");
    dt__hello h;
    unsigned char b[DT__HELLO];
    dt__hello_self(&peer, &h);
    cl.index = 0;
    dt__hello_pack(&h, b);
    /* d[0..7]: four (offset, value) pairs applied to the hello */
    int k;
    for (k = 0; k < 4; k++)
      if (d[2 * k + 1]) b[d[2 * k] % DT__HELLO] = d[2 * k + 1];
    dt__frame_pack(msg, DT__MSG_HELLO, self.job, peer.id, 0, b, DT__HELLO);
    memcpy(msg + DT__NET_HDR, b, DT__HELLO);
    len = DT__NET_HDR + DT__HELLO;
    if (auth) {
      /* a well-formed proof frame, with a proof made from the input (wrong, short of breaking HMAC) */
      unsigned char proof[32];
      for (k = 0; k < 32; k++) proof[k] = d[k % 8] ^ (unsigned char)k;
      dt__frame_pack(msg + len, DT__MSG_AUTH, self.job, peer.id, 1, proof, 32);
      memcpy(msg + len + DT__NET_HDR, proof, 32);
      len += DT__NET_HDR + 32;
    }
    d += 8; n -= 8;
  }
  memcpy(msg + len, d, n);
  len += n;

  if (feed) fz_feed(&self, msg, len, seed, with_token);
  else fz_socket(&self, msg, len, with_token);
  return 0;
}
