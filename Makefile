# `make serve` and `make test` each set up .venv first (idempotent, fast when done).
.PHONY: setup serve demo test test-all lint bench

setup:
	@bash scripts/setup.sh

# SmolLM2-135M-Instruct (the default model) as "smollm2-135m-instruct" on 127.0.0.1:8000.
serve: setup
	.venv/bin/pagedserve serve

demo: setup
	.venv/bin/python -m pagedserve.entrypoints.demo

test: setup
	.venv/bin/python -m pytest -q

test-all: setup
	.venv/bin/python -m pytest -q -m ""

lint: setup
	.venv/bin/ruff check pagedserve tests benchmarks scripts

bench: setup
	.venv/bin/python benchmarks/throughput.py
