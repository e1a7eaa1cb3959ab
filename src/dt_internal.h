/* ===========================================================================
 * dt_internal.h -- private declarations shared by the implementation files
 * ===========================================================================
 * Names: dt__name (functions), DT__NAME (macros), dt__<module>_<name> for
 * file-scope statics. DTRAIN_PRIVATE marks cross-file internal functions: they
 * are static in the amalgamated dtrain.h and extern when src/ is compiled
 * file by file.
 *
 * This is the base layer's private header: it includes only dt_base.h. The
 * private declarations of the layers above live in their own headers, each
 * including the ones below it (see LAYERS in the manual):
 *   dt_tensor_internal.h   the graph, its arena and tape, the device arena
 *   dt_ops_internal.h      the device twins of the ops
 *   dt_params_internal.h   parameter layouts
 * A source file includes dt_internal.h, the public headers of its layer and
 * below, and the private headers it needs.
 */
#ifndef DTRAIN_INTERNAL_H
#define DTRAIN_INTERNAL_H

/* A source file compiled alone (not through dtrain.h) gets POSIX here. */
#if !defined(DTRAIN__AMALGAMATED) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_WIN32)
#  define _POSIX_C_SOURCE 200809L
#endif

#include "dt_base.h"

/* Windows (MinGW-w64, MSVC): Winsock 2 before <windows.h>, which would
 * otherwise bring the old winsock.h; lean, and without the min/max macros. */
#if defined(_WIN32)
#  ifndef WIN32_LEAN_AND_MEAN
#    define WIN32_LEAN_AND_MEAN
#  endif
#  ifndef NOMINMAX
#    define NOMINMAX
#  endif
#  ifndef DTRAIN_NO_NET
#    include <winsock2.h>
#    include <ws2tcpip.h>
#  endif
#  include <windows.h>
#  include <ntsecapi.h> /* RtlGenRandom (dt_handshake.c) */
/* <windef.h>'s empty annotations would take these common words from the program */
#  undef near
#  undef far
#  undef IN
#  undef OUT
#  undef OPTIONAL
#endif

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h> /* vsnprintf; FILE I/O only without DTRAIN_NO_STDIO */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(DT__POSIX_LATE) /* in strict ISO mode <stdio.h> may have come before POSIX (see dt_base.h) */
extern FILE *fdopen(int fd, const char *mode);
extern int fileno(FILE *f);
#endif

/* MinGW's default runtime (msvcrt) printf lacks C99's %zu and %lld: the
 * implementation formats with MinGW's own C99 printf family instead. */
#if defined(__MINGW32__) && !(defined(__USE_MINGW_ANSI_STDIO) && __USE_MINGW_ANSI_STDIO)
#  undef printf
#  undef fprintf
#  undef snprintf
#  undef vsnprintf
#  undef vfprintf
#  define printf __mingw_printf
#  define fprintf __mingw_fprintf
#  define snprintf __mingw_snprintf
#  define vsnprintf __mingw_vsnprintf
#  define vfprintf __mingw_vfprintf
#endif

#if defined(__MINGW32__)
#  define DT__UNUSED __attribute__((unused))
#  define DT__PRINTF(f, a) __attribute__((format(gnu_printf, f, a)))
#  define DT__RESTRICT __restrict__
#elif defined(__GNUC__) || defined(__clang__)
#  define DT__UNUSED __attribute__((unused))
#  define DT__PRINTF(f, a) __attribute__((format(printf, f, a)))
#  define DT__RESTRICT __restrict__
#else
#  define DT__UNUSED
#  define DT__PRINTF(f, a)
#  define DT__RESTRICT
#endif

#if defined(DTRAIN__AMALGAMATED) && !defined(DTRAIN_IMPLEMENTATION_PART) /* parts call each other's */
#  define DTRAIN_PRIVATE static DT__UNUSED
#elif defined(DTRAIN__LINKED_TEST) && defined(__cplusplus) /* a C++ test linking the C parts */
#  define DTRAIN_PRIVATE extern "C"
#else
#  define DTRAIN_PRIVATE
#endif

#if defined(DTRAIN_NO_THREADS)
#  define DT__TLS
#elif defined(__cplusplus)
#  define DT__TLS thread_local
#elif defined(_MSC_VER)
#  define DT__TLS __declspec(thread)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L && !defined(__STDC_NO_THREADS__)
#  define DT__TLS _Thread_local
#else
#  define DT__TLS __thread
#endif

