#!/bin/sh
# Compares tests/portable_run's output on every cross architecture with this
# machine's: "exact" lines must match bit for bit, "float" lines within a
# relative 1e-4. Then checkpoints cross over: each architecture loads the
# host's checkpoint and the host loads each architecture's, and the loaded
# parameters must equal the writer's bit for bit. Wire frames likewise: the
# bytes written are the same everywhere ("wire.bytes"), and each side
# decodes the other's frames to the values that were written.
# Prints "cross_compare: N passed, N failed". A pair "TRIPLE:win" is the
# Windows build (make windows), run under $WINE.
CROSS_ARCHS=${CROSS_ARCHS:-"aarch64-linux-gnu:aarch64 arm-linux-gnueabihf:arm s390x-linux-gnu:s390x"}
# The host's files in a directory of this run's own: CI compares several
# architectures at once, each lane with its own run of this script.
NAT=$(mktemp -d build/portable.native.XXXXXX) || exit 1
trap 'rm -rf "$NAT"' EXIT
build/tests/portable_run save $NAT/native.safetensors wsave $NAT/native.wire > $NAT/native.txt || { echo "cross_compare: 0 passed, 1 failed"; exit 1; }
info() { grep "^$1 info " "$2" | cut -d' ' -f3; }
pass=0; fail=0
for pair in $CROSS_ARCHS; do
  triple=${pair%%:*}; q=${pair##*:}
  if [ "$q" = win ]; then # make windows: the MinGW-w64 build under wine
    bin=build/win/tests/portable_run.exe; run="${WINE:-wine}"
  else
    bin=build/cross-$q/tests/portable_run; run="qemu-$q -L /usr/$triple"
  fi
  if ! $run $bin save build/portable.$q.safetensors load $NAT/native.safetensors \
      wsave build/portable.$q.wire wload $NAT/native.wire > build/portable.$q.txt 2> build/portable.$q.err; then
    echo "FAIL $triple: portable_run did not run"; cat build/portable.$q.err; fail=$((fail + 1)); continue
  fi
  if [ "$q" = win ]; then # its stdout is in text mode: lines end in CR LF
    tr -d '\r' < build/portable.$q.txt > build/portable.$q.lf && mv build/portable.$q.lf build/portable.$q.txt
  fi
  if awk -v arch="$triple" '
    NR == FNR { kind[$1] = $2; val[$1] = $3; next }
    {
      if ($2 == "info") next
      n++
      if (!($1 in val)) { printf "FAIL %s: unexpected key %s\n", arch, $1; bad++; next }
      if (kind[$1] == "exact") { if ($3 != val[$1]) { printf "FAIL %s: %s = %s, native %s\n", arch, $1, $3, val[$1]; bad++ } }
      else {
        a = $3 + 0; b = val[$1] + 0; d = a - b; if (d < 0) d = -d
        m = (a < 0 ? -a : a); if ((b < 0 ? -b : b) > m) m = (b < 0 ? -b : b)
        if (d > 1e-4 * m + 1e-6) { printf "FAIL %s: %s = %s, native %s\n", arch, $1, $3, val[$1]; bad++ }
      }
    }
    END { if (n == 0) { print "FAIL " arch ": no output"; bad++ } exit bad > 0 }' $NAT/native.txt build/portable.$q.txt
  then echo "ok $triple agrees with the native run ($(wc -l < build/portable.$q.txt) values)"; pass=$((pass + 1))
  else fail=$((fail + 1)); fi
  # Checkpoints: the host's, read there; theirs, read here.
  if [ -n "$(info train.checksum $NAT/native.txt)" ] && \
     [ "$(info load.checksum build/portable.$q.txt)" = "$(info train.checksum $NAT/native.txt)" ]; then
    echo "ok $triple reads the host's checkpoint bit for bit"; pass=$((pass + 1))
  else echo "FAIL $triple: the host's checkpoint loaded as $(info load.checksum build/portable.$q.txt)"; fail=$((fail + 1)); fi
  mine=$(build/tests/portable_run load build/portable.$q.safetensors | grep '^load.checksum info ' | cut -d' ' -f3)
  if [ -n "$mine" ] && [ "$mine" = "$(info train.checksum build/portable.$q.txt)" ]; then
    echo "ok the host reads the $triple checkpoint bit for bit"; pass=$((pass + 1))
  else echo "FAIL host: the $triple checkpoint loaded as $mine"; fail=$((fail + 1)); fi
  # Wire frames: theirs decode here and ours there to the values written.
  if [ -n "$(info wire.digest $NAT/native.txt)" ] && \
     [ "$(info wireload.digest build/portable.$q.txt)" = "$(info wire.digest $NAT/native.txt)" ]; then
    echo "ok $triple decodes the host's wire frames"; pass=$((pass + 1))
  else echo "FAIL $triple: the host's wire frames decoded as $(info wireload.digest build/portable.$q.txt)"; fail=$((fail + 1)); fi
  mine=$(build/tests/portable_run wload build/portable.$q.wire | grep '^wireload.digest info ' | cut -d' ' -f3)
  if [ -n "$mine" ] && [ "$mine" = "$(info wire.digest build/portable.$q.txt)" ]; then
    echo "ok the host decodes the $triple wire frames"; pass=$((pass + 1))
  else echo "FAIL host: the $triple wire frames decoded as $mine"; fail=$((fail + 1)); fi
done
echo "cross_compare: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
