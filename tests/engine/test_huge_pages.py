"""Weights and KV cache in transparent huge pages (worker/huge_pages.py).

Moving the weights must keep every tensor's values, its identity (modules, tied weights and
anything else holding it see the new memory) and its aliases (two tensors of one storage stay
one storage), and leave alone what it cannot move safely. That the kernel was asked for huge
pages is read back from /proc/self/smaps ("THPeligible: 1" for the mapping); whether it hands
them out is the kernel's business (AnonHugePages), so it is not asserted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.worker import huge_pages

from hf_reference import make_prompts

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte may get huge pages (its smaps entry)."""
    address = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 48)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.randn(300, 1024))  # > 1 MiB
        self.register_buffer("table_bits", self.table.view(torch.int32))  # an alias of another dtype
        self.register_buffer("columns", torch.randn(8, 16).t())  # not contiguous: stays
        self.register_buffer("top_rows", torch.randn(64, 64)[:32])  # part of a storage: stays


def test_move_keeps_values_identity_and_aliases():
    model = Model()
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    before = {name: t.clone() for name, t in tensors.items()}
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    moved = huge_pages.move_weights(model)
    expected = sum(t.nbytes for name, t in tensors.items() if name not in ("table_bits", "columns", "top_rows"))
    assert expected <= moved < expected + 64 * len(tensors)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t is tensors[name], name  # the same object, its memory swapped
        assert torch.equal(t, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.table_bits.data_ptr() == model.table.data_ptr()  # still one storage
    model.table.add_(1.0)
    assert torch.equal(model.table_bits, model.table.view(torch.int32))
    for name in ("columns", "top_rows"):
        assert tensors[name].data_ptr() == pointers[name], name
    for name in ("embed.weight", "proj.weight", "proj.bias", "table"):
        assert tensors[name].data_ptr() != pointers[name], name
        assert thp_eligible(tensors[name]), name


def test_off_moves_nothing(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "off")
    model = Model()
    pointer = model.proj.weight.data_ptr()
    assert not huge_pages.available()
    assert huge_pages.move_weights(model) == 0
    assert model.proj.weight.data_ptr() == pointer
    kv = huge_pages.zeros((2, 3), torch.float32, torch.device("cpu"))
    assert torch.equal(kv, torch.zeros(2, 3))


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_HUGE_PAGES"):
        huge_pages.available()


def test_zeros_in_huge_pages():
    kv = huge_pages.zeros((2, 40, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert kv.shape == (2, 40, 16, 4, 64) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert kv.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not kv.any()
    assert thp_eligible(kv)


def test_engine_weights_and_cache_in_huge_pages(model_path, monkeypatch):
    """The same tokens and logprobs as an engine in torch's memory, with every linear weight
    and the KV cache in mappings that asked for huge pages."""
    path = model_path("llama-gqa")
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=3)
    outputs = []
    for setting in ("off", "on"):
        monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", setting)
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)
        prompts = make_prompts(llm.llm_engine.vocab_size, lengths=[5, 17], seed=3)
        outputs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        runner = llm.llm_engine.runner
        weights = [t for t in [*runner.model.parameters(), *runner.model.buffers()] if t.dim() >= 2]
        eligible = [thp_eligible(t) for t in [*weights, *runner.kv_caches]]
        if setting == "on":
            assert all(eligible)
        elif "[madvise]" in huge_pages.THP_SETTING.read_text():  # ("always": every mapping is)
            assert not any(eligible)
    for off, on in zip(*outputs, strict=True):
        assert off.outputs[0].token_ids == on.outputs[0].token_ids
        assert off.outputs[0].logprobs == on.outputs[0].logprobs
