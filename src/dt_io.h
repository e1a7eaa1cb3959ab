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
 * data; verified whenever present, whatever the "format").
 *
 * Saving is atomic: the file is written to a temporary file in the same
 * directory ("<path>.tmp-<pid>-<n>", created exclusively, never through a
 * symbolic link planted there), flushed and fsync'ed, renamed over `path`,
 * and the directory is fsync'ed. On any failure the temporary file is
 * removed, an existing file at `path` is left as it was, and the error
 * (DTRAIN_ERR_IO, or DTRAIN_ERR_NOMEM when an allocation failed) names the
 * path and the reason. Temporaries left by a process killed while saving are
 * removed by the next save to the same path once that process is gone.
 *
 * Loading validates everything before it changes anything, and the header
 * before it reads the data: a regular file only (a FIFO, a device or a
 * directory is refused at once, DTRAIN_ERR_IO), the file size,
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

#include "dt_optim.h"

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

/* ---- export: the weights as C source, for inference on a board ---------------
 * Writes out_path (atomically, as a checkpoint) as a C header holding every
 * F32 tensor of the safetensors file at path except the optimizer's
 * ("optim.*"): for tensor "fc1.weight",
 *   static const float PREFIX_fc1_weight[N] = { ... };   (bit-exact floats)
 * (a name's bytes other than letters and digits become '_'), then
 *   typedef struct PREFIX_tensor { const char *name; int ndim;
 *                                  int64_t shape[DTRAIN_MAX_DIMS]; const float *data; } PREFIX_tensor;
 *   static const PREFIX_tensor PREFIX_tensors[PREFIX_TENSORS] = { {"fc1.weight", 2, {256, 784, 1, ...}, ...}, ... };
 * with PREFIX upper-cased in the macros PREFIX_TENSORS, PREFIX_FLOATS and the
 * include guard. prefix: a C identifier (NULL: "model"). Refused: a non-F32
 * tensor, a NaN or infinite weight, two names that give the same C name.
 * examples/board/board_inference.c runs an MLP from such a header with no
 * file system, threads or malloc. (tools/dtrain-ckpt export-c from the shell.) */
DTRAIN_API dt_result dt_checkpoint_export_c(const char *path, const char *out_path, const char *prefix);

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
/* Tensors, in the order of their data in the file. Counts and sizes of a
 * NULL c are 0; dt_checkpoint_find and dt_checkpoint_meta of a NULL c or
 * name return DTRAIN_ERR_NULL_ARG / NULL with dt_last_error() set. */
DTRAIN_API int dt_checkpoint_count(const dt_checkpoint *c);
DTRAIN_API dt_result dt_checkpoint_entry_at(const dt_checkpoint *c, int index, dt_checkpoint_entry *out);
/* Index of the tensor named `name`, or DTRAIN_ERR_NOT_FOUND. */
DTRAIN_API int dt_checkpoint_find(const dt_checkpoint *c, const char *name);
/* Copy tensor `index` (dtype F32, exactly n elements) into dst, in host order. */
DTRAIN_API dt_result dt_checkpoint_read_f32(const dt_checkpoint *c, int index, float *dst, size_t n);
/* Metadata entries, in file order; key or value may be NULL (not wanted). */
DTRAIN_API int dt_checkpoint_meta_count(const dt_checkpoint *c);
DTRAIN_API dt_result dt_checkpoint_meta_at(const dt_checkpoint *c, int index, const char **key, const char **value);
/* Value of metadata `key`, or NULL when absent. */
DTRAIN_API const char *dt_checkpoint_meta(const dt_checkpoint *c, const char *key);
/* Total file size and header length (N) in bytes. */
DTRAIN_API uint64_t dt_checkpoint_file_size(const dt_checkpoint *c);
DTRAIN_API uint64_t dt_checkpoint_header_size(const dt_checkpoint *c);

