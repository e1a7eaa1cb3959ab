/* ===========================================================================
 * dt_frame.c -- the frame header: encode, decode and check (see dt_wire.h and
 * docs/wire_protocol.md)
 * ===========================================================================
 * Pure functions over byte buffers, also built without networking: the
 * sockets and connections that move frames are in dt_socket.c and
 * dt_conn.c.
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
#include "dt_wire.h"

#if !defined(DTRAIN_NO_DIST) /* the whole file: only the network layer uses it */

DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length) {
  uint32_t flags = type < DT__MSG_DATA0 ? DT__NET_F_PAYLOAD_CRC : 0u;
  dt__put_le32(h, DT__NET_MAGIC);
  h[4] = (unsigned char)(DTRAIN_NET_VERSION & 0xFF);
  h[5] = (unsigned char)(DTRAIN_NET_VERSION >> 8);
  h[6] = (unsigned char)(type & 0xFF);
  h[7] = (unsigned char)(type >> 8);
  dt__put_le64(h + 8, job);
  dt__put_le32(h + 16, sender);
  dt__put_le32(h + 20, flags);
  dt__put_le64(h + 24, seq);
  dt__put_le32(h + 32, length);
  uint32_t crc = dt__crc32c(0, h, 36);
  if ((flags & DT__NET_F_PAYLOAD_CRC) && length > 0 && payload) crc = dt__crc32c(crc, payload, length);
  dt__put_le32(h + 36, crc);
}

DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap) {
  memset(f, 0, sizeof *f);
  why[0] = '\0';
  f->magic = dt__get_le32(h);
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
  f->version = dt__get_le16(h + 4);
  f->type = dt__get_le16(h + 6);
  f->job = dt__get_le64(h + 8);
  f->sender = dt__get_le32(h + 16);
  f->flags = dt__get_le32(h + 20);
  f->seq = dt__get_le64(h + 24);
  f->length = dt__get_le32(h + 32);
  f->checksum = dt__get_le32(h + 36);
  uint32_t crc = dt__crc32c(0, h, 36);
  int covers = (f->flags & DT__NET_F_PAYLOAD_CRC) != 0;
  if (!covers && crc != f->checksum) {
    snprintf(why, cap, "header checksum mismatch (0x%08x, computed 0x%08x)", (unsigned)f->checksum, (unsigned)crc);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->version != DTRAIN_NET_VERSION) {
    snprintf(why, cap, "protocol version %u, this build speaks %d (every process of a job must run the same wire "
             "version; see docs/wire_protocol.md)",
             (unsigned)f->version, DTRAIN_NET_VERSION);
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
    snprintf(why, cap, "frame of job %016llx, this is job %016llx (another job: DTRAIN_JOB_ID differs or is not set)",
             (unsigned long long)f->job, (unsigned long long)job);
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

#endif /* DTRAIN_NO_DIST */
