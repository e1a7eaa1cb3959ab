#!/bin/sh
# Build-configuration checks: the shipped header compiles cleanly with gcc and
# clang in strict C11, as C++17, with DTRAIN_STATIC in two translation units,
# and each src/*.c compiles alone. Prints "compile_checks: N passed, N failed,
# N skipped" (a skip: a compiler or library this machine lacks).
BUILD=${BUILD:-build}
D="$BUILD/compile_checks"
mkdir -p "$D"
pass=0; fail=0; skipped=0
# skip WHAT: why -- a check that cannot run here, counted and named in the summary.
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
W="-Wall -Wextra -Wpedantic -Werror"
# WQ: the same without gcc's -Wmisleading-indentation, which costs it 1.9 s of
# every compile of the implementation (4.9 s at -O0): its line lookups scan
# the file, so its time grows with the square of the header's length (40,000
# lines of single-statement ifs here). Indentation does not depend on a
# switch or a language: the warning stays on where the code is read for
# warnings (gcc-c11-O3 whole, gcc-c11-edge with every switch, clang
# everywhere, make's own build) and is off where a check is about something
# else (a link, a library, the API, a run).
WQ="$W -Wno-misleading-indentation"
wq() { if [ "$1" = gcc ] || [ "$1" = g++ ]; then echo "$WQ"; else echo "$W"; fi; } # CC: its flags
# check NAME COMMAND...: runs in the background, CHECK_JOBS at a time (default
# 2: most checks are one compiler run on one core); its verdict goes to a
# numbered file, read back in order by check_sync. A check that needs another
# one's output comes after a check_sync.
JOBS=${CHECK_JOBS:-2}
secs_since() { echo "$1 $(date +%s.%N)" | awk '{ printf "%.1f", $2 - $1 }'; }
nchk=0; pids=""
check() { # name, command...
  name=$1; shift
  nchk=$((nchk + 1))
  ( t0=$(date +%s.%N)
    if out=$("$@" 2>&1); then echo "ok $name ($(secs_since "$t0") s)"
    else echo "FAIL $name: $*"; printf '%s\n' "$out" | head -n 20; fi ) > "$D/check.$nchk" 2>&1 &
  pids="$pids $!"
  set -- $pids
  if [ $# -ge "$JOBS" ]; then wait "$1"; shift; pids="$*"; fi
}
# Waits for every check started so far and counts their verdicts.
nread=0
check_sync() {
  wait
  pids=""
  while [ "$nread" -lt "$nchk" ]; do
    nread=$((nread + 1))
    cat "$D/check.$nread"
    if head -n 1 "$D/check.$nread" | grep -q '^ok '; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
  done
}
printf '#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint main(void){ return dt_build_features() == 0; }\n' > "$D/impl.c"
cp "$D/impl.c" "$D/impl.cpp"
for cc in gcc clang; do
  command -v $cc >/dev/null 2>&1 || { skip "$cc-c11*: no $cc"; continue; }
  # gcc at -O3 (as many users build: it inlines more there, and its flow warnings,
  # -Wstringop-overflow, -Wmaybe-uninitialized, -Wformat-truncation, see more; the
  # Makefile's build is the -O2 one, in parts), clang at -O2.
  if [ "$cc" = gcc ]; then lvl=-O3; else lvl=-O2; fi
  check "$cc-c11$([ $cc = gcc ] && echo -O3)" $cc -std=c11 $W $lvl -I. "$D/impl.c" -o "$D/impl_$cc" -lm -lpthread
  check "$cc-c11-no-threads" $cc -std=c11 $(wq $cc) -DDTRAIN_NO_THREADS -DDTRAIN_NO_NET -I. -c "$D/impl.c" -o "$D/impl_nt_$cc.o"
  check "$cc-c11-no-stdio" $cc -std=c11 $(wq $cc) -DDTRAIN_NO_STDIO -I. -c "$D/impl.c" -o "$D/impl_ns_$cc.o"
  # The edge switches, each alone, and the smallest build with all of them.
  # gcc builds them (each alone at -O1, where its flow warnings already run;
  # all of them at -O2, as the full build is at -O3) and the API check below
  # reads its objects; clang's warnings come from its front end, so it only
  # parses them.
  for sw in DIST DATA FIT; do
    if [ "$cc" = gcc ]; then
      check "$cc-c11-no-$sw" $cc -std=c11 $WQ -O1 -DDTRAIN_NO_$sw -I. -c "$D/impl.c" -o "$D/impl_no${sw}_$cc.o"
    else
      check "$cc-c11-no-$sw" $cc -std=c11 $W -fsyntax-only -DDTRAIN_NO_$sw -I. "$D/impl.c"
    fi
  done
  check "$cc-c11-edge" $cc -std=c11 $W -O2 -DDTRAIN_NO_THREADS -DDTRAIN_NO_DIST -DDTRAIN_NO_DATA -DDTRAIN_NO_FIT \
    -DDTRAIN_NO_STDIO -I. -c "$D/impl.c" -o "$D/impl_edge_$cc.o"
done
# Strict warnings (issue 22 item 3): the implementation is clean under -Wshadow -Wconversion
# (sign conversions included) -Wstrict-prototypes -Wmissing-prototypes too, full and with the
# main switches, gcc and clang (front-end warnings: a syntax pass is enough).
SW="-Wshadow -Wconversion -Wstrict-prototypes -Wmissing-prototypes"
for cc in gcc clang; do
  command -v $cc >/dev/null 2>&1 || { skip "$cc strict warnings: no $cc"; continue; }
  check "$cc-strict-warnings" $cc -std=c11 $(wq $cc) $SW -fsyntax-only -I. "$D/impl.c"
  check "$cc-strict-warnings-no-threads-no-net" $cc -std=c11 $(wq $cc) $SW -DDTRAIN_NO_THREADS -DDTRAIN_NO_NET -fsyntax-only -I. "$D/impl.c"
  check "$cc-strict-warnings-no-dist-no-stdio" $cc -std=c11 $(wq $cc) $SW -DDTRAIN_NO_DIST -DDTRAIN_NO_STDIO -fsyntax-only -I. "$D/impl.c"
done
# The implementation after system headers (issue 22 item 1): strict C11 and C17 hide POSIX
# unless a feature macro comes first, and a user's file may include <stdio.h> (or any ISO C
# header, or <pthread.h>) before dtrain.h. Each of those first, then all of them together:
# it compiles clean and runs. <netdb.h> first in strict mode hides getaddrinfo for good: a
# clear #error says what to do.
early_hdrs="stdio.h stdlib.h string.h math.h time.h signal.h errno.h assert.h limits.h stdint.h pthread.h unistd.h sys/types.h sys/stat.h fcntl.h sys/socket.h poll.h"
all_early=""
for h in $early_hdrs; do
  hf=$(echo "$h" | tr '/.' '__')
  printf '#include <%s>\n#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint main(void){ return dt_build_features() == 0; }\n' "$h" > "$D/early_$hf.c"
  all_early="$all_early#include <$h>\n"
done
printf "$all_early"'#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint main(void){ return dt_build_features() == 0; }\n' > "$D/early_all.c"
printf '#include <netdb.h>\n#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint main(void){ return 0; }\n' > "$D/early_netdb.c"
# compile_early CC STD: every one-header file, then all of them (built and run). C17
# sets the same feature macros as C11 (glibc tests __STDC_VERSION__ only against C2x),
# so there the one-header files are not compiled again: all of them first is.
compile_early() {
  [ "$2" = c17 ] || for h in $early_hdrs; do
    hf=$(echo "$h" | tr '/.' '__')
    $1 -std=$2 $(wq $1) -fsyntax-only -I. "$D/early_$hf.c" || { echo "with <$h> first"; return 1; }
  done
  $1 -std=$2 $(wq $1) -O0 -I. "$D/early_all.c" -o "$D/early_all_$1_$2" -lm -lpthread && "$D/early_all_$1_$2"
}
netdb_error() {
  out=$($1 -std=c11 -fsyntax-only -I. "$D/early_netdb.c" 2>&1)
  [ $? -ne 0 ] && printf '%s' "$out" | grep -q 'define _POSIX_C_SOURCE 200809L before the first #include'
}
for cc in gcc clang; do
  command -v $cc >/dev/null 2>&1 || { skip "$cc system headers first: no $cc"; continue; }
  for std in c11 c17; do check "$cc-$std-system-headers-first" compile_early $cc $std; done
  check "$cc-netdb-first-says-what-to-do" netdb_error $cc
done
for cxx in g++ clang++; do
  command -v $cxx >/dev/null 2>&1 || { skip "$cxx-c++17: no $cxx"; continue; }
  check "$cxx-c++17" $cxx -std=c++17 $W -O1 -I. "$D/impl.cpp" -o "$D/impl_$cxx" -lm -lpthread
  for sw in DIST DATA FIT; do
    check "$cxx-c++17-no-$sw" $cxx -std=c++17 $(wq $cxx) -fsyntax-only -DDTRAIN_NO_$sw -I. "$D/impl.cpp"
  done
done
# The implementation in parts (DTRAIN_IMPLEMENTATION_PART 1..4; make builds
# build/dtrain.o so): each part as C++17 and with clang; the parts linked
# together export exactly the whole's public functions; a part out of range or
# with DTRAIN_STATIC is refused with a message.
parts_api_match() { # the dt_ API symbols of the gcc parts joined vs of the whole
  printf '#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\n' > "$D/impl_only.c"
  printf '#include "dtrain.h"\nint main(void){ return dt_build_features() == 0; }\n' > "$D/parts_main.c"
  for k in 1 2 3 4; do gcc -std=c11 $WQ -O0 -DDTRAIN_IMPLEMENTATION_PART=$k -I. -c "$D/impl_only.c" -o "$D/part$k.o" || return 1; done
  gcc -std=c11 $WQ -O0 -I. -c "$D/impl_only.c" -o "$D/whole.o" &&
    gcc -std=c11 $W -I. "$D/parts_main.c" "$D/part1.o" "$D/part2.o" "$D/part3.o" "$D/part4.o" -o "$D/parts_linked" -lm -lpthread &&
    "$D/parts_linked" &&
    nm "$D/whole.o" | awk '$2 == "T" && $3 ~ /^dt_[^_]/ {print $3}' | sort > "$D/api_whole.txt" &&
    nm "$D/part1.o" "$D/part2.o" "$D/part3.o" "$D/part4.o" | awk '$2 == "T" && $3 ~ /^dt_[^_]/ {print $3}' | sort > "$D/api_parts.txt" &&
    [ -s "$D/api_whole.txt" ] && cmp "$D/api_whole.txt" "$D/api_parts.txt"
}
check "parts-link-and-export-the-whole-api" parts_api_match
for k in 1 2 3 4; do
  command -v g++ >/dev/null 2>&1 && check "g++-c++17-part-$k" g++ -std=c++17 $WQ -fsyntax-only -DDTRAIN_IMPLEMENTATION_PART=$k -I. "$D/impl.cpp"
  command -v clang >/dev/null 2>&1 && check "clang-c11-part-$k" clang -std=c11 $W -fsyntax-only -DDTRAIN_IMPLEMENTATION_PART=$k -I. "$D/impl.c"
done
check "part-5-refused" sh -c "! gcc -std=c11 -fsyntax-only -DDTRAIN_IMPLEMENTATION_PART=5 -I. $D/impl.c > $D/part5.txt 2>&1 && grep -q 'DTRAIN_IMPLEMENTATION_PART is 1, 2, 3 or 4' $D/part5.txt"
check "part-static-refused" sh -c "! gcc -std=c11 -fsyntax-only -DDTRAIN_IMPLEMENTATION_PART=1 -DDTRAIN_STATIC -I. $D/impl.c > $D/partst.txt 2>&1 && grep -q 'cannot be static' $D/partst.txt"
# Two translation units, each with its own static copy of the implementation.
printf '#define DTRAIN_STATIC\n#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint tu_a(void){ return (int)dt_build_features(); }\n' > "$D/tu_a.c"
printf '#define DTRAIN_STATIC\n#define DTRAIN_IMPLEMENTATION\n#include "dtrain.h"\nint tu_a(void);\nint main(void){ return tu_a() != (int)dt_build_features(); }\n' > "$D/tu_b.c"
check "static-two-tu" sh -c "gcc -std=c11 $WQ -I. -c $D/tu_a.c -o $D/tu_a.o && gcc -std=c11 $WQ -I. -c $D/tu_b.c -o $D/tu_b.o && gcc $D/tu_a.o $D/tu_b.o -o $D/tu -lm -lpthread && $D/tu"
# A contradictory configuration must stop the build with a message.
check "contradiction-errors" sh -c "! gcc -std=c11 -DDTRAIN_NO_THREADS -DDTRAIN_USE_MPI -I. -c $D/impl.c -o $D/bad.o 2>$D/bad.txt && grep -q 'DTRAIN_USE_MPI needs threads' $D/bad.txt"
check "no-dist-mpi-contradiction-errors" sh -c "! gcc -std=c11 -DDTRAIN_NO_DIST -DDTRAIN_USE_MPI -I. -c $D/impl.c -o $D/bad3.o 2>$D/bad3.txt && grep -q 'remove DTRAIN_NO_DIST or DTRAIN_USE_MPI' $D/bad3.txt"
check "no-data-zlib-contradiction-errors" sh -c "! gcc -std=c11 -DDTRAIN_NO_DATA -DDTRAIN_USE_ZLIB -I. -c $D/impl.c -o $D/bad4.o 2>$D/bad4.txt && grep -q 'remove DTRAIN_NO_DATA or DTRAIN_USE_ZLIB' $D/bad4.txt"
# The compiled-out parts say so (UNSUPPORTED, a message naming the switch,
# NULL from constructors), dt_build_features() knows, one_device still trains.
cat > "$D/edge_stubs.c" <<'EOF'
#define DTRAIN_NO_DIST
#define DTRAIN_NO_DATA
#define DTRAIN_NO_FIT
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <string.h>
static int says(dt_result r, const char *macro) {
  return r == DTRAIN_ERR_UNSUPPORTED && dt_last_result() == r && strstr(dt_last_error(), macro) != NULL;
}
static dt_tensor *step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  int64_t s[2] = {b->rows, 1};
  (void)replica;
  return dt_mse(g, dt_nn_linear_forward(g, (dt_nn_linear *)user, dt_tensor_wrap(g, 2, s, (float *)b->x)),
                dt_tensor_wrap(g, 2, s, (float *)b->t));
}
int main(void) {
  unsigned f = dt_build_features();
  dt_dataset *ds = (dt_dataset *)&f;
  dt_cluster *cl = (dt_cluster *)&f;
  dt_fit_options fd;
  float x[4] = {0, 1, 2, 3}, t[4] = {1, 3, 5, 7}, loss = 1;
  if (f & (DTRAIN_FEATURE_DIST | DTRAIN_FEATURE_DATA | DTRAIN_FEATURE_FIT | DTRAIN_FEATURE_NET)) return 1;
  if (!strstr(dt_build_info(), "dist=no data=no fit=no")) return 2;
  if ((ds = dt_dataset_from_csv("1,2\n", 4, 0)) != NULL || !says(dt_last_result(), "DTRAIN_NO_DATA")) return 3;
  if (!says(dt_loader_next(0, 0), "DTRAIN_NO_DATA")) return 4;
  memset(&fd, 0, sizeof fd);
  if (!says(dt_fit(&fd, 0), "DTRAIN_NO_FIT")) return 5;
  if (!says(dt_cluster_parse_json("{}", &cl), "DTRAIN_NO_DIST") || cl) return 6;
  if (dt_comm_create_threads(2, 0) || !says(dt_last_result(), "DTRAIN_NO_DIST")) return 7;
  if (dt_pstore_create_local(x, 4, 1, 0, DTRAIN_ASYNC_HOGWILD, 0) || !says(dt_last_result(), "DTRAIN_NO_DIST")) return 8;
  dt_params *P = dt_params_create(1);
  dt_nn_linear lin;
  dt_nn_linear_init(&lin, P, "lin", 1, 1, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.lr = 0.05f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_strategy_options sd = dt_strategy_mirrored(2);
  if (dt_strategy_create(P, opt, step, &lin, &sd) || !says(dt_last_result(), "DTRAIN_NO_DIST")) return 9;
  sd = dt_strategy_one_device();
  dt_strategy *s = dt_strategy_create(P, opt, step, &lin, &sd);
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = 4; b.x = x; b.x_cols = 1; b.t = t; b.t_cols = 1;
  for (int i = 0; i < 2000 && s; i++)
    if (dt_strategy_step(s, &b, &loss) != DTRAIN_OK) return 10;
  if (!s || !(loss < 0.01f)) return 11;
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return 0;
}
EOF
check "edge-stubs-say-so-one-device-trains" sh -c "gcc -std=c11 $WQ -I. $D/edge_stubs.c -o $D/edge_stubs -lm -lpthread && $D/edge_stubs"
# DTRAIN_USE_CBLAS routes GEMM to OpenBLAS: the matmul tests must pass through it.
if [ -f /usr/include/x86_64-linux-gnu/cblas.h ] || [ -f /usr/include/cblas.h ] || [ -f /usr/include/openblas/cblas.h ]; then
  check "cblas-build-and-matmul-tests" sh -c "gcc -std=c11 $WQ -O1 -DDTRAIN_USE_CBLAS -I. -I/usr/include/openblas -c tests/dtrain_impl.c -o $D/impl_cblas.o && gcc -std=c11 $W -O1 -I. -Itests tests/test_ops_matmul.c $D/impl_cblas.o -o $D/test_matmul_cblas -lopenblas -lm -lpthread && $D/test_matmul_cblas | grep -q ' 0 failed' && $D/test_matmul_cblas | grep -q 'cblas=yes'"
else
  skip "cblas-build-and-matmul-tests: no cblas.h (apt-get install libopenblas-dev)"
fi
# DTRAIN_NO_MALLOC: the library object references no allocator of libc at all,
# and the fixed-memory tests pass against it.
check "no-malloc-object-has-no-malloc" sh -c "gcc -std=c11 $WQ -O1 -DDTRAIN_NO_MALLOC -I. -c tests/dtrain_impl.c -o $D/impl_nomalloc.o && nm -u $D/impl_nomalloc.o > $D/nomalloc.syms && ! grep -wE 'malloc|calloc|realloc|free|aligned_alloc|posix_memalign|strdup' $D/nomalloc.syms"
check_sync  # the next check links the object the previous one built
check "no-malloc-fixed-memory-tests" sh -c "gcc -std=c11 $W -O1 -I. -Itests tests/test_fixed_memory.c $D/impl_nomalloc.o -o $D/test_fixed_nomalloc -lm -lpthread && $D/test_fixed_nomalloc > $D/nomalloc.out && grep -q 'fixed_memory: [0-9]* passed, 0 failed' $D/nomalloc.out"
check "no-malloc-contradiction-errors" sh -c "! gcc -std=c11 -DDTRAIN_NO_MALLOC '-DDTRAIN_MALLOC(s)=0' '-DDTRAIN_REALLOC(p,s)=0' '-DDTRAIN_FREE(p)=0' -I. -c $D/impl.c -o $D/bad2.o 2>$D/bad2.txt && grep -q 'DTRAIN_NO_MALLOC contradicts' $D/bad2.txt"
# DTRAIN_USE_ZLIB: gzip data is inflated by zlib; the data tests must pass through it.
if [ -f /usr/include/zlib.h ]; then
  check "zlib-build-and-data-tests" sh -c "gcc -std=c11 $WQ -O1 -DDTRAIN_USE_ZLIB -I. -c tests/dtrain_impl.c -o $D/impl_zlib.o && gcc -std=c11 $W -O1 -I. -Itests tests/test_data.c $D/impl_zlib.o -o $D/test_data_zlib -lz -lm -lpthread && $D/test_data_zlib > $D/test_data_zlib.txt 2>&1 && grep -q ' 0 failed' $D/test_data_zlib.txt && grep -q 'zlib=yes' $D/test_data_zlib.txt"
else
  skip "zlib-build-and-data-tests: no zlib.h (apt-get install zlib1g-dev)"
fi
# DTRAIN_NO_STDIO: the file readers say UNSUPPORTED, the from-memory parsers still work.
cat > "$D/nostdio_data.c" <<'EOF'
#define DTRAIN_NO_STDIO
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
int main(void) {
  static const unsigned char idx[] = {0, 0, 8, 1, 0, 0, 0, 2, 7, 9};
  static const unsigned char stored_gz[] = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 0, 0xfd, 0xff, 'h', 'i',
                                            0xac, 0x2a, 0x93, 0xd8, 2, 0, 0, 0};
  dt_idx a;
  dt_dataset *ds = 0;
  dt_bytes b;
  char dir[64];
  int64_t one = 1;
  if (dt_idx_read("x.idx", &a) != DTRAIN_ERR_UNSUPPORTED) return 1;
  if (dt_idx_parse(idx, sizeof idx, &a) != DTRAIN_OK || a.size != 2 || a.data[1] != 9) return 2;
  dt_idx_free(&a);
  if ((ds = dt_dataset_load_csv("x.csv", 0)) != 0 || dt_last_result() != DTRAIN_ERR_UNSUPPORTED) return 3;
  if (!(ds = dt_dataset_from_csv("1,2\n", 4, 0)) || ds->n != 1 || ds->x[1] != 2.0f) return 4;
  dt_dataset_destroy(ds);
  if (dt_npy_write("x.npy", DTRAIN_NPY_U8, 1, &one, idx) != DTRAIN_ERR_UNSUPPORTED) return 5;
  if (dt_fashion_mnist_find(0, dir, sizeof dir, 0) != DTRAIN_ERR_UNSUPPORTED) return 6;
  if (dt_gunzip(stored_gz, sizeof stored_gz, 0, &b) != DTRAIN_OK || b.size != 2 || b.data[1] != 'i') return 7;
  dt_bytes_free(&b);
  return 0;
}
EOF
check "no-stdio-data-parsers" sh -c "gcc -std=c11 $WQ -I. $D/nostdio_data.c -o $D/nostdio_data -lm -lpthread && $D/nostdio_data"
# dtrain_cuda.h: its public part is C (strict C11, -Wpedantic); its host
# emulation compiles with clang++ too (g++ builds test_cuda_emu); with nvcc,
# a .cu holding only DTRAIN_CUDA_IMPLEMENTATION compiles and links against
# the C object, as users are told to build it.
printf '#include "dtrain_cuda.h"\nint main(void){ dt_device *(*f)(int) = dt_cuda_device_create; (void)f; return 0; }\n' > "$D/cuda_public.c"
# The examples compile as C++17 too, warnings as errors (issue 22 item 2: a
# user's C++ project copies them; "= {0}" on an enum-first struct does not
# compile there, dt_optim_defaults does).
for ex in examples/0*.c; do
  check "cxx17-$(basename "$ex" .c)" g++ -std=c++17 -Wall -Wextra -Werror -x c++ -fsyntax-only -DDTRAIN__IMPLEMENTATION_DONE -I. "$ex"
