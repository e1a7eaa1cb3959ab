#!/bin/sh
# tools/dtrain-launch against tests/launch_probe: DTRAIN_CONFIG and
# DTRAIN_LISTEN_FD per process, output prefixes (stdout and stderr, partial
# and long lines), exit codes and signals of failing processes, the others
# stopped after a failure (SIGTERM, then SIGKILL), signals passed on,
# parameter servers stopped after the workers, a parameter-server job going
# on without a dead worker, workers' listening sockets closed once the world
# formed, --timeout, the job's token and job id, --bind-to, --max-restarts, usage,
# --hosts/--rsh over network namespaces.
# Prints "launch_checks: N passed, N failed, N skipped".
BUILD=${BUILD:-build}
L=${LAUNCH:-tools/dtrain-launch}
P=${PROBE:-$BUILD/tests/launch_probe}
T=$BUILD/launch_checks
rm -rf "$T"; mkdir -p "$T"
pass=0; fail=0; skipped=0
# skip WHAT: why -- a check that cannot run here, counted and named in the summary.
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; shift; for f in "$@"; do echo "--- $f"; tail -n 20 "$f"; done; fail=$((fail + 1)); }
if [ ! -x "$L" ] || [ ! -x "$P" ]; then
  echo "FAIL: build $L and $P first (make all)"
  echo "launch_checks: 0 passed, 1 failed"; exit 1
fi
# run NAME ARGS...: launcher with ARGS, stdout/stderr/exit code into $T/NAME.{out,err,rc}; 60 s cap (never reached).
run() {
  name=$1; shift
  rm -rf "$T/sync"; mkdir -p "$T/sync"
  PROBE_DIR="$T/sync" timeout 60 "$L" "$@" >"$T/$name.out" 2>"$T/$name.err"; echo $? >"$T/$name.rc"
}
rc_of() { cat "$T/$1.rc"; }
has() { grep -q -- "$2" "$T/$1"; }
count_ready() { c=$(grep -c 'ready' "$1" 2>/dev/null); echo "${c:-0}"; }

# -- usage
"$L" -h >"$T/h.out" 2>&1 && grep -q '^usage: dtrain-launch -n N' "$T/h.out" && ok "help" || bad "help" "$T/h.out"
run nonum -- "$P"; [ "$(rc_of nonum)" = 2 ] && has nonum.err '\-n N' && ok "usage: -n required" || bad "usage: -n required" "$T/nonum.err"
run noprog -n 2; [ "$(rc_of noprog)" = 2 ] && has noprog.err 'no program' && ok "usage: program required" || bad "usage: program required" "$T/noprog.err"
run badn -n 0 -- "$P"; [ "$(rc_of badn)" = 2 ] && has badn.err "expected a number of workers" && ok "usage: bad -n" || bad "usage: bad -n" "$T/badn.err"
run badopt -n 1 --bogus -- "$P"; [ "$(rc_of badopt)" = 2 ] && has badopt.err "unknown option '--bogus'" && ok "usage: unknown option" || bad "usage: unknown option" "$T/badopt.err"
run badport -n 2 --port 65535 -- "$P"; [ "$(rc_of badport)" = 2 ] && has badport.err "ports up to 65536 do not exist" && ok "usage: ports past 65535" || bad "usage: ports past 65535" "$T/badport.err"

