#!/bin/sh
# run_slowlinks.sh -- `make bench-net`, part 2 (issue 19, "the seeds' claims,
# measured"): training over slow links, every strategy side by side in one run.
#
#   sh bench/run_slowlinks.sh          (BUILD=build; root with ip and tc for part 1)
#
# 1. One link, two machines: 2 ranks in two network namespaces joined by a
#    veth pair whose ends are shaped by the kernel's token-bucket shaper
#    (tc qdisc ... tbf) at 1 Gbit, 100 Mbit and 10 Mbit. On that same link:
#    build/bench/bench_multiworker (dtrain multi_worker_mirrored, plain and
#    --compress powersgd:4) and bench/torch_ddp.py (PyTorch DDP over gloo,
#    plain and with DDP's own PowerSGD hook, rank 4), the Fashion-MNIST MLP
#    at 64 samples per rank, samples/s of both ranks together (best 10-step
#    window, as bench_speed.c). The issue's goal: dtrain at least 2x DDP's
#    samples/s at 100 Mbit (dtrain's best method against DDP as people run it).
# 2. Every strategy, on links emulated by DTRAIN_NETEM (loopback, per
#    connection: a parameter server's links to its 2 workers are two links):
#    the Fashion-MNIST MLP, global batch 128, the first 6400 training samples,
#    until test accuracy reaches 0.80 (--target-accuracy; epochs of 50 steps,
#    at most 4; parameter-server workers do not stop early: 4 epochs, 1 at 10
#    Mbit). Samples/s (all workers together), seconds of training to the
#    target, the epoch it was met in, and bytes each worker sent per step
#    (multi_worker_mirrored: its collectives; parameter server: its pushes
#    and pull requests, it receives about as much again in pulled weights).
#    In-process strategies have no link: their rows are the compute ceiling.
#    A slow member: rank 1's links at a tenth of the rate; jitter: 2 ms delay
#    with 1 ms jitter on every send.
# Timings only: nothing is asserted. One run per row (the link dominates).
PY=${PYTHON:-/usr/bin/python3}
DIR=$(dirname "$0")
B=${BUILD:-build}
EX=$B/examples/02_fashion_mnist
MW=$B/bench/bench_multiworker
LAUNCH=tools/dtrain-launch
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
have_torch=0
[ -x "$PY" ] && "$PY" -c "import torch" >/dev/null 2>&1 && have_torch=1

echo "== slow links: cpus $(getconf _NPROCESSORS_ONLN), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), load $(cut -d' ' -f1 /proc/loadavg)"

# ---- 1. the same tbf-shaped link: dtrain against PyTorch DDP ----
rate_of() { sed -n 's/^result samples_per_s=\([0-9.]*\).*/\1/p'; }
part1() {
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "== 1. tbf link: skipped (needs root, ip and tc for network namespaces)"; return
  fi
  [ -x $MW ] || { echo "== 1. tbf link: skipped (no $MW)"; return; }
  . "$DIR/netns_pair.sh"
  A=dtsl$$a; Bn=dtsl$$b
  cleanup() { ip netns del $A 2>/dev/null; ip netns del $Bn 2>/dev/null; }
  trap cleanup EXIT INT TERM
  netns_pair $A $Bn 10.214.0 || { echo "== 1. tbf link: skipped (could not make the namespaces)"; return; }
  export DTRAIN_TOKEN=slowlinks-$$ # not loopback: peers prove the token
  echo "== 1. MLP, 2 ranks x batch 64 across one tbf-shaped veth link: samples/s (both ranks)"
  [ $have_torch = 1 ] || echo "(PyTorch side skipped: no torch in $PY)"
  printf '%-8s %12s %12s %12s %12s %16s %16s\n' link dtrain dtrain_psgd4 DDP DDP_psgd4 "dtrain/DDP" "best/DDP"
  port=7400
  for rate in 1gbit 100mbit 10mbit; do
    netns_tbf $A $Bn $rate
    secs=2; [ $rate = 10mbit ] && secs=1
    res=""
    for c in none powersgd:4; do
      port=$((port + 1))
      peers=10.214.0.1:$port,10.214.0.2:$port
      ip netns exec $Bn timeout 300 $MW 2 64 $secs --rank 1 --peers $peers --compress $c >/dev/null 2>&1 &
      p=$!
      v=$(ip netns exec $A timeout 300 $MW 2 64 $secs --rank 0 --peers $peers --compress $c 2>/dev/null | rate_of)
      wait $p
      res="$res ${v:-0}"
    done
    for h in 0 4; do
      v=0
      if [ $have_torch = 1 ]; then
        port=$((port + 1))
        extra=""; [ $h -gt 0 ] && extra="--powersgd $h"
        # gloo picks its interface from the hostname, which no namespace has: name it
        GLOO_SOCKET_IFNAME=${Bn}v ip netns exec $Bn timeout 300 "$PY" "$DIR/torch_ddp.py" 2 64 $secs --rank 1 --master 10.214.0.1:$port $extra >/dev/null 2>&1 &
        p=$!
        v=$(GLOO_SOCKET_IFNAME=${A}v ip netns exec $A timeout 300 "$PY" "$DIR/torch_ddp.py" 2 64 $secs --rank 0 --master 10.214.0.1:$port $extra 2>/dev/null | rate_of)
        wait $p
      fi
      res="$res ${v:-0}"
    done
    echo "$rate $res" | awk '{ r = ($4 > 0) ? sprintf("%.2fx", $2 / $4) : "-"; b = ($4 > 0) ? sprintf("%.2fx", ($3 > $2 ? $3 : $2) / $4) : "-"
      printf "%-8s %12.0f %12.0f %12.0f %12.0f %16s %16s\n", $1, $2, $3, $4, $5, r, b }'
  done
  cleanup
  trap - EXIT INT TERM
  unset DTRAIN_TOKEN
}
# SLOWLINKS_ONLY=2 skips part 1; SLOWLINKS_ROWS=REGEX runs only the part-2 rows whose name matches.
[ "${SLOWLINKS_ONLY:-}" = 2 ] || part1
echo

