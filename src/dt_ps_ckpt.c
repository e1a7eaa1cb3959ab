/* ===========================================================================
 * dt_ps_ckpt.c -- parameter servers: shard checkpoints, DIR/ps-<i>-of-<M>.ckpt
 * (see dt_ps_core.h)
 * ===========================================================================
 * Layout (little-endian): a 64-byte header -- u32 magic "DTPS", u32 version 1,
 * u32 shard index, u32 servers, u64 params floats, u64 shard floats, u64
 * layout hash, u64 updates applied, u64 optimizer steps, u32 optimizer slots
 * -- then the shard's values, then each optimizer slot's shard, then the
 * CRC-32C of everything before it. Written through dt_file.h (a temporary
 * file created exclusively, synced and renamed), so a crash leaves the old
 * checkpoint or the new one.
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
#include "dt_file.h"

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
  /* The shared atomic writer: created exclusively (a link planted at the
   * temporary name is never written through), synced, renamed. */
  dt__file_out fo;
  dt_result r = dt__file_create(&fo, S->ckpt_path);
  if (r != DTRAIN_OK) return dt__error(r, "ps %d: checkpoint '%s': %s", S->me, S->ckpt_path, fo.msg);
  if (fwrite(b, 1, off, fo.f) != off) {
    int saved = errno;
    dt__file_abort(&fo);
    return dt__error(DTRAIN_ERR_IO, "ps %d: writing the checkpoint '%s' failed: %s", S->me, S->ckpt_path,
                     strerror(saved));
  }
  r = dt__file_commit(&fo);
  if (r != DTRAIN_OK)
    return dt__error(r, "ps %d: writing the checkpoint '%s' failed: %s", S->me, S->ckpt_path, fo.msg);
  S->since_ckpt = 0;
  S->last_ckpt = dt__now();
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__ps_ckpt_check_dir(dt__ps_server *S, const char *fn) {
  dt__quiet_push(); /* one log line: the message below, not also the inner one */
  if (dt_check_writable(S->ckpt_path, 0) == DTRAIN_OK) return dt__quiet_pop(DTRAIN_OK);
  char why[DT__MSG_CAP];
  snprintf(why, sizeof why, "%s", dt_last_error());
  return dt__quiet_pop(dt__error(dt_last_result(), "%s: ps %d: checkpoint_dir '%s': %s", fn, S->me,
                                   S->po.checkpoint_dir, why));
}

DTRAIN_PRIVATE dt_result dt__ps_ckpt_read(dt__ps_server *S) {
  /* A regular file of exactly the expected size, or nothing is read (a FIFO
   * or a device planted there is refused without blocking). */
  FILE *f;
  uint64_t fsize;
  char why[200];
  if (dt__file_open_read(S->ckpt_path, &f, &fsize, why, sizeof why) != DTRAIN_OK) {
    if (errno == ENOENT) return DTRAIN_OK; /* no checkpoint yet */
    return dt__error(DTRAIN_ERR_IO, "ps %d: checkpoint '%s': %s", S->me, S->ckpt_path, why);
  }
  unsigned char *b = S->ckpt;
  size_t got = 0;
  int extra = fsize > (uint64_t)S->ckpt_bytes; /* read no more than a checkpoint holds */
  got = fread(b, 1, extra ? S->ckpt_bytes : (size_t)fsize, f);
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
  /* Checksummed is not sound: a hand-made file may carry any numbers. */
  if ((int64_t)dt__get_le64(b + 48) < 0 || (int64_t)dt__get_le64(b + 40) < 0)
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' holds a negative count (%lld updates, optimizer "
                     "step %lld)", S->me, p, (long long)dt__get_le64(b + 40), (long long)dt__get_le64(b + 48));
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
DTRAIN_PRIVATE dt_result dt__ps_ckpt_check_dir(dt__ps_server *S, const char *fn) {
  (void)fn;
  return dt__ps_ckpt_write(S);
}
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
