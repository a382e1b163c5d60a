"""Real-text quality of a trained model under each precision / quantization setting.

    python benchmarks/quality.py --model /path/to/SmolLM2-135M-Instruct   # HF folder or .gguf
    python benchmarks/quality.py --model ... --configs fp32,int8 --tokens 8000 --prompts 8
    python benchmarks/quality.py --quick                                  # smoke run, random model

Per configuration, through the engine (the offline LLM class):
  * perplexity on real English: the docstrings of a fixed list of Python standard-library
    modules (every machine with Python has them; they change only with the Python version,
    which the report prints), tokenized once and cut into independent windows of --window
    tokens; each window is one request with prompt_logprobs=0, and the perplexity is
    exp(-mean logprob) over every token that has a context (all but each window's first);
  * greedy agreement with fp32: --prompts chat prompts (a fixed list, ChatML via the
    tokenizer's chat template) x --new-tokens greedy tokens; per prompt, the tokens before
    the first divergence from fp32's output, summed over prompts and divided by fp32's
    token count (both stopping at end-of-turn at the same place counts as full agreement);
  * teacher-forced agreement: every configuration reads fp32's greedy continuations as prompts
    (prompt_logprobs=2) and its top-1 at each position is compared with fp32's token. Unlike the
    first-divergence share, one near-tie early in a reply does not discard the rest of it. The
    fp32 row is the noise floor (its prefill against its own decode: different matmul kernels);
  * the margin at each first divergence: fp32's top-1 minus top-2 logprob at the position where
    the configuration's greedy reply first differs (median over the diverging prompts). A small
    margin says the two precisions split a near-tie, not that one of them went wrong.

Two reference rows besides the engine's configurations (issue 35.5: a GGUF file served
natively against transformers on the dequantized weights, and against llama.cpp on the file):
  * `hf-fp32`: transformers in float32 (eager attention) on the same weights (a .gguf file
    dequantized by transformers' own GGUF loader), the same windows, prompts and stops;
  * `llama.cpp`: llama.cpp on the same file through its Python binding in its own interpreter
    (--llama-python; pagedserve/bench/llamacpp_side.py), fed the same token ids.
`--reference` names the row the others are compared with (default fp32; hf-fp32 for a .gguf,
whose fp32 row is the file's blocks served natively like gguf).

    python benchmarks/quality.py --model qwen2.5-coder-1.5b-instruct --configs hf-fp32,gguf,llama.cpp \
        --reference hf-fp32 --tokens 20480 --prompts 8 --new-tokens 32 \
        --llama-python /work/scratch/llamacpp/venv/bin/python

Nothing here depends on timing: the numbers are deterministic for a model, a Python version
and a CPU's float summation order, so one run is the result.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.bench.agreement import (
    CONFIGS,
    agreement,
    chat_prompts,
    divergence_margins,
    teacher_forced,
    teacher_forced_agreement,
)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIGS = ["fp32", "bf16", "int8", "int4", "kv-int8", "int8+kv-int8"]
# Rows that are not the engine's: transformers float32 and llama.cpp (see the docstring).
REFERENCES = ("hf-fp32", "llama.cpp")

# Modules whose docstrings make the corpus, in this order (stable across Python 3.10-3.13).
CORPUS_MODULES = [
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "functools", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "http.cookies", "imaplib", "inspect", "ipaddress", "json", "locale", "logging",
    "mailbox", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "smtplib", "socket",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
]

def corpus_text() -> str:
    """Module docstrings, then each public class's and function's (sorted by name), deduplicated."""
    seen: set[str] = set()
    parts: list[str] = []

    def add(doc: str | None) -> None:
        if doc and len(doc) > 40 and doc not in seen:
            seen.add(doc)
            parts.append(doc)

    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        add(inspect.getdoc(module))
        for attr in sorted(vars(module)):
            obj = vars(module)[attr]
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                add(inspect.getdoc(obj))
    return "\n\n".join(parts)


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids) - 1, size) if len(token_ids[i : i + size]) > 1]


def perplexity(llm, chunks: list[list[int]]) -> tuple[float, int]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    total, count = 0.0, 0
    for out, chunk in zip(outputs, chunks, strict=True):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            total += entry[token].logprob
            count += 1
    return math.exp(-total / count), count


def greedy_outputs(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(model: str, config: dict, window: int):
    from pagedserve import LLM

    return LLM(model, max_model_len=max(window, 1024) + 8, kv_cache_memory_bytes=512 << 20,
               enable_prefix_caching=False, **config)


def hf_reference(model_path: str, chunks: list[list[int]], prompts: list[list[int]], new_tokens: int,
                 eos: list[int], reference: list[list[int]] | None) -> dict:
    """transformers float32 on the same weights: window perplexity, greedy replies, and the
    teacher-forced rows on `reference` (its own replies when None)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.suffix == ".gguf" \
        else {"pretrained_model_name_or_path": path}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    total, count, outputs, forced = 0.0, 0, [], []
    with torch.inference_mode():
        for chunk in chunks:
            logprobs = model(torch.tensor([chunk])).logits[0, :-1].double().log_softmax(-1)
            total += logprobs.gather(1, torch.tensor(chunk[1:])[:, None]).sum().item()
            count += len(chunk) - 1
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):].tolist()
            stop = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
            outputs.append(out[:stop])
        for prompt, reply in zip(prompts, reference or outputs, strict=True):
            logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(reply)]
            top = logits.double().log_softmax(-1).topk(2, dim=-1)
            forced.append([(int(i[0]), float(v[0] - v[1])) for v, i in zip(top.values, top.indices, strict=True)])
    return {"ppl": math.exp(-total / count), "count": count, "outputs": outputs, "forced": forced}


