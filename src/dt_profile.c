/* ===========================================================================
 * dt_profile.c -- the per-op profile and the timelines: where a training
 * step's time goes, in a table and on every thread's time line
 * ===========================================================================
 * See dt_profile_start in dt_base.h. One table for the process: a slot per
 * (name, phase), found by the name's pointer (the ops' names are string
 * literals) or its text, appended under a spin lock the first time a name is
 * seen, never removed; calls and nanoseconds are added with relaxed atomic
 * adds, so replica threads charge into it at once without a lock.
 *
 * Attribution of the forward pass (self time, as profilers report it): every
 * op's entry (dt__prof_fwd_begin, from dt__begin) charges the time since the
 * thread's last mark to the op that was running and makes the new op the
 * running one; an op's output recorded or finished (dt__prof_fwd_end) charges
 * it and leaves nothing running. A layer built from other ops (a linear layer:
 * a matrix product and a bias add) so shows its pieces' time under their
 * names, and its own entry only the bookkeeping between them. Time between
 * ops (the user's code) is charged to nobody. Backward charges each tape
 * node's backward call to the node's op. The running op and the last mark
 * are per thread; the generation number makes a thread's mark from before a
 * dt_profile_start worthless.
 *
 * The same hooks feed the timeline (below) while a trace runs: each
 * piece of time charged becomes a span of the thread's timeline too. The
 * two are switched by separate bits of one word (dt__prof_on: 1 profile,
 * 2 trace), so with both off (the default) each hook is one relaxed load
 * and a return. */
#include "dt_internal.h"
#include "dt_platform.h"
#include "dt_file.h"
#include <time.h>

#define DT__PROF_SLOTS 192
#define DT__PROF_PHASES (DTRAIN_PROFILE_CHECKPOINT + 1)

typedef struct dt__prof_slot {
  const char *name;
  int phase;
  DT__ATOMIC(int64_t) calls;
  DT__ATOMIC(int64_t) ns;
} dt__prof_slot;

static dt__prof_slot dt__prof_tab[DT__PROF_SLOTS];
static DT__ATOMIC(int) dt__prof_used;   /* slots published (acquire to read their names) */
static DT__ATOMIC(int) dt__prof_lock;   /* taken only to append a slot */
static DT__ATOMIC(int) dt__prof_on;     /* bits: DT__PROF_TABLE, DT__PROF_TRACE */
#define DT__PROF_TABLE 1
#define DT__PROF_TRACE 2
static DT__ATOMIC(unsigned) dt__prof_gen;
static DT__ATOMIC(int64_t) dt__prof_dropped; /* charges lost because the table was full */

/* the thread's running forward op and its last mark */
static DT__TLS const char *dt__prof_cur;
static DT__TLS int64_t dt__prof_mark;
static DT__TLS unsigned dt__prof_tgen;

static int64_t dt__prof_now(void) { return (int64_t)(dt_time_now() * 1e9); }

static dt__prof_slot *dt__prof_find(const char *name, int phase) {
  int n = DT__ALOAD(&dt__prof_used, DT__MO_ACQUIRE);
  for (int i = 0; i < n; i++)
    if (dt__prof_tab[i].name == name && dt__prof_tab[i].phase == phase) return &dt__prof_tab[i];
  for (int i = 0; i < n; i++)
    if (dt__prof_tab[i].phase == phase && strcmp(dt__prof_tab[i].name, name) == 0) return &dt__prof_tab[i];
  int unlocked = 0;
  while (!DT__ACAS(&dt__prof_lock, &unlocked, 1, DT__MO_ACQUIRE)) {
    unlocked = 0;
    dt__cpu_relax();
  }
  dt__prof_slot *s = NULL;
  int m = DT__ALOAD(&dt__prof_used, DT__MO_RELAXED);
  for (int i = n; i < m && !s; i++) /* appended by another thread meanwhile */
    if (dt__prof_tab[i].phase == phase && strcmp(dt__prof_tab[i].name, name) == 0) s = &dt__prof_tab[i];
  if (!s && m < DT__PROF_SLOTS) {
    s = &dt__prof_tab[m];
    s->name = name;
    s->phase = phase;
    DT__ASTORE(&s->calls, 0, DT__MO_RELAXED);
    DT__ASTORE(&s->ns, 0, DT__MO_RELAXED);
    DT__ASTORE(&dt__prof_used, m + 1, DT__MO_RELEASE);
  }
  DT__ASTORE(&dt__prof_lock, 0, DT__MO_RELEASE);
  return s;
}