done
# Every C snippet of the README, each in a function given the variables it uses
# (tests/readme_idioms.py), as C11 and as C++17 with gcc and clang, warnings as
# errors (unused ones aside: the snippets are fragments). A new snippet without
# a context there fails the generation.
RI="-Wall -Wextra -Werror -Wno-unused-parameter -Wno-unused-variable -Wno-unused-but-set-variable -Wno-unused-function -fsyntax-only -I."
check "readme-idioms-extracted" python3 tests/readme_idioms.py README.md "$D/readme_idioms.c"
check_sync
for cc in gcc clang; do
  command -v $cc >/dev/null 2>&1 || { skip "readme-idioms-$cc: no $cc"; continue; }
  cxx=$([ $cc = gcc ] && echo g++ || echo clang++)
  check "readme-idioms-$cc-c11" $cc -std=c11 $RI "$D/readme_idioms.c"
  check "readme-idioms-$cxx-c++17" $cxx -std=c++17 -x c++ $RI "$D/readme_idioms.c"
done
check "cuda-header-public-c11" gcc -std=c11 $W -I. -c "$D/cuda_public.c" -o "$D/cuda_public.o"
if command -v clang++ >/dev/null 2>&1; then
  check "cuda-host-emulation-clang++" clang++ -std=c++17 $W -I. -Itests -fsyntax-only tests/test_cuda_emu.cc
