/* ===========================================================================
 * dt_ps_client.c -- parameter servers: the worker's side, a dt_pstore
 * (dt_strategy.h) backed by the cluster's servers (dt_pstore_create_tcp;
 * see dt_ps_core.h for the messages)
 * ===========================================================================
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
/* dt_strategy.h: dt_pstore, the interface this store implements. */
#include "dt_strategy.h"
#include "dt_strategy_impl.h"
#include "dt_ps_core.h"

#if !defined(DTRAIN_NO_NET)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <unistd.h>
#  endif

/* dt__ps_client, this store's state: dt_ps_core.h (the tests reach into it). */

static dt__ps_client *dt__ps_client_of(dt_pstore *ps) { return (dt__ps_client *)ps->impl; }

/* Record the first failure: the other servers are told (ABORT) and every connection closed. */
static dt_result dt__ps_client_fail(dt__ps_client *C, dt_result rc) {
  if (C->err == DTRAIN_OK) {
    C->err = rc;
    snprintf(C->msg, sizeof C->msg, "%s", dt_last_error());
    for (int s = 0; s < C->M; s++) {
      dt__conn_abort(&C->conn[s], rc, C->msg);
      dt__conn_close(&C->conn[s]);
    }
  }
  return dt__error(C->err, "%s", C->msg);
}

static dt_result dt__ps_client_check(dt__ps_client *C, const char *op) {
  if (C->err != DTRAIN_OK) return dt__error(C->err, "%s", C->msg);
  if (C->left) return dt__error(DTRAIN_ERR_STATE, "%s: this worker already left (dt_pstore_leave)", op);
  if (DT__ALOAD(&C->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  return DTRAIN_OK;
}

/* Receive server s's answer of `type` with exactly len payload bytes into C->buf[s]
 * (or, parts not NULL, into parts[0..nparts), which add up to len),
 * skipping heartbeats (each renews the deadline). */
static dt_result dt__ps_client_answerv(dt__ps_client *C, int s, uint16_t type, uint32_t len, const struct iovec *parts,
                                       int nparts, const char *op) {
  for (;;) {
    dt__frame f;
    unsigned char h[DT__NET_HDR];
    double deadline = dt__now() + C->timeout;
    dt_result rc = dt__conn_recv_header(&C->conn[s], &f, h, deadline, op);
    if (rc != DTRAIN_OK) return rc;
    if (f.type == DT__MSG_HEARTBEAT && f.length == 0) {
      rc = dt__conn_recv_payload(&C->conn[s], &f, h, NULL, deadline, op);
      if (rc != DTRAIN_OK) return rc;
      continue;
    }
    if (f.type != type || f.length != len)
      return dt__error(DTRAIN_ERR_PROTOCOL, "%s: %s sent a frame of type 0x%02x and %u bytes, expected type 0x%02x "
                       "and %u bytes", op, C->conn[s].peer, (unsigned)f.type, (unsigned)f.length, (unsigned)type,
                       (unsigned)len);
    if (parts) return dt__conn_recv_payloadv(&C->conn[s], &f, h, parts, nparts, deadline, op);
    return dt__conn_recv_payload(&C->conn[s], &f, h, C->buf[s], deadline, op);
  }
}

static dt_result dt__ps_client_answer(dt__ps_client *C, int s, uint16_t type, uint32_t len, const char *op) {
  return dt__ps_client_answerv(C, s, type, len, NULL, 0, op);
}

/* Server s's frame of floats as pieces in C->iov: its DT__PS_FIX bytes at
 * fix, then each of its parameters' elements where they lie in full (the
 * shard's order; little-endian hosts only: the floats are their bytes).
 * Returns the count. */
static int dt__ps_client_parts(dt__ps_client *C, int s, unsigned char *fix, const float *full) {
  C->iov[0].iov_base = fix;
  C->iov[0].iov_len = DT__PS_FIX;
  return 1 + dt__ps_pieces(C->params, C->owner, s, full, C->iov + 1);
}

static dt_result dt__ps_client_taken(dt__ps_client *C, const char *op, int64_t *k);

/* ---- pushes in parts (PUSHP; dt_strategy_options.push_early) ---- */

/* The shard offset of server s's first parameter from index `from` on (the shard's floats when none). */
static size_t dt__ps_client_offset(const dt__ps_client *C, int s, int from) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int p = 0; dt__params_range(C->params, p, &b, &e, &tr, &dec); p++) {
    if (C->owner[p] != s) continue;
    if (p >= from) return off;
    off += e - b;
  }
  return off;
}

/* A PUSHP frame's pieces in C->iov: its DT__PS_PFIX bytes at fix, then
 * server s's shard floats [lo, hi) (at parameter boundaries): a trained
 * parameter's from g, a buffer's from d (NULL: from g too), where they lie on
 * a little-endian host, else gathered as little-endian bytes into C->buf[s].
 * Returns the count. */
