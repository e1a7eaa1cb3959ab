/* tests/test_ps_backup.c -- parameter servers in synchronous rounds with
 * backup workers (dt_ps_options.aggregate; dt_ps_apply.c), over TCP:
 *   - bitwise the same as the rounds done by hand (each round: the held
 *     workers' gradients at the round's weights, summed in rank order,
 *     times 1/count, one optimizer step): 2 workers in rounds of 2, 1
 *     server, SGD with momentum; 3 workers in rounds of 2 on 2 servers with
 *     Adam, worker 2 held back in its first step's compute until the others
 *     finished: its push comes late, is dropped (its stats and both
 *     servers count it), and the weights are those of workers 0 and 1 alone;
 *   - a worker that dies: 3 workers in rounds of 3, worker 2 killed before
 *     its 6th step: the rounds before have its gradient, the later ones
 *     close with the two left (bitwise);
 *   - compressed pushes (fp16) are decoded when held, and training converges;
 *   - 3 equal workers in rounds of 2: no round takes more than 2 pushes (the
 *     third of its version is late), every push held or dropped;
 *   - a worker asking for a staleness bound is refused, a correct one trains;
 *   - a push while its last one is held (the pull must come first) drops
 *     that worker, whose held push stays in its round, while the other
 *     trains on;
 *   - refusals: aggregate outside [0, workers], with a work queue, with
 *     staleness_lr;
 *   - (every build with the distributed parts) the parameter_server strategy
 *     counts the pushes a store says were dropped (dt_pstore_ticket.dropped)
 *     in dt_replica_stats.dropped and dt_strategy_stats.dropped_grads. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "ps_harness.h"

#  define STEPS 12
#  define ROWS 16

/* The rounds by hand: in round t the workers `in(t, w)` of W computed the
 * gradient of batch t * W + w at the round's weights. */
static void rounds_reference(int W, dt_optim_kind kind, float lr, int (*in)(int t, int w), float *out) {
  model r;
  model_init(&r, kind, lr);
  size_t n = dt_params_size(r.P);
  float *S = dt_params_data(r.P), *G = (float *)malloc(n * sizeof(float)), *sum = (float *)malloc(n * sizeof(float));
  float *W0 = (float *)malloc(n * sizeof(float));
  dt_graph *g = dt_graph_create(r.P, NULL);
  CHECK(G && sum && W0 && g);
  for (int t = 0; g && G && sum && W0 && t < STEPS; t++) {
    memcpy(W0, S, n * sizeof(float));
    int count = 0;
    for (int w = 0; w < W; w++) {
      if (!in(t, w)) continue;
      memset(G, 0, n * sizeof(float));
      CHECK(dt_graph_bind(g, W0, G) == DTRAIN_OK);
      dt_graph_reset(g);
      dt_minibatch b = batch_at((int64_t)t * W + w, ROWS);
      CHECK(dt_backward(g, step_fn(g, 0, &b, &r)) == DTRAIN_OK);
      for (size_t j = 0; j < n; j++) sum[j] = count == 0 ? G[j] : sum[j] + G[j];
      count++;
    }
    const float inv = 1.0f / (float)count;
    for (size_t j = 0; j < n; j++) sum[j] *= inv;
    CHECK(dt_optim_update(r.opt, S, sum, 0, n) == DTRAIN_OK);
    dt_optim_advance(r.opt);
  }
  memcpy(out, S, n * sizeof(float));
  dt_graph_destroy(g);
  free(G);
  free(sum);
  free(W0);
  model_free(&r);
}

/* The "params" line of a worker's output, bits to floats: the count read. */
static size_t params_of(const char *out, float *dst, size_t cap) {
  const char *p = strstr(out, "params ");
  size_t n = 0;
  if (!p) return 0;
  p += 7;
  while (n < cap) {
    unsigned u;
    if (sscanf(p, "%8x", &u) != 1) break;
    uint32_t v = (uint32_t)u;
    memcpy(dst + n++, &v, 4);
    p += 8;
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) break;
  }
  return n;
}

