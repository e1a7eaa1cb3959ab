#!/bin/sh
# tests/mpi_checks.sh -- the MPI backend (DTRAIN_USE_MPI): builds
# tests/mpi_check.c with mpicc (C) and the implementation with mpicxx (C++),
# then runs it under mpirun with 2 and 3 processes over TCP (collectives
# against local references; multi_worker_mirrored on MPI == mirrored(W*N)).
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
echo "$name: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
