"""A tensor-parallel rank > 0: its own process, its shard of the model and of the KV cache.

It owns no scheduler and samples nothing: it runs what rank 0 sends (distributed/tp_workers.py
draws the protocol), in the same order, so every collective inside the forward and the LM
head pairs up with rank 0's. Its only state between messages is the current step's hidden
states (needed by the step's LM-head calls, dropped at "step_done"); `_state` reports it,
so the engine's leak check can assert that no worker holds anything once the engine is idle.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.distributed.parallel_state import create_group
from pagedserve.distributed.tp_workers import WorkerSpec
from pagedserve.lora.layout import write_adapter
from pagedserve.worker.model_runner import ModelRunner


def main(spec: WorkerSpec, rank: int, conn: Connection) -> None:
    """The worker's life: join the group, load the shard, serve rank 0 until told to stop."""
    try:
        torch.set_num_threads(spec.num_threads)
        store = dist.TCPStore(
            "127.0.0.1", spec.store_port, spec.tp_size, is_master=False,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        store.set(f"joined/{rank}", "1")
        device = torch.device("cuda", rank) if spec.device_type == "cuda" else torch.device(spec.device_type)
        group = create_group(store, rank, spec.tp_size, device, spec.timeout_s)
        runner = ModelRunner(
            spec.model_path, spec.dtype, device, spec.block_size,
            quantization=spec.quantization, kv_cache_dtype=spec.kv_cache_dtype, lora_dtype=spec.lora_dtype,
            tp_group=group,
        )
    except BaseException:  # noqa: BLE001 - rank 0 reports it
        _reply(conn, "error", traceback.format_exc())
        raise SystemExit(1) from None
    _reply(conn, "ready", None)
    try:
        _serve(runner, conn)
    except BaseException:  # noqa: BLE001 - rank 0 sees the exit code and this text
        _reply(conn, "error", traceback.format_exc())
        raise SystemExit(1) from None


def _serve(runner: ModelRunner, conn: Connection) -> None:
    hidden: torch.Tensor | None = None
    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # rank 0 is gone: never outlive the engine
            match message:
                case ("step", blocks, batch, lora_runs):
                    hidden = runner.execute_worker_step(blocks, batch, lora_runs)
                case ("logits", rows):
                    assert hidden is not None, "logits asked for a step without a forward"
                    runner.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)])
                case ("step_done",):
                    hidden = None
                case ("adapter", adapter, layout, first_block):
                    write_adapter(runner.lora_shard(adapter), layout, runner.kv_caches, first_block,
                                  runner.lora_dtype)
                case ("kv_cache", num_blocks):
                    runner.initialize_kv_cache(num_blocks)
                case ("swap_space", num_blocks):
                    runner.initialize_swap_space(num_blocks)
                case ("state",):
                    _reply(conn, "state", _state(runner, hidden))
                case ("stop",):
                    return
                case _:
                    raise ValueError(f"unknown message {message[0]!r}")


def _state(runner: ModelRunner, hidden: torch.Tensor | None) -> dict[str, Any]:
    return {
        "holds_step": hidden is not None,
        "generators": len(runner.generators),
        "num_blocks": runner.kv_caches[0].shape[1] if runner.kv_caches else 0,
        "num_kv_heads": runner.kv_cache_spec().num_kv_heads,
    }


def _reply(conn: Connection, kind: str, detail: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps((kind, detail)))
    except OSError:
        pass  # rank 0 is gone


if __name__ == "__main__":
    # `python -m pagedserve.worker.tp_worker FD`: FD is this end of rank 0's socket pair; the
    # first message on it is (WorkerSpec, rank).
    _conn = Connection(int(sys.argv[1]))
    _spec, _rank = pickle.loads(_conn.recv_bytes())
    main(_spec, _rank, _conn)
