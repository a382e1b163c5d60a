"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A prefill chunk computes hidden states for positions [start, start + n). The hidden state at
position p predicts token p + 1, so a chunk yields the prompt logprobs of tokens
start + 1 .. min(start + n, num_prompt_tokens - 1); the last prompt position predicts the
first generated token, which is the sampler's business. Chunked prefill needs nothing
special (the next chunk's first token is a prompt token, known in advance). Prefix-cache
hits would skip positions, so a request that asks for prompt logprobs does not read the
prefix cache (`KVCacheManager.find_cached_prefix`), as in vLLM v1; its blocks are still
published for others.

Logprobs come from the raw logits (no penalties, bias or temperature), like the sampler's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.sample.sampler import gather_logprobs

# Rows of logits materialised at once: (rows, vocab) float32 is 200 MB at 1024 x 49152.
_ROWS_PER_SLICE = 512


@dataclass(slots=True)
class PromptLogprobsPlan:
    """Which flat-batch rows give prompt logprobs this step (host integers only)."""

    # Per scheduled request: (first prompt position predicted from, number of rows), or None.
    spans: list[tuple[int, int] | None]
    flat_rows: list[int]  # rows of the step's hidden states, in span order
    targets: list[int]  # the prompt token each row predicts
    num_top: int  # largest prompt_logprobs asked for this step


# Per request: (first position, per row: token ids, logprobs, ranks), the prompt token first.
PromptLogprobs = tuple[int, list[list[int]], list[list[float]], list[list[int]]]


def _num_top(want: int, vocab_size: int) -> int:
    return vocab_size if want == -1 else want  # -1: the whole vocabulary (vLLM)


def plan_prompt_logprobs(sched: SchedulerOutput, vocab_size: int) -> PromptLogprobsPlan | None:
    spans: list[tuple[int, int] | None] = []
    flat_rows: list[int] = []
    targets: list[int] = []
    num_top = 0
    offset = 0
    for item in sched.scheduled:
        request = item.request
        want = request.sampling_params.prompt_logprobs
        start, n = item.num_computed_tokens, item.num_new_tokens
        end = min(start + n, request.num_prompt_tokens - 1)
        if want is None or end <= start:
            spans.append(None)
        else:
            spans.append((start, end - start))
            flat_rows.extend(range(offset, offset + end - start))
            targets.extend(request.prompt_token_ids[start + 1 : end + 1])
            num_top = max(num_top, _num_top(want, vocab_size))
        offset += n
    if not flat_rows:
        return None
    return PromptLogprobsPlan(spans, flat_rows, targets, num_top)


def compute_prompt_logprobs(
    plan: PromptLogprobsPlan, logits_at: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, 1 + num_top) token ids, logprobs and ranks, on the host's side of no sync yet.

    `logits_at(rows)`: the logits at those rows (indices on `device`) of the step's hidden
    states (a function, so tensor-parallel ranks can be told the rows too)."""
    rows = torch.tensor(plan.flat_rows, dtype=torch.int64, device=device)
    targets = torch.tensor(plan.targets, dtype=torch.int64, device=device)
    parts = []
    for begin in range(0, len(plan.flat_rows), _ROWS_PER_SLICE):
        chunk = slice(begin, begin + _ROWS_PER_SLICE)
        logits = logits_at(rows[chunk]).float()
        parts.append(gather_logprobs(torch.log_softmax(logits, dim=-1), targets[chunk], plan.num_top))
    if len(parts) == 1:
        return parts[0]
    ids, values, ranks = zip(*parts, strict=True)
    return torch.cat(ids), torch.cat(values), torch.cat(ranks)


def split_prompt_logprobs(
    sched: SchedulerOutput, plan: PromptLogprobsPlan, lists: tuple[list, list, list], vocab_size: int
) -> list[PromptLogprobs | None]:
    """Cuts the step's rows (already Python lists) into per-request spans, each request's
    top-k trimmed to what it asked for."""
    ids, values, ranks = lists
    out: list[PromptLogprobs | None] = []
    row = 0
    for item, span in zip(sched.scheduled, plan.spans, strict=True):
        if span is None:
            out.append(None)
            continue
        first, count = span
        width = 1 + _num_top(item.request.sampling_params.prompt_logprobs or 0, vocab_size)
        rows = range(row, row + count)
        out.append((first, [ids[r][:width] for r in rows], [values[r][:width] for r in rows],
                    [ranks[r][:width] for r in rows]))
        row += count
    return out
