/* bench_tcp_allreduce.c -- the TCP communicator's all-reduce between local
 * processes on 127.0.0.1, in the nccl-tests style.
 *
 *   make build/bench/bench_tcp_allreduce && build/bench/bench_tcp_allreduce [W]
 *
 * Forks W processes (default 2) that build a communicator over loopback
 * (listening sockets bound to port 0 by the parent before forking) and
 * all-reduce float buffers of 4 KiB to 64 MiB. Rank 0 prints, per size, the
 * best of ROUNDS rounds: time per call, algbw = bytes / time and busbw =
 * algbw * 2(W-1)/W. Timings only: nothing is asserted (the results are
 * checked once per size). */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 5
#define MAXW 16

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int listen_any(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  socklen_t len = sizeof a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 64) != 0) return -1;
  getsockname(fd, (struct sockaddr *)&a, &len);
  *port = ntohs(a.sin_port);
  return fd;
}

static int run_rank(int w, int rank, char **addrs, int lfd) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = w;
  c.worker_addr = addrs;
  c.role = DTRAIN_ROLE_WORKER;
  c.index = rank;
  dt_net_options o = dt_net_defaults();
  o.listen_fd = lfd;
  dt_comm *comm = dt_comm_create_tcp(&c, &o);
  if (!comm) {
    fprintf(stderr, "rank %d: %s\n", rank, dt_last_error());
    return 1;
  }
  size_t maxn = (size_t)16 << 20; /* 64 MiB of floats */
  float *buf = (float *)malloc(maxn * sizeof(float));
  if (rank == 0)
    printf("%12s %12s %12s %12s   (W=%d, tcp, 127.0.0.1)\n", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", w);
  for (size_t bytes = 4096; bytes <= maxn * sizeof(float); bytes *= 4) {
    size_t n = bytes / sizeof(float);
    for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
    if (dt_comm_allreduce(comm, rank, buf, n) != DTRAIN_OK) {
      fprintf(stderr, "rank %d: %s\n", rank, dt_last_error());
      return 1;
    }
    if (buf[0] != (float)w || buf[n - 1] != (float)w) fprintf(stderr, "rank %d: wrong sum at %zu bytes\n", rank, bytes);
    int iters = bytes <= (1u << 16) ? 200 : bytes <= (1u << 22) ? 20 : 3;
    double best = 1e30;
    for (int r = 0; r < ROUNDS; r++) {
      dt_comm_barrier(comm, rank);
      double t0 = now_s();
      for (int k = 0; k < iters; k++) dt_comm_allreduce(comm, rank, buf, n);
      double t = (now_s() - t0) / iters;
      if (t < best) best = t;
    }
    if (rank == 0) {
      double alg = (double)bytes / best / 1e9;
      printf("%12zu %12.1f %12.3f %12.3f\n", bytes, best * 1e6, alg, alg * 2.0 * (w - 1) / w);
      fflush(stdout);
    }
  }
  free(buf);
  dt_comm_destroy(comm);
  return 0;
}

int main(int argc, char **argv) {
  int w = argc > 1 ? atoi(argv[1]) : 2;
  if (w < 2 || w > MAXW) {
    fprintf(stderr, "usage: %s [W in 2..%d]\n", argv[0], MAXW);
    return 2;
  }
  static char text[MAXW][32];
  char *addrs[MAXW];
  int lfd[MAXW];
  for (int r = 0; r < w; r++) {
    int port = 0;
    lfd[r] = listen_any(&port);
    if (lfd[r] < 0) {
      perror("listen");
      return 1;
    }
    snprintf(text[r], sizeof text[r], "127.0.0.1:%d", port);
    addrs[r] = text[r];
  }
  fflush(NULL);
  pid_t pid[MAXW];
  for (int r = 0; r < w; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      for (int j = 0; j < w; j++)
        if (j != r) close(lfd[j]);
      _exit(run_rank(w, r, addrs, lfd[r]));
    }
  }
  int bad = 0;
  for (int r = 0; r < w; r++) {
    int st = 0;
    waitpid(pid[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  for (int r = 0; r < w; r++) close(lfd[r]);
  return bad;
}
