"""The engine's per-step timings hook (engine/step_timings.py): one record per step that ran
the model, with the step's batch and parts that add up to no more than the step."""

from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.engine.step_timings import StepTimings


def test_step_hook_reports_every_model_step(model_path) -> None:
    llm = LLM(model_path("llama-gqa"), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    seen: list[StepTimings] = []
    llm.llm_engine.add_step_hook(seen.append)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # Step 1 prefills both (4 tokens) and samples their first tokens; 3 decode steps follow.
    assert [(s.num_seqs, s.num_tokens) for s in seen] == [(2, 4), (2, 2), (2, 2), (2, 2)]
    # Contexts 3 + 1, then 4 + 2, 5 + 3, 6 + 4 rows; the prefill scores 6 + 1 (query, key) pairs.
    assert [s.context_tokens for s in seen] == [4, 6, 8, 10]
    assert [s.attended_keys for s in seen] == [7, 6, 8, 10]
    assert [s.logits_rows for s in seen] == [2, 2, 2, 2]
    assert llm.llm_engine.get_stats().num_steps_total == len(seen)
    for s in seen:
        parts = [s.schedule_s, s.prepare_s, s.forward_s, s.sample_s, s.update_s, s.output_s]
        assert all(p >= 0 for p in parts) and s.forward_s > 0
        assert sum(parts) <= s.total_s
        assert 0 < s.overhead_s < s.total_s
    llm.llm_engine.remove_step_hook(seen.append)
    n = len(seen)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(seen) == n  # removed


def test_logits_rows_skip_prompt_chunks_that_do_not_sample(model_path) -> None:
    # A 10-token prompt in chunks of 4: the first two chunks sample nothing, so the LM head
    # (and the throughput roofline's head FLOPs) runs on no row for them.
    llm = LLM(model_path("llama-gqa"), max_model_len=128, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=4, enable_chunked_prefill=True)
    seen: list[StepTimings] = []
    llm.llm_engine.add_step_hook(seen.append)
    llm.generate([{"prompt_token_ids": list(range(5, 15))}],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [(s.num_tokens, s.logits_rows) for s in seen] == [(4, 0), (4, 0), (2, 1), (1, 1)]