/* bit on (1) or off (0) in dt__prof_on */
static void dt__prof_bit(int bit, int on) {
  int v = DT__ALOAD(&dt__prof_on, DT__MO_RELAXED);
  while (!DT__ACAS(&dt__prof_on, &v, on ? (v | bit) : (v & ~bit), DT__MO_ACQ_REL)) {
  }
}

DTRAIN_PRIVATE int dt__prof_tracing(void) { return (DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) & DT__PROF_TRACE) != 0; }

/* to the table when the profile is on, as a span [t0, t1) when the trace is */
static void dt__prof_charge(const char *name, int phase, int64_t calls, int64_t ns);
static void dt__prof_both(int on, const char *name, int phase, int64_t calls, int64_t t0, int64_t t1) {
  if (on & DT__PROF_TABLE) dt__prof_charge(name, phase, calls, t1 - t0);
  if ((on & DT__PROF_TRACE) && t1 > t0) dt__trace_span(name, phase, t0, t1);
}

static void dt__prof_charge(const char *name, int phase, int64_t calls, int64_t ns) {
  dt__prof_slot *s = dt__prof_find(name, phase);
  if (!s) {
    DT__AFETCH_ADD(&dt__prof_dropped, 1, DT__MO_RELAXED);
    return;
  }
  if (calls) DT__AFETCH_ADD(&s->calls, calls, DT__MO_RELAXED);
  if (ns > 0) DT__AFETCH_ADD(&s->ns, ns, DT__MO_RELAXED);
}

DTRAIN_PRIVATE int64_t dt__prof_t0(void) { return DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) ? dt__prof_now() : 0; }

DTRAIN_PRIVATE void dt__prof_add(const char *name, dt_profile_phase phase, int64_t t0) {
  int on = t0 ? DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) : 0;
  if (on) dt__prof_both(on, name, (int)phase, 1, t0, dt__prof_now());
}

DTRAIN_PRIVATE void dt__prof_add_table(const char *name, dt_profile_phase phase, int64_t t0) {
  int on = t0 ? DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) : 0;
  if (on & DT__PROF_TABLE) dt__prof_charge(name, (int)phase, 1, dt__prof_now() - t0);
}

DTRAIN_PRIVATE int64_t dt__trace_t0(void) {
  return (DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) & DT__PROF_TRACE) ? dt__prof_now() : 0;
}

DTRAIN_PRIVATE void dt__trace_end(const char *name, int cat, int64_t t0) {
  if (t0 && (DT__ALOAD(&dt__prof_on, DT__MO_RELAXED) & DT__PROF_TRACE)) dt__trace_span(name, cat, t0, dt__prof_now());
}

DTRAIN_PRIVATE void dt__prof_fwd_begin(const char *op) {
  int on = DT__ALOAD(&dt__prof_on, DT__MO_RELAXED);
  if (!on) return;
  int64_t now = dt__prof_now();
  unsigned gen = DT__ALOAD(&dt__prof_gen, DT__MO_RELAXED);
  if (dt__prof_cur && dt__prof_tgen == gen) dt__prof_both(on, dt__prof_cur, DTRAIN_PROFILE_FORWARD, 0, dt__prof_mark, now);
  if (on & DT__PROF_TABLE) dt__prof_charge(op, DTRAIN_PROFILE_FORWARD, 1, 0);
  dt__prof_cur = op;
  dt__prof_tgen = gen;
  dt__prof_mark = dt__prof_now(); /* the table lookups above are the profile's time, not the op's */
}

