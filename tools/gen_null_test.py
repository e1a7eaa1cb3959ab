#!/usr/bin/env python3
"""tools/gen_null_test.py -- writes tests/test_null_args.c from the public API.

Every DTRAIN_API prototype of the public headers (the "public" lines of
src/MANIFEST) that takes a pointer (or a callback) is called:
  1. with every pointer argument NULL at once, and
  2. where the generator can make a harmless valid value for each pointer
     type (FIXTURE below: a small dt_params, a graph, a tensor, a buffer...),
     once per pointer argument with that one NULL and the others valid.
Scalars get small valid-looking values (SCALARS below). The program checks
that no call crashes, and that a call which reports an error (a negative
dt_result, a NULL object) also leaves dt_last_error() set. A call that
succeeds with a NULL argument must name that argument in NULLABLE (the header
documents it as optional); a function whose return type cannot carry an error
must set dt_last_error() or be listed in NOOP (documented as a no-op on NULL).

  python3 tools/gen_null_test.py            rewrite tests/test_null_args.c
  python3 tools/gen_null_test.py --check    exit 1 if the committed file is stale
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "test_null_args.c")

# Functions not called at all, with the reason.
EXCLUDE = {
    # Reads the DTRAIN_* environment of the process when argc/argv are NULL:
    # its answer depends on how the suite was started.
    "dt_cluster_discover": "reads the environment of the process; NULL out covered by test_cluster",
}

# Functions called with all pointers NULL only, with the reason: with the
# others valid they would do real work that blocks or waits for peers.
ALL_NULL_ONLY = {
    "dt_ps_serve": "serves the shard until the workers leave (blocks)",
    "dt_comm_create_tcp": "connects to the cluster's peers (waits for its deadline)",
    "dt_pstore_create_tcp": "connects to the cluster's servers (waits for its deadline)",
}

# Arguments documented as optional: a success with that one NULL is right
# (the all-NULL call may succeed only when every pointer is listed).
NULLABLE = {
    "dt_graph_create": {"params", "desc"},
    "dt_graph_bind": {"data", "grad"},
    "dt_set_allocator": {"a"},
    "dt_set_logger": {"fn", "user"},
    "dt_linear": {"b"},
    "dt_linear_relu": {"b"},
    "dt_tp_column_linear": {"b"},
    "dt_tp_row_linear": {"b"},
    "dt_tp_attention": {"b_qkv", "b_proj"},
    "dt_conv2d": {"b"},
    "dt_conv2d_relu": {"b"},
    "dt_layer_norm": {"gamma", "beta"},
    "dt_batch_norm": {"gamma", "beta", "running_mean", "running_var"},
    "dt_memory_stats": {"p", "o", "g"},
    "dt_checkpoint_meta_at": {"key", "value"},
    "dt_dataset_from_arrays": {"y"},
    "dt_dataset_from_npy": {"y"},
    "dt_dataset_load_idx": {"labels_path"},
    "dt_dataset_read_idx": {"labels_path"},
    "dt_dataset_from_idx": {"labels"},
    "dt_dataset_parse_idx": {"labels"},
    "dt_fashion_mnist_find": {"dir", "has_train"},
    "dt_fashion_mnist_load": {"dir", "train"},
    "dt_cluster_describe": {"c"},
    "dt_strategy_create": {"user", "desc"},
    "dt_strategy_step": {"loss"},
    "dt_strategy_run": {"mean_loss", "next_user"},
    "dt_fit": {"result"},
    "dt_npy_encode": {"buf"},  # NULL buf asks for the length
    "dt_crc32": {"data"},
    "dt_loader_position": {"epoch", "index"},
}

# Functions that return a value (or nothing) that cannot carry an error and
# are documented as quiet no-ops on NULL (destroy/free/close are implied).
NOOP = {
    # setters whose NULL restores the default (dt_base.h)
    "dt_set_allocator", "dt_set_logger", "dt_rng_seed",
    # NULL names clear the timeline's thread name and process role (dt_base.h)
    "dt_trace_name_thread", "dt_trace_set_process",
    # counts, sizes, flags and hashes of a NULL object: 0 (or the empty hash)
    "dt_graph_training", "dt_graph_bytes_used", "dt_graph_bytes_peak", "dt_graph_bytes_reserved",
    "dt_same_shape", "dt_params_count", "dt_params_size", "dt_params_trainable_size",
    "dt_params_checksum", "dt_params_layout_hash", "dt_params_hash", "dt_l2_norm",
    "dt_optim_steps", "dt_optim_state_slots", "dt_comm_world", "dt_comm_rank",
    "dt_checkpoint_count", "dt_checkpoint_meta_count", "dt_checkpoint_file_size",
    "dt_checkpoint_header_size", "dt_loader_num_samples", "dt_loader_num_batches",
    "dt_strategy_replicas", "dt_pstore_version", "dt_crc32", "dt_schedule_lr",
    # called by the library itself on objects that may be absent (no optimizer,
    # cleanup after a failed setup)
    "dt_optim_advance", "dt_optim_set_steps", "dt_comm_abort", "dt_comm_reset_stats",
    "dt_strategy_reset_stats", "dt_pstore_leave", "dt_pstore_abort",
    # option constructors: dt_strategy_create refuses the NULL comm or store
    "dt_strategy_multi_worker_mirrored", "dt_strategy_parameter_server",
    "dt_multi_worker_mirrored", "dt_parameter_server",
}

# Functions returning a string that is never NULL (a message, a name).
STRING_ALWAYS = {"dt_graph_message", "dt_shape_str", "dt_comm_name", "dt_device_group_method",
                 "dt_strategy_kind_name"}

# Callback typedefs ("typedef R (*name)(...)" in the public headers) count as
# pointer arguments; filled in by prototypes().
CALLBACKS = set()

# Valid values by pointer type (the type without const, spaces removed).
# None: not generated (the function then gets only the all-NULL call).
FIXTURE = {
    "dt_graph*": "f.g", "dt_params*": "f.p", "dt_tensor*": "f.t", "dt_optim*": "f.o",
    "dt_rng*": "&f.rng", "dt_comm*": "f.comm", "dt_dataset*": "f.ds", "dt_loader*": "f.ld",
    "dt_tensor*const*": "f.tl", "dt_tensor**": "f.tout",
    "dt_dataset**": "&f.ds_out[%d]", "dt_cluster**": "&f.cl_out[%d]", "dt_loader**": "&f.ld_out[%d]",
    "dt_text*": "&f.text", "dt_npy*": "&f.npy", "dt_bytes*": "&f.bytes", "dt_idx*": "&f.idx",
    "dt_batch*": "&f.batch", "dt_loader_options*": "&f.lopt",
    "char*": "f.cbuf", "void*": "f.vbuf", "float*": "f.fbuf", "float*const*": "f.fbufs",
    "int32_t*": "f.ibuf", "int64_t*": "f.lbuf", "int*": "f.ivals", "size_t*": "&f.szval",
    "uint64_t*": "f.u64", "constchar**": "&f.cstr", "char**": "f.argv",
    "dt_checkpoint*": "f.ck", "dt_cluster*": "f.cl", "dt_strategy*": "f.s", "dt_pstore*": "f.ps",
    "dt_step_fn": "nt_step", "dt_minibatch_fn": "nt_next", "dt_log_fn": "th_log",
}
# Types of which a zeroed local is a fine value (options, outputs, layer structs).
ZEROED = {"dt_graph_options", "dt_param_info", "dt_schedule", "dt_optim_options", "dt_nn_linear",
          "dt_nn_conv2d", "dt_nn_embedding", "dt_nn_layer_norm", "dt_nn_batch_norm", "dt_nn_lstm_cell",
          "dt_nn_gru_cell", "dt_nn_attention", "dt_train_state", "dt_checkpoint_entry", "dt_fit_options",
          "dt_fit_result", "dt_fit_epoch", "dt_csv_options", "dt_memory_info", "dt_comm_stats",
          "dt_minibatch", "dt_strategy_options", "dt_strategy_stats", "dt_replica_stats",
          "dt_pstore_ticket", "dt_net_options", "dt_ps_options", "dt_allocator"}

# Scalar values by argument name, then by type.
SCALAR_BY_NAME = {"index": "0", "rank": "0", "root": "0", "slot": "0", "replica": "0", "worker": "0",
                  "axis": "0", "ndim": "2", "n": "2", "cap": "sizeof f.cbuf", "world": "1",
                  "replicas": "1", "workers": "1", "servers": "1", "count": "2", "len": "4",
                  "max_out": "64", "in": "2", "out": "2", "hidden": "2", "dim": "2", "heads": "1",
                  "vocab": "4", "kernel": "1", "stride": "1", "padding": "0", "channels": "2",
                  "begin": "0", "end": "2", "batch": "1", "seq_len": "2", "epoch": "0", "clock": "0",
                  "steps": "1", "max_staleness": "0", "spin_us": "0", "lda": "2", "ldb": "2", "ldc": "2",
                  "m": "2", "k": "2", "trans_a": "0", "trans_b": "0", "code": "DTRAIN_ERR_INVALID_ARG",
                  "start": "0", "d0": "2", "d1": "2", "d2": "2", "d3": "2", "level": "DTRAIN_LOG_ERROR",
                  "max_level": "DTRAIN_LOG_ERROR", "size": "64"}
SCALAR_BY_TYPE = {"int": "1", "int64_t": "2", "size_t": "4", "float": "0.5f", "double": "0.5",
                  "uint64_t": "1", "uint32_t": "0", "unsigned": "0", "dt_init": "dt_init_zeros()",
                  "dt_compress": "(dt_compress){DTRAIN_COMPRESS_TOPK, 0.5f, 0}"}


HEAD = r"""/* tests/test_null_args.c -- GENERATED by tools/gen_null_test.py from the DTRAIN_API
 * prototypes of the public headers: do not edit; run `python3 tools/gen_null_test.py`
 * after changing the API (`make check-house` fails while this file is stale).
 *
 * Every public function that takes a pointer is called with all its pointers
 * NULL, then (where the generator has a harmless valid value for each pointer
 * type) with each pointer NULL in turn and the others valid. No call may
 * crash (a crash names the call); an error return (negative dt_result, NULL
 * object) must leave dt_last_error() set; a success with a NULL argument is
 * right only where the header documents that argument as optional; a
 * function that cannot return an error (void, a count) either sets
 * dt_last_error() or is documented as a no-op on NULL. */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <setjmp.h>
