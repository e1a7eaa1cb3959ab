/* ===========================================================================
 * dt_trace.c -- timelines: every thread's spans as Chrome trace-event JSON
 * ===========================================================================
 * See dt_trace_start in dt_base.h. The spans come from the profile's hooks
 * (dt_profile.c: each op's forward pieces, each tape node's backward, the
 * optimizer, the loader, the collectives, pushes and pulls, checkpoints) and
 * from the trace-only ones (waits at barriers, strategy steps): dt__trace_span
 * appends one to the calling thread's own buffer, so recording takes no
 * lock; a thread claims a buffer (under dt__trace_mu) the first time it
 * records in a session.
 *
 * A buffer is a list of chunks of DT__TRACE_CHUNK events, up to
 * DT__TRACE_MAX_EVENTS a thread (past that events are counted, not kept).
 * Only its owner writes it; the owner publishes a chunk's pointer before the
 * count that covers it (release), and dt_trace_stop reads the count
 * (acquire), so a span still being recorded while the file is written is
 * either whole in it or left out. Buffers are never freed while the process
 * runs (a thread may still hold one when the trace stops); a new session
 * resets them and hands them to whichever threads record first, so their
 * number is the most threads that ever recorded in one session. Names are
 * kept by pointer: the hooks pass string literals (op names, "dt_pstore_pull").
 *
 * The file: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData":
 * {...}}, complete ("X") events with ts and dur in microseconds of the
 * monotonic clock (dt_time_now), one process (pid: the worker's rank, 1000 +
 * a server's index, 0 alone) and one tid per thread, named by metadata
 * events; otherData carries the process's role and index and one reading of
 * the monotonic and of the calendar clock taken together, from which
 * tools/dtrain-trace merge puts the files of several processes on one axis.
 * It is written through dt__file_create/commit: a failed write (a full disk)
 * is an error and leaves whatever was at the path. */
#include "dt_internal.h"
#include "dt_platform.h"
#include "dt_file.h"
#include <time.h>

#define DT__TRACE_CHUNK 4096
#define DT__TRACE_MAX_EVENTS ((int64_t)1 << 21) /* a thread's events kept in one session (64 MiB) */
#define DT__TRACE_MAX_CHUNKS (DT__TRACE_MAX_EVENTS / DT__TRACE_CHUNK)

typedef struct dt__trace_ev {
  const char *name;
  int64_t t0, dur; /* ns */
  int32_t cat;
  int32_t pad;
} dt__trace_ev;

typedef struct dt__trace_buf {
  struct dt__trace_buf *next; /* every buffer ever made (under dt__trace_mu) */
  int owned;                  /* claimed in this session (under dt__trace_mu) */
  int tid;
  char name[48];
  dt__trace_ev *chunks[DT__TRACE_MAX_CHUNKS];
  DT__ATOMIC(int64_t) n;
} dt__trace_buf;

static dt__mutex dt__trace_mu;
static DT__ATOMIC(int) dt__trace_mu_ready; /* 0 none, 1 being made, 2 made */
static dt__trace_buf *dt__trace_bufs;
static int dt__trace_tids;                 /* tids handed out in this session */
static DT__ATOMIC(unsigned) dt__trace_gen; /* a new session makes every thread claim again */
static DT__ATOMIC(int64_t) dt__trace_dropped;
static char dt__trace_role[24];
static int dt__trace_index = -1;
#ifndef DTRAIN_NO_STDIO
static char dt__trace_path[1024];
static double dt__trace_mono0, dt__trace_real0; /* one reading of both clocks, at start */
#endif
static DT__ATOMIC(int) dt__trace_env_done;

static DT__TLS dt__trace_buf *dt__trace_mine;
static DT__TLS unsigned dt__trace_mygen;
static DT__TLS char dt__trace_myname[48];

static void dt__trace_lock(void) {
  int st = DT__ALOAD(&dt__trace_mu_ready, DT__MO_ACQUIRE);
  if (st != 2) {
    int zero = 0;
    if (DT__ACAS(&dt__trace_mu_ready, &zero, 1, DT__MO_ACQ_REL)) {
      dt__mutex_init(&dt__trace_mu);
      DT__ASTORE(&dt__trace_mu_ready, 2, DT__MO_RELEASE);
    } else {
      while (DT__ALOAD(&dt__trace_mu_ready, DT__MO_ACQUIRE) != 2) dt__cpu_relax();
    }
  }
  dt__mutex_lock(&dt__trace_mu);
}

static void dt__trace_unlock(void) { dt__mutex_unlock(&dt__trace_mu); }

/* The calling thread's buffer for this session, claimed or made; NULL when
 * out of memory (the event is counted as dropped). */
