"""Small Llama-shaped GGUF files the tests write themselves with the `gguf` package."""

from __future__ import annotations

from typing import Any


def llama_gguf_writer(path: Any, arch: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                      vocab: int) -> Any:
    """A GGUFWriter with a Llama-shaped model's metadata (token ids only: no tokenizer);
    the caller adds the tensors and writes the file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer
