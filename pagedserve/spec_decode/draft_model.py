"""A draft model proposes: a smaller model with the target's tokenizer guesses k tokens
greedily, one forward per token, batched over the speculating requests.

It has its own paged KV cache (its own block pool, from the same memory budget as the
target's; see LLMEngine._size_kv_cache) and its own model runner, which builds its
tensors. Per request it keeps how many tokens' K/V it holds:

    request tokens:  [0 ........................... T)      T = request.num_tokens
    draft K/V:       [0 ........ num_computed)               valid, verified tokens
    one propose():   catch up [num_computed, T) in one forward -> guess 1,
                     then guesses 1..k-1 one forward each      -> guesses 2..k
                     afterwards num_computed = T and the guesses' slots are rolled back

Only verified tokens' K/V is kept, so a rejected guess never needs repair, and a
preempted or swapped target request keeps its draft state (its tokens do not change).
Greedy guesses are one-hot proposals, which the rejection sampler verifies exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ScheduledRequest, SchedulerOutput
from pagedserve.request import Request

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        # A draft with windowed layers (Gemma 2/3) keeps one table per layer group, as the
        # target does: its runner splits the table it is given by group.
        groups = runner.kv_groups
        self.kv: KVCacheManager | HybridKVCacheManager = (
            HybridKVCacheManager(num_blocks, block_size, groups.windows) if groups.hybrid
            else KVCacheManager(num_blocks, block_size))
        runner.initialize_kv_cache(num_blocks)
        self.num_computed: dict[str, int] = {}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Greedy guesses, `num_tokens[i]` (>= 1) for requests[i]; [] for a request whose
        draft K/V found no free blocks."""
        items: list[ScheduledRequest] = []
        wanted: list[int] = []
        for request, k in zip(requests, num_tokens, strict=True):
            rid = request.request_id
            done = self.num_computed.get(rid, 0)
            # Slots for the catch-up tokens and the k-1 guesses fed back in.
            if not self.kv.allocate_slots(rid, done, request.num_tokens - done + k - 1):
                continue
            items.append(ScheduledRequest(request, done, request.num_tokens - done, self.kv.get_block_table(rid), True))
            wanted.append(k)
        guesses: list[list[int]] = [[] for _ in items]
        active = list(range(len(items)))
        for step in range(max(wanted, default=0)):
            if step > 0:
                # Feed each active request its newest guess, at the position after the last.
                for i in active:
                    item = items[i]
                    item.num_computed_tokens += item.num_new_tokens
                    item.num_new_tokens = 1
                    item.spec_token_ids = [guesses[i][-1]]
            logits = self.runner.forward_last_logits(SchedulerOutput(scheduled=[items[i] for i in active]))
            for i, token_id in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                guesses[i].append(token_id)
            active = [i for i in active if len(guesses[i]) < wanted[i]]
        by_id: dict[str, list[int]] = {}
        for item, guess in zip(items, guesses, strict=True):
            rid = item.request.request_id
            self.num_computed[rid] = item.request.num_tokens
            self.kv.rollback(rid, item.request.num_tokens)
            by_id[rid] = guess
        return [by_id.get(r.request_id, []) for r in requests]

    def release(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.num_computed.pop(request_id, None)

    def tracked_ids(self) -> list[str]:
        return list(self.num_computed)
