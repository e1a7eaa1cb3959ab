#!/bin/bash
# Past this machine, by simulation (issue 21 part 5), `make simulate`: the MLP
# and the CNN of examples/05_multi_worker (02's models) on dtrain's MPI
# backend under SimGrid's SMPI (Debian's libsimgrid-dev: smpicc, smpirun),
# 1 to 64 workers on the platforms in bench/platforms (a classroom LAN, a
# Wi-Fi edge cluster, a datacenter), 32 rows a worker (weak scaling).
#
# Under smpicc every clock_gettime of the program is SMPI's simulated clock
# (smpi_helpers.h, which smpicc includes), so dtrain's timers and what the
# example prints are simulated time; the network is the platform's.
#
# The compute (SIM_COMPUTE): "planner" (the default) spends in each worker's
# step the planner's own time for it off the network: the row's step less its
# communication. For the ring that is the forward, backward and loading of 32
# rows as the planner measured them of one worker alone on this machine, the
# optimizer's step and the two passes over the summed gradient; for a
# parameter server's worker the forward, backward and loading, and each
# server spends update_s / M a push (05 --sim-compute-ms and --sim-update-ms,
# under smpi/simulate-computation:no), as machines of their own would. The
# real compute still runs (the weights learn) but costs no simulated time, so
# a point is the same on a busy machine as on an idle one, and "planner /
# simulated" checks the planner's network -- the all-reduce's schedule, the
# switch, the servers' ports, the shared medium -- where this machine cannot:
# beyond 4 workers. (Its compute is checked against real runs of 1-4 workers,
# the README's measured table.) "core": the real compute of this machine's
# core as SMPI measures it (hosts of speed 1Gf, smpi/host-speed 1Gf); SMPI
# runs every rank in turn on that core, each finding its data evicted by the
# rank before, so it computes 1.3-1.7x slower than one worker alone does.
#
# Each point runs on two networks: SMPI's default model, whose factors
# (calibrated on MPI over TCP clusters) scale each message by its size
# (latency x2-11.6, bandwidth x0.34-0.94), and the plain flow model with those
# factors 1 (`smpi/lat-factor:0:1`, `smpi/bw-factor:0:1`) and without
# SimGrid's cross-traffic (`network/crosstraffic:0`; see below): latency and
# bandwidth as the platform says, each direction of a link on its own,
# contention and the all-reduce's real message schedule still simulated, the
# network the planner's alpha-beta model describes. (SimGrid's cross-traffic
# stands for TCP's acknowledgements: every flow also takes 5% of its rate on
# the reverse path, as one variable of the max-min sharing, so a flow into a
# server's port is held to the rate of the flows going out of it: one push
# among 63 pulls moves at 1/63 of the port although its own direction is
# idle. Real full-duplex links do not couple the two directions that way.) Beside each, the planner's prediction for the platform's link as
# it is (02 --plan --plan-weak --batch 32 --link bandwidth=...,latency=...
# [,shared=1 for the Wi-Fi medium], a machine per worker), and that
# prediction's all-reduce put beside the simulation's own compute.
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
#   [SIM_COMPUTE=planner|core] [PS_MODELS="mlp cnn"] bash bench/run_simulate.sh [MAX_WORKERS [MODELS [PLATFORMS]]]
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
SIMC=${SIM_COMPUTE:-planner}
case $SIMC in
  planner | core) ;;
  *) echo "simulate: SIM_COMPUTE is planner or core, not '$SIMC'" >&2; exit 2 ;;
esac
OUT=$S/simulated.jsonl
[ "${APPEND:-0}" = 1 ] || : > "$OUT" # (APPEND=1: add to the points of an earlier run)
if [ -s "$OUT" ] && ! head -n 1 "$OUT" | grep -q "\"compute\": \"$SIMC\""; then
  echo "simulate: $OUT holds points of another SIM_COMPUTE; APPEND=1 adds only to points of the same" >&2
  exit 2
fi

