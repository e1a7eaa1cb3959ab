/* ===========================================================================
 * dt_base.h -- configuration, result codes, allocator and logger hooks
 * ===========================================================================
 */
#ifndef DTRAIN_BASE_H
#define DTRAIN_BASE_H

/* The implementation in parts (see the manual's CONFIGURATION): part K of
 * DTRAIN_IMPLEMENTATION_PARTS, one per translation unit, compiled in parallel. */
#define DTRAIN_IMPLEMENTATION_PARTS 4
#if defined(DTRAIN__LINKED_TEST)
/* The test suite only (the Makefile's LINKED_TESTS): a test written for the whole
 * implementation (DTRAIN_STATIC, DTRAIN_IMPLEMENTATION: it calls private functions) gets
 * the implementation's declarations only and links with the parts (build/dtrain.o), so
 * that each configuration compiles the implementation once, not once per test. */
#  undef DTRAIN_STATIC
#  define DTRAIN_IMPLEMENTATION_PART 0
#  ifndef DTRAIN_IMPLEMENTATION
#    define DTRAIN_IMPLEMENTATION
#  endif
#elif defined(DTRAIN_IMPLEMENTATION_PART)
#  if DTRAIN_IMPLEMENTATION_PART < 1 || DTRAIN_IMPLEMENTATION_PART > DTRAIN_IMPLEMENTATION_PARTS
#    error "DTRAIN_IMPLEMENTATION_PART is 1, 2, 3 or 4 (DTRAIN_IMPLEMENTATION_PARTS): one translation unit each"
#  endif
#  if defined(DTRAIN_STATIC)
#    error "DTRAIN_IMPLEMENTATION_PART with DTRAIN_STATIC: the parts call each other, so they cannot be static"
#  endif
#  ifndef DTRAIN_IMPLEMENTATION
#    define DTRAIN_IMPLEMENTATION
#  endif
#endif

/* The implementation uses POSIX (threads, sockets, fsync, clock_gettime).
 * Strict ISO modes (-std=c11, c17) hide it unless a feature macro comes
 * before the first system header; the implementation file may well include
 * <stdio.h> before dtrain.h, so when no feature macro is set: define
 * _POSIX_C_SOURCE, and when glibc's <features.h> already ran (a system header
 * came first) run it again, so that the headers included from here on see
 * POSIX (it starts by undefining everything it derives; musl's headers test
 * the macro itself). What the ISO C headers included before left out
 * (fdopen, fileno, nanosleep, kill, S_ISSOCK) is declared where it is used
 * (DT__POSIX_LATE). POSIX headers (<unistd.h>, <netdb.h>, <sys/socket.h>)
 * included first in strict mode need a feature macro before them, as the
 * code that includes them does. */
#if defined(DTRAIN_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && \
    !defined(_XOPEN_SOURCE) && !defined(_WIN32)
#  define _POSIX_C_SOURCE 200809L
#  if defined(_FEATURES_H) /* glibc's or musl's: a system header came first */
#    if defined(__GLIBC__)
#      undef _FEATURES_H
#      include <features.h>
#    endif
#    if !defined(__cplusplus) /* (C++ modes show POSIX anyway) */
#      define DT__POSIX_LATE 1
#    endif
#  endif
#endif

#include <stddef.h>
#include <stdint.h>

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 1
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION_STRING "0.1.0"

