"""`pagedserve bench report --models ...` (issue #39) on two tiny random models with minimal
cells: the report's shape (every table, plot and cell), and a rerun that skips done cells.
No timing is asserted: the numbers are whatever this machine gives."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.cells import Cell, CellStore
from pagedserve.bench.cli import parse_bench_args, run_bench
from pagedserve.bench.study import PARTS, plan, settings_from_args

MODELS = ["llama-gqa", "qwen2"]
ARGS = ["report", "--models", ",".join(MODELS), "--quick", "--no-progress", "--num-requests", "6",
        "--rate-fractions", "0.5,1,1.5", "--batch-sizes", "1,2", "--context-lens", "16,4096",
        "--quant-levels", "native,int8", "--lora-counts", "2", "--lora-ranks", "8"]
TABLE_HEADERS = {"info": "| model | weights |", "latency": "| model | load |", "batch": "| model | batch |",
                 "context": "| model | prompt tokens |", "quant": "| model | weights | output tok/s |",
                 "memory": "| model | KV bytes / token |", "lora": "| model | adapters | rank |",
                 "peer": "| model | server | load |"}
PLOTS = ["latency.png", "batch.png", "context.png", "quant.png", "memory.png", "lora.png"]


def _store(out, args) -> CellStore:
    """The cells as the study saved them (under its settings' fingerprint)."""
    return CellStore(out, settings_from_args(args, None).fingerprint())


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    args = parse_bench_args([*ARGS, "--out", str(out)])
    code = run_bench(args)
    return out, args, code


def test_report_has_every_table_plot_and_cell(study):
    out, args, code = study
    assert code == 0, "no cell failed (each cell asserts no KV-block leak before it returns)"
    report = (out / "report.md").read_text()
    for line in ("- CPU: ", "- Date: ", "- Commit: ", "- Command: `pagedserve bench report --models"):
        assert line in report
    for part, header in TABLE_HEADERS.items():
        assert header in report, f"the {part} table"
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000, name
        assert f"]({name})" in report
    cells = plan(MODELS, settings_from_args(args, None))
    assert {c.part for c in cells} == set(PARTS)
    store = _store(out, args)
    for cell in cells:
        record = store.load(cell)
        assert record is not None, f"cell {cell.name} saved"
        assert "error" not in record["result"], record["result"]
        assert f"| {cell.model} |" in report
    saved = json.loads((out / "study.json").read_text())
    assert len(saved["cells"]) == len(cells)


def test_cells_hold_what_the_tables_need(study):
    out, args, _ = study
    store = _store(out, args)
    latency = [store.load(Cell(m, "latency", f"rate={f:g}"))["result"] for m in MODELS for f in (0.5, 1, 1.5)]
    for r in latency:
        assert r["completed"] == 6 and r["request_rate"] > 0
        assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"]
        assert 0 < r["tpot_ms"]["median"] <= r["tpot_ms"]["p99"]
    too_long = store.load(Cell("llama-gqa", "context", "4096"))["result"]
    assert "beyond the model's context length (2048)" in too_long["skipped"]
    memory = store.load(Cell("qwen2", "memory", "paged"))["result"]
    assert memory["kv_bytes_per_token"] > 0 and 0 < memory["memory"]["shares"]["token_states"] <= 1
    lora = store.load(Cell("llama-gqa", "lora", "n=2,r=8"))["result"]
    assert lora["count"] == 2 and lora["disk_loads"] >= 2
    assert store.load(Cell("qwen2", "peer", "llama.cpp"))["result"]["available"] is False


def test_rerun_skips_done_cells_and_runs_missing_ones(study, capsys):
    out, args, _ = study
    store = _store(out, args)
    dropped = Cell("qwen2", "batch", "2")
    before = {c: store.path(c).stat().st_mtime_ns for c in plan(MODELS, settings_from_args(args, None))}
    store.path(dropped).unlink()
    capsys.readouterr()
    assert run_bench(parse_bench_args([*ARGS, "--out", str(out)])) == 0
    assert "[study] 1 cells run" in capsys.readouterr().out
    after = {c: store.path(c).stat().st_mtime_ns for c in before}
    assert [c for c in before if after[c] != before[c]] == [dropped]


def test_a_cell_saved_under_other_settings_is_measured_again(tmp_path):
    cell = Cell("m", "batch", "4", {"batch": 4})
    CellStore(tmp_path, {"num_requests": 6}).save(cell, {"output_throughput": 1.0}, 0.1)
    assert CellStore(tmp_path, {"num_requests": 6}).load(cell)["result"] == {"output_throughput": 1.0}
    assert CellStore(tmp_path, {"num_requests": 8}).load(cell) is None


@pytest.mark.slow
def test_peer_cells_serve_the_latency_trace_over_http(tmp_path):
    """--peer-server-cmd, with `pagedserve serve` standing in for llama.cpp's server: both
    servers get the latency cells' requests at the same rates over HTTP."""
    from pagedserve.bench.peer import PAGEDSERVE_SERVER_CMD

    args = parse_bench_args(["report", "--models", "llama-gqa", "--quick", "--no-progress", "--num-requests", "4",
                             "--rate-fractions", "0.5", "--parts", "latency,peer", "--out", str(tmp_path),
                             "--peer-server-cmd", PAGEDSERVE_SERVER_CMD])
    assert run_bench(args) == 0
    store = _store(tmp_path, args)
    latency = store.load(Cell("llama-gqa", "latency", "rate=0.5"))["result"]
    served = [store.load(Cell("llama-gqa", "peer", f"{server} rate=0.5"))["result"]
              for server in ("pagedserve", "llama.cpp")]
    for r in served:
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["request_rate"] == pytest.approx(latency["request_rate"])
        assert 0 < r["ttft_ms"]["median"] <= r["e2e_ms"]["median"]
    assert served[0]["total_output_tokens"] == served[1]["total_output_tokens"] > 4, "the same requests"
    assert (tmp_path / "peer.png").stat().st_size > 1000
    assert "| llama-gqa | llama.cpp | 0.5 x C |" in (tmp_path / "report.md").read_text()
