/* bench_hostile.c -- training time with hostile connections open for the
 * whole run (issue 17): a parameter-server job and a multi_worker_mirrored
 * job, each undisturbed and then with an attacker process that holds
 * `silent` connections that never send a byte and `drip` connections that
 * send one byte of a genuine-looking hello every drip_s seconds, at every
 * listening process of the job, reconnecting each one the job drops (so the
 * attack lasts the whole run) -- with and without a token.
 *
 *   build/bench/bench_hostile [steps] [rounds] [silent] [drip] [drip_s]
 *   (defaults: 3000 2 8 8 1.0; make build/bench/bench_hostile)
 *
 * parameter_server: 2 workers x 1 server, an MLP 64-256-256-1 (83k floats),
 * batch 32, max_staleness 1, `steps` steps per worker. multi_worker_mirrored:
 * 2 workers, the same MLP and steps (one gradient all-reduce per step). Each
 * process is forked here on 127.0.0.1 with pre-bound sockets. Time: from the
 * fork of the job's processes until every worker exited (start-up included),
 * best of `rounds`, the two kinds of run alternating. Prints one line per
 * case with both times and their ratio, and the attacker's reconnects (how
 * many connections the job dropped). Timings only: nothing is asserted. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define NIN 64
#define NH 256
#define NSAMPLES 2048
#define BATCH 32
#define MAXC 256

typedef struct mlp {
  dt_nn_linear l1, l2, l3;
} mlp;

static float g_x[NSAMPLES * NIN], g_t[NSAMPLES];

static dt_tensor *mlp_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  mlp *m = (mlp *)user;
  int64_t xs[2] = {b->rows, NIN}, ts[2] = {b->rows, 1};
  (void)replica;
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  return dt_mse(g, dt_nn_linear_forward(g, &m->l3, h), dt_tensor_wrap(g, 2, ts, (float *)b->t));
}

static dt_params *mlp_make(mlp *m, dt_optim **opt) {
  dt_params *P = dt_params_create(1);
  dt_nn_linear_init(&m->l1, P, "fc1", NIN, NH, 1);
  dt_nn_linear_init(&m->l2, P, "fc2", NH, NH, 1);
  dt_nn_linear_init(&m->l3, P, "fc3", NH, 1, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.01f;
  *opt = dt_optim_create(P, &od);
  return P;
}

typedef struct job {
  int ps;              /* 1: parameter_server, 0: multi_worker_mirrored */
  const char *token;
  int steps;
  char addr[3][32];
  char *waddr[2], *saddr[1];
  int lfd[3];          /* workers' (mwm), then the server's */
} job;

static dt_net_options job_opts(const job *J, int lfd) {
  dt_net_options o = dt_net_defaults();
  o.token = J->token;
  o.job_id = 0x6a6f62;
  o.listen_fd = lfd;
  o.quiet = 1;
  return o;
}

static int run_process(const job *J, dt_role role, int index) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = 2;
  c.servers = J->ps ? 1 : 0;
  c.worker_addr = (char **)J->waddr;
  c.server_addr = J->ps ? (char **)J->saddr : NULL;
  c.role = role;
  c.index = index;
  mlp m;
  dt_optim *opt;
  dt_params *P = mlp_make(&m, &opt);
  dt_net_options o = job_opts(J, role == DTRAIN_ROLE_PS ? J->lfd[2] : J->ps ? -1 : J->lfd[index]);
  o.model_hash = dt_params_hash(P);
  if (role == DTRAIN_ROLE_PS) return dt_ps_serve(&c, P, opt, &o, NULL) == DTRAIN_OK ? 0 : 1;
  dt_pstore *store = NULL;
  dt_comm *comm = NULL;
  dt_strategy_options sd;
  if (J->ps) {
    store = dt_pstore_create_tcp(&c, P, &o, 1);
    if (!store) goto fail;
    sd = dt_strategy_parameter_server(store, 1);
  } else {
    comm = dt_comm_create_tcp(&c, &o);
    if (!comm) goto fail;
    sd = dt_strategy_multi_worker_mirrored(comm, 1);
  }
  dt_strategy *s = dt_strategy_create(P, opt, mlp_step, &m, &sd);
  if (!s) goto fail;
  for (int t = 0; t < J->steps; t++) {
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    int64_t first = ((int64_t)(t * 2 + index) * BATCH) % (NSAMPLES - BATCH);
    b.rows = BATCH;
    b.x = g_x + first * NIN;
    b.x_cols = NIN;
    b.t = g_t + first;
    b.t_cols = 1;
    if (dt_strategy_step(s, &b, NULL) != DTRAIN_OK) goto fail;
  }
  if (store) dt_pstore_leave(store, index);
  dt_strategy_destroy(s);
  if (store) dt_pstore_destroy(store);
  if (comm) dt_comm_destroy(comm);
  return 0;
