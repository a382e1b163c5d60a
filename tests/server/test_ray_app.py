"""`serve run pagedserve.ray:app key=value ...`: the application arguments become serve flags."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli import build_parser
from pagedserve.ray import serve_argv


def test_app_arguments_are_serve_flags() -> None:
    argv = serve_argv({"model": "llama-gqa", "num_replicas": "4", "kv_cache_memory_bytes": "8MiB",
                       "enable_prefix_caching": "false", "enable_lora": "true", "quantization": "int8"})
    args = build_parser().parse_args(["serve", *argv])
    assert args.model_tag == "llama-gqa" and args.data_parallel_size == 4
    assert args.distributed_executor_backend == "ray"
    assert args.kv_cache_memory_bytes == 8 << 20 and args.quantization == "int8"
    assert args.enable_prefix_caching is False and args.enable_lora is True


def test_app_needs_a_model() -> None:
    with pytest.raises(ValueError, match="model"):
        serve_argv({"num_replicas": "2"})
