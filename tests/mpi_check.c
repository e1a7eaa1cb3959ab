/* tests/mpi_check.c -- the MPI communicator under mpirun (built and run by
 * tests/mpi_checks.sh with mpicc -DDTRAIN_USE_MPI): every collective against
 * a reference computed locally (integer-valued floats, so sums are exact)
 * for several sizes, argument checks, and multi_worker_mirrored on the MPI
 * communicator against mirrored(world * N) computed in each process alone.
 * Rank 0 prints "mpi_check: N passed, N failed" (failures summed over ranks). */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed, my_rank;

#define CHECK(cond)                                                                    \
  do {                                                                                 \
    if (cond) passed++;                                                                \
    else {                                                                             \
      failed++;                                                                        \
      fprintf(stderr, "FAIL rank %d %s:%d: %s (%s)\n", my_rank, __FILE__, __LINE__, #cond, dt_last_error()); \
    }                                                                                  \
  } while (0)

/* Rank q's value at index i: a small integer (exact sums). */
static float val(int q, size_t i) { return (float)((int)((i * 7u + (size_t)q * 13u) % 31u) - 15 + q); }

static void check_collectives(dt_comm *c) {
  const int W = dt_comm_world(c), me = dt_comm_rank(c);
  static const size_t sizes[] = {1, 2, 3, 15, 16, 17, 33, 1000, 4099, 65536 + 5, 1000003};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    float *buf = (float *)malloc(n * sizeof(float)), *sum = (float *)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
      sum[i] = 0.0f;
      for (int q = 0; q < W; q++) sum[i] += val(q, i);
    }
    int bad;
    /* all-reduce */
    for (size_t i = 0; i < n; i++) buf[i] = val(me, i);
    CHECK(dt_comm_allreduce(c, me, buf, n) == DTRAIN_OK);
    bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != sum[i];
    CHECK(bad == 0);
    /* reduce-scatter: my slice */
    size_t b, e;
    dt_comm_slice(n, W, me, &b, &e);
    for (size_t i = 0; i < n; i++) buf[i] = val(me, i);
    CHECK(dt_comm_reduce_scatter(c, me, buf, n) == DTRAIN_OK);
    bad = 0;
    for (size_t i = b; i < e; i++) bad += buf[i] != sum[i];
    CHECK(bad == 0);
    /* all-gather: slice q from rank q */
    for (size_t i = 0; i < n; i++) buf[i] = (i >= b && i < e) ? val(me, i) : -999.0f;
    CHECK(dt_comm_allgather(c, me, buf, n) == DTRAIN_OK);
    bad = 0;
    for (int q = 0; q < W; q++) {
      size_t qb, qe;
      dt_comm_slice(n, W, q, &qb, &qe);
      for (size_t i = qb; i < qe; i++) bad += buf[i] != val(q, i);
    }
    CHECK(bad == 0);
    /* reduce to the last rank: the root gets the sum, the others keep theirs */
    int root = W - 1;
    for (size_t i = 0; i < n; i++) buf[i] = val(me, i);
    CHECK(dt_comm_reduce(c, me, buf, n, root) == DTRAIN_OK);
    bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != (me == root ? sum[i] : val(me, i));
    CHECK(bad == 0);
    /* broadcast from rank W / 2 */
    root = W / 2;
    for (size_t i = 0; i < n; i++) buf[i] = val(me, i);
    CHECK(dt_comm_broadcast(c, me, buf, n, root) == DTRAIN_OK);
    bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != val(root, i);
    CHECK(bad == 0);
    free(buf);
    free(sum);
  }
  CHECK(dt_comm_barrier(c, me) == DTRAIN_OK);
  /* the rank argument must be this process's */
  float x = 1.0f;
  if (W > 1) CHECK(dt_comm_allreduce(c, (me + 1) % W, &x, 1) == DTRAIN_ERR_INDEX);
  /* abort breaks only this process's communicator, until recover */
  dt_comm_abort(c, me);
  CHECK(dt_comm_allreduce(c, me, &x, 1) == DTRAIN_ERR_ABORTED);
  CHECK(dt_comm_recover(c) == DTRAIN_OK);
  CHECK(dt_comm_allreduce(c, me, &x, 1) == DTRAIN_OK && x == (float)W);
  dt_comm_stats st;
  CHECK(dt_comm_stats_get(c, me, &st) == DTRAIN_OK && st.calls > 50 && st.bytes > 0);
  CHECK(strcmp(dt_comm_name(c), "mpi") == 0);
}

