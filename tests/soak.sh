#!/bin/sh
# tests/soak.sh -- `make soak`: a parameter-server job under hostile conditions (issue 17).
#
# 3 workers and 2 parameter servers of examples/06_parameter_server on loopback under
# tools/dtrain-launch, with a token (DTRAIN_TOKEN), run twice: undisturbed (the baseline),
# then while this script
#   - kills worker 1 (SIGKILL) and starts it again by hand with the same DTRAIN_* environment
#     and arguments (it must rejoin the servers under its rank and finish its remaining steps),
#   - opens silent connections and sends random bytes to every port of the job (servers and
#     workers), in rounds,
#   - stops worker 2 (SIGSTOP) for a few seconds and continues it (SIGCONT),
# and samples the servers' open descriptors (/proc/PID/fd) and resident memory (VmRSS).
# It passes when the disturbed job finishes (the launcher exits 0), the restarted worker 1
# rejoined and finished (exit 0), worker 0's final loss and
# test accuracy are within tolerance of the baseline's, and the servers' descriptors and
# memory do not grow (samples before the disturbances against samples after them).
# Prints one line per check and "soak: PASS" or "soak: FAIL (...)"; exits non-zero on failure.
# Not part of `make test` (minutes, and timing-dependent by nature).
#
# Environment (all optional):
#   SOAK_SECONDS   the whole soak's budget in seconds, at most 600 [600]; each training run
#                  is sized to about 30% of it (at least 30 s of training is asked for)
#   SOAK_LIMIT     training rows (--limit) [12000]
#   SOAK_STOP_S    how long worker 2 stays stopped each time [5]; SOAK_STOPS how many times
#                  [1 per 60 s of the baseline, at least 1]
#   SOAK_ROUNDS    rounds of junk connections [enough to fill 40% of the baseline's time, at
#                  least 3]; SOAK_JUNK_N connections of each kind per port and round [4];
#                  SOAK_HOLD_S seconds each round holds them open [4]
#   SOAK_LOSS_TOL  relative tolerance of worker 0's final loss [0.25]
#   SOAK_ACC_TOL   absolute tolerance of worker 0's test accuracy [0.04]
#   SOAK_FD_TOL    descriptors a server may gain [2]
#   SOAK_RSS_TOL   relative growth of a server's RSS allowed [0.10], plus SOAK_RSS_KB [8192] kB
#   DTRAIN_TIMEOUT the deadline of every network call [20]
#   BUILD [build], LAUNCH [tools/dtrain-launch], SOAK_PROGRAM [$BUILD/examples/06_parameter_server]
BUILD=${BUILD:-build}
L=${LAUNCH:-tools/dtrain-launch}
EX=${SOAK_PROGRAM:-$BUILD/examples/06_parameter_server}
S=${SOAK_SECONDS:-600}
LIMIT=${SOAK_LIMIT:-12000}
STOP_S=${SOAK_STOP_S:-5}
STOPS=${SOAK_STOPS:-}
ROUNDS=${SOAK_ROUNDS:-}
JUNK_N=${SOAK_JUNK_N:-4}
HOLD_S=${SOAK_HOLD_S:-4}
LOSS_TOL=${SOAK_LOSS_TOL:-0.25}
ACC_TOL=${SOAK_ACC_TOL:-0.04}
FD_TOL=${SOAK_FD_TOL:-2}
RSS_TOL=${SOAK_RSS_TOL:-0.10}
RSS_KB=${SOAK_RSS_KB:-8192}
export DTRAIN_TIMEOUT=${DTRAIN_TIMEOUT:-20}
T=$BUILD/soak
fails=""
fail() { echo "FAIL $1"; fails="$fails${fails:+; }$1"; }
ok() { echo "ok $1"; }
note() { echo "note: $1"; }

case $S in ''|*[!0-9]*) echo "soak: SOAK_SECONDS must be a whole number of seconds"; exit 2;; esac
[ "$S" -gt 600 ] && S=600
if [ ! -x "$L" ] || [ ! -x "$EX" ]; then
  echo "soak: FAIL (build $L and $EX first: make tools/dtrain-launch $EX)"; exit 1