#include <signal.h>
#include <unistd.h>

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

/* The call running now: a crash names it, counts as a failure, and the
 * program goes on with the next call (so that one run lists every crash). */
static const char *nt_call = "";
static sigjmp_buf nt_jb;
static int nt_crashes;

static void nt_on_signal(int sig) {
  fprintf(stderr, "FAIL test_null_args: signal %d in %s\n", sig, nt_call);
  fflush(stderr);
  if (++nt_crashes > 100) _Exit(1);
  siglongjmp(nt_jb, 1);
}

/* Callbacks for the arguments that take one. */
static dt_tensor *nt_step(dt_graph *g, int replica, const dt_minibatch *shard, void *user) {
  (void)replica;
  (void)shard;
  (void)user;
  return dt_sum(g, dt_param(g, 0));
}
static dt_result nt_next(void *user, int replica, int64_t step, dt_minibatch *out) {
  (void)user;
  (void)replica;
  (void)step;
  memset(out, 0, sizeof *out);
  out->rows = 1;
  return DTRAIN_OK;
}

/* A checkpoint file to open (none where the build has no file I/O). */
static char nt_ck_path[64];

static void nt_finish(void) {
  if (nt_ck_path[0]) remove(nt_ck_path);
}

static void nt_init(void) {
  const int64_t shape[2] = {2, 2};
  dt_params *p = dt_params_create(1);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = p;
  snprintf(nt_ck_path, sizeof nt_ck_path, "/tmp/dtrain_null_args_%ld.safetensors", (long)getpid());
  if (!p || dt_params_add(p, "w", 2, shape, dt_init_zeros()) < 0 || dt_checkpoint_save(nt_ck_path, &st) != DTRAIN_OK)
    nt_ck_path[0] = '\0';
  dt_params_destroy(p);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = nt_on_signal;
  sa.sa_flags = SA_NODEFER;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}

