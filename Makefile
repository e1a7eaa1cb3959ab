# dtrain -- build, test, demo, bench.
#   make demo      build and run the main demo
#   make test      build everything and run the test suite
# Everything is built into $(BUILD)/ (default build/).

CC      ?= cc
CXX     ?= c++
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

.PHONY: all test test-run demo bench amalgamate sanitize tsan clean check-amalgamation
.PHONY: bench-strategy

all: dtrain.h $(TESTS) $(EXAMPLES)

# ---- the header ------------------------------------------------------------
$(AMALG): tools/amalgamate.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O1 -Wall -Wextra -Werror $< -o $@

dtrain.h: $(SRC) $(AMALG)
	$(AMALG) src src/MANIFEST dtrain.h

amalgamate: $(AMALG)
	$(AMALG) src src/MANIFEST dtrain.h

# ---- objects, tests, examples ----------------------------------------------
$(BUILD)/dtrain.o: tests/dtrain_impl.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -I. -c $< -o $@

$(BUILD)/tests/%: tests/%.c tests/harness.h $(BUILD)/dtrain.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -I. -Itests $< $(BUILD)/dtrain.o -o $@ $(LDLIBS)

$(BUILD)/examples/%: examples/%.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -I. $< -o $@ $(LDLIBS)

# ---- running -----------------------------------------------------------------
test: all
	@BUILD=$(BUILD) CC="$(CC)" CXX="$(CXX)" SAN="$(SAN)" sh tools/run_tests.sh

demo: $(BUILD)/examples/01_xor
	$(BUILD)/examples/01_xor

$(BUILD)/bench/%: bench/%.c dtrain.h
	@mkdir -p $(dir $@)
	$(CC) $(STD) -O3 -march=native -g $(EXTRA_CFLAGS) -I. $< -o $@ $(LDLIBS)

bench: $(BUILD)/bench/bench_core
	$(BUILD)/bench/bench_core

# Strategy benchmarks (in-process all-reduce busbw against a minimal reference;
# MLP samples/s under each strategy), run by `make bench` too.
bench: bench-strategy
bench-strategy: $(BUILD)/bench/bench_allreduce $(BUILD)/bench/bench_strategy
	$(BUILD)/bench/bench_allreduce
	$(BUILD)/bench/bench_strategy

# ASan + UBSan over the whole suite (separate build directory).
sanitize:
	$(MAKE) BUILD=build/asan OPT="-O1 -g -fno-omit-frame-pointer" \
	  SAN="-fsanitize=address,undefined -fno-sanitize-recover=all" test

# ThreadSanitizer over the whole suite.
tsan:
	$(MAKE) BUILD=build/tsan OPT="-O1 -g" SAN="-fsanitize=thread" test

# Fails if dtrain.h is not what src/ generates.
check-amalgamation: $(AMALG)
	$(AMALG) src src/MANIFEST $(BUILD)/dtrain.check.h
	cmp dtrain.h $(BUILD)/dtrain.check.h || { echo "dtrain.h is stale: run 'make amalgamate' and commit it"; exit 1; }

clean:
	rm -rf build
