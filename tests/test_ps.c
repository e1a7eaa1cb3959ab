/* tests/test_ps.c -- parameter servers over loopback with forked processes:
 * shard assignment; 1 worker x 1 server with max_staleness 0 equals
 * one_device; 2 workers x 2 servers converge; max_staleness 2 with a slow
 * worker stays within the bound; workers asking for another max_staleness
 * are refused; kill -9 and SIGSTOP of a
 * worker (training goes on, the server logs it); heartbeats keep idle and
 * waiting workers alive; kill -9 and SIGSTOP of a server
 * (workers stop with an error naming it, also two workers at once);
 * restart from a shard checkpoint;
 * bad bytes and bad tokens against a server; silent and slow clients
 * (and a flood of them) never stall a server. */
/* Private transport functions (bad-bytes clients) are static in the
 * amalgamation: compile it into this test. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"
#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "hostile_clients.h"
#endif

#ifdef DTRAIN_NO_DIST
/* The entry points say what is missing. */
static void test_compiled_out(void) {
  int own[1];
  CHECK_ERR(dt_ps_shard(NULL, 1, own), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_DIST");
  CHECK_ERR(dt_ps_serve(NULL, NULL, NULL, NULL, NULL), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_DIST");
  CHECK(dt_pstore_create_tcp(NULL, NULL, NULL, 0) == NULL && strstr(dt_last_error(), "DTRAIN_NO_DIST"));
}
#else
/* Shard assignment works in every build with the distributed parts. */
static void test_shard(void) {
  dt_params *P = dt_params_create(1);
  int64_t s10[1] = {10}, s100[1] = {100}, s40[1] = {40}, s60[1] = {60}, s50[1] = {50};
  dt_params_add(P, "a", 1, s10, dt_init_zeros());
  dt_params_add(P, "b", 1, s100, dt_init_zeros());
  dt_params_add(P, "c", 1, s40, dt_init_zeros());
  dt_params_add(P, "d", 1, s60, dt_init_zeros());
  dt_params_add_buffer(P, "e", 1, s50, dt_init_zeros());
  int own[5], own2[5];
  /* Largest first onto the least loaded: b->0, d->1, e->1 (110), c->0 (140), a->1 (120). */
  CHECK(dt_ps_shard(P, 2, own) == DTRAIN_OK);
  CHECK(own[0] == 1 && own[1] == 0 && own[2] == 0 && own[3] == 1 && own[4] == 1);
  CHECK(dt_ps_shard(P, 2, own2) == DTRAIN_OK);
  CHECK(memcmp(own, own2, sizeof own) == 0);
  /* Balanced: the loads differ by at most the largest parameter. */
  CHECK(dt_ps_shard(P, 3, own) == DTRAIN_OK);
  size_t load[3] = {0, 0, 0};
  const size_t sz[5] = {10, 100, 40, 60, 50};
  for (int i = 0; i < 5; i++) {
    CHECK(own[i] >= 0 && own[i] < 3);
    load[own[i]] += sz[i];
  }
  CHECK(load[0] == 100 && load[1] == 70 && load[2] == 90); /* b | d, a | e, c */
  CHECK(dt_ps_shard(P, 1, own) == DTRAIN_OK);
  for (int i = 0; i < 5; i++) CHECK(own[i] == 0);
  /* More servers than parameters: some get nothing. */
  CHECK(dt_ps_shard(P, 8, own) == DTRAIN_OK);
  for (int i = 0; i < 5; i++) CHECK(own[i] == (i == 1 ? 0 : i == 3 ? 1 : i == 4 ? 2 : i == 2 ? 3 : 4));
  CHECK_ERR(dt_ps_shard(P, 0, own), DTRAIN_ERR_INVALID_ARG, "servers");
  CHECK_ERR(dt_ps_shard(NULL, 2, own), DTRAIN_ERR_NULL_ARG, "params");
  dt_params_destroy(P);
}
#endif /* DTRAIN_NO_DIST */

#if !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "ps_harness.h"

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_strategy_desc(void) {
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  CHECK(strcmp(dt_strategy_kind_name(DTRAIN_STRATEGY_PARAMETER_SERVER), "parameter_server") == 0);
  dt_strategy_options sd = dt_strategy_parameter_server(NULL, 0);
  CHECK(sd.kind == DTRAIN_STRATEGY_PARAMETER_SERVER && sd.replicas == 1);
  CHECK(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_NULL_ARG && strstr(dt_last_error(), "desc.store"));
  dt_pstore *local = dt_pstore_create_local(dt_params_data(m.P), dt_params_size(m.P), 2, 0, DTRAIN_ASYNC_HOGWILD, 0);
  sd = dt_strategy_parameter_server(local, 0);
  sd.replicas = 2;
  CHECK(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG && strstr(dt_last_error(), "1 replica per process"));
  dt_pstore_destroy(local);
  /* Not a worker, or not a server. */
  int port = 1;
  pc x;
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_PS, 0);
  CHECK(dt_pstore_create_tcp(&x.c, m.P, NULL, 0) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
  CHECK_ERR(dt_ps_serve(&x.c, m.P, m.opt, NULL, NULL), DTRAIN_ERR_INVALID_ARG, "not a server");
  CHECK(dt_pstore_create_tcp(&x.c, m.P, NULL, -2) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  model_free(&m);
}

static void test_equals_one_device(void) {
  alarm(30);
  const int steps = 12;
  /* The reference: one_device, SGD with momentum. */
  model r;
  model_init(&r, DTRAIN_OPTIM_SGD, 0.05f);
  dt_strategy_options od = dt_strategy_one_device();
  dt_strategy *rs = dt_strategy_create(r.P, r.opt, step_fn, &r, &od);
  CHECK(rs != NULL);
  for (int t = 0; rs && t < steps; t++) {
    dt_minibatch b = batch_at(t, 24);
    CHECK(dt_strategy_step(rs, &b, NULL) == DTRAIN_OK);
  }
  dt_strategy_destroy(rs);

  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  child srv = spawn_server(&sc, &lfd);
  close(lfd);

  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(2.0, NULL);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    CHECK(ps->gradients == 1 && ps->size == dt_params_size(m.P));
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    for (int t = 0; s && t < steps; t++) {
      dt_minibatch b = batch_at(t, 24);
      dt_result rc = dt_strategy_step(s, &b, NULL);
      CHECK_MSG(rc == DTRAIN_OK, "%s", dt_last_error());
    }
    dt_strategy_stats st;
    if (s) {
      CHECK(dt_strategy_stats_get(s, &st) == DTRAIN_OK);
      CHECK(st.steps == steps && st.kind == DTRAIN_STRATEGY_PARAMETER_SERVER);
      CHECK(st.staleness_max == 0);
      /* the wire: each step a pull request and a push of every float of the
       * one server's shard (16-byte headers), the weights and an answer back */
      uint64_t shard = 0;
      dt_param_info info;
      for (int p = 0; dt_params_info(m.P, p, &info) == DTRAIN_OK; p++) shard += info.size;
      uint64_t per = 16 + 16 + 4 * shard;
      CHECK_MSG(st.wire_bytes == steps * per && st.wire_bytes_received == steps * per,
                "sent %llu, received %llu, expected %llu each", (unsigned long long)st.wire_bytes,
                (unsigned long long)st.wire_bytes_received, (unsigned long long)(steps * per));
      dt_strategy_reset_stats(s);
      CHECK(dt_strategy_stats_get(s, &st) == DTRAIN_OK && st.wire_bytes == 0 && st.wire_bytes_received == 0);
    }
    /* The last push is on the server: pull once more. */
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 0, 0, dt_params_data(m.P), dt_params_size(m.P), &tk) == DTRAIN_OK);
    CHECK(tk.version == (uint64_t)steps);
    CHECK(dt_pstore_version(ps) == (uint64_t)steps);
    const float *a = dt_params_data(r.P), *b = dt_params_data(m.P);
    double worst = 0;
    for (size_t i = 0; i < dt_params_size(m.P); i++) worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    CHECK_MSG(worst <= 1e-6, "max difference %g", worst);
    /* And it moved. */
    model init;
    model_init(&init, DTRAIN_OPTIM_SGD, 0.05f);
    CHECK(memcmp(dt_params_data(init.P), b, dt_params_size(m.P) * sizeof(float)) != 0);
    model_free(&init);
    dt_pstore_leave(ps, 0);
    CHECK_ERR(dt_pstore_pull(ps, 0, 1, dt_params_data(m.P), dt_params_size(m.P), &tk), DTRAIN_ERR_STATE, "left");
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
  }
  model_free(&m);
  model_free(&r);
  child_wait(&srv);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  CHECK_MSG(strstr(srv.out, "finished (BYE)"), "%s", srv.out);
  alarm(0);
}

