/* ===========================================================================
 * dt_ps.c -- parameter servers: shard assignment, the server loop
 * (dt_ps_serve) and the worker's TCP parameter store (dt_pstore_create_tcp)
 * ===========================================================================
 * The server is one thread running a poll loop over its listening socket,
 * connections still in the handshake and one connection per worker. It
 * reads a worker's frame whole when the socket is readable (deadline
 * timeout_s/2), never blocks on a send (each worker has an output buffer
 * flushed as its socket takes it), and answers requests when the staleness
 * bound allows: a request that must wait stays pending, and the server
 * sends that worker a heartbeat every timeout_s/4 so it knows the server
 * lives. The SSP rule is the one of the in-process store (dt_strategy.c):
 *
 *   pull for clock t:  every live worker pushed clock t-k-1 (pushed >= t-k)
 *   push of clock t:   every live worker pulled clock t-k   (pulled >= t-k+1)
 *                      and, when k = 0, every live worker j < w pushed t
 *
 * where "live" means not yet gone (BYE) or lost; a worker not yet connected
 * counts with clocks 0 (others wait for it, within the bound).
 *
 * Messages (after the transport handshake; little-endian):
 *   JOIN   0x50 w->s  32 B: i32 max_staleness, u32 0, u64 params floats,
 *                            u64 shard floats, u64 layout hash
 *   JOINED 0x51 s->w  32 B: u64 version, i64 optimizer steps, i32 max_staleness,
 *                            u32 live workers, u64 layout hash
 *   PULL   0x52 w->s  16 B: u64 clock, u64 0
 *   PARAMS 0x53 s->w  16 B + 4*shard: u64 version, i64 clock gap, f32[shard]
 *   PUSH   0x54 w->s  16 B (+ 4*shard): u64 clock, u64 version pulled, f32[shard]
 *                            (no floats: an empty push that only advances the clock)
 *   PUSHED 0x55 s->w  16 B: u64 version after, i64 staleness
 *   HEARTBEAT (0x07) both ways, BYE (0x08) w->s, REFUSE (0x05) s->w.
 * The shard's floats are its parameters' elements in parameter order.
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
#include "dt_net_core.h"
#include "dt_platform.h"

enum {
  DT__PS_JOIN = 0x50,
  DT__PS_JOINED = 0x51,
  DT__PS_PULL = 0x52,
  DT__PS_PARAMS = 0x53,
  DT__PS_PUSH = 0x54,
  DT__PS_PUSHED = 0x55
};
#define DT__PS_FIX 16   /* fixed part of PULL, PARAMS, PUSH, PUSHED */
#define DT__PS_JOINLEN 32
#define DT__PS_CKPT_MAGIC 0x53505444u /* "DTPS" */
#define DT__PS_CKPT_HDR 64

/* Prefix the thread's last error (copied first: dt__error writes the buffer dt_last_error reads). */
static DT__UNUSED dt_result dt__ps_prefix(dt_result rc, const char *a, const char *b) {
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  if (b) return dt__error(rc, "%s: %s: %s", a, b, keep);
  return dt__error(rc, "%s: %s", a, keep);
}

/* ---- shard assignment (also without networking) ----------------------------------------- */

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
static DT__UNUSED size_t dt__ps_shard_floats(const dt_params *p, const int *owner, int s) {
  size_t n = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
    if (owner[i] == s) n += e - b;
  return n;
}

/* FNV-1a over the shard's parameter ranges, the params' size and the server count. */
static DT__UNUSED uint64_t dt__ps_layout_hash(const dt_params *p, const int *owner, int s, int servers) {
  uint64_t h = 1469598103934665603ULL;
  uint64_t v[4];
  size_t b, e;
  int tr, dec;
  v[0] = (uint64_t)dt_params_size(p);
  v[1] = (uint64_t)servers;
  v[2] = (uint64_t)s;
  v[3] = (uint64_t)dt_params_count(p);
  for (int k = 0; k < 4; k++)
    for (int j = 0; j < 8; j++) h = (h ^ ((v[k] >> (8 * j)) & 0xFF)) * 1099511628211ULL;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    v[0] = (uint64_t)i;
    v[1] = (uint64_t)b;
    v[2] = (uint64_t)e;
    v[3] = (uint64_t)tr;
    for (int k = 0; k < 4; k++)
      for (int j = 0; j < 8; j++) h = (h ^ ((v[k] >> (8 * j)) & 0xFF)) * 1099511628211ULL;
  }
  return h;
}

static DT__UNUSED int dt__ps_little_endian(void) {
  const uint16_t one = 1;
  unsigned char c;
  memcpy(&c, &one, 1);
  return c == 1;
}

/* Floats to little-endian bytes and back. */
static DT__UNUSED void dt__ps_put_floats(unsigned char *dst, const float *src, size_t n) {
  if (dt__ps_little_endian()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, src + i, 4);
    dt__le32_put(dst + 4 * i, u);
  }
}

