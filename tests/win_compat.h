/* tests/win_compat.h -- the few POSIX calls the test programs use, on Windows
 * (MinGW-w64, run under wine by `make windows`). Included by harness.h. The
 * programs that need fork(), signals or POSIX sockets directly are not built
 * there (WIN_SKIP in the Makefile says which, and why). */
#ifndef DTRAIN_TESTS_WIN_COMPAT_H
#define DTRAIN_TESTS_WIN_COMPAT_H
#if defined(_WIN32)
#  include <direct.h>
#  include <io.h>
#  include <malloc.h>
#  include <pthread.h>
#  include <stdio.h>
#  include <stdlib.h>
#  include <string.h>
#  include <time.h>

/* alarm(): a watchdog thread that ends the program when the time passes (no
 * SIGALRM there: the handler a test installs is not called; the program
 * exits 124 as `timeout` would, which fails it). alarm(0) disarms it. */
#  ifndef SIGALRM
#    define SIGALRM 14
#  endif
static volatile long th_win_alarm_gen;
typedef struct { long gen; unsigned s; } th_win_alarm_arg;
static void *th_win_alarm_run(void *p) {
  th_win_alarm_arg a = *(th_win_alarm_arg *)p;
  free(p);
  for (unsigned long ms = 0; ms < a.s * 1000ul; ms += 100) {
    struct timespec ts = {0, 100000000L};
    nanosleep(&ts, NULL);
    if (__atomic_load_n(&th_win_alarm_gen, __ATOMIC_SEQ_CST) != a.gen) return NULL;
  }
  fprintf(stderr, "watchdog: %u s passed (alarm)\n", a.s);
  fflush(NULL);
  _exit(124);
}
static unsigned alarm(unsigned s) {
  long gen = __atomic_add_fetch(&th_win_alarm_gen, 1, __ATOMIC_SEQ_CST);
  if (s == 0) return 0;
  th_win_alarm_arg *a = (th_win_alarm_arg *)malloc(sizeof *a);
  pthread_t t;
  if (!a) return 0;
  a->gen = gen;
  a->s = s;
  if (pthread_create(&t, NULL, th_win_alarm_run, a) != 0) {
    free(a);
    return 0;
  }
  pthread_detach(t);
  return 0;
}

static int setenv(const char *name, const char *value, int overwrite) {
  if (!overwrite && getenv(name)) return 0;
  return _putenv_s(name, value) == 0 ? 0 : -1;
}
static int unsetenv(const char *name) { return _putenv_s(name, "") == 0 ? 0 : -1; }

static char *mkdtemp(char *tmpl) {
  if (_mktemp_s(tmpl, strlen(tmpl) + 1) != 0) return NULL;
  return _mkdir(tmpl) == 0 ? tmpl : NULL;
}
#  define th_mkdir(path, mode) _mkdir(path)

/* rm -rf DIR, for the tests' cleanup (no shell commands under wine) */
#  include <dirent.h>
#  include <sys/stat.h>
static int th_rm_rf(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) return 0;
  if (!S_ISDIR(st.st_mode)) return remove(path) == 0 ? 0 : -1;
  DIR *d = opendir(path);
  int rc = 0;
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      char sub[1024];
      snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
      if (th_rm_rf(sub) != 0) rc = -1;
    }
    closedir(d);
  }
  return _rmdir(path) == 0 ? rc : -1;
}
#  define th_aligned_alloc(align, size) _aligned_malloc(size, align)
#  define th_aligned_free(p) _aligned_free(p)
#else
static int th_rm_rf(const char *path) {
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  return system(cmd) == 0 ? 0 : -1;
}
#  define th_mkdir(path, mode) mkdir(path, mode)
#  define th_aligned_alloc(align, size) aligned_alloc(align, size)
#  define th_aligned_free(p) free(p)
#endif
#endif
