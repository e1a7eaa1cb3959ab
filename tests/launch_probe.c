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
#include <netinet/in.h>
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

static void wait_for_signal(const dt_cluster *c, int ignore_term) {
  signal(SIGINT, on_sig);
  signal(SIGHUP, on_sig);
  signal(SIGTERM, ignore_term ? SIG_IGN : on_sig);
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