/* Valid-looking values for the arguments that are not NULL in a call. */
#define NT_SLOTS 8 /* output objects: one slot per argument position */
typedef struct nt_fix {
  dt_params *p;
  dt_graph *g;
  dt_tensor *t;
  dt_tensor *tl[2];
  dt_tensor *tout[8];
  dt_optim *o;
  dt_comm *comm;
  dt_checkpoint *ck;
  dt_cluster *cl;
  dt_strategy *s;
  dt_pstore *ps;
  float ps_data[4];
  dt_dataset *ds;
  dt_loader *ld;
  dt_rng rng;
  dt_dataset *ds_out[NT_SLOTS];
  dt_loader *ld_out[NT_SLOTS];
  dt_cluster *cl_out[NT_SLOTS];
  dt_text text, text_in;
  dt_npy npy, npy_in;
  dt_bytes bytes;
  dt_idx idx;
  dt_batch batch;
  dt_loader_options lopt;
  char cbuf[256];
  unsigned char vbuf[256];
  float fbuf[256];
  float *fbufs[2];
  int32_t ibuf[256];
  int64_t lbuf[16];
  int ivals[8];
  size_t szval;
  uint64_t u64[4];
  const char *cstr;
  char arg0[8];
  char *argv[2];
  /* zeroed option, output and layer structs */
@ZEROED@
} nt_fix;

