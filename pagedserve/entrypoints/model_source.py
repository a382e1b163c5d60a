"""Which model a command line names: a folder as given, or a built-in demo model by name."""

from __future__ import annotations

import argparse
import os
import sys

from pagedserve.engine_args import EngineArgs


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


def engine_args_from(args: argparse.Namespace) -> tuple[EngineArgs, str]:
    """The EngineArgs of parsed flags with MODEL resolved, and the default served model name."""
    engine_args = EngineArgs.from_cli_args(args)
    path, name = resolve_model(engine_args.model)
    return engine_args.replace(model=path), name
