"""The async front of the engine: one thread owns the LLMEngine, asyncio callers stream outputs.

    event loop thread                         engine thread (owns LLMEngine, torch)
    -----------------                         -------------------------------------
    add_requests() ----_Add(reqs, future)--->  commands: drained between steps
    RequestGroup.abort() --_Abort(ids)----->     add_request / abort_request
    call_in_engine_thread() --_Call(fn)---->     fn(engine), between steps
    unload_lora() --_Unload(lora)---------->     fail the adapter's requests, unregister it
    shutdown() --_Stop()------------------->     ends the loop
                                              step() -> [RequestOutput]
    RequestGroup queue <--call_soon_threadsafe--  one batch of (group, index, output) per step

The engine is CPU-bound torch; its kernels release the GIL, so the event loop stays
responsive while a step runs. Only the engine thread ever touches the LLMEngine: aborts
and adds are commands, statistics are a snapshot replaced after every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine import registry
from pagedserve.engine.engine_thread import EngineThread
from pagedserve.engine.input_processor import EngineInput
from pagedserve.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from pagedserve.lora.request import AdapterNotRegisteredError, LoRARequest
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash or shutdown); no request can be served."""


class EngineObserver:
    """Receives per-request timings from the engine thread (no-op default; see server/metrics.py)."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, itl_s: float | None, num_tokens: int) -> None: ...
    def on_finished(self, e2e_s: float, finish_reason: str) -> None: ...
    def on_request_metrics(self, metrics: RequestMetrics) -> None: ...
    def on_stats(self, stats: EngineStats) -> None: ...


class RequestGroup:
    """The outputs of a set of engine requests (one per choice), consumed on the event loop.

    Iterating yields `(index, RequestOutput)` until every request has finished; an engine
    failure is raised from the iteration. `async with group:` aborts whatever is still
    unfinished on exit, so a cancelled or failed consumer always frees its KV blocks.
    """

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item[1].finished:
                self._unfinished.discard(item[0])
            yield item

    def abort(self) -> None:
        """Aborts the unfinished requests; their blocks are free before the next step."""
        if self._unfinished:
            self._engine.abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping of one engine request."""

    group: RequestGroup
    index: int
    arrival_time: float
    lora_id: int = 0  # 0: the base model
    # Per sample (CompletionOutput.index) of an n > 1 request: each has its own token times.
    last_token_time: dict[int, float] = field(default_factory=dict)


# ---- the engine thread's commands: one small dataclass each, drained between steps ----------


@dataclass(slots=True)
class _Add:
    """Queue these requests as one group, all or none; `done` reports the outcome."""

    requests: list[tuple[str, PromptInput | EngineInput, SamplingParams | None]]
    group: RequestGroup
    arrival_time: float
    done: concurrent.futures.Future[None]
    lora_request: Any = None
    priority: int = 0


@dataclass(slots=True)
class _Abort:
    """End these requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    """Run fn(engine) between steps; its result or exception goes to `done`."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


@dataclass(slots=True)
class _Unload:
    """Fail the adapter's in-flight requests (AdapterNotRegisteredError), then unregister it."""

    lora: LoRARequest
    done: concurrent.futures.Future[int]


@dataclass(slots=True)
class _Stop:
    """Leave the loop: in-flight requests are aborted and their callers told."""


_Command = _Add | _Abort | _Call | _Unload | _Stop


