/* libFuzzer target: the acceptor's side of the handshake (`make fuzz`).
 *
 * The input is what a client sends after connecting (written into a socket
 * pair whose far end is then shut). Half the inputs start with a genuine
 * hello whose fields the input then changes (so the fuzzer gets past the
 * checksum and reaches the field checks and the authentication step); the
 * rest are raw bytes. Properties: dt__net_admit never crashes, never hangs
 * past its deadline, always says why it refused, and admits a client only
 * when the client's hello matches this process (same world, job, model and,
 * with a token, never without a proof -- which the fuzzer cannot forge). */
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

int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n);
int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n) {
  static int once = 0;
  if (!once) { dt_set_logger(fz_log, NULL, DTRAIN_LOG_ERROR); once = 1; }
  if (n < 2 || n > 16384) return 0;
  int with_token = d[0] & 1, genuine = (d[0] & 2) != 0;
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
  o.quiet = 1;
  dt__net_self self;
  if (dt__net_self_init(&self, &cl, &o) != DTRAIN_OK) FZ_FAIL("self_init failed");

  unsigned char msg[DT__NET_HDR + DT__HELLO + 16384];
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
    d += 8; n -= 8;
  }
  memcpy(msg + len, d, n);
  len += n;

  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 0;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(sv[1], msg + off, len - off);
    if (w <= 0) break;
    off += (size_t)w;
  }
  shutdown(sv[1], SHUT_WR);
  unsigned char seen[3] = {0, 0, 0};
  dt__conn c;
  double t0 = dt__now();
  dt_result rc = dt__net_admit(&self, sv[0], "fuzz", t0 + 0.5, seen, &c);
  if (dt__now() - t0 > 5.0) FZ_FAIL("admit ran far past its deadline");
  if (rc == DTRAIN_OK) {
    if (with_token) FZ_FAIL("admitted a client with a token-protected process without a proof");
    if (c.peer_role != DTRAIN_ROLE_WORKER || c.peer_index < 1 || c.peer_index > 2) FZ_FAIL("admitted an impossible peer");
    if (!seen[c.peer_index]) FZ_FAIL("admitted peer not marked as seen");
    if (c.lane != 0) FZ_FAIL("admitted a second connection (lane 1) outside a 2-worker job");
    dt__conn_close(&c);
  } else if (!dt_last_error()[0]) {
    FZ_FAIL("refused without a message");
  }
  close(sv[1]);
  return 0;
}
