"""Offline generation demo on the demo model: prints generated text and tokens/s.

The demo model has random weights (built locally, see pagedserve/demo_models.py), so its
text is random; a real Hugging Face checkpoint folder loads the same way.
"""

from __future__ import annotations

import argparse
import time

from pagedserve.demo_models import DEMO_MODEL, get_model_path
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Paged attention stores the KV cache in",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model = args.model or str(get_model_path(DEMO_MODEL))
    llm = LLM(model=model, kv_cache_memory_bytes=256 << 20)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=1, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs[: len(PROMPTS)]:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s: "
        f"{generated / elapsed:.1f} output tokens/s, {(prompt_tokens + generated) / elapsed:.1f} total tokens/s"
    )


if __name__ == "__main__":
    main()
