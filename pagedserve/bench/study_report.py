"""The per-model study's report: one Markdown page, one table and one PNG per part, one
line (or bar) per model, from the cells `study.py` saved. Reads nothing but the records.

A cell that failed or was skipped stays a row, with its reason, so every planned cell is
accounted for in the page; plots draw the cells that have numbers.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.bench.cells import Cell, format_duration
from pagedserve.bench.common import json_clean, md_table
from pagedserve.bench.plots import pyplot, save_figure

Records = dict[Cell, dict[str, Any]]

SECTIONS = {  # part -> (title, plot file or "", how to read it)
    "info": ("Models", "", "What was loaded: the weights as served, and the KV cache's cost per token."),
    "latency": ("Latency under Poisson arrivals", "latency.png",
                "Requests with Alpaca-like lengths arrive as a Poisson process at fractions of the model's "
                "capacity C (every request queued at once). p50 above, p99 below, log scale; a p99 turning up is the "
                "queue starting to grow, the model's saturation. Simulated clock advanced by a step-time "
                "model fitted to the model's measured steps (bench/clock.py)."),
    "batch": ("Throughput against batch size", "batch.png",
              "B requests of the same length queued at once (B = batch size): output tokens per second, "
              "log scales. Solid with dots: the engine in process (simulated clock); with "
              "--peer-server-cmd also the same requests over HTTP on the wall clock, `pagedserve serve` "
              "dotted and the peer dashed with hollow markers (their rows: the peer section's table)."),
    "context": ("Prefill and decode against context length", "context.png",
                "One request of prompt length L: TTFT is the prefill of L tokens, TPOT a decode step "
                "attending L tokens. Lengths past the model's limit are skipped. Lines as in the batch "
                "figure: in process, and with --peer-server-cmd both servers over HTTP."),
    "quant": ("Throughput against weight format", "quant.png",
              "The same requests with the model's weights as in its file (native), requantized to int8 / "
              "int4, or dequantized to bf16 / fp32. No peer line: llama.cpp serves a GGUF file's own "
              "types, and the other levels would be other files (made with llama-quantize); its point "
              "at native is the batch figure's peer line at the same number of requests."),
    "memory": ("KV memory: bytes per token and live share", "memory.png",
               "A ShareGPT-like trace (Alpaca-like with --quick) in a bounded paged KV pool: bytes of K/V per "
               "token, and how the pool's "
               "memory in use splits into live token states, slots reserved for the next tokens, and "
               "fragmentation (summed over steps; the vLLM paper's waste breakdown). The last two columns: "
               "the KV one 8192-token sequence holds once windowed layers have given their slid-out blocks "
               "back (Gemma's sliding-window saving), against keeping every block. No peer column: "
               "llama-server allocates its KV cache whole at start (--ctx-size tokens, shared by its "
               "slots), so its live share is simply the tokens in flight over that size, not a paged "
               "pool's breakdown."),
    "lora": ("Multi-LoRA: adapter count, rank, base quantization and switching overhead", "lora.png",
             "The same requests (all queued) spread over K random adapters (PEFT layout, q/k/v/o) of rank r; "
             "request i uses adapter i % K, at most 16 resident at once (more are evicted and reloaded). "
             "The figure: the model's own weights; `lora_quant.png`: the same at the first rank on each "
             "base quantization; `lora_switch.png`: switching overhead and the two alternatives to "
             "heterogeneous batching (tables below). No peer: llama-server takes LoRA adapters as GGUF "
             "files converted from PEFT (convert_lora_to_gguf.py), listed at start; switching among "
             "256 of them is not something it is built for, and this study does not convert them."),
    "peer": ("Beside a peer: pagedserve and llama.cpp over HTTP", "peer.png",
             "`pagedserve serve` and the peer server (--peer-server-cmd: llama.cpp's llama-server on the same "
             "file) get the latency cells' requests at the same Poisson rates through the same streaming HTTP "
             "client (bench/loadgen.py), on the wall clock: p50 above, p99 below, one colour per model, "
             "pagedserve solid with dots, the peer dashed with hollow squares. The table also holds both "
             "servers' batch and context cells (drawn in those sections' figures). Without "
             "--peer-server-cmd the section says why there is no peer."),
}


def describe_run() -> dict[str, str]:
    """CPU, date and commit, for the report's header."""
    # cpp_build imports torch: imported here, so that `pagedserve --help` stays cheap.
    from pagedserve.cpp_build import cpu_description

    root = Path(__file__).resolve().parents[2]

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return {"cpu": cpu_description(), "date": datetime.date.today().isoformat(), "commit": commit}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def write_study_report(out_dir: Path, models: list[str], records: Records, parts: tuple[str, ...],
                       command: str, part_commands: dict[str, str], run: dict[str, str]) -> Path:
    """report.md, a PNG per part and study.json (every record) in `out_dir`; returns report.md.
    `part_commands[part]` is the command that measures that part alone."""
    total = sum(r["seconds"] for r in records.values())
    lines = ["# pagedserve across models", "",
             f"- CPU: {run['cpu']}", f"- Date: {run['date']}", f"- Commit: {run['commit']}",
             f"- Command: `{command}`",
             f"- Duration: {format_duration(total)} of measurement over {len(records)} cells "
             "(resumed runs add up; each cell's time is in its JSON under cells/)", ""]
    for part in parts:
        title, figure, how = SECTIONS[part]
        rows = [(c, r["result"]) for c, r in records.items() if c.part == part]
        lines += [f"## {title}", "", how, "", f"Command: `{part_commands[part]}`", ""]
        # The batch and context figures also draw the peer part's HTTP cells of their kind.
        plotted = rows + [(c, r["result"]) for c, r in records.items()
                          if c.part == "peer" and part in PEER_DRAWN_IN and part in c.params]
        if figure and any(_ok(r) for _, r in rows):
            PLOTS[part](plotted, out_dir / figure)
            lines += [f"![{part}]({figure})", ""]
        for name, plot in EXTRA_PLOTS.get(part, []):
            if plot(rows, out_dir / name) is not None:
                lines += [f"![{name.removesuffix('.png')}]({name})", ""]
        lines += [TABLES[part](rows), ""]
    (out_dir / "study.json").write_text(json.dumps(json_clean(
        {"models": models, "run": run, "command": command, "cells": list(records.values())}), indent=1) + "\n")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _ok(result: dict[str, Any]) -> bool:
    return "error" not in result and "skipped" not in result and result.get("available", True)


