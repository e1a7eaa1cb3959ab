/* The per-op profile (dt_profile_*): off until started; every op's forward,
 * every backward node, the optimizer, the loader and the collectives are
 * counted once per call, from every replica thread; the times never add up
 * to more than the wall time on one thread (self time: no double counting of
 * ops built from ops); stop freezes the figures and start zeroes them; the
 * table's text and its bad arguments. */
#include "harness.h"

#define CHECK_EQ(a, b) CHECK_MSG((a) == (b), "%lld, want %lld", (long long)(a), (long long)(b))

static void spin_for(double seconds) {
  double end = dt_time_now() + seconds;
  while (dt_time_now() < end) {
  }
}

#define NF 16
#define NC 4
#define ROWS 32
static float xs_data[ROWS * NF];
static int32_t ys_data[ROWS];

typedef struct {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_optim *opt;
  dt_graph *g;
} net;

static void net_init(net *m) {
  m->P = dt_params_create(7);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 64, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 64, NC, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.01f;
  m->opt = dt_optim_create(m->P, &d);
  m->g = dt_graph_create(m->P, NULL);
  th_seed(99);
  for (int i = 0; i < ROWS * NF; i++) xs_data[i] = th_uniform(-1, 1);
  for (int i = 0; i < ROWS; i++) ys_data[i] = i % NC;
}

static void net_free(net *m) {
  dt_graph_destroy(m->g);
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

static dt_tensor *net_loss(dt_graph *g, net *m, const float *x, const int32_t *y, int64_t rows) {
  int64_t s[2] = {rows, NF};
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, s, (float *)x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), y);
}

static int net_step(net *m) {
  dt_graph_reset(m->g);
  dt_params_zero_grad(m->P);
  dt_tensor *loss = net_loss(m->g, m, xs_data, ys_data, ROWS);
  if (dt_backward(m->g, loss) != DTRAIN_OK) return 0;
  return dt_optim_step(m->opt) == DTRAIN_OK;
}

/* the entry (name, phase), or calls -1 when absent */
static dt_profile_entry find(const char *name, dt_profile_phase phase) {
  dt_profile_entry e[64], none;
  memset(&none, 0, sizeof none);
  none.calls = -1;
  int n = dt_profile_read(e, 64);
  for (int i = 0; i < n && i < 64; i++)
    if (e[i].phase == phase && strcmp(e[i].name, name) == 0) return e[i];
  return none;
}

static double sum_seconds(void) {
  dt_profile_entry e[64];
  int n = dt_profile_read(e, 64);
  double s = 0;
  for (int i = 0; i < n && i < 64; i++) s += e[i].seconds;
  return s;
}

static void test_counts_every_call(void) {
  net m;
  net_init(&m);
  CHECK(net_step(&m)); /* not profiled: the profile is off */
  dt_profile_start();
  CHECK_EQ(dt_profile_read(NULL, 0), 0); /* start zeroes */
  const int K = 25;
  double t0 = dt_time_now();
  for (int k = 0; k < K; k++) CHECK(net_step(&m));
  double wall = dt_time_now() - t0;
  dt_profile_stop();
  /* the layer is a dt_linear op: its forward and backward time is dt_linear's */
  dt_profile_entry layer = find("dt_nn_linear_forward", DTRAIN_PROFILE_FORWARD);
  dt_profile_entry lin_f = find("dt_linear", DTRAIN_PROFILE_FORWARD);
  dt_profile_entry lin_b = find("dt_linear", DTRAIN_PROFILE_BACKWARD);
  dt_profile_entry relu_f = find("dt_relu", DTRAIN_PROFILE_FORWARD);
  dt_profile_entry relu_b = find("dt_relu", DTRAIN_PROFILE_BACKWARD);
  dt_profile_entry ce_b = find("dt_cross_entropy", DTRAIN_PROFILE_BACKWARD);
  dt_profile_entry upd = find("dt_optim_update", DTRAIN_PROFILE_UPDATE);
  CHECK_EQ(layer.calls, 2 * K);
  CHECK_EQ(lin_f.calls, 2 * K);
  CHECK_EQ(lin_b.calls, 2 * K);
  CHECK_EQ(find("dt_nn_linear_forward", DTRAIN_PROFILE_BACKWARD).calls, -1);
  CHECK_EQ(relu_f.calls, K);
  CHECK_EQ(relu_b.calls, K);
  CHECK_EQ(ce_b.calls, K);
  CHECK_EQ(upd.calls, K);
  CHECK(lin_f.seconds > 0 && lin_b.seconds > 0 && upd.seconds > 0);
  /* one thread: each nanosecond is charged to at most one op */
  double sum = sum_seconds();
  CHECK(sum > 0);
  CHECK(sum <= wall * 1.0001 + 1e-6);
  if (getenv("DTRAIN_TEST_VERBOSE")) {
    char buf[4096];
    dt_profile_format(buf, sizeof buf, K, wall);
    printf("%s", buf);
  }
  /* stopped: nothing more is counted */
  CHECK(net_step(&m));
  CHECK_EQ(find("dt_nn_linear_forward", DTRAIN_PROFILE_FORWARD).calls, 2 * K);
  /* started again: zeroed, and counting */
  dt_profile_start();
  CHECK_EQ(find("dt_nn_linear_forward", DTRAIN_PROFILE_FORWARD).calls, -1);
  CHECK(net_step(&m));
  dt_profile_stop();
  CHECK_EQ(find("dt_nn_linear_forward", DTRAIN_PROFILE_FORWARD).calls, 2);
  net_free(&m);
}

