"""The C++ decoder loop (models/decoder_loop.py) against the Python layers and transformers.

The loop calls the same C++ ops as the Python layers in the same order, so an engine with it
must produce the Python path's tokens AND logprobs exactly, at every precision it takes; in
float32 both equal transformers' greedy tokens. Steps of more than 8 tokens (prefill) run the
layers' GEMM calls in the loop (float32 / bfloat16) or the Python layers (group-wise int8 /
int4), so each run below mixes both sizes.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.quantization import gemv

from hf_reference import hf_greedy, make_prompts
from lora_utils import make_peft_adapter

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, logprobs=3)


def _llm(path: str, loop: str, monkeypatch: pytest.MonkeyPatch, **kwargs) -> LLM:
    monkeypatch.setenv("PAGEDSERVE_DECODER_LOOP", loop)
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("dtype", "float32")
    return LLM(path, **kwargs)


def _run(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


CASES = {
    "llama-fp32": ("llama-gqa", {}),
    "qwen2-fp32 (qkv bias)": ("qwen2", {}),
    "llama-bf16": ("llama-gqa", {"dtype": "bfloat16"}),
    "llama-int8": ("llama-gqa", {"quantization": "int8"}),
    "llama-int8-a8": ("llama-gqa", {"quantization": "int8", "quantization_activations": "int8"}),
    "llama-int4": ("llama-gqa", {"quantization": "int4"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loop_equals_the_python_layers(case, model_path, monkeypatch):
    name, kwargs = CASES[case]
    path = model_path(name)
    with_loop = _llm(path, "cpp", monkeypatch, **kwargs)
    loop = with_loop.llm_engine.runner.decoder_loop
    assert loop is not None
    prompts = make_prompts(with_loop.llm_engine.vocab_size, lengths=[3, 11, 29], seed=7)
    # One request alone (batch 1 decode), then three together (batch 3 decode).
    out = _run(with_loop, prompts[:1]) + _run(with_loop, prompts)
    # float32 / bfloat16 layers have a GEMM call too: every step runs the loop, prefill included;
    # group-wise int8 / int4 ones steps of at most gemv.CHUNKED_MAX_ROWS tokens (32 rows a GEMV
    # call past 32), which here is every step too (the 3 prompts' prefill is 43 tokens).
    assert loop.max_tokens == (gemv.CHUNKED_MAX_ROWS if "int" in case else None)
    assert loop.calls == 2 * NEW
    without = _llm(path, "off", monkeypatch, **kwargs)
    assert without.llm_engine.runner.decoder_loop is None
    ref = _run(without, prompts[:1]) + _run(without, prompts)
    for i, (a, b) in enumerate(zip(out, ref, strict=True)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids, f"{case} request {i}: tokens differ"
        assert a.logprobs == b.logprobs, f"{case} request {i}: logprobs differ"
    if "fp32" in case:
        for o, p in zip(out[1:], prompts, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(path, p, new_tokens=NEW, min_new_tokens=NEW)


def test_models_the_loop_cannot_run_keep_the_python_layers(model_path, monkeypatch):
    path = model_path("llama-gqa")
    # An int8 KV cache runs the torch attention backend: automatic mode says why and goes on.
    llm = _llm(path, "auto", monkeypatch, kv_cache_dtype="int8")
    assert llm.llm_engine.runner.decoder_loop is None
    prompts = make_prompts(llm.llm_engine.vocab_size, lengths=[4], seed=1)
    assert len(_run(llm, prompts)[0].outputs[0].token_ids) == NEW
    # Forced, the same model is an error that names the reason.
    with pytest.raises(ValueError, match="PAGEDSERVE_DECODER_LOOP=cpp.*attention backend"):
        _llm(path, "cpp", monkeypatch, kv_cache_dtype="int8")


def test_non_llama_models_keep_the_python_layers(model_path, monkeypatch):
    llm = _llm(model_path("opt"), "auto", monkeypatch)
    assert llm.llm_engine.runner.decoder_loop is None
    with pytest.raises(ValueError, match="not a Llama-family model"):
        _llm(model_path("opt"), "cpp", monkeypatch)


def test_lora_engines_run_base_steps_in_the_loop(model_path, monkeypatch, tmp_path):
    """With LoRA on, steps without adapter tokens run the loop (the wrappers' base layers);
    steps with them keep the Python layers. Both equal an engine without the loop."""
    path = model_path("llama-gqa")
    adapter = LoRARequest("attn", 1, make_peft_adapter(path, tmp_path / "attn", 8, ["q_proj", "v_proj", "o_proj"]))
    kwargs = {"enable_lora": True, "max_lora_rank": 8}
    with_loop = _llm(path, "cpp", monkeypatch, **kwargs)
    without = _llm(path, "off", monkeypatch, **kwargs)
    loop = with_loop.llm_engine.runner.decoder_loop
    prompts = make_prompts(with_loop.llm_engine.vocab_size, lengths=[6, 13], seed=3)
    base_out = _run(with_loop, prompts)
    base_calls = loop.calls
    assert base_calls >= NEW - 1
    lora_out = with_loop.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                                  lora_request=adapter)
    assert loop.calls == base_calls  # every step carried adapter tokens
    ref_base = _run(without, prompts)
    ref_lora = without.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                                lora_request=adapter)
    for a, b in zip(base_out + lora_out, ref_base + ref_lora, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    # The adapter changes the output (the LoRA path really ran).
    assert [o.outputs[0].token_ids for o in lora_out] != [o.outputs[0].token_ids for o in base_out]