static DT__UNUSED void dt__ps_get_floats(float *dst, const unsigned char *src, size_t n) {
  if (dt__ps_little_endian()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u = dt__le32_get(src + 4 * i);
    memcpy(dst + i, &u, 4);
  }
}

/* The shard of a full-layout buffer to bytes, and back (trainable_to, when
 * not NULL, receives the trainable parameters' floats instead of full). */
static DT__UNUSED void dt__ps_gather(const dt_params *p, const int *owner, int s, const float *full, unsigned char *out) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__ps_put_floats(out + 4 * off, full + b, e - b);
    off += e - b;
  }
}

static DT__UNUSED void dt__ps_scatter(const dt_params *p, const int *owner, int s, const unsigned char *in, float *full) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__ps_get_floats(full + b, in + 4 * off, e - b);
    off += e - b;
  }
}

#if !defined(DTRAIN_NO_NET)
#  include <errno.h>
#  include <poll.h>
#  include <sys/socket.h>
#  include <sys/types.h>
#  include <unistd.h>
#  ifdef MSG_NOSIGNAL
#    define DT__PS_SEND_FLAGS MSG_NOSIGNAL
#  else
#    define DT__PS_SEND_FLAGS 0
#  endif

/* ============================================================================================
 * The server
 * ============================================================================================ */

enum { DT__PSW_NEW = 0, DT__PSW_LIVE, DT__PSW_DONE, DT__PSW_LOST };
enum { DT__PSP_NONE = 0, DT__PSP_PULL, DT__PSP_PUSH };
#  define DT__PS_PENDING 16 /* connections in the handshake at a time */

typedef struct dt__ps_worker {
  int state;
  int joined;
  dt__conn conn;
  int64_t pulled, pushed;   /* clocks: pulls / pushes made */
  int pend;                 /* DT__PSP_* */
  int64_t pend_clock;
  uint64_t pend_version;
  int pend_empty;
  double pend_since;
  double last_heard;        /* last frame from it, or our last answer */
  double last_sent;
  unsigned char *rx, *tx;
  size_t rx_cap, tx_cap, tx_len, tx_off;
} dt__ps_worker;

typedef struct dt__ps_server {
  dt__net_self self;
  const dt_cluster *c;
  dt_params *params;
  dt_optim *opt;
  dt_ps_options po;
  int *owner;
  int np, W, me;
  size_t shard;
  uint64_t layout;
  dt__ps_worker *w;
  unsigned char *seen;
  int lfd, own_lfd;
  int k, k_set;
  uint64_t version;
  int64_t since_ckpt;
  double last_ckpt;
  unsigned char *ckpt;
  size_t ckpt_bytes;
  char ckpt_path[1024];
  int pfd[DT__PS_PENDING];
  double pt[DT__PS_PENDING];
  char paddr[DT__PS_PENDING][DT__NET_ADDR];
  int npend;
  int done;
} dt__ps_server;

static int dt__ps_live_count(const dt__ps_server *S) {
  int n = 0;
  for (int i = 0; i < S->W; i++)
    if (S->w[i].state == DT__PSW_NEW || S->w[i].state == DT__PSW_LIVE) n++;
  return n;
}

static void dt__ps_worker_free(dt__ps_server *S, dt__ps_worker *w) {
  (void)S;
  dt__conn_close(&w->conn);
  dt__free(w->rx, w->rx_cap);
  dt__free(w->tx, w->tx_cap);
  w->rx = w->tx = NULL;
  w->rx_cap = w->tx_cap = w->tx_len = w->tx_off = 0;
  w->pend = DT__PSP_NONE;
}

static void dt__ps_worker_name(const dt__ps_server *S, int i, char *buf, size_t cap) {
  const dt__ps_worker *w = &S->w[i];
  if (w->conn.peer_role >= 0) snprintf(buf, cap, "%.95s", w->conn.peer);
  else snprintf(buf, cap, "worker %d (%.80s)", i, S->c->worker_addr[i] ? S->c->worker_addr[i] : "?");
}

/* Drop worker i from training: logged, out of the clocks. */
static void dt__ps_lose(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  char name[DT__NET_ADDR];
  dt__ps_worker_name(S, i, name, sizeof name);
  dt__ps_worker_free(S, w);
  w->state = DT__PSW_LOST;
  int left = dt__ps_live_count(S);
  dt__log(DTRAIN_LOG_WARN, code, "ps %d: %s lost: %s; going on with %d worker%s", S->me, name, why, left,
          left == 1 ? "" : "s");
}

