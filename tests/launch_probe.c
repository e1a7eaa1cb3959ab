/* tests/launch_probe.c -- the program tests/launch_checks.sh starts under
 * tools/dtrain-launch. It reads its place in the cluster with
 * dt_cluster_from_env and behaves as the first argument says:
 *
 *   info                  print role, index, cluster size, own address, the
 *                         convenience variables, and whether DTRAIN_LISTEN_FD
 *                         is a listening socket bound to its own port
 *   exitif ROLE I CODE    process (ROLE, I) exits with CODE; the others wait
 *   killif ROLE I SIG     process (ROLE, I) kills itself with SIG; the others wait
 *   ignore                worker 1 exits with 1; the others ignore SIGTERM and wait
 *   wait                  print "ready pid=PID", wait for a signal, report it, die by it
 *   ps                    servers wait like `wait`; workers print info and exit 0
 *   partial               worker 0 prints a line without its newline, worker 1
 *                         a line on stderr, worker 2 a 10000-byte line
 *   token                 print DTRAIN_TOKEN
 *   pswork S              servers wait like `wait`; workers print "ready
 *                         pid=PID", work S seconds (sleep), print "finished"
 *                         and exit 0 (the script kills some of them meanwhile)
 *   mwm                   workers form a TCP communicator (dt_comm_create_tcp),
 *                         then dial every worker's port while all are still
 *                         up (barriers around it) and print what a stranger
 *                         gets: "probe worker K: refused" is right, "hangs"
 *                         (nothing within 2 s) is the bug
 *   psworkers             servers serve a tiny model (dt_ps_serve); workers
 *                         open a store (dt_pstore_create_tcp), then probe the
 *                         workers' ports the same way (PROBE_DIR keeps them
 *                         all up meanwhile) and leave
 *   psworkers I           the same, but worker I stops itself (SIGSTOP) once its
 *                         store is open and the others leave without probing
 *
 * "Wait" means: until a signal (reported as "got signal N", then the default
 * action) or 20 s (alarm), so that nothing hangs. With PROBE_DIR set, a
 * waiting process creates PROBE_DIR/ready.ROLE.INDEX once its signal
 * handlers are in place, and a failing process first waits (up to 10 s) for
 * every other process's file, so that what the others do with the
 * launcher's SIGTERM does not depend on timing.
 */
#define _POSIX_C_SOURCE 200809L
#include "dtrain.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void on_sig(int sig) {
  char msg[32] = "got signal ";
  size_t n = strlen(msg);
  if (sig >= 10) msg[n++] = (char)('0' + sig / 10);
  msg[n++] = (char)('0' + sig % 10);
  msg[n++] = '\n';
  if (write(1, msg, n) < 0) _exit(99);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void marker(char *buf, size_t cap, const char *dir, int ps, int index) {
  snprintf(buf, cap, "%s/ready.%s.%d", dir, ps ? "ps" : "worker", index);
}

/* sigaction, not signal(): in a strict C11 build glibc's signal() is one-shot
 * and does not block the signal in its handler, so a second SIGTERM (the
 * launcher's to the process group, then the --hosts script's to the program,
 * microseconds apart) killed the process before it reported the first. Here
 * all three are blocked while the handler runs. */
static void catch_signal(int sig, void (*handler)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGHUP);
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaction(sig, &sa, NULL);
}

static void wait_for_signal(const dt_cluster *c, int ignore_term) {
  catch_signal(SIGINT, on_sig);
  catch_signal(SIGHUP, on_sig);
  catch_signal(SIGTERM, ignore_term ? SIG_IGN : on_sig);
  alarm(20);
  const char *dir = getenv("PROBE_DIR");
  if (dir) {
    char path[512];
    marker(path, sizeof path, dir, c->role == DTRAIN_ROLE_PS, c->index);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
  }
  printf("ready pid=%ld\n", (long)getpid());
  fflush(stdout);
  for (;;) pause();
}

/* Wait until every other process is waiting (see PROBE_DIR above). */
static void sync_others(const dt_cluster *c) {
  const char *dir = getenv("PROBE_DIR");
  if (!dir) return;
  for (int tries = 0; tries < 500; tries++) {
    int missing = 0;
    for (int k = 0; k < c->workers + c->servers; k++) {
      int ps = k >= c->workers, i = ps ? k - c->workers : k;
      if (ps == (c->role == DTRAIN_ROLE_PS) && i == c->index) continue;
      char path[512];
      marker(path, sizeof path, dir, ps, i);
      if (access(path, F_OK) != 0) missing++;
    }
    if (!missing) return;
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
}

static int port_of(const char *addr) {
  const char *c = strrchr(addr, ':');
  return c ? atoi(c + 1) : -1;
}

/* A listening TCP socket's port, or -1 when fd is not one. */
static int listening_port(int fd) {
  int acc = 0;
  socklen_t len = sizeof acc;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) return -1;
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return -1;
}