/* A "g W T" line on the event pipe within 20 s: a worker pulled and waits on its gate. */
static int gated(int fd) {
  char line[64];
  size_t n = 0;
  double until = dt__now() + 20;
  while (dt__now() < until && n < sizeof line - 1) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 100) <= 0) continue;
    if (read(fd, line + n, 1) != 1) return 0;
    if (line[n] == '\n') {
      line[n] = '\0';
      if (line[0] == 'g') return 1;
      n = 0;
      continue;
    }
    n++;
  }
  return 0;
}

static int all_in(int t, int w) {
  (void)t;
  (void)w;
  return 1;
}
static int first_two(int t, int w) {
  (void)t;
  return w < 2;
}
static int until_5(int t, int w) { return w < 2 || t < 5; }

/* W workers, M servers in rounds of R (kind, lr); gate: worker W-1 is held
 * back in its first step's compute until the others are done, and makes
 * that one step; die: worker W-1 kills itself before step 5. The final
 * weights of worker 0's last pull equal rounds_reference(in), bitwise. */
static void rounds_case(const char *name, int W, int M, int R, dt_optim_kind kind, float lr, int gate, int die,
                        int (*in)(int, int)) {
  int lfd[2], ports[2];
  CHECK(listen_fds(M, lfd, ports));
  child srv[2], wk[3];
  for (int i = 0; i < M; i++) {
    server_cfg sc = server_defaults(W, M, i, ports, lfd[i]);
    sc.kind = kind;
    sc.lr = lr;
    sc.aggregate = R;
    srv[i] = spawn_server(&sc, lfd);
  }
  int gp[2] = {-1, -1}, ev[2] = {-1, -1};
  if (gate) CHECK(pipe(gp) == 0 && pipe(ev) == 0);
  /* the held-back worker first, and the others once it has pulled version 0: its push is then
     surely computed on weights older than the last round's (were it to join after the others
     finished, it would pull the final weights and its push would make a round alone) */
  for (int j = 0; j < W; j++) {
    int i = gate ? (j + W - 1) % W : j;
    if (gate && j == 1) CHECK_MSG(gated(ev[0]), "%s: worker %d never reached its gate", name, W - 1);
    worker_cfg wc = worker_defaults(W, M, i, ports);
    wc.k = 0;
    wc.steps = STEPS;
    wc.rows = ROWS;
    wc.say_params = 1;
    if (gate && i == W - 1) {
      wc.gate_fd = gp[0];
      wc.events_fd = ev[1];
      wc.steps = 1;
    }
    if (die && i == W - 1) wc.die_at = 5;
    wk[i] = spawn_worker(&wc, lfd, M);
  }
  for (int i = 0; i < M; i++) close(lfd[i]);
  if (gate) { /* (ev[0] stays open: the held-back worker records its later events there) */
    close(gp[0]);
    close(ev[1]);
  }
  for (int i = 0; i < W; i++) {
    if (gate && i == W - 1) { /* the others are done: the held-back worker goes on, late */
      CHECK(write(gp[1], "g", 1) == 1);
      close(gp[1]);
    }
    child_wait(&wk[i]);
  }
  for (int i = 0; i < M; i++) child_wait(&srv[i]);
  if (gate) close(ev[0]);
  model sz;
  model_init(&sz, kind, lr);
  size_t n = dt_params_size(sz.P); /* (the params' buffer: aligned, with gaps) */
  model_free(&sz);
  float want[80], got[80];
  CHECK(n <= 80);
  rounds_reference(W, kind, lr, in, want);
  for (int i = 0; i < W; i++) {
    if (die && i == W - 1) {
      CHECK_MSG(wk[i].status == 128 + SIGKILL, "%s: worker %d status %d", name, i, wk[i].status);
      continue;
    }
    CHECK_MSG(wk[i].status == 0, "%s: worker %d status %d: %s", name, i, wk[i].status, wk[i].out);
    size_t k = params_of(wk[i].out, got, 80);
    CHECK_MSG(k == n, "%s: worker %d: %zu floats: %s", name, i, k, wk[i].out);
    if (gate && i == W - 1) {
      /* its one push came after every round closed: dropped, not applied */
      CHECK_MSG(strstr(wk[i].out, "dropped 1"), "%s: %s", name, wk[i].out);
    } else {
      CHECK_MSG(strstr(wk[i].out, "dropped 0"), "%s: worker %d: %s", name, i, wk[i].out);
    }
    if (k == n) CHECK_MSG(memcmp(got, want, n * sizeof(float)) == 0, "%s: worker %d's final weights differ from "
                          "the rounds by hand (first: %.9g vs %.9g)", name, i, (double)got[0], (double)want[0]);
  }
  for (int i = 0; i < M; i++) {
    CHECK_MSG(srv[i].status == 0, "%s: server %d status %d: %s", name, i, srv[i].status, srv[i].out);
    char line[96];
    snprintf(line, sizeof line, "%d rounds of up to %d pushes (%d held), %d late pushes dropped", STEPS, R,
             die ? 5 * 3 + (STEPS - 5) * 2 : STEPS * R, gate ? 1 : 0);
    CHECK_MSG(strstr(srv[i].out, line), "%s: server %d, want \"%s\": %s", name, i, line, srv[i].out);
  }
}

