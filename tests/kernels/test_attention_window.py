"""Sliding windows and logit softcapping in the fused C++ paged-attention kernel, against the
torch backend (the oracle) and a dense fp64 reference, on every ISA variant this CPU runs.

Blocks wholly before the window of a request's first query are given back in the engine (a
windowed KV group's table holds the null block there): here they are NaN and the table points
at one NaN "null" block, so any read of a key outside the window poisons the output.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_attention_cpp import Req, Shape, build_step, make_requests

from pagedserve import envs
from pagedserve.attention import cpp_paged
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.cpp_build import PAGED_ATTENTION, KernelUnavailable, load_isa, runnable_isas


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    try:
        cpp_paged.load_extension()
    except KernelUnavailable as exc:
        pytest.skip(f"C++ paged attention cannot be built here: {exc}")


def ops_for(isa: envs.IsaName):
    if isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    return load_isa(PAGED_ATTENTION, isa).require()


def null_before_window(cache: torch.Tensor, common: CommonAttentionMetadata, reqs: list[Req],
                       block_size: int, window: int) -> None:
    """Blocks wholly before each request's first window start -> NaN, table -> a null block."""
    null = None
    for i, r in enumerate(reqs):
        start = max(0, r.cached - window + 1)  # first key the first query sees
        for b in range(start // block_size):
            cache[:, r.blocks[b]] = float("nan")
            null = r.blocks[b] if null is None else null
            common.block_tables[i, b] = null


def reference(reqs: list[Req], shape: Shape, scale: float, window: int,
              softcap: float | None) -> torch.Tensor:
    """Dense fp64: key j visible to query i iff i - window < j <= i; scores*scale, capped."""
    outs = []
    for r in reqs:
        k = r.k.double().repeat_interleave(shape.group, dim=1)
        v = r.v.double().repeat_interleave(shape.group, dim=1)
        scores = torch.einsum("thd,jhd->htj", r.q.double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(r.cached, r.cached + r.new)[:, None]
        keys = torch.arange(r.cached + r.new)[None, :]
        visible = (keys <= qpos) & (keys > qpos - window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("htj,jhd->thd", probs, v))
    return torch.cat(outs).float()


def run(backend, reqs, block_size, shape, window, softcap, dtype=torch.float32) -> torch.Tensor:
    cache, q, k, v, common = build_step(reqs, block_size, shape, dtype)
    null_before_window(cache, common, reqs, block_size, window)
    meta = backend.build_metadata(common)
    return backend.forward(q, k, v, cache, meta, shape.head_dim**-0.5, window, softcap)


# (cached, new): decodes inside / past the window, prefill chunks crossing the window edge,
# fresh prefills longer than the window, one-token prompts.
KINDS = [(0, 1), (3, 1), (40, 1), (150, 1), (301, 1), (0, 45), (9, 30), (60, 33), (130, 17),
         (200, 64)]
SHAPES = [Shape(4, 4, 64), Shape(6, 2, 64), Shape(8, 2, 128), Shape(10, 2, 48)]
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "split": {"min_part_tokens": 32, "parts_per_thread": 64, "q_tile": 3},
    "head_per_task": {"heads_per_task": 1, "q_tile": 5},
}


@pytest.mark.parametrize("isa", envs.ISAS)
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", [1, 7, 32, 50, 1000])
def test_window_and_softcap_match_torch(isa: envs.IsaName, window: int, softcap) -> None:
    ops = ops_for(isa)
    rng = random.Random(window * 7 + (softcap is None))
    torch.manual_seed(window)
    for shape in SHAPES:
        for block_size in (8, 16):
            kinds = rng.sample(KINDS, 6)
            reqs = make_requests(rng, kinds, block_size, shape)
            want = run(TorchPagedAttentionBackend(), reqs, block_size, shape, window, softcap)
            exact = reference(reqs, shape, shape.head_dim**-0.5, window, softcap)
            torch.testing.assert_close(want, exact, rtol=1e-4, atol=1e-4)  # the oracle itself
            for config, kwargs in CONFIGS.items():
                backend = cpp_paged.CppPagedAttentionBackend(ops=ops, **kwargs)
                got = run(backend, reqs, block_size, shape, window, softcap)
                try:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                except AssertionError as exc:
                    raise AssertionError(f"{shape} bs{block_size} {config} {kinds}") from exc


@pytest.mark.parametrize("isa", envs.ISAS)
def test_bfloat16_window_and_softcap(isa: envs.IsaName) -> None:
    ops = ops_for(isa)
    rng = random.Random(3)
    torch.manual_seed(3)
    shape = Shape(8, 2, 64)
    for window, softcap in ((20, None), (20, 3.0), (1000, 3.0)):
        reqs = make_requests(rng, rng.sample(KINDS, 7), 16, shape)
        got = run(cpp_paged.CppPagedAttentionBackend(ops=ops), reqs, 16, shape, window, softcap,
                  torch.bfloat16)
        assert got.dtype == torch.bfloat16
        want = run(TorchPagedAttentionBackend(), reqs, 16, shape, window, softcap, torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        exact = reference(reqs, shape, shape.head_dim**-0.5, window, softcap)
        torch.testing.assert_close(got.float(), exact, rtol=3e-2, atol=3e-2)


def test_windowed_plan_starts_at_each_items_window() -> None:
    """Decode items cover the last W keys (split from there); prefill tiles start at the
    window of their first query; the unwindowed plan is kept for the step's other layers."""
    backend = cpp_paged.CppPagedAttentionBackend(min_part_tokens=32, parts_per_thread=64, q_tile=8)
    items, merges, num_parts = backend._plan([1, 20], [1000, 120], threads=2, window=100)
    decode = sorted(r[3:5] for r in items if r[0] == 0)
    assert decode[0][0] == 900 and decode[-1][1] == 1000 and len(merges) == 1
    assert sum(e - b for b, e in decode) == 100 and num_parts == len(decode)
    prefill = sorted(r[1:5] for r in items if r[0] == 1)
    assert prefill == [[0, 8, 1, 108], [8, 16, 9, 116], [16, 20, 17, 120]]


def test_softcap_and_window_do_not_fall_back() -> None:
    backend = cpp_paged.CppPagedAttentionBackend()
    reqs = make_requests(random.Random(4), [(70, 1), (10, 20)], 16, Shape(6, 2, 64))
    run(backend, reqs, 16, Shape(6, 2, 64), 16, 30.0)
    assert backend._fallback_backend is None
