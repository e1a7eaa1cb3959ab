/* tests/ps_harness.h -- the parameter-server tests' cluster on loopback
 * (test_ps.c, test_ps_elastic.c): a small linear-regression model and its
 * data, forked server and worker processes on pre-bound listening sockets,
 * their logs through a pipe, and an event pipe for the order of the
 * workers' steps. Include after dtrain.h (with DTRAIN_STATIC and
 * DTRAIN_IMPLEMENTATION: the bad-bytes clients use private transport
 * functions) and harness.h, where networking and threads are compiled in.
 * Not every test file uses every helper. */
#ifndef DTRAIN_TESTS_PS_HARNESS_H
#define DTRAIN_TESTS_PS_HARNESS_H
#if defined(__GNUC__)
#  pragma GCC diagnostic ignored "-Wunused-function"
#endif
#  include <dirent.h>
#  include <errno.h>
#  include <poll.h>
#  include <fcntl.h>
#  include <signal.h>
#  include <sys/socket.h>
#  include <sys/stat.h>
#  include <sys/wait.h>
#  include <unistd.h>

#  define NF 6
#  define NS 240

static float data_x[NS * NF], data_t[NS];

static double hash01(uint64_t k) {
  k += 0x9e3779b97f4a7c15ULL;
  k = (k ^ (k >> 30)) * 0xbf58476d1ce4e5b9ULL;
  k = (k ^ (k >> 27)) * 0x94d049bb133111ebULL;
  k ^= k >> 31;
  return (double)(k >> 11) / 9007199254740992.0;
}

/* Linear regression: t = x . w* + 0.5 (no noise). */
static void make_data(void) {
  static const float wstar[NF] = {0.7f, -1.2f, 0.4f, 2.0f, -0.5f, 1.1f};
  for (int i = 0; i < NS; i++) {
    float t = 0.5f;
    for (int j = 0; j < NF; j++) {
      float x = (float)(2.0 * hash01((uint64_t)(i * NF + j)) - 1.0);
      data_x[i * NF + j] = x;
      t += x * wstar[j];
    }
    data_t[i] = t;
  }
}

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_optim *opt;
} model;

/* Two layers without a nonlinearity (still a linear model, but 4 parameters to shard). */
static void model_init(model *m, dt_optim_kind kind, float lr) {
  memset(m, 0, sizeof *m);
  m->P = dt_params_create(7);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 4, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 4, 1, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.lr = lr;
  d.momentum = kind == DTRAIN_OPTIM_SGD ? 0.9f : 0.0f;
  m->opt = dt_optim_create(m->P, &d);
}

static void model_free(model *m) {
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

/* Seconds every training step sleeps inside its compute (between its pull and its push):
 * set in a slowed-down worker's process only. */
static double step_sleep_s;
/* >= 0: the first step's compute waits for a byte on it (a worker held back at will) */
static int step_gate_fd = -1;

/* The order of the workers' training events, for tests that check what waited
 * for what without reading a clock. The workers of a test share one pipe
 * (event_fd, -1: not recorded) and write a line per event into it; writes of
 * less than PIPE_BUF bytes to a pipe are never interleaved, so the parent
 * reads the events in the order they happened:
 *   "a W T"  worker W asks for step T (before dt_strategy_step: its pull of T)
 *   "c W T"  worker W computed step T (in step_fn, after its step_sleep_s: its
 *            pull of T was answered, its push of T is still to come)
 *   "z W T"  worker W woke from its idle time before step T (sleep_at)
 *   "g W T"  worker W pulled for step T and waits on its gate (gate_fd) */
static int event_fd = -1, event_worker, event_step;

static void event_say(char kind, int step) {
  char line[32];
  int n = snprintf(line, sizeof line, "%c %d %d\n", kind, event_worker, step);
  if (event_fd >= 0 && write(event_fd, line, (size_t)n) < 0) {
  }
}

static dt_tensor *step_fn(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  model *m = (model *)user;
  (void)replica;
  if (step_sleep_s > 0) dt_sleep(step_sleep_s);
  if (step_gate_fd >= 0) {
    char go;
    event_say('g', event_step); /* its pull is done: held back now */
    if (read(step_gate_fd, &go, 1) != 1) {
    }
    step_gate_fd = -1;
  }
  event_say('c', event_step);
  int64_t xs[2] = {b->rows, NF}, ts[2] = {b->rows, 1};
  dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
  dt_tensor *h = dt_nn_linear_forward(g, &m->l1, x);
  return dt_mse(g, dt_nn_linear_forward(g, &m->l2, h), dt_tensor_wrap(g, 2, ts, (float *)b->t));
}

static dt_minibatch batch_at(int64_t k, int64_t rows) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  int64_t first = (k * rows) % (NS - rows);
  b.rows = rows;
  b.x = data_x + first * NF;
  b.x_cols = NF;
  b.t = data_t + first;
  b.t_cols = 1;
  return b;
}

