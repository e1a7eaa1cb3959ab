/* ===========================================================================
 * dt_platform.c -- threads, events, the breakable barrier, the thread pool
 * ===========================================================================
 * See dt_platform.h. POSIX threads; without threads (DTRAIN_NO_THREADS) the
 * primitives degrade to what a single thread needs.
 */
#include "dt_internal.h"
#include "dt_platform.h"

#if !defined(_WIN32)
#  include <errno.h>
#  include <sched.h>
#  include <unistd.h>
#  if defined(DT__POSIX_LATE) /* <time.h> before dtrain.h in strict ISO mode (dt_base.h) */
extern int nanosleep(const struct timespec *req, struct timespec *rem);
#  endif
#endif
#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#  define DT__FP_X86 1
#  include <xmmintrin.h>
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#  define DT__FP_ARM64 1
#endif

/* ---- time ------------------------------------------------------------------------ */

/* The library's deadlines and the public dt_time_now read one clock, so a
 * time a user measured can be compared with the library's. */
DTRAIN_PRIVATE double dt__now(void) { return dt_time_now(); }

DTRAIN_PRIVATE double dt__thread_cpu_s(void) {
#if defined(_WIN32)
  FILETIME c, e, k, u;
  if (!GetThreadTimes(GetCurrentThread(), &c, &e, &k, &u)) return -1.0;
  return ((double)(((uint64_t)k.dwHighDateTime << 32) | k.dwLowDateTime) +
          (double)(((uint64_t)u.dwHighDateTime << 32) | u.dwLowDateTime)) * 1e-7; /* 100 ns units */
#elif defined(CLOCK_THREAD_CPUTIME_ID)
  struct timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return -1.0;
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#else
  return -1.0;
#endif
}

DTRAIN_PRIVATE void dt__sleep(double seconds) {
  if (!(seconds > 0.0)) return;
#if !defined(_WIN32)
  struct timespec ts;
  ts.tv_sec = (time_t)seconds;
  ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
#else /* Windows: Sleep (whole milliseconds, at the scheduler's tick), the last one yielding */
  double end = dt__now() + seconds, left;
  while ((left = end - dt__now()) > 0.0) {
    if (left > 0.002) Sleep((DWORD)((left - 0.001) * 1000.0));
    else if (!SwitchToThread()) dt__cpu_relax();
  }
#endif
}

DTRAIN_PRIVATE int dt__cpu_count(void) {
#if defined(_WIN32)
  DWORD n = GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
  if (n >= 1 && n < 65536) return (int)n;
#elif defined(_SC_NPROCESSORS_ONLN)
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n >= 1 && n < 65536) return (int)n;
#endif
  return 1;
}

DTRAIN_PRIVATE double dt__spin_seconds(int spin_us, int nthreads) {
  if (spin_us < 0) return 0.0;
  if (spin_us > 0) return (double)spin_us * 1e-6;
  return nthreads <= dt__cpu_count() ? 50e-6 : 0.5e-6;
}

/* ---- mutex, condvar, thread ------------------------------------------------------ */

#if !defined(DTRAIN_NO_THREADS)

DTRAIN_PRIVATE dt_result dt__mutex_init(dt__mutex *m) {
  int rc = pthread_mutex_init(&m->m, NULL);
  return rc == 0 ? DTRAIN_OK : dt__error(DTRAIN_ERR_THREAD, "pthread_mutex_init failed (error %d)", rc);
}
DTRAIN_PRIVATE void dt__mutex_destroy(dt__mutex *m) { pthread_mutex_destroy(&m->m); }
DTRAIN_PRIVATE void dt__mutex_lock(dt__mutex *m) { pthread_mutex_lock(&m->m); }
DTRAIN_PRIVATE void dt__mutex_unlock(dt__mutex *m) { pthread_mutex_unlock(&m->m); }

DTRAIN_PRIVATE dt_result dt__cond_init(dt__cond *c) {
  int rc = pthread_cond_init(&c->c, NULL);
  return rc == 0 ? DTRAIN_OK : dt__error(DTRAIN_ERR_THREAD, "pthread_cond_init failed (error %d)", rc);
}
DTRAIN_PRIVATE void dt__cond_destroy(dt__cond *c) { pthread_cond_destroy(&c->c); }
DTRAIN_PRIVATE void dt__cond_wait(dt__cond *c, dt__mutex *m) { pthread_cond_wait(&c->c, &m->m); }
DTRAIN_PRIVATE void dt__cond_broadcast(dt__cond *c) { pthread_cond_broadcast(&c->c); }

typedef struct dt__platform_start {
  dt__thread_fn fn;
  void *arg;
} dt__platform_start;

#define DT__THREAD_STACK ((size_t)2 << 20) /* at least 2 MiB per worker thread */

static void *dt__platform_trampoline(void *p) {
  dt__platform_start s = *(dt__platform_start *)p;
  dt__free(p, sizeof(dt__platform_start));
  s.fn(s.arg);
  return NULL;
}

