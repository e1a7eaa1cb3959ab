/* tools/dtrain_launch.c -- dtrain-launch: start N workers (and M parameter
 * servers) of a dtrain program on this machine, like torchrun or mpirun do
 * for one machine.
 *
 *   dtrain-launch -n N [--ps M] [--port P] [--host H] [--grace S] [--timeout S] [--token-env]
 *                 [--bind-to core|none] [--max-restarts K] [--min-workers M] [--pipeline P]
 *                 [--tensor T] [--hosts LIST [--rsh CMD]] -- PROGRAM ARGS...
 *
 * For each process it binds a listening socket (port 0, so the kernel picks a
 * free one, unless --port), then starts the program with:
 *   DTRAIN_CONFIG     the whole cluster and this process's task (TF_CONFIG style)
 *   DTRAIN_LISTEN_FD  the already bound, listening socket (no race for ports)
 *   DTRAIN_RANK, DTRAIN_WORLD, DTRAIN_ROLE   the same, for convenience
 *   DTRAIN_TOKEN      a fresh random secret for this job (kept if already set), so
 *                     that only the job's own processes get in; never printed
 *   DTRAIN_JOB_ID     a fresh random job id (kept if already set): every frame
 *                     carries it, and a peer of another job, or one started by
 *                     hand without it, is refused
 * With --bind-to core (Linux), process k (workers, then servers) may run only
 * on core k mod C of the C cores this launcher may use (all of a core's
 * hardware threads), as mpirun binds ranks: otherwise the scheduler, which
 * puts a task woken by a socket on the waker's CPU, often stacks two busy
 * workers on one core for milliseconds at a time (a 2-worker 1 MiB
 * all-reduce then runs at half speed).
 * Servers start first, then workers. Every line a process writes is prefixed
 * with "[worker 0] " or "[ps 1] " (stdout to stdout, stderr to stderr).
 * SIGINT, SIGTERM and SIGHUP are passed on to every process (a second one
 * kills them); unless a process failed first, the job's exit status is then
 * 128 + that signal. When a process fails (non-zero exit, or killed by a signal),
 * the others get a grace period to stop on their own (their dtrain calls fail
 * naming the lost rank), then SIGTERM, then SIGKILL; the exit status is the
 * first failure's code (128 + N for signal N). Servers still running a grace
 * period after every worker ended are stopped, and the run counts as a
 * success.
 * A parameter-server job (--ps M, M >= 1) is asynchronous: the servers drop a
 * worker that dies and train on with the others, so a worker's failure is
 * logged and ends nothing. The job ends when every worker has ended; it
 * succeeded (exit 0) when at least one worker finished (exit code 0) and no
 * server failed; when every worker failed, the exit status is the first
 * worker failure's code. A server's failure (or a signal passed on, or
 * --timeout) still ends the whole job as above. Servers end on their own
 * once every worker has left or was lost, so workers still running a grace
 * period after the last server ended (stopped with SIGSTOP, hung) cannot
 * train on: they are stopped too, and count as lost.
 * --max-restarts K (like torchrun's): a worker that fails does not end the
 * job while fewer than K restarts were made. In a synchronous job every
 * worker is stopped (SIGTERM, then SIGKILL) and all are started again, with
 * DTRAIN_RESTART=R (the restart's number; 0 the first time): the program
 * resumes from its last checkpoint (examples/05: --checkpoint with
 * --checkpoint-every). In a parameter-server job only the dead worker is
 * started again and rejoins the servers, which wait DTRAIN_REJOIN_TIMEOUT
 * for it (set to 60 s unless given) when it was the last one live.
 * --min-workers M (elastic size, synchronous jobs): a worker that fails again
 * within --elastic-timeout of its restart is left out and the job restarts
 * with one worker fewer (ranks renumbered, DTRAIN_SLOT kept) while at least M
 * remain; the restart after a later failure tries it again.
 * --pipeline P --tensor T: the workers' model-parallel layout, written into
 * every worker's DTRAIN_CONFIG as "layout": {"pipeline": P, "tensor": T}
 * (dt_layout_from_cluster splits the communicator accordingly); the rest of
 * the workers are data-parallel replicas, so N must be a multiple of P*T.
 *
 * --hosts NAME[=ADDR][:SLOTS],... [--rsh CMD] (several machines, as mpirun's
 * host list): the workers fill the hosts' slots in order (-n defaults to all
 * the slots), the servers go one per host in turn; each process runs as
 * `CMD NAME sh` (CMD: "ssh" unless --rsh; "ip netns exec" makes each NAME a
 * network namespace) and reads a small script on its standard input that
 * exports its DTRAIN_* variables (the token and the job id included: they
 * never appear on a command line), changes to the launcher's directory and
 * runs the program; closing that input (the launcher stopping it, or gone)
 * stops the program. ADDR (default NAME, less any "user@") is the address the
 * other processes dial, with ports --port P, P+1, ... [29500] in process
 * order (workers, then servers); the program binds its own port there
 * (no DTRAIN_LISTEN_FD). Output lines are prefixed "[NAME:worker I] ".
 *
 * Plain POSIX C; does not need dtrain.h. Build: cc -std=c11 -O2 tools/dtrain_launch.c -o tools/dtrain-launch
 */
#ifdef __linux__
#  define _GNU_SOURCE /* sched_setaffinity, cpu_set_t */
#endif
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#  include <sched.h>
#  include <sys/prctl.h>
#endif

#define MAX_PROCS 1024 /* per role, as DTRAIN_MAX_PEERS */
#define LINE_CAP 8192  /* longest line passed on whole; longer ones are split */

static double dmin(double a, double b) { return a < b ? a : b; }

typedef struct stream {
  int fd;      /* read end, -1 once closed */
  int dest;    /* 1 stdout, 2 stderr */
  size_t n;    /* bytes in buf */
  int midline; /* a split line: the next bytes continue it (no prefix) */
  char buf[LINE_CAP];
} stream;

typedef struct proc {
  int ps;            /* 0 worker, 1 parameter server */
  int index;
  int lfd, port;
  char addr[300];
  char name[32];     /* "worker 0" */
  char prefix[300];  /* "[worker 0] ", or with --hosts "[HOST:worker 0] " */
  int host;          /* --hosts: index into g_hosts, else -1 (this machine) */
  int in_w;          /* --hosts: the write end of its standard input (closed: stop), else -1 */
  pid_t pid;         /* 0 before start and after it was reaped */
  int running;
  int stopped_by_us; /* we sent it SIGTERM/SIGKILL */
  int core;          /* --bind-to core: index into the cores, else -1 */
  int status;        /* wait status once reaped */
  int restarts;      /* times this process was started again */
  int dropped;       /* --min-workers: left out of the job (it did not come back) */
  int slot;          /* its place among the workers (or servers): DTRAIN_SLOT; index is its rank */
  double started_at; /* when it was last started */
  stream out[2];
} proc;

static const char *g_self = "dtrain-launch";

/* --hosts: where the processes run, and --rsh: how they are started there. */
#define MAX_HOSTS 256
typedef struct rhost {
  char name[200]; /* given to the rsh command */
  char addr[200]; /* in the cluster: what the others dial */
  long slots;
} rhost;
static rhost g_hosts[MAX_HOSTS];
static int g_nhosts;
static char *g_rsh[32]; /* the rsh command's words, NULL-terminated */
static int g_sigpipe[2] = {-1, -1};

