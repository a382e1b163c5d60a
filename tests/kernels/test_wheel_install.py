"""A non-editable install (a built wheel) still has its C++ kernels and runs them.

The wheel is built from a copy of the package (`pip wheel --no-deps --no-build-isolation`),
installed with `pip install --no-deps --target` into a temporary folder that shadows the
checkout on PYTHONPATH (torch and the other dependencies come from this venv, untouched), and
a child process started outside the checkout generates greedily with every kernel forced
(`PAGEDSERVE_*=cpp`: a kernel that is not there fails the engine's construction instead of
falling back). Oracle: transformers' greedy tokens on the same weights.

The kernels build from the installed package's own `pagedserve/csrc`: the child checks that
`cpp_build.CSRC` lies inside the install and that the sources are there. The build cache is
keyed by the sources' bytes, not their path, so an install of the same sources reuses the
checkout's builds (the test costs seconds once the suite has built them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_reference import hf_greedy, make_prompts

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from pathlib import Path
import pagedserve
from pagedserve import LLM, SamplingParams, cpp_build
site = Path(sys.argv[1]).resolve()
assert Path(pagedserve.__file__).resolve().is_relative_to(site), pagedserve.__file__
assert cpp_build.CSRC.resolve().is_relative_to(site), cpp_build.CSRC
llm = LLM(model=sys.argv[2], dtype="float32", seed=0)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[3])}],
                   SamplingParams(temperature=0, max_tokens=int(sys.argv[4])))
used = sorted(k.name for k in cpp_build.KERNELS if cpp_build.load(k).ops is not None)
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "kernels": used,
                  "sources": sorted(p.name for p in cpp_build.CSRC.iterdir())}))
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow  # builds and installs the wheel in a fresh venv: `make test-slow`, which CI runs
def test_wheel_install_runs_the_cpp_kernels(tmp_path: Path, model_path) -> None:
    if shutil.which("ninja") is None and not (Path(sys.executable).parent / "ninja").exists():
        pytest.skip("no ninja: the kernels cannot be built here")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "pagedserve", src / "pagedserve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("pagedserve-*.whl")
    site = tmp_path / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])

    path = model_path("llama-gqa")
    prompt = make_prompts(256, [9])[0]
    env = {**os.environ, "PYTHONPATH": str(site), "PAGEDSERVE_ATTENTION_BACKEND": "cpp",
           "PAGEDSERVE_FUSED_OPS": "cpp", "PAGEDSERVE_GEMV": "cpp"}
    result = _run([sys.executable, "-c", CHILD, str(site), path, json.dumps(prompt), "8"],
                  env=env, cwd=tmp_path, timeout=900)
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"paged_attention", "fused", "gemv"} <= set(got["kernels"])
    assert "pagedserve_common.h" in got["sources"] and "fused_ops_cpu.cpp" in got["sources"]
    assert got["tokens"] == hf_greedy(path, prompt, new_tokens=8)
