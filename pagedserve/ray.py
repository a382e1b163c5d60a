"""pagedserve as a Ray Serve application.

    serve run pagedserve.ray:app model=MODEL num_replicas=4 [kv_cache_memory_bytes=1GiB ...]

One Serve deployment is the ingress: the same FastAPI server as `pagedserve serve`, built on
the Serve replica, over `num_replicas` engine actors (pagedserve's own router, so prefix and
adapter affinity hold; Serve's proxy only forwards HTTP). Every other key=value is the
`pagedserve serve` flag of that name (`enable_prefix_caching=false` gives
`--no-enable-prefix-caching`, `enable_lora=true` gives `--enable-lora`).

The module is named for Ray; inside it, `import ray` is still the Ray package (absolute import).
"""

from __future__ import annotations

from typing import Any

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def serve_argv(args: dict[str, str]) -> list[str]:
    """`pagedserve serve` arguments for Serve's key=value application arguments."""
    from pagedserve.entrypoints.cli import build_parser

    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    known = set(serve_parser._option_string_actions)
    args = dict(args)
    if "model" not in args:
        raise ValueError("model: the application needs model=MODEL")
    argv = [str(args.pop("model")), "--data-parallel-size", str(int(args.pop("num_replicas", 1))),
            "--distributed-executor-backend", "ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value)
        if text.lower() in _TRUE:
            argv.append(flag)
        elif text.lower() in _FALSE:
            if "--no-" + key.replace("_", "-") in known:  # a setting that defaults to on
                argv.append("--no-" + key.replace("_", "-"))
        else:
            argv += [flag, text]
    return argv


def build_asgi_app(argv: list[str]) -> Any:
    """The pagedserve FastAPI app for `pagedserve serve <argv>` (run on the Serve replica)."""
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.model_source import engine_args_from
    from pagedserve.server.api_server import build_app
    from pagedserve.server.launch import build_context

    args = build_parser().parse_args(["serve", *argv])
    engine_args, name = engine_args_from(args)
    return build_app(build_context(args, engine_args, name))


def app(args: dict[str, str]) -> Any:
    """The Serve application builder (`serve run pagedserve.ray:app key=value ...`)."""
    from ray import serve

    argv = serve_argv(args)
    # The ingress reserves no CPU: the engine actors it starts take them.
    ingress = serve.deployment(name="pagedserve", num_replicas=1, ray_actor_options={"num_cpus": 0})(
        serve.ingress(lambda: build_asgi_app(argv))()
    )
    return ingress.bind()
