#!/bin/sh
# run_pipeline.sh -- pipeline parallelism (issue 18): examples/07_model_parallel's
# MLP (7 hidden layers of 256: 8 linear layers, so the 2 stages hold 4 each;
# batch 64) in 2 stages on threads, GPipe and 1F1B,
# for M = 1, 2, 4, 8, 16 micro-batches, beside one_device on the same batches:
# samples/s, the largest worker's bytes (parameters, gradients, Adam state and
# activation arenas) and the measured bubble (the stages' mean idle share of a
# step) against the theory (P-1)/(M+P-1).
#
#   sh bench/run_pipeline.sh [path/to/07_model_parallel]      (make bench runs it)
#
# samples/s is the best of BENCH_ROUNDS rounds (default 3; the machine may be
# shared). The CPU is printed first: stages are threads, and on a machine with
# fewer cores than stages they take turns, which the bubble then includes.
# (PyTorch's pipeline schedules are not beside it: the installed PyTorch,
# 1.13, has no torch.distributed.pipelining.) Timings only: nothing is asserted.
BIN=${1:-build/examples/07_model_parallel}
ROUNDS=${BENCH_ROUNDS:-3}
STEPS=${BENCH_STEPS:-40}
LAYERS=${BENCH_LAYERS:-7}
echo "== pipeline bench: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //') ($(nproc 2>/dev/null) cores)"
best() { # best samples/s over the rounds of "$@"; prints the last JSON line's other fields
  b=0; line=""
  r=0; while [ $r -lt "$ROUNDS" ]; do
    l=$("$BIN" "$@" --layers "$LAYERS" --steps "$STEPS" --json) || { echo "run failed: $*" >&2; exit 1; }
    s=$(echo "$l" | sed 's/.*"samples_per_s": \([0-9.]*\).*/\1/')
    if awk "BEGIN { exit !($s > $b) }"; then b=$s; line=$l; fi
    r=$((r + 1))
  done
  echo "$line"
}
field() { echo "$1" | sed "s/.*\"$2\": \([0-9.e+-]*\).*/\1/"; }
ref=$(best --parallel none)
rs=$(field "$ref" samples_per_s); rb=$(field "$ref" peak_bytes_per_worker)
printf '%-10s %3s %10s %8s %12s %7s %8s %7s\n' schedule M samples/s "x one" "bytes/worker" "x one" bubble theory
printf '%-10s %3s %10.0f %8s %12.0f %7s %8s %7s\n' one_device - "$rs" 1.00 "$rb" 1.00 - -
for sched in gpipe 1f1b; do
  for m in 1 2 4 8 16; do
    l=$(best --parallel pipeline --stages 2 --microbatches $m --schedule $sched)
    s=$(field "$l" samples_per_s); b=$(field "$l" peak_bytes_per_worker)
    printf '%-10s %3d %10.0f %8.2f %12.0f %7.2f %8.3f %7.3f\n' $sched $m "$s" "$(awk "BEGIN { print $s / $rs }")" "$b" \
      "$(awk "BEGIN { print $b / $rb }")" "$(field "$l" bubble_measured)" "$(field "$l" bubble_theory)"
  done
done
# The same 1F1B pipeline as 2 processes over loopback TCP (dtrain-launch): the
# activations and gradients cross sockets (dt_comm_isend goes out at once, so a
# stage's output leaves while it computes its next micro-batch).
LAUNCH=${LAUNCH:-tools/dtrain-launch}
if [ -x "$LAUNCH" ]; then
  for m in 2 4 8; do
    b=0; line=""
    r=0; while [ $r -lt "$ROUNDS" ]; do
      l=$(timeout 300 "$LAUNCH" -n 2 -- "$BIN" --parallel pipeline --stages 2 --microbatches $m --layers "$LAYERS" \
          --steps "$STEPS" --json 2>/dev/null | grep -o '{.*}' | tail -n 1)
      s=$(echo "$l" | sed 's/.*"samples_per_s": \([0-9.]*\).*/\1/')
      if [ -n "$l" ] && awk "BEGIN { exit !($s > $b) }"; then b=$s; line=$l; fi
      r=$((r + 1))
    done
    [ -n "$line" ] || { echo "1f1b over TCP, M=$m: no run succeeded" >&2; continue; }
    printf '%-10s %3d %10.0f %8.2f %12.0f %7.2f %8.3f %7.3f  (2 processes, loopback)\n' 1f1b-tcp $m "$b" \
      "$(awk "BEGIN { print $b / $rs }")" "$(field "$line" peak_bytes_per_worker)" \
      "$(awk "BEGIN { print $(field "$line" peak_bytes_per_worker) / $rb }")" "$(field "$line" bubble_measured)" \
      "$(field "$line" bubble_theory)"
  done
fi
