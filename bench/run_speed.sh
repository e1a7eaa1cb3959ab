#!/bin/sh
# run_speed.sh -- `make bench`: dtrain against OpenBLAS and PyTorch, side by side,
# one thread each (and a few rows at two threads), in one run on this machine.
# Prints tables of ratios.
#
#   sh bench/run_speed.sh [path/to/bench_speed [path/to/bench_speed_cblas]]
#
# bench_speed_cblas is bench_speed.c built with DTRAIN_USE_CBLAS and linked
# with OpenBLAS (make bench builds it when libopenblas-dev is installed); when
# it is missing the DTRAIN_USE_CBLAS row says "skipped".
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
BIN_CBLAS=${2:-build/bench/bench_speed_cblas}
PY=${PYTHON:-/usr/bin/python3}
SECS=${BENCH_SECONDS:-3}
ROUNDS=${BENCH_ROUNDS:-3}
DIR=$(dirname "$0")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# The references run OpenBLAS's best kernel for this CPU: an OPENBLAS_CORETYPE or
# OPENBLAS_L2_SIZE in the environment can pin an older one (Haswell on an AVX-512 core).
for v in OPENBLAS_CORETYPE OPENBLAS_L2_SIZE; do
  eval "val=\${$v:-}"
  [ -n "$val" ] && echo "note: $v=$val unset for this run, so OpenBLAS picks its best kernel"
  unset $v
done
# Likewise PyTorch's own kernels: oneDNN (its convolutions) takes the best the CPU has
# unless capped, and PyTorch 1.13's elementwise and optimizer kernels stay on AVX2 even on
# an AVX-512 core unless ATEN_CPU_CAPABILITY=avx512 asks (measured here: MLP b64 +2.5%).
for v in ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA ATEN_CPU_CAPABILITY; do
  eval "val=\${$v:-}"
  [ -n "$val" ] && echo "note: $v=$val unset for this run, so PyTorch uses its best kernels"
  unset $v
done
grep -qw avx512f /proc/cpuinfo 2>/dev/null && export ATEN_CPU_CAPABILITY=avx512

if [ ! -x "$BIN" ]; then
  echo "run_speed.sh: $BIN not built (make bench builds it)"
  exit 1
fi

echo "== machine"
echo "cpus: $(getconf _NPROCESSORS_ONLN 2>/dev/null || echo '?'), load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/^model name[^:]*: /cpu: /'
echo "threads: 1 for both sides (OMP/MKL/OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1), openblas_set_num_threads(1)),"
echo "         except the rows marked 2 threads / 2thr (dt_set_threads(2) vs 2 OpenBLAS / PyTorch threads)"
echo

echo "== this core's FMA peak, GFLOP/s (12 independent multiply-add chains, best of windows), per instruction set"
"$BIN" peak 0.5 || echo "peak bench failed"
PEAK_LINE=$("$BIN" peak 0.3 2>/dev/null | grep '^peak in_use=.* gflops=')
echo

echo "== sgemm, one thread: GFLOP/s (best of windows, sides alternating), ratio = dtrain / OpenBLAS,"
echo "   and each side as a share of the FMA peak of dtrain's path (goal for n >= 256: dtrain >= 90%)"
"$BIN" gemm || echo "sgemm bench failed"
echo

echo "== sgemm, two threads: dt_set_threads(2) against OpenBLAS with 2 threads (OPENBLAS_NUM_THREADS=2)"
OPENBLAS_NUM_THREADS=2 "$BIN" gemm 0.4 2 || echo "sgemm bench (2 threads) failed"
echo

echo "== DTRAIN_USE_CBLAS: the GEMM calls of one MLP step through dt_sgemm vs cblas_sgemm called directly"
echo "   (one thread; ratio = time through dtrain / raw OpenBLAS time; goal <= 1.05)"
if [ -x "$BIN_CBLAS" ]; then
  for batch in 64 256; do
    line=$("$BIN_CBLAS" cblas "$batch" 2 2>&1 | grep '^result')
    if [ -n "$line" ]; then
      printf 'mlp batch %-4s %2s calls: dt_sgemm %8s us, cblas_sgemm %8s us, ratio %s\n' "$batch" \
        "$(printf '%s\n' "$line" | tr ' ' '\n' | sed -n 's/^gemm_calls=//p')" \
        "$(printf '%s\n' "$line" | tr ' ' '\n' | sed -n 's/^dt_sgemm_us=//p')" \
        "$(printf '%s\n' "$line" | tr ' ' '\n' | sed -n 's/^cblas_us=//p')" \
        "$(printf '%s\n' "$line" | tr ' ' '\n' | sed -n 's/^ratio=//p')"
    else
      echo "mlp batch $batch: run failed"
    fi
  done