fi
if [ ! -d /proc/self/fd ]; then echo "soak: SKIP (needs Linux /proc)"; exit 0; fi
rm -rf "$T"; mkdir -p "$T"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( S - $(date +%s) + T0 )); }
ARGS="--batch 60 --limit $LIMIT --seed 1"
export DTRAIN_TOKEN=${DTRAIN_TOKEN:-soak-$(date +%s)-$$}

# ---- helpers -----------------------------------------------------------------------------------
# the launcher's child with DTRAIN_ROLE=$2 and DTRAIN_RANK=$3 (launcher pid $1), or nothing
kids() {
  if command -v pgrep >/dev/null 2>&1; then pgrep -P "$1"; return; fi
  for st in /proc/[0-9]*/stat; do
    [ "$(sed 's/^.*) //' "$st" 2>/dev/null | awk '{print $2}')" = "$1" ] && { d=${st%/stat}; echo "${d#/proc/}"; }
  done
}
child() {
  for c in $(kids "$1"); do
    env=$(tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null)
    echo "$env" | grep -qx "DTRAIN_ROLE=$2" && echo "$env" | grep -qx "DTRAIN_RANK=$3" && { echo "$c"; return; }
  done
}
# sleep until $1 seconds after the run started at $2 (a date +%s)
until_t() { w=$(( $2 + $1 - $(date +%s) )); [ $w -gt 0 ] && sleep $w; return 0; }
# worker 0's "mean loss" and "test accuracy" from a run's output
loss_of() { sed -n 's/^\[worker 0\] worker 0: .* mean loss \([0-9.]*\),.*/\1/p' "$1" | tail -n 1; }
acc_of() { sed -n 's/^\[worker 0\] worker 0: test accuracy \([0-9.]*\).*/\1/p' "$1" | tail -n 1; }

# ---- 1. calibration: 2 epochs, to size the runs: its wall time less worker 0's training time
#         (steps x rows / samples per second) is the start-up (mostly loading the data) ---------
now() { date +%s.%N 2>/dev/null | grep -v N || date +%s; }
c0=$(now)
timeout 180 "$L" -n 3 --ps 2 -- "$EX" $ARGS --epochs 2 >"$T/calib.out" 2>&1; rc=$?
cal=$(awk -v a=$c0 -v b=$(now) 'BEGIN { print b - a }')
line=$(grep '^\[worker 0\] worker 0: [0-9]* steps' "$T/calib.out")
if [ $rc -ne 0 ] || [ -z "$line" ]; then
  echo "soak: FAIL (the calibration run failed, exit $rc)"; tail -n 20 "$T/calib.out"; exit 1
fi
D=$(( S * 3 / 10 )); [ $D -lt 30 ] && D=30
# "worker 0: 266 steps, mean loss 0.61, 4000 samples/s, ..." at 20 rows a step
E=$(echo "$line" | awk -v c="$cal" -v d=$D '{ for (i = 1; i <= NF; i++) { if ($(i+1) == "steps,") st = $i; if ($(i+1) == "samples/s,") r = $i }
  tr = r > 0 ? st * 20 / r : c / 2; if (tr > c) tr = c; up = c - tr; pe = tr / 2; if (pe < 0.01) pe = 0.01
  e = int(0.8 * (d - up) / pe); if (e < 3) e = 3; if (e > 5000) e = 5000; printf "%d", e }')
echo "soak: 2 epochs of $LIMIT rows took $cal s in all: $E epochs a run (about ${D} s), budget ${S} s"

