"""Shared fixtures. Every engine created during a test gets the KV leak check at teardown."""

from __future__ import annotations

import os
import weakref

import pytest

# Keep tests on the CPU's two cores without oversubscription by tokenizers' thread pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pagedserve.engine import llm_engine  # noqa: E402

_live_engines: list[weakref.ref] = []
_original_init = llm_engine.LLMEngine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _live_engines.append(weakref.ref(self))


llm_engine.LLMEngine.__init__ = _tracking_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def kv_leak_check():
    """After each test: every live engine is idle, all blocks free, refcounts zero.

    Engines shared by a module fixture are checked after every test that used them.
    An engine driven by a server thread sets `external_leak_check` and is checked by its
    own tests once the server is idle (checking it from here would race its loop).
    """
    yield
    _live_engines[:] = [ref for ref in _live_engines if ref() is not None]
    for ref in _live_engines:
        engine = ref()
        if engine is not None and not getattr(engine, "external_leak_check", False):
            engine.assert_no_leaks()


@pytest.fixture(scope="session")
def model_path():
    """Returns a function: test model name -> its (cached) HF folder."""
    from pagedserve.demo_models import get_model_path

    return lambda name: str(get_model_path(name))
