"""Weight (int8, int4) and KV-cache (int8) quantization.

Oracles:
  * round trips: the dequantized weight is within half a quantization step of the original;
  * kernels: each layer's output equals a pure-torch evaluation of the same arithmetic
    (bf16 activations, integer weights, float32 sums rounded to bf16, float32 scales);
  * end to end: the int8 engine's greedy tokens equal transformers' `generate` on the same
    checkpoint with every linear layer replaced by that pure-torch arithmetic;
  * KV int8: paged attention equals SDPA over round-tripped K/V (float tolerance) and is
    within a stated tolerance of fp32 attention; the engine is batch/chunk invariant.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.engine_args import EngineArgs
from pagedserve.entrypoints.cli import build_parser
from pagedserve.models.layers.linear import LinearBase
from pagedserve.models.loader import load_model, weight_bytes
from pagedserve.quantization import QuantizationConfig
from pagedserve.quantization.gemv import gemv_ops
from pagedserve.quantization.int4 import (
    Int4LinearMethod,
    _packed_block_n,
    _unpack_blocks,
    dequantize_int4,
    pack_int4,
    quantize_int4,
)
from pagedserve.quantization.int8 import Int8LinearMethod, dequantize_int8, quantize_int8
from pagedserve.quantization.int8 import cpp_ops as int8_cpp_ops
from pagedserve.quantization.kv_int8 import dequantize_kv, fake_quantize_kv, quantize_kv
from pagedserve.worker import model_runner
from pagedserve.worker.kv_cache import KVCacheSpec

from hf_reference import hf_token_logprobs, make_prompts

BF16_ULP = 2.0**-7  # one bf16 unit in the last place, relative to the value (worst case)


class _Linear(nn.Module):
    """The attributes a quant method needs (a stand-in for LinearBase in unit tests)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.output_size, self.input_size = weight.shape
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = bias


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)
    w[3] = 0.0  # an all-zero row must not produce NaN
    w[5, 7] = 40 * w.abs().max()  # an outlier stretches only its own row/group
    return w


# ---- round trips ------------------------------------------------------------------------