def _not_run(result: dict[str, Any]) -> str:
    return str(result.get("error") or result.get("skipped") or result.get("reason") or "")


# Parts whose figure also draws the peer part's cells of their kind (cells with that parameter).
PEER_DRAWN_IN = ("batch", "context")


# ---- tables -------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[tuple[Cell, dict]], first: Callable[[Cell, dict], list],
           values: Callable[[dict], list] | None = None,
           cell_values: Callable[[Cell, dict], list] | None = None) -> str:
    """A row per cell: `first(cell, result)`, then `values(result)` (or `cell_values(cell,
    result)`), or the reason the cell has no numbers."""
    out = []
    for cell, r in rows:
        lead = first(cell, r)
        width = len(headers) - len(lead)
        if not _ok(r):
            out.append([*lead, _not_run(r), *[""] * (width - 1)])
        else:
            out.append([*lead, *(cell_values(cell, r) if cell_values else values(r) if values else [])])
    return md_table(headers, out)


def _info_table(rows: list[tuple[Cell, dict]]) -> str:
    return _table(["model", "weights", "architecture", "vocabulary", "context limit", "KV bytes / token",
                   "layers x KV heads x head dim"], rows, lambda c, r: [c.model],
                  lambda r: [r["weights"], r["architecture"], r["vocab_size"], r["max_position_embeddings"],
                             r["kv_bytes_per_token"], f"{r['num_layers']} x {r['num_kv_heads']} x {r['head_dim']}"])