static void nt_setup(nt_fix *f) {
  memset(f, 0, sizeof *f);
  dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG);
  for (int i = 0; i < 256; i++) f->fbuf[i] = 0.25f;
  for (int i = 0; i < 16; i++) f->lbuf[i] = 2;
  for (int i = 0; i < 8; i++) f->ivals[i] = i < 2 ? 1 - i : i; /* a permutation: 1 0 2 3 ... */
  f->fbufs[0] = f->fbuf;
  f->fbufs[1] = f->fbuf + 128;
  dt_rng_seed(&f->rng, 7);
  dt_rng_seed((dt_rng *)(void *)f->u64, 11);
  memcpy(f->arg0, "prog", 5);
  f->argv[0] = f->arg0;
  f->lopt.batch_size = 2;
  const int64_t shape[2] = {2, 2};
  f->p = dt_params_create(1);
  if (f->p && dt_params_add(f->p, "w", 2, shape, dt_init_constant(0.5f)) < 0) {
    dt_params_destroy(f->p);
    f->p = NULL;
  }
  f->g = dt_graph_create(f->p, NULL);
  if (f->g) {
    f->t = dt_tensor_from(f->g, 2, shape, f->fbuf);
    f->tl[0] = f->t;
    f->tl[1] = dt_tensor_from(f->g, 2, shape, f->fbuf);
  }
  dt_optim_options oo;
  memset(&oo, 0, sizeof oo);
  oo.kind = DTRAIN_OPTIM_SGD;
  if (f->p) f->o = dt_optim_create(f->p, &oo);
  f->comm = dt_comm_create_threads(1, 0);
  if (nt_ck_path[0]) f->ck = dt_checkpoint_open(nt_ck_path);
  if (dt_cluster_parse_json("{\"cluster\": {\"worker\": [\"127.0.0.1:1\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}",
                            &f->cl) != DTRAIN_OK)
    f->cl = NULL;
  if (f->p && f->o) {
    dt_strategy_options so = dt_strategy_one_device();
    f->s = dt_strategy_create(f->p, f->o, nt_step, NULL, &so);
  }
  f->ps = dt_pstore_create_local(f->ps_data, 4, 1, 0, (dt_async_update)0, 0);
  int64_t sample = 2;
  f->ds = dt_dataset_new(4, 1, &sample, 1);
  if (f->ds) f->ld = dt_loader_new(f->ds, &f->lopt);
  if (dt_text_parse("abcabcab", 8, &f->text_in) != DTRAIN_OK) memset(&f->text_in, 0, sizeof f->text_in);
  unsigned char npy[256];
  size_t len = 0;
  if (dt_npy_encode(npy, sizeof npy, &len, DTRAIN_NPY_F32, 2, shape, f->fbuf) != DTRAIN_OK ||
      dt_npy_parse(npy, len, &f->npy_in) != DTRAIN_OK)
    memset(&f->npy_in, 0, sizeof f->npy_in);
  dt_clear_error();
}

static void nt_teardown(nt_fix *f) {
  dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG);
  dt_set_allocator(NULL);
  for (int i = 0; i < NT_SLOTS; i++) {
    dt_loader_destroy(f->ld_out[i]);
    dt_dataset_destroy(f->ds_out[i]);
    dt_cluster_destroy(f->cl_out[i]);
  }
  dt_text_free(&f->text);
  dt_text_free(&f->text_in);
  dt_npy_free(&f->npy);
  dt_npy_free(&f->npy_in);
  dt_bytes_free(&f->bytes);
  dt_idx_free(&f->idx);
  dt_loader_destroy(f->ld);
  dt_dataset_destroy(f->ds);
  dt_comm_destroy(f->comm);
  dt_pstore_destroy(f->ps);
  dt_strategy_destroy(f->s);
  dt_cluster_destroy(f->cl);
  dt_checkpoint_close(f->ck);
  dt_optim_destroy(f->o);
  dt_graph_destroy(f->g);
  dt_params_destroy(f->p);
}

