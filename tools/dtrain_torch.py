#!/usr/bin/env python3
"""dtrain <-> PyTorch: weights both ways, through safetensors files.

A dtrain checkpoint (dt_checkpoint_save, examples' --checkpoint) is a
safetensors file: float32 tensors under the parameters' names ("fc1.weight"
[out, in], "conv1.weight" [out, in, k, k], "*.bias" [out]: PyTorch's names and
layouts for nn.Linear and nn.Conv2d), the optimizer state as
"optim.<slot>.<name>", and string metadata with a "checksum" (dtrain's 64-bit
hash over the index and the data, described in src/dt_safetensors.h).

    import dtrain_torch as dtt
    sd = dtt.load("build/fmnist.ckpt")          # {"fc1.weight": tensor, ...}
    model = dtt.FashionMLP(); model.load_state_dict(sd)
    dtt.save(model.state_dict(), "from_torch.safetensors")
    # then: build/examples/02_fashion_mnist --init-weights from_torch.safetensors --evaluate

load(path, weights_only=True, numpy=False)
    The file's tensors (the parameters and buffers; with weights_only=False
    the "optim.*" tensors too) as a dict of torch tensors, or of numpy arrays
    when torch is not installed or numpy=True. The checksum is verified when
    the file has one; every structural rule dtrain checks is checked here.
save(state_dict, path, metadata=None)
    Writes the tensors (torch tensors or numpy arrays, any float dtype, cast
    to float32) as a safetensors file with a dtrain checksum, atomically
    (a temporary file renamed over path). dtrain reads it with
    dt_checkpoint_load_weights / --init-weights (names and shapes must be the
    model's). A non-float tensor (BatchNorm's num_batches_tracked) is refused
    by name: drop it from the dict first.
FashionMLP, FashionCNN (with torch)
    examples/02_fashion_mnist's two models as torch modules, same names and
    layouts: MLP 784-256-128-10 (fc1, fc2, fc3, ReLU between); CNN conv1 1->32
    5x5 pad 2, ReLU, 2x2 max pool, conv2 32->64 5x5 pad 2, ReLU, 2x2 max pool,
    flatten (N, 64*7*7 in C,H,W order), fc1 3136->1024, ReLU, fc2 1024->10.
    Input: [N, 784] pixels scaled to [0, 1].

Command line (the tests use it; numpy needed, torch for evaluate/train):
    dtrain_torch.py info FILE
    dtrain_torch.py evaluate FILE --model mlp|cnn [--data DIR]
        test accuracy and mean cross-entropy of the weights in PyTorch (one JSON line)
    dtrain_torch.py train OUT --model mlp|cnn [--epochs N] [--limit N] [--seed S] [--data DIR]
        train in PyTorch (Adam, batch 64) and save the weights for dtrain
    dtrain_torch.py init OUT --model mlp|cnn [--seed S]
        save PyTorch's own initial weights (no training)
    dtrain_torch.py roundtrip IN OUT
        load a file and save its weights again (dtrain -> PyTorch -> dtrain)
"""
import gzip
import json
import os
import struct
import sys

import numpy as np

try:
    import torch
except ImportError:  # numpy alone still reads and writes the files
    torch = None

__all__ = ["load", "save", "checksum", "DtrainFileError"]

MAX_HEADER = 100000000  # the safetensors reference limit, as dtrain
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_M64 = (1 << 64) - 1
_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
           "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


class DtrainFileError(ValueError):
    """A file that is not a safetensors file dtrain would read, with the reason."""


# ---- dtrain's checksum (src/dt_safetensors.h) ------------------------------------------
class _Hasher:
    def __init__(self):
        self.h = _FNV_OFFSET
        self.carry = b""

    def update(self, data):
        data = self.carry + bytes(data)
        n = len(data) - len(data) % 8
        h = self.h
        if n:
            for w in np.frombuffer(data[:n], dtype="<u8").tolist():
                h = ((h ^ w) * _FNV_PRIME) & _M64
                h ^= h >> 32
        self.h = h
        self.carry = data[n:]

    def u64(self, v):
        self.update(struct.pack("<Q", v))

    def final(self):
        h = self.h
        for b in self.carry:
            h = ((h ^ b) * _FNV_PRIME) & _M64
        self.carry = b""
        return h


