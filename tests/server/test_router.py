"""The replica router's policy, without Ray: affinity keys, overload fallback, failover."""

from __future__ import annotations

import pytest

from pagedserve.distributed.router import ReplicaRouter, RouterConfig

BLOCK = 4


def router(n: int = 4, **kwargs: object) -> ReplicaRouter:
    return ReplicaRouter(n, RouterConfig(block_size=BLOCK, affinity_blocks=2, **kwargs), seed=0)


def test_same_prefix_same_replica_and_prefixes_spread() -> None:
    r = router()
    head = [7] * (2 * BLOCK)
    picks = {r.route(head + [i, i + 1]).replica for i in range(20)}
    assert len(picks) == 1  # only the first 2 blocks are hashed: the suffix does not matter
    assert r.route(head).reason == "prefix"
    spread = {r.route([i] * (2 * BLOCK)).replica for i in range(40)}
    assert spread == {0, 1, 2, 3}  # different prefixes use every replica


def test_short_prompt_is_balanced_to_the_less_loaded_of_two() -> None:
    r = router(n=2)
    r.started(0, 5)
    route = r.route([1, 2, 3])  # shorter than one block: no affinity key
    assert route.reason == "balance" and route.replica == 1


def test_adapter_affinity_overrides_the_prefix() -> None:
    r = router()
    replicas = {r.route([i] * (3 * BLOCK), adapter="sql").replica for i in range(10)}
    assert len(replicas) == 1 and r.route([1] * BLOCK, adapter="sql").reason == "adapter"


def test_overloaded_preferred_replica_falls_back() -> None:
    r = router(n=2, balance_abs_threshold=3, balance_rel_threshold=2.0)
    prompt = [5] * (2 * BLOCK)
    preferred = r.route(prompt).replica
    other = 1 - preferred
    r.started(preferred, 3)
    assert r.route(prompt).replica == preferred  # 3 > 0 + 3 is false: still preferred
    r.started(preferred, 1)
    route = r.route(prompt)
    assert route.replica == other and route.reason == "balance"
    # The fallback cached the prefix on the other replica too: it is followed there now.
    assert r.route(prompt) == route.__class__(other, "prefix")


def test_down_replica_moves_only_its_own_keys() -> None:
    r = router()
    prompts = [[i] * (2 * BLOCK) for i in range(40)]
    before = [r.route(p).replica for p in prompts]
    r.mark_down(2)
    after = [r.route(p).replica for p in prompts]
    for b, a in zip(before, after, strict=True):
        assert a != 2 and (b == 2 or a == b)
    fresh = [99] * (2 * BLOCK)
    home = r.route(fresh).replica
    assert r.route(fresh, exclude=frozenset({home})).replica != home
    r.mark_up(2)
    # The moved chains stay where their blocks are cached now; new prefixes use replica 2 again.
    assert [r.route(p).replica for p in prompts] == after
    assert 2 in {r.route([i] * (2 * BLOCK)).replica for i in range(100, 140)}
    for i in range(4):
        r.mark_down(i)
    with pytest.raises(RuntimeError, match="no replica"):
        r.route(fresh)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        RouterConfig(block_size=0)
    with pytest.raises(ValueError):
        ReplicaRouter(0)


def test_affinity_off_balances_everything() -> None:
    r = ReplicaRouter(2, RouterConfig(block_size=BLOCK, affinity=False), seed=0)
    assert {r.route([3] * (4 * BLOCK)).reason for _ in range(5)} == {"balance"}


def test_a_growing_chat_stays_on_its_replica() -> None:
    """Each turn extends the last one's prompt past the hashed head; the deepest known block wins."""
    r = ReplicaRouter(4, RouterConfig(block_size=BLOCK, affinity_blocks=64), seed=0)
    chats = [[c] * (BLOCK + 1) for c in range(12)]
    first = [r.route(chat).replica for chat in chats]
    for turn in range(6):
        for c, chat in enumerate(chats):
            chat += [turn + 50] * (BLOCK + 3)
            assert r.route(chat).replica == first[c]
    # Chats sharing a system prompt go where it is cached while that replica is not overloaded.
    system = [9] * (3 * BLOCK)
    owner = r.route(system).replica
    assert r.route(system + [1] * BLOCK).replica == owner