def _latency_table(rows: list[tuple[Cell, dict]]) -> str:
    def load(c: Cell, r: dict) -> list:
        return [c.model, "capacity C (all queued)" if c.key == "capacity" else f"{c.params['fraction']:g} x C"]

    def values(r: dict) -> list:
        rate = r.get("request_rate", r.get("capacity_req_s"))
        return [rate, r["ttft_ms"]["median"], r["ttft_ms"]["p99"], r["tpot_ms"]["median"], r["tpot_ms"]["p99"],
                r["e2e_ms"]["median"] / 1000, r["e2e_ms"]["p99"] / 1000, r["output_throughput"]]

    return _table(["model", "load", *LATENCY_HEADERS], rows, load, values)


LATENCY_HEADERS = ["rate (req/s)", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)",
                   "E2E p50 (s)", "E2E p99 (s)", "output tok/s"]


def _peer_table(rows: list[tuple[Cell, dict]]) -> str:
    def lead(c: Cell, r: dict) -> list:
        p = c.params
        load = f"{p['fraction']:g} x C" if "fraction" in p else f"batch {p['batch']} (all queued)" if "batch" in p \
            else f"one prompt of {r.get('prompt_tokens', p['context'])}" if "context" in p else "-"
        return [c.model, p["server"], load]

    def values(r: dict) -> list:
        return [r["request_rate"], r["ttft_ms"]["median"], r["ttft_ms"]["p99"], r["tpot_ms"]["median"],
                r["tpot_ms"]["p99"], r["e2e_ms"]["median"] / 1000, r["e2e_ms"]["p99"] / 1000, r["output_throughput"]]

    return _table(["model", "server", "load", *LATENCY_HEADERS], rows, lead, values)


def _simple(headers: list[str], key: Callable[[Cell, dict], list], values: Callable[[dict], list]) -> Callable:
    return lambda rows: _table(headers, rows, key, values)