fail:
  fprintf(stderr, "bench_hostile: worker %d: %s\n", index, dt_last_error());
  return 1;
}

/* ---- the attacker ------------------------------------------------------------------------ */

static volatile sig_atomic_t g_stop;
static void on_term(int sig) {
  (void)sig;
  g_stop = 1;
}
static void quiet_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level;
  (void)code;
  (void)msg;
  (void)user;
}

/* Holds silent + drip connections at each address, reconnecting any the far
 * side closes; writes its reconnect count to out_fd when told to stop. */
static void attacker(char *const *addrs, int naddr, int silent, int drip, double drip_s,
                     const unsigned char *hello, int ready_fd, int out_fd) {
  int fd[MAXC], drips[MAXC], who[MAXC], n = 0;
  size_t off[MAXC];
  long reconnects = 0;
  signal(SIGTERM, on_term);
  dt_set_logger(quiet_log, NULL, DTRAIN_LOG_ERROR); /* a refused reconnect is expected at the end */
  for (int a = 0; a < naddr; a++)
    for (int k = 0; k < silent + drip && n < MAXC; k++, n++) {
      who[n] = a;
      drips[n] = k >= silent;
      off[n] = 0;
      if (dt__net_connect(addrs[a], dt__now() + 5, &fd[n]) != DTRAIN_OK) fd[n] = -1;
    }
  if (write(ready_fd, "k", 1) != 1) _exit(1);
  double next_drip = dt__now() + drip_s;
  while (!g_stop) {
    struct pollfd pf[MAXC];
    for (int i = 0; i < n; i++) {
      pf[i].fd = fd[i];
      pf[i].events = POLLIN;
      pf[i].revents = 0;
    }
    poll(pf, (nfds_t)n, 20);
    for (int i = 0; i < n; i++) {
      int gone = fd[i] < 0;
      if (!gone && (pf[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        unsigned char junk[512];
        ssize_t k = recv(fd[i], junk, sizeof junk, 0);
        gone = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      }
      if (!gone) continue;
      if (fd[i] >= 0) {
        close(fd[i]);
        reconnects++; /* the job dropped it */
      }
      off[i] = 0;
      if (dt__net_connect(addrs[who[i]], dt__now() + 0.05, &fd[i]) != DTRAIN_OK) fd[i] = -1;
    }
    if (dt__now() >= next_drip) {
      next_drip += drip_s;
      for (int i = 0; i < n; i++)
        if (drips[i] && fd[i] >= 0 && off[i] < DT__NET_HDR + DT__HELLO &&
            send(fd[i], hello + off[i], 1, DT__NET_SEND_FLAGS) == 1)
          off[i]++;
    }
  }
  if (write(out_fd, &reconnects, sizeof reconnects) != (ssize_t)sizeof reconnects) _exit(1);
  _exit(0);
}

/* ---- one run ------------------------------------------------------------------------------- */

static double run_job(int ps, const char *token, int steps, int silent, int drip, double drip_s, long *reconnects) {
  job J;
  memset(&J, 0, sizeof J);
  J.ps = ps;
  J.token = token;
  J.steps = steps;
  int nl = ps ? 1 : 2; /* listening: the server, or the workers of the mesh */
  for (int i = 0; i < 3; i++) J.lfd[i] = -1;
  for (int i = 0; i < nl; i++) {
    int slot = ps ? 2 : i;
    if (dt__net_listen("127.0.0.1:0", &J.lfd[slot]) != DTRAIN_OK) return -1;
    snprintf(J.addr[slot], sizeof J.addr[slot], "127.0.0.1:%d", dt__net_port(J.lfd[slot]));
  }
  if (ps) {
    snprintf(J.addr[0], sizeof J.addr[0], "127.0.0.1:1"); /* workers do not listen in PS training */
    snprintf(J.addr[1], sizeof J.addr[1], "127.0.0.1:2");
  }
  J.waddr[0] = J.addr[0];
  J.waddr[1] = J.addr[1];
  J.saddr[0] = J.addr[2];
  pid_t bad = -1;
  int rp[2] = {-1, -1}, op[2] = {-1, -1};
  if (silent + drip > 0) {
    /* A hello of worker 1 of this job (with the token flag when the job has one): it looks real. */
    dt_cluster c;
    memset(&c, 0, sizeof c);
    c.workers = 2;
    c.servers = ps ? 1 : 0;
    c.worker_addr = J.waddr;
    c.server_addr = ps ? J.saddr : NULL;
    c.role = DTRAIN_ROLE_WORKER;
    c.index = 1;
    dt_net_options o = job_opts(&J, -1);
    dt__net_self self;
    unsigned char hello[DT__NET_HDR + DT__HELLO];
    dt__hello h;
    dt__net_self_init(&self, &c, &o);
    dt__hello_self(&self, &h);
    dt__hello_pack(&h, hello + DT__NET_HDR);
    dt__frame_pack(hello, DT__MSG_HELLO, self.job, self.id, 0, hello + DT__NET_HDR, DT__HELLO);
    char *targets[2];
    int nt = 0;
    if (ps) targets[nt++] = J.addr[2];
    else targets[nt++] = J.addr[0]; /* rank 1 of 2 dials and accepts nothing */
    if (pipe(rp) != 0 || pipe(op) != 0) return -1;
    fflush(NULL);
    bad = fork();
    if (bad == 0) {
      for (int i = 0; i < 3; i++)
        if (J.lfd[i] >= 0) close(J.lfd[i]);
      attacker(targets, nt, silent, drip, drip_s, hello, rp[1], op[1]);
    }
    char ok;
    if (read(rp[0], &ok, 1) != 1) return -1;
  }
  double t0 = dt__now();
  pid_t pid[3];
  int np = 0;
  fflush(NULL);
  for (int p = 0; p < (ps ? 3 : 2); p++) {
    dt_role role = p == 2 ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER;
    pid[np] = fork();
    if (pid[np] == 0) {
      signal(SIGPIPE, SIG_IGN);
      int keep = role == DTRAIN_ROLE_PS ? 2 : ps ? -1 : p;
      for (int i = 0; i < 3; i++)
        if (i != keep && J.lfd[i] >= 0) close(J.lfd[i]);
      _exit(run_process(&J, role, role == DTRAIN_ROLE_PS ? 0 : p));
    }
    np++;
  }
  int failed = 0;
  for (int p = 0; p < np; p++) {
    int st = 0;
    waitpid(pid[p], &st, 0);
    failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  double dt = dt__now() - t0;
  *reconnects = 0;
  if (bad > 0) {
    kill(bad, SIGTERM);
    if (read(op[0], reconnects, sizeof *reconnects) != (ssize_t)sizeof *reconnects) *reconnects = -1;
    waitpid(bad, NULL, 0);
    close(rp[0]);
    close(rp[1]);
    close(op[0]);
    close(op[1]);
  }
  for (int i = 0; i < 3; i++)
    if (J.lfd[i] >= 0) close(J.lfd[i]);
  return failed ? -1 : dt;
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 3000, rounds = argc > 2 ? atoi(argv[2]) : 2;
  int silent = argc > 3 ? atoi(argv[3]) : 8, drip = argc > 4 ? atoi(argv[4]) : 8;
  double drip_s = argc > 5 ? atof(argv[5]) : 1.0;
  if (steps < 1 || rounds < 1 || silent < 0 || drip < 0 || silent + drip > MAXC || drip_s <= 0) {
    fprintf(stderr, "usage: bench_hostile [steps] [rounds] [silent] [drip] [drip_s]\n");
    return 2;
  }
  dt_set_logger(NULL, NULL, DTRAIN_LOG_ERROR);
  dt_rng r;
  dt_rng_seed(&r, 7);
  for (int i = 0; i < NSAMPLES * NIN; i++) g_x[i] = dt_rng_uniform(&r) * 2 - 1;
  for (int i = 0; i < NSAMPLES; i++) g_t[i] = g_x[i * NIN] - 0.5f * g_x[i * NIN + 1];
  printf("bench_hostile: %d steps x 2 workers, best of %d; attack: %d silent + %d connections sending a byte "
         "every %.2f s, at each listening process, held all run\n", steps, rounds, silent, drip, drip_s);
  for (int ps = 1; ps >= 0; ps--)
    for (int tok = 0; tok < 2; tok++) {
      double calm = 1e30, hit = 1e30;
      long rec = 0, rmax = 0;
      for (int k = 0; k < rounds; k++) {
        double a = run_job(ps, tok ? "bench-secret" : NULL, steps, 0, 0, drip_s, &rec);
        double b = run_job(ps, tok ? "bench-secret" : NULL, steps, silent, drip, drip_s, &rec);
        if (a < 0 || b < 0) {
          printf("%-22s %-8s a run failed (%s)\n", ps ? "parameter_server" : "multi_worker_mirrored",
                 tok ? "token" : "no token", a < 0 ? "undisturbed" : "attacked");
          fflush(stdout);
          continue;
        }
        if (a < calm) calm = a;
        if (b < hit) hit = b;
        if (rec > rmax) rmax = rec;
      }
      if (calm < 1e30 && hit < 1e30)
        printf("%-22s %-8s undisturbed %6.2f s  attacked %6.2f s  ratio %.3f  (connections dropped and reopened: %ld)\n",
               ps ? "parameter_server" : "multi_worker_mirrored", tok ? "token" : "no token", calm, hit, hit / calm,
               rmax);
      fflush(stdout);
    }
  return 0;
}
