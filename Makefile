# Two commands do all the set-up on a fresh machine:
#   make demo   - tiny GPT pretraining on the CPU, on real text (the embedded corpus)
#   make test   - the test suite (CPU; GPU tests skip without CUDA)
PY := .venv/bin/python

.PHONY: venv demo test test-fast tables clean

venv:
	bash scripts/setup_venv.sh

demo: venv
	bash examples/train_tiny_cpu.sh

test: venv
	$(PY) -m pytest -q

# Unit tests only: skips the multi-second end-to-end runs.
test-fast: venv
	$(PY) -m pytest -q -m "not slow"

# docs/benchmarks.md and the README's figures, from the records in docs/figures/runs/
tables: venv
	$(PY) bench/tables.py

clean:
	rm -rf runs/ .pytest_cache
