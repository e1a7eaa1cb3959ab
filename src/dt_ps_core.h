/* ===========================================================================
 * dt_ps_core.h -- private: the parameter servers' shared parts: message
 * types, the shard's layout and bytes (dt_ps_shard.c), the server's state
 * (dt_ps_server.c, dt_ps_ckpt.c); the worker's store is dt_ps_client.c
 * ===========================================================================
 * The server is one thread running a poll loop over its listening socket,
 * connections still in the handshake and one connection per worker. It
 * never waits for one worker: a worker's frame is read piecewise as its
 * socket has bytes (header, checked at once, then payload) and handled when
 * whole, and one not whole timeout_s after its first byte drops that worker;
 * it never blocks on a send either (each worker has an output buffer
 * flushed as its socket takes it), and answers requests when the staleness
 * bound allows: a request that must wait stays pending, and the server
 * sends that worker a heartbeat every timeout_s/4 so it knows the server
 * lives. The SSP rule is the one of the in-process store (dt_strategy.c):
 *
 *   pull for clock t:  every live worker pushed clock t-k-1 (pushed >= t-k)
 *   push of clock t:   every live worker pulled clock t-k   (pulled >= t-k+1)
 *                      and, when k = 0, every live worker j < w pushed t
 *
 * where "live" means not yet gone (BYE) or lost; until the quorum (every
 * worker, or dt_ps_options.min_workers of them, joined once) a worker not
 * yet connected or joined counts with clocks 0 (others wait for it, within
 * the bound); after it, only joined workers count. A worker that (re)joins
 * starts at the clock of the slowest counting worker, or at its own last
 * push when it was ahead (JOINED says both); its first request may be for
 * any clock from there (the worker takes the largest over its servers).
 *
 * Messages (after the transport handshake; little-endian):
 *   JOIN   0x50 w->s  32 B: i32 max_staleness, u32 0, u64 params floats,
 *                            u64 shard floats, u64 layout hash
 *   JOINED 0x51 s->w  48 B: u64 version, i64 optimizer steps, i32 max_staleness,
 *                            u32 live workers, u64 layout hash, u64 start clock,
 *                            u64 steps done (pushes of this rank before; 0 on a first join)
 *   PULL   0x52 w->s  16 B: u64 clock, u64 0
 *   PARAMS 0x53 s->w  16 B + 4*shard: u64 version, i64 clock gap, f32[shard]
 *   PUSH   0x54 w->s  16 B (+ 4*shard): u64 clock, u64 version pulled, f32[shard]
 *                            (no floats: an empty push that only advances the clock)
 *   PUSHED 0x55 s->w  16 B: u64 version after, i64 staleness
 *                            (aggregate: the version now; 0 held in the open round,
 *                            -1 - staleness dropped as late; see dt_ps_apply.c)
 *   TAKE   0x56 w->s   0 B: the next work item, please (server 0 only; dt_pstore_take)
 *   TAKEN  0x57 s->w  16 B: i64 item (>= 0; -1: every item done; -2: no queue here;
 *                            -3: every item left is held by others, ask again), u64 items done
 * Work queue (server 0 with dt_ps_options.work_items): an item handed out is
 * held by its worker until the worker's next PUSH, whose application marks
 * it done (one frame: done exactly once); a worker lost or gone (BYE) first
 * gives it back, to the next TAKE. A TAKE is answered at once (-3 rather
 * than waiting: a worker waiting for server 0 would send the other servers
 * nothing, not even heartbeats, and they would drop it).
 * Compressed (dt_ps_codec.c; the worker's dt_pstore.compress):
 *   PULL's second word asks how the weights come: 0 floats (PARAMS); 1 floats
 *     (PARAMS) and keep them as this worker's copy; 2 / 3 the difference from
 *     that copy in fp16 / bf16 (PARAMZ; only after a 1 since the join)
 *   PARAMZ 0x59 s->w  24 B + 2*shard: u64 version, i64 clock gap, u32 kind (1 fp16,
 *                            2 bf16), i32 fp16 scale exponent (bf16: 0), u16[shard]
 *   PUSHZ  0x58 w->s  24 B + body: u64 clock, u64 version pulled, u32 kind (1 fp16,
 *                            2 bf16, 3 topk, 4 powersgd), u32 argument (fp16's exponent,
 *                            topk's count of values, powersgd's rank), then the trained
 *                            values as the kind has them, then the buffers as f32
 * Early pushes (the worker's dt_strategy_options.push_early): a push sent in
 * parts while backward goes on, the shard's floats from the end down:
 *   PUSHP  0x5A w->s  32 B + 4*count: u64 clock, u64 version pulled, u64 offset
 *                            (floats into the shard), u64 flags (1 last: the push is
 *                            whole, a PUSH of clock; 2 with 1: discard the parts, an
 *                            empty push; 4 alone: abandon the parts, no push), f32[count]
 *   The first part ends at the shard's end, each next one where the one before
 *   began, the last at 0; all of one push carry the same clock and version;
 *   discard and abandon carry no floats and offset 0. Nothing is applied
 *   before the last part; until it (or an abandon) comes the worker may send
 *   nothing but parts, heartbeats and BYE. The last part is answered PUSHED
 *   as a PUSH is. The server gathers the parts into the push's buffer.
 *   HEARTBEAT (0x07) both ways, BYE (0x08) w->s, REFUSE (0x05) s->w.
 * The shard's floats are its parameters' elements in parameter order.
 */