#define DT__ALIGN 64
/* Most elements one tensor may have (2^40 floats = 4 TiB): a guard against
 * absurd shapes. As uint64_t so that it means the same on 32-bit targets,
 * where size_t overflows first (callers also check bytes with dt__mul_size). */
#define DT__MAX_ELEMS ((uint64_t)1 << 40)
/* A function, not a macro, so 32-bit builds do not warn that a size_t
 * comparison against 2^40 is always false. */
static DT__UNUSED int dt__too_many(uint64_t n) { return n > DT__MAX_ELEMS; }
#define DT__MSG_CAP 320
#define DT__MIN(a, b) ((a) < (b) ? (a) : (b))
#define DT__MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- the per-op profile's hooks (dt_profile.c, base) ---------------------------------
 * fwd_begin: an op starts (dt__begin); fwd_end: its output is recorded or
 * finished. t0/add: time a region, `int64_t t = dt__prof_t0(); ...;
 * dt__prof_add(name, phase, t);` (t0 is 0 when the profile is off and add then
 * does nothing). */
DTRAIN_PRIVATE void dt__prof_fwd_begin(const char *op);
DTRAIN_PRIVATE void dt__prof_fwd_end(void);
DTRAIN_PRIVATE int64_t dt__prof_t0(void);
DTRAIN_PRIVATE void dt__prof_add(const char *name, dt_profile_phase phase, int64_t t0);
/* add, to the table only: a region too small and frequent for the timeline
 * (an optimizer block inside a parameter-store push, whose span covers it) */
DTRAIN_PRIVATE void dt__prof_add_table(const char *name, dt_profile_phase phase, int64_t t0);
/* The timeline (dt_profile.c too): tracing reads its bit of the hooks'
 * word; trace_t0/trace_end time a trace-only span (a strategy
 * step: not in the profile's table, whose rows would count it twice);
 * trace_wait records a wait of `seconds` that ends now; trace_span appends
 * [t0, t1) (ns of the monotonic clock) to the calling thread's buffer; trace_env
 * starts the trace DTRAIN_TRACE names, once per process (dt_graph_create,
 * the communicators, the parameter servers call it). cat: a
 * dt_profile_phase or one of these. */
#define DT__TRACE_WAIT 16
#define DT__TRACE_STEP 17
DTRAIN_PRIVATE int dt__prof_tracing(void);
DTRAIN_PRIVATE int64_t dt__trace_t0(void);
DTRAIN_PRIVATE void dt__trace_end(const char *name, int cat, int64_t t0);
DTRAIN_PRIVATE void dt__trace_wait(const char *name, double seconds);
DTRAIN_PRIVATE void dt__trace_span(const char *name, int cat, int64_t t0, int64_t t1);
DTRAIN_PRIVATE void dt__trace_env(void);
/* One estimate of a peer's monotonic clock against ours, from a handshake
 * (dt_handshake.c): offset_s = the peer's clock minus ours, exact within
 * delay_s / 2 (delay_s: the round trip's time on the wire). Kept per peer,
 * the one of least delay; every trace file's otherData.clocks lists them, and
 * tools/dtrain-trace merge puts the files on one axis with them. */
DTRAIN_PRIVATE void dt__trace_clock_note(int server, int index, double offset_s, double delay_s);
/* The estimate kept for that peer: 1 and its offset and delay, or 0 if none was noted. */
DTRAIN_PRIVATE int dt__trace_clock_get(int server, int index, double *offset_s, double *delay_s);

/* ---- base (dt_base.c) ------------------------------------------------------- */

/* Aligned allocation through the installed allocator. NULL on failure (no error set). */
DTRAIN_PRIVATE void *dt__alloc(size_t size);
DTRAIN_PRIVATE void *dt__calloc(size_t size);
/* Give freed heap memory back to the system where the C library keeps it
 * (glibc, the built-in allocator); a no-op elsewhere. */
DTRAIN_PRIVATE void dt__heap_trim(void);
/* size must be the size passed to dt__alloc; ptr NULL is a no-op. */
DTRAIN_PRIVATE void dt__free(void *ptr, size_t size);
/* Grow a block: copies min(old,new) bytes; frees the old on success only. */
DTRAIN_PRIVATE void *dt__realloc(void *ptr, size_t old_size, size_t new_size);

/* A work buffer of at least size bytes (DT__ALIGN-aligned) from one of a few
 * process-wide slots, kept between claims; NULL when none can be had (all
 * busy, no memory, a user's allocator): fall back to the stack. *slot is for
 * dt__scratch_release (-1 with NULL; releasing -1 is a no-op). */
