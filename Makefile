# distmuon — the two commands a newcomer runs are `make demo` and `make test`.
# Both install what is missing (Debian packages with apt-get, Python packages with pip),
# build, and run. Every target is idempotent.

SHELL := /bin/bash
PYTHON ?= python3
JOBS ?= $(shell nproc)
BUILD_DIR ?= build
CMAKE_PRESET ?= release

APT_PACKAGES := cmake pkg-config g++ make libopenblas-dev openmpi-bin libopenmpi-dev \
                coinor-libcbc-dev nlohmann-json3-dev libeigen3-dev libgtest-dev libcli11-dev
# name[:module] — the module whose import proves the package is there.
PIP_PACKAGES := numpy pytest torch nanobind scikit-build-core:scikit_build_core matplotlib \
                nvidia-cutlass:cutlass_library

.PHONY: all deps deps-apt deps-pip build build-cpp python test test-cpp test-python test-gpu sanitize demo format tidy clean help

all: build

help:
	@echo "make demo    install what is missing, build the Python package, train the example with distmuon, torch.optim.Muon and AdamW (CPU)"
	@echo "make test    install what is missing, build, run every test (ctest: gtest + MPI; pytest)"
	@echo "make test-gpu  on a machine with NVIDIA GPUs: the whole GPU verification (tests/gpu/verify.sh)"
	@echo "make build   configure and build Release into $(BUILD_DIR)/ (executables in $(BUILD_DIR)/bin), pip-install the Python package"
	@echo "make python  only (re)install the Python package distmuon when its sources changed"
	@echo "make deps    only install the Debian and Python dependencies"
	@echo "make sanitize  the C++ CPU test suite built with AddressSanitizer + UBSan (build-sanitize/)"
	@echo "make format  clang-format the C++ sources; make tidy runs clang-tidy"

deps: deps-apt deps-pip

# Installs only the Debian packages that are missing (no prompts).
deps-apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "[deps] apt-get install $$missing"; \
	  if [ "$$(id -u)" != 0 ]; then SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "[deps] Debian packages present"; fi

# Installs only the Python packages that cannot be imported.
deps-pip:
	@missing=$$(for e in $(PIP_PACKAGES); do p=$${e%%:*}; m=$${e#*:}; \
	  $(PYTHON) -c "import $$m" >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "[deps] pip install $$missing"; \
	  $(PYTHON) -m pip install -q --disable-pip-version-check $$missing; \
	else echo "[deps] Python packages present"; fi

build: build-cpp python

build-cpp:
	@cmake --preset $(CMAKE_PRESET) -DPython3_EXECUTABLE=$$(command -v $(PYTHON)) >/dev/null
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# The Python package (scikit-build-core + nanobind, no network: --no-build-isolation), reinstalled
# only when a source it is built from changed since the last install (stamp file).
PY_STAMP := $(BUILD_DIR)/.python-installed
PY_SOURCES := pyproject.toml CMakeLists.txt $(wildcard cmake/*) \
              $(shell find python src include -type f \( -name '*.py' -o -name '*.cc' -o -name '*.h' \
                -o -name '*.cu' -o -name '*.cuh' -o -name 'CMakeLists.txt' \) 2>/dev/null)

# Without a visible GPU the extension is built CPU-only: its CUDA code could not run, and the
# C++ build above already compiles every CUDA source once (CI has 2 cores and no GPU).
PY_CUDA_FLAG := $(shell nvidia-smi -L >/dev/null 2>&1 || echo "-C cmake.define.DISTMUON_WITH_CUDA=OFF")

python: $(PY_STAMP)

$(PY_STAMP): $(PY_SOURCES)
	@echo "[python] pip install . (distmuon)"
	@$(PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-build-isolation --no-deps \
	  $(PY_CUDA_FLAG) .
	@mkdir -p $(BUILD_DIR) && touch $@

test: deps build test-cpp test-python

test-cpp:
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

# Passive OpenMP waiting: torch's pool, the engine's loops and OpenBLAS share few cores.
test-python: python
	OMP_WAIT_POLICY=passive $(PYTHON) -m pytest tests/python -q

# The GPU verification: CUDA kernels, NCCL at 2, 4 and 8 ranks, the PyTorch front over NCCL,
# faults, compute-sanitizer (tests/gpu/verify.sh says what and how). STAGED=.gpubin uses what
# tests/gpu/stage.sh prepared on another machine instead of installing and building here.
test-gpu:
	$(if $(STAGED),,$(MAKE) deps &&) STAGED=$(STAGED) PYTHON=$(PYTHON) tests/gpu/verify.sh

# The C++ CPU tests (gtest, MPI ranks, fuzz and fault tests) built with AddressSanitizer and
# UndefinedBehaviorSanitizer: any report fails the test that made it. Open MPI's own allocations
# at exit are not leaks of ours (tests/sanitize/lsan.supp); full stacks and Open MPI's plugins
# kept loaded, so that leaks inside third-party code are named and matched, not "unknown module".
SANITIZE_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0 \
  OMPI_MCA_mca_base_component_disable_dlclose=1
sanitize: deps
	@cmake --preset sanitize >/dev/null
	@cmake --build build-sanitize -j $(JOBS)
	cd build-sanitize && $(SANITIZE_ENV) ctest --output-on-failure -j $(JOBS) --timeout 1200

# The demo needs only the Python package (whose build compiles the core once, CPU-only without a
# GPU); `make test` is what compiles every CUDA source.
demo: deps python
	$(PYTHON) examples/train_gpt.py --optimizer distmuon,torch-muon,adamw --baseline-budget-s 90

format:
	clang-format -i $$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')

tidy: build
	clang-tidy -p $(BUILD_DIR) $$(git ls-files 'src/*.cc' 'tools/*.cc')

clean:
	rm -rf $(BUILD_DIR) build-py build-sanitize
