#!/bin/sh
# Runs every test program in $BUILD/tests and the compile checks, then prints
# one closing line "N passed, N failed" and exits non-zero on any failure.
# A program that crashes, times out or prints no summary counts as a failure.
# RUNNER (e.g. "qemu-aarch64 -L /usr/aarch64-linux-gnu") prefixes every test
# program; with a RUNNER the host compile checks are skipped.
BUILD=${BUILD:-build}
RUNNER=${RUNNER:-}
TIMEOUT=${TEST_TIMEOUT:-600}
pass=0; fail=0
# TEST_JOBS programs at a time (default 1; make test-cross uses 2: qemu runs
# each program on one core). Outputs are read back in name order.
JOBS=${TEST_JOBS:-1}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-tests.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
running=0
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  ( timeout "$TIMEOUT" $RUNNER "$t" > "$tmp/$name.out" 2>&1; echo $? > "$tmp/$name.rc" ) &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait; running=0; fi
done
wait
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  out=$(cat "$tmp/$name.out" 2>/dev/null); rc=$(cat "$tmp/$name.rc" 2>/dev/null || echo 1)
  line=$(printf '%s\n' "$out" | grep -E '^[a-z_0-9]+: [0-9]+ passed, [0-9]+ failed' | tail -n 1)
  if [ -z "$line" ]; then
    printf '%s\n' "$out" | tail -n 30
    echo "$name: no summary (exit code $rc) -- counted as 1 failed"
    fail=$((fail + 1)); continue
  fi
  p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\1/')
  f=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\2/')
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
  if [ "$f" -ne 0 ]; then printf '%s\n' "$out" | grep -E 'FAIL|ERROR|error|Sanitizer' | head -n 40; fi
  echo "$line"
  pass=$((pass + p)); fail=$((fail + f))
done
# Host-only script checks (build configurations, install routes).
if [ -z "$SAN" ] && [ -z "$RUNNER" ] && [ "${SCRIPTS:-1}" = 1 ]; then
  for script in tests/compile_checks.sh tests/install_checks.sh tests/torch_parity.sh tests/example_checks.sh \
                tests/launch_checks.sh tests/mpi_checks.sh tests/multiworker_checks.sh; do
    name=$(basename "$script" .sh)
    out=$(CC="$CC" CXX="$CXX" BUILD="$BUILD" sh "$script" 2>&1); rc=$?
    line=$(printf '%s\n' "$out" | grep -E "^$name: [0-9]+ passed, [0-9]+ failed" | tail -n 1)
    if [ -z "$line" ]; then printf '%s\n' "$out" | tail -n 30; echo "$name: no summary"; fail=$((fail + 1)); continue; fi
    [ "$rc" -ne 0 ] && printf '%s\n' "$out" | grep -v '^ok' | head -n 60
    echo "$line"
    pass=$((pass + $(echo "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')))
    f=$(echo "$line" | sed -E 's/.*, ([0-9]+) failed.*/\1/')
    [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
    fail=$((fail + f))
  done
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
