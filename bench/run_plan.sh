#!/bin/bash
# The planner against measured runs (issue 21 part 3): for the MLP and the
# CNN, examples/02_fashion_mnist --plan --json predicts samples/s (all
# workers together) and the same example trains and reports its
# global_samples_per_sec with --json: threads (one_device, mirrored 2) and
# processes on this machine over loopback and over links emulated at 100 and
# 10 Mbit/s (DTRAIN_NETEM; the planner told the same with --link and
# --plan-one-machine: the processes share this machine's cores). The loopback
# rows' plan runs under the launcher, whose two workers probe this machine's
# loopback (latency, one stream's rate: the kernel's copies the planner
# counts; until 2026-11-30 it took 25 us and 2.5 GB/s for any machine; printed
# after the tables).
# Each measured row is the best of RUNS runs (this machine is shared and
# noisy); the ratio is predicted / measured. Prints a markdown table.
#   bash bench/run_plan.sh [RUNS]      (make bench-plan)
# Takes about 6 minutes with RUNS=2 on 2 cores.
set -u
cd "$(dirname "$0")/.."
EX=${EX:-build/examples/02_fashion_mnist}
L=tools/dtrain-launch
RUNS=${1:-2}
for f in "$EX" "$L"; do
  [ -x "$f" ] || { echo "run_plan: $f is not built (make $EX $L)" >&2; exit 1; }
done
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

