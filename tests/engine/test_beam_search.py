"""Beam search inside the engine equals transformers' beam search, token for token."""

from __future__ import annotations

import pytest

from pagedserve import LLM, BeamSearchParams

from hf_reference import hf_beams, make_prompts

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def setup(model_path):
    path = model_path("llama-gqa")
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    return path, llm


def check(llm, path, prompts, width, length_penalty, ignore_eos, max_tokens=MAX_TOKENS):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_beams(path, prompt, width, length_penalty, max_tokens, ignore_eos)
        ours = [(s.tokens[len(prompt):], s.score) for s in out.sequences]
        assert [t for t, _ in ours] == [t for t, _ in expected]
        assert [s for _, s in ours] == pytest.approx([s for _, s in expected], abs=1e-4)
    return outputs


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beams_equal_transformers_without_eos(setup, width, length_penalty):
    path, llm = setup
    prompts = make_prompts(llm.llm_engine.vocab_size, [5, 19, 40], seed=21)
    outputs = check(llm, path, prompts, width, length_penalty, ignore_eos=True)
    assert all(s.finish_reason == "length" for o in outputs for s in o.sequences)


# Prompts (of this seeded candidate list) whose transformers beams end on EOS, found by
# scanning the list once; the test re-checks the property, so a changed demo model fails
# loudly here instead of silently testing nothing.
_EOS_CANDIDATES = {"lengths": [3, 6, 9, 12] * 25, "seed": 33, "indices": [63, 80, 81, 84]}


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_with_eos_reachable(setup, width):
    path, llm = setup
    eos = llm.llm_engine.eos_token_id
    candidates = make_prompts(llm.llm_engine.vocab_size, _EOS_CANDIDATES["lengths"], seed=_EOS_CANDIDATES["seed"])
    prompts = [candidates[i] for i in _EOS_CANDIDATES["indices"]]
    reaches_eos = [any(t[-1] == eos and len(t) < 40 for t, _ in hf_beams(path, p, width, 1.0, 40, False)) for p in prompts]
    assert any(reaches_eos), "no candidate prompt reaches EOS any more: rescan the candidate list"
    outputs = check(llm, path, prompts, width, 1.0, ignore_eos=False, max_tokens=40)
    assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)


def test_beams_share_blocks_and_free_pruned_ones(setup):
    _, llm = setup
    engine = llm.llm_engine
    (prompt,) = make_prompts(engine.vocab_size, [40], seed=2)
    rid = engine.add_beam_search(None, {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    max_shared, max_live = 0, 0
    while rid not in engine.beam_search.results:
        engine.step()
        engine.check_integrity()
        live = [r for r in engine.scheduler.requests.values() if r.group_id == rid]
        max_live = max(max_live, len(live))
        max_shared = max([max_shared] + [c for c in engine.kv_manager.pool.ref_cnt])
    # Four beams over one 40-token prompt: its blocks are held 4 times, not copied.
    assert max_live == 4 and max_shared == 4
    engine.beam_search.results.pop(rid)


def test_invalid_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def test_a_search_failing_in_the_runner_ends_alone(model_path):
    """A beam whose sampling inputs fail to build ends its search with an error for its caller
    (`take` raises it); the engine, and a request beside it, go on (it raised out of step())."""
    from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
    from pagedserve.engine.beam_search import BeamSearchFailed
    from pagedserve.engine.faults import FailRequests
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams

    faults = FailRequests("sampling_inputs", ["doomed#beam0"])
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model_path("llama-gqa")),
                                    cache=CacheConfig(kv_cache_memory_bytes=8 << 20)), faults=faults)
    engine.add_beam_search("doomed", {"prompt_token_ids": [5, 6, 7]}, BeamSearchParams(beam_width=2, max_tokens=6))
    engine.add_request("beside", {"prompt_token_ids": [8, 9]}, SamplingParams(temperature=0, max_tokens=6,
                                                                                ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests() or engine.beam_search.has_work():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert faults.num_raised >= 1
    with pytest.raises(BeamSearchFailed, match="injected fault"):
        engine.beam_search.take("doomed")
    assert len(finished["beside"].outputs[0].token_ids) == 6
    engine.assert_no_leaks()
