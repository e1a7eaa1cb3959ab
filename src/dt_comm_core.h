/* ===========================================================================
 * dt_comm_core.h -- private: what the communicator backends share for
 * point-to-point messages and groups: the request, the tags the library
 * keeps for itself, and the group communicator built from point-to-point
 * messages (dt_comm_group.c), which the TCP backend's groups are
 * ===========================================================================
 */
#ifndef DTRAIN_COMM_CORE_H
#define DTRAIN_COMM_CORE_H

#include "dt_internal.h"
#include "dt_comm.h"

/* Tags above DT_COMM_TAG_MAX are the library's: a group's collectives and
 * splits travel as point-to-point messages with these. */
#define DT__TAG_CALL 0x40000001u  /* a group collective's agreement */
#define DT__TAG_DATA 0x40000002u  /* its data */
#define DT__TAG_SPLIT 0x40000003u /* colours and keys of a split */

struct dt_comm_request {
  dt_comm *comm;         /* the backend communicator whose wait finishes it */
  size_t bytes;          /* its allocation (backends may allocate more than this struct) */
  int send;              /* 1 send, 0 receive */
  int rank, peer;        /* the caller's and the peer's rank in comm */
  uint64_t ctx;          /* tcp: the group the message belongs to (0: comm itself) */
  uint32_t tag;
  float *buf;
  size_t n;              /* floats */
  size_t moved;          /* tcp: floats sent / received so far */
  int done;
  dt_result rc;          /* when done */
  char why[DT__MSG_CAP]; /* rc's text, raised again by the wait */
  dt_comm_request *next; /* the backend's queue */
};

DTRAIN_PRIVATE dt_comm_request *dt__req_new(dt_comm *c, size_t bytes, int send, int rank, int peer, uint32_t tag,
                                            float *buf, size_t n);
DTRAIN_PRIVATE void dt__req_free(dt_comm_request *r);
/* Finish r with rc and the thread's current error text (when rc != OK). */
DTRAIN_PRIVATE void dt__req_fail(dt_comm_request *r, dt_result rc);

/* The transport a group communicator runs on: the base communicator's
 * point-to-point with a context (ranks are the base's). */
typedef struct dt__p2p_ops {
  dt_result (*isend)(dt_comm *base, uint64_t ctx, int dst, uint32_t tag, const float *buf, size_t n,
                     dt_comm_request **req);
  dt_result (*irecv)(dt_comm *base, uint64_t ctx, int src, uint32_t tag, float *buf, size_t n,
                     dt_comm_request **req);
  void (*abort)(dt_comm *base);
  int (*broken)(dt_comm *base);
} dt__p2p_ops;

/* Split a communicator of `world` ranks whose rank r is base rank members[r]
 * (members NULL: the same), messages in context ctx, the caller being rank
 * me: exchange colours and keys, then make the caller's group (a
 * dt__comm_group). *splits counts the splits of this communicator (every
 * member counts the same), so each group gets its own context. */
#if !defined(DTRAIN_NO_DIST)
DTRAIN_PRIVATE dt_result dt__group_split(dt_comm *base, const dt__p2p_ops *ops, uint64_t ctx, uint64_t *splits,
                                         const int *members, int world, int me, int color, int key, dt_comm **out,
                                         int *out_rank);
#endif

/* dt_comm_reduce_scatter that also tells every rank whether the whole sum
 * (every rank's slice) is finite: *finite = 1 when it is known to be, 0 when
 * some element is infinite or NaN or the backend does not check (all but
 * the in-process one: the caller checks itself). The in-process backend
 * checks each slice as it sums it and publishes the answers in the
 * collective's closing meet, so that a synchronous step needs no barrier of
 * its own between its check and its update. handoff (in-process, two
 * ranks): each rank also writes its slice of the sum into the other rank's
 * buffer, whose values outside its own slice are then scratch -- so the
 * lines it read there leave as modified, which the other rank's next write
 * to them takes faster on a host where writing a line another core holds
 * shared is slow (dt__cache_evict in dt_platform.c). */
DTRAIN_PRIVATE dt_result dt__comm_reduce_scatter_finite(dt_comm *c, int rank, float *buf, size_t n, int *finite,
                                                        int handoff);

#endif /* DTRAIN_COMM_CORE_H */
