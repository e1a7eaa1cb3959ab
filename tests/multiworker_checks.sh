#!/bin/sh
# multiworker_checks.sh -- examples/05_multi_worker end to end, several processes
# under tools/dtrain-launch on 127.0.0.1: a run agrees across ranks; a killed
# worker (kill -9) and a stalled one (SIGSTOP) make the others stop within the
# deadline with an error naming it; restarting from the last checkpoint after
# the failure ends bit for bit where the uninterrupted run ends. Parameter
# servers (examples/06): 2 workers x 2 servers learn; a killed worker is
# dropped and the other finishes. examples/02 across processes equals mirrored at the
# same --batch (global under every strategy); a --batch that does not divide is refused;
# tools/dtrain-bench reports right results.
# Prints "multiworker_checks: N passed, N failed, N skipped".
BUILD=${BUILD:-build}
EX=$BUILD/examples/05_multi_worker
L=tools/dtrain-launch
T=$BUILD/multiworker_checks
mkdir -p "$T"
pass=0; fail=0; skipped=0
# skip WHAT: why -- a check that cannot run here, counted and named in the summary.
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }
if [ ! -x "$EX" ] || [ ! -x "$L" ]; then
  echo "FAIL $EX or $L not built"; echo "multiworker_checks: 0 passed, 1 failed"; exit 1
fi
# --batch is the global batch: 128 over 2 workers is 64 rows a worker a step
ARGS="--limit 3000 --epochs 2 --quiet --batch 128"
export DTRAIN_TIMEOUT=5
sums() { sed -n 's/.*rank [0-9]*: final params_checksum=\([0-9a-f]*\).*/\1/p' "$1" | sort -u; }

# 1. two workers agree; the reference checksum for the restart check
if timeout 120 $L -n 2 -- $EX $ARGS > "$T/full.out" 2>&1 && [ "$(sums "$T/full.out" | wc -l)" = 1 ] &&
   [ "$(grep -c 'final params_checksum' "$T/full.out")" = 2 ]; then
  ok "2 workers finish with equal parameters ($(sums "$T/full.out"))"
else bad "2 workers: $(tail -n 5 "$T/full.out")"; fi
ref=$(sums "$T/full.out")

# 1b. --batch-per-worker keeps the old meaning of --batch: 64 a worker is --batch 128 over 2,
#     bit for bit; the two flags together are refused with the usage (exit 2)
if timeout 120 $L -n 2 -- $EX --limit 3000 --epochs 2 --quiet --batch-per-worker 64 > "$T/bpw.out" 2>&1 &&
   [ "$(sums "$T/bpw.out")" = "$ref" ] && [ -n "$ref" ]; then
  ok "05 --batch-per-worker 64 equals --batch 128 over 2 workers, bit for bit"
else bad "--batch-per-worker: $(sums "$T/bpw.out") vs $ref: $(tail -n 4 "$T/bpw.out")"; fi
$EX --batch 128 --batch-per-worker 64 > "$T/both.out" 2>&1; rc=$?
if [ $rc = 2 ] && grep -q 'error: --batch (global) and --batch-per-worker' "$T/both.out" && grep -q '^usage: 05_multi_worker' "$T/both.out"; then
  ok "05 --batch with --batch-per-worker is refused (exit 2)"
else bad "05 both batch flags: exit $rc: $(tail -n 3 "$T/both.out")"; fi
# --servers (parameter servers on MPI) is the MPI build's: over TCP it is refused, pointing at 06
$EX --servers 1 > "$T/servers.out" 2>&1; rc=$?
if [ $rc = 2 ] && grep -q "error: --servers is the MPI build's" "$T/servers.out" && grep -q '06_parameter_server' "$T/servers.out"; then
  ok "05 --servers without MPI is refused (exit 2), pointing at 06"
else bad "05 --servers over TCP: exit $rc: $(tail -n 3 "$T/servers.out")"; fi
# --sim-compute-ms / --sim-update-ms are for builds under SimGrid's smpicc (make simulate)
$EX --sim-compute-ms 1 > "$T/simc.out" 2>&1; rc=$?
if [ $rc = 2 ] && grep -q "error: --sim-compute-ms and --sim-update-ms are for a build under SimGrid" "$T/simc.out"; then
  ok "05 --sim-compute-ms outside SimGrid is refused (exit 2)"
else bad "05 --sim-compute-ms over TCP: exit $rc: $(tail -n 3 "$T/simc.out")"; fi

# 2. 2 workers x 2 threads: same as 4 replicas, agrees across ranks
if timeout 120 $L -n 2 -- $EX $ARGS --threads 2 > "$T/hier.out" 2>&1 && [ "$(sums "$T/hier.out" | wc -l)" = 1 ]; then
  ok "2 workers x 2 threads (hierarchical) finish with equal parameters"