class AsyncLLMEngine:
    """Drives an LLMEngine from a dedicated thread; many asyncio callers share its batch.

    Args:
        engine: the engine; from now on only the engine thread may touch it.
        observer: receives timings and statistics (called from the engine thread).
        stall_timeout_s: `health()` fails when there is work but no step completed for this long.
    """

    def __init__(
        self, engine: LLMEngine, observer: EngineObserver | None = None, stall_timeout_s: float = 60.0,
        thread: EngineThread | None = None,
    ) -> None:
        self.engine = engine
        # From now on only our thread steps it; checks from elsewhere must go through us.
        registry.set_driver(engine, self)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.hidden_size = engine.hidden_size
        # Stateless but for the tokenizer: handlers process their inputs with it, off this thread.
        self.input_processor = engine.input_processor
        # Thread-safe: handlers compile grammars through it before queueing (cache shared).
        self.structured_outputs = engine.structured_outputs
        self.observer = observer or EngineObserver()
        self.stall_timeout_s = stall_timeout_s
        self.stats: EngineStats = engine.get_stats()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The thread that steps the engine: the one that built it when given (engine_thread.py).
        self._runner = thread
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._busy = False
        self._last_progress = time.monotonic()

    @classmethod
    def build(
        cls, factory: Callable[[], LLMEngine], observer: EngineObserver | None = None, stall_timeout_s: float = 60.0,
    ) -> AsyncLLMEngine:
        """The engine `factory()` makes, made on the thread that will step it (see
        engine/engine_thread.py: a second OpenMP pool slows every op)."""
        thread = EngineThread()
        try:
            engine = thread.submit(factory).result()
        except BaseException:
            thread.close()
            raise
        return cls(engine, observer, stall_timeout_s, thread=thread)

    # ---- lifecycle (event loop thread) ---------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread; outputs are delivered on `loop` (default: the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        runner = self._runner or EngineThread()
        self._thread = runner.thread
        runner.submit(self._run)
        runner.close()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Aborts every in-flight request (callers see EngineDeadError) and stops the thread."""
        if self._thread is None:
            return
        if not self._stopping:
            self._stopping = True
            self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout_s)

    def health(self) -> str | None:
        """None when healthy, else why not: the loop died, or has work but made no progress."""
        if self._error is not None:
            return f"engine loop died: {self._error!r}"
        if self._thread is None or not self._thread.is_alive():
            return "engine loop is not running"
        stalled_for = time.monotonic() - self._last_progress
        if self._busy and stalled_for > self.stall_timeout_s:
            return f"engine loop stalled: no step completed for {stalled_for:.1f} s"
        # An idle engine would only notice a dead tensor-parallel worker at its next step.
        return self.engine.health_problem()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: the scheduler's waiting queue plus adds not yet processed."""
        return self.stats.scheduler.num_waiting + self._commands.qsize()

    # ---- requests (event loop thread) ---------------------------------------------------

    async def add_requests(
        self,
        requests: list[tuple[PromptInput | EngineInput, SamplingParams | None]],
        arrival_time: float | None = None,
        group_id: str | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> RequestGroup:
        """Queues the requests as one group, all or none (an `EngineInput` comes processed,
        with its own parameters: pass None as its SamplingParams).

        Raises:
            ValueError: a request failed the engine's validation (none of them was kept).
            EngineDeadError: the engine loop is not running.
        """
        self._check_alive()
        group_id = group_id or f"req-{next(self._ids)}"
        ids = [f"{group_id}-{i}" for i in range(len(requests))]
        group = RequestGroup(self, ids)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        add = _Add(
            [(rid, prompt, params) for rid, (prompt, params) in zip(ids, requests, strict=True)],
            group, arrival_time if arrival_time is not None else time.monotonic(), done, lora_request, priority,
        )
        self._commands.put(add)
        try:
            await self._wait_for_thread(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            self.abort(ids)  # the caller left before the engine thread got to the add
            raise
        return group

    async def _wait_for_thread(self, future: asyncio.Future[Any]) -> Any:
        # A command queued just as the thread exits would never be answered: check liveness.
        while True:
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            if self._thread is None or not self._thread.is_alive():
                future.cancel()
                raise EngineDeadError("the engine is not running")

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request (vLLM's AsyncLLM.generate); aborts it if left early."""
        group = await self.add_requests([(prompt, params)], group_id=request_id)
        async with group:
            async for _, output in group:
                yield output

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe; the requests leave the batch before the next step."""
        self._commands.put(_Abort(list(request_ids)))

    def call_in_engine_thread(self, fn: Callable[[LLMEngine], Any], timeout_s: float = 30.0) -> Any:
        """Runs fn(engine) between steps and returns its result (blocking; for tests and tools)."""
        return self.submit_call(fn).result(timeout_s)

    def submit_call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        """Queues fn(engine) to run between steps; its result or exception comes in the future."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return done

    async def unload_lora(self, lora: LoRARequest) -> int:
        """Unregisters the adapter between steps; its in-flight requests end first, each
        caller seeing AdapterNotRegisteredError. Adds queued after this never run with it
        (the engine thread refuses an unregistered adapter). Returns how many requests ended.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        self._check_alive()
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._commands.put(_Unload(lora, done))
        return await self._wait_for_thread(asyncio.wrap_future(done))

    def _check_alive(self) -> None:
        if self._stopping or self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running" + (f": {self._error!r}" if self._error else ""))

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # Block only when idle: a busy engine steps again right after the commands.
                # An idle engine is not stalled: the stall clock runs only while there is work.
                self._set_busy(self.engine.has_unfinished_requests())
                if not self._process_commands(block=not self._busy):
                    break
                self._set_busy(self.engine.has_unfinished_requests())
                if self._busy:
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - every caller must hear about it
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))
            self.engine.shutdown()  # tensor-parallel workers: they cannot go on without it
            return
        self.engine.abort_request(list(self._tracked))
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.engine.shutdown()

    def _process_commands(self, block: bool) -> bool:
        """Applies queued commands; False once a stop command arrived."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            match command:
                case _Stop():
                    return False
                case _Add():
                    self._add(command)
                case _Abort(request_ids):
                    self._abort(request_ids)
                case _Call(fn, done):
                    _call(fn, self.engine, done)
                case _Unload(lora, done):
                    _call(lambda _: self._unload(lora), self.engine, done)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, add: _Add) -> None:
        added: list[str] = []
        lora = add.lora_request
        # The serving path never registers implicitly: an adapter unloaded since the caller
        # resolved its name would otherwise come back (a phantom) or fail later as a 500.
        if lora is not None and not self._is_registered(lora):
            add.done.set_exception(AdapterNotRegisteredError(lora.lora_name))
            return
        try:
            for request_id, prompt, params in add.requests:
                self.engine.add_request(
                    request_id, prompt, params, arrival_time=add.arrival_time, lora_request=add.lora_request,
                    priority=add.priority,
                )
                added.append(request_id)
        except Exception as exc:  # noqa: BLE001 - a validation error goes back to its caller only
            self.engine.abort_request(added)
            add.done.set_exception(exc)
            return
        for index, (request_id, _, _) in enumerate(add.requests):
            self._tracked[request_id] = _Tracked(add.group, index, add.arrival_time,
                                                 lora.lora_int_id if lora is not None else 0)
        add.done.set_result(None)
        self.stats = self.engine.get_stats()

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self.observer.on_finished(time.monotonic() - tracked.arrival_time, "abort")
        self.stats = self.engine.get_stats()

    def _is_registered(self, lora: LoRARequest) -> bool:
        manager = self.engine.lora_manager
        return manager is not None and manager.registered.get(lora.lora_int_id) == lora

    def _unload(self, lora: LoRARequest) -> int:
        ids = [rid for rid, tracked in self._tracked.items() if tracked.lora_id == lora.lora_int_id]
        groups = {id(self._tracked[rid].group): self._tracked[rid].group for rid in ids}
        self._abort(ids)  # frees their blocks and unpins the adapter
        error = AdapterNotRegisteredError(lora.lora_name)
        self._deliver([(group, error) for group in groups.values()])
        if self.engine.lora_manager is not None:
            self.engine.lora_manager.unregister(lora.lora_int_id)
        return len(ids)

    def _set_busy(self, busy: bool) -> None:
        if busy and not self._busy:
            self._last_progress = time.monotonic()  # the stall clock starts with the work
        self._busy = busy

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        self._last_progress = now
        batch = [self._track_output(output, now) for output in outputs]
        self.stats = self.engine.get_stats()
        self.observer.on_stats(self.stats)
        self._deliver([item for item in batch if item is not None])

    def _track_output(self, output: RequestOutput, now: float) -> tuple[RequestGroup, Any] | None:
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return None
        if not tracked.last_token_time:
            self.observer.on_first_token(now - tracked.arrival_time, len(output.prompt_token_ids))
        for completion in output.outputs:
            last = tracked.last_token_time.get(completion.index)
            self.observer.on_tokens(None if last is None else now - last, len(completion.token_ids))
            tracked.last_token_time[completion.index] = now
        if output.finished:
            del self._tracked[output.request_id]
            self.observer.on_finished(now - tracked.arrival_time, output.outputs[0].finish_reason or "stop")
            if output.metrics is not None:
                self.observer.on_request_metrics(output.metrics)
        return tracked.group, (tracked.index, output)

    def _deliver(self, batch: list[tuple[RequestGroup, Any]]) -> None:
        if not batch or self._loop is None:
            return
        try:
            # One wake-up of the event loop per step, not one per request.
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            logger.warning("event loop closed; dropping %d outputs", len(batch))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Ends every caller: tracked groups get `error`, queued adds and calls raise it."""
        groups = {id(t.group): t.group for t in self._tracked.values()}
        self._tracked.clear()
        self._deliver([(group, error) for group in groups.values()])
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add | _Call | _Unload):
                command.done.set_exception(error)


def _put_all(batch: list[tuple[RequestGroup, Any]]) -> None:
    for group, item in batch:
        group.put(item)


def _call(fn: Callable[[LLMEngine], Any], engine: LLMEngine, done: concurrent.futures.Future[Any]) -> None:
    try:
        done.set_result(fn(engine))
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        done.set_exception(exc)