DTRAIN_PRIVATE dt_result dt__thread_start(dt__thread *t, dt__thread_fn fn, void *arg) {
  t->started = 0;
  dt__platform_start *s = (dt__platform_start *)dt__alloc(sizeof *s);
  if (!s) return dt__error(DTRAIN_ERR_NOMEM, "thread start: out of memory");
  s->fn = fn;
  s->arg = arg;
  /* An explicit stack: dt_sgemm keeps its packed panels (~320 KiB) on the
   * stack when it gets no scratch slot (dt_gemm.c), more than some libcs
   * give a thread by default (musl: 128 KiB). */
  pthread_attr_t attr;
  int rc = pthread_attr_init(&attr);
  if (rc == 0) {
    size_t have = 0;
    if (pthread_attr_getstacksize(&attr, &have) != 0 || have < DT__THREAD_STACK)
      rc = pthread_attr_setstacksize(&attr, DT__THREAD_STACK);
    if (rc == 0) rc = pthread_create(&t->t, &attr, dt__platform_trampoline, s);
    pthread_attr_destroy(&attr);
  }
  if (rc != 0) {
    dt__free(s, sizeof *s);
    return dt__error(DTRAIN_ERR_THREAD, "pthread_create failed (error %d)", rc);
  }
  t->started = 1;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__thread_join(dt__thread *t) {
  if (t->started) pthread_join(t->t, NULL);
  t->started = 0;
}

#else /* DTRAIN_NO_THREADS */

DTRAIN_PRIVATE dt_result dt__mutex_init(dt__mutex *m) { m->unused = 0; return DTRAIN_OK; }
DTRAIN_PRIVATE void dt__mutex_destroy(dt__mutex *m) { (void)m; }
DTRAIN_PRIVATE void dt__mutex_lock(dt__mutex *m) { (void)m; }
DTRAIN_PRIVATE void dt__mutex_unlock(dt__mutex *m) { (void)m; }
DTRAIN_PRIVATE dt_result dt__cond_init(dt__cond *c) { c->unused = 0; return DTRAIN_OK; }
DTRAIN_PRIVATE void dt__cond_destroy(dt__cond *c) { (void)c; }
DTRAIN_PRIVATE void dt__cond_wait(dt__cond *c, dt__mutex *m) { (void)c; (void)m; }
DTRAIN_PRIVATE void dt__cond_broadcast(dt__cond *c) { (void)c; }
DTRAIN_PRIVATE dt_result dt__thread_start(dt__thread *t, dt__thread_fn fn, void *arg) {
  (void)fn; (void)arg;
  t->started = 0;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "threads are not available (built with DTRAIN_NO_THREADS)");
}
DTRAIN_PRIVATE void dt__thread_join(dt__thread *t) { t->started = 0; }

#endif

/* ---- events ------------------------------------------------------------------------ */

DTRAIN_PRIVATE dt_result dt__event_init(dt__event *e) {
  DT__ASTORE(&e->sleepers, 0, DT__MO_RELAXED);
  dt_result r = dt__mutex_init(&e->m);
  if (r != DTRAIN_OK) return r;
  r = dt__cond_init(&e->c);
  if (r != DTRAIN_OK) dt__mutex_destroy(&e->m);
  return r;
}

DTRAIN_PRIVATE void dt__event_destroy(dt__event *e) {
  dt__cond_destroy(&e->c);
  dt__mutex_destroy(&e->m);
}

DTRAIN_PRIVATE void dt__event_notify(dt__event *e) {
  /* Pairs with the sleeper's seq_cst increment of `sleepers` followed by its
   * seq_cst re-check of the condition: one of the two sees the other. */
  if (DT__ALOAD(&e->sleepers, DT__MO_SEQ_CST) > 0) {
    dt__mutex_lock(&e->m);
    dt__cond_broadcast(&e->c);
    dt__mutex_unlock(&e->m);
  }
}

DTRAIN_PRIVATE double dt__event_wait(dt__event *e, dt__pred_fn pred, void *arg, double spin_s) {
  if (pred(arg)) return 0.0;
  double t0 = dt__now(), t;
  for (;;) {
    for (int k = 0; k < 32; k++) {
      dt__cpu_relax();
      if (pred(arg)) return dt__now() - t0;
    }
    t = dt__now() - t0;
    if (t >= spin_s) break;
    /* After a couple of microseconds of pure spinning, offer the core to
     * whoever else is runnable on it (perhaps the thread we wait for). */
#if !defined(DTRAIN_NO_THREADS) && defined(_WIN32)
    if (t > 2e-6) SwitchToThread();
#elif !defined(DTRAIN_NO_THREADS)
    if (t > 2e-6) sched_yield();
#endif
  }
#if !defined(DTRAIN_NO_THREADS)
  dt__mutex_lock(&e->m);
  DT__AFETCH_ADD(&e->sleepers, 1, DT__MO_SEQ_CST);
  while (!pred(arg)) dt__cond_wait(&e->c, &e->m);
  DT__AFETCH_SUB(&e->sleepers, 1, DT__MO_SEQ_CST);
  dt__mutex_unlock(&e->m);
#else
  (void)e; /* one thread: nobody else can make pred true */
#endif
  return dt__now() - t0;
}

/* ---- barrier -------------------------------------------------------------------------- */

DTRAIN_PRIVATE dt_result dt__barrier_init(dt__barrier *b, int n, double spin_s) {
  DT__ASTORE(&b->count, 0, DT__MO_RELAXED);
  DT__ASTORE(&b->phase, 0u, DT__MO_RELAXED);
  DT__ASTORE(&b->broken, 0, DT__MO_RELAXED);
  b->n = n;
  b->spin_s = spin_s;
  return dt__event_init(&b->ev);
}