DTRAIN_PRIVATE void dt__prof_fwd_end(void) {
  if (!dt__prof_cur) return;
  const char *op = dt__prof_cur;
  dt__prof_cur = NULL;
  int on = DT__ALOAD(&dt__prof_on, DT__MO_RELAXED);
  if (!on || dt__prof_tgen != DT__ALOAD(&dt__prof_gen, DT__MO_RELAXED)) return;
  dt__prof_both(on, op, DTRAIN_PROFILE_FORWARD, 0, dt__prof_mark, dt__prof_now());
}

DTRAIN_API void dt_profile_start(void) {
  int n = DT__ALOAD(&dt__prof_used, DT__MO_ACQUIRE);
  for (int i = 0; i < n; i++) {
    DT__ASTORE(&dt__prof_tab[i].calls, 0, DT__MO_RELAXED);
    DT__ASTORE(&dt__prof_tab[i].ns, 0, DT__MO_RELAXED);
  }
  DT__ASTORE(&dt__prof_dropped, 0, DT__MO_RELAXED);
  DT__AFETCH_ADD(&dt__prof_gen, 1u, DT__MO_RELAXED);
  dt__prof_bit(DT__PROF_TABLE, 1);
}

DTRAIN_API void dt_profile_stop(void) { dt__prof_bit(DT__PROF_TABLE, 0); }

DTRAIN_API void dt_profile_resume(void) {
  DT__AFETCH_ADD(&dt__prof_gen, 1u, DT__MO_RELAXED); /* an op left running while off is not charged the pause */
  dt__prof_bit(DT__PROF_TABLE, 1);
}

DTRAIN_API const char *dt_profile_phase_name(dt_profile_phase phase) {
  switch (phase) {
    case DTRAIN_PROFILE_FORWARD: return "forward";
    case DTRAIN_PROFILE_BACKWARD: return "backward";
    case DTRAIN_PROFILE_UPDATE: return "update";
    case DTRAIN_PROFILE_DATA: return "data";
    case DTRAIN_PROFILE_COMM: return "comm";
    case DTRAIN_PROFILE_CHECKPOINT: return "checkpoint";
  }
  return "unknown";
}

DTRAIN_API int dt_profile_read(dt_profile_entry *out, int cap) {
  if (cap < 0 || (cap > 0 && !out)) {
    dt__error(out ? DTRAIN_ERR_INVALID_ARG : DTRAIN_ERR_NULL_ARG, "dt_profile_read: out is %s with cap %d",
              out ? "given" : "NULL", cap);
    return -1;
  }
  int n = DT__ALOAD(&dt__prof_used, DT__MO_ACQUIRE), k = 0;
  for (int i = 0; i < n; i++) {
    dt_profile_entry e;
    e.name = dt__prof_tab[i].name;
    e.phase = (dt_profile_phase)dt__prof_tab[i].phase;
    e.calls = DT__ALOAD(&dt__prof_tab[i].calls, DT__MO_RELAXED);
    e.seconds = (double)DT__ALOAD(&dt__prof_tab[i].ns, DT__MO_RELAXED) * 1e-9;
    if (e.calls == 0 && e.seconds == 0) continue;
    /* insertion into the first min(k, cap) entries, longest first */
    int j = k < cap ? k : cap;
    while (j > 0 && out[j - 1].seconds < e.seconds) {
      if (j < cap) out[j] = out[j - 1];
      j--;
    }
    if (j < cap) out[j] = e;
    k++;
  }
  return k;
}

/* snprintf into the rest of buf, as far as it goes; *len counts what the whole text needs */
static void dt__prof_put(char *buf, size_t cap, size_t *len, const char *fmt, ...) DT__PRINTF(4, 5);
static void dt__prof_put(char *buf, size_t cap, size_t *len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *at = buf && *len < cap ? buf + *len : NULL;
  int k = vsnprintf(at, at ? cap - *len : 0, fmt, ap);
  va_end(ap);
  if (k > 0) *len += (size_t)k;
}

