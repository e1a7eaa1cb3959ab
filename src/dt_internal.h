/* ===========================================================================
 * dt_internal.h -- private declarations shared by the implementation files
 * ===========================================================================
 * Names: dt__name (functions), DT__NAME (macros), dt__<module>_<name> for
 * file-scope statics. DTRAIN_PRIVATE marks cross-file internal functions: they
 * are static in the amalgamated dtrain.h and extern when src/ is compiled
 * file by file.
 */
#ifndef DTRAIN_INTERNAL_H
#define DTRAIN_INTERNAL_H

/* A source file compiled alone (not through dtrain.h) gets POSIX here. */
#if !defined(DTRAIN__AMALGAMATED) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_WIN32)
#  define _POSIX_C_SOURCE 200809L
#endif

#include "dt_base.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_fit.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_strategy.h"
#include "dt_net.h"
#include "dt_device.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h> /* vsnprintf; FILE I/O only without DTRAIN_NO_STDIO */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__GNUC__) || defined(__clang__)
#  define DT__UNUSED __attribute__((unused))
#  define DT__PRINTF(f, a) __attribute__((format(printf, f, a)))
#  define DT__RESTRICT __restrict__
#else
#  define DT__UNUSED
#  define DT__PRINTF(f, a)
#  define DT__RESTRICT
#endif

#ifdef DTRAIN__AMALGAMATED
#  define DTRAIN_PRIVATE static DT__UNUSED
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

/* ---- base (dt_base.c) ------------------------------------------------------- */

/* Aligned allocation through the installed allocator. NULL on failure (no error set). */
DTRAIN_PRIVATE void *dt__alloc(size_t size);
DTRAIN_PRIVATE void *dt__calloc(size_t size);
/* size must be the size passed to dt__alloc; ptr NULL is a no-op. */
DTRAIN_PRIVATE void dt__free(void *ptr, size_t size);
/* Grow a block: copies min(old,new) bytes; frees the old on success only. */
DTRAIN_PRIVATE void *dt__realloc(void *ptr, size_t old_size, size_t new_size);

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

/* ---- RNG (dt_rng.c) ---------------------------------------------------------- */
DTRAIN_PRIVATE uint64_t dt__splitmix64(uint64_t *state);

/* ---- graph internals (dt_tensor.c) --------------------------------------------
 * Op pattern:
 *   dt_tensor *dt_relu(dt_graph *g, dt_tensor *x) {
 *     if (!dt__begin(g, "dt_relu", 1, x)) return NULL;
 *     dt_tensor *y = dt__new_like(g, x); if (!y) return NULL;
 *     ...forward...
 *     dt__record(g, y, "relu", dt__relu_backward, x, NULL, NULL);
 *     return dt__finish(g, y);
 *   }
 *   static void dt__relu_backward(dt_graph *g, dt_tensor *y) {
 *     float *gx = dt__grad(g, y->src[0]);   // NULL: input needs no gradient
 *     if (gx) ... gx[i] += y->grad[i] * ...;  // always accumulate
 *   }
 */
typedef struct dt__chunk dt__chunk;
typedef struct dt__dchunk dt__dchunk;

struct dt_graph {
  dt_params *params;
  float *bound_data, *bound_grad; /* NULL data: the params' own buffers */
  int bound_own;                  /* 1: use params' own buffers */
  dt_tensor *pviews;              /* one view per parameter */
  int npviews;
  size_t pviews_bytes;
  /* arena */
  dt__chunk *chunks;              /* newest first */
  size_t used, peak, reserved, first_block;
  /* tape */
  dt_tensor **tape;
  int64_t ntape, tape_cap;
  /* state */
  dt_result err;
  char msg[DT__MSG_CAP];
  int training, grad_enabled, check_numerics, backward_done;
  dt_rng rng;
  /* device (dt_device.h): NULL on the CPU. Tensor data and gradients come
   * from the device arena `dchunks`; headers from the host arena above. */
  dt_device *device;
  dt__dchunk *dchunks;
  size_t dreserved;
  float *dparam_data, *dparam_grad; /* the device copy of the params */
  size_t dparam_n;
};

/* Checks the graph is usable and the n tensor arguments are non-NULL and
 * belong to g. Returns 0 (and records an error if none yet) otherwise. */
DTRAIN_PRIVATE int dt__begin(dt_graph *g, const char *op, int n, ...);
/* Record the first error on g (also as the thread's error). Returns NULL. */
DTRAIN_PRIVATE void *dt__fail(dt_graph *g, dt_result code, const char *fmt, ...) DT__PRINTF(3, 4);
/* Arena memory, 64-byte aligned; NULL and NOMEM error on failure. */
DTRAIN_PRIVATE void *dt__arena_alloc(dt_graph *g, size_t bytes);
DTRAIN_PRIVATE float *dt__arena_floats(dt_graph *g, int64_t n);     /* uninitialised */
DTRAIN_PRIVATE float *dt__arena_zeros(dt_graph *g, int64_t n);
/* New tensor with uninitialised data; validates shape (dims >= 1). */
DTRAIN_PRIVATE dt_tensor *dt__new(dt_graph *g, const char *op, int ndim, const int64_t *shape);
DTRAIN_PRIVATE dt_tensor *dt__new_like(dt_graph *g, const char *op, const dt_tensor *x);
/* Tensor header aliasing `data` (views). */
DTRAIN_PRIVATE dt_tensor *dt__new_view(dt_graph *g, const char *op, int ndim, const int64_t *shape, float *data);
/* Connect out to its inputs and put it on the tape when a gradient can flow. */
DTRAIN_PRIVATE void dt__record(dt_graph *g, dt_tensor *out, const char *op, dt_backward_fn fn,
                               dt_tensor *a, dt_tensor *b, dt_tensor *c);
