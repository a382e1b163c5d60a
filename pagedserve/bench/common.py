"""What every `pagedserve bench` subcommand shares: engines, workloads, threads, output files."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.bench.sim import SimClock, run_simulated
from pagedserve.bench.workloads import (
    WARM_UP,
    WORKLOADS,
    WorkloadRequest,
    fit_to_context,
    fixed,
    from_sharegpt_json,
    synthetic,
)

# The 2-core machine these benchmarks were budgeted on is shared: with 2 OpenMP threads a
# tiny-model step took 84 ms under load against 4.2 ms with 1 (spin-waiting threads lose
# their core). One thread is the default; pass --threads to change it.
DEFAULT_THREADS = 1


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration of a benchmark (the knobs the benchmarks vary)."""

    model: str
    kv_allocation: str = "paged"
    batching: str = "continuous"
    block_size: int = 16
    kv_tokens: int = 16384
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    batch_window_s: float = 0.05
    dtype: str = "float32"
    quantization: str | None = None
    # LoRA serving: adapters resident at once (0 = LoRA off) and the largest rank.
    max_loras: int = 0
    max_lora_rank: int = 64

    @property
    def alloc_label(self) -> str:
        return f"paged (block {self.block_size})" if self.kv_allocation == "paged" else self.kv_allocation

    @property
    def label(self) -> str:
        return self.alloc_label if self.batching == "continuous" else f"{self.alloc_label}, {self.batching}"


def make_engine(spec: EngineSpec) -> Any:
    """An `LLMEngine` for `spec`, with `spec.kv_tokens` KV slots whatever the allocation.

    Prefix caching is off (contiguous allocation has none; synthetic prompts share nothing)
    and preemption recomputes, so that allocation is the only difference between runs.
    """
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine_args import EngineArgs

    kwargs: dict[str, Any] = dict(
        block_size=spec.block_size,
        num_gpu_blocks_override=max(1, spec.kv_tokens // spec.block_size),
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        dtype=spec.dtype,
        kv_allocation=spec.kv_allocation,
        batching=spec.batching,
        batch_window_s=spec.batch_window_s,
        preemption_mode="recompute",
    )
    if spec.quantization is not None:
        kwargs["quantization"] = spec.quantization
    if spec.max_loras:
        kwargs.update(enable_lora=True, max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank)
    # The simulated-time driver (bench/sim.py) moves this clock; nothing else does.
    return LLMEngine(EngineArgs(model=spec.model, **kwargs).create_engine_config(), clock=SimClock())


def llm_accepts(name: str) -> bool:
    """Whether `LLM(...)` takes this keyword (features other engineers are adding)."""
    from pagedserve.engine_args import engine_setting_names

    return name in engine_setting_names()


def resolve_model_path(model: str) -> str:
    """A folder or file as given, a demo model built on first use ("llama-gqa", "bench-125m",
    ...), or a catalog name ("smollm2-135m-instruct", ...) pulled on first use."""
    from pagedserve.demo_models import get_model_path, model_names
    from pagedserve.models.catalog import CATALOG, ensure

    if Path(model).exists():
        return model
    if model in model_names():
        return str(get_model_path(model))
    if model in CATALOG:
        return str(ensure(model))
    return model


def vocab_size(model_path: str) -> int:
    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


def load_requests(
    workload: str, num_requests: int, model_path: str, max_model_len: int, seed: int = 0,
    dataset: str | None = None, prompt_len: int = 128, output_len: int = 128,
) -> list[WorkloadRequest]:
    """Requests from a ShareGPT-format file (`dataset`), else the seeded generators:
    "sharegpt" / "alpaca" (length distributions of those traces) or "random" (fixed lengths)."""
    if dataset is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        requests = from_sharegpt_json(dataset, tokenizer, num_requests, seed)
    elif workload == "random":
        requests = fixed(num_requests, prompt_len, output_len, vocab_size(model_path), seed)
    else:
        requests = synthetic(workload, num_requests, vocab_size(model_path), seed)
    return fit_to_context(requests, max_model_len)


def add_workload_args(parser: argparse.ArgumentParser, workload: str = "sharegpt", num_requests: int = 200) -> None:
    """The flags every trace-driven subcommand shares: model, workload, KV memory, context.

    `requests_from_args` turns them into requests; the defaults differ per subcommand only in
    the workload (short Alpaca-like requests where many sequences per prompt are the point)
    and the number of requests.
    """
    parser.add_argument("--model", default="llama-gqa", help="model folder or demo model name")
    parser.add_argument("--workload", default=workload, choices=[*WORKLOADS, "random"],
                        help="synthetic lengths like ShareGPT / Alpaca, or fixed (random)")
    parser.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic lengths)")
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--prompt-len", type=int, default=128, help="--workload random: prompt length")
    parser.add_argument("--output-len", type=int, default=128, help="--workload random: output length")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV memory in token slots (all configs)")
    parser.add_argument("--max-model-len", type=int, default=2048)


def requests_from_args(args: argparse.Namespace, model_path: str) -> list[WorkloadRequest]:
    """The requests `add_workload_args`' flags describe."""
    return load_requests(args.workload, args.num_requests, model_path, args.max_model_len, args.seed,
                         args.dataset, args.prompt_len, args.output_len)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Runs the block with `num_threads` intra-op threads, then restores the previous count."""
    import torch

    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def warm_up(engine: Any) -> None:
    """One short request, so first-call costs (allocations, kernel selection) stay out of timings.

    Driven like a trace (`run_simulated`): the engine's clock is simulated, so a batching
    baseline's window only passes, and its queue only closes, when the driver says so.
    """
    run_simulated(engine, [WARM_UP], [0.0], id_prefix="warmup-")


def progress(total: int, desc: str, enabled: bool, leave: bool = False) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=leave, dynamic_ncols=True)


def json_clean(value: Any) -> Any:
    # JSON has no inf or nan: write them as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_clean(v) for v in value]
    return value


def write_outputs(out_dir: str | Path, name: str, data: dict[str, Any], markdown: str) -> list[Path]:
    """Writes `name`.json (data, with a header) and `name`.md; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"), **data}
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(json_clean(data), indent=2) + "\n")
    paths[1].write_text(markdown.rstrip() + "\n")
    return paths


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; floats get 3 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_list(text: str, kind: type = str) -> list[Any]:
    """'a,b,c' -> ['a', 'b', 'c'] (converted by `kind`); 'inf' works for floats."""
    return [kind(item.strip()) for item in text.split(",") if item.strip()]
