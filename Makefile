# `make serve` and `make test` each set up .venv first (idempotent, fast when done).
.PHONY: setup serve demo test test-all lint bench

setup:
	@bash scripts/setup.sh

serve: setup
	.venv/bin/pagedserve serve

demo: setup
	.venv/bin/python -m pagedserve.entrypoints.demo

test: setup
	.venv/bin/python -m pytest -q

test-all: setup
	.venv/bin/python -m pytest -q -m ""

lint: setup
	.venv/bin/ruff check pagedserve tests benchmarks

bench: setup
	.venv/bin/python benchmarks/throughput.py