/* Loss of the params' current values on the whole data set. */
static float full_loss(model *m) {
  dt_graph *g = dt_graph_create(m->P, NULL);
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = NS;
  b.x = data_x;
  b.x_cols = NF;
  b.t = data_t;
  b.t_cols = 1;
  dt_tensor *L = step_fn(g, 0, &b, m);
  float v = L ? L->data[0] : NAN;
  dt_graph_destroy(g);
  return v;
}

static int open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* ---- the cluster --------------------------------------------------------------------- */

typedef struct pc {
  dt_cluster c;
  char *wa[4], *sa[4];
  char wbuf[4][32], sbuf[4][32];
} pc;

static void pc_make(pc *x, int W, int M, const int *ports, dt_role role, int index) {
  memset(x, 0, sizeof *x);
  for (int i = 0; i < W; i++) {
    snprintf(x->wbuf[i], sizeof x->wbuf[i], "127.0.0.1:%d", 1 + i); /* workers do not listen in PS training */
    x->wa[i] = x->wbuf[i];
  }
  for (int i = 0; i < M; i++) {
    snprintf(x->sbuf[i], sizeof x->sbuf[i], "127.0.0.1:%d", ports[i]);
    x->sa[i] = x->sbuf[i];
  }
  x->c.workers = W;
  x->c.servers = M;
  x->c.worker_addr = x->wa;
  x->c.server_addr = x->sa;
  x->c.role = role;
  x->c.index = index;
}

static int listen_fds(int M, int *fds, int *ports) {
  for (int i = 0; i < M; i++) {
    if (dt__net_listen("127.0.0.1:0", &fds[i]) != DTRAIN_OK) return 0;
    ports[i] = dt__net_port(fds[i]);
  }
  return 1;
}

static dt_net_options net_opts(double timeout, const char *token) {
  dt_net_options o = dt_net_defaults();
  o.timeout_s = timeout;
  o.connect_timeout_s = 10;
  o.token = token;
  o.model_hash = 4242;
  o.job_id = 99;
  o.listen_fd = -1;
  o.quiet = 0;
  return o;
}

/* Children log into a pipe (non-blocking: a full pipe drops lines, never blocks). */
static void child_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  int fd = *(int *)user;
  char line[600];
  int n = snprintf(line, sizeof line, "%d %s %s\n", (int)level, dt_result_name(code), msg);
  if (n > 0 && write(fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1)) < 0) {
  }
}

static int log_fd_storage;
static void child_setup(int wfd) {
  alarm(25);
  log_fd_storage = wfd;
  fcntl(wfd, F_SETFL, fcntl(wfd, F_GETFL, 0) | O_NONBLOCK);
  dt_set_logger(child_log, &log_fd_storage, DTRAIN_LOG_INFO);
}

static void child_say(const char *fmt, const char *s) {
  char line[700];
  int n = snprintf(line, sizeof line, fmt, s);
  if (n > 0 && write(log_fd_storage, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1)) < 0) {
  }
}

