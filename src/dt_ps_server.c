/* ===========================================================================
 * dt_ps_server.c -- parameter servers: the server (dt_ps_serve): its poll
 * loop, the staleness rule, the workers' frames (see dt_ps_core.h for the
 * design and the messages)
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
#include "dt_optim_internal.h"
#include "dt_ps_core.h"

#if !defined(DTRAIN_NO_NET)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/types.h>
#    include <unistd.h>
#  endif

/* Connected workers, and (before the quorum) those still expected. */
static int dt__ps_live_count(const dt__ps_server *S) {
  int n = 0;
  for (int i = 0; i < S->W; i++)
    if (S->w[i].state == DT__PSW_LIVE || (S->w[i].state == DT__PSW_NEW && !S->quorum)) n++;
  return n;
}

/* Keep serving? While a worker is live or expected, or one lost less than
 * rejoin_timeout_s ago may come back. */
static int dt__ps_open(const dt__ps_server *S, double now) {
  if (dt__ps_live_count(S) > 0) return 1;
  for (int i = 0; i < S->W; i++)
    if (S->w[i].state == DT__PSW_LOST && now - S->w[i].lost_at < S->po.rejoin_timeout_s) return 1;
  return 0;
}

/* Work queue: the item worker w holds goes back, to the next TAKE (its push never came). */
static void dt__ps_give_back(dt__ps_server *S, dt__ps_worker *w) {
  if (!S->q_back || w->lease < 0) return;
  S->q_back[S->q_nback++] = w->lease; /* at most one per worker: room for W */
  S->q.returned++;
  w->lease = -1;
}

static void dt__ps_worker_free(dt__ps_server *S, dt__ps_worker *w) {
  dt__ps_give_back(S, w);
  dt__ps_agg_free(S, w);
  dt__conn_close(&w->conn);
  dt__free(w->rx, w->rx_cap);
  dt__free(w->tx, w->tx_cap);
  if (w->view) dt__free(w->view, (S->shard ? S->shard : 1) * sizeof(float));
  w->view = NULL;
  w->view_ok = 0;
  dt__free(w->rxp, DT__PS_PFIX + S->shard * 4);
  w->rx = w->tx = w->rxp = NULL;
  w->rx_cap = w->tx_cap = w->tx_len = w->tx_off = 0;
  w->parting = 0;
  w->pend = DT__PSP_NONE;
  w->in_len = 0;
}

static void dt__ps_worker_name(const dt__ps_server *S, int i, char *buf, size_t cap) {
  const dt__ps_worker *w = &S->w[i];
  if (w->conn.peer_role >= 0) snprintf(buf, cap, "%.95s", w->conn.peer);
  else snprintf(buf, cap, "worker %d (%.70s)", i, S->c->worker_addr[i] ? S->c->worker_addr[i] : "?");
}

/* Drop worker i from training: logged, out of the clocks. */
static void dt__ps_lose(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  char name[DT__NET_ADDR];
  dt__ps_worker_name(S, i, name, sizeof name);
  dt__ps_worker_free(S, w);
  w->state = DT__PSW_LOST;
  w->joined = w->fresh = 0;
  w->lost_at = dt__now();
  S->seen[i] = 0; /* its rank may connect again (a restarted process) */
  int left = dt__ps_live_count(S);
  dt__log(DTRAIN_LOG_WARN, code, "ps %d: %s lost: %s; going on with %d worker%s", S->me, name, why, left,
          left == 1 ? "" : "s");
}

/* Write as much of worker i's output as the socket takes. 0 when the worker was lost. */
static int dt__ps_flush(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  while (w->tx_off < w->tx_len) {
    ssize_t k = dt__sock_send(w->conn.fd, w->tx + w->tx_off, w->tx_len - w->tx_off, DT__NET_SEND_FLAGS);
    if (k > 0) {
      w->tx_off += (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
    char why[160];
    snprintf(why, sizeof why, "send failed: %.120s", k < 0 ? dt__sk_strerror(errno) : "connection closed");
    dt__ps_lose(S, i, DTRAIN_ERR_PEER, why);
    return 0;
  }
  w->tx_off = w->tx_len = 0;
  return 1;
}

/* Room for a frame of len payload bytes in worker i's output: where its
 * payload goes (dt__ps_commit sends it). NULL when the worker was lost. */
static unsigned char *dt__ps_reserve(dt__ps_server *S, int i, uint32_t len) {
  dt__ps_worker *w = &S->w[i];
  if (w->tx_off == w->tx_len) w->tx_off = w->tx_len = 0;
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    memmove(w->tx, w->tx + w->tx_off, w->tx_len - w->tx_off);
    w->tx_len -= w->tx_off;
    w->tx_off = 0;
  }
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    dt__ps_lose(S, i, DTRAIN_ERR_INTERNAL, "output buffer overflow");
    return NULL;
  }
  return w->tx + w->tx_len + DT__NET_HDR;
}

/* The frame whose payload dt__ps_reserve placed: framed and sent as the socket takes it. */
static int dt__ps_commit(dt__ps_server *S, int i, uint16_t type, uint32_t len) {
  dt__ps_worker *w = &S->w[i];
  unsigned char *h = w->tx + w->tx_len, *pl = h + DT__NET_HDR;
  dt__frame_pack(h, type, w->conn.job, w->conn.self_id, w->conn.send_seq, pl, len);
  w->conn.send_seq++;
  w->tx_len += DT__NET_HDR + len;
  w->last_sent = dt__now();
  return dt__ps_flush(S, i);
}

/* A frame of the fixed part and the shard's floats in full, with nothing
 * queued before it for worker i (little-endian host): sent from where the
 * floats lie, as much as the socket takes now; the rest, and only the rest,
 * is copied into the worker's output for dt__ps_flush (the values as they
 * are now: a later push may change full). 0 when the worker was lost. */