else bad "hierarchical: $(tail -n 5 "$T/hier.out")"; fi

# 3. kill -9 of worker 1 in epoch 2: worker 0 fails naming it, within the deadline
rm -f "$T/ck.safetensors"
t0=$(date +%s)
timeout 120 $L -n 2 --grace 2 -- $EX $ARGS --checkpoint "$T/ck.safetensors" --crash-at 1:35 > "$T/crash.out" 2>&1
rc=$?; t1=$(date +%s)
if [ $rc -ne 0 ] && grep -q 'rank 0: step 35 failed: .*worker 1 (127.0.0.1:[0-9]*)' "$T/crash.out" &&
   grep -q 'allreduce #[0-9]*' "$T/crash.out" && [ $((t1 - t0)) -le 30 ]; then
  ok "kill -9 of a worker: the other stops naming it and the operation ($((t1 - t0)) s, exit $rc)"
else bad "kill -9: exit $rc after $((t1 - t0)) s: $(grep -v '^\[worker 0\] dtrain error' "$T/crash.out" | tail -n 6)"; fi

# 4. restart from the checkpoint of epoch 1: ends where the uninterrupted run ends, bit for bit
if [ -f "$T/ck.safetensors" ] && timeout 120 $L -n 2 -- $EX $ARGS --resume "$T/ck.safetensors" > "$T/resume.out" 2>&1 &&
   [ "$(sums "$T/resume.out")" = "$ref" ] && [ -n "$ref" ]; then
  ok "restart from the last checkpoint after the failure ends bit for bit as the uninterrupted run"
else bad "resume: $(sums "$T/resume.out") vs $ref: $(tail -n 4 "$T/resume.out")"; fi

# 4b. --max-restarts: a worker killed (kill -9) at several points -- before the first
#     checkpoint, rank 0 right after a save, late in epoch 2 (23 steps an epoch) -- and the launcher stops the
#     others and starts every worker again from the last checkpoint (--checkpoint-every 7
#     steps): the run ends bit for bit where the uninterrupted one ends
for c in 1:3 0:28 1:30 1:40; do
  rm -f "$T/mr.safetensors"
  timeout 120 $L -n 2 --grace 2 --max-restarts 1 -- $EX $ARGS --checkpoint "$T/mr.safetensors" --checkpoint-every 7 \
    --crash-at $c > "$T/mr.out" 2>&1; rc=$?
  if [ $rc = 0 ] && [ "$(sums "$T/mr.out")" = "$ref" ] && [ -n "$ref" ] &&
     grep -q "stopping every worker to start them all again from their checkpoint (restart 1 of 1)" "$T/mr.out"; then
    ok "--max-restarts: kill -9 at $c, every worker restarted from the last checkpoint, ends bit for bit as the uninterrupted run"
  else bad "--max-restarts, kill -9 at $c: exit $rc, $(sums "$T/mr.out") vs $ref: $(grep -v 'dtrain error' "$T/mr.out" | tail -n 6)"; fi
done
# 4d. elastic size (--min-workers 2, 3 workers, global batch 120 kept): worker 2 is killed at
#     step 30 and fails again at once after each restart (it does not come back): the job goes
#     on from the checkpoint with 2 workers (60 rows each), ends with both equal and the test
#     accuracy of the undisturbed 3-worker run within 0.02; in a second job, worker 1 fails
#     once in the 2-worker round and at that restart worker 2 is tried again and stays: the
#     job ends with 3 workers
EA="--limit 3000 --epochs 2 --batch 120 --quiet"
acc_of() { sed -n 's/.*final params_checksum=[0-9a-f]* test_accuracy=\([0-9.]*\).*/\1/p' "$1" | head -n 1; }
timeout 120 $L -n 3 -- $EX $EA > "$T/el_base.out" 2>&1
{
  echo '#!/bin/sh'
  echo 'if [ "$DTRAIN_SLOT" = 2 ] && [ "$DTRAIN_RESTART" -ge 1 ] && [ "${EL_BACK:-}" != "$DTRAIN_RESTART" ]; then echo "slot 2 is gone"; exit 7; fi'
  echo 'if [ "$DTRAIN_SLOT" = 1 ] && [ "$DTRAIN_RESTART" = "${EL_FAIL1:-none}" ]; then echo "slot 1 fails once"; exit 5; fi'
  echo "exec $EX $EA --checkpoint $T/el.safetensors --checkpoint-every 5 --crash-at 2:30"
} > "$T/el.sh"
rm -f "$T/el.safetensors"
timeout 120 $L -n 3 --min-workers 2 --max-restarts 3 --grace 1 -- sh "$T/el.sh" > "$T/el.out" 2>&1; rc=$?
a0=$(acc_of "$T/el_base.out"); a1=$(acc_of "$T/el.out")
if [ $rc = 0 ] && grep -q 'worker 2 exited with code 7 .* it does not come back' "$T/el.out" &&
   grep -q 'restarting with 2 of 3 workers' "$T/el.out" && grep -q 'the job ended with 2 of 3 workers' "$T/el.out" &&
   [ "$(grep -c 'final params_checksum' "$T/el.out")" = 2 ] && [ "$(sums "$T/el.out" | wc -l)" = 1 ] &&
   [ -n "$a0" ] && awk -v a="$a0" -v b="$a1" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.02) }'; then
  ok "--min-workers: 3 -> 2 workers from the checkpoint, global batch kept; test accuracy $a1 (3 workers undisturbed: $a0)"
