#!/bin/sh
# make windows: the examples as a Windows user runs them, under wine (WINE,
# WINEPREFIX set by the Makefile). Prints "windows_checks: N passed, N failed".
#  1. examples/02 for two epochs (mirrored, 2 replicas) that rewrite the chart, the CSV
#     and the checkpoint every epoch (rename does not replace a file on Windows);
#  2. examples/02 --evaluate from that checkpoint: the accuracy the training reported;
#  3. examples/05 as two processes over TCP (Winsock): both ranks end with the same weights;
#  4. the same over an emulated slow link (DTRAIN_NETEM): the same weights again.
WINE=${WINE:-wine}
cd build/win || exit 1
pass=0; fail=0
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }
rm -f ex.svg ex.csv ex.ckpt ex.txt ev.txt mw0.txt mw1.txt ne0.txt ne1.txt
if $WINE examples/02_fashion_mnist.exe --model mlp --epochs 2 --limit 1000 --svg ex.svg --csv ex.csv \
     --checkpoint ex.ckpt --strategy mirrored --replicas 2 > ex.txt 2>&1 &&
   [ -s ex.svg ] && [ -s ex.ckpt ] && [ "$(grep -c '' ex.csv)" -ge 3 ]; then
  ok "02_fashion_mnist: 2 epochs rewrote the chart, the CSV and the checkpoint"
else
  cat ex.txt; bad "02_fashion_mnist: 2 epochs with --svg --csv --checkpoint"
fi
trained=$(sed -n 's/^test accuracy \([0-9.]*\) .*/\1/p' ex.txt | tr -d '\r')
if $WINE examples/02_fashion_mnist.exe --model mlp --evaluate --resume ex.ckpt --limit 1000 > ev.txt 2>&1; then
  got=$(sed -n 's/^test accuracy \([0-9.]*\) .*/\1/p' ev.txt | tr -d '\r')
  if [ -n "$got" ] && [ "$got" = "$trained" ]; then ok "02_fashion_mnist --evaluate: $got, as trained"
  else cat ev.txt; bad "02_fashion_mnist --evaluate: '$got', trained '$trained'"; fi
else
  cat ev.txt; bad "02_fashion_mnist --evaluate --resume ex.ckpt"
fi
P=$((30000 + $$ % 20000))
peers=127.0.0.1:$P,127.0.0.1:$((P + 1))
$WINE examples/05_multi_worker.exe --rank 0 --world 2 --peers $peers --epochs 1 --limit 1000 --quiet > mw0.txt 2>&1 &
r0pid=$!
$WINE examples/05_multi_worker.exe --rank 1 --world 2 --peers $peers --epochs 1 --limit 1000 --quiet > mw1.txt 2>&1
r1=$?
wait $r0pid
r0=$?
c0=$(sed -n 's/.*params_checksum=\([0-9a-f]*\).*/\1/p' mw0.txt | tr -d '\r')
c1=$(sed -n 's/.*params_checksum=\([0-9a-f]*\).*/\1/p' mw1.txt | tr -d '\r')
if [ "$r0" = 0 ] && [ "$r1" = 0 ] && [ -n "$c0" ] && [ "$c0" = "$c1" ]; then
  ok "05_multi_worker: 2 processes over TCP, both ranks end at params_checksum $c0"
else
  cat mw0.txt mw1.txt; bad "05_multi_worker over TCP: exit $r0/$r1, checksums '$c0' '$c1'"
fi
# the same over an emulated 50 Mbit/s link (DTRAIN_NETEM: a line thread per connection,
# polls over sockets some of which it leaves out): the same weights, only later
P=$((P + 2))
peers=127.0.0.1:$P,127.0.0.1:$((P + 1))
DTRAIN_NETEM="rate=50mbit,delay=2ms" $WINE examples/05_multi_worker.exe --rank 0 --world 2 --peers $peers --epochs 1 \
  --limit 1000 --quiet > ne0.txt 2>&1 &
r0pid=$!
DTRAIN_NETEM="rate=50mbit,delay=2ms" $WINE examples/05_multi_worker.exe --rank 1 --world 2 --peers $peers --epochs 1 \
  --limit 1000 --quiet > ne1.txt 2>&1
r1=$?
wait $r0pid
r0=$?
n0=$(sed -n 's/.*params_checksum=\([0-9a-f]*\).*/\1/p' ne0.txt | tr -d '\r')
n1=$(sed -n 's/.*params_checksum=\([0-9a-f]*\).*/\1/p' ne1.txt | tr -d '\r')
if [ "$r0" = 0 ] && [ "$r1" = 0 ] && [ -n "$n0" ] && [ "$n0" = "$n1" ] && [ "$n0" = "$c0" ]; then
  ok "05_multi_worker over an emulated 50 Mbit/s link: the same weights"
else
  cat ne0.txt ne1.txt; bad "05_multi_worker under DTRAIN_NETEM: exit $r0/$r1, checksums '$n0' '$n1' (unshaped '$c0')"
fi
echo "windows_checks: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
