"""`pagedserve bench report --models A,B,...`: the per-model study, one resumable cell at a time.

Parts (each a list of cells per model, `cells.py` saves each as it finishes):

    info      the model loaded once: architecture, vocabulary, context limit, KV bytes/token
    latency   all requests queued (capacity C, and the step-time model of bench/clock.py),
              then Poisson arrivals at fractions of C: TTFT / TPOT / E2E p50 and p99
    batch     B requests queued at once, B = 1 ... 64: throughput against batch size
    context   one request of prompt length L: prefill (TTFT) and decode (TPOT) against L
    quant     the same requests per weight format: the file's own, int8, int4, bf16, fp32
    memory    a ShareGPT-like trace in a bounded KV pool: bytes per token and the share of
              the pool holding live token states (the vLLM paper's waste breakdown)
    lora      K random adapters (PEFT layout) of rank r over the same requests, and the base;
              the same on each base quantization (--lora-quant); switching overhead: an
              adapter's disk -> host and host -> KV-pool load, and requests each on its own
              adapter vs all on one; against the adapter merged into the base weights, and
              against one-adapter-at-a-time batching (a step holds one adapter's requests)
    peer      with --peer-server-cmd: pagedserve's server and the peer (llama.cpp) on the
              latency cells' requests and rates over HTTP (bench/peer.py); else a cell saying
              the peer was not available

Engines are built per distinct configuration and reused by consecutive cells (loading a
real model costs more than most cells). `study_report.py` turns the cells into the report.
--parts limits both the cells run and the sections written; a rerun without it measures
nothing already on disk and writes every section again.
"""

from __future__ import annotations

import argparse
import gc
import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pagedserve.bench.cells import Cell, CellStore, run_cells
from pagedserve.bench.clock import FEATURES, StepCostModel, fit_step_model, modelled_makespan
from pagedserve.bench.common import (
    DEFAULT_THREADS,
    EngineSpec,
    make_engine,
    parse_list,
    resolve_model_path,
    torch_threads,
    warm_up,
)
from pagedserve.bench.lora import (
    build_adapters,
    merge_adapter,
    one_adapter_at_a_time,
    time_adapter_loads,
    warm_up_lora,
)
from pagedserve.bench.online import MIN_FIT_STEPS
from pagedserve.bench.peer import PAGEDSERVE_SERVER_CMD, Server, serve_trace
from pagedserve.bench.sim import run_simulated, summarize
from pagedserve.bench.study_report import describe_run, write_study_report
from pagedserve.bench.workloads import (
    WorkloadRequest,
    arrival_times,
    fit_to_context,
    fixed,
    synthetic,
)
from pagedserve.config import NO_QUANTIZATION

PARTS = ("info", "latency", "batch", "context", "quant", "memory", "lora", "peer")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MIXED_RANKS = [8, 16, 64]
LOAD_ADAPTERS = 4  # adapters timed per load cell (medians)
PEER_MISSING = ("llama.cpp peer not available: no --peer-server-cmd given (issue #39.3; build llama.cpp's "
                "llama-server in a scratch folder, it is never a project dependency)")
SERVERS = ("pagedserve", "llama.cpp")
# The parts a part's cells read (besides info): the rates come from the latency part's capacity.
PART_NEEDS = {"info": ("info",), "peer": ("latency", "peer")}


@dataclass(frozen=True)
class StudySettings:
    """What each part measures; `QUICK` is the same study on a budget of minutes per model."""

    parts: tuple[str, ...] = PARTS
    workload: str = "alpaca"  # latency: Alpaca-like lengths (prompt ~19, output ~58 tokens)
    # Per latency, memory and LoRA cell. 32: a peer cell at 0.4 x capacity is real (wall) time,
    # 32 requests of a 1.5B model ~3 minutes of it.
    num_requests: int = 32
    rate_fractions: tuple[float, ...] = (0.4, 0.7, 1.0)
    peer_rate_fractions: tuple[float, ...] = ()  # the peer part's rates (over HTTP, wall time); () = rate_fractions
    peer_batch_sizes: tuple[int, ...] = ()  # the peer part's batch cells; () = batch_sizes
    peer_context_lens: tuple[int, ...] = ()  # the peer part's context cells; () = context_lens
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_len: int = 64  # batch, quant and lora cells: every request prompt_len / output_len
    output_len: int = 32
    context_lens: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    context_output_len: int = 16
    quant_levels: tuple[str, ...] = ("native", "int8", "int4", "bfloat16", "float32")
    quant_requests: int = 8
    memory_workload: str = "sharegpt"
    memory_kv_tokens: int = 8192  # small enough that the trace fills it: memory is the bottleneck
    lora_models: tuple[str, ...] = ()  # the LoRA part's base models; () = every model
    lora_counts: tuple[int, ...] = (1, 4, 16, 64, 256)
    lora_ranks: tuple[str, ...] = ("8", "16", "64", "mixed")
    # The LoRA cells' base weights: the file's own (a non-GGUF checkpoint: its dtype), int8, bf16.
    lora_quant: tuple[str, ...] = ("native", "int8", "bfloat16")
    max_loras: int = 16  # adapters resident at once; more are evicted and reloaded
    repeats: int = 2  # offline cells: fastest of this many runs (other load only adds time)
    seed: int = 0
    threads: int = DEFAULT_THREADS  # torch intra-op threads: the same cell runs 1.3-2x apart on 1 and 2
    peer_server_cmd: str | None = None  # e.g. "llama-server -m {model} --port {port}"

    def fingerprint(self) -> dict[str, Any]:
        """What a saved cell's numbers depend on beyond its own key: every setting but the
        lists of cells (adding a rate or a batch size keeps the cells already measured)."""
        lists = {"parts", "peer_server_cmd", *_LIST_FLAGS}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in lists}


