/* tests/test_ps_elastic.c -- parameter servers with workers that come and go
 * (issue 20, part 1), over loopback with forked processes:
 *   - a worker killed (kill -9) comes back with its rank: it rejoins at the
 *     slowest live worker's clock, gets the current parameters, resumes its
 *     schedule after the steps it had pushed, and everybody finishes;
 *   - a worker that dies twice resumes after the pushes it made, though its
 *     first rejoin moved its clock ahead;
 *   - a restarted worker whose old connection the server still holds (the
 *     old process is stopped, not dead) is refused as "already connected"
 *     and keeps trying until the server drops the old one;
 *   - with min_workers 2 of 3, training starts without the third, which
 *     joins mid-run at the others' clock;
 *   - a worker that said BYE cannot come back under its rank;
 *   - rejoin_timeout_s keeps a server whose only worker died serving until it
 *     returns, and ends it (every worker lost) when it does not;
 *   - the worker's decoder of JOINED refuses bad clocks and lengths, and of
 *     TAKEN bad lengths and items;
 *   - the work queue (dynamic data sharding): with a straggler and a worker
 *     killed holding an item, every item is trained on exactly once; a
 *     staleness bound is refused with it;
 *   - the staleness-aware learning rate, in-process and on a server, against
 *     the optimizer applied by hand. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_NET) && !defined(DTRAIN_NO_THREADS)
#  include <pthread.h>
#  include "ps_harness.h"

/* A child's log on one line (the test runner shows a failure's lines that say FAIL). */
static const char *flat(const char *out) {
  static char buf[4][8192];
  static int k;
  char *b = buf[k++ % 4];
  size_t n = 0;
  for (const char *p = out; *p && n + 4 < sizeof buf[0]; p++) {
    if (*p == '\n') {
      memcpy(b + n, " | ", 3);
      n += 3;
    } else {
      b[n++] = *p;
    }
  }
  b[n] = '\0';
  return b;
}

/* "joined start S done D version V" from a worker's log: 1 when found. */
static int joined_line(const char *out, long long *start, long long *done, unsigned long long *version) {
  const char *p = strstr(out, "joined start ");
  return p && sscanf(p, "joined start %lld done %lld version %llu", start, done, version) == 3;
}

/* The steps of "stats steps N gap G stale S" (worker_main's last line), or -1. */
static int stats_steps(const char *out) {
  const char *p = strstr(out, "stats steps ");
  long long steps = -1;
  return p && sscanf(p, "stats steps %lld", &steps) == 1 ? (int)steps : -1;
}

/* Worker 1 of 2 dies after 20 steps and is started again with resume: it
 * rejoins both servers, starts at worker 0's clock (not at its own 20, so
 * worker 0 never waits for it to catch up), gets the current parameters (a
 * version > 0 at its join), makes its remaining 100 steps, and both
 * workers' losses fall. The servers log the rejoin. */
static void test_rejoin(void) {
  alarm(60);
  int lfd[2], port[2];
  CHECK(listen_fds(2, lfd, port));
  child srv[2];
  spawn_servers(2, 2, port, lfd, 0.01f, srv); /* async SGD with momentum 0.9: small steps, never diverging */
  worker_cfg w0 = worker_defaults(2, 2, 0, port), w1 = worker_defaults(2, 2, 1, port);
  w0.steps = w1.steps = 120;
  w0.step_sleep_s = w1.step_sleep_s = 0.02;
  w0.target = w1.target = 0.5f;
  w1.die_at = 20;
  child a = spawn_worker(&w0, lfd, 2), b = spawn_worker(&w1, lfd, 2);
  child_wait(&b);
  CHECK_MSG(b.status == 128 + SIGKILL, "worker 1 status %d: %s", b.status, flat(b.out));
  w1.die_at = -1;
  w1.resume = 1;
  child b2 = spawn_worker(&w1, lfd, 2);
  close(lfd[0]);
  close(lfd[1]);
  child_wait(&b2);
  child_wait(&a);
  for (int i = 0; i < 2; i++) child_wait(&srv[i]);
  CHECK_MSG(a.status == 0, "worker 0 status %d: %s", a.status, flat(a.out));
  CHECK_MSG(b2.status == 0, "worker 1 (restarted) status %d: %s", b2.status, flat(b2.out));
  long long start = -1, done = -1;
  unsigned long long version = 0;
  CHECK_MSG(joined_line(b2.out, &start, &done, &version), "%s", flat(b2.out));
  CHECK_MSG(done == 20, "steps done %lld (it pushed 20 before it died): %s", done, flat(b2.out));
  CHECK_MSG(start >= done && version > 0, "start %lld, version %llu: %s", start, version, flat(b2.out));
  CHECK_MSG(stats_steps(b2.out) == 100, "the restarted worker made %d steps (want 100): %s", stats_steps(b2.out),
            flat(b2.out));
  for (int i = 0; i < 2; i++) {
    CHECK_MSG(srv[i].status == 0, "server %d status %d: %s", i, srv[i].status, flat(srv[i].out));
    CHECK_MSG(strstr(srv[i].out, "worker 1 (127.0.0.1:2) lost: ") && strstr(srv[i].out, "rejoined at clock") &&
                  strstr(srv[i].out, "(it had pushed 20;") && strstr(srv[i].out, "worker 1 (127.0.0.1:2) finished (BYE)"),
              "server %d: %s", i, flat(srv[i].out));
  }
  alarm(0);
}

