#!/bin/sh
# tests/mpi_checks.sh -- the MPI backend (DTRAIN_USE_MPI): builds
# tests/mpi_check.c with mpicc (C) and the implementation with mpicxx (C++),
# then runs it under mpirun with 2 and 3 processes over TCP (collectives
# against local references; multi_worker_mirrored on MPI == mirrored(W*N)), and
# examples/05 --servers (parameter servers on MPI), and where SimGrid is (smpicc, smpirun)
# examples/05 under SMPI on 2 simulated hosts, and with a parameter server on 5.
# Skips (0 passed, 0 failed, 1 skipped) when mpicc or mpirun is missing:
#   apt-get install libopenmpi-dev openmpi-bin
# Prints "mpi_checks: N passed, N failed, N skipped".
BUILD=${BUILD:-build}
name=mpi_checks
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
  echo "skip $name: mpicc/mpirun not found (apt-get install libopenmpi-dev openmpi-bin)"
  echo "$name: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
pass=0; fail=0; skipped=0
ok() { pass=$((pass + 1)); echo "ok $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
out=$BUILD/mpi
mkdir -p "$out"
WARN="-Wall -Wextra -Wpedantic -Werror"

if mpicc -std=c11 $WARN -O1 -DDTRAIN_USE_MPI -I. tests/mpi_check.c -o "$out/mpi_check" -lm -lpthread 2>"$out/cc.log"; then
  ok "mpicc -DDTRAIN_USE_MPI builds tests/mpi_check.c"
else
  cat "$out/cc.log"; bad "mpicc -DDTRAIN_USE_MPI builds tests/mpi_check.c"
fi
if mpicc -std=c11 $WARN -O1 -DDTRAIN_USE_MPI -Isrc -c src/dt_comm_mpi.c -o "$out/dt_comm_mpi.o" 2>"$out/alone.log"; then
  ok "src/dt_comm_mpi.c compiles alone with mpicc -DDTRAIN_USE_MPI"
else
  cat "$out/alone.log"; bad "src/dt_comm_mpi.c compiles alone with mpicc -DDTRAIN_USE_MPI"
fi
if command -v mpicxx >/dev/null 2>&1; then
  if printf '#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\n' > "$out/impl.cpp" &&
     mpicxx -std=c++17 $WARN -O0 -DDTRAIN_USE_MPI -I. -c "$out/impl.cpp" -o "$out/impl.o" 2>"$out/cxx.log"; then
    ok "mpicxx -DDTRAIN_USE_MPI compiles the implementation as C++17"
  else
    cat "$out/cxx.log"; bad "mpicxx -DDTRAIN_USE_MPI compiles the implementation as C++17"
  fi
else
  echo "skip mpicxx-c++17: no mpicxx"; skipped=$((skipped + 1))
fi

# mpirun as root in a container needs these; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm_rsh_agent=
if [ -x "$out/mpi_check" ]; then
  for n in 2 3; do
    log=$(timeout 60 mpirun -n $n --oversubscribe --bind-to none --mca btl tcp,self "$out/mpi_check" 2>&1); rc=$?
    line=$(printf '%s\n' "$log" | grep -E '^mpi_check: [0-9]+ passed, [0-9]+ failed' | tail -n 1)
    f=$(echo "$line" | sed -n -E 's/.*: [0-9]+ passed, ([0-9]+) failed.*/\1/p')
    if [ "$rc" -eq 0 ] && [ -n "$line" ] && [ "$f" = 0 ]; then
      ok "mpirun -n $n: $line"
    else
      printf '%s\n' "$log" | tail -n 30
      bad "mpirun -n $n (exit $rc): ${line:-no summary}"
    fi
  done
fi
# examples/05 --servers M (asynchronous parameter servers on MPI): one worker is plain
# training (the servers apply each gradient as one optimizer step: the weights of 05 on one
# rank, bit for bit, with 1 or 2 servers each holding a slice), and with 2 workers the server
# applies every push of every step (none lost, none twice).
if mpicc -std=c11 $WARN -O1 -DDTRAIN_USE_MPI -I. examples/05_multi_worker.c -o "$out/mw" -lm -lpthread 2>"$out/mw.log"; then
  MPIRUN="timeout 120 mpirun --oversubscribe --bind-to none --mca btl tcp,self"
  A="--data data/fashion-mnist --limit 1280 --epochs 2 --eval-limit 300"
  one=$($MPIRUN -n 1 "$out/mw" $A --batch 32 2>&1 | sed -n 's/^rank 0: final params_checksum=\([0-9a-f]*\).*/\1/p')
  for sv in 1 2; do
    got=$($MPIRUN -n $((sv + 1)) "$out/mw" $A --batch 32 --servers $sv 2>&1 | sed -n 's/^rank 0: final params_checksum=\([0-9a-f]*\).*/\1/p')
    if [ -n "$one" ] && [ "$got" = "$one" ]; then
      ok "05 --servers $sv with one worker: the weights of 05 on one rank ($got)"
    else
      bad "05 --servers $sv with one worker: checksum '$got', 05 on one rank '$one'"
    fi
  done
  log=$($MPIRUN -n 3 "$out/mw" $A --batch 64 --servers 1 2>&1)
  pushes=$(printf '%s\n' "$log" | sed -n 's/^rank 0: server: \([0-9]*\) pushes applied$/\1/p')
  acc=$(printf '%s\n' "$log" | sed -n 's/^rank 0: final .*test_accuracy=\([0-9.]*\)$/\1/p')
  # 1280 samples in 2 shards of 640, 32 rows a worker: 20 steps an epoch each, 2 epochs
  if [ "$pushes" = 80 ] && [ -n "$acc" ] && awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }'; then
    ok "05 --servers 1 with 2 workers: the server applied all 80 pushes (test accuracy $acc)"
  else
    printf '%s\n' "$log" | tail -n 8; bad "05 --servers 1 with 2 workers: ${pushes:-no} pushes of 80, accuracy ${acc:-none}"
  fi
  err=$($MPIRUN -n 2 "$out/mw" $A --servers 2 2>&1)
  if printf '%s\n' "$err" | grep -q 'error: --servers 2 leaves no worker among 2 ranks'; then
    ok "05 --servers 2 on 2 ranks is refused, named"
  else
    printf '%s\n' "$err" | tail -n 4; bad "05 --servers 2 on 2 ranks: no clear refusal"
  fi