static void usage(FILE *f) {
  fprintf(f,
          "usage: dtrain-launch -n N [--ps M] [--port P] [--host H] [--grace S] [--timeout S] [--token-env]\n"
          "                     [--bind-to core|none] [--max-restarts K] [--min-workers M]\n"
          "                     [--max-workers N] [--elastic-timeout S] [--pipeline P] [--tensor T]\n"
          "                     [--hosts LIST [--rsh CMD]] -- PROGRAM [ARGS...]\n"
          "Starts N workers (and M parameter servers) of PROGRAM on this machine (or on --hosts).\n"
          "  -n N          worker processes (1..%d)\n"
          "  --ps M        parameter-server processes (0..%d) [0]\n"
          "  --port P      use ports P, P+1, ... (workers first, then servers) instead of free ones\n"
          "  --host H      address to bind and to put in the cluster [127.0.0.1]\n"
          "  --grace S     after a failure (or after all workers finished, for servers), wait S s\n"
          "                before terminating the rest: SIGTERM, then SIGKILL [10]\n"
          "  --timeout S   stop everything after S s of running and exit 124 [none]\n"
          "  --token-env   (the default; kept for old scripts) a fresh random DTRAIN_TOKEN (unless set)\n"
          "  --bind-to W   core: process k (workers, then servers) runs only on core k mod C of the\n"
          "                C cores this launcher may use (Linux); none: wherever the kernel puts it [none]\n"
          "  --max-restarts K  a failed worker does not end the job until K restarts were made: all\n"
          "                workers are started again (each gets DTRAIN_RESTART=R and resumes from its\n"
          "                checkpoint), or with --ps only the dead one (it rejoins the servers) [0]\n"
          "  --min-workers M  elastic size (synchronous jobs, with --max-restarts): a worker that fails\n"
          "                again within --elastic-timeout of its restart does not come back: the job\n"
          "                restarts without it, with one worker fewer, while at least M remain; at the\n"
          "                restart after a later failure it is tried again [-n: not elastic]\n"
          "  --max-workers N  the same as -n N (torchrun's --nnodes MIN:MAX)\n"
          "  --elastic-timeout S  see --min-workers [30]\n"
          "  --pipeline P, --tensor T  the workers' model-parallel layout, written into DTRAIN_CONFIG\n"
          "                (\"layout\"; dt_layout_from_cluster): P pipeline stages x T tensor-parallel ranks,\n"
          "                the rest data-parallel replicas; N must be a multiple of P x T [1, 1]\n"
          "  --hosts LIST  several machines: LIST is NAME[=ADDR][:SLOTS],... (SLOTS workers on each,\n"
          "                in order; -n defaults to their sum; servers one per host in turn); each\n"
          "                process is started by `RSH NAME sh`, its settings (the token too) sent on\n"
          "                its standard input, never on a command line; ADDR (default NAME) is what\n"
          "                the others dial, ports from --port [29500]; output \"[NAME:worker I] \"\n"
          "  --rsh CMD     how --hosts processes are started [ssh]; \"ip netns exec\" runs them in\n"
          "                the network namespaces named by the hosts (a rehearsal on one machine)\n"
          "  -h, --help    this text\n"
          "Each process gets DTRAIN_CONFIG (the cluster and its task), DTRAIN_LISTEN_FD (its bound\n"
          "listening socket), DTRAIN_RANK, DTRAIN_WORLD, DTRAIN_ROLE, DTRAIN_SLOT (its place in\n"
          "the -n workers, which stays when --min-workers leaves one out and the ranks move up;\n"
          "\"worker I\" in the output is the slot), DTRAIN_TOKEN and\n"
          "DTRAIN_JOB_ID (fresh random ones unless set: peers authenticate); its output lines are\n"
          "prefixed with \"[worker I] \" or \"[ps I] \"; stdin is /dev/null. Exit status: 0 when all\n"
          "succeed, else the first failure's exit code (128+N for signal N), 124 on --timeout,\n"
          "2 for a usage error, 1 when the processes could not be started. With --ps, a worker that\n"
          "fails is logged and the others go on (the servers drop it): exit 0 when at least one\n"
          "worker finished and no server failed, else the first failure's code.\n",
          MAX_PROCS, MAX_PROCS);
}

static void say(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  int n = snprintf(buf, sizeof buf, "%s: ", g_self);
  va_start(ap, fmt);
  vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
  va_end(ap);
  size_t len = strlen(buf);
  buf[len++] = '\n';
  ssize_t w;
  size_t off = 0;
  while (off < len && ((w = write(2, buf + off, len - off)) > 0 || (w < 0 && errno == EINTR)))
    if (w > 0) off += (size_t)w;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whole write; output that cannot be written (a closed pipe) is dropped. */
static void put(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= (size_t)w;
  }
}

static void cloexec(int fd) { fcntl(fd, F_SETFD, FD_CLOEXEC); }
static void nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  if (write(g_sigpipe[1], &b, 1) < 0) { /* full: a wake-up is pending anyway */
  }
  errno = saved;
}

/* ---- options ------------------------------------------------------------------------------ */

static int parse_long(const char *s, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

static int parse_secs(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= 0) || v > 1e9) return 0;
  *out = v;
  return 1;
}

#define NOPTS 15
static const char *const k_opts[NOPTS] = {"-n",        "--ps",      "--port",   "--host",
                                          "--grace",   "--timeout", "--bind-to", "--max-restarts",
                                          "--min-workers", "--max-workers", "--elastic-timeout",
                                          "--pipeline", "--tensor", "--hosts", "--rsh"};
static const char *const k_what[NOPTS] = {"a number of workers in 1..1024", "a number of servers in 0..1024",
                                          "a port in 1..65535", "a host name or address", "seconds (>= 0)",
                                          "seconds (> 0)", "core or none", "a number of restarts in 0..10000",
                                          "a number of workers in 1..1024", "a number of workers in 1..1024",
                                          "seconds (> 0)", "a number of stages in 1..1024",
                                          "a number of tensor-parallel ranks in 1..1024",
                                          "NAME[=ADDR][:SLOTS],... (names and addresses of letters, digits and .-_@[]:%)",
                                          "a command (words split at spaces)"};

/* The model-parallel layout (--pipeline, --tensor), written into every worker's DTRAIN_CONFIG. */
static long g_pipeline = 1, g_tensor = 1;

/* "--name value" or "--name=value" at argv[*k]: 1 when it is this option
 * (*value: the value, NULL when missing; *k advanced past it), else 0. */
static int opt_value(int argc, char **argv, int *k, const char *name, const char **value) {
  size_t n = strlen(name);
  const char *a = argv[*k];
  *value = NULL;
  if (strncmp(a, name, n) != 0 || (a[n] != '=' && a[n] != '\0')) return 0;
  if (a[n] == '=')
    *value = a + n + 1;
  else if (*k + 1 < argc)
    *value = argv[++*k];
  return 1;
}

/* ---- --hosts and --rsh ----------------------------------------------------------------------- */

static int host_char_ok(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c && strchr(".-_@[]:%", c));
}