/* Everything a child wrote, after it exited (buf gets it, NUL-terminated). */
static void read_all(int fd, char *buf, size_t cap) {
  size_t n = 0;
  for (;;) {
    ssize_t k = read(fd, buf + n, cap - 1 - n);
    if (k <= 0) break;
    n += (size_t)k;
    if (n >= cap - 1) break;
  }
  buf[n] = '\0';
}

typedef struct child {
  pid_t pid;
  int rfd; /* the read end of its pipe */
  int status;
  char out[8192];
} child;

static void child_wait(child *ch) {
  int st = 0;
  waitpid(ch->pid, &st, 0);
  ch->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  read_all(ch->rfd, ch->out, sizeof ch->out);
  close(ch->rfd);
}

/* ---- a server process --------------------------------------------------------------- */

typedef struct server_cfg {
  int W, M, index;
  const int *ports;
  int lfd;
  double timeout;
  const char *token;
  dt_optim_kind kind;
  float lr;
  const char *ckpt_dir;
  int ckpt_every;
  int check_fds;
  double hs_timeout; /* options.handshake_timeout_s (0: the default) */
  int min_workers;   /* dt_ps_options.min_workers */
  double rejoin_timeout;
  int staleness_lr;
  int64_t work_items; /* dt_ps_options.work_items (server 0): it says "queue ..." at the end */
  int aggregate;      /* dt_ps_options.aggregate */
} server_cfg;

static int server_main(const server_cfg *sc) {
  model m;
  model_init(&m, sc->kind, sc->lr);
  pc x;
  pc_make(&x, sc->W, sc->M, sc->ports, DTRAIN_ROLE_PS, sc->index);
  dt_net_options o = net_opts(sc->timeout, sc->token);
  o.listen_fd = sc->lfd;
  o.handshake_timeout_s = sc->hs_timeout;
  dt_ps_options po;
  memset(&po, 0, sizeof po);
  po.checkpoint_dir = sc->ckpt_dir;
  po.checkpoint_every = sc->ckpt_every;
  po.min_workers = sc->min_workers;
  po.rejoin_timeout_s = sc->rejoin_timeout;
  po.staleness_lr = sc->staleness_lr;
  po.work_items = sc->work_items;
  po.aggregate = sc->aggregate;
  dt_ps_work_stats ws;
  po.work_stats = &ws;
  int before = open_fds();
  dt_result rc = dt_ps_serve(&x.c, m.P, m.opt, &o, &po);
  int after = open_fds();
  if (rc != DTRAIN_OK) child_say("serve: %s\n", dt_last_error());
  {
    char b[160];
    snprintf(b, sizeof b, "items %lld done %lld handed %lld returned %lld", (long long)ws.items, (long long)ws.done,
             (long long)ws.handed_out, (long long)ws.returned);
    child_say("queue %s\n", b);
  }
  model_free(&m);
  if (rc != DTRAIN_OK) return 10 + (-(int)rc) % 100;
  if (sc->check_fds && before != after) {
    char b[64];
    snprintf(b, sizeof b, "%d -> %d", before, after);
    child_say("descriptors leaked: %s\n", b);
    return 3;
  }
  return 0;
}

/* A child process running fn(arg), its log into a pipe; it closes the n
 * listening sockets lfds but `keep` (-1: none). */
static child spawn_fn(int (*fn)(const void *), const void *arg, const int *lfds, int n, int keep) {
  child ch;
  memset(&ch, 0, sizeof ch);
  int p[2];
  if (pipe(p) != 0) {
    ch.pid = -1;
    return ch;
  }
  fflush(NULL);
  ch.pid = fork();
  if (ch.pid == 0) {
    close(p[0]);
    for (int i = 0; i < n; i++)
      if (lfds[i] != keep) close(lfds[i]);
    child_setup(p[1]);
    exit(fn(arg)); /* exit, not _exit: LeakSanitizer checks the child too */
  }
  close(p[1]);
  ch.rfd = p[0];
  return ch;
}

static int server_main_fn(const void *arg) { return server_main((const server_cfg *)arg); }

