"""Beam search inside the engine: the per-step decision, over plain lists.

Each live beam is a request in the scheduler. After a step in which every live beam of a
group computed its last token, the group takes the 2 * width best (beam, token)
continuations by cumulative logprob (from each beam's top-2*width logprobs):
  - among the first `width` of them, those that end the sequence (EOS, or max length)
    become finished hypotheses, scored by cum_logprob / generated_len ** length_penalty;
  - the best `width` that do not end become the next beams.
The engine then applies the plan: a parent's first child continues in the parent's
request, further children fork the parent's blocks (copy-on-write on the next write), and
parents without children are freed. With early stopping the group is done once `width`
hypotheses have finished. This reproduces transformers' beam search step for step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.outputs import Logprob
from pagedserve.request import Request, RequestStatus


@dataclass(slots=True)
class Beam:
    request_id: str
    score: float  # cumulative logprob of the generated tokens
    token_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Hypothesis:
    output_token_ids: list[int]
    token_logprobs: list[float]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass(slots=True)
class Continuation:
    """A next beam: `parent` continues with `token`; `fork` when another child already took the parent."""

    parent: str
    token: int
    score: float
    token_logprob: float
    fork: bool


@dataclass(slots=True)
class BeamPlan:
    continuations: list[Continuation]
    pruned: list[str]
    done: bool


class BeamGroup:
    def __init__(self, group_id: str, params: BeamSearchParams, eos_token_id: int | None, first_beam: str) -> None:
        self.group_id = group_id
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.beams: list[Beam] = [Beam(first_beam, 0.0)]
        self.finished: list[Hypothesis] = []
        # Top logprobs reported this round: beam id -> (token ids, logprobs).
        self.reported: dict[str, tuple[list[int], list[float]]] = {}
        self._pending_next: list[tuple[Beam, float, float]] = []

    @property
    def num_candidates(self) -> int:
        return 2 * self.params.beam_width

    def report(self, beam_id: str, token_ids: list[int], logprobs: list[float]) -> bool:
        """Records a beam's top logprobs; True once every live beam has reported."""
        self.reported[beam_id] = (token_ids, logprobs)
        return len(self.reported) == len(self.beams)

    def decide(self, output_tokens: dict[str, list[int]]) -> BeamPlan:
        """Chooses the next beams from this round's reports.

        Args:
            output_tokens: each live beam's generated tokens so far.
        """
        width = self.params.beam_width
        generated_len = len(output_tokens[self.beams[0].request_id]) + 1
        candidates = sorted(
            ((beam.score + lp, i, tok, lp) for i, beam in enumerate(self.beams)
             for tok, lp in zip(*self.reported[beam.request_id], strict=True)),
            key=lambda c: -c[0],
        )[: self.num_candidates]
        at_length = generated_len >= self.params.max_tokens
        ends = [at_length or tok == self.eos_token_id for _, _, tok, _ in candidates]
        for (score, i, tok, lp), end in zip(candidates[:width], ends[:width], strict=True):
            if end:
                beam = self.beams[i]
                self.finished.append(Hypothesis(
                    output_token_ids=output_tokens[beam.request_id] + [tok],
                    token_logprobs=beam.token_logprobs + [lp],
                    cum_logprob=score,
                    score=score / generated_len**self.params.length_penalty,
                    finish_reason="length" if tok != self.eos_token_id else "stop",
                ))
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:width]
        survivors = [c for c, end in zip(candidates, ends, strict=True) if not end][:width]
        self.reported.clear()
        done = len(self.finished) >= width or not survivors
        return self._plan(survivors if not done else [], done)

    def _plan(self, survivors: list[tuple[float, int, int, float]], done: bool) -> BeamPlan:
        taken: set[int] = set()
        continuations = []
        next_beams = []
        for score, i, tok, lp in survivors:
            parent = self.beams[i]
            continuations.append(Continuation(parent.request_id, tok, score, lp, fork=i in taken))
            taken.add(i)
            next_beams.append((parent, score, lp))
        pruned = [beam.request_id for i, beam in enumerate(self.beams) if i not in taken]
        self._pending_next = next_beams
        return BeamPlan(continuations, pruned, done)

    def adopt(self, plan: BeamPlan, new_ids: list[str]) -> None:
        """Sets the live beams after the engine applied `plan` (new_ids: one per continuation)."""
        self.beams = [
            Beam(rid, score, parent.token_logprobs + [lp])
            for rid, (parent, score, lp) in zip(new_ids, self._pending_next, strict=True)
        ]


