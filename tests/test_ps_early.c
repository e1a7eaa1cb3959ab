/* tests/test_ps_early.c -- parameter_server's pushes in parts during
 * backward (dt_strategy_options.push_early; PUSHP frames, dt_ps_core.h):
 *   - bitwise the plain push's result: a model with batch-norm buffers
 *     (their values go in the parts from the params, the rest from the push
 *     vector), SGD with momentum and Adam, 1 and 2 servers, parts of one
 *     parameter each, of 64 bytes, and the default (nothing early), over
 *     dt_strategy_step and dt_strategy_run; the wire says parts went;
 *   - a step skipped for a NaN gradient discards its parts (the same as the
 *     plain path's empty push); a step that fails after its parts went
 *     leaves them, and the next request drops them (the same as the plain
 *     path's missing push);
 *   - refusals: another kind, overlap, compress, clip_norm, an in-process
 *     store;
 *   - hostile parts: unknown flags, a part not ending where the last began,
 *     another push's part, a request between parts, a discard with floats,
 *     an abandon with no parts, a ragged length, a last part short of 0:
 *     each drops that worker with the reason while the other trains on. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include "ps_harness.h"

/* ---- a model with buffers: linear, batch norm, tanh, linear ---------------------------- */

typedef struct bmodel {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_nn_batch_norm bn;
  dt_optim *opt;
} bmodel;

static void bmodel_init(bmodel *m, dt_optim_kind kind, float clip) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(8);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 8, 1);
  dt_nn_batch_norm_init(&m->bn, m->P, "bn", 8);
  dt_nn_linear_init(&m->l2, m->P, "l2", 8, 1, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = kind == DTRAIN_OPTIM_SGD ? 0.05f : 0.01f;
  d.momentum = kind == DTRAIN_OPTIM_SGD ? 0.9f : 0.0f;
  d.clip_norm = clip;
  m->opt = dt_optim_create(m->P, &d);
}

