"""The offline API, shaped like vLLM's `LLM` so vLLM scripts run by changing the import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams
from pagedserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from pagedserve.engine.llm_engine import LLMEngine, PromptInput
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generates text for batches of prompts with continuous batching over a paged KV cache.

    Args:
        model: a Hugging Face folder (config.json, *.safetensors, tokenizer files).
        tokenizer: tokenizer folder, if not the model's.
        skip_tokenizer_init: no tokenizer; prompts must be token ids and outputs have no text.
        dtype: "auto" (float32 on CPU), "float32", "bfloat16" or "float16".
        seed: seed of the engine's random generator (requests without their own seed).
        block_size: tokens per KV block.
        kv_cache_memory_bytes: memory for the KV cache; default a share of free memory.
        num_gpu_blocks_override: exact number of KV blocks (overrides the memory budget).
        max_model_len: longest prompt + output; default the model's maximum.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: split long prompts over several steps.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes seen before.
        preemption_mode: "recompute", "swap" or "auto" (swap when copying is cheaper).
        swap_space_bytes: host memory for swapped-out KV blocks.
        device: "auto", "cpu" or "cuda".
        enable_lora: serve PEFT LoRA adapters (per request, mixed in one batch).
        max_loras: adapters resident in the KV memory pool at once.
        max_lora_rank: largest adapter rank accepted.
        max_cpu_loras: adapters kept in the host cache (default max(max_loras, 16)).
        lora_dtype: adapters' dtype in the KV pool: "auto" (the model's), "float32" or
            "bfloat16" (half the memory and decode reads; weights rounded once).
        kv_allocation: "paged", or a contiguous baseline for benchmarks ("contiguous-max",
            "contiguous-pow2", "contiguous-oracle"; see core/contiguous.py).
        batching: "continuous", or a baseline for benchmarks ("static", "dynamic"; see
            core/batching.py).
        batch_window_s: dynamic batching's longest wait for a partial batch.
        quantization: None, "int8" (per-channel weights) or "int4" (group-wise weights),
            applied to every linear layer while loading a full-precision checkpoint.
        quantization_group_size: int4 group size (32, 64, 128 or 256).
        quantize_lm_head: also quantize the LM head (embeddings stay full precision).
        kv_cache_dtype: "auto" (the model's dtype) or "int8" (per-token-per-head scales).
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        dtype: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "auto",
        swap_space_bytes: int = 1 << 30,
        device: str = "auto",
        kv_allocation: str = "paged",
        batching: str = "continuous",
        batch_window_s: float = 0.05,
        quantization: str | None = None,
        quantization_group_size: int = 128,
        quantize_lm_head: bool = False,
        kv_cache_dtype: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
        lora_dtype: str = "auto",
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=str(model),
                tokenizer=str(tokenizer) if tokenizer is not None else None,
                skip_tokenizer_init=skip_tokenizer_init,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                quantization=quantization,
                quantization_group_size=quantization_group_size,
                quantize_lm_head=quantize_lm_head,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_gpu_blocks_override=num_gpu_blocks_override,
                enable_prefix_caching=enable_prefix_caching,
                swap_space_bytes=swap_space_bytes,
                kv_allocation=kv_allocation,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                preemption_mode=preemption_mode,
                batching=batching,
                batch_window_s=batch_window_s,
            ),
            device=device,
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras, lora_dtype) if enable_lora else None,
        )
        self.llm_engine = LLMEngine(config)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in input order.

        Args:
            lora_request: one adapter for every prompt, or one (or None) per prompt.
                Each adapter is loaded and validated first: a bad one raises
                LoRALoadError naming it before any prompt runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        loras = self._prepare_loras(lora_request, len(prompt_list))
        request_ids = self._add_all(prompt_list, params_list, loras)
        return self._run(request_ids, use_tqdm)

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
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template already placed any BOS token; do not add a second one.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, run inside the engine (beams share KV blocks).

        Returns, per prompt, its `beam_width` best sequences, best first.
        """
        engine = self.llm_engine
        prompt_list = _as_prompt_list(prompts)
        ids: list[str] = []
        try:
            for prompt in prompt_list:
                ids.append(engine.add_beam_search(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        bar = tqdm(total=len(ids), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True)
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
        return [engine.beam_search.results.pop(i) for i in ids]

    def _add_all(
        self, prompts: list[PromptInput], params: list[SamplingParams], loras: list[LoRARequest | None]
    ) -> list[str]:
        engine = self.llm_engine
        added: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                added.append(engine.add_request(None, prompt, p, lora_request=lora))
        except Exception:
            # One bad prompt fails the call, but must not leave the others in the engine.
            engine.abort_request(added)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    generated += 1
                    if output.finished:
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


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("prompts: pass token ids as {'prompt_token_ids': [...]}, not a bare list of ints")
    return prompts


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts; pass one, or one per prompt")
    return params