static int dt__ps_client_part_pieces(dt__ps_client *C, int s, size_t lo, size_t hi, unsigned char *fix, const float *g,
                                     const float *d) {
  C->iov[0].iov_base = fix;
  C->iov[0].iov_len = DT__PS_PFIX;
  int n = 1;
  size_t off = 0, k = 0, b, e;
  int tr, dec;
  for (int p = 0; off < hi && dt__params_range(C->params, p, &b, &e, &tr, &dec); p++) {
    if (C->owner[p] != s) continue;
    if (off >= lo && e > b) {
      const float *src = (tr || !d ? g : d) + b;
      if (DT__HOST_LE) {
        C->iov[n].iov_base = (void *)(uintptr_t)src;
        C->iov[n++].iov_len = (e - b) * sizeof(float);
      } else {
        dt__put_f32le(C->buf[s] + 4 * k, src, e - b);
        k += e - b;
      }
    }
    off += e - b;
  }
  if (!DT__HOST_LE && k) {
    C->iov[1].iov_base = C->buf[s];
    C->iov[1].iov_len = 4 * k;
    n = 2;
  }
  return n;
}

/* The version server s's part of the next push says it was computed on (as
 * dt__ps_client_push says it: the last pull's, or the one before). */
static uint64_t dt__ps_client_part_version(const dt__ps_client *C, int s) {
  const int before = C->basis >= 0 && C->basis != C->pulled_clock;
  return before ? C->basis_version[s] : C->pulled_version[s];
}

/* PUSHP's fixed bytes into fix. */
static void dt__ps_client_part_fix(int64_t T, uint64_t version, size_t off, uint64_t flags, unsigned char *fix) {
  dt__put_le64(fix, (uint64_t)T);
  dt__put_le64(fix + 8, version);
  dt__put_le64(fix + 16, (uint64_t)off);
  dt__put_le64(fix + 24, flags);
}

/* Parts sent of a push that will not come (its step failed): each server
 * told to drop them. Under the lock. */
static dt_result dt__ps_client_unpart(dt__ps_client *C, const char *op) {
  dt_result rc = DTRAIN_OK;
  for (int s = 0; C->parting && s < C->M; s++) {
    if (C->part_lo[s] >= C->shard[s]) continue;
    C->part_lo[s] = C->shard[s];
    unsigned char fix[DT__PS_PFIX];
    dt__ps_client_part_fix(C->part_T, dt__ps_client_part_version(C, s), 0, DT__PS_PART_ABANDON, fix);
    if (rc == DTRAIN_OK) rc = dt__conn_send(&C->conn[s], DT__PS_PUSHP, fix, DT__PS_PFIX, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
    if (rc == DTRAIN_OK) C->ps.wire_sent += DT__PS_PFIX;
  }
  C->parting = 0;
  return rc;
}

DTRAIN_PRIVATE dt_result dt__ps_client_push_part(dt_pstore *ps, int64_t clock, int s, int from, const float *g,
                                                 const float *d) {
  dt__ps_client *C = dt__ps_client_of(ps);
  char op[96];
  int64_t T = C->base + clock;
  snprintf(op, sizeof op, "worker %d: push #%lld (a part for ps %d)", C->me, (long long)T, s);
  dt__mutex_lock(&C->mu);
  dt_result rc = dt__ps_client_check(C, op);
  if (rc == DTRAIN_OK && (s < 0 || s >= C->M || !g))
    rc = dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s", op, !g ? "no gradient" : "no such server");
  if (rc == DTRAIN_OK && C->ps.compress.kind != DTRAIN_COMPRESS_NONE)
    rc = dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: a push in parts carries floats, and this store's pushes are "
                   "compressed (%s)", op, dt_compress_name(C->ps.compress));
  if (rc == DTRAIN_OK && C->parting && C->part_T != T)
    rc = dt__error(DTRAIN_ERR_STATE, "%s: the parts of push #%lld are still open", op, (long long)C->part_T);
  if (rc != DTRAIN_OK) {
    dt__mutex_unlock(&C->mu);
    return rc;
  }
  size_t lo = dt__ps_client_offset(C, s, from), hi = C->part_lo[s];
  if (lo < hi) {
    unsigned char fix[DT__PS_PFIX];
    dt__ps_client_part_fix(T, dt__ps_client_part_version(C, s), lo, 0, fix);
    int n = dt__ps_client_part_pieces(C, s, lo, hi, fix, g, d);
    rc = dt__conn_sendv(&C->conn[s], DT__PS_PUSHP, C->iov, n, C->iov_scratch, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
    if (rc == DTRAIN_OK) {
      ps->wire_sent += DT__PS_PFIX + 4 * (hi - lo);
      C->part_lo[s] = lo;
      C->parting = 1;
      C->part_T = T;
    } else if (rc != DTRAIN_ERR_ABORTED) {
      rc = dt__ps_client_fail(C, rc);
    }
  }
  dt__mutex_unlock(&C->mu);
  return rc;
}

static void dt__ps_client_codec_free(dt__ps_client *C) {
  dt__ef_destroy(C->ef);
  C->ef = NULL;
  if (C->view)
    for (int s = 0; s < C->M; s++) dt__free(C->view[s], (C->shard[s] ? C->shard[s] : 1) * sizeof(float));
  dt__free(C->view, (size_t)C->M * sizeof(float *));
  dt__free(C->view_ok, (size_t)C->M * sizeof(int));
  C->view = NULL;
  C->view_ok = NULL;
  memset(&C->zc, 0, sizeof C->zc);
}

/* The state for ps.compress when it changed (before the first pull, or
 * between calls: the error and the copies start again). Under the lock. */
static dt_result dt__ps_client_codec(dt__ps_client *C, const char *op) {
  dt_compress c = C->ps.compress;
  if (c.kind == C->zc.kind && (c.kind != DTRAIN_COMPRESS_TOPK || c.fraction == C->zc.fraction) &&
      (c.kind != DTRAIN_COMPRESS_POWERSGD || c.rank == C->zc.rank))
    return DTRAIN_OK;
  dt__ps_client_codec_free(C);
  if (c.kind == DTRAIN_COMPRESS_NONE) return DTRAIN_OK;
  if (c.kind != DTRAIN_COMPRESS_FP16 && c.kind != DTRAIN_COMPRESS_BF16 && c.kind != DTRAIN_COMPRESS_TOPK &&
      c.kind != DTRAIN_COMPRESS_POWERSGD)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: compress.kind %d is none of none, fp16, bf16, topk, powersgd", op,
                     (int)c.kind);
  if (c.kind == DTRAIN_COMPRESS_TOPK || c.kind == DTRAIN_COMPRESS_POWERSGD) {
    dt_result rc = dt__ef_create_params(c, C->params, 1, &C->ef);
    if (rc != DTRAIN_OK) return dt__ps_prefix(rc, op, NULL);
  }
  C->view = (float **)dt__calloc((size_t)C->M * sizeof(float *));
  C->view_ok = (int *)dt__calloc((size_t)C->M * sizeof(int));
  int ok = C->view && C->view_ok;
  for (int s = 0; ok && s < C->M; s++) {
    ok = (C->view[s] = (float *)dt__alloc((C->shard[s] ? C->shard[s] : 1) * sizeof(float))) != NULL;
    size_t want = DT__MAX(dt__ps_pushz_cap(C->params, C->owner, s), DT__PS_ZFIX + 2 * C->shard[s]);
    if (ok && want > C->buf_cap[s]) {
      unsigned char *nb = (unsigned char *)dt__alloc(want);
      if (!(ok = nb != NULL)) break;
      dt__free(C->buf[s], C->buf_cap[s]);
      C->buf[s] = nb;
      C->buf_cap[s] = want;
    }
  }
  if (!ok) {
    dt__ps_client_codec_free(C);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory for compress %s", op, dt_compress_name(c));
  }
  C->zc = c;
  return DTRAIN_OK;
}

