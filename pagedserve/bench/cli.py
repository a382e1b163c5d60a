"""`pagedserve bench <subcommand>`: the benchmark suite's one entry point.

Only argparse is imported here: `pagedserve --help` must stay cheap. Each subcommand's
module (imported when it runs) has `add_arguments(parser)` and `run(args) -> exit code`,
and writes <out-dir>/<name>.json and <name>.md (and a PNG where a figure helps).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from pagedserve.bench.common import DEFAULT_THREADS

# subcommand -> (module under pagedserve.bench, one-line help)
SUBCOMMANDS = {
    "throughput": ("throughput", "offline throughput per KV allocation scheme / batching policy"),
    "serve": ("online", "latency and throughput vs request rate (simulated clock, or --base-url)"),
    "memory": ("memory", "KV memory breakdown: token states vs reservation vs fragmentation"),
    "sharing": ("sharing", "KV memory saved by sharing blocks (parallel sampling, beam search)"),
    "lora": ("lora", "multi-LoRA serving"),
    "sweep": ("sweep", "batch size, context length, dtype and block size sweeps (125M model)"),
    "report": ("report", "run everything and write docs/benchmarks (figures, tables, how to read them); "
                         "with --models: the per-model study (latency, batch, context, quantization, KV, LoRA)"),
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output and run")
    group.add_argument("--out-dir", "--out", default="docs/benchmarks", help="where JSON, Markdown and PNG files go")
    group.add_argument("--name", default=None, help="output file stem (default: the benchmark's)")
    group.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    group.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                       help="torch intra-op threads (default 1: the budget machine is a shared 2-core box)")
    group.add_argument("--quick", action="store_true", help="a small, fast version (smoke test)")
    group.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Registers `bench` and its subcommands on the `pagedserve` command's subparsers."""
    parser = sub.add_parser("bench", help="benchmarks: throughput, serving, memory, sweeps, report",
                            description="Benchmarks of pagedserve against its own baselines.")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        child = bench_sub.add_parser(name, help=help_text, description=help_text)
        _module(module).add_arguments(child)
        add_common_arguments(child)
    return parser


def _module(name: str) -> Any:
    # The modules import torch only inside their functions, so this stays cheap.
    return importlib.import_module(f"pagedserve.bench.{name}")


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) is None:
        print("usage: pagedserve bench {" + ",".join(SUBCOMMANDS) + "} [options]  (see --help)")
        return 2
    return int(_module(SUBCOMMANDS[args.bench_command][0]).run(args))


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """`pagedserve bench` arguments (argv without the leading "bench")."""
    top = argparse.ArgumentParser(prog="pagedserve")
    add_bench_parser(top.add_subparsers(dest="command"))
    return top.parse_args(["bench", *argv])


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.bench.cli ...` = `pagedserve bench ...`."""
    return run_bench(parse_bench_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