TABLES: dict[str, Callable[[list[tuple[Cell, dict]]], str]] = {
    "info": _info_table,
    "latency": _latency_table,
    "batch": _simple(["model", "batch", "output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "peak KV blocks"],
                     lambda c, r: [c.model, c.params["batch"]],
                     lambda r: [r["output_throughput"], r["ttft_ms"]["median"], r["tpot_ms"]["median"],
                                r["peak_blocks_used"]]),
    "context": _simple(["model", "prompt tokens", "TTFT (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)"],
                       lambda c, r: [c.model, r.get("prompt_tokens", c.params["context"])],
                       lambda r: [r["ttft_ms"]["median"], r["tpot_ms"]["median"], r["tpot_ms"]["p99"]]),
    "quant": _simple(["model", "weights", "output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"],
                     lambda c, r: [c.model, r.get("label", c.key)],
                     lambda r: [r["output_throughput"], r["ttft_ms"]["median"], r["tpot_ms"]["median"]]),
    "memory": _simple(["model", "KV bytes / token", "KV MiB / 1k tokens", "token states %", "reserved %",
                       "internal frag. %", "external frag. %", "mean batch", "sliding window",
                       "one 8k-token sequence holds (MiB)", "every block kept (MiB)"],
                      lambda c, r: [c.model],
                      lambda r: [r["kv_bytes_per_token"], r["kv_bytes_per_token"] * 1000 / 2**20,
                                 *(f"{100 * r['memory']['shares'][k]:.1f}"
                                   for k in ("token_states", "reserved", "internal", "external")),
                                 r["mean_batched_requests"], r["sliding_window"] or "none",
                                 *(_mib(r.get(k)) for k in ("kv_bytes_8k_held", "kv_bytes_8k_every_block"))]),
    "lora": lambda rows: _lora_tables(rows),
    "peer": _peer_table,
}


def _kind(cell: Cell) -> str:
    return str(cell.params.get("kind", "sweep"))


def _sweep_rows(rows: list[tuple[Cell, dict]], native: bool) -> list[tuple[Cell, dict]]:
    return [(c, r) for c, r in rows if _kind(c) == "sweep" and (c.params.get("quant", "native") == "native") == native]


def _quant_label(c: Cell, r: dict) -> str:
    q = str(c.params.get("quant", "native"))
    return f"native ({r['dtype'] if r.get('quantization') is None else r['quantization']})" \
        if q == "native" and "dtype" in r else q


def _lora_tables(rows: list[tuple[Cell, dict]]) -> str:
    """The LoRA section's tables: count x rank, base quantization, the two switching costs,
    and the two alternatives (merged weights, one adapter at a time), each beside the
    heterogeneous-batch cell it is compared with (same model, adapter count, base)."""
    hetero = {(c.model, c.params.get("quant", "native"), c.params["count"], str(c.params["rank"])): r
              for c, r in rows if _kind(c) == "sweep" and _ok(r)}

    def ratio(value: float, other: dict | None) -> str:
        return f"{value / other['output_throughput']:.2f}x" if other and other["output_throughput"] else "-"

    lead = ["model", "adapters", "rank"]
    perf = ["output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"]
    per_request = [(c, r) for c, r in rows if _kind(c) == "per-request"]
    one = {c.model: r for c, r in per_request if c.params["adapters"] == "one" and _ok(r)}
    return "\n\n".join([
        _table([*lead, *perf, "adapter loads (disk / device)"], _sweep_rows(rows, True),
               lambda c, r: [c.model, c.params["count"] or "base (LoRA off)", c.params["rank"]],
               lambda r: [*_perf(r), f"{r['disk_loads']} / {r['device_loads']}"]),
        "### Base quantization\n\nThe first rank's cells on each base: the file's own weights (a non-GGUF "
        "checkpoint: its dtype), int8, bf16; `vs LoRA off`: against the same base with LoRA off.\n\n"
        + _table(["model", "base weights", "adapters", "rank", *perf, "vs LoRA off"],
                 [(c, r) for c, r in rows if _kind(c) == "sweep"
                  and (c.params.get("quant", "native") != "native" or str(c.params["rank"]) in ("-", _first(rows)))],
                 lambda c, r: [c.model, _quant_label(c, r), c.params["count"] or "base (LoRA off)", c.params["rank"]],
                 cell_values=lambda c, r: [*_perf(r), ratio(r["output_throughput"], hetero.get(
                     (c.model, c.params.get("quant", "native"), 0, "-")))]),
        "### Switching overhead: loading an adapter\n\nPer rank, medians over fresh adapters: disk -> host "
        "(read and validate the PEFT folder; the file may sit in the OS page cache, as on a server that just "
        "wrote or read it) and host -> KV pool (allocate a run of KV blocks, write the weights in: S-LoRA's "
        "unified paging, pagedserve/lora/manager.py).\n\n"
        + _table(["model", "rank", "adapter MiB (fp32)", "KV blocks", "disk -> host (ms)", "host -> KV pool (ms)"],
                 [(c, r) for c, r in rows if _kind(c) == "load"], lambda c, r: [c.model, c.params["rank"]],
                 lambda r: [r["adapter_mib_fp32"], r["kv_blocks"], r["disk_to_host_ms"], r["host_to_pool_ms"]]),
        "### Switching overhead: per request\n\nThe same requests, all queued and their adapters resident "
        "before the run: each request on a different adapter (a segment per request in every step) vs all "
        "on one adapter.\n\n"
        + _table(["model", "requests on", "requests", *perf, "vs one adapter"], per_request,
                 lambda c, r: [c.model, "a different adapter each" if c.params["adapters"] == "distinct"
                               else "one adapter"],
                 cell_values=lambda c, r: [r["requests"], *_perf(r), ratio(r["output_throughput"], one.get(c.model))]),
        "### Against merged weights and one-adapter-at-a-time batching\n\nMerged: the n=1 cell's adapter "
        "merged into the base weights, served as a plain model (quantized bases cannot be merged in place: "
        "the row says so). One at a time: the K-adapter requests grouped so that a step only ever holds one "
        "adapter's requests, group after group (TTFT includes the groups before). `vs batched LoRA`: "
        "against the heterogeneous batch of the same adapters on the same base.\n\n"
        + _table(["model", "serving", "base weights", "adapters", *perf, "vs batched LoRA"],
                 [(c, r) for c, r in rows if _kind(c) in ("merged", "serial")],
                 lambda c, r: [c.model, "merged weights" if _kind(c) == "merged" else "one adapter at a time",
                               c.params.get("quant", "native"), c.params.get("count", 1)],
                 cell_values=lambda c, r: [*_perf(r), ratio(r["output_throughput"], hetero.get(
                     (c.model, c.params.get("quant", "native"), c.params.get("count", 1), str(c.params["rank"]))))]),
    ])


def _first(rows: list[tuple[Cell, dict]]) -> str:
    return next((str(c.params["rank"]) for c, _ in rows if c.params.get("count")), "8")


def _perf(r: dict) -> list:
    return [r["output_throughput"], r["ttft_ms"]["median"], r["tpot_ms"]["median"]]


# ---- plots: one line per model -------------------------------------------------------------


def _by_model(rows: list[tuple[Cell, dict]], x: Callable[[Cell, dict], Any], y: Callable[[dict], float],
              label: Callable[[Cell], str] = lambda c: c.model) -> dict[str, tuple[list, list]]:
    """label (default: the model) -> (xs, ys) of the cells that have numbers, in cell order."""
    series: dict[str, tuple[list, list]] = {}
    for cell, r in rows:
        if _ok(r):
            xs, ys = series.setdefault(label(cell), ([], []))
            xs.append(x(cell, r))
            ys.append(y(r))
    return series


def _server(cell: Cell) -> str:
    """Who served a cell: the in-process engine, or (peer cells) a server over HTTP."""
    return str(cell.params.get("server", "in-process"))


class _Styles:
    """One colour a model and, when `rows` come from more than one server, one line style and
    marker a server: the first solid with dots, the peer (llama.cpp) dashed with hollow squares
    (told apart even where it has a single point), any other dotted with diamonds. Series are
    labelled "model" or "model, server"."""

    def __init__(self, plt: Any, rows: list[tuple[Cell, dict]]) -> None:
        self.colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        self.models = list(dict.fromkeys(c.model for c, _ in rows))
        self.servers = list(dict.fromkeys(_server(c) for c, _ in rows))
        self.several = len(self.servers) > 1

    def label(self, cell: Cell) -> str:
        return f"{cell.model}, {_server(cell)}" if self.several else cell.model

    def plot(self, ax: Any, series: dict[str, tuple[list, list]]) -> None:
        for name, (xs, ys) in series.items():
            model, _, server = name.partition(", ")
            peer = server == "llama.cpp"
            first = not self.several or self.servers.index(server) == 0
            line, marker = ("--", "s") if peer else ("-", "o") if first else (":", "D")
            ax.plot(xs, ys, line, marker=marker, markerfacecolor="none" if peer else None,
                    color=self.colors[self.models.index(model) % len(self.colors)], label=name)


def _line_panels(rows: list[tuple[Cell, dict]], path: Path, xlabel: str, x: Callable[[Cell, dict], Any],
                 panels: list[tuple[str, Callable[[dict], float]]], log2x: bool = False, logy: bool = False) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    styles = _Styles(plt, rows)
    for ax, (ylabel, y) in zip(axes[0], panels, strict=True):
        styles.plot(ax, _by_model(rows, x, y, styles.label))
        ax.set(xlabel=xlabel, ylabel=ylabel)
        if log2x:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7 if styles.several else 8)
    return save_figure(fig, path.parent, path.name)


