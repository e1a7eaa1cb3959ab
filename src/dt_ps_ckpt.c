/* ===========================================================================
 * dt_ps_ckpt.c -- parameter servers: shard checkpoints, DIR/ps-<i>-of-<M>.ckpt
 * (see dt_ps_core.h)
 * ===========================================================================
 * Layout (little-endian): a 64-byte header -- u32 magic "DTPS", u32 version 1,
 * u32 shard index, u32 servers, u64 params floats, u64 shard floats, u64
 * layout hash, u64 updates applied, u64 optimizer steps, u32 optimizer slots
 * -- then the shard's values, then each optimizer slot's shard, then the
 * CRC-32C of everything before it. Written to a temporary file, synced and
 * renamed, so a crash leaves the old checkpoint or the new one.
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

#if !defined(DTRAIN_NO_NET)
#  include <errno.h>
#  include <unistd.h>

#define DT__PS_CKPT_MAGIC 0x53505444u /* "DTPS" */
#define DT__PS_CKPT_HDR 64

static int dt__ps_slots(const dt__ps_server *S) { return dt_optim_state_slots(S->opt); }

/* Header, the shard's values, one shard per optimizer slot, CRC-32C. */
DTRAIN_PRIVATE size_t dt__ps_ckpt_size(const dt__ps_server *S) {
  return DT__PS_CKPT_HDR + (size_t)(1 + dt__ps_slots(S)) * S->shard * 4 + 4;
}

#  ifndef DTRAIN_NO_STDIO
DTRAIN_PRIVATE dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  unsigned char *b = S->ckpt;
  int slots = dt__ps_slots(S);
  memset(b, 0, DT__PS_CKPT_HDR);
  dt__put_le32(b, DT__PS_CKPT_MAGIC);
  dt__put_le32(b + 4, 1);
  dt__put_le32(b + 8, (uint32_t)S->me);
  dt__put_le32(b + 12, (uint32_t)S->c->servers);
  dt__put_le64(b + 16, (uint64_t)dt_params_size(S->params));
  dt__put_le64(b + 24, (uint64_t)S->shard);
  dt__put_le64(b + 32, S->layout);
  dt__put_le64(b + 40, S->version);
  dt__put_le64(b + 48, (uint64_t)dt_optim_steps(S->opt));
  dt__put_le32(b + 56, (uint32_t)slots);
  size_t off = DT__PS_CKPT_HDR;
  dt__ps_gather(S->params, S->owner, S->me, dt_params_data(S->params), b + off);
  off += S->shard * 4;
  for (int k = 0; k < slots; k++) {
    dt__ps_gather(S->params, S->owner, S->me, dt_optim_state(S->opt, k), b + off);
    off += S->shard * 4;
  }
  dt__put_le32(b + off, dt__crc32c(0, b, off));
  off += 4;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%.1024s.tmp", S->ckpt_path);
  FILE *f = fopen(tmp, "wb");
  if (!f) return dt__error(DTRAIN_ERR_IO, "ps %d: cannot create '%s': %s", S->me, tmp, strerror(errno));
  int ok = fwrite(b, 1, off, f) == off && fflush(f) == 0;
  if (ok) {
    int rc;
    do rc = fsync(fileno(f)); while (rc != 0 && errno == EINTR);
  }
  if (fclose(f) != 0) ok = 0;
  if (!ok || rename(tmp, S->ckpt_path) != 0) {
    int saved = errno;
    remove(tmp);
    return dt__error(DTRAIN_ERR_IO, "ps %d: writing the checkpoint '%s' failed: %s", S->me, S->ckpt_path,
                     strerror(saved));
  }
  S->since_ckpt = 0;
  S->last_ckpt = dt__now();
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__ps_ckpt_read(dt__ps_server *S) {
  FILE *f = fopen(S->ckpt_path, "rb");
  if (!f) return DTRAIN_OK;
  unsigned char *b = S->ckpt;
  size_t got = fread(b, 1, S->ckpt_bytes, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  const char *p = S->ckpt_path;
  if (got < DT__PS_CKPT_HDR + 4 || dt__get_le32(b) != DT__PS_CKPT_MAGIC || dt__get_le32(b + 4) != 1)
    return dt__error(DTRAIN_ERR_FORMAT, "ps %d: '%s' is not a dtrain parameter-server checkpoint", S->me, p);
  if (dt__get_le32(b + 8) != (uint32_t)S->me || dt__get_le32(b + 12) != (uint32_t)S->c->servers ||
      dt__get_le64(b + 16) != (uint64_t)dt_params_size(S->params) || dt__get_le64(b + 24) != (uint64_t)S->shard ||
      dt__get_le64(b + 32) != S->layout || dt__get_le32(b + 56) != (uint32_t)dt__ps_slots(S))
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "ps %d: checkpoint '%s' is shard %u of %u servers with %llu floats (%u optimizer slots); this "
                     "server is shard %d of %d with %zu floats (%d slots) of another layout or model",
                     S->me, p, (unsigned)dt__get_le32(b + 8), (unsigned)dt__get_le32(b + 12),
                     (unsigned long long)dt__get_le64(b + 24), (unsigned)dt__get_le32(b + 56), S->me, S->c->servers,
                     S->shard, dt__ps_slots(S));
  if (got != S->ckpt_bytes || extra || dt__get_le32(b + got - 4) != dt__crc32c(0, b, got - 4))
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' is truncated or corrupt (checksum)", S->me, p);
  S->version = dt__get_le64(b + 40);
  dt_optim_set_steps(S->opt, (int64_t)dt__get_le64(b + 48));
  size_t off = DT__PS_CKPT_HDR;
  dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_params_data(S->params));
  off += S->shard * 4;
  for (int k = 0; k < dt__ps_slots(S); k++) {
    dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_optim_state(S->opt, k));
    off += S->shard * 4;
  }
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: resumed from '%s' (%llu updates, optimizer step %lld)", S->me, p,
          (unsigned long long)S->version, (long long)dt_optim_steps(S->opt));
  return DTRAIN_OK;
}
#  else
DTRAIN_PRIVATE dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "ps %d: checkpoints need stdio (built with DTRAIN_NO_STDIO)", S->me);
}
DTRAIN_PRIVATE dt_result dt__ps_ckpt_read(dt__ps_server *S) { return dt__ps_ckpt_write(S); }
#  endif

DTRAIN_PRIVATE void dt__ps_maybe_ckpt(dt__ps_server *S) {
  if (!S->ckpt) return;
  int due = (S->po.checkpoint_every > 0 && S->since_ckpt >= S->po.checkpoint_every) ||
            (S->po.checkpoint_seconds > 0 && dt__now() - S->last_ckpt >= S->po.checkpoint_seconds);
  if (due && dt__ps_ckpt_write(S) != DTRAIN_OK) {
    dt__log(DTRAIN_LOG_WARN, dt_last_result(), "%s", dt_last_error());
    S->since_ckpt = 0;
    S->last_ckpt = dt__now();
  }
}

#  undef DT__PS_CKPT_MAGIC
#  undef DT__PS_CKPT_HDR

#endif /* DTRAIN_NO_NET */