else bad "--min-workers shrink: exit $rc, accuracy '$a1' vs '$a0': $(grep -v 'dtrain error' "$T/el.out" | tail -n 6)"; fi
rm -f "$T/el.safetensors"
EL_BACK=3 EL_FAIL1=2 timeout 120 $L -n 3 --min-workers 2 --max-restarts 3 --grace 1 -- sh "$T/el.sh" > "$T/el2.out" 2>&1; rc=$?
if [ $rc = 0 ] && grep -q 'restarting with 2 of 3 workers' "$T/el2.out" && grep -q 'worker 2 is tried again' "$T/el2.out" &&
   [ "$(grep -c 'final params_checksum' "$T/el2.out")" = 3 ] && ! grep -q 'the job ended with' "$T/el2.out"; then
  ok "--max-workers: the left-out worker is tried again at the next restart and the job ends with 3 workers"
else bad "--min-workers regrow: exit $rc: $(grep -v 'dtrain error' "$T/el2.out" | tail -n 6)"; fi

# 4c. kill -9 of rank 0 from outside at a moment it does not choose, while it saves a
#     checkpoint after every step (so the kill often lands in a save): still bit for bit
rm -f "$T/mr2.safetensors"
timeout 120 $L -n 2 --grace 2 --max-restarts 1 -- $EX $ARGS --checkpoint "$T/mr2.safetensors" --checkpoint-every 1 \
  > "$T/mr2.out" 2>&1 &
lp=$!; r0=""; k=0
while [ -z "$r0" ] && [ $k -lt 100 ]; do
  for c in $(for l in $(pgrep -P $lp 2>/dev/null); do pgrep -P $l; done 2>/dev/null); do # timeout > launcher > workers
    tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx 'DTRAIN_RANK=0' && r0=$c
  done
  [ -n "$r0" ] || sleep 0.05; k=$((k + 1))
done
# kill once its first checkpoint exists and it has saved 1-4 more (each save renames a new
# file into place: a new inode), so the kill lands while it trains and saves. (A fixed
# 0.1-0.7 s after the first save could land after the job's last step: the whole run is
# about half a second, and a kill that came too late read as a failed restart.)
k=0; while [ ! -f "$T/mr2.safetensors" ] && [ $k -lt 200 ]; do sleep 0.02; k=$((k + 1)); done
want=$(( $$ % 4 + 1 )); seen=0; k=0; ino=$(stat -c %i "$T/mr2.safetensors" 2>/dev/null)
while [ $seen -lt $want ] && [ $k -lt 400 ]; do
  now=$(stat -c %i "$T/mr2.safetensors" 2>/dev/null)
  if [ -n "$now" ] && [ "$now" != "$ino" ]; then seen=$((seen + 1)); ino=$now; fi
  sleep 0.005; k=$((k + 1))
done
[ -n "$r0" ] && kill -KILL "$r0" 2>/dev/null
wait $lp; rc=$?
if [ -n "$r0" ] && [ $rc = 0 ] && [ "$(sums "$T/mr2.out")" = "$ref" ] && grep -q 'restart 1 of 1' "$T/mr2.out" &&
   ! ls "$T"/mr2.safetensors.tmp-* >/dev/null 2>&1; then
  ok "--max-restarts: rank 0 killed from outside while saving every step: restarted, bit for bit, no temporary left"
else bad "--max-restarts, rank 0 killed from outside (pid ${r0:-none}): exit $rc, $(sums "$T/mr2.out") vs $ref: $(grep -v 'dtrain error' "$T/mr2.out" | tail -n 6)"; fi

# 5. SIGSTOP of worker 1: worker 0 times out naming it (DTRAIN_TIMEOUT=4 s)
t0=$(date +%s)
timeout 120 $L -n 2 --grace 1 -- $EX $ARGS --stall-at 1:10 > "$T/stall.out" 2>&1
rc=$?; t1=$(date +%s)
if [ $rc -ne 0 ] && grep -q 'rank 0: step 10 failed: .*worker 1 (127.0.0.1:[0-9]*)' "$T/stall.out" && [ $((t1 - t0)) -le 40 ]; then
  ok "SIGSTOP of a worker: the other gives up after the deadline naming it ($((t1 - t0)) s)"
