/* dtrain-bench -- all-reduce benchmark in the style of nccl-tests, for every
 * dtrain communicator backend.
 *
 *   tools/dtrain-bench [--backend threads|tcp|mpi] [-n N] [-b MIN] [-e MAX] [-f FACTOR]
 *                      [--iters I] [--warmup W] [--op allreduce|broadcast|reduce_scatter|allgather]
 *                      [--no-check] [--csv FILE]
 *
 *   threads: N threads of this process (dt_comm_create_threads)
 *   tcp:     N processes over TCP. Under tools/dtrain-launch (or with DTRAIN_CONFIG /
 *            --rank/--world/--peers set by hand, across machines) each process is one rank;
 *            otherwise dtrain-bench forks N local processes itself (127.0.0.1, free ports).
 *   mpi:     MPI_COMM_WORLD (the binary built with mpicc -DDTRAIN_USE_MPI, dtrain-bench-mpi,
 *            run under mpirun); the same table for MPI's own collectives.
 *
 * Columns (rank 0 prints them): size in bytes, count in floats, time per call in
 * microseconds (mean over the iterations, the slowest rank's), algbw = size / time,
 * busbw = algbw * 2(N-1)/N for all-reduce ((N-1)/N for reduce-scatter and all-gather,
 * 1 for broadcast): the bandwidth each link must sustain, comparable across N and
 * against the link's speed (nccl-tests' definition). #wrong counts elements that
 * differ from the exact expected result (the inputs are small integers, so sums are
 * exact in float).
 */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_WIN32)
#  include <sys/socket.h>
#  include <sys/wait.h>
#  include <unistd.h>
#endif

typedef enum { OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE_SCATTER, OP_ALLGATHER } bench_op;

typedef struct bench_cfg {
  const char *backend;
  int n;
  size_t min_bytes, max_bytes;
  double factor;
  int iters, warmup;
  bench_op op;
  int check;
  const char *csv;
} bench_cfg;

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return v < 4 ? 4 : (size_t)v;
}

static const char *op_name(bench_op op) {
  return op == OP_ALLREDUCE ? "allreduce" : op == OP_BROADCAST ? "broadcast" : op == OP_REDUCE_SCATTER ? "reduce_scatter" : "allgather";
}

static double bus_factor(bench_op op, int n) {
  if (n <= 1) return 1.0;
  if (op == OP_ALLREDUCE) return 2.0 * (n - 1) / n;
  if (op == OP_BROADCAST) return 1.0;
  return (double)(n - 1) / n;
}

static void fill(float *b, size_t count, int rank) {
  for (size_t i = 0; i < count; i++) b[i] = (float)((int)((i * 7 + (size_t)rank * 13) % 17) - 8);
}

/* Elements of b that differ from what the op must have produced. */
static long count_wrong(const float *b, size_t count, int rank, int n, bench_op op) {
  long wrong = 0;
  size_t lo = 0, hi = count;
  if (op == OP_REDUCE_SCATTER) dt_comm_slice(count, n, rank, &lo, &hi);
  for (size_t i = lo; i < hi; i++) {
    float want;
    if (op == OP_ALLREDUCE || op == OP_REDUCE_SCATTER) {
      int s = 0;
      for (int r = 0; r < n; r++) s += (int)((i * 7 + (size_t)r * 13) % 17) - 8;
      want = (float)s;
    } else if (op == OP_BROADCAST) {
      want = (float)((int)((i * 7) % 17) - 8);
    } else {
      int owner = 0;
      for (int r = 0; r < n; r++) {
        size_t a, z;
        dt_comm_slice(count, n, r, &a, &z);
        if (i >= a && i < z) owner = r;
      }
      want = (float)((int)((i * 7 + (size_t)owner * 13) % 17) - 8);
    }
    if (b[i] != want) wrong++;
  }
  return wrong;
}

static dt_result run_op(dt_comm *c, int rank, float *b, size_t count, bench_op op) {
  switch (op) {
    case OP_ALLREDUCE: return dt_comm_allreduce(c, rank, b, count);
    case OP_BROADCAST: return dt_comm_broadcast(c, rank, b, count, 0);
    case OP_REDUCE_SCATTER: return dt_comm_reduce_scatter(c, rank, b, count);
    default: return dt_comm_allgather(c, rank, b, count);
  }
}