def checksum(entries, metadata, data):
    """dtrain's checksum: entries {name: (dtype, shape, begin, end)}, metadata
    {key: value} ("checksum" itself left out), data the bytes after the header."""
    hs = _Hasher()
    for name in sorted(entries, key=lambda s: s.encode("utf-8")):
        dtype, shape, begin, end = entries[name]
        hs.update(name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
        hs.u64(len(shape))
        for d in shape:
            hs.u64(d)
        hs.u64(begin)
        hs.u64(end)
    for key in sorted(metadata, key=lambda s: s.encode("utf-8")):
        if key != "checksum":
            hs.update(key.encode("utf-8") + b"\0" + metadata[key].encode("utf-8") + b"\0")
    hs.update(data)
    return hs.final()


# ---- reading -------------------------------------------------------------------------------
def _parse(path):
    """(entries, metadata, data) of a safetensors file, every rule checked."""
    with open(path, "rb") as f:
        raw = f.read()
    where = "'%s'" % path
    if len(raw) < 8:
        raise DtrainFileError("%s: not a safetensors file (%d bytes, shorter than the 8-byte header length)"
                              % (where, len(raw)))
    (n,) = struct.unpack("<Q", raw[:8])
    head = raw[8:8 + min(n, 64)].lstrip()
    if n < 2 or not head.startswith(b"{"):
        raise DtrainFileError("%s: not a safetensors file (no JSON header after the 8-byte length)" % where)
    if n > MAX_HEADER or n > len(raw) - 8:
        raise DtrainFileError("%s: truncated or corrupt: header length %d exceeds the file (%d bytes)"
                              % (where, n, len(raw)))

    def no_dups(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                raise DtrainFileError("%s: duplicate key '%s' in the header" % (where, k))
            d[k] = v
        return d
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=no_dups)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DtrainFileError("%s: not a safetensors file (header is not JSON: %s)" % (where, e)) from None
    if not isinstance(header, dict):
        raise DtrainFileError("%s: not a safetensors file (header is not a JSON object)" % where)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise DtrainFileError("%s: __metadata__ is not an object of strings" % where)
    data = raw[8 + n:]
    entries = {}
    for name, t in header.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise DtrainFileError("%s: tensor '%s': needs exactly dtype, shape and data_offsets" % (where, name))
        dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in _DTYPES:
            raise DtrainFileError("%s: tensor '%s': unknown dtype %r" % (where, name, dtype))
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)):
            raise DtrainFileError("%s: tensor '%s': malformed shape or data_offsets" % (where, name))
        b, e = offs
        count = 1
        for d in shape:
            count *= d
        if not 0 <= b <= e <= len(data) or e - b != count * _DTYPES[dtype]:
            raise DtrainFileError("%s: tensor '%s': data_offsets [%d, %d] do not hold shape %s of %s in %d bytes"
                                  % (where, name, b, e, shape, dtype, len(data)))
        entries[name] = (dtype, shape, b, e)
    pos = 0
    for b, e in sorted((v[2], v[3]) for v in entries.values()):
        if b != pos:
            raise DtrainFileError("%s: tensors overlap or leave a gap at byte %d" % (where, pos))
        pos = e
    if pos != len(data):
        raise DtrainFileError("%s: %d bytes after the last tensor" % (where, len(data) - pos))
    if "checksum" in meta:
        want = meta["checksum"]
        if len(want) != 16 or any(c not in "0123456789abcdef" for c in want):
            raise DtrainFileError("%s: metadata 'checksum' is not 16 lowercase hex digits" % where)
        got = checksum(entries, meta, data)
        if got != int(want, 16):
            raise DtrainFileError("%s: checksum mismatch: the header or the data were changed" % where)
    elif meta.get("format") == "dtrain":
        raise DtrainFileError("%s: dtrain checkpoint without metadata 'checksum'" % where)
    return entries, meta, data