DTRAIN_PRIVATE void dt__barrier_destroy(dt__barrier *b) { dt__event_destroy(&b->ev); }

typedef struct dt__platform_bwait {
  dt__barrier *b;
  unsigned phase;
} dt__platform_bwait;

static int dt__platform_barrier_open(void *arg) {
  dt__platform_bwait *w = (dt__platform_bwait *)arg;
  return DT__ALOAD(&w->b->phase, DT__MO_SEQ_CST) != w->phase || DT__ALOAD(&w->b->broken, DT__MO_SEQ_CST);
}

DTRAIN_PRIVATE dt_result dt__barrier_wait(dt__barrier *b, double *waited) {
  if (waited) *waited = 0.0;
  if (DT__ALOAD(&b->broken, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  if (b->n <= 1) return DTRAIN_OK;
  /* The phase must be read before arriving: once we count, the last thread
   * may bump it at any moment. */
  dt__platform_bwait w;
  w.b = b;
  w.phase = DT__ALOAD(&b->phase, DT__MO_ACQUIRE);
  if (DT__AFETCH_ADD(&b->count, 1, DT__MO_ACQ_REL) + 1 == b->n) {
    /* Last to arrive: reset the count for the next phase, then open. The
     * waiters acquire the phase, so they see the count at 0 when they come
     * back for the next phase. */
    DT__ASTORE(&b->count, 0, DT__MO_RELAXED);
    DT__ASTORE(&b->phase, w.phase + 1u, DT__MO_SEQ_CST);
    dt__event_notify(&b->ev);
    return DT__ALOAD(&b->broken, DT__MO_ACQUIRE) ? DTRAIN_ERR_ABORTED : DTRAIN_OK;
  }
  double t = dt__event_wait(&b->ev, dt__platform_barrier_open, &w, b->spin_s);
  if (waited) *waited = t;
  /* Broken wins even when the phase also moved: a failed replica's partners
   * must not go on with half a collective. */
  return DT__ALOAD(&b->broken, DT__MO_ACQUIRE) ? DTRAIN_ERR_ABORTED : DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__barrier_break(dt__barrier *b) {
  DT__ASTORE(&b->broken, 1, DT__MO_SEQ_CST);
  dt__event_notify(&b->ev);
}


DTRAIN_PRIVATE void dt__barrier_reset(dt__barrier *b) {
  DT__ASTORE(&b->count, 0, DT__MO_RELAXED);
  DT__ASTORE(&b->broken, 0, DT__MO_SEQ_CST);
}

/* ---- thread pool ------------------------------------------------------------------------ */

typedef struct dt__platform_worker {
  dt__pool *pool;
  int index;
  dt__thread thread;
} dt__platform_worker;

struct dt__pool {
  int n;
  double spin_s;
  dt__platform_worker *workers; /* n - 1 */
  dt__event start, done;
  DT__ATOMIC(uint64_t) gen;      /* job generation: bumped to start a job */
  DT__ATOMIC(int) pending;       /* workers still running the current job */
  DT__ATOMIC(int) stop;
  dt__pool_fn fn;                /* the job: written before gen is bumped */
  void *arg;
};

typedef struct dt__platform_gwait {
  dt__pool *p;
  uint64_t seen;
} dt__platform_gwait;

static int dt__platform_pool_started(void *arg) {
  dt__platform_gwait *w = (dt__platform_gwait *)arg;
  return DT__ALOAD(&w->p->gen, DT__MO_SEQ_CST) != w->seen || DT__ALOAD(&w->p->stop, DT__MO_SEQ_CST);
}

static int dt__platform_pool_done(void *arg) {
  dt__pool *p = (dt__pool *)arg;
  return DT__ALOAD(&p->pending, DT__MO_SEQ_CST) == 0;
}

static void dt__platform_pool_main(void *arg) {
  dt__platform_worker *w = (dt__platform_worker *)arg;
  dt__pool *p = w->pool;
  dt__platform_gwait gw;
  gw.p = p;
  gw.seen = 0;
  for (;;) {
    dt__event_wait(&p->start, dt__platform_pool_started, &gw, p->spin_s);
    if (DT__ALOAD(&p->stop, DT__MO_ACQUIRE)) return;
    gw.seen = DT__ALOAD(&p->gen, DT__MO_ACQUIRE);
    unsigned long fp = dt__fp_enter();
    p->fn(p->arg, w->index);
    dt__fp_leave(fp);
    if (DT__AFETCH_SUB(&p->pending, 1, DT__MO_SEQ_CST) == 1) dt__event_notify(&p->done);
  }
}

DTRAIN_PRIVATE dt__pool *dt__pool_create(int n, double spin_s) {
  if (n < 1) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "thread pool: %d participants (need >= 1)", n);
    return NULL;
  }
#if defined(DTRAIN_NO_THREADS)
  if (n > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED, "thread pool of %d: threads are not available (built with DTRAIN_NO_THREADS)", n);
    return NULL;
  }
#endif
  dt__pool *p = (dt__pool *)dt__calloc(sizeof *p);
  if (!p) {
    dt__error(DTRAIN_ERR_NOMEM, "thread pool: out of memory");
    return NULL;
  }
  p->n = n;
  p->spin_s = spin_s;
  DT__ASTORE(&p->gen, (uint64_t)0, DT__MO_RELAXED);
  DT__ASTORE(&p->pending, 0, DT__MO_RELAXED);
  DT__ASTORE(&p->stop, 0, DT__MO_RELAXED);
  if (dt__event_init(&p->start) != DTRAIN_OK) {
    dt__free(p, sizeof *p);
    return NULL;
  }
  if (dt__event_init(&p->done) != DTRAIN_OK) {
    dt__event_destroy(&p->start);
    dt__free(p, sizeof *p);
    return NULL;
  }
  if (n > 1) {
    p->workers = (dt__platform_worker *)dt__calloc((size_t)(n - 1) * sizeof(dt__platform_worker));
    if (!p->workers) {
      dt__error(DTRAIN_ERR_NOMEM, "thread pool: out of memory");
      dt__pool_destroy(p);
      return NULL;
    }
    for (int i = 0; i < n - 1; i++) {
      p->workers[i].pool = p;
      p->workers[i].index = i + 1;
      if (dt__thread_start(&p->workers[i].thread, dt__platform_pool_main, &p->workers[i]) != DTRAIN_OK) {
        dt__pool_destroy(p); /* joins the ones that started */
        return NULL;
      }
    }
  }
  return p;
}