DTRAIN_PRIVATE void *dt__scratch_claim(size_t size, int *slot);
DTRAIN_PRIVATE void dt__scratch_release(int slot);

/* Record a thread-local error (and log it at `level`); returns code. */
DTRAIN_PRIVATE dt_result dt__error(dt_result code, const char *fmt, ...) DT__PRINTF(2, 3);
DTRAIN_PRIVATE void dt__log(dt_log_level level, dt_result code, const char *fmt, ...) DT__PRINTF(3, 4);
/* Layered code (the network backends) wraps an inner error in context
 * several times ("worker 0: allreduce #7: receive from worker 1: ..."). Between
 * dt__quiet_push() and dt__quiet_pop() (per thread, nestable) dt__error sets the
 * message without logging it; the outermost pop logs the final message once
 * when rc is an error (not DTRAIN_ERR_ABORTED, which has no message of its
 * own), so one failure is one log line. dt__quiet_pop(DTRAIN_OK) logs nothing. */
DTRAIN_PRIVATE void dt__quiet_push(void);
DTRAIN_PRIVATE dt_result dt__quiet_pop(dt_result rc);

/* a*b with overflow check into *out; returns 0 on overflow. */
DTRAIN_PRIVATE int dt__mul_size(size_t a, size_t b, size_t *out);

/* Gradient clipping by the global L2 norm, as PyTorch's clip_grad_norm_: a
 * gradient whose norm is above clip is scaled by clip / (norm + 1e-6).
 * Returns that factor, or 1 when norm <= clip (nothing to scale: callers skip
 * the pass). norm must be finite (callers refuse or skip a non-finite norm
 * first). The one formula of dt_clip_grad_norm, the optimizers' steps on the
 * host and on a device (dt_optim.c) and the strategies' clipping. */
static DT__UNUSED float dt__clip_scale(double norm, float clip) {
  return norm > (double)clip ? (float)((double)clip / (norm + 1e-6)) : 1.0f;
}

/* ---- bytes: fixed byte order and FNV-1a ----------------------------------------------
 * Files and the wire are little-endian whatever the host is, so fields are
 * read and written a byte at a time (IDX, the one big-endian format, has
 * dt__get_be32). dt__fnv1a64 is 64-bit FNV-1a: start from DT__FNV64_OFFSET,
 * feed bytes; a hash of several pieces chains h through the calls. */
#define DT__FNV64_OFFSET 0xcbf29ce484222325ULL
#define DT__FNV64_PRIME 0x100000001b3ULL
static DT__UNUSED uint16_t dt__get_le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static DT__UNUSED uint32_t dt__get_le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static DT__UNUSED uint64_t dt__get_le64(const unsigned char *p) {
  return (uint64_t)dt__get_le32(p) | (uint64_t)dt__get_le32(p + 4) << 32;
}
static DT__UNUSED uint32_t dt__get_be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}
static DT__UNUSED void dt__put_le16(unsigned char *p, uint16_t v) {
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
}
static DT__UNUSED void dt__put_le32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static DT__UNUSED void dt__put_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
/* n floats to/from their little-endian IEEE-754 bytes (4 per float); a
 * plain copy on a host known to be little-endian. */
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#  define DT__HOST_LE 1
#else
#  define DT__HOST_LE 0
#endif
/* The host's byte order at run time, for formats that say which they use
 * (NPY's '<', '>', '='): 1 on a little-endian host. Compilers fold it. */
static DT__UNUSED int dt__host_le(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}
static DT__UNUSED void dt__put_f32le(unsigned char *dst, const float *src, size_t n) {
  if (DT__HOST_LE) {
    if (n) memcpy(dst, src, 4 * n);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &src[i], 4);
    dt__put_le32(dst + 4 * i, u);
  }
}
static DT__UNUSED void dt__get_f32le(float *dst, const unsigned char *src, size_t n) {
  if (DT__HOST_LE) {
    if (n) memcpy(dst, src, 4 * n);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u = dt__get_le32(src + 4 * i);
    memcpy(&dst[i], &u, 4);
  }
}
static DT__UNUSED uint64_t dt__fnv1a64(uint64_t h, const void *data, size_t n) {
  const unsigned char *b = (const unsigned char *)data;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * DT__FNV64_PRIME;
  return h;
}

