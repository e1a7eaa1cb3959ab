#!/bin/sh
# tests/chaos.sh -- `make chaos` (issue 20): a scripted chaos run, bounded in time, outside
# `make test`. Two jobs on loopback under tools/dtrain-launch, each run once undisturbed (the
# baseline) and once while this script, at random moments (seeded: CHAOS_SEED), kills
# workers with SIGKILL and stops processes with SIGSTOP for a random while (shorter or
# longer than the network deadline) before SIGCONT:
#
#   A. synchronous: 3 workers of examples/05_multi_worker with --checkpoint-every 5 under
#      dtrain-launch --max-restarts: every failure (a kill, or a peer that waited past the
#      deadline for a stopped one) stops the job and starts every worker again from the last
#      checkpoint. Nothing lost: the job exits 0 and ends with the baseline's parameters, bit
#      for bit (params_checksum).
#   B. parameter servers: 3 workers and 2 servers of examples/06_parameter_server under
#      dtrain-launch --ps 2 --max-restarts: a dead worker is started again alone and rejoins
#      the servers under its rank, resuming the steps it had pushed. Nothing lost: the job
#      exits 0, every server applied at least the baseline's number of updates (at most one
#      more per kill: a worker killed between its pushes to the two servers repeats that push
#      on the server that had it), and worker 0's test accuracy is within CHAOS_ACC_TOL of the
#      baseline's.
#   C. B with --work-queue (dynamic data sharding on server 0): the job exits 0 and server 0's
#      queue says every batch was done, each exactly once.
#   D. B with --backup-workers 1 (synchronous rounds of 2 pushes on the servers): a stopped or
#      dead worker is a backup whose round closes without it; a dead one is started again and
#      rejoins. Nothing lost: the job exits 0, every server closed at least the job's rounds,
#      and worker 0's test accuracy is within CHAOS_ACC_TOL of an undisturbed run's.
#
# Prints each disturbance as it happens, one line per check, and "chaos: PASS" or
# "chaos: FAIL (...)"; exits non-zero on failure.
#
# Environment (all optional):
#   CHAOS_SECONDS  the whole run's budget in seconds, at most 600 [480]; each of the seven
#                  jobs (four disturbed, three baselines) gets a seventh of it (the launcher's
#                  --timeout), so the whole run ends within it
#   CHAOS_SEED     the random choices [the process id]
#   CHAOS_LIMIT    training rows of each job (--limit) [9000]; CHAOS_EPOCHS its epochs [16]
#                  (about 30 s of training each on a 2-core machine: time for the disturbances)
#   CHAOS_KILLS    SIGKILLs per job at most [4]; CHAOS_STOPS SIGSTOPs per job at most [3]
#   CHAOS_ACC_TOL  absolute tolerance of worker 0's test accuracy in B [0.04]
#   DTRAIN_TIMEOUT the deadline of every network call [4]
#   BUILD [build], LAUNCH [tools/dtrain-launch]
BUILD=${BUILD:-build}
L=${LAUNCH:-tools/dtrain-launch}
MW=$BUILD/examples/05_multi_worker
PS=$BUILD/examples/06_parameter_server
S=${CHAOS_SECONDS:-480}
SEED=${CHAOS_SEED:-$$}
LIMIT=${CHAOS_LIMIT:-9000}
EPOCHS=${CHAOS_EPOCHS:-16}
KILLS=${CHAOS_KILLS:-4}
STOPS=${CHAOS_STOPS:-3}
ACC_TOL=${CHAOS_ACC_TOL:-0.04}
export DTRAIN_TIMEOUT=${DTRAIN_TIMEOUT:-4}
T=$BUILD/chaos
fails=""
fail() { echo "FAIL $1"; fails="$fails${fails:+; }$1"; }
ok() { echo "ok $1"; }

case $S in ''|*[!0-9]*) echo "chaos: CHAOS_SECONDS must be a whole number of seconds"; exit 2;; esac
[ "$S" -gt 600 ] && S=600
if [ ! -x "$L" ] || [ ! -x "$MW" ] || [ ! -x "$PS" ]; then
  echo "chaos: FAIL (build $L, $MW and $PS first: make tools/dtrain-launch $MW $PS)"; exit 1
fi
rm -rf "$T"; mkdir -p "$T"
START=$(date +%s)
JOB_S=$((S / 7))
now() { echo $(( $(date +%s) - START )); }

