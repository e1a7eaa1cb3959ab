/* ===========================================================================
 * dt_base.c -- result strings, per-thread errors, allocator, logger, build info
 * ===========================================================================
 */
#include "dt_internal.h"

/* ---- results ----------------------------------------------------------------- */

DTRAIN_API const char *dt_result_str(dt_result r) {
  switch (r) {
#define DT__RESULT_STR(name, value, text) case name: return text;
    DTRAIN_RESULT_LIST(DT__RESULT_STR)
#undef DT__RESULT_STR
    default: return "unknown result code";
  }
}

DTRAIN_API const char *dt_result_name(dt_result r) {
  switch (r) {
#define DT__RESULT_NAME(name, value, text) case name: return #name;
    DTRAIN_RESULT_LIST(DT__RESULT_NAME)
#undef DT__RESULT_NAME
    default: return "DTRAIN_ERR_UNKNOWN";
  }
}

static DT__TLS char dt__base_errmsg[DT__MSG_CAP];
static DT__TLS dt_result dt__base_errcode;

DTRAIN_API const char *dt_last_error(void) { return dt__base_errmsg; }
DTRAIN_API dt_result dt_last_result(void) { return dt__base_errcode; }
DTRAIN_API void dt_clear_error(void) {
  dt__base_errmsg[0] = '\0';
  dt__base_errcode = DTRAIN_OK;
}

/* ---- logging ------------------------------------------------------------------- */

static void dt__base_default_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)user;
#ifndef DTRAIN_NO_STDIO
  const char *tag = level == DTRAIN_LOG_ERROR ? "error" : level == DTRAIN_LOG_WARN ? "warning"
                  : level == DTRAIN_LOG_INFO ? "info" : "debug";
  if (code != DTRAIN_OK)
    fprintf(stderr, "dtrain %s (%s): %s\n", tag, dt_result_name(code), msg);
  else
    fprintf(stderr, "dtrain %s: %s\n", tag, msg);
#else
  (void)level; (void)code; (void)msg;
#endif
}

/* Set once at setup (documented as not thread-safe to change during use). */
static dt_log_fn dt__base_log_fn = dt__base_default_log;
static void *dt__base_log_user = NULL;
static dt_log_level dt__base_log_max = DTRAIN_LOG_WARN;

DTRAIN_API void dt_set_logger(dt_log_fn fn, void *user, dt_log_level max_level) {
  dt__base_log_fn = fn ? fn : dt__base_default_log;
  dt__base_log_user = fn ? user : NULL;
  dt__base_log_max = max_level;
}

static void dt__base_vlog(dt_log_level level, dt_result code, const char *fmt, va_list ap) {
  char buf[DT__MSG_CAP];
  if (level > dt__base_log_max) return;
  vsnprintf(buf, sizeof buf, fmt, ap);
  dt__base_log_fn(level, code, buf, dt__base_log_user);
}

DTRAIN_PRIVATE void dt__log(dt_log_level level, dt_result code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  dt__base_vlog(level, code, fmt, ap);
  va_end(ap);
}

static DT__TLS int dt__base_quiet;

DTRAIN_PRIVATE void dt__quiet_push(void) { dt__base_quiet++; }

DTRAIN_PRIVATE dt_result dt__quiet_pop(dt_result rc) {
  if (dt__base_quiet > 0) dt__base_quiet--;
  if (dt__base_quiet == 0 && rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && dt__base_errmsg[0])
    dt__log(DTRAIN_LOG_ERROR, rc, "%s", dt__base_errmsg);
  return rc;
}

