/* tests/test_net_threads.c -- the TCP transport with every rank a thread of
 * this process (no fork: the one network test that also runs on Windows,
 * under wine, through Winsock): a world of 3 ranks over 127.0.0.1 forms and
 * all-reduces, broadcasts and all-gathers exact values, a 4 MiB all-reduce
 * (partial sends, would-block, poll) included; a client that sends garbage
 * to rank 0's port while the world forms is refused and the world still
 * forms; a parameter server and a worker push and pull (plain SGD, exact
 * values); a dial to a port nobody listens on fails within its deadline. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS) && !defined(DTRAIN_NO_DIST)
#  include <pthread.h>

#  define W 3
#  define BIG (1u << 20) /* floats: 4 MiB a rank */

typedef struct tworld {
  int lfd[W];
  char addr[W][64];
  char *addrs[W];
} tworld;

typedef struct rank_arg {
  tworld *x;
  int rank;
  int fails;        /* checks that failed in this thread */
  char why[512];    /* the first one */
} rank_arg;

#  define RCHECK(a, cond)                                                                           \
    do {                                                                                            \
      if (!(cond) && (a)->fails++ == 0)                                                             \
        snprintf((a)->why, sizeof (a)->why, "rank %d: line %d: %s (last error: %.300s)", (a)->rank,     \
                 __LINE__, #cond, dt_last_error());                                                 \
    } while (0)

static int tworld_init(tworld *x) {
  memset(x, 0, sizeof *x);
  for (int i = 0; i < W; i++) {
    if (dt__net_listen("127.0.0.1:0", &x->lfd[i]) != DTRAIN_OK) return 0;
    snprintf(x->addr[i], sizeof x->addr[i], "127.0.0.1:%d", dt__net_port(x->lfd[i]));
    x->addrs[i] = x->addr[i];
  }
  return 1;
}

static void tworld_close(tworld *x) {
  for (int i = 0; i < W; i++) dt__net_close(x->lfd[i]);
}

static void *rank_main(void *p) {
  rank_arg *a = (rank_arg *)p;
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = W;
  c.worker_addr = a->x->addrs;
  c.role = DTRAIN_ROLE_WORKER;
  c.index = a->rank;
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 20;
  o.connect_timeout_s = 20;
  o.quiet = 1;
  o.listen_fd = a->x->lfd[a->rank];
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  RCHECK(a, comm != NULL);
  if (!comm) return NULL;
  int r = a->rank;
  /* small: exact sums of small integers */
  float v[1000];
  for (int i = 0; i < 1000; i++) v[i] = (float)((r + 1) * i);
  RCHECK(a, dt_comm_allreduce(comm, r, v, 1000) == DTRAIN_OK);
  int bad = 0;
  for (int i = 0; i < 1000; i++) bad += v[i] != (float)(6 * i); /* (1+2+3) i */
  RCHECK(a, bad == 0);
  /* large: 4 MiB a rank, more than a socket buffer holds */
  float *big = (float *)malloc(BIG * sizeof(float));
  RCHECK(a, big != NULL);
  if (big) {
    for (unsigned i = 0; i < BIG; i++) big[i] = (float)(r + 1) * (float)(i % 1024);
    RCHECK(a, dt_comm_allreduce(comm, r, big, BIG) == DTRAIN_OK);
    bad = 0;
    for (unsigned i = 0; i < BIG; i++) bad += big[i] != 6.0f * (float)(i % 1024);
    RCHECK(a, bad == 0);
    free(big);
  }
  /* broadcast from rank 1 and all-gather */
  float b[64];
  for (int i = 0; i < 64; i++) b[i] = r == 1 ? (float)(i * 3 + 1) : -1.0f;
  RCHECK(a, dt_comm_broadcast(comm, r, b, 64, 1) == DTRAIN_OK);
  bad = 0;
  for (int i = 0; i < 64; i++) bad += b[i] != (float)(i * 3 + 1);
  RCHECK(a, bad == 0);
  float g[W * 40]; /* each rank fills its slice (dt_comm_slice) */
  size_t lo, hi;
  dt_comm_slice(W * 40, W, r, &lo, &hi);
  for (size_t i = 0; i < W * 40; i++) g[i] = i >= lo && i < hi ? (float)(1000 * r + (int)i) : -1.0f;
  RCHECK(a, dt_comm_allgather(comm, r, g, W * 40) == DTRAIN_OK);
  bad = 0;
  for (int q = 0; q < W; q++) {
    dt_comm_slice(W * 40, W, q, &lo, &hi);
    for (size_t i = lo; i < hi; i++) bad += g[i] != (float)(1000 * q + (int)i);
  }
  RCHECK(a, bad == 0);
  RCHECK(a, dt_comm_barrier(comm, r) == DTRAIN_OK);
  dt_comm_destroy(comm);
  return NULL;
}

/* A stranger that dials rank 0's port before the world forms and sends
 * bytes that are no hello: it must be dropped (closed or refused), never
 * answered with data that completes a handshake, and never hang. */
typedef struct garbage_arg {
  const char *addr;
  int connected, wrote;
  dt_result ended; /* how its reading ended: DTRAIN_ERR_PEER (dropped) is the one right answer */
  double took;     /* seconds from the write to that end */
} garbage_arg;

static void *garbage_main(void *p) {
  garbage_arg *g = (garbage_arg *)p;
  int fd = -1;
  if (dt__net_connect(g->addr, dt__now() + 5, &fd) != DTRAIN_OK) return NULL;
  g->connected = 1;
  unsigned char junk[512];
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = (unsigned char)(i * 37 + 11);
  g->wrote = dt__net_write(fd, junk, sizeof junk, dt__now() + 5) == DTRAIN_OK;
  /* read until the transport drops us: a REFUSE frame may come first; a
   * full megabyte would mean it took the junk for a peer */
  unsigned char buf[4096];
  size_t got = 0;
  double t0 = dt__now(), deadline = t0 + 30;
  g->ended = DTRAIN_OK;
  while (got < (1u << 20)) {
    dt_result rc = dt__net_read(fd, buf, 1, deadline);
    if (rc != DTRAIN_OK) {
      g->ended = rc;
      break;
    }
    got++;
  }
  g->took = dt__now() - t0;
  dt__net_close(fd);
  return NULL;
}

static void run_world(int with_garbage) {
  tworld x;
  CHECK(tworld_init(&x));
  rank_arg a[W];
  pthread_t t[W], gt;
  garbage_arg g;
  memset(&g, 0, sizeof g);
  g.addr = x.addr[0];
  if (with_garbage) CHECK(pthread_create(&gt, NULL, garbage_main, &g) == 0);
  if (with_garbage) dt__sleep(0.2); /* its bytes are in rank 0's backlog before rank 0 runs */
  for (int r = 0; r < W; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].x = &x;
    a[r].rank = r;
    CHECK(pthread_create(&t[r], NULL, rank_main, &a[r]) == 0);
  }
  for (int r = 0; r < W; r++) pthread_join(t[r], NULL);
  for (int r = 0; r < W; r++) CHECK_MSG(a[r].fails == 0, "%s", a[r].why);
  tworld_close(&x);
  if (with_garbage) {
    pthread_join(gt, NULL);
    CHECK(g.connected);
    CHECK(g.wrote);
    /* dropped (closed or reset), not served, and not left waiting to its own deadline */
    CHECK_MSG(g.ended == DTRAIN_ERR_PEER, "the stranger's read ended with %d", (int)g.ended);
    CHECK_MSG(g.took < 20.0, "the stranger waited %.1f s", g.took);
  }
}