# ---- 2. every strategy on emulated links ----
[ -x $EX ] && [ -x $LAUNCH ] || { echo "== 2. strategies: skipped (no $EX or $LAUNCH)"; exit 0; }
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" | head -1; }
T=$B/bench/slowlinks
mkdir -p $T
COMMON="--model mlp --batch 128 --limit 6400 --seed 1 --quiet --json --csv $T/m.csv --svg $T/m.svg --target-accuracy 0.80"
# row NAME LINK WORKERS NETEM -- command...
row() {
  name=$1; link=$2; w=$3; ne=$4; shift 5
  if [ -n "${SLOWLINKS_ROWS:-}" ] && ! printf '%s\n' "$name" | grep -Eq "$SLOWLINKS_ROWS"; then return; fi
  if [ "$ne" = - ]; then out=$(timeout 600 "$@" 2>&1); else out=$(DTRAIN_NETEM="$ne" timeout 600 "$@" 2>&1); fi
  j=$(printf '%s\n' "$out" | sed -n 's/^\(\[worker 0\] \)\{0,1\}\({"model".*\)/\2/p' | head -1)
  if [ -z "$j" ]; then
    printf '%-34s %-24s %3s  failed: %s\n' "$name" "$link" "$w" "$(printf '%s' "$out" | tail -1 | cut -c1-60)"
    return
  fi
  sps=$(echo "$j" | field samples_per_sec); acc=$(echo "$j" | field test_accuracy)
  st=$(echo "$j" | field seconds_to_target); et=$(echo "$j" | field epochs_to_target)
  wb=$(echo "$j" | field wire_bytes_per_step); ep=$(echo "$j" | field epochs)
  echo "$name|$link|$w|$sps|$acc|$st|$et|$wb|$ep" | awk -F'|' '{
    per = ($1 ~ /^(multi_worker|parameter_server)/) ? $3 : 1
    tta = ($6 + 0 >= 0) ? sprintf("%.1f", $6) : sprintf("not in %d ep", $9)
    printf "%-34s %-24s %3s %10.0f %8.4f %12s %6s %12s\n", $1, $2, $3, $4 * per, $5, tta, ($7 + 0 >= 0) ? $7 : "-",
      sprintf("%.0f", $8 / 1024) }'
}
echo "== 2. Fashion-MNIST MLP, global batch 128, 6400 samples, to test accuracy 0.80 (DTRAIN_NETEM links)"
printf '%-34s %-24s %3s %10s %8s %12s %6s %12s\n' strategy link W samples/s test_acc s_to_0.80 epoch wire_KB/step
row one_device "none (one process)" 1 - -- $EX $COMMON --epochs 4
row "mirrored (2 replicas)" "none (one process)" 2 - -- $EX $COMMON --epochs 4 --strategy mirrored --replicas 2
row "async (2 replicas)" "none (one process)" 2 - -- $EX $COMMON --epochs 4 --strategy async --replicas 2
for rate in 1gbit 100mbit 10mbit; do
  for c in none fp16 topk:0.1 powersgd:4; do
    row "multi_worker_mirrored $c" "$rate" 2 rate=$rate -- $LAUNCH -n 2 -- $EX $COMMON --epochs 4 --strategy multi_worker_mirrored --compress $c
  done
done
for c in none powersgd:4; do
  row "multi_worker_mirrored $c" "100mbit, 4 workers" 4 rate=100mbit -- $LAUNCH -n 4 -- $EX $COMMON --epochs 4 --strategy multi_worker_mirrored --compress $c
  row "multi_worker_mirrored $c" "100mbit, rank1 10mbit" 2 "rate=100mbit;rank1:rate=10mbit" -- $LAUNCH -n 2 -- $EX $COMMON --epochs 4 --strategy multi_worker_mirrored --compress $c
  row "multi_worker_mirrored $c" "100mbit+2ms, jitter 1ms" 2 "rate=100mbit,delay=2ms,jitter=1ms" -- $LAUNCH -n 2 -- $EX $COMMON --epochs 4 --strategy multi_worker_mirrored --compress $c
done
for rate in 1gbit 100mbit 10mbit; do
  e=4; [ $rate = 10mbit ] && e=1
  row "parameter_server (1 server)" "$rate" 2 rate=$rate -- $LAUNCH -n 2 --ps 1 -- $EX $COMMON --epochs $e --strategy parameter_server
done
row "parameter_server (1 server)" "100mbit, rank1 10mbit" 2 "rate=100mbit;rank1:rate=10mbit" -- $LAUNCH -n 2 --ps 1 -- $EX $COMMON --epochs 4 --strategy parameter_server
# pushes in parts during backward (the same parameters as the plain rows above)
for rate in 1gbit 100mbit; do
  row "parameter_server push_early" "$rate" 2 rate=$rate -- $LAUNCH -n 2 --ps 1 -- $EX $COMMON --epochs 4 --strategy parameter_server --push-early --bucket-kb 256
done
# compressed pushes (and 16-bit difference pulls)
for rate in 100mbit 10mbit; do
  e=4; [ $rate = 10mbit ] && e=2
  for c in fp16 topk:0.1 powersgd:4; do
    row "parameter_server $c" "$rate" 2 rate=$rate -- $LAUNCH -n 2 --ps 1 -- $EX $COMMON --epochs $e --strategy parameter_server --compress $c
  done
done
