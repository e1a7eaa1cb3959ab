/* ===========================================================================
 * dt_file.c -- writing a file atomically, opening a file to read it safely
 * ===========================================================================
 * See dt_file.h. The one place that creates, renames and opens files, so
 * that every writer (checkpoints, parameter-server shards, the fit chart,
 * .npy files) and every reader (checkpoints, data sets) gets the same rules.
 */
#include "dt_internal.h"
#include "dt_file.h"

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if defined(_WIN32)
#    include <fcntl.h>
#    include <io.h>
#    include <process.h>
#    include <sys/stat.h>
#  else
#    include <dirent.h>
#    include <fcntl.h>
#    if defined(__linux__)
#      include <sys/syscall.h>
#    endif
#    include <signal.h>
#    include <sys/stat.h>
#    include <sys/types.h>
#    include <unistd.h>
#    if defined(DT__POSIX_LATE) /* <signal.h>, <sys/stat.h> before dtrain.h in strict ISO mode (dt_base.h) */
extern int kill(pid_t pid, int sig);
#      if !defined(S_ISSOCK) && defined(__S_IFSOCK) && defined(__S_IFMT)
#        define S_ISSOCK(m) (((m) & __S_IFMT) == __S_IFSOCK)
#      endif
#    endif
#  endif
#endif

#ifndef DTRAIN_NO_STDIO

#if !defined(_WIN32) && !defined(O_NOFOLLOW)
#  define O_NOFOLLOW 0 /* a system without it still gets O_EXCL, which refuses a planted link too */
#endif
#if !defined(_WIN32) && !defined(O_CLOEXEC)
#  define O_CLOEXEC 0
#endif

static long dt__file_pid(void) {
#if defined(_WIN32)
  return (long)_getpid();
#else
  return (long)getpid();
#endif
}

/* Length of the directory part of path, without the last '/' ("": none). */
static size_t dt__file_dir_len(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? (size_t)(slash - path) : 0;
}

#if !defined(_WIN32)
/* Opens the directory of path (fsync, listing); -1 on failure. */
static int dt__file_open_dir(const char *path) {
  size_t n = dt__file_dir_len(path);
  if (!strchr(path, '/')) return open(".", O_RDONLY | O_CLOEXEC);
  if (n == 0) return open("/", O_RDONLY | O_CLOEXEC);
  char *dir = (char *)dt__alloc(n + 1);
  if (!dir) return -1;
  memcpy(dir, path, n);
  dir[n] = '\0';
  int fd = open(dir, O_RDONLY | O_CLOEXEC);
  dt__free(dir, n + 1);
  return fd;
}

/* A temporary name "<base>.tmp-<pid>-<n>": the pid when it is one, else 0. */
static long dt__file_tmp_pid(const char *name, const char *base, size_t blen) {
  if (strncmp(name, base, blen) != 0 || strncmp(name + blen, ".tmp-", 5) != 0) return 0;
  const char *p = name + blen + 5;
  long pid = 0;
  int digits = 0;
  /* At most 9 digits: no overflow of a 32-bit long, and never a value that
   * a pid_t would turn negative (kill() would then address a group). */
  for (; *p >= '0' && *p <= '9' && digits < 9; p++, digits++) pid = pid * 10 + (*p - '0');
  if (digits == 0 || *p != '-' || !p[1]) return 0;
  for (p++; *p; p++)
    if (*p < '0' || *p > '9') return 0;
  return pid;
}

/* One directory entry: removes it when it is a temporary of path's whose
 * process is gone. 0 when out of memory (stop listing). */
static int dt__file_clean_one(const char *path, const char *name, const char *base, size_t blen, long me) {
  size_t dn = dt__file_dir_len(path);
  long pid = dt__file_tmp_pid(name, base, blen);
  if (pid <= 0 || pid == me) return 1;
  if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) return 1; /* alive, or not ours to judge */
  size_t cap = (strchr(path, '/') ? dn + 1 : 0) + strlen(name) + 1;
  char *full = (char *)dt__alloc(cap);
  if (!full) return 0;
  snprintf(full, cap, "%.*s%s%s", (int)dn, path, strchr(path, '/') ? "/" : "", name);
  if (unlink(full) == 0)
    dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "removed '%s', left by process %ld that no longer exists", full, pid);
  dt__free(full, cap);
  return 1;
}

