"""`pagedserve serve`: build the engine, print how to call it, run uvicorn, exit 0 on a signal."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve import envs
from pagedserve.server.limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    header_timeout_protocol,
    install_repeat_filter,
)

if TYPE_CHECKING:
    from pagedserve.engine_args import EngineArgs


logger = logging.getLogger("pagedserve.server")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents if it names a file, else the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise SystemExit(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def build_context(args: argparse.Namespace, engine_args: EngineArgs, default_name: str) -> Any:
    """The ServerContext: engine (from the engine settings), metrics and the serving options."""
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.lora_admin import LoRARegistry
    from pagedserve.server.metrics import ServerMetrics
    from pagedserve.server.request_fields import RequestFields
    from pagedserve.server.serving_common import ServerContext

    names = args.served_model_name or [default_name]
    if getattr(args, "lora_modules", None) and not engine_args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    if getattr(args, "enable_auto_tool_choice", False) and getattr(args, "tool_call_parser", None) is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    metrics = ServerMetrics(names[0])
    loras = LoRARegistry(
        lora_dirs=[Path(d) for d in getattr(args, "lora_dir", [])],
        runtime_updates=getattr(args, "enable_lora_runtime_updates", False),
    )
    lora_modules = getattr(args, "lora_modules", None) or []

    def register_adapters(target: Any) -> None:
        try:
            loras.register_modules(target, lora_modules)
        except ValueError as exc:
            raise SystemExit(f"pagedserve: {exc}") from None

    # The LoRA registry takes either engine; the handlers take either serving engine (the
    # replica set offers AsyncLLMEngine's methods).
    engine: Any
    serving_engine: Any
    if engine_args.data_parallel_size > 1 or engine_args.distributed_executor_backend is not None:
        from pagedserve.distributed.launch import build_replica_set
        from pagedserve.dtypes import torch_device
        from pagedserve.models.source import resolve_model_source

        # N replicas on Ray: the same handlers, a router in place of the engine thread.
        # Each replica's config is one engine's; the ingress reads only its model source.
        config = engine_args.replace(data_parallel_size=1, distributed_executor_backend=None).create_engine_config()
        engine = serving_engine = build_replica_set(args, engine_args, metrics)
        sampling_defaults = dict(resolve_model_source(config.model, torch_device(config.device)).sampling_defaults)
        register_adapters(engine)
    else:
        def build_engine() -> LLMEngine:
            # On the engine thread, the adapters' loads too: the main thread runs no torch op.
            built = LLMEngine(engine_args.create_engine_config())
            register_adapters(built)
            return built

        serving_engine = AsyncLLMEngine.build(build_engine, metrics, stall_timeout_s=args.stall_timeout)
        engine = serving_engine.engine
        sampling_defaults = dict(engine.source.sampling_defaults)
    return ServerContext(
        engine=serving_engine,
        model_names=names,
        model_path=str(engine_args.model),
        metrics=metrics,
        api_key=api_keys(args.api_key),
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),
        default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None) or {},
        max_queue_len=args.max_queue_len,
        loras=loras,
        sampling_defaults=sampling_defaults,
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        request_fields=RequestFields(strict=getattr(args, "strict_request_fields", False)),
    )


def api_keys(flag: list[str] | None) -> list[str] | None:
    """--api-key's keys, else $VLLM_API_KEY, else $PAGEDSERVE_API_KEY (None: no auth)."""
    if flag:
        return list(flag)
    key = envs.api_key()
    return [key] if key else None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def open_cors_warning(host: str, has_key: bool, allowed_origins: list[str]) -> str | None:
    """The start-up warning for vLLM's default CORS `*` on a server anyone can reach and no
    key guards: any web page a user of that network opens can drive it. None when safe."""
    if has_key or host in LOOPBACK_HOSTS or host.startswith("127.") or "*" not in allowed_origins:
        return None
    return (f"SECURITY: serving on {host} with no --api-key and CORS allowed origins '*': any web page opened "
            "by anyone who can reach this address can call every route of this server (generate, load and "
            "unload adapters). Set --api-key, or --allowed-origins to the pages that may call it, or bind "
            "--host 127.0.0.1.")


def usage_text(host: str, port: int, model: str, has_key: bool) -> str:
    base = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if has_key else ""
    key = 'os.environ["PAGEDSERVE_API_KEY"]' if has_key else '"EMPTY"'
    return (
        f"pagedserve: serving {model!r} on {base}\n"
        f"  try:   curl {base}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"           -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
        f"  or:    openai.OpenAI(base_url=\"{base}/v1\", api_key={key})\n"
        f"  also:  {base}/health  {base}/metrics  {base}/docs"
    )


def _keep_calm_on_signals() -> None:
    # uvicorn handles SIGINT/SIGTERM itself (stop accepting, drain, lifespan shutdown), then
    # re-raises the signal at the handler that was installed before it. A no-op handler
    # there turns a graceful shutdown into exit status 0 rather than 130/143.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)


def make_server(app: Any, engine: Any, host: str, port: int, log_level: str, grace_s: float,
                max_connections: int | None = None, keep_alive_s: float = 5.0,
                header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> Any:
    """A uvicorn server whose shutdown gives in-flight requests `grace_s`, then aborts them.

    `max_connections`: past it uvicorn answers 503 at once (at the descriptor limit /health
    used to time out); `keep_alive_s`: an idle connection is closed after this long;
    `header_timeout_s`: so is one whose request head has not arrived whole. Repeated
    identical log errors are collapsed (limits.RepeatFilter).

    Aborting through the engine (rather than letting uvicorn cancel the handlers) ends each
    stream properly: an error chunk and [DONE]; a waiting non-streamed call gets a 503.
    """
    import asyncio

    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            abort_later = asyncio.get_running_loop().call_later(
                grace_s, lambda: asyncio.ensure_future(engine.shutdown())
            )
            try:
                await super().shutdown(sockets)
            finally:
                abort_later.cancel()

    # uvicorn's own deadline is only the backstop behind ours.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(grace_s) + 5,
                            limit_concurrency=max_connections, timeout_keep_alive=int(max(1, keep_alive_s)),
                            http=header_timeout_protocol(header_timeout_s))
    install_repeat_filter()  # after uvicorn.Config: it installs uvicorn's log handlers
    return GracefulServer(config)


def serve(args: argparse.Namespace) -> int:
    from pagedserve.server.api_server import HTTPOptions, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pagedserve.entrypoints.model_source import engine_args_from

    engine_args, default_name = engine_args_from(args)
    ctx = build_context(args, engine_args, default_name)
    app = build_app(ctx, HTTPOptions.from_cli_args(args))
    uvicorn_level = getattr(args, "uvicorn_log_level", None) or args.log_level
    server = make_server(app, ctx.engine, args.host, args.port, uvicorn_level, args.shutdown_timeout,
                         args.max_connections, args.keep_alive_timeout, args.header_timeout)
    print(usage_text(args.host, args.port, ctx.model_names[0], ctx.api_key is not None), file=sys.stderr, flush=True)
    warning = open_cors_warning(args.host, ctx.api_key is not None, list(getattr(args, "allowed_origins", ["*"])))
    if warning is not None:
        logger.warning(warning)
        print(f"pagedserve: {warning}", file=sys.stderr, flush=True)
    _keep_calm_on_signals()
    server.run()
    if not server.started:
        return 3  # could not bind, or start-up failed (uvicorn's own exit code for this)
    return 0
