# Two commands work on a fresh Debian machine (run as root, or with sudo for apt):
#   make demo   install what is needed, build, and reshape the built-in example
#   make test   install what is needed, build, and run every test
BUILD ?= build
JOBS ?= $(shell nproc)
PY := /usr/bin/python3
DEB_PACKAGES := cmake g++ make pkg-config libtorch-dev libyaml-cpp-dev libre2-dev \
                libcli11-dev libgtest-dev libbenchmark-dev python3-torch \
                openmpi-bin libopenmpi-dev clang libclang-rt-14-dev strace \
                pybind11-dev python3-dev python3-venv ccache
FUZZ_BUILD ?= build-fuzz
# Seconds per fuzz target: short in `make test`, longer by hand (make fuzz FUZZ_SECONDS=3600).
FUZZ_SECONDS ?= 40
FUZZERS := pickle zip rules safetensors dcp_metadata hf_json manifest
SANITIZE_BUILD ?= build-asan

.PHONY: deps build install test demo fuzz sanitize bench clean

deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# The binary, its rules and the Python module (import reshard) into
# /usr/local (PREFIX=...); the module goes where Debian's python3 looks.
PREFIX ?= /usr/local
install: build
	cmake -S . -B $(BUILD) -DCMAKE_INSTALL_PREFIX=$(PREFIX) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)
	cmake --install $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(MAKE) fuzz

# libFuzzer with AddressSanitizer and UBSan on the parsers of untrusted bytes
# (tests/fuzz/). Each run starts from the seeds in tests/fuzz/corpus/ and
# keeps what it finds in $(FUZZ_BUILD)/corpus/; a crash fails the target and
# leaves its input as $(FUZZ_BUILD)/crash-*.
fuzz: deps
	cmake -S tests/fuzz -B $(FUZZ_BUILD) -DCMAKE_CXX_COMPILER=clang++ >/dev/null
	cmake --build $(FUZZ_BUILD) -j $(JOBS)
	@for f in $(FUZZERS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$f; \
	  echo "fuzzing $$f for $(FUZZ_SECONDS) s"; \
	  $(FUZZ_BUILD)/$${f}_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/ $(FUZZ_BUILD)/corpus/$$f tests/fuzz/corpus/$$f \
	    > $(FUZZ_BUILD)/$$f.log 2>&1; status=$$?; \
	  grep -E "^(Done|stat::number_of_executed_units)" $(FUZZ_BUILD)/$$f.log; \
	  if [ $$status -ne 0 ]; then tail -n 40 $(FUZZ_BUILD)/$$f.log; exit 1; fi; \
	done

# The unit tests built with AddressSanitizer and UBSan (-O1): a memory error,
# a leak or undefined behaviour fails the run with its report (but for the
# leak of LibTorch's own in tests/lsan_suppressions.txt). A build of its
# own (about 30 minutes on 2 cores with a cold compiler cache), so CI runs it
# after `make test`.
sanitize: deps
	cmake -S . -B $(SANITIZE_BUILD) -DRESHARD_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DRESHARD_BENCHMARKS=OFF >/dev/null
	cmake --build $(SANITIZE_BUILD) -j $(JOBS) --target unit_tests
	LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan_suppressions.txt $(SANITIZE_BUILD)/tests/unit_tests --gtest_brief=1

# Only the binary (and the LibTorch module it loads): the demo runs nothing else.
demo: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD) -j $(JOBS) --target reshard
	examples/demo.sh $(BUILD)/reshard

# The performance figures of benchmarks/README.md in one run (~30 minutes, ~50 GB in
# BENCH_WORKDIR, best as root on an otherwise idle machine): convert against
# cp -r in both page-cache modes with the exports and mpirun -np 2, then the
# cost model at three sizes. Never part of `make test`.
BENCH_BUILD ?= build-bench
BENCH_WORKDIR ?= $(BENCH_BUILD)/work
BENCH_LOG ?= $(BENCH_BUILD)/bench.log
# BENCH_KEEP=--keep keeps the checkpoints (~30 GB) for the next run.
BENCH_KEEP ?=
bench: deps
	cmake -S . -B $(BENCH_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BENCH_BUILD) -j $(JOBS) --target reshard
	{ $(PY) benchmarks/run.py --reshard $(BENCH_BUILD)/reshard --scales 1 --runs 3 --exports --crc-cost --mpi 2 \
	    --buffer-sizes 128KiB,4MiB --workdir $(BENCH_WORKDIR) --keep-checkpoints --json $(BENCH_BUILD)/run.json && \
	  $(PY) benchmarks/cost_model.py --reshard $(BENCH_BUILD)/reshard --workdir $(BENCH_WORKDIR) $(BENCH_KEEP) \
	    --json $(BENCH_BUILD)/cost_model.json; } 2>&1 | tee $(BENCH_LOG)

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD) $(SANITIZE_BUILD) $(BENCH_BUILD)
