/* ===========================================================================
 * dt_ps_parts.c -- parameter servers: a push that comes in parts (PUSHP,
 * dt_strategy_options.push_early; see dt_ps_core.h), gathered into the
 * worker's push buffer and handed to the server's request handling whole
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

/* A part of a push in parts (PUSHP, len bytes at p; see dt_ps_core.h):
 * checked against the parts before it, its floats gathered into rx; the
 * last one makes the push a request. */
DTRAIN_PRIVATE void dt__ps_on_part(dt__ps_server *S, int i, const unsigned char *p, uint32_t len, const char *op) {
  dt__ps_worker *w = &S->w[i];
  char why[DT__MSG_CAP];
  const int64_t t = (int64_t)dt__get_le64(p);
  const uint64_t v = dt__get_le64(p + 8), off = dt__get_le64(p + 16), flags = dt__get_le64(p + 24);
  const size_t n = (len - DT__PS_PFIX) / 4, lo = w->parting ? w->part_lo : S->shard;
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
    snprintf(why, sizeof why, "%s: protocol violation: a push's part (clock %lld, floats [%llu, %llu) of %zu, flags "
             "%llu): %s", op, (long long)t, (unsigned long long)off, (unsigned long long)(off + n), S->shard,
             (unsigned long long)flags, bad);
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  if (flags == DT__PS_PART_ABANDON) { /* the parts so far are dropped: no push */
    w->parting = 0;
    return;
  }
  if (n) memcpy(w->rx + DT__PS_FIX + 4 * off, p + DT__PS_PFIX, 4 * n);
  w->parting = 1;
  w->part_lo = (size_t)off;
  w->part_clock = t;
  w->part_version = v;
  if (!last) return;
  w->parting = 0; /* whole: a push of clock t, its floats in rx (none when discarded) */
  dt__ps_on_request(S, i, DT__PS_PUSH, t, v,
                    (uint32_t)(flags & DT__PS_PART_DISCARD ? DT__PS_FIX : DT__PS_FIX + S->shard * 4), op);
}

#endif /* DTRAIN_NO_NET */