/* "NAME[=ADDR][:SLOTS],..." into g_hosts; 0 on a malformed list (said why). */
static int parse_hosts(const char *list) {
  const char *p = list;
  g_nhosts = 0;
  while (*p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char item[420];
    if (len == 0 || len >= sizeof item) {
      say("--hosts '%s': an empty or overlong entry", list);
      return 0;
    }
    if (g_nhosts == MAX_HOSTS) {
      say("--hosts: more than %d hosts", MAX_HOSTS);
      return 0;
    }
    memcpy(item, p, len);
    item[len] = '\0';
    rhost *h = &g_hosts[g_nhosts];
    h->slots = 1;
    char *colon = strrchr(item, ':'), *rb = strrchr(item, ']');
    if (colon && (!rb || colon > rb)) { /* SLOTS: after the last ':' outside [...] */
      if (!parse_long(colon + 1, 1, MAX_PROCS, &h->slots)) {
        say("--hosts '%s': slots '%s' is not a number in 1..%d", item, colon + 1, MAX_PROCS);
        return 0;
      }
      *colon = '\0';
    }
    char *eq = strchr(item, '=');
    const char *addr;
    if (eq) {
      *eq = '\0';
      addr = eq + 1;
    } else {
      const char *at = strrchr(item, '@');
      addr = at ? at + 1 : item;
    }
    for (const char *c = item; *c; c++)
      if (!host_char_ok(*c) || *c == ':' || *c == '[' || *c == ']') addr = NULL;
    for (const char *c = addr ? addr : ""; *c; c++)
      if (!host_char_ok(*c) || *c == '@') addr = NULL;
    if (!addr || !*item || !*addr || item[0] == '-' || strlen(item) >= sizeof h->name ||
        strlen(addr) >= sizeof h->addr) {
      say("--hosts: '%.*s' is not NAME[=ADDR][:SLOTS] (a name of letters, digits and .-_@ not starting with '-', "
          "an address or [IPv6 address])", (int)len, p);
      return 0;
    }
    if (strchr(addr, ':') && addr[0] != '[') {
      say("--hosts: '%.*s': put an IPv6 address in brackets ([%s])", (int)len, p, addr);
      return 0;
    }
    snprintf(h->name, sizeof h->name, "%s", item);
    snprintf(h->addr, sizeof h->addr, "%s", addr);
    g_nhosts++;
    p += len;
    if (*p == ',') p++;
  }
  if (g_nhosts == 0) say("--hosts: no host given");
  return g_nhosts > 0;
}

/* --rsh "CMD ARGS": its words (split at spaces) into g_rsh; 0 when empty or too many. */
static int parse_rsh(const char *cmd) {
  static char buf[1024];
  int nw = 0;
  if (strlen(cmd) >= sizeof buf) return 0;
  snprintf(buf, sizeof buf, "%s", cmd);
  for (char *w = strtok(buf, " \t"); w; w = strtok(NULL, " \t")) {
    if (nw == (int)(sizeof g_rsh / sizeof g_rsh[0]) - 3) return 0; /* room for NAME, sh, NULL */
    g_rsh[nw++] = w;
  }
  g_rsh[nw] = NULL;
  return nw > 0;
}

/* A growing string (the remote script); on allocation failure ok becomes 0. */
typedef struct sbuf {
  char *b;
  size_t n, cap;
  int ok;
} sbuf;

static void sb_put(sbuf *s, const char *t, size_t n) {
  if (!s->ok) return;
  if (s->n + n + 1 > s->cap) {
    size_t cap = (s->cap ? 2 * s->cap : 1024) + n;
    char *b = (char *)realloc(s->b, cap);
    if (!b) {
      s->ok = 0;
      return;
    }
    s->b = b;
    s->cap = cap;
  }
  memcpy(s->b + s->n, t, n);
  s->n += n;
  s->b[s->n] = '\0';
}

static void sb_str(sbuf *s, const char *t) { sb_put(s, t, strlen(t)); }

/* t in single quotes for sh ('\'' for a quote inside). */
static void sb_quoted(sbuf *s, const char *t) {
  sb_put(s, "'", 1);
  for (const char *q; (q = strchr(t, '\'')) != NULL; t = q + 1) {
    sb_put(s, t, (size_t)(q - t));
    sb_str(s, "'\\''");
  }
  sb_str(s, t);
  sb_put(s, "'", 1);
}

static void sb_export(sbuf *s, const char *name, const char *value) {
  sb_str(s, "export ");
  sb_str(s, name);
  sb_put(s, "=", 1);
  sb_quoted(s, value);
  sb_put(s, "\n", 1);
}

extern char **environ;

/* What a --hosts process's `sh` reads on its standard input: its settings
 * (every DTRAIN_* of the launcher's environment, then its own), the
 * launcher's directory, the program run in the background, and a watcher
 * that stops it (SIGTERM) when that input closes: the launcher stopping it,
 * or gone. sh's exit status is the program's (128+N for signal N). One
 * brace group, so that sh has parsed all of it before the watcher reads on. */
static char *remote_script(const proc *p, const char *config, int world, const char *token, char **prog) {
  sbuf s = {NULL, 0, 0, 1};
  char num[32], cwd[4096];
  sb_str(&s, "{\n");
  for (char **e = environ; e && *e; e++) { /* -x DTRAIN_* as mpirun's -x */
    const char *eq = strchr(*e, '=');
    if (!eq || strncmp(*e, "DTRAIN_", 7) != 0 || strncmp(*e, "DTRAIN_LISTEN_FD=", 17) == 0) continue;
    char name[128];
    size_t len = (size_t)(eq - *e);
    int ok = len < sizeof name;
    for (size_t i = 0; ok && i < len; i++) ok = host_char_ok((*e)[i]) && (*e)[i] != '.' && (*e)[i] != '-';
    if (!ok) continue;
    memcpy(name, *e, len);
    name[len] = '\0';
    sb_export(&s, name, eq + 1);
  }
  sb_export(&s, "DTRAIN_CONFIG", config);
  if (token) sb_export(&s, "DTRAIN_TOKEN", token);
  snprintf(num, sizeof num, "%d", p->restarts);
  sb_export(&s, "DTRAIN_RESTART", num);
  snprintf(num, sizeof num, "%d", p->index);
  sb_export(&s, "DTRAIN_RANK", num);
  snprintf(num, sizeof num, "%d", p->slot);
  sb_export(&s, "DTRAIN_SLOT", num);
  snprintf(num, sizeof num, "%d", world);
  sb_export(&s, "DTRAIN_WORLD", num);
  sb_export(&s, "DTRAIN_ROLE", p->ps ? "ps" : "worker");
  if (getcwd(cwd, sizeof cwd)) {
    sb_str(&s, "cd ");
    sb_quoted(&s, cwd);
    sb_str(&s, " || exit 127\n");
  }
  sb_str(&s, "exec 3<&0\n");
  for (char **a = prog; *a; a++) {
    sb_quoted(&s, *a);
    sb_put(&s, " ", 1);
  }
  sb_str(&s, "</dev/null &\n"
             "p=$!\n"
             "trap 'kill -TERM $p 2>/dev/null' TERM INT HUP\n"
             "{ read -r line <&3; kill -TERM $p 2>/dev/null; } &\n"
             "w=$!\n"
             "while :; do wait $p; rc=$?; kill -0 $p 2>/dev/null || break; done\n"
             "kill $w 2>/dev/null\n"
             /* a program killed by a signal: sh dies by it too, so the launcher sees the signal */
             "if [ $rc -gt 128 ] && [ $rc -lt 160 ]; then trap - TERM INT HUP; kill -$((rc - 128)) $$; fi\n"
             "exit $rc\n"
             "}\n");
  if (!s.ok) {
    free(s.b);
    return NULL;
  }
  return s.b;
}

/* ---- sockets ------------------------------------------------------------------------------- */

