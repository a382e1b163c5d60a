"""Aggregates the samples of an n / best_of request into one RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


def sample_request_id(group_id: str, index: int) -> str:
    return f"{group_id}#{index}"


@dataclass
class SampleGroup:
    """The samples of one request. Cumulative mode reports once, when every sample is done;
    delta mode (streaming) passes each sample's update through with its index."""

    group_id: str
    params: SamplingParams
    sample_ids: list[str]
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    # Only the sample that prefills computes the prompt's logprobs; they belong to the group.
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.sample_ids)

    def add(self, output: RequestOutput, index: int) -> RequestOutput | None:
        completion = output.outputs[0]
        completion.index = index
        self.latest[index] = completion
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.done.add(index)
        if self.params.output_kind == "delta":
            return self._wrap(output, [completion])
        if not self.finished:
            return None
        generated = sum(len(c.token_ids) for c in self.latest.values())
        final = self._wrap(output, self._final_completions())
        if len(self.latest) > self.params.n:
            final.num_generated_tokens = generated
        return final

    def _final_completions(self) -> list[CompletionOutput]:
        completions = [self.latest[i] for i in sorted(self.latest)]
        n = self.params.n
        if len(completions) > n:
            # best_of: keep the n most likely samples, best first.
            completions = sorted(completions, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:n]
            for new_index, completion in enumerate(completions):
                completion.index = new_index
                if self.params.logprobs is None:
                    completion.logprobs = None  # computed only for the ranking
        return completions

    def _wrap(self, output: RequestOutput, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.group_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            metrics=output.metrics,
            prompt_logprobs=self.prompt_logprobs if self.params.output_kind != "delta" else output.prompt_logprobs,
            num_cached_tokens=output.num_cached_tokens,
            lora_request=output.lora_request,
        )