class BeamSearchFailed(RuntimeError):
    """A search whose inputs failed to build: its caller's error, the engine goes on."""


class BeamSearchDriver:
    """Applies beam groups' decisions to the scheduler; owns the groups and their results.

    Per step the engine calls `take_reports` (before the scheduler update: beam rows get no
    sampled token, their logprobs are reported instead) and `apply_decisions` (after it).
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.groups: dict[str, BeamGroup] = {}
        self.group_of: dict[str, str] = {}
        # A finished search's output, or the error that ended it (`take` raises it).
        self.results: dict[str, BeamSearchOutput | BeamSearchFailed] = {}
        self._ready: list[str] = []
        self._forks = 0

    def add(self, first_beam: Request, params: BeamSearchParams) -> None:
        group_id = first_beam.group_id
        assert group_id is not None
        self.groups[group_id] = BeamGroup(group_id, params, first_beam.eos_token_id, first_beam.request_id)
        self.group_of[first_beam.request_id] = group_id
        self.scheduler.add_request(first_beam)

    def take_reports(self, sched_out: SchedulerOutput, sampled: list[int | None], logprobs: list[Any]) -> None:
        for index, item in enumerate(sched_out.scheduled):
            group_id = self.group_of.get(item.request.request_id)
            if group_id is None or sampled[index] is None:
                continue
            sampled[index] = None  # the group picks this beam's token, not the sampler
            ids, values, _ = logprobs[index]
            if self.groups[group_id].report(item.request.request_id, ids[1:], values[1:]):
                self._ready.append(group_id)

    def apply_decisions(self) -> None:
        ready, self._ready = self._ready, []
        for group_id in ready:
            group = self.groups[group_id]
            requests = {b.request_id: self.scheduler.requests[b.request_id] for b in group.beams}
            plan = group.decide({rid: list(r.output_token_ids) for rid, r in requests.items()})
            self._release(plan.pruned)
            new_ids = [self._continue(requests[c.parent], c) for c in plan.continuations]
            group.adopt(plan, new_ids)
            if plan.done:
                self._release(new_ids)
                self.results[group_id] = self._output(group, next(iter(requests.values())).prompt_token_ids)
                del self.groups[group_id]

    def _continue(self, parent: Request, c: Continuation) -> str:
        if not c.fork:
            parent.append_output_token(c.token)
            return parent.request_id
        self._forks += 1
        child = Request(
            request_id=f"{parent.group_id}#beam{self._forks}",
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params,
            eos_token_id=parent.eos_token_id,
            prompt=parent.prompt,
            max_output_tokens=parent.max_output_tokens,
            arrival_time=parent.arrival_time,
            group_id=parent.group_id,
            sample_index=self._forks,
            is_beam=True,
        )
        # The parent already took its own continuation this round: fork from its tokens before that.
        child.output_token_ids = list(parent.output_token_ids[: parent.num_computed_tokens - parent.num_prompt_tokens])
        self.scheduler.fork_request(parent, child, c.token)
        self.group_of[child.request_id] = parent.group_id or ""
        return child.request_id

    def _release(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.group_of.pop(rid, None)

    def _output(self, group: BeamGroup, prompt: list[int]) -> BeamSearchOutput:
        sequences = []
        for hyp in group.finished:
            tokens = prompt + hyp.output_token_ids
            sequences.append(BeamSearchSequence(
                tokens=tokens,
                logprobs=[{t: Logprob(lp)} for t, lp in zip(hyp.output_token_ids, hyp.token_logprobs, strict=True)],
                cum_logprob=hyp.cum_logprob,
                text=self.tokenizer.decode(tokens) if self.tokenizer is not None else None,
                finish_reason=hyp.finish_reason,
                score=hyp.score,
            ))
        return BeamSearchOutput(sequences)

    def fail(self, group_id: str, reason: str) -> None:
        """Ends the search with an error its caller gets from `take` (never the engine's)."""
        if self.abort(group_id):
            self.results[group_id] = BeamSearchFailed(f"beam search {group_id} failed: {reason}")

    def take(self, group_id: str) -> BeamSearchOutput | None:
        """The search's output once it finished (removed), None before; raises its failure."""
        result = self.results.pop(group_id, None)
        if isinstance(result, BeamSearchFailed):
            raise result
        return result

    def abort(self, group_id: str) -> bool:
        group = self.groups.pop(group_id, None)
        if group is None:
            return False
        self._release([b.request_id for b in group.beams])
        return True

    def has_work(self) -> bool:
        return bool(self.groups)