#ifndef DTRAIN_PS_CORE_H
#define DTRAIN_PS_CORE_H

#include "dt_internal.h"
#include "dt_strategy.h"
#include "dt_net_core.h"
#include "dt_platform.h"

enum {
  DT__PS_JOIN = 0x50,
  DT__PS_JOINED = 0x51,
  DT__PS_PULL = 0x52,
  DT__PS_PARAMS = 0x53,
  DT__PS_PUSH = 0x54,
  DT__PS_PUSHED = 0x55,
  DT__PS_TAKE = 0x56,
  DT__PS_TAKEN = 0x57,
  DT__PS_PUSHZ = 0x58,
  DT__PS_PARAMZ = 0x59,
  DT__PS_PUSHP = 0x5A
};
/* PUSHP's flags (see above) */
enum { DT__PS_PART_LAST = 1, DT__PS_PART_DISCARD = 2, DT__PS_PART_ABANDON = 4 };
/* PULL's second word (see above) */
enum { DT__PS_PULL_FLOATS = 0, DT__PS_PULL_KEEP = 1, DT__PS_PULL_FP16 = 2, DT__PS_PULL_BF16 = 3 };
#define DT__PS_ZFIX 24  /* fixed part of PUSHZ, PARAMZ */
#define DT__PS_FIX 16   /* fixed part of PULL, PARAMS, PUSH, PUSHED */
#define DT__PS_PFIX 32  /* fixed part of PUSHP */
#define DT__PS_JOINLEN 32   /* JOIN */
#define DT__PS_JOINEDLEN 48 /* JOINED */

/* Prefix the thread's last error (copied first: dt__error writes the buffer dt_last_error reads). */
static DT__UNUSED dt_result dt__ps_prefix(dt_result rc, const char *a, const char *b) {
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  if (b) return dt__error(rc, "%s: %s: %s", a, b, keep);
  return dt__error(rc, "%s: %s", a, keep);
}

/* ---- the shard (dt_ps_shard.c; also without networking) ----------------------------------- */
#if !defined(DTRAIN_NO_DIST)
/* Floats of server s's shard (owner: dt_ps_shard's assignment). */
DTRAIN_PRIVATE size_t dt__ps_shard_floats(const dt_params *p, const int *owner, int s);
/* FNV-1a over the shard's parameter ranges, the params' size and the server count. */
DTRAIN_PRIVATE uint64_t dt__ps_layout_hash(const dt_params *p, const int *owner, int s, int servers);
/* The shard of a full-layout buffer to little-endian bytes, and back. */
DTRAIN_PRIVATE void dt__ps_gather(const dt_params *p, const int *owner, int s, const float *full, unsigned char *out);
DTRAIN_PRIVATE void dt__ps_scatter(const dt_params *p, const int *owner, int s, const unsigned char *in, float *full);
#  if !defined(DTRAIN_NO_NET)
/* Shard s of full as pieces where its floats lie (the shard's order; the
 * floats are their wire bytes on a little-endian host): one iovec per
 * non-empty parameter of s into iov (room for the params' count). Returns
 * the count. */
DTRAIN_PRIVATE int dt__ps_pieces(const dt_params *p, const int *owner, int s, const float *full, struct iovec *iov);
#  endif
/* The same between a full-layout buffer and floats in shard order: out != 0 copies
 * full's shard into shard, else shard back into full (compressed pulls' copies). */