static void test_world_threads(void) { run_world(0); }
static void test_world_with_garbage(void) { run_world(1); }

/* A parameter server and a worker, threads of this process: the worker
 * pulls the initial values, pushes a gradient of ones three times, and pulls
 * what plain SGD (lr 0.25) made of them; the server ends on the worker's BYE
 * with the same values in its own params. */
#  define PSN 300
typedef struct ps_arg {
  int lfd;
  char addr[64];
  dt_result rc;
  float final0, final_last;
  char why[320];
} ps_arg;

static dt_cluster ps_cluster(char **wa, char **sa, dt_role role) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = 1;
  c.servers = 1;
  c.worker_addr = wa;
  c.server_addr = sa;
  c.role = role;
  c.index = 0;
  return c;
}

static dt_params *ps_params(void) {
  dt_params *P = dt_params_create(3);
  int64_t shape[1] = {PSN};
  if (P) dt_params_add(P, "w", 1, shape, dt_init_constant(2.0f));
  return P;
}

static void *ps_server_main(void *p) {
  ps_arg *a = (ps_arg *)p;
  char wbuf[] = "127.0.0.1:1", *wa[1] = {wbuf}, *sa[1] = {a->addr}; /* workers do not listen here */
  dt_cluster c = ps_cluster(wa, sa, DTRAIN_ROLE_PS);
  dt_params *P = ps_params();
  dt_optim_options od = dt_optim_defaults(DTRAIN_OPTIM_SGD);
  od.lr = 0.25f;
  dt_optim *opt = P ? dt_optim_create(P, &od) : NULL;
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 20;
  o.connect_timeout_s = 20;
  o.model_hash = 77;
  o.listen_fd = a->lfd;
  o.quiet = 1;
  a->rc = opt ? dt_ps_serve(&c, P, opt, &o, NULL) : DTRAIN_ERR_NOMEM;
  if (a->rc != DTRAIN_OK) snprintf(a->why, sizeof a->why, "%.300s", dt_last_error());
  if (P) {
    a->final0 = dt_params_data(P)[0];
    a->final_last = dt_params_data(P)[PSN - 1];
  }
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return NULL;
}