static dt_result dt__ps_client_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  (void)n;
  char op[80];
  double t0 = dt__now();
  int64_t T = C->base + clock;
  snprintf(op, sizeof op, "worker %d: pull #%lld", C->me, (long long)T);
  dt__mutex_lock(&C->mu);
  dt_result rc = dt__ps_client_check(C, op);
  if (rc == DTRAIN_OK && (rc = dt__ps_client_codec(C, op)) != DTRAIN_OK) {
    dt__mutex_unlock(&C->mu);
    return rc;
  }
  if (rc == DTRAIN_OK && C->parting) rc = dt__ps_client_unpart(C, op); /* a push in parts that did not end */
  const int z = C->zc.kind != DTRAIN_COMPRESS_NONE;
  const dt_compress_kind zk = C->zc.kind == DTRAIN_COMPRESS_BF16 ? DTRAIN_COMPRESS_BF16 : DTRAIN_COMPRESS_FP16;
  const int direct = DT__HOST_LE && !z; /* (a failed pull may leave dst partly written: dt_net.h says so) */
  unsigned char req[DT__PS_FIX];
  dt__put_le64(req, (uint64_t)T);
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    int mode = !z ? DT__PS_PULL_FLOATS : !C->view_ok[s] ? DT__PS_PULL_KEEP
             : zk == DTRAIN_COMPRESS_BF16 ? DT__PS_PULL_BF16 : DT__PS_PULL_FP16;
    dt__put_le64(req + 8, (uint64_t)mode);
    rc = dt__conn_send(&C->conn[s], DT__PS_PULL, req, DT__PS_FIX, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
    if (rc == DTRAIN_OK) ps->wire_sent += DT__PS_FIX;
  }
  tk->version = 0;
  tk->clock_gap = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    int delta = z && C->view_ok[s];
    uint32_t len = (uint32_t)(delta ? DT__PS_ZFIX + C->shard[s] * 2 : DT__PS_FIX + C->shard[s] * 4);
    if (direct) /* the floats straight into dst */
      rc = dt__ps_client_answerv(C, s, DT__PS_PARAMS, len, C->iov, dt__ps_client_parts(C, s, C->buf[s], dst), op);
    else
      rc = dt__ps_client_answer(C, s, delta ? DT__PS_PARAMZ : DT__PS_PARAMS, len, op);
    if (rc == DTRAIN_OK && delta) {
      rc = dt__ps_delta_apply(zk, C->buf[s] + DT__PS_FIX, C->view[s], C->shard[s]);
      if (rc != DTRAIN_OK) rc = dt__ps_prefix(rc, op, C->conn[s].peer);
    }
    if (rc != DTRAIN_OK) break;
    ps->wire_received += len;
    uint64_t v = dt__get_le64(C->buf[s]);
    int64_t gap = (int64_t)dt__get_le64(C->buf[s] + 8);
    C->basis_version[s] = C->pulled_version[s];
    C->pulled_version[s] = v;
    if (v > C->heard_version[s]) C->heard_version[s] = v;
    if (v > tk->version) tk->version = v;
    if (v > C->version) C->version = v;
    if (gap > tk->clock_gap) tk->clock_gap = gap;
    if (!z) {
      if (!direct) dt__ps_scatter(C->params, C->owner, s, C->buf[s] + DT__PS_FIX, dst);
      continue;
    }
    if (!delta) { /* floats: this worker's copy starts (the server kept the same) */
      dt__get_f32le(C->view[s], C->buf[s] + DT__PS_FIX, C->shard[s]);
      C->view_ok[s] = 1;
    }
    dt__ps_shard_copy(C->params, C->owner, s, dst, C->view[s], 0);
  }
  if (rc == DTRAIN_OK) C->pulled_clock = T;
  if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE) rc = dt__ps_client_fail(C, rc);
  dt__mutex_unlock(&C->mu);
  tk->wait_s = dt__now() - t0;
  return rc;
}

