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
 *   dt_fit_options fd = {0};               // zero fields take defaults
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
 * Non-finite steps. After every step dt_fit checks that the step did not
 * fail with DTRAIN_ERR_NONFINITE (dt_backward refuses a NaN/Inf loss;
 * dt_strategy_step a NaN/Inf loss or gradient), that the loss it reported
 * (b->loss; a step that sets none is not checked) is finite, and, with
 * desc.params, that the trainable gradients in the params' grad buffer
 * are (one pass). By default such a step stops dt_fit with
 * DTRAIN_ERR_NONFINITE: "dt_fit: step 41 (epoch 2, batch 9 of 50): loss is
 * NaN; ...". With desc.skip_nonfinite it is skipped instead: dt_fit keeps
 * a copy of the params' values and of the optimizer's state (desc.params,
 * desc.optim) from before each step and puts it back, so that a step which
 * already made its update touches nothing; the batch is left out of the
 * epoch's metrics, result.skipped_steps counts it, a warning is logged, and
 * training goes on with the next batch. With a strategy in the step, set
 * its own skip_nonfinite too (it skips before any update, on every replica).
 *
 * Without stdio (DTRAIN_NO_STDIO) the loop runs silently; asking for a file
 * (CSV, SVG, checkpoint) or an explicit progress mode gives
 * DTRAIN_ERR_UNSUPPORTED.
 */
#ifndef DTRAIN_FIT_H
#define DTRAIN_FIT_H

#include <stdio.h>

#include "dt_io.h"

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
typedef struct dt_fit_options {
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
  /* Output. Every path below is checked before the first step: its directory
   * must exist and take a new file, else dt_fit returns DTRAIN_ERR_IO naming it. */
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
  /* A step whose loss or gradient is NaN/Inf (see "Non-finite steps"):
   * 0 stops dt_fit with DTRAIN_ERR_NONFINITE naming the step; nonzero skips
   * it (put back, left out of the metrics, counted in skipped_steps). [0] */
  int skip_nonfinite;
} dt_fit_options;
/* Deprecated: the old name, removed in the next release. */
typedef dt_fit_options dt_fit_desc;

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
  int64_t skipped_steps;      /* steps skipped for a non-finite loss or gradient (skip_nonfinite) */
} dt_fit_result;

/* Run the loop. result may be NULL. Returns the first error of a callback,
 * a checkpoint, the CSV or the chart (training stops there), else DTRAIN_OK. */
DTRAIN_API dt_result dt_fit(const dt_fit_options *desc, dt_fit_result *result);

/* Write a standalone SVG chart (no dependency) of n epochs' metrics: loss
 * (train and validation) in the left panel, accuracy in the right one, with
 * axes, ticks, labels and legends. NaN values are left out. Written to a
 * temporary file and renamed over path. */
DTRAIN_API dt_result dt_fit_write_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_FIT_H */
