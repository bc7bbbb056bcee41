# Two commands do all the set-up on a fresh machine:
#   make demo   - tiny GPT pretraining on the CPU, on real text (the embedded corpus)
#   make test   - the test suite (CPU; GPU tests skip without CUDA)
PY := .venv/bin/python

.PHONY: venv demo test test-fast tables step-doc clean

venv:
	bash scripts/setup_venv.sh

demo: venv
	bash examples/train_tiny_cpu.sh

# Tests run on TEST_WORKERS processes (pytest-xdist), each module's tests on one of them (its
# fixtures, often end-to-end runs shared by its tests, run once); the report ends with the
# slowest tests, so that a new slow one is seen when it lands.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: venv
	$(PYTEST) --durations=25

# Unit tests only: skips the multi-second end-to-end runs.
test-fast: venv
	$(PYTEST) -m "not slow"

# bench/benchmarks.md and the figures of README.md and docs/, from bench/figures/runs/
tables: venv
	$(PY) bench/tables.py

# docs/step.md: what one iteration runs, in order, from the launch's table of megatron changes
step-doc: venv
	$(PY) -m megagpt.launch.step_doc

clean:
	rm -rf runs/ .pytest_cache
