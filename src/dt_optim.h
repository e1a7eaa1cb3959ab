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

#include "dt_params.h"

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

/* Learning rate at `step` (0-based) for base rate lr (lr itself when s is NULL). */
DTRAIN_API float dt_schedule_lr(const dt_schedule *s, float lr, int64_t step);

/* Zero fields take the defaults in brackets. */
typedef struct dt_optim_options {
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
} dt_optim_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_optim_options dt_optim_desc;

typedef struct dt_optim dt_optim;

/* Options of this kind with every other field zero (the defaults): the same
 * in C and C++, where "dt_optim_options od = {0};" does not compile (its
 * first member is an enum):  dt_optim_options od = dt_optim_defaults(DTRAIN_OPTIM_ADAM); */
DTRAIN_API dt_optim_options dt_optim_defaults(dt_optim_kind kind);

/* NULL on failure (dt_last_error()). The params must not gain parameters later. */
DTRAIN_API dt_optim *dt_optim_create(dt_params *p, const dt_optim_options *desc);
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
/* Advance the step counter (after every range of a step was updated). With
 * o NULL, advance and set_steps do nothing and steps/state_slots return 0
 * (the library calls them where a strategy has no optimizer of its own);
 * dt_optim_lr returns 0 and dt_optim_state/get_options NULL, with
 * DTRAIN_ERR_NULL_ARG in dt_last_error(). */
DTRAIN_API void dt_optim_advance(dt_optim *o);

DTRAIN_API int64_t dt_optim_steps(const dt_optim *o);
DTRAIN_API void dt_optim_set_steps(dt_optim *o, int64_t steps);
/* Learning rate the next update will use. */
DTRAIN_API float dt_optim_lr(const dt_optim *o);
/* The options the optimizer was created with (defaults filled in). */
DTRAIN_API const dt_optim_options *dt_optim_get_options(const dt_optim *o);
DTRAIN_API DTRAIN_DEPRECATED("renamed dt_optim_get_options")
const dt_optim_options *dt_optim_get_desc(const dt_optim *o);
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
