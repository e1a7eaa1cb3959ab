#!/bin/bash
# The seeds' scaling figure (issue 21 part 4), `make figures`: speed-up
# against workers, 1 to 64, synchronous (multi_worker_mirrored, ring) and
# asynchronous (parameter servers), from the planner (examples/02 --plan
# --plan-weak --json: every worker keeps 64 rows a step, the seeds' setting)
# over a 1 and a 10 Gbit/s network with a machine per worker, and on this
# machine (its cores shared, loopback) with the measured points beside it
# (02 --json runs of 1, 2 and 4 workers under tools/dtrain-launch).
# Writes bench/figures/scaling.svg (the README shows it) and the JSON it was
# drawn from under build/figures/, and bench/figures/simulated.svg from
# `make simulate`'s points when they are there. About 3 minutes on 2 cores.
#   bash bench/run_figures.sh
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
EX=$BUILD/examples/02_fashion_mnist
L=tools/dtrain-launch
F=$BUILD/figures
mkdir -p "$F" bench/figures
for f in "$EX" "$L"; do
  [ -x "$f" ] || { echo "run_figures: $f is not built (make $EX $L)" >&2; exit 1; }
done
plan() { # OUT MODEL ARGS...: the planner's rows, weak scaling at 64 rows a worker
  local out=$1 model=$2
  shift 2
  "$EX" --model "$model" --batch 64 --plan --plan-weak --json "$@" | grep '^{' > "$F/$out"
  echo "plan: $out"
}
plan cnn_10gbit.json cnn --plan-workers 64 --link rate=10gbit,delay=50us
plan cnn_10gbit_ps8.json cnn --plan-workers 64 --link rate=10gbit,delay=50us --plan-servers 8
plan cnn_1gbit.json cnn --plan-workers 64 --link rate=1gbit,delay=100us
plan mlp_1gbit.json mlp --plan-workers 64 --link rate=1gbit,delay=100us
# this machine: two workers under the launcher probe its loopback first (the
# kernel's copies the planner charges on one machine: dt_plan_options.loopback_Bps)
timeout 300 "$L" -n 2 -- "$EX" --model mlp --batch 64 --plan --plan-weak --json --plan-workers 4 2>/dev/null |
  sed -n 's/^\[worker 0\] {/{/p' > "$F/mlp_here.json"
[ -s "$F/mlp_here.json" ] || {
  echo "run_figures: the plan under the launcher wrote nothing; see: $L -n 2 -- $EX --model mlp --plan --json" >&2
  exit 1
}
echo "plan: mlp_here.json (loopback probed)"
# measured here: one_device at 64, and 2 and 4 workers at 64 rows each (--batch is global)
M="--model mlp --limit 12800 --epochs 1 --json --quiet"
: > "$F/measured.jsonl"
"$EX" $M --batch 64 --strategy one_device | grep '^{' >> "$F/measured.jsonl"
for n in 2 4; do
  timeout 300 "$L" -n $n -- "$EX" $M --batch $((64 * n)) --strategy multi_worker_mirrored |
    sed -n 's/^\[worker 0\] {/{/p' >> "$F/measured.jsonl"
  timeout 300 "$L" -n $n --ps 1 -- "$EX" $M --batch $((64 * n)) --strategy parameter_server |
    sed -n 's/^\[worker 0\] {/{/p' >> "$F/measured.jsonl"
done
echo "measured: $(wc -l < "$F/measured.jsonl") runs"
S="multi_worker_mirrored ring"
A="parameter_server 1 server"
python3 tools/dtrain-figure -o bench/figures/scaling.svg --seeds \
  --title "Speed-up against workers (64 rows a worker; planner lines, measured boxes)" \
  --curve "CNN sync, 10 Gbit/s=$F/cnn_10gbit.json:$S" \
  --curve "CNN async (1 server), 10 Gbit/s=$F/cnn_10gbit.json:$A" \
  --curve "CNN async (8 servers), 10 Gbit/s=$F/cnn_10gbit_ps8.json:parameter_server 8 servers" \
  --curve "CNN sync, 1 Gbit/s=$F/cnn_1gbit.json:$S" \
  --curve "MLP sync, 1 Gbit/s=$F/mlp_1gbit.json:$S" \
  --curve "MLP sync, this machine=$F/mlp_here.json:$S" \
  --curve "MLP async, this machine=$F/mlp_here.json:$A" \
  --points "MLP sync, this machine=$F/measured.jsonl:multi_worker_mirrored" \
  --points "MLP async, this machine=$F/measured.jsonl:parameter_server"
python3 - "$F" <<'EOF'
import json, sys
F = sys.argv[1]
for name in ("cnn_10gbit", "cnn_10gbit_ps8", "cnn_1gbit", "mlp_1gbit", "mlp_here"):
    d = json.loads(open("%s/%s.json" % (F, name)).read().strip().splitlines()[-1])
    one = [r for r in d["strategies"] if r["name"] == "one_device"][0]["samples_per_sec"]
    cells = []
    for st in ("multi_worker_mirrored ring", "parameter_server 1 server", "parameter_server 8 servers"):
        for r in d["strategies"]:
            if r["name"] == st and r["workers"] in (2, 8, 64):
                cells.append("%s %d: %.2fx" % (st.split()[0], r["workers"], r["samples_per_sec"] / one))
    print("%-11s one_device %.0f samples/s; %s" % (name, one, "; ".join(cells)))
EOF
# past this machine: the simulated points (bench/run_simulate.sh, `make simulate`, needs SimGrid)
if [ -s "$BUILD/simulate/simulated.jsonl" ]; then
  bash bench/draw_simulated.sh "$BUILD/simulate"
else
  echo "bench/figures/simulated.svg: not redrawn (no $BUILD/simulate/simulated.jsonl: make simulate first)"
fi
