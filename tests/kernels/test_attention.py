"""The paged-attention backend against a dense per-request reference.

Each request's full K/V history is known to the test; the reference attends directly over
it (explicit softmax, causal among the new tokens), so block tables, slot mappings, padding
and chunking are all checked by an oracle that uses none of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


@dataclass
class Req:
    cached: int  # context already in the cache before this step
    new: int  # tokens in this step (1 = decode)
    k: torch.Tensor  # (cached + new, KVH, D): the request's whole K history
    v: torch.Tensor
    q: torch.Tensor  # (new, H, D)
    blocks: list[int]


def make_requests(rng: random.Random, kinds: list[tuple[int, int]], block_size: int) -> list[Req]:
    needed = sum(-(-(c + n) // block_size) for c, n in kinds)
    pool = list(range(needed + 16))  # a few blocks stay unused (NaN) in the cache
    rng.shuffle(pool)  # non-contiguous, shuffled block ids
    reqs = []
    for cached, new in kinds:
        total = cached + new
        nblk = -(-total // block_size)
        blocks, pool = pool[:nblk], pool[nblk:]
        reqs.append(
            Req(
                cached,
                new,
                torch.randn(total, NUM_KV_HEADS, HEAD_DIM),
                torch.randn(total, NUM_KV_HEADS, HEAD_DIM),
                torch.randn(new, NUM_HEADS, HEAD_DIM),
                blocks,
            )
        )
    return reqs


def slot(req: Req, pos: int, block_size: int) -> int:
    return req.blocks[pos // block_size] * block_size + pos % block_size


def build_step(reqs: list[Req], block_size: int, num_blocks: int):
    """Cache holding every request's prior context (NaN elsewhere), flat q/k/v, metadata."""
    cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    for r in reqs:
        for p in range(r.cached):
            flat[0, slot(r, p, block_size)] = r.k[p]
            flat[1, slot(r, p, block_size)] = r.v[p]
    q = torch.cat([r.q for r in reqs])
    k = torch.cat([r.k[r.cached :] for r in reqs])
    v = torch.cat([r.v[r.cached :] for r in reqs])
    slots = [slot(r, p, block_size) for r in reqs for p in range(r.cached, r.cached + r.new)]
    q_lens = [r.new for r in reqs]
    s_lens = [r.cached + r.new for r in reqs]
    max_blocks = max(len(r.blocks) for r in reqs)
    common = CommonAttentionMetadata(
        num_tokens=len(slots),
        num_seqs=len(reqs),
        block_size=block_size,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(s_lens),
        block_tables=torch.tensor([r.blocks + [0] * (max_blocks - len(r.blocks)) for r in reqs]),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
    )
    return cache, q, k, v, common


def reference(reqs: list[Req], scale: float) -> torch.Tensor:
    """Dense attention per request, over its known K/V; (num_tokens, H, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    outs = []
    for r in reqs:
        k = r.k.repeat_interleave(group, dim=1)  # (ctx, H, D): head h uses KV head h // group
        v = r.v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,jhd->htj", r.q, k) * scale  # (H, new, ctx)
        qpos = torch.arange(r.cached, r.cached + r.new)[:, None]
        visible = torch.arange(r.cached + r.new)[None, :] <= qpos  # (new, ctx)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1)
        outs.append(torch.einsum("htj,jhd->thd", probs, v))
    return torch.cat(outs)


def random_kinds(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(cached, new) mixes: decodes, prefill chunks with prior context, fresh prefills."""
    kinds = []
    for _ in range(n):
        kind = rng.choice(["decode", "decode", "chunk", "fresh"])
        if kind == "decode":
            kinds.append((rng.randint(0, 90), 1))
        elif kind == "chunk":
            kinds.append((rng.randint(1, 70), rng.randint(2, 40)))
        else:
            kinds.append((0, rng.randint(1, 80)))
    return kinds


BACKENDS = {
    "default": {},
    # Tiny budgets: every request its own chunk / many padded multi-request chunks.
    "tiny_budget": {"kv_budget_tokens": 1, "solo_prefill_tokens": 1},
    "padded_groups": {"kv_budget_tokens": 400, "solo_prefill_tokens": 10_000},
    "one_chunk": {"kv_budget_tokens": 1 << 30, "solo_prefill_tokens": 10_000},
    "no_fold": {"fold_gqa_decode": False},
}


def run_and_check(backend: AttentionBackend, reqs: list[Req], block_size: int) -> None:
    num_blocks = max(max(r.blocks) for r in reqs) + 1
    cache, q, k, v, common = build_step(reqs, block_size, num_blocks)
    scale = HEAD_DIM**-0.5
    meta = backend.build_metadata(common)
    out = backend.forward(q, k, v, cache, meta, scale)
    torch.testing.assert_close(out, reference(reqs, scale), rtol=1e-5, atol=1e-5)
    # The new tokens' K/V landed at their slots.
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[0, common.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, common.slot_mapping], v, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("config", list(BACKENDS))
def test_mixed_batches_match_reference(block_size: int, config: str) -> None:
    torch.manual_seed(block_size)
    rng = random.Random(block_size)
    backend = TorchPagedAttentionBackend(**BACKENDS[config])
    for trial in range(3):
        reqs = make_requests(rng, random_kinds(rng, 3 + 4 * trial), block_size)
        rng.shuffle(reqs)
        run_and_check(backend, reqs, block_size)


@pytest.mark.parametrize(
    "kinds",
    [
        [(0, 37)],  # one fresh prefill: causal over the new tokens, no gather
        [(0, 9), (0, 9), (0, 9)],  # equal fresh prefills in one chunk: plain causal
        [(0, 1)],  # one-token prompt
        [(40, 1)],  # one decode
        [(25, 1), (25, 1), (25, 1)],  # equal decodes: no mask
        [(33, 12)],  # continued prefill of one request
        [(5, 3), (0, 20), (17, 1), (64, 1), (0, 2)],
    ],
)
def test_edge_shapes(kinds: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    for config in ("default", "padded_groups"):
        backend = TorchPagedAttentionBackend(**BACKENDS[config])
        run_and_check(backend, make_requests(rng, kinds, 16), 16)


def test_factory_returns_backend() -> None:
    backend = get_attention_backend(torch.device("cpu"))
    assert isinstance(backend, AttentionBackend)