DTRAIN_PRIVATE void dt__pool_destroy(dt__pool *p) {
  if (!p) return;
  if (p->workers) {
    DT__ASTORE(&p->stop, 1, DT__MO_SEQ_CST);
    dt__event_notify(&p->start);
    for (int i = 0; i < p->n - 1; i++) dt__thread_join(&p->workers[i].thread);
    dt__free(p->workers, (size_t)(p->n - 1) * sizeof(dt__platform_worker));
  }
  dt__event_destroy(&p->done);
  dt__event_destroy(&p->start);
  dt__free(p, sizeof *p);
}

DTRAIN_PRIVATE void dt__pool_run(dt__pool *p, dt__pool_fn fn, void *arg) {
  unsigned long fp = dt__fp_enter();
  if (p->n == 1) {
    fn(arg, 0);
    dt__fp_leave(fp);
    return;
  }
  p->fn = fn;
  p->arg = arg;
  DT__ASTORE(&p->pending, p->n - 1, DT__MO_RELAXED);
  /* Publishes fn, arg and pending to the workers, which acquire gen. */
  DT__AFETCH_ADD(&p->gen, (uint64_t)1, DT__MO_SEQ_CST);
  dt__event_notify(&p->start);
  fn(arg, 0);
  dt__event_wait(&p->done, dt__platform_pool_done, p, p->spin_s);
  dt__fp_leave(fp);
}

DTRAIN_PRIVATE int dt__pool_size(const dt__pool *p) { return p ? p->n : 0; }
#undef DT__THREAD_STACK

/* ---- intra-op threads ---------------------------------------------------------------------
 * One pool for the whole process, used by one kernel at a time: `busy` is a
 * try-lock (0 -> 1 by compare-and-swap) that owns `par_pool`. A caller that
 * does not get it runs its parts alone. `want` is the setting: 0 until
 * DTRAIN_THREADS is read (or dt_set_threads stores one). */
static DT__ATOMIC(int) dt__platform_par_want = 0;
static DT__ATOMIC(int) dt__platform_par_busy = 0;
static dt__pool *dt__platform_par_pool = NULL; /* owned by whoever holds busy */
static DT__TLS int dt__platform_par_replica = 0;

#define DT__PAR_MAX 256

static int dt__platform_par_clamp(int n) {
#if defined(DTRAIN_NO_THREADS)
  (void)n;
  return 1;
#else
  if (n == 0) n = dt__cpu_count();
  if (n < 1) n = 1;
  return n > DT__PAR_MAX ? DT__PAR_MAX : n;
#endif
}

static int dt__platform_par_want_get(void) {
  int w = DT__ALOAD(&dt__platform_par_want, DT__MO_ACQUIRE);
  if (w > 0) return w;
  int v = 1;
  const char *e = getenv("DTRAIN_THREADS");
  if (e && *e) {
    if (strcmp(e, "auto") == 0) {
      v = dt__platform_par_clamp(0);
    } else {
      char *end = NULL;
      long x = strtol(e, &end, 10);
      if (end && *end == '\0' && x >= 0 && x <= DT__PAR_MAX) v = dt__platform_par_clamp((int)x);
      else dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_INVALID_ARG, "DTRAIN_THREADS=\"%.40s\" is not a number: using 1", e);
    }
  }
  int expect = 0; /* a concurrent dt_set_threads wins */
  if (!DT__ACAS(&dt__platform_par_want, &expect, v, DT__MO_ACQ_REL)) return expect;
  return v;
}

static int dt__platform_par_try_lock(void) {
  int expect = 0;
  return DT__ACAS(&dt__platform_par_busy, &expect, 1, DT__MO_ACQUIRE);
}

static void dt__platform_par_unlock(void) { DT__ASTORE(&dt__platform_par_busy, 0, DT__MO_RELEASE); }

#if !defined(DTRAIN_NO_THREADS) && !defined(_WIN32)
/* A child of fork() has none of the pool's threads: it forgets the pool
 * (without touching it) and starts its own at its first parallel kernel. */
static void dt__platform_par_atfork_child(void) {
  dt__platform_par_pool = NULL;
  DT__ASTORE(&dt__platform_par_busy, 0, DT__MO_RELAXED);
}
static DT__ATOMIC(int) dt__platform_par_atfork_set = 0;
#endif

