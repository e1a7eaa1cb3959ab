/* ===========================================================================
 * dt_comm_tcp_core.h -- private: the TCP communicator's state, shared by its
 * start-up (dt_comm_tcp_setup.c) and its calls (dt_comm_tcp.c): one rank per
 * process, a full mesh of framed TCP connections among the workers
 * (dt_net_core.h)
 * ===========================================================================
 * Setup. Rank r dials every lower rank (0..r-1, in order) and then accepts
 * the higher ones on its listening socket until each has connected or the
 * deadline (connect_timeout_s + timeout_s from the start) passes. Anything
 * else that connects -- garbage, a wrong token, another job -- is refused by
 * the handshake (dt__net_admit logs why) and the loop keeps waiting for the
 * real peers. A socket this process bound itself, or the one the launcher
 * handed over (DTRAIN_LISTEN_FD), is closed once the mesh is up; one the
 * caller passed in dt_net_options.listen_fd stays the caller's.
 *
 * Every collective call has a sequence number (#1, #2, ... per communicator)
 * and starts with an agreement round: the ranks exchange (op, root, n, seq)
 * by recursive doubling in CALL frames (below), so every rank learns whether
 * all ranks called the same thing and returns DTRAIN_ERR_MISMATCH (the
 * communicator stays usable) when they did not. A barrier is that round only.
 *
 * All-reduce of n floats:
 *   n*4 <= small_bytes: recursive doubling over the largest power of two p
 *     <= world; ranks p..world-1 first fold their buffer into rank r-p and
 *     get the result back at the end. Each step sums its buffer with the
 *     partner's (both partners compute the same float sum, a + b == b + a),
 *     so every element is summed along the same fixed tree of ranks.
 *   larger: ring reduce-scatter then ring all-gather over the dt_comm_slice
 *     slices, each slice cut into equal parts of at most chunk_bytes that are
 *     exchanged full duplex (dt__conn_exchange: send to the next rank while
 *     receiving from the previous one). Slice j is summed in ring order
 *     starting after its owner: x[j+1] + x[j+2] + ... + x[world-1] + x[0] +
 *     ... + x[j] (indices mod world), left to right.
 * Either way the order depends only on n, world and the options, never on
 * timing: results repeat bitwise. They differ from the threads backend (rank
 * order) only by float rounding.
 * reduce_scatter / allgather: the ring halves alone (rank r ends with slice
 * r). reduce: a pipelined chain root+1 -> root+2 -> ... -> root carrying
 * partial sums (x[root+1] + ... + x[root]), so no buffer but the root's is
 * written. broadcast: a pipelined chain root -> root+1 -> ... -> root-1.
 *
 * Failure. Any transport error in a call (a peer closed or reset the
 * connection, nothing arrived before the deadline, an ABORT notice, a
 * protocol error) breaks the communicator. This rank sends an ABORT frame
 * carrying its error to every peer, then listens for up to a grace period
 * (a quarter of timeout_s, at most 2 s) for the other ranks' ABORT frames:
 * the peers that closed their connection are dead, the ones that neither
 * aborted nor closed are stalled, and the error names them:
 *   "worker 0: allreduce #57: worker 2 (127.0.0.1:40123) closed the connection"
 *   "worker 0: allreduce #57: worker 2 (127.0.0.1:40123) sent nothing before the deadline (stalled?)"
 * so every surviving rank names the lost one, not the neighbour it was
 * waiting on. Later calls return DTRAIN_ERR_ABORTED. dt_comm_recover cannot
 * repair a TCP communicator (DTRAIN_ERR_UNSUPPORTED): destroy it, restart
 * the processes and resume from the last checkpoint.
 *
 * Wire messages of this backend (docs/wire_protocol.md), all little-endian:
 *   0x40 CALL  88 bytes: u32 first_rank, u32 bad_rank (0xffffffff: none),
 *              then two 40-byte call records (the first rank's and a
 *              differing one's), each u32 op, u32 root, u64 n, u64 seq,
 *              u32 chunk (floats per part), u32 small_bytes, 4 bytes: the
 *              sender's in-memory bytes of the integer 0x01020304 (04 03 02
 *              01 on little-endian hosts), u32 reserved (0); ops: 1
 *              allreduce, 2 reduce_scatter, 3 allgather, 4 reduce,
 *              5 broadcast, 6 barrier
 *   0x41 SUM   IEEE-754 float32 in the sender's byte order (ranks of
 *              another byte order are refused by the CALL round): partial sums (recursive doubling, ring reduce-scatter,
 *              reduce chain)
 *   0x42 COPY  floats: final values (fold-back, ring all-gather, broadcast)
 * BYE (0x08) is sent to every peer by destroy.
 */
#ifndef DTRAIN_COMM_TCP_CORE_H
#define DTRAIN_COMM_TCP_CORE_H

#include "dt_internal.h"
#include "dt_net_core.h"
#include "dt_platform.h"

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  if !defined(_WIN32)
#    include <poll.h>
#  endif

enum {
  DT__TCP_MSG_CALL = DT__MSG_DATA0,
  DT__TCP_MSG_SUM = DT__MSG_DATA0 + 1,
  DT__TCP_MSG_COPY = DT__MSG_DATA0 + 2,
  DT__TCP_MSG_P2P = DT__MSG_DATA0 + 3 /* a point-to-point message's frame (dt_comm_tcp_p2p.c) */
};

