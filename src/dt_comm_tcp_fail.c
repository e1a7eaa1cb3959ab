/* ===========================================================================
 * dt_comm_tcp_fail.c -- the TCP communicator's failure path: break the
 * communicator, tell every peer, listen for their notices and name the lost
 * rank (see "Failure" in dt_comm_tcp_core.h); used by the collectives
 * (dt_comm_tcp.c) and the point-to-point messages (dt_comm_tcp_p2p.c)
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
#include "dt_comm_tcp_core.h"

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#  endif

/* ---- the failure path ----------------------------------------------------------------- */

/* Index of the peer whose description ends `text` before `upto` (or appears in
 * text when upto is NULL), -1 if none. */
static int dt__tcp_find_peer(const dt__comm_tcp *t, const char *text, const char *upto) {
  int best = -1;
  size_t best_at = 0;
  for (int j = 0; j < t->comm.world; j++) {
    if (j == t->comm.rank) continue;
    const char *name = t->conns[j].peer;
    size_t nl = strlen(name);
    if (nl == 0) continue;
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name)) {
      if (upto && p + nl > upto) break;
      size_t at = (size_t)(p - text);
      /* The last mention before `upto` (the aborting peer), else the first mention. */
      if (best < 0 || (upto ? at > best_at : at < best_at)) {
        best = j;
        best_at = at;
      }
    }
  }
  return best;
}

/* Listen for the other ranks' ABORT frames (or EOF) for up to `grace` seconds. */
static void dt__tcp_collect(dt__comm_tcp *t, double grace) {
  int world = t->comm.world;
  double end = dt__now() + grace;
  struct pollfd *pf = t->pfd;
  int *idx = t->pidx;
  for (;;) {
    int np = 0;
    for (int j = 0; j < world; j++) {
      if (j == t->comm.rank || t->conns[j].fd < 0 || t->peer_state[j] != DT__TCP_P_UNKNOWN) continue;
      pf[np].fd = t->conns[j].fd;
      pf[np].events = POLLIN;
      pf[np].revents = 0;
      idx[np++] = j;
    }
    if (np == 0) return;
    double left = end - dt__now();
    if (left <= 0) return;
    int k = dt__sock_poll(pf, (nfds_t)np, (int)(left * 1000.0) + 1);
    if (k <= 0) continue; /* timeout (loop ends) or EINTR */
    for (int q = 0; q < np; q++) {
      if (!pf[q].revents) continue;
      int j = idx[q];
      dt__conn *c = &t->conns[j];
      dt__frame f;
      unsigned char h[DT__NET_HDR];
      memset(&f, 0, sizeof f);
      dt_result rc = dt__conn_recv_header(c, &f, h, dt__now() + 0.5, "drain");
      if (rc == DTRAIN_OK) {
        if (f.type == DT__MSG_BYE) {
          t->peer_state[j] = DT__TCP_P_DEAD;
        } else if ((size_t)f.length <= t->scratch_bytes) {
          /* A data frame still in flight: skip it. */
          if (dt__conn_recv_payload(c, &f, h, t->scratch, dt__now() + 0.5, "drain") != DTRAIN_OK)
            t->peer_state[j] = DT__TCP_P_ALIVE;
        } else {
          t->peer_state[j] = DT__TCP_P_ALIVE;
        }
      } else if (f.type == DT__MSG_ABORT || f.type == DT__MSG_REFUSE || rc == DTRAIN_ERR_PROTOCOL ||
                 rc == DTRAIN_ERR_MISMATCH) {
        t->peer_state[j] = DT__TCP_P_ALIVE; /* it spoke: not the lost one */
      } else if (rc == DTRAIN_ERR_PEER) {
        t->peer_state[j] = DT__TCP_P_DEAD;
      } /* a timeout mid-frame: leave it unknown */
    }
  }
}

/* Called with the thread's error set by the failing transport call. Breaks
 * the communicator, tells every peer, finds the lost ranks, and rewrites the
 * error to name them. */
DTRAIN_PRIVATE dt_result dt__tcp_fail(dt__comm_tcp *t, dt_result rc) {
  int world = t->comm.world;
  char first[DT__MSG_CAP];
  snprintf(first, sizeof first, "%s", dt_last_error());
  t->broken = 1;
  for (int j = 0; j < world; j++) t->peer_state[j] = DT__TCP_P_UNKNOWN;
  /* What the first error says about one peer. */
  const char *ab = strstr(first, " aborted: ");
  int who = dt__tcp_find_peer(t, first, ab);
  if (who >= 0) {
    if (ab) t->peer_state[who] = DT__TCP_P_ALIVE;
    else if (rc == DTRAIN_ERR_PEER) t->peer_state[who] = DT__TCP_P_DEAD;
  }
  /* Tell everyone, then listen for the others' notices. */
  for (int j = 0; j < world; j++)
    if (j != t->comm.rank && t->conns[j].fd >= 0 && t->peer_state[j] != DT__TCP_P_DEAD)
      dt__conn_abort(&t->conns[j], rc, first);
  if (t->lane2.fd >= 0 && t->peer_state[1 - t->comm.rank] != DT__TCP_P_DEAD) /* it may be waiting on lane 1 */
    dt__conn_abort(&t->lane2, rc, first);
  /* A peer's dt_comm_abort: the program decided, nobody was lost. */
  if (ab && strstr(ab, "(dt_comm_abort)")) return dt__error(DTRAIN_ERR_ABORTED, "%s", first);
  if (rc != DTRAIN_ERR_MISMATCH && rc != DTRAIN_ERR_PROTOCOL) {
    double grace = t->timeout_s * 0.25;
    dt__tcp_collect(t, grace > 2.0 ? 2.0 : grace);
  }
  /* Name the lost ranks: the dead first, else the silent ones. */
  char names[DT__MSG_CAP];
  size_t used = 0;
  int dead = 0, silent = 0;
  names[0] = '\0';
  for (int pass = 0; pass < 2 && used == 0; pass++) {
    for (int j = 0; j < world; j++) {
      if (j == t->comm.rank) continue;
      int st = t->peer_state[j];
      if (pass == 0 ? st != DT__TCP_P_DEAD : st != DT__TCP_P_UNKNOWN) continue;
      int k = snprintf(names + used, sizeof names - used, "%s%.95s", used ? ", " : "", t->conns[j].peer);
      if (k < 0 || (size_t)k >= sizeof names - used) break;
      used += (size_t)k;
      if (pass == 0) dead++;
      else silent++;
    }
  }
  if (dead)
    return dt__error(DTRAIN_ERR_PEER, "%.90s: %.200s closed the connection", t->op, names);
  if (silent)
    return dt__error(DTRAIN_ERR_TIMEOUT, "%.90s: %.200s sent nothing before the deadline (stalled?)", t->op, names);
  return dt__error(rc, "%s", first);
}

#endif /* !DTRAIN_NO_NET && !DTRAIN_NO_THREADS */
