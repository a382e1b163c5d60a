"""A GGUF file's quantized blocks served as they are: the exact integer form of every type
(quantization/gguf_decode.py) and the GEMV kernels' float32 / float16 / affine parameter
forms that serve it (csrc/gemv_cpu.cpp, through quantization/gguf_blocks.py's methods).

Oracles: `gguf.dequantize` (the package's own numpy code) for the weights, bit for bit, and
F.linear in float64 on those weights for the layer outputs (the kernels multiply x by the
exact weights in float32: only the summation order differs). Blocks come from
`gguf.quants.quantize` where it can write the type, else random bytes with finite scales
(tests/gguf_utils.py). tests/engine/test_isa_variants.py re-runs this file per ISA variant.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gemv_cases import BF16_ULP
from gguf_utils import quantized

from pagedserve.models.gguf import GGUFQuantizedTensor
from pagedserve.models.layers.linear import MergedColumnParallelLinear
from pagedserve.quantization import gemv
from pagedserve.quantization.gguf_blocks import gguf_method
from pagedserve.quantization.gguf_decode import BLOCKS, decode

gguf = pytest.importorskip("gguf")

IN, OUT = 512, 48  # 512: two K-quant super-blocks; 48: three channel tiles per shard


def _tensor(qtype: str, seed: int, rows: int = OUT) -> tuple[GGUFQuantizedTensor, torch.Tensor]:
    """(the blocks, gguf.dequantize of them as float32 (rows, IN))."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, IN)) * 0.05).astype(np.float32)
    raw = np.ascontiguousarray(quantized(w, qtype, rng))
    want = gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32).reshape(rows, IN)
    return GGUFQuantizedTensor(qtype, (rows, IN), torch.from_numpy(raw)), torch.from_numpy(want)


@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_integer_form_is_gguf_dequantize_bit_for_bit(qtype: str):
    blocks, want = _tensor(qtype, 0)
    got = decode(qtype, blocks.blocks, blocks.shape).dequantize()
    if qtype == "Q4_0":  # q d + (-8 d) gives +0 where gguf's (q - 8) d gives -0 (d < 0)
        assert torch.equal(got, want)
    else:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _layer(qtypes: tuple[str, ...], bias: bool, activations: str = "none",
           ) -> tuple[MergedColumnParallelLinear, torch.Tensor]:
    """A fused layer with one shard per type, loaded through its GGUF method."""
    layer = MergedColumnParallelLinear(IN, [OUT] * len(qtypes), bias=bias)
    method = gguf_method(set(qtypes), kernel=True, activations=activations)
    assert method is not None
    layer.set_quant_method(method)
    parts = [_tensor(t, i + 1) for i, t in enumerate(qtypes)]
    for shard, (blocks, _) in enumerate(parts):
        layer.weight.weight_loader(layer.weight, blocks, shard)
    if bias:
        layer.bias.data.copy_(torch.randn(OUT * len(qtypes), generator=torch.Generator().manual_seed(5)))
    method.process_weights_after_loading(layer)
    return layer, torch.cat([w for _, w in parts])


# Each served form: int4 float32 (s, l0); 5- / 6-bit tiles with float16 / float32 scales of
# q - 2^(bits-1) or (s, l0) pairs, groups of 16 with a Q6_K shard; int8 float16 / float32
# scales or pairs; the types people publish alone and fused.
CASES = [("Q4_K",), ("Q4_K", "Q4_0"), ("Q6_K",), ("Q5_0",), ("Q5_0", "Q6_K"), ("Q5_0", "Q4_K"),
         ("Q5_1",), ("Q5_K",), ("Q4_K", "Q6_K"), ("Q5_0", "Q8_0"), ("IQ4_NL",), ("IQ4_XS",),
         ("Q6_K", "Q8_0", "Q5_1"), ("Q5_K", "Q6_K"), ("Q4_K", "Q5_K")]
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
BITS = FOUR_BIT | {"Q5_0", "Q6_K", "Q5_1", "Q5_K"}


