#!/bin/sh
# tools/check_codegen.sh -- SIMD kernels the compiler scalarised.
#
#   sh tools/check_codegen.sh OBJECT...
#
# dtrain's x86 kernels are functions with target("avx2,fma") / ("avx512f")
# attributes inside a build that may have no -march flag at all (the header
# dropped into a plain -O2 project). There gcc 12 once compiled an
# _mm256_blendv_ps into eight lane extracts and branches (the async store's
# add 4x slower, in exactly the builds our benchmarks, at -march=native, never
# make). This check disassembles each OBJECT (x86-64 only) and fails for a
# function with more than MAX_EXTRACTS (2) lane extracts or inserts
# (vpextr*, vextractps, vpinsr*, vinsertps): a kernel does not move single
# lanes in and out of its vectors. Prints "check_codegen: N functions, N
# flagged" and exits non-zero when any is flagged; exits 77 with "skipped" on
# other architectures or without objdump (tests/compile_checks.sh counts that
# as a skip, not a pass).
#
# Allowed (ALLOW, space-separated names): dt__bf16_pairs scatters each of its
# 16 converted lanes to its own strided address through a small array, which
# clang turns into one extract per lane: those are its stores, not a lost vector.
MAX=${MAX_EXTRACTS:-2}
ALLOW=${ALLOW:-dt__bf16_pairs}
command -v objdump >/dev/null 2>&1 || { echo "check_codegen: skipped (no objdump)"; exit 77; }
status=0
for obj in "$@"; do
  [ -f "$obj" ] || { echo "check_codegen: $obj: no such file"; status=1; continue; }
  if ! objdump -f "$obj" | grep -q 'x86-64'; then
    echo "check_codegen: $obj: skipped (not x86-64)"
    [ "$status" = 0 ] && status=77
    continue
  fi
  objdump -d --no-show-raw-insn "$obj" | awk -v max="$MAX" -v obj="$obj" -v allow="$ALLOW" '
    /^[0-9a-f]+ <.*>:$/ { f = $2; nf++; next }
    /\t(vpextr[bwdq]|vextractps|vpinsr[bwdq]|vinsertps) / { c[f]++ }
    END {
      bad = 0
      n = split(allow, al, " ")
      for (i = 1; i <= n; i++) ok["<" al[i] ">:"] = 1
      for (k in c) if (c[k] > max && !(k in ok)) { printf "  %s: %d lane extracts/inserts in %s\n", obj, c[k], k; bad++ }
      printf "check_codegen: %s: %d functions, %d flagged\n", obj, nf, bad
      exit bad > 0
    }' || status=1
done
exit $status
