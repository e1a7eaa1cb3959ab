#!/bin/sh
# The examples as a user runs them: 01_xor learns; 02_fashion_mnist trains on
# the shipped test split, prints its JSON line, resumes from a checkpoint
# bitwise, and refuses bad flags and bad files with a clear message.
# Prints "example_checks: N passed, N failed".
BUILD=${BUILD:-build}
T="$BUILD/example_checks"
rm -rf "$T"; mkdir -p "$T"
E="$BUILD/examples/02_fashion_mnist"
D="data/fashion-mnist"
pass=0; fail=0
check() { name=$1; shift
  if out=$("$@" 2>&1); then echo "ok $name"; pass=$((pass + 1)); else echo "FAIL $name"; printf '%s\n' "$out" | tail -n 15; fail=$((fail + 1)); fi; }
sum() { grep -o '"params_checksum":"[0-9a-f]*"' "$1"; }
check "xor-learns" sh -c "$BUILD/examples/01_xor | tail -n 4 | grep -q '1 xor 1 -> 0.0'"
common="--data $D --quiet --json --csv $T/m.csv --svg $T/m.svg"
check "fmnist-json-line" sh -c "$E $common --epochs 1 > $T/one.json && grep -q '\"model\":\"mlp\"' $T/one.json && grep -q '\"test_accuracy\":0\.[5-9]' $T/one.json && grep -q '\"samples_per_sec\"' $T/one.json"
check "fmnist-svg-and-csv" sh -c "grep -q '<svg' $T/m.svg && grep -q '</svg>' $T/m.svg && head -n 1 $T/m.csv | grep -q 'epoch' && test \$(wc -l < $T/m.csv) -ge 2"
check "fmnist-resume-bitwise" sh -c "$E $common --epochs 2 > $T/straight.json && $E $common --epochs 1 --checkpoint $T/ck.safetensors > /dev/null && $E $common --epochs 2 --resume $T/ck.safetensors > $T/resumed.json && test \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/straight.json)\" = \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/resumed.json)\""
check "fmnist-same-seed-same-bits" sh -c "$E $common --epochs 1 > $T/again.json && test \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/one.json)\" = \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/again.json)\""
check "fmnist-cnn-runs" sh -c "$E $common --model cnn --epochs 1 --limit 512 > $T/cnn.json && grep -q '\"model\":\"cnn\"' $T/cnn.json"
check "fmnist-mirrored-repeats-bitwise" sh -c "$E $common --epochs 1 --limit 2048 --strategy mirrored --replicas 2 > $T/mir1.json && $E $common --epochs 1 --limit 2048 --strategy mirrored --replicas 2 > $T/mir2.json && test \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/mir1.json)\" = \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/mir2.json)\" && grep -q '\"replicas\":2' $T/mir1.json"
check "fmnist-central-storage-equals-mirrored" sh -c "$E $common --epochs 1 --limit 2048 --strategy central_storage --replicas 2 > $T/cs.json && test \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/cs.json)\" = \"\$(grep -o '\"params_checksum\":\"[0-9a-f]*\"' $T/mir1.json)\""
check "fmnist-async-runs" sh -c "$E $common --epochs 1 --limit 2048 --strategy async --replicas 2 --max-staleness 2 > $T/as.json && grep -q '\"strategy\":\"async\"' $T/as.json"
check "fmnist-bad-strategy" sh -c "! $E --strategy nope > $T/bad5.txt 2>&1 && grep -q 'error:' $T/bad5.txt"
check "fmnist-bad-flag" sh -c "! $E --model rnn > $T/bad.txt 2>&1 && grep -q 'mlp or cnn' $T/bad.txt"
check "fmnist-bad-data-dir" sh -c "! $E --data /nonexistent > $T/bad2.txt 2>&1 && grep -q 'error:' $T/bad2.txt && grep -q '/nonexistent' $T/bad2.txt"
check "fmnist-corrupt-checkpoint" sh -c "head -c 100 $T/ck.safetensors > $T/bad.safetensors && ! $E $common --epochs 2 --resume $T/bad.safetensors > $T/bad3.txt 2>&1 && grep -q 'error:' $T/bad3.txt"
check "fmnist-cnn-checkpoint-into-mlp" sh -c "$E $common --model cnn --epochs 1 --limit 256 --checkpoint $T/cnn.safetensors > /dev/null && ! $E $common --epochs 2 --resume $T/cnn.safetensors > $T/bad4.txt 2>&1 && grep -qi 'mismatch\|does not match\|missing\|unknown' $T/bad4.txt"
echo "example_checks: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
