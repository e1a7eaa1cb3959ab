/* ===========================================================================
 * dt_file.h -- writing a file atomically, opening a file to read it safely
 * ===========================================================================
 * Private to the implementation. Every file dtrain writes goes through
 * dt__file_create / dt__file_commit:
 *
 *   - the bytes go to a temporary file "<path>.tmp-<pid>-<n>" in the same
 *     directory, created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW): a file or
 *     a symbolic link planted at that name is never opened or written
 *     through;
 *   - commit flushes and fsyncs it, renames it over path and fsyncs the
 *     directory, so a crash leaves either the old file or the new one;
 *   - on any failure (or dt__file_abort) the temporary file is removed and an
 *     existing file at path is left as it was;
 *   - a process killed while writing leaves its temporary behind: the next
 *     dt__file_create for the same path removes the temporaries
 *     "<path>.tmp-<pid>-*" of processes that no longer exist (POSIX: kill(pid,
 *     0) fails with ESRCH).
 *
 * Reading, dt__file_open_read refuses what is not a regular file before it
 * can block (the open is non-blocking, then fstat: a FIFO, a device such as
 * /dev/zero, a directory or a socket is refused) and gives the size, so a
 * loader can check the size against its header and its limits before it
 * reads a byte.
 *
 * The functions set no dtrain error: they return a code and leave a message
 * ("cannot create temporary file '...': Permission denied") in msg, which the
 * caller puts in its own error, naming its function and the path.
 */
#ifndef DTRAIN_FILE_H
#define DTRAIN_FILE_H

#include "dt_internal.h"

#ifndef DTRAIN_NO_STDIO

typedef struct dt__file_out {
  FILE *f;         /* write here between create and commit/abort */
  const char *path;
  char *tmp;       /* the temporary file's name */
  size_t tmp_cap;
  char msg[320];   /* why the last call failed */
} dt__file_out;

/* Creates the temporary file for path. DTRAIN_OK, DTRAIN_ERR_NOMEM or
 * DTRAIN_ERR_IO (msg says why); on error nothing is left to clean up. */
DTRAIN_PRIVATE dt_result dt__file_create(dt__file_out *o, const char *path);
/* Flush, fsync, close, rename over path, fsync the directory. On failure
 * (DTRAIN_ERR_IO, msg) the temporary file is removed. Frees o either way. */
DTRAIN_PRIVATE dt_result dt__file_commit(dt__file_out *o);
/* Closes and removes the temporary file, frees o. */
DTRAIN_PRIVATE void dt__file_abort(dt__file_out *o);

/* Opens path for reading when it is a regular file (see above); *size is its
 * size in bytes. DTRAIN_ERR_IO with msg (cap bytes) otherwise. */
DTRAIN_PRIVATE dt_result dt__file_open_read(const char *path, FILE **out, uint64_t *size, char *msg, size_t cap);

/* Opens path to append to it (a log that grows, such as dt_fit's metrics
 * CSV), creating it if missing; never through a symbolic link planted at
 * path (O_NOFOLLOW), and only a regular file. NULL with msg otherwise. */
DTRAIN_PRIVATE FILE *dt__file_open_append(const char *path, char *msg, size_t cap);

/* Reads exactly n bytes; 0 on a short read or an error (msg says which). */
DTRAIN_PRIVATE int dt__file_read_exact(FILE *f, void *dst, size_t n, char *msg, size_t cap);

#endif /* DTRAIN_NO_STDIO */
#endif /* DTRAIN_FILE_H */
