"""/v1/completions scoring text the way lm-evaluation-harness does through vLLM's server:
echo + logprobs (max_tokens 0 or 1) and vLLM's `prompt_logprobs`, against transformers (fp32)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from hf_reference import load_hf
from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

PROMPT = "The quick brown fox jumps over the lazy dog because it is late"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--dtype", "float32"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def reference(server: LiveServer) -> tuple[list[int], torch.Tensor]:
    """The prompt's token ids and transformers' log_softmax at each position."""
    ids = server.ctx.engine.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = load_hf(server.model_path)(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _check_prompt_part(lp, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
        # The prompt token, then the top `top` (one fewer key when the token is among them).
        assert top <= len(lp.top_logprobs[i]) <= top + 1
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_max_tokens_0_scores_the_prompt(client, server, reference) -> None:
    ids, ref = reference
    out = client.completions.create(model=TEST_MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(ids)
    assert "".join(choice.logprobs.tokens) == PROMPT
    _check_prompt_part(choice.logprobs, ids, ref, 2)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


def test_echo_with_one_generated_token_like_lm_eval(client, reference) -> None:
    ids, ref = reference
    out = client.completions.create(model=TEST_MODEL, prompt=[ids, ids[:5]], max_tokens=1, echo=True,
                                    logprobs=1, temperature=0)
    first, second = out.choices
    assert len(first.logprobs.token_logprobs) == len(ids) + 1
    _check_prompt_part(first.logprobs, ids, ref, 1)
    # The generated token is greedy: its logprob is transformers' best at the last position.
    assert first.logprobs.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)
    # Prompt positions are causal: a shorter prompt scores its tokens the same.
    assert second.logprobs.token_logprobs[1:5] == pytest.approx(first.logprobs.token_logprobs[1:5], abs=1e-5)


def test_prompt_logprobs_field_has_vllm_shape(server, reference) -> None:
    ids, ref = reference
    body = {"model": TEST_MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    choice = httpx.post(server.v1 + "/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        record = entries[i][str(ids[i])]
        assert abs(record["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert record["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert set(record) == {"logprob", "rank", "decoded_token"}
        assert 3 <= len(entries[i]) <= 4
    assert choice["logprobs"] is None


def test_streamed_echo_gives_the_same_logprobs(client, reference) -> None:
    ids, _ = reference
    kwargs = {"model": TEST_MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text and text.startswith(PROMPT)
    assert tokens == whole.logprobs.tokens and len(tokens) == len(ids) + 3
    assert offsets == whole.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize(("patch", "param"), [
    ({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_scoring_fields_are_400(server, patch: dict, param: str) -> None:
    body = {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 4, **patch}
    resp = httpx.post(server.v1 + "/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
