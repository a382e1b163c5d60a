"""The offline API, shaped like vLLM's `LLM` so vLLM scripts run by changing the import."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm.auto import tqdm

from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams
from pagedserve.engine.llm_engine import LLMEngine, PromptInput
from pagedserve.engine_args import EngineArgs
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generates text for batches of prompts with continuous batching over a paged KV cache.

    Args:
        model: a Hugging Face folder (config.json, *.safetensors, tokenizer files), a .gguf
            file (config, tokenizer and chat template from its metadata; weights dequantized
            at load), or a hub id ("org/name") found in the local Hugging Face cache.
        **kwargs: any engine setting by its vLLM name (`dtype`, `seed`, `block_size`,
            `kv_cache_memory_bytes`, `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
            `enable_chunked_prefill`, `enable_prefix_caching`, `preemption_mode`, `swap_space`
            (GiB), `quantization`, `kv_cache_dtype`, `enable_lora`, `max_loras`, ...): the fields
            of :class:`pagedserve.engine_args.EngineArgs`, where each is documented once. An
            unknown keyword is a TypeError naming it; a bad value a ValueError naming it.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=str(model), **kwargs).create_engine_config())

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM over the engine these settings describe."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(engine_args.create_engine_config())
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Uses another (compatible) tokenizer for prompts and output text from now on."""
        self.llm_engine.set_tokenizer(tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`/`chat` use when given none: vLLM's defaults, overridden by the
        model's generation_config.json (unless generation_config="vllm")."""
        return self.llm_engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (False, and nothing done, while requests are running)."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges under vLLM's metric names (vLLM's LLM.get_metrics)."""
        stats = self.llm_engine.get_stats()
        sched = stats.scheduler
        return [
            Metric("vllm:num_requests_running", "gauge", sched.num_running),
            Metric("vllm:num_requests_waiting", "gauge", sched.num_waiting),
            Metric("vllm:kv_cache_usage_perc", "gauge", sched.kv_usage),
            Metric("vllm:num_preemptions", "counter", sched.num_preemptions_total),
            Metric("vllm:prefix_cache_queries", "counter", sched.prefix_cache_queries),
            Metric("vllm:prefix_cache_hits", "counter", sched.prefix_cache_hits),
            Metric("vllm:prompt_tokens", "counter", stats.num_prompt_tokens_total),
            Metric("vllm:generation_tokens", "counter", stats.num_generation_tokens_total),
        ]

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in input order.

        Args:
            priority: one per prompt; lower runs first (needs scheduling_policy="priority").
            lora_request: one adapter for every prompt, or one (or None) per prompt.
                Each adapter is loaded and validated first: a bad one raises
                LoRALoadError naming it before any prompt runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        loras = self._prepare_loras(lora_request, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompt_list)} prompts; pass one per prompt")
        request_ids = self._add_all(prompt_list, params_list, loras, priorities)
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: the final hidden state at the last prompt token (vLLM's
        LAST pooling for a decoder-only model), L2-normalized unless pooling_params says not."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list: list[Any] = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"pooling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        loras = self._prepare_loras(lora_request, len(prompt_list))
        outputs = self._run(self._add_all(prompt_list, params_list, loras), use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(list(o.pooled or [])))
            for o in outputs
        ]

    def _prepare_loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"lora_request: got {len(loras)} for {n} prompts; pass one, or one per prompt")
        manager = self.llm_engine.lora_manager
        for lora in {lo for lo in loras if lo is not None}:
            if manager is None:
                raise ValueError("lora_request: LoRA is not enabled (LLM(..., enable_lora=True))")
            manager.register(lora, load_now=True)
        return loras

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the chat template to each conversation, then generates (vLLM's signature).

        Message content may be a string or OpenAI's list of text parts; `chat_template_content_format`
        says how the template wants it ("auto" looks at the template). continue_final_message
        (with add_generation_prompt=False) lets the model continue the last message.
        tools: OpenAI-style tool definitions, rendered by the template (which must know
        tools: see pagedserve/chat_templates/hermes_tools.jinja); assistant messages may
        carry tool_calls and role "tool" messages their results. chat_template_kwargs: extra
        template variables.
        """
        if self.get_tokenizer() is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.llm_engine.input_processor
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text, token_ids = processor.render_chat(
                conversation, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs, chat_template_content_format=chat_template_content_format,
            )
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, run inside the engine (beams share KV blocks).

        Returns, per prompt, its `beam_width` best sequences, best first.
        """
        engine = self.llm_engine
        prompt_list = _as_prompt_list(prompts)
        if lora_request is not None:
            self._prepare_loras(lora_request, 1)
        ids: list[str] = []
        try:
            for prompt in prompt_list:
                ids.append(engine.add_beam_search(None, prompt, params, lora_request=lora_request))
        except Exception:
            engine.abort_request(ids)
            raise
        bar = _progress_bar(use_tqdm, total=len(ids), desc="Beam search")
        try:
            while any(i not in engine.beam_search.results for i in ids):
                engine.step()
                bar.n = sum(i in engine.beam_search.results for i in ids)
                bar.refresh()
        except BaseException:
            engine.abort_request([i for i in ids if i not in engine.beam_search.results])
            raise
        finally:
            bar.close()
        try:
            outputs = [engine.beam_search.take(i) for i in ids]  # raises a failed search's error
        finally:
            for i in ids:
                engine.beam_search.results.pop(i, None)
        return [o for o in outputs if o is not None]

    def _add_all(
        self,
        prompts: list[PromptInput],
        params: list[SamplingParams | None],
        loras: list[LoRARequest | None],
        priorities: list[int] | None = None,
    ) -> list[str]:
        engine = self.llm_engine
        added: list[str] = []
        priorities = priorities or [0] * len(prompts)
        try:
            for prompt, p, lora, priority in zip(prompts, params, loras, priorities, strict=True):
                added.append(engine.add_request(None, prompt, _final_only(p, engine), lora_request=lora,
                                                priority=priority))
        except Exception:
            # One bad prompt fails the call, but must not leave the others in the engine.
            engine.abort_request(added)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, total=len(request_ids), desc="Processed prompts")
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        finished[output.request_id] = output
                        bar.update(1)
                if use_tqdm:
                    bar.set_postfix_str(f"out tok/s: {generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


@dataclass(frozen=True)
class Metric:
    """One metric of `LLM.get_metrics()`: its vLLM name, kind ("counter" | "gauge") and value."""

    name: str
    kind: str
    value: float


def _final_only(params: Any, engine: LLMEngine) -> Any:
    """`LLM` returns only finished outputs, so a cumulative request (the default) runs as
    "final_only", as in vLLM's LLM: the engine then builds its output once, not every step."""
    if params is None:
        params = engine.default_sampling_params()
    if isinstance(params, SamplingParams) and params.output_kind == "cumulative":
        return replace(params, output_kind="final_only")
    return params


def _progress_bar(use_tqdm: bool | Callable[..., Any], **kwargs: Any) -> Any:
    """vLLM's use_tqdm: True / False, or a tqdm-like class (a callable taking tqdm's arguments)."""
    if callable(use_tqdm):
        return use_tqdm(dynamic_ncols=True, **kwargs)
    return tqdm(disable=not use_tqdm, dynamic_ncols=True, **kwargs)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("prompts: pass token ids as {'prompt_token_ids': [...]}, not a bare list of ints")
    return prompts


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams | None]:
    if params is None:
        return [None] * n  # the engine's defaults (generation_config.json)
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts; pass one, or one per prompt")
    return params