/* Write as much of worker i's output as the socket takes. 0 when the worker was lost. */
static int dt__ps_flush(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  while (w->tx_off < w->tx_len) {
    ssize_t k = send(w->conn.fd, w->tx + w->tx_off, w->tx_len - w->tx_off, DT__PS_SEND_FLAGS);
    if (k > 0) {
      w->tx_off += (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
    char why[160];
    snprintf(why, sizeof why, "send failed: %.120s", k < 0 ? strerror(errno) : "connection closed");
    dt__ps_lose(S, i, DTRAIN_ERR_PEER, why);
    return 0;
  }
  w->tx_off = w->tx_len = 0;
  return 1;
}

/* Queue one frame for worker i: the fixed part, then n floats of the shard gathered from full (if any). */
static int dt__ps_queue(dt__ps_server *S, int i, uint16_t type, const unsigned char *fix, uint32_t fixn,
                        const float *full) {
  dt__ps_worker *w = &S->w[i];
  uint32_t len = fixn + (full ? (uint32_t)(S->shard * 4) : 0u);
  if (w->tx_off == w->tx_len) w->tx_off = w->tx_len = 0;
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    memmove(w->tx, w->tx + w->tx_off, w->tx_len - w->tx_off);
    w->tx_len -= w->tx_off;
    w->tx_off = 0;
  }
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    dt__ps_lose(S, i, DTRAIN_ERR_INTERNAL, "output buffer overflow");
    return 0;
  }
  unsigned char *h = w->tx + w->tx_len, *pl = h + DT__NET_HDR;
  if (fixn) memcpy(pl, fix, fixn);
  if (full) dt__ps_gather(S->params, S->owner, S->me, full, pl + fixn);
  dt__frame_pack(h, type, w->conn.job, w->conn.self_id, w->conn.send_seq, pl, len);
  w->conn.send_seq++;
  w->tx_len += DT__NET_HDR + len;
  w->last_sent = dt__now();
  return dt__ps_flush(S, i);
}

/* ---- checkpoints ------------------------------------------------------------------------ */

static int dt__ps_slots(const dt__ps_server *S) { return dt_optim_state_slots(S->opt); }

#  ifndef DTRAIN_NO_STDIO
static dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  unsigned char *b = S->ckpt;
  int slots = dt__ps_slots(S);
  memset(b, 0, DT__PS_CKPT_HDR);
  dt__le32_put(b, DT__PS_CKPT_MAGIC);
  dt__le32_put(b + 4, 1);
  dt__le32_put(b + 8, (uint32_t)S->me);
  dt__le32_put(b + 12, (uint32_t)S->c->servers);
  dt__le64_put(b + 16, (uint64_t)dt_params_size(S->params));
  dt__le64_put(b + 24, (uint64_t)S->shard);
  dt__le64_put(b + 32, S->layout);
  dt__le64_put(b + 40, S->version);
  dt__le64_put(b + 48, (uint64_t)dt_optim_steps(S->opt));
  dt__le32_put(b + 56, (uint32_t)slots);
  size_t off = DT__PS_CKPT_HDR;
  dt__ps_gather(S->params, S->owner, S->me, dt_params_data(S->params), b + off);
  off += S->shard * 4;
  for (int k = 0; k < slots; k++) {
    dt__ps_gather(S->params, S->owner, S->me, dt_optim_state(S->opt, k), b + off);
    off += S->shard * 4;
  }
  dt__le32_put(b + off, dt__crc32c(0, b, off));
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

/* Resume from the checkpoint when it exists: DTRAIN_OK (also when there is none). */
static dt_result dt__ps_ckpt_read(dt__ps_server *S) {
  FILE *f = fopen(S->ckpt_path, "rb");
  if (!f) return DTRAIN_OK;
  unsigned char *b = S->ckpt;
  size_t got = fread(b, 1, S->ckpt_bytes, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  const char *p = S->ckpt_path;
  if (got < DT__PS_CKPT_HDR + 4 || dt__le32_get(b) != DT__PS_CKPT_MAGIC || dt__le32_get(b + 4) != 1)
    return dt__error(DTRAIN_ERR_FORMAT, "ps %d: '%s' is not a dtrain parameter-server checkpoint", S->me, p);
  if (dt__le32_get(b + 8) != (uint32_t)S->me || dt__le32_get(b + 12) != (uint32_t)S->c->servers ||
      dt__le64_get(b + 16) != (uint64_t)dt_params_size(S->params) || dt__le64_get(b + 24) != (uint64_t)S->shard ||
      dt__le64_get(b + 32) != S->layout || dt__le32_get(b + 56) != (uint32_t)dt__ps_slots(S))
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "ps %d: checkpoint '%s' is shard %u of %u servers with %llu floats (%u optimizer slots); this "
                     "server is shard %d of %d with %zu floats (%d slots) of another layout or model",
                     S->me, p, (unsigned)dt__le32_get(b + 8), (unsigned)dt__le32_get(b + 12),
                     (unsigned long long)dt__le64_get(b + 24), (unsigned)dt__le32_get(b + 56), S->me, S->c->servers,
                     S->shard, dt__ps_slots(S));
  if (got != S->ckpt_bytes || extra || dt__le32_get(b + got - 4) != dt__crc32c(0, b, got - 4))
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' is truncated or corrupt (checksum)", S->me, p);
  S->version = dt__le64_get(b + 40);
  dt_optim_set_steps(S->opt, (int64_t)dt__le64_get(b + 48));
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
static dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "ps %d: checkpoints need stdio (built with DTRAIN_NO_STDIO)", S->me);
}
static dt_result dt__ps_ckpt_read(dt__ps_server *S) { return dt__ps_ckpt_write(S); }
#  endif