/* Worker 1 dies twice. Between its first death and its return worker 0 runs
 * on alone, so the rejoin moves worker 1's clock up to worker 0's: its clock
 * is no longer its count of pushes. The second rejoin must still say the
 * pushes it made (40), not its clock, or it would skip steps it never
 * pushed (found by tests/chaos.sh: a job that lost 5% of its updates). */
static void test_rejoin_twice_counts_pushes(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.lr = 0.01f;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(2, 1, 0, &port), w1 = worker_defaults(2, 1, 1, &port);
  w0.steps = 200;
  w0.step_sleep_s = 0.01;
  w1.steps = 80;
  w1.step_sleep_s = 0.01;
  w1.die_at = 20;
  child a = spawn_worker(&w0, &lfd, 1), b = spawn_worker(&w1, &lfd, 1);
  child_wait(&b);
  CHECK_MSG(b.status == 128 + SIGKILL, "worker 1 status %d: %s", b.status, flat(b.out));
  dt_sleep(0.4); /* worker 0 runs ahead meanwhile */
  w1.resume = 1;
  w1.die_at = 40; /* 20 more pushes, then the second death */
  child b2 = spawn_worker(&w1, &lfd, 1);
  child_wait(&b2);
  CHECK_MSG(b2.status == 128 + SIGKILL, "worker 1 (2nd) status %d: %s", b2.status, flat(b2.out));
  long long start = -1, done = -1;
  unsigned long long version = 0;
  CHECK_MSG(joined_line(b2.out, &start, &done, &version) && done == 20 && start > done,
            "the first rejoin: start %lld (want > its 20 pushes: worker 0 ran ahead), done %lld: %s", start, done,
            flat(b2.out));
  w1.die_at = -1;
  child b3 = spawn_worker(&w1, &lfd, 1);
  close(lfd);
  child_wait(&b3);
  child_wait(&a);
  child_wait(&srv);
  CHECK_MSG(a.status == 0 && b3.status == 0 && srv.status == 0, "status %d %d %d: %s / %s / %s", a.status, b3.status,
            srv.status, flat(a.out), flat(b3.out), flat(srv.out));
  CHECK_MSG(joined_line(b3.out, &start, &done, &version) && done == 40,
            "the second rejoin says %lld steps done (want the 40 it pushed): %s", done, flat(b3.out));
  CHECK_MSG(stats_steps(b3.out) == 40, "the last run made %d steps (want 80 - 40): %s", stats_steps(b3.out),
            flat(b3.out));
  alarm(0);
}

/* The items a worker's log says it took ("took K" lines), in order; n gets how many. */
static int took_items(const char *out, int64_t *items, int cap) {
  int n = 0;
  for (const char *p = strstr(out, "took "); p && n < cap; p = strstr(p + 5, "took ")) {
    long long k;
    if (sscanf(p, "took %lld", &k) == 1) items[n++] = k;
  }
  return n;
}

/* Dynamic data sharding (issue 20 part 2): 3 workers take 90 items from
 * server 0's queue (2 servers: server 1 has none). Worker 1 is a straggler
 * (6x the step time), worker 2 dies (kill -9) at its 6th item, holding it.
 * Every item is trained on exactly once: the items the workers completed
 * (all they took, but the one worker 2 died holding) are 0..89, each once;
 * server 0 counts 90 done, 91 handed out, 1 given back; the straggler did
 * fewer items than worker 0. */
