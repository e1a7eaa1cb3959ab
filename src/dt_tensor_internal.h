/* ===========================================================================
 * dt_tensor_internal.h -- the graph, its arena and tape, the device arena (tensor layer)
 * ===========================================================================
 * Private: part of the implementation, not of the API. See dt_internal.h.
 */
#ifndef DTRAIN_TENSOR_INTERNAL_H
#define DTRAIN_TENSOR_INTERNAL_H

#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_device.h"

/* ---- graph internals (dt_tensor.c) --------------------------------------------
 * The tensor layer: calls only the base and the graph's device side
 * (its last section), never the ops, the params or anything above them.
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
  /* backward calls ready(ready_user, p) once parameter p's gradient is final
   * (dt__graph_on_grad_ready); NULL: no calls */
  void (*ready)(void *user, int param_index);
  void *ready_user;
  /* device (dt_device.h): NULL on the CPU. Tensor data and gradients come
   * from the device arena `dchunks`; headers from the host arena above. */
  dt_device *device;
  dt__dchunk *dchunks;
  size_t dreserved;
  float *dparam_data, *dparam_grad; /* the device copy of the params */
  size_t dparam_n;
  /* Deferred zeroing of the params' gradient (dt__graph_grad_defer, CPU):
   * while gstale[p] is 1 (p < ngstale), parameter p's gradient still holds
   * the last step's values; its first use zeroes it (dt__grad) or overwrites
   * it (dt__grad_first), and dt__graph_grad_settle zeroes the ones no op
   * touched. ngstale 0: nothing deferred. */
  uint8_t *gstale;
  int ngstale, gstale_cap;
};

/* A graph without params (dt_tensor.c): dt_graph_create (dt_graph_params.c)
 * builds on it, so that the tensor layer never calls into the params.
 * NULL with the thread's error set on failure. */
DTRAIN_PRIVATE dt_graph *dt__graph_new(const dt_graph_desc *desc);
/* Fills a tensor header of g (no data; param_index -1, no flags). */
DTRAIN_PRIVATE void dt__header_init(dt_tensor *t, dt_graph *g, int ndim, const int64_t *shape, int64_t size);
/* Checks the graph is usable and the n tensor arguments are non-NULL and
 * belong to g. Returns 0 (and records an error if none yet) otherwise. */
DTRAIN_PRIVATE int dt__begin(dt_graph *g, const char *op, int n, ...);
/* Record the first error on g (also as the thread's error). Returns NULL. */
DTRAIN_PRIVATE void *dt__fail(dt_graph *g, dt_result code, const char *fmt, ...) DT__PRINTF(3, 4);
/* Arena memory, 64-byte aligned; NULL and NOMEM error on failure. */
DTRAIN_PRIVATE void *dt__arena_alloc(dt_graph *g, size_t bytes);
DTRAIN_PRIVATE float *dt__arena_floats(dt_graph *g, int64_t n);     /* uninitialised */
DTRAIN_PRIVATE float *dt__arena_zeros(dt_graph *g, int64_t n);
/* Scratch within one op: m = dt__arena_mark(g); ...allocate and use...;
 * dt__arena_release(g, m) gives back everything allocated after the mark,
 * so the step's peak holds one op's temporaries, not all of them. Only for
 * memory nothing refers to once the op returns (never a tensor, its data or
 * a saved-for-backward buffer). A no-op on a device graph. */
typedef struct dt__arena_pos { void *chunk; size_t used, graph_used; } dt__arena_pos;
DTRAIN_PRIVATE dt__arena_pos dt__arena_mark(dt_graph *g);
DTRAIN_PRIVATE void dt__arena_release(dt_graph *g, dt__arena_pos m);
/* New tensor with uninitialised data; validates shape (dims >= 1). */
DTRAIN_PRIVATE dt_tensor *dt__new(dt_graph *g, const char *op, int ndim, const int64_t *shape);
DTRAIN_PRIVATE dt_tensor *dt__new_like(dt_graph *g, const char *op, const dt_tensor *x);
/* Tensor header aliasing `data` (views). */
DTRAIN_PRIVATE dt_tensor *dt__new_view(dt_graph *g, const char *op, int ndim, const int64_t *shape, float *data);
/* A tape node whose aux holds iaux[0] input pointers beyond src (dt_concat of
 * more than four inputs): its backward writes their gradients too. */
