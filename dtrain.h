/* dtrain.h -- train neural networks from plain C.             MIT license
 *
 * One stb-style header: float32 tensors, reverse-mode autograd, the ops for
 * MLPs, CNNs, recurrent nets and small transformers, optimizers, data loaders
 * (IDX/gzip, CSV, NPY, text), safetensors checkpoints, a training loop with
 * progress, metrics CSV and SVG charts, and data-parallel training on threads
 * (mirrored, central storage, asynchronous Hogwild). C11 + libm + pthreads.
 *
 * INCLUDING
 *   In exactly one C file, before the include (ideally as its first include):
 *     #define DTRAIN_IMPLEMENTATION
 *     #include "dtrain.h"
 *   Everywhere else just #include "dtrain.h". Link with -lm -lpthread.
 *
 * EXAMPLE (a 2-8-1 network learning XOR; examples/01_xor.c is the full program)
 *   dt_params *P = dt_params_create(42);
 *   dt_nn_linear hid, out;
 *   dt_nn_linear_init(&hid, P, "hidden", 2, 8, 1);
 *   dt_nn_linear_init(&out, P, "out", 8, 1, 1);
 *   dt_optim_desc od = {0};  od.kind = DTRAIN_OPTIM_ADAM;  od.lr = 0.05f;
 *   dt_optim *opt = dt_optim_create(P, &od);
 *   dt_graph *g = dt_graph_create(P, NULL);
 *   for (int step = 0; step < 2000; step++) {
 *     dt_graph_reset(g);                        // forget last step, keep memory
 *     dt_params_zero_grad(P);
 *     dt_tensor *x = dt_tensor_from(g, 2, xs, X), *y = dt_tensor_from(g, 2, ys, Y);
 *     dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &hid, x));
 *     dt_tensor *p = dt_sigmoid(g, dt_nn_linear_forward(g, &out, h));
 *     dt_tensor *loss = dt_mse(g, p, y);
 *     if (dt_backward(g, loss) != DTRAIN_OK) { puts(dt_graph_message(g)); break; }
 *     dt_optim_step(opt);
 *   }
 *   dt_graph_destroy(g); dt_optim_destroy(opt); dt_params_destroy(P);
 *
 * CONFIGURATION (define before the include; the same in every TU)
 *   DTRAIN_IMPLEMENTATION   emit the implementation here
 *   DTRAIN_STATIC           all functions static (private copy per TU)
 *   DTRAIN_USE_CBLAS        GEMM through cblas_sgemm (link -lopenblas or similar)
 *   DTRAIN_NO_THREADS       no pthreads; threaded APIs give DTRAIN_ERR_UNSUPPORTED
 *   DTRAIN_NO_NET           no sockets
 *   DTRAIN_NO_STDIO         no FILE* or stderr use
 *   DTRAIN_MALLOC/REALLOC/FREE   compile-time allocator: all three or none
 *   DTRAIN_NO_MALLOC        no libc allocator: call dt_use_fixed_memory(buf, n)
 *   Contradictory settings stop the build with an #error naming the fix.
 *   dt_build_info() / dt_build_features() report what was compiled in.
 *
 * MEMORY AND OWNERSHIP
 *   dt_params owns the flat parameter and gradient buffers (one float array
 *   each; every named parameter is a range). dt_graph owns every tensor it
 *   returns (op results, dt_tensor_new/from/wrap, dt_param views) until
 *   dt_graph_reset() or dt_graph_destroy(): never free a tensor. dt_optim owns
 *   its state buffers. destroy(NULL) is a no-op everywhere. After the first
 *   step a training step allocates nothing (the arena is kept and merged).
 *   All allocation goes through dt_set_allocator() hooks (size + alignment).
 *
 * ERRORS
 *   dt_result: 0 = DTRAIN_OK, negative codes grouped by area (DTRAIN_RESULT_LIST).
 *   Every failure also leaves a message: dt_last_error() (per thread) and, for
 *   graph building, dt_graph_message(). Ops keep the first error on the graph
 *   (sticky) and return NULL; later ops are no-ops, dt_backward returns the
 *   error: check once per step. Nothing calls exit() or abort() on bad input.
 *
 * THREADS
 *   object        may be used by
 *   dt_graph      one thread at a time (each replica has its own)
 *   dt_params     one writer at a time; readers of data concurrently with
 *                 graphs that bind their own gradient buffers
 *   dt_optim      one thread at a time (dt_optim_update on disjoint ranges may
 *                 run concurrently)
 *   logger        called from any thread, never with a lock held
 *   dt_set_allocator / dt_set_logger: at set-up, before other threads use dtrain
 *   Intra-op threads: dt_set_threads(n) (or DTRAIN_THREADS=n|auto in the
 *   environment; default 1) splits big GEMMs and Adam updates over a
 *   persistent pool of n threads, bit for bit the one-thread results. Kernels
 *   inside the replicas of a multi-replica strategy use one thread.
 *
 * DEVICES (dt_device.h; the CUDA backend is dtrain_cuda.h, built with nvcc)
 *   dt_graph_desc.device runs the same model code on a device: tensor data and
 *   gradients in device memory, headers and the tape on the host. The graph
 *   keeps a device copy of its params (dt_graph_params_upload/download);
 *   dt_optim_step_graph updates it there; dt_tensor_to_host reads results.
 *   Ops without a device kernel fail with DTRAIN_ERR_UNSUPPORTED (never a
 *   host read of device memory); dt_device.h lists the ones that run.
 *   The CUDA backend has not yet run on a GPU: its kernels' math is checked
 *   against the CPU ops in a host emulation (tests/test_cuda_emu.cc).
 *
 * WHAT IT DOES NOT DO (yet)
 *   No strided (non-contiguous) tensors: transpose/permute copy. No float16.
 *   CUDA: one GPU, kernels only for the ops dt_device.h lists, not yet run
 *   on a GPU; no multi-GPU: later milestones (see README.md and CHANGELOG.md).
 */

/* This file is generated by tools/amalgamate from src/ (see src/MANIFEST).
 * Edit src/, then run `make amalgamate`. */

#ifndef DTRAIN_H_INCLUDED
#define DTRAIN_H_INCLUDED

/* ======== begin dt_base.h ======== */
/* ===========================================================================
 * dt_base.h -- configuration, result codes, allocator and logger hooks
 * ===========================================================================
 */
#ifndef DTRAIN_BASE_H
#define DTRAIN_BASE_H

/* The implementation uses POSIX (threads, sockets, fsync, clock_gettime).
 * This only takes effect when dtrain.h is the first include of the
 * implementation file, as the manual asks. */
#if defined(DTRAIN_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && \
    !defined(_XOPEN_SOURCE) && !defined(_WIN32)
#  define _POSIX_C_SOURCE 200809L
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

/* Bit set of DTRAIN_FEATURE_* compiled into the implementation. */
DTRAIN_API unsigned dt_build_features(void);
/* One line: version, compiler and features, e.g.
 * "dtrain 0.1.0 (gcc 12.2) threads=yes net=yes stdio=yes cblas=no ...". Static storage. */
DTRAIN_API const char *dt_build_info(void);

/* Monotonic wall clock in seconds (for timing and progress). */
DTRAIN_API double dt_time_now(void);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_BASE_H */
/* ======== end dt_base.h ======== */

/* ======== begin dt_tensor.h ======== */
/* ===========================================================================
 * dt_tensor.h -- tensors, the per-step graph (arena + tape) and autograd
 * ===========================================================================
 */
#ifndef DTRAIN_TENSOR_H
#define DTRAIN_TENSOR_H

/* #include "dt_base.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

#define DTRAIN_MAX_DIMS 6

typedef struct dt_tensor dt_tensor;
typedef struct dt_graph dt_graph;
typedef struct dt_params dt_params;
typedef struct dt_device dt_device; /* dt_device.h */

/* Tensor flags. */
#define DTRAIN_TENSOR_REQUIRES_GRAD 0x01 /* gradient flows into this tensor */
#define DTRAIN_TENSOR_PARAM         0x02 /* a view of a parameter in a dt_params */
#define DTRAIN_TENSOR_VIEW          0x04 /* data aliases another tensor or user memory */

typedef void (*dt_backward_fn)(dt_graph *g, dt_tensor *out);

/* A float32 tensor: contiguous, row-major. Users read and write `data`,
 * `shape`, `ndim` and `size` directly; the rest belongs to autograd.
 *
 * Ownership: tensors made by a graph (every op result, dt_tensor_new/from/wrap)
 * live in the graph's arena until dt_graph_reset() or dt_graph_destroy();
 * never free them. Parameter views (dt_param) are owned by the graph too, but
 * their data and grad point into the flat buffers bound with the graph.
 */
struct dt_tensor {
  float *data;                      /* `size` floats */
  float *grad;                      /* NULL until backward reaches it */
  int64_t shape[DTRAIN_MAX_DIMS];   /* shape[ndim..] are 1 */
  int64_t size;                     /* product of shape[0..ndim) */
  int ndim;                         /* 0 (scalar) .. DTRAIN_MAX_DIMS */
  int flags;                        /* DTRAIN_TENSOR_* */
  /* -- autograd (private) -- */
  dt_graph *graph;
  const char *op;                   /* name of the op that produced it */
  dt_backward_fn backward;          /* NULL for leaves */
  dt_tensor *src[4];                /* inputs of the op */
  void *aux;                        /* op-private saved data (arena) */
  int64_t iaux[8];                  /* op-private integers */
  float faux[4];                    /* op-private floats */
  int32_t param_index;              /* parameter index, or -1 */
};

/* ---- graph -----------------------------------------------------------------
 * A graph is one replica's working memory for a training step: an arena from
 * which every tensor of the step is allocated, and the tape that autograd
 * replays. It is used by one thread at a time. After the first step, a step
 * (reset, forward, backward) allocates nothing: reset keeps the arena, merging
 * its chunks into one block sized for the largest step seen.
 *
 * Errors are sticky: the first failing op records its code and message on the
 * graph and returns NULL; every later op on the graph (and dt_backward) returns
 * NULL / that error without doing anything. Check once at the end.
 */
typedef struct dt_graph_desc {
  size_t arena_bytes;   /* first arena block; 0 means 1 MiB */
  uint64_t seed;        /* seed of the graph's RNG (dropout); 0 means 1 */
  int check_numerics;   /* nonzero: every op checks its output for NaN/Inf */
  dt_device *device;    /* NULL: the CPU; else run on this device (dt_device.h) */
} dt_graph_desc;

/* Create a graph bound to `params` (may be NULL): dt_param(g, i) returns views
 * of the params' data and grad buffers. desc may be NULL for defaults.
 * Returns NULL on failure (see dt_last_error()). */
DTRAIN_API dt_graph *dt_graph_create(dt_params *params, const dt_graph_desc *desc);
DTRAIN_API void dt_graph_destroy(dt_graph *g);

/* Forget every tensor of the step and clear the tape and the sticky error.
 * Keeps the memory for the next step. */
DTRAIN_API void dt_graph_reset(dt_graph *g);

/* Point the graph's parameter views at other flat buffers of the bound
 * params' layout (a replica's own copy, or a central copy). data must hold
 * dt_params_size() floats; grad may be NULL (no parameter gradients).
 * NULL data restores the params' own buffers. */
DTRAIN_API dt_result dt_graph_bind(dt_graph *g, float *data, float *grad);

/* Training mode (default on) switches dropout and batch-norm behaviour. */
DTRAIN_API void dt_graph_set_training(dt_graph *g, int training);
DTRAIN_API int dt_graph_training(const dt_graph *g);

/* Gradient recording (default on). Off = no-grad mode for evaluation: ops
 * record nothing on the tape. Returns the previous setting. */
DTRAIN_API int dt_graph_set_grad_enabled(dt_graph *g, int enabled);

/* Sticky error of the graph, and its detailed message ("" if none). */
DTRAIN_API dt_result dt_graph_error(const dt_graph *g);
DTRAIN_API const char *dt_graph_message(const dt_graph *g);

/* Record an error on the graph from user code (keeps the first). */
DTRAIN_API void dt_graph_fail(dt_graph *g, dt_result code, const char *msg);

/* Arena bytes in use now, the most used in any step, and reserved. */
DTRAIN_API size_t dt_graph_bytes_used(const dt_graph *g);
DTRAIN_API size_t dt_graph_bytes_peak(const dt_graph *g);
DTRAIN_API size_t dt_graph_bytes_reserved(const dt_graph *g);

/* The graph's RNG state (dropout). Seeded from desc.seed. */
DTRAIN_API void dt_graph_rng_state(const dt_graph *g, uint64_t out[4]);
DTRAIN_API void dt_graph_set_rng_state(dt_graph *g, const uint64_t s[4]);

/* ---- tensors ---------------------------------------------------------------- */

/* New zero-filled tensor in the graph's arena. ndim 0 is a scalar. */
DTRAIN_API dt_tensor *dt_tensor_new(dt_graph *g, int ndim, const int64_t *shape);
/* New tensor with a copy of `data` (size floats). */
DTRAIN_API dt_tensor *dt_tensor_from(dt_graph *g, int ndim, const int64_t *shape, const float *data);
/* Tensor over user memory, no copy: `data` must stay valid until reset. */
DTRAIN_API dt_tensor *dt_tensor_wrap(dt_graph *g, int ndim, const int64_t *shape, float *data);
/* Shorthands with the dimensions as arguments. */
DTRAIN_API dt_tensor *dt_tensor_new1(dt_graph *g, int64_t d0);
DTRAIN_API dt_tensor *dt_tensor_new2(dt_graph *g, int64_t d0, int64_t d1);
DTRAIN_API dt_tensor *dt_tensor_new3(dt_graph *g, int64_t d0, int64_t d1, int64_t d2);
DTRAIN_API dt_tensor *dt_tensor_new4(dt_graph *g, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
DTRAIN_API dt_tensor *dt_scalar(dt_graph *g, float value);

/* Ask for the gradient of a non-parameter tensor (input gradients, tests). */
DTRAIN_API void dt_tensor_set_requires_grad(dt_tensor *t, int on);
/* Copy of a tensor's values that does not take part in autograd. */
DTRAIN_API dt_tensor *dt_detach(dt_graph *g, dt_tensor *t);

/* View of parameter `index` of the bound params (see dt_params_add). */
DTRAIN_API dt_tensor *dt_param(dt_graph *g, int index);

/* Scalar value of a 1-element tensor (NaN if t is NULL or not 1 element). */
DTRAIN_API float dt_item(const dt_tensor *t);
/* Shape as text into buf, e.g. "[64,10]"; returns buf. */
DTRAIN_API const char *dt_shape_str(const dt_tensor *t, char *buf, size_t cap);
/* Same shape? */
DTRAIN_API int dt_same_shape(const dt_tensor *a, const dt_tensor *b);

/* ---- autograd ----------------------------------------------------------------
 * Replays the tape in reverse from `loss` (one element), accumulating (+=)
 * gradients into every tensor that requires them; parameter gradients land in
 * the bound flat gradient buffer. Call at most once per step. Returns the
 * graph's sticky error if graph building failed, DTRAIN_ERR_NONFINITE if the
 * loss is NaN/Inf (nothing is accumulated then).
 */
DTRAIN_API dt_result dt_backward(dt_graph *g, dt_tensor *loss);
/* Vector-Jacobian product: backward from any tensor `out`, taking `grad`
 * (out->size floats) as d(loss)/d(out). Same rules as dt_backward. */
DTRAIN_API dt_result dt_backward_grad(dt_graph *g, dt_tensor *out, const float *grad);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_TENSOR_H */
/* ======== end dt_tensor.h ======== */

/* ======== begin dt_ops.h ======== */
/* ===========================================================================
 * dt_ops.h -- differentiable operations
 * ===========================================================================
 * Every op takes the graph first, allocates its result in the graph's arena,
 * records itself on the tape (unless no-grad mode or no input needs a
 * gradient), and returns the result. On bad input an op records a sticky error
 * on the graph ("dt_add: shapes [2,3] and [4] cannot broadcast") and returns
 * NULL; an op given a NULL input or called on a failed graph returns NULL.
 *
 * Broadcasting follows NumPy: shapes are aligned at the right; a dimension of
 * 1 stretches. Axes may be negative (-1 is the last).
 */
#ifndef DTRAIN_OPS_H
#define DTRAIN_OPS_H

/* #include "dt_tensor.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* ---- elementwise, binary with broadcasting ---------------------------------- */
DTRAIN_API dt_tensor *dt_add(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_sub(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_mul(dt_graph *g, dt_tensor *a, dt_tensor *b);
DTRAIN_API dt_tensor *dt_div(dt_graph *g, dt_tensor *a, dt_tensor *b);

/* ---- scalar ops ------------------------------------------------------------- */
DTRAIN_API dt_tensor *dt_add_scalar(dt_graph *g, dt_tensor *x, float s);  /* x + s */
DTRAIN_API dt_tensor *dt_mul_scalar(dt_graph *g, dt_tensor *x, float s);  /* x * s */
DTRAIN_API dt_tensor *dt_pow_scalar(dt_graph *g, dt_tensor *x, float p);  /* x ^ p (x > 0 unless p is an integer) */
DTRAIN_API dt_tensor *dt_rsub_scalar(dt_graph *g, dt_tensor *x, float s); /* s - x */

/* ---- elementwise, unary ----------------------------------------------------- */
DTRAIN_API dt_tensor *dt_neg(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_exp(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_log(dt_graph *g, dt_tensor *x);   /* error if any x <= 0 */
DTRAIN_API dt_tensor *dt_sqrt(dt_graph *g, dt_tensor *x);  /* error if any x < 0 */
DTRAIN_API dt_tensor *dt_relu(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_leaky_relu(dt_graph *g, dt_tensor *x, float slope);
DTRAIN_API dt_tensor *dt_sigmoid(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_tanh(dt_graph *g, dt_tensor *x);
DTRAIN_API dt_tensor *dt_gelu(dt_graph *g, dt_tensor *x);  /* tanh approximation */

/* ---- reductions ------------------------------------------------------------- */
DTRAIN_API dt_tensor *dt_sum(dt_graph *g, dt_tensor *x);   /* all elements -> scalar */
DTRAIN_API dt_tensor *dt_mean(dt_graph *g, dt_tensor *x);
/* Over one axis; keepdim keeps it as size 1. */
DTRAIN_API dt_tensor *dt_sum_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim);
DTRAIN_API dt_tensor *dt_mean_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim);

/* ---- shape ------------------------------------------------------------------ */
/* Same data, new shape (one dim may be -1: inferred). No copy. */
DTRAIN_API dt_tensor *dt_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape);
DTRAIN_API dt_tensor *dt_reshape2(dt_graph *g, dt_tensor *x, int64_t d0, int64_t d1);
DTRAIN_API dt_tensor *dt_flatten(dt_graph *g, dt_tensor *x); /* [N, ...] -> [N, rest] */
/* Swap the last two dims (rank >= 2). */
DTRAIN_API dt_tensor *dt_transpose(dt_graph *g, dt_tensor *x);
/* Output dim i is input dim perm[i]. */
DTRAIN_API dt_tensor *dt_permute(dt_graph *g, dt_tensor *x, const int *perm);
/* Join n tensors along `axis`; other dims must agree. */
DTRAIN_API dt_tensor *dt_concat(dt_graph *g, dt_tensor *const *xs, int n, int axis);
/* Elements [start, start+len) of `axis`. */
DTRAIN_API dt_tensor *dt_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len);
/* Split `axis` into n equal parts (size must divide); outs receives n tensors.
 * Returns the graph's error code (DTRAIN_OK on success). */
DTRAIN_API dt_result dt_split(dt_graph *g, dt_tensor *x, int axis, int n, dt_tensor **outs);

/* ---- linear algebra --------------------------------------------------------- */
/* [M,K] @ [K,N] -> [M,N]. */
DTRAIN_API dt_tensor *dt_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b);
/* Batched: [...,M,K] @ [...,K,N] -> [...,M,N]; leading dims equal, or b is 2-D
 * and shared by every batch. trans_b uses b as [...,N,K]. */
DTRAIN_API dt_tensor *dt_bmm(dt_graph *g, dt_tensor *a, dt_tensor *b, int trans_b);
/* x [N,in] @ w[out,in]^T + b[out] -> [N,out]; b may be NULL. (PyTorch layout.) */
DTRAIN_API dt_tensor *dt_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b);

/* ---- softmax and losses ----------------------------------------------------- */
DTRAIN_API dt_tensor *dt_softmax(dt_graph *g, dt_tensor *x, int axis);
DTRAIN_API dt_tensor *dt_log_softmax(dt_graph *g, dt_tensor *x, int axis);
/* Mean over rows of -log softmax(logits)[label]; logits [N,C] (or [...,C],
 * rows = product of leading dims), labels: one int32 per row in [0,C).
 * Labels are copied. Fused and numerically stable. */
DTRAIN_API dt_tensor *dt_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels);
/* Mean of (a - b)^2 over all elements; shapes equal. */
DTRAIN_API dt_tensor *dt_mse(dt_graph *g, dt_tensor *a, dt_tensor *b);

/* ---- nn ----------------------------------------------------------------------- */
/* Rows of table [V,D] picked by n ids -> [n,D]; ids copied, each in [0,V). */
DTRAIN_API dt_tensor *dt_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n);
/* Inverted dropout with probability p from the graph's RNG; identity when the
 * graph is not training or p == 0. */
DTRAIN_API dt_tensor *dt_dropout(dt_graph *g, dt_tensor *x, float p);
/* Normalise over the last dim; gamma, beta [D] (either may be NULL). */
DTRAIN_API dt_tensor *dt_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps);
/* Over the channel dim 1 of [N,C] or [N,C,H,W]. Training: batch statistics,
 * and running_mean/running_var (each [C], may be NULL) are updated with
 * `momentum` (PyTorch convention, unbiased variance). Eval: running stats. */
DTRAIN_API dt_tensor *dt_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                    dt_tensor *running_mean, dt_tensor *running_var,
                                    float momentum, float eps);
/* For attention scores [..., T, T]: entries above the diagonal become -inf
 * (their softmax weight 0); gradient passes below and on the diagonal. */
DTRAIN_API dt_tensor *dt_causal_mask(dt_graph *g, dt_tensor *x);

/* ---- convolution and pooling (NCHW) ------------------------------------------- */
/* x [N,C,H,W], w [O,C,kh,kw], b [O] or NULL -> [N,O,Ho,Wo].
 * Ho = (H + 2*padding - kh)/stride + 1, likewise Wo. Computed as im2col +
 * GEMM, except 5x5 kernels with stride 1 and at least 8 channels in and out,
 * which use Winograd F(2x2,5x5) (2.8x fewer multiplications; results differ
 * from a direct sum by a few float roundings per unit of term magnitude).
 * Either way deterministic, and the same bits with any dt_set_threads. */
DTRAIN_API dt_tensor *dt_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b,
                                int stride, int padding);
DTRAIN_API dt_tensor *dt_max_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride);
DTRAIN_API dt_tensor *dt_avg_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride);

/* ---- GEMM ----------------------------------------------------------------------
 * C = alpha * op(A) @ op(B) + beta * C, row-major; op(X) = X or X^T. The
 * kernel under every matmul, exposed for users and benchmarks. */
DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc);
/* The micro-kernel dt_sgemm runs on this CPU: "avx2+fma" (x86-64, picked at
 * run time), "neon" (aarch64), "portable" (plain C; always under
 * DTRAIN_NO_SIMD), or "cblas" (DTRAIN_USE_CBLAS). */
DTRAIN_API const char *dt_sgemm_kernel(void);
/* on = 1 forces the portable C kernel, 0 returns to the best one (the
 * environment variable DTRAIN_GEMM=portable sets 1 at start). Returns the
 * previous setting. For tests and benchmarks: call it while no other thread
 * runs dt_sgemm. The kernels agree to rounding, not bit for bit. */
DTRAIN_API int dt_sgemm_use_portable(int on);

/* ---- threads inside one replica (intra-op) ----------------------------------------
 * dt_set_threads(n) lets the big kernels of a step split their work over n
 * threads: dt_sgemm (by blocks of rows or columns of C, each element computed
 * by one thread in the same order as with one thread, so results are bit for
 * bit those of n = 1), and the Adam/AdamW update of large buffers. n = 1 (the
 * default) runs everything on the calling thread; n = 0 means one thread per
 * online CPU. Without a call, the environment variable DTRAIN_THREADS (a
 * number, or "auto" for the CPU count) is read once, at the first use.
 * The n - 1 extra threads are created once, at the first kernel big enough
 * to use them, and live until the process exits or dt_set_threads(1); no
 * thread is created per call (a child of fork() starts its own). GEMMs below about a million multiply-adds stay
 * on one thread. Inside the replicas of a strategy with more than one replica
 * (mirrored, central_storage, async) kernels always use one thread: the
 * replicas already occupy the cores. When two user threads run kernels at the
 * same time, one gets the pool and the other runs alone (same results).
 * Returns DTRAIN_OK, DTRAIN_ERR_INVALID_ARG for n < 0, or
 * DTRAIN_ERR_UNSUPPORTED for n > 1 in a build without threads
 * (DTRAIN_NO_THREADS, where it stays 1). Safe to call from any thread at any
 * time (it waits for a kernel running on the pool to finish). */
DTRAIN_API dt_result dt_set_threads(int n);
/* The current setting (reads DTRAIN_THREADS if nothing set it yet): >= 1. */
DTRAIN_API int dt_get_threads(void);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_OPS_H */
/* ======== end dt_ops.h ======== */

/* ======== begin dt_params.h ======== */
/* ===========================================================================
 * dt_params.h -- flat parameter buffers, initializers, the portable RNG
 * ===========================================================================
 * All parameters of a model live in one contiguous float buffer, their
 * gradients in a second one of the same layout; each named parameter is a
 * range (a view). An all-reduce is then one call over one buffer, a checkpoint
 * a few writes, a replica a pointer swap (dt_graph_bind).
 *
 * Ownership: dt_params owns its data and grad buffers. Pointers returned by
 * dt_params_data/grad stay valid until the next dt_params_add* or destroy.
 */
#ifndef DTRAIN_PARAMS_H
#define DTRAIN_PARAMS_H

/* #include "dt_tensor.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* ---- RNG: xoshiro256** seeded by splitmix64; same numbers on every platform. */
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

/* ---- initializers --------------------------------------------------------------
 * fan_in / fan_out follow PyTorch: for shape [out, in, k...] fan_in = in*prod(k),
 * fan_out = out*prod(k); a 1-D shape has fan_in = fan_out = its size. */
typedef enum dt_init_kind {
  DTRAIN_INIT_ZEROS = 0,
  DTRAIN_INIT_ONES,
  DTRAIN_INIT_CONSTANT,       /* a */
  DTRAIN_INIT_UNIFORM,        /* U(a, b) */
  DTRAIN_INIT_NORMAL,         /* N(mean a, std b) */
  DTRAIN_INIT_GLOROT_UNIFORM, /* U(-l, l), l = gain a (0 = 1) * sqrt(6/(fan_in+fan_out)) */
  DTRAIN_INIT_GLOROT_NORMAL,  /* std = gain * sqrt(2/(fan_in+fan_out)) */
  DTRAIN_INIT_HE_UNIFORM,     /* U(-l, l), l = sqrt(6/fan_in) */
  DTRAIN_INIT_HE_NORMAL       /* std = sqrt(2/fan_in) */
} dt_init_kind;

typedef struct dt_init { dt_init_kind kind; float a, b; } dt_init;

DTRAIN_API dt_init dt_init_zeros(void);
DTRAIN_API dt_init dt_init_constant(float v);
DTRAIN_API dt_init dt_init_uniform(float lo, float hi);
DTRAIN_API dt_init dt_init_normal(float mean, float std);
DTRAIN_API dt_init dt_init_glorot_uniform(void);
DTRAIN_API dt_init dt_init_glorot_normal(void);
DTRAIN_API dt_init dt_init_he_uniform(void);
DTRAIN_API dt_init dt_init_he_normal(void);

/* Fill n floats of a tensor with the given shape (for fan computation). */
DTRAIN_API dt_result dt_init_fill(float *dst, int ndim, const int64_t *shape, dt_init init, dt_rng *rng);

/* ---- parameters ------------------------------------------------------------------ */
typedef struct dt_param_info {
  const char *name;      /* owned by the params */
  size_t offset;         /* first float in the flat buffers */
  size_t size;           /* number of floats */
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int trainable;         /* 0 for buffers (running statistics) */
  int decay;             /* weight decay applies (default: trainable && ndim >= 2) */
} dt_param_info;

/* Empty parameter set; seed drives every initializer. NULL on failure. */
DTRAIN_API dt_params *dt_params_create(uint64_t seed);
DTRAIN_API void dt_params_destroy(dt_params *p);

/* Add a trainable parameter; returns its index (>= 0) or a negative dt_result.
 * Names must be unique (at most 127 bytes). Values are drawn at once from the
 * params' RNG, so the order of adds fixes the numbers. Each parameter starts
 * at an offset that is a multiple of 16 floats (64 bytes). */
DTRAIN_API int dt_params_add(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init);
/* Add a non-trainable buffer (no gradient, never touched by optimizers). */
DTRAIN_API int dt_params_add_buffer(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init);

DTRAIN_API int dt_params_count(const dt_params *p);
DTRAIN_API size_t dt_params_size(const dt_params *p);       /* floats in the flat buffers */
DTRAIN_API size_t dt_params_trainable_size(const dt_params *p);
DTRAIN_API float *dt_params_data(dt_params *p);
DTRAIN_API float *dt_params_grad(dt_params *p);
DTRAIN_API dt_result dt_params_info(const dt_params *p, int index, dt_param_info *out);
/* Index of the parameter named `name`, or DTRAIN_ERR_NOT_FOUND. */
DTRAIN_API int dt_params_find(const dt_params *p, const char *name);
DTRAIN_API dt_result dt_params_set_decay(dt_params *p, int index, int decay);
DTRAIN_API void dt_params_zero_grad(dt_params *p);
/* Multiply every gradient by s (gradient accumulation: 1/k after k micro-batches). */
DTRAIN_API void dt_params_scale_grad(dt_params *p, float s);
/* Copy values (and optionally nothing else) from another params with the same layout. */
DTRAIN_API dt_result dt_params_copy(dt_params *dst, const dt_params *src);
/* FNV-1a 64 over the bytes of the data buffer: equal iff bitwise equal (almost surely). */
DTRAIN_API uint64_t dt_params_checksum(const dt_params *p);
/* Hash of names and shapes (not values): replicas and checkpoints must agree. */
DTRAIN_API uint64_t dt_params_layout_hash(const dt_params *p);
/* The params' RNG (used by initializers); for checkpointing its state. */
DTRAIN_API dt_rng *dt_params_rng(dt_params *p);

/* Global L2 norm of n floats (accumulated in double). */
DTRAIN_API double dt_l2_norm(const float *x, size_t n);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_PARAMS_H */
/* ======== end dt_params.h ======== */

/* ======== begin dt_optim.h ======== */
/* ===========================================================================
 * dt_optim.h -- optimizers, learning-rate schedules, gradient clipping
 * ===========================================================================
 * An optimizer owns flat state buffers (momentum, Adam moments) with the
 * layout of its params. dt_optim_step() updates the params' own buffers;
 * strategies call dt_optim_update() on ranges of other buffers so that each
 * replica can update its own copy, or its own slice.
 */
#ifndef DTRAIN_OPTIM_H
#define DTRAIN_OPTIM_H

/* #include "dt_params.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

typedef enum dt_optim_kind {
  DTRAIN_OPTIM_SGD = 0,  /* momentum, Nesterov, coupled (L2) weight decay */
  DTRAIN_OPTIM_ADAM,     /* L2 weight decay added to the gradient (PyTorch Adam) */
  DTRAIN_OPTIM_ADAMW,    /* decoupled weight decay (Loshchilov & Hutter) */
  DTRAIN_OPTIM_RMSPROP   /* optional momentum; PyTorch semantics */
} dt_optim_kind;

typedef enum dt_schedule_kind {
  DTRAIN_SCHED_CONSTANT = 0,
  DTRAIN_SCHED_STEP,     /* lr * gamma ^ floor(step / step_size) */
  DTRAIN_SCHED_COSINE    /* min_lr + (lr - min_lr) * (1 + cos(pi * t / total)) / 2 */
} dt_schedule_kind;

/* Linear warm-up (lr * (step+1) / warmup_steps for step < warmup_steps) applies
 * before any kind; the kind's clock starts after the warm-up. */
typedef struct dt_schedule {
  dt_schedule_kind kind;
  int64_t warmup_steps;
  int64_t step_size;    /* STEP */
  float gamma;          /* STEP; 0 means 0.1 */
  int64_t total_steps;  /* COSINE: steps after warm-up to reach min_lr */
  float min_lr;         /* COSINE */
} dt_schedule;

/* Learning rate at `step` (0-based) for base rate lr. */
DTRAIN_API float dt_schedule_lr(const dt_schedule *s, float lr, int64_t step);

/* Zero fields take the defaults in brackets. */
typedef struct dt_optim_desc {
  dt_optim_kind kind;
  float lr;             /* [0.01 for SGD, 0.001 otherwise] */
  float momentum;       /* SGD, RMSprop [0] */
  int nesterov;         /* SGD, needs momentum > 0 */
  float weight_decay;   /* [0]; applies to parameters with decay set */
  float beta1, beta2;   /* Adam(W) [0.9, 0.999] */
  float eps;            /* Adam(W) [1e-8], RMSprop [1e-8] */
  float alpha;          /* RMSprop smoothing [0.99] */
  float clip_norm;      /* > 0: clip the global gradient norm in dt_optim_step */
  dt_schedule schedule;
} dt_optim_desc;

typedef struct dt_optim dt_optim;

/* NULL on failure (dt_last_error()). The params must not gain parameters later. */
DTRAIN_API dt_optim *dt_optim_create(dt_params *p, const dt_optim_desc *desc);
DTRAIN_API void dt_optim_destroy(dt_optim *o);

/* One update of the params' own data from their own grad: clip (if set),
 * update every trainable element at the current step's lr, advance the step.
 * Gradients are not zeroed. */
DTRAIN_API dt_result dt_optim_step(dt_optim *o);

/* Update data[begin,end) of a buffer with the params' layout from grad
 * [begin,end), using this optimizer's state for that range, at the current
 * step (no clipping, does not advance). The range may cut parameters. */
DTRAIN_API dt_result dt_optim_update(dt_optim *o, float *data, const float *grad, size_t begin, size_t end);
/* One step over the parameter buffers a graph's dt_param views use
 * (dt_graph_param_data/grad): on a CPU graph the same as dt_optim_step on
 * those buffers; on a device graph (dt_device.h) the update runs on the
 * device, with the optimizer's state in device memory (allocated at the
 * first call and tied to that device; it starts from the host state, so a
 * state loaded from a checkpoint carries over). SGD, Adam, AdamW, RMSprop
 * and clip_norm all run on a device. Clips (if set), updates, advances. */
DTRAIN_API dt_result dt_optim_step_graph(dt_optim *o, dt_graph *g);
/* Advance the step counter (after every range of a step was updated). */
DTRAIN_API void dt_optim_advance(dt_optim *o);

DTRAIN_API int64_t dt_optim_steps(const dt_optim *o);
DTRAIN_API void dt_optim_set_steps(dt_optim *o, int64_t steps);
/* Learning rate the next update will use. */
DTRAIN_API float dt_optim_lr(const dt_optim *o);
DTRAIN_API const dt_optim_desc *dt_optim_get_desc(const dt_optim *o);
/* State buffers for checkpoints: n_slots (0..2) buffers of dt_params_size floats.
 * After dt_optim_step_graph on a device the state lives on the device:
 * dt_optim_state then copies the slot to the host (a device -> host copy;
 * NULL and dt_last_error() if that fails) and returns the host copy, which
 * the caller may read (save) or overwrite (load); the next
 * dt_optim_step_graph uploads the slots handed out before it updates. So a
 * checkpoint (dt_checkpoint_save / dt_checkpoint_load) of a device run holds
 * and restores the whole state. Do not mix dt_optim_step (host) into a
 * device run: the host copy is not kept current between calls. */
DTRAIN_API int dt_optim_state_slots(const dt_optim *o);
DTRAIN_API float *dt_optim_state(dt_optim *o, int slot);

/* Scale grad so its global L2 norm is at most max_norm; returns the norm before. */
DTRAIN_API float dt_clip_grad_norm(float *grad, size_t n, float max_norm);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_OPTIM_H */
/* ======== end dt_optim.h ======== */

/* ======== begin dt_nn.h ======== */
/* ===========================================================================
 * dt_nn.h -- layers: parameter indices plus a forward function
 * ===========================================================================
 * A layer struct holds parameter indices, not pointers, so the same model
 * struct serves every replica: forward looks the parameters up in the graph
 * it runs on (dt_param), which is bound to that replica's buffers.
 * Parameters are named "<name>.weight", "<name>.bias", ... (PyTorch names).
 */
#ifndef DTRAIN_NN_H
#define DTRAIN_NN_H

/* #include "dt_ops.h" (amalgamated) */
/* #include "dt_params.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* y = x W^T + b; W [out,in] (Glorot uniform), b [out] (zeros). */
typedef struct dt_nn_linear { int w, b; int64_t in, out; } dt_nn_linear;
DTRAIN_API dt_result dt_nn_linear_init(dt_nn_linear *l, dt_params *p, const char *name,
                                       int64_t in, int64_t out, int bias);
/* x [..., in] -> [..., out] */
DTRAIN_API dt_tensor *dt_nn_linear_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x);

/* W [out,in,k,k] (He uniform), b [out]. */
typedef struct dt_nn_conv2d { int w, b; int in, out, kernel, stride, padding; } dt_nn_conv2d;
DTRAIN_API dt_result dt_nn_conv2d_init(dt_nn_conv2d *l, dt_params *p, const char *name, int in, int out,
                                       int kernel, int stride, int padding, int bias);
DTRAIN_API dt_tensor *dt_nn_conv2d_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x);

/* table [vocab, dim] ~ N(0,1). */
typedef struct dt_nn_embedding { int w; int64_t vocab, dim; } dt_nn_embedding;
DTRAIN_API dt_result dt_nn_embedding_init(dt_nn_embedding *l, dt_params *p, const char *name,
                                          int64_t vocab, int64_t dim);
DTRAIN_API dt_tensor *dt_nn_embedding_forward(dt_graph *g, const dt_nn_embedding *l,
                                              const int32_t *ids, int64_t n);

/* gamma [dim] = 1, beta [dim] = 0. */
typedef struct dt_nn_layer_norm { int gamma, beta; int64_t dim; float eps; } dt_nn_layer_norm;
DTRAIN_API dt_result dt_nn_layer_norm_init(dt_nn_layer_norm *l, dt_params *p, const char *name, int64_t dim);
DTRAIN_API dt_tensor *dt_nn_layer_norm_forward(dt_graph *g, const dt_nn_layer_norm *l, dt_tensor *x);

/* gamma, beta [C]; buffers running_mean (0), running_var (1). */
typedef struct dt_nn_batch_norm { int gamma, beta, mean, var; int64_t channels; float momentum, eps; } dt_nn_batch_norm;
DTRAIN_API dt_result dt_nn_batch_norm_init(dt_nn_batch_norm *l, dt_params *p, const char *name, int64_t channels);
DTRAIN_API dt_tensor *dt_nn_batch_norm_forward(dt_graph *g, const dt_nn_batch_norm *l, dt_tensor *x);

/* LSTM cell (PyTorch gate order i, f, g, o): weight_ih [4H,in], weight_hh [4H,H],
 * bias [4H] (forget-gate bias 1). h, c: [N,H] (NULL means zeros). */
typedef struct dt_nn_lstm_cell { int w_ih, w_hh, b; int64_t in, hidden; } dt_nn_lstm_cell;
DTRAIN_API dt_result dt_nn_lstm_cell_init(dt_nn_lstm_cell *l, dt_params *p, const char *name,
                                          int64_t in, int64_t hidden);
DTRAIN_API dt_result dt_nn_lstm_cell_forward(dt_graph *g, const dt_nn_lstm_cell *l, dt_tensor *x,
                                             dt_tensor *h, dt_tensor *c, dt_tensor **h_out, dt_tensor **c_out);

/* GRU cell (PyTorch equations, gate order r, z, n): weight_ih [3H,in],
 * weight_hh [3H,H], bias_ih [3H], bias_hh [3H]. */
typedef struct dt_nn_gru_cell { int w_ih, w_hh, b_ih, b_hh; int64_t in, hidden; } dt_nn_gru_cell;
DTRAIN_API dt_result dt_nn_gru_cell_init(dt_nn_gru_cell *l, dt_params *p, const char *name,
                                         int64_t in, int64_t hidden);
DTRAIN_API dt_tensor *dt_nn_gru_cell_forward(dt_graph *g, const dt_nn_gru_cell *l, dt_tensor *x, dt_tensor *h);

/* Causal multi-head self-attention, composed from ops: x [B,T,C] -> [B,T,C].
 * qkv: linear C -> 3C, proj: linear C -> C; heads must divide C. */
typedef struct dt_nn_attention { dt_nn_linear qkv, proj; int64_t dim; int heads; } dt_nn_attention;
DTRAIN_API dt_result dt_nn_attention_init(dt_nn_attention *l, dt_params *p, const char *name,
                                          int64_t dim, int heads);
DTRAIN_API dt_tensor *dt_nn_attention_forward(dt_graph *g, const dt_nn_attention *l, dt_tensor *x);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_NN_H */
/* ======== end dt_nn.h ======== */

/* ======== begin dt_io.h ======== */
/* ===========================================================================
 * dt_io.h -- checkpoints of the full training state in the safetensors format
 * ===========================================================================
 * A checkpoint is a safetensors file (readable by PyTorch's `safetensors`,
 * NumPy, or anything that follows the format):
 *
 *   8 bytes    N, the header length, unsigned little-endian
 *   N bytes    JSON: {"__metadata__": {"key": "value", ...},
 *                     "fc1.weight": {"dtype": "F32", "shape": [256, 784],
 *                                    "data_offsets": [begin, end]}, ...}
 *              padded with spaces so that the data starts 8-byte aligned
 *   the rest   the tensors' bytes, contiguous, little-endian float32;
 *              offsets are relative to the first byte after the header
 *
 * Tensors: every parameter and buffer under its dt_params name, then the
 * optimizer state as "optim.<slot>.<parameter name>" for each trainable
 * parameter, with PyTorch's slot names: SGD "momentum_buffer"; Adam(W)
 * "exp_avg", "exp_avg_sq"; RMSprop "square_avg", "momentum_buffer".
 * Metadata (all strings): "format" = "dtrain", "format_version" = "1",
 * "dtrain_version", "step" (optimizer steps), "epoch", "data_epoch" and
 * "data_index" (the data loader's position), "params_rng" and "graph_rng"
 * (RNG states, 64 hex digits), "optimizer" (the optimizer's settings),
 * "layout_hash" (dt_params_layout_hash, 16 hex digits), "config" (a user
 * string) and "checksum" (16 hex digits over the header's content and the
 * data; verified when present).
 *
 * Saving is atomic: the file is written to a temporary file in the same
 * directory, flushed and fsync'ed, renamed over `path`, and the directory is
 * fsync'ed. On any failure the temporary file is removed, an existing file at
 * `path` is left as it was, and the error (DTRAIN_ERR_IO) names the path and
 * the system's reason.
 *
 * Loading validates everything before it changes anything: the file size,
 * the header length (at most 100,000,000 bytes and within the file), the JSON
 * (strict RFC 8259, UTF-8, depth and length limits, no duplicate keys), every
 * entry (dtype, shape, offsets in bounds, sizes matching shapes, tensors
 * contiguous and covering the data exactly), the checksum, and the fit with
 * the model (every parameter present with its shape, every tensor known).
 * Errors:
 *   DTRAIN_ERR_IO        the file cannot be opened or read
 *   DTRAIN_ERR_CORRUPT   truncated, header length beyond the file, offsets out
 *                        of bounds / overlapping / leaving gaps, sizes that do
 *                        not match shapes, checksum mismatch
 *   DTRAIN_ERR_FORMAT    not safetensors JSON, a dtype other than F32 where
 *                        dtrain needs F32, missing or malformed metadata
 *   DTRAIN_ERR_MISMATCH  a valid file that does not fit this model or
 *                        optimizer (shape, missing or unknown tensor, layout)
 * The message names the file and the tensor or field. On any error the
 * params, optimizer, graph and state are left unchanged.
 *
 * Resuming: save with the params, the optimizer and the graph (dropout RNG)
 * and the data position; load them into a model built the same way (any seed)
 * and training continues bitwise as if it had never stopped.
 * A device run (dt_device.h) checkpoints the same way: give the device graph
 * as `graph`; save first copies its params from the device to the host
 * params (dt_graph_params_download) and the optimizer's device state to its
 * host copy (dt_optim_state); load writes the host params and state, then
 * uploads the params to the graph (dt_graph_params_upload), and the next
 * dt_optim_step_graph takes the state to the device. A device checkpoint
 * resumes on the CPU too (and a CPU one on a device).
 *
 * Ownership: dt_checkpoint (from dt_checkpoint_open) owns the file's bytes and
 * every string it returns, until dt_checkpoint_close.
 * Without stdio (DTRAIN_NO_STDIO) every function here that touches a file
 * returns DTRAIN_ERR_UNSUPPORTED.
 */
#ifndef DTRAIN_IO_H
#define DTRAIN_IO_H

/* #include "dt_optim.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* The checkpoint format version written in the metadata ("format_version"). */
#define DTRAIN_CHECKPOINT_VERSION 1
/* Largest header accepted (the safetensors reference limit). */
#define DTRAIN_CHECKPOINT_MAX_HEADER 100000000

/* What dt_checkpoint_save writes and dt_checkpoint_load restores. */
typedef struct dt_train_state {
  dt_params *params;   /* required: every parameter and buffer */
  dt_optim *optim;     /* optional: state slots and step count */
  dt_graph *graph;     /* optional: the graph's RNG (dropout); a device graph on
                          `params` also has its params moved (see above) */
  int64_t step;        /* save: written when optim is NULL (else dt_optim_steps); load: set */
  int64_t epoch;       /* save: written; load: set */
  int64_t data_epoch;  /* data loader position (epoch, index): save: written; load: set */
  int64_t data_index;
  const char *config;  /* save: user text stored as metadata "config" (valid UTF-8; NULL: "").
                          load: not touched (read it with dt_checkpoint_open + dt_checkpoint_meta) */
} dt_train_state;

/* Save the full training state atomically (see above). */
DTRAIN_API dt_result dt_checkpoint_save(const char *path, const dt_train_state *st);

/* Restore the full state: parameters and buffers, the optimizer's slots and
 * step count (when st->optim; the file must hold state for the same kind of
 * optimizer; its other settings, such as lr, may differ), the graph's RNG
 * (when st->graph), the params' RNG, and st->step, epoch, data_epoch and
 * data_index. The file must be a dtrain checkpoint of the same layout
 * (names, shapes, order, buffers). Nothing changes on error. */
DTRAIN_API dt_result dt_checkpoint_load(const char *path, dt_train_state *st);

/* Restore parameters and buffers only, from any safetensors file whose F32
 * tensors match the model by name and shape (for example one written by
 * PyTorch). Optimizer tensors ("optim.<slot>.<name>") and metadata are
 * ignored; any other unknown tensor is an error. Nothing changes on error. */
DTRAIN_API dt_result dt_checkpoint_load_weights(const char *path, dt_params *p);

/* ---- inspection: list a safetensors file's tensors and metadata ------------ */
typedef struct dt_checkpoint dt_checkpoint;

typedef struct dt_checkpoint_entry {
  const char *name;               /* owned by the checkpoint */
  const char *dtype;              /* "F32", "F16", "BF16", "I64", ... */
  int ndim;                       /* 0 (scalar) .. DTRAIN_MAX_DIMS */
  int64_t shape[DTRAIN_MAX_DIMS]; /* shape[ndim..] are 1 */
  uint64_t begin, end;            /* byte range in the data (after the header) */
} dt_checkpoint_entry;

/* Read and validate a safetensors file (any dtype; not checked against a
 * model). NULL on error (dt_last_error()/dt_last_result()). */
DTRAIN_API dt_checkpoint *dt_checkpoint_open(const char *path);
DTRAIN_API void dt_checkpoint_close(dt_checkpoint *c);
/* Tensors, in the order of their data in the file. */
DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c);
DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out);
/* Index of the tensor named `name`, or DTRAIN_ERR_NOT_FOUND. */
DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name);
/* Copy tensor `index` (dtype F32, exactly n elements) into dst, in host order. */
DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n);
/* Metadata entries, in file order. */
DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c);
DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value);
/* Value of metadata `key`, or NULL when absent. */
DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key);
/* Total file size and header length (N) in bytes. */
DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c);
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_IO_H */
/* ======== end dt_io.h ======== */

/* ======== begin dt_fit.h ======== */
/* ===========================================================================
 * dt_fit.h -- the training loop: epochs, evaluation, callbacks, early
 * stopping, checkpoints, progress, a metrics CSV and an SVG chart
 * ===========================================================================
 * dt_fit does not know the model or the data: it calls your train step once
 * per batch (you run forward, backward and the optimizer step on the batch
 * your loader gives for (epoch, index)) and your evaluation once per epoch,
 * and does the bookkeeping around them:
 *
 *   static dt_result step(dt_fit_batch *b, void *user) {
 *     ...batch b->index of epoch b->epoch: forward, dt_backward, dt_optim_step...
 *     b->loss = dt_item(loss);  b->samples = n;  b->correct = hits;  // correct optional
 *     return DTRAIN_OK;
 *   }
 *   dt_fit_desc fd = {0};                  // zero fields take defaults
 *   fd.epochs = 10;  fd.steps_per_epoch = n_train / batch;
 *   fd.train_step = step;  fd.evaluate = eval;  fd.user = &model;
 *   fd.params = P;  fd.optim = opt;  fd.graph = g;
 *   fd.patience = 3;  fd.restore_best = 1;
 *   fd.csv_path = "metrics.csv";  fd.svg_path = "curves.svg";
 *   dt_fit_result res;
 *   dt_result r = dt_fit(&fd, &res);
 *
 * Progress goes to desc.out (stdout by default): a bar redrawn in place when
 * it is a terminal (isatty), one plain line per epoch otherwise (for logs and
 * pipes), nothing when quiet. Never both.
 *
 * Epochs: the loop runs epochs [start_epoch, epochs) (0-based indices, as a
 * data loader counts them); rows, the CSV and the chart number epochs from 1.
 * To resume, load a checkpoint (dt_checkpoint_load) and pass its data_epoch
 * and data_index as start_epoch and start_batch with the same desc. The
 * checkpoints dt_fit writes store (epoch, batch) as the data position.
 * Early stopping and the chart start afresh on resume.
 *
 * Without stdio (DTRAIN_NO_STDIO) the loop runs silently; asking for a file
 * (CSV, SVG, checkpoint) or an explicit progress mode gives
 * DTRAIN_ERR_UNSUPPORTED.
 */
#ifndef DTRAIN_FIT_H
#define DTRAIN_FIT_H

#include <stdio.h>

/* #include "dt_io.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* One batch: dt_fit fills the first fields, the train step the rest. */
typedef struct dt_fit_batch {
  int64_t epoch;    /* 0-based epoch index */
  int64_t index;    /* 0-based batch index within the epoch */
  int64_t step;     /* global step before this batch */
  double loss;      /* out: mean loss over the batch */
  int64_t samples;  /* out: samples in the batch [desc.batch_size] */
  int64_t correct;  /* out: correct predictions [-1: no accuracy] */
} dt_fit_batch;

/* The validation metrics of one epoch. */
typedef struct dt_fit_eval {
  int64_t epoch;    /* 0-based epoch just trained */
  double loss;      /* out: mean validation loss [NaN] */
  double accuracy;  /* out: fraction in [0, 1] [NaN: not measured] */
} dt_fit_eval;

/* One epoch's metrics: a row of the CSV and a point of the chart. */
typedef struct dt_fit_epoch {
  int64_t epoch;           /* 1-based: 1 after the first epoch */
  int64_t step;            /* global step at the end of the epoch */
  double train_loss;       /* sample-weighted mean of the batch losses */
  double train_acc;        /* NaN when the step reports no correct counts */
  double val_loss;         /* NaN without evaluate */
  double val_acc;          /* NaN without evaluate or accuracy */
  double lr;               /* the optimizer's next lr (NaN without optim) */
  double seconds;          /* wall time since dt_fit started */
  double train_seconds;    /* time in train steps during this epoch */
  int64_t samples;         /* training samples this epoch */
  double samples_per_sec;  /* samples / train_seconds */
} dt_fit_epoch;

/* Callbacks return a dt_result (steps, evaluation: an error stops dt_fit
 * with that error) or nonzero to stop training early (the hooks). */
typedef dt_result (*dt_fit_step_fn)(dt_fit_batch *b, void *user);
typedef dt_result (*dt_fit_eval_fn)(dt_fit_eval *e, void *user);
typedef int (*dt_fit_batch_fn)(const dt_fit_batch *b, void *user);
typedef int (*dt_fit_epoch_fn)(const dt_fit_epoch *e, void *user);

typedef enum dt_fit_monitor {
  DTRAIN_FIT_MONITOR_AUTO = 0,   /* val_loss with evaluate, else train_loss */
  DTRAIN_FIT_MONITOR_VAL_LOSS,   /* lower is better */
  DTRAIN_FIT_MONITOR_VAL_ACC,    /* higher is better */
  DTRAIN_FIT_MONITOR_TRAIN_LOSS,
  DTRAIN_FIT_MONITOR_TRAIN_ACC
} dt_fit_monitor;

typedef enum dt_fit_progress {
  DTRAIN_FIT_PROGRESS_AUTO = 0,  /* a bar on a terminal, plain lines otherwise */
  DTRAIN_FIT_PROGRESS_BAR,
  DTRAIN_FIT_PROGRESS_LINES,
  DTRAIN_FIT_PROGRESS_QUIET
} dt_fit_progress;

/* Zero fields take the defaults in brackets. */
typedef struct dt_fit_desc {
  int64_t epochs;             /* train epochs [start_epoch, epochs) [1] */
  int64_t steps_per_epoch;    /* batches per epoch (required) */
  int64_t batch_size;         /* samples per batch when a step does not report them [1] */
  dt_fit_step_fn train_step;  /* required */
  dt_fit_eval_fn evaluate;    /* optional: after every epoch */
  dt_fit_batch_fn on_batch_end;  /* optional: nonzero stops (after the epoch's bookkeeping) */
  dt_fit_epoch_fn on_epoch_end;  /* optional: nonzero stops */
  void *user;                 /* passed to every callback */
  /* Training state: params for restore_best and checkpoints, optim for the
   * step count, lr and checkpoints, graph for the RNG in checkpoints. */
  dt_params *params;
  dt_optim *optim;
  dt_graph *graph;
  /* Early stopping: stop after `patience` epochs in a row without an
   * improvement larger than min_delta of the monitored metric. */
  int patience;               /* [0: off] */
  double min_delta;           /* [0] */
  dt_fit_monitor monitor;     /* [AUTO] */
  int restore_best;           /* at the end put back the parameters of the best epoch (needs params) */
  /* Output. */
  dt_fit_progress progress;   /* [AUTO] */
  FILE *out;                  /* progress stream [stdout] */
  int64_t log_every;          /* plain-line mode: also a line every N batches [0: per epoch only] */
  const char *csv_path;       /* append a row per epoch; header when the file is new or empty */
  const char *svg_path;       /* rewrite the loss/accuracy chart after every epoch */
  const char *title;          /* chart title ["training"] */
  /* Checkpoints (dt_checkpoint_save of params, optim, graph and position). */
  const char *checkpoint_path;  /* save here at epoch ends */
  int64_t checkpoint_every;     /* every N epochs [1 when checkpoint_path is set]; the last epoch always */
  int64_t checkpoint_steps;     /* > 0: also every N global steps, mid-epoch */
  const char *best_path;        /* save here whenever the monitored metric improves */
  const char *config;           /* user text stored in every checkpoint */
  /* Resume. */
  int64_t start_epoch;        /* 0-based epoch to start in [0] */
  int64_t start_batch;        /* batch to start at within start_epoch [0] */
} dt_fit_desc;

typedef struct dt_fit_result {
  int64_t epochs_run;         /* epochs completed by this call */
  int64_t step;               /* global step at the end */
  int stopped_early;          /* early stopping triggered */
  int stopped_by_callback;    /* a hook asked to stop */
  int restored_best;          /* restore_best put the best epoch's parameters back */
  int64_t best_epoch;         /* 1-based epoch with the best monitored value (0: none) */
  double best_value;          /* its value (NaN: none) */
  dt_fit_epoch last;          /* the last epoch's metrics */
  int64_t samples;            /* training samples, all epochs of this call */
  double train_seconds;       /* time in train steps, all epochs */
  double total_seconds;       /* wall time of dt_fit */
  double samples_per_sec;     /* samples / train_seconds */
} dt_fit_result;

/* Run the loop. result may be NULL. Returns the first error of a callback,
 * a checkpoint, the CSV or the chart (training stops there), else DTRAIN_OK. */
DTRAIN_API dt_result dt_fit(const dt_fit_desc *desc, dt_fit_result *result);

/* Write a standalone SVG chart (no dependency) of n epochs' metrics: loss
 * (train and validation) in the left panel, accuracy in the right one, with
 * axes, ticks, labels and legends. NaN values are left out. Written to a
 * temporary file and renamed over path. */
DTRAIN_API dt_result dt_fit_write_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_FIT_H */
/* ======== end dt_fit.h ======== */

/* ======== begin dt_data.h ======== */
/* ===========================================================================
 * dt_data.h -- data: gzip/inflate, IDX, CSV, NPY, text corpora, datasets,
 *              the batch loader (shuffle, batches, split, shards)
 * ===========================================================================
 * Readers come in two forms: dt_*_read(path, ...) reads a file and
 * dt_*_parse(buf, len, ...) parses bytes already in memory. With
 * DTRAIN_NO_STDIO the file forms return DTRAIN_ERR_UNSUPPORTED; the parse
 * forms always work. Every reader checks sizes claimed by a header against
 * the bytes actually there BEFORE allocating, and reports malformed input as
 * DTRAIN_ERR_FORMAT (not this kind of file), DTRAIN_ERR_CORRUPT (truncated or
 * damaged) or DTRAIN_ERR_IO (with the path and the system's reason), with a
 * message in dt_last_error().
 *
 * gzip: every reader accepts gzip-compressed input (data starting with the
 * magic 1f 8b, whatever the file is called), decompressed by a small built-in
 * inflater (RFC 1951/1952, CRC-32 and length checked) or by zlib when
 * DTRAIN_USE_ZLIB is defined (link -lz).
 *
 * Ownership: every struct filled by a reader owns its memory until the
 * matching *_free / *_destroy (which zero the struct; freeing a zeroed
 * struct or NULL is a no-op). A loader borrows its dataset: the dataset must
 * outlive the loader.
 */
#ifndef DTRAIN_DATA_H
#define DTRAIN_DATA_H

/* #include "dt_params.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

/* ---- byte buffers, files, gzip ---------------------------------------------- */
typedef struct dt_bytes {
  unsigned char *data; /* `size` bytes (plus a 0 byte after them) */
  size_t size;
  size_t cap;          /* private: allocated bytes */
} dt_bytes;

DTRAIN_API void dt_bytes_free(dt_bytes *b);
/* Whole file into memory, as stored (no decompression). */
DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out);
/* Whole file; gzip data (magic 1f 8b) is decompressed, anything else is
 * returned as is. */
DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out);
/* Decompress a gzip file image (one or more members; header flags FTEXT,
 * FHCRC, FEXTRA, FNAME, FCOMMENT; CRC-32 and ISIZE verified). max_out caps
 * the output size (0: 4 GiB). */
DTRAIN_API dt_result dt_gunzip(const void *in, size_t len, size_t max_out, dt_bytes *out);
/* Decompress a raw deflate stream (RFC 1951, no header). */
DTRAIN_API dt_result dt_inflate(const void *in, size_t len, size_t max_out, dt_bytes *out);
/* CRC-32 (ISO-HDLC, as gzip and zlib); pass 0 as crc to start. */
DTRAIN_API uint32_t dt_crc32(uint32_t crc, const void *data, size_t len);

/* ---- IDX (the MNIST file format) ------------------------------------------------
 * Magic 00 00 08 NDIM (unsigned bytes only), NDIM big-endian u32 dimensions,
 * then the bytes. At most DTRAIN_MAX_DIMS dimensions, each at least 1. */
typedef struct dt_idx {
  unsigned char *data;             /* size bytes, row-major */
  int64_t size;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  size_t bytes_;                   /* private */
} dt_idx;

DTRAIN_API dt_result dt_idx_read(const char *path, dt_idx *out);
DTRAIN_API dt_result dt_idx_parse(const void *buf, size_t len, dt_idx *out);
DTRAIN_API void dt_idx_free(dt_idx *a);

/* ---- datasets ----------------------------------------------------------------------
 * n samples held in memory: features as float32 with a per-sample shape, and
 * optionally one int32 label per sample. Fields may be read directly; sample
 * i starts at x + i * sample_size. */
typedef struct dt_dataset {
  float *x;                        /* n * sample_size floats */
  int32_t *y;                      /* n labels, or NULL */
  int64_t n;
  int64_t sample_size;             /* product of shape[0..ndim) */
  int ndim;                        /* per-sample dims, 1..DTRAIN_MAX_DIMS-1 */
  int64_t shape[DTRAIN_MAX_DIMS];
  int num_classes;                 /* max label + 1 when loaded; 0 without labels */
} dt_dataset;

/* Flags for loaders that read bytes (IDX, NPY uint8). */
#define DTRAIN_DATA_RAW 0x01u      /* keep byte values 0..255 (default: scale to [0,1]) */

/* New zero-filled dataset of n samples of the given shape, with labels if
 * with_labels (num_classes then 0: set it). */
DTRAIN_API dt_result dt_dataset_create(dt_dataset **out, int64_t n, int ndim, const int64_t *sample_shape,
                                       int with_labels);
DTRAIN_API void dt_dataset_destroy(dt_dataset *ds);
/* Copy samples idx[0..count) into a new dataset (same shape, labels, classes). */
DTRAIN_API dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out);
/* Seeded disjoint split: round(n * val_fraction) samples (at least 1, at most
 * n-1) go to *val, the rest to *train; both keep the original order. */
DTRAIN_API dt_result dt_dataset_split(const dt_dataset *ds, double val_fraction, uint64_t seed,
                                      dt_dataset **train, dt_dataset **val);
/* Reinterpret the per-sample shape (same number of values), e.g. [28,28] -> [1,28,28]. */
DTRAIN_API dt_result dt_dataset_reshape(dt_dataset *ds, int ndim, const int64_t *sample_shape);

/* IDX images (n, dims...) + IDX labels (n): pixels / 255 (or raw with
 * DTRAIN_DATA_RAW), labels as int32, num_classes = max label + 1. Either
 * file may be gzipped. labels_path NULL (or labels NULL / 0 bytes): no labels. */
DTRAIN_API dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path,
                                         unsigned flags);
DTRAIN_API dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len,
                                          const void *labels, size_t labels_len, unsigned flags);

/* Fashion-MNIST: find the directory holding its IDX files (.gz or not).
 * Looks at `dir` if non-NULL (which must hold at least the test split), else
 * /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist), else
 * data/fashion-mnist relative to the working directory (the shipped test
 * split only). Writes the directory used to out (cap bytes) and whether it
 * has the 60000-image train split to *has_train (may be NULL). */
DTRAIN_API dt_result dt_fashion_mnist_find(const char *dir, char *out, size_t cap, int *has_train);
/* Load the splits from `dir` (found as above). train may be NULL (not
 * wanted); *train is set to NULL when the directory has no train split. */
DTRAIN_API dt_result dt_fashion_mnist_load(const char *dir, dt_dataset **train, dt_dataset **test);

/* ---- CSV ----------------------------------------------------------------------------
 * Numeric CSV: every field a finite number (C locale: '.' decimal point);
 * blank lines are skipped; "\r\n" line ends are fine; every row must have the
 * same number of fields. A zeroed desc means: no header, no labels, ','. */
typedef struct dt_csv_desc {
  int header;          /* nonzero: the first line is a header and is skipped */
  int has_labels;      /* nonzero: one column holds integer labels >= 0 */
  int label_column;    /* 0-based; negative counts from the end (-1 = last) */
  char delimiter;      /* 0 means ',' */
} dt_csv_desc;

DTRAIN_API dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_desc *desc);
DTRAIN_API dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_desc *desc);

/* ---- NPY ----------------------------------------------------------------------------
 * NumPy .npy, format versions 1.0 and 2.0 (read), 1.0 (written). dtypes
 * '<f4', '<i4', '<i8', '|u1' (and big-endian '>f4', '>i4', '>i8', converted
 * on reading); C order only (fortran_order True is refused). */
typedef enum dt_npy_dtype {
  DTRAIN_NPY_F32 = 1,  /* float32 */
  DTRAIN_NPY_U8 = 2,   /* uint8 */
  DTRAIN_NPY_I32 = 3,  /* int32 */
  DTRAIN_NPY_I64 = 4   /* int64 */
} dt_npy_dtype;

typedef struct dt_npy {
  void *data;                      /* size elements of dtype, native byte order */
  dt_npy_dtype dtype;
  int ndim;                        /* 0 (scalar) .. DTRAIN_MAX_DIMS */
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t size;
  size_t bytes_;                   /* private */
} dt_npy;

DTRAIN_API dt_result dt_npy_read(const char *path, dt_npy *out);
DTRAIN_API dt_result dt_npy_parse(const void *buf, size_t len, dt_npy *out);
DTRAIN_API void dt_npy_free(dt_npy *a);
/* Bytes per element of a dtype (0 if unknown). */
DTRAIN_API size_t dt_npy_dtype_size(dt_npy_dtype dtype);
/* Encode into buf (cap bytes); *len receives the bytes needed. buf NULL or
 * cap too small: nothing written, DTRAIN_ERR_INVALID_ARG unless buf is NULL
 * (a size query returns DTRAIN_OK). */
DTRAIN_API dt_result dt_npy_encode(void *buf, size_t cap, size_t *len, dt_npy_dtype dtype, int ndim,
                                   const int64_t *shape, const void *data);
DTRAIN_API dt_result dt_npy_write(const char *path, dt_npy_dtype dtype, int ndim, const int64_t *shape,
                                  const void *data);
/* Dataset from arrays: x [n, ...] of any dtype (uint8 scaled to [0,1] unless
 * DTRAIN_DATA_RAW), y [n] integer labels >= 0 (or NULL). */
DTRAIN_API dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags);

/* ---- text corpora (character models) ----------------------------------------------
 * The vocabulary is the set of distinct bytes of the text, in byte order:
 * id k is the k-th smallest byte value present. */
typedef struct dt_text {
  int32_t *ids;                    /* the text as ids, n of them */
  int64_t n;
  int vocab_size;                  /* 1..256 */
  unsigned char vocab[256];        /* id -> byte */
  int16_t id_of[256];              /* byte -> id, -1 if absent */
  size_t bytes_;                   /* private */
} dt_text;

DTRAIN_API dt_result dt_text_read(const char *path, dt_text *out);
DTRAIN_API dt_result dt_text_parse(const void *buf, size_t len, dt_text *out);
DTRAIN_API void dt_text_free(dt_text *t);
/* Bytes -> ids (len of them); a byte outside the vocabulary is an error. */
DTRAIN_API dt_result dt_text_encode(const dt_text *t, const char *s, size_t len, int32_t *ids);
/* ids -> bytes; writes n bytes and a terminating 0 (cap >= n + 1). */
DTRAIN_API dt_result dt_text_decode(const dt_text *t, const int32_t *ids, int64_t n, char *out, size_t cap);
/* `batch` random windows of ids[begin, end): x[b*seq_len + t] = ids[s + t],
 * y[...] = ids[s + t + 1] (next-character targets); needs end - begin > seq_len. */
DTRAIN_API dt_result dt_text_sample(const dt_text *t, int64_t begin, int64_t end, dt_rng *rng, int64_t batch,
                                    int64_t seq_len, int32_t *x, int32_t *y);

/* ---- loader --------------------------------------------------------------------------
 * Iterates one shard of a dataset in batches, epoch after epoch.
 *
 * Order: epoch e visits the permutation P_e of 0..n-1, a pure function of
 * (seed, e) (identity when shuffle is 0). Shard k of K takes the positions
 * k, k+K, k+2K, ... of P_e: shards are disjoint and their union is the whole
 * set. When K does not divide n, shards 0..(n mod K)-1 hold one sample more
 * than the others (sizes floor(n/K) or ceil(n/K)); replicas that must take
 * the same number of steps should use drop_last with equal batch counts, or
 * a dataset size divisible by K * batch_size.
 *
 * Position: (epoch, index), index = samples of this shard already delivered
 * in this epoch. It is all the state there is: save it with
 * dt_loader_position and restore it with dt_loader_set_position to resume
 * the identical stream of batches.
 *
 * Batches live in buffers the loader allocated once at creation: a batch is
 * valid until the next dt_loader_next call. Stepping allocates nothing.
 */
typedef struct dt_loader dt_loader;

typedef struct dt_loader_desc {
  int64_t batch_size;    /* required, >= 1 */
  uint64_t seed;         /* shuffle seed */
  int shuffle;           /* nonzero: a fresh permutation every epoch */
  int drop_last;         /* nonzero: skip the last partial batch of an epoch */
  int shard_index;       /* k in 0..shard_count-1 */
  int shard_count;       /* K; 0 means 1 (the whole set) */
} dt_loader_desc;

typedef struct dt_batch {
  float *x;                        /* size * sample_size floats (loader's buffer) */
  int32_t *y;                      /* size labels, NULL if the dataset has none */
  const int64_t *index;            /* dataset index of each sample */
  int64_t size;                    /* samples in this batch (<= batch_size) */
  int ndim;                        /* 1 + the sample ndim */
  int64_t shape[DTRAIN_MAX_DIMS];  /* [size, sample shape...]: for dt_tensor_wrap */
  int64_t epoch;                   /* where this batch came from */
  int64_t start;                   /* index of its first sample in the epoch's shard order */
} dt_batch;

DTRAIN_API dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_desc *desc);
DTRAIN_API void dt_loader_destroy(dt_loader *l);
/* Next batch: returns 1 and fills *b; at the end of the epoch returns 0
 * (b untouched) and moves to (epoch + 1, 0); a negative dt_result on error.
 *   while (dt_loader_next(L, &b) > 0) { ...train on b... }   // one epoch */
DTRAIN_API int dt_loader_next(dt_loader *l, dt_batch *b);
DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index);
DTRAIN_API dt_result dt_loader_set_position(dt_loader *l, int64_t epoch, int64_t index);
/* Samples in this shard per epoch, and batches per epoch (honours drop_last). */
DTRAIN_API int64_t dt_loader_num_samples(const dt_loader *l);
DTRAIN_API int64_t dt_loader_num_batches(const dt_loader *l);
/* The dataset index at position `index` of epoch `epoch` in this shard's order
 * (-1 if out of range). Pure: does not move the loader. */
DTRAIN_API int64_t dt_loader_sample_at(dt_loader *l, int64_t epoch, int64_t index);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_DATA_H */
/* ======== end dt_data.h ======== */

/* ======== begin dt_memory.h ======== */
/* ===========================================================================
 * dt_memory.h -- where the memory of a training set-up goes
 * ===========================================================================
 * dt_memory_stats() adds up the bytes of a params / optimizer / graph triple:
 * parameter values, gradients, optimizer state and the step's activations
 * (the graph arena's peak: activations, their gradients and op scratch).
 * After the first step a training step allocates nothing more, so these
 * figures are the steady state.
 */
#ifndef DTRAIN_MEMORY_H
#define DTRAIN_MEMORY_H

/* #include "dt_optim.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_memory_info {
  size_t params_bytes;      /* parameter values (the flat data buffer, buffers included) */
  size_t grads_bytes;       /* the flat gradient buffer */
  size_t optim_bytes;       /* optimizer state: momentum, Adam moments (0 without an optimizer) */
  size_t activations_bytes; /* peak arena use of one step so far (dt_graph_bytes_peak) */
  size_t arena_bytes;       /* arena memory the graph holds now (dt_graph_bytes_reserved) */
  size_t tape_bytes;        /* the graph's autograd tape and parameter views */
  size_t total_bytes;       /* params + grads + optim + arena + tape */
} dt_memory_info;

/* Fills *out for the params p, the optimizer o created on p, and the graph g;
 * any of them may be NULL (its figures are 0), except that an optimizer needs
 * its params (its state has their size). DTRAIN_ERR_NULL_ARG when out is NULL
 * or o is given without p. */
DTRAIN_API dt_result dt_memory_stats(const dt_params *p, const dt_optim *o, const dt_graph *g, dt_memory_info *out);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_MEMORY_H */
/* ======== end dt_memory.h ======== */

/* ======== begin dt_comm.h ======== */
/* ===========================================================================
 * dt_comm.h -- communicators: all-reduce, reduce-scatter, all-gather,
 * reduce, broadcast and barrier over flat float buffers, behind a vtable
 * ===========================================================================
 * A communicator connects `world` ranks. Every collective is called by every
 * rank with the same n (and root); each rank passes its own buffer. Sums run
 * in rank order (rank 0 + rank 1 + ...), so results never depend on timing
 * and repeat bitwise.
 *
 * Backends implement dt_comm_vtable. The in-process backend
 * (dt_comm_create_threads) connects threads of one process: each call names
 * the calling thread's rank. Backends with one rank per process (TCP, MPI)
 * implement the same table and take the rank argument as a check.
 *
 * Slices: reduce-scatter and all-gather split a buffer of n floats into
 * `world` contiguous slices given by dt_comm_slice(): boundaries on multiples
 * of 16 floats (64 bytes, no false sharing), sizes differing by at most 16.
 *
 * Failure: dt_comm_abort() breaks the communicator; every collective in
 * progress or later returns DTRAIN_ERR_ABORTED on every rank (no rank is left
 * waiting) until dt_comm_recover(), which is called when no rank is inside.
 * DTRAIN_ERR_ABORTED comes without a message or log line of its own: the
 * rank that aborted reports the cause.
 *
 * Threads: a rank's calls come from one thread at a time; different ranks
 * call concurrently. Buffers must not be touched by anyone else while a
 * collective on them runs; when a call returns, the buffer is the caller's.
 */
#ifndef DTRAIN_COMM_H
#define DTRAIN_COMM_H

/* #include "dt_base.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_comm dt_comm;

/* Per-rank counters (since creation or dt_comm_reset_stats). */
typedef struct dt_comm_stats {
  int64_t calls;       /* collectives completed by this rank */
  double wait_s;       /* seconds this rank spent waiting for the others */
  uint64_t bytes;      /* bytes of buffer this rank passed to collectives */
} dt_comm_stats;

typedef struct dt_comm_vtable {
  const char *name; /* "threads", "tcp", ... */
  /* Every buffer gets the element-wise sum over ranks. */
  dt_result (*allreduce)(dt_comm *c, int rank, float *buf, size_t n);
  /* The rank's slice (dt_comm_slice) of its buffer gets the sum over ranks of
   * that slice; the rest of its buffer is unspecified afterwards. */
  dt_result (*reduce_scatter)(dt_comm *c, int rank, float *buf, size_t n);
  /* Slice r of every buffer gets slice r of rank r's buffer. */
  dt_result (*allgather)(dt_comm *c, int rank, float *buf, size_t n);
  /* The root's buffer gets the sum; the others' buffers are unchanged. */
  dt_result (*reduce)(dt_comm *c, int rank, float *buf, size_t n, int root);
  /* Every buffer gets a copy of the root's. */
  dt_result (*broadcast)(dt_comm *c, int rank, float *buf, size_t n, int root);
  dt_result (*barrier)(dt_comm *c, int rank);
  /* Break the communicator (see above). Callable from any rank, any time. */
  void (*abort)(dt_comm *c, int rank);
  /* Make a broken communicator usable again; no rank may be inside a call. */
  dt_result (*recover)(dt_comm *c);
  void (*stats)(dt_comm *c, int rank, dt_comm_stats *out);
  void (*reset_stats)(dt_comm *c);
  void (*destroy)(dt_comm *c);
} dt_comm_vtable;

/* The communicator object. Backends fill it; users only pass it around. */
struct dt_comm {
  const dt_comm_vtable *vtable;
  int world;  /* number of ranks (>= 1) */
  int rank;   /* one-rank-per-process backends (tcp, mpi): this process's rank; threads: 0 */
  void *impl; /* the backend's state */
};

/* In-process backend for `world` threads (1 <= world <= 256). spin_us: how
 * long a waiting rank spins before it sleeps (0: default, 50 us when the
 * ranks fit on the cores; < 0: never spin). NULL on failure; world > 1 needs
 * threads (DTRAIN_ERR_UNSUPPORTED with DTRAIN_NO_THREADS). Each collective:
 * ranks publish their buffers and meet at a barrier, each rank sums its slice
 * in rank order and writes the result where it belongs (for all-reduce: into
 * every rank's buffer -- reduce-scatter and all-gather fused), and they meet
 * again before returning. */
DTRAIN_API dt_comm *dt_comm_create_threads(int world, int spin_us);
/* Destroys any backend; NULL is a no-op. No rank may be inside a call. */
DTRAIN_API void dt_comm_destroy(dt_comm *c);

/* The collectives: check the arguments, then call the backend. They return
 * DTRAIN_ERR_NULL_ARG / DTRAIN_ERR_INDEX for bad arguments (without
 * communicating), DTRAIN_ERR_ABORTED when the communicator is broken, and
 * DTRAIN_ERR_MISMATCH (on every rank) when the ranks disagree on n or root. */
DTRAIN_API dt_result dt_comm_allreduce(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_allgather(dt_comm *c, int rank, float *buf, size_t n);
DTRAIN_API dt_result dt_comm_reduce(dt_comm *c, int rank, float *buf, size_t n, int root);
DTRAIN_API dt_result dt_comm_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root);
DTRAIN_API dt_result dt_comm_barrier(dt_comm *c, int rank);
DTRAIN_API void dt_comm_abort(dt_comm *c, int rank);
DTRAIN_API dt_result dt_comm_recover(dt_comm *c);
DTRAIN_API int dt_comm_world(const dt_comm *c);
/* This process's rank in a one-rank-per-process communicator (tcp, mpi); 0 for threads. */
DTRAIN_API int dt_comm_rank(const dt_comm *c);
DTRAIN_API const char *dt_comm_name(const dt_comm *c);
DTRAIN_API dt_result dt_comm_stats_get(dt_comm *c, int rank, dt_comm_stats *out);
DTRAIN_API void dt_comm_reset_stats(dt_comm *c);

/* Slice `rank` of n floats split over `world` ranks: [*begin, *end). */
DTRAIN_API void dt_comm_slice(size_t n, int world, int rank, size_t *begin, size_t *end);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_COMM_H */
/* ======== end dt_comm.h ======== */

/* ======== begin dt_strategy.h ======== */
/* ===========================================================================
 * dt_strategy.h -- data-parallel training in one process: one_device,
 * mirrored, central_storage and async (Hogwild) behind one API; the
 * in-process parameter store
 * ===========================================================================
 * Write the model and a step function once; pick a strategy in one line:
 *
 *   static dt_tensor *step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
 *     model *m = (model *)user;              // read-only here: replicas share it
 *     int64_t xs[2] = {b->rows, 784};
 *     dt_tensor *x = dt_tensor_wrap(g, 2, xs, (float *)b->x);
 *     return dt_cross_entropy(g, model_forward(g, m, x), b->y);   // mean over the shard
 *   }
 *   ...
 *   dt_strategy_desc sd = dt_mirrored(4);    // or dt_one_device(), dt_central_storage(4), dt_async(4, 2)
 *   dt_strategy *s = dt_strategy_create(P, opt, step, &m, &sd);
 *   for (...) { dt_minibatch b = {...}; dt_strategy_step(s, &b, &loss); }
 *
 * | strategy            | parameters                   | per step                                                |
 * |---------------------|------------------------------|---------------------------------------------------------|
 * | one_device          | the params' own buffers      | forward/backward on the whole batch, one update          |
 * | mirrored(N)         | one copy per replica         | N shards; reduce-scatter of the gradients; each replica  |
 * |                     |                              | updates its slice; all-gather of the parameters          |
 * | central_storage(N)  | one copy read by all (*)     | N shards; gradients reduced into the centre; one update  |
 * |                     |                              | (each replica applies it to its slice of the centre)     |
 * | async(N, k)         | a lock-free store + a copy   | replicas run free: pull, forward/backward on their own   |
 * |                     | per replica                  | batch, local optimizer step, push the update             |
 * | multi_worker_       | one copy per replica in      | each process: its own batch in N shards; threads reduce  |
 * | mirrored(comm, N)   | every process                | to replica 0; ONE all-reduce across processes on comm;   |
 * |                     |                              | each replica updates its slice; all-gather (threads)     |
 * | parameter_server    | sharded over server          | this process is one worker: pull from every server,      |
 * |   (store, k)        | processes (dt_net.h)         | forward/backward on its own batch, push the (clipped)    |
 * |                     |                              | gradient; the servers apply the optimizer to their shard |
 *
 * (*) Non-trainable buffers (batch-norm running statistics) are written by
 * the forward pass, so with such a model each central_storage replica works
 * on a private copy of the centre, refreshed every step. Buffers follow
 * replica 0 in every strategy (mirrored hands replica 0's to every replica
 * after each step, within the all-gather, like PyTorch DDP's
 * broadcast_buffers; multi_worker_mirrored: rank 0's replica 0); async
 * pushes their change like any other update.
 *
 * After a step the params' data buffer holds the trained parameters under
 * every strategy (mirrored: replica 0's copy, equal to the others). Its grad
 * buffer holds the reduced gradient of the whole batch for one_device and
 * central_storage; for mirrored only replica 0's slice of it (the
 * reduce-scatter leaves each slice with its owner).
 *
 * The synchronous strategies compute exactly what one_device computes on the
 * same global batch (up to float rounding: the gradient sums run in rank
 * order) and repeat bitwise. async trades that for never waiting for the
 * slowest replica; max_staleness bounds how far it may drift (0 = lock-step).
 *
 * Batches and loss scaling. The global batch of a synchronous step is split
 * into N contiguous shards; with B rows, shard r has B/N rows plus one when
 * r < B % N (shards may be empty when B < N; an empty replica computes
 * nothing). The step function returns the loss of its shard as it would for
 * one device -- with DTRAIN_LOSS_MEAN (the default) the mean over the shard's
 * rows -- and the strategy weights its gradient by rows/B (the dt_minibatch
 * field `weight`), so the summed gradient is exactly the gradient of the mean
 * over the whole batch, for any split. DTRAIN_LOSS_SUM: the step returns a
 * sum over its rows and the weights are 1.
 * In async, each replica's step is an optimizer step of its own on its own
 * batch (weight 1), like N single-device trainers sharing the parameters.
 *
 * multi_worker_mirrored (hierarchical, across processes). desc.comm connects
 * W processes, one rank each (dt_comm_create_tcp or dt_comm_create_mpi in
 * dt_net.h; borrowed: destroy it after the strategy); desc.replicas threads
 * run inside each process. Every process calls dt_strategy_step with its OWN
 * local batch (its shard of the data, like TF's MultiWorkerMirroredStrategy);
 * the global batch is the concatenation of the local batches in rank order,
 * and local batches may differ in rows (or be empty). Per step: the local
 * replicas compute on shards of the local batch (loss gradients weighted by
 * their rows: row sums), reduce to replica 0 in rank order, replica 0 runs ONE
 * all-reduce on desc.comm of the gradient with a small tail appended (rows,
 * loss sum, failure flags: one collective carries them all), the gradient is
 * divided by the global rows -- so it is exactly the gradient of the mean
 * loss over the global batch, up to float rounding -- and shared back: each
 * local replica updates its slice, an all-gather spreads the parameters.
 * W processes x N threads equal mirrored(W*N) on the concatenated batch
 * (float tolerance) and repeat bitwise. *loss gets the global batch's loss,
 * the same on every rank. At create (and at dt_strategy_sync, which is then a
 * collective: every process calls it) the processes check that they built
 * the same model (dt_params_hash; else DTRAIN_ERR_MISMATCH on every rank
 * naming the one that differs) and rank 0 broadcasts its parameters and
 * buffers, so all start equal whatever each initialised. Buffers (batch-norm
 * statistics) follow rank 0's replica 0 (carried by the same all-reduce).
 * shard.first and shard.global_rows are relative to the local batch. The
 * params' grad buffer gets the reduced gradient of the global batch (after
 * clipping). Failures: a communicator error (a lost or stalled rank) ends the
 * step on every local replica with the communicator's message (it names the
 * lost rank, the operation and its sequence number) and changes no
 * parameter; a local failure on one rank (NaN loss, a failing op) fails the
 * step on every rank: that rank reports its own error, the others
 * DTRAIN_ERR_PEER "rank k failed its part of step s". Every process must call
 * dt_strategy_step the same number of times.
 *
 * Async update rule. Each replica pulls the parameters into its own copy
 * with relaxed atomic loads (no lock; a version number says how fresh),
 * runs forward/backward, applies the optimizer to its copy with its own
 * optimizer state (a clone of the given optimizer), and pushes the
 * difference (new - pulled) into the store. The default push,
 * DTRAIN_ASYNC_HOGWILD, is Hogwild's unsynchronised per-element update done
 * with relaxed atomic loads and stores: no lock, no read-modify-write
 * instruction, but two replicas writing the same element at the same instant
 * may lose one of the two additions -- rare (replicas sweep the buffer at
 * different places) and harmless for SGD, as the Hogwild paper shows; atomic
 * (not plain) accesses keep it free of undefined behaviour and clean under
 * ThreadSanitizer. DTRAIN_ASYNC_ATOMIC adds with a compare-and-swap loop per
 * element: no update is ever lost, at several times the cost of the push.
 *
 * Staleness. max_staleness k is bounded staleness (SSP) on step clocks: a
 * replica starts (pulls for) its step t only after every replica finished
 * step t-k-1, and pushes step t only after every replica started step t-k;
 * so a replica is never more than k steps ahead of the slowest one, and the
 * parameters it computes on miss at most (N-1)(2k+1) updates. k = 0 is
 * lock-step: every replica reads the same parameters in a round, and the
 * pushes are applied in replica order, so async(N, 0) is deterministic and
 * equals a synchronous step with DTRAIN_LOSS_SUM. DTRAIN_STALENESS_UNBOUNDED
 * (-1) is fully asynchronous. The staleness recorded for each push (the
 * histogram in dt_strategy_stats) is the number of updates other replicas
 * pushed between its pull and its push.
 *
 * Failures. An error in one replica (a failing op, a non-finite loss, with
 * check_numerics also a NaN/Inf gradient or update) stops the step on every
 * replica: the barrier or the store is broken, the others return at once
 * with DTRAIN_ERR_ABORTED, and dt_strategy_step/run returns the failing
 * replica's code with a message naming it ("replica 2: dt_matmul: ...").
 * Nothing is left waiting. A failed synchronous step changes no parameter
 * (the check happens before any update; batch-norm statistics excepted);
 * dt_strategy_stats.failed_replica and each dt_replica_stats.result say who
 * failed and who was aborted. The strategy stays usable.
 *
 * Threads: the pool of N-1 worker threads is created with the strategy and
 * lives until it is destroyed (the calling thread is replica 0); no thread
 * is created per step. Who touches what:
 *
 * | object                      | touched by                                                        |
 * |-----------------------------|-------------------------------------------------------------------|
 * | dt_strategy                 | one calling thread at a time (step, run, stats, sync, destroy)     |
 * | the step function           | replica r's thread, concurrently for different r; `user` must be   |
 * |                             | read-only or per-replica                                           |
 * | the batch function (run)    | sync: the calling thread; async: replica r's thread, concurrently  |
 * | replica r's graph           | replica r's thread during a step; the caller between steps         |
 * | the params and optimizer    | the strategy during step/run; the caller between them              |
 * | params data during async    | read and written by every replica with atomic accesses             |
 *
 * Without threads (DTRAIN_NO_THREADS) only one_device works; the other
 * strategies return DTRAIN_ERR_UNSUPPORTED from dt_strategy_create.
 *
 * Devices (GPUs). desc.devices / desc.ndevices put the replicas on devices,
 * one replica per device (dt_device.h; dtrain_cuda.h makes CUDA ones):
 *
 *   dt_device *gpu[2] = {dt_cuda_device_create(0), dt_cuda_device_create(1)};
 *   dt_strategy_desc sd = dt_mirrored(0);   the replica count follows the devices
 *   sd.devices = gpu; sd.ndevices = 2;      the one-line switch (one_device: 1 device)
 *
 * The step function is unchanged: replica r's graph is created with
 * dt_graph_desc.device = devices[r], so dt_tensor_from() copies its shard of
 * the host batch to that device and the ops run there (the ops a device
 * lacks fail the step with DTRAIN_ERR_UNSUPPORTED; dt_tensor_wrap takes
 * device pointers there, so wrap host data only on the CPU). A step: every
 * replica zeroes its device gradient and runs forward/backward on its shard
 * (the same loss weights as on the CPU: MEAN rows/B, SUM 1); the gradients
 * are all-reduced ON THE DEVICES (dt_device_group in dt_device.h: NCCL
 * where the backend has it, else a ring over peer copies; afterwards every
 * replica's dt_graph_param_grad holds the reduced gradient); replica 0
 * checks it on a host copy when asked (check_numerics: NaN/Inf; clip_norm:
 * a finite norm), so a bad gradient stops the step before any update; then
 * device 0 alone updates with dt_optim_step_graph and the optimizer given
 * to dt_strategy_create (clipping the reduced gradient; the optimizer state
 * lives on device 0 only) and broadcasts its parameters (buffers included:
 * batch-norm statistics follow replica 0) to the other devices (ncclBroadcast
 * with NCCL, else peer copies). Why not
 * every device updating its own copy: one optimizer state instead of N, and
 * the replicas can never drift apart (see Failures); the price is one
 * broadcast of the parameters per step. Last, replica 0's parameters are
 * copied to the params' data buffer (one device -> host copy per step), so
 * dt_save / evaluation on the host see the trained values as with the CPU
 * strategies; the params' grad buffer is NOT written with devices.
 * mirrored(N) on N devices equals CPU mirrored(N) and one_device on the
 * whole batch within float tolerance (the all-reduce sums in ring order),
 * and repeats bitwise; one_device with one device is the same code without
 * the all-reduce.
 * Failures: as on the CPU ("replica 1: dt_relu: device cuda:1: ..."; a
 * failing all-reduce, update or broadcast is reported by replica 0 and
 * names the device); stats.failed_replica says who. A failed step leaves
 * the params' values intact, and when it failed in the update or the
 * broadcast the strategy uploads them to every device again, so the
 * replicas stay equal; the optimizer's state and step count on device 0
 * may then keep that step (as a failing dt_optim_step_graph would).
 * multi_worker_mirrored with devices: each process's replicas run on its
 * devices; the local gradients are all-reduced on the devices, replica 0's
 * copy comes to the host (device -> host), joins the cross-process
 * all-reduce on desc.comm as above, and goes back to device 0 (host ->
 * device), which updates and broadcasts to the other local devices as in
 * mirrored; W processes x N devices equal CPU mirrored(W*N) within float
 * tolerance (every process's device 0 updates; the processes stay equal as
 * on the CPU: same sum, same update).
 * dt_strategy_sync uploads the params' values to every device (mwm: rank
 * 0's, as above). central_storage, async and parameter_server keep their
 * parameters in host memory and refuse devices (DTRAIN_ERR_UNSUPPORTED at
 * dt_strategy_create).
 */
#ifndef DTRAIN_STRATEGY_H
#define DTRAIN_STRATEGY_H

/* #include "dt_optim.h" (amalgamated) */
/* #include "dt_comm.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

#define DTRAIN_MAX_REPLICAS 64
#define DTRAIN_STALENESS_UNBOUNDED (-1)
#define DTRAIN_STALENESS_BINS 64

typedef enum dt_strategy_kind {
  DTRAIN_STRATEGY_ONE_DEVICE = 0,
  DTRAIN_STRATEGY_MIRRORED,
  DTRAIN_STRATEGY_CENTRAL_STORAGE,
  DTRAIN_STRATEGY_ASYNC,
  DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED, /* lock-step across processes (dt_net.h); desc.comm */
  DTRAIN_STRATEGY_PARAMETER_SERVER       /* async against server processes (dt_net.h); desc.store */
} dt_strategy_kind;

typedef enum dt_loss_reduction {
  DTRAIN_LOSS_MEAN = 0, /* the step returns the mean over its shard (default) */
  DTRAIN_LOSS_SUM       /* the step returns the sum over its shard */
} dt_loss_reduction;

typedef enum dt_async_update {
  DTRAIN_ASYNC_HOGWILD = 0, /* relaxed atomic load + store per element (default) */
  DTRAIN_ASYNC_ATOMIC       /* compare-and-swap add per element: no lost update */
} dt_async_update;

/* A batch (or a shard of one): arrays with `rows` rows, row-major. The
 * strategy never copies the data; shards point into the global batch. */
typedef struct dt_minibatch {
  int64_t rows;          /* samples */
  const float *x;        /* rows * x_cols inputs (may be NULL) */
  int64_t x_cols;
  const int32_t *y;      /* rows * y_cols integer labels (may be NULL) */
  int64_t y_cols;        /* 0 means 1 */
  const float *t;        /* rows * t_cols float targets (may be NULL) */
  int64_t t_cols;
  void *user;            /* passed unchanged to every shard */
  /* Filled by the strategy in what the step function receives: */
  int64_t step;          /* the batch's number: sync, the global step; async, a ticket unique across replicas */
  int64_t replica_step;  /* steps this replica made before this one in the current call */
  int64_t first;         /* the shard's first row in the global batch */
  int64_t global_rows;   /* rows of the global batch */
  float weight;          /* factor applied to this shard's loss gradient */
} dt_minibatch;

/* Builds replica `replica`'s loss on graph g (bound to that replica's
 * parameters: use dt_param(g, i) / the dt_nn_* layers) for its shard and
 * returns it (one element), or NULL after a failed op (the graph's error is
 * reported). Called concurrently from the replicas' threads. */
typedef dt_tensor *(*dt_step_fn)(dt_graph *g, int replica, const dt_minibatch *shard, void *user);

/* Fills *out with batch number `step` for dt_strategy_run: replica -1 asks
 * for the global batch of a synchronous step (called on the calling
 * thread); replica r >= 0 for async replica r's own batch (called on that
 * replica's thread, concurrently with other replicas). The data must stay
 * valid until the step is done (the next call for the same replica). Return
 * DTRAIN_OK or an error code, which stops the run. */
typedef dt_result (*dt_minibatch_fn)(void *user, int replica, int64_t step, dt_minibatch *out);

typedef struct dt_pstore dt_pstore; /* the parameter store (below) */

/* Zero fields take the defaults in brackets. */
typedef struct dt_strategy_desc {
  dt_strategy_kind kind;         /* [one_device] */
  int replicas;                  /* N [one_device: 1; others: the number of CPUs] */
  int max_staleness;             /* async: 0 lock-step, k > 0 bounded, DTRAIN_STALENESS_UNBOUNDED */
  dt_async_update async_update;  /* async: [HOGWILD] */
  dt_loss_reduction loss;        /* [MEAN] */
  int check_numerics;            /* nonzero: every op checks for NaN/Inf, and so do the reduced
                                    gradients (sync) and the pushed updates (async) */
  size_t arena_bytes;            /* first arena block of each replica's graph [1 MiB] */
  uint64_t seed;                 /* replica r's graph RNG (dropout) gets seed + r [1] */
  int spin_us;                   /* waiting threads spin this long before sleeping
                                    [50 when N <= CPUs, else 0.5]; < 0: never spin */
  int straggler;                 /* for experiments: this replica ... */
  float straggler_factor;        /* ... runs this many times slower (> 1: after computing it
                                    sleeps factor-1 times its compute time) [off] */
  dt_comm *comm;                 /* multi_worker_mirrored: the cross-process communicator, one
                                    rank per process (dt_comm_create_tcp/_mpi); borrowed */
  dt_pstore *store;              /* parameter_server: the store (dt_pstore_create_tcp); borrowed */
  dt_device **devices;           /* one_device, mirrored, multi_worker_mirrored: replica r runs on
                                    devices[r] (dt_device.h, e.g. dt_cuda_device_create(r)); the
                                    array and the devices are borrowed [NULL: the CPU] */
  int ndevices;                  /* entries in devices; replicas 0 means ndevices, else it must
                                    equal ndevices (one replica per device) */
} dt_strategy_desc;

/* The one-line choices. */
DTRAIN_API dt_strategy_desc dt_one_device(void);
DTRAIN_API dt_strategy_desc dt_mirrored(int replicas);
DTRAIN_API dt_strategy_desc dt_central_storage(int replicas);
DTRAIN_API dt_strategy_desc dt_async(int replicas, int max_staleness);
/* Across processes: comm has one rank per process (borrowed), `replicas`
 * threads in each (0: the number of CPUs). */
DTRAIN_API dt_strategy_desc dt_multi_worker_mirrored(dt_comm *comm, int replicas);
/* Parameter-server training (dt_net.h): the store from dt_pstore_create_tcp
 * (borrowed: destroy it after the strategy; call dt_pstore_leave when this
 * worker is done). One replica per process; max_staleness is the store's
 * (the argument is ignored in favour of it). The optimizer given to
 * dt_strategy_create only lends its clip_norm (gradients are clipped before
 * the push); the servers run theirs. After a step the params' data holds
 * the parameters this step pulled (the last push is applied on the servers;
 * pull again to see it). */
DTRAIN_API dt_strategy_desc dt_parameter_server(dt_pstore *store, int max_staleness);
/* From a name ("one_device", "mirrored", "central_storage", "async",
 * "multi_worker_mirrored", "parameter_server"), e.g. for a --strategy flag;
 * set desc.comm / desc.store yourself for the last two.
 * DTRAIN_ERR_INVALID_ARG for an unknown name. */
DTRAIN_API dt_result dt_strategy_parse(const char *name, int replicas, int max_staleness, dt_strategy_desc *out);
DTRAIN_API const char *dt_strategy_kind_name(dt_strategy_kind kind);

typedef struct dt_strategy dt_strategy;

/* Create a strategy training `params` with `opt` (created on params) by
 * calling `step(g, replica, shard, user)`. desc NULL means one_device. The
 * params must not gain parameters afterwards. The strategy borrows params,
 * opt and user (they must outlive it) and owns its graphs, replica buffers
 * and threads. After creation the replicas hold the params' current values;
 * if you change them yourself later (loading a checkpoint), call
 * dt_strategy_sync(). NULL on failure (dt_last_error()). */
DTRAIN_API dt_strategy *dt_strategy_create(dt_params *params, dt_optim *opt, dt_step_fn step, void *user,
                                           const dt_strategy_desc *desc);
/* Joins the threads and frees everything the strategy owns; NULL is a no-op. */
DTRAIN_API void dt_strategy_destroy(dt_strategy *s);

/* One step on a global batch: split into shards, forward/backward on every
 * replica, reduce, update. For async: one round -- replica r takes shard r
 * and makes one step of its own against the store. *loss (may be NULL) gets
 * the loss of the whole batch (MEAN: the rows-weighted mean of the shard
 * losses; SUM: their sum). Returns DTRAIN_OK or the first failing replica's
 * error (see Failures). */
DTRAIN_API dt_result dt_strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss);

/* `steps` steps with batches from next(). Sync: `steps` global steps, each on
 * next(user, -1, step) (multi_worker_mirrored: this process's local batch).
 * Async: steps * N pushes in all, the replicas running free (with
 * max_staleness 0 exactly `steps` each); replica r gets its
 * batches from next(user, r, ticket). *mean_loss (may be NULL) gets the mean
 * loss over the steps (async: over the pushes). */
DTRAIN_API dt_result dt_strategy_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                     float *mean_loss);

/* Copy the params' current values into every replica's copy (mirrored).
 * multi_worker_mirrored: a collective (every process calls it): rank 0's
 * values go to every process and replica. */
DTRAIN_API dt_result dt_strategy_sync(dt_strategy *s);

DTRAIN_API int dt_strategy_replicas(const dt_strategy *s);
DTRAIN_API const dt_strategy_desc *dt_strategy_get_desc(const dt_strategy *s);
/* Replica r's graph (for inspection between steps: memory, RNG state). */
DTRAIN_API dt_graph *dt_strategy_graph(dt_strategy *s, int replica);

/* The device of replica r (NULL: the CPU, or r out of range). */
DTRAIN_API dt_device *dt_strategy_device(const dt_strategy *s, int replica);

/* ---- statistics (since creation or dt_strategy_reset_stats) ---------------------- */
typedef struct dt_replica_stats {
  int64_t steps;          /* steps completed (async: pushes) */
  int64_t samples;        /* rows processed */
  double compute_s;       /* forward + backward (+ straggler sleep) */
  double wait_s;          /* waiting for the others: barriers (sync), the staleness bound (async) */
  int64_t staleness_max;  /* async: most updates pushed by others between a pull and its push */
  double staleness_mean;
  int64_t clock_gap_max;  /* async: most steps this replica was ahead of the slowest at a pull */
  dt_result result;       /* of the last call: DTRAIN_OK, its own error, or DTRAIN_ERR_ABORTED */
} dt_replica_stats;

typedef struct dt_strategy_stats {
  dt_strategy_kind kind;
  int replicas;
  int64_t steps;          /* sync: global steps; async: pushes by all replicas */
  int64_t samples;        /* rows processed by all replicas */
  double seconds;         /* wall time inside dt_strategy_step/run */
  double steps_per_s, samples_per_s;
  double wait_s_mean;     /* mean over replicas of dt_replica_stats.wait_s */
  double wait_s_max;
  float last_loss;        /* sync: the last step's loss; async: the last push's */
  double mean_loss;       /* mean over the steps (async: pushes) */
  int64_t staleness_hist[DTRAIN_STALENESS_BINS]; /* async: pushes by staleness; the last bin is ">=" */
  int64_t staleness_max;
  double staleness_mean;
  int64_t clock_gap_max;
  int failed_replica;     /* -1, or the replica whose error ended the last call */
} dt_strategy_stats;

DTRAIN_API dt_result dt_strategy_stats_get(const dt_strategy *s, dt_strategy_stats *out);
DTRAIN_API dt_result dt_strategy_replica_stats(const dt_strategy *s, int replica, dt_replica_stats *out);
DTRAIN_API void dt_strategy_reset_stats(dt_strategy *s);

/* ---- the parameter store -----------------------------------------------------------
 * What async replicas (workers) train against: pull the parameters, push an
 * update, each with a step clock that enforces the staleness bound (see
 * Staleness above). The in-process backend is lock-free; a networked one
 * (parameter-server shards) implements the same table.
 *
 *   for (t = 0; ; t++) {
 *     dt_pstore_pull(ps, w, t, mine, n, &tk);     // may wait for the bound
 *     ... compute delta ...
 *     dt_pstore_push(ps, w, t, delta, n, &tk);    // may wait; records tk.staleness
 *   }
 *   dt_pstore_leave(ps, w);                        // done: nobody waits for w any more
 *
 * With max_staleness 0 every worker must make the same number of steps.
 * dt_pstore_begin() starts a new run (clocks back to 0) when no worker is
 * inside; dt_pstore_abort() makes every waiting and later call return
 * DTRAIN_ERR_ABORTED until dt_pstore_begin(). */
typedef struct dt_pstore_ticket {
  uint64_t version;    /* pull: updates applied when the copy began (push reads it) */
  int64_t staleness;   /* push: updates pushed by others since the pull */
  int64_t clock_gap;   /* pull: steps this worker was ahead of the slowest */
  double wait_s;       /* seconds this call waited for the bound */
} dt_pstore_ticket;

typedef struct dt_pstore_vtable {
  const char *name;
  dt_result (*pull)(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n, dt_pstore_ticket *tk);
  /* delta NULL: an empty push that only advances the clock */
  dt_result (*push)(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n, dt_pstore_ticket *tk);
  void (*leave)(dt_pstore *ps, int worker);
  void (*abort)(dt_pstore *ps);
  dt_result (*begin)(dt_pstore *ps);
  uint64_t (*version)(dt_pstore *ps);
  void (*destroy)(dt_pstore *ps);
} dt_pstore_vtable;

struct dt_pstore {
  const dt_pstore_vtable *vtable;
  int workers;
  int max_staleness;
  size_t size;   /* floats in the store */
  int gradients; /* 0: push takes parameter deltas (the worker ran the optimizer);
                    1: push takes gradients and the store applies the optimizer */
  void *impl;
};

/* In-process store over `data` (n floats, borrowed: the params' buffer) for
 * `workers` threads. NULL on failure. */
DTRAIN_API dt_pstore *dt_pstore_create_local(float *data, size_t n, int workers, int max_staleness,
                                             dt_async_update update, int spin_us);
DTRAIN_API void dt_pstore_destroy(dt_pstore *ps);
DTRAIN_API dt_result dt_pstore_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk);
DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk);
DTRAIN_API void dt_pstore_leave(dt_pstore *ps, int worker);
DTRAIN_API void dt_pstore_abort(dt_pstore *ps);
DTRAIN_API dt_result dt_pstore_begin(dt_pstore *ps);
DTRAIN_API uint64_t dt_pstore_version(dt_pstore *ps);

/* ---- small utilities ------------------------------------------------------------------ */
/* Sleep for `seconds` (monotonic; restarts after signals). */
DTRAIN_API void dt_sleep(double seconds);
/* Number of online CPUs (>= 1). */
DTRAIN_API int dt_cpu_count(void);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_STRATEGY_H */
/* ======== end dt_strategy.h ======== */

/* ======== begin dt_net.h ======== */
/* ===========================================================================
 * dt_net.h -- training across processes and machines: the cluster
 * description, the TCP transport's options, the TCP (and MPI) communicators,
 * and parameter servers
 * ===========================================================================
 * A cluster is W worker processes (ranks 0..W-1) and, for parameter-server
 * training, M server processes. Every process learns the cluster and its own
 * place in it from DTRAIN_CONFIG (JSON in the style of TF_CONFIG) or from
 * flags:
 *
 *   DTRAIN_CONFIG='{"cluster": {"worker": ["10.0.0.1:7000", "10.0.0.2:7000"],
 *                               "ps": ["10.0.0.3:7100"]},
 *                   "task": {"type": "worker", "index": 0}}'
 *
 *   prog --rank 0 --world 2 --peers 10.0.0.1:7000,10.0.0.2:7000 [--ps host:port,...] [--role worker|ps]
 *
 * tools/dtrain-launch -n N [--ps M] -- prog args starts N workers (and M
 * servers) on this machine with the right DTRAIN_CONFIG.
 *
 * Every blocking call has a deadline (dt_net_options.timeout_s, default 30 s,
 * env DTRAIN_TIMEOUT). When a peer dies or stalls, every rank returns an
 * error naming the lost rank, the operation and its sequence number: nothing
 * hangs. The wire format is in docs/wire_protocol.md.
 *
 * Without networking (DTRAIN_NO_NET) the create functions fail with
 * DTRAIN_ERR_UNSUPPORTED; the cluster parser still works.
 */
#ifndef DTRAIN_NET_H
#define DTRAIN_NET_H

/* #include "dt_strategy.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

#define DTRAIN_MAX_PEERS 1024
#define DTRAIN_NET_VERSION 1

typedef enum dt_role {
  DTRAIN_ROLE_WORKER = 0,
  DTRAIN_ROLE_PS = 1
} dt_role;

/* ---- the cluster description ---------------------------------------------------------- */
typedef struct dt_cluster {
  int workers;         /* worker processes (>= 1) */
  int servers;         /* parameter-server processes (>= 0) */
  char **worker_addr;  /* "host:port" of each worker ("[::1]:7000" for IPv6) */
  char **server_addr;  /* "host:port" of each server */
  dt_role role;        /* this process */
  int index;           /* this process's index within its role */
} dt_cluster;

/* Parse DTRAIN_CONFIG-style JSON. On success *out owns a new cluster (free it
 * with dt_cluster_destroy); on failure *out is NULL. The text must be one
 * JSON object (RFC 8259, UTF-8) with "cluster": {"worker": [...], "ps": [...]}
 * ("ps" may be absent or empty) and "task": {"type": "worker" | "ps",
 * "index": N}; other keys, also inside "cluster" and "task" (e.g. "chief"),
 * are checked as JSON and ignored. Addresses are "host:port" (a host name or
 * IPv4) or "[v6]:port", port 0..65535, at most 255 bytes. Nesting is limited
 * to 32 levels. Errors: DTRAIN_ERR_FORMAT for bad JSON, a duplicate or
 * missing key or a non-integer index, naming the byte offset (from 0) and
 * what was expected ("cluster JSON: byte 11: expected ':' after the object
 * key, found '{'"); DTRAIN_ERR_INVALID_ARG for a bad address, an unknown task
 * type, no workers, more than DTRAIN_MAX_PEERS per role, an index out of
 * range or two processes with the same address (host compared ignoring case). */
DTRAIN_API dt_result dt_cluster_parse_json(const char *json, dt_cluster **out);
/* From the environment variable DTRAIN_CONFIG (messages say "DTRAIN_CONFIG:
 * byte N: ..."); DTRAIN_ERR_NOT_FOUND when unset or empty. */
DTRAIN_API dt_result dt_cluster_from_env(dt_cluster **out);
/* From flags --rank R --world W --peers a,b,... [--ps a,b,...] [--role worker|ps]
 * (also --flag=value). The flags it used are removed from argv (and *argc
 * updated; argv[*argc] becomes NULL) so the program can parse the rest;
 * scanning stops at "--". DTRAIN_ERR_NOT_FOUND when none of them is present
 * (then argv is untouched): fall back to the environment. --rank is required
 * (the index within --role, default worker). --world without --peers means
 * 127.0.0.1 ports 29500.. (--port P for the first); then --ps M (a count)
 * puts M servers on the ports after the workers'. --world with --peers must
 * equal the number of peers. On an error (DTRAIN_ERR_INVALID_ARG naming the
 * flag) argv is untouched. */
DTRAIN_API dt_result dt_cluster_from_args(int *argc, char **argv, dt_cluster **out);
/* Flags first, then DTRAIN_CONFIG; neither: a one-worker cluster (*out is a
 * cluster of one worker at 127.0.0.1:0). Bad flags or a bad DTRAIN_CONFIG
 * are errors, not a reason to fall back. argc/argv may be NULL (no flags). */
DTRAIN_API dt_result dt_cluster_discover(int *argc, char **argv, dt_cluster **out);
/* A copy in one allocation, owned by the caller (NULL on failure: out of
 * memory, or c is not a valid cluster as dt_cluster_parse_json would accept;
 * c may be built by hand). */
DTRAIN_API dt_cluster *dt_cluster_clone(const dt_cluster *c);
/* Frees a cluster made by the functions above (never one built by hand); NULL is a no-op. */
DTRAIN_API void dt_cluster_destroy(dt_cluster *c);
/* "worker 1 (127.0.0.1:7001)" into buf (truncated to cap); "worker 7" when c
 * is NULL or has no such process; returns buf. */
DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap);
/* JSON text of c (the DTRAIN_CONFIG that reproduces it, on one line, e.g.
 * {"cluster":{"worker":["a:1"],"ps":[]},"task":{"type":"worker","index":0}})
 * into buf; DTRAIN_ERR_OVERFLOW (buf set to "") if cap is too small, the
 * message naming the bytes needed; DTRAIN_ERR_INVALID_ARG if c is not valid. */
DTRAIN_API dt_result dt_cluster_to_json(const dt_cluster *c, char *buf, size_t cap);

/* ---- transport options ---------------------------------------------------------------- */
/* Zero fields take the defaults in brackets (most also from the environment). */
typedef struct dt_net_options {
  double timeout_s;          /* deadline for every blocking call [env DTRAIN_TIMEOUT, else 30] */
  double connect_timeout_s;  /* how long to retry connecting while peers start [timeout_s] */
  const char *token;         /* shared secret: peers must prove they know it (HMAC-SHA256
                                challenge-response; it never crosses the wire)
                                [env DTRAIN_TOKEN; NULL or "": no authentication] */
  uint64_t job_id;           /* frames of another job are refused [env DTRAIN_JOB_ID, else a
                                hash of the cluster's addresses] */
  uint64_t model_hash;       /* checked in the handshake; 0: not checked (see dt_params_hash) */
  int listen_fd;             /* an already bound, listening socket to use instead of binding
                                this process's address [env DTRAIN_LISTEN_FD; 0 means none:
                                to pass fd 0 itself, use the environment] */
  size_t max_payload;        /* largest frame payload accepted [256 MiB] */
  size_t chunk_bytes;        /* ring all-reduce pipelining chunk [512 KiB] */
  size_t small_bytes;        /* all-reduce of at most this many bytes uses recursive doubling [64 KiB] */
  int quiet;                 /* nonzero: no log lines for refused connections */
  double spin_us;            /* a collective waiting for a peer's frame retries the socket
                                (sched_yield() between tries) this long before sleeping in
                                poll(), whose wake-up costs a few microseconds per message
                                [env DTRAIN_SPIN_US, else 20; 0 here means the default,
                                negative: never spin] */
  int64_t sock_buf_bytes;    /* SO_SNDBUF and SO_RCVBUF of every collective connection: large
                                buffers let a peer send the next ring part while this rank
                                sums the last one (on loopback, 4 MiB ran 1-4 MiB all-reduces
                                about 20-50% faster than autotuning). The kernel caps it
                                (net.core.wmem_max / rmem_max) [env DTRAIN_SOCKBUF, else
                                4 MiB; 0 here means the default; negative (or 0 in the
                                environment): the kernel's own sizes and autotuning] */
} dt_net_options;

DTRAIN_API dt_net_options dt_net_defaults(void);

/* A hash of the parameters' names, shapes and order (not values), for
 * dt_net_options.model_hash: processes that built different models refuse
 * to train together. */
DTRAIN_API uint64_t dt_params_hash(const dt_params *p);

/* ---- communicators across processes ------------------------------------------------------
 * One rank per worker process (rank = cluster index); the rank argument of
 * the dt_comm_* calls must equal it. Creating connects to every peer it needs
 * (retrying with backoff until connect_timeout_s while peers start), runs the
 * handshake (version, job, world size, unique ranks, model hash, token) and
 * fails naming both sides when they differ. All-reduce: ring (reduce-scatter
 * + all-gather, chunked and pipelined) above small_bytes, recursive doubling
 * at or below it. Sums are in a fixed order per element (not rank order), so
 * results repeat bitwise and equal the threads backend within float rounding.
 * Failure: a dead or stalled peer makes the call return DTRAIN_ERR_PEER or
 * DTRAIN_ERR_TIMEOUT within the deadline, with a message naming the peer,
 * the operation and its sequence number; this rank then tells the peers it
 * can still reach (an abort frame) so they fail fast too.
 *
 * Details of the tcp communicator:
 * - Every call has a sequence number (#1, #2, ...) and starts with a small
 *   agreement round (recursive doubling, log2(world) round trips) that
 *   compares the operation, n, root, sequence number and the chunk_bytes /
 *   small_bytes options of every rank: when they differ, every rank returns
 *   DTRAIN_ERR_MISMATCH naming two ranks and what they called, and the
 *   communicator stays usable. A barrier is that round alone.
 * - Sum order: at or below small_bytes, recursive doubling over the largest
 *   power of two p <= world (ranks p.. fold into rank r-p first), i.e. a
 *   fixed tree of ranks; above it, slice j (dt_comm_slice) is summed in ring
 *   order starting after its owner: x[j+1] + x[j+2] + ... + x[j] (mod world).
 *   reduce sums x[root+1] + ... + x[root] along a chain. The order depends
 *   only on n, world and the options, so results repeat bitwise.
 * - Failure messages name the lost rank, not just the neighbour a rank was
 *   waiting for: after a failure each rank listens up to min(timeout_s/4,
 *   2 s) for the others' abort frames; peers that closed their connection
 *   are reported as "worker 2 (host:port) closed the connection"
 *   (DTRAIN_ERR_PEER), peers that sent nothing as "... sent nothing before
 *   the deadline (stalled?)" (DTRAIN_ERR_TIMEOUT). A peer's dt_comm_abort
 *   reaches the others as DTRAIN_ERR_ABORTED. After any failure the
 *   communicator is broken: later calls return DTRAIN_ERR_ABORTED and
 *   dt_comm_recover returns DTRAIN_ERR_UNSUPPORTED -- destroy it, restart the
 *   processes and resume from the last checkpoint.
 * - Setup: rank r dials ranks 0..r-1 and accepts r+1..world-1 until
 *   connect_timeout_s + timeout_s; connections that are not a valid peer
 *   (garbage, another job, a wrong token) are refused, logged and do not
 *   delay the real peers. A socket passed in listen_fd stays the caller's;
 *   one the communicator bound itself is closed once every peer is in.
 * - Memory: buffers of max(chunk_bytes, small_bytes) are allocated at
 *   creation; calls allocate nothing. dt_comm_destroy says goodbye (a BYE
 *   frame) to every peer and closes every socket. */
DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *c, const dt_net_options *o);
/* MPI_COMM_WORLD (DTRAIN_USE_MPI only; otherwise NULL with
 * DTRAIN_ERR_UNSUPPORTED). Calls MPI_Init_thread (MPI_THREAD_SERIALIZED) if
 * MPI is not initialized yet and MPI_Finalize at destroy in that case; a
 * program that initialized MPI itself keeps it. Rank and world are MPI's.
 * Works on a duplicate of MPI_COMM_WORLD (the program's own MPI traffic never
 * mixes with dtrain's) with MPI_ERRORS_RETURN: a failing MPI call returns
 * DTRAIN_ERR_NET with MPI_Error_string's text, the operation and its sequence
 * number (whether MPI reports a lost process or ends the job is up to the
 * MPI library). The collectives map to MPI_Allreduce, MPI_Reduce_scatter,
 * MPI_Allgatherv (dt_comm_slice slices), MPI_Reduce, MPI_Bcast and
 * MPI_Barrier; sums follow MPI's order, so results equal the other backends'
 * within float rounding. dt_comm_abort breaks only this process's
 * communicator. Build and run:
 *
 *   mpicc -O2 -DDTRAIN_USE_MPI prog.c -o prog -lm -lpthread
 *   mpirun -n 4 ./prog                      (or the cluster's scheduler: srun, ...)
 *
 *   dt_comm *c = dt_comm_create_mpi();
 *   dt_strategy_desc sd = dt_multi_worker_mirrored(c, 2);   // 4 processes x 2 threads
 */
DTRAIN_API dt_comm *dt_comm_create_mpi(void);

/* ---- parameter servers ---------------------------------------------------------------------
 * Parameter-server training: the model's variables are sharded over the M
 * server processes of the cluster; W worker processes pull the parameters,
 * compute gradients on their own batches and push them; each server applies
 * the optimizer to its shard. Every process runs the same program and builds
 * the same model (dt_params, same names, shapes and order) and optimizer:
 *
 *   dt_cluster *c;  dt_cluster_discover(&argc, argv, &c);
 *   ... build params P and optimizer opt ...
 *   if (c->role == DTRAIN_ROLE_PS) return dt_ps_serve(c, P, opt, NULL, &po) == DTRAIN_OK ? 0 : 1;
 *   dt_pstore *ps = dt_pstore_create_tcp(c, P, NULL, 2);    // max_staleness 2
 *   dt_strategy_desc sd = dt_parameter_server(ps, 2);
 *   dt_strategy *s = dt_strategy_create(P, opt, step, &m, &sd);
 *   dt_strategy_run(s, steps, next_batch, &data, &loss);
 *   dt_pstore_leave(ps, c->index);                        // BYE: the servers stop waiting for us
 *   dt_strategy_destroy(s);  dt_pstore_destroy(ps);
 *
 * Sharding (dt_ps_shard): parameters are assigned whole, largest first (ties:
 * lower index first), each to the server with the least floats so far (ties:
 * lower server index); every process computes the same assignment. No
 * parameter is split, so one huge parameter makes its server the bottleneck.
 * Non-trainable buffers (batch-norm statistics) are sharded too; a push
 * carries their current value and the server keeps the last one.
 *
 * Staleness: the SSP rule of dt_pstore (dt_strategy.h) on each server, with
 * the bound the workers ask for (dt_pstore_create_tcp; all workers must ask
 * for the same, else the later one is refused). 0 is lock-step: a server
 * applies the pushes of a round in worker order, so 1 worker x 1 server with
 * bound 0 computes exactly what one_device computes with the same optimizer.
 *
 * Failures. A worker whose connection breaks, that sends a bad frame, or
 * from which a server hears nothing for timeout_s while the server owes it
 * no answer (workers send heartbeats every timeout_s/3 when idle; servers
 * send them every timeout_s/4 to a worker held back by the bound) is logged
 * ("ps 0: worker 1 (127.0.0.1:7001) lost: ...; going on with 1 worker"),
 * dropped from the staleness clocks, and training goes on with the rest. A
 * worker that never connects within connect_timeout_s is dropped the same
 * way. A server that dies or stalls makes every call of every worker's store
 * return DTRAIN_ERR_PEER or DTRAIN_ERR_TIMEOUT within about timeout_s, naming
 * it ("worker 0: push #12: receive from ps 1 (127.0.0.1:7101): ..."); the
 * error stays until the store is destroyed. Restart the job: each server
 * resumes from its last checkpoint (dt_ps_options).
 *
 * Wire: after the transport handshake, message types 0x50..0x55 (see
 * docs/wire_protocol.md); parameters and gradients travel as little-endian
 * IEEE-754 floats. */

/* Zero fields take the defaults in brackets. */
typedef struct dt_ps_options {
  const char *checkpoint_dir;  /* shard checkpoints go to DIR/ps-<i>-of-<M>.ckpt (written to a
                                  temporary file, then renamed); on start the server resumes from
                                  it when it exists [NULL: no checkpoints] */
  int64_t checkpoint_every;    /* also write one after every this many updates [0: off] */
  double checkpoint_seconds;   /* also write one when this many seconds passed since the last [0: off] */
  int no_resume;               /* nonzero: start from the params' values even if a checkpoint exists */
} dt_ps_options;

/* The server of each parameter: server_of[i] for i < dt_params_count(p)
 * (see Sharding above). */
DTRAIN_API dt_result dt_ps_shard(const dt_params *p, int servers, int *server_of);

/* Run server c->index (c->role must be DTRAIN_ROLE_PS) until every worker has
 * said BYE or was lost: owns its shard of params (their initial values are
 * the params' current values, or the checkpoint's) and applies opt to it.
 * The optimizer advances once per applied push; its clip_norm is not used
 * (workers clip their gradients before pushing). Writes a final checkpoint
 * when po->checkpoint_dir is set. Returns DTRAIN_OK when at least one worker
 * finished with BYE, DTRAIN_ERR_PEER when all were lost, or the error that
 * stopped it (listening, a bad checkpoint). On return the params' shard
 * holds the trained values. po may be NULL. */
DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po);

/* A parameter store (dt_strategy.h) backed by the cluster's servers, for
 * worker c->index: connects to every server (retrying until
 * connect_timeout_s), checks the model hash (o->model_hash) and the token, and
 * announces max_staleness. Pushes take gradients (store->gradients == 1):
 * the vector pushed has the params' layout, gradients for trainable
 * parameters and current values for buffers. The `worker` argument of the
 * dt_pstore_* calls is ignored (the store is worker c->index); clocks given
 * to pull/push count from dt_pstore_begin, which continues where the last
 * run stopped (the servers' clocks never go back). pull sends a request to
 * every server, then gathers the shards; push sends each server its slice.
 * dt_pstore_leave says BYE (later calls fail with DTRAIN_ERR_STATE);
 * dt_pstore_destroy says it too when leave was not called. A heartbeat
 * thread (not with DTRAIN_NO_THREADS) keeps idle connections alive. NULL on
 * failure (dt_last_error()). */
DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_NET_H */
/* ======== end dt_net.h ======== */

/* ======== begin dt_device.h ======== */
/* ===========================================================================
 * dt_device.h -- running a graph on an accelerator (the device hook)
 * ===========================================================================
 * A graph created with dt_graph_desc.device set runs on that device: the
 * SAME model code (dt_linear, dt_relu, dt_cross_entropy, ... on the graph)
 * works unchanged, but every tensor's `data` and `grad` point into device
 * memory. Tensor headers (shape, flags, the tape) stay in host memory.
 *
 *   dt_device *dev = dt_cuda_device_create(0);     (dtrain_cuda.h)
 *   dt_graph_desc gd = {0};
 *   gd.device = dev;                                the one-line switch
 *   dt_graph *g = dt_graph_create(params, &gd);     uploads the params
 *   ... forward with the usual ops, dt_backward(g, loss) ...
 *   dt_optim_step_graph(opt, g);                    update on the device
 *   dt_graph_zero_grad(g);
 *   dt_graph_params_download(g);                    device -> params (host)
 *
 * What moves, and what does not:
 *   - dt_tensor_from() copies host data to the device; dt_tensor_new() and
 *     gradients are zeroed on the device; dt_tensor_wrap() takes a DEVICE
 *     pointer on a device graph. Read results with dt_tensor_to_host() /
 *     dt_tensor_grad_to_host() (dt_item() copies the one float itself).
 *     Never read t->data of a device tensor on the host.
 *   - A device graph with params holds its own device copy of the params'
 *     flat data and grad buffers (dt_graph_param_data/grad). The host params
 *     are not updated until dt_graph_params_download(); after changing the
 *     host params (dt_load, an initialiser) call dt_graph_params_upload().
 *     dt_graph_bind() on a device graph takes device pointers.
 *   - Label arrays (dt_cross_entropy) are host memory: they are checked on
 *     the host and copied to the device.
 *   - check_numerics on a device graph copies every op output to the host to
 *     check it (slow: for debugging).
 *
 * Ops that run on a device (an op without a device path would fail on a
 * device graph with DTRAIN_ERR_UNSUPPORTED naming the op and the device,
 * before touching any data -- never a silent host read of device memory;
 * today every op of dtrain has one):
 *   dt_add, dt_sub, dt_mul, dt_div  (same shapes, or b broadcast over a's
 *                            leading dims, e.g. [N,C] + [C]; other broadcasts
 *                            are DTRAIN_ERR_UNSUPPORTED on a device)
 *   dt_add_scalar, dt_mul_scalar, dt_rsub_scalar, dt_neg, dt_exp,
 *   dt_leaky_relu, dt_gelu, dt_pow_scalar, dt_log, dt_sqrt (log, sqrt and
 *   non-integer powers check their domain on the device as the CPU op does,
 *   failing with the same DTRAIN_ERR_INVALID_ARG message; the check waits
 *   for one float from the device),
 *   dt_relu, dt_sigmoid, dt_tanh, dt_sum, dt_mean, dt_sum_axis, dt_mean_axis,
 *   dt_transpose (any rank >= 2: the last two dims),
 *   dt_dropout (the mask is drawn on the host from the graph's RNG exactly as
 *   the CPU op draws it, then copied to the device: same seed, same result),
 *   dt_layer_norm, dt_embedding (ids are host memory: checked on the host,
 *   copied to the device),
 *   dt_matmul (2-D), dt_linear, dt_softmax, dt_log_softmax,
 *   dt_cross_entropy, dt_mse, dt_reshape, dt_reshape2, dt_flatten (no-copy
 *   views), dt_conv2d (im2col + GEMM), dt_max_pool2d, dt_avg_pool2d,
 *   dt_permute (any rank), dt_concat, dt_slice, dt_split (strided copies),
 *   dt_bmm (one strided-batched GEMM; b batched or 2-D shared, trans_b),
 *   dt_causal_mask (check_numerics checks the kept entries on the host),
 *   dt_batch_norm (training: batch statistics, the running mean/var updated
 *   in place on the device as the CPU op does; eval: the running stats --
 *   the running_var + eps > 0 check copies C floats to the host),
 *   dt_nn_linear_forward, dt_nn_conv2d_forward, dt_nn_embedding_forward,
 *   dt_nn_layer_norm_forward, dt_nn_batch_norm_forward,
 *   dt_nn_attention_forward, dt_nn_lstm_cell_forward, dt_nn_gru_cell_forward,
 *   dt_detach, dt_param, dt_tensor_new/from/wrap, dt_scalar, dt_item,
 *   dt_backward, dt_backward_grad.
 * Optimizers on a device (dt_optim_step_graph): SGD (momentum, Nesterov,
 * weight decay), Adam, AdamW, RMSprop (momentum, weight decay), clip_norm.
 * Their state lives on the device; dt_optim_state copies it to the host for
 * checkpoints and dt_checkpoint_save/load with the device graph in the
 * dt_train_state move the params too (see dt_io.h): a device run saves and
 * resumes (on the device or on the CPU) without losing anything.
 *
 * ---- the backend interface --------------------------------------------------
 * A device is a table of functions filled by a backend (dtrain_cuda.h is the
 * one shipped). The core never calls a device API directly: it allocates,
 * zeroes and copies through these functions and asks `run` for each kernel.
 * Every function returns DTRAIN_OK or an error code after recording a message
 * with dt_device_error() (e.g. "cuda:0: cudaMalloc of 4096 bytes: out of
 * memory"); the core then fails the graph with that message.
 */
#ifndef DTRAIN_DEVICE_H
#define DTRAIN_DEVICE_H

/* #include "dt_tensor.h" (amalgamated) */

DTRAIN_EXTERN_C_BEGIN

typedef enum dt_copy_kind {
  DTRAIN_COPY_H2D = 0, /* host -> device */
  DTRAIN_COPY_D2H = 1, /* device -> host (returns when the data is on the host) */
  DTRAIN_COPY_D2D = 2  /* device -> device */
} dt_copy_kind;

/* Kernels the core asks for, with their arguments in dt_kernel_args. p[] are
 * device pointers, i64 counts, f scalars. "+=" kernels accumulate. A pointer
 * named "scalar pointer" is a 1-float device buffer read by the kernel (so
 * that the host never waits on a gradient). Row-major everywhere. */
typedef enum dt_kernel {
  /* p0[i] = p1[i] op p2[i % n1], i < n0 (n1 divides n0: b over a's leading dims) */
  DTRAIN_K_ADD = 1, DTRAIN_K_SUB, DTRAIN_K_MUL,
  DTRAIN_K_ACC,          /* p0[i] += f0 * p1[i], i < n0 */
  DTRAIN_K_ACC_MUL,      /* p0[i] += p1[i] * p2[i % n1], i < n0 */
  DTRAIN_K_ACC_ROWS,     /* p0[j] += f0 * sum_r p1[r*n1 + j], j < n1, r < n0/n1 */
  DTRAIN_K_ACC_MUL_ROWS, /* p0[j] += sum_r p1[r*n1 + j] * p2[r*n1 + j] */
  DTRAIN_K_ACC_SCALAR,   /* p0[i] += f0 * p1[0], i < n0 (p1 a scalar pointer) */
  DTRAIN_K_ROWS_COPY,    /* p0[i] = p1[i % n1], i < n0 (bias rows) */
  DTRAIN_K_RELU, DTRAIN_K_SIGMOID, DTRAIN_K_TANH,             /* p0[i] = f(p1[i]), i < n0 */
  DTRAIN_K_RELU_BWD,     /* p0[i] += p1[i] * (p2[i] > 0): p0 gx, p1 gy, p2 x */
  DTRAIN_K_SIGMOID_BWD,  /* p0[i] += p1[i] * p2[i] * (1 - p2[i]): p2 y */
  DTRAIN_K_TANH_BWD,     /* p0[i] += p1[i] * (1 - p2[i]^2): p2 y */
  DTRAIN_K_SUM,          /* p0[0] = f0 * sum p1[0..n0) (accumulated in double) */
  DTRAIN_K_SUMSQ,        /* p0[0] = sum p1[i]^2 (double) */
  DTRAIN_K_SCALE,        /* p0[i] *= f0, i < n0 */
  DTRAIN_K_SQDIFF,       /* p0[i] = (p1[i] - p2[i])^2 */
  DTRAIN_K_MSE_BWD,      /* d = 2*p4[0]/n0 * (p2[i]-p3[i]); p0 += d, p1 -= d (either NULL) */
  /* C = alpha op(A) op(B) + beta C: p0 C [m,n], p1 A, p2 B; n0 m, n1 n, n2 k,
   * n3 = trans_a | trans_b << 1; f0 alpha, f1 beta; packed (lda = cols).
   * Batched when n4 > 1: n4 products, the i-th at p1 + i*n5, p2 + i*n6,
   * p0 + i*n7 (strides in floats; n6 = 0 shares B). n4 0 or 1: one. */
  DTRAIN_K_GEMM,
  /* Softmax over an axis: rows r < n0 (outer*inner), n1 = axis length,
   * n2 = inner stride, n3 = 1 for log-softmax. Fwd: p0 y, p1 x. Bwd: p0 gx,
   * p1 gy, p2 y. */
  DTRAIN_K_SOFTMAX, DTRAIN_K_SOFTMAX_BWD,
  /* Cross entropy, r < n0 rows of n1 classes, labels in `labels` (device):
   * fwd p0 row loss, p1 logits, p2 row max, p3 row log-sum-exp(x - max);
   * bwd (i < n0*n1) p0 gx += p4[0]*f0 * (softmax - onehot), p1 logits, p2, p3. */
  DTRAIN_K_XENT, DTRAIN_K_XENT_BWD,
  /* Optimizers over i < n0 elements: p0 param, p1 grad.
   * SGD: p2 momentum buffer or NULL; f0 lr, f1 weight decay, f2 momentum,
   *      n1 nesterov.
   * ADAM: p2 m, p3 v; f0 step_size, f1 weight decay, f2 sqrt(bias corr. 2),
   *      f3 eps, f4 1-beta1, f5 1-beta2, f6 beta2, f7 shrink (AdamW
   *      1 - lr*wd); n1 decoupled (AdamW). Same float operations as the CPU. */
  DTRAIN_K_SGD, DTRAIN_K_ADAM,
  /* Convolution, NCHW: n0 N, n1 C, n2 H, n3 W, n4 kh, n5 kw, n6 stride,
   * n7 padding, n8 Ho, n9 Wo, n10 O. Columns are [N][K][P] (K = C*kh*kw,
   * P = Ho*Wo), one K x P matrix per image.
   * IM2COL: p0 col, p1 x. COL2IM_ACC: p0 gx += the columns p1 fold back.
   * CONV_BIAS: p0 y [N,O,P] = p1 b[o]. CONV_BIAS_BWD: p0 gb[o] += sum of
   * p1 gy over images and positions. */
  DTRAIN_K_IM2COL, DTRAIN_K_COL2IM_ACC, DTRAIN_K_CONV_BIAS, DTRAIN_K_CONV_BIAS_BWD,
  /* Pooling, no padding: n0 planes (N*C), n1 H, n2 W, n3 Ho, n4 Wo,
   * n5 kernel, n6 stride. Fwd p0 y, p1 x. Bwd p0 gx, p1 gy, p2 x, p3 y (max:
   * the gradient goes to the first maximum of each window, a NaN wins). */
  DTRAIN_K_MAXPOOL, DTRAIN_K_MAXPOOL_BWD, DTRAIN_K_AVGPOOL, DTRAIN_K_AVGPOOL_BWD,
  /* Division, b over a's leading dims as DTRAIN_K_ADD: DIV p0[i] = p1[i] /
   * p2[i % n1]; ACC_DIV p0[i] += p1[i] / p2[i % n1] (ga += gy / b);
   * DIV_BWD_ROWS p0[j] -= sum_r p1[r*n1+j] * p3[r*n1+j] / (p2[j] * p2[j]),
   * j < n1, rows r < n0/n1 ascending (gb from gy p1, b p2, a p3). */
  DTRAIN_K_DIV, DTRAIN_K_ACC_DIV, DTRAIN_K_DIV_BWD_ROWS,
  /* Elementwise maps, i < n0, n1 a dt_map_fn, f0 its scalar: MAP p0[i] =
   * f(p1[i]); MAP_BWD p0[i] += p1[i] * f'(...) with p2 x, p3 y. */
  DTRAIN_K_MAP, DTRAIN_K_MAP_BWD,
  /* Sum over one axis, x viewed as [outer n0, len n1, inner n2]: SUM_AXIS
   * p0[o*n2 + i] = sum_k p1[(o*n1 + k)*n2 + i] (in double, k ascending;
   * divided by n1 when n3 = 1: the mean); SUM_AXIS_BWD p0[(o*n1 + k)*n2 + i]
   * += p1[o*n2 + i] * f0. */
  DTRAIN_K_SUM_AXIS, DTRAIN_K_SUM_AXIS_BWD,
  /* Batched transpose: p1 is n0 matrices of n1 rows x n2 cols; p0 gets
   * their transposes (n2 x n1 each), p0 = when n3 = 0, p0 += when n3 = 1. */
  DTRAIN_K_TRANSPOSE,
  /* Layer norm over rows r < n0 of n1 floats, f0 eps. p4 stats: mean[n0]
   * then rstd[n0] (written by the forward, read by the backward).
   * LAYER_NORM (per row): p0 y, p1 x, p2 gamma, p3 beta (either NULL).
   * LAYER_NORM_BWD (per row): p0 gx +=, p1 gy, p2 x, p3 gamma (or NULL).
   * LAYER_NORM_BWD_PARAMS (per column j < n1, rows ascending): p0 ggamma
   * +=, p1 gbeta += (either NULL), p2 gy, p3 x. */
  DTRAIN_K_LAYER_NORM, DTRAIN_K_LAYER_NORM_BWD, DTRAIN_K_LAYER_NORM_BWD_PARAMS,
  /* Embedding, n0 ids (in `labels`, device, already range-checked), rows of
   * n1 floats: EMBED p0[i*n1 + j] = p1[ids[i]*n1 + j]; EMBED_BWD (one
   * column j < n1, ids in order) p0[ids[i]*n1 + j] += p1[i*n1 + j]. */
  DTRAIN_K_EMBED, DTRAIN_K_EMBED_BWD,
  /* Permute, i < n0 (the output's size): n1 rank (<= 6), n2..n7 the output
   * shape, n8 the permutation packed 4 bits a dim (perm[d] at bits 4d: the
   * output's dim d is the input's dim perm[d]). n9 = 0: p0 y[i] = p1
   * x[off(i)]; n9 = 1 (backward): p0 gx[off(i)] += p1 gy[i]. */
  DTRAIN_K_PERMUTE,
  /* Strided rows (slice, split, concat): i < n0*n1, row o = i / n1, column
   * c = i % n1: p0[o*n2 + c] = p1[o*n3 + c] (+= when n4 = 1); p0 and p1
   * already offset to the first row's block. */
  DTRAIN_K_COPY_ROWS,
  /* Causal mask over n0 elements of [..., T, T] matrices, n1 T. n2 = 0: p0
   * y[i] = col <= row ? p1 x[i] : -inf; n2 = 1: p0 gx[i] += p1 gy[i] where
   * col <= row. */
  DTRAIN_K_CAUSAL_MASK,
  /* RMSprop over i < n0: p0 param, p1 grad, p2 square average, p3 momentum
   * buffer or NULL; f0 lr, f1 weight decay, f2 alpha, f3 1 - alpha, f4
   * momentum, f5 eps. Same float operations as the CPU. */
  DTRAIN_K_RMSPROP,
  /* Batch norm, x [n0 N, n1 C, n2 HW], p-stats = mean[C] then rstd[C].
   * BN_STATS (per channel): p0 stats, p1 x, p2 running mean, p3 running var
   * (both NULL: none); n3 = 1 batch statistics (the CPU's double sums; the
   * running stats updated with f1 momentum, unbiased variance), n3 = 0 from
   * the running stats; f0 eps.
   * BN (per element): p0 y, p1 x, p2 stats, p3 gamma, p4 beta (either NULL).
   * BN_BWD_CH (per channel): p0 ggamma +=, p1 gbeta += (either NULL), p2 gy,
   * p3 x, p4 stats, p5 red: writes mean(gy)[C] then mean(gy * xhat)[C].
   * BN_BWD (per element): p0 gx +=, p1 gy, p2 x, p3 stats, p4 gamma (or
   * NULL), p5 red; n3 as in BN_STATS (0: gx += gy * gamma * rstd). */
  DTRAIN_K_BN_STATS, DTRAIN_K_BN, DTRAIN_K_BN_BWD_CH, DTRAIN_K_BN_BWD,
  DTRAIN_K_COUNT
} dt_kernel;

/* The functions of DTRAIN_K_MAP / DTRAIN_K_MAP_BWD (s = f0): x + s, x * s,
 * s - x, x^s, -x, exp(x), leaky ReLU with slope s, GELU (tanh form), log(x),
 * sqrt(x). Same float expressions as the CPU ops. The two DOMAIN maps (MAP
 * only) write 1 where x is outside a domain, else 0: x > 0 (log, non-integer
 * powers) and x >= 0 (sqrt). */
typedef enum dt_map_fn {
  DTRAIN_MAP_ADD_SCALAR = 0, DTRAIN_MAP_MUL_SCALAR, DTRAIN_MAP_RSUB_SCALAR, DTRAIN_MAP_POW_SCALAR,
  DTRAIN_MAP_NEG, DTRAIN_MAP_EXP, DTRAIN_MAP_LEAKY_RELU, DTRAIN_MAP_GELU, DTRAIN_MAP_LOG, DTRAIN_MAP_SQRT,
  DTRAIN_MAP_DOMAIN_POS, DTRAIN_MAP_DOMAIN_NONNEG
} dt_map_fn;

typedef struct dt_kernel_args {
  float *p[6];
  const int32_t *labels;
  int64_t n[12];
  float f[8];
} dt_kernel_args;

typedef struct dt_device dt_device;
struct dt_device {
  const char *name;   /* "cuda:0": used in messages */
  void *impl;         /* the backend's state */
  dt_result (*alloc)(dt_device *d, size_t bytes, void **out);
  void (*free)(dt_device *d, void *p, size_t bytes);
  dt_result (*zero)(dt_device *d, void *p, size_t bytes);
  dt_result (*copy)(dt_device *d, void *dst, const void *src, size_t bytes, dt_copy_kind kind);
  dt_result (*sync)(dt_device *d);
  /* DTRAIN_ERR_UNSUPPORTED for a kernel the backend lacks. */
  dt_result (*run)(dt_device *d, dt_kernel k, const dt_kernel_args *a);
  /* ---- several devices (dt_device_group, dt_strategy with desc.devices) ----
   * All optional: a backend that leaves them NULL (zero-initialised) still
   * works, through host memory.
   * peer_copy: `bytes` from `src` (memory of device `from`) to `dst` (memory
   * of d), ordered after the work already queued on both devices; it may
   * return once the copy is queued on d (later work on d sees the data).
   * It may still be reading src then: the caller queues no work on `from`
   * that writes src before d->sync (dt_device_group syncs every device at
   * the end of each round).
   * NULL: the core stages the copy through host memory (D2H on `from`, then
   * H2D on d). */
  dt_result (*peer_copy)(dt_device *d, void *dst, dt_device *from, const void *src, size_t bytes);
  /* A collective library (NCCL): group_create makes one communicator over
   * devs[0..n) (called on devs[0]; every device of the group has the same
   * hooks), group_allreduce sums bufs[i] (count floats on devs[i]) in place
   * so that every device holds the same sum, queued on the devices' streams;
   * group_destroy frees it. NULL group_create, or group_create returning
   * DTRAIN_ERR_UNSUPPORTED (not for these devices, e.g. NCCL given one GPU
   * twice): dt_device_group uses a ring over peer_copy and the DTRAIN_K_ACC
   * kernel instead. */
  dt_result (*group_create)(dt_device *const *devs, int n, void **out);
  dt_result (*group_allreduce)(void *group, float *const *bufs, size_t count);
  void (*group_destroy)(void *group);
  /* Optional with the group hooks: bufs[root] (count floats) to every
   * other bufs[i] (ncclBroadcast). NULL: peer copies from the root. */
  dt_result (*group_broadcast)(void *group, float *const *bufs, size_t count, int root);
};

/* For backends: record `msg` as this thread's error (dt_last_error) and
 * return code. */
DTRAIN_API dt_result dt_device_error(dt_result code, const char *msg);

/* The device of a graph (NULL: the CPU). */
DTRAIN_API dt_device *dt_graph_device(const dt_graph *g);
/* The flat parameter buffers the graph's dt_param views use (device memory
 * on a device graph); NULL without params. */
DTRAIN_API float *dt_graph_param_data(dt_graph *g);
DTRAIN_API float *dt_graph_param_grad(dt_graph *g);
/* Host params -> the graph's device copy, and back (data only; upload also
 * zeroes the device gradient). DTRAIN_OK and nothing done on a CPU graph. */
DTRAIN_API dt_result dt_graph_params_upload(dt_graph *g);
DTRAIN_API dt_result dt_graph_params_download(dt_graph *g);
/* Zero the gradient buffer bound to the graph (device or host). */
DTRAIN_API dt_result dt_graph_zero_grad(dt_graph *g);

/* Copy t->size floats of a tensor's data (or gradient: zeros when it has
 * none) to host memory `dst`. Works for CPU tensors too (memcpy). */
DTRAIN_API dt_result dt_tensor_to_host(const dt_tensor *t, float *dst);
DTRAIN_API dt_result dt_tensor_grad_to_host(const dt_tensor *t, float *dst);

/* ---- several devices: the all-reduce of data-parallel training ----------------
 * A group of n devices, each holding a buffer of `count` floats (e.g. the
 * parameter gradients of a replica's graph: dt_graph_param_grad). What
 * dt_strategy uses for mirrored training over devices; usable directly.
 *
 *   dt_device_group *grp = dt_device_group_create(devs, n, count);
 *   float *bufs[n] = {dt_graph_param_grad(g0), dt_graph_param_grad(g1), ...};
 *   dt_device_group_allreduce(grp, bufs);      every buffer now holds the sum
 *
 * How: when the devices have group hooks (dtrain_cuda.h compiled with
 * DTRAIN_USE_NCCL: ncclAllReduce), one collective call; otherwise a ring
 * over peer copies: a reduce-scatter (n-1 rounds: device i sends chunk
 * (i-k) mod n to device i+1, which adds it to its own with DTRAIN_K_ACC)
 * then an all-gather (n-1 rounds of copies), chunks as dt_comm_slice. Each
 * chunk's sum is made once, on one device, and copied to the others, so
 * every device ends with the bitwise same values, and the same inputs give
 * the bitwise same sum on every call. Devices without peer_copy go through
 * host memory. Every device is synchronised at the end (the buffers may be
 * read or reused at once). The group keeps one chunk of scratch per device
 * (count/n floats, plus one). A failure returns the device's error code
 * with a message naming the device and the round; the buffers are then
 * undefined. n = 1 is a no-op. */
typedef struct dt_device_group dt_device_group;
/* NULL + dt_last_error() on failure. The devices are borrowed. */
DTRAIN_API dt_device_group *dt_device_group_create(dt_device *const *devs, int n, size_t count);
DTRAIN_API void dt_device_group_destroy(dt_device_group *g);
/* Sum bufs[i] (count floats on device i) in place on every device. */
DTRAIN_API dt_result dt_device_group_allreduce(dt_device_group *g, float *const *bufs);
/* bufs[root][begin, end) -> the same range of every other device's buffer
 * (the group_broadcast hook where the devices have one, else peer copies
 * from the root). */
DTRAIN_API dt_result dt_device_group_broadcast(dt_device_group *g, float *const *bufs, size_t begin, size_t end,
                                               int root);
/* "nccl-style collective (group hooks)", "ring over peer copies" or "ring
 * through host memory": what dt_device_group_allreduce uses. */
DTRAIN_API const char *dt_device_group_method(const dt_device_group *g);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_DEVICE_H */
/* ======== end dt_device.h ======== */

#endif /* DTRAIN_H_INCLUDED */

#if defined(DTRAIN_IMPLEMENTATION) && !defined(DTRAIN__IMPLEMENTATION_DONE)
#define DTRAIN__IMPLEMENTATION_DONE
#define DTRAIN__AMALGAMATED 1

/* ======== begin dt_internal.h ======== */
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

/* #include "dt_base.h" (amalgamated) */
/* #include "dt_tensor.h" (amalgamated) */
/* #include "dt_ops.h" (amalgamated) */
/* #include "dt_params.h" (amalgamated) */
/* #include "dt_optim.h" (amalgamated) */
/* #include "dt_nn.h" (amalgamated) */
/* #include "dt_io.h" (amalgamated) */
/* #include "dt_fit.h" (amalgamated) */
/* #include "dt_data.h" (amalgamated) */
/* #include "dt_memory.h" (amalgamated) */
/* #include "dt_comm.h" (amalgamated) */
/* #include "dt_strategy.h" (amalgamated) */
/* #include "dt_net.h" (amalgamated) */
/* #include "dt_device.h" (amalgamated) */

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
/* ======== end dt_internal.h ======== */

/* ======== begin dt_base.c ======== */
/* ===========================================================================
 * dt_base.c -- result strings, per-thread errors, allocator, logger, build info
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */

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
#endif

static dt_allocator dt__base_allocator; /* alloc NULL: built-in */

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
  if (dt__base_allocator.alloc) return dt__base_allocator.alloc(size, DT__ALIGN, dt__base_allocator.user);
#ifdef DTRAIN_NO_MALLOC
  dt__log(DTRAIN_LOG_ERROR, DTRAIN_ERR_NOMEM,
          "no allocator: a DTRAIN_NO_MALLOC build needs dt_use_fixed_memory() or dt_set_allocator() first");
  return NULL;
#else
  /* Built-in: over-allocate, align, and keep the raw pointer just below. */
  if (size > SIZE_MAX - DT__ALIGN - sizeof(void *)) return NULL;
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

DTRAIN_API const char *dt_build_info(void) {
  return "dtrain " DTRAIN_VERSION_STRING " (" DT__COMPILER DT__LANG ") threads=" DT__B_THREADS " net=" DT__B_NET
         " stdio=" DT__B_STDIO " cblas=" DT__B_CBLAS " simd=" DT__B_SIMD " mpi=" DT__B_MPI " zlib=" DT__B_ZLIB
         " debug=" DT__B_DEBUG;
}
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

DTRAIN_API double dt_time_now(void) {
  struct timespec ts;
  if (timespec_get(&ts, TIME_UTC) != TIME_UTC) return (double)clock() / CLOCKS_PER_SEC;
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
#undef DT__FIX_HDR
/* ======== end dt_base.c ======== */

/* ======== begin dt_rng.c ======== */
/* ===========================================================================
 * dt_rng.c -- portable RNG: splitmix64 seeding, xoshiro256** stream
 * ===========================================================================
 * Integer arithmetic only, so every platform draws the same bits. Normal
 * deviates go through libm in double and are rounded to float, which agrees
 * across IEEE platforms in practice (last-bit libm differences vanish in the
 * rounding almost always).
 */
/* #include "dt_internal.h" (amalgamated) */

DTRAIN_PRIVATE uint64_t dt__splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

DTRAIN_API void dt_rng_seed(dt_rng *r, uint64_t seed) {
  if (!r) return;
  uint64_t st = seed;
  for (int i = 0; i < 4; i++) r->s[i] = dt__splitmix64(&st);
}

static uint64_t dt__rng_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

DTRAIN_API uint64_t dt_rng_u64(dt_rng *r) {
  uint64_t *s = r->s;
  uint64_t result = dt__rng_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = dt__rng_rotl(s[3], 45);
  return result;
}

DTRAIN_API uint64_t dt_rng_below(dt_rng *r, uint64_t n) {
  if (n <= 1) return 0;
  /* Rejection: accept draws below the largest multiple of n. */
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = dt_rng_u64(r); while (x >= limit);
  return x % n;
}

DTRAIN_API float dt_rng_uniform(dt_rng *r) {
  return (float)(dt_rng_u64(r) >> 40) * (1.0f / 16777216.0f);
}

DTRAIN_API float dt_rng_normal(dt_rng *r) {
  /* Box-Muller; u1 in (0,1] so log is finite. One value per call keeps the
   * stream position simple to reason about (and to checkpoint). */
  double u1 = ((double)(dt_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  double u2 = (double)(dt_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2));
}

DTRAIN_API void dt_rng_shuffle(dt_rng *r, int32_t *idx, int64_t n) {
  if (!r || !idx) return;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)dt_rng_below(r, (uint64_t)i + 1);
    int32_t t = idx[i];
    idx[i] = idx[j];
    idx[j] = t;
  }
}
/* ======== end dt_rng.c ======== */

/* ======== begin dt_tensor.c ======== */
/* ===========================================================================
 * dt_tensor.c -- the graph: arena, tape, sticky errors, tensors, backward
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */

/* ---- arena ---------------------------------------------------------------------- */

struct dt__chunk {
  dt__chunk *next;
  size_t cap;   /* usable bytes after the header */
  size_t used;
};
#define DT__CHUNK_HDR ((sizeof(dt__chunk) + DT__ALIGN - 1) & ~(size_t)(DT__ALIGN - 1))

static dt__chunk *dt__tensor_chunk_new(size_t cap) {
  dt__chunk *c = (dt__chunk *)dt__alloc(DT__CHUNK_HDR + cap);
  if (!c) return NULL;
  c->next = NULL;
  c->cap = cap;
  c->used = 0;
  return c;
}

static void dt__tensor_chunks_free(dt__chunk *c) {
  while (c) {
    dt__chunk *n = c->next;
    dt__free(c, DT__CHUNK_HDR + c->cap);
    c = n;
  }
}

DTRAIN_PRIVATE void *dt__arena_alloc(dt_graph *g, size_t bytes) {
  size_t need = (bytes + DT__ALIGN - 1) & ~(size_t)(DT__ALIGN - 1);
  if (need < bytes) return dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: request of %zu bytes overflows", bytes);
  dt__chunk *c = g->chunks;
  if (!c || c->cap - c->used < need) {
    size_t cap = c ? c->cap * 2 : g->first_block;
    if (cap < need) cap = need;
    dt__chunk *n = dt__tensor_chunk_new(cap);
    if (!n) return dt__fail(g, DTRAIN_ERR_NOMEM, "arena: cannot allocate a block of %zu bytes", cap);
    n->next = c;
    g->chunks = n;
    g->reserved += cap;
    c = n;
  }
  void *p = (unsigned char *)c + DT__CHUNK_HDR + c->used;
  c->used += need;
  g->used += need;
  if (g->used > g->peak) g->peak = g->used;
  return p;
}

DTRAIN_PRIVATE float *dt__arena_floats(dt_graph *g, int64_t n) {
  size_t bytes;
  if (n < 0 || !dt__mul_size((size_t)n, sizeof(float), &bytes))
    return (float *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: %lld floats overflow", (long long)n);
  if (g->device) return (float *)dt__dev_arena(g, bytes); /* tensor data lives on the device */
  return (float *)dt__arena_alloc(g, bytes);
}

DTRAIN_PRIVATE float *dt__arena_zeros(dt_graph *g, int64_t n) {
  float *p = dt__arena_floats(g, n);
  if (p && g->device) return dt__dev_zero(g, "arena", p, (size_t)n * sizeof(float)) ? p : NULL;
  if (p) memset(p, 0, (size_t)n * sizeof(float));
  return p;
}

/* ---- graph ------------------------------------------------------------------------ */

DTRAIN_API dt_graph *dt_graph_create(dt_params *params, const dt_graph_desc *desc) {
  dt_graph *g = (dt_graph *)dt__calloc(sizeof *g);
  if (!g) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_graph_create: out of memory");
    return NULL;
  }
  g->params = params;
  g->bound_own = 1;
  g->first_block = (desc && desc->arena_bytes) ? desc->arena_bytes : ((size_t)1 << 20);
  g->training = 1;
  g->grad_enabled = 1;
  g->check_numerics = desc ? desc->check_numerics : 0;
  dt_rng_seed(&g->rng, (desc && desc->seed) ? desc->seed : 1);
  if (desc && desc->device) {
    g->device = desc->device;
    if (dt__dev_graph_init(g) != DTRAIN_OK) {
      dt_graph_destroy(g);
      return NULL;
    }
  }
  return g;
}

DTRAIN_API void dt_graph_destroy(dt_graph *g) {
  if (!g) return;
  if (g->device) dt__dev_free_chunks(g);
  dt__tensor_chunks_free(g->chunks);
  dt__free(g->tape, (size_t)g->tape_cap * sizeof(dt_tensor *));
  dt__free(g->pviews, g->pviews_bytes);
  dt__free(g, sizeof *g);
}

DTRAIN_API void dt_graph_reset(dt_graph *g) {
  if (!g) return;
  if (g->chunks && g->chunks->next) {
    /* Several blocks: replace them by one that holds the whole step, so that
     * the next step of the same size allocates nothing. If that allocation
     * fails, keep the old blocks (still correct, just not merged). */
    size_t total = 0;
    for (dt__chunk *c = g->chunks; c; c = c->next) total += c->cap;
    dt__chunk *one = dt__tensor_chunk_new(total);
    if (one) {
      dt__tensor_chunks_free(g->chunks);
      g->chunks = one;
      g->reserved = total;
    }
  }
  /* If the merge failed, only the newest block is used again (older ones stay
   * reserved until the next successful merge or destroy): still correct. */
  for (dt__chunk *c = g->chunks; c; c = c->next) c->used = 0;
  if (g->device) dt__dev_reset(g);
  g->used = 0;
  g->ntape = 0;
  g->err = DTRAIN_OK;
  g->msg[0] = '\0';
  g->backward_done = 0;
}

DTRAIN_API dt_result dt_graph_bind(dt_graph *g, float *data, float *grad) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_bind: graph is NULL");
  if (!g->params && data) return dt__error(DTRAIN_ERR_STATE, "dt_graph_bind: graph has no params");
  if (!data && grad) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_graph_bind: grad without data");
  g->bound_own = data == NULL;
  g->bound_data = data;
  g->bound_grad = grad;
  return DTRAIN_OK;
}

DTRAIN_API void dt_graph_set_training(dt_graph *g, int training) { if (g) g->training = training != 0; }
DTRAIN_API int dt_graph_training(const dt_graph *g) { return g ? g->training : 0; }

DTRAIN_API int dt_graph_set_grad_enabled(dt_graph *g, int enabled) {
  if (!g) return 0;
  int old = g->grad_enabled;
  g->grad_enabled = enabled != 0;
  return old;
}

DTRAIN_API dt_result dt_graph_error(const dt_graph *g) { return g ? g->err : DTRAIN_ERR_NULL_ARG; }
DTRAIN_API const char *dt_graph_message(const dt_graph *g) { return g ? g->msg : "graph is NULL"; }

DTRAIN_API void dt_graph_fail(dt_graph *g, dt_result code, const char *msg) {
  if (g) dt__fail(g, code == DTRAIN_OK ? DTRAIN_ERR_INVALID_ARG : code, "%s", msg ? msg : "user error");
}

DTRAIN_API size_t dt_graph_bytes_used(const dt_graph *g) { return g ? g->used : 0; }
DTRAIN_API size_t dt_graph_bytes_peak(const dt_graph *g) { return g ? g->peak : 0; }
DTRAIN_API size_t dt_graph_bytes_reserved(const dt_graph *g) { return g ? g->reserved : 0; }

DTRAIN_API void dt_graph_rng_state(const dt_graph *g, uint64_t out[4]) {
  if (g && out) memcpy(out, g->rng.s, sizeof g->rng.s);
}
DTRAIN_API void dt_graph_set_rng_state(dt_graph *g, const uint64_t s[4]) {
  if (g && s) memcpy(g->rng.s, s, sizeof g->rng.s);
}

/* ---- errors and op plumbing --------------------------------------------------------- */

DTRAIN_PRIVATE void *dt__fail(dt_graph *g, dt_result code, const char *fmt, ...) {
  char buf[DT__MSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (g && g->err == DTRAIN_OK) {
    g->err = code;
    memcpy(g->msg, buf, sizeof buf);
    dt__error(code, "%s", buf);
  } else if (!g) {
    dt__error(code, "%s", buf);
  }
  return NULL;
}

DTRAIN_PRIVATE int dt__begin(dt_graph *g, const char *op, int n, ...) {
  if (!g) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: graph is NULL", op);
    return 0;
  }
  if (g->err != DTRAIN_OK) return 0;
  if (g->device && !dt__dev_op_ok(op)) {
    dt__fail(g, DTRAIN_ERR_UNSUPPORTED, "%s: not supported on device %s (no device kernel; see dt_device.h)", op,
             g->device->name);
    return 0;
  }
  va_list ap;
  va_start(ap, n);
  int ok = 1;
  for (int i = 0; i < n && ok; i++) {
    dt_tensor *t = va_arg(ap, dt_tensor *);
    if (!t) {
      dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: tensor argument %d is NULL", op, i + 1);
      ok = 0;
    } else if (t->graph != g) {
      dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: tensor argument %d belongs to another graph", op, i + 1);
      ok = 0;
    }
  }
  va_end(ap);
  return ok;
}

DTRAIN_PRIVATE int dt__axis(int axis, int ndim) {
  if (axis < 0) axis += ndim;
  return (axis >= 0 && axis < ndim) ? axis : -1;
}

DTRAIN_PRIVATE void dt__strides(const dt_tensor *t, int64_t *st) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    st[i] = s;
    s *= t->shape[i];
  }
}

DTRAIN_PRIVATE const char *dt__shape_text(int ndim, const int64_t *shape, char *buf, size_t cap) {
  size_t k = 0;
  if (!buf || cap == 0) return "";
  buf[0] = '\0';
  k += (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < ndim && k < cap; i++)
    k += (size_t)snprintf(buf + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

DTRAIN_API const char *dt_shape_str(const dt_tensor *t, char *buf, size_t cap) {
  if (!buf || cap == 0) return "";
  if (!t) {
    snprintf(buf, cap, "(null)");
    return buf;
  }
  return dt__shape_text(t->ndim, t->shape, buf, cap);
}

DTRAIN_API int dt_same_shape(const dt_tensor *a, const dt_tensor *b) {
  if (!a || !b || a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static void dt__tensor_init_header(dt_tensor *t, dt_graph *g, int ndim, const int64_t *shape, int64_t size) {
  memset(t, 0, sizeof *t);
  t->graph = g;
  t->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) t->shape[i] = i < ndim ? shape[i] : 1;
  t->size = size;
  t->param_index = -1;
}

/* Validates a shape and returns its element count, or -1 with an error. */
static int64_t dt__tensor_count(dt_graph *g, const char *op, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS) {
    dt__fail(g, DTRAIN_ERR_RANK, "%s: %d dimensions (allowed 0..%d)", op, ndim, DTRAIN_MAX_DIMS);
    return -1;
  }
  if (ndim > 0 && !shape) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", op);
    return -1;
  }
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] <= 0) {
      dt__fail(g, shape[i] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
               "%s: dimension %d is %lld (must be >= 1)", op, i, (long long)shape[i]);
      return -1;
    }
    if (n > INT64_MAX / shape[i] || dt__too_many((uint64_t)(n * shape[i]))) {
      dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: shape too large", op);
      return -1;
    }
    n *= shape[i];
  }
  return n;
}

DTRAIN_PRIVATE dt_tensor *dt__new_view(dt_graph *g, const char *op, int ndim, const int64_t *shape, float *data) {
  int64_t n = dt__tensor_count(g, op, ndim, shape);
  if (n < 0) return NULL;
  dt_tensor *t = (dt_tensor *)dt__arena_alloc(g, sizeof(dt_tensor));
  if (!t) return NULL;
  dt__tensor_init_header(t, g, ndim, shape, n);
  t->data = data;
  t->flags = DTRAIN_TENSOR_VIEW;
  t->op = op;
  return t;
}

DTRAIN_PRIVATE dt_tensor *dt__new(dt_graph *g, const char *op, int ndim, const int64_t *shape) {
  int64_t n = dt__tensor_count(g, op, ndim, shape);
  if (n < 0) return NULL;
  dt_tensor *t = (dt_tensor *)dt__arena_alloc(g, sizeof(dt_tensor));
  if (!t) return NULL;
  float *d = dt__arena_floats(g, n);
  if (!d) return NULL;
  dt__tensor_init_header(t, g, ndim, shape, n);
  t->data = d;
  t->op = op;
  return t;
}

DTRAIN_PRIVATE dt_tensor *dt__new_like(dt_graph *g, const char *op, const dt_tensor *x) {
  return dt__new(g, op, x->ndim, x->shape);
}

DTRAIN_PRIVATE void dt__record(dt_graph *g, dt_tensor *out, const char *op, dt_backward_fn fn,
                               dt_tensor *a, dt_tensor *b, dt_tensor *c) {
  out->op = op;
  out->src[0] = a;
  out->src[1] = b;
  out->src[2] = c;
  if (!g->grad_enabled || !fn) return;
  int need = 0;
  for (int i = 0; i < 3; i++)
    if (out->src[i] && (out->src[i]->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) need = 1;
  if (!need) return;
  if (g->ntape == g->tape_cap) {
    int64_t cap = g->tape_cap ? g->tape_cap * 2 : 256;
    dt_tensor **nt = (dt_tensor **)dt__realloc(g->tape, (size_t)g->tape_cap * sizeof(dt_tensor *),
                                               (size_t)cap * sizeof(dt_tensor *));
    if (!nt) {
      dt__fail(g, DTRAIN_ERR_NOMEM, "%s: cannot grow the tape to %lld entries", op, (long long)cap);
      return;
    }
    g->tape = nt;
    g->tape_cap = cap;
  }
  out->flags |= DTRAIN_TENSOR_REQUIRES_GRAD;
  out->backward = fn;
  g->tape[g->ntape++] = out;
}

DTRAIN_PRIVATE dt_tensor *dt__finish(dt_graph *g, dt_tensor *out) {
  if (g->err != DTRAIN_OK) return NULL;
  if (g->check_numerics && g->device) return dt__dev_check_numerics(g, out);
  if (g->check_numerics) {
    for (int64_t i = 0; i < out->size; i++) {
      if (!isfinite(out->data[i])) {
        char sb[96];
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", out->op,
                                     dt_shape_str(out, sb, sizeof sb), isnan(out->data[i]) ? "NaN" : "Inf",
                                     (long long)i);
      }
    }
  }
  return out;
}

DTRAIN_PRIVATE float *dt__grad(dt_graph *g, dt_tensor *t) {
  if (!t || !(t->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) return NULL;
  if (!t->grad) t->grad = dt__arena_zeros(g, t->size);
  return t->grad;
}

/* ---- public tensor constructors ---------------------------------------------------- */

DTRAIN_API dt_tensor *dt_tensor_new(dt_graph *g, int ndim, const int64_t *shape) {
  if (!dt__begin(g, "dt_tensor_new", 0)) return NULL;
  dt_tensor *t = dt__new(g, "dt_tensor_new", ndim, shape);
  if (t && g->device)
    return dt__dev_zero(g, "dt_tensor_new", t->data, (size_t)t->size * sizeof(float)) ? t : NULL;
  if (t) memset(t->data, 0, (size_t)t->size * sizeof(float));
  return t;
}

DTRAIN_API dt_tensor *dt_tensor_from(dt_graph *g, int ndim, const int64_t *shape, const float *data) {
  if (!dt__begin(g, "dt_tensor_from", 0)) return NULL;
  if (!data) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_tensor_from: data is NULL");
  dt_tensor *t = dt__new(g, "dt_tensor_from", ndim, shape);
  if (t && g->device)
    return dt__dev_copy(g, "dt_tensor_from", t->data, data, (size_t)t->size * sizeof(float), DTRAIN_COPY_H2D) ? t
                                                                                                              : NULL;
  if (t) memcpy(t->data, data, (size_t)t->size * sizeof(float));
  return t;
}

DTRAIN_API dt_tensor *dt_tensor_wrap(dt_graph *g, int ndim, const int64_t *shape, float *data) {
  if (!dt__begin(g, "dt_tensor_wrap", 0)) return NULL;
  if (!data) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_tensor_wrap: data is NULL");
  return dt__new_view(g, "dt_tensor_wrap", ndim, shape, data);
}

DTRAIN_API dt_tensor *dt_tensor_new1(dt_graph *g, int64_t d0) { return dt_tensor_new(g, 1, &d0); }
DTRAIN_API dt_tensor *dt_tensor_new2(dt_graph *g, int64_t d0, int64_t d1) {
  int64_t s[2];
  s[0] = d0; s[1] = d1;
  return dt_tensor_new(g, 2, s);
}
DTRAIN_API dt_tensor *dt_tensor_new3(dt_graph *g, int64_t d0, int64_t d1, int64_t d2) {
  int64_t s[3];
  s[0] = d0; s[1] = d1; s[2] = d2;
  return dt_tensor_new(g, 3, s);
}
DTRAIN_API dt_tensor *dt_tensor_new4(dt_graph *g, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  int64_t s[4];
  s[0] = d0; s[1] = d1; s[2] = d2; s[3] = d3;
  return dt_tensor_new(g, 4, s);
}

DTRAIN_API dt_tensor *dt_scalar(dt_graph *g, float value) {
  if (g && g->device) return dt_tensor_from(g, 0, NULL, &value);
  dt_tensor *t = dt_tensor_new(g, 0, NULL);
  if (t) t->data[0] = value;
  return t;
}

DTRAIN_API void dt_tensor_set_requires_grad(dt_tensor *t, int on) {
  if (!t || (t->flags & DTRAIN_TENSOR_PARAM)) return;
  if (on) t->flags |= DTRAIN_TENSOR_REQUIRES_GRAD;
  else t->flags &= ~DTRAIN_TENSOR_REQUIRES_GRAD;
}

DTRAIN_API dt_tensor *dt_detach(dt_graph *g, dt_tensor *t) {
  if (!dt__begin(g, "dt_detach", 1, t)) return NULL;
  dt_tensor *d = dt__new_like(g, "dt_detach", t);
  if (d && g->device)
    return dt__dev_copy(g, "dt_detach", d->data, t->data, (size_t)t->size * sizeof(float), DTRAIN_COPY_D2D) ? d : NULL;
  if (d) memcpy(d->data, t->data, (size_t)t->size * sizeof(float));
  return d;
}

DTRAIN_API float dt_item(const dt_tensor *t) {
  if (!t || t->size != 1) return NAN;
  if (t->graph && t->graph->device) {
    float v;
    dt_device *d = t->graph->device;
    return d->copy(d, &v, t->data, sizeof v, DTRAIN_COPY_D2H) == DTRAIN_OK ? v : NAN;
  }
  return t->data[0];
}

DTRAIN_API dt_tensor *dt_param(dt_graph *g, int index) {
  if (!dt__begin(g, "dt_param", 0)) return NULL;
  if (!g->params) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_STATE, "dt_param: graph was created without params");
  int count = dt_params_count(g->params);
  if (index < 0 || index >= count)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "dt_param: index %d out of range (params has %d)", index, count);
  if (g->npviews < count) {
    /* Parameters were added since the views were built: grow (setup only). */
    size_t bytes = (size_t)count * sizeof(dt_tensor);
    dt_tensor *nv = (dt_tensor *)dt__realloc(g->pviews, g->pviews_bytes, bytes);
    if (!nv) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "dt_param: out of memory");
    g->pviews = nv;
    g->pviews_bytes = bytes;
    g->npviews = count;
  }
  size_t off;
  int ndim, trainable;
  const int64_t *shape;
  dt__params_view(g->params, index, &off, &ndim, &shape, &trainable);
  float *data = g->bound_own ? dt_params_data(g->params) : g->bound_data;
  float *grad = g->bound_own ? dt_params_grad(g->params) : g->bound_grad;
  if (g->device && g->bound_own && dt_params_size(g->params) != g->dparam_n)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_STATE,
                                 "dt_param: params grew since the graph was created on device %s; create it after "
                                 "adding every parameter", g->device->name);
  if (g->device && g->bound_own) { /* the graph's device copy of the params */
    data = g->dparam_data;
    grad = g->dparam_grad;
  }
  dt_tensor *t = &g->pviews[index];
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  dt__tensor_init_header(t, g, ndim, shape, n);
  t->data = data + off;
  t->grad = (grad && trainable) ? grad + off : NULL;
  t->flags = DTRAIN_TENSOR_PARAM | (t->grad ? DTRAIN_TENSOR_REQUIRES_GRAD : 0);
  t->op = "param";
  t->param_index = index;
  return t;
}

/* ---- backward --------------------------------------------------------------------------- */

static dt_result dt__tensor_backward(dt_graph *g, dt_tensor *out, const float *seed, const char *fn) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: graph is NULL", fn);
  if (g->err != DTRAIN_OK) return g->err;
  if (!dt__begin(g, fn, 1, out)) return g->err;
  if (!seed) {
    if (out->size != 1) {
      char sb[96];
      dt__fail(g, DTRAIN_ERR_SHAPE, "%s: loss must have one element, got %s", fn, dt_shape_str(out, sb, sizeof sb));
      return g->err;
    }
    float v;
    if (!g->device) v = out->data[0];
    else if (!dt__dev_copy(g, fn, &v, out->data, sizeof v, DTRAIN_COPY_D2H)) return g->err; /* the device's error */
    if (!isfinite(v)) {
      dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: loss is %s", fn, isnan(v) ? "NaN" : "Inf");
      return g->err;
    }
  }
  if (g->backward_done) {
    dt__fail(g, DTRAIN_ERR_STATE, "%s: already called for this step (call dt_graph_reset first)", fn);
    return g->err;
  }
  if (!(out->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) {
    dt__fail(g, DTRAIN_ERR_STATE,
             "%s: the output does not depend on anything that needs a gradient (no-grad mode, or no parameters used)", fn);
    return g->err;
  }
  g->backward_done = 1;
  float *go = dt__grad(g, out);
  if (!go) return g->err;
  if (g->device) {
    /* The seed goes up to the device and is added there. */
    float one = 1.0f;
    float *tmp = dt__arena_floats(g, out->size);
    if (!tmp || !dt__dev_copy(g, fn, tmp, seed ? seed : &one, (size_t)out->size * sizeof(float), DTRAIN_COPY_H2D))
      return g->err;
    dt__dev_acc(g, go, tmp, out->size, fn);
    if (g->err != DTRAIN_OK) return g->err;
  } else if (seed) {
    for (int64_t i = 0; i < out->size; i++) go[i] += seed[i];
  } else {
    go[0] += 1.0f;
  }
  for (int64_t i = g->ntape - 1; i >= 0; i--) {
    dt_tensor *t = g->tape[i];
    if (t->grad && t->backward) t->backward(g, t);
    if (g->err != DTRAIN_OK) return g->err;
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_backward(dt_graph *g, dt_tensor *loss) {
  return dt__tensor_backward(g, loss, NULL, "dt_backward");
}

DTRAIN_API dt_result dt_backward_grad(dt_graph *g, dt_tensor *out, const float *grad) {
  if (g && g->err == DTRAIN_OK && !grad) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_backward_grad: grad is NULL");
    return g->err;
  }
  return dt__tensor_backward(g, out, grad, "dt_backward_grad");
}
/* ======== end dt_tensor.c ======== */

/* ======== begin dt_device.c ======== */
/* ===========================================================================
 * dt_device.c -- the device hook: device arena, transfers, and the device
 * twins of the ops that have kernels (see dt_device.h for the list)
 * ===========================================================================
 * On a device graph tensor headers come from the host arena (dt__arena_alloc)
 * and tensor data from the device arena below (dt__arena_floats switches on
 * g->device). Each op with a device path calls its dt__dev_* twin here right
 * after dt__begin; the twin checks what the device supports, allocates its
 * output, asks the device to run the kernel(s) and records a device backward
 * function. Every other op is refused by dt__begin (dt__dev_op_ok) with
 * DTRAIN_ERR_UNSUPPORTED, so no CPU loop ever reads device memory.
 * Nothing here runs on a CPU graph: the CPU ops only test `g->device`.
 */
/* #include "dt_internal.h" (amalgamated) */

struct dt__dchunk {
  dt__dchunk *next;
  void *base; /* device memory */
  size_t cap, used;
};

/* Device allocations are 256-byte aligned (what cudaMalloc gives, and what
 * coalesced loads like). */
#define DT__DEV_ALIGN 256

/* Ops with a device path (dt__begin refuses every other op on a device). */
static const char *const dt__device_ops[] = {
  "dt_tensor_new", "dt_tensor_from", "dt_tensor_wrap", "dt_detach", "dt_param", "dt_backward", "dt_backward_grad",
  "dt_add", "dt_sub", "dt_mul", "dt_div", "dt_add_scalar", "dt_mul_scalar", "dt_rsub_scalar", "dt_pow_scalar",
  "dt_neg", "dt_exp", "dt_log", "dt_sqrt", "dt_leaky_relu", "dt_gelu", "dt_relu", "dt_sigmoid", "dt_tanh", "dt_sum", "dt_mean", "dt_sum_axis", "dt_mean_axis", "dt_transpose", "dt_dropout", "dt_layer_norm", "dt_embedding", "dt_matmul", "dt_linear",
  "dt_softmax", "dt_log_softmax", "dt_cross_entropy", "dt_mse", "dt_reshape", "dt_reshape2", "dt_flatten",
  "dt_conv2d", "dt_max_pool2d", "dt_avg_pool2d", "dt_nn_linear_forward", "dt_nn_conv2d_forward", "dt_nn_embedding_forward",
  "dt_nn_layer_norm_forward", "dt_permute", "dt_concat", "dt_slice", "dt_split", "dt_bmm", "dt_causal_mask",
  "dt_batch_norm", "dt_nn_batch_norm_forward", "dt_nn_attention_forward", "dt_nn_lstm_cell_forward",
  "dt_nn_gru_cell_forward", NULL
};

DTRAIN_PRIVATE int dt__dev_op_ok(const char *op) {
  for (int i = 0; dt__device_ops[i]; i++)
    if (strcmp(op, dt__device_ops[i]) == 0) return 1;
  return 0;
}

DTRAIN_API dt_result dt_device_error(dt_result code, const char *msg) {
  return dt__error(code == DTRAIN_OK ? DTRAIN_ERR_INTERNAL : code, "%s", msg ? msg : "device error");
}

/* ---- plumbing: every device call checked, failures fail the graph ------------------ */

DTRAIN_PRIVATE int dt__dev_run(dt_graph *g, const char *op, dt_kernel k, const dt_kernel_args *a) {
  dt_result r = g->device->run(g->device, k, a);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

DTRAIN_PRIVATE int dt__dev_copy(dt_graph *g, const char *op, void *dst, const void *src, size_t bytes,
                                dt_copy_kind kind) {
  if (bytes == 0) return 1;
  dt_result r = g->device->copy(g->device, dst, src, bytes, kind);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

DTRAIN_PRIVATE int dt__dev_zero(dt_graph *g, const char *op, void *p, size_t bytes) {
  if (bytes == 0) return 1;
  dt_result r = g->device->zero(g->device, p, bytes);
  if (r == DTRAIN_OK) return 1;
  dt__fail(g, r, "%s: device %s: %s", op, g->device->name, dt_last_error());
  return 0;
}

static void dt__device_args0(dt_kernel_args *a) { memset(a, 0, sizeof *a); }

/* ---- device arena ----------------------------------------------------------------- */

static dt__dchunk *dt__device_chunk_new(dt_graph *g, size_t cap) {
  dt__dchunk *c = (dt__dchunk *)dt__alloc(sizeof *c);
  if (!c) {
    dt__fail(g, DTRAIN_ERR_NOMEM, "arena: out of host memory");
    return NULL;
  }
  dt_result r = g->device->alloc(g->device, cap, &c->base);
  if (r != DTRAIN_OK) {
    dt__fail(g, r, "arena: device %s: %s", g->device->name, dt_last_error());
    dt__free(c, sizeof *c);
    return NULL;
  }
  c->next = NULL;
  c->cap = cap;
  c->used = 0;
  return c;
}

static void dt__device_chunks_free(dt_device *d, dt__dchunk *c) {
  while (c) {
    dt__dchunk *n = c->next;
    d->free(d, c->base, c->cap);
    dt__free(c, sizeof *c);
    c = n;
  }
}

DTRAIN_PRIVATE void *dt__dev_arena(dt_graph *g, size_t bytes) {
  size_t need = (bytes + DT__DEV_ALIGN - 1) & ~(size_t)(DT__DEV_ALIGN - 1);
  if (need < bytes) return dt__fail(g, DTRAIN_ERR_OVERFLOW, "arena: request of %zu bytes overflows", bytes);
  if (need == 0) need = DT__DEV_ALIGN;
  dt__dchunk *c = g->dchunks;
  if (!c || c->cap - c->used < need) {
    size_t cap = c ? c->cap * 2 : g->first_block;
    if (cap < need) cap = need;
    dt__dchunk *n = dt__device_chunk_new(g, cap);
    if (!n) return NULL;
    n->next = c;
    g->dchunks = n;
    g->dreserved += cap;
    c = n;
  }
  void *p = (unsigned char *)c->base + c->used;
  c->used += need;
  g->used += need;
  if (g->used > g->peak) g->peak = g->used;
  return p;
}

DTRAIN_PRIVATE void dt__dev_reset(dt_graph *g) {
  if (g->dchunks && g->dchunks->next) { /* merge into one block, as the host arena does */
    size_t total = 0;
    for (dt__dchunk *c = g->dchunks; c; c = c->next) total += c->cap;
    dt__dchunk *one = (dt__dchunk *)dt__alloc(sizeof *one);
    if (one && g->device->alloc(g->device, total, &one->base) == DTRAIN_OK) {
      dt__device_chunks_free(g->device, g->dchunks);
      one->next = NULL;
      one->cap = total;
      g->dchunks = one;
      g->dreserved = total;
    } else {
      dt__free(one, sizeof *one);
      dt_clear_error();
    }
  }
  for (dt__dchunk *c = g->dchunks; c; c = c->next) c->used = 0;
}

DTRAIN_PRIVATE void dt__dev_free_chunks(dt_graph *g) {
  dt_device *d = g->device;
  dt__device_chunks_free(d, g->dchunks);
  g->dchunks = NULL;
  if (g->dparam_data) d->free(d, g->dparam_data, g->dparam_n * sizeof(float));
  if (g->dparam_grad) d->free(d, g->dparam_grad, g->dparam_n * sizeof(float));
  g->dparam_data = g->dparam_grad = NULL;
}

/* ---- graph-level device API -------------------------------------------------------- */

DTRAIN_PRIVATE dt_result dt__dev_graph_init(dt_graph *g) {
  dt_device *d = g->device;
  if (!d->alloc || !d->free || !d->zero || !d->copy || !d->sync || !d->run)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_graph_create: device %s has a NULL function", d->name ? d->name : "?");
  size_t n = dt_params_size(g->params), bytes;
  if (n == 0) return DTRAIN_OK;
  if (!dt__mul_size(n, sizeof(float), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_graph_create: params too large");
  void *pd = NULL, *pg = NULL;
  dt_result r = d->alloc(d, bytes, &pd);
  if (r == DTRAIN_OK) r = d->alloc(d, bytes, &pg);
  if (r != DTRAIN_OK) {
    if (pd) d->free(d, pd, bytes);
    return dt__error(r, "dt_graph_create: device copy of the params (%zu bytes): %s", bytes, dt_last_error());
  }
  g->dparam_data = (float *)pd;
  g->dparam_grad = (float *)pg;
  g->dparam_n = n;
  return dt_graph_params_upload(g);
}

DTRAIN_API dt_device *dt_graph_device(const dt_graph *g) { return g ? g->device : NULL; }

DTRAIN_API float *dt_graph_param_data(dt_graph *g) {
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_data;
  return g->device ? g->dparam_data : dt_params_data(g->params);
}

DTRAIN_API float *dt_graph_param_grad(dt_graph *g) {
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_grad;
  return g->device ? g->dparam_grad : dt_params_grad(g->params);
}

DTRAIN_API dt_result dt_graph_params_upload(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_upload: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_upload: params changed size since the graph was created");
  size_t bytes = g->dparam_n * sizeof(float);
  dt_result r = d->copy(d, g->dparam_data, dt_params_data(g->params), bytes, DTRAIN_COPY_H2D);
  if (r == DTRAIN_OK) r = d->zero(d, g->dparam_grad, bytes);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_upload: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_params_download(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_download: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_download: params changed size since the graph was created");
  dt_result r = d->copy(d, dt_params_data(g->params), g->dparam_data, g->dparam_n * sizeof(float), DTRAIN_COPY_D2H);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_download: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_zero_grad(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_zero_grad: graph is NULL");
  float *grad = dt_graph_param_grad(g);
  size_t n = dt_params_size(g->params);
  if (!grad || n == 0) return DTRAIN_OK;
  if (!g->device) {
    memset(grad, 0, n * sizeof(float));
    return DTRAIN_OK;
  }
  dt_result r = g->device->zero(g->device, grad, n * sizeof(float));
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_zero_grad: device %s: %s", g->device->name, dt_last_error());
  return DTRAIN_OK;
}

static dt_result dt__device_to_host(const dt_tensor *t, const float *src, float *dst, const char *fn) {
  if (!t || !dst) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  size_t bytes = (size_t)t->size * sizeof(float);
  dt_device *d = t->graph ? t->graph->device : NULL;
  if (!src) {
    memset(dst, 0, bytes);
    return DTRAIN_OK;
  }
  if (!d) {
    memcpy(dst, src, bytes);
    return DTRAIN_OK;
  }
  dt_result r = d->copy(d, dst, src, bytes, DTRAIN_COPY_D2H);
  if (r != DTRAIN_OK) return dt__error(r, "%s: device %s: %s", fn, d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_tensor_to_host(const dt_tensor *t, float *dst) {
  return dt__device_to_host(t, t ? t->data : NULL, dst, "dt_tensor_to_host");
}

DTRAIN_API dt_result dt_tensor_grad_to_host(const dt_tensor *t, float *dst) {
  return dt__device_to_host(t, t ? t->grad : NULL, dst, "dt_tensor_grad_to_host");
}

/* check_numerics on a device: the output comes to the host to be checked. */
DTRAIN_PRIVATE dt_tensor *dt__dev_check_numerics(dt_graph *g, dt_tensor *out) {
  size_t bytes = (size_t)out->size * sizeof(float);
  float *h = (float *)dt__alloc(bytes);
  if (!h) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "%s: check_numerics: out of host memory", out->op);
  dt_tensor *res = out;
  if (!dt__dev_copy(g, out->op, h, out->data, bytes, DTRAIN_COPY_D2H)) {
    res = NULL;
  } else {
    for (int64_t i = 0; i < out->size; i++) {
      if (!isfinite(h[i])) {
        char sb[96];
        dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", out->op,
                 dt_shape_str(out, sb, sizeof sb), isnan(h[i]) ? "NaN" : "Inf", (long long)i);
        res = NULL;
        break;
      }
    }
  }
  dt__free(h, bytes);
  return res;
}

DTRAIN_PRIVATE void dt__dev_acc(dt_graph *g, float *gx, const float *gy, int64_t n, const char *op) {
  dt_kernel_args a;
  dt__device_args0(&a);
  a.p[0] = gx;
  a.p[1] = (float *)(uintptr_t)gy;
  a.n[0] = n;
  a.f[0] = 1.0f;
  dt__dev_run(g, op, DTRAIN_K_ACC, &a);
}

/* ---- elementwise binary: same shapes, or b over a's leading dims ---------------------- */

static void dt__device_binary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel k = (dt_kernel)y->iaux[0];
  dt_kernel_args r;
  if (ga) {
    dt__device_args0(&r);
    r.p[0] = ga;
    r.p[1] = y->grad;
    r.p[2] = b->data;
    r.n[0] = y->size;
    r.n[1] = b->size;
    r.f[0] = 1.0f;
    if (!dt__dev_run(g, y->op,
                     k == DTRAIN_K_MUL ? DTRAIN_K_ACC_MUL : k == DTRAIN_K_DIV ? DTRAIN_K_ACC_DIV : DTRAIN_K_ACC, &r))
      return;
  }
  if (gb) { /* summed over the rows b was repeated over (one row when shapes agree) */
    dt__device_args0(&r);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.p[2] = a->data;
    r.n[0] = y->size;
    r.n[1] = b->size;
    r.f[0] = k == DTRAIN_K_SUB ? -1.0f : 1.0f;
    if (k == DTRAIN_K_DIV) { /* gb -= gy * a / b^2 */
      r.p[2] = b->data;
      r.p[3] = a->data;
    }
    dt__dev_run(g, y->op,
                k == DTRAIN_K_MUL   ? DTRAIN_K_ACC_MUL_ROWS
                : k == DTRAIN_K_DIV ? DTRAIN_K_DIV_BWD_ROWS
                                    : DTRAIN_K_ACC_ROWS,
                &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op) {
  /* b must match a's trailing dims; b's leading dims of 1 stretch. Then b's
   * flat index is i % b->size. */
  int lead = 0;
  while (lead < b->ndim && b->shape[lead] == 1) lead++;
  int ok = b->ndim <= a->ndim;
  for (int d = 0; ok && d < b->ndim - lead; d++)
    if (b->shape[b->ndim - 1 - d] != a->shape[a->ndim - 1 - d]) ok = 0;
  if (!ok) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_UNSUPPORTED,
                                 "%s: shapes %s and %s on device %s: only equal shapes or b over a's leading dims "
                                 "(e.g. [N,C] and [C]) are supported on a device",
                                 op, dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2), g->device->name);
  }
  dt_tensor *y = dt__new_like(g, op, a);
  if (!y) return NULL;
  dt_kernel k = (dt_kernel)kind;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = a->data;
  r.p[2] = b->data;
  r.n[0] = y->size;
  r.n[1] = b->size;
  if (!dt__dev_run(g, op, k, &r)) return NULL;
  y->iaux[0] = k;
  dt__record(g, y, op, dt__device_binary_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- unary ------------------------------------------------------------------------------ */

static void dt__device_unary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel k = (dt_kernel)y->iaux[0];
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = k == DTRAIN_K_RELU ? x->data : y->data;
  r.n[0] = y->size;
  dt__dev_run(g, y->op,
              k == DTRAIN_K_RELU ? DTRAIN_K_RELU_BWD : k == DTRAIN_K_SIGMOID ? DTRAIN_K_SIGMOID_BWD : DTRAIN_K_TANH_BWD,
              &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_unary(dt_graph *g, dt_tensor *x, dt_kernel fwd, const char *op) {
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  if (!dt__dev_run(g, op, fwd, &r)) return NULL;
  y->iaux[0] = fwd;
  dt__record(g, y, op, dt__device_unary_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- elementwise maps (scalar ops, neg, exp, leaky ReLU, GELU) ---------------------------- */

static void dt__device_map_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = y->data;
  r.n[0] = y->size;
  r.n[1] = y->iaux[0];
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_MAP_BWD, &r);
}

/* The CPU op's domain check, on the device: a 0/1 map of the elements
 * outside the domain, summed, one float read back. Only on failure does the
 * map come to the host, to name the first bad element as the CPU op does. */
static int dt__device_domain(dt_graph *g, const dt_tensor *x, int fn, const char *op) {
  float *bad = dt__arena_floats(g, x->size);
  float *count = bad ? dt__arena_floats(g, 1) : NULL;
  if (!count) return 0;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = bad;
  r.p[1] = x->data;
  r.n[0] = x->size;
  r.n[1] = fn == DTRAIN_MAP_SQRT ? DTRAIN_MAP_DOMAIN_NONNEG : DTRAIN_MAP_DOMAIN_POS;
  if (!dt__dev_run(g, op, DTRAIN_K_MAP, &r)) return 0;
  dt__device_args0(&r);
  r.p[0] = count;
  r.p[1] = bad;
  r.n[0] = x->size;
  r.f[0] = 1.0f;
  float h = 0.0f;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r) || !dt__dev_copy(g, op, &h, count, sizeof h, DTRAIN_COPY_D2H)) return 0;
  if (h == 0.0f) return 1;
  size_t bytes = (size_t)x->size * sizeof(float);
  float *hb = (float *)dt__alloc(bytes);
  if (!hb) {
    dt__fail(g, DTRAIN_ERR_NOMEM, "%s: an input element is outside the op's domain (out of host memory to find it)", op);
    return 0;
  }
  int64_t at = 0;
  float v = 0.0f;
  if (dt__dev_copy(g, op, hb, bad, bytes, DTRAIN_COPY_D2H)) {
    while (at < x->size - 1 && hb[at] == 0.0f) at++;
    if (dt__dev_copy(g, op, &v, x->data + at, sizeof v, DTRAIN_COPY_D2H)) {
      if (fn == DTRAIN_MAP_POW_SCALAR)
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                 (long long)at, (double)v);
      else
        dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op, (long long)at,
                 (double)v, fn == DTRAIN_MAP_LOG ? ">" : ">=");
    }
  }
  dt__free(hb, bytes);
  return 0;
}

DTRAIN_PRIVATE dt_tensor *dt__dev_map(dt_graph *g, dt_tensor *x, int fn, float s, const char *op) {
  if ((fn == DTRAIN_MAP_POW_SCALAR && s != floorf(s)) || fn == DTRAIN_MAP_LOG || fn == DTRAIN_MAP_SQRT)
    if (!dt__device_domain(g, x, fn, op)) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  r.n[1] = fn;
  r.f[0] = s;
  if (!dt__dev_run(g, op, DTRAIN_K_MAP, &r)) return NULL;
  y->iaux[0] = fn;
  y->faux[0] = s;
  dt__record(g, y, op, dt__device_map_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- sum / mean ---------------------------------------------------------------------------- */

static void dt__device_reduce_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = x->size;
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_ACC_SCALAR, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op) {
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = x->size;
  r.f[0] = mean ? (float)(1.0 / (double)x->size) : 1.0f;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  y->faux[0] = r.f[0];
  dt__record(g, y, op, dt__device_reduce_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- sum / mean over one axis ---------------------------------------------------------------- */

static void dt__device_reduce_axis_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[1];
  r.n[2] = y->iaux[2];
  r.f[0] = y->faux[0];
  dt__dev_run(g, y->op, DTRAIN_K_SUM_AXIS_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_reduce_axis(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t outer,
                                              int64_t len, int64_t inner, int mean, const char *op) {
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = outer;
  r.n[1] = len;
  r.n[2] = inner;
  r.n[3] = mean;
  if (!dt__dev_run(g, op, DTRAIN_K_SUM_AXIS, &r)) return NULL;
  y->iaux[0] = outer;
  y->iaux[1] = len;
  y->iaux[2] = inner;
  y->iaux[3] = mean;
  y->faux[0] = mean ? (float)(1.0 / (double)len) : 1.0f;
  dt__record(g, y, op, dt__device_reduce_axis_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- transpose (last two dims) ----------------------------------------------------------------- */

static void dt__device_transpose_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r; /* gx [b, m, n] += (gy [b, n, m])^T */
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[2];
  r.n[2] = y->iaux[1];
  r.n[3] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_TRANSPOSE, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_transpose(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, int64_t batch,
                                            int64_t m, int64_t n) {
  const char *op = "dt_transpose";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = batch;
  r.n[1] = m;
  r.n[2] = n;
  if (!dt__dev_run(g, op, DTRAIN_K_TRANSPOSE, &r)) return NULL;
  y->iaux[0] = batch;
  y->iaux[1] = m;
  y->iaux[2] = n;
  dt__record(g, y, op, dt__device_transpose_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- dropout: the mask drawn on the host from the graph's RNG (the CPU op's
 * draws, in the same order), copied to the device; y = x * mask, and the
 * backward gx += gy * mask. ------------------------------------------------------------------ */

static void dt__device_dropout_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = (float *)y->aux;
  r.n[0] = y->size;
  r.n[1] = y->size;
  dt__dev_run(g, y->op, DTRAIN_K_ACC_MUL, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_dropout(dt_graph *g, dt_tensor *x, float p) {
  const char *op = "dt_dropout";
  size_t bytes;
  if (!dt__mul_size((size_t)x->size, sizeof(float), &bytes))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: mask of %lld floats overflows", op, (long long)x->size);
  float *host = (float *)dt__arena_alloc(g, bytes); /* host arena: no allocation in steady state */
  float *mask = host ? dt__arena_floats(g, x->size) : NULL;
  dt_tensor *y = mask ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < x->size; i++) host[i] = dt_rng_uniform(&g->rng) >= p ? scale : 0.0f;
  if (!dt__dev_copy(g, op, mask, host, bytes, DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = mask;
  r.n[0] = y->size;
  r.n[1] = y->size;
  if (!dt__dev_run(g, op, DTRAIN_K_MUL, &r)) return NULL;
  y->aux = mask;
  y->faux[0] = p;
  dt__record(g, y, op, dt__device_dropout_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- layer norm over the last dim ------------------------------------------------------------
 * aux: the device stats [mean[rows], rstd[rows]]; iaux 0 rows, 1 d. */

static void dt__device_layer_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  if (gg || gb) {
    dt__device_args0(&r);
    r.p[0] = gg;
    r.p[1] = gb;
    r.p[2] = y->grad;
    r.p[3] = x->data;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    if (!dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD_PARAMS, &r)) return;
  }
  if (gx) {
    dt__device_args0(&r);
    r.p[0] = gx;
    r.p[1] = y->grad;
    r.p[2] = x->data;
    r.p[3] = gamma ? gamma->data : NULL;
    r.p[4] = (float *)y->aux;
    r.n[0] = y->iaux[0];
    r.n[1] = y->iaux[1];
    dt__dev_run(g, y->op, DTRAIN_K_LAYER_NORM_BWD, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps,
                                             int64_t rows, int64_t d) {
  const char *op = "dt_layer_norm";
  float *stats = dt__arena_floats(g, 2 * rows);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = gamma ? gamma->data : NULL;
  r.p[3] = beta ? beta->data : NULL;
  r.p[4] = stats;
  r.n[0] = rows;
  r.n[1] = d;
  r.f[0] = eps;
  if (!dt__dev_run(g, op, DTRAIN_K_LAYER_NORM, &r)) return NULL;
  y->aux = stats;
  y->iaux[0] = rows;
  y->iaux[1] = d;
  dt__record(g, y, op, dt__device_layer_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* ---- embedding: ids checked on the host (by dt_embedding), copied to the device ------------
 * aux: the device ids. */

static void dt__device_embedding_backward(dt_graph *g, dt_tensor *y) {
  float *gt = dt__grad(g, y->src[0]);
  if (!gt) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gt;
  r.p[1] = y->grad;
  r.labels = (const int32_t *)y->aux;
  r.n[0] = y->shape[0];
  r.n[1] = y->shape[1];
  dt__dev_run(g, y->op, DTRAIN_K_EMBED_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n, int64_t d) {
  const char *op = "dt_embedding";
  int64_t shape[2];
  shape[0] = n;
  shape[1] = d;
  dt_tensor *y = dt__new(g, op, 2, shape); /* validates the size, so n * 4 bytes cannot overflow */
  int32_t *dids = y ? (int32_t *)dt__dev_arena(g, (size_t)n * sizeof(int32_t)) : NULL;
  if (!dids) return NULL;
  if (!dt__dev_copy(g, op, dids, ids, (size_t)n * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = table->data;
  r.labels = dids;
  r.n[0] = n;
  r.n[1] = d;
  if (!dt__dev_run(g, op, DTRAIN_K_EMBED, &r)) return NULL;
  y->aux = dids;
  dt__record(g, y, op, dt__device_embedding_backward, table, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- GEMM-based: matmul (2-D), linear --------------------------------------------------------- */

/* `batch` products C_i [m,n] (+)= op(A_i) op(B_i), packed row-major, the
 * i-th at A + i*sa, B + i*sb, C + i*sc. */
static int dt__device_gemm_batched(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                                   const float *A, int64_t sa, const float *B, int64_t sb, float beta, float *C,
                                   int64_t sc, int64_t batch) {
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = C;
  r.p[1] = (float *)(uintptr_t)A;
  r.p[2] = (float *)(uintptr_t)B;
  r.n[0] = m;
  r.n[1] = n;
  r.n[2] = k;
  r.n[3] = ta | (tb << 1);
  r.n[4] = batch;
  r.n[5] = sa;
  r.n[6] = sb;
  r.n[7] = sc;
  r.f[0] = 1.0f;
  r.f[1] = beta;
  return dt__dev_run(g, op, DTRAIN_K_GEMM, &r);
}

/* C [m,n] (+)= op(A) op(B), packed row-major. */
static int dt__device_gemm(dt_graph *g, const char *op, int ta, int tb, int64_t m, int64_t n, int64_t k,
                           const float *A, const float *B, float beta, float *C) {
  return dt__device_gemm_batched(g, op, ta, tb, m, n, k, A, 0, B, 0, beta, C, 0, 1);
}

static void dt__device_matmul_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t m = y->iaux[0], k = y->iaux[1], n = y->iaux[2];
  if (ga && !dt__device_gemm(g, y->op, 0, 1, m, k, n, y->grad, b->data, 1.0f, ga)) return; /* dA += dC B^T */
  if (gb) dt__device_gemm(g, y->op, 1, 0, k, n, m, a->data, y->grad, 1.0f, gb);            /* dB += A^T dC */
}

DTRAIN_PRIVATE dt_tensor *dt__dev_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1];
  if (b->shape[0] != k) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: inner dims differ (%s @ %s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  int64_t shape[2];
  shape[0] = m;
  shape[1] = n;
  dt_tensor *y = dt__new(g, op, 2, shape);
  if (!y) return NULL;
  if (!dt__device_gemm(g, op, 0, 0, m, n, k, a->data, b->data, 0.0f, y->data)) return NULL;
  y->iaux[0] = m;
  y->iaux[1] = k;
  y->iaux[2] = n;
  dt__record(g, y, op, dt__device_matmul_backward, a, b, NULL);
  return dt__finish(g, y);
}

static void dt__device_linear_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t rows = y->iaux[0], in = y->iaux[1], out = y->iaux[2];
  if (gx && !dt__device_gemm(g, y->op, 0, 0, rows, in, out, y->grad, w->data, 1.0f, gx)) return; /* dx += dy w */
  if (gw && !dt__device_gemm(g, y->op, 1, 0, out, in, rows, y->grad, x->data, 1.0f, gw)) return; /* dw += dy^T x */
  if (gb) {
    dt_kernel_args r;
    dt__device_args0(&r);
    r.p[0] = gb;
    r.p[1] = y->grad;
    r.n[0] = rows * out;
    r.n[1] = out;
    r.f[0] = 1.0f;
    dt__dev_run(g, y->op, DTRAIN_K_ACC_ROWS, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int64_t rows,
                                         int64_t in, int64_t out, int ndim, const int64_t *shape) {
  const char *op = "dt_linear";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  if (b) { /* rows of bias, then GEMM with beta = 1: the CPU's order */
    dt_kernel_args r;
    dt__device_args0(&r);
    r.p[0] = y->data;
    r.p[1] = b->data;
    r.n[0] = rows * out;
    r.n[1] = out;
    if (!dt__dev_run(g, op, DTRAIN_K_ROWS_COPY, &r)) return NULL;
  }
  if (!dt__device_gemm(g, op, 0, 1, rows, out, in, x->data, w->data, b ? 1.0f : 0.0f, y->data)) return NULL;
  y->iaux[0] = rows;
  y->iaux[1] = in;
  y->iaux[2] = out;
  dt__record(g, y, op, dt__device_linear_backward, x, w, b);
  return dt__finish(g, y);
}

/* ---- softmax / log_softmax over any axis ---------------------------------------------------- */

static void dt__device_softmax_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_softmax_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = y->data;
  dt__dev_run(g, y->op, DTRAIN_K_SOFTMAX_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_softmax(dt_graph *g, dt_tensor *x, int ax, int is_log, const char *op) {
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t outer = 1, inner = 1, n = x->shape[ax];
  for (int d = 0; d < ax; d++) outer *= x->shape[d];
  for (int d = ax + 1; d < x->ndim; d++) inner *= x->shape[d];
  y->iaux[0] = outer * inner;
  y->iaux[1] = n;
  y->iaux[2] = inner;
  y->iaux[3] = is_log;
  dt_kernel_args r;
  dt__device_softmax_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_SOFTMAX, &r)) return NULL;
  dt__record(g, y, op, dt__device_softmax_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- cross entropy ----------------------------------------------------------------------------
 * aux (host arena): the device labels and the per-row max / log-sum-exp. */
typedef struct dt__device_xent {
  int32_t *labels;
  float *rowloss, *mx, *ls;
} dt__device_xent;

static void dt__device_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const dt__device_xent *s = (const dt__device_xent *)y->aux;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.p[4] = y->grad;
  r.labels = s->labels;
  r.n[0] = y->iaux[0];
  r.n[1] = y->iaux[1];
  dt__dev_run(g, y->op, DTRAIN_K_XENT_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_xent(dt_graph *g, dt_tensor *x, const int32_t *labels, int64_t rows, int64_t c) {
  const char *op = "dt_cross_entropy";
  dt__device_xent *s = (dt__device_xent *)dt__arena_alloc(g, sizeof *s);
  if (!s) return NULL;
  s->labels = (int32_t *)dt__dev_arena(g, (size_t)rows * sizeof(int32_t));
  s->rowloss = dt__arena_floats(g, 3 * rows);
  if (!s->labels || !s->rowloss) return NULL;
  s->mx = s->rowloss + rows;
  s->ls = s->mx + rows;
  if (!dt__dev_copy(g, op, s->labels, labels, (size_t)rows * sizeof(int32_t), DTRAIN_COPY_H2D)) return NULL;
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = s->rowloss;
  r.p[1] = x->data;
  r.p[2] = s->mx;
  r.p[3] = s->ls;
  r.labels = s->labels;
  r.n[0] = rows;
  r.n[1] = c;
  if (!dt__dev_run(g, op, DTRAIN_K_XENT, &r)) return NULL;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = s->rowloss;
  r.n[0] = rows;
  r.f[0] = (float)(1.0 / (double)rows);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  y->aux = s;
  y->iaux[0] = rows;
  y->iaux[1] = c;
  dt__record(g, y, op, dt__device_xent_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- mean squared error ------------------------------------------------------------------------- */

static void dt__device_mse_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = ga;
  r.p[1] = gb;
  r.p[2] = a->data;
  r.p[3] = b->data;
  r.p[4] = y->grad;
  r.n[0] = a->size;
  dt__dev_run(g, y->op, DTRAIN_K_MSE_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_mse(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  const char *op = "dt_mse";
  float *sq = dt__arena_floats(g, a->size);
  dt_tensor *y = sq ? dt__new(g, op, 0, NULL) : NULL;
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = sq;
  r.p[1] = a->data;
  r.p[2] = b->data;
  r.n[0] = a->size;
  if (!dt__dev_run(g, op, DTRAIN_K_SQDIFF, &r)) return NULL;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = sq;
  r.n[0] = a->size;
  r.f[0] = (float)(1.0 / (double)a->size);
  if (!dt__dev_run(g, op, DTRAIN_K_SUM, &r)) return NULL;
  dt__record(g, y, op, dt__device_mse_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- convolution (im2col + GEMM per image) and pooling -------------------------------
 * The forward keeps the column matrices of the whole batch ([N][K][P], in the
 * device arena) for the backward, which also needs one gradient column
 * buffer of the same size. */

static void dt__device_conv_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *w, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = x->shape[0];
  r->n[1] = x->shape[1];
  r->n[2] = x->shape[2];
  r->n[3] = x->shape[3];
  r->n[4] = w->shape[2];
  r->n[5] = w->shape[3];
  r->n[6] = y->iaux[0];
  r->n[7] = y->iaux[1];
  r->n[8] = y->shape[2];
  r->n[9] = y->shape[3];
  r->n[10] = w->shape[0];
}

static void dt__device_conv_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  const float *col = (const float *)y->aux;
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t pp = y->shape[2] * y->shape[3];
  dt_kernel_args r;
  if (gb) {
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gb;
    r.p[1] = y->grad;
    if (!dt__dev_run(g, y->op, DTRAIN_K_CONV_BIAS_BWD, &r)) return;
  }
  if (gw)
    for (int64_t i = 0; i < n; i++) /* gw [O,K] += gy_i [O,P] @ col_i^T */
      if (!dt__device_gemm(g, y->op, 0, 1, o, k, pp, y->grad + i * o * pp, col + i * k * pp, 1.0f, gw)) return;
  if (gx) {
    float *gcol = dt__arena_floats(g, n * k * pp);
    if (!gcol) return;
    for (int64_t i = 0; i < n; i++) /* gcol_i [K,P] = w^T @ gy_i */
      if (!dt__device_gemm(g, y->op, 1, 0, k, pp, o, w->data, y->grad + i * o * pp, 0.0f, gcol + i * k * pp)) return;
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = gx;
    r.p[1] = gcol;
    dt__dev_run(g, y->op, DTRAIN_K_COL2IM_ACC, &r);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  const char *op = "dt_conv2d";
  int64_t n = x->shape[0], o = w->shape[0], k = w->shape[1] * w->shape[2] * w->shape[3];
  int64_t ho = (x->shape[2] + 2 * (int64_t)padding - w->shape[2]) / stride + 1;
  int64_t wo = (x->shape[3] + 2 * (int64_t)padding - w->shape[3]) / stride + 1, pp = ho * wo;
  int64_t shape[4];
  shape[0] = n;
  shape[1] = o;
  shape[2] = ho;
  shape[3] = wo;
  size_t cols;
  if (!dt__mul_size((size_t)n, (size_t)k, &cols) || !dt__mul_size(cols, (size_t)pp, &cols) || dt__too_many(cols)) {
    char sx[96], sw[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrices of x %s, w %s too large", op,
                                 dt_shape_str(x, sx, sizeof sx), dt_shape_str(w, sw, sizeof sw));
  }
  dt_tensor *y = dt__new(g, op, 4, shape);
  float *col = y ? dt__arena_floats(g, (int64_t)cols) : NULL;
  if (!col) return NULL;
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt_kernel_args r;
  dt__device_conv_args(&r, x, w, y);
  r.p[0] = col;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_IM2COL, &r)) return NULL;
  if (b) {
    dt__device_conv_args(&r, x, w, y);
    r.p[0] = y->data;
    r.p[1] = b->data;
    if (!dt__dev_run(g, op, DTRAIN_K_CONV_BIAS, &r)) return NULL;
  }
  for (int64_t i = 0; i < n; i++) /* y_i [O,P] = w [O,K] @ col_i [K,P] (+ bias) */
    if (!dt__device_gemm(g, op, 0, 0, o, pp, k, w->data, col + i * k * pp, b ? 1.0f : 0.0f, y->data + i * o * pp))
      return NULL;
  y->aux = col;
  dt__record(g, y, op, dt__device_conv_backward, x, w, b);
  return dt__finish(g, y);
}

static void dt__device_pool_args(dt_kernel_args *r, const dt_tensor *x, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = x->shape[0] * x->shape[1];
  r->n[1] = x->shape[2];
  r->n[2] = x->shape[3];
  r->n[3] = y->shape[2];
  r->n[4] = y->shape[3];
  r->n[5] = y->iaux[0];
  r->n[6] = y->iaux[1];
}

static void dt__device_pool_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = y->data;
  dt__dev_run(g, y->op, y->iaux[2] ? DTRAIN_K_MAXPOOL_BWD : DTRAIN_K_AVGPOOL_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_pool(dt_graph *g, dt_tensor *x, int kernel, int stride, int is_max, const char *op) {
  int64_t shape[4];
  shape[0] = x->shape[0];
  shape[1] = x->shape[1];
  shape[2] = (x->shape[2] - kernel) / stride + 1;
  shape[3] = (x->shape[3] - kernel) / stride + 1;
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  y->iaux[0] = kernel;
  y->iaux[1] = stride;
  y->iaux[2] = is_max;
  dt_kernel_args r;
  dt__device_pool_args(&r, x, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, is_max ? DTRAIN_K_MAXPOOL : DTRAIN_K_AVGPOOL, &r)) return NULL;
  dt__record(g, y, op, dt__device_pool_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- batched matmul: one strided-batched GEMM per product --------------------------------
 * y's iaux is dt_ops_matmul.c's layout: 0 batch, 1 M, 2 K, 3 N, 4 trans_b,
 * 5 shared (b 2-D: the batch folds into the rows, one GEMM). The products
 * and their backward are the CPU's, with the batch as one GEMM call. */

static void dt__device_bmm_dims(const dt_tensor *y, int64_t *nb, int64_t *m) {
  int shared = (int)y->iaux[5];
  *nb = shared ? 1 : y->iaux[0];
  *m = shared ? y->iaux[0] * y->iaux[1] : y->iaux[1];
}

static void dt__device_bmm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  int64_t sa = m * k, sb = shared ? 0 : k * n, sc = m * n;
  if (ga) { /* dA += dC @ op(B)^T */
    if (!dt__device_gemm_batched(g, y->op, 0, trans_b ? 0 : 1, m, k, n, y->grad, sc, b->data, sb, 1.0f, ga, sa, nb))
      return;
  }
  if (gb) { /* dB += A^T @ dC, or dB^T += dC^T @ A when B is used transposed */
    if (trans_b) dt__device_gemm_batched(g, y->op, 1, 0, n, k, m, y->grad, sc, a->data, sa, 1.0f, gb, sb, nb);
    else dt__device_gemm_batched(g, y->op, 1, 0, k, n, m, a->data, sa, y->grad, sc, 1.0f, gb, sb, nb);
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_bmm(dt_graph *g, dt_tensor *y, dt_tensor *a, dt_tensor *b, const char *op) {
  int64_t nb, m, k = y->iaux[2], n = y->iaux[3];
  int trans_b = (int)y->iaux[4], shared = (int)y->iaux[5];
  dt__device_bmm_dims(y, &nb, &m);
  if (!dt__device_gemm_batched(g, op, 0, trans_b, m, n, k, a->data, m * k, b->data, shared ? 0 : k * n, 0.0f, y->data,
                               m * n, nb))
    return NULL;
  dt__record(g, y, op, dt__device_bmm_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- permute: one gather kernel (and its scatter-add backward) --------------------------------
 * iaux[0..ndim): the permutation, as the CPU op keeps it. */

static void dt__device_permute_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = y->size;
  r->n[1] = y->ndim;
  int64_t packed = 0;
  for (int d = 0; d < y->ndim; d++) {
    r->n[2 + d] = y->shape[d];
    packed |= y->iaux[d] << (4 * d);
  }
  r->n[8] = packed;
}

static void dt__device_permute_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_permute_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[9] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_PERMUTE, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_permute(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const int64_t *perm) {
  const char *op = "dt_permute";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  for (int d = 0; d < ndim; d++) y->iaux[d] = perm[d];
  dt_kernel_args r;
  dt__device_permute_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  if (!dt__dev_run(g, op, DTRAIN_K_PERMUTE, &r)) return NULL;
  dt__record(g, y, op, dt__device_permute_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- slice / split / concat: strided row copies --------------------------------------------- */

static int dt__device_copy_rows(dt_graph *g, const char *op, float *dst, const float *src, int64_t rows, int64_t chunk,
                                int64_t dst_stride, int64_t src_stride, int acc) {
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = dst;
  r.p[1] = (float *)(uintptr_t)src;
  r.n[0] = rows;
  r.n[1] = chunk;
  r.n[2] = dst_stride;
  r.n[3] = src_stride;
  r.n[4] = acc;
  return dt__dev_run(g, op, DTRAIN_K_COPY_ROWS, &r);
}

/* iaux as the CPU op: 0 outer, 1 dim, 2 inner, 3 start, 4 len. */
static void dt__device_slice_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], dim = y->iaux[1], inner = y->iaux[2], start = y->iaux[3], len = y->iaux[4];
  dt__device_copy_rows(g, y->op, gx + start * inner, y->grad, outer, len * inner, dim * inner, len * inner, 1);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_slice(dt_graph *g, dt_tensor *x, const char *op, int ndim, const int64_t *shape,
                                        int64_t outer, int64_t dim, int64_t inner, int64_t start, int64_t len) {
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  if (!dt__device_copy_rows(g, op, y->data, x->data + start * inner, outer, len * inner, len * inner, dim * inner, 0))
    return NULL;
  y->iaux[0] = outer;
  y->iaux[1] = dim;
  y->iaux[2] = inner;
  y->iaux[3] = start;
  y->iaux[4] = len;
  dt__record(g, y, op, dt__device_slice_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* aux: the n inputs (host arena); iaux 0 n, 1 outer, 2 inner (the CPU op's layout). */
static void dt__device_concat_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *const *xs = (dt_tensor *const *)y->aux;
  int n = (int)y->iaux[0];
  int64_t outer = y->iaux[1], row = y->size / outer, base = 0;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->size / outer;
    float *gx = dt__grad(g, x);
    if (g->err != DTRAIN_OK) return;
    if (gx && !dt__device_copy_rows(g, y->op, gx, y->grad + base, outer, chunk, chunk, row, 1)) return;
    base += chunk;
  }
}

DTRAIN_PRIVATE dt_tensor *dt__dev_concat(dt_graph *g, dt_tensor *const *xs, int n, dt_tensor **list, int ndim,
                                         const int64_t *shape, int64_t outer, int64_t inner, int ax) {
  const char *op = "dt_concat";
  dt_tensor *y = dt__new(g, op, ndim, shape);
  if (!y) return NULL;
  int64_t row = shape[ax] * inner, base = 0;
  dt_tensor *first_rg = NULL;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->shape[ax] * inner;
    if (!dt__device_copy_rows(g, op, y->data + base, x->data, outer, chunk, row, chunk, 0)) return NULL;
    base += chunk;
    list[j] = x;
    if (!first_rg && (x->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) first_rg = x;
  }
  y->aux = list;
  y->iaux[0] = n;
  y->iaux[1] = outer;
  y->iaux[2] = inner;
  dt__record(g, y, op, dt__device_concat_backward, first_rg ? first_rg : list[0], NULL, NULL);
  for (int j = 0; j < 4; j++) y->src[j] = j < n ? list[j] : NULL;
  return dt__finish(g, y);
}

/* ---- causal mask ---------------------------------------------------------------------------- */

static void dt__device_causal_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.n[0] = y->size;
  r.n[1] = y->shape[y->ndim - 1];
  r.n[2] = 1;
  dt__dev_run(g, y->op, DTRAIN_K_CAUSAL_MASK, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_causal_mask(dt_graph *g, dt_tensor *x, int64_t t) {
  const char *op = "dt_causal_mask";
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  dt_kernel_args r;
  dt__device_args0(&r);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.n[0] = y->size;
  r.n[1] = t;
  if (!dt__dev_run(g, op, DTRAIN_K_CAUSAL_MASK, &r)) return NULL;
  dt__record(g, y, op, dt__device_causal_backward, x, NULL, NULL);
  if (g->err != DTRAIN_OK) return NULL;
  if (!g->check_numerics) return y;
  /* The -inf entries are intended: check only the kept ones, on the host. */
  size_t bytes = (size_t)y->size * sizeof(float);
  float *h = (float *)dt__alloc(bytes);
  if (!h) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "%s: check_numerics: out of host memory", op);
  dt_tensor *res = y;
  if (!dt__dev_copy(g, op, h, y->data, bytes, DTRAIN_COPY_D2H)) {
    res = NULL;
  } else {
    for (int64_t i = 0; i < y->size && res; i++) {
      if (i % t > (i / t) % t || isfinite(h[i])) continue;
      char sb[96];
      dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", op, dt_shape_str(y, sb, sizeof sb),
               isnan(h[i]) ? "NaN" : "Inf", (long long)i);
      res = NULL;
    }
  }
  dt__free(h, bytes);
  return res;
}

/* ---- batch norm ------------------------------------------------------------------------------
 * aux: the device stats [mean[C], rstd[C]]; iaux as the CPU op: 0 N, 1 C, 2 hw,
 * 3 batch statistics used. */

static void dt__device_bn_args(dt_kernel_args *r, const dt_tensor *y) {
  dt__device_args0(r);
  r->n[0] = y->iaux[0];
  r->n[1] = y->iaux[1];
  r->n[2] = y->iaux[2];
  r->n[3] = y->iaux[3];
}

static void dt__device_bn_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  float *red = dt__arena_floats(g, 2 * y->iaux[1]);
  if (!red) return;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = gg;
  r.p[1] = gb;
  r.p[2] = y->grad;
  r.p[3] = x->data;
  r.p[4] = (float *)y->aux;
  r.p[5] = red;
  if (!dt__dev_run(g, y->op, DTRAIN_K_BN_BWD_CH, &r) || !gx) return;
  dt__device_bn_args(&r, y);
  r.p[0] = gx;
  r.p[1] = y->grad;
  r.p[2] = x->data;
  r.p[3] = (float *)y->aux;
  r.p[4] = gamma ? gamma->data : NULL;
  r.p[5] = red;
  dt__dev_run(g, y->op, DTRAIN_K_BN_BWD, &r);
}

DTRAIN_PRIVATE dt_tensor *dt__dev_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                             dt_tensor *running_mean, dt_tensor *running_var, float momentum,
                                             float eps, int64_t nb, int64_t c, int64_t hw, int batch) {
  const char *op = "dt_batch_norm";
  if (!batch) { /* the CPU op's check of the running variance: c floats come to the host */
    float *h = (float *)dt__arena_alloc(g, (size_t)c * sizeof(float));
    if (!h || !dt__dev_copy(g, op, h, running_var->data, (size_t)c * sizeof(float), DTRAIN_COPY_D2H)) return NULL;
    for (int64_t ch = 0; ch < c; ch++)
      if (!(h[ch] + eps > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: running_var[%lld] + eps is %g (must be > 0)", op,
                                     (long long)ch, (double)(h[ch] + eps));
  }
  float *stats = dt__arena_floats(g, 2 * c);
  dt_tensor *y = stats ? dt__new_like(g, op, x) : NULL;
  if (!y) return NULL;
  y->aux = stats;
  y->iaux[0] = nb;
  y->iaux[1] = c;
  y->iaux[2] = hw;
  y->iaux[3] = batch;
  dt_kernel_args r;
  dt__device_bn_args(&r, y);
  r.p[0] = stats;
  r.p[1] = x->data;
  r.p[2] = running_mean ? running_mean->data : NULL;
  r.p[3] = running_var ? running_var->data : NULL;
  r.f[0] = eps;
  r.f[1] = momentum;
  if (!dt__dev_run(g, op, DTRAIN_K_BN_STATS, &r)) return NULL;
  dt__device_bn_args(&r, y);
  r.p[0] = y->data;
  r.p[1] = x->data;
  r.p[2] = stats;
  r.p[3] = gamma ? gamma->data : NULL;
  r.p[4] = beta ? beta->data : NULL;
  if (!dt__dev_run(g, op, DTRAIN_K_BN, &r)) return NULL;
  dt__record(g, y, op, dt__device_bn_backward, x, gamma, beta);
  return dt__finish(g, y);
}

#undef DT__DEV_ALIGN
/* ======== end dt_device.c ======== */

/* ======== begin dt_devgroup.c ======== */
/* ===========================================================================
 * dt_devgroup.c -- collectives over several devices (dt_device_group): the
 * all-reduce of mirrored training on devices
 * ===========================================================================
 * A ring over the devices' peer copies and their DTRAIN_K_ACC kernel, or the
 * backend's own collective (group hooks: NCCL in dtrain_cuda.h). The core
 * never calls a device API here either: everything goes through the
 * dt_device function table. See dt_device.h for the contract.
 */
/* #include "dt_internal.h" (amalgamated) */

struct dt_device_group {
  int n;
  size_t count;
  dt_device **devs;
  float **scratch;   /* one chunk per device (device memory) */
  size_t chunk;      /* floats in the largest chunk */
  float *host;       /* staging for devices without peer_copy (chunk floats), or NULL */
  void *coll;        /* the backend's collective (group hooks), or NULL */
  float **view;      /* n pointers: buffers offset for a ranged collective */
};

DTRAIN_API const char *dt_device_group_method(const dt_device_group *g) {
  if (!g) return "none";
  if (g->coll) return "collective (group hooks)";
  if (g->n == 1) return "none (one device)";
  return g->host ? "ring through host memory" : "ring over peer copies";
}

DTRAIN_API void dt_device_group_destroy(dt_device_group *g) {
  if (!g) return;
  if (g->coll && g->devs[0]->group_destroy) g->devs[0]->group_destroy(g->coll);
  if (g->scratch)
    for (int i = 0; i < g->n; i++)
      if (g->scratch[i]) g->devs[i]->free(g->devs[i], g->scratch[i], g->chunk * sizeof(float));
  dt__free(g->host, g->chunk * sizeof(float));
  dt__free(g->scratch, (size_t)g->n * sizeof(float *));
  dt__free(g->view, (size_t)g->n * sizeof(float *));
  dt__free(g->devs, (size_t)g->n * sizeof(dt_device *));
  dt__free(g, sizeof *g);
}

DTRAIN_API dt_device_group *dt_device_group_create(dt_device *const *devs, int n, size_t count) {
  const char *fn = "dt_device_group_create";
  if (!devs) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: devs is NULL", fn);
    return NULL;
  }
  if (n < 1) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d devices (need >= 1)", fn, n);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    const dt_device *d = devs[i];
    if (!d || !d->alloc || !d->free || !d->copy || !d->sync || !d->run) {
      dt__error(DTRAIN_ERR_NULL_ARG, "%s: device %d is NULL or has a NULL function", fn, i);
      return NULL;
    }
  }
  int hooks = 0;
  dt_device_group *g = (dt_device_group *)dt__calloc(sizeof *g);
  if (!g) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  g->n = n;
  g->count = count;
  g->devs = (dt_device **)dt__calloc((size_t)n * sizeof(dt_device *));
  g->scratch = (float **)dt__calloc((size_t)n * sizeof(float *));
  g->view = (float **)dt__calloc((size_t)n * sizeof(float *));
  if (!g->devs || !g->scratch || !g->view) goto nomem;
  for (int i = 0; i < n; i++) g->devs[i] = devs[i];
  if (n == 1) return g;
  for (int i = 0; i < n; i++) {
    size_t b, e;
    dt_comm_slice(count, n, i, &b, &e);
    if (e - b > g->chunk) g->chunk = e - b;
  }
  if (g->chunk == 0) g->chunk = 1;
  for (int i = 0; i < n; i++)
    if (!devs[i]->peer_copy && !g->host && !(g->host = (float *)dt__alloc(g->chunk * sizeof(float)))) goto nomem;
  /* The backend's collective, when every device has the same one. */
  hooks = devs[0]->group_create && devs[0]->group_allreduce && devs[0]->group_destroy;
  for (int i = 1; i < n && hooks; i++)
    hooks = devs[i]->group_create == devs[0]->group_create && devs[i]->group_allreduce == devs[0]->group_allreduce;
  if (hooks) {
    dt__quiet_push(); /* a failure is logged once, below, with the group's context */
    dt_result r = devs[0]->group_create(g->devs, n, &g->coll);
    dt__quiet_pop(DTRAIN_OK);
    if (r == DTRAIN_ERR_UNSUPPORTED) { /* not for these devices (NCCL: a GPU twice): the ring below */
      dt__log(DTRAIN_LOG_DEBUG, DTRAIN_OK, "%s: the backend's collective refused %d devices (%.300s); using the ring",
              fn, n, dt_last_error());
      g->coll = NULL;
      hooks = 0;
    } else if (r != DTRAIN_OK) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "%.300s", dt_last_error());
      dt__error(r, "%s: collective over %d devices (%s, ...): %s", fn, n, devs[0]->name, what);
      g->coll = NULL;
      goto fail;
    } else {
      return g;
    }
  }
  for (int i = 0; i < n; i++) {
    void *p = NULL;
    dt_result r = devs[i]->alloc(devs[i], g->chunk * sizeof(float), &p);
    if (r != DTRAIN_OK) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "%.300s", dt_last_error());
      dt__error(r, "%s: scratch of %zu bytes on device %s: %s", fn, g->chunk * sizeof(float), devs[i]->name, what);
      goto fail;
    }
    g->scratch[i] = (float *)p;
  }
  return g;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
fail:
  dt_device_group_destroy(g);
  return NULL;
}

/* bytes from device `from` (src) to device `to` (dst). */
static dt_result dt__devgroup_copy(dt_device_group *g, int to, float *dst, int from, const float *src, size_t bytes,
                                   const char *what) {
  dt_device *d = g->devs[to], *f = g->devs[from];
  dt_result r;
  const char *who = d->name;
  if (bytes == 0) return DTRAIN_OK;
  if (d->peer_copy) {
    r = d->peer_copy(d, dst, f, src, bytes);
  } else {
    who = f->name;
    r = f->copy(f, g->host, src, bytes, DTRAIN_COPY_D2H);
    if (r == DTRAIN_OK) {
      who = d->name;
      r = d->copy(d, dst, g->host, bytes, DTRAIN_COPY_H2D);
    }
  }
  if (r != DTRAIN_OK) {
    char msg[DT__MSG_CAP];
    snprintf(msg, sizeof msg, "%.300s", dt_last_error());
    return dt__error(r, "%s: copy %s -> %s: device %s: %s", what, f->name, d->name, who, msg);
  }
  return DTRAIN_OK;
}

static dt_result dt__devgroup_sync_all(dt_device_group *g, const char *what) {
  for (int i = 0; i < g->n; i++) {
    dt_result r = g->devs[i]->sync(g->devs[i]);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: device %s: %s", what, g->devs[i]->name, msg);
    }
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_device_group_allreduce(dt_device_group *g, float *const *bufs) {
  const char *fn = "dt_device_group_allreduce";
  if (!g || !bufs) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !g ? "group" : "bufs");
  const int n = g->n;
  if (n == 1 || g->count == 0) return DTRAIN_OK;
  for (int i = 0; i < n; i++)
    if (!bufs[i]) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: buffer %d is NULL", fn, i);
  dt_result r;
  char what[96];
  if (g->coll) {
    r = g->devs[0]->group_allreduce(g->coll, bufs, g->count);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: collective over %d devices: %s", fn, n, msg);
    }
    return dt__devgroup_sync_all(g, fn);
  }
  /* reduce-scatter: in round k device i sends chunk (i - k) mod n to device
   * i + 1, which adds it to its own; after n - 1 rounds device i holds the
   * whole sum of chunk (i + 1) mod n. */
  for (int k = 0; k < n - 1; k++) {
    snprintf(what, sizeof what, "%s: reduce-scatter round %d of %d", fn, k + 1, n - 1);
    for (int i = 0; i < n; i++) {
      int to = (i + 1) % n, c = ((i - k) % n + n) % n;
      size_t b, e;
      dt_comm_slice(g->count, n, c, &b, &e);
      if (b == e) continue;
      r = dt__devgroup_copy(g, to, g->scratch[to], i, bufs[i] + b, (e - b) * sizeof(float), what);
      if (r != DTRAIN_OK) return r;
      dt_kernel_args a;
      memset(&a, 0, sizeof a);
      a.p[0] = bufs[to] + b;
      a.p[1] = g->scratch[to];
      a.n[0] = (int64_t)(e - b);
      a.f[0] = 1.0f;
      dt_device *d = g->devs[to];
      r = d->run(d, DTRAIN_K_ACC, &a);
      if (r != DTRAIN_OK) {
        char msg[DT__MSG_CAP];
        snprintf(msg, sizeof msg, "%.300s", dt_last_error());
        return dt__error(r, "%s: accumulate on device %s: %s", what, d->name, msg);
      }
    }
    if ((r = dt__devgroup_sync_all(g, what)) != DTRAIN_OK) return r;
  }
  /* all-gather: in round k device i sends its finished chunk (i + 1 - k)
   * mod n to device i + 1. */
  for (int k = 0; k < n - 1; k++) {
    snprintf(what, sizeof what, "%s: all-gather round %d of %d", fn, k + 1, n - 1);
    for (int i = 0; i < n; i++) {
      int to = (i + 1) % n, c = ((i + 1 - k) % n + n) % n;
      size_t b, e;
      dt_comm_slice(g->count, n, c, &b, &e);
      r = dt__devgroup_copy(g, to, bufs[to] + b, i, bufs[i] + b, (e - b) * sizeof(float), what);
      if (r != DTRAIN_OK) return r;
    }
    if ((r = dt__devgroup_sync_all(g, what)) != DTRAIN_OK) return r;
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_device_group_broadcast(dt_device_group *g, float *const *bufs, size_t begin, size_t end,
                                               int root) {
  const char *fn = "dt_device_group_broadcast";
  if (!g || !bufs) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !g ? "group" : "bufs");
  if (root < 0 || root >= g->n) return dt__error(DTRAIN_ERR_INDEX, "%s: root %d outside [0, %d)", fn, root, g->n);
  if (begin > end || end > g->count)
    return dt__error(DTRAIN_ERR_INDEX, "%s: range [%zu, %zu) outside the group's %zu floats", fn, begin, end, g->count);
  if (g->n == 1 || begin == end) return DTRAIN_OK;
  for (int i = 0; i < g->n; i++)
    if (!bufs[i]) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: buffer %d is NULL", fn, i);
  dt_result r;
  if (g->coll && g->devs[0]->group_broadcast) {
    for (int i = 0; i < g->n; i++) g->view[i] = bufs[i] + begin;
    r = g->devs[0]->group_broadcast(g->coll, g->view, end - begin, root);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: collective over %d devices: %s", fn, g->n, msg);
    }
    return dt__devgroup_sync_all(g, fn);
  }
  /* Host staging copies at most a chunk at a time. */
  size_t step = g->host ? g->chunk : end - begin;
  for (int i = 0; i < g->n; i++) {
    if (i == root) continue;
    for (size_t off = begin; off < end; off += step) {
      size_t m = DT__MIN(step, end - off);
      r = dt__devgroup_copy(g, i, bufs[i] + off, root, bufs[root] + off, m * sizeof(float), fn);
      if (r != DTRAIN_OK) return r;
    }
  }
  return dt__devgroup_sync_all(g, fn);
}
/* ======== end dt_devgroup.c ======== */

/* ======== begin dt_gemm.c ======== */
/* ===========================================================================
 * dt_gemm.c -- single-precision GEMM
 * ===========================================================================
 * C = alpha * op(A) @ op(B) + beta * C, row-major, op(X) = X or X^T.
 *
 * The classic Goto/BLIS structure:
 *
 *   for jc in n by NC:                      columns of C and B
 *     for pc in k by KC:                    the shared dimension
 *       pack op(B)[pc.., jc..] -> bp        KC x NC, NR-wide slivers
 *       for ic in m by MC:                  rows of C and A
 *         pack op(A)[ic.., pc..] -> ap      MC x KC, MR-tall slivers
 *         for jr, ir: micro-kernel          one MR x NR tile of C
 *
 * Packing copies each block into the order the micro-kernel reads it
 * (contiguous, zero-padded to whole tiles), so the transpose flags and the
 * leading dimensions only matter in the packing routines. Partial tiles at
 * the edges run the kernel into a small local tile and copy its valid part
 * (the AVX2 path has a 4-row kernel for the 4-row edge of 64-row batches).
 * Products A @ B^T with few columns (n < 32) skip packing on the AVX2 path:
 * a dot-product kernel (see dt__gemm_dot_avx2).
 * When A has few rows (at most 2 MC: the batch of a training step) and B is
 * wider than NC, the loops run pc -> jc instead, so that A is packed once per
 * k block rather than once per B panel.
 * The panels are one automatic array of fixed size (256 KiB of stack), so
 * a call allocates nothing and may run on any thread.
 *
 * Kernels ("paths"), picked once per process at run time:
 *   avx2+fma  x86-64 with GCC or clang: a 6x16 micro-kernel and packing
 *             routines in intrinsics, compiled for AVX2+FMA with a function
 *             attribute, so a plain -O2 build uses them on CPUs that have
 *             them (checked with __builtin_cpu_supports).
 *   neon      aarch64: an 8x12 micro-kernel in NEON intrinsics.
 *   portable  plain C that gcc and clang vectorise with whatever the build
 *             targets (6x8 with SSE, 6x16 with -mavx); the fallback, and the
 *             only path under DTRAIN_NO_SIMD.
 * The environment variable DTRAIN_GEMM=portable, or dt_sgemm_use_portable(1),
 * forces the portable path (tests compare the two).
 *
 * Determinism: the path is fixed once chosen, the blocking depends only on
 * (m, n, k) and the path, and every element of C is summed in the same
 * order on every call: over k in KC blocks, each block in increasing p.
 * Different paths round differently (FMA or not), so results agree across
 * paths only to rounding.
 */
/* #include "dt_internal.h" (amalgamated) */
#ifdef DTRAIN_USE_CBLAS
#include <cblas.h>
#endif

#if !defined(DTRAIN_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__GEMM_X86 1
#  include <immintrin.h>
#  define DT__GEMM_AVX2 __attribute__((target("avx2,fma")))
#endif
#if !defined(DTRAIN_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
#  define DT__GEMM_NEON 1
#  include <arm_neon.h>
#endif

/* Path ids. */
#define DT__GEMM_PORTABLE 0
#define DT__GEMM_PATH_AVX2 1
#define DT__GEMM_PATH_NEON 2

/* Portable register tile. MR x NR is 12 vector accumulators, whether a
 * vector holds 4 floats (SSE, NEON) or 8 (AVX). */
#define DT__GEMM_MR 6
#if defined(__AVX__)
#  define DT__GEMM_NR 16
#else
#  define DT__GEMM_NR 8
#endif

/* Cache blocking shared by all paths: a B sliver (KC x NR) stays in L1, the
 * packed A block (MC x KC) and the B panel (KC x NC) in L2. MC is a multiple
 * of every path's MR (6, 8) and NC of every NR (8, 12, 16). */
#define DT__GEMM_KC 256
#define DT__GEMM_MC 48
#define DT__GEMM_NC 192
#define DT__GEMM_BUF (DT__GEMM_KC * (DT__GEMM_MC + DT__GEMM_NC)) /* floats */
#define DT__GEMM_TILE_MAX (8 * 16) /* largest MR x NR of any path */
#define DT__GEMM_NR_MAX 16         /* largest NR of any path */

/* Loop hints for the portable micro-kernel, so that the accumulator tile
 * stays in vector registers. gcc needs the loops over the rows of the tile
 * fully unrolled (DT__GEMM_UNROLL); clang unrolls and vectorises those loops
 * best on its own, but when it also unrolls the loop over k (as it does when
 * tuning for some CPUs, e.g. -march=znver3) the tile falls back to memory
 * and speed drops by 2.5x, hence DT__GEMM_KLOOP. */
#if defined(__clang__)
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP _Pragma("clang loop unroll(disable)")
#elif defined(__GNUC__) && __GNUC__ >= 8
#  define DT__GEMM_UNROLL _Pragma("GCC unroll 16")
#  define DT__GEMM_KLOOP
#else
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP
#endif

#if DT__GEMM_MC % 24 != 0 || DT__GEMM_NC % 48 != 0
#  error "dt_gemm.c: MC must be a multiple of 6 and 8, NC of 8, 12 and 16"
#endif

/* One path: its tile, micro-kernel and packing routines.
 *   kernel   C[r][j] = alpha * sum_p ap[p*mr + r] * bp[p*nr + j] + beta * C[r][j]
 *            over a whole mr x nr tile; C is not read when beta == 0.
 *   pack_a   rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) into mr-tall
 *            slivers: ap[s*mr*kc + p*mr + r] = op(A)[i0+s*mr+r][p0+p], zero
 *            past mc.
 *   pack_b   rows [p0, p0+kc) x cols [j0, j0+nc) of op(B) into nr-wide
 *            slivers: bp[s*nr*kc + p*nr + j] = op(B)[p0+p][j0+s*nr+j], zero
 *            past nc. */
typedef void (*dt__gemm_kernel_fn)(int64_t kc, const float *ap, const float *bp, float alpha, float beta, float *c,
                                   int64_t ldc);
typedef void (*dt__gemm_pack_fn)(int trans, const float *x, int64_t ld, int64_t r0, int64_t c0, int64_t rows,
                                 int64_t cols, float *dst);
typedef struct dt__gemm_path {
  int mr, nr;
  dt__gemm_kernel_fn kernel;
  dt__gemm_kernel_fn kernel4; /* the first 4 rows of a tile into C, or NULL */
  dt__gemm_pack_fn pack_a, pack_b;
  const char *name;
} dt__gemm_path;

/* ---- portable packing and kernel ------------------------------------------------------ */

/* Generic packing for an mr-tall A sliver layout. op(A)[i][p] is a[i*lda + p],
 * or a[p*lda + i] when transposed. */
static void dt__gemm_pack_a_n(int mr, int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                              int64_t kc, float *DT__RESTRICT ap) {
  for (int64_t s = 0; s < mc; s += mr) {
    int64_t rows = DT__MIN(mr, mc - s);
    if (!trans) {
      for (int64_t r = 0; r < rows; r++) {
        const float *src = a + (i0 + s + r) * lda + p0;
        for (int64_t p = 0; p < kc; p++) ap[p * mr + r] = src[p];
      }
    } else {
      for (int64_t p = 0; p < kc; p++) {
        const float *src = a + (p0 + p) * lda + i0 + s;
        for (int64_t r = 0; r < rows; r++) ap[p * mr + r] = src[r];
      }
    }
    for (int64_t r = rows; r < mr; r++)
      for (int64_t p = 0; p < kc; p++) ap[p * mr + r] = 0.0f;
    ap += mr * kc;
  }
}

/* Generic packing for an nr-wide B sliver layout. op(B)[p][j] is
 * b[p*ldb + j], or b[j*ldb + p] when transposed. */
static void dt__gemm_pack_b_n(int nr, int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                              int64_t nc, float *DT__RESTRICT bp) {
  for (int64_t s = 0; s < nc; s += nr) {
    int64_t cols = DT__MIN(nr, nc - s);
    if (!trans) {
      for (int64_t p = 0; p < kc; p++) {
        const float *src = b + (p0 + p) * ldb + j0 + s;
        float *dst = bp + p * nr;
        int64_t j = 0;
        for (; j < cols; j++) dst[j] = src[j];
        for (; j < nr; j++) dst[j] = 0.0f;
      }
    } else {
      for (int64_t j = 0; j < cols; j++) {
        const float *src = b + (j0 + s + j) * ldb + p0;
        for (int64_t p = 0; p < kc; p++) bp[p * nr + j] = src[p];
      }
      for (int64_t j = cols; j < nr; j++)
        for (int64_t p = 0; p < kc; p++) bp[p * nr + j] = 0.0f;
    }
    bp += nr * kc;
  }
}

static void dt__gemm_pack_a_c(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc, int64_t kc,
                              float *ap) {
  dt__gemm_pack_a_n(DT__GEMM_MR, trans, a, lda, i0, p0, mc, kc, ap);
}

static void dt__gemm_pack_b_c(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc, int64_t nc,
                              float *bp) {
  dt__gemm_pack_b_n(DT__GEMM_NR, trans, b, ldb, p0, j0, kc, nc, bp);
}

/* The portable micro-kernel: the accumulator tile is a local array that
 * gcc and clang keep in vector registers. Accumulates in increasing p. */
static void dt__gemm_micro_c(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp, float alpha,
                             float beta, float *DT__RESTRICT c, int64_t ldc) {
  float acc[DT__GEMM_MR][DT__GEMM_NR];
  DT__GEMM_UNROLL
  for (int r = 0; r < DT__GEMM_MR; r++)
    for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] = 0.0f;
  DT__GEMM_KLOOP
  for (int64_t p = 0; p < kc; p++) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++) {
      float av = ap[r];
      for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] += av * bp[j];
    }
    ap += DT__GEMM_MR;
    bp += DT__GEMM_NR;
  }
  if (beta == 0.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j];
  } else if (beta == 1.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] += alpha * acc[r][j];
  } else {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j] + beta * c[r * ldc + j];
  }
}

/* ---- AVX2 + FMA (x86-64, chosen at run time) --------------------------------------------
 * A 6x16 tile: 12 ymm accumulators, two B vectors and one broadcast A value
 * per k step (12 FMAs for 2 loads and 6 broadcasts). */
#ifdef DT__GEMM_X86

#define DT__AVX_FMA2(r)                                          \
  do {                                                           \
    __m256 a_ = _mm256_broadcast_ss(ap + (r));                   \
    c##r##0 = _mm256_fmadd_ps(a_, b0, c##r##0);                  \
    c##r##1 = _mm256_fmadd_ps(a_, b1, c##r##1);                  \
  } while (0)

/* One row of the tile: c[r] = alpha*acc (+ beta*c[r]). */
#define DT__AVX_STORE(r)                                                                            \
  do {                                                                                              \
    float *cr_ = c + (r) * ldc;                                                                     \
    if (beta == 0.0f) {                                                                             \
      _mm256_storeu_ps(cr_, _mm256_mul_ps(va, c##r##0));                                            \
      _mm256_storeu_ps(cr_ + 8, _mm256_mul_ps(va, c##r##1));                                        \
    } else if (beta == 1.0f) {                                                                      \
      _mm256_storeu_ps(cr_, _mm256_fmadd_ps(va, c##r##0, _mm256_loadu_ps(cr_)));                    \
      _mm256_storeu_ps(cr_ + 8, _mm256_fmadd_ps(va, c##r##1, _mm256_loadu_ps(cr_ + 8)));            \
    } else {                                                                                        \
      _mm256_storeu_ps(cr_, _mm256_fmadd_ps(va, c##r##0, _mm256_mul_ps(vb, _mm256_loadu_ps(cr_)))); \
      _mm256_storeu_ps(cr_ + 8,                                                                     \
                       _mm256_fmadd_ps(va, c##r##1, _mm256_mul_ps(vb, _mm256_loadu_ps(cr_ + 8))));  \
    }                                                                                               \
  } while (0)

DT__GEMM_AVX2 static void dt__gemm_micro_avx2(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                              float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps();
  __m256 c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps();
  __m256 c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int r = 0; r < 6; r++) { /* C is needed at the end: start fetching it now */
    _mm_prefetch((const char *)(c + r * ldc), _MM_HINT_T0);
    _mm_prefetch((const char *)(c + r * ldc + 15), _MM_HINT_T0);
  }
  for (int64_t p = 0; p < kc; p++) {
    __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
    DT__AVX_FMA2(0);
    DT__AVX_FMA2(1);
    DT__AVX_FMA2(2);
    DT__AVX_FMA2(3);
    DT__AVX_FMA2(4);
    DT__AVX_FMA2(5);
    ap += 6;
    bp += 16;
  }
  __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  DT__AVX_STORE(0);
  DT__AVX_STORE(1);
  DT__AVX_STORE(2);
  DT__AVX_STORE(3);
  DT__AVX_STORE(4);
  DT__AVX_STORE(5);
}

/* The first 4 rows of a 6x16 tile (the slivers stay 6 tall): the edge tile
 * of the 64-row batches of training steps (64 = 10 x 6 + 4), written
 * straight to C like a full tile, with the same arithmetic per element. */
DT__GEMM_AVX2 static void dt__gemm_micro4_avx2(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp,
                                               float alpha, float beta, float *DT__RESTRICT c, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps();
  __m256 c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  for (int64_t p = 0; p < kc; p++) {
    __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
    DT__AVX_FMA2(0);
    DT__AVX_FMA2(1);
    DT__AVX_FMA2(2);
    DT__AVX_FMA2(3);
    ap += 6;
    bp += 16;
  }
  __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  DT__AVX_STORE(0);
  DT__AVX_STORE(1);
  DT__AVX_STORE(2);
  DT__AVX_STORE(3);
}

/* In-register transpose of 8 rows of 8: on return r[p] holds column p. */
#define DT__AVX_T8(r)                                                                          \
  do {                                                                                         \
    __m256 t0_ = _mm256_unpacklo_ps(r[0], r[1]), t1_ = _mm256_unpackhi_ps(r[0], r[1]);         \
    __m256 t2_ = _mm256_unpacklo_ps(r[2], r[3]), t3_ = _mm256_unpackhi_ps(r[2], r[3]);         \
    __m256 t4_ = _mm256_unpacklo_ps(r[4], r[5]), t5_ = _mm256_unpackhi_ps(r[4], r[5]);         \
    __m256 t6_ = _mm256_unpacklo_ps(r[6], r[7]), t7_ = _mm256_unpackhi_ps(r[6], r[7]);         \
    __m256 u0_ = _mm256_shuffle_ps(t0_, t2_, 0x44), u1_ = _mm256_shuffle_ps(t0_, t2_, 0xEE);   \
    __m256 u2_ = _mm256_shuffle_ps(t1_, t3_, 0x44), u3_ = _mm256_shuffle_ps(t1_, t3_, 0xEE);   \
    __m256 u4_ = _mm256_shuffle_ps(t4_, t6_, 0x44), u5_ = _mm256_shuffle_ps(t4_, t6_, 0xEE);   \
    __m256 u6_ = _mm256_shuffle_ps(t5_, t7_, 0x44), u7_ = _mm256_shuffle_ps(t5_, t7_, 0xEE);   \
    r[0] = _mm256_permute2f128_ps(u0_, u4_, 0x20);                                             \
    r[1] = _mm256_permute2f128_ps(u1_, u5_, 0x20);                                             \
    r[2] = _mm256_permute2f128_ps(u2_, u6_, 0x20);                                             \
    r[3] = _mm256_permute2f128_ps(u3_, u7_, 0x20);                                             \
    r[4] = _mm256_permute2f128_ps(u0_, u4_, 0x31);                                             \
    r[5] = _mm256_permute2f128_ps(u1_, u5_, 0x31);                                             \
    r[6] = _mm256_permute2f128_ps(u2_, u6_, 0x31);                                             \
    r[7] = _mm256_permute2f128_ps(u3_, u7_, 0x31);                                             \
  } while (0)

/* 6-tall A slivers. Untransposed A: 8 columns of 6 rows at a time through an
 * 8x8 transpose; each 6-float column is stored with an 8-float store whose
 * 2 extra zeros the next store overwrites (the panel has slack for the last). */
DT__GEMM_AVX2 static void dt__gemm_pack_a_avx2(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0,
                                               int64_t mc, int64_t kc, float *ap) {
  int64_t full = mc - mc % 6;
  if (!trans) {
    for (int64_t s = 0; s < full; s += 6, ap += 6 * kc) {
      const float *src = a + (i0 + s) * lda + p0;
      int64_t p = 0;
      for (; p + 8 <= kc; p += 8) {
        __m256 r[8];
        for (int i = 0; i < 6; i++) r[i] = _mm256_loadu_ps(src + i * lda + p);
        r[6] = r[7] = _mm256_setzero_ps();
        DT__AVX_T8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(ap + (p + i) * 6, r[i]);
      }
      for (; p < kc; p++)
        for (int i = 0; i < 6; i++) ap[p * 6 + i] = src[i * lda + p];
    }
  } else {
    for (int64_t s = 0; s < full; s += 6, ap += 6 * kc) {
      const float *src = a + p0 * lda + i0 + s;
      for (int64_t p = 0; p < kc; p++) {
        const float *x = src + p * lda;
        float *d = ap + p * 6;
        _mm_storeu_ps(d, _mm_loadu_ps(x));
        d[4] = x[4];
        d[5] = x[5];
      }
    }
  }
  if (full < mc) dt__gemm_pack_a_n(6, trans, a, lda, i0 + full, p0, mc - full, kc, ap);
}

/* 16-wide B slivers. Transposed B (rows of op(B)^T contiguous in p): two
 * 8x8 transposes per 8 values of p. */
DT__GEMM_AVX2 static void dt__gemm_pack_b_avx2(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0,
                                               int64_t kc, int64_t nc, float *bp) {
  int64_t full = nc - nc % 16;
  if (!trans) {
    for (int64_t s = 0; s < full; s += 16, bp += 16 * kc) {
      const float *src = b + p0 * ldb + j0 + s;
      for (int64_t p = 0; p < kc; p++) {
        _mm256_storeu_ps(bp + p * 16, _mm256_loadu_ps(src + p * ldb));
        _mm256_storeu_ps(bp + p * 16 + 8, _mm256_loadu_ps(src + p * ldb + 8));
      }
    }
  } else {
    for (int64_t s = 0; s < full; s += 16, bp += 16 * kc) {
      const float *src = b + (j0 + s) * ldb + p0;
      int64_t p = 0;
      for (; p + 8 <= kc; p += 8) {
        for (int h = 0; h < 2; h++) {
          __m256 r[8];
          for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (8 * h + i) * ldb + p);
          DT__AVX_T8(r);
          for (int i = 0; i < 8; i++) _mm256_storeu_ps(bp + (p + i) * 16 + 8 * h, r[i]);
        }
      }
      for (; p < kc; p++)
        for (int j = 0; j < 16; j++) bp[p * 16 + j] = src[j * ldb + p];
    }
  }
  if (full < nc) dt__gemm_pack_b_n(16, trans, b, ldb, p0, j0 + full, kc, nc - full, bp);
}

/* C = alpha * A @ B^T + beta * C (A untransposed, B transposed) without
 * packing, for products with few columns (n < 32, less than two B slivers),
 * where packing both operands costs as much as the product and the 16-wide
 * tile would be mostly padding (the weight gradient of a first convolution
 * layer: 32 x 25 x 784). Rows of A and rows of B^T are both contiguous in
 * p, so each element is a dot product: 8 lanes of FMAs over p in steps of 8,
 * the lanes summed in a fixed tree, the remaining p added by scalar FMAs in
 * order, then alpha and beta. Every element gets exactly these operations
 * wherever it sits, so results do not depend on how rows are blocked or
 * split over threads. Blocks of 3 rows x 4 columns, columns outside; a
 * partial block repeats its last row or column and stores only the valid
 * ones. */
DT__GEMM_AVX2 static void dt__gemm_dot_avx2(int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                                            int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                            int64_t ldc) {
  int64_t k8 = k - k % 8;
  for (int64_t j0 = 0; j0 < n; j0 += 4) { /* 4 rows of B^T stay in L1 while A streams past */
    int64_t nr = DT__MIN(4, n - j0);
    const float *br[4];
    for (int j = 0; j < 4; j++) br[j] = b + (j0 + DT__MIN(j, nr - 1)) * ldb;
    for (int64_t i0 = 0; i0 < m; i0 += 3) {
      int64_t mr = DT__MIN(3, m - i0);
      const float *ar[3];
      for (int r = 0; r < 3; r++) ar[r] = a + (i0 + DT__MIN(r, mr - 1)) * lda;
      /* Twelve named accumulators (an array would live in memory). */
      __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c02 = _mm256_setzero_ps();
      __m256 c03 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
      __m256 c12 = _mm256_setzero_ps(), c13 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps();
      __m256 c21 = _mm256_setzero_ps(), c22 = _mm256_setzero_ps(), c23 = _mm256_setzero_ps();
      for (int64_t p = 0; p < k8; p += 8) {
        __m256 a0 = _mm256_loadu_ps(ar[0] + p), a1 = _mm256_loadu_ps(ar[1] + p), a2 = _mm256_loadu_ps(ar[2] + p), bv;
#define DT__DOT_COL(j)                         \
  bv = _mm256_loadu_ps(br[j] + p);             \
  c0##j = _mm256_fmadd_ps(a0, bv, c0##j);      \
  c1##j = _mm256_fmadd_ps(a1, bv, c1##j);      \
  c2##j = _mm256_fmadd_ps(a2, bv, c2##j)
        DT__DOT_COL(0);
        DT__DOT_COL(1);
        DT__DOT_COL(2);
        DT__DOT_COL(3);
#undef DT__DOT_COL
      }
      __m256 acc[3][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
      for (int64_t r = 0; r < mr; r++) {
        for (int64_t j = 0; j < nr; j++) {
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r][j]), _mm256_extractf128_ps(acc[r][j], 1));
          h = _mm_add_ps(h, _mm_movehl_ps(h, h));
          h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
          for (int64_t p = k8; p < k; p++) h = _mm_fmadd_ss(_mm_set_ss(ar[r][p]), _mm_set_ss(br[j][p]), h);
          float v = _mm_cvtss_f32(h), *cp = c + (i0 + r) * ldc + j0 + j;
          if (beta == 0.0f) *cp = alpha * v;
          else if (beta == 1.0f) *cp += alpha * v;
          else *cp = alpha * v + beta * *cp;
        }
      }
    }
  }
}

#undef DT__AVX_T8
#undef DT__AVX_FMA2
#undef DT__AVX_STORE

/* 1 when the CPU (and OS) support AVX2 and FMA. */
static int dt__gemm_x86_has_avx2(void) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif /* DT__GEMM_X86 */

/* ---- NEON (aarch64) ----------------------------------------------------------------------
 * An 8x12 tile: 24 q-register accumulators, three B vectors and two A
 * vectors per k step, lane FMAs. */
#ifdef DT__GEMM_NEON
static void dt__gemm_micro_neon(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp, float alpha,
                                float beta, float *DT__RESTRICT c, int64_t ldc) {
  float32x4_t acc[8][3];
  for (int r = 0; r < 8; r++)
    for (int j = 0; j < 3; j++) acc[r][j] = vdupq_n_f32(0.0f);
  for (int64_t p = 0; p < kc; p++) {
    float32x4_t a0 = vld1q_f32(ap), a1 = vld1q_f32(ap + 4);
    float32x4_t b0 = vld1q_f32(bp), b1 = vld1q_f32(bp + 4), b2 = vld1q_f32(bp + 8);
#define DT__NEON_ROW(r, av, lane)                         \
  acc[r][0] = vfmaq_laneq_f32(acc[r][0], b0, av, lane); \
  acc[r][1] = vfmaq_laneq_f32(acc[r][1], b1, av, lane); \
  acc[r][2] = vfmaq_laneq_f32(acc[r][2], b2, av, lane)
    DT__NEON_ROW(0, a0, 0);
    DT__NEON_ROW(1, a0, 1);
    DT__NEON_ROW(2, a0, 2);
    DT__NEON_ROW(3, a0, 3);
    DT__NEON_ROW(4, a1, 0);
    DT__NEON_ROW(5, a1, 1);
    DT__NEON_ROW(6, a1, 2);
    DT__NEON_ROW(7, a1, 3);
#undef DT__NEON_ROW
    ap += 8;
    bp += 12;
  }
  float32x4_t va = vdupq_n_f32(alpha), vb = vdupq_n_f32(beta);
  for (int r = 0; r < 8; r++) {
    float *cr = c + r * ldc;
    for (int j = 0; j < 3; j++) {
      float32x4_t v = vmulq_f32(va, acc[r][j]);
      if (beta == 1.0f) v = vaddq_f32(v, vld1q_f32(cr + 4 * j));
      else if (beta != 0.0f) v = vfmaq_f32(v, vb, vld1q_f32(cr + 4 * j));
      vst1q_f32(cr + 4 * j, v);
    }
  }
}

static void dt__gemm_pack_a_neon(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                                 int64_t kc, float *ap) {
  dt__gemm_pack_a_n(8, trans, a, lda, i0, p0, mc, kc, ap);
}

static void dt__gemm_pack_b_neon(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                                 int64_t nc, float *bp) {
  dt__gemm_pack_b_n(12, trans, b, ldb, p0, j0, kc, nc, bp);
}
#endif /* DT__GEMM_NEON */

/* ---- path selection ----------------------------------------------------------------------- */

static const dt__gemm_path dt__gemm_paths[3] = {
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#ifdef DT__GEMM_X86
    {6, 16, dt__gemm_micro_avx2, dt__gemm_micro4_avx2, dt__gemm_pack_a_avx2, dt__gemm_pack_b_avx2, "avx2+fma"},
#else
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#endif
#ifdef DT__GEMM_NEON
    {8, 12, dt__gemm_micro_neon, NULL, dt__gemm_pack_a_neon, dt__gemm_pack_b_neon, "neon"},
#else
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#endif
};

/* The best path this build and CPU have (ignoring any override). */
static int dt__gemm_best_path(void) {
#if defined(DT__GEMM_X86)
  return dt__gemm_x86_has_avx2() ? DT__GEMM_PATH_AVX2 : DT__GEMM_PORTABLE;
#elif defined(DT__GEMM_NEON)
  return DT__GEMM_PATH_NEON;
#else
  return DT__GEMM_PORTABLE;
#endif
}

/* The chosen path, +1 (0: not chosen yet), and the override (-1: none yet
 * read, 0: best, 1: portable). Each is a plain int written with the same
 * value by whichever thread gets there first, through atomic builtins where
 * the compiler has them so that concurrent first calls are race-free. */
static int dt__gemm_chosen = 0;
static int dt__gemm_override = -1;

#if defined(__GNUC__) || defined(__clang__)
#  define DT__GEMM_LOAD(v) __atomic_load_n(&(v), __ATOMIC_ACQUIRE)
#  define DT__GEMM_STORE(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELEASE)
#else
#  define DT__GEMM_LOAD(v) (v)
#  define DT__GEMM_STORE(v, x) ((v) = (x))
#endif

static int dt__gemm_path_id(void) {
  int c = DT__GEMM_LOAD(dt__gemm_chosen);
  if (c > 0) return c - 1;
  int ov = DT__GEMM_LOAD(dt__gemm_override);
  if (ov < 0) {
    const char *e = getenv("DTRAIN_GEMM");
    ov = (e && strcmp(e, "portable") == 0) ? 1 : 0;
    DT__GEMM_STORE(dt__gemm_override, ov);
  }
  c = ov ? DT__GEMM_PORTABLE : dt__gemm_best_path();
  DT__GEMM_STORE(dt__gemm_chosen, c + 1);
  return c;
}

DTRAIN_API int dt_sgemm_use_portable(int on) {
  (void)dt__gemm_path_id(); /* reads DTRAIN_GEMM once */
  int prev = DT__GEMM_LOAD(dt__gemm_override);
  DT__GEMM_STORE(dt__gemm_override, on ? 1 : 0);
  DT__GEMM_STORE(dt__gemm_chosen, 0);
  return prev;
}

DTRAIN_API const char *dt_sgemm_kernel(void) {
#ifdef DTRAIN_USE_CBLAS
  return "cblas";
#else
  return dt__gemm_paths[dt__gemm_path_id()].name;
#endif
}

/* ---- driver ------------------------------------------------------------------------------- */

/* C = beta * C over m x n (C not read when beta == 0): the k == 0 or
 * alpha == 0 case, where op(A) @ op(B) contributes nothing. */
static void dt__gemm_scale(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    float *ci = c + i * ldc;
    if (beta == 0.0f)
      for (int64_t j = 0; j < n; j++) ci[j] = 0.0f;
    else if (beta != 1.0f)
      for (int64_t j = 0; j < n; j++) ci[j] *= beta;
  }
}

/* A partial tile (mr < MR or nr < NR): run the kernel into a local tile,
 * then apply it to the valid mr x nr corner of C. */
static void dt__gemm_edge(const dt__gemm_path *pa, int64_t kc, const float *ap, const float *bp, float alpha,
                          float beta, float *c, int64_t ldc, int64_t mr, int64_t nr) {
  float t[DT__GEMM_TILE_MAX];
  pa->kernel(kc, ap, bp, 1.0f, 0.0f, t, pa->nr);
  for (int64_t r = 0; r < mr; r++) {
    float *cr = c + r * ldc;
    const float *tr = t + r * pa->nr;
    if (beta == 0.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j];
    else if (beta == 1.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] += alpha * tr[j];
    else
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j] + beta * cr[j];
  }
}

/* One packed A block (mc x kc) times one packed B panel (kc x nc) into C:
 * the loops over the tiles, B slivers outside (one stays in L1 while the
 * A slivers stream past it). */
static void dt__gemm_macro(const dt__gemm_path *pa, int64_t mc, int64_t nc, int64_t kc, float alpha, const float *ap,
                           const float *bp, float beta, float *c, int64_t ldc) {
  const int64_t MR = pa->mr, NR = pa->nr;
  for (int64_t jr = 0; jr < nc; jr += NR) {
    int64_t nr = DT__MIN(NR, nc - jr);
    const float *bs = bp + jr * kc;
    for (int64_t ir = 0; ir < mc; ir += MR) {
      int64_t mr = DT__MIN(MR, mc - ir);
      const float *as = ap + ir * kc;
      float *cs = c + ir * ldc + jr;
      if (mr == MR && nr == NR)
        pa->kernel(kc, as, bs, alpha, beta, cs, ldc);
      else if (mr == 4 && nr == NR && pa->kernel4)
        pa->kernel4(kc, as, bs, alpha, beta, cs, ldc);
      else
        dt__gemm_edge(pa, kc, as, bs, alpha, beta, cs, ldc, mr, nr);
    }
  }
}

/* The blocked product on one thread (m, n, k > 0, alpha != 0). */
static void dt__gemm_run(const dt__gemm_path *pa, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                         int64_t ldc) {
  const int64_t MR = pa->mr, NR = pa->nr;
  /* The packed panels share one buffer on the stack, aligned by hand to
   * 64 bytes: an A block of MC x KC and a B panel of KC x NC, or, when A
   * has few rows (up to 2 MC) and B is wider than NC, all of A's rows and
   * a B panel as wide as the rest allows (A is then packed once per k
   * block instead of once per B panel). */
  /* + one more B sliver's worth (see the jc loop), alignment, and slack after A (see pack_a) */
  float buf[DT__GEMM_BUF + DT__GEMM_KC * DT__GEMM_NR_MAX + 48];
  float *ap = buf + ((16 - ((uintptr_t)buf / sizeof(float)) % 16) % 16);
  int64_t mcb = DT__GEMM_MC, ncb = DT__GEMM_NC;
  int few_rows = n > DT__GEMM_NC && m <= 2 * DT__GEMM_MC;
  if (few_rows) {
    mcb = (m + MR - 1) / MR * MR;
    ncb = (DT__GEMM_BUF - mcb * DT__GEMM_KC) / DT__GEMM_KC / NR * NR;
  }
  float *bp = ap + mcb * DT__GEMM_KC + 16;

  /* The order of the loops does not change any result: every element of C
   * is summed over the same k blocks in the same order. */
  if (few_rows) { /* pack A once per k block, then B panels in turn */
    for (int64_t pc = 0; pc < k; pc += DT__GEMM_KC) {
      int64_t kc = DT__MIN(DT__GEMM_KC, k - pc);
      float beta_blk = pc == 0 ? beta : 1.0f;
      pa->pack_a(trans_a, a, lda, 0, pc, m, kc, ap);
      for (int64_t jc = 0; jc < n; jc += ncb) {
        int64_t nc = DT__MIN(ncb, n - jc);
        pa->pack_b(trans_b, b, ldb, pc, jc, kc, nc, bp);
        dt__gemm_macro(pa, m, nc, kc, alpha, ap, bp, beta_blk, c + jc, ldc);
      }
    }
    return;
  }
  for (int64_t jc = 0, nc; jc < n; jc += nc) {
    /* A last panel of at most one sliver joins this one: A is packed once
     * per panel, so a 196-wide B would pack all of A twice for 4 columns. */
    nc = n - jc <= ncb + NR ? n - jc : ncb;
    for (int64_t pc = 0; pc < k; pc += DT__GEMM_KC) {
      int64_t kc = DT__MIN(DT__GEMM_KC, k - pc);
      float beta_blk = pc == 0 ? beta : 1.0f; /* later k blocks add to C */
      pa->pack_b(trans_b, b, ldb, pc, jc, kc, nc, bp);
      for (int64_t ic = 0; ic < m; ic += mcb) {
        int64_t mc = DT__MIN(mcb, m - ic);
        pa->pack_a(trans_a, a, lda, ic, pc, mc, kc, ap);
        dt__gemm_macro(pa, mc, nc, kc, alpha, ap, bp, beta_blk, c + ic * ldc + jc, ldc);
      }
    }
  }
}

/* ---- intra-op threads ---------------------------------------------------------------------
 * C is cut into blocks of whole tiles, along the rows when op(A) has more
 * row tiles than op(B) has column tiles, else along the columns, and each
 * thread runs the one-thread product on its block. The cuts fall on
 * multiples of MR (rows) or NR (columns) from 0, so each tile of C is the
 * same tile (full, 4-row or edge) with the same k blocks as in the whole
 * product: every element is computed by exactly one thread, bit for bit as
 * with one thread. */
#define DT__GEMM_PAR_MIN ((double)(1 << 20)) /* multiply-adds below which one thread is faster */

typedef struct dt__gemm_job {
  const dt__gemm_path *pa;
  int trans_a, trans_b, by_rows, dot;
  int64_t m, n, k, lda, ldb, ldc, tiles;
  float alpha, beta;
  const float *a, *b;
  float *c;
} dt__gemm_job;

static void dt__gemm_part(void *arg, int part, int nparts) {
  const dt__gemm_job *j = (const dt__gemm_job *)arg;
  int64_t t0 = j->tiles * part / nparts, t1 = j->tiles * (part + 1) / nparts;
  if (t0 >= t1) return;
#ifdef DT__GEMM_X86
  if (j->dot) { /* blocks of 3 rows */
    int64_t i0 = t0 * 3, i1 = DT__MIN(j->m, t1 * 3);
    dt__gemm_dot_avx2(i1 - i0, j->n, j->k, j->alpha, j->a + i0 * j->lda, j->lda, j->b, j->ldb, j->beta,
                      j->c + i0 * j->ldc, j->ldc);
    return;
  }
#endif
  if (j->by_rows) {
    int64_t i0 = t0 * j->pa->mr, i1 = DT__MIN(j->m, t1 * j->pa->mr);
    const float *a = j->trans_a ? j->a + i0 : j->a + i0 * j->lda;
    dt__gemm_run(j->pa, j->trans_a, j->trans_b, i1 - i0, j->n, j->k, j->alpha, a, j->lda, j->b, j->ldb, j->beta,
                 j->c + i0 * j->ldc, j->ldc);
  } else {
    int64_t c0 = t0 * j->pa->nr, c1 = DT__MIN(j->n, t1 * j->pa->nr);
    const float *b = j->trans_b ? j->b + c0 * j->ldb : j->b + c0;
    dt__gemm_run(j->pa, j->trans_a, j->trans_b, j->m, c1 - c0, j->k, j->alpha, j->a, j->lda, b, j->ldb, j->beta,
                 j->c + c0, j->ldc);
  }
}

DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                         float beta, float *c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
#ifdef DTRAIN_USE_CBLAS
  /* BLAS, like this kernel, never reads C when beta == 0. Sizes beyond int
   * (not reachable with the arena's limits) fall through to the C kernel. */
  if (m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX) {
    if (k <= 0) {
      dt__gemm_scale(m, n, beta, c, ldc);
      return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)m,
                (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
    return;
  }
#endif
  if (k <= 0 || alpha == 0.0f) {
    dt__gemm_scale(m, n, beta, c, ldc);
    return;
  }
  int path = dt__gemm_path_id();
  const dt__gemm_path *pa = &dt__gemm_paths[path];
  /* Few columns of A @ B^T: the unpacked dot-product kernel (AVX2 path). */
  int dot = path == DT__GEMM_PATH_AVX2 && !trans_a && trans_b && n < 32 && k >= 16;
  int threads = (double)m * (double)n * (double)k >= DT__GEMM_PAR_MIN ? dt__par_threads() : 1;
  if (threads > 1 || dot) {
    dt__gemm_job j;
    int64_t tiles_m = (m + pa->mr - 1) / pa->mr, tiles_n = (n + pa->nr - 1) / pa->nr;
    j.pa = pa;
    j.trans_a = trans_a;
    j.trans_b = trans_b;
    j.dot = dot;
    j.by_rows = dot || tiles_m > tiles_n;
    j.tiles = dot ? (m + 2) / 3 : j.by_rows ? tiles_m : tiles_n;
    j.m = m;
    j.n = n;
    j.k = k;
    j.lda = lda;
    j.ldb = ldb;
    j.ldc = ldc;
    j.alpha = alpha;
    j.beta = beta;
    j.a = a;
    j.b = b;
    j.c = c;
    int parts = (int)DT__MIN((int64_t)threads, j.tiles);
    if (parts > 1) {
      dt__par_run(parts, dt__gemm_part, &j);
      return;
    }
    if (dot) {
      dt__gemm_part(&j, 0, 1);
      return;
    }
  }
  dt__gemm_run(pa, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

#undef DT__GEMM_MR
#undef DT__GEMM_NR
#undef DT__GEMM_KC
#undef DT__GEMM_MC
#undef DT__GEMM_NC
#undef DT__GEMM_TILE_MAX
#undef DT__GEMM_NR_MAX
#undef DT__GEMM_PAR_MIN
#undef DT__GEMM_BUF
#undef DT__GEMM_UNROLL
#undef DT__GEMM_KLOOP
#undef DT__GEMM_PORTABLE
#undef DT__GEMM_PATH_AVX2
#undef DT__GEMM_PATH_NEON
#undef DT__GEMM_LOAD
#undef DT__GEMM_STORE
#ifdef DT__GEMM_X86
#  undef DT__GEMM_X86
#  undef DT__GEMM_AVX2
#endif
#ifdef DT__GEMM_NEON
#  undef DT__GEMM_NEON
#endif
/* ======== end dt_gemm.c ======== */

/* ======== begin dt_ops_elem.c ======== */
/* ===========================================================================
 * dt_ops_elem.c -- elementwise ops: broadcasting binary ops, scalar ops, unary
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__ELEM_SSE 1
#  include <emmintrin.h>
#endif

/* ---- broadcasting -------------------------------------------------------------------
 * Output shape is the NumPy broadcast of a and b; sa/sb are the element
 * strides of a and b along each output dim (0 where that input is stretched).
 */
typedef struct dt__bcast {
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t sa[DTRAIN_MAX_DIMS], sb[DTRAIN_MAX_DIMS];
} dt__bcast;

static int dt__elem_broadcast(dt_graph *g, const char *op, const dt_tensor *a, const dt_tensor *b, dt__bcast *bc) {
  int nd = DT__MAX(a->ndim, b->ndim);
  int64_t sta[DTRAIN_MAX_DIMS], stb[DTRAIN_MAX_DIMS];
  dt__strides(a, sta);
  dt__strides(b, stb);
  bc->ndim = nd;
  for (int d = 0; d < nd; d++) {
    int ia = d - (nd - a->ndim), ib = d - (nd - b->ndim);
    int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      char s1[96], s2[96];
      dt__fail(g, DTRAIN_ERR_SHAPE, "%s: shapes %s and %s cannot broadcast (dim %d: %lld vs %lld)", op,
               dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2), d, (long long)da, (long long)db);
      return 0;
    }
    bc->shape[d] = DT__MAX(da, db);
    bc->sa[d] = (ia >= 0 && da != 1) ? sta[ia] : 0;
    bc->sb[d] = (ib >= 0 && db != 1) ? stb[ib] : 0;
  }
  return 1;
}

/* Walk every output element i with the matching offsets oa, ob. */
#define DT__BCAST_LOOP(bc, n, BODY)                                        \
  do {                                                                     \
    int64_t idx_[DTRAIN_MAX_DIMS] = {0};                                   \
    int64_t oa = 0, ob = 0;                                                \
    for (int64_t i = 0; i < (n); i++) {                                    \
      BODY;                                                                \
      for (int d_ = (bc)->ndim - 1; d_ >= 0; d_--) {                       \
        idx_[d_]++;                                                        \
        oa += (bc)->sa[d_];                                                \
        ob += (bc)->sb[d_];                                                \
        if (idx_[d_] < (bc)->shape[d_]) break;                             \
        oa -= (bc)->sa[d_] * (bc)->shape[d_];                              \
        ob -= (bc)->sb[d_] * (bc)->shape[d_];                              \
        idx_[d_] = 0;                                                      \
      }                                                                    \
    }                                                                      \
  } while (0)

enum { DT__ADD, DT__SUB, DT__MUL, DT__DIV };

static void dt__binary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  const dt__bcast *bc = (const dt__bcast *)y->aux;
  int kind = (int)y->iaux[0];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  const float *go = y->grad, *ad = a->data, *bd = b->data;
  if (g->err != DTRAIN_OK) return;
  switch (kind) {
    case DT__ADD:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i]; if (gb) gb[ob] += go[i]; });
      break;
    case DT__SUB:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i]; if (gb) gb[ob] -= go[i]; });
      break;
    case DT__MUL:
      DT__BCAST_LOOP(bc, y->size, { if (ga) ga[oa] += go[i] * bd[ob]; if (gb) gb[ob] += go[i] * ad[oa]; });
      break;
    default:
      DT__BCAST_LOOP(bc, y->size, {
        if (ga) ga[oa] += go[i] / bd[ob];
        if (gb) gb[ob] -= go[i] * ad[oa] / (bd[ob] * bd[ob]);
      });
      break;
  }
}

static dt_tensor *dt__binary(dt_graph *g, dt_tensor *a, dt_tensor *b, int kind, const char *op) {
  if (!dt__begin(g, op, 2, a, b)) return NULL;
  if (g->device)
    return dt__dev_binary(g, a, b,
                          kind == DT__ADD   ? DTRAIN_K_ADD
                          : kind == DT__SUB ? DTRAIN_K_SUB
                          : kind == DT__MUL ? DTRAIN_K_MUL
                                            : DTRAIN_K_DIV,
                          op);
  dt__bcast *bc = (dt__bcast *)dt__arena_alloc(g, sizeof(dt__bcast));
  if (!bc || !dt__elem_broadcast(g, op, a, b, bc)) return NULL;
  dt_tensor *y = dt__new(g, op, bc->ndim, bc->shape);
  if (!y) return NULL;
  const float *ad = a->data, *bd = b->data;
  float *yd = y->data;
  int same = dt_same_shape(a, b);
  switch (kind) {
    case DT__ADD:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] + bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] + bd[ob]);
      break;
    case DT__SUB:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] - bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] - bd[ob]);
      break;
    case DT__MUL:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] * bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] * bd[ob]);
      break;
    default:
      if (same) for (int64_t i = 0; i < y->size; i++) yd[i] = ad[i] / bd[i];
      else DT__BCAST_LOOP(bc, y->size, yd[i] = ad[oa] / bd[ob]);
      break;
  }
  y->aux = bc;
  y->iaux[0] = kind;
  dt__record(g, y, op, dt__binary_backward, a, b, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_add(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__ADD, "dt_add"); }
DTRAIN_API dt_tensor *dt_sub(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__SUB, "dt_sub"); }
DTRAIN_API dt_tensor *dt_mul(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__MUL, "dt_mul"); }
DTRAIN_API dt_tensor *dt_div(dt_graph *g, dt_tensor *a, dt_tensor *b) { return dt__binary(g, a, b, DT__DIV, "dt_div"); }

/* ---- unary and scalar ops -------------------------------------------------------------
 * One forward/backward pair, switched on the kind; faux[0] holds the scalar. */
enum {
  DT__U_ADDS, DT__U_MULS, DT__U_POWS, DT__U_RSUBS, DT__U_NEG, DT__U_EXP, DT__U_LOG, DT__U_SQRT,
  DT__U_RELU, DT__U_LRELU, DT__U_SIGMOID, DT__U_TANH, DT__U_GELU
};

#define DT__GELU_C 0.7978845608028654f /* sqrt(2/pi) */
#define DT__GELU_K 0.044715f

/* ReLU forward and backward without branches (a mispredicted branch per
 * element costs more than the whole SSE loop). Same values as the scalar
 * forms: max(x, 0) is x > 0 ? x : 0 (NaN gives 0), and adding the masked
 * gradient adds +0 where x <= 0. */
static void dt__elem_relu(const float *DT__RESTRICT x, float *DT__RESTRICT y, int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_max_ps(_mm_loadu_ps(x + i), z));
#endif
  for (; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void dt__elem_relu_backward(const float *DT__RESTRICT x, const float *DT__RESTRICT go, float *DT__RESTRICT gx,
                                   int64_t n) {
  int64_t i = 0;
#ifdef DT__ELEM_SSE
  const __m128 z = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 keep = _mm_cmpgt_ps(_mm_loadu_ps(x + i), z);
    _mm_storeu_ps(gx + i, _mm_add_ps(_mm_loadu_ps(gx + i), _mm_and_ps(keep, _mm_loadu_ps(go + i))));
  }
#endif
  for (; i < n; i++) gx[i] += x[i] > 0.0f ? go[i] : 0.0f;
}

static void dt__unary_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  const float *go = y->grad, *xd = x->data, *yd = y->data;
  float s = y->faux[0];
  int64_t n = y->size;
  switch ((int)y->iaux[0]) {
    case DT__U_ADDS: for (int64_t i = 0; i < n; i++) gx[i] += go[i]; break;
    case DT__U_MULS: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * s; break;
    case DT__U_POWS: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * s * powf(xd[i], s - 1.0f); break;
    case DT__U_RSUBS:
    case DT__U_NEG: for (int64_t i = 0; i < n; i++) gx[i] -= go[i]; break;
    case DT__U_EXP: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * yd[i]; break;
    case DT__U_LOG: for (int64_t i = 0; i < n; i++) gx[i] += go[i] / xd[i]; break;
    case DT__U_SQRT: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * 0.5f / yd[i]; break;
    case DT__U_RELU: dt__elem_relu_backward(xd, go, gx, n); break;
    case DT__U_LRELU: for (int64_t i = 0; i < n; i++) gx[i] += xd[i] > 0.0f ? go[i] : s * go[i]; break;
    case DT__U_SIGMOID: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * yd[i] * (1.0f - yd[i]); break;
    case DT__U_TANH: for (int64_t i = 0; i < n; i++) gx[i] += go[i] * (1.0f - yd[i] * yd[i]); break;
    case DT__U_GELU:
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i], u = DT__GELU_C * (v + DT__GELU_K * v * v * v);
        float t = tanhf(u);
        float du = DT__GELU_C * (1.0f + 3.0f * DT__GELU_K * v * v);
        gx[i] += go[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
      }
      break;
    default: dt__fail(g, DTRAIN_ERR_INTERNAL, "unary backward: unknown kind %lld", (long long)y->iaux[0]); break;
  }
}

static dt_tensor *dt__unary(dt_graph *g, dt_tensor *x, int kind, float s, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (g->device) { /* the device checks the domain of log, sqrt and pow itself */
    if (kind == DT__U_RELU || kind == DT__U_SIGMOID || kind == DT__U_TANH)
      return dt__dev_unary(g, x, kind == DT__U_RELU ? DTRAIN_K_RELU : kind == DT__U_SIGMOID ? DTRAIN_K_SIGMOID : DTRAIN_K_TANH,
                           op);
    static const int map_fn[] = {DTRAIN_MAP_ADD_SCALAR, DTRAIN_MAP_MUL_SCALAR, DTRAIN_MAP_POW_SCALAR,
                                 DTRAIN_MAP_RSUB_SCALAR, DTRAIN_MAP_NEG, DTRAIN_MAP_EXP};
    int fn = kind == DT__U_LRELU  ? DTRAIN_MAP_LEAKY_RELU
             : kind == DT__U_GELU ? DTRAIN_MAP_GELU
             : kind == DT__U_LOG  ? DTRAIN_MAP_LOG
             : kind == DT__U_SQRT ? DTRAIN_MAP_SQRT
                                  : -1;
    if (kind >= DT__U_ADDS && kind <= DT__U_EXP) fn = map_fn[kind];
    if (fn < 0) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INTERNAL, "%s: no device map for kind %d", op, kind);
    return dt__dev_map(g, x, fn, s, op);
  }
  const float *xd = x->data;
  int64_t n = x->size;
  if (kind == DT__U_LOG || kind == DT__U_SQRT) {
    for (int64_t i = 0; i < n; i++) {
      if (kind == DT__U_LOG ? !(xd[i] > 0.0f) : !(xd[i] >= 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: input element %lld is %g (domain is x %s 0)", op,
                                     (long long)i, (double)xd[i], kind == DT__U_LOG ? ">" : ">=");
    }
  }
  if (kind == DT__U_POWS && s != floorf(s)) {
    for (int64_t i = 0; i < n; i++)
      if (!(xd[i] > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                     "%s: input element %lld is %g; a non-integer power needs x > 0", op,
                                     (long long)i, (double)xd[i]);
  }
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  float *yd = y->data;
  switch (kind) {
    case DT__U_ADDS: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] + s; break;
    case DT__U_MULS: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] * s; break;
    case DT__U_POWS: for (int64_t i = 0; i < n; i++) yd[i] = powf(xd[i], s); break;
    case DT__U_RSUBS: for (int64_t i = 0; i < n; i++) yd[i] = s - xd[i]; break;
    case DT__U_NEG: for (int64_t i = 0; i < n; i++) yd[i] = -xd[i]; break;
    case DT__U_EXP: for (int64_t i = 0; i < n; i++) yd[i] = expf(xd[i]); break;
    case DT__U_LOG: for (int64_t i = 0; i < n; i++) yd[i] = logf(xd[i]); break;
    case DT__U_SQRT: for (int64_t i = 0; i < n; i++) yd[i] = sqrtf(xd[i]); break;
    case DT__U_RELU: dt__elem_relu(xd, yd, n); break;
    case DT__U_LRELU: for (int64_t i = 0; i < n; i++) yd[i] = xd[i] > 0.0f ? xd[i] : s * xd[i]; break;
    case DT__U_SIGMOID:
      /* Stable in both tails: exp of a non-positive number only. */
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i];
        if (v >= 0.0f) yd[i] = 1.0f / (1.0f + expf(-v));
        else { float e = expf(v); yd[i] = e / (1.0f + e); }
      }
      break;
    case DT__U_TANH: for (int64_t i = 0; i < n; i++) yd[i] = tanhf(xd[i]); break;
    case DT__U_GELU:
      for (int64_t i = 0; i < n; i++) {
        float v = xd[i];
        yd[i] = 0.5f * v * (1.0f + tanhf(DT__GELU_C * (v + DT__GELU_K * v * v * v)));
      }
      break;
    default: return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INTERNAL, "%s: unknown kind %d", op, kind);
  }
  y->iaux[0] = kind;
  y->faux[0] = s;
  dt__record(g, y, op, dt__unary_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_add_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_ADDS, s, "dt_add_scalar"); }
DTRAIN_API dt_tensor *dt_mul_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_MULS, s, "dt_mul_scalar"); }
DTRAIN_API dt_tensor *dt_pow_scalar(dt_graph *g, dt_tensor *x, float p) { return dt__unary(g, x, DT__U_POWS, p, "dt_pow_scalar"); }
DTRAIN_API dt_tensor *dt_rsub_scalar(dt_graph *g, dt_tensor *x, float s) { return dt__unary(g, x, DT__U_RSUBS, s, "dt_rsub_scalar"); }
DTRAIN_API dt_tensor *dt_neg(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_NEG, 0.0f, "dt_neg"); }
DTRAIN_API dt_tensor *dt_exp(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_EXP, 0.0f, "dt_exp"); }
DTRAIN_API dt_tensor *dt_log(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_LOG, 0.0f, "dt_log"); }
DTRAIN_API dt_tensor *dt_sqrt(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_SQRT, 0.0f, "dt_sqrt"); }
DTRAIN_API dt_tensor *dt_relu(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_RELU, 0.0f, "dt_relu"); }
DTRAIN_API dt_tensor *dt_leaky_relu(dt_graph *g, dt_tensor *x, float slope) { return dt__unary(g, x, DT__U_LRELU, slope, "dt_leaky_relu"); }
DTRAIN_API dt_tensor *dt_sigmoid(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_SIGMOID, 0.0f, "dt_sigmoid"); }
DTRAIN_API dt_tensor *dt_tanh(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_TANH, 0.0f, "dt_tanh"); }
DTRAIN_API dt_tensor *dt_gelu(dt_graph *g, dt_tensor *x) { return dt__unary(g, x, DT__U_GELU, 0.0f, "dt_gelu"); }

#undef DT__BCAST_LOOP
#undef DT__GELU_C
#undef DT__GELU_K
#ifdef DT__ELEM_SSE
#  undef DT__ELEM_SSE
#endif
/* ======== end dt_ops_elem.c ======== */

/* ======== begin dt_ops_reduce.c ======== */
/* ===========================================================================
 * dt_ops_reduce.c -- reductions: sum and mean, over everything or one axis
 * ===========================================================================
 * Sums are accumulated in double, always in the same order (ascending index
 * along the reduced elements), so results are accurate and deterministic.
 */
/* #include "dt_internal.h" (amalgamated) */

/* Doubles accumulated at once by the axis reduction (stack buffer). */
#define DT__REDUCE_BLOCK 256

/* ---- all elements -> scalar --------------------------------------------------------
 * faux[0] is the scale (1 for sum, 1/size for mean). */

static void dt__reduce_all_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  float v = y->grad[0] * y->faux[0];
  for (int64_t i = 0; i < x->size; i++) gx[i] += v;
}

static dt_tensor *dt__reduce_all(dt_graph *g, dt_tensor *x, int mean, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (g->device) return dt__dev_reduce_all(g, x, mean, op);
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  const float *xd = x->data;
  double acc = 0.0;
  for (int64_t i = 0; i < x->size; i++) acc += (double)xd[i];
  if (mean) acc /= (double)x->size;
  y->data[0] = (float)acc;
  y->faux[0] = mean ? (float)(1.0 / (double)x->size) : 1.0f;
  dt__record(g, y, op, dt__reduce_all_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_sum(dt_graph *g, dt_tensor *x) { return dt__reduce_all(g, x, 0, "dt_sum"); }
DTRAIN_API dt_tensor *dt_mean(dt_graph *g, dt_tensor *x) { return dt__reduce_all(g, x, 1, "dt_mean"); }

/* ---- one axis -------------------------------------------------------------------------
 * x is viewed as [outer, len, inner] with len the reduced dim; y as [outer, inner].
 * iaux: 0 outer, 1 len, 2 inner, 3 mean; faux[0] the scale. */

static void dt__reduce_axis_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t outer = y->iaux[0], len = y->iaux[1], inner = y->iaux[2];
  float s = y->faux[0];
  const float *go = y->grad;
  for (int64_t o = 0; o < outer; o++) {
    const float *gorow = go + o * inner;
    float *gxo = gx + o * len * inner;
    for (int64_t k = 0; k < len; k++) {
      float *gxr = gxo + k * inner;
      for (int64_t i = 0; i < inner; i++) gxr[i] += gorow[i] * s;
    }
  }
}

static dt_tensor *dt__reduce_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim, int mean, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: axis %d out of range for %s (rank %d)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  int64_t shape[DTRAIN_MAX_DIMS] = {0};
  int nd = 0;
  int64_t outer = 1, len = x->shape[ax], inner = 1;
  for (int d = 0; d < x->ndim; d++) {
    if (d < ax) outer *= x->shape[d];
    if (d > ax) inner *= x->shape[d];
    if (d != ax) shape[nd++] = x->shape[d];
    else if (keepdim) shape[nd++] = 1;
  }
  if (g->device) return dt__dev_reduce_axis(g, x, nd, shape, outer, len, inner, mean, op);
  dt_tensor *y = dt__new(g, op, nd, shape);
  if (!y) return NULL;
  const float *xd = x->data;
  float *yd = y->data;
  double dlen = (double)len;
  double acc[DT__REDUCE_BLOCK];
  for (int64_t o = 0; o < outer; o++) {
    const float *xo = xd + o * len * inner;
    for (int64_t i0 = 0; i0 < inner; i0 += DT__REDUCE_BLOCK) {
      int64_t nb = DT__MIN(inner - i0, (int64_t)DT__REDUCE_BLOCK);
      for (int64_t i = 0; i < nb; i++) acc[i] = 0.0;
      for (int64_t k = 0; k < len; k++) {
        const float *xr = xo + k * inner + i0;
        for (int64_t i = 0; i < nb; i++) acc[i] += (double)xr[i];
      }
      float *yr = yd + o * inner + i0;
      for (int64_t i = 0; i < nb; i++) yr[i] = (float)(mean ? acc[i] / dlen : acc[i]);
    }
  }
  y->iaux[0] = outer;
  y->iaux[1] = len;
  y->iaux[2] = inner;
  y->iaux[3] = mean;
  y->faux[0] = mean ? (float)(1.0 / dlen) : 1.0f;
  dt__record(g, y, op, dt__reduce_axis_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_sum_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim) {
  return dt__reduce_axis(g, x, axis, keepdim, 0, "dt_sum_axis");
}

DTRAIN_API dt_tensor *dt_mean_axis(dt_graph *g, dt_tensor *x, int axis, int keepdim) {
  return dt__reduce_axis(g, x, axis, keepdim, 1, "dt_mean_axis");
}

#undef DT__REDUCE_BLOCK
/* ======== end dt_ops_reduce.c ======== */

/* ======== begin dt_ops_shape.c ======== */
/* ===========================================================================
 * dt_ops_shape.c -- shape ops: reshape, flatten, transpose, permute, concat,
 * slice, split
 * ===========================================================================
 * Reshape (and reshape2, flatten) returns a view: no copy, the output's data
 * is the input's data; its gradient is a separate buffer that backward adds
 * into the input's gradient. Every other op here copies.
 */
/* #include "dt_internal.h" (amalgamated) */

/* Tile edge of the blocked 2-D transpose. */
#define DT__SHAPE_TILE 32

/* "[2,3,4]" from a shape array into buf (cap >= 2). */
static const char *dt__shape_fmt(const int64_t *shape, int ndim, char *buf, size_t cap) {
  size_t k = (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < ndim && k < cap; i++)
    k += (size_t)snprintf(buf + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

/* Product of dims [from, to). */
static int64_t dt__shape_prod(const int64_t *shape, int from, int to) {
  int64_t p = 1;
  for (int d = from; d < to; d++) p *= shape[d];
  return p;
}

/* ---- reshape, reshape2, flatten ---------------------------------------------------------- */

/* y and x have the same number of elements in the same order. */
static void dt__shape_same_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  const float *go = y->grad;
  if (g->device) {
    dt__dev_acc(g, gx, go, y->size, y->op);
    return;
  }
  for (int64_t i = 0; i < y->size; i++) gx[i] += go[i];
}

static dt_tensor *dt__shape_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape, const char *op) {
  char s1[96], s2[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: %d dimensions (allowed 0..%d)", op, ndim, DTRAIN_MAX_DIMS);
  if (ndim > 0 && !shape) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", op);
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    s[d] = shape[d];
    if (shape[d] == -1) {
      if (infer >= 0)
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: new shape %s has more than one -1 (dims %d and %d)",
                                     op, dt__shape_fmt(shape, ndim, s2, sizeof s2), infer, d);
      infer = d;
    } else if (shape[d] <= 0) {
      return (dt_tensor *)dt__fail(g, shape[d] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                                   "%s: new shape %s: dimension %d is %lld (must be >= 1, or -1 to infer)", op,
                                   dt__shape_fmt(shape, ndim, s2, sizeof s2), d, (long long)shape[d]);
    }
  }
  /* Product of the known dims; stops growing (and mismatches) once past x->size. */
  int64_t known = 1;
  int fits = 1;
  for (int d = 0; d < ndim && fits; d++) {
    if (d == infer) continue;
    if (known > x->size / s[d]) fits = 0;
    else known *= s[d];
  }
  if (fits && infer >= 0) {
    if (x->size % known != 0) fits = 0;
    else s[infer] = x->size / known;
  } else if (fits && known != x->size) {
    fits = 0;
  }
  if (!fits)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: cannot reshape %s (%lld elements) into %s", op,
                                 dt_shape_str(x, s1, sizeof s1), (long long)x->size,
                                 dt__shape_fmt(shape, ndim, s2, sizeof s2));
  dt_tensor *y = dt__new_view(g, op, ndim, s, x->data);
  if (!y) return NULL;
  dt__record(g, y, op, dt__shape_same_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_reshape(dt_graph *g, dt_tensor *x, int ndim, const int64_t *shape) {
  return dt__shape_reshape(g, x, ndim, shape, "dt_reshape");
}

DTRAIN_API dt_tensor *dt_reshape2(dt_graph *g, dt_tensor *x, int64_t d0, int64_t d1) {
  int64_t s[2];
  s[0] = d0;
  s[1] = d1;
  return dt__shape_reshape(g, x, 2, s, "dt_reshape2");
}

/* [N] -> [N,1]; [N, ...] -> [N, rest]. */
DTRAIN_API dt_tensor *dt_flatten(dt_graph *g, dt_tensor *x) {
  if (!dt__begin(g, "dt_flatten", 1, x)) return NULL;
  if (x->ndim < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_flatten: input is a scalar (needs rank >= 1)");
  int64_t s[2];
  s[0] = x->shape[0];
  s[1] = x->size / x->shape[0];
  return dt__shape_reshape(g, x, 2, s, "dt_flatten");
}

/* ---- transpose ------------------------------------------------------------------------------ */

/* dst (cols x rows) = or += src (rows x cols)^T, in tiles. */
static void dt__shape_transpose2d(const float *src, float *dst, int64_t rows, int64_t cols, int acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += DT__SHAPE_TILE) {
    int64_t r1 = DT__MIN(rows, r0 + DT__SHAPE_TILE);
    for (int64_t c0 = 0; c0 < cols; c0 += DT__SHAPE_TILE) {
      int64_t c1 = DT__MIN(cols, c0 + DT__SHAPE_TILE);
      for (int64_t c = c0; c < c1; c++) {
        float *d = dst + c * rows;
        if (acc) for (int64_t r = r0; r < r1; r++) d[r] += src[r * cols + c];
        else for (int64_t r = r0; r < r1; r++) d[r] = src[r * cols + c];
      }
    }
  }
}

/* iaux: 0 batch, 1 rows (M), 2 cols (N) of the input [..., M, N]. */
static void dt__shape_transpose_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t batch = y->iaux[0], m = y->iaux[1], n = y->iaux[2];
  for (int64_t b = 0; b < batch; b++) dt__shape_transpose2d(y->grad + b * m * n, gx + b * m * n, n, m, 1);
}

DTRAIN_API dt_tensor *dt_transpose(dt_graph *g, dt_tensor *x) {
  if (!dt__begin(g, "dt_transpose", 1, x)) return NULL;
  if (x->ndim < 2) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_transpose: input %s has rank %d (needs >= 2)",
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  int nd = x->ndim;
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) s[d] = x->shape[d];
  s[nd - 2] = x->shape[nd - 1];
  s[nd - 1] = x->shape[nd - 2];
  if (g->device)
    return dt__dev_transpose(g, x, nd, s, dt__shape_prod(x->shape, 0, nd - 2), x->shape[nd - 2], x->shape[nd - 1]);
  dt_tensor *y = dt__new(g, "dt_transpose", nd, s);
  if (!y) return NULL;
  int64_t m = x->shape[nd - 2], n = x->shape[nd - 1], batch = dt__shape_prod(x->shape, 0, nd - 2);
  for (int64_t b = 0; b < batch; b++) dt__shape_transpose2d(x->data + b * m * n, y->data + b * m * n, m, n, 0);
  y->iaux[0] = batch;
  y->iaux[1] = m;
  y->iaux[2] = n;
  dt__record(g, y, "dt_transpose", dt__shape_transpose_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- permute --------------------------------------------------------------------------------
 * iaux[0..ndim) holds the normalised perm. The output is walked in order with
 * the matching input offset; the last output dim is the inner loop. */

static void dt__shape_perm_walk(const dt_tensor *x, const dt_tensor *y, const int64_t *perm, const float *src,
                                float *dst, int backward) {
  int nd = y->ndim;
  if (nd == 0) {
    if (backward) dst[0] += src[0];
    else dst[0] = src[0];
    return;
  }
  int64_t xst[DTRAIN_MAX_DIMS], st[DTRAIN_MAX_DIMS], idx[DTRAIN_MAX_DIMS];
  dt__strides(x, xst);
  for (int d = 0; d < nd; d++) {
    st[d] = xst[perm[d]];
    idx[d] = 0;
  }
  int64_t last = y->shape[nd - 1], ls = st[nd - 1], off = 0;
  for (int64_t i = 0; i < y->size; i += last) {
    /* forward: dst = y, src = x; backward: dst = gx, src = gy */
    if (backward) for (int64_t j = 0; j < last; j++) dst[off + j * ls] += src[i + j];
    else for (int64_t j = 0; j < last; j++) dst[i + j] = src[off + j * ls];
    for (int d = nd - 2; d >= 0; d--) {
      idx[d]++;
      off += st[d];
      if (idx[d] < y->shape[d]) break;
      off -= st[d] * y->shape[d];
      idx[d] = 0;
    }
  }
}

static void dt__shape_permute_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  dt__shape_perm_walk(x, y, y->iaux, y->grad, gx, 1);
}

DTRAIN_API dt_tensor *dt_permute(dt_graph *g, dt_tensor *x, const int *perm) {
  if (!dt__begin(g, "dt_permute", 1, x)) return NULL;
  int nd = x->ndim;
  if (nd > 0 && !perm) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_permute: perm is NULL");
  int64_t p[DTRAIN_MAX_DIMS] = {0}, s[DTRAIN_MAX_DIMS] = {0};
  int seen[DTRAIN_MAX_DIMS] = {0};
  int ok = 1;
  for (int d = 0; d < nd; d++) {
    int a = dt__axis(perm[d], nd);
    if (a < 0 || seen[a]) ok = 0;
    else seen[a] = 1;
    p[d] = a;
  }
  if (!ok) {
    char sb[96], pb[96];
    size_t k = (size_t)snprintf(pb, sizeof pb, "{");
    for (int d = 0; d < nd && k < sizeof pb; d++) k += (size_t)snprintf(pb + k, sizeof pb - k, d ? ",%d" : "%d", perm[d]);
    if (k < sizeof pb) snprintf(pb + k, sizeof pb - k, "}");
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_permute: perm %s is not a permutation of the %d dims of %s",
                                 pb, nd, dt_shape_str(x, sb, sizeof sb));
  }
  for (int d = 0; d < nd; d++) s[d] = x->shape[p[d]];
  if (g->device) return dt__dev_permute(g, x, nd, s, p);
  dt_tensor *y = dt__new(g, "dt_permute", nd, s);
  if (!y) return NULL;
  for (int d = 0; d < nd; d++) y->iaux[d] = p[d];
  dt__shape_perm_walk(x, y, y->iaux, x->data, y->data, 0);
  dt__record(g, y, "dt_permute", dt__shape_permute_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- concat ---------------------------------------------------------------------------------
 * Inputs are viewed as [outer, len_j, inner]. aux holds all n input pointers
 * (arena); src[0..3] the first four, for inspection only.
 * iaux: 0 n, 1 outer, 2 inner. */

static void dt__shape_concat_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *const *xs = (dt_tensor *const *)y->aux;
  int n = (int)y->iaux[0];
  int64_t outer = y->iaux[1];
  int64_t row = y->size / outer, base = 0; /* base: start of xs[j] within a y row */
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->size / outer;
    float *gx = dt__grad(g, x);
    if (g->err != DTRAIN_OK) return;
    if (gx) {
      for (int64_t o = 0; o < outer; o++) {
        const float *go = y->grad + o * row + base;
        float *gxo = gx + o * chunk;
        for (int64_t i = 0; i < chunk; i++) gxo[i] += go[i];
      }
    }
    base += chunk;
  }
}

DTRAIN_API dt_tensor *dt_concat(dt_graph *g, dt_tensor *const *xs, int n, int axis) {
  char s1[96], s2[96];
  if (!dt__begin(g, "dt_concat", 0)) return NULL;
  if (!xs) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs is NULL");
  if (n < 1) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: n is %d (needs >= 1)", n);
  for (int j = 0; j < n; j++) {
    if (!xs[j]) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs[%d] is NULL", j);
    if (xs[j]->graph != g)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: xs[%d] belongs to another graph", j);
  }
  const dt_tensor *x0 = xs[0];
  int nd = x0->ndim;
  int ax = dt__axis(axis, nd);
  if (ax < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "dt_concat: axis %d out of range for %s (rank %d)", axis,
                                 dt_shape_str(x0, s1, sizeof s1), nd);
  int64_t cat = 0;
  for (int j = 0; j < n; j++) {
    const dt_tensor *x = xs[j];
    int same = x->ndim == nd;
    for (int d = 0; d < nd && same; d++)
      if (d != ax && x->shape[d] != x0->shape[d]) same = 0;
    if (!same)
      return (dt_tensor *)dt__fail(g, x->ndim == nd ? DTRAIN_ERR_SHAPE : DTRAIN_ERR_RANK,
                                   "dt_concat: xs[%d] is %s but xs[0] is %s (all dims but axis %d must agree)", j,
                                   dt_shape_str(x, s1, sizeof s1), dt_shape_str(x0, s2, sizeof s2), ax);
    if (dt__too_many((uint64_t)cat)) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "dt_concat: result too large");
    cat += x->shape[ax];
  }
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) s[d] = x0->shape[d];
  s[ax] = cat;
  dt_tensor **list = (dt_tensor **)dt__arena_alloc(g, (size_t)n * sizeof(dt_tensor *));
  if (!list) return NULL;
  int64_t outer = dt__shape_prod(s, 0, ax), inner = dt__shape_prod(s, ax + 1, nd);
  if (g->device) return dt__dev_concat(g, xs, n, list, nd, s, outer, inner, ax);
  dt_tensor *y = dt__new(g, "dt_concat", nd, s);
  if (!y) return NULL;
  int64_t row = cat * inner, base = 0;
  dt_tensor *first_rg = NULL;
  for (int j = 0; j < n; j++) {
    dt_tensor *x = xs[j];
    int64_t chunk = x->shape[ax] * inner;
    for (int64_t o = 0; o < outer; o++)
      memcpy(y->data + o * row + base, x->data + o * chunk, (size_t)chunk * sizeof(float));
    base += chunk;
    list[j] = x;
    if (!first_rg && (x->flags & DTRAIN_TENSOR_REQUIRES_GRAD)) first_rg = x;
  }
  y->aux = list;
  y->iaux[0] = n;
  y->iaux[1] = outer;
  y->iaux[2] = inner;
  /* dt__record decides from its three tensor arguments whether y goes on the
   * tape; give it the first input that needs a gradient (any of the n), then
   * show the first four inputs in src. Backward walks aux, all n inputs. */
  dt__record(g, y, "dt_concat", dt__shape_concat_backward, first_rg ? first_rg : list[0], NULL, NULL);
  for (int j = 0; j < 4; j++) y->src[j] = j < n ? list[j] : NULL;
  return dt__finish(g, y);
}

/* ---- slice and split --------------------------------------------------------------------------
 * x viewed as [outer, dim, inner]; y = x[:, start:start+len, :].
 * iaux: 0 outer, 1 dim, 2 inner, 3 start, 4 len. */

static void dt__shape_slice_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], dim = y->iaux[1], inner = y->iaux[2], start = y->iaux[3], len = y->iaux[4];
  int64_t chunk = len * inner;
  for (int64_t o = 0; o < outer; o++) {
    float *gxo = gx + (o * dim + start) * inner;
    const float *go = y->grad + o * chunk;
    for (int64_t i = 0; i < chunk; i++) gxo[i] += go[i];
  }
}

static dt_tensor *dt__shape_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len, const char *op) {
  char sb[96];
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: axis %d out of range for %s (rank %d)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  int64_t dim = x->shape[ax];
  if (start < 0 || len < 1 || start >= dim || len > dim - start)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: start %lld, len %lld out of bounds for axis %d (size %lld) of %s",
                                 op, (long long)start, (long long)len, ax, (long long)dim,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t s[DTRAIN_MAX_DIMS] = {0};
  for (int d = 0; d < x->ndim; d++) s[d] = x->shape[d];
  s[ax] = len;
  int64_t outer = dt__shape_prod(x->shape, 0, ax), inner = dt__shape_prod(x->shape, ax + 1, x->ndim);
  if (g->device) return dt__dev_slice(g, x, op, x->ndim, s, outer, dim, inner, start, len);
  dt_tensor *y = dt__new(g, op, x->ndim, s);
  if (!y) return NULL;
  int64_t chunk = len * inner;
  for (int64_t o = 0; o < outer; o++)
    memcpy(y->data + o * chunk, x->data + (o * dim + start) * inner, (size_t)chunk * sizeof(float));
  y->iaux[0] = outer;
  y->iaux[1] = dim;
  y->iaux[2] = inner;
  y->iaux[3] = start;
  y->iaux[4] = len;
  dt__record(g, y, op, dt__shape_slice_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_slice(dt_graph *g, dt_tensor *x, int axis, int64_t start, int64_t len) {
  if (!dt__begin(g, "dt_slice", 1, x)) return NULL;
  return dt__shape_slice(g, x, axis, start, len, "dt_slice");
}

DTRAIN_API dt_result dt_split(dt_graph *g, dt_tensor *x, int axis, int n, dt_tensor **outs) {
  char sb[96];
  if (outs)
    for (int i = 0; i < n; i++) outs[i] = NULL;
  if (!dt__begin(g, "dt_split", 1, x)) return g ? g->err : DTRAIN_ERR_NULL_ARG;
  if (!outs) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_split: outs is NULL");
    return g->err;
  }
  if (n < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "dt_split: n is %d (needs >= 1)", n);
    return g->err;
  }
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    dt__fail(g, DTRAIN_ERR_INDEX, "dt_split: axis %d out of range for %s (rank %d)", axis,
             dt_shape_str(x, sb, sizeof sb), x->ndim);
    return g->err;
  }
  if (x->shape[ax] % n != 0) {
    dt__fail(g, DTRAIN_ERR_SHAPE, "dt_split: axis %d of %s (size %lld) does not split into %d equal parts", ax,
             dt_shape_str(x, sb, sizeof sb), (long long)x->shape[ax], n);
    return g->err;
  }
  int64_t part = x->shape[ax] / n;
  for (int i = 0; i < n; i++) {
    outs[i] = dt__shape_slice(g, x, ax, (int64_t)i * part, part, "dt_split");
    if (!outs[i]) {
      for (int j = 0; j < i; j++) outs[j] = NULL;
      return g->err != DTRAIN_OK ? g->err : DTRAIN_ERR_INTERNAL;
    }
  }
  return DTRAIN_OK;
}

#undef DT__SHAPE_TILE
/* ======== end dt_ops_shape.c ======== */

/* ======== begin dt_ops_matmul.c ======== */
/* ===========================================================================
 * dt_ops_matmul.c -- matmul, batched matmul, linear (all on dt_sgemm)
 * ===========================================================================
 * Forward and backward are GEMM calls with the transpose flags; backward
 * passes beta = 1 so that it accumulates into the gradient buffers.
 *
 * dt_matmul and dt_bmm share one core over a batch of `nb` products
 * [M,K] @ op(B) -> [M,N]. When B is one 2-D matrix shared by the batch,
 * the batch folds into the rows: [nb*M, K] @ op(B) is a single GEMM, and
 * so are both backward products (the one for B sums over the batch).
 */
/* #include "dt_internal.h" (amalgamated) */

/* iaux layout of a matmul/bmm output. */
enum { DT__MM_NB, DT__MM_M, DT__MM_K, DT__MM_N, DT__MM_TRANS_B, DT__MM_SHARED };

/* From y's iaux: the number of GEMMs (*nb) and the rows of A and C in each
 * (*m); a shared b makes it one GEMM over all the rows. */
static void dt__matmul_dims(const dt_tensor *y, int64_t *nb, int64_t *m) {
  int shared = (int)y->iaux[DT__MM_SHARED];
  *nb = shared ? 1 : y->iaux[DT__MM_NB];
  *m = shared ? y->iaux[DT__MM_NB] * y->iaux[DT__MM_M] : y->iaux[DT__MM_M];
}

static void dt__matmul_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t nb, m, k = y->iaux[DT__MM_K], n = y->iaux[DT__MM_N];
  int trans_b = (int)y->iaux[DT__MM_TRANS_B], shared = (int)y->iaux[DT__MM_SHARED];
  dt__matmul_dims(y, &nb, &m);
  int64_t sa = m * k, sb = shared ? 0 : k * n, sc = m * n;
  const float *gy = y->grad;
  for (int64_t i = 0; i < nb; i++) {
    const float *ai = a->data + i * sa, *bi = b->data + i * sb, *gyi = gy + i * sc;
    if (ga) { /* dA += dC @ op(B)^T */
      if (trans_b) dt_sgemm(0, 0, m, k, n, 1.0f, gyi, n, bi, k, 1.0f, ga + i * sa, k);
      else dt_sgemm(0, 1, m, k, n, 1.0f, gyi, n, bi, n, 1.0f, ga + i * sa, k);
    }
    if (gb) { /* dB += A^T @ dC, or dB^T += dC^T @ A when B is used transposed */
      if (trans_b) dt_sgemm(1, 0, n, k, m, 1.0f, gyi, n, ai, k, 1.0f, gb + i * sb, k);
      else dt_sgemm(1, 0, k, n, m, 1.0f, ai, k, gyi, n, 1.0f, gb + i * sb, n);
    }
  }
}

/* The shared core: a [..., M, K] @ b [..., K, N] (b [..., N, K] with
 * trans_b) with equal leading dims, or b 2-D and shared by the batch. */
static dt_tensor *dt__matmul(dt_graph *g, const char *op, dt_tensor *a, dt_tensor *b, int trans_b) {
  char s1[96], s2[96];
  int nd = a->ndim;
  if (a->ndim < 2 || b->ndim < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: operands must have at least 2 dims (%s @ %s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  int shared = b->ndim == 2;
  if (!shared) {
    int same = b->ndim == nd;
    for (int d = 0; same && d < nd - 2; d++) same = a->shape[d] == b->shape[d];
    if (!same)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE,
                                   "%s: batch dims differ (%s @ %s); b must have a's leading dims or be 2-D", op,
                                   dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  int64_t m = a->shape[nd - 2], k = a->shape[nd - 1];
  int64_t bk = trans_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2];
  int64_t n = trans_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
  if (bk != k)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: inner dims differ (%s @ %s%s)", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2),
                                 trans_b ? "^T" : "");
  int64_t shape[DTRAIN_MAX_DIMS];
  int64_t nb = 1;
  for (int d = 0; d < nd - 2; d++) {
    shape[d] = a->shape[d];
    nb *= a->shape[d];
  }
  shape[nd - 2] = m;
  shape[nd - 1] = n;
  dt_tensor *y = dt__new(g, op, nd, shape);
  if (!y) return NULL;
  y->iaux[DT__MM_NB] = nb;
  y->iaux[DT__MM_M] = m;
  y->iaux[DT__MM_K] = k;
  y->iaux[DT__MM_N] = n;
  y->iaux[DT__MM_TRANS_B] = trans_b;
  y->iaux[DT__MM_SHARED] = shared;
  if (g->device) return dt__dev_bmm(g, y, a, b, op);
  int64_t gemms, rows;
  dt__matmul_dims(y, &gemms, &rows);
  int64_t sa = rows * k, sb = shared ? 0 : k * n, sc = rows * n;
  for (int64_t i = 0; i < gemms; i++)
    dt_sgemm(0, trans_b, rows, n, k, 1.0f, a->data + i * sa, k, b->data + i * sb, trans_b ? k : n, 0.0f,
             y->data + i * sc, n);
  dt__record(g, y, op, dt__matmul_backward, a, b, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_matmul(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  if (!dt__begin(g, "dt_matmul", 2, a, b)) return NULL;
  if (a->ndim != 2 || b->ndim != 2) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "dt_matmul: operands must be 2-D (%s @ %s); see dt_bmm",
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  if (g->device) return dt__dev_matmul(g, a, b, "dt_matmul");
  return dt__matmul(g, "dt_matmul", a, b, 0);
}

DTRAIN_API dt_tensor *dt_bmm(dt_graph *g, dt_tensor *a, dt_tensor *b, int trans_b) {
  if (!dt__begin(g, "dt_bmm", 2, a, b)) return NULL;
  return dt__matmul(g, "dt_bmm", a, b, trans_b != 0);
}

/* ---- linear ---------------------------------------------------------------------
 * x [..., in] viewed as [rows, in]; y [rows, out] = x @ w^T + b.
 * iaux[0] = rows, iaux[1] = in, iaux[2] = out. */

static void dt__linear_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  int64_t rows = y->iaux[0], in = y->iaux[1], out = y->iaux[2];
  const float *gy = y->grad;
  if (gx) dt_sgemm(0, 0, rows, in, out, 1.0f, gy, out, w->data, in, 1.0f, gx, in);      /* dx += dy @ w */
  if (gw) dt_sgemm(1, 0, out, in, rows, 1.0f, gy, out, x->data, in, 1.0f, gw, in);      /* dw += dy^T @ x */
  if (gb)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t o = 0; o < out; o++) gb[o] += gy[r * out + o];
}

DTRAIN_API dt_tensor *dt_linear(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
  const char *op = "dt_linear";
  if (!dt__begin(g, op, 2, x, w)) return NULL;
  if (b && b->graph != g) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: bias belongs to another graph", op);
  char s1[96], s2[96], s3[96];
  if (x->ndim < 1 || w->ndim != 2 || (b && b->ndim != 1))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK,
                                 "%s: expects x [...,in], weight [out,in], bias [out] (x %s, weight %s, bias %s)", op,
                                 dt_shape_str(x, s1, sizeof s1), dt_shape_str(w, s2, sizeof s2),
                                 b ? dt_shape_str(b, s3, sizeof s3) : "NULL");
  int64_t in = x->shape[x->ndim - 1], out = w->shape[0];
  if (w->shape[1] != in)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: weight %s does not match x %s (expected [out,%lld])",
                                 op, dt_shape_str(w, s2, sizeof s2), dt_shape_str(x, s1, sizeof s1),
                                 (long long)in);
  if (b && b->shape[0] != out)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: bias %s does not match weight %s (expected [%lld])", op,
                                 dt_shape_str(b, s3, sizeof s3), dt_shape_str(w, s2, sizeof s2),
                                 (long long)out);
  int64_t shape[DTRAIN_MAX_DIMS];
  for (int d = 0; d < x->ndim - 1; d++) shape[d] = x->shape[d];
  shape[x->ndim - 1] = out;
  int64_t rows = x->size / in;
  if (g->device) return dt__dev_linear(g, x, w, b, rows, in, out, x->ndim, shape);
  dt_tensor *y = dt__new(g, op, x->ndim, shape);
  if (!y) return NULL;
  if (b) {
    for (int64_t r = 0; r < rows; r++) memcpy(y->data + r * out, b->data, (size_t)out * sizeof(float));
  }
  dt_sgemm(0, 1, rows, out, in, 1.0f, x->data, in, w->data, in, b ? 1.0f : 0.0f, y->data, out);
  y->iaux[0] = rows;
  y->iaux[1] = in;
  y->iaux[2] = out;
  dt__record(g, y, op, dt__linear_backward, x, w, b);
  return dt__finish(g, y);
}
/* ======== end dt_ops_matmul.c ======== */

/* ======== begin dt_ops_nn.c ======== */
/* ===========================================================================
 * dt_ops_nn.c -- softmax, losses and neural-network layers' ops: softmax,
 * log_softmax, cross_entropy, mse, embedding, dropout, layer_norm,
 * batch_norm, causal_mask
 * ===========================================================================
 * Sums run in double and in a fixed order (deterministic). Saved statistics
 * (row log-sum-exp, mean and 1/std) live in the arena, pointed to by y->aux.
 */
/* #include "dt_internal.h" (amalgamated) */

/* Checks an optional tensor argument (NULL is fine) belongs to g. */
static int dt__nn_opt(dt_graph *g, const char *op, const char *name, const dt_tensor *t) {
  if (t && t->graph != g) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: %s belongs to another graph", op, name);
    return 0;
  }
  return 1;
}

/* Checks an optional per-feature tensor (NULL is fine) has shape [n]. */
static int dt__nn_vec(dt_graph *g, const char *op, const char *name, const dt_tensor *t, int64_t n,
                      const char *what, const dt_tensor *x) {
  if (!t) return 1;
  if (t->ndim != 1 || t->shape[0] != n) {
    char s1[96], s2[96];
    dt__fail(g, DTRAIN_ERR_SHAPE, "%s: %s has shape %s, expected [%lld] (%s of input %s)", op, name,
             dt_shape_str(t, s1, sizeof s1), (long long)n, what, dt_shape_str(x, s2, sizeof s2));
    return 0;
  }
  return 1;
}

static int dt__nn_eps(dt_graph *g, const char *op, float eps) {
  if (!(eps >= 0.0f) || !isfinite(eps)) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: eps is %g (must be finite and >= 0)", op, (double)eps);
    return 0;
  }
  return 1;
}

/* ---- softmax / log_softmax ------------------------------------------------------------
 * The axis splits x into [outer, n, inner]; element (o,k,i) is at
 * (o*n + k)*inner + i. Each (o,i) line of n elements is normalised. */

static void dt__nn_softmax_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], n = y->iaux[1], inner = y->iaux[2];
  int is_log = (int)y->iaux[3];
  const float *yd = y->data, *go = y->grad;
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * n * inner + i;
      double s = 0.0;
      if (is_log) {
        for (int64_t k = 0; k < n; k++) s += (double)go[base + k * inner];
        float fs = (float)s;
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          gx[j] += go[j] - expf(yd[j]) * fs;
        }
      } else {
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          s += (double)go[j] * (double)yd[j];
        }
        float fs = (float)s;
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          gx[j] += yd[j] * (go[j] - fs);
        }
      }
    }
  }
}

static dt_tensor *dt__nn_softmax(dt_graph *g, dt_tensor *x, int axis, int is_log, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, x->ndim == 0 ? DTRAIN_ERR_RANK : DTRAIN_ERR_INDEX,
                                 "%s: axis %d out of range for input %s (%d dims)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  if (g->device) return dt__dev_softmax(g, x, ax, is_log, op);
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t outer = 1, inner = 1, n = x->shape[ax];
  for (int d = 0; d < ax; d++) outer *= x->shape[d];
  for (int d = ax + 1; d < x->ndim; d++) inner *= x->shape[d];
  const float *xd = x->data;
  float *yd = y->data;
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * n * inner + i;
      float m = xd[base];
      for (int64_t k = 1; k < n; k++) m = DT__MAX(m, xd[base + k * inner]);
      double s = 0.0;
      if (is_log) {
        for (int64_t k = 0; k < n; k++) s += (double)expf(xd[base + k * inner] - m);
        float ls = (float)log(s); /* (x - m) - ls keeps precision for large logits */
        for (int64_t k = 0; k < n; k++) yd[base + k * inner] = (xd[base + k * inner] - m) - ls;
      } else {
        for (int64_t k = 0; k < n; k++) {
          float e = expf(xd[base + k * inner] - m);
          yd[base + k * inner] = e;
          s += (double)e;
        }
        float inv = (float)(1.0 / s);
        for (int64_t k = 0; k < n; k++) yd[base + k * inner] *= inv;
      }
    }
  }
  y->iaux[0] = outer;
  y->iaux[1] = n;
  y->iaux[2] = inner;
  y->iaux[3] = is_log;
  dt__record(g, y, op, dt__nn_softmax_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_softmax(dt_graph *g, dt_tensor *x, int axis) {
  return dt__nn_softmax(g, x, axis, 0, "dt_softmax");
}

DTRAIN_API dt_tensor *dt_log_softmax(dt_graph *g, dt_tensor *x, int axis) {
  return dt__nn_softmax(g, x, axis, 1, "dt_log_softmax");
}

/* ---- cross entropy ----------------------------------------------------------------------
 * aux: labels (int32, rows, padded to 4), then per row its max m and
 * ls = log(sum exp(x - m)) (float, rows each); log-sum-exp = m + ls. */

static void dt__nn_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t rows = y->iaux[0], c = y->iaux[1];
  const int32_t *labels = (const int32_t *)y->aux;
  const float *mx = (const float *)y->aux + y->iaux[2], *ls = mx + rows;
  const float *xd = x->data;
  float scale = y->grad[0] / (float)rows;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * c;
    float *gr = gx + r * c;
    float m = mx[r], l = ls[r];
    for (int64_t j = 0; j < c; j++) gr[j] += expf((xr[j] - m) - l) * scale;
    gr[labels[r]] -= scale;
  }
}

DTRAIN_API dt_tensor *dt_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels) {
  const char *op = "dt_cross_entropy";
  if (!dt__begin(g, op, 1, logits)) return NULL;
  char sb[96];
  if (logits->ndim < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: logits must have at least 1 dim [...,C], got %s", op,
                                 dt_shape_str(logits, sb, sizeof sb));
  if (!labels) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: labels is NULL", op);
  int64_t c = logits->shape[logits->ndim - 1], rows = logits->size / c;
  for (int64_t r = 0; r < rows; r++) {
    if (labels[r] < 0 || (int64_t)labels[r] >= c)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: label %d of row %lld is out of range [0,%lld) (logits %s)",
                                   op, (int)labels[r], (long long)r, (long long)c,
                                   dt_shape_str(logits, sb, sizeof sb));
  }
  if (g->device) return dt__dev_xent(g, logits, labels, rows, c);
  int64_t lab_floats = (rows + 3) / 4 * 4;
  float *aux = dt__arena_floats(g, lab_floats + 2 * rows);
  if (!aux) return NULL;
  int32_t *lab = (int32_t *)(void *)aux;
  float *mx = aux + lab_floats, *ls = mx + rows;
  memcpy(lab, labels, (size_t)rows * sizeof(int32_t));
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  const float *xd = logits->data;
  double loss = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * c;
    float m = xr[0];
    for (int64_t j = 1; j < c; j++) m = DT__MAX(m, xr[j]);
    double s = 0.0;
    for (int64_t j = 0; j < c; j++) s += (double)expf(xr[j] - m);
    double l = log(s);
    mx[r] = m;
    ls[r] = (float)l;
    loss += l + ((double)m - (double)xr[lab[r]]);
  }
  y->data[0] = (float)(loss / (double)rows);
  y->aux = aux;
  y->iaux[0] = rows;
  y->iaux[1] = c;
  y->iaux[2] = lab_floats;
  dt__record(g, y, op, dt__nn_xent_backward, logits, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- mean squared error ---------------------------------------------------------------- */

static void dt__nn_mse_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  const float *ad = a->data, *bd = b->data;
  float k = 2.0f * y->grad[0] / (float)a->size;
  for (int64_t i = 0; i < a->size; i++) {
    float d = k * (ad[i] - bd[i]);
    if (ga) ga[i] += d;
    if (gb) gb[i] -= d;
  }
}

DTRAIN_API dt_tensor *dt_mse(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  const char *op = "dt_mse";
  if (!dt__begin(g, op, 2, a, b)) return NULL;
  if (!dt_same_shape(a, b)) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: shapes %s and %s differ", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  if (g->device) return dt__dev_mse(g, a, b);
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  double s = 0.0;
  for (int64_t i = 0; i < a->size; i++) {
    double d = (double)a->data[i] - (double)b->data[i];
    s += d * d;
  }
  y->data[0] = (float)(s / (double)a->size);
  dt__record(g, y, op, dt__nn_mse_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- embedding ----------------------------------------------------------------------------
 * aux: the ids (int32, n). */

static void dt__nn_embedding_backward(dt_graph *g, dt_tensor *y) {
  float *gt = dt__grad(g, y->src[0]);
  if (!gt) return;
  const int32_t *ids = (const int32_t *)y->aux;
  int64_t n = y->shape[0], d = y->shape[1];
  const float *go = y->grad;
  for (int64_t i = 0; i < n; i++) {
    float *row = gt + (int64_t)ids[i] * d;
    const float *gr = go + i * d;
    for (int64_t j = 0; j < d; j++) row[j] += gr[j];
  }
}

DTRAIN_API dt_tensor *dt_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n) {
  const char *op = "dt_embedding";
  if (!dt__begin(g, op, 1, table)) return NULL;
  char sb[96];
  if (table->ndim != 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: table must be 2-D [V,D], got %s", op,
                                 dt_shape_str(table, sb, sizeof sb));
  if (!ids) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: ids is NULL", op);
  if (n <= 0)
    return (dt_tensor *)dt__fail(g, n == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                                 "%s: n is %lld (must be >= 1)", op, (long long)n);
  int64_t v = table->shape[0], d = table->shape[1];
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || (int64_t)ids[i] >= v)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: id %d at position %lld is out of range [0,%lld) (table %s)",
                                   op, (int)ids[i], (long long)i, (long long)v, dt_shape_str(table, sb, sizeof sb));
  }
  if (g->device) return dt__dev_embedding(g, table, ids, n, d);
  int64_t shape[2];
  shape[0] = n;
  shape[1] = d;
  dt_tensor *y = dt__new(g, op, 2, shape); /* validates the size, so n * 4 bytes cannot overflow */
  if (!y) return NULL;
  int32_t *copy = (int32_t *)dt__arena_alloc(g, (size_t)n * sizeof(int32_t));
  if (!copy) return NULL;
  memcpy(copy, ids, (size_t)n * sizeof(int32_t));
  for (int64_t i = 0; i < n; i++)
    memcpy(y->data + i * d, table->data + (int64_t)copy[i] * d, (size_t)d * sizeof(float));
  y->aux = copy;
  dt__record(g, y, op, dt__nn_embedding_backward, table, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- dropout --------------------------------------------------------------------------------
 * aux: the mask as scales (0 or 1/(1-p)), one per element. */

static void dt__nn_dropout_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  const float *mask = (const float *)y->aux, *go = y->grad;
  for (int64_t i = 0; i < y->size; i++) gx[i] += go[i] * mask[i];
}

DTRAIN_API dt_tensor *dt_dropout(dt_graph *g, dt_tensor *x, float p) {
  const char *op = "dt_dropout";
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!(p >= 0.0f && p < 1.0f))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: p is %g (must be in [0,1))", op, (double)p);
  if (!g->training || p == 0.0f) return x; /* identity */
  if (g->device) return dt__dev_dropout(g, x, p);
  float *mask = dt__arena_floats(g, x->size);
  if (!mask) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < x->size; i++) {
    mask[i] = dt_rng_uniform(&g->rng) >= p ? scale : 0.0f;
    y->data[i] = x->data[i] * mask[i];
  }
  y->aux = mask;
  y->faux[0] = p;
  dt__record(g, y, op, dt__nn_dropout_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- normalisation ----------------------------------------------------------------------------
 * Both norms save, per normalised group, the mean and 1/sqrt(var + eps):
 * aux = [mean[0..k), rstd[0..k)]. With xhat = (x - mean) * rstd and
 * dxhat = dy * gamma, the input gradient over a group of m elements is
 *   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)). */

static void dt__nn_layer_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  int64_t d = x->shape[x->ndim - 1], rows = x->size / d;
  const float *mean = (const float *)y->aux, *rstd = mean + rows;
  const float *xd = x->data, *go = y->grad, *gm = gamma ? gamma->data : NULL;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * d, *gr = go + r * d;
    float mu = mean[r], rs = rstd[r];
    if (gg || gb) {
      for (int64_t j = 0; j < d; j++) {
        if (gg) gg[j] += gr[j] * (xr[j] - mu) * rs;
        if (gb) gb[j] += gr[j];
      }
    }
    if (!gx) continue;
    double s1 = 0.0, s2 = 0.0;
    for (int64_t j = 0; j < d; j++) {
      double dxh = (double)gr[j] * (gm ? (double)gm[j] : 1.0);
      s1 += dxh;
      s2 += dxh * (double)((xr[j] - mu) * rs);
    }
    float m1 = (float)(s1 / (double)d), m2 = (float)(s2 / (double)d);
    float *gxr = gx + r * d;
    for (int64_t j = 0; j < d; j++) {
      float dxh = gr[j] * (gm ? gm[j] : 1.0f);
      gxr[j] += rs * (dxh - m1 - (xr[j] - mu) * rs * m2);
    }
  }
}

DTRAIN_API dt_tensor *dt_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps) {
  const char *op = "dt_layer_norm";
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!dt__nn_opt(g, op, "gamma", gamma) || !dt__nn_opt(g, op, "beta", beta)) return NULL;
  if (x->ndim < 1) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must have at least 1 dim, got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  }
  int64_t d = x->shape[x->ndim - 1], rows = x->size / d;
  if (!dt__nn_vec(g, op, "gamma", gamma, d, "last dim", x) || !dt__nn_vec(g, op, "beta", beta, d, "last dim", x) ||
      !dt__nn_eps(g, op, eps))
    return NULL;
  if (g->device) return dt__dev_layer_norm(g, x, gamma, beta, eps, rows, d);
  float *stats = dt__arena_floats(g, 2 * rows);
  if (!stats) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  const float *gm = gamma ? gamma->data : NULL, *bt = beta ? beta->data : NULL;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x->data + r * d;
    float *yr = y->data + r * d;
    double s = 0.0, v = 0.0;
    for (int64_t j = 0; j < d; j++) s += (double)xr[j];
    double mu = s / (double)d;
    for (int64_t j = 0; j < d; j++) {
      double t = (double)xr[j] - mu;
      v += t * t;
    }
    float fmu = (float)mu, rs = (float)(1.0 / sqrt(v / (double)d + (double)eps));
    for (int64_t j = 0; j < d; j++) {
      float h = (xr[j] - fmu) * rs;
      if (gm) h *= gm[j];
      if (bt) h += bt[j];
      yr[j] = h;
    }
    stats[r] = fmu;
    stats[rows + r] = rs;
  }
  y->aux = stats;
  dt__record(g, y, op, dt__nn_layer_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* Batch norm: x [N,C,HW...]: element (n,c,s) at (n*C + c)*hw + s.
 * iaux: [0] N, [1] C, [2] hw, [3] 1 if batch statistics were used. */

static void dt__nn_batch_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  int64_t nb = y->iaux[0], c = y->iaux[1], hw = y->iaux[2];
  int batch = (int)y->iaux[3];
  double m = (double)(nb * hw);
  const float *mean = (const float *)y->aux, *rstd = mean + c;
  const float *xd = x->data, *go = y->grad;
  for (int64_t ch = 0; ch < c; ch++) {
    float mu = mean[ch], rs = rstd[ch], gam = gamma ? gamma->data[ch] : 1.0f;
    double sg = 0.0, sgx = 0.0; /* sum dy, sum dy * xhat */
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t s = 0; s < hw; s++) {
        sg += (double)go[base + s];
        sgx += (double)go[base + s] * (double)((xd[base + s] - mu) * rs);
      }
    }
    if (gg) gg[ch] += (float)sgx;
    if (gb) gb[ch] += (float)sg;
    if (!gx) continue;
    float k = gam * rs;
    if (!batch) {
      for (int64_t n = 0; n < nb; n++) {
        int64_t base = (n * c + ch) * hw;
        for (int64_t s = 0; s < hw; s++) gx[base + s] += go[base + s] * k;
      }
      continue;
    }
    float m1 = (float)(sg / m), m2 = (float)(sgx / m);
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t s = 0; s < hw; s++) {
        float xh = (xd[base + s] - mu) * rs;
        gx[base + s] += k * (go[base + s] - m1 - xh * m2);
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                    dt_tensor *running_mean, dt_tensor *running_var,
                                    float momentum, float eps) {
  const char *op = "dt_batch_norm";
  char sb[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!dt__nn_opt(g, op, "gamma", gamma) || !dt__nn_opt(g, op, "beta", beta) ||
      !dt__nn_opt(g, op, "running_mean", running_mean) || !dt__nn_opt(g, op, "running_var", running_var))
    return NULL;
  if (x->ndim != 2 && x->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must be [N,C] or [N,C,H,W], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t nb = x->shape[0], c = x->shape[1], hw = x->size / (nb * c);
  if (!dt__nn_vec(g, op, "gamma", gamma, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "beta", beta, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "running_mean", running_mean, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "running_var", running_var, c, "channel dim 1", x) || !dt__nn_eps(g, op, eps))
    return NULL;
  if ((running_mean == NULL) != (running_var == NULL))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: running_mean and running_var must both be given or both be NULL", op);
  int have_running = running_mean != NULL;
  int batch = g->training || !have_running; /* eval without running stats: batch stats (as PyTorch) */
  if (g->training && have_running && !(momentum >= 0.0f && momentum <= 1.0f))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: momentum is %g (must be in [0,1])", op,
                                 (double)momentum);
  int64_t m = nb * hw;
  if (batch && m < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: batch statistics need more than 1 value per channel (input %s)", op,
                                 dt_shape_str(x, sb, sizeof sb));
  if (g->device)
    return dt__dev_batch_norm(g, x, gamma, beta, running_mean, running_var, momentum, eps, nb, c, hw, batch);
  if (!batch) {
    for (int64_t ch = 0; ch < c; ch++)
      if (!(running_var->data[ch] + eps > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: running_var[%lld] + eps is %g (must be > 0)", op,
                                     (long long)ch, (double)(running_var->data[ch] + eps));
  }
  float *stats = dt__arena_floats(g, 2 * c);
  if (!stats) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  const float *xd = x->data;
  for (int64_t ch = 0; ch < c; ch++) {
    float mu, rs;
    if (batch) {
      double s = 0.0, v = 0.0;
      for (int64_t n = 0; n < nb; n++) {
        const float *p = xd + (n * c + ch) * hw;
        for (int64_t t = 0; t < hw; t++) s += (double)p[t];
      }
      double dmu = s / (double)m;
      for (int64_t n = 0; n < nb; n++) {
        const float *p = xd + (n * c + ch) * hw;
        for (int64_t t = 0; t < hw; t++) {
          double e = (double)p[t] - dmu;
          v += e * e;
        }
      }
      mu = (float)dmu;
      rs = (float)(1.0 / sqrt(v / (double)m + (double)eps));
      if (have_running) { /* training: update the running statistics in place */
        double mom = (double)momentum;
        running_mean->data[ch] = (float)((1.0 - mom) * (double)running_mean->data[ch] + mom * dmu);
        running_var->data[ch] = (float)((1.0 - mom) * (double)running_var->data[ch] + mom * v / (double)(m - 1));
      }
    } else {
      mu = running_mean->data[ch];
      rs = (float)(1.0 / sqrt((double)running_var->data[ch] + (double)eps));
    }
    stats[ch] = mu;
    stats[c + ch] = rs;
    float gam = gamma ? gamma->data[ch] : 1.0f, bet = beta ? beta->data[ch] : 0.0f;
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t t = 0; t < hw; t++) y->data[base + t] = (xd[base + t] - mu) * rs * gam + bet;
    }
  }
  y->aux = stats;
  y->iaux[0] = nb;
  y->iaux[1] = c;
  y->iaux[2] = hw;
  y->iaux[3] = batch;
  dt__record(g, y, op, dt__nn_batch_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* ---- causal mask ------------------------------------------------------------------------------ */

static void dt__nn_causal_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t t = y->shape[y->ndim - 1], mats = y->size / (t * t);
  const float *go = y->grad;
  for (int64_t b = 0; b < mats; b++)
    for (int64_t i = 0; i < t; i++) {
      int64_t row = (b * t + i) * t;
      for (int64_t j = 0; j <= i; j++) gx[row + j] += go[row + j];
    }
}

DTRAIN_API dt_tensor *dt_causal_mask(dt_graph *g, dt_tensor *x) {
  const char *op = "dt_causal_mask";
  char sb[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (x->ndim < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must be [...,T,T], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t t = x->shape[x->ndim - 1];
  if (x->shape[x->ndim - 2] != t)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: last two dims must be equal [...,T,T], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  if (g->device) return dt__dev_causal_mask(g, x, t);
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t mats = x->size / (t * t);
  for (int64_t b = 0; b < mats; b++)
    for (int64_t i = 0; i < t; i++) {
      int64_t row = (b * t + i) * t;
      for (int64_t j = 0; j < t; j++) y->data[row + j] = j <= i ? x->data[row + j] : -INFINITY;
    }
  dt__record(g, y, op, dt__nn_causal_backward, x, NULL, NULL);
  if (g->err != DTRAIN_OK) return NULL;
  /* The -inf entries are intended: check only the kept ones (dt__finish would flag them). */
  if (g->check_numerics) {
    for (int64_t b = 0; b < mats; b++)
      for (int64_t i = 0; i < t; i++)
        for (int64_t j = 0; j <= i; j++) {
          float v = y->data[(b * t + i) * t + j];
          if (!isfinite(v))
            return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", op,
                                         dt_shape_str(y, sb, sizeof sb), isnan(v) ? "NaN" : "Inf",
                                         (long long)((b * t + i) * t + j));
        }
  }
  return y;
}
/* ======== end dt_ops_nn.c ======== */

/* ======== begin dt_ops_conv.c ======== */
/* ===========================================================================
 * dt_ops_conv.c -- 2-D convolution (im2col + GEMM) and max/average pooling, NCHW
 * ===========================================================================
 * Convolution: for a group of nb images the column matrix col [K, nb*P]
 * (K = C*kh*kw rows, P = Ho*Wo output positions per image, images side by
 * side) is built in arena scratch, and out [O, nb*P] = w [O,K] @ col. nb is
 * picked from the shapes alone (enough columns for an efficient GEMM, scratch
 * capped), so results are deterministic. Backward recomputes col per group
 * instead of keeping it for the whole batch:
 *   gw [O,K]    += gy [O, nb*P] @ col^T
 *   gcol [K,nb*P] = w^T @ gy,  then col2im accumulates gcol into gx
 *   gb [O]      += sum of gy over images and positions
 * A 1x1 kernel with stride 1, padding 0 and nb == 1 uses x itself as col.
 * 5x5 kernels with stride 1 and at least 8 channels in and out use
 * Winograd F(2x2, 5x5) instead (see below): 2.8x fewer multiplications.
 */
/* #include "dt_internal.h" (amalgamated) */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__CONV_SSE 1
#  include <emmintrin.h>
#endif

#if defined(DT__CONV_SSE) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__CONV_AVX 1 /* picked at run time */
#  include <immintrin.h>
#endif

/* Grouping: images are put side by side only while an image has fewer than
 * DT__CONV_COLS output positions (the GEMM's B panel is 192 wide), and only
 * as far as the column matrix stays within DT__CONV_CAP floats (1 MiB, a
 * typical L2 cache): the matrix im2col writes is read back by the GEMM's
 * packing while it is still in cache, and with one image per GEMM the
 * output and its gradient need no reordering copies. */
#define DT__CONV_COLS 192
#define DT__CONV_CAP (1 << 18)

/* Geometry of one convolution, from the tensors and the saved parameters. */
typedef struct dt__conv_geom {
  int64_t n, c, h, w;      /* input */
  int64_t o, kh, kw;       /* weight */
  int64_t ho, wo;          /* output */
  int64_t s, p;            /* stride, padding */
  int64_t k, pp, nb;       /* K = c*kh*kw, P = ho*wo, images per GEMM */
  int direct;              /* 1x1, stride 1, padding 0, nb == 1: col is x */
} dt__conv_geom;

static void dt__conv_geometry(dt__conv_geom *q, const dt_tensor *x, const dt_tensor *w, int64_t s, int64_t p) {
  q->n = x->shape[0];
  q->c = x->shape[1];
  q->h = x->shape[2];
  q->w = x->shape[3];
  q->o = w->shape[0];
  q->kh = w->shape[2];
  q->kw = w->shape[3];
  q->s = s;
  q->p = p;
  q->ho = (q->h + 2 * p - q->kh) / s + 1;
  q->wo = (q->w + 2 * p - q->kw) / s + 1;
  q->k = q->c * q->kh * q->kw;
  q->pp = q->ho * q->wo;
  int64_t rows = DT__MAX(q->k, q->o), nb = 1;
  if (q->pp < DT__CONV_COLS) nb = (DT__CONV_COLS + q->pp - 1) / q->pp;
  if (nb > q->n) nb = q->n;
  if (nb > 1 && nb * rows * q->pp > DT__CONV_CAP) nb = DT__MAX(1, DT__CONV_CAP / (rows * q->pp));
  q->nb = nb;
  q->direct = q->kh == 1 && q->kw == 1 && s == 1 && p == 0 && nb == 1;
}

/* Output columns ow in [lo,hi) read input column ow*s - p + kj inside [0, w). */
static void dt__conv_range(const dt__conv_geom *q, int64_t kj, int64_t *lo, int64_t *hi) {
  int64_t a = q->p - kj, b = q->w - 1 + q->p - kj;
  int64_t l = a > 0 ? (a + q->s - 1) / q->s : 0;
  int64_t h = b >= 0 ? b / q->s + 1 : 0;
  if (h > q->wo) h = q->wo;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* Output rows oh in [lo,hi) read input row oh*s - p + ki inside [0, h). */
static void dt__conv_rows(const dt__conv_geom *q, int64_t ki, int64_t *lo, int64_t *hi) {
  int64_t a = q->p - ki, b = q->h - 1 + q->p - ki;
  int64_t l = a > 0 ? (a + q->s - 1) / q->s : 0;
  int64_t h = b >= 0 ? b / q->s + 1 : 0;
  if (h > q->ho) h = q->ho;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* Zero n floats; n is usually tiny (the padding width), where a loop that
 * the compiler turns into a memset call costs more than the stores. */
static void dt__conv_zero_short(float *d, int64_t n) {
  if (n > 4) {
    memset(d, 0, (size_t)n * sizeof(float));
    return;
  }
  if (n > 0) d[0] = 0.0f;
  if (n > 1) d[1] = 0.0f;
  if (n > 2) d[2] = 0.0f;
  if (n > 3) d[3] = 0.0f;
}

#ifdef DT__CONV_AVX
__attribute__((target("avx"))) static void dt__conv_addto_avx(float *DT__RESTRICT dst, const float *DT__RESTRICT src,
                                                              int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
  for (; i < n; i++) dst[i] += src[i];
}
#endif

/* dst[i] += src[i], 8 or 4 floats at a time (spans of a few hundred floats). */
static void dt__conv_addto(float *DT__RESTRICT dst, const float *DT__RESTRICT src, int64_t n) {
  int64_t i = 0;
#ifdef DT__CONV_AVX
  if (n >= 16 && __builtin_cpu_supports("avx")) {
    dt__conv_addto_avx(dst, src, n);
    return;
  }
#endif
#ifdef DT__CONV_SSE
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(dst + i, _mm_add_ps(_mm_loadu_ps(dst + i), _mm_loadu_ps(src + i)));
#endif
  for (; i < n; i++) dst[i] += src[i];
}

/* Column matrix of one image x [C,H,W]: row (c,ki,kj), column oh*Wo+ow holds
 * x[c, oh*s-p+ki, ow*s-p+kj] (0 in the padding); rows are ld floats apart.
 * Rows of the output that fall in the padding are zeroed in one go. With
 * stride 1 and Wo == W (a "same" convolution) the valid part of a column row
 * is one contiguous span of x: it is copied with one memcpy and the few
 * entries that wrapped around from the neighbouring input rows are zeroed,
 * instead of one short copy per output row. */
static void dt__conv_im2col(const dt__conv_geom *q, const float *x, float *col, int64_t ld) {
  int64_t r = 0, wo = q->wo, span = q->s == 1 && q->wo == q->w;
  for (int64_t c = 0; c < q->c; c++) {
    for (int64_t ki = 0; ki < q->kh; ki++) {
      int64_t rlo, rhi;
      dt__conv_rows(q, ki, &rlo, &rhi);
      for (int64_t kj = 0; kj < q->kw; kj++, r++) {
        float *row = col + r * ld;
        int64_t lo, hi, off = kj - q->p;
        dt__conv_range(q, kj, &lo, &hi);
        if (lo == hi || rlo == rhi) {
          memset(row, 0, (size_t)(q->ho * wo) * sizeof(float));
          continue;
        }
        if (rlo > 0) memset(row, 0, (size_t)(rlo * wo) * sizeof(float));
        if (rhi < q->ho) memset(row + rhi * wo, 0, (size_t)((q->ho - rhi) * wo) * sizeof(float));
        const float *plane = x + c * q->h * q->w;
        if (span) {
          const float *src = plane + (rlo - q->p + ki) * q->w + lo + off;
          memcpy(row + rlo * wo + lo, src, (size_t)((rhi - rlo - 1) * wo + hi - lo) * sizeof(float));
          /* The gap between two rows' valid parts is contiguous: [hi, wo) of
           * one row and [0, lo) of the next, |off| floats. */
          dt__conv_zero_short(row + rlo * wo, lo);
          for (int64_t oh = rlo; oh < rhi; oh++)
            dt__conv_zero_short(row + oh * wo + hi, wo - hi + (oh + 1 < rhi ? lo : 0));
          continue;
        }
        for (int64_t oh = rlo; oh < rhi; oh++) {
          float *dst = row + oh * wo;
          const float *src = plane + (oh * q->s - q->p + ki) * q->w;
          for (int64_t ow = 0; ow < lo; ow++) dst[ow] = 0.0f;
          if (q->s == 1) memcpy(dst + lo, src + lo + off, (size_t)(hi - lo) * sizeof(float));
          else for (int64_t ow = lo; ow < hi; ow++) dst[ow] = src[ow * q->s + off];
          for (int64_t ow = hi; ow < wo; ow++) dst[ow] = 0.0f;
        }
      }
    }
  }
}

/* Adjoint of im2col: gx [C,H,W] += the column gradient gcol (rows ld apart).
 * gcol is scratch: in the span case (stride 1, Wo == W, see im2col) the
 * entries that would wrap around to neighbouring input rows are zeroed in
 * gcol first, so that each column row adds to gx as one contiguous span. */
static void dt__conv_col2im(const dt__conv_geom *q, float *gcol, int64_t ld, float *gx) {
  int64_t r = 0, wo = q->wo, span = q->s == 1 && q->wo == q->w;
  for (int64_t c = 0; c < q->c; c++) {
    for (int64_t ki = 0; ki < q->kh; ki++) {
      int64_t rlo, rhi;
      dt__conv_rows(q, ki, &rlo, &rhi);
      for (int64_t kj = 0; kj < q->kw; kj++, r++) {
        float *row = gcol + r * ld;
        int64_t lo, hi, off = kj - q->p;
        dt__conv_range(q, kj, &lo, &hi);
        if (lo == hi || rlo == rhi) continue;
        float *plane = gx + c * q->h * q->w;
        if (span) {
          for (int64_t oh = rlo; oh + 1 < rhi; oh++) dt__conv_zero_short(row + oh * wo + hi, wo - hi + lo);
          dt__conv_addto(plane + (rlo - q->p + ki) * q->w + lo + off, row + rlo * wo + lo,
                         (rhi - rlo - 1) * wo + hi - lo);
          continue;
        }
        for (int64_t oh = rlo; oh < rhi; oh++) {
          const float *src = row + oh * wo;
          float *dst = plane + (oh * q->s - q->p + ki) * q->w;
          if (q->s == 1) dt__conv_addto(dst + lo + off, src + lo, hi - lo);
          else for (int64_t ow = lo; ow < hi; ow++) dst[ow * q->s + off] += src[ow];
        }
      }
    }
  }
}

/* ---- Winograd F(2x2, 5x5) ---------------------------------------------------------------
 * 5x5 kernels with stride 1 and enough channels (conv2 of a LeNet-style
 * CNN) run as Winograd minimal filtering: each 2x2 block of outputs (a
 * "tile") is computed from the 6x6 input patch under it as
 *   Y = A^T [ (G g G^T) (.) (B^T d B) ] A
 * (interpolation points 0, 1, -1, 2, -2 and infinity), so the channel sums
 * become 36 GEMMs, one per position xi of the 6x6 transformed tile:
 *   M_xi [O, T] = U_xi [O, C] @ V_xi [C, T]      U = G g G^T, V = B^T d B
 * over the T tiles of a group of images: 36 multiplications per 4 outputs
 * instead of 100. Backward runs the adjoints of the same linear maps:
 *   dM = A dY A^T;  dV_xi = U_xi^T @ dM_xi, dx += scatter of B dV B^T;
 *   dU_xi += dM_xi @ V_xi^T, dw += G^T dU G.
 * The transforms are separable: a 1-D transform along the rows (the input
 * rows deinterleaved into even and odd columns, so that tile tj's columns
 * are at tj + constant), then down the columns, on vectors of 8 tile
 * columns. Every value is computed in one fixed order
 * (a function of the shapes only), so results are deterministic; they
 * differ from the im2col path by rounding (a few float ulps per term
 * magnitude). */

/* Tiles are processed along a tile row in vectors of DT__WINO_L lanes: with
 * GCC and clang a vector type (two SSE or NEON registers, or one AVX
 * register), otherwise an array that the compiler may vectorise. */
#define DT__WINO_L 8
#define DT__WINO_COLS 192 /* tiles per GEMM: at least the B panel width */
/* The transforms are inlined into two copies of the step function, one
 * compiled for AVX2 (x86-64, picked at run time: one 8-lane register per
 * vector instead of two SSE ones) and one for the build's target. */
#if defined(__GNUC__) || defined(__clang__)
#  define DT__WINO_INLINE __attribute__((always_inline)) inline
#else
#  define DT__WINO_INLINE
#endif
#if !defined(DTRAIN_NO_SIMD) && (defined(__GNUC__) || defined(__clang__))
/* Loads and stores through an unaligned, may-alias vector type; macros, as
 * passing a 32-byte vector by value to a function changes the ABI without
 * AVX (GCC warns). */
typedef float dt__wv __attribute__((vector_size(32)));
typedef float dt__wvu __attribute__((vector_size(32), aligned(4), __may_alias__));
typedef int32_t dt__wvi __attribute__((vector_size(32)));
#  define DT__WV_LD(p) (*(const dt__wvu *)(const void *)(p))
#  define DT__WV_ST(p, v) (*(dt__wvu *)(void *)(p) = (v))
#  define DT__WV_ADD(a, b) ((a) + (b))
#  define DT__WV_SUB(a, b) ((a) - (b))
#  define DT__WV_MUL(a, s) ((a) * (s)) /* s: a positive float constant (see DT__WV_NEG) */
#  define DT__WV_NEG(a) (-(a))
/* A mask of the lanes below n; DT__WV_KEEP sets the other lanes to 0
 * (bitwise, so garbage lanes cannot leak NaN). */
typedef dt__wvi dt__wvm;
static DT__WINO_INLINE void dt__wv_mask(dt__wvm *m, int64_t n) {
  for (int i = 0; i < DT__WINO_L; i++) (*m)[i] = i < n ? -1 : 0;
}
#  define DT__WV_KEEP(v, m) ((v) = (dt__wv)((dt__wvi)(v) & (m)))
#else
typedef struct dt__wv {
  float f[DT__WINO_L];
} dt__wv;
static dt__wv dt__wv_ld(const float *p) {
  dt__wv v;
  memcpy(v.f, p, sizeof v.f);
  return v;
}
static void dt__wv_st(float *p, dt__wv v) { memcpy(p, v.f, sizeof v.f); }
static dt__wv dt__wv_add(dt__wv a, dt__wv b) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] += b.f[i];
  return a;
}
static dt__wv dt__wv_sub(dt__wv a, dt__wv b) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] -= b.f[i];
  return a;
}
static dt__wv dt__wv_mul(dt__wv a, float s) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] *= s;
  return a;
}
typedef int64_t dt__wvm;
static void dt__wv_mask(dt__wvm *m, int64_t n) { *m = n; }
static void dt__wv_keep(dt__wv *v, int64_t n) {
  for (int64_t i = n < 0 ? 0 : n; i < DT__WINO_L; i++) v->f[i] = 0.0f;
}
#  define DT__WV_KEEP(v, m) dt__wv_keep(&(v), m)
#  define DT__WV_LD(p) dt__wv_ld(p)
#  define DT__WV_ST(p, v) dt__wv_st(p, v)
#  define DT__WV_ADD(a, b) dt__wv_add(a, b)
#  define DT__WV_SUB(a, b) dt__wv_sub(a, b)
#  define DT__WV_MUL(a, s) dt__wv_mul(a, s)
#  define DT__WV_NEG(a) dt__wv_mul(a, -1.0f)
#endif

typedef struct dt__wino {
  int64_t th, tw, tpi; /* tile rows, tile columns, tiles per image */
  int64_t lw;          /* tw rounded up to DT__WINO_L */
  int64_t rows;        /* padded input rows the tiles read: 2*th + 4 */
  int64_t nb;          /* images per group */
} dt__wino;

static int dt__wino_use(const dt__conv_geom *q) {
  return q->kh == 5 && q->kw == 5 && q->s == 1 && q->c >= 8 && q->o >= 8;
}

static void dt__wino_geometry(const dt__conv_geom *q, dt__wino *z) {
  z->th = (q->ho + 1) / 2;
  z->tw = (q->wo + 1) / 2;
  z->tpi = z->th * z->tw;
  z->lw = (z->tw + DT__WINO_L - 1) / DT__WINO_L * DT__WINO_L;
  z->rows = 2 * z->th + 4;
  /* About one GEMM B panel of tiles per group (fewer were slower, and so
   * were more: V and M of a group then fall out of the caches), and V and M
   * within 4 MiB. */
  int64_t nb = (DT__WINO_COLS + z->tpi - 1) / z->tpi;
  if (nb > q->n) nb = q->n;
  while (nb > 1 && 36 * (q->c + q->o) * nb * z->tpi > (1 << 20)) nb--;
  z->nb = nb;
}

/* Floats of per-plane scratch the transforms need. */
static int64_t dt__wino_scratch(const dt__wino *z) {
  return z->rows * 6 * z->lw + 6 * (z->lw + 16) + 2 * (z->lw + 8) + 12 * z->lw;
}

/* The transformed tiles of a group (V, M and their gradients) are matrices
 * with rows of ld = T + DT__WINO_L floats: a tile row is stored as whole
 * vectors, whose lanes past the row spill into the next tile row (written
 * after it) or into the slack at the end. Entry xi of tile (ti, tj) of a
 * plane is at [xi * xs + ti * tw + tj]. */

/* Input transform of one plane [H, W]: v = B^T d B for every tile. */
static DT__WINO_INLINE void dt__wino_in(const dt__conv_geom *q, const dt__wino *z, const float *plane, float *v, int64_t xs,
                        float *scr) {
  int64_t lw = z->lw, tw = z->tw;
  float *hb = scr, *e = hb + z->rows * 6 * lw, *od = e + lw + 8;
  for (int64_t r = 0; r < z->rows; r++) { /* each padded row: deinterleave, then B^T along it */
    int64_t ir = r - q->p;
    float *hr = hb + r * 6 * lw;
    if (ir < 0 || ir >= q->h) {
      memset(hr, 0, (size_t)(6 * lw) * sizeof(float));
      continue;
    }
    const float *src = plane + ir * q->w;
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
      e[k] = c0 >= 0 && c0 < q->w ? src[c0] : 0.0f;
      od[k] = c1 >= 0 && c1 < q->w ? src[c1] : 0.0f;
    }
    /* column 2*tj + b of the padded row: e[tj + b/2] for even b, od[tj + b/2] for odd b */
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      dt__wv a = DT__WV_LD(e + l), b = DT__WV_LD(od + l), c = DT__WV_LD(e + l + 1), d = DT__WV_LD(od + l + 1);
      dt__wv f = DT__WV_LD(e + l + 2), h = DT__WV_LD(od + l + 2);
      DT__WV_ST(hr + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(a, 4.0f), DT__WV_MUL(c, 5.0f)), f));
      DT__WV_ST(hr + lw + l, DT__WV_SUB(DT__WV_ADD(d, f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)));
      DT__WV_ST(hr + 2 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, c), 4.0f), DT__WV_SUB(f, d)));
      DT__WV_ST(hr + 3 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(d, b), 2.0f), DT__WV_SUB(f, c)));
      DT__WV_ST(hr + 4 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, d), 2.0f), DT__WV_SUB(f, c)));
      DT__WV_ST(hr + 5 * lw + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(b, 4.0f), DT__WV_MUL(d, 5.0f)), h));
    }
  }
  for (int64_t ti = 0; ti < z->th; ti++) { /* B^T down the 6 padded rows of each tile row */
    for (int64_t xb = 0; xb < 6; xb++) {
      const float *p0 = hb + 2 * ti * 6 * lw + xb * lw;
      float *o = v + xb * xs + ti * tw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * lw + l), c = DT__WV_LD(p0 + 12 * lw + l);
        dt__wv d = DT__WV_LD(p0 + 18 * lw + l), f = DT__WV_LD(p0 + 24 * lw + l), h = DT__WV_LD(p0 + 30 * lw + l);
        DT__WV_ST(o + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(a, 4.0f), DT__WV_MUL(c, 5.0f)), f));
        DT__WV_ST(o + 6 * xs + l, DT__WV_SUB(DT__WV_ADD(d, f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)));
        DT__WV_ST(o + 12 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, c), 4.0f), DT__WV_SUB(f, d)));
        DT__WV_ST(o + 18 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(d, b), 2.0f), DT__WV_SUB(f, c)));
        DT__WV_ST(o + 24 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, d), 2.0f), DT__WV_SUB(f, c)));
        DT__WV_ST(o + 30 * xs + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(b, 4.0f), DT__WV_MUL(d, 5.0f)), h));
      }
    }
  }
}

/* g_0..g_5 = B applied to a..h: g_i = sum_j BT[j][i] * (a, b, c, d, f, h)[j]. */
#define DT__WINO_B(a, b, c, d, f, h, G0, G1, G2, G3, G4, G5)                                                   \
  do {                                                                                                         \
    G0 = DT__WV_MUL(a, 4.0f);                                                                                  \
    G1 = DT__WV_ADD(DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(c, b), 4.0f), DT__WV_MUL(DT__WV_SUB(f, d), 2.0f)),        \
                    DT__WV_MUL(h, 4.0f));                                                                      \
    G2 = DT__WV_NEG(DT__WV_ADD(DT__WV_ADD(DT__WV_MUL(a, 5.0f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)),           \
                               DT__WV_ADD(d, f)));                                                             \
    G3 = DT__WV_SUB(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), DT__WV_MUL(h, 5.0f));    \
    G4 = DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f);                                        \
    G5 = h;                                                                                                    \
  } while (0)

/* The adjoint of the input transform: gx [H, W] += the sum over the tiles
 * of B dv B^T, each at its tile's place. */
static DT__WINO_INLINE void dt__wino_in_adjoint(const dt__conv_geom *q, const dt__wino *z, const float *dv, int64_t xs, float *gx,
                                float *scr) {
  int64_t lw = z->lw, tw = z->tw, gp = lw + 16;
  float *hb = scr, *gb = hb + z->rows * 6 * lw, *e = gb + 6 * gp, *od = e + lw + 8;
  memset(gb, 0, (size_t)(6 * gp) * sizeof(float));
  dt__wvm last;
  dt__wv_mask(&last, tw - (lw - DT__WINO_L));
  for (int64_t ti = 0; ti < z->th; ti++) { /* B down the tile: added to padded rows 2*ti .. 2*ti+5 */
    for (int64_t xb = 0; xb < 6; xb++) {
      const float *p0 = dv + xb * xs + ti * tw;
      float *h0 = hb + 2 * ti * 6 * lw + xb * lw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * xs + l), c = DT__WV_LD(p0 + 12 * xs + l);
        dt__wv d = DT__WV_LD(p0 + 18 * xs + l), f = DT__WV_LD(p0 + 24 * xs + l), h = DT__WV_LD(p0 + 30 * xs + l);
        if (l + DT__WINO_L > tw) { /* lanes past the tile row hold the next row's tiles */
          DT__WV_KEEP(a, last);
          DT__WV_KEEP(b, last);
          DT__WV_KEEP(c, last);
          DT__WV_KEEP(d, last);
          DT__WV_KEEP(f, last);
          DT__WV_KEEP(h, last);
        }
        dt__wv g[6];
        DT__WINO_B(a, b, c, d, f, h, g[0], g[1], g[2], g[3], g[4], g[5]);
        for (int i = 0; i < 6; i++) { /* rows past 2*ti + 3 are new in this tile row */
          float *t = h0 + i * 6 * lw + l;
          if (ti > 0 && i < 4) DT__WV_ST(t, DT__WV_ADD(DT__WV_LD(t), g[i]));
          else DT__WV_ST(t, g[i]);
        }
      }
    }
  }
  for (int64_t r = 0; r < z->rows; r++) { /* B along each padded row, then into gx */
    int64_t ir = r - q->p;
    if (ir < 0 || ir >= q->h) continue;
    const float *p0 = hb + r * 6 * lw;
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + lw + l), c = DT__WV_LD(p0 + 2 * lw + l);
      dt__wv d = DT__WV_LD(p0 + 3 * lw + l), f = DT__WV_LD(p0 + 4 * lw + l), h = DT__WV_LD(p0 + 5 * lw + l);
      dt__wv g[6];
      DT__WINO_B(a, b, c, d, f, h, g[0], g[1], g[2], g[3], g[4], g[5]);
      for (int i = 0; i < 6; i++) DT__WV_ST(gb + i * gp + 2 + l, g[i]);
    }
    /* column 2*k + (0 or 1) of the padded row gets g_b of tile tj = k - b/2
     * for the even (odd) b; gb rows are zero outside [2, 2 + lw) */
    for (int64_t k = 0; k < lw + 2; k += DT__WINO_L) {
      DT__WV_ST(e + k, DT__WV_ADD(DT__WV_ADD(DT__WV_LD(gb + 2 + k), DT__WV_LD(gb + 2 * gp + 1 + k)),
                                  DT__WV_LD(gb + 4 * gp + k)));
      DT__WV_ST(od + k, DT__WV_ADD(DT__WV_ADD(DT__WV_LD(gb + gp + 2 + k), DT__WV_LD(gb + 3 * gp + 1 + k)),
                                   DT__WV_LD(gb + 5 * gp + k)));
    }
    float *dst = gx + ir * q->w;
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
      if (c0 >= 0 && c0 < q->w) dst[c0] += e[k];
      if (c1 >= 0 && c1 < q->w) dst[c1] += od[k];
    }
  }
}
#undef DT__WINO_B

/* Output transform of one output plane [Ho, Wo]: y = A^T m A + bias per tile,
 * the parts of the last tiles past Ho, Wo dropped. A^T = [1 1 1 1 1 0;
 * 0 1 -1 2 -2 1]. */
static DT__WINO_INLINE void dt__wino_out(const dt__conv_geom *q, const dt__wino *z, const float *m, int64_t xs, float *y, float bias,
                         float *scr) {
  int64_t lw = z->lw, tw = z->tw, wo = q->wo;
  float *s = scr, *ev = s + 12 * lw, *od = ev + lw;
  for (int64_t ti = 0; ti < z->th; ti++) {
    for (int64_t xb = 0; xb < 6; xb++) { /* down the columns */
      const float *p0 = m + xb * xs + ti * tw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * xs + l), c = DT__WV_LD(p0 + 12 * xs + l);
        dt__wv d = DT__WV_LD(p0 + 18 * xs + l), f = DT__WV_LD(p0 + 24 * xs + l), h = DT__WV_LD(p0 + 30 * xs + l);
        DT__WV_ST(s + xb * lw + l, DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f));
        DT__WV_ST(s + (6 + xb) * lw + l, DT__WV_ADD(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), h));
      }
    }
    for (int64_t i = 0; i < 2 && 2 * ti + i < q->ho; i++) { /* along the rows */
      const float *p0 = s + i * 6 * lw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + lw + l), c = DT__WV_LD(p0 + 2 * lw + l);
        dt__wv d = DT__WV_LD(p0 + 3 * lw + l), f = DT__WV_LD(p0 + 4 * lw + l), h = DT__WV_LD(p0 + 5 * lw + l);
        DT__WV_ST(ev + l, DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f));
        DT__WV_ST(od + l, DT__WV_ADD(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), h));
      }
      float *yr = y + (2 * ti + i) * wo;
      int64_t full = wo / 2;
      for (int64_t l = 0; l < full; l++) {
        yr[2 * l] = ev[l] + bias;
        yr[2 * l + 1] = od[l] + bias;
      }
      if (wo % 2) yr[wo - 1] = ev[full] + bias;
    }
  }
}

/* The adjoint of the output transform for one gradient plane gy [Ho, Wo]:
 * dm = A gy A^T per tile (entries past Ho, Wo count as 0). */
static DT__WINO_INLINE void dt__wino_out_adjoint(const dt__conv_geom *q, const dt__wino *z, const float *gy, float *dm, int64_t xs,
                                 float *scr) {
  int64_t lw = z->lw, tw = z->tw, wo = q->wo;
  float *s = scr;
  for (int64_t ti = 0; ti < z->th; ti++) {
    dt__wv r[2][2];
    for (int64_t i = 0; i < 2; i++) { /* rows 2*ti + i deinterleaved into s[i][0] (even), s[i][1] (odd) */
      int64_t oh = 2 * ti + i;
      int64_t l = 0;
      float *ev = s + i * 2 * lw, *od = ev + lw;
      if (oh < q->ho) { /* deinterleave the row */
        const float *gr = gy + oh * wo;
        for (; 2 * l + 1 < wo; l++) {
          ev[l] = gr[2 * l];
          od[l] = gr[2 * l + 1];
        }
        if (2 * l < wo) {
          ev[l] = gr[2 * l];
          od[l] = 0.0f;
          l++;
        }
      }
      for (; l < lw; l++) ev[l] = od[l] = 0.0f;
    }
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      for (int i = 0; i < 2; i++) {
        r[i][0] = DT__WV_LD(s + i * 2 * lw + l);
        r[i][1] = DT__WV_LD(s + i * 2 * lw + lw + l);
      }
      /* along the rows: t_i[b] = sum_j gy[i][j] AT[j][b], then down the columns the same way */
      dt__wv t[2][6];
      for (int i = 0; i < 2; i++) {
        dt__wv a = r[i][0], b = r[i][1];
        t[i][0] = a;
        t[i][1] = DT__WV_ADD(a, b);
        t[i][2] = DT__WV_SUB(a, b);
        t[i][3] = DT__WV_ADD(a, DT__WV_MUL(b, 2.0f));
        t[i][4] = DT__WV_SUB(a, DT__WV_MUL(b, 2.0f));
        t[i][5] = b;
      }
      float *o = dm + ti * tw + l;
      for (int xb = 0; xb < 6; xb++) {
        dt__wv a = t[0][xb], b = t[1][xb];
        DT__WV_ST(o + xb * xs, a);
        DT__WV_ST(o + (6 + xb) * xs, DT__WV_ADD(a, b));
        DT__WV_ST(o + (12 + xb) * xs, DT__WV_SUB(a, b));
        DT__WV_ST(o + (18 + xb) * xs, DT__WV_ADD(a, DT__WV_MUL(b, 2.0f)));
        DT__WV_ST(o + (24 + xb) * xs, DT__WV_SUB(a, DT__WV_MUL(b, 2.0f)));
        DT__WV_ST(o + (30 + xb) * xs, b);
      }
    }
  }
}

/* G of F(2, 5): 6 x 5. */
static const float dt__wino_g[6][5] = {
    {1.0f / 4, 0.0f, 0.0f, 0.0f, 0.0f},
    {-1.0f / 6, -1.0f / 6, -1.0f / 6, -1.0f / 6, -1.0f / 6},
    {-1.0f / 6, 1.0f / 6, -1.0f / 6, 1.0f / 6, -1.0f / 6},
    {1.0f / 24, 1.0f / 12, 1.0f / 6, 1.0f / 3, 2.0f / 3},
    {1.0f / 24, -1.0f / 12, 1.0f / 6, -1.0f / 3, 2.0f / 3},
    {0.0f, 0.0f, 0.0f, 0.0f, 1.0f},
};

/* u[xi][o][c] = (G w[o][c] G^T)[xi] for every kernel of w [O, C, 5, 5]. */
static void dt__wino_kernels(const dt__conv_geom *q, const float *w, float *u) {
  int64_t oc = q->o * q->c;
  for (int64_t k = 0; k < oc; k++) {
    const float *g = w + k * 25;
    float t[6][5];
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int i = 0; i < 5; i++) acc += dt__wino_g[a][i] * g[i * 5 + j];
        t[a][j] = acc;
      }
    for (int a = 0; a < 6; a++)
      for (int b = 0; b < 6; b++) {
        float acc = 0.0f;
        for (int j = 0; j < 5; j++) acc += t[a][j] * dt__wino_g[b][j];
        u[(a * 6 + b) * oc + k] = acc;
      }
  }
}

/* The adjoint: gw[o][c] += G^T du[.][o][c] G. */
static void dt__wino_kernels_adjoint(const dt__conv_geom *q, const float *du, float *gw) {
  int64_t oc = q->o * q->c;
  for (int64_t k = 0; k < oc; k++) {
    float t[6][5];
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int b = 0; b < 6; b++) acc += du[(a * 6 + b) * oc + k] * dt__wino_g[b][j];
        t[a][j] = acc;
      }
    float *g = gw + k * 25;
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int a = 0; a < 6; a++) acc += dt__wino_g[a][i] * t[a][j];
        g[i * 5 + j] += acc;
      }
  }
}

/* The steps of a group of images, each split over the intra-op threads by
 * planes (transforms) or by xi (GEMMs): every part writes its own planes or
 * matrices, each computed exactly as on one thread, so results do not
 * depend on the number of threads. */
enum { DT__WINO_IN, DT__WINO_MUL, DT__WINO_OUT, DT__WINO_OUT_ADJ, DT__WINO_MUL_DU, DT__WINO_MUL_DV, DT__WINO_IN_ADJ };
typedef struct dt__wino_job {
  const dt__conv_geom *q;
  const dt__wino *z;
  int step;
  int64_t n0, nbb, tt, ld, nscr;
  const float *x, *b, *u, *gy;
  float *v, *m, *y, *du, *dv, *gx, *scr;
} dt__wino_job;

static DT__WINO_INLINE void dt__wino_part_body(void *arg, int part, int nparts) {
  const dt__wino_job *jb = (const dt__wino_job *)arg;
  const dt__conv_geom *q = jb->q;
  const dt__wino *z = jb->z;
  int64_t hw = q->h * q->w, chw = q->c * hw, op = q->o * q->pp, oc = q->o * q->c, ld = jb->ld, tt = jb->tt;
  int64_t total = jb->step == DT__WINO_IN || jb->step == DT__WINO_IN_ADJ    ? q->c
                  : jb->step == DT__WINO_OUT || jb->step == DT__WINO_OUT_ADJ ? q->o
                                                                             : 36;
  int64_t i0 = total * part / nparts, i1 = total * (part + 1) / nparts;
  float *scr = jb->scr + part * jb->nscr;
  const float *x = jb->x + jb->n0 * chw;
  for (int64_t i = i0; i < i1; i++) {
    switch (jb->step) {
    case DT__WINO_IN: /* images in increasing order: see the spill note above */
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_in(q, z, x + j * chw + i * hw, jb->v + i * ld + j * z->tpi, q->c * ld, scr);
      break;
    case DT__WINO_MUL:
      dt_sgemm(0, 0, q->o, tt, q->c, 1.0f, jb->u + i * oc, q->c, jb->v + i * q->c * ld, ld, 0.0f,
               jb->m + i * q->o * ld, ld);
      break;
    case DT__WINO_OUT:
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_out(q, z, jb->m + i * ld + j * z->tpi, q->o * ld, jb->y + (jb->n0 + j) * op + i * q->pp,
                     jb->b ? jb->b[i] : 0.0f, scr);
      break;
    case DT__WINO_OUT_ADJ:
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_out_adjoint(q, z, jb->gy + (jb->n0 + j) * op + i * q->pp, jb->m + i * ld + j * z->tpi, q->o * ld,
                             scr);
      break;
    case DT__WINO_MUL_DU:
      dt_sgemm(0, 1, q->o, q->c, tt, 1.0f, jb->m + i * q->o * ld, ld, jb->v + i * q->c * ld, ld,
               jb->n0 == 0 ? 0.0f : 1.0f, jb->du + i * oc, q->c);
      break;
    case DT__WINO_MUL_DV:
      dt_sgemm(1, 0, q->c, tt, q->o, 1.0f, jb->u + i * oc, q->c, jb->m + i * q->o * ld, ld, 0.0f,
               jb->dv + i * q->c * ld, ld);
      break;
    default: /* DT__WINO_IN_ADJ */
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_in_adjoint(q, z, jb->dv + i * ld + j * z->tpi, q->c * ld, jb->gx + (jb->n0 + j) * chw + i * hw,
                            scr);
      break;
    }
  }
}

static void dt__wino_part(void *arg, int part, int nparts) { dt__wino_part_body(arg, part, nparts); }
#ifdef DT__CONV_AVX
__attribute__((target("avx2"))) static void dt__wino_part_avx2(void *arg, int part, int nparts) {
  dt__wino_part_body(arg, part, nparts);
}
#endif

static void dt__wino_run(dt__wino_job *jb, int step, int parts) {
  jb->step = step;
#ifdef DT__CONV_AVX
  if (__builtin_cpu_supports("avx2")) {
    dt__par_run(parts, dt__wino_part_avx2, jb);
    return;
  }
#endif
  dt__par_run(parts, dt__wino_part, jb);
}

/* Sets up a job: scratch per part, and the group buffers (v and dv only
 * when asked). Returns the number of parts, 0 when the arena failed. */
static int dt__wino_setup(dt_graph *g, dt__wino_job *jb, const dt__conv_geom *q, const dt__wino *z, int want_v,
                          int want_dv) {
  int parts = dt__par_threads();
  if (parts < 1) parts = 1;
  if (parts > 36) parts = 36;
  int64_t ldmax = z->nb * z->tpi + DT__WINO_L;
  memset(jb, 0, sizeof *jb);
  jb->q = q;
  jb->z = z;
  jb->nscr = dt__wino_scratch(z);
  jb->scr = dt__arena_floats(g, parts * jb->nscr);
  jb->u = NULL;
  jb->v = want_v ? dt__arena_floats(g, 36 * q->c * ldmax) : NULL;
  jb->dv = want_dv ? dt__arena_floats(g, 36 * q->c * ldmax) : NULL;
  jb->m = dt__arena_floats(g, 36 * q->o * ldmax);
  return g->err == DTRAIN_OK ? parts : 0;
}

static void dt__wino_group(dt__wino_job *jb, int64_t n0) {
  jb->n0 = n0;
  jb->nbb = DT__MIN(jb->z->nb, jb->q->n - n0);
  jb->tt = jb->nbb * jb->z->tpi;
  jb->ld = jb->tt + DT__WINO_L;
}

static void dt__wino_forward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *b,
                             float *y) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  float *u = dt__arena_floats(g, 36 * q->o * q->c);
  int parts = dt__wino_setup(g, &jb, q, &z, 1, 0);
  if (!parts || g->err != DTRAIN_OK) return;
  dt__wino_kernels(q, w, u);
  jb.u = u;
  jb.x = x;
  jb.b = b;
  jb.y = y;
  for (int64_t n0 = 0; n0 < q->n; n0 += z.nb) {
    dt__wino_group(&jb, n0);
    dt__wino_run(&jb, DT__WINO_IN, parts);
    dt__wino_run(&jb, DT__WINO_MUL, parts);
    dt__wino_run(&jb, DT__WINO_OUT, parts);
  }
}

/* gy: the output gradient; m holds dM. */
static void dt__wino_backward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *gy,
                              float *gx, float *gw) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  int64_t oc = q->o * q->c;
  float *u = gx ? dt__arena_floats(g, 36 * oc) : NULL, *du = gw ? dt__arena_floats(g, 36 * oc) : NULL;
  int parts = dt__wino_setup(g, &jb, q, &z, gw != NULL, gx != NULL);
  if (!parts || g->err != DTRAIN_OK) return;
  if (gx) dt__wino_kernels(q, w, u);
  jb.u = u;
  jb.du = du;
  jb.x = x;
  jb.gy = gy;
  jb.gx = gx;
  for (int64_t n0 = 0; n0 < q->n; n0 += z.nb) {
    dt__wino_group(&jb, n0);
    dt__wino_run(&jb, DT__WINO_OUT_ADJ, parts);
    if (gw) {
      dt__wino_run(&jb, DT__WINO_IN, parts);
      dt__wino_run(&jb, DT__WINO_MUL_DU, parts);
    }
    if (gx) {
      dt__wino_run(&jb, DT__WINO_MUL_DV, parts);
      dt__wino_run(&jb, DT__WINO_IN_ADJ, parts);
    }
  }
  if (gw) dt__wino_kernels_adjoint(q, du, gw);
}

static void dt__conv_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, y->iaux[0], y->iaux[1]);
  const float *go = y->grad;
  int64_t chw = q.c * q.h * q.w, op = q.o * q.pp, cols = q.nb * q.pp;
  if (gb) {
    /* In double, in four interleaved partial sums (a fixed order): one
     * dependent chain of double adds would take most of this function. */
    for (int64_t o = 0; o < q.o; o++) {
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#ifdef DT__CONV_SSE
      /* The same four sums, two per register (lanes: s0 s1 | s2 s3). */
      __m128d a01 = _mm_setzero_pd(), a23 = _mm_setzero_pd();
      for (int64_t n = 0; n < q.n; n++) {
        const float *r = go + n * op + o * q.pp;
        int64_t i = 0;
        for (; i + 4 <= q.pp; i += 4) {
          __m128 v = _mm_loadu_ps(r + i);
          a01 = _mm_add_pd(a01, _mm_cvtps_pd(v));
          a23 = _mm_add_pd(a23, _mm_cvtps_pd(_mm_movehl_ps(v, v)));
        }
        for (; i < q.pp; i++) a01 = _mm_add_sd(a01, _mm_set_sd((double)r[i]));
      }
      s0 = _mm_cvtsd_f64(a01);
      s1 = _mm_cvtsd_f64(_mm_unpackhi_pd(a01, a01));
      s2 = _mm_cvtsd_f64(a23);
      s3 = _mm_cvtsd_f64(_mm_unpackhi_pd(a23, a23));
#else
      for (int64_t n = 0; n < q.n; n++) {
        const float *r = go + n * op + o * q.pp;
        int64_t i = 0;
        for (; i + 4 <= q.pp; i += 4) {
          s0 += (double)r[i];
          s1 += (double)r[i + 1];
          s2 += (double)r[i + 2];
          s3 += (double)r[i + 3];
        }
        for (; i < q.pp; i++) s0 += (double)r[i];
      }
#endif
      gb[o] += (float)((s0 + s1) + (s2 + s3));
    }
  }
  if (!gx && !gw) return;
  if (dt__wino_use(&q)) {
    dt__wino_backward(g, &q, x->data, w->data, go, gx, gw);
    return;
  }
  float *col = NULL, *gcol = NULL, *gyt = NULL;
  if (gw && !q.direct) col = dt__arena_floats(g, q.k * cols);
  if (gx && !q.direct) gcol = dt__arena_floats(g, q.k * cols);
  if (q.nb > 1) gyt = dt__arena_floats(g, q.o * cols);
  if (g->err != DTRAIN_OK) return;
  for (int64_t n0 = 0; n0 < q.n; n0 += q.nb) {
    int64_t nbb = DT__MIN(q.nb, q.n - n0), ld = nbb * q.pp;
    const float *gy = go + n0 * op;
    if (q.nb > 1) {
      for (int64_t j = 0; j < nbb; j++)
        for (int64_t o = 0; o < q.o; o++)
          memcpy(gyt + o * ld + j * q.pp, go + (n0 + j) * op + o * q.pp, (size_t)q.pp * sizeof(float));
      gy = gyt;
    }
    if (gw) {
      const float *cp = x->data + n0 * chw;
      if (!q.direct) {
        for (int64_t j = 0; j < nbb; j++) dt__conv_im2col(&q, x->data + (n0 + j) * chw, col + j * q.pp, ld);
        cp = col;
      }
      dt_sgemm(0, 1, q.o, q.k, ld, 1.0f, gy, ld, cp, ld, 1.0f, gw, q.k);
    }
    if (gx) {
      if (q.direct) {
        dt_sgemm(1, 0, q.k, ld, q.o, 1.0f, w->data, q.k, gy, ld, 1.0f, gx + n0 * chw, ld);
      } else {
        dt_sgemm(1, 0, q.k, ld, q.o, 1.0f, w->data, q.k, gy, ld, 0.0f, gcol, ld);
        for (int64_t j = 0; j < nbb; j++) dt__conv_col2im(&q, gcol + j * q.pp, ld, gx + (n0 + j) * chw);
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  static const char *op = "dt_conv2d";
  if (b ? !dt__begin(g, op, 3, x, w, b) : !dt__begin(g, op, 2, x, w)) return NULL;
  char sx[96], sw[96], sb[96];
  dt_shape_str(x, sx, sizeof sx);
  dt_shape_str(w, sw, sizeof sw);
  if (x->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: x %s must have rank 4 [N,C,H,W]", op, sx);
  if (w->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: w %s must have rank 4 [O,C,kh,kw]", op, sw);
  if (w->shape[1] != x->shape[1])
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: channels differ (x %s has %lld, w %s has %lld)", op, sx,
                                 (long long)x->shape[1], sw, (long long)w->shape[1]);
  if (b && (b->ndim != 1 || b->shape[0] != w->shape[0]))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: bias %s must be [%lld] for w %s", op,
                                 dt_shape_str(b, sb, sizeof sb), (long long)w->shape[0], sw);
  if (stride < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: stride %d (must be >= 1), x %s, w %s", op, stride,
                                 sx, sw);
  if (padding < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: padding %d (must be >= 0), x %s, w %s", op,
                                 padding, sx, sw);
  int64_t hp = x->shape[2] + 2 * (int64_t)padding, wp = x->shape[3] + 2 * (int64_t)padding;
  if (w->shape[2] > hp || w->shape[3] > wp)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE,
                                 "%s: kernel %lldx%lld larger than the padded input %lldx%lld (x %s, w %s, padding %d)",
                                 op, (long long)w->shape[2], (long long)w->shape[3], (long long)hp, (long long)wp, sx,
                                 sw, padding);
  if (g->device) return dt__dev_conv2d(g, x, w, b, stride, padding);
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, stride, padding);
  int64_t shape[4] = {q.n, q.o, q.ho, q.wo};
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  size_t kp;
  if (!dt__mul_size((size_t)q.k, (size_t)q.pp, &kp) || dt__too_many(kp))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrix of x %s, w %s too large", op, sx, sw);
  if (dt__wino_use(&q)) {
    dt__wino_forward(g, &q, x->data, w->data, b ? b->data : NULL, y->data);
    if (g->err != DTRAIN_OK) return NULL;
    y->iaux[0] = stride;
    y->iaux[1] = padding;
    dt__record(g, y, op, dt__conv_backward, x, w, b);
    return dt__finish(g, y);
  }
  int64_t chw = q.c * q.h * q.w, op_ = q.o * q.pp, cols = q.nb * q.pp;
  float *col = q.direct ? NULL : dt__arena_floats(g, q.k * cols);
  float *tmp = q.nb > 1 ? dt__arena_floats(g, q.o * cols) : NULL;
  if (g->err != DTRAIN_OK) return NULL;
  for (int64_t n0 = 0; n0 < q.n; n0 += q.nb) {
    int64_t nbb = DT__MIN(q.nb, q.n - n0), ld = nbb * q.pp;
    const float *cp = x->data + n0 * chw;
    if (!q.direct) {
      for (int64_t j = 0; j < nbb; j++) dt__conv_im2col(&q, x->data + (n0 + j) * chw, col + j * q.pp, ld);
      cp = col;
    }
    float *out = q.nb > 1 ? tmp : y->data + n0 * op_;
    if (b) {
      for (int64_t o = 0; o < q.o; o++)
        for (int64_t i = 0; i < ld; i++) out[o * ld + i] = b->data[o];
    }
    dt_sgemm(0, 0, q.o, ld, q.k, 1.0f, w->data, q.k, cp, ld, b ? 1.0f : 0.0f, out, ld);
    if (q.nb > 1) {
      for (int64_t j = 0; j < nbb; j++)
        for (int64_t o = 0; o < q.o; o++)
          memcpy(y->data + (n0 + j) * op_ + o * q.pp, tmp + o * ld + j * q.pp, (size_t)q.pp * sizeof(float));
    }
  }
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt__record(g, y, op, dt__conv_backward, x, w, b);
  return dt__finish(g, y);
}

/* ---- pooling --------------------------------------------------------------------------
 * No padding; Ho = (H - k)/s + 1. iaux: kernel, stride. Max pooling routes
 * the gradient to the first maximum of each window (a NaN wins). */

static int dt__pool_check(dt_graph *g, const char *op, dt_tensor *x, int kernel, int stride) {
  if (!dt__begin(g, op, 1, x)) return 0;
  char sx[96];
  dt_shape_str(x, sx, sizeof sx);
  if (x->ndim != 4) {
    dt__fail(g, DTRAIN_ERR_RANK, "%s: x %s must have rank 4 [N,C,H,W]", op, sx);
    return 0;
  }
  if (kernel < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: kernel %d (must be >= 1), x %s", op, kernel, sx);
    return 0;
  }
  if (stride < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: stride %d (must be >= 1), x %s", op, stride, sx);
    return 0;
  }
  if (kernel > x->shape[2] || kernel > x->shape[3]) {
    dt__fail(g, DTRAIN_ERR_SHAPE, "%s: kernel %d larger than the input %lldx%lld (x %s)", op, kernel,
             (long long)x->shape[2], (long long)x->shape[3], sx);
    return 0;
  }
  return 1;
}

static dt_tensor *dt__pool_new(dt_graph *g, const char *op, dt_tensor *x, int kernel, int stride) {
  int64_t shape[4] = {x->shape[0], x->shape[1], (x->shape[2] - kernel) / stride + 1,
                      (x->shape[3] - kernel) / stride + 1};
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  y->iaux[0] = kernel;
  y->iaux[1] = stride;
  return y;
}

/* The window of output (oh, ow) starts at input offset oh*s*w + ow*s. Its
 * maximum is the first element that is greater than all before it, or the
 * first NaN: v replaces best when v > best, or v is NaN and best is not. */
#ifdef DT__CONV_SSE
static __m128 dt__pool_max4(__m128 best, __m128 v) {
  __m128 take = _mm_or_ps(_mm_cmpgt_ps(v, best), _mm_and_ps(_mm_cmpunord_ps(v, v), _mm_cmpord_ps(best, best)));
  return _mm_or_ps(_mm_and_ps(take, v), _mm_andnot_ps(take, best));
}
#endif

/* Backward finds the winner again instead of keeping an index per output
 * from the forward pass: the first element of the window equal to the
 * output (the first NaN when the output is NaN) is the element the forward
 * pass picked, since the maximum is the first occurrence of its value. */
static void dt__pool_max_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t k = y->iaux[0], s = y->iaux[1];
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3];
  const float *go = y->grad, *yd = y->data;
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    float *gp = gx + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      int64_t ow = 0;
#ifdef DT__CONV_SSE
      if (k == 2 && s == 2) { /* 4 windows at a time: masks of the winners, no branches */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
        float *g0 = gp + 2 * oh * w, *g1 = g0 + w;
        for (; ow + 4 <= wo; ow += 4) {
          int64_t o = (pl * ho + oh) * wo + ow;
          __m128 best = _mm_loadu_ps(yd + o), gv = _mm_loadu_ps(go + o);
          __m128 bnan = _mm_cmpunord_ps(best, best);
          __m128 a0 = _mm_loadu_ps(r0 + 2 * ow), a1 = _mm_loadu_ps(r0 + 2 * ow + 4);
          __m128 b0 = _mm_loadu_ps(r1 + 2 * ow), b1 = _mm_loadu_ps(r1 + 2 * ow + 4);
          __m128 v[4], e[4];
          v[0] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
          v[1] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
          v[2] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
          v[3] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
          __m128 taken = _mm_setzero_ps();
          for (int t = 0; t < 4; t++) {
            __m128 eq = _mm_or_ps(_mm_cmpeq_ps(v[t], best), _mm_and_ps(bnan, _mm_cmpunord_ps(v[t], v[t])));
            eq = _mm_andnot_ps(taken, eq); /* the first match only */
            taken = _mm_or_ps(taken, eq);
            e[t] = _mm_and_ps(eq, gv);
          }
          _mm_storeu_ps(g0 + 2 * ow, _mm_add_ps(_mm_loadu_ps(g0 + 2 * ow), _mm_unpacklo_ps(e[0], e[1])));
          _mm_storeu_ps(g0 + 2 * ow + 4, _mm_add_ps(_mm_loadu_ps(g0 + 2 * ow + 4), _mm_unpackhi_ps(e[0], e[1])));
          _mm_storeu_ps(g1 + 2 * ow, _mm_add_ps(_mm_loadu_ps(g1 + 2 * ow), _mm_unpacklo_ps(e[2], e[3])));
          _mm_storeu_ps(g1 + 2 * ow + 4, _mm_add_ps(_mm_loadu_ps(g1 + 2 * ow + 4), _mm_unpackhi_ps(e[2], e[3])));
        }
      }
#endif
      for (; ow < wo; ow++) {
        int64_t o = (pl * ho + oh) * wo + ow, at = oh * s * w + ow * s, t0 = at;
        float best = yd[o];
        int nan = best != best;
        /* Scan backwards so that the first match is the one that stays;
         * no early exit, so the compiler can use conditional moves. */
        for (int64_t i = k - 1; i >= 0; i--) {
          for (int64_t j = k - 1; j >= 0; j--) {
            int64_t t = t0 + i * w + j;
            float v = xp[t];
            if (v == best || (nan && v != v)) at = t;
          }
        }
        gp[at] += go[o];
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_max_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride) {
  static const char *op = "dt_max_pool2d";
  if (!dt__pool_check(g, op, x, kernel, stride)) return NULL;
  if (g->device) return dt__dev_pool(g, x, kernel, stride, 1, op);
  dt_tensor *y = dt__pool_new(g, op, x, kernel, stride);
  if (!y) return NULL;
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3], k = kernel, s = stride;
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      float *yo = y->data + (pl * ho + oh) * wo;
      int64_t ow = 0;
#ifdef DT__CONV_SSE
      if (k == 2 && s == 2) { /* the common 2x2 pooling: 4 outputs from 2 x 8 inputs */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
        for (; ow + 4 <= wo; ow += 4) {
          __m128 a0 = _mm_loadu_ps(r0 + 2 * ow), a1 = _mm_loadu_ps(r0 + 2 * ow + 4);
          __m128 b0 = _mm_loadu_ps(r1 + 2 * ow), b1 = _mm_loadu_ps(r1 + 2 * ow + 4);
          __m128 best = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
          best = dt__pool_max4(best, _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
          best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)));
          best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
          _mm_storeu_ps(yo + ow, best);
        }
      }
#endif
      for (; ow < wo; ow++) {
        const float *win = xp + oh * s * w + ow * s;
        float best = win[0];
        for (int64_t i = 0; i < k; i++) {
          for (int64_t j = 0; j < k; j++) {
            float v = win[i * w + j];
            if (v > best || (v != v && best == best)) best = v;
          }
        }
        yo[ow] = best;
      }
    }
  }
  dt__record(g, y, op, dt__pool_max_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

static void dt__pool_avg_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t k = y->iaux[0], s = y->iaux[1];
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3];
  float kk = (float)(k * k);
  const float *go = y->grad;
  for (int64_t pl = 0; pl < planes; pl++) {
    float *gp = gx + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      for (int64_t ow = 0; ow < wo; ow++) {
        float d = go[(pl * ho + oh) * wo + ow] / kk;
        for (int64_t i = 0; i < k; i++) {
          float *r = gp + (oh * s + i) * w + ow * s;
          for (int64_t j = 0; j < k; j++) r[j] += d;
        }
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_avg_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride) {
  static const char *op = "dt_avg_pool2d";
  if (!dt__pool_check(g, op, x, kernel, stride)) return NULL;
  if (g->device) return dt__dev_pool(g, x, kernel, stride, 0, op);
  dt_tensor *y = dt__pool_new(g, op, x, kernel, stride);
  if (!y) return NULL;
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3], k = kernel, s = stride;
  float kk = (float)(k * k);
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      for (int64_t ow = 0; ow < wo; ow++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < k; i++) {
          const float *r = xp + (oh * s + i) * w + ow * s;
          for (int64_t j = 0; j < k; j++) sum += r[j];
        }
        y->data[(pl * ho + oh) * wo + ow] = sum / kk;
      }
    }
  }
  dt__record(g, y, op, dt__pool_avg_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

#undef DT__WINO_L
#undef DT__WINO_COLS
#undef DT__WINO_INLINE
#undef DT__WV_LD
#undef DT__WV_ST
#undef DT__WV_ADD
#undef DT__WV_SUB
#undef DT__WV_MUL
#undef DT__WV_KEEP
#undef DT__WV_NEG
#undef DT__CONV_COLS
#undef DT__CONV_CAP
#ifdef DT__CONV_SSE
#  undef DT__CONV_SSE
#endif
#ifdef DT__CONV_AVX
#  undef DT__CONV_AVX
#endif
/* ======== end dt_ops_conv.c ======== */

/* ======== begin dt_params.c ======== */
/* ===========================================================================
 * dt_params.c -- flat parameter and gradient buffers, initializers
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */

#define DT__NAME_MAX 127
#define DT__PARAM_ALIGN_FLOATS 16 /* 64 bytes */

typedef struct dt__param {
  char name[DT__NAME_MAX + 1];
  size_t offset, size;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  int trainable, decay;
} dt__param;

struct dt_params {
  dt__param *items;
  int count, cap;
  float *data, *grad;
  size_t size;       /* floats used (end of the last parameter) */
  size_t capacity;   /* floats allocated */
  dt_rng rng;
};

/* ---- initializers ------------------------------------------------------------------- */

DTRAIN_API dt_init dt_init_zeros(void) { dt_init i; i.kind = DTRAIN_INIT_ZEROS; i.a = 0; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_constant(float v) { dt_init i; i.kind = DTRAIN_INIT_CONSTANT; i.a = v; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_uniform(float lo, float hi) { dt_init i; i.kind = DTRAIN_INIT_UNIFORM; i.a = lo; i.b = hi; return i; }
DTRAIN_API dt_init dt_init_normal(float mean, float std) { dt_init i; i.kind = DTRAIN_INIT_NORMAL; i.a = mean; i.b = std; return i; }
DTRAIN_API dt_init dt_init_glorot_uniform(void) { dt_init i; i.kind = DTRAIN_INIT_GLOROT_UNIFORM; i.a = 1; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_glorot_normal(void) { dt_init i; i.kind = DTRAIN_INIT_GLOROT_NORMAL; i.a = 1; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_he_uniform(void) { dt_init i; i.kind = DTRAIN_INIT_HE_UNIFORM; i.a = 0; i.b = 0; return i; }
DTRAIN_API dt_init dt_init_he_normal(void) { dt_init i; i.kind = DTRAIN_INIT_HE_NORMAL; i.a = 0; i.b = 0; return i; }

static void dt__params_fans(int ndim, const int64_t *shape, double *fan_in, double *fan_out) {
  if (ndim <= 1) {
    *fan_in = *fan_out = ndim == 1 ? (double)shape[0] : 1.0;
    return;
  }
  double rf = 1.0;
  for (int i = 2; i < ndim; i++) rf *= (double)shape[i];
  *fan_in = (double)shape[1] * rf;
  *fan_out = (double)shape[0] * rf;
}

DTRAIN_API dt_result dt_init_fill(float *dst, int ndim, const int64_t *shape, dt_init init, dt_rng *rng) {
  if (!dst || (ndim > 0 && !shape) || !rng) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_init_fill: NULL argument");
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS) return dt__error(DTRAIN_ERR_RANK, "dt_init_fill: %d dimensions", ndim);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double fi, fo;
  dt__params_fans(ndim, shape, &fi, &fo);
  double gain = init.a != 0.0f ? (double)init.a : 1.0;
  switch (init.kind) {
    case DTRAIN_INIT_ZEROS: memset(dst, 0, (size_t)n * sizeof(float)); break;
    case DTRAIN_INIT_ONES: for (int64_t i = 0; i < n; i++) dst[i] = 1.0f; break;
    case DTRAIN_INIT_CONSTANT: for (int64_t i = 0; i < n; i++) dst[i] = init.a; break;
    case DTRAIN_INIT_UNIFORM:
      if (!(init.b >= init.a)) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: uniform range [%g,%g) is empty", init.a, init.b);
      for (int64_t i = 0; i < n; i++) dst[i] = init.a + (init.b - init.a) * dt_rng_uniform(rng);
      break;
    case DTRAIN_INIT_NORMAL:
      if (!(init.b >= 0)) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: normal std %g < 0", init.b);
      for (int64_t i = 0; i < n; i++) dst[i] = init.a + init.b * dt_rng_normal(rng);
      break;
    case DTRAIN_INIT_GLOROT_UNIFORM:
    case DTRAIN_INIT_HE_UNIFORM: {
      double l = init.kind == DTRAIN_INIT_GLOROT_UNIFORM ? gain * sqrt(6.0 / (fi + fo)) : sqrt(6.0 / fi);
      for (int64_t i = 0; i < n; i++) dst[i] = (float)(l * (2.0 * (double)dt_rng_uniform(rng) - 1.0));
      break;
    }
    case DTRAIN_INIT_GLOROT_NORMAL:
    case DTRAIN_INIT_HE_NORMAL: {
      double s = init.kind == DTRAIN_INIT_GLOROT_NORMAL ? gain * sqrt(2.0 / (fi + fo)) : sqrt(2.0 / fi);
      for (int64_t i = 0; i < n; i++) dst[i] = (float)(s * (double)dt_rng_normal(rng));
      break;
    }
    default: return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_init_fill: unknown initializer %d", (int)init.kind);
  }
  return DTRAIN_OK;
}

/* ---- params --------------------------------------------------------------------------- */

DTRAIN_API dt_params *dt_params_create(uint64_t seed) {
  dt_params *p = (dt_params *)dt__calloc(sizeof *p);
  if (!p) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_params_create: out of memory");
    return NULL;
  }
  dt_rng_seed(&p->rng, seed);
  return p;
}

DTRAIN_API void dt_params_destroy(dt_params *p) {
  if (!p) return;
  dt__free(p->items, (size_t)p->cap * sizeof(dt__param));
  dt__free(p->data, p->capacity * sizeof(float));
  dt__free(p->grad, p->capacity * sizeof(float));
  dt__free(p, sizeof *p);
}

static int dt__params_add(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init, int trainable) {
  const char *fn = trainable ? "dt_params_add" : "dt_params_add_buffer";
  if (!p || !name || (ndim > 0 && !shape)) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  size_t nlen = strlen(name);
  if (nlen == 0 || nlen > DT__NAME_MAX)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name must have 1..%d bytes", fn, DT__NAME_MAX);
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_RANK, "%s('%s'): %d dimensions (allowed 0..%d)", fn, name, ndim, DTRAIN_MAX_DIMS);
  if (dt_params_find(p, name) >= 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name '%s' already used", fn, name);
  size_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] <= 0)
      return dt__error(shape[i] == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                       "%s('%s'): dimension %d is %lld (must be >= 1)", fn, name, i, (long long)shape[i]);
    if (!dt__mul_size(n, (size_t)shape[i], &n) || dt__too_many(n))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): shape too large", fn, name);
  }
  size_t off = (p->size + DT__PARAM_ALIGN_FLOATS - 1) / DT__PARAM_ALIGN_FLOATS * DT__PARAM_ALIGN_FLOATS;
  if (n > SIZE_MAX - off) return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): parameters would exceed the address space", fn, name);
  size_t end = off + n;
  if (p->count == p->cap) {
    int ncap = p->cap ? p->cap * 2 : 16;
    dt__param *ni = (dt__param *)dt__realloc(p->items, (size_t)p->cap * sizeof(dt__param), (size_t)ncap * sizeof(dt__param));
    if (!ni) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory", fn, name);
    p->items = ni;
    p->cap = ncap;
  }
  if (end > p->capacity) {
    size_t ncap = DT__MAX(end, p->capacity * 2), bytes;
    if (!dt__mul_size(ncap, sizeof(float), &bytes)) ncap = end; /* doubling overflowed: grow exactly */
    if (!dt__mul_size(ncap, sizeof(float), &bytes))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s('%s'): parameters would exceed the address space", fn, name);
    float *nd = (float *)dt__realloc(p->data, p->capacity * sizeof(float), ncap * sizeof(float));
    if (!nd) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory for %zu floats", fn, name, ncap);
    p->data = nd;
    float *ng = (float *)dt__realloc(p->grad, p->capacity * sizeof(float), ncap * sizeof(float));
    if (!ng) return dt__error(DTRAIN_ERR_NOMEM, "%s('%s'): out of memory for %zu floats", fn, name, ncap);
    p->grad = ng;
    memset(p->data + p->capacity, 0, (ncap - p->capacity) * sizeof(float));
    memset(p->grad + p->capacity, 0, (ncap - p->capacity) * sizeof(float));
    p->capacity = ncap;
  }
  dt_result r = dt_init_fill(p->data + off, ndim, shape, init, &p->rng);
  if (r != DTRAIN_OK) return r;
  dt__param *it = &p->items[p->count];
  memset(it, 0, sizeof *it);
  memcpy(it->name, name, nlen + 1);
  it->offset = off;
  it->size = n;
  it->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) it->shape[i] = i < ndim ? shape[i] : 1;
  it->trainable = trainable;
  it->decay = trainable && ndim >= 2;
  p->size = end;
  return p->count++;
}

DTRAIN_API int dt_params_add(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init) {
  return dt__params_add(p, name, ndim, shape, init, 1);
}
DTRAIN_API int dt_params_add_buffer(dt_params *p, const char *name, int ndim, const int64_t *shape, dt_init init) {
  return dt__params_add(p, name, ndim, shape, init, 0);
}

DTRAIN_API int dt_params_count(const dt_params *p) { return p ? p->count : 0; }
DTRAIN_API size_t dt_params_size(const dt_params *p) { return p ? p->size : 0; }
DTRAIN_API size_t dt_params_trainable_size(const dt_params *p) {
  size_t n = 0;
  for (int i = 0; p && i < p->count; i++)
    if (p->items[i].trainable) n += p->items[i].size;
  return n;
}
DTRAIN_API float *dt_params_data(dt_params *p) { return p ? p->data : NULL; }
DTRAIN_API float *dt_params_grad(dt_params *p) { return p ? p->grad : NULL; }

DTRAIN_API dt_result dt_params_info(const dt_params *p, int index, dt_param_info *out) {
  if (!p || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_info: NULL argument");
  if (index < 0 || index >= p->count)
    return dt__error(DTRAIN_ERR_INDEX, "dt_params_info: index %d out of range (%d params)", index, p->count);
  const dt__param *it = &p->items[index];
  out->name = it->name;
  out->offset = it->offset;
  out->size = it->size;
  out->ndim = it->ndim;
  memcpy(out->shape, it->shape, sizeof it->shape);
  out->trainable = it->trainable;
  out->decay = it->decay;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__params_view(const dt_params *p, int index, size_t *offset, int *ndim,
                                   const int64_t **shape, int *trainable) {
  const dt__param *it = &p->items[index];
  *offset = it->offset;
  *ndim = it->ndim;
  *shape = it->shape;
  *trainable = it->trainable;
  return 1;
}

/* Trainable range i of the flat buffers, for the optimizer: returns 0 past the end. */
DTRAIN_PRIVATE int dt__params_range(const dt_params *p, int index, size_t *begin, size_t *end, int *trainable, int *decay) {
  if (!p || index < 0 || index >= p->count) return 0;
  const dt__param *it = &p->items[index];
  *begin = it->offset;
  *end = it->offset + it->size;
  *trainable = it->trainable;
  *decay = it->decay;
  return 1;
}

DTRAIN_API int dt_params_find(const dt_params *p, const char *name) {
  if (!p || !name) return DTRAIN_ERR_NULL_ARG;
  for (int i = 0; i < p->count; i++)
    if (strcmp(p->items[i].name, name) == 0) return i;
  return DTRAIN_ERR_NOT_FOUND;
}

DTRAIN_API dt_result dt_params_set_decay(dt_params *p, int index, int decay) {
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_set_decay: params is NULL");
  if (index < 0 || index >= p->count)
    return dt__error(DTRAIN_ERR_INDEX, "dt_params_set_decay: index %d out of range (%d params)", index, p->count);
  p->items[index].decay = decay != 0 && p->items[index].trainable;
  return DTRAIN_OK;
}

DTRAIN_API void dt_params_zero_grad(dt_params *p) {
  if (p && p->grad) memset(p->grad, 0, p->size * sizeof(float));
}

DTRAIN_API void dt_params_scale_grad(dt_params *p, float s) {
  if (!p) return;
  for (size_t i = 0; i < p->size; i++) p->grad[i] *= s;
}

DTRAIN_API dt_result dt_params_copy(dt_params *dst, const dt_params *src) {
  if (!dst || !src) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_params_copy: NULL argument");
  if (dt_params_layout_hash(dst) != dt_params_layout_hash(src))
    return dt__error(DTRAIN_ERR_MISMATCH, "dt_params_copy: layouts differ (%d vs %d params)", dst->count, src->count);
  if (src->size) memcpy(dst->data, src->data, src->size * sizeof(float));
  return DTRAIN_OK;
}

static uint64_t dt__params_fnv(uint64_t h, const void *data, size_t n) {
  const unsigned char *b = (const unsigned char *)data;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

DTRAIN_API uint64_t dt_params_checksum(const dt_params *p) {
  uint64_t h = 0xcbf29ce484222325ULL;
  if (!p) return h;
  /* Hash values in little-endian byte order so the checksum is portable. */
  for (size_t i = 0; i < p->size; i++) {
    uint32_t u;
    unsigned char le[4];
    memcpy(&u, &p->data[i], 4);
    le[0] = (unsigned char)u; le[1] = (unsigned char)(u >> 8); le[2] = (unsigned char)(u >> 16); le[3] = (unsigned char)(u >> 24);
    h = dt__params_fnv(h, le, 4);
  }
  return h;
}

DTRAIN_API uint64_t dt_params_layout_hash(const dt_params *p) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int i = 0; p && i < p->count; i++) {
    const dt__param *it = &p->items[i];
    h = dt__params_fnv(h, it->name, strlen(it->name) + 1);
    for (int d = 0; d < it->ndim; d++) {
      unsigned char le[8];
      uint64_t v = (uint64_t)it->shape[d];
      for (int k = 0; k < 8; k++) le[k] = (unsigned char)(v >> (8 * k));
      h = dt__params_fnv(h, le, 8);
    }
    h = dt__params_fnv(h, it->trainable ? "T" : "B", 1);
  }
  return h;
}

/* Declared in dt_net.h (the handshake's model check); FNV-1a 64 over a
 * version tag, the count, and per parameter its name, rank, shape (64-bit
 * little-endian) and trainable flag, in order. */
DTRAIN_API uint64_t dt_params_hash(const dt_params *p) {
  uint64_t h = dt__params_fnv(0xcbf29ce484222325ULL, "dtrain-model-1", 14);
  unsigned char le[8];
  uint64_t v = p ? (uint64_t)p->count : 0;
  for (int k = 0; k < 8; k++) le[k] = (unsigned char)(v >> (8 * k));
  h = dt__params_fnv(h, le, 8);
  for (int i = 0; p && i < p->count; i++) {
    const dt__param *it = &p->items[i];
    h = dt__params_fnv(h, it->name, strlen(it->name) + 1);
    le[0] = (unsigned char)it->ndim;
    h = dt__params_fnv(h, le, 1);
    for (int d = 0; d < it->ndim; d++) {
      v = (uint64_t)it->shape[d];
      for (int k = 0; k < 8; k++) le[k] = (unsigned char)(v >> (8 * k));
      h = dt__params_fnv(h, le, 8);
    }
    h = dt__params_fnv(h, it->trainable ? "T" : "B", 1);
  }
  return h;
}

DTRAIN_API dt_rng *dt_params_rng(dt_params *p) { return p ? &p->rng : NULL; }

DTRAIN_API double dt_l2_norm(const float *x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; x && i < n; i++) s += (double)x[i] * (double)x[i];
  return sqrt(s);
}
/* ======== end dt_params.c ======== */

/* ======== begin dt_optim.c ======== */
/* ===========================================================================
 * dt_optim.c -- SGD, Adam, AdamW, RMSprop; learning-rate schedules; clipping
 * ===========================================================================
 * The update rules follow PyTorch's single-tensor implementations (torch.optim,
 * foreach=False) operation by operation, in float, with the per-step scalars
 * (bias corrections, lr * weight decay) computed in double like Python does.
 *
 * State slots (dt_optim_state):
 *   SGD      slot 0: momentum buffer (only when momentum > 0)
 *   Adam(W)  slot 0: first moment m, slot 1: second moment v
 *   RMSprop  slot 0: square average v, slot 1: momentum buffer (momentum > 0)
 * Every slot has the params' layout, so a range [begin,end) of the flat
 * buffers uses the same range of each slot.
 */
/* #include "dt_internal.h" (amalgamated) */

/* The Adam update in SIMD: the same float operations in the same order as
 * the scalar loop (no FMA), so the results are the same bit for bit, and
 * sqrt/div do not go through libm. SSE is baseline on x86-64; an AVX version
 * (8 floats, twice as fast) is picked at run time with GCC or clang. */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__OPTIM_SSE 1
#  include <emmintrin.h>
#  if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#    define DT__OPTIM_AVX 1
#    include <immintrin.h>
#  endif
#endif

struct dt_optim {
  dt_optim_desc desc;   /* filled: zero fields replaced by their defaults */
  dt_params *params;
  size_t size;          /* dt_params_size() at creation */
  int64_t steps;        /* completed steps */
  int nslots;
  float *state[2];      /* nslots buffers of `size` floats */
  /* device state (dt_optim_step_graph on a device graph) */
  dt_device *dev;
  float *dstate[2];
  float *dscratch;      /* one float: the sum of squares for clipping */
  unsigned host_mirror; /* bit s: dt_optim_state(s) handed out the host copy of a
                           device slot; it goes back up before the next device step */
};

/* ---- learning-rate schedules ------------------------------------------------------ */

DTRAIN_API float dt_schedule_lr(const dt_schedule *s, float lr, int64_t step) {
  if (!s) return lr;
  if (step < 0) step = 0;
  if (s->warmup_steps > 0 && step < s->warmup_steps)
    return (float)((double)lr * (double)(step + 1) / (double)s->warmup_steps);
  int64_t t = step - (s->warmup_steps > 0 ? s->warmup_steps : 0);
  switch (s->kind) {
    case DTRAIN_SCHED_STEP: {
      if (s->step_size <= 0) return lr;
      double gamma = s->gamma != 0.0f ? (double)s->gamma : 0.1;
      return (float)((double)lr * pow(gamma, (double)(t / s->step_size)));
    }
    case DTRAIN_SCHED_COSINE: {
      double lo = (double)s->min_lr;
      if (s->total_steps <= 0 || t >= s->total_steps) return s->min_lr;
      double c = cos(3.14159265358979323846 * (double)t / (double)s->total_steps);
      return (float)(lo + ((double)lr - lo) * (1.0 + c) * 0.5);
    }
    case DTRAIN_SCHED_CONSTANT:
    default: return lr;
  }
}

/* ---- gradient clipping -------------------------------------------------------------- */

DTRAIN_API float dt_clip_grad_norm(float *grad, size_t n, float max_norm) {
  if (!grad && n > 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_clip_grad_norm: grad is NULL");
    return -1.0f;
  }
  if (!(max_norm > 0.0f)) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_clip_grad_norm: max_norm %g must be > 0", (double)max_norm);
    return -1.0f;
  }
  double norm = dt_l2_norm(grad, n);
  if (norm > (double)max_norm && isfinite(norm)) {
    /* PyTorch: clip_coef = max_norm / (total_norm + 1e-6). */
    float coef = (float)((double)max_norm / (norm + 1e-6));
    for (size_t i = 0; i < n; i++) grad[i] *= coef;
  }
  return (float)norm;
}

/* ---- create / destroy ------------------------------------------------------------------ */

static int dt__optim_bad01(float x) { return !(x >= 0.0f && x < 1.0f); }

/* Checks the schedule; returns DTRAIN_OK or records an error. */
static dt_result dt__optim_check_schedule(const dt_schedule *s) {
  const char *fn = "dt_optim_create";
  if (s->warmup_steps < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: schedule warmup_steps %lld < 0", fn, (long long)s->warmup_steps);
  switch (s->kind) {
    case DTRAIN_SCHED_CONSTANT: return DTRAIN_OK;
    case DTRAIN_SCHED_STEP:
      if (s->step_size <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: step schedule needs step_size >= 1 (got %lld)", fn,
                         (long long)s->step_size);
      if (!(s->gamma >= 0.0f))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: step schedule gamma %g < 0", fn, (double)s->gamma);
      return DTRAIN_OK;
    case DTRAIN_SCHED_COSINE:
      if (s->total_steps <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: cosine schedule needs total_steps >= 1 (got %lld)", fn,
                         (long long)s->total_steps);
      if (!(s->min_lr >= 0.0f))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: cosine schedule min_lr %g < 0", fn, (double)s->min_lr);
      return DTRAIN_OK;
    default: return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown schedule kind %d", fn, (int)s->kind);
  }
}

/* Fills defaults into d and validates it. */
static dt_result dt__optim_fill(dt_optim_desc *d) {
  const char *fn = "dt_optim_create";
  if ((int)d->kind < (int)DTRAIN_OPTIM_SGD || (int)d->kind > (int)DTRAIN_OPTIM_RMSPROP)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown optimizer kind %d", fn, (int)d->kind);
  if (!(d->lr >= 0.0f) || !isfinite(d->lr))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: lr %g must be finite and >= 0", fn, (double)d->lr);
  if (!(d->momentum >= 0.0f) || !isfinite(d->momentum))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: momentum %g must be finite and >= 0", fn, (double)d->momentum);
  if (d->nesterov && d->kind != DTRAIN_OPTIM_SGD)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: nesterov applies to SGD only", fn);
  if (d->nesterov && d->momentum == 0.0f)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: nesterov needs momentum > 0", fn);
  if (!(d->weight_decay >= 0.0f) || !isfinite(d->weight_decay))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: weight_decay %g must be finite and >= 0", fn,
                     (double)d->weight_decay);
  if (dt__optim_bad01(d->beta1) || dt__optim_bad01(d->beta2))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: betas (%g, %g) must lie in [0, 1)", fn, (double)d->beta1,
                     (double)d->beta2);
  if (!(d->eps >= 0.0f) || !isfinite(d->eps))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: eps %g must be finite and >= 0", fn, (double)d->eps);
  if (dt__optim_bad01(d->alpha))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: alpha %g must lie in [0, 1)", fn, (double)d->alpha);
  if (!(d->clip_norm >= 0.0f))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: clip_norm %g must be >= 0 (0: no clipping)", fn,
                     (double)d->clip_norm);
  dt_result r = dt__optim_check_schedule(&d->schedule);
  if (r != DTRAIN_OK) return r;
  if (d->lr == 0.0f) d->lr = d->kind == DTRAIN_OPTIM_SGD ? 0.01f : 0.001f;
  if (d->beta1 == 0.0f) d->beta1 = 0.9f;
  if (d->beta2 == 0.0f) d->beta2 = 0.999f;
  if (d->eps == 0.0f) d->eps = 1e-8f;
  if (d->alpha == 0.0f) d->alpha = 0.99f;
  if (d->schedule.kind == DTRAIN_SCHED_STEP && d->schedule.gamma == 0.0f) d->schedule.gamma = 0.1f;
  return DTRAIN_OK;
}

static int dt__optim_slots(const dt_optim_desc *d) {
  switch (d->kind) {
    case DTRAIN_OPTIM_SGD: return d->momentum > 0.0f ? 1 : 0;
    case DTRAIN_OPTIM_ADAM:
    case DTRAIN_OPTIM_ADAMW: return 2;
    case DTRAIN_OPTIM_RMSPROP: return d->momentum > 0.0f ? 2 : 1;
    default: return 0;
  }
}

DTRAIN_API dt_optim *dt_optim_create(dt_params *p, const dt_optim_desc *desc) {
  if (!p || !desc) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_create: %s is NULL", !p ? "params" : "desc");
    return NULL;
  }
  dt_optim_desc d = *desc;
  if (dt__optim_fill(&d) != DTRAIN_OK) return NULL;
  size_t n = dt_params_size(p), bytes;
  if (!dt__mul_size(n, sizeof(float), &bytes)) {
    dt__error(DTRAIN_ERR_OVERFLOW, "dt_optim_create: state of %zu floats is too large", n);
    return NULL;
  }
  dt_optim *o = (dt_optim *)dt__calloc(sizeof *o);
  if (!o) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_optim_create: out of memory");
    return NULL;
  }
  o->desc = d;
  o->params = p;
  o->size = n;
  o->nslots = dt__optim_slots(&d);
  for (int s = 0; s < o->nslots; s++) {
    o->state[s] = (float *)dt__calloc(bytes);
    if (!o->state[s]) {
      dt__error(DTRAIN_ERR_NOMEM, "dt_optim_create: out of memory for %d state buffers of %zu floats", o->nslots, n);
      dt_optim_destroy(o);
      return NULL;
    }
  }
  return o;
}

DTRAIN_API void dt_optim_destroy(dt_optim *o) {
  if (!o) return;
  for (int s = 0; s < 2; s++) dt__free(o->state[s], o->size * sizeof(float));
  if (o->dev) {
    for (int s = 0; s < 2; s++)
      if (o->dstate[s]) o->dev->free(o->dev, o->dstate[s], o->size * sizeof(float));
    if (o->dscratch) o->dev->free(o->dev, o->dscratch, sizeof(float));
  }
  dt__free(o, sizeof *o);
}

/* ---- update kernels ------------------------------------------------------------------
 * Each updates n elements: p (data), g (grad), s0/s1 (state) already offset to
 * the range. wd is the weight decay of this parameter (0 where decay is off). */

static void dt__optim_sgd(const dt_optim *o, float lr, float wd, float *DT__RESTRICT p,
                          const float *DT__RESTRICT g, float *DT__RESTRICT buf, size_t n) {
  const float mom = o->desc.momentum;
  const int nesterov = o->desc.nesterov;
  for (size_t i = 0; i < n; i++) {
    float d = g[i];
    if (wd != 0.0f) d = d + wd * p[i];
    if (buf) {
      /* PyTorch starts buf at d on step 1; with dampening 0, mom*0 + d == d. */
      buf[i] = mom * buf[i] + d;
      d = nesterov ? d + mom * buf[i] : buf[i];
    }
    p[i] = p[i] - lr * d;
  }
}

#ifdef DT__OPTIM_SSE
/* Elements [0, n - n%4) of the Adam update (see the scalar loop); returns
 * how many it did. */
static size_t dt__optim_adam_sse(float w1, float w2, float fb2, float eps, float bc2_sqrt, float step_size, float wd,
                                 int decoupled, float shrink, float *DT__RESTRICT p, const float *DT__RESTRICT g,
                                 float *DT__RESTRICT m, float *DT__RESTRICT v, size_t n) {
  const __m128 vw1 = _mm_set1_ps(w1), vw2 = _mm_set1_ps(w2), vb2 = _mm_set1_ps(fb2), veps = _mm_set1_ps(eps);
  const __m128 vbc2 = _mm_set1_ps(bc2_sqrt), vstep = _mm_set1_ps(step_size), vwd = _mm_set1_ps(wd);
  const __m128 vshrink = _mm_set1_ps(shrink);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128 d = _mm_loadu_ps(g + i), pv = _mm_loadu_ps(p + i), mv = _mm_loadu_ps(m + i), vv = _mm_loadu_ps(v + i);
    if (wd != 0.0f) {
      if (decoupled) pv = _mm_mul_ps(pv, vshrink);
      else d = _mm_add_ps(d, _mm_mul_ps(vwd, pv));
    }
    mv = _mm_add_ps(mv, _mm_mul_ps(vw1, _mm_sub_ps(d, mv)));
    vv = _mm_add_ps(_mm_mul_ps(vv, vb2), _mm_mul_ps(_mm_mul_ps(vw2, d), d));
    __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vv), vbc2), veps);
    pv = _mm_sub_ps(pv, _mm_mul_ps(vstep, _mm_div_ps(mv, denom)));
    _mm_storeu_ps(m + i, mv);
    _mm_storeu_ps(v + i, vv);
    _mm_storeu_ps(p + i, pv);
  }
  return i;
}
#endif

#ifdef DT__OPTIM_AVX
/* The same as dt__optim_adam_sse, 8 elements at a time. */
__attribute__((target("avx"))) static size_t dt__optim_adam_avx(float w1, float w2, float fb2, float eps,
                                                                float bc2_sqrt, float step_size, float wd,
                                                                int decoupled, float shrink, float *DT__RESTRICT p,
                                                                const float *DT__RESTRICT g, float *DT__RESTRICT m,
                                                                float *DT__RESTRICT v, size_t n) {
  const __m256 vw1 = _mm256_set1_ps(w1), vw2 = _mm256_set1_ps(w2), vb2 = _mm256_set1_ps(fb2);
  const __m256 veps = _mm256_set1_ps(eps), vbc2 = _mm256_set1_ps(bc2_sqrt), vstep = _mm256_set1_ps(step_size);
  const __m256 vwd = _mm256_set1_ps(wd), vshrink = _mm256_set1_ps(shrink);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 d = _mm256_loadu_ps(g + i), pv = _mm256_loadu_ps(p + i);
    __m256 mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    if (wd != 0.0f) {
      if (decoupled) pv = _mm256_mul_ps(pv, vshrink);
      else d = _mm256_add_ps(d, _mm256_mul_ps(vwd, pv));
    }
    mv = _mm256_add_ps(mv, _mm256_mul_ps(vw1, _mm256_sub_ps(d, mv)));
    vv = _mm256_add_ps(_mm256_mul_ps(vv, vb2), _mm256_mul_ps(_mm256_mul_ps(vw2, d), d));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), vbc2), veps);
    pv = _mm256_sub_ps(pv, _mm256_mul_ps(vstep, _mm256_div_ps(mv, denom)));
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    _mm256_storeu_ps(p + i, pv);
  }
  return i;
}
#endif

static void dt__optim_adam_run(const dt_optim *o, float lr, float wd, int decoupled, float *DT__RESTRICT p,
                               const float *DT__RESTRICT g, float *DT__RESTRICT m, float *DT__RESTRICT v, size_t n) {
  const double b1 = (double)o->desc.beta1, b2 = (double)o->desc.beta2;
  const double t = (double)(o->steps + 1);
  const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
  const float step_size = (float)((double)lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  const float w1 = (float)(1.0 - b1), w2 = (float)(1.0 - b2);
  const float fb2 = o->desc.beta2, eps = o->desc.eps;
  /* AdamW: param.mul_(1 - lr * weight_decay) before the Adam step. */
  const float shrink = (float)(1.0 - (double)lr * (double)wd);
  size_t i = 0;
#ifdef DT__OPTIM_AVX
  if (__builtin_cpu_supports("avx"))
    i = dt__optim_adam_avx(w1, w2, fb2, eps, bc2_sqrt, step_size, wd, decoupled, shrink, p, g, m, v, n);
#endif
#ifdef DT__OPTIM_SSE
  if (i == 0) i = dt__optim_adam_sse(w1, w2, fb2, eps, bc2_sqrt, step_size, wd, decoupled, shrink, p, g, m, v, n);
#endif
  for (; i < n; i++) {
    float d = g[i];
    if (wd != 0.0f) {
      if (decoupled) p[i] = p[i] * shrink;
      else d = d + wd * p[i];
    }
    m[i] = m[i] + w1 * (d - m[i]);          /* exp_avg.lerp_(grad, 1 - beta1) */
    v[i] = v[i] * fb2 + w2 * d * d;         /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2) */
    float denom = sqrtf(v[i]) / bc2_sqrt + eps;
    p[i] = p[i] - step_size * (m[i] / denom);
  }
}

/* Intra-op threads (dt_set_threads): a large buffer is cut into runs of
 * whole 64-float blocks, one per thread. Each element's update depends on
 * that element only, so the result is the one-thread result bit for bit. */
#define DT__OPTIM_PAR_MIN ((size_t)1 << 16) /* floats below which one thread is faster */

typedef struct dt__optim_adam_job {
  const dt_optim *o;
  float lr, wd;
  int decoupled;
  float *p, *m, *v;
  const float *g;
  size_t n;
} dt__optim_adam_job;

static void dt__optim_adam_part(void *arg, int part, int nparts) {
  const dt__optim_adam_job *j = (const dt__optim_adam_job *)arg;
  size_t blocks = (j->n + 63) / 64;
  size_t lo = blocks * (size_t)part / (size_t)nparts * 64, hi = blocks * (size_t)(part + 1) / (size_t)nparts * 64;
  if (hi > j->n) hi = j->n;
  if (lo < hi)
    dt__optim_adam_run(j->o, j->lr, j->wd, j->decoupled, j->p + lo, j->g + lo, j->m + lo, j->v + lo, hi - lo);
}

static void dt__optim_adam(const dt_optim *o, float lr, float wd, int decoupled, float *p, const float *g, float *m,
                           float *v, size_t n) {
  int threads = n >= DT__OPTIM_PAR_MIN ? dt__par_threads() : 1;
  if (threads <= 1) {
    dt__optim_adam_run(o, lr, wd, decoupled, p, g, m, v, n);
    return;
  }
  dt__optim_adam_job j;
  j.o = o;
  j.lr = lr;
  j.wd = wd;
  j.decoupled = decoupled;
  j.p = p;
  j.g = g;
  j.m = m;
  j.v = v;
  j.n = n;
  dt__par_run(threads, dt__optim_adam_part, &j);
}
#undef DT__OPTIM_PAR_MIN

static void dt__optim_rmsprop(const dt_optim *o, float lr, float wd, float *DT__RESTRICT p,
                              const float *DT__RESTRICT g, float *DT__RESTRICT sq, float *DT__RESTRICT buf,
                              size_t n) {
  const float alpha = o->desc.alpha, w = (float)(1.0 - (double)o->desc.alpha);
  const float mom = o->desc.momentum, eps = o->desc.eps;
  for (size_t i = 0; i < n; i++) {
    float d = g[i];
    if (wd != 0.0f) d = d + wd * p[i];
    sq[i] = sq[i] * alpha + w * d * d;
    float avg = sqrtf(sq[i]) + eps;
    if (buf) {
      buf[i] = buf[i] * mom + d / avg;
      p[i] = p[i] - lr * buf[i];
    } else {
      p[i] = p[i] - lr * (d / avg);
    }
  }
}

/* ---- steps ---------------------------------------------------------------------------- */

static dt_result dt__optim_check_layout(const dt_optim *o, const char *fn) {
  size_t now = dt_params_size(o->params);
  if (now != o->size)
    return dt__error(DTRAIN_ERR_STATE, "%s: params changed size since dt_optim_create (%zu -> %zu floats)", fn,
                     o->size, now);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_update(dt_optim *o, float *data, const float *grad, size_t begin, size_t end) {
  if (!o) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_update: optimizer is NULL");
  dt_result r = dt__optim_check_layout(o, "dt_optim_update");
  if (r != DTRAIN_OK) return r;
  if (begin > end || end > o->size)
    return dt__error(DTRAIN_ERR_INDEX, "dt_optim_update: range [%zu,%zu) outside [0,%zu)", begin, end, o->size);
  if (begin == end) return DTRAIN_OK;
  if (!data || !grad)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_update: %s is NULL", !data ? "data" : "grad");
  const float lr = dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps);
  size_t b, e;
  int trainable, decay;
  for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
    if (!trainable) continue;
    size_t lo = DT__MAX(b, begin), hi = DT__MIN(e, end);
    if (lo >= hi) continue;
    size_t n = hi - lo;
    float wd = decay ? o->desc.weight_decay : 0.0f;
    float *s0 = o->nslots > 0 ? o->state[0] + lo : NULL;
    float *s1 = o->nslots > 1 ? o->state[1] + lo : NULL;
    switch (o->desc.kind) {
      case DTRAIN_OPTIM_SGD: dt__optim_sgd(o, lr, wd, data + lo, grad + lo, s0, n); break;
      case DTRAIN_OPTIM_ADAM: dt__optim_adam(o, lr, wd, 0, data + lo, grad + lo, s0, s1, n); break;
      case DTRAIN_OPTIM_ADAMW: dt__optim_adam(o, lr, wd, 1, data + lo, grad + lo, s0, s1, n); break;
      case DTRAIN_OPTIM_RMSPROP: dt__optim_rmsprop(o, lr, wd, data + lo, grad + lo, s0, s1, n); break;
      default: return dt__error(DTRAIN_ERR_INTERNAL, "dt_optim_update: unknown optimizer kind %d", (int)o->desc.kind);
    }
  }
  return DTRAIN_OK;
}

/* Clip (if set), update and advance over data/grad with the params' layout. */
static dt_result dt__optim_step_host(dt_optim *o, float *data, float *grad, const char *fn) {
  dt_result r = dt__optim_check_layout(o, fn);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  int trainable, decay;
  if (o->desc.clip_norm > 0.0f) {
    /* Global norm over the trainable ranges only, summed in double in index order. */
    double ss = 0.0;
    for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++)
      for (size_t j = b; trainable && j < e; j++) ss += (double)grad[j] * (double)grad[j];
    double norm = sqrt(ss);
    if (!isfinite(norm))
      return dt__error(DTRAIN_ERR_NONFINITE, "%s: gradient norm is %s; no update made", fn,
                       isnan(norm) ? "NaN" : "Inf");
    if (norm > (double)o->desc.clip_norm) {
      float coef = (float)((double)o->desc.clip_norm / (norm + 1e-6));
      for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++)
        for (size_t j = b; trainable && j < e; j++) grad[j] *= coef;
    }
  }
  r = dt_optim_update(o, data, grad, 0, o->size);
  if (r != DTRAIN_OK) return r;
  dt_optim_advance(o);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_step(dt_optim *o) {
  if (!o) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_step: optimizer is NULL");
  return dt__optim_step_host(o, dt_params_data(o->params), dt_params_grad(o->params), "dt_optim_step");
}

/* ---- on a device --------------------------------------------------------------------- */

static dt_result dt__optim_dev_run(dt_optim *o, dt_kernel k, const dt_kernel_args *a) {
  dt_result r = o->dev->run(o->dev, k, a);
  if (r != DTRAIN_OK)
    return dt__error(r, "dt_optim_step_graph: device %s: %s", o->dev->name, dt_last_error());
  return DTRAIN_OK;
}

static dt_result dt__optim_dev_state(dt_optim *o, dt_device *d) {
  const char *fn = "dt_optim_step_graph";
  if (o->dev && o->dev != d)
    return dt__error(DTRAIN_ERR_STATE, "%s: the optimizer's state lives on device %s, not %s", fn, o->dev->name,
                     d->name);
  size_t bytes = o->size * sizeof(float);
  dt_result r = DTRAIN_OK;
  if (o->dev) { /* the host copies dt_optim_state handed out (a checkpoint saved or loaded) go back up */
    for (int s = 0; r == DTRAIN_OK && s < o->nslots; s++)
      if (o->host_mirror & (1u << s)) r = d->copy(d, o->dstate[s], o->state[s], bytes, DTRAIN_COPY_H2D);
    if (r != DTRAIN_OK) return dt__error(r, "%s: optimizer state to device %s: %s", fn, d->name, dt_last_error());
    o->host_mirror = 0;
    return DTRAIN_OK;
  }
  /* First step on a device: the state starts as the host state (zeros, or
   * what a checkpoint loaded through dt_optim_state). */
  o->dev = d;
  void *p = NULL;
  r = d->alloc(d, sizeof(float), &p);
  o->dscratch = (float *)p;
  for (int s = 0; r == DTRAIN_OK && s < o->nslots; s++) {
    p = NULL;
    r = d->alloc(d, bytes, &p);
    o->dstate[s] = (float *)p;
    if (r == DTRAIN_OK) r = d->copy(d, p, o->state[s], bytes, DTRAIN_COPY_H2D);
  }
  if (r != DTRAIN_OK) return dt__error(r, "%s: optimizer state on device %s: %s", fn, d->name, dt_last_error());
  o->host_mirror = 0;
  return DTRAIN_OK;
}

static dt_result dt__optim_step_device(dt_optim *o, dt_device *d, float *data, float *grad) {
  const char *fn = "dt_optim_step_graph";
  dt_result r = dt__optim_check_layout(o, fn);
  if (r != DTRAIN_OK) return r;
  if (o->desc.kind != DTRAIN_OPTIM_SGD && o->desc.kind != DTRAIN_OPTIM_ADAM && o->desc.kind != DTRAIN_OPTIM_ADAMW &&
      o->desc.kind != DTRAIN_OPTIM_RMSPROP)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: this optimizer kind (%d) has no kernel on device %s", fn,
                     (int)o->desc.kind, d->name);
  r = dt__optim_dev_state(o, d);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  int trainable, decay;
  dt_kernel_args a;
  if (o->desc.clip_norm > 0.0f) {
    double ss = 0.0;
    for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
      if (!trainable || b == e) continue;
      float part;
      memset(&a, 0, sizeof a);
      a.p[0] = o->dscratch;
      a.p[1] = grad + b;
      a.n[0] = (int64_t)(e - b);
      if ((r = dt__optim_dev_run(o, DTRAIN_K_SUMSQ, &a)) != DTRAIN_OK) return r;
      if ((r = d->copy(d, &part, o->dscratch, sizeof part, DTRAIN_COPY_D2H)) != DTRAIN_OK)
        return dt__error(r, "%s: device %s: %s", fn, d->name, dt_last_error());
      ss += (double)part;
    }
    double norm = sqrt(ss);
    if (!isfinite(norm))
      return dt__error(DTRAIN_ERR_NONFINITE, "%s: gradient norm is %s; no update made", fn,
                       isnan(norm) ? "NaN" : "Inf");
    if (norm > (double)o->desc.clip_norm) {
      float coef = (float)((double)o->desc.clip_norm / (norm + 1e-6));
      for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
        if (!trainable || b == e) continue;
        memset(&a, 0, sizeof a);
        a.p[0] = grad + b;
        a.n[0] = (int64_t)(e - b);
        a.f[0] = coef;
        if ((r = dt__optim_dev_run(o, DTRAIN_K_SCALE, &a)) != DTRAIN_OK) return r;
      }
    }
  }
  const float lr = dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps);
  /* The per-step scalars exactly as dt__optim_adam_run computes them. */
  const double b1 = (double)o->desc.beta1, b2 = (double)o->desc.beta2, t = (double)(o->steps + 1);
  const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
  for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
    if (!trainable || b == e) continue;
    float wd = decay ? o->desc.weight_decay : 0.0f;
    memset(&a, 0, sizeof a);
    a.p[0] = data + b;
    a.p[1] = grad + b;
    a.p[2] = o->nslots > 0 ? o->dstate[0] + b : NULL;
    a.p[3] = o->nslots > 1 ? o->dstate[1] + b : NULL;
    a.n[0] = (int64_t)(e - b);
    if (o->desc.kind == DTRAIN_OPTIM_SGD) {
      a.f[0] = lr;
      a.f[1] = wd;
      a.f[2] = o->desc.momentum;
      a.n[1] = o->desc.nesterov;
      r = dt__optim_dev_run(o, DTRAIN_K_SGD, &a);
    } else if (o->desc.kind == DTRAIN_OPTIM_RMSPROP) { /* the scalars as dt__optim_rmsprop has them */
      a.f[0] = lr;
      a.f[1] = wd;
      a.f[2] = o->desc.alpha;
      a.f[3] = (float)(1.0 - (double)o->desc.alpha);
      a.f[4] = o->desc.momentum;
      a.f[5] = o->desc.eps;
      r = dt__optim_dev_run(o, DTRAIN_K_RMSPROP, &a);
    } else {
      a.f[0] = (float)((double)lr / bc1);
      a.f[1] = wd;
      a.f[2] = (float)sqrt(bc2);
      a.f[3] = o->desc.eps;
      a.f[4] = (float)(1.0 - b1);
      a.f[5] = (float)(1.0 - b2);
      a.f[6] = o->desc.beta2;
      a.f[7] = (float)(1.0 - (double)lr * (double)wd);
      a.n[1] = o->desc.kind == DTRAIN_OPTIM_ADAMW;
      r = dt__optim_dev_run(o, DTRAIN_K_ADAM, &a);
    }
    if (r != DTRAIN_OK) return r;
  }
  dt_optim_advance(o);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_step_graph(dt_optim *o, dt_graph *g) {
  const char *fn = "dt_optim_step_graph";
  if (!o || !g) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !o ? "optimizer" : "graph");
  if (g->params != o->params)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: the graph is bound to other params than the optimizer", fn);
  float *data = dt_graph_param_data(g), *grad = dt_graph_param_grad(g);
  if (!data || !grad) return dt__error(DTRAIN_ERR_STATE, "%s: the graph has no parameter gradient buffer", fn);
  if (g->device) return dt__optim_step_device(o, g->device, data, grad);
  return dt__optim_step_host(o, data, grad, fn);
}

DTRAIN_API void dt_optim_advance(dt_optim *o) {
  if (o) o->steps++;
}

/* ---- accessors ------------------------------------------------------------------------- */

DTRAIN_API int64_t dt_optim_steps(const dt_optim *o) { return o ? o->steps : 0; }

DTRAIN_API void dt_optim_set_steps(dt_optim *o, int64_t steps) {
  if (!o) return;
  if (steps < 0) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_optim_set_steps: steps %lld < 0", (long long)steps);
    return;
  }
  o->steps = steps;
}

DTRAIN_API float dt_optim_lr(const dt_optim *o) {
  return o ? dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps) : 0.0f;
}

DTRAIN_API const dt_optim_desc *dt_optim_get_desc(const dt_optim *o) { return o ? &o->desc : NULL; }

DTRAIN_API int dt_optim_state_slots(const dt_optim *o) { return o ? o->nslots : 0; }

DTRAIN_API float *dt_optim_state(dt_optim *o, int slot) {
  if (!o) return NULL;
  if (slot < 0 || slot >= o->nslots) {
    dt__error(DTRAIN_ERR_INDEX, "dt_optim_state: slot %d out of range (%d slots)", slot, o->nslots);
    return NULL;
  }
  if (o->dev && !(o->host_mirror & (1u << slot))) { /* the state lives on a device: bring it to the host copy */
    dt_result r = o->dev->copy(o->dev, o->state[slot], o->dstate[slot], o->size * sizeof(float), DTRAIN_COPY_D2H);
    if (r != DTRAIN_OK) {
      dt__error(r, "dt_optim_state: slot %d from device %s: %s", slot, o->dev->name, dt_last_error());
      return NULL;
    }
    o->host_mirror |= 1u << slot;
  }
  return o->state[slot];
}

#ifdef DT__OPTIM_SSE
#  undef DT__OPTIM_SSE
#endif
#ifdef DT__OPTIM_AVX
#  undef DT__OPTIM_AVX
#endif
/* ======== end dt_optim.c ======== */

/* ======== begin dt_nn.c ======== */
/* ===========================================================================
 * dt_nn.c -- layers composed from the ops
 * ===========================================================================
 * Each layer is a struct of parameter indices plus an init and a forward
 * function. Init adds the parameters to a dt_params (names "<name>.weight",
 * ...); forward looks them up on the graph it runs on, so one model struct
 * serves every replica.
 */
/* #include "dt_internal.h" (amalgamated) */

/* "<name>.<suffix>" into buf; error if it does not fit. */
static dt_result dt__nn_name(char *buf, size_t cap, const char *fn, const char *name, const char *suffix) {
  if (!name) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: name is NULL", fn);
  int k = snprintf(buf, cap, "%s.%s", name, suffix);
  if (k < 0 || (size_t)k >= cap) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name '%s' is too long", fn, name);
  return DTRAIN_OK;
}

/* Adds "<name>.<suffix>" and returns its index (negative dt_result on error). */
static int dt__nn_add(dt_params *p, const char *fn, const char *name, const char *suffix, int ndim,
                      const int64_t *shape, dt_init init, int trainable) {
  char full[160];
  dt_result r = dt__nn_name(full, sizeof full, fn, name, suffix);
  if (r != DTRAIN_OK) return r;
  return trainable ? dt_params_add(p, full, ndim, shape, init) : dt_params_add_buffer(p, full, ndim, shape, init);
}

#define DT__NN_TRY(idx_expr, dst)  \
  do {                             \
    int r_ = (idx_expr);           \
    if (r_ < 0) return (dt_result)r_; \
    (dst) = r_;                    \
  } while (0)

/* ---- linear ------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_linear_init(dt_nn_linear *l, dt_params *p, const char *name,
                                       int64_t in, int64_t out, int bias) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_linear_init: NULL argument");
  if (in <= 0 || out <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_linear_init('%s'): in=%lld out=%lld (must be >= 1)",
                     name ? name : "", (long long)in, (long long)out);
  int64_t ws[2], bs[1];
  ws[0] = out; ws[1] = in; bs[0] = out;
  l->in = in;
  l->out = out;
  l->b = -1;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_linear_init", name, "weight", 2, ws, dt_init_glorot_uniform(), 1), l->w);
  if (bias) DT__NN_TRY(dt__nn_add(p, "dt_nn_linear_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_linear_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_linear_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_linear_forward: layer is NULL");
  return dt_linear(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL);
}

/* ---- conv2d ---------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_conv2d_init(dt_nn_conv2d *l, dt_params *p, const char *name, int in, int out,
                                       int kernel, int stride, int padding, int bias) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_conv2d_init: NULL argument");
  if (in <= 0 || out <= 0 || kernel <= 0 || stride <= 0 || padding < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG,
                     "dt_nn_conv2d_init('%s'): in=%d out=%d kernel=%d stride=%d padding=%d out of range",
                     name ? name : "", in, out, kernel, stride, padding);
  int64_t ws[4], bs[1];
  ws[0] = out; ws[1] = in; ws[2] = kernel; ws[3] = kernel; bs[0] = out;
  l->in = in;
  l->out = out;
  l->kernel = kernel;
  l->stride = stride;
  l->padding = padding;
  l->b = -1;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_conv2d_init", name, "weight", 4, ws, dt_init_he_uniform(), 1), l->w);
  if (bias) DT__NN_TRY(dt__nn_add(p, "dt_nn_conv2d_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_conv2d_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_conv2d_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_conv2d_forward: layer is NULL");
  return dt_conv2d(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL, l->stride, l->padding);
}

/* ---- embedding ---------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_embedding_init(dt_nn_embedding *l, dt_params *p, const char *name,
                                          int64_t vocab, int64_t dim) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_embedding_init: NULL argument");
  if (vocab <= 0 || dim <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_embedding_init('%s'): vocab=%lld dim=%lld (must be >= 1)",
                     name ? name : "", (long long)vocab, (long long)dim);
  int64_t s[2];
  s[0] = vocab; s[1] = dim;
  l->vocab = vocab;
  l->dim = dim;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_embedding_init", name, "weight", 2, s, dt_init_normal(0.0f, 1.0f), 1), l->w);
  dt_params_set_decay(p, l->w, 0);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_embedding_forward(dt_graph *g, const dt_nn_embedding *l, const int32_t *ids, int64_t n) {
  if (!dt__begin(g, "dt_nn_embedding_forward", 0)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_embedding_forward: layer is NULL");
  return dt_embedding(g, dt_param(g, l->w), ids, n);
}

/* ---- layer norm ------------------------------------------------------------------------------ */

DTRAIN_API dt_result dt_nn_layer_norm_init(dt_nn_layer_norm *l, dt_params *p, const char *name, int64_t dim) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_layer_norm_init: NULL argument");
  if (dim <= 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_layer_norm_init('%s'): dim=%lld", name ? name : "", (long long)dim);
  int64_t s[1];
  s[0] = dim;
  l->dim = dim;
  l->eps = 1e-5f;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_layer_norm_init", name, "weight", 1, s, dt_init_constant(1.0f), 1), l->gamma);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_layer_norm_init", name, "bias", 1, s, dt_init_zeros(), 1), l->beta);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_layer_norm_forward(dt_graph *g, const dt_nn_layer_norm *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_layer_norm_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_layer_norm_forward: layer is NULL");
  return dt_layer_norm(g, x, dt_param(g, l->gamma), dt_param(g, l->beta), l->eps);
}

/* ---- batch norm ------------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_batch_norm_init(dt_nn_batch_norm *l, dt_params *p, const char *name, int64_t channels) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_batch_norm_init: NULL argument");
  if (channels <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_batch_norm_init('%s'): channels=%lld", name ? name : "", (long long)channels);
  int64_t s[1];
  s[0] = channels;
  l->channels = channels;
  l->momentum = 0.1f;
  l->eps = 1e-5f;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "weight", 1, s, dt_init_constant(1.0f), 1), l->gamma);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "bias", 1, s, dt_init_zeros(), 1), l->beta);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "running_mean", 1, s, dt_init_zeros(), 0), l->mean);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "running_var", 1, s, dt_init_constant(1.0f), 0), l->var);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_batch_norm_forward(dt_graph *g, const dt_nn_batch_norm *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_batch_norm_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_batch_norm_forward: layer is NULL");
  return dt_batch_norm(g, x, dt_param(g, l->gamma), dt_param(g, l->beta), dt_param(g, l->mean),
                       dt_param(g, l->var), l->momentum, l->eps);
}

/* ---- recurrent cells ------------------------------------------------------------------------------
 * Weights ~ U(-1/sqrt(H), 1/sqrt(H)) as in PyTorch. */

/* The two weight matrices shared by both cells: weight_ih [gates*H, in] and
 * weight_hh [gates*H, H]; fills bshape with [gates*H] for the biases. */
static dt_result dt__nn_rnn_weights(dt_params *p, const char *fn, const char *name, int64_t in, int64_t hidden,
                                    int gates, int *w_ih, int *w_hh, int64_t *bshape) {
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  if (in <= 0 || hidden <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s('%s'): in=%lld hidden=%lld (must be >= 1)", fn, name ? name : "",
                     (long long)in, (long long)hidden);
  float k = 1.0f / sqrtf((float)hidden);
  int64_t wi[2], wh[2];
  wi[0] = gates * hidden; wi[1] = in;
  wh[0] = gates * hidden; wh[1] = hidden;
  bshape[0] = gates * hidden;
  DT__NN_TRY(dt__nn_add(p, fn, name, "weight_ih", 2, wi, dt_init_uniform(-k, k), 1), *w_ih);
  DT__NN_TRY(dt__nn_add(p, fn, name, "weight_hh", 2, wh, dt_init_uniform(-k, k), 1), *w_hh);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_lstm_cell_init(dt_nn_lstm_cell *l, dt_params *p, const char *name,
                                          int64_t in, int64_t hidden) {
  int64_t bs[1];
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_lstm_cell_init: NULL argument");
  dt_result r = dt__nn_rnn_weights(p, "dt_nn_lstm_cell_init", name, in, hidden, 4, &l->w_ih, &l->w_hh, bs);
  if (r != DTRAIN_OK) return r;
  l->in = in;
  l->hidden = hidden;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_lstm_cell_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  /* Forget-gate bias 1: remember by default early in training. */
  dt_param_info info;
  dt_params_info(p, l->b, &info);
  float *b = dt_params_data(p) + info.offset;
  for (int64_t i = hidden; i < 2 * hidden; i++) b[i] = 1.0f;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_lstm_cell_forward(dt_graph *g, const dt_nn_lstm_cell *l, dt_tensor *x, dt_tensor *h,
                                             dt_tensor *c, dt_tensor **h_out, dt_tensor **c_out) {
  if (h_out) *h_out = NULL;
  if (c_out) *c_out = NULL;
  if (!dt__begin(g, "dt_nn_lstm_cell_forward", 1, x)) return g ? g->err : DTRAIN_ERR_NULL_ARG;
  if (!l || !h_out || !c_out) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_lstm_cell_forward: layer or output pointer is NULL");
    return g->err;
  }
  dt_tensor *gates = dt_linear(g, x, dt_param(g, l->w_ih), dt_param(g, l->b));
  if (h) gates = dt_add(g, gates, dt_linear(g, h, dt_param(g, l->w_hh), NULL));
  dt_tensor *parts[4] = {NULL, NULL, NULL, NULL};
  if (dt_split(g, gates, -1, 4, parts) != DTRAIN_OK) return g->err;
  dt_tensor *ig = dt_sigmoid(g, parts[0]);
  dt_tensor *fg = dt_sigmoid(g, parts[1]);
  dt_tensor *gg = dt_tanh(g, parts[2]);
  dt_tensor *og = dt_sigmoid(g, parts[3]);
  dt_tensor *cn = dt_mul(g, ig, gg);
  if (c) cn = dt_add(g, dt_mul(g, fg, c), cn);
  dt_tensor *hn = dt_mul(g, og, dt_tanh(g, cn));
  if (g->err != DTRAIN_OK) return g->err;
  *h_out = hn;
  *c_out = cn;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_gru_cell_init(dt_nn_gru_cell *l, dt_params *p, const char *name,
                                         int64_t in, int64_t hidden) {
  int64_t bs[1];
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_gru_cell_init: NULL argument");
  dt_result r = dt__nn_rnn_weights(p, "dt_nn_gru_cell_init", name, in, hidden, 3, &l->w_ih, &l->w_hh, bs);
  if (r != DTRAIN_OK) return r;
  l->in = in;
  l->hidden = hidden;
  float k = 1.0f / sqrtf((float)hidden);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_gru_cell_init", name, "bias_ih", 1, bs, dt_init_uniform(-k, k), 1), l->b_ih);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_gru_cell_init", name, "bias_hh", 1, bs, dt_init_uniform(-k, k), 1), l->b_hh);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_gru_cell_forward(dt_graph *g, const dt_nn_gru_cell *l, dt_tensor *x, dt_tensor *h) {
  if (!dt__begin(g, "dt_nn_gru_cell_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_gru_cell_forward: layer is NULL");
  if (!h) h = dt_tensor_new2(g, x->shape[0], l->hidden); /* zero state */
  dt_tensor *gi = dt_linear(g, x, dt_param(g, l->w_ih), dt_param(g, l->b_ih));
  dt_tensor *gh = dt_linear(g, h, dt_param(g, l->w_hh), dt_param(g, l->b_hh));
  dt_tensor *pi[3] = {NULL, NULL, NULL}, *ph[3] = {NULL, NULL, NULL};
  if (dt_split(g, gi, -1, 3, pi) != DTRAIN_OK || dt_split(g, gh, -1, 3, ph) != DTRAIN_OK) return NULL;
  dt_tensor *r = dt_sigmoid(g, dt_add(g, pi[0], ph[0]));
  dt_tensor *z = dt_sigmoid(g, dt_add(g, pi[1], ph[1]));
  dt_tensor *n = dt_tanh(g, dt_add(g, pi[2], dt_mul(g, r, ph[2])));
  /* h' = (1 - z) * n + z * h = n + z * (h - n) */
  return dt_add(g, n, dt_mul(g, z, dt_sub(g, h, n)));
}

/* ---- causal self-attention ---------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_attention_init(dt_nn_attention *l, dt_params *p, const char *name, int64_t dim, int heads) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_attention_init: NULL argument");
  if (dim <= 0 || heads <= 0 || dim % heads != 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_attention_init('%s'): dim=%lld must be a positive multiple of heads=%d",
                     name ? name : "", (long long)dim, heads);
  char sub[160];
  dt_result r;
  l->dim = dim;
  l->heads = heads;
  if ((r = dt__nn_name(sub, sizeof sub, "dt_nn_attention_init", name, "qkv")) != DTRAIN_OK) return r;
  if ((r = dt_nn_linear_init(&l->qkv, p, sub, dim, 3 * dim, 1)) != DTRAIN_OK) return r;
  if ((r = dt__nn_name(sub, sizeof sub, "dt_nn_attention_init", name, "proj")) != DTRAIN_OK) return r;
  return dt_nn_linear_init(&l->proj, p, sub, dim, dim, 1);
}

DTRAIN_API dt_tensor *dt_nn_attention_forward(dt_graph *g, const dt_nn_attention *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_attention_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_attention_forward: layer is NULL");
  if (x->ndim != 3 || x->shape[2] != l->dim) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "dt_nn_attention_forward: input %s, expected [B,T,%lld]",
                                 dt_shape_str(x, sb, sizeof sb), (long long)l->dim);
  }
  int64_t B = x->shape[0], T = x->shape[1], C = l->dim, H = l->heads, D = C / H;
  static const int to_heads[4] = {0, 2, 1, 3}; /* [B,T,H,D] <-> [B,H,T,D] */
  int64_t s4[4], s3[3];
  s4[0] = B; s4[1] = T; s4[2] = H; s4[3] = D;
  s3[0] = B; s3[1] = T; s3[2] = C;
  dt_tensor *qkv = dt_nn_linear_forward(g, &l->qkv, x); /* [B,T,3C] */
  dt_tensor *p[3] = {NULL, NULL, NULL};
  if (dt_split(g, qkv, 2, 3, p) != DTRAIN_OK) return NULL;
  dt_tensor *q = dt_permute(g, dt_reshape(g, p[0], 4, s4), to_heads);
  dt_tensor *k = dt_permute(g, dt_reshape(g, p[1], 4, s4), to_heads);
  dt_tensor *v = dt_permute(g, dt_reshape(g, p[2], 4, s4), to_heads);
  dt_tensor *att = dt_mul_scalar(g, dt_bmm(g, q, k, 1), 1.0f / sqrtf((float)D)); /* [B,H,T,T] */
  att = dt_softmax(g, dt_causal_mask(g, att), -1);
  dt_tensor *y = dt_bmm(g, att, v, 0);                                            /* [B,H,T,D] */
  y = dt_reshape(g, dt_permute(g, y, to_heads), 3, s3);
  return dt_nn_linear_forward(g, &l->proj, y);
}

#undef DT__NN_TRY
/* ======== end dt_nn.c ======== */

/* ======== begin dt_json.h ======== */
/* ===========================================================================
 * dt_json.h -- the strict JSON reader shared by checkpoints (the safetensors
 * header, its "optimizer" metadata) and the cluster description (DTRAIN_CONFIG)
 * ===========================================================================
 * dt__json_parse reads a whole text into a flat array of values (node 0 is
 * the top value) and a pool of decoded strings, or fails with one message
 * naming the byte: "byte 29: expected ',' or '}', found end of text". Callers
 * put their own context in front ("header JSON: ...", "DTRAIN_CONFIG: ...")
 * and report their own checks on the values with dt__json_found, so a
 * config's missing key reads like a syntax error.
 *
 * Strict RFC 8259: objects, arrays, strings (escapes checked, \u surrogate
 * pairs paired, raw bytes valid UTF-8, no raw control characters), numbers in
 * the JSON grammar (no leading zeros), true/false/null; whitespace is space,
 * tab, CR, LF; no trailing commas, comments, NaN or data after the value.
 * Nesting is limited (max_depth containers). Duplicate keys are the caller's
 * business: objects keep every member in order. The value of an object
 * member always directly follows its key in v (value id = key id + 1).
 */
#ifndef DTRAIN_JSON_H
#define DTRAIN_JSON_H

/* #include "dt_internal.h" (amalgamated) */

enum { DT__JSON_OBJ = 1, DT__JSON_ARR, DT__JSON_STR, DT__JSON_NUM, DT__JSON_TRUE, DT__JSON_FALSE, DT__JSON_NULL };

typedef struct dt__json_val {
  int type;            /* DT__JSON_* */
  int32_t child, next; /* first child, next sibling (-1: none); an object's children alternate key, value */
  int32_t parent;      /* the enclosing object or array (-1: the top value) */
  int32_t count;       /* children (objects: 2 per member) */
  size_t pos;          /* where the value starts in the text (for messages) */
  size_t off, len;     /* STR: pool offset and decoded length; NUM: text offset and length */
} dt__json_val;

typedef struct dt__json {
  const unsigned char *s; /* the text (not copied: it must outlive the reader's use of numbers) */
  size_t n, pos;
  int max_depth, allow_nul;
  dt__json_val *v;        /* the values; v[0] is the top one */
  size_t nv, cap;
  char *pool;             /* decoded strings, each NUL-terminated */
  size_t pool_used, pool_cap;
  int32_t open;           /* while parsing: the innermost open object or array (-1: none) */
  /* After a failure: why (err), where (err_pos), inside which object or
   * array (err_in, -1: none; its values so far are in v), and err_value
   * when no value started there at all ("expected a value"): then, inside
   * an object, the last value in v is the key whose value is missing. */
  int nomem;              /* the failure was out of memory */
  int err_value;
  int32_t err_in;
  size_t err_pos;
  char err[160];
} dt__json;

/* Parses text[0..n) as one JSON value. allow_nul: strings may hold U+0000
 * (written \u0000; their len counts it); otherwise that is an error. Returns
 * 1, or 0 with j->err set (and j->nomem when memory ran out). Either way
 * dt__json_free(j) releases what it holds. */
DTRAIN_PRIVATE int dt__json_parse(dt__json *j, const void *text, size_t n, int max_depth, int allow_nul);
DTRAIN_PRIVATE void dt__json_free(dt__json *j);
/* The decoded string of STR value id (NUL-terminated; see allow_nul). */
DTRAIN_PRIVATE const char *dt__json_str(const dt__json *j, int32_t id);
/* Whether STR value id is exactly word (an embedded U+0000 never matches). */
DTRAIN_PRIVATE int dt__json_eq(const dt__json *j, int32_t id, const char *word);
/* A non-negative JSON integer (digits only: no sign, fraction or exponent)
 * that fits in 64 bits into *out; 0 otherwise. */
DTRAIN_PRIVATE int dt__json_uint(const dt__json *j, int32_t id, uint64_t *out);
/* What stands at byte pos of the text, for messages: "'x'", "byte 0x01" or
 * "end of text". buf: at least 16 bytes. */
DTRAIN_PRIVATE const char *dt__json_found(const unsigned char *s, size_t n, size_t pos, char *buf, size_t cap);
/* The UTF-8 sequence at p (avail bytes, p[0] >= 0x80): its length when
 * valid; 0: p[0] cannot start one; -1: byte p[*bad] is not a continuation
 * byte; -2: overlong, a UTF-16 surrogate, or above U+10FFFF. */
DTRAIN_PRIVATE int dt__json_utf8(const unsigned char *p, size_t avail, size_t *bad);

#endif /* DTRAIN_JSON_H */
/* ======== end dt_json.h ======== */

/* ======== begin dt_json.c ======== */
/* ===========================================================================
 * dt_json.c -- the strict JSON reader (see dt_json.h)
 * ===========================================================================
 * Recursive descent over the text, one function per grammar rule. Every
 * failure goes through dt__json_fail, which keeps the first message: "byte N:
 * <what was expected>, found <what is there>". The depth limit bounds the
 * recursion, so no input can overflow the stack.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_json.h" (amalgamated) */

static int dt__json_isdigit(int c) { return c >= '0' && c <= '9'; }

DTRAIN_PRIVATE const char *dt__json_found(const unsigned char *s, size_t n, size_t pos, char *buf, size_t cap) {
  if (pos >= n) return "end of text";
  unsigned ch = s[pos];
  if (ch >= 0x20 && ch < 0x7f)
    snprintf(buf, cap, "'%c'", (char)ch);
  else
    snprintf(buf, cap, "byte 0x%02x", ch);
  return buf;
}

/* Records "byte <at>: <what>[, found ...]" unless a failure is already
 * recorded. Returns -1 (the failed node id) for the callers' convenience. */
static int dt__json_fail_at(dt__json *j, size_t at, const char *what, int found) {
  if (!j->err[0]) {
    char f[16];
    j->err_pos = at;
    j->err_in = j->open;
    if (found)
      snprintf(j->err, sizeof j->err, "byte %zu: %s, found %s", at, what, dt__json_found(j->s, j->n, at, f, sizeof f));
    else
      snprintf(j->err, sizeof j->err, "byte %zu: %s", at, what);
  }
  return -1;
}

static int dt__json_fail(dt__json *j, const char *what) { return dt__json_fail_at(j, j->pos, what, 1); }

static int32_t dt__json_node(dt__json *j, int type, size_t pos) {
  if (j->nv == j->cap) {
    size_t ncap = j->cap ? j->cap * 2 : 64;
    if (ncap > (size_t)INT32_MAX) return dt__json_fail_at(j, pos, "too many JSON values", 0);
    dt__json_val *nv = (dt__json_val *)dt__realloc(j->v, j->cap * sizeof(dt__json_val), ncap * sizeof(dt__json_val));
    if (!nv) {
      j->nomem = 1;
      return dt__json_fail_at(j, pos, "out of memory", 0);
    }
    j->v = nv;
    j->cap = ncap;
  }
  dt__json_val *x = &j->v[j->nv];
  memset(x, 0, sizeof *x);
  x->type = type;
  x->child = x->next = -1;
  x->parent = j->open;
  x->pos = pos;
  return (int32_t)j->nv++;
}

static void dt__json_ws(dt__json *j) {
  while (j->pos < j->n) {
    unsigned char c = j->s[j->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    j->pos++;
  }
}

DTRAIN_PRIVATE int dt__json_utf8(const unsigned char *p, size_t avail, size_t *bad) {
  unsigned c = p[0];
  int k;
  uint32_t cp, min;
  if (c >= 0xc2 && c <= 0xdf) {
    k = 1, cp = c & 0x1f, min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    k = 2, cp = c & 0x0f, min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    k = 3, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  for (int i = 1; i <= k; i++) {
    if ((size_t)i >= avail || (p[i] & 0xc0) != 0x80) {
      *bad = (size_t)i;
      return -1;
    }
    cp = (cp << 6) | (p[i] & 0x3fu);
  }
  /* Each code point has one encoding, UTF-16's surrogates are no characters. */
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return -2;
  return k + 1;
}

/* The pool holds at most n + 1 bytes of strings: a string's decoded bytes
 * and its NUL never outnumber its source bytes with the quotes. */
static void dt__json_put(dt__json *j, unsigned char c) { j->pool[j->pool_used++] = (char)c; }

static void dt__json_put_cp(dt__json *j, uint32_t cp) {
  if (cp < 0x80) {
    dt__json_put(j, (unsigned char)cp);
  } else if (cp < 0x800) {
    dt__json_put(j, (unsigned char)(0xc0 | (cp >> 6)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    dt__json_put(j, (unsigned char)(0xe0 | (cp >> 12)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 6) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  } else {
    dt__json_put(j, (unsigned char)(0xf0 | (cp >> 18)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 12) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 6) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  }
}

/* Four hex digits at j->pos into *out (advanced past them); -1 at a non-digit. */
static int dt__json_hex4(dt__json *j, uint32_t *out) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    int c = j->pos < j->n ? j->s[j->pos] : -1;
    int d = dt__json_isdigit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
    if (d < 0) return dt__json_fail(j, "expected a hex digit in \\u escape");
    v = (v << 4) | (uint32_t)d;
    j->pos++;
  }
  *out = v;
  return 0;
}

/* The \u escape whose 'u' is at j->pos - 1; esc: where its '\' is. */
static int dt__json_unicode(dt__json *j, size_t esc) {
  uint32_t cp, lo;
  if (dt__json_hex4(j, &cp) < 0) return -1;
  if (cp >= 0xdc00 && cp <= 0xdfff) {
    j->pos -= 4;
    return dt__json_fail(j, "expected a \\u escape that is not a lone low surrogate");
  }
  if (cp >= 0xd800 && cp <= 0xdbff) {
    if (j->n - j->pos < 2 || j->s[j->pos] != '\\' || j->s[j->pos + 1] != 'u')
      return dt__json_fail(j, "expected '\\u' with the low half of a surrogate pair");
    j->pos += 2;
    if (dt__json_hex4(j, &lo) < 0) return -1;
    if (lo < 0xdc00 || lo > 0xdfff) {
      j->pos -= 4;
      return dt__json_fail(j, "expected a low surrogate (DC00..DFFF)");
    }
    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
  }
  if (cp == 0 && !j->allow_nul) return dt__json_fail_at(j, esc, "\\u0000 in a string is not supported", 0);
  dt__json_put_cp(j, cp);
  return 0;
}

static int32_t dt__json_string(dt__json *j) {
  int32_t id = dt__json_node(j, DT__JSON_STR, j->pos);
  if (id < 0) return -1;
  j->pos++; /* the opening quote */
  size_t start = j->pool_used;
  for (;;) {
    if (j->pos >= j->n) return dt__json_fail(j, "expected '\"' to close the string (unterminated string)");
    unsigned char c = j->s[j->pos];
    if (c == '"') {
      j->pos++;
      break;
    }
    if (c < 0x20) return dt__json_fail(j, "expected a string character (control characters must be escaped)");
    if (c == '\\') {
      size_t esc = j->pos++;
      int e = j->pos < j->n ? j->s[j->pos] : -1;
      static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
      const char *k = e > 0 ? strchr(from, e) : NULL;
      j->pos++;
      if (k) {
        dt__json_put(j, (unsigned char)to[k - from]);
      } else if (e == 'u') {
        if (dt__json_unicode(j, esc) < 0) return -1;
      } else {
        j->pos--;
        return dt__json_fail(j, "bad escape: expected an escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
      }
      continue;
    }
    if (c < 0x80) {
      dt__json_put(j, c);
      j->pos++;
      continue;
    }
    size_t bad = 0;
    int len = dt__json_utf8(j->s + j->pos, j->n - j->pos, &bad);
    if (len == 0) return dt__json_fail(j, "expected valid UTF-8 in a string");
    if (len == -1) return dt__json_fail_at(j, j->pos + bad, "expected a UTF-8 continuation byte", 1);
    if (len < 0) return dt__json_fail(j, "expected valid UTF-8 in a string (overlong, surrogate or too large)");
    for (int i = 0; i < len; i++) dt__json_put(j, j->s[j->pos + (size_t)i]);
    j->pos += (size_t)len;
  }
  j->pool[j->pool_used++] = '\0';
  j->v[id].off = start;
  j->v[id].len = j->pool_used - 1 - start;
  return id;
}

static int dt__json_digits(dt__json *j, const char *what) {
  if (j->pos >= j->n || !dt__json_isdigit(j->s[j->pos])) return dt__json_fail(j, what);
  while (j->pos < j->n && dt__json_isdigit(j->s[j->pos])) j->pos++;
  return 0;
}

static int32_t dt__json_number(dt__json *j) {
  size_t start = j->pos;
  if (j->s[j->pos] == '-') j->pos++;
  if (j->pos < j->n && j->s[j->pos] == '0') {
    j->pos++; /* "0" followed by a digit: the caller refuses what follows */
  } else if (dt__json_digits(j, "expected a digit") < 0) {
    return -1;
  }
  if (j->pos < j->n && j->s[j->pos] == '.') {
    j->pos++;
    if (dt__json_digits(j, "expected a digit after '.'") < 0) return -1;
  }
  if (j->pos < j->n && (j->s[j->pos] == 'e' || j->s[j->pos] == 'E')) {
    j->pos++;
    if (j->pos < j->n && (j->s[j->pos] == '+' || j->s[j->pos] == '-')) j->pos++;
    if (dt__json_digits(j, "expected a digit in the exponent") < 0) return -1;
  }
  int32_t id = dt__json_node(j, DT__JSON_NUM, start);
  if (id < 0) return -1;
  j->v[id].off = start;
  j->v[id].len = j->pos - start;
  return id;
}

/* true, false, null: the message names the word and points at the first byte that differs. */
static int32_t dt__json_literal(dt__json *j, const char *word, int type) {
  size_t start = j->pos;
  for (const char *w = word; *w; w++, j->pos++) {
    if (j->pos >= j->n || j->s[j->pos] != (unsigned char)*w) {
      char what[24];
      snprintf(what, sizeof what, "expected '%s'", word);
      return dt__json_fail(j, what);
    }
  }
  return dt__json_node(j, type, start);
}

static int32_t dt__json_value(dt__json *j, int depth);

/* Whether value id is the number 0 (or -0) with a digit right after it. */
static int dt__json_lone_zero(const dt__json *j, int32_t id) {
  const dt__json_val *x = &j->v[id];
  size_t end = x->off + x->len;
  return x->type == DT__JSON_NUM && x->len <= 2 && j->s[end - 1] == '0' && end < j->n && dt__json_isdigit(j->s[end]);
}

/* An object or an array at j->pos; children linked in order. */
static int32_t dt__json_container(dt__json *j, int depth, int is_obj) {
  if (depth >= j->max_depth) {
    char what[64];
    snprintf(what, sizeof what, "nested too deeply: nesting deeper than %d levels", j->max_depth);
    return dt__json_fail_at(j, j->pos, what, 0);
  }
  int32_t id = dt__json_node(j, is_obj ? DT__JSON_OBJ : DT__JSON_ARR, j->pos);
  if (id < 0) return -1;
  unsigned char close = is_obj ? '}' : ']';
  int32_t last = -1, outer = j->open;
  j->open = id;
  j->pos++;
  dt__json_ws(j);
  if (j->pos < j->n && j->s[j->pos] == close) {
    j->pos++;
    j->open = outer;
    return id;
  }
  for (;;) {
    int32_t k = -1, val;
    dt__json_ws(j);
    if (is_obj) {
      if (j->pos >= j->n || j->s[j->pos] != '"')
        return dt__json_fail(j, last < 0 ? "expected a string (object key) or '}'" : "expected a string (object key)");
      k = dt__json_string(j);
      if (k < 0) return -1;
      dt__json_ws(j);
      if (j->pos >= j->n || j->s[j->pos] != ':') return dt__json_fail(j, "expected ':' after the object key");
      j->pos++;
    }
    val = dt__json_value(j, depth + 1);
    if (val < 0) return -1;
    if (k >= 0) j->v[k].next = val;
    if (last < 0) j->v[id].child = k >= 0 ? k : val;
    else j->v[last].next = k >= 0 ? k : val;
    j->v[id].count += k >= 0 ? 2 : 1;
    last = val;
    dt__json_ws(j);
    if (j->pos < j->n && j->s[j->pos] == ',') {
      j->pos++;
      continue;
    }
    if (j->pos < j->n && j->s[j->pos] == close) {
      j->pos++;
      j->open = outer;
      return id;
    }
    /* The grammar's own way to refuse "01": a number ends after a lone 0. */
    if (dt__json_lone_zero(j, val))
      return dt__json_fail(j, is_obj ? "expected ',' or '}' (no leading zeros in a number)"
                                     : "expected ',' or ']' (no leading zeros in a number)");
    return dt__json_fail(j, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
  }
}

static int32_t dt__json_value(dt__json *j, int depth) {
  dt__json_ws(j);
  int c = j->pos < j->n ? j->s[j->pos] : -1;
  switch (c) {
    case '{': return dt__json_container(j, depth, 1);
    case '[': return dt__json_container(j, depth, 0);
    case '"': return dt__json_string(j);
    case 't': return dt__json_literal(j, "true", DT__JSON_TRUE);
    case 'f': return dt__json_literal(j, "false", DT__JSON_FALSE);
    case 'n': return dt__json_literal(j, "null", DT__JSON_NULL);
    default:
      if (c == '-' || dt__json_isdigit(c)) return dt__json_number(j);
      j->err_value = !j->err[0];
      return dt__json_fail(j, "expected a value (object, array, string, number, true, false or null)");
  }
}

DTRAIN_PRIVATE void dt__json_free(dt__json *j) {
  dt__free(j->v, j->cap * sizeof(dt__json_val));
  dt__free(j->pool, j->pool_cap);
  j->v = NULL;
  j->pool = NULL;
  j->cap = j->pool_cap = j->nv = 0;
}

DTRAIN_PRIVATE int dt__json_parse(dt__json *j, const void *text, size_t n, int max_depth, int allow_nul) {
  memset(j, 0, sizeof *j);
  j->s = (const unsigned char *)text;
  j->n = n;
  j->max_depth = max_depth;
  j->allow_nul = allow_nul;
  j->open = j->err_in = -1;
  j->pool_cap = n + 1;
  j->pool = (char *)dt__alloc(j->pool_cap);
  if (!j->pool) {
    j->pool_cap = 0;
    j->nomem = 1;
    snprintf(j->err, sizeof j->err, "out of memory for %zu bytes of JSON", n);
    return 0;
  }
  if (dt__json_value(j, 0) < 0) return 0;
  dt__json_ws(j);
  if (j->pos != n) {
    dt__json_fail(j, dt__json_lone_zero(j, 0) ? "expected end of text after the JSON value (no leading zeros in a number)"
                                              : "expected end of text after the JSON value");
    return 0;
  }
  return 1;
}

DTRAIN_PRIVATE const char *dt__json_str(const dt__json *j, int32_t id) { return j->pool + j->v[id].off; }

DTRAIN_PRIVATE int dt__json_eq(const dt__json *j, int32_t id, const char *word) {
  const dt__json_val *x = &j->v[id];
  return x->type == DT__JSON_STR && x->len == strlen(word) && memcmp(j->pool + x->off, word, x->len) == 0;
}

DTRAIN_PRIVATE int dt__json_uint(const dt__json *j, int32_t id, uint64_t *out) {
  const dt__json_val *x = &j->v[id];
  if (x->type != DT__JSON_NUM) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < x->len; i++) {
    unsigned char c = j->s[x->off + i];
    if (!dt__json_isdigit(c)) return 0;
    if (v > (UINT64_MAX - (uint64_t)(c - '0')) / 10) return 0;
    v = v * 10 + (uint64_t)(c - '0');
  }
  *out = v;
  return x->len > 0;
}
/* ======== end dt_json.c ======== */

/* ======== begin dt_safetensors.h ======== */
/* ===========================================================================
 * dt_safetensors.h -- what the safetensors reader (dt_safetensors.c) shares
 * with checkpoint save and load (dt_checkpoint.c)
 * ===========================================================================
 */
#ifndef DTRAIN_SAFETENSORS_H
#define DTRAIN_SAFETENSORS_H

/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_json.h" (amalgamated) */

#ifndef DTRAIN_NO_STDIO

#define DT__IO_JSON_DEPTH 64 /* nesting allowed in a header (and its "optimizer" metadata) */

/* ---- the checksum ----------------------------------------------------------------------
 * A streaming 64-bit hash for corruption detection (not security): FNV-1a
 * style over little-endian 64-bit words, h = (h ^ w) * P; h ^= h >> 32, then
 * the tail bytes one by one. Each step is a bijection of h, so changing any
 * one word of the input always changes the result.
 *
 * A checkpoint's "checksum" covers, in this order: each tensor entry sorted
 * by name (name, 0, dtype, 0, then ndim, each dim, begin, end as u64 words),
 * each metadata pair sorted by key except "checksum" itself (key, 0, value,
 * 0), then the data bytes. It does not depend on the order of the JSON keys
 * or on whitespace. */
typedef struct dt__io_hasher {
  uint64_t h;
  unsigned char carry[8];
  int nc;
} dt__io_hasher;

DTRAIN_PRIVATE void dt__io_hash_init(dt__io_hasher *s);
DTRAIN_PRIVATE void dt__io_hash(dt__io_hasher *s, const void *data, size_t n);
DTRAIN_PRIVATE void dt__io_hash_u64(dt__io_hasher *s, uint64_t v);
DTRAIN_PRIVATE uint64_t dt__io_hash_final(dt__io_hasher *s);

/* ---- error context: "<fn>: '<path>': <message>" --------------------------------------- */

typedef struct dt__io_ctx {
  const char *fn;   /* public function name */
  const char *path;
} dt__io_ctx;

DTRAIN_PRIVATE dt_result dt__io_err(const dt__io_ctx *c, dt_result code, const char *fmt, ...) DT__PRINTF(3, 4);

/* ---- an opened file's index ------------------------------------------------------------ */

typedef struct dt__io_entry {
  const char *name;  /* in the JSON pool */
  const char *dtype; /* static table */
  int dsize, ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  uint64_t begin, end, nelem;
} dt__io_entry;

struct dt_checkpoint {
  unsigned char *file;
  size_t file_size, file_cap;
  size_t header_len;
  const unsigned char *data;
  size_t data_size;
  dt__json json;
  dt__io_entry *entries; /* sorted by data offset */
  int nentries;
  int *by_name;          /* entry indices sorted by name */
  const char **mkeys, **mvals;
  int nmeta;
  int is_dtrain;         /* metadata "format" is "dtrain" */
};

/* Hashes c's entries (in by_name order) and metadata (in meta_order, without
 * "checksum"): the checksum's first part, the data bytes follow. */
DTRAIN_PRIVATE void dt__io_hash_index(dt__io_hasher *h, const dt_checkpoint *c, const int *meta_order);
/* Indices 0..n-1 sorted by names[i]; NULL when out of memory. */
DTRAIN_PRIVATE int *dt__io_sorted_index(const char *const *names, int n);
DTRAIN_PRIVATE const char *dt__io_meta_get(const dt_checkpoint *c, const char *key);
/* Entry index of the tensor called name, -1 when there is none. */
DTRAIN_PRIVATE int dt__io_find(const dt_checkpoint *c, const char *name);
/* Exactly 16 lowercase hex digits into *out. */
DTRAIN_PRIVATE int dt__io_parse_hex64(const char *s, uint64_t *out);
/* Reads and indexes the file ctx->path (need_f32: refuse other dtypes at
 * once). NULL and *res set (with a message) on failure. */
DTRAIN_PRIVATE dt_checkpoint *dt__io_open(const dt__io_ctx *ctx, int need_f32, dt_result *res);

#endif /* DTRAIN_NO_STDIO */
#endif /* DTRAIN_SAFETENSORS_H */
/* ======== end dt_safetensors.h ======== */

/* ======== begin dt_safetensors.c ======== */
/* ===========================================================================
 * dt_safetensors.c -- reading safetensors files: the checksum, the strict
 * index (dt_checkpoint_open and friends)
 * ===========================================================================
 * A file is read whole, its header parsed by the strict JSON reader
 * (dt_json.c) and every entry checked: known dtype, a shape that matches its
 * byte range, ranges that tile the data exactly, unique names, and for a
 * dtrain checkpoint the checksum. Checkpoint save and load (dt_checkpoint.c)
 * build on this index.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_json.h" (amalgamated) */
/* #include "dt_safetensors.h" (amalgamated) */

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if !defined(_WIN32)
#    include <sys/stat.h>
#    include <sys/types.h>
#  endif
#endif

#ifndef DTRAIN_NO_STDIO

/* ---- checksum (the format is described in dt_safetensors.h) --------------------------------- */

DTRAIN_PRIVATE void dt__io_hash_init(dt__io_hasher *s) {
  s->h = DT__FNV64_OFFSET;
  s->nc = 0;
}

static void dt__io_hash_word(dt__io_hasher *s, uint64_t w) {
  s->h = (s->h ^ w) * DT__FNV64_PRIME;
  s->h ^= s->h >> 32;
}

DTRAIN_PRIVATE void dt__io_hash(dt__io_hasher *s, const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  while (n > 0 && s->nc > 0) {
    s->carry[s->nc++] = *p++;
    n--;
    if (s->nc == 8) {
      dt__io_hash_word(s, dt__get_le64(s->carry));
      s->nc = 0;
    }
  }
  while (n >= 8) {
    dt__io_hash_word(s, dt__get_le64(p));
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    s->carry[s->nc++] = *p++;
    n--;
  }
}

DTRAIN_PRIVATE void dt__io_hash_u64(dt__io_hasher *s, uint64_t v) {
  unsigned char le[8];
  dt__put_le64(le, v);
  dt__io_hash(s, le, 8);
}

DTRAIN_PRIVATE uint64_t dt__io_hash_final(dt__io_hasher *s) {
  s->h = dt__fnv1a64(s->h, s->carry, (size_t)s->nc); /* the tail bytes one by one */
  s->nc = 0;
  return s->h;
}

/* ---- error context ----------------------------------------------------------------- */

DTRAIN_PRIVATE dt_result dt__io_err(const dt__io_ctx *c, dt_result code, const char *fmt, ...) {
  char buf[DT__MSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return dt__error(code, "%s: '%s': %s", c->fn, c->path, buf);
}

/* ---- the safetensors index ----------------------------------------------------------- */

typedef struct dt__io_dtype {
  const char *name;
  int size;
} dt__io_dtype;

static const dt__io_dtype dt__io_dtypes[] = {
  {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F64", 8}, {"I8", 1}, {"U8", 1}, {"I16", 2}, {"U16", 2},
  {"I32", 4}, {"U32", 4}, {"I64", 8}, {"U64", 8}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

static int dt__io_cmp_entry_off(const void *a, const void *b) {
  const dt__io_entry *x = (const dt__io_entry *)a, *y = (const dt__io_entry *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* qsort context for sorting index arrays by name (qsort has no user pointer). */
static DT__TLS const char *const *dt__io_sort_names;
static int dt__io_cmp_idx_name(const void *a, const void *b) {
  return strcmp(dt__io_sort_names[*(const int *)a], dt__io_sort_names[*(const int *)b]);
}

/* Indices 0..n-1 sorted by names[i]; NULL when out of memory. */
DTRAIN_PRIVATE int *dt__io_sorted_index(const char *const *names, int n) {
  int *idx = (int *)dt__alloc((size_t)(n > 0 ? n : 1) * sizeof(int));
  if (!idx) return NULL;
  for (int i = 0; i < n; i++) idx[i] = i;
  dt__io_sort_names = names;
  if (n > 1) qsort(idx, (size_t)n, sizeof(int), dt__io_cmp_idx_name);
  dt__io_sort_names = NULL;
  return idx;
}

DTRAIN_API void dt_checkpoint_close(dt_checkpoint *c) {
  if (!c) return;
  dt__free(c->file, c->file_cap);
  dt__json_free(&c->json);
  dt__free(c->entries, (size_t)(c->nentries > 0 ? c->nentries : 1) * sizeof(dt__io_entry));
  dt__free(c->by_name, (size_t)(c->nentries > 0 ? c->nentries : 1) * sizeof(int));
  dt__free((void *)c->mkeys, (size_t)(c->nmeta > 0 ? c->nmeta : 1) * sizeof(char *));
  dt__free((void *)c->mvals, (size_t)(c->nmeta > 0 ? c->nmeta : 1) * sizeof(char *));
  dt__free(c, sizeof *c);
}

DTRAIN_PRIVATE const char *dt__io_meta_get(const dt_checkpoint *c, const char *key) {
  for (int i = 0; i < c->nmeta; i++)
    if (strcmp(c->mkeys[i], key) == 0) return c->mvals[i];
  return NULL;
}

DTRAIN_PRIVATE int dt__io_find(const dt_checkpoint *c, const char *name) {
  int lo = 0, hi = c->nentries - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2;
    int r = strcmp(c->entries[c->by_name[mid]].name, name);
    if (r == 0) return c->by_name[mid];
    if (r < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

DTRAIN_PRIVATE void dt__io_hash_index(dt__io_hasher *h, const dt_checkpoint *c, const int *meta_order) {
  for (int k = 0; k < c->nentries; k++) {
    const dt__io_entry *e = &c->entries[c->by_name[k]];
    dt__io_hash(h, e->name, strlen(e->name) + 1);
    dt__io_hash(h, e->dtype, strlen(e->dtype) + 1);
    dt__io_hash_u64(h, (uint64_t)e->ndim);
    for (int d = 0; d < e->ndim; d++) dt__io_hash_u64(h, (uint64_t)e->shape[d]);
    dt__io_hash_u64(h, e->begin);
    dt__io_hash_u64(h, e->end);
  }
  for (int k = 0; k < c->nmeta; k++) {
    int i = meta_order[k];
    if (strcmp(c->mkeys[i], "checksum") == 0) continue;
    dt__io_hash(h, c->mkeys[i], strlen(c->mkeys[i]) + 1);
    dt__io_hash(h, c->mvals[i], strlen(c->mvals[i]) + 1);
  }
}

/* Checksum of an opened file: its index, then its data. */
static uint64_t dt__io_checksum(const dt_checkpoint *c, const int *meta_order) {
  dt__io_hasher h;
  dt__io_hash_init(&h);
  dt__io_hash_index(&h, c, meta_order);
  dt__io_hash(&h, c->data, c->data_size);
  return dt__io_hash_final(&h);
}

DTRAIN_PRIVATE int dt__io_parse_hex64(const char *s, uint64_t *out) {
  uint64_t v = 0;
  if (strlen(s) != 16) return 0;
  for (int i = 0; i < 16; i++) {
    char ch = s[i];
    int d = (ch >= '0' && ch <= '9') ? ch - '0' : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10 : -1;
    if (d < 0) return 0;
    v = (v << 4) | (uint64_t)d;
  }
  *out = v;
  return 1;
}

/* Builds the index of c->file (already read). need_f32: refuse other dtypes
 * at once (FORMAT) instead of listing them. */
static dt_result dt__io_index(dt_checkpoint *c, const dt__io_ctx *ctx, int need_f32) {
  if (c->file_size < 8)
    return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "truncated: %zu bytes, a safetensors file has at least 8", c->file_size);
  uint64_t n = dt__get_le64(c->file);
  if (n > (uint64_t)(c->file_size - 8))
    return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "header length %llu exceeds the file (%zu bytes: at most %zu)",
                      (unsigned long long)n, c->file_size, c->file_size - 8);
  if (n > (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER)
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "header length %llu exceeds the limit of %d bytes",
                      (unsigned long long)n, DTRAIN_CHECKPOINT_MAX_HEADER);
  if (n < 2 || c->file[8] != '{')
    return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "not a safetensors file: the header does not start with '{'");
  c->header_len = (size_t)n;
  c->data = c->file + 8 + c->header_len;
  c->data_size = c->file_size - 8 - c->header_len;
  dt__json *j = &c->json;
  if (!dt__json_parse(j, c->file + 8, c->header_len, DT__IO_JSON_DEPTH, 0))
    return dt__io_err(ctx, j->nomem ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_FORMAT, "header JSON: %s", j->err);
  const dt__json_val *top = &j->v[0];
  if (top->type != DT__JSON_OBJ) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "header is not a JSON object");

  /* Count members. */
  int nent = 0, nmeta = 0, seen_meta = 0;
  for (int32_t k = top->child; k >= 0; k = j->v[j->v[k].next].next) {
    int32_t val = j->v[k].next;
    if (strcmp(dt__json_str(j, k), "__metadata__") == 0) {
      if (seen_meta++) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate key '__metadata__'");
      if (j->v[val].type != DT__JSON_OBJ)
        return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "'__metadata__' is not an object of strings");
      nmeta = j->v[val].count / 2;
    } else {
      nent++;
    }
  }
  c->entries = (dt__io_entry *)dt__calloc((size_t)(nent > 0 ? nent : 1) * sizeof(dt__io_entry));
  c->mkeys = (const char **)dt__calloc((size_t)(nmeta > 0 ? nmeta : 1) * sizeof(char *));
  c->mvals = (const char **)dt__calloc((size_t)(nmeta > 0 ? nmeta : 1) * sizeof(char *));
  c->nentries = nent;
  c->nmeta = nmeta;
  if (!c->entries || !c->mkeys || !c->mvals) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");

  int ie = 0;
  for (int32_t k = top->child; k >= 0; k = j->v[j->v[k].next].next) {
    const char *key = dt__json_str(j, k);
    int32_t val = j->v[k].next;
    if (strcmp(key, "__metadata__") == 0) {
      int im = 0;
      for (int32_t mk = j->v[val].child; mk >= 0; mk = j->v[j->v[mk].next].next) {
        int32_t mv = j->v[mk].next;
        if (j->v[mv].type != DT__JSON_STR)
          return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata '%s' is not a string", dt__json_str(j, mk));
        c->mkeys[im] = dt__json_str(j, mk);
        c->mvals[im] = dt__json_str(j, mv);
        im++;
      }
      continue;
    }
    dt__io_entry *e = &c->entries[ie++];
    e->name = key;
    if (j->v[val].type != DT__JSON_OBJ)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': entry is not an object", key);
    int32_t fdtype = -1, fshape = -1, foffs = -1;
    for (int32_t fk = j->v[val].child; fk >= 0; fk = j->v[j->v[fk].next].next) {
      const char *f = dt__json_str(j, fk);
      int32_t *slot = strcmp(f, "dtype") == 0 ? &fdtype : strcmp(f, "shape") == 0 ? &fshape
                    : strcmp(f, "data_offsets") == 0 ? &foffs : NULL;
      if (!slot) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': unknown field '%s'", key, f);
      if (*slot >= 0) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': duplicate field '%s'", key, f);
      *slot = j->v[fk].next;
    }
    if (fdtype < 0 || fshape < 0 || foffs < 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': missing field '%s'", key,
                        fdtype < 0 ? "dtype" : fshape < 0 ? "shape" : "data_offsets");
    /* dtype */
    if (j->v[fdtype].type != DT__JSON_STR)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': dtype is not a string", key);
    const char *dt = dt__json_str(j, fdtype);
    e->dtype = NULL;
    for (size_t t = 0; t < sizeof dt__io_dtypes / sizeof dt__io_dtypes[0]; t++)
      if (strcmp(dt, dt__io_dtypes[t].name) == 0) {
        e->dtype = dt__io_dtypes[t].name;
        e->dsize = dt__io_dtypes[t].size;
      }
    if (!e->dtype) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': unknown dtype '%s'", key, dt);
    if (need_f32 && strcmp(e->dtype, "F32") != 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s' has dtype %s; dtrain loads F32 only", key, e->dtype);
    /* shape */
    if (j->v[fshape].type != DT__JSON_ARR)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': shape is not an array", key);
    if (j->v[fshape].count > DTRAIN_MAX_DIMS)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s' has %d dimensions (dtrain reads at most %d)", key,
                        (int)j->v[fshape].count, DTRAIN_MAX_DIMS);
    e->ndim = (int)j->v[fshape].count;
    uint64_t nel = 1;
    int overflow = 0, d = 0;
    for (int32_t sv = j->v[fshape].child; sv >= 0; sv = j->v[sv].next, d++) {
      uint64_t dim;
      if (!dt__json_uint(j, sv, &dim) || dim > (uint64_t)INT64_MAX)
        return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': shape holds a value that is not a size", key);
      e->shape[d] = (int64_t)dim;
      if (dim != 0 && nel > UINT64_MAX / dim) overflow = 1;
      else nel *= dim;
    }
    for (; d < DTRAIN_MAX_DIMS; d++) e->shape[d] = 1;
    /* offsets */
    if (j->v[foffs].type != DT__JSON_ARR || j->v[foffs].count != 2)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': data_offsets is not [begin, end]", key);
    int32_t b0 = j->v[foffs].child, b1 = j->v[b0].next;
    if (!dt__json_uint(j, b0, &e->begin) || !dt__json_uint(j, b1, &e->end))
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "tensor '%s': data_offsets hold a value that is not an offset", key);
    if (e->begin > e->end)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': data_offsets [%llu, %llu] end before they begin", key,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > (uint64_t)c->data_size)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT,
                        "tensor '%s': data_offsets [%llu, %llu] out of bounds (the data has %zu bytes; truncated?)",
                        key, (unsigned long long)e->begin, (unsigned long long)e->end, c->data_size);
    if (overflow || nel > UINT64_MAX / (uint64_t)e->dsize || nel * (uint64_t)e->dsize != e->end - e->begin)
      return dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': shape of %s needs %s bytes but data_offsets give %llu",
                        key, e->dtype, overflow ? "too many" : "a different number of",
                        (unsigned long long)(e->end - e->begin));
    e->nelem = nel;
  }

  /* Names unique (sorted index), metadata keys unique. */
  {
    const char **names = (const char **)dt__alloc((size_t)(nent > 0 ? nent : 1) * sizeof(char *));
    if (!names) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
    /* Sort entries by offset first, so by_name refers to the final order. */
    if (nent > 1) qsort(c->entries, (size_t)nent, sizeof(dt__io_entry), dt__io_cmp_entry_off);
    for (int i = 0; i < nent; i++) names[i] = c->entries[i].name;
    c->by_name = dt__io_sorted_index(names, nent);
    dt__free((void *)names, (size_t)(nent > 0 ? nent : 1) * sizeof(char *));
    if (!c->by_name) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
  }
  for (int i = 1; i < nent; i++)
    if (strcmp(c->entries[c->by_name[i - 1]].name, c->entries[c->by_name[i]].name) == 0)
      return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate tensor '%s'", c->entries[c->by_name[i]].name);
  int *morder = dt__io_sorted_index(c->mkeys, nmeta);
  if (!morder) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the index");
  dt_result r = DTRAIN_OK;
  for (int i = 1; i < nmeta && r == DTRAIN_OK; i++)
    if (strcmp(c->mkeys[morder[i - 1]], c->mkeys[morder[i]]) == 0)
      r = dt__io_err(ctx, DTRAIN_ERR_FORMAT, "duplicate metadata key '%s'", c->mkeys[morder[i]]);

  /* Contiguous and covering: sorted by offset, each begins where the last ended. */
  uint64_t at = 0;
  for (int i = 0; i < nent && r == DTRAIN_OK; i++) {
    const dt__io_entry *e = &c->entries[i];
    if (e->begin < at)
      r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s'", e->name,
                     (unsigned long long)e->begin, (unsigned long long)e->end, c->entries[i - 1].name);
    else if (e->begin > at)
      r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "gap in the data: bytes [%llu, %llu) belong to no tensor (before '%s')",
                     (unsigned long long)at, (unsigned long long)e->begin, e->name);
    at = e->end;
  }
  if (r == DTRAIN_OK && at != (uint64_t)c->data_size)
    r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "the tensors cover %llu bytes of data but the file holds %zu",
                   (unsigned long long)at, c->data_size);

  const char *fmt = dt__io_meta_get(c, "format");
  c->is_dtrain = fmt && strcmp(fmt, "dtrain") == 0;
  if (r == DTRAIN_OK && c->is_dtrain) {
    const char *cs = dt__io_meta_get(c, "checksum");
    uint64_t want = 0;
    if (!cs)
      r = dt__io_err(ctx, DTRAIN_ERR_FORMAT, "dtrain checkpoint without metadata 'checksum'");
    else if (!dt__io_parse_hex64(cs, &want))
      r = dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata 'checksum' is not 16 lowercase hex digits");
    else if (dt__io_checksum(c, morder) != want)
      r = dt__io_err(ctx, DTRAIN_ERR_CORRUPT, "checksum mismatch: the header or the data were changed");
  }
  dt__free(morder, (size_t)(nmeta > 0 ? nmeta : 1) * sizeof(int));
  return r;
}

/* Read the whole file into c->file. */
static dt_result dt__io_read_file(dt_checkpoint *c, const dt__io_ctx *ctx) {
  FILE *f = fopen(ctx->path, "rb");
  if (!f) return dt__io_err(ctx, DTRAIN_ERR_IO, "cannot open: %s", strerror(errno));
  dt_result r = DTRAIN_OK;
  long size = -1;
#if !defined(_WIN32)
  {
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && !S_ISREG(sb.st_mode)) {
      fclose(f);
      return dt__io_err(ctx, DTRAIN_ERR_IO, "not a regular file");
    }
  }
#endif
  if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
  if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "cannot determine the size: %s", strerror(errno));
  } else if ((unsigned long)size > (unsigned long)(SIZE_MAX / 2)) {
    r = dt__io_err(ctx, DTRAIN_ERR_OVERFLOW, "file of %ld bytes is too large", size);
  } else {
    c->file_cap = (size_t)size + 1;
    c->file = (unsigned char *)dt__alloc(c->file_cap);
    if (!c->file) {
      c->file_cap = 0;
      r = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for %ld bytes", size);
    } else {
      size_t got = fread(c->file, 1, (size_t)size, f);
      if (got != (size_t)size || ferror(f))
        r = dt__io_err(ctx, DTRAIN_ERR_IO, "read %zu of %ld bytes: %s", got, size,
                       ferror(f) ? strerror(errno) : "file changed while reading");
      c->file_size = got;
    }
  }
  fclose(f);
  return r;
}

DTRAIN_PRIVATE dt_checkpoint *dt__io_open(const dt__io_ctx *ctx, int need_f32, dt_result *res) {
  dt_checkpoint *c = (dt_checkpoint *)dt__calloc(sizeof *c);
  if (!c) {
    *res = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
    return NULL;
  }
  *res = dt__io_read_file(c, ctx);
  if (*res == DTRAIN_OK) *res = dt__io_index(c, ctx, need_f32);
  if (*res != DTRAIN_OK) {
    dt_checkpoint_close(c);
    return NULL;
  }
  return c;
}

DTRAIN_API dt_checkpoint *dt_checkpoint_open(const char *path) {
  dt_result r;
  if (!path) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_open: path is NULL");
    return NULL;
  }
  dt__io_ctx ctx;
  ctx.fn = "dt_checkpoint_open";
  ctx.path = path;
  return dt__io_open(&ctx, 0, &r);
}

DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c) { return c ? c->nentries : 0; }

DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out) {
  if (!c || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_entry_at: NULL argument");
  if (index < 0 || index >= c->nentries)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_entry_at: index %d out of range (%d tensors)", index,
                     c->nentries);
  const dt__io_entry *e = &c->entries[index];
  out->name = e->name;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  memcpy(out->shape, e->shape, sizeof e->shape);
  out->begin = e->begin;
  out->end = e->end;
  return DTRAIN_OK;
}

DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name) {
  if (!c || !name) return DTRAIN_ERR_NULL_ARG;
  int i = dt__io_find(c, name);
  return i >= 0 ? i : DTRAIN_ERR_NOT_FOUND;
}

DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n) {
  if (!c || (!dst && n > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_read_f32: NULL argument");
  if (index < 0 || index >= c->nentries)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_read_f32: index %d out of range (%d tensors)", index,
                     c->nentries);
  const dt__io_entry *e = &c->entries[index];
  if (strcmp(e->dtype, "F32") != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "dt_checkpoint_read_f32: tensor '%s' has dtype %s, not F32", e->name,
                     e->dtype);
  if ((uint64_t)n != e->nelem)
    return dt__error(DTRAIN_ERR_SHAPE, "dt_checkpoint_read_f32: tensor '%s' has %llu elements, not %zu", e->name,
                     (unsigned long long)e->nelem, n);
  dt__get_f32le(dst, c->data + e->begin, n);
  return DTRAIN_OK;
}

DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c) { return c ? c->nmeta : 0; }

DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value) {
  if (!c) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_meta_at: checkpoint is NULL");
  if (index < 0 || index >= c->nmeta)
    return dt__error(DTRAIN_ERR_INDEX, "dt_checkpoint_meta_at: index %d out of range (%d entries)", index, c->nmeta);
  if (key) *key = c->mkeys[index];
  if (value) *value = c->mvals[index];
  return DTRAIN_OK;
}

DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key) {
  return (c && key) ? dt__io_meta_get(c, key) : NULL;
}

DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c) { return c ? (uint64_t)c->file_size : 0; }
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c) { return c ? (uint64_t)c->header_len : 0; }

#else /* DTRAIN_NO_STDIO: no file I/O, every entry point says so */

struct dt_checkpoint {
  int unused;
};

static dt_result dt__safetensors_unsupported(const char *fn) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO (no file I/O)", fn);
}

DTRAIN_API dt_checkpoint *dt_checkpoint_open(const char *path) {
  (void)path;
  dt__safetensors_unsupported("dt_checkpoint_open");
  return NULL;
}
DTRAIN_API void dt_checkpoint_close(dt_checkpoint *c) { (void)c; }
DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out) {
  (void)c; (void)index; (void)out;
  return dt__safetensors_unsupported("dt_checkpoint_entry_at");
}
DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name) {
  (void)c; (void)name;
  return DTRAIN_ERR_UNSUPPORTED;
}
DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n) {
  (void)c; (void)index; (void)dst; (void)n;
  return dt__safetensors_unsupported("dt_checkpoint_read_f32");
}
DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value) {
  (void)c; (void)index; (void)key; (void)value;
  return dt__safetensors_unsupported("dt_checkpoint_meta_at");
}
DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key) {
  (void)c; (void)key;
  return NULL;
}
DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c) { (void)c; return 0; }
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c) { (void)c; return 0; }

#endif /* DTRAIN_NO_STDIO */
/* ======== end dt_safetensors.c ======== */

/* ======== begin dt_checkpoint.c ======== */
/* ===========================================================================
 * dt_checkpoint.c -- training checkpoints as safetensors: atomic save,
 * validated load
 * ===========================================================================
 * Sections: a JSON writer, optimizer state names, save, load. Reading the
 * file and its index is dt_safetensors.c's part.
 *
 * Load never changes the model until everything is checked: the whole file is
 * read into memory (the scratch copy), parsed and validated against the model,
 * and only then are the floats decoded into the params, the optimizer state
 * and the RNGs (a step that cannot fail).
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_json.h" (amalgamated) */
/* #include "dt_safetensors.h" (amalgamated) */

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if defined(_WIN32)
#    include <process.h>
#  else
#    include <fcntl.h>
#    include <sys/stat.h>
#    include <sys/types.h>
#    include <unistd.h>
#  endif
#endif

#ifndef DTRAIN_NO_STDIO

#define DT__IO_HEX_RNG 64 /* hex digits of a 4 x 64-bit RNG state */

/* ---- JSON writer: a growable byte buffer -------------------------------------------- */

typedef struct dt__io_buf {
  char *p;
  size_t len, cap;
  int nomem;
} dt__io_buf;

static void dt__io_buf_put(dt__io_buf *b, const void *s, size_t n) {
  if (b->nomem) return;
  if (b->len + n + 1 > b->cap) {
    size_t ncap = b->cap ? b->cap : 256;
    while (ncap < b->len + n + 1) ncap *= 2;
    char *np = (char *)dt__realloc(b->p, b->cap, ncap);
    if (!np) {
      b->nomem = 1;
      return;
    }
    b->p = np;
    b->cap = ncap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void dt__io_buf_str(dt__io_buf *b, const char *s) { dt__io_buf_put(b, s, strlen(s)); }

static void dt__io_buf_u64(dt__io_buf *b, uint64_t v) {
  char tmp[24];
  snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  dt__io_buf_str(b, tmp);
}

/* Quoted JSON string; s must be valid UTF-8 (checked by the caller). */
static void dt__io_buf_jstr(dt__io_buf *b, const char *s) {
  static const char hex[] = "0123456789abcdef";
  dt__io_buf_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[7];
    switch (*p) {
      case '"': dt__io_buf_put(b, "\\\"", 2); break;
      case '\\': dt__io_buf_put(b, "\\\\", 2); break;
      case '\n': dt__io_buf_put(b, "\\n", 2); break;
      case '\r': dt__io_buf_put(b, "\\r", 2); break;
      case '\t': dt__io_buf_put(b, "\\t", 2); break;
      default:
        if (*p < 0x20) {
          esc[0] = '\\'; esc[1] = 'u'; esc[2] = '0'; esc[3] = '0';
          esc[4] = hex[*p >> 4]; esc[5] = hex[*p & 15]; esc[6] = '\0';
          dt__io_buf_put(b, esc, 6);
        } else {
          dt__io_buf_put(b, p, 1);
        }
    }
  }
  dt__io_buf_put(b, "\"", 1);
}

static void dt__io_buf_free(dt__io_buf *b) {
  dt__free(b->p, b->cap);
  b->p = NULL;
  b->len = b->cap = 0;
}

static int dt__io_valid_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      i++;
      continue;
    }
    size_t bad;
    int len = dt__json_utf8(p + i, n - i, &bad);
    if (len <= 0) return 0;
    i += (size_t)len;
  }
  return 1;
}

/* ---- optimizer slots --------------------------------------------------------------------- */

static const char *const dt__io_all_slots[] = {"momentum_buffer", "exp_avg", "exp_avg_sq", "square_avg"};

static const char *dt__io_kind_name(dt_optim_kind k) {
  switch (k) {
    case DTRAIN_OPTIM_SGD: return "sgd";
    case DTRAIN_OPTIM_ADAM: return "adam";
    case DTRAIN_OPTIM_ADAMW: return "adamw";
    case DTRAIN_OPTIM_RMSPROP: return "rmsprop";
    default: return "unknown";
  }
}

/* PyTorch's name of state slot s of an optimizer of this kind. */
static const char *dt__io_slot_name(dt_optim_kind k, int s) {
  switch (k) {
    case DTRAIN_OPTIM_SGD: return "momentum_buffer";
    case DTRAIN_OPTIM_ADAM:
    case DTRAIN_OPTIM_ADAMW: return s == 0 ? "exp_avg" : "exp_avg_sq";
    case DTRAIN_OPTIM_RMSPROP: return s == 0 ? "square_avg" : "momentum_buffer";
    default: return "unknown";
  }
}

/* "optim.<slot>.<param>": returns the param part and the slot number in
 * dt__io_all_slots, or NULL when name is not of that form. */
static const char *dt__io_split_optim(const char *name, int *slot) {
  if (strncmp(name, "optim.", 6) != 0) return NULL;
  const char *s = name + 6, *dot = strchr(s, '.');
  if (!dot) return NULL;
  for (int i = 0; i < (int)(sizeof dt__io_all_slots / sizeof dt__io_all_slots[0]); i++)
    if ((size_t)(dot - s) == strlen(dt__io_all_slots[i]) && strncmp(s, dt__io_all_slots[i], (size_t)(dot - s)) == 0) {
      *slot = i;
      return dot + 1;
    }
  return NULL;
}

/* The optimizer's state must cover the params' layout (it was created for
 * them): dt_optim_update on the empty range [n, n) checks exactly that. */
static dt_result dt__io_check_optim(const dt__io_ctx *ctx, dt_optim *o, dt_params *p) {
  size_t n = dt_params_size(p);
  if (!o || dt_optim_update(o, NULL, NULL, n, n) == DTRAIN_OK) return DTRAIN_OK;
  return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "the optimizer was not created for these params (%zu floats)", n);
}

/* ---- save ---------------------------------------------------------------------------------- */

typedef struct dt__io_out {
  size_t name_off;     /* into the names buffer */
  const float *src;
  size_t n;
  int ndim;
  int64_t shape[DTRAIN_MAX_DIMS];
  uint64_t begin, end;
} dt__io_out;

static void dt__io_hex_rng(char *out, const uint64_t s[4]) {
  for (int i = 0; i < 4; i++) snprintf(out + 16 * i, 17, "%016llx", (unsigned long long)s[i]);
}

/* Streams the tensors' bytes (little-endian) to f, or into the hasher when f is NULL. */
static int dt__io_stream_data(FILE *f, dt__io_hasher *h, const dt__io_out *outs, int nout) {
  unsigned char stage[16384];
  const size_t per = sizeof stage / 4;
  for (int t = 0; t < nout; t++) {
    for (size_t i = 0; i < outs[t].n; i += per) {
      size_t k = DT__MIN(per, outs[t].n - i);
      dt__put_f32le(stage, outs[t].src + i, k);
      if (f) {
        if (fwrite(stage, 1, 4 * k, f) != 4 * k) return 0;
      } else {
        dt__io_hash(h, stage, 4 * k);
      }
    }
  }
  return 1;
}

/* Directory part of path ("." when none) into a new buffer. */
static char *dt__io_dirname(const char *path, size_t *cap) {
  const char *slash = strrchr(path, '/');
  size_t n = slash ? (size_t)(slash - path) : 1;
  if (slash && n == 0) n = 1; /* "/file" -> "/" */
  *cap = n + 1;
  char *d = (char *)dt__alloc(*cap);
  if (!d) return NULL;
  if (slash) memcpy(d, path, n);
  else d[0] = '.';
  d[n] = '\0';
  return d;
}

static void dt__io_fsync_dir(const char *path) {
#if defined(_WIN32)
  (void)path;
#else
  size_t cap;
  char *dir = dt__io_dirname(path, &cap);
  if (!dir) return;
  int fd = open(dir, O_RDONLY);
  if (fd >= 0) {
    int rc;
    do rc = fsync(fd); while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EINVAL && errno != EROFS)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_IO, "dt_checkpoint_save: fsync of directory '%s' failed: %s", dir,
              strerror(errno));
    close(fd);
  }
  dt__free(dir, cap);
#endif
}

static long dt__io_pid(void) {
#if defined(_WIN32)
  return (long)_getpid();
#else
  return (long)getpid();
#endif
}

/* Write [len][header][data] to a temporary file next to path and rename it over path. */
static dt_result dt__io_write_atomic(const dt__io_ctx *ctx, const dt__io_buf *header, const dt__io_out *outs,
                                     int nout) {
  static DT__TLS unsigned dt__io_tmp_counter;
  size_t tcap = strlen(ctx->path) + 48;
  char *tmp = (char *)dt__alloc(tcap);
  FILE *f = NULL;
  dt_result r = DTRAIN_OK;
  unsigned char len8[8];
  int saved = 0;
  if (!tmp) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
  for (int attempt = 0; attempt < 100 && !f; attempt++) {
    snprintf(tmp, tcap, "%s.tmp-%ld-%u", ctx->path, dt__io_pid(), dt__io_tmp_counter++);
    f = fopen(tmp, "wbx");
    if (!f && errno != EEXIST) break;
  }
  if (!f) {
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "cannot create temporary file '%s': %s", tmp, strerror(errno));
    dt__free(tmp, tcap);
    return r;
  }
  dt__put_le64(len8, (uint64_t)header->len);
  if (fwrite(len8, 1, 8, f) != 8 || fwrite(header->p, 1, header->len, f) != header->len ||
      !dt__io_stream_data(f, NULL, outs, nout)) {
    saved = errno;
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "write to '%s' failed: %s", tmp, strerror(saved));
    goto fail;
  }
  if (fflush(f) != 0) {
    saved = errno;
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "write to '%s' failed: %s", tmp, strerror(saved));
    goto fail;
  }
#if !defined(_WIN32)
  {
    int rc;
    do rc = fsync(fileno(f)); while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EINVAL) {
      saved = errno;
      r = dt__io_err(ctx, DTRAIN_ERR_IO, "fsync of '%s' failed: %s", tmp, strerror(saved));
      goto fail;
    }
  }
#endif
  {
    int rc = fclose(f);
    f = NULL;
    if (rc != 0) {
      saved = errno;
      r = dt__io_err(ctx, DTRAIN_ERR_IO, "closing '%s' failed: %s", tmp, strerror(saved));
      goto fail;
    }
  }
#if defined(_WIN32)
  remove(ctx->path); /* rename does not replace on Windows (not atomic there) */
#endif
  if (rename(tmp, ctx->path) != 0) {
    saved = errno;
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "renaming '%s' failed: %s", tmp, strerror(saved));
    goto fail;
  }
  dt__io_fsync_dir(ctx->path);
  dt__free(tmp, tcap);
  return DTRAIN_OK;
fail:
  if (f) fclose(f);
  remove(tmp);
  dt__free(tmp, tcap);
  return r;
}

/* Shortest of %.6g / %.9g that reads back as the same float. */
static void dt__io_fmt_float(char *buf, size_t cap, float v) {
  snprintf(buf, cap, "%.6g", (double)v);
  if ((float)strtod(buf, NULL) != v) snprintf(buf, cap, "%.9g", (double)v);
}

/* Optimizer settings as a JSON object (a metadata string). */
static void dt__io_optim_json(dt__io_buf *b, const dt_optim_desc *d, int nslots) {
  static const char *const sched[3] = {"constant", "step", "cosine"};
  const char *names[9] = {"lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "alpha", "clip_norm", "min_lr"};
  float vals[9];
  char tmp[96];
  vals[0] = d->lr; vals[1] = d->momentum; vals[2] = d->weight_decay; vals[3] = d->beta1; vals[4] = d->beta2;
  vals[5] = d->eps; vals[6] = d->alpha; vals[7] = d->clip_norm; vals[8] = d->schedule.min_lr;
  snprintf(tmp, sizeof tmp, "{\"kind\":\"%s\",\"slots\":%d,\"nesterov\":%d", dt__io_kind_name(d->kind), nslots,
           d->nesterov);
  dt__io_buf_str(b, tmp);
  for (int i = 0; i < 8; i++) {
    char num[32];
    dt__io_fmt_float(num, sizeof num, vals[i]);
    snprintf(tmp, sizeof tmp, ",\"%s\":%s", names[i], num);
    dt__io_buf_str(b, tmp);
  }
  {
    int k = (int)d->schedule.kind;
    char g[32], lo[32];
    dt__io_fmt_float(g, sizeof g, d->schedule.gamma);
    dt__io_fmt_float(lo, sizeof lo, vals[8]);
    snprintf(tmp, sizeof tmp, ",\"schedule\":{\"kind\":\"%s\",\"warmup_steps\":%lld,",
             k >= 0 && k < 3 ? sched[k] : "unknown", (long long)d->schedule.warmup_steps);
    dt__io_buf_str(b, tmp);
    snprintf(tmp, sizeof tmp, "\"step_size\":%lld,\"gamma\":%s,", (long long)d->schedule.step_size, g);
    dt__io_buf_str(b, tmp);
    snprintf(tmp, sizeof tmp, "\"total_steps\":%lld,\"min_lr\":%s}}", (long long)d->schedule.total_steps, lo);
    dt__io_buf_str(b, tmp);
  }
}

#define DT__IO_NMETA 14

DTRAIN_API dt_result dt_checkpoint_save(const char *path, const dt_train_state *st) {
  dt__io_ctx ctx;
  ctx.fn = "dt_checkpoint_save";
  ctx.path = path ? path : "(null)";
  if (!path || !st || !st->params)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_save: %s is NULL", !path ? "path" : !st ? "state" : "params");
  dt_params *p = st->params;
  dt_optim *o = st->optim;
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  const dt_optim_desc *od = o ? dt_optim_get_desc(o) : NULL;
  float *data = dt_params_data(p);
  dt__io_buf names, header, optjson;
  dt__io_out *outs = NULL;
  size_t outs_cap = 0;
  int nout = 0, ntrain = 0;
  dt_result r = DTRAIN_OK;
  const char *mk[DT__IO_NMETA], *mv[DT__IO_NMETA];
  char vbuf[DT__IO_NMETA][72];
  char prng[DT__IO_HEX_RNG + 1], grng[DT__IO_HEX_RNG + 1];
  int nm = 0, *order = NULL;
  dt_checkpoint view;
  const char **onames = NULL;
  uint64_t off = 0;
  memset(&names, 0, sizeof names);
  memset(&header, 0, sizeof header);
  memset(&optjson, 0, sizeof optjson);
  memset(&view, 0, sizeof view);

  r = dt__io_check_optim(&ctx, o, p);
  if (r != DTRAIN_OK) goto done;
  if (st->config && !dt__io_valid_utf8(st->config)) {
    r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "config is not valid UTF-8");
    goto done;
  }
  if (st->step < 0 || st->epoch < 0 || st->data_epoch < 0 || st->data_index < 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "step, epoch and data position must be >= 0");
    goto done;
  }
  for (int i = 0; i < np; i++) {
    dt_param_info info;
    dt_params_info(p, i, &info);
    if (info.trainable) ntrain++;
  }
  outs_cap = (size_t)np + (size_t)nslots * (size_t)ntrain;
  outs = (dt__io_out *)dt__calloc((outs_cap > 0 ? outs_cap : 1) * sizeof(dt__io_out));
  if (!outs) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  /* A device run: the device's params and optimizer state come to the host
   * first (dt_optim_state copies a device slot to its host copy). */
  if (st->graph && st->graph->device && st->graph->params == p) {
    r = dt_graph_params_download(st->graph);
    if (r != DTRAIN_OK) {
      r = dt__io_err(&ctx, r, "%s", dt_last_error());
      goto done;
    }
  }
  for (int s = 0; s < nslots; s++) {
    if (!dt_optim_state(o, s)) {
      r = dt__io_err(&ctx, dt_last_result(), "%s", dt_last_error());
      goto done;
    }
  }
  /* Tensors: parameters and buffers, then optimizer slots. */
  for (int s = -1; s < nslots; s++) {
    const float *base = s < 0 ? data : dt_optim_state(o, s);
    for (int i = 0; i < np; i++) {
      dt_param_info info;
      dt_params_info(p, i, &info);
      if (s >= 0 && !info.trainable) continue;
      dt__io_out *t = &outs[nout++];
      t->name_off = names.len;
      if (s < 0) {
        if (!dt__io_valid_utf8(info.name) || strcmp(info.name, "__metadata__") == 0) {
          r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "parameter name '%s' cannot be a safetensors name", info.name);
          goto done;
        }
      } else {
        dt__io_buf_str(&names, "optim.");
        dt__io_buf_str(&names, dt__io_slot_name(od->kind, s));
        dt__io_buf_str(&names, ".");
      }
      dt__io_buf_put(&names, info.name, strlen(info.name) + 1);
      t->src = base + info.offset;
      t->n = info.size;
      t->ndim = info.ndim;
      memcpy(t->shape, info.shape, sizeof t->shape);
      t->begin = off;
      off += (uint64_t)info.size * 4u;
      t->end = off;
    }
  }
  if (names.nomem) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  /* A parameter must not be named like another one's optimizer state. */
  for (int t = np; t < nout; t++)
    if (dt_params_find(p, names.p + outs[t].name_off) >= 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "parameter name '%s' collides with optimizer state",
                     names.p + outs[t].name_off);
      goto done;
    }

  /* Metadata. */
  {
    dt_rng *pr = dt_params_rng(p);
    uint64_t gs[4];
    mk[nm] = "format"; mv[nm++] = "dtrain";
    snprintf(vbuf[nm], sizeof vbuf[nm], "%d", DTRAIN_CHECKPOINT_VERSION);
    mk[nm] = "format_version"; mv[nm] = vbuf[nm]; nm++;
    mk[nm] = "dtrain_version"; mv[nm++] = DTRAIN_VERSION_STRING;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)(o ? dt_optim_steps(o) : st->step));
    mk[nm] = "step"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->epoch);
    mk[nm] = "epoch"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->data_epoch);
    mk[nm] = "data_epoch"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->data_index);
    mk[nm] = "data_index"; mv[nm] = vbuf[nm]; nm++;
    dt__io_hex_rng(prng, pr->s);
    mk[nm] = "params_rng"; mv[nm++] = prng;
    if (st->graph) {
      dt_graph_rng_state(st->graph, gs);
      dt__io_hex_rng(grng, gs);
      mk[nm] = "graph_rng"; mv[nm++] = grng;
    }
    if (o) {
      dt__io_optim_json(&optjson, od, nslots);
      if (optjson.nomem) {
        r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
        goto done;
      }
      mk[nm] = "optimizer"; mv[nm++] = optjson.p;
    }
    snprintf(vbuf[nm], sizeof vbuf[nm], "%016llx", (unsigned long long)dt_params_layout_hash(p));
    mk[nm] = "layout_hash"; mv[nm] = vbuf[nm]; nm++;
    mk[nm] = "config"; mv[nm++] = st->config ? st->config : "";
  }

  /* Checksum over the canonical index (a dt_checkpoint view) and the data. */
  onames = (const char **)dt__alloc((size_t)(nout > 0 ? nout : 1) * sizeof(char *));
  view.entries = (dt__io_entry *)dt__calloc((size_t)(nout > 0 ? nout : 1) * sizeof(dt__io_entry));
  if (!onames || !view.entries) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int t = 0; t < nout; t++) {
    dt__io_entry *e = &view.entries[t];
    onames[t] = e->name = names.p + outs[t].name_off;
    e->dtype = "F32";
    e->dsize = 4;
    e->ndim = outs[t].ndim;
    memcpy(e->shape, outs[t].shape, sizeof e->shape);
    e->begin = outs[t].begin;
    e->end = outs[t].end;
  }
  view.nentries = nout;
  view.by_name = dt__io_sorted_index(onames, nout);
  view.mkeys = mk;
  view.mvals = mv;
  view.nmeta = nm;
  order = dt__io_sorted_index(mk, nm);
  if (!view.by_name || !order) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  {
    /* The checksum a reader computes (dt__io_checksum), with the data
     * streamed from memory; mk has no "checksum" key yet. */
    dt__io_hasher h;
    char sum[17];
    dt__io_hash_init(&h);
    dt__io_hash_index(&h, &view, order);
    dt__io_stream_data(NULL, &h, outs, nout);
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)dt__io_hash_final(&h));

    /* Header JSON. */
    dt__io_buf_str(&header, "{\"__metadata__\":{");
    for (int k = 0; k < nm; k++) {
      dt__io_buf_jstr(&header, mk[k]);
      dt__io_buf_str(&header, ":");
      dt__io_buf_jstr(&header, mv[k]);
      dt__io_buf_str(&header, ",");
    }
    dt__io_buf_str(&header, "\"checksum\":");
    dt__io_buf_jstr(&header, sum);
    dt__io_buf_str(&header, "}");
  }
  for (int t = 0; t < nout; t++) {
    dt__io_buf_str(&header, ",");
    dt__io_buf_jstr(&header, names.p + outs[t].name_off);
    dt__io_buf_str(&header, ":{\"dtype\":\"F32\",\"shape\":[");
    for (int d = 0; d < outs[t].ndim; d++) {
      if (d) dt__io_buf_str(&header, ",");
      dt__io_buf_u64(&header, (uint64_t)outs[t].shape[d]);
    }
    dt__io_buf_str(&header, "],\"data_offsets\":[");
    dt__io_buf_u64(&header, outs[t].begin);
    dt__io_buf_str(&header, ",");
    dt__io_buf_u64(&header, outs[t].end);
    dt__io_buf_str(&header, "]}");
  }
  dt__io_buf_str(&header, "}");
  while ((8 + header.len) % 8 != 0) dt__io_buf_str(&header, " ");
  if (header.nomem) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory for the header");
    goto done;
  }
  if (header.len > (size_t)DTRAIN_CHECKPOINT_MAX_HEADER) {
    r = dt__io_err(&ctx, DTRAIN_ERR_OVERFLOW, "header of %zu bytes exceeds the limit", header.len);
    goto done;
  }
  r = dt__io_write_atomic(&ctx, &header, outs, nout);

done:
  dt__free(view.entries, (size_t)(nout > 0 ? nout : 1) * sizeof(dt__io_entry));
  dt__free(view.by_name, (size_t)(nout > 0 ? nout : 1) * sizeof(int));
  dt__free(order, (size_t)(nm > 0 ? nm : 1) * sizeof(int));
  dt__free((void *)onames, (size_t)(nout > 0 ? nout : 1) * sizeof(char *));
  dt__free(outs, (outs_cap > 0 ? outs_cap : 1) * sizeof(dt__io_out));
  dt__io_buf_free(&names);
  dt__io_buf_free(&header);
  dt__io_buf_free(&optjson);
  return r;
}

/* ---- load ------------------------------------------------------------------------------------ */

static int dt__io_parse_i64(const char *s, int64_t *out) {
  int64_t v = 0;
  if (!*s) return 0;
  for (const char *q = s; *q; q++) {
    if (*q < '0' || *q > '9') return 0;
    if (v > (INT64_MAX - (*q - '0')) / 10) return 0;
    v = v * 10 + (*q - '0');
  }
  if (s[0] == '0' && s[1]) return 0;
  *out = v;
  return 1;
}

static int dt__io_parse_rng(const char *s, uint64_t out[4]) {
  char part[17];
  if (strlen(s) != DT__IO_HEX_RNG) return 0;
  for (int i = 0; i < 4; i++) {
    memcpy(part, s + 16 * i, 16);
    part[16] = '\0';
    if (!dt__io_parse_hex64(part, &out[i])) return 0;
  }
  return 1;
}

/* Checks that the entries fit the model. entry_of[i]: entry of parameter i.
 * With optim: every trainable parameter has each slot of its kind (slot_of[s][i]). */
static dt_result dt__io_match(const dt_checkpoint *c, const dt__io_ctx *ctx, dt_params *p, dt_optim *o,
                              int *entry_of, int *slot_entry) {
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  const dt_optim_desc *od = o ? dt_optim_get_desc(o) : NULL;
  char s1[96], s2[96];
  for (int i = 0; i < np; i++) {
    dt_param_info info;
    dt_params_info(p, i, &info);
    for (int s = -1; s < nslots; s++) {
      char name[192];
      if (s >= 0 && !info.trainable) continue;
      if (s < 0) snprintf(name, sizeof name, "%s", info.name);
      else snprintf(name, sizeof name, "optim.%s.%s", dt__io_slot_name(od->kind, s), info.name);
      int e = dt__io_find(c, name);
      if (e < 0)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "%s '%s' is missing from the checkpoint",
                          s < 0 ? "parameter" : "optimizer state", name);
      const dt__io_entry *en = &c->entries[e];
      int same = en->ndim == info.ndim;
      for (int d = 0; same && d < info.ndim; d++) same = en->shape[d] == info.shape[d];
      if (!same)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' has shape %s in the checkpoint but %s in the model",
                          name, dt__shape_text(en->ndim, en->shape, s1, sizeof s1),
                          dt__shape_text(info.ndim, info.shape, s2, sizeof s2));
      if (s < 0) entry_of[i] = e;
      else slot_entry[(size_t)s * (size_t)np + (size_t)i] = e;
    }
  }
  /* Every tensor known: a parameter, or optimizer state of a trainable
   * parameter (of this optimizer's kind when one is given). */
  for (int e = 0; e < c->nentries; e++) {
    const char *name = c->entries[e].name;
    int slot = -1, pi;
    if (dt_params_find(p, name) >= 0) continue;
    const char *pname = dt__io_split_optim(name, &slot);
    if (!pname || (pi = dt_params_find(p, pname)) < 0)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "unknown tensor '%s' (not a parameter of this model)", name);
    if (o) {
      int ok = 0;
      for (int s = 0; s < nslots; s++) ok |= strcmp(dt__io_all_slots[slot], dt__io_slot_name(od->kind, s)) == 0;
      if (!ok)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' is state of another optimizer (this one is %s with %d slots)",
                          name, dt__io_kind_name(od->kind), nslots);
    }
  }
  return DTRAIN_OK;
}

static dt_result dt__io_load(const char *path, const char *fn, dt_train_state *st, dt_params *p, int full) {
  dt__io_ctx ctx;
  ctx.fn = fn;
  ctx.path = path ? path : "(null)";
  if (!path || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !path ? "path" : "params");
  dt_result r;
  dt_checkpoint *c = dt__io_open(&ctx, 1, &r);
  if (!c) return r;
  dt_optim *o = full ? st->optim : NULL;
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  size_t nent = (size_t)(np > 0 ? np : 1), nslot_ent = (size_t)(nslots > 0 ? nslots : 1) * nent;
  int *entry_of = (int *)dt__calloc(nent * sizeof(int));
  int *slot_entry = (int *)dt__calloc(nslot_ent * sizeof(int));
  int64_t step = 0, epoch = 0, data_epoch = 0, data_index = 0;
  uint64_t prng[4], grng[4];
  if (!entry_of || !slot_entry) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  r = dt__io_check_optim(&ctx, o, p);
  if (r != DTRAIN_OK) goto done;
  if (full) {
    static const char *const ints[4] = {"step", "epoch", "data_epoch", "data_index"};
    int64_t *dst[4];
    const char *v;
    dst[0] = &step; dst[1] = &epoch; dst[2] = &data_epoch; dst[3] = &data_index;
    if (!c->is_dtrain) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT,
                     "not a dtrain checkpoint (metadata 'format' is not \"dtrain\"); dt_checkpoint_load_weights reads weights only");
      goto done;
    }
    v = dt__io_meta_get(c, "format_version");
    if (!v || strcmp(v, "1") != 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "unsupported format_version '%s' (this build reads 1)", v ? v : "(none)");
      goto done;
    }
    for (int k = 0; k < 4; k++) {
      v = dt__io_meta_get(c, ints[k]);
      if (!v || !dt__io_parse_i64(v, dst[k])) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata '%s' is %s", ints[k], v ? "not a non-negative integer" : "missing");
        goto done;
      }
    }
    v = dt__io_meta_get(c, "params_rng");
    if (!v || !dt__io_parse_rng(v, prng)) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'params_rng' is %s", v ? "not 64 hex digits" : "missing");
      goto done;
    }
    if (st->graph) {
      v = dt__io_meta_get(c, "graph_rng");
      if (!v) {
        r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint has no graph RNG state (saved without a graph); load with graph = NULL");
        goto done;
      }
      if (!dt__io_parse_rng(v, grng)) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'graph_rng' is not 64 hex digits");
        goto done;
      }
    }
    v = dt__io_meta_get(c, "layout_hash");
    {
      uint64_t lh;
      if (!v || !dt__io_parse_hex64(v, &lh)) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'layout_hash' is %s", v ? "not 16 hex digits" : "missing");
        goto done;
      }
      if (lh != dt_params_layout_hash(p)) {
        /* Name the first difference when there is one. */
        r = dt__io_match(c, &ctx, p, NULL, entry_of, slot_entry);
        if (r == DTRAIN_OK)
          r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH,
                         "layout hash %s differs from the model's %016llx (parameter order or buffers differ)", v,
                         (unsigned long long)dt_params_layout_hash(p));
        goto done;
      }
    }
    if (o) {
      const char *kind = dt__io_kind_name(dt_optim_get_desc(o)->kind);
      dt__json oj;
      int ok = 0;
      v = dt__io_meta_get(c, "optimizer");
      if (!v) {
        r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint has no optimizer state (saved without one); load with optim = NULL");
        goto done;
      }
      if (dt__json_parse(&oj, v, strlen(v), DT__IO_JSON_DEPTH, 0) && oj.v[0].type == DT__JSON_OBJ) {
        for (int32_t k = oj.v[0].child; k >= 0; k = oj.v[oj.v[k].next].next) {
          int32_t val = oj.v[k].next;
          if (strcmp(dt__json_str(&oj, k), "kind") == 0 && oj.v[val].type == DT__JSON_STR) {
            ok = 1;
            if (strcmp(dt__json_str(&oj, val), kind) != 0) ok = 2;
            if (ok == 2)
              r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint holds %s optimizer state; this optimizer is %s",
                             dt__json_str(&oj, val), kind);
          }
        }
      }
      dt__json_free(&oj);
      if (ok == 0) r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'optimizer' is not a JSON object with a \"kind\"");
      if (r != DTRAIN_OK) goto done;
    }
  }
  r = dt__io_match(c, &ctx, p, o, entry_of, slot_entry);
  if (r != DTRAIN_OK) goto done;
  /* An optimizer stepped on a device: its host copies, fetched now (the one
   * step that can fail), are what the commit overwrites; the next
   * dt_optim_step_graph takes them back to the device. */
  for (int s = 0; s < nslots; s++) {
    if (!dt_optim_state(o, s)) {
      r = dt__io_err(&ctx, dt_last_result(), "%s", dt_last_error());
      goto done;
    }
  }

  /* Commit: nothing below can fail (but the upload to a device graph after it). */
  {
    float *data = dt_params_data(p);
    for (int i = 0; i < np; i++) {
      dt_param_info info;
      dt_params_info(p, i, &info);
      dt__get_f32le(data + info.offset, c->data + c->entries[entry_of[i]].begin, info.size);
    }
    for (int s = 0; s < nslots; s++) {
      float *buf = dt_optim_state(o, s);
      memset(buf, 0, dt_params_size(p) * sizeof(float));
      for (int i = 0; i < np; i++) {
        dt_param_info info;
        dt_params_info(p, i, &info);
        if (!info.trainable) continue;
        int e = slot_entry[(size_t)s * (size_t)np + (size_t)i];
        dt__get_f32le(buf + info.offset, c->data + c->entries[e].begin, info.size);
      }
    }
    if (full) {
      if (o) dt_optim_set_steps(o, step);
      memcpy(dt_params_rng(p)->s, prng, sizeof prng);
      if (st->graph) dt_graph_set_rng_state(st->graph, grng);
      st->step = step;
      st->epoch = epoch;
      st->data_epoch = data_epoch;
      st->data_index = data_index;
    }
  }
  /* A device graph on these params gets the loaded values (its gradient zeroed). */
  if (full && st->graph && st->graph->device && st->graph->params == p) {
    r = dt_graph_params_upload(st->graph);
    if (r != DTRAIN_OK) r = dt__io_err(&ctx, r, "the params were loaded on the host: %s", dt_last_error());
  }
done:
  dt__free(entry_of, nent * sizeof(int));
  dt__free(slot_entry, nslot_ent * sizeof(int));
  dt_checkpoint_close(c);
  return r;
}

DTRAIN_API dt_result dt_checkpoint_load(const char *path, dt_train_state *st) {
  if (!st) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_load: state is NULL");
  return dt__io_load(path, "dt_checkpoint_load", st, st->params, 1);
}

DTRAIN_API dt_result dt_checkpoint_load_weights(const char *path, dt_params *p) {
  return dt__io_load(path, "dt_checkpoint_load_weights", NULL, p, 0);
}

#undef DT__IO_HEX_RNG
#undef DT__IO_NMETA

#else /* DTRAIN_NO_STDIO: no file I/O, every entry point says so */

static dt_result dt__checkpoint_unsupported(const char *fn) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO (no file I/O)", fn);
}

DTRAIN_API dt_result dt_checkpoint_save(const char *path, const dt_train_state *st) {
  (void)path; (void)st;
  return dt__checkpoint_unsupported("dt_checkpoint_save");
}
DTRAIN_API dt_result dt_checkpoint_load(const char *path, dt_train_state *st) {
  (void)path; (void)st;
  return dt__checkpoint_unsupported("dt_checkpoint_load");
}
DTRAIN_API dt_result dt_checkpoint_load_weights(const char *path, dt_params *p) {
  (void)path; (void)p;
  return dt__checkpoint_unsupported("dt_checkpoint_load_weights");
}
#endif /* DTRAIN_NO_STDIO */
/* ======== end dt_checkpoint.c ======== */

/* ======== begin dt_fit.c ======== */
/* ===========================================================================
 * dt_fit.c -- the training loop, progress output, metrics CSV, SVG chart
 * ===========================================================================
 * Sections: progress (bar / lines), CSV, SVG chart, the loop.
 * Nothing here runs inside a training step: the loop calls the user's step
 * and only does arithmetic and (throttled) printing in between.
 */
/* #include "dt_internal.h" (amalgamated) */

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if defined(_WIN32)
#    include <io.h>
#    include <process.h>
#  else
#    include <unistd.h>
#  endif
#endif

#define DT__FIT_BAR_WIDTH 28
#define DT__FIT_REDRAW_SECONDS 0.1

static int dt__fit_finite(double x) { return isfinite(x) != 0; }

/* ---- progress ------------------------------------------------------------------------ */

#ifndef DTRAIN_NO_STDIO

static int dt__fit_isatty(FILE *f) {
#if defined(_WIN32)
  return _isatty(_fileno(f)) != 0;
#else
  return isatty(fileno(f)) != 0;
#endif
}

/* "12.3s", "4m05s", "1h02m" */
static void dt__fit_duration(char *buf, size_t cap, double s) {
  if (!dt__fit_finite(s) || s < 0) s = 0;
  if (s < 60) snprintf(buf, cap, "%.1fs", s);
  else if (s < 3600) snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
  else snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), ((int)s % 3600) / 60);
}

/* " name 0.1234" when finite; nothing otherwise. */
static void dt__fit_metric(FILE *out, const char *name, double v) {
  if (dt__fit_finite(v)) fprintf(out, "  %s %.4f", name, v);
}

/* The bar line (no newline); final: the epoch is complete. */
static void dt__fit_draw_bar(FILE *out, int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss,
                             double acc, double rate, double eta, const dt_fit_epoch *row) {
  char bar[DT__FIT_BAR_WIDTH + 1], d[32];
  int fill = total > 0 ? (int)((double)DT__FIT_BAR_WIDTH * (double)done / (double)total) : DT__FIT_BAR_WIDTH;
  for (int i = 0; i < DT__FIT_BAR_WIDTH; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
  bar[DT__FIT_BAR_WIDTH] = '\0';
  fprintf(out, "\repoch %lld/%lld [%s] %lld/%lld", (long long)epoch + 1, (long long)epochs, bar, (long long)done,
          (long long)total);
  dt__fit_metric(out, "loss", loss);
  dt__fit_metric(out, "acc", acc);
  if (row) {
    dt__fit_metric(out, "val_loss", row->val_loss);
    dt__fit_metric(out, "val_acc", row->val_acc);
    dt__fit_duration(d, sizeof d, row->train_seconds);
    fprintf(out, "  %s  %.0f samples/s", d, row->samples_per_sec);
  } else {
    dt__fit_duration(d, sizeof d, eta);
    fprintf(out, "  %.0f samples/s  ETA %s", rate, d);
  }
  fputs("\033[K", out); /* clear the rest of the line */
  fflush(out);
}

static void dt__fit_print_line(FILE *out, int64_t epochs, const dt_fit_epoch *row) {
  char d[32];
  fprintf(out, "epoch %lld/%lld  step %lld", (long long)row->epoch, (long long)epochs, (long long)row->step);
  dt__fit_metric(out, "loss", row->train_loss);
  dt__fit_metric(out, "acc", row->train_acc);
  dt__fit_metric(out, "val_loss", row->val_loss);
  dt__fit_metric(out, "val_acc", row->val_acc);
  if (dt__fit_finite(row->lr)) fprintf(out, "  lr %.3g", row->lr);
  dt__fit_duration(d, sizeof d, row->train_seconds);
  fprintf(out, "  %s  %.0f samples/s\n", d, row->samples_per_sec);
  fflush(out);
}

/* ---- CSV --------------------------------------------------------------------------------- */

static void dt__fit_csv_num(FILE *f, double v, int last) {
  if (dt__fit_finite(v)) fprintf(f, "%.6g", v);
  fputc(last ? '\n' : ',', f);
}

static dt_result dt__fit_csv_append(const char *path, const dt_fit_epoch *row) {
  FILE *f = fopen(path, "ab");
  if (!f) return dt__error(DTRAIN_ERR_IO, "dt_fit: cannot open metrics CSV '%s': %s", path, strerror(errno));
  long at = -1;
  if (fseek(f, 0, SEEK_END) == 0) at = ftell(f);
  if (at == 0) fputs("epoch,step,train_loss,train_acc,val_loss,val_acc,lr,seconds\n", f);
  fprintf(f, "%lld,%lld,", (long long)row->epoch, (long long)row->step);
  dt__fit_csv_num(f, row->train_loss, 0);
  dt__fit_csv_num(f, row->train_acc, 0);
  dt__fit_csv_num(f, row->val_loss, 0);
  dt__fit_csv_num(f, row->val_acc, 0);
  dt__fit_csv_num(f, row->lr, 0);
  fprintf(f, "%.3f\n", row->seconds);
  int bad = ferror(f) != 0;
  int saved = errno;
  if (fclose(f) != 0 && !bad) {
    bad = 1;
    saved = errno;
  }
  if (bad) return dt__error(DTRAIN_ERR_IO, "dt_fit: writing metrics CSV '%s' failed: %s", path, strerror(saved));
  return DTRAIN_OK;
}

/* ---- SVG chart ------------------------------------------------------------------------------ */

typedef struct dt__fit_axis {
  double lo, hi, step; /* tick range and spacing */
  int decimals;
} dt__fit_axis;

static double dt__fit_nice(double x, int round_it) {
  double e = floor(log10(x)), f = x / pow(10.0, e), nf;
  if (round_it) nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  else nf = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return nf * pow(10.0, e);
}

/* "Nice numbers" axis covering [lo, hi] with about `target` ticks. */
static void dt__fit_make_axis(dt__fit_axis *a, double lo, double hi, int target, int integer) {
  if (!(hi > lo)) {
    double pad = fabs(lo) > 0 ? fabs(lo) * 0.1 : 1.0;
    lo -= pad;
    hi += pad;
  }
  double range = dt__fit_nice(hi - lo, 0);
  double step = dt__fit_nice(range / (double)(target - 1), 1);
  if (integer && step < 1) step = 1;
  a->step = step;
  a->lo = floor(lo / step) * step;
  a->hi = ceil(hi / step) * step;
  a->decimals = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
  if (a->decimals > 6) a->decimals = 6;
}

/* Text with XML special characters escaped. */
static void dt__fit_xml_text(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      case '\'': fputs("&apos;", f); break;
      default:
        if ((unsigned char)*s >= 0x20 || *s == '\t') fputc(*s, f);
    }
  }
}

typedef struct dt__fit_series {
  const char *name, *color;
  int dashed;
  size_t field; /* offsetof the double in dt_fit_epoch */
} dt__fit_series;

static double dt__fit_get(const dt_fit_epoch *r, size_t field) {
  double v;
  memcpy(&v, (const char *)r + field, sizeof v);
  return v;
}

/* One panel at (x0, y0) of size w x h. */
static void dt__fit_panel(FILE *f, double x0, double y0, double w, double h, const char *ylabel,
                          const dt_fit_epoch *rows, int64_t n, const dt__fit_series *ser, int nser, int unit_range) {
  const double ml = 62, mr = 16, mt = 14, mb = 46; /* plot margins inside the panel */
  const double px = x0 + ml, py = y0 + mt, pw = w - ml - mr, ph = h - mt - mb;
  double ylo = INFINITY, yhi = -INFINITY;
  int64_t emin = rows[0].epoch, emax = rows[0].epoch;
  for (int64_t i = 0; i < n; i++) {
    emin = DT__MIN(emin, rows[i].epoch);
    emax = DT__MAX(emax, rows[i].epoch);
    for (int s = 0; s < nser; s++) {
      double v = dt__fit_get(&rows[i], ser[s].field);
      if (!dt__fit_finite(v)) continue;
      ylo = DT__MIN(ylo, v);
      yhi = DT__MAX(yhi, v);
    }
  }
  fprintf(f, "<g>\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#ffffff\" stroke=\"#cccccc\"/>\n",
          px, py, pw, ph);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
             "transform=\"rotate(-90 %.1f %.1f)\">",
          x0 + 16, py + ph / 2, x0 + 16, py + ph / 2);
  dt__fit_xml_text(f, ylabel);
  fputs("</text>\n", f);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">epoch</text>\n", px + pw / 2,
          y0 + h - 8);
  if (!(yhi >= ylo)) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" fill=\"#888888\" text-anchor=\"middle\">"
               "no %s reported</text>\n</g>\n",
            px + pw / 2, py + ph / 2, ylabel);
    return;
  }
  if (unit_range) { /* accuracy: stay inside [0, 1] */
    ylo = DT__MAX(0.0, ylo - 0.02);
    yhi = DT__MIN(1.0, yhi + 0.02);
  }
  dt__fit_axis xa, ya;
  dt__fit_make_axis(&xa, (double)emin, (double)emax, 8, 1);
  if (emin == emax) {
    xa.lo = (double)emin - 1;
    xa.hi = (double)emin + 1;
  }
  dt__fit_make_axis(&ya, ylo, yhi, 6, 0);
  double xs = pw / (xa.hi - xa.lo), ys = ph / (ya.hi - ya.lo);
#define DT__FIT_X(e) (px + ((double)(e) - xa.lo) * xs)
#define DT__FIT_Y(v) (py + ph - ((v) - ya.lo) * ys)
  /* Grid, ticks and tick labels. */
  for (int k = 0;; k++) {
    double v = ya.lo + k * ya.step;
    if (v > ya.hi + ya.step * 1e-6) break;
    double y = DT__FIT_Y(v);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n", px, y, px + pw, y);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px - 4, y, px, y);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%.*f</text>\n", px - 7, y + 4,
            ya.decimals, v);
  }
  for (int k = 0;; k++) {
    double e = xa.lo + k * xa.step;
    if (e > xa.hi + 1e-9) break;
    if (e < 0.5 || e != floor(e)) continue; /* epochs are whole and start at 1 */
    double x = DT__FIT_X(e);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n", x, py, x, py + ph);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", x, py + ph, x,
            py + ph + 4);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%.0f</text>\n", x, py + ph + 17,
            e);
  }
  /* Axes. */
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px, py, px, py + ph);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px, py + ph, px + pw,
          py + ph);
  /* Series: polylines broken at NaN, with markers. */
  int shown[4] = {0, 0, 0, 0}, nshown = 0;
  for (int s = 0; s < nser && s < 4; s++) {
    int open = 0;
    for (int64_t i = 0; i < n; i++) {
      double v = dt__fit_get(&rows[i], ser[s].field);
      if (!dt__fit_finite(v)) {
        if (open) fputs("\"/>\n", f);
        open = 0;
        continue;
      }
      if (!open) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", ser[s].color,
                ser[s].dashed ? " stroke-dasharray=\"6 3\"" : "");
        open = 1;
      }
      fprintf(f, "%.1f,%.1f ", DT__FIT_X(rows[i].epoch), DT__FIT_Y(v));
      shown[s] = 1;
    }
    if (open) fputs("\"/>\n", f);
    if (!shown[s]) continue;
    nshown++;
    if (n <= 80)
      for (int64_t i = 0; i < n; i++) {
        double v = dt__fit_get(&rows[i], ser[s].field);
        if (dt__fit_finite(v))
          fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", DT__FIT_X(rows[i].epoch),
                  DT__FIT_Y(v), ser[s].color);
      }
  }
  /* Legend over a translucent box: top right for losses (they fall), bottom right for accuracy (it rises). */
  double lx = px + pw - 118, ly = unit_range ? py + ph - 16 - 18.0 * nshown : py + 8;
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"110\" height=\"%.1f\" fill=\"#ffffff\" fill-opacity=\"0.85\" "
             "stroke=\"#cccccc\"/>\n",
          lx, ly, 8.0 + 18.0 * nshown);
  for (int s = 0, k = 0; s < nser && s < 4; s++) {
    if (!shown[s]) continue;
    double y = ly + 18 + 18 * k++;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", lx + 8,
            y - 4, lx + 30, y - 4, ser[s].color, ser[s].dashed ? " stroke-dasharray=\"6 3\"" : "");
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">%s</text>\n", lx + 36, y, ser[s].name);
  }
#undef DT__FIT_X
#undef DT__FIT_Y
  fputs("</g>\n", f);
}

static dt_result dt__fit_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title) {
  static DT__TLS unsigned counter;
  const double W = 960, H = 400, top = 40;
  size_t cap = strlen(path) + 48;
  char *tmp = (char *)dt__alloc(cap);
  if (!tmp) return dt__error(DTRAIN_ERR_NOMEM, "dt_fit_write_svg: out of memory");
#if defined(_WIN32)
  snprintf(tmp, cap, "%s.tmp-%ld-%u", path, (long)_getpid(), counter++);
#else
  snprintf(tmp, cap, "%s.tmp-%ld-%u", path, (long)getpid(), counter++);
#endif
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    dt_result r = dt__error(DTRAIN_ERR_IO, "dt_fit_write_svg: cannot create '%s': %s", tmp, strerror(errno));
    dt__free(tmp, cap);
    return r;
  }
  dt__fit_series loss[2], acc[2];
  loss[0].name = "train"; loss[0].color = "#1f77b4"; loss[0].dashed = 0; loss[0].field = offsetof(dt_fit_epoch, train_loss);
  loss[1].name = "validation"; loss[1].color = "#ff7f0e"; loss[1].dashed = 1; loss[1].field = offsetof(dt_fit_epoch, val_loss);
  acc[0] = loss[0];
  acc[0].field = offsetof(dt_fit_epoch, train_acc);
  acc[1] = loss[1];
  acc[1].field = offsetof(dt_fit_epoch, val_acc);
  fputs("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n", f);
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
             "font-family=\"Helvetica, Arial, sans-serif\">\n",
          W, H, W, H);
  fputs("<title>", f);
  dt__fit_xml_text(f, title);
  fputs("</title>\n", f);
  fprintf(f, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#fafafa\"/>\n", W, H);
  fprintf(f, "<text x=\"%.1f\" y=\"26\" font-size=\"16\" font-weight=\"bold\" text-anchor=\"middle\">", W / 2);
  dt__fit_xml_text(f, title);
  fputs("</text>\n", f);
  if (n > 0) {
    dt__fit_panel(f, 0, top, W / 2, H - top, "loss", rows, n, loss, 2, 0);
    dt__fit_panel(f, W / 2, top, W / 2, H - top, "accuracy", rows, n, acc, 2, 1);
  } else {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">no epochs yet</text>\n", W / 2,
            H / 2);
  }
  fputs("</svg>\n", f);
  int bad = ferror(f) != 0;
  int saved = errno;
  if (fclose(f) != 0 && !bad) {
    bad = 1;
    saved = errno;
  }
  if (!bad && rename(tmp, path) != 0) {
    bad = 1;
    saved = errno;
  }
  dt_result r = DTRAIN_OK;
  if (bad) {
    remove(tmp);
    r = dt__error(DTRAIN_ERR_IO, "dt_fit_write_svg: writing '%s' failed: %s", path, strerror(saved));
  }
  dt__free(tmp, cap);
  return r;
}

#endif /* DTRAIN_NO_STDIO */

DTRAIN_API dt_result dt_fit_write_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title) {
  if (!path || (!rows && n > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fit_write_svg: NULL argument");
  if (n < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_fit_write_svg: n = %lld < 0", (long long)n);
#ifdef DTRAIN_NO_STDIO
  (void)title;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fit_write_svg: built with DTRAIN_NO_STDIO (no file I/O)");
#else
  return dt__fit_svg(path, rows, n, title ? title : "training");
#endif
}

/* ---- the loop ---------------------------------------------------------------------------- */

typedef struct dt__fit_run {
  const dt_fit_desc *d;
  int mode;                 /* DTRAIN_FIT_PROGRESS_BAR / LINES / QUIET after AUTO resolved */
  FILE *out;
  dt_fit_epoch *hist;       /* this call's epochs, for the chart */
  int64_t nhist, hist_cap;
  float *best;              /* restore_best: parameters of the best epoch */
  size_t best_n;
  int64_t step;             /* global step counter when there is no optimizer */
} dt__fit_run;

static int64_t dt__fit_step_now(const dt__fit_run *run) {
  return run->d->optim ? dt_optim_steps(run->d->optim) : run->step;
}

static dt_result dt__fit_checkpoint(const dt__fit_run *run, const char *path, int64_t epoch_done, int64_t data_epoch,
                                    int64_t data_index) {
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = run->d->params;
  st.optim = run->d->optim;
  st.graph = run->d->graph;
  st.step = dt__fit_step_now(run);
  st.epoch = epoch_done;
  st.data_epoch = data_epoch;
  st.data_index = data_index;
  st.config = run->d->config;
  return dt_checkpoint_save(path, &st);
}

static double dt__fit_monitored(dt_fit_monitor m, const dt_fit_epoch *row) {
  switch (m) {
    case DTRAIN_FIT_MONITOR_VAL_LOSS: return row->val_loss;
    case DTRAIN_FIT_MONITOR_VAL_ACC: return row->val_acc;
    case DTRAIN_FIT_MONITOR_TRAIN_ACC: return row->train_acc;
    case DTRAIN_FIT_MONITOR_TRAIN_LOSS:
    default: return row->train_loss;
  }
}

static const char *dt__fit_monitor_name(dt_fit_monitor m) {
  switch (m) {
    case DTRAIN_FIT_MONITOR_VAL_LOSS: return "val_loss";
    case DTRAIN_FIT_MONITOR_VAL_ACC: return "val_acc";
    case DTRAIN_FIT_MONITOR_TRAIN_ACC: return "train_acc";
    case DTRAIN_FIT_MONITOR_TRAIN_LOSS:
    default: return "train_loss";
  }
}

static dt_result dt__fit_check(const dt_fit_desc *d) {
  const char *fn = "dt_fit";
  if (!d->train_step) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: train_step is NULL", fn);
  if (d->steps_per_epoch <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: steps_per_epoch %lld must be >= 1", fn, (long long)d->steps_per_epoch);
  if (d->epochs < 0 || d->batch_size < 0 || d->patience < 0 || d->log_every < 0 || d->checkpoint_every < 0 ||
      d->checkpoint_steps < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: epochs, batch_size, patience, log_every and checkpoint intervals must be >= 0", fn);
  if (!(d->min_delta >= 0))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: min_delta %g must be >= 0", fn, d->min_delta);
  if (d->start_epoch < 0 || d->start_batch < 0 || d->start_batch >= d->steps_per_epoch)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: start position (epoch %lld, batch %lld) is outside [0, %lld batches)",
                     fn, (long long)d->start_epoch, (long long)d->start_batch, (long long)d->steps_per_epoch);
  if ((int)d->monitor < (int)DTRAIN_FIT_MONITOR_AUTO || (int)d->monitor > (int)DTRAIN_FIT_MONITOR_TRAIN_ACC)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown monitor %d", fn, (int)d->monitor);
  if ((int)d->progress < (int)DTRAIN_FIT_PROGRESS_AUTO || (int)d->progress > (int)DTRAIN_FIT_PROGRESS_QUIET)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown progress mode %d", fn, (int)d->progress);
  if ((d->monitor == DTRAIN_FIT_MONITOR_VAL_LOSS || d->monitor == DTRAIN_FIT_MONITOR_VAL_ACC) && !d->evaluate)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: monitor %s needs an evaluate callback", fn,
                     dt__fit_monitor_name(d->monitor));
  if ((d->restore_best || d->checkpoint_path || d->best_path) && !d->params)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: restore_best and checkpoints need params", fn);
#ifdef DTRAIN_NO_STDIO
  if (d->csv_path || d->svg_path || d->checkpoint_path || d->best_path ||
      d->progress == DTRAIN_FIT_PROGRESS_BAR || d->progress == DTRAIN_FIT_PROGRESS_LINES)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO: no progress output or files", fn);
#endif
  return DTRAIN_OK;
}

/* Appends row to the history (for the chart). */
static dt_result dt__fit_push(dt__fit_run *run, const dt_fit_epoch *row) {
  if (run->nhist == run->hist_cap) {
    int64_t ncap = run->hist_cap ? run->hist_cap * 2 : 16;
    dt_fit_epoch *nh = (dt_fit_epoch *)dt__realloc(run->hist, (size_t)run->hist_cap * sizeof(dt_fit_epoch),
                                                   (size_t)ncap * sizeof(dt_fit_epoch));
    if (!nh) return dt__error(DTRAIN_ERR_NOMEM, "dt_fit: out of memory for the history");
    run->hist = nh;
    run->hist_cap = ncap;
  }
  run->hist[run->nhist++] = *row;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_fit(const dt_fit_desc *desc, dt_fit_result *result) {
  dt_fit_result res;
  dt__fit_run run;
  dt_result r;
  memset(&res, 0, sizeof res);
  memset(&run, 0, sizeof run);
  res.best_value = NAN;
  if (result) *result = res;
  if (!desc) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fit: desc is NULL");
  r = dt__fit_check(desc);
  if (r != DTRAIN_OK) return r;

  const dt_fit_desc *d = desc;
  const int64_t epochs = d->epochs ? d->epochs : 1;
  const int64_t bsize = d->batch_size ? d->batch_size : 1;
  const int64_t ckpt_every = d->checkpoint_every ? d->checkpoint_every : 1;
  const dt_fit_monitor mon = d->monitor != DTRAIN_FIT_MONITOR_AUTO ? d->monitor
                           : d->evaluate ? DTRAIN_FIT_MONITOR_VAL_LOSS : DTRAIN_FIT_MONITOR_TRAIN_LOSS;
  const int maximize = mon == DTRAIN_FIT_MONITOR_VAL_ACC || mon == DTRAIN_FIT_MONITOR_TRAIN_ACC;
  const double t_start = dt_time_now();
  int64_t wait = 0, start_batch = d->start_batch, last_ckpt_step = -1;
  int stop = 0;
  run.d = d;
  run.step = d->start_epoch * d->steps_per_epoch + d->start_batch;
  run.mode = DTRAIN_FIT_PROGRESS_QUIET;
#ifndef DTRAIN_NO_STDIO
  run.out = d->out ? d->out : stdout;
  run.mode = d->progress == DTRAIN_FIT_PROGRESS_AUTO ? (dt__fit_isatty(run.out) ? DTRAIN_FIT_PROGRESS_BAR
                                                                               : DTRAIN_FIT_PROGRESS_LINES)
                                                     : (int)d->progress;
#endif
  if (d->restore_best) {
    run.best_n = dt_params_size(d->params);
    run.best = (float *)dt__alloc((run.best_n ? run.best_n : 1) * sizeof(float));
    if (!run.best) {
      r = dt__error(DTRAIN_ERR_NOMEM, "dt_fit: out of memory for a copy of %zu parameters", run.best_n);
      goto done;
    }
  }

  for (int64_t e = d->start_epoch; e < epochs && !stop; e++) {
    dt_fit_epoch row;
    double loss_sum = 0, tr_secs = 0, last_draw = -1;
    int64_t samples = 0, acc_samples = 0, correct = 0, done_batches = 0, pos = start_batch;
    memset(&row, 0, sizeof row);
    (void)last_draw;
    (void)pos;
    for (int64_t b = start_batch; b < d->steps_per_epoch; b++) {
      dt_fit_batch bt;
      bt.epoch = e;
      bt.index = b;
      bt.step = dt__fit_step_now(&run);
      bt.loss = NAN;
      bt.samples = 0;
      bt.correct = -1;
      double t0 = dt_time_now();
      r = d->train_step(&bt, d->user);
      tr_secs += dt_time_now() - t0;
      if (r != DTRAIN_OK) {
        char inner[DT__MSG_CAP];
        snprintf(inner, sizeof inner, "%s", dt_last_result() == r ? dt_last_error() : dt_result_str(r));
        dt__error(r, "dt_fit: train step failed in epoch %lld, batch %lld of %lld: %s", (long long)e + 1,
                  (long long)b + 1, (long long)d->steps_per_epoch, inner);
        goto done;
      }
      if (!d->optim) run.step++;
      int64_t ns = bt.samples > 0 ? bt.samples : bsize;
      samples += ns;
      loss_sum += bt.loss * (double)ns;
      if (bt.correct >= 0) {
        correct += bt.correct;
        acc_samples += ns;
      }
      done_batches++;
      pos = b + 1;
#ifndef DTRAIN_NO_STDIO
      if (run.mode == DTRAIN_FIT_PROGRESS_BAR) {
        double now = dt_time_now();
        if (b + 1 == d->steps_per_epoch || last_draw < 0 || now - last_draw >= DT__FIT_REDRAW_SECONDS) {
          double rate = tr_secs > 0 ? (double)samples / tr_secs : 0;
          double eta = done_batches > 0 ? tr_secs / (double)done_batches * (double)(d->steps_per_epoch - b - 1) : 0;
          dt__fit_draw_bar(run.out, e, epochs, b + 1, d->steps_per_epoch, loss_sum / (double)samples,
                           acc_samples ? (double)correct / (double)acc_samples : NAN, rate, eta, NULL);
          last_draw = now;
        }
      } else if (run.mode == DTRAIN_FIT_PROGRESS_LINES && d->log_every > 0 && (b + 1) % d->log_every == 0 &&
                 b + 1 < d->steps_per_epoch) {
        fprintf(run.out, "epoch %lld/%lld  batch %lld/%lld", (long long)e + 1, (long long)epochs, (long long)b + 1,
                (long long)d->steps_per_epoch);
        dt__fit_metric(run.out, "loss", loss_sum / (double)samples);
        if (acc_samples) dt__fit_metric(run.out, "acc", (double)correct / (double)acc_samples);
        fputc('\n', run.out);
        fflush(run.out);
      }
#endif
      if (d->checkpoint_path && d->checkpoint_steps > 0 && b + 1 < d->steps_per_epoch) {
        int64_t now_step = dt__fit_step_now(&run);
        if (now_step % d->checkpoint_steps == 0 && now_step != last_ckpt_step) { /* once per step */
          r = dt__fit_checkpoint(&run, d->checkpoint_path, e, e, b + 1);
          if (r != DTRAIN_OK) goto done;
          last_ckpt_step = now_step;
        }
      }
      if (d->on_batch_end && d->on_batch_end(&bt, d->user)) {
        stop = 1;
        res.stopped_by_callback = 1;
        break;
      }
    }
    start_batch = 0;

    /* Epoch bookkeeping. */
    row.epoch = e + 1;
    row.step = dt__fit_step_now(&run);
    row.train_loss = samples ? loss_sum / (double)samples : NAN;
    row.train_acc = acc_samples ? (double)correct / (double)acc_samples : NAN;
    row.val_loss = row.val_acc = NAN;
    row.lr = d->optim ? (double)dt_optim_lr(d->optim) : NAN;
    row.train_seconds = tr_secs;
    row.samples = samples;
    row.samples_per_sec = tr_secs > 0 ? (double)samples / tr_secs : 0;
    if (d->evaluate) {
      dt_fit_eval ev;
      ev.epoch = e;
      ev.loss = NAN;
      ev.accuracy = NAN;
      r = d->evaluate(&ev, d->user);
      if (r != DTRAIN_OK) {
        char inner[DT__MSG_CAP];
        snprintf(inner, sizeof inner, "%s", dt_last_result() == r ? dt_last_error() : dt_result_str(r));
        dt__error(r, "dt_fit: evaluation failed after epoch %lld: %s", (long long)e + 1, inner);
        goto done;
      }
      row.val_loss = ev.loss;
      row.val_acc = ev.accuracy;
    }
    row.seconds = dt_time_now() - t_start;
    res.samples += samples;
    res.train_seconds += tr_secs;
    res.epochs_run++;
    res.last = row;
    r = dt__fit_push(&run, &row);
    if (r != DTRAIN_OK) goto done;

#ifndef DTRAIN_NO_STDIO
    if (run.mode == DTRAIN_FIT_PROGRESS_BAR) {
      dt__fit_draw_bar(run.out, e, epochs, pos, d->steps_per_epoch, row.train_loss, row.train_acc, 0, 0, &row);
      fputc('\n', run.out);
      fflush(run.out);
    } else if (run.mode == DTRAIN_FIT_PROGRESS_LINES) {
      dt__fit_print_line(run.out, epochs, &row);
    }
    if (d->csv_path) {
      r = dt__fit_csv_append(d->csv_path, &row);
      if (r != DTRAIN_OK) goto done;
    }
    if (d->svg_path) {
      r = dt_fit_write_svg(d->svg_path, run.hist, run.nhist, d->title);
      if (r != DTRAIN_OK) goto done;
    }
#endif

    /* Early stopping and the best epoch. */
    {
      double v = dt__fit_monitored(mon, &row);
      int improved = 0;
      if (dt__fit_finite(v)) {
        if (res.best_epoch == 0) improved = 1;
        else if (maximize) improved = v > res.best_value + d->min_delta;
        else improved = v < res.best_value - d->min_delta;
      }
      if (improved) {
        res.best_epoch = row.epoch;
        res.best_value = v;
        wait = 0;
        if (run.best) memcpy(run.best, dt_params_data(d->params), run.best_n * sizeof(float));
        if (d->best_path) {
          r = dt__fit_checkpoint(&run, d->best_path, e + 1, e + 1, 0);
          if (r != DTRAIN_OK) goto done;
        }
      } else {
        wait++;
        if (d->patience > 0 && wait >= d->patience) {
          stop = 1;
          res.stopped_early = 1;
        }
      }
    }
    if (d->on_epoch_end && d->on_epoch_end(&row, d->user)) {
      stop = 1;
      res.stopped_by_callback = 1;
    }
    if (d->checkpoint_path && ((e + 1 - d->start_epoch) % ckpt_every == 0 || e + 1 == epochs || stop)) {
      /* A hook may have stopped the epoch early: store where it stopped. */
      int complete = pos == d->steps_per_epoch;
      r = dt__fit_checkpoint(&run, d->checkpoint_path, complete ? e + 1 : e, complete ? e + 1 : e,
                             complete ? 0 : pos);
      if (r != DTRAIN_OK) goto done;
    }
#ifndef DTRAIN_NO_STDIO
    if (res.stopped_early && run.mode != DTRAIN_FIT_PROGRESS_QUIET)
      fprintf(run.out, "early stopping: %s did not improve by more than %g for %lld epochs (best %.4f at epoch %lld)\n",
              dt__fit_monitor_name(mon), d->min_delta, (long long)wait, res.best_value, (long long)res.best_epoch);
#endif
  }

  if (run.best && res.best_epoch > 0) {
    memcpy(dt_params_data(d->params), run.best, run.best_n * sizeof(float));
    res.restored_best = 1;
#ifndef DTRAIN_NO_STDIO
    if (run.mode != DTRAIN_FIT_PROGRESS_QUIET && res.best_epoch != res.last.epoch)
      fprintf(run.out, "restored the parameters of epoch %lld (%s %.4f)\n", (long long)res.best_epoch,
              dt__fit_monitor_name(mon), res.best_value);
#endif
  }
  r = DTRAIN_OK;

done:
#ifndef DTRAIN_NO_STDIO
  if (r != DTRAIN_OK && run.mode == DTRAIN_FIT_PROGRESS_BAR) {
    fputc('\n', run.out); /* do not leave the error behind a half-drawn bar */
    fflush(run.out);
  }
#endif
  res.step = dt__fit_step_now(&run);
  res.total_seconds = dt_time_now() - t_start;
  res.samples_per_sec = res.train_seconds > 0 ? (double)res.samples / res.train_seconds : 0;
  if (result) *result = res;
  dt__free(run.best, (run.best_n ? run.best_n : 1) * sizeof(float));
  dt__free(run.hist, (size_t)run.hist_cap * sizeof(dt_fit_epoch));
  return r;
}

#undef DT__FIT_BAR_WIDTH
#undef DT__FIT_REDRAW_SECONDS
/* ======== end dt_fit.c ======== */

/* ======== begin dt_data_core.h ======== */
/* ===========================================================================
 * dt_data_core.h -- what the data files share: whole files (gunzipped when
 * they are gzip data) and new datasets
 * ===========================================================================
 * dt_data.c: files, datasets, the loader; dt_data_idx.c: IDX and
 * Fashion-MNIST; dt_data_npy.c: NPY; dt_data_text.c: CSV and text corpora;
 * dt_inflate.c: gzip.
 */
#ifndef DTRAIN_DATA_CORE_H
#define DTRAIN_DATA_CORE_H

/* #include "dt_internal.h" (amalgamated) */

#define DT__DATA_CTX 384 /* a message prefix: "<function>: '<path>'" */

/* From dt_inflate.c: gunzip `in` appending to `out`, messages prefixed by ctx. */
DTRAIN_PRIVATE dt_result dt__gunzip_ctx(const char *ctx, const unsigned char *in, size_t len, size_t max_out,
                                        dt_bytes *out);
/* The whole file at path into *out (who: the public function, for messages);
 * gunzipped when gz and the data has the gzip magic. UNSUPPORTED with
 * DTRAIN_NO_STDIO. */
DTRAIN_PRIVATE dt_result dt__data_load(const char *who, const char *path, int gz, dt_bytes *out);
/* Bytes of a parse_* input, gunzipped into tmp when they are gzip data
 * (*p and *len then point at tmp's bytes; free tmp after use). */
DTRAIN_PRIVATE dt_result dt__data_maybe_gunzip(const char *ctx, const unsigned char **p, size_t *len, dt_bytes *tmp);
/* A zeroed dataset of n samples of the given shape (and n labels when
 * with_labels), all sizes checked; who names the caller in messages. */
DTRAIN_PRIVATE dt_result dt__data_ds_new(const char *who, dt_dataset **out, int64_t n, int ndim, const int64_t *shape,
                                         int with_labels);
/* Labels must be >= 0; sets num_classes to max + 1. */
DTRAIN_PRIVATE dt_result dt__data_set_classes(const char *who, dt_dataset *ds);

#endif /* DTRAIN_DATA_CORE_H */
/* ======== end dt_data_core.h ======== */

/* ======== begin dt_inflate.c ======== */
/* ===========================================================================
 * dt_inflate.c -- gzip (RFC 1952) and a small inflater (RFC 1951), CRC-32
 * ===========================================================================
 * The inflater decodes the three block types of deflate:
 *   stored (copy LEN bytes), fixed Huffman (the RFC's fixed codes) and
 *   dynamic Huffman (code lengths sent, themselves Huffman coded).
 * A Huffman code is canonical: it is fully described by each symbol's code
 * length. Decoding uses a 9-bit lookup table for short codes and walks the
 * canonical code bit by bit for longer ones. Every read is bounds-checked;
 * every malformed stream ends in DTRAIN_ERR_CORRUPT naming what was wrong
 * and where.
 *
 * With DTRAIN_USE_ZLIB the raw deflate decoding goes through zlib instead;
 * the gzip wrapper (header, CRC-32, ISIZE, members) is the same code.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_data_core.h" (amalgamated) */

#ifdef DTRAIN_USE_ZLIB
#  include <zlib.h>
#endif

#define DT__INFLATE_FAST 9           /* bits resolved by one table lookup */
#define DT__INFLATE_MAXBITS 15       /* longest deflate code */
#define DT__INFLATE_DEFAULT_MAX ((size_t)1 << (sizeof(size_t) >= 8 ? 32 : 30))

/* ---- byte buffers ---------------------------------------------------------------- */

DTRAIN_API void dt_bytes_free(dt_bytes *b) {
  if (!b) return;
  dt__free(b->data, b->cap);
  b->data = NULL;
  b->size = b->cap = 0;
}

/* Make room for `need` bytes plus a terminating 0 (cap > need), growing
 * geometrically but never past limit + 1. Returns 0 when that is impossible. */
static int dt__inflate_reserve(dt_bytes *b, size_t need, size_t limit) {
  if (need < b->cap) return 1;
  if (need > limit) return 0;
  size_t cap = b->cap ? b->cap : 4096;
  while (cap <= need) cap = cap > (SIZE_MAX - 1) / 2 ? need + 1 : cap * 2;
  if (cap > limit + 1) cap = limit + 1;
  unsigned char *p = (unsigned char *)dt__realloc(b->data, b->cap, cap);
  if (!p) return 0;
  b->data = p;
  b->cap = cap;
  return 1;
}

/* ---- CRC-32 ------------------------------------------------------------------------
 * Reflected polynomial 0xEDB88320. The 1 KiB table is built on the stack per
 * call (cheap next to any real input) so there is no shared state to race on. */
typedef struct dt__crc_table { uint32_t t[256]; } dt__crc_table;

static void dt__inflate_crc_init(dt__crc_table *c) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t v = n;
    for (int k = 0; k < 8; k++) v = (v & 1) ? 0xEDB88320u ^ (v >> 1) : v >> 1;
    c->t[n] = v;
  }
}

static uint32_t dt__inflate_crc(const dt__crc_table *c, uint32_t crc, const unsigned char *p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; i++) crc = c->t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

DTRAIN_API uint32_t dt_crc32(uint32_t crc, const void *data, size_t len) {
  if (!data || len == 0) return crc;
  dt__crc_table c;
  dt__inflate_crc_init(&c);
  return dt__inflate_crc(&c, crc, (const unsigned char *)data, len);
}

/* ---- raw deflate ----------------------------------------------------------------------
 * dt__inflate_raw appends the decoded bytes of one deflate stream to `out`
 * (whose existing bytes are not a valid back-reference target) and reports
 * how many input bytes the stream used. On error it returns the code and sets
 * *why to a static description; *where is the input byte near the error. */

#ifndef DTRAIN_USE_ZLIB

typedef struct dt__huff {
  uint16_t count[DT__INFLATE_MAXBITS + 1]; /* number of codes of each length */
  uint16_t symbol[288];                    /* symbols ordered by (length, value) */
  uint16_t fast[1 << DT__INFLATE_FAST];    /* next 9 bits -> symbol | len << 9; 0: slow path */
} dt__huff;

typedef struct dt__inflater {
  const unsigned char *in;
  size_t len, pos;          /* input and the next unread byte */
  uint64_t bits;            /* bit buffer: the next bits of the stream, LSB first */
  int nbits;
  dt_bytes *out;
  size_t base;              /* out->size when this stream began */
  size_t limit;             /* max out->size */
  const char *why;          /* error description (static string) */
  dt_result code;
} dt__inflater;

static int dt__inflate_fail(dt__inflater *s, dt_result code, const char *why) {
  if (!s->why) {
    s->why = why;
    s->code = code;
  }
  return 0;
}

static void dt__inflate_refill(dt__inflater *s) {
  while (s->nbits <= 56 && s->pos < s->len) {
    s->bits |= (uint64_t)s->in[s->pos++] << s->nbits;
    s->nbits += 8;
  }
}

/* Take n (0..16) bits; 0 if the input ends first. */
static int dt__inflate_bits(dt__inflater *s, int n, unsigned *v) {
  if (s->nbits < n) dt__inflate_refill(s);
  if (s->nbits < n) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream");
  *v = (unsigned)(s->bits & ((1u << n) - 1u));
  s->bits >>= n;
  s->nbits -= n;
  return 1;
}

/* Drop the bits of a partly used byte and hand whole buffered bytes back to
 * the input, so that pos is the next byte of the stream. */
static void dt__inflate_align(dt__inflater *s) {
  int drop = s->nbits & 7;
  s->bits >>= drop;
  s->nbits -= drop;
  s->pos -= (size_t)(s->nbits / 8);
  s->bits = 0;
  s->nbits = 0;
}

/* Build a canonical code from lengths[0..n). Over-subscribed sets are
 * refused; an incomplete set only when allow_incomplete (deflate permits one
 * for literal/length and distance codes made of a single 1-bit code, and an
 * empty distance code). Returns 0 (with s->why set) on a bad set. */
static int dt__inflate_build(dt__inflater *s, dt__huff *h, const uint8_t *lengths, int n, int allow_incomplete) {
  uint16_t offs[DT__INFLATE_MAXBITS + 2];
  memset(h->count, 0, sizeof h->count);
  memset(h->fast, 0, sizeof h->fast);
  for (int i = 0; i < n; i++) h->count[lengths[i]]++;
  int used = n - h->count[0]; /* symbols that have a code */
  /* Kraft: each length doubles the code space; every code uses up one slot. */
  int left = 1, maxlen = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) {
    left = left * 2 - h->count[len];
    if (left < 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "over-subscribed Huffman code");
    if (h->count[len]) maxlen = len;
  }
  if (left > 0 && used > 0 && !(allow_incomplete && maxlen == 1))
    return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "incomplete Huffman code");
  if (used == 0 && !allow_incomplete) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "empty Huffman code");
  /* Symbols sorted by length, then value. */
  offs[1] = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) offs[len + 1] = (uint16_t)(offs[len] + h->count[len]);
  for (int i = 0; i < n; i++)
    if (lengths[i]) h->symbol[offs[lengths[i]]++] = (uint16_t)i;
  /* Fast table: walk the codes in canonical order. Code bits are sent most
   * significant first, so the table index is the code bit-reversed. */
  unsigned code = 0;
  int k = 0;
  for (int len = 1; len <= DT__INFLATE_FAST; len++) {
    for (int j = 0; j < h->count[len]; j++, k++, code++) {
      unsigned rev = 0;
      for (int b = 0; b < len; b++) rev |= ((code >> b) & 1u) << (len - 1 - b);
      uint16_t entry = (uint16_t)(h->symbol[k] | (unsigned)len << 9);
      for (unsigned i = rev; i < (1u << DT__INFLATE_FAST); i += 1u << len) h->fast[i] = entry;
    }
    code <<= 1;
  }
  return 1;
}

/* Decode one symbol; -1 on error. */
static int dt__inflate_decode(dt__inflater *s, const dt__huff *h) {
  if (s->nbits < DT__INFLATE_MAXBITS) dt__inflate_refill(s);
  unsigned e = h->fast[s->bits & ((1u << DT__INFLATE_FAST) - 1u)];
  if (e) {
    int len = (int)(e >> 9);
    if (len > s->nbits) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream"), -1;
    s->bits >>= len;
    s->nbits -= len;
    return (int)(e & 0x1FF);
  }
  /* Slow path: the codes of length len are the integers first..first+count-1
   * (in canonical order); extend the code one bit at a time. */
  int code = 0, first = 0, index = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) {
    if (len > s->nbits) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream"), -1;
    code |= (int)((s->bits >> (len - 1)) & 1u);
    int count = h->count[len];
    if (code - first < count) {
      s->bits >>= len;
      s->nbits -= len;
      return h->symbol[index + (code - first)];
    }
    index += count;
    first = (first + count) << 1;
    code <<= 1;
  }
  return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid Huffman code"), -1;
}

static int dt__inflate_stored(dt__inflater *s) {
  dt__inflate_align(s);
  if (s->len - s->pos < 4) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated stored block header");
  unsigned n = dt__get_le16(s->in + s->pos), nc = dt__get_le16(s->in + s->pos + 2);
  if ((n ^ 0xFFFFu) != nc) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "stored block length check (LEN/NLEN) fails");
  s->pos += 4;
  if (s->len - s->pos < n) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated stored block");
  if (!dt__inflate_reserve(s->out, s->out->size + n, s->limit))
    return dt__inflate_fail(s, s->out->size + n > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                            "output does not fit (size limit or out of memory)");
  if (n) memcpy(s->out->data + s->out->size, s->in + s->pos, n);
  s->out->size += n;
  s->pos += n;
  return 1;
}

static const uint16_t dt__inflate_len_base[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                                  31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
static const uint8_t dt__inflate_len_extra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                                  2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
static const uint16_t dt__inflate_dist_base[30] = {1,    2,    3,    4,    5,    7,     9,     13,    17,  25,
                                                   33,   49,   65,   97,   129,  193,   257,   385,   513, 769,
                                                   1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
static const uint8_t dt__inflate_dist_extra[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                                   6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

/* Decode literal/length + distance symbols until end-of-block (256). */
static int dt__inflate_codes(dt__inflater *s, const dt__huff *lit, const dt__huff *dist) {
  dt_bytes *o = s->out;
  for (;;) {
    int sym = dt__inflate_decode(s, lit);
    if (sym < 0) return 0;
    if (sym < 256) {
      if (o->size + 1 >= o->cap && !dt__inflate_reserve(o, o->size + 1, s->limit))
        return dt__inflate_fail(s, o->size + 1 > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                                "output does not fit (size limit or out of memory)");
      o->data[o->size++] = (unsigned char)sym;
      continue;
    }
    if (sym == 256) return 1;
    sym -= 257;
    if (sym >= 29) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid literal/length symbol (286 or 287)");
    unsigned extra, len, d;
    if (!dt__inflate_bits(s, dt__inflate_len_extra[sym], &extra)) return 0;
    len = dt__inflate_len_base[sym] + extra;
    int ds = dt__inflate_decode(s, dist);
    if (ds < 0) return 0;
    if (ds >= 30) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid distance symbol (30 or 31)");
    if (!dt__inflate_bits(s, dt__inflate_dist_extra[ds], &extra)) return 0;
    d = dt__inflate_dist_base[ds] + extra;
    if (d > o->size - s->base) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "distance too far back");
    if (o->size + len >= o->cap && !dt__inflate_reserve(o, o->size + len, s->limit))
      return dt__inflate_fail(s, o->size + len > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                              "output does not fit (size limit or out of memory)");
    /* Byte by byte: the source may overlap the bytes being written (d < len). */
    unsigned char *dst = o->data + o->size;
    const unsigned char *src = dst - d;
    for (unsigned i = 0; i < len; i++) dst[i] = src[i];
    o->size += len;
  }
}

static int dt__inflate_fixed(dt__inflater *s, dt__huff *lit, dt__huff *dist) {
  uint8_t l[288];
  int i = 0;
  for (; i < 144; i++) l[i] = 8;
  for (; i < 256; i++) l[i] = 9;
  for (; i < 280; i++) l[i] = 7;
  for (; i < 288; i++) l[i] = 8;
  if (!dt__inflate_build(s, lit, l, 288, 0)) return 0;
  for (i = 0; i < 32; i++) l[i] = 5; /* 30 and 31 are in the code but invalid */
  if (!dt__inflate_build(s, dist, l, 32, 0)) return 0;
  return dt__inflate_codes(s, lit, dist);
}

static int dt__inflate_dynamic(dt__inflater *s, dt__huff *lit, dt__huff *dist) {
  static const uint8_t order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
  uint8_t lengths[288 + 32];
  unsigned hlit, hdist, hclen, v;
  if (!dt__inflate_bits(s, 5, &hlit) || !dt__inflate_bits(s, 5, &hdist) || !dt__inflate_bits(s, 4, &hclen)) return 0;
  hlit += 257;
  hdist += 1;
  hclen += 4;
  if (hlit > 286) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "too many literal/length codes (HLIT > 286)");
  if (hdist > 30) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "too many distance codes (HDIST > 30)");
  /* The code-length code: 3 bits per length, in the RFC's order. */
  memset(lengths, 0, sizeof lengths);
  for (unsigned i = 0; i < hclen; i++) {
    if (!dt__inflate_bits(s, 3, &v)) return 0;
    lengths[order[i]] = (uint8_t)v;
  }
  for (unsigned i = hclen; i < 19; i++) lengths[order[i]] = 0;
  dt__huff *clen = lit; /* reuse the literal table's storage for the code-length code */
  if (!dt__inflate_build(s, clen, lengths, 19, 0)) return 0;
  /* Literal/length and distance code lengths, one sequence with repeats. */
  unsigned n = 0, total = hlit + hdist;
  while (n < total) {
    int sym = dt__inflate_decode(s, clen);
    if (sym < 0) return 0;
    if (sym < 16) {
      lengths[n++] = (uint8_t)sym;
      continue;
    }
    uint8_t val = 0;
    unsigned rep;
    if (sym == 16) {
      if (n == 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "repeat of a code length with none before it");
      val = lengths[n - 1];
      if (!dt__inflate_bits(s, 2, &rep)) return 0;
      rep += 3;
    } else if (sym == 17) {
      if (!dt__inflate_bits(s, 3, &rep)) return 0;
      rep += 3;
    } else {
      if (!dt__inflate_bits(s, 7, &rep)) return 0;
      rep += 11;
    }
    if (n + rep > total) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "code length repeat runs past the end");
    while (rep--) lengths[n++] = val;
  }
  if (lengths[256] == 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "no end-of-block code");
  if (!dt__inflate_build(s, lit, lengths, (int)hlit, 1)) return 0;
  if (!dt__inflate_build(s, dist, lengths + hlit, (int)hdist, 1)) return 0;
  return dt__inflate_codes(s, lit, dist);
}

static dt_result dt__inflate_raw(const unsigned char *in, size_t len, size_t *used, dt_bytes *out, size_t limit,
                                 const char **why, size_t *where) {
  dt__inflater s;
  dt__huff *tables = (dt__huff *)dt__alloc(2 * sizeof(dt__huff));
  if (!tables) {
    *why = "out of memory";
    *where = 0;
    return DTRAIN_ERR_NOMEM;
  }
  memset(&s, 0, sizeof s);
  s.in = in;
  s.len = len;
  s.out = out;
  s.base = out->size;
  s.limit = limit;
  int ok = 1;
  unsigned last = 0, type;
  while (ok && !last) {
    ok = dt__inflate_bits(&s, 1, &last) && dt__inflate_bits(&s, 2, &type);
    if (!ok) break;
    if (type == 0) ok = dt__inflate_stored(&s);
    else if (type == 1) ok = dt__inflate_fixed(&s, &tables[0], &tables[1]);
    else if (type == 2) ok = dt__inflate_dynamic(&s, &tables[0], &tables[1]);
    else ok = dt__inflate_fail(&s, DTRAIN_ERR_CORRUPT, "invalid block type 3");
  }
  dt__free(tables, 2 * sizeof(dt__huff));
  if (!ok) {
    *why = s.why;
    *where = s.pos;
    return s.code;
  }
  dt__inflate_align(&s);
  *used = s.pos;
  return DTRAIN_OK;
}

#else /* DTRAIN_USE_ZLIB */

static dt_result dt__inflate_raw(const unsigned char *in, size_t len, size_t *used, dt_bytes *out, size_t limit,
                                 const char **why, size_t *where) {
  z_stream z;
  memset(&z, 0, sizeof z);
  *where = 0;
  if (inflateInit2(&z, -MAX_WBITS) != Z_OK) {
    *why = "zlib inflateInit2 failed";
    return DTRAIN_ERR_INTERNAL;
  }
  size_t pos = 0;
  dt_result r = DTRAIN_OK;
  for (;;) {
    if (out->size + 1 >= out->cap) {
      size_t want = out->size + (out->size / 2 > 65536 ? out->size / 2 : 65536);
      if (want > limit) want = limit;
      if (want <= out->size || !dt__inflate_reserve(out, want, limit)) {
        r = out->size >= limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM;
        *why = "output does not fit (size limit or out of memory)";
        break;
      }
    }
    size_t chunk_in = DT__MIN(len - pos, (size_t)UINT_MAX);
    size_t chunk_out = DT__MIN(out->cap - 1 - out->size, (size_t)UINT_MAX);
    z.next_in = (Bytef *)(uintptr_t)(in + pos);
    z.avail_in = (uInt)chunk_in;
    z.next_out = (Bytef *)(out->data + out->size);
    z.avail_out = (uInt)chunk_out;
    int zr = inflate(&z, Z_NO_FLUSH);
    pos += chunk_in - z.avail_in;
    out->size += chunk_out - z.avail_out;
    if (zr == Z_STREAM_END) break;
    if (zr == Z_OK) continue;
    if (zr == Z_BUF_ERROR && z.avail_out == 0) continue; /* grow the output */
    if (zr == Z_BUF_ERROR) {
      r = DTRAIN_ERR_CORRUPT;
      *why = "truncated deflate stream";
      break;
    }
    r = zr == Z_MEM_ERROR ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_CORRUPT;
    *why = z.msg ? z.msg : "zlib reports a data error";
    break;
  }
  *where = pos;
  *used = pos;
  inflateEnd(&z);
  return r;
}

#endif /* DTRAIN_USE_ZLIB */

/* ---- public raw inflate -------------------------------------------------------------- */

static size_t dt__inflate_limit(size_t max_out) {
  return max_out ? DT__MIN(max_out, SIZE_MAX - 2) : DT__MIN(DT__INFLATE_DEFAULT_MAX, SIZE_MAX - 2);
}

DTRAIN_API dt_result dt_inflate(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_inflate: out is NULL");
  memset(out, 0, sizeof *out);
  if (!in && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_inflate: in is NULL");
  size_t used = 0, where = 0, limit = dt__inflate_limit(max_out);
  const char *why = "";
  if (!dt__inflate_reserve(out, 0, limit)) return dt__error(DTRAIN_ERR_NOMEM, "dt_inflate: out of memory");
  dt_result r = dt__inflate_raw((const unsigned char *)in, len, &used, out, limit, &why, &where);
  if (r != DTRAIN_OK) {
    dt_bytes_free(out);
    if (r == DTRAIN_ERR_OVERFLOW)
      return dt__error(r, "dt_inflate: decompressed data exceeds the limit of %zu bytes", limit);
    if (r == DTRAIN_ERR_NOMEM) return dt__error(r, "dt_inflate: out of memory while decompressing");
    return dt__error(r, "dt_inflate: corrupt deflate data: %s (near input byte %zu)", why, where);
  }
  out->data[out->size] = 0;
  return DTRAIN_OK;
}

/* ---- gzip ----------------------------------------------------------------------------
 * A gzip file is one or more members:
 *   1f 8b CM=8 FLG MTIME(4) XFL OS [XLEN(2) extra] [name\0] [comment\0] [HCRC(2)]
 *   deflate data, CRC-32 (4, little-endian) of the member's output, ISIZE (4) = its length mod 2^32. */
#define DT__GZ_FTEXT 0x01
#define DT__GZ_FHCRC 0x02
#define DT__GZ_FEXTRA 0x04
#define DT__GZ_FNAME 0x08
#define DT__GZ_FCOMMENT 0x10

/* ctx prefixes every message ("dt_idx_read: 'f.gz'"). Appends to out. */
DTRAIN_PRIVATE dt_result dt__gunzip_ctx(const char *ctx, const unsigned char *in, size_t len, size_t max_out,
                                        dt_bytes *out) {
  dt__crc_table crc;
  size_t pos = 0, limit = dt__inflate_limit(max_out);
  int member = 0;
  dt__inflate_crc_init(&crc);
  /* Size hint from the last ISIZE, bounded by what deflate can expand to
   * (at most 258 bytes per 2 bits, about 1032:1), so a forged value cannot
   * make us allocate much. */
  if (len >= 18 && out->cap == 0) {
    size_t hint = dt__get_le32(in + len - 4);
    size_t bound = len > (SIZE_MAX - 1024) / 1032 ? SIZE_MAX - 1024 : len * 1032 + 1024;
    hint = DT__MIN(DT__MIN(hint, bound), limit);
    if (!dt__inflate_reserve(out, hint, limit)) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, hint);
  }
  while (pos < len || member == 0) {
    size_t start = pos, rest = len - pos;
    if (rest < 2 || in[pos] != 0x1f || in[pos + 1] != 0x8b) {
      if (member == 0) return dt__error(DTRAIN_ERR_FORMAT, "%s: not gzip data (no 1f 8b magic)", ctx);
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: %zu bytes of trailing garbage after member %d",
                       ctx, rest, member);
    }
    if (rest < 18) return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated (member %d has %zu bytes, a member needs at least 18)", ctx, member + 1, rest);
    if (in[pos + 2] != 8)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: compression method %u is not deflate (8)", ctx,
                       (unsigned)in[pos + 2]);
    unsigned flg = in[pos + 3];
    if (flg & 0xE0) return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: reserved header flags set (0x%02x)", ctx, flg);
    pos += 10;
    if (flg & DT__GZ_FEXTRA) {
      if (len - pos < 2) goto truncated_header;
      size_t xlen = dt__get_le16(in + pos);
      pos += 2;
      if (len - pos < xlen) goto truncated_header;
      pos += xlen;
    }
    for (int f = 0; f < 2; f++) { /* zero-terminated name, then comment */
      if (!(flg & (f == 0 ? DT__GZ_FNAME : DT__GZ_FCOMMENT))) continue;
      const unsigned char *z = (const unsigned char *)memchr(in + pos, 0, len - pos);
      if (!z) goto truncated_header;
      pos = (size_t)(z - in) + 1;
    }
    if (flg & DT__GZ_FHCRC) {
      if (len - pos < 2) goto truncated_header;
      uint32_t want = dt__get_le16(in + pos);
      uint32_t got = dt__inflate_crc(&crc, 0, in + start, pos - start) & 0xFFFFu;
      if (want != got)
        return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: header CRC mismatch (stored 0x%04x, computed 0x%04x)",
                         ctx, (unsigned)want, (unsigned)got);
      pos += 2;
    }
    size_t used = 0, where = 0, before = out->size;
    const char *why = "";
    dt_result r = dt__inflate_raw(in + pos, len - pos, &used, out, limit, &why, &where);
    if (r == DTRAIN_ERR_OVERFLOW)
      return dt__error(r, "%s: decompressed data exceeds the limit of %zu bytes", ctx, limit);
    if (r == DTRAIN_ERR_NOMEM) return dt__error(r, "%s: out of memory while decompressing", ctx);
    if (r != DTRAIN_OK)
      return dt__error(r, "%s: corrupt gzip data: %s (near byte %zu of the file)", ctx, why, pos + where);
    pos += used;
    if (len - pos < 8)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated (the CRC-32/ISIZE trailer is missing)", ctx);
    uint32_t want_crc = dt__get_le32(in + pos), want_size = dt__get_le32(in + pos + 4);
    uint32_t got_crc = dt__inflate_crc(&crc, 0, out->data + before, out->size - before);
    uint32_t got_size = (uint32_t)((out->size - before) & 0xFFFFFFFFu);
    if (want_crc != got_crc)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: CRC-32 mismatch (stored 0x%08x, computed 0x%08x)", ctx,
                       (unsigned)want_crc, (unsigned)got_crc);
    if (want_size != got_size)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: ISIZE mismatch (stored %u, decompressed %u bytes)", ctx,
                       (unsigned)want_size, (unsigned)got_size);
    pos += 8;
    member++;
  }
  if (!dt__inflate_reserve(out, out->size, limit)) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", ctx);
  out->data[out->size] = 0;
  return DTRAIN_OK;
truncated_header:
  return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated header (member %d)", ctx, member + 1);
}

DTRAIN_API dt_result dt_gunzip(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_gunzip: out is NULL");
  memset(out, 0, sizeof *out);
  if (!in && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_gunzip: in is NULL");
  dt_result r = dt__gunzip_ctx("dt_gunzip", (const unsigned char *)in, len, max_out, out);
  if (r != DTRAIN_OK) dt_bytes_free(out);
  return r;
}

#undef DT__INFLATE_FAST
#undef DT__INFLATE_MAXBITS
#undef DT__INFLATE_DEFAULT_MAX
#undef DT__GZ_FTEXT
#undef DT__GZ_FHCRC
#undef DT__GZ_FEXTRA
#undef DT__GZ_FNAME
#undef DT__GZ_FCOMMENT
/* ======== end dt_inflate.c ======== */

/* ======== begin dt_data.c ======== */
/* ===========================================================================
 * dt_data.c -- files, datasets, the batch loader
 * ===========================================================================
 * The parsers (dt_data_idx.c, dt_data_npy.c, dt_data_text.c) work on bytes
 * in memory; the file functions here read the whole file (decompressing
 * gzip with dt_inflate.c) and hand the bytes to them. Every size a header
 * claims is checked against the bytes that are really there before anything
 * is allocated for it.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_data_core.h" (amalgamated) */

#ifndef DTRAIN_NO_STDIO
#  include <errno.h>
#endif

static int dt__data_is_gzip(const unsigned char *p, size_t len) { return len >= 2 && p[0] == 0x1f && p[1] == 0x8b; }

/* ---- files ---------------------------------------------------------------------------- */

#ifndef DTRAIN_NO_STDIO
static dt_result dt__data_read_raw(const char *who, const char *path, dt_bytes *out) {
  memset(out, 0, sizeof *out);
  FILE *f = fopen(path, "rb");
  if (!f) return dt__error(DTRAIN_ERR_IO, "%s: cannot open '%s': %s", who, path, strerror(errno));
  /* Probe one byte first: a directory (or another unreadable thing) fails
   * here, before its bogus size could be trusted for an allocation. */
  int c0 = fgetc(f);
  if (c0 == EOF && ferror(f)) {
    int e = errno;
    fclose(f);
    return dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, e ? strerror(e) : "read error");
  }
  size_t cap = 1 << 16;
  if (fseek(f, 0, SEEK_END) == 0) {
    long end = ftell(f);
    if (end > 0 && (unsigned long)end < (unsigned long)(SIZE_MAX - 1)) cap = (size_t)end + 1;
  }
  rewind(f);
  unsigned char *buf = (unsigned char *)dt__alloc(cap);
  if (!buf) {
    fclose(f);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory (%zu bytes)", who, path, cap);
  }
  size_t size = 0;
  for (;;) {
    if (size + 1 >= cap) { /* keep room for the terminating 0 */
      size_t ncap = cap > SIZE_MAX / 2 ? SIZE_MAX : cap * 2;
      unsigned char *nb = ncap > cap ? (unsigned char *)dt__realloc(buf, cap, ncap) : NULL;
      if (!nb) {
        dt__free(buf, cap);
        fclose(f);
        return dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory reading the file", who, path);
      }
      buf = nb;
      cap = ncap;
    }
    size_t got = fread(buf + size, 1, cap - 1 - size, f);
    size += got;
    if (got == 0) {
      if (ferror(f)) {
        int e = errno;
        dt__free(buf, cap);
        fclose(f);
        return dt__error(DTRAIN_ERR_IO, "%s: cannot read '%s': %s", who, path, e ? strerror(e) : "read error");
      }
      break;
    }
  }
  fclose(f);
  buf[size] = 0;
  out->data = buf;
  out->size = size;
  out->cap = cap;
  return DTRAIN_OK;
}
#endif

/* Whole file; gunzipped when gz and the data has the gzip magic. */
DTRAIN_PRIVATE dt_result dt__data_load(const char *who, const char *path, int gz, dt_bytes *out) {
  memset(out, 0, sizeof *out);
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: path is NULL", who);
#ifdef DTRAIN_NO_STDIO
  (void)gz;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "%s: file I/O is not available in this build (DTRAIN_NO_STDIO); parse from memory instead", who);
#else
  dt_bytes raw;
  dt_result r = dt__data_read_raw(who, path, &raw);
  if (r != DTRAIN_OK || !gz || !dt__data_is_gzip(raw.data, raw.size)) {
    *out = raw;
    return r;
  }
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "%s: '%s'", who, path);
  r = dt__gunzip_ctx(ctx, raw.data, raw.size, 0, out);
  dt_bytes_free(&raw);
  if (r != DTRAIN_OK) dt_bytes_free(out);
  return r;
#endif
}

DTRAIN_API dt_result dt_read_file(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file: out is NULL");
  return dt__data_load("dt_read_file", path, 0, out);
}

DTRAIN_API dt_result dt_read_file_gz(const char *path, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_read_file_gz: out is NULL");
  return dt__data_load("dt_read_file_gz", path, 1, out);
}

/* Bytes of a parse_* input, gunzipped into tmp when they are gzip data. */
DTRAIN_PRIVATE dt_result dt__data_maybe_gunzip(const char *ctx, const unsigned char **p, size_t *len, dt_bytes *tmp) {
  memset(tmp, 0, sizeof *tmp);
  if (!dt__data_is_gzip(*p, *len)) return DTRAIN_OK;
  dt_result r = dt__gunzip_ctx(ctx, *p, *len, 0, tmp);
  if (r != DTRAIN_OK) {
    dt_bytes_free(tmp);
    return r;
  }
  *p = tmp->data;
  *len = tmp->size;
  return DTRAIN_OK;
}

/* ---- datasets -------------------------------------------------------------------------------
 * The public struct is the first member of a private one that remembers the
 * allocation sizes, so a user who edits the fields cannot break the free. */
typedef struct dt__data_ds {
  dt_dataset pub;
  size_t xbytes, ybytes;
} dt__data_ds;

DTRAIN_API void dt_dataset_destroy(dt_dataset *ds) {
  if (!ds) return;
  dt__data_ds *d = (dt__data_ds *)ds;
  dt__free(ds->x, d->xbytes);
  dt__free(ds->y, d->ybytes);
  dt__free(d, sizeof *d);
}

DTRAIN_PRIVATE dt_result dt__data_ds_new(const char *who, dt_dataset **out, int64_t n, int ndim, const int64_t *shape,
                                 int with_labels) {
  *out = NULL;
  if (n < 1) return dt__error(DTRAIN_ERR_EMPTY, "%s: a dataset needs at least 1 sample (got %lld)", who, (long long)n);
  if (ndim < 1 || ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_RANK, "%s: a sample has %d dims (supported: 1 to %d)", who, ndim, DTRAIN_MAX_DIMS - 1);
  if (!shape) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: sample_shape is NULL", who);
  size_t per = 1, total, xbytes, ybytes = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 1) return dt__error(DTRAIN_ERR_SHAPE, "%s: sample dim %d is %lld (must be >= 1)", who, d, (long long)shape[d]);
    if ((uint64_t)shape[d] > SIZE_MAX || !dt__mul_size(per, (size_t)shape[d], &per))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s: sample size overflows", who);
  }
  if ((uint64_t)n > SIZE_MAX || !dt__mul_size(per, (size_t)n, &total) || !dt__mul_size(total, sizeof(float), &xbytes) ||
      (with_labels && !dt__mul_size((size_t)n, sizeof(int32_t), &ybytes)))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: %lld samples of %zu values overflow memory sizes", who, (long long)n, per);
  dt__data_ds *d = (dt__data_ds *)dt__calloc(sizeof *d);
  if (!d) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", who);
  d->xbytes = xbytes;
  d->ybytes = ybytes;
  d->pub.x = (float *)dt__calloc(xbytes);
  d->pub.y = with_labels ? (int32_t *)dt__calloc(ybytes) : NULL;
  if (!d->pub.x || (with_labels && !d->pub.y)) {
    dt_dataset_destroy(&d->pub);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes for %lld samples)", who, xbytes + ybytes, (long long)n);
  }
  d->pub.n = n;
  d->pub.sample_size = (int64_t)per;
  d->pub.ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) d->pub.shape[i] = i < ndim ? shape[i] : 1;
  *out = &d->pub;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_create(dt_dataset **out, int64_t n, int ndim, const int64_t *sample_shape,
                                       int with_labels) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_create: out is NULL");
  return dt__data_ds_new("dt_dataset_create", out, n, ndim, sample_shape, with_labels);
}

/* Labels must be >= 0; sets num_classes to max + 1. */
DTRAIN_PRIVATE dt_result dt__data_set_classes(const char *who, dt_dataset *ds) {
  int32_t mx = -1;
  for (int64_t i = 0; i < ds->n; i++) {
    if (ds->y[i] < 0)
      return dt__error(DTRAIN_ERR_INDEX, "%s: label %d of sample %lld is negative", who, (int)ds->y[i], (long long)i);
    if (ds->y[i] > mx) mx = ds->y[i];
  }
  ds->num_classes = mx == INT32_MAX ? INT32_MAX : mx + 1;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_subset(const dt_dataset *ds, const int64_t *idx, int64_t count, dt_dataset **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_subset: out is NULL");
  *out = NULL;
  if (!ds || !idx) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_subset: %s is NULL", ds ? "idx" : "ds");
  for (int64_t i = 0; i < count; i++)
    if (idx[i] < 0 || idx[i] >= ds->n)
      return dt__error(DTRAIN_ERR_INDEX, "dt_dataset_subset: idx[%lld] = %lld is out of range [0, %lld)", (long long)i,
                       (long long)idx[i], (long long)ds->n);
  dt_dataset *s;
  dt_result r = dt__data_ds_new("dt_dataset_subset", &s, count, ds->ndim, ds->shape, ds->y != NULL);
  if (r != DTRAIN_OK) return r;
  size_t row = (size_t)ds->sample_size;
  for (int64_t i = 0; i < count; i++) {
    memcpy(s->x + (size_t)i * row, ds->x + (size_t)idx[i] * row, row * sizeof(float));
    if (ds->y) s->y[i] = ds->y[idx[i]];
  }
  s->num_classes = ds->num_classes;
  *out = s;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_split(const dt_dataset *ds, double val_fraction, uint64_t seed, dt_dataset **train,
                                      dt_dataset **val) {
  if (!train || !val) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_split: train or val is NULL");
  *train = *val = NULL;
  if (!ds) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_split: ds is NULL");
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_dataset_split: val_fraction %g is not in (0, 1)", val_fraction);
  if (ds->n < 2)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_dataset_split: cannot split %lld sample(s) in two", (long long)ds->n);
  int64_t nval = (int64_t)floor((double)ds->n * val_fraction + 0.5);
  nval = DT__MAX(1, DT__MIN(nval, ds->n - 1));
  size_t n = (size_t)ds->n;
  int64_t *perm = (int64_t *)dt__alloc(n * sizeof(int64_t));
  int64_t *tr = (int64_t *)dt__alloc(n * sizeof(int64_t));
  unsigned char *is_val = (unsigned char *)dt__calloc(n);
  dt_result r = DTRAIN_OK;
  if (!perm || !tr || !is_val) {
    r = dt__error(DTRAIN_ERR_NOMEM, "dt_dataset_split: out of memory");
    goto done;
  }
  {
    /* The first nval entries of a seeded permutation go to validation; both
     * parts are then listed in the original order. */
    dt_rng rng;
    dt_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) perm[i] = (int64_t)i;
    for (size_t i = n - 1; i > 0; i--) {
      size_t j = (size_t)dt_rng_below(&rng, (uint64_t)i + 1);
      int64_t t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    for (int64_t i = 0; i < nval; i++) is_val[perm[i]] = 1;
    int64_t nt = 0, nv = 0;
    for (size_t i = 0; i < n; i++) {
      if (is_val[i]) perm[nv++] = (int64_t)i; /* perm is free for reuse: nv <= i */
      else tr[nt++] = (int64_t)i;
    }
    r = dt_dataset_subset(ds, tr, nt, train);
    if (r == DTRAIN_OK) r = dt_dataset_subset(ds, perm, nv, val);
    if (r != DTRAIN_OK) {
      dt_dataset_destroy(*train);
      *train = NULL;
    }
  }
done:
  dt__free(perm, n * sizeof(int64_t));
  dt__free(tr, n * sizeof(int64_t));
  dt__free(is_val, n);
  return r;
}

DTRAIN_API dt_result dt_dataset_reshape(dt_dataset *ds, int ndim, const int64_t *sample_shape) {
  if (!ds || !sample_shape) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_reshape: %s is NULL", ds ? "sample_shape" : "ds");
  if (ndim < 1 || ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_RANK, "dt_dataset_reshape: %d dims (supported: 1 to %d)", ndim, DTRAIN_MAX_DIMS - 1);
  int64_t per = 1;
  for (int d = 0; d < ndim; d++) {
    if (sample_shape[d] < 1 || sample_shape[d] > ds->sample_size)
      return dt__error(DTRAIN_ERR_SHAPE, "dt_dataset_reshape: dim %d is %lld", d, (long long)sample_shape[d]);
    per *= sample_shape[d];
    if (per > ds->sample_size) break;
  }
  if (per != ds->sample_size) {
    char a[160], b[160];
    return dt__error(DTRAIN_ERR_SHAPE, "dt_dataset_reshape: shape %s does not hold the %lld values of %s",
                     dt__shape_text(ndim, sample_shape, a, sizeof a), (long long)ds->sample_size,
                     dt__shape_text(ds->ndim, ds->shape, b, sizeof b));
  }
  ds->ndim = ndim;
  for (int i = 0; i < DTRAIN_MAX_DIMS; i++) ds->shape[i] = i < ndim ? sample_shape[i] : 1;
  return DTRAIN_OK;
}

/* ---- loader ----------------------------------------------------------------------------------------------- */

struct dt_loader {
  const dt_dataset *ds;
  int64_t batch_size;
  uint64_t seed;
  int shuffle, drop_last, shard, shards;
  int64_t shard_n;            /* samples of this shard per epoch */
  int64_t epoch, index;       /* the position */
  int64_t *perm;              /* the permutation of perm_epoch (shuffle only) */
  int64_t perm_epoch;
  size_t perm_bytes;
  float *bx;                  /* batch buffers, allocated once */
  int32_t *by;
  int64_t *bidx;
  size_t bx_bytes, by_bytes, bidx_bytes;
};

DTRAIN_API void dt_loader_destroy(dt_loader *l) {
  if (!l) return;
  dt__free(l->perm, l->perm_bytes);
  dt__free(l->bx, l->bx_bytes);
  dt__free(l->by, l->by_bytes);
  dt__free(l->bidx, l->bidx_bytes);
  dt__free(l, sizeof *l);
}

DTRAIN_API dt_result dt_loader_create(dt_loader **out, const dt_dataset *ds, const dt_loader_desc *desc) {
  const char *who = "dt_loader_create";
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!ds || !desc) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", who, ds ? "desc" : "ds");
  if (!ds->x || ds->n < 1 || ds->sample_size < 1 || ds->ndim < 1 || ds->ndim > DTRAIN_MAX_DIMS - 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: the dataset is empty or malformed", who);
  int shards = desc->shard_count ? desc->shard_count : 1;
  if (desc->batch_size < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: batch_size %lld must be >= 1", who, (long long)desc->batch_size);
  if (shards < 1 || desc->shard_index < 0 || desc->shard_index >= shards)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: shard %d of %d is not valid (need 0 <= shard_index < shard_count)", who,
                     desc->shard_index, shards);
  if ((int64_t)shards > ds->n)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d shards of %lld samples would leave shard(s) empty", who, shards,
                     (long long)ds->n);
  size_t bs = (size_t)desc->batch_size, row = (size_t)ds->sample_size, bx_bytes;
  if ((uint64_t)desc->batch_size > SIZE_MAX / sizeof(int64_t) || !dt__mul_size(bs, row, &bx_bytes) ||
      !dt__mul_size(bx_bytes, sizeof(float), &bx_bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: batch of %lld samples overflows", who, (long long)desc->batch_size);
  dt_loader *l = (dt_loader *)dt__calloc(sizeof *l);
  if (!l) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", who);
  l->ds = ds;
  l->batch_size = desc->batch_size;
  l->seed = desc->seed;
  l->shuffle = desc->shuffle != 0;
  l->drop_last = desc->drop_last != 0;
  l->shard = desc->shard_index;
  l->shards = shards;
  l->shard_n = ds->n / shards + (desc->shard_index < ds->n % shards ? 1 : 0);
  l->perm_epoch = -1;
  l->bx_bytes = bx_bytes;
  l->by_bytes = ds->y ? bs * sizeof(int32_t) : 0;
  l->bidx_bytes = bs * sizeof(int64_t);
  l->perm_bytes = l->shuffle ? (size_t)ds->n * sizeof(int64_t) : 0;
  l->bx = (float *)dt__alloc(l->bx_bytes);
  l->by = ds->y ? (int32_t *)dt__alloc(l->by_bytes) : NULL;
  l->bidx = (int64_t *)dt__alloc(l->bidx_bytes);
  l->perm = l->shuffle ? (int64_t *)dt__alloc(l->perm_bytes) : NULL;
  if (!l->bx || (ds->y && !l->by) || !l->bidx || (l->shuffle && !l->perm)) {
    dt_loader_destroy(l);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory for batch buffers", who);
  }
  *out = l;
  return DTRAIN_OK;
}

/* The permutation of epoch e depends on (seed, e) only: the RNG is seeded
 * from a hash of both, then Fisher-Yates runs over 0..n-1. */
static void dt__data_loader_perm(dt_loader *l, int64_t epoch) {
  if (!l->shuffle || l->perm_epoch == epoch) return;
  uint64_t st = l->seed;
  uint64_t k = dt__splitmix64(&st);
  st = k ^ ((uint64_t)epoch * 0xD1B54A32D192ED03ULL);
  dt_rng rng;
  dt_rng_seed(&rng, dt__splitmix64(&st));
  int64_t n = l->ds->n;
  for (int64_t i = 0; i < n; i++) l->perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)dt_rng_below(&rng, (uint64_t)i + 1);
    int64_t t = l->perm[i];
    l->perm[i] = l->perm[j];
    l->perm[j] = t;
  }
  l->perm_epoch = epoch;
}

DTRAIN_API int64_t dt_loader_sample_at(dt_loader *l, int64_t epoch, int64_t index) {
  if (!l || epoch < 0 || index < 0 || index >= l->shard_n) return -1;
  int64_t g = (int64_t)l->shard + index * (int64_t)l->shards; /* position in the epoch's order */
  if (!l->shuffle) return g;
  dt__data_loader_perm(l, epoch);
  return l->perm[g];
}

DTRAIN_API int dt_loader_next(dt_loader *l, dt_batch *b) {
  if (!l || !b) return (int)dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_next: %s is NULL", l ? "b" : "l");
  int64_t left = l->shard_n - l->index;
  if (left <= 0 || (l->drop_last && left < l->batch_size)) {
    l->epoch++;
    l->index = 0;
    return 0;
  }
  const dt_dataset *ds = l->ds;
  int64_t cnt = DT__MIN(left, l->batch_size);
  size_t row = (size_t)ds->sample_size;
  dt__data_loader_perm(l, l->epoch);
  for (int64_t j = 0; j < cnt; j++) {
    int64_t g = (int64_t)l->shard + (l->index + j) * (int64_t)l->shards;
    int64_t s = l->shuffle ? l->perm[g] : g;
    memcpy(l->bx + (size_t)j * row, ds->x + (size_t)s * row, row * sizeof(float));
    if (l->by) l->by[j] = ds->y[s];
    l->bidx[j] = s;
  }
  b->x = l->bx;
  b->y = l->by;
  b->index = l->bidx;
  b->size = cnt;
  b->ndim = 1 + ds->ndim;
  b->shape[0] = cnt;
  for (int d = 1; d < DTRAIN_MAX_DIMS; d++) b->shape[d] = d - 1 < ds->ndim ? ds->shape[d - 1] : 1;
  b->epoch = l->epoch;
  b->start = l->index;
  l->index += cnt;
  return 1;
}

DTRAIN_API void dt_loader_position(const dt_loader *l, int64_t *epoch, int64_t *index) {
  if (epoch) *epoch = l ? l->epoch : 0;
  if (index) *index = l ? l->index : 0;
}

DTRAIN_API dt_result dt_loader_set_position(dt_loader *l, int64_t epoch, int64_t index) {
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_loader_set_position: l is NULL");
  if (epoch < 0 || index < 0 || index > l->shard_n)
    return dt__error(DTRAIN_ERR_INDEX, "dt_loader_set_position: (epoch %lld, index %lld) is out of range (index 0..%lld)",
                     (long long)epoch, (long long)index, (long long)l->shard_n);
  l->epoch = epoch;
  l->index = index;
  return DTRAIN_OK;
}

DTRAIN_API int64_t dt_loader_num_samples(const dt_loader *l) { return l ? l->shard_n : 0; }

DTRAIN_API int64_t dt_loader_num_batches(const dt_loader *l) {
  if (!l) return 0;
  return l->drop_last ? l->shard_n / l->batch_size : (l->shard_n + l->batch_size - 1) / l->batch_size;
}
/* ======== end dt_data.c ======== */

/* ======== begin dt_data_idx.c ======== */
/* ===========================================================================
 * dt_data_idx.c -- IDX files and Fashion-MNIST
 * ===========================================================================
 * IDX (the MNIST format): magic 00 00 08 NDIM, NDIM big-endian u32 sizes,
 * then the unsigned bytes. Datasets from an image file and a label file;
 * Fashion-MNIST found in the usual places.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_data_core.h" (amalgamated) */

#define DT__DATA_FM_SYSTEM "/usr/share/datasets/fashion-mnist"
#define DT__DATA_FM_SHIPPED "data/fashion-mnist"

/* ---- IDX -------------------------------------------------------------------------------- */

/* Validate an IDX image; fills ndim/shape/size and the data offset. */
static dt_result dt__data_idx_header(const char *ctx, const unsigned char *p, size_t len, int *ndim, int64_t *shape,
                                     int64_t *size, size_t *offset) {
  if (len < 4)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated IDX file (%zu bytes; the header alone needs at least 4)", ctx, len);
  if (p[0] != 0 || p[1] != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: bad magic %02x %02x %02x %02x: not an IDX file (expected 00 00 08 NDIM)", ctx,
                     p[0], p[1], p[2], p[3]);
  if (p[2] != 0x08)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX data type 0x%02x is not supported (only 0x08, unsigned byte)", ctx, p[2]);
  int nd = p[3];
  if (nd < 1 || nd > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX file has %d dimensions (supported: 1 to %d)", ctx, nd, DTRAIN_MAX_DIMS);
  size_t hdr = 4 + 4 * (size_t)nd;
  if (len < hdr)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated IDX header (%zu bytes, %zu needed for %d dimensions)", ctx, len, hdr,
                     nd);
  size_t total = 1;
  int overflow = 0;
  for (int d = 0; d < nd; d++) {
    uint32_t v = dt__get_be32(p + 4 + 4 * d);
    shape[d] = (int64_t)v;
    if (v == 0) return dt__error(DTRAIN_ERR_FORMAT, "%s: IDX dimension %d is 0", ctx, d);
    if (!dt__mul_size(total, (size_t)v, &total)) overflow = 1;
  }
  char sh[160];
  dt__shape_text(nd, shape, sh, sizeof sh);
  size_t avail = len - hdr;
  if (overflow || total > avail || total > (size_t)INT64_MAX)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: IDX header claims shape %s but only %zu data bytes follow (truncated or corrupt)",
                     ctx, sh, avail);
  if (total < avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: IDX file has %zu bytes after the data of shape %s", ctx, avail - total, sh);
  for (int d = nd; d < DTRAIN_MAX_DIMS; d++) shape[d] = 1;
  *ndim = nd;
  *size = (int64_t)total;
  *offset = hdr;
  return DTRAIN_OK;
}

static dt_result dt__data_idx_parse(const char *ctx, const unsigned char *p, size_t len, dt_idx *out) {
  dt_bytes tmp;
  dt_result r = dt__data_maybe_gunzip(ctx, &p, &len, &tmp);
  if (r != DTRAIN_OK) return r;
  size_t off = 0;
  r = dt__data_idx_header(ctx, p, len, &out->ndim, out->shape, &out->size, &off);
  if (r == DTRAIN_OK) {
    out->bytes_ = (size_t)out->size;
    out->data = (unsigned char *)dt__alloc(out->bytes_);
    if (!out->data) r = dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, out->bytes_);
    else memcpy(out->data, p + off, out->bytes_);
  }
  dt_bytes_free(&tmp);
  if (r != DTRAIN_OK) dt_idx_free(out);
  return r;
}

DTRAIN_API void dt_idx_free(dt_idx *a) {
  if (!a) return;
  dt__free(a->data, a->bytes_);
  memset(a, 0, sizeof *a);
}

DTRAIN_API dt_result dt_idx_parse(const void *buf, size_t len, dt_idx *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_parse: buf is NULL");
  return dt__data_idx_parse("dt_idx_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_idx_read(const char *path, dt_idx *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_idx_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_idx_read", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_idx_read: '%s'", path);
  r = dt__data_idx_parse(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

/* ---- datasets from IDX ------------------------------------------------------------------------ */

static dt_result dt__data_from_idx(const char *ictx, const char *lctx, dt_dataset **out, const unsigned char *ip,
                                   size_t ilen, const unsigned char *lp, size_t llen, int has_labels, unsigned flags) {
  dt_bytes itmp, ltmp;
  int ind = 0, lnd = 0;
  int64_t ish[DTRAIN_MAX_DIMS], lsh[DTRAIN_MAX_DIMS], isize = 0, lsize = 0;
  size_t ioff = 0, loff = 0;
  memset(&ltmp, 0, sizeof ltmp);
  dt_result r = dt__data_maybe_gunzip(ictx, &ip, &ilen, &itmp);
  if (r != DTRAIN_OK) return r;
  r = dt__data_idx_header(ictx, ip, ilen, &ind, ish, &isize, &ioff);
  if (r == DTRAIN_OK && ind < 2)
    r = dt__error(DTRAIN_ERR_FORMAT, "%s: an images file needs at least 2 dimensions (count, values...), this one has 1",
                  ictx);
  if (r == DTRAIN_OK && has_labels) {
    r = dt__data_maybe_gunzip(lctx, &lp, &llen, &ltmp);
    if (r == DTRAIN_OK) r = dt__data_idx_header(lctx, lp, llen, &lnd, lsh, &lsize, &loff);
    if (r == DTRAIN_OK && lnd != 1) {
      char sh[160];
      r = dt__error(DTRAIN_ERR_FORMAT, "%s: a labels file must be 1-D, this one has shape %s", lctx,
                    dt__shape_text(lnd, lsh, sh, sizeof sh));
    }
    if (r == DTRAIN_OK && lsh[0] != ish[0])
      r = dt__error(DTRAIN_ERR_MISMATCH, "%s: %lld images but %lld labels", ictx, (long long)ish[0], (long long)lsh[0]);
  }
  dt_dataset *ds = NULL;
  if (r == DTRAIN_OK) r = dt__data_ds_new(ictx, &ds, ish[0], ind - 1, ish + 1, has_labels);
  if (r == DTRAIN_OK) {
    const unsigned char *px = ip + ioff;
    size_t total = (size_t)isize;
    float scale = (flags & DTRAIN_DATA_RAW) ? 1.0f : 1.0f / 255.0f;
    for (size_t i = 0; i < total; i++) ds->x[i] = (float)px[i] * scale;
    if (has_labels) {
      for (int64_t i = 0; i < ds->n; i++) ds->y[i] = lp[loff + (size_t)i];
      dt__data_set_classes(lctx, ds);
    }
    *out = ds;
  }
  dt_bytes_free(&itmp);
  dt_bytes_free(&ltmp);
  return r;
}

DTRAIN_API dt_result dt_dataset_parse_idx(dt_dataset **out, const void *images, size_t images_len, const void *labels,
                                          size_t labels_len, unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: out is NULL");
  *out = NULL;
  if (!images) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: images is NULL");
  if (!labels && labels_len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_idx: labels is NULL");
  return dt__data_from_idx("dt_dataset_parse_idx: images", "dt_dataset_parse_idx: labels", out,
                           (const unsigned char *)images, images_len, (const unsigned char *)labels, labels_len,
                           labels != NULL && labels_len > 0, flags);
}

DTRAIN_API dt_result dt_dataset_read_idx(dt_dataset **out, const char *images_path, const char *labels_path,
                                         unsigned flags) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_idx: out is NULL");
  *out = NULL;
  if (!images_path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_idx: images_path is NULL");
  dt_bytes ib, lb;
  memset(&lb, 0, sizeof lb);
  dt_result r = dt__data_load("dt_dataset_read_idx", images_path, 0, &ib); /* gunzipped by the parser */
  if (r != DTRAIN_OK) return r;
  if (labels_path) r = dt__data_load("dt_dataset_read_idx", labels_path, 0, &lb);
  if (r == DTRAIN_OK) {
    char ictx[DT__DATA_CTX], lctx[DT__DATA_CTX];
    snprintf(ictx, sizeof ictx, "dt_dataset_read_idx: '%s'", images_path);
    snprintf(lctx, sizeof lctx, "dt_dataset_read_idx: '%s'", labels_path ? labels_path : "");
    r = dt__data_from_idx(ictx, lctx, out, ib.data, ib.size, lb.data, lb.size, labels_path != NULL, flags);
  }
  dt_bytes_free(&ib);
  dt_bytes_free(&lb);
  return r;
}

/* ---- Fashion-MNIST ------------------------------------------------------------------------------ */

#ifndef DTRAIN_NO_STDIO
/* Path of dir/base.gz or dir/base, whichever exists (gz first); 0 if neither. */
static int dt__data_fm_file(const char *dir, const char *base, char *path, size_t cap) {
  for (int gz = 1; gz >= 0; gz--) {
    int n = snprintf(path, cap, "%s/%s%s", dir, base, gz ? ".gz" : "");
    if (n < 0 || (size_t)n >= cap) return 0;
    FILE *f = fopen(path, "rb");
    if (f) {
      fclose(f);
      return 1;
    }
  }
  return 0;
}

static int dt__data_fm_has(const char *dir, int train) {
  char p[1024];
  return dt__data_fm_file(dir, train ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte", p, sizeof p) &&
         dt__data_fm_file(dir, train ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte", p, sizeof p);
}
#endif

DTRAIN_API dt_result dt_fashion_mnist_find(const char *dir, char *out, size_t cap, int *has_train) {
  if (has_train) *has_train = 0;
  if (!out || cap == 0) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fashion_mnist_find: out is NULL or cap is 0");
  out[0] = '\0';
#ifdef DTRAIN_NO_STDIO
  (void)dir;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fashion_mnist_find: file I/O is not available in this build (DTRAIN_NO_STDIO)");
#else
  const char *cands[2] = {DT__DATA_FM_SYSTEM, DT__DATA_FM_SHIPPED};
  const char *found = NULL;
  if (dir) {
    if (dt__data_fm_has(dir, 0)) found = dir;
  } else {
    for (int i = 0; i < 2 && !found; i++)
      if (dt__data_fm_has(cands[i], 0)) found = cands[i];
  }
  if (!found) {
    if (dir)
      return dt__error(DTRAIN_ERR_NOT_FOUND,
                       "dt_fashion_mnist_find: no Fashion-MNIST in '%s' (need t10k-images-idx3-ubyte[.gz] and "
                       "t10k-labels-idx1-ubyte[.gz])", dir);
    return dt__error(DTRAIN_ERR_NOT_FOUND,
                     "dt_fashion_mnist_find: no Fashion-MNIST found in " DT__DATA_FM_SYSTEM " (apt-get install "
                     "dataset-fashion-mnist) nor in " DT__DATA_FM_SHIPPED " (run from the dtrain directory)");
  }
  if (strlen(found) + 1 > cap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_fashion_mnist_find: out (%zu bytes) is too small for '%s'", cap, found);
  memcpy(out, found, strlen(found) + 1);
  int train = dt__data_fm_has(found, 1);
  if (has_train) *has_train = train;
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "Fashion-MNIST: using '%s' (%s)", found,
          train ? "train and test splits" : "test split only");
  return DTRAIN_OK;
#endif
}

DTRAIN_API dt_result dt_fashion_mnist_load(const char *dir, dt_dataset **train, dt_dataset **test) {
  if (train) *train = NULL;
  if (!test) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fashion_mnist_load: test is NULL");
  *test = NULL;
#ifdef DTRAIN_NO_STDIO
  (void)dir;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fashion_mnist_load: file I/O is not available in this build (DTRAIN_NO_STDIO)");
#else
  char d[1024], ip[1100], lp[1100];
  int has_train = 0;
  dt_result r = dt_fashion_mnist_find(dir, d, sizeof d, &has_train);
  if (r != DTRAIN_OK) return r;
  dt__data_fm_file(d, "t10k-images-idx3-ubyte", ip, sizeof ip);
  dt__data_fm_file(d, "t10k-labels-idx1-ubyte", lp, sizeof lp);
  r = dt_dataset_read_idx(test, ip, lp, 0);
  if (r == DTRAIN_OK && train && has_train) {
    dt__data_fm_file(d, "train-images-idx3-ubyte", ip, sizeof ip);
    dt__data_fm_file(d, "train-labels-idx1-ubyte", lp, sizeof lp);
    r = dt_dataset_read_idx(train, ip, lp, 0);
    if (r != DTRAIN_OK) {
      dt_dataset_destroy(*test);
      *test = NULL;
    }
  }
  return r;
#endif
}

#undef DT__DATA_FM_SYSTEM
#undef DT__DATA_FM_SHIPPED
/* ======== end dt_data_idx.c ======== */

/* ======== begin dt_data_npy.c ======== */
/* ===========================================================================
 * dt_data_npy.c -- NumPy .npy arrays: parse, encode, read, write, datasets
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_data_core.h" (amalgamated) */

#ifndef DTRAIN_NO_STDIO
#  include <errno.h>
#endif

/* ---- NPY ---------------------------------------------------------------------------------------------
 *   "\x93NUMPY" major minor HEADER_LEN (u16 LE in 1.0, u32 LE in 2.0/3.0)
 *   header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *           padded with spaces and ended by '\n'; then the data, C order. */

static int dt__data_host_le(void) {
  uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

DTRAIN_API size_t dt_npy_dtype_size(dt_npy_dtype dtype) {
  switch (dtype) {
    case DTRAIN_NPY_F32: return 4;
    case DTRAIN_NPY_U8: return 1;
    case DTRAIN_NPY_I32: return 4;
    case DTRAIN_NPY_I64: return 8;
    default: return 0;
  }
}

static const char *dt__data_npy_descr(dt_npy_dtype t) {
  switch (t) {
    case DTRAIN_NPY_F32: return "<f4";
    case DTRAIN_NPY_U8: return "|u1";
    case DTRAIN_NPY_I32: return "<i4";
    case DTRAIN_NPY_I64: return "<i8";
    default: return "?";
  }
}

typedef struct dt__data_npyp {
  const char *ctx;
  const char *p, *end;
} dt__data_npyp;

static void dt__data_npy_ws(dt__data_npyp *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static int dt__data_npy_eat(dt__data_npyp *s, char ch) {
  dt__data_npy_ws(s);
  if (s->p < s->end && *s->p == ch) {
    s->p++;
    return 1;
  }
  return 0;
}

/* A quoted Python string into buf; 0 if there is none (or it is too long). */
static int dt__data_npy_str(dt__data_npyp *s, char *buf, size_t cap) {
  dt__data_npy_ws(s);
  if (s->p >= s->end || (*s->p != '\'' && *s->p != '"')) return 0;
  char q = *s->p++;
  size_t n = 0;
  while (s->p < s->end && *s->p != q) {
    if (n + 1 >= cap) return 0;
    buf[n++] = *s->p++;
  }
  if (s->p >= s->end) return 0;
  s->p++;
  buf[n] = '\0';
  return 1;
}

static dt_result dt__data_npy_bad(dt__data_npyp *s, const char *what) {
  return dt__error(DTRAIN_ERR_FORMAT, "%s: bad NPY header: %s", s->ctx, what);
}

static dt_result dt__data_npy_header(dt__data_npyp *s, dt_npy *a, int *swap) {
  int have_descr = 0, have_fortran = 0, have_shape = 0;
  if (!dt__data_npy_eat(s, '{')) return dt__data_npy_bad(s, "expected '{'");
  for (;;) {
    if (dt__data_npy_eat(s, '}')) break;
    char key[32], val[32];
    if (!dt__data_npy_str(s, key, sizeof key)) return dt__data_npy_bad(s, "expected a quoted key");
    if (!dt__data_npy_eat(s, ':')) return dt__data_npy_bad(s, "expected ':' after a key");
    if (!strcmp(key, "descr")) {
      if (!dt__data_npy_str(s, val, sizeof val)) return dt__data_npy_bad(s, "'descr' is not a simple dtype string");
      char bo = val[0];
      const char *ty = val + 1;
      if (bo != '<' && bo != '>' && bo != '|' && bo != '=') return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY dtype '%s' is not supported (float32 '<f4', uint8 '|u1', int32 '<i4', int64 '<i8')", s->ctx, val);
      if (!strcmp(ty, "u1")) a->dtype = DTRAIN_NPY_U8;
      else if (!strcmp(ty, "f4") && bo != '|') a->dtype = DTRAIN_NPY_F32;
      else if (!strcmp(ty, "i4") && bo != '|') a->dtype = DTRAIN_NPY_I32;
      else if (!strcmp(ty, "i8") && bo != '|') a->dtype = DTRAIN_NPY_I64;
      else
        return dt__error(DTRAIN_ERR_FORMAT,
                         "%s: NPY dtype '%s' is not supported (float32 '<f4', uint8 '|u1', int32 '<i4', int64 '<i8')",
                         s->ctx, val);
      int file_le = bo == '<' || (bo == '=' && dt__data_host_le());
      *swap = a->dtype != DTRAIN_NPY_U8 && file_le != dt__data_host_le();
      have_descr = 1;
    } else if (!strcmp(key, "fortran_order")) {
      dt__data_npy_ws(s);
      if ((size_t)(s->end - s->p) >= 5 && !strncmp(s->p, "False", 5)) {
        s->p += 5;
      } else if ((size_t)(s->end - s->p) >= 4 && !strncmp(s->p, "True", 4)) {
        return dt__error(DTRAIN_ERR_FORMAT,
                         "%s: NPY array is in Fortran order, which is not supported (save np.ascontiguousarray(a))",
                         s->ctx);
      } else {
        return dt__data_npy_bad(s, "'fortran_order' is not True or False");
      }
      have_fortran = 1;
    } else if (!strcmp(key, "shape")) {
      if (!dt__data_npy_eat(s, '(')) return dt__data_npy_bad(s, "'shape' is not a tuple");
      a->ndim = 0;
      for (;;) {
        if (dt__data_npy_eat(s, ')')) break;
        dt__data_npy_ws(s);
        if (s->p >= s->end || *s->p < '0' || *s->p > '9') return dt__data_npy_bad(s, "'shape' holds something other than integers");
        uint64_t v = 0;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
          v = v * 10 + (uint64_t)(*s->p - '0');
          if (v > (uint64_t)INT64_MAX / 16) return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY shape has an absurd dimension", s->ctx);
          s->p++;
        }
        if (a->ndim == DTRAIN_MAX_DIMS)
          return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY array has more than %d dimensions", s->ctx, DTRAIN_MAX_DIMS);
        a->shape[a->ndim++] = (int64_t)v;
        if (!dt__data_npy_eat(s, ',')) {
          if (!dt__data_npy_eat(s, ')')) return dt__data_npy_bad(s, "'shape' tuple is not closed");
          break;
        }
      }
      have_shape = 1;
    } else {
      char msg[96];
      snprintf(msg, sizeof msg, "unexpected key '%s'", key);
      return dt__data_npy_bad(s, msg);
    }
    if (!dt__data_npy_eat(s, ',')) {
      if (!dt__data_npy_eat(s, '}')) return dt__data_npy_bad(s, "expected ',' or '}'");
      break;
    }
  }
  if (!have_descr || !have_fortran || !have_shape)
    return dt__data_npy_bad(s, !have_descr ? "no 'descr'" : !have_fortran ? "no 'fortran_order'" : "no 'shape'");
  return DTRAIN_OK;
}

static void dt__data_swap(unsigned char *p, size_t n, size_t w) {
  for (size_t i = 0; i < n; i++, p += w)
    for (size_t k = 0; k < w / 2; k++) {
      unsigned char t = p[k];
      p[k] = p[w - 1 - k];
      p[w - 1 - k] = t;
    }
}

static dt_result dt__data_npy_parse(const char *ctx, const unsigned char *p, size_t len, dt_npy *out) {
  memset(out, 0, sizeof *out);
  if (len < 10 || memcmp(p, "\x93NUMPY", 6) != 0) {
    if (len >= 6 && memcmp(p, "\x93NUMPY", 6) == 0)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file (%zu bytes)", ctx, len);
    return dt__error(DTRAIN_ERR_FORMAT, "%s: not an NPY file (no \\x93NUMPY magic)", ctx);
  }
  unsigned major = p[6], minor = p[7];
  size_t hlen, hstart;
  if (major == 1) {
    hlen = dt__get_le16(p + 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (len < 12) return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file (%zu bytes)", ctx, len);
    hlen = dt__get_le32(p + 8);
    hstart = 12;
  } else {
    return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY format version %u.%u is not supported (1.0, 2.0, 3.0)", ctx, major, minor);
  }
  if (minor != 0)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: NPY format version %u.%u is not supported (1.0, 2.0, 3.0)", ctx, major, minor);
  if (hlen > len - hstart)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: truncated NPY file: header of %zu bytes, only %zu follow", ctx, hlen,
                     len - hstart);
  dt__data_npyp s;
  s.ctx = ctx;
  s.p = (const char *)p + hstart;
  s.end = s.p + hlen;
  int swap = 0;
  dt_npy a;
  memset(&a, 0, sizeof a);
  dt_result r = dt__data_npy_header(&s, &a, &swap);
  if (r != DTRAIN_OK) return r;
  /* Sizes in 64 bits: a shape such as [2^32,...] must not wrap a 32-bit size_t. */
  uint64_t w = dt_npy_dtype_size(a.dtype), count = 1, bytes64 = 0;
  int overflow = 0;
  for (int d = 0; d < a.ndim; d++) {
    uint64_t dim = (uint64_t)a.shape[d];
    if (dim != 0 && count > UINT64_MAX / dim) overflow = 1;
    else count *= dim;
  }
  if (!overflow && w != 0 && count > UINT64_MAX / w) overflow = 1;
  else bytes64 = count * w;
  size_t avail = len - hstart - hlen;
  char sh[160];
  dt__shape_text(a.ndim, a.shape, sh, sizeof sh);
  if (overflow || bytes64 > (uint64_t)avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY header claims shape %s of '%s' but only %zu data bytes follow", ctx, sh,
                     dt__data_npy_descr(a.dtype), avail);
  size_t bytes = (size_t)bytes64; /* <= avail: fits */
  if (bytes < avail)
    return dt__error(DTRAIN_ERR_CORRUPT, "%s: NPY file has %zu bytes after the data of shape %s", ctx, avail - bytes, sh);
  for (int d = a.ndim; d < DTRAIN_MAX_DIMS; d++) a.shape[d] = 1;
  a.size = (int64_t)count;
  a.bytes_ = bytes;
  a.data = dt__alloc(bytes);
  if (!a.data) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, bytes);
  if (bytes) memcpy(a.data, p + hstart + hlen, bytes);
  if (swap) dt__data_swap((unsigned char *)a.data, (size_t)count, (size_t)w);
  *out = a;
  return DTRAIN_OK;
}

DTRAIN_API void dt_npy_free(dt_npy *a) {
  if (!a) return;
  dt__free(a->data, a->bytes_);
  memset(a, 0, sizeof *a);
}

DTRAIN_API dt_result dt_npy_parse(const void *buf, size_t len, dt_npy *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_parse: buf is NULL");
  return dt__data_npy_parse("dt_npy_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_npy_read(const char *path, dt_npy *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_npy_read", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_npy_read: '%s'", path);
  r = dt__data_npy_parse(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

/* Header text for an array, padded so that the data starts at a multiple
 * of 64 bytes (as NumPy writes it). Returns its length (0 if too long). */
static size_t dt__data_npy_make_header(char *h, size_t cap, dt_npy_dtype dtype, int ndim, const int64_t *shape) {
  char sh[200];
  size_t n = 0;
  sh[n++] = '(';
  for (int d = 0; d < ndim; d++)
    n += (size_t)snprintf(sh + n, sizeof sh - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (ndim == 1) sh[n++] = ',';
  sh[n++] = ')';
  sh[n] = '\0';
  int k = snprintf(h, cap, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", dt__data_npy_descr(dtype), sh);
  if (k < 0 || (size_t)k >= cap) return 0;
  size_t len = (size_t)k, total = 10 + len + 1;
  size_t pad = (64 - total % 64) % 64;
  if (len + pad + 1 >= cap) return 0;
  memset(h + len, ' ', pad);
  h[len + pad] = '\n';
  return len + pad + 1;
}

static dt_result dt__data_npy_check(const char *who, dt_npy_dtype dtype, int ndim, const int64_t *shape, const void *data,
                                    size_t *count) {
  if (dt_npy_dtype_size(dtype) == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown dtype %d", who, (int)dtype);
  if (ndim < 0 || ndim > DTRAIN_MAX_DIMS)
    return dt__error(DTRAIN_ERR_RANK, "%s: ndim %d is not in 0..%d", who, ndim, DTRAIN_MAX_DIMS);
  if (ndim > 0 && !shape) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: shape is NULL", who);
  size_t c = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) return dt__error(DTRAIN_ERR_SHAPE, "%s: dim %d is negative (%lld)", who, d, (long long)shape[d]);
    if ((uint64_t)shape[d] > SIZE_MAX || !dt__mul_size(c, (size_t)shape[d], &c))
      return dt__error(DTRAIN_ERR_OVERFLOW, "%s: array size overflows", who);
  }
  if (c > 0 && !data) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: data is NULL", who);
  if (!dt__mul_size(c, dt_npy_dtype_size(dtype), count) || *count > SIZE_MAX - 512)
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: array size overflows", who);
  *count = c;
  return DTRAIN_OK;
}

static dt_result dt__data_npy_encode(const char *who, unsigned char *buf, size_t cap, size_t *len, dt_npy_dtype dtype,
                                     int ndim, const int64_t *shape, const void *data) {
  size_t count = 0;
  dt_result r = dt__data_npy_check(who, dtype, ndim, shape, data, &count);
  if (r != DTRAIN_OK) return r;
  char h[512];
  size_t hl = dt__data_npy_make_header(h, sizeof h, dtype, ndim, shape);
  if (hl == 0) return dt__error(DTRAIN_ERR_INTERNAL, "%s: NPY header does not fit", who);
  size_t w = dt_npy_dtype_size(dtype), bytes = count * w, total = 10 + hl + bytes;
  if (len) *len = total;
  if (!buf) return DTRAIN_OK;
  if (cap < total)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: buffer of %zu bytes is too small (%zu needed)", who, cap, total);
  memcpy(buf, "\x93NUMPY\x01\x00", 8);
  dt__put_le16(buf + 8, (uint16_t)hl);
  memcpy(buf + 10, h, hl);
  if (bytes) memcpy(buf + 10 + hl, data, bytes);
  if (w > 1 && !dt__data_host_le()) dt__data_swap(buf + 10 + hl, count, w);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_npy_encode(void *buf, size_t cap, size_t *len, dt_npy_dtype dtype, int ndim, const int64_t *shape,
                                   const void *data) {
  return dt__data_npy_encode("dt_npy_encode", (unsigned char *)buf, cap, len, dtype, ndim, shape, data);
}

DTRAIN_API dt_result dt_npy_write(const char *path, dt_npy_dtype dtype, int ndim, const int64_t *shape, const void *data) {
  if (!path) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_npy_write: path is NULL");
#ifdef DTRAIN_NO_STDIO
  (void)dtype; (void)ndim; (void)shape; (void)data;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "dt_npy_write: file I/O is not available in this build (DTRAIN_NO_STDIO); use dt_npy_encode");
#else
  size_t total = 0;
  dt_result r = dt__data_npy_encode("dt_npy_write", NULL, 0, &total, dtype, ndim, shape, data);
  if (r != DTRAIN_OK) return r;
  unsigned char *buf = (unsigned char *)dt__alloc(total);
  if (!buf) return dt__error(DTRAIN_ERR_NOMEM, "dt_npy_write: out of memory (%zu bytes)", total);
  r = dt__data_npy_encode("dt_npy_write", buf, total, &total, dtype, ndim, shape, data);
  if (r == DTRAIN_OK) {
    FILE *f = fopen(path, "wb");
    if (!f) {
      r = dt__error(DTRAIN_ERR_IO, "dt_npy_write: cannot create '%s': %s", path, strerror(errno));
    } else {
      errno = 0;
      size_t put = fwrite(buf, 1, total, f);
      int e = errno;
      int bad = put != total || fflush(f) != 0;
      if (fclose(f) != 0) bad = 1;
      if (bad) {
        remove(path);
        r = dt__error(DTRAIN_ERR_IO, "dt_npy_write: cannot write '%s': %s", path, e ? strerror(e) : "write error");
      }
    }
  }
  dt__free(buf, total);
  return r;
#endif
}

DTRAIN_API dt_result dt_dataset_from_npy(dt_dataset **out, const dt_npy *x, const dt_npy *y, unsigned flags) {
  const char *who = "dt_dataset_from_npy";
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: out is NULL", who);
  *out = NULL;
  if (!x || !x->data) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: x is NULL or empty", who);
  if (x->ndim < 1) return dt__error(DTRAIN_ERR_RANK, "%s: x is a scalar; it needs a leading sample dimension", who);
  int64_t one = 1;
  int snd = x->ndim == 1 ? 1 : x->ndim - 1;
  const int64_t *ssh = x->ndim == 1 ? &one : x->shape + 1;
  if (y) {
    if (!y->data || y->ndim != 1 || y->shape[0] != x->shape[0]) {
      char a[160], b[160];
      return dt__error(DTRAIN_ERR_MISMATCH, "%s: labels of shape %s do not match samples of shape %s (need [%lld])", who,
                       dt__shape_text(y->ndim, y->shape, a, sizeof a),
                       dt__shape_text(x->ndim, x->shape, b, sizeof b), (long long)x->shape[0]);
    }
    if (y->dtype == DTRAIN_NPY_F32) return dt__error(DTRAIN_ERR_FORMAT, "%s: labels must be integers, not float32", who);
  }
  dt_dataset *ds;
  dt_result r = dt__data_ds_new(who, &ds, x->shape[0], snd, ssh, y != NULL);
  if (r != DTRAIN_OK) return r;
  size_t total = (size_t)x->size;
  float scale = (flags & DTRAIN_DATA_RAW) ? 1.0f : 1.0f / 255.0f;
  for (size_t i = 0; i < total; i++) {
    switch (x->dtype) {
      case DTRAIN_NPY_F32: ds->x[i] = ((const float *)x->data)[i]; break;
      case DTRAIN_NPY_U8: ds->x[i] = (float)((const unsigned char *)x->data)[i] * scale; break;
      case DTRAIN_NPY_I32: ds->x[i] = (float)((const int32_t *)x->data)[i]; break;
      default: ds->x[i] = (float)((const int64_t *)x->data)[i]; break;
    }
  }
  if (y) {
    for (int64_t i = 0; i < ds->n; i++) {
      int64_t v = y->dtype == DTRAIN_NPY_U8    ? ((const unsigned char *)y->data)[i]
                  : y->dtype == DTRAIN_NPY_I32 ? ((const int32_t *)y->data)[i]
                                               : ((const int64_t *)y->data)[i];
      if (v < 0 || v > INT32_MAX) {
        dt_dataset_destroy(ds);
        return dt__error(DTRAIN_ERR_INDEX, "%s: label %lld of sample %lld is out of range [0, %d]", who, (long long)v,
                         (long long)i, INT32_MAX);
      }
      ds->y[i] = (int32_t)v;
    }
    dt__data_set_classes(who, ds);
  }
  *out = ds;
  return DTRAIN_OK;
}
/* ======== end dt_data_npy.c ======== */

/* ======== begin dt_data_text.c ======== */
/* ===========================================================================
 * dt_data_text.c -- text formats: CSV tables and character corpora
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_data_core.h" (amalgamated) */

/* ---- CSV ------------------------------------------------------------------------------------------ */

typedef struct dt__data_csv {
  const char *ctx;
  const char *p, *end, *next;
  char delim;
  int header, has_labels;
  int64_t label_col; /* resolved once the column count is known */
  int64_t rows, cols;
} dt__data_csv;

/* One pass over the text. With ds NULL it validates and counts rows and
 * columns; with ds it stores the values (the first pass succeeded, so every
 * row has c->cols fields). */
static dt_result dt__data_csv_pass(dt__data_csv *c, dt_dataset *ds) {
  const char *p = c->p;
  int64_t line = 0, row = 0, first_line = 0;
  int skipped_header = 0;
  if (c->end - p >= 3 && (unsigned char)p[0] == 0xEF && (unsigned char)p[1] == 0xBB && (unsigned char)p[2] == 0xBF)
    p += 3; /* UTF-8 byte order mark */
  for (; p < c->end; p = c->next) {
    const char *eol = (const char *)memchr(p, '\n', (size_t)(c->end - p));
    const char *le = eol ? eol : c->end;
    c->next = eol ? eol + 1 : c->end;
    line++;
    if (le > p && le[-1] == '\r') le--;
    const char *q = p;
    while (q < le && (*q == ' ' || *q == '\t')) q++;
    if (q == le) continue; /* blank line */
    if (c->header && !skipped_header) {
      skipped_header = 1;
      continue;
    }
    /* Same number of fields as the first row? */
    int64_t nfields = 1;
    for (q = p; q < le; q++) nfields += *q == c->delim;
    if (row == 0 && !ds) {
      c->cols = nfields;
      first_line = line;
    } else if (nfields != c->cols) {
      return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld has %lld fields, expected %lld (as on line %lld)", c->ctx,
                       (long long)line, (long long)nfields, (long long)c->cols, (long long)first_line);
    }
    const char *hint = (row == 0 && !c->header) ? " (is it a header? set dt_csv_desc.header)" : "";
    const char *f = p;
    for (int64_t col = 0; col < nfields; col++) {
      const char *fe = f;
      while (fe < le && *fe != c->delim) fe++;
      const char *a = f, *b = fe;
      f = fe + 1;
      while (a < b && (*a == ' ' || *a == '\t')) a++;
      while (b > a && (b[-1] == ' ' || b[-1] == '\t')) b--;
      char buf[72];
      size_t flen = (size_t)(b - a);
      if (flen == 0)
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: empty field%s", c->ctx, (long long)line,
                         (long long)col + 1, hint);
      if (flen >= sizeof buf)
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: a field of %zu characters is not a number",
                         c->ctx, (long long)line, (long long)col + 1, flen);
      memcpy(buf, a, flen);
      buf[flen] = '\0';
      char *stop = NULL;
      double v = strtod(buf, &stop);
      if (stop != buf + flen || !isfinite(v))
        return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: '%s' is not a finite number%s", c->ctx,
                         (long long)line, (long long)col + 1, buf, hint);
      if (!ds) continue;
      if (c->has_labels && col == c->label_col) {
        if (v < 0 || v > (double)INT32_MAX || v != floor(v))
          return dt__error(DTRAIN_ERR_FORMAT, "%s: line %lld, column %lld: label '%s' is not an integer in [0, %d]",
                           c->ctx, (long long)line, (long long)col + 1, buf, INT32_MAX);
        ds->y[row] = (int32_t)v;
      } else {
        int64_t fi = (c->has_labels && col > c->label_col) ? col - 1 : col;
        ds->x[row * ds->sample_size + fi] = (float)v;
      }
    }
    row++;
  }
  c->rows = row;
  return DTRAIN_OK;
}

static dt_result dt__data_csv_parse(const char *ctx, dt_dataset **out, const char *text, size_t len,
                                    const dt_csv_desc *desc) {
  dt__data_csv c;
  dt_csv_desc zero;
  memset(&zero, 0, sizeof zero);
  if (!desc) desc = &zero;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  c.p = text;
  c.end = text + len;
  c.delim = desc->delimiter ? desc->delimiter : ',';
  c.header = desc->header != 0;
  c.has_labels = desc->has_labels != 0;
  if (c.delim == '\n' || c.delim == '\r' || c.delim == ' ' || c.delim == '"' || c.delim == '.' || c.delim == '-' ||
      c.delim == '+' || (c.delim >= '0' && c.delim <= '9'))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: delimiter 0x%02x is not usable", ctx, (unsigned)(unsigned char)c.delim);
  dt_result r = dt__data_csv_pass(&c, NULL);
  if (r != DTRAIN_OK) return r;
  if (c.rows == 0) return dt__error(DTRAIN_ERR_EMPTY, "%s: no data rows", ctx);
  if (c.has_labels) {
    int64_t lc = desc->label_column < 0 ? c.cols + desc->label_column : desc->label_column;
    if (lc < 0 || lc >= c.cols)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: label_column %d is out of range for %lld columns", ctx,
                       desc->label_column, (long long)c.cols);
    if (c.cols < 2) return dt__error(DTRAIN_ERR_FORMAT, "%s: 1 column holds the labels, none is left for features", ctx);
    c.label_col = lc;
  }
  int64_t nf = c.cols - (c.has_labels ? 1 : 0);
  dt_dataset *ds;
  r = dt__data_ds_new(ctx, &ds, c.rows, 1, &nf, c.has_labels);
  if (r != DTRAIN_OK) return r;
  r = dt__data_csv_pass(&c, ds);
  if (r == DTRAIN_OK && c.has_labels) r = dt__data_set_classes(ctx, ds);
  if (r != DTRAIN_OK) {
    dt_dataset_destroy(ds);
    return r;
  }
  *out = ds;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_dataset_parse_csv(dt_dataset **out, const char *text, size_t len, const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_csv: out is NULL");
  *out = NULL;
  if (!text) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_parse_csv: text is NULL");
  return dt__data_csv_parse("dt_dataset_parse_csv", out, text, len, desc);
}

DTRAIN_API dt_result dt_dataset_read_csv(dt_dataset **out, const char *path, const dt_csv_desc *desc) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_dataset_read_csv: out is NULL");
  *out = NULL;
  dt_bytes b;
  dt_result r = dt__data_load("dt_dataset_read_csv", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_dataset_read_csv: '%s'", path);
  r = dt__data_csv_parse(ctx, out, (const char *)b.data, b.size, desc);
  dt_bytes_free(&b);
  return r;
}

/* ---- text corpora -------------------------------------------------------------------------------------- */

DTRAIN_API void dt_text_free(dt_text *t) {
  if (!t) return;
  dt__free(t->ids, t->bytes_);
  memset(t, 0, sizeof *t);
}

static dt_result dt__data_text(const char *ctx, const unsigned char *p, size_t len, dt_text *out) {
  memset(out, 0, sizeof *out);
  if (len == 0) return dt__error(DTRAIN_ERR_EMPTY, "%s: the text is empty", ctx);
  size_t bytes;
  if (len > (size_t)INT64_MAX || !dt__mul_size(len, sizeof(int32_t), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: text of %zu bytes is too long", ctx, len);
  int present[256] = {0};
  for (size_t i = 0; i < len; i++) present[p[i]] = 1;
  for (int b = 0; b < 256; b++) {
    out->id_of[b] = -1;
    if (present[b]) {
      out->id_of[b] = (int16_t)out->vocab_size;
      out->vocab[out->vocab_size++] = (unsigned char)b;
    }
  }
  out->ids = (int32_t *)dt__alloc(bytes);
  if (!out->ids) {
    memset(out, 0, sizeof *out);
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, bytes);
  }
  for (size_t i = 0; i < len; i++) out->ids[i] = out->id_of[p[i]];
  out->n = (int64_t)len;
  out->bytes_ = bytes;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_parse(const void *buf, size_t len, dt_text *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_parse: out is NULL");
  memset(out, 0, sizeof *out);
  if (!buf) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_parse: buf is NULL");
  return dt__data_text("dt_text_parse", (const unsigned char *)buf, len, out);
}

DTRAIN_API dt_result dt_text_read(const char *path, dt_text *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_read: out is NULL");
  memset(out, 0, sizeof *out);
  dt_bytes b;
  dt_result r = dt__data_load("dt_text_read", path, 1, &b);
  if (r != DTRAIN_OK) return r;
  char ctx[DT__DATA_CTX];
  snprintf(ctx, sizeof ctx, "dt_text_read: '%s'", path);
  r = dt__data_text(ctx, b.data, b.size, out);
  dt_bytes_free(&b);
  return r;
}

DTRAIN_API dt_result dt_text_encode(const dt_text *t, const char *s, size_t len, int32_t *ids) {
  if (!t || (!s && len) || (!ids && len))
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_encode: %s is NULL", !t ? "t" : !s ? "s" : "ids");
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (t->id_of[c] < 0)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_encode: byte 0x%02x ('%c') at offset %zu is not in the vocabulary",
                       (unsigned)c, (c >= 32 && c < 127) ? (char)c : '?', i);
    ids[i] = t->id_of[c];
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_decode(const dt_text *t, const int32_t *ids, int64_t n, char *out, size_t cap) {
  if (!t || (!ids && n > 0) || !out)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_decode: %s is NULL", !t ? "t" : !out ? "out" : "ids");
  if (n < 0 || (uint64_t)n >= cap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_decode: %lld ids need %lld bytes, out has %zu", (long long)n,
                     (long long)n + 1, cap);
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= t->vocab_size) {
      out[0] = '\0';
      return dt__error(DTRAIN_ERR_INDEX, "dt_text_decode: id %d at %lld is not in [0, %d)", (int)ids[i], (long long)i,
                       t->vocab_size);
    }
    out[i] = (char)t->vocab[ids[i]];
  }
  out[n] = '\0';
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_text_sample(const dt_text *t, int64_t begin, int64_t end, dt_rng *rng, int64_t batch,
                                    int64_t seq_len, int32_t *x, int32_t *y) {
  if (!t || !rng || !x || !y)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_text_sample: %s is NULL", !t ? "t" : !rng ? "rng" : !x ? "x" : "y");
  if (batch < 1 || seq_len < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_text_sample: batch %lld and seq_len %lld must be >= 1", (long long)batch,
                     (long long)seq_len);
  if (begin < 0 || end > t->n || end - begin <= seq_len)
    return dt__error(DTRAIN_ERR_INDEX, "dt_text_sample: range [%lld, %lld) of a %lld-id text cannot hold a window of %lld + 1",
                     (long long)begin, (long long)end, (long long)t->n, (long long)seq_len);
  uint64_t starts = (uint64_t)(end - begin - seq_len);
  for (int64_t b = 0; b < batch; b++) {
    int64_t s = begin + (int64_t)dt_rng_below(rng, starts);
    memcpy(x + b * seq_len, t->ids + s, (size_t)seq_len * sizeof(int32_t));
    memcpy(y + b * seq_len, t->ids + s + 1, (size_t)seq_len * sizeof(int32_t));
  }
  return DTRAIN_OK;
}
/* ======== end dt_data_text.c ======== */

/* ======== begin dt_memory.c ======== */
/* ===========================================================================
 * dt_memory.c -- dt_memory_stats: bytes of params, gradients, optimizer state
 * and activations
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */

DTRAIN_API dt_result dt_memory_stats(const dt_params *p, const dt_optim *o, const dt_graph *g, dt_memory_info *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_memory_stats: out is NULL");
  memset(out, 0, sizeof *out);
  if (o && !p)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_memory_stats: an optimizer needs its params (p is NULL)");
  if (p) {
    size_t n = dt_params_size(p);
    out->params_bytes = n * sizeof(float);
    out->grads_bytes = n * sizeof(float);
    if (o) out->optim_bytes = (size_t)dt_optim_state_slots(o) * n * sizeof(float);
  }
  if (g) {
    out->activations_bytes = g->peak;
    out->arena_bytes = g->reserved;
    out->tape_bytes = (size_t)g->tape_cap * sizeof(dt_tensor *) + g->pviews_bytes;
  }
  out->total_bytes = out->params_bytes + out->grads_bytes + out->optim_bytes + out->arena_bytes + out->tape_bytes;
  return DTRAIN_OK;
}
/* ======== end dt_memory.c ======== */

/* ======== begin dt_platform.h ======== */
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

/* #include "dt_internal.h" (amalgamated) */

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
DTRAIN_PRIVATE int dt__barrier_broken(dt__barrier *b);
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
/* ======== end dt_platform.h ======== */

/* ======== begin dt_platform.c ======== */
/* ===========================================================================
 * dt_platform.c -- threads, events, the breakable barrier, the thread pool
 * ===========================================================================
 * See dt_platform.h. POSIX threads; without threads (DTRAIN_NO_THREADS) the
 * primitives degrade to what a single thread needs.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

#if !defined(_WIN32)
#  include <errno.h>
#  include <sched.h>
#  include <unistd.h>
#endif

/* ---- time ------------------------------------------------------------------------ */

DTRAIN_PRIVATE double dt__now(void) {
#if defined(CLOCK_MONOTONIC) && !defined(_WIN32)
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#endif
  return dt_time_now();
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
#else
  double end = dt__now() + seconds;
  while (dt__now() < end) dt__cpu_relax();
#endif
}

DTRAIN_PRIVATE int dt__cpu_count(void) {
#if defined(_SC_NPROCESSORS_ONLN)
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
  /* An explicit stack: dt_sgemm keeps its packed panels (~256 KiB) on the
   * stack, more than some libcs give a thread by default (musl: 128 KiB). */
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
#if !defined(DTRAIN_NO_THREADS) && !defined(_WIN32)
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

DTRAIN_PRIVATE int dt__barrier_broken(dt__barrier *b) { return DT__ALOAD(&b->broken, DT__MO_ACQUIRE) != 0; }

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
    p->fn(p->arg, w->index);
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
  if (p->n == 1) {
    fn(arg, 0);
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
/* ======== end dt_platform.c ======== */

/* ======== begin dt_comm.c ======== */
/* ===========================================================================
 * dt_comm.c -- the communicator front end and the in-process threads backend
 * ===========================================================================
 * Threads backend. Each rank owns a 64-byte slot where it publishes the
 * buffer of the collective it is in. A collective is:
 *
 *   publish slot -> barrier -> check that every rank called the same thing
 *   -> work on this rank's slice of every buffer -> barrier
 *
 * The first barrier makes every buffer ready and visible; the second keeps
 * every buffer untouched until nobody reads it any more (the caller may
 * reuse it as soon as the call returns). Between them only the owner of a
 * slice touches that slice of any buffer, so the work needs no atomics. The
 * sums run over a block of the slice at a time, rank 0 first, into a small
 * stack buffer, then go where they belong: the result never depends on which
 * thread came first.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

enum {
  DT__COMM_OP_ALLREDUCE = 1,
  DT__COMM_OP_REDUCE_SCATTER,
  DT__COMM_OP_ALLGATHER,
  DT__COMM_OP_REDUCE,
  DT__COMM_OP_BROADCAST,
  DT__COMM_OP_BARRIER
};

static const char *dt__comm_op_name(int op) {
  switch (op) {
    case DT__COMM_OP_ALLREDUCE: return "allreduce";
    case DT__COMM_OP_REDUCE_SCATTER: return "reduce_scatter";
    case DT__COMM_OP_ALLGATHER: return "allgather";
    case DT__COMM_OP_REDUCE: return "reduce";
    case DT__COMM_OP_BROADCAST: return "broadcast";
    case DT__COMM_OP_BARRIER: return "barrier";
    default: return "?";
  }
}

/* ---- slices -------------------------------------------------------------------------- */

DTRAIN_API void dt_comm_slice(size_t n, int world, int rank, size_t *begin, size_t *end) {
  size_t b = 0, e = 0;
  if (world >= 1 && rank >= 0 && rank < world) {
    size_t chunks = (n + 15) / 16, w = (size_t)world, r = (size_t)rank;
    b = chunks * r / w * 16;
    e = chunks * (r + 1) / w * 16;
    if (b > n) b = n;
    if (e > n) e = n;
  }
  if (begin) *begin = b;
  if (end) *end = e;
}

/* ---- the threads backend ---------------------------------------------------------------- */

typedef struct dt__comm_slot_data {
  float *buf;
  size_t n;
  int op, root;
  dt_comm_stats st;
} dt__comm_slot_data;

typedef union dt__comm_slot {
  dt__comm_slot_data d;
  char align[2 * DT__ALIGN]; /* one slot per cache line pair: no false sharing */
} dt__comm_slot;

typedef struct dt__comm_threads {
  dt_comm comm;
  dt__barrier bar;
  dt__comm_slot *slots;
  size_t slots_bytes;
} dt__comm_threads;

#define DT__COMM_BLOCK 1024

static dt__comm_threads *dt__comm_threads_of(dt_comm *c) { return (dt__comm_threads *)c->impl; }

/* Barrier that accounts the wait to the rank. */
static dt_result dt__comm_threads_meet(dt__comm_threads *t, int rank) {
  double w = 0.0;
  dt_result r = dt__barrier_wait(&t->bar, &w);
  t->slots[rank].d.st.wait_s += w;
  return r;
}

/* Publish, meet, check agreement. On success the caller does its work and
 * then dt__comm_threads_leave(). */
static dt_result dt__comm_threads_enter(dt__comm_threads *t, int rank, int op, float *buf, size_t n, int root) {
  dt__comm_slot_data *me = &t->slots[rank].d;
  me->buf = buf;
  me->n = n;
  me->op = op;
  me->root = root;
  /* An aborted collective returns DTRAIN_ERR_ABORTED without a message or a
   * log line: the rank that aborted reports the cause. */
  dt_result r = dt__comm_threads_meet(t, rank);
  if (r != DTRAIN_OK) return r;
  int world = t->comm.world;
  for (int j = 0; j < world; j++) {
    const dt__comm_slot_data *o = &t->slots[j].d;
    if (o->op != op || o->n != n || o->root != root) {
      /* Every rank sees the same slots, so every rank takes this branch;
       * leave together so that nobody rewrites its slot while it is read. */
      int bad_op = o->op;
      size_t bad_n = o->n;
      int bad_root = o->root;
      dt__comm_threads_meet(t, rank);
      if (bad_op != op)
        return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d: rank %d called %s instead", dt__comm_op_name(op),
                         rank, j, dt__comm_op_name(bad_op));
      if (bad_n != n)
        return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d passed n=%zu but rank %d passed n=%zu",
                         dt__comm_op_name(op), rank, n, j, bad_n);
      return dt__error(DTRAIN_ERR_MISMATCH, "dt_comm_%s: rank %d passed root %d but rank %d passed root %d",
                       dt__comm_op_name(op), rank, root, j, bad_root);
    }
  }
  return DTRAIN_OK;
}

static dt_result dt__comm_threads_leave(dt__comm_threads *t, int rank, size_t n) {
  dt_result r = dt__comm_threads_meet(t, rank);
  if (r != DTRAIN_OK) return r;
  t->slots[rank].d.st.calls++;
  t->slots[rank].d.st.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

/* acc[0..m) = sum over ranks of buf_r[off..off+m), in rank order. */
static void dt__comm_threads_sum(dt__comm_threads *t, size_t off, size_t m, float *acc) {
  int world = t->comm.world;
  const float *a = t->slots[0].d.buf + off;
  if (world == 1) {
    memcpy(acc, a, m * sizeof(float));
    return;
  }
  const float *b = t->slots[1].d.buf + off;
  for (size_t i = 0; i < m; i++) acc[i] = a[i] + b[i];
  for (int r = 2; r < world; r++) {
    const float *c = t->slots[r].d.buf + off;
    for (size_t i = 0; i < m; i++) acc[i] += c[i];
  }
}

static dt_result dt__comm_threads_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_ALLREDUCE, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    for (int j = 0; j < c->world; j++) memcpy(t->slots[j].d.buf + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_REDUCE_SCATTER, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    memcpy(buf + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_ALLGATHER, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  for (int j = 0; j < c->world; j++) {
    if (j == rank) continue;
    size_t b, e;
    dt_comm_slice(n, c->world, j, &b, &e);
    if (e > b) memcpy(buf + b, t->slots[j].d.buf + b, (e - b) * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_REDUCE, buf, n, root);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  dt_comm_slice(n, c->world, rank, &b, &e);
  float acc[DT__COMM_BLOCK];
  float *out = t->slots[root].d.buf;
  for (size_t off = b; c->world > 1 && off < e; off += DT__COMM_BLOCK) {
    size_t m = DT__MIN((size_t)DT__COMM_BLOCK, e - off);
    dt__comm_threads_sum(t, off, m, acc);
    memcpy(out + off, acc, m * sizeof(float));
  }
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_BROADCAST, buf, n, root);
  if (r != DTRAIN_OK) return r;
  const float *src = t->slots[root].d.buf;
  if (rank != root && n > 0 && src != buf) memcpy(buf, src, n * sizeof(float));
  return dt__comm_threads_leave(t, rank, n);
}

static dt_result dt__comm_threads_barrier(dt_comm *c, int rank) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  /* Two meetings like every collective, so that a rank calling barrier while
   * another calls something else is caught (MISMATCH) instead of pairing
   * meetings of different calls. */
  dt_result r = dt__comm_threads_enter(t, rank, DT__COMM_OP_BARRIER, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  return dt__comm_threads_leave(t, rank, 0);
}

static void dt__comm_threads_abort(dt_comm *c, int rank) {
  (void)rank;
  dt__barrier_break(&dt__comm_threads_of(c)->bar);
}

static dt_result dt__comm_threads_recover(dt_comm *c) {
  dt__barrier_reset(&dt__comm_threads_of(c)->bar);
  return DTRAIN_OK;
}

static void dt__comm_threads_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  *out = dt__comm_threads_of(c)->slots[rank].d.st;
}

static void dt__comm_threads_reset_stats(dt_comm *c) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  for (int j = 0; j < c->world; j++) memset(&t->slots[j].d.st, 0, sizeof(dt_comm_stats));
}

static void dt__comm_threads_destroy(dt_comm *c) {
  dt__comm_threads *t = dt__comm_threads_of(c);
  dt__barrier_destroy(&t->bar);
  dt__free(t->slots, t->slots_bytes);
  dt__free(t, sizeof *t);
}

static const dt_comm_vtable dt__comm_threads_vtable = {
  "threads",
  dt__comm_threads_allreduce,
  dt__comm_threads_reduce_scatter,
  dt__comm_threads_allgather,
  dt__comm_threads_reduce,
  dt__comm_threads_broadcast,
  dt__comm_threads_barrier,
  dt__comm_threads_abort,
  dt__comm_threads_recover,
  dt__comm_threads_stats,
  dt__comm_threads_reset_stats,
  dt__comm_threads_destroy
};

DTRAIN_API dt_comm *dt_comm_create_threads(int world, int spin_us) {
  if (world < 1 || world > 256) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_comm_create_threads: world %d outside [1, 256]", world);
    return NULL;
  }
#if defined(DTRAIN_NO_THREADS)
  if (world > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_create_threads: world %d needs threads (built with DTRAIN_NO_THREADS)",
              world);
    return NULL;
  }
#endif
  dt__comm_threads *t = (dt__comm_threads *)dt__calloc(sizeof *t);
  if (!t) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_threads: out of memory");
    return NULL;
  }
  t->slots_bytes = (size_t)world * sizeof(dt__comm_slot);
  t->slots = (dt__comm_slot *)dt__calloc(t->slots_bytes);
  if (!t->slots) {
    dt__free(t, sizeof *t);
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_threads: out of memory");
    return NULL;
  }
  if (dt__barrier_init(&t->bar, world, dt__spin_seconds(spin_us, world)) != DTRAIN_OK) {
    dt__free(t->slots, t->slots_bytes);
    dt__free(t, sizeof *t);
    return NULL;
  }
  t->comm.vtable = &dt__comm_threads_vtable;
  t->comm.world = world;
  t->comm.impl = t;
  return &t->comm;
}

/* ---- front end ------------------------------------------------------------------------------ */

static dt_result dt__comm_check(dt_comm *c, const char *fn, int rank, const float *buf, size_t n, int root) {
  if (!c || !c->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: communicator is NULL", fn);
  if (rank < 0 || rank >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d outside [0, %d)", fn, rank, c->world);
  if (root < 0 || root >= c->world)
    return dt__error(DTRAIN_ERR_INDEX, "%s: rank %d: root %d outside [0, %d)", fn, rank, root, c->world);
  if (!buf && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: rank %d: buffer is NULL (n=%zu)", fn, rank, n);
  return DTRAIN_OK;
}

DTRAIN_API void dt_comm_destroy(dt_comm *c) {
  dt__quiet_push(); /* goodbyes to peers that are gone are not news */
  if (c && c->vtable && c->vtable->destroy) c->vtable->destroy(c);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API dt_result dt_comm_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_allreduce", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->allreduce(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce_scatter", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->reduce_scatter(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt_result r = dt__comm_check(c, "dt_comm_allgather", rank, buf, n, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->allgather(c, rank, buf, n));
}

DTRAIN_API dt_result dt_comm_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_reduce", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->reduce(c, rank, buf, n, root));
}

DTRAIN_API dt_result dt_comm_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt_result r = dt__comm_check(c, "dt_comm_broadcast", rank, buf, n, root);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->broadcast(c, rank, buf, n, root));
}

DTRAIN_API dt_result dt_comm_barrier(dt_comm *c, int rank) {
  dt_result r = dt__comm_check(c, "dt_comm_barrier", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(c->vtable->barrier(c, rank));
}

DTRAIN_API void dt_comm_abort(dt_comm *c, int rank) {
  if (c && c->vtable && c->vtable->abort) c->vtable->abort(c, rank);
}

DTRAIN_API dt_result dt_comm_recover(dt_comm *c) {
  if (!c || !c->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_recover: communicator is NULL");
  return c->vtable->recover ? c->vtable->recover(c) : DTRAIN_OK;
}

DTRAIN_API int dt_comm_world(const dt_comm *c) { return c ? c->world : 0; }
DTRAIN_API int dt_comm_rank(const dt_comm *c) { return c ? c->rank : 0; }

DTRAIN_API const char *dt_comm_name(const dt_comm *c) {
  return (c && c->vtable && c->vtable->name) ? c->vtable->name : "none";
}

DTRAIN_API dt_result dt_comm_stats_get(dt_comm *c, int rank, dt_comm_stats *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_stats_get: out is NULL");
  memset(out, 0, sizeof *out);
  dt_result r = dt__comm_check(c, "dt_comm_stats_get", rank, NULL, 0, 0);
  if (r != DTRAIN_OK) return r;
  if (c->vtable->stats) c->vtable->stats(c, rank, out);
  return DTRAIN_OK;
}

DTRAIN_API void dt_comm_reset_stats(dt_comm *c) {
  if (c && c->vtable && c->vtable->reset_stats) c->vtable->reset_stats(c);
}

#undef DT__COMM_BLOCK
/* ======== end dt_comm.c ======== */

/* ======== begin dt_strategy.c ======== */
/* ===========================================================================
 * dt_strategy.c -- one_device, mirrored, central_storage, async; the
 * in-process lock-free parameter store
 * ===========================================================================
 * A synchronous step (dt__strategy_sync_job, run by every replica's thread):
 *
 *   shard r of the batch -> zero own gradient -> step fn + backward (the
 *   loss gradient weighted by the shard's share) -> [mirrored]
 *   reduce-scatter of the gradients: replica r owns slice r of the sum ->
 *   [central] reduce into the centre's gradient, replica r summing slice r ->
 *   (clip: partial norms, a barrier, the total in rank order) -> (numerics
 *   check, a barrier, so that a bad gradient stops every replica before any
 *   update) -> dt_optim_update on slice r (one optimizer, disjoint ranges:
 *   its state is sharded by slice) -> [mirrored] each replica copies
 *   replica 0's buffers (batch-norm statistics) within its slice, then the
 *   all-gather of the parameters.
 *
 * The caller advances the optimizer once per step after the pool joins.
 * one_device is the same code with one replica and no threads, so mirrored(1)
 * equals it bitwise.
 *
 * An async replica (dt__strategy_async_job) loops: take a ticket, get a
 * batch, pull from the store, forward/backward on its own copy, its own
 * optimizer step, push the difference. See dt_strategy.h for the rules.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

/* ---- the in-process parameter store --------------------------------------------------- */

#define DT__PSTORE_DONE ((int64_t)1 << 60) /* the clock of a worker that left */

typedef union dt__pstore_clock {
  struct {
    DT__ATOMIC(int64_t) pulled; /* pulls made (steps started) */
    DT__ATOMIC(int64_t) pushed; /* pushes made (steps finished) */
  } c;
  char align[2 * DT__ALIGN];
} dt__pstore_clock;

typedef struct dt__pstore_local {
  dt_pstore ps;
  float *data;
  dt_async_update update;
  double spin_s;
  DT__ATOMIC(uint64_t) version;
  uint64_t base;           /* version at dt_pstore_begin (lock-step turns count from it) */
  DT__ATOMIC(int) aborted;
  dt__pstore_clock *clocks;
  dt__event ev;
} dt__pstore_local;

static dt__pstore_local *dt__pstore_of(dt_pstore *ps) { return (dt__pstore_local *)ps->impl; }

static int64_t dt__pstore_min(dt__pstore_local *l, int pushed) {
  int64_t m = DT__PSTORE_DONE;
  for (int j = 0; j < l->ps.workers; j++) {
    int64_t v = pushed ? DT__ALOAD(&l->clocks[j].c.pushed, DT__MO_SEQ_CST)
                       : DT__ALOAD(&l->clocks[j].c.pulled, DT__MO_SEQ_CST);
    if (v < m) m = v;
  }
  return m;
}

typedef struct dt__pstore_wait {
  dt__pstore_local *l;
  int kind;         /* 0: pull rule, 1: push rule, 2: lock-step turn */
  int64_t need;     /* pull: min pushed >= need; push: min pulled >= need */
  uint64_t turn;    /* lock-step: version == turn */
} dt__pstore_wait;

static int dt__pstore_ready(void *arg) {
  dt__pstore_wait *w = (dt__pstore_wait *)arg;
  if (DT__ALOAD(&w->l->aborted, DT__MO_SEQ_CST)) return 1;
  switch (w->kind) {
    case 0: return dt__pstore_min(w->l, 1) >= w->need;
    case 1: return dt__pstore_min(w->l, 0) >= w->need;
    default: return DT__ALOAD(&w->l->version, DT__MO_SEQ_CST) == w->turn;
  }
}

static double dt__pstore_wait_for(dt__pstore_local *l, int kind, int64_t need, uint64_t turn) {
  dt__pstore_wait w;
  w.l = l;
  w.kind = kind;
  w.need = need;
  w.turn = turn;
  return dt__event_wait(&l->ev, dt__pstore_ready, &w, l->spin_s);
}

static dt_result dt__pstore_local_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                       dt_pstore_ticket *tk) {
  dt__pstore_local *l = dt__pstore_of(ps);
  int k = ps->max_staleness;
  tk->wait_s = 0.0;
  if (k >= 0) tk->wait_s = dt__pstore_wait_for(l, 0, clock - k, 0);
  if (DT__ALOAD(&l->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  int64_t slowest = dt__pstore_min(l, 1);
  tk->clock_gap = slowest >= DT__PSTORE_DONE ? 0 : DT__MAX(clock - slowest, (int64_t)0);
  /* Acquire: every update counted in the version is visible to the loads. */
  tk->version = DT__ALOAD(&l->version, DT__MO_ACQUIRE);
  dt__afloat *src = (dt__afloat *)l->data;
  for (size_t i = 0; i < n; i++) dst[i] = dt__afloat_load(src + i);
  DT__ASTORE(&l->clocks[worker].c.pulled, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
  return DTRAIN_OK;
}

static dt_result dt__pstore_local_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                       dt_pstore_ticket *tk) {
  dt__pstore_local *l = dt__pstore_of(ps);
  int k = ps->max_staleness;
  tk->wait_s = 0.0;
  if (k >= 0) tk->wait_s = dt__pstore_wait_for(l, 1, clock - k + 1, 0);
  /* Lock-step: the pushes of a round go in worker order (deterministic sums). */
  if (k == 0)
    tk->wait_s += dt__pstore_wait_for(l, 2, 0, l->base + (uint64_t)clock * (uint64_t)ps->workers + (uint64_t)worker);
  if (DT__ALOAD(&l->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  dt__afloat *dst = (dt__afloat *)l->data;
  if (delta) {
    if (l->update == DTRAIN_ASYNC_ATOMIC) {
      for (size_t i = 0; i < n; i++)
        if (delta[i] != 0.0f) dt__afloat_add(dst + i, delta[i]);
    } else {
      for (size_t i = 0; i < n; i++)
        if (delta[i] != 0.0f) dt__afloat_store(dst + i, dt__afloat_load(dst + i) + delta[i]);
    }
  }
  /* Release: a puller that sees this version sees these stores. */
  uint64_t before = DT__AFETCH_ADD(&l->version, (uint64_t)1, DT__MO_SEQ_CST);
  tk->staleness = (int64_t)(before - tk->version);
  DT__ASTORE(&l->clocks[worker].c.pushed, clock + 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
  return DTRAIN_OK;
}

static void dt__pstore_local_leave(dt_pstore *ps, int worker) {
  dt__pstore_local *l = dt__pstore_of(ps);
  DT__ASTORE(&l->clocks[worker].c.pulled, DT__PSTORE_DONE, DT__MO_SEQ_CST);
  DT__ASTORE(&l->clocks[worker].c.pushed, DT__PSTORE_DONE, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
}

static void dt__pstore_local_abort(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  DT__ASTORE(&l->aborted, 1, DT__MO_SEQ_CST);
  dt__event_notify(&l->ev);
}

static dt_result dt__pstore_local_begin(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  for (int j = 0; j < ps->workers; j++) {
    DT__ASTORE(&l->clocks[j].c.pulled, (int64_t)0, DT__MO_RELAXED);
    DT__ASTORE(&l->clocks[j].c.pushed, (int64_t)0, DT__MO_RELAXED);
  }
  l->base = DT__ALOAD(&l->version, DT__MO_RELAXED);
  DT__ASTORE(&l->aborted, 0, DT__MO_SEQ_CST);
  return DTRAIN_OK;
}

static uint64_t dt__pstore_local_version(dt_pstore *ps) {
  return DT__ALOAD(&dt__pstore_of(ps)->version, DT__MO_ACQUIRE);
}

static void dt__pstore_local_destroy(dt_pstore *ps) {
  dt__pstore_local *l = dt__pstore_of(ps);
  dt__event_destroy(&l->ev);
  dt__free(l->clocks, (size_t)ps->workers * sizeof(dt__pstore_clock));
  dt__free(l, sizeof *l);
}

static const dt_pstore_vtable dt__pstore_local_vtable = {
  "local",
  dt__pstore_local_pull,
  dt__pstore_local_push,
  dt__pstore_local_leave,
  dt__pstore_local_abort,
  dt__pstore_local_begin,
  dt__pstore_local_version,
  dt__pstore_local_destroy
};

DTRAIN_API dt_pstore *dt_pstore_create_local(float *data, size_t n, int workers, int max_staleness,
                                             dt_async_update update, int spin_us) {
  const char *fn = "dt_pstore_create_local";
  if (!data && n > 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: data is NULL", fn);
    return NULL;
  }
  if (workers < 1 || workers > DTRAIN_MAX_REPLICAS) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: workers %d outside [1, %d]", fn, workers, DTRAIN_MAX_REPLICAS);
    return NULL;
  }
  if (max_staleness < DTRAIN_STALENESS_UNBOUNDED) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
              max_staleness);
    return NULL;
  }
  if (update != DTRAIN_ASYNC_HOGWILD && update != DTRAIN_ASYNC_ATOMIC) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown update rule %d", fn, (int)update);
    return NULL;
  }
#if defined(DTRAIN_NO_THREADS)
  if (workers > 1) {
    dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %d workers need threads (built with DTRAIN_NO_THREADS)", fn, workers);
    return NULL;
  }
#endif
  dt__pstore_local *l = (dt__pstore_local *)dt__calloc(sizeof *l);
  if (!l) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  l->clocks = (dt__pstore_clock *)dt__calloc((size_t)workers * sizeof(dt__pstore_clock));
  if (!l->clocks || dt__event_init(&l->ev) != DTRAIN_OK) {
    if (l->clocks) dt__free(l->clocks, (size_t)workers * sizeof(dt__pstore_clock));
    dt__free(l, sizeof *l);
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  l->data = data;
  l->update = update;
  l->spin_s = dt__spin_seconds(spin_us, workers);
  l->ps.vtable = &dt__pstore_local_vtable;
  l->ps.workers = workers;
  l->ps.max_staleness = max_staleness;
  l->ps.size = n;
  l->ps.impl = l;
  dt__pstore_local_begin(&l->ps);
  return &l->ps;
}

static dt_result dt__pstore_check(dt_pstore *ps, const char *fn, int worker, int64_t clock, size_t n,
                                  const dt_pstore_ticket *tk) {
  if (!ps || !ps->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: store is NULL", fn);
  if (!tk) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: ticket is NULL", fn);
  if (worker < 0 || worker >= ps->workers)
    return dt__error(DTRAIN_ERR_INDEX, "%s: worker %d outside [0, %d)", fn, worker, ps->workers);
  if (clock < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: worker %d: clock %lld < 0", fn, worker, (long long)clock);
  if (n != ps->size)
    return dt__error(DTRAIN_ERR_SHAPE, "%s: worker %d: n=%zu but the store holds %zu floats", fn, worker, n, ps->size);
  return DTRAIN_OK;
}

DTRAIN_API void dt_pstore_destroy(dt_pstore *ps) {
  dt__quiet_push();
  if (ps && ps->vtable && ps->vtable->destroy) ps->vtable->destroy(ps);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API dt_result dt_pstore_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk) {
  dt_result r = dt__pstore_check(ps, "dt_pstore_pull", worker, clock, n, tk);
  if (r != DTRAIN_OK) return r;
  if (!dst && n > 0) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pstore_pull: worker %d: dst is NULL", worker);
  dt__quiet_push();
  return dt__quiet_pop(ps->vtable->pull(ps, worker, clock, dst, n, tk));
}

DTRAIN_API dt_result dt_pstore_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  dt_result r = dt__pstore_check(ps, "dt_pstore_push", worker, clock, n, tk);
  if (r != DTRAIN_OK) return r;
  dt__quiet_push();
  return dt__quiet_pop(ps->vtable->push(ps, worker, clock, delta, n, tk));
}

DTRAIN_API void dt_pstore_leave(dt_pstore *ps, int worker) {
  dt__quiet_push();
  if (ps && ps->vtable && worker >= 0 && worker < ps->workers) ps->vtable->leave(ps, worker);
  dt__quiet_pop(DTRAIN_OK);
}

DTRAIN_API void dt_pstore_abort(dt_pstore *ps) {
  if (ps && ps->vtable) ps->vtable->abort(ps);
}

DTRAIN_API dt_result dt_pstore_begin(dt_pstore *ps) {
  if (!ps || !ps->vtable) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_pstore_begin: store is NULL");
  return ps->vtable->begin(ps);
}

DTRAIN_API uint64_t dt_pstore_version(dt_pstore *ps) {
  return (ps && ps->vtable) ? ps->vtable->version(ps) : 0;
}

/* ---- strategy state ---------------------------------------------------------------------- */

typedef struct dt__strategy_replica {
  dt_graph *g;
  float *data, *grad;      /* what the graph is bound to */
  float *own_data, *own_grad, *old; /* allocated here (NULL when borrowed) */
  dt_optim *opt;           /* async: this replica's optimizer */
  int updating;            /* devices: this step reached the update */
  /* the current step */
  float loss;
  int64_t rows;
  double ss_part;          /* clipping: sum of squares of this replica's slice */
  dt_result result;
  /* statistics */
  int64_t steps, samples;
  double compute_s, wait_s, loss_sum;
  int64_t loss_count;
  float last_loss;
  double last_time;        /* async: when the last push finished */
  int64_t hist[DTRAIN_STALENESS_BINS];
  int64_t stale_max, stale_sum, gap_max;
  char pad[DT__ALIGN];     /* keeps the next replica's hot fields off these cache lines */
} dt__strategy_replica;

enum { DT__STRATEGY_JOB_SYNC = 0, DT__STRATEGY_JOB_ASYNC };

struct dt_strategy {
  dt_strategy_desc desc;
  dt_params *params;
  dt_optim *opt;
  dt_step_fn step;
  void *user;
  int n;
  size_t size;             /* floats in the flat buffers */
  size_t fbytes;           /* size * sizeof(float) */
  dt__strategy_replica *rep;
  size_t rep_bytes;
  dt__pool *pool;
  dt_comm *comm;           /* sync strategies */
  dt_pstore *pstore;       /* async */
  size_t *bufr;            /* non-trainable runs [begin, end) pairs */
  int nbufr;
  /* the current job */
  const dt_minibatch *batch;   /* step(): the global batch */
  dt_minibatch_fn next;        /* run(): the batch source (async) */
  void *next_user;
  int64_t job_steps;       /* async: steps per replica (lock-step) or total pushes */
  int64_t ticket_base;
  DT__ATOMIC(int64_t) ticket;
  DT__ATOMIC(int) failed;  /* -1, or the first replica that failed */
  dt_result err;
  char msg[DT__MSG_CAP];
  /* totals */
  int64_t steps, samples, tickets;
  double seconds, loss_sum;
  int64_t loss_count;
  float last_loss;
  int last_failed;
  /* multi_worker_mirrored (see its section) */
  float *mwm_buf;          /* replica 0's gradient + DT__MWM_TAIL floats: what crosses processes */
  size_t mwm_bytes;
  double mwm_rows;         /* the global batch's rows (this step) */
  double mwm_loss;         /* the global batch's loss (this step) */
  /* devices (desc.devices) */
  int dev;                 /* nonzero: replica r runs on desc.devices[r] */
  dt_device_group *dgroup; /* the all-reduce over the replicas' devices */
  float **dgrad, **ddata;  /* each replica's device gradient / parameters */
  float *dhost;            /* host copy of replica 0's reduced gradient (checks) */
  int64_t dev_opt_steps;   /* the optimizer's steps before the current step */
};

/* ---- small helpers -------------------------------------------------------------------------- */

DTRAIN_API void dt_sleep(double seconds) { dt__sleep(seconds); }
DTRAIN_API int dt_cpu_count(void) { return dt__cpu_count(); }

DTRAIN_API const char *dt_strategy_kind_name(dt_strategy_kind kind) {
  switch (kind) {
    case DTRAIN_STRATEGY_ONE_DEVICE: return "one_device";
    case DTRAIN_STRATEGY_MIRRORED: return "mirrored";
    case DTRAIN_STRATEGY_CENTRAL_STORAGE: return "central_storage";
    case DTRAIN_STRATEGY_ASYNC: return "async";
    case DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED: return "multi_worker_mirrored";
    case DTRAIN_STRATEGY_PARAMETER_SERVER: return "parameter_server";
    default: return "unknown";
  }
}

static dt_strategy_desc dt__strategy_desc(dt_strategy_kind kind, int replicas, int max_staleness) {
  dt_strategy_desc d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  d.replicas = replicas;
  d.max_staleness = max_staleness;
  return d;
}

DTRAIN_API dt_strategy_desc dt_one_device(void) { return dt__strategy_desc(DTRAIN_STRATEGY_ONE_DEVICE, 1, 0); }
DTRAIN_API dt_strategy_desc dt_mirrored(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_MIRRORED, replicas, 0);
}
DTRAIN_API dt_strategy_desc dt_central_storage(int replicas) {
  return dt__strategy_desc(DTRAIN_STRATEGY_CENTRAL_STORAGE, replicas, 0);
}
DTRAIN_API dt_strategy_desc dt_async(int replicas, int max_staleness) {
  return dt__strategy_desc(DTRAIN_STRATEGY_ASYNC, replicas, max_staleness);
}
DTRAIN_API dt_strategy_desc dt_multi_worker_mirrored(dt_comm *comm, int replicas) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED, replicas, 0);
  d.comm = comm;
  return d;
}

DTRAIN_API dt_result dt_strategy_parse(const char *name, int replicas, int max_staleness, dt_strategy_desc *out) {
  if (!name || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_parse: %s is NULL", !name ? "name" : "out");
  for (int k = DTRAIN_STRATEGY_ONE_DEVICE; k <= DTRAIN_STRATEGY_PARAMETER_SERVER; k++) {
    if (strcmp(name, dt_strategy_kind_name((dt_strategy_kind)k)) == 0) {
      *out = dt__strategy_desc((dt_strategy_kind)k, k == DTRAIN_STRATEGY_ONE_DEVICE ? 1 : replicas, max_staleness);
      return DTRAIN_OK;
    }
  }
  return dt__error(DTRAIN_ERR_INVALID_ARG,
                   "dt_strategy_parse: unknown strategy '%s' (one_device, mirrored, central_storage, async, "
                   "multi_worker_mirrored, parameter_server)", name);
}

static int dt__strategy_sync(const dt_strategy *s) {
  return s->desc.kind != DTRAIN_STRATEGY_ASYNC && s->desc.kind != DTRAIN_STRATEGY_PARAMETER_SERVER;
}

/* Record replica r's failure; the first one wins. Breaks the barrier or the
 * store so that nobody waits for r. */
static void dt__strategy_fail(dt_strategy *s, int r, dt_result code, const char *what) {
  int expected = -1;
  s->rep[r].result = code;
  if (DT__ACAS(&s->failed, &expected, r, DT__MO_SEQ_CST)) {
    s->err = code;
    snprintf(s->msg, sizeof s->msg, "replica %d: %s", r, what);
  }
  if (s->comm) dt_comm_abort(s->comm, r);
  if (s->pstore) dt_pstore_abort(s->pstore);
}

static int dt__strategy_failed(dt_strategy *s) { return DT__ALOAD(&s->failed, DT__MO_ACQUIRE) >= 0; }

/* A collective or the store returned rc: aborted by someone else, or a
 * failure of this replica's own. */
static void dt__strategy_comm_failed(dt_strategy *s, int r, dt_result rc) {
  if (rc == DTRAIN_ERR_ABORTED) s->rep[r].result = DTRAIN_ERR_ABORTED;
  else dt__strategy_fail(s, r, rc, dt_last_error());
}

/* Shard r of the global batch (see "Batches" in dt_strategy.h). */
static void dt__strategy_shard(const dt_minibatch *gb, int n, int r, dt_minibatch *out) {
  int64_t base = gb->rows / n, extra = gb->rows % n;
  int64_t first = base * r + DT__MIN((int64_t)r, extra);
  int64_t rows = base + (r < extra ? 1 : 0);
  *out = *gb;
  out->rows = rows;
  out->first = first;
  out->global_rows = gb->rows;
  out->x = gb->x ? gb->x + first * gb->x_cols : NULL;
  out->y = gb->y ? gb->y + first * (gb->y_cols > 0 ? gb->y_cols : 1) : NULL;
  out->t = gb->t ? gb->t + first * gb->t_cols : NULL;
}

static dt_result dt__strategy_check_batch(const dt_minibatch *b, const char *fn) {
  if (!b) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: batch is NULL", fn);
  if (b->rows < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: batch has %lld rows", fn, (long long)b->rows);
  if (b->x_cols < 0 || b->y_cols < 0 || b->t_cols < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: negative column count (x %lld, y %lld, t %lld)", fn,
                     (long long)b->x_cols, (long long)b->y_cols, (long long)b->t_cols);
  return DTRAIN_OK;
}

/* Index of the first non-finite value in x[b, e), or e. */
static size_t dt__strategy_nonfinite(const float *x, size_t b, size_t e) {
  for (size_t i = b; i < e; i++)
    if (!isfinite(x[i])) return i;
  return e;
}

/* Name of the parameter holding flat index i (for messages). */
static const char *dt__strategy_param_at(dt_strategy *s, size_t i) {
  dt_param_info info;
  for (int p = 0; p < dt_params_count(s->params); p++)
    if (dt_params_info(s->params, p, &info) == DTRAIN_OK && i >= info.offset && i < info.offset + info.size)
      return info.name;
  return "(padding)";
}

/* Forward + backward of replica r on its shard. Returns 0 on failure (recorded). */
static int dt__strategy_compute(dt_strategy *s, int r, const dt_minibatch *b) {
  dt__strategy_replica *R = &s->rep[r];
  char what[DT__MSG_CAP];
  if (s->dev) {
    dt_result zr = dt_graph_zero_grad(R->g);
    if (zr != DTRAIN_OK) {
      dt__strategy_fail(s, r, zr, dt_last_error());
      return 0;
    }
  } else {
    memset(R->grad, 0, s->fbytes);
  }
  R->rows = b->rows;
  R->loss = 0.0f;
  if (b->rows == 0) return 1;
  double t0 = dt__now();
  dt_graph_reset(R->g);
  dt_tensor *L = s->step(R->g, r, b, s->user);
  dt_result rc = dt_graph_error(R->g);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_graph_message(R->g));
    return 0;
  }
  if (!L) {
    dt__strategy_fail(s, r, DTRAIN_ERR_NULL_ARG, "the step function returned NULL without a graph error");
    return 0;
  }
  if (L->size != 1) {
    char sb[96];
    snprintf(what, sizeof what, "the step function's loss must have one element, got %s",
             dt_shape_str(L, sb, sizeof sb));
    dt__strategy_fail(s, r, DTRAIN_ERR_SHAPE, what);
    return 0;
  }
  float lv;
  if (!s->dev) {
    lv = L->data[0];
  } else if ((rc = dt_tensor_to_host(L, &lv)) != DTRAIN_OK) { /* the loss comes from the device */
    dt__strategy_fail(s, r, rc, dt_last_error());
    return 0;
  }
  if (!isfinite(lv)) {
    snprintf(what, sizeof what, "loss is %s", isnan(lv) ? "NaN" : "Inf");
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
  float w = b->weight;
  rc = dt_backward_grad(R->g, L, &w);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_graph_message(R->g));
    return 0;
  }
  R->loss = lv;
  if (s->desc.check_numerics) {
    /* Before any reduction or optimizer state sees it, and where the
     * culprit is still known. On a device: a host copy is scanned. */
    const float *hg = R->grad;
    if (s->dev) {
      dt_device *d = s->desc.devices[r];
      rc = d->copy(d, R->old, R->grad, s->fbytes, DTRAIN_COPY_D2H);
      if (rc != DTRAIN_OK) {
        snprintf(what, sizeof what, "check_numerics: gradient to the host: device %.40s: %.200s", d->name,
                 dt_last_error());
        dt__strategy_fail(s, r, rc, what);
        return 0;
      }
      hg = R->old;
    }
    size_t bad = dt__strategy_nonfinite(hg, 0, s->size);
    if (bad < s->size) {
      snprintf(what, sizeof what, "gradient of '%s' is %s at flat index %zu", dt__strategy_param_at(s, bad),
               isnan(hg[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  double dt = dt__now() - t0;
  if (r == s->desc.straggler && s->desc.straggler_factor > 1.0f) {
    double extra = dt * ((double)s->desc.straggler_factor - 1.0);
    dt__sleep(extra);
    dt += extra;
  }
  R->compute_s += dt;
  return 1;
}

/* Sum of squares of the trainable elements of grad in [b, e), in index order. */
static double dt__strategy_sumsq(dt_strategy *s, const float *grad, size_t b, size_t e) {
  double ss = 0.0;
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    for (size_t j = lo; j < hi; j++) ss += (double)grad[j] * (double)grad[j];
  }
  return ss;
}

static void dt__strategy_scale(dt_strategy *s, float *grad, size_t b, size_t e, float coef) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    for (size_t j = lo; j < hi; j++) grad[j] *= coef;
  }
}

/* Replica r's part of gradient clipping over the slice [b, e) of grad. */
static int dt__strategy_clip(dt_strategy *s, int r, float *grad, size_t b, size_t e) {
  float clip = dt_optim_get_desc(s->opt)->clip_norm;
  if (!(clip > 0.0f)) return 1;
  s->rep[r].ss_part = dt__strategy_sumsq(s, grad, b, e);
  dt_result rc = dt_comm_barrier(s->comm, r);
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    return 0;
  }
  double ss = 0.0;
  for (int j = 0; j < s->n; j++) ss += s->rep[j].ss_part; /* rank order: the same total everywhere */
  double norm = sqrt(ss);
  if (!isfinite(norm)) {
    /* Every replica sees the same total; let replica 0 report it. */
    if (r == 0) {
      char what[96];
      snprintf(what, sizeof what, "gradient norm is %s; no update made", isnan(norm) ? "NaN" : "Inf");
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    } else {
      s->rep[r].result = DTRAIN_ERR_ABORTED;
    }
    return 0;
  }
  if (norm > (double)clip) dt__strategy_scale(s, grad, b, e, (float)((double)clip / (norm + 1e-6)));
  return 1;
}

/* Replica r's checks of its slice [lo, hi) of the reduced gradient before
 * the update (mirrored, multi_worker_mirrored): clipping, then with
 * check_numerics a NaN/Inf scan and a barrier, so that nobody updates before
 * everybody checked. 0: the step stops (the failure is recorded). */
static int dt__strategy_clip_check(dt_strategy *s, int r, float *grad, size_t lo, size_t hi) {
  if (!dt__strategy_clip(s, r, grad, lo, hi)) return 0;
  if (!s->desc.check_numerics) return 1;
  size_t bad = dt__strategy_nonfinite(grad, lo, hi);
  if (bad < hi) {
    char what[DT__MSG_CAP];
    snprintf(what, sizeof what, "reduced gradient of '%s' is %s at flat index %zu; no update made",
             dt__strategy_param_at(s, bad), isnan(grad[bad]) ? "NaN" : "Inf", bad);
    dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
    return 0;
  }
  dt_result rc = dt_comm_barrier(s->comm, r);
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    return 0;
  }
  return 1;
}

/* Copies the non-trainable runs (buffers) of src within [b, e) to dst. */
static void dt__strategy_copy_buffers(dt_strategy *s, float *dst, const float *src, size_t b, size_t e) {
  for (int i = 0; i < s->nbufr; i++) {
    size_t lo = DT__MAX(s->bufr[2 * i], b), hi = DT__MIN(s->bufr[2 * i + 1], e);
    if (lo < hi) memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float));
  }
}

/* ---- the synchronous step ------------------------------------------------------------------ */

static void dt__strategy_sync_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int mirrored = s->desc.kind == DTRAIN_STRATEGY_MIRRORED;
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  b.weight = (s->desc.loss == DTRAIN_LOSS_SUM || b.global_rows == 0) ? 1.0f
                                                                    : (float)((double)b.rows / (double)b.global_rows);
  b.replica_step = 0;
  /* central storage with buffers: every replica reads a private copy of
   * the centre, so that forward passes writing batch-norm statistics do not
   * race; replica 0's statistics go back to the centre after the reduce. */
  if (R->own_data && !mirrored) memcpy(R->own_data, dt_params_data(s->params), s->fbytes);
  if (!dt__strategy_compute(s, r, &b)) return;

  size_t lo, hi;
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  float *grad, *data;
  dt_result rc;
  double w0 = 0.0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  w0 = cs.wait_s;
  if (mirrored) {
    rc = dt_comm_reduce_scatter(s->comm, r, R->grad, s->size);
    grad = R->grad;
    data = R->data;
  } else {
    rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
    grad = s->rep[0].grad;
    data = dt_params_data(s->params);
  }
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  if (!dt__strategy_clip_check(s, r, grad, lo, hi)) goto done;
  rc = dt_optim_update(s->opt, data, grad, lo, hi);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    goto done;
  }
  /* The optimizer never touches the buffer ranges: replica 0 may write them
   * while the others update their slices. */
  if (!mirrored && r == 0 && R->own_data)
    for (int i = 0; i < s->nbufr; i++)
      memcpy(data + s->bufr[2 * i], R->own_data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  if (mirrored) {
    /* Buffers follow replica 0: each replica puts replica 0's values into
     * its own slice before the all-gather spreads the slices (the optimizer
     * never writes the buffer ranges, so replica 0's stay still meanwhile). */
    if (r > 0) dt__strategy_copy_buffers(s, R->data, s->rep[0].data, lo, hi);
    rc = dt_comm_allgather(s->comm, r, R->data, s->size);
    if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
  }
done:
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
}

/* ==== multi_worker_mirrored ============================================================
 * Lock-step data parallelism across processes, hierarchical inside each:
 * desc.comm connects the processes (one rank each: TCP, MPI); the process's
 * own replicas (threads) use the in-process communicator s->comm. A step
 * (dt__strategy_mwm_job, run by every local replica):
 *
 *   shard r of this process's batch -> forward/backward with the loss
 *   gradient weighted by the shard's rows (MEAN; 1 for SUM), so gradients
 *   are row sums -> reduce to replica 0 (threads, rank order) -> replica 0
 *   appends a tail (rows, loss sum, failure flags) and writes rank 0's
 *   buffers (batch-norm statistics; zeros elsewhere) into their ranges of the
 *   gradient -> ONE all-reduce of the whole buffer on desc.comm -> a barrier
 *   (replica 0's result is everybody's) -> each replica scales its slice by
 *   1/global rows, then clipping / numerics / the optimizer on its slice as
 *   in mirrored, and the slice of the buffers from the all-reduce (= rank 0
 *   replica 0's) into its copy -> all-gather of the parameters.
 *
 * Replica 0 always joins the cross-process all-reduce, even after a local
 * failure (it then sends zeros with the failure flag set), so that no other
 * process waits for it: every rank sees the flag and fails the step too.
 * After the all-reduce every rank holds the same numbers, so clipping and
 * numerics checks decide the same everywhere without further messages.
 */

/* Floats after the gradient in the cross-process buffer:
 * [0, 1] global rows (hi + lo), [2, 3] loss sum (hi + lo),
 * [4] ranks that failed locally, [5] sum of (failed rank + 1). */
#define DT__MWM_TAIL 8

static dt_result dt__strategy_mwm_check(const dt_strategy_desc *d) {
  const char *fn = "dt_strategy_create";
  dt_comm *c = d->comm;
  if (!c || !c->vtable)
    return dt__error(DTRAIN_ERR_NULL_ARG,
                     "%s: multi_worker_mirrored needs desc.comm (dt_comm_create_tcp or dt_comm_create_mpi)", fn);
  if (c->world < 1 || c->rank < 0 || c->rank >= c->world)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: multi_worker_mirrored: communicator '%s' has rank %d of world %d",
                     fn, dt_comm_name(c), c->rank, c->world);
  return DTRAIN_OK;
}

static dt_result dt__strategy_mwm_alloc(dt_strategy *s) {
  s->mwm_bytes = (s->size + DT__MWM_TAIL) * sizeof(float);
  s->mwm_buf = (float *)dt__calloc(s->mwm_bytes);
  return s->mwm_buf ? DTRAIN_OK : DTRAIN_ERR_NOMEM;
}

static dt_result dt__strategy_mwm_comm_error(dt_strategy *s, const char *fn, dt_result rc) {
  char what[DT__MSG_CAP];
  snprintf(what, sizeof what, "%.300s", dt_last_error());
  return dt__error(rc, "%s: multi_worker_mirrored: initial broadcast from rank 0 (rank %d of %d): %s", fn,
                   dt_comm_rank(s->desc.comm), dt_comm_world(s->desc.comm), what);
}

/* Rank 0's parameters and buffers to every process (after checking that all
 * built the same model), then into every local replica. Collective: every
 * process calls it (dt_strategy_create, dt_strategy_sync). */
static dt_result dt__strategy_mwm_start(dt_strategy *s, const char *fn) {
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *pdata = dt_params_data(s->params);
  /* The model hash in 16-bit pieces (exact in floats), from rank 0. */
  uint64_t h = dt_params_hash(s->params), h0 = 0;
  float hb[4], flag[2];
  for (int i = 0; i < 4; i++) hb[i] = (float)((h >> (16 * i)) & 0xffffu);
  dt_result rc = dt_comm_broadcast(x, rank, hb, 4, 0);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  for (int i = 0; i < 4; i++) h0 |= (uint64_t)hb[i] << (16 * i);
  /* Everybody learns whether somebody differs (so that all fail alike). */
  flag[0] = h0 != h ? 1.0f : 0.0f;
  flag[1] = h0 != h ? (float)(rank + 1) : 0.0f;
  rc = dt_comm_allreduce(x, rank, flag, 2);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  if (flag[0] > 0.5f) {
    if (flag[0] < 1.5f)
      return dt__error(DTRAIN_ERR_MISMATCH,
                       "%s: multi_worker_mirrored: rank %d built a different model than rank 0 (dt_params_hash "
                       "differs: names, shapes or order of the parameters)", fn, (int)flag[1] - 1);
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "%s: multi_worker_mirrored: %d ranks built a different model than rank 0 (dt_params_hash differs)",
                     fn, (int)(flag[0] + 0.5f));
  }
  rc = dt_comm_broadcast(x, rank, pdata, s->size, 0);
  if (rc != DTRAIN_OK) return dt__strategy_mwm_comm_error(s, fn, rc);
  if (s->dev) {
    for (int r = 0; r < s->n; r++) {
      rc = dt_graph_params_upload(s->rep[r].g);
      if (rc != DTRAIN_OK) return dt__error(rc, "%s: replica %d: %s", fn, r, dt_last_error());
    }
    return DTRAIN_OK;
  }
  for (int r = 1; r < s->n; r++) memcpy(s->rep[r].data, pdata, s->fbytes);
  return DTRAIN_OK;
}

/* Replica 0's part: the one cross-process all-reduce. ok: the local part
 * succeeded. Returns 1 when the step goes on (s->mwm_rows/mwm_loss set). */
static int dt__strategy_mwm_exchange(dt_strategy *s, int ok) {
  dt__strategy_replica *R = &s->rep[0];
  dt_comm *x = s->desc.comm;
  const int rank = dt_comm_rank(x);
  float *buf = s->mwm_buf, *tail = buf + s->size; /* (replica 0's gradient on the CPU) */
  char what[DT__MSG_CAP];
  memset(tail, 0, DT__MWM_TAIL * sizeof(float));
  if (ok) {
    double rows = 0.0, lsum = 0.0;
    for (int r = 0; r < s->n; r++) {
      rows += (double)s->rep[r].rows;
      lsum += (s->desc.loss == DTRAIN_LOSS_SUM ? 1.0 : (double)s->rep[r].rows) * (double)s->rep[r].loss;
    }
    tail[0] = (float)rows;
    tail[1] = (float)(rows - (double)tail[0]);
    tail[2] = (float)lsum;
    tail[3] = (float)(lsum - (double)tail[2]);
    /* Buffers follow rank 0: its values plus zeros from the others (with
     * devices the caller put them in buf). */
    for (int i = 0; i < s->nbufr && !s->dev; i++) {
      size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
      if (rank == 0) memcpy(buf + b, R->data + b, (e - b) * sizeof(float));
      else memset(buf + b, 0, (e - b) * sizeof(float));
    }
  } else {
    memset(buf, 0, s->fbytes);
    tail[4] = 1.0f;
    tail[5] = (float)(rank + 1);
  }
  double t0 = dt__now();
  dt_result rc = dt_comm_allreduce(x, rank, buf, s->size + DT__MWM_TAIL);
  R->wait_s += dt__now() - t0;
  if (rc != DTRAIN_OK) {
    if (ok) {
      /* ABORTED carries no message of its own: an earlier failure broke the communicator. */
      snprintf(what, sizeof what, "cross-process all-reduce (rank %d of %d): %.250s", rank, x->world,
               rc == DTRAIN_ERR_ABORTED ? "the communicator was broken by an earlier failure (see that error); "
                                          "recreate it (and the strategy) to go on"
                                        : dt_last_error());
      dt__strategy_fail(s, 0, rc, what);
    }
    return 0;
  }
  if (!ok) return 0; /* the local failure is already recorded */
  if (tail[4] > 0.5f) {
    if (tail[4] < 1.5f)
      snprintf(what, sizeof what, "rank %d failed its part of step %lld (its own error says why); no update made",
               (int)tail[5] - 1, (long long)s->batch->step);
    else
      snprintf(what, sizeof what, "%d ranks failed their part of step %lld; no update made", (int)(tail[4] + 0.5f),
               (long long)s->batch->step);
    dt__strategy_fail(s, 0, DTRAIN_ERR_PEER, what);
    return 0;
  }
  s->mwm_rows = (double)tail[0] + (double)tail[1];
  double L = (double)tail[2] + (double)tail[3];
  s->mwm_loss = s->desc.loss == DTRAIN_LOSS_SUM ? L : (s->mwm_rows > 0.0 ? L / s->mwm_rows : 0.0);
  return 1;
}

/* Copies the trainable elements of grad in [b, e) to dst (the params' grad). */
static void dt__strategy_mwm_copy_grad(dt_strategy *s, float *dst, const float *grad, size_t b, size_t e) {
  size_t pb, pe;
  int tr, dec;
  for (int i = 0; dt__params_range(s->params, i, &pb, &pe, &tr, &dec); i++) {
    if (!tr) continue;
    size_t lo = DT__MAX(pb, b), hi = DT__MIN(pe, e);
    if (lo < hi) memcpy(dst + lo, grad + lo, (hi - lo) * sizeof(float));
  }
}

static void dt__strategy_mwm_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  R->result = DTRAIN_OK;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  /* Row sums now; the division by the global rows comes after the all-reduce. */
  b.weight = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0f : (float)b.rows;
  b.replica_step = 0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  double w0 = cs.wait_s;
  int ok = dt__strategy_compute(s, r, &b);
  dt_result rc;
  float *grad = s->rep[0].grad;
  size_t lo, hi;
  if (ok) {
    rc = dt_comm_reduce(s->comm, r, R->grad, s->size, 0);
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  if (r == 0) ok = dt__strategy_mwm_exchange(s, ok);
  if (!ok) goto done;
  rc = dt_comm_barrier(s->comm, r); /* replica 0's all-reduce is done */
  if (rc != DTRAIN_OK) {
    dt__strategy_comm_failed(s, r, rc);
    goto done;
  }
  dt_comm_slice(s->size, s->n, r, &lo, &hi);
  if (s->desc.loss == DTRAIN_LOSS_MEAN && s->mwm_rows > 0.0)
    dt__strategy_scale(s, grad, lo, hi, (float)(1.0 / s->mwm_rows));
  if (!dt__strategy_clip_check(s, r, grad, lo, hi)) goto done;
  rc = dt_optim_update(s->opt, R->data, grad, lo, hi);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, r, rc, dt_last_error());
    goto done;
  }
  dt__strategy_mwm_copy_grad(s, dt_params_grad(s->params), grad, lo, hi);
  /* The buffers: rank 0 replica 0's, carried by the all-reduce; each replica
   * puts its slice of them into its copy, the all-gather spreads them. */
  dt__strategy_copy_buffers(s, R->data, grad, lo, hi);
  rc = dt_comm_allgather(s->comm, r, R->data, s->size);
  if (rc != DTRAIN_OK) dt__strategy_comm_failed(s, r, rc);
done:
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
}

#undef DT__MWM_TAIL
/* ==== end of multi_worker_mirrored ============================================================ */

/* ==== replicas on devices (desc.devices) ======================================================
 * One replica per device; the same thread pool and in-process communicator
 * (a barrier) as on the CPU. A step (dt__strategy_dev_job, every replica):
 *
 *   shard r -> zero the device gradient -> step fn + backward on the device
 *   -> barrier -> replica 0 alone: dt_device_group_allreduce of the device
 *   gradients, [mwm: device 0's sum -> host -> the cross-process all-reduce
 *   -> scaled by 1/global rows -> device 0], the checks on a host copy
 *   (check_numerics, a finite clipping norm), dt_optim_step_graph on device
 *   0 with the strategy's optimizer (its state lives on device 0 only), and
 *   a broadcast of device 0's parameters (buffers included) to the others.
 * Updating on one device and broadcasting (rather than every device
 * updating its copy with its own optimizer state) keeps ONE optimizer state
 * (the given dt_optim's, so that checkpoints and dt_optim_* see it) and
 * makes a failure easy to undo: the replicas can never drift apart, because
 * whatever fails, every device gets the params' values again. The price is
 * one broadcast of the parameters per step on top of the all-reduce.
 * The caller then copies replica 0's parameters to the params (host). */

/* Replica 0's checks of a host copy of the reduced gradient: NaN/Inf
 * (check_numerics) and a finite clipping norm. 0: the step stops. */
static int dt__strategy_dev_checks(dt_strategy *s, const float *g) {
  char what[DT__MSG_CAP];
  if (s->desc.check_numerics) {
    size_t bad = dt__strategy_nonfinite(g, 0, s->size);
    if (bad < s->size) {
      snprintf(what, sizeof what, "reduced gradient of '%s' is %s at flat index %zu; no update made",
               dt__strategy_param_at(s, bad), isnan(g[bad]) ? "NaN" : "Inf", bad);
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  if (dt_optim_get_desc(s->opt)->clip_norm > 0.0f) {
    double norm = sqrt(dt__strategy_sumsq(s, g, 0, s->size));
    if (!isfinite(norm)) {
      snprintf(what, sizeof what, "gradient norm is %s; no update made", isnan(norm) ? "NaN" : "Inf");
      dt__strategy_fail(s, 0, DTRAIN_ERR_NONFINITE, what);
      return 0;
    }
  }
  return 1;
}

/* A failed device call of replica 0's reduce phase. */
static int dt__strategy_dev_failed(dt_strategy *s, dt_result rc, const char *what) {
  char msg[DT__MSG_CAP];
  snprintf(msg, sizeof msg, "%.60s: %.250s", what, dt_last_error());
  dt__strategy_fail(s, 0, rc, msg);
  return 0;
}

/* Replica 0's host <-> device copy of [b, e) of replica r's buffer p. */
static dt_result dt__strategy_dev_copy(dt_strategy *s, int r, float *dst, const float *src, size_t b, size_t e,
                                       dt_copy_kind kind) {
  dt_device *d = s->desc.devices[r];
  if (e <= b) return DTRAIN_OK;
  dt_result rc = d->copy(d, dst + b, src + b, (e - b) * sizeof(float), kind);
  if (rc != DTRAIN_OK) {
    char msg[DT__MSG_CAP];
    snprintf(msg, sizeof msg, "%.250s", dt_last_error());
    return dt__error(rc, "device %s: %s", d->name, msg);
  }
  return DTRAIN_OK;
}

/* Replica 0's part after the barrier. ok: the local part succeeded
 * (multi_worker_mirrored: replica 0 always joins the exchange). */
static int dt__strategy_dev_reduce(dt_strategy *s, int ok) {
  const int mwm = s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_device_group_allreduce(s->dgroup, s->dgrad);
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "all-reduce of the gradients over the devices");
  }
  if (!mwm) {
    if (!ok) return 0;
    if (!s->desc.check_numerics && !(dt_optim_get_desc(s->opt)->clip_norm > 0.0f)) return 1;
    rc = dt__strategy_dev_copy(s, 0, s->dhost, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
    if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the host");
    return dt__strategy_dev_checks(s, s->dhost);
  }
  /* multi_worker_mirrored: device 0 -> host -> across processes -> device 0 */
  float *buf = s->mwm_buf;
  if (ok) {
    rc = dt__strategy_dev_copy(s, 0, buf, s->dgrad[0], 0, s->size, DTRAIN_COPY_D2H);
    for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) {
      size_t b = s->bufr[2 * i], e = s->bufr[2 * i + 1];
      if (dt_comm_rank(s->desc.comm) == 0) rc = dt__strategy_dev_copy(s, 0, buf, s->ddata[0], b, e, DTRAIN_COPY_D2H);
      else memset(buf + b, 0, (e - b) * sizeof(float));
    }
    if (rc != DTRAIN_OK) ok = dt__strategy_dev_failed(s, rc, "local gradient to the host");
  }
  if (!dt__strategy_mwm_exchange(s, ok)) return 0;
  if (s->desc.loss == DTRAIN_LOSS_MEAN && s->mwm_rows > 0.0)
    dt__strategy_scale(s, buf, 0, s->size, (float)(1.0 / s->mwm_rows));
  if (!dt__strategy_dev_checks(s, buf)) return 0;
  rc = dt__strategy_dev_copy(s, 0, s->dgrad[0], buf, 0, s->size, DTRAIN_COPY_H2D);
  for (int i = 0; i < s->nbufr && rc == DTRAIN_OK; i++) /* rank 0 replica 0's buffers */
    rc = dt__strategy_dev_copy(s, 0, s->ddata[0], buf, s->bufr[2 * i], s->bufr[2 * i + 1], DTRAIN_COPY_H2D);
  if (rc != DTRAIN_OK) return dt__strategy_dev_failed(s, rc, "reduced gradient to the device");
  return 1;
}

static void dt__strategy_dev_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int mwm = s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
  R->result = DTRAIN_OK;
  R->updating = 0;
  dt_minibatch b;
  dt__strategy_shard(s->batch, s->n, r, &b);
  if (mwm) b.weight = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0f : (float)b.rows; /* row sums, as on the CPU */
  else b.weight = (s->desc.loss == DTRAIN_LOSS_SUM || b.global_rows == 0)
                      ? 1.0f
                      : (float)((double)b.rows / (double)b.global_rows);
  b.replica_step = 0;
  dt_comm_stats cs;
  dt_comm_stats_get(s->comm, r, &cs);
  double w0 = cs.wait_s;
  int ok = dt__strategy_compute(s, r, &b);
  dt_result rc;
  if (ok && s->n > 1) {
    rc = dt_comm_barrier(s->comm, r); /* every gradient is done */
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      ok = 0;
    }
  }
  dt_comm_stats_get(s->comm, r, &cs);
  R->wait_s += cs.wait_s - w0;
  if (r > 0) return;
  if (!dt__strategy_dev_reduce(s, ok)) return;
  R->updating = 1;
  rc = dt_optim_step_graph(s->opt, R->g);
  if (rc != DTRAIN_OK) {
    dt__strategy_fail(s, 0, rc, dt_last_error());
    return;
  }
  if (s->n > 1) {
    rc = dt_device_group_broadcast(s->dgroup, s->ddata, 0, s->size, 0);
    if (rc != DTRAIN_OK) dt__strategy_dev_failed(s, rc, "parameters of replica 0 to the devices");
  }
}

/* After a failed step: when some replica reached the update, put the
 * params' (pre-step) values back on every device so the replicas stay
 * equal. */
static void dt__strategy_dev_restore(dt_strategy *s, int64_t opt_steps) {
  int any = 0;
  for (int r = 0; r < s->n; r++) any |= s->rep[r].updating;
  if (!any) return;
  dt__quiet_push();
  for (int r = 0; r < s->n; r++) (void)dt_graph_params_upload(s->rep[r].g);
  dt__quiet_pop(DTRAIN_OK);
  dt_optim_set_steps(s->opt, opt_steps);
}

/* ==== end of devices ======================================================================= */

/* ==== parameter_server (worker side) ==========================================================
 * The async replica's loop against a store that takes gradients (dt_pstore_create_tcp): no
 * local optimizer step; the vector pushed holds the (clipped) gradient for trainable
 * parameters and the current values of buffers. One replica per process: the replica is this
 * process's worker of the store. */

/* Replica r's push vector in R->old, or NULL after a recorded failure. */
static const float *dt__strategy_ps_gradient(dt_strategy *s, int r) {
  dt__strategy_replica *R = &s->rep[r];
  float clip = dt_optim_get_desc(s->opt)->clip_norm;
  if (clip > 0.0f) {
    double norm = sqrt(dt__strategy_sumsq(s, R->grad, 0, s->size));
    if (!isfinite(norm)) {
      dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, "gradient norm is not finite; nothing pushed");
      return NULL;
    }
    if (norm > (double)clip) dt__strategy_scale(s, R->grad, 0, s->size, (float)((double)clip / (norm + 1e-6)));
  }
  memcpy(R->old, R->grad, s->fbytes);
  for (int i = 0; i < s->nbufr; i++)
    memcpy(R->old + s->bufr[2 * i], R->data + s->bufr[2 * i], (s->bufr[2 * i + 1] - s->bufr[2 * i]) * sizeof(float));
  return R->old;
}

DTRAIN_API dt_strategy_desc dt_parameter_server(dt_pstore *store, int max_staleness) {
  dt_strategy_desc d = dt__strategy_desc(DTRAIN_STRATEGY_PARAMETER_SERVER, 1, max_staleness);
  d.store = store;
  return d;
}

/* ==== end of parameter_server ================================================================= */

/* ---- the asynchronous replica -------------------------------------------------------------- */

static void dt__strategy_async_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  dt__strategy_replica *R = &s->rep[r];
  const int lockstep = s->desc.max_staleness == 0 || s->batch != NULL;
  const int ps_kind = s->desc.kind == DTRAIN_STRATEGY_PARAMETER_SERVER;
  R->result = DTRAIN_OK;
  char what[DT__MSG_CAP];
  for (int64_t t = 0;; t++) {
    if (dt__strategy_failed(s)) {
      if (R->result == DTRAIN_OK) R->result = DTRAIN_ERR_ABORTED;
      break;
    }
    int64_t ticket;
    if (lockstep) {
      if (t >= s->job_steps) break;
      ticket = t * s->n + r;
    } else {
      ticket = DT__AFETCH_ADD(&s->ticket, (int64_t)1, DT__MO_RELAXED);
      if (ticket >= s->job_steps) break;
    }
    dt_minibatch b;
    if (s->batch) {
      dt__strategy_shard(s->batch, s->n, r, &b);
    } else {
      memset(&b, 0, sizeof b);
      dt_result rc = s->next(s->next_user, r, s->ticket_base + ticket, &b);
      if (rc == DTRAIN_OK) rc = dt__strategy_check_batch(&b, "dt_strategy_run");
      if (rc != DTRAIN_OK) {
        snprintf(what, sizeof what, "the batch function failed for step %lld (%s)",
                 (long long)(s->ticket_base + ticket), dt_result_name(rc));
        dt__strategy_fail(s, r, rc, what);
        break;
      }
      b.first = 0;
      b.global_rows = b.rows;
    }
    b.step = s->ticket_base + ticket;
    b.replica_step = t;
    b.weight = 1.0f;
    dt_pstore_ticket tk;
    memset(&tk, 0, sizeof tk);
    dt_result rc = dt_pstore_pull(s->pstore, r, t, R->data, s->size, &tk);
    R->wait_s += tk.wait_s;
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    if (tk.clock_gap > R->gap_max) R->gap_max = tk.clock_gap;
    if (!ps_kind) memcpy(R->old, R->data, s->fbytes);
    if (!dt__strategy_compute(s, r, &b)) break;
    const float *delta = NULL;
    if (b.rows > 0 && ps_kind) {
      if (!(delta = dt__strategy_ps_gradient(s, r))) break;
    } else if (b.rows > 0) {
      float clip = dt_optim_get_desc(R->opt)->clip_norm;
      if (clip > 0.0f) {
        double norm = sqrt(dt__strategy_sumsq(s, R->grad, 0, s->size));
        if (!isfinite(norm)) {
          dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, "gradient norm is not finite; no update made");
          break;
        }
        if (norm > (double)clip) dt__strategy_scale(s, R->grad, 0, s->size, (float)((double)clip / (norm + 1e-6)));
      }
      rc = dt_optim_update(R->opt, R->data, R->grad, 0, s->size);
      if (rc != DTRAIN_OK) {
        dt__strategy_fail(s, r, rc, dt_last_error());
        break;
      }
      dt_optim_advance(R->opt);
      float *d = R->old;
      for (size_t i = 0; i < s->size; i++) d[i] = R->data[i] - d[i];
      if (s->desc.check_numerics) {
        size_t bad = dt__strategy_nonfinite(d, 0, s->size);
        if (bad < s->size) {
          snprintf(what, sizeof what, "update of '%s' is %s at flat index %zu; not pushed",
                   dt__strategy_param_at(s, bad), isnan(d[bad]) ? "NaN" : "Inf", bad);
          dt__strategy_fail(s, r, DTRAIN_ERR_NONFINITE, what);
          break;
        }
      }
      delta = d;
    }
    rc = dt_pstore_push(s->pstore, r, t, delta, s->size, &tk);
    R->wait_s += tk.wait_s;
    if (rc != DTRAIN_OK) {
      dt__strategy_comm_failed(s, r, rc);
      break;
    }
    int64_t st = tk.staleness < 0 ? 0 : tk.staleness;
    R->hist[DT__MIN(st, (int64_t)DTRAIN_STALENESS_BINS - 1)]++;
    R->stale_sum += st;
    if (st > R->stale_max) R->stale_max = st;
    R->steps++;
    R->samples += b.rows;
    if (b.rows > 0) {
      R->loss_sum += R->loss;
      R->loss_count++;
      R->last_loss = R->loss;
      R->last_time = dt__now();
    }
  }
  if (!ps_kind) dt_pstore_leave(s->pstore, r); /* a server store is left with dt_pstore_leave by the user */
}

/* ---- running jobs ------------------------------------------------------------------------------ */

static void dt__strategy_job(void *arg, int r) {
  dt_strategy *s = (dt_strategy *)arg;
  int was = dt__par_set_replica(s->n > 1); /* replicas fill the cores: kernels inside use one thread */
  if (s->dev) dt__strategy_dev_job(arg, r);
  else if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) dt__strategy_mwm_job(arg, r);
  else if (dt__strategy_sync(s)) dt__strategy_sync_job(arg, r);
  else dt__strategy_async_job(arg, r);
  dt__par_set_replica(was);
}

/* Runs the current job on every replica; returns the first failure, with
 * the thread's error set on the calling thread. */
static dt_result dt__strategy_launch(dt_strategy *s, const char *fn) {
  DT__ASTORE(&s->failed, -1, DT__MO_RELAXED);
  s->err = DTRAIN_OK;
  s->msg[0] = '\0';
  if (s->pstore) dt_pstore_begin(s->pstore);
  dt__pool_run(s->pool, dt__strategy_job, s);
  int f = DT__ALOAD(&s->failed, DT__MO_ACQUIRE);
  s->last_failed = f;
  if (f < 0) return DTRAIN_OK;
  if (s->comm) dt_comm_recover(s->comm);
  if (s->dev) dt__strategy_dev_restore(s, s->dev_opt_steps);
  return dt__error(s->err, "%s: %s", fn, s->msg);
}

DTRAIN_API dt_result dt_strategy_step(dt_strategy *s, const dt_minibatch *batch, float *loss) {
  const char *fn = "dt_strategy_step";
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: strategy is NULL", fn);
  dt_result rc = dt__strategy_check_batch(batch, fn);
  if (rc != DTRAIN_OK) return rc;
  double t0 = dt__now();
  dt_minibatch gb = *batch;
  gb.step = dt__strategy_sync(s) ? s->steps : s->tickets;
  s->batch = &gb;
  s->next = NULL;
  s->job_steps = 1;
  s->ticket_base = s->tickets;
  int64_t before = 0;
  for (int r = 0; r < s->n; r++) before += s->rep[r].steps;
  if (s->dev) s->dev_opt_steps = dt_optim_steps(s->opt);
  rc = dt__strategy_launch(s, fn);
  s->batch = NULL;
  if (rc == DTRAIN_OK && s->dev) {
    /* dt_optim_step_graph advanced the optimizer; the params get replica 0's values */
    rc = dt_graph_params_download(s->rep[0].g);
    if (rc != DTRAIN_OK) rc = dt__error(rc, "%s: replica 0's parameters to the host: %s", fn, dt_last_error());
  }
  s->seconds += dt__now() - t0;
  if (rc != DTRAIN_OK) return rc;
  /* The batch's loss: shard losses weighted by their share, in rank order
   * (multi_worker_mirrored: the global batch's, from the all-reduce). */
  double L = 0.0;
  if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) L = s->mwm_loss;
  for (int r = 0; r < s->n && s->desc.kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED; r++) {
    double w = s->desc.loss == DTRAIN_LOSS_SUM ? 1.0 : (gb.rows ? (double)s->rep[r].rows / (double)gb.rows : 0.0);
    L += w * (double)s->rep[r].loss;
  }
  if (dt__strategy_sync(s)) {
    if (!s->dev) dt_optim_advance(s->opt);
    for (int r = 0; r < s->n; r++) {
      s->rep[r].steps++;
      s->rep[r].samples += s->rep[r].rows;
    }
    s->steps++;
  } else {
    int64_t after = 0;
    for (int r = 0; r < s->n; r++) after += s->rep[r].steps;
    s->steps += after - before;
    s->tickets += s->n;
  }
  s->samples += gb.rows;
  s->last_loss = (float)L;
  s->loss_sum += L;
  s->loss_count++;
  if (loss) *loss = (float)L;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_strategy_run(dt_strategy *s, int64_t steps, dt_minibatch_fn next, void *next_user,
                                     float *mean_loss) {
  const char *fn = "dt_strategy_run";
  if (mean_loss) *mean_loss = NAN;
  if (!s || !next) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !s ? "strategy" : "next");
  if (steps < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: steps %lld < 0", fn, (long long)steps);
  if (dt__strategy_sync(s)) {
    double sum = 0.0;
    for (int64_t t = 0; t < steps; t++) {
      dt_minibatch b;
      memset(&b, 0, sizeof b);
      int64_t id = s->steps;
      dt_result rc = next(next_user, -1, id, &b);
      if (rc != DTRAIN_OK)
        return dt__error(rc, "%s: the batch function failed for step %lld (%s)", fn, (long long)id, dt_result_name(rc));
      float L;
      rc = dt_strategy_step(s, &b, &L);
      if (rc != DTRAIN_OK) return rc;
      sum += L;
    }
    if (mean_loss && steps > 0) *mean_loss = (float)(sum / (double)steps);
    return DTRAIN_OK;
  }
  /* async: one job in which the replicas run free */
  if (s->desc.max_staleness != 0 && steps > INT64_MAX / DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_OVERFLOW, "%s: %lld steps is too many", fn, (long long)steps);
  double t0 = dt__now();
  s->batch = NULL;
  s->next = next;
  s->next_user = next_user;
  s->job_steps = s->desc.max_staleness == 0 ? steps : steps * s->n;
  s->ticket_base = s->tickets;
  DT__ASTORE(&s->ticket, (int64_t)0, DT__MO_RELAXED);
  double lsum = 0.0;
  int64_t lcount = 0, before = 0, sbefore = 0;
  for (int r = 0; r < s->n; r++) {
    lsum -= s->rep[r].loss_sum;
    lcount -= s->rep[r].loss_count;
    before += s->rep[r].steps;
    sbefore += s->rep[r].samples;
  }
  dt_result rc = dt__strategy_launch(s, fn);
  s->seconds += dt__now() - t0;
  int64_t after = 0, safter = 0;
  double last_time = -1.0;
  for (int r = 0; r < s->n; r++) {
    lsum += s->rep[r].loss_sum;
    lcount += s->rep[r].loss_count;
    after += s->rep[r].steps;
    safter += s->rep[r].samples;
    if (s->rep[r].loss_count > 0 && s->rep[r].last_time > last_time) {
      last_time = s->rep[r].last_time;
      s->last_loss = s->rep[r].last_loss;
    }
  }
  s->steps += after - before;
  s->samples += safter - sbefore;
  s->tickets += s->job_steps;
  s->loss_sum += lsum;
  s->loss_count += lcount;
  if (mean_loss && lcount > 0) *mean_loss = (float)(lsum / (double)lcount);
  return rc;
}

/* ---- create / destroy -------------------------------------------------------------------------- */

static float *dt__strategy_floats(dt_strategy *s, const float *init) {
  float *p = (float *)dt__alloc(s->fbytes ? s->fbytes : sizeof(float));
  if (p) {
    if (init) memcpy(p, init, s->fbytes);
    else memset(p, 0, s->fbytes);
  }
  return p;
}

static dt_result dt__strategy_check_desc(dt_strategy_desc *d) {
  const char *fn = "dt_strategy_create";
  if ((int)d->kind < (int)DTRAIN_STRATEGY_ONE_DEVICE || (int)d->kind > (int)DTRAIN_STRATEGY_PARAMETER_SERVER)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown strategy kind %d", fn, (int)d->kind);
  if (d->kind == DTRAIN_STRATEGY_PARAMETER_SERVER) {
    if (!d->store) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: parameter_server needs desc.store (dt_pstore_create_tcp)", fn);
    if (d->replicas > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: parameter_server runs 1 replica per process (the process is "
                       "one worker of the store), not %d", fn, d->replicas);
    d->replicas = 1;
    d->max_staleness = d->store->max_staleness;
  }
  const char *name = dt_strategy_kind_name(d->kind);
#if defined(DTRAIN_NO_THREADS)
  if (d->kind != DTRAIN_STRATEGY_ONE_DEVICE)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: %s needs threads (built with DTRAIN_NO_THREADS); use one_device",
                     fn, name);
#endif
  if (d->devices && d->replicas == 0) d->replicas = d->ndevices;
  if (d->kind == DTRAIN_STRATEGY_ONE_DEVICE) {
    if (d->replicas > 1)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: one_device has 1 replica, not %d", fn, d->replicas);
    d->replicas = 1;
  }
  if (d->replicas == 0) d->replicas = DT__MIN(dt__cpu_count(), DTRAIN_MAX_REPLICAS);
  if (d->replicas < 1 || d->replicas > DTRAIN_MAX_REPLICAS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s with %d replicas (need 1..%d)", fn, name, d->replicas,
                     DTRAIN_MAX_REPLICAS);
  if ((d->kind == DTRAIN_STRATEGY_ASYNC || d->kind == DTRAIN_STRATEGY_PARAMETER_SERVER) &&
      d->max_staleness < DTRAIN_STALENESS_UNBOUNDED)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
                     d->max_staleness);
  if (d->async_update != DTRAIN_ASYNC_HOGWILD && d->async_update != DTRAIN_ASYNC_ATOMIC)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown async update rule %d", fn, (int)d->async_update);
  if (d->loss != DTRAIN_LOSS_MEAN && d->loss != DTRAIN_LOSS_SUM)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown loss reduction %d", fn, (int)d->loss);
  if (!(d->straggler_factor >= 0.0f) || !isfinite(d->straggler_factor))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: straggler_factor %g must be finite and >= 0", fn,
                     (double)d->straggler_factor);
  if (d->straggler_factor > 1.0f && (d->straggler < 0 || d->straggler >= d->replicas))
    return dt__error(DTRAIN_ERR_INDEX, "%s: straggler replica %d outside [0, %d)", fn, d->straggler, d->replicas);
  if (d->kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) {
    dt_result rc = dt__strategy_mwm_check(d);
    if (rc != DTRAIN_OK) return rc;
  }
  if (d->devices || d->ndevices) {
    if (d->kind != DTRAIN_STRATEGY_ONE_DEVICE && d->kind != DTRAIN_STRATEGY_MIRRORED &&
        d->kind != DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED)
      return dt__error(DTRAIN_ERR_UNSUPPORTED,
                       "%s: %s cannot run on devices (its parameters live in host memory); use one_device, "
                       "mirrored or multi_worker_mirrored with desc.devices", fn, name);
    if (!d->devices) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: desc.ndevices is %d but desc.devices is NULL", fn,
                                      d->ndevices);
    if (d->ndevices < 1 || d->ndevices > DTRAIN_MAX_REPLICAS)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: desc.ndevices %d (need 1..%d with desc.devices)", fn, d->ndevices,
                       DTRAIN_MAX_REPLICAS);
    if (d->replicas != d->ndevices)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s with %d replicas on %d devices (one replica per device; "
                       "replicas 0 takes the device count)", fn, name, d->replicas, d->ndevices);
    for (int i = 0; i < d->ndevices; i++) {
      const dt_device *dv = d->devices[i];
      if (!dv || !dv->alloc || !dv->free || !dv->zero || !dv->copy || !dv->sync || !dv->run)
        return dt__error(DTRAIN_ERR_NULL_ARG, "%s: desc.devices[%d] is NULL or has a NULL function", fn, i);
    }
  }
  if (d->seed == 0) d->seed = 1;
  return DTRAIN_OK;
}

DTRAIN_API dt_strategy *dt_strategy_create(dt_params *params, dt_optim *opt, dt_step_fn step, void *user,
                                           const dt_strategy_desc *desc) {
  const char *fn = "dt_strategy_create";
  if (!params || !opt || !step) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !params ? "params" : !opt ? "opt" : "step");
    return NULL;
  }
  dt_strategy_desc d = desc ? *desc : dt_one_device();
  if (dt__strategy_check_desc(&d) != DTRAIN_OK) return NULL;
  if (dt_params_trainable_size(params) == 0) {
    dt__error(DTRAIN_ERR_STATE, "%s: the params have no trainable parameter", fn);
    return NULL;
  }
  dt_strategy *s = (dt_strategy *)dt__calloc(sizeof *s);
  if (!s) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  s->desc = d;
  s->params = params;
  s->opt = opt;
  s->step = step;
  s->user = user;
  s->n = d.replicas;
  s->size = dt_params_size(params);
  s->fbytes = s->size * sizeof(float);
  s->last_failed = -1;
  DT__ASTORE(&s->failed, -1, DT__MO_RELAXED);
  DT__ASTORE(&s->ticket, (int64_t)0, DT__MO_RELAXED);
  const int kind = d.kind;
  float *pdata = dt_params_data(params), *pgrad = dt_params_grad(params);

  /* Non-trainable runs (batch-norm statistics), adjacent ones merged. */
  int count = dt_params_count(params);
  size_t pb, pe;
  int tr, dec;
  for (int pass = 0; pass < 2; pass++) {
    int nr = 0;
    size_t cur_b = 0, cur_e = 0;
    int open = 0;
    for (int i = 0; i <= count; i++) {
      int have = i < count && dt__params_range(params, i, &pb, &pe, &tr, &dec);
      if (have && !tr) {
        if (open && pb <= ((cur_e + 15) / 16) * 16) {
          cur_e = pe;
        } else {
          if (open) {
            if (pass) { s->bufr[2 * nr] = cur_b; s->bufr[2 * nr + 1] = cur_e; }
            nr++;
          }
          cur_b = pb;
          cur_e = pe;
          open = 1;
        }
      } else if (open) {
        if (pass) { s->bufr[2 * nr] = cur_b; s->bufr[2 * nr + 1] = cur_e; }
        nr++;
        open = 0;
      }
    }
    if (pass == 0) {
      s->nbufr = nr;
      if (nr > 0) {
        s->bufr = (size_t *)dt__alloc((size_t)nr * 2 * sizeof(size_t));
        if (!s->bufr) goto nomem;
      }
    }
  }

  s->rep_bytes = (size_t)s->n * sizeof(dt__strategy_replica);
  s->rep = (dt__strategy_replica *)dt__calloc(s->rep_bytes);
  if (!s->rep) goto nomem;
  if (d.devices) {
    s->dev = 1;
    s->dgrad = (float **)dt__calloc((size_t)s->n * sizeof(float *));
    s->ddata = (float **)dt__calloc((size_t)s->n * sizeof(float *));
    if (!s->dgrad || !s->ddata || !(s->dhost = dt__strategy_floats(s, NULL))) goto nomem;
    if (kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && dt__strategy_mwm_alloc(s) != DTRAIN_OK) goto nomem;
  }
  for (int r = 0; r < s->n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    dt_graph_desc gd;
    memset(&gd, 0, sizeof gd);
    gd.arena_bytes = d.arena_bytes;
    gd.seed = d.seed + (uint64_t)r;
    gd.check_numerics = d.check_numerics;
    if (s->dev) gd.device = d.devices[r]; /* the graph holds its own device copy of the params */
    R->g = dt_graph_create(params, &gd);
    if (!R->g) {
      if (s->dev) {
        char what[DT__MSG_CAP];
        snprintf(what, sizeof what, "%.300s", dt_last_error());
        dt__error(dt_last_result(), "%s: replica %d on device %s: %s", fn, r, d.devices[r]->name, what);
      }
      goto fail;
    }
    R->result = DTRAIN_OK;
    if (s->dev) {
      R->data = s->ddata[r] = dt_graph_param_data(R->g);
      R->grad = s->dgrad[r] = dt_graph_param_grad(R->g);
      if (d.check_numerics && !(R->old = dt__strategy_floats(s, NULL))) goto nomem;
      continue;
    }
    const int mwm = kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED;
    int own_data = ((kind == DTRAIN_STRATEGY_MIRRORED || mwm) && r > 0) || kind == DTRAIN_STRATEGY_ASYNC ||
                   (kind == DTRAIN_STRATEGY_CENTRAL_STORAGE && s->nbufr > 0);
    int own_grad = r > 0 || kind == DTRAIN_STRATEGY_ASYNC;
    if (own_data && !(R->own_data = dt__strategy_floats(s, pdata))) goto nomem;
    if (own_grad && !(R->own_grad = dt__strategy_floats(s, NULL))) goto nomem;
    R->data = own_data ? R->own_data : pdata;
    R->grad = own_grad ? R->own_grad : pgrad;
    if (mwm && r == 0) {
      if (dt__strategy_mwm_alloc(s) != DTRAIN_OK) goto nomem;
      R->grad = s->mwm_buf;
    }
    if (dt_graph_bind(R->g, R->data, R->grad) != DTRAIN_OK) goto fail;
    if (kind == DTRAIN_STRATEGY_PARAMETER_SERVER && !(R->old = dt__strategy_floats(s, NULL))) goto nomem;
    if (kind == DTRAIN_STRATEGY_ASYNC) {
      if (!(R->old = dt__strategy_floats(s, NULL))) goto nomem;
      R->opt = dt_optim_create(params, dt_optim_get_desc(opt));
      if (!R->opt) goto fail;
      dt_optim_set_steps(R->opt, dt_optim_steps(opt));
    }
  }
  if (kind == DTRAIN_STRATEGY_ASYNC) {
    s->pstore = dt_pstore_create_local(pdata, s->size, s->n, d.max_staleness, d.async_update, d.spin_us);
    if (!s->pstore) goto fail;
  } else if (kind == DTRAIN_STRATEGY_PARAMETER_SERVER) {
    if (d.store->size != s->size) {
      dt__error(DTRAIN_ERR_SHAPE, "%s: the store holds %zu floats, the params %zu", fn, d.store->size, s->size);
      goto fail;
    }
    s->pstore = d.store; /* borrowed */
  } else {
    s->comm = dt_comm_create_threads(s->n, d.spin_us);
    if (!s->comm) goto fail;
  }
  if (s->dev && s->n > 1) {
    s->dgroup = dt_device_group_create(d.devices, s->n, s->size);
    if (!s->dgroup) goto fail;
  }
  s->pool = dt__pool_create(s->n, dt__spin_seconds(d.spin_us, s->n));
  if (!s->pool) goto fail;
  if (kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED && dt__strategy_mwm_start(s, fn) != DTRAIN_OK) goto fail;
  return s;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory for %d replicas of %zu floats", fn, s->n, s->size);
fail:
  dt_strategy_destroy(s);
  return NULL;
}

DTRAIN_API void dt_strategy_destroy(dt_strategy *s) {
  if (!s) return;
  dt__pool_destroy(s->pool);
  dt_comm_destroy(s->comm);
  dt_device_group_destroy(s->dgroup);
  dt__free(s->dgrad, (size_t)s->n * sizeof(float *));
  dt__free(s->ddata, (size_t)s->n * sizeof(float *));
  dt__free(s->dhost, s->fbytes ? s->fbytes : sizeof(float));
  if (s->desc.kind != DTRAIN_STRATEGY_PARAMETER_SERVER) dt_pstore_destroy(s->pstore);
  if (s->rep) {
    for (int r = 0; r < s->n; r++) {
      dt__strategy_replica *R = &s->rep[r];
      dt_graph_destroy(R->g);
      dt_optim_destroy(R->opt);
      dt__free(R->own_data, s->fbytes ? s->fbytes : sizeof(float));
      dt__free(R->own_grad, s->fbytes ? s->fbytes : sizeof(float));
      dt__free(R->old, s->fbytes ? s->fbytes : sizeof(float));
    }
    dt__free(s->rep, s->rep_bytes);
  }
  dt__free(s->bufr, (size_t)s->nbufr * 2 * sizeof(size_t));
  dt__free(s->mwm_buf, s->mwm_bytes);
  dt__free(s, sizeof *s);
}

DTRAIN_API dt_result dt_strategy_sync(dt_strategy *s) {
  if (!s) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_sync: strategy is NULL");
  if (s->desc.kind == DTRAIN_STRATEGY_MULTI_WORKER_MIRRORED) return dt__strategy_mwm_start(s, "dt_strategy_sync");
  if (s->dev) {
    for (int r = 0; r < s->n; r++) {
      dt_result rc = dt_graph_params_upload(s->rep[r].g);
      if (rc != DTRAIN_OK) return dt__error(rc, "dt_strategy_sync: replica %d: %s", r, dt_last_error());
    }
    return DTRAIN_OK;
  }
  if (s->desc.kind == DTRAIN_STRATEGY_MIRRORED) {
    const float *src = dt_params_data(s->params);
    for (int r = 1; r < s->n; r++) memcpy(s->rep[r].data, src, s->fbytes);
  }
  return DTRAIN_OK;
}

DTRAIN_API int dt_strategy_replicas(const dt_strategy *s) { return s ? s->n : 0; }
DTRAIN_API const dt_strategy_desc *dt_strategy_get_desc(const dt_strategy *s) { return s ? &s->desc : NULL; }

DTRAIN_API dt_device *dt_strategy_device(const dt_strategy *s, int replica) {
  if (!s || !s->dev || replica < 0 || replica >= s->n) return NULL;
  return s->desc.devices[replica];
}

DTRAIN_API dt_graph *dt_strategy_graph(dt_strategy *s, int replica) {
  if (!s) return NULL;
  if (replica < 0 || replica >= s->n) {
    dt__error(DTRAIN_ERR_INDEX, "dt_strategy_graph: replica %d outside [0, %d)", replica, s->n);
    return NULL;
  }
  return s->rep[replica].g;
}

/* ---- statistics ------------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_strategy_replica_stats(const dt_strategy *s, int replica, dt_replica_stats *out) {
  if (!s || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_replica_stats: %s is NULL", !s ? "strategy" : "out");
  memset(out, 0, sizeof *out);
  if (replica < 0 || replica >= s->n)
    return dt__error(DTRAIN_ERR_INDEX, "dt_strategy_replica_stats: replica %d outside [0, %d)", replica, s->n);
  const dt__strategy_replica *R = &s->rep[replica];
  out->steps = R->steps;
  out->samples = R->samples;
  out->compute_s = R->compute_s;
  out->wait_s = R->wait_s;
  out->staleness_max = R->stale_max;
  out->staleness_mean = R->steps ? (double)R->stale_sum / (double)R->steps : 0.0;
  out->clock_gap_max = R->gap_max;
  out->result = R->result;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_strategy_stats_get(const dt_strategy *s, dt_strategy_stats *out) {
  if (!s || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_strategy_stats_get: %s is NULL", !s ? "strategy" : "out");
  memset(out, 0, sizeof *out);
  out->kind = s->desc.kind;
  out->replicas = s->n;
  out->steps = s->steps;
  out->samples = s->samples;
  out->seconds = s->seconds;
  if (s->seconds > 0.0) {
    out->steps_per_s = (double)s->steps / s->seconds;
    out->samples_per_s = (double)s->samples / s->seconds;
  }
  int64_t pushes = 0, stale_sum = 0;
  for (int r = 0; r < s->n; r++) {
    const dt__strategy_replica *R = &s->rep[r];
    out->wait_s_mean += R->wait_s / (double)s->n;
    if (R->wait_s > out->wait_s_max) out->wait_s_max = R->wait_s;
    for (int b = 0; b < DTRAIN_STALENESS_BINS; b++) out->staleness_hist[b] += R->hist[b];
    if (R->stale_max > out->staleness_max) out->staleness_max = R->stale_max;
    if (R->gap_max > out->clock_gap_max) out->clock_gap_max = R->gap_max;
    stale_sum += R->stale_sum;
    if (!dt__strategy_sync(s)) pushes += R->steps;
  }
  out->staleness_mean = pushes ? (double)stale_sum / (double)pushes : 0.0;
  out->last_loss = s->last_loss;
  out->mean_loss = s->loss_count ? s->loss_sum / (double)s->loss_count : 0.0;
  out->failed_replica = s->last_failed;
  return DTRAIN_OK;
}

DTRAIN_API void dt_strategy_reset_stats(dt_strategy *s) {
  if (!s) return;
  for (int r = 0; r < s->n; r++) {
    dt__strategy_replica *R = &s->rep[r];
    R->steps = R->samples = R->loss_count = 0;
    R->compute_s = R->wait_s = R->loss_sum = 0.0;
    memset(R->hist, 0, sizeof R->hist);
    R->stale_max = R->stale_sum = R->gap_max = 0;
  }
  s->steps = s->samples = s->loss_count = 0;
  s->seconds = s->loss_sum = 0.0;
  if (s->comm) dt_comm_reset_stats(s->comm);
}

#undef DT__PSTORE_DONE
/* ======== end dt_strategy.c ======== */

/* ======== begin dt_cluster.c ======== */
/* ===========================================================================
 * dt_cluster.c -- the cluster description: DTRAIN_CONFIG (JSON in the style
 * of TF_CONFIG), command-line flags, and back to JSON (see dt_net.h)
 * ===========================================================================
 * The text is read by the strict JSON reader that checkpoints use too
 * (dt_json.c, RFC 8259): it checks the whole text, including keys this file
 * ignores, decodes string escapes, checks UTF-8 and limits nesting, so a bad
 * DTRAIN_CONFIG fails loudly with the byte offset and what was expected
 * instead of being half read. The values are then walked once to check and
 * count the addresses, and copied into one allocation.
 *
 * A dt_cluster made here is one block: the struct, the two address arrays and
 * the strings, so destroy needs no bookkeeping beyond the block's size. This
 * file needs no networking: the parser works under DTRAIN_NO_NET too.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_json.h" (amalgamated) */

#define DT__CLUSTER_MAX_DEPTH 32  /* nesting of arrays/objects in DTRAIN_CONFIG */
#define DT__CLUSTER_ADDR_MAX 255  /* longest "host:port" */
#define DT__CLUSTER_DEFAULT_PORT 29500

typedef struct dt__cluster_block {
  dt_cluster pub; /* first: a dt_cluster* is a dt__cluster_block* */
  size_t bytes;   /* the whole block, for dt__free */
} dt__cluster_block;

/* ---- the one-block cluster -------------------------------------------------------------- */

/* A cluster with nw + ns address slots and str_bytes of string space (*strs). */
static dt_cluster *dt__cluster_new(int nw, int ns, size_t str_bytes, char **strs) {
  size_t bytes = sizeof(dt__cluster_block) + (size_t)(nw + ns) * sizeof(char *) + str_bytes;
  dt__cluster_block *b = (dt__cluster_block *)dt__calloc(bytes);
  if (!b) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_cluster: out of memory (%zu bytes)", bytes);
    return NULL;
  }
  b->bytes = bytes;
  char **slots = (char **)(void *)(b + 1);
  b->pub.workers = nw;
  b->pub.servers = ns;
  b->pub.worker_addr = slots;
  b->pub.server_addr = ns > 0 ? slots + nw : NULL;
  *strs = (char *)(slots + nw + ns);
  return &b->pub;
}

/* Copy n bytes of s as a string at *strs into slot *slot; advances *strs. */
static void dt__cluster_put(char **slot, char **strs, const char *s, size_t n) {
  memcpy(*strs, s, n);
  (*strs)[n] = '\0';
  *slot = *strs;
  *strs += n + 1;
}

DTRAIN_API void dt_cluster_destroy(dt_cluster *c) {
  if (!c) return;
  dt__cluster_block *b = (dt__cluster_block *)(void *)c;
  dt__free(b, b->bytes);
}

/* ---- addresses --------------------------------------------------------------------------- */

static int dt__cluster_alnum(int ch) {
  return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}
static int dt__cluster_hex(int ch) {
  return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

/* "host:port" (host name or IPv4) or "[v6]:port" (optionally "[v6%zone]:port"),
 * port 0..65535. 1 when valid; otherwise 0 and the reason in why. */
static int dt__cluster_addr_ok(const char *a, size_t n, char *why, size_t cap) {
  const char *port;
  if (n == 0) {
    snprintf(why, cap, "is empty");
    return 0;
  }
  if (n > DT__CLUSTER_ADDR_MAX) {
    snprintf(why, cap, "is longer than %d bytes", DT__CLUSTER_ADDR_MAX);
    return 0;
  }
  if (memchr(a, '\0', n)) {
    snprintf(why, cap, "contains a NUL character");
    return 0;
  }
  if (a[0] == '[') {
    const char *end = (const char *)memchr(a, ']', n);
    if (!end || end + 1 >= a + n || end[1] != ':') {
      snprintf(why, cap, "expected [v6]:port");
      return 0;
    }
    int colons = 0, zone = 0;
    for (const char *q = a + 1; q < end; q++) {
      int ch = (unsigned char)*q;
      if (zone) {
        if (!dt__cluster_alnum(ch) && ch != '_' && ch != '.' && ch != '-') zone = -1;
      } else if (ch == '%' && q > a + 1 && q + 1 < end) {
        zone = 1;
      } else if (ch == ':') {
        colons++;
      } else if (!dt__cluster_hex(ch) && ch != '.') {
        zone = -1;
      }
      if (zone < 0) break;
    }
    if (zone < 0 || colons < 2) {
      snprintf(why, cap, "has a bad IPv6 address between [ and ]");
      return 0;
    }
    port = end + 2;
  } else {
    const char *colon = NULL;
    for (const char *q = a; q < a + n; q++)
      if (*q == ':') {
        if (colon) {
          snprintf(why, cap, "has more than one ':' (write an IPv6 address as [v6]:port)");
          return 0;
        }
        colon = q;
      }
    if (!colon) {
      snprintf(why, cap, "expected host:port");
      return 0;
    }
    if (colon == a) {
      snprintf(why, cap, "has no host before ':'");
      return 0;
    }
    for (const char *q = a; q < colon; q++) {
      int ch = (unsigned char)*q;
      if (!dt__cluster_alnum(ch) && ch != '.' && ch != '-' && ch != '_') {
        snprintf(why, cap, "has a character not allowed in a host name (byte 0x%02x)", (unsigned)ch);
        return 0;
      }
    }
    port = colon + 1;
  }
  size_t pl = (size_t)(a + n - port);
  long v = 0;
  if (pl == 0 || pl > 5) {
    snprintf(why, cap, pl == 0 ? "has no port after ':'" : "has a port out of range (0..65535)");
    return 0;
  }
  for (size_t i = 0; i < pl; i++) {
    if (port[i] < '0' || port[i] > '9') {
      snprintf(why, cap, "has a port that is not a number");
      return 0;
    }
    v = v * 10 + (port[i] - '0');
  }
  if (v > 65535) {
    snprintf(why, cap, "has a port out of range (0..65535)");
    return 0;
  }
  return 1;
}

/* Addresses equal ignoring ASCII case (host names and hex digits). */
static int dt__cluster_same(const char *a, const char *b) {
  for (;; a++, b++) {
    int x = (unsigned char)*a, y = (unsigned char)*b;
    if (x >= 'A' && x <= 'Z') x += 'a' - 'A';
    if (y >= 'A' && y <= 'Z') y += 'a' - 'A';
    if (x != y) return 0;
    if (!x) return 1;
  }
}

static const char *dt__cluster_role_name(dt_role r) { return r == DTRAIN_ROLE_PS ? "ps" : "worker"; }

/* Everything a dt_cluster promises: counts, addresses, no duplicates, this
 * process inside it. src names the origin in messages. */
static dt_result dt__cluster_check(const dt_cluster *c, const char *src) {
  char why[96];
  if (c->workers < 1 || c->workers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d workers (need 1..%d)", src, c->workers, DTRAIN_MAX_PEERS);
  if (c->servers < 0 || c->servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d parameter servers (need 0..%d)", src, c->servers, DTRAIN_MAX_PEERS);
  if (!c->worker_addr || (c->servers > 0 && !c->server_addr))
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: address array is NULL", src);
  int total = c->workers + c->servers;
  for (int k = 0; k < total; k++) {
    dt_role r = k < c->workers ? DTRAIN_ROLE_WORKER : DTRAIN_ROLE_PS;
    int i = k < c->workers ? k : k - c->workers;
    const char *a = r == DTRAIN_ROLE_WORKER ? c->worker_addr[i] : c->server_addr[i];
    if (!a) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s %d has no address", src, dt__cluster_role_name(r), i);
    if (!dt__cluster_addr_ok(a, strlen(a), why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s %d address '%.*s' %s", src, dt__cluster_role_name(r), i,
                       DT__CLUSTER_ADDR_MAX, a, why);
    for (int m = 0; m < k; m++) {
      dt_role r2 = m < c->workers ? DTRAIN_ROLE_WORKER : DTRAIN_ROLE_PS;
      int j = m < c->workers ? m : m - c->workers;
      const char *b = r2 == DTRAIN_ROLE_WORKER ? c->worker_addr[j] : c->server_addr[j];
      if (dt__cluster_same(a, b))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s %d and %s %d have the same address '%.*s'", src,
                         dt__cluster_role_name(r2), j, dt__cluster_role_name(r), i, DT__CLUSTER_ADDR_MAX, a);
    }
  }
  if (c->role != DTRAIN_ROLE_WORKER && c->role != DTRAIN_ROLE_PS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: role %d is neither worker nor ps", src, (int)c->role);
  int limit = c->role == DTRAIN_ROLE_PS ? c->servers : c->workers;
  if (c->index < 0 || c->index >= limit)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: task %s %d is out of range (the cluster has %d %s%s)", src,
                     dt__cluster_role_name(c->role), c->index, limit,
                     c->role == DTRAIN_ROLE_PS ? "parameter server" : "worker", limit == 1 ? "" : "s");
  return DTRAIN_OK;
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* What the walk over the parsed text found (node ids into the reader's values). */
typedef struct dt__cluster_doc {
  const dt__json *j;
  const char *src;      /* origin for messages */
  int32_t list[2];      /* the "worker" and "ps" arrays (-1: absent) */
  int count[2];         /* addresses per role */
  size_t str_bytes;     /* string bytes the addresses need */
  int have_cluster, have_task, have_type, have_index;
  dt_role role;
  int index;
} dt__cluster_doc;

/* What this file expects as the value of member `key` (a key's id) of
 * object `in`, or as an element of array `in` (key -1); NULL: any value.
 * The walk's type checks and a value the reader found missing or malformed
 * there both say it ("expected an address string ..."). A container's own
 * key is the value just before it (dt_json.h). */
static const char *dt__cluster_want(const dt__json *j, int32_t in, int32_t key) {
  int32_t up = j->v[in].parent;
  if (in == 0) {
    if (dt__json_eq(j, key, "cluster")) return "'{' (the \"cluster\" object)";
    if (dt__json_eq(j, key, "task")) return "'{' (the \"task\" object)";
  } else if (up == 0 && j->v[in].type == DT__JSON_OBJ && dt__json_eq(j, in - 1, "cluster")) {
    if (dt__json_eq(j, key, "worker") || dt__json_eq(j, key, "ps")) return "'['";
  } else if (up == 0 && j->v[in].type == DT__JSON_OBJ && dt__json_eq(j, in - 1, "task")) {
    if (dt__json_eq(j, key, "type")) return "a string (task type \"worker\" or \"ps\")";
    if (dt__json_eq(j, key, "index")) return "a number (task index)";
  } else if (up > 0 && j->v[in].type == DT__JSON_ARR && j->v[up].parent == 0 && dt__json_eq(j, up - 1, "cluster") &&
             (dt__json_eq(j, in - 1, "worker") || dt__json_eq(j, in - 1, "ps"))) {
    return "an address string \"host:port\"";
  }
  return NULL;
}

/* "<src>: byte N: expected <what>, found <what is there>", the reader's style. */
static dt_result dt__cluster_expected_at(const dt__json *j, const char *src, size_t pos, const char *what) {
  char f[16];
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: expected %s, found %s", src, pos, what,
                   dt__json_found(j->s, j->n, pos, f, sizeof f));
}

/* Value val (member key of object in, or an element of array in when key is -1) is not what dt__cluster_want says. */
static dt_result dt__cluster_expected(const dt__cluster_doc *d, int32_t in, int32_t key, int32_t val) {
  return dt__cluster_expected_at(d->j, d->src, d->j->v[val].pos, dt__cluster_want(d->j, in, key));
}

static dt_result dt__cluster_dup_key(const dt__cluster_doc *d, int32_t key) {
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: duplicate key \"%s\"", d->src, d->j->v[key].pos,
                   dt__json_str(d->j, key));
}

/* "worker": [...] or "ps": [...]: every address checked and counted. */
static dt_result dt__cluster_list(dt__cluster_doc *d, int32_t arr, dt_role role) {
  const dt__json *j = d->j;
  int r = (int)role;
  if (j->v[arr].type != DT__JSON_ARR) return dt__cluster_expected(d, j->v[arr].parent, arr - 1, arr);
  d->list[r] = arr;
  for (int32_t e = j->v[arr].child; e >= 0; e = j->v[e].next) {
    char why[96];
    if (j->v[e].type != DT__JSON_STR) return dt__cluster_expected(d, arr, -1, e);
    const char *a = dt__json_str(j, e);
    size_t len = j->v[e].len;
    if (d->count[r] >= DTRAIN_MAX_PEERS)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: more than %d %s addresses", d->src, j->v[e].pos,
                       DTRAIN_MAX_PEERS, dt__cluster_role_name(role));
    if (!dt__cluster_addr_ok(a, len, why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: %s %d address '%.*s' %s", d->src, j->v[e].pos,
                       dt__cluster_role_name(role), d->count[r], 64, a, why);
    d->str_bytes += len + 1;
    d->count[r]++;
  }
  return DTRAIN_OK;
}

/* The members of object obj, key and value, in order. */
#define DT__CLUSTER_MEMBERS(j, obj, k, val) \
  for (int32_t k = (j)->v[obj].child, val = k >= 0 ? (j)->v[k].next : -1; k >= 0; \
       k = (j)->v[val].next, val = k >= 0 ? (j)->v[k].next : -1)

static dt_result dt__cluster_cluster_obj(dt__cluster_doc *d, int32_t obj) {
  dt_result rc = DTRAIN_OK;
  int have[2] = {0, 0};
  DT__CLUSTER_MEMBERS(d->j, obj, k, val) {
    int which = dt__json_eq(d->j, k, "worker") ? 0 : dt__json_eq(d->j, k, "ps") ? 1 : -1;
    if (which < 0) continue; /* other jobs ("chief", ...) are not ours */
    if (have[which]) return dt__cluster_dup_key(d, k);
    have[which] = 1;
    if ((rc = dt__cluster_list(d, val, which ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER)) != DTRAIN_OK) return rc;
  }
  return rc;
}

static dt_result dt__cluster_task_obj(dt__cluster_doc *d, int32_t obj) {
  const dt__json *j = d->j;
  DT__CLUSTER_MEMBERS(j, obj, k, val) {
    if (dt__json_eq(j, k, "type")) {
      if (d->have_type) return dt__cluster_dup_key(d, k);
      d->have_type = 1;
      if (j->v[val].type != DT__JSON_STR) return dt__cluster_expected(d, obj, k, val);
      if (dt__json_eq(j, val, "worker")) {
        d->role = DTRAIN_ROLE_WORKER;
      } else if (dt__json_eq(j, val, "ps")) {
        d->role = DTRAIN_ROLE_PS;
      } else {
        return dt__error(DTRAIN_ERR_INVALID_ARG,
                         "%s: byte %zu: task type \"%.*s\" is not supported (expected \"worker\" or \"ps\")", d->src,
                         j->v[val].pos, 15, dt__json_str(j, val));
      }
    } else if (dt__json_eq(j, k, "index")) {
      if (d->have_index) return dt__cluster_dup_key(d, k);
      d->have_index = 1;
      if (j->v[val].type != DT__JSON_NUM) return dt__cluster_expected(d, obj, k, val);
      /* An integer in 0..INT_MAX; "-0" is 0 (the JSON grammar allows it). */
      uint64_t v = 0;
      const dt__json_val *x = &j->v[val];
      int minus_zero = x->len == 2 && memcmp(j->s + x->off, "-0", 2) == 0;
      if (!minus_zero && (!dt__json_uint(j, val, &v) || v > (uint64_t)INT_MAX))
        return dt__cluster_expected_at(j, d->src, x->pos, "a non-negative integer (task index)");
      d->index = (int)v;
    }
  }
  return DTRAIN_OK;
}

static dt_result dt__cluster_top(dt__cluster_doc *d) {
  const dt__json *j = d->j;
  dt_result rc = DTRAIN_OK;
  DT__CLUSTER_MEMBERS(j, 0, k, val) {
    if (dt__json_eq(j, k, "cluster")) {
      if (d->have_cluster) return dt__cluster_dup_key(d, k);
      d->have_cluster = 1;
      if (j->v[val].type != DT__JSON_OBJ) return dt__cluster_expected(d, 0, k, val);
      rc = dt__cluster_cluster_obj(d, val);
    } else if (dt__json_eq(j, k, "task")) {
      if (d->have_task) return dt__cluster_dup_key(d, k);
      d->have_task = 1;
      if (j->v[val].type != DT__JSON_OBJ) return dt__cluster_expected(d, 0, k, val);
      rc = dt__cluster_task_obj(d, val);
    }
    if (rc != DTRAIN_OK) return rc;
  }
  if (!d->have_cluster) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"cluster\"", d->src);
  if (!d->have_task) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"task\"", d->src);
  if (!d->have_type) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"type\" in \"task\"", d->src);
  if (!d->have_index) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"index\" in \"task\"", d->src);
  if (d->count[0] == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: \"cluster\" lists no \"worker\" addresses", d->src);
  return DTRAIN_OK;
}

/* The whole text is checked by the shared reader first (dt_json.c), then
 * the values are walked for the keys this file knows. */
static dt_result dt__cluster_parse(const char *json, const char *src, dt_cluster **out) {
  const unsigned char *s = (const unsigned char *)json;
  size_t n = strlen(json), i = 0;
  char f[16];
  while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
  if (i >= n || s[i] != '{')
    return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: expected '{' (a JSON object), found %s", src, i,
                     dt__json_found(s, n, i, f, sizeof f));
  dt__json j;
  dt_result rc;
  if (!dt__json_parse(&j, json, n, DT__CLUSTER_MAX_DEPTH, 1)) {
    /* No value where this file wants a particular one: say which. */
    const char *want = NULL;
    if (j.err_value && j.err_in >= 0)
      want = dt__cluster_want(&j, j.err_in, j.v[j.err_in].type == DT__JSON_OBJ ? (int32_t)j.nv - 1 : -1);
    if (want)
      rc = dt__cluster_expected_at(&j, src, j.err_pos, want);
    else
      rc = dt__error(j.nomem ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_FORMAT, "%s: %s", src, j.err);
    dt__json_free(&j);
    return rc;
  }
  dt__cluster_doc d;
  memset(&d, 0, sizeof d);
  d.j = &j;
  d.src = src;
  d.list[0] = d.list[1] = -1;
  rc = dt__cluster_top(&d);
  dt_cluster *c = NULL;
  if (rc == DTRAIN_OK) {
    char *strs;
    c = dt__cluster_new(d.count[0], d.count[1], d.str_bytes, &strs);
    if (!c) rc = DTRAIN_ERR_NOMEM;
    for (int r = 0; c && r < 2; r++) {
      char **slots = r ? c->server_addr : c->worker_addr;
      int k = 0;
      for (int32_t e = d.list[r] >= 0 ? j.v[d.list[r]].child : -1; e >= 0; e = j.v[e].next)
        dt__cluster_put(&slots[k++], &strs, dt__json_str(&j, e), j.v[e].len);
    }
  }
  if (c) {
    c->role = d.role;
    c->index = d.index;
    rc = dt__cluster_check(c, src);
  }
  dt__json_free(&j);
  if (rc != DTRAIN_OK) {
    dt_cluster_destroy(c);
    return rc;
  }
  *out = c;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_cluster_parse_json(const char *json, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_parse_json: out is NULL");
  *out = NULL;
  if (!json) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_parse_json: json is NULL");
  return dt__cluster_parse(json, "cluster JSON", out);
}

/* quiet: NOT_FOUND without an error message (for dt_cluster_discover). */
static dt_result dt__cluster_env(dt_cluster **out, int quiet) {
  const char *e = getenv("DTRAIN_CONFIG");
  if (!e || !*e) {
    if (quiet) return DTRAIN_ERR_NOT_FOUND;
    return dt__error(DTRAIN_ERR_NOT_FOUND, "dt_cluster_from_env: DTRAIN_CONFIG is not set");
  }
  return dt__cluster_parse(e, "DTRAIN_CONFIG", out);
}

DTRAIN_API dt_result dt_cluster_from_env(dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_env: out is NULL");
  *out = NULL;
  return dt__cluster_env(out, 0);
}

/* ---- flags ---------------------------------------------------------------------------------- */

enum { DT__CF_RANK, DT__CF_WORLD, DT__CF_PEERS, DT__CF_PS, DT__CF_ROLE, DT__CF_PORT, DT__CF_N };
static const char *const dt__cluster_flags[DT__CF_N] = {"--rank", "--world", "--peers", "--ps", "--role", "--port"};

/* A whole decimal number in 0..max, or -1. */
static long dt__cluster_uint(const char *s, long max) {
  long v = 0;
  if (!*s) return -1;
  for (; *s; s++) {
    if (*s < '0' || *s > '9') return -1;
    v = v * 10 + (*s - '0');
    if (v > max) return -1;
  }
  return v;
}

/* Validate a comma-separated address list; *n items, *bytes string bytes. */
static dt_result dt__cluster_csv(const char *flag, const char *list, int *n, size_t *bytes) {
  char why[96];
  *n = 0;
  *bytes = 0;
  for (const char *s = list;;) {
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    if (!dt__cluster_addr_ok(s, len, why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: address %d '%.*s' %s", flag, *n,
                       (int)(len < 64 ? len : 64), s, why);
    if (++*n > DTRAIN_MAX_PEERS) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: more than %d addresses", flag, DTRAIN_MAX_PEERS);
    *bytes += len + 1;
    if (!e) return DTRAIN_OK;
    s = e + 1;
  }
}

static void dt__cluster_csv_fill(char **slots, char **strs, const char *list) {
  for (int k = 0;; k++) {
    const char *e = strchr(list, ',');
    size_t len = e ? (size_t)(e - list) : strlen(list);
    dt__cluster_put(&slots[k], strs, list, len);
    if (!e) return;
    list = e + 1;
  }
}

static dt_result dt__cluster_args(int *argc, char **argv, dt_cluster **out, int quiet) {
  const char *val[DT__CF_N] = {NULL, NULL, NULL, NULL, NULL, NULL};
  int at[DT__CF_N][2]; /* argv slots used by each flag (-1: none) */
  int any = 0, n = *argc;
  for (int f = 0; f < DT__CF_N; f++) at[f][0] = at[f][1] = -1;
  for (int k = 1; k < n && argv[k]; k++) {
    const char *a = argv[k];
    if (strcmp(a, "--") == 0) break; /* the rest belongs to the program */
    for (int f = 0; f < DT__CF_N; f++) {
      size_t fl = strlen(dt__cluster_flags[f]);
      if (strncmp(a, dt__cluster_flags[f], fl) != 0 || (a[fl] != '\0' && a[fl] != '=')) continue;
      if (val[f]) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: %s given twice", dt__cluster_flags[f]);
      at[f][0] = k;
      if (a[fl] == '=') {
        val[f] = a + fl + 1;
      } else {
        if (k + 1 >= n || !argv[k + 1])
          return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: %s needs a value", dt__cluster_flags[f]);
        val[f] = argv[++k];
        at[f][1] = k;
      }
      if (f != DT__CF_PORT) any = 1;
      break;
    }
  }
  if (!any) {
    if (quiet) return DTRAIN_ERR_NOT_FOUND;
    return dt__error(DTRAIN_ERR_NOT_FOUND, "dt_cluster_from_args: none of --rank --world --peers --ps --role given");
  }

  /* Check the values. */
  long rank = -1, world = -1, port = DT__CLUSTER_DEFAULT_PORT, nps = -1;
  dt_role role = DTRAIN_ROLE_WORKER;
  int nw = 0, ns = 0;
  size_t wbytes = 0, sbytes = 0;
  dt_result rc;
  if (!val[DT__CF_RANK]) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --rank is missing");
  if ((rank = dt__cluster_uint(val[DT__CF_RANK], DTRAIN_MAX_PEERS)) < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --rank '%.32s' is not a number in 0..%d",
                     val[DT__CF_RANK], DTRAIN_MAX_PEERS);
  if (val[DT__CF_WORLD] && (world = dt__cluster_uint(val[DT__CF_WORLD], DTRAIN_MAX_PEERS)) < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --world '%.32s' is not a number in 1..%d",
                     val[DT__CF_WORLD], DTRAIN_MAX_PEERS);
  if (val[DT__CF_ROLE]) {
    if (strcmp(val[DT__CF_ROLE], "worker") == 0)
      role = DTRAIN_ROLE_WORKER;
    else if (strcmp(val[DT__CF_ROLE], "ps") == 0)
      role = DTRAIN_ROLE_PS;
    else
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --role '%.32s' is not worker or ps", val[DT__CF_ROLE]);
  }
  if (val[DT__CF_PORT] && (port = dt__cluster_uint(val[DT__CF_PORT], 65535)) < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --port '%.32s' is not a number in 0..65535",
                     val[DT__CF_PORT]);
  if (val[DT__CF_PEERS]) {
    if (val[DT__CF_PORT])
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --port applies to --world without --peers");
    if ((rc = dt__cluster_csv("--peers", val[DT__CF_PEERS], &nw, &wbytes)) != DTRAIN_OK) return rc;
    if (world >= 0 && world != nw)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --world %ld but --peers lists %d address%s", world, nw,
                       nw == 1 ? "" : "es");
  } else {
    if (world < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: need --peers or --world");
    nw = (int)world;
    wbytes = (size_t)nw * 16;
  }
  if (val[DT__CF_PS]) {
    const char *s = val[DT__CF_PS];
    if (!strchr(s, ':') && (nps = dt__cluster_uint(s, DTRAIN_MAX_PEERS)) >= 0) {
      /* --ps M: M servers on 127.0.0.1 after the workers' ports */
      if (val[DT__CF_PEERS])
        return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --ps %ld (a count) needs --world instead of --peers; "
                         "with --peers, list the servers' addresses", nps);
      ns = (int)nps;
      sbytes = (size_t)ns * 16;
    } else if ((rc = dt__cluster_csv("--ps", s, &ns, &sbytes)) != DTRAIN_OK) {
      return rc;
    }
  }
  if (!val[DT__CF_PEERS] && port + nw + ns - 1 > 65535)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: ports %ld..%ld go past 65535", port, port + nw + ns - 1);

  char *strs;
  dt_cluster *c = dt__cluster_new(nw, ns, wbytes + sbytes, &strs);
  if (!c) return DTRAIN_ERR_NOMEM;
  if (val[DT__CF_PEERS]) {
    dt__cluster_csv_fill(c->worker_addr, &strs, val[DT__CF_PEERS]);
  } else {
    for (int k = 0; k < nw; k++) {
      char a[16];
      int len = snprintf(a, sizeof a, "127.0.0.1:%ld", port + k);
      dt__cluster_put(&c->worker_addr[k], &strs, a, (size_t)len);
    }
  }
  if (nps >= 0) {
    for (int k = 0; k < ns; k++) {
      char a[16];
      int len = snprintf(a, sizeof a, "127.0.0.1:%ld", port + nw + k);
      dt__cluster_put(&c->server_addr[k], &strs, a, (size_t)len);
    }
  } else if (ns > 0) {
    dt__cluster_csv_fill(c->server_addr, &strs, val[DT__CF_PS]);
  }
  c->role = role;
  c->index = (int)rank;
  if ((rc = dt__cluster_check(c, "cluster flags")) != DTRAIN_OK) {
    dt_cluster_destroy(c);
    return rc;
  }

  /* Remove the used flags, keeping the order of the rest. */
  int w = 1;
  for (int k = 1; k < n; k++) {
    int used = 0;
    for (int f = 0; f < DT__CF_N; f++) used |= (at[f][0] == k || at[f][1] == k);
    if (!used) argv[w++] = argv[k];
  }
  if (w < n) argv[w] = NULL;
  *argc = w;
  *out = c;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_cluster_from_args(int *argc, char **argv, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_args: out is NULL");
  *out = NULL;
  if (!argc || !argv) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_args: argc or argv is NULL");
  return dt__cluster_args(argc, argv, out, 0);
}

DTRAIN_API dt_result dt_cluster_discover(int *argc, char **argv, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_discover: out is NULL");
  *out = NULL;
  dt_result rc = DTRAIN_ERR_NOT_FOUND;
  if (argc && argv) rc = dt__cluster_args(argc, argv, out, 1);
  if (rc == DTRAIN_ERR_NOT_FOUND) rc = dt__cluster_env(out, 1);
  if (rc != DTRAIN_ERR_NOT_FOUND) return rc;
  static const char one[] = "127.0.0.1:0";
  char *strs;
  dt_cluster *c = dt__cluster_new(1, 0, sizeof one, &strs);
  if (!c) return DTRAIN_ERR_NOMEM;
  dt__cluster_put(&c->worker_addr[0], &strs, one, sizeof one - 1);
  c->role = DTRAIN_ROLE_WORKER;
  c->index = 0;
  *out = c;
  return DTRAIN_OK;
}

/* ---- copies and text ---------------------------------------------------------------------------- */

DTRAIN_API dt_cluster *dt_cluster_clone(const dt_cluster *c) {
  if (!c) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_clone: cluster is NULL");
    return NULL;
  }
  if (dt__cluster_check(c, "dt_cluster_clone") != DTRAIN_OK) return NULL;
  size_t bytes = 0;
  for (int k = 0; k < c->workers; k++) bytes += strlen(c->worker_addr[k]) + 1;
  for (int k = 0; k < c->servers; k++) bytes += strlen(c->server_addr[k]) + 1;
  char *strs;
  dt_cluster *d = dt__cluster_new(c->workers, c->servers, bytes, &strs);
  if (!d) return NULL;
  for (int k = 0; k < c->workers; k++) dt__cluster_put(&d->worker_addr[k], &strs, c->worker_addr[k], strlen(c->worker_addr[k]));
  for (int k = 0; k < c->servers; k++) dt__cluster_put(&d->server_addr[k], &strs, c->server_addr[k], strlen(c->server_addr[k]));
  d->role = c->role;
  d->index = c->index;
  return d;
}

DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap) {
  if (!buf || cap == 0) return buf;
  const char *addr = NULL;
  if (c && role == DTRAIN_ROLE_WORKER && index >= 0 && index < c->workers && c->worker_addr) addr = c->worker_addr[index];
  if (c && role == DTRAIN_ROLE_PS && index >= 0 && index < c->servers && c->server_addr) addr = c->server_addr[index];
  if (addr)
    snprintf(buf, cap, "%s %d (%s)", dt__cluster_role_name(role), index, addr);
  else
    snprintf(buf, cap, "%s %d", dt__cluster_role_name(role), index);
  return buf;
}

typedef struct dt__cluster_out {
  char *buf;
  size_t cap, n; /* n: bytes the whole text needs (without NUL) */
} dt__cluster_out;

static void dt__cluster_w(dt__cluster_out *o, const char *s, size_t len) {
  for (size_t k = 0; k < len; k++, o->n++)
    if (o->n + 1 < o->cap) o->buf[o->n] = s[k];
}
static void dt__cluster_wstr(dt__cluster_out *o, const char *s) { dt__cluster_w(o, s, strlen(s)); }

static void dt__cluster_wq(dt__cluster_out *o, const char *s) {
  static const char hx[] = "0123456789abcdef";
  dt__cluster_w(o, "\"", 1);
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') {
      char e[2] = {'\\', (char)ch};
      dt__cluster_w(o, e, 2);
    } else if (ch < 0x20) {
      char e[6] = {'\\', 'u', '0', '0', hx[ch >> 4], hx[ch & 15]};
      dt__cluster_w(o, e, 6);
    } else {
      dt__cluster_w(o, (const char *)&ch, 1);
    }
  }
  dt__cluster_w(o, "\"", 1);
}

static void dt__cluster_wlist(dt__cluster_out *o, char **a, int n) {
  dt__cluster_w(o, "[", 1);
  for (int k = 0; k < n; k++) {
    if (k) dt__cluster_w(o, ",", 1);
    dt__cluster_wq(o, a[k]);
  }
  dt__cluster_w(o, "]", 1);
}

DTRAIN_API dt_result dt_cluster_to_json(const dt_cluster *c, char *buf, size_t cap) {
  if (!c || (!buf && cap > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_to_json: cluster or buf is NULL");
  if (cap > 0) buf[0] = '\0';
  dt_result rc = dt__cluster_check(c, "dt_cluster_to_json");
  if (rc != DTRAIN_OK) return rc;
  dt__cluster_out o;
  char num[16];
  o.buf = buf;
  o.cap = cap;
  o.n = 0;
  dt__cluster_wstr(&o, "{\"cluster\":{\"worker\":");
  dt__cluster_wlist(&o, c->worker_addr, c->workers);
  dt__cluster_wstr(&o, ",\"ps\":");
  dt__cluster_wlist(&o, c->server_addr, c->servers);
  dt__cluster_wstr(&o, "},\"task\":{\"type\":\"");
  dt__cluster_wstr(&o, dt__cluster_role_name(c->role));
  snprintf(num, sizeof num, "%d", c->index);
  dt__cluster_wstr(&o, "\",\"index\":");
  dt__cluster_wstr(&o, num);
  dt__cluster_wstr(&o, "}}");
  if (o.n + 1 > cap) {
    if (cap > 0) buf[0] = '\0';
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_cluster_to_json: the text needs %zu bytes, buffer has %zu", o.n + 1, cap);
  }
  buf[o.n] = '\0';
  return DTRAIN_OK;
}

#undef DT__CLUSTER_MAX_DEPTH
#undef DT__CLUSTER_MEMBERS
#undef DT__CLUSTER_ADDR_MAX
#undef DT__CLUSTER_DEFAULT_PORT
/* ======== end dt_cluster.c ======== */

/* ======== begin dt_net_core.h ======== */
/* ===========================================================================
 * dt_net_core.h -- private: the TCP transport shared by the communicator and
 * the parameter servers (frames, sockets with deadlines, handshake, HMAC)
 * ===========================================================================
 * The wire format is written down in docs/wire_protocol.md; this is its one
 * implementation. Everything here is DTRAIN_PRIVATE.
 *
 * Frame: a 40-byte little-endian header, then `length` payload bytes.
 *
 *   off size field
 *    0   4   magic     0x4E525444 ("DTRN" as bytes 44 54 52 4E)
 *    4   2   version   DTRAIN_NET_VERSION
 *    6   2   type      DT__MSG_*
 *    8   8   job       job id; frames of another job are refused
 *   16   4   sender    the sender's id (dt__net_id: workers 0.., servers 0x10000+i)
 *   20   4   flags     bit 0: the checksum also covers the payload
 *   24   8   seq       per connection and direction, from 0, +1 per frame
 *   32   4   length    payload bytes (capped by the receiver before reading)
 *   36   4   checksum  CRC-32C of bytes 0..35 (and the payload when flags bit 0)
 *
 * Control frames (types below 0x40) always carry flags bit 0; bulk data
 * frames (0x40 and up) leave payload integrity to TCP, as checksumming
 * gigabytes per second would cost more than the transfer.
 */
#ifndef DTRAIN_NET_CORE_H
#define DTRAIN_NET_CORE_H

/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_net.h" (amalgamated) */

#define DT__NET_MAGIC 0x4E525444u
#define DT__NET_HDR 40
#define DT__NET_F_PAYLOAD_CRC 1u
#define DT__NET_SERVER_ID0 0x10000u /* sender id of server 0 */
#define DT__NET_NONCE 32
#define DT__NET_ADDR 96

/* Message types. 0x01..0x3f: control (the transport's own); 0x40..: data,
 * owned by the backends (0x40..0x4f the communicator, 0x50..0x6f the
 * parameter servers). */
enum {
  DT__MSG_HELLO = 0x01,     /* connector -> acceptor: dt__hello */
  DT__MSG_WELCOME = 0x02,   /* acceptor -> connector: dt__hello */
  DT__MSG_AUTH = 0x03,      /* 32-byte HMAC-SHA256 proof */
  DT__MSG_READY = 0x04,     /* acceptor -> connector: handshake complete */
  DT__MSG_REFUSE = 0x05,    /* u32 code (dt_result, negated), then UTF-8 reason */
  DT__MSG_ABORT = 0x06,     /* u32 code, then UTF-8 reason: the sender's run failed */
  DT__MSG_HEARTBEAT = 0x07, /* empty */
  DT__MSG_BYE = 0x08,       /* empty: orderly close */
  DT__MSG_DATA0 = 0x40      /* first backend type */
};

typedef struct dt__frame {
  uint32_t magic;
  uint16_t version, type;
  uint64_t job;
  uint32_t sender, flags;
  uint64_t seq;
  uint32_t length, checksum;
} dt__frame;

/* ---- checksums and authentication --------------------------------------------------- */
DTRAIN_PRIVATE uint32_t dt__crc32c(uint32_t crc, const void *p, size_t n);
typedef struct dt__sha256 {
  uint32_t h[8];
  uint64_t len;
  unsigned char buf[64];
  size_t fill;
} dt__sha256;
DTRAIN_PRIVATE void dt__sha256_init(dt__sha256 *s);
DTRAIN_PRIVATE void dt__sha256_update(dt__sha256 *s, const void *p, size_t n);
DTRAIN_PRIVATE void dt__sha256_final(dt__sha256 *s, unsigned char out[32]);
DTRAIN_PRIVATE void dt__hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen, unsigned char out[32]);
/* Constant-time comparison: 1 when equal. */
DTRAIN_PRIVATE int dt__net_ct_equal(const unsigned char *a, const unsigned char *b, size_t n);

/* ---- frames ----------------------------------------------------------------------------- */
DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length);
/* Decode and check a header: magic, version, header checksum, job (unless
 * job is 0), length <= max_payload. DTRAIN_ERR_PROTOCOL (or _MISMATCH for a
 * wrong job/version) with the reason in why (never NULL; cap >= 1). */
DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap);
/* 1 when the payload matches the checksum (or the frame does not cover it). */
DTRAIN_PRIVATE int dt__frame_payload_ok(const unsigned char h[DT__NET_HDR], const dt__frame *f, const void *payload);

#ifndef DTRAIN_NO_NET /* the socket layer exists only with networking */
/* ---- sockets ------------------------------------------------------------------------------
 * Every socket is non-blocking; every call takes an absolute deadline
 * (dt__now() seconds) and returns DTRAIN_ERR_TIMEOUT past it. EINTR is
 * retried; SIGPIPE never raised. Messages are set with dt__error. */
/* "host:port" or "[v6]:port" -> host and port strings. */
DTRAIN_PRIVATE dt_result dt__net_split(const char *hostport, char *host, size_t hcap, char *port, size_t pcap);
DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd);
DTRAIN_PRIVATE int dt__net_port(int fd); /* the bound port, -1 on error */
/* Connect, retrying refused/unreachable with backoff (10 ms doubling to 0.5 s) until the deadline. */
DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd);
/* Wait for one connection; *fd gets it, addr (may be NULL) the peer's "host:port". */
DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd, char *addr, size_t cap);
DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline);
DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline);
/* The same, but when nothing has arrived it polls the socket (yielding the
 * CPU between tries) for up to spin_s seconds before sleeping in poll(). */
DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s);
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes); /* SO_SNDBUF/SO_RCVBUF; <= 0: the kernel's */
DTRAIN_PRIVATE void dt__net_close(int fd);
/* Wait until fd is readable: 1 readable, 0 timed out (after `seconds`), -1 error. */
DTRAIN_PRIVATE int dt__net_poll_in(int fd, double seconds);

/* ---- connections: a socket plus both directions' sequence numbers ---------------------- */
typedef struct dt__conn {
  int fd;
  uint64_t job;
  uint32_t self_id;      /* our sender id */
  uint32_t max_payload;
  double spin_s;         /* receiving here (dt__conn_recv_header, exchanges), spin this long
                            before sleeping in poll() (0: never) */
  uint64_t send_seq, recv_seq;
  int peer_role;         /* dt_role, -1 before the handshake */
  int peer_index;
  int lane;              /* 0, or 1: a 2-worker collective's second connection (hello offset 28) */
  char peer[DT__NET_ADDR]; /* "worker 1 (127.0.0.1:7001)" */
} dt__conn;

DTRAIN_PRIVATE void dt__conn_init(dt__conn *c, int fd, uint64_t job, uint32_t self_id, uint32_t max_payload);
/* Send one frame (header + payload, gathered). op names the operation for
 * errors: "worker 0: allreduce #12: send to worker 1 (127.0.0.1:7001): connection reset". */
DTRAIN_PRIVATE dt_result dt__conn_send(dt__conn *c, uint16_t type, const void *payload, uint32_t n, double deadline,
                                       const char *op);
/* Receive one frame's header (checked: sequence number, sender when known)
 * into *f. ABORT and REFUSE frames are read whole and turned into
 * DTRAIN_ERR_PEER / the refusal's code with the peer's reason. Then the
 * caller reads f->length payload bytes with dt__conn_recv_payload (which
 * checks the payload checksum when the frame carries one). */
DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op);
DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op);
/* Header + payload into buf (cap bytes); a frame of another type or longer
 * than cap is DTRAIN_ERR_PROTOCOL. *len (may be NULL) gets the length. */
DTRAIN_PRIVATE dt_result dt__conn_recv(dt__conn *c, uint16_t type, void *buf, uint32_t cap, uint32_t *len,
                                       double deadline, const char *op);
/* Send a frame to `to` while receiving one of `type` from `from` (possibly
 * the same connection), progressing both as the sockets allow, so two peers
 * exchanging in a ring never deadlock on full socket buffers. The received
 * payload must be exactly rn bytes, from the peer the connection belongs to.
 * When neither side can move it spins for from->spin_s, then polls. */
DTRAIN_PRIVATE dt_result dt__conn_exchange(dt__conn *to, uint16_t stype, const void *sbuf, uint32_t sn, dt__conn *from,
                                           uint16_t rtype, void *rbuf, uint32_t rn, double deadline, const char *op);
/* Best effort, short deadline: tell the peer our run failed (code + text). */
DTRAIN_PRIVATE void dt__conn_abort(dt__conn *c, dt_result code, const char *reason);
DTRAIN_PRIVATE void dt__conn_close(dt__conn *c);

#endif /* DTRAIN_NO_NET */

/* ---- who we are, and the handshake ----------------------------------------------------- */
typedef struct dt__net_self {
  const dt_cluster *cluster;
  dt_net_options opt;    /* with defaults filled */
  uint64_t job;
  uint32_t id;           /* dt__net_id(role, index) */
} dt__net_self;

DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index);
/* Fill self from the cluster and options (NULL: defaults); job id from the
 * options or a hash of the cluster's addresses. */
DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o);
#ifndef DTRAIN_NO_NET
/* This process's listening socket: options.listen_fd, or bind its own address from the cluster. */
DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd);
/* Connector side: connect to (role, index) with retries until connect_timeout,
 * handshake; on success *c is ready. */
DTRAIN_PRIVATE dt_result dt__net_dial(const dt__net_self *self, dt_role role, int index, dt__conn *c);
/* The same, announcing `lane` in the hello (1: the second connection of a 2-worker collective). */
DTRAIN_PRIVATE dt_result dt__net_dial_lane(const dt__net_self *self, dt_role role, int index, int lane, dt__conn *c);
/* Acceptor side on a fresh connection fd (ownership passes to *c or the fd
 * is closed): check the peer's hello (version, job, world, servers, model
 * hash, a valid and -- unless allow_dup -- not yet `seen` id), authenticate,
 * and send READY. On refusal the peer gets a REFUSE frame naming both sides,
 * the reason is logged (unless opt.quiet) and returned; the caller keeps
 * serving others. `seen` (may be NULL): per-worker flags set on success. */
DTRAIN_PRIVATE dt_result dt__net_admit(const dt__net_self *self, int fd, const char *addr, double deadline,
                                       unsigned char *seen, dt__conn *c);
/* Read 32 bytes of randomness (/dev/urandom, else a hash of time and pid). */
DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n);
#endif /* DTRAIN_NO_NET */

/* Floats travel little-endian. On a little-endian host this is a no-op
 * (buffers go out as they are, no copy); on a big-endian one it swaps the
 * bytes of each float in place (the same call converts back). */
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#  define DT__NET_HOST_LE 0
#else
#  define DT__NET_HOST_LE 1
#endif
DTRAIN_PRIVATE void dt__net_f32_le(float *p, size_t n);

/* Little-endian helpers. */
DTRAIN_PRIVATE void dt__le32_put(unsigned char *p, uint32_t v);
DTRAIN_PRIVATE void dt__le64_put(unsigned char *p, uint64_t v);
DTRAIN_PRIVATE uint32_t dt__le32_get(const unsigned char *p);
DTRAIN_PRIVATE uint64_t dt__le64_get(const unsigned char *p);

#endif /* DTRAIN_NET_CORE_H */
/* ======== end dt_net_core.h ======== */

/* ======== begin dt_net.c ======== */
/* ===========================================================================
 * dt_net.c -- the TCP transport: CRC-32C, SHA-256/HMAC, frames, sockets with
 * deadlines, connections, the handshake (see dt_net_core.h and
 * docs/wire_protocol.md)
 * ===========================================================================
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_net_core.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

/* ---- little-endian helpers (used by the frame code, also without networking) -------- */

DTRAIN_PRIVATE void dt__le32_put(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
DTRAIN_PRIVATE void dt__le64_put(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
DTRAIN_PRIVATE uint32_t dt__le32_get(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
DTRAIN_PRIVATE uint64_t dt__le64_get(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
DTRAIN_PRIVATE void dt__net_f32_le(float *p, size_t n) {
#if DT__NET_HOST_LE
  (void)p;
  (void)n;
#else
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &p[i], 4);
    u = (u >> 24) | ((u >> 8) & 0xFF00u) | ((u << 8) & 0xFF0000u) | (u << 24);
    memcpy(&p[i], &u, 4);
  }
#endif
}

static uint16_t dt__net_le16_get(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---- CRC-32C (Castagnoli), four bits at a time: it only covers headers and control frames ---- */

/* dt__crc32c_nib[i]: the reflected polynomial 0x82F63B78 applied to the
 * four bits i (the bitwise loop's four steps folded into one lookup). */
static const uint32_t dt__crc32c_nib[16] = {0x00000000u, 0x105EC76Fu, 0x20BD8EDEu, 0x30E349B1u,
                                            0x417B1DBCu, 0x5125DAD3u, 0x61C69362u, 0x7198540Du,
                                            0x82F63B78u, 0x92A8FC17u, 0xA24BB5A6u, 0xB21572C9u,
                                            0xC38D26C4u, 0xD3D3E1ABu, 0xE330A81Au, 0xF36E6F75u};

DTRAIN_PRIVATE uint32_t dt__crc32c(uint32_t crc, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  crc = ~crc;
  for (size_t i = 0; i < n; i++) {
    crc ^= b[i];
    crc = (crc >> 4) ^ dt__crc32c_nib[crc & 15u];
    crc = (crc >> 4) ^ dt__crc32c_nib[crc & 15u];
  }
  return ~crc;
}

/* ---- SHA-256 (FIPS 180-4) and HMAC (RFC 2104) ---------------------------------------- */

static const uint32_t dt__sha256_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

static uint32_t dt__sha256_ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void dt__sha256_block(dt__sha256 *s, const unsigned char *p) {
  uint32_t w[64], a[8];
  for (int i = 0; i < 16; i++)
    w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = dt__sha256_ror(w[i - 15], 7) ^ dt__sha256_ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = dt__sha256_ror(w[i - 2], 17) ^ dt__sha256_ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(a, s->h, sizeof a);
  for (int i = 0; i < 64; i++) {
    uint32_t S1 = dt__sha256_ror(a[4], 6) ^ dt__sha256_ror(a[4], 11) ^ dt__sha256_ror(a[4], 25);
    uint32_t ch = (a[4] & a[5]) ^ (~a[4] & a[6]);
    uint32_t t1 = a[7] + S1 + ch + dt__sha256_k[i] + w[i];
    uint32_t S0 = dt__sha256_ror(a[0], 2) ^ dt__sha256_ror(a[0], 13) ^ dt__sha256_ror(a[0], 22);
    uint32_t maj = (a[0] & a[1]) ^ (a[0] & a[2]) ^ (a[1] & a[2]);
    uint32_t t2 = S0 + maj;
    memmove(a + 1, a, 7 * sizeof(uint32_t));
    a[4] += t1;
    a[0] = t1 + t2;
  }
  for (int i = 0; i < 8; i++) s->h[i] += a[i];
}

DTRAIN_PRIVATE void dt__sha256_init(dt__sha256 *s) {
  static const uint32_t h0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
  memcpy(s->h, h0, sizeof h0);
  s->len = 0;
  s->fill = 0;
}

DTRAIN_PRIVATE void dt__sha256_update(dt__sha256 *s, const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  s->len += (uint64_t)n;
  while (n > 0) {
    size_t take = 64 - s->fill < n ? 64 - s->fill : n;
    memcpy(s->buf + s->fill, p, take);
    s->fill += take;
    p += take;
    n -= take;
    if (s->fill == 64) {
      dt__sha256_block(s, s->buf);
      s->fill = 0;
    }
  }
}

DTRAIN_PRIVATE void dt__sha256_final(dt__sha256 *s, unsigned char out[32]) {
  uint64_t bits = s->len * 8;
  unsigned char pad = 0x80, zero = 0, lenb[8];
  dt__sha256_update(s, &pad, 1);
  while (s->fill != 56) dt__sha256_update(s, &zero, 1);
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)(bits >> (56 - 8 * i));
  dt__sha256_update(s, lenb, 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (unsigned char)(s->h[i] >> 24);
    out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
    out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
    out[4 * i + 3] = (unsigned char)s->h[i];
  }
}

DTRAIN_PRIVATE void dt__hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen, unsigned char out[32]) {
  unsigned char k[64], pad[64], inner[32];
  dt__sha256 s;
  memset(k, 0, sizeof k);
  if (klen > 64) {
    dt__sha256_init(&s);
    dt__sha256_update(&s, key, klen);
    dt__sha256_final(&s, k);
  } else if (klen > 0) {
    memcpy(k, key, klen);
  }
  for (int i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x36);
  dt__sha256_init(&s);
  dt__sha256_update(&s, pad, 64);
  dt__sha256_update(&s, msg, mlen);
  dt__sha256_final(&s, inner);
  for (int i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x5c);
  dt__sha256_init(&s);
  dt__sha256_update(&s, pad, 64);
  dt__sha256_update(&s, inner, 32);
  dt__sha256_final(&s, out);
}

DTRAIN_PRIVATE int dt__net_ct_equal(const unsigned char *a, const unsigned char *b, size_t n) {
  unsigned d = 0;
  for (size_t i = 0; i < n; i++) d |= (unsigned)(a[i] ^ b[i]);
  return d == 0;
}

/* ---- frames -------------------------------------------------------------------------------- */

DTRAIN_PRIVATE void dt__frame_pack(unsigned char h[DT__NET_HDR], uint16_t type, uint64_t job, uint32_t sender,
                                   uint64_t seq, const void *payload, uint32_t length) {
  uint32_t flags = type < DT__MSG_DATA0 ? DT__NET_F_PAYLOAD_CRC : 0u;
  dt__le32_put(h, DT__NET_MAGIC);
  h[4] = (unsigned char)(DTRAIN_NET_VERSION & 0xFF);
  h[5] = (unsigned char)(DTRAIN_NET_VERSION >> 8);
  h[6] = (unsigned char)(type & 0xFF);
  h[7] = (unsigned char)(type >> 8);
  dt__le64_put(h + 8, job);
  dt__le32_put(h + 16, sender);
  dt__le32_put(h + 20, flags);
  dt__le64_put(h + 24, seq);
  dt__le32_put(h + 32, length);
  uint32_t crc = dt__crc32c(0, h, 36);
  if ((flags & DT__NET_F_PAYLOAD_CRC) && length > 0 && payload) crc = dt__crc32c(crc, payload, length);
  dt__le32_put(h + 36, crc);
}

DTRAIN_PRIVATE dt_result dt__frame_unpack(const unsigned char h[DT__NET_HDR], uint64_t job, uint32_t max_payload,
                                          dt__frame *f, char *why, size_t cap) {
  memset(f, 0, sizeof *f);
  why[0] = '\0';
  f->magic = dt__le32_get(h);
  if (f->magic != DT__NET_MAGIC) {
    /* Say what it looks like: a stray HTTP client or TLS is common. */
    const char *kind = (memcmp(h, "GET ", 4) == 0 || memcmp(h, "POST", 4) == 0 || memcmp(h, "HEAD", 4) == 0 ||
                        memcmp(h, "PUT ", 4) == 0)
                           ? " (an HTTP request?)"
                       : (h[0] == 0x16 && h[1] == 0x03) ? " (a TLS handshake?)"
                                                        : "";
    snprintf(why, cap, "bad magic 0x%08x, not a dtrain frame%s", (unsigned)f->magic, kind);
    return DTRAIN_ERR_PROTOCOL;
  }
  f->version = dt__net_le16_get(h + 4);
  f->type = dt__net_le16_get(h + 6);
  f->job = dt__le64_get(h + 8);
  f->sender = dt__le32_get(h + 16);
  f->flags = dt__le32_get(h + 20);
  f->seq = dt__le64_get(h + 24);
  f->length = dt__le32_get(h + 32);
  f->checksum = dt__le32_get(h + 36);
  uint32_t crc = dt__crc32c(0, h, 36);
  int covers = (f->flags & DT__NET_F_PAYLOAD_CRC) != 0;
  if (!covers && crc != f->checksum) {
    snprintf(why, cap, "header checksum mismatch (0x%08x, computed 0x%08x)", (unsigned)f->checksum, (unsigned)crc);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->version != DTRAIN_NET_VERSION) {
    snprintf(why, cap, "protocol version %u, this build speaks %d", (unsigned)f->version, DTRAIN_NET_VERSION);
    return DTRAIN_ERR_MISMATCH;
  }
  if ((f->flags & ~DT__NET_F_PAYLOAD_CRC) != 0) {
    snprintf(why, cap, "unknown flags 0x%x", (unsigned)f->flags);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type < DT__MSG_DATA0 && !covers) {
    snprintf(why, cap, "control frame (type %u) without a payload checksum", (unsigned)f->type);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type == 0 || (f->type > DT__MSG_BYE && f->type < DT__MSG_DATA0)) {
    snprintf(why, cap, "unknown frame type %u", (unsigned)f->type);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->type < DT__MSG_DATA0 && f->length > 4096) {
    snprintf(why, cap, "control frame (type %u) of %u bytes (at most 4096)", (unsigned)f->type, (unsigned)f->length);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (f->length > max_payload) {
    snprintf(why, cap, "frame length %u exceeds the limit of %u bytes", (unsigned)f->length, (unsigned)max_payload);
    return DTRAIN_ERR_PROTOCOL;
  }
  if (job != 0 && f->job != job) {
    snprintf(why, cap, "frame of job %016llx, this is job %016llx", (unsigned long long)f->job,
             (unsigned long long)job);
    return DTRAIN_ERR_MISMATCH;
  }
  /* A covered header's checksum is checked with the payload (dt__frame_payload_ok). */
  return DTRAIN_OK;
}

DTRAIN_PRIVATE int dt__frame_payload_ok(const unsigned char h[DT__NET_HDR], const dt__frame *f, const void *payload) {
  uint32_t crc = dt__crc32c(0, h, 36);
  if (f->flags & DT__NET_F_PAYLOAD_CRC) {
    if (f->length > 0) crc = dt__crc32c(crc, payload, f->length);
  }
  return crc == f->checksum;
}

DTRAIN_PRIVATE uint32_t dt__net_id(dt_role role, int index) {
  return role == DTRAIN_ROLE_PS ? DT__NET_SERVER_ID0 + (uint32_t)index : (uint32_t)index;
}

#ifndef DTRAIN_NO_NET
/* ============================================================================================
 * Sockets (POSIX)
 * ============================================================================================ */
#  include <errno.h>
#  include <fcntl.h>
#  include <netdb.h>
#  include <netinet/in.h>
#  include <netinet/tcp.h>
#  include <poll.h>
#  include <sched.h>
#  include <sys/socket.h>
#  include <sys/types.h>
#  include <sys/uio.h>
#  include <unistd.h>
#  include <arpa/inet.h>

#  ifdef MSG_NOSIGNAL
#    define DT__NET_SEND_FLAGS MSG_NOSIGNAL
#  else
#    define DT__NET_SEND_FLAGS 0
#  endif

DTRAIN_PRIVATE dt_result dt__net_split(const char *hostport, char *host, size_t hcap, char *port, size_t pcap) {
  if (!hostport || !*hostport) return dt__error(DTRAIN_ERR_INVALID_ARG, "address is empty");
  const char *colon, *hs = hostport, *he;
  if (hostport[0] == '[') {
    he = strchr(hostport, ']');
    if (!he || he[1] != ':') return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': expected [v6]:port", hostport);
    hs = hostport + 1;
    colon = he + 1;
  } else {
    colon = strrchr(hostport, ':');
    if (!colon) return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': expected host:port", hostport);
    he = colon;
  }
  size_t hl = (size_t)(he - hs), pl = strlen(colon + 1);
  if (hl == 0 || hl >= hcap || pl == 0 || pl >= pcap)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': bad host or port", hostport);
  for (size_t i = 0; i < pl; i++)
    if (colon[1 + i] < '0' || colon[1 + i] > '9')
      return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': port is not a number", hostport);
  memcpy(host, hs, hl);
  host[hl] = '\0';
  memcpy(port, colon + 1, pl + 1);
  if (atol(port) > 65535) return dt__error(DTRAIN_ERR_INVALID_ARG, "address '%s': port out of range", hostport);
  return DTRAIN_OK;
}

static void dt__net_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static void dt__net_tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
#  ifdef SO_NOSIGPIPE
  setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#  endif
  dt__net_nonblock(fd);
}

/* SO_SNDBUF/SO_RCVBUF of a connected socket (bytes <= 0: left to the kernel).
 * Best effort: the kernel caps the sizes, and a refusal changes nothing. */
DTRAIN_PRIVATE void dt__net_set_bufs(int fd, int64_t bytes) {
  if (fd < 0 || bytes <= 0) return;
  int b = bytes > (int64_t)(1 << 30) ? (1 << 30) : (int)bytes;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
}

static dt_result dt__net_resolve(const char *hostport, int passive, struct addrinfo **res) {
  char host[256], port[16];
  dt_result rc = dt__net_split(hostport, host, sizeof host, port, sizeof port);
  if (rc != DTRAIN_OK) return rc;
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  int e = getaddrinfo(host, port, &hints, res);
  if (e != 0) return dt__error(DTRAIN_ERR_NET, "cannot resolve '%s': %s", hostport, gai_strerror(e));
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_listen(const char *hostport, int *fd_out) {
  struct addrinfo *res = NULL;
  *fd_out = -1;
  dt_result rc = dt__net_resolve(hostport, 1, &res);
  if (rc != DTRAIN_OK) return rc;
  int err = 0;
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      dt__net_nonblock(fd);
      freeaddrinfo(res);
      *fd_out = fd;
      return DTRAIN_OK;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  return dt__error(DTRAIN_ERR_NET, "cannot listen on %s: %s", hostport, strerror(err));
}

DTRAIN_PRIVATE int dt__net_port(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return -1;
}

/* poll one fd for `events` until the deadline: 1 ready, 0 timeout, -1 error (errno). */
static int dt__net_wait(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - dt__now();
    if (left <= 0) return 0;
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    int ms = left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
    int n = poll(&p, 1, ms);
    if (n > 0) return 1;
    if (n < 0 && errno != EINTR) return -1;
  }
}

DTRAIN_PRIVATE int dt__net_poll_in(int fd, double seconds) {
  int r = dt__net_wait(fd, POLLIN, dt__now() + seconds);
  return r;
}

/* 1 when a connected socket's two ends are the same address: nobody listened
 * on the port and the kernel happened to pick that very port for our end, so
 * TCP's simultaneous open connected the socket to itself (possible whenever a
 * peer's port lies in the ephemeral range and we dial before it listens). */
static int dt__net_self_connected(int fd) {
  struct sockaddr_storage a, b;
  socklen_t la = sizeof a, lb = sizeof b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  if (getsockname(fd, (struct sockaddr *)&a, &la) != 0 || getpeername(fd, (struct sockaddr *)&b, &lb) != 0) return 0;
  if (la != lb || a.ss_family != b.ss_family) return 0;
  if (a.ss_family == AF_INET) {
    const struct sockaddr_in *x = (const struct sockaddr_in *)&a, *y = (const struct sockaddr_in *)&b;
    return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)&a, *y = (const struct sockaddr_in6 *)&b;
    return x->sin6_port == y->sin6_port && memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) == 0;
  }
  return 0;
}

DTRAIN_PRIVATE dt_result dt__net_connect(const char *hostport, double deadline, int *fd_out) {
  double backoff = 0.01;
  int err = 0;
  *fd_out = -1;
  for (;;) {
    struct addrinfo *res = NULL;
    dt_result rc = dt__net_resolve(hostport, 0, &res);
    if (rc != DTRAIN_OK) return rc;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
      int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) {
        err = errno;
        continue;
      }
      dt__net_tune(fd);
      int r = connect(fd, a->ai_addr, a->ai_addrlen);
      if (r != 0 && (errno == EINPROGRESS || errno == EINTR)) {
        int w = dt__net_wait(fd, POLLOUT, deadline);
        if (w == 1) {
          int so = 0;
          socklen_t sl = sizeof so;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
          if (so == 0) r = 0;
          else errno = so;
        } else if (w == 0) {
          errno = ETIMEDOUT;
        }
      }
      if (r == 0 && dt__net_self_connected(fd)) {
        r = -1; /* talking to ourselves: as good as refused, retry */
        errno = ECONNREFUSED;
      }
      if (r == 0) {
        freeaddrinfo(res);
        *fd_out = fd;
        return DTRAIN_OK;
      }
      err = errno;
      close(fd);
    }
    freeaddrinfo(res);
    double now = dt__now();
    if (now + backoff > deadline)
      return dt__error(DTRAIN_ERR_TIMEOUT, "cannot connect to %s before the deadline: %s", hostport,
                       strerror(err ? err : ETIMEDOUT));
    dt__sleep(backoff);
    backoff = backoff * 2 > 0.5 ? 0.5 : backoff * 2;
  }
}

static void dt__net_addr_text(const struct sockaddr_storage *ss, char *out, size_t cap) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    snprintf(out, cap, "%s:%d", host, port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    snprintf(out, cap, "[%s]:%d", host, port);
  } else {
    snprintf(out, cap, "unknown address");
  }
}

DTRAIN_PRIVATE dt_result dt__net_accept(int lfd, double deadline, int *fd_out, char *addr, size_t cap) {
  *fd_out = -1;
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int fd = accept(lfd, (struct sockaddr *)&ss, &len);
    if (fd >= 0) {
      dt__net_tune(fd);
      if (addr) dt__net_addr_text(&ss, addr, cap);
      *fd_out = fd;
      return DTRAIN_OK;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return dt__error(DTRAIN_ERR_NET, "accept: %s", strerror(errno));
    int w = dt__net_wait(lfd, POLLIN, deadline);
    if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "accept: no connection before the deadline");
    if (w < 0) return dt__error(DTRAIN_ERR_NET, "accept: poll: %s", strerror(errno));
  }
}

DTRAIN_PRIVATE dt_result dt__net_write(int fd, const void *p, size_t n, double deadline) {
  const unsigned char *b = (const unsigned char *)p;
  while (n > 0) {
    ssize_t k = send(fd, b, n, DT__NET_SEND_FLAGS);
    if (k > 0) {
      b += k;
      n -= (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int w = dt__net_wait(fd, POLLOUT, deadline);
      if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "send timed out (the peer stopped reading)");
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "send failed: %s", k < 0 ? strerror(errno) : "connection closed");
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_read(int fd, void *p, size_t n, double deadline) {
  return dt__net_read_spin(fd, p, n, deadline, 0.0);
}

DTRAIN_PRIVATE dt_result dt__net_read_spin(int fd, void *p, size_t n, double deadline, double spin_s) {
  unsigned char *b = (unsigned char *)p;
  double spin_until = -1.0;
  while (n > 0) {
    ssize_t k = recv(fd, b, n, 0);
    if (k > 0) {
      b += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0) return dt__error(DTRAIN_ERR_PEER, "connection closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (spin_s > 0) {
        /* A reply due within microseconds: try again (giving the CPU away
         * in between) before sleeping in poll(), whose wake-up costs more. */
        double t = dt__now();
        if (spin_until < 0) spin_until = DT__MIN(t + spin_s, deadline);
        if (t < spin_until) {
          sched_yield();
          continue;
        }
      }
      int w = dt__net_wait(fd, POLLIN, deadline);
      if (w == 0) return dt__error(DTRAIN_ERR_TIMEOUT, "receive timed out (the peer sent nothing before the deadline)");
      if (w < 0) return dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      continue;
    }
    return dt__error(DTRAIN_ERR_PEER, "receive failed: %s", strerror(errno));
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__net_close(int fd) {
  if (fd >= 0) close(fd);
}

DTRAIN_PRIVATE void dt__net_random(unsigned char *out, size_t n) {
  size_t got = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    while (got < n) {
      ssize_t k = read(fd, out + got, n - got);
      if (k > 0) got += (size_t)k;
      else if (k < 0 && errno == EINTR) continue;
      else break;
    }
    close(fd);
  }
  if (got < n) {
    /* No /dev/urandom: a hash of the time, the pid and a counter (weaker, documented). */
    static DT__ATOMIC(uint64_t) counter;
    unsigned char seed[32];
    double t = dt__now();
    uint64_t pid = (uint64_t)getpid(), c = DT__AFETCH_ADD(&counter, (uint64_t)1, DT__MO_RELAXED);
    memcpy(seed, &t, sizeof t);
    memcpy(seed + 8, &pid, 8);
    memcpy(seed + 16, &c, 8);
    memset(seed + 24, 0x5a, 8);
    for (size_t off = got; off < n; off += 32) {
      unsigned char h[32];
      dt__sha256 s;
      dt__sha256_init(&s);
      dt__sha256_update(&s, seed, sizeof seed);
      dt__sha256_update(&s, &off, sizeof off);
      dt__sha256_final(&s, h);
      memcpy(out + off, h, n - off < 32 ? n - off : 32);
    }
  }
}

/* ============================================================================================
 * Connections
 * ============================================================================================ */

DTRAIN_PRIVATE void dt__conn_init(dt__conn *c, int fd, uint64_t job, uint32_t self_id, uint32_t max_payload) {
  memset(c, 0, sizeof *c);
  c->fd = fd;
  c->job = job;
  c->self_id = self_id;
  c->max_payload = max_payload;
  c->peer_role = -1;
  c->peer_index = -1;
  c->lane = 0;
  snprintf(c->peer, sizeof c->peer, "an unidentified peer");
}

/* Rewrites the thread's last error as "<op>: <verb> <peer>: <detail>". */
static dt_result dt__conn_fail(dt__conn *c, dt_result rc, const char *op, const char *verb) {
  char detail[DT__MSG_CAP];
  snprintf(detail, sizeof detail, "%s", dt_last_error());
  return dt__error(rc, "%s: %s %s: %s", op ? op : "tcp", verb, c->peer, detail);
}

DTRAIN_PRIVATE dt_result dt__conn_send(dt__conn *c, uint16_t type, const void *payload, uint32_t n, double deadline,
                                       const char *op) {
  unsigned char h[DT__NET_HDR];
  dt__frame_pack(h, type, c->job, c->self_id, c->send_seq, payload, n);
  /* Header and payload in one gathered send when the socket takes it all. */
  struct iovec iov[2];
  iov[0].iov_base = h;
  iov[0].iov_len = DT__NET_HDR;
  iov[1].iov_base = (void *)(uintptr_t)payload;
  iov[1].iov_len = payload ? n : 0;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = iov;
  mh.msg_iovlen = 2;
  size_t total = DT__NET_HDR + (size_t)(payload ? n : 0);
  ssize_t k;
  do {
    k = sendmsg(c->fd, &mh, DT__NET_SEND_FLAGS);
  } while (k < 0 && errno == EINTR);
  if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    dt__error(DTRAIN_ERR_PEER, "send failed: %s", strerror(errno));
    return dt__conn_fail(c, DTRAIN_ERR_PEER, op, "send to");
  }
  size_t sent = k > 0 ? (size_t)k : 0;
  dt_result rc = DTRAIN_OK;
  if (sent < DT__NET_HDR) rc = dt__net_write(c->fd, h + sent, DT__NET_HDR - sent, deadline);
  if (rc == DTRAIN_OK && sent < total) {
    size_t po = sent > DT__NET_HDR ? sent - DT__NET_HDR : 0;
    rc = dt__net_write(c->fd, (const unsigned char *)payload + po, n - po, deadline);
  }
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "send to");
  c->send_seq++;
  return DTRAIN_OK;
}

/* An ABORT or REFUSE frame's payload: u32 code, then text. */
static dt_result dt__conn_read_notice(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                      double deadline, const char *op) {
  char text[DT__MSG_CAP];
  unsigned char buf[512];
  uint32_t n = f->length;
  if (n > sizeof buf) {
    dt__error(DTRAIN_ERR_PROTOCOL, "notice of %u bytes", (unsigned)n);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  dt_result rc = dt__net_read(c->fd, buf, n, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  if (!dt__frame_payload_ok(h, f, buf) || n < 4) {
    dt__error(DTRAIN_ERR_PROTOCOL, "corrupt %s frame", f->type == DT__MSG_ABORT ? "abort" : "refusal");
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  uint32_t code = dt__le32_get(buf);
  size_t tl = n - 4 < sizeof text - 1 ? n - 4 : sizeof text - 1;
  memcpy(text, buf + 4, tl);
  text[tl] = '\0';
  for (size_t i = 0; i < tl; i++)
    if ((unsigned char)text[i] < 0x20) text[i] = ' ';
  c->recv_seq++;
  dt_result their = (dt_result)(-(int32_t)code);
  if (f->type == DT__MSG_ABORT)
    return dt__error(DTRAIN_ERR_PEER, "%s: %s aborted: %s", op ? op : "tcp", c->peer, text);
  if (their != DTRAIN_ERR_AUTH && their != DTRAIN_ERR_MISMATCH && their != DTRAIN_ERR_PROTOCOL) their = DTRAIN_ERR_NET;
  return dt__error(their, "%s: refused by %s: %s", op ? op : "tcp", c->peer, text);
}

/* A received header, decoded into *f and checked against the connection:
 * magic/version/checksum/job/length (dt__frame_unpack), the next sequence
 * number, the sender the handshake established; an ABORT or REFUSE frame is
 * read whole and becomes the peer's error. */
static dt_result dt__conn_header_ok(dt__conn *c, const unsigned char h[DT__NET_HDR], dt__frame *f, double deadline,
                                    const char *op) {
  char why[160];
  dt_result rc = dt__frame_unpack(h, c->job, c->max_payload, f, why, sizeof why);
  if (rc != DTRAIN_OK) {
    dt__error(rc, "%s", why);
    return dt__conn_fail(c, rc, op, "receive from");
  }
  if (f->seq != c->recv_seq) {
    dt__error(DTRAIN_ERR_PROTOCOL, "sequence number %llu, expected %llu", (unsigned long long)f->seq,
              (unsigned long long)c->recv_seq);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  if (c->peer_role >= 0 && f->sender != dt__net_id((dt_role)c->peer_role, c->peer_index)) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame claims sender %u", (unsigned)f->sender);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  if (f->type == DT__MSG_ABORT || f->type == DT__MSG_REFUSE) return dt__conn_read_notice(c, f, h, deadline, op);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_recv_header(dt__conn *c, dt__frame *f, unsigned char h[DT__NET_HDR], double deadline,
                                              const char *op) {
  dt_result rc = dt__net_read_spin(c->fd, h, DT__NET_HDR, deadline, c->spin_s);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  return dt__conn_header_ok(c, h, f, deadline, op);
}

DTRAIN_PRIVATE dt_result dt__conn_recv_payload(dt__conn *c, const dt__frame *f, const unsigned char h[DT__NET_HDR],
                                               void *buf, double deadline, const char *op) {
  dt_result rc = dt__net_read(c->fd, buf, f->length, deadline);
  if (rc != DTRAIN_OK) return dt__conn_fail(c, rc, op, "receive from");
  if (!dt__frame_payload_ok(h, f, buf)) {
    dt__error(DTRAIN_ERR_PROTOCOL, "checksum mismatch in a frame of type %u", (unsigned)f->type);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  c->recv_seq++;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_recv(dt__conn *c, uint16_t type, void *buf, uint32_t cap, uint32_t *len,
                                       double deadline, const char *op) {
  dt__frame f;
  unsigned char h[DT__NET_HDR];
  dt_result rc = dt__conn_recv_header(c, &f, h, deadline, op);
  if (rc != DTRAIN_OK) return rc;
  if (f.type != type || f.length > cap) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame of type %u and %u bytes, expected type %u and at most %u bytes",
              (unsigned)f.type, (unsigned)f.length, (unsigned)type, (unsigned)cap);
    return dt__conn_fail(c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  rc = dt__conn_recv_payload(c, &f, h, buf, deadline, op);
  if (rc == DTRAIN_OK && len) *len = f.length;
  return rc;
}

/* ---- frames moved piecewise on non-blocking sockets ------------------------------------
 * One frame in flight on a connection, moved as the socket allows: how
 * dt__conn_exchange keeps a send and a receive going at once. Start it with
 * dt__xfer_send / dt__xfer_recv (the buffers stay the caller's until it is
 * done); dt__xfer_step sends or receives what the socket takes without
 * blocking, sets *moved when bytes moved, checks a received header (as
 * dt__conn_recv_header, plus exactly the type and length expected) before any
 * payload, and bumps the connection's sequence number when the frame is
 * complete (active drops to 0). When nothing moved, dt__xfer_wait spins (the
 * receiving connection's spin_s, from *spin_until, which the caller resets to
 * -1 whenever bytes moved), then polls the active ones; past the deadline it
 * returns DTRAIN_ERR_TIMEOUT naming the stuck peer. */
typedef struct dt__xfer {
  dt__conn *c;
  unsigned char h[DT__NET_HDR];
  unsigned char *buf;
  uint32_t n;    /* payload bytes */
  uint16_t type; /* sent, or expected */
  int recv, active, checked;
  size_t done;   /* header + payload bytes moved */
} dt__xfer;

static void dt__xfer_send(dt__xfer *x, dt__conn *c, uint16_t type, const void *p, uint32_t n) {
  x->c = c;
  x->recv = 0;
  x->buf = (unsigned char *)(uintptr_t)p;
  x->n = n;
  x->type = type;
  x->done = 0;
  x->active = 1;
  x->checked = 0;
  dt__frame_pack(x->h, type, c->job, c->self_id, c->send_seq, p, n);
}

static void dt__xfer_recv(dt__xfer *x, dt__conn *c, uint16_t type, void *p, uint32_t n) {
  x->c = c;
  x->recv = 1;
  x->buf = (unsigned char *)p;
  x->n = n;
  x->type = type;
  x->done = 0;
  x->active = 1;
  x->checked = 0;
}

/* The header of a frame being received, checked before a byte of payload is read. */
static dt_result dt__xfer_check(dt__xfer *x, double deadline, const char *op) {
  dt__frame f;
  dt_result rc = dt__conn_header_ok(x->c, x->h, &f, deadline, op);
  if (rc != DTRAIN_OK) return rc;
  if (f.type != x->type || f.length != x->n) {
    dt__error(DTRAIN_ERR_PROTOCOL, "frame of type %u and %u bytes, expected type %u and %u bytes", (unsigned)f.type,
              (unsigned)f.length, (unsigned)x->type, (unsigned)x->n);
    return dt__conn_fail(x->c, DTRAIN_ERR_PROTOCOL, op, "receive from");
  }
  x->checked = 1;
  return DTRAIN_OK;
}

static dt_result dt__xfer_step(dt__xfer *x, double deadline, const char *op, int *moved) {
  if (!x->active) return DTRAIN_OK;
  size_t total = DT__NET_HDR + (size_t)x->n;
  ssize_t k;
  if (!x->recv) {
    struct iovec iov[2];
    int cnt = 0;
    if (x->done < DT__NET_HDR) {
      iov[cnt].iov_base = x->h + x->done;
      iov[cnt].iov_len = DT__NET_HDR - x->done;
      cnt++;
    }
    if (x->n) {
      size_t po = x->done > DT__NET_HDR ? x->done - DT__NET_HDR : 0;
      iov[cnt].iov_base = x->buf + po;
      iov[cnt].iov_len = x->n - po;
      cnt++;
    }
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)cnt;
    k = sendmsg(x->c->fd, &mh, DT__NET_SEND_FLAGS);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "send failed: %s", strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "send to");
    }
  } else {
    unsigned char *dst = x->done < DT__NET_HDR ? x->h + x->done : x->buf + (x->done - DT__NET_HDR);
    size_t want = x->done < DT__NET_HDR ? DT__NET_HDR - x->done : total - x->done;
    k = recv(x->c->fd, dst, want, 0);
    if (k == 0) {
      dt__error(DTRAIN_ERR_PEER, "connection closed by the peer");
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      dt__error(DTRAIN_ERR_PEER, "receive failed: %s", strerror(errno));
      return dt__conn_fail(x->c, DTRAIN_ERR_PEER, op, "receive from");
    }
  }
  if (k <= 0) return DTRAIN_OK;
  x->done += (size_t)k;
  *moved = 1;
  if (x->recv && !x->checked && x->done >= DT__NET_HDR) {
    dt_result rc = dt__xfer_check(x, deadline, op);
    if (rc != DTRAIN_OK) return rc;
  }
  if (x->done == total) {
    x->active = 0;
    if (x->recv) x->c->recv_seq++;
    else x->c->send_seq++;
  }
  return DTRAIN_OK;
}

static dt_result dt__xfer_wait(dt__xfer *s, dt__xfer *r, double deadline, double *spin_until, const char *op) {
  double now = dt__now();
  double spin = r && r->active ? r->c->spin_s : s && s->active ? s->c->spin_s : 0.0;
  if (spin > 0) {
    /* As in dt__net_read_spin: the peer's next bytes are usually microseconds
     * away, and waking from poll() (on a VM, an idle vCPU that halted) costs
     * far more. spin_until is reset by the caller whenever data moved. */
    if (*spin_until < 0) *spin_until = DT__MIN(now + spin, deadline);
    if (now < *spin_until) {
      sched_yield();
      return DTRAIN_OK;
    }
  }
  double left = deadline - now;
  if (left <= 0) {
    int recv_stuck = r && r->active;
    dt__xfer *x = recv_stuck ? r : s;
    dt__error(DTRAIN_ERR_TIMEOUT, "%s", recv_stuck ? "nothing received before the deadline (the peer stalled?)"
                                                   : "send did not complete before the deadline");
    return dt__conn_fail(x->c, DTRAIN_ERR_TIMEOUT, op, recv_stuck ? "receive from" : "send to");
  }
  struct pollfd p[2];
  nfds_t np = 0;
  if (s && s->active) {
    p[np].fd = s->c->fd;
    p[np].events = POLLOUT;
    p[np].revents = 0;
    np++;
  }
  if (r && r->active) {
    p[np].fd = r->c->fd;
    p[np].events = POLLIN;
    p[np].revents = 0;
    np++;
  }
  int ms = left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
  if (poll(p, np, ms) < 0 && errno != EINTR) {
    dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
    return dt__conn_fail(r && r->active ? r->c : s->c, DTRAIN_ERR_NET, op, "exchange with");
  }
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__conn_exchange(dt__conn *to, uint16_t stype, const void *sbuf, uint32_t sn, dt__conn *from,
                                           uint16_t rtype, void *rbuf, uint32_t rn, double deadline, const char *op) {
  dt__xfer s, r;
  dt__xfer_send(&s, to, stype, sbuf, sn);
  dt__xfer_recv(&r, from, rtype, rbuf, rn);
  double spin_until = -1.0;
  dt_result rc = DTRAIN_OK;
  while (rc == DTRAIN_OK && (s.active || r.active)) {
    /* Progress without blocking, then wait for whichever side is stuck. */
    int moved = 0;
    rc = dt__xfer_step(&s, deadline, op, &moved);
    if (rc == DTRAIN_OK) rc = dt__xfer_step(&r, deadline, op, &moved);
    if (rc == DTRAIN_OK && !moved) rc = dt__xfer_wait(&s, &r, deadline, &spin_until, op);
    if (moved) spin_until = -1.0;
  }
  return rc;
}

DTRAIN_PRIVATE void dt__conn_abort(dt__conn *c, dt_result code, const char *reason) {
  if (!c || c->fd < 0) return;
  unsigned char buf[4 + 256];
  size_t tl = reason ? strlen(reason) : 0;
  if (tl > 256) tl = 256;
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
  if (tl) memcpy(buf + 4, reason, tl);
  /* Best effort within 0.2 s; the error it may raise is not this thread's news. */
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  dt__conn_send(c, DT__MSG_ABORT, buf, (uint32_t)(4 + tl), dt__now() + 0.2, "abort");
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

DTRAIN_PRIVATE void dt__conn_close(dt__conn *c) {
  if (!c) return;
  dt__net_close(c->fd);
  c->fd = -1;
}

/* ============================================================================================
 * The handshake
 * ============================================================================================
 * hello payload (little-endian, 128 bytes):
 *   0 u32 role   4 u32 index   8 u32 workers   12 u32 servers
 *  16 u64 model hash   24 u32 flags (bit 0: I have a token)
 *  28 u32 lane (0; 1: the second connection between the two workers of a
 *         2-worker collective, which carries one direction of the ring)
 *  32 nonce[32]   64 addr[64] (NUL-padded: the address the sender believes it has)
 * The proof (AUTH) is HMAC-SHA256(token, "dtrain-auth-1" | side byte ('C' or 'A') |
 * job (8) | connector hello (128) | acceptor hello (128)): it binds both nonces
 * and both identities, so a recorded proof cannot be replayed. */
#  define DT__HELLO 128
#  define DT__HELLO_F_TOKEN 1u

typedef struct dt__hello {
  uint32_t role, index, workers, servers;
  uint64_t model_hash;
  uint32_t flags;
  uint32_t lane;
  unsigned char nonce[DT__NET_NONCE];
  char addr[64];
} dt__hello;

static void dt__hello_pack(const dt__hello *h, unsigned char b[DT__HELLO]) {
  memset(b, 0, DT__HELLO);
  dt__le32_put(b, h->role);
  dt__le32_put(b + 4, h->index);
  dt__le32_put(b + 8, h->workers);
  dt__le32_put(b + 12, h->servers);
  dt__le64_put(b + 16, h->model_hash);
  dt__le32_put(b + 24, h->flags);
  dt__le32_put(b + 28, h->lane);
  memcpy(b + 32, h->nonce, DT__NET_NONCE);
  size_t al = strlen(h->addr);
  memcpy(b + 64, h->addr, al < 63 ? al : 63);
}

static void dt__hello_unpack(const unsigned char b[DT__HELLO], dt__hello *h) {
  h->role = dt__le32_get(b);
  h->index = dt__le32_get(b + 4);
  h->workers = dt__le32_get(b + 8);
  h->servers = dt__le32_get(b + 12);
  h->model_hash = dt__le64_get(b + 16);
  h->flags = dt__le32_get(b + 24);
  h->lane = dt__le32_get(b + 28);
  memcpy(h->nonce, b + 32, DT__NET_NONCE);
  memcpy(h->addr, b + 64, 63);
  h->addr[63] = '\0';
  for (int i = 0; i < 63 && h->addr[i]; i++)
    if ((unsigned char)h->addr[i] < 0x20 || (unsigned char)h->addr[i] > 0x7e) h->addr[i] = '?';
}

static const char *dt__net_role_name(uint32_t role) { return role == DTRAIN_ROLE_PS ? "ps" : "worker"; }

static void dt__hello_self(const dt__net_self *self, dt__hello *h) {
  const dt_cluster *c = self->cluster;
  memset(h, 0, sizeof *h);
  h->role = (uint32_t)c->role;
  h->index = (uint32_t)c->index;
  h->workers = (uint32_t)c->workers;
  h->servers = (uint32_t)c->servers;
  h->model_hash = self->opt.model_hash;
  h->flags = (self->opt.token && self->opt.token[0]) ? DT__HELLO_F_TOKEN : 0u;
  dt__net_random(h->nonce, DT__NET_NONCE);
  const char *a = c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index];
  snprintf(h->addr, sizeof h->addr, "%s", a ? a : "");
}

static void dt__net_proof(const dt__net_self *self, char side, const unsigned char conn_hello[DT__HELLO],
                          const unsigned char acc_hello[DT__HELLO], unsigned char out[32]) {
  unsigned char msg[14 + 1 + 8 + 2 * DT__HELLO];
  memcpy(msg, "dtrain-auth-1", 13);
  msg[13] = 0;
  msg[14] = (unsigned char)side;
  dt__le64_put(msg + 15, self->job);
  memcpy(msg + 23, conn_hello, DT__HELLO);
  memcpy(msg + 23 + DT__HELLO, acc_hello, DT__HELLO);
  dt__hmac_sha256(self->opt.token, strlen(self->opt.token), msg, sizeof msg, out);
}

static void dt__net_describe(const dt__hello *h, char *buf, size_t cap) {
  snprintf(buf, cap, "%s %u (%.63s)", dt__net_role_name(h->role), (unsigned)h->index, h->addr[0] ? h->addr : "?");
}

/* Compare the peer's hello with ours; "" when compatible, else the reason naming both. */
static void dt__net_compare(const dt__net_self *self, const dt__hello *me, const dt__hello *peer, char *why,
                            size_t cap) {
  char a[128], b[128];
  dt__net_describe(me, a, sizeof a);
  dt__net_describe(peer, b, sizeof b);
  why[0] = '\0';
  if (peer->role > 1) snprintf(why, cap, "%.100s claims an unknown role %u", b, (unsigned)peer->role);
  else if (peer->workers != me->workers || peer->servers != me->servers)
    snprintf(why, cap, "%.100s has a cluster of %u workers and %u servers, %.100s has %u and %u", b, (unsigned)peer->workers,
             (unsigned)peer->servers, a, (unsigned)me->workers, (unsigned)me->servers);
  else if ((peer->role == DTRAIN_ROLE_WORKER && peer->index >= (uint32_t)self->cluster->workers) ||
           (peer->role == DTRAIN_ROLE_PS && peer->index >= (uint32_t)self->cluster->servers))
    snprintf(why, cap, "%.100s has an index out of range", b);
  else if (peer->role == me->role && peer->index == me->index)
    snprintf(why, cap, "%.100s claims the same rank as %.100s (duplicate rank)", b, a);
  else if (self->opt.model_hash && peer->model_hash && peer->model_hash != self->opt.model_hash)
    snprintf(why, cap, "%.100s has model hash %016llx, %.100s has %016llx (different models)", b,
             (unsigned long long)peer->model_hash, a, (unsigned long long)self->opt.model_hash);
  else if (!!self->opt.model_hash != !!peer->model_hash)
    snprintf(why, cap, "%.100s %s a model hash, %.100s %s", b, peer->model_hash ? "sends" : "does not send", a,
             self->opt.model_hash ? "requires one" : "does not check one");
}

static void dt__net_refuse(dt__conn *c, dt_result code, const char *why, double deadline) {
  unsigned char buf[4 + 256];
  size_t tl = strlen(why);
  if (tl > 256) tl = 256;
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  dt__conn_send(c, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), deadline, "refuse");
  dt__error(code, "%s", keep);
}

DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o) {
  memset(self, 0, sizeof *self);
  if (!c) return dt__error(DTRAIN_ERR_NULL_ARG, "cluster is NULL");
  if (c->workers < 1 || c->servers < 0 || c->workers + c->servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster of %d workers and %d servers", c->workers, c->servers);
  if (c->index < 0 || c->index >= (c->role == DTRAIN_ROLE_PS ? c->servers : c->workers))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "this process's index %d is out of range for its role", c->index);
  self->cluster = c;
  dt_net_options d = dt_net_defaults();
  if (o) {
    if (o->timeout_s > 0) d.timeout_s = o->timeout_s;
    if (o->connect_timeout_s > 0) d.connect_timeout_s = o->connect_timeout_s;
    else if (o->timeout_s > 0) d.connect_timeout_s = o->timeout_s;
    if (o->token) d.token = o->token;
    if (o->job_id) d.job_id = o->job_id;
    d.model_hash = o->model_hash;
    if (o->listen_fd > 0) d.listen_fd = o->listen_fd;
    if (o->max_payload) d.max_payload = o->max_payload;
    if (o->chunk_bytes) d.chunk_bytes = o->chunk_bytes;
    if (o->spin_us != 0) d.spin_us = o->spin_us;
    if (o->sock_buf_bytes != 0) d.sock_buf_bytes = o->sock_buf_bytes;
    if (o->small_bytes) d.small_bytes = o->small_bytes;
    d.quiet = o->quiet;
  }
  if (d.max_payload > 0xFFFFFFF0u) d.max_payload = 0xFFFFFFF0u;
  self->opt = d;
  if (d.job_id) {
    self->job = d.job_id;
  } else {
    /* FNV-1a over every address: processes of the same cluster agree. */
    uint64_t h = 1469598103934665603ULL;
    for (int r = 0; r < c->workers + c->servers; r++) {
      const char *a = r < c->workers ? c->worker_addr[r] : c->server_addr[r - c->workers];
      for (const char *p = a; p && *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ULL;
      h = (h ^ 0xFF) * 1099511628211ULL;
    }
    self->job = h ? h : 1;
  }
  self->id = dt__net_id(c->role, c->index);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__net_self_listen(const dt__net_self *self, int *fd) {
  if (self->opt.listen_fd >= 0) {
    *fd = self->opt.listen_fd;
    dt__net_nonblock(*fd);
    return DTRAIN_OK;
  }
  const dt_cluster *c = self->cluster;
  return dt__net_listen(c->role == DTRAIN_ROLE_PS ? c->server_addr[c->index] : c->worker_addr[c->index], fd);
}

DTRAIN_PRIVATE dt_result dt__net_dial(const dt__net_self *self, dt_role role, int index, dt__conn *c) {
  return dt__net_dial_lane(self, role, index, 0, c);
}

DTRAIN_PRIVATE dt_result dt__net_dial_lane(const dt__net_self *self, dt_role role, int index, int lane, dt__conn *c) {
  const dt_cluster *cl = self->cluster;
  const char *addr = role == DTRAIN_ROLE_PS ? cl->server_addr[index] : cl->worker_addr[index];
  double start = dt__now(), deadline = start + self->opt.connect_timeout_s;
  char want[128];
  snprintf(want, sizeof want, "%s %d (%.100s)", dt__net_role_name((uint32_t)role), index, addr);
  int fd;
  dt_result rc = dt__net_connect(addr, deadline, &fd);
  if (rc != DTRAIN_OK) return dt__error(rc, "handshake with %s: %s", want, dt_last_error());
  dt__conn_init(c, fd, self->job, self->id, (uint32_t)self->opt.max_payload);
  snprintf(c->peer, sizeof c->peer, "%.95s", want);
  deadline = dt__now() + self->opt.timeout_s;
  dt__hello me, peer;
  unsigned char mine[DT__HELLO], theirs[DT__HELLO], proof[32], expect[32];
  dt__hello_self(self, &me);
  me.lane = (uint32_t)lane;
  dt__hello_pack(&me, mine);
  uint32_t len = 0;
  int have, they;
  char why[DT__MSG_CAP];
  rc = dt__conn_send(c, DT__MSG_HELLO, mine, DT__HELLO, deadline, "handshake");
  if (rc == DTRAIN_OK) rc = dt__conn_recv(c, DT__MSG_WELCOME, theirs, DT__HELLO, &len, deadline, "handshake");
  if (rc == DTRAIN_OK && len != DT__HELLO) rc = dt__error(DTRAIN_ERR_PROTOCOL, "handshake: short welcome from %s", want);
  if (rc != DTRAIN_OK) goto fail;
  dt__hello_unpack(theirs, &peer);
  dt__net_compare(self, &me, &peer, why, sizeof why);
  if (!why[0] && (peer.role != (uint32_t)role || peer.index != (uint32_t)index)) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s answered as %s", want, b);
  }
  if (why[0]) {
    rc = dt__error(DTRAIN_ERR_MISMATCH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_MISMATCH, why, deadline);
    goto fail;
  }
  c->peer_role = (int)role;
  c->peer_index = index;
  c->lane = lane;
  have = (me.flags & DT__HELLO_F_TOKEN) != 0;
  they = (peer.flags & DT__HELLO_F_TOKEN) != 0;
  if (have != they) {
    snprintf(why, sizeof why, "%s %s a token, %s %s", want, they ? "requires" : "does not use", "this worker",
             have ? "requires one" : "has none (set DTRAIN_TOKEN)");
    rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_AUTH, why, deadline);
    goto fail;
  }
  if (have) {
    dt__net_proof(self, 'C', mine, theirs, proof);
    rc = dt__conn_send(c, DT__MSG_AUTH, proof, 32, deadline, "handshake");
    if (rc == DTRAIN_OK) rc = dt__conn_recv(c, DT__MSG_AUTH, proof, 32, &len, deadline, "handshake");
    if (rc != DTRAIN_OK) goto fail;
    dt__net_proof(self, 'A', mine, theirs, expect);
    if (len != 32 || !dt__net_ct_equal(proof, expect, 32)) {
      rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s failed to prove it knows the token", want);
      dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication failed", deadline);
      goto fail;
    }
  }
  rc = dt__conn_recv(c, DT__MSG_READY, NULL, 0, &len, deadline, "handshake");
  if (rc != DTRAIN_OK) goto fail;
  return DTRAIN_OK;
fail:
  dt__conn_close(c);
  return rc;
}

DTRAIN_PRIVATE dt_result dt__net_admit(const dt__net_self *self, int fd, const char *addr, double deadline,
                                       unsigned char *seen, dt__conn *c) {
  dt__conn_init(c, fd, self->job, self->id, (uint32_t)self->opt.max_payload);
  snprintf(c->peer, sizeof c->peer, "a client at %.80s", addr ? addr : "?");
  dt__hello me, peer;
  unsigned char mine[DT__HELLO], theirs[DT__HELLO], proof[32], expect[32];
  uint32_t len = 0;
  int have, they;
  char why[DT__MSG_CAP];
  /* The hello is the first frame: a cap of one hello keeps strangers from making us allocate or read much. */
  uint32_t keep_max = c->max_payload;
  c->max_payload = DT__HELLO;
  dt_result rc = dt__conn_recv(c, DT__MSG_HELLO, theirs, DT__HELLO, &len, deadline, "handshake");
  c->max_payload = keep_max;
  if (rc == DTRAIN_OK && len != DT__HELLO) rc = dt__error(DTRAIN_ERR_PROTOCOL, "handshake: short hello from %s", c->peer);
  if (rc != DTRAIN_OK) {
    /* Garbage or a wrong version: answer once (best effort), so a confused client learns why. */
    snprintf(why, sizeof why, "%s", dt_last_error());
    if (rc == DTRAIN_ERR_PROTOCOL || rc == DTRAIN_ERR_MISMATCH) dt__net_refuse(c, rc, why, dt__now() + 0.2);
    goto refused;
  }
  dt__hello_unpack(theirs, &peer);
  dt__hello_self(self, &me);
  dt__hello_pack(&me, mine);
  dt__net_compare(self, &me, &peer, why, sizeof why);
  if (!why[0] && peer.lane > 1) {
    snprintf(why, sizeof why, "lane %u in the hello (only 0 and 1 exist)", (unsigned)peer.lane);
  } else if (!why[0] && peer.lane == 1 &&
             (peer.role != DTRAIN_ROLE_WORKER || me.role != DTRAIN_ROLE_WORKER || me.workers != 2)) {
    snprintf(why, sizeof why, "a second connection (lane 1) is only for the two workers of a 2-worker job");
  }
  if (!why[0] && seen && peer.role == DTRAIN_ROLE_WORKER && (seen[peer.index] & (1u << peer.lane))) {
    char b[128];
    dt__net_describe(&peer, b, sizeof b);
    snprintf(why, sizeof why, "%s is already connected (duplicate rank%s)", b, peer.lane ? ", lane 1" : "");
  }
  if (why[0]) {
    rc = dt__error(DTRAIN_ERR_MISMATCH, "handshake: %s", why);
    dt__net_refuse(c, DTRAIN_ERR_MISMATCH, why, deadline);
    goto refused;
  }
  dt__net_describe(&peer, c->peer, sizeof c->peer);
  c->peer_role = (int)peer.role;
  c->peer_index = (int)peer.index;
  c->lane = (int)peer.lane;
  rc = dt__conn_send(c, DT__MSG_WELCOME, mine, DT__HELLO, deadline, "handshake");
  if (rc != DTRAIN_OK) goto refused;
  have = (me.flags & DT__HELLO_F_TOKEN) != 0;
  they = (peer.flags & DT__HELLO_F_TOKEN) != 0;
  if (have != they) {
    /* The connector sees the same difference in our welcome and refuses; when
     * it has no token we refuse here too, so a peer without one never gets in. */
    rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s %s, this process %s", c->peer,
                   they ? "uses a token" : "has no token", have ? "requires one" : "has none");
    dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication required", deadline);
    goto refused;
  }
  if (have) {
    rc = dt__conn_recv(c, DT__MSG_AUTH, proof, 32, &len, deadline, "handshake");
    if (rc != DTRAIN_OK) goto refused;
    dt__net_proof(self, 'C', theirs, mine, expect);
    if (len != 32 || !dt__net_ct_equal(proof, expect, 32)) {
      rc = dt__error(DTRAIN_ERR_AUTH, "handshake: %s failed to prove it knows the token", c->peer);
      dt__net_refuse(c, DTRAIN_ERR_AUTH, "authentication failed", deadline);
      goto refused;
    }
    dt__net_proof(self, 'A', theirs, mine, proof);
    rc = dt__conn_send(c, DT__MSG_AUTH, proof, 32, deadline, "handshake");
    if (rc != DTRAIN_OK) goto refused;
  }
  rc = dt__conn_send(c, DT__MSG_READY, NULL, 0, deadline, "handshake");
  if (rc != DTRAIN_OK) goto refused;
  if (seen && peer.role == DTRAIN_ROLE_WORKER) seen[peer.index] |= (unsigned char)(1u << peer.lane);
  return DTRAIN_OK;
refused:
  if (!self->opt.quiet) dt__log(DTRAIN_LOG_WARN, rc, "refused a connection: %s", dt_last_error());
  dt__conn_close(c);
  return rc;
}

#else /* DTRAIN_NO_NET */

DTRAIN_PRIVATE dt_result dt__net_self_init(dt__net_self *self, const dt_cluster *c, const dt_net_options *o) {
  (void)self;
  (void)c;
  (void)o;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "networking is not compiled in (DTRAIN_NO_NET)");
}

#endif /* DTRAIN_NO_NET */

/* ---- defaults ------------------------------------------------------------------------------ */
DTRAIN_API dt_net_options dt_net_defaults(void) {
  dt_net_options o;
  memset(&o, 0, sizeof o);
  o.timeout_s = 30.0;
  o.listen_fd = -1;
  o.max_payload = (size_t)256 << 20;
  o.chunk_bytes = (size_t)512 << 10;
  o.small_bytes = (size_t)64 << 10;
  o.spin_us = 20.0;
  o.sock_buf_bytes = (int64_t)4 << 20;
#ifndef DTRAIN_NO_STDIO
  const char *e = getenv("DTRAIN_TIMEOUT");
  if (e && atof(e) > 0) o.timeout_s = atof(e);
  e = getenv("DTRAIN_TOKEN");
  if (e && *e) o.token = e;
  e = getenv("DTRAIN_JOB_ID");
  if (e && *e) o.job_id = (uint64_t)strtoull(e, NULL, 0);
  e = getenv("DTRAIN_SPIN_US");
  if (e && *e) o.spin_us = atof(e);
  e = getenv("DTRAIN_SOCKBUF");
  if (e && *e) o.sock_buf_bytes = atoll(e) > 0 ? (int64_t)atoll(e) : -1;
  e = getenv("DTRAIN_LISTEN_FD");
  if (e && *e) o.listen_fd = atoi(e);
#endif
  o.connect_timeout_s = o.timeout_s;
  return o;
}
/* ======== end dt_net.c ======== */

/* ======== begin dt_comm_tcp.c ======== */
/* ===========================================================================
 * dt_comm_tcp.c -- the TCP communicator: one rank per process, a full mesh
 * of framed TCP connections among the workers (dt_net_core.h)
 * ===========================================================================
 * Setup. Rank r dials every lower rank (0..r-1, in order) and then accepts
 * the higher ones on its listening socket until each has connected or the
 * deadline (connect_timeout_s + timeout_s from the start) passes. Anything
 * else that connects -- garbage, a wrong token, another job -- is refused by
 * the handshake (dt__net_admit logs why) and the loop keeps waiting for the
 * real peers. A socket this process bound itself is closed once the mesh is
 * up; one passed in dt_net_options.listen_fd stays the caller's.
 *
 * Every collective call has a sequence number (#1, #2, ... per communicator)
 * and starts with an agreement round: the ranks exchange (op, root, n, seq)
 * by recursive doubling in CALL frames (below), so every rank learns whether
 * all ranks called the same thing and returns DTRAIN_ERR_MISMATCH (the
 * communicator stays usable) when they did not. A barrier is that round only.
 *
 * All-reduce of n floats:
 *   n*4 <= small_bytes: recursive doubling over the largest power of two p
 *     <= world; ranks p..world-1 first fold their buffer into rank r-p and
 *     get the result back at the end. Each step sums its buffer with the
 *     partner's (both partners compute the same float sum, a + b == b + a),
 *     so every element is summed along the same fixed tree of ranks.
 *   larger: ring reduce-scatter then ring all-gather over the dt_comm_slice
 *     slices, each slice cut into equal parts of at most chunk_bytes that are
 *     exchanged full duplex (dt__conn_exchange: send to the next rank while
 *     receiving from the previous one). Slice j is summed in ring order
 *     starting after its owner: x[j+1] + x[j+2] + ... + x[world-1] + x[0] +
 *     ... + x[j] (indices mod world), left to right.
 * Either way the order depends only on n, world and the options, never on
 * timing: results repeat bitwise. They differ from the threads backend (rank
 * order) only by float rounding.
 * reduce_scatter / allgather: the ring halves alone (rank r ends with slice
 * r). reduce: a pipelined chain root+1 -> root+2 -> ... -> root carrying
 * partial sums (x[root+1] + ... + x[root]), so no buffer but the root's is
 * written. broadcast: a pipelined chain root -> root+1 -> ... -> root-1.
 *
 * Failure. Any transport error in a call (a peer closed or reset the
 * connection, nothing arrived before the deadline, an ABORT notice, a
 * protocol error) breaks the communicator. This rank sends an ABORT frame
 * carrying its error to every peer, then listens for up to a grace period
 * (a quarter of timeout_s, at most 2 s) for the other ranks' ABORT frames:
 * the peers that closed their connection are dead, the ones that neither
 * aborted nor closed are stalled, and the error names them:
 *   "worker 0: allreduce #57: worker 2 (127.0.0.1:40123) closed the connection"
 *   "worker 0: allreduce #57: worker 2 (127.0.0.1:40123) sent nothing before the deadline (stalled?)"
 * so every surviving rank names the lost one, not the neighbour it was
 * waiting on. Later calls return DTRAIN_ERR_ABORTED. dt_comm_recover cannot
 * repair a TCP communicator (DTRAIN_ERR_UNSUPPORTED): destroy it, restart
 * the processes and resume from the last checkpoint.
 *
 * Wire messages of this backend (docs/wire_protocol.md), all little-endian:
 *   0x40 CALL  88 bytes: u32 first_rank, u32 bad_rank (0xffffffff: none),
 *              then two 40-byte call records (the first rank's and a
 *              differing one's), each u32 op, u32 root, u64 n, u64 seq,
 *              u32 chunk (floats per part), u32 small_bytes, 4 bytes: the
 *              sender's in-memory bytes of the integer 0x01020304 (04 03 02
 *              01 on little-endian hosts), u32 reserved (0); ops: 1
 *              allreduce, 2 reduce_scatter, 3 allgather, 4 reduce,
 *              5 broadcast, 6 barrier
 *   0x41 SUM   IEEE-754 float32 in the sender's byte order (ranks of
 *              another byte order are refused by the CALL round): partial sums (recursive doubling, ring reduce-scatter,
 *              reduce chain)
 *   0x42 COPY  floats: final values (fold-back, ring all-gather, broadcast)
 * BYE (0x08) is sent to every peer by destroy.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_net_core.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

#if defined(DTRAIN_NO_NET) || defined(DTRAIN_NO_THREADS)

DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *c, const dt_net_options *o) {
  (void)c;
  (void)o;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_comm_create_tcp: networking is not compiled in (%s)",
#  if defined(DTRAIN_NO_NET)
            "DTRAIN_NO_NET"
#  else
            "DTRAIN_NO_THREADS"
#  endif
  );
  return NULL;
}

#else

#  include <errno.h>
#  include <poll.h>
#  include <sys/socket.h>
#  include <sys/types.h>

enum {
  DT__TCP_MSG_CALL = DT__MSG_DATA0,
  DT__TCP_MSG_SUM = DT__MSG_DATA0 + 1,
  DT__TCP_MSG_COPY = DT__MSG_DATA0 + 2
};

enum {
  DT__TCP_OP_ALLREDUCE = 1,
  DT__TCP_OP_REDUCE_SCATTER,
  DT__TCP_OP_ALLGATHER,
  DT__TCP_OP_REDUCE,
  DT__TCP_OP_BROADCAST,
  DT__TCP_OP_BARRIER
};

#  define DT__TCP_CALL_BYTES 88
#  define DT__TCP_NONE 0xFFFFFFFFu
/* All-reduces of at most this many bytes (and at most small_bytes) travel
 * inside the agreement round's CALL frames: one round of messages, not two. */
#  define DT__TCP_FUSED_MAX 16384

/* Per-peer state after a failure. */
enum { DT__TCP_P_UNKNOWN = 0, DT__TCP_P_ALIVE, DT__TCP_P_DEAD, DT__TCP_P_SILENT };

typedef struct dt__comm_tcp {
  dt_comm comm;
  dt__net_self self;
  dt__conn *conns; /* world entries; conns[rank].fd == -1 */
  size_t conns_bytes;
  /* With 2 workers the ring's two directions would share one socket, whose
   * lock then serialises this rank's sends with the processing of what the
   * peer sends: a second connection (lane 1) carries worker 1 -> worker 0
   * ring traffic, conns[] (lane 0) worker 0 -> worker 1 and everything else.
   * On loopback that took 1-4 MiB all-reduces from ~3 to ~4-5.5 GB/s. */
  dt__conn lane2;  /* fd -1 unless lanes == 2 */
  int lanes;
  unsigned char *peer_state; /* world entries, used by the failure path */
  struct pollfd *pfd;        /* world entries, used by the failure path */
  int *pidx;
  float *scratch;            /* receive buffer: max(chunk, small) bytes */
  size_t scratch_bytes;
  unsigned char *fout, *fin; /* CALL frames with a fused all-reduce: CALL_BYTES + fused_max each */
  float *fkeep;              /* the caller's buffer before a fused all-reduce (restored on mismatch) */
  size_t fused_max;          /* bytes of data a CALL frame may carry */
  size_t chunk_floats, small_bytes;
  double timeout_s;
  uint64_t seq;
  int broken;
  dt_comm_stats st;
  char op[96]; /* "worker 0: allreduce #57" for the current call */
} dt__comm_tcp;

typedef struct dt__tcp_call {
  uint32_t op, root;
  uint64_t n, seq;
  uint32_t chunk, small; /* the algorithm's options: chunk floats, small_bytes */
  unsigned char order[4]; /* the sender's in-memory bytes of 0x01020304: floats travel in host order */
} dt__tcp_call;

static const char *dt__tcp_op_name(uint32_t op) {
  switch (op) {
    case DT__TCP_OP_ALLREDUCE: return "allreduce";
    case DT__TCP_OP_REDUCE_SCATTER: return "reduce_scatter";
    case DT__TCP_OP_ALLGATHER: return "allgather";
    case DT__TCP_OP_REDUCE: return "reduce";
    case DT__TCP_OP_BROADCAST: return "broadcast";
    case DT__TCP_OP_BARRIER: return "barrier";
    default: return "?";
  }
}

static dt__comm_tcp *dt__tcp_of(dt_comm *c) { return (dt__comm_tcp *)c->impl; }

/* ---- the failure path ----------------------------------------------------------------- */

/* Index of the peer whose description ends `text` before `upto` (or appears in
 * text when upto is NULL), -1 if none. */
static int dt__tcp_find_peer(const dt__comm_tcp *t, const char *text, const char *upto) {
  int best = -1;
  size_t best_at = 0;
  for (int j = 0; j < t->comm.world; j++) {
    if (j == t->comm.rank) continue;
    const char *name = t->conns[j].peer;
    size_t nl = strlen(name);
    if (nl == 0) continue;
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name)) {
      if (upto && p + nl > upto) break;
      size_t at = (size_t)(p - text);
      /* The last mention before `upto` (the aborting peer), else the first mention. */
      if (best < 0 || (upto ? at > best_at : at < best_at)) {
        best = j;
        best_at = at;
      }
    }
  }
  return best;
}

/* Listen for the other ranks' ABORT frames (or EOF) for up to `grace` seconds. */
static void dt__tcp_collect(dt__comm_tcp *t, double grace) {
  int world = t->comm.world;
  double end = dt__now() + grace;
  struct pollfd *pf = t->pfd;
  int *idx = t->pidx;
  for (;;) {
    int np = 0;
    for (int j = 0; j < world; j++) {
      if (j == t->comm.rank || t->conns[j].fd < 0 || t->peer_state[j] != DT__TCP_P_UNKNOWN) continue;
      pf[np].fd = t->conns[j].fd;
      pf[np].events = POLLIN;
      pf[np].revents = 0;
      idx[np++] = j;
    }
    if (np == 0) return;
    double left = end - dt__now();
    if (left <= 0) return;
    int k = poll(pf, (nfds_t)np, (int)(left * 1000.0) + 1);
    if (k <= 0) continue; /* timeout (loop ends) or EINTR */
    for (int q = 0; q < np; q++) {
      if (!pf[q].revents) continue;
      int j = idx[q];
      dt__conn *c = &t->conns[j];
      dt__frame f;
      unsigned char h[DT__NET_HDR];
      memset(&f, 0, sizeof f);
      dt_result rc = dt__conn_recv_header(c, &f, h, dt__now() + 0.5, "drain");
      if (rc == DTRAIN_OK) {
        if (f.type == DT__MSG_BYE) {
          t->peer_state[j] = DT__TCP_P_DEAD;
        } else if ((size_t)f.length <= t->scratch_bytes) {
          /* A data frame still in flight: skip it. */
          if (dt__conn_recv_payload(c, &f, h, t->scratch, dt__now() + 0.5, "drain") != DTRAIN_OK)
            t->peer_state[j] = DT__TCP_P_ALIVE;
        } else {
          t->peer_state[j] = DT__TCP_P_ALIVE;
        }
      } else if (f.type == DT__MSG_ABORT || f.type == DT__MSG_REFUSE || rc == DTRAIN_ERR_PROTOCOL ||
                 rc == DTRAIN_ERR_MISMATCH) {
        t->peer_state[j] = DT__TCP_P_ALIVE; /* it spoke: not the lost one */
      } else if (rc == DTRAIN_ERR_PEER) {
        t->peer_state[j] = DT__TCP_P_DEAD;
      } /* a timeout mid-frame: leave it unknown */
    }
  }
}

/* Called with the thread's error set by the failing transport call. Breaks
 * the communicator, tells every peer, finds the lost ranks, and rewrites the
 * error to name them. */
static dt_result dt__tcp_fail(dt__comm_tcp *t, dt_result rc) {
  int world = t->comm.world;
  char first[DT__MSG_CAP];
  snprintf(first, sizeof first, "%s", dt_last_error());
  t->broken = 1;
  for (int j = 0; j < world; j++) t->peer_state[j] = DT__TCP_P_UNKNOWN;
  /* What the first error says about one peer. */
  const char *ab = strstr(first, " aborted: ");
  int who = dt__tcp_find_peer(t, first, ab);
  if (who >= 0) {
    if (ab) t->peer_state[who] = DT__TCP_P_ALIVE;
    else if (rc == DTRAIN_ERR_PEER) t->peer_state[who] = DT__TCP_P_DEAD;
  }
  /* Tell everyone, then listen for the others' notices. */
  for (int j = 0; j < world; j++)
    if (j != t->comm.rank && t->conns[j].fd >= 0 && t->peer_state[j] != DT__TCP_P_DEAD)
      dt__conn_abort(&t->conns[j], rc, first);
  if (t->lane2.fd >= 0 && t->peer_state[1 - t->comm.rank] != DT__TCP_P_DEAD) /* it may be waiting on lane 1 */
    dt__conn_abort(&t->lane2, rc, first);
  /* A peer's dt_comm_abort: the program decided, nobody was lost. */
  if (ab && strstr(ab, "(dt_comm_abort)")) return dt__error(DTRAIN_ERR_ABORTED, "%s", first);
  if (rc != DTRAIN_ERR_MISMATCH && rc != DTRAIN_ERR_PROTOCOL) {
    double grace = t->timeout_s * 0.25;
    dt__tcp_collect(t, grace > 2.0 ? 2.0 : grace);
  }
  /* Name the lost ranks: the dead first, else the silent ones. */
  char names[DT__MSG_CAP];
  size_t used = 0;
  int dead = 0, silent = 0;
  names[0] = '\0';
  for (int pass = 0; pass < 2 && used == 0; pass++) {
    for (int j = 0; j < world; j++) {
      if (j == t->comm.rank) continue;
      int st = t->peer_state[j];
      if (pass == 0 ? st != DT__TCP_P_DEAD : st != DT__TCP_P_UNKNOWN) continue;
      int k = snprintf(names + used, sizeof names - used, "%s%.95s", used ? ", " : "", t->conns[j].peer);
      if (k < 0 || (size_t)k >= sizeof names - used) break;
      used += (size_t)k;
      if (pass == 0) dead++;
      else silent++;
    }
  }
  if (dead)
    return dt__error(DTRAIN_ERR_PEER, "%.90s: %.200s closed the connection", t->op, names);
  if (silent)
    return dt__error(DTRAIN_ERR_TIMEOUT, "%.90s: %.200s sent nothing before the deadline (stalled?)", t->op, names);
  return dt__error(rc, "%s", first);
}

/* ---- transport wrappers (time accounted to wait_s) ------------------------------------- */

/* The connection an exchange sends on / receives from: with two lanes,
 * worker 0 sends on lane 0 and receives on lane 1, worker 1 the other way
 * round, so each socket carries one direction. */
static dt__conn *dt__tcp_out(dt__comm_tcp *t, int to) {
  return (t->lanes == 2 && t->comm.rank == 1) ? &t->lane2 : &t->conns[to];
}
static dt__conn *dt__tcp_in(dt__comm_tcp *t, int from) {
  return (t->lanes == 2 && t->comm.rank == 0) ? &t->lane2 : &t->conns[from];
}

static dt_result dt__tcp_exchange(dt__comm_tcp *t, int to, uint16_t stype, const void *s, size_t sn, int from,
                                  uint16_t rtype, void *r, size_t rn) {
  double t0 = dt__now();
  dt_result rc = dt__conn_exchange(dt__tcp_out(t, to), stype, s, (uint32_t)(sn * sizeof(float)), dt__tcp_in(t, from),
                                   rtype, r, (uint32_t)(rn * sizeof(float)), t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

static dt_result dt__tcp_send(dt__comm_tcp *t, int to, uint16_t type, const void *s, size_t bytes) {
  double t0 = dt__now();
  dt_result rc = dt__conn_send(&t->conns[to], type, s, (uint32_t)bytes, t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

static dt_result dt__tcp_recv(dt__comm_tcp *t, int from, uint16_t type, void *r, size_t bytes) {
  double t0 = dt__now();
  uint32_t len = 0;
  dt_result rc = dt__conn_recv(&t->conns[from], type, r, (uint32_t)bytes, &len, t0 + t->timeout_s, t->op);
  t->st.wait_s += dt__now() - t0;
  if (rc == DTRAIN_OK && len != bytes)
    rc = dt__error(DTRAIN_ERR_PROTOCOL, "%s: receive from %s: %u bytes, expected %zu", t->op, t->conns[from].peer,
                   (unsigned)len, bytes);
  return rc;
}

/* ---- recursive doubling over a byte buffer --------------------------------------------- */

typedef void (*dt__tcp_combine_fn)(void *acc, const void *in, size_t bytes);

/* d[i] = in[i] + d[i] (float addition commutes: the same bits as d + in).
 * Blocks of 8 so that compilers vectorise it at -O2 too; the sums are
 * memory-bound and otherwise a fifth of a large all-reduce's time. */
static void dt__tcp_sum(float *DT__RESTRICT d, const float *DT__RESTRICT in, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) d[i + j] = in[i + j] + d[i + j];
  for (; i < n; i++) d[i] = in[i] + d[i];
}

static void dt__tcp_add(void *acc, const void *in, size_t bytes) {
  dt__tcp_sum((float *)acc, (const float *)in, bytes / sizeof(float));
}

/* buf (bytes) becomes the combination over all ranks. Partial frames are
 * `part`, the fold-back `final`. */
static dt_result dt__tcp_rd(dt__comm_tcp *t, void *buf, size_t bytes, uint16_t part, uint16_t final,
                            dt__tcp_combine_fn combine) {
  int world = t->comm.world, r = t->comm.rank, p2 = 1;
  dt__conn *cs = t->conns;
  double dl;
  dt_result rc = DTRAIN_OK;
  while (p2 * 2 <= world) p2 *= 2;
  if (r >= p2) {
    /* Extra rank: hand the buffer to rank r - p2, get the result back. */
    rc = dt__tcp_send(t, r - p2, part, buf, bytes);
    if (rc == DTRAIN_OK) rc = dt__tcp_recv(t, r - p2, final, buf, bytes);
    return rc;
  }
  if (r + p2 < world) {
    rc = dt__tcp_recv(t, r + p2, part, t->scratch, bytes);
    if (rc != DTRAIN_OK) return rc;
    combine(buf, t->scratch, bytes);
  }
  for (int d = 1; d < p2; d *= 2) {
    int q = r ^ d;
    dl = dt__now();
    rc = dt__conn_exchange(&cs[q], part, buf, (uint32_t)bytes, &cs[q], part, t->scratch, (uint32_t)bytes,
                           dl + t->timeout_s, t->op);
    t->st.wait_s += dt__now() - dl;
    if (rc != DTRAIN_OK) return rc;
    combine(buf, t->scratch, bytes);
  }
  if (r + p2 < world) rc = dt__tcp_send(t, r + p2, final, buf, bytes);
  return rc;
}

/* ---- the agreement round ----------------------------------------------------------------- */

static void dt__tcp_call_put(unsigned char *p, const dt__tcp_call *c) {
  dt__le32_put(p, c->op);
  dt__le32_put(p + 4, c->root);
  dt__le64_put(p + 8, c->n);
  dt__le64_put(p + 16, c->seq);
  dt__le32_put(p + 24, c->chunk);
  dt__le32_put(p + 28, c->small);
  memcpy(p + 32, c->order, 4);
  memset(p + 36, 0, 4);
}

static void dt__tcp_call_get(const unsigned char *p, dt__tcp_call *c) {
  c->op = dt__le32_get(p);
  c->root = dt__le32_get(p + 4);
  c->n = dt__le64_get(p + 8);
  c->seq = dt__le64_get(p + 16);
  c->chunk = dt__le32_get(p + 24);
  c->small = dt__le32_get(p + 28);
  memcpy(c->order, p + 32, 4);
}

static int dt__tcp_call_eq(const dt__tcp_call *a, const dt__tcp_call *b) {
  return a->op == b->op && a->root == b->root && a->n == b->n && a->seq == b->seq && a->chunk == b->chunk &&
         a->small == b->small && memcmp(a->order, b->order, 4) == 0;
}

/* State: the lowest rank seen with its call, and (if any) a rank whose call
 * differs from it. Merging keeps "a differing call exists" exact, so every
 * rank ends knowing whether all ranks agree. */
static void dt__tcp_agree_combine(void *acc, const void *in, size_t bytes) {
  unsigned char *a = (unsigned char *)acc;
  const unsigned char *b = (const unsigned char *)in;
  (void)bytes;
  uint32_t af = dt__le32_get(a), ab = dt__le32_get(a + 4), bf = dt__le32_get(b), bb = dt__le32_get(b + 4);
  dt__tcp_call acf, acb, bcf, bcb;
  dt__tcp_call_get(a + 8, &acf);
  dt__tcp_call_get(a + 48, &acb);
  dt__tcp_call_get(b + 8, &bcf);
  dt__tcp_call_get(b + 48, &bcb);
  /* The new first: the lower of the two firsts. */
  uint32_t nf = af < bf ? af : bf, nb = DT__TCP_NONE;
  dt__tcp_call cf = af < bf ? acf : bcf, cb = cf;
  /* Candidates for a differing call, lowest rank first. */
  struct {
    uint32_t rank;
    dt__tcp_call call;
  } cand[4];
  int nc;
  cand[0].rank = af;
  cand[0].call = acf;
  cand[1].rank = bf;
  cand[1].call = bcf;
  nc = 2;
  if (ab != DT__TCP_NONE) {
    cand[nc].rank = ab;
    cand[nc].call = acb;
    nc++;
  }
  if (bb != DT__TCP_NONE) {
    cand[nc].rank = bb;
    cand[nc].call = bcb;
    nc++;
  }
  for (int i = 0; i < nc; i++)
    if (!dt__tcp_call_eq(&cand[i].call, &cf) && (nb == DT__TCP_NONE || cand[i].rank < nb)) {
      nb = cand[i].rank;
      cb = cand[i].call;
    }
  dt__le32_put(a, nf);
  dt__le32_put(a + 4, nb);
  dt__tcp_call_put(a + 8, &cf);
  dt__tcp_call_put(a + 48, &cb);
}

static const char *dt__tcp_call_text(const dt__tcp_call *c, int options, char *buf, size_t cap) {
  if (options)
    snprintf(buf, cap, "chunk_bytes %llu, small_bytes %u and %s-endian floats",
             (unsigned long long)c->chunk * sizeof(float), (unsigned)c->small, c->order[0] == 4 ? "little" : "big");
  else
    snprintf(buf, cap, "%s n=%llu root %u (call #%llu)", dt__tcp_op_name(c->op), (unsigned long long)c->n,
             (unsigned)c->root, (unsigned long long)c->seq);
  return buf;
}

/* One step of the agreement round: send our frame (state + data) to `to`,
 * receive one from `from` into t->fin; *len gets its length. Frames are at
 * most CALL_BYTES + fused_max (16 KiB + 88): both sides send before they
 * receive, which socket buffers always absorb. */
static dt_result dt__tcp_agree_xfer(dt__comm_tcp *t, int to, size_t out_bytes, int from, uint32_t *len) {
  double t0 = dt__now();
  dt_result rc = DTRAIN_OK;
  if (to >= 0) rc = dt__conn_send(&t->conns[to], DT__TCP_MSG_CALL, t->fout, (uint32_t)out_bytes, t0 + t->timeout_s, t->op);
  if (rc == DTRAIN_OK && from >= 0)
    rc = dt__conn_recv(&t->conns[from], DT__TCP_MSG_CALL, t->fin, (uint32_t)(DT__TCP_CALL_BYTES + t->fused_max), len,
                       t0 + t->timeout_s, t->op);
  if (rc == DTRAIN_OK && from >= 0 && *len < DT__TCP_CALL_BYTES)
    rc = dt__error(DTRAIN_ERR_PROTOCOL, "%s: receive from %s: a CALL frame of %u bytes", t->op, t->conns[from].peer,
                   (unsigned)*len);
  t->st.wait_s += dt__now() - t0;
  return rc;
}

/* Folds a received frame (t->fin, len bytes) into ours (t->fout): the
 * agreement state always; the data (n floats) when the peer carried the same
 * amount -- summed (partial) or copied (final). A peer with another amount made
 * another call, which the state records, so the data are then not needed. */
static void dt__tcp_agree_fold(dt__comm_tcp *t, uint32_t len, size_t n, int final) {
  if (final) memcpy(t->fout, t->fin, DT__TCP_CALL_BYTES);
  else dt__tcp_agree_combine(t->fout, t->fin, DT__TCP_CALL_BYTES);
  if (n == 0 || len != DT__TCP_CALL_BYTES + n * sizeof(float)) return;
  float *acc = (float *)(void *)(t->fout + DT__TCP_CALL_BYTES);
  const float *in = (const float *)(const void *)(t->fin + DT__TCP_CALL_BYTES);
  if (final) memcpy(acc, in, n * sizeof(float));
  else dt__tcp_sum(acc, in, n);
}

/* The agreement round by recursive doubling (the same tree as dt__tcp_rd),
 * its frames carrying `n` floats of data (0: none) that are summed on the way. */
static dt_result dt__tcp_agree_rd(dt__comm_tcp *t, size_t n) {
  int world = t->comm.world, r = t->comm.rank, p2 = 1;
  size_t bytes = DT__TCP_CALL_BYTES + n * sizeof(float);
  uint32_t len = 0;
  dt_result rc;
  while (p2 * 2 <= world) p2 *= 2;
  if (r >= p2) {
    rc = dt__tcp_agree_xfer(t, r - p2, bytes, r - p2, &len);
    if (rc == DTRAIN_OK) dt__tcp_agree_fold(t, len, n, 1);
    return rc;
  }
  if (r + p2 < world) {
    rc = dt__tcp_agree_xfer(t, -1, 0, r + p2, &len);
    if (rc != DTRAIN_OK) return rc;
    dt__tcp_agree_fold(t, len, n, 0);
  }
  for (int d = 1; d < p2; d *= 2) {
    rc = dt__tcp_agree_xfer(t, r ^ d, bytes, r ^ d, &len);
    if (rc != DTRAIN_OK) return rc;
    dt__tcp_agree_fold(t, len, n, 0);
  }
  if (r + p2 < world) return dt__tcp_agree_xfer(t, r + p2, bytes, -1, &len);
  return DTRAIN_OK;
}

/* Start a call: checks, sequence number, the agreement round. fused (n
 * floats in buf, n * 4 <= fused_max): an all-reduce whose data ride in the
 * agreement round's frames; on success buf holds the sum, on a mismatch it is
 * restored. */
static dt_result dt__tcp_enter_fused(dt__comm_tcp *t, int rank, uint32_t op, size_t n, int root, float *fused) {
  if (rank != t->comm.rank)
    return dt__error(DTRAIN_ERR_INDEX, "dt_comm_%s: called with rank %d, but this process is rank %d",
                     dt__tcp_op_name(op), rank, t->comm.rank);
  if (t->broken) return DTRAIN_ERR_ABORTED;
  t->seq++;
  snprintf(t->op, sizeof t->op, "worker %d: %s #%llu", t->comm.rank, dt__tcp_op_name(op), (unsigned long long)t->seq);
  if (t->comm.world == 1) return DTRAIN_OK;
  unsigned char st[DT__TCP_CALL_BYTES];
  dt__tcp_call me;
  me.op = op;
  me.root = (uint32_t)root;
  me.n = (uint64_t)n;
  me.seq = t->seq;
  me.chunk = (uint32_t)t->chunk_floats;
  me.small = (uint32_t)t->small_bytes;
  {
    uint32_t probe = 0x01020304u;
    memcpy(me.order, &probe, 4);
  }
  memset(st, 0, sizeof st);
  dt__le32_put(st, (uint32_t)t->comm.rank);
  dt__le32_put(st + 4, DT__TCP_NONE);
  dt__tcp_call_put(st + 8, &me);
  dt__tcp_call_put(st + 48, &me);
  size_t fn = fused ? n : 0;
  memcpy(t->fout, st, sizeof st);
  if (fn) {
    memcpy(t->fkeep, fused, fn * sizeof(float));
    memcpy(t->fout + DT__TCP_CALL_BYTES, fused, fn * sizeof(float));
  }
  dt_result rc = dt__tcp_agree_rd(t, fn);
  if (rc != DTRAIN_OK) return dt__tcp_fail(t, rc);
  memcpy(st, t->fout, sizeof st);
  uint32_t fr = dt__le32_get(st), br = dt__le32_get(st + 4);
  if (br != DT__TCP_NONE) {
    dt__tcp_call a, b;
    char ta[96], tb[96];
    dt__tcp_call_get(st + 8, &a);
    dt__tcp_call_get(st + 48, &b);
    /* Options differ only when the calls agree otherwise. */
    int opts = a.op == b.op && a.root == b.root && a.n == b.n && a.seq == b.seq;
    return dt__error(DTRAIN_ERR_MISMATCH, "%s: the ranks disagree: worker %u %s %s, worker %u %s %s", t->op,
                     (unsigned)fr, opts ? "uses" : "called", dt__tcp_call_text(&a, opts, ta, sizeof ta), (unsigned)br,
                     opts ? "uses" : "called", dt__tcp_call_text(&b, opts, tb, sizeof tb));
  }
  if (fn) memcpy(fused, t->fout + DT__TCP_CALL_BYTES, fn * sizeof(float));
  return DTRAIN_OK;
}

static dt_result dt__tcp_enter(dt__comm_tcp *t, int rank, uint32_t op, size_t n, int root) {
  return dt__tcp_enter_fused(t, rank, op, n, root, NULL);
}

static dt_result dt__tcp_leave(dt__comm_tcp *t, dt_result rc, size_t n) {
  if (rc != DTRAIN_OK) return t->broken ? rc : dt__tcp_fail(t, rc);
  t->st.calls++;
  t->st.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

/* ---- ring halves ---------------------------------------------------------------------------- */

static size_t dt__tcp_nparts(const dt__comm_tcp *t, size_t n) {
  size_t maxlen = 0;
  for (int j = 0; j < t->comm.world; j++) {
    size_t b, e;
    dt_comm_slice(n, t->comm.world, j, &b, &e);
    if (e - b > maxlen) maxlen = e - b;
  }
  size_t k = (maxlen + t->chunk_floats - 1) / t->chunk_floats;
  return k ? k : 1;
}

/* Part c of a slice of `len` floats cut into k parts. */
static void dt__tcp_part(size_t len, size_t k, size_t c, size_t *off, size_t *m) {
  uint64_t a = (uint64_t)len * c / k, b = (uint64_t)len * (c + 1) / k;
  *off = (size_t)a;
  *m = (size_t)(b - a);
}

static dt_result dt__tcp_ring(dt__comm_tcp *t, float *buf, size_t n, int gather) {
  int world = t->comm.world, r = t->comm.rank;
  int next = (r + 1) % world, prev = (r + world - 1) % world;
  size_t k = dt__tcp_nparts(t, n);
  for (int s = 0; s < world - 1; s++) {
    /* Reduce-scatter: send slice r-s-1, receive slice r-s-2 (rank r ends with
     * slice r). All-gather: send slice r-s, receive slice r-s-1. */
    int js = gather ? (r - s + world) % world : (r - s - 1 + 2 * world) % world;
    int jr = (js - 1 + world) % world;
    size_t sb, se, rb, re;
    dt_comm_slice(n, world, js, &sb, &se);
    dt_comm_slice(n, world, jr, &rb, &re);
    for (size_t c = 0; c < k; c++) {
      size_t so, sm, ro, rm;
      dt__tcp_part(se - sb, k, c, &so, &sm);
      dt__tcp_part(re - rb, k, c, &ro, &rm);
      dt_result rc;
      if (gather) {
        rc = dt__tcp_exchange(t, next, DT__TCP_MSG_COPY, buf + sb + so, sm, prev, DT__TCP_MSG_COPY, buf + rb + ro, rm);
      } else {
        rc = dt__tcp_exchange(t, next, DT__TCP_MSG_SUM, buf + sb + so, sm, prev, DT__TCP_MSG_SUM, t->scratch, rm);
        if (rc == DTRAIN_OK) {
          /* received partial (x[j+1] + ... ) + this rank's value */
          dt__tcp_sum(buf + rb + ro, t->scratch, rm);
        }
      }
      if (rc != DTRAIN_OK) return rc;
    }
  }
  return DTRAIN_OK;
}

/* ---- the vtable ------------------------------------------------------------------------------ */

static dt_result dt__tcp_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  if (n > 0 && n * sizeof(float) <= t->fused_max) {
    /* Small: the data ride in the agreement round (one round of messages). */
    dt_result rf = dt__tcp_enter_fused(t, rank, DT__TCP_OP_ALLREDUCE, n, 0, buf);
    if (rf != DTRAIN_OK) {
      if (rf == DTRAIN_ERR_MISMATCH) memcpy(buf, t->fkeep, n * sizeof(float));
      return rf;
    }
    return dt__tcp_leave(t, rf, n);
  }
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_ALLREDUCE, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  if (n * sizeof(float) <= t->small_bytes) {
    rc = dt__tcp_rd(t, buf, n * sizeof(float), DT__TCP_MSG_SUM, DT__TCP_MSG_COPY, dt__tcp_add);
  } else {
    rc = dt__tcp_ring(t, buf, n, 0);
    if (rc == DTRAIN_OK) rc = dt__tcp_ring(t, buf, n, 1);
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_REDUCE_SCATTER, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  return dt__tcp_leave(t, dt__tcp_ring(t, buf, n, 0), n);
}

static dt_result dt__tcp_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_ALLGATHER, n, 0);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  return dt__tcp_leave(t, dt__tcp_ring(t, buf, n, 1), n);
}

static dt_result dt__tcp_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_REDUCE, n, root);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  int world = c->world, pos = (rank - root - 1 + 2 * world) % world; /* root is last */
  int prev = (rank + world - 1) % world, next = (rank + 1) % world;
  size_t k = (n + t->chunk_floats - 1) / t->chunk_floats;
  for (size_t p = 0; p < k && rc == DTRAIN_OK; p++) {
    size_t off, m;
    dt__tcp_part(n, k, p, &off, &m);
    if (pos == 0) {
      rc = dt__tcp_send(t, next, DT__TCP_MSG_SUM, buf + off, m * sizeof(float));
      continue;
    }
    rc = dt__tcp_recv(t, prev, DT__TCP_MSG_SUM, t->scratch, m * sizeof(float));
    if (rc != DTRAIN_OK) break;
    if (pos == world - 1) {
      dt__tcp_sum(buf + off, t->scratch, m); /* partial + this rank's value, into buf */
    } else {
      dt__tcp_sum(t->scratch, buf + off, m);
      rc = dt__tcp_send(t, next, DT__TCP_MSG_SUM, t->scratch, m * sizeof(float));
    }
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_BROADCAST, n, root);
  if (rc != DTRAIN_OK || c->world == 1 || n == 0) return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, n) : rc;
  int world = c->world, pos = (rank - root + world) % world; /* root first */
  int prev = (rank + world - 1) % world, next = (rank + 1) % world;
  size_t k = (n + t->chunk_floats - 1) / t->chunk_floats;
  for (size_t p = 0; p < k && rc == DTRAIN_OK; p++) {
    size_t off, m;
    dt__tcp_part(n, k, p, &off, &m);
    if (pos > 0) rc = dt__tcp_recv(t, prev, DT__TCP_MSG_COPY, buf + off, m * sizeof(float));
    if (rc == DTRAIN_OK && pos < world - 1) rc = dt__tcp_send(t, next, DT__TCP_MSG_COPY, buf + off, m * sizeof(float));
  }
  return dt__tcp_leave(t, rc, n);
}

static dt_result dt__tcp_barrier(dt_comm *c, int rank) {
  dt__comm_tcp *t = dt__tcp_of(c);
  dt_result rc = dt__tcp_enter(t, rank, DT__TCP_OP_BARRIER, 0, 0);
  return rc == DTRAIN_OK ? dt__tcp_leave(t, rc, 0) : rc;
}

static void dt__tcp_abort(dt_comm *c, int rank) {
  dt__comm_tcp *t = dt__tcp_of(c);
  (void)rank;
  if (t->broken) return;
  t->broken = 1;
  char why[160];
  snprintf(why, sizeof why, "worker %d: the program aborted the communicator (dt_comm_abort)", c->rank);
  for (int j = 0; j < c->world; j++)
    if (j != c->rank && t->conns[j].fd >= 0) dt__conn_abort(&t->conns[j], DTRAIN_ERR_ABORTED, why);
  if (t->lane2.fd >= 0) dt__conn_abort(&t->lane2, DTRAIN_ERR_ABORTED, why);
}

static dt_result dt__tcp_recover(dt_comm *c) {
  dt__comm_tcp *t = dt__tcp_of(c);
  if (!t->broken) return DTRAIN_OK;
  return dt__error(DTRAIN_ERR_UNSUPPORTED,
                   "dt_comm_recover: worker %d: a tcp communicator cannot be repaired after a failure; destroy it, "
                   "restart the processes and resume from the last checkpoint",
                   c->rank);
}

static void dt__tcp_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  *out = dt__tcp_of(c)->st;
}

static void dt__tcp_reset_stats(dt_comm *c) { memset(&dt__tcp_of(c)->st, 0, sizeof(dt_comm_stats)); }

static void dt__tcp_free(dt__comm_tcp *t) {
  if (t->conns)
    for (int j = 0; j < t->comm.world; j++) dt__conn_close(&t->conns[j]);
  dt__conn_close(&t->lane2);
  dt__free(t->conns, t->conns_bytes);
  dt__free(t->peer_state, (size_t)t->comm.world);
  dt__free(t->pfd, (size_t)t->comm.world * sizeof(struct pollfd));
  dt__free(t->pidx, (size_t)t->comm.world * sizeof(int));
  dt__free(t->scratch, t->scratch_bytes);
  dt__free(t->fout, DT__TCP_CALL_BYTES + t->fused_max);
  dt__free(t->fin, DT__TCP_CALL_BYTES + t->fused_max);
  dt__free(t->fkeep, t->fused_max + sizeof(float));
  dt__free(t, sizeof *t);
}

static void dt__tcp_destroy(dt_comm *c) {
  dt__comm_tcp *t = dt__tcp_of(c);
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  for (int j = 0; j < c->world; j++)
    if (j != c->rank && t->conns[j].fd >= 0)
      dt__conn_send(&t->conns[j], DT__MSG_BYE, NULL, 0, dt__now() + 0.2, "bye");
  dt__tcp_free(t);
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

static const dt_comm_vtable dt__comm_tcp_vtable = {
  "tcp",
  dt__tcp_allreduce,
  dt__tcp_reduce_scatter,
  dt__tcp_allgather,
  dt__tcp_reduce,
  dt__tcp_broadcast,
  dt__tcp_barrier,
  dt__tcp_abort,
  dt__tcp_recover,
  dt__tcp_stats,
  dt__tcp_reset_stats,
  dt__tcp_destroy
};

/* ---- setup ------------------------------------------------------------------------------------ */

/* Accepted connections whose first frame has not fully arrived: strangers
 * that send a few bytes (or none) and stall must not hold up the real peers,
 * so a connection is admitted only once its hello is there (or its first
 * bytes are plainly not a frame, or it closed). */
#  define DT__TCP_PENDING 16
#  define DT__TCP_HELLO_FRAME (DT__NET_HDR + 128)

typedef struct dt__tcp_pending {
  int fd;
  int partial; /* some bytes arrived, not enough: polling would spin, so it is re-checked every 10 ms */
  double since;
  char addr[DT__NET_ADDR];
} dt__tcp_pending;

/* 1: admit now, 0: keep waiting, -1: closed without a byte (drop quietly),
 * 2: not a dtrain frame and too short for the handshake to read (refuse
 * here: why gets the reason). */
static int dt__tcp_pending_ready(int fd, int *partial, char *why, size_t cap) {
  unsigned char peek[DT__TCP_HELLO_FRAME];
  ssize_t k = recv(fd, peek, sizeof peek, MSG_PEEK);
  *partial = k > 0;
  if (k == 0) return -1;
  if (k < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
  if ((size_t)k >= sizeof peek) return 1;
  if (k >= 4 && dt__le32_get(peek) != DT__NET_MAGIC) {
    if (k >= DT__NET_HDR) return 1; /* the handshake reads the header and refuses it */
    dt__frame f;
    memset(peek + k, 0, sizeof peek - (size_t)k);
    dt__frame_unpack(peek, 0, 0, &f, why, cap);
    return 2;
  }
  /* Closed after a few bytes: the handshake reports the truncated frame. */
  struct pollfd p;
  p.fd = fd;
  p.events = POLLIN;
  p.revents = 0;
  if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR))) return 1;
  return 0;
}

static void dt__tcp_refuse_log(const dt__comm_tcp *t, const dt__tcp_pending *p, const char *why) {
  if (!t->self.opt.quiet)
    dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "worker %d: refused a connection from %.80s: %s", t->comm.rank,
            p->addr, why);
}

static dt_result dt__tcp_connect_all(dt__comm_tcp *t) {
  const dt_cluster *cl = t->self.cluster;
  int world = cl->workers, r = cl->index, lfd = -1, own_lfd = 0, np = 0;
  const unsigned all = t->lanes == 2 ? 3u : 1u; /* the lanes' bits in seen[] */
  int need = (world - 1 - r) * t->lanes;
  double start = dt__now();
  double deadline = start + t->self.opt.connect_timeout_s + t->self.opt.timeout_s;
  unsigned char *seen = NULL;
  dt__tcp_pending pend[DT__TCP_PENDING];
  dt_result rc = DTRAIN_OK;
  if (need > 0) {
    /* Listen before dialing so higher ranks' connections wait in the backlog. */
    rc = dt__net_self_listen(&t->self, &lfd);
    if (rc != DTRAIN_OK) goto done;
    own_lfd = t->self.opt.listen_fd < 0;
    seen = (unsigned char *)dt__calloc((size_t)world);
    if (!seen) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "out of memory");
      goto done;
    }
  }
  for (int j = 0; j < r; j++) {
    rc = dt__net_dial(&t->self, DTRAIN_ROLE_WORKER, j, &t->conns[j]);
    if (rc != DTRAIN_OK) goto done;
  }
  if (t->lanes == 2 && r == 1) {
    rc = dt__net_dial_lane(&t->self, DTRAIN_ROLE_WORKER, 0, 1, &t->lane2);
    if (rc != DTRAIN_OK) goto done;
  }
  while (need > 0) {
    struct pollfd pf[DT__TCP_PENDING + 1];
    double now = dt__now();
    if (now >= deadline) {
      char miss[200];
      size_t used = 0;
      miss[0] = '\0';
      for (int j = r + 1; j < world; j++) {
        if (seen[j] == all) continue;
        int k = snprintf(miss + used, sizeof miss - used, "%s%d", used ? ", " : "", j);
        if (k < 0 || (size_t)k >= sizeof miss - used) break;
        used += (size_t)k;
      }
      rc = dt__error(DTRAIN_ERR_TIMEOUT, "worker %s did not connect before the deadline (%.1f s)", miss,
                     deadline - start);
      goto done;
    }
    pf[0].fd = lfd;
    pf[0].events = POLLIN;
    pf[0].revents = 0;
    int npf = 1, ms = (int)((deadline - now) * 1000.0) + 1;
    if (ms > 100) ms = 100; /* also re-checks how long the pending ones have waited */
    for (int q = 0; q < np; q++) {
      if (pend[q].partial) {
        if (ms > 10) ms = 10;
        continue;
      }
      pf[npf].fd = pend[q].fd;
      pf[npf].events = POLLIN;
      pf[npf].revents = 0;
      npf++;
    }
    if (poll(pf, (nfds_t)npf, ms) < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "poll: %s", strerror(errno));
      goto done;
    }
    if (pf[0].revents) {
      int fd;
      char addr[DT__NET_ADDR];
      rc = dt__net_accept(lfd, dt__now(), &fd, addr, sizeof addr);
      if (rc == DTRAIN_OK) {
        if (np == DT__TCP_PENDING) {
          dt__tcp_refuse_log(t, &pend[0], "too many connections waiting to say hello");
          dt__net_close(pend[0].fd);
          memmove(pend, pend + 1, (size_t)(np - 1) * sizeof pend[0]);
          np--;
        }
        pend[np].fd = fd;
        pend[np].partial = 0;
        pend[np].since = dt__now();
        snprintf(pend[np].addr, sizeof pend[np].addr, "%s", addr);
        np++;
      } else if (rc != DTRAIN_ERR_TIMEOUT) {
        goto done;
      }
      rc = DTRAIN_OK;
    }
    for (int q = 0; q < np && need > 0; q++) {
      char why[160];
      int ready = dt__tcp_pending_ready(pend[q].fd, &pend[q].partial, why, sizeof why);
      if (ready == 0 && dt__now() - pend[q].since > t->self.opt.timeout_s) {
        dt__tcp_refuse_log(t, &pend[q], "no hello before the deadline");
        ready = -1;
      }
      if (ready == 2) {
        dt__tcp_refuse_log(t, &pend[q], why);
        ready = -1;
      }
      if (ready == 0) continue;
      dt__tcp_pending p = pend[q];
      memmove(pend + q, pend + q + 1, (size_t)(np - q - 1) * sizeof pend[0]);
      np--;
      q--;
      if (ready < 0) {
        dt__net_close(p.fd);
        continue;
      }
      double dl = dt__now() + t->self.opt.timeout_s;
      dt__conn c;
      if (dl > deadline) dl = deadline;
      if (dt__net_admit(&t->self, p.fd, p.addr, dl, seen, &c) != DTRAIN_OK)
        continue; /* refused and logged; keep waiting for the real peers */
      if (c.peer_role != DTRAIN_ROLE_WORKER || c.peer_index <= r) {
        /* Lower ranks are dialed by this rank; servers do not belong here. */
        if (!t->self.opt.quiet)
          dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "worker %d: refused %s: it should not dial this rank", r,
                  c.peer);
        if (c.peer_role == DTRAIN_ROLE_WORKER && c.peer_index >= 0 && c.peer_index < world)
          seen[c.peer_index] &= (unsigned char)~(1u << c.lane);
        dt__conn_close(&c);
        continue;
      }
      if (c.lane == 1) t->lane2 = c; /* admitted only with 2 workers: from worker 1 */
      else t->conns[c.peer_index] = c;
      need--;
    }
  }
  rc = DTRAIN_OK;
done:
  for (int q = 0; q < np; q++) {
    dt__tcp_refuse_log(t, &pend[q], "setup ended before its hello");
    dt__net_close(pend[q].fd);
  }
  if (own_lfd) dt__net_close(lfd);
  dt__free(seen, (size_t)world);
  return rc;
}

static dt_comm *dt__tcp_create(const dt_cluster *cl, const dt_net_options *o) {
  dt__comm_tcp *t = NULL;
  dt_result rc;
  size_t world, scratch;
  if (!cl) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_comm_create_tcp: cluster is NULL");
    return NULL;
  }
  if (cl->role != DTRAIN_ROLE_WORKER) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_comm_create_tcp: this process is a parameter server, not a worker");
    return NULL;
  }
  t = (dt__comm_tcp *)dt__calloc(sizeof *t);
  if (!t) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_tcp: out of memory");
    return NULL;
  }
  t->lane2.fd = -1; /* before anything can free it */
  rc = dt__net_self_init(&t->self, cl, o);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__error(rc, "dt_comm_create_tcp: %.290s", why);
    dt__free(t, sizeof *t);
    return NULL;
  }
  world = (size_t)cl->workers;
  t->comm.vtable = &dt__comm_tcp_vtable;
  t->comm.world = cl->workers;
  t->comm.rank = cl->index;
  t->comm.impl = t;
  t->timeout_s = t->self.opt.timeout_s;
  /* Frames must fit the receivers' payload limit. */
  t->chunk_floats = DT__MIN(t->self.opt.chunk_bytes, t->self.opt.max_payload) / sizeof(float);
  if (t->chunk_floats < 16) t->chunk_floats = 16;
  t->small_bytes = DT__MIN(t->self.opt.small_bytes, t->self.opt.max_payload);
  scratch = DT__MAX(t->chunk_floats * sizeof(float), t->small_bytes);
  scratch = DT__MAX(scratch, (size_t)DT__TCP_CALL_BYTES) + DT__TCP_CALL_BYTES + 64; /* + a fused CALL frame's header */
  t->conns_bytes = world * sizeof(dt__conn);
  t->conns = (dt__conn *)dt__calloc(t->conns_bytes);
  for (size_t j = 0; t->conns && j < world; j++) t->conns[j].fd = -1; /* before anything can free them */
  t->peer_state = (unsigned char *)dt__calloc(world);
  t->pfd = (struct pollfd *)dt__calloc(world * sizeof(struct pollfd));
  t->pidx = (int *)dt__calloc(world * sizeof(int));
  t->scratch = (float *)dt__alloc(scratch);
  t->scratch_bytes = t->scratch ? scratch : 0;
  t->fused_max = DT__MIN(t->small_bytes, (size_t)DT__TCP_FUSED_MAX) & ~(size_t)3;
  if (t->fused_max + DT__TCP_CALL_BYTES > t->self.opt.max_payload) t->fused_max = 0;
  t->fout = (unsigned char *)dt__alloc(DT__TCP_CALL_BYTES + t->fused_max);
  t->fin = (unsigned char *)dt__alloc(DT__TCP_CALL_BYTES + t->fused_max);
  t->fkeep = (float *)dt__alloc(t->fused_max + sizeof(float));
  if (!t->conns || !t->peer_state || !t->pfd || !t->pidx || !t->scratch || !t->fout || !t->fin || !t->fkeep) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_comm_create_tcp: out of memory");
    dt__tcp_free(t);
    return NULL;
  }
  for (size_t j = 0; j < world; j++) {
    dt__conn_init(&t->conns[j], -1, t->self.job, t->self.id, (uint32_t)t->self.opt.max_payload);
    t->conns[j].fd = -1;
  }
  dt__conn_init(&t->lane2, -1, t->self.job, t->self.id, (uint32_t)t->self.opt.max_payload);
  t->lane2.fd = -1;
  t->lanes = world == 2 ? 2 : 1;
  rc = dt__tcp_connect_all(t);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__error(rc, "dt_comm_create_tcp: worker %d: %.280s", cl->index, why);
    dt__tcp_free(t);
    return NULL;
  }
  for (int j = 0; j < t->comm.world; j++) {
    t->conns[j].spin_s = t->self.opt.spin_us > 0 ? t->self.opt.spin_us * 1e-6 : 0.0;
    dt__net_set_bufs(t->conns[j].fd, t->self.opt.sock_buf_bytes);
  }
  t->lane2.spin_s = t->conns[0].spin_s;
  dt__net_set_bufs(t->lane2.fd, t->self.opt.sock_buf_bytes);
  t->self.cluster = NULL; /* the caller's; not needed after setup */
  t->self.opt.token = NULL;
  return &t->comm;
}

DTRAIN_API dt_comm *dt_comm_create_tcp(const dt_cluster *cl, const dt_net_options *o) {
  dt__quiet_push(); /* one log line for a failure, with its whole context */
  dt_comm *c = dt__tcp_create(cl, o);
  dt__quiet_pop(c ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return c;
}

#  undef DT__TCP_PENDING
#  undef DT__TCP_HELLO_FRAME
#  undef DT__TCP_CALL_BYTES
#  undef DT__TCP_NONE
#  undef DT__TCP_FUSED_MAX

#endif /* DTRAIN_NO_NET || DTRAIN_NO_THREADS */
/* ======== end dt_comm_tcp.c ======== */

/* ======== begin dt_comm_mpi.c ======== */
/* ===========================================================================
 * dt_comm_mpi.c -- the MPI communicator (DTRAIN_USE_MPI): dtrain's
 * collectives carried by MPI's on a duplicate of MPI_COMM_WORLD
 * ===========================================================================
 * One rank per process (rank and world from MPI_COMM_WORLD). The mapping:
 *
 *   allreduce       MPI_Allreduce (MPI_IN_PLACE, MPI_SUM)
 *   reduce_scatter  MPI_Reduce_scatter with dt_comm_slice counts (in place:
 *                   MPI leaves the slice at the start, moved to its place)
 *   allgather       MPI_Allgatherv in place with dt_comm_slice counts/displs
 *   reduce          MPI_Reduce (MPI_IN_PLACE at the root)
 *   broadcast       MPI_Bcast
 *   barrier         MPI_Barrier
 *
 * Counts above INT_MAX floats go in pieces (all-reduce, reduce, broadcast;
 * reduce-scatter falls back to a whole all-reduce, all-gather to one
 * broadcast per slice). The duplicate communicator has MPI_ERRORS_RETURN, so
 * a failing call returns DTRAIN_ERR_NET with MPI_Error_string's text, the
 * operation and its sequence number instead of killing the job (what MPI
 * itself can report about a lost process depends on the MPI library: many
 * still abort the whole job). dt_comm_abort only breaks this process's
 * communicator (later calls return DTRAIN_ERR_ABORTED): MPI has no way to
 * interrupt the other ranks short of MPI_Abort.
 *
 * Compiled only with DTRAIN_USE_MPI (and <mpi.h>: build with mpicc);
 * otherwise dt_comm_create_mpi fails with DTRAIN_ERR_UNSUPPORTED.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

#if defined(DTRAIN_USE_MPI)
/* C only: the deprecated MPI C++ bindings do not compile warning-free. */
#if defined(__cplusplus) && !defined(OMPI_SKIP_MPICXX)
#  define OMPI_SKIP_MPICXX 1
#endif
#if defined(__cplusplus) && !defined(MPICH_SKIP_MPICXX)
#  define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#define DT__MPI_PIECE ((size_t)1 << 30) /* floats per MPI call when n exceeds INT_MAX */

typedef struct dt__comm_mpi {
  dt_comm comm;
  MPI_Comm mc;          /* a duplicate of MPI_COMM_WORLD: our traffic never meets the user's */
  int finalize;         /* we called MPI_Init_thread: MPI_Finalize at destroy */
  int aborted;
  int *counts, *displs; /* dt_comm_slice sizes for the current n */
  size_t slices_n;      /* the n they were computed for ((size_t)-1: none) */
  uint64_t seq;         /* collectives started */
  dt_comm_stats stats;
} dt__comm_mpi;

static dt__comm_mpi *dt__comm_mpi_of(dt_comm *c) { return (dt__comm_mpi *)c->impl; }

/* Maps an MPI error code to a dt_result with MPI's own words. */
static dt_result dt__comm_mpi_error(dt__comm_mpi *m, const char *op, int code) {
  char text[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  if (len < 0) len = 0;
  if (len > MPI_MAX_ERROR_STRING) len = MPI_MAX_ERROR_STRING;
  text[len] = '\0';
  return dt__error(DTRAIN_ERR_NET, "mpi: %s #%llu (rank %d of %d) failed: %.200s (MPI error %d)", op,
                   (unsigned long long)m->seq, m->comm.rank, m->comm.world, len ? text : "unknown", code);
}

/* Common start of a collective: the rank check, the abort flag, counters. */
static dt_result dt__comm_mpi_begin(dt__comm_mpi *m, const char *op, int rank, size_t n) {
  if (rank != m->comm.rank)
    return dt__error(DTRAIN_ERR_INDEX, "mpi: %s: rank %d is not this process's rank (%d)", op, rank, m->comm.rank);
  if (m->aborted) return DTRAIN_ERR_ABORTED;
  m->seq++;
  m->stats.bytes += (uint64_t)n * sizeof(float);
  return DTRAIN_OK;
}

static dt_result dt__comm_mpi_end(dt__comm_mpi *m, double t0) {
  m->stats.calls++;
  m->stats.wait_s += dt__now() - t0;
  return DTRAIN_OK;
}

/* The slice counts and displacements for n floats (cached per n). */
static int dt__comm_mpi_slices(dt__comm_mpi *m, size_t n) {
  if (n > (size_t)INT_MAX) return 0;
  if (m->slices_n != n) {
    for (int r = 0; r < m->comm.world; r++) {
      size_t b, e;
      dt_comm_slice(n, m->comm.world, r, &b, &e);
      m->counts[r] = (int)(e - b);
      m->displs[r] = (int)b;
    }
    m->slices_n = n;
  }
  return 1;
}

static int dt__comm_mpi_bcast_pieces(dt__comm_mpi *m, float *buf, size_t n, int root) {
  for (size_t off = 0; off < n; off += DT__MPI_PIECE) {
    int rc = MPI_Bcast(buf + off, (int)DT__MIN(DT__MPI_PIECE, n - off), MPI_FLOAT, root, m->mc);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

static int dt__comm_mpi_allreduce_pieces(dt__comm_mpi *m, float *buf, size_t n) {
  for (size_t off = 0; off < n; off += DT__MPI_PIECE) {
    int rc = MPI_Allreduce(MPI_IN_PLACE, buf + off, (int)DT__MIN(DT__MPI_PIECE, n - off), MPI_FLOAT, MPI_SUM, m->mc);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

static dt_result dt__comm_mpi_allreduce(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "allreduce", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = dt__comm_mpi_allreduce_pieces(m, buf, n);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "allreduce", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_reduce_scatter(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "reduce_scatter", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc;
  if (dt__comm_mpi_slices(m, n)) {
    rc = MPI_Reduce_scatter(MPI_IN_PLACE, buf, m->counts, MPI_FLOAT, MPI_SUM, m->mc);
    /* In place, MPI leaves this rank's slice at the start of buf. */
    if (rc == MPI_SUCCESS && m->displs[rank] > 0 && m->counts[rank] > 0)
      memmove(buf + m->displs[rank], buf, (size_t)m->counts[rank] * sizeof(float));
  } else {
    rc = dt__comm_mpi_allreduce_pieces(m, buf, n); /* every slice summed: more than asked */
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "reduce_scatter", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_allgather(dt_comm *c, int rank, float *buf, size_t n) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "allgather", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_SUCCESS;
  if (dt__comm_mpi_slices(m, n)) {
    rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, m->counts, m->displs, MPI_FLOAT, m->mc);
  } else {
    for (int q = 0; rc == MPI_SUCCESS && q < c->world; q++) {
      size_t b, e;
      dt_comm_slice(n, c->world, q, &b, &e);
      rc = dt__comm_mpi_bcast_pieces(m, buf + b, e - b, q);
    }
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "allgather", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_reduce(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "reduce", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_SUCCESS;
  for (size_t off = 0; rc == MPI_SUCCESS && off < n; off += DT__MPI_PIECE) {
    int cnt = (int)DT__MIN(DT__MPI_PIECE, n - off);
    if (rank == root) rc = MPI_Reduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, MPI_SUM, root, m->mc);
    else rc = MPI_Reduce(buf + off, NULL, cnt, MPI_FLOAT, MPI_SUM, root, m->mc);
  }
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "reduce", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_broadcast(dt_comm *c, int rank, float *buf, size_t n, int root) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "broadcast", rank, n);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = dt__comm_mpi_bcast_pieces(m, buf, n, root);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "broadcast", rc);
  return dt__comm_mpi_end(m, t0);
}

static dt_result dt__comm_mpi_barrier(dt_comm *c, int rank) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  dt_result r = dt__comm_mpi_begin(m, "barrier", rank, 0);
  if (r != DTRAIN_OK) return r;
  double t0 = dt__now();
  int rc = MPI_Barrier(m->mc);
  if (rc != MPI_SUCCESS) return dt__comm_mpi_error(m, "barrier", rc);
  return dt__comm_mpi_end(m, t0);
}

static void dt__comm_mpi_abort(dt_comm *c, int rank) {
  (void)rank;
  dt__comm_mpi_of(c)->aborted = 1;
}

static dt_result dt__comm_mpi_recover(dt_comm *c) {
  dt__comm_mpi_of(c)->aborted = 0;
  return DTRAIN_OK;
}

static void dt__comm_mpi_stats(dt_comm *c, int rank, dt_comm_stats *out) {
  (void)rank;
  *out = dt__comm_mpi_of(c)->stats;
}

static void dt__comm_mpi_reset_stats(dt_comm *c) { memset(&dt__comm_mpi_of(c)->stats, 0, sizeof(dt_comm_stats)); }

static void dt__comm_mpi_free(dt__comm_mpi *m) {
  size_t ib = (size_t)(m->comm.world > 0 ? m->comm.world : 1) * sizeof(int);
  dt__free(m->counts, ib);
  dt__free(m->displs, ib);
  dt__free(m, sizeof *m);
}

static void dt__comm_mpi_destroy(dt_comm *c) {
  dt__comm_mpi *m = dt__comm_mpi_of(c);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Comm_free(&m->mc);
    if (m->finalize) MPI_Finalize();
  }
  dt__comm_mpi_free(m);
}

static const dt_comm_vtable dt__comm_mpi_vtable = {
  "mpi",
  dt__comm_mpi_allreduce,
  dt__comm_mpi_reduce_scatter,
  dt__comm_mpi_allgather,
  dt__comm_mpi_reduce,
  dt__comm_mpi_broadcast,
  dt__comm_mpi_barrier,
  dt__comm_mpi_abort,
  dt__comm_mpi_recover,
  dt__comm_mpi_stats,
  dt__comm_mpi_reset_stats,
  dt__comm_mpi_destroy
};

DTRAIN_API dt_comm *dt_comm_create_mpi(void) {
  const char *fn = "dt_comm_create_mpi";
  int inited = 0, finalized = 0, rc, we_init = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    dt__error(DTRAIN_ERR_STATE, "%s: MPI was already finalized", fn);
    return NULL;
  }
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    /* The strategy calls its communicator from one thread at a time. */
    rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      dt__error(DTRAIN_ERR_NET, "%s: MPI_Init_thread failed (MPI error %d)", fn, rc);
      return NULL;
    }
    we_init = 1;
  }
  dt__comm_mpi *m = (dt__comm_mpi *)dt__calloc(sizeof *m);
  int world = 0, rank = 0;
  if (!m) goto nomem;
  m->mc = MPI_COMM_NULL;
  m->finalize = we_init;
  m->slices_n = (size_t)-1;
  rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->mc);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->mc, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->mc, &world);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->mc, &rank);
  if (rc != MPI_SUCCESS) {
    dt__comm_mpi_error(m, "create (MPI_Comm_dup/size/rank)", rc);
    goto fail;
  }
  m->comm.vtable = &dt__comm_mpi_vtable;
  m->comm.world = world;
  m->comm.rank = rank;
  m->comm.impl = m;
  m->counts = (int *)dt__calloc((size_t)world * sizeof(int));
  m->displs = (int *)dt__calloc((size_t)world * sizeof(int));
  if (!m->counts || !m->displs) goto nomem;
  return &m->comm;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
fail:
  if (m) {
    if (m->mc != MPI_COMM_NULL) MPI_Comm_free(&m->mc);
    dt__comm_mpi_free(m);
  }
  if (we_init) MPI_Finalize();
  return NULL;
}

#undef DT__MPI_PIECE

#else /* !DTRAIN_USE_MPI */

DTRAIN_API dt_comm *dt_comm_create_mpi(void) {
  dt__error(DTRAIN_ERR_UNSUPPORTED,
            "dt_comm_create_mpi: built without DTRAIN_USE_MPI (compile with mpicc -DDTRAIN_USE_MPI)");
  return NULL;
}

#endif /* DTRAIN_USE_MPI */
/* ======== end dt_comm_mpi.c ======== */

/* ======== begin dt_ps.c ======== */
/* ===========================================================================
 * dt_ps.c -- parameter servers: shard assignment, the server loop
 * (dt_ps_serve) and the worker's TCP parameter store (dt_pstore_create_tcp)
 * ===========================================================================
 * The server is one thread running a poll loop over its listening socket,
 * connections still in the handshake and one connection per worker. It
 * reads a worker's frame whole when the socket is readable (deadline
 * timeout_s/2), never blocks on a send (each worker has an output buffer
 * flushed as its socket takes it), and answers requests when the staleness
 * bound allows: a request that must wait stays pending, and the server
 * sends that worker a heartbeat every timeout_s/4 so it knows the server
 * lives. The SSP rule is the one of the in-process store (dt_strategy.c):
 *
 *   pull for clock t:  every live worker pushed clock t-k-1 (pushed >= t-k)
 *   push of clock t:   every live worker pulled clock t-k   (pulled >= t-k+1)
 *                      and, when k = 0, every live worker j < w pushed t
 *
 * where "live" means not yet gone (BYE) or lost; a worker not yet connected
 * counts with clocks 0 (others wait for it, within the bound).
 *
 * Messages (after the transport handshake; little-endian):
 *   JOIN   0x50 w->s  32 B: i32 max_staleness, u32 0, u64 params floats,
 *                            u64 shard floats, u64 layout hash
 *   JOINED 0x51 s->w  32 B: u64 version, i64 optimizer steps, i32 max_staleness,
 *                            u32 live workers, u64 layout hash
 *   PULL   0x52 w->s  16 B: u64 clock, u64 0
 *   PARAMS 0x53 s->w  16 B + 4*shard: u64 version, i64 clock gap, f32[shard]
 *   PUSH   0x54 w->s  16 B (+ 4*shard): u64 clock, u64 version pulled, f32[shard]
 *                            (no floats: an empty push that only advances the clock)
 *   PUSHED 0x55 s->w  16 B: u64 version after, i64 staleness
 *   HEARTBEAT (0x07) both ways, BYE (0x08) w->s, REFUSE (0x05) s->w.
 * The shard's floats are its parameters' elements in parameter order.
 */
/* #include "dt_internal.h" (amalgamated) */
/* #include "dt_net_core.h" (amalgamated) */
/* #include "dt_platform.h" (amalgamated) */

enum {
  DT__PS_JOIN = 0x50,
  DT__PS_JOINED = 0x51,
  DT__PS_PULL = 0x52,
  DT__PS_PARAMS = 0x53,
  DT__PS_PUSH = 0x54,
  DT__PS_PUSHED = 0x55
};
#define DT__PS_FIX 16   /* fixed part of PULL, PARAMS, PUSH, PUSHED */
#define DT__PS_JOINLEN 32
#define DT__PS_CKPT_MAGIC 0x53505444u /* "DTPS" */
#define DT__PS_CKPT_HDR 64

/* Prefix the thread's last error (copied first: dt__error writes the buffer dt_last_error reads). */
static DT__UNUSED dt_result dt__ps_prefix(dt_result rc, const char *a, const char *b) {
  char keep[DT__MSG_CAP];
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  if (b) return dt__error(rc, "%s: %s: %s", a, b, keep);
  return dt__error(rc, "%s: %s", a, keep);
}

/* ---- shard assignment (also without networking) ----------------------------------------- */

DTRAIN_API dt_result dt_ps_shard(const dt_params *p, int servers, int *server_of) {
  const char *fn = "dt_ps_shard";
  if (!p || !server_of) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !p ? "params" : "server_of");
  if (servers < 1 || servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d servers (need 1..%d)", fn, servers, DTRAIN_MAX_PEERS);
  int n = dt_params_count(p);
  if (n <= 0) return DTRAIN_OK;
  int *order = (int *)dt__alloc((size_t)n * sizeof(int));
  uint64_t *load = (uint64_t *)dt__calloc((size_t)servers * sizeof(uint64_t));
  if (!order || !load) {
    dt__free(order, (size_t)n * sizeof(int));
    dt__free(load, (size_t)servers * sizeof(uint64_t));
    return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
  }
  size_t b = 0, e = 0;
  int tr, dec;
  /* Largest first, ties by index: insertion sort (parameter counts are small). */
  for (int i = 0; i < n; i++) {
    dt__params_range(p, i, &b, &e, &tr, &dec);
    size_t si = e - b;
    int j = i;
    while (j > 0) {
      size_t b2 = 0, e2 = 0;
      dt__params_range(p, order[j - 1], &b2, &e2, &tr, &dec);
      if (e2 - b2 >= si) break;
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
  for (int k = 0; k < n; k++) {
    int i = order[k], best = 0;
    for (int s = 1; s < servers; s++)
      if (load[s] < load[best]) best = s;
    dt__params_range(p, i, &b, &e, &tr, &dec);
    load[best] += (uint64_t)(e - b);
    server_of[i] = best;
  }
  dt__free(order, (size_t)n * sizeof(int));
  dt__free(load, (size_t)servers * sizeof(uint64_t));
  return DTRAIN_OK;
}

/* Floats of server s's shard. */
static DT__UNUSED size_t dt__ps_shard_floats(const dt_params *p, const int *owner, int s) {
  size_t n = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++)
    if (owner[i] == s) n += e - b;
  return n;
}

/* FNV-1a over the shard's parameter ranges, the params' size and the server count. */
static DT__UNUSED uint64_t dt__ps_layout_hash(const dt_params *p, const int *owner, int s, int servers) {
  uint64_t h = 1469598103934665603ULL;
  uint64_t v[4];
  size_t b, e;
  int tr, dec;
  v[0] = (uint64_t)dt_params_size(p);
  v[1] = (uint64_t)servers;
  v[2] = (uint64_t)s;
  v[3] = (uint64_t)dt_params_count(p);
  for (int k = 0; k < 4; k++)
    for (int j = 0; j < 8; j++) h = (h ^ ((v[k] >> (8 * j)) & 0xFF)) * 1099511628211ULL;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    v[0] = (uint64_t)i;
    v[1] = (uint64_t)b;
    v[2] = (uint64_t)e;
    v[3] = (uint64_t)tr;
    for (int k = 0; k < 4; k++)
      for (int j = 0; j < 8; j++) h = (h ^ ((v[k] >> (8 * j)) & 0xFF)) * 1099511628211ULL;
  }
  return h;
}

static DT__UNUSED int dt__ps_little_endian(void) {
  const uint16_t one = 1;
  unsigned char c;
  memcpy(&c, &one, 1);
  return c == 1;
}

/* Floats to little-endian bytes and back. */
static DT__UNUSED void dt__ps_put_floats(unsigned char *dst, const float *src, size_t n) {
  if (dt__ps_little_endian()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, src + i, 4);
    dt__le32_put(dst + 4 * i, u);
  }
}

static DT__UNUSED void dt__ps_get_floats(float *dst, const unsigned char *src, size_t n) {
  if (dt__ps_little_endian()) {
    if (n) memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t u = dt__le32_get(src + 4 * i);
    memcpy(dst + i, &u, 4);
  }
}

/* The shard of a full-layout buffer to bytes, and back (trainable_to, when
 * not NULL, receives the trainable parameters' floats instead of full). */
static DT__UNUSED void dt__ps_gather(const dt_params *p, const int *owner, int s, const float *full, unsigned char *out) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__ps_put_floats(out + 4 * off, full + b, e - b);
    off += e - b;
  }
}

static DT__UNUSED void dt__ps_scatter(const dt_params *p, const int *owner, int s, const unsigned char *in, float *full) {
  size_t off = 0, b, e;
  int tr, dec;
  for (int i = 0; dt__params_range(p, i, &b, &e, &tr, &dec); i++) {
    if (owner[i] != s) continue;
    dt__ps_get_floats(full + b, in + 4 * off, e - b);
    off += e - b;
  }
}

#if !defined(DTRAIN_NO_NET)
#  include <errno.h>
#  include <poll.h>
#  include <sys/socket.h>
#  include <sys/types.h>
#  include <unistd.h>
#  ifdef MSG_NOSIGNAL
#    define DT__PS_SEND_FLAGS MSG_NOSIGNAL
#  else
#    define DT__PS_SEND_FLAGS 0
#  endif

/* ============================================================================================
 * The server
 * ============================================================================================ */

enum { DT__PSW_NEW = 0, DT__PSW_LIVE, DT__PSW_DONE, DT__PSW_LOST };
enum { DT__PSP_NONE = 0, DT__PSP_PULL, DT__PSP_PUSH };
#  define DT__PS_PENDING 16 /* connections in the handshake at a time */

typedef struct dt__ps_worker {
  int state;
  int joined;
  dt__conn conn;
  int64_t pulled, pushed;   /* clocks: pulls / pushes made */
  int pend;                 /* DT__PSP_* */
  int64_t pend_clock;
  uint64_t pend_version;
  int pend_empty;
  double pend_since;
  double last_heard;        /* last frame from it, or our last answer */
  double last_sent;
  unsigned char *rx, *tx;
  size_t rx_cap, tx_cap, tx_len, tx_off;
} dt__ps_worker;

typedef struct dt__ps_server {
  dt__net_self self;
  const dt_cluster *c;
  dt_params *params;
  dt_optim *opt;
  dt_ps_options po;
  int *owner;
  int np, W, me;
  size_t shard;
  uint64_t layout;
  dt__ps_worker *w;
  unsigned char *seen;
  int lfd, own_lfd;
  int k, k_set;
  uint64_t version;
  int64_t since_ckpt;
  double last_ckpt;
  unsigned char *ckpt;
  size_t ckpt_bytes;
  char ckpt_path[1024];
  int pfd[DT__PS_PENDING];
  double pt[DT__PS_PENDING];
  char paddr[DT__PS_PENDING][DT__NET_ADDR];
  int npend;
  int done;
} dt__ps_server;

static int dt__ps_live_count(const dt__ps_server *S) {
  int n = 0;
  for (int i = 0; i < S->W; i++)
    if (S->w[i].state == DT__PSW_NEW || S->w[i].state == DT__PSW_LIVE) n++;
  return n;
}

static void dt__ps_worker_free(dt__ps_server *S, dt__ps_worker *w) {
  (void)S;
  dt__conn_close(&w->conn);
  dt__free(w->rx, w->rx_cap);
  dt__free(w->tx, w->tx_cap);
  w->rx = w->tx = NULL;
  w->rx_cap = w->tx_cap = w->tx_len = w->tx_off = 0;
  w->pend = DT__PSP_NONE;
}

static void dt__ps_worker_name(const dt__ps_server *S, int i, char *buf, size_t cap) {
  const dt__ps_worker *w = &S->w[i];
  if (w->conn.peer_role >= 0) snprintf(buf, cap, "%.95s", w->conn.peer);
  else snprintf(buf, cap, "worker %d (%.80s)", i, S->c->worker_addr[i] ? S->c->worker_addr[i] : "?");
}

/* Drop worker i from training: logged, out of the clocks. */
static void dt__ps_lose(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  char name[DT__NET_ADDR];
  dt__ps_worker_name(S, i, name, sizeof name);
  dt__ps_worker_free(S, w);
  w->state = DT__PSW_LOST;
  int left = dt__ps_live_count(S);
  dt__log(DTRAIN_LOG_WARN, code, "ps %d: %s lost: %s; going on with %d worker%s", S->me, name, why, left,
          left == 1 ? "" : "s");
}

/* Write as much of worker i's output as the socket takes. 0 when the worker was lost. */
static int dt__ps_flush(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  while (w->tx_off < w->tx_len) {
    ssize_t k = send(w->conn.fd, w->tx + w->tx_off, w->tx_len - w->tx_off, DT__PS_SEND_FLAGS);
    if (k > 0) {
      w->tx_off += (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
    char why[160];
    snprintf(why, sizeof why, "send failed: %.120s", k < 0 ? strerror(errno) : "connection closed");
    dt__ps_lose(S, i, DTRAIN_ERR_PEER, why);
    return 0;
  }
  w->tx_off = w->tx_len = 0;
  return 1;
}

/* Queue one frame for worker i: the fixed part, then n floats of the shard gathered from full (if any). */
static int dt__ps_queue(dt__ps_server *S, int i, uint16_t type, const unsigned char *fix, uint32_t fixn,
                        const float *full) {
  dt__ps_worker *w = &S->w[i];
  uint32_t len = fixn + (full ? (uint32_t)(S->shard * 4) : 0u);
  if (w->tx_off == w->tx_len) w->tx_off = w->tx_len = 0;
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    memmove(w->tx, w->tx + w->tx_off, w->tx_len - w->tx_off);
    w->tx_len -= w->tx_off;
    w->tx_off = 0;
  }
  if (w->tx_len + DT__NET_HDR + len > w->tx_cap) {
    dt__ps_lose(S, i, DTRAIN_ERR_INTERNAL, "output buffer overflow");
    return 0;
  }
  unsigned char *h = w->tx + w->tx_len, *pl = h + DT__NET_HDR;
  if (fixn) memcpy(pl, fix, fixn);
  if (full) dt__ps_gather(S->params, S->owner, S->me, full, pl + fixn);
  dt__frame_pack(h, type, w->conn.job, w->conn.self_id, w->conn.send_seq, pl, len);
  w->conn.send_seq++;
  w->tx_len += DT__NET_HDR + len;
  w->last_sent = dt__now();
  return dt__ps_flush(S, i);
}

/* ---- checkpoints ------------------------------------------------------------------------ */

static int dt__ps_slots(const dt__ps_server *S) { return dt_optim_state_slots(S->opt); }

#  ifndef DTRAIN_NO_STDIO
static dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  unsigned char *b = S->ckpt;
  int slots = dt__ps_slots(S);
  memset(b, 0, DT__PS_CKPT_HDR);
  dt__le32_put(b, DT__PS_CKPT_MAGIC);
  dt__le32_put(b + 4, 1);
  dt__le32_put(b + 8, (uint32_t)S->me);
  dt__le32_put(b + 12, (uint32_t)S->c->servers);
  dt__le64_put(b + 16, (uint64_t)dt_params_size(S->params));
  dt__le64_put(b + 24, (uint64_t)S->shard);
  dt__le64_put(b + 32, S->layout);
  dt__le64_put(b + 40, S->version);
  dt__le64_put(b + 48, (uint64_t)dt_optim_steps(S->opt));
  dt__le32_put(b + 56, (uint32_t)slots);
  size_t off = DT__PS_CKPT_HDR;
  dt__ps_gather(S->params, S->owner, S->me, dt_params_data(S->params), b + off);
  off += S->shard * 4;
  for (int k = 0; k < slots; k++) {
    dt__ps_gather(S->params, S->owner, S->me, dt_optim_state(S->opt, k), b + off);
    off += S->shard * 4;
  }
  dt__le32_put(b + off, dt__crc32c(0, b, off));
  off += 4;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%.1024s.tmp", S->ckpt_path);
  FILE *f = fopen(tmp, "wb");
  if (!f) return dt__error(DTRAIN_ERR_IO, "ps %d: cannot create '%s': %s", S->me, tmp, strerror(errno));
  int ok = fwrite(b, 1, off, f) == off && fflush(f) == 0;
  if (ok) {
    int rc;
    do rc = fsync(fileno(f)); while (rc != 0 && errno == EINTR);
  }
  if (fclose(f) != 0) ok = 0;
  if (!ok || rename(tmp, S->ckpt_path) != 0) {
    int saved = errno;
    remove(tmp);
    return dt__error(DTRAIN_ERR_IO, "ps %d: writing the checkpoint '%s' failed: %s", S->me, S->ckpt_path,
                     strerror(saved));
  }
  S->since_ckpt = 0;
  S->last_ckpt = dt__now();
  return DTRAIN_OK;
}

/* Resume from the checkpoint when it exists: DTRAIN_OK (also when there is none). */
static dt_result dt__ps_ckpt_read(dt__ps_server *S) {
  FILE *f = fopen(S->ckpt_path, "rb");
  if (!f) return DTRAIN_OK;
  unsigned char *b = S->ckpt;
  size_t got = fread(b, 1, S->ckpt_bytes, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  const char *p = S->ckpt_path;
  if (got < DT__PS_CKPT_HDR + 4 || dt__le32_get(b) != DT__PS_CKPT_MAGIC || dt__le32_get(b + 4) != 1)
    return dt__error(DTRAIN_ERR_FORMAT, "ps %d: '%s' is not a dtrain parameter-server checkpoint", S->me, p);
  if (dt__le32_get(b + 8) != (uint32_t)S->me || dt__le32_get(b + 12) != (uint32_t)S->c->servers ||
      dt__le64_get(b + 16) != (uint64_t)dt_params_size(S->params) || dt__le64_get(b + 24) != (uint64_t)S->shard ||
      dt__le64_get(b + 32) != S->layout || dt__le32_get(b + 56) != (uint32_t)dt__ps_slots(S))
    return dt__error(DTRAIN_ERR_MISMATCH,
                     "ps %d: checkpoint '%s' is shard %u of %u servers with %llu floats (%u optimizer slots); this "
                     "server is shard %d of %d with %zu floats (%d slots) of another layout or model",
                     S->me, p, (unsigned)dt__le32_get(b + 8), (unsigned)dt__le32_get(b + 12),
                     (unsigned long long)dt__le64_get(b + 24), (unsigned)dt__le32_get(b + 56), S->me, S->c->servers,
                     S->shard, dt__ps_slots(S));
  if (got != S->ckpt_bytes || extra || dt__le32_get(b + got - 4) != dt__crc32c(0, b, got - 4))
    return dt__error(DTRAIN_ERR_CORRUPT, "ps %d: checkpoint '%s' is truncated or corrupt (checksum)", S->me, p);
  S->version = dt__le64_get(b + 40);
  dt_optim_set_steps(S->opt, (int64_t)dt__le64_get(b + 48));
  size_t off = DT__PS_CKPT_HDR;
  dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_params_data(S->params));
  off += S->shard * 4;
  for (int k = 0; k < dt__ps_slots(S); k++) {
    dt__ps_scatter(S->params, S->owner, S->me, b + off, dt_optim_state(S->opt, k));
    off += S->shard * 4;
  }
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: resumed from '%s' (%llu updates, optimizer step %lld)", S->me, p,
          (unsigned long long)S->version, (long long)dt_optim_steps(S->opt));
  return DTRAIN_OK;
}
#  else
static dt_result dt__ps_ckpt_write(dt__ps_server *S) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "ps %d: checkpoints need stdio (built with DTRAIN_NO_STDIO)", S->me);
}
static dt_result dt__ps_ckpt_read(dt__ps_server *S) { return dt__ps_ckpt_write(S); }
#  endif

static void dt__ps_maybe_ckpt(dt__ps_server *S) {
  if (!S->ckpt) return;
  int due = (S->po.checkpoint_every > 0 && S->since_ckpt >= S->po.checkpoint_every) ||
            (S->po.checkpoint_seconds > 0 && dt__now() - S->last_ckpt >= S->po.checkpoint_seconds);
  if (due && dt__ps_ckpt_write(S) != DTRAIN_OK) {
    dt__log(DTRAIN_LOG_WARN, dt_last_result(), "%s", dt_last_error());
    S->since_ckpt = 0;
    S->last_ckpt = dt__now();
  }
}

/* ---- the staleness rule ------------------------------------------------------------------- */

static int64_t dt__ps_min_clock(const dt__ps_server *S, int pushed) {
  int64_t m = INT64_MAX;
  for (int j = 0; j < S->W; j++) {
    const dt__ps_worker *w = &S->w[j];
    if (w->state != DT__PSW_NEW && w->state != DT__PSW_LIVE) continue;
    int64_t v = pushed ? w->pushed : w->pulled;
    if (v < m) m = v;
  }
  return m;
}

static int dt__ps_can_serve(const dt__ps_server *S, int i) {
  const dt__ps_worker *w = &S->w[i];
  int64_t t = w->pend_clock, k = S->k;
  if (k < 0) return 1;
  if (w->pend == DT__PSP_PULL) return dt__ps_min_clock(S, 1) >= t - k;
  if (dt__ps_min_clock(S, 0) < t - k + 1) return 0;
  if (k == 0)
    for (int j = 0; j < i; j++) {
      const dt__ps_worker *o = &S->w[j];
      if ((o->state == DT__PSW_NEW || o->state == DT__PSW_LIVE) && o->pushed < t + 1) return 0;
    }
  return 1;
}

/* Answer worker i's pending request. 0 when the worker was lost; -1 on a fatal error. */
static int dt__ps_serve_one(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  unsigned char fix[DT__PS_FIX];
  int64_t t = w->pend_clock;
  double now = dt__now();
  if (w->pend == DT__PSP_PULL) {
    int64_t slowest = dt__ps_min_clock(S, 1);
    int64_t gap = slowest == INT64_MAX ? 0 : DT__MAX(t - slowest, (int64_t)0);
    dt__le64_put(fix, S->version);
    dt__le64_put(fix + 8, (uint64_t)gap);
    if (w->pulled < t + 1) w->pulled = t + 1;
    w->pend = DT__PSP_NONE;
    w->last_heard = now;
    return dt__ps_queue(S, i, DT__PS_PARAMS, fix, DT__PS_FIX, dt_params_data(S->params));
  }
  uint64_t before = S->version;
  if (!w->pend_empty) {
    float *data = dt_params_data(S->params), *grad = dt_params_grad(S->params);
    const unsigned char *in = w->rx + DT__PS_FIX;
    size_t off = 0, b, e;
    int tr, dec;
    for (int p = 0; dt__params_range(S->params, p, &b, &e, &tr, &dec); p++) {
      if (S->owner[p] != S->me) continue;
      if (tr) {
        dt__ps_get_floats(grad + b, in + 4 * off, e - b);
        if (dt_optim_update(S->opt, data, grad, b, e) != DTRAIN_OK) return -1;
      } else {
        dt__ps_get_floats(data + b, in + 4 * off, e - b);
      }
      off += e - b;
    }
    dt_optim_advance(S->opt);
  }
  S->version++;
  S->since_ckpt++;
  int64_t stale = w->pend_version <= before ? (int64_t)(before - w->pend_version) : 0;
  if (w->pulled < t + 1) w->pulled = t + 1;
  w->pushed = t + 1;
  w->pend = DT__PSP_NONE;
  w->last_heard = now;
  dt__ps_maybe_ckpt(S); /* before the answer: an acknowledged update is in the checkpoint when every == 1 */
  dt__le64_put(fix, S->version);
  dt__le64_put(fix + 8, (uint64_t)stale);
  return dt__ps_queue(S, i, DT__PS_PUSHED, fix, DT__PS_FIX, NULL);
}

/* Answer every request the bound allows, until none can be answered. */
static dt_result dt__ps_progress(dt__ps_server *S) {
  for (int again = 1; again;) {
    again = 0;
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      if (w->state != DT__PSW_LIVE || w->pend == DT__PSP_NONE || !dt__ps_can_serve(S, i)) continue;
      int r = dt__ps_serve_one(S, i);
      if (r < 0) return dt_last_result();
      again = 1;
    }
  }
  return DTRAIN_OK;
}

/* ---- frames from workers ------------------------------------------------------------------- */

/* Refuse worker i at JOIN: the connection is closed and logged, and the
 * worker's slot is free again (a correct worker may still come). */
static void dt__ps_refuse(dt__ps_server *S, int i, dt_result code, const char *why) {
  dt__ps_worker *w = &S->w[i];
  unsigned char buf[4 + 256];
  size_t tl = strlen(why);
  if (tl > 256) tl = 256;
  dt__le32_put(buf, (uint32_t)(-(int32_t)code));
  memcpy(buf + 4, why, tl);
  dt__conn_send(&w->conn, DT__MSG_REFUSE, buf, (uint32_t)(4 + tl), dt__now() + 0.2, "refuse");
  if (!S->self.opt.quiet) dt__log(DTRAIN_LOG_WARN, code, "ps %d: refused %s: %s", S->me, w->conn.peer, why);
  dt__ps_worker_free(S, w);
  dt__conn_init(&w->conn, -1, S->self.job, S->self.id, (uint32_t)S->self.opt.max_payload);
  w->state = DT__PSW_NEW;
  w->joined = 0;
  w->pulled = w->pushed = 0;
  S->seen[i] = 0;
}

static void dt__ps_on_join(dt__ps_server *S, int i, const unsigned char *b) {
  dt__ps_worker *w = &S->w[i];
  char why[DT__MSG_CAP];
  int k = (int)(int32_t)dt__le32_get(b);
  uint64_t total = dt__le64_get(b + 8), shard = dt__le64_get(b + 16), layout = dt__le64_get(b + 24);
  if (total != (uint64_t)dt_params_size(S->params) || shard != (uint64_t)S->shard || layout != S->layout) {
    snprintf(why, sizeof why,
             "its model has %llu floats and a shard of %llu for ps %d, this server's has %zu and %zu (different "
             "models or layouts)",
             (unsigned long long)total, (unsigned long long)shard, S->me, dt_params_size(S->params), S->shard);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (k < DTRAIN_STALENESS_UNBOUNDED) {
    snprintf(why, sizeof why, "it asks for max_staleness %d", k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  if (S->k_set && k != S->k) {
    snprintf(why, sizeof why, "it asks for max_staleness %d, the other workers for %d", k, S->k);
    dt__ps_refuse(S, i, DTRAIN_ERR_MISMATCH, why);
    return;
  }
  S->k = k;
  S->k_set = 1;
  w->rx_cap = DT__PS_FIX + S->shard * 4;
  w->tx_cap = 4 * DT__NET_HDR + 2 * DT__PS_FIX + DT__PS_JOINLEN + S->shard * 4;
  w->rx = (unsigned char *)dt__alloc(w->rx_cap);
  w->tx = (unsigned char *)dt__alloc(w->tx_cap);
  if (!w->rx || !w->tx) {
    dt__ps_refuse(S, i, DTRAIN_ERR_NOMEM, "the server is out of memory");
    return;
  }
  w->joined = 1;
  unsigned char out[DT__PS_JOINLEN];
  memset(out, 0, sizeof out);
  dt__le64_put(out, S->version);
  dt__le64_put(out + 8, (uint64_t)dt_optim_steps(S->opt));
  dt__le32_put(out + 16, (uint32_t)(int32_t)S->k);
  dt__le32_put(out + 20, (uint32_t)dt__ps_live_count(S));
  dt__le64_put(out + 24, S->layout);
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s joined (max_staleness %d)", S->me, w->conn.peer, S->k);
  dt__ps_queue(S, i, DT__PS_JOINED, out, DT__PS_JOINLEN, NULL);
}

/* Read one frame from worker i (its socket is readable). */
static void dt__ps_on_readable(dt__ps_server *S, int i) {
  dt__ps_worker *w = &S->w[i];
  dt__frame f;
  unsigned char h[DT__NET_HDR];
  char op[64], why[DT__MSG_CAP];
  double deadline = dt__now() + S->self.opt.timeout_s / 2;
  snprintf(op, sizeof op, "ps %d", S->me);
  dt_result rc = dt__conn_recv_header(&w->conn, &f, h, deadline, op);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, rc, why);
    return;
  }
  uint32_t want_max = 0;
  int ok_type = 1;
  switch (f.type) {
    case DT__MSG_HEARTBEAT:
    case DT__MSG_BYE: want_max = 0; break;
    case DT__PS_JOIN: want_max = DT__PS_JOINLEN; ok_type = !w->joined; break;
    case DT__PS_PULL: want_max = DT__PS_FIX; ok_type = w->joined && w->pend == DT__PSP_NONE; break;
    case DT__PS_PUSH: want_max = (uint32_t)w->rx_cap; ok_type = w->joined && w->pend == DT__PSP_NONE; break;
    default: ok_type = 0;
  }
  int exact = f.type == DT__PS_JOIN || f.type == DT__PS_PULL;
  int bad_len = f.length > want_max || (exact && f.length != want_max) ||
                (f.type == DT__PS_PUSH && f.length != DT__PS_FIX && f.length != want_max);
  if (!ok_type || bad_len) {
    snprintf(why, sizeof why, "%s: protocol violation: a frame of type 0x%02x and %u bytes %s", op, (unsigned)f.type,
             (unsigned)f.length, ok_type ? "(wrong length)" : (w->joined ? "out of turn" : "before joining"));
    dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
    return;
  }
  unsigned char small[DT__PS_JOINLEN];
  unsigned char *dst = f.type == DT__PS_PUSH ? w->rx : small;
  rc = dt__conn_recv_payload(&w->conn, &f, h, dst, deadline, op);
  if (rc != DTRAIN_OK) {
    char why[DT__MSG_CAP];
    snprintf(why, sizeof why, "%s", dt_last_error());
    dt__ps_lose(S, i, rc, why);
    return;
  }
  w->last_heard = dt__now();
  switch (f.type) {
    case DT__MSG_BYE: {
      char name[DT__NET_ADDR];
      dt__ps_worker_name(S, i, name, sizeof name);
      dt__ps_worker_free(S, w);
      w->state = DT__PSW_DONE;
      S->done++;
      dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: %s finished (BYE)", S->me, name);
      break;
    }
    case DT__PS_JOIN: dt__ps_on_join(S, i, small); break;
    case DT__PS_PULL:
    case DT__PS_PUSH: {
      int64_t t = (int64_t)dt__le64_get(dst);
      if (t < 0 || (f.type == DT__PS_PUSH && t < w->pushed)) {
        snprintf(why, sizeof why, "%s: protocol violation: %s for clock %lld after a push of clock %lld", op,
                 f.type == DT__PS_PUSH ? "push" : "pull", (long long)t, (long long)w->pushed - 1);
        dt__ps_lose(S, i, DTRAIN_ERR_PROTOCOL, why);
        return;
      }
      w->pend = f.type == DT__PS_PULL ? DT__PSP_PULL : DT__PSP_PUSH;
      w->pend_clock = t;
      w->pend_version = dt__le64_get(dst + 8);
      w->pend_empty = f.length == DT__PS_FIX && S->shard > 0;
      if (f.type == DT__PS_PUSH && S->shard == 0) w->pend_empty = 1;
      w->pend_since = w->last_heard;
      break;
    }
    default: break; /* heartbeat */
  }
}

/* ---- connections ------------------------------------------------------------------------------ */

static void dt__ps_drop_pending(dt__ps_server *S, int j) {
  S->pfd[j] = S->pfd[S->npend - 1];
  S->pt[j] = S->pt[S->npend - 1];
  memcpy(S->paddr[j], S->paddr[S->npend - 1], DT__NET_ADDR);
  S->npend--;
}

static void dt__ps_accept(dt__ps_server *S) {
  int fd;
  char addr[DT__NET_ADDR];
  if (dt__net_accept(S->lfd, dt__now() + 0.01, &fd, addr, sizeof addr) != DTRAIN_OK) return;
  if (S->npend == DT__PS_PENDING) {
    /* Too many silent clients: the oldest goes. */
    int old = 0;
    for (int j = 1; j < S->npend; j++)
      if (S->pt[j] < S->pt[old]) old = j;
    if (!S->self.opt.quiet)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "ps %d: refused a connection from %s: too many connections in "
              "the handshake", S->me, S->paddr[old]);
    dt__net_close(S->pfd[old]);
    dt__ps_drop_pending(S, old);
  }
  S->pfd[S->npend] = fd;
  S->pt[S->npend] = dt__now();
  snprintf(S->paddr[S->npend], DT__NET_ADDR, "%s", addr);
  S->npend++;
}

static void dt__ps_admit(dt__ps_server *S, int j) {
  int fd = S->pfd[j];
  char addr[DT__NET_ADDR];
  snprintf(addr, sizeof addr, "%s", S->paddr[j]);
  dt__ps_drop_pending(S, j);
  dt__conn c;
  if (dt__net_admit(&S->self, fd, addr, dt__now() + S->self.opt.timeout_s / 2, S->seen, &c) != DTRAIN_OK) return;
  if (c.peer_role != DTRAIN_ROLE_WORKER || S->w[c.peer_index].state != DT__PSW_NEW) {
    if (!S->self.opt.quiet)
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_PROTOCOL, "ps %d: refused %s: %s", S->me, c.peer,
              c.peer_role != DTRAIN_ROLE_WORKER ? "only workers talk to a server" : "that worker already left");
    dt__conn_close(&c);
    return;
  }
  dt__ps_worker *w = &S->w[c.peer_index];
  w->conn = c;
  w->state = DT__PSW_LIVE;
  w->joined = 0;
  w->last_heard = w->last_sent = dt__now();
}

/* ---- the loop ----------------------------------------------------------------------------------- */

static void dt__ps_server_free(dt__ps_server *S) {
  if (S->w) {
    for (int i = 0; i < S->W; i++) dt__ps_worker_free(S, &S->w[i]);
    dt__free(S->w, (size_t)S->W * sizeof(dt__ps_worker));
  }
  for (int j = 0; j < S->npend; j++) dt__net_close(S->pfd[j]);
  S->npend = 0;
  if (S->own_lfd) dt__net_close(S->lfd);
  dt__free(S->seen, (size_t)S->W);
  dt__free(S->owner, (size_t)(S->np > 0 ? S->np : 1) * sizeof(int));
  dt__free(S->ckpt, S->ckpt_bytes);
}

static dt_result dt__ps_loop(dt__ps_server *S) {
  const double T = S->self.opt.timeout_s;
  const double start = dt__now();
  double tick = T / 8 < 0.25 ? T / 8 : 0.25;
  if (tick < 0.005) tick = 0.005;
  size_t cap = 1 + (size_t)DT__PS_PENDING + (size_t)S->W;
  struct pollfd *pf = (struct pollfd *)dt__alloc(cap * sizeof(struct pollfd));
  int *who = (int *)dt__alloc(cap * sizeof(int));
  dt_result rc = DTRAIN_OK;
  if (!pf || !who) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "dt_ps_serve: ps %d: out of memory", S->me);
    goto out;
  }
  while (dt__ps_live_count(S) > 0) {
    double now = dt__now();
    /* Deadlines: workers that never came, went silent, or stopped reading. */
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      char why[160];
      if (w->state == DT__PSW_NEW && now - start > S->self.opt.connect_timeout_s) {
        snprintf(why, sizeof why, "it did not connect within %.1f s", S->self.opt.connect_timeout_s);
        dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
      } else if (w->state == DT__PSW_LIVE) {
        if (w->tx_off < w->tx_len && now - w->last_sent > T) {
          snprintf(why, sizeof why, "it read nothing for %.1f s (deadline)", now - w->last_sent);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->pend == DT__PSP_NONE && now - w->last_heard > T) {
          snprintf(why, sizeof why, "nothing heard for %.1f s (deadline %.1f s)", now - w->last_heard, T);
          dt__ps_lose(S, i, DTRAIN_ERR_TIMEOUT, why);
        } else if (w->pend != DT__PSP_NONE && w->tx_off == w->tx_len && now - w->last_sent > T / 4) {
          dt__ps_queue(S, i, DT__MSG_HEARTBEAT, NULL, 0, NULL);
        }
      }
    }
    for (int j = 0; j < S->npend;) {
      if (now - S->pt[j] > T) {
        if (!S->self.opt.quiet)
          dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_TIMEOUT, "ps %d: refused a connection from %s: it sent nothing for "
                  "%.1f s", S->me, S->paddr[j], now - S->pt[j]);
        dt__net_close(S->pfd[j]);
        dt__ps_drop_pending(S, j);
      } else {
        j++;
      }
    }
    /* Losing a worker may let others go on. */
    rc = dt__ps_progress(S);
    if (rc != DTRAIN_OK || dt__ps_live_count(S) == 0) break;
    int n = 0;
    pf[n].fd = S->lfd;
    pf[n].events = POLLIN;
    who[n++] = -1;
    for (int j = 0; j < S->npend; j++) {
      pf[n].fd = S->pfd[j];
      pf[n].events = POLLIN;
      who[n++] = -2 - j;
    }
    for (int i = 0; i < S->W; i++) {
      dt__ps_worker *w = &S->w[i];
      if (w->state != DT__PSW_LIVE) continue;
      pf[n].fd = w->conn.fd;
      pf[n].events = (short)(POLLIN | (w->tx_off < w->tx_len ? POLLOUT : 0));
      who[n++] = i;
    }
    for (int j = 0; j < n; j++) pf[j].revents = 0;
    int pr = poll(pf, (nfds_t)n, (int)(tick * 1000.0) + 1);
    if (pr < 0 && errno != EINTR) {
      rc = dt__error(DTRAIN_ERR_NET, "dt_ps_serve: ps %d: poll: %s", S->me, strerror(errno));
      break;
    }
    if (pr <= 0) continue;
    /* Workers first (their pending-fd indices do not move), then handshakes, then new connections. */
    for (int j = 0; j < n; j++) {
      int i = who[j];
      if (i < 0 || S->w[i].state != DT__PSW_LIVE) continue;
      if ((pf[j].revents & POLLOUT) && !dt__ps_flush(S, i)) continue;
      if (pf[j].revents & (POLLIN | POLLERR | POLLHUP)) dt__ps_on_readable(S, i);
    }
    /* At most one handshake per round: each may block up to timeout/2 on a
     * slow client, and the workers' heartbeats go out between rounds. */
    for (int j = n - 1; j > 0; j--) {
      if (who[j] > -2 || !(pf[j].revents & (POLLIN | POLLERR | POLLHUP))) continue;
      dt__ps_admit(S, -2 - who[j]);
      break;
    }
    if (pf[0].revents & POLLIN) dt__ps_accept(S);
    rc = dt__ps_progress(S);
    if (rc != DTRAIN_OK) break;
  }
  /* Flush the last answers (best effort, briefly). */
  for (int i = 0; i < S->W; i++) {
    dt__ps_worker *w = &S->w[i];
    if (w->state == DT__PSW_LIVE && w->tx_off < w->tx_len)
      dt__net_write(w->conn.fd, w->tx + w->tx_off, w->tx_len - w->tx_off, dt__now() + 0.2);
  }
out:
  dt__free(pf, cap * sizeof(struct pollfd));
  dt__free(who, cap * sizeof(int));
  return rc;
}

static dt_result dt__ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  const char *fn = "dt_ps_serve";
  if (!c || !params || !opt)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !c ? "cluster" : !params ? "params" : "opt");
  if (c->role != DTRAIN_ROLE_PS || c->servers < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: this process is not a server of the cluster (role %s, %d servers)",
                     fn, c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->servers);
  dt__ps_server S;
  memset(&S, 0, sizeof S);
  S.lfd = -1;
  dt_result rc = dt__net_self_init(&S.self, c, o);
  if (rc != DTRAIN_OK) return dt__ps_prefix(rc, fn, NULL);
  S.c = c;
  S.params = params;
  S.opt = opt;
  if (po) S.po = *po;
  S.me = c->index;
  S.W = c->workers;
  S.np = dt_params_count(params);
  S.k = 0;
  S.owner = (int *)dt__alloc((size_t)(S.np > 0 ? S.np : 1) * sizeof(int));
  S.w = (dt__ps_worker *)dt__calloc((size_t)S.W * sizeof(dt__ps_worker));
  S.seen = (unsigned char *)dt__calloc((size_t)S.W);
  if (!S.owner || !S.w || !S.seen) {
    rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory", fn, S.me);
    goto done;
  }
  for (int i = 0; i < S.W; i++) {
    dt__conn_init(&S.w[i].conn, -1, S.self.job, S.self.id, (uint32_t)S.self.opt.max_payload);
  }
  rc = dt_ps_shard(params, c->servers, S.owner);
  if (rc != DTRAIN_OK) goto done;
  S.shard = dt__ps_shard_floats(params, S.owner, S.me);
  S.layout = dt__ps_layout_hash(params, S.owner, S.me, c->servers);
  if (DT__PS_FIX + S.shard * 4 > S.self.opt.max_payload) {
    rc = dt__error(DTRAIN_ERR_OVERFLOW, "%s: ps %d: a shard of %zu floats exceeds max_payload (%zu bytes); use more "
                   "servers or raise it", fn, S.me, S.shard, S.self.opt.max_payload);
    goto done;
  }
  if (S.po.checkpoint_dir && S.po.checkpoint_dir[0]) {
    S.ckpt_bytes = DT__PS_CKPT_HDR + (size_t)(1 + dt__ps_slots(&S)) * S.shard * 4 + 4;
    S.ckpt = (unsigned char *)dt__alloc(S.ckpt_bytes);
    if (!S.ckpt) {
      rc = dt__error(DTRAIN_ERR_NOMEM, "%s: ps %d: out of memory for the checkpoint buffer", fn, S.me);
      goto done;
    }
    snprintf(S.ckpt_path, sizeof S.ckpt_path, "%.900s/ps-%d-of-%d.ckpt", S.po.checkpoint_dir, S.me, c->servers);
    if (!S.po.no_resume) {
      rc = dt__ps_ckpt_read(&S);
      if (rc != DTRAIN_OK) goto done;
    }
    S.last_ckpt = dt__now();
  }
  rc = dt__net_self_listen(&S.self, &S.lfd);
  if (rc != DTRAIN_OK) {
    char who[32];
    snprintf(who, sizeof who, "ps %d", S.me);
    rc = dt__ps_prefix(rc, fn, who);
    goto done;
  }
  S.own_lfd = S.self.opt.listen_fd < 0;
  dt__log(DTRAIN_LOG_INFO, DTRAIN_OK, "ps %d: serving %zu floats of %d parameters to %d workers", S.me, S.shard,
          S.np, S.W);
  rc = dt__ps_loop(&S);
  if (rc == DTRAIN_OK && S.ckpt) {
    rc = dt__ps_ckpt_write(&S);
  }
  if (rc == DTRAIN_OK && S.done == 0)
    rc = dt__error(DTRAIN_ERR_PEER, "%s: ps %d: every worker was lost (none finished with BYE)", fn, S.me);
done:
  {
    char keep[DT__MSG_CAP];
    snprintf(keep, sizeof keep, "%s", dt_last_error());
    dt__ps_server_free(&S);
    if (rc != DTRAIN_OK) dt__error(rc, "%s", keep);
  }
  return rc;
}

DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  dt__quiet_push(); /* one log line for a failure, with its whole context (warnings are logged as they happen) */
  return dt__quiet_pop(dt__ps_serve(c, params, opt, o, po));
}

/* ============================================================================================
 * The worker's store
 * ============================================================================================ */

typedef struct dt__ps_client {
  dt_pstore ps;
  dt_params *params;
  int M, me;
  double timeout;
  int *owner;
  int np;
  dt__conn *conn;
  size_t *shard;
  unsigned char **buf;
  size_t *buf_cap;
  double *last_send;
  uint64_t *pulled_version;
  uint64_t version;
  int64_t base, next;
  int left;
  dt_result err;
  char msg[DT__MSG_CAP];
  DT__ATOMIC(int) aborted;
  DT__ATOMIC(int) stop;
  dt__mutex mu;
  dt__thread hb;
} dt__ps_client;

static dt__ps_client *dt__ps_client_of(dt_pstore *ps) { return (dt__ps_client *)ps->impl; }

/* Record the first failure: the other servers are told (ABORT) and every connection closed. */
static dt_result dt__ps_client_fail(dt__ps_client *C, dt_result rc) {
  if (C->err == DTRAIN_OK) {
    C->err = rc;
    snprintf(C->msg, sizeof C->msg, "%s", dt_last_error());
    for (int s = 0; s < C->M; s++) {
      dt__conn_abort(&C->conn[s], rc, C->msg);
      dt__conn_close(&C->conn[s]);
    }
  }
  return dt__error(C->err, "%s", C->msg);
}

static dt_result dt__ps_client_check(dt__ps_client *C, const char *op) {
  if (C->err != DTRAIN_OK) return dt__error(C->err, "%s", C->msg);
  if (C->left) return dt__error(DTRAIN_ERR_STATE, "%s: this worker already left (dt_pstore_leave)", op);
  if (DT__ALOAD(&C->aborted, DT__MO_ACQUIRE)) return DTRAIN_ERR_ABORTED;
  return DTRAIN_OK;
}

/* Receive server s's answer of `type` with exactly len payload bytes into C->buf[s],
 * skipping heartbeats (each renews the deadline). */
static dt_result dt__ps_client_answer(dt__ps_client *C, int s, uint16_t type, uint32_t len, const char *op) {
  for (;;) {
    dt__frame f;
    unsigned char h[DT__NET_HDR];
    double deadline = dt__now() + C->timeout;
    dt_result rc = dt__conn_recv_header(&C->conn[s], &f, h, deadline, op);
    if (rc != DTRAIN_OK) return rc;
    if (f.type == DT__MSG_HEARTBEAT && f.length == 0) {
      rc = dt__conn_recv_payload(&C->conn[s], &f, h, NULL, deadline, op);
      if (rc != DTRAIN_OK) return rc;
      continue;
    }
    if (f.type != type || f.length != len)
      return dt__error(DTRAIN_ERR_PROTOCOL, "%s: %s sent a frame of type 0x%02x and %u bytes, expected type 0x%02x "
                       "and %u bytes", op, C->conn[s].peer, (unsigned)f.type, (unsigned)f.length, (unsigned)type,
                       (unsigned)len);
    return dt__conn_recv_payload(&C->conn[s], &f, h, C->buf[s], deadline, op);
  }
}

static dt_result dt__ps_client_pull(dt_pstore *ps, int worker, int64_t clock, float *dst, size_t n,
                                    dt_pstore_ticket *tk) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  (void)n;
  char op[80];
  double t0 = dt__now();
  int64_t T = C->base + clock;
  snprintf(op, sizeof op, "worker %d: pull #%lld", C->me, (long long)T);
  dt__mutex_lock(&C->mu);
  dt_result rc = dt__ps_client_check(C, op);
  unsigned char req[DT__PS_FIX];
  dt__le64_put(req, (uint64_t)T);
  dt__le64_put(req + 8, 0);
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__conn_send(&C->conn[s], DT__PS_PULL, req, DT__PS_FIX, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
  }
  tk->version = 0;
  tk->clock_gap = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__ps_client_answer(C, s, DT__PS_PARAMS, (uint32_t)(DT__PS_FIX + C->shard[s] * 4), op);
    if (rc != DTRAIN_OK) break;
    uint64_t v = dt__le64_get(C->buf[s]);
    int64_t gap = (int64_t)dt__le64_get(C->buf[s] + 8);
    C->pulled_version[s] = v;
    if (v > tk->version) tk->version = v;
    if (v > C->version) C->version = v;
    if (gap > tk->clock_gap) tk->clock_gap = gap;
    dt__ps_scatter(C->params, C->owner, s, C->buf[s] + DT__PS_FIX, dst);
  }
  if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE) rc = dt__ps_client_fail(C, rc);
  dt__mutex_unlock(&C->mu);
  tk->wait_s = dt__now() - t0;
  return rc;
}

static dt_result dt__ps_client_push(dt_pstore *ps, int worker, int64_t clock, const float *delta, size_t n,
                                    dt_pstore_ticket *tk) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  (void)n;
  char op[80];
  double t0 = dt__now();
  int64_t T = C->base + clock;
  snprintf(op, sizeof op, "worker %d: push #%lld", C->me, (long long)T);
  dt__mutex_lock(&C->mu);
  dt_result rc = dt__ps_client_check(C, op);
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    unsigned char *b = C->buf[s];
    dt__le64_put(b, (uint64_t)T);
    dt__le64_put(b + 8, C->pulled_version[s]);
    size_t len = DT__PS_FIX;
    if (delta) {
      dt__ps_gather(C->params, C->owner, s, delta, b + DT__PS_FIX);
      len += C->shard[s] * 4;
    }
    rc = dt__conn_send(&C->conn[s], DT__PS_PUSH, b, (uint32_t)len, dt__now() + C->timeout, op);
    C->last_send[s] = dt__now();
  }
  tk->staleness = 0;
  for (int s = 0; rc == DTRAIN_OK && s < C->M; s++) {
    rc = dt__ps_client_answer(C, s, DT__PS_PUSHED, DT__PS_FIX, op);
    if (rc != DTRAIN_OK) break;
    uint64_t v = dt__le64_get(C->buf[s]);
    int64_t st = (int64_t)dt__le64_get(C->buf[s] + 8);
    if (v > C->version) C->version = v;
    if (st > tk->staleness) tk->staleness = st;
  }
  if (rc == DTRAIN_OK && T + 1 > C->next) C->next = T + 1;
  if (rc != DTRAIN_OK && rc != DTRAIN_ERR_ABORTED && rc != DTRAIN_ERR_STATE) rc = dt__ps_client_fail(C, rc);
  dt__mutex_unlock(&C->mu);
  tk->wait_s = dt__now() - t0;
  return rc;
}

static void dt__ps_client_bye(dt__ps_client *C) {
  if (C->left) return;
  C->left = 1;
  if (C->err != DTRAIN_OK) return;
  char keep[DT__MSG_CAP];
  dt_result keep_rc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  for (int s = 0; s < C->M; s++) {
    dt__conn_send(&C->conn[s], DT__MSG_BYE, NULL, 0, dt__now() + DT__MIN(C->timeout, 1.0), "bye");
    dt__conn_close(&C->conn[s]);
  }
  if (keep_rc != DTRAIN_OK) dt__error(keep_rc, "%s", keep);
  else dt_clear_error();
}

static void dt__ps_client_leave(dt_pstore *ps, int worker) {
  dt__ps_client *C = dt__ps_client_of(ps);
  (void)worker;
  dt__mutex_lock(&C->mu);
  dt__ps_client_bye(C);
  dt__mutex_unlock(&C->mu);
}

static void dt__ps_client_abort(dt_pstore *ps) {
  DT__ASTORE(&dt__ps_client_of(ps)->aborted, 1, DT__MO_SEQ_CST);
}

static dt_result dt__ps_client_begin(dt_pstore *ps) {
  dt__ps_client *C = dt__ps_client_of(ps);
  dt__mutex_lock(&C->mu);
  DT__ASTORE(&C->aborted, 0, DT__MO_SEQ_CST);
  C->base = C->next;
  dt_result rc = C->err != DTRAIN_OK ? dt__error(C->err, "%s", C->msg) : DTRAIN_OK;
  dt__mutex_unlock(&C->mu);
  return rc;
}

static uint64_t dt__ps_client_version(dt_pstore *ps) {
  dt__ps_client *C = dt__ps_client_of(ps);
  dt__mutex_lock(&C->mu);
  uint64_t v = C->version;
  dt__mutex_unlock(&C->mu);
  return v;
}

#  if !defined(DTRAIN_NO_THREADS)
/* The heartbeat thread: every timeout/3, a heartbeat on each connection idle that long. */
static void dt__ps_client_heartbeat(void *arg) {
  dt__ps_client *C = (dt__ps_client *)arg;
  double period = C->timeout / 3;
  while (!DT__ALOAD(&C->stop, DT__MO_ACQUIRE)) {
    dt__sleep(DT__MIN(period / 4, 0.02));
    dt__mutex_lock(&C->mu);
    if (C->err == DTRAIN_OK && !C->left) {
      double now = dt__now();
      for (int s = 0; s < C->M; s++) {
        if (now - C->last_send[s] < period) continue;
        if (dt__conn_send(&C->conn[s], DT__MSG_HEARTBEAT, NULL, 0, now + C->timeout / 4, "heartbeat") != DTRAIN_OK) {
          /* The next call finds the broken connection and reports it. */
          C->last_send[s] = now + 1e9;
        } else {
          C->last_send[s] = now;
        }
      }
    }
    dt__mutex_unlock(&C->mu);
  }
}
#  endif

static void dt__ps_client_free(dt__ps_client *C) {
  if (C->hb.started) {
    DT__ASTORE(&C->stop, 1, DT__MO_SEQ_CST);
    dt__thread_join(&C->hb);
  }
  if (C->conn) {
    dt__ps_client_bye(C);
    for (int s = 0; s < C->M; s++) dt__conn_close(&C->conn[s]);
  }
  size_t M = (size_t)C->M;
  if (C->buf)
    for (int s = 0; s < C->M; s++) dt__free(C->buf[s], C->buf_cap[s]);
  dt__free(C->buf, M * sizeof(unsigned char *));
  dt__free(C->buf_cap, M * sizeof(size_t));
  dt__free(C->conn, M * sizeof(dt__conn));
  dt__free(C->shard, M * sizeof(size_t));
  dt__free(C->last_send, M * sizeof(double));
  dt__free(C->pulled_version, M * sizeof(uint64_t));
  dt__free(C->owner, (size_t)(C->np > 0 ? C->np : 1) * sizeof(int));
  dt__mutex_destroy(&C->mu);
  dt__free(C, sizeof *C);
}

static void dt__ps_client_destroy(dt_pstore *ps) { dt__ps_client_free(dt__ps_client_of(ps)); }

static const dt_pstore_vtable dt__ps_client_vtable = {
  "tcp",
  dt__ps_client_pull,
  dt__ps_client_push,
  dt__ps_client_leave,
  dt__ps_client_abort,
  dt__ps_client_begin,
  dt__ps_client_version,
  dt__ps_client_destroy
};

static dt_pstore *dt__ps_store_create(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  const char *fn = "dt_pstore_create_tcp";
  if (!c || !params) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !c ? "cluster" : "params");
    return NULL;
  }
  if (c->role != DTRAIN_ROLE_WORKER || c->servers < 1) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: this process is not a worker of a cluster with servers (role %s, %d "
              "servers)", fn, c->role == DTRAIN_ROLE_PS ? "ps" : "worker", c->servers);
    return NULL;
  }
  if (max_staleness < DTRAIN_STALENESS_UNBOUNDED) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: max_staleness %d (use >= 0, or DTRAIN_STALENESS_UNBOUNDED)", fn,
              max_staleness);
    return NULL;
  }
  dt__net_self self;
  if (dt__net_self_init(&self, c, o) != DTRAIN_OK) {
    dt__ps_prefix(dt_last_result(), fn, NULL);
    return NULL;
  }
  dt__ps_client *C = (dt__ps_client *)dt__calloc(sizeof *C);
  if (!C) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  dt_result rc = dt__mutex_init(&C->mu);
  size_t M = (size_t)c->servers;
  C->M = c->servers;
  C->me = c->index;
  C->params = params;
  C->timeout = self.opt.timeout_s;
  C->np = dt_params_count(params);
  C->err = DTRAIN_OK;
  DT__ASTORE(&C->aborted, 0, DT__MO_RELAXED);
  DT__ASTORE(&C->stop, 0, DT__MO_RELAXED);
  C->owner = (int *)dt__alloc((size_t)(C->np > 0 ? C->np : 1) * sizeof(int));
  C->conn = (dt__conn *)dt__calloc(M * sizeof(dt__conn));
  C->shard = (size_t *)dt__calloc(M * sizeof(size_t));
  C->buf = (unsigned char **)dt__calloc(M * sizeof(unsigned char *));
  C->buf_cap = (size_t *)dt__calloc(M * sizeof(size_t));
  C->last_send = (double *)dt__calloc(M * sizeof(double));
  C->pulled_version = (uint64_t *)dt__calloc(M * sizeof(uint64_t));
  if (C->conn)
    for (int s = 0; s < C->M; s++) C->conn[s].fd = -1;
  if (rc != DTRAIN_OK || !C->owner || !C->conn || !C->shard || !C->buf || !C->buf_cap || !C->last_send ||
      !C->pulled_version) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    goto fail;
  }
  if (dt_ps_shard(params, C->M, C->owner) != DTRAIN_OK) goto fail;
  for (int s = 0; s < C->M; s++) {
    C->shard[s] = dt__ps_shard_floats(params, C->owner, s);
    C->buf_cap[s] = DT__PS_FIX + C->shard[s] * 4;
    C->buf[s] = (unsigned char *)dt__alloc(C->buf_cap[s]);
    if (!C->buf[s]) {
      dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
      goto fail;
    }
  }
  /* Connect and join, server by server. */
  for (int s = 0; s < C->M; s++) {
    char op[64];
    snprintf(op, sizeof op, "worker %d: join", C->me);
    if (dt__net_dial(&self, DTRAIN_ROLE_PS, s, &C->conn[s]) != DTRAIN_OK) {
      C->conn[s].fd = -1;
      dt__ps_prefix(dt_last_result(), op, NULL);
      goto fail;
    }
    unsigned char j[DT__PS_JOINLEN];
    memset(j, 0, sizeof j);
    dt__le32_put(j, (uint32_t)(int32_t)max_staleness);
    dt__le64_put(j + 8, (uint64_t)dt_params_size(params));
    dt__le64_put(j + 16, (uint64_t)C->shard[s]);
    dt__le64_put(j + 24, dt__ps_layout_hash(params, C->owner, s, C->M));
    rc = dt__conn_send(&C->conn[s], DT__PS_JOIN, j, DT__PS_JOINLEN, dt__now() + C->timeout, op);
    if (rc == DTRAIN_OK && C->buf_cap[s] < DT__PS_JOINLEN) {
      unsigned char *nb = (unsigned char *)dt__alloc(DT__PS_JOINLEN);
      if (!nb) {
        dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
        goto fail;
      }
      dt__free(C->buf[s], C->buf_cap[s]);
      C->buf[s] = nb;
      C->buf_cap[s] = DT__PS_JOINLEN;
    }
    if (rc == DTRAIN_OK) rc = dt__ps_client_answer(C, s, DT__PS_JOINED, DT__PS_JOINLEN, op);
    if (rc != DTRAIN_OK) goto fail;
    uint64_t v = dt__le64_get(C->buf[s]);
    C->pulled_version[s] = v;
    if (v > C->version) C->version = v;
    C->last_send[s] = dt__now();
  }
  C->ps.vtable = &dt__ps_client_vtable;
  C->ps.workers = c->workers;
  C->ps.max_staleness = max_staleness;
  C->ps.size = dt_params_size(params);
  C->ps.gradients = 1;
  C->ps.impl = C;
#  if !defined(DTRAIN_NO_THREADS)
  if (dt__thread_start(&C->hb, dt__ps_client_heartbeat, C) != DTRAIN_OK) {
    dt__ps_prefix(dt_last_result(), fn, "cannot start the heartbeat thread");
    goto fail;
  }
#  endif
  return &C->ps;
fail: {
  char keep[DT__MSG_CAP];
  dt_result krc = dt_last_result();
  snprintf(keep, sizeof keep, "%s", dt_last_error());
  C->left = 1; /* no BYE: we never joined them all */
  dt__ps_client_free(C);
  dt__error(krc != DTRAIN_OK ? krc : DTRAIN_ERR_INTERNAL, "%s", keep);
}
  return NULL;
}

DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  dt__quiet_push();
  dt_pstore *ps = dt__ps_store_create(c, params, o, max_staleness);
  dt__quiet_pop(ps ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NET));
  return ps;
}

#  undef DT__PS_SEND_FLAGS
#  undef DT__PS_PENDING

#else /* DTRAIN_NO_NET */

DTRAIN_API dt_result dt_ps_serve(const dt_cluster *c, dt_params *params, dt_optim *opt, const dt_net_options *o,
                                 const dt_ps_options *po) {
  (void)c;
  (void)params;
  (void)opt;
  (void)o;
  (void)po;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_ps_serve: networking is not compiled in (DTRAIN_NO_NET)");
}

DTRAIN_API dt_pstore *dt_pstore_create_tcp(const dt_cluster *c, dt_params *params, const dt_net_options *o,
                                           int max_staleness) {
  (void)c;
  (void)params;
  (void)o;
  (void)max_staleness;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_pstore_create_tcp: networking is not compiled in (DTRAIN_NO_NET)");
  return NULL;
}

#endif /* DTRAIN_NO_NET */

#undef DT__PS_FIX
#undef DT__PS_JOINLEN
#undef DT__PS_CKPT_MAGIC
#undef DT__PS_CKPT_HDR
/* ======== end dt_ps.c ======== */

#endif /* DTRAIN_IMPLEMENTATION */
