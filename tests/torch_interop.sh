#!/bin/sh
# dtrain <-> PyTorch weights both ways (tools/dtrain_torch.py, examples/02
# --init-weights / --evaluate): tests/torch_interop.py.
BUILD=${BUILD:-build}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
exec "$PY" tests/torch_interop.py "$BUILD/examples/02_fashion_mnist" "$BUILD/torch_interop"