DTRAIN_PRIVATE void dt__ps_shard_copy(const dt_params *p, const int *owner, int s, float *full, float *shard, int out);

/* ---- compressed pushes and pulls (dt_ps_codec.c) ---- */
struct dt__ef;
/* The largest PUSHZ payload for server s's shard (any kind). */
DTRAIN_PRIVATE size_t dt__ps_pushz_cap(const dt_params *p, const int *owner, int s);
/* Server s's PUSHZ payload (from its 16th byte on; the caller writes the
 * first 16) of push vector g compressed as c (fp16/bf16: ef NULL; topk,
 * powersgd: ef after dt__ef_local of g). Returns the payload's bytes. */
DTRAIN_PRIVATE size_t dt__ps_encode_push(dt_compress c, const struct dt__ef *ef, const dt_params *p, const int *owner,
                                         int s, const float *g, unsigned char *out);
/* A PUSHZ payload of len bytes for shard s, checked, into grad (trained
 * parameters) and data (buffers); scratch grows as PowerSGD needs.
 * DTRAIN_ERR_PROTOCOL naming what is wrong (nothing is applied then; grad may
 * be written). */
DTRAIN_PRIVATE dt_result dt__ps_decode_push(const dt_params *p, const int *owner, int s, const unsigned char *in,
                                            size_t len, float *grad, float *data, float **scratch, size_t *scap);
/* PARAMZ's body (from its 16th byte: 8 + 2 x shard bytes): shard s of full
 * minus view (shard order) in 16 bits of kind; view += the decoded values. */
DTRAIN_PRIVATE void dt__ps_delta_encode(dt_compress_kind kind, const dt_params *p, const int *owner, int s,
                                        const float *full, float *view, unsigned char *out);
/* The worker's side: view (n floats, shard order) += the decoded values. */
DTRAIN_PRIVATE dt_result dt__ps_delta_apply(dt_compress_kind kind, const unsigned char *in, float *view, size_t n);
#endif /* DTRAIN_NO_DIST */

#if !defined(DTRAIN_NO_NET)
/* ---- the server's state (dt_ps_server.c) ----------------------------------------------------- */

enum { DT__PSW_NEW = 0, DT__PSW_LIVE, DT__PSW_DONE, DT__PSW_LOST };
enum { DT__PSP_NONE = 0, DT__PSP_PULL, DT__PSP_PUSH };