/* ---- configuration sanity: contradictory settings stop the build ---------- */
#if defined(DTRAIN_MALLOC) || defined(DTRAIN_REALLOC) || defined(DTRAIN_FREE)
#  if !defined(DTRAIN_MALLOC) || !defined(DTRAIN_REALLOC) || !defined(DTRAIN_FREE)
#    error "dtrain: define all of DTRAIN_MALLOC, DTRAIN_REALLOC and DTRAIN_FREE, or none of them"
#  endif
#endif
#if defined(DTRAIN_NO_MALLOC) && defined(DTRAIN_MALLOC)
#  error "dtrain: DTRAIN_NO_MALLOC contradicts DTRAIN_MALLOC; define one of them"
#endif
#if defined(DTRAIN_NO_THREADS) && defined(DTRAIN_USE_MPI)
#  error "dtrain: DTRAIN_USE_MPI needs threads; remove DTRAIN_NO_THREADS or DTRAIN_USE_MPI"
#endif
#if defined(DTRAIN_NO_DIST) && defined(DTRAIN_USE_MPI)
#  error "dtrain: DTRAIN_USE_MPI is a distributed backend; remove DTRAIN_NO_DIST or DTRAIN_USE_MPI"
#endif
#if defined(DTRAIN_NO_DATA) && defined(DTRAIN_USE_ZLIB)
#  error "dtrain: DTRAIN_USE_ZLIB serves the data loaders; remove DTRAIN_NO_DATA or DTRAIN_USE_ZLIB"
#endif
/* Edge builds: DTRAIN_NO_DIST leaves out every distributed part (the
 * communicators but one_device's in-process one of world 1, the strategies
 * but one_device, the parameter stores and servers, the cluster parser and
 * the whole network layer), so it implies DTRAIN_NO_NET: the sockets' own
 * guards then apply and dt_build_features() reports no network. */
#if defined(DTRAIN_NO_DIST) && !defined(DTRAIN_NO_NET)
#  define DTRAIN_NO_NET
#endif
#if defined(DTRAIN_NO_NET) && defined(DTRAIN_USE_MPI)
#  error "dtrain: DTRAIN_USE_MPI is a network backend; remove DTRAIN_NO_NET or DTRAIN_USE_MPI"
#endif

/* ---- linkage -------------------------------------------------------------- */
#ifdef DTRAIN_STATIC
#  if defined(__GNUC__) || defined(__clang__)
#    define DTRAIN_API static __attribute__((unused))
#  else
#    define DTRAIN_API static
#  endif
#else
#  define DTRAIN_API extern
#endif

/* Marks a public name kept for one release after its rename: calling it
 * still works, the compiler warns and the message names the replacement.
 * Only functions carry it (the old type names are plain typedefs: the
 * library's own sources still spell some of them); -Wno-deprecated-declarations
 * silences it. */
#if defined(__GNUC__) || defined(__clang__)
#  define DTRAIN_DEPRECATED(msg) __attribute__((deprecated(msg)))
#elif defined(_MSC_VER)
#  define DTRAIN_DEPRECATED(msg) __declspec(deprecated(msg))
#else
#  define DTRAIN_DEPRECATED(msg)
#endif

#ifdef __cplusplus
#  define DTRAIN_EXTERN_C_BEGIN extern "C" {
#  define DTRAIN_EXTERN_C_END }
#else
#  define DTRAIN_EXTERN_C_BEGIN
#  define DTRAIN_EXTERN_C_END
#endif

DTRAIN_EXTERN_C_BEGIN

/* ---- result codes ----------------------------------------------------------
 * 0 is success; errors are negative and grouped by hundreds per area.
 * One list yields both the enum and the strings returned by dt_result_str().
 */
#define DTRAIN_RESULT_LIST(X)                                                   \
  X(DTRAIN_OK,               0,    "success")                                   \
  X(DTRAIN_ERR_INVALID_ARG,  -100, "invalid argument")                          \
  X(DTRAIN_ERR_NULL_ARG,     -101, "required argument is NULL")                 \
  X(DTRAIN_ERR_UNSUPPORTED,  -102, "not supported by this build")               \
  X(DTRAIN_ERR_STATE,        -103, "object is in the wrong state for this call") \
  X(DTRAIN_ERR_INTERNAL,     -104, "internal error")                            \
  X(DTRAIN_ERR_SHAPE,        -200, "tensor shapes do not match")                \
  X(DTRAIN_ERR_RANK,         -201, "wrong number of dimensions")                \
  X(DTRAIN_ERR_EMPTY,        -202, "zero-size tensor")                          \
  X(DTRAIN_ERR_INDEX,        -203, "index out of range")                        \
  X(DTRAIN_ERR_NONFINITE,    -204, "NaN or Inf in a tensor")                    \
  X(DTRAIN_ERR_NOT_FOUND,    -205, "name not found")                            \
  X(DTRAIN_ERR_NOMEM,        -300, "out of memory")                             \
  X(DTRAIN_ERR_OVERFLOW,     -301, "size overflow")                             \
  X(DTRAIN_ERR_IO,           -400, "I/O error")                                 \
  X(DTRAIN_ERR_FORMAT,       -401, "bad file format")                           \
  X(DTRAIN_ERR_CORRUPT,      -402, "corrupt or truncated data")                 \
  X(DTRAIN_ERR_MISMATCH,     -403, "data does not match the model")             \
  X(DTRAIN_ERR_NET,          -500, "network error")                             \
  X(DTRAIN_ERR_TIMEOUT,      -501, "deadline exceeded")                         \
  X(DTRAIN_ERR_PEER,         -502, "peer failed or disconnected")               \
  X(DTRAIN_ERR_PROTOCOL,     -503, "protocol violation")                        \
  X(DTRAIN_ERR_AUTH,         -504, "authentication failed")                     \
  X(DTRAIN_ERR_THREAD,       -600, "thread error")                              \
  X(DTRAIN_ERR_ABORTED,      -601, "aborted because another replica failed")

