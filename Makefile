# ddm-fleet: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test install test-xla clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ddm-fleet up

test: $(STAMP)
	$(BIN)/python -m pytest -q

# XLA backend tests: a separate venv (torch 2.9.0 + torch-xla 2.9.0, ~7 GB, built once) and
# XLA's CPU device. The project is installed there without its torch pin; tests/xla/ runs.
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
XLA_DEPS = $(shell $(PY) -c "import tomllib; p=tomllib.load(open('pyproject.toml','rb'))['project']; \
	skip=('torch','jax','flax','optax','playwright'); \
	print(' '.join(repr(d) for d in p['dependencies']+p['optional-dependencies']['test'] if not d.startswith(skip)))")

$(XLA_STAMP): pyproject.toml
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install --quiet --upgrade pip
	$(XLA_VENV)/bin/pip install --quiet 'torch==2.9.0' 'torch-xla==2.9.0'
	$(XLA_VENV)/bin/pip install --quiet $(XLA_DEPS)
	$(XLA_VENV)/bin/pip install --quiet --no-deps -e .
	rm -f $(XLA_VENV)/.installed-*
	touch $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/xla

clean:
	rm -rf $(VENV) $(XLA_VENV) build *.egg-info