static child spawn_server(const server_cfg *sc, const int *lfds) {
  return spawn_fn(server_main_fn, sc, lfds, sc->M, sc->lfd);
}

/* ---- a worker process ----------------------------------------------------------------- */

typedef struct worker_cfg {
  int W, M, index;
  const int *ports;
  double timeout;
  const char *token;
  int k;
  int steps;
  int64_t rows;
  int die_at, stop_at, progress_at; /* after this many steps: SIGKILL / SIGSTOP itself, or write "P" */
  int go_fd;                         /* >= 0: after writing "P", wait for a byte on it */
  int events_fd;                     /* >= 0: record the training events there (event_fd) */
  int sleep_at;                      /* ... or sleep sleep_s seconds (idle: only heartbeats go out) */
  double sleep_s;
  double step_sleep_s;               /* every step computes this much longer (between pull and push) */
  float target;                      /* the final loss must be below target * the initial loss */
  int resume;                        /* start at the store's steps_done (a restarted worker) */
  const char *compress;              /* dt_compress_parse's text: the pushes' and pulls' form [floats] */
  int queue;                         /* take its batches from server 0's work queue (steps: an upper
                                        bound); says "took K" for each; die_at: its die_at-th take
                                        kills it while it holds that item */
  int gate_fd;                       /* >= 0: its first step's compute waits for a byte on it */
  int say_params;                    /* after the final pull: "params" and the floats' bits in hex */
} worker_cfg;

/* A worker on the servers' work queue: dt_strategy_run with work_queue. */
typedef struct queue_feed {
  const worker_cfg *wc;
  int takes;
} queue_feed;

static dt_result queue_next(void *user, int replica, int64_t item, dt_minibatch *out) {
  queue_feed *q = (queue_feed *)user;
  (void)replica;
  char b[32];
  snprintf(b, sizeof b, "%lld", (long long)item);
  child_say("took %s\n", b);
  if (q->takes++ == q->wc->die_at) raise(SIGKILL); /* holding the item: no push for it */
  *out = batch_at(item, q->wc->rows);
  return DTRAIN_OK;
}

static int queue_worker_main(const worker_cfg *wc) {
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, wc->W, wc->M, wc->ports, DTRAIN_ROLE_WORKER, wc->index);
  dt_net_options o = net_opts(wc->timeout, wc->token);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, DTRAIN_STALENESS_UNBOUNDED);
  if (!ps) {
    child_say("create: %s\n", dt_last_error());
    model_free(&m);
    return 4;
  }
  dt_strategy_options sd = dt_strategy_parameter_server(ps, DTRAIN_STALENESS_UNBOUNDED);
  sd.work_queue = 1;
  dt_strategy *s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd);
  if (!s) {
    child_say("strategy: %s\n", dt_last_error());
    dt_pstore_destroy(ps);
    model_free(&m);
    return 5;
  }
  step_sleep_s = wc->step_sleep_s;
  queue_feed q = {wc, 0};
  int code = 0;
  if (dt_strategy_run(s, wc->steps, queue_next, &q, NULL) != DTRAIN_OK) {
    child_say("E %s\n", dt_last_error());
    code = 6;
  } else {
    dt_replica_stats rs;
    if (dt_strategy_replica_stats(s, 0, &rs) == DTRAIN_OK) {
      char b[64];
      snprintf(b, sizeof b, "steps %lld gap 0 stale %lld", (long long)rs.steps, (long long)rs.staleness_max);
      child_say("stats %s\n", b);
    }
    dt_strategy_stats st;
    if (dt_strategy_stats_get(s, &st) == DTRAIN_OK) {
      char b[96];
      snprintf(b, sizeof b, "%llu %llu", (unsigned long long)st.wire_bytes, (unsigned long long)st.wire_bytes_received);
      child_say("wire %s\n", b);
    }
  }
  dt_pstore_leave(ps, wc->index);
  dt_strategy_destroy(s);
  dt_pstore_destroy(ps);
  model_free(&m);
  return code;
}