DTRAIN_API int64_t dt_profile_format(char *buf, size_t cap, int64_t steps, double wall_seconds) {
  if (!buf && cap) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_profile_format: buf is NULL with cap %zu", cap);
    return -1;
  }
  if (steps < 0 || !(wall_seconds >= 0)) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_profile_format: steps %lld and wall_seconds %g must not be negative",
              (long long)steps, wall_seconds);
    return -1;
  }
  if (cap) buf[0] = '\0';
  dt_profile_entry e[DT__PROF_SLOTS];
  int n = dt_profile_read(e, DT__PROF_SLOTS);
  double sum = 0, phase[DT__PROF_PHASES] = {0};
  for (int i = 0; i < n; i++) {
    sum += e[i].seconds;
    if ((int)e[i].phase >= 0 && (int)e[i].phase < DT__PROF_PHASES) phase[e[i].phase] += e[i].seconds;
  }
  const double base = wall_seconds > 0 ? wall_seconds : sum;
  size_t len = 0;
  dt__prof_put(buf, cap, &len, "profile: %d op kinds, %.4g s in ops", n, sum);
  if (wall_seconds > 0) dt__prof_put(buf, cap, &len, " of %.4g s wall (shares: of the wall time)", wall_seconds);
  dt__prof_put(buf, cap, &len, "\n  %-28s %-8s %10s %11s %11s %7s\n", "op", "phase", "calls", "total ms",
               steps > 0 ? "us/step" : "", "share");
  for (int i = 0; i < n; i++) {
    char per[32] = "";
    if (steps > 0) snprintf(per, sizeof per, "%.1f", e[i].seconds * 1e6 / (double)steps);
    dt__prof_put(buf, cap, &len, "  %-28s %-8s %10lld %11.2f %11s %6.1f%%\n", e[i].name,
                 dt_profile_phase_name(e[i].phase), (long long)e[i].calls, e[i].seconds * 1e3, per,
                 base > 0 ? 100.0 * e[i].seconds / base : 0.0);
  }
  dt__prof_put(buf, cap, &len, "  by phase:");
  for (int p = 0; p < DT__PROF_PHASES; p++)
    if (phase[p] > 0)
      dt__prof_put(buf, cap, &len, " %s %.1f%%", dt_profile_phase_name((dt_profile_phase)p),
                   base > 0 ? 100.0 * phase[p] / base : 0.0);
  if (wall_seconds > 0)
    dt__prof_put(buf, cap, &len, "; in no op (the caller's code, waits, idle threads) %.1f%%",
                 wall_seconds > sum ? 100.0 * (wall_seconds - sum) / wall_seconds : 0.0);
  dt__prof_put(buf, cap, &len, "\n");
  int64_t dropped = DT__ALOAD(&dt__prof_dropped, DT__MO_RELAXED);
  if (dropped)
    dt__prof_put(buf, cap, &len, "  (%lld charges not counted: more than %d op kinds)\n", (long long)dropped,
                 DT__PROF_SLOTS);
  return (int64_t)len;
}

/* ---- timelines: every thread's spans as Chrome trace-event JSON ---------------------------
 * See dt_trace_start in dt_base.h. The spans come from the profile's hooks
 * (above: each op's forward pieces, each tape node's backward, the
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
 * the monotonic and of the calendar clock taken together, and (clocks) the
 * handshakes' estimates of each peer's monotonic clock against ours, from
 * which tools/dtrain-trace merge puts the files of several processes on one
 * axis.
 * It is written through dt__file_create/commit: a failed write (a full disk)
 * is an error and leaves whatever was at the path. */

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
static double dt__trace_read0; /* that reading's error bound (s): the monotonic bracket around it */
#endif
static DT__ATOMIC(int) dt__trace_env_done;

/* the handshakes' clock estimates (dt__trace_clock_note), under dt__trace_mu;
 * kept across trace sessions (connections outlive them) */
