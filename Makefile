# dtrain -- build, test, demo, bench.
#   make demo      build and run the main demo
#   make test      build everything and run the test suite
# Everything is built into $(BUILD)/ (default build/).

CC      ?= cc
CXX     ?= c++
HOSTCC  ?= cc
BUILD   ?= build
OPT     ?= -O2 -g
SAN     ?=
STD     ?= -std=c11
WARN    := -Wall -Wextra -Wpedantic -Werror
CFLAGS_ALL = $(STD) $(WARN) $(OPT) $(SAN) $(EXTRA_CFLAGS)
LDLIBS  := -lm -lpthread

SRC      := $(wildcard src/*.c src/*.h src/*.txt) src/MANIFEST
TEST_SRC := $(wildcard tests/test_*.c)
TESTS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
EX_SRC   := $(wildcard examples/*.c)
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(EX_SRC))
AMALG    := $(BUILD)/tools/amalgamate

.PHONY: xor test-minimal test-minimal-nothreads test-minimal-nostdio test-minimal-edge all test test-suite suite-bins check-house demo bench amalgamate sanitize tsan clean check-amalgamation test-cross install uninstall
.PHONY: windows bench-strategy bench-backup bench-plan figures simulate bench-pipeline bench-net bench-netem bench-gpu fuzz soak chaos board

all: dtrain.h $(TESTS) $(EXAMPLES) $(BUILD)/tests/portable_run $(BUILD)/tests/torch_dump tools/dtrain-launch $(BUILD)/tests/launch_probe tools/dtrain-bench tools/dtrain-ckpt

# The launcher (plain POSIX C, no dtrain.h): built for this machine with
# HOSTCC, also in cross builds, since it is installed and run here.
tools/dtrain-launch: tools/dtrain_launch.c
	$(HOSTCC) -std=c11 $(WARN) -O2 $< -o $@

# The all-reduce benchmark (nccl-tests style; threads and tcp backends; the
# mpi one is tools/dtrain-bench-mpi, built by `make bench-net` where mpicc is).
tools/dtrain-bench: tools/dtrain_bench.c dtrain.h
	$(HOSTCC) -std=c11 $(WARN) -O2 -I. $< -o $@ -lm -lpthread

# Model-parallel checkpoints from the shell: info, gather the parts, split for a layout.
tools/dtrain-ckpt: tools/dtrain_ckpt.c dtrain.h
	$(HOSTCC) -std=c11 $(WARN) -O2 -I. $< -o $@ -lm -lpthread

# ---- the header ------------------------------------------------------------
$(AMALG): tools/amalgamate.c
	@mkdir -p $(dir $@)
	$(HOSTCC) -std=c11 -O1 -Wall -Wextra -Werror $< -o $@

dtrain.h: $(SRC) $(AMALG)
	$(AMALG) src src/MANIFEST dtrain.h

amalgamate: $(AMALG)
	$(AMALG) src src/MANIFEST dtrain.h

# ---- objects, tests, examples ----------------------------------------------
# The implementation in its 4 parts (DTRAIN_IMPLEMENTATION_PART, compiled in
# parallel under make -j), joined into one relocatable object; the whole
# translation unit is compiled by tests/compile_checks.sh.
DT_PARTS := $(foreach k,1 2 3 4,$(BUILD)/dtrain_part$(k).o)
$(BUILD)/dtrain_part%.o: tests/dtrain_impl.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DDTRAIN_IMPLEMENTATION_PART=$* -I. -c $< -o $@

$(BUILD)/dtrain.o: $(DT_PARTS)
	$(CC) -r -nostdlib $(DT_PARTS) -o $@

# Tests written for the whole implementation (DTRAIN_STATIC and DTRAIN_IMPLEMENTATION: they
# call private functions) that take its declarations only and link with the parts instead
# (DTRAIN__LINKED_TEST, dt_base.h): every configuration (sanitizers, cross, minimal) then
# compiles the implementation once rather than once more per such test, which was most of
# CI's time. The private types and functions they reach (the PS client's state, the
# handshake's hello, the error-feedback state) are declared in src/'s private headers for
# them. Only test_strategy_nothreads, which sets a configuration of its own, compiles the
# implementation itself.
LINKED_TESTS := test_comm_p2p test_compress test_flush test_grad_ready test_mwm_tcp test_net_threads test_overlap \
                test_pipeline test_speed test_strategy_multi test_tensor_parallel test_trace test_ps_elastic \
                test_conv_relu test_gemm_panels test_plan_fluid test_compress_ef test_comm_tcp test_ps \
                test_ps_backup test_ps_compress test_ps_early test_net test_netem \
                test_strategy_backup test_strategy

# Test programs compiled at -O0 in every configuration (the flag comes last, so
# it wins): test_null_args is 9,000 generated lines of calls with NULL
# arguments, nothing to optimise, and took 5.1 s at -O2 against 0.75 s at -O0
# (the library it calls is built as the configuration says).
O0_TESTS := test_null_args

# SKIP_TESTS (make windows): programs built as a stand-in that reports them
# skipped with SKIP_WHY (tests/cuda_skip.c) instead of the test.
$(BUILD)/tests/%: tests/%.c tests/harness.h tests/win_compat.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
	$(if $(filter $*,$(SKIP_TESTS)),$(CC) $(CFLAGS_ALL) -DCUDA_SKIP_NAME='"$*"' '-DCUDA_SKIP_REASON="$(SKIP_WHY)"' tests/cuda_skip.c -o $@,$(CC) $(CFLAGS_ALL) $(if $(filter $*,$(O0_TESTS)),-O0) $(if $(filter $*,$(LINKED_TESTS)),-DDTRAIN__LINKED_TEST) -I. -Itests $< $(BUILD)/dtrain.o -o $@ $(LDLIBS))

# The parameter-server tests share their forked cluster.
$(BUILD)/tests/test_ps $(BUILD)/tests/test_ps_elastic $(BUILD)/tests/test_ps_compress $(BUILD)/tests/test_ps_early $(BUILD)/tests/test_ps_backup: tests/ps_harness.h tests/hostile_clients.h

# The TCP communicator's tests share their forked ranks.
$(BUILD)/tests/test_comm_tcp $(BUILD)/tests/test_comm_p2p $(BUILD)/tests/test_pipeline \
  $(BUILD)/tests/test_tensor_parallel $(BUILD)/tests/test_netem: tests/tcp_world.h
# The model-parallel tests share their data, packing and comparison.
$(BUILD)/tests/test_pipeline $(BUILD)/tests/test_tensor_parallel $(BUILD)/tests/test_parallel_ckpt: tests/mp_common.h

# test_char_model compiles the example into itself (its library: $(BUILD)/dtrain.o).
$(BUILD)/tests/test_char_model: examples/03_char_model.c

# They reach private functions (the wire frames): linked as LINKED_TESTS are.
$(BUILD)/tests/portable_run $(BUILD)/tests/torch_dump: $(BUILD)/tests/%: tests/%.c dtrain.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DDTRAIN__LINKED_TEST -I. $< $(BUILD)/dtrain.o -o $@ $(LDLIBS)

# The examples are single-file programs (each defines DTRAIN_IMPLEMENTATION,
# as a user's program does); here they link the one library object instead
# of compiling the implementation again each (DTRAIN__IMPLEMENTATION_DONE
# skips their copy): the library is built once per configuration. The
# single-file build itself is checked by tests/compile_checks.sh.
$(BUILD)/examples/%: examples/%.c examples/example_flags.h examples/fashion_model.h dtrain.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DDTRAIN__IMPLEMENTATION_DONE -I. $< $(BUILD)/dtrain.o -o $@ $(LDLIBS)

# ---- the CUDA backend (dtrain_cuda.h) ---------------------------------------------
# test_cuda_emu: the CUDA kernels' math in host emulation against the CPU ops
# (plain C++, built and run everywhere). test_cuda: the same checks on a real
# GPU, built with nvcc where it exists (PATH or /usr/local/cuda/bin) for a
# native, non-sanitizer build; elsewhere a stand-in that prints why it skips.
# On a machine without a GPU the nvcc-built test_cuda skips at run time.
NVCC ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
NVCCFLAGS ?= -std=c++17 -O2 -Xcompiler -Wall,-Wextra,-Werror
CUDA_TESTS := $(BUILD)/tests/test_cuda_emu $(BUILD)/tests/test_cuda_strategy $(BUILD)/tests/test_cuda \
              $(BUILD)/tests/test_cuda_nccl
CUDA_NATIVE := $(if $(filter $(shell $(CC) -dumpmachine 2>/dev/null),$(shell $(HOSTCC) -dumpmachine 2>/dev/null)),yes,)
CUDA_SKIP := $(if $(NVCC),$(if $(CUDA_NATIVE),$(if $(SAN),not built in sanitizer builds,),not built in cross builds),nvcc not found)
all: $(CUDA_TESTS)

CXX_FOUND := $(shell command -v $(CXX) >/dev/null 2>&1 && echo yes)
# NCCL next to nvcc (CUDA_HOME/include/nccl.h, CUDA_HOME/lib64/libnccl.so):
# test_cuda_nccl is test_cuda with -DDTRAIN_USE_NCCL (the all-reduce over
# several GPUs through ncclAllReduce).
CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(NVCC)))
NCCL_SKIP := $(if $(CUDA_SKIP),$(CUDA_SKIP),$(if $(wildcard $(CUDA_HOME)/include/nccl.h),$(if $(wildcard $(CUDA_HOME)/lib64/libnccl.so),,no libnccl.so in $(CUDA_HOME)/lib64),no nccl.h in $(CUDA_HOME)/include))

# The host build compiles the implementation into them as C++ (a C++ user's single-file
# build, run); the other configurations (sanitizers, cross, minimal, Windows) link them with
# the library object instead (DTRAIN__LINKED_TEST), which saves a C++ compile of the whole
# implementation per program per configuration.
CUDA_EMU_LINKED := $(if $(SAN)$(RUNNER)$(EXTRA_CFLAGS),yes,)
CUDA_EMU_BUILD = $(CXX) -std=c++17 $(WARN) $(OPT) $(SAN) $(EXTRA_CFLAGS) $(if $(CUDA_EMU_LINKED),-DDTRAIN__LINKED_TEST) \
                 -I. -Itests $< $(if $(CUDA_EMU_LINKED),$(BUILD)/dtrain.o) -o $@ $(LDLIBS)
$(BUILD)/tests/test_cuda_emu: tests/test_cuda_emu.cc tests/cuda_skip.c tests/cuda_parity.h tests/harness.h dtrain.h dtrain_cuda.h \
                              $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
ifeq ($(CXX_FOUND),yes)
	$(CUDA_EMU_BUILD)
else
	$(CC) $(CFLAGS_ALL) -DCUDA_SKIP_NAME='"test_cuda_emu"' '-DCUDA_SKIP_REASON="no C++ compiler ($(CXX))"' tests/cuda_skip.c -o $@
endif

# test_cuda_strategy: mirrored / multi_worker_mirrored over several emulated
# devices (the same host emulation), against the CPU strategies.
$(BUILD)/tests/test_cuda_strategy: tests/test_cuda_strategy.cc tests/cuda_skip.c tests/harness.h dtrain.h dtrain_cuda.h \
                                   $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
ifeq ($(CXX_FOUND),yes)
	$(CUDA_EMU_BUILD)
else
	$(CC) $(CFLAGS_ALL) -DCUDA_SKIP_NAME='"test_cuda_strategy"' '-DCUDA_SKIP_REASON="no C++ compiler ($(CXX))"' tests/cuda_skip.c -o $@
endif

$(BUILD)/tests/test_cuda: tests/test_cuda.cu tests/cuda_skip.c tests/cuda_parity.h tests/harness.h dtrain_cuda.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
ifeq ($(CUDA_SKIP),)
	$(NVCC) $(NVCCFLAGS) $(EXTRA_CFLAGS) -I. -Itests $< $(BUILD)/dtrain.o -o $@ -lcublas $(LDLIBS)
else
	$(CC) $(CFLAGS_ALL) '-DCUDA_SKIP_REASON="$(CUDA_SKIP)"' tests/cuda_skip.c -o $@
endif

$(BUILD)/tests/test_cuda_nccl: tests/test_cuda.cu tests/cuda_skip.c tests/cuda_parity.h tests/harness.h dtrain_cuda.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
ifeq ($(NCCL_SKIP),)
	$(NVCC) $(NVCCFLAGS) $(EXTRA_CFLAGS) -DDTRAIN_USE_NCCL -I. -Itests $< $(BUILD)/dtrain.o -o $@ -lcublas -L$(CUDA_HOME)/lib64 -lnccl $(LDLIBS)
else
	$(CC) $(CFLAGS_ALL) -DCUDA_SKIP_NAME='"test_cuda_nccl"' '-DCUDA_SKIP_REASON="$(NCCL_SKIP)"' tests/cuda_skip.c -o $@
endif

# The example on a GPU (02_fashion_mnist --device cuda), where nvcc builds
# test_cuda; and the same program on the host emulation of the CUDA kernels
# (02_fashion_mnist_emu, for tests/example_checks.sh), where a C++ compiler is.
FMNIST_CUDA_BINS := $(if $(CUDA_SKIP),,$(BUILD)/examples/02_fashion_mnist_cuda) \
                    $(if $(CXX_FOUND),$(BUILD)/examples/02_fashion_mnist_emu,)
all: $(FMNIST_CUDA_BINS)

$(BUILD)/examples/02_fashion_mnist_cuda.o: examples/02_fashion_mnist.c examples/example_flags.h examples/fashion_model.h dtrain.h dtrain_cuda.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -DFMNIST_CUDA -I. -c $< -o $@

$(BUILD)/examples/02_fashion_mnist_cuda: $(BUILD)/examples/02_fashion_mnist_cuda.o examples/cuda_backend.cu dtrain_cuda.h
	$(NVCC) $(NVCCFLAGS) $(EXTRA_CFLAGS) -I. examples/cuda_backend.cu $< -o $@ -lcublas $(LDLIBS)

$(BUILD)/examples/02_fashion_mnist_emu: $(BUILD)/examples/02_fashion_mnist_cuda.o tests/cuda_emu_backend.cc dtrain_cuda.h
	$(CXX) -std=c++17 $(WARN) $(OPT) $(SAN) $(EXTRA_CFLAGS) -I. tests/cuda_emu_backend.cc $< -o $@ $(LDLIBS)

# The GPU benchmark (bench/bench_gpu.c): bench_gpu on the CUDA backend (make
# bench-gpu, where nvcc is), bench_gpu_emu on the host emulation (built with
# everything, run for a few steps by tests/example_checks.sh).
$(BUILD)/bench/bench_gpu.o: bench/bench_gpu.c bench/bench_models.h dtrain.h dtrain_cuda.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -I. -c $< -o $@

$(BUILD)/bench/bench_gpu: $(BUILD)/bench/bench_gpu.o examples/cuda_backend.cu dtrain_cuda.h
	$(NVCC) $(NVCCFLAGS) $(EXTRA_CFLAGS) -I. examples/cuda_backend.cu $< -o $@ -lcublas $(LDLIBS)

$(BUILD)/bench/bench_gpu_emu: $(BUILD)/bench/bench_gpu.o tests/cuda_emu_backend.cc dtrain_cuda.h
	$(CXX) -std=c++17 $(WARN) $(OPT) $(SAN) $(EXTRA_CFLAGS) -I. tests/cuda_emu_backend.cc $< -o $@ $(LDLIBS)

all: $(if $(CXX_FOUND),$(BUILD)/bench/bench_gpu_emu,)

# ---- running -----------------------------------------------------------------
test: all
	@BUILD=$(BUILD) CC="$(CC)" CXX="$(CXX)" SAN="$(SAN)" RUNNER="$(RUNNER)" SCRIPTS="$(SCRIPTS)" TEST_JOBS="$(TEST_JOBS)" sh tools/run_tests.sh

# The test programs alone (no examples, benchmarks or host tools) and their
# run: what the sanitizer, minimal and cross configurations need, since the
# script checks (examples, launcher, install, PyTorch parity) run only in the
# host build. portable_run is the cross builds' part of tests/cross_compare.sh.
SUITE_BINS := $(TESTS) $(CUDA_TESTS) $(if $(RUNNER),$(BUILD)/tests/portable_run,)
suite-bins: dtrain.h $(SUITE_BINS)
test-suite: suite-bins
	@BUILD=$(BUILD) CC="$(CC)" CXX="$(CXX)" SAN="$(SAN)" RUNNER="$(RUNNER)" SCRIPTS=0 TEST_JOBS="$(TEST_JOBS)" sh tools/run_tests.sh

# The soak test (tests/soak.sh): 3 workers and 2 parameter servers over loopback while a
# worker is killed and restarted, every port gets silent and random-byte connections and a
# worker is stopped and continued; minutes (SOAK_SECONDS, at most 600), so not in `make test`.
soak: tools/dtrain-launch $(BUILD)/examples/06_parameter_server
	BUILD=$(BUILD) sh tests/soak.sh
# A scripted chaos run (issue 20): kill -9, SIGSTOP/SIGCONT and restarts of a synchronous and
# a parameter-server job; nothing lost. Bounded (CHAOS_SECONDS, at most 600); not in `make test`.
chaos: tools/dtrain-launch $(BUILD)/examples/05_multi_worker $(BUILD)/examples/06_parameter_server
	BUILD=$(BUILD) sh tests/chaos.sh

# The main demo: Fashion-MNIST for a few epochs (the full set when Debian's
# dataset-fashion-mnist is installed, else the test split shipped in data/).
demo: $(BUILD)/examples/02_fashion_mnist
	@mkdir -p $(BUILD)
	$(BUILD)/examples/02_fashion_mnist --model mlp --epochs 3 --csv $(BUILD)/fashion_mnist.csv --svg $(BUILD)/fashion_mnist.svg

# A trained MLP on a small board (examples/board/board_inference.c): its checkpoint
# exported as C source, compiled without threads, stdio or malloc in the library.
#   make board CKPT=mlp.ckpt                                   (this machine)
#   make board CKPT=mlp.ckpt BOARD_CC=arm-linux-gnueabihf-gcc BOARD_LDFLAGS=-static
BOARD_CC ?= $(CC)
board: tools/dtrain-ckpt
	@test -n "$(CKPT)" || { echo "make board CKPT=FILE: the checkpoint of an MLP (examples/02_fashion_mnist --checkpoint FILE)"; exit 2; }
	@mkdir -p $(BUILD)/board
	tools/dtrain-ckpt export-c $(CKPT) -o $(BUILD)/board/model.h
	$(BOARD_CC) -std=c11 -O2 -Wall -Wextra -I$(BUILD)/board -I. examples/board/board_inference.c -o $(BUILD)/board/board_inference $(BOARD_LDFLAGS) -lm
	size $(BUILD)/board/board_inference

xor: $(BUILD)/examples/01_xor
	$(BUILD)/examples/01_xor

$(BUILD)/bench/%: bench/%.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(STD) -O3 -march=native -g $(EXTRA_CFLAGS) -I. $< -o $@ $(LDLIBS)
$(BUILD)/bench/bench_async $(BUILD)/bench/bench_strategy: bench/bench_cores.h

# The comparison bench is built like users build (-O2, no -march): the GEMM
# kernel is the one dtrain picks at run time.
$(BUILD)/bench/bench_speed: bench/bench_speed.c bench/bench_models.h dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(STD) $(WARN) -O2 -g $(EXTRA_CFLAGS) -I. $< -o $@ $(LDLIBS) -ldl

# The same bench built with DTRAIN_USE_CBLAS (needs libopenblas-dev): the
# DTRAIN_USE_CBLAS row of run_speed.sh. make bench goes on without it.
$(BUILD)/bench/bench_speed_cblas: bench/bench_speed.c bench/bench_models.h dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(STD) $(WARN) -O2 -g -DDTRAIN_USE_CBLAS $(EXTRA_CFLAGS) -I. $< -o $@ -lopenblas $(LDLIBS) -ldl

bench: $(BUILD)/bench/bench_core $(BUILD)/bench/bench_speed
	$(BUILD)/bench/bench_core
	-@$(MAKE) --no-print-directory $(BUILD)/bench/bench_speed_cblas || echo "(no OpenBLAS to link: the DTRAIN_USE_CBLAS row is skipped)"
	sh bench/run_speed.sh $(BUILD)/bench/bench_speed $(BUILD)/bench/bench_speed_cblas

# Strategy benchmarks (in-process all-reduce busbw against a minimal reference;
# MLP samples/s under each strategy; async against mirrored, with a straggler,
# and the staleness-bound curve), run by `make bench` too.
bench: bench-strategy bench-net
# TCP collectives and multi-worker training vs OpenMPI (TCP), iperf3 and PyTorch DDP;
# then every strategy over slow links (tbf-shaped veth and DTRAIN_NETEM), with DDP
# on the same shaped link (bench/run_slowlinks.sh, about 10 minutes).
bench-net: tools/dtrain-bench tools/dtrain-launch $(BUILD)/bench/bench_multiworker $(BUILD)/examples/02_fashion_mnist
	@if command -v mpicc >/dev/null 2>&1; then \
	  mpicc -std=c11 -O2 -DDTRAIN_USE_MPI -I. tools/dtrain_bench.c -o tools/dtrain-bench-mpi -lm -lpthread; fi
	BUILD=$(BUILD) sh bench/run_net.sh
	BUILD=$(BUILD) sh bench/run_slowlinks.sh
# The MLP and CNN on one GPU against PyTorch on the same GPU (skips without
# nvcc, a GPU or torch.cuda); not part of `make bench` (no GPU on most machines).
bench-gpu:
	@if [ -n "$(CUDA_SKIP)" ]; then echo "bench-gpu: skipped ($(CUDA_SKIP))"; \
	else $(MAKE) --no-print-directory $(BUILD)/bench/bench_gpu && BUILD=$(BUILD) sh bench/run_gpu.sh; fi
bench-strategy: $(BUILD)/bench/bench_allreduce $(BUILD)/bench/bench_strategy $(BUILD)/bench/bench_async
	$(BUILD)/bench/bench_allreduce
	$(BUILD)/bench/bench_strategy
	$(BUILD)/bench/bench_async
# Link emulation (DTRAIN_NETEM) against the kernel's tbf shaper on a veth pair
# between two network namespaces (root; skips without ip/tc).
bench: bench-netem
bench-netem: tools/dtrain-bench
	sh bench/run_netem.sh
# Backup workers: mirrored(4) with a 4x straggler and one backup vs undisturbed.
bench: bench-backup
bench-backup: $(BUILD)/examples/04_sync_vs_async
	sh bench/run_backup.sh $(BUILD)/examples/04_sync_vs_async
# The planner against measured runs (02 --plan against 02 --json: threads, processes on
# loopback and over emulated 100 and 10 Mbit/s links; MLP and CNN), a table; about 6 minutes.
bench: bench-plan
bench-plan: $(BUILD)/examples/02_fashion_mnist $(BUILD)/examples/07_model_parallel tools/dtrain-launch
	EX=$(BUILD)/examples/02_fashion_mnist MP=$(BUILD)/examples/07_model_parallel bash bench/run_plan.sh
# The seeds' scaling figure (speed-up against 1-64 workers, sync and async, planner lines
# and measured points): bench/figures/scaling.svg, and bench/figures/simulated.svg redrawn
# from the last `make simulate`; about 3 minutes.
figures: $(BUILD)/examples/02_fashion_mnist tools/dtrain-launch
	BUILD=$(BUILD) bash bench/run_figures.sh
# Past this machine (issue 21 part 5): examples/05 (MLP and CNN) on the MPI backend under
# SimGrid's SMPI, 1-64 workers on bench/platforms, synchronous and (05 --servers 1) with a
# parameter server, beside the planner, and its figure bench/figures/simulated.svg (skips
# without smpicc/smpirun); each step's compute the planner's (SIM_COMPUTE=planner, the
# default; SIM_COMPUTE=core: this core's, as SMPI measures it); about 30 minutes.
simulate: $(BUILD)/examples/02_fashion_mnist
	BUILD=$(BUILD) bash bench/run_simulate.sh
# Pipeline parallelism: GPipe and 1F1B for M = 1..16 beside one_device.
bench: bench-pipeline
bench-pipeline: $(BUILD)/examples/07_model_parallel
	sh bench/run_pipeline.sh $(BUILD)/examples/07_model_parallel

# ---- Windows: MinGW-w64 (Debian's gcc-mingw-w64-x86-64-posix), the suite run under wine ----
# Static executables (no libwinpthread-1.dll beside them), Winsock (-lws2_32).
# The programs that fork processes or use POSIX-only calls are stand-ins that
# report themselves skipped (the README's Windows section lists what is and
# is not tested there); test_net_threads carries the transport's Windows checks.
WIN_CC   ?= x86_64-w64-mingw32-gcc-posix
WIN_CXX  ?= x86_64-w64-mingw32-g++-posix
WINE     ?= $(shell command -v wine64 || command -v wine || { test -x /usr/lib/wine/wine64 && echo /usr/lib/wine/wine64; })
WIN_SKIP := test_comm_tcp test_comm_p2p test_pipeline test_tensor_parallel test_netem test_mwm_tcp test_net \
            test_ps test_ps_elastic test_ps_compress test_ps_early test_ps_backup test_speed test_null_args test_alloc_fail
windows:
	@command -v $(WIN_CC) >/dev/null || { echo "make windows: no $(WIN_CC) (apt-get install gcc-mingw-w64-x86-64-posix)"; exit 2; }
	@test -n "$(WINE)" || { echo "make windows: no wine (apt-get install wine64)"; exit 2; }
	$(MAKE) --no-print-directory BUILD=build/win CC=$(WIN_CC) CXX=$(WIN_CXX) EXTRA_CFLAGS="-D__USE_MINGW_ANSI_STDIO=1" \
	  LDLIBS="-lm -lpthread -lws2_32 -static" SKIP_TESTS="$(WIN_SKIP)" RUNNER="$(WINE)" \
	  SKIP_WHY="not run on Windows: it forks processes or uses POSIX-only calls (fork, signals, FIFOs)" suite-bins
	@# the single-file build as a user compiles it (msvcrt's stdio, no feature macros)
	$(WIN_CC) -std=c11 $(WARN) -O1 -I. tests/dtrain_impl.c -c -o build/win/single_file.o
	@mkdir -p build/win/wineprefix
	WINEPREFIX=$(CURDIR)/build/win/wineprefix WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml=" $(WINE) wineboot -i >/dev/null 2>&1 || true
	WINEPREFIX=$(CURDIR)/build/win/wineprefix WINEDEBUG=-all BUILD=build/win RUNNER="$(WINE)" SCRIPTS=0 \
	  TEST_JOBS=2 sh tools/run_tests.sh
	@# the same numbers, checkpoints and wire frames as this machine's build (tests/cross_compare.sh)
	$(MAKE) --no-print-directory build/tests/portable_run
	WINEPREFIX=$(CURDIR)/build/win/wineprefix WINEDEBUG=-all WINE="$(WINE)" CROSS_ARCHS=x86_64-w64-mingw32:win \
	  sh tests/cross_compare.sh
	@# the examples as a user runs them (tests/windows_checks.sh): 02 rewriting its outputs, 05 over TCP
	$(MAKE) --no-print-directory BUILD=build/win CC=$(WIN_CC) EXTRA_CFLAGS="-D__USE_MINGW_ANSI_STDIO=1" \
	  LDLIBS="-lm -lpthread -lws2_32 -static" $(patsubst examples/%.c,build/win/examples/%,$(EX_SRC))
	WINEPREFIX=$(CURDIR)/build/win/wineprefix WINEDEBUG=-all WINE="$(WINE)" sh tests/windows_checks.sh

# ASan + UBSan over the whole suite (separate build directory).
sanitize:
	$(MAKE) BUILD=build/asan OPT="-O1 -g -fno-omit-frame-pointer" \
	  SAN="-fsanitize=address,undefined -fno-sanitize-recover=all" test-suite

# ThreadSanitizer over the suite's concurrent tests. TSan finds races between
# threads only, so the programs that start none (and whose library calls start
# none: intra-op threads stay at 1 unless DTRAIN_THREADS says otherwise) are
# reported skipped with the reason instead of run again at TSan's 5-15x cost;
# ASan+UBSan and the host build run them. (Checked with strace -f: none of
# them makes a clone with CLONE_THREAD; test_comm_tcp and test_net start
# processes, whose races TSan cannot see either.)
TSAN_SERIAL := test_api_compat test_char_model test_cluster test_comm_tcp test_data test_fit test_fixed_memory \
               test_grad_ready test_net test_nn test_null_args test_ops_conv test_ops_elem test_ops_matmul \
               test_ops_nn test_ops_shape test_optim test_params test_plan_fluid test_relu_inplace \
               test_strategy_nothreads test_train
tsan:
	$(MAKE) BUILD=build/tsan OPT="-O1 -g" SAN="-fsanitize=thread" SKIP_TESTS="$(TSAN_SERIAL)" \
	  SKIP_WHY="starts no thread: nothing for ThreadSanitizer (ASan+UBSan and the host build run it)" test-suite

# The suite cross-compiled for 64-bit ARM, 32-bit ARM and big-endian s390x and
# run under qemu-user, then compared number by number with this machine's run
# (needs gcc-<triple> cross compilers and qemu-user; see .ci/run).
CROSS_ARCHS ?= aarch64-linux-gnu:aarch64 arm-linux-gnueabihf:arm s390x-linux-gnu:s390x
test-cross: dtrain.h
	@set -e; for pair in $(CROSS_ARCHS); do \
	  triple=$${pair%%:*}; q=$${pair##*:}; \
	  echo "== $$triple (qemu-$$q)"; \
	  $(MAKE) --no-print-directory BUILD=build/cross-$$q CC=$$triple-gcc CXX=$$triple-g++ OPT="-O2" \
	    RUNNER="qemu-$$q -L /usr/$$triple" TEST_JOBS=2 test-suite; \
	done
	@CROSS_ARCHS="$(CROSS_ARCHS)" sh tests/cross_compare.sh

# The suite against minimal builds: no threads and no sockets; no stdio; the
# edge build without the distributed parts, the data loaders and dt_fit (tests
# of a compiled-out part skip, naming the switch).
# (Fixed memory with DTRAIN_NO_MALLOC is covered by tests/compile_checks.sh.)
MIN_CONFIGS := nothreads nostdio edge
MIN_FLAGS_nothreads := -DDTRAIN_NO_THREADS -DDTRAIN_NO_NET
MIN_FLAGS_nostdio := -DDTRAIN_NO_STDIO
MIN_FLAGS_edge := -DDTRAIN_NO_DIST -DDTRAIN_NO_DATA -DDTRAIN_NO_FIT
MIN_TARGETS := $(patsubst %,test-minimal-%,$(MIN_CONFIGS))
test-minimal: $(MIN_TARGETS)
# One configuration (CI runs them in different lanes): make test-minimal-edge
$(MIN_TARGETS): test-minimal-%: dtrain.h
	$(MAKE) --no-print-directory BUILD=build/min-$* EXTRA_CFLAGS="$(MIN_FLAGS_$*)" test-suite

# The house rules (layers only point down, no src/ file over 1,000 lines, the
# manual names every configuration macro): tools/check_house.sh.
check-house:
	sh tools/check_house.sh src
	@if command -v python3 >/dev/null 2>&1; then python3 tools/gen_null_test.py --check; \
	  else echo "check-house: no python3: tests/test_null_args.c not checked against the headers"; fi

# Fails if dtrain.h is not what src/ generates.
check-amalgamation: $(AMALG)
	$(AMALG) src src/MANIFEST $(BUILD)/dtrain.check.h
	cmp dtrain.h $(BUILD)/dtrain.check.h || { echo "dtrain.h is stale: run 'make amalgamate' and commit it"; exit 1; }

# libFuzzer targets (tests/fuzz/fuzz_*.c: the frame decoder, the handshake,
# ...), each run for FUZZ_SECONDS from its committed seeds plus the corpus it
# grew before (in $(BUILD)/fuzz). Needs clang with libFuzzer.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))
$(BUILD)/fuzz/%: tests/fuzz/%.c dtrain.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c11 -g -O1 -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=all -I. $< -o $@ -lm -lpthread
# One run per target, so that `make -j2 fuzz` runs two at a time (each
# libFuzzer process uses one core).
FUZZ_RUNS := $(patsubst %,%.run,$(FUZZ_TARGETS))
.PHONY: $(FUZZ_RUNS)
fuzz: $(FUZZ_RUNS)
$(FUZZ_RUNS): $(BUILD)/fuzz/%.run: $(BUILD)/fuzz/%
	@n=$*; mkdir -p $(BUILD)/fuzz/corpus-$$n; \
	  $< -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/corpus-$$n tests/fuzz/seeds/$$n > $(BUILD)/fuzz/$$n.log 2>&1 \
	    || { tail -n 60 $(BUILD)/fuzz/$$n.log; echo "$$n: FAILED (the input is in $(BUILD)/fuzz/)"; exit 1; }; \
	  echo "== $$n: $(FUZZ_SECONDS) s: $$(grep -E '^Done' $(BUILD)/fuzz/$$n.log)"; \
	  grep -E 'stat::number_of_executed_units|stat::peak_rss' $(BUILD)/fuzz/$$n.log

# ---- install ------------------------------------------------------------------
# make install PREFIX=/opt/dtrain [DESTDIR=...]: the header(s), a pkg-config
# file, a CMake package (find_package(dtrain)) and the tools that exist.
PREFIX  ?= /usr/local
VERSION := $(shell sed -n 's/^\#define DTRAIN_VERSION_STRING "\(.*\)"/\1/p' src/dt_base.h)
INSTALL_FILES_H := dtrain.h $(wildcard dtrain_cuda.h)
INSTALL_TOOLS   := tools/dtrain-launch tools/dtrain-bench tools/dtrain-ckpt

install: dtrain.h $(INSTALL_TOOLS)
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/lib/cmake/dtrain
	install -m 644 $(INSTALL_FILES_H) $(DESTDIR)$(PREFIX)/include/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' cmake/dtrain.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/dtrain.pc
	install -m 644 cmake/dtrainConfig.cmake $(DESTDIR)$(PREFIX)/lib/cmake/dtrain/
	sed -e 's|@VERSION@|$(VERSION)|' cmake/dtrainConfigVersion.cmake.in > $(DESTDIR)$(PREFIX)/lib/cmake/dtrain/dtrainConfigVersion.cmake
	$(if $(INSTALL_TOOLS),install -d $(DESTDIR)$(PREFIX)/bin && install -m 755 $(INSTALL_TOOLS) $(DESTDIR)$(PREFIX)/bin/)

uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/include/,$(notdir $(INSTALL_FILES_H)))
	rm -f $(DESTDIR)$(PREFIX)/lib/pkgconfig/dtrain.pc
	rm -rf $(DESTDIR)$(PREFIX)/lib/cmake/dtrain
	$(if $(INSTALL_TOOLS),rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(notdir $(INSTALL_TOOLS))))

clean:
	rm -rf build