typedef struct dt__ps_worker {
  int state;
  int joined;
  dt__conn conn;
  int64_t pulled, pushed;   /* clocks: pulls / pushes made */
  int64_t npushed;          /* pushes of this rank applied, over all its (re)joins: JOINED's steps
                               done (the clocks jump to the slowest's at a rejoin: not a count) */
  int ever;                 /* it joined once (counted in the quorum) */
  int fresh;                /* (re)joined, no request yet: the first one sets its clocks */
  int64_t start;            /* the clock it (re)joined at */
  double lost_at;           /* when it was lost (DT__PSW_LOST) */
  int pend;                 /* DT__PSP_* */
  int64_t pend_clock;
  uint64_t pend_version;
  int pend_empty;
  double pend_since;
  double last_heard;        /* last frame from it, or our last answer */
  double last_sent;
  unsigned char *rx, *tx;
  size_t rx_cap, tx_cap, tx_len, tx_off;
  /* The frame coming in, read as the socket allows (never waited for): */
  unsigned char in_h[DT__NET_HDR];
  unsigned char in_small[DT__NET_NOTICE_MAX]; /* every payload but a PUSH's (that goes to rx) */
  dt__frame in_f;           /* its header, checked, once in_len >= DT__NET_HDR */
  unsigned char *in_dst;    /* where its payload goes */
  size_t in_len;            /* bytes of it so far (0: none) */
  double in_started;        /* when its first byte came */
  int64_t lease;            /* work queue: the item it holds until its next push (-1: none) */
  int pend_mode;            /* a pull: DT__PS_PULL_* */
  int pend_z;               /* a push: compressed (PUSHZ), pend_len bytes in rx */
  size_t pend_len;
  float *view;              /* compressed pulls: the weights this worker holds (shard floats) */
  int view_ok;              /* ... set by a DT__PS_PULL_KEEP since its join */
  /* A push coming in parts (PUSHP): each read into rxp, its floats copied to rx */
  unsigned char *rxp;       /* (made at its first part: DT__PS_PFIX + shard floats) */
  int parting;              /* parts came, not yet the last: rx holds floats [part_lo, shard) */
  size_t part_lo;
  int64_t part_clock;
  uint64_t part_version;
  /* dt_ps_options.aggregate: a push waiting for its round to close (dt_ps_apply.c) */
  int held;                 /* its push is in the open round (hrx), its next pull waits for the close */
  unsigned char *hrx;       /* the held push: the shard's floats, little-endian (made at its first) */
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
  float *before;            /* staleness_lr: a parameter's values before its update (shard floats) */
  size_t zcap;              /* the largest compressed push (dt__ps_pushz_cap) */
  struct iovec *iov;        /* np + 1: a PARAMS frame's pieces, sent from where they lie (dt__ps_queue) */
  float *zscratch;          /* PowerSGD's factors while a push is decoded */
  size_t zscratch_cap;
  char ckpt_path[1024];
  dt__hs *pend;             /* DT__NET_PENDING_MAX connections in the handshake, beside the serving */
  int npend;
  int done;
  int need;                 /* the quorum: workers that must join before the clocks ignore the rest */
  int joined;               /* distinct workers that joined at least once */
  int quorum;               /* sticky: reached, or the connect deadline passed */
  double start;             /* when serving began */
  /* the work queue (server 0 with po.work_items > 0) */
  int64_t *q_back;          /* items given back, handed out first (at most one per worker); NULL: no queue */
  int q_nback;
  int64_t q_next;           /* items below were handed out at least once */
  dt_ps_work_stats q;       /* items, done, handed_out, returned */
  /* dt_ps_options.aggregate (dt_ps_apply.c) */
  int agg;                  /* R: a round closes with the first R pushes computed on its version [0: off] */
  int nheld;                /* pushes held in the open round (a gone worker's too) */
  float *agg_sum;           /* the round's sum, full layout (dt_params_size floats) */
  int64_t rounds, dropped;  /* rounds closed; pushes dropped as late */
  int64_t held_total;       /* pushes held (in rounds closed or open) */
} dt__ps_server;

/* Does worker w count in the staleness rule (and may it add a push to a
 * round)? Before the quorum every worker not gone does (clocks 0 until it
 * joins); after it, joined ones only. */
static inline int dt__ps_counts(const dt__ps_server *S, const dt__ps_worker *w) {
  if (w->state == DT__PSW_LIVE && w->joined) return 1;
  return !S->quorum && (w->state == DT__PSW_NEW || w->state == DT__PSW_LIVE);
}

/* ---- what a push does to the shard (dt_ps_apply.c) ---------------------------------------------- */
/* Apply worker i's pending push (not empty; its frame in rx) as one optimizer
 * step (staleness_lr scales it). 1: applied; -1: a compressed push that does
 * not decode (dt_last_error; nothing applied: drop the worker); -2: the
 * optimizer failed (stops the server). */
DTRAIN_PRIVATE int dt__ps_apply(dt__ps_server *S, int i);
/* dt_ps_options.aggregate checked against the others, S->agg set and its sum made. */
DTRAIN_PRIVATE dt_result dt__ps_agg_setup(dt__ps_server *S, const char *fn);
/* Synchronous rounds (aggregate, see dt_ps_apply.c): */
/* Worker i's pending push (its frame in rx), with aggregate: held in the
 * open round (its floats copied to hrx, a compressed one decoded there) or,
 * computed on an older version than the shard's, dropped as late (its round
 * closed without it); *stale gets the versions it is behind. 1: held; 0:
 * dropped, or empty (a skipped step); -1: it does not decode or memory ran
 * out (dt_last_error says which; nothing is held). */
DTRAIN_PRIVATE int dt__ps_agg_hold(dt__ps_server *S, int i, int64_t *stale);
/* May the open round close? It holds R pushes, or some and no worker that
 * counts (dt__ps_counts) can add one. */
DTRAIN_PRIVATE int dt__ps_agg_due(const dt__ps_server *S);
/* Close the open round: the held pushes summed in rank order and averaged,
 * one optimizer step (buffers: their mean), version + 1; the workers' pulls
 * may go. DTRAIN_OK, or the optimizer's error (which stops the server). */
DTRAIN_PRIVATE dt_result dt__ps_agg_close(dt__ps_server *S);
/* Worker w's buffers are freed (lost, BYE): a held push stays in the round
 * (it was answered: it counts); hrx is freed at the close. */