#define DT__TRACE_CLOCKS 128
typedef struct dt__trace_clock {
  int server, index;
  double offset, delay;
} dt__trace_clock;
static dt__trace_clock dt__trace_clocks[DT__TRACE_CLOCKS];
static int dt__trace_nclocks, dt__trace_clocks_lost;

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
  int64_t t1 = dt__prof_now();
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

/* The slot of that peer's estimate, or dt__trace_nclocks if it has none (under dt__trace_mu). */
static int dt__trace_clock_find(int server, int index) {
  int k = 0;
  while (k < dt__trace_nclocks && (dt__trace_clocks[k].server != !!server || dt__trace_clocks[k].index != index)) k++;
  return k;
}

DTRAIN_PRIVATE void dt__trace_clock_note(int server, int index, double offset_s, double delay_s) {
  if (!(offset_s == offset_s) || !(delay_s >= 0) || offset_s > 1e9 || offset_s < -1e9 || delay_s > 1e9) return;
  dt__trace_lock();
  int k = dt__trace_clock_find(server, index);
  if (k == dt__trace_nclocks) {
    if (k == DT__TRACE_CLOCKS) {
      dt__trace_clocks_lost++;
      dt__trace_unlock();
      return;
    }
    dt__trace_nclocks++;
    dt__trace_clocks[k].server = !!server;
    dt__trace_clocks[k].index = index;
    dt__trace_clocks[k].delay = -1;
  }
  if (dt__trace_clocks[k].delay < 0 || delay_s < dt__trace_clocks[k].delay) {
    dt__trace_clocks[k].offset = offset_s;
    dt__trace_clocks[k].delay = delay_s;
  }
  dt__trace_unlock();
}

DTRAIN_PRIVATE int dt__trace_clock_get(int server, int index, double *offset_s, double *delay_s) {
  dt__trace_lock();
  int k = dt__trace_clock_find(server, index);
  int found = k < dt__trace_nclocks;
  if (found) *offset_s = dt__trace_clocks[k].offset, *delay_s = dt__trace_clocks[k].delay;
  dt__trace_unlock();
  return found;
}

#ifndef DTRAIN_NO_STDIO
/* the trace's bit on or off (the writer below is its only switch) */
static void dt__prof_set_tracing(int on) {
  if (on) DT__AFETCH_ADD(&dt__prof_gen, 1u, DT__MO_RELAXED); /* marks from before are worthless */
  dt__prof_bit(DT__PROF_TRACE, on);
}


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
  /* The calendar clock read between two monotonic readings; a thread
   * preempted in between (a loaded machine) widens the bracket, so the
   * tightest of a few tries is kept and its half width written with it. */
  dt__trace_read0 = 1e30;
  for (int k = 0; k < 8 && dt__trace_read0 > 2e-6; k++) {
    double a = dt_time_now(), r = dt__trace_realtime(), b = dt_time_now();
    if (0.5 * (b - a) < dt__trace_read0) {
      dt__trace_mono0 = 0.5 * (a + b);
      dt__trace_real0 = r;
      dt__trace_read0 = 0.5 * (b - a);
    }
  }
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
          "\"realtime_us\": %.3f, \"clock_read_us\": %.3f, \"clocks\": [",
          dt__trace_index, pid, (long long)events, (long long)DT__ALOAD(&dt__trace_dropped, DT__MO_RELAXED),
          dt__trace_mono0 * 1e6, dt__trace_real0 * 1e6, dt__trace_read0 * 1e6);
  for (int k = 0; k < dt__trace_nclocks; k++)
    fprintf(f, "%s{\"role\": \"%s\", \"index\": %d, \"offset_us\": %.3f, \"delay_us\": %.3f}", k ? ", " : "",
            dt__trace_clocks[k].server ? "server" : "worker", dt__trace_clocks[k].index, dt__trace_clocks[k].offset * 1e6,
            dt__trace_clocks[k].delay * 1e6);
  fprintf(f, "], \"clocks_lost\": %d}\n}\n", dt__trace_clocks_lost);
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
