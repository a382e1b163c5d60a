"""Every live LLMEngine in this process, and which loop (if any) steps it.

Leak checks, benchmarks and debugging tools find engines here instead of patching
`LLMEngine.__init__`. The registry holds weak references only: it never keeps an engine alive.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

_engines: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
# engine -> the object whose thread steps it (an AsyncLLMEngine); absent: the caller steps it.
_drivers: weakref.WeakKeyDictionary[LLMEngine, Any] = weakref.WeakKeyDictionary()


def register(engine: LLMEngine) -> None:
    """Called once by each engine's constructor."""
    _engines.add(engine)


def set_driver(engine: LLMEngine, driver: Any) -> None:
    """`driver`'s own thread steps `engine` from now on; nobody else may touch its state."""
    _drivers[engine] = driver


def driver_of(engine: LLMEngine) -> Any | None:
    return _drivers.get(engine)


def live_engines() -> list[LLMEngine]:
    """The engines alive now, oldest first."""
    return sorted(_engines, key=lambda e: e.created_seq)