/* Dial addr ("host:port", IPv4 loopback here) as a stranger would and say
 * what happens within 2 s: refused, closed (reset or end of file), answered
 * (some bytes: a refusal frame), or hangs (connected, nothing comes). */
static const char *stranger(const char *addr) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((unsigned short)port_of(addr));
  sa.sin_addr.s_addr = htonl(0x7f000001);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "no socket";
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  const char *what = "hangs";
  struct pollfd p = {fd, POLLOUT, 0};
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (errno != EINPROGRESS) what = errno == ECONNREFUSED ? "refused" : "error";
    else if (poll(&p, 1, 2000) != 1) what = "hangs";
    else {
      int err = 0;
      socklen_t l = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l);
      if (err) what = err == ECONNREFUSED ? "refused" : "error";
      else what = NULL;
    }
  } else {
    what = NULL;
  }
  if (!what) { /* connected: does anything come back? */
    char b[64];
    p.events = POLLIN;
    p.revents = 0;
    if (poll(&p, 1, 2000) != 1) what = "hangs";
    else {
      ssize_t k = recv(fd, b, sizeof b, 0);
      what = k > 0 ? "answered" : "closed";
    }
  }
  close(fd);
  return what;
}

static void probe_workers(const dt_cluster *c) {
  for (int k = 0; k < c->workers; k++) printf("probe worker %d: %s\n", k, stranger(c->worker_addr[k]));
  const char *lf = getenv("DTRAIN_LISTEN_FD");
  printf("own listener: %s\n", lf && listening_port(atoi(lf)) >= 0 ? "open" : "closed");
  fflush(stdout);
}

/* PROBE_DIR/TAG.ROLE.INDEX exists for every process, this one's made first (10 s at most). */
static void rendezvous(const dt_cluster *c, const char *tag) {
  const char *dir = getenv("PROBE_DIR");
  char path[512];
  if (!dir) return;
  snprintf(path, sizeof path, "%s/%s.%s.%d", dir, tag, c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->index);
  FILE *f = fopen(path, "w");
  if (f) fclose(f);
  for (int tries = 0; tries < 500; tries++) {
    int missing = 0;
    for (int k = 0; k < c->workers; k++) {
      snprintf(path, sizeof path, "%s/%s.worker.%d", dir, tag, k);
      if (access(path, F_OK) != 0) missing++;
    }
    if (!missing) return;
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
}

static int mwm(const dt_cluster *c) {
  dt_net_options o = dt_net_defaults();
  dt_comm *comm = dt_comm_create_tcp(c, &o);
  if (!comm) {
    printf("comm: %s\n", dt_last_error());
    return 1;
  }
  int bad = dt_comm_barrier(comm, c->index) != DTRAIN_OK; /* every rank's mesh is up */
  probe_workers(c);
  bad |= dt_comm_barrier(comm, c->index) != DTRAIN_OK; /* nobody gone before everyone probed */
  dt_comm_destroy(comm);
  return bad;
}

static int psworkers(const dt_cluster *c, int stall) {
  dt_params *P = dt_params_create(1);
  int64_t shape[1] = {8};
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.1f;
  dt_init zeros;
  memset(&zeros, 0, sizeof zeros);
  int bad = !P || dt_params_add(P, "w", 1, shape, zeros) < 0;
  dt_optim *opt = bad ? NULL : dt_optim_create(P, &od);
  dt_net_options o = dt_net_defaults();
  if (!opt) bad = 1;
  else if (c->role == DTRAIN_ROLE_PS) {
    bad = dt_ps_serve(c, P, opt, &o, NULL) != DTRAIN_OK;
  } else {
    dt_pstore *st = dt_pstore_create_tcp(c, P, &o, 0);
    if (!st) {
      printf("store: %s\n", dt_last_error());
      bad = 1;
    } else {
      if (stall >= 0 && c->index == stall) {
        printf("stopping myself\n");
        fflush(stdout);
        raise(SIGSTOP);
      } else if (stall < 0) {
        rendezvous(c, "store");
        probe_workers(c);
        rendezvous(c, "probed");
      }
      dt_pstore_leave(st, c->index);
      dt_pstore_destroy(st);
    }
  }
  if (bad) printf("psworkers: %s\n", dt_last_error());
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return bad;
}

static void info(const dt_cluster *c) {
  const char *self = c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index];
  const char *lf = getenv("DTRAIN_LISTEN_FD"), *rank = getenv("DTRAIN_RANK"), *world = getenv("DTRAIN_WORLD");
  const char *role = getenv("DTRAIN_ROLE");
  char listen[64] = "missing";
  if (lf) {
    int fd = atoi(lf), p = listening_port(fd);
    if (p < 0)
      snprintf(listen, sizeof listen, "bad(fd %d is not a listening socket)", fd);
    else if (p != port_of(self))
      snprintf(listen, sizeof listen, "bad(port %d, own address has %d)", p, port_of(self));
    else
      snprintf(listen, sizeof listen, "ok");
  }
  /* The other processes' listening sockets must not leak into this one. */
  int leaked = -1;
  for (int fd = 3; fd < 256; fd++)
    if ((!lf || fd != atoi(lf)) && listening_port(fd) >= 0) leaked = fd;
  printf("role=%s index=%d workers=%d servers=%d self=%s rank=%s world=%s envrole=%s listen=%s leaked=%d\n",
         c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->index, c->workers, c->servers, self, rank ? rank : "-",
         world ? world : "-", role ? role : "-", listen, leaked);
  for (int k = 0; k < c->workers; k++) printf("worker_addr %d %s\n", k, c->worker_addr[k]);
  for (int k = 0; k < c->servers; k++) printf("server_addr %d %s\n", k, c->server_addr[k]);
}