static void test_parameter_server_threads(void) {
  ps_arg a;
  memset(&a, 0, sizeof a);
  CHECK(dt__net_listen("127.0.0.1:0", &a.lfd) == DTRAIN_OK);
  snprintf(a.addr, sizeof a.addr, "127.0.0.1:%d", dt__net_port(a.lfd));
  pthread_t st;
  CHECK(pthread_create(&st, NULL, ps_server_main, &a) == 0);
  char wbuf[] = "127.0.0.1:1", *wa[1] = {wbuf}, *sa[1] = {a.addr};
  dt_cluster c = ps_cluster(wa, sa, DTRAIN_ROLE_WORKER);
  dt_params *P = ps_params();
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 20;
  o.connect_timeout_s = 20;
  o.model_hash = 77;
  o.quiet = 1;
  dt_pstore *ps = P ? dt_pstore_create_tcp(&c, P, &o, DTRAIN_STALENESS_UNBOUNDED) : NULL;
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    float v[PSN], g[PSN];
    dt_pstore_ticket tk;
    for (int i = 0; i < PSN; i++) g[i] = 1.0f;
    CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 0, 0, v, PSN, &tk) == DTRAIN_OK);
    CHECK(v[0] == 2.0f && v[PSN - 1] == 2.0f);
    for (int t = 0; t < 3; t++) CHECK(dt_pstore_push(ps, 0, t, g, PSN, &tk) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 0, 3, v, PSN, &tk) == DTRAIN_OK);
    int bad = 0;
    for (int i = 0; i < PSN; i++) bad += v[i] != 1.25f; /* 2 - 3 * 0.25 */
    CHECK_MSG(bad == 0, "%d values differ from 1.25 (v[0] = %g)", bad, (double)v[0]);
    dt_pstore_leave(ps, 0);
    dt_pstore_destroy(ps);
  }
  pthread_join(st, NULL);
  CHECK_MSG(a.rc == DTRAIN_OK, "server: %s", a.why);
  CHECK(a.final0 == 1.25f && a.final_last == 1.25f);
  dt__net_close(a.lfd);
  dt_params_destroy(P);
}

/* Nobody listens: connect keeps retrying until its deadline, then says so. */
static void test_connect_deadline(void) {
  int lfd = -1, fd = -1;
  char addr[64];
  CHECK(dt__net_listen("127.0.0.1:0", &lfd) == DTRAIN_OK);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", dt__net_port(lfd));
  dt__net_close(lfd); /* the port is free now: nobody answers there */
  double t0 = dt__now();
  dt_result rc = dt__net_connect(addr, t0 + 1.0, &fd);
  double took = dt__now() - t0;
  CHECK(rc == DTRAIN_ERR_TIMEOUT);
  CHECK(fd == -1);
  CHECK_MSG(took < 10.0, "took %.1f s", took);
  CHECK(strstr(dt_last_error(), "cannot connect") != NULL);
}

/* A resolver error names the address. */
static void test_bad_address(void) {
  int fd = -1;
  CHECK(dt__net_connect("no.such.host.invalid:1", dt__now() + 1, &fd) != DTRAIN_OK);
  CHECK(strstr(dt_last_error(), "no.such.host.invalid") != NULL);
  CHECK(dt__net_listen("127.0.0.1:notaport", &fd) == DTRAIN_ERR_INVALID_ARG);
}

int main(void) {
  TH_RUN(test_world_threads);
  TH_RUN(test_world_with_garbage);
  TH_RUN(test_parameter_server_threads);
  TH_RUN(test_connect_deadline);
  TH_RUN(test_bad_address);
  return th_summary("test_net_threads");
}
#else
int main(void) {
  (void)th_cur_failed;
  th_skip_item("test_net_threads", "built without the network or threads");
  return th_summary("test_net_threads");
}
#endif