static int listen_on(const char *host, int port, int *bound) {
  char ps[16];
  struct addrinfo hints, *res = NULL, *ai;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  snprintf(ps, sizeof ps, "%d", port);
  int e = getaddrinfo(host, ps, &hints, &res);
  if (e != 0) {
    say("cannot resolve '%s': %s", host, gai_strerror(e));
    return -1;
  }
  int fd = -1, err = 0;
  for (ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0) break;
    err = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    say("cannot listen on %s port %d: %s", host, port, strerror(err));
    return -1;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
    say("getsockname: %s", strerror(errno));
    close(fd);
    return -1;
  }
  *bound = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                    : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  cloexec(fd);
  return fd;
}

/* ---- output ---------------------------------------------------------------------------------- */

static char g_line[LINE_CAP + 64];

static void emit(const proc *p, stream *s, const char *data, size_t n, int end_line) {
  size_t k = 0;
  if (!s->midline) {
    size_t pl = strlen(p->prefix);
    memcpy(g_line, p->prefix, pl);
    k = pl;
  }
  memcpy(g_line + k, data, n);
  k += n;
  if (end_line && (n == 0 || data[n - 1] != '\n')) g_line[k++] = '\n';
  put(s->dest, g_line, k);
}

/* Pass on the complete lines in s->buf; keep the rest. flush: also the rest. */
static void lines(const proc *p, stream *s, int flush) {
  size_t start = 0;
  for (size_t i = 0; i < s->n; i++) {
    if (s->buf[i] != '\n') continue;
    emit(p, s, s->buf + start, i + 1 - start, 0);
    s->midline = 0;
    start = i + 1;
  }
  if (start < s->n && (flush || (start == 0 && s->n == sizeof s->buf))) {
    /* at exit, or one line fills the whole buffer: pass it on as it is */
    emit(p, s, s->buf + start, s->n - start, flush);
    s->midline = !flush;
    start = s->n;
  }
  memmove(s->buf, s->buf + start, s->n - start);
  s->n -= start;
}

/* Read what is there; at end of file (or error) flush and close. */
static void drain(const proc *p, stream *s) {
  while (s->fd >= 0) {
    if (s->n == sizeof s->buf) lines(p, s, 0);
    ssize_t r = read(s->fd, s->buf + s->n, sizeof s->buf - s->n);
    if (r > 0) {
      s->n += (size_t)r;
      lines(p, s, 0);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    lines(p, s, 1);
    close(s->fd);
    s->fd = -1;
  }
}

/* ---- binding (--bind-to core) ------------------------------------------------------------------ */

#ifdef __linux__
typedef struct core_cpus {
  int pkg, id;    /* topology: physical_package_id, core_id (-1: unknown, the CPU is its own core) */
  cpu_set_t cpus; /* its hardware threads that this launcher may use */
} core_cpus;

static int topology_id(int cpu, const char *what) {
  char path[128], buf[32];
  snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, what);
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  ssize_t k = read(fd, buf, sizeof buf - 1);
  close(fd);
  long v;
  if (k <= 0) return -1;
  buf[k] = '\0';
  if (buf[k - 1] == '\n') buf[k - 1] = '\0';
  return parse_long(buf, 0, 1L << 20, &v) ? (int)v : -1;
}

/* The cores this process may run on, in CPU order; their count, or -1 (errno). */
static int allowed_cores(core_cpus *out, int cap) {
  cpu_set_t mine;
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return -1;
  int n = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
    if (!CPU_ISSET(cpu, &mine)) continue;
    int pkg = topology_id(cpu, "physical_package_id"), id = topology_id(cpu, "core_id"), k = 0;
    if (pkg < 0 || id < 0) pkg = id = -1;
    while (k < n && !(pkg >= 0 && out[k].pkg == pkg && out[k].id == id)) k++;
    if (k == n) {
      if (n == cap) break;
      out[n].pkg = pkg;
      out[n].id = id;
      CPU_ZERO(&out[n].cpus);
      n++;
    }
    CPU_SET(cpu, &out[k].cpus);
  }
  return n;
}

static core_cpus g_cores[CPU_SETSIZE];
#endif

/* ---- processes ------------------------------------------------------------------------------------ */

static void signal_all(proc *ps, int np, int sig, int by_us) {
  for (int k = 0; k < np; k++) {
    if (!ps[k].running) continue;
    /* the process group first (the program's own children too), then the process */
    if (kill(-ps[k].pid, sig) != 0) kill(ps[k].pid, sig);
    /* a stopped process (SIGSTOP, ^Z) only acts on SIGTERM once continued */
    if (sig == SIGTERM && kill(-ps[k].pid, SIGCONT) != 0) kill(ps[k].pid, SIGCONT);
    if (by_us) ps[k].stopped_by_us = 1;
    if (ps[k].in_w >= 0 && (sig == SIGTERM || sig == SIGKILL || by_us)) { /* --hosts: its input closes: it stops */
      close(ps[k].in_w);
      ps[k].in_w = -1;
    }
  }
}

static void child_exec(proc *p, int out_w, int err_w, int in_r, char **prog, const char *config, int workers,
                       const char *token, pid_t parent, int restart) {
  char num[32];
  (void)parent;
  setpgid(0, 0);
#ifdef __linux__
  /* die with the launcher, even when it is killed with SIGKILL */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
#endif
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD};
  for (size_t k = 0; k < sizeof sigs / sizeof sigs[0]; k++) sigaction(sigs[k], &sa, NULL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  int nul = in_r >= 0 ? in_r : open("/dev/null", O_RDONLY); /* --hosts: the script's pipe */
  if (nul >= 0 && nul != 0) {
    dup2(nul, 0);
    close(nul);
  }
  dup2(out_w, 1);
  dup2(err_w, 2);
  if (out_w > 2) close(out_w);
  if (err_w > 2) close(err_w);
#ifdef __linux__
  if (p->core >= 0 && sched_setaffinity(0, sizeof g_cores[p->core].cpus, &g_cores[p->core].cpus) != 0) {
    fprintf(stderr, "%s: cannot bind %s to a core: sched_setaffinity: %s\n", g_self, p->name, strerror(errno));
    _exit(127);
  }
#endif
  setenv("DTRAIN_CONFIG", config, 1);
  if (p->lfd >= 0) {
    fcntl(p->lfd, F_SETFD, 0); /* this one survives exec */
    snprintf(num, sizeof num, "%d", p->lfd);
    setenv("DTRAIN_LISTEN_FD", num, 1);
  } else {
    unsetenv("DTRAIN_LISTEN_FD"); /* a restarted parameter-server worker (it only dials) */
  }
  snprintf(num, sizeof num, "%d", restart);
  setenv("DTRAIN_RESTART", num, 1);
  snprintf(num, sizeof num, "%d", p->index);
  setenv("DTRAIN_RANK", num, 1);
  snprintf(num, sizeof num, "%d", p->slot);
  setenv("DTRAIN_SLOT", num, 1);
  snprintf(num, sizeof num, "%d", workers);
  setenv("DTRAIN_WORLD", num, 1);
  setenv("DTRAIN_ROLE", p->ps ? "ps" : "worker", 1);
  if (token) setenv("DTRAIN_TOKEN", token, 1);
  if (p->host >= 0) { /* --hosts: RSH NAME sh, which reads the script on its input */
    char *argv[sizeof g_rsh / sizeof g_rsh[0]];
    int a = 0;
    unsetenv("DTRAIN_TOKEN"); /* sent on the pipe only (an rsh that keeps the environment must not leak it) */
    while (g_rsh[a]) {
      argv[a] = g_rsh[a];
      a++;
    }
    argv[a++] = g_hosts[p->host].name;
    argv[a++] = (char *)"sh";
    argv[a] = NULL;
    execvp(argv[0], argv);
    fprintf(stderr, "%s: cannot run '%s': %s\n", g_self, argv[0], strerror(errno));
    _exit(127);
  }
  execvp(prog[0], prog);
  fprintf(stderr, "%s: cannot run '%s': %s\n", g_self, prog[0], strerror(errno));
  _exit(127);
}

