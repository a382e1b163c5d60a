"""Compiles constraints off the hot path and keeps one matcher per sequence.

    server handler / LLMEngine.add_request
        -> StructuredOutputManager.compile_async(params)   a small worker pool, cached by spec
        -> RequestGrammar(compiled) per sequence            (n / best_of: one each)
    model runner, each step
        -> RequestGrammar.fill_bitmask(output_token_ids, bitmask, row)
           (the matcher first catches up with the tokens the sequence kept)

One manager serves one engine, hence one tokenizer: the cache key is (kind, spec, compact
JSON) and the tokenizer is implied.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from pagedserve.config import STRUCTURED_OUTPUT_BACKENDS
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
)
from pagedserve.structured_outputs.selector import load_backend

logger = logging.getLogger(__name__)

BACKENDS = tuple(b for b in STRUCTURED_OUTPUT_BACKENDS if b != "auto")
_CACHE_SIZE = 512
# Grammar compilations at once: a slow one (a huge choice list, a deep schema) holds one.
COMPILE_WORKERS = 4
# A compile waits at least this long for a free worker (more with a longer compile timeout).
QUEUE_WAIT_MIN_S = 30.0
STARTED_POLL_S = 0.01
# Tokens compared at the end of a sequence to find rejected proposals (>= the longest run).
_TAIL_CHECK = 16


class StructuredOutputManager:
    """Args:
        backend: "llguidance" or "xgrammar" (validated at construction).
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's size).
        eos_token_id: the engine's EOS id; the grammar allows it only once complete.
        compile_timeout_s: a compilation slower than this fails its request (400); counted
            from when its own compile starts, not from when it was queued.
        num_workers: compilations run at once (a slow grammar holds one worker, not all).
        load: builds the backend from (name, tokenizer, vocab_size, eos_token_id).
    """

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 compile_timeout_s: float = 10.0, num_workers: int = COMPILE_WORKERS,
                 load: Callable[..., GrammarBackend] = load_backend) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend_name = backend
        self.compile_timeout_s = compile_timeout_s
        self._args = (tokenizer, vocab_size, eos_token_id)
        self._load = load
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        # Daemon threads of our own (not a ThreadPoolExecutor, whose threads are joined at
        # exit): a pathological grammar still compiling never blocks the process from ending.
        self._queue: queue.Queue[tuple[StructuredOutputsParams, Future[CompiledGrammar]]] = queue.Queue()
        self._num_workers = num_workers
        self._workers: list[threading.Thread] = []
        # Per compile: [start, end] (time.monotonic()), written by its worker.
        self._times: weakref.WeakKeyDictionary[Future[CompiledGrammar], list[float]] = weakref.WeakKeyDictionary()

    @property
    def max_queue_wait_s(self) -> float:
        """How long a compile may wait for a free worker before its request is refused."""
        return max(QUEUE_WAIT_MIN_S, self.compile_timeout_s * self._num_workers)

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of the compiled grammar (already done on a cache hit); it is running
        once a worker took it (`started`). Thread-safe."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            if len(self._workers) < self._num_workers:
                worker = threading.Thread(target=self._work, name=f"grammar-compile-{len(self._workers)}", daemon=True)
                self._workers.append(worker)
                worker.start()
        self._queue.put((params, future))
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Waits for the grammar; GrammarError if invalid, or slower than compile_timeout_s
        from the start of its own compile."""
        future = self.compile_async(params)
        if future.done():
            return future.result()  # a cache hit, however long it once took
        queued_until = time.monotonic() + self.max_queue_wait_s
        while not started(future):
            if time.monotonic() > queued_until:
                raise GrammarError(self.queue_full_message(params.kind))
            time.sleep(STARTED_POLL_S)
        try:
            grammar = future.result(timeout=max(0.0, self.time_left(future)))
        except FutureTimeout:
            raise GrammarError(self.timeout_message(params.kind)) from None
        if self.time_left(future) < 0:
            raise GrammarError(self.timeout_message(params.kind))
        return grammar

    def time_left(self, future: Future[CompiledGrammar]) -> float:
        """compile_timeout_s less the time the compile took (so far, if still running)."""
        times = self._times.get(future)
        if not times:
            return self.compile_timeout_s
        end = times[1] if len(times) > 1 else time.monotonic()
        return self.compile_timeout_s - (end - times[0])

    def timeout_message(self, what: str) -> str:
        return f"{what}: compiling the grammar took longer than {self.compile_timeout_s:g} s; simplify the constraint"

    def queue_full_message(self, what: str) -> str:
        return f"{what}: every grammar compiler stayed busy for {self.max_queue_wait_s:g} s; retry later"

    def _backend_instance(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._load(self.backend_name, *self._args)
            return self._backend

    def _work(self) -> None:
        while True:
            params, future = self._queue.get()
            times = [time.monotonic()]
            self._times[future] = times  # before it shows as running
            if not future.set_running_or_notify_cancel():
                continue
            try:
                grammar = self._backend_instance().compile(params)
            except GrammarError as exc:
                times.append(time.monotonic())
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - any backend failure is this request's 400
                times.append(time.monotonic())
                future.set_exception(GrammarError(f"invalid {params.kind}: {exc}"))
            else:
                times.append(time.monotonic())
                future.set_result(grammar)


def started(future: Future[Any]) -> bool:
    """A compile's deadline runs from here: a worker took it (or it is already done)."""
    return future.running() or future.done()


class GrammarRejectedError(RuntimeError):
    """A token the sequence kept is not allowed by its grammar: the request fails."""


class RequestGrammar:
    """One sequence's matcher, kept in step with the tokens the sequence keeps.

    The matcher consumes lazily, when the next mask is needed: the tokens a sequence keeps
    are its output_token_ids, whatever happened since (preemption by recompute or swap keeps
    them; a rejected speculative token disappears from them and is rolled back here).
    """

    __slots__ = ("_grammar", "_matcher", "_consumed", "_eos_token_id", "_failed")

    def __init__(self, grammar: CompiledGrammar, eos_token_id: int | None) -> None:
        self._grammar = grammar
        self._matcher: GrammarMatcher | None = None
        self._consumed: list[int] = []
        self._eos_token_id = eos_token_id
        self._failed = False

    def fill_bitmask(self, output_token_ids: list[int], bitmask: torch.Tensor, row: int,
                     num_proposed: int = 0) -> None:
        """Writes the tokens allowed after `output_token_ids` into `bitmask[row]`.

        The last `num_proposed` of those tokens are speculative proposals being verified
        (a proposal row's mask follows the proposals before it); one the grammar refuses is
        expected, not an error: the row before it masks it out, so it is rejected.
        """
        if self._matcher is None:
            self._matcher = self._grammar.new_matcher()
        self._catch_up(output_token_ids, num_proposed)
        if self._failed:
            # Only after a rejected speculative proposal (a kept token raises instead).
            bitmask[row].zero_()
            if self._eos_token_id is not None:
                bitmask[row, self._eos_token_id // 32] = 1 << (self._eos_token_id % 32)
            return
        self._matcher.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def _catch_up(self, tokens: list[int], num_proposed: int = 0) -> None:
        assert self._matcher is not None
        done = self._consumed
        n = len(done)
        # Kept tokens only ever grow; what can change is the tail (rejected proposals), so
        # comparing the last few tokens finds where the sequence left the matcher's path.
        tail = min(n, _TAIL_CHECK)
        if n > len(tokens) or done[n - tail:] != tokens[n - tail:n]:
            keep = 0
            while keep < min(n, len(tokens)) and done[keep] == tokens[keep]:
                keep += 1
            self._matcher.rollback(n - keep)
            del done[keep:]
        self._failed = False
        first_proposed = len(tokens) - num_proposed
        for index in range(len(done), len(tokens)):
            token = tokens[index]
            if not self._matcher.accept_token(token):
                if index < first_proposed:
                    # A kept token the grammar refuses (the backend erred, or its mask was
                    # wrong): the output already breaks the constraint, so the request fails
                    # (the runner ends it alone, finish_reason "error"); ending it as "stop"
                    # would hand the client text outside its constraint as a success.
                    why = getattr(self._matcher, "error", lambda: "")()
                    raise GrammarRejectedError(
                        f"the grammar rejected token {token} after {index} tokens" + (f": {why}" if why else ""))
                self._failed = True  # a speculative proposal: expected, the mask rejects it
                break
            done.append(token)