/* ---- multi_worker_mirrored on MPI == mirrored(W * N) in one process ---------------- */
#define NS 256
#define NF 6
#define NC 3
static float data_x[NS * NF];
static int32_t data_y[NS];

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2;
} model;

static void model_init(model *m, uint64_t seed) {
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 10, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 10, NC, 1);
}

static dt_tensor *model_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, NF};
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

static dt_minibatch rows_at(int64_t first, int64_t rows) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = rows;
  b.x = data_x + first * NF;
  b.x_cols = NF;
  b.y = data_y + first;
  b.y_cols = 1;
  return b;
}

#define K 6
#define B 29

/* Trains K steps; mwm: this process's part of each global batch. */
static void train(dt_comm *c, int mwm, int N, uint64_t seed, float *out, float *loss) {
  const int W = dt_comm_world(c), me = dt_comm_rank(c);
  model m;
  model_init(&m, seed);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.01f;
  dt_optim *opt = dt_optim_create(m.P, &od);
  dt_strategy_options sd = mwm ? dt_strategy_multi_worker_mirrored(c, N) : dt_strategy_mirrored(W * N);
  sd.spin_us = -1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  /* my rows: mirrored(W*N)'s shards me*N .. me*N+N-1 */
  int64_t first = 0, rows = 0, base = B / (W * N), extra = B % (W * N);
  for (int r = 0; r < W * N; r++) {
    int64_t rr = base + (r < extra ? 1 : 0);
    if (r < me * N) first += rr;
    else if (r < (me + 1) * N) rows += rr;
  }
  for (int k = 0; s && k < K; k++) {
    int64_t g0 = (k * B) % (NS - B);
    dt_minibatch b = mwm ? rows_at(g0 + first, rows) : rows_at(g0, B);
    CHECK(dt_strategy_step(s, &b, &loss[k]) == DTRAIN_OK);
  }
  memcpy(out, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static void check_mwm(dt_comm *c) {
  const int me = dt_comm_rank(c);
  unsigned st = 12345u;
  for (int i = 0; i < NS; i++) {
    int cls = (int)((st = st * 1103515245u + 12345u) >> 16) % NC;
    data_y[i] = cls;
    for (int f = 0; f < NF; f++) {
      st = st * 1103515245u + 12345u;
      data_x[i * NF + f] = (float)((st >> 16) % 2001) / 1000.0f - 1.0f + (f % NC == cls ? 1.0f : 0.0f);
    }
  }
  static float ref[1024], got[1024], rank0[1024];
  float lref[K], lgot[K], l0[K];
  for (int N = 1; N <= 2; N++) {
    train(c, 0, N, 7, ref, lref);
    /* every rank initialises differently: the broadcast at create evens them */
    train(c, 1, N, 7 + (uint64_t)me * 31, got, lgot);
    size_t n = 0;
    {
      model m;
      model_init(&m, 1);
      n = dt_params_size(m.P);
      dt_params_destroy(m.P);
    }
    double d = 0.0, mx = 0.0;
    for (size_t i = 0; i < n; i++) {
      d = fmax(d, fabs((double)got[i] - (double)ref[i]));
      mx = fmax(mx, fabs((double)ref[i]));
    }
    if (!(d <= 1e-5 * mx)) fprintf(stderr, "rank %d N %d: relative error %g\n", me, N, d / mx);
    CHECK(d <= 1e-5 * mx);
    for (int k = 0; k < K; k++) CHECK(fabs((double)lgot[k] - (double)lref[k]) <= 1e-5 * fabs((double)lref[k]) + 1e-6);
    /* all ranks hold rank 0's numbers exactly */
    memcpy(rank0, got, n * sizeof(float));
    memcpy(l0, lgot, sizeof l0);
    CHECK(dt_comm_broadcast(c, me, rank0, n, 0) == DTRAIN_OK);
    CHECK(dt_comm_broadcast(c, me, l0, K, 0) == DTRAIN_OK);
    CHECK(memcmp(rank0, got, n * sizeof(float)) == 0);
    CHECK(memcmp(l0, lgot, sizeof l0) == 0);
  }
}

static void quiet_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

/* Point-to-point around the ring (tags overtaking, one wrong length) and a
 * split into colours rank % 2 with reversed keys. */
static void check_p2p_split(dt_comm *c) {
  int W = dt_comm_world(c), me = dt_comm_rank(c), next = (me + 1) % W, prev = (me + W - 1) % W;
  float a[100], b[100], t2[3] = {0};
  for (int i = 0; i < 100; i++) a[i] = val(me, (size_t)i);
  float small[3] = {7, 8, 9};
  dt_comm_request *q[4];
  CHECK(dt_comm_isend(c, me, next, 1, a, 100, &q[0]) == DTRAIN_OK);
  CHECK(dt_comm_isend(c, me, next, 2, small, 3, &q[1]) == DTRAIN_OK);
  CHECK(dt_comm_irecv(c, me, prev, 2, t2, 3, &q[2]) == DTRAIN_OK);
  CHECK(dt_comm_irecv(c, me, prev, 1, b, 100, &q[3]) == DTRAIN_OK);
  CHECK(dt_comm_waitall(q, 4) == DTRAIN_OK);
  int bad = 0;
  for (int i = 0; i < 100; i++) bad += b[i] != val(prev, (size_t)i);
  CHECK(bad == 0 && t2[0] == 7 && t2[2] == 9);
  if (W >= 2 && me <= 1) {
    if (me == 0) CHECK(dt_comm_send(c, 0, 1, 9, a, 10) == DTRAIN_OK);
    else CHECK(dt_comm_recv(c, 1, 0, 9, b, 12) == DTRAIN_ERR_MISMATCH);
  }
  CHECK(dt_comm_isend(c, me, next, DT_COMM_TAG_MAX + 1, a, 1, &q[0]) == DTRAIN_ERR_INVALID_ARG);
  dt_comm *g = NULL;
  int gr = -1;
  CHECK(dt_comm_split(c, me, me % 2, -me, &g, &gr) == DTRAIN_OK && g != NULL);
  if (g) {
    int gw = dt_comm_world(g);
    CHECK(gw == (W + 1 - me % 2) / 2 && dt_comm_rank(g) == gr);
    float x = (float)me;
    CHECK(dt_comm_allreduce(g, gr, &x, 1) == DTRAIN_OK);
    float want = 0;
    for (int j = me % 2; j < W; j += 2) want += (float)j;
    CHECK(x == want);
    /* Keys -rank: the highest old rank leads. */
    float top = gr == 0 ? (float)me : -1.0f;
    CHECK(dt_comm_broadcast(g, gr, &top, 1, 0) == DTRAIN_OK);
    CHECK(top == (float)(W - 1 - ((W - 1 - me) % 2)));
    dt_comm_destroy(g);
  }
  CHECK(dt_comm_split(c, me, -1, 0, &g, &gr) == DTRAIN_OK && g == NULL && gr == -1);
}

int main(void) {
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR); /* the argument checks log errors on purpose */
  dt_comm *c = dt_comm_create_mpi();
  if (!c) {
    fprintf(stderr, "FAIL dt_comm_create_mpi: %s\n", dt_last_error());
    printf("mpi_check: 0 passed, 1 failed\n");
    return 1;
  }
  my_rank = dt_comm_rank(c);
  CHECK(dt_comm_world(c) >= 1 && my_rank >= 0 && my_rank < dt_comm_world(c));
  check_collectives(c);
  check_p2p_split(c);
  check_mwm(c);
  /* failures summed over the ranks */
  float tot[2] = {(float)passed, (float)failed};
  if (dt_comm_allreduce(c, my_rank, tot, 2) != DTRAIN_OK) tot[1] += 1.0f;
  if (my_rank == 0) printf("mpi_check: %d passed, %d failed (%d ranks)\n", (int)tot[0], (int)tot[1], dt_comm_world(c));
  dt_comm_destroy(c);
  return tot[1] > 0.0f ? 1 : 0;
}
