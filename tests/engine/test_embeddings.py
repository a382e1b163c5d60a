"""Embeddings (LLM.embed, /v1/embeddings): the final hidden state at the last prompt token,
L2-normalized, checked against transformers' `last_hidden_state` on the same weights."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
from transformers import AutoModel

from pagedserve import LLM, PoolingParams, SamplingParams

from server_fixtures import TEST_MODEL, live_server  # noqa: F401

TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "hello", "a b c d e f g h"]


@pytest.fixture(scope="module")
def reference(model_path):
    model = AutoModel.from_pretrained(model_path(TEST_MODEL), torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def last_hidden(token_ids: list[int], normalize: bool = True) -> torch.Tensor:
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden

    return last_hidden


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8, "block_size": 4},  # chunked prefill: pooled at the last chunk
    {"enable_prefix_caching": True},
])
def test_embed_equals_transformers(model_path, reference, engine_args) -> None:
    llm = LLM(model_path(TEST_MODEL), kv_cache_memory_bytes=8 << 20, **engine_args)
    # Twice: the second pass hits the prefix cache where it is on.
    for _ in range(2):
        outs = llm.embed(TEXTS, use_tqdm=False)
        for out in outs:
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == (llm.llm_engine.hidden_size,)
            assert torch.allclose(got, reference(out.prompt_token_ids), atol=1e-5)
    raw = llm.embed({"prompt_token_ids": [5, 6, 7, 8]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    assert torch.allclose(torch.tensor(raw.outputs.embedding), reference([5, 6, 7, 8], normalize=False), atol=1e-4)
    llm.llm_engine.assert_no_leaks()


def test_embed_beside_generation_and_bad_params(model_path) -> None:
    llm = LLM(model_path(TEST_MODEL), kv_cache_memory_bytes=8 << 20)
    engine = llm.llm_engine
    alone = llm.generate("a b c", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    engine.add_request("gen", "a b c", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.add_request("emb", "hello there", PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["gen"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert done["emb"].pooled is not None and done["gen"].pooled is None
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", PoolingParams(dimensions=3), use_tqdm=False)
    engine.assert_no_leaks()


def test_embeddings_endpoint(live_server, reference) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0)
    # Without encoding_format the client asks for base64 and decodes it; then float explicitly.
    for fmt in ({}, {"encoding_format": "float"}):
        out = client.embeddings.create(model=TEST_MODEL, input=TEXTS, **fmt)
        assert [d.index for d in out.data] == [0, 1, 2]
        ids = [live_server.ctx.tokenizer.encode(t) for t in TEXTS]
        for data, token_ids in zip(out.data, ids, strict=True):
            assert torch.allclose(torch.tensor(data.embedding), reference(token_ids), atol=1e-5)
        assert out.usage.prompt_tokens == sum(len(i) for i in ids) == out.usage.total_tokens
    raw = httpx.post(live_server.v1 + "/embeddings", json={"input": [[5, 6, 7]], "encoding_format": "base64"}).json()
    vector = struct.unpack("<" + "f" * live_server.ctx.engine.hidden_size, base64.b64decode(raw["data"][0]["embedding"]))
    assert torch.allclose(torch.tensor(vector), reference([5, 6, 7]), atol=1e-5)
    for bad, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 3}, "dimensions"),
                       ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                       ({"input": "x", "messages": []}, "messages")):
        resp = httpx.post(live_server.v1 + "/embeddings", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    live_server.wait_idle()
    live_server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