static void test_work_queue_exactly_once(void) {
  alarm(60);
  enum { N = 90 };
  int lfd[2], port[2];
  CHECK(listen_fds(2, lfd, port));
  child srv[2];
  for (int i = 0; i < 2; i++) {
    server_cfg sc = server_defaults(3, 2, i, port, lfd[i]);
    sc.lr = 0.01f;
    sc.work_items = N; /* server 1 ignores it: the queue is server 0's */
    srv[i] = spawn_server(&sc, lfd);
  }
  worker_cfg wc[3];
  child w[3];
  for (int i = 0; i < 3; i++) {
    wc[i] = worker_defaults(3, 2, i, port);
    wc[i].queue = 1;
    wc[i].steps = 1000; /* an upper bound: the queue ends the run */
    wc[i].step_sleep_s = i == 1 ? 0.03 : 0.005;
  }
  wc[2].die_at = 5;
  for (int i = 0; i < 3; i++) w[i] = spawn_worker(&wc[i], lfd, 2);
  close(lfd[0]);
  close(lfd[1]);
  for (int i = 0; i < 3; i++) child_wait(&w[i]);
  for (int i = 0; i < 2; i++) child_wait(&srv[i]);
  CHECK_MSG(w[0].status == 0 && w[1].status == 0, "workers: %d %d: %s / %s", w[0].status, w[1].status,
            flat(w[0].out), flat(w[1].out));
  CHECK_MSG(w[2].status == 128 + SIGKILL, "worker 2 status %d: %s", w[2].status, flat(w[2].out));
  int count[N];
  memset(count, 0, sizeof count);
  int64_t items[N + 8];
  int done[3] = {0, 0, 0}, bad = 0;
  for (int i = 0; i < 3; i++) {
    int n = took_items(w[i].out, items, N + 8);
    if (i == 2) n--; /* the item it died holding was never pushed */
    for (int k = 0; k < n; k++) {
      if (items[k] < 0 || items[k] >= N) bad++;
      else count[items[k]]++;
    }
    done[i] = n;
  }
  int missing = 0, twice = 0;
  for (int k = 0; k < N; k++) {
    missing += count[k] == 0;
    twice += count[k] > 1;
  }
  CHECK_MSG(bad == 0 && missing == 0 && twice == 0, "%d out of range, %d never trained, %d trained twice (done %d %d %d)",
            bad, missing, twice, done[0], done[1], done[2]);
  CHECK_MSG(done[2] == 5, "worker 2 completed %d items before it died (want 5)", done[2]);
  CHECK_MSG(stats_steps(w[0].out) == done[0] && stats_steps(w[1].out) == done[1], "steps %d %d vs items %d %d",
            stats_steps(w[0].out), stats_steps(w[1].out), done[0], done[1]);
  CHECK_MSG(done[1] < done[0], "the straggler did %d items, worker 0 %d", done[1], done[0]);
  CHECK_MSG(srv[0].status == 0 && strstr(srv[0].out, "queue items 90 done 90 handed 91 returned 1"), "server 0: %s",
            flat(srv[0].out));
  CHECK_MSG(srv[1].status == 0 && strstr(srv[1].out, "queue items 0 done 0 handed 0 returned 0"), "server 1: %s",
            flat(srv[1].out));
  alarm(0);
}

#  ifndef DTRAIN_NO_STDIO
/* The work queue survives server 0's restart from its checkpoint: a worker
 * does 7 of 20 items and leaves (BYE, holding the 8th it prefetched: given
 * back); server 0 ends with a checkpoint. Started again from it, the server
 * hands out the 8th item first, then the rest: a second worker trains on 13
 * items, which with the first's 7 are 0..19, each once, and the server ends
 * with 20 updates applied (not 7 + 20: the queue did not start over). */
static void test_work_queue_resumed(void) {
  alarm(60);
  enum { N = 20 };
  char dir[] = "/tmp/dtrain_psq_XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  int count[N];
  memset(count, 0, sizeof count);
  child srv[2], w[2];
  for (int run = 0; run < 2; run++) {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
    sc.work_items = N;
    sc.ckpt_dir = dir;
    sc.ckpt_every = 1;
    srv[run] = spawn_server(&sc, &lfd);
    worker_cfg wc = worker_defaults(1, 1, 0, &port);
    wc.queue = 1;
    wc.steps = run == 0 ? 7 : 1000; /* the first leaves after 7 items; the queue ends the second */
    w[run] = spawn_worker(&wc, &lfd, 1);
    close(lfd);
    child_wait(&w[run]);
    child_wait(&srv[run]);
    CHECK_MSG(w[run].status == 0, "run %d: worker status %d: %s", run, w[run].status, flat(w[run].out));
    CHECK_MSG(srv[run].status == 0, "run %d: server status %d: %s", run, srv[run].status, flat(srv[run].out));
    int64_t items[N + 8];
    int n = took_items(w[run].out, items, N + 8); /* (the 8th, prefetched, was never asked for: no "took") */
    CHECK_MSG(n == (run == 0 ? 7 : 13), "run %d: %d items trained", run, n);
    for (int k = 0; k < n; k++)
      if (items[k] >= 0 && items[k] < N) count[items[k]]++;
  }
  int missing = 0, twice = 0;
  for (int k = 0; k < N; k++) {
    missing += count[k] == 0;
    twice += count[k] > 1;
  }
  CHECK_MSG(missing == 0 && twice == 0, "%d items never trained, %d twice", missing, twice);
  CHECK_MSG(strstr(srv[0].out, "queue items 20 done 7 handed 8 returned 1"), "first server: %s", flat(srv[0].out));
  CHECK_MSG(strstr(srv[1].out, "work queue: 7 of 20 items done, 1 to do again") &&
                strstr(srv[1].out, "queue items 20 done 20 handed 21 returned 1"),
            "resumed server: %s", flat(srv[1].out));
  /* the parameters took every item's update once: 20 updates in the last checkpoint */
  char path[256];
  snprintf(path, sizeof path, "%s/ps-0-of-1.ckpt", dir);
  FILE *f = fopen(path, "rb");
  unsigned char h[64];
  CHECK(f && fread(h, 1, sizeof h, f) == sizeof h && dt__get_le32(h + 4) == 2);
  if (f) fclose(f);
  CHECK_MSG(dt__get_le64(h + 40) == N, "%llu updates applied", (unsigned long long)dt__get_le64(h + 40));
  /* a queue of another size is refused at start, the file named */
  {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    pc x;
    pc_make(&x, 1, 1, &port, DTRAIN_ROLE_PS, 0);
    dt_net_options o = net_opts(2.0, NULL);
    o.listen_fd = lfd;
    dt_ps_options po;
    memset(&po, 0, sizeof po);
    po.checkpoint_dir = dir;
    po.work_items = N + 1;
    model m;
    model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
    CHECK_ERR(dt_ps_serve(&x.c, m.P, m.opt, &o, &po), DTRAIN_ERR_MISMATCH, "work queue of 20 items");
    model_free(&m);
    close(lfd);
  }
  remove(path);
  rmdir(dir);
  alarm(0);
}
#  endif

