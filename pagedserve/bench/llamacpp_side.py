"""llama.cpp's side of the quality comparisons, run by llama.cpp's own Python (never the
project's): it imports only the standard library, numpy and `llama_cpp`.

    PYTHONPATH=<this repository> <llama python> -m pagedserve.bench.llamacpp_side REQUEST.json RESPONSE.json

The request names a GGUF file and token ids made by pagedserve's tokenizer (so both sides read
the same ids; nothing is tokenized here): `windows` are scored (the log-probability of every
token after a window's first, each window evaluated from an empty cache in one batch),
`prompts` are answered greedily (argmax of the last row, stopping at `eos`), and `replies`
are read as part of their prompts (the teacher-forced top-1 and its margin at each position).
llama.cpp runs with the binding's defaults otherwise (its f16 KV cache included): what a
llama.cpp user gets from the same file.

llama_cpp can come from a build beside the project: `PYTHONPATH=<llama-cpp-python sdist>`
with `LLAMA_CPP_LIB_PATH=<llama.cpp build>/bin` (the libllama.so of the vendored llama.cpp).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def load(path: str, n_ctx: int, threads: int, **kwargs: Any) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                 n_threads_batch=threads, logits_all=True, seed=0, verbose=False, **kwargs)


def log_softmax(rows: Any) -> Any:
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def window_logprobs(llm: Any, window: list[int]) -> list[float]:
    """log p(window[i] | window[:i]) for i >= 1, the window evaluated in one batch."""
    llm.reset()
    llm.eval(window)
    logprobs = log_softmax(llm.scores[: len(window) - 1])
    return [float(logprobs[i, token]) for i, token in enumerate(window[1:])]


def greedy(llm: Any, prompt: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy reply: argmax of the last row each step (the first maximum, like torch.argmax)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    reply: list[int] = []
    while len(reply) < new_tokens:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        reply.append(token)
        if token in eos:
            break
        llm.eval([token])
    return reply


def forced(llm: Any, prompt: list[int], reply: list[int]) -> list[tuple[int, float]]:
    """(top-1 token, top-1 minus top-2 logprob) predicting each reply token, `reply` read as
    part of the prompt in one batch."""
    import numpy as np

    llm.reset()
    llm.eval(prompt + reply)
    rows = []
    for pos in range(len(prompt) - 1, len(prompt) - 1 + len(reply)):
        logits = llm.scores[pos]
        top2 = np.argpartition(-logits, 1)[:2]
        first, second = sorted(top2, key=lambda i: (-logits[i], i))
        rows.append((int(first), float(logits[first] - logits[second])))  # logprob gap = logit gap
    return rows


def main(request_path: str, response_path: str) -> None:
    import llama_cpp

    req = json.loads(Path(request_path).read_text())
    start = time.perf_counter()
    longest = max([len(w) for w in req["windows"]] +
                  [len(p) + max(req["new_tokens"], len(r)) for p, r in zip(req["prompts"], req["replies"], strict=True)])
    llm = load(req["model"], longest + 8, req["threads"])
    scored = [window_logprobs(llm, w) for w in req["windows"]]
    outputs = [greedy(llm, p, req["new_tokens"], set(req["eos"])) for p in req["prompts"]]
    replies = req["replies"] or outputs
    forced_rows = [forced(llm, p, r) for p, r in zip(req["prompts"], replies, strict=True)]
    meta = {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode(),
            "seconds": time.perf_counter() - start}
    Path(response_path).write_text(json.dumps({"meta": meta, "logprobs": scored, "outputs": outputs,
                                               "forced": forced_rows}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