# a linear congruential generator in the shell: rnd N sets R to 0..N-1
seed=$SEED
rnd() { seed=$(( (seed * 1103515245 + 12345) % 2147483648 )); R=$(( (seed / 65536) % $1 )); }

# pid_of LAUNCHER ROLE RANK: the launcher's child with that DTRAIN_ROLE and DTRAIN_RANK
pid_of() {
  for c in $(pgrep -P "$1" 2>/dev/null); do
    if tr '\0' '\n' < "/proc/$c/environ" 2>/dev/null | grep -qx "DTRAIN_ROLE=$2" &&
       tr '\0' '\n' < "/proc/$c/environ" 2>/dev/null | grep -qx "DTRAIN_RANK=$3"; then echo "$c"; return; fi
  done
}

# disturb LAUNCHER WORKERS SERVERS LOG: until the launcher exits, every 1-3 s, one of: kill -9
# of a random worker, SIGSTOP of a random process (servers too) for 1..2*DTRAIN_TIMEOUT s.
# Counts go into $T/kills and $T/stops.
disturb() {
  lp=$1; nw=$2; ns=$3; kills=0; stops=0
  # let the job start and save its first checkpoint
  sleep 2
  while kill -0 "$lp" 2>/dev/null; do
    rnd 20; sleep "$((R / 10 + 1)).$((R % 10))"
    kill -0 "$lp" 2>/dev/null || break
    rnd 2
    if [ $R = 0 ] && [ $kills -lt "$KILLS" ]; then
      rnd "$nw"; p=$(pid_of "$lp" worker $R)
      [ -n "$p" ] || continue
      kill -KILL "$p" 2>/dev/null && kills=$((kills + 1)) &&
        echo "  t=$(now)s kill -9 worker $R (pid $p)"
    elif [ $stops -lt "$STOPS" ]; then
      role=worker; n=$nw
      if [ "$ns" -gt 0 ]; then rnd 3; [ $R = 0 ] && { role=ps; n=$ns; }; fi
      rnd "$n"; rank=$R; p=$(pid_of "$lp" $role $rank)
      [ -n "$p" ] || continue
      rnd $((2 * DTRAIN_TIMEOUT)); d=$((R + 1))
      if kill -STOP "$p" 2>/dev/null; then
        stops=$((stops + 1))
        echo "  t=$(now)s SIGSTOP $role $rank (pid $p) for ${d}s (deadline ${DTRAIN_TIMEOUT}s)"
        sleep "$d"; kill -CONT "$p" 2>/dev/null; echo "  t=$(now)s SIGCONT $role $rank"
      fi
    elif [ $kills -ge "$KILLS" ]; then
      break # both budgets spent: let the job finish
    fi
  done
  echo $kills > "$T/kills"; echo $stops > "$T/stops"
}
sums() { sed -n 's/.*rank [0-9]*: final params_checksum=\([0-9a-f]*\).*/\1/p' "$1" | sort -u; }

echo "chaos: seed $SEED, budget ${S}s (${JOB_S}s a disturbed job), deadline ${DTRAIN_TIMEOUT}s, at most $KILLS kills and $STOPS stops a job"

# ---- A. synchronous, restarted from checkpoints ---------------------------------------------
ARGS="--limit $LIMIT --epochs $EPOCHS --quiet --batch 120"
echo "== A. multi_worker_mirrored: 3 workers, --checkpoint-every 5, --max-restarts $((KILLS + STOPS + 2))"
$L -n 3 --timeout "$JOB_S" -- $MW $ARGS > "$T/a_base.out" 2>&1; rc=$?
ref=$(sums "$T/a_base.out")
if [ $rc = 0 ] && [ -n "$ref" ] && [ "$(echo "$ref" | wc -l)" = 1 ]; then
  echo "  baseline: exit 0 in $(now)s, params_checksum $ref"
else fail "A baseline: exit $rc: $(tail -n 3 "$T/a_base.out" | tr '\n' ' ')"; fi
a0=$(date +%s)
$L -n 3 --grace 2 --max-restarts $((KILLS + STOPS + 2)) --timeout "$JOB_S" -- $MW $ARGS \
  --checkpoint "$T/a.safetensors" --checkpoint-every 5 > "$T/a.out" 2>&1 &
lp=$!
disturb $lp 3 0
wait $lp; rc=$?
k=$(cat "$T/kills"); st=$(cat "$T/stops"); restarts=$(grep -c 'to start them all again from their checkpoint' "$T/a.out")
got=$(sums "$T/a.out")
echo "  disturbed: exit $rc after $(( $(date +%s) - a0 ))s; $k kills, $st stops, $restarts restarts of the job"
if [ $rc = 0 ] && [ -n "$ref" ] && [ "$got" = "$ref" ]; then
  ok "A: the disturbed synchronous job ends bit for bit as the baseline ($got)"