/* The overlapped loop (desc.overlap, dt_strategy_run), 1 worker and 2
 * servers, SGD with momentum: step t computes on the parameters of the pull
 * of clock t - 1 (its own last update not yet in them) while the thread
 * pushes step t - 1 and pulls clock t. The same run by hand: S_{t+1} =
 * S_t - update(grad at S_{max(t-1,0)}), and the params end holding S_T.
 * Each push after the first says it was computed one version back
 * (staleness 1, counted by the servers). The plain sequence (every step on
 * S_t) ends elsewhere, so the check tells the two apart. */
static int64_t ov_rows = 24;
static dt_result ov_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user;
  (void)replica;
  *out = batch_at(step, ov_rows);
  return DTRAIN_OK;
}

static void ps_reference(int steps, int delayed, float *out) {
  model r;
  model_init(&r, DTRAIN_OPTIM_SGD, 0.05f);
  size_t n = dt_params_size(r.P);
  float *S = dt_params_data(r.P), *lag = (float *)malloc(n * sizeof(float)), *W = (float *)malloc(n * sizeof(float)),
        *G = (float *)malloc(n * sizeof(float));
  dt_graph *g = dt_graph_create(r.P, NULL);
  CHECK(lag && W && G && g);
  for (int t = 0; g && lag && W && G && t < steps; t++) {
    memcpy(W, delayed && t > 0 ? lag : S, n * sizeof(float));
    memcpy(lag, S, n * sizeof(float));
    memset(G, 0, n * sizeof(float));
    CHECK(dt_graph_bind(g, W, G) == DTRAIN_OK);
    dt_graph_reset(g);
    dt_minibatch b = batch_at(t, ov_rows);
    CHECK(dt_backward(g, step_fn(g, 0, &b, &r)) == DTRAIN_OK);
    CHECK(dt_optim_update(r.opt, S, G, 0, n) == DTRAIN_OK);
    dt_optim_advance(r.opt);
  }
  memcpy(out, S, n * sizeof(float));
  dt_graph_destroy(g);
  free(lag);
  free(W);
  free(G);
  model_free(&r);
}

static void test_overlap_delayed(void) {
  alarm(40);
  const int steps = 16;
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  size_t n = dt_params_size(m.P);
  float *want = (float *)malloc(n * sizeof(float)), *plain = (float *)malloc(n * sizeof(float));
  CHECK(want && plain);
  if (!want || !plain) return;
  ps_reference(steps, 1, want);
  ps_reference(steps, 0, plain);
  int lfd[2], port[2];
  CHECK(listen_fds(2, lfd, port));
  child srv[2];
  spawn_servers(1, 2, port, lfd, 0.05f, srv);
  for (int i = 0; i < 2; i++) close(lfd[i]);
  pc x;
  pc_make(&x, 1, 2, port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(4.0, NULL);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 2);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 2);
    sd.overlap = 1;
    dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    float loss = -1.0f;
    CHECK_MSG(s && dt_strategy_run(s, steps, ov_next, NULL, &loss) == DTRAIN_OK, "%s", dt_last_error());
    CHECK(loss > 0.0f);
    const float *got = dt_params_data(m.P);
    double worst = 0.0, apart = 0.0;
    for (size_t i = 0; i < n; i++) {
      worst = fmax(worst, fabs((double)got[i] - (double)want[i]));
      apart = fmax(apart, fabs((double)plain[i] - (double)want[i]));
    }
    CHECK_MSG(worst <= 1e-6, "max difference from the delayed run by hand %g", worst);
    CHECK_MSG(apart > 1e-3, "the plain run ends %g from the delayed one: the test cannot tell them apart", apart);
    dt_strategy_stats st;
    CHECK(s && dt_strategy_stats_get(s, &st) == DTRAIN_OK);
    CHECK_MSG(st.steps == steps && st.staleness_hist[0] == 1 && st.staleness_hist[1] == steps - 1 &&
                  st.staleness_max == 1,
              "steps %lld, staleness 0: %lld, 1: %lld, max %lld", (long long)st.steps, (long long)st.staleness_hist[0],
              (long long)st.staleness_hist[1], (long long)st.staleness_max);
    /* the servers hold what the params hold: every push applied, the last pull after it */
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    float *again = (float *)calloc(n, sizeof(float)); /* (zeros in the padding, as in the params) */
    CHECK(again && dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK(again && dt_pstore_pull(ps, 0, 0, again, n, &tk) == DTRAIN_OK && tk.version == (uint64_t)steps);
    CHECK(again && memcmp(again, got, n * sizeof(float)) == 0);
    free(again);
    /* a second run goes on from there; dt_strategy_step takes the plain path */
    CHECK(s && dt_strategy_run(s, 3, ov_next, NULL, NULL) == DTRAIN_OK);
    dt_minibatch b = batch_at(0, ov_rows);
    CHECK(s && dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    CHECK(dt_pstore_version(ps) == (uint64_t)steps + 4);
    dt_pstore_leave(ps, 0);
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
  }
  for (int i = 0; i < 2; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0, "server %d status %d: %s", i, srv[i].status, srv[i].out);
  }
  /* overlap computes a clock behind: not with the lock-step bound */
  CHECK(listen_fds(1, lfd, port));
  server_cfg sc = server_defaults(1, 1, 0, port, lfd[0]);
  child one = spawn_server(&sc, lfd);
  close(lfd[0]);
  pc_make(&x, 1, 1, port, DTRAIN_ROLE_WORKER, 0);
  ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    sd.overlap = 1;
    CHECK(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd) == NULL);
    CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "max_staleness 0"), "%s",
              dt_last_error());
    dt_pstore_leave(ps, 0);
    dt_pstore_destroy(ps);
  }
  child_wait(&one);
  model_free(&m);
  free(want);
  free(plain);
  alarm(0);
}