#  if defined(__linux__) && defined(SYS_getdents64)
/* syscall() is not declared under _POSIX_C_SOURCE alone; this is its prototype in glibc and musl. */
extern long syscall(long number, ...);
#  endif

/* Removes "<path>.tmp-<pid>-*" of processes that are gone (killed while
 * saving). Best effort: a failure here never stops the save. On Linux the
 * directory is read with getdents64 itself: readdir in a 32-bit build
 * without large-file support fails (EOVERFLOW) on a file system with 64-bit
 * inode numbers, and a header library cannot choose the user's
 * _FILE_OFFSET_BITS. */
static void dt__file_clean_stale(const char *path) {
  size_t dn = dt__file_dir_len(path);
  const char *base = strchr(path, '/') ? path + dn + 1 : path;
  size_t blen = strlen(base);
  long me = dt__file_pid();
  if (blen == 0) return;
  int dfd = dt__file_open_dir(path);
  if (dfd < 0) return;
  int err = 0;
#  if defined(__linux__) && defined(SYS_getdents64)
  /* struct linux_dirent64: u64 d_ino, s64 d_off, u16 d_reclen, u8 d_type, char d_name[] (NUL-terminated). */
  enum { DT__DIRENT_RECLEN = 16, DT__DIRENT_NAME = 19 };
  size_t cap = 16384;
  unsigned char *buf = (unsigned char *)dt__alloc(cap);
  if (!buf) {
    close(dfd);
    return;
  }
  for (int more = 1; more;) {
    long n = syscall(SYS_getdents64, dfd, buf, cap);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    for (long off = 0; off + DT__DIRENT_NAME < n;) {
      unsigned short reclen;
      memcpy(&reclen, buf + off + DT__DIRENT_RECLEN, sizeof reclen);
      if (reclen <= DT__DIRENT_NAME || off + reclen > n) break; /* cannot happen: the kernel's own records */
      buf[off + reclen - 1] = '\0'; /* the record is padded with NULs; never read past it */
      if (!dt__file_clean_one(path, (const char *)buf + off + DT__DIRENT_NAME, base, blen, me)) {
        more = 0;
        break;
      }
      off += reclen;
    }
  }
  dt__free(buf, cap);
  close(dfd);
#  else
  DIR *d = fdopendir(dfd);
  if (!d) {
    close(dfd);
    return;
  }
  struct dirent *e;
  for (errno = 0; (e = readdir(d)) != NULL; errno = 0)
    if (!dt__file_clean_one(path, e->d_name, base, blen, me)) break;
  err = e ? 0 : errno;
  closedir(d);
#  endif
  /* A listing that fails removes nothing: say so. */
  if (err != 0)
    dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_IO, "cannot list the directory of '%s' to remove stale temporaries: %s", path,
            strerror(err));
}
#endif

static void dt__file_release(dt__file_out *o) {
  dt__free(o->tmp, o->tmp_cap);
  o->tmp = NULL;
  o->tmp_cap = 0;
  o->f = NULL;
}