# -- every process gets its own task in a well-formed DTRAIN_CONFIG and its own listening socket
run info -n 3 --ps=2 -- "$P" info
good=1
for t in "worker 0" "worker 1" "worker 2" "ps 0" "ps 1"; do
  r=${t% *}; i=${t#* }
  grep -q "^\[$t\] role=$r index=$i workers=3 servers=2 self=127.0.0.1:[0-9]* rank=$i world=3 envrole=$r listen=ok leaked=-1\$" "$T/info.out" || { echo "missing/odd line for $t"; good=0; }
  [ "$(grep -c "^\[$t\] " "$T/info.out")" = 6 ] || { echo "$t: not 6 lines"; good=0; }
done
# every process sees the same cluster, and the 5 addresses differ
[ "$(grep -E '^\[[a-z]+ [0-9]\] (worker|server)_addr' "$T/info.out" | sed 's/^\[[^]]*\] //' | sort | uniq -c | awk '$1 != 5' | wc -l)" = 0 ] || { echo "processes disagree on the cluster"; good=0; }
[ "$(grep '^\[worker 0\] .*_addr' "$T/info.out" | awk '{print $NF}' | sort -u | wc -l)" = 5 ] || { echo "addresses not distinct"; good=0; }
[ "$(rc_of info)" = 0 ] && [ $good = 1 ] && [ ! -s "$T/info.err" ] && ok "config, rank, world and listening socket per process" || bad "config, rank, world and listening socket per process" "$T/info.out" "$T/info.err"

# -- IPv6 loopback (skipped where ::1 cannot be bound)
run v6 -n 2 --host ::1 -- "$P" info
if [ "$(rc_of v6)" = 1 ] && has v6.err "cannot listen"; then
  skip "ipv6: cannot bind ::1"
else
  [ "$(rc_of v6)" = 0 ] && [ "$(grep -c 'self=\[::1\]:[0-9]* rank=[01] world=2 envrole=worker listen=ok leaked=-1$' "$T/v6.out")" = 2 ] \
    && ok "--host ::1" || bad "--host ::1" "$T/v6.out" "$T/v6.err"
fi

# -- prefixes on stdout and stderr; a partial last line is flushed; a long line stays one line
run partial -n 3 -- "$P" partial
grep -qx '\[worker 0\] no newline' "$T/partial.out" && grep -qx '\[worker 1\] to stderr' "$T/partial.err" \
  && ! grep -q 'to stderr' "$T/partial.out" && [ "$(grep -c '^\[worker 2\] x' "$T/partial.out")" = 1 ] \
  && [ "$(grep '^\[worker 2\] x' "$T/partial.out" | wc -c)" = 10012 ] && [ "$(rc_of partial)" = 0 ] \
  && ok "prefixes, partial and long lines" || bad "prefixes, partial and long lines" "$T/partial.out" "$T/partial.err"

# -- a failing worker: its exit code, the message, the others stopped (SIGTERM after the grace period)
run exit3 -n 3 --grace 0.3 -- "$P" exitif worker 1 3
[ "$(rc_of exit3)" = 3 ] && has exit3.err '^dtrain-launch: worker 1 exited with code 3$' \
  && has exit3.out '^\[worker 0\] got signal 15$' && has exit3.out '^\[worker 2\] got signal 15$' \
  && has exit3.err 'worker 2 killed by signal 15 (stopped by dtrain-launch)' \
  && ok "exit code propagated, others terminated" || bad "exit code propagated, others terminated" "$T/exit3.out" "$T/exit3.err"

# -- a server that fails counts too
run psfail -n 1 --ps 1 --grace 0.3 -- "$P" exitif ps 0 7
[ "$(rc_of psfail)" = 7 ] && has psfail.err '^dtrain-launch: ps 0 exited with code 7$' && has psfail.out '^\[worker 0\] got signal 15$' \
  && ok "failing server" || bad "failing server" "$T/psfail.out" "$T/psfail.err"

# -- a worker killed by a signal: 128 + signal
run kill9 -n 2 --grace 0.3 -- "$P" killif worker 0 9
[ "$(rc_of kill9)" = 137 ] && has kill9.err '^dtrain-launch: worker 0 killed by signal 9$' && has kill9.out '^\[worker 1\] got signal 15$' \
  && ok "killed by signal" || bad "killed by signal" "$T/kill9.out" "$T/kill9.err"

# -- a process that ignores SIGTERM gets SIGKILL
run ignore -n 2 --grace 0.2 -- "$P" ignore
[ "$(rc_of ignore)" = 1 ] && has ignore.err 'worker 1 exited with code 1' && has ignore.err 'worker 0 did not stop after SIGTERM; sending SIGKILL' \
  && has ignore.err 'worker 0 killed by signal 9 (stopped by dtrain-launch)' \
  && ok "SIGKILL after an ignored SIGTERM" || bad "SIGKILL after an ignored SIGTERM" "$T/ignore.out" "$T/ignore.err"

# -- signals sent to the launcher reach every process
for sig in TERM INT HUP; do
  case $sig in TERM) n=15;; INT) n=2;; HUP) n=1;; esac
  : >"$T/sig$sig.out" # exists before the background job opens it
  "$L" -n 2 --ps 1 -- "$P" wait >>"$T/sig$sig.out" 2>"$T/sig$sig.err" &
  pid=$!
  k=0
  while [ "$(count_ready "$T/sig$sig.out")" -lt 3 ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  kill -"$sig" $pid
  k=0
  while kill -0 $pid 2>/dev/null && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  kill -KILL $pid 2>/dev/null
  wait $pid; rc=$?
  [ $rc = $((128 + n)) ] && has "sig$sig.out" "^\[worker 0\] got signal $n\$" && has "sig$sig.out" "^\[worker 1\] got signal $n\$" \
    && has "sig$sig.out" "^\[ps 0\] got signal $n\$" && ok "SIG$sig passed on (exit $rc)" || bad "SIG$sig passed on (exit $rc)" "$T/sig$sig.out" "$T/sig$sig.err"
done

# -- a second signal kills every process at once; the job still exits 128 + the signal (not 0)
: >"$T/sig2.out"
"$L" -n 2 -- sh -c 'trap "" INT; echo ready; exec sleep 30' >>"$T/sig2.out" 2>"$T/sig2.err" &
pid=$!
k=0; while [ "$(count_ready "$T/sig2.out")" -lt 2 ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
kill -INT $pid; sleep 0.3; kill -INT $pid
k=0; while kill -0 $pid 2>/dev/null && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
kill -KILL $pid 2>/dev/null; wait $pid; rc=$?
[ $rc = 130 ] && has sig2.err 'got signal 2 again; killing every process' && ok "a second signal: everything killed, exit 130" \
  || bad "a second signal (exit $rc)" "$T/sig2.out" "$T/sig2.err"

# -- a stopped process (SIGSTOP) is continued so that it acts on the SIGTERM
: >"$T/stop.out"
PROBE_DIR="$T/sync" "$L" -n 2 --grace 0.2 -- "$P" wait >>"$T/stop.out" 2>"$T/stop.err" &
pid=$!
k=0
while [ "$(count_ready "$T/stop.out")" -lt 2 ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
w0=$(sed -n 's/^\[worker 0\] ready pid=\([0-9]*\)$/\1/p' "$T/stop.out")
w1=$(sed -n 's/^\[worker 1\] ready pid=\([0-9]*\)$/\1/p' "$T/stop.out")
[ -n "$w0" ] && [ -n "$w1" ] && kill -STOP "$w1" && kill -KILL "$w0"
k=0
while kill -0 $pid 2>/dev/null && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
kill -KILL $pid 2>/dev/null
wait $pid; rc=$?
[ $rc = 137 ] && has stop.err '^dtrain-launch: worker 0 killed by signal 9$' \
  && has stop.err '^dtrain-launch: worker 1 killed by signal 15 (stopped by dtrain-launch)$' && has stop.out '^\[worker 1\] got signal 15$' \
  && ok "a stopped process is continued to take SIGTERM" || bad "a stopped process is continued to take SIGTERM" "$T/stop.out" "$T/stop.err"

# -- servers still running after the workers succeeded are stopped; the run succeeds
run ps -n 2 --ps 2 --grace 0.3 -- "$P" ps
[ "$(rc_of ps)" = 0 ] && has ps.err '^dtrain-launch: ps 0 killed by signal 15 (stopped by dtrain-launch)$' \
  && has ps.err '^dtrain-launch: ps 1 killed by signal 15 (stopped by dtrain-launch)$' \
  && has ps.out '^\[worker 1\] role=worker index=1 workers=2 servers=2' && ! has ps.err 'exited with code' \
  && ok "--ps: servers stopped after the workers, exit 0" || bad "--ps: servers stopped after the workers, exit 0" "$T/ps.out" "$T/ps.err"

# -- a parameter-server job goes on when a worker dies (the servers drop it): killed mid-run from
#    outside, the other workers finish and the job exits 0; when every worker dies it fails
# psjob NAME N KILL...: -n N --ps 1 workers working 3 s; the listed workers get SIGKILL once all are ready
psjob() {
  name=$1; n=$2; shift 2
  : >"$T/$name.out"
  timeout 60 "$L" -n "$n" --ps 1 --grace 0.3 -- "$P" pswork 3 >>"$T/$name.out" 2>"$T/$name.err" &
  pid=$!
  k=0
  while [ "$(count_ready "$T/$name.out")" -lt $((n + 1)) ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  for w in "$@"; do
    wp=$(sed -n "s/^\[worker $w\] ready pid=\([0-9]*\)\$/\1/p" "$T/$name.out")
    [ -n "$wp" ] && kill -KILL "$wp"
  done
  wait $pid; echo $? >"$T/$name.rc"
}
psjob pskill 3 1
[ "$(rc_of pskill)" = 0 ] && has pskill.err '^dtrain-launch: worker 1 killed by signal 9$' \
  && has pskill.err '^dtrain-launch: parameter-server job: going on with 2 workers$' \
  && has pskill.out '^\[worker 0\] finished$' && has pskill.out '^\[worker 2\] finished$' \
  && has pskill.err 'training finished with 2 of 3 workers (1 lost)' \
  && has pskill.err '^dtrain-launch: ps 0 killed by signal 15 (stopped by dtrain-launch)$' && ! has pskill.out '^\[worker .*got signal' \
  && ok "--ps: a worker killed mid-run, the others finish, exit 0" || bad "--ps: a worker killed mid-run, the others finish, exit 0" "$T/pskill.out" "$T/pskill.err"
psjob psallkill 2 0 1
[ "$(rc_of psallkill)" = 137 ] && has psallkill.err 'parameter-server job failed: none of the 2 workers finished' \
  && has psallkill.err '^dtrain-launch: ps 0 killed by signal 15 (stopped by dtrain-launch)$' \
  && ok "--ps: every worker killed, exit 137" || bad "--ps: every worker killed, exit 137" "$T/psallkill.out" "$T/psallkill.err"
# a worker stopped (SIGSTOP) for good: the server drops it and ends, and then the launcher
# stops it too (after --grace) instead of waiting for it forever; the job exits 0
DTRAIN_TIMEOUT=2 run psstop -n 2 --ps 1 --grace 0.3 -- "$P" psworkers 1
[ "$(rc_of psstop)" = 0 ] && has psstop.err '^dtrain-launch: worker 1 still running 0.3 s later than every server (it cannot train on); sending SIGTERM$' \
  && has psstop.err '^dtrain-launch: worker 1 killed by signal 15 (stopped by dtrain-launch)$' \
  && has psstop.err 'training finished with 1 of 2 workers (1 lost)' \
  && ok "--ps: a stopped worker is stopped once the servers ended, exit 0" || bad "--ps: a stopped worker is stopped once the servers ended, exit 0" "$T/psstop.out" "$T/psstop.err"

# -- once the world has formed, a stranger dialing a worker's port (the launcher's socket) is
#    refused at once, never left hanging in a backlog nobody accepts from: multi_worker_mirrored
#    (tcp communicator) and parameter-server workers (which only dial)
run mwmport -n 3 -- "$P" mwm
[ "$(rc_of mwmport)" = 0 ] && [ "$(grep -c '^\[worker [012]\] probe worker [012]: refused$' "$T/mwmport.out")" = 9 ] \
  && [ "$(grep -c 'own listener: closed$' "$T/mwmport.out")" = 3 ] \
  && ok "mwm: listeners closed once the world formed" || bad "mwm: listeners closed once the world formed" "$T/mwmport.out" "$T/mwmport.err"
run psport -n 2 --ps 1 -- "$P" psworkers
[ "$(rc_of psport)" = 0 ] && [ "$(grep -c '^\[worker [01]\] probe worker [01]: refused$' "$T/psport.out")" = 4 ] \
  && [ "$(grep -c 'own listener: closed$' "$T/psport.out")" = 2 ] \
  && ok "--ps: workers' listeners closed" || bad "--ps: workers' listeners closed" "$T/psport.out" "$T/psport.err"

# -- --timeout
run timeout -n 2 --timeout 0.5 -- "$P" wait
[ "$(rc_of timeout)" = 124 ] && has timeout.err 'timed out after 0.5 s' \
  && has timeout.err '^dtrain-launch: worker 1 killed by signal 15 (stopped by dtrain-launch)$' \
  && ok "--timeout" || bad "--timeout" "$T/timeout.out" "$T/timeout.err"

# -- every job authenticates: one fresh 64-hex-digit secret shared by all, without asking
# (--token-env is still accepted); an existing DTRAIN_TOKEN is kept; the launcher never prints it
run token -n 3 -- "$P" token
tokv=$(sed -n 's/^\[worker 0\] token=//p' "$T/token.out")
[ "$(sed 's/^\[[^]]*\] //' "$T/token.out" | sort -u | grep -c '^token=[0-9a-f]\{64\}$')" = 1 ] && [ "$(wc -l <"$T/token.out")" = 3 ] \
  && [ -n "$tokv" ] && [ "$(grep -v '^\[' "$T/token.out" "$T/token.err" | grep -c "$tokv")" = 0 ] \
  && ok "a fresh token by default, never printed" || bad "a fresh token by default, never printed" "$T/token.out" "$T/token.err"
run token3 -n 2 --token-env -- "$P" token
[ "$(sed 's/^\[[^]]*\] //' "$T/token3.out" | sort -u | grep -c '^token=[0-9a-f]\{64\}$')" = 1 ] \
  && ! grep -q "$tokv" "$T/token3.out" && ok "--token-env" || bad "--token-env" "$T/token3.out" "$T/token3.err"
DTRAIN_TOKEN=mine timeout 60 "$L" -n 1 --token-env -- "$P" token >"$T/token2.out" 2>&1
grep -qx '\[worker 0\] token=mine' "$T/token2.out" && ok "DTRAIN_TOKEN is kept" || bad "DTRAIN_TOKEN is kept" "$T/token2.out"

# -- a fresh random job id (DTRAIN_JOB_ID) shared by all processes of a job, another for the next job; kept when set
run job -n 2 --ps 1 -- sh -c 'echo "job=$DTRAIN_JOB_ID"'
run job2 -n 1 -- sh -c 'echo "job=$DTRAIN_JOB_ID"'
j1=$(sed -n 's/^\[worker 0\] //p' "$T/job.out"); j2=$(sed -n 's/^\[worker 0\] //p' "$T/job2.out")
[ "$(rc_of job)" = 0 ] && [ "$(sed 's/^\[[^]]*\] //' "$T/job.out" | sort -u | grep -c '^job=0x[0-9a-f]\{16\}$')" = 1 ] \
  && [ "$(wc -l <"$T/job.out")" = 3 ] && [ "$j1" != "$j2" ] \
  && ok "a fresh job id per job" || bad "a fresh job id per job" "$T/job.out" "$T/job.err" "$T/job2.out"
DTRAIN_JOB_ID=0x2a timeout 60 "$L" -n 1 -- sh -c 'echo "job=$DTRAIN_JOB_ID"' >"$T/job3.out" 2>&1
grep -qx '\[worker 0\] job=0x2a' "$T/job3.out" && ok "DTRAIN_JOB_ID is kept" || bad "DTRAIN_JOB_ID is kept" "$T/job3.out"

# -- a program that cannot be run: 127 and the reason, prefixed
run noexec -n 1 -- "$T/does-not-exist"
[ "$(rc_of noexec)" = 127 ] && has noexec.err "^\[worker 0\] dtrain-launch: cannot run '.*does-not-exist'" \
  && ok "missing program" || bad "missing program" "$T/noexec.err"

# -- --bind-to core: each process confined to one core (a subset of the launcher's CPUs), the
#    first two on different cores when there are two; taskset to one CPU: all share it, and
#    the launcher says so; none (the default): the launcher's CPUs as they are
run badbind -n 2 --bind-to socket -- true
[ "$(rc_of badbind)" = 2 ] && has badbind.err "\-\-bind-to 'socket': expected core or none" && ok "usage: bad --bind-to" \
  || bad "usage: bad --bind-to" "$T/badbind.err"
if [ -r /proc/self/status ] && [ "$(uname -s)" = Linux ]; then
  mine=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status)
  show='sed -n "s/^Cpus_allowed_list:[[:space:]]*//p" /proc/self/status'
  cpus_of() { sed -n "s/^\[$2\] //p" "$T/$1.out"; }
  # "0-3,5" -> one CPU number a line
  expand() { echo "$1" | tr ',' '\n' | awk -F- '{ e = NF > 1 ? $2 : $1; for (c = $1; c <= e; c++) print c }'; }
  run bindnone -n 2 -- sh -c "$show"
  [ "$(rc_of bindnone)" = 0 ] && [ "$(cpus_of bindnone 'worker 0')" = "$mine" ] && [ "$(cpus_of bindnone 'worker 1')" = "$mine" ] \
    && ok "--bind-to none leaves the CPUs alone" || bad "--bind-to none leaves the CPUs alone" "$T/bindnone.out" "$T/bindnone.err"
  run bindcore -n 3 --bind-to core -- sh -c "$show"
  good=1
  for w in 0 1 2; do
    l=$(cpus_of bindcore "worker $w")
    [ -n "$l" ] || { echo "worker $w: no CPU list"; good=0; continue; }
    for c in $(expand "$l"); do expand "$mine" | grep -qx "$c" || { echo "worker $w: CPU $c is not the launcher's"; good=0; }; done
  done
  w0=$(cpus_of bindcore 'worker 0'); w1=$(cpus_of bindcore 'worker 1')
  if [ "$(expand "$mine" | wc -l)" -ge 2 ]; then
    [ "$w0" != "$mine" ] || { echo "worker 0 not confined"; good=0; }
    for c in $(expand "$w0"); do expand "$w1" | grep -qx "$c" && { echo "workers 0 and 1 share CPU $c"; good=0; }; done
  fi
  [ "$(rc_of bindcore)" = 0 ] && [ $good = 1 ] && ok "--bind-to core: one core each" || bad "--bind-to core: one core each" "$T/bindcore.out" "$T/bindcore.err"
  if command -v taskset >/dev/null 2>&1; then
    one=$(expand "$mine" | head -n 1)
    rm -rf "$T/sync"; mkdir -p "$T/sync"
    timeout 60 taskset -c "$one" "$L" -n 2 --bind-to core -- sh -c "$show" >"$T/bindone.out" 2>"$T/bindone.err"; echo $? >"$T/bindone.rc"
    [ "$(rc_of bindone)" = 0 ] && [ "$(cpus_of bindone 'worker 0')" = "$one" ] && [ "$(cpus_of bindone 'worker 1')" = "$one" ] \
      && has bindone.err '2 processes on 1 core: some share a core' && ok "--bind-to core within the launcher's CPUs" \
      || bad "--bind-to core within the launcher's CPUs" "$T/bindone.out" "$T/bindone.err"
  else
    skip "--bind-to core under taskset: no taskset"
  fi
else
  skip "--bind-to core: not Linux"
fi

# -- --max-restarts: a worker that always fails is restarted K times, every worker with it (a
#    synchronous job), each run with DTRAIN_RESTART=0, 1, 2; then its code ends the job. (Worker
#    0 may be stopped before it prints: a restart that comes at once. A signal for a child that
#    has not yet reset its handlers once reached the launcher's own signal pipe: the launcher
#    then "passed on" a SIGTERM nobody sent it and ended the job.)
run restarts -n 2 --grace 1 --max-restarts 2 -- sh -c 'echo "run $DTRAIN_RESTART"; if [ "$DTRAIN_RANK" = 1 ]; then exit 3; fi; sleep 5'
if [ "$(rc_of restarts)" = 3 ] && has restarts.err 'worker 1 exited with code 3; stopping every worker to start them all again from their checkpoint (restart 2 of 2)' &&
   [ "$(grep -c '^\[worker 1\] run [012]$' "$T/restarts.out")" = 3 ] && has restarts.out '^\[worker 1\] run 2$' &&
   has restarts.err '2 restarts made (--max-restarts 2)'; then
  ok "--max-restarts 2: every worker started 3 times (DTRAIN_RESTART 0..2), then the failure's code"
else bad "--max-restarts" "$T/restarts.out" "$T/restarts.err"; fi
# with --ps only the failing worker is started again; the server and the other worker run on
run psrestarts -n 2 --ps 1 --grace 1 --max-restarts 1 -- sh -c 'echo "run $DTRAIN_ROLE $DTRAIN_RANK $DTRAIN_RESTART"; if [ "$DTRAIN_ROLE $DTRAIN_RANK $DTRAIN_RESTART" = "worker 1 0" ]; then exit 3; fi; sleep 1'
if [ "$(rc_of psrestarts)" = 0 ] && has psrestarts.err 'worker 1 exited with code 3; starting it again (restart 1 of 1): it rejoins the servers' &&
   [ "$(grep -c 'run worker 0 ' "$T/psrestarts.out")" = 1 ] && [ "$(grep -c 'run ps 0 ' "$T/psrestarts.out")" = 1 ] &&
   has psrestarts.out 'run worker 1 1'; then
  ok "--max-restarts with --ps: only the failed worker is started again (DTRAIN_RESTART=1); exit 0"
else bad "--max-restarts with --ps" "$T/psrestarts.out" "$T/psrestarts.err"; fi
run badrestarts -n 1 --max-restarts -1 -- "$P"; [ "$(rc_of badrestarts)" = 2 ] && has badrestarts.err "expected a number of restarts" && ok "usage: bad --max-restarts" || bad "usage: bad --max-restarts" "$T/badrestarts.err"
# -- --min-workers (elastic size): its usage errors; DTRAIN_SLOT stays while the ranks move up
run minbig -n 2 --min-workers 3 --max-restarts 1 -- "$P"; [ "$(rc_of minbig)" = 2 ] && has minbig.err "more than the 2 workers" && ok "usage: --min-workers above -n" || bad "usage: --min-workers above -n" "$T/minbig.err"
run minps -n 2 --ps 1 --min-workers 1 --max-restarts 1 -- "$P"; [ "$(rc_of minps)" = 2 ] && has minps.err "for synchronous jobs" && ok "usage: --min-workers with --ps" || bad "usage: --min-workers with --ps" "$T/minps.err"
run minnr -n 2 --min-workers 1 -- "$P"; [ "$(rc_of minnr)" = 2 ] && has minnr.err "needs --max-restarts" && ok "usage: --min-workers without --max-restarts" || bad "usage: --min-workers without --max-restarts" "$T/minnr.err"
run slots --max-workers 3 --min-workers 2 --max-restarts 2 --grace 1 -- sh -c 'echo "slot $DTRAIN_SLOT rank $DTRAIN_RANK world $DTRAIN_WORLD restart $DTRAIN_RESTART"; if [ "$DTRAIN_SLOT" = 0 ] && [ "$DTRAIN_RESTART" = 0 ]; then sleep 0.5; exit 3; fi; if [ "$DTRAIN_SLOT" = 0 ]; then exit 3; fi; sleep 1'
if [ "$(rc_of slots)" = 0 ] && has slots.err 'worker 0 exited with code 3 .* it does not come back' &&
   has slots.out '^\[worker 1\] slot 1 rank 0 world 2 restart 2$' && has slots.out '^\[worker 2\] slot 2 rank 1 world 2 restart 2$' &&
   has slots.err 'the job ended with 2 of 3 workers'; then
  ok "--min-workers: a worker that fails again at once is left out; the others restart as ranks 0..1 of 2 (DTRAIN_SLOT stays)"
else bad "--min-workers slots" "$T/slots.out" "$T/slots.err"; fi

# -- --hosts (several machines) and --rsh: usage; then two network namespaces as the hosts
#    (--rsh "ip netns exec"): placement, addresses and ports, prefixes, the token sent on each
#    process's input (never on a command line), a failure's code, a launcher killed with
#    SIGKILL leaving nothing behind, and a real multi-worker training across the two
run hrsh -n 2 --rsh "ip netns exec" -- "$P"; [ "$(rc_of hrsh)" = 2 ] && has hrsh.err "without --hosts" && ok "usage: --rsh without --hosts" || bad "usage: --rsh without --hosts" "$T/hrsh.err"
run hzero --hosts a:0 -- "$P"; [ "$(rc_of hzero)" = 2 ] && has hzero.err "slots '0' is not a number" && ok "usage: --hosts a:0" || bad "usage: --hosts a:0" "$T/hzero.err"
run hmany -n 5 --hosts a:2,b:2 -- "$P"; [ "$(rc_of hmany)" = 2 ] && has hmany.err "more workers than the 4 slots" && ok "usage: -n above the slots" || bad "usage: -n above the slots" "$T/hmany.err"
run hdash --hosts -oProxyCommand=x:1 -- "$P"; [ "$(rc_of hdash)" = 2 ] && has hdash.err "is not NAME" && ok "usage: a host name that is an option" || bad "usage: a host name that is an option" "$T/hdash.err"
run hhost --hosts a:1 --host 127.0.0.1 -- "$P"; [ "$(rc_of hhost)" = 2 ] && has hhost.err "is for one machine" && ok "usage: --host with --hosts" || bad "usage: --host with --hosts" "$T/hhost.err"
NSA=dtlA$$; NSB=dtlB$$
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
  skip "--hosts over network namespaces: needs root and ip(8)"
elif ! { ip netns add $NSA && ip netns add $NSB && ip link add ${NSA}v type veth peer name ${NSB}v &&
         ip link set ${NSA}v netns $NSA && ip link set ${NSB}v netns $NSB &&
         ip -n $NSA addr add 10.231.9.1/24 dev ${NSA}v && ip -n $NSB addr add 10.231.9.2/24 dev ${NSB}v &&
         ip -n $NSA link set ${NSA}v up && ip -n $NSB link set ${NSB}v up &&
         ip -n $NSA link set lo up && ip -n $NSB link set lo up; } 2>"$T/netns.err"; then
  skip "--hosts over network namespaces: cannot make them here ($(head -1 "$T/netns.err"))"
  ip netns del $NSA 2>/dev/null; ip netns del $NSB 2>/dev/null
else
  H="--hosts $NSA=10.231.9.1:2,$NSB=10.231.9.2:1 --rsh"
  run hinfo $H "ip netns exec" --ps 2 -- "$P" info
  good=1
  for t in "$NSA:worker 0:10.231.9.1:29500" "$NSA:worker 1:10.231.9.1:29501" "$NSB:worker 2:10.231.9.2:29502" \
           "$NSA:ps 0:10.231.9.1:29503" "$NSB:ps 1:10.231.9.2:29504"; do
    pre=${t%%:1*}; addr=${t#"$pre":}; who=${pre#*:}; r=${who% *}; i=${who#* }
    grep -q "^\[$pre\] role=$r index=$i workers=3 servers=2 self=$addr rank=$i world=3 envrole=$r listen=missing" "$T/hinfo.out" || { echo "missing/odd line for $pre"; good=0; }
  done
  [ "$(rc_of hinfo)" = 0 ] && [ $good = 1 ] && ok "--hosts: workers fill the slots, servers one per host, ADDR:port in every config" || bad "--hosts placement" "$T/hinfo.out" "$T/hinfo.err"
  # the token: the same one reaches every process, on no command line while they run
  : >"$T/htok.out"
  DTRAIN_TOKEN=hosts-secret-$$ PROBE_DIR="$T/sync" "$L" $H "ip netns exec" -- "$P" wait >"$T/htok.out" 2>"$T/htok.err" &
  pid=$!
  k=0; while [ "$(count_ready "$T/htok.out")" -lt 3 ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  seen=$(cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' ' ' | grep -c "hosts-secret[-]$$") # [-]: not its own
  envok=0; for q in $(sed -n 's/.*ready pid=\([0-9]*\).*/\1/p' "$T/htok.out"); do tr '\0' '\n' </proc/$q/environ 2>/dev/null | grep -qx "DTRAIN_TOKEN=hosts-secret-$$" && envok=$((envok + 1)); done
  kill -TERM $pid
  k=0; while kill -0 $pid 2>/dev/null && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  kill -KILL $pid 2>/dev/null; wait $pid; hrc=$?
  [ "$(count_ready "$T/htok.out")" = 3 ] && [ "$seen" = 0 ] && [ $envok = 3 ] && [ $hrc = 143 ] && has htok.err 'worker 2 killed by signal 15$' \
    && ok "--hosts: the token reaches every process on its input, on no command line; SIGTERM stops the job" \
    || bad "--hosts token (ready $(count_ready "$T/htok.out"), on a command line $seen, in the environment $envok, exit $hrc)" "$T/htok.out" "$T/htok.err"
  run hfail $H "ip netns exec" --grace 0.3 -- "$P" exitif worker 2 3
  [ "$(rc_of hfail)" = 3 ] && has hfail.err 'worker 2 exited with code 3' && has hfail.out "^\[$NSA:worker 0\] got signal 15\$" \
    && ok "--hosts: a failure's exit code, the others stopped" || bad "--hosts failure" "$T/hfail.out" "$T/hfail.err"
  # the launcher killed outright: each process's input closes and its watcher stops it
  PROBE_DIR="$T/sync" "$L" $H "ip netns exec" -- "$P" wait >"$T/hkill.out" 2>"$T/hkill.err" &
  pid=$!
  k=0; while [ "$(count_ready "$T/hkill.out")" -lt 3 ] && [ $k -lt 100 ]; do sleep 0.1; k=$((k + 1)); done
  kill -KILL $pid; wait $pid 2>/dev/null
  k=0; while [ -n "$(ip netns pids $NSA; ip netns pids $NSB)" ] && [ $k -lt 50 ]; do sleep 0.1; k=$((k + 1)); done
  left=$(ip netns pids $NSA; ip netns pids $NSB)
  [ "$(count_ready "$T/hkill.out")" = 3 ] && [ -z "$left" ] && ok "--hosts: nothing left running after the launcher is killed" \
    || { bad "--hosts: left running after SIGKILL: $left" "$T/hkill.out"; for q in $left; do kill -KILL $q; done; }
  E=$BUILD/examples/02_fashion_mnist
  if [ -x "$E" ] && [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    run htrain --hosts $NSA=10.231.9.1:1,$NSB=10.231.9.2:1 --rsh "ip netns exec" -- "$E" --strategy multi_worker_mirrored \
      --epochs 1 --limit 1024 --batch 64 --json --quiet --csv "$T/h.csv" --svg "$T/h.svg"
    [ "$(rc_of htrain)" = 0 ] && grep "^\[$NSA:worker 0\] {" "$T/htrain.out" | grep -q '"strategy":"multi_worker_mirrored"' \
      && ok "--hosts: multi_worker_mirrored trains across the two namespaces" || bad "--hosts training" "$T/htrain.out" "$T/htrain.err"
  else
    skip "--hosts training: no $E or no Fashion-MNIST"
  fi
  # elastic size across the hosts: worker 2 (the one on $NSB) is killed at step 30 and fails at
  # every restart; the two on $NSA go on from the checkpoint (each restarted process listens
  # where it did: before this was fixed the launcher bound the restarted workers' ports on
  # this machine and handed them the sockets, so worker 1 found nobody at 10.231.9.1:29500)
  M=$BUILD/examples/05_multi_worker
  if [ -x "$M" ] && [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    {
      echo '#!/bin/sh'
      echo 'if [ "$DTRAIN_SLOT" = 2 ] && [ "$DTRAIN_RESTART" -ge 1 ]; then echo "slot 2 is gone"; exit 7; fi'
      echo "exec $M --limit 3000 --epochs 2 --batch 120 --quiet --checkpoint $T/hel.safetensors --checkpoint-every 5 --crash-at 2:30"
    } > "$T/hel.sh"
    rm -f "$T/hel.safetensors"
    run hel --hosts $NSA=10.231.9.1:2,$NSB=10.231.9.2:1 --rsh "ip netns exec" --min-workers 2 --max-restarts 3 --grace 1 -- sh "$T/hel.sh"
    [ "$(rc_of hel)" = 0 ] && has hel.err 'restarting with 2 of 3 workers' && has hel.err 'the job ended with 2 of 3 workers' \
      && [ "$(grep -c "^\[$NSA:worker [01]\] rank [01]: final params_checksum" "$T/hel.out")" = 2 ] \
      && ok "--hosts with --min-workers: 3 -> 2 workers across the namespaces, from the checkpoint" \
      || bad "--hosts elastic size" "$T/hel.out" "$T/hel.err"
  else
    skip "--hosts elastic size: no $M or no Fashion-MNIST"
  fi
  ip netns del $NSA; ip netns del $NSB
fi

echo "launch_checks: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