def _method_name(qtypes: tuple[str, ...]) -> str:
    if set(qtypes) <= K_QUANTS:
        return "gguf-bits"  # the file's super-block parameters
    return "gguf-q4" if set(qtypes) <= FOUR_BIT else "gguf-bits" if set(qtypes) <= BITS else "gguf-int8"
ROWS = (1, 3, 11, 32, 45, 200)  # one GEMV call (11: a partial 12-row block); chunks of 32 (up to 128); the GEMM path

needs_kernel = pytest.mark.skipif(gemv.gemv_ops() is None, reason="GEMV kernel unavailable (no AVX2/FMA)")


@needs_kernel
@pytest.mark.parametrize("qtypes", CASES, ids="+".join)
def test_layer_holds_the_files_values_and_multiplies_them(qtypes: tuple[str, ...]):
    layer, want_w = _layer(qtypes, bias=True)
    method = layer.quant_method
    assert method.name == _method_name(qtypes)
    held = method.dequantized_weight(layer)
    assert torch.equal(held, want_w)
    gen = torch.Generator().manual_seed(3)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, IN, generator=gen).to(dtype)
            got = method.apply(layer, x)
            want = F.linear(x.double(), want_w.double(), layer.bias.double())
            magnitude = F.linear(x.double().abs(), want_w.double().abs()) + layer.bias.double().abs()
            bound = 1e-5 * magnitude
            if dtype == torch.bfloat16:  # one rounding of y; past the GEMV rows, a bf16 model's
                # GEMM may multiply bf16-rounded weights (where the CPU multiplies bf16 natively)
                gemm = rows > gemv.CHUNKED_MAX_ROWS
                bound = bound + want.abs() * BF16_ULP + (magnitude * BF16_ULP if gemm else 0)
            assert got.dtype == dtype and got.shape == want.shape
            assert ((got.double() - want).abs() <= bound + 1e-6).all(), (rows, dtype)


# int8 activations (the default for a GGUF file): bit quads x q8 for types of <= 6 bits (mixes of
# Q4_0 / Q4_1 alone keep the int4 tiles), int8 quads x q8 where the int8 parameters are float16
# scales; int8 tiles with float32 (s, l0) pairs keep float activations.
HALF_INT8 = {"Q8_0", "Q5_0", "IQ4_NL"}


def _rounds(qtypes: tuple[str, ...]) -> bool:
    return (set(qtypes) <= BITS and not set(qtypes) <= {"Q4_0", "Q4_1"}) or set(qtypes) <= HALF_INT8


@needs_kernel
@pytest.mark.parametrize("qtypes", CASES, ids="+".join)
def test_int8_activations_multiply_the_files_values_by_rounded_x(qtypes: tuple[str, ...]):
    """y = q8_round_trip(x) W^T (+ b) with W gguf's own dequantization, at decode and prefill row
    counts; the integer block sums are exact, so only float32 rounding of the per-group scale
    products and the sums differs from float64 (and one rounding of a bf16 y)."""
    layer, want_w = _layer(qtypes, bias=True, activations="int8")
    method = layer.quant_method
    rounds = _rounds(qtypes)
    parts = getattr(layer, "bit_parts", 0)
    assert (hasattr(layer, "qweight_quads") or parts > 0) == rounds, method.name
    if method.name == "gguf-bits":  # each shard's type in its own part (the cases' shards all differ)
        assert parts == (len(qtypes) if len(qtypes) > 1 else 0)
    assert torch.equal(method.dequantized_weight(layer), want_w)
    gen = torch.Generator().manual_seed(4)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, IN, generator=gen).to(dtype)
            if rows > 2:
                x[2, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5] * 8)  # ties: round half to even
            got = method.apply(layer, x)
            xr = gemv.q8_round_trip(x.float()).double() if rounds else x.double()
            want = F.linear(xr, want_w.double(), layer.bias.double())
            magnitude = F.linear(xr.abs(), want_w.double().abs()) + layer.bias.double().abs()
            bound = 1e-5 * magnitude
            if dtype == torch.bfloat16:
                bound = bound + want.abs() * BF16_ULP + magnitude * BF16_ULP
            assert got.dtype == dtype and got.shape == want.shape
            assert ((got.double() - want).abs() <= bound + 1e-6).all(), (rows, dtype)