/* ---- model-parallel checkpoints: one part per stage or shard ---------------
 * A pipeline stage (dt_pipeline.h) or a tensor-parallel shard
 * (dt_tensor_parallel.h), or stage s's shard t in a pipeline x tensor layout,
 * saves its own part with dt_checkpoint_save_part: an ordinary checkpoint of
 * its params, optimizer and graph (dt_checkpoint_load resumes it bitwise),
 * plus metadata "part" ({"stage":s,"stages":P,"shard":t,"shards":T}),
 * "split" (how each sharded parameter was cut: {"name":"rows"|"cols"|"qkv"})
 * and "buffers" (the names of the non-trainable ones). Only one replica of a
 * data-parallel layout needs to save (they hold the same values).
 *
 * dt_checkpoint_gather reads all P x T parts (any order) and writes one full
 * checkpoint: the stages' tensors concatenated in stage order, each sharded
 * tensor (and its optimizer state) put back together, a replicated one
 * checked to be bitwise equal on every shard, the layout_hash of the whole
 * model, and the step, data position, RNGs and config of stage 0's shard 0.
 * A one_device model whose parameters are the stages' in stage order loads it
 * with dt_checkpoint_load (or any model by name with _load_weights).
 * The file also keeps "gathered" ({"stages","shards","stage_starts","rng"}:
 * the layout and every part's RNG states), so that splitting it again for
 * the same layout gives back the parts' RNGs, and the run resumes bitwise.
 *
 * dt_checkpoint_split writes part (stage, shard) of a full checkpoint (a
 * gathered one, or any dtrain checkpoint, e.g. one_device's) for a layout:
 * stage s gets the parameters from stage_starts[s-1] up to stage_starts[s],
 * each cut for T shards by its split ("rows": the first dimension, "cols": the
 * last, "qkv": rows within each third of the first dimension; the rest whole).
 * For another layout than the gathered one, the parts get the full file's
 * RNG states. Errors: DTRAIN_ERR_MISMATCH for parts that do not fit together
 * (a missing or doubled part, different steps or optimizers, a tensor missing
 * on a shard, a replicated tensor that differs), DTRAIN_ERR_SHAPE when a
 * tensor does not divide by T, DTRAIN_ERR_INVALID_ARG for a bad layout or
 * plan, and everything dt_checkpoint_open and _save return; the message names
 * the file and the tensor. Nothing is written on error. */
enum { DTRAIN_SPLIT_NONE = 0, DTRAIN_SPLIT_ROWS = 1, DTRAIN_SPLIT_COLS = 2, DTRAIN_SPLIT_QKV = 3 };

typedef struct dt_part {
  int stage, stages;               /* pipeline: stage s of P (P 0 or 1: no pipeline) */
  int shard, shards;               /* tensor parallel: shard t of T (T 0 or 1: none) */
  int nsplit;                      /* the sharded parameters (the others are whole on every shard): */
  const char *const *split_names;  /* their names in st->params */
  const int *split_kinds;          /* DTRAIN_SPLIT_ROWS / _COLS / _QKV */
} dt_part;

/* dt_checkpoint_save of this worker's state, with its place in the layout. */
DTRAIN_API dt_result dt_checkpoint_save_part(const char *path, const dt_train_state *st, const dt_part *part);
/* The full checkpoint at `out` from the nparts part files. */
DTRAIN_API dt_result dt_checkpoint_gather(const char *const *parts, int nparts, const char *out);

typedef struct dt_split_plan {
  int stages;                       /* P (0 or 1: one stage) */
  const char *const *stage_starts;  /* P-1 parameter names, the first of stages 1..P-1 in the full
                                       file's order; NULL: the gathered layout's (same P) */
  int shards;                       /* T (0 or 1: none) */
  int nsplit;                       /* how the sharded parameters are cut; 0: the file's "split" */
  const char *const *split_names;
  const int *split_kinds;
} dt_split_plan;

/* Part (stage, shard) of the full checkpoint `full` for the layout `plan`, to `out`. */
DTRAIN_API dt_result dt_checkpoint_split(const char *full, const dt_split_plan *plan, int stage, int shard,
                                         const char *out);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_IO_H */