else
  skip "cuda-host-emulation-clang++: no clang++"
fi
NVCC=$(command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
if [ -n "$NVCC" ]; then
  printf '#define DTRAIN_CUDA_IMPLEMENTATION\n#include "dtrain_cuda.h"\nint main(void){ return dt_cuda_device_count() < -1; }\n' > "$D/cuda_impl.cu"
  # (the C object: the whole implementation that parts-link-and-export-the-whole-api built)
  check "cuda-nvcc-impl-links" sh -c "test -f $D/whole.o && $NVCC -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -I. $D/cuda_impl.cu $D/whole.o -o $D/cuda_impl -lcublas -lm -lpthread"
else
  skip "cuda-nvcc-impl-links: no nvcc"
fi
# Each source file compiles alone.
for f in src/*.c; do
  check "alone-$(basename $f)" gcc -std=c11 $W -Isrc -c "$f" -o "$D/$(basename $f .c).o"
done
# Struct layouts and the API never depend on a switch: each compile-out
# build exports every public function of the full build (the parts it
# leaves out answer DTRAIN_ERR_UNSUPPORTED naming the switch).
check_sync  # the API check and these two read the objects the checks above built
# DTRAIN_NO_DIST: the object (gcc-c11-no-DIST's) calls no socket function (the
# network layer is gone with the rest). pthread_create stays unless
# DTRAIN_NO_THREADS: the intra-op thread pool (dt_set_threads) is not a
# distributed part. The edge object (gcc-c11-edge's) has no threads, sockets or files.
check "no-dist-object-has-no-sockets" sh -c "nm -u $D/impl_noDIST_gcc.o > $D/nodist.syms && ! grep -wE 'socket|connect|bind|listen|accept|getaddrinfo|setsockopt|send|sendmsg|recv|poll' $D/nodist.syms"
check "edge-object-has-no-threads-sockets-files" sh -c "nm -u $D/impl_edge_gcc.o > $D/edge.syms && ! grep -wE 'pthread_create|socket|connect|bind|listen|accept|fopen' $D/edge.syms"
# The x86 kernels of -O2 builds without -march (target attributes only): none
# scalarised by the compiler (tools/check_codegen.sh: gcc 12 once made an
# _mm256_blendv_ps of the async store's push eight lane extracts and branches).
# Not gcc -O3: its vectoriser builds index and edge-mask vectors lane by lane
# outside the loops (dt__wino_part_avx2), which the count cannot tell apart
# (measured: no slower than -march=native there).
if [ "$(uname -m)" != x86_64 ]; then
  skip "simd-kernels-not-scalarised: not an x86-64 host ($(uname -m))"
elif ! command -v objdump >/dev/null 2>&1; then
  skip "simd-kernels-not-scalarised: no objdump"
else
  check "simd-kernels-not-scalarised" sh -c "gcc -std=c11 -O2 -I. -c $D/impl.c -o $D/impl_o2_gcc.o &&
    sh tools/check_codegen.sh $D/impl_o2_gcc.o \$(test -f $D/impl_clang && echo $D/impl_clang)"
fi
check "compile-out-switches-keep-the-api" sh -c "test -f $D/impl_noDIST_gcc.o &&
  nm $D/impl_gcc | awk '\$2 == \"T\" && \$3 ~ /^dt_/ { print \$3 }' | sort > $D/api_full.txt &&
  test -s $D/api_full.txt &&
  for sw in DIST DATA FIT; do
    nm $D/impl_no\${sw}_gcc.o | awk '\$2 == \"T\" && \$3 ~ /^dt_/ { print \$3 }' | sort > $D/api_\$sw.txt &&
    { comm -23 $D/api_full.txt $D/api_\$sw.txt > $D/api_missing_\$sw.txt; test ! -s $D/api_missing_\$sw.txt ||
      { echo \"DTRAIN_NO_\$sw leaves out:\"; cat $D/api_missing_\$sw.txt; exit 1; }; } || exit 1
  done"
check_sync
echo "compile_checks: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