static void test_converge_2x2(void) {
  alarm(40);
  converge_2x2(NULL, 0.05f);
  alarm(0);
}

/* Bounded staleness over TCP, k = 2: worker 1 computes 40 ms longer per step,
 * worker 0 would run ahead. The library's definitions (dt_strategy.h,
 * "Staleness"; dt_ps.c, the SSP rule): k bounds the step clocks -- a pull of
 * clock t waits until every live worker pushed clock t-k-1 -- so the clock gap
 * a worker sees at a pull (dt_replica_stats.clock_gap_max) is at most k; the
 * staleness of a push (staleness_max) counts the updates others pushed to a
 * shard between its pull and its push (in shard versions, the most over the
 * servers), which that rule bounds by (W-1)(2k+1), not by k. */
static int parse_stats(const char *out, long long *steps, long long *gap, long long *stale) {
  const char *p = strstr(out, "stats steps ");
  return p && sscanf(p, "stats steps %lld gap %lld stale %lld", steps, gap, stale) == 3;
}

/* One event of a worker_cfg.events_fd pipe (see event_say). */
typedef struct event {
  char kind;
  int worker, step;
} event;

/* The next event from the pipe (blocking); 0 at its end. */
static int event_next(int fd, event *e) {
  char line[32], c;
  size_t n = 0;
  for (;;) {
    if (read(fd, &c, 1) != 1) return 0;
    if (c == '\n') break;
    if (n < sizeof line - 1) line[n++] = c;
  }
  line[n] = '\0';
  return sscanf(line, "%c %d %d", &e->kind, &e->worker, &e->step) == 3;
}

/* Reads events until worker w's event of this kind for this step; 0 if the pipe ends first. */
static int event_wait(int fd, char kind, int w, int step) {
  event e;
  while (event_next(fd, &e))
    if (e.kind == kind && e.worker == w && e.step == step) return 1;
  return 0;
}

static void test_staleness_bound(void) {
  alarm(40);
  enum { W = 2, M = 2, K = 2, STEPS = 16 };
  const double slow = 0.04;
  int lfd[M], ports[M], ev[2];
  CHECK(listen_fds(M, lfd, ports));
  CHECK(pipe(ev) == 0);
  child srv[M], wk[W];
  spawn_servers(W, M, ports, lfd, 0.02f, srv);
  for (int i = 0; i < W; i++) {
    worker_cfg wc = worker_defaults(W, M, i, ports);
    wc.k = K;
    wc.steps = STEPS;
    wc.target = 0.5f;
    wc.events_fd = ev[1];
    if (i == 1) wc.step_sleep_s = slow;
    wk[i] = spawn_worker(&wc, lfd, M);
  }
  for (int i = 0; i < M; i++) close(lfd[i]);
  close(ev[1]);
  long long steps[W], gap[W], stale[W];
  for (int i = 0; i < W; i++) {
    child_wait(&wk[i]);
    CHECK_MSG(wk[i].status == 0, "worker %d status %d: %s", i, wk[i].status, wk[i].out);
    /* Training made progress: the final loss is below half the initial one. */
    CHECK_MSG(strstr(wk[i].out, "loss "), "%s", wk[i].out);
    int ok = parse_stats(wk[i].out, &steps[i], &gap[i], &stale[i]);
    CHECK_MSG(ok, "worker %d: no stats: %s", i, wk[i].out);
    if (!ok) steps[i] = gap[i] = stale[i] = -1;
    CHECK_MSG(steps[i] == STEPS, "worker %d: %lld steps", i, steps[i]);
    /* Never beyond the bound: at most k clocks ahead of the slowest at a pull, and
     * at most (W-1)(2k+1) updates by others between a pull and its push. */
    CHECK_MSG(gap[i] >= 0 && gap[i] <= K, "worker %d: clock gap %lld > k = %d", i, gap[i], K);
    CHECK_MSG(stale[i] >= 0 && stale[i] <= (W - 1) * (2 * K + 1), "worker %d: staleness %lld > %d", i, stale[i],
              (W - 1) * (2 * K + 1));
  }
  /* The bound seen from outside, in the order of the events: a worker computes
   * step t only after every other one computed step t-k-1 (whose push came
   * after that, and the pull of t waits for it). Not vacuous: the fast worker
   * asked for a step before the slow one had computed what that step needs,
   * so its pull waited (the slow worker computes 40 ms longer per step). */
  int computed[W] = {0}, slow_at_ask = -1, waited = 0, beyond = 0, events = 0;
  event e;
  while (event_next(ev[0], &e)) {
    events++;
    if (e.worker < 0 || e.worker >= W) continue;
    if (e.kind == 'a' && e.worker == 0) slow_at_ask = computed[1];
    if (e.kind != 'c') continue;
    for (int j = 0; j < W; j++) {
      if (j != e.worker && computed[j] < e.step - K) {
        if (!beyond++)
          CHECK_MSG(0, "worker %d computed step %d when worker %d had computed %d steps (k = %d)", e.worker, e.step,
                    j, computed[j], K);
      }
    }
    if (e.worker == 0 && slow_at_ask >= 0 && slow_at_ask < e.step - K) waited++;
    computed[e.worker]++;
  }
  close(ev[0]);
  CHECK_MSG(computed[0] == STEPS && computed[1] == STEPS, "%d events: %d and %d steps computed", events, computed[0],
            computed[1]);
  CHECK_MSG(waited >= 1, "the fast worker's pulls never waited for the slow worker");
  /* ... the fast worker ran ahead right up to the bound (the library's own count) ... */
  CHECK_MSG(gap[0] == K, "the fast worker's largest clock gap is %lld, not k = %d", gap[0], K);
  /* ... and the slow one computed on parameters that the fast one updated meanwhile. */
  CHECK_MSG(stale[1] >= 1, "the slow worker's staleness_max is %lld", stale[1]);
  for (int i = 0; i < M; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0, "server %d status %d: %s", i, srv[i].status, srv[i].out);
    CHECK_MSG(strstr(srv[i].out, "joined (max_staleness 2)"), "%s", srv[i].out);
    CHECK_MSG(strstr(srv[i].out, "lost") == NULL, "%s", srv[i].out);
  }
  alarm(0);
}