/* An op started while the profile was off and finished after it was turned
 * on must not be charged the time in between (the generation check). */
static void test_start_mid_op(void) {
  net m;
  net_init(&m);
  dt_profile_start();
  dt_graph_reset(m.g);
  int64_t s[2] = {ROWS, NF};
  dt_tensor *x = dt_tensor_wrap(m.g, 2, s, xs_data); /* an op left "running" */
  dt_profile_stop();
  spin_for(0.06);
  dt_profile_start();
  dt_tensor *h = dt_nn_linear_forward(m.g, &m.l1, x);
  dt_profile_stop();
  CHECK(h != NULL);
  CHECK(sum_seconds() < 0.05);
  net_free(&m);
}

static void test_loader_counts(void) {
  int64_t shape[1] = {NF};
  dt_dataset *ds = dt_dataset_new(100, 1, shape, 1);
  if (!ds && dt_last_result() == DTRAIN_ERR_UNSUPPORTED) TH_SKIP("test_loader_counts: built without the data loaders");
  CHECK(ds != NULL);
  dt_loader_options lo;
  memset(&lo, 0, sizeof lo);
  lo.batch_size = 10;
  lo.shuffle = 1;
  dt_loader *l = dt_loader_new(ds, &lo);
  CHECK(l != NULL);
  dt_profile_start();
  dt_batch b;
  int batches = 0;
  while (dt_loader_next(l, &b) == 1) batches++;
  dt_profile_stop();
  CHECK_EQ(batches, 10);
  CHECK_EQ(find("dt_loader_next", DTRAIN_PROFILE_DATA).calls, 10);
  dt_loader_destroy(l);
  dt_dataset_destroy(ds);
}

/* replica threads charge into the same table */
static dt_tensor *rep_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  return net_loss(g, (net *)user, b->x, b->y, b->rows);
}

static void test_replica_threads(void) {
  net m;
  net_init(&m);
  dt_strategy_options so;
  memset(&so, 0, sizeof so);
  so.kind = DTRAIN_STRATEGY_MIRRORED;
  so.replicas = 2;
  dt_strategy *s = dt_strategy_create(m.P, m.opt, rep_step, &m, &so);
  if (!s && dt_last_result() == DTRAIN_ERR_UNSUPPORTED) {
    net_free(&m);
    TH_SKIP("test_replica_threads: built without threads or without the distributed strategies");
  }
  CHECK(s != NULL);
  if (!s) {
    net_free(&m);
    return;
  }
  dt_minibatch mb;
  memset(&mb, 0, sizeof mb);
  mb.rows = ROWS;
  mb.x = xs_data;
  mb.x_cols = NF;
  mb.y = ys_data;
  const int K = 10;
  dt_profile_start();
  for (int k = 0; k < K; k++) CHECK_EQ(dt_strategy_step(s, &mb, NULL), DTRAIN_OK);
  dt_profile_stop();
  CHECK_EQ(find("dt_linear", DTRAIN_PROFILE_FORWARD).calls, 2 * 2 * K);
  CHECK_EQ(find("dt_linear", DTRAIN_PROFILE_BACKWARD).calls, 2 * 2 * K);
  CHECK_EQ(find("dt_relu", DTRAIN_PROFILE_FORWARD).calls, 2 * K);
  CHECK(find("dt_optim_update", DTRAIN_PROFILE_UPDATE).calls >= K); /* each replica updates a slice */
  dt_strategy_destroy(s);
  net_free(&m);
}

