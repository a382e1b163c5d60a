"""Fault injection points: where one request's work can fail without failing the batch.

The engine and the model runner call `FaultInjector.check(point, request_id)` at the
per-request points below when an injector was passed to `LLMEngine(config, faults=...)`;
without one (production) nothing is called. Tests use `FailRequests` to prove that an
exception in one request's preparation or detokenization ends that request alone
(`finish_reason="error"`) while the rest of the batch keeps its tokens.

    "sampling_inputs"  building the request's row of the sampling metadata (model runner)
    "detokenize"       turning the request's new token into text (engine, output processor)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

POINTS = ("sampling_inputs", "detokenize")


class FaultInjector(Protocol):
    def check(self, point: str, request_id: str) -> None:
        """Raises to make `request_id` fail at `point`; returns to let it pass."""


class InjectedFault(RuntimeError):
    """The exception `FailRequests` raises."""


class FailRequests:
    """Fails the named requests at one point, every time they reach it.

    Args:
        point: one of POINTS.
        request_ids: the engine request ids to fail (a sample of an n > 1 request has
            its own id, see engine/parallel_sampling.py).
    """

    def __init__(self, point: str, request_ids: Iterable[str]) -> None:
        if point not in POINTS:
            raise ValueError(f"point must be one of {POINTS}, got {point!r}")
        self.point = point
        self.request_ids = set(request_ids)
        self.num_raised = 0

    def check(self, point: str, request_id: str) -> None:
        if point == self.point and request_id in self.request_ids:
            self.num_raised += 1
            raise InjectedFault(f"injected fault at {point} for request {request_id}")