/* One rank's whole sweep. Rank 0 prints. Every rank returns 0 or 1. */
static int bench_rank(dt_comm *c, int rank, const bench_cfg *cfg) {
  int n = dt_comm_world(c);
  size_t maxc = cfg->max_bytes / 4;
  float *buf = (float *)malloc(maxc * sizeof(float) + 64);
  FILE *csv = NULL;
  int bad = 0;
  if (!buf) {
    fprintf(stderr, "dtrain-bench: out of memory\n");
    return 1;
  }
  if (rank == 0) {
    printf("# dtrain-bench: %s, backend %s, %d ranks, %d iterations (+%d warm-up)\n", op_name(cfg->op), dt_comm_name(c), n,
           cfg->iters, cfg->warmup);
    printf("#%12s %12s %6s %10s %8s %8s %7s\n", "size", "count", "type", "time", "algbw", "busbw", "#wrong");
    printf("#%12s %12s %6s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "(us)", "(GB/s)", "(GB/s)", "");
    if (cfg->csv) {
      csv = fopen(cfg->csv, "w");
      if (!csv) {
        fprintf(stderr, "dtrain-bench: --csv %s: %s\n", cfg->csv, strerror(errno));
        free(buf);
        return 1;
      }
      fprintf(csv, "backend,op,ranks,bytes,count,time_us,algbw_gbs,busbw_gbs,wrong\n");
    }
  }
  for (size_t bytes = cfg->min_bytes; bytes <= cfg->max_bytes;) {
    size_t count = bytes / 4;
    long wrong = 0;
    dt_result rc = DTRAIN_OK;
    if (cfg->check) {
      fill(buf, count, rank);
      rc = run_op(c, rank, buf, count, cfg->op);
      if (rc == DTRAIN_OK) wrong = count_wrong(buf, count, rank, n, cfg->op);
    }
    for (int i = 0; rc == DTRAIN_OK && i < cfg->warmup; i++) rc = run_op(c, rank, buf, count, cfg->op);
    double t0 = dt_time_now();
    for (int i = 0; rc == DTRAIN_OK && i < cfg->iters; i++) rc = run_op(c, rank, buf, count, cfg->op);
    double dt = (dt_time_now() - t0) / cfg->iters;
    if (rc != DTRAIN_OK) {
      fprintf(stderr, "dtrain-bench: rank %d: %s\n", rank, dt_last_error());
      bad = 1;
      break;
    }
    /* the slowest rank's time and the total of wrong elements, via the backend itself */
    float tmax[2] = {(float)dt, (float)wrong};
    if (dt_comm_allreduce(c, rank, tmax, 2) != DTRAIN_OK) {
      fprintf(stderr, "dtrain-bench: rank %d: %s\n", rank, dt_last_error());
      bad = 1;
      break;
    }
    /* allreduce sums: the mean time over ranks (nccl-tests reports the average too) */
    double tm = tmax[0] / n;
    long wr = (long)tmax[1];
    if (wr) bad = 1;
    if (rank == 0) {
      double algbw = (double)bytes / tm / 1e9, busbw = algbw * bus_factor(cfg->op, n);
      printf(" %12zu %12zu %6s %10.2f %8.3f %8.3f %7ld\n", bytes, count, "float", tm * 1e6, algbw, busbw, wr);
      fflush(stdout);
      if (csv)
        fprintf(csv, "%s,%s,%d,%zu,%zu,%.3f,%.4f,%.4f,%ld\n", dt_comm_name(c), op_name(cfg->op), n, bytes, count,
                tm * 1e6, algbw, busbw, wr);
    }
    size_t next = (size_t)((double)bytes * cfg->factor);
    if (next <= bytes) next = bytes + 4;
    if (bytes < cfg->max_bytes && next > cfg->max_bytes) next = cfg->max_bytes;
    else if (bytes == cfg->max_bytes) break;
    bytes = next;
  }
  if (csv) fclose(csv);
  free(buf);
  return bad;
}

/* ---- threads backend ------------------------------------------------------------------ */
typedef struct thr_arg {
  dt_comm *c;
  int rank;
  const bench_cfg *cfg;
  int result;
} thr_arg;

#if !defined(DTRAIN_NO_THREADS)
#  include <pthread.h>
static void *thr_main(void *p) {
  thr_arg *a = (thr_arg *)p;
  a->result = bench_rank(a->c, a->rank, a->cfg);
  return NULL;
}
#endif

static int run_threads(const bench_cfg *cfg) {
#if defined(DTRAIN_NO_THREADS)
  (void)cfg;
  fprintf(stderr, "dtrain-bench: built without threads\n");
  return 2;
#else
  dt_comm *c = dt_comm_create_threads(cfg->n, 0);
  if (!c) {
    fprintf(stderr, "dtrain-bench: %s\n", dt_last_error());
    return 2;
  }
  pthread_t th[256];
  thr_arg args[256];
  for (int r = 0; r < cfg->n; r++) {
    args[r].c = c;
    args[r].rank = r;
    args[r].cfg = cfg;
    args[r].result = 0;
    if (r > 0) pthread_create(&th[r], NULL, thr_main, &args[r]);
  }
  thr_main(&args[0]);
  int bad = args[0].result;
  for (int r = 1; r < cfg->n; r++) {
    pthread_join(th[r], NULL);
    bad |= args[r].result;
  }
  dt_comm_destroy(c);
  return bad;
#endif
}

/* ---- tcp backend ------------------------------------------------------------------------ */
static int run_tcp_rank(const dt_cluster *cl, const bench_cfg *cfg, int listen_fd) {
  dt_net_options o = dt_net_defaults();
  if (listen_fd >= 0) o.listen_fd = listen_fd;
  dt_comm *c = dt_comm_create_tcp(cl, &o);
  if (!c) {
    fprintf(stderr, "dtrain-bench: worker %d: %s\n", cl->index, dt_last_error());
    return 2;
  }
  int bad = bench_rank(c, dt_comm_rank(c), cfg);
  dt_comm_destroy(c);
  return bad;
}

static int run_tcp(const bench_cfg *cfg, int *argc, char **argv) {
  dt_cluster *cl = NULL;
  int given = getenv("DTRAIN_CONFIG") != NULL;
  for (int i = 1; i < *argc; i++)
    if (!strncmp(argv[i], "--rank", 6) || !strncmp(argv[i], "--world", 7) || !strncmp(argv[i], "--peers", 7)) given = 1;
  dt_result rc = given ? dt_cluster_discover(argc, argv, &cl) : DTRAIN_ERR_NOT_FOUND;
  if (rc == DTRAIN_OK) {
    int bad = run_tcp_rank(cl, cfg, -1);
    dt_cluster_destroy(cl);
    return bad;
  }
  if (given) {
    fprintf(stderr, "dtrain-bench: %s\n", dt_last_error());
    return 2;
  }
#if defined(_WIN32) || defined(DTRAIN_NO_NET)
  fprintf(stderr, "dtrain-bench: no cluster given and cannot fork here\n");
  return 2;
#else
  /* No cluster given: fork N local ranks, each with a listening socket bound to a free port. */
  int n = cfg->n, fds[DTRAIN_MAX_PEERS];
  char *addr[DTRAIN_MAX_PEERS];
  char text[DTRAIN_MAX_PEERS][32];
  for (int r = 0; r < n; r++) {
    int port;
    if (dt__net_listen("127.0.0.1:0", &fds[r]) != DTRAIN_OK || (port = dt__net_port(fds[r])) < 0) {
      fprintf(stderr, "dtrain-bench: %s\n", dt_last_error());
      return 2;
    }
    snprintf(text[r], sizeof text[r], "127.0.0.1:%d", port);
    addr[r] = text[r];
  }
  dt_cluster local;
  memset(&local, 0, sizeof local);
  local.workers = n;
  local.worker_addr = addr;
  local.role = DTRAIN_ROLE_WORKER;
  pid_t pid[DTRAIN_MAX_PEERS];
  fflush(stdout);
  for (int r = 0; r < n; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      for (int k = 0; k < n; k++)
        if (k != r) close(fds[k]);
      local.index = r;
      _exit(run_tcp_rank(&local, cfg, fds[r]));
    }
  }
  for (int r = 0; r < n; r++) close(fds[r]);
  int bad = 0;
  for (int r = 0; r < n; r++) {
    int st = 0;
    while (waitpid(pid[r], &st, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  return bad;
#endif
}

/* ---- mpi backend ---------------------------------------------------------------------- */
static int run_mpi(const bench_cfg *cfg) {
  dt_comm *c = dt_comm_create_mpi();
  if (!c) {
    fprintf(stderr, "dtrain-bench: %s (build dtrain-bench-mpi with mpicc -DDTRAIN_USE_MPI, run it under mpirun)\n",
            dt_last_error());
    return 2;
  }
  int bad = bench_rank(c, dt_comm_rank(c), cfg);
  dt_comm_destroy(c);
  return bad;
}

static void usage(void) {
  printf("usage: dtrain-bench [--backend threads|tcp|mpi] [-n N] [-b MIN] [-e MAX] [-f FACTOR]\n"
         "                    [--iters I] [--warmup W] [--op allreduce|broadcast|reduce_scatter|allgather]\n"
         "                    [--no-check] [--csv FILE] [--rank R --world W --peers h:p,...]\n"
         "sizes accept K/M/G suffixes (bytes). Defaults: tcp, -n 2, -b 4K -e 64M -f 2, 20 iterations, 5 warm-up.\n");
}

int main(int argc, char **argv) {
  bench_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
#if defined(DTRAIN_USE_MPI)
  cfg.backend = "mpi";
#else
  cfg.backend = "tcp";
#endif
  cfg.n = 2;
  cfg.min_bytes = 4096;
  cfg.max_bytes = 64u << 20;
  cfg.factor = 2;
  cfg.iters = 20;
  cfg.warmup = 5;
  cfg.check = 1;
  /* Our flags are consumed here; the cluster flags stay in argv for dt_cluster_from_args. */
  int out = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage();
      return 0;
    } else if (!strcmp(a, "--backend") && v) cfg.backend = v, i++;
    else if (!strcmp(a, "-n") && v) cfg.n = atoi(v), i++;
    else if (!strcmp(a, "-b") && v) cfg.min_bytes = parse_size(v), i++;
    else if (!strcmp(a, "-e") && v) cfg.max_bytes = parse_size(v), i++;
    else if (!strcmp(a, "-f") && v) cfg.factor = atof(v), i++;
    else if (!strcmp(a, "--iters") && v) cfg.iters = atoi(v), i++;
    else if (!strcmp(a, "--warmup") && v) cfg.warmup = atoi(v), i++;
    else if (!strcmp(a, "--csv") && v) cfg.csv = v, i++;
    else if (!strcmp(a, "--no-check")) cfg.check = 0;
    else if (!strcmp(a, "--op") && v) {
      i++;
      if (!strcmp(v, "allreduce")) cfg.op = OP_ALLREDUCE;
      else if (!strcmp(v, "broadcast")) cfg.op = OP_BROADCAST;
      else if (!strcmp(v, "reduce_scatter")) cfg.op = OP_REDUCE_SCATTER;
      else if (!strcmp(v, "allgather")) cfg.op = OP_ALLGATHER;
      else {
        fprintf(stderr, "dtrain-bench: unknown op '%s'\n", v);
        return 2;
      }
    } else argv[out++] = argv[i];
  }
  argc = out;
  argv[argc] = NULL;
  if (cfg.n < 1 || cfg.n > 256 || cfg.iters < 1 || cfg.warmup < 0 || cfg.factor <= 1.0 ||
      cfg.min_bytes > cfg.max_bytes) {
    fprintf(stderr, "dtrain-bench: bad arguments\n");
    usage();
    return 2;
  }
  cfg.min_bytes &= ~(size_t)3;
  cfg.max_bytes &= ~(size_t)3;
  if (cfg.csv) { /* an output that cannot be written fails now, not after the sweep (append: nothing is lost) */
    FILE *probe = fopen(cfg.csv, "a");
    if (!probe) {
      fprintf(stderr, "dtrain-bench: --csv %s: %s\n", cfg.csv, strerror(errno));
      return 2;
    }
    fclose(probe);
  }
  if (!strcmp(cfg.backend, "threads")) return run_threads(&cfg);
  if (!strcmp(cfg.backend, "tcp")) return run_tcp(&cfg, &argc, argv);
  if (!strcmp(cfg.backend, "mpi")) return run_mpi(&cfg);
  fprintf(stderr, "dtrain-bench: unknown backend '%s'\n", cfg.backend);
  return 2;
}