else bad "SIGSTOP: exit $rc after $((t1 - t0)) s: $(grep -v 'dtrain error' "$T/stall.out" | tail -n 6)"; fi

# 6. three workers, a wrong token on one: refused, nobody trains with it
DTRAIN_TOKEN=s3cret timeout 60 $L -n 3 -- sh -c 'if [ "$DTRAIN_RANK" = 2 ]; then export DTRAIN_TOKEN=wrong; fi; exec "$0" "$@"' \
  $EX $ARGS --batch 120 > "$T/token.out" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -qi 'token\|authentication' "$T/token.out" && ! grep -q 'final params_checksum' "$T/token.out"; then
  ok "a worker with the wrong token is refused and no one trains with it"
else bad "token: exit $rc: $(tail -n 6 "$T/token.out")"; fi

# 7. parameter servers (examples/06_parameter_server): 2 workers x 2 servers learn
PS=$BUILD/examples/06_parameter_server
rm -rf "$T/psck"; mkdir -p "$T/psck"
if timeout 120 $L -n 2 --ps 2 -- $PS --limit 3000 --epochs 2 --checkpoint-dir "$T/psck" > "$T/ps.out" 2>&1 &&
   acc=$(sed -n 's/.*worker 0: test accuracy \([0-9.]*\).*/\1/p' "$T/ps.out") && [ -n "$acc" ] &&
   awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' && [ -f "$T/psck/ps-0-of-2.ckpt" ] && [ -f "$T/psck/ps-1-of-2.ckpt" ]; then
  ok "parameter servers: 2 workers x 2 servers reach test accuracy $acc, both shards checkpointed"
else bad "parameter servers: $(tail -n 6 "$T/ps.out")"; fi

# 7b. compressed pushes and pulls: 2 workers x 2 servers with powersgd:4 learn, and each worker
#     sends and receives fewer bytes per step than the float run above
if timeout 120 $L -n 2 --ps 2 -- $PS --limit 3000 --epochs 2 --compress powersgd:4 > "$T/psz.out" 2>&1 &&
   acc=$(sed -n 's/.*worker 0: test accuracy \([0-9.]*\).*/\1/p' "$T/psz.out") && [ -n "$acc" ] &&
   awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' &&
   f=$(sed -n 's/.*worker 0: wire \([0-9]*\) bytes\/step sent, \([0-9]*\) received (compress none).*/\1 \2/p' "$T/ps.out") &&
   z=$(sed -n 's/.*worker 0: wire \([0-9]*\) bytes\/step sent, \([0-9]*\) received (compress powersgd).*/\1 \2/p' "$T/psz.out") &&
   [ -n "$f" ] && [ -n "$z" ] && echo "$f $z" | awk '{ exit !($3 * 10 < $1 && $4 * 1.8 < $2) }'; then
  ok "parameter servers, powersgd:4: reach test accuracy $acc; bytes per step sent/received $z (floats: $f)"
else bad "parameter servers, compressed: $(tail -n 6 "$T/psz.out"; echo "floats: $f; compressed: $z")"; fi

# 7c. --overlap: each worker pushes and pulls in a second thread while its next step computes
#     (on the weights one pull older): 2 workers x 2 servers learn, and the pushes report the
#     extra staleness: every push after the first counts at least the worker's own last update,
#     never in the weights it computed on (so the mean is at least 93/94 here, whatever the
#     other worker did; the plain run's counts only the other's pushes)
if timeout 120 $L -n 2 --ps 2 -- $PS --limit 3000 --epochs 2 --overlap > "$T/psov.out" 2>&1 &&
   acc=$(sed -n 's/.*worker 0: test accuracy \([0-9.]*\).*/\1/p' "$T/psov.out") && [ -n "$acc" ] &&
   awk -v a="$acc" 'BEGIN { exit !(a > 0.6) }' &&
   sm=$(sed -n 's/.*worker 0: [0-9]* steps, .* staleness mean \([0-9.]*\) max.*/\1/p' "$T/psov.out") && [ -n "$sm" ] &&
   awk -v s="$sm" 'BEGIN { exit !(s >= 0.98) }'; then
  ok "parameter servers, --overlap: reach test accuracy $acc; staleness mean $sm (at least 1 a push after the first)"
else bad "parameter servers, --overlap: $(tail -n 6 "$T/psov.out")"; fi