def test_int8_round_trip_within_half_a_step() -> None:
    w = _weights(96, 128)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, w.abs().amax(1) / 127)
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert not dequantize_int8(q, scale)[3].any()
    # Relative RMS error of a Gaussian row: step / sqrt(12) / rms ~ 2.6 / 127 / 3.5 ~ 0.7%.
    assert (err[6:].pow(2).mean() / w[6:].pow(2).mean()).sqrt() < 0.01


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_round_trip_within_half_a_step(group_size: int) -> None:
    w = _weights(96, 256)
    # Plain min/max ranges: every value within half a step of its level.
    q, scale, zero = quantize_int4(w, group_size, clip_ratios=(1.0,))
    assert q.dtype == torch.uint8 and q.max() <= 15
    assert scale.shape == zero.shape == (256 // group_size, 96)
    dq = dequantize_int4(q, scale, zero, group_size)
    step = scale.float().t().repeat_interleave(group_size, dim=1)
    # Half a step, plus the bf16 rounding of the stored zero (~2^-9 of the group's range).
    assert ((dq - w).abs() <= step * 0.5 + step * 15 * 2**-8).all()
    assert not dq[3].any()
    # The outlier only coarsens its own group of row 5.
    assert scale[0, 5] > 20 * scale[1:, 5].max()
    # The default clip search never increases a group's squared error, and lowers the total.
    q2, scale2, zero2 = quantize_int4(w, group_size)
    dq2 = dequantize_int4(q2, scale2, zero2, group_size)

    def group_err(d: torch.Tensor) -> torch.Tensor:
        return (d - w).pow(2).view(96, -1, group_size).sum(-1)

    assert (group_err(dq2) <= group_err(dq) * (1 + 1e-6)).all()
    assert group_err(dq2).sum() < 0.99 * group_err(dq).sum()


def test_int4_packing_round_trips() -> None:
    q = torch.randint(0, 16, (128, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (128, 128) and packed.dtype == torch.uint8  # two values per byte
    block_n = _packed_block_n()
    if block_n is None:
        pytest.skip("this CPU's int4 packed layout is not the AVX512/AVX2 one")
    unpacked = _unpack_blocks(packed, block_n).permute(0, 2, 1).reshape(128, 256)
    assert torch.equal(unpacked, q)


# ---- kernels vs the same arithmetic in pure torch -----------------------------------------


def _int8_cpp_kernels() -> bool:
    """Whether int8 layers keep pair tiles: a C++ kernel (GEMM or decode GEMV) runs here."""
    return int8_cpp_ops() is not None or gemv_ops() is not None


def reference_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """float(bf16(bf16(x) @ q^T)) * scale + bias, with float32 sums."""
    acc = F.linear(x.bfloat16().float(), q.float()).bfloat16().float()
    y = acc * scale
    return y if bias is None else y + bias


def reference_int4(x: torch.Tensor, dq: torch.Tensor, bias=None) -> torch.Tensor:
    """float(bf16(bf16(x) @ W_dq^T)) + bias, W_dq = (q - 8) * scale + zero in float32."""
    y = F.linear(x.bfloat16().float(), dq).bfloat16().float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("kernel", ["auto", "torch"])  # C++ (AVX512-BF16 CPUs), torch's ops
@pytest.mark.parametrize("rows", [1, 8, 9, 16, 17, 200])  # <= 16: GEMV / torch int8 kernel; GEMM
def test_int8_layer_equals_reference_arithmetic(rows: int, kernel: str) -> None:
    w, bias = _weights(192, 256), torch.randn(192)
    layer = _Linear(w, bias)
    method = Int8LinearMethod(kernel=kernel)
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight")  # the full-precision weight is gone
    # Pair tiles for the C++ kernels (AVX512-BF16 GEMM or AVX2 GEMV), else torch's layout.
    assert hasattr(layer, "qweight_packed") == (kernel == "auto" and _int8_cpp_kernels())
    q, scale = quantize_int8(w)
    assert torch.equal(method.int_weight(layer), q) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    got = method.apply(layer, x)
    want = reference_int8(x, q, scale, bias)
    assert got.dtype == torch.float32
    # Same products and sums; only the float32 summation order differs, which can flip the
    # bf16 rounding of a sum by one unit.
    scale_bound = (want - bias).abs() * BF16_ULP + 1e-6
    assert ((got - want).abs() <= scale_bound).all()
    assert (got == want).float().mean() > 0.99


# torch's kernel (<= 64 rows) and bf16 GEMM; or the GEMV kernel (one call up to 32 rows, 32 rows
# a call up to gemv.CHUNKED_MAX_ROWS) and the GEMM on dequantized tiles
@pytest.mark.parametrize("rows", [1, 9, 32, 33, 64, 65, 128, 129, 200])
def test_int4_layer_equals_reference_arithmetic(rows: int) -> None:
    w, bias = _weights(192, 256), torch.randn(192)
    layer = _Linear(w, bias)
    method = Int4LinearMethod(group_size=64)
    method.process_weights_after_loading(layer)
    q, scale, zero = quantize_int4(w, 64)
    dq = dequantize_int4(q, scale, zero, 64)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    got = method.apply(layer, x)
    if hasattr(layer, "qweight_tiles"):  # the GEMV kernel's layout: float32 x, see int4.py
        want64 = F.linear(x.double(), dq.double(), bias.double())
        # float32 x: float32 products on every path and every CPU (issue 32: the GEMM past
        # CHUNKED_MAX_ROWS ran in bf16 on AVX512-BF16 CPUs).
        magnitude = F.linear(x.abs().double(), dq.abs().double())
        assert ((got.double() - want64).abs() <= magnitude * 1e-5 + 1e-5).all()
        return
    want = reference_int4(x, dq, bias)
    # The kernel path sums exactly these products. The bf16-GEMM path (> 64 rows) builds
    # the weight as q * scale + level0 in bf16, level0 = zero - 8 * scale: both level0 and
    # the weight are rounded once (2^-9 relative each), on top of the output rounding.
    level0 = (zero.float() - 8 * scale.float()).t().repeat_interleave(64, dim=1)
    weight_error = (dq.abs() + level0.abs()) * 2**-9
    budget = F.linear(x.bfloat16().float().abs(), weight_error) * (rows > method.kernel_max_rows)
    assert ((got - want).abs() <= (want - bias).abs() * BF16_ULP + budget + 1e-5).all()


def test_bf16_model_dtype_keeps_output_dtype() -> None:
    layer = _Linear(_weights(64, 128).bfloat16(), torch.randn(64).bfloat16())
    for method in (Int8LinearMethod(), Int4LinearMethod(64)):
        lay = _Linear(layer.weight.data, layer.bias)
        method.process_weights_after_loading(lay)
        assert method.apply(lay, torch.randn(3, 5, 128).bfloat16()).shape == (3, 5, 64)
        assert method.apply(lay, torch.randn(4, 128).bfloat16()).dtype == torch.bfloat16


# ---- loading ------------------------------------------------------------------------------


def _linear_layers(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_load_quantizes_every_linear_and_shrinks_weights(model_path, method: str, monkeypatch) -> None:
    path = model_path("demo")  # hidden 256, MLP 688: 688 is no int4 group multiple
    # Without the full-precision layers' decode copies (test_gemv.py counts those), so the
    # byte difference is the quantized layers' alone.
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    fp32, _ = load_model(path, torch.float32, torch.device("cpu"))
    # int8 per output channel and int4 at group 128 (int8's group-wise default: test_quantization_grouped.py).
    config = QuantizationConfig(method, -1 if method == "int8" else 128)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), config)
    layers = _linear_layers(model)
    names = [m.quant_method.name for m in layers]
    if method == "int8":
        assert set(names) == {"int8"}
        # Where the C++ kernel runs, every layer takes it (all shapes here are multiples of 16).
        assert all(hasattr(m, "qweight_packed") == _int8_cpp_kernels() for m in layers)
    else:  # down_proj (in 688) falls back to int8, the rest is int4
        assert names.count("int4") == 3 * len(layers) // 4 and names.count("int8") == len(layers) // 4
    assert all(not hasattr(m, "weight") for m in layers)
    linear_fp32 = sum(m.input_size * m.output_size * 4 for m in _linear_layers(fp32))
    linear_q = sum(m.quant_method.weight_bytes(m) for m in layers)
    assert linear_q < linear_fp32 * (0.26 if method == "int8" else 0.2)
    assert weight_bytes(fp32) - weight_bytes(model) == linear_fp32 - linear_q
    # The LM head and embeddings stay full precision unless asked.
    assert getattr(model.lm_head.quant_method, "name", None) != method
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_quantize_lm_head_keeps_tied_embedding(model_path) -> None:
    path = model_path("llama-tied")
    model, _ = load_model(
        path, torch.float32, torch.device("cpu"), QuantizationConfig("int8", -1, quantize_lm_head=True)
    )
    fp32, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.lm_head.quant_method.name == "int8" and not hasattr(model.lm_head, "weight")
    torch.testing.assert_close(model.model.embed_tokens.weight, fp32.model.embed_tokens.weight)
    hidden = torch.randn(4, fp32.config.hidden_size)
    got, want = model.compute_logits(hidden), fp32.compute_logits(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())


# ---- end to end: int8 engine == transformers with the same arithmetic -------------------


class _ReferenceInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.q, self.scale = quantize_int8(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_int8(x, self.q, self.scale, self.bias)


def _int8_reference_model(path: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and full != "lm_head":
                setattr(module, child_name, _ReferenceInt8Linear(child))
    return model


@torch.inference_mode()
def _greedy(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=model.config.pad_token_id,
    )[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
    return out, logprobs[pos, torch.tensor(out)].tolist()


def test_int8_engine_equals_reference_arithmetic(model_path, monkeypatch) -> None:
    """Greedy tokens of the quantized engine == transformers running the reference int8
    arithmetic in every linear layer: the test checks our kernels and loading, not just
    closeness to fp32. Prompts of mixed lengths run batched (prefill and decode rows).

    The elementwise ops run as torch's (transformers') own here: bf16 activations turn a
    last-bit difference of a fused RMSNorm into a bf16 rounding flip, and this random model
    has near-tied logits. Those ops are checked against torch in test_fused_ops.py."""
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "torch")
    path = model_path("llama-gqa")  # fused q/k/v and gate/up: shards quantized per row
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, [1, 5, 17, 33, 64, 100])
    reference = _int8_reference_model(path)
    expected = [_greedy(reference, p, 16) for p in prompts]
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, quantization="int8",
              quantization_group_size=-1)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        ours = [e[t].logprob for e, t in zip(completion.logprobs, tokens, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 2e-2


# ---- KV cache int8 ------------------------------------------------------------------------


def test_kv_round_trip_per_token_per_head() -> None:
    x = torch.randn(10, 4, 64)
    x[2, 1] = 0.0
    x[3, 0] *= 100  # one loud (token, head) row does not coarsen the others
    rows = quantize_kv(x)
    assert rows.shape == (10, 4, 68) and rows.dtype == torch.int8
    back = dequantize_kv(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert not back[2, 1].any()
    assert (step[3, 1] < step[3, 0] / 10).all()


def test_kv_cache_spec_counts_scales() -> None:
    fp32 = KVCacheSpec(12, 4, 64, 16, torch.float32)
    bf16 = KVCacheSpec(12, 4, 64, 16, torch.bfloat16)
    int8 = KVCacheSpec(12, 4, 64, 16, torch.int8)
    assert int8.bytes_per_token == 2 * 12 * 4 * (64 + 4)
    assert fp32.bytes_per_block / int8.bytes_per_block == pytest.approx(256 / 68)  # 3.76x
    assert bf16.bytes_per_block / int8.bytes_per_block == pytest.approx(128 / 68)  # 1.88x


def _paged_attention(q, k, v, kv_dtype, block_size=4):
    """Two requests through the torch backend: a cached prefix (written first), then a step
    of new tokens (3 and 1) attending to it. Returns the second step's output."""
    backend = TorchPagedAttentionBackend()
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    last = head_dim + 4 if kv_dtype == torch.int8 else head_dim
    cache = torch.zeros(2, 16, block_size, num_kv_heads, last, dtype=kv_dtype)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]])
    lens = [(0, 13), (0, 9)]  # request 0: 13 cached then 3 new; request 1: 9 then 1

    def step(spans, rows):
        slots = torch.cat([
            tables[r, torch.arange(a, b) // block_size] * block_size + torch.arange(a, b) % block_size
            for r, (a, b) in enumerate(spans)
        ])
        q_lens = [b - a for a, b in spans]
        common = CommonAttentionMetadata(
            num_tokens=len(rows), num_seqs=2, block_size=block_size, slot_mapping=slots,
            query_start_loc=torch.tensor([0, q_lens[0], sum(q_lens)]),
            seq_lens=torch.tensor([b for _, b in spans]), block_tables=tables,
            query_lens_list=q_lens, seq_lens_list=[b for _, b in spans],
            max_query_len=max(q_lens), max_seq_len=max(b for _, b in spans),
        )
        meta = backend.build_metadata(common)
        return backend.forward(q[rows], k[rows], v[rows], cache, meta, head_dim**-0.5)

    step(lens, torch.cat([torch.arange(0, 13), torch.arange(16, 25)]))
    return step([(13, 16), (9, 10)], torch.tensor([13, 14, 15, 25]))


def _sdpa_reference(q, k, v):
    """Causal attention of rows 13..15 over request 0 (rows 0..15), row 25 over 16..25."""
    outs = []
    for rows, ctx in ((range(13, 16), range(0, 16)), (range(25, 26), range(16, 26))):
        qq, kk, vv = q[list(rows)], k[list(ctx)], v[list(ctx)]
        group = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        offset = len(ctx) - len(rows)
        mask = torch.arange(len(ctx))[None] <= torch.arange(len(rows))[:, None] + offset
        outs.append(F.scaled_dot_product_attention(
            qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask
        ).transpose(0, 1))
    return torch.cat(outs)


def test_kv_int8_attention_vs_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(26, n, 64, generator=g) for n in (8, 2, 2))
    k[:, 1] *= 8  # heads with different ranges
    got = _paged_attention(q, k, v, torch.int8)
    # Exactly SDPA over the round-tripped K/V (float32 noise only) ...
    torch.testing.assert_close(got, _sdpa_reference(q, fake_quantize_kv(k), fake_quantize_kv(v)),
                               rtol=1e-5, atol=1e-5)
    # ... and within the stated tolerance of fp32 attention: per-row quantization error of
    # 1/254 of max|row| gives an output error ~1% of the output scale here.
    want = _sdpa_reference(q, k, v)
    assert (got - want).abs().max() < 0.03 * want.abs().max()
    assert torch.allclose(_paged_attention(q, k, v, torch.float32), want, rtol=1e-5, atol=1e-5)


def _greedy_engine(path: str, prompts, **kwargs) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=8 << 20, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [e[t].logprob for e, t in zip(o.outputs[0].logprobs, ts, strict=True)]
        for o, ts in zip(outs, tokens, strict=True)
    ]
    return tokens, logprobs


def test_kv_int8_engine_is_chunk_invariant_and_close_to_fp32(model_path) -> None:
    path = model_path("llama-gqa")
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, [1, 17, 64, 170])
    int8, logprobs = _greedy_engine(path, prompts, kv_cache_dtype="int8")
    # New tokens attend to their own dequantized K/V, so chunking changes nothing.
    chunked, _ = _greedy_engine(path, prompts, kv_cache_dtype="int8", max_num_batched_tokens=16)
    assert chunked == int8
    # Greedy tokens may part ways with fp32 at a near-tie (this random model has top-2 gaps
    # down to 1e-3), so compare probabilities instead: fp32 transformers' logprob of each
    # token the int8-KV engine chose, on the same context, is close to the engine's own.
    for prompt, tokens, ours in zip(prompts, int8, logprobs, strict=True):
        theirs = hf_token_logprobs(path, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 0.1


def test_kv_int8_quadruples_blocks_vs_fp32(model_path) -> None:
    path = model_path("demo")  # head_dim 32: (32 * 4) / (32 + 4) = 3.56x
    fp32 = LLM(path, max_model_len=256, kv_cache_memory_bytes=8 << 20).llm_engine.num_blocks
    int8 = LLM(path, max_model_len=256, kv_cache_memory_bytes=8 << 20, kv_cache_dtype="int8")
    assert int8.llm_engine.num_blocks == pytest.approx(fp32 * 128 / 36, rel=0.01)


class _NoInt8Backend(TorchPagedAttentionBackend):
    name = "no_int8"
    supports_kv_int8 = False


def test_kv_int8_refused_by_forced_backend_without_support(monkeypatch) -> None:
    monkeypatch.setattr(model_runner, "get_attention_backend", lambda device: _NoInt8Backend())
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "cpp")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported by the 'no_int8'"):
        model_runner._attention_backend(torch.device("cpu"), torch.int8)
    # Chosen automatically, it is replaced by the torch backend instead.
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND")
    backend = model_runner._attention_backend(torch.device("cpu"), torch.int8)
    assert backend.supports_kv_int8
    assert model_runner._attention_backend(torch.device("cpu"), torch.float32).name == "no_int8"


# ---- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ModelConfig("m", quantization="int3"), "quantization must be one of"),
        (lambda: ModelConfig("m", quantization="int4", quantization_group_size=100), "group_size"),
        (lambda: ModelConfig("m", quantize_lm_head=True), "quantize_lm_head"),
        (lambda: CacheConfig(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    ],
)
def test_bad_config_is_refused(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_flags() -> None:
    args = build_parser().parse_args([
        "generate", "m", "--prompt", "x", "--quantization", "int4",
        "--quantization-group-size", "64", "--quantize-lm-head", "--kv-cache-dtype", "int8",
    ])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.quantization, engine_args.quantization_group_size) == ("int4", 64)
    assert engine_args.quantize_lm_head is True and engine_args.kv_cache_dtype == "int8"