static int worker_main(const worker_cfg *wc) {
  if (wc->queue) return queue_worker_main(wc);
  model m;
  model_init(&m, DTRAIN_OPTIM_SGD, 0.05f);
  pc x;
  pc_make(&x, wc->W, wc->M, wc->ports, DTRAIN_ROLE_WORKER, wc->index);
  dt_net_options o = net_opts(wc->timeout, wc->token);
  dt_pstore *ps = dt_pstore_create_tcp(&x.c, m.P, &o, wc->k);
  if (!ps) {
    child_say("create: %s\n", dt_last_error());
    model_free(&m); /* (LeakSanitizer checks the child at its exit) */
    return 4;
  }
  {
    /* Where it (re)joined, for the parent: "joined start S done D version V". */
    char b[160];
    snprintf(b, sizeof b, "start %lld done %lld version %llu", (long long)ps->start_clock, (long long)ps->steps_done,
             (unsigned long long)dt_pstore_version(ps));
    child_say("joined %s\n", b);
  }
  dt_strategy_options sd = dt_strategy_parameter_server(ps, wc->k);
  dt_strategy *s = NULL;
  if (wc->compress && dt_compress_parse(wc->compress, &sd.compress) != DTRAIN_OK)
    child_say("compress: %s\n", dt_last_error());
  else if (!(s = dt_strategy_create(m.P, m.opt, step_fn, &m, &sd)))
    child_say("strategy: %s\n", dt_last_error());
  if (!s) {
    dt_pstore_destroy(ps);
    model_free(&m);
    return 5;
  }
  float initial = full_loss(&m);
  int code = 0;
  step_sleep_s = wc->step_sleep_s;
  step_gate_fd = wc->gate_fd;
  event_fd = wc->events_fd;
  event_worker = wc->index;
  for (int t = wc->resume ? (int)ps->steps_done : 0; t < wc->steps; t++) {
    if (t == wc->die_at) raise(SIGKILL);
    if (t == wc->stop_at) raise(SIGSTOP);
    if (t == wc->progress_at) {
      child_say("%s", "P");
      char go;
      if (wc->go_fd >= 0 && read(wc->go_fd, &go, 1) != 1) return 9;
    }
    if (t == wc->sleep_at) {
      dt_sleep(wc->sleep_s);
      event_say('z', t);
    }
    event_step = t;
    event_say('a', t);
    dt_minibatch b = batch_at((int64_t)t * wc->W + wc->index, wc->rows);
    float L;
    dt_result rc = dt_strategy_step(s, &b, &L);
    if (rc != DTRAIN_OK) {
      child_say("E %s\n", dt_last_error());
      code = 6;
      break;
    }
  }
  step_sleep_s = 0;
  event_fd = -1;
  if (code == 0) {
    /* What the strategy recorded, for the parent to check (see test_staleness_bound). */
    dt_replica_stats rs;
    if (dt_strategy_replica_stats(s, 0, &rs) == DTRAIN_OK) {
      char b[160];
      snprintf(b, sizeof b, "steps %lld gap %lld stale %lld dropped %lld", (long long)rs.steps,
               (long long)rs.clock_gap_max, (long long)rs.staleness_max, (long long)rs.dropped);
      child_say("stats %s\n", b);
    }
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    dt_result rc = dt_pstore_begin(ps);
    if (rc == DTRAIN_OK) rc = dt_pstore_pull(ps, wc->index, 0, dt_params_data(m.P), dt_params_size(m.P), &tk);
    if (rc != DTRAIN_OK) {
      child_say("E final pull: %s\n", dt_last_error());
      code = 7;
    } else if (wc->say_params) {
      char hex[8 * 80 + 1];
      size_t n = dt_params_size(m.P) < 80 ? dt_params_size(m.P) : 80;
      for (size_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, dt_params_data(m.P) + j, 4);
        snprintf(hex + 8 * j, 9, "%08x", (unsigned)u);
      }
      hex[8 * n] = '\0';
      child_say("params %s\n", hex);
    }
    if (rc == DTRAIN_OK && wc->target > 0) {
      float fin = full_loss(&m);
      char b[96];
      snprintf(b, sizeof b, "%g -> %g", (double)initial, (double)fin);
      child_say("loss %s\n", b);
      if (!(fin < wc->target * initial)) code = 8;
    }
    dt_pstore_leave(ps, wc->index);
  }
  dt_strategy_destroy(s);
  dt_pstore_destroy(ps);
  model_free(&m);
  return code;
}

