# `make demo`: set up and run the main job on the embedded defaults.
# `make test`: set up and run the whole test suite (what CI runs).
# `make test-fast`: the tests that start no Ray and train nothing end to end, and the linter (minutes).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lint gpu-check bench mutation

setup: $(VENV)/.installed

# constraints.txt: the versions the suite was run with (`pip freeze`), so an install is reproducible
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/mdc demo

test: setup
	$(PY) -m pytest -q

test-fast: setup lint
	$(PY) -m pytest -q -m "not ray and not slow"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# `make gpu-check`: the GPU box check (benchmarks/gpu_check.py, one JSON); DRY_RUN=1 runs it on CPU.
gpu-check: setup
	$(PY) -m benchmarks.gpu_check $(if $(DRY_RUN),--dry-run)

bench: setup
	$(PY) -m benchmarks.ingest
	$(PY) -m benchmarks.train_throughput

# Mutation testing of the math (objectives, ELBO/score estimators, samplers; [tool.mutmut] in
# pyproject.toml): CPU heavy, outside CI. Score = killed / all mutants (docs/testing.md).
mutation: setup
	rm -rf mutants
	nice -n 15 $(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results
