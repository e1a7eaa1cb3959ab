#!/bin/bash
# Past this machine, by simulation (issue 21 part 5), `make simulate`: the MLP
# and the CNN of examples/05_multi_worker (02's models) on dtrain's MPI
# backend under SimGrid's SMPI (Debian's libsimgrid-dev: smpicc, smpirun),
# 1 to 64 workers on the platforms in bench/platforms (a classroom LAN, a
# Wi-Fi edge cluster, a datacenter), 32 rows a worker (weak scaling).
#
# Under smpicc every clock_gettime of the program is SMPI's simulated clock
# (smpi_helpers.h, which smpicc includes), so dtrain's timers and what the
# example prints are simulated time: the compute is the real compute of this
# machine's core (hosts of speed 1Gf and smpi/host-speed 1Gf), the network the
# platform's. Each point runs on two networks: SMPI's default model, whose
# factors (calibrated on MPI over TCP clusters) scale each message by its size
# (latency x2-11.6, bandwidth x0.34-0.94), and the plain flow model with those
# factors 1 (`smpi/lat-factor:0:1`, `smpi/bw-factor:0:1`): latency and
# bandwidth as the platform says, contention and the all-reduce's real message
# schedule still simulated, the network the planner's alpha-beta model
# describes. Beside each, the planner's prediction for the platform's link as
# it is (02 --plan --plan-weak --batch 32 --link bandwidth=...,latency=...
# [,shared=1 for the Wi-Fi medium], a machine per worker), and that
# prediction's all-reduce put beside the simulation's own compute (SMPI runs
# every rank in turn on this one core, so each finds its data evicted by the
# rank before: the simulated compute at 2+ workers is slower than one
# worker's, and slower than on machines of their own).
#
# Then the asynchronous strategy (PS_MODELS, default mlp; empty: none): 05
# --servers 1, one parameter server on the platform's host 64 and N workers
# (MPI point-to-point: push the gradient, pull the weights; the server applies
# pushes as they come), beside the planner's "parameter_server 1 server" row.
#
# Prints two markdown tables and writes every simulated point to
# $BUILD/simulate/simulated.jsonl (02 --json's fields: strategy, workers,
# global_samples_per_sec, with model, platform, network, step_ms, compute_ms,
# comm_ms), which `make figures` draws. Skips (exit 0) without smpicc/smpirun.
# About 30 minutes on one core (the CNN's compute is most of it; the parameter servers 10).
#   [PS_MODELS="mlp cnn"] bash bench/run_simulate.sh [MAX_WORKERS [MODELS [PLATFORMS]]]
#   (default 64 "mlp cnn" "classroom_lan wifi_edge datacenter_64"; MODELS "": the
#   synchronous runs skipped, APPEND=1: added to the points of an earlier run)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MAXW=${1:-64}
MODELS=${2-mlp cnn}
PLATFORMS=${3:-classroom_lan wifi_edge datacenter_64}
EX02=$BUILD/examples/02_fashion_mnist
if ! command -v smpicc > /dev/null 2>&1 || ! command -v smpirun > /dev/null 2>&1; then
  echo "simulate: skipped (no smpicc/smpirun: apt-get install libsimgrid-dev)"
  exit 0
fi
[ -x "$EX02" ] || { echo "simulate: $EX02 is not built (make $EX02)" >&2; exit 1; }
S=$BUILD/simulate
mkdir -p "$S"
MW=$S/05_multi_worker_smpi
if [ ! -x "$MW" ] || [ examples/05_multi_worker.c -nt "$MW" ] || [ dtrain.h -nt "$MW" ]; then
  echo "building $MW with smpicc (about a minute)" >&2
  smpicc -std=c11 -O2 -DSMPI_NO_OVERRIDE_MALLOC -DDTRAIN_USE_MPI -I. examples/05_multi_worker.c -o "$MW" -lm -lpthread \
    > "$S/build.log" 2>&1 || { cat "$S/build.log" >&2; exit 1; }