/* A worker that asks for a staleness bound is refused by a server with a
 * queue (the bound would hold everybody at the straggler's clock); the
 * strategy refuses work_queue with a bound before it gets there. */
static void test_work_queue_needs_unbounded(void) {
  alarm(30);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  float data[2] = {0, 0};
  for (int k = 2; k >= -1; k -= 3) { /* the store's bound is the strategy's */
    dt_pstore *local = dt_pstore_create_local(data, 2, 1, k, DTRAIN_ASYNC_HOGWILD, 0);
    dt_strategy_options sd = dt_strategy_parameter_server(local, k);
    sd.work_queue = 1;
    if (k == 2)
      CHECK_ERR(TH_RESULT(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd)), DTRAIN_ERR_INVALID_ARG, "unbounded");
    else
      CHECK_ERR(TH_RESULT(dt_strategy_create(m.P, m.opt, step_fn, &m, &sd)), DTRAIN_ERR_UNSUPPORTED, "no work queue");
    dt_pstore_destroy(local);
  }
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  sc.work_items = 4;
  sc.timeout = 1.0;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg wk = worker_defaults(1, 1, 0, &port);
  wk.k = 2; /* the ordinary worker, with a bound */
  child w = spawn_worker(&wk, &lfd, 1);
  close(lfd);
  child_wait(&w);
  kill(srv.pid, SIGTERM);
  child_wait(&srv);
  CHECK_MSG(w.status == 4 && strstr(w.out, "unbounded staleness"), "worker status %d: %s", w.status, flat(w.out));
  model_free(&m);
  alarm(0);
}

/* The old process of worker 1 is stopped (SIGSTOP), so its connection stays
 * open; a new process with rank 1 is refused ("already connected") and
 * tries again until the server drops the silent old one (timeout 2 s), then
 * rejoins and finishes. */
static void test_rejoin_while_old_connected(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.lr = 0.005f; /* 250 async steps with momentum 0.9: a loss that stays finite under any timing */
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(2, 1, 0, &port), w1 = worker_defaults(2, 1, 1, &port);
  w0.steps = 250;
  w0.step_sleep_s = 0.02;
  w1.steps = 60;
  w1.stop_at = 10;
  child a = spawn_worker(&w0, &lfd, 1), b = spawn_worker(&w1, &lfd, 1);
  /* Wait until the old worker 1 has stopped itself. */
  for (int k = 0; k < 500; k++) {
    int st;
    if (waitpid(b.pid, &st, WUNTRACED | WNOHANG) == b.pid && WIFSTOPPED(st)) break;
    dt_sleep(0.01);
  }
  w1.stop_at = -1;
  w1.resume = 1;
  double t0 = dt_time_now();
  child b2 = spawn_worker(&w1, &lfd, 1);
  close(lfd);
  child_wait(&b2);
  double took = dt_time_now() - t0;
  kill(b.pid, SIGKILL);
  child_wait(&b);
  child_wait(&a);
  child_wait(&srv);
  CHECK_MSG(b2.status == 0, "worker 1 (restarted) status %d after %.1f s: %s", b2.status, took, flat(b2.out));
  CHECK_MSG(strstr(b2.out, "still holds this rank's old connection"), "%s", flat(b2.out));
  long long start = -1, done = -1;
  unsigned long long version = 0;
  CHECK_MSG(joined_line(b2.out, &start, &done, &version) && done == 10, "%s", flat(b2.out));
  CHECK_MSG(a.status == 0, "worker 0 status %d: %s", a.status, flat(a.out));
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, flat(srv.out));
  CHECK_MSG(strstr(srv.out, "is already connected (duplicate rank") && strstr(srv.out, "nothing heard") &&
                strstr(srv.out, "rejoined at clock"),
            "%s", flat(srv.out));
  alarm(0);
}

/* min_workers 2 of 3: workers 0 and 1 start at once (with bound 1 they could
 * make 1 step if worker 2 were waited for); worker 2 comes later and joins
 * mid-run at their clock, with the current parameters. */