static void test_rounds_bitwise(void) {
  alarm(60);
  rounds_case("2 workers, rounds of 2", 2, 1, 2, DTRAIN_OPTIM_SGD, 0.05f, 0, 0, all_in);
  rounds_case("3 workers, rounds of 2, one late", 3, 2, 2, DTRAIN_OPTIM_ADAM, 0.01f, 1, 0, first_two);
  alarm(0);
}

static void test_worker_dies(void) {
  alarm(60);
  rounds_case("3 workers, rounds of 3, one killed", 3, 1, 3, DTRAIN_OPTIM_SGD, 0.05f, 0, 1, until_5);
  alarm(0);
}

/* fp16 pushes: decoded when held (a bad one would drop its worker before it counts). */
static void test_compressed(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.aggregate = 2;
  sc.lr = 0.02f;
  child srv = spawn_server(&sc, &lfd), wk[2];
  for (int i = 0; i < 2; i++) {
    worker_cfg wc = worker_defaults(2, 1, i, &port);
    wc.k = 0;
    wc.steps = 60;
    wc.target = 0.1f;
    wc.compress = "fp16";
    wk[i] = spawn_worker(&wc, &lfd, 1);
  }
  close(lfd);
  for (int i = 0; i < 2; i++) {
    child_wait(&wk[i]);
    CHECK_MSG(wk[i].status == 0 && strstr(wk[i].out, "loss "), "worker %d status %d: %s", i, wk[i].status,
              wk[i].out);
  }
  child_wait(&srv);
  CHECK_MSG(srv.status == 0 && strstr(srv.out, "60 rounds of up to 2 pushes (120 held), 0 late"), "%s", srv.out);
  CHECK_MSG(!strstr(srv.out, "lost"), "%s", srv.out);
  alarm(0);
}

/* A second push before the pull that waits for the first one's round. The good worker
 * is held back in its first step's compute until the server dropped the bad one, so the
 * first push is surely still held when the second comes (under load, the good worker's
 * push could otherwise close the round in between, making the second merely late). */
