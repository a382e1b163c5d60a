"""vLLM-style offline scripts (tests/vllm_examples/) run with only their imports changed.

Each script imports `vllm` and names hub models as vLLM's examples do. Here its import lines
are rewritten to `pagedserve` (nothing else in it changes) and it runs against a local Hugging
Face cache where those ids hold the random test models, offline. What the script leaves in
its namespace is then checked: greedy text against transformers / PEFT on the same weights,
constrained text against its constraint, and the engine left with no KV block in use.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import subprocess
import sys

import pytest
from model_copies import add_hub_snapshot
from transformers import AutoTokenizer

from hf_reference import hf_greedy
from lora_utils import make_peft_adapter, peft_greedy

# vLLM's example scripts run whole (2+ minutes in all): `make test-slow`, which CI runs.
pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).parent / "vllm_examples"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# hub id in the scripts -> the random test model standing in for it
HUB_MODELS = {"facebook/opt-125m": "opt", "meta-llama/Llama-2-7b-hf": "llama-gqa"}
ADAPTER_ID = "yard1/llama-2-7b-sql-lora-test"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub(model_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache")
    for repo_id, name in HUB_MODELS.items():
        add_hub_snapshot(cache, repo_id, pathlib.Path(model_path(name)), {"main": COMMIT})
    adapter = make_peft_adapter(model_path("llama-gqa"), tmp_path_factory.mktemp("adapter") / "sql", 8,
                                ["q_proj", "v_proj"], seed=3)
    add_hub_snapshot(cache, ADAPTER_ID, pathlib.Path(adapter), {"main": COMMIT})
    return cache


@pytest.fixture
def run_example(hub, tmp_path):
    """Runs an example in its own process, offline, with HF_HUB_CACHE pointing at `hub`."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

    def run(name: str) -> dict:
        out = tmp_path / f"{name}.pkl"
        done = subprocess.run([sys.executable, str(EXAMPLES / "_harness.py"), str(EXAMPLES / name), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        with open(out, "rb") as f:
            namespace = pickle.load(f)
        assert namespace["_leaks"] is None, namespace["_leaks"]
        return namespace

    return run


def test_generate(run_example) -> None:
    ns = run_example("generate.py")
    outputs = ns["outputs"]
    assert [o.prompt for o in outputs] == ns["prompts"]
    # vLLM's default max_tokens is 16.
    assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outputs)


def test_chat(run_example, model_path) -> None:
    ns = run_example("chat.py")
    tokenizer = AutoTokenizer.from_pretrained(model_path("opt"))
    want = tokenizer.apply_chat_template(ns["conversation"], add_generation_prompt=True, tokenize=False)
    assert ns["single"][0].prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)
    assert len(ns["batch"]) == 5 and all(o.prompt_token_ids == ns["single"][0].prompt_token_ids for o in ns["batch"])


def test_beam_search(run_example) -> None:
    ns = run_example("beam_search.py")
    sequences = ns["results"][0].sequences
    assert len(sequences) == 3
    scores = [s.cum_logprob for s in sequences]
    assert scores == sorted(scores, reverse=True)


def test_lora(run_example, hub, model_path) -> None:
    ns = run_example("lora.py")
    prompt_ids = ns["with_adapter"][0].prompt_token_ids
    base = model_path("llama-gqa")
    assert list(ns["with_adapter"][0].outputs[0].token_ids) == peft_greedy(base, ns["adapter_path"], prompt_ids, 10)
    assert list(ns["without"][0].outputs[0].token_ids) == hf_greedy(base, prompt_ids, 10)


def test_structured_outputs(run_example) -> None:
    import jsonschema

    ns = run_example("structured_outputs.py")
    answers = ns["answers"]
    schema = ns["schema"].structured_outputs.json
    assert answers["choice"] in ("yes", "no")
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,8}\.com", answers["regex"]), answers["regex"]
    jsonschema.validate(json.loads(answers["json"]), schema)
    assert re.fullmatch(r"SELECT (name|age|city) FROM (users|orders)", answers["grammar"]), answers["grammar"]


def test_engine_loop(run_example, model_path) -> None:
    ns = run_example("engine_loop.py")
    finished = ns["finished"]
    assert sorted(finished) == ["0", "1", "2"] and len(finished["2"].outputs) == 2
    greedy = finished["0"]
    assert list(greedy.outputs[0].token_ids) == hf_greedy(model_path("opt"), greedy.prompt_token_ids, 12)