static dt_result dt__ps_client_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  (void)n;
  char op[80];
  double t0 = dt__now();
  int64_t T = C->base + clock;
  snprintf(op, sizeof op, "worker %d: push #%lld", C->me, (long long)T);
  dt__mutex_lock(&C->mu);
  dt_result rc = dt__ps_client_check(C, op);
  if (rc == DTRAIN_OK && (rc = dt__ps_client_codec(C, op)) != DTRAIN_OK) {
    dt__mutex_unlock(&C->mu);
    return rc;
  }
  if (rc == DTRAIN_OK && C->parting && C->part_T != T) rc = dt__ps_client_unpart(C, op); /* not this push's */
  const int z = delta && C->zc.kind != DTRAIN_COMPRESS_NONE;
  if (rc == DTRAIN_OK && z && C->parting)
    rc = dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: a compressed push after parts of floats", op);
  if (rc == DTRAIN_OK && z && C->ef) dt__ef_local(C->ef, delta); /* top-k / PowerSGD: over the whole vector, then per server */
  /* the version it was computed on: the last pull's, or the one before (overlap) */
  const int before = C->basis >= 0 && C->basis != C->pulled_clock;
  C->basis = -1;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    unsigned char *b = C->buf[s];
    dt__put_le64(b, (uint64_t)T);
    dt__put_le64(b + 8, before ? C->basis_version[s] : C->pulled_version[s]);
    size_t len = DT__PS_FIX;
    int pieces = 0; /* > 0: the floats go from where they lie */
    if (C->parting && C->part_lo[s] < C->shard[s]) { /* parts went before: the last one, the rest of the shard */
      unsigned char fix[DT__PS_PFIX];
      uint64_t flags = DT__PS_PART_LAST | (delta ? 0 : DT__PS_PART_DISCARD);
      dt__ps_client_part_fix(T, before ? C->basis_version[s] : C->pulled_version[s], 0, flags, fix);
      int nparts = delta ? dt__ps_client_part_pieces(C, s, 0, C->part_lo[s], fix, delta, NULL) : 1;
      if (!delta) C->iov[0].iov_base = fix, C->iov[0].iov_len = DT__PS_PFIX;
      len = DT__PS_PFIX + (delta ? 4 * C->part_lo[s] : 0);
      rc = dt__conn_sendv(&C->conn[s], DT__PS_PUSHP, C->iov, nparts, C->iov_scratch, dt__now() + C->timeout, op);
      C->last_send[s] = dt__now();
      if (rc == DTRAIN_OK) ps->wire_sent += len;
      continue;
    }
    if (z) {
      len = dt__ps_encode_push(C->zc, C->ef, C->params, C->owner, s, delta, b);
      if (len > C->conn[s].max_payload) {
        rc = dt__error(DTRAIN_ERR_OVERFLOW, "%s: a compressed push (%s) of %zu bytes exceeds max_payload (%u bytes)",
                       op, dt_compress_name(C->zc), len, (unsigned)C->conn[s].max_payload);
        break;
      }
    } else if (delta) {
      if (DT__HOST_LE) pieces = dt__ps_client_parts(C, s, b, delta);
      else dt__ps_gather(C->params, C->owner, s, delta, b + DT__PS_FIX);
      len += C->shard[s] * 4;
    }
    if (pieces)
      rc = dt__conn_sendv(&C->conn[s], DT__PS_PUSH, C->iov, pieces, C->iov_scratch, dt__now() + C->timeout, op);
    else
      rc = dt__conn_send(&C->conn[s], z ? DT__PS_PUSHZ : DT__PS_PUSH, b, (uint32_t)len, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
    if (rc == DTRAIN_OK) ps->wire_sent += len;
  }
  /* Work queue: the next item is asked for with this push (server 0 marks the
   * held one done on the push first), which saves the take its round trip. */
  int ask = rc == DTRAIN_OK && C->queue && !C->have_item;
  if (ask) rc = dt__conn_send(&C->conn[0], DT__PS_TAKE, NULL, 0, dt__now() + C->timeout, op);
  tk->staleness = 0;
  tk->dropped = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__ps_client_answer(C, s, DT__PS_PUSHED, DT__PS_FIX, op);
    if (rc != DTRAIN_OK) break;
    ps->wire_received += DT__PS_FIX;
    uint64_t v = dt__get_le64(C->buf[s]);
    int64_t st = (int64_t)dt__get_le64(C->buf[s] + 8);
    if (st < 0) { /* a server in rounds (aggregate) dropped it: -1 - its staleness */
      tk->dropped = 1;
      st = -1 - st;
    }
    if (v > C->heard_version[s]) C->heard_version[s] = v;
    if (v > C->version) C->version = v;
    if (st > tk->staleness) tk->staleness = st;
  }
  if (rc == DTRAIN_OK && ask) {
    int64_t k = -3;
    rc = dt__ps_client_taken(C, op, &k);
    if (rc == DTRAIN_OK && k >= -1) { /* -3: the take asks again */
      C->item = k;
      C->have_item = 1;
    }
  }
  for (int s = 0; C->parting && s < C->M; s++) C->part_lo[s] = C->shard[s]; /* (sent whole or failed) */
  C->parting = 0;
  if (rc == DTRAIN_OK && z) dt__ef_commit(C->ef); /* every server took it: its error is kept */
  if (rc == DTRAIN_OK && T + 1 > C->next) C->next = T + 1;
  if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE) rc = dt__ps_client_fail(C, rc);
  dt__mutex_unlock(&C->mu);
  tk->wait_s = dt__now() - t0;
  return rc;
}