/* Workers of one job must ask for the same max_staleness: the first to join
 * sets it on each server, a worker asking for another one is refused (with
 * the setting named on both sides), and a correct worker can still take its
 * place. */
static void test_staleness_mismatch(void) {
  alarm(40);
  int lfd[2], ports[2];
  CHECK(listen_fds(2, lfd, ports));
  child srv[2];
  spawn_servers(2, 2, ports, lfd, 0.02f, srv);
  close(lfd[0]);
  close(lfd[1]);
  model m0, m1;
  model_init(&m0, DTRAIN_OPTIM_SGD, 0.05f);
  model_init(&m1, DTRAIN_OPTIM_SGD, 0.05f);
  pc x0, x1;
  pc_make(&x0, 2, 2, ports, DTRAIN_ROLE_WORKER, 0);
  pc_make(&x1, 2, 2, ports, DTRAIN_ROLE_WORKER, 1);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt_pstore *ps0 = dt_pstore_create_tcp(&x0.c, m0.P, &o, 2);
  CHECK_MSG(ps0 != NULL, "%s", dt_last_error());
  /* Worker 1 asks for 1 (then for unbounded): refused by ps 0, never gets to ps 1. */
  dt_pstore *bad = dt_pstore_create_tcp(&x1.c, m1.P, &o, 1);
  CHECK(bad == NULL);
  CHECK_ERR(dt_last_result(), DTRAIN_ERR_MISMATCH, "it asks for max_staleness 1, the other workers for 2");
  CHECK_MSG(strstr(dt_last_error(), "worker 1: join: refused by ps 0 (127.0.0.1:"), "%s", dt_last_error());
  dt_pstore_destroy(bad);
  bad = dt_pstore_create_tcp(&x1.c, m1.P, &o, DTRAIN_STALENESS_UNBOUNDED);
  CHECK(bad == NULL);
  CHECK_ERR(dt_last_result(), DTRAIN_ERR_MISMATCH, "max_staleness -1, the other workers for 2");
  dt_pstore_destroy(bad);
  /* The right one is admitted in its place, and both train a few steps. */
  dt_pstore *ps1 = dt_pstore_create_tcp(&x1.c, m1.P, &o, 2);
  CHECK_MSG(ps1 != NULL, "%s", dt_last_error());
  if (ps0 && ps1) {
    CHECK(ps0->max_staleness == 2 && ps1->max_staleness == 2);
    dt_strategy_options sd0 = dt_strategy_parameter_server(ps0, 2), sd1 = dt_strategy_parameter_server(ps1, 2);
    dt_strategy *s0 = dt_strategy_create(m0.P, m0.opt, step_fn, &m0, &sd0);
    dt_strategy *s1 = dt_strategy_create(m1.P, m1.opt, step_fn, &m1, &sd1);
    CHECK(s0 && s1);
    /* One thread, two workers: alternating steps never wait for the bound. */
    for (int t = 0; s0 && s1 && t < 4; t++) {
      dt_minibatch b = batch_at(2 * t, 16);
      CHECK_MSG(dt_strategy_step(s0, &b, NULL) == DTRAIN_OK, "%s", dt_last_error());
      b = batch_at(2 * t + 1, 16);
      CHECK_MSG(dt_strategy_step(s1, &b, NULL) == DTRAIN_OK, "%s", dt_last_error());
    }
    dt_pstore_leave(ps0, 0);
    dt_pstore_leave(ps1, 1);
    dt_strategy_destroy(s0);
    dt_strategy_destroy(s1);
  }
  dt_pstore_destroy(ps0);
  dt_pstore_destroy(ps1);
  model_free(&m0);
  model_free(&m1);
  for (int i = 0; i < 2; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0, "server %d status %d: %s", i, srv[i].status, srv[i].out);
    CHECK_MSG(strstr(srv[i].out, "lost") == NULL, "%s", srv[i].out);
  }
  /* ps 0 logged the refusals with the reason; ps 1 never saw the bad worker. */
  CHECK_MSG(strstr(srv[0].out, "ps 0: refused worker 1 (127.0.0.1:2): it asks for max_staleness 1, the other workers "
                   "for 2"),
            "%s", srv[0].out);
  CHECK_MSG(strstr(srv[1].out, "refused") == NULL, "%s", srv[1].out);
  alarm(0);
}

/* kill -9 (how = 0) or SIGSTOP (how = 1) of worker 1 after 5 steps. */
static void worker_fault(int how) {
  alarm(40);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.lr = 0.02f;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(2, 1, 0, &port), w1 = worker_defaults(2, 1, 1, &port);
  w0.steps = 30;
  w0.target = 0.5f;
  if (how == 0) w1.die_at = 5;
  else w1.stop_at = 5;
  child a = spawn_worker(&w0, &lfd, 1), b = spawn_worker(&w1, &lfd, 1);
  close(lfd);
  child_wait(&a);
  CHECK_MSG(a.status == 0, "worker 0 status %d: %s", a.status, a.out);
  child_wait(&srv);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  /* Why the server let worker 1 go, in its own words: the connection closed
   * (kill -9), or its deadline of 2 s passed with nothing heard (SIGSTOP). */
  CHECK_MSG(strstr(srv.out, "ps 0: worker 1 (") && strstr(srv.out, "lost: ") &&
                strstr(srv.out, "going on with 1 worker"),
            "%s", srv.out);
  if (how == 0) CHECK_MSG(strstr(srv.out, "connection closed by the peer"), "%s", srv.out);
  if (how == 1) CHECK_MSG(strstr(srv.out, "nothing heard") && strstr(srv.out, "(deadline 2.0 s)"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "worker 0 (127.0.0.1:1) finished (BYE)"), "%s", srv.out);
  if (how == 1) kill(b.pid, SIGKILL);
  child_wait(&b);
  CHECK(b.status == 128 + SIGKILL);
  alarm(0);
}

