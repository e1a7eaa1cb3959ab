/* ===========================================================================
 * dt_net_bytes.c -- the wire's byte order: little-endian integers and floats
 * (see dt_wire.h)
 * ===========================================================================
 * Every multi-byte field on the wire and in a shard checkpoint is
 * little-endian, written byte by byte (never a struct copied), so the code
 * is the same on every host. Floats go out as they are on a little-endian
 * host (no copy, no loop) and are swapped on a big-endian one.
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

/* 1 on a little-endian host. A run-time test rather than __BYTE_ORDER__,
 * which not every compiler defines; compilers fold it to a constant. */
static int dt__net_bytes_host_le(void) {
  const uint16_t one = 1;
  unsigned char c;
  memcpy(&c, &one, 1);
  return c == 1;
}

DTRAIN_PRIVATE uint16_t dt__net_le16_get(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
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
  if (dt__net_bytes_host_le()) return;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &p[i], 4);
    u = (u >> 24) | ((u >> 8) & 0xFF00u) | ((u << 8) & 0xFF0000u) | (u << 24);
    memcpy(&p[i], &u, 4);
  }
}

DTRAIN_PRIVATE void dt__net_f32_put(unsigned char *dst, const float *src, size_t n) {
  if (dt__net_bytes_host_le()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, src + i, 4);
    dt__le32_put(dst + 4 * i, u);
  }
}

DTRAIN_PRIVATE void dt__net_f32_get(float *dst, const unsigned char *src, size_t n) {
  if (dt__net_bytes_host_le()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u = dt__le32_get(src + 4 * i);
    memcpy(dst + i, &u, 4);
  }
}

#endif /* DTRAIN_NO_DIST */
