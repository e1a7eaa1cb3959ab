/* tests/test_cuda_strategy.cc -- data-parallel strategies on devices, on the
 * host emulation of the CUDA backend (several emulated devices, each with
 * its own name and peer copies; no GPU needed).
 *
 *   - dt_device_group: the ring all-reduce (peer copies, and through host
 *     memory without them) gives the exact sum, bitwise the same on every
 *     device; a backend's group hooks are used when present.
 *   - one_device on a device and mirrored over 2 and 3 devices equal CPU
 *     mirrored(N) and CPU one_device on the whole batch (float tolerance),
 *     with uneven and empty shards, MEAN and SUM loss, clipping, SGD and
 *     Adam; a second run repeats bitwise; every replica's device copy equals
 *     the params after each step.
 *   - a kernel failing on one device (in the forward pass, and in the
 *     update) fails the step naming the replica and the device, leaves the
 *     params (and every device copy) as before, and the strategy goes on.
 *   - dt_fit around mirrored on 2 devices = around CPU mirrored(2).
 *   - check_numerics, refusals (async, central_storage, parameter_server
 *     with devices; bad device lists).
 *   - multi_worker_mirrored: 2 forked processes x 1 and 2 devices over TCP
 *     on 127.0.0.1 equal CPU mirrored(2) / mirrored(4) in one process (MEAN
 *     with clipping, and SUM), and the ranks end bitwise equal; a NaN on
 *     one rank fails the step on both (NONFINITE there, PEER naming it on
 *     the other) with no parameter changed, and training goes on. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#define DTRAIN_CUDA_HOST_EMULATION
#include "dtrain_cuda.h"
#include "harness.h"

/* The CUDA backend's entry points, on emulated devices (DTRAIN_STATIC: they
 * are this file's own). */
DTRAIN_API int dt_cuda_device_count(void) { return 4; }
static int guarded; /* the second pass: device memory the host cannot touch (as on a GPU) */
DTRAIN_API dt_device *dt_cuda_device_create(int index) {
  return guarded ? dt_cuda_emu_guarded_device_create(index) : dt_cuda_emu_device_create(index);
}
DTRAIN_API void dt_cuda_device_destroy(dt_device *d) { dt_cuda_emu_device_free(d); }

#define NS 128
#define NF 6
#define NC 3
#define HID 10
#define K 5
#define PMAX 512
#define MAXD 4

static float data_x[NS * NF];
static int32_t data_y[NS];

static void make_data(void) {
  th_seed(11);
  for (int i = 0; i < NS; i++) {
    int c = (int)(th_rand() * NC);
    data_y[i] = c;
    for (int f = 0; f < NF; f++) data_x[i * NF + f] = th_uniform(-1, 1) + (f % NC == c ? 1.0f : 0.0f);
  }
}

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2;
  int sum_loss; /* the step returns the sum over its rows */
} model;

static void model_init(model *m, uint64_t seed) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, HID, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", HID, NC, 1);
}

/* The same step function on the CPU and on a device: dt_tensor_from copies
 * the shard (host memory) into the replica's graph, wherever it lives. */
static dt_tensor *model_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, NF};
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_from(g, 2, xs, b->x)));
  dt_tensor *l = dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
  return m->sum_loss ? dt_mul_scalar(g, l, (float)b->rows) : l;
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

static int64_t batch_first(int k, int64_t B) { return ((int64_t)k * 17) % (NS - B); }

typedef struct config {
  dt_optim_kind opt;
  float clip;
  int sum_loss;
  int64_t B;
} config;

static dt_optim *make_opt(dt_params *P, const config *c) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = c->opt;
  d.lr = c->opt == DTRAIN_OPTIM_SGD ? 0.1f : 0.01f;
  d.momentum = c->opt == DTRAIN_OPTIM_SGD ? 0.9f : 0.0f;
  d.clip_norm = c->clip;
  return dt_optim_create(P, &d);
}

static dt_device *devs[MAXD];

/* Every replica's device copy equals the params (bitwise). */
static int replicas_equal_params(dt_strategy *s, const float *params, size_t n) {
  static float h[PMAX];
  for (int r = 0; r < dt_strategy_replicas(s); r++) {
    dt_graph *g = dt_strategy_graph(s, r);
    dt_device *d = dt_graph_device(g);
    if (!d || d->copy(d, h, dt_graph_param_data(g), n * sizeof(float), DTRAIN_COPY_D2H) != DTRAIN_OK) return 0;
    if (memcmp(h, params, n * sizeof(float)) != 0) return 0;
  }
  return 1;
}

/* K steps of `sd` (ndev > 0: on devs[0..ndev)); the final params and the
 * losses. Returns 0 on a failure (checked). */
