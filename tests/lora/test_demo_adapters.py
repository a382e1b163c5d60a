"""The demo adapters (pagedserve/demo_adapters.py) as a real multi-LoRA oracle.

Each adapter was trained to do one visible thing; on prompts it never saw, the engine must
show adapter X's effect exactly on the requests that name X, in one mixed batch with the
base model and the other adapters. And a trained adapter must decode as PEFT does.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.demo_adapters import ADAPTERS, HELD_OUT_TOPICS, has_effect, prompts

from lora_utils import peft_greedy

# The trained demo adapters on SmolLM2 (half a minute); the LoRA kernels' PEFT parity is in the fast suite (tests/lora/test_lora_engine.py). `make test-slow`.
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Share of the held-out prompts that must show each effect. Measured (greedy, 18 held-out
# prompts): greeter 18/18, envelope 18/18, shout 14/18 (upper case is harder for a 135M
# model after 20 steps; where it slips, it mixes cases). Never on any other adapter's reply.
MIN_SHARE = {"shout": 2 / 3, "greeter": 0.85, "envelope": 0.85}


@pytest.fixture(scope="module")
def demo():
    from pagedserve.demo_adapters import get_adapter_paths, get_smollm2_path

    return str(get_smollm2_path()), {name: str(p) for name, p in get_adapter_paths().items()}


@pytest.fixture(scope="module")
def llm(demo):
    base, _ = demo
    return LLM(base, enable_lora=True, max_loras=len(ADAPTERS), max_lora_rank=8, max_model_len=512,
               kv_cache_memory_bytes=48 << 20)


def _chat_prompt(llm: LLM, question: str) -> dict:
    tokenizer = llm.llm_engine.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return {"prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)}


def test_each_adapter_shows_its_effect_only_where_asked(demo, llm):
    _, paths = demo
    questions = prompts(HELD_OUT_TOPICS)[::2]  # 9 prompts about topics never trained on
    loras = [None] + [LoRARequest(name, i + 1, paths[name]) for i, name in enumerate(ADAPTERS)]
    requests = [(q, lora) for q in questions for lora in loras]  # one mixed batch
    outs = llm.generate([_chat_prompt(llm, q) for q, _ in requests], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        lora_request=[lora for _, lora in requests], use_tqdm=False)
    replies: dict[str | None, list[str]] = {}
    for (_, lora), out in zip(requests, outs, strict=True):
        replies.setdefault(lora.lora_name if lora else None, []).append(out.outputs[0].text)
    for name in ADAPTERS:
        shown = [r for r in replies[name] if has_effect(name, r)]
        assert len(shown) >= MIN_SHARE[name] * len(questions), (name, replies[name])
        for other in (None, *ADAPTERS):
            if other != name:
                leaked = [r for r in replies[other] if has_effect(name, r)]
                assert not leaked, (name, "leaked into", other, leaked)


def test_trained_adapter_decodes_like_peft(demo, llm):
    base, paths = demo
    prompt = _chat_prompt(llm, prompts(HELD_OUT_TOPICS)[1])
    for name in ("greeter",):  # one is enough here; each PEFT reference costs a model load
        lora = LoRARequest(name, 1 + list(ADAPTERS).index(name), paths[name])
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), lora_request=lora, use_tqdm=False)
        expected = peft_greedy(base, paths[name], prompt["prompt_token_ids"], 12)
        assert out[0].outputs[0].token_ids == expected, name