else fail "A: exit $rc, params_checksum '$got' vs '$ref': $(grep -v 'dtrain error' "$T/a.out" | tail -n 4 | tr '\n' ' ')"; fi
if [ "$k" -gt 0 ] && [ "$restarts" -lt 1 ]; then fail "A: $k kills but no restart logged"; fi

# ---- B. parameter servers, dead workers started again alone ------------------------------------
PARGS="--limit $LIMIT --epochs $EPOCHS --batch 96"
echo "== B. parameter_server: 3 workers, 2 servers, --max-restarts $((KILLS + STOPS + 2)) (only the dead worker)"
updates() { sed -n "s/.*ps $2: done, \([0-9]*\) updates applied.*/\1/p" "$1" | tail -n 1; }
acc() { sed -n 's/.*worker 0: test accuracy \([0-9.]*\).*/\1/p' "$1" | tail -n 1; }
$L -n 3 --ps 2 --timeout "$JOB_S" -- $PS $PARGS > "$T/b_base.out" 2>&1; rc=$?
u0=$(updates "$T/b_base.out" 0); u1=$(updates "$T/b_base.out" 1); acc0=$(acc "$T/b_base.out")
if [ $rc = 0 ] && [ -n "$u0" ] && [ -n "$u1" ] && [ -n "$acc0" ]; then
  echo "  baseline: exit 0, servers applied $u0 and $u1 updates, worker 0 test accuracy $acc0"
else fail "B baseline: exit $rc: $(tail -n 3 "$T/b_base.out" | tr '\n' ' ')"; fi
b0=$(date +%s)
$L -n 3 --ps 2 --grace 2 --max-restarts $((KILLS + STOPS + 2)) --timeout "$JOB_S" -- $PS $PARGS > "$T/b.out" 2>&1 &
lp=$!
disturb $lp 3 2
wait $lp; rc=$?
k=$(cat "$T/kills"); st=$(cat "$T/stops")
v0=$(updates "$T/b.out" 0); v1=$(updates "$T/b.out" 1); acc1=$(acc "$T/b.out")
rejoins=$(grep -c 'rejoined at clock' "$T/b.out")
echo "  disturbed: exit $rc after $(( $(date +%s) - b0 ))s; $k kills, $st stops, $rejoins rejoins; servers applied ${v0:-?} and ${v1:-?} updates, worker 0 test accuracy ${acc1:-?}"
if [ $rc = 0 ] && [ -n "$v0" ] && [ -n "$v1" ] && [ -n "$u0" ] && [ -n "$u1" ] &&
   [ "$v0" -ge "$u0" ] && [ "$v1" -ge "$u1" ] && [ "$v0" -le $((u0 + k)) ] && [ "$v1" -le $((u1 + k)) ]; then
  ok "B: every server applied every step's update (${v0} >= ${u0}, ${v1} >= ${u1}; at most $k repeated)"
else fail "B: exit $rc, updates ${v0:-?}/${v1:-?} vs ${u0:-?}/${u1:-?} (kills $k): $(grep -v 'dtrain error' "$T/b.out" | tail -n 4 | tr '\n' ' ')"; fi
if [ -n "$acc0" ] && [ -n "$acc1" ] && awk -v a="$acc0" -v b="$acc1" -v t="$ACC_TOL" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; then
  ok "B: worker 0's test accuracy $acc1 within $ACC_TOL of the baseline's $acc0"
else fail "B: worker 0's test accuracy '${acc1:-none}' vs the baseline's '${acc0:-none}'"; fi
if [ "$k" -gt 0 ] && [ "$rejoins" -lt 1 ]; then fail "B: $k kills but no worker rejoined"; fi