typedef struct dt__p2p_msg dt__p2p_msg;
typedef struct dt__p2p_peer dt__p2p_peer;

enum {
  DT__TCP_OP_ALLREDUCE = 1,
  DT__TCP_OP_REDUCE_SCATTER,
  DT__TCP_OP_ALLGATHER,
  DT__TCP_OP_REDUCE,
  DT__TCP_OP_BROADCAST,
  DT__TCP_OP_BARRIER
};

#  define DT__TCP_CALL_BYTES 88
#  define DT__TCP_NONE 0xFFFFFFFFu
/* All-reduces of at most this many bytes (and at most small_bytes) travel
 * inside the agreement round's CALL frames: one round of messages, not two. */
#  define DT__TCP_FUSED_MAX 16384

/* Per-peer state after a failure. */
enum { DT__TCP_P_UNKNOWN = 0, DT__TCP_P_ALIVE, DT__TCP_P_DEAD, DT__TCP_P_SILENT };

typedef struct dt__comm_tcp {
  dt_comm comm;
  dt__net_self self;
  dt__conn *conns; /* world entries; conns[rank].fd == -1 */
  size_t conns_bytes;
  /* With 2 workers the ring's two directions would share one socket, whose
   * lock then serialises this rank's sends with the processing of what the
   * peer sends: a second connection (lane 1) carries worker 1 -> worker 0
   * ring traffic, conns[] (lane 0) worker 0 -> worker 1 and everything else.
   * On loopback that took 1-4 MiB all-reduces from ~3 to ~4-5.5 GB/s. */
  dt__conn lane2;  /* fd -1 unless lanes == 2 */
  int lanes;
  unsigned char *peer_state; /* world entries, used by the failure path */
  struct pollfd *pfd;        /* world entries, used by the failure path */
  int *pidx;
  float *scratch;            /* receive buffer: max(chunk, small) bytes */
  size_t scratch_bytes;
  unsigned char *fout, *fin; /* CALL frames with a fused all-reduce: CALL_BYTES + fused_max each */
  float *fkeep;              /* the caller's buffer before a fused all-reduce (restored on mismatch) */
  size_t fused_max;          /* bytes of data a CALL frame may carry */
  size_t chunk_floats, small_bytes;
  double timeout_s;
  uint64_t seq;
  int broken;
  dt_comm_stats st;
  char op[96]; /* "worker 0: allreduce #57" for the current call */
  /* Point-to-point (dt_comm_tcp_p2p.c). */
  dt__p2p_peer *pp;       /* world entries, made on first use */
  size_t pp_bytes;
  dt_comm_request *posted; /* receives not yet matched, FIFO */
  dt__p2p_msg *unexp;     /* messages that came before their receive, FIFO */
  int queued;             /* sends in the peers' queues */
  uint64_t splits, p2p_seq;
} dt__comm_tcp;

typedef struct dt__tcp_call {
  uint32_t op, root;
  uint64_t n, seq;
  uint32_t chunk, small; /* the algorithm's options: chunk floats, small_bytes */
  unsigned char order[4]; /* the sender's in-memory bytes of 0x01020304: floats travel in host order */
} dt__tcp_call;

/* The communicator's function table (dt_comm_tcp.c). */
DTRAIN_PRIVATE const dt_comm_vtable *dt__tcp_vtable(void);
DTRAIN_PRIVATE const dt_comm_p2p_vtable *dt__tcp_p2p_vtable(void);
/* Close every connection and free t and everything it holds (dt_comm_tcp.c). */
DTRAIN_PRIVATE void dt__tcp_free(dt__comm_tcp *t);
/* Called with the thread's error set by a failing transport call: breaks the
 * communicator, tells every peer, and rewrites the error to name the lost
 * ranks (dt_comm_tcp_fail.c). */
DTRAIN_PRIVATE dt_result dt__tcp_fail(dt__comm_tcp *t, dt_result rc);

/* Point-to-point and groups (dt_comm_tcp_p2p.c): the vtable's calls; the
 * collectives' first step (every queued send out; a failure breaks t); the
 * connections' hook for P2P frames met by a collective; freeing. */
DTRAIN_PRIVATE dt_result dt__tcp_isend(dt_comm *c, int rank, int dst, int tag, const float *buf, size_t n,
                                       dt_comm_request **req);
DTRAIN_PRIVATE dt_result dt__tcp_irecv(dt_comm *c, int rank, int src, int tag, float *buf, size_t n,
                                       dt_comm_request **req);
DTRAIN_PRIVATE dt_result dt__tcp_wait(dt_comm *c, dt_comm_request *r);
DTRAIN_PRIVATE dt_result dt__tcp_split(dt_comm *c, int rank, int color, int key, dt_comm **out, int *out_rank);
DTRAIN_PRIVATE dt_result dt__tcp_p2p_flush(dt__comm_tcp *t);
DTRAIN_PRIVATE void dt__tcp_p2p_hook(dt__comm_tcp *t);
DTRAIN_PRIVATE void dt__tcp_p2p_free(dt__comm_tcp *t);

#endif /* !DTRAIN_NO_NET && !DTRAIN_NO_THREADS */

#endif /* DTRAIN_COMM_TCP_CORE_H */