@needs_kernel
@pytest.mark.parametrize("qtypes", [("Q4_K",), ("Q6_K",), ("Q5_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q4_K"),
                                    ("Q4_K", "Q5_K", "Q6_K")], ids="+".join)
def test_k_quant_layers_hold_the_files_bytes(qtypes: tuple[str, ...]):
    """With int8 activations a K-quant layer keeps exactly the file's bytes, so a decode step
    reads no more than llama.cpp does: each run of shards of one type in its own bits, Q4_K /
    Q5_K's 6-bit scales and mins packed as the file packs them (a Q4_K_M qkv with a Q6_K v
    held q and k in 6 bits, and Q4_K's parameters took 21 bytes a channel and super-block, not
    16)."""
    layer, want_w = _layer(qtypes, bias=False, activations="int8")
    raw = sum(_tensor(t, i + 1)[0].blocks.numel() for i, t in enumerate(qtypes))
    assert layer.quant_method.weight_bytes(layer) == raw
    assert torch.equal(layer.quant_method.dequantized_weight(layer), want_w)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parts_split_over_threads_by_bytes_compute_every_tile_once(threads: int):
    """The parts op gives each thread a run of tiles of about equal bytes, across part
    boundaries (10 tiles of 4 KiB, then 6 of 6 KiB: two threads split at 38 KiB, inside the
    first part's last tile): its output equals each part's own call."""
    layer = MergedColumnParallelLinear(IN, [160, 96], bias=False)
    layer.set_quant_method(gguf_method({"Q4_K", "Q6_K"}, kernel=True, activations="int8"))
    for shard, qtype in enumerate(("Q4_K", "Q6_K")):
        layer.weight.weight_loader(layer.weight, _tensor(qtype, shard + 1, rows=(160, 96)[shard])[0], shard)
    layer.quant_method.process_weights_after_loading(layer)
    parts = [(layer.qweight_quads_0, layer.scale_tiles_0), (layer.qweight_quads_1, layer.scale_tiles_1)]
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gemv.bits_q8_parts(x, [q for q, _ in parts], [p for _, p in parts], None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.cat([gemv.bits_q8(x, q, p, None) for q, p in parts], dim=-1))


@needs_kernel
def test_int8_activations_give_a_row_the_same_bits_in_any_batch():
    """A row's result does not depend on the rows beside it (each row is rounded alone and its
    sums run in one order): speculative decoding's verify steps and batched decode give the
    tokens a batch-1 decode gives."""
    layer, _ = _layer(("Q4_K", "Q6_K"), bias=True, activations="int8")
    x = torch.randn(37, IN, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([layer.quant_method.apply(layer, x[i : i + 1]) for i in range(37)])
    for rows in (2, 7, 37):
        assert torch.equal(layer.quant_method.apply(layer, x[:rows]), alone[:rows])


@needs_kernel
def test_int8_activations_past_a_chunk_of_rows_equal_the_rows_in_small_batches():
    """The kernel walks its tiles once per chunk of rows (512 KiB of int8 x: 1,020 rows of 512 k);
    2,100 rows take three chunks, and each row's result is what a small batch gives it."""
    layer, _ = _layer(("Q4_K", "Q6_K"), bias=True, activations="int8")
    x = torch.randn(2100, IN, generator=torch.Generator().manual_seed(11))
    pieces = torch.cat([layer.quant_method.apply(layer, part) for part in x.split(100)])
    assert torch.equal(layer.quant_method.apply(layer, x), pieces)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 5, 6])
