"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Order, as in vLLM: a structured-output request's grammar mask comes first (disallowed
tokens get -inf, so they are never drawn and their logprob is -inf); logprobs come from
those logits; then logit bias (and min_tokens'
ban on stop tokens), penalties, temperature, truncation, and the draw. Sampling uses the
exponential race (argmax of p / q, q ~ Exp(1)), which draws from p exactly and lets a
seeded request take its noise from its own generator, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sample.metadata import PenaltyInputs, SamplingMetadata
from pagedserve.structured_outputs.bitmask import apply_token_bitmask


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # (N,) int64
    # When logprobs were asked for: (N, 1 + k) token ids (chosen first), logprobs, ranks.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


@dataclass(slots=True)
class TargetDistribution:
    """What verifying proposed tokens needs from each row (see spec_decode/rejection_sampler.py)."""

    raw_logprobs: torch.Tensor | None  # (N, V) when logprobs were asked for
    greedy_tokens: torch.Tensor  # (N,) argmax after bias and penalties
    probs: torch.Tensor | None  # (N, V) the distribution a token is drawn from; None if all greedy


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: (N, vocab) float32 raw model output; modified in place."""
        raw_logprobs = self._prepare(logits, meta)
        if meta.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, meta)
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            gather_logprobs_into(raw_logprobs, token_ids, meta.max_num_logprobs or 0, out)
        return out

    def target_distribution(self, logits: torch.Tensor, meta: SamplingMetadata) -> TargetDistribution:
        """The same processing as a draw, stopped before it: speculative decoding accepts
        proposals against these distributions. logits are modified in place."""
        raw_logprobs = self._prepare(logits, meta)
        greedy_tokens = logits.argmax(dim=-1)
        probs = None if meta.all_greedy else self._probs(logits, meta)
        return TargetDistribution(raw_logprobs, greedy_tokens, probs)

    def _prepare(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
        """Raw logprobs (if asked for), then logit bias and penalties, in place."""
        if meta.grammar_bitmask is not None:
            apply_token_bitmask(logits, *meta.grammar_bitmask)
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        if meta.logit_bias is not None:
            rows, cols, values = meta.logit_bias
            logits.index_put_((rows, cols), values, accumulate=True)
        if meta.penalties is not None:
            _apply_penalties(logits, meta.penalties)
        return raw_logprobs

    def _probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k/top-p, softmax, min-p: the distribution of the draw."""
        assert meta.temperature is not None
        logits.div_(meta.temperature.unsqueeze(1))
        if meta.top_k is not None or meta.top_p is not None:
            logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            probs.masked_fill_(probs < threshold, 0.0)
        return probs

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1) if meta.greedy_mask is not None else None
        probs = self._probs(logits, meta)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        if greedy_tokens is not None:
            assert meta.greedy_mask is not None
            sampled = torch.where(meta.greedy_mask, greedy_tokens, sampled)
        return sampled


def _apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> None:
    vocab = logits.shape[1]
    rows = logits[p.rows]  # (P, V) copy
    # One extra column swallows the padding id `vocab`.
    counts = torch.zeros(rows.shape[0], vocab + 1, dtype=rows.dtype)
    counts.scatter_add_(1, p.output_token_ids, torch.ones_like(p.output_token_ids, dtype=rows.dtype))
    counts = counts[:, :vocab]
    seen = counts > 0
    in_prompt = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool)
    in_prompt.scatter_(1, p.prompt_token_ids, True)
    seen_any = seen | in_prompt[:, :vocab]
    repetition = p.repetition.unsqueeze(1)
    penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(seen_any, penalized, rows)
    rows -= p.frequency.unsqueeze(1) * counts
    rows -= p.presence.unsqueeze(1) * seen.to(rows.dtype)
    logits[p.rows] = rows


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        # Ascending order: the k largest sit at the end; mask everything before them.
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        mask = cumulative <= (1.0 - top_p).unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs_into(raw: torch.Tensor, token_ids: torch.Tensor, k: int, out: SamplerOutput) -> None:
    out.logprob_token_ids, out.logprobs, out.ranks = gather_logprobs(raw, token_ids, k)


def gather_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob and rank of `token_ids` (one per row) and the top `k` of each row.

    raw: (N, vocab) log-probabilities. Returns (N, 1 + k) token ids (the given one first),
    their logprobs and ranks (1 = most likely).
    """
    chosen = raw.gather(1, token_ids.unsqueeze(1))  # (N, 1)
    chosen_rank = (raw > chosen).sum(dim=-1, keepdim=True) + 1
    if k == 0:
        return token_ids.unsqueeze(1), chosen, chosen_rank
    top_values, top_ids = raw.topk(k, dim=-1)
    top_ranks = torch.arange(1, k + 1).expand(raw.shape[0], k)
    return (
        torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        torch.cat([chosen, top_values], dim=1),
        torch.cat([chosen_rank, top_ranks], dim=1),
    )
