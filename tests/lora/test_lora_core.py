"""Multi-LoRA core: PEFT parsing and refusals, the SGMV kernel, layout in the KV cache.

Oracles: peft's own LoRA modules (delta = scaling * B @ A) for parsing; a dense per-token
float64 formula for the kernel and its torch reference; x @ (scale * B @ A)^T through
`flat_storage` views of real KV caches for the layout. Adapters are built once with peft
and cached (tests/lora_utils.py); the C++ extension is built once (~20 s) and cached.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cpp_build import KernelUnavailable
from pagedserve.lora import kernels
from pagedserve.lora.layout import plan_layout, write_adapter
from pagedserve.lora.peft_loader import (
    TARGETABLE,
    LoRAAdapter,
    LoRALoadError,
    load_peft_adapter,
    module_dims_for,
)
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.segments import ResidentAdapter, build_segments, table_slices
from pagedserve.worker.kv_cache import KVCacheSpec, allocate_kv_caches

from lora_utils import make_peft_adapter, peft_module_deltas, peft_reference_model

# (base model, r, target_modules, extra LoraConfig arguments)
ADAPTERS = {
    "r4-qv": ("llama-gqa", 4, ["q_proj", "v_proj"], {}),
    "r8-all-linear-qwen2": ("qwen2", 8, "all-linear", {}),
    "r16-regex-bias-model": ("llama3-rope", 16, r".*\.(q_proj|up_proj|down_proj)", {}),
    "r64-rslora": ("llama-gqa", 64, ["q_proj", "k_proj", "v_proj", "o_proj"], {"use_rslora": True}),
    "r8-patterns": ("llama-gqa", 8, "all-linear", {
        "rank_pattern": {"q_proj": 4, "layers.1.mlp.down_proj": 16},
        "alpha_pattern": {"v_proj": 3, "model.layers.0.self_attn.o_proj": 32},
    }),
}


def hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def adapter_path(model_path, key: str) -> tuple[str, str]:
    base_name, r, targets, extra = ADAPTERS[key]
    base = model_path(base_name)
    return base, make_peft_adapter(base, None, r, targets, **extra)


def load(base: str, path: str, name: str = "test", max_rank: int = 64) -> LoRAAdapter:
    cfg = hf_config(base)
    request = LoRARequest(name, 1, path)
    return load_peft_adapter(request, module_dims_for(cfg), cfg.num_hidden_layers, max_rank)


# ---- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_parse_matches_peft(model_path, key: str) -> None:
    base, path = adapter_path(model_path, key)
    adapter = load(base, path)
    deltas = peft_module_deltas(peft_reference_model(base, path))
    assert set(adapter.weights) == set(deltas)
    for (layer, name), ref in deltas.items():
        w = adapter.weights[(layer, name)]
        ours = w.scale * w.lora_b.double() @ w.lora_a.double()
        torch.testing.assert_close(ours, ref.double(), rtol=1e-6, atol=1e-7, msg=f"{layer} {name}")
    assert adapter.rank == max(w.rank for w in adapter.weights.values())
    if key == "r8-patterns":
        assert adapter.weights[(0, "q_proj")].rank == 4 and adapter.rank == 16
        assert adapter.weights[(1, "down_proj")].rank == 16


def test_bin_and_fan_in_fan_out_load_the_same(model_path, tmp_path) -> None:
    base, path = adapter_path(model_path, "r4-qv")
    folder = tmp_path / "bin"
    folder.mkdir()
    config = json.loads(open(f"{path}/adapter_config.json").read())
    config["fan_in_fan_out"] = True  # peft resets it for nn.Linear; no transpose
    (folder / "adapter_config.json").write_text(json.dumps(config))
    torch.save(load_file(f"{path}/adapter_model.safetensors"), folder / "adapter_model.bin")
    ours, ref = load(base, str(folder)), load(base, path)
    for k, w in ref.weights.items():
        assert torch.equal(ours.weights[k].lora_a, w.lora_a)
        assert torch.equal(ours.weights[k].lora_b, w.lora_b)
        assert ours.weights[k].scale == w.scale


def test_lora_request() -> None:
    req = LoRARequest("a", 3, "/x")
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("a", 3, "/x")
    with pytest.raises(ValueError):
        LoRARequest("a", 0, "/x")


# ---- refusals ------------------------------------------------------------------------------

_PREFIX = "base_model.model.model.layers"


def _set(key, value):
    return lambda cfg, tensors: cfg.__setitem__(key, value)


def _add(name, shape):
    return lambda cfg, tensors: tensors.__setitem__(name, torch.zeros(shape))


def _drop(name):
    return lambda cfg, tensors: tensors.pop(name)


def _reshape(name, shape):
    return lambda cfg, tensors: tensors.__setitem__(name, torch.zeros(shape))


def _nan(cfg, tensors) -> None:
    tensors[f"{_PREFIX}.0.self_attn.q_proj.lora_B.weight"][0, 0] = float("nan")


# (id, change to config / tensors, expected words, load kwargs); the base adapter is r4-qv
# on llama-gqa (hidden 64, 2 layers): q_proj lora_A (4, 64), lora_B (64, 4).
REFUSALS = [
    ("dora", _set("use_dora", True), "DoRA", {}),
    ("dora-tensor", _add(f"{_PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", (64,)), "DoRA", {}),
    ("modules-to-save", _set("modules_to_save", ["lm_head"]), "modules_to_save", {}),
    ("bias", _set("bias", "all"), "bias='all'", {}),
    ("lora-bias", _add(f"{_PREFIX}.0.self_attn.q_proj.lora_B.bias", (64,)), "lora_bias", {}),
    ("lm-head-target", _set("target_modules", ["q_proj", "v_proj", "lm_head"]), "lm_head", {}),
    ("embed-regex", _set("target_modules", r".*(embed_tokens|q_proj)"), "embedding", {}),
    ("embedding-tensor", _add("base_model.model.model.embed_tokens.lora_embedding_A", (4, 1024)),
     "embedding", {}),
    ("unknown-target", _set("target_modules", ["q_proj", "v_proj", "c_attn"]), "'c_attn'", {}),
    ("untargetable-tensor", _add(f"{_PREFIX}.0.self_attn.rotary_emb.lora_A.weight", (4, 64)),
     "unsupported LoRA target", {}),
    ("not-in-targets", _set("target_modules", ["q_proj"]), "not in target_modules", {}),
    ("missing-lora-b", _drop(f"{_PREFIX}.1.self_attn.v_proj.lora_B.weight"), "lora_B is missing", {}),
    ("wrong-shape", _reshape(f"{_PREFIX}.0.self_attn.q_proj.lora_A.weight", (4, 48)), "do not fit", {}),
    ("rank-vs-config", _set("r", 8), "rank 4 in the weights, but 8", {}),
    ("non-finite", _nan, "non-finite", {}),
    ("peft-type", _set("peft_type", "IA3"), "peft_type 'IA3'", {}),
    ("max-rank", None, "rank 4 exceeds max_lora_rank 2", {"max_rank": 2}),
    ("layer-range", None, "layer index 1 out of range", {"num_layers": 1}),
]


@pytest.mark.parametrize("change,words,kwargs", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals(model_path, tmp_path, change, words: str, kwargs: dict) -> None:
    base, good = adapter_path(model_path, "r4-qv")
    config = json.loads(open(f"{good}/adapter_config.json").read())
    tensors = load_file(f"{good}/adapter_model.safetensors")
    if change is not None:
        change(config, tensors)
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = hf_config(base)
    request = LoRARequest("bad-adapter", 7, str(folder))
    with pytest.raises(LoRALoadError) as info:
        load_peft_adapter(request, module_dims_for(cfg), kwargs.get("num_layers", 2),
                          kwargs.get("max_rank", 64))
    assert "bad-adapter" in str(info.value) and words in str(info.value), str(info.value)


def _corrupt_config(folder) -> None:
    (folder / "adapter_config.json").write_text('{"r": 4,')


def _truncate_weights(folder) -> None:
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_bin(folder) -> None:
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not a pickle at all")


FILE_REFUSALS = [
    ("no-config", lambda f: (f / "adapter_config.json").unlink(), "missing adapter_config.json"),
    ("no-weights", lambda f: (f / "adapter_model.safetensors").unlink(), "missing adapter_model"),
    ("corrupt-config", _corrupt_config, "corrupt adapter_config.json"),
    ("truncated-safetensors", _truncate_weights, "corrupt adapter_model.safetensors"),
    ("corrupt-bin", _garbage_bin, "corrupt adapter_model.bin"),
    ("no-folder", lambda f: shutil.rmtree(f), "not found"),
]


@pytest.mark.parametrize("damage,words", [r[1:] for r in FILE_REFUSALS], ids=[r[0] for r in FILE_REFUSALS])
def test_file_refusals(model_path, tmp_path, damage, words: str) -> None:
    base, good = adapter_path(model_path, "r4-qv")
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    damage(folder)
    cfg = hf_config(base)
    with pytest.raises(LoRALoadError) as info:
        load_peft_adapter(LoRARequest("bad-adapter", 7, str(folder)), module_dims_for(cfg), 2, 64)
    assert "bad-adapter" in str(info.value) and words in str(info.value), str(info.value)


# ---- kernel --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ops():
    try:
        return kernels.load_extension()
    except KernelUnavailable as exc:
        pytest.skip(f"C++ LoRA kernel cannot be built here: {exc}")


def random_batch(rng: random.Random, in_dim: int, out_dim: int, dtype: torch.dtype):
    """Random segments (1-token runs and 1-300-token runs), ranks {0, 4, 8, 16, 64}, weights
    packed at random offsets of shared storages, y a column slice of a wider tensor."""
    lens = [1 if rng.random() < 0.5 else rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
    ranks = [rng.choice([0, 4, 8, 16, 64]) for _ in lens]
    a_parts, b_parts, a_off, b_off, mats = [], [], [], [], []
    pos_a = pos_b = rng.randrange(0, 50)
    for r in ranks:
        a = torch.randn(r, in_dim) / in_dim**0.5
        b = torch.randn(out_dim, r) / max(r, 1) ** 0.5
        mats.append((a, b))
        a_off.append(pos_a)
        b_off.append(pos_b)
        a_parts.append(a.reshape(-1))
        b_parts.append(kernels.pack_lora_b(b))
        pos_a += a_parts[-1].numel() + rng.randrange(0, 40)
        pos_b += b_parts[-1].numel() + rng.randrange(0, 40)
        a_parts.append(torch.randn(pos_a - a_off[-1] - a_parts[-1].numel()))
        b_parts.append(torch.randn(pos_b - b_off[-1] - b_parts[-1].numel()))
    storage_a = torch.cat([torch.randn(a_off[0]), *a_parts]).to(dtype)
    storage_b = torch.cat([torch.randn(b_off[0]), *b_parts]).to(dtype)
    lead = rng.randrange(0, 3)  # rows before the first segment and after the last: untouched
    starts = [lead]
    for n in lens:
        starts.append(starts[-1] + n)
    tokens = starts[-1] + rng.randrange(0, 3)
    x = torch.randn(tokens, in_dim).to(dtype)
    scales = [rng.uniform(0.5, 2.0) for _ in lens]
    args = (torch.tensor(starts), torch.tensor(a_off), torch.tensor(b_off),
            torch.tensor(ranks, dtype=torch.int32), torch.tensor(scales, dtype=torch.float32))
    return x, storage_a, storage_b, args, mats


def dense_delta(x, starts, mats, scales, out_dim) -> torch.Tensor:
    """Each token's delta through its segment's merged dense weight, float64:
    x_t @ (scale * B @ A)^T (the other association than the kernel's two products)."""
    delta = torch.zeros(x.shape[0], out_dim, dtype=torch.float64)
    for s, (a, b) in enumerate(mats):
        merged = scales[s] * b.double() @ a.double()  # (out_dim, in_dim)
        delta[starts[s] : starts[s + 1]] = x[starts[s] : starts[s + 1]].double() @ merged.T
    return delta


@pytest.mark.parametrize("dims", [(768, 256), (2048, 768), (70, 45)])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_reference_and_dense(ops, dims, seed: int) -> None:
    rng = random.Random(seed * 100 + dims[0])
    torch.manual_seed(seed)
    in_dim, out_dim = dims
    x, sa, sb, args, mats = random_batch(rng, in_dim, out_dim, torch.float32)
    wide = torch.randn(x.shape[0], out_dim + 13)
    y_cpp, y_ref = wide.clone(), wide.clone()
    cols = slice(5, 5 + out_dim)  # strided y: a column slice
    kernels.lora_apply(y_cpp[:, cols], x, sa, sb, *args)
    kernels.lora_apply_reference(y_ref[:, cols], x, sa, sb, *args)
    expected = wide.double()
    expected[:, cols] += dense_delta(x, args[0].tolist(), mats, args[4].tolist(), out_dim)
    torch.testing.assert_close(y_cpp.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_ref.double(), expected, rtol=1e-5, atol=1e-5)
    outside = torch.ones(wide.shape, dtype=torch.bool)
    outside[:, cols] = False
    assert torch.equal(y_cpp[outside], wide[outside])  # neighbouring columns untouched


def test_kernel_bf16(ops) -> None:
    rng = random.Random(7)
    for in_dim, out_dim in [(768, 256), (70, 45)]:
        x, sa, sb, args, mats = random_batch(rng, in_dim, out_dim, torch.bfloat16)
        wide = torch.randn(x.shape[0], out_dim + 3).to(torch.bfloat16)
        y_cpp, y_ref = wide.clone(), wide.clone()
        kernels.lora_apply(y_cpp[:, :out_dim], x, sa, sb, *args)
        kernels.lora_apply_reference(y_ref[:, :out_dim], x, sa, sb, *args)
        mats_bf16 = [(a.to(torch.bfloat16), b.to(torch.bfloat16)) for a, b in mats]
        expected = wide.double()
        expected[:, :out_dim] += dense_delta(x, args[0].tolist(), mats_bf16, args[4].tolist(), out_dim)
        torch.testing.assert_close(y_cpp.double(), expected, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y_ref.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("act", "lora"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_kernel_mixed_activation_and_adapter_dtypes(ops, monkeypatch, act, lora) -> None:
    """Adapters stored in another dtype than the activations (lora_dtype): the kernel widens
    the weights and accumulates in float32. All paths (dot-product, transposed and BLAS
    phase 1) against the dense product of the stored weights."""
    rng = random.Random(11)
    for in_dim, out_dim in [(768, 256), (70, 45)]:
        x, sa, sb, args, mats = random_batch(rng, in_dim, out_dim, lora)
        x = x.to(act)
        mats_stored = [(a.to(lora), b.to(lora)) for a, b in mats]
        expected = dense_delta(x, args[0].tolist(), mats_stored, args[4].tolist(), out_dim)
        tol = 1e-5 if act == torch.float32 else 2e-2
        for mm_rows in (kernels.MM_MIN_ROWS, 8):
            monkeypatch.setattr(kernels, "MM_MIN_ROWS", mm_rows)
            y = torch.zeros(x.shape[0], out_dim, dtype=act)
            kernels.lora_apply(y, x, sa, sb, *args)
            torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
        y_ref = torch.zeros(x.shape[0], out_dim, dtype=act)
        kernels.lora_apply_reference(y_ref, x, sa, sb, *args)
        torch.testing.assert_close(y_ref.double(), expected, rtol=tol, atol=tol)


def test_kernel_threads_and_blas_path_agree(ops, monkeypatch) -> None:
    """Each output is computed by one task: bitwise the same for any thread count; the BLAS
    phase-1 path (long segments) agrees within float noise."""
    rng = random.Random(3)
    x, sa, sb, args, _ = random_batch(rng, 768, 256, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = torch.zeros(x.shape[0], 256)
            kernels.lora_apply(y, x, sa, sb, *args)
            outs.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setattr(kernels, "MM_MIN_ROWS", 8)
    monkeypatch.setattr(kernels, "MM_MIN_RANK", 1)
    y = torch.zeros(x.shape[0], 256)
    kernels.lora_apply(y, x, sa, sb, *args)
    torch.testing.assert_close(y, outs[0], rtol=1e-5, atol=1e-5)


def test_kernel_rejects_out_of_range_offsets(ops) -> None:
    x, y = torch.randn(2, 64), torch.zeros(2, 32)
    sa, sb = torch.randn(4 * 64), torch.randn(4 * 32)
    ok = (torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0]),
          torch.tensor([4], dtype=torch.int32), torch.tensor([1.0]))
    kernels.lora_apply(y, x, sa, sb, *ok)
    for bad in ((ok[0], torch.tensor([1]), *ok[2:]), (ok[0], ok[1], torch.tensor([1]), *ok[3:]),
                (torch.tensor([0, 3]), *ok[1:])):
        with pytest.raises(RuntimeError):
            kernels.lora_apply(y, x, sa, sb, *bad)


def test_fallback_without_extension(monkeypatch, caplog) -> None:
    rng = random.Random(5)
    x, sa, sb, args, mats = random_batch(rng, 70, 45, torch.float32)
    kernels._ops_or_none.cache_clear()
    monkeypatch.setattr(kernels, "load_extension", _raise_build_error)
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            y = torch.zeros(x.shape[0], 45)
            kernels.lora_apply(y, x, sa, sb, *args)
        assert "reference" in caplog.text
        # The table form: row 1 of (2, S) tables whose row 0 is garbage.
        tables = [torch.stack([torch.full_like(t, 7), t]) for t in args[1:]]
        y_rows = torch.zeros_like(y)
        kernels.lora_apply_slices(y_rows, x, sa, sb, args[0], *tables, [1, 0, 45])
        assert torch.equal(y, y_rows)
    finally:
        kernels._ops_or_none.cache_clear()
    expected = dense_delta(x, args[0].tolist(), mats, args[4].tolist(), 45)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def _raise_build_error():
    raise KernelUnavailable("no compiler (test)")


# ---- layout in the KV cache ----------------------------------------------------------------


def make_caches(cfg, num_blocks: int, dtype: torch.dtype, block_size: int = 16):
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    spec = KVCacheSpec(cfg.num_hidden_layers, kv_heads, head_dim, block_size, dtype)
    return allocate_kv_caches(spec, num_blocks, torch.device("cpu"))


@pytest.mark.parametrize("cache_dtype,lora_dtype", [
    (torch.float32, torch.float32), (torch.int8, torch.float32), (torch.bfloat16, torch.bfloat16),
])
def test_layout_round_trip(model_path, cache_dtype, lora_dtype) -> None:
    base, path = adapter_path(model_path, "r8-patterns")
    cfg = hf_config(base)
    adapter = load(base, path)
    caches = make_caches(cfg, 64, cache_dtype)
    e = kernels.block_elems(caches[0], lora_dtype)
    layout = plan_layout(adapter, cfg.num_hidden_layers, e)
    first = 5
    write_adapter(adapter, layout, caches, first, lora_dtype)
    touched = torch.zeros(64, dtype=torch.bool)
    touched[first : first + layout.num_blocks] = True
    for kv in caches:  # nothing written outside the run
        assert not kv[:, ~touched].any()
    dims = module_dims_for(cfg)
    tol = 1e-5 if lora_dtype == torch.float32 else 3e-2
    for (layer, name), w in adapter.weights.items():
        m = TARGETABLE.index(name)
        sa, sb = kernels.flat_storage(caches[layer], lora_dtype)
        x = torch.randn(3, dims[name][0])
        y = torch.zeros(3, dims[name][1], dtype=lora_dtype)
        base_off = first * e
        args = (torch.tensor([0, 3]), layout.a_offsets[layer, m : m + 1] + base_off,
                layout.b_offsets[layer, m : m + 1] + base_off, layout.ranks[layer, m : m + 1],
                layout.scales[layer, m : m + 1])
        kernels.lora_apply(y, x.to(lora_dtype), sa, sb, *args)
        expected = x @ (w.scale * w.lora_b @ w.lora_a).T
        torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol, msg=f"{layer} {name}")


def test_layout_is_tight_and_disjoint(model_path) -> None:
    base, path = adapter_path(model_path, "r8-patterns")
    cfg = hf_config(base)
    adapter = load(base, path)
    dims = module_dims_for(cfg)
    e = 1024
    layout = plan_layout(adapter, cfg.num_hidden_layers, e)
    worst = 0
    for layer in range(cfg.num_hidden_layers):
        spans_a, spans_b = [], []
        for m, name in enumerate(TARGETABLE):
            r = int(layout.ranks[layer, m])
            if r == 0:
                assert (layer, name) not in adapter.weights
                continue
            in_dim, out_dim = dims[name]
            spans_a.append((int(layout.a_offsets[layer, m]), r * in_dim))
            spans_b.append((int(layout.b_offsets[layer, m]), kernels.b_region_elems(out_dim, r)))
        for spans in (spans_a, spans_b):
            spans.sort()
            for (s0, n0), (s1, _) in zip(spans, spans[1:], strict=False):
                assert s0 + n0 <= s1
            worst = max(worst, spans[-1][0] + spans[-1][1])
    assert (layout.num_blocks - 1) * e < worst <= layout.num_blocks * e


def test_segments_mixed_batch(model_path) -> None:
    """Two resident adapters + base-model runs, one lora_apply per (layer, module)."""
    base_a, path_a = adapter_path(model_path, "r8-patterns")
    _, path_b = adapter_path(model_path, "r64-rslora")
    cfg = hf_config(base_a)
    caches = make_caches(cfg, 256, torch.float32)
    e = kernels.block_elems(caches[0], torch.float32)
    resident = {}
    first = 3
    for key, path in (("a", path_a), ("b", path_b)):
        adapter = load(base_a, path)
        layout = plan_layout(adapter, cfg.num_hidden_layers, e)
        write_adapter(adapter, layout, caches, first, torch.float32)
        resident[key] = (adapter, ResidentAdapter(layout, first))
        first += layout.num_blocks
    plan = [(2, None), (1, "a"), (3, "a"), (1, "b"), (4, None), (1, "b"), (5, "a"), (1, None)]
    runs = [(n, resident[k][1] if k else None) for n, k in plan]
    segs = build_segments(runs, cfg.num_hidden_layers, len(TARGETABLE))
    assert segs.seg_starts.tolist() == [2, 6, 7, 11, 12, 17]  # a | b | base | b | a
    unmerged = build_segments(runs, cfg.num_hidden_layers, len(TARGETABLE), merge_neighbours=False)
    assert unmerged.seg_starts.tolist() == [2, 3, 6, 7, 11, 12, 17]  # a | a | b | base | b | a
    assert unmerged.ranks[..., 0].tolist() == unmerged.ranks[..., 1].tolist() == segs.ranks[..., 0].tolist()
    owner = [k for n, k in plan for _ in range(n)]
    dims = module_dims_for(cfg)
    for layer in range(cfg.num_hidden_layers):
        sa, sb = kernels.flat_storage(caches[layer], torch.float32)
        for m, name in enumerate(TARGETABLE):
            x = torch.randn(len(owner), dims[name][0])
            y = torch.zeros(len(owner), dims[name][1])
            kernels.lora_apply(y, x, sa, sb, *segs.args(layer, m))
            y_rows = torch.zeros_like(y)
            # The op reads the tables' row in place.
            segs.apply(y_rows, x, sa, sb, table_slices(layer, [(m, 0, dims[name][1])]))
            assert torch.equal(y, y_rows)
            for t, k in enumerate(owner):
                w = resident[k][0].weights.get((layer, name)) if k else None
                want = torch.zeros(dims[name][1]) if w is None else w.scale * w.lora_b @ (w.lora_a @ x[t])
                torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


def test_fused_projection_slices_equal_separate_calls(model_path) -> None:
    """One call for q/k/v (and gate/up) into column slices of one output, with gaps left
    untouched, gives bitwise what one call per module gives; overlapping or decreasing
    slices are refused (two tasks would write the same columns)."""
    base, path = adapter_path(model_path, "r8-patterns")
    _, path_b = adapter_path(model_path, "r64-rslora")
    cfg = hf_config(base)
    caches = make_caches(cfg, 256, torch.float32)
    e = kernels.block_elems(caches[0], torch.float32)
    placed, first = [], 1
    for p in (path, path_b):
        adapter = load(base, p)
        layout = plan_layout(adapter, cfg.num_hidden_layers, e)
        write_adapter(adapter, layout, caches, first, torch.float32)
        placed.append(ResidentAdapter(layout, first))
        first += layout.num_blocks
    segs = build_segments([(3, placed[0]), (2, None), (130, placed[1]), (1, placed[0])],
                          cfg.num_hidden_layers, len(TARGETABLE))
    dims = module_dims_for(cfg)
    tokens = 136
    for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        modules, col = [], 0
        for name in names:
            col += 3  # a gap before each slice
            modules.append((TARGETABLE.index(name), col, col + dims[name][1]))
            col += dims[name][1]
        x = torch.randn(tokens, dims[names[0]][0])
        for layer in range(cfg.num_hidden_layers):
            sa, sb = kernels.flat_storage(caches[layer], torch.float32)
            wide = torch.randn(tokens, col + 5)
            fused, separate = wide.clone(), wide.clone()
            segs.apply(fused, x, sa, sb, table_slices(layer, modules))
            for m, start, end in modules:
                kernels.lora_apply(separate[:, start:end], x, sa, sb, *segs.args(layer, m))
            assert torch.equal(fused, separate)
            assert not torch.equal(fused, wide)
        for bad in ([modules[1], modules[0]], [modules[0], (modules[1][0], modules[0][1], modules[1][2])]):
            with pytest.raises(RuntimeError, match="increasing and disjoint"):
                segs.apply(wide.clone(), x, sa, sb, table_slices(0, bad))


@pytest.mark.parametrize("tokens", [1, 48, 136])
def test_lora_linear_over_a_packed_base_equals_the_two_ops(model_path, monkeypatch, tokens: int) -> None:
    """`LoRALinear` over a oneDNN-prepacked projection (with a bias) runs the GEMM and the
    deltas in one op (`lora_linear`); that must be bit for bit the base layer followed by
    `lora_apply_slices`, which the wrapper runs when the fused op is unavailable."""
    from torch import nn

    from pagedserve.lora.layers import LoRALinear, lora_step
    from pagedserve.models.layers.linear import MergedColumnParallelLinear
    from pagedserve.quantization.packed import PACKED, onednn_available

    if not onednn_available():
        pytest.skip("torch built without oneDNN")
    base_path, path = adapter_path(model_path, "r8-patterns")  # adapts gate and up
    cfg = hf_config(base_path)
    caches = make_caches(cfg, 256, torch.float32)
    adapter = load(base_path, path)
    e = kernels.block_elems(caches[0], torch.float32)
    layout = plan_layout(adapter, cfg.num_hidden_layers, e)
    write_adapter(adapter, layout, caches, 2, torch.float32)
    dims = module_dims_for(cfg)
    hidden, inter = dims["gate_proj"]
    # The one-op path multiplies through oneDNN at every row count; without the decode GEMV's
    # copy the base layer does too, so the two can be compared bit for bit.
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    layer = MergedColumnParallelLinear(hidden, [inter, inter], bias=True)
    layer.set_quant_method(PACKED)
    layer.weight = nn.Parameter(torch.randn(2 * inter, hidden) / hidden**0.5, requires_grad=False)
    layer.bias = nn.Parameter(torch.randn(2 * inter), requires_grad=False)
    PACKED.process_weights_after_loading(layer)
    wrapper = LoRALinear(layer, 0, [(TARGETABLE.index("gate_proj"), 0, inter),
                                    (TARGETABLE.index("up_proj"), inter, 2 * inter)])
    wrapper.bind(caches[0], torch.float32)
    segs = build_segments([(tokens, ResidentAdapter(layout, 2))], cfg.num_hidden_layers, len(TARGETABLE))
    x = torch.randn(tokens, hidden)
    assert wrapper.one_op
    with monkeypatch.context() as patch:
        # The one-op path never calls the base layer; the fallback would fail here.
        patch.setattr(layer, "forward", lambda _: pytest.fail("the base ran apart from the deltas"))
        with lora_step(segs):
            fused = wrapper(x)
    separate = layer(x)
    kernels.lora_apply_slices(separate, x, wrapper.storage_a, wrapper.storage_b, segs.seg_starts, segs.a_offsets,
                              segs.b_offsets, segs.ranks, segs.scales, wrapper.kernel_slices)
    assert torch.equal(fused, separate)
    assert not torch.equal(separate, layer(x))  # the adapter changed the output


def stored_back_to_back(mats, out_dim: int, starts: list[int], scales: list[float]):
    """Segment s's (A, B) in mats stored one after another (B in panels): (storage_a,
    storage_b, the tables `lora_apply` takes after them)."""
    ranks = [a.shape[0] for a, _ in mats]
    sa = torch.cat([a.reshape(-1) for a, _ in mats])
    sb = torch.cat([kernels.pack_lora_b(b) for _, b in mats])
    a_off = [sum(a.numel() for a, _ in mats[:i]) for i in range(len(mats))]
    b_off = [sum(kernels.b_region_elems(out_dim, r) for r in ranks[:i]) for i in range(len(mats))]
    args = (torch.tensor(starts), torch.tensor(a_off), torch.tensor(b_off),
            torch.tensor(ranks, dtype=torch.int32), torch.tensor(scales, dtype=torch.float32))
    return sa, sb, args


def test_kernel_long_rank16_segments(ops) -> None:
    """Segments with a rank multiple of 16 and >= 96 tokens (>= 32 from rank 32) take the
    transposed phase 1 (csrc: phase1_at); it must agree with the dense product and not
    depend on threads. in = 770: a partial 16-column block in the A transpose."""
    in_dim, out_dim, lens, ranks = 770, 256, [200, 97, 5, 40, 33], [16, 16, 16, 32, 64]
    g = torch.Generator().manual_seed(11)
    mats = [(torch.randn(r, in_dim, generator=g) / in_dim**0.5, torch.randn(out_dim, r, generator=g) / r**0.5)
            for r in ranks]
    starts = [0, *itertools.accumulate(lens)]
    scales = [0.5, 2.0, 1.0, 1.5, 0.25]
    sa, sb, args = stored_back_to_back(mats, out_dim, starts, scales)
    x = torch.randn(starts[-1], in_dim, generator=g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = torch.zeros(x.shape[0], out_dim)
            kernels.lora_apply(y, x, sa, sb, *args)
            outs.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    expected = dense_delta(x, starts, mats, scales, out_dim)
    torch.testing.assert_close(outs[0].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dim", [256, 45])
def test_kernel_blas_phase2_for_long_segments(ops, lora_dtype, out_dim: int) -> None:
    """Float32 segments of >= 384 tokens (prefill) add their deltas by BLAS from B copied out
    of its panels (csrc: phase2_mm); short ones keep the SIMD path in the same call. Against
    the dense product of the stored weights, y a column slice whose neighbours stay untouched;
    out = 45 leaves a partial panel."""
    in_dim, lens, ranks = 200, [400, 3, 513, 1], [16, 8, 64, 4]
    g = torch.Generator().manual_seed(5)
    mats = [((torch.randn(r, in_dim, generator=g) / in_dim**0.5).to(lora_dtype),
             (torch.randn(out_dim, r, generator=g) / r**0.5).to(lora_dtype)) for r in ranks]
    starts = [2, *(2 + n for n in itertools.accumulate(lens))]
    scales = [0.5, 2.0, 0.25, 1.0]
    sa, sb, args = stored_back_to_back(mats, out_dim, starts, scales)
    x = torch.randn(starts[-1] + 1, in_dim, generator=g)
    wide = torch.randn(x.shape[0], out_dim + 9, generator=g)
    y = wide.clone()
    cols = slice(4, 4 + out_dim)
    kernels.lora_apply(y[:, cols], x, sa, sb, *args)
    expected = wide.double()
    expected[:, cols] += dense_delta(x, starts, mats, scales, out_dim)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    outside = torch.ones(wide.shape, dtype=torch.bool)
    outside[:, cols] = False
    assert torch.equal(y[outside], wide[outside])