static int dt__ps_send_floats(dt__ps_server *S, int i, uint16_t type, const unsigned char *fix, uint32_t fixn,
                              const float *full, uint32_t len) {
  dt__ps_worker *w = &S->w[i];
  unsigned char *h = w->tx;
  w->tx_off = w->tx_len = 0;
  if (fixn) memcpy(h + DT__NET_HDR, fix, fixn);
  dt__frame_pack(h, type, w->conn.job, w->conn.self_id, w->conn.send_seq, NULL, len); /* a data frame: header-only check */
  w->conn.send_seq++;
  w->last_sent = dt__now();
  S->iov[0].iov_base = h;
  S->iov[0].iov_len = DT__NET_HDR + fixn;
  int n = 1 + dt__ps_pieces(S->params, S->owner, S->me, full, S->iov + 1), at = 0;
  while (at < n) {
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = S->iov + at;
    mh.msg_iovlen = (size_t)DT__MIN(n - at, DT__NET_IOV_MAX);
    ssize_t k = dt__sock_sendmsg(w->conn.fd, &mh, DT__NET_SEND_FLAGS);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (k <= 0) {
      char why[160];
      snprintf(why, sizeof why, "send failed: %.120s", k < 0 ? dt__sk_strerror(errno) : "connection closed");
      dt__ps_lose(S, i, DTRAIN_ERR_PEER, why);
      return 0;
    }
    at = dt__net_iov_advance(S->iov, n, at, (size_t)k); /* past what went */
  }
  for (; at < n; at++) { /* what did not go: into the output, in order (the header's rest moves to the front) */
    memmove(w->tx + w->tx_len, S->iov[at].iov_base, S->iov[at].iov_len);
    w->tx_len += S->iov[at].iov_len;
  }
  return 1;
}

/* Queue one frame for worker i: the fixed part, then the shard's floats gathered from full (if any). */
static int dt__ps_queue(dt__ps_server *S, int i, uint16_t type, const unsigned char *fix, uint32_t fixn,
                        const float *full) {
  uint32_t len = fixn + (full ? (uint32_t)(S->shard * 4) : 0u);
  dt__ps_worker *w = &S->w[i];
  if (full && DT__HOST_LE && w->tx_off == w->tx_len && DT__NET_HDR + (size_t)len <= w->tx_cap)
    return dt__ps_send_floats(S, i, type, fix, fixn, full, len);
  unsigned char *pl = dt__ps_reserve(S, i, len);
  if (!pl) return 0;
  if (fixn) memcpy(pl, fix, fixn);
  if (full) dt__ps_gather(S->params, S->owner, S->me, full, pl + fixn);
  return dt__ps_commit(S, i, type, len);
}

/* ---- the staleness rule ------------------------------------------------------------------- */

static int64_t dt__ps_min_clock(const dt__ps_server *S, int pushed) {
  int64_t m = INT64_MAX;
  for (int j = 0; j < S->W; j++) {
    const dt__ps_worker *w = &S->w[j];
    if (!dt__ps_counts(S, w)) continue;
    int64_t v = pushed ? w->pushed : w->pulled;
    if (v < m) m = v;
  }
  return m;
}

static int dt__ps_can_serve(const dt__ps_server *S, int i) {
  const dt__ps_worker *w = &S->w[i];
  int64_t t = w->pend_clock, k = S->k;
  if (S->agg) return w->pend == DT__PSP_PUSH || !w->held; /* rounds: a pull waits for its push's round */
  if (k < 0) return 1;
  if (w->pend == DT__PSP_PULL) return dt__ps_min_clock(S, 1) >= t - k;
  if (dt__ps_min_clock(S, 0) < t - k + 1) return 0;
  if (k == 0)
    for (int j = 0; j < i; j++) {
      const dt__ps_worker *o = &S->w[j];
      if (dt__ps_counts(S, o) && o->pushed < t + 1) return 0;
    }
  return 1;
}

/* Answer worker i's pending request. 0 when the worker was lost; -1 on a fatal error. */
static int dt__ps_serve_one(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  unsigned char fix[DT__PS_FIX];
  int64_t t = w->pend_clock;
  double now = dt__now();
  if (w->pend == DT__PSP_PULL) {
    int64_t slowest = dt__ps_min_clock(S, 1);
    int64_t gap = slowest == INT64_MAX ? 0 : DT__MAX(t - slowest, (int64_t)0);
    dt__put_le64(fix, S->version);
    dt__put_le64(fix + 8, (uint64_t)gap);
    if (w->pulled < t + 1) w->pulled = t + 1;
    w->pend = DT__PSP_NONE;
    w->last_heard = now;
    const float *data = dt_params_data(S->params);
    if (w->pend_mode == DT__PS_PULL_FP16 || w->pend_mode == DT__PS_PULL_BF16) { /* the difference from its copy */
      uint32_t len = (uint32_t)(DT__PS_ZFIX + 2 * S->shard);
      unsigned char *pl = dt__ps_reserve(S, i, len);
      if (!pl) return 0;
      memcpy(pl, fix, DT__PS_FIX);
      dt__ps_delta_encode(w->pend_mode == DT__PS_PULL_FP16 ? DTRAIN_COMPRESS_FP16 : DTRAIN_COMPRESS_BF16, S->params,
                          S->owner, S->me, data, w->view, pl + DT__PS_FIX);
      return dt__ps_commit(S, i, DT__PS_PARAMZ, len);
    }
    if (w->pend_mode == DT__PS_PULL_KEEP) { /* its copy starts here */
      if (!w->view && !(w->view = (float *)dt__alloc((S->shard ? S->shard : 1) * sizeof(float)))) {
        dt__ps_lose(S, i, DTRAIN_ERR_NOMEM, "out of memory for its copy of the weights (compressed pulls)");
        return 0;
      }
      dt__ps_shard_copy(S->params, S->owner, S->me, dt_params_data(S->params), w->view, 1);
      w->view_ok = 1;
    }
    return dt__ps_queue(S, i, DT__PS_PARAMS, fix, DT__PS_FIX, data);
  }
  uint64_t before = S->version;
  int64_t agg_stale = 0;
  /* applied now (dt_ps_apply.c), or held in the open round or dropped as late (aggregate) */
  int r = S->agg ? dt__ps_agg_hold(S, i, &agg_stale) : w->pend_empty ? 1 : dt__ps_apply(S, i);
  if (r == -2) return -1;
  if (r < 0) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, dt_last_result(), why);
    return 0;
  }
  if (!S->agg) {
    S->version++;
    S->since_ckpt++;
  }
  w->npushed++;
  if (S->q_back && w->lease >= 0) { /* its item is done: applied with this push, once */
    S->q.done++;
    w->lease = -1;
  }
  /* (aggregate: a dropped push says so with -1 - its staleness) */
  int64_t stale = S->agg ? (agg_stale > 0 ? -1 - agg_stale : 0)
                         : w->pend_version <= before ? (int64_t)(before - w->pend_version) : 0;
  if (w->pulled < t + 1) w->pulled = t + 1;
  w->pushed = t + 1;
  w->pend = DT__PSP_NONE;
  w->last_heard = now;
  if (!S->agg) dt__ps_maybe_ckpt(S); /* before the answer: an acknowledged update is in the checkpoint when every == 1 */
  /* (a push held in the open round: the version its round makes) */
  dt__put_le64(fix, S->version + (w->held ? 1 : 0));
  dt__put_le64(fix + 8, (uint64_t)stale);
  return dt__ps_queue(S, i, DT__PS_PUSHED, fix, DT__PS_FIX, NULL);
}