def _array(entries, data, name):
    dtype, shape, b, e = entries[name]
    np_dtype = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}.get(dtype)
    if np_dtype is None:  # BF16: widened to float32
        u = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape).copy()
    return np.frombuffer(data[b:e], dtype=np_dtype).reshape(shape).copy()


def load(path, weights_only=True, numpy=False):
    """The tensors of a safetensors file (see the module's doc)."""
    entries, _, data = _parse(path)
    names = sorted(entries, key=lambda k: entries[k][2])  # in the file's order (dtrain: the model's)
    out = {}
    for name in names:
        if weights_only and name.startswith("optim."):
            continue
        a = _array(entries, data, name)
        out[name] = torch.from_numpy(a) if (torch is not None and not numpy) else a
    return out


def metadata(path):
    """The file's string metadata (dtrain: step, epoch, optimizer, config, ...)."""
    return _parse(path)[1]


# ---- writing -------------------------------------------------------------------------------
def _as_f32(name, t):
    if torch is not None and isinstance(t, torch.Tensor):
        if not (t.is_floating_point()):
            raise DtrainFileError("tensor '%s' is %s, not floating point: dtrain stores float32 only "
                                  "(drop it from the dict, e.g. BatchNorm's num_batches_tracked)" % (name, t.dtype))
        t = t.detach().to("cpu", torch.float32).contiguous().numpy()
    a = np.asarray(t)
    if a.dtype.kind != "f":
        raise DtrainFileError("tensor '%s' is %s, not floating point: dtrain stores float32 only" % (name, a.dtype))
    return np.ascontiguousarray(a, dtype="<f4")


def save(state_dict, path, metadata=None):
    """Write state_dict as a safetensors file dtrain loads (see the module's doc)."""
    meta = {"writer": "dtrain_torch.py"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str) or k == "checksum":
            raise ValueError("metadata: string keys and values only, and not 'checksum'")
        meta[k] = v
    if meta.get("format") == "dtrain":
        raise ValueError("metadata 'format' = 'dtrain' is for full checkpoints (dt_checkpoint_save)")
    arrays, entries, pos = [], {}, 0
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError("tensor name %r: a non-empty string other than __metadata__" % (name,))
        a = _as_f32(name, t)
        entries[name] = ("F32", list(a.shape), pos, pos + a.nbytes)
        arrays.append(a)
        pos += a.nbytes
    data = b"".join(a.tobytes() for a in arrays)
    meta["checksum"] = "%016x" % checksum(entries, meta, data)
    header = {"__metadata__": meta}
    for name, (dtype, shape, b, e) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * ((8 - (8 + len(js)) % 8) % 8)  # the data starts 8-byte aligned
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(js)))
            f.write(js)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---- the examples' models and data ------------------------------------------------------------
if torch is not None:
    class FashionMLP(torch.nn.Module):
        """examples/02_fashion_mnist --model mlp: 784-256-128-10, ReLU."""

        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(784, 256)
            self.fc2 = torch.nn.Linear(256, 128)
            self.fc3 = torch.nn.Linear(128, 10)

        def forward(self, x):
            x = torch.relu(self.fc1(x))
            x = torch.relu(self.fc2(x))
            return self.fc3(x)

    class FashionCNN(torch.nn.Module):
        """examples/02_fashion_mnist --model cnn."""

        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 32, 5, stride=1, padding=2)
            self.conv2 = torch.nn.Conv2d(32, 64, 5, stride=1, padding=2)
            self.fc1 = torch.nn.Linear(64 * 7 * 7, 1024)
            self.fc2 = torch.nn.Linear(1024, 10)

        def forward(self, x):
            x = x.reshape(-1, 1, 28, 28)
            x = torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2, 2)
            x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2, 2)
            x = torch.relu(self.fc1(torch.flatten(x, 1)))
            return self.fc2(x)

    MODELS = {"mlp": FashionMLP, "cnn": FashionCNN}


