"""Replicas on Ray behind the one OpenAI server: a local 2-CPU Ray cluster, 2 replicas.

One cluster and one server for the module (starting Ray and the replica processes is the
cost); the tests run in order and the last one kills a replica.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from lora_utils import make_peft_adapter, peft_greedy
from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

# Ray replicas started and killed (a minute in all): `make test-slow`, which CI runs.
pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

REPLICA_ARGS = ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"]
VICTIM_PREFIX = list(range(300, 340))
PROMPTS = [list(range(3, 40)), [5, 9, 13, 2, 8], list(range(100, 180, 3)), [42] * 20]


@pytest.fixture(scope="module")
def adapter(model_path, tmp_path_factory) -> str:
    return make_peft_adapter(model_path(TEST_MODEL), tmp_path_factory.mktemp("lora"), 8, ["q_proj", "v_proj"],
                             seed=1)


@pytest.fixture(scope="module")
def server(adapter: str) -> Iterator[LiveServer]:
    ray.init(num_cpus=2, include_dashboard=False, namespace="pagedserve", log_to_driver=False)
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}"]
    try:
        with running_server([TEST_MODEL, *SERVE_ARGS, *REPLICA_ARGS, *lora]) as live:
            yield live
    finally:
        ray.shutdown()


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    # Every live replica's engine: all KV blocks free, every reference count zero.
    server.ctx.engine.check_no_leaks()


def replica_series(server: LiveServer, name: str, **labels: str) -> dict[str, float]:
    """replica -> value of a `pagedserve:replica_*` series in /metrics."""
    text = httpx.get(server.base_url + "/metrics").text
    values: dict[str, float] = {}
    for match in re.finditer(rf'^{re.escape(name)}{{([^}}]*)}} (\S+)$', text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            values[found["replica"]] = values.get(found["replica"], 0.0) + float(match.group(2))
    return values


def routed(server: LiveServer) -> dict[str, float]:
    return replica_series(server, "pagedserve:replica_routed_requests_total")


def test_greedy_outputs_equal_a_single_engine(server: LiveServer, client: openai.OpenAI) -> None:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(server.model_path, kv_cache_memory_bytes=8 << 20)
    expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    before = routed(server)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.outputs[0].text
    after = routed(server)
    assert sum(after.values()) - sum(before.values()) == len(PROMPTS)
    # The chat endpoint goes through the same router.
    chat = client.chat.completions.create(model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_same_prefix_lands_on_the_same_replica(server: LiveServer, client: openai.OpenAI) -> None:
    shared = list(range(200, 264))  # 4 full blocks of 16: the router's affinity key
    before = routed(server)
    hits_before = replica_series(server, "pagedserve:replica_prefix_cache_hits")
    for suffix in range(5):
        client.completions.create(model=TEST_MODEL, prompt=shared + [suffix, suffix + 1], max_tokens=2,
                                  temperature=0)
    after = routed(server)
    grew = {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}
    assert list(grew.values()) == [5.0], f"one replica should take all five: {grew}"
    (replica,) = grew
    time.sleep(0.7)  # the ingress polls replicas' statistics twice a second
    hits = replica_series(server, "pagedserve:replica_prefix_cache_hits")
    assert hits[replica] - hits_before.get(replica, 0.0) >= 4 * 64  # requests 2..5 reused the prefix


def test_adapter_requests_go_where_the_adapter_is_and_equal_peft(
    server: LiveServer, client: openai.OpenAI, adapter: str
) -> None:
    before = replica_series(server, "pagedserve:replica_routed_requests_total", reason="adapter")
    outs = [client.completions.create(model="sql", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
            for prompt in PROMPTS[:3]]
    after = replica_series(server, "pagedserve:replica_routed_requests_total", reason="adapter")
    grew = {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}
    assert list(grew.values()) == [3.0], f"one replica should take every request for the adapter: {grew}"
    assert outs[0].choices[0].token_ids == peft_greedy(server.model_path, adapter, PROMPTS[0], 6)


def test_invalid_request_is_a_400_naming_the_field(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TEST_MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=-1)
    assert "temperature" in str(info.value)


def test_killed_replica_fails_its_stream_cleanly_and_others_serve_on(
    server: LiveServer, client: openai.OpenAI
) -> None:
    before = routed(server)
    stream = client.completions.create(model=TEST_MODEL, prompt=VICTIM_PREFIX, max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the replica has streamed: this request cannot be retried elsewhere
    after = routed(server)
    (victim,) = [r for r in after if after[r] > before.get(r, 0.0)]
    ray.kill(ray.get_actor(f"pagedserve-replica-{victim}", namespace="pagedserve"), no_restart=False)
    with pytest.raises(openai.APIError, match="died"):
        for _ in chunks:
            pass
    # The others serve on, whatever prefix a request has.
    for prompt in PROMPTS:
        out = client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert replica_series(server, "pagedserve:replica_failures_total")[victim] >= 1
    # Ray restarts the replica; the router takes it back once it answers.
    deadline = time.monotonic() + 120
    while replica_series(server, "pagedserve:replica_up")[victim] != 1.0:
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.5)


def test_request_to_a_dead_replica_is_retried_before_any_output(
    server: LiveServer, client: openai.OpenAI
) -> None:
    """Last test: a replica killed for good; a request routed to it before the ingress notices
    (its prefix is cached there) goes to the other replica and succeeds."""
    owner = routed(server)
    client.completions.create(model=TEST_MODEL, prompt=VICTIM_PREFIX, max_tokens=1, temperature=0)
    grew = routed(server)
    (home,) = [r for r in grew if grew[r] > owner.get(r, 0.0)]
    retries_before = replica_series(server, "pagedserve:replica_retried_requests_total").get(home, 0.0)
    ray.kill(ray.get_actor(f"pagedserve-replica-{home}", namespace="pagedserve"), no_restart=True)
    out = client.completions.create(model=TEST_MODEL, prompt=VICTIM_PREFIX + [7], max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    retries = replica_series(server, "pagedserve:replica_retried_requests_total").get(home, 0.0)
    if retries == retries_before:
        pytest.skip("the statistics poll saw the replica die before the request was routed")
    assert retries == retries_before + 1