/* Worker i's TAKE, answered at once: an item (it holds it until its next
 * push), -1 when every item is done, -3 when every item left is held by
 * others (it asks again a little later; a TAKE never waits here: while it
 * would, the worker could send the other servers nothing, not even its
 * heartbeats). -2: no queue on this server. 0 when the worker was lost. */
static int dt__ps_take(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  int64_t item = -2;
  if (S->q_back) {
    dt__ps_give_back(S, w); /* a second take without a push: the first item was not trained on */
    if (S->q_nback > 0) item = S->q_back[--S->q_nback];
    else if (S->q_next < S->q.items) item = S->q_next++;
    else item = S->q.done == S->q.items ? -1 : -3;
    if (item >= 0) {
      w->lease = item;
      S->q.handed_out++;
    }
  }
  unsigned char fix[DT__PS_FIX];
  dt__put_le64(fix, (uint64_t)item);
  dt__put_le64(fix + 8, (uint64_t)S->q.done);
  return dt__ps_queue(S, i, DT__PS_TAKEN, fix, DT__PS_FIX, NULL);
}

/* Answer every request the bound allows, until none can be answered. */
static dt_result dt__ps_progress(dt__ps_server *S) {
  for (int again = 1; again;) {
    again = 0;
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      if (S->agg && dt__ps_agg_due(S)) { /* the round closes (before another push: it is full) */
        dt_result rc = dt__ps_agg_close(S);
        if (rc != DTRAIN_OK) return rc;
        again = 1; /* its pulls may go */
      }
      if (w->state != DT__PSW_LIVE || w->pend == DT__PSP_NONE || !dt__ps_can_serve(S, i)) continue;
      int r = dt__ps_serve_one(S, i);
      if (r < 0) return dt_last_result();
      again = 1;
    }
  }
  return DTRAIN_OK;
}

/* ---- frames from workers ------------------------------------------------------------------- */

/* Refuse worker i at JOIN: the connection is closed and logged, and the
 * worker's slot is free again (a correct worker may still come; one that
 * was lost keeps its clocks for its return). */
static void dt__ps_refuse(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  unsigned char buf[4 + 256];
  size_t tl = strlen(why);
  if (tl > 256) tl = 256;
  dt__put_le32(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  dt__conn_send(&w->conn, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), dt__now() + 0.2, "refuse");
  if (!S->self.opt.quiet) dt__log(DTRAIN_LOG_WARN, code, "ps %d: refused %s: %s", S->me, w->conn.peer, why);
  dt__ps_worker_free(S, w);
  dt__conn_init(&w->conn, -1, S->self.job, S->self.id, (uint32_t)S->self.opt.max_payload);
  w->joined = w->fresh = 0;
  if (w->ever) {
    w->state = DT__PSW_LOST;
    w->lost_at = dt__now();
  } else {
    w->state = DT__PSW_NEW;
    w->pulled = w->pushed = 0;
  }
  S->seen[i] = 0;
}