/* Heartbeats: worker 1 idles for 2.5 deadlines between two steps (its heartbeat
 * thread keeps it alive), while worker 0 waits that long for it in lock-step
 * (the server's heartbeats keep its wait alive). Nobody is lost. The events
 * show that worker 0 was waiting for worker 1 across the idle time: it asked
 * for step 3 before worker 1 woke, and could go on to step 4 only after. */
static void test_heartbeats(void) {
  alarm(40);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.timeout = 1.0;
  sc.lr = 0.02f;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(2, 1, 0, &port), w1 = worker_defaults(2, 1, 1, &port);
  w0.timeout = w1.timeout = 1.0;
  w0.k = w1.k = 0;
  w0.steps = w1.steps = 6;
  w1.sleep_at = 3;
  w1.sleep_s = 2.5;
  int ev[2];
  CHECK(pipe(ev) == 0);
  w0.events_fd = w1.events_fd = ev[1];
  child a = spawn_worker(&w0, &lfd, 1), b = spawn_worker(&w1, &lfd, 1);
  close(lfd);
  close(ev[1]);
  child_wait(&a);
  child_wait(&b);
  child_wait(&srv);
  int asked3 = -1, woke = -1, asked4 = -1, i = 0;
  event e;
  for (; event_next(ev[0], &e); i++) {
    if (e.kind == 'a' && e.worker == 0 && e.step == 3) asked3 = i;
    if (e.kind == 'z' && e.worker == 1) woke = i;
    if (e.kind == 'a' && e.worker == 0 && e.step == 4) asked4 = i;
  }
  close(ev[0]);
  CHECK_MSG(asked3 >= 0 && woke > asked3 && asked4 > woke, "events: worker 0 asked for step 3 at %d, for step 4 at %d; "
            "worker 1 woke at %d", asked3, asked4, woke);
  CHECK_MSG(a.status == 0 && b.status == 0, "workers %d %d: %s / %s", a.status, b.status, a.out, b.out);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  CHECK_MSG(strstr(srv.out, "lost") == NULL, "%s", srv.out);
  alarm(0);
}

static void test_worker_killed(void) { worker_fault(0); }
static void test_worker_stopped(void) { worker_fault(1); }

/* kill -9 (how = 0) or SIGSTOP (how = 1) of server 1 while worker 0 trains:
 * the worker waits at step 5 until the server is dead (or stopped), and its
 * very next call, the pull of step 5, fails naming the server -- at once
 * (the connection closed) or when its own deadline passes (nothing heard). */
static void server_fault(int how) {
  alarm(40);
  int lfd[2], ports[2], go[2];
  CHECK(listen_fds(2, lfd, ports));
  CHECK(pipe(go) == 0);
  child srv[2];
  spawn_servers(1, 2, ports, lfd, 0.05f, srv);
  worker_cfg wc = worker_defaults(1, 2, 0, ports);
  wc.steps = 1000000;
  wc.progress_at = 5;
  wc.go_fd = go[0];
  child w = spawn_worker(&wc, lfd, 2);
  close(lfd[0]);
  close(lfd[1]);
  close(go[0]);
  char c = 0;
  while (read(w.rfd, &c, 1) == 1 && c != 'P') {
  }
  CHECK(c == 'P');
  kill(srv[1].pid, how == 0 ? SIGKILL : SIGSTOP);
  int st = 0;
  if (how == 0) child_wait(&srv[1]); /* gone: its sockets are closed */
  else CHECK(waitpid(srv[1].pid, &st, WUNTRACED) == srv[1].pid && WIFSTOPPED(st));
  CHECK(write(go[1], "g", 1) == 1);
  close(go[1]);
  child_wait(&w);
  CHECK_MSG(w.status == 6, "worker status %d: %s", w.status, w.out);
  CHECK_MSG(strstr(w.out, "E ") && strstr(w.out, "worker 0: pull #5: receive from ps 1 (127.0.0.1:"), "%s", w.out);
  if (how == 0) CHECK_MSG(strstr(w.out, "connection closed by the peer"), "%s", w.out);
  if (how == 1) {
    CHECK_MSG(strstr(w.out, "timed out"), "%s", w.out);
    kill(srv[1].pid, SIGKILL);
    child_wait(&srv[1]);
  }
  CHECK(srv[1].status == 128 + SIGKILL);
  /* The other server hears the worker's abort, logs it, and ends: nobody finished. */
  child_wait(&srv[0]);
  CHECK_MSG(srv[0].status == 10 + 502 % 100, "server 0 status %d: %s", srv[0].status, srv[0].out);
  CHECK_MSG(strstr(srv[0].out, "worker 0 (") && strstr(srv[0].out, "lost"), "%s", srv[0].out);
  alarm(0);
}

/* kill -9 of server 1 while two workers train against two servers (k = 1):
 * both workers stop with an error naming the lost server, and the surviving
 * server logs both of them lost. Worker 1 waits at step 5 until the server is
 * dead, so worker 0 is held by the bound: it computed step 6, and its push
 * of 6 waits for worker 1's pull of 5 -- it is waiting on both servers when
 * one dies, and that push fails naming it; worker 1's next call, the pull
 * of 5, fails the same way. */
static void test_server_killed_two_workers(void) {
  alarm(40);
  int lfd[2], ports[2], go[2], ev[2];
  CHECK(listen_fds(2, lfd, ports));
  CHECK(pipe(go) == 0 && pipe(ev) == 0);
  child srv[2], wk[2];
  spawn_servers(2, 2, ports, lfd, 0.05f, srv);
  for (int i = 0; i < 2; i++) {
    worker_cfg wc = worker_defaults(2, 2, i, ports);
    wc.steps = 1000000;
    if (i == 0) wc.events_fd = ev[1];
    if (i == 1) wc.progress_at = 5, wc.go_fd = go[0];
    wk[i] = spawn_worker(&wc, lfd, 2);
  }
  close(lfd[0]);
  close(lfd[1]);
  close(go[0]);
  close(ev[1]);
  char c = 0;
  while (read(wk[1].rfd, &c, 1) == 1 && c != 'P') {
  }
  CHECK_MSG(c == 'P', "worker 1 never reached step 5");
  CHECK_MSG(event_wait(ev[0], 'c', 0, 6), "worker 0 never computed step 6");
  kill(srv[1].pid, SIGKILL);
  child_wait(&srv[1]);
  CHECK(srv[1].status == 128 + SIGKILL);
  CHECK(write(go[1], "g", 1) == 1);
  close(go[1]);
  for (int i = 0; i < 2; i++) child_wait(&wk[i]);
  close(ev[0]);
  for (int i = 0; i < 2; i++) {
    char who[40];
    snprintf(who, sizeof who, i == 0 ? "worker 0: push #6: " : "worker 1: pull #5: ");
    CHECK_MSG(wk[i].status == 6, "worker %d status %d: %s", i, wk[i].status, wk[i].out);
    CHECK_MSG(strstr(wk[i].out, "E ") && strstr(wk[i].out, "ps 1 (127.0.0.1:") && strstr(wk[i].out, who), "%s",
              wk[i].out);
  }
  child_wait(&srv[0]);
  CHECK_MSG(srv[0].status == 10 + 502 % 100, "server 0 status %d: %s", srv[0].status, srv[0].out);
  CHECK_MSG(strstr(srv[0].out, "ps 0: worker 0 (127.0.0.1:1) lost") && strstr(srv[0].out, "ps 0: worker 1 (127.0.0.1:2) lost"),
            "%s", srv[0].out);
  CHECK_MSG(strstr(srv[0].out, "finished (BYE)") == NULL, "%s", srv[0].out);
  alarm(0);
}

