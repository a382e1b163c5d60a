"""Builds SamplingMetadata for the rows due a token this step (host lists -> tensors, once)."""

from __future__ import annotations

import torch

from pagedserve.request import Request
from pagedserve.sample.metadata import PenaltyInputs, SamplingMetadata

# Temperatures above this sample as it does (logits / 1e4 are flat to within 1% for any
# logits a model gives): a larger value, e.g. 1.7e308, is inf in float32, and a grammar-masked
# logit -inf / inf is NaN, which broke the draw (the fuzz test's 500).
MAX_TEMPERATURE = 1e4


def build_sampling_metadata(
    requests: list[Request],
    generators: dict[str, torch.Generator],
    vocab_size: int,
    device: torch.device,
    proposed: list[list[int]] | None = None,
) -> SamplingMetadata:
    """Args:
        requests: one per logits row, in row order.
        generators: the runner's per-request generators; seeded requests get theirs here.
        proposed: per row, the speculative proposals that precede it (a request verifying
            x_1..x_k has rows [], [x_1], ..., [x_1..x_k]); only the grammar masks read them.
    """
    params = [r.sampling_params for r in requests]
    n = len(requests)
    all_greedy = all(p.greedy for p in params)
    temperature = greedy_mask = top_p = top_k = min_p = None
    row_generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        greedy = [p.greedy for p in params]
        temperature = torch.tensor([1.0 if g else min(p.temperature, MAX_TEMPERATURE)
                                    for g, p in zip(greedy, params, strict=True)], device=device)
        if any(greedy):
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if any(0 < p.top_k < vocab_size for p in params):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
        for row, (request, p) in enumerate(zip(requests, params, strict=True)):
            if p.seed is not None and not p.greedy:
                row_generators[row] = _generator_for(request, generators, device)
    # logprobs=-1 asks for the whole vocabulary.
    max_logprobs = max(
        (vocab_size if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None), default=None
    )
    # Before the biases: it brings each matcher up to date (min_tokens asks whether it ended).
    grammar_bitmask = _grammar_bitmask(requests, vocab_size, device, proposed)
    return SamplingMetadata(
        num_rows=n,
        all_greedy=all_greedy,
        temperature=temperature,
        greedy_mask=greedy_mask,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        generators=row_generators,
        penalties=_penalties(requests, vocab_size, device),
        logit_bias=_logit_bias(requests, vocab_size, device),
        max_num_logprobs=max_logprobs,
        grammar_bitmask=grammar_bitmask,
    )


def _grammar_bitmask(
    requests: list[Request], vocab_size: int, device: torch.device, proposed: list[list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each constrained row's allowed tokens, filled by its own matcher (host, then one copy)."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), (vocab_size + 31) // 32, dtype=torch.int32)
    for index, row in enumerate(rows):
        request = requests[row]
        assert request.grammar is not None
        prefix = proposed[row] if proposed is not None else []
        tokens = request.output_token_ids + prefix if prefix else request.output_token_ids
        request.grammar.fill_bitmask(tokens, bitmask, index, num_proposed=len(prefix))
    return torch.tensor(rows, dtype=torch.int64, device=device), bitmask.to(device)


def _generator_for(request: Request, generators: dict[str, torch.Generator], device: torch.device) -> torch.Generator:
    generator = generators.get(request.request_id)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(request.sampling_params.seed)
        generators[request.request_id] = generator
    return generator


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def _penalties(requests: list[Request], vocab_size: int, device: torch.device) -> PenaltyInputs | None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not rows:
        return None
    chosen = [requests[i] for i in rows]
    sp = [r.sampling_params for r in chosen]
    return PenaltyInputs(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        presence=torch.tensor([p.presence_penalty for p in sp], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in sp], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in sp], device=device),
        output_token_ids=_pad([r.output_token_ids for r in chosen], vocab_size, device),
        prompt_token_ids=_pad([r.prompt_token_ids for r in chosen], vocab_size, device),
    )


def _logit_bias(
    requests: list[Request], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Sparse additions to the logits: logit_bias, and -inf for every token a request may not
    produce now (min_tokens' stop tokens, bad words, tokens outside allowed_token_ids)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    banned_rows: list[torch.Tensor] = []  # allowed_token_ids: (row, disallowed ids) as tensors
    for row, request in enumerate(requests):
        p = request.sampling_params
        if p.allowed_token_ids is not None:
            disallowed = torch.ones(vocab_size, dtype=torch.bool)
            disallowed[torch.tensor(p.allowed_token_ids)] = False
            banned_rows.append(torch.stack([torch.full((int(disallowed.sum()),), row), disallowed.nonzero()[:, 0]]))
        for word in request.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or request.output_token_ids[-len(prefix):] == prefix:
                rows.append(row)
                cols.append(word[-1])
                values.append(float("-inf"))
        if p.logit_bias:
            for token_id, bias in p.logit_bias.items():
                rows.append(row)
                cols.append(token_id)
                values.append(float(bias))
        grammar_done = request.grammar is not None and request.grammar.is_terminated()
        if request.num_output_tokens < p.min_tokens and not grammar_done:
            # (A complete grammar allows only EOS: the grammar wins over min_tokens.)
            # min_tokens: the request may not stop yet, so its stop tokens are banned.
            banned = set(p.stop_token_ids or [])
            if not p.ignore_eos and request.eos_token_id is not None:
                banned.add(request.eos_token_id)
            for token_id in banned:
                rows.append(row)
                cols.append(token_id)
                values.append(float("-inf"))
    if not rows and not banned_rows:
        return None
    row_t = torch.tensor(rows, dtype=torch.int64)
    col_t = torch.tensor(cols, dtype=torch.int64)
    value_t = torch.tensor(values, dtype=torch.float32)
    if banned_rows:
        banned = torch.cat(banned_rows, dim=1)
        row_t = torch.cat([row_t, banned[0]])
        col_t = torch.cat([col_t, banned[1]])
        value_t = torch.cat([value_t, torch.full((banned.shape[1],), float("-inf"))])
    return row_t.to(device), col_t.to(device), value_t.to(device)