# ---- C. parameter servers with the work queue: every batch trained on exactly once ---------------
echo "== C. parameter_server --work-queue: 3 workers, 2 servers, --max-restarts $((KILLS + STOPS + 2))"
c0=$(date +%s)
$L -n 3 --ps 2 --grace 2 --max-restarts $((KILLS + STOPS + 2)) --timeout "$JOB_S" -- $PS $PARGS --work-queue > "$T/c.out" 2>&1 &
lp=$!
disturb $lp 3 2
wait $lp; rc=$?
k=$(cat "$T/kills"); st=$(cat "$T/stops")
q=$(sed -n 's/.*ps 0: work queue: \([0-9]*\) of \([0-9]*\) batches done, \([0-9]*\) handed out, \([0-9]*\) given back.*/\1 \2 \3 \4/p' "$T/c.out" | tail -n 1)
echo "  disturbed: exit $rc after $(( $(date +%s) - c0 ))s; $k kills, $st stops; queue (done, items, handed out, given back): ${q:-none}"
set -- $q
if [ $rc = 0 ] && [ $# = 4 ] && [ "$1" = "$2" ] && [ "$3" -ge "$1" ]; then
  ok "C: every batch of the queue was trained on exactly once ($1 of $2; $4 given back by workers that died holding one)"
else fail "C: exit $rc, queue '${q:-none}': $(grep -v 'dtrain error' "$T/c.out" | tail -n 4 | tr '\n' ' ')"; fi

# ---- D. parameter servers in synchronous rounds with a backup worker -------------------------------
echo "== D. parameter_server --backup-workers 1: 3 workers, 2 servers, --max-restarts $((KILLS + STOPS + 2))"
rounds() { sed -n 's/.*synchronous rounds of [0-9]* pushes ([0-9]* backup), \([0-9]*\) rounds.*/\1/p' "$1" | head -n 1; }
$L -n 3 --ps 2 --timeout "$JOB_S" -- $PS $PARGS --backup-workers 1 > "$T/d_base.out" 2>&1; rc=$?
n0=$(rounds "$T/d_base.out"); w0=$(updates "$T/d_base.out" 0); w1=$(updates "$T/d_base.out" 1); dacc0=$(acc "$T/d_base.out")
if [ $rc = 0 ] && [ -n "$n0" ] && [ -n "$w0" ] && [ -n "$w1" ] && [ -n "$dacc0" ]; then
  echo "  baseline: exit 0, $n0 rounds wanted, servers closed $w0 and $w1, worker 0 test accuracy $dacc0"
else fail "D baseline: exit $rc: $(tail -n 3 "$T/d_base.out" | tr '\n' ' ')"; fi
d0=$(date +%s)
$L -n 3 --ps 2 --grace 2 --max-restarts $((KILLS + STOPS + 2)) --timeout "$JOB_S" -- $PS $PARGS --backup-workers 1 \
  > "$T/d.out" 2>&1 &
lp=$!
disturb $lp 3 2
wait $lp; rc=$?
k=$(cat "$T/kills"); st=$(cat "$T/stops")
x0=$(updates "$T/d.out" 0); x1=$(updates "$T/d.out" 1); dacc1=$(acc "$T/d.out")
rejoins=$(grep -c 'rejoined at clock' "$T/d.out")
drops=$(sed -n 's/.*worker [0-9]*: \([0-9]*\) of its [0-9]* pushes came after their round closed.*/\1/p' "$T/d.out" |
        awk '{ s += $1 } END { print s + 0 }')
echo "  disturbed: exit $rc after $(( $(date +%s) - d0 ))s; $k kills, $st stops, $rejoins rejoins; servers closed ${x0:-?} and ${x1:-?} rounds, $drops late pushes dropped (said by the workers that finished), worker 0 test accuracy ${dacc1:-?}"
if [ $rc = 0 ] && [ -n "$n0" ] && [ -n "$x0" ] && [ -n "$x1" ] && [ "$x0" -ge "$n0" ] && [ "$x1" -ge "$n0" ]; then
  ok "D: every server closed the job's rounds (${x0} and ${x1} >= ${n0})"
else fail "D: exit $rc, rounds ${x0:-?}/${x1:-?} vs ${n0:-?} wanted: $(grep -v 'dtrain error' "$T/d.out" | tail -n 4 | tr '\n' ' ')"; fi
if [ -n "$dacc0" ] && [ -n "$dacc1" ] && awk -v a="$dacc0" -v b="$dacc1" -v t="$ACC_TOL" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; then
  ok "D: worker 0's test accuracy $dacc1 within $ACC_TOL of the undisturbed rounds' $dacc0"
else fail "D: worker 0's test accuracy '${dacc1:-none}' vs the undisturbed rounds' '${dacc0:-none}'"; fi
if [ "$k" -gt 0 ] && [ "$rejoins" -lt 1 ]; then fail "D: $k kills but no worker rejoined"; fi

echo "chaos: $(now)s in all"
if [ -z "$fails" ]; then echo "chaos: PASS"; else echo "chaos: FAIL ($fails)"; exit 1; fi