static void bmodel_free(bmodel *m) {
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

static int nan_step = -1; /* the batch of this step gets a NaN input (its gradient is NaN) */
static float nan_x[64 * NF];

static dt_tensor *bstep(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  bmodel *m = (bmodel *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, NF}, ts[2] = {b->rows, 1};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  dt_tensor *h = dt_tanh(g, dt_nn_batch_norm_forward(g, &m->bn, dt_nn_linear_forward(g, &m->l1, x)));
  return dt_mse(g, dt_nn_linear_forward(g, &m->l2, h), dt_tensor_wrap(g, 2, ts, (float *)b->t));
}

static dt_minibatch bbatch(int64_t k) {
  dt_minibatch b = batch_at(k, 16);
  if (k == nan_step) {
    memcpy(nan_x, b.x, 16 * NF * sizeof(float));
    nan_x[3] = NAN;
    b.x = nan_x;
  }
  return b;
}

static dt_result bnext(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user;
  (void)replica;
  *out = bbatch(100 + step);
  return DTRAIN_OK;
}

/* A server of the batch-norm model (the harness's serves the linear one). */
typedef struct bserver {
  int M, index;
  const int *ports, *lfds;
  dt_optim_kind kind;
} bserver;

static int bserver_main(const void *arg) {
  const bserver *b = (const bserver *)arg;
  bmodel m;
  bmodel_init(&m, b->kind, 0.0f);
  pc x;
  pc_make(&x, 1, b->M, b->ports, DTRAIN_ROLE_PS, b->index);
  dt_net_options o = net_opts(4.0, NULL);
  o.listen_fd = b->lfds[b->index];
  dt_result rc = dt_ps_serve(&x.c, m.P, m.opt, &o, NULL);
  if (rc != DTRAIN_OK) child_say("serve: %s\n", dt_last_error());
  bmodel_free(&m);
  return rc == DTRAIN_OK ? 0 : 10;
}

static child spawn_bserver(int M, int index, const int *ports, const int *lfds, dt_optim_kind kind) {
  bserver b = {M, index, ports, lfds, kind}; /* (the child has its own copy of it) */
  return spawn_fn(bserver_main, &b, lfds, M, lfds[index]);
}

typedef struct brun {
  int M, early, fail_step;
  size_t bucket;
  dt_optim_kind kind;
  int skip;           /* skip_nonfinite (else a NaN gradient fails the step) */
} brun;

/* 8 steps by dt_strategy_step, then 6 by dt_strategy_run, against M fresh
 * servers; out gets the params as the servers hold them at the end, *wire
 * the bytes sent. 1 when it ran as expected. */
static int brun_go(const brun *cfg, float *out, size_t n, uint64_t *wire) {
  int lfd[2], port[2], good = 1;
  CHECK(listen_fds(cfg->M, lfd, port));
  child srv[2];
  for (int i = 0; i < cfg->M; i++) srv[i] = spawn_bserver(cfg->M, i, port, lfd, cfg->kind);
  for (int i = 0; i < cfg->M; i++) close(lfd[i]);
  bmodel m;
  bmodel_init(&m, cfg->kind, 0.0f);
  pc x;
  pc_make(&x, 1, cfg->M, port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(4.0, NULL);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  good = ps != NULL;
  if (ps) {
    dt_strategy_options sd = dt_strategy_parameter_server(ps, 0);
    sd.push_early = cfg->early;
    sd.bucket_bytes = cfg->bucket;
    sd.skip_nonfinite = cfg->skip;
    dt_strategy *s = dt_strategy_create(m.P, m.opt, bstep, &m, &sd);
    CHECK_MSG(s != NULL, "%s", dt_last_error());
    good = s != NULL;
    for (int t = 0; s && t < 8; t++) {
      dt_minibatch b = bbatch(t);
      dt_result rc = dt_strategy_step(s, &b, NULL);
      if (t == cfg->fail_step) {
        CHECK_MSG(rc == DTRAIN_ERR_NONFINITE, "step %d: %s", t, dt_last_error());
        good &= rc == DTRAIN_ERR_NONFINITE;
      } else {
        CHECK_MSG(rc == DTRAIN_OK, "step %d: %s", t, dt_last_error());
        good &= rc == DTRAIN_OK;
      }
    }
    float loss = -1;
    dt_result rc = s ? dt_strategy_run(s, 6, bnext, NULL, &loss) : DTRAIN_ERR_NULL_ARG;
    CHECK_MSG(rc == DTRAIN_OK && loss > 0, "run: %s", dt_last_error());
    good &= rc == DTRAIN_OK;
    dt_strategy_stats st;
    if (s && dt_strategy_stats_get(s, &st) == DTRAIN_OK) *wire = st.wire_bytes;
    /* what the servers hold */
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    memset(out, 0, n * sizeof(float));
    CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK_MSG(dt_pstore_pull(ps, 0, 0, out, n, &tk) == DTRAIN_OK, "%s", dt_last_error());
    dt_pstore_leave(ps, 0);
    dt_strategy_destroy(s);
    dt_pstore_destroy(ps);
  }
  bmodel_free(&m);
  for (int i = 0; i < cfg->M; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0 && !strstr(srv[i].out, "lost"), "server %d status %d: %s", i, srv[i].status,
              srv[i].out);
  }
  return good;
}

static size_t bmodel_size(void) {
  bmodel m;
  bmodel_init(&m, DTRAIN_OPTIM_SGD, 0.0f);
  size_t n = dt_params_size(m.P);
  bmodel_free(&m);
  return n;
}

static void test_bitwise(void) {
  alarm(150);
  size_t n = bmodel_size();
  float *plain = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
  float *init = (float *)malloc(n * sizeof(float));
  CHECK(plain && got && init);
  if (!plain || !got || !init) return;
  {
    bmodel m0;
    bmodel_init(&m0, DTRAIN_OPTIM_SGD, 0.0f);
    memcpy(init, dt_params_data(m0.P), n * sizeof(float));
    bmodel_free(&m0);
  }
  const dt_optim_kind kinds[2] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM};
  const size_t buckets[3] = {4, 64, 0};
  for (int k = 0; k < 2; k++)
    for (int M = 1; M <= 2; M++) {
      brun c;
      memset(&c, 0, sizeof c);
      c.M = M;
      c.kind = kinds[k];
      c.fail_step = -1;
      uint64_t wire_plain = 0, wire = 0;
      if (!brun_go(&c, plain, n, &wire_plain)) continue;
      CHECK(memcmp(plain, init, n * sizeof(float)) != 0); /* it trained */
      for (int bk = 0; bk < 3; bk++) {
        c.early = 1;
        c.bucket = buckets[bk];
        if (!brun_go(&c, got, n, &wire)) continue;
        if (getenv("DTRAIN_TEST_VERBOSE"))
          printf("  %s, %d server(s), parts of %zu bytes: %llu bytes sent (plain %llu)\n", k ? "adam" : "sgd", M,
                 buckets[bk], (unsigned long long)wire, (unsigned long long)wire_plain);
        size_t diff = 0;
        for (size_t i = 0; i < n; i++) diff += memcmp(&plain[i], &got[i], sizeof(float)) != 0;
        CHECK_MSG(diff == 0, "%s, %d server(s), parts of %zu bytes: %zu floats differ from the plain push's",
                  k ? "adam" : "sgd", M, buckets[bk], diff);
        /* the wire: with parts, each push's last part says 32 bytes where a
         * PUSH said 16, and each part before it adds a frame (at least one a
         * step: the thread may join parts posted while it sent); the default
         * size (2 MiB) sends nothing early: plain pushes (14 steps, M servers) */
        uint64_t last_only = wire_plain + 14ull * (uint64_t)M * 16;
        if (buckets[bk] == 0) CHECK_MSG(wire == wire_plain, "sent %llu, expected %llu (nothing early: plain pushes)",
                                        (unsigned long long)wire, (unsigned long long)wire_plain);
        else CHECK_MSG(wire >= last_only + 14ull * 32, "sent %llu: no part went early (the last parts alone: %llu)",
                       (unsigned long long)wire, (unsigned long long)last_only);
      }
    }
  free(plain);
  free(got);
  free(init);
  alarm(0);
}