/* The cluster JSON with this process's task: the workers not dropped (in
 * slot order: their ranks), then the servers. */
static char *config_json(const proc *ps, int np, int workers, const proc *self) {
  size_t cap = 192;
  for (int k = 0; k < np; k++) cap += strlen(ps[k].addr) + 4;
  char *j = (char *)malloc(cap);
  if (!j) return NULL;
  size_t n = (size_t)snprintf(j, cap, "{\"cluster\":{\"worker\":[");
  for (int k = 0, any = 0; k < workers; k++)
    if (!ps[k].dropped) n += (size_t)snprintf(j + n, cap - n, "%s\"%s\"", any++ ? "," : "", ps[k].addr);
  n += (size_t)snprintf(j + n, cap - n, "],\"ps\":[");
  for (int k = workers; k < np; k++) n += (size_t)snprintf(j + n, cap - n, "%s\"%s\"", k > workers ? "," : "", ps[k].addr);
  n += (size_t)snprintf(j + n, cap - n, "]},\"task\":{\"type\":\"%s\",\"index\":%d}", self->ps ? "ps" : "worker",
                        self->index);
  if (g_pipeline > 1 || g_tensor > 1)
    n += (size_t)snprintf(j + n, cap - n, ",\"layout\":{\"pipeline\":%ld,\"tensor\":%ld}", g_pipeline, g_tensor);
  snprintf(j + n, cap - n, "}");
  return j;
}

/* Workers not dropped (--min-workers); each gets its rank among them (p->index). */
static int renumber_workers(proc *ps, int workers) {
  int r = 0;
  for (int k = 0; k < workers; k++)
    if (!ps[k].dropped) ps[k].index = r++;
  return r;
}

/* n random bytes from /dev/urandom; 0 when it cannot be read. */
static int random_bytes(unsigned char *r, size_t n) {
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0) return 0;
  size_t got = 0;
  while (got < n) {
    ssize_t k = read(fd, r + got, n - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got += (size_t)k;
  }
  close(fd);
  return got == n;
}

/* The job's secret: 32 random bytes as 64 hex digits. */
static int make_token(char *hex, size_t cap) {
  unsigned char r[32];
  if (!random_bytes(r, sizeof r) || cap < 2 * sizeof r + 1) return 0;
  for (size_t k = 0; k < sizeof r; k++) snprintf(hex + 2 * k, 3, "%02x", r[k]);
  return 1;
}

/* The job id (DTRAIN_JOB_ID): 64 random bits, never 0 (0 means "derive one"). */
static int make_job_id(char *out, size_t cap) {
  unsigned char r[8];
  unsigned long long v = 0;
  if (!random_bytes(r, sizeof r)) return 0;
  for (size_t k = 0; k < sizeof r; k++) v = (v << 8) | r[k];
  if (v == 0) v = 1;
  snprintf(out, cap, "0x%016llx", v);
  return 1;
}

static int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

/* Fork and exec process p (its listening socket p->lfd, if any, goes to the
 * child and is closed here; its output pipes are read from now on). 0 when
 * it could not be started (said why). */
