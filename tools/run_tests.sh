#!/bin/sh
# Runs every test program in $BUILD/tests and the script checks, then prints
# one line per skipped item with its reason and the closing line
# "N passed, N failed, N skipped"; exits non-zero on any failure.
# Each program ends with "name: N passed, N failed[, N skipped]" (the skipped
# part is optional, so older programs still parse) and gives each skip's
# reason on a line "skip WHAT: why". A program that crashes, times out, exits
# non-zero or prints no summary counts as a failure; so does one that reports
# nothing at all (0 passed, 0 failed, 0 skipped). A skip never offsets a
# failure: the counts are added, never netted.
# RUNNER (e.g. "qemu-aarch64 -L /usr/aarch64-linux-gnu") prefixes every test
# program; with a RUNNER the host compile checks are skipped.
BUILD=${BUILD:-build}
RUNNER=${RUNNER:-}
TIMEOUT=${TEST_TIMEOUT:-600}
pass=0; fail=0; skip=0
# TEST_JOBS programs at a time (default 1; make test-cross uses 2: qemu runs
# each program on one core). Outputs are read back in name order.
JOBS=${TEST_JOBS:-1}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-tests.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
: > "$tmp/skips"
running=0
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  ( timeout "$TIMEOUT" $RUNNER "$t" > "$tmp/$name.out" 2>&1; echo $? > "$tmp/$name.rc" ) &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait; running=0; fi
done
wait

# tally NAME OUTPUT RC SUMMARY-REGEX SHOW: reads the summary line and the
# skip reasons out of one program's (or script's) output and adds them up;
# SHOW=1 prints the FAIL lines of a failed program.
tally() {
  t_name=$1; t_out=$2; t_rc=$3
  line=$(printf '%s\n' "$t_out" | grep -E "$4" | tail -n 1)
  if [ -z "$line" ]; then
    printf '%s\n' "$t_out" | tail -n 30
    echo "$t_name: no summary (exit code $t_rc) -- counted as 1 failed"
    fail=$((fail + 1)); return
  fi
  p=$(echo "$line" | sed -E 's/^[^:]*: ([0-9]+) passed, ([0-9]+) failed.*/\1/')
  f=$(echo "$line" | sed -E 's/^[^:]*: ([0-9]+) passed, ([0-9]+) failed.*/\2/')
  s=$(echo "$line" | sed -n -E 's/^[^:]*: [0-9]+ passed, [0-9]+ failed, ([0-9]+) skipped.*/\1/p')
  s=${s:-0}
  if [ "$f" -ne 0 ] || [ "$t_rc" -ne 0 ]; then
    [ "$5" = 1 ] && printf '%s\n' "$t_out" | grep -E 'FAIL|ERROR|error|Sanitizer' | head -n 40
  fi
  echo "$line"
  if [ "$t_rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    f=1; echo "$t_name: exit code $t_rc after its summary -- counted as 1 failed"
  fi
  if [ "$p" -eq 0 ] && [ "$f" -eq 0 ] && [ "$s" -eq 0 ]; then
    f=1; echo "$t_name: reported no test at all -- counted as 1 failed"
  fi
  # Each skip's reason, as the program gave it; a count without reasons
  # (an older program) still shows up.
  reasons=$(printf '%s\n' "$t_out" | grep -E '^skip [^:]+: ' | sed "s/^skip /$t_name: skipped /")
  if [ -n "$reasons" ]; then printf '%s\n' "$reasons" >> "$tmp/skips"; fi
  given=$(printf '%s' "$reasons" | grep -c '' )
  if [ "$s" -gt "$given" ]; then echo "$t_name: $((s - given)) skipped without a reason given" >> "$tmp/skips"; fi
  pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
}

for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  out=$(cat "$tmp/$name.out" 2>/dev/null); rc=$(cat "$tmp/$name.rc" 2>/dev/null || echo 1)
  tally "$name" "$out" "$rc" '^[a-z_0-9]+: [0-9]+ passed, [0-9]+ failed' 1
done
# Host-only script checks (build configurations, install routes).
if [ -z "$SAN" ] && [ -z "$RUNNER" ] && [ "${SCRIPTS:-1}" = 1 ]; then
  for script in tests/compile_checks.sh tests/install_checks.sh tests/torch_parity.sh tests/example_checks.sh \
                tests/launch_checks.sh tests/mpi_checks.sh tests/multiworker_checks.sh; do
    name=$(basename "$script" .sh)
    out=$(CC="$CC" CXX="$CXX" BUILD="$BUILD" sh "$script" 2>&1); rc=$?
    [ "$rc" -ne 0 ] && printf '%s\n' "$out" | grep -v '^ok' | head -n 60
    tally "$name" "$out" "$rc" "^$name: [0-9]+ passed, [0-9]+ failed" 0
  done
fi
cat "$tmp/skips"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