def test_bit_quads_hold_every_value_where_the_kernel_reads_it(bits: int):
    """`pack_bit_quads`' layout as the C++ reads it (BitQuads), checked byte by byte, and its
    inverse."""
    q = torch.randint(0, 1 << bits, (32, 96), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    quads = gemv.pack_bit_quads(q, bits)
    assert quads.shape == (2, 3, 256 + 64 * (bits - 4))
    assert torch.equal(gemv.unpack_bit_quads(quads), q)
    for t, b, o, h, j, e in [(0, 0, 0, 0, 0, 0), (1, 2, 3, 1, 7, 3), (1, 1, 2, 0, 5, 1), (0, 2, 1, 1, 2, 2)]:
        ch, k = 16 * t + 8 * h + j, 32 * b + 8 * o + e
        byte = int(quads[t, b, 64 * o + 32 * h + 4 * j + e])
        assert byte == (int(q[ch, k]) & 15) | (int(q[ch, k + 4]) & 15) << 4
        if bits == 5:
            high = int(quads[t, b, 256 + 32 * h + 4 * j + e])
            assert (high >> 2 * o) & 1 == int(q[ch, k]) >> 4 and (high >> (2 * o + 1)) & 1 == int(q[ch, k + 4]) >> 4
        if bits == 6:
            high = int(quads[t, b, 256 + 64 * (o // 2) + 32 * h + 4 * j + e])
            shift = 4 * (o % 2)
            assert (high >> shift) & 3 == int(q[ch, k]) >> 4 and (high >> (shift + 2)) & 3 == int(q[ch, k + 4]) >> 4


@needs_kernel
def test_bits_q8_refuses_malformed_inputs():
    q = gemv.pack_bit_quads(torch.zeros(16, 64, dtype=torch.uint8), 4)
    pairs = torch.zeros(1, 2, 2, 16)
    with pytest.raises(RuntimeError, match="bit quads"):
        gemv.bits_q8(torch.zeros(1, 96), q, pairs, None)  # K mismatch
    with pytest.raises(RuntimeError, match="groups of 16 or 32"):
        gemv.bits_q8(torch.zeros(1, 64), q, torch.zeros(1, 1, 2, 16), None)  # a group of 64
    with pytest.raises(RuntimeError, match="one parameter tensor per part"):
        gemv.bits_q8_parts(torch.zeros(1, 64), [q, q], [pairs], None)
    with pytest.raises(RuntimeError, match="bias must have N"):
        gemv.bits_q8_parts(torch.zeros(1, 64), [q, q], [pairs, pairs], torch.zeros(16))


@needs_kernel
def test_the_decode_op_is_the_apply_of_a_decode_step():
    """What the C++ decoder loop calls (`decode_op`) computes what `apply` does."""
    for activations in ("none", "int8"):
        layer, _ = _layer(("Q4_K", "Q6_K"), bias=False, activations=activations)
        op, args = layer.quant_method.decode_op(layer)
        assert op == ("gemv_bits_q8_parts" if activations == "int8" else "gemv_int4_grouped")
        x = torch.randn(4, IN)
        if op == "gemv_bits_q8_parts":  # the parts' q's, then their parameters
            got = gemv._ops().gemv_bits_q8_parts(x, args[:2], args[2:], None)
        else:
            got = getattr(gemv._ops(), op)(x, *args, None)
        assert torch.equal(got, layer.quant_method.apply(layer, x))


@needs_kernel
def test_parameters_take_the_fewest_bytes_that_are_exact():
    """As many bits a weight as the file's (5 for Q5_0, 6 with a Q6_K shard); float16
    parameters where every shard's are exact in it (Q5_0, Q8_0); float32 for d * sub-block
    scale; (s, l0) pairs and groups of 16 only where a shard needs them."""
    forms = {  # tile bytes per k, parameter dtype, dims, groups (in = 512)
        ("Q5_0",): (10, torch.float16, 3, 16),
        ("Q5_0", "Q6_K"): (12, torch.float32, 3, 32),
        ("Q5_0", "Q8_0"): (16, torch.float16, 3, 16),
        ("IQ4_XS",): (16, torch.float32, 4, 16),
    }
    for qtypes, (nbytes, dtype, dims, groups) in forms.items():
        layer, _ = _layer(qtypes, bias=False)
        scales = layer.scale_tiles
        assert layer.qweight_tiles.shape[-1] == nbytes, qtypes
        assert (scales.dtype, scales.dim(), scales.shape[1]) == (dtype, dims, groups), qtypes
    layer, _ = _layer(("Q4_K", "Q4_0"), bias=False)
    assert layer.scales_zeros_tiles.dtype == torch.float32 and layer.qweight_tiles.shape[-1] == 8


# K-quants alone: uint8 super-block parameters (N/16, in/256, B), the file's integers and
# float16s: B = 32 + 16 G centered (Q6_K alone), 256 packed (Q4_K / Q5_K: 6-bit sc and m),
# 80 + 32 G affine (Q6_K beside them; G = groups a super-block).
SUPERBLOCK_FORMS = {  # tile bytes per k, B, bits a weight read (the file's)
    ("Q4_K",): (8, 256, 4.5),
    ("Q5_K",): (10, 256, 5.5),
    ("Q6_K",): (12, 32 + 16 * 16, 6.5625),
    ("Q4_K", "Q6_K"): (12, 80 + 32 * 16, None),
    ("Q4_K", "Q5_K"): (10, 256, None),
}


@needs_kernel
@pytest.mark.parametrize("qtypes", list(SUPERBLOCK_FORMS), ids="+".join)
def test_k_quants_read_about_the_files_bytes(qtypes: tuple[str, ...]):
    """A decode step reads the tiles and these parameters: the file's own size where the layer
    has one type (float32 (s, l0) pairs cost 2 bits more)."""
    nbytes, sb_bytes, file_bits = SUPERBLOCK_FORMS[qtypes]
    layer, _ = _layer(qtypes, bias=False)
    tiles, params = layer.qweight_tiles, layer.scale_tiles
    assert tiles.shape[-1] == nbytes
    assert params.dtype == torch.uint8 and params.shape == (tiles.shape[0], IN // 256, sb_bytes)
    if file_bits is not None:
        bits = 8 * (tiles.numel() + params.numel()) / (OUT * IN)
        assert bits == file_bits


@needs_kernel
def test_kernel_refuses_malformed_superblock_parameters():
    x = torch.randn(1, 256)
    q = torch.zeros(1, 256, 8, dtype=torch.uint8)
    for bad in (torch.zeros(1, 1, 100, dtype=torch.uint8), torch.zeros(1, 2, 336, dtype=torch.uint8)):
        with pytest.raises(RuntimeError, match="super-block"):
            gemv.int4_grouped(x, q, bad, None)
        with pytest.raises(RuntimeError, match="super-block"):
            gemv.dequant_tiles(q, bad)


@needs_kernel
def test_kernel_refuses_malformed_parameters():
    q = torch.zeros(1, 64, 16, dtype=torch.int8)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="float16"):
        gemv.int8_grouped(x, q, torch.zeros(1, 2, 16, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        gemv.int8_grouped(x, q, torch.zeros(1, 8, 2, 16), None)
    with pytest.raises(RuntimeError, match="5 / 6 bits"):
        gemv.int4_grouped(x, torch.zeros(1, 64, 9, dtype=torch.uint8), torch.zeros(1, 2, 16), None)


@needs_kernel
@pytest.mark.parametrize("qtypes", CASES, ids="+".join)
def test_tiles_dequantize_in_cpp_to_the_files_values(qtypes: tuple[str, ...]):
    """`gemv.dequant_tiles` (a prefill's GEMM weights) gives gguf.dequantize's numbers."""
    layer, want_w = _layer(qtypes, bias=False)
    params = getattr(layer, "scale_tiles", None)
    if params is None:
        params = layer.scales_zeros_tiles
    assert torch.equal(gemv.dequant_tiles(layer.qweight_tiles, params).t(), want_w)