static int start_proc(proc *p, proc *ps, int np, int workers, char **prog, const char *tok) {
  int po[2], pe[2];
  if (pipe(po) != 0) {
    say("cannot start %s: pipe: %s", p->name, strerror(errno));
    return 0;
  }
  if (pipe(pe) != 0) {
    say("cannot start %s: pipe: %s", p->name, strerror(errno));
    close(po[0]);
    close(po[1]);
    return 0;
  }
  cloexec(po[0]);
  cloexec(pe[0]);
  cloexec(po[1]);
  cloexec(pe[1]);
  char *config = config_json(ps, np, workers, p);
  int world = 0;
  for (int k = 0; k < workers; k++) world += !ps[k].dropped;
  /* --hosts: the script for the remote sh, on a pipe that stays open while it runs */
  const char *token = tok ? tok : getenv("DTRAIN_TOKEN");
  char *script = config && p->host >= 0 ? remote_script(p, config, world, token && *token ? token : NULL, prog) : NULL;
  int pin[2] = {-1, -1};
  if (!config || (p->host >= 0 && !script)) {
    say("out of memory");
    free(config);
    close(po[0]), close(po[1]), close(pe[0]), close(pe[1]);
    return 0;
  }
  if (script && pipe(pin) != 0) {
    say("cannot start %s: pipe: %s", p->name, strerror(errno));
    free(config);
    free(script);
    close(po[0]), close(po[1]), close(pe[0]), close(pe[1]);
    return 0;
  }
  if (script) {
    cloexec(pin[0]);
    cloexec(pin[1]); /* no other child may hold it: its closing is the stop */
  }
  /* Signals are blocked across the fork: until the child has set its
   * handlers back to the defaults, a signal for it (a SIGTERM of a restart
   * that comes at once) would run the launcher's handler in the child and
   * land in the launcher's own signal pipe, read as a signal to the launcher.
   * child_exec unblocks them once the defaults are in place. */
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  pid_t self = getpid(), pid = fork();
  if (pid == 0) child_exec(p, po[1], pe[1], pin[0], prog, config, world, tok, self, p->restarts);
  sigprocmask(SIG_SETMASK, &old, NULL);
  free(config);
  close(po[1]);
  close(pe[1]);
  if (pin[0] >= 0) close(pin[0]);
  if (pid < 0) {
    say("cannot start %s: fork: %s", p->name, strerror(errno));
    close(po[0]);
    close(pe[0]);
    if (pin[1] >= 0) close(pin[1]);
    free(script);
    return 0;
  }
  if (script) { /* a few KiB: the pipe takes it whole; a failure shows as the process's exit */
    size_t len = strlen(script), off = 0;
    while (off < len) {
      ssize_t w = write(pin[1], script + off, len - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += (size_t)w;
    }
    free(script);
    if (p->in_w >= 0) close(p->in_w);
    p->in_w = pin[1];
  }
  setpgid(pid, pid); /* also in the child: whichever runs first */
  p->pid = pid;
  p->running = 1;
  p->stopped_by_us = 0;
  p->started_at = now_s();
  if (p->lfd >= 0) close(p->lfd);
  p->lfd = -1;
  for (int s = 0; s < 2; s++)
    if (p->out[s].fd >= 0) { /* the last run's pipe: what is left of it first */
      lines(p, &p->out[s], 1);
      close(p->out[s].fd);
    }
  p->out[0].fd = po[0];
  p->out[0].dest = 1;
  p->out[1].fd = pe[0];
  p->out[1].dest = 2;
  p->out[0].n = p->out[1].n = 0;
  p->out[0].midline = p->out[1].midline = 0;
  nonblock(po[0]);
  nonblock(pe[0]);
  return 1;
}

int main(int argc, char **argv) {
  long n = 0, m = 0, port = 0, max_restarts = 0, min_workers = 0;
  double grace = 10.0, timeout = 0.0, elastic_timeout = 30.0;
  const char *host = "127.0.0.1", *hosts = NULL, *rsh = NULL;
  int token_env = 0, k, prog_at = -1, bind = 0, host_given = 0;

  for (k = 1; k < argc; k++) {
    const char *a = argv[k], *v = NULL;
    if (strcmp(a, "--") == 0) {
      prog_at = k + 1;
      break;
    }
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    }
    if (strcmp(a, "--token-env") == 0) {
      token_env = 1;
      continue;
    }
    if (a[0] != '-') {
      prog_at = k;
      break;
    }
    int o = 0;
    while (o < NOPTS && !opt_value(argc, argv, &k, k_opts[o], &v)) o++;
    if (o == NOPTS && strncmp(a, "-n", 2) == 0 && a[2] >= '0' && a[2] <= '9') { /* -n4 */
      o = 0;
      v = a + 2;
    }
    if (o == NOPTS) {
      say("unknown option '%s' (see -h)", a);
      return 2;
    }
    if (!v) {
      say("%s needs a value (see -h)", k_opts[o]);
      return 2;
    }
    int ok = 1;
    switch (o) {
      case 0: ok = parse_long(v, 1, MAX_PROCS, &n); break;
      case 1: ok = parse_long(v, 0, MAX_PROCS, &m); break;
      case 2: ok = parse_long(v, 1, 65535, &port); break;
      case 3: ok = *v != '\0'; host = v; host_given = 1; break;
      case 13: hosts = v; if (!parse_hosts(v)) return 2; break;
      case 14: rsh = v; ok = parse_rsh(v); break;
      case 4: ok = parse_secs(v, &grace); break;
      case 5: ok = parse_secs(v, &timeout) && timeout > 0; break;
      case 7: ok = parse_long(v, 0, 10000, &max_restarts); break;
      case 8: ok = parse_long(v, 1, MAX_PROCS, &min_workers); break;
      case 9: ok = parse_long(v, 1, MAX_PROCS, &n); break;
      case 10: ok = parse_secs(v, &elastic_timeout) && elastic_timeout > 0; break;
      case 11: ok = parse_long(v, 1, MAX_PROCS, &g_pipeline); break;
      case 12: ok = parse_long(v, 1, MAX_PROCS, &g_tensor); break;
      default:
        ok = strcmp(v, "core") == 0 || strcmp(v, "none") == 0;
        bind = strcmp(v, "core") == 0;
        break;
    }
    if (!ok) {
      say("%s '%s': expected %s (see -h)", k_opts[o], v, k_what[o]);
      return 2;
    }
  }
  long slots = 0;
  for (int h = 0; h < g_nhosts; h++) slots += g_hosts[h].slots;
  if (hosts) {
    if (n == 0) n = slots > MAX_PROCS ? MAX_PROCS : slots;
    if (n > slots) {
      say("-n %ld: more workers than the %ld slots of --hosts", n, slots);
      return 2;
    }
    if (host_given || bind) {
      say("%s is for one machine: with --hosts each process binds its host's address", host_given ? "--host" : "--bind-to");
      return 2;
    }
    if (port == 0) port = 29500;
    if (!rsh) parse_rsh("ssh");
  } else if (rsh) {
    say("--rsh starts the processes of --hosts; without --hosts they run here");
    return 2;
  }
  if (n == 0) {
    say("-n N (the number of workers) is required (see -h)");
    return 2;
  }
  if (prog_at < 0 || prog_at >= argc) {
    say("no program given: dtrain-launch -n N [options] -- PROGRAM [ARGS...]");
    return 2;
  }
  if (min_workers > n) {
    say("--min-workers %ld is more than the %ld workers (-n / --max-workers)", min_workers, n);
    return 2;
  }
  if (min_workers == 0) min_workers = n; /* not elastic */
  if (g_pipeline > 1 || g_tensor > 1) {
    if (n % (g_pipeline * g_tensor) != 0) {
      say("--pipeline %ld --tensor %ld: %ld workers do not make replicas of %ld (the rest of the layout is data "
          "parallel: -n must be a multiple of pipeline x tensor)", g_pipeline, g_tensor, n, g_pipeline * g_tensor);
      return 2;
    }
    if (m > 0) {
      say("--pipeline/--tensor lay out synchronous workers; a parameter-server job (--ps) has none");
      return 2;
    }
    if (min_workers < n) {
      say("--pipeline/--tensor with --min-workers: a job that loses a worker loses part of the model");
      return 2;
    }
  }
  if (min_workers < n && m > 0) {
    say("--min-workers is for synchronous jobs: with --ps a lost worker does not stop the others anyway");
    return 2;
  }
  if (min_workers < n && max_restarts == 0) {
    say("--min-workers needs --max-restarts K (the job goes on with fewer workers through a restart)");
    return 2;
  }
  if (port > 0 && port + n + m - 1 > 65535) {
    say("--port %ld: ports up to %ld do not exist", port, port + n + m - 1);
    return 2;
  }
  for (const char *h = host; *h; h++)
    if (!((*h >= '0' && *h <= '9') || (*h >= 'a' && *h <= 'z') || (*h >= 'A' && *h <= 'Z') || *h == '.' ||
          *h == '-' || *h == '_' || *h == ':' || *h == '%')) {
      say("--host '%s': not a host name or address", host);
      return 2;
    }

  /* fds 0..2 must exist so that no socket or pipe lands on them */
  for (int fd = 0; fd < 3; fd++)
    if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0) return 1;

  int np = (int)(n + m), workers = (int)n, rc = 1;
  proc *ps = (proc *)calloc((size_t)np, sizeof(proc));
  char token[80];
  const char *tok = NULL;
  if (!ps) {
    say("out of memory");
    return 1;
  }
  for (k = 0; k < np; k++) {
    ps[k].lfd = ps[k].out[0].fd = ps[k].out[1].fd = ps[k].in_w = -1;
    ps[k].core = -1;
    ps[k].host = -1;
  }
  if (bind) {
#ifdef __linux__
    int nc = allowed_cores(g_cores, CPU_SETSIZE);
    if (nc <= 0) {
      say("--bind-to core: cannot read this process's CPUs: %s", nc < 0 ? strerror(errno) : "none allowed");
      goto done;
    }
    for (k = 0; k < np; k++) ps[k].core = k % nc;
    if (np > nc) say("--bind-to core: %d processes on %d core%s: some share a core", np, nc, nc > 1 ? "s" : "");
#else
    say("--bind-to core: not supported on this system (Linux only)");
    goto done;
#endif
  }
  /* Every job authenticates: a fresh secret and job id unless the caller
   * gave them (then they are inherited as they are). Without them a stranger
   * who connected first could join as a worker. Neither is ever printed. */
  (void)token_env; /* --token-env: what every run does now */
  {
    const char *e = getenv("DTRAIN_TOKEN");
    char job[32];
    if (e && *e) {
      tok = NULL; /* inherited as it is */
    } else if (make_token(token, sizeof token)) {
      tok = token;
    } else {
      say("cannot read /dev/urandom for the job's token (set DTRAIN_TOKEN)");
      goto done;
    }
    e = getenv("DTRAIN_JOB_ID");
    if (!(e && *e)) {
      if (!make_job_id(job, sizeof job)) {
        say("cannot read /dev/urandom for the job id (set DTRAIN_JOB_ID)");
        goto done;
      }
      setenv("DTRAIN_JOB_ID", job, 1); /* inherited by every child */
    }
  }

  /* Bind everything first: the whole cluster's addresses go into every config. */
  for (k = 0; k < np; k++) {
    proc *p = &ps[k];
    p->ps = k >= workers;
    p->index = p->ps ? k - workers : k;
    p->slot = p->index;
    snprintf(p->name, sizeof p->name, "%s %d", p->ps ? "ps" : "worker", p->index);
    snprintf(p->prefix, sizeof p->prefix, "[%s] ", p->name);
    if (g_nhosts > 0) { /* --hosts: workers fill the slots in order, servers one per host in turn */
      int h = 0;
      if (!p->ps)
        for (long before = g_hosts[0].slots; before <= k; before += g_hosts[++h].slots) {}
      else
        h = p->index % g_nhosts;
      const rhost *hh = &g_hosts[h];
      p->host = h;
      p->port = (int)port + k;
      snprintf(p->prefix, sizeof p->prefix, "[%.200s:%s] ", hh->name, p->name);
      if (strchr(hh->addr, ':') && hh->addr[0] != '[')
        snprintf(p->addr, sizeof p->addr, "[%.200s]:%d", hh->addr, p->port);
      else
        snprintf(p->addr, sizeof p->addr, "%.200s:%d", hh->addr, p->port);
      continue;
    }
    p->lfd = listen_on(host, port > 0 ? (int)port + k : 0, &p->port);
    if (p->lfd < 0) goto done;
    if (strchr(host, ':'))
      snprintf(p->addr, sizeof p->addr, "[%.200s]:%d", host, p->port);
    else
      snprintf(p->addr, sizeof p->addr, "%.200s:%d", host, p->port);
  }

  if (pipe(g_sigpipe) != 0) {
    say("pipe: %s", strerror(errno));
    goto done;
  }
  cloexec(g_sigpipe[0]);
  cloexec(g_sigpipe[1]);
  nonblock(g_sigpipe[0]);
  nonblock(g_sigpipe[1]);
  {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sa.sa_flags = 0;
    sigaction(SIGPIPE, &sa, NULL);
  }

  /* Servers wait this long for a lost worker's return when none is live
   * (dt_ps_serve reads it): the launcher starts it again at once, and its
   * data may take a while to load. */
  if (m > 0 && max_restarts > 0 && !getenv("DTRAIN_REJOIN_TIMEOUT")) setenv("DTRAIN_REJOIN_TIMEOUT", "60", 1);
  /* Start: servers first, then workers. */
  for (int t = 0; t < np; t++)
    if (!start_proc(&ps[t < (int)m ? workers + t : t - (int)m], ps, np, workers, argv + prog_at, tok)) goto stop_started;

  {
    const double kill_delay = grace < 1 ? 1 : grace > 5 ? 5 : grace;
    double t0 = now_s(), term_at = -1, kill_at = -1, drain_until = -1;
    int failure = -1, forwarded = 0, running = np, workers_left = workers;
    int forwarded_sig = 0; /* the signal passed on: the job's exit is 128 + it when nothing failed first */
    /* parameter-server jobs: workers that finished, the first lost worker's code, servers running */
    int ps_job = m > 0, workers_done = 0, lost_code = -1, servers_left = (int)m;
    int servers_gone = 0; /* term_at was set because every server had ended */
    int restarts_used = 0, restarting = 0; /* --max-restarts; a synchronous restart waits for every worker to stop */
    int dropped_now = 0; /* --min-workers: this restart leaves a worker out (else the left-out come back) */
    struct pollfd *pf = (struct pollfd *)calloc((size_t)(2 * np + 1), sizeof(struct pollfd));
    stream **owner = (stream **)calloc((size_t)(2 * np + 1), sizeof(stream *));
    proc **owner_p = (proc **)calloc((size_t)(2 * np + 1), sizeof(proc *));
    if (!pf || !owner || !owner_p) {
      free(pf), free(owner), free(owner_p);
      say("out of memory");
      signal_all(ps, np, SIGKILL, 1);
      while (wait(NULL) > 0 || errno == EINTR) {
      }
      goto done;
    }
    for (;;) {
      double t = now_s();
      /* timers */
      if (timeout > 0 && t - t0 >= timeout && running > 0 && kill_at < 0) {
        say("timed out after %g s; stopping every process", timeout);
        if (failure < 0) failure = 124;
        signal_all(ps, np, SIGTERM, 1);
        kill_at = t + kill_delay;
        term_at = -1;
      }
      if (term_at >= 0 && t >= term_at) {
        for (k = 0; k < np; k++)
          if (ps[k].running)
            say("%s still running %g s later%s; sending SIGTERM", ps[k].name, grace,
                servers_gone ? " than every server (it cannot train on)" : "");
        signal_all(ps, np, SIGTERM, 1);
        term_at = -1;
        kill_at = t + kill_delay;
      }
      if (kill_at >= 0 && t >= kill_at) {
        for (k = 0; k < np; k++)
          if (ps[k].running) say("%s did not stop after SIGTERM; sending SIGKILL", ps[k].name);
        signal_all(ps, np, SIGKILL, 1);
        kill_at = -1;
      }
      int open_streams = 0, nf = 1;
      pf[0].fd = g_sigpipe[0];
      pf[0].events = POLLIN;
      for (k = 0; k < np; k++)
        for (int s = 0; s < 2; s++)
          if (ps[k].out[s].fd >= 0) {
            pf[nf].fd = ps[k].out[s].fd;
            pf[nf].events = POLLIN;
            owner[nf] = &ps[k].out[s];
            owner_p[nf] = &ps[k];
            nf++;
            open_streams++;
          }
      if (running == 0) {
        /* everyone reaped: pass on what is left, but do not wait for
         * background processes that inherited the pipes */
        if (open_streams == 0) break;
        if (drain_until < 0) drain_until = t + 0.5;
        if (t >= drain_until) break;
      }
      double next = 1.0;
      if (timeout > 0 && kill_at < 0) next = dmin(next, t0 + timeout - t);
      if (term_at >= 0) next = dmin(next, term_at - t);
      if (kill_at >= 0) next = dmin(next, kill_at - t);
      if (drain_until >= 0) next = dmin(next, drain_until - t);
      int ms = next <= 0 ? 0 : (int)(next * 1000) + 1;
      int r = poll(pf, (nfds_t)nf, ms);
      if (r < 0 && errno != EINTR) {
        say("poll: %s", strerror(errno));
        break;
      }
      if (r > 0) {
        for (int f = 1; f < nf; f++)
          if (pf[f].revents) drain(owner_p[f], owner[f]);
        if (pf[0].revents) {
          unsigned char sig[64];
          ssize_t got;
          while ((got = read(g_sigpipe[0], sig, sizeof sig)) > 0) {
            for (ssize_t i = 0; i < got; i++) {
              if (sig[i] == SIGCHLD || running == 0) continue;
              if (!forwarded) {
                say("got signal %d; passing it on", (int)sig[i]);
                signal_all(ps, np, sig[i], 0);
                forwarded = 1;
                forwarded_sig = sig[i];
                if (kill_at < 0) kill_at = now_s() + grace + kill_delay;
              } else {
                say("got signal %d again; killing every process", (int)sig[i]);
                signal_all(ps, np, SIGKILL, 1);
              }
            }
          }
        }
      }
      /* reap (at the end of this pass, a synchronous restart starts every worker again) */
      int st;
      pid_t pid;
      while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        proc *p = NULL;
        for (k = 0; k < np; k++)
          if (ps[k].running && ps[k].pid == pid) p = &ps[k];
        if (!p) continue;
        p->running = 0;
        if (p->in_w >= 0) { /* --hosts: its remote script's input */
          close(p->in_w);
          p->in_w = -1;
        }
        p->status = st;
        running--;
        drain(p, &p->out[0]); /* its last words before the verdict */
        drain(p, &p->out[1]);
        int code = exit_code_of(st);
        if (!p->ps) workers_left--;
        else servers_left--;
        if (!p->ps && code == 0) workers_done++;
        if (code != 0 && !p->ps && !p->stopped_by_us && failure < 0 && !forwarded && !restarting &&
            restarts_used < max_restarts && kill_at < 0) {
          /* --max-restarts: this failure does not end the job. */
          char how[64];
          if (WIFSIGNALED(st))
            snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(st));
          else
            snprintf(how, sizeof how, "exited with code %d", code);
          restarts_used++;
          if (ps_job) {
            say("%s %s; starting it again (restart %d of %ld): it rejoins the servers", p->name, how, restarts_used,
                max_restarts);
            p->restarts = restarts_used;
            p->lfd = -1; /* a parameter-server worker only dials */
            if (start_proc(p, ps, np, workers, argv + prog_at, tok)) {
              running++;
              workers_left++;
              continue;
            }
            failure = code; /* could not start it again (said why) */
          } else {
            int live = 0;
            for (int q = 0; q < workers; q++) live += !ps[q].dropped;
            if (live > min_workers && now_s() - p->started_at < elastic_timeout && p->restarts > 0) {
              /* it failed again soon after its restart: it does not come back */
              p->dropped = 1;
              dropped_now = 1;
              say("%s %s %.1f s after it was started again: it does not come back (--elastic-timeout %g); "
                  "going on with %d workers (--min-workers %ld) from the checkpoint (restart %d of %ld)",
                  p->name, how, now_s() - p->started_at, elastic_timeout, live - 1, min_workers, restarts_used,
                  max_restarts);
            } else {
              say("%s %s; stopping every worker to start them all again from their checkpoint (restart %d of %ld)",
                  p->name, how, restarts_used, max_restarts);
            }
            restarting = 1;
            signal_all(ps, np, SIGTERM, 1);
            kill_at = now_s() + kill_delay;
            term_at = -1;
            continue;
          }
        }
        if (code != 0) {
          char how[64];
          if (WIFSIGNALED(st))
            snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(st));
          else
            snprintf(how, sizeof how, "exited with code %d", code);
          say("%s %s%s", p->name, how, p->stopped_by_us ? " (stopped by dtrain-launch)" : "");
          if (!p->stopped_by_us && failure < 0 && ps_job && !p->ps && !forwarded) {
            /* Parameter servers train asynchronously and drop a lost worker:
             * the others and the servers go on (the verdict waits for the
             * last worker). A signal passed on to everyone is not this. */
            if (lost_code < 0) lost_code = code;
            if (workers_left > 0)
              say("parameter-server job: going on with %d worker%s", workers_left, workers_left == 1 ? "" : "s");
          } else if (!p->stopped_by_us && failure < 0) {
            failure = code;
            if (running > 0 && term_at < 0 && kill_at < 0) {
              say("stopping the other processes in %g s (--grace)", grace);
              term_at = now_s() + grace;
            }
          }
        }
        int none_finished = 0;
        if (workers_left == 0 && failure < 0 && ps_job && !p->ps && !forwarded) {
          /* the last worker ended: the job's verdict */
          if (workers_done == 0) {
            say("parameter-server job failed: none of the %d worker%s finished", workers, workers == 1 ? "" : "s");
            failure = lost_code >= 0 ? lost_code : 1;
            none_finished = 1;
          } else if (workers_done < workers) {
            say("parameter-server job: training finished with %d of %d workers (%d lost)", workers_done, workers,
                workers - workers_done);
          }
        }
        if (workers_left == 0 && running > 0 && term_at < 0 && kill_at < 0 && (failure < 0 || none_finished))
          term_at = now_s() + grace; /* only servers remain: give them the grace period */
        if (ps_job && p->ps && servers_left == 0 && workers_left > 0 && failure < 0 && !forwarded && term_at < 0 &&
            kill_at < 0) {
          /* The servers ended on their own, so they saw every worker leave or
           * lost: the workers left (stopped, or hung) cannot train on. They
           * get the grace period (said only if they outlive it). */
          servers_gone = 1;
          term_at = now_s() + grace;
        }
      }
      if (restarting && running == 0 && !forwarded && failure < 0) {
        /* Every worker stopped: start them all again, on fresh listening sockets
         * (the same ports when they are free). */
        restarting = 0;
        kill_at = term_at = -1;
        workers_done = 0;
        /* --max-workers: a worker left out at an earlier restart is tried again */
        for (k = 0; k < workers && !dropped_now; k++)
          if (ps[k].dropped) {
            ps[k].dropped = 0;
            say("%s is tried again (--max-workers %d)", ps[k].name, workers);
          }
        dropped_now = 0;
        int live = renumber_workers(ps, workers);
        if (live < workers) say("restarting with %d of %d workers", live, workers);
        for (k = 0; k < np && failure < 0; k++) {
          proc *p = &ps[k];
          if (p->dropped) continue;
          p->restarts = restarts_used;
          if (p->host >= 0) continue; /* --hosts: it listens there itself, at the same address */
          int was = p->port;
          p->lfd = listen_on(host, p->port, &p->port);
          if (p->lfd < 0) p->lfd = listen_on(host, 0, &p->port);
          if (p->lfd < 0) {
            failure = 1;
            break;
          }
          if (p->port != was) {
            if (strchr(host, ':'))
              snprintf(p->addr, sizeof p->addr, "[%.200s]:%d", host, p->port);
            else
              snprintf(p->addr, sizeof p->addr, "%.200s:%d", host, p->port);
          }
        }
        for (k = 0; k < np && failure < 0; k++) {
          if (ps[k].dropped) continue;
          if (!start_proc(&ps[k], ps, np, workers, argv + prog_at, tok)) {
            failure = 1;
            signal_all(ps, np, SIGKILL, 1);
            break;
          }
          running++;
        }
        if (failure < 0) workers_left = live;
      }
    }
    free(pf);
    free(owner);
    free(owner_p);
    rc = failure >= 0 ? failure : forwarded ? 128 + forwarded_sig : 0;
    if (restarts_used > 0) say("%d restart%s made (--max-restarts %ld)", restarts_used, restarts_used == 1 ? "" : "s",
                               max_restarts);
    {
      int live = 0;
      for (k = 0; k < workers; k++) live += !ps[k].dropped;
      if (live < workers) say("the job ended with %d of %d workers (--min-workers %ld)", live, workers, min_workers);
    }
    goto done;
  }

stop_started:
  signal_all(ps, np, SIGKILL, 1);
  for (k = 0; k < np; k++)
    if (ps[k].running) waitpid(ps[k].pid, NULL, 0);
  rc = 1;
done:
  for (k = 0; k < np; k++) {
    if (ps[k].lfd >= 0) close(ps[k].lfd);
    if (ps[k].in_w >= 0) close(ps[k].in_w);
    for (int s = 0; s < 2; s++)
      if (ps[k].out[s].fd >= 0) {
        lines(&ps[k], &ps[k].out[s], 1);
        close(ps[k].out[s].fd);
      }
  }
  free(ps);
  return rc;

}
