/* tests/test_mwm_tcp.c -- multi_worker_mirrored across forked processes
 * over the TCP communicator on 127.0.0.1 (port 0): 2 x 1 equals mirrored(2)
 * and 2 x 2 equals mirrored(4) computed in one process, 3 processes with
 * uneven local batches (one empty) equal one_device on the concatenation,
 * every rank ends bitwise equal to rank 0 with the same losses, and a rank
 * killed (SIGKILL) or stopped (SIGSTOP) mid-run makes every other rank's
 * step fail within the deadline naming it, with no parameter changed. The
 * parent binds every rank's listening socket before forking; children report
 * through exit codes; alarms keep anything from hanging. With fp16 or bf16
 * gradients on the wire (compress) the ranks stay bitwise equal, near
 * mirrored's result, sending about half the bytes. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#if defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)
static void test_unsupported(void) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  CHECK(dt_comm_create_tcp(&c, NULL) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
}

int main(void) {
  th_skip_item("test_mwm_tcp multi-process tests", "networking or threads not compiled in");
  TH_RUN(test_unsupported);
  return th_summary("mwm_tcp");
}
#else
#  include <signal.h>
#  include <sys/wait.h>
#  include <unistd.h>

#  define MAXW 4
#  define NS 256
#  define NF 6
#  define NC 3
#  define K 6
#  define PMAX 1024

static float data_x[NS * NF];
static int32_t data_y[NS];

static void make_data(void) {
  th_seed(7);
  for (int i = 0; i < NS; i++) {
    int c = (int)(th_rand() * NC);
    data_y[i] = c;
    for (int f = 0; f < NF; f++) data_x[i * NF + f] = th_uniform(-1, 1) + (f % NC == c ? 1.0f : 0.0f);
  }
}

typedef struct model {
  dt_params *P;
  dt_nn_linear l1, l2;
} model;

static void model_init(model *m, uint64_t seed) {
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 12, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 12, NC, 1);
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

static dt_optim *make_opt(dt_params *P) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.01f;
  return dt_optim_create(P, &d);
}

/* A run: W processes x N threads; split[r] rows for rank r (sum B). */
typedef struct run {
  int W, N;
  int64_t B;
  int64_t split[MAXW];
  int victim;      /* this rank raises sig before step 3 (-1: none) */
  int sig;
  dt_compress compress; /* gradients on the wire: near the reference, not equal */
  int converge;         /* the long run of test_compressed_converges instead */
  int overlap;          /* test_overlap's comparison instead */
  size_t bucket;        /* overlap: bucket bytes */
  dt_compress_kind ck;  /* overlap: fp16 / bf16 buckets (both runs; none: floats) */
  int ov;               /* the plain runs (faults) with overlap on */
  float ref[PMAX], ref_loss[K];
} run;

static int64_t batch_first(int k, int64_t B) { return ((int64_t)k * B) % (NS - B); }

