#!/bin/sh
# run_backup.sh -- backup workers (issue 20's goal): mirrored(4) with one
# replica slowed 4x and --backup-workers 1 against mirrored(4) undisturbed,
# side by side on this machine, from examples/04_sync_vs_async's table.
#
#   sh bench/run_backup.sh [path/to/04_sync_vs_async]     (make bench runs it)
#
# Each round runs the example twice: without a straggler (the undisturbed
# mirrored(4) row) and with --straggler 1:4 (the mirrored(4) row: plain
# synchronous steps waiting for the straggler; the "1 backup" row: steps that
# close with the first 3 gradients). Reported: samples/s of each (rows trained
# on: a backup step aggregates 3 gradients of batch/3 rows, a global batch)
# as the best of BENCH_ROUNDS rounds (default 3; the machine may be shared:
# the best round is the least disturbed), their ratio to the undisturbed
# run, and the test accuracy after the same number of steps. The goal:
# backup + straggler >= 0.9x undisturbed samples/s, accuracy within 0.5 points.
# Timings only: nothing is asserted.
BIN=${1:-build/examples/04_sync_vs_async}
ROUNDS=${BENCH_ROUNDS:-3}
STEPS=${BENCH_STEPS:-600}
if [ ! -x "$BIN" ]; then
  echo "run_backup.sh: $BIN not built (make bench builds it)"
  exit 1
fi
echo "== backup workers: 04_sync_vs_async --replicas 4 --steps $STEPS --batch 256, best of $ROUNDS rounds"
echo "   CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //'), $(nproc 2>/dev/null || echo '?') cores"
best() { # FILE ROWNAME -> "samples/s acc" of the row (its first numbers)
  awk -v row="$2" 'index($0, row) == 1 { n = split(substr($0, length(row) + 1), f, " "); print f[1], f[4]; exit }' "$1"
}
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
u_best=0; s_best=0; b_best=0; u_acc=; s_acc=; b_acc=; drops=
r=1
while [ "$r" -le "$ROUNDS" ]; do
  "$BIN" --replicas 4 --steps "$STEPS" --backup-workers 1 > "$tmp/u" || exit 1
  "$BIN" --replicas 4 --steps "$STEPS" --backup-workers 1 --straggler 1:4 > "$tmp/s" || exit 1
  set -- $(best "$tmp/u" "mirrored(4) ")
  u=$1; u_acc=$2
  set -- $(best "$tmp/s" "mirrored(4) ")
  s=$1; s_acc=$2
  set -- $(best "$tmp/s" "mirrored(4), 1 backup")
  b=$1; b_acc="$b_acc $2"
  drops=$(grep -m1 'gradients used' "$tmp/s" | sed 's/.*replica: //')
  echo "   round $r: undisturbed $u, straggler $s, straggler + 1 backup $b samples/s (used (dropped) per replica: $drops)"
  u_best=$(awk -v a="$u_best" -v b="$u" 'BEGIN { print (b > a ? b : a) }')
  s_best=$(awk -v a="$s_best" -v b="$s" 'BEGIN { print (b > a ? b : a) }')
  b_best=$(awk -v a="$b_best" -v b="$b" 'BEGIN { print (b > a ? b : a) }')
  r=$((r + 1))
done
awk -v u="$u_best" -v s="$s_best" -v b="$b_best" -v ua="$u_acc" -v sa="$s_acc" -v ba="$b_acc" 'BEGIN {
  n = split(ba, acc, " "); lo = 1; hi = 0
  for (i = 1; i <= n; i++) { if (acc[i] < lo) lo = acc[i]; if (acc[i] > hi) hi = acc[i] }
  printf "   %-32s %10s %8s %s\n", "", "samples/s", "ratio", "test acc"
  printf "   %-32s %10.0f %8s %.4f\n", "mirrored(4) undisturbed", u, "1.00x", ua
  printf "   %-32s %10.0f %7.2fx %.4f\n", "mirrored(4), replica 1 4x slow", s, s / u, sa
  printf "   %-32s %10.0f %7.2fx %.4f..%.4f (%+.2f..%+.2f points)\n", "  + 1 backup worker", b, b / u, lo, hi,
         100 * (lo - ua), 100 * (hi - ua)
}'
