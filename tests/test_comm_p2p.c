/* tests/test_comm_p2p.c -- point-to-point messages and groups (dt_comm_send /
 * _recv / _isend / _irecv / _wait, dt_comm_split) on the threads backend
 * (threads of this process) and the TCP backend (forked processes on
 * 127.0.0.1): exact delivery, order per tag, out-of-order tags, lengths that
 * differ (MISMATCH, communicator still usable), large messages both ways at
 * once (no deadlock on full socket buffers), messages interleaved with
 * collectives, self-messages, abort, a lost or stalled peer (named within
 * the deadline), groups' collectives against the rank-order sum (bitwise),
 * nested splits, and bad arguments. */
#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  define DTRAIN_STATIC
#  define DTRAIN_IMPLEMENTATION
#endif
#include "dtrain.h"
#include "harness.h"
#if !defined(DTRAIN_NO_THREADS)
#  include <pthread.h>
#  include <time.h>
#endif

/* Checks inside ranks (threads or children) count here; the main thread CHECKs the count. */
static int rank_fail; /* __atomic builtins: the ranks may be threads */
#define RK(cond)                                                                                          \
  do {                                                                                                    \
    if (!(cond)) {                                                                                        \
      __atomic_fetch_add(&rank_fail, 1, __ATOMIC_RELAXED);                                                      \
      fprintf(stderr, "RANK FAIL %s:%d [%s]: %s (last error: %s)\n", __FILE__, __LINE__, th_cur, #cond, \
              dt_last_error());                                                                           \
    }                                                                                                     \
  } while (0)

static float pval(int from, int to, int msg, size_t i) {
  return (float)((int)((i * 13 + (size_t)from * 101 + (size_t)to * 7 + (size_t)msg * 31) % 1000) - 500) * 0.25f;
}

static int check_pattern(const float *b, size_t n, int from, int to, int msg) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != pval(from, to, msg, i)) return 0;
  return 1;
}

static void fill_pattern(float *b, size_t n, int from, int to, int msg) {
  for (size_t i = 0; i < n; i++) b[i] = pval(from, to, msg, i);
}

/* ---- the scenarios: each runs on every rank of a communicator ------------------------------ */

/* Every rank sends each other rank three messages (tags 1, 2, 1) and
 * receives them in the order tag 2, tag 1, tag 1: tag 2 overtakes, the two
 * tag-1 messages keep their order. Sizes from 0 to `big` floats. */
static void sc_exchange(dt_comm *c, int rank, size_t big) {
  int w = dt_comm_world(c);
  size_t sizes[3] = {big, 0, 17};
  int tags[3] = {1, 2, 1};
  float *out[8][3], *in[8][3];
  dt_comm_request *q[8 * 6];
  int nq = 0;
  for (int j = 0; j < w; j++)
    for (int m = 0; m < 3; m++) {
      out[j][m] = (float *)malloc((sizes[m] ? sizes[m] : 1) * sizeof(float));
      in[j][m] = (float *)malloc((sizes[m] ? sizes[m] : 1) * sizeof(float));
      fill_pattern(out[j][m], sizes[m], rank, j, m);
    }
  /* Receives first for tag 2, then the tag-1 pair; sends in message order. */
  for (int j = 0; j < w; j++) {
    if (j == rank) continue;
    RK(dt_comm_irecv(c, rank, j, 2, in[j][1], sizes[1], &q[nq++]) == DTRAIN_OK);
    RK(dt_comm_irecv(c, rank, j, 1, in[j][0], sizes[0], &q[nq++]) == DTRAIN_OK);
    RK(dt_comm_irecv(c, rank, j, 1, in[j][2], sizes[2], &q[nq++]) == DTRAIN_OK);
  }
  for (int j = 0; j < w; j++) {
    if (j == rank) continue;
    for (int m = 0; m < 3; m++) RK(dt_comm_isend(c, rank, j, tags[m], out[j][m], sizes[m], &q[nq++]) == DTRAIN_OK);
  }
  RK(dt_comm_waitall(q, nq) == DTRAIN_OK);
  for (int i = 0; i < nq; i++) RK(q[i] == NULL);
  for (int j = 0; j < w; j++) {
    if (j == rank) continue;
    for (int m = 0; m < 3; m++) RK(check_pattern(in[j][m], sizes[m], j, rank, m));
  }
  for (int j = 0; j < w; j++)
    for (int m = 0; m < 3; m++) {
      free(out[j][m]);
      free(in[j][m]);
    }
}

