"""The synchronous engine: step() = schedule -> run model -> sample -> update -> outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.beam_search import BeamSearchParams
from pagedserve.config import EngineConfig
from pagedserve.core.factory import build_kv_manager, build_scheduler
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.core.scheduler import SchedulerStats
from pagedserve.dtypes import lora_dtype, torch_device
from pagedserve.engine import builder, registry
from pagedserve.engine.beam_search import BeamSearchDriver
from pagedserve.engine.faults import FaultInjector
from pagedserve.engine.input_processor import EngineInput, InputProcessor, PromptInput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.parallel_sampling import SampleGroup, sample_request_id
from pagedserve.engine.step_timings import StepCounters, StepHook, StepTimer
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.lora.request import LoRARequest
from pagedserve.models.source import eos_token_ids, resolve_model_source
from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_outputs import RequestGrammar, StructuredOutputManager
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# A step that ran nothing waits this long at most for a pending adapter load (a new request
# arriving meanwhile waits as long; a load takes ~20 ms).
LORA_LOAD_WAIT_S = 0.02


@dataclass(slots=True)
class EngineStats:
    scheduler: SchedulerStats
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_steps_total: int
    last_step_num_tokens: int
    # Speculative decoding in the last step: proposed tokens verified, and accepted.
    last_step_spec_draft_tokens: int = 0
    last_step_spec_accepted_tokens: int = 0

    @property
    def last_step_spec_acceptance_rate(self) -> float | None:
        """Accepted / verified proposals of the last step; None if it verified none."""
        if not self.last_step_spec_draft_tokens:
            return None
        return self.last_step_spec_accepted_tokens / self.last_step_spec_draft_tokens


class LLMEngine:
    """Args:
        config: the frozen engine configuration.
        faults: a fault injector (tests only; see engine/faults.py): per-request failure points.
        clock: seconds for arrival / scheduling / finish times and the batching baselines'
            windows; the benchmarks' simulated-time driver passes its own (bench/sim.py).
    """

    _created = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """vLLM's constructor: the engine an `EngineArgs` describes."""
        return cls(engine_args.create_engine_config())

    def __init__(
        self, config: EngineConfig, faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.faults = faults
        self.clock = clock
        # The plan of the latest step (read by the benchmarks' simulated-time driver).
        self.last_scheduler_output: SchedulerOutput | None = None
        self.created_seq = next(LLMEngine._created)
        self.device = torch_device(config.device)
        torch.manual_seed(config.model.seed)
        model_cfg = config.model
        self.source = resolve_model_source(model_cfg, self.device)
        self.tokenizer = None if self.source.tokenizer is None else load_tokenizer(self.source.tokenizer)
        model_dtype = self.source.dtype
        # Ranks 1..N-1 of a tensor-parallel model (None with one rank); stopped by `shutdown`.
        self.tp_workers = builder.start_tp_workers(config, self.source, self.device, model_dtype)
        try:
            self.runner = ModelRunner(
                self.source.path, model_dtype, self.device, config.cache.block_size,
                quantization=model_cfg.quant_config(),
                kv_cache_dtype=config.cache.kv_cache_dtype,
                lora_dtype=lora_dtype(config.lora, model_dtype) if config.lora else None,
                faults=faults,
                tp_group=self.tp_workers.group if self.tp_workers is not None else None,
                tp_workers=self.tp_workers,
                compilation=config.compilation,
                gguf_blocks=model_cfg.serves_gguf_blocks,
            )
            if self.tp_workers is not None:
                self.tp_workers.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        hf_config = self.runner.hf_config
        self.vocab_size = self.runner.vocab_size
        # Width of an embedding (LLM.embed, /v1/embeddings): the final hidden state.
        self.hidden_size = int(getattr(hf_config, "hidden_size", 0) or getattr(hf_config, "n_embd", 0))
        # The first EOS id is the request's `eos_token_id`; any others end a sequence as
        # extra stop token ids (vLLM's treatment of generation_config's EOS list).
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, self.source.generation_eos_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.max_model_len = builder.resolve_max_model_len(hf_config, model_cfg.max_model_len)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )
        draft = builder.load_draft(config, self.device, model_dtype, self.vocab_size, self.max_model_len)
        self.num_blocks = builder.size_kv_cache(config, self.runner, draft, self.device, self.max_model_len)
        self.runner.initialize_kv_cache(self.num_blocks)
        self.num_swap_blocks = config.cache.swap_space_bytes // self.runner.kv_cache_spec().bytes_per_block
        self.runner.initialize_swap_space(self.num_swap_blocks)
        self.kv_manager = build_kv_manager(config.cache, self.num_blocks, self.max_model_len, self.num_swap_blocks,
                                           groups=self.runner.kv_groups)
        # Built before the scheduler, which gets it (as its AdapterResidency) at construction.
        self.lora_manager = builder.start_lora(config, self.kv_manager, self.runner, self.tp_workers is not None)
        self.scheduler = build_scheduler(sched, self.kv_manager, builder.preemption_policy(config, self.runner, self.device),
                                         self.lora_manager, clock=clock)
        self.speculator = builder.start_speculator(config, draft, self.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
            self.source.sampling_defaults, sched.scheduling_policy, self.hidden_size,
        )
        so_config = config.structured_outputs
        self.structured_outputs = None if self.tokenizer is None else StructuredOutputManager(
            so_config.resolved_backend, self.tokenizer, self.vocab_size, self.eos_token_id,
            so_config.compile_timeout_s,
        )
        self._groups: dict[str, SampleGroup] = {}
        self.beam_search = BeamSearchDriver(self.scheduler, self.tokenizer)
        self._next_request_id = 0
        self.counters = StepCounters()
        registry.register(self)
        self._step_hooks: list[StepHook] = []

    def health_problem(self) -> str | None:
        """Why this engine cannot serve even while idle (a tensor-parallel worker exited),
        else None. Safe from any thread (the server's /health calls it between steps)."""
        return None if self.tp_workers is None else self.tp_workers.problem()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (idempotent; nothing to do with one
        rank). The engine cannot step afterwards."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    # ---- requests ----------------------------------------------------------------------

    def new_request_id(self) -> str:
        self._next_request_id += 1
        return str(self._next_request_id - 1)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput | EngineInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> str:
        """Queues a request; raises ValueError naming the bad field.

        `prompt` is raw (processed here by the input processor) or an `EngineInput` the
        caller processed already, off this thread (the server); `params` and `priority` are
        then the input's own. `lora_request` selects an adapter (registered here, loaded from
        disk on demand). `priority`: lower runs first under scheduling_policy="priority".
        """
        inputs = prompt if isinstance(prompt, EngineInput) else self.input_processor.process(prompt, params, priority)
        params = inputs.params
        lora_id = self._register_lora(lora_request)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self._groups or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammar = self._compile_grammar(params)
        arrival = arrival_time if arrival_time is not None else self.clock()

        def make(rid: str, sample_params: SamplingParams, index: int, group: str | None) -> Request:
            return Request(
                request_id=rid, prompt_token_ids=inputs.prompt_token_ids, sampling_params=sample_params,
                eos_token_id=self.eos_token_id, prompt=inputs.prompt, cache_salt=inputs.cache_salt,
                max_output_tokens=inputs.max_output_tokens, arrival_time=arrival, group_id=group,
                sample_index=index, lora_id=lora_id, bad_words_token_ids=inputs.bad_words_token_ids,
                priority=inputs.priority,
                # Each sample follows the grammar with its own matcher.
                grammar=RequestGrammar(grammar, self.eos_token_id) if grammar is not None else None,
                pooling=inputs.pooling,
            )

        if params.num_samples == 1:
            samples = [make(request_id, params, 0, None)]
        else:
            samples = [
                make(sample_request_id(request_id, i), params.for_sample(i), i, request_id)
                for i in range(params.num_samples)
            ]
            self._groups[request_id] = SampleGroup(request_id, params, [r.request_id for r in samples])
        self.scheduler.add_request(samples[0], samples[1:])
        for sample in samples:
            self.output_processor.add_request(sample, lora_request)
        return request_id

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's generation_config.json (if any)."""
        return self.input_processor.default_sampling_params()

    def _compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (cached; the server compiled it already), or None.

        Raises GrammarError (a ValueError) naming the constraint when it is invalid or its
        compilation times out, before anything is queued.
        """
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.structured_outputs is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=False)")
        return self.structured_outputs.compile(spec)

    def _register_lora(self, lora_request: LoRARequest | None) -> int:
        if lora_request is None:
            return 0
        if self.lora_manager is None:
            raise ValueError("lora_request: LoRA is not enabled on this engine (enable_lora=True)")
        self.lora_manager.register(lora_request)
        return lora_request.lora_int_id

    def add_beam_search(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queues a beam search; its result appears in `beam_search.results[request_id]`."""
        lora_id = self._register_lora(lora_request)
        prompt_text, token_ids = self.input_processor.tokenize(prompt)
        self.input_processor.validate_prompt(token_ids)
        max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        # Each beam reports its top 2 * width raw logprobs; the group picks its tokens.
        beam_params = SamplingParams(temperature=0, logprobs=2 * params.beam_width, max_tokens=max_tokens + 1, ignore_eos=True)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.beam_search.groups or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        first = Request(
            request_id=f"{request_id}#beam0", prompt_token_ids=token_ids, sampling_params=beam_params,
            eos_token_id=self.eos_token_id, prompt=prompt_text, max_output_tokens=max_tokens + 1,
            group_id=request_id, is_beam=True, lora_id=lora_id,
        )
        self.beam_search.add(first, params if max_tokens == params.max_tokens else _with_max_tokens(params, max_tokens))
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.beam_search.abort(request_id):
                continue
            group = self._groups.pop(request_id, None)
            ids.extend(group.sample_ids if group is not None else [request_id])
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.requests)
        now = self.clock()
        for request_id in ids:
            self.output_processor.finish(request_id, now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- the step ----------------------------------------------------------------------

    def add_step_hook(self, hook: StepHook) -> None:
        """Calls `hook(StepTimings)` after every step that ran the model (benchmarks, metrics)."""
        self._step_hooks.append(hook)

    def remove_step_hook(self, hook: StepHook) -> None:
        self._step_hooks.remove(hook)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model -> update the requests -> their outputs.

        A request whose own preparation or detokenization raises ends alone with finish_reason
        "error" (its blocks freed this step); only a failure of the step as a whole (the model
        forward) propagates."""
        timer = StepTimer(self._step_hooks)
        sched_out = self.last_scheduler_output = self.scheduler.schedule()
        self._stamp_first_scheduled(sched_out)
        timer.mark_scheduled()
        runner_out = self.runner.execute_model(sched_out)
        failed = self._fail_in_runner(sched_out, runner_out.failed)
        timer.mark_ran()
        updated, first_new = self._update_from_output(sched_out, runner_out)
        failed += self.scheduler.take_failed()
        timer.mark_updated()
        outputs = self._make_outputs(updated, first_new, _logprobs_by_request(sched_out, runner_out), failed)
        outputs += self._report_failed(failed)
        if self.speculator is not None:
            # After stop strings ended their requests: propose for who runs next step.
            self.speculator.release(self.scheduler.requests)
            self.speculator.propose(self.scheduler.running)
        timer.finish(sched_out, runner_out)
        if sched_out.is_empty and self.lora_manager is not None:
            # Nothing ran: its requests may wait on adapter loads; give the loader the GIL.
            self.lora_manager.wait_for_loads(LORA_LOAD_WAIT_S)
        return outputs

    def _stamp_first_scheduled(self, sched_out: SchedulerOutput) -> None:
        now = self.clock()
        for item in sched_out.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now

    def _update_from_output(self, sched_out: SchedulerOutput, runner_out: Any) -> tuple[list[Request], dict[str, int]]:
        """The scheduler, speculator and beam search take the step's tokens; pooled vectors and
        prompt logprobs go to the output processor. Returns the updated requests and, per
        request, the index of its first new output token."""
        sampled = runner_out.sampled_token_ids
        if self.beam_search.has_work():
            self.beam_search.take_reports(sched_out, sampled, runner_out.logprobs)
        first_new = {item.request.request_id: item.request.num_output_tokens for item in sched_out.scheduled}
        updated = self.scheduler.update_from_output(
            sched_out, sampled, runner_out.fork_token_ids, runner_out.extra_token_ids or None
        )
        if self.speculator is not None:
            self.speculator.observe(sched_out, runner_out.extra_token_ids)
        if self.beam_search.has_work():
            self.beam_search.apply_decisions()
        self.counters.record_step(sched_out)
        for item, vector in zip(sched_out.scheduled, runner_out.pooled, strict=False):
            if vector is not None:
                self.output_processor.set_pooled(item.request, vector)
        for item, prompt_lp in zip(sched_out.scheduled, runner_out.prompt_logprobs, strict=False):
            if prompt_lp is not None:
                self.output_processor.add_prompt_logprobs(item.request, prompt_lp)
        return updated, first_new

    def _make_outputs(self, updated: list[Request], first_new: dict[str, int], logprobs_by_id: dict[str, list[Any]],
                      failed: list[Request]) -> list[RequestOutput]:
        """The updated requests' outputs; one whose processing raises is appended to `failed`."""
        now = self.clock()
        outputs = []
        for request in updated:
            first = first_new.get(request.request_id, 0)
            self.counters.generation_tokens += request.num_output_tokens - first
            try:
                output = self._process_token(request, first, logprobs_by_id.get(request.request_id, []), now)
            except Exception as exc:  # noqa: BLE001 - this request's own failure, not the batch's
                logger.warning("request %s failed while processing its output: %r", request.request_id, exc)
                self._end_with_error(request, f"{type(exc).__name__}: {exc}")
                failed.append(request)
                continue
            if output is not None:  # None: an unfinished final_only request or group sample
                outputs.append(output)
        return outputs

    def _report_failed(self, failed: list[Request]) -> list[RequestOutput]:
        """Requests that failed in the runner, the scheduler (their adapter did not load) or the
        output processor: reported as finished with "error", nothing else touched."""
        now = self.clock()
        outputs = []
        for request in failed:
            if not self.output_processor.has(request.request_id):
                continue  # already reported as finished
            output = self.output_processor.make_output(request, True)
            self.output_processor.finish(request.request_id, now)
            reported = self._group_output(request, output) if request.group_id is not None else output
            if reported is not None:  # None: its group has not finished
                outputs.append(reported)
        return outputs

    def _process_token(
        self, request: Request, first_new: int, logprobs: list[Any], now: float
    ) -> RequestOutput | None:
        """The request's new tokens (one, or an accepted speculative run) -> its output."""
        if self.faults is not None:
            self.faults.check("detokenize", request.request_id)
        self._process_new_tokens(request, first_new, logprobs, now)
        finished = request.status.finished
        if not finished and _reports_only_when_finished(request):
            return None  # nobody reads this step's output: not built (O(tokens) per request)
        output = self.output_processor.make_output(request, finished)
        if finished:
            self.output_processor.finish(request.request_id, now)
        if request.group_id is not None:
            return self._group_output(request, output)
        return output

    def _end_with_error(self, request: Request, message: str) -> None:
        """Ends one request with finish_reason "error"; `stop_reason` carries the message."""
        request.stop_reason = message
        if request.status.finished:
            request.status = RequestStatus.FINISHED_ERROR  # already retired: only the report changes
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)

    def _fail_in_runner(self, sched_out, reasons: dict[str, str]) -> list[Request]:
        """Ends the requests (and the siblings they were to fork) whose inputs failed to build."""
        if not reasons:
            return []
        failed: list[Request] = []
        for item in sched_out.scheduled:
            reason = reasons.get(item.request.request_id)
            if reason is None:
                continue
            if item.request.is_beam:
                # One decision over all its beams: the whole search ends, its caller (LLM.beam_search
                # or a use_beam_search request) gets the error, and the engine goes on.
                self.beam_search.fail(item.request.group_id or "", reason)
                continue
            for request in (item.request, *item.fork_requests):
                self._end_with_error(request, reason)
                failed.append(request)
        return failed

    def _process_new_tokens(self, request: Request, first_new: int, logprobs: list[Any], now: float) -> None:
        """Detokenizes the request's new tokens in order; a stop string ends it at its token
        (the rest of an accepted speculative run is dropped) and frees its blocks now."""
        last = request.num_output_tokens - 1
        for index in range(first_new, last + 1):
            offset = index - first_new
            lp = logprobs[offset] if offset < len(logprobs) else None
            if not self.output_processor.process_token(request, lp, now, index):
                continue
            if index < last:
                del request.output_token_ids[index + 1 :]
                if request.status.finished:
                    # The run's later token ended it (EOS, length); the stop string came first.
                    request.status = RequestStatus.FINISHED_STOPPED
            if not request.status.finished:
                # A stop string ends the request now; its blocks return to the pool this step.
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            return

    def _group_output(self, request: Request, output: RequestOutput) -> RequestOutput | None:
        group = self._groups.get(request.group_id) if request.group_id is not None else None
        if group is None:
            return None
        merged = group.add(output, request.sample_index)
        if group.finished:
            del self._groups[group.group_id]
        return merged

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Uses `tokenizer` for new requests' prompts and outputs (vLLM's LLM.set_tokenizer)."""
        self.tokenizer = tokenizer
        self.input_processor.set_tokenizer(tokenizer)
        self.output_processor.set_tokenizer(tokenizer)
        self.beam_search.tokenizer = tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; refused (False) while requests run, as in vLLM."""
        if self.has_unfinished_requests():
            return False
        self.kv_manager.reset_prefix_cache()
        return True

    def get_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.stats(),
            num_prompt_tokens_total=self.counters.prompt_tokens,
            num_generation_tokens_total=self.counters.generation_tokens,
            num_steps_total=self.counters.steps,
            last_step_num_tokens=self.counters.last_step_tokens,
            last_step_spec_draft_tokens=self.speculator.last_num_draft_tokens if self.speculator else 0,
            last_step_spec_accepted_tokens=self.speculator.last_num_accepted_tokens if self.speculator else 0,
        )

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()

    def assert_no_leaks(self) -> None:
        """Leak check: engine idle, every block free, every reference count zero."""
        assert not self.has_unfinished_requests(), "engine still has unfinished requests"
        adapter_blocks: set[int] = set()
        if self.lora_manager is not None:
            self.lora_manager.check_idle()
            adapter_blocks = self.lora_manager.device_blocks()
        self.kv_manager.assert_all_free(adapter_blocks)
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.kv.assert_all_free()
        if self.tp_workers is not None and self.tp_workers.alive:
            # The block accounting lives here only; the workers must hold nothing between steps.
            for rank, state in enumerate(self.tp_workers.query_state(), start=1):
                assert not state["holds_step"], f"tensor-parallel rank {rank} still holds a step's tensors"
                assert state["generators"] == 0, f"tensor-parallel rank {rank} holds sampling generators"
                assert state["num_blocks"] == self.num_blocks, (
                    f"tensor-parallel rank {rank} has {state['num_blocks']} KV blocks, rank 0 {self.num_blocks}")


def _reports_only_when_finished(request: Request) -> bool:
    """Whether the caller sees this request only when it finishes: output_kind "final_only",
    or a sample of an n / best_of group outside delta mode (the group reports once)."""
    kind = request.sampling_params.output_kind
    return kind == "final_only" or (request.group_id is not None and kind != "delta")


def _with_max_tokens(params: BeamSearchParams, max_tokens: int) -> BeamSearchParams:
    from dataclasses import replace

    return replace(params, max_tokens=max_tokens)


def _logprobs_by_request(sched_out, runner_out) -> dict[str, list[Any]]:
    """Request id -> logprobs of each token it got this step, in order (None where not asked)."""
    found: dict[str, list[Any]] = {}
    for index, item in enumerate(sched_out.scheduled):
        extra = runner_out.extra_logprobs[index] if runner_out.extra_logprobs else []
        found[item.request.request_id] = [runner_out.logprobs[index], *extra]
        for sibling, lp in zip(item.fork_requests, runner_out.fork_logprobs[index], strict=False):
            found[sibling.request_id] = [lp]
    return found
