/* ===========================================================================
 * dt_profile.c -- the per-op profile: where a training step's time goes
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
 * The same hooks feed the timeline (dt_trace.c) while a trace runs: each
 * piece of time charged becomes a span of the thread's timeline too. The
 * two are switched by separate bits of one word (dt__prof_on: 1 profile,
 * 2 trace), so with both off (the default) each hook is one relaxed load
 * and a return. */
#include "dt_internal.h"
#include "dt_platform.h"

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

DTRAIN_PRIVATE void dt__prof_set_tracing(int on) {
  if (on) DT__AFETCH_ADD(&dt__prof_gen, 1u, DT__MO_RELAXED); /* marks from before are worthless */
  dt__prof_bit(DT__PROF_TRACE, on);
}

DTRAIN_PRIVATE int64_t dt__prof_now_ns(void) { return dt__prof_now(); }

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