/* Blocking ping-pong around a ring, then a receive of the wrong length
 * (MISMATCH naming both lengths) after which the communicator still works. */
static void sc_ring_mismatch(dt_comm *c, int rank) {
  int w = dt_comm_world(c), next = (rank + 1) % w, prev = (rank + w - 1) % w;
  float a[64], b[64];
  for (int round = 0; round < 3; round++) {
    fill_pattern(a, 64, rank, next, round);
    if (rank % 2 == 0) {
      RK(dt_comm_send(c, rank, next, 7, a, 64) == DTRAIN_OK);
      RK(dt_comm_recv(c, rank, prev, 7, b, 64) == DTRAIN_OK);
    } else {
      RK(dt_comm_recv(c, rank, prev, 7, b, 64) == DTRAIN_OK);
      RK(dt_comm_send(c, rank, next, 7, a, 64) == DTRAIN_OK);
    }
    RK(check_pattern(b, 64, prev, rank, round));
  }
  if (w >= 2 && rank <= 1) {
    dt_comm_request *q = NULL;
    if (rank == 0) {
      RK(dt_comm_isend(c, 0, 1, 9, a, 10, &q) == DTRAIN_OK);
      RK(dt_comm_wait(q) == DTRAIN_OK);
    } else {
      dt_result rc = dt_comm_recv(c, 1, 0, 9, b, 12);
      RK(rc == DTRAIN_ERR_MISMATCH);
      RK(strstr(dt_last_error(), "has 10 floats, the receive wants 12") != NULL);
    }
  }
  RK(dt_comm_barrier(c, rank) == DTRAIN_OK);
  float x = (float)rank;
  RK(dt_comm_allreduce(c, rank, &x, 1) == DTRAIN_OK);
  RK(x == (float)(w * (w - 1) / 2));
}

/* Messages and collectives interleaved: rank 1 sends rank 0 a message and
 * then joins an all-reduce; rank 0 receives it only after the all-reduce.
 * Self-messages; a blocking send to itself is refused. */
static void sc_interleave_self(dt_comm *c, int rank) {
  int w = dt_comm_world(c);
  float m[300], s = 1.0f;
  if (w >= 2 && rank == 1) {
    fill_pattern(m, 300, 1, 0, 5);
    dt_comm_request *q = NULL;
    RK(dt_comm_isend(c, 1, 0, 3, m, 300, &q) == DTRAIN_OK);
    /* Still queued (tcp: the all-reduce sends it first) or waiting for its
     * receive (threads: a rendezvous that rank 0's receive finishes). */
    RK(dt_comm_allreduce(c, rank, &s, 1) == DTRAIN_OK);
    RK(dt_comm_wait(q) == DTRAIN_OK);
  } else {
    RK(dt_comm_allreduce(c, rank, &s, 1) == DTRAIN_OK);
    if (w >= 2 && rank == 0) {
      RK(dt_comm_recv(c, 0, 1, 3, m, 300) == DTRAIN_OK);
      RK(check_pattern(m, 300, 1, 0, 5));
    }
  }
  RK(s == (float)w);
  /* To itself: receive posted first, or send posted first. */
  float a[5] = {1, 2, 3, 4, 5}, b[5] = {0};
  dt_comm_request *r1 = NULL, *r2 = NULL;
  RK(dt_comm_irecv(c, rank, rank, 11, b, 5, &r1) == DTRAIN_OK);
  RK(dt_comm_isend(c, rank, rank, 11, a, 5, &r2) == DTRAIN_OK);
  RK(dt_comm_wait(r2) == DTRAIN_OK && dt_comm_wait(r1) == DTRAIN_OK);
  RK(memcmp(a, b, sizeof a) == 0);
  memset(b, 0, sizeof b);
  RK(dt_comm_isend(c, rank, rank, 12, a, 5, &r2) == DTRAIN_OK);
  RK(dt_comm_recv(c, rank, rank, 12, b, 5) == DTRAIN_OK);
  RK(dt_comm_wait(r2) == DTRAIN_OK);
  RK(memcmp(a, b, sizeof a) == 0);
  if (strcmp(dt_comm_name(c), "threads") == 0) RK(dt_comm_send(c, rank, rank, 13, a, 5) == DTRAIN_ERR_STATE);
  RK(dt_comm_barrier(c, rank) == DTRAIN_OK);
}