static void test_join_mid_run(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(3, 1, 0, &port, lfd);
  sc.min_workers = 2;
  sc.lr = 0.005f;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w[3];
  child c[3];
  for (int i = 0; i < 3; i++) {
    w[i] = worker_defaults(3, 1, i, &port);
    w[i].steps = 150;
    w[i].step_sleep_s = 0.01;
    w[i].target = 0.5f;
  }
  c[0] = spawn_worker(&w[0], &lfd, 1);
  c[1] = spawn_worker(&w[1], &lfd, 1);
  dt_sleep(0.6);
  c[2] = spawn_worker(&w[2], &lfd, 1);
  close(lfd);
  for (int i = 0; i < 3; i++) {
    child_wait(&c[i]);
    CHECK_MSG(c[i].status == 0, "worker %d status %d: %s", i, c[i].status, flat(c[i].out));
  }
  child_wait(&srv);
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, flat(srv.out));
  long long start = -1, done = -1;
  unsigned long long version = 0;
  CHECK_MSG(joined_line(c[2].out, &start, &done, &version), "%s", flat(c[2].out));
  CHECK_MSG(start >= 5 && done == 0 && version > 0, "worker 2 joined at clock %lld (done %lld, version %llu): %s",
            start, done, version, flat(c[2].out));
  CHECK_MSG(strstr(srv.out, "worker 2 (127.0.0.1:3) joined mid-run at clock"), "%s", flat(srv.out));
  CHECK_MSG(!strstr(srv.out, "did not connect"), "%s", flat(srv.out));
  alarm(0);
}

/* A worker that finished (BYE) cannot come back: a process with its rank is
 * refused at the handshake, at once, naming why. */
static void test_finished_cannot_rejoin(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
  sc.lr = 0.005f; /* worker 1's 200 async steps with momentum 0.9 stay finite under any timing (qemu s390x: Inf at 0.05) */
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(2, 1, 0, &port), w1 = worker_defaults(2, 1, 1, &port);
  w0.steps = 10;
  w0.k = w1.k = DTRAIN_STALENESS_UNBOUNDED;
  w1.steps = 200;
  w1.step_sleep_s = 0.02;
  child a = spawn_worker(&w0, &lfd, 1), b = spawn_worker(&w1, &lfd, 1);
  child_wait(&a);
  CHECK_MSG(a.status == 0, "worker 0 status %d: %s", a.status, flat(a.out));
  double t0 = dt_time_now();
  child a2 = spawn_worker(&w0, &lfd, 1);
  close(lfd);
  child_wait(&a2);
  double took = dt_time_now() - t0;
  child_wait(&b);
  child_wait(&srv);
  CHECK_MSG(a2.status == 4 && strstr(a2.out, "already finished (it said BYE)"), "status %d: %s", a2.status, flat(a2.out));
  CHECK_MSG(took < 3.0, "refused after %.1f s", took);
  CHECK_MSG(b.status == 0, "worker 1 status %d: %s", b.status, flat(b.out));
  CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, flat(srv.out));
  alarm(0);
}

/* The only worker dies. With rejoin_timeout_s 6 the server keeps serving and
 * the worker, restarted a second later, rejoins and finishes; with 1 s and
 * no return the server ends after about that long, every worker lost. */
static void test_rejoin_timeout(void) {
  alarm(60);
  int lfd, port;
  CHECK(listen_fds(1, &lfd, &port));
  server_cfg sc = server_defaults(1, 1, 0, &port, lfd);
  sc.rejoin_timeout = 6.0;
  child srv = spawn_server(&sc, &lfd);
  worker_cfg w0 = worker_defaults(1, 1, 0, &port);
  w0.steps = 40;
  w0.die_at = 15;
  child a = spawn_worker(&w0, &lfd, 1);
  child_wait(&a);
  CHECK(a.status == 128 + SIGKILL);
  dt_sleep(1.0);
  w0.die_at = -1;
  w0.resume = 1;
  w0.target = 0.5f;
  child a2 = spawn_worker(&w0, &lfd, 1);
  close(lfd);
  child_wait(&a2);
  child_wait(&srv);
  CHECK_MSG(a2.status == 0, "restarted worker status %d: %s", a2.status, flat(a2.out));
  CHECK_MSG(srv.status == 0 && strstr(srv.out, "rejoined at clock 15"), "server status %d: %s", srv.status, flat(srv.out));

  CHECK(listen_fds(1, &lfd, &port));
  sc = server_defaults(1, 1, 0, &port, lfd);
  sc.rejoin_timeout = 1.0;
  double t0 = dt_time_now();
  srv = spawn_server(&sc, &lfd);
  w0 = worker_defaults(1, 1, 0, &port);
  w0.die_at = 5;
  a = spawn_worker(&w0, &lfd, 1);
  close(lfd);
  child_wait(&a);
  child_wait(&srv);
  double took = dt_time_now() - t0;
  CHECK_MSG(srv.status == 10 + 502 % 100 && strstr(srv.out, "every worker was lost"), "server status %d: %s",
            srv.status, flat(srv.out));
  CHECK_MSG(took > 0.9 && took < 5.0, "the server ended after %.1f s (rejoin_timeout_s 1)", took);
  alarm(0);
}

/* ---- the worker's decoder of JOINED, against a fake server ----------------------------------
 * A server thread that admits the worker, reads its JOIN and answers with the
 * bytes given: a bad JOINED (a length of the old protocol, steps done after
 * the start clock, a negative clock) fails dt_pstore_create_tcp with
 * DTRAIN_ERR_PROTOCOL naming it; a good one sets start_clock and steps_done. */