static void dt__ps_on_join(dt__ps_server *S, int i, const unsigned char *b) {
  dt__ps_worker *w = &S->w[i];
  char why[DT__MSG_CAP];
  int k = (int)(int32_t)dt__get_le32(b);
  uint64_t total = dt__get_le64(b + 8), shard = dt__get_le64(b + 16), layout = dt__get_le64(b + 24);
  if (total != (uint64_t)dt_params_size(S->params) || shard != (uint64_t)S->shard || layout != S->layout) {
    snprintf(why, sizeof why,
             "its model has %llu floats and a shard of %llu for ps %d, this server's has %zu and %zu (different "
             "models or layouts)",
             (unsigned long long)total, (unsigned long long)shard, S->me, dt_params_size(S->params), S->shard);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (k < DTRAIN_STALENESS_UNBOUNDED) {
    snprintf(why, sizeof why, "it asks for max_staleness %d", k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (S->q_back && k != DTRAIN_STALENESS_UNBOUNDED) {
    /* a bound would hold the fast workers at the clock of the slowest, which the
     * queue lets fall behind (it takes fewer items), and of one waiting for an item */
    snprintf(why, sizeof why, "it asks for max_staleness %d; the work queue needs unbounded staleness (-1)", k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (S->agg && k != 0) {
    /* each push of a round is computed on the round's weights: one computed on older ones
     * (overlap's, a bound's) would come late and be dropped, every time */
    snprintf(why, sizeof why, "it asks for max_staleness %d; synchronous rounds (aggregate %d) need 0", k, S->agg);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (S->k_set && k != S->k) {
    snprintf(why, sizeof why, "it asks for max_staleness %d, the other workers for %d", k, S->k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  S->k = k;
  S->k_set = 1;
  w->rx_cap = DT__PS_FIX + S->shard * 4;
  w->tx_cap = 4 * DT__NET_HDR + 2 * DT__PS_FIX + DT__PS_JOINLEN + S->shard * 4 + 8; /* + 8: PARAMZ's header */
  w->view_ok = 0; /* its first compressed pull starts a copy */
  w->rx = (unsigned char *)dt__alloc(w->rx_cap);
  w->tx = (unsigned char *)dt__alloc(w->tx_cap);
  if (!w->rx || !w->tx) {
    dt__ps_refuse(S, i, DTRAIN_ERR_NOMEM, "the server is out of memory");
    return;
  }
  /* Its clocks: where it was (its pushes before, 0 the first time), moved up
   * to the slowest worker that counts, so that nobody waits for it. A first
   * join before the quorum starts at 0: it was expected, and the others have
   * waited for it within the bound (as they did before workers could join
   * late), so the clocks of a job's start are the same whoever comes first. */
  int64_t done = w->npushed, slowest = INT64_MAX;
  for (int j = 0; j < S->W; j++)
    if (j != i && S->w[j].state == DT__PSW_LIVE && S->w[j].joined && S->w[j].pushed < slowest)
      slowest = S->w[j].pushed;
  w->start = slowest != INT64_MAX && slowest > w->pushed ? slowest : w->pushed;
  if (!w->ever && !S->quorum) w->start = 0;
  w->pulled = w->pushed = w->start;
  w->fresh = 1;
  w->joined = 1;
  int again = w->ever;
  if (!w->ever) {
    w->ever = 1;
    if (++S->joined >= S->need) S->quorum = 1;
  }
  unsigned char out[DT__PS_JOINEDLEN];
  memset(out, 0, sizeof out);
  dt__put_le64(out, S->version);
  dt__put_le64(out + 8, (uint64_t)dt_optim_steps(S->opt));
  dt__put_le32(out + 16, (uint32_t)(int32_t)S->k);
  dt__put_le32(out + 20, (uint32_t)dt__ps_live_count(S));
  dt__put_le64(out + 24, S->layout);
  dt__put_le64(out + 32, (uint64_t)w->start);
  dt__put_le64(out + 40, (uint64_t)(again ? done : 0));
  if (again)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s rejoined at clock %lld (it had pushed %lld; version %llu)", S->me,
            w->conn.peer, (long long)w->start, (long long)done, (unsigned long long)S->version);
  else if (S->version > 0)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s joined mid-run at clock %lld (version %llu)", S->me, w->conn.peer,
            (long long)w->start, (unsigned long long)S->version);
  else
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s joined (max_staleness %d)", S->me, w->conn.peer, S->k);
  dt__ps_queue(S, i, DT__PS_JOINED, out, DT__PS_JOINEDLEN, NULL);
}

/* A whole header from worker i (w->in_h): checked as dt__conn_recv_header
 * does, then against what the worker may send now; w->in_dst gets where its
 * payload goes. 0 when the worker was lost. */
static int dt__ps_on_header(dt__ps_server *S, int i, const char *op) {
  dt__ps_worker *w = &S->w[i];
  dt__frame *f = &w->in_f;
  char why[DT__MSG_CAP];
  dt_result rc = dt__conn_check_header(&w->conn, w->in_h, f, op);
  if (rc != DTRAIN_OK) {
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, rc, why);
    return 0;
  }
  if (f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE) { /* its text, then the peer's error */
    w->in_dst = w->in_small;
    return 1;
  }
  uint32_t want_max = 0;
  int ok_type = 1;
  /* a request may come when none is pending, and not between a push's parts */
  const int free_turn = w->joined && w->pend == DT__PSP_NONE && !w->parting;
  switch (f->type) {
    case DT__MSG_HEARTBEAT:
    case DT__MSG_BYE: want_max = 0; break;
    case DT__PS_JOIN: want_max = DT__PS_JOINLEN; ok_type = !w->joined; break;
    case DT__PS_PULL: want_max = DT__PS_FIX; ok_type = free_turn; break;
    case DT__PS_TAKE: want_max = 0; ok_type = free_turn; break;
    /* (aggregate: not while its last push is held: it pulls first, and that waits for the round) */
    case DT__PS_PUSH: want_max = (uint32_t)w->rx_cap; ok_type = free_turn && !w->held; break;
    case DT__PS_PUSHZ:
      want_max = (uint32_t)DT__MIN(S->zcap, (size_t)UINT32_MAX);
      ok_type = free_turn && !w->held;
      break;
    case DT__PS_PUSHP:
      want_max = (uint32_t)DT__MIN(DT__PS_PFIX + S->shard * 4, (size_t)UINT32_MAX);
      ok_type = w->joined && w->pend == DT__PSP_NONE && !w->held;
      break;
    default: ok_type = 0;
  }
  if (ok_type && f->type == DT__PS_PUSHP && !w->rxp && !(w->rxp = (unsigned char *)dt__alloc(DT__PS_PFIX + S->shard * 4))) {
    dt__ps_lose(S, i, DTRAIN_ERR_NOMEM, "out of memory for a push in parts");
    return 0;
  }
  if (ok_type && f->type == DT__PS_PUSHZ && f->length >= DT__PS_ZFIX && f->length <= want_max && f->length > w->rx_cap) {
    /* the first compressed push larger than a float one (top-k near 1): room for the largest */
    unsigned char *nb = (unsigned char *)dt__alloc(S->zcap);
    if (!nb) {
      dt__ps_lose(S, i, DTRAIN_ERR_NOMEM, "out of memory for a compressed push");
      return 0;
    }
    dt__free(w->rx, w->rx_cap);
    w->rx = nb;
    w->rx_cap = S->zcap;
  }
  int exact = f->type == DT__PS_JOIN || f->type == DT__PS_PULL;
  int bad_len = f->length > want_max || (exact && f->length != want_max) ||
                (f->type == DT__PS_PUSH && f->length != DT__PS_FIX && f->length != DT__PS_FIX + S->shard * 4) ||
                (f->type == DT__PS_PUSHZ && f->length < DT__PS_ZFIX) ||
                (f->type == DT__PS_PUSHP && (f->length < DT__PS_PFIX || (f->length - DT__PS_PFIX) % 4 != 0));
  if (!ok_type || bad_len) {
    snprintf(why, sizeof why, "%s: protocol violation: a frame of type 0x%02x and %u bytes %s", op, (unsigned)f->type,
             (unsigned)f->length, ok_type ? "(wrong length)" : (w->joined ? "out of turn" : "before joining"));
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return 0;
  }
  w->in_dst = f->type == DT__PS_PUSH || f->type == DT__PS_PUSHZ ? w->rx : f->type == DT__PS_PUSHP ? w->rxp : w->in_small;
  return 1;
}

/* A request of worker i whole: a PULL (word: the form asked for), a PUSH or
 * PUSHZ of length bytes in rx (word: the version it was computed on), or the
 * last part of a push (as a PUSH: length DT__PS_FIX + the shard's floats, or
 * DT__PS_FIX when discarded). Checked against its clocks, then pending. */
static void dt__ps_on_request(dt__ps_server *S, int i, uint16_t type, int64_t t, uint64_t word, uint32_t length,
                              const char *op) {
  dt__ps_worker *w = &S->w[i];
  char why[DT__MSG_CAP];
  const int push = type != DT__PS_PULL;
  const uint64_t mode = push ? 0 : word;
  if (mode > DT__PS_PULL_BF16 || (mode >= DT__PS_PULL_FP16 && !w->view_ok)) {
    snprintf(why, sizeof why, "%s: protocol violation: a pull asking for weights of form %llu%s", op,
             (unsigned long long)mode, mode > DT__PS_PULL_BF16 ? " (0-3)" : " before a pull that keeps a copy");
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  if (w->fresh && t < w->start) {
    snprintf(why, sizeof why, "%s: protocol violation: %s for clock %lld, before its start clock %lld", op,
             push ? "push" : "pull", (long long)t, (long long)w->start);
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  if (w->fresh) { /* its first request: it may start later (another server's start clock was larger) */
    w->pushed = t;
    w->pulled = push ? t + 1 : t;
    w->fresh = 0;
  }
  if (t < 0 || (push && t < w->pushed)) {
    snprintf(why, sizeof why, "%s: protocol violation: %s for clock %lld after a push of clock %lld", op,
             push ? "push" : "pull", (long long)t, (long long)w->pushed - 1);
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  w->pend = push ? DT__PSP_PUSH : DT__PSP_PULL;
  w->pend_clock = t;
  w->pend_version = word;
  w->pend_mode = (int)mode;
  w->pend_z = type == DT__PS_PUSHZ;
  w->pend_len = length;
  w->pend_empty = length == DT__PS_FIX && S->shard > 0;
  if (push && S->shard == 0) w->pend_empty = 1;
  w->pend_since = w->last_heard;
}

/* A whole frame from worker i: payload checked, then handled. */
static void dt__ps_on_frame(dt__ps_server *S, int i, const char *op) {
  dt__ps_worker *w = &S->w[i];
  const dt__frame f = w->in_f;
  const unsigned char *dst = w->in_dst;
  char why[DT__MSG_CAP];
  w->in_len = 0;
  dt_result rc = dt__conn_check_payload(&w->conn, &f, w->in_h, dst, op);
  if (rc != DTRAIN_OK) {
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, rc, why);
    return;
  }
  w->last_heard = dt__now();
  switch (f.type) {
    case DT__MSG_BYE: {
      char name[DT__NET_ADDR];
      dt__ps_worker_name(S, i, name, sizeof name);
      dt__ps_worker_free(S, w);
      w->state = DT__PSW_DONE;
      S->seen[i] = DT__NET_SEEN_LEFT; /* a process with its rank is refused as finished */
      S->done++;
      dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s finished (BYE)", S->me, name);
      break;
    }
    case DT__PS_JOIN: dt__ps_on_join(S, i, dst); break;
    case DT__PS_TAKE: (void)dt__ps_take(S, i); break;
    case DT__PS_PUSHP: { /* a part (dt_ps_parts.c); the last makes the push a request */
      dt__ps_whole whole;
      int k = dt__ps_part(w, S->shard, dst, f.length, op, &whole, why, sizeof why);
      if (k < 0) dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
      else if (k > 0) dt__ps_on_request(S, i, DT__PS_PUSH, whole.clock, whole.version, whole.length, op);
      break;
    }
    case DT__PS_PULL:
    case DT__PS_PUSH:
    case DT__PS_PUSHZ: dt__ps_on_request(S, i, f.type, (int64_t)dt__get_le64(dst), dt__get_le64(dst + 8), f.length, op); break;
    default: break; /* heartbeat */
  }
}

/* Worker i's socket is readable: take what it has of the current frame
 * without waiting (only as many bytes as the frame needs), checking the
 * header as soon as it is whole, and handle the frame once it is. A worker
 * that stops halfway holds its own connection only, until the loop's
 * deadline drops it; the others are served meanwhile. */
static void dt__ps_on_readable(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  char op[64], why[DT__MSG_CAP];
  snprintf(op, sizeof op, "ps %d", S->me);
  for (;;) {
    int in_header = w->in_len < DT__NET_HDR;
    size_t total = DT__NET_HDR + (in_header ? 0 : (size_t)w->in_f.length);
    if (!in_header && w->in_len == total) {
      dt__ps_on_frame(S, i, op);
      return; /* the next frame on the next poll, after the other workers */
    }
    unsigned char *dst = in_header ? w->in_h + w->in_len : w->in_dst + (w->in_len - DT__NET_HDR);
    size_t want = total - w->in_len;
    ssize_t k = dt__sock_recv(w->conn.fd, dst, want, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      /* As dt__conn_recv_header words it. */
      snprintf(why, sizeof why, "%.60s: receive from %.95s: %.100s", op, w->conn.peer,
               k == 0 ? "connection closed by the peer" : dt__sk_strerror(errno));
      dt__ps_lose(S, i, DTRAIN_ERR_PEER, why);
      return;
    }
    if (w->in_len == 0) w->in_started = dt__now();
    w->in_len += (size_t)k;
    if (in_header && w->in_len == DT__NET_HDR && !dt__ps_on_header(S, i, op)) return;
    if ((size_t)k < want) return; /* the socket is empty for now */
  }
}

/* ---- connections ------------------------------------------------------------------------------ */

static void dt__ps_drop_pending(dt__ps_server *S, int j) {
  if (j != S->npend - 1) S->pend[j] = S->pend[S->npend - 1];
  S->npend--;
}

/* Pending handshake j ended (r: DT__HS_DONE or _FAILED, the failure already
 * logged): a worker joins the serving, or the slot is free again. */
static void dt__ps_admit_done(dt__ps_server *S, int j, int r) {
  dt__conn c = S->pend[j].conn;
  dt__ps_drop_pending(S, j);
  if (r != DT__HS_DONE) return;
  if (c.peer_role != DTRAIN_ROLE_WORKER ||
      (S->w[c.peer_index].state != DT__PSW_NEW && S->w[c.peer_index].state != DT__PSW_LOST)) {
    if (!S->self.opt.quiet)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "ps %d: refused %s: %s", S->me, c.peer,
              c.peer_role != DTRAIN_ROLE_WORKER ? "only workers talk to a server" : "that worker already left");
    dt__conn_close(&c);
    return;
  }
  dt__ps_worker *w = &S->w[c.peer_index];
  w->conn = c;
  w->state = DT__PSW_LIVE;
  w->joined = 0;
  w->in_len = 0;
  w->last_heard = w->last_sent = dt__now();
}

/* Take every connection waiting in the backlog into a handshake (bounded per
 * round). Handshakes never block the loop: a client that says nothing, or a
 * byte a second, holds a slot until its deadline, never the workers. */
static void dt__ps_accept(dt__ps_server *S) {
  for (int round = 0; round < DT__NET_PENDING_MAX; round++) {
    int fd;
    char addr[DT__NET_ADDR];
    if (dt__net_accept(S->lfd, 0.0, &fd, addr, sizeof addr) != DTRAIN_OK) return;
    if (S->npend == DT__NET_PENDING_MAX) {
      /* Too many clients in the handshake: the oldest silent one goes. */
      int old = dt__hs_victim(S->pend, S->npend);
      char why[96];
      snprintf(why, sizeof why, "too many connections in the handshake (%d); the oldest %sis dropped",
               DT__NET_PENDING_MAX, S->pend[old].in_len == 0 ? "silent one " : "");
      dt__hs_drop(&S->pend[old], &S->self, DTRAIN_ERR_PROTOCOL, why);
      dt__ps_drop_pending(S, old);
    }
    dt__hs *h = &S->pend[S->npend++];
    dt__hs_start(h, &S->self, fd, addr, dt__now() + dt__net_hs_timeout(&S->self));
    /* Its hello is often there already. */
    int r = dt__hs_step(h, &S->self, S->seen);
    if (r != DT__HS_BUSY) dt__ps_admit_done(S, S->npend - 1, r);
  }
}

/* ---- the loop ----------------------------------------------------------------------------------- */

static void dt__ps_server_free(dt__ps_server *S) {
  if (S->w) {
    for (int i = 0; i < S->W; i++) {
      S->w[i].held = 0; /* (a round left open: its pushes go with the server) */
      dt__ps_worker_free(S, &S->w[i]);
    }
    dt__free(S->w, (size_t)S->W * sizeof(dt__ps_worker));
  }
  for (int j = 0; j < S->npend; j++) dt__conn_close(&S->pend[j].conn);
  S->npend = 0;
  dt__free(S->pend, (size_t)DT__NET_PENDING_MAX * sizeof(dt__hs));
  if (S->own_lfd) dt__net_close(S->lfd);
  dt__free(S->seen, (size_t)S->W);
  dt__free(S->owner, (size_t)(S->np > 0 ? S->np : 1) * sizeof(int));
  dt__free(S->ckpt, S->ckpt_bytes);
  if (S->before) dt__free(S->before, dt_params_size(S->params) * sizeof(float) + 4);
  dt__free(S->zscratch, S->zscratch_cap * sizeof(float));
  dt__free(S->iov, (size_t)(S->np + 1) * sizeof(struct iovec));
  if (S->q_back) dt__free(S->q_back, (size_t)S->W * sizeof(int64_t));
  if (S->agg_sum) dt__free(S->agg_sum, dt_params_size(S->params) * sizeof(float) + 4);
}

static dt_result dt__ps_loop(dt__ps_server *S) {
  const double T = S->self.opt.timeout_s;
  const double start = dt__now();
  double tick = T / 8 < 0.25 ? T / 8 : 0.25;
  if (tick < 0.005) tick = 0.005;
  size_t cap = 1 + (size_t)DT__NET_PENDING_MAX + (size_t)S->W;
  struct pollfd *pf = (struct pollfd *)dt__alloc(cap * sizeof(struct pollfd));
  int *who = (int *)dt__alloc(cap * sizeof(int));
  dt_result rc = DTRAIN_OK;
  if (!pf || !who) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "dt_ps_serve: ps %d: out of memory", S->me);
    goto out;
  }
  while (dt__ps_open(S, dt__now())) {
    double now = dt__now();
    /* Deadlines: workers that never came (before the quorum; after it the
     * rest are welcome later), went silent, or stopped reading. */
    int late = !S->quorum && now - start > S->self.opt.connect_timeout_s;
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      char why[160];
      if (w->state == DT__PSW_NEW && late) {
        snprintf(why, sizeof why, "it did not connect within %.1f s", S->self.opt.connect_timeout_s);
        dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
      } else if (w->state == DT__PSW_LIVE) {
        if (w->tx_off < w->tx_len && now - w->last_sent > T) {
          snprintf(why, sizeof why, "it read nothing for %.1f s (deadline)", now - w->last_sent);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->in_len > 0 && now - w->in_started > T) {
          /* Half a frame: the rest never came (a stalled or buggy worker), or comes too slowly. */
          if (w->in_len < DT__NET_HDR)
            snprintf(why, sizeof why, "half a frame for %.1f s: %zu of %d header bytes (deadline %.1f s)",
                     now - w->in_started, w->in_len, DT__NET_HDR, T);
          else
            snprintf(why, sizeof why, "half a frame for %.1f s: %zu of %u payload bytes of a frame of type 0x%02x "
                     "(deadline %.1f s)", now - w->in_started, w->in_len - DT__NET_HDR, (unsigned)w->in_f.length,
                     (unsigned)w->in_f.type, T);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->in_len == 0 && w->pend == DT__PSP_NONE && now - w->last_heard > T) {
          snprintf(why, sizeof why, "nothing heard for %.1f s (deadline %.1f s)", now - w->last_heard, T);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->pend != DT__PSP_NONE && w->tx_off == w->tx_len && now - w->last_sent > T / 4) {
          dt__ps_queue(S, i, DT__MSG_HEARTBEAT, NULL, 0, NULL);
        }
      }
    }
    /* Handshakes past their deadline (dt__hs_step fails them and logs why). */
    for (int j = 0; j < S->npend;) {
      int r = now >= S->pend[j].deadline ? dt__hs_step(&S->pend[j], &S->self, S->seen) : DT__HS_BUSY;
      if (r != DT__HS_BUSY) dt__ps_admit_done(S, j, r);
      else j++;
    }
    if (late) S->quorum = 1; /* whoever was coming on time is here */
    /* Losing a worker may let others go on. */
    rc = dt__ps_progress(S);
    if (rc != DTRAIN_OK || !dt__ps_open(S, now)) break;
    int n = 0;
    pf[n].fd = S->lfd;
    pf[n].events = POLLIN;
    who[n++] = -1;
    for (int j = 0; j < S->npend; j++) {
      pf[n].fd = S->pend[j].conn.fd;
      pf[n].events = dt__hs_events(&S->pend[j]);
      who[n++] = -2 - j;
    }
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      if (w->state != DT__PSW_LIVE) continue;
      pf[n].fd = w->conn.fd;
      pf[n].events = (short)(POLLIN | (w->tx_off < w->tx_len ? POLLOUT : 0));
      who[n++] = i;
    }
    for (int j = 0; j < n; j++) pf[j].revents = 0;
    int pr = dt__sock_poll(pf, (nfds_t)n, (int)(tick * 1000.0) + 1);
    if (pr < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "dt_ps_serve: ps %d: poll: %s", S->me, dt__sk_strerror(errno));
      break;
    }
    if (pr <= 0) continue;
    /* Workers first (their pending-fd indices do not move), then handshakes, then new connections. */
    for (int j = 0; j < n; j++) {
      int i = who[j];
      if (i < 0 || S->w[i].state != DT__PSW_LIVE) continue;
      if ((pf[j].revents & POLLOUT) && !dt__ps_flush(S, i)) continue;
      if (pf[j].revents & (POLLIN | POLLERR | POLLHUP)) dt__ps_on_readable(S, i);
    }
    /* Then the handshakes that can move (none blocks: each moves what its socket
     * allows); from the last so that finished ones leave the list behind us. */
    for (int j = n - 1; j > 0; j--) {
      if (who[j] > -2 || !pf[j].revents) continue;
      int q = -2 - who[j];
      int r = dt__hs_step(&S->pend[q], &S->self, S->seen);
      if (r != DT__HS_BUSY) dt__ps_admit_done(S, q, r);
    }
    if (pf[0].revents & POLLIN) dt__ps_accept(S);
    rc = dt__ps_progress(S);
    if (rc != DTRAIN_OK) break;
  }
  /* Flush the last answers (best effort, briefly). */
  for (int i = 0; i < S->W; i++) {
    dt__ps_worker *w = &S->w[i];
    if (w->state == DT__PSW_LIVE && w->tx_off < w->tx_len)
      dt__net_write(w->conn.fd, w->tx + w->tx_off, w->tx_len - w->tx_off, dt__now() + 0.2);
  }
out:
  dt__free(pf, cap * sizeof(struct pollfd));
  dt__free(who, cap * sizeof(int));
  return rc;
}

static dt_result dt__ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  const char *fn = "dt_ps_serve";
  if (!c || !params || !opt)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !c ? "cluster" : !params ? "params" : "opt");
  if (c->role != DTRAIN_ROLE_PS || c->servers < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: this process is not a server of the cluster (role %s, %d servers)",
                     fn, c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->servers);
  dt__ps_server S;
  memset(&S, 0, sizeof S);
  S.lfd = -1;
  dt_result rc = dt__net_self_init(&S.self, c, o);
  if (rc != DTRAIN_OK) return dt__ps_prefix(rc, fn, NULL);
  S.c = c;
  S.params = params;
  S.opt = opt;
  if (po) S.po = *po;
  if (S.po.work_stats) memset(S.po.work_stats, 0, sizeof *S.po.work_stats);
  S.me = c->index;
  S.W = c->workers;
  S.np = dt_params_count(params);
  S.k = 0;