/* The valid values exist where the build has their parts: else the calls that
 * need them are left out and this test says so. */
static void nt_fixture_complete(void) {
  nt_fix f;
  unsigned feat = dt_build_features();
  nt_setup(&f);
  CHECK(f.p && f.g && f.t && f.tl[1] && f.o);
  if (feat & DTRAIN_FEATURE_DATA) CHECK(f.ds && f.ld && f.text_in.ids && f.npy_in.data);
  else th_skip("the data loaders are compiled out (DTRAIN_NO_DATA): calls needing a dataset left out");
  if ((feat & DTRAIN_FEATURE_DIST) && (feat & DTRAIN_FEATURE_THREADS)) CHECK(f.comm && f.cl && f.ps);
  else th_skip("no threads or no distributed parts: calls needing a communicator, cluster or store left out");
  if (feat & DTRAIN_FEATURE_STDIO) CHECK(f.ck);
  else th_skip("no file I/O (DTRAIN_NO_STDIO): calls needing an open checkpoint left out");
  CHECK(f.s);
  nt_teardown(&f);
}

static void nt_begin(const char *call) {
  nt_call = call;
  dt_clear_error();
}

/* An error must say why. */
static int nt_error_set(void) { return dt_last_result() != DTRAIN_OK && dt_last_error()[0] != '\0'; }

static void nt_check_result(dt_result r, int nullable_ok) {
  if (r == DTRAIN_OK) {
    CHECK_MSG(nullable_ok, "%s succeeded with a NULL argument not documented as optional", nt_call);
    return;
  }
  CHECK_MSG(r < 0, "%s returned %d", nt_call, (int)r);
  CHECK_MSG(nt_error_set(), "%s returned %s but left no dt_last_error()", nt_call, dt_result_name(r));
}

static void nt_check_ptr(int got, int nullable_ok) {
  if (got) {
    CHECK_MSG(nullable_ok, "%s returned an object with a NULL argument not documented as optional", nt_call);
    return;
  }
  CHECK_MSG(nt_error_set(), "%s returned NULL but left no dt_last_error()", nt_call);
}

/* A function returning a string that is never NULL. */
static void nt_check_string(const char *s) { CHECK_MSG(s != NULL, "%s returned NULL", nt_call); }