DTRAIN_PRIVATE dt_result dt__file_create(dt__file_out *o, const char *path) {
  static DT__TLS unsigned counter;
  memset(o, 0, sizeof *o);
  o->path = path;
  o->tmp_cap = strlen(path) + 48;
  o->tmp = (char *)dt__alloc(o->tmp_cap);
  if (!o->tmp) {
    o->tmp_cap = 0;
    snprintf(o->msg, sizeof o->msg, "out of memory");
    return DTRAIN_ERR_NOMEM;
  }
#if !defined(_WIN32)
  dt__file_clean_stale(path);
#endif
  int err = 0;
  for (int attempt = 0; attempt < 100 && !o->f; attempt++) {
    snprintf(o->tmp, o->tmp_cap, "%s.tmp-%ld-%u", path, dt__file_pid(), counter++);
#if defined(_WIN32) /* _O_EXCL as O_EXCL (msvcrt's fopen has no "x") */
    int fd = _open(o->tmp, _O_WRONLY | _O_CREAT | _O_EXCL | _O_BINARY | _O_NOINHERIT, _S_IREAD | _S_IWRITE);
#  define DT__FILE_FDOPEN _fdopen
#  define DT__FILE_CLOSE _close
#else
    int fd = open(o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
#  define DT__FILE_FDOPEN fdopen
#  define DT__FILE_CLOSE close
#endif
    if (fd >= 0) {
      o->f = DT__FILE_FDOPEN(fd, "wb");
      if (!o->f) {
        err = errno;
        DT__FILE_CLOSE(fd);
        remove(o->tmp);
        break;
      }
    } else {
      err = errno;
    }
#undef DT__FILE_FDOPEN
#undef DT__FILE_CLOSE
    if (!o->f && err != EEXIST) break;
  }
  if (!o->f) {
    snprintf(o->msg, sizeof o->msg, "cannot create temporary file '%.200s': %s", o->tmp, strerror(err));
    dt__file_release(o);
    return err == ENOMEM ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO;
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__file_abort(dt__file_out *o) {
  if (o->f) fclose(o->f);
  if (o->tmp) remove(o->tmp);
  dt__file_release(o);
}

static dt_result dt__file_fail(dt__file_out *o, const char *what, int err) {
  snprintf(o->msg, sizeof o->msg, "%s '%.200s' failed: %s", what, o->tmp, strerror(err));
  dt__file_abort(o);
  return DTRAIN_ERR_IO;
}

DTRAIN_PRIVATE dt_result dt__file_commit(dt__file_out *o) {
  if (ferror(o->f)) return dt__file_fail(o, "write to", errno ? errno : EIO);
  if (fflush(o->f) != 0) return dt__file_fail(o, "write to", errno);
#if defined(_WIN32)
  if (_commit(_fileno(o->f)) != 0) return dt__file_fail(o, "flushing to disk", errno); /* FlushFileBuffers */
#else
  {
    int rc;
    do rc = fsync(fileno(o->f)); while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EINVAL) return dt__file_fail(o, "fsync of", errno);
  }
#endif
  {
    int rc = fclose(o->f);
    o->f = NULL;
    if (rc != 0) return dt__file_fail(o, "closing", errno);
  }
#if defined(_WIN32)
  /* rename() there refuses an existing target: MoveFileEx replaces it in one
   * step (the old file stays whole until then), flushed before it returns. */
  if (!MoveFileExA(o->tmp, o->path, MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) {
    DWORD e = GetLastError();
    return dt__file_fail(o, "renaming", e == ERROR_ACCESS_DENIED || e == ERROR_SHARING_VIOLATION ? EACCES
                                        : e == ERROR_PATH_NOT_FOUND || e == ERROR_FILE_NOT_FOUND ? ENOENT
                                        : e == ERROR_DISK_FULL || e == ERROR_HANDLE_DISK_FULL    ? ENOSPC
                                                                                                 : EIO);
  }
#else
  if (rename(o->tmp, o->path) != 0) return dt__file_fail(o, "renaming", errno);
#endif
#if !defined(_WIN32)
  {
    /* The rename is durable once the directory is. */
    int fd = dt__file_open_dir(o->path);
    if (fd >= 0) {
      int rc;
      do rc = fsync(fd); while (rc != 0 && errno == EINTR);
      if (rc != 0 && errno != EINVAL && errno != EROFS && errno != EBADF)
        dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_IO, "fsync of the directory of '%s' failed: %s", o->path, strerror(errno));
      close(fd);
    }
  }
#endif
  dt__file_release(o);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__file_open_read(const char *path, FILE **out, uint64_t *size, char *msg, size_t cap) {
  *out = NULL;
  *size = 0;
#if defined(_WIN32)
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(msg, cap, "cannot open: %s", strerror(errno));
    return DTRAIN_ERR_IO;
  }
  __int64 n = -1; /* 64-bit offsets: a long is 32 bits there */
  if (_fseeki64(f, 0, SEEK_END) == 0) n = _ftelli64(f);
  if (n < 0 || _fseeki64(f, 0, SEEK_SET) != 0) {
    snprintf(msg, cap, "cannot determine the size: %s", strerror(errno));
    fclose(f);
    return DTRAIN_ERR_IO;
  }
  *size = (uint64_t)n;
  *out = f;
  return DTRAIN_OK;
#else
  /* Non-blocking, so that opening a FIFO without a writer returns at once. */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int saved = errno;
    snprintf(msg, cap, "cannot open: %s", strerror(saved));
    errno = saved; /* the caller may tell "no such file" apart */
    return DTRAIN_ERR_IO;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    snprintf(msg, cap, "cannot stat: %s", strerror(errno));
    close(fd);
    return DTRAIN_ERR_IO;
  }
  if (!S_ISREG(sb.st_mode)) {
    snprintf(msg, cap, "not a regular file (%s)",
             S_ISDIR(sb.st_mode) ? "a directory" : S_ISFIFO(sb.st_mode) ? "a FIFO"
             : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device" : S_ISSOCK(sb.st_mode) ? "a socket" : "special");
    close(fd);
    return DTRAIN_ERR_IO;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl != -1) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    snprintf(msg, cap, "cannot open: %s", strerror(errno));
    close(fd);
    return errno == ENOMEM ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_IO;
  }
  *size = sb.st_size > 0 ? (uint64_t)sb.st_size : 0;
  *out = f;
  return DTRAIN_OK;
#endif
}

DTRAIN_PRIVATE FILE *dt__file_open_append(const char *path, char *msg, size_t cap) {
#if defined(_WIN32)
  FILE *f = fopen(path, "ab"); /* Windows: no symbolic links to plant without privileges */
  if (!f) snprintf(msg, cap, "%s", strerror(errno));
  return f;
#else
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd < 0) {
    snprintf(msg, cap, "%s", errno == ELOOP ? "a symbolic link is there (not followed)" : strerror(errno));
    return NULL;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    snprintf(msg, cap, "not a regular file");
    close(fd);
    return NULL;
  }
  FILE *f = fdopen(fd, "ab");
  if (!f) {
    snprintf(msg, cap, "%s", strerror(errno));
    close(fd);
  }
  return f;
#endif
}