/* A NaN gradient at step 3: skipped (its parts discarded) or failed (its
 * parts dropped by the next request); either way as the plain path. */
static void test_nan_steps(void) {
  alarm(90);
  size_t n = bmodel_size();
  float *plain = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
  CHECK(plain && got);
  if (!plain || !got) return;
  nan_step = 3;
  for (int skip = 1; skip >= 0; skip--) {
    brun c;
    memset(&c, 0, sizeof c);
    c.M = 2;
    c.kind = DTRAIN_OPTIM_SGD;
    c.skip = skip;
    c.fail_step = skip ? -1 : 3;
    uint64_t w0 = 0, w1 = 0;
    if (!brun_go(&c, plain, n, &w0)) continue;
    c.early = 1;
    c.bucket = 4;
    if (!brun_go(&c, got, n, &w1)) continue;
    int finite = 1;
    for (size_t i = 0; i < n; i++) finite &= isfinite(got[i]) != 0;
    CHECK_MSG(finite, "%s: a NaN reached the servers", skip ? "skipped" : "failed");
    CHECK_MSG(memcmp(plain, got, n * sizeof(float)) == 0, "%s step: the early pushes end elsewhere than the plain",
              skip ? "skipped" : "failed");
  }
  nan_step = -1;
  free(plain);
  free(got);
  alarm(0);
}

