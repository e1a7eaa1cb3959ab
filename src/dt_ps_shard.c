/* ===========================================================================
 * dt_ps_shard.c -- parameter servers: which server owns which parameter
 * (dt_ps_shard), and a shard's size, layout hash and bytes (see dt_ps_core.h)
 * ===========================================================================
 * Every process computes the same assignment from the params alone, so the
 * servers and the workers agree without asking each other; the layout hash
 * checks that they did.
 */
#include "dt_internal.h"
#include "dt_strategy.h"
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
#include "dt_ps_core.h"

#if !defined(DTRAIN_NO_DIST) /* the whole file; the stubs at the end stand in without it */

DTRAIN_API dt_result dt_ps_shard(const dt_params *p, int servers, int *server_of) {
  const char *fn = "dt_ps_shard";
  if (!p || !server_of) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !p ? "params" : "server_of");
  if (servers < 1 || servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d servers (need 1..%d)", fn, servers, DTRAIN_MAX_PEERS);
  int n = dt_params_count(p);
  if (n <= 0) return DTRAIN_OK;
  int *order = (int *)dt__alloc((size_t)n * sizeof(int));
  uint64_t *load = (uint64_t *)dt__calloc((size_t)servers * sizeof(uint64_t));
  if (!order || !load) {
    dt__free(order, (size_t)n * sizeof(int));
    dt__free(load, (size_t)servers * sizeof(uint64_t));
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
  }
  size_t b = 0, e = 0;
  int tr, dec;
  /* Largest first, ties by index: insertion sort (parameter counts are small). */
  for (int i = 0; i < n; i++) {
    dt__params_range(p, i, &b, &e, &tr, &dec);
    size_t si = e - b;
    int j = i;
    while (j > 0) {
      size_t b2 = 0, e2 = 0;
      dt__params_range(p, order[j - 1], &b2, &e2, &tr, &dec);
      if (e2 - b2 >= si) break;
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
  for (int k = 0; k < n; k++) {
    int i = order[k], best = 0;
    for (int s = 1; s < servers; s++)
      if (load[s] < load[best]) best = s;
    dt__params_range(p, i, &b, &e, &tr, &dec);
    load[best] += (uint64_t)(e - b);
    server_of[i] = best;
  }
  dt__free(order, (size_t)n * sizeof(int));
  dt__free(load, (size_t)servers * sizeof(uint64_t));
  return DTRAIN_OK;
}

/* Floats of server s's shard. */
DTRAIN_PRIVATE size_t dt__ps_shard_floats(const dt_params *p, const int *owner, int s) {
  size_t n = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
    if (owner[i] == s) n += e - b;
  return n;
}

/* Four numbers into the hash, each as 8 little-endian bytes. */
static uint64_t dt__ps_shard_hash4(uint64_t h, const uint64_t v[4]) {
  unsigned char b[32];
  for (int k = 0; k < 4; k++) dt__put_le64(b + 8 * k, v[k]);
  return dt__fnv1a64(h, b, sizeof b);
}

/* FNV-1a over the shard's parameter ranges, the params' size and the server count. */
DTRAIN_PRIVATE uint64_t dt__ps_layout_hash(const dt_params *p, const int *owner, int s, int servers) {
  uint64_t h = DT__FNV64_OFFSET;
  uint64_t v[4];
  size_t b, e;
  int tr, dec;
  v[0] = (uint64_t)dt_params_size(p);
  v[1] = (uint64_t)servers;
  v[2] = (uint64_t)s;
  v[3] = (uint64_t)dt_params_count(p);
  h = dt__ps_shard_hash4(h, v);
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    v[0] = (uint64_t)i;
    v[1] = (uint64_t)b;
    v[2] = (uint64_t)e;
    v[3] = (uint64_t)tr;
    h = dt__ps_shard_hash4(h, v);
  }
  return h;
}

/* The shard of a full-layout buffer to little-endian bytes (its parameters'
 * ranges in order), and back. */
DTRAIN_PRIVATE void dt__ps_gather(const dt_params *p, const int *owner, int s, const float *full, unsigned char *out) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__put_f32le(out + 4 * off, full + b, e - b);
    off += e - b;
  }
}

DTRAIN_PRIVATE void dt__ps_scatter(const dt_params *p, const int *owner, int s, const unsigned char *in, float *full) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__get_f32le(full + b, in + 4 * off, e - b);
    off += e - b;
  }
}

#  if !defined(DTRAIN_NO_NET)
DTRAIN_PRIVATE int dt__ps_pieces(const dt_params *p, const int *owner, int s, const float *full, struct iovec *iov) {
  size_t b, e;
  int tr, dec, n = 0;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s || e == b) continue;
    iov[n].iov_base = (void *)(uintptr_t)(full + b);
    iov[n++].iov_len = (e - b) * sizeof(float);
  }
  return n;
}
#  endif

DTRAIN_PRIVATE void dt__ps_shard_copy(const dt_params *p, const int *owner, int s, float *full, float *shard, int out) {
  size_t b, e, k = 0;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
    if (owner[i] == s) {
      if (out) memcpy(shard + k, full + b, (e - b) * sizeof(float));
      else memcpy(full + b, shard + k, (e - b) * sizeof(float));
      k += e - b;
    }
}

#else /* DTRAIN_NO_DIST: every entry point says so */

DTRAIN_API dt_result dt_ps_shard(const dt_params *p, int servers, int *server_of) {
  (void)p; (void)servers; (void)server_of;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_ps_shard: compiled out (DTRAIN_NO_DIST)");
}

#endif /* DTRAIN_NO_DIST */