/* The rank-order sum of x_r[i] = gval(r, i) over the ranks of a group. */
static float gval(int r, size_t i) { return (float)((int)((i * 7 + (size_t)r * 29) % 97) - 48) * 0.1f; }

/* Split into colour rank % 2, keys reversing the order; every collective of
 * the group against the rank-order sum, bitwise; point-to-point inside the
 * group; a nested split; a negative colour; a mismatch inside a group. */
static void sc_groups(dt_comm *c, int rank) {
  int w = dt_comm_world(c);
  dt_comm *g = NULL;
  int gr = -2;
  RK(dt_comm_split(c, rank, rank % 2, -rank, &g, &gr) == DTRAIN_OK);
  if (!g) return;
  int gw = dt_comm_world(g), want_w = (w + 1 - rank % 2) / 2;
  RK(gw == want_w);
  /* Keys -rank: the highest old rank is rank 0 of the group. */
  int old_of[8], k = 0;
  for (int j = w - 1; j >= 0; j--)
    if (j % 2 == rank % 2) old_of[k++] = j;
  RK(old_of[gr] == rank);
  size_t ns[3] = {1, 33, 5000};
  for (int t = 0; t < 3; t++) {
    size_t n = ns[t];
    float *b = (float *)malloc(n * sizeof(float)), *sum = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
      sum[i] = gval(old_of[0], i);
      if (gw > 1) sum[i] = gval(old_of[0], i) + gval(old_of[1], i);
      for (int j = 2; j < gw; j++) sum[i] += gval(old_of[j], i);
    }
    for (size_t i = 0; i < n; i++) b[i] = gval(rank, i);
    RK(dt_comm_allreduce(g, gr, b, n) == DTRAIN_OK);
    RK(memcmp(b, sum, n * sizeof(float)) == 0);
    for (size_t i = 0; i < n; i++) b[i] = gval(rank, i);
    RK(dt_comm_reduce_scatter(g, gr, b, n) == DTRAIN_OK);
    size_t sb, se;
    dt_comm_slice(n, gw, gr, &sb, &se);
    RK(se == sb || memcmp(b + sb, sum + sb, (se - sb) * sizeof(float)) == 0);
    RK(dt_comm_allgather(g, gr, b, n) == DTRAIN_OK);
    RK(memcmp(b, sum, n * sizeof(float)) == 0);
    for (size_t i = 0; i < n; i++) b[i] = gval(rank, i);
    RK(dt_comm_reduce(g, gr, b, n, gw - 1) == DTRAIN_OK);
    if (gr == gw - 1) RK(memcmp(b, sum, n * sizeof(float)) == 0);
    else RK(b[0] == gval(rank, 0) && b[n - 1] == gval(rank, n - 1));
    if (gr == 0) fill_pattern(b, n, 42, 0, (int)t);
    RK(dt_comm_broadcast(g, gr, b, n, 0) == DTRAIN_OK);
    RK(check_pattern(b, n, 42, 0, (int)t));
    free(b);
    free(sum);
  }
  RK(dt_comm_barrier(g, gr) == DTRAIN_OK);
  /* Point-to-point inside the group (group ranks). */
  if (gw >= 2) {
    float m[40];
    int to = (gr + 1) % gw, from = (gr + gw - 1) % gw;
    fill_pattern(m, 40, gr, to, 1);
    dt_comm_request *q[2];
    float in[40];
    RK(dt_comm_irecv(g, gr, from, 4, in, 40, &q[0]) == DTRAIN_OK);
    RK(dt_comm_isend(g, gr, to, 4, m, 40, &q[1]) == DTRAIN_OK);
    RK(dt_comm_waitall(q, 2) == DTRAIN_OK);
    RK(check_pattern(in, 40, from, gr, 1));
    /* A mismatch inside the group: every member sees it, the group goes on. */
    float v[4] = {1, 1, 1, 1};
    RK(dt_comm_allreduce(g, gr, v, gr == 0 ? 3 : 4) == DTRAIN_ERR_MISMATCH);
    RK(dt_comm_allreduce(g, gr, v, 4) == DTRAIN_OK);
    RK(v[3] == (float)gw);
  }
  /* Nested: group rank 0 alone; the rest together; a negative colour gets none. */
  dt_comm *h = NULL;
  int hr = -2;
  RK(dt_comm_split(g, gr, gr == 0 ? 0 : 1, 0, &h, &hr) == DTRAIN_OK);
  RK(h != NULL && hr == (gr == 0 ? 0 : gr - 1));
  if (h) {
    float one = 1.0f;
    RK(dt_comm_allreduce(h, hr, &one, 1) == DTRAIN_OK);
    RK(one == (float)(gr == 0 ? 1 : gw - 1));
    dt_comm_destroy(h);
  }
  dt_comm *none = (dt_comm *)1;
  int nr = 5;
  RK(dt_comm_split(g, gr, gr == 0 ? -1 : 0, 0, &none, &nr) == DTRAIN_OK);
  RK((gr == 0) == (none == NULL));
  RK(gr == 0 ? nr == -1 : nr == gr - 1);
  if (none) dt_comm_destroy(none);
  dt_comm_destroy(g);
  RK(dt_comm_barrier(c, rank) == DTRAIN_OK);
}