# Minutes per model: a real 1.5B model runs ~0.6 requests/s here, and each engine (a quant
# level, LoRA on) is a load of its own, so QUICK keeps one engine per part where it can, the
# peer at one rate over HTTP (wall time, not the simulated clock) and the LoRA part to one
# count and rank on the file's own weights.
QUICK = StudySettings(num_requests=16, rate_fractions=(0.5, 0.9), peer_rate_fractions=(0.7,), peer_batch_sizes=(16,),
                      peer_context_lens=(1024,), batch_sizes=(1, 4, 16),
                      context_lens=(256, 1024), context_output_len=8, quant_levels=("native", "int8"),
                      quant_requests=4, lora_counts=(4,), lora_ranks=("8",), lora_quant=("native",),
                      # ShareGPT-like requests are ~500 tokens: 24 of them take minutes on a 1.5B model
                      memory_workload="alpaca", memory_kv_tokens=1024,
                      repeats=1)

# The list-valued settings a flag of the same name overrides -> their element type.
_LIST_FLAGS = {"rate_fractions": float, "peer_rate_fractions": float, "peer_batch_sizes": int,
               "peer_context_lens": int, "batch_sizes": int, "context_lens": int,
               "quant_levels": str, "lora_models": str, "lora_counts": int, "lora_ranks": str, "lora_quant": str}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the per-model study (on `bench report`; they apply with --models)."""
    group = parser.add_argument_group("per-model study (with --models)")
    group.add_argument("--models", default=None,
                       help="comma-separated catalog names (`pagedserve models`), demo models or paths: "
                            "run the per-model study instead of the engine-baseline report")
    unset = {"peer_rate_fractions": "the rate fractions", "peer_batch_sizes": "the batch sizes",
             "peer_context_lens": "the context lengths", "lora_models": "every model"}
    for flag in _LIST_FLAGS:
        default = ",".join(map(str, getattr(StudySettings(), flag))) or unset[flag]
        group.add_argument("--" + flag.replace("_", "-"), default=None,
                           help=f"comma-separated (default: {default}; --quick: {','.join(map(str, getattr(QUICK, flag))) or unset[flag]})")
    group.add_argument("--num-requests", type=int, default=None, help="requests per latency, memory and LoRA cell")
    group.add_argument("--retry-errors", action="store_true", help="rerun cells saved with an error")
    group.add_argument("--peer-server-cmd", default=None,
                       help="the peer's server command, with {model} (the model file) and {port}, e.g. "
                            "\"llama-server -m {model} --port {port}\": adds HTTP cells of it and of "
                            "`pagedserve serve` at the latency cells' rates (a changed command: delete cells/*/peer)")


def settings_from_args(args: argparse.Namespace, parts: list[str] | None) -> StudySettings:
    base = replace(QUICK if args.quick else StudySettings(), seed=args.seed, threads=args.threads)
    changes: dict[str, Any] = {f: tuple(parse_list(v, kind)) for f, kind in _LIST_FLAGS.items()
                               if (v := getattr(args, f, None)) is not None}
    if args.num_requests is not None:
        changes["num_requests"] = args.num_requests
    if getattr(args, "peer_server_cmd", None):
        changes["peer_server_cmd"] = args.peer_server_cmd
    if parts is not None:
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"--parts: unknown {', '.join(sorted(unknown))}; the study has {', '.join(PARTS)}")
        changes["parts"] = tuple(p for p in PARTS if p in parts or p == "info")  # info: the others need it
    return replace(base, **changes)


def run_study(args: argparse.Namespace) -> int:
    """Runs the cells not on disk yet (all of them with --retry-errors), then writes the report.

    Exit 1 when a cell holds an error (the report still shows every cell, with its reason).
    """
    models = parse_list(args.models)
    settings = settings_from_args(args, parse_list(args.parts) if args.parts else None)
    out = Path(args.out_dir)
    store = study_store(out, settings)
    cells = plan(models, settings)
    if args.render_only:
        records = {c: r for c in cells if (r := store.load(c)) is not None}
    else:
        runner = StudyRunner(store, settings)
        with torch_threads(args.threads):
            try:
                records, ran = run_cells(cells, store, runner.measure, args.progress, args.retry_errors)
            finally:
                runner.close()
        print(f"[study] {ran} cells run, {len(cells) - ran} already on disk")
    commands = {part: study_command(args, PART_NEEDS.get(part, (part,))) for part in settings.parts}
    path = write_study_report(out, models, records, settings.parts, study_command(args), commands, describe_run())
    failed = [c.name for c, r in records.items() if "error" in r["result"]]
    print(f"[study] wrote {path}" + (f"; cells with errors: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def study_store(out: Path, settings: StudySettings) -> CellStore:
    """The study folder's cells under these settings and this CPU (a folder resumed on
    another machine measures its cells again)."""
    return CellStore(out, {**settings.fingerprint(), "cpu": describe_run()["cpu"]})


def study_command(args: argparse.Namespace, parts: tuple[str, ...] | None = None) -> str:
    """The command line that reproduces this study (the flags given, not their defaults), or
    only `parts` of it."""
    words = ["pagedserve bench report", "--models", args.models, "--out", args.out_dir]
    words += ["--quick"] if args.quick else []
    words += ["--threads", str(args.threads)] if args.threads != DEFAULT_THREADS else []
    for flag in [*_LIST_FLAGS, "num_requests", "parts", "peer_server_cmd"]:
        value = ",".join(parts) if flag == "parts" and parts else getattr(args, flag, None)
        if value is not None:
            words += ["--" + flag.replace("_", "-"), shlex.quote(str(value))]
    return " ".join(words)


def plan(models: list[str], s: StudySettings) -> list[Cell]:
    """Every cell of the study, model by model, in the order they run.

    Raises:
        ValueError: a --lora-models name that is not one of `models` (it would run nothing).
    """
    stray = [m for m in s.lora_models if m not in models]
    if stray:
        raise ValueError(f"--lora-models: {', '.join(stray)} not among --models ({', '.join(models)})")
    cells: list[Cell] = []
    for m in models:
        lat = s.num_requests * 80.0  # Alpaca-like: ~77 tokens per request
        by_part: dict[str, list[Cell]] = {
            # A load (parsing, repacking, kernels) takes about as long as ~1000 tokens.
            "info": [Cell(m, "info", "model", cost=1000)],
            "latency": [Cell(m, "latency", "capacity", cost=lat)]
            + [Cell(m, "latency", f"rate={f:g}", {"fraction": f}, lat) for f in s.rate_fractions],
            "batch": [Cell(m, "batch", str(b), {"batch": b}, s.repeats * b * (s.prompt_len + s.output_len))
                      for b in s.batch_sizes],
            "context": [Cell(m, "context", str(c), {"context": c}, c + 4.0 * s.context_output_len)
                        for c in s.context_lens],
            "quant": [Cell(m, "quant", q, {"level": q}, s.quant_requests * (s.prompt_len + s.output_len))
                      for q in s.quant_levels],
            "memory": [Cell(m, "memory", "paged", cost=s.num_requests * (500.0 if s.memory_workload == "sharegpt"
                                                                      else 80.0))],
            "lora": lora_cells(m, s) if not s.lora_models or m in s.lora_models else [],
            "peer": [cell for server in SERVERS for cell in _peer_cells(m, server, s, lat)] if s.peer_server_cmd
            else [Cell(m, "peer", "llama.cpp", {"server": "llama.cpp"}, cost=0)],
        }
        # Costs are tokens; a token of a bigger model costs more, in proportion to its file.
        weight = _cost_weight(m)
        for part in s.parts:
            cells += [replace(c, cost=c.cost * weight) for c in by_part[part]]
    return cells


def _peer_cells(model: str, server: str, s: StudySettings, latency_cost: float) -> list[Cell]:
    """`server`'s cells, together (a server starts once per model): the latency cells' traces at
    the peer rates, then the batch and context cells' requests over HTTP (wall clock)."""
    return ([Cell(model, "peer", f"{server} rate={f:g}", {"server": server, "fraction": f}, latency_cost)
             for f in s.peer_rate_fractions or s.rate_fractions]
            + [Cell(model, "peer", f"{server} batch={b}", {"server": server, "batch": b},
                    b * (s.prompt_len + s.output_len)) for b in s.peer_batch_sizes or s.batch_sizes]
            + [Cell(model, "peer", f"{server} context={c}", {"server": server, "context": c},
                    c + 4.0 * s.context_output_len) for c in s.peer_context_lens or s.context_lens])