DTRAIN_PRIVATE dt_result dt__error(dt_result code, const char *fmt, ...) {
  /* Format into a local buffer first: callers often wrap the previous
   * message (an argument pointing into dt__base_errmsg itself). */
  char buf[sizeof dt__base_errmsg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  memcpy(dt__base_errmsg, buf, sizeof buf);
  dt__base_errcode = code;
  if (!dt__base_quiet) dt__log(DTRAIN_LOG_ERROR, code, "%s", dt__base_errmsg);
  return code;
}

/* ---- memory ---------------------------------------------------------------------- */

#if !defined(DTRAIN_MALLOC) && !defined(DTRAIN_NO_MALLOC)
#  define DTRAIN_MALLOC(sz) malloc(sz)
#  define DTRAIN_REALLOC(p, sz) realloc(p, sz)
#  define DTRAIN_FREE(p) free(p)
#  if defined(__GLIBC__) && !defined(DTRAIN_NO_HEAP_TRIM)
#    define DT__HEAP_TRIM 1
#    include <malloc.h> /* malloc_trim */
#  endif
#endif

static dt_allocator dt__base_allocator; /* alloc NULL: built-in */

/* glibc keeps freed heap memory mapped (it serves blocks under its adaptive
 * mmap threshold from the heap and trims only its top): after a graph frees
 * its first step's arena blocks, they stayed resident next to the merged
 * block (20 MB for the CNN's 53 MB step). Returns them, with the built-in
 * allocator on glibc only; called rarely (when an arena is merged). */
DTRAIN_PRIVATE void dt__heap_trim(void) {
#ifdef DT__HEAP_TRIM
  if (!dt__base_allocator.alloc) (void)malloc_trim(0);
#endif
}

DTRAIN_API void dt_set_allocator(const dt_allocator *a) {
  if (a && a->alloc && a->free) {
    dt__base_allocator = *a;
  } else {
    dt__base_allocator.alloc = NULL;
    dt__base_allocator.free = NULL;
    dt__base_allocator.user = NULL;
  }
}

/* ---- fixed-memory allocator ---------------------------------------------------------
 * The user's buffer is a list of blocks, each starting with a 64-byte header
 * {size of the block including the header, free flag}; blocks tile the buffer
 * in address order, so a block's successor is at (char *)b + b->size. Alloc is
 * first fit with splitting; free merges with the following free block and, by
 * a walk from the start, with the preceding one. O(blocks), which is fine for
 * dtrain's few long-lived allocations (the arena makes steps allocation-free). */
typedef struct dt__fixblk {
  size_t size;
  size_t free;
} dt__fixblk;
#define DT__FIX_HDR ((size_t)DT__ALIGN)

static struct {
  unsigned char *base;
  size_t size, used, peak;
  int lock;
} dt__base_fix;

static void dt__base_fix_lock(void) {
#if defined(__GNUC__) || defined(__clang__)
  while (__atomic_test_and_set(&dt__base_fix.lock, __ATOMIC_ACQUIRE)) {
  }
#endif
}
static void dt__base_fix_unlock(void) {
#if defined(__GNUC__) || defined(__clang__)
  __atomic_clear(&dt__base_fix.lock, __ATOMIC_RELEASE);
#endif
}

static void *dt__base_fix_alloc(size_t size, size_t align, void *user) {
  (void)align; /* every block is DT__ALIGN-aligned, the largest alignment asked for */
  (void)user;
  if (size > dt__base_fix.size) return NULL;
  size_t need = DT__FIX_HDR + ((size + DT__ALIGN - 1) & ~(size_t)(DT__ALIGN - 1));
  void *result = NULL;
  dt__base_fix_lock();
  unsigned char *end = dt__base_fix.base + dt__base_fix.size;
  for (unsigned char *p = dt__base_fix.base; p < end; p += ((dt__fixblk *)p)->size) {
    dt__fixblk *b = (dt__fixblk *)p;
    if (!b->free || b->size < need) continue;
    if (b->size - need >= DT__FIX_HDR + DT__ALIGN) { /* split off the rest */
      dt__fixblk *rest = (dt__fixblk *)(p + need);
      rest->size = b->size - need;
      rest->free = 1;
      b->size = need;
    }
    b->free = 0;
    dt__base_fix.used += b->size;
    if (dt__base_fix.used > dt__base_fix.peak) dt__base_fix.peak = dt__base_fix.used;
    result = p + DT__FIX_HDR;
    break;
  }
  dt__base_fix_unlock();
  return result;
}

static void dt__base_fix_free(void *ptr, size_t size, void *user) {
  (void)size;
  (void)user;
  dt__base_fix_lock();
  dt__fixblk *b = (dt__fixblk *)((unsigned char *)ptr - DT__FIX_HDR);
  unsigned char *end = dt__base_fix.base + dt__base_fix.size;
  b->free = 1;
  dt__base_fix.used -= b->size;
  unsigned char *next = (unsigned char *)b + b->size;
  if (next < end && ((dt__fixblk *)next)->free) b->size += ((dt__fixblk *)next)->size;
  for (unsigned char *p = dt__base_fix.base; p < (unsigned char *)b; p += ((dt__fixblk *)p)->size) {
    dt__fixblk *q = (dt__fixblk *)p;
    if (p + q->size == (unsigned char *)b) {
      if (q->free) q->size += b->size;
      break;
    }
  }
  dt__base_fix_unlock();
}

DTRAIN_API dt_result dt_use_fixed_memory(void *buf, size_t size) {
  if (!buf) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_use_fixed_memory: buffer is NULL");
  uintptr_t a = ((uintptr_t)buf + DT__ALIGN - 1) & ~(uintptr_t)(DT__ALIGN - 1);
  size_t skip = (size_t)(a - (uintptr_t)buf);
  if (size < 4096 || size - skip < 4096)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_use_fixed_memory: %zu bytes is too small (at least 4096)", size);
  size_t usable = (size - skip) & ~(size_t)(DT__ALIGN - 1);
  dt__base_fix.base = (unsigned char *)a;
  dt__base_fix.size = usable;
  dt__base_fix.used = 0;
  dt__base_fix.peak = 0;
  dt__base_fix.lock = 0;
  dt__fixblk *b = (dt__fixblk *)dt__base_fix.base;
  b->size = usable;
  b->free = 1;
  dt_allocator al;
  al.alloc = dt__base_fix_alloc;
  al.free = dt__base_fix_free;
  al.user = NULL;
  dt_set_allocator(&al);
  return DTRAIN_OK;
}

DTRAIN_API size_t dt_fixed_memory_used(void) { return dt__base_fix.used; }
DTRAIN_API size_t dt_fixed_memory_peak(void) { return dt__base_fix.peak; }

DTRAIN_PRIVATE void *dt__alloc(size_t size) {
  if (size == 0) size = 1;
  if (size > (size_t)PTRDIFF_MAX) return NULL; /* no object is larger (and callers' memset bounds are known) */
  if (dt__base_allocator.alloc) return dt__base_allocator.alloc(size, DT__ALIGN, dt__base_allocator.user);
#ifdef DTRAIN_NO_MALLOC
  dt__log(DTRAIN_LOG_ERROR, DTRAIN_ERR_NOMEM,
          "no allocator: a DTRAIN_NO_MALLOC build needs dt_use_fixed_memory() or dt_set_allocator() first");
  return NULL;
#else
  /* Built-in: over-allocate, align, and keep the raw pointer just below
   * (size <= PTRDIFF_MAX: adding the alignment cannot wrap). */
  unsigned char *raw = (unsigned char *)DTRAIN_MALLOC(size + DT__ALIGN + sizeof(void *));
  if (!raw) return NULL;
  uintptr_t p = ((uintptr_t)(raw + sizeof(void *)) + DT__ALIGN - 1) & ~(uintptr_t)(DT__ALIGN - 1);
  memcpy((void *)(p - sizeof(void *)), &raw, sizeof raw);
  return (void *)p;
#endif
}

DTRAIN_PRIVATE void *dt__calloc(size_t size) {
  void *p = dt__alloc(size);
  if (p) memset(p, 0, size);
  return p;
}

DTRAIN_PRIVATE void dt__free(void *ptr, size_t size) {
  if (!ptr) return;
  if (size == 0) size = 1;
  if (dt__base_allocator.free) {
    dt__base_allocator.free(ptr, size, dt__base_allocator.user);
    return;
  }
#ifndef DTRAIN_NO_MALLOC
  void *raw;
  memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
  DTRAIN_FREE(raw);
#endif
}

DTRAIN_PRIVATE void *dt__realloc(void *ptr, size_t old_size, size_t new_size) {
  void *n = dt__alloc(new_size);
  if (!n) return NULL;
  if (ptr) {
    memcpy(n, ptr, DT__MIN(old_size, new_size));
    dt__free(ptr, old_size);
  }
  return n;
}

/* ---- scratch slots ------------------------------------------------------------------
 * Work buffers too big for every thread's stack that a hot call must not
 * allocate each time (dt_sgemm's packed panels): DT__SCRATCH_SLOTS slots,
 * each claimed with an atomic flag and keeping its block, once allocated, for
 * the life of the process (grown when a claim asks for more). Only with the
 * built-in allocator: a user's allocator or fixed memory would lose the block
 * for good. A claim returns NULL when every slot is busy, when allocation
 * fails, under DTRAIN_NO_MALLOC or without the atomic builtins; the caller
 * then works from its stack. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(DTRAIN_NO_MALLOC)
#  define DT__SCRATCH_SLOTS 32
/* A slot a cache line long: each dt_sgemm call claims and releases one, so
 * threads working in parallel must not write to each other's lines. */
static struct {
  int busy;
  size_t size;
  void *raw;
  char pad_[64 - sizeof(int) - sizeof(size_t) - sizeof(void *)];
} dt__scratch[DT__SCRATCH_SLOTS];
#endif

DTRAIN_PRIVATE void *dt__scratch_claim(size_t size, int *slot) {
  *slot = -1;
#ifdef DT__SCRATCH_SLOTS
  if (dt__base_allocator.alloc || size > SIZE_MAX - DT__ALIGN) return NULL;
  for (int i = 0; i < DT__SCRATCH_SLOTS; i++) {
    if (__atomic_load_n(&dt__scratch[i].busy, __ATOMIC_RELAXED) ||
        __atomic_exchange_n(&dt__scratch[i].busy, 1, __ATOMIC_ACQUIRE))
      continue;
    if (dt__scratch[i].size < size) { /* the slot is ours alone until released */
      if (dt__scratch[i].raw) DTRAIN_FREE(dt__scratch[i].raw); /* as dt__free: a user's DTRAIN_FREE never sees NULL */
      dt__scratch[i].raw = DTRAIN_MALLOC(size + DT__ALIGN);
      dt__scratch[i].size = dt__scratch[i].raw ? size : 0;
      if (!dt__scratch[i].raw) {
        __atomic_store_n(&dt__scratch[i].busy, 0, __ATOMIC_RELEASE);
        return NULL;
      }
    }
    *slot = i;
    return (void *)(((uintptr_t)dt__scratch[i].raw + DT__ALIGN - 1) & ~(uintptr_t)(DT__ALIGN - 1));
  }
#else
  (void)size;
#endif
  return NULL;
}

DTRAIN_PRIVATE void dt__scratch_release(int slot) {
#ifdef DT__SCRATCH_SLOTS
  if (slot >= 0 && slot < DT__SCRATCH_SLOTS) __atomic_store_n(&dt__scratch[slot].busy, 0, __ATOMIC_RELEASE);
#else
  (void)slot;
#endif
}
#ifdef DT__SCRATCH_SLOTS
#  undef DT__SCRATCH_SLOTS
#endif

DTRAIN_PRIVATE int dt__mul_size(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 0;
  *out = a * b;
  return 1;
}

/* ---- build info -------------------------------------------------------------------- */

DTRAIN_API unsigned dt_build_features(void) {
  unsigned f = 0;
#ifndef DTRAIN_NO_THREADS
  f |= DTRAIN_FEATURE_THREADS;
#endif
#ifndef DTRAIN_NO_NET
  f |= DTRAIN_FEATURE_NET;
#endif
#ifndef DTRAIN_NO_STDIO
  f |= DTRAIN_FEATURE_STDIO;
#endif
#ifdef DTRAIN_USE_CBLAS
  f |= DTRAIN_FEATURE_CBLAS;
#endif
#ifndef DTRAIN_NO_SIMD
  f |= DTRAIN_FEATURE_SIMD;
#endif
#ifdef DTRAIN_USE_MPI
  f |= DTRAIN_FEATURE_MPI;
#endif
#ifdef DTRAIN_USE_ZLIB
  f |= DTRAIN_FEATURE_ZLIB;
#endif
#ifdef DTRAIN_DEBUG
  f |= DTRAIN_FEATURE_DEBUG;
#endif
#ifndef DTRAIN_NO_MALLOC
  f |= DTRAIN_FEATURE_MALLOC;
#endif
#ifndef DTRAIN_NO_DIST
  f |= DTRAIN_FEATURE_DIST;
#endif
#ifndef DTRAIN_NO_DATA
  f |= DTRAIN_FEATURE_DATA;
#endif
#ifndef DTRAIN_NO_FIT
  f |= DTRAIN_FEATURE_FIT;
#endif
  return f;
}

/* The build line is a string literal assembled by the preprocessor: no
 * buffer, nothing to race on. */
#if defined(__clang__)
#  define DT__COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#  define DT__COMPILER "gcc " __VERSION__
#elif defined(_MSC_VER)
#  define DT__COMPILER "msvc"
#else
#  define DT__COMPILER "unknown compiler"
#endif
#ifdef __cplusplus
#  define DT__LANG ", C++"
#else
#  define DT__LANG ""
#endif
#ifndef DTRAIN_NO_THREADS
#  define DT__B_THREADS "yes"
#else
#  define DT__B_THREADS "no"
#endif
#ifndef DTRAIN_NO_NET
#  define DT__B_NET "yes"
#else
#  define DT__B_NET "no"
#endif
#ifndef DTRAIN_NO_STDIO
#  define DT__B_STDIO "yes"
#else
#  define DT__B_STDIO "no"
#endif
#ifdef DTRAIN_USE_CBLAS
#  define DT__B_CBLAS "yes"
#else
#  define DT__B_CBLAS "no"
#endif
#ifndef DTRAIN_NO_SIMD
#  define DT__B_SIMD "yes"
#else
#  define DT__B_SIMD "no"
#endif
#ifdef DTRAIN_USE_MPI
#  define DT__B_MPI "yes"
#else
#  define DT__B_MPI "no"
#endif
#ifdef DTRAIN_USE_ZLIB
#  define DT__B_ZLIB "yes"
#else
#  define DT__B_ZLIB "no"
#endif
#ifdef DTRAIN_DEBUG
#  define DT__B_DEBUG "yes"
#else
#  define DT__B_DEBUG "no"
#endif
#ifndef DTRAIN_NO_DIST
#  define DT__B_DIST "yes"
#else
#  define DT__B_DIST "no"
#endif
#ifndef DTRAIN_NO_DATA
#  define DT__B_DATA "yes"
#else
#  define DT__B_DATA "no"
#endif
#ifndef DTRAIN_NO_FIT
#  define DT__B_FIT "yes"
#else
#  define DT__B_FIT "no"
#endif

#define DT__B_INFO                                                                                             \
  "dtrain " DTRAIN_VERSION_STRING " (" DT__COMPILER DT__LANG ") threads=" DT__B_THREADS " net=" DT__B_NET          \
  " stdio=" DT__B_STDIO " cblas=" DT__B_CBLAS " simd=" DT__B_SIMD " mpi=" DT__B_MPI " zlib=" DT__B_ZLIB          \
  " debug=" DT__B_DEBUG " dist=" DT__B_DIST " data=" DT__B_DATA " fit=" DT__B_FIT " isa="

DTRAIN_PRIVATE int dt__cpu_avx2(void) {
#ifdef DT__CPU_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return 0;
#endif
}

DTRAIN_PRIVATE int dt__cpu_avx512(void) {
#ifdef DT__CPU_X86
  return dt__cpu_avx2() && __builtin_cpu_supports("avx512f");
#else
  return 0;
#endif
}

DTRAIN_PRIVATE int dt__cpu_bf16(void) {
#ifdef DT__CPU_X86
  return dt__cpu_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
#else
  return 0;
#endif
}

/* isa=: the widest kernel path this build has on this CPU (dt_gemm.c's
 * best path), the one the kernels pick unless DTRAIN_ISA or
 * dt_sgemm_use_isa forces another (dt_sgemm_kernel() names the one in
 * use). Static strings only. */
DTRAIN_API const char *dt_build_info(void) {
#ifdef DT__CPU_X86
  return dt__cpu_avx512() ? DT__B_INFO "avx512" : dt__cpu_avx2() ? DT__B_INFO "avx2" : DT__B_INFO "portable";
#elif !defined(DTRAIN_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
  return DT__B_INFO "neon";
#else
  return DT__B_INFO "portable";
#endif
}
#undef DT__B_INFO
#undef DT__COMPILER
#undef DT__LANG
#undef DT__B_THREADS
#undef DT__B_NET
#undef DT__B_STDIO
#undef DT__B_CBLAS
#undef DT__B_SIMD
#undef DT__B_MPI
#undef DT__B_ZLIB
#undef DT__B_DEBUG
#undef DT__B_DIST
#undef DT__B_DATA
#undef DT__B_FIT

/* Timings subtract two readings, so the clock must not step when NTP or an
 * administrator sets the time: CLOCK_MONOTONIC where POSIX has it. */
DTRAIN_API double dt_time_now(void) {
#if defined(_WIN32) /* the performance counter: monotonic, sub-microsecond (msvcrt has no timespec_get) */
  LARGE_INTEGER freq, now;
  if (QueryPerformanceFrequency(&freq) && freq.QuadPart > 0 && QueryPerformanceCounter(&now))
    return (double)now.QuadPart / (double)freq.QuadPart;
  return (double)GetTickCount64() * 1e-3;
#else
  struct timespec ts;
#  if defined(CLOCK_MONOTONIC)
  if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#  endif
  if (timespec_get(&ts, TIME_UTC) != TIME_UTC) return (double)clock() / CLOCKS_PER_SEC;
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#endif
}
#undef DT__FIX_HDR
