/* ===========================================================================
 * dt_pipeline.h -- pipeline parallelism: a model cut into stages, each on its
 * own thread or process, micro-batches flowing through them (GPipe, 1F1B)
 * ===========================================================================
 * A model too large for one worker is cut into P stages; stage s holds only
 * its own layers (its own dt_params) and runs its part of the forward pass.
 * A step splits the global batch into M micro-batches (contiguous rows, as
 * the strategies shard: B/M rows, one more for the first B % M). Stage s
 * receives micro-batch m's activations from stage s-1, runs its stage
 * function, and sends its output on to stage s+1; the last stage returns the
 * loss. The backward pass flows the other way: stage s receives d(loss)/d(its
 * output) from s+1, runs autograd through its part (dt_backward_grad) and
 * sends d(loss)/d(its input) back to s-1. Parameter gradients accumulate over
 * the micro-batches (each loss weighted by rows/B, so the sum is the gradient
 * of the mean over the whole batch); after the last micro-batch each stage
 * applies its optimizer to its own parameters. So a step computes what
 * one_device computes on the same batch, up to float rounding (the
 * micro-batches' gradients are summed in micro-batch order 0, 1, ..., M-1 under
 * both schedules, so GPipe and 1F1B agree bitwise).
 *
 * Schedules (per stage; F = a forward, B = a backward):
 *   DTRAIN_PIPE_GPIPE  every F (0..M-1), then every B (0..M-1): M micro-batches'
 *                      activations held at once
 *   DTRAIN_PIPE_1F1B   min(P-s-1, M) F to fill the pipe, then alternately one F
 *                      and one B, then the remaining B: at most P-s micro-batches
 *                      in flight on stage s, so less activation memory
 * Both leave the same bubble (idle time) of (P-1)/(M+P-1) of a step in theory.
 *
 * Where the stages run:
 *   o.comm == NULL   threads of this process: one dt_pipeline runs all P stages
 *                    (params: an array of P dt_params, stage s's layers in
 *                    params[s]); dt_pipeline_step on the calling thread
 *                    runs stage 0 and P-1 pool threads the others.
 *   o.comm != NULL   one stage per rank of a one-rank-per-process communicator
 *                    (dt_comm_create_tcp / dt_comm_create_mpi, world == P,
 *                    borrowed): stage = dt_comm_rank(comm); params: one
 *                    dt_params (params[0]), this stage's. Every process calls
 *                    dt_pipeline_step with the same global batch (stage 0
 *                    reads its features, the last stage its labels).
 * Data parallel on top: R replicas of the whole pipeline, each on its part
 * of the global batch (threads: shard r of the batch dt_pipeline_step gets;
 * processes: the batch each process passes, the global batch being their
 * concatenation). Losses are weighted by rows / global rows, and before the
 * optimizers run, each stage's gradient is summed over its data-parallel
 * group (one all-reduce of the stage's parameters): every replica applies
 * the same update, and a step equals one_device on the global batch.
 * Activations travel as point-to-point messages (dt_comm_isend / _irecv): a
 * micro-batch's output goes with its shape, so a stage's input may have any
 * shape (rows first).
 *
 * The stage function builds stage `stage`'s part of micro-batch mb on g
 * (bound to that stage's parameters: dt_param, the dt_nn_* layers). x is
 * NULL on stage 0 (read mb's features) and otherwise the previous stage's
 * output (a leaf that requires its gradient). The last stage returns the
 * micro-batch's loss, one element, the mean over its rows (like a strategy's
 * step function); the others return their output. NULL or a failed graph
 * fails the step on every stage (DTRAIN_ERR_ABORTED on the others, the cause
 * on the stage that failed).
 *
 * Not supported here yet: gradient clipping by the global norm (each stage
 * sees only its gradients; clip_norm in the optimizer options is refused),
 * batch-norm running statistics (a stage's buffers follow its micro-batches).
 */
#ifndef DTRAIN_PIPELINE_H
#define DTRAIN_PIPELINE_H

#include "dt_base.h"
#include "dt_tensor.h"
#include "dt_optim.h"
#include "dt_comm.h"
#include "dt_strategy.h"
#include "dt_memory.h"

DTRAIN_EXTERN_C_BEGIN