static void test_push_while_held(void) {
  alarm(60);
  int lfd, port, gp[2];
  CHECK(listen_fds(1, &lfd, &port));
  CHECK(pipe(gp) == 0);
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.aggregate = 2;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg wc = worker_defaults(2, 1, 0, &port);
  wc.k = 0;
  wc.steps = 20;
  wc.gate_fd = gp[0];
  child good = spawn_worker(&wc, &lfd, 1);
  close(lfd);
  close(gp[0]);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, 2, 1, &port, DTRAIN_ROLE_WORKER, 1);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    dt__ps_client *C = (dt__ps_client *)ps->impl;
    size_t shard = NF * 4 + 4 + 4 + 1;
    unsigned char b[DT__PS_FIX + 4 * 64];
    memset(b, 0, sizeof b);
    dt__mutex_lock(&C->mu); /* the heartbeat thread sends too */
    for (int k = 0; k < 2; k++) {
      dt__put_le64(b, (uint64_t)(C->base + k));
      CHECK(dt__conn_send(&C->conn[0], DT__PS_PUSH, b, (uint32_t)(DT__PS_FIX + 4 * shard), dt__now() + 2, "test") ==
            DTRAIN_OK);
    }
    int closed = server_closes(C->conn[0].fd);
    dt__mutex_unlock(&C->mu);
    CHECK_MSG(closed, "the server kept a worker that pushed twice in a round");
    dt_pstore_destroy(ps);
  }
  CHECK(write(gp[1], "g", 1) == 1); /* the good worker goes on */
  close(gp[1]);
  model_free(&m);
  child_wait(&good);
  CHECK_MSG(good.status == 0, "the good worker: status %d: %s", good.status, good.out);
  child_wait(&srv);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, srv.out);
  CHECK_MSG(strstr(srv.out, "worker 1") && strstr(srv.out, "lost") && strstr(srv.out, "out of turn"), "%s", srv.out);
  /* the good worker's 20 pushes made 20 rounds: the first with the lost worker's zeros in it */
  CHECK_MSG(strstr(srv.out, "20 rounds of up to 2 pushes (21 held), 0 late"), "%s", srv.out);
  alarm(0);
}

/* 3 workers of equal speed in rounds of 2: pushes often come together (in one poll of the
 * server), and a round never takes more than 2 (the third of its version is late): every
 * push is held or dropped, and the held ones fill the rounds, at most 2 each. */
static void test_full_rounds(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(3, 1, 0, &port, lfd);
  sc.aggregate = 2;
  child srv = spawn_server(&sc, &lfd), wk[3];
  for (int i = 0; i < 3; i++) {
    worker_cfg wc = worker_defaults(3, 1, i, &port);
    wc.k = 0;
    wc.steps = 30;
    wk[i] = spawn_worker(&wc, &lfd, 1);
  }
  close(lfd);
  long long dropped = 0;
  for (int i = 0; i < 3; i++) {
    child_wait(&wk[i]);
    CHECK_MSG(wk[i].status == 0, "worker %d status %d: %s", i, wk[i].status, wk[i].out);
    const char *p = strstr(wk[i].out, " dropped ");
    long long d = -1;
    CHECK_MSG(p && sscanf(p, " dropped %lld", &d) == 1, "%s", wk[i].out);
    if (d > 0) dropped += d;
  }
  child_wait(&srv);
  long long rounds = -1, held = -1, late = -1;
  int got = 0;
  for (const char *p = strstr(srv.out, "ps 0: "); p && got != 3; p = strstr(p + 1, "ps 0: "))
    got = sscanf(p, "ps 0: %lld rounds of up to 2 pushes (%lld held), %lld late", &rounds, &held, &late);
  CHECK_MSG(srv.status == 0 && got == 3, "%s", srv.out);
  CHECK_MSG(held + late == 90 && held <= 2 * rounds && late == dropped,
            "%lld rounds, %lld held, %lld late (the workers say %lld) of 90 pushes", rounds, held, late, dropped);
  alarm(0);
}

/* A worker that asks for a staleness bound is refused (its pushes would all be late); a
 * correct one trains on. */