static int train(const config *c, dt_strategy_options sd, int ndev, float *params, float *loss) {
  model m;
  model_init(&m, 5);
  m.sum_loss = c->sum_loss;
  if (c->sum_loss) sd.loss = DTRAIN_LOSS_SUM;
  dt_optim *opt = make_opt(m.P, c);
  sd.spin_us = -1;
  if (ndev > 0) {
    sd.devices = devs;
    sd.ndevices = ndev;
  }
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK_MSG(s != NULL, "%s", dt_last_error());
  int ok = s != NULL;
  size_t n = dt_params_size(m.P);
  for (int k = 0; ok && k < K; k++) {
    dt_minibatch b = rows_at(batch_first(k, c->B), c->B);
    dt_result rc = dt_strategy_step(s, &b, &loss[k]);
    CHECK_MSG(rc == DTRAIN_OK, "%s", dt_last_error());
    ok = rc == DTRAIN_OK;
    if (ok && ndev > 0) CHECK(replicas_equal_params(s, dt_params_data(m.P), n));
  }
  if (ok && ndev > 0) {
    for (int r = 0; r < ndev; r++) CHECK(dt_strategy_device(s, r) == devs[r]);
    dt_strategy_stats st;
    CHECK(dt_strategy_stats_get(s, &st) == DTRAIN_OK);
    CHECK(st.steps == K && st.replicas == ndev && st.failed_replica == -1);
    CHECK(dt_optim_steps(opt) == K);
  }
  memcpy(params, dt_params_data(m.P), n * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  return ok;
}

static double rel_diff(const float *a, const float *b, size_t n) {
  double d = 0.0, mx = 1e-12;
  for (size_t i = 0; i < n; i++) {
    d = fmax(d, fabs((double)a[i] - (double)b[i]));
    mx = fmax(mx, fabs((double)b[i]));
  }
  return d / mx;
}

static size_t model_size(void) {
  model m;
  model_init(&m, 5);
  size_t n = dt_params_size(m.P);
  dt_params_destroy(m.P);
  return n;
}

static void check_parity(const config *c, int ndev, double tol) {
  static float p_dev[PMAX], p_dev2[PMAX], p_mir[PMAX], p_one[PMAX];
  float l_dev[K], l_dev2[K], l_mir[K], l_one[K];
  size_t n = model_size();
  dt_strategy_options mir = ndev == 1 ? dt_strategy_one_device() : dt_strategy_mirrored(0);
  dt_strategy_options cpu_mir = ndev == 1 ? dt_strategy_one_device() : dt_strategy_mirrored(ndev);
  if (!train(c, mir, ndev, p_dev, l_dev) || !train(c, mir, ndev, p_dev2, l_dev2) ||
      !train(c, cpu_mir, 0, p_mir, l_mir) || !train(c, dt_strategy_one_device(), 0, p_one, l_one))
    return;
  /* repeats bitwise */
  CHECK_MSG(memcmp(p_dev, p_dev2, n * sizeof(float)) == 0, "%d devices: second run differs", ndev);
  CHECK(memcmp(l_dev, l_dev2, sizeof l_dev) == 0);
  double dm = rel_diff(p_dev, p_mir, n), d1 = rel_diff(p_dev, p_one, n);
  CHECK_MSG(dm <= tol && d1 <= tol, "%d devices, B %lld, opt %d, clip %g, sum %d: vs CPU mirrored %.3g, vs one_device %.3g",
            ndev, (long long)c->B, (int)c->opt, (double)c->clip, c->sum_loss, dm, d1);
  for (int k = 0; k < K; k++) {
    CHECK_NEAR(l_dev[k], l_mir[k], tol * (1.0 + fabs((double)l_mir[k])));
    CHECK_NEAR(l_dev[k], l_one[k], tol * (1.0 + fabs((double)l_one[k])));
  }
  /* the model trained at all (the parity is not between untouched params) */
  model m;
  model_init(&m, 5);
  CHECK(rel_diff(p_dev, dt_params_data(m.P), n) > 1e-3);
  dt_params_destroy(m.P);
}

static void test_parity(void) {
  config c;
  memset(&c, 0, sizeof c);
  for (int nd = 1; nd <= 3; nd++) {
    c.opt = DTRAIN_OPTIM_SGD;
    c.clip = 0.0f;
    c.sum_loss = 0;
    c.B = 31; /* uneven shards */
    check_parity(&c, nd, 2e-5);
    c.B = 2; /* with 3 devices one shard is empty */
    check_parity(&c, nd, 2e-5);
    c.B = 24;
    c.clip = 0.05f; /* clipping over the reduced gradient (it does clip: the norm is larger) */
    check_parity(&c, nd, 2e-5);
    c.clip = 0.0f;
    c.sum_loss = 1;
    check_parity(&c, nd, 2e-5);
    c.sum_loss = 0;
    c.opt = DTRAIN_OPTIM_ADAM;
    c.clip = 1.0f;
    check_parity(&c, nd, 1e-4);
  }
}

static void test_one_device_only(void) {
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_SGD;
  c.B = 31;
  check_parity(&c, 1, 2e-5);
}

/* ---- the device group directly ---- */

static int hook_calls;
static dt_result fake_group_create(dt_device *const *d, int n, void **out) {
  (void)d;
  *out = calloc(1, sizeof(int));
  *(int *)*out = n;
  return *out ? DTRAIN_OK : DTRAIN_ERR_NOMEM;
}
static dt_result fake_group_allreduce(void *grp, float *const *bufs, size_t count) {
  int n = *(int *)grp;
  hook_calls++;
  for (size_t i = 0; i < count; i++) { /* "device" memory: the guarded devices' pointers made host pointers */
    float s = 0.0f;
    for (int r = 0; r < n; r++) s += ((float *)dt__cu_guard_off(bufs[r]))[i];
    for (int r = 0; r < n; r++) ((float *)dt__cu_guard_off(bufs[r]))[i] = s;
  }
  return DTRAIN_OK;
}
static void fake_group_destroy(void *grp) { free(grp); }
static int bcast_calls;
static dt_result fake_group_broadcast(void *grp, float *const *bufs, size_t count, int root) {
  int n = *(int *)grp;
  bcast_calls++;
  for (int r = 0; r < n; r++)
    if (r != root) memcpy(dt__cu_guard_off(bufs[r]), dt__cu_guard_off(bufs[root]), count * sizeof(float));
  return DTRAIN_OK;
}

static void test_group(void) {
  static const size_t counts[] = {1, 37, 1000};
  float *buf[MAXD], want[1000], got[1000];
  for (int mode = 0; mode < 3; mode++) { /* peer copies, through the host, group hooks */
    dt_device dv[MAXD], *dp[MAXD];
    for (int i = 0; i < 3; i++) {
      dv[i] = *devs[i];
      if (mode == 1) dv[i].peer_copy = NULL;
      if (mode == 2) {
        dv[i].group_create = fake_group_create;
        dv[i].group_allreduce = fake_group_allreduce;
        dv[i].group_destroy = fake_group_destroy;
        dv[i].group_broadcast = fake_group_broadcast;
      }
      dp[i] = &dv[i];
    }
    for (int ci = 0; ci < 3; ci++) {
      size_t cnt = counts[ci];
      dt_device_group *g = dt_device_group_create(dp, 3, cnt);
      CHECK_MSG(g != NULL, "%s", dt_last_error());
      if (!g) continue;
      CHECK(strstr(dt_device_group_method(g), mode == 0 ? "peer" : mode == 1 ? "host" : "hooks") != NULL);
      th_seed(3 + cnt);
      for (size_t i = 0; i < cnt; i++) want[i] = 0.0f;
      for (int r = 0; r < 3; r++) {
        void *p = NULL;
        CHECK(dp[r]->alloc(dp[r], cnt * sizeof(float), &p) == DTRAIN_OK);
        buf[r] = (float *)p;
        float h[1000];
        th_fill(h, (int64_t)cnt, -1, 1);
        for (size_t i = 0; i < cnt; i++) want[i] += h[i];
        CHECK(dp[r]->copy(dp[r], buf[r], h, cnt * sizeof(float), DTRAIN_COPY_H2D) == DTRAIN_OK);
      }
      int before = hook_calls;
      CHECK_MSG(dt_device_group_allreduce(g, buf) == DTRAIN_OK, "%s", dt_last_error());
      CHECK((hook_calls > before) == (mode == 2));
      float first[1000];
      CHECK(dp[0]->copy(dp[0], first, buf[0], cnt * sizeof(float), DTRAIN_COPY_D2H) == DTRAIN_OK);
      for (int r = 0; r < 3; r++) {
        CHECK(dp[r]->copy(dp[r], got, buf[r], cnt * sizeof(float), DTRAIN_COPY_D2H) == DTRAIN_OK);
        CHECK(memcmp(got, first, cnt * sizeof(float)) == 0); /* bitwise the same everywhere */
        for (size_t i = 0; i < cnt; i++) CHECK_NEAR(got[i], want[i], 1e-5);
      }
      /* broadcast of a range from device 2 */
      if (cnt >= 37) {
        float h[1000];
        for (size_t i = 0; i < cnt; i++) h[i] = (float)i;
        CHECK(dp[2]->copy(dp[2], buf[2], h, cnt * sizeof(float), DTRAIN_COPY_H2D) == DTRAIN_OK);
        int bc = bcast_calls;
        CHECK(dt_device_group_broadcast(g, buf, 5, 30, 2) == DTRAIN_OK);
        CHECK((bcast_calls > bc) == (mode == 2));
        CHECK(dp[0]->copy(dp[0], got, buf[0], cnt * sizeof(float), DTRAIN_COPY_D2H) == DTRAIN_OK);
        CHECK(got[5] == 5.0f && got[29] == 29.0f && got[4] == first[4] && got[30] == first[30]);
        CHECK_ERR(dt_device_group_broadcast(g, buf, 5, cnt + 1, 0), DTRAIN_ERR_INDEX, "outside");
      }
      for (int r = 0; r < 3; r++) dp[r]->free(dp[r], buf[r], cnt * sizeof(float));
      dt_device_group_destroy(g);
    }
  }
  CHECK(dt_device_group_create(NULL, 2, 4) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_device_group_create(devs, 0, 4) == NULL && dt_last_result() == DTRAIN_ERR_INVALID_ARG);
}

/* A collective that refuses these devices (DTRAIN_ERR_UNSUPPORTED, as the
 * NCCL hooks do for a GPU given twice): the group falls back to the ring,
 * which still sums; any other group_create failure fails the group. */
static int refuse_code = DTRAIN_ERR_UNSUPPORTED;
static dt_result refusing_group_create(dt_device *const *d, int n, void **out) {
  (void)d;
  (void)n;
  *out = NULL;
  return dt_device_error((dt_result)refuse_code, "fake collective: refused");
}

static void test_group_refused(void) {
  dt_device dv[2], *dp[2];
  for (int i = 0; i < 2; i++) {
    dv[i] = *devs[i];
    dv[i].group_create = refusing_group_create;
    dv[i].group_allreduce = fake_group_allreduce;
    dv[i].group_destroy = fake_group_destroy;
    dp[i] = &dv[i];
  }
  refuse_code = DTRAIN_ERR_UNSUPPORTED;
  dt_device_group *g = dt_device_group_create(dp, 2, 5);
  CHECK_MSG(g != NULL, "%s", dt_last_error());
  if (g) {
    CHECK(strstr(dt_device_group_method(g), "peer") != NULL);
    float *buf[2], h[5], got[5];
    for (int r = 0; r < 2; r++) {
      void *p = NULL;
      CHECK(dp[r]->alloc(dp[r], sizeof h, &p) == DTRAIN_OK);
      buf[r] = (float *)p;
      for (int i = 0; i < 5; i++) h[i] = (float)(i + 10 * r);
      CHECK(dp[r]->copy(dp[r], buf[r], h, sizeof h, DTRAIN_COPY_H2D) == DTRAIN_OK);
    }
    int before = hook_calls;
    CHECK_MSG(dt_device_group_allreduce(g, buf) == DTRAIN_OK, "%s", dt_last_error());
    CHECK(hook_calls == before);
    for (int r = 0; r < 2; r++) {
      CHECK(dp[r]->copy(dp[r], got, buf[r], sizeof got, DTRAIN_COPY_D2H) == DTRAIN_OK);
      for (int i = 0; i < 5; i++) CHECK(got[i] == (float)(2 * i + 10));
      dp[r]->free(dp[r], buf[r], sizeof h);
    }
    dt_device_group_destroy(g);
  }
  refuse_code = DTRAIN_ERR_IO;
  dt__quiet_push(); /* the expected failure is not an error */
  g = dt_device_group_create(dp, 2, 5);
  dt__quiet_pop(DTRAIN_OK);
  CHECK(g == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_IO && strstr(dt_last_error(), "fake collective: refused") != NULL);
  dt_device_group_destroy(g);
}

/* The strategy over devices with group hooks: they carry the all-reduce. */
static void test_hooks_in_strategy(void) {
  static float p_hook[PMAX], p_ring[PMAX];
  float l[K];
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_SGD;
  c.B = 24;
  dt_device dv[2], *saved[2] = {devs[0], devs[1]};
  for (int i = 0; i < 2; i++) {
    dv[i] = *devs[i];
    dv[i].group_create = fake_group_create;
    dv[i].group_allreduce = fake_group_allreduce;
    dv[i].group_destroy = fake_group_destroy;
    dv[i].group_broadcast = fake_group_broadcast;
    devs[i] = &dv[i];
  }
  int before = hook_calls, bc = bcast_calls;
  int ok = train(&c, dt_strategy_mirrored(0), 2, p_hook, l);
  CHECK(hook_calls - before == K);
  CHECK(bcast_calls - bc == K); /* the parameters from device 0 */
  devs[0] = saved[0];
  devs[1] = saved[1];
  if (ok && train(&c, dt_strategy_mirrored(0), 2, p_ring, l))
    CHECK(rel_diff(p_hook, p_ring, model_size()) <= 1e-6);
}

/* ---- failures ---- */

static dt_device *fail_dev;
static int fail_kernel = -1;
static dt_result failing_run(dt_device *d, dt_kernel k, const dt_kernel_args *a) {
  if (d == fail_dev && (int)k == fail_kernel) {
    char msg[96];
    snprintf(msg, sizeof msg, "injected kernel failure on %s", d->name);
    return dt_device_error(DTRAIN_ERR_IO, msg);
  }
  return dt_cuda_emu_device()->run(d, k, a);
}

static int fail_peer;
static dt_result failing_peer_copy(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes) {
  if (d == fail_dev && fail_peer) return dt_device_error(DTRAIN_ERR_IO, "injected peer copy failure");
  return dt_cuda_emu_device()->peer_copy(d, dst, from, src, bytes);
}

static void test_failures(void) {
  dt_device dv[3], *dp[3];
  for (int i = 0; i < 3; i++) {
    dv[i] = *devs[i];
    dv[i].run = failing_run;
    dv[i].peer_copy = failing_peer_copy;
    dp[i] = &dv[i];
  }
  /* the forward pass on device 1; a peer copy of the ring to device 2; the update on device 0 */
  static const int kernels[3] = {DTRAIN_K_TANH, -1, DTRAIN_K_SGD};
  static const int where[3] = {1, 2, 0};
  static const char *const want[3] = {"replica 1: dt_tanh: device cuda-emu:1: injected kernel failure on cuda-emu:1",
                                      "replica 0: all-reduce of the gradients over the devices",
                                      "replica 0: dt_optim_step_graph: device cuda-emu:0: injected"};
  for (int ki = 0; ki < 3; ki++) {
    model m;
    model_init(&m, 5);
    config c;
    memset(&c, 0, sizeof c);
    c.opt = DTRAIN_OPTIM_SGD;
    dt_optim *opt = make_opt(m.P, &c);
    dt_strategy_options sd = dt_strategy_mirrored(0);
    sd.devices = dp;
    sd.ndevices = 3;
    sd.spin_us = -1;
    dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    if (!s) return;
    size_t n = dt_params_size(m.P);
    float before[PMAX], loss;
    dt_minibatch b = rows_at(0, 30);
    CHECK(dt_strategy_step(s, &b, &loss) == DTRAIN_OK);
    memcpy(before, dt_params_data(m.P), n * sizeof(float));
    fail_dev = dp[where[ki]];
    fail_kernel = kernels[ki];
    fail_peer = ki == 1;
    b = rows_at(30, 30);
    dt_result rc = dt_strategy_step(s, &b, &loss);
    CHECK(rc == DTRAIN_ERR_IO);
    CHECK_MSG(strstr(dt_last_error(), want[ki]) != NULL, "%s", dt_last_error());
    if (ki == 1)
      CHECK_MSG(strstr(dt_last_error(), "-> cuda-emu:2: device cuda-emu:2: injected peer copy failure") != NULL, "%s",
                dt_last_error());
    CHECK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0); /* the params are intact */
    CHECK(replicas_equal_params(s, before, n));                       /* so is every device copy */
    CHECK(dt_optim_steps(opt) == 1);
    dt_strategy_stats st;
    dt_strategy_stats_get(s, &st);
    CHECK(st.failed_replica == (ki == 0 ? 1 : 0) && st.steps == 1);
    dt_replica_stats rs;
    dt_strategy_replica_stats(s, ki == 0 ? 1 : 0, &rs);
    CHECK(rs.result == DTRAIN_ERR_IO);
    /* and it goes on */
    fail_kernel = -1;
    fail_peer = 0;
    CHECK(dt_strategy_step(s, &b, &loss) == DTRAIN_OK);
    CHECK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) != 0);
    CHECK(replicas_equal_params(s, dt_params_data(m.P), n));
    CHECK(dt_optim_steps(opt) == 2);
    dt_strategy_destroy(s);
    dt_optim_destroy(opt);
    dt_params_destroy(m.P);
  }
}