# 8. a worker killed mid-run: the servers drop it, the other worker finishes, and the job
#    counts as finished (exit 0: a parameter-server job goes on without a dead worker)
rm -rf "$T/psck2"; mkdir -p "$T/psck2"
DTRAIN_TIMEOUT=10 timeout 120 $L -n 2 --ps 2 -- $PS --limit 3000 --epochs 2 --crash-at 1:15 > "$T/pskill.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'worker 0: test accuracy' "$T/pskill.out" && grep -q 'ps [01]: worker 1 .*lost' "$T/pskill.out" &&
   grep -q 'worker 1 killed by signal 9' "$T/pskill.out" && grep -q 'training finished with 1 of 2 workers (1 lost)' "$T/pskill.out"; then
  ok "parameter servers: a killed worker is dropped (logged), the other finishes; the launcher says so and exits 0"
else bad "ps worker kill: exit $rc: $(grep -v 'dtrain error' "$T/pskill.out" | tail -n 8)"; fi

# 8a. the same kill with --overlap (the worker may die while its thread is halfway through a push)
DTRAIN_TIMEOUT=10 timeout 120 $L -n 2 --ps 2 -- $PS --limit 3000 --epochs 2 --overlap --crash-at 1:15 > "$T/psovkill.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'worker 0: test accuracy' "$T/psovkill.out" && grep -q 'ps [01]: worker 1 .*lost' "$T/psovkill.out" &&
   grep -q 'training finished with 1 of 2 workers (1 lost)' "$T/psovkill.out"; then
  ok "parameter servers, --overlap: a killed worker is dropped, the other finishes; exit 0"
else bad "ps worker kill with --overlap: exit $rc: $(grep -v 'dtrain error' "$T/psovkill.out" | tail -n 8)"; fi

# 8b. --max-restarts with parameter servers: only the dead worker is started again; it
#     rejoins the servers under its rank, skips the steps its rank had pushed, and finishes:
#     both workers finish and the job exits 0
DTRAIN_TIMEOUT=10 timeout 120 $L -n 2 --ps 2 --max-restarts 1 -- $PS --limit 3000 --epochs 2 --crash-at 1:15 \
  > "$T/psrestart.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'worker 1 killed by signal 9; starting it again (restart 1 of 1): it rejoins the servers' "$T/psrestart.out" &&
   grep -q '\[worker 1\] worker 1: rejoined at clock [0-9]*; 15 of [0-9]* steps were done before' "$T/psrestart.out" &&
   grep -q 'worker 0: test accuracy' "$T/psrestart.out" && ! grep -q 'training finished with 1 of 2' "$T/psrestart.out"; then
  ok "parameter servers, --max-restarts: the killed worker alone is started again, rejoins after its 15 steps and finishes; exit 0"
else bad "ps --max-restarts: exit $rc: $(grep -v 'dtrain error' "$T/psrestart.out" | tail -n 8)"; fi

# 8c. --work-queue (dynamic data sharding): worker 2 of 3 is killed at its 10th batch, holding
#     it; server 0's queue hands that batch to another worker: all 1876 batches done exactly
#     once (1877 handed out, 1 given back), each server applied 1876 updates; a staleness bound
#     is refused with the queue. (30000 samples: with 3000 the two other workers could drain
#     the queue, 0.3 s, before a worker 2 started late on a loaded machine took any batch.)
DTRAIN_TIMEOUT=10 timeout 120 $L -n 3 --ps 2 -- $PS --limit 30000 --epochs 2 --batch 96 --work-queue --crash-at 2:10 \
  > "$T/queue.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'ps 0: work queue: 1876 of 1876 batches done, 1877 handed out, 1 given back' "$T/queue.out" &&
   [ "$(grep -c 'ps [01]: done, 1876 updates applied' "$T/queue.out")" = 2 ] && grep -q 'worker 0: test accuracy' "$T/queue.out"; then
  ok "parameter servers, --work-queue: a worker killed holding a batch; every batch trained on once (1876 of 1876, 1 given back)"
else bad "ps --work-queue: exit $rc: $(grep -v 'dtrain error' "$T/queue.out" | tail -n 8)"; fi
$PS --work-queue --max-staleness 2 > "$T/queue_bad.out" 2>&1; rc=$?
if [ $rc = 2 ] && grep -q 'work-queue needs --max-staleness -1' "$T/queue_bad.out"; then
  ok "parameter servers: --work-queue with a staleness bound is refused (exit 2)"
else bad "--work-queue --max-staleness 2: exit $rc: $(tail -n 3 "$T/queue_bad.out")"; fi