#define DT__TENSOR_AUX_INPUTS 0x40000000
/* An op has taken this tensor as an input (dt__begin, dt_concat). */
#define DT__TENSOR_USED 0x10000000
/* dt_relu_inplace replaced its values: taking it as an input is an error. */
#define DT__TENSOR_OVERWRITTEN 0x20000000
/* dt__begin's check of one tensor argument (NULL, other graph, spent by
 * dt_relu_inplace), numbered argno from 1 in the message; marks it used.
 * Returns 0 after failing g. */
DTRAIN_PRIVATE int dt__take_input(dt_graph *g, const char *op, dt_tensor *t, int argno);
/* From the next backward on, ready(user, p) is called in backward's thread
 * as soon as parameter p's gradient is final: right after the backward of
 * the earliest op (in forward order) that used it -- ops run in reverse, so
 * no later one adds to it. Once per parameter the step used, latest layers
 * first; an unused parameter gets no call. fn NULL stops the calls. (For
 * communication that overlaps the rest of backward.) */
DTRAIN_PRIVATE void dt__graph_on_grad_ready(dt_graph *g, void (*fn)(void *user, int param_index), void *user);
/* Connect out to its inputs and put it on the tape when a gradient can flow. */
DTRAIN_PRIVATE void dt__record(dt_graph *g, dt_tensor *out, const char *op, dt_backward_fn fn,
                               dt_tensor *a, dt_tensor *b, dt_tensor *c);
DTRAIN_PRIVATE dt_tensor *dt__finish(dt_graph *g, dt_tensor *out);
/* Gradient buffer of t (allocated zeroed on first use) or NULL if t needs none. */
DTRAIN_PRIVATE float *dt__grad(dt_graph *g, dt_tensor *t);
/* dt__grad for an op that can write t's whole gradient instead of adding to
 * it: *overwrite = 1 when nothing has been added to it yet this step (a new
 * buffer, not zeroed, or a parameter's deferred one: dt__graph_grad_defer),
 * and the caller must then write every element (a GEMM with beta 0); 0:
 * add to it as usual. Saves zeroing a buffer only to add to the zeros. */
DTRAIN_PRIVATE float *dt__grad_first(dt_graph *g, dt_tensor *t, int *overwrite);
/* Normalise a possibly negative axis; -1 if out of range. */
DTRAIN_PRIVATE int dt__axis(int axis, int ndim);
/* A shape as text, e.g. "[64,10]", into buf (cap bytes); returns buf. */
DTRAIN_PRIVATE const char *dt__shape_text(int ndim, const int64_t *shape, char *buf, size_t cap);
/* Row-major strides of t into st (elements). */
DTRAIN_PRIVATE void dt__strides(const dt_tensor *t, int64_t *st);

/* ---- device: the graph's side (dt_tensor.c, tensor layer) ---------------------------
 * What the graph layer itself needs on a device graph: the device arena, the
 * checked transfers and kernel runs (a failure fails g with op's name and
 * the device's message) and the list of ops that have a device path. Calls
 * only the dt_device function table, never up into the ops or the params. */
DTRAIN_PRIVATE int dt__dev_op_ok(const char *op);
/* The device's function table is complete (dt_graph_create refuses it
 * otherwise, before allocating anything). */
DTRAIN_PRIVATE dt_result dt__dev_graph_check(dt_graph *g);
DTRAIN_PRIVATE void dt__dev_free_chunks(dt_graph *g); /* the device arena and the params' device copy */
DTRAIN_PRIVATE void *dt__dev_arena(dt_graph *g, size_t bytes);
DTRAIN_PRIVATE void dt__dev_reset(dt_graph *g);
DTRAIN_PRIVATE int dt__dev_run(dt_graph *g, const char *op, dt_kernel k, const dt_kernel_args *a);
DTRAIN_PRIVATE int dt__dev_copy(dt_graph *g, const char *op, void *dst, const void *src, size_t bytes, dt_copy_kind kind);
DTRAIN_PRIVATE int dt__dev_zero(dt_graph *g, const char *op, void *p, size_t bytes);
DTRAIN_PRIVATE void dt__dev_args0(dt_kernel_args *a); /* all fields zero */
DTRAIN_PRIVATE dt_tensor *dt__dev_check_numerics(dt_graph *g, dt_tensor *out);
/* gx += gy over n elements (the backward of no-copy views, the loss seed). */
DTRAIN_PRIVATE void dt__dev_acc(dt_graph *g, float *gx, const float *gy, int64_t n, const char *op);

#endif /* DTRAIN_TENSOR_INTERNAL_H */