fi
for i in $(seq 0 63); do echo "laptop-$i"; done > "$S/hosts_classroom_lan"
for i in $(seq 0 63); do echo "board-$i"; done > "$S/hosts_wifi_edge"
for i in $(seq 0 63); do echo "node-$i"; done > "$S/hosts_datacenter_64"
for p in classroom_lan wifi_edge datacenter_64; do # M parameter servers on hosts 64.., then the workers
  for m in 1 2 4 8; do
    pre=$(sed -n 1p "$S/hosts_$p" | sed 's/-0$//')
    { for i in $(seq 64 $((63 + m))); do echo "$pre-$i"; done; cat "$S/hosts_$p"; } > "$S/hosts_ps${m}_$p"
  done
done
OUT=$S/simulated.jsonl
[ "${APPEND:-0}" = 1 ] || : > "$OUT" # (APPEND=1: add to the points of an earlier run)

# sim MODEL PLATFORM NET N: "samples/s step_ms compute_ms comm_ms" of the last
# epoch (the first has the arenas' warm-up; rank 0's split of a step), from up
# to 8 steps of 32 rows a worker (the shipped data/fashion-mnist has 8000
# samples: 64 workers get 3 steps); NET ab: SMPI's factors 1, tcp: its defaults
sim() {
  local model=$1 p=$2 net=$3 n=$4 f=""
  local steps=$((8000 / (32 * n))) epochs=3
  [ "$steps" -le 8 ] || steps=8
  [ "$model" = mlp ] || epochs=2
  [ "$net" = ab ] && f="--cfg=smpi/lat-factor:0:1 --cfg=smpi/bw-factor:0:1"
  local out="$S/run_${model}_${p}_${net}_$n.out"
  # (f unquoted: two --cfg words or none)
  # shellcheck disable=SC2086
  timeout 1200 smpirun -np "$n" -platform "bench/platforms/$p.xml" -hostfile "$S/hosts_$p" \
    --cfg=smpi/host-speed:1Gf --cfg=smpi/allreduce:lr $f --log=root.thres:critical \
    "$MW" --model "$model" --data data/fashion-mnist --batch $((32 * n)) --limit $((32 * n * steps)) \
    --epochs $epochs --eval-limit 200 > "$out" 2>&1
  local v split
  v=$(sed -n "s/^epoch $epochs: .*, \([0-9.]*\) samples\/s (all workers)$/\1/p" "$out" | tail -n 1)
  split=$(sed -n 's/^rank 0: final .* step_ms=\([0-9.]*\) compute_ms=\([0-9.]*\) comm_ms=\([0-9.]*\).*/\1 \2 \3/p' "$out")
  [ -n "$v" ] && [ -n "$split" ] && echo "$v $split"
}
# simps MODEL PLATFORM NET N M: the same with M parameter servers (05 --servers M:
# ranks 0..M-1 serve on the platform's hosts 64.., N workers on hosts 0..N-1, asynchronous)
simps() {
  local model=$1 p=$2 net=$3 n=$4 m=$5 f=""
  local steps=$((8000 / (32 * n))) epochs=3
  [ "$steps" -le 8 ] || steps=8
  [ "$model" = mlp ] || epochs=2
  [ "$net" = ab ] && f="--cfg=smpi/lat-factor:0:1 --cfg=smpi/bw-factor:0:1"
  local out="$S/run_ps${m}_${model}_${p}_${net}_$n.out"
  # shellcheck disable=SC2086
  timeout 1200 smpirun -np $((n + m)) -platform "bench/platforms/$p.xml" -hostfile "$S/hosts_ps${m}_$p" \
    --cfg=smpi/host-speed:1Gf $f --log=root.thres:critical \
    "$MW" --servers "$m" --model "$model" --data data/fashion-mnist --batch $((32 * n)) --limit $((32 * n * steps)) \
    --epochs $epochs --eval-limit 200 > "$out" 2>&1
  sed -n 's/^parameter servers: last epoch \([0-9.]*\) samples\/s (all workers) step_ms=\([0-9.]*\) compute_ms=\([0-9.]*\) comm_ms=\([0-9.]*\)$/\1 \2 \3 \4/p' "$out"
}
# plan MODEL LINK N [ROW [M]]: the planner's "samples/s comm_ms" for ROW (default
# multi_worker_mirrored ring) at N workers of 32 rows (ring: one_device at 1), the
# parameter_server rows with M servers (default 1)
plan() {
  local f="$S/plan_$1_$(echo "$2" | tr '=,' '__').json" m=${5:-1}
  [ "$m" = 1 ] || f="${f%.json}_servers$m.json"
  [ -s "$f" ] || "$EX02" --model "$1" --data data/fashion-mnist --batch 32 --plan --plan-weak --plan-workers 64 \
    --plan-servers "$m" --link "$2" --json 2> /dev/null | grep '^{' > "$f"
  python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for r in d['strategies']:
    if (r['name'] == 'one_device' and sys.argv[2] == '1' and sys.argv[3] == 'multi_worker_mirrored ring') or (r['name'] == sys.argv[3] and r['workers'] == int(sys.argv[2])):
        step = 32 * r['workers'] / r['samples_per_sec']
        print(r['samples_per_sec'], 1e3 * step * r['comm_share']); break
else:
    print('nan nan')" "$f" "$3" "${4:-multi_worker_mirrored ring}" 2> /dev/null || echo nan nan
}