/* void and plain-value functions: a documented no-op, or an error set. */
static void nt_check_quiet(int noop) {
  CHECK_MSG(noop || nt_error_set(), "%s: not documented as a no-op on NULL, and no dt_last_error()", nt_call);
}
"""


def strip_comments(s):
    s = re.sub(r"/\*.*?\*/", " ", s, flags=re.S)
    return re.sub(r"//[^\n]*", " ", s)


def public_headers():
    out = []
    with open(os.path.join(ROOT, "src", "MANIFEST")) as f:
        for line in f:
            w = line.split()
            if len(w) == 2 and w[0] == "public":
                out.append(w[1])
    return out


def parse_param(p):
    p = p.strip()
    arr = re.search(r"\[[^\]]*\]\s*$", p)
    if arr:  # "uint64_t out[4]" is a pointer
        p = p[: arr.start()].strip()
    m = re.match(r"^(.*?)([A-Za-z_][A-Za-z_0-9]*)$", p)
    typ, name = m.group(1).strip(), m.group(2)
    if arr:
        typ += " *"
    return typ, name


def prototypes():
    protos = []
    for h in public_headers():
        with open(os.path.join(ROOT, "src", h)) as f:
            text = strip_comments(f.read())
        text = "\n".join(l for l in text.split("\n") if not l.lstrip().startswith("#"))
        CALLBACKS.update(re.findall(r"typedef[^;]*?\(\s*\*\s*(dt_[A-Za-z0-9_]+)\s*\)", text))
        for m in re.finditer(r"\bDTRAIN_API\b(.*?);", text, flags=re.S):
            decl = " ".join(m.group(1).split())
            decl = re.sub(r'DTRAIN_DEPRECATED\("[^"]*"\)', "", decl).strip()
            pm = re.match(r"^(.*?)\b(dt_[A-Za-z0-9_]+)\s*\((.*)\)$", decl)
            if not pm:
                sys.exit("gen_null_test: cannot parse: " + decl)
            ret, name, args = pm.group(1).strip(), pm.group(2), pm.group(3).strip()
            params = [] if args in ("", "void") else [parse_param(a) for a in args.split(",")]
            protos.append((h, ret, name, params))
    return protos


def norm(t):
    return t.replace("struct ", "").replace(" ", "")


def is_pointer(typ):
    return "*" in typ or norm(typ).replace("const", "") in CALLBACKS


def base_key(typ):
    t = norm(typ)
    if t.startswith("const"):
        t = t[len("const"):]
    return t


def valid_value(fn, typ, name, pos):
    """C expression for a harmless valid value of pointer type typ, or None."""
    key = base_key(typ)
    if norm(typ) == "constchar**":
        key = "constchar**"
    if key == "constchar*" or key == "char*" and "const" in typ:
        key = "constchar*"
    if key == "constchar*":
        if name in ("path", "dir", "images_path", "labels_path"):
            return '"/nonexistent-dtrain-null-test/x"'
        if name == "json":
            return '"{}"'
        return '"w"' if name == "name" else '"wxyz"'
    if typ.replace(" ", "").startswith("const") and key in ("dt_text*", "dt_npy*"):
        return "&f.%s_in" % key[3:-1]
    if key in FIXTURE:
        # output slots: one per argument position, so that two outputs of a
        # call (train and val) never alias
        return FIXTURE[key].replace("%d", str(pos))
    bare = key.rstrip("*")
    if key.count("*") == 1 and bare in ZEROED:
        return "&f.z_" + bare
    return None


def scalar_value(typ, name):
    t = norm(typ).replace("const", "")
    if name in SCALAR_BY_NAME:
        v = SCALAR_BY_NAME[name]
        if t.startswith("dt_") and t not in ("dt_init",):
            return "(%s)%s" % (t, v) if not v.startswith("DTRAIN_") else v
        return v
    if t in SCALAR_BY_TYPE:
        return SCALAR_BY_TYPE[t]
    if t.startswith("dt_"):
        return "(%s)0" % t
    sys.exit("gen_null_test: no scalar value for %s %s" % (typ, name))


def kind_of(ret):
    r = norm(ret)
    if r == "void":
        return "void"
    if r == "dt_result":
        return "result"
    if "*" in r:
        return "ptr"
    return "scalar"


OUT_DESTROY = {"dt_dataset**": "dt_dataset_destroy", "dt_cluster**": "dt_cluster_destroy"}
RET_DESTROY = {"dt_graph*": "dt_graph_destroy", "dt_params*": "dt_params_destroy",
               "dt_optim*": "dt_optim_destroy", "dt_dataset*": "dt_dataset_destroy",
               "dt_loader*": "dt_loader_destroy", "dt_comm*": "dt_comm_destroy",
               "dt_checkpoint*": "dt_checkpoint_close", "dt_cluster*": "dt_cluster_destroy",
               "dt_strategy*": "dt_strategy_destroy", "dt_pstore*": "dt_pstore_destroy",
               "dt_device_group*": "dt_device_group_destroy"}


def c_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


OBJECTS = ("f.g", "f.p", "f.t", "f.o", "f.comm", "f.ds", "f.ld", "f.ck", "f.cl", "f.s", "f.ps")


def emit_call(fn, ret, params, values, null_name):
    """One call: values[i] per argument; null_name the argument set NULL (or '*')."""
    kind = kind_of(ret)
    args = ", ".join(values)
    desc = "%s(%s)" % (fn, ", ".join("NULL" if v == "NULL" else n for v, (_, n) in zip(values, params)))
    nullable = NULLABLE.get(fn, set())
    ptr_names = [n for t, n in params if is_pointer(t)]
    if null_name == "*":
        ok_null = all(n in nullable for n in ptr_names)
    else:
        ok_null = null_name in nullable
    ok_null = "1" if ok_null else "0"
    quiet = fn in NOOP or re.search(r"_(destroy|free|close)$", fn) or ok_null == "1"
    noop = "1" if quiet else "0"
    # The fixture objects this call needs (a build switch may leave one out).
    needs = sorted({v.lstrip("&") for v in values if v.lstrip("&") in OBJECTS})
    call = []
    if kind == "void":
        call.append("%s(%s);" % (fn, args))
        call.append("nt_check_quiet(%s);" % noop)
    elif kind == "result":
        call.append("nt_check_result(%s(%s), %s);" % (fn, args, ok_null))
    elif kind == "ptr":
        destroy = RET_DESTROY.get(norm(ret).replace("const", ""))
        if fn in STRING_ALWAYS:
            call.append("nt_check_string(%s(%s));" % (fn, args))
        else:
            call.append("%s r_ = %s(%s);" % (ret, fn, args))
            call.append("nt_check_ptr(r_ != NULL, %s);" % ok_null)
            if destroy:
                call.append("if (r_) %s(r_);" % destroy)
    else:
        call.append("(void)%s(%s);" % (fn, args))
        call.append("nt_check_quiet(%s);" % noop)
    lines = ["  nt_setup(&f);"]
    ind = "  "
    if needs:
        lines.append("  if (%s) {" % " && ".join(needs))
        ind = "    "
    lines.append(ind + "if (sigsetjmp(nt_jb, 1) == 0) {")
    lines.append(ind + "  nt_begin(%s);" % c_str(desc))
    lines += [ind + "  " + c for c in call]
    lines.append(ind + "} else {")
    lines.append(ind + "  th_cur_failed++; /* crashed: named by nt_on_signal */")
    lines.append(ind + "}")
    if needs:
        lines.append("  }")
    lines.append("  nt_teardown(&f);")
    return lines


def gen():
    body, runs, skipped = [], [], []
    for h, ret, fn, params in prototypes():
        ptrs = [i for i, (t, n) in enumerate(params) if is_pointer(t)]
        if not ptrs:
            continue
        if fn in EXCLUDE:
            skipped.append((fn, EXCLUDE[fn]))
            continue
        lines = ["/* %s: %s %s(%s) */" % (h, ret, fn, ", ".join("%s %s" % p for p in params)),
                 "static void nt_%s(void) {" % fn, "  nt_fix f;"]
        allnull = ["NULL" if is_pointer(t) else scalar_value(t, n) for t, n in params]
        lines += emit_call(fn, ret, params, allnull, "*")
        valid = [valid_value(fn, t, n, i) if is_pointer(t) else scalar_value(t, n) for i, (t, n) in enumerate(params)]
        missing = [params[i] for i in ptrs if valid[i] is None]
        if fn in ALL_NULL_ONLY:
            lines.append("  /* one NULL at a time: not done, %s */" % ALL_NULL_ONLY[fn])
        elif missing and len(ptrs) > 1:
            lines.append("  /* one NULL at a time: no generated value for %s */" %
                         ", ".join("%s %s" % m for m in missing))
        elif len(ptrs) > 1:
            for i in ptrs:
                vals = list(valid)
                vals[i] = "NULL"
                lines += emit_call(fn, ret, params, vals, params[i][1])
        lines.append("}")
        body.append("\n".join(lines))
        runs.append("  TH_RUN(nt_%s);" % fn)
    return body, runs, skipped


def render():
    body, runs, skipped = gen()
    out = [HEAD.replace("@ZEROED@", "\n".join("  %s z_%s;" % (t, t) for t in sorted(ZEROED))).rstrip("\n"), ""]
    out += body
    out.append("")
    out.append("int main(void) {")
    out.append("  nt_init();")
    out.append("  TH_RUN(nt_fixture_complete);")
    out += runs
    for fn, why in skipped:
        out.append("  th_skip_item(%s, %s);" % (c_str(fn), c_str("not called: " + why)))
    out.append("  nt_finish();")
    out.append('  return th_summary("null_args");')
    out.append("}")
    return "\n".join(out) + "\n"


def main():
    text = render()
    if "--check" in sys.argv[1:]:
        try:
            with open(OUT) as f:
                cur = f.read()
        except OSError:
            cur = None
        if cur != text:
            print("tests/test_null_args.c is stale: run 'python3 tools/gen_null_test.py' and commit it")
            return 1
        print("tests/test_null_args.c is up to date")
        return 0
    with open(OUT + ".tmp", "w") as f:
        f.write(text)
    os.replace(OUT + ".tmp", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
