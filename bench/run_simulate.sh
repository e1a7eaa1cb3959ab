#!/bin/bash
# Past this machine, by simulation (issue 21 part 5), `make simulate`: the
# MLP of examples/05_multi_worker on dtrain's MPI backend under SimGrid's SMPI
# (Debian's libsimgrid-dev: smpicc, smpirun), 1 to 64 workers on the platforms
# in bench/platforms (a classroom LAN, a Wi-Fi edge cluster, a datacenter),
# with 32 rows a worker (weak scaling). Under smpicc every clock_gettime of
# the program is SMPI's simulated clock (smpi_helpers.h, which smpicc
# includes), so dtrain's timers and the samples/s the example prints are
# simulated time: the compute is the real compute of this machine's core
# (hosts of speed 1Gf and smpi/host-speed 1Gf), the network the platform's.
# Beside each simulated figure, the planner's prediction for the same link
# (02 --plan --plan-weak --batch 32 --link ..., a machine per worker), where
# the planner has a model of that network (not for a shared Wi-Fi medium).
# Prints a markdown table; skips (exit 0) without smpicc/smpirun.
#   bash bench/run_simulate.sh [MAX_WORKERS]     (default 64)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MAXW=${1:-64}
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

# sim PLATFORM N: the simulated samples/s of all workers, the second epoch's (the
# first has the arenas' warm-up), from up to 8 steps of 32 rows a worker (the shipped
# data/fashion-mnist has 8000 samples: 64 workers get 3 steps)
sim() {
  local p=$1 n=$2
  local steps=$((8000 / (32 * n)))
  [ "$steps" -le 8 ] || steps=8
  timeout 600 smpirun -np "$n" -platform "bench/platforms/$p.xml" -hostfile "$S/hosts_$p" \
    --cfg=smpi/host-speed:1Gf --cfg=smpi/allreduce:lr --log=root.thres:critical \
    "$MW" --data data/fashion-mnist --batch $((32 * n)) --limit $((32 * n * steps)) --epochs 2 > "$S/run_${p}_$n.out" 2>&1
  sed -n 's/^epoch 2: .*, \([0-9.]*\) samples\/s (all workers)$/\1/p' "$S/run_${p}_$n.out" | tail -n 1
}
# plan LINK N: the planner's multi_worker_mirrored ring at N workers of 32 rows
plan() {
  local f="$S/plan_$(echo "$1" | tr '=,' '__').json"
  [ -s "$f" ] || "$EX02" --data data/fashion-mnist --batch 32 --plan --plan-weak --plan-workers 64 --link "$1" --json \
    2> /dev/null | grep '^{' > "$f"
  python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for r in d['strategies']:
    if (r['name'] == 'one_device' and sys.argv[2] == '1') or (r['name'] == 'multi_worker_mirrored ring' and r['workers'] == int(sys.argv[2])):
        print(r['samples_per_sec']); break
else:
    print('nan')" "$f" "$2" 2> /dev/null || echo nan
}

echo "simulated with SimGrid $(smpirun -version 2>/dev/null | head -n 1 | sed 's/.*version //'), $(date -u '+%Y-%m-%d %H:%M') UTC; compute: this machine's core ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
echo
echo "| platform | workers | simulated samples/s | speed-up | planner | planner / simulated |"
echo "|---|---|---|---|---|---|"
for p in classroom_lan wifi_edge datacenter_64; do
  case $p in
    classroom_lan) link="rate=100mbit,delay=105us" ;; # two 50 us hops and the switch's 5 us
    datacenter_64) link="rate=10gbit,delay=11us" ;;
    *) link="" ;;                                    # a shared medium: no planner model
  esac
  base=""
  for n in 1 2 4 8 16 32 64; do
    [ "$n" -le "$MAXW" ] || break
    v=$(sim "$p" "$n")
    [ -n "$v" ] || { echo "| $p | $n | failed: $(tail -n 2 "$S/run_${p}_$n.out" | tr '\n' ' ') | | | |"; continue; }
    [ -n "$base" ] || base=$v
    if [ -n "$link" ]; then pr=$(plan "$link" "$n"); else pr=nan; fi
    python3 -c "
import sys
p, n, v, b, pr = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
cells = ['%.0f' % pr, '%.2fx' % (pr / v)] if pr == pr else ['-', '-']
print('| %s | %s | %.0f | %.2fx | %s |' % (p, n, v, v / b, ' | '.join(cells)))" "$p" "$n" "$v" "$base" "$pr"
  done
done
