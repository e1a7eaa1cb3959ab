/* ===========================================================================
 * dt_platform.h -- threads, mutexes, condition variables, atomics, a
 * breakable barrier, a persistent thread pool, monotonic time, sleep
 * ===========================================================================
 * Private to the implementation (it is listed as an impl file: its types hold
 * pthread objects, and public struct layouts never depend on a macro). The
 * only file that includes pthread.h; the strategies (dt_strategy.c) and the
 * communicators (dt_comm*.c) build on it.
 *
 * Atomics: C11 <stdatomic.h> when compiled as C, the GCC/Clang __atomic
 * builtins when compiled as C++ (C++17 has no <stdatomic.h>) or when the C
 * compiler lacks C11 atomics. Both spell the same operations through the
 * DT__A* macros below; a shared word is declared DT__ATOMIC(T). Nothing
 * spins on `volatile`.
 *
 * Waiting: every wait spins for a short time (spin_us, checking the
 * condition between CPU pause instructions), then sleeps on a condition
 * variable. A waker only touches the mutex when somebody sleeps. The spin
 * phase is what makes a 4 KiB all-reduce take about a microsecond instead
 * of the ~11 us of a sleeping pthread barrier.
 *
 * Without threads (DTRAIN_NO_THREADS) the same API exists: mutexes and
 * condition variables do nothing, thread creation fails with
 * DTRAIN_ERR_UNSUPPORTED, and a pool or barrier of one participant works.
 */
#ifndef DTRAIN_PLATFORM_H
#define DTRAIN_PLATFORM_H

#include "dt_internal.h"

#if !defined(DTRAIN_NO_THREADS)
#  include <pthread.h>
#endif

/* ---- atomics ------------------------------------------------------------------- */
#if defined(__cplusplus) || defined(__STDC_NO_ATOMICS__)
#  if !defined(__GNUC__) && !defined(__clang__)
#    error "dtrain: atomics need C11 <stdatomic.h> or the GCC/Clang __atomic builtins"
#  endif
#  define DT__ATOMIC(T) T
#  define DT__MO_RELAXED __ATOMIC_RELAXED
#  define DT__MO_ACQUIRE __ATOMIC_ACQUIRE
#  define DT__MO_RELEASE __ATOMIC_RELEASE
#  define DT__MO_ACQ_REL __ATOMIC_ACQ_REL
#  define DT__MO_SEQ_CST __ATOMIC_SEQ_CST
#  define DT__ALOAD(p, mo) __atomic_load_n((p), (mo))
#  define DT__ASTORE(p, v, mo) __atomic_store_n((p), (v), (mo))
#  define DT__AFETCH_ADD(p, v, mo) __atomic_fetch_add((p), (v), (mo))
#  define DT__AFETCH_SUB(p, v, mo) __atomic_fetch_sub((p), (v), (mo))
#  define DT__ACAS(p, expp, des, mo) \
     __atomic_compare_exchange_n((p), (expp), (des), 0, (mo), __ATOMIC_RELAXED)
#else
#  include <stdatomic.h>
#  define DT__ATOMIC(T) _Atomic(T)
#  define DT__MO_RELAXED memory_order_relaxed
#  define DT__MO_ACQUIRE memory_order_acquire
#  define DT__MO_RELEASE memory_order_release
#  define DT__MO_ACQ_REL memory_order_acq_rel
#  define DT__MO_SEQ_CST memory_order_seq_cst
#  define DT__ALOAD(p, mo) atomic_load_explicit((p), (mo))
#  define DT__ASTORE(p, v, mo) atomic_store_explicit((p), (v), (mo))
#  define DT__AFETCH_ADD(p, v, mo) atomic_fetch_add_explicit((p), (v), (mo))
#  define DT__AFETCH_SUB(p, v, mo) atomic_fetch_sub_explicit((p), (v), (mo))
#  define DT__ACAS(p, expp, des, mo) \
     atomic_compare_exchange_strong_explicit((p), (expp), (des), (mo), memory_order_relaxed)
#endif

/* A float buffer that is read and written concurrently (the Hogwild
 * parameter store). Cast a float* to this to access it atomically. */
typedef DT__ATOMIC(float) dt__afloat;

/* Relaxed float load/store (never torn; plain moves on x86 and ARM). */
static DT__UNUSED inline float dt__afloat_load(dt__afloat *p) {
#if defined(__cplusplus) || defined(__STDC_NO_ATOMICS__)
  float v;
  __atomic_load(p, &v, __ATOMIC_RELAXED);
  return v;
#else
  return atomic_load_explicit(p, memory_order_relaxed);
#endif
}