def _data_dir(d):
    if d:
        return d
    for c in ("/usr/share/datasets/fashion-mnist", os.path.join(os.path.dirname(__file__), "..", "data", "fashion-mnist")):
        if os.path.exists(os.path.join(c, "t10k-images-idx3-ubyte.gz")) or os.path.exists(os.path.join(c, "t10k-images-idx3-ubyte")):
            return c
    raise FileNotFoundError("no Fashion-MNIST files: --data DIR")


def _idx(path):
    op = gzip.open if os.path.exists(path + ".gz") else open
    with op(path + ".gz" if op is gzip.open else path, "rb") as f:
        raw = f.read()
    (magic,) = struct.unpack(">I", raw[:4])
    nd = magic & 0xFF
    shape = struct.unpack(">" + "I" * nd, raw[4:4 + 4 * nd])
    return np.frombuffer(raw[4 + 4 * nd:], dtype=np.uint8).reshape(shape)


def fashion_mnist(split, data=None):
    """(x [N, 784] float32 in [0, 1] as examples/02 scales them, y [N] int64)."""
    d = _data_dir(data)
    pre = "train" if split == "train" else "t10k"
    x = _idx(os.path.join(d, pre + "-images-idx3-ubyte")).reshape(-1, 784).astype(np.float32) / np.float32(255)
    y = _idx(os.path.join(d, pre + "-labels-idx1-ubyte")).astype(np.int64)
    return x, y


def evaluate(model, data=None):
    """(test accuracy, mean cross-entropy, samples right) of a torch model on the test split."""
    x, y = fashion_mnist("test", data)
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for s in range(0, len(x), 500):
            xb, yb = torch.from_numpy(x[s:s + 500]), torch.from_numpy(y[s:s + 500])
            logits = model(xb)
            loss += torch.nn.functional.cross_entropy(logits, yb, reduction="sum").item()
            correct += int((logits.argmax(1) == yb).sum())
    return correct / len(x), loss / len(x), correct


def _cli(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="dtrain_torch.py", description="dtrain <-> PyTorch weights (safetensors)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="list a file's tensors and metadata")
    p.add_argument("file")
    for name in ("evaluate", "train", "init"):
        p = sub.add_parser(name)
        p.add_argument("file")
        p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
        p.add_argument("--data", default=None)
        p.add_argument("--seed", type=int, default=1)
        if name == "train":
            p.add_argument("--epochs", type=int, default=1)
            p.add_argument("--limit", type=int, default=0)
    p = sub.add_parser("roundtrip", help="load IN's weights and save them to OUT")
    p.add_argument("src")
    p.add_argument("dst")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "info":
            entries, meta, _ = _parse(a.file)
            for k in sorted(meta):
                print("meta %s = %s" % (k, meta[k]))
            for name in sorted(entries, key=lambda k: entries[k][2]):
                dtype, shape, b, e = entries[name]
                print("%-40s %-5s %s" % (name, dtype, shape))
            return 0
        if a.cmd == "roundtrip":
            save(load(a.src, numpy=True), a.dst)
            return 0
        if torch is None:
            print("dtrain_torch.py: skip: torch is not installed", file=sys.stderr)
            return 77
        torch.manual_seed(a.seed)
        model = MODELS[a.model]()
        if a.cmd == "evaluate":
            model.load_state_dict(load(a.file))
            acc, loss, correct = evaluate(model, a.data)
            print(json.dumps({"model": a.model, "test_accuracy": round(acc, 4), "test_loss": round(loss, 5),
                              "test_correct": correct}))
            return 0
        if a.cmd == "train":
            x, y = fashion_mnist("train", a.data)
            if a.limit > 0:
                x, y = x[:a.limit], y[:a.limit]
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(a.seed)
            for _ in range(a.epochs):
                perm = torch.randperm(len(x), generator=g).numpy()
                model.train()
                for s in range(0, len(x) - 63, 64):
                    i = perm[s:s + 64]
                    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[i])), torch.from_numpy(y[i]))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        save(model.state_dict(), a.file, {"model": a.model})
        return 0
    except (DtrainFileError, OSError) as e:
        print("dtrain_torch.py: error: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
