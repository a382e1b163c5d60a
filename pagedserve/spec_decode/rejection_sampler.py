"""Verifying proposed tokens exactly: the standard speculative-sampling rule.

A request with k proposed tokens x_1..x_k gets k + 1 logits rows from one target forward:

    row:      0        1        ...  k-1        k
    checks:   x_1      x_2           x_k        (bonus)
    p_j:      target distribution for the token after the request's first j proposals

Row j accepts x_{j+1} with probability min(1, p_j(x) / q_j(x)) (q_j: the proposer's
distribution; a deterministic proposer, n-gram lookup or a greedy draft model, has q_j
one-hot, so the test is u < p_j(x)). The first rejected row emits a token drawn from
norm(max(0, p_j - q_j)) instead and ends the run; if all k are accepted, row k emits a
bonus token drawn from p_k. Each emitted token is then distributed exactly as p (Leviathan
et al. 2023; Chen et al. 2023). Greedy rows accept iff x equals the argmax and emit the
argmax, so greedy output is token for token what it is without speculation.

Everything here is tensors over all rows of all requests at once; the per-request walk
over the results happens on host lists once (`accepted_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class VerifyOutput:
    """Per logits row: the token it emits and whether its proposal was accepted."""

    token_ids: torch.Tensor  # (N,) int64: the proposal if accepted, else the fallback draw
    accepted: torch.Tensor  # (N,) bool; False on bonus rows (they have no proposal)


def rejection_sample(
    probs: torch.Tensor | None,
    greedy_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    has_draft: list[bool],
    *,
    greedy_mask: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> VerifyOutput:
    """Accept or reject every row's proposal; draw fallbacks and bonus tokens.

    Args:
        probs: (N, V) target distributions after temperature and truncation; None when
            every row is greedy.
        greedy_tokens: (N,) argmax of the processed logits.
        draft_token_ids: (N,) int64, the proposal each row checks (any id on bonus rows).
        has_draft: per row, False on bonus rows (and rows of requests not speculating).
        greedy_mask: (N,) bool rows that are greedy when `probs` is given (None: none are).
        draft_probs: (N, V) the proposer's distributions q; None means one-hot proposals.
        generators: row -> generator, for seeded requests (their draws do not depend on
            the rest of the batch). A row without a proposal takes exactly the draws a
            plain sampling step would (the exponential race), so a seeded request that
            is not speculating samples the same tokens in a step that verifies others.
    """
    draft_mask = torch.tensor(has_draft, dtype=torch.bool, device=greedy_tokens.device)
    if probs is None:
        accepted = draft_mask & (greedy_tokens == draft_token_ids)
        return VerifyOutput(torch.where(accepted, draft_token_ids, greedy_tokens), accepted)
    rows = torch.arange(probs.shape[0], device=probs.device)
    p_x = probs[rows, draft_token_ids]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        residual = probs.clone()
        residual[rows, draft_token_ids] = 0.0
    else:
        q_x = draft_probs[rows, draft_token_ids]
        residual = (probs - draft_probs).clamp_(min=0.0)
    # Bonus rows draw from p itself; so does a row whose residual is empty (p <= q
    # everywhere means p == q, where the proposal is always accepted anyway).
    empty = residual.sum(dim=-1) <= 0.0
    residual = torch.where((~draft_mask | empty).unsqueeze(1), probs, residual)
    uniform = torch.rand(p_x.shape, device=probs.device)
    noise = torch.empty_like(residual).exponential_()
    for row, generator in (generators or {}).items():
        if has_draft[row]:
            uniform[row] = torch.rand((), generator=generator, device=probs.device)
        noise[row].exponential_(generator=generator)
    # u < p/q, written without the division; strict, so p(x) = 0 always rejects.
    accepted = draft_mask & (uniform * q_x < p_x)
    # The exponential race: argmax(r / E), E ~ Exp(1), is a draw from r / sum(r).
    fallback = residual.div_(noise).argmax(dim=-1)
    if greedy_mask is not None:
        greedy_accept = draft_mask & (greedy_tokens == draft_token_ids)
        accepted = torch.where(greedy_mask, greedy_accept, accepted)
        fallback = torch.where(greedy_mask, greedy_tokens, fallback)
    return VerifyOutput(torch.where(accepted, draft_token_ids, fallback), accepted)


def accepted_runs(token_ids: list[int], accepted: list[bool], num_drafts: list[int]) -> list[list[int]]:
    """Per request (rows laid out as above, `num_drafts[i] + 1` rows each): the tokens it
    emits this step, the accepted proposals then the first rejection's draw or the bonus."""
    runs: list[list[int]] = []
    row = 0
    for k in num_drafts:
        run = []
        for j in range(k + 1):
            run.append(token_ids[row + j])
            if not accepted[row + j]:
                break
        runs.append(run)
        row += k + 1
    return runs
