# ddm-fleet: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pyproject.toml gives torch as a range; this pins the CPU wheel the suite runs on (see the file).
CONSTRAINTS := infra/constraints-cpu.txt
# Stamps are keyed on pyproject.toml + the constraints: a second run with both unchanged does not reinstall.
KEY := $(shell cat pyproject.toml $(CONSTRAINTS) | sha1sum | cut -c1-12)
RUNTIME_STAMP := $(VENV)/.installed-all-$(KEY)
TEST_STAMP := $(VENV)/.installed-test-$(KEY)
# Browser tests drive Debian's Chromium (tests/web/test_app_browser.py); DDM_CHROMIUM points elsewhere.
CHROMIUM := $(or $(DDM_CHROMIUM),/usr/bin/chromium)
# No wheel cache: it would keep a second copy of every wheel (about 4 GB for the XLA venv's CUDA
# torch) on a disk that CI machines do not always have to spare.
PIP_INSTALL := pip install --quiet --no-cache-dir

.PHONY: demo test test-fast lint install chromium cxx test-xla clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/$(PIP_INSTALL) --upgrade pip

# Runtime only: every role but xla (pyproject.toml's `all` extra).
$(RUNTIME_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[all]'
	rm -f $(VENV)/.installed-all-*
	touch $(RUNTIME_STAMP)

# What the suite needs: every role, the pretrained extra (diffusers, transformers: their tests) and
# the test tools (a superset of the runtime install).
$(TEST_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python chromium cxx
	$(BIN)/$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[all,pretrained,test]'
	rm -f $(VENV)/.installed-*
	touch $(RUNTIME_STAMP) $(TEST_STAMP)

# Chromium for the browser tests: present, or installed from Debian's packages when running as
# root, or stop at once with the command to run.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	if [ -z "$(DDM_CHROMIUM)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing Debian's chromium for the browser tests"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
	  echo "make: no Chromium at $(CHROMIUM) (browser tests); run: sudo apt-get install -y chromium (or set DDM_CHROMIUM)" >&2; exit 1; \
	fi

# A C++ compiler for torch.compile (inductor writes C++; the workers' `--compile auto` uses it on a CPU,
# tests/workers/test_torch_compile.py asks for it): present, or Debian's g++ when running as root.
cxx:
	@if command -v g++ >/dev/null || command -v c++ >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing Debian's g++ for torch.compile"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++; \
	else \
	  echo "make: no C++ compiler (torch.compile needs one); run: sudo apt-get install -y g++" >&2; exit 1; \
	fi

install: $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP)
	$(BIN)/ddm-fleet up

# Lint and format check ([tool.ruff] in pyproject.toml); `make test` and `make test-fast` run it first.
# `.venv/bin/ruff check --fix . && .venv/bin/ruff format .` fixes most of what it reports.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The whole suite, TEST_WORKERS test processes side by side (pytest-xdist; most tests wait on servers,
# processes and timeouts, so more workers than cores pays: measured in the README's "Tests"). Tests that
# share a module's fixture stay on one worker (--dist loadgroup, tests/conftest.py), the longest handed out
# first (tests/ordering.py; --no-loadscope-reorder keeps that order). It ends with the 25
# slowest tests and the wall and CPU seconds per marker tier (tests/timing_report.py).
TEST_WORKERS ?= 4
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

# The quick tier, for after each edit: pure units and in-process tests. Leaves out the tests that need
# a nats-server (bus), start processes (procs), drive Chromium (browser), train (train) or are slow;
# tests/conftest.py and pyproject.toml say how a test gets those markers. `make test` runs them all.
FAST := not slow and not bus and not procs and not browser and not train
# Two workers: 56 s against 83 s one at a time on the 2-core box (1,229 tests).
test-fast: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "$(FAST)"

# XLA backend tests: a separate venv with the [xla] extra (torch 2.9.0 + torch-xla 2.9.0 pinned by
# infra/constraints-xla.txt, ~7 GB, built once) on XLA's CPU device; tests/xla/ runs.
XLA_VENV := .venv-xla
XLA_CONSTRAINTS := infra/constraints-xla.txt
XLA_STAMP := $(XLA_VENV)/.installed-$(shell cat pyproject.toml $(XLA_CONSTRAINTS) | sha1sum | cut -c1-12)

# Disk: about 7.6 GB once installed (4.3 GB of it CUDA libraries torch 2.9.0 imports even on a CPU).
# infra/pip_stepwise.py installs one wheel at a time (a plain pip install holds every downloaded wheel
# until it is done: 11.7 GB at its peak), so the peak stays near the final size.
XLA_DISK_GB ?= 8

$(XLA_STAMP): pyproject.toml $(XLA_CONSTRAINTS) infra/pip_stepwise.py
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(XLA_DISK_GB) ]; then \
	  echo "make: warning: $$free GB free here; the XLA venv needs about $(XLA_DISK_GB) GB" >&2; \
	fi
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/$(PIP_INSTALL) --upgrade pip
	$(XLA_VENV)/bin/python infra/pip_stepwise.py -c $(XLA_CONSTRAINTS) -e '.[xla,test]' || { \
	  echo "make: installing the XLA venv failed; disk space where it installs:" >&2; df -h . >&2; exit 1; }
	rm -f $(XLA_VENV)/.installed-*
	touch $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/xla

clean:
	rm -rf $(VENV) $(XLA_VENV) build *.egg-info