/* Server 0's TAKEN (already asked for) into *k: an item, -1 (all done) or -3
 * (all held by others). Under the lock. */
static dt_result dt__ps_client_taken(dt__ps_client *C, const char *op, int64_t *k) {
  dt_result rc = dt__ps_client_answer(C, 0, DT__PS_TAKEN, DT__PS_FIX, op);
  if (rc != DTRAIN_OK) return rc;
  *k = (int64_t)dt__get_le64(C->buf[0]);
  if (*k == -2)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %s has no work queue (dt_ps_options.work_items is 0 there)", op,
                     C->conn[0].peer);
  if (*k < -3) {
    dt__error(DTRAIN_ERR_PROTOCOL, "%s: %s sent work item %lld (want >= -3)", op, C->conn[0].peer, (long long)*k);
    return dt__ps_client_fail(C, DTRAIN_ERR_PROTOCOL);
  }
  return DTRAIN_OK;
}

/* The next work item from server 0's queue (see dt_ps_core.h): the one the
 * last push asked for when there is one, else asked for now. While every
 * item left is held by other workers (-3), ask again after a pause, without
 * the lock: the heartbeat thread keeps the other servers' connections alive. */
static dt_result dt__ps_client_take(dt_pstore *ps, int worker, int64_t *item) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  char op[80];
  snprintf(op, sizeof op, "worker %d: take a work item", C->me);
  double pause = 0.005;
  for (;;) {
    dt__mutex_lock(&C->mu);
    dt_result rc = dt__ps_client_check(C, op);
    int64_t k = -3;
    if (rc == DTRAIN_OK && C->have_item) {
      k = C->item;
      C->have_item = 0;
    } else if (rc == DTRAIN_OK) {
      rc = dt__conn_send(&C->conn[0], DT__PS_TAKE, NULL, 0, dt__now() + C->timeout, op);
      C->last_send[0] = dt__now();
      if (rc == DTRAIN_OK) rc = dt__ps_client_taken(C, op, &k);
      if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE && rc != DTRAIN_ERR_UNSUPPORTED)
        rc = dt__ps_client_fail(C, rc);
    }
    if (rc == DTRAIN_OK && k >= -1) {
      *item = k;
      C->queue = 1;
    }
    dt__mutex_unlock(&C->mu);
    if (rc != DTRAIN_OK || k != -3) return rc;
    dt__sleep(pause); /* the items left are held by others: one may come back, or all be done */
    if (pause < 0.05) pause *= 2;
  }
}

