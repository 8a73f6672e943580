# The two commands of the README: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m engines.kernels.build || true  # CPU kernels, once per machine (~30 s); else mlx's
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve --parallelism auto

# Four xdist workers on this 2-core machine: many cluster tests wait (heartbeats, lost-after,
# discovery) more than they compute (three kept the cores 1.47 busy of 2 on average, four 1.54). A module (or a package with its own conftest) runs whole on
# one, each worker on its own loopback; see tests/helpers/workers.py.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --dist loadscope --no-loadscope-reorder --durations=30

# Benchmarks are separate from the tests; each rewrites its own section of docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m tests.bench.bench_single
	$(BIN)/python -m tests.bench.bench_tensor_parallel
	$(BIN)/python -m tests.bench.bench_pipeline
	$(BIN)/python -m tests.bench.bench_prefix_cache
	$(BIN)/python -m tests.bench.architectures_table

lint: $(STAMP)
	$(BIN)/ruff check planner engines discovery cli tests

clean:
	rm -rf $(VENV) build *.egg-info