/* The single-process reference on the global batches. */
static void reference(run *R, const dt_strategy_options *sd0) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P);
  dt_strategy_options sd = *sd0;
  sd.spin_us = -1;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CHECK(s != NULL);
  for (int k = 0; s && k < K; k++) {
    dt_minibatch b = rows_at(batch_first(k, R->B), R->B);
    CHECK(dt_strategy_step(s, &b, &R->ref_loss[k]) == DTRAIN_OK);
  }
  memcpy(R->ref, dt_params_data(m.P), dt_params_size(m.P) * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static int child_fail;
#  define CK(cond)                                                                                          \
    do {                                                                                                    \
      if (!(cond)) {                                                                                        \
        child_fail++;                                                                                       \
        fprintf(stderr, "CHILD FAIL %s:%d [%s]: %s (last error: %s)\n", __FILE__, __LINE__, th_cur, #cond, \
                dt_last_error());                                                                           \
      }                                                                                                     \
    } while (0)

static int lfd[MAXW];
static char addr[MAXW][64];
static char *addrs[MAXW];

static void converge_child(const run *R, dt_comm *comm, int rank);
static void overlap_child(const run *R, dt_comm *comm, int rank);

static void child(const run *R, int rank) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = R->W;
  c.worker_addr = addrs;
  c.role = DTRAIN_ROLE_WORKER;
  c.index = rank;
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 3;
  o.connect_timeout_s = 10;
  o.quiet = 1;
  o.listen_fd = lfd[rank];
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  CK(comm != NULL);
  if (!comm) return;
  if (R->converge || R->overlap) {
    if (R->converge) converge_child(R, comm, rank);
    else overlap_child(R, comm, rank);
    dt_comm_destroy(comm);
    return;
  }
  model m;
  model_init(&m, 5 + 1000 * (uint64_t)rank); /* differently initialised: rank 0's values win */
  dt_optim *opt = make_opt(m.P);
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(comm, R->N);
  sd.spin_us = -1;
  sd.compress = R->compress;
  sd.overlap = R->ov;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CK(s != NULL);
  size_t n = dt_params_size(m.P);
  int64_t first = 0;
  for (int r = 0; r < rank; r++) first += R->split[r];
  float loss[K];
  for (int k = 0; s && k < K; k++) {
    if (rank == R->victim && k == 3) raise(R->sig);
    dt_minibatch b = rows_at(batch_first(k, R->B) + first, R->split[rank]);
    float before[PMAX];
    memcpy(before, dt_params_data(m.P), n * sizeof(float));
    double t0 = dt__now();
    dt_result rc = dt_strategy_step(s, &b, &loss[k]);
    double took = dt__now() - t0;
    if (R->victim >= 0 && k == 3) {
      /* the survivors: the error names the lost rank, within the deadline */
      char want[64];
      snprintf(want, sizeof want, "worker %d (127.0.0.1:", R->victim);
      CK(rc == (R->sig == SIGKILL ? DTRAIN_ERR_PEER : DTRAIN_ERR_TIMEOUT));
      CK(strstr(dt_last_error(), want) != NULL);
      CK(strstr(dt_last_error(), "dt_strategy_step") != NULL);
      CK(took < 8.0);
      CK(memcmp(before, dt_params_data(m.P), n * sizeof(float)) == 0);
      if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "rank %d (%.2f s): %s\n", rank, took, dt_last_error());
      break;
    }
    CK(rc == DTRAIN_OK);
    if (rc != DTRAIN_OK) break;
  }
  if (R->victim < 0) {
    double d = 0.0, mx = 0.0;
    for (size_t i = 0; i < n; i++) {
      d = fmax(d, fabs((double)dt_params_data(m.P)[i] - (double)R->ref[i]));
      mx = fmax(mx, fabs((double)R->ref[i]));
    }
    /* compressed: gradients rounded to 11 (fp16) or 8 (bf16) bits, 6 Adam steps
     * of lr 0.01; topk:1 and a PowerSGD rank no matrix is factored at send
     * every value as a float */
    dt_compress_kind ck = R->compress.kind;
    double tol = ck == DTRAIN_COMPRESS_FP16 ? 2e-3 : ck == DTRAIN_COMPRESS_BF16 ? 1e-2 : 1e-5;
    CK(d <= tol * mx);
    if (d > tol * mx) fprintf(stderr, "rank %d: max diff %g of %g\n", rank, d, mx);
    for (int k = 0; k < K; k++) CK(fabs((double)loss[k] - (double)R->ref_loss[k]) <= tol * fabs((double)R->ref_loss[k]) + 1e-6);
    /* the bytes sent: the float ring's 2(W-1)/W of the buffer, or about half of it in 16 bits */
    dt_strategy_stats st;
    memset(&st, 0, sizeof st);
    CK(s && dt_strategy_stats_get(s, &st) == DTRAIN_OK);
    double ring = (double)K * 2.0 * (R->W - 1) / R->W * (double)(n + 8) * sizeof(float);
    if (ck == DTRAIN_COMPRESS_NONE) CK(fabs((double)st.wire_bytes - ring) <= (double)K);
    else if (ck == DTRAIN_COMPRESS_FP16 || ck == DTRAIN_COMPRESS_BF16) CK(st.wire_bytes > 0 && (double)st.wire_bytes <= 0.62 * ring);
    else CK(st.wire_bytes > 0);
    if (getenv("DTRAIN_TEST_VERBOSE")) fprintf(stderr, "rank %d: %llu wire bytes (float ring %.0f)\n", rank, (unsigned long long)st.wire_bytes, ring);
    /* bitwise equal to rank 0: parameters and losses */
    float p0[PMAX], l0[K];
    memcpy(p0, dt_params_data(m.P), n * sizeof(float));
    memcpy(l0, loss, sizeof l0);
    CK(dt_comm_broadcast(comm, rank, p0, n, 0) == DTRAIN_OK);
    CK(dt_comm_broadcast(comm, rank, l0, K, 0) == DTRAIN_OK);
    CK(memcmp(p0, dt_params_data(m.P), n * sizeof(float)) == 0);
    CK(memcmp(l0, loss, sizeof l0) == 0);
  }
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  dt_comm_destroy(comm);
}