static int worker_main_fn(const void *arg) { return worker_main((const worker_cfg *)arg); }

static child spawn_worker(const worker_cfg *wc, const int *lfds, int nl) {
  return spawn_fn(worker_main_fn, wc, lfds, nl, -1);
}

/* A worker's connection to a server (fd, its lock held by the caller): 1 when
 * the server closes it within 10 s (heartbeats may come first). */
static int server_closes(int fd) {
  double until = dt__now() + 10;
  while (dt__now() < until) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 100) <= 0) continue;
    unsigned char junk[256];
    ssize_t k = recv(fd, junk, sizeof junk, 0);
    if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) return 1;
  }
  return 0;
}

static server_cfg server_defaults(int W, int M, int index, const int *ports, int lfd) {
  server_cfg sc;
  memset(&sc, 0, sizeof sc);
  sc.W = W;
  sc.M = M;
  sc.index = index;
  sc.ports = ports;
  sc.lfd = lfd;
  sc.timeout = 2.0;
  sc.kind = DTRAIN_OPTIM_SGD;
  sc.lr = 0.05f;
  return sc;
}

/* M servers of a W-worker job on the pre-bound lfd/ports, each with learning rate lr. */
static void spawn_servers(int W, int M, const int *ports, const int *lfd, float lr, child *srv) {
  for (int i = 0; i < M; i++) {
    server_cfg sc = server_defaults(W, M, i, ports, lfd[i]);
    sc.lr = lr;
    srv[i] = spawn_server(&sc, lfd);
  }
}

static worker_cfg worker_defaults(int W, int M, int index, const int *ports) {
  worker_cfg wc;
  memset(&wc, 0, sizeof wc);
  wc.W = W;
  wc.M = M;
  wc.index = index;
  wc.ports = ports;
  wc.timeout = 2.0;
  wc.k = 1;
  wc.steps = 40;
  wc.rows = 16;
  wc.die_at = wc.stop_at = wc.progress_at = wc.sleep_at = -1;
  wc.go_fd = wc.events_fd = wc.gate_fd = -1;
  return wc;
}

/* 2 workers x 2 servers (learning rate 0.02), 60 steps each with pushes of form compress
 * (dt_compress_parse's text; NULL: floats): every worker's final loss is below target
 * times its initial one, and no server loses a worker. */
static void converge_2x2(const char *compress, float target) {
  const char *name = compress ? compress : "floats";
  int lfd[2], ports[2];
  CHECK(listen_fds(2, lfd, ports));
  child srv[2], wk[2];
  spawn_servers(2, 2, ports, lfd, 0.02f, srv);
  for (int i = 0; i < 2; i++) {
    worker_cfg wc = worker_defaults(2, 2, i, ports);
    wc.steps = 60;
    wc.target = target;
    wc.compress = compress;
    wk[i] = spawn_worker(&wc, lfd, 2);
  }
  close(lfd[0]);
  close(lfd[1]);
  for (int i = 0; i < 2; i++) {
    child_wait(&wk[i]);
    CHECK_MSG(wk[i].status == 0, "%s: worker %d status %d: %s", name, i, wk[i].status, wk[i].out);
    CHECK_MSG(strstr(wk[i].out, "loss "), "%s", wk[i].out);
  }
  for (int i = 0; i < 2; i++) {
    child_wait(&srv[i]);
    CHECK_MSG(srv[i].status == 0 && !strstr(srv[i].out, "lost"), "%s: server %d status %d: %s", name, i,
              srv[i].status, srv[i].out);
  }
}

#endif /* DTRAIN_TESTS_PS_HARNESS_H */