# 8d. --backup-workers (synchronous rounds on the servers, dt_ps_options.aggregate): 3 workers
#     x 2 servers in rounds of 2, worker 2 six times slower: its late pushes are dropped (it
#     says how many), the others train on and finish, and it stops with them; refused with
#     --work-queue. Ten epochs (600 rounds, ~1 s): with one (60 rounds, ~80 ms) a worker
#     started late on a loaded machine once found the rounds over after its first push.
DTRAIN_TIMEOUT=10 timeout 120 $L -n 3 --ps 2 -- $PS --limit 5760 --epochs 10 --batch 64 --backup-workers 1 --slow 2:6 \
  > "$T/backup.out" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q 'synchronous rounds of 2 pushes (1 backup)' "$T/backup.out" &&
   grep -Eq 'worker 2: [1-9][0-9]* of its [0-9]+ pushes came after their round closed' "$T/backup.out" &&
   [ "$(grep -c 'ps [01]: done, [0-9]* updates applied' "$T/backup.out")" = 2 ] && grep -q 'worker 0: test accuracy' "$T/backup.out"; then
  ok "parameter servers, --backup-workers 1: a 6x slower worker's late pushes dropped, the rounds go on; exit 0"
else bad "ps --backup-workers: exit $rc: $(grep -v 'dtrain error' "$T/backup.out" | tail -n 8)"; fi
$PS --backup-workers 1 --work-queue > "$T/backup_bad.out" 2>&1; rc=$?
if [ $rc = 2 ] && grep -q 'backup-workers: not with --work-queue' "$T/backup_bad.out"; then
  ok "parameter servers: --backup-workers with --work-queue is refused (exit 2)"
else bad "--backup-workers --work-queue: exit $rc: $(tail -n 3 "$T/backup_bad.out")"; fi

# 9. by hand, as across machines: --rank/--world/--peers, each process binding its own
#    address (no launcher), worker 1 started first, so that it retries dialling worker 0
#    until worker 0 is up a second later; ends where the launcher's run ends, bit for bit
ports=$(python3 -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))' 2>/dev/null)
if [ -n "$ports" ]; then
  peers="127.0.0.1:${ports% *},127.0.0.1:${ports#* }"
  timeout 120 $EX $ARGS --rank 1 --world 2 --peers "$peers" > "$T/hand1.out" 2>&1 &
  p1=$!
  sleep 1
  timeout 120 $EX $ARGS --rank 0 --world 2 --peers "$peers" > "$T/hand0.out" 2>&1; rc0=$?
  wait $p1; rc1=$?
  cat "$T/hand0.out" "$T/hand1.out" > "$T/hand.out"
  if [ $rc0 = 0 ] && [ $rc1 = 0 ] && [ "$(sums "$T/hand.out")" = "$ref" ] && [ -n "$ref" ] &&
     [ "$(grep -c 'final params_checksum' "$T/hand.out")" = 2 ]; then
    ok "by hand (--rank/--peers, worker 0 a second late): the same parameters as under the launcher"
  else bad "by hand: exit $rc0/$rc1: $(tail -n 3 "$T/hand0.out" "$T/hand1.out")"; fi
else skip "by-hand start: no python3 to find free ports"; fi

# 9b. examples/02 across processes: the same --batch 128 (global under every strategy)
#    under multi_worker_mirrored, 2 workers x 64 rows, equals mirrored over 2 replicas
#    (the same samples per step), and 2 workers x 2 threads equals mirrored(4), within
#    float rounding (the TCP ring sums in another order than the threads), and both report
#    "batch":128; parameter_server with 2 workers x 1 server learns
F=$BUILD/examples/02_fashion_mnist
FA="--data data/fashion-mnist --quiet --json --epochs 1 --limit 2048"
val() { grep -o "\"$2\":[0-9.]*" "$1" | head -n 1 | cut -d: -f2; }
close_to() { awk -v a="$1" -v b="$2" 'BEGIN { x = a - b; if (x < 0) x = -x; exit !(a > 0 && b > 0 && x <= 1e-4 * a) }'; }
for cfg in "1 2" "2 4"; do
  thr=${cfg% *}; reps=${cfg#* }
  if $F $FA --batch 128 --strategy mirrored --replicas $reps > "$T/f_mir$reps.json" 2>&1 &&
     timeout 120 $L -n 2 -- $F $FA --batch 128 --strategy multi_worker_mirrored --replicas $thr > "$T/f_mwm$reps.json" 2>&1 &&
     [ "$(val "$T/f_mir$reps.json" batch)" = 128 ] && [ "$(val "$T/f_mwm$reps.json" batch)" = 128 ] &&
     [ "$(val "$T/f_mir$reps.json" batch_per_worker)" = 128 ] && [ "$(val "$T/f_mwm$reps.json" batch_per_worker)" = 64 ] &&
     close_to "$(val "$T/f_mir$reps.json" test_loss)" "$(val "$T/f_mwm$reps.json" test_loss)" &&
     close_to "$(val "$T/f_mir$reps.json" final_loss)" "$(val "$T/f_mwm$reps.json" final_loss)"; then
    ok "02 multi_worker_mirrored 2 x $thr equals mirrored($reps) (test loss $(val "$T/f_mwm$reps.json" test_loss))"
  else bad "02 mwm 2 x $thr vs mirrored($reps): $(val "$T/f_mwm$reps.json" test_loss) vs $(val "$T/f_mir$reps.json" test_loss): $(tail -n 3 "$T/f_mwm$reps.json")"; fi
done
if timeout 120 $L -n 2 --ps 1 -- $F $FA --strategy parameter_server > "$T/f_ps.json" 2>&1 &&
   grep -q '"strategy":"parameter_server"' "$T/f_ps.json" && acc=$(val "$T/f_ps.json" test_accuracy) &&
   awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }'; then
  ok "02 parameter_server, 2 workers x 1 server, learns (test accuracy $acc)"