def llama_reference(args: argparse.Namespace, model_path: str, chunks: list[list[int]], prompts: list[list[int]],
                    eos: list[int], reference: list[list[int]] | None) -> dict:
    """llama.cpp on the same file, in --llama-python (pagedserve/bench/llamacpp_side.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        request, response = Path(tmp) / "request.json", Path(tmp) / "response.json"
        request.write_text(json.dumps({"model": model_path, "windows": chunks, "prompts": prompts,
                                       "replies": reference or [], "eos": eos, "new_tokens": args.new_tokens,
                                       "threads": args.threads}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([args.llama_python, "-m", "pagedserve.bench.llamacpp_side", str(request), str(response)],
                              env=env)
        if done.returncode != 0:
            raise SystemExit(f"the llama.cpp side failed (exit {done.returncode}): --llama-python must import llama_cpp")
        got = json.loads(response.read_text())
    scored = [lp for window in got["logprobs"] for lp in window]
    print(f"# llama.cpp: llama-cpp-python {got['meta']['llama_cpp_python']}; "
          f"{got['meta']['system_info'].strip()}", flush=True)
    return {"ppl": math.exp(-sum(scored) / len(scored)), "count": len(scored), "outputs": got["outputs"],
            "forced": [[tuple(row) for row in rows] for rows in got["forced"]]}


def eos_ids(model_path: str, tokenizer) -> list[int]:
    """What the engine stops on: the tokenizer's EOS and, for a GGUF, the file's end-of-generation ids."""
    from pagedserve.models.gguf import gguf_eog_token_ids
    from pagedserve.models.hub import is_gguf

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if is_gguf(model_path):
        ids += [i for i in gguf_eog_token_ids(model_path) if i not in ids]
    return ids


def run(args: argparse.Namespace) -> None:
    from pagedserve.engine.tokenizer import load_tokenizer
    from pagedserve.models.hub import resolve_model_path

    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS and n not in REFERENCES]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join([*CONFIGS, *REFERENCES])}")
    if args.reference in names:  # the reference runs first: the others are teacher-forced on its replies
        names = [args.reference] + [n for n in names if n != args.reference]
    results = _load_results(args)
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer.encode(corpus_text())[: args.tokens]
    chunks = windows(ids, args.window)
    prompts = chat_prompts(tokenizer, args.prompts)
    eos = eos_ids(model_path, tokenizer)
    for name in names:
        start = time.perf_counter()
        reference = results[args.reference]["outputs"] if args.reference in results else None
        if name == "hf-fp32":
            results[name] = hf_reference(model_path, chunks, prompts, args.new_tokens, eos, reference)
        elif name == "llama.cpp":
            results[name] = llama_reference(args, model_path, chunks, prompts, eos, reference)
        else:
            llm = make_llm(model_path, CONFIGS[name], args.window)
            ppl, count = perplexity(llm, chunks)
            results[name] = {"ppl": ppl, "count": count, "outputs": greedy_outputs(llm, prompts, args.new_tokens)}
            results[name]["forced"] = teacher_forced(llm, prompts, reference or results[name]["outputs"])
            del llm
        _save_result(args, name, results[name])
        print(f"# {name}: ppl {results[name]['ppl']:.4f} ({results[name]['count']} tokens), "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    report(args, results)


def _key(args: argparse.Namespace) -> dict:
    return {"model": args.model, "reference": args.reference, "tokens": args.tokens, "window": args.window, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "python": platform.python_version()}


def _load_results(args: argparse.Namespace) -> dict[str, dict]:
    """Results saved in --results-dir by earlier (or parallel) runs with the same settings:
    configurations can run in separate processes, and `--configs ''` just prints the table."""
    found: dict[str, dict] = {}
    if args.results_dir is None:
        return found
    for path in sorted(Path(args.results_dir).glob("*.json")):
        saved = json.loads(path.read_text())
        if saved.get("key") == _key(args):
            found[path.stem] = saved
    return found


def _save_result(args: argparse.Namespace, name: str, result: dict) -> None:
    if args.results_dir is not None:
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.results_dir) / f"{name}.json").write_text(json.dumps({"key": _key(args), **result}))


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    if args.reference not in results:
        print(f"(no {args.reference} result yet: the table needs it as the reference)")
        return
    base = results[args.reference]
    print(f"\nmodel {args.model}; corpus: {len(CORPUS_MODULES)} stdlib modules' docstrings, Python "
          f"{platform.python_version()}, {base['count']} scored tokens in windows of {args.window}; "
          f"greedy: {args.prompts} chat prompts x {args.new_tokens} tokens")
    print(f"reference: {args.reference}")
    print(f"| config | perplexity | vs {args.reference} | greedy agreement | teacher-forced top-1 | diverging prompts | "
          "fp32 margin at divergence (median, nats) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    order = [n for n in [*REFERENCES, *CONFIGS] if n in results]
    for name in order:
        r = results[name]
        agree = agreement(base["outputs"], r["outputs"])
        forced = f"{teacher_forced_agreement(base['outputs'], r['forced']):.3f}" if "forced" in r else "-"
        margins = divergence_margins(base["outputs"], r["outputs"], base["forced"]) if "forced" in base else []
        margin = f"{statistics.median(margins):.3f}" if margins else "-"
        print(f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f}% | {agree:.3f} | {forced} | "
              f"{len(margins)} / {len(base['outputs'])} | {margin} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the demo model with --quick)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--tokens", type=int, default=50_000, help="corpus tokens scored")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--results-dir", default=None,
                        help="save each configuration's results here and report every one found "
                             "(run configurations in parallel processes, then once with --configs '')")
    parser.add_argument("--reference", default="fp32", help=f"the row compared against: fp32 or one of {REFERENCES}")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python that imports llama_cpp (its own venv, never the project's), for llama.cpp")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--quick", action="store_true", help="small run on the random demo model")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.window, args.prompts, args.new_tokens = 600, 128, 4, 8
        if args.model is None:
            from pagedserve.demo_models import get_model_path

            args.model = str(get_model_path("llama-gqa"))
    if args.model is None:
        parser.error("--model is required (an HF folder or a .gguf file) unless --quick")
    run(args)


if __name__ == "__main__":
    main()
