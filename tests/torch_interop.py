#!/usr/bin/env python3
"""dtrain <-> PyTorch weights (tools/dtrain_torch.py, examples/02 --init-weights / --evaluate).

usage: torch_interop.py EXAMPLE_BINARY WORKDIR

  - the reader against bad bytes (numpy): every structural fault and a changed
    byte are refused with the reason, by this reader and by dtrain's;
  - dtrain -> PyTorch -> dtrain: a model trained by dtrain evaluates in PyTorch
    with the same test accuracy, and comes back bit for bit (same accuracy,
    same params_checksum);
  - PyTorch -> dtrain: an MLP and a CNN trained in PyTorch evaluate in dtrain
    with the same number of test samples right and the same loss (1e-4);
  - the example's flags: --evaluate without weights, a missing file, the
    wrong model's weights.
Prints "torch_interop: N passed, N failed, N skipped"; exit 1 on a failure.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))

passed = failed = skipped = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL %s" % what)


def skip(what, why):
    global skipped
    skipped += 1
    print("skip %s: %s" % (what, why))


def finish():
    print("torch_interop: %d passed, %d failed, %d skipped" % (passed, failed, skipped))
    sys.exit(1 if failed else 0)


try:
    import numpy as np
except ImportError:
    skip("torch_interop", "numpy is not installed")
    finish()
import dtrain_torch as dtt  # noqa: E402

EX, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
DATA = "/usr/share/datasets/fashion-mnist"
have_data = os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz"))


def run(*args):
    """(rc, last JSON line or None, stderr) of the example."""
    p = subprocess.run([EX, "--quiet", "--csv", os.path.join(WORK, "m.csv"), "--svg", os.path.join(WORK, "m.svg")]
                       + list(args), capture_output=True, text=True, timeout=600)
    js = None
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            js = json.loads(line)
    return p.returncode, js, p.stderr


def raises(fn, needle, what):
    try:
        fn()
    except dtt.DtrainFileError as e:
        check(needle in str(e), "%s: message %r lacks %r" % (what, str(e), needle))
        return
    check(False, "%s: accepted" % what)


# ---- the reader against bad bytes (numpy alone) ------------------------------------------------
def p(name):
    return os.path.join(WORK, name)


rng = np.random.default_rng(5)
sd = {"fc1.weight": rng.standard_normal((4, 3)).astype(np.float32), "fc1.bias": np.zeros(4, np.float32),
      "fc2.weight": rng.standard_normal((2, 4), dtype=np.float64)}
dtt.save(sd, p("good.st"), {"note": "x"})
back = dtt.load(p("good.st"), numpy=True)
check(list(back) == list(sd) and all(np.array_equal(back[k], sd[k].astype(np.float32)) for k in sd),
      "save/load keeps names, order and float32 values")
check(dtt.metadata(p("good.st"))["note"] == "x", "metadata kept")
raw = open(p("good.st"), "rb").read()
n = int.from_bytes(raw[:8], "little")
check((8 + n) % 8 == 0, "data starts 8-byte aligned")


def bad(name, data):
    with open(p(name), "wb") as f:
        f.write(data)
    return p(name)


raises(lambda: dtt.load(bad("short.st", raw[:5])), "not a safetensors file", "5 bytes")
raises(lambda: dtt.load(bad("text.st", b"hello, this is a text file, not tensors\n")), "not a safetensors file",
       "a text file")
raises(lambda: dtt.load(bad("trunc.st", raw[:len(raw) - 4])), "", "truncated data")
raises(lambda: dtt.load(bad("len.st", (len(raw)).to_bytes(8, "little") + raw[8:])), "exceeds the file",
       "header length beyond the file")
flip = bytearray(raw)
flip[-1] ^= 0x01
raises(lambda: dtt.load(bad("flip.st", bytes(flip))), "checksum mismatch", "one data bit changed")
hdr = raw[8:8 + n].decode()
dup = hdr.replace('"fc1.bias"', '"fc1.weight"', 1).encode()
raises(lambda: dtt.load(bad("dup.st", len(dup).to_bytes(8, "little") + dup + raw[8 + n:])), "duplicate key",
       "a duplicate tensor name")
over = hdr.replace('"data_offsets":[48,64]', '"data_offsets":[44,60]', 1)
if over != hdr:
    raises(lambda: dtt.load(bad("over.st", raw[:8] + over.encode() + raw[8 + n:])), "", "overlapping offsets")
else:
    check(False, "the overlap case did not find its offsets in %s" % hdr[:200])
raises(lambda: dtt.save({"n": np.arange(3)}, p("int.st")), "not floating point", "an integer tensor")
# dtrain's own reader refuses the changed file too (before loading any data)
rc, _, err = run("--init-weights", p("flip.st"), "--evaluate")
check(rc == 1 and "checksum mismatch" in err, "dtrain refuses a changed byte: rc %d %r" % (rc, err[-200:]))
rc, _, err = run("--init-weights", p("text.st"), "--evaluate")
check(rc == 1 and "not a safetensors file" in err, "dtrain: a text file: rc %d %r" % (rc, err[-200:]))
rc, _, err = run("--evaluate")
check(rc == 2 and "--init-weights" in err, "--evaluate without weights: rc %d %r" % (rc, err[-200:]))
rc, _, err = run("--init-weights", p("nonexistent.st"))
check(rc == 1 and "nonexistent.st" in err, "a missing weights file: rc %d %r" % (rc, err[-200:]))

if not have_data:
    skip("dtrain <-> PyTorch training", "no %s (Debian package dataset-fashion-mnist)" % DATA)
    finish()

# ---- dtrain -> PyTorch -> dtrain ----------------------------------------------------------------------
ck = p("dtrain_mlp.ckpt")
rc, trained, err = run("--model", "mlp", "--epochs", "1", "--limit", "6000", "--checkpoint", ck, "--json")
check(rc == 0 and trained is not None, "dtrain trains the MLP: rc %d %s" % (rc, err[-300:]))
if rc != 0 or trained is None:
    finish()
entries, meta, data = dtt._parse(ck)  # dtrain's checksum verified by this reader
check(int(meta["checksum"], 16) == dtt.checksum(entries, meta, data), "this reader computes dtrain's checksum")
rc, wrong, err = run("--model", "cnn", "--init-weights", ck, "--evaluate")
check(rc == 1 and "'conv1.weight' is missing" in err, "an MLP's weights for the CNN are refused by name: rc %d %r" % (rc, err[-200:]))
want_right = int(round(trained["test_accuracy"] * trained["test_samples"]))

try:
    import torch
except ImportError:
    torch = None
if torch is None:
    skip("PyTorch side", "torch is not installed (python3-torch)")
    # numpy round trip: the weights come back bit for bit
    dtt.save(dtt.load(ck, numpy=True), p("rt.st"))
    rc, ev, err = run("--init-weights", p("rt.st"), "--evaluate", "--json")
    check(rc == 0 and ev and ev["params_checksum"] == trained["params_checksum"], "numpy round trip bitwise")
    finish()

torch.manual_seed(0)
m = dtt.FashionMLP()
m.load_state_dict(dtt.load(ck))
acc, loss, right = dtt.evaluate(m)
check(right == want_right, "dtrain's MLP in PyTorch: %d right, dtrain %d" % (right, want_right))
check(abs(loss - trained["test_loss"]) <= 1e-4 * max(1.0, loss), "loss %.6f vs dtrain %.5f" % (loss, trained["test_loss"]))
dtt.save(m.state_dict(), p("from_torch.st"))
rc, ev, err = run("--init-weights", p("from_torch.st"), "--evaluate", "--json")
check(rc == 0 and ev is not None, "dtrain evaluates PyTorch's copy: rc %d %s" % (rc, err[-300:]))
if ev:
    check(ev["test_accuracy"] == trained["test_accuracy"] and ev["test_loss"] == trained["test_loss"],
          "back in dtrain: accuracy %s loss %s vs %s %s" % (ev["test_accuracy"], ev["test_loss"],
                                                            trained["test_accuracy"], trained["test_loss"]))
    check(ev["params_checksum"] == trained["params_checksum"], "back in dtrain bit for bit: checksum %s vs %s"
          % (ev["params_checksum"], trained["params_checksum"]))
# --init-weights without --evaluate: training starts from them (a step of 1e-12 keeps their accuracy,
# where the seed's own initial weights are at chance)
rc, st, err = run("--init-weights", p("from_torch.st"), "--epochs", "1", "--limit", "640", "--lr", "1e-12", "--json")
check(rc == 0 and st and st["test_accuracy"] == trained["test_accuracy"],
      "training starts from --init-weights: rc %d accuracy %s vs %s" % (rc, st and st["test_accuracy"],
                                                                       trained["test_accuracy"]))
# --resume FILE --evaluate reads the same weights from the full checkpoint
rc, ev2, err = run("--resume", ck, "--evaluate", "--json")
check(rc == 0 and ev2 and ev2["test_accuracy"] == trained["test_accuracy"], "--resume --evaluate: rc %d" % rc)


# ---- PyTorch -> dtrain: an MLP and a CNN trained in PyTorch ----------------------------------------------
def from_torch(model, epochs, limit):
    f = p("torch_%s.st" % model)
    q = subprocess.run([sys.executable, os.path.join(HERE, "..", "tools", "dtrain_torch.py"), "train", f, "--model",
                        model, "--epochs", str(epochs), "--limit", str(limit), "--seed", "3"],
                       capture_output=True, text=True, timeout=600)
    check(q.returncode == 0, "PyTorch trains the %s: %s" % (model, q.stderr[-300:]))
    if q.returncode:
        return
    torch.manual_seed(0)
    net = dtt.MODELS[model]()
    net.load_state_dict(dtt.load(f))
    t_acc, t_loss, t_right = dtt.evaluate(net)
    rc, ev, err = run("--model", model, "--init-weights", f, "--evaluate", "--json")
    check(rc == 0 and ev is not None, "dtrain evaluates PyTorch's %s: rc %d %s" % (model, rc, err[-300:]))
    if not ev:
        return
    check(ev["test_correct"] == t_right, "PyTorch's %s in dtrain: %d right, PyTorch %d" % (model, ev["test_correct"],
                                                                                          t_right))
    check(abs(ev["test_loss"] - t_loss) <= 1e-4 * max(1.0, t_loss), "PyTorch's %s loss in dtrain %.5f vs %.6f"
          % (model, ev["test_loss"], t_loss))
    check(t_acc > 0.5, "PyTorch's %s learned (accuracy %.4f)" % (model, t_acc))


from_torch("mlp", 1, 6000)
from_torch("cnn", 1, 2000)
finish()
