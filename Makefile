# Two commands work on a fresh Debian machine (run as root, or with sudo for apt):
#   make demo   install what is needed, build, and reshape the built-in example
#   make test   install what is needed, build, and run every test
BUILD ?= build
JOBS ?= $(shell nproc)
PY := /usr/bin/python3
DEB_PACKAGES := cmake g++ make pkg-config libtorch-dev libyaml-cpp-dev libre2-dev \
                libcli11-dev libgtest-dev libbenchmark-dev python3-torch \
                openmpi-bin libopenmpi-dev

.PHONY: deps build test demo clean

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

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

demo: build
	examples/demo.sh $(BUILD)/reshard

clean:
	rm -rf $(BUILD)