typedef struct fake_ps {
  int lfd, port;
  unsigned char joined[64];
  uint32_t len;
  unsigned char taken[32]; /* the answer to a TAKE, when taken_len > 0 */
  uint32_t taken_len;
} fake_ps;

static void fake_ps_serve(fake_ps *f, pc *x, const dt_net_options *o);

static void *fake_ps_main(void *p) {
  fake_ps *f = (fake_ps *)p;
  pc x;
  pc_make(&x, 1, 1, &f->port, DTRAIN_ROLE_PS, 0);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt__quiet_push(); /* this thread's errors are not logged: the test's logger is the main thread's */
  fake_ps_serve(f, &x, &o);
  dt__quiet_pop(DTRAIN_OK);
  return NULL;
}

static void fake_ps_serve(fake_ps *f, pc *x, const dt_net_options *o) {
  dt__net_self self;
  int fd;
  char addr[64];
  dt__conn c;
  unsigned char join[DT__PS_JOINLEN];
  uint32_t len = 0;
  if (dt__net_self_init(&self, &x->c, o) != DTRAIN_OK) return;
  if (dt__net_accept(f->lfd, dt__now() + 5, &fd, addr, sizeof addr) != DTRAIN_OK) return;
  if (dt__net_admit(&self, fd, addr, dt__now() + 5, NULL, &c) != DTRAIN_OK) return;
  if (dt__conn_recv(&c, DT__PS_JOIN, join, sizeof join, &len, dt__now() + 5, "fake ps") == DTRAIN_OK)
    dt__conn_send(&c, DT__PS_JOINED, f->joined, f->len, dt__now() + 5, "fake ps");
  unsigned char h[DT__NET_HDR];
  dt__frame fr;
  if (f->taken_len > 0 && dt__conn_recv_header(&c, &fr, h, dt__now() + 5, "fake ps") == DTRAIN_OK &&
      fr.type == DT__PS_TAKE && fr.length == 0 &&
      dt__conn_recv_payload(&c, &fr, h, NULL, dt__now() + 5, "fake ps") == DTRAIN_OK)
    dt__conn_send(&c, DT__PS_TAKEN, f->taken, f->taken_len, dt__now() + 5, "fake ps");
  dt__conn_recv_header(&c, &fr, h, dt__now() + 3, "fake ps"); /* until the worker closes (or its BYE) */
  dt__conn_close(&c);
}

static dt_pstore *join_fake(uint32_t len, uint64_t start, uint64_t done, model *m) {
  fake_ps f;
  memset(&f, 0, sizeof f);
  if (!listen_fds(1, &f.lfd, &f.port)) return NULL;
  f.len = len;
  dt__put_le64(f.joined, 5);       /* version */
  dt__put_le64(f.joined + 8, 5);   /* optimizer steps */
  dt__put_le32(f.joined + 16, 1);  /* max_staleness */
  dt__put_le32(f.joined + 20, 1);  /* live workers */
  dt__put_le64(f.joined + 32, start);
  dt__put_le64(f.joined + 40, done);
  pthread_t t;
  if (pthread_create(&t, NULL, fake_ps_main, &f) != 0) return NULL;
  pc x;
  pc_make(&x, 1, 1, &f.port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m->P, &o, 1);
  char keep[DT__MSG_CAP];
  dt_result rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  if (ps) dt_pstore_leave(ps, 0);
  pthread_join(t, NULL);
  close(f.lfd);
  if (!ps) dt__error(rc, "%s", keep);
  return ps;
}

/* A fake server that answers one TAKE with `len` bytes saying `item`: what dt_pstore_take returns. */
static dt_result take_fake(uint32_t len, int64_t item, int64_t *got, model *m) {
  fake_ps f;
  memset(&f, 0, sizeof f);
  if (!listen_fds(1, &f.lfd, &f.port)) return DTRAIN_ERR_NET;
  f.len = DT__PS_JOINEDLEN;
  dt__put_le32(f.joined + 16, (uint32_t)-1); /* max_staleness: unbounded */
  dt__put_le32(f.joined + 20, 1);
  f.taken_len = len;
  dt__put_le64(f.taken, (uint64_t)item);
  dt__put_le64(f.taken + 8, 3); /* items done */
  pthread_t t;
  if (pthread_create(&t, NULL, fake_ps_main, &f) != 0) return DTRAIN_ERR_INTERNAL;
  pc x;
  pc_make(&x, 1, 1, &f.port, DTRAIN_ROLE_WORKER, 0);
  dt_net_options o = net_opts(2.0, NULL);
  o.quiet = 1;
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m->P, &o, -1);
  dt_result rc = ps ? dt_pstore_take(ps, 0, got) : dt_last_result();
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  if (ps) dt_pstore_leave(ps, 0);
  pthread_join(t, NULL);
  close(f.lfd);
  dt_pstore_destroy(ps);
  if (rc != DTRAIN_OK) dt__error(rc, "%s", keep);
  return rc;
}

/* The worker's decoder of TAKEN: the length, the item's range; -2 says the
 * server has no queue. */
