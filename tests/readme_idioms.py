#!/usr/bin/env python3
"""Every C snippet of README.md as compilable code (issue 22 item 2).

usage: readme_idioms.py README.md OUT.c

Each ```c block of the README becomes a function (its statements) plus the
file-scope functions it defines (lines from a column-0 "static ..." to the
column-0 "}"), given the variables it uses from CONTEXT below, keyed by a
phrase the block contains. tests/compile_checks.sh compiles OUT.c as C11 and as
C++17 with -Wall -Wextra -Werror: a snippet that is not valid in both fails.
A block that no key matches fails here: give it a context below (or, for a
block that is not C code to compile, a SKIP entry with the reason).
"""
import re
import sys

PRELUDE = r"""
#include "dtrain.h"
#include <stdio.h>
#include <string.h>
/* what the snippets call but do not define */
typedef struct model { int layers; } model;
dt_tensor *my_batch_loss(model *m, int64_t epoch, int64_t index);
dt_tensor *model_forward(dt_graph *g, model *m, dt_tensor *x);
dt_tensor *my_layers(dt_graph *g, int s, dt_tensor *x);
dt_result eval(dt_fit_eval *e, void *user);
dt_result next_batch(void *user, int replica, int64_t step, dt_minibatch *out);
dt_device *dt_cuda_device_create(int index); /* dtrain_cuda.h (a .cu file) */
enum { LAST = 1 };
"""

# key phrase -> the declarations the block's statements need (function parameters)
CONTEXT = {
    "dt_nn_linear_init(&l1": "int steps, const int64_t *shape, float *batch_pixels, const int32_t *batch_labels",
    "st.params = P; st.optim = opt; st.graph = g;": "dt_params *P, dt_optim *opt, dt_graph *g, int64_t epoch, int64_t batch, "
                                                 "dt_params *P2, dt_optim *opt2, dt_graph *g2",
    "dt_fit_options fd": "model m, dt_params *P, dt_optim *opt, dt_graph *g, int64_t n_train, int64_t batch",
    "dt_fashion_mnist_load": "dt_graph *g",
    "dt_strategy_mirrored(4)": "model m, dt_params *P, dt_optim *opt, const float *pixels, const int32_t *labels, "
                               "float loss, int steps",
    "dt_cluster_discover": "int argc, char **argv",
    "dt_net_defaults()": "dt_cluster *c, dt_params *P, dt_optim *opt, model m, dt_step_fn step",
    "dt_ps_serve": "dt_cluster *c, dt_params *P, dt_optim *opt, dt_net_options no, model m, int steps, int data, "
                   "float loss, dt_step_fn step",
    "dt_comm_send": "dt_comm *c, int rank, int prev, int next, float *acts, float *grad_in, const float *grad_out, "
                    "float *partial, int64_t n",
    "powersgd:4": "dt_comm *comm",
    "sd.overlap = 1": "dt_comm *comm",
    "sd.push_early = 1": "dt_pstore *store, int k",
    "dt_pipeline_defaults": "model m, dt_params *first_half, dt_params *second_half, dt_optim_options optim_options, "
                            "dt_minibatch batch, float loss",
    "dt_checkpoint_save_part": "dt_params **params, dt_pipeline *pl, int s, int P, int t, int T",
    "dt_tp_column_linear": "dt_graph *g, dt_tensor *x, dt_tensor *w1, dt_tensor *b1, dt_tensor *w2, dt_tensor *b2, "
                           "dt_comm *tp, int r",
    "gd.device = dev": "dt_params *P, dt_optim *opt",
    "dt_device *gpu[2]": "dt_params *P, dt_optim *opt, model model, dt_step_fn step",
}
SKIP = {
    "#define DTRAIN_IMPLEMENTATION\n#include \"dtrain.h\"": "the include itself (every test file does it)",
}


def blocks(text):
    return re.findall(r"^```c\n(.*?)^```$", text, flags=re.S | re.M)


def split(block):
    """(file-scope definitions, statements) of a block."""
    top, body, inside = [], [], False
    for line in block.splitlines():
        if not inside and line.startswith("static "):
            inside = True
        (top if inside else body).append(line)
        if inside and line == "}":
            inside = False
    return "\n".join(top), "\n".join(body)


def main():
    readme, out = sys.argv[1], sys.argv[2]
    text = open(readme, encoding="utf-8").read()
    parts, bad = [PRELUDE], 0
    for i, b in enumerate(blocks(text), 1):
        if any(k in b for k in SKIP):
            continue
        keys = [k for k in CONTEXT if k in b]
        if len(keys) != 1:
            print("readme_idioms: block %d (%r...) matches %d contexts: give it one in tests/readme_idioms.py"
                  % (i, b[:60], len(keys)))
            bad = 1
            continue
        top, body = split(b)
        # a step function's name is "step" in several blocks: each gets its own
        top = re.sub(r"\bstep\b", "step_%d" % i, top)
        body = re.sub(r"\bstep\b(?!_)", "step_%d" % i, body) if top else body
        parts.append("/* README block %d */\n%s\nint readme_block_%d(%s);\nint readme_block_%d(%s) {\n%s\nreturn 0;\n}\n"
                     % (i, top, i, CONTEXT[keys[0]], i, CONTEXT[keys[0]], body))
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return bad


if __name__ == "__main__":
    sys.exit(main())