static DT__UNUSED inline void dt__afloat_store(dt__afloat *p, float v) {
#if defined(__cplusplus) || defined(__STDC_NO_ATOMICS__)
  __atomic_store(p, &v, __ATOMIC_RELAXED);
#else
  atomic_store_explicit(p, v, memory_order_relaxed);
#endif
}

/* *p += v as one indivisible step (compare-and-swap loop, relaxed). */
static DT__UNUSED inline void dt__afloat_add(dt__afloat *p, float v) {
  float old = dt__afloat_load(p), upd;
  for (;;) {
    upd = old + v;
#if defined(__cplusplus) || defined(__STDC_NO_ATOMICS__)
    if (__atomic_compare_exchange(p, &old, &upd, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
#else
    if (atomic_compare_exchange_weak_explicit(p, &old, upd, memory_order_relaxed, memory_order_relaxed)) return;
#endif
  }
}

/* A shared vector's sweeps (the in-process parameter store, dt_pstore.c):
 * dst[i] = src[i] for i < n, and x[i] = x[i] + d[i] * scale for each i < n
 * with d[i] != 0 (a zero is not written), each element read and written
 * whole, unordered, as the relaxed dt__afloat_load/_store do (Hogwild: an
 * add racing another on the same element may lose one of the two). Vector
 * loads and stores where the CPU makes each aligned element of one a single
 * untorn access (x86-64, AArch64), element by element elsewhere, under
 * DTRAIN_NO_SIMD and under ThreadSanitizer (see dt_platform.c). */
DTRAIN_PRIVATE void dt__shared_load(float *dst, dt__afloat *src, size_t n);
DTRAIN_PRIVATE void dt__shared_add(dt__afloat *x, const float *d, float scale, size_t n);
/* 1 where the sweeps above are vector loops (the CPU's aligned float
 * accesses are untorn and nothing checks the C memory model's races), so
 * that ordinary code may read and write such a vector while other threads
 * do, as Hogwild's threads do (the async strategy's replicas computing on
 * the store itself); 0 under ThreadSanitizer, DTRAIN_NO_SIMD and elsewhere. */
DTRAIN_PRIVATE int dt__shared_direct(void);

/* Handing cache lines over between cores (dt_platform.c tells why): 1 where
 * dt__cache_evict works (x86-64); dt__cache_evict writes back and drops the
 * lines of [p, p + bytes) from every core's cache. */
DTRAIN_PRIVATE int dt__cache_evict_ok(void);
DTRAIN_PRIVATE void dt__cache_evict(const void *p, size_t bytes);

/* A hint to the CPU inside spin loops (lets the sibling hyper-thread run). */
static DT__UNUSED inline void dt__cpu_relax(void) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_ia32_pause();
#elif (defined(__GNUC__) || defined(__clang__)) && (defined(__aarch64__) || defined(__arm__))
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* ---- time ------------------------------------------------------------------------ */
/* Monotonic seconds (CLOCK_MONOTONIC where available). */
DTRAIN_PRIVATE double dt__now(void);
/* The calling thread's CPU time in seconds (user and system), or -1 where
 * the platform does not tell. */
DTRAIN_PRIVATE double dt__thread_cpu_s(void);
/* Sleep for `seconds` (>= 0), restarting after signals. */
DTRAIN_PRIVATE void dt__sleep(double seconds);
/* Online CPUs (>= 1). */
DTRAIN_PRIVATE int dt__cpu_count(void);

/* ---- threads, mutexes, condition variables ---------------------------------------- */
typedef struct dt__mutex {
#if !defined(DTRAIN_NO_THREADS)
  pthread_mutex_t m;
#else
  int unused;
#endif
} dt__mutex;

typedef struct dt__cond {
#if !defined(DTRAIN_NO_THREADS)
  pthread_cond_t c;
#else
  int unused;
#endif
} dt__cond;

typedef struct dt__thread {
#if !defined(DTRAIN_NO_THREADS)
  pthread_t t;
#endif
  int started;
} dt__thread;

typedef void (*dt__thread_fn)(void *arg);

DTRAIN_PRIVATE dt_result dt__mutex_init(dt__mutex *m);
DTRAIN_PRIVATE void dt__mutex_destroy(dt__mutex *m);
DTRAIN_PRIVATE void dt__mutex_lock(dt__mutex *m);
DTRAIN_PRIVATE void dt__mutex_unlock(dt__mutex *m);
DTRAIN_PRIVATE dt_result dt__cond_init(dt__cond *c);
DTRAIN_PRIVATE void dt__cond_destroy(dt__cond *c);
DTRAIN_PRIVATE void dt__cond_wait(dt__cond *c, dt__mutex *m);
DTRAIN_PRIVATE void dt__cond_broadcast(dt__cond *c);
/* Start a thread running fn(arg). DTRAIN_ERR_UNSUPPORTED without threads. */
DTRAIN_PRIVATE dt_result dt__thread_start(dt__thread *t, dt__thread_fn fn, void *arg);
DTRAIN_PRIVATE void dt__thread_join(dt__thread *t);

/* ---- events: spin, then sleep until a condition holds ------------------------------
 * The condition is a function of atomics that only ever change from "false"
 * to "true" through a change that is followed by dt__event_notify(). The
 * condition's loads must be seq_cst (or acquire after a seq_cst store), the
 * notifier's stores seq_cst: then a sleeper cannot miss its wake-up. */
typedef struct dt__event {
  dt__mutex m;
  dt__cond c;
  DT__ATOMIC(int) sleepers;
} dt__event;

typedef int (*dt__pred_fn)(void *arg);

DTRAIN_PRIVATE dt_result dt__event_init(dt__event *e);
DTRAIN_PRIVATE void dt__event_destroy(dt__event *e);
/* Wake every sleeper (cheap when nobody sleeps). Call after the change. */
DTRAIN_PRIVATE void dt__event_notify(dt__event *e);
/* Wait until pred(arg) is true: spin for spin_s seconds, then sleep. Returns
 * the seconds spent waiting (0 when pred held at once). */
DTRAIN_PRIVATE double dt__event_wait(dt__event *e, dt__pred_fn pred, void *arg, double spin_s);

/* ---- barrier with a broken state ---------------------------------------------------
 * A counting barrier for n threads. dt__barrier_break() releases every
 * waiter, present and future, with DTRAIN_ERR_ABORTED until
 * dt__barrier_reset(), which must only be called while no thread is inside. */
typedef struct dt__barrier {
  DT__ATOMIC(int) count;        /* arrivals in this phase */
  DT__ATOMIC(unsigned) phase;   /* bumped by the last arrival */
  DT__ATOMIC(int) broken;
  int n;
  double spin_s;
  dt__event ev;
} dt__barrier;

DTRAIN_PRIVATE dt_result dt__barrier_init(dt__barrier *b, int n, double spin_s);
DTRAIN_PRIVATE void dt__barrier_destroy(dt__barrier *b);
/* DTRAIN_OK, or DTRAIN_ERR_ABORTED when the barrier is (or becomes) broken.
 * *waited (may be NULL) gets the seconds this thread waited. */
DTRAIN_PRIVATE dt_result dt__barrier_wait(dt__barrier *b, double *waited);
DTRAIN_PRIVATE void dt__barrier_break(dt__barrier *b);
DTRAIN_PRIVATE void dt__barrier_reset(dt__barrier *b);

/* ---- persistent thread pool ---------------------------------------------------------
 * n participants: the calling thread is index 0, n-1 worker threads are
 * created once and wait (spin, then sleep) between jobs. dt__pool_run()
 * runs fn(arg, i) for i = 0..n-1 and returns when all have returned. No
 * thread is created per job. */
typedef void (*dt__pool_fn)(void *arg, int index);
typedef struct dt__pool dt__pool;

/* n >= 1; n > 1 needs threads. NULL on failure (thread error set). */
DTRAIN_PRIVATE dt__pool *dt__pool_create(int n, double spin_s);
DTRAIN_PRIVATE void dt__pool_destroy(dt__pool *p);
DTRAIN_PRIVATE void dt__pool_run(dt__pool *p, dt__pool_fn fn, void *arg);
DTRAIN_PRIVATE int dt__pool_size(const dt__pool *p);

/* Default spin before sleeping: 50 us when the waiters fit on the cores,
 * else a few hundred nanoseconds (a spinner would steal the core that the
 * thread being waited for needs). spin_us < 0 means never spin; 0 the default. */
DTRAIN_PRIVATE double dt__spin_seconds(int spin_us, int nthreads);

#endif /* DTRAIN_PLATFORM_H */
