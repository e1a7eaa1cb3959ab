/* bench_multiworker.c -- the Fashion-MNIST MLP (784-256-128-10, Adam lr 1e-3)
 * trained by multi_worker_mirrored across W processes over TCP, for the
 * comparison with PyTorch DDP (gloo) in `make bench-net` (bench/run_net.sh).
 *
 *   build/bench/bench_multiworker [workers] [batch_per_rank] [seconds] [--compress X]
 *   build/bench/bench_multiworker W B S --rank R --peers host:port,... [--compress X]
 *
 * The first form forks the workers here; the second runs one rank of W
 * (bench/run_slowlinks.sh puts each in its own network namespace, behind a
 * tbf-shaped veth link). --compress is multi_worker_mirrored's (none, fp16,
 * bf16, topk:F, powersgd:R).
 *
 * Forks `workers` processes on 127.0.0.1 (pre-bound ports, one thread each),
 * synthetic data of Fashion-MNIST's shape (4096 samples per rank, cycled), and
 * times like bench/torch_ddp.py: after 3 warm-up steps, the best of windows of
 * 10 steps on rank 0 (every step all-reduces, so the ranks stay in step; rank
 * 0 decides when to stop and the others learn it through a broadcast).
 * Prints "result samples_per_s=... (all ranks together)". Timings only. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NSAMPLES 4096
#define WINDOW 10

typedef struct mlp {
  dt_nn_linear l1, l2, l3;
} mlp;

static dt_tensor *mlp_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  mlp *m = (mlp *)user;
  int64_t xs[2] = {b->rows, 784};
  (void)replica;
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, xs, (float *)b->x)));
  h = dt_relu(g, dt_nn_linear_forward(g, &m->l2, h));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l3, h), b->y);
}

static dt_compress compress; /* --compress */

