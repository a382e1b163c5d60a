"""The fused C++ paged-attention backend against a dense reference and the torch backend.

The extension is compiled once (tens of seconds) into the build cache
(`pagedserve.envs.torch_extensions_dir()`); later runs only load it. Every test here is
skipped, with the reason, when it cannot be built on this machine.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest
import torch

from pagedserve.attention import cpp_paged
from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.cpp_build import PAGED_ATTENTION, KernelUnavailable, load_isa

from hf_reference import hf_greedy, make_prompts


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    try:
        cpp_paged.load_extension()
    except KernelUnavailable as exc:
        pytest.skip(f"C++ paged attention cannot be built here: {exc}")


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclass
class Req:
    cached: int  # context already in the cache before this step
    new: int  # tokens in this step (1 = decode)
    k: torch.Tensor  # (cached + new, KVH, D): the request's whole K history
    v: torch.Tensor
    q: torch.Tensor  # (new, H, D)
    blocks: list[int]


def make_requests(
    rng: random.Random, kinds: list[tuple[int, int]], block_size: int, shape: Shape
) -> list[Req]:
    needed = sum(-(-(c + n) // block_size) for c, n in kinds)
    pool = list(range(needed + 16))  # a few blocks stay unused (NaN) in the cache
    rng.shuffle(pool)  # non-contiguous, shuffled block ids
    reqs = []
    for cached, new in kinds:
        nblk = -(-(cached + new) // block_size)
        blocks, pool = pool[:nblk], pool[nblk:]
        kv = torch.randn(2, cached + new, shape.kv_heads, shape.head_dim)
        q = torch.randn(new, shape.heads, shape.head_dim)
        reqs.append(Req(cached, new, kv[0], kv[1], q, blocks))
    return reqs


def slot(req: Req, pos: int, block_size: int) -> int:
    return req.blocks[pos // block_size] * block_size + pos % block_size


def build_step(reqs: list[Req], block_size: int, shape: Shape, dtype: torch.dtype):
    """Cache holding every request's prior context (NaN elsewhere), strided q/k/v, metadata.

    q, k and v are views of one fused (T, H + 2 KVH, D) tensor, as the model passes them.
    """
    num_blocks = max(max(r.blocks) for r in reqs) + 1
    kvh, d = shape.kv_heads, shape.head_dim
    cache = torch.full((2, num_blocks, block_size, kvh, d), float("nan"), dtype=dtype)
    flat = cache.view(2, -1, kvh, d)
    for r in reqs:
        slots = torch.tensor([slot(r, p, block_size) for p in range(r.cached)], dtype=torch.long)
        flat[0, slots] = r.k[: r.cached].to(dtype)
        flat[1, slots] = r.v[: r.cached].to(dtype)
    qkv = torch.cat([torch.cat([r.q, r.k[r.cached :], r.v[r.cached :]], dim=1) for r in reqs]).to(
        dtype
    )
    q, k, v = qkv.split([shape.heads, kvh, kvh], dim=1)
    slots = [slot(r, p, block_size) for r in reqs for p in range(r.cached, r.cached + r.new)]
    q_lens, s_lens = [r.new for r in reqs], [r.cached + r.new for r in reqs]
    width = max(len(r.blocks) for r in reqs)
    common = CommonAttentionMetadata(
        num_tokens=len(slots),
        num_seqs=len(reqs),
        block_size=block_size,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(s_lens),
        block_tables=torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs]),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
    )
    return cache, q, k, v, common


def reference(reqs: list[Req], shape: Shape, scale: float) -> torch.Tensor:
    """Dense fp64 attention per request over its known K/V; (num_tokens, H, D) fp32."""
    outs = []
    for r in reqs:
        k = r.k.double().repeat_interleave(shape.group, dim=1)  # head h uses KV head h // G
        v = r.v.double().repeat_interleave(shape.group, dim=1)
        scores = torch.einsum("thd,jhd->htj", r.q.double(), k) * scale  # (H, new, ctx)
        qpos = torch.arange(r.cached, r.cached + r.new)[:, None]
        visible = torch.arange(r.cached + r.new)[None, :] <= qpos  # (new, ctx)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("htj,jhd->thd", probs, v))
    return torch.cat(outs).float()


def random_kinds(rng: random.Random, n: int, long: bool = False) -> list[tuple[int, int]]:
    """(cached, new) mixes: decodes, prefill chunks with prior context, fresh prefills."""
    top = 400 if long else 90
    kinds = []
    for _ in range(n):
        kind = rng.choice(["decode", "decode", "chunk", "fresh"])
        if kind == "decode":
            kinds.append((rng.randint(0, top), 1))
        elif kind == "chunk":
            kinds.append((rng.randint(1, top), rng.randint(2, 40)))
        else:
            kinds.append((0, rng.randint(1, 80)))
    return kinds


CONFIGS = {
    "default": {},
    # Every decode split in many parts (log-sum-exp merge), tiny query tiles.
    "split": {"min_part_tokens": 32, "parts_per_thread": 64, "q_tile": 3},
    "head_per_task": {"heads_per_task": 1, "q_tile": 1},
    "index_copy_write": {"fused_cache_write": False, "q_tile": 64},
}
# head_dim 48: vectors, but not 4 of them (the one-row loops); G = 1, 3, 4 and 5 (row blocks of
# 3 with 1 or 2 left over, prefill tiles mixing tokens in one block).
SHAPES = [Shape(4, 4, 64), Shape(6, 2, 64), Shape(8, 2, 128), Shape(12, 4, 128), Shape(10, 2, 48)]


def run_step(
    backend: AttentionBackend, reqs: list[Req], block_size: int, shape: Shape, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(output, cache after the step, metadata) of one step through `backend`."""
    cache, q, k, v, common = build_step(reqs, block_size, shape, dtype)
    meta = backend.build_metadata(common)
    out = backend.forward(q, k, v, cache, meta, shape.head_dim**-0.5)
    return out, cache, common


