"""Which replica serves a request: prefix affinity, adapter affinity, power-of-two-choices.

    request ─► preferred replica ─┬─ adapter named: rendezvous hash of its name
                                  └─ else the replica last sent the longest prefix of the
                                     prompt's full blocks (chained block hashes, as the
                                     prefix cache names them); no match: rendezvous hash
                                     of the first block
               overloaded? (in-flight > least loaded + abs and > rel x least loaded)
               ▼ yes, or prompt shorter than one block
               least loaded of two random live replicas

Remembering where each block chain went (an LRU map, SGLang's cache-aware router in the
small) is what keeps a multi-turn chat on one replica: turn k+1's prompt extends turn k's,
so its deepest known block is the one turn k left on that replica, while a fixed-length
hash of the head would change as the chat grows past it. An adapter's requests all go to
one replica, so its weights stay resident there (the prefix cache is rooted in the adapter
anyway). Load is what this router has in flight per replica: known without asking the
replicas, exact for a single ingress.

Plain integers and lists; no Ray, so the policy is tested without a cluster.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterConfig:
    """Routing knobs (SGLang's cache-aware router uses the same absolute/relative pair)."""

    block_size: int = 16
    # Blocks of a prompt hashed and remembered (64 x 16 = the first 1024 tokens).
    affinity_blocks: int = 64
    # Block chains remembered (LRU); a forgotten chain routes by its first block's hash.
    max_remembered_blocks: int = 200_000
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    # False: every request is balanced (the baseline the affinity is measured against).
    affinity: bool = True
    # How a request without a preferred replica is placed: the less loaded of two random
    # replicas, or (the baseline for the hit rate) one replica drawn at random.
    balance_policy: str = "two_choices"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.affinity_blocks < 1:
            raise ValueError("block_size and affinity_blocks must be >= 1")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.balance_policy not in ("two_choices", "random"):
            raise ValueError(f"balance_policy must be 'two_choices' or 'random', got {self.balance_policy!r}")


@dataclass(slots=True)
class Route:
    """The decision for one request: the replica and why ('prefix', 'adapter', 'balance')."""

    replica: int
    reason: str


@dataclass
class ReplicaRouter:
    """Routes requests over `num_replicas` replicas and counts what each has in flight.

    The caller brackets each routed request with `started(replica)` / `finished(replica)` and
    reports replicas that went away (`mark_down`) or came back (`mark_up`).
    """

    num_replicas: int
    config: RouterConfig = field(default_factory=RouterConfig)
    seed: int | None = None
    in_flight: list[int] = field(init=False)
    up: list[bool] = field(init=False)
    _rng: random.Random = field(init=False)
    _owner: OrderedDict[bytes, int] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self.in_flight = [0] * self.num_replicas
        self.up = [True] * self.num_replicas
        self._rng = random.Random(self.seed)
        self._owner = OrderedDict()

    def block_hashes(self, prompt_token_ids: list[int] | None) -> list[bytes]:
        """Chained hashes of the prompt's first full blocks (each names its whole prefix)."""
        if not prompt_token_ids:
            return []
        size = self.config.block_size
        num_blocks = min(len(prompt_token_ids) // size, self.config.affinity_blocks)
        hashes: list[bytes] = []
        parent = b""
        for i in range(num_blocks):
            block = array("q", prompt_token_ids[i * size:(i + 1) * size]).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def route(self, prompt_token_ids: list[int] | None, adapter: str | None = None,
              exclude: frozenset[int] = frozenset()) -> Route:
        """The replica for a request; `exclude` holds replicas that just failed it.

        Raises:
            RuntimeError: no replica is up.
        """
        live = [i for i in range(self.num_replicas) if self.up[i] and i not in exclude]
        if not live:
            raise RuntimeError("no replica is available")
        hashes = self.block_hashes(prompt_token_ids) if self.config.affinity else []
        preferred: Route | None = None
        if adapter is not None and self.config.affinity:
            preferred = Route(_rendezvous(adapter.encode(), live), "adapter")
        elif hashes:
            preferred = Route(self._deepest_owner(hashes, live), "prefix")
        if preferred is not None and not self._overloaded(preferred.replica, live):
            route = preferred
        else:
            route = Route(self._two_choices(live), "balance")
        self._remember(hashes, route.replica)
        return route

    def _deepest_owner(self, hashes: list[bytes], live: list[int]) -> int:
        for block_hash in reversed(hashes):
            owner = self._owner.get(block_hash)
            if owner is not None and owner in live:
                return owner
        return _rendezvous(hashes[0], live)

    def _remember(self, hashes: list[bytes], replica: int) -> None:
        for block_hash in hashes:
            self._owner[block_hash] = replica
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.config.max_remembered_blocks:
            self._owner.popitem(last=False)

    def _overloaded(self, replica: int, live: list[int]) -> bool:
        least = min(self.in_flight[i] for i in live)
        load = self.in_flight[replica]
        cfg = self.config
        return load > least + cfg.balance_abs_threshold and load > least * cfg.balance_rel_threshold

    def _two_choices(self, live: list[int]) -> int:
        if self.config.balance_policy == "random":
            return self._rng.choice(live)
        picks = self._rng.sample(live, 2) if len(live) >= 2 else live
        return min(picks, key=lambda i: self.in_flight[i])

    def started(self, replica: int, count: int = 1) -> None:
        self.in_flight[replica] += count

    def finished(self, replica: int, count: int = 1) -> None:
        self.in_flight[replica] = max(0, self.in_flight[replica] - count)

    def mark_down(self, replica: int) -> None:
        self.up[replica] = False

    def mark_up(self, replica: int) -> None:
        self.up[replica] = True


def _rendezvous(key: bytes, live: list[int]) -> int:
    # Highest-random-weight hashing: a key keeps its replica while that replica is up, and only
    # the keys of a replica that is down move (to their second choice).
    def score(replica: int) -> int:
        digest = hashlib.blake2b(key + replica.to_bytes(4, "little"), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return max(live, key=score)
