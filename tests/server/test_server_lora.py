"""LoRA over HTTP: adapters by name, /v1/models, runtime load/unload, path checks."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from openai import OpenAI

from hf_reference import make_prompts
from lora_utils import make_peft_adapter, peft_greedy
from server_fixtures import SERVE_ARGS, running_server


@pytest.fixture(scope="module")
def setup(model_path, tmp_path_factory):
    base = model_path("llama-gqa")
    root = tmp_path_factory.mktemp("lora_root")
    sql = make_peft_adapter(base, root / "sql", 8, ["q_proj", "v_proj"], seed=1)
    tone = make_peft_adapter(base, root / "tone", 16, "all-linear", seed=2)
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tone, outside / "tone")
    argv = ["llama-gqa", *SERVE_ARGS, "--enable-lora", "--lora-modules", f"sql={sql}",
            # vLLM's JSON form of the same flag
            json.dumps({"name": "tone-json", "path": str(tone), "base_model_name": "the-base"}),
            "--enable-lora-runtime-updates", "--lora-dir", str(root), "--max-lora-rank", "16"]
    with running_server(argv) as server:
        yield server, base, root, {"sql": sql, "tone": tone}, outside


def test_adapter_selected_by_model_name_equals_peft(setup):
    server, base, _, paths, _ = setup
    client = OpenAI(base_url=server.v1, api_key="x")
    (prompt,) = make_prompts(1024, [12], seed=4)
    out = client.completions.create(model="sql", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == peft_greedy(base, paths["sql"], prompt, 12)
    base_out = client.completions.create(model="llama-gqa", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert base_out.choices[0].token_ids != out.choices[0].token_ids
    models = {m.id: m for m in client.models.list().data}
    assert models["sql"].parent == "llama-gqa" and models["llama-gqa"].parent is None
    assert models["tone-json"].parent == "the-base"
    tone = client.completions.create(model="tone-json", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert tone.choices[0].token_ids == peft_greedy(base, paths["tone"], prompt, 12)


@pytest.mark.parametrize("spec", ["sql", "=p", '{"name": "x"}', '{"name": "x", "path": "p", "rank": 8}', "{bad"])
def test_lora_module_specs_refused(spec):
    from pagedserve.server.lora_admin import parse_lora_module

    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(spec)
    assert parse_lora_module('{"name": "a", "path": "/p"}') == ("a", "/p", None)
    assert parse_lora_module("a=/p=q") == ("a", "/p=q", None)


def test_runtime_load_and_unload(setup):
    server, base, root, paths, _ = setup
    load = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "tone", "lora_path": paths["tone"]})
    assert load.status_code == 200, load.text
    client = OpenAI(base_url=server.v1, api_key="x")
    (prompt,) = make_prompts(1024, [9], seed=5)
    out = client.completions.create(model="tone", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == peft_greedy(base, paths["tone"], prompt, 10)
    assert httpx.post(f"{server.v1}/unload_lora_adapter", json={"lora_name": "tone"}).status_code == 200
    gone = httpx.post(f"{server.v1}/completions", json={"model": "tone", "prompt": "hi", "max_tokens": 2})
    assert gone.status_code == 404


@pytest.mark.parametrize("how", ["dotdot", "symlink", "outside"])
def test_path_escapes_are_refused(setup, how):
    server, _, root, _, outside = setup
    if how == "dotdot":
        path = str(root / ".." / outside.name / "tone")
    elif how == "symlink":
        link = root / "sneaky"
        if not link.exists():
            os.symlink(outside / "tone", link)
        path = str(link)
    else:
        path = str(outside / "tone")
    r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": f"x-{how}", "lora_path": path})
    assert r.status_code == 400 and "outside the allowed --lora-dir" in r.json()["error"]["message"]


def test_corrupt_adapter_refused_while_others_complete(setup):
    server, _, root, paths, _ = setup
    broken = root / "broken"
    if not broken.exists():
        shutil.copytree(paths["sql"], broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    client = OpenAI(base_url=server.v1, api_key="x")
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # ignore_eos: an unseeded sample may draw EOS early; the point is that all 20 tokens arrive.
        busy = [pool.submit(client.completions.create, model="sql", prompt="hello", max_tokens=20,
                            extra_body={"ignore_eos": True}) for _ in range(3)]
        r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
        assert r.status_code == 400 and "broken" in r.json()["error"]["message"]
        assert all(f.result().usage.completion_tokens == 20 for f in busy)
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


def test_runtime_updates_are_off_by_default():
    with running_server(["llama-gqa", *SERVE_ARGS, "--enable-lora"]) as server:
        r = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 404