DTRAIN_PRIVATE int dt__par_set_replica(int on) {
  int prev = dt__platform_par_replica;
  dt__platform_par_replica = on ? 1 : 0;
  return prev;
}

DTRAIN_PRIVATE int dt__par_threads(void) {
  if (dt__platform_par_replica) return 1;
  return dt__platform_par_want_get(); /* 1 without threads */
}

typedef struct dt__platform_par_job {
  dt__par_fn fn;
  void *arg;
  int nparts, nthreads;
} dt__platform_par_job;

static void dt__platform_par_main(void *arg, int index) {
  dt__platform_par_job *j = (dt__platform_par_job *)arg;
  for (int part = index; part < j->nparts; part += j->nthreads) j->fn(j->arg, part, j->nparts);
}

DTRAIN_PRIVATE void dt__par_run(int nparts, dt__par_fn fn, void *arg) {
  if (nparts <= 0) return;
  int want = dt__par_threads();
  if (nparts == 1 || want <= 1 || !dt__platform_par_try_lock()) {
    for (int part = 0; part < nparts; part++) fn(arg, part, nparts);
    return;
  }
  dt__pool *p = dt__platform_par_pool;
  if (p && dt__pool_size(p) != want) { /* the setting changed: rebuild */
    dt__pool_destroy(p);
    p = NULL;
  }
  if (!p) {
#if !defined(DTRAIN_NO_THREADS) && !defined(_WIN32)
    int expect = 0; /* under busy: one registration per process */
    if (DT__ACAS(&dt__platform_par_atfork_set, &expect, 1, DT__MO_RELAXED))
      pthread_atfork(NULL, NULL, dt__platform_par_atfork_child);
#endif
    p = dt__pool_create(want, dt__spin_seconds(0, want));
    if (!p)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_THREAD, "intra-op threads: could not start %d threads; running on one",
              want);
  }
  dt__platform_par_pool = p;
  if (!p) {
    /* Not retried on every call: one thread from now on. */
    DT__ASTORE(&dt__platform_par_want, 1, DT__MO_RELEASE);
    dt__platform_par_unlock();
    for (int part = 0; part < nparts; part++) fn(arg, part, nparts);
    return;
  }
  dt__platform_par_job j;
  j.fn = fn;
  j.arg = arg;
  j.nparts = nparts;
  j.nthreads = dt__pool_size(p);
  dt__pool_run(p, dt__platform_par_main, &j);
  dt__platform_par_unlock();
}

DTRAIN_API dt_result dt_set_threads(int n) {
  if (n < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_set_threads: %d threads (need >= 0)", n);
#if defined(DTRAIN_NO_THREADS)
  DT__ASTORE(&dt__platform_par_want, 1, DT__MO_RELEASE);
  if (n > 1)
    return dt__error(DTRAIN_ERR_UNSUPPORTED,
                     "dt_set_threads(%d): threads are not available (built with DTRAIN_NO_THREADS)", n);
  return DTRAIN_OK;
#else
  int v = dt__platform_par_clamp(n);
  /* Take the pool from whoever runs on it (they finish their kernel). */
  while (!dt__platform_par_try_lock()) dt__sleep(20e-6);
  DT__ASTORE(&dt__platform_par_want, v, DT__MO_RELEASE);
  if (dt__platform_par_pool && dt__pool_size(dt__platform_par_pool) != v) {
    dt__pool_destroy(dt__platform_par_pool); /* joins its threads */
    dt__platform_par_pool = NULL;
  }
  dt__platform_par_unlock();
  return DTRAIN_OK;
#endif
}

DTRAIN_API int dt_get_threads(void) { return dt__platform_par_want_get(); }
#undef DT__PAR_MAX

/* ---- subnormal floats (see dt_internal.h) ---------------------------------------------- */
static DT__ATOMIC(int) dt__platform_ftz = -1; /* -1: DTRAIN_FLUSH_DENORMALS not read yet */

DTRAIN_API int dt_get_flush_denormals(void) {
  int v = DT__ALOAD(&dt__platform_ftz, DT__MO_RELAXED);
  if (v >= 0) return v;
  const char *e = getenv("DTRAIN_FLUSH_DENORMALS");
  v = 1;
  if (e && *e) {
    if (!strcmp(e, "0")) v = 0;
    else if (strcmp(e, "1"))
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_INVALID_ARG, "DTRAIN_FLUSH_DENORMALS=\"%.40s\" is not 0 or 1: using 1", e);
  }
  int expect = -1; /* a concurrent dt_set_flush_denormals wins */
  if (!DT__ACAS(&dt__platform_ftz, &expect, v, DT__MO_RELAXED)) return expect;
  return v;
}

DTRAIN_API int dt_set_flush_denormals(int on) {
  int was = dt_get_flush_denormals();
  DT__ASTORE(&dt__platform_ftz, on ? 1 : 0, DT__MO_RELAXED);
  return was;
}

/* FTZ (bit 15: results) and DAZ (bit 6: operands) on x86; FZ (bit 24) on AArch64. */
DTRAIN_PRIVATE unsigned long dt__fp_enter(void) {
#if defined(DT__FP_X86)
  unsigned int old = _mm_getcsr();
  if (dt_get_flush_denormals() && (old & 0x8040u) != 0x8040u) _mm_setcsr(old | 0x8040u);
  return old;
#elif defined(DT__FP_ARM64)
  unsigned long old;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
  if (dt_get_flush_denormals() && !(old & (1ul << 24))) {
    unsigned long want = old | (1ul << 24);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(want));
  }
  return old;
