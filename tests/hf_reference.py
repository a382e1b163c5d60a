"""Reference outputs from Hugging Face transformers (fp32) for the parity tests."""

from __future__ import annotations

import functools
import random

import torch

ARCH_MODELS = ["llama-gqa", "llama-tied", "llama3-rope", "qwen2"]
PROMPT_LENGTHS = [1, 5, 17, 33, 64, 100, 170, 300]
NEW_TOKENS = 32


def make_prompts(vocab_size: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    # Ids above the special tokens, so prompts are ordinary text-like token streams.
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]


@functools.lru_cache(maxsize=8)
def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], new_tokens: int = NEW_TOKENS, min_new_tokens: int = 0) -> list[int]:
    """transformers' greedy generate for one prompt, without padding."""
    model = load_hf(path)
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_token_logprobs(path: str, prompt: list[int], output: list[int]) -> list[float]:
    """log_softmax of transformers' logits at each generated token."""
    model = load_hf(path)
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    return logprobs[positions, torch.tensor(output)].tolist()


def hf_beams(path: str, prompt: list[int], width: int, length_penalty: float, max_tokens: int, ignore_eos: bool):
    """transformers' beams (generated tokens, score), best first."""
    model = load_hf(path)
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, num_return_sequences=width, do_sample=False, early_stopping=True,
            length_penalty=length_penalty, max_new_tokens=max_tokens, pad_token_id=model.config.pad_token_id,
            output_scores=True, return_dict_in_generate=True, **kwargs,
        )
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = seq[len(prompt):].tolist()
        if eos in tokens and not ignore_eos:
            tokens = tokens[: tokens.index(eos) + 1]
        while len(tokens) > 1 and tokens[-1] == pad:
            tokens.pop()
        beams.append((tokens, score.item()))
    return beams