def check(backend: AttentionBackend, reqs: list[Req], block_size: int, shape: Shape) -> None:
    out, cache, common = run_step(backend, reqs, block_size, shape)
    scale = shape.head_dim**-0.5
    torch.testing.assert_close(out, reference(reqs, shape, scale), rtol=1e-5, atol=1e-5)
    torch_out, _, _ = run_step(TorchPagedAttentionBackend(), reqs, block_size, shape)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    # The new tokens' K/V landed at their slots.
    flat = cache.view(2, -1, shape.kv_heads, shape.head_dim)
    new_k = torch.cat([r.k[r.cached :] for r in reqs])
    new_v = torch.cat([r.v[r.cached :] for r in reqs])
    torch.testing.assert_close(flat[0, common.slot_mapping], new_k, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, common.slot_mapping], new_v, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.heads}kv{s.kv_heads}d{s.head_dim}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batches_match_reference(block_size: int, shape: Shape) -> None:
    torch.manual_seed(block_size)
    rng = random.Random(block_size * 100 + shape.heads)
    for config, kwargs in CONFIGS.items():
        backend = cpp_paged.CppPagedAttentionBackend(**kwargs)
        for trial in range(2):
            reqs = make_requests(
                rng, random_kinds(rng, 3 + 5 * trial, long=trial == 1), block_size, shape
            )
            rng.shuffle(reqs)
            try:
                check(backend, reqs, block_size, shape)
            except AssertionError as exc:
                raise AssertionError(f"config {config}, trial {trial}") from exc