DTRAIN_PRIVATE void dt__ps_agg_free(dt__ps_server *S, dt__ps_worker *w);

/* ---- pushes in parts (dt_ps_parts.c) ---------------------------------------------------------- */
/* A push whose parts are all in: a PUSH of this clock and version, of length
 * bytes (DT__PS_FIX + the shard's floats, in rx; DT__PS_FIX: discarded, empty). */
typedef struct dt__ps_whole {
  int64_t clock;
  uint64_t version;
  uint32_t length;
} dt__ps_whole;
/* Worker w's PUSHP of len bytes at p (its length already a multiple of 4
 * past DT__PS_PFIX, at most the shard's), checked against the parts before
 * it, its floats gathered into w->rx. 1: the push is whole (*whole says
 * which); 0: taken (or the parts abandoned); -1: a protocol violation,
 * why (cap bytes) names it, prefixed with op. */
DTRAIN_PRIVATE int dt__ps_part(dt__ps_worker *w, size_t shard, const unsigned char *p, uint32_t len, const char *op,
                               dt__ps_whole *whole, char *why, size_t cap);

/* ---- shard checkpoints (dt_ps_ckpt.c) -------------------------------------------------------- */
/* Bytes of S's checkpoint file (and of S->ckpt, the buffer it is built in). */
DTRAIN_PRIVATE size_t dt__ps_ckpt_size(const dt__ps_server *S);
/* Write S's shard, version and optimizer state to S->ckpt_path (through a temporary file). */
DTRAIN_PRIVATE dt_result dt__ps_ckpt_write(dt__ps_server *S);
/* Resume from the checkpoint when it exists: DTRAIN_OK (also when there is none). */
/* Before serving: can a checkpoint be written at S->ckpt_path? (creates and
 * removes the temporary the first save would; DTRAIN_ERR_IO naming the
 * directory otherwise, so a bad checkpoint_dir fails before the first step,
 * not after training when the shard would be lost) */
DTRAIN_PRIVATE dt_result dt__ps_ckpt_check_dir(dt__ps_server *S, const char *fn);
DTRAIN_PRIVATE dt_result dt__ps_ckpt_read(dt__ps_server *S);
/* Write one when checkpoint_every / checkpoint_seconds says it is due (a failure is logged, not returned). */
DTRAIN_PRIVATE void dt__ps_maybe_ckpt(dt__ps_server *S);

/* ---- the client (dt_ps_client.c): a worker's dt_pstore over the servers ------------------------ */
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
  uint64_t *pulled_version; /* per server: the version of the last pull (the next push says it) */
  uint64_t *basis_version;  /* ... of the pull before it (dt__ps_client_push_basis) */
  uint64_t *heard_version;  /* per server: the last version it said (a pull's, a push's answer) */
  int64_t pulled_clock;     /* the last pull's clock (absolute), -1: none since the join */
  int64_t basis;            /* the next push was computed on the pull of this clock (absolute); -1: the last */
  uint64_t version;
  int64_t base, next;
  int queue;               /* it took a work item: each push asks for the next one too */
  int have_item;           /* ... and got it: the next take returns item */
  int64_t item;
  int left;
  /* compression (dt_pstore.compress, set up by dt__ps_client_codec) */
  dt_compress zc;          /* the form in use */
  struct dt__ef *ef;       /* top-k / PowerSGD: the error kept for the next push */
  float **view;            /* per server: its shard as this worker holds it (compressed pulls) */
  int *view_ok;            /* ... started by a pull that kept a copy */
  /* float pushes and pulls on a little-endian host go from and to the
   * params' layout where they lie: a frame's pieces (dt__ps_client_parts) */
  struct iovec *iov, *iov_scratch; /* np + 2 entries each */
  /* a push in parts (dt__ps_client_push_part): sent so far, the floats of
   * each server's shard from part_lo[s] on (part_lo[s] = shard[s]: none) */
  size_t *part_lo;
  int parting;
  int64_t part_T;          /* ... of this push (absolute clock) */
  dt_result err;
  char msg[DT__MSG_CAP];
  DT__ATOMIC(int) aborted;
  DT__ATOMIC(int) stop;
  dt__mutex mu;
  dt__thread hb;
} dt__ps_client;

#endif /* DTRAIN_NO_NET */

#endif /* DTRAIN_PS_CORE_H */