typedef enum dt_result {
#define DTRAIN__RESULT_ENUM(name, value, text) name = value,
  DTRAIN_RESULT_LIST(DTRAIN__RESULT_ENUM)
#undef DTRAIN__RESULT_ENUM
  DTRAIN__RESULT_FORCE_INT = 0x7fffffff
} dt_result;

/* Short fixed text for a code ("out of memory"); never NULL. */
DTRAIN_API const char *dt_result_str(dt_result r);
/* The code's enum name ("DTRAIN_ERR_NOMEM"); never NULL. */
DTRAIN_API const char *dt_result_name(dt_result r);
/* Detailed message of the last error raised on this thread, e.g.
 * "dt_matmul: inner dims differ ([3,4] @ [5,2])". Empty string if none.
 * The pointer stays valid until the next failing dtrain call on this thread. */
DTRAIN_API const char *dt_last_error(void);
/* The code of the last error on this thread (DTRAIN_OK if none). */
DTRAIN_API dt_result dt_last_result(void);
DTRAIN_API void dt_clear_error(void);

/* ---- memory ----------------------------------------------------------------
 * Every allocation dtrain makes goes through one allocator. Compile time:
 * define DTRAIN_MALLOC(sz), DTRAIN_REALLOC(p,sz) and DTRAIN_FREE(p) (all or
 * none). Run time: dt_set_allocator() installs hooks that receive size and
 * alignment (alignment is a power of two, at most 64). Set it before creating
 * any dtrain object and do not change it while objects exist.
 */
typedef struct dt_allocator {
  void *(*alloc)(size_t size, size_t align, void *user); /* NULL on failure */
  void (*free)(void *ptr, size_t size, void *user);      /* size as allocated */
  void *user;
} dt_allocator;

/* Install an allocator; NULL restores the default. Not thread-safe: call at setup. */
DTRAIN_API void dt_set_allocator(const dt_allocator *a);

/* Fixed-memory mode: every allocation dtrain makes comes from `buf` (`size`
 * bytes, any alignment; at least 4 KiB) and malloc is never called. Call at
 * setup, before creating any dtrain object; `buf` must outlive them all. An
 * allocation that does not fit fails cleanly (DTRAIN_ERR_NOMEM with a message).
 * Blocks are first-fit with coalescing, 64-byte aligned, guarded by a spin lock.
 * dt_set_allocator() (or this call again) replaces it. Build with
 * DTRAIN_NO_MALLOC to leave malloc out of the library altogether. */
DTRAIN_API dt_result dt_use_fixed_memory(void *buf, size_t size);
/* Bytes of the fixed buffer in use now, and the most ever in use. */
DTRAIN_API size_t dt_fixed_memory_used(void);
DTRAIN_API size_t dt_fixed_memory_peak(void);

/* ---- logging ---------------------------------------------------------------
 * One callback receives every message. It may be called from any thread, but
 * never while dtrain holds a lock. By default errors and warnings go to stderr
 * (unless DTRAIN_NO_STDIO).
 */
typedef enum dt_log_level {
  DTRAIN_LOG_ERROR = 1,
  DTRAIN_LOG_WARN = 2,
  DTRAIN_LOG_INFO = 3,
  DTRAIN_LOG_DEBUG = 4
} dt_log_level;

typedef void (*dt_log_fn)(dt_log_level level, dt_result code, const char *msg, void *user);

