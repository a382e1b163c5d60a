"""The one OS thread that builds the server's engine and then steps it.

Why one thread for both: torch's CPU ops run their parallel regions on OpenMP (libgomp), which
keeps a pool of worker threads for each thread that starts a region. The server used to load
the model on the main thread and step it on a thread of its own, so the process had two pools,
and every parallel region of every step then cost ~50 us more (two context switches each;
`x.add(1)` on 64k floats: 7 us from the thread that ran the first region, 57-66 us from another
one, 2-core EPYC). Gemma-3-270M decoded a token in 22-29 ms over HTTP against 14.5 ms offline.
A process whose regions all start from one thread keeps one pool: built and stepped here, the
server decodes as fast as the offline `LLM`. Any other long-lived thread that runs a parallel
torch op brings a second pool back (one region from the LoRA manager's loader thread, and the
engine thread's `x.add(1)` went from 8.5 to 73 us): so adapter loads read files on other threads
and convert the tensors here (lora/peft_loader.py `read_peft_adapter` / `to_adapter`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running the calls submitted to it, in order, until `close`."""

    def __init__(self, name: str = "pagedserve-engine") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Runs fn() on the thread after the calls before it; its result or exception."""
        future: Future[T] = Future()
        self._calls.put((fn, future))
        return future

    def close(self) -> None:
        """The thread ends once the calls already submitted have run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the submitter's result() raises it
                    future.set_exception(exc)