echo "simulated with SimGrid $(smpirun -version 2>/dev/null | head -n 1 | sed 's/.*version //'), $(date -u '+%Y-%m-%d %H:%M') UTC; compute: this machine's core ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
echo
echo "| model | platform | workers | simulated, alpha-beta network: samples/s (speed-up) | its step: all-reduce ms / ms | planner | planner / simulated | planner's all-reduce / simulated's | planner's all-reduce + simulated compute: / simulated | simulated, SMPI's TCP factors: samples/s | its all-reduce ms | planner / simulated |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for model in $MODELS; do
  for p in $PLATFORMS; do
    case $p in
      classroom_lan) link="bandwidth=100mbit,latency=105us" ;; # two 50 us hops and the switch's 5 us
      datacenter_64) link="bandwidth=10gbit,latency=11us" ;;   # two 5 us hops and the fabric's 1 us
      wifi_edge) link="bandwidth=50mbit,latency=3ms,shared=1" ;; # three 1 ms hops, one medium
    esac
    base=""
    for n in 1 2 4 8 16 32 64; do
      [ "$n" -le "$MAXW" ] || break
      ab=$(sim "$model" "$p" ab "$n")
      tcp=$(sim "$model" "$p" tcp "$n")
      if [ -z "$ab" ] || [ -z "$tcp" ]; then
        echo "| $model | $p | $n | failed: $(tail -n 2 "$S/run_${model}_${p}_$([ -z "$ab" ] && echo ab || echo tcp)_$n.out" | tr '\n|' '  ') | | | | | | | | |"
        continue
      fi
      [ -n "$base" ] || base=${ab%% *}
      if [ -n "$link" ]; then pr=$(plan "$model" "$link" "$n"); else pr="nan nan"; fi
      python3 - "$model" "$p" "$n" "$base" "$OUT" $ab $tcp $pr <<'EOF'
import json, sys
model, p, n, base, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
v, st, cp, cm, tv, tst, tcp_, tcm, pr, pcm = map(float, sys.argv[6:16])
strategy = "one_device" if n == 1 else "multi_worker_mirrored"
with open(out, "a") as f:
    for net, a, b, c, d in (("alpha-beta", v, st, cp, cm), ("smpi-tcp", tv, tst, tcp_, tcm)):
        f.write(json.dumps({"strategy": strategy, "workers": n, "global_samples_per_sec": a, "model": model,
                            "platform": p, "network": net, "batch_per_worker": 32, "step_ms": b,
                            "compute_ms": c, "comm_ms": d}) + "\n")