# json FILE FIELD: the field of the last JSON line of FILE (worker 0's)
json() { python3 -c "
import json, sys
lines = [l[l.index('{'):] for l in open(sys.argv[1]) if '{' in l]
print(json.loads(lines[-1])[sys.argv[2]] if lines else 'nan')" "$1" "$2" 2>/dev/null || echo nan; }

# predict MODEL BATCH LINK NAME WORKERS: the planner's samples/s for that row
predict() {
  local key="$1 $2 $3"
  local f="$T/plan.$(echo "$key" | tr ' =,' '___')"
  if [ ! -s "$f" ]; then
    if [ "$3" = loopback ]; then # two workers on this host probe its loopback first (02 --plan under the launcher)
      "$L" -n 2 -- "$EX" --model "$1" --batch "$2" --plan --plan-workers 4 --json 2>/dev/null |
        sed -n 's/^\[worker 0\] //p' | grep '^{' > "$f"
    else
      "$EX" --model "$1" --batch "$2" --plan --plan-workers 4 --link "$3" --plan-one-machine --json > "$f" 2>/dev/null
    fi
  fi
  python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for r in d['strategies']:
    if r['name'] == sys.argv[2] and r['workers'] == int(sys.argv[3]):
        print(r['samples_per_sec']); break
else:
    print('nan')" "$f" "$4" "$5" 2>/dev/null || echo nan
}

# measure LINK WORKERS SERVERS ARGS...: the best global samples/s of RUNS runs
measure() {
  local link=$1 n=$2 ps=$3 best=0 v
  shift 3
  for ((i = 0; i < RUNS; i++)); do
    if [ "$n" = 0 ]; then
      timeout 600 "$EX" "$@" --json --quiet > "$T/run" 2>&1
    elif [ "$link" = loopback ]; then
      timeout 600 "$L" -n "$n" --ps "$ps" -- "$EX" "$@" --json --quiet > "$T/run" 2>&1
    else
      DTRAIN_NETEM="$link" timeout 600 "$L" -n "$n" --ps "$ps" -- "$EX" "$@" --json --quiet > "$T/run" 2>&1
    fi
    v=$(json "$T/run" global_samples_per_sec)
    best=$(python3 -c "import sys; a, b = sys.argv[1:]; print(max(float(a), float(b) if b != 'nan' else 0))" "$best" "$v")
  done
  echo "$best"
}

row() { # MODEL BATCH LINK SETTING PLANNED_NAME WORKERS SERVERS MEASURE_ARGS...
  local model=$1 batch=$2 link=$3 setting=$4 name=$5 n=$6 ps=$7
  shift 7
  local p m
  p=$(predict "$model" "$batch" "$link" "$name" "$([ "$n" = 0 ] && echo "${W:-1}" || echo "$n")")
  m=$(measure "$link" "$n" "$ps" --model "$model" --batch "$batch" "$@")
  python3 -c "
import sys
model, setting, name, w, p, m = sys.argv[1:]
p, m = float(p), float(m)
r = p / m if m > 0 else float('nan')
f = lambda v: f'{v:.0f}' if v >= 100 else f'{v:.1f}'
print(f'| {model} | {setting} | {name} | {w} | {f(p)} | {f(m)} | {r:.2f}x | {\"yes\" if abs(r - 1) <= 0.2 else \"no\"} |')
" "$model" "$setting" "$name" "$([ "$n" = 0 ] && echo "${W:-1}" || echo "$n")" "$p" "$m"
}

echo "planner validation: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M') UTC, best of $RUNS runs"
echo
echo "| model | where | strategy | workers | predicted samples/s | measured | predicted / measured | within 20% |"
echo "|---|---|---|---|---|---|---|---|"
M="--limit 20000 --epochs 6" # (6 epochs: a run of 1-3 s; at 2, 0.3-1 s runs moved by 10-40% from run to run)
W=1 row mlp 128 loopback "threads" one_device 0 0 $M --strategy one_device
W=2 row mlp 128 loopback "threads" mirrored 0 0 $M --strategy mirrored --replicas 2
row mlp 128 loopback "loopback" "multi_worker_mirrored ring" 2 0 $M --strategy multi_worker_mirrored
row mlp 128 loopback "loopback" "multi_worker_mirrored ring" 4 0 $M --strategy multi_worker_mirrored
row mlp 128 loopback "loopback" "parameter_server 1 server" 2 1 $M --strategy parameter_server
row mlp 128 rate=100mbit "100 Mbit/s" "multi_worker_mirrored ring" 2 0 --limit 5120 --epochs 1 --strategy multi_worker_mirrored
row mlp 128 rate=100mbit "100 Mbit/s" "parameter_server 1 server" 2 1 --limit 5120 --epochs 1 --strategy parameter_server
row mlp 128 rate=10mbit "10 Mbit/s" "multi_worker_mirrored ring" 2 0 --limit 2560 --epochs 1 --strategy multi_worker_mirrored
row mlp 128 rate=10mbit "10 Mbit/s" "parameter_server 1 server" 2 1 --limit 1280 --epochs 1 --strategy parameter_server
C="--limit 1280 --epochs 1"
W=1 row cnn 64 loopback "threads" one_device 0 0 $C --strategy one_device
W=2 row cnn 64 loopback "threads" mirrored 0 0 $C --strategy mirrored --replicas 2
row cnn 64 loopback "loopback" "multi_worker_mirrored ring" 2 0 $C --strategy multi_worker_mirrored
row cnn 64 loopback "loopback" "parameter_server 1 server" 2 1 $C --strategy parameter_server
row cnn 64 rate=100mbit "100 Mbit/s" "multi_worker_mirrored ring" 2 0 --limit 640 --epochs 1 --strategy multi_worker_mirrored
row cnn 64 rate=10mbit "10 Mbit/s" "multi_worker_mirrored ring" 2 0 --limit 256 --epochs 1 --strategy multi_worker_mirrored

# Model parallelism (tensor-parallel and pipeline rows): examples/07_model_parallel's
# MLP (8 hidden layers of 256, tanh; batch 64) on 2 processes over loopback,
# 07 --plan --json against its own samples_per_s, one_device beside them.
MP=${MP:-build/examples/07_model_parallel}
if [ -x "$MP" ]; then
  "$MP" --plan --json > "$T/mp.plan" 2>/dev/null
  mp_pred() { python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(next((s['samples_per_sec'] for s in d['strategies'] if s['name'] == sys.argv[2] and s['workers'] == int(sys.argv[3])), 'nan'))" "$T/mp.plan" "$1" "$2" 2>/dev/null || echo nan; }
  mp_row() { # NAME WORKERS -- the run's flags
    local name=$1 w=$2 best=0; shift 3
    for r in $(seq "$RUNS"); do
      if [ "$w" = 1 ]; then "$MP" "$@" --steps 300 --json > "$T/mp.out" 2>&1
      else timeout 300 "$L" -n "$w" -- "$MP" "$@" --steps 300 --json > "$T/mp.out" 2>&1; fi
      v=$(json "$T/mp.out" samples_per_s)
      best=$(python3 -c "import sys; a, b = sys.argv[1:]; print(max(float(a), float(b) if b != 'nan' else 0))" "$best" "$v")
    done
    python3 -c "
import sys
name, w, p, m = sys.argv[1:]
p, m = float(p), float(m)
r = p / m if m > 0 else float('nan')
print(f'| mlp 8x256 (07) | loopback | {name} | {w} | {p:.0f} | {m:.0f} | {r:.2f}x | {\"yes\" if abs(r - 1) <= 0.2 else \"no\"} |')
" "$name" "$w" "$(mp_pred "$name" "$w")" "$best"
  }
  mp_row one_device 1 -- --parallel none
  mp_row tensor_parallel 2 -- --parallel tensor --stages 2
  mp_row "pipeline 1f1b m=4" 2 -- --parallel pipeline --stages 2 --microbatches 4
else
  echo "(model-parallel rows skipped: $MP is not built)"
fi

echo
# what the loopback rows' plans probed (the two workers under the launcher): the
# predictions there move with it
for f in "$T"/plan.*loopback*; do
  [ -s "$f" ] && python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
l = d['link']
print('(%s at batch %d, loopback probed: %.1f us, %.2f GB/s)' % (d['model'], d['batch'], 1e6 * l['latency_s'], l['bandwidth_Bps'] / 1e9))" "$f" 2>/dev/null
done