else
  echo "skipped ($BIN_CBLAS not built: needs libopenblas-dev)"
fi
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

echo "== training steps, synthetic data, Adam lr 1e-3: samples/s (best window of $ROUNDS runs x ${SECS} s)"
echo "   one thread unless the workload says 2 threads (dt_set_threads(2) vs torch.set_num_threads(2))"
[ -n "$torch_why" ] && echo "PyTorch: skipped ($torch_why)"
# Goals (issue 25) by dtrain's path: on an AVX-512 core against PyTorch at its best
# kernel MLP b64 >= 1.6, b256 >= 1.25, CNN >= 1.6; on an AVX2 core MLP b64 >= 1.7,
# CNN >= 1.6 (b256: the older >= 1.05). Two threads: >= 1.8x dtrain's own one thread.
ISA_IN_USE=$(printf '%s\n' "$PEAK_LINE" | sed -n 's/.*in_use=\([^ ]*\).*/\1/p')
case "$ISA_IN_USE" in
  avx512) G64=1.6 G256=1.25 GCNN=1.6 ;;
  *) G64=1.7 G256=1.05 GCNN=1.6 ;;
esac
echo "   goals for dtrain's path (${ISA_IN_USE:-unknown}); 2 threads: against dtrain's one thread, goal >= 1.8"
printf '%-22s %11s %11s %7s %7s | %11s %11s %7s %7s\n' "workload" "dtrain" "PyTorch" "ratio" "goal" \
  "dtrain RSS" "torch RSS" "ratio" "goal"
ONE_mlp256="" ONE_cnn64=""
for wl in "mlp 64 $G64 1" "mlp 256 $G256 1" "cnn 64 $GCNN 1" "mlp 256 - 2" "cnn 64 - 2"; do
  set -- $wl
  mode=$1 batch=$2 goal=$3 nth=$4
  d_best="" t_best="" d_rss="" flops="" t_core="" t_rss="" d_med="" t_med="" d_cpu="" t_cpu="" extra=""
  r=0
  while [ $r -lt "$ROUNDS" ]; do
    line=$(OPENBLAS_NUM_THREADS=$nth "$BIN" "$mode" "$batch" "$SECS" "$nth" 2>&1 | grep '^result')
    if [ -n "$line" ]; then
      d_best=$(maxof "$d_best" "$(field samples_per_s "$line")")
      d_med=$(maxof "$d_med" "$(field median_samples_per_s "$line")")
      d_cpu=$(maxof "$d_cpu" "$(field cpu_samples_per_s "$line")")
      d_rss=$(maxof "$d_rss" "$(field peak_rss_kb "$line")")
      flops=$(field flops_per_sample "$line")
      extra="params $(field params_kb "$line") KiB, Adam state $(field optim_kb "$line") KiB, activations $(field activations_kb "$line") KiB"
    fi
    if [ -z "$torch_why" ]; then
      line=$("$PY" "$DIR/torch_speed.py" "$mode" "$batch" "$SECS" "$nth" 2>&1 | grep '^result')
      if [ -n "$line" ]; then
        t_best=$(maxof "$t_best" "$(field samples_per_s "$line")")
        t_med=$(maxof "$t_med" "$(field median_samples_per_s "$line")")
        t_cpu=$(maxof "$t_cpu" "$(field cpu_samples_per_s "$line")")
        t_rss=$(maxof "$t_rss" "$(field peak_rss_kb "$line")")
        t_core=$(field blas_core "$line")
      fi
    fi
    r=$((r + 1))
  done
  name="$mode batch $batch"
  [ "$nth" != 1 ] && name="$name ${nth}thr"
  rss_goal="-"
  [ "$mode" = mlp ] && [ "$nth" = 1 ] && rss_goal="<=0.5"
  if [ -n "$t_best" ] && [ -n "$d_best" ]; then
    awk -v n="$name" -v d="$d_best" -v t="$t_best" -v g="$goal" -v dr="$d_rss" -v tr="$t_rss" -v rg="$rss_goal" \
      'BEGIN { printf "%-22s %11.0f %11.0f %7.2f %7s | %8.1f MiB %7.1f MiB %7.2f %7s\n", n, d, t, d / t, (g == "-" ? "-" : ">=" g),
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
  if [ "$nth" = 1 ] && [ -n "$d_best" ]; then
    eval "ONE_$mode$batch=\$d_best"
  elif [ -n "$d_best" ]; then
    eval "one=\${ONE_$mode$batch:-}"
    [ -n "$one" ] && awk -v d="$d_best" -v o="$one" -v k="$nth" \
      'BEGIN { printf "%-22s over dtrain on one thread: %.2fx (%d threads; goal >= 1.8)\n", "", d / o, k }'
  fi
  [ -n "$extra" ] && printf '%-22s dtrain memory: %s\n' "" "$extra"
  [ -n "$t_core" ] && printf '%-22s PyTorch %s, its BLAS: OpenBLAS kernel %s; its own kernels %s, oneDNN %s\n' "" \
    "$(field torch "$line")" "$t_core" "$(field aten_isa "$line")" "$(field onednn_isa "$line")"
  # the step against the FMA peak (one core: the peak; 2 threads: twice it)
  peak=$(printf '%s\n' "$PEAK_LINE" | sed -n 's/.*gflops=\([0-9.]*\).*/\1/p')
  if [ -n "$peak" ] && [ -n "$d_best" ] && [ -n "$flops" ]; then
    awk -v d="$d_best" -v t="${t_best:-0}" -v f="$flops" -v p="$peak" -v k="$nth" -v m="$mode" -v b="$batch" \
      'BEGIN { g = (m == "mlp" ? (b >= 256 ? ">= 75%" : ">= 55%") : "-");
               printf "%-22s of the FMA peak (%.1f MFLOP/sample, %.0f GFLOP/s x %d): dtrain %.0f%%%s (goal %s)\n", "",
                      f / 1e6, p, k, 100 * d * f / (p * 1e9 * k),
                      (t > 0 ? sprintf(", PyTorch %.0f%%", 100 * t * f / (p * 1e9 * k)) : ""), g }'
  fi
