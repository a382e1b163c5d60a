"""Which replica serves a request: prefix affinity, adapter affinity, power-of-two-choices.

    request ─► key ─► preferred replica (rendezvous hash of the key over the live replicas)
                          │ overloaded? (in-flight > least loaded + abs and > rel x least loaded)
                          ▼ yes
               least loaded of two random live replicas

The key is the LoRA adapter's name when the request names one (its weights then stay
resident on one replica, and the prefix cache is rooted in the adapter anyway), else a hash
of the prompt's first `affinity_blocks` full KV blocks: requests that share a system prompt,
or a chat's earlier turns, land where those blocks are cached. Prompts shorter than one block
have no key and are balanced. Load is what this router has in flight per replica: known
without asking the replicas, exact for a single ingress.

Plain integers and lists; no Ray, so the policy is tested without a cluster.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterConfig:
    """Routing knobs (SGLang's cache-aware router uses the same absolute/relative pair)."""

    block_size: int = 16
    affinity_blocks: int = 4
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.affinity_blocks < 1:
            raise ValueError("block_size and affinity_blocks must be >= 1")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")


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

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self.in_flight = [0] * self.num_replicas
        self.up = [True] * self.num_replicas
        self._rng = random.Random(self.seed)

    def affinity_key(self, prompt_token_ids: list[int] | None, adapter: str | None) -> tuple[str, bytes] | None:
        """('adapter', name) or ('prefix', hash of the first full blocks), or None (no affinity)."""
        if adapter is not None:
            return "adapter", adapter.encode()
        if not prompt_token_ids:
            return None
        num_blocks = min(len(prompt_token_ids) // self.config.block_size, self.config.affinity_blocks)
        if num_blocks == 0:
            return None
        head = prompt_token_ids[: num_blocks * self.config.block_size]
        return "prefix", hashlib.blake2b(",".join(map(str, head)).encode(), digest_size=16).digest()

    def route(self, prompt_token_ids: list[int] | None, adapter: str | None = None,
              exclude: frozenset[int] = frozenset()) -> Route:
        """The replica for a request; `exclude` holds replicas that just failed it.

        Raises:
            RuntimeError: no replica is up.
        """
        live = [i for i in range(self.num_replicas) if self.up[i] and i not in exclude]
        if not live:
            raise RuntimeError("no replica is available")
        key = self.affinity_key(prompt_token_ids, adapter)
        if key is not None:
            preferred = max(live, key=lambda i: _rendezvous_score(key[1], i))
            if not self._overloaded(preferred, live):
                return Route(preferred, key[0])
        return Route(self._two_choices(live), "balance")

    def _overloaded(self, replica: int, live: list[int]) -> bool:
        least = min(self.in_flight[i] for i in live)
        load = self.in_flight[replica]
        cfg = self.config
        return load > least + cfg.balance_abs_threshold and load > least * cfg.balance_rel_threshold

    def _two_choices(self, live: list[int]) -> int:
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


def _rendezvous_score(key: bytes, replica: int) -> int:
    # Highest-random-weight hashing: a key keeps its replica while that replica is up, and only
    # the keys of a replica that is down move (to their second choice).
    digest = hashlib.blake2b(key + replica.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")
