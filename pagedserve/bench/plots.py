"""PNG figures of the benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"token_states": "#4c72b0", "reserved": "#55a868", "internal": "#dd8452", "external": "#c44e52"}
_NAMES = {"token_states": "token states", "reserved": "reserved", "internal": "internal frag.",
          "external": "external frag."}


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the benchmark figures need matplotlib: pip install 'pagedserve[bench]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: str | Path, name: str) -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_memory(data: dict[str, Any], out_dir: str | Path) -> Path:
    """Stacked bars: share of KV memory per category, one bar per allocation scheme."""
    plt = pyplot()
    results = data["results"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [r["label"] for r in results]
    bottom = [0.0] * len(results)
    for cat in _COLORS:
        values = [100 * r["memory"]["shares"][cat] for r in results]
        ax.bar(labels, values, bottom=bottom, color=_COLORS[cat], label=_NAMES[cat])
        for i, v in enumerate(values):
            if v >= 6:
                ax.text(i, bottom[i] + v / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8, color="white")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("% of KV memory in use or unusable")
    ax.set_ylim(0, 100)
    ax.set_title("KV cache memory breakdown (ShareGPT-like trace)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right", fontsize=8)
    return save_figure(fig, out_dir, "memory_breakdown.png")


def _series(results: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """label -> (rates, values) for finite rates, sorted by rate."""
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for r in sorted(results, key=lambda r: r["request_rate"]):
        rate = r["request_rate"]
        if isinstance(rate, str) or rate == float("inf"):
            continue
        xs, ys = lines.setdefault(r["label"], ([], []))
        xs.append(rate)
        ys.append(_get(r, key))
    return lines


def _get(result: dict, key: str) -> float:
    value: Any = result
    for part in key.split("."):
        value = value[part]
    return float(value)


def plot_online(data: dict[str, Any], out_dir: str | Path, name: str) -> Path:
    """Normalized latency (paper Fig. 12) and mean batched requests (Fig. 13) vs request rate."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, (xs, ys) in _series(data["results"], "normalized_latency_s").items():
        ax1.plot(xs, [1000 * y for y in ys], marker="o", label=label)
    for label, (xs, ys) in _series(data["results"], "mean_batched_requests").items():
        ax2.plot(xs, ys, marker="o", label=label)
    workload = data["settings"]["workload"]
    ax1.set(xlabel="request rate (req/s)", ylabel="normalized latency (ms/token)", yscale="log",
            title=f"{workload}: latency vs load")
    ax2.set(xlabel="request rate (req/s)", ylabel="mean batched requests", title=f"{workload}: batch size")
    _plain_log_ticks(ax1)
    ax1.legend(fontsize=8)
    return save_figure(fig, out_dir, f"{name}.png")


def _plain_log_ticks(ax: Any) -> None:
    # Log scale for latencies that span decades, but ticks read as plain numbers (1, 2, 5, 10...).
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_batching(data: dict[str, Any], out_dir: str | Path, name: str) -> Path:
    """Throughput and TTFT / TPOT / E2E (means) vs request rate, one line per policy."""
    plt = pyplot()
    panels = [("output_throughput", "output tok/s", 1.0), ("ttft_ms.mean", "mean TTFT (ms)", 1.0),
              ("tpot_ms.mean", "mean TPOT (ms)", 1.0), ("e2e_ms.mean", "mean E2E latency (s)", 1e-3)]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (key, ylabel, scale) in zip(axes, panels, strict=True):
        for label, (xs, ys) in _series(data["results"], key).items():
            ax.plot(xs, [scale * y for y in ys], marker="o", label=label)
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Batching policies, {data['settings']['workload']}")
    return save_figure(fig, out_dir, f"{name}.png")


def plot_sweep(data: dict[str, Any], out_dir: str | Path, name: str = "sweep") -> Path:
    """One row per swept axis: speed and latencies, then the KV footprint, against the axis value."""
    plt = pyplot()
    axes_data = data["axes"]
    panels = [("output_throughput", "output tok/s", 1.0), ("ttft_ms.mean", "mean TTFT (ms)", 1.0),
              ("tpot_ms.mean", "mean TPOT (ms)", 1.0), ("e2e_ms.mean", "mean E2E (ms)", 1.0),
              ("peak_kv_mib", "peak KV memory (MiB)", 1.0), ("token_state_share", "KV slots holding tokens (%)", 100.0)]
    fig, grid = plt.subplots(len(axes_data), len(panels), figsize=(20, 3.0 * len(axes_data)), squeeze=False)
    for row, (axis, points) in zip(grid, axes_data.items(), strict=True):
        ok = [p for p in points if "error" not in p]
        xs = [str(p["value"]) for p in ok]
        categorical = any(isinstance(p["value"], str) for p in ok)
        for ax, (key, ylabel, scale) in zip(row, panels, strict=True):
            ys = [scale * _get(p, key) for p in ok]
            if categorical:
                ax.bar(xs, ys, color="#4c72b0")
            else:
                ax.plot(xs, ys, marker="o")
            ax.set(xlabel=axis, ylabel=ylabel)
            if key == "token_state_share":
                ax.set_ylim(0, 105)  # a share: keep the scale honest
    fig.suptitle(f"Sweeps on {data['settings']['model']}")
    return save_figure(fig, out_dir, f"{name}.png")


def plot_sharing(data: dict[str, Any], out_dir: str | Path, name: str = "sharing") -> Path:
    """Bars: KV memory saved by block sharing, per parallel-sampling / beam-search mode."""
    plt = pyplot()
    ok = [r for r in data["results"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["#4c72b0" if r["mode"].startswith("n=") else "#dd8452" for r in ok]
    ax.bar([r["mode"] for r in ok], [100 * r["memory_saving"] for r in ok], color=colors)
    ax.set(ylabel="KV memory saved by sharing (%)", title="Block sharing: parallel sampling (blue), beam search")
    return save_figure(fig, out_dir, f"{name}.png")


def plot_lora(data: dict[str, Any], out_dir: str | Path, name: str = "lora") -> Path:
    """Capacity and normalized latency against the number of distinct adapters."""
    plt = pyplot()
    results = data["results"]
    labels = [str(r["num_adapters"] or "base") for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.bar(labels, [r["capacity_req_s"] for r in results], color="#4c72b0")
    ax1.set(xlabel="distinct adapters", ylabel="capacity (req/s, all queued)")
    ax2.bar(labels, [1000 * r["online"]["normalized_latency_s"] for r in results], color="#dd8452")
    ax2.set(xlabel="distinct adapters", ylabel="normalized latency (ms/token)",
            title=f"Poisson at {data['settings']['rate_fraction']} x base capacity")
    fig.suptitle(f"Multi-LoRA serving ({data['settings']['max_loras']} adapters resident at most)")
    return save_figure(fig, out_dir, f"{name}.png")