#else
  return 0;
#endif
}

DTRAIN_PRIVATE void dt__fp_leave(unsigned long saved) {
#if defined(DT__FP_X86)
  if (_mm_getcsr() != (unsigned int)saved) _mm_setcsr((unsigned int)saved);
#elif defined(DT__FP_ARM64)
  unsigned long now;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(now));
  if (now != saved) __asm__ __volatile__("msr fpcr, %0" : : "r"(saved));
#else
  (void)saved;
#endif
}

/* dt__par_range: [0, n) cut at multiples of grain into one run per thread. */
typedef struct dt__par_range_job {
  dt__par_range_fn fn;
  void *arg;
  int64_t n, grain;
} dt__par_range_job;

static void dt__par_range_part(void *arg, int part, int nparts) {
  const dt__par_range_job *j = (const dt__par_range_job *)arg;
  int64_t blocks = (j->n + j->grain - 1) / j->grain;
  int64_t lo = blocks * part / nparts * j->grain, hi = blocks * (part + 1) / nparts * j->grain;
  if (hi > j->n) hi = j->n;
  if (lo < hi) j->fn(j->arg, lo, hi);
}

DTRAIN_PRIVATE void dt__par_range(int64_t n, int64_t grain, int64_t min_n, dt__par_range_fn fn, void *arg) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int t = dt__par_threads();
  int64_t blocks = (n + grain - 1) / grain;
  if (t <= 1 || n < min_n || blocks < 2) {
    fn(arg, 0, n);
    return;
  }
  dt__par_range_job j;
  j.fn = fn;
  j.arg = arg;
  j.n = n;
  j.grain = grain;
  dt__par_run((int)(blocks < t ? blocks : t), dt__par_range_part, &j);
}

/* ---- float vectors ------------------------------------------------------------------------
 * dt__vec_add_finite and dt__vec_add (dt_internal.h), one loop: AVX picked
 * at run time on x86-64 (a function attribute, so a plain -O2 build uses it
 * where the CPU has it), SSE and NEON always, plain C under DTRAIN_NO_SIMD. */
#if !defined(DTRAIN_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__PLATFORM_X86 1
#  include <immintrin.h>
#elif !defined(DTRAIN_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
#  define DT__PLATFORM_NEON 1
#  include <arm_neon.h>
#endif

#ifdef DT__PLATFORM_X86
/* The sums of dt__vec_add_finite, and whether each is finite: a sum's
 * exponent bits alone (sign and mantissa masked off) are +0, a power of two
 * or, for an infinite or NaN sum, +Inf; their maximum is +Inf exactly when
 * one was. Masks, a maximum and one integer compare of the bits at the end
 * (no lane taken out alone: tools/check_codegen.sh): nothing a -ffast-math
 * build could fold away. */
static int dt__exp_bits_finite4(__m128 mx) {
  __m128i inf = _mm_cmpeq_epi32(_mm_castps_si128(mx), _mm_set1_epi32(0x7f800000));
  return _mm_movemask_epi8(inf) == 0;
}

__attribute__((target("avx"))) static size_t dt__vec_add_finite_avx(float *dst, const float *a, const float *b, size_t n,
                                                                   int *finite) {
  size_t i = 0;
  const __m256 em = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  __m256 mx = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8));
    __m256 x2 = _mm256_add_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16));
    __m256 x3 = _mm256_add_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24));
    _mm256_storeu_ps(dst + i, x0);
    _mm256_storeu_ps(dst + i + 8, x1);
    _mm256_storeu_ps(dst + i + 16, x2);
    _mm256_storeu_ps(dst + i + 24, x3);
    __m256 m01 = _mm256_max_ps(_mm256_and_ps(x0, em), _mm256_and_ps(x1, em));
    __m256 m23 = _mm256_max_ps(_mm256_and_ps(x2, em), _mm256_and_ps(x3, em));
    mx = _mm256_max_ps(mx, _mm256_max_ps(m01, m23));
  }
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(dst + i, x);
    mx = _mm256_max_ps(mx, _mm256_and_ps(x, em));
  }
  *finite = dt__exp_bits_finite4(_mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1)));
  return i;
}
#endif

DTRAIN_PRIVATE int dt__vec_add_finite(float *dst, const float *a, const float *b, size_t n) {
  size_t i = 0;
  int finite = 1;
#if defined(DT__PLATFORM_X86)
  if (n >= 16 && __builtin_cpu_supports("avx")) i = dt__vec_add_finite_avx(dst, a, b, n, &finite);
  if (i + 4 <= n) {
    const __m128 em = _mm_castsi128_ps(_mm_set1_epi32(0x7f800000));
    __m128 mx = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4) {
      __m128 x = _mm_add_ps(_mm_loadu_ps(a + i), _mm_loadu_ps(b + i));
      _mm_storeu_ps(dst + i, x);
      mx = _mm_max_ps(mx, _mm_and_ps(x, em));
    }
    finite &= dt__exp_bits_finite4(mx);
  }