static void test_refusals(void) {
  alarm(30);
  bmodel m;
  bmodel_init(&m, DTRAIN_OPTIM_SGD, 0.0f);
  dt_pstore *local = dt_pstore_create_local(dt_params_data(m.P), dt_params_size(m.P), 1, 0, DTRAIN_ASYNC_HOGWILD, 0);
  CHECK(local != NULL);
  dt_strategy_options sd = dt_strategy_parameter_server(local, 0);
  sd.push_early = 1;
  CHECK(dt_strategy_create(m.P, m.opt, bstep, &m, &sd) == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "needs a store over TCP"), "%s",
            dt_last_error());
  dt_pstore_destroy(local);
  /* overlap, compress, clip_norm: over TCP, refused at create */
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  child srv = spawn_bserver(1, 0, &port, &lfd, DTRAIN_OPTIM_SGD);
  close(lfd);
  bmodel c;
  bmodel_init(&c, DTRAIN_OPTIM_SGD, 1.0f);
  pc x;
  pc_make(&x, 1, 1, &port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(4.0, NULL);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, c.P, &o, 0);
  CHECK_MSG(ps != NULL, "%s", dt_last_error());
  if (ps) {
    dt_strategy_options pd = dt_strategy_parameter_server(ps, 0);
    pd.push_early = 1;
    pd.overlap = 1;
    CHECK(dt_strategy_create(c.P, c.opt, bstep, &c, &pd) == NULL);
    CHECK_MSG(strstr(dt_last_error(), "both push_early and overlap"), "%s", dt_last_error());
    pd.overlap = 0;
    CHECK(dt_compress_parse("fp16", &pd.compress) == DTRAIN_OK);
    CHECK(dt_strategy_create(c.P, c.opt, bstep, &c, &pd) == NULL);
    CHECK_MSG(strstr(dt_last_error(), "push_early with compress fp16"), "%s", dt_last_error());
    memset(&pd.compress, 0, sizeof pd.compress);
    CHECK(dt_strategy_create(c.P, c.opt, bstep, &c, &pd) == NULL);
    CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED && strstr(dt_last_error(), "clip_norm 1"), "%s",
              dt_last_error());
    dt_pstore_leave(ps, 0);
    dt_pstore_destroy(ps);
  }
  child_wait(&srv);
  bmodel_free(&c);
  bmodel_free(&m);
  alarm(0);
}

/* ---- hostile parts ---------------------------------------------------------------------- */

typedef struct frame {
  uint16_t type;
  int64_t clock;     /* added to the store's base */
  uint64_t version, off, flags;
  size_t floats;     /* its floats (PUSHP); PULL: none */
  int ragged;        /* two bytes more */
} frame;

static int send_frame(dt__ps_client *C, const frame *f) {
  unsigned char b[DT__PS_PFIX + 4 * 64 + 2];
  memset(b, 0, sizeof b);
  uint32_t len = DT__PS_FIX;
  dt__put_le64(b, (uint64_t)(C->base + f->clock));
  if (f->type == DT__PS_PUSHP) {
    dt__put_le64(b + 8, f->version);
    dt__put_le64(b + 16, f->off);
    dt__put_le64(b + 24, f->flags);
    len = (uint32_t)(DT__PS_PFIX + 4 * f->floats + (f->ragged ? 2 : 0));
  }
  return dt__conn_send(&C->conn[0], f->type, b, len, dt__now() + 2, "test") == DTRAIN_OK;
}

