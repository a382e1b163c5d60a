"""N engine replicas on Ray behind the one OpenAI server: the ingress side.

`ReplicaSetEngine` offers the surface of `AsyncLLMEngine` the server uses (`add_requests`
returning a `RequestGroup`, `abort`, `stats`, `health`, `num_waiting`, `tokenizer`, ...), so
the FastAPI handlers do not know whether one engine or N replicas serve them.

    add_requests ─► router.route(prompt head / adapter) ─► replica.add (one Ray call: ack)
                       ▲ in-flight counts
    one pump task per replica ◄── replica.outputs (one Ray stream, opened once: a list of
                                  every group's outputs per engine step) ─► RequestGroups

A replica that dies is restarted by Ray (`max_restarts`); meanwhile the router skips it. A
group it was serving is re-sent to another replica if none of its outputs had reached the
caller yet, else it fails with `EngineDeadError` (a 503 or an SSE error chunk). A poll task
reads every replica's statistics twice a second: the aggregate feeds the server's metrics,
and a replica answering again is marked up (its adapters registered again first); its pump
then opens a new outputs stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.core.scheduler import SchedulerStats
from pagedserve.distributed.metrics import ReplicaMetrics
from pagedserve.distributed.replica import END, EngineReplica
from pagedserve.distributed.router import ReplicaRouter, RouterConfig
from pagedserve.engine.async_engine import EngineDeadError, EngineObserver, RequestGroup
from pagedserve.engine.input_processor import EngineInput, InputProcessor
from pagedserve.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from pagedserve.engine_args import EngineArgs
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
# Actors' names in their Ray namespace: f"{prefix}-{index}" (tools and tests find them by name).
REPLICA_NAME_PREFIX = "pagedserve-replica"


@dataclass
class _Flight:
    """The ingress's bookkeeping of one group routed to a replica."""

    group: RequestGroup
    requests: list[tuple[PromptInput | EngineInput, SamplingParams | None]]
    lora_request: LoRARequest | None
    prompt_token_ids: list[int] | None
    arrival_time: float
    priority: int = 0
    replica: int = -1
    streamed: bool = False
    # Per (request, sample) of the group: each sample of an n > 1 request has its own times.
    last_token_time: dict[tuple[int, int], float] = field(default_factory=dict)


