# The two commands a new user needs: `make demo` and `make test`. Both install what is missing
# (apt, via scripts/install-deps) and build first.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
PYTHON := /usr/bin/python3
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# --durations: the slowest cases in every log, to keep CI under its time budget (move long ones to soak)
PYTEST_FLAGS ?= -q --durations=15

export PATH := $(CURDIR)/$(BUILD_DIR):$(PATH)
export PYTHONPATH := $(CURDIR)/python
export EFDL_BIN := $(CURDIR)/$(BUILD_DIR)/efdl

.PHONY: all deps configure build test test-cpp test-python demo install uninstall test-install bench clean \
	sanitize test-faults soak

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS) >/dev/null

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 300

test-python: build
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests/python

# Fault injection (tests/faults, docs/reliability.md): mounts tmpfs when run as root.
test-faults: build
	$(PYTHON) -m pytest $(PYTEST_FLAGS) tests/faults

test: test-cpp test-python test-faults

SOAK_SECONDS ?= 1800
# The rendezvous interleaving checker over 1,000,000 random schedules (about 5 min; make test runs
# 40,000), the kept-lease outage cases 20 times each (about 8 min; make test runs 5), the
# straggler detector at its default 30 s window (make test runs it at 6 s), then the
# fault-injection soak.
SOAK_SCHEDULES ?= 1000000
SOAK_LEASE_TRIALS ?= 20
soak: build
	EFDL_CHECKER_SCHEDULES=$(SOAK_SCHEDULES) $(BUILD_DIR)/tests/rendezvous/rendezvous_interleaving_test
	EFDL_LEASE_TRIALS=$(SOAK_LEASE_TRIALS) $(BUILD_DIR)/tests/etcd/etcd_lease_outage_test
	EFDL_TEST_DEFAULT_WINDOW=1 $(PYTHON) -m pytest $(PYTEST_FLAGS) tests/python/test_stragglers.py -k equal_nodes
	$(PYTHON) tests/faults/soak.py --duration $(SOAK_SECONDS)

demo: build
	$(PYTHON) examples/demo.py

# ASan+UBSan (clang) build of the input parsers and their unit tests, then each libFuzzer target
# for FUZZ_SECONDS, as many side by side as there are cores (scripts/sanitize; part of CI).
SANITIZE_DIR ?= build-sanitize
FUZZ_SECONDS ?= 20
sanitize: deps
	scripts/sanitize $(SANITIZE_DIR) $(FUZZ_SECONDS)

bench: build
	scripts/run-benchmarks

# /usr/local/bin/efdl (cmake, listed in $(BUILD_DIR)/install_manifest.txt) and the efdl package for
# $(PYTHON); its site-packages gets efdl-install-record.txt, which lists both.
install: build
	cmake --install $(BUILD_DIR)
	$(PYTHON) scripts/install-python-package.py $(CURDIR)/python \
	    --cmake-manifest $(abspath $(BUILD_DIR))/install_manifest.txt

# Removes exactly what `make install` put on the machine (the record and cmake's manifest) and
# prints each path; refuses in one line when nothing is recorded. Needs no build.
uninstall:
	@$(PYTHON) scripts/install-python-package.py --uninstall \
	    --cmake-manifest $(abspath $(BUILD_DIR))/install_manifest.txt

# As root, on a machine without EFDL installed (part of CI): make install, check the installed
# command and package (scripts/test-install), make uninstall, check nothing of it is left.
test-install: build
	scripts/test-install --build-dir $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR)