static void dt__ps_client_bye(dt__ps_client *C) {
  if (C->left) return;
  C->left = 1;
  if (C->err != DTRAIN_OK) return;
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  for (int s = 0; s < C->M; s++) {
    dt__conn_send(&C->conn[s], DT__MSG_BYE, NULL, 0, dt__now() + DT__MIN(C->timeout, 1.0), "bye");
    dt__conn_close(&C->conn[s]);
  }
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

static void dt__ps_client_leave(dt_pstore *ps, int worker) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  dt__mutex_lock(&C->mu);
  dt__ps_client_bye(C);
  dt__mutex_unlock(&C->mu);
}

static void dt__ps_client_abort(dt_pstore *ps) {
  DT__ASTORE(&dt__ps_client_of(ps)->aborted, 1, DT__MO_SEQ_CST);
}

static dt_result dt__ps_client_begin(dt_pstore *ps) {
  dt__ps_client *C = dt__ps_client_of(ps);
  dt__mutex_lock(&C->mu);
  DT__ASTORE(&C->aborted, 0, DT__MO_SEQ_CST);
  C->base = C->next;
  dt_result rc = C->err != DTRAIN_OK ? dt__error(C->err, "%s", C->msg) : DTRAIN_OK;
  dt__mutex_unlock(&C->mu);
  return rc;
}

static uint64_t dt__ps_client_version(dt_pstore *ps) {
  dt__ps_client *C = dt__ps_client_of(ps);
  dt__mutex_lock(&C->mu);
  /* The smallest of the servers' last words: every server is at least there (in
   * rounds, dt_ps_options.aggregate, each server counts its own) */
  uint64_t v = C->M > 0 ? C->heard_version[0] : C->version;
  for (int s = 1; s < C->M; s++)
    if (C->heard_version[s] < v) v = C->heard_version[s];
  dt__mutex_unlock(&C->mu);
  return v;
}

DTRAIN_PRIVATE int dt__ps_client_servers(dt_pstore *ps, const int **owner) {
  if (owner) *owner = NULL;
  if (!ps || !ps->vtable || !ps->vtable->name || strcmp(ps->vtable->name, "tcp") != 0) return 0;
  dt__ps_client *C = dt__ps_client_of(ps);
  if (owner) *owner = C->owner;
  return C->M;
}

DTRAIN_PRIVATE void dt__ps_client_push_basis(dt_pstore *ps, int64_t clock) {
  if (!ps || !ps->vtable || !ps->vtable->name || strcmp(ps->vtable->name, "tcp") != 0) return; /* this store's */
  dt__ps_client *C = dt__ps_client_of(ps);
  dt__mutex_lock(&C->mu);
  C->basis = clock < 0 ? -1 : C->base + clock;
  dt__mutex_unlock(&C->mu);
}

#  if !defined(DTRAIN_NO_THREADS)
/* The heartbeat thread: every timeout/3, a heartbeat on each connection idle that long. */
static void dt__ps_client_heartbeat(void *arg) {
  dt__ps_client *C = (dt__ps_client *)arg;
  double period = C->timeout / 3;
  while (!DT__ALOAD(&C->stop, DT__MO_ACQUIRE)) {
    dt__sleep(DT__MIN(period / 4, 0.02));
    dt__mutex_lock(&C->mu);
    if (C->err == DTRAIN_OK && !C->left) {
      double now = dt__now();
      for (int s = 0; s < C->M; s++) {
        if (now - C->last_send[s] < period) continue;
        if (dt__conn_send(&C->conn[s], DT__MSG_HEARTBEAT, NULL, 0, now + C->timeout / 4, "heartbeat") != DTRAIN_OK) {
          /* The next call finds the broken connection and reports it. */
          C->last_send[s] = now + 1e9;
        } else {
          C->last_send[s] = now;
        }
      }
    }
    dt__mutex_unlock(&C->mu);
  }
}
#  endif

static void dt__ps_client_free(dt__ps_client *C) {
  if (C->hb.started) {
    DT__ASTORE(&C->stop, 1, DT__MO_SEQ_CST);
    dt__thread_join(&C->hb);
  }
  if (C->conn) {
    dt__ps_client_bye(C);
    for (int s = 0; s < C->M; s++) dt__conn_close(&C->conn[s]);
  }
  size_t M = (size_t)C->M;
  if (C->shard) dt__ps_client_codec_free(C);
  if (C->buf && C->buf_cap) /* either may be missing when set-up ran out of memory */
    for (int s = 0; s < C->M; s++) dt__free(C->buf[s], C->buf_cap[s]);
  dt__free(C->buf, M * sizeof(unsigned char *));
  dt__free(C->buf_cap, M * sizeof(size_t));
  dt__free(C->conn, M * sizeof(dt__conn));
  dt__free(C->shard, M * sizeof(size_t));
  dt__free(C->last_send, M * sizeof(double));
  dt__free(C->pulled_version, M * sizeof(uint64_t));
  dt__free(C->heard_version, M * sizeof(uint64_t));
  dt__free(C->basis_version, M * sizeof(uint64_t));
  dt__free(C->part_lo, M * sizeof(size_t));
  dt__free(C->owner, (size_t)(C->np > 0 ? C->np : 1) * sizeof(int));
  dt__free(C->iov, (size_t)(C->np + 2) * sizeof(struct iovec));
  dt__free(C->iov_scratch, (size_t)(C->np + 2) * sizeof(struct iovec));
  dt__mutex_destroy(&C->mu);
  dt__free(C, sizeof *C);
}

