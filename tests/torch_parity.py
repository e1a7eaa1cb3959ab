#!/usr/bin/env python3
"""Compare dtrain's loss and gradients with PyTorch's for the same MLP / CNN,
the same weights and the same batch (files written by tests/torch_dump.c).

usage: torch_parity.py DIR [DIR ...]   (a DIR with optim.txt: the optimizers)
Prints one line per check and "torch_parity: N passed, N failed, 0 skipped"
(or "skip torch_parity: why" and "0 passed, 0 failed, 1 skipped" when torch
is not installed). A check passes
when |loss - loss_torch| <= 1e-4 |loss_torch| and, for every parameter,
||grad - grad_torch|| <= 1e-4 ||grad_torch|| (relative error of the whole
gradient, which is well defined where single elements are near zero).

A directory with maps.txt (the mlp one) also holds every elementwise map of
dtrain's DT__MAP_LIST (src/dt_maps.h): each is recomputed with its torch
expression in MAPS below, forward and backward, with the same tolerance. A
map without an entry in MAPS fails: add its expression there. The maps'
inputs hold NaN and +-Inf, and special.txt lists softmax, losses, pooling
and reductions on NaN / Inf inputs: NaN must come out where torch gives NaN,
each infinity where torch gives it, the finite rest within the tolerance."""
import os
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover
    print(f"skip torch_parity: PyTorch/numpy not available ({e}); apt-get install python3-torch")
    print("torch_parity: 0 passed, 0 failed, 1 skipped")
    sys.exit(0)

torch.set_num_threads(1)
TOL = 1e-4


# The torch expression of each map of DT__MAP_LIST, x a tensor, s the scalar
# (ignored by the ops that take none).
MAPS = {
    "add_scalar": lambda x, s: x + s,
    "mul_scalar": lambda x, s: x * s,
    "rsub_scalar": lambda x, s: s - x,
    "pow_scalar": lambda x, s: torch.pow(x, s),
    "neg": lambda x, s: -x,
    "exp": lambda x, s: torch.exp(x),
    "leaky_relu": lambda x, s: F.leaky_relu(x, s),
    "gelu": lambda x, s: F.gelu(x, approximate="tanh"),
    "log": lambda x, s: torch.log(x),
    "sqrt": lambda x, s: torch.sqrt(x),
    "relu": lambda x, s: F.relu(x),
    "sigmoid": lambda x, s: torch.sigmoid(x),
    "tanh": lambda x, s: torch.tanh(x),
}


def load(d, name, dtype="<f4"):
    return np.fromfile(os.path.join(d, name), dtype=dtype)