done
echo

# On an AVX-512 core the AVX2-only goals (issue 25: MLP b64 >= 1.7x, CNN >= 1.6x
# against PyTorch on OpenBLAS's Haswell kernel) are measured by a stand-in: dtrain
# forced to its AVX2 path, and PyTorch held to what it has on an AVX2-only core:
# OpenBLAS pinned to its Haswell kernel, oneDNN capped at AVX2 (without the cap its
# convolutions ran jit:avx512_core here, 1.3-1.45k CNN samples/s against 0.98-1.03k
# capped), its own kernels on AVX2.
STANDIN_ENV="OPENBLAS_CORETYPE=Haswell ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"
if [ "$ISA_IN_USE" = avx512 ]; then
  echo "== the AVX2 goals' stand-in on this AVX-512 core: DTRAIN_ISA=avx2 against PyTorch with"
  echo "   $STANDIN_ENV,"
  echo "   one thread, samples/s (best window of $ROUNDS runs x ${SECS} s)"
  [ -n "$torch_why" ] && echo "PyTorch: skipped ($torch_why)"
  printf '%-22s %11s %11s %7s %7s\n' "workload" "dtrain avx2" "PyTorch" "ratio" "goal"
  for wl in "mlp 64 1.7" "cnn 64 1.6"; do
    set -- $wl
    mode=$1 batch=$2 goal=$3
    d_best="" t_best="" d_med="" t_med="" t_core="" dk=""
    r=0
    while [ $r -lt "$ROUNDS" ]; do
      line=$(DTRAIN_ISA=avx2 "$BIN" "$mode" "$batch" "$SECS" 1 2>&1 | grep '^result')
      if [ -n "$line" ]; then
        d_best=$(maxof "$d_best" "$(field samples_per_s "$line")")
        d_med=$(maxof "$d_med" "$(field median_samples_per_s "$line")")
        dk=$(field kernel "$line")
      fi
      if [ -z "$torch_why" ]; then
        tline=$(env $STANDIN_ENV "$PY" "$DIR/torch_speed.py" "$mode" "$batch" "$SECS" 1 2>&1 | grep '^result')
        if [ -n "$tline" ]; then
          t_best=$(maxof "$t_best" "$(field samples_per_s "$tline")")
          t_med=$(maxof "$t_med" "$(field median_samples_per_s "$tline")")
          t_core="$(field blas_core "$tline"), its own kernels $(field aten_isa "$tline"), oneDNN $(field onednn_isa "$tline")"
        fi
      fi
      r=$((r + 1))
    done
    if [ -n "$d_best" ] && [ -n "$t_best" ]; then
      awk -v n="$mode batch $batch" -v d="$d_best" -v t="$t_best" -v g="$goal" -v dm="$d_med" -v tm="$t_med" \
        'BEGIN { printf "%-22s %11.0f %11.0f %7.2f %7s   median window %.0f vs %.0f (%.2f)\n", n, d, t, d / t, ">=" g,
                 dm, tm, dm / tm }'
      printf '%-22s dtrain kernel %s; PyTorch its BLAS: OpenBLAS kernel %s\n' "" "${dk:-?}" "${t_core:-?}"
    elif [ -n "$d_best" ]; then
      awk -v n="$mode batch $batch" -v d="$d_best" 'BEGIN { printf "%-22s %11.0f %11s   PyTorch skipped or failed\n", n, d, "-" }'
    else
      printf '%-22s dtrain run failed\n' "$mode batch $batch"
    fi
  done
  echo
