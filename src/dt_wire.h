/* ===========================================================================
 * dt_wire.h -- private: the bytes on the wire, below any socket: byte order
 * (dt_net_bytes.c), checksums and hashes (dt_hash.c) and the frame header
 * (dt_frame.c)
 * ===========================================================================
 * The wire format is written down in docs/wire_protocol.md; this is its one
 * implementation. Everything here is DTRAIN_PRIVATE and exists also without
 * networking (DTRAIN_NO_NET). It is the bottom of the transport: it uses no
 * sockets, connections, handshake, communicator or strategy, so that the
 * code above (dt_net_core.h, the TCP communicator, the parameter servers)
 * can change without touching what goes on the wire.
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
#ifndef DTRAIN_WIRE_H
#define DTRAIN_WIRE_H

#include "dt_internal.h"

#define DT__NET_MAGIC 0x4E525444u
#define DT__NET_HDR 40
#define DT__NET_F_PAYLOAD_CRC 1u

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

/* DTRAIN_NO_DIST compiles these functions out with the network layer, and
 * their declarations too: gcc warns of a static declared but never defined. */
#if !defined(DTRAIN_NO_DIST)
/* ---- byte order: the shared helpers of dt_internal.h -------------------------------------------
 * Every multi-byte field on the wire and in a shard checkpoint is
 * little-endian, written byte by byte (never a struct copied): dt__put_le32,
 * dt__get_le64, dt__put_f32le (a plain copy on a little-endian host), ... */

/* ---- checksums, hashes and authentication (dt_hash.c) ---------------------------------------- */
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
/* FNV-1a: dt__fnv1a64 of dt_internal.h (the job id, a server's shard layout). */

/* ---- frames (dt_frame.c) ---------------------------------------------------------------------- */
DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length);
/* Decode and check a header: magic, version, header checksum, job (unless
 * job is 0), length <= max_payload. DTRAIN_ERR_PROTOCOL (or _MISMATCH for a
 * wrong job/version) with the reason in why (never NULL; cap >= 1). */
DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap);
/* 1 when the payload matches the checksum (or the frame does not cover it). */
DTRAIN_PRIVATE int dt__frame_payload_ok(const unsigned char h[DT__NET_HDR], const dt__frame *f, const void *payload);

#endif /* DTRAIN_NO_DIST */

#endif /* DTRAIN_WIRE_H */
