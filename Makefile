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

# The Ray-free tests on two processes of one torch thread each (two threads each oversubscribe two
# cores: 12 min instead of 4), a test module on one process so its module fixtures are built once;
# then the Ray tests one at a time (each starts Ray on the machine's cores). Both always run.
FREE_OF_RAY = OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadscope
test: setup
	$(FREE_OF_RAY) -m "not ray"; free=$$?; \
	$(PY) -m pytest -q -m ray; exit $$((free || $$?))

test-fast: setup lint
	$(FREE_OF_RAY) -m "not ray and not slow"

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
# pyproject.toml): CPU heavy, outside CI. Score = (killed + timed out) / all mutants (docs/testing.md).
# mutmut 3 skips every decorated function, and the estimators and samplers are all @torch.no_grad():
# MUTMUT mutates a function whose only decorator is torch.no_grad() like an undecorated one (the
# decorator does nothing when the function is defined; the trampoline and every mutant keep it).
# One torch thread per mutant process: two of them share the two cores without oversubscription.
# `make mutation MUTANTS="name ..."` re-runs only those mutants (after a full run; `mutmut show name`).
MUTMUT = $(PY) -c 'import libcst as cst, mutmut.mutation.file_mutation as f; \
skip = f.MutationVisitor._skip_node_and_children; \
no_grad = lambda n: isinstance(n, cst.FunctionDef) and n.decorators and all(cst.Module([]).code_for_node(d.decorator) == "torch.no_grad()" for d in n.decorators); \
f.MutationVisitor._skip_node_and_children = lambda self, n: skip(self, n.with_changes(decorators=[]) if no_grad(n) else n); \
from mutmut.__main__ import cli; cli()'

mutation: setup
	$(if $(MUTANTS),,rm -rf mutants)
	OMP_NUM_THREADS=1 nice -n 15 $(MUTMUT) run --max-children 2 $(MUTANTS)
	$(VENV)/bin/mutmut results