class ReplicaSetEngine:
    """`num_replicas` engines in Ray actors, routed by prefix / adapter affinity.

    Args:
        engine_args: every replica's settings (its data_parallel_size is ignored).
        num_replicas: how many engines.
        observer: the server's metrics (timings are measured here, on the ingress).
        router_config: routing knobs; the block size defaults to the engine's.
        max_restarts: how often Ray restarts a dead replica (-1: always).
        num_cpus_per_replica: Ray CPUs each actor reserves (torch gets as many threads).
        namespace: the Ray namespace of the named actors.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        num_replicas: int,
        observer: EngineObserver | None = None,
        router_config: RouterConfig | None = None,
        max_restarts: int = -1,
        num_cpus_per_replica: float = 1,
        namespace: str = "pagedserve",
        seed: int | None = None,
    ) -> None:
        import ray

        if not ray.is_initialized():
            # Joins the cluster named by RAY_ADDRESS (`ray start --head` ...), else starts one here.
            ray.init(namespace=namespace, log_to_driver=False)
        self._ray = ray
        self.observer = observer or EngineObserver()
        replica_args = engine_args.replace(data_parallel_size=1, distributed_executor_backend=None)
        actor = ray.remote(EngineReplica)
        self.replicas = [
            actor.options(
                name=f"{REPLICA_NAME_PREFIX}-{i}", namespace=namespace, max_restarts=max_restarts,
                max_task_retries=0, num_cpus=num_cpus_per_replica, max_concurrency=1000,
            ).remote(replica_args, i)
            for i in range(num_replicas)
        ]
        info = ray.get([r.info.remote() for r in self.replicas])[0]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.hidden_size: int = info.get("hidden_size", 0)
        self.tokenizer = self._load_tokenizer(replica_args)
        # The handlers process inputs here, on the ingress; replicas get them processed.
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, info["eos_token_ids"],
            info["sampling_defaults"], replica_args.scheduling_policy, info.get("hidden_size"),
        )
        config = router_config or RouterConfig(block_size=engine_args.block_size)
        self.router = ReplicaRouter(num_replicas, config, seed=seed)
        self.metrics = ReplicaMetrics(num_replicas, getattr(self.observer, "registry", None))
        self.lora_manager = _BroadcastLoRA(self)
        self.stats: EngineStats = _empty_stats()
        self.replica_stats: list[EngineStats | None] = [None] * num_replicas
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count()
        self._poll_task: asyncio.Task[None] | None = None
        self._pumps: list[asyncio.Task[None]] = []
        # Bumped each time a replica's outputs stream fails: a group acknowledged by a replica
        # that was lost meanwhile is handled as lost too.
        self._lost_count = [0] * num_replicas
        self._stopping = False
        self._started = False

    @staticmethod
    def _load_tokenizer(engine_args: EngineArgs) -> Any:
        if engine_args.skip_tokenizer_init:
            return None
        from pagedserve.engine.tokenizer import load_tokenizer

        return load_tokenizer(engine_args.tokenizer or str(engine_args.model))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        self._poll_task = loop.create_task(self._poll_forever())
        self._pumps = [loop.create_task(self._pump(i)) for i in range(len(self.replicas))]
        self._started = True

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Fails every in-flight group (EngineDeadError) and stops the replicas."""
        if self._stopping:
            return
        self._stopping = True
        if self._poll_task is not None:
            self._poll_task.cancel()
        for pump in self._pumps:
            pump.cancel()
        for flight in list(self._flights.values()):
            flight.group.put(EngineDeadError("the server is shutting down"))
        self._flights.clear()
        for replica in self.replicas:
            self._ray.kill(replica, no_restart=True)

    def health(self) -> str | None:
        """None while at least one replica is up; a dead or restarting replica is routed around."""
        if self._stopping:
            return "the server is shutting down"
        if not any(self.router.up):
            return f"no replica is up (all {len(self.replicas)} failed)"
        return None

    @property
    def num_waiting(self) -> int:
        return self.stats.scheduler.num_waiting

    # ---- requests ----------------------------------------------------------------------------

    async def add_requests(
        self,
        requests: list[tuple[PromptInput | EngineInput, SamplingParams | None]],
        arrival_time: float | None = None,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestGroup:
        """Routes the group to one replica (its samples then share a prefix there).

        Raises:
            ValueError: a request failed the engine's validation.
            EngineDeadError: no replica could take it.
        """
        if self._stopping or not self._started:
            raise EngineDeadError("the engine is not running")
        group_id = group_id or f"req-{next(self._ids)}"
        ids = [f"{group_id}-{i}" for i in range(len(requests))]
        flight = _Flight(
            RequestGroup(self, ids), requests, lora_request, self._prompt_token_ids(requests[0][0]),
            arrival_time if arrival_time is not None else time.monotonic(), priority,
        )
        self._flights[group_id] = flight  # before the add: its outputs may overtake the reply
        try:
            await self._submit(group_id, flight, frozenset())
        except BaseException:
            self._flights.pop(group_id, None)
            raise
        return flight.group

    def _prompt_token_ids(self, prompt: PromptInput | EngineInput) -> list[int] | None:
        if isinstance(prompt, EngineInput):
            return prompt.prompt_token_ids
        if isinstance(prompt, list):
            return prompt
        if isinstance(prompt, dict):
            if prompt.get("prompt_token_ids") is not None:
                return list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt") or ""
        if self.tokenizer is None or not isinstance(prompt, str):
            return None
        return self.tokenizer.encode(prompt)

    async def _submit(self, group_id: str, flight: _Flight, exclude: frozenset[int]) -> None:
        """Sends the group to a replica and waits for its acknowledgement; tries the others
        when a replica fails before acknowledging. Its outputs then come through the pump."""
        ray = self._ray
        adapter = flight.lora_request.lora_name if flight.lora_request is not None else None
        size = len(flight.requests)
        while True:
            try:
                route = self.router.route(flight.prompt_token_ids, adapter, exclude)
            except RuntimeError as exc:
                raise EngineDeadError(str(exc)) from None
            replica = route.replica
            lost_before = self._lost_count[replica]
            self.router.started(replica, size)
            try:
                kind, payload = await _as_future(self.replicas[replica].add.remote(
                    group_id, flight.requests, flight.lora_request, flight.priority))
            except ray.exceptions.RayError as exc:
                self.router.finished(replica, size)
                self._replica_failed(replica, exc)
                self.metrics.retried(replica)
                exclude = exclude | {replica}
                continue
            except asyncio.CancelledError:  # the caller went away: the add may still land
                self.router.finished(replica, size)
                self.replicas[replica].abort.remote(group_id)
                raise
            if kind != "added":
                self.router.finished(replica, size)
                if kind == "invalid":
                    raise ValueError(payload)
                raise EngineDeadError(payload)
            if self._lost_count[replica] != lost_before and not flight.streamed:
                # Its outputs stream failed while the reply travelled: nothing will come from there.
                self.router.finished(replica, size)
                self.metrics.retried(replica)
                exclude = exclude | {replica}
                continue
            flight.replica = replica
            self.metrics.routed_to(replica, route.reason)
            return

    async def _pump(self, replica: int) -> None:
        """Reads one replica's outputs stream into its groups; after a failure, waits until the
        replica answers the poll again and opens a new stream."""
        ray = self._ray
        while not self._stopping:
            stream = self.replicas[replica].outputs.options(num_returns="streaming").remote()
            try:
                async for ref in stream:
                    self._dispatch(await ref)
            except ray.exceptions.RayError as exc:
                self._replica_lost(replica, exc)
            except Exception:  # noqa: BLE001 - the pump must outlive any one bad item
                logger.exception("replica %d: outputs stream failed", replica)
            await asyncio.sleep(POLL_INTERVAL_S)
            while not self._stopping and not self.router.up[replica]:
                await asyncio.sleep(POLL_INTERVAL_S)

    def _dispatch(self, batch: list[tuple[str, int, Any]]) -> None:
        for group_id, index, payload in batch:
            flight = self._flights.get(group_id)
            if flight is None:  # aborted, or failed over to another replica
                continue
            if index == END:
                self._end_flight(group_id, flight)
                if payload is not None:
                    flight.group.put(EngineDeadError(payload))
            else:
                self._deliver(flight, index, payload)

    def _end_flight(self, group_id: str, flight: _Flight) -> None:
        self._flights.pop(group_id, None)
        if flight.replica >= 0:
            self.router.finished(flight.replica, len(flight.requests))
            flight.replica = -1

    def _replica_lost(self, replica: int, exc: BaseException) -> None:
        """A replica's stream failed: its groups fail, or go elsewhere if nothing was streamed."""
        self._lost_count[replica] += 1
        self._replica_failed(replica, exc)
        for group_id, flight in list(self._flights.items()):
            if flight.replica != replica:
                continue
            self.router.finished(replica, len(flight.requests))
            flight.replica = -1
            if flight.streamed:
                self._flights.pop(group_id, None)
                flight.group.put(EngineDeadError(f"replica {replica} died while serving this request"))
            else:
                self.metrics.retried(replica)
                asyncio.ensure_future(self._resubmit(group_id, flight, replica))

    async def _resubmit(self, group_id: str, flight: _Flight, failed: int) -> None:
        try:
            await self._submit(group_id, flight, frozenset({failed}))
        except Exception as exc:  # noqa: BLE001 - every failure ends the group, never the ingress
            self._flights.pop(group_id, None)
            flight.group.put(exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc)))

    def _deliver(self, flight: _Flight, index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        flight.streamed = True
        if not any(key[0] == index for key in flight.last_token_time):
            self.observer.on_first_token(now - flight.arrival_time, len(output.prompt_token_ids))
        for completion in output.outputs:
            last = flight.last_token_time.get((index, completion.index))
            self.observer.on_tokens(None if last is None else now - last, len(completion.token_ids))
            flight.last_token_time[index, completion.index] = now
        if output.finished:
            self.observer.on_finished(now - flight.arrival_time, output.outputs[0].finish_reason or "stop")
            if output.metrics is not None:  # the replica's own clock: only differences are used
                self.observer.on_request_metrics(output.metrics)
        flight.group.put((index, output))

    def _replica_failed(self, replica: int, exc: BaseException) -> None:
        if self.router.up[replica]:
            logger.warning("replica %d failed (%s); routing around it until it is back", replica, exc)
        self.router.mark_down(replica)
        self.metrics.failed(replica)

    def abort(self, request_ids: list[str]) -> None:
        """The group's requests leave their replica's batch (RequestGroup.abort calls this)."""
        group_id = request_ids[0].rsplit("-", 1)[0] if request_ids else None
        flight = self._flights.get(group_id) if group_id else None
        if flight is None:
            return
        if flight.replica >= 0:
            self.replicas[flight.replica].abort.remote(group_id)
        self._end_flight(group_id, flight)

    # ---- statistics and health -----------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(POLL_INTERVAL_S)

    async def poll(self) -> None:
        """Reads every replica's statistics; marks replicas down / up by whether they answer."""
        results = await asyncio.gather(
            *(asyncio.wait_for(_as_future(r.stats.remote()), POLL_TIMEOUT_S) for r in self.replicas),
            return_exceptions=True,
        )
        for i, result in enumerate(results):
            if isinstance(result, BaseException) or result[1] is not None:
                self.replica_stats[i] = None
                if self.router.up[i]:
                    self._replica_failed(i, result if isinstance(result, BaseException) else RuntimeError(result[1]))
                continue
            self.replica_stats[i] = result[0]
            if not self.router.up[i]:
                await self._replica_back(i)
        self.stats = _aggregate([s for s in self.replica_stats if s is not None])
        self.observer.on_stats(self.stats)
        self.metrics.update(self.replica_stats, self.router.up, self.router.in_flight)

    async def _replica_back(self, replica: int) -> None:
        try:
            for request in self.lora_manager.registered:
                await _as_future(self.replicas[replica].register_lora.remote(request))
        except Exception as exc:  # noqa: BLE001 - stays down; the next poll tries again
            logger.warning("replica %d is back but its adapters failed to load: %s", replica, exc)
            return
        logger.info("replica %d is back", replica)
        self.router.mark_up(replica)

    def configure_router(self, config: RouterConfig) -> None:
        """New routing knobs from now on (in-flight counts and replica health carry over)."""
        self.router.config = config

    # ---- tools and tests -------------------------------------------------------------------------

    def call_on_replicas(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """fn(engine) on every replica between steps (blocking)."""
        return self._ray.get([r.call.remote(fn) for r in self.replicas])

    def check_no_leaks(self) -> None:
        """Every live replica's leak check (a leak raises, via Ray, the replica's AssertionError);
        a replica killed for good holds no KV cache and is skipped."""
        ray = self._ray
        for ref in [r.check_no_leaks.remote() for r in self.replicas]:
            try:
                ray.get(ref)
            except ray.exceptions.ActorDiedError:
                continue


class _BroadcastLoRA:
    """`lora_manager.register(...)` for the server's LoRA registry: every replica loads it."""

    def __init__(self, replicas: ReplicaSetEngine) -> None:
        self._set = replicas
        self.registered: list[LoRARequest] = []

    def register(self, request: LoRARequest, load_now: bool = True, adapter: Any = None) -> None:
        ray = self._set._ray
        ray.get([r.register_lora.remote(request) for r in self._set.replicas])
        self.registered.append(request)


def _as_future(ref: Any) -> asyncio.Future[Any]:
    return asyncio.wrap_future(ref.future())


def _empty_stats() -> EngineStats:
    return _aggregate([])


def _aggregate(stats: Iterable[EngineStats]) -> EngineStats:
    """Sums over replicas; KV usage is the pool-weighted mean (used / total over all pools)."""
    stats = list(stats)
    sched: dict[str, Any] = {}
    for f in fields(SchedulerStats):
        sched[f.name] = sum(getattr(s.scheduler, f.name) for s in stats)
    total = sched["kv_blocks_total"]
    sched["kv_usage"] = sched["kv_blocks_used"] / total if total else 0.0
    return EngineStats(
        scheduler=SchedulerStats(**sched),
        num_prompt_tokens_total=sum(s.num_prompt_tokens_total for s in stats),
        num_generation_tokens_total=sum(s.num_generation_tokens_total for s in stats),
        num_steps_total=sum(s.num_steps_total for s in stats),
        last_step_num_tokens=sum(s.last_step_num_tokens for s in stats),
    )