def _beyond_context(info: dict[str, Any]) -> dict[str, Any]:
    return {"skipped": f"beyond the model's context length ({info['max_position_embeddings']})"}


def _cost_weight(model: str) -> float:
    """A model's time per token relative to a ~100 MB one, from its catalog file's size (1 for
    others). Less than in proportion: `--quick` took 1.9x, 4.7x and 2.0x SmolLM2's time on the
    0.5B, 1.5B and Gemma files (2 threads), which are 5x, 11x and 2.5x its size."""
    from pagedserve.models.catalog import CATALOG

    entry = CATALOG.get(model)
    return max(1.0, entry.size / 1e8) ** 0.7 if entry else 1.0


def lora_cells(model: str, s: StudySettings) -> list[Cell]:
    """The lora part's cells, grouped so that consecutive cells share an engine. params
    "kind": sweep (count x rank, and count at the first rank per other --lora-quant level),
    load (per rank), per-request, serial (one adapter at a time), merged (per quant level)."""
    run = s.num_requests * 100.0
    first = s.lora_ranks[0] if s.lora_ranks else "8"
    cells: list[Cell] = []
    for q in s.lora_quant:
        tag = "" if q == "native" else f" q={q}"
        sweep = {"kind": "sweep", "quant": q}
        cells.append(Cell(model, "lora", "base" + tag, {**sweep, "count": 0, "rank": "-"}, run))
        ranks = s.lora_ranks if q == "native" else (first,)
        cells += [Cell(model, "lora", f"n={k},r={r}{tag}", {**sweep, "count": k, "rank": r}, run + k)
                  for r in ranks for k in s.lora_counts]
        if q == "native":
            cells += [Cell(model, "lora", f"load r={r}", {"kind": "load", "rank": r}, 50.0 * LOAD_ADAPTERS)
                      for r in _load_ranks(s)]
            per_request = min(s.num_requests, s.max_loras) * 100.0
            cells += [Cell(model, "lora", f"per-request {on}", {"kind": "per-request", "adapters": on}, per_request)
                      for on in ("one", "distinct")]
            cells += [Cell(model, "lora", f"one-at-a-time n={k},r={first}", {"kind": "serial", "count": k,
                                                                              "rank": first}, run + k)
                      for k in s.lora_counts if k > 1]
        # Last on its engine: merging changes the weights, and the engine is dropped after.
        cells.append(Cell(model, "lora", "merged" + tag, {"kind": "merged", "quant": q, "rank": first}, run))
    return cells