else bad "02 parameter_server: $(tail -n 4 "$T/f_ps.json")"; fi
# --push-early (pushes in parts during backward): 1 worker x 1 server ends with the same
# parameters as without (params_checksum) and says so in --json; refused for other kinds
ck() { grep -o '"params_checksum":"[0-9a-f]*"' "$1" | head -n 1; }
if timeout 120 $L -n 1 --ps 1 -- $F $FA --limit 1024 --strategy parameter_server > "$T/f_pe0.json" 2>&1 &&
   timeout 120 $L -n 1 --ps 1 -- $F $FA --limit 1024 --strategy parameter_server --push-early --bucket-kb 64 > "$T/f_pe1.json" 2>&1 &&
   [ -n "$(ck "$T/f_pe0.json")" ] && [ "$(ck "$T/f_pe0.json")" = "$(ck "$T/f_pe1.json")" ] &&
   grep -q '"push_early":1' "$T/f_pe1.json" && grep -q '"push_early":0' "$T/f_pe0.json"; then
  ok "02 parameter_server --push-early ends where the plain pushes do ($(ck "$T/f_pe1.json"))"
else bad "02 --push-early: $(ck "$T/f_pe0.json") vs $(ck "$T/f_pe1.json"): $(tail -n 2 "$T/f_pe1.json")"; fi
if $F $FA --strategy mirrored --push-early > "$T/f_pe2.out" 2>&1; then bad "02 mirrored --push-early was not refused"
elif [ $? = 2 ] && grep -q "push-early is for --strategy parameter_server" "$T/f_pe2.out"; then
  ok "02 --push-early refused for mirrored, with the reason"
else bad "02 mirrored --push-early: $(tail -n 2 "$T/f_pe2.out")"; fi
# 9b. --json's totals (issue 21 part 6): all workers together, and where the time went.
#     Lock-step workers: the job's samples/s is the workers' count times worker 0's own;
#     parameter servers: every push the servers applied while worker 0 trained (at least
#     its own); the time shares are fractions that add up to 1, with communication in them
shares='s = d["time_shares"]; assert set(s) == {"compute", "communication", "waiting", "other"}, s; assert all(0 <= v <= 1 for v in s.values()) and abs(sum(s.values()) - 1) < 1e-3 and s["compute"] > 0 and s["communication"] > 0, s'
for f in "$T/f_mwm2.json" "$T/f_ps.json"; do grep '^.worker 0. {' "$f" | sed 's/^.worker 0. //' > "$f.w0"; done
if python3 -c "
import json
d = json.load(open('$T/f_mwm2.json.w0'))
assert d['workers'] == 2 and d['global_batch'] == 128 and abs(d['global_samples_per_sec'] - 2 * d['samples_per_sec']) <= 2, d
$shares
d = json.load(open('$T/f_ps.json.w0'))
assert d['workers'] == 2 and d['global_batch'] == 64 and d['global_samples_per_sec'] >= d['samples_per_sec'] > 0, d
$shares
d = json.load(open('$T/f_mir2.json'))
assert d['workers'] == 1 and d['global_samples_per_sec'] == d['samples_per_sec'] and d['time_shares']['communication'] == 0, d
" > "$T/shares.out" 2>&1; then
  ok "02 --json: global samples/s and batch (workers x own for lock-step, the servers' pushes for parameter_server), time shares adding up to 1"
else bad "02 --json totals: $(tail -n 3 "$T/shares.out")"; fi

# 9d. --plan under the launcher: workers 0 and 1 probe the link between them (here an
#     emulated one) and worker 0 alone prints the plan for it, one JSON line; the others
#     (a third worker, a parameter server) exit 0 without output of their own
if DTRAIN_NETEM="rate=100mbit,delay=1ms" timeout 120 $L -n 3 --ps 1 -- $F --data data/fashion-mnist --plan --plan-workers 4 --json > "$T/pprobe.out" 2>&1 &&
   [ "$(grep -c '^\[worker 0\] {' "$T/pprobe.out")" = 1 ] && ! grep -q '^\[worker [12]\] \|^\[ps 0\] ' "$T/pprobe.out" &&
   grep '^\[worker 0\] {' "$T/pprobe.out" | sed 's/^\[worker 0\] //' | python3 -c "