static void test_hostile_parts(void) {
  alarm(150);
  const uint64_t shard = NF * 4 + 4 + 4 + 1; /* one server holds the harness model's parameters */
  struct {
    frame a, b;   /* b.type 0: none */
    const char *why;
  } cases[] = {
    {{DT__PS_PUSHP, 0, 0, shard - 1, 8, 1, 0}, {0, 0, 0, 0, 0, 0, 0}, "unknown flags"},
    {{DT__PS_PUSHP, 0, 0, shard - 3, 0, 2, 0}, {0, 0, 0, 0, 0, 0, 0}, "not ending where"},
    {{DT__PS_PUSHP, 0, 0, shard - 1, 0, 1, 0}, {DT__PS_PUSHP, 1, 0, shard - 2, 0, 1, 0}, "another push"},
    {{DT__PS_PUSHP, 0, 0, shard - 1, 0, 1, 0}, {DT__PS_PULL, 0, 0, 0, 0, 0, 0}, "out of turn"},
    {{DT__PS_PUSHP, 0, 0, shard - 1, 0, 1, 0}, {DT__PS_PUSHP, 0, 0, 0, 3, 1, 0}, "discard or abandon carrying"},
    {{DT__PS_PUSHP, 0, 0, 0, 4, 0, 0}, {0, 0, 0, 0, 0, 0, 0}, "with no parts before it"},
    {{DT__PS_PUSHP, 0, 0, shard - 1, 0, 1, 1}, {0, 0, 0, 0, 0, 0, 0}, "wrong length"},
    {{DT__PS_PUSHP, 0, 0, shard - 2, 1, 2, 0}, {0, 0, 0, 0, 0, 0, 0}, "not reaching the shard's start"},
  };
  const int ncase = (int)(sizeof cases / sizeof cases[0]);
  for (int c = 0; c < ncase; c++) {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
    child srv = spawn_server(&sc, &lfd);
    worker_cfg wc = worker_defaults(2, 1, 0, &port);
    wc.steps = 20;
    child good = spawn_worker(&wc, &lfd, 1);
    close(lfd);
    model m;
    model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
    pc x;
    pc_make(&x, 2, 1, &port, DTRAIN_ROLE_WORKER, 1);
    dt_net_options o = net_opts(2.0, NULL);
    o.quiet = 1;
    dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, 1);
    CHECK_MSG(ps != NULL, "%s", dt_last_error());
    if (ps) {
      dt__ps_client *C = (dt__ps_client *)ps->impl;
      dt__mutex_lock(&C->mu); /* the heartbeat thread sends too */
      CHECK(send_frame(C, &cases[c].a));
      if (cases[c].b.type) CHECK(send_frame(C, &cases[c].b));
      int closed = server_closes(C->conn[0].fd); /* the server drops it */
      dt__mutex_unlock(&C->mu);
      CHECK_MSG(closed, "%s: the server kept a worker that sent a bad part", cases[c].why);
      dt_pstore_destroy(ps);
    }
    model_free(&m);
    child_wait(&good);
    CHECK_MSG(good.status == 0, "%s: the good worker: status %d: %s", cases[c].why, good.status, good.out);
    child_wait(&srv);
    CHECK_MSG(strstr(srv.out, "worker 1") && strstr(srv.out, "lost") && strstr(srv.out, cases[c].why), "%s: %s",
              cases[c].why, srv.out);
  }
  alarm(0);
}
#endif

/* push_early belongs to parameter_server: any other kind refuses it (in every build). */
static dt_tensor *tiny_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  int64_t xs[2] = {b->rows, 2};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  return dt_mean(g, dt_nn_linear_forward(g, (const dt_nn_linear *)user, x));
}

static void test_other_kinds(void) {
  dt_params *P = dt_params_create(2);
  dt_nn_linear l;
  CHECK(P && dt_nn_linear_init(&l, P, "l", 2, 1, 1) == DTRAIN_OK);
  dt_optim_options oo;
  memset(&oo, 0, sizeof oo);
  oo.kind = DTRAIN_OPTIM_SGD;
  oo.lr = 0.1f;
  dt_optim *opt = dt_optim_create(P, &oo);
  CHECK(opt != NULL);
  dt_strategy_options od = dt_strategy_one_device();
  od.push_early = 1;
  CHECK(dt_strategy_create(P, opt, tiny_step, &l, &od) == NULL);
  CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED &&
                strstr(dt_last_error(), "push_early is for parameter_server (its pushes go to the servers in parts"),
            "%s", dt_last_error());
  od.push_early = 0; /* and without it, the same options make a strategy */
  dt_strategy *s = dt_strategy_create(P, opt, tiny_step, &l, &od);
  CHECK_MSG(s != NULL, "%s", dt_last_error());
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  TH_RUN(test_other_kinds);
#if defined(DTRAIN_NO_DIST) || defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
  th_skip_item("test_ps_early over TCP", "parameter servers over TCP need distribution, networking and threads");
#else
  signal(SIGPIPE, SIG_DFL);
  make_data();
  TH_RUN(test_refusals);
  TH_RUN(test_bitwise);
  TH_RUN(test_nan_steps);
  TH_RUN(test_hostile_parts);
#endif
  return th_summary("test_ps_early");
}