/* dt_layout over 8 ranks (or fewer): P = 2 stages x T = 2 tensor ranks x the
 * rest data parallel; each group's all-reduce of the old ranks against the
 * ranks the grid puts there. */
static void sc_layout(dt_comm *c, int rank) {
  int W = dt_comm_world(c), P = W % 2 == 0 ? 2 : 1, T = W % 4 == 0 ? 2 : 1, R = W / (P * T);
  dt_layout l;
  RK(dt_layout_create(c, rank, P, T, &l) == DTRAIN_OK);
  RK(l.pipeline == P && l.tensor == T && l.data == R);
  RK(rank == l.tp_rank + T * (l.dp_rank + R * l.stage));
  RK(dt_comm_world(l.pp) == P && dt_comm_world(l.tp) == T && dt_comm_world(l.dp) == R);
  float x[3] = {(float)rank, (float)rank, (float)rank}, want[3] = {0, 0, 0};
  for (int p = 0; p < P; p++) want[0] += (float)(l.tp_rank + T * (l.dp_rank + R * p));
  for (int t = 0; t < T; t++) want[1] += (float)(t + T * (l.dp_rank + R * l.stage));
  for (int d = 0; d < R; d++) want[2] += (float)(l.tp_rank + T * (d + R * l.stage));
  int ranks[3] = {l.stage, l.tp_rank, l.dp_rank};
  dt_comm *g[3] = {l.pp, l.tp, l.dp};
  for (int k = 0; k < 3; k++) {
    RK(dt_comm_allreduce(g[k], ranks[k], &x[k], 1) == DTRAIN_OK);
    RK(x[k] == want[k]);
  }
  dt_layout_destroy(&l);
  RK(l.pp == NULL && l.tp == NULL && l.dp == NULL);
  dt_layout bad;
  RK(dt_layout_create(c, rank, W + 1, 1, &bad) == DTRAIN_ERR_INVALID_ARG);
  RK(dt_comm_barrier(c, rank) == DTRAIN_OK);
}

static void sc_bad_args(dt_comm *c, int rank) {
  float a[2] = {0};
  dt_comm_request *q = (dt_comm_request *)1;
  int w = dt_comm_world(c);
  RK(dt_comm_isend(c, rank, w, 0, a, 2, &q) == DTRAIN_ERR_INDEX && q == NULL);
  RK(dt_comm_isend(c, rank, 0, -1, a, 2, &q) == DTRAIN_ERR_INVALID_ARG);
  RK(dt_comm_isend(c, rank, 0, DT_COMM_TAG_MAX + 1, a, 2, &q) == DTRAIN_ERR_INVALID_ARG);
  RK(dt_comm_irecv(c, rank, -1, 0, a, 2, &q) == DTRAIN_ERR_INDEX);
  RK(dt_comm_irecv(c, rank, 0, 0, NULL, 2, &q) == DTRAIN_ERR_NULL_ARG);
  RK(dt_comm_isend(c, rank, 0, 0, a, 2, NULL) == DTRAIN_ERR_NULL_ARG);
  RK(dt_comm_send(NULL, rank, 0, 0, a, 2) == DTRAIN_ERR_NULL_ARG);
  RK(dt_comm_wait(NULL) == DTRAIN_ERR_NULL_ARG);
  RK(dt_comm_waitall(NULL, 0) == DTRAIN_OK);
  RK(dt_comm_split(c, rank, 0, 0, NULL, NULL) == DTRAIN_ERR_NULL_ARG);
}