static void test_bound_refused(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  sc.aggregate = 1;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg wc = worker_defaults(1, 1, 0, &port);
  wc.k = 1;
  wc.steps = 4;
  child bad = spawn_worker(&wc, &lfd, 1);
  child_wait(&bad);
  CHECK_MSG(bad.status == 4 && strstr(bad.out, "synchronous rounds (aggregate 1) need 0"), "status %d: %s",
            bad.status, bad.out);
  wc.k = 0;
  child good = spawn_worker(&wc, &lfd, 1);
  close(lfd);
  child_wait(&good);
  CHECK_MSG(good.status == 0, "status %d: %s", good.status, good.out);
  child_wait(&srv);
  CHECK_MSG(srv.status == 0 && strstr(srv.out, "4 rounds of up to 1 pushes (4 held), 0 late"), "%s", srv.out);
  alarm(0);
}

static void test_refusals(void) {
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  struct {
    int aggregate, staleness_lr;
    int64_t work_items;
    dt_result code;
    const char *why;
  } cases[] = {
    {3, 0, 0, DTRAIN_ERR_INVALID_ARG, "aggregate 3 outside [0, 2]"},
    {-1, 0, 0, DTRAIN_ERR_INVALID_ARG, "aggregate -1 outside"},
    {2, 0, 10, DTRAIN_ERR_UNSUPPORTED, "with a work queue"},
    {1, 1, 0, DTRAIN_ERR_UNSUPPORTED, "with staleness_lr"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    model m;
    model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
    pc x;
    pc_make(&x, 2, 1, &port, DTRAIN_ROLE_PS, 0);
    dt_net_options o = net_opts(2.0, NULL);
    o.listen_fd = lfd;
    o.quiet = 1;
    dt_ps_options po;
    memset(&po, 0, sizeof po);
    po.aggregate = cases[c].aggregate;
    po.staleness_lr = cases[c].staleness_lr;
    po.work_items = cases[c].work_items;
    CHECK_ERR(dt_ps_serve(&x.c, m.P, m.opt, &o, &po), cases[c].code, cases[c].why);
    model_free(&m);
  }
  close(lfd);
}
#endif

#if !defined(DTRAIN_NO_DIST)
/* A store that holds the weights and drops every third push (as a server in
 * rounds says of a late one). */
typedef struct fake_store {
  dt_pstore ps;
  int pushes;
  float w[256];
} fake_store;

static dt_result fake_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n, dt_pstore_ticket *tk) {
  (void)worker;
  (void)clock;
  memcpy(dst, ((fake_store *)ps)->w, n * sizeof(float));
  memset(tk, 0, sizeof *tk);
  return DTRAIN_OK;
}
static dt_result fake_push(dt_pstore *ps, int worker, int64_t clock, const float *g, size_t n, dt_pstore_ticket *tk) {
  fake_store *f = (fake_store *)ps;
  (void)worker;
  (void)clock;
  memset(tk, 0, sizeof *tk);
  tk->dropped = f->pushes++ % 3 == 2;
  tk->staleness = tk->dropped ? 1 : 0;
  for (size_t j = 0; g && !tk->dropped && j < n; j++) f->w[j] -= 0.1f * g[j];
  return DTRAIN_OK;
}
static void fake_leave(dt_pstore *ps, int worker) {
  (void)ps;
  (void)worker;
}
static void fake_abort(dt_pstore *ps) { (void)ps; }
static dt_result fake_begin(dt_pstore *ps) {
  (void)ps;
  return DTRAIN_OK;
}
static uint64_t fake_version(dt_pstore *ps) { return (uint64_t)((fake_store *)ps)->pushes; }
static void fake_destroy(dt_pstore *ps) { (void)ps; }

static dt_tensor *lin_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  int64_t xs[2] = {b->rows, 2};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  return dt_mean(g, dt_nn_linear_forward(g, (const dt_nn_linear *)user, x));
}

