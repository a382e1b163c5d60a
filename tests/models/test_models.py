"""Tiny random models vs Hugging Face transformers (fp32), through our loader and paged cache.

Each model is built with transformers' own classes, saved with `save_pretrained`, loaded
with `load_model`, then run (a) as one flat prefill batch and (b) incrementally (prefix
prefill, then decodes and continued-prefill chunks through the KV cache). Every fed
position's logits must match transformers' logits for the full sequence.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.models.layers.attention import Attention
from pagedserve.models.loader import load_model

BLOCK_SIZE = 8
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama_gqa": LlamaConfig(**TINY | {"head_dim": 32}),  # head_dim != hidden / heads
    "llama_tied_linear": LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    ),
    "llama3_bias": LlamaConfig(
        **TINY, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True
    ),
    "qwen2": Qwen2Config(**TINY),
    # yarn: the one supported type whose attention_scaling != 1.
    "qwen2_yarn": Qwen2Config(
        **TINY,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": MistralConfig(**TINY | {"sliding_window": None}),
}


def save_random_model(config: PretrainedConfig, path: Path, **save_kwargs) -> None:
    """Random weights large enough that attention patterns and biases matter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path, **save_kwargs)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(CONFIGS[request.param], path)
    return path


@torch.inference_mode()
def hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return [model(torch.tensor([p])).logits[0] for p in prompts]


class PagedRunner:
    """Minimal stand-in for the model runner: contiguous blocks per request, one cache per layer."""

    def __init__(self, model: torch.nn.Module, num_requests: int, max_len: int = 128) -> None:
        self.model = model
        self.blocks_per_req = -(-max_len // BLOCK_SIZE)
        self.backend = get_attention_backend(torch.device("cpu"))
        self.seq_lens = [0] * num_requests
        layers = sorted(
            (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
        )
        for layer in layers:
            shape = (
                2,
                num_requests * self.blocks_per_req,
                BLOCK_SIZE,
                layer.num_kv_heads,
                layer.head_dim,
            )
            layer.kv_cache = torch.zeros(shape)

    @torch.inference_mode()
    def step(self, feeds: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """feeds: (request index, new token ids) -> logits (len(new), vocab) per feed."""
        ids, positions, slots, q_lens = [], [], [], []
        for r, tokens in feeds:
            start = self.seq_lens[r]
            pos = list(range(start, start + len(tokens)))
            ids += tokens
            positions += pos
            slots += [
                (r * self.blocks_per_req + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
                for p in pos
            ]
            q_lens.append(len(tokens))
            self.seq_lens[r] += len(tokens)
        s_lens = [self.seq_lens[r] for r, _ in feeds]
        tables = [
            list(range(r * self.blocks_per_req, (r + 1) * self.blocks_per_req)) for r, _ in feeds
        ]
        common = CommonAttentionMetadata(
            num_tokens=len(ids),
            num_seqs=len(feeds),
            block_size=BLOCK_SIZE,
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
            seq_lens=torch.tensor(s_lens),
            block_tables=torch.tensor(tables),
            query_lens_list=q_lens,
            seq_lens_list=s_lens,
            max_query_len=max(q_lens),
            max_seq_len=max(s_lens),
        )
        hidden = self.model(
            torch.tensor(ids), torch.tensor(positions), self.backend.build_metadata(common)
        )
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(q_lens))


def prompts_for(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_prefill_batch_matches_hf(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    prompts = prompts_for(config.vocab_size, [23, 1, 40])
    runner = PagedRunner(model, len(prompts))
    ours = runner.step(list(enumerate(prompts)))
    for got, want in zip(ours, hf_logits(checkpoint, prompts), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_incremental_matches_hf(checkpoint: Path) -> None:
    """Prefix prefills, then each step: req 0 decodes, req 1 feeds 3-token chunks."""
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    prompts = prompts_for(config.vocab_size, [30, 41])
    want = hf_logits(checkpoint, prompts)
    runner = PagedRunner(model, 2)
    fed = [5, 11]
    got: list[list[torch.Tensor]] = [[], []]
    for r, out in zip(
        (0, 1), runner.step([(0, prompts[0][:5]), (1, prompts[1][:11])]), strict=True
    ):
        got[r].append(out)
    while fed[0] < len(prompts[0]) or fed[1] < len(prompts[1]):
        feeds = []
        for r, n in ((1, 3), (0, 1)):  # chunk before decode: any order must work
            if fed[r] < len(prompts[r]):
                feeds.append((r, prompts[r][fed[r] : fed[r] + n]))
                fed[r] += len(feeds[-1][1])
        for (r, _), out in zip(feeds, runner.step(feeds), strict=True):
            got[r].append(out)
    for r in (0, 1):
        torch.testing.assert_close(torch.cat(got[r]), want[r], rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    save_random_model(CONFIGS["llama_gqa"], tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"))
    prompt = prompts_for(config.vocab_size, [12])
    got = PagedRunner(model, 1).step([(0, prompt[0])])[0]
    torch.testing.assert_close(got, hf_logits(tmp_path, prompt)[0], rtol=1e-4, atol=1e-4)


def test_bfloat16_load(tmp_path: Path) -> None:
    save_random_model(CONFIGS["qwen2"], tmp_path)
    model, config = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    prompt = prompts_for(config.vocab_size, [16])
    runner = PagedRunner(model, 1)
    for layer in layers:
        layer.kv_cache = layer.kv_cache.bfloat16()
    got = runner.step([(0, prompt[0])])[0]
    torch.testing.assert_close(got, hf_logits(tmp_path, prompt)[0], rtol=0.1, atol=0.15)


def save_config(config: PretrainedConfig, path: Path, arch: str) -> Path:
    config.architectures = [arch]
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "config, arch, option",
    [
        # A config of a supported family under an architecture name that is not.
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), "FalconForCausalLM", "FalconForCausalLM"),
        (
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16),
            "Qwen2ForCausalLM",
            "use_sliding_window",
        ),
        (
            LlamaConfig(
                **TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
            ),
            "LlamaForCausalLM",
            "rope_type",
        ),
        (LlamaConfig(**TINY, hidden_act="gelu"), "LlamaForCausalLM", "hidden_act"),
        (
            LlamaConfig(**TINY, quantization_config={"quant_method": "gptq", "bits": 4}),
            "LlamaForCausalLM",
            "quantization_config",
        ),
    ],
    ids=["arch", "qwen2_window", "dynamic_rope", "gelu", "gptq"],
)
def test_unsupported_is_refused(
    tmp_path: Path, config: PretrainedConfig, arch: str, option: str
) -> None:
    save_config(config, tmp_path, arch)
    with pytest.raises(ValueError, match=option):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_weight_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_random_model(CONFIGS["llama_gqa"], tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