# ---- 2. the baseline --------------------------------------------------------------------------------
b0=$(date +%s)
# at most 3 D, and leave the disturbed run 1.2 times the baseline's time plus the stop
tb=$(( ($(left) - STOP_S - 10) * 10 / 22 )); [ $tb -gt $(( 3 * D )) ] && tb=$(( 3 * D )); [ $tb -lt 10 ] && tb=10
timeout $tb "$L" -n 3 --ps 2 -- "$EX" $ARGS --epochs $E >"$T/base.out" 2>&1; rc=$?
B=$(( $(date +%s) - b0 )); [ $B -lt 10 ] && B=10
loss_b=$(loss_of "$T/base.out"); acc_b=$(acc_of "$T/base.out")
if [ $rc -eq 124 ]; then
  echo "soak: FAIL (the undisturbed run of $E epochs took more than its $tb s: this machine is busier than the calibration said; raise SOAK_SECONDS or lower SOAK_LIMIT)"; exit 1
elif [ $rc -ne 0 ] || [ -z "$loss_b" ] || [ -z "$acc_b" ]; then
  echo "soak: FAIL (the undisturbed run failed, exit $rc)"; tail -n 20 "$T/base.out"; exit 1
fi
echo "soak: baseline ${B} s: worker 0 loss $loss_b, test accuracy $acc_b"

# ---- 3. the disturbed run ---------------------------------------------------------------------------
[ -n "$ROUNDS" ] || ROUNDS=$(( B * 4 / 10 / (HOLD_S + 1) ))
[ "$ROUNDS" -ge 1 ] 2>/dev/null || ROUNDS=3
[ -n "$SOAK_ROUNDS" ] || { [ $ROUNDS -lt 3 ] && ROUNDS=3; }
[ -n "$STOPS" ] || STOPS=$(( B / 60 ))
[ "$STOPS" -ge 1 ] 2>/dev/null || STOPS=1
# schedule, in seconds after the start (the run takes about B s, longer while disturbed)
t_early=$(( B * 15 / 100 )); [ $t_early -lt 5 ] && t_early=5
t_kill=$(( t_early + 3 ))
t_restart=$(( t_kill + 2 ))
t_junk=$(( t_restart + 1 ))
t_stop=$(( t_junk + 1 ))
: >"$T/run.out"
r0=$(date +%s)
budget=$(left); [ $budget -lt 20 ] && budget=20
timeout "$budget" "$L" -n 3 --ps 2 -- "$EX" $ARGS --epochs $E >"$T/run.out" 2>&1 &
tpid=$!
# the launcher (timeout's child)
lpid=""; k=0
while [ -z "$lpid" ] && [ $k -lt 50 ]; do lpid=$(kids $tpid | head -n 1); [ -n "$lpid" ] || sleep 0.1; k=$((k + 1)); done
[ -n "$lpid" ] || lpid=$tpid
# (a) sampler: every second, each server's descriptors and RSS, until the job ends (bounded)
(
  n=0; p0=""; p1=""
  while kill -0 $lpid 2>/dev/null && [ $n -lt $((budget + 5)) ]; do
    [ -n "$p0" ] || p0=$(child $lpid ps 0)
    [ -n "$p1" ] || p1=$(child $lpid ps 1)
    for i in 0 1; do
      eval p=\$p$i
      [ -n "$p" ] && [ -d /proc/$p ] || continue
      fds=$(ls /proc/$p/fd 2>/dev/null | wc -l)
      rss=$(sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\).*/\1/p' /proc/$p/status 2>/dev/null)
      [ -n "$rss" ] && echo "$(( $(date +%s) - r0 )) $i $fds $rss"
    done
    n=$((n + 1)); sleep 1
  done
) >"$T/samples.txt" &
spid=$!

# (b) kill worker 1; keep its environment to start it again
until_t $t_kill $r0
w1=$(child $lpid worker 1)
restarted=""
if [ -n "$w1" ]; then
  tr '\0' '\n' <"/proc/$w1/environ" | grep '^DTRAIN_' >"$T/w1.env"
  kill -KILL "$w1" && echo "soak: t=$(( $(date +%s) - r0 )) s: killed worker 1 (pid $w1)"
  until_t $t_restart $r0
  # again by hand, as an operator would: the same cluster, task, token and job; no launcher
  ( while IFS= read -r kv; do export "$kv"; done <"$T/w1.env"; unset DTRAIN_LISTEN_FD
    exec timeout "$budget" "$EX" $ARGS --epochs $E ) >"$T/restart.out" 2>&1 &
  restarted=$!
  echo "soak: t=$(( $(date +%s) - r0 )) s: started worker 1 again (pid $restarted)"
