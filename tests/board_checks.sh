#!/bin/sh
# A trained model on a small board (issue 22 item 17): examples/02 trains an MLP,
# tools/dtrain-ckpt export-c writes it as C source, examples/board/board_inference.c
# (no threads, no stdio, no malloc in the library; a 16 KiB fixed buffer) predicts
# with it. Checked: the header holds every float bit for bit (tests/board_export_check.c);
# the board program gets the same test samples right as dtrain's own --evaluate; the
# export refuses a NaN weight, a non-F32 tensor, a bad prefix and an unwritable path,
# leaving nothing behind; an armhf build under qemu predicts what the host build does.
# Prints sizes and peak memory (reported, not asserted), and
# "board_checks: N passed, N failed, N skipped".
BUILD=${BUILD:-build}
CC=${CC:-cc}
T=$BUILD/board_checks
rm -rf "$T"; mkdir -p "$T"
pass=0; fail=0; skipped=0
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; shift; for f in "$@"; do echo "--- $f"; tail -n 20 "$f"; done; fail=$((fail + 1)); }
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
finish() { echo "board_checks: $pass passed, $fail failed, $skipped skipped"; [ "$fail" -eq 0 ]; exit $?; }
E=$BUILD/examples/02_fashion_mnist; K=tools/dtrain-ckpt
D=/usr/share/datasets/fashion-mnist
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3

# -- the export's refusals (any safetensors file: made with numpy when it is here)
if [ -x "$K" ] && "$PY" -c 'import numpy' 2>/dev/null; then
  "$PY" - "$T" <<'PYEOF'
import sys; sys.path.insert(0, "tools")
import numpy as np, dtrain_torch as dtt
t = sys.argv[1]
w = np.ones((2, 3), np.float32); w[1, 2] = np.nan
dtt.save({"fc1.weight": w, "fc1.bias": np.zeros(2, np.float32)}, t + "/nan.st")
dtt.save({"a.b": np.ones(2, np.float32), "a_b": np.ones(2, np.float32)}, t + "/clash.st")
dtt.save({"fc1.weight": np.ones((2, 3), np.float32)}, t + "/one.st")
PYEOF
  "$K" export-c "$T/nan.st" -o "$T/nan.h" 2>"$T/nan.err"; rc=$?
  [ $rc = 1 ] && grep -q "'fc1.weight' element 5 is NaN" "$T/nan.err" && [ ! -e "$T/nan.h" ] && [ -z "$(ls "$T" | grep tmp)" ] \
    && ok "export refuses a NaN weight, writes nothing" || bad "export: NaN (rc $rc)" "$T/nan.err"
  "$K" export-c "$T/clash.st" -o "$T/clash.h" 2>"$T/clash.err"; rc=$?
  [ $rc = 1 ] && grep -q "both become the C name model_a_b" "$T/clash.err" && ok "export refuses two names with one C name" || bad "export: clash (rc $rc)" "$T/clash.err"
  "$K" export-c "$T/one.st" -o "$T/one.h" --prefix 9lives 2>"$T/prefix.err"; rc=$?
  [ $rc = 1 ] && grep -q "not a C identifier" "$T/prefix.err" && ok "export refuses a prefix that is not a C identifier" || bad "export: prefix (rc $rc)" "$T/prefix.err"
  "$K" export-c "$T/one.st" -o "$T/no-such-dir/one.h" 2>"$T/dir.err"; rc=$?
  [ $rc = 1 ] && grep -q "no-such-dir" "$T/dir.err" && ok "export to a directory that does not exist: an error naming it" || bad "export: no dir (rc $rc)" "$T/dir.err"
  printf 'not tensors\n' >"$T/text.st"
  "$K" export-c "$T/text.st" -o "$T/text.h" 2>"$T/text.err"; rc=$?
  [ $rc = 1 ] && [ ! -e "$T/text.h" ] && ok "export of a file that is not safetensors: refused" || bad "export: text (rc $rc)" "$T/text.err"
else
  skip "export refusals: no $K or no numpy"
fi

if [ ! -x "$E" ] || [ ! -f "$D/t10k-images-idx3-ubyte.gz" ]; then
  skip "board inference: no $E or no $D (dataset-fashion-mnist)"
  finish