static void test_dropped_counted(void) {
  static const dt_pstore_vtable vt = {"fake", fake_pull, fake_push, fake_leave, fake_abort, fake_begin,
                                      fake_version, fake_destroy, NULL};
  dt_params *P = dt_params_create(2);
  dt_nn_linear l;
  CHECK(P && dt_nn_linear_init(&l, P, "l", 2, 1, 1) == DTRAIN_OK);
  dt_optim_options oo;
  memset(&oo, 0, sizeof oo);
  oo.kind = DTRAIN_OPTIM_SGD;
  oo.lr = 0.1f;
  dt_optim *opt = dt_optim_create(P, &oo);
  fake_store f;
  memset(&f, 0, sizeof f);
  f.ps.vtable = &vt;
  f.ps.workers = 1;
  f.ps.size = dt_params_size(P);
  f.ps.gradients = 1;
  CHECK(f.ps.size >= 3 && f.ps.size <= 256);
  memcpy(f.w, dt_params_data(P), f.ps.size * sizeof(float));
  dt_strategy_options sd = dt_strategy_parameter_server(&f.ps, 0);
  dt_strategy *s = opt ? dt_strategy_create(P, opt, lin_step, &l, &sd) : NULL;
#  if defined(DTRAIN_NO_THREADS) /* (the strategy runs its replica in a thread) */
  CHECK_MSG(s == NULL && strstr(dt_last_error(), "needs threads"), "%s", s ? "made" : dt_last_error());
#  else
  CHECK_MSG(s != NULL, "%s", dt_last_error());
#  endif
  float x[8] = {1, 2, 3, 4, -1, 0.5f, 2, 1};
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = 4;
  b.x = x;
  b.x_cols = 2;
  for (int t = 0; s && t < 9; t++) CHECK_MSG(dt_strategy_step(s, &b, NULL) == DTRAIN_OK, "%s", dt_last_error());
  if (s) {
    dt_replica_stats rs;
    dt_strategy_stats st;
    CHECK(dt_strategy_replica_stats(s, 0, &rs) == DTRAIN_OK && dt_strategy_stats_get(s, &st) == DTRAIN_OK);
    CHECK_MSG(rs.dropped == 3 && st.dropped_grads == 3 && rs.steps == 9 && f.pushes == 9, "dropped %lld / %lld of %lld pushes (%d)",
              (long long)rs.dropped, (long long)st.dropped_grads, (long long)rs.steps, f.pushes);
    dt_strategy_reset_stats(s);
    CHECK(dt_strategy_stats_get(s, &st) == DTRAIN_OK && st.dropped_grads == 0);
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}
#else
/* Without the distributed parts the server says so, rounds or not. */
static void test_compiled_out(void) {
  dt_ps_options po;
  memset(&po, 0, sizeof po);
  po.aggregate = 2;
  CHECK_ERR(dt_ps_serve(NULL, NULL, NULL, NULL, &po), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_DIST");
}
#endif
#if !defined(DTRAIN_NO_DIST) && defined(DTRAIN_NO_NET)
/* Without networking too. */
static void test_no_net(void) {
  dt_ps_options po;
  memset(&po, 0, sizeof po);
  po.aggregate = 2;
  CHECK_ERR(dt_ps_serve(NULL, NULL, NULL, NULL, &po), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_NET");
}
#endif

int main(void) {
#if !defined(DTRAIN_NO_DIST)
  TH_RUN(test_dropped_counted);
#  if defined(DTRAIN_NO_NET)
  TH_RUN(test_no_net);
#  endif
#else
  TH_RUN(test_compiled_out);
#endif
#if defined(DTRAIN_NO_DIST) || defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
  th_skip_item("test_ps_backup over TCP", "parameter servers over TCP need distribution, networking and threads");
#else
  signal(SIGPIPE, SIG_DFL);
  make_data();
  TH_RUN(test_refusals);
  TH_RUN(test_rounds_bitwise);
  TH_RUN(test_worker_dies);
  TH_RUN(test_compressed);
  TH_RUN(test_full_rounds);
  TH_RUN(test_bound_refused);
  TH_RUN(test_push_while_held);
#endif
  return th_summary("test_ps_backup");
}
