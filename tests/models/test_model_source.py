"""What a checkpoint declares: hub ids from a local Hugging Face cache (laid out here),
EOS id lists, generation_config.json defaults, and dtype="auto"."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_copies import add_hub_snapshot

from pagedserve import LLM, SamplingParams
from pagedserve.dtypes import auto_dtype
from pagedserve.models.hub import resolve_model_path
from pagedserve.server.protocol import CompletionRequest

SMALL = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20}
PROMPT = {"prompt_token_ids": [5, 9, 33, 120, 7]}
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture
def model_copy(model_path, tmp_path):
    """A writable copy of the llama-gqa test model (its config files get edited)."""
    dst = tmp_path / "model"
    shutil.copytree(model_path("llama-gqa"), dst)
    return dst


def _edit_json(path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def _hub_cache(tmp_path, source) -> str:
    """models--org--tiny with refs/main -> COMMIT_A and a tag v2 -> COMMIT_B, as huggingface_hub lays it out."""
    cache = tmp_path / "hub"
    add_hub_snapshot(cache, "org/tiny", source, {"main": COMMIT_A, "v2": COMMIT_B})
    return str(cache)


def test_hub_id_resolves_offline_from_the_cache(model_path, tmp_path):
    cache = _hub_cache(tmp_path, model_path("llama-gqa"))
    assert resolve_model_path("org/tiny", None, cache).endswith(f"snapshots/{COMMIT_A}")
    assert resolve_model_path("org/tiny", "v2", cache).endswith(f"snapshots/{COMMIT_B}")
    assert resolve_model_path("org/tiny", COMMIT_B, cache).endswith(f"snapshots/{COMMIT_B}")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    from_hub = LLM("org/tiny", download_dir=cache, **SMALL).generate(PROMPT, params, use_tqdm=False)
    from_folder = LLM(model_path("llama-gqa"), **SMALL).generate(PROMPT, params, use_tqdm=False)
    assert from_hub[0].outputs[0].token_ids == from_folder[0].outputs[0].token_ids


def test_missing_hub_model_says_where_it_looked(model_path, tmp_path):
    cache = _hub_cache(tmp_path, model_path("llama-gqa"))
    with pytest.raises(FileNotFoundError, match="models--org--absent"):
        LLM("org/absent", download_dir=cache, **SMALL)
    with pytest.raises(FileNotFoundError, match="revision nope"):
        resolve_model_path("org/tiny", "nope", cache)
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        resolve_model_path("./not/here/at/all")


def _greedy_tokens(model, **kwargs) -> list[int]:
    llm = LLM(str(model), **SMALL, **kwargs)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.finish_reason


def _stop_candidate(model) -> tuple[list[int], int]:
    """The greedy continuation and a token from its middle to declare as an extra EOS."""
    llm = LLM(str(model), **SMALL)
    tokens = list(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids)
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] != 2)
    return tokens, index


def test_every_eos_id_in_config_list_ends_the_sequence(model_copy):
    tokens, i = _stop_candidate(model_copy)
    _edit_json(model_copy / "config.json", eos_token_id=[2, tokens[i]])
    got, reason = _greedy_tokens(model_copy)
    assert got == tokens[: i + 1] and reason == "stop"


def test_generation_config_eos_and_defaults(model_copy):
    tokens, i = _stop_candidate(model_copy)
    _edit_json(model_copy / "generation_config.json", eos_token_id=[2, tokens[i]], temperature=0.0,
               top_k=5, max_new_tokens=12)
    llm = LLM(str(model_copy), **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 12)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # no params: the file's defaults
    assert list(out.token_ids) == tokens[: i + 1] and out.finish_reason == "stop"
    # --generation-config vllm: the file is ignored.
    got, reason = _greedy_tokens(model_copy, generation_config="vllm")
    assert got == tokens and reason == "length"


def test_server_request_fields_override_generation_defaults():
    defaults = {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.2}
    omitted = CompletionRequest(prompt="x").sampling_params(16, None, defaults)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty) == (0.3, 0.5, 7, 1.2)
    given = CompletionRequest(prompt="x", temperature=1.0, top_k=0).sampling_params(16, None, defaults)
    assert (given.temperature, given.top_k, given.top_p) == (1.0, 0, 0.5)
    plain = CompletionRequest(prompt="x").sampling_params(16, None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_dtype_auto_follows_the_checkpoint(model_copy):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert auto_dtype(cpu, torch.float32, False) == torch.float32
    assert auto_dtype(cpu, torch.bfloat16, False) == torch.bfloat16
    assert auto_dtype(cpu, torch.float16, False) == torch.bfloat16  # no fast fp16 GEMM on CPU
    assert auto_dtype(gpu, torch.float16, False) == torch.float16
    assert auto_dtype(cpu, None, False) == torch.float32
    # A quantized file computes in float32 on every CPU, whatever its bf16 instructions
    # (issue 32: bf16 on AVX512-BF16 machines flipped SmolLM2's first token).
    assert auto_dtype(cpu, None, True) == torch.float32
    assert auto_dtype(gpu, None, True) == torch.bfloat16
    _edit_json(model_copy / "config.json", dtype="float16")
    llm = LLM(str(model_copy), kv_cache_memory_bytes=2 << 20, device="cpu")
    assert llm.llm_engine.runner.dtype == torch.bfloat16


def test_cli_names_where_a_missing_hub_model_was_looked_for(tmp_path, capsys):
    from pagedserve.entrypoints.cli import main

    assert main(["generate", "org/absent", "--download-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert str(tmp_path / "models--org--absent") in capsys.readouterr().err