static void test_server_killed(void) { server_fault(0); }
static void test_server_stopped(void) { server_fault(1); }

#  ifndef DTRAIN_NO_STDIO
static void test_checkpoint_restart(void) {
  alarm(40);
  char dir[] = "/tmp/dtrain_ps_XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  const int steps = 10;
  float saved[256];
  size_t n = 0;
  {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
    sc.kind = DTRAIN_OPTIM_ADAM;
    sc.lr = 0.01f;
    sc.ckpt_dir = dir;
    sc.ckpt_every = 1;
    child srv = spawn_server(&sc, &lfd);
    close(lfd);
    model m;
    model_init(&m, DTRAIN_OPTIM_ADAM, 0.01f);
    n = dt_params_size(m.P);
    CHECK(n <= 256);
    pc x;
    pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
    dt_net_options o = net_opts(2.0, NULL);
    dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
    CHECK_MSG(ps != NULL, "%s", dt_last_error());
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    dt_strategy *s = ps ? dt_strategy_create(m.P, m.opt, step_fn, &m, &sd) : NULL;
    for (int t = 0; s && t < steps; t++) {
      dt_minibatch b = batch_at(t, 24);
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    }
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    if (ps) {
      CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
      CHECK(dt_pstore_pull(ps, 0, 0, saved, n, &tk) == DTRAIN_OK);
      CHECK(tk.version == (uint64_t)steps);
    }
    /* Every update was checkpointed before it was acknowledged: kill the server now. */
    kill(srv.pid, SIGKILL);
    child_wait(&srv);
    CHECK(srv.status == 128 + SIGKILL);
    /* The worker's next call fails naming the server. */
    if (ps) {
      CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
      dt_result rc = dt_pstore_pull(ps, 0, 0, dt_params_data(m.P), n, &tk);
      CHECK(rc == DTRAIN_ERR_PEER || rc == DTRAIN_ERR_TIMEOUT);
      CHECK_MSG(strstr(dt_last_error(), "ps 0 (127.0.0.1:"), "%s", dt_last_error());
      /* Sticky: every later call says the same. */
      CHECK(dt_pstore_push(ps, 0, 0, NULL, n, &tk) == rc);
    }
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
    model_free(&m);
  }
  char path[256];
  snprintf(path, sizeof path, "%s/ps-0-of-1.ckpt", dir);
  struct stat stt;
  CHECK(stat(path, &stt) == 0);
  {
    /* A restarted server resumes: the parameters pulled equal the checkpointed ones. */
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
    sc.kind = DTRAIN_OPTIM_ADAM;
    sc.lr = 0.01f;
    sc.ckpt_dir = dir;
    sc.ckpt_every = 1;
    child srv = spawn_server(&sc, &lfd);
    close(lfd);
    model m;
    model_init(&m, DTRAIN_OPTIM_ADAM, 0.01f);
    pc x;
    pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
    dt_net_options o = net_opts(2.0, NULL);
    dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
    CHECK_MSG(ps != NULL, "%s", dt_last_error());
    if (ps) {
      CHECK(dt_pstore_version(ps) == (uint64_t)steps);
      dt_pstore_ticket tk;
      memset(&tk, 0, sizeof tk);
      CHECK(dt_pstore_pull(ps, 0, 0, dt_params_data(m.P), n, &tk) == DTRAIN_OK);
      CHECK(memcmp(saved, dt_params_data(m.P), n * sizeof(float)) == 0);
      /* Training goes on from there. */
      dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
      dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
      dt_minibatch b = batch_at(steps, 24);
      CHECK(s && dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
      CHECK(dt_pstore_version(ps) == (uint64_t)steps + 1);
      dt_pstore_leave(ps, 0);
      dt_strategy_destroy(s);
      dt_pstore_destroy(ps);
    }
    model_free(&m);
    child_wait(&srv);
    CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
    CHECK_MSG(strstr(srv.out, "resumed from"), "%s", srv.out);
  }
  {
    /* Another model, or a damaged file: the server refuses to start. */
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    pc x;
    pc_make(&x, 1, 1, &port, DTRAIN_ROLE_PS, 0);
    dt_net_options o = net_opts(2.0, NULL);
    o.listen_fd = lfd;
    dt_ps_options po;
    memset(&po, 0, sizeof po);
    po.checkpoint_dir = dir;
    dt_params *P = dt_params_create(1);
    int64_t shp[2] = {3, 5};
    dt_params_add(P, "other", 2, shp, dt_init_zeros());
    dt_optim_options od;
    memset(&od, 0, sizeof od);
    od.kind = DTRAIN_OPTIM_ADAM;
    dt_optim *opt = dt_optim_create(P, &od);
    CHECK_ERR(dt_ps_serve(&x.c, P, opt, &o, &po), DTRAIN_ERR_MISMATCH, "checkpoint");
    dt_optim_destroy(opt);
    dt_params_destroy(P);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    if (f) {
      fseek(f, 70, SEEK_SET);
      fputc(0x5a, f);
      fclose(f);
    }
    model m;
    model_init(&m, DTRAIN_OPTIM_ADAM, 0.01f);
    CHECK_ERR(dt_ps_serve(&x.c, m.P, m.opt, &o, &po), DTRAIN_ERR_CORRUPT, "checksum");
    /* A checkpoint_dir that does not exist: refused at once, before serving
     * (it was found only at the first checkpoint, after training had run). */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no_such_dir", dir);
    po.checkpoint_dir = missing;
    double t0 = dt_time_now();
    CHECK_ERR(dt_ps_serve(&x.c, m.P, m.opt, &o, &po), DTRAIN_ERR_IO, "no_such_dir");
    CHECK_MSG(dt_time_now() - t0 < 1.0, "took %.2f s", dt_time_now() - t0);
    po.checkpoint_dir = dir;
    model_free(&m);
    close(lfd);
  }
  remove(path);
  rmdir(dir);
  alarm(0);
}

#  endif

/* Bad clients, one after the other, then a real worker. */
static void bad_client(int kind, int port) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  int fd;
  if (dt__net_connect(addr, dt__now() + 5, &fd) != DTRAIN_OK) {
    CHECK(0);
    return;
  }
  unsigned char h[DT__NET_HDR];
  if (kind == 0) {
    unsigned char junk[1000];
    uint64_t st = 12345;
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (unsigned char)(dt__splitmix64(&st) >> 7);
    dt__net_write(fd, junk, sizeof junk, dt__now() + 5);
  } else if (kind == 1) {
    const char *req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
    dt__net_write(fd, req, strlen(req), dt__now() + 5);
  } else if (kind == 2) {
    dt__frame_pack(h, DT__MSG_HELLO, 99, 0, 0, NULL, 0x7FFFFFF0u);
    dt__net_write(fd, h, sizeof h, dt__now() + 5);
  } else if (kind == 3) {
    dt__frame_pack(h, DT__MSG_HELLO, 99, 0, 0, NULL, 128);
    dt__net_write(fd, h, 21, dt__now() + 5);
    close(fd);
    return;
  } else {
    dt__frame_pack(h, DT__MSG_HELLO, 99, 0, 0, NULL, 0);
    h[4] = 9; /* version 9, with a valid header checksum */
    dt__put_le32(h + 36, dt__crc32c(0, h, 36));
    dt__net_write(fd, h, sizeof h, dt__now() + 5);
  }
  /* Read until the server closes. */
  char buf[512];
  double end = dt__now() + 5;
  while (dt__now() < end) {
    if (dt__net_poll_in(fd, 0.5) <= 0) continue;
    if (recv(fd, buf, sizeof buf, 0) <= 0) break;
  }
  close(fd);
}