static void sc_exchange_mid(dt_comm *c, int rank) { sc_exchange(c, rank, 100000); }

/* ---- threads ---------------------------------------------------------------------------- */

typedef void (*scenario_fn)(dt_comm *c, int rank);

#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
typedef struct tjob {
  dt_comm *c;
  int rank;
  scenario_fn fn;
} tjob;

static void *tjob_main(void *p) {
  tjob *j = (tjob *)p;
  j->fn(j->c, j->rank);
  return NULL;
}

static void run_threads(int world, scenario_fn fn) {
  dt_comm *c = dt_comm_create_threads(world, 0);
  CHECK(c != NULL);
  if (!c) return;
  pthread_t th[8];
  tjob jobs[8];
  __atomic_store_n(&rank_fail, 0, __ATOMIC_RELAXED);
  for (int r = 0; r < world; r++) {
    jobs[r].c = c;
    jobs[r].rank = r;
    jobs[r].fn = fn;
    pthread_create(&th[r], NULL, tjob_main, &jobs[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  CHECK_MSG(__atomic_load_n(&rank_fail, __ATOMIC_RELAXED) == 0, "world %d: %d failed checks in the ranks", world,
            __atomic_load_n(&rank_fail, __ATOMIC_RELAXED));
  dt_comm_destroy(c);
}

static void test_threads_p2p(void) {
  for (int w = 2; w <= 4; w++) {
    run_threads(w, sc_exchange_mid);
    run_threads(w, sc_ring_mismatch);
    run_threads(w, sc_interleave_self);
    run_threads(w, sc_bad_args);
  }
}

static void test_threads_groups(void) {
  for (int w = 2; w <= 5; w++) run_threads(w, sc_groups);
  run_threads(8, sc_layout);
  run_threads(6, sc_layout);
}

/* dt_comm_abort ends a receive that would wait forever; recover makes the communicator usable. */
typedef struct abort_job {
  dt_comm *c;
  dt_result rc;
} abort_job;

static void *abort_waiter(void *p) {
  abort_job *j = (abort_job *)p;
  float b[4];
  j->rc = dt_comm_recv(j->c, 0, 1, 5, b, 4);
  return NULL;
}

static void test_threads_abort(void) {
  dt_comm *c = dt_comm_create_threads(2, 0);
  CHECK(c != NULL);
  if (!c) return;
  abort_job j = {c, DTRAIN_OK};
  pthread_t th;
  pthread_create(&th, NULL, abort_waiter, &j);
  struct timespec nap = {0, 50 * 1000 * 1000};
  nanosleep(&nap, NULL);
  dt_comm_abort(c, 1);
  pthread_join(th, NULL);
  CHECK(j.rc == DTRAIN_ERR_ABORTED);
  float b[4] = {0};
  dt_comm_request *q = NULL;
  CHECK(dt_comm_isend(c, 1, 0, 5, b, 4, &q) == DTRAIN_ERR_ABORTED && q == NULL);
  CHECK(dt_comm_recover(c) == DTRAIN_OK);
  run_threads(2, sc_ring_mismatch);
  dt_comm_destroy(c);
}
#endif /* threads */

/* One rank: everything a communicator of one can do (every build). */
static void test_world_one(void) {
  dt_comm *c = dt_comm_create_threads(1, 0);
  CHECK(c != NULL);
  if (!c) return;
  __atomic_store_n(&rank_fail, 0, __ATOMIC_RELAXED);
  sc_interleave_self(c, 0);
  sc_bad_args(c, 0);
  sc_groups(c, 0);
  sc_layout(c, 0);
  CHECK(__atomic_load_n(&rank_fail, __ATOMIC_RELAXED) == 0);
  dt_comm_destroy(c);
}

/* ---- TCP: forked ranks -------------------------------------------------------------------- */
#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "tcp_world.h"

static int child_scenario(world *x, int rank, void *arg) {
  scenario_fn fn = *(scenario_fn *)arg;
  dt_cluster c = cluster_of(x, rank);
  dt_net_options o = opts_of(x, rank);
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  CK(comm != NULL);
  if (!comm) return 2;
  __atomic_store_n(&rank_fail, 0, __ATOMIC_RELAXED);
  fn(comm, rank);
  dt_comm_destroy(comm);
  return __atomic_load_n(&rank_fail, __ATOMIC_RELAXED) ? 1 : 0;
}

static void run_tcp(int w, scenario_fn fn) {
  world x;
  int st[MAXW];
  world_init(&x, w);
  run_world(&x, child_scenario, &fn, st);
  world_close(&x);
  check_world(&x, st, NULL);
}

static void sc_exchange_big(dt_comm *c, int rank) { sc_exchange(c, rank, (size_t)3 << 20); }

static void test_tcp_p2p(void) {
  run_tcp(2, sc_exchange_big); /* 12 MiB each way at once: far beyond the sockets' buffers */
  run_tcp(3, sc_exchange_mid);
  for (int w = 2; w <= 4; w++) run_tcp(w, sc_ring_mismatch);
  run_tcp(2, sc_interleave_self);
  run_tcp(3, sc_interleave_self);
  run_tcp(2, sc_bad_args);
}

/* Rank 1 of 2 leaves the moment its communicator is up (nothing to do): rank 0,
 * still finishing its side of the start-up, must not take the close of the
 * second connection (lane 1) for a client that gave up in its backlog (it
 * then waited 15 s for a worker 1 that had come and gone). Bounded: 40 runs. */
static void sc_nothing(dt_comm *c, int rank) {
  (void)c;
  (void)rank;
}

static void test_tcp_quick_exit(void) {
  for (int k = 0; k < 40; k++) run_tcp(2, sc_nothing);
}

static void test_tcp_groups(void) {
  run_tcp(2, sc_groups);
  run_tcp(4, sc_groups);
  run_tcp(5, sc_groups);
  run_tcp(4, sc_layout);
}

/* A rank lost while the others wait for its message: kill -9 (PEER) or
 * SIGSTOP (TIMEOUT), named within the deadline; or a rank that calls a
 * collective while another waits for its message (MISMATCH at once). */
typedef struct p2p_fault {
  int victim, sig;
} p2p_fault;

static int child_p2p_fault(world *x, int rank, void *argp) {
  const p2p_fault *a = (const p2p_fault *)argp;
  dt_cluster c = cluster_of(x, rank);
  dt_net_options o = opts_of(x, rank);
  o.timeout_s = 3;
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  CK(comm != NULL);
  if (!comm) return 2;
  float b[1000];
  fill_pattern(b, 1000, rank, 0, 0);
  CK(dt_comm_barrier(comm, rank) == DTRAIN_OK);
  if (rank == a->victim) {
    if (a->sig) raise(a->sig);
    float s = 1.0f;
    CK(dt_comm_allreduce(comm, rank, &s, 1) != DTRAIN_OK); /* the others wait for a message instead */
    dt_comm_destroy(comm);
    return 0;
  }
  double t0 = dt__now();
  dt_result rc = dt_comm_recv(comm, rank, a->victim, 1, b, 1000);
  double took = dt__now() - t0;
  char want[64];
  snprintf(want, sizeof want, "worker %d (127.0.0.1:", a->victim);
  if (a->sig == SIGKILL) {
    CK(rc == DTRAIN_ERR_PEER);
    CK(strstr(dt_last_error(), "closed the connection") != NULL);
  } else if (a->sig == SIGSTOP) {
    CK(rc == DTRAIN_ERR_TIMEOUT);
  } else {
    CK(rc == DTRAIN_ERR_MISMATCH || rc == DTRAIN_ERR_PEER);
    CK(took < 1.5);
  }
  CK(strstr(dt_last_error(), want) != NULL);
  CK(took < 6.0);
  if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "rank %d (%.2f s): %s\n", rank, took, dt_last_error());
  CK(dt_comm_recv(comm, rank, a->victim, 1, b, 1000) == DTRAIN_ERR_ABORTED);
  CK(dt_comm_barrier(comm, rank) == DTRAIN_ERR_ABORTED);
  dt_comm_destroy(comm);
  return 0;
}

static void run_p2p_fault(int w, int victim, int sig) {
  world x;
  int st[MAXW], want[MAXW] = {0};
  p2p_fault a = {victim, sig};
  world_init(&x, w);
  if (sig) {
    run_world_victim(&x, child_p2p_fault, &a, victim, st);
    CHECK(st[victim] == 128 + SIGKILL);
    st[victim] = 0;
  } else {
    run_world(&x, child_p2p_fault, &a, st);
  }
  world_close(&x);
  check_world(&x, st, want);
}

/* An isend to a rank that died: the call queues (OK) and leaves the last
 * error as it was, though what it sent at once met a dead socket; the wait
 * names the failure. */
static int child_isend_dead(world *x, int rank, void *argp) {
  (void)argp;
  dt_cluster c = cluster_of(x, rank);
  dt_net_options o = opts_of(x, rank);
  o.timeout_s = 3;
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  CK(comm != NULL);
  if (!comm) return 2;
  CK(dt_comm_barrier(comm, rank) == DTRAIN_OK);
  if (rank == 1) raise(SIGKILL);
  dt__sleep(0.2); /* its socket closed by the kernel */
  float a[4] = {1, 2, 3, 4};
  dt_comm_request *q[3] = {NULL, NULL, NULL};
  dt_result rc = DTRAIN_OK;
  for (int i = 0; i < 3 && rc == DTRAIN_OK; i++) {
    dt__quiet_push();
    (void)dt__error(DTRAIN_ERR_INVALID_ARG, "the caller's own error %d", i);
    (void)dt__quiet_pop(DTRAIN_OK);
    rc = dt_comm_isend(comm, 0, 1, 2, a, 4, &q[i]);
    char want[64];
    snprintf(want, sizeof want, "the caller's own error %d", i);
    if (rc == DTRAIN_OK) CK(dt_last_result() == DTRAIN_ERR_INVALID_ARG && strcmp(dt_last_error(), want) == 0);
    dt__sleep(0.1); /* the dead end's reset arrives */
  }
  dt_result w = DTRAIN_OK;
  for (int i = 0; i < 3; i++)
    if (q[i]) {
      dt_result r = dt_comm_wait(q[i]);
      if (w == DTRAIN_OK) w = r;
    }
  CK(rc != DTRAIN_OK || w != DTRAIN_OK); /* the failure was reported, by a later call or a wait */
  if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "isend %d, wait %d: %s\n", rc, w, dt_last_error());
  dt_comm_destroy(comm);
  return 0;
}

static void test_tcp_isend_dead(void) {
  world x;
  int st[MAXW], want[MAXW] = {0};
  world_init(&x, 2);
  run_world_victim(&x, child_isend_dead, NULL, 1, st);
  CHECK(st[1] == 128 + SIGKILL);
  st[1] = 0;
  world_close(&x);
  check_world(&x, st, want);
}

static void test_tcp_fault(void) {
  run_p2p_fault(2, 1, SIGKILL);
  run_p2p_fault(3, 0, SIGKILL);
  run_p2p_fault(3, 2, SIGSTOP);
  run_p2p_fault(2, 1, 0);
}
#endif /* tcp */

int main(void) {
  TH_RUN(test_world_one);
#if !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
  TH_RUN(test_threads_p2p);
  TH_RUN(test_threads_groups);
  TH_RUN(test_threads_abort);
#else
  th_skip_item("test_comm_p2p threads", "threads or distribution not compiled in");
#endif
#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
  TH_RUN(test_tcp_p2p);
  TH_RUN(test_tcp_groups);
  TH_RUN(test_tcp_isend_dead);
  TH_RUN(test_tcp_fault);
  TH_RUN(test_tcp_quick_exit);
#else
  th_skip_item("test_comm_p2p tcp", "networking or threads not compiled in");
#endif
  return th_summary("test_comm_p2p");
}