static void test_taken_decoder(void) {
  alarm(60);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  int64_t got = 99;
  CHECK_ERR(take_fake(8, 5, &got, &m), DTRAIN_ERR_PROTOCOL, "8 bytes");
  CHECK_ERR(take_fake(DT__PS_FIX, -7, &got, &m), DTRAIN_ERR_PROTOCOL, "work item -7");
  CHECK_ERR(take_fake(DT__PS_FIX, -2, &got, &m), DTRAIN_ERR_UNSUPPORTED, "no work queue");
  CHECK(take_fake(DT__PS_FIX, 5, &got, &m) == DTRAIN_OK && got == 5);
  CHECK(take_fake(DT__PS_FIX, -1, &got, &m) == DTRAIN_OK && got == -1);
  /* the in-process store has no queue */
  float data[2] = {0, 0};
  dt_pstore *local = dt_pstore_create_local(data, 2, 1, -1, DTRAIN_ASYNC_HOGWILD, 0);
  CHECK_ERR(dt_pstore_take(local, 0, &got), DTRAIN_ERR_UNSUPPORTED, "no work queue");
  CHECK_ERR(dt_pstore_take(local, 0, NULL), DTRAIN_ERR_NULL_ARG, "item");
  dt_pstore_destroy(local);
  model_free(&m);
  alarm(0);
}

static void test_joined_decoder(void) {
  alarm(60);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  dt_pstore *ps = join_fake(32, 0, 0, &m);
  CHECK(!ps && dt_last_result() == DTRAIN_ERR_PROTOCOL && strstr(dt_last_error(), "32 bytes") &&
        strstr(dt_last_error(), "48 bytes"));
  ps = join_fake(DT__PS_JOINEDLEN, 3, 7, &m);
  CHECK_MSG(!ps && dt_last_result() == DTRAIN_ERR_PROTOCOL && strstr(dt_last_error(), "start clock 3 and steps done 7"),
            "%s", dt_last_error());
  ps = join_fake(DT__PS_JOINEDLEN, (uint64_t)1 << 63, 0, &m);
  CHECK_MSG(!ps && dt_last_result() == DTRAIN_ERR_PROTOCOL, "%s", dt_last_error());
  ps = join_fake(DT__PS_JOINEDLEN, 9, 4, &m);
  CHECK_MSG(ps && ps->start_clock == 9 && ps->steps_done == 4, "%s", dt_last_error());
  dt_pstore_destroy(ps);
  model_free(&m);
  alarm(0);
}

/* ---- the staleness-aware learning rate ---------------------------------------------------
 * In-process store: worker 1 pushes first (staleness 0: its delta whole),
 * then worker 0, whose pull is one update old (staleness 1: half its delta). */
static void test_staleness_lr_local(void) {
  for (int on = 0; on < 2; on++) {
    float data[3] = {1, 2, 3}, mine[3];
    dt_pstore *ps = dt_pstore_create_local(data, 3, 2, DTRAIN_STALENESS_UNBOUNDED, DTRAIN_ASYNC_HOGWILD, 0);
    CHECK(ps != NULL);
    if (!ps) return;
    ps->staleness_lr = on;
    dt_pstore_ticket t0, t1;
    const float d1[3] = {0.5f, 0.5f, 0.5f}, d0[3] = {-1.0f, 2.0f, 4.0f};
    CHECK(dt_pstore_begin(ps) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 0, 0, mine, 3, &t0) == DTRAIN_OK);
    CHECK(dt_pstore_pull(ps, 1, 0, mine, 3, &t1) == DTRAIN_OK);
    CHECK(dt_pstore_push(ps, 1, 0, d1, 3, &t1) == DTRAIN_OK && t1.staleness == 0);
    CHECK(dt_pstore_push(ps, 0, 0, d0, 3, &t0) == DTRAIN_OK && t0.staleness == 1);
    const float s = on ? 0.5f : 1.0f;
    CHECK_MSG(data[0] == 1.5f - 1.0f * s && data[1] == 2.5f + 2.0f * s && data[2] == 3.5f + 4.0f * s,
              "staleness_lr %d: %g %g %g", on, (double)data[0], (double)data[1], (double)data[2]);
    dt_pstore_destroy(ps);
  }
}

/* A server with dt_ps_options.staleness_lr: two workers pull the same
 * parameters p0; worker 0 pushes gA (staleness 0: the optimizer's step
 * whole), then worker 1 pushes gB computed on p0 (staleness 1: half the
 * optimizer's step from where the parameters are). The result equals the
 * same optimizer (SGD, momentum 0.9) applied here by hand. */