def _load_ranks(s: StudySettings) -> list[int]:
    return sorted({r for name in s.lora_ranks for r in (MIXED_RANKS if name == "mixed" else [int(name)])})


class StudyRunner:
    """Measures cells; keeps the last engine while consecutive cells share its configuration."""

    def __init__(self, store: CellStore, settings: StudySettings) -> None:
        self.store, self.s = store, settings
        self._spec: EngineSpec | None = None
        self._engine: Any = None
        self._server: tuple[tuple[str, str], Server] | None = None
        self._paths: dict[str, str] = {}

    def measure(self, cell: Cell) -> dict[str, Any]:
        if cell.part == "peer" and not self.s.peer_server_cmd:
            return {"available": False, "reason": PEER_MISSING}
        if cell.part == "info":
            return self._info(cell.model)
        measures = {"latency": self._latency, "batch": self._batch, "context": self._context,
                    "quant": self._quant, "memory": self._memory, "lora": self._lora, "peer": self._peer}
        try:
            return measures[cell.part](cell, self._saved_info(cell.model))
        except Exception:
            # A cell that raised may leave requests or adapters in the engine: the next cell
            # gets a fresh one rather than failing on this one's leftovers.
            self.close()
            raise

    def close(self) -> None:
        """Drops the engine and stops the server, whichever is held."""
        self._engine = self._spec = None
        if self._server is not None:
            self._server[1].close()
            self._server = None
        gc.collect()

    # ---- engines -------------------------------------------------------------------------

    def path(self, model: str) -> str:
        if model not in self._paths:
            self._paths[model] = resolve_model_path(model)
        return self._paths[model]

    def engine(self, spec: EngineSpec) -> Any:
        if spec != self._spec:
            self.close()  # the old engine's memory goes before the new one loads
            engine = make_engine(spec)
            warm_up(engine)
            if spec.max_loras:
                warm_up_lora(engine, spec.model, LORA_TARGETS)
            self._engine, self._spec = engine, spec
        return self._engine

    def server(self, name: str, model_path: str) -> Server:
        """`name`'s server on `model_path`, started unless it is the one running."""
        key = (name, model_path)
        if self._server is None or self._server[0] != key:
            self.close()
            command = PAGEDSERVE_SERVER_CMD if name == "pagedserve" else str(self.s.peer_server_cmd)
            self._server = (key, Server(command, model_path))
        return self._server[1]

    def _saved_info(self, model: str) -> dict[str, Any]:
        record = self.store.load(Cell(model, "info", "model"))
        if record is None or "error" in record["result"]:
            reason = record["result"]["error"] if record else "no info cell"
            raise RuntimeError(f"the model did not load ({reason})")
        return dict(record["result"])

    def _engine_spec(self, info: dict[str, Any], **changes: Any) -> EngineSpec:
        """The model's one engine configuration for every part but memory (plus `changes`):
        room for the longest context cell, the largest batch and the latency trace at once,
        so consecutive cells share one loaded engine and differ only in their requests."""
        s, limit = self.s, info["max_position_embeddings"]
        longest = max((p for c in s.context_lens if (p := _context_prompt(c, s.context_output_len, limit))), default=0)
        max_len = min(limit, max(2048, longest + s.context_output_len, s.prompt_len + s.output_len))
        most = max(s.batch_sizes, default=1)
        kv_tokens = max(16384, most * (s.prompt_len + s.output_len), max_len) + 256
        spec = EngineSpec(str(info["path"]), max_model_len=max_len, kv_tokens=_pool_tokens(info, kv_tokens),
                          max_num_seqs=max(256, most))
        return replace(spec, **changes)

    # ---- parts ---------------------------------------------------------------------------

    def _info(self, model: str) -> dict[str, Any]:
        from pagedserve.models.catalog import CATALOG

        # 4096 tokens: a model with windowed layers pages each of its layer groups separately
        # (Gemma 3: 6 groups), and every group needs its blocks for one sequence.
        engine = self.engine(EngineSpec(self.path(model), max_model_len=128, kv_tokens=4096, max_num_seqs=8))
        hf, kv, groups = engine.runner.hf_config, engine.runner.kv_cache_spec(), engine.runner.kv_groups
        entry = CATALOG.get(model)
        # A block is one page of a layer group (all layers without windowed ones): one 8k-token
        # sequence holds every group's pages but a windowed group's slid-out ones.
        long_seq = 8192
        held = groups.blocks_per_sequence(long_seq, kv.block_size, 1) - (1 if groups.hybrid else 0)  # less the null block
        engine.assert_no_leaks()
        return {"path": self.path(model), "title": entry.title if entry else model,
                "weights": entry.quantization if entry else "float32 (random weights)",
                "architecture": (getattr(hf, "architectures", None) or [hf.model_type])[0],
                "vocab_size": engine.vocab_size,
                "max_position_embeddings": int(getattr(hf, "max_position_embeddings", 0) or 2048),
                "sliding_window": getattr(hf, "sliding_window", None),
                "num_layers": kv.num_layers * groups.num_groups, "num_kv_heads": kv.num_kv_heads,
                "head_dim": kv.head_dim, "kv_bytes_per_token": kv.bytes_per_token * groups.num_groups,
                "kv_groups": groups.num_groups,
                "kv_bytes_8k_held": held * kv.bytes_per_block,
                "kv_bytes_8k_every_block": -(-long_seq // kv.block_size) * groups.num_groups * kv.bytes_per_block,
                "checkpoint_dtype": _checkpoint_dtype(hf)}

    def _run(self, spec: EngineSpec, requests: list[WorkloadRequest], arrivals: list[float] | None = None,
             repeats: int = 1, **kwargs: Any) -> dict[str, Any]:
        """The fastest of `repeats` runs of `requests` (all queued unless `arrivals`), summarized."""
        engine = self.engine(spec)
        runs = [run_simulated(engine, requests, arrivals or [0.0] * len(requests), id_prefix=f"r{i}-", **kwargs)
                for i in range(max(1, repeats))]
        engine.assert_no_leaks()
        return summarize(min(runs, key=lambda r: r.busy_s))

    def _latency_requests(self, info: dict[str, Any]) -> tuple[EngineSpec, list[WorkloadRequest]]:
        spec = self._engine_spec(info)
        requests = synthetic(self.s.workload, self.s.num_requests, info["vocab_size"], self.s.seed)
        return spec, fit_to_context(requests, spec.max_model_len)

    def _capacity(self, model: str) -> dict[str, Any]:
        record = self.store.load(Cell(model, "latency", "capacity"))
        if record is None or "error" in record["result"]:
            raise RuntimeError("no capacity cell for this model (the latency part): no rates to run")
        return dict(record["result"])

    def _peer(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        """A latency cell's trace at its rate, a batch cell's requests all at once, or a context
        cell's one request, sent to `server` over HTTP (wall clock)."""
        s, server = self.s, cell.params["server"]
        extra: dict[str, Any] = {}
        if "batch" in cell.params:
            requests = self._batch_requests(cell.params["batch"], info)
            rate, extra = float("inf"), {"batch": cell.params["batch"]}
        elif "context" in cell.params:
            context = self._context_requests(cell.params["context"], info)
            if context is None:
                return _beyond_context(info)
            requests, rate, extra = context, float("inf"), {"prompt_tokens": len(context[0].prompt_token_ids)}
        else:
            _, requests = self._latency_requests(info)
            rate = cell.params["fraction"] * self._capacity(cell.model)["capacity_req_s"]
            extra = {"rate_fraction": cell.params["fraction"]}
        try:
            summary = serve_trace(self.server(server, str(info["path"])).base_url, requests, rate, s.seed)
        except BaseException:
            self.close()  # a server that failed a cell may be stuck: the next cell starts a fresh one
            raise
        return {"server": server, "request_rate": rate, "clock": "wall (HTTP)", **extra, **summary}

    def _latency(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        spec, requests = self._latency_requests(info)
        if cell.key == "capacity":
            engine = self.engine(spec)
            run = run_simulated(engine, requests, [0.0] * len(requests), id_prefix="cap-")
            engine.assert_no_leaks()
            model = fit_step_model(run.steps) if len(run.steps) >= MIN_FIT_STEPS else None
            capacity = len(requests) / (modelled_makespan(run, model) if model else run.makespan_s)
            return {"capacity_req_s": capacity, "step_model": model.as_dict() if model else None,
                    "clock": "fitted" if model else "measured", **summarize(run)}
        cap = self._capacity(cell.model)
        step_model = _step_model(cap["step_model"]) if cap["step_model"] else None
        rate = cell.params["fraction"] * cap["capacity_req_s"]
        arrivals = arrival_times(len(requests), rate, seed=self.s.seed)
        result = self._run(spec, requests, arrivals, step_time=step_model)
        return {"rate_fraction": cell.params["fraction"], "request_rate": rate, "clock": cap["clock"], **result}

    # The batch and context cells' requests, the same in process and over HTTP (the peer part).
    # A seed per cell: with one seed a cell's prompts would begin with the previous cell's, and
    # a server's prefix cache would serve them.
    def _batch_requests(self, batch: int, info: dict[str, Any]) -> list[WorkloadRequest]:
        s = self.s
        return fixed(batch, s.prompt_len, s.output_len, info["vocab_size"], s.seed + batch)

    def _context_requests(self, context: int, info: dict[str, Any]) -> list[WorkloadRequest] | None:
        """One request of the longest prompt up to `context` that fits the model with its
        output; None past the model's limit."""
        out = self.s.context_output_len
        prompt = _context_prompt(context, out, info["max_position_embeddings"])
        return None if prompt is None else fixed(1, prompt, out, info["vocab_size"], self.s.seed + prompt)

    def _batch(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        requests = self._batch_requests(cell.params["batch"], info)
        return self._run(self._engine_spec(info), requests, repeats=self.s.repeats)

    def _context(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        requests = self._context_requests(cell.params["context"], info)
        if requests is None:
            return _beyond_context(info)
        return {"prompt_tokens": len(requests[0].prompt_token_ids),
                **self._run(self._engine_spec(info), requests, repeats=self.s.repeats)}

    def _quant(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        s, level = self.s, cell.params["level"]
        gguf = str(info["path"]).endswith(".gguf")
        dtype, quantization = {"native": ("float32", "gguf" if gguf else None), "int8": ("float32", "int8"),
                               "int4": ("float32", "int4"), "bfloat16": ("bfloat16", NO_QUANTIZATION),
                               "float32": ("float32", NO_QUANTIZATION)}[level]
        # A GGUF file's blocks are what the loader serves unasked: native is the other parts' engine.
        spec = self._engine_spec(info, dtype=dtype, quantization=None if level == "native" else quantization)
        requests = self._batch_requests(s.quant_requests, info)  # the batch cell's of that size
        label = f"native ({info['weights']})" if level == "native" else level
        return {"label": label, "dtype": dtype, "quantization": quantization,
                **self._run(spec, requests, repeats=s.repeats)}

    def _memory(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        s = self.s
        max_len = min(2048, s.memory_kv_tokens, info["max_position_embeddings"])
        spec = EngineSpec(str(info["path"]), max_model_len=max_len, kv_tokens=_pool_tokens(info, s.memory_kv_tokens))
        requests = fit_to_context(synthetic(s.memory_workload, s.num_requests, info["vocab_size"], s.seed), max_len)
        result = self._run(spec, requests, sample_memory=True)
        return {"kv_bytes_per_token": info["kv_bytes_per_token"], "kv_tokens": s.memory_kv_tokens,
                "kv_bytes_8k_held": info.get("kv_bytes_8k_held"), "kv_bytes_8k_every_block": info.get("kv_bytes_8k_every_block"),
                "workload": s.memory_workload, "sliding_window": info.get("sliding_window"), **result}

    def _lora_spec(self, info: dict[str, Any], quant: str, lora: bool = True) -> EngineSpec:
        """The LoRA cells' engine on base weights `quant` (native: the file's own blocks for a
        GGUF file, else the checkpoint's dtype, bf16 or float32)."""
        gguf = str(info["path"]).endswith(".gguf")
        native_dtype = "bfloat16" if info.get("checkpoint_dtype") == "bfloat16" and not gguf else "float32"
        dtype, quantization = {"native": (native_dtype, "gguf" if gguf else None), "int8": ("float32", "int8"),
                               "int4": ("float32", "int4"), "bfloat16": ("bfloat16", NO_QUANTIZATION),
                               "float32": ("float32", NO_QUANTIZATION)}[quant]
        changes: dict[str, Any] = {"max_loras": self.s.max_loras, "max_lora_rank": max(MIXED_RANKS)} if lora else {}
        return self._engine_spec(info, dtype=dtype, quantization=quantization, **changes)

    def _adapters(self, info: dict[str, Any], spec: EngineSpec, k: int, rank: str, first_id: int | None = None,
                  seed_offset: int = 0) -> list[Any]:
        ranks = MIXED_RANKS if rank == "mixed" else [int(rank)]
        config = self.engine(spec).runner.hf_config
        # One engine serves every (count, rank) cell: each rank population gets its own ids.
        first_id = first_id if first_id is not None else 1 + 100_000 * self.s.lora_ranks.index(rank)
        return build_adapters(info["path"], k, ranks, LORA_TARGETS, self.s.seed + seed_offset, config, first_id)

    def _lora(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        kind = cell.params.get("kind", "sweep")
        measure = {"sweep": self._lora_sweep, "load": self._lora_load, "per-request": self._lora_per_request,
                   "serial": self._lora_serial, "merged": self._lora_merged}[kind]
        return measure(cell, info)

    def _lora_run(self, spec: EngineSpec, requests: list[WorkloadRequest], loras: list[Any] | None,
                  serial: bool = False) -> dict[str, Any]:
        """One run of `requests` (all queued), with the adapter loads it caused."""
        engine = self.engine(spec)
        manager = getattr(engine, "lora_manager", None)
        before = (getattr(manager, "num_disk_loads", 0), getattr(manager, "num_device_loads", 0))
        if serial:
            result = summarize(one_adapter_at_a_time(engine, requests, loras or []))
            engine.assert_no_leaks()
        else:
            result = self._run(spec, requests, lora_requests=loras)
        return {"disk_loads": getattr(manager, "num_disk_loads", 0) - before[0],
                "device_loads": getattr(manager, "num_device_loads", 0) - before[1], **result}

    def _lora_sweep(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        s, k, rank, quant = self.s, cell.params["count"], cell.params["rank"], cell.params.get("quant", "native")
        spec = self._lora_spec(info, quant, lora=bool(k))
        requests = fixed(s.num_requests, s.prompt_len, s.output_len, info["vocab_size"], s.seed)
        loras = None
        if k:
            adapters = self._adapters(info, spec, k, rank)
            loras = [adapters[i % k] for i in range(len(requests))]
        return {"count": k, "rank": rank, "quant": quant, "dtype": spec.dtype, "quantization": spec.quantization,
                **self._lora_run(spec, requests, loras)}

    def _lora_load(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        rank = cell.params["rank"]
        spec = self._lora_spec(info, "native")
        # Fresh files and ids (not the sweep's): their first read, though the OS may cache them.
        adapters = self._adapters(info, spec, LOAD_ADAPTERS, str(rank), first_id=800_000 + 1000 * rank,
                                  seed_offset=7919)
        engine = self.engine(spec)
        result = time_adapter_loads(engine, adapters)
        engine.assert_no_leaks()
        return {"rank": rank, **result}

    def _lora_per_request(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        """min(requests, max_loras) requests all queued, all resident before the run: each on
        its own adapter (a step's batch has one segment per request) vs all on one."""
        s, on = self.s, cell.params["adapters"]
        spec = self._lora_spec(info, "native")
        n = min(s.num_requests, s.max_loras)
        first = s.lora_ranks[0] if s.lora_ranks else "8"
        adapters = self._adapters(info, spec, n, first, first_id=900_000)
        loras = [adapters[i] if on == "distinct" else adapters[0] for i in range(n)]
        manager = self.engine(spec).lora_manager
        used = list(dict.fromkeys(loras))
        for adapter in used:  # resident first: only the batch's cost is measured
            manager.register(adapter, load_now=True)
            manager.prepare(adapter.lora_int_id)
        requests = fixed(n, s.prompt_len, s.output_len, info["vocab_size"], s.seed)
        result = {"adapters": on, "requests": n, "rank": first, **self._lora_run(spec, requests, loras)}
        for adapter in used:  # gone again: a host cache full of resident adapters is not the next cell's start
            manager.unregister(adapter.lora_int_id)
        return result

    def _lora_serial(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        s, k, rank = self.s, cell.params["count"], cell.params["rank"]
        spec = self._lora_spec(info, "native")
        requests = fixed(s.num_requests, s.prompt_len, s.output_len, info["vocab_size"], s.seed)
        adapters = self._adapters(info, spec, k, rank)
        loras = [adapters[i % k] for i in range(len(requests))]
        return {"count": k, "rank": rank, **self._lora_run(spec, requests, loras, serial=True)}

    def _lora_merged(self, cell: Cell, info: dict[str, Any]) -> dict[str, Any]:
        """The first rank's first adapter (the n=1 cell's) merged into the base weights, its
        requests served as the plain model; the engine is dropped after (its weights changed)."""
        s, quant, rank = self.s, cell.params["quant"], cell.params["rank"]
        spec = self._lora_spec(info, quant)
        adapter = self._adapters(info, spec, 1, rank)[0]
        try:
            merge_adapter(self.engine(spec), adapter)
        except NotImplementedError as exc:
            return {"skipped": f"no merged-weights serving on this base: {exc}"}
        try:
            requests = fixed(s.num_requests, s.prompt_len, s.output_len, info["vocab_size"], s.seed)
            return {"quant": quant, "rank": rank, **self._lora_run(spec, requests, None)}
        finally:
            self.close()


def _context_prompt(context: int, output_len: int, limit: int) -> int | None:
    """The prompt of a context cell: `context` tokens, or at the model's limit itself the
    limit less the output (SmolLM2's 8192 is a cell too); None past the limit."""
    return None if context > limit else min(context, limit - output_len)


def _pool_tokens(info: dict[str, Any], tokens: int) -> int:
    """EngineSpec.kv_tokens for a pool of as many bytes as `tokens` tokens in every layer: a
    model with windowed layers (KV groups) has a block per group of layers, so G groups make
    G times the blocks of one page each, the same bytes (and what it saves shows as room),
    plus the one block such a model's manager keeps aside (its null block)."""
    groups = int(info.get("kv_groups", 1))
    return tokens * groups + (EngineSpec.block_size if groups > 1 else 0)


def _checkpoint_dtype(hf: Any) -> str:
    """The checkpoint's dtype name ("bfloat16", "float32"...; float32 when unstated)."""
    # `dtype` since transformers 4.56; reading the older `torch_dtype` there logs a deprecation.
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


def _step_model(saved: dict[str, Any]) -> StepCostModel:
    """The step-time model a capacity cell saved (`StepCostModel.as_dict`), rebuilt."""
    coefficients = saved["coefficients_s"]
    a, b, c, d = (float(coefficients[name]) for name in FEATURES)
    return StepCostModel((a, b, c, d), float(saved["r2"]), int(saved["num_steps"]))
