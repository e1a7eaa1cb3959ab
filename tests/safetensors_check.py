#!/usr/bin/env python3
"""Cross-check a dtrain checkpoint with Python tools written from the safetensors spec.

usage: safetensors_check.py FILE EXPECTED

EXPECTED has one line per tensor: "name ndim dim... value..." with values as C99
hex floats (%a). The file is read three ways when possible:
  1. plain json + numpy (always; exit 77 when numpy is missing),
  2. the `safetensors` package (numpy API), if importable,
  3. torch, if importable (tensors built from the same bytes).
Exit 0 when every read matches bit for bit, 1 otherwise, 77 to skip.
"""
import json
import struct
import sys

try:
    import numpy as np
except ImportError:
    print("safetensors_check: skip: numpy is not installed")
    sys.exit(77)


def fail(msg):
    print("safetensors_check: FAIL: " + msg)
    sys.exit(1)


def read_plain(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        fail("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        fail("header length %d exceeds the file" % n)
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        fail("metadata is not string to string")
    buf = raw[8 + n:]
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    pos = 0
    for b, e in spans:
        if b != pos:
            fail("buffer not contiguous at %d" % b)
        pos = e
    if pos != len(buf):
        fail("buffer has %d bytes, tensors cover %d" % (len(buf), pos))
    out = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            fail("%s has dtype %s" % (name, t["dtype"]))
        b, e = t["data_offsets"]
        arr = np.frombuffer(buf[b:e], dtype="<f4").reshape(t["shape"])
        out[name] = arr
    return out, meta


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    path, expected_path = sys.argv[1], sys.argv[2]
    expected = {}
    with open(expected_path) as f:
        for line in f:
            parts = line.split()
            name, ndim = parts[0], int(parts[1])
            shape = tuple(int(x) for x in parts[2:2 + ndim])
            vals = [float.fromhex(x) for x in parts[2 + ndim:]]
            expected[name] = np.array(vals, dtype=np.float32).reshape(shape)

    tensors, meta = read_plain(path)
    if meta.get("format") != "dtrain":
        fail("metadata format is %r" % meta.get("format"))
    for key in ("step", "epoch", "data_epoch", "data_index", "params_rng", "layout_hash", "config"):
        if key not in meta:
            fail("metadata %s missing" % key)

    def compare(source, got):
        if set(got) != set(expected):
            fail("%s: names differ: %s" % (source, sorted(set(got) ^ set(expected))))
        for name, want in expected.items():
            arr = np.asarray(got[name], dtype=np.float32)
            if arr.shape != want.shape:
                fail("%s: %s has shape %s, expected %s" % (source, name, arr.shape, want.shape))
            if arr.tobytes() != want.astype("<f4").tobytes():
                fail("%s: %s values differ" % (source, name))
        print("safetensors_check: %s: %d tensors match bit for bit" % (source, len(expected)))

    compare("json+numpy", tensors)

    try:
        from safetensors.numpy import load_file  # type: ignore
    except ImportError:
        print("safetensors_check: skip: the safetensors package is not installed")
    else:
        compare("safetensors", load_file(path))

    try:
        import torch  # type: ignore
    except ImportError:
        print("safetensors_check: skip: torch is not installed")
    else:
        got = {}
        for name, arr in tensors.items():
            t = torch.from_numpy(arr.copy())
            if t.dtype != torch.float32:
                fail("torch: %s has dtype %s" % (name, t.dtype))
            got[name] = t.numpy()
        compare("torch", got)
    sys.exit(0)


if __name__ == "__main__":
    main()
