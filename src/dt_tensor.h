/* ===========================================================================
 * dt_tensor.h -- tensors, the per-step graph (arena + tape) and autograd
 * ===========================================================================
 */
#ifndef DTRAIN_TENSOR_H
#define DTRAIN_TENSOR_H

#include "dt_base.h"

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
typedef struct dt_graph_options {
  size_t arena_bytes;   /* first arena block; 0 means 1 MiB (with a device: the first device block) */
  uint64_t seed;        /* seed of the graph's RNG (dropout); 0 means 1 */
  int check_numerics;   /* nonzero: every op checks its output for NaN/Inf */
  dt_device *device;    /* NULL: the CPU; else run on this device (dt_device.h) */
} dt_graph_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_graph_options dt_graph_desc;

/* Create a graph bound to `params` (may be NULL): dt_param(g, i) returns views
 * of the params' data and grad buffers. desc may be NULL for defaults.
 * Returns NULL on failure (see dt_last_error()). */
DTRAIN_API dt_graph *dt_graph_create(dt_params *params, const dt_graph_options *desc);
DTRAIN_API void dt_graph_destroy(dt_graph *g);

/* Forget every tensor of the step and clear the tape and the sticky error.
 * Keeps the memory for the next step. */
DTRAIN_API void dt_graph_reset(dt_graph *g);

/* Point the graph's parameter views at other flat buffers of the bound
 * params' layout (a replica's own copy, or a central copy). data must hold
 * dt_params_size() floats; grad may be NULL (no parameter gradients).
 * NULL data restores the params' own buffers. */
DTRAIN_API dt_result dt_graph_bind(dt_graph *g, float *data, float *grad);

/* Training mode (default on) switches dropout and batch-norm behaviour.
 * A NULL graph: set_training does nothing (DTRAIN_ERR_NULL_ARG in
 * dt_last_error()), dt_graph_training returns 0. */
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

/* Arena bytes in use now, the most used in any step, and reserved (0 for a NULL graph). */
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

/* Scalar value of a 1-element tensor (NaN if t is NULL, with dt_last_error() set, or not 1 element). */
DTRAIN_API float dt_item(const dt_tensor *t);
/* Shape as text into buf, e.g. "[64,10]"; returns buf. */
DTRAIN_API const char *dt_shape_str(const dt_tensor *t, char *buf, size_t cap);
/* Same shape? 0 when either is NULL. */
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