static dt__trace_buf *dt__trace_claim(unsigned gen) {
  dt__trace_lock();
  dt__trace_buf *b = dt__trace_bufs;
  while (b && b->owned) b = b->next;
  if (!b) {
    b = (dt__trace_buf *)dt__calloc(sizeof *b);
    if (b) {
      b->next = dt__trace_bufs;
      dt__trace_bufs = b;
    }
  }
  if (b) {
    b->owned = 1;
    b->tid = dt__trace_tids++;
    memcpy(b->name, dt__trace_myname, sizeof b->name);
    DT__ASTORE(&b->n, 0, DT__MO_RELAXED);
  }
  dt__trace_unlock();
  dt__trace_mine = b;
  dt__trace_mygen = gen;
  return b;
}

DTRAIN_PRIVATE void dt__trace_span(const char *name, int cat, int64_t t0, int64_t t1) {
  unsigned gen = DT__ALOAD(&dt__trace_gen, DT__MO_RELAXED);
  dt__trace_buf *b = dt__trace_mine;
  if (!b || dt__trace_mygen != gen) b = dt__trace_claim(gen);
  int64_t n = b ? DT__ALOAD(&b->n, DT__MO_RELAXED) : DT__TRACE_MAX_EVENTS;
  if (n >= DT__TRACE_MAX_EVENTS) {
    DT__AFETCH_ADD(&dt__trace_dropped, 1, DT__MO_RELAXED);
    return;
  }
  dt__trace_ev *c = b->chunks[n / DT__TRACE_CHUNK];
  if (!c) {
    c = (dt__trace_ev *)dt__alloc(sizeof(dt__trace_ev) * DT__TRACE_CHUNK);
    if (!c) {
      DT__AFETCH_ADD(&dt__trace_dropped, 1, DT__MO_RELAXED);
      return;
    }
    b->chunks[n / DT__TRACE_CHUNK] = c;
  }
  dt__trace_ev *e = &c[n % DT__TRACE_CHUNK];
  e->name = name;
  e->t0 = t0;
  e->dur = t1 > t0 ? t1 - t0 : 0;
  e->cat = cat;
  e->pad = 0;
  DT__ASTORE(&b->n, n + 1, DT__MO_RELEASE);
}

DTRAIN_PRIVATE void dt__trace_wait(const char *name, double seconds) {
  if (!(seconds > 0) || !dt__prof_tracing()) return;
  int64_t t1 = dt__prof_now_ns();
  dt__trace_span(name, DT__TRACE_WAIT, t1 - (int64_t)(seconds * 1e9), t1);
}

DTRAIN_API void dt_trace_name_thread(const char *name) {
  snprintf(dt__trace_myname, sizeof dt__trace_myname, "%s", name ? name : "");
  if (dt__trace_mine && dt__trace_mygen == DT__ALOAD(&dt__trace_gen, DT__MO_RELAXED)) {
    dt__trace_lock();
    memcpy(dt__trace_mine->name, dt__trace_myname, sizeof dt__trace_myname);
    dt__trace_unlock();
  }
}

DTRAIN_API void dt_trace_set_process(const char *role, int index) {
  dt__trace_lock();
  snprintf(dt__trace_role, sizeof dt__trace_role, "%s", role ? role : "");
  dt__trace_index = role && *role ? index : -1;
  dt__trace_unlock();
}

DTRAIN_API int dt_trace_active(void) { return dt__prof_tracing(); }

#ifndef DTRAIN_NO_STDIO

static double dt__trace_realtime(void) {
#  if defined(TIME_UTC)
  struct timespec ts;
  if (timespec_get(&ts, TIME_UTC) == TIME_UTC) return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#  endif
  return (double)time(NULL);
}

DTRAIN_API dt_result dt_trace_start(const char *path) {
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_trace_start: path is NULL");
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof dt__trace_path - 32)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_trace_start: path '%.60s' is %s", path,
                     len ? "too long (1000 bytes at most)" : "empty");
  dt__trace_lock();
  memcpy(dt__trace_path, path, len + 1);
  for (dt__trace_buf *b = dt__trace_bufs; b; b = b->next) b->owned = 0;
  dt__trace_tids = 0;
  DT__ASTORE(&dt__trace_dropped, 0, DT__MO_RELAXED);
  DT__AFETCH_ADD(&dt__trace_gen, 1u, DT__MO_RELAXED);
  dt__trace_mono0 = dt_time_now();
  dt__trace_real0 = dt__trace_realtime();
  dt__trace_unlock();
  dt__prof_set_tracing(1);
  return DTRAIN_OK;
}

/* JSON string body of s (no quotes), escaped */
static void dt__trace_put_str(FILE *f, const char *s) {
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
}

static const char *dt__trace_cat_name(int cat) {
  if (cat >= 0 && cat <= DTRAIN_PROFILE_CHECKPOINT) return dt_profile_phase_name((dt_profile_phase)cat);
  if (cat == DT__TRACE_WAIT) return "wait";
  if (cat == DT__TRACE_STEP) return "step";
  return "other";
}

