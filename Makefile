# Every target that runs code depends on .venv, so `make run` and `make test` set themselves up.
PYTHON ?= python3
# torch with torchvision (every image processor of transformers builds), a CUDA build that runs on
# the CPU here and unchanged on a GPU; `make setup TORCH=torch==2.13.0` takes the CPU build alone.
TORCH ?= torch==2.14.1 torchvision==0.29.1
VENV := .venv
# The set CI tests: every package pinned (pip freeze of the venv the suite passed in).
PINNED := .ci/pinned.txt
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test test-all test-browser soak test-latest bench bench-setup bench-tp sweep ui lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(PINNED)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare torch requirement would pull the newest CUDA build.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c $(PINNED) -e ".[dev,ray]"
	touch $@

run: setup
	$(PY) -m pipeline model=mistral3 capture=partial $(ARGS)

# Two workers, each test process's torch on its share of the cores (tests/conftest.py): most
# end-to-end tests wait on a subprocess's start-up more than they compute. Every
# test has a time limit (pyproject.toml: pytest-timeout), and the processes it started end with it.
# `make test`: every test not marked slow or browser; `make test-all`: the whole suite (whole runs,
# sweeps, ranks, the browser, the bench), what CI runs, with its 30 slowest tests listed;
# `make test-browser`: the MLflow UI in Chromium alone; `make soak`: a race hunt, not a test.
PYTEST := $(PY) -m pytest -q -n 2
test: setup
	$(PYTEST) -m "not slow and not browser" $(ARGS)

test-all: setup
	$(PYTEST) --durations=30 $(ARGS)

test-browser: setup
	$(PYTEST) -m browser $(ARGS)

SOAK_REPEATS ?= 5
soak: setup
	PIPELINE_SOAK_REPEATS=$(SOAK_REPEATS) $(PYTEST) tests/reliability/test_tracking_store.py \
		-k parallel_sweeps_lose_no_run $(ARGS)

# The suite against the newest releases pyproject.toml admits, in a venv of their own: no pinned set,
# and torch as pip resolves it (a CUDA build of several GB). This machine's pip is capped at torch
# 2.14.1: `make test-latest PIP_CONFIG_FILE=/dev/null` lifts the cap (and every other pip setting).
LATEST := .venv-latest
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev,ray]"
	@$(LATEST)/bin/python -c "import torch, transformers, mlflow, hydra; print('testing torch', \
		torch.__version__, 'transformers', transformers.__version__, 'mlflow', mlflow.__version__, \
		'hydra-core', hydra.__version__)"
	$(LATEST)/bin/python -m pytest -q -n 2 --durations=30 $(ARGS)

# A ready example: every capture mode x two CPU backends on a tiny VLM (capture=full fails, by design).
sweep: setup
	$(PY) -m pipeline -m model=tiny_mistral3 capture=none,full,partial backend=torch-simple,torch-compile $(ARGS)

bench: setup
	$(PY) -m pipeline.bench $(ARGS)

# Decode with the language model sharded over 2 gloo ranks against one process (BENCHMARKS.tp.json,
# shown in BENCHMARKS.md); on GPUs: `$(PY) -m pipeline.bench.tensor_parallel --device cuda --worlds 1,2,4,8`.
# `make setup` from a fresh clone, timed per torch choice (BENCHMARKS.setup.json, shown in BENCHMARKS.md)
bench-setup: setup
	$(PY) -m pipeline.bench.setup $(ARGS)
	$(PY) -m pipeline.bench --render

bench-tp: setup
	$(PY) -m pipeline.bench.tensor_parallel $(ARGS)
	$(PY) -m pipeline.bench --render

# The embedded store of every run (tracking.uri unset), on 127.0.0.1 only.
PORT ?= 5000
ui: setup
	@$(PY) -m pipeline.tools.ui_url --port $(PORT)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check pipeline tests
	$(VENV)/bin/ruff format --check pipeline tests

clean:
	rm -rf outputs/2* outputs/multirun .pytest_cache .ruff_cache
