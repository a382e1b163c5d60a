"""Small, fast runs of every `pagedserve bench` subcommand on the tiny model: the JSON each
writes is complete and sane."""

from __future__ import annotations

import json
import math

import pytest

from pagedserve.bench.cli import parse_bench_args, run_bench
from pagedserve.bench.sim import run_simulated
from pagedserve.bench.workloads import arrival_times, fixed


def bench(tmp_path, *argv: str) -> int:
    return run_bench(parse_bench_args([*argv, "--out-dir", str(tmp_path), "--no-progress"]))


def load(tmp_path, name: str) -> dict:
    assert (tmp_path / f"{name}.md").read_text().count("|") > 10, "a Markdown table"
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_memory_breakdown_paged_beats_contiguous_max(tmp_path):
    code = bench(tmp_path, "memory", "--configs", "paged:16,contiguous-max,contiguous-pow2", "--num-requests", "8",
                 "--kv-tokens", "1536", "--max-model-len", "384")
    assert code == 0
    data = load(tmp_path, "memory")
    by_kind = {r["kv_allocation"]: r for r in data["results"]}
    for r in data["results"]:
        assert r["completed"] == 8
        assert sum(r["memory"]["shares"].values()) == pytest.approx(1.0)
        assert r["memory"]["samples"] == r["num_steps"]
    paged, worst = by_kind["paged"]["memory"]["shares"], by_kind["contiguous-max"]["memory"]["shares"]
    assert paged["token_states"] > 0.9 > worst["token_states"]
    assert paged["external"] == 0.0
    assert by_kind["contiguous-pow2"]["num_reallocations"] > 0
    assert (tmp_path / "memory_breakdown.png").stat().st_size > 1000


def test_serve_rate_sweep_on_the_simulated_clock(tmp_path):
    code = bench(tmp_path, "serve", "--workload", "random", "--prompt-len", "8", "--output-len", "6",
                 "--num-requests", "6", "--rates", "20,inf", "--kv-allocation", "paged,contiguous-oracle",
                 "--max-model-len", "64", "--kv-tokens", "256")
    assert code == 0
    data = load(tmp_path, "online_random")
    assert len(data["results"]) == 4
    for r in data["results"]:
        assert r["completed"] == 6
        assert r["output_throughput"] > 0 and r["normalized_latency_s"] > 0
        assert 0 < r["ttft_ms"]["mean"] <= r["e2e_ms"]["mean"]
        assert r["mean_batched_requests"] >= 1
    assert (tmp_path / "online_random.png").exists()


def test_serve_compares_batching_policies_at_auto_rates(tmp_path):
    code = bench(tmp_path, "serve", "--workload", "random", "--prompt-len", "8", "--output-len", "4",
                 "--num-requests", "6", "--rate-fractions", "0.5", "--kv-allocation", "paged",
                 "--batching", "continuous,static,dynamic", "--max-num-seqs", "2", "--max-model-len", "64",
                 "--kv-tokens", "256", "--name", "batching")
    assert code == 0
    data = load(tmp_path, "batching")
    capacity = data["settings"]["capacity_req_s"]
    assert capacity > 0 and data["settings"]["rates"] == [round(capacity * 0.5, 3)]
    policies = {r["batching"] for r in data["results"]}
    assert policies == {"continuous", "static", "dynamic"}
    assert all(r["completed"] == 6 for r in data["results"])


def test_throughput(tmp_path):
    code = bench(tmp_path, "throughput", "--workload", "random", "--prompt-len", "8", "--output-len", "4",
                 "--num-requests", "4", "--kv-allocation", "paged,contiguous-max", "--max-model-len", "64",
                 "--kv-tokens", "256")
    assert code == 0
    results = load(tmp_path, "throughput")["results"]
    assert [r["completed"] for r in results] == [4, 4]
    assert all(r["output_throughput"] > 0 and r["makespan_s"] > 0 for r in results)