#elif defined(DT__PLATFORM_NEON)
  if (i + 4 <= n) {
    const uint32x4_t em = vdupq_n_u32(0x7f800000u);
    uint32x4_t mx = vdupq_n_u32(0);
    for (; i + 4 <= n; i += 4) {
      float32x4_t x = vaddq_f32(vld1q_f32(a + i), vld1q_f32(b + i));
      vst1q_f32(dst + i, x);
      mx = vmaxq_u32(mx, vandq_u32(vreinterpretq_u32_f32(x), em)); /* the bits as unsigned: the same order */
    }
    finite &= vmaxvq_u32(mx) != 0x7f800000u;
  }
#endif
  for (; i < n; i++) {
    dst[i] = a[i] + b[i];
    uint32_t u;
    memcpy(&u, dst + i, sizeof u);
    finite &= (u & 0x7f800000u) != 0x7f800000u;
  }
  return finite;
}

/* The check is an AND and a maximum a vector in a loop bound by its loads
 * and stores: the plain sum runs the same loop. */
DTRAIN_PRIVATE void dt__vec_add(float *dst, const float *a, const float *b, size_t n) {
  (void)dt__vec_add_finite(dst, a, b, n);
}

#ifdef DT__PLATFORM_X86
__attribute__((target("avx"))) static size_t dt__vec_add_scale_avx(float *dst, const float *a, const float *b,
                                                                  float scale, size_t n) {
  size_t i = 0;
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    __m256 x0 = _mm256_loadu_ps(a + i), x1 = _mm256_loadu_ps(a + i + 8);
    if (b) {
      x0 = _mm256_add_ps(x0, _mm256_loadu_ps(b + i));
      x1 = _mm256_add_ps(x1, _mm256_loadu_ps(b + i + 8));
    }
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(x0, s));
    _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(x1, s));
  }
  return i;
}
#endif

DTRAIN_PRIVATE void dt__vec_add_scale(float *dst, const float *a, const float *b, float scale, size_t n) {
  size_t i = 0;
#if defined(DT__PLATFORM_X86)
  if (n >= 16 && __builtin_cpu_supports("avx")) i = dt__vec_add_scale_avx(dst, a, b, scale, n);
  const __m128 s = _mm_set1_ps(scale);
  for (; i + 4 <= n; i += 4) {
    __m128 x = _mm_loadu_ps(a + i);
    if (b) x = _mm_add_ps(x, _mm_loadu_ps(b + i));
    _mm_storeu_ps(dst + i, _mm_mul_ps(x, s));
  }
#elif defined(DT__PLATFORM_NEON)
  const float32x4_t s = vdupq_n_f32(scale);
  for (; i + 4 <= n; i += 4) {
    float32x4_t x = vld1q_f32(a + i);
    if (b) x = vaddq_f32(x, vld1q_f32(b + i));
    vst1q_f32(dst + i, vmulq_f32(x, s));
  }
#endif
  for (; i < n; i++) dst[i] = (b ? a[i] + b[i] : a[i]) * scale;
}

/* ---- a shared vector's sweeps -------------------------------------------------------------
 * dt__shared_load / dt__shared_add (dt_platform.h): the in-process
 * parameter store's pull and its Hogwild push, over a vector other threads
 * write at the same time. What they must give is what relaxed atomic
 * accesses give: each element read or written whole, in no order. C11
 * atomics give that one element per instruction; done so, a push of the MLP's
 * 235k floats took a sixth of an async replica's step. A vector load or
 * store of naturally aligned 4-byte elements is, on x86-64 and on AArch64,
 * one single-copy-atomic access per element (never torn), so the vector
 * loops below give the same per element, 4 or 8 elements an instruction.
 * The C standard still calls them a data race: a ThreadSanitizer build (which
 * checks the store's protocol) and a build without SIMD take the element-
 * by-element atomic loops instead. The atomic update rule
 * (DTRAIN_ASYNC_ATOMIC: compare-and-swap per element) does not come here. */
#if defined(__SANITIZE_THREAD__)
#  define DT__SHARED_ATOMIC_ONLY 1
#elif defined(__has_feature)
#  if __has_feature(thread_sanitizer)
#    define DT__SHARED_ATOMIC_ONLY 1
#  endif
#endif

#if defined(DT__PLATFORM_X86) && !defined(DT__SHARED_ATOMIC_ONLY)
__attribute__((target("avx"))) static size_t dt__shared_load_avx(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(src + i), b = _mm256_loadu_ps(src + i + 8);
    _mm256_storeu_ps(dst + i, a);
    _mm256_storeu_ps(dst + i + 8, b);
  }
  return i;
}

__attribute__((target("avx"))) static size_t dt__shared_add_avx(float *x, const float *d, float scale, size_t n) {
  const __m256 s = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 dv = _mm256_loadu_ps(d + i);
    __m256 keep = _mm256_cmp_ps(dv, zero, _CMP_NEQ_UQ); /* d != 0 (NaN too), as the scalar test */
    if (_mm256_testz_ps(keep, keep)) continue; /* all zero: nothing written */
    /* The select as and/andnot/or: gcc 12 turned _mm256_blendv_ps here into
     * lane-by-lane extracts and branches (14 cycles for 8 floats; the MLP's
     * 235k-float push 112 us, with this 28 us). */
    __m256 xv = _mm256_loadu_ps(x + i), nv = _mm256_add_ps(xv, _mm256_mul_ps(dv, s));
    _mm256_storeu_ps(x + i, _mm256_or_ps(_mm256_and_ps(keep, nv), _mm256_andnot_ps(keep, xv)));
  }
  return i;
}
#endif

