#!/bin/sh
# Every way a project can pick up dtrain, each with a tiny consumer that trains
# a model: make install + pkg-config, make install + CMake find_package (with a
# version check), add_subdirectory, FetchContent from a tarball, and the CMake
# install route. Prints "install_checks: N passed, N failed, N skipped".
BUILD=${BUILD:-build}
ROOT=$(pwd)
T="$ROOT/$BUILD/install_checks"
rm -rf "$T"; mkdir -p "$T"
pass=0; fail=0; skipped=0
# skip WHAT: why -- a check that cannot run here, counted and named in the summary.
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
check() { # name, command...
  name=$1; shift
  if out=$("$@" 2>&1); then echo "ok $name"; pass=$((pass + 1));
  else echo "FAIL $name"; printf '%s\n' "$out" | tail -n 25; fail=$((fail + 1)); fi
}
C="$ROOT/tests/consumer"
check "make-install" make -s install PREFIX="$T/prefix"
# The optional CUDA backend header is installed next to dtrain.h.
if [ -f dtrain_cuda.h ]; then
  check "make-install-dtrain_cuda.h" cmp dtrain_cuda.h "$T/prefix/include/dtrain_cuda.h"
fi
# The launcher is installed with the header (make install builds it).
if [ -f tools/dtrain_launch.c ]; then
  check "make-install-dtrain-launch" sh -c "test -x $T/prefix/bin/dtrain-launch && $T/prefix/bin/dtrain-launch -h | grep -q '^usage: dtrain-launch'"
fi
if command -v pkg-config >/dev/null 2>&1; then
  check "pkg-config" sh -c "cc -std=c11 -Wall -Wextra -Werror $C/main.c \$(PKG_CONFIG_PATH=$T/prefix/lib/pkgconfig pkg-config --cflags --libs dtrain) -o $T/pc_consumer && $T/pc_consumer"
else
  skip "pkg-config: pkg-config not installed"
fi
if command -v cmake >/dev/null 2>&1; then
  cm() { # route, builddir, extra args...
    r=$1; b=$2; shift 2
    cmake -S "$C" -B "$b" -DDTRAIN_ROUTE=$r "$@" >/dev/null && cmake --build "$b" >/dev/null && "$b/consumer"
  }
  check "cmake-find_package" cm find "$T/find" -DCMAKE_PREFIX_PATH="$T/prefix" -DDTRAIN_WANT_VERSION=0.1
  # An installed tree still works after it is moved (the config is relocatable).
  check "cmake-find_package-moved-prefix" sh -c "cp -r $T/prefix $T/moved && rm -rf $T/find2 && cmake -S $C -B $T/find2 -DDTRAIN_ROUTE=find -DCMAKE_PREFIX_PATH=$T/moved >/dev/null && cmake --build $T/find2 >/dev/null && $T/find2/consumer"
  check "cmake-version-too-new-refused" sh -c "! cmake -S $C -B $T/find3 -DDTRAIN_ROUTE=find -DCMAKE_PREFIX_PATH=$T/prefix -DDTRAIN_WANT_VERSION=9.0 >$T/find3.log 2>&1 && grep -q 'dtrain' $T/find3.log"
  check "cmake-add_subdirectory" cm subdir "$T/subdir" -DDTRAIN_SOURCE="$ROOT"
  mkdir -p "$T/src/dtrain"
  cp -r dtrain.h CMakeLists.txt cmake LICENSE "$T/src/dtrain/"
  [ -f dtrain_cuda.h ] && cp dtrain_cuda.h "$T/src/dtrain/"
  (cd "$T/src" && tar czf "$T/dtrain.tar.gz" dtrain)
  check "cmake-FetchContent" cm fetch "$T/fetch" -DDTRAIN_URL="file://$T/dtrain.tar.gz"
  check "cmake-install" sh -c "cmake -S $ROOT -B $T/cmk -DCMAKE_INSTALL_PREFIX=$T/cprefix >/dev/null && cmake --build $T/cmk >/dev/null && cmake --install $T/cmk >/dev/null && test -f $T/cprefix/include/dtrain.h && { test ! -f $ROOT/dtrain_cuda.h || cmp -s $ROOT/dtrain_cuda.h $T/cprefix/include/dtrain_cuda.h; } && test -f $T/cprefix/lib/cmake/dtrain/dtrainConfig.cmake && $T/cprefix/bin/dtrain-launch --help 2>&1 | grep -q 'dtrain-launch' && test -x $T/cprefix/bin/dtrain-bench && test -x $T/cprefix/bin/dtrain-ckpt && PKG_CONFIG_PATH=$T/cprefix/lib/pkgconfig pkg-config --modversion dtrain | grep -q '^0\\.1\\.0$'"
else
  skip "cmake routes: cmake not installed"
fi
check "make-uninstall" sh -c "make -s uninstall PREFIX=$T/prefix && test ! -e $T/prefix/include/dtrain.h && test ! -e $T/prefix/include/dtrain_cuda.h && test ! -e $T/prefix/lib/pkgconfig/dtrain.pc && test ! -e $T/prefix/bin/dtrain-launch"
echo "install_checks: $pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
