"""LoRA on Qwen3-MoE (issue 36): adapters on the attention projections only.

A tiny random Qwen3-MoE (3 layers, layer 1 dense through `mlp_only_layers`, 8 experts,
top-2). Oracles: PEFT on transformers (fp32, eager attention), greedy token for token, with
two attention adapters and the base model in one batch, offline and through the server's
runtime load route. Adapters on anything else are refused naming the module, a LoRALoadError
(a ValueError) offline and a 400 naming `lora_path` over HTTP: what PEFT writes for an MLP
target on transformers 5's Qwen3-MoE (its experts are raw parameters: `target_parameters`),
MLP or router names in target_modules, and weights on a dense layer's MLP, an expert's or
the router's linears (as PEFT wrote them on transformers 4's per-expert layers).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.demo_models import get_tokenizer_path
from pagedserve.lora.peft_loader import LoRALoadError

from lora_utils import hf_greedy_tokens, make_peft_adapter, peft_eager
from server_fixtures import SERVE_ARGS, running_server

VOCAB, NEW_TOKENS = 1024, 16
CONFIG = Qwen3MoeConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, mlp_only_layers=[1],
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
ATTENTION = [("qkvo8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]), ("qv4", 4, ["q_proj", "v_proj"])]
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128, block_size=8,
              kv_cache_memory_bytes=8 << 20, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model folder (random weights, a tokenizer for the server) and adapters beside it."""
    root = tmp_path_factory.mktemp("moe_lora")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # big enough that the router's choice and attention patterns matter
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(root / "model")
    PreTrainedTokenizerFast.from_pretrained(str(get_tokenizer_path(VOCAB))).save_pretrained(str(root / "model"))
    return root


def adapter(root: Path, rank: int, targets: list[str] | str, seed: int) -> str:
    return make_peft_adapter(root / "model", root / "adapters", rank, targets, seed=seed)


def eager(root: Path, adapter_path: str | None) -> torch.nn.Module:
    return peft_eager(root / "model", adapter_path)


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return hf_greedy_tokens(model, prompt, NEW_TOKENS)


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(8, VOCAB, (n,), generator=g).tolist() for n in lengths]


def edited_adapter(root: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """The attention adapter with more tensors and adapter_config.json keys."""
    from safetensors.torch import load_file, save_file

    if not out.is_dir():
        base = Path(adapter(root, 8, ATTENTION[0][2], seed=0))
        shutil.copytree(base, out)
        save_file(load_file(str(base / "adapter_model.safetensors")) | tensors, str(out / "adapter_model.safetensors"))
        old = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps(old | config))
    return str(out)


def peft_expert_adapter(root: Path) -> str:
    """What PEFT writes for target_modules=["q_proj", "down_proj"] on transformers 5's
    Qwen3-MoE: the experts' down_proj is a raw parameter, so it goes to target_parameters."""
    from peft import LoraConfig, get_peft_model

    out = root / "peft-experts"
    if not out.is_dir():
        model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"])).save_pretrained(str(out))
    return str(out)


def refused_adapters(root: Path) -> dict[str, tuple[str, str]]:
    """name -> (adapter folder, a regex of what the refusal names)."""
    def lora(module: str, rank: int, in_dim: int, out_dim: int) -> dict[str, torch.Tensor]:
        key = f"base_model.model.model.layers.{module}"
        return {f"{key}.lora_A.weight": torch.zeros(rank, in_dim), f"{key}.lora_B.weight": torch.zeros(out_dim, rank)}

    return {
        "peft-experts": (peft_expert_adapter(root), r"target_parameters \['down_proj'\]"),
        # target_modules naming an MLP projection or the router, as older PEFT configs do.
        "mlp-target": (edited_adapter(root, root / "mlp-target", {}, {"target_modules": ["q_proj", "up_proj"]}),
                       r"'up_proj'.* takes them on q_proj, k_proj, v_proj, o_proj only"),
        "router-target": (edited_adapter(root, root / "router-target", {}, {"target_modules": ["q_proj", "gate"]}),
                          r"'gate' is not supported"),
        # Weights on the dense layer's MLP, on an expert's and on the router's linears (as PEFT
        # wrote them on transformers 4's Qwen3-MoE), under a target regex that allows them.
        "dense-mlp": (edited_adapter(root, root / "dense-mlp", lora("1.mlp.down_proj", 8, 96, 64),
                                     {"target_modules": r".*\.(q|k|v|o|down)_proj"}),
                      r"model\.layers\.1\.mlp\.down_proj is not a projection"),
        "expert": (edited_adapter(root, root / "expert", lora("0.mlp.experts.3.gate_proj", 8, 64, 32),
                                  {"target_modules": "all-linear"}),
                   r"model\.layers\.0\.mlp\.experts\.3\.gate_proj is not a projection"),
        "router": (edited_adapter(root, root / "router", lora("2.mlp.gate", 8, 64, 8), {"target_modules": "all-linear"}),
                   r"model\.layers\.2\.mlp\.gate is not a projection"),
    }


def test_attention_adapters_in_one_batch_equal_peft(root: Path) -> None:
    loras = [LoRARequest(name, i + 1, adapter(root, r, targets, seed=i))
             for i, (name, r, targets) in enumerate(ATTENTION)]
    ps = prompts([9, 30, 17, 41, 5, 22])
    chosen = [loras[0], loras[1], None, loras[1], loras[0], None]
    base = eager(root, None)
    references = {None: base} | {lora.lora_int_id: eager(root, lora.lora_path) for lora in loras}
    expected = [greedy(references[lora and lora.lora_int_id], p) for p, lora in zip(ps, chosen, strict=True)]
    assert sum(e != greedy(base, p) for p, e, lora in zip(ps, expected, chosen, strict=True) if lora) >= 3
    llm = LLM(str(root / "model"), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, lora_request=chosen)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # The MLPs took no wrapper: a sparse layer has no `gate_up_proj` to wrap.
    layers = llm.llm_engine.runner.model.model.layers
    assert type(layers[1].mlp.gate_up_proj).__name__ != "LoRALinear"
    assert type(layers[0].self_attn.qkv_proj).__name__ == "LoRALinear"
    llm.llm_engine.assert_no_leaks()


def test_adapters_on_experts_router_or_mlp_are_refused_naming_the_module(root: Path) -> None:
    llm = LLM(str(root / "model"), **ENGINE)
    for i, (name, (path, names)) in enumerate(refused_adapters(root).items()):
        with pytest.raises(LoRALoadError, match=names):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest(name, 10 + i, path))
    llm.llm_engine.assert_no_leaks()


def test_server_load_route_takes_attention_adapters_and_refuses_the_rest(root: Path) -> None:
    path = adapter(root, *ATTENTION[0][1:], seed=0)
    argv = [str(root / "model"), *SERVE_ARGS, "--enable-lora", "--enable-lora-runtime-updates",
            "--lora-dir", str(root), "--max-lora-rank", "8", "--max-model-len", "128"]
    with running_server(argv) as server:
        load = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "attn", "lora_path": path})
        assert load.status_code == 200, load.text
        (prompt,) = prompts([12])
        out = httpx.post(f"{server.v1}/completions", json={
            "model": "attn", "prompt": prompt, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
            "temperature": 0, "return_token_ids": True}).json()
        assert out["choices"][0]["token_ids"] == greedy(eager(root, path), prompt)
        for name, (bad, names) in refused_adapters(root).items():
            r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": name, "lora_path": bad})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "lora_path"
            assert re.search(names, error["message"]), error["message"]
        server.assert_no_leaks()
