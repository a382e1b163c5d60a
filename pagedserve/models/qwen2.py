"""Qwen2 / Qwen2.5: the Llama architecture with a QKV bias (o_proj and MLP unbiased)."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return True, False, False

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"unsupported use_sliding_window=True (sliding_window={getattr(config, 'sliding_window', None)}) "
                f"for {cls.__name__}: sliding-window attention is not implemented"
            )
        super().check_config(config)
