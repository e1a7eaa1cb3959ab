/* tests/tcp_world.h -- forked ranks on 127.0.0.1 for the TCP communicator's
 * tests: the parent binds every rank's listening socket (port 0) before
 * forking, so there is no port race; each child runs a function and reports
 * through its exit code (CK counts failed checks inside a child). */
#ifndef DTRAIN_TCP_WORLD_H
#define DTRAIN_TCP_WORLD_H
#include <dirent.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXW 5

typedef struct world {
  int w;
  int lfd[MAXW];
  char addr[MAXW][64];
  char *addrs[MAXW];
  pid_t pid[MAXW];
} world;

static int open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

static void world_init(world *x, int w) {
  memset(x, 0, sizeof *x);
  x->w = w;
  for (int i = 0; i < w; i++) {
    if (dt__net_listen("127.0.0.1:0", &x->lfd[i]) != DTRAIN_OK) {
      fprintf(stderr, "listen: %s\n", dt_last_error());
      exit(1);
    }
    snprintf(x->addr[i], sizeof x->addr[i], "127.0.0.1:%d", dt__net_port(x->lfd[i]));
    x->addrs[i] = x->addr[i];
  }
}

static void world_close(world *x) {
  for (int i = 0; i < x->w; i++) close(x->lfd[i]);
}

static dt_cluster cluster_of(world *x, int rank) {
  dt_cluster c;
  memset(&c, 0, sizeof c);
  c.workers = x->w;
  c.worker_addr = x->addrs;
  c.role = DTRAIN_ROLE_WORKER;
  c.index = rank;
  return c;
}

static dt_net_options opts_of(world *x, int rank) {
  dt_net_options o = dt_net_defaults();
  o.timeout_s = 5;
  o.connect_timeout_s = 10;
  o.quiet = getenv("DTRAIN_TEST_VERBOSE") == NULL;
  o.listen_fd = x->lfd[rank];
  return o;
}

/* Child-side checks: print and count. */
static int child_fail;
#define CK(cond)                                                                                        \
    do {                                                                                                  \
      if (!(cond)) {                                                                                      \
        child_fail++;                                                                                     \
        fprintf(stderr, "CHILD FAIL %s:%d [%s]: %s (last error: %s)\n", __FILE__, __LINE__, th_cur, #cond, \
                dt_last_error());                                                                         \
      }                                                                                                   \
    } while (0)

typedef int (*child_fn)(world *x, int rank, void *arg);

/* Fork one child per rank running fn (under an alarm of `alarm_s`). */
static void fork_world(world *x, child_fn fn, void *arg, unsigned alarm_s) {
  fflush(NULL);
  for (int r = 0; r < x->w; r++) {
    pid_t p = fork();
    if (p == 0) {
      alarm(alarm_s);
      for (int j = 0; j < x->w; j++)
        if (j != r) close(x->lfd[j]);
      child_fail = 0;
      int rc = fn(x, r, arg);
      fflush(NULL);
      exit(rc ? rc : (child_fail ? 1 : 0)); /* exit, not _exit: LeakSanitizer checks the children too */
    }
    x->pid[r] = p;
  }
}

static int reap(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

/* One child per rank running fn; status[r]: its exit code (128 + N: signal N). */
static void run_world(world *x, child_fn fn, void *arg, int *status) {
  fork_world(x, fn, arg, 60);
  for (int r = 0; r < x->w; r++) status[r] = reap(x->pid[r]);
}

/* The same when rank `victim` stops or kills itself on purpose: the others
 * are waited for first, then the victim is finished (SIGKILL, SIGCONT for a
 * stopped one) and reaped: status[victim] is 128 + SIGKILL unless it ended
 * on its own before. */
static void run_world_victim(world *x, child_fn fn, void *arg, int victim, int *status) {
  fork_world(x, fn, arg, 30);
  for (int r = 0; r < x->w; r++)
    if (r != victim) status[r] = reap(x->pid[r]);
  kill(x->pid[victim], SIGKILL);
  kill(x->pid[victim], SIGCONT);
  status[victim] = reap(x->pid[victim]);
}

static void check_world(world *x, const int *st, const int *want) {
  for (int r = 0; r < x->w; r++)
    CHECK_MSG(st[r] == (want ? want[r] : 0), "world %d rank %d exit %d", x->w, r, st[r]);
}

#endif /* DTRAIN_TCP_WORLD_H */
