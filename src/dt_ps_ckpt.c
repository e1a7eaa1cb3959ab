/* ===========================================================================
 * dt_ps_ckpt.c -- parameter servers: shard checkpoints, DIR/ps-<i>-of-<M>.ckpt
 * (see dt_ps_core.h)
 * ===========================================================================
 * Layout (little-endian): a 64-byte header -- u32 magic "DTPS", u32 version 2,
 * u32 shard index, u32 servers, u64 params floats, u64 shard floats, u64
 * layout hash, u64 updates applied, u64 optimizer steps, u32 optimizer slots
 * -- then the shard's values, then each optimizer slot's shard, then the work
 * queue (server 0 with dt_ps_options.work_items; zeros elsewhere): u64 items,
 * u64 next (items below were handed out), u64 done, u64 handed out, u64
 * returned, u64 count, then count i64: the items below next that are not
 * done (given back, or held by a worker: it gives them back when it goes,
 * so a resumed queue hands them out again; at most one per worker), then the
 * CRC-32C of everything before it. Version 1 (no queue section) is still
 * read: its queue starts over. Written through dt_file.h (a temporary
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
#define DT__PS_CKPT_QHDR 48 /* the work queue's six counts */

static int dt__ps_slots(const dt__ps_server *S) { return dt_optim_state_slots(S->opt); }

/* Header, the shard's values, one shard per optimizer slot (version 1 ends there), the
 * work queue (its items to do again: at most one per worker), CRC-32C. */
static size_t dt__ps_ckpt_size_v1(const dt__ps_server *S) {
  return DT__PS_CKPT_HDR + (size_t)(1 + dt__ps_slots(S)) * S->shard * 4 + 4;
}

/* The largest (the buffer's size). */
DTRAIN_PRIVATE size_t dt__ps_ckpt_size(const dt__ps_server *S) {
  return dt__ps_ckpt_size_v1(S) + DT__PS_CKPT_QHDR + (size_t)S->W * 8;
}

#  ifndef DTRAIN_NO_STDIO
/* The work queue into b (room for DT__PS_CKPT_QHDR + 8 W bytes): its counts,
 * then the items handed out and not done (given back, or held by a live
 * worker). Returns the bytes written. */
static size_t dt__ps_ckpt_put_queue(const dt__ps_server *S, unsigned char *b) {
  memset(b, 0, DT__PS_CKPT_QHDR);
  if (!S->q_back) return DT__PS_CKPT_QHDR;
  uint64_t count = 0;
  for (int k = 0; k < S->q_nback; k++) dt__put_le64(b + DT__PS_CKPT_QHDR + 8 * count++, (uint64_t)S->q_back[k]);
  for (int i = 0; i < S->W && count < (uint64_t)S->W; i++)
    if (S->w && S->w[i].lease >= 0) dt__put_le64(b + DT__PS_CKPT_QHDR + 8 * count++, (uint64_t)S->w[i].lease);
  dt__put_le64(b, (uint64_t)S->q.items);
  dt__put_le64(b + 8, (uint64_t)S->q_next);
  dt__put_le64(b + 16, (uint64_t)S->q.done);
  dt__put_le64(b + 24, (uint64_t)S->q.handed_out);
  dt__put_le64(b + 32, (uint64_t)S->q.returned);
  dt__put_le64(b + 40, count);
  return DT__PS_CKPT_QHDR + 8 * (size_t)count;
}

/* The work queue of a checkpoint (b, as dt__ps_ckpt_put_queue writes it),
 * checked against this server's and for sense, then taken: the items not
 * done are handed out first. */