int main(int argc, char **argv) {
  dt_cluster *c = NULL;
  if (dt_cluster_from_env(&c) != DTRAIN_OK) {
    printf("no cluster: %s\n", dt_last_error());
    return 90;
  }
  const char *mode = argc > 1 ? argv[1] : "info";
  const char *role = c->role == DTRAIN_ROLE_PS ? "ps" : "worker";
  int index = c->index, is_ps = c->role == DTRAIN_ROLE_PS;
  if (strcmp(mode, "info") == 0) {
    info(c);
  } else if ((strcmp(mode, "exitif") == 0 || strcmp(mode, "killif") == 0) && argc == 5) {
    if (strcmp(argv[2], role) == 0 && atoi(argv[3]) == index) {
      sync_others(c);
      printf("failing now\n");
      fflush(stdout);
      if (mode[0] == 'e') exit(atoi(argv[4]));
      raise(atoi(argv[4]));
    }
    wait_for_signal(c, 0);
  } else if (strcmp(mode, "ignore") == 0) {
    if (!is_ps && index == 1) {
      sync_others(c);
      dt_cluster_destroy(c);
      return 1;
    }
    wait_for_signal(c, 1);
  } else if (strcmp(mode, "wait") == 0) {
    wait_for_signal(c, 0);
  } else if (strcmp(mode, "ps") == 0) {
    if (is_ps) wait_for_signal(c, 0);
    info(c);
  } else if (strcmp(mode, "partial") == 0) {
    if (index == 0) printf("no newline");
    if (index == 1) fprintf(stderr, "to stderr\n");
    if (index == 2) {
      for (int k = 0; k < 10000; k++) putchar('x');
      putchar('\n');
    }
  } else if (strcmp(mode, "pswork") == 0 && argc == 3) {
    if (is_ps) wait_for_signal(c, 0);
    printf("ready pid=%ld\n", (long)getpid());
    fflush(stdout);
    double secs = atof(argv[2]);
    struct timespec ts = {(time_t)secs, (long)((secs - (double)(time_t)secs) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    printf("finished\n");
  } else if (strcmp(mode, "mwm") == 0 || strcmp(mode, "psworkers") == 0) {
    int bad = mode[0] == 'm' ? mwm(c) : psworkers(c, argc > 2 ? atoi(argv[2]) : -1);
    dt_cluster_destroy(c);
    return bad;
  } else if (strcmp(mode, "token") == 0) {
    const char *t = getenv("DTRAIN_TOKEN");
    printf("token=%s\n", t ? t : "");
  } else {
    printf("unknown mode %s\n", mode);
    dt_cluster_destroy(c);
    return 91;
  }
  dt_cluster_destroy(c);
  return 0;
}