/* fn NULL restores the default logger. Messages above max_level are dropped. */
DTRAIN_API void dt_set_logger(dt_log_fn fn, void *user, dt_log_level max_level);

/* ---- build information ------------------------------------------------------ */
#define DTRAIN_FEATURE_THREADS 0x01u
#define DTRAIN_FEATURE_NET     0x02u
#define DTRAIN_FEATURE_STDIO   0x04u
#define DTRAIN_FEATURE_CBLAS   0x08u
#define DTRAIN_FEATURE_SIMD    0x10u
#define DTRAIN_FEATURE_MPI     0x20u
#define DTRAIN_FEATURE_ZLIB    0x40u
#define DTRAIN_FEATURE_DEBUG   0x80u
#define DTRAIN_FEATURE_MALLOC  0x100u /* the built-in allocator may call malloc (not DTRAIN_NO_MALLOC) */
#define DTRAIN_FEATURE_DIST    0x200u /* strategies beyond one_device, communicators, networking (not DTRAIN_NO_DIST) */
#define DTRAIN_FEATURE_DATA    0x400u /* the data loaders: IDX/gzip, CSV, NPY, text, datasets (not DTRAIN_NO_DATA) */
#define DTRAIN_FEATURE_FIT     0x800u /* dt_fit, its progress output, CSV and SVG chart (not DTRAIN_NO_FIT) */

/* Bit set of DTRAIN_FEATURE_* compiled into the implementation. */
DTRAIN_API unsigned dt_build_features(void);
/* One line: version, compiler and features, e.g.
 * "dtrain 0.1.0 (gcc 12.2) threads=yes net=yes stdio=yes cblas=no ... dist=yes data=yes fit=yes isa=avx512".
 * isa=: the widest kernel path (portable, avx2, avx512, neon) this build has
 * on this CPU, the one used unless DTRAIN_ISA or dt_sgemm_use_isa forces
 * another (dt_sgemm_kernel() names the GEMM's path in use). Static storage. */
DTRAIN_API const char *dt_build_info(void);

/* ---- RNG: xoshiro256** seeded by splitmix64; same numbers on every platform.
 * A NULL generator: dt_rng_seed does nothing; the draws return 0 (NaN for
 * dt_rng_uniform and dt_rng_normal) and dt_rng_shuffle leaves idx alone, all
 * with DTRAIN_ERR_NULL_ARG in dt_last_error(). */
typedef struct dt_rng { uint64_t s[4]; } dt_rng;

DTRAIN_API void dt_rng_seed(dt_rng *r, uint64_t seed);
DTRAIN_API uint64_t dt_rng_u64(dt_rng *r);
/* Uniform integer in [0, n), n > 0, without modulo bias. */
DTRAIN_API uint64_t dt_rng_below(dt_rng *r, uint64_t n);
/* Uniform float in [0, 1) with 24 random bits. */
DTRAIN_API float dt_rng_uniform(dt_rng *r);
/* Standard normal (Box-Muller computed in double, rounded to float). */
DTRAIN_API float dt_rng_normal(dt_rng *r);
/* Fisher-Yates shuffle of n int32 indices. */
DTRAIN_API void dt_rng_shuffle(dt_rng *r, int32_t *idx, int64_t n);

/* Seconds on a monotonic clock (CLOCK_MONOTONIC: never jumps when the
 * system time is set), for timing and progress; only differences mean
 * anything. Without a monotonic clock (no POSIX), the C11 calendar clock. */
DTRAIN_API double dt_time_now(void);

/* ---- per-op profile ---------------------------------------------------------------
 * Where a training step's time goes: dt_profile_start() zeroes the process's
 * profile and turns it on; from then on every op's forward (its own time, not
 * that of the ops it is built from: a linear layer's matrix product is charged
 * to dt_matmul), every tape node's backward, dt_optim_step (update),
 * dt_loader_next (data) and the communicators' collectives (comm) add their
 * calls and wall seconds, from every thread (replica threads add up: on N
 * replicas the sum can reach N times the wall time). dt_profile_stop() turns
 * it off; the figures stay readable until the next start (dt_profile_resume
 * goes on adding to them). Off, the hooks cost
 * one load each. Time outside any op (the caller's code, waiting for a
 * barrier) is in no entry: compare the sum with the wall time. */