have = pr == pr
cells = ["%d (%.2fx)" % (v, v / base), "%.2f / %.2f" % (cm, st),
         "%d" % pr if have else "-", "%.2fx" % (pr / v) if have else "-",
         ("%.2fx" % (pcm / cm) if cm > 0 else "-") if have and n > 1 else "-",
         "%.2fx" % ((32 * n / ((st - cm + pcm) / 1e3)) / v) if have and n > 1 else "-",
         "%d" % tv, "%.2f" % tcm, "%.2fx" % (pr / tv) if have else "-"]
print("| %s | %s | %d | %s |" % (model, p, n, " | ".join(cells)))
EOF
    done
  done
done

# The asynchronous strategy: M parameter servers (PS_SERVERS, default "1 8"), N
# workers (PS_MODELS, default mlp; PS_MODELS= skips)
PS_MODELS=${PS_MODELS-mlp}
PS_SERVERS=${PS_SERVERS:-1 8}
if [ -n "$PS_MODELS" ]; then
  echo
  echo "| model | platform | servers | workers | simulated, alpha-beta network: samples/s (over one_device) | its step: push and pull ms / ms | planner (parameter_server) | planner / simulated | simulated, SMPI's TCP factors: samples/s | planner / that |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
fi
for model in $PS_MODELS; do
  for p in $PLATFORMS; do
  for m in $PS_SERVERS; do
    case $p in
      classroom_lan) link="bandwidth=100mbit,latency=105us" ;;
      datacenter_64) link="bandwidth=10gbit,latency=11us" ;;
      wifi_edge) link="bandwidth=50mbit,latency=3ms,shared=1" ;;
    esac
    base=$(python3 -c "
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if (d['model'], d['platform'], d['network'], d['strategy']) == (sys.argv[2], sys.argv[3], 'alpha-beta', 'one_device'):
        print(d['global_samples_per_sec'])" "$OUT" "$model" "$p" | head -n 1)
    for n in 1 2 4 8 16 32 64; do
      [ "$n" -le "$MAXW" ] || break
      ab=$(simps "$model" "$p" ab "$n" "$m")
      tcp=$(simps "$model" "$p" tcp "$n" "$m")
      if [ -z "$ab" ] || [ -z "$tcp" ]; then
        echo "| $model | $p | $m | $n | failed: $(tail -n 2 "$S/run_ps${m}_${model}_${p}_$([ -z "$ab" ] && echo ab || echo tcp)_$n.out" | tr '\n|' '  ') | | | | | |"
        continue
      fi
      row="parameter_server $m server"
      [ "$m" = 1 ] || row="${row}s"
      pr=$(plan "$model" "$link" "$n" "$row" "$m")
      python3 - "$model" "$p" "$n" "${base:-nan}" "$OUT" "$m" $ab $tcp $pr <<'EOF2'
import json, sys
model, p, n, base, out, m = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6])
v, st, cp, cm, tv, tst, tcp_, tcm, pr, pcm = map(float, sys.argv[7:17])
with open(out, "a") as f:
    for net, a, b, c, d in (("alpha-beta", v, st, cp, cm), ("smpi-tcp", tv, tst, tcp_, tcm)):
        f.write(json.dumps({"strategy": "parameter_server", "workers": n, "servers": m, "global_samples_per_sec": a,
                            "model": model, "platform": p, "network": net, "batch_per_worker": 32, "step_ms": b,
                            "compute_ms": c, "comm_ms": d}) + "\n")
have = pr == pr
cells = ["%d (%.2fx)" % (v, v / base) if base == base else "%d" % v, "%.2f / %.2f" % (cm, st),
         "%d" % pr if have else "-", "%.2fx" % (pr / v) if have else "-", "%d" % tv, "%.2fx" % (pr / tv) if have else "-"]
print("| %s | %s | %d | %d | %s |" % (model, p, m, n, " | ".join(cells)))
EOF2
    done
  done
  done
done
echo
echo "simulated points: $OUT ($(wc -l < "$OUT") lines)"

# The figure: the planner's lines and the simulated points (32 rows a worker)
bash bench/draw_simulated.sh "$S" || exit 1