/* check_numerics on devices: a NaN input stops the step on its replica,
 * before any update. */
static void test_numerics(void) {
  model m;
  model_init(&m, 5);
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_SGD;
  dt_optim *opt = make_opt(m.P, &c);
  dt_strategy_options sd = dt_strategy_mirrored(0);
  sd.devices = devs;
  sd.ndevices = 2;
  sd.spin_us = -1;
  sd.check_numerics = 1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  if (!s) return;
  float x[20 * NF], before[PMAX], loss;
  memcpy(x, data_x, sizeof x);
  x[15 * NF + 2] = NAN; /* row 15: replica 1's shard */
  dt_minibatch b = rows_at(0, 20);
  b.x = x;
  size_t n = dt_params_size(m.P);
  memcpy(before, dt_params_data(m.P), n * sizeof(float));
  CHECK(dt_strategy_step(s, &b, &loss) == DTRAIN_ERR_NONFINITE);
  CHECK_MSG(strstr(dt_last_error(), "replica 1: ") != NULL && strstr(dt_last_error(), "NaN") != NULL, "%s",
            dt_last_error());
  CHECK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0);
  CHECK(replicas_equal_params(s, before, n));
  b.x = data_x;
  CHECK(dt_strategy_step(s, &b, &loss) == DTRAIN_OK);
  /* dt_strategy_sync: the params' values to every device */
  dt_params_data(m.P)[3] = 0.25f;
  CHECK(dt_strategy_sync(s) == DTRAIN_OK);
  CHECK(replicas_equal_params(s, dt_params_data(m.P), n));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static void test_refusals(void) {
  model m;
  model_init(&m, 5);
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_SGD;
  dt_optim *opt = make_opt(m.P, &c);
  float store_data[PMAX];
  memset(store_data, 0, sizeof store_data);
  dt_pstore *ps = dt_pstore_create_local(store_data, dt_params_size(m.P), 1, 0, DTRAIN_ASYNC_HOGWILD, -1);
  dt_strategy_options cases[3] = {dt_strategy_async(2, 0), dt_strategy_central_storage(2), dt_strategy_parameter_server(ps, 0)};
  const char *names[3] = {"async", "central_storage", "parameter_server"};
  for (int i = 0; i < 3; i++) {
    dt_strategy_options sd = cases[i];
    sd.devices = devs;
    sd.ndevices = i == 2 ? 1 : 2;
    if (i == 2) sd.replicas = 0;
    CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL);
    CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(dt_last_error(), names[i]) != NULL && strstr(dt_last_error(), "devices") != NULL, "%s",
              dt_last_error());
  }
  dt_strategy_options sd = dt_strategy_mirrored(3); /* 3 replicas on 2 devices */
  sd.devices = devs;
  sd.ndevices = 2;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  sd = dt_strategy_one_device();
  sd.devices = devs;
  sd.ndevices = 2;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  dt_device *holes[2] = {devs[0], NULL};
  sd = dt_strategy_mirrored(0);
  sd.devices = holes;
  sd.ndevices = 2;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  sd.devices = NULL;
  CHECK(dt_strategy_create(m.P, opt, model_step, &m, &sd) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  dt_pstore_destroy(ps);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* ---- dt_fit around a strategy on devices ---- */
typedef struct fit_ctx {
  dt_strategy *s;
} fit_ctx;

static dt_result fit_step(dt_fit_batch *fb, void *user) {
  fit_ctx *c = (fit_ctx *)user;
  dt_minibatch b = rows_at((fb->epoch * 4 + fb->index) * 8 % (NS - 24), 24);
  float loss = 0.0f;
  dt_result r = dt_strategy_step(c->s, &b, &loss);
  fb->loss = loss;
  fb->samples = b.rows;
  return r;
}

/* 2 epochs x 4 steps; the final params and the last epoch's train loss. */
static int fit_run(int ndev, float *params, double *last_loss) {
  model m;
  model_init(&m, 5);
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_ADAM;
  dt_optim *opt = make_opt(m.P, &c);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  sd.spin_us = -1;
  if (ndev) {
    sd.replicas = 0;
    sd.devices = devs;
    sd.ndevices = ndev;
  }
  fit_ctx ctx;
  ctx.s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK_MSG(ctx.s != NULL, "%s", dt_last_error());
  int ok = 0;
  if (ctx.s) {
    dt_fit_options fd;
    memset(&fd, 0, sizeof fd);
    fd.epochs = 2;
    fd.steps_per_epoch = 4;
    fd.train_step = fit_step;
    fd.user = &ctx;
    fd.params = m.P;
    fd.optim = opt;
    fd.graph = dt_strategy_graph(ctx.s, 0);
    fd.progress = DTRAIN_FIT_PROGRESS_QUIET;
    dt_fit_result res;
    dt_result r = dt_fit(&fd, &res);
    CHECK_MSG(r == DTRAIN_OK, "%s", dt_last_error());
    ok = r == DTRAIN_OK;
    *last_loss = res.last.train_loss;
    CHECK(dt_optim_steps(opt) == 8);
  }
  memcpy(params, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
  dt_strategy_destroy(ctx.s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  return ok;
}

static void test_fit(void) {
  static float p_cpu[PMAX], p_dev[PMAX];
  double l_cpu = 0.0, l_dev = 0.0;
  if (!(dt_build_features() & DTRAIN_FEATURE_FIT)) TH_SKIP("dt_fit is compiled out (DTRAIN_NO_FIT)");
  if (!fit_run(0, p_cpu, &l_cpu) || !fit_run(2, p_dev, &l_dev)) return;
  CHECK_MSG(rel_diff(p_dev, p_cpu, model_size()) <= 1e-4, "%.3g", rel_diff(p_dev, p_cpu, model_size()));
  CHECK_NEAR(l_dev, l_cpu, 1e-5 * (1.0 + fabs(l_cpu)));
  CHECK(l_cpu > 0.0);
}

/* ---- multi_worker_mirrored: forked processes, each with its devices ---- */
#if defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
static void test_mwm(void) { TH_SKIP("networking or threads not compiled in"); }
#else
#  include <signal.h>
#  include <sys/wait.h>
#  include <unistd.h>

#  define MAXW 2
static int lfd[MAXW];
static char addr[MAXW][64];
static char *addrs[MAXW];
static int child_fail;
#  define CK(cond)                                                                                          \
    do {                                                                                                    \
      if (!(cond)) {                                                                                        \
        child_fail++;                                                                                       \
        fprintf(stderr, "CHILD FAIL %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond, dt_last_error()); \
      }                                                                                                     \
    } while (0)

/* fail_step >= 0: at that step rank 1 feeds a NaN (its own error is
 * NONFINITE, rank 0's PEER naming rank 1; nobody updates), and the parity
 * is not checked (that step is missing). */
static void mwm_child(int W, int N, int rank, const config *c, const float *ref, const float *ref_loss,
                      int fail_step) {
  dt_cluster cl;
  memset(&cl, 0, sizeof cl);
  cl.workers = W;
  cl.worker_addr = addrs;
  cl.role = DTRAIN_ROLE_WORKER;
  cl.index = rank;
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 5;
  o.connect_timeout_s = 10;
  o.quiet = 1;
  o.listen_fd = lfd[rank];
  dt_comm *comm = dt_comm_create_tcp(&cl, &o);
  CK(comm != NULL);
  if (!comm) return;
  model m;
  model_init(&m, 5 + 1000 * (uint64_t)rank); /* rank 0's values win */
  m.sum_loss = c->sum_loss;
  dt_optim *opt = make_opt(m.P, c);
  dt_device *mine[2];
  for (int i = 0; i < N; i++) mine[i] = dt_cuda_device_create(10 * rank + i);
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(comm, 0);
  sd.devices = mine;
  sd.ndevices = N;
  sd.spin_us = -1;
  if (c->sum_loss) sd.loss = DTRAIN_LOSS_SUM;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CK(s != NULL);
  size_t n = dt_params_size(m.P);
  /* this rank's part of the global batch: the shards of replicas rank*N .. */
  int64_t tot = W * N, base = c->B / tot, extra = c->B % tot, first = 0, rows = 0;
  for (int q = 0; q < (rank + 1) * N; q++) {
    int64_t r = base + (q < extra ? 1 : 0);
    if (q < rank * N) first += r;
    else rows += r;
  }
  float loss[K];
  static float bad_x[NS * NF], before[PMAX];
  for (int k = 0; s && k < K; k++) {
    dt_minibatch b = rows_at(batch_first(k, c->B) + first, rows);
    if (k == fail_step) {
      memcpy(before, dt_params_data(m.P), n * sizeof(float));
      if (rank == 1) {
        memcpy(bad_x, b.x, (size_t)rows * NF * sizeof(float));
        bad_x[1] = NAN;
        b.x = bad_x;
      }
    }
    dt_result rc = dt_strategy_step(s, &b, &loss[k]);
    if (k == fail_step) {
      CK(rc == (rank == 1 ? DTRAIN_ERR_NONFINITE : DTRAIN_ERR_PEER));
      if (rank == 0) CK(strstr(dt_last_error(), "rank 1 failed its part of step") != NULL);
      CK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0);
      CK(replicas_equal_params(s, before, n));
      continue;
    }
    CK(rc == DTRAIN_OK);
    if (rc != DTRAIN_OK) break;
    CK(replicas_equal_params(s, dt_params_data(m.P), n));
  }
  if (s && fail_step < 0) {
    CK(rel_diff(dt_params_data(m.P), ref, n) <= 2e-5);
    for (int k = 0; k < K; k++) CK(fabs((double)loss[k] - (double)ref_loss[k]) <= 2e-5 * (1.0 + fabs((double)ref_loss[k])));
  }
  if (s) {
    float p0[PMAX];
    memcpy(p0, dt_params_data(m.P), n * sizeof(float));
    CK(dt_comm_broadcast(comm, rank, p0, n, 0) == DTRAIN_OK);
    CK(memcmp(p0, dt_params_data(m.P), n * sizeof(float)) == 0); /* bitwise equal to rank 0 */
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt); /* its state lives on device 0: before the devices */
  for (int i = 0; i < N; i++) dt_cuda_device_destroy(mine[i]);
  dt_params_destroy(m.P);
  dt_comm_destroy(comm);
}

static void mwm_world(int W, int N, const config *c, int fail_step) {
  static float ref[PMAX];
  float ref_loss[K];
  if (fail_step < 0 && !train(c, dt_strategy_mirrored(W * N), 0, ref, ref_loss)) return;
  for (int r = 0; r < W; r++) {
    if (dt__net_listen("127.0.0.1:0", &lfd[r]) != DTRAIN_OK) {
      CHECK_MSG(0, "listen: %s", dt_last_error());
      return;
    }
    snprintf(addr[r], sizeof addr[r], "127.0.0.1:%d", dt__net_port(lfd[r]));
    addrs[r] = addr[r];
  }
  pid_t pid[MAXW];
  fflush(NULL);
  for (int r = 0; r < W; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      alarm(60);
      for (int j = 0; j < W; j++)
        if (j != r) close(lfd[j]);
      child_fail = 0;
      mwm_child(W, N, r, c, ref, ref_loss, fail_step);
      fflush(NULL);
      _exit(child_fail ? 1 : 0);
    }
  }
  for (int r = 0; r < W; r++) {
    int st = 0;
    if (pid[r] > 0) waitpid(pid[r], &st, 0);
    CHECK_MSG(pid[r] > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
              "%d x %d devices (sum %d, failing step %d): rank %d ended with status %d", W, N, c->sum_loss, fail_step,
              r, st);
  }
  for (int r = 0; r < W; r++) close(lfd[r]);
}

static void test_mwm(void) {
  config c;
  memset(&c, 0, sizeof c);
  c.opt = DTRAIN_OPTIM_SGD;
  c.clip = 0.5f;
  c.B = 29;
  mwm_world(2, 1, &c, -1); /* = mirrored(2) */
  mwm_world(2, 2, &c, -1); /* = mirrored(4) */
  c.clip = 0.0f;
  c.sum_loss = 1;
  mwm_world(2, 2, &c, -1);
  c.sum_loss = 0;
  mwm_world(2, 2, &c, 2); /* rank 1 fails step 2: nobody updates, then it goes on */
}
#endif

int main(void) {
#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
  signal(SIGPIPE, SIG_IGN);
  alarm(240);
#endif
  make_data();
  for (int i = 0; i < MAXD; i++) devs[i] = dt_cuda_device_create(i);
#if defined(DTRAIN_NO_DIST)
  th_skip_item("test_cuda_strategy strategy tests", "compiled out (DTRAIN_NO_DIST): only one_device on a device ran");
  TH_RUN(test_one_device_only);
#elif defined(DTRAIN_NO_THREADS)
  th_skip_item("test_cuda_strategy strategy tests", "threads not compiled in: only one_device on a device ran");
  TH_RUN(test_one_device_only);
#else
  TH_RUN(test_group);
  TH_RUN(test_group_refused);
  TH_RUN(test_parity);
  TH_RUN(test_hooks_in_strategy);
  TH_RUN(test_failures);
  TH_RUN(test_numerics);
  TH_RUN(test_refusals);
  TH_RUN(test_fit);
  TH_RUN(test_mwm);
  /* Again on guarded emulated devices (dt_cuda_emu_guarded_device_create):
   * a host read of device memory in the strategy, the device group or the
   * optimizer would crash here instead of passing. */
  for (int i = 0; i < MAXD; i++) dt_cuda_device_destroy(devs[i]);
  guarded = 1;
  for (int i = 0; i < MAXD; i++) devs[i] = dt_cuda_device_create(i);
  TH_RUN(test_group);
  TH_RUN(test_parity);
  TH_RUN(test_numerics);
  TH_RUN(test_fit);
  TH_RUN(test_mwm);
#endif
  for (int i = 0; i < MAXD; i++) dt_cuda_device_destroy(devs[i]);
  (void)dt_cuda_device_count();
  return th_summary("test_cuda_strategy");
}