DTRAIN_PRIVATE dt_tensor *dt__finish(dt_graph *g, dt_tensor *out);
/* Gradient buffer of t (allocated zeroed on first use) or NULL if t needs none. */
DTRAIN_PRIVATE float *dt__grad(dt_graph *g, dt_tensor *t);
/* Normalise a possibly negative axis; -1 if out of range. */
DTRAIN_PRIVATE int dt__axis(int axis, int ndim);
/* A shape as text, e.g. "[64,10]", into buf (cap bytes); returns buf. */
DTRAIN_PRIVATE const char *dt__shape_text(int ndim, const int64_t *shape, char *buf, size_t cap);
/* Row-major strides of t into st (elements). */
DTRAIN_PRIVATE void dt__strides(const dt_tensor *t, int64_t *st);

/* ---- device (dt_device.c) ----------------------------------------------------------
 * Every op that has a device path calls its dt__dev_* twin right after
 * dt__begin when g->device is set; dt__begin already refused (with
 * DTRAIN_ERR_UNSUPPORTED) every op that has none. */
DTRAIN_PRIVATE int dt__dev_op_ok(const char *op);
DTRAIN_PRIVATE void dt__dev_free_chunks(dt_graph *g);
DTRAIN_PRIVATE void *dt__dev_arena(dt_graph *g, size_t bytes);
DTRAIN_PRIVATE void dt__dev_reset(dt_graph *g);
/* Runs kernel k; on failure fails g with op's name and the device message. */
DTRAIN_PRIVATE int dt__dev_run(dt_graph *g, const char *op, dt_kernel k, const dt_kernel_args *a);
DTRAIN_PRIVATE int dt__dev_copy(dt_graph *g, const char *op, void *dst, const void *src, size_t bytes, dt_copy_kind kind);
DTRAIN_PRIVATE int dt__dev_zero(dt_graph *g, const char *op, void *p, size_t bytes);
DTRAIN_PRIVATE dt_result dt__dev_graph_init(dt_graph *g);
DTRAIN_PRIVATE dt_tensor *dt__dev_check_numerics(dt_graph *g, dt_tensor *out);
DTRAIN_PRIVATE dt_tensor *dt__dev_binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_unary(dt_graph *g, dt_tensor *x, dt_kernel fwd, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_map(dt_graph *g, dt_tensor *x, int fn, float s, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_transpose(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t batch,
                                            int64_t m, int64_t n);
DTRAIN_PRIVATE dt_tensor *dt__dev_dropout(dt_graph *g, dt_tensor *x, float p);
DTRAIN_PRIVATE dt_tensor *dt__dev_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, int64_t d);
DTRAIN_PRIVATE dt_tensor *dt__dev_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps,
                                             int64_t rows, int64_t d);
DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_axis(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t outer,
                                              int64_t len, int64_t inner, int mean, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int64_t rows,
                                         int64_t in, int64_t out, int ndim, const int64_t *shape);
DTRAIN_PRIVATE dt_tensor *dt__dev_softmax(dt_graph *g, dt_tensor *x, int ax, int is_log, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_xent(dt_graph *g, dt_tensor *x, const int32_t *labels, int64_t rows, int64_t c);
DTRAIN_PRIVATE dt_tensor *dt__dev_mse(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_PRIVATE dt_tensor *dt__dev_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding);
DTRAIN_PRIVATE dt_tensor *dt__dev_pool(dt_graph *g, dt_tensor *x, int kernel, int stride, int is_max, const char *op);
/* gx += gy over n elements (the backward of no-copy views). */
DTRAIN_PRIVATE dt_tensor *dt__dev_bmm(dt_graph *g, dt_tensor *y, dt_tensor *a, dt_tensor *b, const char *op);
DTRAIN_PRIVATE dt_tensor *dt__dev_permute(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const int64_t *perm);
DTRAIN_PRIVATE dt_tensor *dt__dev_slice(dt_graph *g, dt_tensor *x, const char *op, int ndim, const int64_t *shape,
                                        int64_t outer, int64_t dim, int64_t inner, int64_t start, int64_t len);
DTRAIN_PRIVATE dt_tensor *dt__dev_concat(dt_graph *g, dt_tensor *const *xs, int n, dt_tensor **list, int ndim,
                                         const int64_t *shape, int64_t outer, int64_t inner, int ax);
DTRAIN_PRIVATE dt_tensor *dt__dev_causal_mask(dt_graph *g, dt_tensor *x, int64_t t);
DTRAIN_PRIVATE dt_tensor *dt__dev_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                             dt_tensor *running_mean, dt_tensor *running_var, float momentum,
                                             float eps, int64_t nb, int64_t c, int64_t hw, int batch);
DTRAIN_PRIVATE void dt__dev_acc(dt_graph *g, float *gx, const float *gy, int64_t n, const char *op);

/* ---- params internals (dt_params.c) ------------------------------------------------ */
/* Layout of parameter `index` (no checks: index must be valid). */
DTRAIN_PRIVATE int dt__params_view(const dt_params *p, int index, size_t *offset, int *ndim,
                                   const int64_t **shape, int *trainable);
/* Range [begin,end) of parameter `index` in the flat buffers; 0 past the end. */
DTRAIN_PRIVATE int dt__params_range(const dt_params *p, int index, size_t *begin, size_t *end,
                                    int *trainable, int *decay);

/* ---- GEMM (dt_gemm.c) ---------------------------------------------------------
 * dt_sgemm is the public entry; ops call it directly. */

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
/* Marks (1) or unmarks (0) the calling thread as a strategy replica; returns
 * the previous mark. */
DTRAIN_PRIVATE int dt__par_set_replica(int on);

#endif /* DTRAIN_INTERNAL_H */
