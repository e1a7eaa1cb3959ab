/* tests/test_trace.c -- timelines (dt_trace_*): the file is valid JSON (read
 * back with dtrain's strict reader) whose spans nest on every thread, for
 * every strategy that runs in one process; the spans are the steps, ops,
 * collectives, pushes and pulls that ran, counted exactly; a process's role
 * names its file; a stopped trace records nothing; a second session holds
 * only its own spans; the profile's counts are the same with the trace on;
 * bad calls and an unwritable path are errors that leave what was there. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if !defined(_WIN32)
#  include <sys/stat.h> /* mkdir (th_mkdir) */
#endif

#define CHECK_EQ(a, b) CHECK_MSG((a) == (b), "%lld, want %lld", (long long)(a), (long long)(b))

#define NF 16
#define NC 4
#define ROWS 32
static float xs_data[ROWS * NF];
static int32_t ys_data[ROWS];
static char dir[256];

typedef struct {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_optim *opt;
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
  th_seed(99);
  for (int i = 0; i < ROWS * NF; i++) xs_data[i] = th_uniform(-1, 1);
  for (int i = 0; i < ROWS; i++) ys_data[i] = i % NC;
}

static void net_free(net *m) {
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

static dt_tensor *rep_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  net *m = (net *)user;
  int64_t s[2] = {b->rows, NF};
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, s, (float *)b->x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

/* the whole data set as one batch */
static dt_minibatch all_rows(void) {
  dt_minibatch mb;
  memset(&mb, 0, sizeof mb);
  mb.rows = ROWS;
  mb.x = xs_data;
  mb.x_cols = NF;
  mb.y = ys_data;
  return mb;
}

/* ---- reading a trace back ------------------------------------------------------------------ */

#define MAXEV 20000
typedef struct {
  char name[48], cat[16];
  double ts, dur;
  long pid, tid;
} ev;

typedef struct {
  ev e[MAXEV];
  int n;
  int threads;           /* distinct tids among the spans */
  char thread_names[8][48];
  int nthread_names;
  char process[48];
  long long dropped;
  int ok;                /* parsed, every field present, spans nest */
} trace;

static trace T;

static int32_t jget(const dt__json *j, int32_t obj, const char *key) {
  if (obj < 0 || j->v[obj].type != DT__JSON_OBJ) return -1;
  for (int32_t k = j->v[obj].child; k >= 0; k = j->v[j->v[k].next].next)
    if (dt__json_eq(j, k, key)) return j->v[k].next;
  return -1;
}

static double jnum(const dt__json *j, int32_t id, int *bad) {
  if (id < 0 || j->v[id].type != DT__JSON_NUM) {
    *bad = 1;
    return 0;
  }
  char buf[64];
  size_t len = j->v[id].len < sizeof buf - 1 ? j->v[id].len : sizeof buf - 1;
  memcpy(buf, j->s + j->v[id].off, len);
  buf[len] = '\0';
  return strtod(buf, NULL);
}

static const char *jstr(const dt__json *j, int32_t id, int *bad) {
  if (id < 0 || j->v[id].type != DT__JSON_STR) {
    *bad = 1;
    return "";
  }
  return dt__json_str(j, id);
}

static int ev_cmp(const void *a, const void *b) {
  const ev *x = (const ev *)a, *y = (const ev *)b;
  if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
  if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
  if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
  return x->dur > y->dur ? -1 : x->dur < y->dur ? 1 : 0; /* the enclosing span first */
}

/* Reads path into T; T.ok when it is a trace whose spans nest thread by thread. */
static void read_trace(const char *path) {
  memset(&T, 0, sizeof T);
  FILE *f = fopen(path, "rb");
  CHECK_MSG(f != NULL, "%s not written", path);
  if (!f) return;
  static char text[8 << 20];
  size_t n = fread(text, 1, sizeof text, f);
  fclose(f);
  CHECK(n < sizeof text);
  dt__json j;
  int parsed = dt__json_parse(&j, text, n, 8, 0);
  CHECK_MSG(parsed, "%s: %s", path, parsed ? "" : j.err);
  int bad = !parsed;
  int32_t evs = parsed ? jget(&j, 0, "traceEvents") : -1;
  CHECK(evs >= 0 && j.v[evs].type == DT__JSON_ARR);
  if (evs < 0 || j.v[evs].type != DT__JSON_ARR) bad = 1;
  for (int32_t e = evs >= 0 ? j.v[evs].child : -1; e >= 0 && !bad; e = j.v[e].next) {
    const char *ph = jstr(&j, jget(&j, e, "ph"), &bad);
    if (strcmp(ph, "M") == 0) {
      const char *what = jstr(&j, jget(&j, e, "name"), &bad);
      const char *nm = jstr(&j, jget(&j, jget(&j, e, "args"), "name"), &bad);
      if (strcmp(what, "thread_name") == 0 && T.nthread_names < 8)
        snprintf(T.thread_names[T.nthread_names++], 48, "%s", nm);
      else if (strcmp(what, "process_name") == 0)
        snprintf(T.process, sizeof T.process, "%s", nm);
      continue;
    }
    CHECK_MSG(strcmp(ph, "X") == 0, "event of phase '%s'", ph);
    if (T.n >= MAXEV) {
      bad = 1;
      break;
    }
    ev *x = &T.e[T.n++];
    snprintf(x->name, sizeof x->name, "%s", jstr(&j, jget(&j, e, "name"), &bad));
    snprintf(x->cat, sizeof x->cat, "%s", jstr(&j, jget(&j, e, "cat"), &bad));
    x->ts = jnum(&j, jget(&j, e, "ts"), &bad);
    x->dur = jnum(&j, jget(&j, e, "dur"), &bad);
    x->pid = (long)jnum(&j, jget(&j, e, "pid"), &bad);
    x->tid = (long)jnum(&j, jget(&j, e, "tid"), &bad);
    if (x->dur < 0) bad = 1;
  }
  int32_t od = parsed ? jget(&j, 0, "otherData") : -1;
  T.dropped = (long long)jnum(&j, jget(&j, od, "dropped"), &bad);
  (void)jnum(&j, jget(&j, od, "realtime_us"), &bad);
  (void)jnum(&j, jget(&j, od, "monotonic_us"), &bad);
  CHECK_MSG(!bad, "%s: an event or otherData lacks a field", path);
  dt__json_free(&j);
  /* nesting: on each thread, a span starts after the open one ends or ends inside it
   * (2 ns of slack: ts and dur are each printed to the nanosecond) */
  qsort(T.e, (size_t)T.n, sizeof(ev), ev_cmp);
  int nested = 1;
  int stack[64], depth = 0;
  for (int i = 0; i < T.n; i++) {
    if (i == 0 || T.e[i].pid != T.e[i - 1].pid || T.e[i].tid != T.e[i - 1].tid) {
      depth = 0;
      T.threads++;
    }
    while (depth > 0 && T.e[i].ts >= T.e[stack[depth - 1]].ts + T.e[stack[depth - 1]].dur - 0.0021) depth--;
    if (depth > 0 && T.e[i].ts + T.e[i].dur > T.e[stack[depth - 1]].ts + T.e[stack[depth - 1]].dur + 0.0021) {
      CHECK_MSG(0, "%s: %s at %.3f (%.3f us) overlaps %s at %.3f (%.3f us)", path, T.e[i].name, T.e[i].ts,
                T.e[i].dur, T.e[stack[depth - 1]].name, T.e[stack[depth - 1]].ts, T.e[stack[depth - 1]].dur);
      nested = 0;
      break;
    }
    if (depth < 64) stack[depth++] = i;
  }
  T.ok = !bad && nested;
}

static int count(const char *name, const char *cat) {
  int k = 0;
  for (int i = 0; i < T.n; i++) k += strcmp(T.e[i].name, name) == 0 && (!cat || strcmp(T.e[i].cat, cat) == 0);
  return k;
}

static int count_prefix(const char *prefix) {
  int k = 0;
  for (int i = 0; i < T.n; i++) k += strncmp(T.e[i].name, prefix, strlen(prefix)) == 0;
  return k;
}

static int has_thread(const char *name) {
  for (int i = 0; i < T.nthread_names; i++)
    if (strcmp(T.thread_names[i], name) == 0) return 1;
  return 0;
}

/* ---- the tests ----------------------------------------------------------------------------- */

#define K 6

/* K steps of the strategy traced into path; 1 when the strategy could run here */
static int traced_steps(dt_strategy_options so, const char *path, dt_pstore *borrowed) {
  (void)borrowed;
  net m;
  net_init(&m);
  dt_strategy *s = dt_strategy_create(m.P, m.opt, rep_step, &m, &so);
  if (!s) {
    CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED, "%s", dt_last_error());
    net_free(&m);
    return 0;
  }
  dt_minibatch mb = all_rows();
  CHECK_EQ(dt_trace_start(path), DTRAIN_OK);
  CHECK(dt_trace_active());
  for (int k = 0; k < K; k++) CHECK_EQ(dt_strategy_step(s, &mb, NULL), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  CHECK(!dt_trace_active());
  dt_strategy_destroy(s);
  net_free(&m);
  read_trace(path);
  CHECK_MSG(T.ok, "%s", path);
  CHECK_EQ(count("dt_strategy_step", "step"), K);
  CHECK_EQ(T.dropped, 0);
  return 1;
}

static void test_one_device(void) {
  char p[300];
  snprintf(p, sizeof p, "%s/one.json", dir);
  if (!traced_steps(dt_strategy_one_device(), p, NULL)) TH_SKIP("one_device: unsupported in this build");
  /* each op's forward is on the timeline (a linear layer: its own pieces and its matmul's) */
  CHECK(count("dt_linear", "forward") >= 2 * K);
  CHECK_EQ(count("dt_linear", "backward"), 2 * K);
  CHECK_EQ(count("dt_relu", "backward"), K);
  CHECK_EQ(count("dt_cross_entropy", "backward"), K);
  CHECK(count("dt_optim_update", "update") >= K);
  CHECK_EQ(T.threads, 1);
  CHECK(strcmp(T.process, "dtrain") == 0);
}

static void test_mirrored(void) {
  char p[300];
  snprintf(p, sizeof p, "%s/mirrored.json", dir);
  if (!traced_steps(dt_strategy_mirrored(2), p, NULL)) {
    TH_SKIP("mirrored: built without threads or the distributed strategies");
  }
  CHECK_EQ(T.threads, 2);
  CHECK(has_thread("replica 0") && has_thread("replica 1"));
  CHECK_EQ(count("dt_linear", "backward"), 2 * 2 * K);
  CHECK(count_prefix("dt_comm_") >= 2 * K); /* each replica's reduction of each step */
}

static void test_central_storage(void) {
  char p[300];
  snprintf(p, sizeof p, "%s/central.json", dir);
  if (!traced_steps(dt_strategy_central_storage(2), p, NULL)) {
    TH_SKIP("central_storage: built without threads or the distributed strategies");
  }
  CHECK_EQ(T.threads, 2);
  CHECK_EQ(count("dt_linear", "backward"), 2 * 2 * K);
}

static void test_async(void) {
  for (int bound = -1; bound <= 1; bound += 2) {
    char p[300];
    snprintf(p, sizeof p, "%s/async%d.json", dir, bound);
    if (!traced_steps(dt_strategy_async(2, bound), p, NULL)) {
      TH_SKIP("async: built without threads or the distributed strategies");
    }
    CHECK_EQ(T.threads, 2);
    /* a step: one pull and one push per replica */
    CHECK_EQ(count("dt_pstore_pull", "comm"), 2 * K);
    CHECK_EQ(count("dt_pstore_push", "comm") + count("dt_pstore_push (with the update)", "comm"), 2 * K);
  }
}

static void test_multi_worker_mirrored(void) {
  dt_comm *c = dt_comm_create_threads(1, 0);
  if (!c) TH_SKIP("multi_worker_mirrored: no communicator in this build");
  char p[300];
  snprintf(p, sizeof p, "%s/mwm.json", dir);
  if (!traced_steps(dt_strategy_multi_worker_mirrored(c, 2), p, NULL)) {
    dt_comm_destroy(c);
    TH_SKIP("multi_worker_mirrored: unsupported in this build");
  }
  CHECK(count_prefix("dt_comm_") >= K);
  CHECK_EQ(count("dt_linear", "backward"), 2 * 2 * K);
  dt_comm_destroy(c);
}

static void test_parameter_server_local(void) {
  net m;
  net_init(&m);
  dt_pstore *st = dt_pstore_create_local(dt_params_data(m.P), dt_params_size(m.P), 1, -1, (dt_async_update)0, 0);
  net_free(&m);
  if (!st) TH_SKIP("parameter_server: no parameter store in this build");
  dt_pstore_destroy(st);
  /* the strategy over a store of its own params */
  net m2;
  net_init(&m2);
  dt_pstore *st2 = dt_pstore_create_local(dt_params_data(m2.P), dt_params_size(m2.P), 1, -1, (dt_async_update)0, 0);
  dt_strategy_options so = dt_strategy_parameter_server(st2, -1);
  dt_strategy *s = dt_strategy_create(m2.P, m2.opt, rep_step, &m2, &so);
  if (!s) {
    CHECK_MSG(dt_last_result() == DTRAIN_ERR_UNSUPPORTED || dt_last_result() == DTRAIN_ERR_INVALID_ARG, "%s",
              dt_last_error());
    dt_pstore_destroy(st2);
    net_free(&m2);
    TH_SKIP("parameter_server over an in-process store: refused (%s)", dt_last_error());
  }
  dt_minibatch mb = all_rows();
  char p[300];
  snprintf(p, sizeof p, "%s/ps.json", dir);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  for (int k = 0; k < K; k++) CHECK_EQ(dt_strategy_step(s, &mb, NULL), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  dt_strategy_destroy(s);
  dt_pstore_destroy(st2);
  net_free(&m2);
  read_trace(p);
  CHECK(T.ok);
  CHECK_EQ(count("dt_strategy_step", "step"), K);
  CHECK_EQ(count("dt_pstore_pull", "comm"), K);
  CHECK_EQ(count("dt_pstore_push", "comm"), K);
}

/* what runs while no trace runs is not recorded; a second session has only its own spans */
static void test_sessions(void) {
  net m;
  net_init(&m);
  dt_graph *g = dt_graph_create(m.P, NULL);
  dt_minibatch mb = all_rows();
  char p[300];
  snprintf(p, sizeof p, "%s/s1.json", dir);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  dt_graph_reset(g);
  CHECK_EQ(dt_backward(g, rep_step(g, 0, &mb, &m)), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  for (int k = 0; k < 3; k++) { /* off: nothing recorded */
    dt_graph_reset(g);
    CHECK_EQ(dt_backward(g, rep_step(g, 0, &mb, &m)), DTRAIN_OK);
  }
  snprintf(p, sizeof p, "%s/s2.json", dir);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  for (int k = 0; k < 2; k++) {
    dt_graph_reset(g);
    CHECK_EQ(dt_backward(g, rep_step(g, 0, &mb, &m)), DTRAIN_OK);
  }
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  read_trace(p);
  CHECK(T.ok);
  CHECK_EQ(count("dt_cross_entropy", "backward"), 2);
  snprintf(p, sizeof p, "%s/s1.json", dir);
  read_trace(p);
  CHECK(T.ok);
  CHECK_EQ(count("dt_cross_entropy", "backward"), 1);
  dt_graph_destroy(g);
  net_free(&m);
}

/* the profile's table counts the same with the timeline on */
static void test_profile_unchanged(void) {
  net m;
  net_init(&m);
  dt_graph *g = dt_graph_create(m.P, NULL);
  dt_minibatch mb = all_rows();
  int64_t calls[2];
  for (int pass = 0; pass < 2; pass++) {
    char p[300];
    snprintf(p, sizeof p, "%s/prof.json", dir);
    if (pass) CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
    dt_profile_start();
    for (int k = 0; k < 3; k++) {
      dt_graph_reset(g);
      CHECK_EQ(dt_backward(g, rep_step(g, 0, &mb, &m)), DTRAIN_OK);
      CHECK_EQ(dt_optim_step(m.opt), DTRAIN_OK);
    }
    dt_profile_stop();
    if (pass) CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
    dt_profile_entry e[64];
    int n = dt_profile_read(e, 64);
    calls[pass] = 0;
    for (int i = 0; i < n && i < 64; i++) calls[pass] += e[i].calls;
  }
  CHECK(calls[0] > 0);
  CHECK_EQ(calls[1], calls[0]);
  char p[300];
  snprintf(p, sizeof p, "%s/prof.json", dir);
  read_trace(p);
  CHECK(T.ok);
  CHECK_EQ(count("dt_cross_entropy", "backward"), 3);
  dt_graph_destroy(g);
  net_free(&m);
}

static void test_roles_and_errors(void) {
  char p[300], want[320];
  /* a worker's file is named after its role and index; its process after them too */
  snprintf(p, sizeof p, "%s/run.json", dir);
  dt_trace_set_process("worker", 3);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  dt_trace_name_thread("main thread");
  net m;
  net_init(&m);
  CHECK_EQ(dt_optim_step(m.opt), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  snprintf(want, sizeof want, "%s/run.worker3.json", dir);
  read_trace(want);
  CHECK(T.ok);
  CHECK(strcmp(T.process, "worker 3") == 0);
  CHECK(has_thread("main thread"));
  CHECK_EQ(count("dt_optim_update", "update"), 1);
  for (int i = 0; i < T.n; i++) CHECK_EQ(T.e[i].pid, 3);
  dt_trace_set_process(NULL, 0);
  dt_trace_name_thread("");
  /* stop without a trace; bad paths */
  CHECK_EQ(dt_trace_stop(), DTRAIN_ERR_STATE);
  CHECK(strstr(dt_last_error(), "dt_trace_stop") != NULL);
  CHECK_EQ(dt_trace_start(""), DTRAIN_ERR_INVALID_ARG);
  CHECK_EQ(dt_trace_start(NULL), DTRAIN_ERR_NULL_ARG);
  CHECK(!dt_trace_active());
  /* a path that cannot be written: an IO error at stop, naming it; what was there stays */
  snprintf(p, sizeof p, "%s/no-such-dir/t.json", dir);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  CHECK_EQ(dt_optim_step(m.opt), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_ERR_IO);
  CHECK(strstr(dt_last_error(), "no-such-dir") != NULL);
  CHECK(!dt_trace_active());
  /* a directory at the path: the file cannot replace it, and it stays a directory */
  snprintf(p, sizeof p, "%s/adir", dir);
  CHECK(th_mkdir(p, 0700) == 0);
  CHECK_EQ(dt_trace_start(p), DTRAIN_OK);
  CHECK_EQ(dt_optim_step(m.opt), DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_ERR_IO);
  CHECK(th_mkdir(p, 0700) != 0); /* still there */
  net_free(&m);
}

static int have_stdio;

/* DTRAIN_NO_STDIO builds have no traces: both calls say so */
static void test_probe(void) {
  char p[300];
  snprintf(p, sizeof p, "%s/probe.json", dir);
  dt_result r = dt_trace_start(p);
  if (r == DTRAIN_ERR_UNSUPPORTED) {
    CHECK(strstr(dt_last_error(), "DTRAIN_NO_STDIO") != NULL);
    CHECK_EQ(dt_trace_stop(), DTRAIN_ERR_UNSUPPORTED);
    CHECK(!dt_trace_active());
    return;
  }
  CHECK_EQ(r, DTRAIN_OK);
  CHECK_EQ(dt_trace_stop(), DTRAIN_OK);
  read_trace(p);
  CHECK(T.ok);
  CHECK_EQ(T.n, 0);
  have_stdio = 1;
}

int main(void) {
  snprintf(dir, sizeof dir, "%s/dtrain-trace-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(dir)) {
    printf("test_trace: cannot make a temporary directory\n");
    return 1;
  }
  TH_RUN(test_probe);
  if (have_stdio) {
    TH_RUN(test_one_device);
    TH_RUN(test_mirrored);
    TH_RUN(test_central_storage);
    TH_RUN(test_async);
    TH_RUN(test_multi_worker_mirrored);
    TH_RUN(test_parameter_server_local);
    TH_RUN(test_sessions);
    TH_RUN(test_profile_unchanged);
    TH_RUN(test_roles_and_errors);
  } else {
    th_skip_item("trace tests", "DTRAIN_NO_STDIO build has no file I/O");
  }
#if !defined(_WIN32) /* (Windows: the directory stays in the temporary folder) */
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf \"%s\"", dir);
  if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
#endif
  return th_summary("test_trace");
}
