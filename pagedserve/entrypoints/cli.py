"""The `pagedserve` command: `serve` (OpenAI-compatible server) and `generate` (offline run).

Imports are lazy: `pagedserve --help` must not pay for torch, transformers or FastAPI.
A `bench` subcommand is added by registering another parser in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' -> 1000000000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1e9)")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that map one-to-one onto EngineConfig (ModelConfig, CacheConfig, SchedulerConfig)."""
    parser.add_argument(
        "model", nargs="?", default=None,
        help="Hugging Face model folder, or a built-in demo model name (demo, llama-gqa, ...). "
             "Default: the demo model (random weights, gibberish text).")
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    group.add_argument("--dtype", default="auto",
                       help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16 or float16")
    group.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's maximum)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                       help="memory for the KV cache, e.g. 512MiB or 2GiB (default: a share of free memory)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts over several steps")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse cached KV blocks of shared prompt prefixes (on by default)")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                       help="how to preempt under memory pressure (auto: swap when copying is cheaper)")
    group.add_argument("--swap-space", type=parse_bytes, default=1 << 30, metavar="BYTES",
                       help="host memory for swapped-out KV blocks, e.g. 1GiB")
    group.add_argument("--quantization", default=None, choices=["int8", "int4"],
                       help="weight-only quantization of every linear layer at load time "
                            "(int8: per output channel; int4: group-wise)")
    group.add_argument("--quantization-group-size", type=int, default=128,
                       help="int4 group size along the input dim: 32, 64, 128 or 256")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="also quantize the LM head (embeddings stay full precision)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                       help="auto (the model's dtype) or int8 (per-token-per-head scales, "
                            "~2x the blocks of bf16, ~4x of fp32)")


def resolve_model(model: str | None) -> tuple[str, str]:
    """(model folder, default served name): a folder as given, or a demo model by name."""
    from pagedserve.demo_models import DEMO_MODEL, get_model_path, model_names

    if model is None:
        path = str(get_model_path(DEMO_MODEL))
        print(f"pagedserve: no model given; using the demo model {DEMO_MODEL!r} at {path} "
              "(random weights: its text is gibberish)", file=sys.stderr)
        return path, DEMO_MODEL
    if not os.path.exists(model) and model in model_names():
        return str(get_model_path(model)), model
    return model, model


def engine_kwargs(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """The engine flags as `LLM(...)` keyword arguments, which build the EngineConfig (one flag, one field)."""
    return {
        "model": model_path,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enable_prefix_caching": args.enable_prefix_caching,
        "device": args.device,
        "preemption_mode": args.preemption_mode,
        "swap_space_bytes": args.swap_space,
        "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size,
        "quantize_lm_head": args.quantize_lm_head,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                            description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use as `model` (default: the MODEL argument)")
    group.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDSERVE_API_KEY)")
    group.add_argument("--chat-template", default=None,
                       help="chat template (a Jinja file, or the template itself) overriding the tokenizer's")
    group.add_argument("--max-queue-len", type=int, default=None,
                       help="answer 503 while this many requests are waiting (default: unbounded)")
    group.add_argument("--stall-timeout", type=float, default=60.0,
                       help="/health fails when the engine has work but no step finished for this many seconds")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before being aborted")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level of the server and engine")
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters on the base model")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="adapters to serve; a request selects one with \"model\": NAME")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters resident in the KV memory pool at once")
    lora.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in the host cache")
    lora.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                      help="adapters' dtype in the KV pool (auto: the model's; bfloat16 halves their memory)")
    lora.add_argument("--enable-lora-runtime-updates", action="store_true",
                      help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    lora.add_argument("--lora-dir", action="append", default=[],
                      help="root folder runtime-loaded adapters must live in (repeatable)")
    return parser


def _generate_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("generate", help="generate text offline (no server)",
                            description="Run prompts through the engine once and print the outputs.")
    add_engine_args(parser)
    group = parser.add_argument_group("sampling")
    group.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    group.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.launch import serve

    return serve(args)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    path, _ = resolve_model(args.model)
    llm = LLM(**engine_kwargs(args, path))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                            max_tokens=args.max_tokens)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        completion = output.outputs[0]
        print(f"prompt: {prompt!r}\noutput: {completion.text!r}\n"
              f"({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})\n")
    return 0


def _bench_parser(sub: Any) -> argparse.ArgumentParser:
    from pagedserve.bench.cli import add_bench_parser

    return add_bench_parser(sub)


def _run_bench(args: argparse.Namespace) -> int:
    from pagedserve.bench.cli import run_bench

    return run_bench(args)


_SUBCOMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[Any], int]]] = {
    "serve": (_serve_parser, _run_serve),
    "generate": (_generate_parser, _run_generate),
    "bench": (_bench_parser, _run_bench),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="A paged-KV-cache LLM serving engine.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for make_parser, _ in _SUBCOMMANDS.values():
        make_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from pagedserve import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _SUBCOMMANDS[args.command][1](args)
    except ValueError as exc:
        # Configuration errors (sizes, dtype, model folder) read better without a traceback.
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