# planfile MODEL LINK M: where plan (below) keeps the planner's JSON for that
# model, link and server count (1: also the synchronous rows')
planfile() {
  local f="$S/plan_$1_$(echo "$2" | tr '=,' '__')"
  [ "$3" = 1 ] && echo "$f.json" || echo "${f}_servers$3.json"
}
# sim MODEL PLATFORM NET N (the platform's LINK from the loop below): "samples/s step_ms compute_ms comm_ms" of the last
# epoch (the first has the arenas' warm-up; rank 0's split of a step), from up
# to 8 steps of 32 rows a worker (the shipped data/fashion-mnist has 8000
# samples: 64 workers get 3 steps); NET ab: SMPI's factors 1, tcp: its defaults
sim() {
  local model=$1 p=$2 net=$3 n=$4 f="" c
  local steps=$((8000 / (32 * n))) epochs=3
  [ "$steps" -le 8 ] || steps=8
  [ "$model" = mlp ] || epochs=2
  [ "$net" = ab ] && f="--cfg=smpi/lat-factor:0:1 --cfg=smpi/bw-factor:0:1 --cfg=network/crosstraffic:0"
  c=$(simc "$(planfile "$model" "$link" 1)" "$n") || return 1
  local out="$S/run_${model}_${p}_${net}_$n.out"
  # (f and c unquoted: words or none)
  # shellcheck disable=SC2086
  timeout 1200 smpirun -np "$n" -platform "bench/platforms/$p.xml" -hostfile "$S/hosts_$p" \
    --cfg=smpi/host-speed:1Gf --cfg=smpi/allreduce:lr $f ${c:+--cfg=smpi/simulate-computation:no} \
    --log=root.thres:critical "$MW" --model "$model" --data data/fashion-mnist --batch $((32 * n)) \
    --limit $((32 * n * steps)) --epochs $epochs --eval-limit 200 $c > "$out" 2>&1
  local v split
  v=$(sed -n "s/^epoch $epochs: .*, \([0-9.]*\) samples\/s (all workers)$/\1/p" "$out" | tail -n 1)
  split=$(sed -n 's/^rank 0: final .* step_ms=\([0-9.]*\) compute_ms=\([0-9.]*\) comm_ms=\([0-9.]*\).*/\1 \2 \3/p' "$out")
  [ -n "$v" ] && [ -n "$split" ] && echo "$v $split"
}
# simps MODEL PLATFORM NET N M (and LINK): the same with M parameter servers (05 --servers M:
# ranks 0..M-1 serve on the platform's hosts 64.., N workers on hosts 0..N-1,
# asynchronous); samples/s while every worker trained (05's window on server 0's
# clock: from the slowest worker's first epoch's end to its last push before
# any worker has ended), with the step's split over the last epochs
simps() {
  local model=$1 p=$2 net=$3 n=$4 m=$5 f="" c
  local steps=$((8000 / (32 * n))) epochs=3
  [ "$steps" -le 8 ] || steps=8
  [ "$model" = mlp ] || epochs=2
  # on the alpha-beta network, PS_ROUNDS pushes a worker (default 128): workers
  # that start in step leave it only slowly (the planner's fluid: 64 to 128
  # rounds), and the window below then covers mostly the rhythm they settle in
  [ "$net" = ab ] && epochs=$(((${PS_ROUNDS:-128} + steps - 1) / steps))
  [ "$net" = ab ] && f="--cfg=smpi/lat-factor:0:1 --cfg=smpi/bw-factor:0:1 --cfg=network/crosstraffic:0"
  c=$(simc "$(planfile "$model" "$link" "$m")" "$n" "$m") || return 1
  local out="$S/run_ps${m}_${model}_${p}_${net}_$n.out"
  # shellcheck disable=SC2086
  timeout 1200 smpirun -np $((n + m)) -platform "bench/platforms/$p.xml" -hostfile "$S/hosts_ps${m}_$p" \
    --cfg=smpi/host-speed:1Gf $f ${c:+--cfg=smpi/simulate-computation:no} --log=root.thres:critical \
    "$MW" --servers "$m" --model "$model" --data data/fashion-mnist --batch $((32 * n)) --limit $((32 * n * steps)) \
    --epochs $epochs --eval-limit 200 $c > "$out" 2>&1
  # the job's rate while every worker trained (server 0's window), else over the last epochs
  local v split
  v=$(sed -n 's/^parameter servers: while every worker trained: \([0-9.]*\) samples\/s .*/\1/p' "$out")
  split=$(sed -n 's/^parameter servers: last epoch \([0-9.]*\) samples\/s (all workers) step_ms=\([0-9.]*\) compute_ms=\([0-9.]*\) comm_ms=\([0-9.]*\)$/\1 \2 \3 \4/p' "$out")
  [ -n "$split" ] && echo "${v:-${split%% *}} ${split#* }"
}
# simc PLANFILE N [M]: with SIM_COMPUTE=planner, 05's --sim-compute-ms (and
# --sim-update-ms) from the plan's row for N workers of 32 rows: its step less
# its communication (one_device at 1, the ring, or M parameter servers: then
# also the servers' update_s / M a push); with core, nothing. The plan file
# is made first (plan) in the loops below.
simc() {
  [ "$SIMC" = planner ] || return 0
  python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
n, m = int(sys.argv[2]), int(sys.argv[3])
want = 'one_device' if n == 1 and m == 0 else 'multi_worker_mirrored ring' if m == 0 else \\
       'parameter_server %d server%s' % (m, 's' if m > 1 else '')
rows = sorted((r for r in d['strategies'] if r['name'] == want), key=lambda r: r['workers'])
r = ([r for r in rows if r['workers'] == n] or rows[:1])[0]  # (1 worker and servers: the 2-worker row's worker)
rest = 32 * r['workers'] / r['samples_per_sec'] * (1 - r['comm_share'])
u = d['measured']['update_s'] / m if m else 0.0
print('--sim-compute-ms %.6f --sim-update-ms %.6f' % (1e3 * rest, 1e3 * u))" "$1" "$2" "${3:-0}"
}
# plan MODEL LINK N [ROW [M]]: the planner's "samples/s comm_ms" for ROW (default
# multi_worker_mirrored ring) at N workers of 32 rows (ring: one_device at 1), the
# parameter_server rows with M servers (default 1)
plan() {
  local f m=${5:-1}
  f=$(planfile "$1" "$2" "$m")
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

echo "simulated with SimGrid $(smpirun -version 2>/dev/null | head -n 1 | sed 's/.*version //'), $(date -u '+%Y-%m-%d %H:%M') UTC; compute ($SIMC): $([ "$SIMC" = planner ] && echo "the planner's measurement of one worker on" || echo "the real compute of") this machine's core ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
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
    plan "$model" "$link" 1 > /dev/null # (its file: the compute SIM_COMPUTE=planner spends)
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
      SIMC=$SIMC python3 - "$model" "$p" "$n" "$base" "$OUT" $ab $tcp $pr <<'EOF'
import json, os, sys
model, p, n, base, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
v, st, cp, cm, tv, tst, tcp_, tcm, pr, pcm = map(float, sys.argv[6:16])
strategy = "one_device" if n == 1 else "multi_worker_mirrored"
with open(out, "a") as f:
    for net, a, b, c, d in (("alpha-beta", v, st, cp, cm), ("smpi-tcp", tv, tst, tcp_, tcm)):
        f.write(json.dumps({"strategy": strategy, "workers": n, "global_samples_per_sec": a, "model": model,
                            "platform": p, "network": net, "batch_per_worker": 32, "step_ms": b,
                            "compute_ms": c, "comm_ms": d, "compute": os.environ["SIMC"]}) + "\n")
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
    plan "$model" "$link" 1 "parameter_server $m server" "$m" > /dev/null
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
      SIMC=$SIMC python3 - "$model" "$p" "$n" "${base:-nan}" "$OUT" "$m" $ab $tcp $pr <<'EOF2'
import json, os, sys
model, p, n, base, out, m = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6])
v, st, cp, cm, tv, tst, tcp_, tcm, pr, pcm = map(float, sys.argv[7:17])
with open(out, "a") as f:
    for net, a, b, c, d in (("alpha-beta", v, st, cp, cm), ("smpi-tcp", tv, tst, tcp_, tcm)):
        f.write(json.dumps({"strategy": "parameter_server", "workers": n, "servers": m, "global_samples_per_sec": a,
                            "model": model, "platform": p, "network": net, "batch_per_worker": 32, "step_ms": b,
                            "compute_ms": c, "comm_ms": d, "compute": os.environ["SIMC"]}) + "\n")
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