def test_sweep(tmp_path):
    code = bench(tmp_path, "sweep", "--model", "llama-gqa", "--axes", "batch,block,dtype", "--batch-sizes", "2",
                 "--block-sizes", "4,16", "--dtypes", "float32", "--num-requests", "2", "--prompt-len", "16",
                 "--output-len", "3", "--max-model-len", "128")
    assert code == 0
    axes = load(tmp_path, "sweep")["axes"]
    assert [p["value"] for p in axes["block"]] == [4, 16]
    for points in axes.values():
        for p in points:
            assert "error" not in p or p["value"] in ("int8", "int4"), p
            if "error" not in p:
                assert p["completed"] == p["num_requests"] and p["kv_bytes_per_token"] > 0
                assert 0 < p["token_state_share"] <= 1
    # Smaller blocks waste fewer slots.
    assert axes["block"][0]["token_state_share"] >= axes["block"][1]["token_state_share"]


def test_sharing_runs_or_says_what_is_missing(tmp_path, capsys):
    code = bench(tmp_path, "sharing", "--modes", "n=1,n=2", "--num-requests", "3", "--max-model-len", "256")
    if code == 2:
        assert "not available yet" in capsys.readouterr().err
        return
    assert code == 0
    results = load(tmp_path, "sharing")["results"]
    assert results[0]["memory_saving"] == 0.0  # one sequence per request: nothing shared
    assert 0 <= results[1]["memory_saving"] < 1


def test_lora_runs_or_says_what_is_missing(tmp_path, capsys):
    from pagedserve.entrypoints.cli import main

    code = main(["bench", "lora", "--num-adapters", "0,2", "--max-loras", "1", "--num-requests", "6",
                 "--max-model-len", "256", "--out-dir", str(tmp_path), "--no-progress"])
    if code == 2:
        assert "not available yet" in capsys.readouterr().err
        return
    assert code == 0
    base, two = load(tmp_path, "lora")["results"]
    assert base["num_adapters"] == 0 and base["disk_loads"] == 0
    assert two["disk_loads"] == 2 and two["device_loads"] >= 2  # one slot for two adapters: reloads
    for r in (base, two):
        assert r["capacity_req_s"] > 0 and r["online"]["completed"] == 6


def test_report_runs_its_parts_and_links_them(tmp_path, monkeypatch):
    from pagedserve.bench import report

    monkeypatch.setattr(report, "PARTS", {"memory": ("memory", [
        "--configs", "paged:16", "--num-requests", "3", "--kv-tokens", "2048", "--max-model-len", "512"])})
    assert bench(tmp_path, "report") == 0
    text = (tmp_path / "report.md").read_text()
    assert "memory_breakdown.png" in text and "How to read this" in text and "Token-state share" in text


def test_simulated_clock_idles_between_arrivals(model_path):
    from pagedserve.bench.common import EngineSpec, make_engine

    engine = make_engine(EngineSpec(model_path("llama-gqa"), max_model_len=64, kv_tokens=256))
    requests = fixed(3, 4, 3, vocab_size=1000, seed=0)
    arrivals = [0.0, 100.0, 200.0]  # far apart: each request runs alone
    run = run_simulated(engine, requests, arrivals)
    assert all(r.finish_s is not None and r.output_len == 3 for r in run.records)
    assert run.records[2].first_token_s > 200.0
    assert run.makespan_s > 200.0 > 10 * run.busy_s  # idle time is skipped, not waited
    assert max(r.e2e_s for r in run.records) < 5.0


def test_arrival_times():
    times = arrival_times(2000, 4.0, seed=1)
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.1)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    bursty = arrival_times(2000, 4.0, burstiness=0.2, seed=1)
    assert bursty[-1] / len(bursty) == pytest.approx(0.25, rel=0.25)


def test_step_model_fit_recovers_costs_and_ignores_contention():
    from pagedserve.bench.clock import fit_step_model

    truth = (1e-3, 2e-4, 1e-5, 1e-7)
    steps = []
    for i in range(200):
        seqs, tokens, context = 1 + i % 40, 1 + (i * 37) % 500, 100 + (i * 91) % 5000
        t = truth[0] + truth[1] * seqs + truth[2] * tokens + truth[3] * context
        steps.append(((seqs, tokens, context), t * (3.0 if i % 10 == 0 else 1.0)))  # every 10th step slowed
    model = fit_step_model(steps)
    assert model.coefficients == pytest.approx(truth, rel=1e-3)
    assert model.num_steps == 180 and model.r2 > 0.999
    with pytest.raises(ValueError):
        fit_step_model(steps[:3])
