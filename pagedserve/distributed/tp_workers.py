"""Rank 0's handle on the other tensor-parallel ranks: starts, feeds and watches them.

    engine process (rank 0)                       worker process (rank r, worker/tp_worker.py)
    -----------------------                       -------------------------------------------
    TPWorkers(spec)  --spawn-->                   joins the TCP store, then the process group
      waits for every rank to join                builds ModelRunner(tp_group) = its shard
    create_group (gloo / NCCL) <--rendezvous-->   ...
    rank 0 loads its shard; wait_ready() <------  ("ready",) once its shard is loaded
    send(("kv_cache", n)) / ("swap_space", n) -->  allocates the same block ids
    send(("adapter", lora, layout, block)) --->  writes its shard of a LoRA adapter there
    every step: send(("step", blocks, batch, lora_runs)) --> block copies + forward
                                                  (all-reduces pair up with rank 0's)
                send(("logits", rows))  ------->  its vocabulary slice, gathered to rank 0
                send(("step_done",))    ------->  drops the step's hidden states
    query_state()  <------------------------->    what it holds (the leak check)
    shutdown()     --("stop",)-->                  exits; killed if it does not within 5 s

Workers are `python -m pagedserve.worker.tp_worker` subprocesses, not multiprocessing
"spawn" children: they never re-import the caller's main module, so a script calling
`LLM(..., tensor_parallel_size=2)` needs no `if __name__ == "__main__"` guard.
Control messages go over one socket pair per worker (pickled once per message); tensors
only ever move through the process group's collectives. A worker whose socket reaches EOF
(rank 0 died) exits, so no worker outlives its engine. Death is detected three ways, none
of which waits: before each message the workers' exit status is polled; a collective with a
dead peer fails at once (its socket closes); a hung peer fails the collective after
PAGEDSERVE_TP_TIMEOUT_S. Each raises `TensorParallelError`: the step fails, the engine stops.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.distributed.parallel_state import CommStats, TensorParallelError, create_group
from pagedserve.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its shard of the model runner (plain, picklable values)."""

    model_path: str
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda" (rank r uses cuda:r)
    block_size: int
    quantization: QuantizationConfig | None
    kv_cache_dtype: str
    lora_dtype: torch.dtype | None  # None: LoRA off
    tp_size: int
    store_port: int
    timeout_s: float
    num_threads: int  # torch intra-op threads of each worker


def worker_threads(tp_size: int) -> int:
    """Each worker's share of the host's cores (rank 0 keeps the process's own setting)."""
    return max(1, (os.cpu_count() or 1) // tp_size)


class TPWorkers:
    """Spawns ranks 1..tp_size-1 and joins the process group as rank 0 (`group`).

    Args:
        spec: the model and cache settings every rank shares (`store_port` is filled here).
        device: rank 0's device; the backend follows it (gloo on CPU, NCCL on CUDA).
        timeout_s: start-up and collective timeout.
    """

    def __init__(self, spec: WorkerSpec, device: torch.device, timeout_s: float) -> None:
        self.size = spec.tp_size
        self.timeout_s = timeout_s
        store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        spec = _with_port(spec, store.port)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(1, self.size):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.worker.tp_worker", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
            )
            theirs.close()
            conn = multiprocessing.connection.Connection(ours.detach())
            conn.send_bytes(pickle.dumps((spec, rank)))
            self.processes.append(process)
            self.conns.append(conn)
        # Stops the workers when this object is collected or at interpreter exit, whichever
        # comes first; `shutdown` calls it early.
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.processes), list(self.conns))
        self.broadcast_s = 0.0
        self.num_broadcasts = 0
        try:
            self._wait_joined(store)
            self.group = create_group(store, 0, self.size, device, timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._store = store  # the group's rendezvous; kept alive as long as the group

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _wait_joined(self, store: dist.TCPStore) -> None:
        # Poll the store rather than block in the group's rendezvous, so a worker that dies
        # while importing is reported at once instead of after the timeout.
        keys = [f"joined/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {self.timeout_s:.0f} s")
            time.sleep(0.02)

    def wait_ready(self) -> None:
        """Blocks until every worker has loaded its shard; raises with a worker's traceback."""
        deadline = time.monotonic() + self.timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.05):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not load its shard in time")
            kind, detail = _recv(conn, rank)
            if kind != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start:\n{detail}")

    def check_alive(self) -> None:
        """Raises TensorParallelError naming the first worker that exited (a select call)."""
        if not self.alive:
            raise TensorParallelError("tensor-parallel workers were shut down")
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True), start=1):
            code = process.poll()  # waitpid(WNOHANG): a syscall, no wait
            if code is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) died (exit code {code}){_last_words(conn)}"
                )

    def problem(self) -> str | None:
        """Why the workers cannot serve (one exited, or they were shut down), else None.
        Safe from any thread: it only polls the processes' exit status."""
        try:
            self.check_alive()
        except TensorParallelError as exc:
            return str(exc)
        return None

    def send(self, message: tuple[Any, ...]) -> None:
        """The same message to every worker, pickled once; fails if one of them is gone."""
        start = time.perf_counter()
        self.check_alive()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            self.check_alive()
            raise TensorParallelError(f"tensor-parallel worker unreachable: {exc}") from exc
        self.broadcast_s += time.perf_counter() - start
        self.num_broadcasts += 1

    def query_state(self) -> list[dict[str, Any]]:
        """Each worker's report of what it holds (worker/tp_worker.py: `_state`)."""
        self.send(("state",))
        states = []
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(self.timeout_s):
                raise TensorParallelError(f"tensor-parallel rank {rank} did not answer")
            kind, detail = _recv(conn, rank)
            if kind != "state":
                raise TensorParallelError(f"tensor-parallel rank {rank}: {detail}")
            states.append(detail)
        return states

    def time_collectives(self, on: bool = True) -> None:
        """Benchmarks: time rank 0's all-reduces and gathers from now on (two perf_counter
        calls each), and start the counts again."""
        self.group.timed = on
        self.group.stats = CommStats()
        self.broadcast_s, self.num_broadcasts = 0.0, 0

    def comm_stats(self) -> CommStats:
        """Rank 0's time in collectives (when timed) and in sending steps to the workers."""
        stats = self.group.stats
        return CommStats(stats.all_reduce_s, stats.gather_s, self.broadcast_s,
                         stats.num_all_reduce, stats.num_gather, self.num_broadcasts)

    def shutdown(self) -> None:
        """Stops every worker (idempotent); returns once they have exited."""
        self._finalizer()


def _with_port(spec: WorkerSpec, port: int) -> WorkerSpec:
    from dataclasses import replace

    return replace(spec, store_port=port)


def _recv(conn: multiprocessing.connection.Connection, rank: int) -> tuple[str, Any]:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError) as exc:
        raise TensorParallelError(f"tensor-parallel rank {rank} closed its pipe: {exc!r}") from exc


def _last_words(conn: multiprocessing.connection.Connection) -> str:
    """The traceback a failing worker sent before exiting, if any."""
    try:
        while conn.poll(0):
            kind, detail = pickle.loads(conn.recv_bytes())
            if kind == "error":
                return f":\n{detail}"
    except (EOFError, OSError, pickle.UnpicklingError):
        pass
    return ""


def _stop_workers(
    processes: list[subprocess.Popen[bytes]], conns: list[multiprocessing.connection.Connection]
) -> None:
    stop = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker pid %d did not stop; killing it", process.pid)
            process.kill()
            process.wait()
    for conn in conns:
        conn.close()