/* ---- CPU features (dt_base.c) ---------------------------------------------------
 * DT__CPU_X86: an x86-64 build with GCC or clang and SIMD, where the AVX2 and
 * AVX-512 kernels are compiled in (function attributes) and the CPU is asked
 * at run time which it can run. Elsewhere each answer is 0. */
#if !defined(DTRAIN_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__CPU_X86 1
#endif
DTRAIN_PRIVATE int dt__cpu_avx2(void);   /* AVX2 and FMA */
DTRAIN_PRIVATE int dt__cpu_avx512(void); /* those and AVX-512F */
DTRAIN_PRIVATE int dt__cpu_bf16(void);   /* those and AVX-512BW and AVX512_BF16 */

/* ---- RNG (dt_rng.c) ---------------------------------------------------------- */
DTRAIN_PRIVATE uint64_t dt__splitmix64(uint64_t *state);

/* ---- intra-op threads (dt_platform.c) -------------------------------------------
 * One process-wide persistent pool (dt_set_threads / DTRAIN_THREADS) that
 * kernels split their work over:
 *   int t = dt__par_threads();           threads this thread may use now
 *   if (t > 1 && work is big) dt__par_run(parts, fn, arg);
 * dt__par_run calls fn(arg, part, nparts) once for each part in [0, nparts),
 * on the pool's threads and the caller, and returns when all have returned.
 * When the pool is busy (another thread is using it) or cannot be created,
 * the caller runs every part itself, so a kernel whose parts write disjoint
 * outputs gives the same result either way. A thread that runs a replica of
 * a multi-replica strategy is marked (dt__par_set_replica) and gets 1, so
 * replicas and intra-op threads never oversubscribe the cores. */
typedef void (*dt__par_fn)(void *arg, int part, int nparts);
DTRAIN_PRIVATE int dt__par_threads(void);
DTRAIN_PRIVATE void dt__par_run(int nparts, dt__par_fn fn, void *arg);
/* fn(arg, lo, hi) over [0, n) cut into one run per thread, each boundary a
 * multiple of grain, when n >= min_n and more than one thread may be used;
 * else fn(arg, 0, n) on the caller. For loops whose elements are computed
 * independently (the result does not depend on the cut). */
typedef void (*dt__par_range_fn)(void *arg, int64_t lo, int64_t hi);
DTRAIN_PRIVATE void dt__par_range(int64_t n, int64_t grain, int64_t min_n, dt__par_range_fn fn, void *arg);
/* Marks (1) or unmarks (0) the calling thread as a strategy replica; returns
 * the previous mark. */
DTRAIN_PRIVATE int dt__par_set_replica(int on);

/* ---- subnormal floats (dt_platform.c) -------------------------------------------
 * Training drives gradients and Adam's second moments below FLT_MIN, and on
 * x86 every subnormal operand or result takes a slow microcode path: a long
 * run's steps got 2.6x slower (the MLP, 3000 steps). dtrain's own work runs
 * with flush-to-zero and denormals-are-zero (x86 MXCSR FTZ|DAZ, AArch64 FPCR
 * FZ) unless dt_set_flush_denormals(0) / DTRAIN_FLUSH_DENORMALS=0; the
 * caller's floating-point environment is restored on the way out:
 *   unsigned long fp = dt__fp_enter();  ...  dt__fp_leave(fp); */
DTRAIN_PRIVATE unsigned long dt__fp_enter(void);
DTRAIN_PRIVATE void dt__fp_leave(unsigned long saved);

/* ---- float vectors (dt_platform.c) --------------------------------------------------
 * dst[i] = a[i] + b[i] for i < n; dst may be a or b (not a partial overlap).
 * Element by element, so the result is bitwise that of the plain loop; 8
 * floats at a time with AVX (picked at run time), 4 with SSE or NEON. A
 * plain -O2 build of the loop stays scalar (gcc vectorises it only from -O3),
 * and the sums of a replicated step's gradients run over every parameter. */
DTRAIN_PRIVATE void dt__vec_add(float *dst, const float *a, const float *b, size_t n);
/* dt__vec_add that also says whether every sum is finite (1) or not (0): the
 * check rides on the values in registers, no second pass. */
DTRAIN_PRIVATE int dt__vec_add_finite(float *dst, const float *a, const float *b, size_t n);
/* dst[i] = (a[i] + b[i]) * scale (b NULL: a[i] * scale), element by element
 * as dt__vec_add; dst may be a or b. */
DTRAIN_PRIVATE void dt__vec_add_scale(float *dst, const float *a, const float *b, float scale, size_t n);

#endif /* DTRAIN_INTERNAL_H */