static void dt__ps_maybe_ckpt(dt__ps_server *S) {
  if (!S->ckpt) return;
  int due = (S->po.checkpoint_every > 0 && S->since_ckpt >= S->po.checkpoint_every) ||
            (S->po.checkpoint_seconds > 0 && dt__now() - S->last_ckpt >= S->po.checkpoint_seconds);
  if (due && dt__ps_ckpt_write(S) != DTRAIN_OK) {
    dt__log(DTRAIN_LOG_WARN, dt_last_result(), "%s", dt_last_error());
    S->since_ckpt = 0;
    S->last_ckpt = dt__now();
  }
}

/* ---- the staleness rule ------------------------------------------------------------------- */

static int64_t dt__ps_min_clock(const dt__ps_server *S, int pushed) {
  int64_t m = INT64_MAX;
  for (int j = 0; j < S->W; j++) {
    const dt__ps_worker *w = &S->w[j];
    if (w->state != DT__PSW_NEW && w->state != DT__PSW_LIVE) continue;
    int64_t v = pushed ? w->pushed : w->pulled;
    if (v < m) m = v;
  }
  return m;
}

static int dt__ps_can_serve(const dt__ps_server *S, int i) {
  const dt__ps_worker *w = &S->w[i];
  int64_t t = w->pend_clock, k = S->k;
  if (k < 0) return 1;
  if (w->pend == DT__PSP_PULL) return dt__ps_min_clock(S, 1) >= t - k;
  if (dt__ps_min_clock(S, 0) < t - k + 1) return 0;
  if (k == 0)
    for (int j = 0; j < i; j++) {
      const dt__ps_worker *o = &S->w[j];
      if ((o->state == DT__PSW_NEW || o->state == DT__PSW_LIVE) && o->pushed < t + 1) return 0;
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
    dt__le64_put(fix, S->version);
    dt__le64_put(fix + 8, (uint64_t)gap);
    if (w->pulled < t + 1) w->pulled = t + 1;
    w->pend = DT__PSP_NONE;
    w->last_heard = now;
    return dt__ps_queue(S, i, DT__PS_PARAMS, fix, DT__PS_FIX, dt_params_data(S->params));
  }
  uint64_t before = S->version;
  if (!w->pend_empty) {
    float *data = dt_params_data(S->params), *grad = dt_params_grad(S->params);
    const unsigned char *in = w->rx + DT__PS_FIX;
    size_t off = 0, b, e;
    int tr, dec;
    for (int p = 0; dt__params_range(S->params, p, &b, &e, &tr, &dec); p++) {
      if (S->owner[p] != S->me) continue;
      if (tr) {
        dt__ps_get_floats(grad + b, in + 4 * off, e - b);
        if (dt_optim_update(S->opt, data, grad, b, e) != DTRAIN_OK) return -1;
      } else {
        dt__ps_get_floats(data + b, in + 4 * off, e - b);
      }
      off += e - b;
    }
    dt_optim_advance(S->opt);
  }
  S->version++;
  S->since_ckpt++;
  int64_t stale = w->pend_version <= before ? (int64_t)(before - w->pend_version) : 0;
  if (w->pulled < t + 1) w->pulled = t + 1;
  w->pushed = t + 1;
  w->pend = DT__PSP_NONE;
  w->last_heard = now;
  dt__ps_maybe_ckpt(S); /* before the answer: an acknowledged update is in the checkpoint when every == 1 */
  dt__le64_put(fix, S->version);
  dt__le64_put(fix + 8, (uint64_t)stale);
  return dt__ps_queue(S, i, DT__PS_PUSHED, fix, DT__PS_FIX, NULL);
}

