"""The 2026 families (issue 36) with the engine's features, token for token transformers'
(fp32, eager attention) on the tiny random configs of test_families_2026.

Prefix caching and chunked prefill are covered there, preemption in
tests/engine/test_sliding_window.py; here:
  * n / best_of (Gemma 3: samples fork windowed groups' blocks) vs transformers' logprobs;
  * beam search (Qwen3; Gemma 3 with window 8 over 8-token blocks, so beams fork blocks a
    windowed layer later gives back) vs transformers' beam search;
  * speculative decoding, n-gram lookup and a draft model (a noisy copy: rejections roll the
    windowed groups' blocks back too) vs transformers' greedy;
  * LoRA (PEFT adapters on every linear layer; Phi-3's fused qkv_proj / gate_up_proj as PEFT
    targets them) vs PEFT's greedy; on windowed models in tests/lora/test_lora_windowed.py;
  * tensor parallelism, two ranks (slow: worker processes) vs transformers' greedy;
  * structured outputs (a regex) vs transformers' greedy restricted, token by token, to the
    tokens that keep the text a prefix of the regex's language (the `regex` module's
    partial matches: an oracle independent of our grammar backend).
Every engine ends with no KV block held.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import regex
import torch
from test_families_2026 import CONFIGS
from test_models import save_random_model
from transformers import AutoModelForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

from pagedserve import LLM, BeamSearchParams, LoRARequest, SamplingParams
from pagedserve.demo_models import get_tokenizer_path
from pagedserve.sampling_params import StructuredOutputsParams

from lora_utils import make_peft_adapter

NEW_TOKENS = 16
ENGINE = dict(max_model_len=128, block_size=8, kv_cache_memory_bytes=8 << 20, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("features")


def checkpoint(root: Path, name: str) -> Path:
    path = root / name
    if not (path / "config.json").is_file():
        save_random_model(CONFIGS[name], path)
    return path


def prompts(vocab: int, lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_eager(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens, EOS ignored (the engine's `ignore_eos`)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,  # type: ignore[operator]
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---- beam search ---------------------------------------------------------------------------


# Qwen3's attention is Llama's plus q/k norms (the beam machinery is covered on Llama): slow.
@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.slow), "gemma3"])
def test_beam_search_matches_transformers(root: Path, name: str) -> None:
    path = checkpoint(root, name)
    model = hf_eager(path)
    ps = prompts(96, [7, 21])
    width = 3
    llm = LLM(str(path), **ENGINE)
    params = BeamSearchParams(beam_width=width, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in ps], params)
    for prompt, out in zip(ps, outputs, strict=True):
        with torch.inference_mode():
            ref = model.generate(  # type: ignore[operator]
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=width, num_return_sequences=width, do_sample=False, early_stopping=True,
                max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
        assert [s.tokens[len(prompt):] for s in out.sequences] == [s[len(prompt):].tolist() for s in ref.sequences]
        assert [s.score for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    llm.llm_engine.assert_no_leaks()


# ---- n / best_of ---------------------------------------------------------------------------


def test_parallel_samples_logprobs_match_transformers(root: Path) -> None:
    """n=2 of best_of=4 sampled continuations of one Gemma 3 prompt (the samples fork its
    blocks, windowed groups included): each sampled token's logprob equals transformers'
    log-softmax over the prompt plus that sample, and the two kept are the likeliest."""
    path = checkpoint(root, "gemma3")
    model = hf_eager(path)
    (prompt,) = prompts(96, [19])
    llm = LLM(str(path), **ENGINE)
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids
    for sample in out.outputs:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + list(sample.token_ids)])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
        want = want[torch.arange(len(sample.token_ids)), torch.tensor(sample.token_ids)]
        got = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids, strict=True)]
        assert got == pytest.approx(want.tolist(), abs=1e-4)
        assert sample.cumulative_logprob == pytest.approx(want.sum().item(), abs=1e-3)
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    llm.llm_engine.assert_no_leaks()


# ---- speculative decoding ------------------------------------------------------------------


def noisy_copy(path: Path, out: Path, relative_noise: float = 0.05) -> Path:
    """A draft that mostly agrees with the target: each matrix plus noise of 5% its std."""
    if not (out / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * p.std() * relative_noise)
        model.save_pretrained(out)
    return out


@pytest.mark.parametrize(("name", "method"), [
    pytest.param("qwen3", "ngram", marks=pytest.mark.slow), ("gemma3", "ngram"), ("gemma3", "draft")])
def test_speculative_decoding_matches_transformers(root: Path, name: str, method: str) -> None:
    path = checkpoint(root, name)
    model = hf_eager(path)
    # Repetitive prompts: n-gram lookup finds matches to propose.
    ps = [[11, 12, 13, 14, 15, 16] * 4, prompts(96, [30])[0]]
    expected = [greedy(model, p, 24) for p in ps]
    always = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **always} if method == "ngram"
            else {"model": str(noisy_copy(path, root / f"{name}-noisy")), "num_speculative_tokens": 3, **always})
    llm = LLM(str(path), speculative_config=spec, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # min_tokens would not speculate
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert token_ids(outputs) == expected
    stats = llm.llm_engine.get_stats().scheduler
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    if method == "draft":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejections rolled back
    llm.llm_engine.assert_no_leaks()


# ---- LoRA ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["phi3_partial_rotary", *(pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3", "granite", "smollm3"))])
def test_lora_matches_peft(root: Path, name: str) -> None:
    from peft import PeftModel

    path = checkpoint(root, name)
    adapter = make_peft_adapter(path, root / f"{name}-lora", 8, "all-linear", seed=3)
    reference = PeftModel.from_pretrained(hf_eager(path), adapter).eval()
    base = hf_eager(path)
    ps = prompts(96, [9, 26])
    expected = [greedy(reference, p) for p in ps]
    assert expected != [greedy(base, p) for p in ps]  # the adapter changes the answer
    llm = LLM(str(path), enable_lora=True, max_lora_rank=8, **ENGINE)
    lora = LoRARequest("a", 1, adapter)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # The adapter and the base model in one batch.
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps * 2], params, use_tqdm=False,
                           lora_request=[lora, lora, None, None])
    assert token_ids(outputs) == expected + [greedy(base, p) for p in ps]
    llm.llm_engine.assert_no_leaks()


# ---- tensor parallelism --------------------------------------------------------------------


@pytest.mark.slow  # two worker processes a model
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_two_ranks_match_transformers(root: Path, name: str) -> None:
    path = checkpoint(root, name)
    model = hf_eager(path)
    ps = prompts(96, [7, 40])
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        assert token_ids(outputs) == [greedy(model, p) for p in ps]
        llm.llm_engine.assert_no_leaks()
    finally:
        llm.llm_engine.shutdown()


# ---- structured outputs --------------------------------------------------------------------

PATTERN = r"[a-z]{2,6}( [a-z]{2,6}){2}"


def gemma3_with_tokenizer(root: Path) -> tuple[Path, PreTrainedTokenizerFast]:
    """Gemma 3 (window 8) over the project's 1024-token BPE tokenizer."""
    path = root / "gemma3-tok"
    tok = PreTrainedTokenizerFast.from_pretrained(str(get_tokenizer_path(1024, style="qwen2")))
    if not (path / "config.json").is_file():
        base = CONFIGS["gemma3"].to_dict()
        config = Gemma3TextConfig(**base | {"vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                            "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id})
        save_random_model(config, path)
        tok.save_pretrained(str(path))
    return path, tok


def test_structured_output_matches_a_constrained_transformers(root: Path) -> None:
    path, tok = gemma3_with_tokenizer(root)
    model = hf_eager(path)
    eos = tok.eos_token_id
    texts = {i: str(tok.decode([i])) for i in range(len(tok))}
    special = set(tok.all_special_ids)

    def allowed(_batch: int, ids: torch.Tensor) -> list[int]:
        done = str(tok.decode(ids[len(prompt):].tolist()))
        ok = [i for i, t in texts.items() if i not in special and t
              and regex.fullmatch(PATTERN, done + t, partial=True)]
        return ok + ([eos] if regex.fullmatch(PATTERN, done) else [])

    llm = LLM(str(path), max_model_len=128, block_size=8, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=PATTERN))
    for prompt in prompts(len(tok), [5, 30], seed=2):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,  # type: ignore[operator]
                                 prefix_allowed_tokens_fn=allowed, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        expected = out[0, len(prompt):].tolist()
        (ours,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert regex.fullmatch(PATTERN, ours.outputs[0].text)
        assert list(ours.outputs[0].token_ids) == expected
    llm.llm_engine.assert_no_leaks()
