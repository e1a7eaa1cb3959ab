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

#include "dt_tensor.h"

DTRAIN_EXTERN_C_BEGIN

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
/* Room for `count` more parameters of `floats` floats in all (their alignment
 * padding is added here), allocated now at exactly that size: the adds that
 * follow do not grow the buffers. Without it the value and gradient buffers
 * grow by doubling, so a model may reserve up to twice what it needs (the
 * part no parameter has claimed is never written, so on a system with virtual
 * memory it takes no RAM), and briefly holds the old and the new buffer:
 * reserve first where memory is tight or fixed (a
 * pipeline stage on a small board, dt_use_fixed_memory budgets). Never
 * shrinks. DTRAIN_ERR_NOMEM / _OVERFLOW with nothing changed. */
DTRAIN_API dt_result dt_params_reserve(dt_params *p, int count, size_t floats);

/* Counts and sizes of a NULL p are 0; its checksum and layout hash those of
 * an empty set. The pointer getters return NULL with dt_last_error() set;
 * zero_grad and scale_grad on NULL do nothing and set it too. */
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

/* Global L2 norm of n floats (accumulated in double); 0 when x is NULL. */
DTRAIN_API double dt_l2_norm(const float *x, size_t n);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_PARAMS_H */
