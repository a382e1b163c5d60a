"""EngineArgs: one definition per setting drives the CLI flags, LLM(**kwargs) and the config."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine_args import EngineArgs, cli_flag_names, parse_gib
from pagedserve.entrypoints.cli import build_parser


def test_every_cli_setting_round_trips_through_its_flag() -> None:
    """Each flag lands in its own field: set all of them to non-defaults and read them back."""
    argv = ["serve", "--model", "m", "--tokenizer", "t", "--dtype", "bfloat16", "--seed", "7",
            "--revision", "v2", "--download-dir", "/hub", "--generation-config", "vllm",
            "--max-model-len", "99", "--device", "cpu", "--quantization", "int4",
            "--quantization-group-size", "32", "--quantize-lm-head", "--quantization-activations", "none",
            "--block-size", "32",
            "--kv-cache-memory-bytes", "3MiB", "--num-gpu-blocks-override", "5",
            "--no-enable-prefix-caching", "--swap-space", "2", "--kv-cache-dtype", "int8",
            "--max-num-seqs", "3", "--max-num-batched-tokens", "111", "--no-enable-chunked-prefill",
            "--preemption-mode", "swap", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--max-cpu-loras", "9", "--lora-dtype", "bfloat16", "--skip-tokenizer-init",
            "--gpu-memory-utilization", "0.5", "--trust-remote-code", "--enforce-eager",
            "--load-format", "gguf", "--tokenizer-mode", "slow", "--disable-log-stats",
            "--scheduling-policy", "priority", "--speculative-config", '{"method": "ngram"}',
            "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--structured-outputs-config", '{"backend": "xgrammar"}', "--guided-decoding-backend", "xgrammar",
            "--compilation-config", "3"]
    args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    defaults = EngineArgs()
    for name in cli_flag_names():
        assert getattr(args, name) != getattr(defaults, name), f"flag of {name} did not reach its field"
    assert args.kv_cache_memory_bytes == 3 << 20 and args.swap_space == 2.0
    with pytest.raises(ValueError, match="data_parallel_size"):
        args.create_engine_config()  # replicas are the server's; one engine is one replica
    config = args.replace(data_parallel_size=1).create_engine_config()
    assert config.parallel.tensor_parallel_size == 2
    assert isinstance(config, EngineConfig)
    assert config.cache.swap_space_bytes == 2 << 30 and config.cache.block_size == 32
    assert config.lora is not None and config.lora.max_cpu_loras == 9
    assert config.speculative is not None and config.speculative.method == "ngram"


def test_positional_and_option_model() -> None:
    parse = build_parser().parse_args
    assert EngineArgs.from_cli_args(parse(["serve", "a"])).model == "a"
    assert EngineArgs.from_cli_args(parse(["serve", "--model", "a"])).model == "a"
    with pytest.raises(ValueError, match="twice"):
        EngineArgs.from_cli_args(parse(["serve", "a", "--model", "b"]))


def test_llm_kwargs_are_the_fields() -> None:
    with pytest.raises(TypeError, match="no_such_setting"):
        EngineArgs(model="m", no_such_setting=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model="m", block_size=3).create_engine_config()
    assert [f.name for f in fields(EngineArgs)][0] == "model"


@pytest.mark.parametrize("text, gib", [("4", 4.0), ("0.5", 0.5), ("512MiB", 0.5), ("1GiB", 1.0)])
def test_swap_space_is_gib(text: str, gib: float) -> None:
    assert parse_gib(text) == gib


def test_engine_args_do_not_import_torch() -> None:
    probe = "import sys, pagedserve.engine_args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("text, tokens", [("2048", 2048), ("16k", 16000), ("16K", 16384), ("1M", 1 << 20),
                                          ("auto", None), ("-1", None)])
def test_max_model_len_units(text: str, tokens: int | None) -> None:
    args = EngineArgs.from_cli_args(build_parser().parse_args(["serve", "m", "--max-model-len", text]))
    assert args.max_model_len == tokens


def test_vllm_only_flags_are_accepted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    argv = ["serve", "m", "--enforce-eager", "--trust-remote-code", "--load-format", "safetensors",
            "--tokenizer-mode", "slow", "--disable-log-stats", "--gpu-memory-utilization", "0.5"]
    args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    with caplog.at_level("INFO", logger="pagedserve.engine_args"):
        args.create_engine_config()
        args.create_engine_config()
    for name in ("enforce_eager", "trust_remote_code", "load_format", "tokenizer_mode", "disable_log_stats"):
        assert sum(name in r.getMessage() for r in caplog.records) <= 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--no-such-flag"])


def test_gpu_memory_utilization_sizes_the_kv_cache() -> None:
    from pagedserve import LLM
    from pagedserve.demo_models import get_model_path
    from pagedserve.worker.kv_cache import kv_cache_bytes_for_utilization

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model="m", gpu_memory_utilization=1.5).create_engine_config()
    import torch

    assert kv_cache_bytes_for_utilization(torch.device("cpu"), 0.01, 0) > 0
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        kv_cache_bytes_for_utilization(torch.device("cpu"), 1e-6, 1 << 30)
    llm = LLM(str(get_model_path("llama-gqa")), max_model_len=64, gpu_memory_utilization=0.001)
    engine = llm.llm_engine
    spec = engine.runner.kv_cache_spec()
    assert engine.num_blocks * spec.bytes_per_block <= 0.001 * 24 * 2**30 + spec.bytes_per_block


def test_compatibility_doc_matches_the_settings() -> None:
    """docs/vllm_compatibility.md carries the table generated from EngineArgs, unchanged."""
    from pathlib import Path

    from pagedserve.engine_args import compatibility_table

    doc = (Path(__file__).parents[2] / "docs" / "vllm_compatibility.md").read_text()
    block = doc.split("<!-- generated: engine settings -->\n", 1)[1].split("<!-- end generated -->", 1)[0]
    assert block == compatibility_table(), "regenerate with: python -m pagedserve.engine_args"