@pytest.mark.parametrize(
    "kinds",
    [
        [(0, 37)],  # one fresh prefill
        [(0, 1)],  # one-token prompt
        [(40, 1)],  # one decode
        [(31, 1), (32, 1), (33, 1)],  # decodes around a tile boundary
        [(33, 12)],  # continued prefill of one request
        [(700, 1), (5, 1)],  # one long decode: split in parts across threads
        [(5, 3), (0, 20), (17, 1), (64, 1), (0, 2), (100, 33)],
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_edge_shapes(kinds: list[tuple[int, int]], threads: int) -> None:
    torch.manual_seed(0)
    shape = Shape(6, 2, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kwargs in CONFIGS.values():
            reqs = make_requests(random.Random(0), kinds, 16, shape)
            check(cpp_paged.CppPagedAttentionBackend(**kwargs), reqs, 16, shape)
    finally:
        torch.set_num_threads(before)


def test_avx2_build_matches_reference() -> None:
    """The AVX2 path (machines without AVX-512), built as a variant of the same source."""
    if cpp_paged.load_extension().isa() != "avx512":
        pytest.skip("the native build already is the AVX2 / scalar path")
    ops = load_isa(PAGED_ATTENTION, "avx2").require()
    assert ops.isa() == "avx2"
    rng = random.Random(5)
    for shape in (Shape(6, 2, 64), Shape(8, 2, 128)):
        for kwargs in CONFIGS.values():
            reqs = make_requests(rng, random_kinds(rng, 8, long=True), 16, shape)
            check(cpp_paged.CppPagedAttentionBackend(ops=ops, **kwargs), reqs, 16, shape)


def test_head_dim_not_a_vector_multiple_uses_scalar_path() -> None:
    shape = Shape(6, 2, 36)  # 36 % 8 != 0: the portable loop on every ISA
    rng = random.Random(6)
    reqs = make_requests(rng, random_kinds(rng, 8, long=True), 16, shape)
    check(cpp_paged.CppPagedAttentionBackend(), reqs, 16, shape)


def test_bfloat16_cache_accumulates_in_fp32() -> None:
    torch.manual_seed(1)
    shape = Shape(12, 4, 64)
    rng = random.Random(1)
    reqs = make_requests(rng, random_kinds(rng, 12, long=True), 16, shape)
    out, cache, _ = run_step(cpp_paged.CppPagedAttentionBackend(), reqs, 16, shape, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref, _, _ = run_step(TorchPagedAttentionBackend(), reqs, 16, shape, torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    exact = reference(reqs, shape, shape.head_dim**-0.5)
    torch.testing.assert_close(out.float(), exact, rtol=3e-2, atol=3e-2)


def test_float16_falls_back_to_torch() -> None:
    shape = Shape(6, 2, 64)
    reqs = make_requests(random.Random(2), [(20, 1), (0, 9)], 16, shape)
    out, _, _ = run_step(cpp_paged.CppPagedAttentionBackend(), reqs, 16, shape, torch.float16)
    ref = reference(reqs, shape, shape.head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_plan_sorts_and_splits() -> None:
    backend = cpp_paged.CppPagedAttentionBackend(min_part_tokens=64)
    items, merges, num_parts = backend._plan([1, 1, 40], [100, 1000, 60], threads=2)
    costs = [(it[4] - it[3]) * (4 + it[2] - it[1]) for it in items]
    assert costs[0] == max(costs)
    # The 1000-token decode is split; its parts cover [0, 1000) exactly once.
    ((seq, first, count),) = merges
    parts = sorted((it[3], it[4]) for it in items if it[5] >= 0)
    assert seq == 1 and count == len(parts) == num_parts > 1 and first == 0
    assert parts[0][0] == 0 and parts[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    # The 40-token chunk (20 cached) is cut into query tiles with a causal key bound.
    tiles = sorted(it[1:5] for it in items if it[0] == 2)
    assert tiles == [[0, 16, 0, 36], [16, 32, 0, 52], [32, 40, 0, 60]]


def test_backend_choice(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    assert isinstance(
        get_attention_backend(torch.device("cpu")), cpp_paged.CppPagedAttentionBackend
    )
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    assert isinstance(get_attention_backend(torch.device("cpu")), TorchPagedAttentionBackend)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="PAGEDSERVE_ATTENTION_BACKEND"):
        get_attention_backend(torch.device("cpu"))

    def broken() -> None:
        raise KernelUnavailable("no compiler")

    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND")
    monkeypatch.setattr(cpp_paged, "load_extension", broken)
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend(torch.device("cpu"))
    assert isinstance(backend, TorchPagedAttentionBackend)
    assert "no compiler" in caplog.text
    # Forced, a kernel that cannot be built is an error, not a silent fallback.
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "cpp")
    with pytest.raises(KernelUnavailable, match="no compiler"):
        get_attention_backend(torch.device("cpu"))


def test_engine_matches_transformers_greedy(model_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig

    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "cpp")
    path = model_path("llama-gqa")
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size)
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64)
    assert isinstance(llm.llm_engine.runner.backend, cpp_paged.CppPagedAttentionBackend)
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        expected = hf_greedy(path, prompt, min_new_tokens=32)
        assert out.outputs[0].token_ids == expected, f"prompt {i}"