static void test_bad_bytes(void) {
  alarm(40);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  sc.token = "sesame";
  sc.check_fds = 1;
  child srv = spawn_server(&sc, &lfd);
  close(lfd);
  for (int kind = 0; kind < 5; kind++) bad_client(kind, port);
  /* A client that connects and says nothing stays pending while the others are served. */
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  int silent = -1;
  CHECK(dt__net_connect(addr, dt__now() + 5, &silent) == DTRAIN_OK);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK(ps == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_AUTH && strstr(dt_last_error(), "token"), "%s", dt_last_error());
  o.token = "open sesame";
  ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK(ps == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_AUTH, "%s", dt_last_error());
  /* A worker of another model. */
  dt_params *P2 = dt_params_create(1);
  int64_t shp[2] = {2, 2};
  dt_params_add(P2, "w", 2, shp, dt_init_zeros());
  o.token = "sesame";
  ps = dt_pstore_create_tcp(&x.c, P2, &o, 0);
  CHECK(ps == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_MISMATCH && strstr(dt_last_error(), "different models"), "%s",
            dt_last_error());
  dt_params_destroy(P2);
  /* Now the real one (worker 0 was not admitted by the refusals above). */
  ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
    for (int t = 0; s && t < 5; t++) {
      dt_minibatch b = batch_at(t, 16);
      CHECK(dt_strategy_step(s, &b, NULL) == DTRAIN_OK);
    }
    dt_pstore_leave(ps, 0);
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
  }
  model_free(&m);
  child_wait(&srv);
  close(silent);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  /* Every refusal was logged with its reason. */
  int refused = 0;
  for (const char *p = srv.out; (p = strstr(p, "2 DTRAIN_ERR_")) != NULL; p++)
    if (strncmp(strchr(p, ' ') + 1 + strcspn(strchr(p, ' ') + 1, " ") + 1, "refused a connection", 20) == 0) refused++;
  CHECK_MSG(refused == 7, "%d refusals logged: %s", refused, srv.out);
  CHECK_MSG(strstr(srv.out, "ps 0: refused worker 0 (127.0.0.1:1): its model"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "HTTP"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "2147483632 bytes"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "version"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "prove"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "different models"), "%s", srv.out);
  alarm(0);
}

/* Slow and silent clients hold handshake slots, never the serving: 8 that say
 * nothing, 8 that send a byte every 0.2 s, and (with a token) 2 that send a
 * genuine-looking hello of worker 0 and then nothing, all in the backlog
 * before the server starts. Before handshakes left the serving loop, each
 * readable one blocked the server up to timeout/2 (a run took 15 s and more,
 * or the worker timed out). Now the run takes about as long as undisturbed;
 * the slow ones are dropped at the handshake deadline (1 s here) and a flood
 * beyond 32 drops the oldest, both logged. */
static double run_one_worker(int port, int lfd, const char *token, child *srv_out) {
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  sc.token = token;
  sc.timeout = 4.0;
  sc.hs_timeout = 1.0;
  double t0 = dt__now();
  child srv = spawn_server(&sc, &lfd);
  close(lfd);
  worker_cfg wc = worker_defaults(1, 1, 0, &port);
  wc.token = token;
  wc.timeout = 4.0;
  wc.steps = 30;
  wc.step_sleep_s = 0.05;
  child wk = spawn_worker(&wc, &lfd, 0);
  child_wait(&wk);
  double dt = dt__now() - t0;
  child_wait(&srv);
  CHECK_MSG(wk.status == 0, "worker status %d: %s", wk.status, wk.out);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  *srv_out = srv;
  return dt;
}

static void slow_clients(const char *token) {
  alarm(60);
  int lfd, port;
  child srv;
  CHECK(listen_fds(1, &lfd, &port));
  double calm = run_one_worker(port, lfd, token, &srv);
  CHECK(listen_fds(1, &lfd, &port));
  pc x;
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(4.0, token);
  unsigned char hello[DT__NET_HDR + DT__HELLO];
  hostile_hello(&x.c, DTRAIN_ROLE_WORKER, 0, &o, hello);
  hostile_spec hs;
  memset(&hs, 0, sizeof hs);
  hs.silent = token ? 30 : 8; /* with the fakes and drips: 40, past the cap of 32 */
  hs.drip = 8;
  hs.fakes = token ? 2 : 0;   /* without a token a fake hello would be worker 0 (see DTRAIN_JOB_ID) */
  hs.drip_s = 0.2;
  hs.hello = hello;
  char *addr = x.sbuf[0];
  pid_t bad = hostile_start(&addr, 1, &hs);
  CHECK(bad > 0);
  double hit = run_one_worker(port, lfd, token, &srv);
  hostile_stop(bad);
  printf("  slow clients: undisturbed %.2f s, with %d silent, %d slow and %d fake clients %.2f s (%s)\n", calm, hs.silent, hs.drip,
          hs.fakes, hit, token ? "token" : "no token");
  fflush(stdout);
  CHECK_MSG(hit < calm + 1.5, "%.2f s with slow clients, %.2f s without: %s", hit, calm, srv.out);
  CHECK_MSG(strstr(srv.out, "handshake deadline"), "%s", srv.out);
  if (token) CHECK_MSG(strstr(srv.out, "too many connections in the handshake"), "%s", srv.out);
  alarm(0);
}

