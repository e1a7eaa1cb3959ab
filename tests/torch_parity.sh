#!/bin/sh
# dtrain vs PyTorch: the Fashion-MNIST MLP and CNN, same weights and batch;
# loss and every parameter's gradient within a relative 1e-4. And every
# optimizer kind (SGD plain, with momentum and weight decay, Nesterov; Adam;
# AdamW; RMSprop, with momentum and weight decay) against torch.optim over
# six steps of the same gradients: each step's change within a relative 1e-4.
BUILD=${BUILD:-build}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
for m in mlp cnn optim; do
  mkdir -p "$BUILD/torch_parity/$m"
  "$BUILD/tests/torch_dump" $m "$BUILD/torch_parity/$m" || { echo "torch_parity: 0 passed, 1 failed, 0 skipped"; exit 1; }
done
exec "$PY" tests/torch_parity.py "$BUILD/torch_parity/mlp" "$BUILD/torch_parity/cnn" "$BUILD/torch_parity/optim"