static void dt__ps_client_destroy(dt_pstore *ps) { dt__ps_client_free(dt__ps_client_of(ps)); }

static const dt_pstore_vtable dt__ps_client_vtable = {
  "tcp",
  dt__ps_client_pull,
  dt__ps_client_push,
  dt__ps_client_leave,
  dt__ps_client_abort,
  dt__ps_client_begin,
  dt__ps_client_version,
  dt__ps_client_destroy,
  dt__ps_client_take
};

static dt_pstore *dt__ps_store_create(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  const char *fn = "dt_pstore_create_tcp";
  if (!c || !params) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !c ? "cluster" : "params");
    return NULL;
  }
  if (c->role != DTRAIN_ROLE_WORKER || c->servers < 1) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: this process is not a worker of a cluster with servers (role %s, %d "
              "servers)", fn, c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->servers);
    return NULL;
  }
  if (max_staleness < DTRAIN_STALENESS_UNBOUNDED) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
              max_staleness);
    return NULL;
  }
  dt__net_self self;
  if (dt__net_self_init(&self, c, o) != DTRAIN_OK) {
    dt__ps_prefix(dt_last_result(), fn, NULL);
    return NULL;
  }
  dt__net_retire_handed_listener(&self); /* a worker only dials its servers: nobody may connect to it */
  dt__ps_client *C = (dt__ps_client *)dt__calloc(sizeof *C);
  if (!C) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  dt_result rc = dt__mutex_init(&C->mu);
  size_t M = (size_t)c->servers;
  C->M = c->servers;
  C->me = c->index;
  C->params = params;
  C->timeout = self.opt.timeout_s;
  C->np = dt_params_count(params);
  C->err = DTRAIN_OK;
  DT__ASTORE(&C->aborted, 0, DT__MO_RELAXED);
  DT__ASTORE(&C->stop, 0, DT__MO_RELAXED);
  C->owner = (int *)dt__alloc((size_t)(C->np > 0 ? C->np : 1) * sizeof(int));
  C->conn = (dt__conn *)dt__calloc(M * sizeof(dt__conn));
  C->shard = (size_t *)dt__calloc(M * sizeof(size_t));
  C->buf = (unsigned char **)dt__calloc(M * sizeof(unsigned char *));
  C->buf_cap = (size_t *)dt__calloc(M * sizeof(size_t));
  C->last_send = (double *)dt__calloc(M * sizeof(double));
  C->pulled_version = (uint64_t *)dt__calloc(M * sizeof(uint64_t));
  C->heard_version = (uint64_t *)dt__calloc(M * sizeof(uint64_t));
  C->basis_version = (uint64_t *)dt__calloc(M * sizeof(uint64_t));
  C->part_lo = (size_t *)dt__calloc(M * sizeof(size_t));
  C->pulled_clock = C->basis = -1;
  C->iov = (struct iovec *)dt__calloc((size_t)(C->np + 2) * sizeof(struct iovec));
  C->iov_scratch = (struct iovec *)dt__calloc((size_t)(C->np + 2) * sizeof(struct iovec));
  if (C->conn)
    for (int s = 0; s < C->M; s++) C->conn[s].fd = -1;
  if (rc != DTRAIN_OK || !C->owner || !C->conn || !C->shard || !C->buf || !C->buf_cap || !C->last_send ||
      !C->pulled_version || !C->heard_version || !C->basis_version || !C->part_lo || !C->iov || !C->iov_scratch) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    goto fail;
  }
  if (dt_ps_shard(params, C->M, C->owner) != DTRAIN_OK) goto fail;
  for (int s = 0; s < C->M; s++) {
    C->shard[s] = dt__ps_shard_floats(params, C->owner, s);
    C->part_lo[s] = C->shard[s];
    C->buf_cap[s] = DT__PS_FIX + C->shard[s] * 4;
    C->buf[s] = (unsigned char *)dt__alloc(C->buf_cap[s]);
    if (!C->buf[s]) {
      dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
      goto fail;
    }
  }
  /* Connect and join, server by server. */
  for (int s = 0; s < C->M; s++) {
    char op[64];
    snprintf(op, sizeof op, "worker %d: join", C->me);
    /* A restarted worker may find its rank still taken: the server has not
     * yet noticed that the old process is gone (it will within its timeout_s):
     * try again until connect_timeout_s. */
    double until = dt__now() + self.opt.connect_timeout_s;
    int said = 0;
    while (dt__net_dial(&self, DTRAIN_ROLE_PS, s, &C->conn[s]) != DTRAIN_OK) {
      C->conn[s].fd = -1;
      if (dt_last_result() == DTRAIN_ERR_MISMATCH && strstr(dt_last_error(), DT__NET_ALREADY) &&
          dt__now() + 0.2 < until) {
        if (!said++)
          dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "worker %d: ps %d still holds this rank's old connection; trying again "
                  "for up to %.0f s", C->me, s, until - dt__now());
        dt__sleep(0.2);
        continue;
      }
      dt__ps_prefix(dt_last_result(), op, NULL);
      goto fail;
    }
    unsigned char j[DT__PS_JOINLEN];
    memset(j, 0, sizeof j);
    dt__put_le32(j, (uint32_t)(int32_t)max_staleness);
    dt__put_le64(j + 8, (uint64_t)dt_params_size(params));
    dt__put_le64(j + 16, (uint64_t)C->shard[s]);
    dt__put_le64(j + 24, dt__ps_layout_hash(params, C->owner, s, C->M));
    rc = dt__conn_send(&C->conn[s], DT__PS_JOIN, j, DT__PS_JOINLEN, dt__now() + C->timeout, op);
    if (rc == DTRAIN_OK && C->buf_cap[s] < DT__PS_JOINEDLEN) {
      unsigned char *nb = (unsigned char *)dt__alloc(DT__PS_JOINEDLEN);
      if (!nb) {
        dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
        goto fail;
      }
      dt__free(C->buf[s], C->buf_cap[s]);
      C->buf[s] = nb;
      C->buf_cap[s] = DT__PS_JOINEDLEN;
    }
    if (rc == DTRAIN_OK) rc = dt__ps_client_answer(C, s, DT__PS_JOINED, DT__PS_JOINEDLEN, op);
    if (rc != DTRAIN_OK) goto fail;
    uint64_t v = dt__get_le64(C->buf[s]);
    int64_t start = (int64_t)dt__get_le64(C->buf[s] + 32), done = (int64_t)dt__get_le64(C->buf[s] + 40);
    if (start < 0 || done < 0 || done > start) {
      dt__error(DTRAIN_ERR_PROTOCOL, "%s: %s sent start clock %lld and steps done %lld (want 0 <= done <= start)", op,
                C->conn[s].peer, (long long)start, (long long)done);
      goto fail;
    }
    /* Start at the largest start clock (every server lets a rejoined worker
     * begin later than it said); resume after the fewest steps any server
     * saw (a push that reached only some servers is made again). */
    if (start > C->next) C->next = start;
    if (s == 0 || done < C->ps.steps_done) C->ps.steps_done = done;
    C->pulled_version[s] = C->basis_version[s] = C->heard_version[s] = v;
    if (v > C->version) C->version = v;
    C->last_send[s] = dt__now();
  }
  C->ps.start_clock = C->next;
  C->base = C->next;
  C->ps.vtable = &dt__ps_client_vtable;
  C->ps.workers = c->workers;
  C->ps.max_staleness = max_staleness;
  C->ps.size = dt_params_size(params);
  C->ps.gradients = 1;
  C->ps.impl = C;