static int run_rank(dt_cluster *cl, int fd, int64_t batch, double seconds, int out_fd) {
  float *X = (float *)malloc(sizeof(float) * NSAMPLES * 784);
  int32_t *Y = (int32_t *)malloc(sizeof(int32_t) * NSAMPLES);
  dt_rng r;
  dt_rng_seed(&r, 100 + (uint64_t)cl->index);
  for (int64_t i = 0; i < (int64_t)NSAMPLES * 784; i++) X[i] = dt_rng_uniform(&r);
  for (int i = 0; i < NSAMPLES; i++) Y[i] = (int32_t)(dt_rng_u64(&r) % 10);
  dt_params *P = dt_params_create(1);
  mlp m;
  dt_nn_linear_init(&m.l1, P, "fc1", 784, 256, 1);
  dt_nn_linear_init(&m.l2, P, "fc2", 256, 128, 1);
  dt_nn_linear_init(&m.l3, P, "fc3", 128, 10, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 1e-3f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_net_options o = dt_net_defaults();
  o.listen_fd = fd > 0 ? fd : 0; /* 0: bind this rank's own address */
  o.model_hash = dt_params_hash(P);
  dt_comm *c = dt_comm_create_tcp(cl, &o);
  if (!c) {
    fprintf(stderr, "bench_multiworker: %s\n", dt_last_error());
    return 1;
  }
  dt_strategy_options sd = dt_strategy_multi_worker_mirrored(c, 1);
  sd.compress = compress;
  dt_strategy *s = dt_strategy_create(P, opt, mlp_step, &m, &sd);
  if (!s) {
    fprintf(stderr, "bench_multiworker: %s\n", dt_last_error());
    return 1;
  }
  int64_t nb = NSAMPLES / batch;
  double best = 0, tw = 0, t_end = 0;
  float stop = 0;
  int rc = 0;
  for (int64_t step = 0;; step++) {
    if (step == 3) {
      tw = dt_time_now();
      t_end = tw + seconds;
    }
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    b.rows = batch;
    b.x = X + (step % nb) * batch * 784;
    b.x_cols = 784;
    b.y = Y + (step % nb) * batch;
    if (dt_strategy_step(s, &b, NULL) != DTRAIN_OK) {
      fprintf(stderr, "bench_multiworker: %s\n", dt_last_error());
      rc = 1;
      break;
    }
    if (step >= 3 && (step - 2) % WINDOW == 0) {
      double now = dt_time_now();
      double rate = (double)WINDOW * (double)batch * cl->workers / (now - tw);
      if (rate > best) best = rate;
      tw = now;
      stop = (cl->index == 0 && now >= t_end) ? 1.0f : 0.0f;
      if (dt_comm_broadcast(c, cl->index, &stop, 1, 0) != DTRAIN_OK) {
        rc = 1;
        break;
      }
      if (stop > 0) break;
    }
  }
  if (cl->index == 0 && out_fd >= 0 && write(out_fd, &best, sizeof best) != (ssize_t)sizeof best) rc = 1;
  if (cl->index == 0 && out_fd < 0 && rc == 0)
    printf("result samples_per_s=%.1f ranks=%d batch_per_rank=%lld\n", best, cl->workers, (long long)batch);
  dt_strategy_destroy(s);
  dt_comm_destroy(c);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  free(X);
  free(Y);
  return rc;
}

int main(int argc, char **argv) {
  int W = argc > 1 ? atoi(argv[1]) : 2;
  int64_t batch = argc > 2 ? atoll(argv[2]) : 64;
  double seconds = argc > 3 ? atof(argv[3]) : 3.0;
  int rank = -1;
  const char *peers = NULL;
  for (int i = 4; i < argc; i++) {
    if (!strcmp(argv[i], "--compress") && i + 1 < argc) {
      if (dt_compress_parse(argv[++i], &compress) != DTRAIN_OK) {
        fprintf(stderr, "bench_multiworker: %s\n", dt_last_error());
        return 2;
      }
    } else if (!strcmp(argv[i], "--rank") && i + 1 < argc) {
      rank = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--peers") && i + 1 < argc) {
      peers = argv[++i];
    } else {
      W = 0; /* the usage */
    }
  }
  if (W < 1 || W > 64 || batch < 1 || batch > NSAMPLES || (rank >= 0) != (peers != NULL) || rank >= W) {
    fprintf(stderr, "usage: bench_multiworker [workers] [batch_per_rank] [seconds] [--rank R --peers host:port,...] [--compress X]\n");
    return 2;
  }
  int fds[64], pfd[2];
  char text[64][64];
  char *addr[64];
  if (peers) { /* one rank of W, each at its address in the list */
    char list[64 * 64];
    snprintf(list, sizeof list, "%s", peers);
    int n = 0;
    for (char *tok = strtok(list, ","); tok && n < 64; tok = strtok(NULL, ",")) {
      if (strlen(tok) >= sizeof text[n]) {
        fprintf(stderr, "bench_multiworker: --peers: address '%.60s' is longer than %d characters\n", tok,
                (int)sizeof text[n] - 1);
        return 2;
      }
      snprintf(text[n], sizeof text[n], "%s", tok);
      addr[n] = text[n];
      n++;
    }
    if (n != W) {
      fprintf(stderr, "bench_multiworker: --peers names %d addresses for %d workers\n", n, W);
      return 2;
    }
    dt_cluster one;
    memset(&one, 0, sizeof one);
    one.workers = W;
    one.worker_addr = addr;
    one.index = rank;
    return run_rank(&one, -1, batch, seconds, -1);
  }
  for (int r = 0; r < W; r++) {
    if (dt__net_listen("127.0.0.1:0", &fds[r]) != DTRAIN_OK) {
      fprintf(stderr, "bench_multiworker: %s\n", dt_last_error());
      return 1;
    }
    snprintf(text[r], sizeof text[r], "127.0.0.1:%d", dt__net_port(fds[r]));
    addr[r] = text[r];
  }
  if (pipe(pfd) != 0) return 1;
  dt_cluster cl;
  memset(&cl, 0, sizeof cl);
  cl.workers = W;
  cl.worker_addr = addr;
  pid_t pid[64];
  fflush(stdout);
  for (int r = 0; r < W; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      for (int k = 0; k < W; k++)
        if (k != r) close(fds[k]);
      close(pfd[0]);
      cl.index = r;
      _exit(run_rank(&cl, fds[r], batch, seconds, pfd[1]));
    }
  }
  close(pfd[1]);
  for (int r = 0; r < W; r++) close(fds[r]);
  double best = 0;
  ssize_t got = read(pfd[0], &best, sizeof best);
  int bad = got != (ssize_t)sizeof best;
  for (int r = 0; r < W; r++) {
    int st = 0;
    waitpid(pid[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  if (bad) {
    printf("result failed\n");
    return 1;
  }
  printf("result samples_per_s=%.1f ranks=%d batch_per_rank=%lld\n", best, W, (long long)batch);
  return 0;
}
