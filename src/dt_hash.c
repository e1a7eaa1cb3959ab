/* ===========================================================================
 * dt_hash.c -- checksums and hashes of the wire: CRC-32C, SHA-256, HMAC-SHA256,
 * a constant-time comparison, FNV-1a (see dt_wire.h)
 * ===========================================================================
 * Written here rather than taken from a library so that the single header
 * needs nothing beyond libc. None of this is used for secrecy: the CRC guards
 * headers and control frames against corruption, SHA-256/HMAC prove that a
 * peer knows the shared token, FNV-1a names a job or a shard layout.
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

#endif /* DTRAIN_NO_DIST */