else
  fail "worker 1 not found to kill (the job ended early?)"
fi

# (c) junk: silent connections and random bytes to every port of the job, in rounds (python3)
until_t $t_junk $r0
cfg=$(grep '^DTRAIN_CONFIG=' "$T/w1.env" 2>/dev/null | sed 's/^DTRAIN_CONFIG=//')
jpid=""
if command -v python3 >/dev/null 2>&1 && [ -n "$cfg" ]; then
  python3 - "$cfg" "$ROUNDS" "$JUNK_N" "$HOLD_S" >"$T/junk.out" 2>&1 <<'EOF' &
import json, os, random, socket, sys, time
cfg, rounds, n, hold = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
addrs = cfg["cluster"]["worker"] + cfg["cluster"]["ps"]
stats = {"silent": 0, "garbage": 0, "refused": 0, "error": 0}
rng = random.Random(17)
for r in range(rounds):
    held = []
    for a in addrs:
        host, port = a.rsplit(":", 1)
        for k in range(2 * n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(2.0)
            try:
                s.connect((host, int(port)))
            except ConnectionRefusedError:
                stats["refused"] += 1; s.close(); continue
            except OSError:
                stats["error"] += 1; s.close(); continue
            if k < n:
                stats["silent"] += 1  # connects, says nothing
                held.append(s)
                continue
            stats["garbage"] += 1
            try:
                s.sendall(os.urandom(rng.choice([1, 3, 7, 16, 40, 200, 4096, 70000])))
            except OSError:
                pass
            if k % 2:
                s.close()  # bytes, then gone
            else:
                held.append(s)  # bytes, then silence
    time.sleep(hold)
    for s in held:
        s.close()
print("junk: %d rounds over %d ports: %d silent, %d with random bytes, %d refused, %d errors"
      % (rounds, len(addrs), stats["silent"], stats["garbage"], stats["refused"], stats["error"]))
EOF
  jpid=$!
else
  note "no python3 (or no config): the junk connections are skipped"
fi

# (d) stop worker 2 for a while, then continue it
until_t $t_stop $r0
w2=$(child $lpid worker 2)
if [ -n "$w2" ]; then
  k=0
  while [ $k -lt "$STOPS" ] && kill -0 "$w2" 2>/dev/null; do
    [ $k -gt 0 ] && sleep 3 # running again in between
    kill -STOP "$w2" && echo "soak: t=$(( $(date +%s) - r0 )) s: stopped worker 2 (pid $w2) for $STOP_S s"
    sleep "$STOP_S"
    kill -CONT "$w2" && echo "soak: t=$(( $(date +%s) - r0 )) s: continued worker 2"
    k=$((k + 1))
  done
else
  fail "worker 2 not found to stop"
fi
[ -n "$jpid" ] && { k=0; while kill -0 $jpid 2>/dev/null && [ $k -lt 120 ]; do sleep 1; k=$((k + 1)); done; kill $jpid 2>/dev/null; wait $jpid; }
t_quiet=$(( $(date +%s) - r0 + 2 )) # the disturbances are over: later samples are "late"
echo "soak: t=$(( $(date +%s) - r0 )) s: disturbances over; waiting for the job"
[ -f "$T/junk.out" ] && sed 's/^/soak: /' "$T/junk.out"

wait $tpid; rc=$?
R=$(( $(date +%s) - r0 ))
kill $spid 2>/dev/null; wait $spid 2>/dev/null
rrc=""
if [ -n "$restarted" ]; then
  k=0; while kill -0 $restarted 2>/dev/null && [ $k -lt 60 ]; do sleep 1; k=$((k + 1)); done
  kill -KILL $restarted 2>/dev/null; wait $restarted; rrc=$?
fi

# ---- 4. verdict -------------------------------------------------------------------------------------
loss_d=$(loss_of "$T/run.out"); acc_d=$(acc_of "$T/run.out")
echo "soak: disturbed run ${R} s, exit $rc: worker 0 loss ${loss_d:-?}, test accuracy ${acc_d:-?}"
[ $rc -eq 0 ] && ok "the disturbed job finished (launcher exit 0)" || fail "the disturbed job did not finish (launcher exit $rc)"
grep -q 'worker 1 killed by signal 9' "$T/run.out" && grep -q 'training finished with 2 of 3 workers (1 lost)' "$T/run.out" \
  && ok "the launcher logged the killed worker and went on" || fail "the launcher's account of the killed worker is missing"
if [ -n "$loss_d" ] && [ -n "$acc_d" ]; then
  awk -v d="$loss_d" -v b="$loss_b" -v t="$LOSS_TOL" 'BEGIN { x = d - b; if (x < 0) x = -x; exit !(x <= t * b) }' \
    && ok "final loss $loss_d within $LOSS_TOL of the baseline's $loss_b" || fail "final loss $loss_d vs baseline $loss_b (tolerance $LOSS_TOL relative)"
  awk -v d="$acc_d" -v b="$acc_b" -v t="$ACC_TOL" 'BEGIN { x = d - b; if (x < 0) x = -x; exit !(x <= t) }' \
    && ok "test accuracy $acc_d within $ACC_TOL of the baseline's $acc_b" || fail "test accuracy $acc_d vs baseline $acc_b (tolerance $ACC_TOL)"
else
  fail "worker 0 printed no final loss / accuracy"
fi
if [ -n "$rrc" ]; then
  if [ "$rrc" = 0 ] && grep -q '^worker 1: rejoined at clock' "$T/restart.out"; then
    ok "the restarted worker 1 rejoined and finished: $(grep '^worker 1: rejoined' "$T/restart.out" | cut -c1-160)"
  else
    fail "the restarted worker 1 (exit $rrc) did not rejoin and finish: $(grep -v '^$' "$T/restart.out" | tail -n 1 | cut -c1-240)"
  fi
fi
# descriptors and RSS: per server, the largest sample before the first disturbance against the
# largest sample after the last one
for i in 0 1; do
  e=$(awk -v i=$i -v t=$t_kill '$2 == i && $1 < t { if ($3 > f) f = $3; if ($4 > r) r = $4 } END { if (f) print f, r }' "$T/samples.txt")
  l=$(awk -v i=$i -v t=$t_quiet '$2 == i && $1 >= t { if ($3 > f) f = $3; if ($4 > r) r = $4; n++ } END { if (f) print f, r, n }' "$T/samples.txt")
  if [ -z "$e" ] || [ -z "$l" ]; then
    fail "ps $i: too few samples (early '${e}', late '${l}'): make the run longer (SOAK_SECONDS, SOAK_LIMIT)"
    continue
  fi
  set -- $e $l
  [ $3 -le $(( $1 + FD_TOL )) ] && ok "ps $i: descriptors $1 before, at most $3 after ($5 samples)" \
    || fail "ps $i: descriptors grew from $1 to $3 (tolerance $FD_TOL)"
  awk -v e=$2 -v l=$4 -v t="$RSS_TOL" -v k="$RSS_KB" 'BEGIN { exit !(l <= e * (1 + t) + k) }' \
    && ok "ps $i: RSS $2 kB before, at most $4 kB after" || fail "ps $i: RSS grew from $2 kB to $4 kB (tolerance $RSS_TOL + $RSS_KB kB)"
done
echo "soak: $(elapsed) s in all; outputs in $T/"
if [ -z "$fails" ]; then echo "soak: PASS"; exit 0; fi
echo "soak: FAIL ($fails)"
exit 1