#  if !defined(DTRAIN_NO_THREADS)
  if (dt__thread_start(&C->hb, dt__ps_client_heartbeat, C) != DTRAIN_OK) {
    dt__ps_prefix(dt_last_result(), fn, "cannot start the heartbeat thread");
    goto fail;
  }
#  endif
  return &C->ps;
fail: {
  char keep[DT__MSG_CAP];
  dt_result krc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  C->left = 1; /* no BYE: we never joined them all */
  dt__ps_client_free(C);
  dt__error(krc != DTRAIN_OK ? krc : DTRAIN_ERR_INTERNAL, "%s", keep);
}
  return NULL;
}

DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  if (c && c->role == DTRAIN_ROLE_WORKER) dt_trace_set_process("worker", c->index);
  dt__trace_env();
  dt__quiet_push();
  dt_pstore *ps = dt__ps_store_create(c, params, o, max_staleness);
  dt__quiet_pop(ps ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return ps;
}

#else /* DTRAIN_NO_NET */

#  if !defined(DTRAIN_NO_DIST)
DTRAIN_PRIVATE void dt__ps_client_push_basis(dt_pstore *ps, int64_t clock) { /* no TCP store without networking */
  (void)ps;
  (void)clock;
}
DTRAIN_PRIVATE int dt__ps_client_servers(dt_pstore *ps, const int **owner) {
  (void)ps;
  if (owner) *owner = NULL;
  return 0;
}
DTRAIN_PRIVATE dt_result dt__ps_client_push_part(dt_pstore *ps, int64_t clock, int s, int from, const float *g,
                                                 const float *d) {
  (void)ps; (void)clock; (void)s; (void)from; (void)g; (void)d;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "push in parts: networking is not compiled in (DTRAIN_NO_NET)");
}
#  endif

DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  (void)c;
  (void)params;
  (void)o;
  (void)max_staleness;
#  if defined(DTRAIN_NO_DIST)
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_create_tcp: compiled out (DTRAIN_NO_DIST)");
#  else
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_create_tcp: networking is not compiled in (DTRAIN_NO_NET)");
#  endif
  return NULL;
}

#endif /* DTRAIN_NO_NET */