/* What run_world is waiting for, so that the whole-test alarm says where it
 * was stuck (a write from the handler, then the default action). */
static char world_now[160] = "set-up";

static void on_alarm(int sig) {
  static const char pre[] = "test_mwm_tcp: the alarm went off while waiting for ";
  ssize_t w = write(2, pre, sizeof pre - 1);
  w = write(2, world_now, strlen(world_now));
  w = write(2, "\n", 1);
  (void)w;
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Forks W ranks; returns after reaping them all (a victim is killed once
 * the survivors are done). */
static void run_world(const run *R) {
  snprintf(world_now, sizeof world_now,
           "run_world: %d processes x %d threads, victim %d (signal %d), compress %d, overlap %d/%d, converge %d",
           R->W, R->N, R->victim, R->sig, (int)R->compress.kind, R->overlap, R->ov, R->converge);
  for (int r = 0; r < R->W; r++) {
    if (dt__net_listen("127.0.0.1:0", &lfd[r]) != DTRAIN_OK) {
      CHECK_MSG(0, "listen: %s", dt_last_error());
      return;
    }
    snprintf(addr[r], sizeof addr[r], "127.0.0.1:%d", dt__net_port(lfd[r]));
    addrs[r] = addr[r];
  }
  pid_t pid[MAXW];
  fflush(NULL);
  for (int r = 0; r < R->W; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      snprintf(world_now, sizeof world_now, "rank %d's own work (its 60 s alarm)", r);
      alarm(60);
      for (int j = 0; j < R->W; j++)
        if (j != r) close(lfd[j]);
      child_fail = 0;
      child(R, r);
      fflush(NULL);
      _exit(child_fail ? 1 : 0);
    }
  }
  for (int r = 0; r < R->W; r++) {
    if (r == R->victim) continue;
    int st = 0;
    waitpid(pid[r], &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%d x %d: rank %d ended with status %d", R->W, R->N, r, st);
  }
  if (R->victim >= 0) {
    kill(pid[R->victim], SIGKILL);
    kill(pid[R->victim], SIGCONT);
    int st = 0;
    waitpid(pid[R->victim], &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  }
  for (int r = 0; r < R->W; r++) close(lfd[r]);
}

static run R;

static void set_mirrored_split(run *r) {
  int tot = r->W * r->N;
  int64_t base = r->B / tot, extra = r->B % tot;
  for (int p = 0; p < r->W; p++) {
    r->split[p] = 0;
    for (int q = p * r->N; q < (p + 1) * r->N; q++) r->split[p] += base + (q < extra ? 1 : 0);
  }
}

/* W processes x N threads (gradients on the wire as `compress`) against mirrored(W x N). */
static void run_like_mirrored(int W, int N, const char *spec) {
  dt_compress compress;
  CHECK(dt_compress_parse(spec, &compress) == DTRAIN_OK);
  memset(&R, 0, sizeof R);
  R.W = W;
  R.N = N;
  R.compress = compress;
  R.B = 31;
  R.victim = -1;
  set_mirrored_split(&R);
  dt_strategy_options md = dt_strategy_mirrored(R.W * R.N);
  reference(&R, &md);
  run_world(&R);
}

static void test_equals_mirrored(void) {
  run_like_mirrored(2, 1, "none");
  run_like_mirrored(2, 2, "none");
}

static void test_uneven_equals_one_device(void) {
  memset(&R, 0, sizeof R);
  R.W = 3;
  R.N = 1;
  R.split[0] = 5;
  R.split[1] = 0;
  R.split[2] = 20;
  R.B = 25;
  R.victim = -1;
  dt_strategy_options od = dt_strategy_one_device();
  reference(&R, &od);
  run_world(&R);
}

static void test_compressed(void) {
  /* fp16 and bf16 on the wire, 2 and 3 processes: near mirrored's result, and
   * every rank bitwise equal to rank 0 (checked in child) */
  run_like_mirrored(2, 1, "fp16");
  run_like_mirrored(3, 2, "fp16");
  run_like_mirrored(2, 2, "bf16");
  /* top-k keeping everything, and a PowerSGD rank at which no matrix is
   * factored (its factors would be no smaller): every value as a float */
  run_like_mirrored(2, 2, "topk:1");
  run_like_mirrored(3, 1, "topk:1");
  run_like_mirrored(2, 1, "powersgd:1024");
}

/* ---- convergence with top-k and PowerSGD (error feedback) ---- */
#  define KC 240
#  define BC 32
static double conv_first, conv_ref; /* one_device: the first loss, the mean of the last 20 */

static double last_mean(const float *loss) {
  double m = 0.0;
  for (int k = KC - 20; k < KC; k++) m += loss[k];
  return m / 20.0;
}

static void converge_reference(void) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P);
  dt_strategy_options sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  float loss[KC];
  for (int k = 0; s && k < KC; k++) {
    dt_minibatch b = rows_at(batch_first(k, BC), BC);
    CHECK(dt_strategy_step(s, &b, &loss[k]) == DTRAIN_OK);
  }
  conv_first = loss[0];
  conv_ref = last_mean(loss);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

/* Each of W ranks trains on its share of the same global batches. */
static void converge_child(const run *R, dt_comm *comm, int rank) {
  model m;
  model_init(&m, 5);
  dt_optim *opt = make_opt(m.P);
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(comm, 1);
  sd.spin_us = -1;
  sd.compress = R->compress;
  dt_strategy *s = dt_strategy_create(m.P, opt, model_step, &m, &sd);
  CK(s != NULL);
  float loss[KC];
  int64_t share = BC / R->W;
  for (int k = 0; s && k < KC; k++) {
    dt_minibatch b = rows_at(batch_first(k, BC) + rank * share, share);
    dt_result rc = dt_strategy_step(s, &b, &loss[k]);
    CK(rc == DTRAIN_OK);
    if (rc != DTRAIN_OK) break;
  }
  char name[32];
  double got = last_mean(loss);
  /* at least 90% of the uncompressed run's drop in loss */
  CK(got <= conv_ref + 0.1 * (conv_first - conv_ref));
  dt_strategy_stats st;
  memset(&st, 0, sizeof st);
  CK(s && dt_strategy_stats_get(s, &st) == DTRAIN_OK);
  size_t n = dt_params_size(m.P);
  double ring = (double)KC * 2.0 * (R->W - 1) / R->W * (double)(n + 8) * sizeof(float);
  if (getenv("DTRAIN_TEST_VERBOSE"))
    fprintf(stderr, "%s W %d rank %d: loss %.4f (one_device %.4f, from %.4f), wire bytes %.3g of the float ring's\n",
            dt_compress_format(R->compress, name, sizeof name), R->W, rank, got, conv_ref, conv_first,
            (double)st.wire_bytes / ring);
  /* the ranks' parameters are bitwise equal */
  float p0[PMAX];
  memcpy(p0, dt_params_data(m.P), n * sizeof(float));
  CK(dt_comm_broadcast(comm, rank, p0, n, 0) == DTRAIN_OK);
  CK(memcmp(p0, dt_params_data(m.P), n * sizeof(float)) == 0);
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
}

static void test_compressed_converges(void) {
  converge_reference();
  const char *specs[] = {"topk:0.1", "powersgd:1", "powersgd:2"};
  for (int i = 0; i < 3; i++)
    for (int W = 2; W <= 4; W += 2) {
      memset(&R, 0, sizeof R);
      R.W = W;
      R.N = 1;
      R.victim = -1;
      R.converge = 1;
      CHECK(dt_compress_parse(specs[i], &R.compress) == DTRAIN_OK);
      run_world(&R);
    }
}

static void test_faults(void) {
  /* {W, victim, signal, overlap, replicas per process} */
  static const int cases[6][5] = {{2, 1, SIGKILL, 0, 2}, {3, 2, SIGKILL, 0, 2}, {2, 0, SIGSTOP, 0, 2},
                                  {3, 1, SIGKILL, 1, 1}, {2, 1, SIGSTOP, 1, 1}, {2, 0, SIGKILL, 1, 2}};
  for (int ci = 0; ci < 6; ci++) {
    memset(&R, 0, sizeof R);
    R.W = cases[ci][0];
    R.N = cases[ci][4];
    R.ov = cases[ci][3];
    R.B = 24;
    R.victim = cases[ci][1];
    R.sig = cases[ci][2];
    set_mirrored_split(&R);
    run_world(&R);
  }
}

/* ---- overlap: buckets all-reduced during backward, bitwise the plain path ---- */
static void overlap_child(const run *R, dt_comm *comm, int rank) {
  model m[2];
  dt_optim *opt[2];
  dt_strategy *s[2];
  for (int v = 0; v < 2; v++) {
    model_init(&m[v], 5 + 1000 * (uint64_t)rank); /* rank 0's values win */
    opt[v] = make_opt(m[v].P);
    dt_strategy_options sd = dt_strategy_multi_worker_mirrored(comm, R->N);
    sd.spin_us = -1;
    sd.check_numerics = R->bucket == 64; /* one case scans in the overlap thread */
    sd.overlap = v;
    sd.bucket_bytes = R->bucket;
    sd.compress.kind = R->ck;
    s[v] = dt_strategy_create(m[v].P, opt[v], model_step, &m[v], &sd);
    CK(s[v] != NULL);
  }
  size_t n = dt_params_size(m[0].P);
  int64_t share = 24 / R->W;
  int same = 1;
  for (int k = 0; s[0] && s[1] && k < K; k++) {
    float loss[2];
    for (int v = 0; v < 2; v++) {
      dt_minibatch b = rows_at(batch_first(k, 24) + rank * share, share);
      CK(dt_strategy_step(s[v], &b, &loss[v]) == DTRAIN_OK);
    }
    same &= loss[0] == loss[1];
    same &= memcmp(dt_params_data(m[0].P), dt_params_data(m[1].P), n * sizeof(float)) == 0;
  }
  CK(same);
  dt_strategy_stats st[2];
  for (int v = 0; v < 2; v++) CK(s[v] && dt_strategy_stats_get(s[v], &st[v]) == DTRAIN_OK);
  /* the same bytes: the buckets cover the gradient once, the tail goes on its own */
  double tail = (double)K * 2.0 * (R->W - 1) / R->W * 8.0 * sizeof(float);
  CK(fabs((double)st[1].wire_bytes - (double)st[0].wire_bytes) <= tail + 16.0 * K);
  if (getenv("DTRAIN_TEST_VERBOSE"))
    fprintf(stderr, "overlap W %d x %d bucket %zu %s rank %d: %d buckets, bitwise %s\n", R->W, R->N, R->bucket,
            R->ck == DTRAIN_COMPRESS_FP16 ? "fp16" : R->ck == DTRAIN_COMPRESS_BF16 ? "bf16" : "floats", rank,
            s[1] ? dt__overlap_buckets(s[1]->ov) : -1, same ? "yes" : "NO");
  for (int v = 0; v < 2; v++) {
    dt_strategy_destroy(s[v]);
    dt_optim_destroy(opt[v]);
    dt_params_destroy(m[v].P);
  }
}

static void test_overlap(void) {
  /* every parameter its own bucket (4 bytes), odd sizes (100, 64 with the
   * numerics scan), one bucket (the default 2 MiB); 2 and 3 workers of one
   * replica, 2 workers of 2 and 3 replicas (the local sum in the thread too) */
  size_t buckets[] = {4, 100, 64, 0};
  const int shape[4][2] = {{2, 1}, {3, 1}, {2, 2}, {2, 3}};
  for (int w = 0; w < 4; w++)
    for (int i = 0; i < 4; i++) {
      memset(&R, 0, sizeof R);
      R.W = shape[w][0];
      R.N = shape[w][1];
      R.victim = -1;
      R.overlap = 1;
      R.bucket = buckets[i];
      run_world(&R);
    }
  /* 16-bit buckets: the plain run sums the same buckets one after the other
   * (bucket_bytes given; 0: one bucket, the whole gradient, both ways) */
  for (int k = 0; k < 2; k++)
    for (int w = 0; w < 3; w++)
      for (int i = 0; i < 4; i += (i == 1 ? 2 : 1)) {
        memset(&R, 0, sizeof R);
        R.W = shape[w][0];
        R.N = shape[w][1];
        R.victim = -1;
        R.overlap = 1;
        R.bucket = buckets[i];
        R.ck = k ? DTRAIN_COMPRESS_BF16 : DTRAIN_COMPRESS_FP16;
        run_world(&R);
      }
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  signal(SIGALRM, on_alarm);
  alarm(240);
  make_data();
  TH_RUN(test_equals_mirrored);
  TH_RUN(test_uneven_equals_one_device);
  TH_RUN(test_compressed);
  TH_RUN(test_compressed_converges);
  TH_RUN(test_overlap);
  TH_RUN(test_faults);
  return th_summary("mwm_tcp");
}
#endif
