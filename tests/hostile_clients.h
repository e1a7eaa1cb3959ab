/* tests/hostile_clients.h -- clients that attack a listening dtrain process
 * by being slow: a child process connects to the given addresses and holds,
 * per address, `silent` connections that never send a byte, `drip`
 * connections that send one byte of a genuine-looking hello every drip_s
 * seconds, and `fakes` connections that send a whole hello (a copy of
 * `hello`, e.g. one pretending to be a real worker) and then nothing. It
 * tells the parent once every connection is open (so they sit in the
 * listeners' backlogs before the real processes start), and holds them until
 * hostile_stop. For tests that include the amalgamation (private functions).
 * POSIX only; used by test_ps.c and test_comm_tcp.c. */
#ifndef DTRAIN_TEST_HOSTILE_CLIENTS_H
#define DTRAIN_TEST_HOSTILE_CLIENTS_H

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define HOSTILE_MAX 64

typedef struct hostile_spec {
  int silent, drip, fakes;
  double drip_s;
  const unsigned char *hello; /* DT__NET_HDR + DT__HELLO bytes: a framed hello */
} hostile_spec;

/* A framed hello from (role, index) of cluster c with options o (its job, model hash, token flag). */
static void hostile_hello(const dt_cluster *c, dt_role role, int index, const dt_net_options *o,
                          unsigned char out[DT__NET_HDR + DT__HELLO]) {
  dt_cluster me = *c;
  me.role = role;
  me.index = index;
  dt__net_self self;
  memset(out, 0, DT__NET_HDR + DT__HELLO);
  if (dt__net_self_init(&self, &me, o) != DTRAIN_OK) return;
  dt__hello h;
  dt__hello_self(&self, &h);
  dt__hello_pack(&h, out + DT__NET_HDR);
  dt__frame_pack(out, DT__MSG_HELLO, self.job, self.id, 0, out + DT__NET_HDR, DT__HELLO);
}

/* The child's pid (its connections are open when this returns), or -1. */
static pid_t hostile_start(char *const *addrs, int naddr, const hostile_spec *s) {
  int p[2];
  if (pipe(p) != 0) return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid > 0) {
    char ok = 0;
    close(p[1]);
    if (read(p[0], &ok, 1) != 1) ok = 0;
    close(p[0]);
    return ok == 'k' ? pid : -1;
  }
  close(p[0]);
  alarm(120); /* never outlives a broken test */
  int fd[HOSTILE_MAX], kind[HOSTILE_MAX], n = 0;
  size_t off[HOSTILE_MAX];
  for (int a = 0; a < naddr; a++) {
    int want[3] = {s->silent, s->drip, s->fakes};
    for (int k = 0; k < 3; k++)
      for (int i = 0; i < want[k] && n < HOSTILE_MAX; i++) {
        if (dt__net_connect(addrs[a], dt__now() + 5, &fd[n]) != DTRAIN_OK) _exit(1);
        kind[n] = k;
        off[n] = 0;
        if (k == 2) dt__net_write(fd[n], s->hello, DT__NET_HDR + DT__HELLO, dt__now() + 5);
        n++;
      }
  }
  if (write(p[1], "k", 1) != 1) _exit(1);
  close(p[1]);
  for (;;) {
    dt_sleep(s->drip_s > 0 ? s->drip_s : 1.0);
    for (int i = 0; i < n; i++) {
      if (kind[i] != 1 || off[i] >= DT__NET_HDR + DT__HELLO) continue;
      if (send(fd[i], s->hello + off[i], 1, DT__NET_SEND_FLAGS) == 1) off[i]++;
    }
  }
}

static void hostile_stop(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

#endif