else
  cat "$out/mw.log"; bad "mpicc -DDTRAIN_USE_MPI builds examples/05_multi_worker.c"
fi
# Under SimGrid's SMPI (libsimgrid-dev: smpicc, smpirun; skipped without): examples/05 on
# the MPI backend as 2 simulated hosts of bench/platforms/classroom_lan.xml. Both ranks end
# with the same weights, and what it reports is simulated time: every step sends the 940 KB
# gradient over a 100 Mbit/s port (at least 75 ms), so 64 samples a step cannot go faster
# than about 850 samples/s however fast this machine ran it (unsimulated: tens of thousands);
# rank 0's split of a step says the same: its all-reduce (comm_ms) at least 70 ms of it.
if command -v smpicc >/dev/null 2>&1 && command -v smpirun >/dev/null 2>&1; then
  if smpicc -std=c11 -O2 -DSMPI_NO_OVERRIDE_MALLOC -DDTRAIN_USE_MPI -I. examples/05_multi_worker.c -o "$out/mw_smpi" \
       -lm -lpthread > "$out/smpicc.log" 2>&1; then
    printf 'laptop-0\nlaptop-1\n' > "$out/smpi_hosts"
    timeout 300 smpirun -np 2 -platform bench/platforms/classroom_lan.xml -hostfile "$out/smpi_hosts" \
      --cfg=smpi/host-speed:1Gf --log=root.thres:critical "$out/mw_smpi" --data data/fashion-mnist --limit 640 \
      --epochs 1 --batch 64 > "$out/smpi.out" 2>&1
    rc=$?
    sums=$(sed -n 's/.*rank [0-9]*: final params_checksum=\([0-9a-f]*\).*/\1/p' "$out/smpi.out" | sort -u | wc -l)
    sps=$(sed -n 's/^epoch 1: .*, \([0-9.]*\) samples\/s (all workers)$/\1/p' "$out/smpi.out")
    split=$(sed -n 's/^rank 0: final .* step_ms=\([0-9.]*\) compute_ms=[0-9.]* comm_ms=\([0-9.]*\).*/\1 \2/p' "$out/smpi.out")
    if [ "$rc" -eq 0 ] && [ "$sums" = 1 ] && [ -n "$sps" ] && awk -v s="$sps" 'BEGIN { exit !(s > 0 && s < 1000) }' &&
       [ -n "$split" ] && echo "$split" | awk '{ exit !($2 >= 70 && $1 >= $2) }'; then
      ok "SMPI: 05 on 2 simulated hosts over 100 Mbit/s agrees across ranks, in simulated time ($sps samples/s; step, all-reduce ms: $split)"
    else
      tail -n 8 "$out/smpi.out"; bad "SMPI run (exit $rc, $sums checksums, ${sps:-no} samples/s, step and all-reduce ms: ${split:-none})"
    fi
    # The parameter server's link is what the simulation must see: 4 workers + 1 server on
    # the datacenter platform, where each push brings 940 KB in through the server's 10 Gbit/s
    # port (0.75 ms; the pulls go out at the same time, full duplex): at most 32 rows / 0.75 ms
    # = 42.7k samples/s however many workers. Workers that had the server to themselves would
    # run 4 x 32 rows / (0.7-1.3 ms of compute + 1.5 ms of their own push and pull) = 46-58k.
    for i in 64 0 1 2 3; do echo "node-$i"; done > "$out/smpi_hosts_ps"
    timeout 300 smpirun -np 5 -platform bench/platforms/datacenter_64.xml -hostfile "$out/smpi_hosts_ps" \
      --cfg=smpi/host-speed:1Gf --cfg=smpi/lat-factor:0:1 --cfg=smpi/bw-factor:0:1 --log=root.thres:critical \
      "$out/mw_smpi" --servers 1 --data data/fashion-mnist --limit 1024 --epochs 2 --batch 128 > "$out/smpi_ps.out" 2>&1
    rc=$?
    sps=$(sed -n 's/^parameter servers: last epoch \([0-9.]*\) samples\/s (all workers).*/\1/p' "$out/smpi_ps.out")
    if [ "$rc" -eq 0 ] && [ -n "$sps" ] && awk -v s="$sps" 'BEGIN { exit !(s > 1000 && s < 42700) }' &&
       grep -q '^rank 0: server: 64 pushes applied$' "$out/smpi_ps.out"; then
      ok "SMPI: 05 --servers 1, 4 workers on 10 Gbit/s: bound by the server's port ($sps samples/s, all 64 pushes)"
    else
      tail -n 8 "$out/smpi_ps.out"; bad "SMPI --servers 1 (exit $rc, ${sps:-no} samples/s: not the server's bound)"
    fi
    # The compute from a measurement (make simulate's SIM_COMPUTE=planner): under
    # smpi/simulate-computation:no a step spends exactly --sim-compute-ms + --sim-update-ms
    # of simulated time, however busy this machine is (one worker: no communication), and
    # the weights are those of the run that counted the real compute; without that option
    # the flags are refused (the real compute would count as well), named.
    timeout 300 smpirun -np 1 -platform bench/platforms/datacenter_64.xml -hostfile "$out/smpi_hosts_ps" \
      --cfg=smpi/host-speed:1Gf --cfg=smpi/simulate-computation:no --log=root.thres:critical "$out/mw_smpi" \
      --data data/fashion-mnist --limit 640 --epochs 2 --batch 64 --sim-compute-ms 2 --sim-update-ms 0.5 \
      > "$out/smpi_sim.out" 2>&1
    rc=$?
    split=$(sed -n 's/^rank 0: final .* step_ms=\([0-9.]*\) compute_ms=\([0-9.]*\) comm_ms=.*/\1 \2/p' "$out/smpi_sim.out")
    sum_sim=$(sed -n 's/^rank 0: final params_checksum=\([0-9a-f]*\).*/\1/p' "$out/smpi_sim.out")
    timeout 300 smpirun -np 1 -platform bench/platforms/datacenter_64.xml -hostfile "$out/smpi_hosts_ps" \
      --cfg=smpi/host-speed:1Gf --log=root.thres:critical "$out/mw_smpi" \
      --data data/fashion-mnist --limit 640 --epochs 2 --batch 64 > "$out/smpi_real.out" 2>&1
    sum_real=$(sed -n 's/^rank 0: final params_checksum=\([0-9a-f]*\).*/\1/p' "$out/smpi_real.out")
    timeout 300 smpirun -np 1 -platform bench/platforms/datacenter_64.xml -hostfile "$out/smpi_hosts_ps" \
      --cfg=smpi/host-speed:1Gf --log=root.thres:critical "$out/mw_smpi" \
      --data data/fashion-mnist --limit 640 --epochs 1 --sim-compute-ms 2 > "$out/smpi_sim_bad.out" 2>&1
    rc_bad=$?
    if [ "$rc" -eq 0 ] && [ -n "$split" ] && echo "$split" | awk '{ exit !($1 > 2.499 && $1 < 2.51 && $2 > 2.499 && $2 < 2.51) }' &&
       [ -n "$sum_sim" ] && [ "$sum_sim" = "$sum_real" ] && [ "$rc_bad" -eq 2 ] &&
       grep -q 'need smpirun --cfg=smpi/simulate-computation:no' "$out/smpi_sim_bad.out"; then
      ok "SMPI: --sim-compute-ms 2 --sim-update-ms 0.5: a step of 2.5 simulated ms (step, compute: $split), the same weights; refused without simulate-computation:no"
    else
      tail -n 4 "$out/smpi_sim.out" "$out/smpi_sim_bad.out"
      bad "SMPI --sim-compute-ms (exit $rc, step and compute ms: ${split:-none}, weights $sum_sim vs $sum_real, unsimulated exit $rc_bad)"
    fi
  else
    tail -n 20 "$out/smpicc.log"; bad "smpicc builds examples/05_multi_worker.c"
  fi
else
  echo "skip smpi: no smpicc/smpirun (apt-get install libsimgrid-dev)"; skipped=$((skipped + 1))
fi
echo "$name: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
