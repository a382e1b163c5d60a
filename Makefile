# `make serve` and `make test` each set up .venv first (idempotent, fast when done).
.PHONY: setup serve demo test test-all lint typecheck bench

setup:
	@bash scripts/setup.sh

# SmolLM2-135M-Instruct with the demo LoRA adapters (trained once, cached; see pagedserve/demo_adapters.py).
serve: setup
	.venv/bin/pagedserve serve $$(.venv/bin/python -m pagedserve.demo_adapters serve-args)

demo: setup
	.venv/bin/python -m pagedserve.entrypoints.demo

test: setup
	.venv/bin/python -m pytest -q

test-all: setup
	.venv/bin/python -m pytest -q -m ""

lint: setup
	.venv/bin/ruff check pagedserve tests benchmarks scripts

typecheck: setup
	.venv/bin/mypy

bench: setup
	.venv/bin/python benchmarks/throughput.py