import json, sys
d = json.load(sys.stdin)
l = d['link']
assert l['probed'] is True and l['spec'] == 'probed' and l['latency_s'] > 0 and l['bandwidth_Bps'] > 0, l
assert d['shared_cores'] == 1 and any(s['name'] == 'multi_worker_mirrored ring' for s in d['strategies']), d
" > "$T/pprobe.err" 2>&1; then
  ok "02 --plan under the launcher: the link probed between workers 0 and 1, one plan from worker 0"
else bad "02 --plan probe: $(tail -n 4 "$T/pprobe.out" "$T/pprobe.err")"; fi

# 9c. a --batch that does not divide over workers x replicas is refused with exit 2 and a
#     message naming both numbers, before any data is loaded (the data dir does not exist,
#     and the message is about the batch, not the data): 02 in one process and across 3,
#     05 and 06 across 3
$F --batch 100 --strategy mirrored --replicas 3 --data /nonexistent > "$T/div1.out" 2>&1; rc1=$?
timeout 60 $L -n 3 -- $F --batch 100 --strategy multi_worker_mirrored --replicas 2 --data /nonexistent > "$T/div2.out" 2>&1; rc2=$?
timeout 60 $L -n 3 -- $EX --batch 100 --data /nonexistent > "$T/div3.out" 2>&1; rc3=$?
timeout 60 $L -n 3 --ps 1 -- $PS --batch 100 --data /nonexistent > "$T/div4.out" 2>&1; rc4=$?
if [ $rc1 = 2 ] && grep -q '^error: --batch 100 does not divide over 1 worker x 3 replicas = 3$' "$T/div1.out" &&
   [ $rc2 = 2 ] && [ "$(grep -c 'error: --batch 100 does not divide over 3 workers x 2 replicas = 6$' "$T/div2.out")" = 3 ] &&
   [ $rc3 = 2 ] && [ "$(grep -c 'error: --batch 100 does not divide over 3 workers x 1 replica = 3$' "$T/div3.out")" = 3 ] &&
   [ $rc4 = 2 ] && grep -q 'error: --batch 100 does not divide over 3 workers x 1 replica = 3$' "$T/div4.out" &&
   ! grep -q nonexistent "$T/div1.out" "$T/div2.out" "$T/div3.out" "$T/div4.out"; then
  ok "a --batch that does not divide over workers x replicas is refused (exit 2) before loading data (02, 05, 06)"
else bad "indivisible --batch: exits $rc1 $rc2 $rc3 $rc4: $(tail -n 12 "$T/div1.out" "$T/div2.out" "$T/div3.out" "$T/div4.out")"; fi

# 10. tools/dtrain-bench: nccl-tests columns, every element right, for threads, forked tcp
#     ranks and tcp ranks under the launcher (sizes below the world, odd and ring-sized)
B=tools/dtrain-bench
benchok() { grep -q '^# *size *count *type *time *algbw *busbw *#wrong' "$1" &&
  [ "$(grep -cE '^ *[0-9]+ +[0-9]+ +float +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$' "$1")" = "$2" ] &&
  ! grep -qE '^ *[0-9]+ +[0-9]+ +float .* [1-9][0-9]*$' "$1"; }
if [ -x "$B" ]; then
  if timeout 60 $B --backend threads -n 3 -b 8 -e 1M -f 16 --iters 3 --warmup 1 > "$T/b_thr.out" 2>&1 && benchok "$T/b_thr.out" 6 &&
     timeout 60 $B --backend tcp -n 3 -b 8 -e 1M -f 16 --iters 3 --warmup 1 > "$T/b_tcp.out" 2>&1 && benchok "$T/b_tcp.out" 6 &&
     timeout 60 $L -n 2 -- $B --backend tcp -b 4 -e 300K -f 9 --iters 3 --warmup 1 > "$T/b_launch.out" 2>&1 &&
     sed 's/^\[worker 0\] //' "$T/b_launch.out" > "$T/b_launch.txt" && benchok "$T/b_launch.txt" 7; then
    ok "dtrain-bench: threads, tcp and tcp under the launcher report every size with 0 wrong"
  else bad "dtrain-bench: $(tail -n 4 "$T/b_thr.out" "$T/b_tcp.out" "$T/b_launch.out" 2>/dev/null)"; fi
else bad "dtrain-bench: $B not built"; fi

echo "multiworker_checks: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
