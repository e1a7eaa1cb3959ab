#!/bin/sh
# run_speed.sh -- `make bench`: dtrain against OpenBLAS and PyTorch, side by side,
# one thread each, in one run on this machine. Prints tables of ratios.
#
#   sh bench/run_speed.sh [path/to/bench_speed]
#
# Environment: BENCH_SECONDS (per run, default 3), BENCH_ROUNDS (alternating
# dtrain/PyTorch runs per workload, default 3), PYTHON (default /usr/bin/python3,
# the Debian python3-torch; another python3 may come first on PATH),
# BENCH_OPENBLAS (the OpenBLAS library to dlopen, default libopenblas.so.0).
#
# Every figure is the best of short windows, and of BENCH_ROUNDS runs, for both
# sides alike (the machine may be shared: the best window is the least disturbed
# one). Peak RSS is VmHWM of each run's own process; the table shows the largest
# over the rounds. Missing OpenBLAS or torch prints "skipped (reason)".
BIN=${1:-build/bench/bench_speed}
PY=${PYTHON:-/usr/bin/python3}
SECS=${BENCH_SECONDS:-3}
ROUNDS=${BENCH_ROUNDS:-3}
DIR=$(dirname "$0")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

if [ ! -x "$BIN" ]; then
  echo "run_speed.sh: $BIN not built (make bench builds it)"
  exit 1
fi

echo "== machine"
echo "cpus: $(getconf _NPROCESSORS_ONLN 2>/dev/null || echo '?'), load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/^model name[^:]*: /cpu: /'
echo "threads: 1 for both sides (OMP/MKL/OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1), openblas_set_num_threads(1))"
echo

echo "== sgemm, one thread: GFLOP/s (best of windows, sides alternating), ratio = dtrain / OpenBLAS"
"$BIN" gemm || echo "sgemm bench failed"
echo

# field NAME LINE: the value of NAME=... in a "result ..." line.
field() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1; }
# Larger of two numbers (empty counts as absent).
maxof() {
  if [ -z "$1" ]; then echo "$2"; elif [ -z "$2" ]; then echo "$1"
  else awk -v a="$1" -v b="$2" 'BEGIN { print (a + 0 >= b + 0) ? a : b }'; fi
}

torch_why=""
if [ ! -x "$PY" ]; then
  torch_why="no $PY"
elif ! "$PY" -c "import torch" >/dev/null 2>&1; then
  torch_why="torch does not import in $PY"
fi

echo "== training steps, one thread, synthetic data, Adam lr 1e-3: samples/s (best window of $ROUNDS runs x ${SECS} s)"
[ -n "$torch_why" ] && echo "PyTorch: skipped ($torch_why)"
printf '%-22s %11s %11s %7s %7s | %11s %11s %7s %7s\n' "workload" "dtrain" "PyTorch" "ratio" "goal" \
  "dtrain RSS" "torch RSS" "ratio" "goal"
for wl in "mlp 64 1.3" "mlp 256 1.05" "cnn 64 1.2"; do
  set -- $wl
  mode=$1 batch=$2 goal=$3
  d_best="" t_best="" d_rss="" t_rss="" d_med="" t_med="" d_cpu="" t_cpu="" extra=""
  r=0
  while [ $r -lt "$ROUNDS" ]; do
    line=$("$BIN" "$mode" "$batch" "$SECS" 2>&1 | grep '^result')
    if [ -n "$line" ]; then
      d_best=$(maxof "$d_best" "$(field samples_per_s "$line")")
      d_med=$(maxof "$d_med" "$(field median_samples_per_s "$line")")
      d_cpu=$(maxof "$d_cpu" "$(field cpu_samples_per_s "$line")")
      d_rss=$(maxof "$d_rss" "$(field peak_rss_kb "$line")")
      extra="params $(field params_kb "$line") KiB, Adam state $(field optim_kb "$line") KiB, activations $(field activations_kb "$line") KiB"
    fi
    if [ -z "$torch_why" ]; then
      line=$("$PY" "$DIR/torch_speed.py" "$mode" "$batch" "$SECS" 1 2>&1 | grep '^result')
      if [ -n "$line" ]; then
        t_best=$(maxof "$t_best" "$(field samples_per_s "$line")")
        t_med=$(maxof "$t_med" "$(field median_samples_per_s "$line")")
        t_cpu=$(maxof "$t_cpu" "$(field cpu_samples_per_s "$line")")
        t_rss=$(maxof "$t_rss" "$(field peak_rss_kb "$line")")
      fi
    fi
    r=$((r + 1))
  done
  name="$mode batch $batch"
  rss_goal="-"
  [ "$mode" = mlp ] && rss_goal="<=0.5"
  if [ -n "$t_best" ] && [ -n "$d_best" ]; then
    awk -v n="$name" -v d="$d_best" -v t="$t_best" -v g="$goal" -v dr="$d_rss" -v tr="$t_rss" -v rg="$rss_goal" \
      'BEGIN { printf "%-22s %11.0f %11.0f %7.2f %7s | %8.1f MiB %7.1f MiB %7.2f %7s\n", n, d, t, d / t, ">=" g,
               dr / 1024, tr / 1024, dr / tr, rg }'
    awk -v d="$d_med" -v t="$t_med" -v dc="$d_cpu" -v tc="$t_cpu" \
      'BEGIN { printf "%-22s median window %.0f vs %.0f (%.2f); per CPU-second %.0f vs %.0f (%.2f)\n", "", d, t, d / t,
               dc, tc, dc / tc }'
  elif [ -n "$d_best" ]; then
    awk -v n="$name" -v d="$d_best" -v dr="$d_rss" -v why="${torch_why:-PyTorch run failed}" \
      'BEGIN { printf "%-22s %11.0f %11s %7s %7s | %8.1f MiB   skipped (%s)\n", n, d, "-", "-", "-", dr / 1024, why }'
  else
    printf '%-22s dtrain run failed\n' "$name"
  fi
  [ -n "$extra" ] && printf '%-22s dtrain memory: %s\n' "" "$extra"
done