static dt_result dt__ps_ckpt_get_queue(dt__ps_server *S, const unsigned char *b, const char *path) {
  const int64_t items = (int64_t)dt__get_le64(b), next = (int64_t)dt__get_le64(b + 8),
                done = (int64_t)dt__get_le64(b + 16), handed = (int64_t)dt__get_le64(b + 24),
                returned = (int64_t)dt__get_le64(b + 32);
  const uint64_t count = dt__get_le64(b + 40);
  if (items != S->q.items)
    return dt__error(DTRAIN_ERR_MISMATCH, "ps %d: checkpoint '%s' holds a work queue of %lld items; this server's "
                     "has %lld (dt_ps_options.work_items, on server 0 only)", S->me, path, (long long)items,
                     (long long)S->q.items);
  const char *bad = NULL;
  if (next < 0 || next > items) bad = "items handed out beyond the queue";
  else if ((int64_t)count > next) bad = "more items to do again than were handed out";
  else if (done != next - (int64_t)count) bad = "a done count that is not the items handed out less those to do again";
  else if (handed < next || returned < 0 || returned > handed) bad = "hand-out counts that do not add up";
  for (uint64_t k = 0; !bad && k < count; k++) {
    int64_t it = (int64_t)dt__get_le64(b + DT__PS_CKPT_QHDR + 8 * k);
    if (it < 0 || it >= next) bad = "an item to do again that was never handed out";
    for (uint64_t j = 0; !bad && j < k; j++)
      if ((int64_t)dt__get_le64(b + DT__PS_CKPT_QHDR + 8 * j) == it) bad = "an item to do again twice";
  }
  if (bad) return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s': its work queue has %s", S->me, path, bad);
  if (!S->q_back) return DTRAIN_OK; /* no queue here (items 0) */
  S->q_next = next;
  S->q_nback = (int)count;
  for (uint64_t k = 0; k < count; k++) /* (the lowest handed out first: taken from the end) */
    S->q_back[count - 1 - k] = (int64_t)dt__get_le64(b + DT__PS_CKPT_QHDR + 8 * k);
  S->q.done = done;
  S->q.handed_out = handed;
  S->q.returned = returned;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  unsigned char *b = S->ckpt;
  int slots = dt__ps_slots(S);
  memset(b, 0, DT__PS_CKPT_HDR);
  dt__put_le32(b, DT__PS_CKPT_MAGIC);
  dt__put_le32(b + 4, 2);
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
  off += dt__ps_ckpt_put_queue(S, b + off);
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
  const uint32_t fv = got >= 8 ? dt__get_le32(b + 4) : 0;
  if (got < DT__PS_CKPT_HDR + 4 || dt__get_le32(b) != DT__PS_CKPT_MAGIC || (fv != 1 && fv != 2))
    return dt__error(DTRAIN_ERR_FORMAT, "ps %d: '%s' is not a dtrain parameter-server checkpoint (of version 1 or "
                     "2)", S->me, p);
  /* version 2: the work queue's items to do again, one per worker at most (this job's) */
  const size_t qoff = DT__PS_CKPT_HDR + (size_t)(1 + dt__ps_slots(S)) * S->shard * 4;
  const uint64_t qcount = fv == 2 && got >= qoff + DT__PS_CKPT_QHDR ? dt__get_le64(b + qoff + 40) : 0;
  if (qcount > (uint64_t)S->W)
    return dt__error(DTRAIN_ERR_MISMATCH, "ps %d: checkpoint '%s' holds a work queue with %llu items to do again, "
                     "more than this job's %d workers can have held", S->me, p, (unsigned long long)qcount, S->W);
  const size_t want = dt__ps_ckpt_size_v1(S) + (fv == 2 ? DT__PS_CKPT_QHDR + 8 * (size_t)qcount : 0);
  if (dt__get_le32(b + 8) != (uint32_t)S->me || dt__get_le32(b + 12) != (uint32_t)S->c->servers ||
      dt__get_le64(b + 16) != (uint64_t)dt_params_size(S->params) || dt__get_le64(b + 24) != (uint64_t)S->shard ||
      dt__get_le64(b + 32) != S->layout || dt__get_le32(b + 56) != (uint32_t)dt__ps_slots(S))
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "ps %d: checkpoint '%s' is shard %u of %u servers with %llu floats (%u optimizer slots); this "
                     "server is shard %d of %d with %zu floats (%d slots) of another layout or model",
                     S->me, p, (unsigned)dt__get_le32(b + 8), (unsigned)dt__get_le32(b + 12),
                     (unsigned long long)dt__get_le64(b + 24), (unsigned)dt__get_le32(b + 56), S->me, S->c->servers,
                     S->shard, dt__ps_slots(S));
  if (got != want || extra || dt__get_le32(b + got - 4) != dt__crc32c(0, b, got - 4))
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' is truncated or corrupt (checksum)", S->me, p);
  /* Checksummed is not sound: a hand-made file may carry any numbers. */
  if ((int64_t)dt__get_le64(b + 48) < 0 || (int64_t)dt__get_le64(b + 40) < 0)
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' holds a negative count (%lld updates, optimizer "
                     "step %lld)", S->me, p, (long long)dt__get_le64(b + 40), (long long)dt__get_le64(b + 48));
  size_t off;
  if (fv == 2) { /* the work queue: checked before anything is taken */
    dt_result qr = dt__ps_ckpt_get_queue(S, b + qoff, p);
    if (qr != DTRAIN_OK) return qr;
  } else if (S->q_back) {
    dt__log(DTRAIN_LOG_WARN, DTRAIN_OK, "ps %d: checkpoint '%s' is of version 1, without the work queue: the queue "
            "starts over", S->me, p);
  }
  S->version = dt__get_le64(b + 40);
  dt_optim_set_steps(S->opt, (int64_t)dt__get_le64(b + 48));
  off = DT__PS_CKPT_HDR;
  dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_params_data(S->params));
  off += S->shard * 4;
  for (int k = 0; k < dt__ps_slots(S); k++) {
    dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_optim_state(S->opt, k));
    off += S->shard * 4;
  }
  if (S->q_back)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: resumed from '%s' (%llu updates, optimizer step %lld; work queue: "
            "%lld of %lld items done, %d to do again)", S->me, p, (unsigned long long)S->version,
            (long long)dt_optim_steps(S->opt), (long long)S->q.done, (long long)S->q.items, S->q_nback);
  else
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
#  undef DT__PS_CKPT_QHDR

#endif /* DTRAIN_NO_NET */