DTRAIN_PRIVATE int dt__shared_direct(void) {
#if !defined(DT__SHARED_ATOMIC_ONLY) && (defined(DT__PLATFORM_X86) || defined(DT__PLATFORM_NEON))
  return 1;
#else
  return 0;
#endif
}

DTRAIN_PRIVATE void dt__shared_load(float *dst, dt__afloat *src, size_t n) {
  size_t i = 0;
#if !defined(DT__SHARED_ATOMIC_ONLY)
  const float *p = (const float *)src;
#  if defined(DT__PLATFORM_X86)
  if (n >= 16 && __builtin_cpu_supports("avx")) i = dt__shared_load_avx(dst, p, n);
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(dst + i, _mm_loadu_ps(p + i));
#  elif defined(DT__PLATFORM_NEON)
  for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vld1q_f32(p + i));
#  endif
  (void)p;
#endif
  for (; i < n; i++) dst[i] = dt__afloat_load(src + i);
}

DTRAIN_PRIVATE void dt__shared_add(dt__afloat *x, const float *d, float scale, size_t n) {
  size_t i = 0;
#if !defined(DT__SHARED_ATOMIC_ONLY)
  float *p = (float *)x;
#  if defined(DT__PLATFORM_X86)
  if (n >= 8 && __builtin_cpu_supports("avx")) i = dt__shared_add_avx(p, d, scale, n);
  const __m128 s = _mm_set1_ps(scale), zero = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 dv = _mm_loadu_ps(d + i), keep = _mm_cmpneq_ps(dv, zero);
    if (_mm_movemask_ps(keep) == 0) continue;
    __m128 xv = _mm_loadu_ps(p + i), nv = _mm_add_ps(xv, _mm_mul_ps(dv, s));
    _mm_storeu_ps(p + i, _mm_or_ps(_mm_and_ps(keep, nv), _mm_andnot_ps(keep, xv)));
  }
#  elif defined(DT__PLATFORM_NEON)
  const float32x4_t s = vdupq_n_f32(scale);
  for (; i + 4 <= n; i += 4) {
    float32x4_t dv = vld1q_f32(d + i);
    uint32x4_t keep = vmvnq_u32(vceqq_f32(dv, vdupq_n_f32(0.0f))); /* d != 0 (NaN too) */
    if (vmaxvq_u32(keep) == 0) continue;
    float32x4_t xv = vld1q_f32(p + i);
    vst1q_f32(p + i, vbslq_f32(keep, vaddq_f32(xv, vmulq_f32(dv, s)), xv));
  }
#  endif
  (void)p;
#endif
  for (; i < n; i++)
    if (d[i] != 0.0f) dt__afloat_store(x + i, dt__afloat_load(x + i) + d[i] * scale);
}

/* ---- handing cache lines over between cores ----------------------------------------------
 * On some hosts a core's store to a line that another core holds shared (it
 * read the line since this core wrote it) costs several times a store to a
 * line the other core modified. Measured 2026-12-02 on a 2-vCPU Zen 5 EPYC
 * (its two vCPUs on different L3s: a cache line between them takes about
 * 0.5 us there and back): one read-modify-write pass over 512 KiB took
 * 88-108 us after the other core had read the buffer, 18 us after it had
 * written it, 4 us with the other core idle; with the lines first written
 * back and dropped from every cache (clflushopt over the buffer, then the
 * pass) 32-38 us. dt__cache_evict is that first part (dt_strategy_mirrored.c
 * uses it when asked). x86-64 only: elsewhere dt__cache_evict_ok() is 0 and
 * nothing is evicted. */
#if defined(DT__PLATFORM_X86)
#  include <cpuid.h>
__attribute__((target("clflushopt"))) static void dt__cache_flush_opt(const char *p, const char *end) {
  for (; p < end; p += 64) _mm_clflushopt((void *)p);
}
static int dt__cache_has_flushopt(void) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 23 & 1u);
}
#endif

DTRAIN_PRIVATE int dt__cache_evict_ok(void) {
#if defined(DT__PLATFORM_X86)
  return 1; /* clflush is part of SSE2, so of every x86-64 */
#else
  return 0;
#endif
}

DTRAIN_PRIVATE void dt__cache_evict(const void *p, size_t bytes) {
#if defined(DT__PLATFORM_X86)
  static DT__ATOMIC(int) opt = -1; /* clflushopt: unordered flushes, many at once */
  if (!bytes) return;
  int o = DT__ALOAD(&opt, DT__MO_RELAXED);
  if (o < 0) DT__ASTORE(&opt, o = dt__cache_has_flushopt(), DT__MO_RELAXED);
  const char *b = (const char *)((uintptr_t)p & ~(uintptr_t)63), *e = (const char *)p + bytes;
  if (o) dt__cache_flush_opt(b, e);
  else
    for (; b < e; b += 64) _mm_clflush(b);
  _mm_sfence(); /* the flushes done before the stores that follow */
#else
  (void)p;
  (void)bytes;
#endif
}

#ifdef DT__SHARED_ATOMIC_ONLY
#  undef DT__SHARED_ATOMIC_ONLY
#endif
#ifdef DT__PLATFORM_X86
#  undef DT__PLATFORM_X86
#endif
#ifdef DT__PLATFORM_NEON
#  undef DT__PLATFORM_NEON
#endif
