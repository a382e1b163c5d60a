"""The scheduler's layer imports no torch (issue 15, point 4): core/ deals in integers and
lists, and its collaborators come in as protocols (core/protocols.py)."""

from __future__ import annotations

import json
import subprocess
import sys

CORE_MODULES = [
    "pagedserve.core.scheduler",
    "pagedserve.core.factory",
    "pagedserve.core.kv_cache_manager",
    "pagedserve.core.block_pool",
    "pagedserve.core.protocols",
    "pagedserve.core.batching",
    "pagedserve.core.contiguous",
    "pagedserve.core.kv_manager_base",
    "pagedserve.core.kv_groups",
    "pagedserve.core.hybrid_kv_manager",
    "pagedserve.config",
]


def _fresh_import(code: str) -> dict:
    # A fresh interpreter: this test process has torch loaded already.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_core_imports_without_torch():
    imports = "; ".join(f"import {name}" for name in CORE_MODULES)
    found = _fresh_import(
        f"import json, sys; {imports}; "
        "print(json.dumps({'torch': 'torch' in sys.modules, "
        "'heavy': sorted(m for m in ('transformers', 'numpy', 'pagedserve.lora', 'pagedserve.cpp_build') "
        "if m in sys.modules)}))"
    )
    assert found == {"torch": False, "heavy": []}


def test_package_exports_stay_lazy():
    """`import pagedserve` is cheap; the vLLM-style top-level names still resolve (and only
    then load torch)."""
    found = _fresh_import(
        "import json, sys; import pagedserve; before = 'torch' in sys.modules; "
        "from pagedserve import LLM, SamplingParams, EngineArgs; "
        "print(json.dumps({'before': before, 'names': [LLM.__name__, SamplingParams.__name__, "
        "EngineArgs.__name__], 'after': 'torch' in sys.modules}))"
    )
    assert found == {"before": False, "names": ["LLM", "SamplingParams", "EngineArgs"], "after": True}