def _plot_latency(rows: list[tuple[Cell, dict]], path: Path) -> Path:
    """p50 (top row) and p99 (bottom) of TTFT, TPOT and E2E against the load as a fraction of
    each model's capacity (the models' rates differ 6x; their fractions line up). One colour a
    model; the peer part's rows: one line style a server."""
    plt = pyplot()
    rated = [(c, r) for c, r in rows if c.key != "capacity"]
    metrics = [("ttft_ms", "TTFT (ms)", 1.0), ("tpot_ms", "TPOT (ms)", 1.0), ("e2e_ms", "E2E latency (s)", 1e-3)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), squeeze=False)
    styles = _Styles(plt, rated)
    for row, pct in enumerate(("median", "p99")):
        for ax, (key, ylabel, scale) in zip(axes[row], metrics, strict=True):
            styles.plot(ax, _by_model(rated, lambda c, r: c.params["fraction"],
                                      partial(_percentile, key=key, pct=pct, scale=scale), styles.label))
            ax.set(xlabel="load (fraction of the model's capacity C)",
                   ylabel=f"{ylabel}, {'p50' if pct == 'median' else 'p99'}")
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path.parent, path.name)


def _percentile(r: dict, key: str, pct: str, scale: float) -> float:
    return scale * float(r[key][pct])


