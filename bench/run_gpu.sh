#!/bin/sh
# run_gpu.sh -- `make bench-gpu`: the MLP and the CNN trained on one GPU by
# dtrain (build/bench/bench_gpu, the CUDA backend) and by PyTorch
# (bench/torch_speed.py ... cuda) on the same GPU, alternating, best of
# BENCH_ROUNDS (default 3) per side, printed as ratios: against PyTorch in
# strict fp32 (dtrain's arithmetic) and at its defaults (TF32 convolutions). Skips cleanly where
# there is no GPU (bench_gpu exits 3) or no CUDA-enabled torch (the PyTorch
# column says "skipped"). Timings only: nothing is asserted.
#
#   BUILD=build sh bench/run_gpu.sh
ROUNDS=${BENCH_ROUNDS:-3}
# PyTorch: $PYTHON, else the first python3 whose torch sees a GPU (the one on
# PATH, e.g. a virtual environment's, then the system's /usr/bin/python3).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for p in python3 /usr/bin/python3; do
    if "$p" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then PY=$p; break; fi
  done
  PY=${PY:-python3}
fi
DIR=$(dirname "$0")
B=${BUILD:-build}/bench/bench_gpu
SECONDS_EACH=${BENCH_SECONDS:-3}

if [ ! -x "$B" ]; then
  echo "bench-gpu: skipped (no $B: needs nvcc)"
  exit 0
fi
probe=$("$B" mlp 64 0.2 2>/dev/null)
if [ $? -eq 3 ]; then
  echo "bench-gpu: skipped (${probe#skipped: })"
  exit 0
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

have_torch=1
tprobe=$("$PY" "$DIR/torch_speed.py" mlp 64 0.2 1 cuda 2>&1 | tail -1)
case "$tprobe" in result*) ;; *) have_torch=0; echo "(PyTorch side skipped: ${tprobe:-no output})" ;; esac

best() { # best samples/s of the result lines on stdin
  sed -n 's/^result samples_per_s=\([0-9.]*\).*/\1/p' | awk 'BEGIN { b = 0 } { if ($1 > b) b = $1 } END { print b }'
}

echo "== one GPU, Adam, synthetic data on the device: samples/s (best of $ROUNDS)"
echo "   PyTorch fp32: strict float32 as dtrain computes (allow_tf32 off); PyTorch default: its defaults (TF32 in cuDNN's convolutions)"
printf "%-10s %12s %14s %8s %16s %8s\n" "workload" "dtrain" "PyTorch fp32" "ratio" "PyTorch default" "ratio"
for w in "mlp 64" "mlp 256" "cnn 64" "cnn 256"; do
  d=0; t=0; u=0; r=0
  while [ $r -lt "$ROUNDS" ]; do
    v=$("$B" $w "$SECONDS_EACH" 2>/dev/null | best)
    d=$(awk -v a="$d" -v b="${v:-0}" 'BEGIN { print (b > a) ? b : a }')
    if [ $have_torch = 1 ]; then
      v=$("$PY" "$DIR/torch_speed.py" $w "$SECONDS_EACH" 1 cuda fp32 2>/dev/null | best)
      t=$(awk -v a="$t" -v b="${v:-0}" 'BEGIN { print (b > a) ? b : a }')
      v=$("$PY" "$DIR/torch_speed.py" $w "$SECONDS_EACH" 1 cuda default 2>/dev/null | best)
      u=$(awk -v a="$u" -v b="${v:-0}" 'BEGIN { print (b > a) ? b : a }')
    fi
    r=$((r + 1))
  done
  awk -v w="$w" -v d="$d" -v t="$t" -v u="$u" 'function f(x) { return x > 0 ? sprintf("%.0f", x) : "-" }
    function q(x) { return x > 0 ? sprintf("%.2fx", d / x) : "-" }
    BEGIN { printf "%-10s %12.0f %14s %8s %16s %8s\n", w, d, f(t), q(t), f(u), q(u) }'
done