/* path with ".<role><index>" before its extension when the process has a role */
static void dt__trace_file_name(char *out, size_t cap) {
  const char *p = dt__trace_path;
  if (!dt__trace_role[0]) {
    snprintf(out, cap, "%s", p);
    return;
  }
  const char *slash = strrchr(p, '/'), *dot = strrchr(p, '.');
  if (!dot || (slash && dot < slash) || dot == p || (slash && dot == slash + 1)) dot = p + strlen(p);
  snprintf(out, cap, "%.*s.%s%d%s", (int)(dot - p), p, dt__trace_role, dt__trace_index, dot);
}

DTRAIN_API dt_result dt_trace_stop(void) {
  if (!dt__prof_tracing()) return dt__error(DTRAIN_ERR_STATE, "dt_trace_stop: no trace is running (dt_trace_start)");
  dt__prof_set_tracing(0);
  dt__trace_lock();
  char file[1100];
  dt__trace_file_name(file, sizeof file);
  int pid = dt__trace_index < 0 ? 0 : strcmp(dt__trace_role, "server") == 0 ? 1000 + dt__trace_index : dt__trace_index;
  dt__file_out fo;
  dt_result r = dt__file_create(&fo, file);
  if (r != DTRAIN_OK) {
    dt__trace_unlock();
    return dt__error(r, "dt_trace_stop: '%s': %s", file, fo.msg);
  }
  FILE *f = fo.f;
  int64_t events = 0;
  fprintf(f, "{\"traceEvents\": [\n");
  fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"", pid);
  if (dt__trace_role[0]) {
    dt__trace_put_str(f, dt__trace_role);
    fprintf(f, " %d", dt__trace_index);
  } else {
    fprintf(f, "dtrain");
  }
  fprintf(f, "\"}}");
  for (dt__trace_buf *b = dt__trace_bufs; b; b = b->next) {
    if (!b->owned) continue;
    fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": \"", pid,
            b->tid);
    if (b->name[0]) dt__trace_put_str(f, b->name);
    else fprintf(f, "thread %d", b->tid);
    fprintf(f, "\"}}");
    int64_t n = DT__ALOAD(&b->n, DT__MO_ACQUIRE);
    for (int64_t i = 0; i < n; i++) {
      const dt__trace_ev *e = &b->chunks[i / DT__TRACE_CHUNK][i % DT__TRACE_CHUNK];
      fprintf(f, ",\n{\"name\": \"");
      dt__trace_put_str(f, e->name);
      fprintf(f, "\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": %d, \"tid\": %d}",
              dt__trace_cat_name(e->cat), (double)e->t0 * 1e-3, (double)e->dur * 1e-3, pid, b->tid);
      events++;
    }
  }
  fprintf(f, "\n],\n\"displayTimeUnit\": \"ms\",\n\"otherData\": {\"dtrain_trace\": 1, \"role\": \"");
  dt__trace_put_str(f, dt__trace_role[0] ? dt__trace_role : "process");
  fprintf(f,
          "\", \"index\": %d, \"pid\": %d, \"events\": %lld, \"dropped\": %lld, \"monotonic_us\": %.3f, "
          "\"realtime_us\": %.3f}\n}\n",
          dt__trace_index, pid, (long long)events, (long long)DT__ALOAD(&dt__trace_dropped, DT__MO_RELAXED),
          dt__trace_mono0 * 1e6, dt__trace_real0 * 1e6);
  r = dt__file_commit(&fo);
  dt__trace_unlock();
  if (r != DTRAIN_OK) return dt__error(r, "dt_trace_stop: writing '%s' failed: %s", file, fo.msg);
  return DTRAIN_OK;
}

static void dt__trace_atexit(void) {
  if (dt__prof_tracing() && dt_trace_stop() != DTRAIN_OK)
    fprintf(stderr, "dtrain: DTRAIN_TRACE: %s\n", dt_last_error());
}

#else /* DTRAIN_NO_STDIO */

DTRAIN_API dt_result dt_trace_start(const char *path) {
  (void)path;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_trace_start: built with DTRAIN_NO_STDIO (no file I/O)");
}

DTRAIN_API dt_result dt_trace_stop(void) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_trace_stop: built with DTRAIN_NO_STDIO (no file I/O)");
}

#endif /* DTRAIN_NO_STDIO */

DTRAIN_PRIVATE void dt__trace_env(void) {
  int zero = 0;
  if (DT__ALOAD(&dt__trace_env_done, DT__MO_RELAXED) || !DT__ACAS(&dt__trace_env_done, &zero, 1, DT__MO_ACQ_REL))
    return;
#ifndef DTRAIN_NO_STDIO
  const char *e = getenv("DTRAIN_TRACE");
  if (!e || !*e || dt__prof_tracing()) return;
  if (dt_trace_start(e) != DTRAIN_OK) {
    fprintf(stderr, "dtrain: DTRAIN_TRACE: %s\n", dt_last_error());
    return;
  }
  atexit(dt__trace_atexit);
#endif
}
