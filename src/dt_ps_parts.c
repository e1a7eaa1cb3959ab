/* ===========================================================================
 * dt_ps_parts.c -- parameter servers: a push that comes in parts (PUSHP,
 * dt_strategy_options.push_early; see dt_ps_core.h), gathered into the
 * worker's push buffer; the server handles the push once it is whole
 * ===========================================================================
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

DTRAIN_PRIVATE int dt__ps_part(dt__ps_worker *w, size_t shard, const unsigned char *p, uint32_t len, const char *op,
                               dt__ps_whole *whole, char *why, size_t cap) {
  const int64_t t = (int64_t)dt__get_le64(p);
  const uint64_t v = dt__get_le64(p + 8), off = dt__get_le64(p + 16), flags = dt__get_le64(p + 24);
  const size_t n = (len - DT__PS_PFIX) / 4, lo = w->parting ? w->part_lo : shard;
  const int last = (flags & DT__PS_PART_LAST) != 0, empty = (flags & (DT__PS_PART_DISCARD | DT__PS_PART_ABANDON)) != 0;
  const char *bad = NULL;
  if (flags != 0 && flags != DT__PS_PART_LAST && flags != (DT__PS_PART_LAST | DT__PS_PART_DISCARD) &&
      flags != DT__PS_PART_ABANDON)
    bad = "unknown flags";
  else if (empty && (n != 0 || off != 0))
    bad = "a discard or abandon carrying floats or an offset";
  else if (empty && !w->parting)
    bad = "a discard or abandon with no parts before it";
  else if (w->parting && flags != DT__PS_PART_ABANDON && (t != w->part_clock || v != w->part_version))
    bad = "a part of another push than the parts before it (clock or version)";
  else if (!empty && (off > lo || n != lo - off))
    bad = "a part not ending where the part before it began (or the shard's end)";
  else if (last && !empty && off != 0)
    bad = "a last part not reaching the shard's start";
  if (bad) {
    snprintf(why, cap, "%s: protocol violation: a push's part (clock %lld, floats [%llu, %llu) of %zu, flags %llu): "
             "%s", op, (long long)t, (unsigned long long)off, (unsigned long long)(off + n), shard,
             (unsigned long long)flags, bad);
    return -1;
  }
  if (flags == DT__PS_PART_ABANDON) { /* the parts so far are dropped: no push */
    w->parting = 0;
    return 0;
  }
  if (n) memcpy(w->rx + DT__PS_FIX + 4 * off, p + DT__PS_PFIX, 4 * n);
  w->parting = 1;
  w->part_lo = (size_t)off;
  w->part_clock = t;
  w->part_version = v;
  if (!last) return 0;
  w->parting = 0; /* whole: a push of clock t, its floats in rx (none when discarded) */
  whole->clock = t;
  whole->version = v;
  whole->length = (uint32_t)(flags & DT__PS_PART_DISCARD ? DT__PS_FIX : DT__PS_FIX + shard * 4);
  return 1;
}

#endif /* DTRAIN_NO_NET */