#  ifndef DTRAIN_NO_STDIO
  if (S.po.rejoin_timeout_s == 0) { /* tools/dtrain-launch --max-restarts sets it */
    const char *e = getenv("DTRAIN_REJOIN_TIMEOUT");
    if (e && atof(e) > 0) S.po.rejoin_timeout_s = atof(e);
  }
#  endif
  S.need = S.po.min_workers > 0 && S.po.min_workers < S.W ? S.po.min_workers : S.W;
  if (S.po.min_workers < 0 || !(S.po.rejoin_timeout_s >= 0)) {
    rc = dt__error(DTRAIN_ERR_INVALID_ARG, "%s: ps %d: min_workers %d and rejoin_timeout_s %g must be >= 0", fn,
                   c->index, S.po.min_workers, S.po.rejoin_timeout_s);
    return rc;
  }
  S.owner = (int *)dt__alloc((size_t)(S.np > 0 ? S.np : 1) * sizeof(int));
  S.iov = (struct iovec *)dt__alloc((size_t)(S.np + 1) * sizeof(struct iovec));
  S.before = S.po.staleness_lr ? (float *)dt__alloc(dt_params_size(params) * sizeof(float) + 4) : NULL;
  S.w = (dt__ps_worker *)dt__calloc((size_t)S.W * sizeof(dt__ps_worker));
  /* Before anything can free them: a zeroed connection's descriptor is 0, and
   * closing it (when a later allocation fails) closed stdin, or by then
   * another thread's socket that had got descriptor 0. */
  for (int i = 0; S.w && i < S.W; i++) S.w[i].conn.fd = -1;
  S.seen = (unsigned char *)dt__calloc((size_t)S.W);
  S.pend = (dt__hs *)dt__alloc((size_t)DT__NET_PENDING_MAX * sizeof(dt__hs));
  if (!S.owner || !S.iov || !S.w || !S.seen || !S.pend || (S.po.staleness_lr && !S.before)) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory", fn, S.me);
    goto done;
  }
  for (int i = 0; i < S.W; i++) {
    dt__conn_init(&S.w[i].conn, -1, S.self.job, S.self.id, (uint32_t)S.self.opt.max_payload);
    S.w[i].lease = -1;
  }
  if (S.po.work_items < 0 || (uint64_t)S.po.work_items > (uint64_t)SIZE_MAX / 2) {
    rc = dt__error(DTRAIN_ERR_INVALID_ARG, "%s: ps %d: work_items %lld must be >= 0", fn, S.me,
                   (long long)S.po.work_items);
    goto done;
  }
  if ((rc = dt__ps_agg_setup(&S, fn)) != DTRAIN_OK) goto done;
  if (S.me == 0 && S.po.work_items > 0) { /* the queue lives on server 0 */
    S.q.items = S.po.work_items;
    S.q_back = (int64_t *)dt__alloc((size_t)S.W * sizeof(int64_t));
    if (!S.q_back) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory for a work queue of %lld items", fn, S.me,
                     (long long)S.q.items);
      goto done;
    }
  }
  rc = dt_ps_shard(params, c->servers, S.owner);
  if (rc != DTRAIN_OK) goto done;
  S.shard = dt__ps_shard_floats(params, S.owner, S.me);
  S.layout = dt__ps_layout_hash(params, S.owner, S.me, c->servers);
  S.zcap = dt__ps_pushz_cap(params, S.owner, S.me);
  if (DT__PS_FIX + S.shard * 4 > S.self.opt.max_payload) {
    rc = dt__error(DTRAIN_ERR_OVERFLOW, "%s: ps %d: a shard of %zu floats exceeds max_payload (%zu bytes); use more "
                   "servers or raise it", fn, S.me, S.shard, S.self.opt.max_payload);
    goto done;
  }
  if (S.po.checkpoint_dir && S.po.checkpoint_dir[0]) {
    S.ckpt_bytes = dt__ps_ckpt_size(&S);
    S.ckpt = (unsigned char *)dt__alloc(S.ckpt_bytes);
    if (!S.ckpt) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory for the checkpoint buffer", fn, S.me);
      goto done;
    }
    snprintf(S.ckpt_path, sizeof S.ckpt_path, "%.900s/ps-%d-of-%d.ckpt", S.po.checkpoint_dir, S.me, c->servers);
    rc = dt__ps_ckpt_check_dir(&S, fn);
    if (rc != DTRAIN_OK) goto done;
    if (!S.po.no_resume) {
      rc = dt__ps_ckpt_read(&S);
      if (rc != DTRAIN_OK) goto done;
    }
    S.last_ckpt = dt__now();
  }
  rc = dt__net_self_listen(&S.self, &S.lfd);
  if (rc != DTRAIN_OK) {
    char who[32];
    snprintf(who, sizeof who, "ps %d", S.me);
    rc = dt__ps_prefix(rc, fn, who);
    goto done;
  }
  S.own_lfd = S.self.opt.listen_fd < 0;
  if (S.agg)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: serving %zu floats of %d parameters to %d workers in rounds of %d "
            "pushes (%d backup)", S.me, S.shard, S.np, S.W, S.agg, S.W - S.agg);
  else
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: serving %zu floats of %d parameters to %d workers", S.me, S.shard,
            S.np, S.W);
  rc = dt__ps_loop(&S);
  if (rc == DTRAIN_OK && S.ckpt) {
    rc = dt__ps_ckpt_write(&S);
  }
  if (rc == DTRAIN_OK && S.done == 0)
    rc = dt__error(DTRAIN_ERR_PEER, "%s: ps %d: every worker was lost (none finished with BYE)", fn, S.me);
  if (S.agg)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %lld rounds of up to %d pushes (%lld held), %lld late pushes dropped",
            S.me, (long long)S.rounds, S.agg, (long long)S.held_total, (long long)S.dropped);
  if (S.q_back)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps 0: work queue: %lld of %lld items done, %lld handed out (%lld given back "
            "by workers that died or left first)", (long long)S.q.done, (long long)S.q.items,
            (long long)S.q.handed_out, (long long)S.q.returned);
done:
  if (S.po.work_stats) *S.po.work_stats = S.q;
  {
    char keep[DT__MSG_CAP];
    snprintf(keep, sizeof keep, "%s", dt_last_error());
    dt__ps_server_free(&S);
    if (rc != DTRAIN_OK) dt__error(rc, "%s", keep);
  }
  return rc;
}

DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  if (c && c->role == DTRAIN_ROLE_PS) dt_trace_set_process("server", c->index);
  dt__trace_env();
  dt__quiet_push(); /* one log line for a failure, with its whole context (warnings are logged as they happen) */
  return dt__quiet_pop(dt__ps_serve(c, params, opt, o, po));
}

#else /* DTRAIN_NO_NET */

DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  (void)c;
  (void)params;
  (void)opt;
  (void)o;
  (void)po;
#  if defined(DTRAIN_NO_DIST)
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_ps_serve: compiled out (DTRAIN_NO_DIST)");
#  else
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_ps_serve: networking is not compiled in (DTRAIN_NO_NET)");
#  endif
}

#endif /* DTRAIN_NO_NET */