DTRAIN_PRIVATE int dt__file_read_exact(FILE *f, void *dst, size_t n, char *msg, size_t cap) {
  size_t got = n ? fread(dst, 1, n, f) : 0;
  if (got == n) return 1;
  if (ferror(f)) snprintf(msg, cap, "read %zu of %zu bytes: %s", got, n, strerror(errno));
  else snprintf(msg, cap, "read %zu of %zu bytes: the file changed while reading", got, n);
  return 0;
}

DTRAIN_API dt_result dt_check_writable(const char *path, int is_dir) {
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_check_writable: path is NULL");
  size_t n = strlen(path);
  if (n == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_check_writable: the path is empty");
  if (!is_dir && path[n - 1] == '/')
    return dt__error(DTRAIN_ERR_INVALID_ARG, "'%s' names a directory, not a file", path);
  /* In a directory: the temporary of a file named there. */
  size_t cap = n + 16;
  char *probe = (char *)dt__alloc(cap);
  if (!probe) return dt__error(DTRAIN_ERR_NOMEM, "dt_check_writable: out of memory");
  if (is_dir) snprintf(probe, cap, "%s%s.dtrain-probe", path, path[n - 1] == '/' ? "" : "/");
  else snprintf(probe, cap, "%s", path);
  dt__file_out o;
  dt_result r = dt__file_create(&o, probe);
  if (r == DTRAIN_OK) dt__file_abort(&o);
  else {
    size_t dn = dt__file_dir_len(probe);
    if (strchr(probe, '/'))
      r = dt__error(r, "cannot create a file in directory '%.*s': %s", (int)(dn ? dn : 1), probe, o.msg);
    else r = dt__error(r, "cannot create a file in directory '.': %s", o.msg);
  }
  dt__free(probe, cap);
  return r;
}

#else
DTRAIN_API dt_result dt_check_writable(const char *path, int is_dir) {
  (void)path, (void)is_dir;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_check_writable: built with DTRAIN_NO_STDIO (no files)");
}
#endif /* DTRAIN_NO_STDIO */
