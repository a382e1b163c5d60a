"""Tiny windowed configs shared by the sliding-window tests (engine and LoRA): Gemma 3 (5 windowed :
1 full), Gemma 2 (alternating, softcapping) and Mistral (every layer windowed)."""

from __future__ import annotations

from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, PretrainedConfig

WINDOW = 16
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS: dict[str, PretrainedConfig] = {
    # Gemma 3's 5 windowed : 1 full, one layer a page; rope per layer type.
    "gemma3": Gemma3TextConfig(
        **TINY, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    ),
    # Gemma 2 alternates window / full (two layers a page) and caps scores.
    "gemma2": Gemma2Config(
        **TINY, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
    ),
    # Mistral windows every layer: a single, windowed group.
    "mistral": MistralConfig(**TINY, num_hidden_layers=2, sliding_window=WINDOW),
}