static void test_staleness_lr_server(void) {
  alarm(60);
  for (int on = 0; on < 2; on++) {
    int lfd, port;
    CHECK(listen_fds(1, &lfd, &port));
    server_cfg sc = server_defaults(2, 1, 0, &port, lfd);
    sc.staleness_lr = on;
    child srv = spawn_server(&sc, &lfd);
    close(lfd);
    model a, b, ref;
    model_init(&a, DTRAIN_OPTIM_SGD, 0.05f);
    model_init(&b, DTRAIN_OPTIM_SGD, 0.05f);
    model_init(&ref, DTRAIN_OPTIM_SGD, 0.05f); /* the server's model: same seed, same optimizer */
    pc xa, xb;
    pc_make(&xa, 2, 1, &port, DTRAIN_ROLE_WORKER, 0);
    pc_make(&xb, 2, 1, &port, DTRAIN_ROLE_WORKER, 1);
    dt_net_options o = net_opts(2.0, NULL);
    dt_pstore *pa = dt_pstore_create_tcp(&xa.c, a.P, &o, DTRAIN_STALENESS_UNBOUNDED);
    dt_pstore *pb = pa ? dt_pstore_create_tcp(&xb.c, b.P, &o, DTRAIN_STALENESS_UNBOUNDED) : NULL;
    CHECK_MSG(pa && pb, "%s", dt_last_error());
    size_t n = dt_params_size(a.P);
    float *ga = (float *)calloc(n, sizeof(float)), *gb = (float *)calloc(n, sizeof(float));
    float *p0 = (float *)calloc(n, sizeof(float)), *got = (float *)calloc(n, sizeof(float));
    float *p1 = (float *)calloc(n, sizeof(float));
    if (pa && pb && ga && gb && p0 && got && p1) {
      for (size_t i = 0; i < n; i++) {
        ga[i] = (float)(0.1 * hash01(i) - 0.05);
        gb[i] = (float)(0.2 * hash01(i + 1000) - 0.1);
      }
      dt_pstore_ticket t;
      CHECK(dt_pstore_begin(pa) == DTRAIN_OK && dt_pstore_begin(pb) == DTRAIN_OK);
      CHECK(dt_pstore_pull(pa, 0, 0, p0, n, &t) == DTRAIN_OK);
      CHECK(dt_pstore_pull(pb, 1, 0, got, n, &t) == DTRAIN_OK);
      CHECK(dt_pstore_push(pa, 0, 0, ga, n, &t) == DTRAIN_OK && t.staleness == 0);
      CHECK(dt_pstore_push(pb, 1, 0, gb, n, &t) == DTRAIN_OK && t.staleness == 1);
      CHECK(dt_pstore_pull(pa, 0, 1, got, n, &t) == DTRAIN_OK);
      /* By hand: the same two updates, the second's step scaled. */
      float *d = dt_params_data(ref.P), *g = dt_params_grad(ref.P);
      memcpy(d, p0, n * sizeof(float));
      size_t bb, e;
      int tr, dec;
      memcpy(g, ga, n * sizeof(float));
      for (int q = 0; dt__params_range(ref.P, q, &bb, &e, &tr, &dec); q++) dt_optim_update(ref.opt, d, g, bb, e);
      dt_optim_advance(ref.opt);
      memcpy(p1, d, n * sizeof(float));
      memcpy(g, gb, n * sizeof(float));
      for (int q = 0; dt__params_range(ref.P, q, &bb, &e, &tr, &dec); q++) dt_optim_update(ref.opt, d, g, bb, e);
      double worst = 0;
      for (size_t i = 0; i < n; i++) {
        float want = on ? p1[i] + (d[i] - p1[i]) * 0.5f : d[i];
        double err = fabs((double)got[i] - (double)want) / (1e-6 + fabs((double)want));
        if (err > worst) worst = err;
      }
      CHECK_MSG(worst < 1e-5, "staleness_lr %d: worst relative difference %g from the optimizer by hand", on, worst);
    }
    free(ga), free(gb), free(p0), free(got), free(p1);
    if (pa) dt_pstore_leave(pa, 0);
    if (pb) dt_pstore_leave(pb, 1);
    dt_pstore_destroy(pa);
    dt_pstore_destroy(pb);
    child_wait(&srv);
    CHECK_MSG(srv.status == 0, "server status %d: %s", srv.status, flat(srv.out));
    model_free(&a);
    model_free(&b);
    model_free(&ref);
  }
  alarm(0);
}
#endif

int main(void) {
#if defined(DTRAIN_NO_DIST) || defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
  (void)th_cur_failed; /* no test of this file is compiled in */
  th_skip_item("test_ps_elastic", "parameter servers over TCP need networking, threads and DTRAIN_NO_DIST off");
#else
  signal(SIGPIPE, SIG_DFL);
  make_data();
  TH_RUN(test_rejoin);
  TH_RUN(test_rejoin_twice_counts_pushes);
  TH_RUN(test_rejoin_while_old_connected);
  TH_RUN(test_join_mid_run);
  TH_RUN(test_finished_cannot_rejoin);
  TH_RUN(test_rejoin_timeout);
  TH_RUN(test_joined_decoder);
  TH_RUN(test_taken_decoder);
  TH_RUN(test_work_queue_exactly_once);
#  ifndef DTRAIN_NO_STDIO
  TH_RUN(test_work_queue_resumed);
#  else
  th_skip_item("test_work_queue_resumed", "shard checkpoints need stdio (DTRAIN_NO_STDIO build)");
#  endif
  TH_RUN(test_work_queue_needs_unbounded);
  TH_RUN(test_staleness_lr_local);
  TH_RUN(test_staleness_lr_server);
#endif
  return th_summary("test_ps_elastic");
}