def run(d):
    meta = [line.split() for line in open(os.path.join(d, "index.txt"))]
    model = next(m[1] for m in meta if m[0] == "model")
    batch = int(next(m[1] for m in meta if m[0] == "batch"))
    params = {}
    for m in meta:
        if m[0] == "param":
            shape = [int(v) for v in m[2:]]
            params[m[1]] = torch.tensor(load(d, m[1] + ".f32").reshape(shape).astype(np.float32), requires_grad=True)
    x = torch.tensor(load(d, "x.f32").astype(np.float32))
    y = torch.tensor(load(d, "y.i32", "<i4").astype(np.int64))
    p = params
    if model == "mlp":
        h = x.reshape(batch, 784)
        h = F.relu(F.linear(h, p["fc1.weight"], p["fc1.bias"]))
        h = F.relu(F.linear(h, p["fc2.weight"], p["fc2.bias"]))
        h = F.linear(h, p["fc3.weight"], p["fc3.bias"])
    else:
        h = x.reshape(batch, 1, 28, 28)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["conv1.weight"], p["conv1.bias"], padding=2)), 2, 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["conv2.weight"], p["conv2.bias"], padding=2)), 2, 2)
        h = F.relu(F.linear(h.flatten(1), p["fc1.weight"], p["fc1.bias"]))
        h = F.linear(h, p["fc2.weight"], p["fc2.bias"])
    loss = F.cross_entropy(h, y)
    loss.backward()
    results = []
    ours = float(load(d, "loss.f32")[0])
    rel = abs(ours - loss.item()) / abs(loss.item())
    results.append((f"{model} loss", rel, f"dtrain {ours:.7g} torch {loss.item():.7g}"))
    for name, t in params.items():
        g = load(d, "grad." + name + ".f32").reshape(t.shape)
        ref = t.grad.numpy().astype(np.float64)
        rel = np.linalg.norm(g.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
        results.append((f"{model} grad {name}", rel, f"|g| {np.linalg.norm(ref):.4g}"))
    return results


def rel_err(ours, ref):
    """Relative error of the finite values; NaN must sit where torch has
    NaN and each infinity where torch has the same one (else inf)."""
    ours = ours.astype(np.float64).ravel()
    ref = ref.astype(np.float64).ravel()
    if ours.shape != ref.shape:
        return float("inf")
    if not np.array_equal(np.isnan(ours), np.isnan(ref)):
        return float("inf")
    inf = np.isinf(ref)
    if not np.array_equal(np.isinf(ours), inf) or not np.array_equal(ours[inf], ref[inf]):
        return float("inf")
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0
    return np.linalg.norm(ours[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)


# The torch expression of each op of torch_dump.c's special.txt: inputs with
# NaN and Inf through softmax, losses, pooling, reductions and integer
# powers (which, unlike MAPS's pow_scalar at 1.7, take any input).
LABELS = torch.tensor([0, 1, 3, 2])
SPECIAL = {
    "softmax": lambda x, t: F.softmax(x, 1),
    "log_softmax": lambda x, t: F.log_softmax(x, 1),
    "xent": lambda x, t: F.cross_entropy(x, LABELS),
    "xent_neginf": lambda x, t: F.cross_entropy(x, LABELS),
    "mse": lambda x, t: F.mse_loss(x, t),
    "max_pool": lambda x, t: F.max_pool2d(x, 2, 2),
    "avg_pool": lambda x, t: F.avg_pool2d(x, 2, 2),
    "sum": lambda x, t: x.sum(),
    "mean_axis": lambda x, t: x.mean(1),
    "max_pool_k3": lambda x, t: F.max_pool2d(x, 3, 1),
    "pow0": lambda x, t: torch.pow(x, 0.0),
    "pow2": lambda x, t: torch.pow(x, 2.0),
    "pow_neg1": lambda x, t: torch.pow(x, -1.0),
}


def run_special(d):
    path = os.path.join(d, "special.txt")
    if not os.path.exists(path):
        return []
    results = []
    for line in open(path):
        f = line.split()
        name, nd = f[1], int(f[2])
        shape = [int(v) for v in f[3:3 + nd]]
        if name not in SPECIAL:
            results.append((f"special {name}", float("inf"), "no torch expression: add it to SPECIAL"))
            continue
        x = torch.tensor(load(d, f"special.{name}.x.f32").reshape(shape), requires_grad=True)
        t = torch.tensor(load(d, f"special.{name}.t.f32").reshape(shape))
        y = SPECIAL[name](x, t)
        go = torch.tensor(load(d, f"special.{name}.go.f32")).reshape(y.shape)
        y.backward(go)
        results.append((f"special {name} forward", rel_err(load(d, f"special.{name}.y.f32"), y.detach().numpy()), "NaN/Inf input"))
        results.append((f"special {name} backward", rel_err(load(d, f"special.{name}.gx.f32"), x.grad.numpy()), "NaN/Inf input"))
    return results


def run_maps(d):
    path = os.path.join(d, "maps.txt")
    if not os.path.exists(path):
        return []
    results = []
    for line in open(path):
        _, name, s, _n = line.split()
        s = float(s)
        if name not in MAPS:
            results.append((f"map {name}", float("inf"), "no torch expression: add it to MAPS in tests/torch_parity.py"))
            continue
        x = torch.tensor(load(d, f"map.{name}.x.f32"), requires_grad=True)
        go = torch.tensor(load(d, f"map.{name}.go.f32"))
        y = MAPS[name](x, s)
        y.backward(go)
        results.append((f"map {name} forward", rel_err(load(d, f"map.{name}.y.f32"), y.detach().numpy()), f"s {s:g}"))
        results.append((f"map {name} backward", rel_err(load(d, f"map.{name}.gx.f32"), x.grad.numpy()), f"s {s:g}"))
    return results


def run_optim(d):
    """torch_dump optim's settings repeated with torch.optim: the weight
    (5x7) in a group with the weight decay, the bias (7) in one without
    (dtrain decays ndim >= 2 only, by default); each step's change from the
    start against torch's, relative error of the whole change. Every step is
    compared; a failing one is reported, and each setting's last step."""
    results, last = [], {}
    nw = 35  # the weight's elements, first on each line; the bias follows
    for line in open(os.path.join(d, "optim.txt")):
        f = line.split()
        if f[0] == "config":
            name, kind = f[1], int(f[2])
            lr, mom, nest, wd, b1, b2, eps, alpha = map(float, f[3:11])
            continue
        vals = np.array([float(v) for v in f[2:]], dtype=np.float32)
        step = int(f[1])
        if f[0] == "p0":
            p0 = vals.astype(np.float64)
            w = torch.tensor(vals[:nw].reshape(5, 7).copy(), requires_grad=True)
            b = torch.tensor(vals[nw:].copy(), requires_grad=True)
            groups = [{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}]
            if kind == 0:
                opt = torch.optim.SGD(groups, lr=lr, momentum=mom, nesterov=bool(nest))
            elif kind == 1:
                opt = torch.optim.Adam(groups, lr=lr, betas=(b1, b2), eps=eps)
            elif kind == 2:
                opt = torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps)
            else:
                opt = torch.optim.RMSprop(groups, lr=lr, alpha=alpha, eps=eps, momentum=mom)
        elif f[0] == "g":
            w.grad = torch.tensor(vals[:nw].reshape(5, 7).copy())
            b.grad = torch.tensor(vals[nw:].copy())
            opt.step()
        elif f[0] == "p":
            ref = np.concatenate([w.detach().numpy().ravel(), b.detach().numpy().ravel()]).astype(np.float64)
            moved = ref - p0
            rel = np.linalg.norm(vals.astype(np.float64) - ref) / max(np.linalg.norm(moved), 1e-30)
            check = (f"optim {name} step {step}", rel, f"|change| {np.linalg.norm(moved):.4g}")
            if rel > TOL:
                results.append(check)
            last[name] = check
    return results + [c for c in last.values() if c[1] <= TOL]


def main():
    passed = failed = 0
    for d in sys.argv[1:]:
        if os.path.exists(os.path.join(d, "optim.txt")):
            checks = run_optim(d)
        else:
            checks = run(d) + run_maps(d) + run_special(d)
        for what, rel, info in checks:
            ok = rel <= TOL
            print(f"{'ok' if ok else 'FAIL'} {what}: relative error {rel:.2e} ({info})")
            passed += ok
            failed += not ok
    print(f"torch_parity: {passed} passed, {failed} failed, 0 skipped")
    sys.exit(1 if failed else 0)


main()
