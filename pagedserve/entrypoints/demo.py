"""Offline generation demo: chat answers from the default model (SmolLM2-135M-Instruct) and tokens/s.

`--model` takes any model the engine loads (a folder, a .gguf file, a hub id in the local
cache, or a random demo model by name: its text is gibberish by construction).
"""

from __future__ import annotations

import argparse
import time

from pagedserve.entrypoints.llm import LLM
from pagedserve.entrypoints.model_source import resolve_model
from pagedserve.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model, _ = resolve_model(args.model)
    llm = LLM(model=model, kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=args.max_tokens, seed=1)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    for question, output in zip(QUESTIONS, outputs, strict=False):
        print(f"{question!r} -> {output.outputs[0].text!r}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s: "
        f"{generated / elapsed:.1f} output tokens/s, {(prompt_tokens + generated) / elapsed:.1f} total tokens/s"
    )


if __name__ == "__main__":
    main()
