#!/bin/sh
# dtrain vs PyTorch: the Fashion-MNIST MLP and CNN, same weights and batch;
# loss and every parameter's gradient within a relative 1e-4.
BUILD=${BUILD:-build}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
for m in mlp cnn; do
  mkdir -p "$BUILD/torch_parity/$m"
  "$BUILD/tests/torch_dump" $m "$BUILD/torch_parity/$m" || { echo "torch_parity: 0 passed, 1 failed, 0 skipped"; exit 1; }
done
exec "$PY" tests/torch_parity.py "$BUILD/torch_parity/mlp" "$BUILD/torch_parity/cnn"
