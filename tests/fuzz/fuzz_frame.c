/* libFuzzer target: the frame decoder (`make fuzz`).
 *
 * Three properties, chosen by the first input byte:
 *  0: raw bytes as a header (+ payload): the decoder never reads past the 40
 *     bytes, and whatever it accepts re-encodes to exactly the same bytes
 *     (there is one encoding per frame, so nothing odd slips through);
 *  1: a valid frame built from the input, then bytes flipped where the input
 *     says: every flip inside the header is refused;
 *  2: the input as a byte stream on a socket, read frame by frame the way a
 *     server reads a client: it ends in a clean error, never a crash, never
 *     an allocation or read beyond the caps. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_frame: %s\n", msg); abort(); } while (0)

static void fz_raw(const unsigned char *d, size_t n) {
  unsigned char h[DT__NET_HDR], again[DT__NET_HDR];
  if (n < DT__NET_HDR) return;
  memcpy(h, d, DT__NET_HDR);
  dt__frame f;
  char why[128];
  uint32_t cap = n > 41 ? d[40] * 64u : 4096u;
  if (dt__frame_unpack(h, 0, cap, &f, why, sizeof why) != DTRAIN_OK) {
    if (!why[0]) FZ_FAIL("refusal without a reason");
    return;
  }
  if (f.length > cap) FZ_FAIL("accepted a length above the cap");
  size_t have = n - DT__NET_HDR;
  const unsigned char *payload = d + DT__NET_HDR;
  if (f.length > have) return; /* truncated: the stream reader waits for more */
  int ok = dt__frame_payload_ok(h, &f, payload);
  if (!ok) return;
  dt__frame_pack(again, f.type, f.job, f.sender, f.seq, (f.flags & DT__NET_F_PAYLOAD_CRC) ? payload : NULL,
                 f.length);
  /* pack sets the payload flag only for control types; compare what it must agree on */
  if ((f.flags & DT__NET_F_PAYLOAD_CRC) == ((uint32_t)dt__get_le32(again + 20) & DT__NET_F_PAYLOAD_CRC) &&
      memcmp(h, again, DT__NET_HDR) != 0)
    FZ_FAIL("accepted header is not the canonical encoding of its fields");
}

static void fz_flip(const unsigned char *d, size_t n) {
  if (n < 12) return;
  /* a valid type: a control type 1..8 or a data type 0x40.. */
  uint16_t type = (d[0] & 1) ? (uint16_t)(1 + (d[0] >> 1) % 8) : (uint16_t)(0x40 + (d[0] >> 1 | d[1] << 7) % 0xFFC0);
  uint64_t job = dt__get_le64(d + 2);
  uint32_t plen = d[10] % 64u;
  if (n < 11 + plen) return;
  const unsigned char *payload = d + 11;
  unsigned char h[DT__NET_HDR], orig[DT__NET_HDR];
  dt__frame_pack(h, type, job, 7, 3, payload, plen);
  memcpy(orig, h, sizeof h);
  dt__frame f;
  char why[128];
  if (dt__frame_unpack(h, job, 64, &f, why, sizeof why) != DTRAIN_OK) FZ_FAIL("a packed frame was refused");
  if (f.type != type || f.job != job || f.length != plen || f.sender != 7 || f.seq != 3) FZ_FAIL("round trip changed a field");
  if (!dt__frame_payload_ok(h, &f, payload)) FZ_FAIL("a packed payload failed its checksum");
  /* flips: pairs (position, xor mask) after the payload */
  size_t i;
  int changed = 0;
  for (i = 11 + plen; i + 1 < n; i += 2) {
    unsigned pos = d[i] % DT__NET_HDR, mask = d[i + 1];
    if (!mask) continue;
    h[pos] ^= (unsigned char)mask;
  }
  changed = memcmp(h, orig, sizeof h) != 0;
  if (changed && dt__frame_unpack(h, job, 64, &f, why, sizeof why) == DTRAIN_OK && f.length <= plen &&
      dt__frame_payload_ok(h, &f, payload)) {
    /* CRC-32C detects every burst of up to 32 bits; larger multi-byte damage can collide, but only
     * with probability 2^-32: treat acceptance of a changed header as a failure when the damage
     * spans at most 4 consecutive bytes */
    int first = -1, last = -1, k;
    for (k = 0; k < DT__NET_HDR; k++)
      if (h[k] != orig[k]) { if (first < 0) first = k; last = k; }
    if (last - first < 4) FZ_FAIL("a damaged header was accepted");
  }
}

static void fz_stream(const unsigned char *d, size_t n) {
  int sv[2];
  if (n > 60000) n = 60000;
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
  size_t off = 0;
  while (off < n) {
    ssize_t w = write(sv[1], d + off, n - off);
    if (w <= 0) break;
    off += (size_t)w;
  }
  shutdown(sv[1], SHUT_WR);
  dt__conn c;
  dt__conn_init(&c, sv[0], 0, 1, 256);
  snprintf(c.peer, sizeof c.peer, "fuzz");
  unsigned char h[DT__NET_HDR], buf[256];
  int frames = 0;
  for (;;) {
    dt__frame f;
    dt_result rc = dt__conn_recv_header(&c, &f, h, dt__now() + 0.5, "fuzz");
    if (rc != DTRAIN_OK) break;
    if (f.length > 256) FZ_FAIL("header accepted above max_payload");
    rc = dt__conn_recv_payload(&c, &f, h, buf, dt__now() + 0.5, "fuzz");
    if (rc != DTRAIN_OK) break;
    frames++;
  }
  if (!dt_last_error()[0]) FZ_FAIL("stream ended without an error message");
  (void)frames;
  dt__conn_close(&c);
  close(sv[1]);
}

static void fz_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n);
int LLVMFuzzerTestOneInput(const unsigned char *d, size_t n) {
  static int quiet = 0;
  if (!quiet) { dt_set_logger(fz_log, NULL, DTRAIN_LOG_ERROR); quiet = 1; }
  if (n < 1) return 0;
  switch (d[0] % 3) {
    case 0: fz_raw(d + 1, n - 1); break;
    case 1: fz_flip(d + 1, n - 1); break;
    default: fz_stream(d + 1, n - 1); break;
  }
  return 0;
}
