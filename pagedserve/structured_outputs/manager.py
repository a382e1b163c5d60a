"""Compiles constraints off the hot path and keeps one matcher per sequence.

    server handler / LLMEngine.add_request
        -> StructuredOutputManager.compile_async(params)   worker thread, cached by spec
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
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    load_backend,
)

logger = logging.getLogger(__name__)

BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"  # chosen by benchmarks/structured.py: see BENCHMARKS.md
_CACHE_SIZE = 512
# Tokens compared at the end of a sequence to find rejected proposals (>= the longest run).
_TAIL_CHECK = 16


class StructuredOutputManager:
    """Args:
        backend: "llguidance" or "xgrammar" (validated at construction).
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's size).
        eos_token_id: the engine's EOS id; the grammar allows it only once complete.
        compile_timeout_s: a compilation slower than this fails its request (400).
    """

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 compile_timeout_s: float = 10.0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend_name = backend
        self.compile_timeout_s = compile_timeout_s
        self._args = (tokenizer, vocab_size, eos_token_id)
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[StructuredOutputsParams, Future[CompiledGrammar]]] = queue.Queue()
        self._worker: threading.Thread | None = None

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of the compiled grammar (already done on a cache hit). Thread-safe."""
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
            if self._worker is None:
                # A daemon thread: a pathological grammar still compiling never blocks exit.
                self._worker = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
                self._worker.start()
        self._queue.put((params, future))
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Waits for the grammar; GrammarError if invalid or slower than compile_timeout_s."""
        future = self.compile_async(params)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise GrammarError(
                f"{params.kind}: compiling the grammar took longer than {self.compile_timeout_s:g} s; "
                "simplify the constraint"
            ) from None

    def _work(self) -> None:
        while True:
            params, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self._backend is None:
                    self._backend = load_backend(self.backend_name, *self._args)
                future.set_result(self._backend.compile(params))
            except GrammarError as exc:
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - any backend failure is this request's 400
                future.set_exception(GrammarError(f"invalid {params.kind}: {exc}"))


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
