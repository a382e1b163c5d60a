"""One replica: a full engine (LLMEngine driven by an AsyncLLMEngine) inside a Ray actor.

    ingress (ReplicaSetEngine)                 actor process (EngineReplica)
    --------------------------                 -----------------------------
    generate.remote(group_id, requests) ─────► AsyncLLMEngine.add_requests
        first item ◄── ("added", None) | ("invalid", message)
        then      ◄── ("outputs", [(index, RequestOutput), ...])   one item per engine step
    abort.remote(group_id) ──────────────────► the group's requests leave the batch

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
        self.engine = AsyncLLMEngine(LLMEngine(engine_args.create_engine_config()))
        self._groups: dict[str, RequestGroup] = {}
        self._aborted: set[str] = set()

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

    async def generate(
        self,
        group_id: str,
        requests: list[tuple[PromptInput | EngineInput, SamplingParams | None]],
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[tuple[str, Any]]:
        """Streams the group: an acknowledgement (or the validation error), then one batch per step."""
        self._ensure_started()
        try:
            group = await self.engine.add_requests(requests, group_id=group_id, lora_request=lora_request,
                                                  priority=priority)
        except ValueError as exc:
            yield "invalid", str(exc)
            return
        except EngineDeadError as exc:
            yield "dead", str(exc)
            return
        self._groups[group_id] = group
        if group_id in self._aborted:
            group.abort()
            self._groups.pop(group_id, None)
            return
        yield "added", None
        try:
            async with group:
                batch: list[Any] = []
                async for item in group:
                    batch.append(item)
                    # Outputs of one step arrive together; send them as one stream item.
                    if group._queue.empty():
                        yield "outputs", batch
                        batch = []
                if batch:
                    yield "outputs", batch
        except _Aborted:
            return
        except EngineDeadError as exc:
            yield "dead", str(exc)
        finally:
            self._groups.pop(group_id, None)
            self._aborted.discard(group_id)

    async def abort(self, group_id: str) -> None:
        """Ends the group's stream and frees its requests' blocks before the next step."""
        group = self._groups.get(group_id)
        if group is None:
            self._aborted.add(group_id)  # the abort overtook the add
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