typedef enum dt_profile_phase {
  DTRAIN_PROFILE_FORWARD = 0,
  DTRAIN_PROFILE_BACKWARD = 1,
  DTRAIN_PROFILE_UPDATE = 2, /* the optimizer */
  DTRAIN_PROFILE_DATA = 3,   /* the loader */
  DTRAIN_PROFILE_COMM = 4,   /* collectives, parameter-store pushes and pulls */
  DTRAIN_PROFILE_CHECKPOINT = 5 /* dt_checkpoint_save and its variants */
} dt_profile_phase;

typedef struct dt_profile_entry {
  const char *name; /* the op's name (static storage), e.g. "dt_matmul", "dt_optim_step" */
  dt_profile_phase phase;
  int64_t calls;
  double seconds;
} dt_profile_entry;

DTRAIN_API void dt_profile_start(void);
DTRAIN_API void dt_profile_stop(void);
/* On again without zeroing: leave out a part of the run (an evaluation). */
DTRAIN_API void dt_profile_resume(void);
/* The entries with any calls or time, longest first: the first min(n, cap) of
 * them into out; returns n (-1 for out NULL with cap > 0, or cap < 0). */
DTRAIN_API int dt_profile_read(dt_profile_entry *out, int cap);
DTRAIN_API const char *dt_profile_phase_name(dt_profile_phase phase); /* "forward", ... */
/* The profile as a table, one op kind a line (calls, total ms, us per step when
 * steps > 0, share of wall_seconds when > 0, else of the profiled sum) and a
 * line of shares by phase, NUL-terminated into buf (cap bytes, cut short to
 * fit). Returns the length the whole text needs (snprintf's rule), -1 on bad
 * arguments. */
DTRAIN_API int64_t dt_profile_format(char *buf, size_t cap, int64_t steps, double wall_seconds);

/* ---- timelines ----------------------------------------------------------------------
 * dt_trace_start(path) records, from every thread, what the profile counts
 * (each op's forward pieces, each backward, the optimizer, the loader, each
 * collective, parameter-store push and pull, checkpoint) as spans on that
 * thread's timeline, with the waits at barriers and each strategy step;
 * dt_trace_stop() writes them to path as Chrome trace-event JSON (open it in
 * https://ui.perfetto.dev or chrome://tracing; tools/dtrain-trace merges the
 * files of several processes and draws an SVG). The environment variable
 * DTRAIN_TRACE=path does the same for a whole run without a code change: the
 * trace starts with the first graph, communicator or parameter server and is
 * written at exit. A process that has a role (dt_trace_set_process; the TCP
 * and MPI communicators name theirs "worker" and their rank, parameter
 * servers "server" and their index) writes "run.worker1.json" for path
 * "run.json". Each thread keeps up to 2^21 spans (64 MiB); later ones are
 * counted in the file's "dropped". Off, the hooks cost one load each.
 * dt_trace_stop fails (DTRAIN_ERR_STATE) when no trace runs and
 * (DTRAIN_ERR_IO) when the file cannot be written, leaving what was at path;
 * DTRAIN_ERR_UNSUPPORTED under DTRAIN_NO_STDIO. */
DTRAIN_API dt_result dt_trace_start(const char *path);
DTRAIN_API dt_result dt_trace_stop(void);
DTRAIN_API int dt_trace_active(void);
/* The calling thread's name on the timeline ("replica 1"; up to 47 bytes;
 * NULL or "": "thread N"). */
DTRAIN_API void dt_trace_name_thread(const char *name);
/* The process's role and index ("worker", 2): its name and pid on a merged
 * timeline, and its file name. role NULL or "" clears it. */
DTRAIN_API void dt_trace_set_process(const char *role, int index);

/* Can a file be written at path (is_dir: in the directory path)? Does what
 * dtrain's writers do -- creates their exclusive temporary next to path and
 * removes it -- so a missing directory, permissions, a read-only mount show
 * before a run rather than when its first output is written. DTRAIN_OK, or
 * DTRAIN_ERR_IO with "cannot create a file in directory '...': why"
 * (DTRAIN_ERR_UNSUPPORTED with DTRAIN_NO_STDIO). */
DTRAIN_API dt_result dt_check_writable(const char *path, int is_dir);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_BASE_H */