fi
# -- train, export, check the header bit for bit
"$E" --epochs 1 --limit 6000 --checkpoint "$T/mlp.ckpt" --json --quiet --csv "$T/m.csv" --svg "$T/m.svg" >"$T/train.json" 2>"$T/train.err" \
  && "$K" export-c "$T/mlp.ckpt" -o "$T/model.h" 2>"$T/export.err" \
  && ok "train, then export-c" || { bad "train/export" "$T/train.err" "$T/export.err"; finish; }
right=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d['test_accuracy']*d['test_samples']))" "$T/train.json")
$CC -std=c11 -O1 -I. -Itests -I"$T" -DMODEL_HEADER='"model.h"' tests/board_export_check.c "$BUILD/dtrain.o" -o "$T/export_check" -lm -lpthread 2>"$T/ec.err" \
  && "$T/export_check" "$T/mlp.ckpt" >"$T/ec.out" 2>&1 && grep -q "^export: 6 tensors, 235146 floats identical" "$T/ec.out" \
  && ok "the header holds the checkpoint's 6 tensors, every float bit for bit" || bad "export bit for bit" "$T/ec.err" "$T/ec.out"
# -- the board program, on this machine: the same samples right as dtrain's own evaluation
W="-std=c11 -O2 -Wall -Wextra -Wpedantic -Werror"
$CC $W -I"$T" -I. examples/board/board_inference.c -o "$T/board" -lm 2>"$T/board.err" \
  && ok "board_inference builds with NO_THREADS, NO_STDIO, NO_MALLOC, NO_DIST, NO_DATA, NO_FIT (-Wall -Wextra -Wpedantic -Werror)" \
  || { bad "board build" "$T/board.err"; finish; }
zcat "$D/t10k-images-idx3-ubyte.gz" | tail -c +17 >"$T/images.raw"
zcat "$D/t10k-labels-idx1-ubyte.gz" | tail -c +9 | od -An -v -tu1 | tr -s ' ' '\n' | grep -v '^$' >"$T/labels.txt"
"$T/board" <"$T/images.raw" >"$T/pred.txt" 2>"$T/board.run"
got=$(paste -d' ' "$T/pred.txt" "$T/labels.txt" | awk '$1 == $2' | wc -l)
[ "$(wc -l <"$T/pred.txt")" = 10000 ] && [ "$got" = "$right" ] \
  && ok "the board program gets $got of 10000 right, as dtrain's evaluation ($right)" \
  || bad "board predictions: $got right, dtrain $right" "$T/board.run"
echo "  host: $(tail -1 "$T/board.run")"
echo "  host: size (text = code + the weights' 940584 bytes): $(size "$T/board" | tail -1 | awk '{print "text " $1 ", data " $2 ", bss " $3}')"
head -c 100 "$T/images.raw" | "$T/board" >/dev/null 2>"$T/partial.err"; rc=$?
[ $rc = 2 ] && grep -q "not a whole image" "$T/partial.err" && ok "input that is not whole images: exit 2" || bad "partial input (rc $rc)" "$T/partial.err"
# -- armhf, statically linked, under qemu: the same predictions as on this machine
if command -v arm-linux-gnueabihf-gcc >/dev/null 2>&1 && command -v qemu-arm >/dev/null 2>&1; then
  arm-linux-gnueabihf-gcc $W -static -I"$T" -I. examples/board/board_inference.c -o "$T/board_armhf" -lm 2>"$T/armhf.err" \
    || { bad "armhf build" "$T/armhf.err"; finish; }
  head -c $((300 * 784)) "$T/images.raw" | QEMU_LD_PREFIX=/usr/arm-linux-gnueabihf timeout 300 qemu-arm "$T/board_armhf" >"$T/pred_armhf.txt" 2>"$T/armhf.run"
  head -300 "$T/pred.txt" | cmp -s - "$T/pred_armhf.txt" && [ "$(wc -l <"$T/pred_armhf.txt")" = 300 ] \
    && ok "armhf (qemu-arm, static): the first 300 predictions are the host's" || bad "armhf predictions" "$T/armhf.run" "$T/pred_armhf.txt"
  echo "  armhf: $(tail -1 "$T/armhf.run")"
  echo "  armhf: size (static, libc included): $(size "$T/board_armhf" | tail -1 | awk '{print "text " $1 ", data " $2 ", bss " $3}')"
else
  skip "armhf board build: no arm-linux-gnueabihf-gcc or qemu-arm (gcc-arm-linux-gnueabihf, qemu-user)"
fi
finish
