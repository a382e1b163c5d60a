"""Tests for pagedserve.demo_models: building, caching and loading the random demo models."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pagedserve import demo_models as dm

SMALL_MODELS = ["llama-gqa", "llama-tied", "llama3-rope", "qwen2", "demo"]

ROUND_TRIP_TEXTS = [
    "Hello, world! This is a test.",
    'Numbers 0123456789 and 3.14159, (parens) and "quotes".',
    "Line one\nLine two\n\n\tTabbed   spaces  ",
    "Unicode: café naïve 東京 😀 — ok",
    "",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # A fresh cache, so the build path itself is exercised (the rest of the suite shares
    # the default cache, where the folders usually already exist).
    return tmp_path_factory.mktemp("pagedserve-cache")


@pytest.fixture(scope="module")
def model_paths(cache_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    return {name: dm.get_model_path(name, cache_dir) for name in SMALL_MODELS}


def test_names_and_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):
    names = dm.model_names()
    assert set(SMALL_MODELS) | {"bench-125m"} <= set(names)
    assert dm.DEMO_MODEL in names
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert dm.default_cache_dir() == tmp_path
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR")
    assert dm.default_cache_dir() == pathlib.Path.home() / ".cache" / "pagedserve"
    with pytest.raises(ValueError, match="unknown demo model"):
        dm.get_model_path("no-such-model", tmp_path)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_model_folder_loads_in_transformers(name: str, model_paths: dict[str, pathlib.Path]):
    path = model_paths[name]
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (path / f).is_file(), f
    assert not list(path.parent.glob(".*.tmp-*")), "temporary build folders left behind"

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.architectures and config.architectures[0].endswith("ForCausalLM")
    assert len(tokenizer) == config.vocab_size
    assert config.max_position_embeddings >= 2048
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert tokenizer.convert_ids_to_tokens([1, 2, 3]) == ["<s>", "</s>", "<pad>"]
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [4, 5]
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"]

    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32
    ids = tokenizer("Once upon a time, there was a model.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()
    # Peaky but sane logits (the init targets std ~2.5), see demo_models._Init.
    assert 1.0 < logits.std().item() < 6.0
    assert logits.abs().max().item() < 50.0


def test_architecture_specifics(model_paths: dict[str, pathlib.Path]):
    def tensor_names(name: str) -> set[str]:
        with safe_open(str(model_paths[name] / "model.safetensors"), "pt") as f:
            return set(f.keys())

    cfg = AutoConfig.from_pretrained(model_paths["llama-gqa"])
    assert cfg.num_key_value_heads < cfg.num_attention_heads and not cfg.tie_word_embeddings
    assert "lm_head.weight" in tensor_names("llama-gqa")

    cfg = AutoConfig.from_pretrained(model_paths["llama-tied"])
    assert cfg.tie_word_embeddings
    # transformers drops the tied lm_head from the file; loaders must reuse the embedding.
    assert "lm_head.weight" not in tensor_names("llama-tied")
    model = AutoModelForCausalLM.from_pretrained(model_paths["llama-tied"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    cfg = AutoConfig.from_pretrained(model_paths["llama3-rope"])
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert cfg.attention_bias and cfg.mlp_bias
    names = tensor_names("llama3-rope")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in names
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.{proj}.bias" in names

    cfg = AutoConfig.from_pretrained(model_paths["qwen2"])
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert "model.layers.0.self_attn.q_proj.bias" in tensor_names("qwen2")


def test_weights_are_not_default_init(model_paths: dict[str, pathlib.Path]):
    # Zero biases and all-ones norms would let an engine that drops them pass every test.
    with safe_open(str(model_paths["llama3-rope"] / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").abs().max() > 0
        assert f.get_tensor("model.layers.0.mlp.down_proj.bias").abs().max() > 0
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert norm.std() > 0.1
        final = f.get_tensor("model.norm.weight")
        assert (final < 0).any() and (final > 0).any()


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied", "qwen2"])
def test_greedy_output_is_diverse(name: str, model_paths: dict[str, pathlib.Path]):
    path = model_paths[name]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 32
    # Default-init random models get stuck repeating one token; ours must not.
    assert len(set(new)) >= 12, new


def test_chat_template(model_paths: dict[str, pathlib.Path]):
    tokenizer = AutoTokenizer.from_pretrained(model_paths["llama-gqa"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("Hi!<|im_end|>\n")
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 4


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "demo"])
def test_text_round_trips(name: str, model_paths: dict[str, pathlib.Path]):
    path = model_paths[name]
    auto = AutoTokenizer.from_pretrained(path)
    fast = PreTrainedTokenizerFast.from_pretrained(path)
    for text in ROUND_TRIP_TEXTS:
        ids = auto(text).input_ids
        assert ids == fast(text).input_ids  # AutoTokenizer must not re-interpret the files
        assert auto.bos_token_id not in ids  # no BOS/EOS added implicitly
        assert auto.decode(ids) == text
    # Every id decodes, including byte tokens that are partial UTF-8 sequences.
    for i in range(len(auto)):
        assert isinstance(auto.decode([i]), str)


def test_large_vocab_tokenizer(cache_dir: pathlib.Path):
    path = dm.get_tokenizer_path(32000, cache_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(tokenizer) == 32000
    for i in range(len(tokenizer)):
        tokenizer.decode([i])
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    # Trained to the full size rather than padded, so common text compresses well.
    ids = tokenizer("the of and to in is it that was for").input_ids
    assert len(ids) <= 11


def test_second_call_hits_cache(
    model_paths: dict[str, pathlib.Path], cache_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    path = model_paths["llama-gqa"]
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(dm, "_build_model", no_build)
    monkeypatch.setattr(dm, "_build_tokenizer", no_build)
    assert dm.get_model_path("llama-gqa", cache_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_spec_change_gives_new_folder(model_paths: dict[str, pathlib.Path], monkeypatch):
    import dataclasses

    spec = dm._SPECS["llama-gqa"]
    monkeypatch.setitem(dm._SPECS, "llama-gqa", dataclasses.replace(spec, seed=spec.seed + 100))
    built: list[pathlib.Path] = []
    monkeypatch.setattr(dm, "_build_model", lambda spec, tmp, root: built.append(tmp))
    new_path = dm.get_model_path("llama-gqa", model_paths["llama-gqa"].parent.parent)
    assert new_path != model_paths["llama-gqa"] and new_path.name.startswith("llama-gqa-")
    assert len(built) == 1


def test_concurrent_builds_are_atomic(tmp_path: pathlib.Path):
    target = tmp_path / "models" / "thing-123"
    calls: list[int] = []
    seen_partial: list[bool] = []

    def slow_build(tmp: pathlib.Path) -> None:
        calls.append(1)
        (tmp / "a.txt").write_text("a")
        time.sleep(0.2)
        (tmp / "b.txt").write_text("b")

    def worker(results: list[pathlib.Path]) -> None:
        p = dm._build_once(target, slow_build)
        seen_partial.append(not (p / "b.txt").exists())
        results.append(p)

    results: list[pathlib.Path] = []
    threads = [threading.Thread(target=worker, args=(results,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 4
    assert calls == [1]  # the lock kept the other builders waiting
    assert not any(seen_partial)
    assert sorted(p.name for p in target.iterdir()) == ["a.txt", "b.txt"]
    assert not list(target.parent.glob(".*.tmp-*"))


def test_failed_build_leaves_nothing(tmp_path: pathlib.Path):
    target = tmp_path / "models" / "broken-1"

    def failing_build(tmp: pathlib.Path) -> None:
        (tmp / "x").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        dm._build_once(target, failing_build)
    assert not target.exists()
    assert not list(target.parent.glob(".*.tmp-*"))


def test_cli_prints_paths(
    model_paths: dict[str, pathlib.Path],
    cache_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(cache_dir))
    assert dm.main(["llama-gqa", "qwen2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"llama-gqa\t{model_paths['llama-gqa']}", f"qwen2\t{model_paths['qwen2']}"]


@pytest.mark.slow
def test_bench_model_builds(tmp_path: pathlib.Path):
    start = time.perf_counter()
    path = dm.get_model_path("bench-125m", tmp_path)
    assert time.perf_counter() - start < 60
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (768, 12, 32000)
    assert config.max_position_embeddings == 4096
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size
    n_params = json.loads((path / "demo_model.json").read_text())["num_parameters"]
    assert 100e6 < n_params < 150e6
