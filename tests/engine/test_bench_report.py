"""`pagedserve bench report --models ...` (issue #39) on two tiny random models with minimal
cells: the report's shape (every table, plot and cell), and a rerun that skips done cells.
No timing is asserted: the numbers are whatever this machine gives."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.cells import Cell, CellStore
from pagedserve.bench.cli import parse_bench_args, run_bench
from pagedserve.bench.common import EngineSpec, make_engine
from pagedserve.bench.study import PARTS, _pool_tokens, plan, settings_from_args, study_store
from pagedserve.cpp_build import cpu_description

MODELS = ["llama-gqa", "qwen2"]
ARGS = ["report", "--models", ",".join(MODELS), "--quick", "--no-progress", "--num-requests", "6",
        "--rate-fractions", "0.5,1,1.5", "--batch-sizes", "1,2", "--context-lens", "16,4096",
        "--quant-levels", "native,int8", "--lora-counts", "1,2", "--lora-ranks", "8", "--lora-quant", "native,int8"]
TABLE_HEADERS = {"info": "| model | weights |", "latency": "| model | load |", "batch": "| model | batch |",
                 "context": "| model | prompt tokens |", "quant": "| model | weights | output tok/s |",
                 "memory": "| model | KV bytes / token |", "lora": "| model | adapters | rank |",
                 "peer": "| model | server | load |",
                 # the LoRA section's further tables (issue #39.4)
                 "lora quant": "| model | base weights | adapters | rank |",
                 "lora load": "| model | rank | adapter MiB (fp32) | KV blocks | disk -> host (ms) | host -> KV pool (ms) |",
                 "lora per request": "| model | requests on | requests |",
                 "lora vs merged / one at a time": "| model | serving | base weights | adapters |"}
PLOTS = ["latency.png", "batch.png", "context.png", "quant.png", "memory.png", "lora.png", "lora_quant.png",
         "lora_switch.png"]


def _store(out, args) -> CellStore:
    """The cells as the study saved them (under its settings' fingerprint)."""
    return study_store(out, settings_from_args(args, None))


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
    assert f"- CPU: {cpu_description()}\n" in report, "the CPU's model and ISA (issue #39.5)"
    sections = report.split("\n## ")[1:]
    for section in sections:  # each figure's command: its section's (issue #39.5)
        if "![" in section:
            command = section.index("Command: `pagedserve bench report --models")
            assert command < section.index("!["), section.splitlines()[0]
    for part, header in TABLE_HEADERS.items():
        assert header in report, f"the {part} table"
    for row in ("| llama-gqa | int8 | 2 | 8 |", "| qwen2 | a different adapter each |", "| qwen2 | one adapter |",
                "| llama-gqa | one adapter at a time | native | 2 |", "| qwen2 | merged weights | native | 1 |",
                "| qwen2 | merged weights | int8 | 1 | no merged-weights serving on this base"):
        assert row in report
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
    assert lora["count"] == 2 and lora["disk_loads"] + 1 >= 2, "adapter 1 may stay from the n=1 cell"
    int8 = store.load(Cell("qwen2", "lora", "n=2,r=8 q=int8"))["result"]
    assert int8["quantization"] == "int8" and int8["completed"] == 6
    load = store.load(Cell("qwen2", "lora", "load r=8"))["result"]
    assert load["adapters"] == 4 and load["kv_blocks"] > 0 and load["adapter_mib_fp32"] > 0
    assert min(load["disk_to_host_all_ms"]) > 0 and min(load["host_to_pool_all_ms"]) > 0
    for on in ("one", "distinct"):
        per_request = store.load(Cell("qwen2", "lora", f"per-request {on}"))["result"]
        assert per_request["completed"] == 6 and per_request["disk_loads"] == 0, "resident before the run"
    serial = store.load(Cell("llama-gqa", "lora", "one-at-a-time n=2,r=8"))["result"]
    assert serial["groups"] == 2 and serial["completed"] == 6
    assert serial["ttft_ms"]["p99"] > serial["ttft_ms"]["median"], "the second group waits for the first"
    assert store.load(Cell("llama-gqa", "lora", "merged"))["result"]["completed"] == 6
    assert "cannot be changed in place" in store.load(Cell("llama-gqa", "lora", "merged q=int8"))["result"]["skipped"]
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
    servers get the latency cells' requests at the same rates over HTTP, and the batch and
    context cells' requests, which the batch and context figures draw beside the in-process
    engine's."""
    from pagedserve.bench.peer import PAGEDSERVE_SERVER_CMD

    args = parse_bench_args(["report", "--models", "llama-gqa", "--quick", "--no-progress", "--num-requests", "4",
                             "--rate-fractions", "0.5", "--peer-rate-fractions", "0.5", "--batch-sizes", "1,3",
                             "--peer-batch-sizes", "1,3", "--context-lens", "16,4096", "--peer-context-lens", "16,4096",
                             "--parts", "latency,batch,context,peer",
                             "--out", str(tmp_path), "--peer-server-cmd", PAGEDSERVE_SERVER_CMD])
    assert run_bench(args) == 0
    store = _store(tmp_path, args)
    report = (tmp_path / "report.md").read_text()
    cells = [c for c in plan(["llama-gqa"], settings_from_args(args, None)) if c.part == "peer"]
    assert [c.params["server"] for c in cells] == ["pagedserve"] * 5 + ["llama.cpp"] * 5, "a server's cells together"
    for server in ("pagedserve", "llama.cpp"):
        batch = store.load(Cell("llama-gqa", "peer", f"{server} batch=3"))["result"]
        assert batch["completed"] == 3 and batch["total_output_tokens"] == 3 * 32
        context = store.load(Cell("llama-gqa", "peer", f"{server} context=16"))["result"]
        assert context["completed"] == 1 and context["prompt_tokens"] == 16
        assert f"| llama-gqa | {server} | batch 3 (all queued) |" in report
        assert f"| llama-gqa | {server} | one prompt of 16 |" in report
    assert (tmp_path / "batch.png").stat().st_size > 1000 and (tmp_path / "context.png").stat().st_size > 1000
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


def test_merge_adapter_gives_peft_merged_weights():
    """bench.lora.merge_adapter (the merged-weights cells) against PEFT's merge_and_unload on
    the same adapter; merging with sign -1 gives the base weights back."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pagedserve.bench.common import EngineSpec, make_engine
    from pagedserve.bench.lora import build_adapters, merge_adapter
    from pagedserve.bench.study import LORA_TARGETS
    from pagedserve.demo_models import get_model_path
    from pagedserve.lora.layers import LoRALinear
    from pagedserve.lora.peft_loader import PARENT_MODULE, TARGETABLE

    path = str(get_model_path("llama-gqa"))
    engine = make_engine(EngineSpec(path, max_model_len=128, kv_tokens=512, max_num_seqs=4, max_loras=2))
    adapter = build_adapters(path, 1, 8, LORA_TARGETS, 3, engine.runner.hf_config, first_id=77)[0]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, adapter.lora_path).merge_and_unload().state_dict()

    def compare(expected: dict) -> int:
        checked = 0
        for wrapper in engine.runner.model.modules():
            if isinstance(wrapper, LoRALinear):
                weight = wrapper.base.weight if getattr(wrapper.base, "weight", None) is not None \
                    else wrapper.base.packed_weight.to_dense()
                for module, start, end in wrapper.slices:
                    name = TARGETABLE[module]
                    want = expected[f"model.layers.{wrapper.layer_idx}.{PARENT_MODULE[name]}.{name}.weight"]
                    torch.testing.assert_close(weight[start:end], want, rtol=1e-5, atol=1e-6)
                    checked += 1
        return checked

    merge_adapter(engine, adapter)
    assert compare(merged) >= 4 * engine.runner.hf_config.num_hidden_layers
    merge_adapter(engine, adapter, -1.0)
    compare(original)
    engine.assert_no_leaks()


def test_a_windowed_model_runs_its_cells(tmp_path):
    """Gemma 3's 5 windowed : 1 full layers page their KV in 6 groups, each needing its own
    blocks: the study's pools are as many bytes as for any model (6x the blocks, of one layer
    each), so the info and memory cells run (they failed with "cannot hold one sequence")."""
    import torch
    from transformers import AutoModelForCausalLM
    from windowed_configs import CONFIGS as WINDOWED

    model_dir = tmp_path / "gemma3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(WINDOWED["gemma3"]).save_pretrained(model_dir)
    out = tmp_path / "study"
    args = parse_bench_args(["report", "--models", str(model_dir), "--quick", "--no-progress", "--num-requests", "4",
                             "--parts", "memory", "--out", str(out)])
    assert run_bench(args) == 0
    store = _store(out, args)
    info = store.load(Cell(str(model_dir), "info", "model"))["result"]
    assert info["kv_groups"] == 6
    # A pool of exactly one longest sequence's tokens holds that sequence (null block included).
    engine = make_engine(EngineSpec(str(model_dir), max_model_len=256, kv_tokens=_pool_tokens(info, 256)))
    engine.assert_no_leaks()
    memory = store.load(Cell(str(model_dir), "memory", "paged"))["result"]
    assert memory["completed"] == 4 and memory["sliding_window"] == WINDOWED["gemma3"].sliding_window
    assert 0 < memory["memory"]["shares"]["token_states"] <= 1
    # One 8k-token sequence: 5 windowed groups keep ~window / block + 1 blocks each (16 / 16 + 1).
    blocks, page = 8192 // 16, memory["kv_bytes_8k_every_block"] // (6 * 8192 // 16)
    assert memory["kv_bytes_8k_held"] == (blocks + 5 * 2) * page


def test_a_context_cell_at_the_model_limit_fits_its_output():
    from pagedserve.bench.study import _context_prompt

    assert _context_prompt(4096, 16, 8192) == 4096
    assert _context_prompt(8192, 16, 8192) == 8176, "SmolLM2's 8k cell: its whole context"
    assert _context_prompt(16384, 16, 8192) is None


def test_a_lora_model_outside_the_models_is_refused():
    args = parse_bench_args([*ARGS, "--out", "unused", "--lora-models", "qwen3"])
    with pytest.raises(ValueError, match="--lora-models: qwen3 not among --models"):
        plan(MODELS, settings_from_args(args, None))


def test_a_peer_server_that_logs_more_than_a_pipe_holds_is_not_blocked(tmp_path):
    """llama-server logs every request to stderr; a pipe nobody read (64 KiB) once filled during
    the study and the server blocked in its next write, every stream left open."""
    import sys
    import threading

    from pagedserve.bench.peer import Server

    script = tmp_path / "server.py"
    script.write_text(
        "import http.server, sys\n"
        "sys.stderr.write('x' * 300_000 + 'end of log')\n"
        "sys.stderr.flush()\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    started: list[Server] = []
    worker = threading.Thread(target=lambda: started.append(Server(f"{sys.executable} {script} {{port}}", "-")),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert started, "the server never answered /health: blocked writing its log"
    try:
        assert started[0].log_tail().count("end of log") == 1
    finally:
        started[0].close()