/* Answer every request the bound allows, until none can be answered. */
static dt_result dt__ps_progress(dt__ps_server *S) {
  for (int again = 1; again;) {
    again = 0;
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
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
 * worker's slot is free again (a correct worker may still come). */
static void dt__ps_refuse(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  unsigned char buf[4 + 256];
  size_t tl = strlen(why);
  if (tl > 256) tl = 256;
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  dt__conn_send(&w->conn, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), dt__now() + 0.2, "refuse");
  if (!S->self.opt.quiet) dt__log(DTRAIN_LOG_WARN, code, "ps %d: refused %s: %s", S->me, w->conn.peer, why);
  dt__ps_worker_free(S, w);
  dt__conn_init(&w->conn, -1, S->self.job, S->self.id, (uint32_t)S->self.opt.max_payload);
  w->state = DT__PSW_NEW;
  w->joined = 0;
  w->pulled = w->pushed = 0;
  S->seen[i] = 0;
}

static void dt__ps_on_join(dt__ps_server *S, int i, const unsigned char *b) {
  dt__ps_worker *w = &S->w[i];
  char why[DT__MSG_CAP];
  int k = (int)(int32_t)dt__le32_get(b);
  uint64_t total = dt__le64_get(b + 8), shard = dt__le64_get(b + 16), layout = dt__le64_get(b + 24);
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
  if (S->k_set && k != S->k) {
    snprintf(why, sizeof why, "it asks for max_staleness %d, the other workers for %d", k, S->k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  S->k = k;
  S->k_set = 1;
  w->rx_cap = DT__PS_FIX + S->shard * 4;
  w->tx_cap = 4 * DT__NET_HDR + 2 * DT__PS_FIX + DT__PS_JOINLEN + S->shard * 4;
  w->rx = (unsigned char *)dt__alloc(w->rx_cap);
  w->tx = (unsigned char *)dt__alloc(w->tx_cap);
  if (!w->rx || !w->tx) {
    dt__ps_refuse(S, i, DTRAIN_ERR_NOMEM, "the server is out of memory");
    return;
  }
  w->joined = 1;
  unsigned char out[DT__PS_JOINLEN];
  memset(out, 0, sizeof out);
  dt__le64_put(out, S->version);
  dt__le64_put(out + 8, (uint64_t)dt_optim_steps(S->opt));
  dt__le32_put(out + 16, (uint32_t)(int32_t)S->k);
  dt__le32_put(out + 20, (uint32_t)dt__ps_live_count(S));
  dt__le64_put(out + 24, S->layout);
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s joined (max_staleness %d)", S->me, w->conn.peer, S->k);
  dt__ps_queue(S, i, DT__PS_JOINED, out, DT__PS_JOINLEN, NULL);
}

/* Read one frame from worker i (its socket is readable). */
static void dt__ps_on_readable(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  dt__frame f;
  unsigned char h[DT__NET_HDR];
  char op[64], why[DT__MSG_CAP];
  double deadline = dt__now() + S->self.opt.timeout_s / 2;
  snprintf(op, sizeof op, "ps %d", S->me);
  dt_result rc = dt__conn_recv_header(&w->conn, &f, h, deadline, op);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, rc, why);
    return;
  }
  uint32_t want_max = 0;
  int ok_type = 1;
  switch (f.type) {
    case DT__MSG_HEARTBEAT:
    case DT__MSG_BYE: want_max = 0; break;
    case DT__PS_JOIN: want_max = DT__PS_JOINLEN; ok_type = !w->joined; break;
    case DT__PS_PULL: want_max = DT__PS_FIX; ok_type = w->joined && w->pend == DT__PSP_NONE; break;
    case DT__PS_PUSH: want_max = (uint32_t)w->rx_cap; ok_type = w->joined && w->pend == DT__PSP_NONE; break;
    default: ok_type = 0;
  }
  int exact = f.type == DT__PS_JOIN || f.type == DT__PS_PULL;
  int bad_len = f.length > want_max || (exact && f.length != want_max) ||
                (f.type == DT__PS_PUSH && f.length != DT__PS_FIX && f.length != want_max);
  if (!ok_type || bad_len) {
    snprintf(why, sizeof why, "%s: protocol violation: a frame of type 0x%02x and %u bytes %s", op, (unsigned)f.type,
             (unsigned)f.length, ok_type ? "(wrong length)" : (w->joined ? "out of turn" : "before joining"));
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  unsigned char small[DT__PS_JOINLEN];
  unsigned char *dst = f.type == DT__PS_PUSH ? w->rx : small;
  rc = dt__conn_recv_payload(&w->conn, &f, h, dst, deadline, op);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
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
      S->done++;
      dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s finished (BYE)", S->me, name);
      break;
    }
    case DT__PS_JOIN: dt__ps_on_join(S, i, small); break;
    case DT__PS_PULL:
    case DT__PS_PUSH: {
      int64_t t = (int64_t)dt__le64_get(dst);
      if (t < 0 || (f.type == DT__PS_PUSH && t < w->pushed)) {
        snprintf(why, sizeof why, "%s: protocol violation: %s for clock %lld after a push of clock %lld", op,
                 f.type == DT__PS_PUSH ? "push" : "pull", (long long)t, (long long)w->pushed - 1);
        dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
        return;
      }
      w->pend = f.type == DT__PS_PULL ? DT__PSP_PULL : DT__PSP_PUSH;
      w->pend_clock = t;
      w->pend_version = dt__le64_get(dst + 8);
      w->pend_empty = f.length == DT__PS_FIX && S->shard > 0;
      if (f.type == DT__PS_PUSH && S->shard == 0) w->pend_empty = 1;
      w->pend_since = w->last_heard;
      break;
    }
    default: break; /* heartbeat */
  }
}

/* ---- connections ------------------------------------------------------------------------------ */

static void dt__ps_drop_pending(dt__ps_server *S, int j) {
  S->pfd[j] = S->pfd[S->npend - 1];
  S->pt[j] = S->pt[S->npend - 1];
  memcpy(S->paddr[j], S->paddr[S->npend - 1], DT__NET_ADDR);
  S->npend--;
}

