"""Greedy agreement between two runs of the same prompts: the quality measure of
benchmarks/quality.py and benchmarks/llamacpp_agreement.py (which compares llama.cpp's
runs on the same prompts), with the configurations and chat prompts both use.

First-divergence agreement: per prompt, the tokens generated before the first one that
differs from the reference's greedy reply, over all prompts' reference tokens.
"""

from __future__ import annotations

# name -> LLM keyword arguments; "fp32" is the reference.
CONFIGS: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    # group-wise int8 with int8 activations per block of 32 (the default) / weight-only
    "int8-a8": {"dtype": "float32", "quantization": "int8", "quantization_activations": "int8"},
    "int8-wo": {"dtype": "float32", "quantization": "int8", "quantization_activations": "none"},
    # ... and the LM head quantized too (llama.cpp's q8_0 files quantize the output matrix)
    "int8-a8-head": {"dtype": "float32", "quantization": "int8", "quantization_activations": "int8",
                     "quantize_lm_head": True},
    "int8-wo-head": {"dtype": "float32", "quantization": "int8", "quantization_activations": "none",
                     "quantize_lm_head": True},
    "int8-channel": {"dtype": "float32", "quantization": "int8", "quantization_group_size": -1},
    "int4": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32},
    "int4-g128": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128},
    "kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "int8+kv-int8": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "int8"},
    # --model a .gguf file only: its quantized linear weights served as they are (fp32 is then
    # the same file dequantized to float32: the same weights, so this measures the kernels);
    # "gguf" is the default (int8 activations, llama.cpp's arithmetic), "gguf-float" keeps
    # float32 activations (the file's weights times x exactly).
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "gguf-float": {"dtype": "float32", "quantization": "gguf", "quantization_activations": "none"},
}
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for a job interview.",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a coffee shop.",
    "How many continents are there? Name them.",
    "What does HTTP stand for?",
    "Write a haiku about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Explain recursion to a ten-year-old.",
    "What is the boiling point of water at sea level?",
    "Who wrote Pride and Prejudice?",
    "Give me a recipe idea for a quick dinner.",
    "What is machine learning?",
    "How can I improve my sleep?",
    "What is the largest planet in our solar system?",
    "Describe a cat in one paragraph.",
    "What is the Pythagorean theorem?",
    "List three renewable energy sources.",
    "How does a bicycle stay upright?",
    "What is the purpose of a database index?",
    "Tell me a fun fact about octopuses.",
    "Write an email subject line for a team meeting.",
    "What is inflation in economics?",
    "How do vaccines work?",
]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    agreed = 0
    for ref, out in zip(reference, other, strict=True):
        n = 0
        while n < len(ref) and n < len(out) and ref[n] == out[n]:
            n += 1
        agreed += n
    return agreed / max(1, sum(len(r) for r in reference))


def teacher_forced(llm, prompts: list[list[int]], replies: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per prompt, per reply position: (this model's top-1 token, its top-1 minus top-2 logprob),
    reading `replies` as part of the prompt."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, replies, strict=True)],
                           params, use_tqdm=False)
    result = []
    for out, prompt, reply in zip(outputs, prompts, replies, strict=True):
        rows = []
        for entry in out.prompt_logprobs[len(prompt) : len(prompt) + len(reply)]:
            ranked = sorted((lp for lp in entry.items() if lp[1].rank in (1, 2)), key=lambda kv: kv[1].rank)
            top1, top2 = ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]
            rows.append((top1[0], top1[1].logprob - top2[1].logprob))
        result.append(rows)
    return result


def teacher_forced_agreement(reference: list[list[int]], forced: list[list[tuple[int, float]]]) -> float:
    agreed = sum(tok == ref for rows, refs in zip(forced, reference, strict=True)
                 for (tok, _), ref in zip(rows, refs, strict=True))
    return agreed / max(1, sum(len(r) for r in reference))


def divergence_margins(reference: list[list[int]], other: list[list[int]],
                       fp32_forced: list[list[tuple[int, float]]]) -> list[float]:
    """fp32's top-1 minus top-2 logprob where `other` first leaves fp32's greedy reply."""
    margins = []
    for ref, out, rows in zip(reference, other, fp32_forced, strict=True):
        n = 0
        while n < len(ref) and n < len(out) and ref[n] == out[n]:
            n += 1
        if n < len(ref) and n < len(rows):
            margins.append(rows[n][1])
    return margins


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for text in (CHAT_PROMPTS * (1 + count // len(CHAT_PROMPTS)))[:count]:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts
