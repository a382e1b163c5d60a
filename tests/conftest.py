"""Shared fixtures. Every engine created during a test gets the KV leak check at teardown."""

from __future__ import annotations

import os

import pytest

# Keep tests on the CPU's two cores without oversubscription by tokenizers' thread pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pagedserve.engine import registry  # noqa: E402


@pytest.fixture(autouse=True)
def kv_leak_check():
    """After each test: every live engine is idle, all blocks free, refcounts zero.

    Engines shared by a module fixture are checked after every test that used them.
    An engine stepped by a server thread (it has a driver in the registry) is checked by its
    own tests once the server is idle (checking it from here would race its loop).
    """
    yield
    for engine in registry.live_engines():
        if registry.driver_of(engine) is None:
            engine.assert_no_leaks()


@pytest.fixture(scope="session")
def model_path():
    """Returns a function: test model name -> its (cached) HF folder."""
    from pagedserve.demo_models import get_model_path

    return lambda name: str(get_model_path(name))
