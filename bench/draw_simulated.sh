#!/bin/bash
# Draws bench/figures/simulated.svg -- speed-up against workers, 1 to 64, 32
# rows a worker: the planner's lines and SimGrid's points, synchronous (the
# ring) and asynchronous (one parameter server) -- from what
# bench/run_simulate.sh left in DIR (simulated.jsonl and the planner's JSON).
# Run by `make simulate` and by `make figures` (when the simulation has run).
#   bash bench/draw_simulated.sh [DIR]      (default build/simulate)
set -eu
cd "$(dirname "$0")/.."
S=${1:-build/simulate}
J=$S/simulated.jsonl
[ -s "$J" ] || { echo "draw_simulated: no $J (make simulate first)" >&2; exit 1; }
args=()
R="multi_worker_mirrored ring"
# series MODEL PLATFORM NETWORK LABEL: that series' points into their own file
series() {
  local f="$S/fig_$1_$2_$3.jsonl"
  python3 -c "
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if (d['model'], d['platform'], d['network']) == tuple(sys.argv[2:5]):
        print(l.strip())" "$J" "$1" "$2" "$3" > "$f"
  [ -s "$f" ] && echo "$f"
}
for spec in "mlp datacenter_64 bandwidth_10gbit_latency_11us MLP, datacenter 10 Gbit/s" \
            "cnn datacenter_64 bandwidth_10gbit_latency_11us CNN, datacenter 10 Gbit/s" \
            "cnn classroom_lan bandwidth_100mbit_latency_105us CNN, classroom 100 Mbit/s"; do
  read -r model platform link label <<< "$spec"
  plan="$S/plan_${model}_${link}.json"
  ab=$(series "$model" "$platform" alpha-beta) || continue
  [ -s "$plan" ] || continue
  args+=(--curve "$label=$plan:$R" --simulated "$label=$ab:multi_worker_mirrored")
  tcp=$(series "$model" "$platform" smpi-tcp) && args+=(--simulated "$label, SMPI's TCP factors=$tcp:multi_worker_mirrored")
done
# The asynchronous strategy (M parameter servers), where make simulate ran it
for spec in "mlp datacenter_64 bandwidth_10gbit_latency_11us 1 MLP, datacenter, 1 parameter server" \
            "mlp datacenter_64 bandwidth_10gbit_latency_11us 8 MLP, datacenter, 8 parameter servers" \
            "cnn datacenter_64 bandwidth_10gbit_latency_11us 1 CNN, datacenter, 1 parameter server"; do
  read -r model platform link m label <<< "$spec"
  plan="$S/plan_${model}_${link}.json" row="parameter_server $m server"
  [ "$m" = 1 ] || { plan="$S/plan_${model}_${link}_servers$m.json"; row="${row}s"; }
  [ -s "$plan" ] || continue
  f="$S/fig_ps${m}_${model}_${platform}.jsonl"
  python3 -c "
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if (d['model'], d['platform'], d['network']) == (sys.argv[2], sys.argv[3], 'alpha-beta') and \
       (d['strategy'] == 'one_device' or (d['strategy'] == 'parameter_server' and d.get('servers') == int(sys.argv[4]))):
        print(l.strip())" "$J" "$model" "$platform" "$m" > "$f"
  grep -q '"parameter_server"' "$f" || continue
  args+=(--curve "$label=$plan:$row" --simulated "$label=$f:parameter_server")
done
[ ${#args[@]} -gt 0 ] || { echo "draw_simulated: no model and platform with both a plan and points in $S" >&2; exit 1; }
mkdir -p bench/figures
python3 tools/dtrain-figure -o bench/figures/simulated.svg --seeds \
  --title "Past this machine: SimGrid (32 rows a worker; planner lines, simulated triangles)" "${args[@]}"