static void test_slow_clients_token(void) { slow_clients("sesame"); }
static void test_slow_clients_open(void) { slow_clients(NULL); }

/* A worker that passed the handshake (it has the token) and then sends half a
 * frame and stops, or drips a frame a byte every 0.1 s: a child process dials
 * as worker `index` of a W-worker job, sends what `drip` says and holds the
 * connection until killed. */
static pid_t half_frame_worker(int W, int index, int port, const char *token, int drip) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid != 0) return pid;
  alarm(30);
  pc x;
  pc_make(&x, W, 1, &port, DTRAIN_ROLE_WORKER, index);
  dt_net_options o = net_opts(4.0, token);
  o.quiet = 1;
  dt__net_self self;
  dt__conn c;
  if (dt__net_self_init(&self, &x.c, &o) != DTRAIN_OK) _exit(1);
  if (dt__net_dial(&self, DTRAIN_ROLE_PS, 0, &c) != DTRAIN_OK) _exit(2);
  unsigned char f[DT__NET_HDR + DT__PS_JOINLEN];
  memset(f + DT__NET_HDR, 0, DT__PS_JOINLEN);
  dt__frame_pack(f, DT__PS_JOIN, c.job, c.self_id, c.send_seq, f + DT__NET_HDR, DT__PS_JOINLEN);
  if (!drip) {
    dt__net_write(c.fd, f, 20, dt__now() + 2); /* half the header, then silence */
  } else {
    for (size_t i = 0; i < sizeof f; i++) {
      if (send(c.fd, f + i, 1, DT__NET_SEND_FLAGS) != 1) break;
      dt_sleep(0.1);
    }
  }
  for (;;) dt_sleep(1.0);
}

/* One real worker (of 3, unbounded staleness, so it never waits for the
 * others' clocks) beside two authenticated workers that send half a frame:
 * one stops after 20 bytes, one drips a byte every 0.1 s. Before worker
 * frames were read piecewise, the server blocked in a receive with a deadline
 * of timeout/2 (2 s) on each, and the real worker stalled (or timed out). Now
 * its run takes about as long as undisturbed, and each half frame is dropped
 * at the timeout (4 s) with a log line. */
static void test_half_frames(void) {
  alarm(60);
  const char *token = "sesame";
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  child srv;
  double calm = run_one_worker(port, lfd, token, &srv);
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(3, 1, 0, &port, lfd);
  sc.token = token;
  sc.timeout = 4.0;
  double t0 = dt__now();
  srv = spawn_server(&sc, &lfd);
  close(lfd);
  pid_t bad[2];
  bad[0] = half_frame_worker(3, 1, port, token, 0);
  bad[1] = half_frame_worker(3, 2, port, token, 1);
  CHECK(bad[0] > 0 && bad[1] > 0);
  dt_sleep(0.3); /* their handshakes done and their first bytes sent */
  worker_cfg wc = worker_defaults(3, 1, 0, &port);
  wc.token = token;
  wc.timeout = 4.0;
  wc.steps = 30;
  wc.step_sleep_s = 0.05;
  wc.k = DTRAIN_STALENESS_UNBOUNDED;
  double t1 = dt__now();
  child wk = spawn_worker(&wc, &lfd, 0);
  child_wait(&wk);
  double hit = dt__now() - t1;
  child_wait(&srv);
  double served = dt__now() - t0;
  for (int i = 0; i < 2; i++) hostile_stop(bad[i]);
  printf("  half frames: undisturbed %.2f s, beside 2 workers sending half frames %.2f s; server done after %.2f s\n",
         calm, hit, served);
  fflush(stdout);
  CHECK_MSG(wk.status == 0, "worker status %d: %s", wk.status, wk.out);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  CHECK_MSG(hit < calm + 1.0, "%.2f s beside half frames, %.2f s without: %s", hit, calm, srv.out);
  CHECK_MSG(strstr(srv.out, "ps 0: worker 1 (127.0.0.1:2) lost: half a frame for ") &&
                strstr(srv.out, "20 of 40 header bytes (deadline 4.0 s)"), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "ps 0: worker 2 (127.0.0.1:3) lost: half a frame for "), "%s", srv.out);
  CHECK_MSG(strstr(srv.out, "worker 0 (127.0.0.1:1) finished (BYE)"), "%s", srv.out);
  CHECK_MSG(served < 9.0, "server done after %.2f s: %s", served, srv.out);
  alarm(0);
}
#endif

int main(void) {
#if defined(DTRAIN_NO_DIST)
  TH_RUN(test_compiled_out);
  th_skip_item("test_ps", "parameter servers are compiled out (DTRAIN_NO_DIST)");
#elif defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
  TH_RUN(test_shard);
  th_skip_item("test_ps networked tests", "built without networking or threads");
#else
  TH_RUN(test_shard);
  signal(SIGPIPE, SIG_DFL); /* the library must not need SIGPIPE ignored */
  make_data();
  TH_RUN(test_strategy_desc);
  TH_RUN(test_equals_one_device);
  TH_RUN(test_overlap_delayed);
  TH_RUN(test_converge_2x2);
  TH_RUN(test_staleness_bound);
  TH_RUN(test_staleness_mismatch);
  TH_RUN(test_heartbeats);
  TH_RUN(test_worker_killed);
  TH_RUN(test_worker_stopped);
  TH_RUN(test_server_killed);
  TH_RUN(test_server_stopped);
  TH_RUN(test_server_killed_two_workers);
#  ifndef DTRAIN_NO_STDIO
  TH_RUN(test_checkpoint_restart);
#  else
  th_skip_item("test_checkpoint_restart", "shard checkpoints need stdio (DTRAIN_NO_STDIO build)");
#  endif
  TH_RUN(test_bad_bytes);
  TH_RUN(test_slow_clients_token);
  TH_RUN(test_slow_clients_open);
  TH_RUN(test_half_frames);
#endif
  return th_summary("test_ps");
}