fi

echo "== where the step's time goes: dtrain's per-op profile (BENCH_PROFILE=1, dt_profile_format), one thread"
for wl in "mlp 64" "mlp 256" "cnn 64"; do
  set -- $wl
  echo "-- $1 batch $2"
  BENCH_PROFILE=1 "$BIN" "$1" "$2" "$SECS" 1 2>&1 | grep -v '^result' || echo "profile run failed"
done
# Adam's floor: the update over the MLP's parameters against the same update
# 8,192 floats at a time (in L2), scaled: close together, the divider (one
# square root and two divides an element, PyTorch's arithmetic) binds it; the
# whole run well above, memory does. The MLP's small-batch peak share can go
# no higher than what is left of the step after it.
echo "-- Adam's floor (bench_speed adam): the MLP's 235,146 parameters at once, and 8,192 at a time scaled to them"
"$BIN" adam 1 2>&1 | awk '/^adam / {
    for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    printf "adam  whole %.1f us (%.3f ns a float), in L2 %.1f us (%.3f ns): bound by %s\n", v["whole_us"],
      v["ns_per_float"], v["cached_us"], v["cached_ns_per_float"],
      (v["whole_us"] <= 1.15 * v["cached_us"] ? "the arithmetic (square root and divides)" : "memory")
    next }
  { print }' || echo "adam floor run failed"
echo

# The timeline's cost (issue 21: at most 2% with DTRAIN_TRACE on): the same
# training run with and without it, alternating, best of ROUNDS each.
echo "== the timeline's cost: DTRAIN_TRACE on / off, one thread, samples/s (best of $ROUNDS runs each; goal >= 0.98)"
TRACE_TMP=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-bench-trace.XXXXXX")
for wl in "mlp 64" "cnn 64"; do
  set -- $wl
  off=0; on=0
  for r in $(seq "$ROUNDS"); do
    a=$("$BIN" "$1" "$2" "$SECS" 1 2>/dev/null | sed -n 's/^result samples_per_s=\([0-9.]*\).*/\1/p')
    b=$(DTRAIN_TRACE="$TRACE_TMP/t.json" "$BIN" "$1" "$2" "$SECS" 1 2>/dev/null | sed -n 's/^result samples_per_s=\([0-9.]*\).*/\1/p')
    off=$(awk -v x="$off" -v y="${a:-0}" 'BEGIN { print (y > x ? y : x) }')
    on=$(awk -v x="$on" -v y="${b:-0}" 'BEGIN { print (y > x ? y : x) }')
  done
  spans=$(grep -c '"ph": "X"' "$TRACE_TMP/t.json" 2>/dev/null || echo 0)
  awk -v w="$1 batch $2" -v a="$off" -v b="$on" -v s="$spans" 'BEGIN {
    if (a > 0 && b > 0) printf "%-14s off %9.0f  on %9.0f  ratio %.3f  (%d spans in the last traced run)\n", w, a, b, b / a, s
    else printf "%-14s failed\n", w }'
done
rm -rf "$TRACE_TMP"