static void dt__ps_accept(dt__ps_server *S) {
  int fd;
  char addr[DT__NET_ADDR];
  if (dt__net_accept(S->lfd, dt__now() + 0.01, &fd, addr, sizeof addr) != DTRAIN_OK) return;
  if (S->npend == DT__PS_PENDING) {
    /* Too many silent clients: the oldest goes. */
    int old = 0;
    for (int j = 1; j < S->npend; j++)
      if (S->pt[j] < S->pt[old]) old = j;
    if (!S->self.opt.quiet)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "ps %d: refused a connection from %s: too many connections in "
              "the handshake", S->me, S->paddr[old]);
    dt__net_close(S->pfd[old]);
    dt__ps_drop_pending(S, old);
  }
  S->pfd[S->npend] = fd;
  S->pt[S->npend] = dt__now();
  snprintf(S->paddr[S->npend], DT__NET_ADDR, "%s", addr);
  S->npend++;
}

static void dt__ps_admit(dt__ps_server *S, int j) {
  int fd = S->pfd[j];
  char addr[DT__NET_ADDR];
  snprintf(addr, sizeof addr, "%s", S->paddr[j]);
  dt__ps_drop_pending(S, j);
  dt__conn c;
  if (dt__net_admit(&S->self, fd, addr, dt__now() + S->self.opt.timeout_s / 2, S->seen, &c) != DTRAIN_OK) return;
  if (c.peer_role != DTRAIN_ROLE_WORKER || S->w[c.peer_index].state != DT__PSW_NEW) {
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
  w->last_heard = w->last_sent = dt__now();
}

/* ---- the loop ----------------------------------------------------------------------------------- */

static void dt__ps_server_free(dt__ps_server *S) {
  if (S->w) {
    for (int i = 0; i < S->W; i++) dt__ps_worker_free(S, &S->w[i]);
    dt__free(S->w, (size_t)S->W * sizeof(dt__ps_worker));
  }
  for (int j = 0; j < S->npend; j++) dt__net_close(S->pfd[j]);
  S->npend = 0;
  if (S->own_lfd) dt__net_close(S->lfd);
  dt__free(S->seen, (size_t)S->W);
  dt__free(S->owner, (size_t)(S->np > 0 ? S->np : 1) * sizeof(int));
  dt__free(S->ckpt, S->ckpt_bytes);
}

static dt_result dt__ps_loop(dt__ps_server *S) {
  const double T = S->self.opt.timeout_s;
  const double start = dt__now();
  double tick = T / 8 < 0.25 ? T / 8 : 0.25;
  if (tick < 0.005) tick = 0.005;
  size_t cap = 1 + (size_t)DT__PS_PENDING + (size_t)S->W;
  struct pollfd *pf = (struct pollfd *)dt__alloc(cap * sizeof(struct pollfd));
  int *who = (int *)dt__alloc(cap * sizeof(int));
  dt_result rc = DTRAIN_OK;
  if (!pf || !who) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "dt_ps_serve: ps %d: out of memory", S->me);
    goto out;
  }
  while (dt__ps_live_count(S) > 0) {
    double now = dt__now();
    /* Deadlines: workers that never came, went silent, or stopped reading. */
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      char why[160];
      if (w->state == DT__PSW_NEW && now - start > S->self.opt.connect_timeout_s) {
        snprintf(why, sizeof why, "it did not connect within %.1f s", S->self.opt.connect_timeout_s);
        dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
      } else if (w->state == DT__PSW_LIVE) {
        if (w->tx_off < w->tx_len && now - w->last_sent > T) {
          snprintf(why, sizeof why, "it read nothing for %.1f s (deadline)", now - w->last_sent);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->pend == DT__PSP_NONE && now - w->last_heard > T) {
          snprintf(why, sizeof why, "nothing heard for %.1f s (deadline %.1f s)", now - w->last_heard, T);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->pend != DT__PSP_NONE && w->tx_off == w->tx_len && now - w->last_sent > T / 4) {
          dt__ps_queue(S, i, DT__MSG_HEARTBEAT, NULL, 0, NULL);
        }
      }
    }
    for (int j = 0; j < S->npend;) {
      if (now - S->pt[j] > T) {
        if (!S->self.opt.quiet)
          dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_TIMEOUT, "ps %d: refused a connection from %s: it sent nothing for "
                  "%.1f s", S->me, S->paddr[j], now - S->pt[j]);
        dt__net_close(S->pfd[j]);
        dt__ps_drop_pending(S, j);
      } else {
        j++;
      }
    }
    /* Losing a worker may let others go on. */
    rc = dt__ps_progress(S);
    if (rc != DTRAIN_OK || dt__ps_live_count(S) == 0) break;
    int n = 0;
    pf[n].fd = S->lfd;
    pf[n].events = POLLIN;
    who[n++] = -1;
    for (int j = 0; j < S->npend; j++) {
      pf[n].fd = S->pfd[j];
      pf[n].events = POLLIN;
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
    int pr = poll(pf, (nfds_t)n, (int)(tick * 1000.0) + 1);
    if (pr < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "dt_ps_serve: ps %d: poll: %s", S->me, strerror(errno));
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
    /* At most one handshake per round: each may block up to timeout/2 on a
     * slow client, and the workers' heartbeats go out between rounds. */
    for (int j = n - 1; j > 0; j--) {
      if (who[j] > -2 || !(pf[j].revents & (POLLIN | POLLERR | POLLHUP))) continue;
      dt__ps_admit(S, -2 - who[j]);
      break;
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
  S.me = c->index;
  S.W = c->workers;
  S.np = dt_params_count(params);
  S.k = 0;
  S.owner = (int *)dt__alloc((size_t)(S.np > 0 ? S.np : 1) * sizeof(int));
  S.w = (dt__ps_worker *)dt__calloc((size_t)S.W * sizeof(dt__ps_worker));
  S.seen = (unsigned char *)dt__calloc((size_t)S.W);
  if (!S.owner || !S.w || !S.seen) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory", fn, S.me);
    goto done;
  }
  for (int i = 0; i < S.W; i++) {
    dt__conn_init(&S.w[i].conn, -1, S.self.job, S.self.id, (uint32_t)S.self.opt.max_payload);
  }
  rc = dt_ps_shard(params, c->servers, S.owner);
  if (rc != DTRAIN_OK) goto done;
  S.shard = dt__ps_shard_floats(params, S.owner, S.me);
  S.layout = dt__ps_layout_hash(params, S.owner, S.me, c->servers);
  if (DT__PS_FIX + S.shard * 4 > S.self.opt.max_payload) {
    rc = dt__error(DTRAIN_ERR_OVERFLOW, "%s: ps %d: a shard of %zu floats exceeds max_payload (%zu bytes); use more "
                   "servers or raise it", fn, S.me, S.shard, S.self.opt.max_payload);
    goto done;
  }
  if (S.po.checkpoint_dir && S.po.checkpoint_dir[0]) {
    S.ckpt_bytes = DT__PS_CKPT_HDR + (size_t)(1 + dt__ps_slots(&S)) * S.shard * 4 + 4;
    S.ckpt = (unsigned char *)dt__alloc(S.ckpt_bytes);
    if (!S.ckpt) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory for the checkpoint buffer", fn, S.me);
      goto done;
    }
    snprintf(S.ckpt_path, sizeof S.ckpt_path, "%.900s/ps-%d-of-%d.ckpt", S.po.checkpoint_dir, S.me, c->servers);
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
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: serving %zu floats of %d parameters to %d workers", S.me, S.shard,
          S.np, S.W);
  rc = dt__ps_loop(&S);
  if (rc == DTRAIN_OK && S.ckpt) {
    rc = dt__ps_ckpt_write(&S);
  }
  if (rc == DTRAIN_OK && S.done == 0)
    rc = dt__error(DTRAIN_ERR_PEER, "%s: ps %d: every worker was lost (none finished with BYE)", fn, S.me);
