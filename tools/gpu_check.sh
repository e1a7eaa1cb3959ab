#!/bin/sh
# gpu_check.sh -- what a session runs when it is lent a GPU, in one go (the
# device time is short, so every step is bounded and writes its own log):
#   1. builds test_cuda, 02_fashion_mnist_cuda and bench_gpu with nvcc (and
#      test_cuda_nccl against nccl.h/libnccl from CUDA_HOME, else from the pip
#      package nvidia-nccl that PyTorch brings);
#   2. runs test_cuda and test_cuda_nccl, and test_cuda under compute-sanitizer's
#      memcheck;
#   3. trains Fashion-MNIST with --device cuda (MLP 3 epochs, CNN 1 epoch);
#   4. make bench-gpu's comparison against PyTorch on the same GPU (about 4 minutes:
#      each PyTorch run starts CUDA anew);
#   5. optional CPU rows (GPU_CHECK_CPU=1) for a machine with more cores than
#      the development one: mirrored(2) over one_device (bench_strategy) and
#      parameter servers over TCP against the in-process store (bench_async --ps).
# Each step's log goes to build/gpu_check/NAME.log, and all of them, packed, to
# $OUT/gpu_check_logs.tgz after every step (the device tool's folder returns
# only a few files); without $OUT, build/gpu_check alone.
#
#   FMNIST=DIR sh tools/gpu_check.sh      (DIR: the Fashion-MNIST files; default: the example's own search)
#
# Through the device tool, the full training set copied into an ignored folder
# of the checkout (it travels only when carried): cp /usr/share/datasets/fashion-mnist/*.gz .fmnist/,
# then run `FMNIST=.fmnist GPU_CHECK_CPU=1 sh tools/gpu_check.sh` with carry [".fmnist"]
# and a limit of about 9 minutes (on an H200, 2026-11-30: build 50 s, tests and memcheck
# 5 s, Fashion-MNIST 15 s, bench-gpu about 4 minutes, the CPU rows 2 minutes).
L=build/gpu_check
mkdir -p "$L"
J=$(nproc 2>/dev/null || echo 4)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
FLAGS="-std=c++17 -O2 -arch=native -Xcompiler -Wall,-Wextra,-Werror"
step() { echo "== $* ($(date +%T))"; }
# run NAME SECONDS CMD...: output to $L/NAME.log, its tail and exit status here
run() {
  n=$1; s=$2; shift 2
  timeout "$s" "$@" > "$L/$n.log" 2>&1
  rc=$?
  tail -n "${TAIL:-4}" "$L/$n.log"
  echo "-- $n: exit $rc"
  if [ -n "$OUT" ]; then tar czf "$OUT/gpu_check_logs.tgz" -C "$L" .; fi
}

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$NVCC" --version | tail -1
grep -m1 "model name" /proc/cpuinfo; echo "cores: $J"

step build
TAIL=6 run build 300 make -j"$J" NVCC="$NVCC" NVCCFLAGS="$FLAGS" build/tests/test_cuda \
  build/examples/02_fashion_mnist_cuda build/bench/bench_gpu build/bench/bench_strategy build/bench/bench_async
CUDA_HOME=$(dirname "$(dirname "$NVCC")")
if [ -f "$CUDA_HOME/include/nccl.h" ] && [ -f "$CUDA_HOME/lib64/libnccl.so" ]; then
  NI=$CUDA_HOME/include; NL=$CUDA_HOME/lib64
else
  ND=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  NI=$ND/include; NL=$ND/lib
fi
if [ -f "$NI/nccl.h" ]; then
  ln -sf "$(ls "$NL"/libnccl.so* | head -1)" build/libnccl.so
  run build_nccl 300 "$NVCC" $FLAGS -DDTRAIN_USE_NCCL -I. -Itests -I"$NI" tests/test_cuda.cu build/dtrain.o \
    -o build/tests/test_cuda_nccl -lcublas -Lbuild -lnccl -lm -lpthread -ldl
else
  echo "-- no nccl.h found (CUDA_HOME $CUDA_HOME, pip nvidia.nccl): test_cuda_nccl not built"
fi

step tests
run test_cuda 120 build/tests/test_cuda
[ -x build/tests/test_cuda_nccl ] && LD_LIBRARY_PATH=$NL:$LD_LIBRARY_PATH run test_cuda_nccl 120 build/tests/test_cuda_nccl
if command -v compute-sanitizer >/dev/null 2>&1; then
  TAIL=8 run memcheck 240 compute-sanitizer --tool memcheck --leak-check full build/tests/test_cuda
fi

step "Fashion-MNIST on the GPU"
D=${FMNIST:+--data $FMNIST}
run fmnist_mlp 120 build/examples/02_fashion_mnist_cuda --device cuda $D --model mlp --epochs 3 --json
run fmnist_cnn 120 build/examples/02_fashion_mnist_cuda --device cuda $D --model cnn --epochs 1 --json
run fmnist_cnn256 120 build/examples/02_fashion_mnist_cuda --device cuda $D --model cnn --epochs 1 --batch 256 --json

step "bench-gpu"
export BENCH_ROUNDS="${BENCH_ROUNDS:-2}" BENCH_SECONDS="${BENCH_SECONDS:-2}"
TAIL=8 run bench_gpu 420 sh bench/run_gpu.sh

if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
  step "CPU rows on this machine's cores"
  TAIL=30 run bench_strategy 120 build/bench/bench_strategy
  TAIL=30 run bench_async_ps 120 build/bench/bench_async --ps
fi
step done