typedef struct dt_pipeline dt_pipeline;

typedef dt_tensor *(*dt_stage_fn)(dt_graph *g, int stage, dt_tensor *x, const dt_minibatch *mb, void *user);

enum { DTRAIN_PIPE_GPIPE = 0, DTRAIN_PIPE_1F1B = 1 };

typedef struct dt_pipeline_options {
  int stages;          /* P >= 1 (with comm: its world) */
  int microbatches;    /* M, 1..16383 */
  int schedule;        /* DTRAIN_PIPE_GPIPE or DTRAIN_PIPE_1F1B */
  dt_comm *comm;       /* NULL: threads; else one stage per rank (borrowed) */
  int spin_us;         /* threads: how long a waiting stage spins (dt_comm_create_threads) */
  size_t arena_bytes;  /* first arena block of each micro-batch's graph (0: the default) */
  uint64_t seed;       /* graphs' RNG seed (dropout); micro-batch m of stage s: seed + 7919 * s + m */
  /* Data parallel on top (a pipeline x data layout): */
  int replicas;        /* threads: R whole pipelines (P*R threads), each on its shard of the batch
                          (params: P*R dt_params, replica r's stage s at params[r*P + s], equal at the
                          start); 0 or 1: one */
  dt_comm *dp_comm;    /* processes: the ranks that run this stage for the other replicas (dt_layout.dp;
                          borrowed); each process passes its own replica's batch. NULL: none */
} dt_pipeline_options;

/* stages and microbatches set, GPipe, threads. */
DTRAIN_API dt_pipeline_options dt_pipeline_defaults(int stages, int microbatches);

/* Per stage, since creation. */
typedef struct dt_pipeline_stats {
  int64_t steps;
  double step_s;        /* wall time in dt_pipeline_step */
  double busy_s;        /* of it, forward and backward work of this stage */
  double bubble;        /* 1 - busy_s / step_s: this stage's idle share */
  double bubble_theory; /* (P-1)/(M+P-1) */
  int max_in_flight;    /* most micro-batches whose activations this stage held at once */
  size_t act_bytes_peak; /* most bytes of graph arenas in use at once (activations) */
} dt_pipeline_stats;

/* params: threads: P of them; processes: one (this stage's). opt is copied.
 * NULL on failure (dt_last_error()). */
DTRAIN_API dt_pipeline *dt_pipeline_create(dt_params *const *params, const dt_optim_options *opt, dt_stage_fn fn,
                                           void *user, const dt_pipeline_options *o);
/* One training step on the global batch; *loss (may be NULL) gets the mean
 * loss over the batch on every stage (a broadcast from the last stage). */
DTRAIN_API dt_result dt_pipeline_step(dt_pipeline *p, const dt_minibatch *batch, float *loss);
/* Stage `stage`'s statistics (processes: this process's stage, the only one it has). */
DTRAIN_API dt_result dt_pipeline_stats_get(const dt_pipeline *p, int stage, dt_pipeline_stats *out);
/* Stage `stage`'s memory (dt_memory.h; processes: this process's stage; threads:
 * replica 0's): its parameters, gradients and optimizer state, and its
 * micro-batch graphs -- activations_bytes the most their arenas held at once
 * (dt_pipeline_stats.act_bytes_peak), arena_bytes and tape_bytes summed over
 * them, total_bytes the sum of all but activations_bytes. */
DTRAIN_API dt_result dt_pipeline_memory(const dt_pipeline *p, int stage, dt_memory_info *out);
/* Stage `stage`'s optimizer (NULL, with DTRAIN_ERR_INDEX, if this process does not run it);
 * threads with replicas: r * P + s is replica r's stage s (the params' order), for
 * loading every replica from a checkpoint (dt_checkpoint_load). */
DTRAIN_API dt_optim *dt_pipeline_optim(dt_pipeline *p, int stage);
/* This process's first stage and how many it runs (threads: 0 and P); 0 for a NULL p. */
DTRAIN_API int dt_pipeline_first_stage(const dt_pipeline *p);
DTRAIN_API int dt_pipeline_local_stages(const dt_pipeline *p);
DTRAIN_API void dt_pipeline_destroy(dt_pipeline *p);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_PIPELINE_H */
