"""One replica: a full engine (LLMEngine driven by an AsyncLLMEngine) inside a Ray actor.

    ingress (ReplicaSetEngine)                 actor process (EngineReplica)
    --------------------------                 -----------------------------
    add.remote(group_id, requests) ──────────► AsyncLLMEngine.add_requests
        reply ◄── ("added", None) | ("invalid", message) | ("dead", message)
    outputs.remote() (one stream per replica, opened once)
        ◄── [(group_id, index, RequestOutput) | (group_id, END, error or None), ...]
            one item per engine step, every group's outputs of that step together
    abort.remote(group_id) ──────────────────► the group's requests leave the batch

Why one stream for every group: a Ray streaming call per request costs a task launch, and
each of its items an object-store round trip; with many requests in flight the ingress
spent its CPU on them (two cores shared with the replicas). One stream per replica moves a
whole step's outputs in one item.

The class is plain Python; `ray.remote` turns it into an actor where it is started
(replica_set.py), so this module imports no Ray. Its async methods run on the actor's event
loop; the engine steps on its own thread, as in the single-process server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestGroup
from pagedserve.engine.input_processor import EngineInput
from pagedserve.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from pagedserve.engine_args import EngineArgs
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams

_MAX_UNCLAIMED_ABORTS = 10_000

# The item that ends a group in the outputs stream: (group_id, END, None or an error message).
END = -1


class _Aborted(Exception):
    """Put into an aborted group's queue so its stream ends at once."""


class EngineReplica:
    """A full engine serving the requests the ingress routes to it.

    Args:
        engine_args: the settings of this replica's engine (data_parallel_size 1).
        replica_index: its place in the replica set (for logs and metrics).
    """

    def __init__(self, engine_args: EngineArgs, replica_index: int) -> None:
        self.replica_index = replica_index
        # Built on the thread that steps it (engine/engine_thread.py).
        self.engine = AsyncLLMEngine.build(lambda: LLMEngine(engine_args.create_engine_config()))
        self._groups: dict[str, RequestGroup] = {}
        # Aborts that found no group (insertion-ordered, bounded: an abort that arrives after its
        # group ended is never claimed by an add).
        self._aborted: dict[str, None] = {}
        self._outbox: list[tuple[str, int, Any]] = []
        self._ready = asyncio.Event()
        self._forwarders: set[asyncio.Task[None]] = set()

    def _ensure_started(self) -> None:
        if self.engine._thread is None:
            self.engine.start(asyncio.get_running_loop())

    async def info(self) -> dict[str, Any]:
        """What the ingress needs to validate requests without an engine of its own."""
        self._ensure_started()
        return {
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "hidden_size": self.engine.hidden_size,
            "eos_token_ids": self.engine.input_processor.eos_token_ids,
            "sampling_defaults": self.engine.input_processor.sampling_defaults,
            "pid": os.getpid(),
            "replica": self.replica_index,
        }

    async def stats(self) -> tuple[EngineStats, str | None]:
        """The latest statistics snapshot and the engine's health (None when healthy)."""
        self._ensure_started()
        return self.engine.stats, self.engine.health()

    async def add(
        self,
        group_id: str,
        requests: list[tuple[PromptInput | EngineInput, SamplingParams | None]],
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> tuple[str, str | None]:
        """Queues the group; its outputs come through `outputs`. ("added" | "invalid" | "dead", message)."""
        self._ensure_started()
        try:
            group = await self.engine.add_requests(requests, group_id=group_id, lora_request=lora_request,
                                                  priority=priority)
        except ValueError as exc:
            return "invalid", str(exc)
        except EngineDeadError as exc:
            return "dead", str(exc)
        if group_id in self._aborted:  # the abort overtook the add
            del self._aborted[group_id]
            group.abort()
            return "added", None  # the ingress has dropped it already
        self._groups[group_id] = group
        task = asyncio.get_running_loop().create_task(self._forward(group_id, group))
        self._forwarders.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._forwarders.discard)
        return "added", None

    async def _forward(self, group_id: str, group: RequestGroup) -> None:
        """Moves one group's outputs into the outbox, then its END item."""
        error: str | None = None
        try:
            async with group:
                async for index, output in group:
                    self._post((group_id, index, output))
        except _Aborted:
            pass
        except Exception as exc:  # noqa: BLE001 - EngineDeadError or a request's own failure
            error = str(exc) or repr(exc)
        finally:
            self._groups.pop(group_id, None)
            self._post((group_id, END, error))

    def _post(self, item: tuple[str, int, Any]) -> None:
        self._outbox.append(item)
        self._ready.set()

    async def outputs(self) -> AsyncIterator[list[tuple[str, int, Any]]]:
        """Every group's outputs, one list per wake-up (an engine step hands its outputs to the
        event loop at once, so a list is usually one step). The ingress holds one open."""
        self._ensure_started()
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._outbox = self._outbox, []
            if batch:
                yield batch

    async def abort(self, group_id: str) -> None:
        """Ends the group's stream and frees its requests' blocks before the next step."""
        group = self._groups.get(group_id)
        if group is None:
            self._aborted[group_id] = None  # the abort overtook the add (or came after the end)
            if len(self._aborted) > _MAX_UNCLAIMED_ABORTS:
                del self._aborted[next(iter(self._aborted))]
            return
        group.abort()
        group.put(_Aborted())

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) between steps (tests' leak checks, adapter registration)."""
        self._ensure_started()
        return await asyncio.to_thread(self.engine.call_in_engine_thread, fn)

    async def register_lora(self, request: LoRARequest) -> None:
        await self.call(lambda engine: engine.lora_manager.register(request, load_now=True))

    async def check_no_leaks(self) -> None:
        """The engine's leak check, run in its thread once idle (raises AssertionError on a leak)."""
        for _ in range(200):
            if not await self.call(lambda engine: engine.has_unfinished_requests()):
                break
            await asyncio.sleep(0.05)
        await self.call(lambda engine: engine.assert_no_leaks())