static void test_comm_counted(void) {
  dt_comm *c = dt_comm_create_threads(1, 0);
  CHECK(c != NULL);
  if (!c) return;
  float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  dt_profile_start();
  for (int i = 0; i < 3; i++) CHECK_EQ(dt_comm_allreduce(c, 0, v, 8), DTRAIN_OK);
  CHECK_EQ(dt_comm_barrier(c, 0), DTRAIN_OK);
  dt_profile_stop();
  CHECK_EQ(find("dt_comm_allreduce", DTRAIN_PROFILE_COMM).calls, 3);
  CHECK_EQ(find("dt_comm_barrier", DTRAIN_PROFILE_COMM).calls, 1);
  dt_comm_destroy(c);
}

static void test_format(void) {
  net m;
  net_init(&m);
  dt_profile_start();
  for (int k = 0; k < 3; k++) CHECK(net_step(&m));
  dt_profile_stop();
  char buf[4096];
  int64_t need = dt_profile_format(buf, sizeof buf, 3, 1.0);
  CHECK(need > 0 && need < (int64_t)sizeof buf);
  CHECK_EQ((int64_t)strlen(buf), need);
  CHECK(strstr(buf, "dt_nn_linear_forward") != NULL);
  CHECK(strstr(buf, "backward") != NULL);
  CHECK(strstr(buf, "by phase: forward") != NULL);
  CHECK(strstr(buf, "us/step") != NULL);
  /* cut short: NUL-terminated, the length it would need returned */
  dt_profile_entry all_for_cap[1];
  char small[40];
  memset(small, 'x', sizeof small);
  CHECK_EQ(dt_profile_format(small, sizeof small, 3, 1.0), need);
  CHECK_EQ((int)strlen(small), (int)sizeof small - 1);
  CHECK_EQ(strncmp(small, buf, sizeof small - 1), 0);
  CHECK_EQ(dt_profile_format(NULL, 0, 3, 1.0), need); /* measuring only */
  /* bad arguments */
  CHECK_EQ(dt_profile_format(buf, sizeof buf, -1, 1.0), -1);
  CHECK(strstr(dt_last_error(), "dt_profile_format") != NULL);
  CHECK_EQ(dt_profile_format(buf, sizeof buf, 1, -2.0), -1);
  CHECK_EQ(dt_profile_read(NULL, 4), -1);
  CHECK_EQ(dt_profile_read(all_for_cap, -1), -1);
  CHECK(strcmp(dt_profile_phase_name(DTRAIN_PROFILE_COMM), "comm") == 0);
  CHECK(strcmp(dt_profile_phase_name((dt_profile_phase)77), "unknown") == 0);
  /* read with a small cap: the longest first, the count of all */
  dt_profile_entry e[2], all[64];
  int n = dt_profile_read(all, 64);
  CHECK(n > 2);
  CHECK_EQ(dt_profile_read(e, 2), n);
  CHECK(e[0].seconds >= e[1].seconds);
  CHECK(e[0].seconds == all[0].seconds && e[1].seconds == all[1].seconds);
  for (int i = 1; i < n && i < 64; i++) CHECK(all[i - 1].seconds >= all[i].seconds);
  net_free(&m);
}

int main(void) {
  TH_RUN(test_counts_every_call);
  TH_RUN(test_start_mid_op);
  TH_RUN(test_loader_counts);
  TH_RUN(test_replica_threads);
  TH_RUN(test_comm_counted);
  TH_RUN(test_format);
  return th_summary("profile");
}