def _plot_bars(rows: list[tuple[Cell, dict]], path: Path, panels: list[tuple[str, Callable[[dict], float]]]) -> Path:
    plt = pyplot()
    ok = [(c, r) for c, r in rows if _ok(r)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (ylabel, y) in zip(axes[0], panels, strict=True):
        ax.bar([c.model for c, _ in ok], [y(r) for _, r in ok], color="#4c72b0")
        ax.set(ylabel=ylabel)
        plt.setp(ax.get_xticklabels(), rotation=15, ha="right", fontsize=8)
    return save_figure(fig, path.parent, path.name)


def _plot_lora(rows: list[tuple[Cell, dict]], path: Path) -> Path:
    """Against adapter count: a colour per model, a line style per rank, the base model dotted
    (the model's own weights: the other bases are lora_quant.png)."""
    rows = _sweep_rows(rows, native=True)
    return _plot_counts(rows, path, lambda c: f"rank {c.params['rank']}")


def _plot_lora_quant(rows: list[tuple[Cell, dict]], path: Path) -> Path | None:
    """Against adapter count at the first rank: a line style per base quantization."""
    first = _first(rows)
    rows = [(c, r) for c, r in rows if _kind(c) == "sweep"
            and (c.params.get("quant", "native") != "native" or str(c.params["rank"]) in ("-", first))]
    if len({c.params.get("quant", "native") for c, r in rows if _ok(r)}) < 2:
        return None  # one base only: lora.png has it all
    return _plot_counts(rows, path, lambda c: f"{c.params.get('quant', 'native')} base")


def _plot_counts(rows: list[tuple[Cell, dict]], path: Path, series: Callable[[Cell], str]) -> Path:
    """Output tok/s and TPOT against adapter count: a colour per model, a line style per
    `series(cell)`; a cell with no adapters (LoRA off) is a dotted level line of its series."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    models = list(dict.fromkeys(c.model for c, _ in rows))
    names = list(dict.fromkeys(series(c) for c, _ in rows if c.params["count"]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", "-.", ":"]
    panels: list[tuple[str, Callable[[dict], float]]] = [
        ("output tok/s", lambda r: r["output_throughput"]), ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["median"])]
    for ax, (ylabel, value) in zip(axes, panels, strict=True):
        for m, model in enumerate(models):
            color = colors[m % len(colors)]
            for i, name in enumerate(names):
                sub = [(c, r) for c, r in rows if c.model == model and series(c) == name and c.params["count"]]
                for xs, ys in _by_model(sub, lambda c, r: c.params["count"], value).values():
                    ax.plot(xs, ys, styles[i % len(styles)], marker="o", color=color, label=f"{model}, {name}")
            for c, r in rows:
                if c.model == model and not c.params["count"] and _ok(r):
                    own = series(c) in names  # a per-quant level: its series' line style, faint
                    style = styles[names.index(series(c)) % len(styles)] if own else ":"
                    ax.axhline(value(r), color=color, linestyle=style, linewidth=1, alpha=0.6 if own else 1.0,
                               label=f"{model}, {f'{series(c)}, LoRA off' if own else 'base'}")
        ax.set(xlabel="distinct adapters", ylabel=ylabel, xscale="log")
        counts = sorted({c.params["count"] for c, _ in rows if c.params["count"]})
        ax.set_xticks(counts, [str(k) for k in counts])  # the counts measured, not 2 x 10^0
        ax.minorticks_off()
    axes[0].legend(fontsize=7)
    return save_figure(fig, path.parent, path.name)


def _plot_lora_switch(rows: list[tuple[Cell, dict]], path: Path) -> Path | None:
    """Three bar panels: adapter load time per rank (disk -> host, host -> KV pool), TPOT of
    requests each on its own adapter vs all on one, and output tok/s of batched LoRA beside
    merged weights and one adapter at a time."""
    loads = [(c, r) for c, r in rows if _kind(c) == "load" and _ok(r)]
    per_request = [(c, r) for c, r in rows if _kind(c) == "per-request" and _ok(r)]
    hetero = {(c.model, c.params.get("quant", "native"), c.params["count"], str(c.params["rank"])): (c, r)
              for c, r in rows if _kind(c) == "sweep" and _ok(r)}
    against: list[tuple[str, float, str]] = []  # (label, tok/s, colour)
    for c, r in rows:
        if _kind(c) not in ("merged", "serial") or not _ok(r):
            continue
        quant, count = c.params.get("quant", "native"), c.params.get("count", 1)
        twin = hetero.get((c.model, quant, count, str(c.params["rank"])))
        tag = f"{c.model}\n{quant}, n={count}" if _kind(c) == "merged" else f"{c.model}\nn={count}"
        if twin:
            against.append((f"{tag}\nbatched", twin[1]["output_throughput"], "#4c72b0"))
        against.append((f"{tag}\n{'merged' if _kind(c) == 'merged' else 'one at a time'}", r["output_throughput"],
                        "#dd8452" if _kind(c) == "merged" else "#55a868"))
    if not (loads or per_request or against):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    labels = [f"{c.model}\nr={c.params['rank']}" for c, _ in loads]
    xs = range(len(loads))
    axes[0].bar([x - 0.2 for x in xs], [r["disk_to_host_ms"] for _, r in loads], 0.4, label="disk -> host")
    axes[0].bar([x + 0.2 for x in xs], [r["host_to_pool_ms"] for _, r in loads], 0.4, label="host -> KV pool")
    axes[0].set_xticks(list(xs), labels)
    axes[0].set(ylabel="ms per adapter (median)", yscale="log", title="loading an adapter")
    axes[0].legend(fontsize=7)
    axes[1].bar([f"{c.model}\n{c.params['adapters']}" for c, _ in per_request],
                [r["tpot_ms"]["median"] for _, r in per_request],
                color=["#c44e52" if c.params["adapters"] == "distinct" else "#4c72b0" for c, _ in per_request])
    axes[1].set(ylabel="TPOT p50 (ms)", title="requests on one adapter vs one each")
    axes[2].bar([a[0] for a in against], [a[1] for a in against], color=[a[2] for a in against])
    axes[2].set(ylabel="output tok/s", title="batched LoRA vs merged / one at a time")
    for ax in axes:
        plt.setp(ax.get_xticklabels(), fontsize=7)
    return save_figure(fig, path.parent, path.name)


PLOTS: dict[str, Callable[[list[tuple[Cell, dict]], Path], Path]] = {
    "latency": _plot_latency,
    "batch": lambda rows, path: _line_panels(
        rows, path, "batch size", lambda c, r: c.params["batch"],
        [("output tok/s", lambda r: r["output_throughput"]), ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["median"])],
        log2x=True, logy=True),
    "context": lambda rows, path: _line_panels(
        rows, path, "prompt tokens", lambda c, r: r.get("prompt_tokens", c.params["context"]),
        [("TTFT (ms)", lambda r: r["ttft_ms"]["median"]), ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["median"])],
        log2x=True, logy=True),
    "quant": lambda rows, path: _line_panels(
        rows, path, "weights", lambda c, r: c.key,
        [("output tok/s", lambda r: r["output_throughput"]), ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["median"])]),
    "memory": lambda rows, path: _plot_bars(
        rows, path, [("KV bytes per token", lambda r: r["kv_bytes_per_token"]),
                     ("live token states (% of KV in use)", lambda r: 100 * r["memory"]["shares"]["token_states"])]),
    "lora": _plot_lora,
    "peer": lambda rows, path: _plot_latency([(c, r) for c, r in rows if "fraction" in c.params], path),
}

# Further figures of a part's section (file, plot; a plot returns None when it has nothing to draw).
EXTRA_PLOTS: dict[str, list[tuple[str, Callable[[list[tuple[Cell, dict]], Path], Path | None]]]] = {
    "lora": [("lora_quant.png", _plot_lora_quant), ("lora_switch.png", _plot_lora_switch)],
}