done:
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
  dt__quiet_push(); /* one log line for a failure, with its whole context (warnings are logged as they happen) */
  return dt__quiet_pop(dt__ps_serve(c, params, opt, o, po));
}

/* ============================================================================================
 * The worker's store
 * ============================================================================================ */

typedef struct dt__ps_client {
  dt_pstore ps;
  dt_params *params;
  int M, me;
  double timeout;
  int *owner;
  int np;
  dt__conn *conn;
  size_t *shard;
  unsigned char **buf;
  size_t *buf_cap;
  double *last_send;
  uint64_t *pulled_version;
  uint64_t version;
  int64_t base, next;
  int left;
  dt_result err;
  char msg[DT__MSG_CAP];
  DT__ATOMIC(int) aborted;
  DT__ATOMIC(int) stop;
  dt__mutex mu;
  dt__thread hb;
} dt__ps_client;

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

/* Receive server s's answer of `type` with exactly len payload bytes into C->buf[s],
 * skipping heartbeats (each renews the deadline). */
static dt_result dt__ps_client_answer(dt__ps_client *C, int s, uint16_t type, uint32_t len, const char *op) {
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
    return dt__conn_recv_payload(&C->conn[s], &f, h, C->buf[s], deadline, op);
  }
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
  unsigned char req[DT__PS_FIX];
  dt__le64_put(req, (uint64_t)T);
  dt__le64_put(req + 8, 0);
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__conn_send(&C->conn[s], DT__PS_PULL, req, DT__PS_FIX, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
  }
  tk->version = 0;
  tk->clock_gap = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__ps_client_answer(C, s, DT__PS_PARAMS, (uint32_t)(DT__PS_FIX + C->shard[s] * 4), op);
    if (rc != DTRAIN_OK) break;
    uint64_t v = dt__le64_get(C->buf[s]);
    int64_t gap = (int64_t)dt__le64_get(C->buf[s] + 8);
    C->pulled_version[s] = v;
    if (v > tk->version) tk->version = v;
    if (v > C->version) C->version = v;
    if (gap > tk->clock_gap) tk->clock_gap = gap;
    dt__ps_scatter(C->params, C->owner, s, C->buf[s] + DT__PS_FIX, dst);
  }
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
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    unsigned char *b = C->buf[s];
    dt__le64_put(b, (uint64_t)T);
    dt__le64_put(b + 8, C->pulled_version[s]);
    size_t len = DT__PS_FIX;
    if (delta) {
      dt__ps_gather(C->params, C->owner, s, delta, b + DT__PS_FIX);
      len += C->shard[s] * 4;
    }
    rc = dt__conn_send(&C->conn[s], DT__PS_PUSH, b, (uint32_t)len, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
  }
  tk->staleness = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__ps_client_answer(C, s, DT__PS_PUSHED, DT__PS_FIX, op);
    if (rc != DTRAIN_OK) break;
    uint64_t v = dt__le64_get(C->buf[s]);
    int64_t st = (int64_t)dt__le64_get(C->buf[s] + 8);
    if (v > C->version) C->version = v;
    if (st > tk->staleness) tk->staleness = st;
  }
  if (rc == DTRAIN_OK && T + 1 > C->next) C->next = T + 1;
  if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE) rc = dt__ps_client_fail(C, rc);
  dt__mutex_unlock(&C->mu);
  tk->wait_s = dt__now() - t0;
  return rc;
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
  uint64_t v = C->version;
  dt__mutex_unlock(&C->mu);
  return v;
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
  if (C->buf)
    for (int s = 0; s < C->M; s++) dt__free(C->buf[s], C->buf_cap[s]);
  dt__free(C->buf, M * sizeof(unsigned char *));
  dt__free(C->buf_cap, M * sizeof(size_t));
  dt__free(C->conn, M * sizeof(dt__conn));
  dt__free(C->shard, M * sizeof(size_t));
  dt__free(C->last_send, M * sizeof(double));
  dt__free(C->pulled_version, M * sizeof(uint64_t));
  dt__free(C->owner, (size_t)(C->np > 0 ? C->np : 1) * sizeof(int));
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
  dt__ps_client_destroy
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
  if (C->conn)
    for (int s = 0; s < C->M; s++) C->conn[s].fd = -1;
  if (rc != DTRAIN_OK || !C->owner || !C->conn || !C->shard || !C->buf || !C->buf_cap || !C->last_send ||
      !C->pulled_version) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    goto fail;
  }
  if (dt_ps_shard(params, C->M, C->owner) != DTRAIN_OK) goto fail;
  for (int s = 0; s < C->M; s++) {
    C->shard[s] = dt__ps_shard_floats(params, C->owner, s);
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
    if (dt__net_dial(&self, DTRAIN_ROLE_PS, s, &C->conn[s]) != DTRAIN_OK) {
      C->conn[s].fd = -1;
      dt__ps_prefix(dt_last_result(), op, NULL);
      goto fail;
    }
    unsigned char j[DT__PS_JOINLEN];
    memset(j, 0, sizeof j);
    dt__le32_put(j, (uint32_t)(int32_t)max_staleness);
    dt__le64_put(j + 8, (uint64_t)dt_params_size(params));
    dt__le64_put(j + 16, (uint64_t)C->shard[s]);
    dt__le64_put(j + 24, dt__ps_layout_hash(params, C->owner, s, C->M));
    rc = dt__conn_send(&C->conn[s], DT__PS_JOIN, j, DT__PS_JOINLEN, dt__now() + C->timeout, op);
    if (rc == DTRAIN_OK && C->buf_cap[s] < DT__PS_JOINLEN) {
      unsigned char *nb = (unsigned char *)dt__alloc(DT__PS_JOINLEN);
      if (!nb) {
        dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
        goto fail;
      }
      dt__free(C->buf[s], C->buf_cap[s]);
      C->buf[s] = nb;
      C->buf_cap[s] = DT__PS_JOINLEN;
    }
    if (rc == DTRAIN_OK) rc = dt__ps_client_answer(C, s, DT__PS_JOINED, DT__PS_JOINLEN, op);
    if (rc != DTRAIN_OK) goto fail;
    uint64_t v = dt__le64_get(C->buf[s]);
    C->pulled_version[s] = v;
    if (v > C->version) C->version = v;
    C->last_send[s] = dt__now();
  }
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
  dt__quiet_push();
  dt_pstore *ps = dt__ps_store_create(c, params, o, max_staleness);
  dt__quiet_pop(ps ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return ps;
}

#  undef DT__PS_SEND_FLAGS
#  undef DT__PS_PENDING

#else /* DTRAIN_NO_NET */

DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  (void)c;
  (void)params;
  (void)opt;
  (void)o;
  (void)po;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_ps_serve: networking is not compiled in (DTRAIN_NO_NET)");
}

DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  (void)c;
  (void)params;
  (void)o;
  (void)max_staleness;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_create_tcp: networking is not compiled in (DTRAIN_NO_NET)");
  return NULL;
}

#endif /* DTRAIN_NO_NET */

#undef DT__PS_FIX
#undef DT__PS_JOINLEN
#undef DT__PS_CKPT_MAGIC
#undef DT__PS_CKPT_HDR
