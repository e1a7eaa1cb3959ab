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
# TEST_JOBS programs and scripts at a time (default 2: most of the suite's
# time is spent waiting on sockets, deadlines and child processes, not on a
# core; qemu runs each program on one core). A pool, not batches: a slow
# program does not hold the others back. The script checks (host builds
# only) go first, being the longest. Outputs are read back in name order,
# and each item's seconds are kept for the closing "slowest" line.
JOBS=${TEST_JOBS:-2}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-tests.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
: > "$tmp/skips"
SCRIPT_LIST="tests/compile_checks.sh tests/multiworker_checks.sh tests/example_checks.sh tests/install_checks.sh
             tests/torch_parity.sh tests/torch_interop.sh tests/board_checks.sh tests/launch_checks.sh tests/mpi_checks.sh"
run_scripts=0
if [ -z "$SAN" ] && [ -z "$RUNNER" ] && [ "${SCRIPTS:-1}" = 1 ]; then run_scripts=1; fi
{
  if [ "$run_scripts" = 1 ]; then for script in $SCRIPT_LIST; do echo "script $script"; done; fi
  for t in "$BUILD"/tests/test_*; do [ -x "$t" ] && echo "prog $t"; done
} > "$tmp/items"
export BUILD RUNNER TIMEOUT CC CXX tmp
# one item: its output, exit code and seconds in $tmp/NAME.{out,rc,secs}
xargs -P "$JOBS" -L 1 sh -c '
  kind=$0; item=$1
  case $kind in
    script) name=$(basename "$item" .sh)
            start=$(date +%s.%N)
            CC="$CC" CXX="$CXX" BUILD="$BUILD" sh "$item" > "$tmp/$name.out" 2>&1; echo $? > "$tmp/$name.rc" ;;
    *)      name=$(basename "$item")
            start=$(date +%s.%N)
            timeout "$TIMEOUT" $RUNNER "$item" > "$tmp/$name.out" 2>&1; echo $? > "$tmp/$name.rc" ;;
  esac
  echo "$start $(date +%s.%N)" | awk "{ printf \"%.1f\n\", \$2 - \$1 }" > "$tmp/$name.secs"
' < "$tmp/items"

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
# Host-only script checks (build configurations, install routes, examples,
# launcher, MPI, multi-worker runs).
if [ "$run_scripts" = 1 ]; then
  for script in $SCRIPT_LIST; do
    name=$(basename "$script" .sh)
    out=$(cat "$tmp/$name.out" 2>/dev/null); rc=$(cat "$tmp/$name.rc" 2>/dev/null || echo 1)
    [ "$rc" -ne 0 ] && printf '%s\n' "$out" | grep -v '^ok' | head -n 60
    tally "$name" "$out" "$rc" "^$name: [0-9]+ passed, [0-9]+ failed" 0
  done
fi
# The slowest items, to see where the suite's time goes (never a verdict).
for f in "$tmp"/*.secs; do [ -f "$f" ] && echo "$(cat "$f") $(basename "$f" .secs)"; done | sort -rn | head -n 6 |
  awk '{ s = s sep $2 " " $1 " s"; sep = ", " } END { if (s != "") print "slowest: " s }'
cat "$tmp/skips"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
