"""Structured outputs on a random-weight model: the grammar alone makes the output valid.

A random model has no idea of JSON, so every valid output here is the constraint's doing;
without the bitmask these outputs are gibberish and the checks fail.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from pagedserve.structured_outputs import GrammarError

MODEL = "llama-gqa"  # 1024-token vocabulary, ~0.5M parameters


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path(MODEL), max_model_len=512, kv_cache_memory_bytes=32 << 20)


# ---- schemas -----------------------------------------------------------------------------
# Leaf schemas are assembled from values hypothesis-jsonschema draws (bounds, enum lists,
# patterns; its object generator is broken with this hypothesis version, hence no
# meta-schema of objects); st.recursive nests them in objects and arrays. Every schema is
# bounded (string lengths, array sizes, integer ranges, no free additional properties), so a
# valid document always fits in max_tokens: the constraint, not luck, must end the output.
def _drawn(schema: dict) -> st.SearchStrategy:
    return from_schema(schema)


_PATTERNS = ["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^[A-Z][a-z]{0,4}$"]
_LEAVES = st.one_of(
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              _drawn({"type": "integer", "minimum": -1000, "maximum": 0}),
              _drawn({"type": "integer", "minimum": 0, "maximum": 1000})),
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": hi},
              _drawn({"type": "integer", "minimum": 0, "maximum": 3}),
              _drawn({"type": "integer", "minimum": 3, "maximum": 8})),
    st.builds(lambda p: {"type": "string", "pattern": p}, _drawn({"enum": _PATTERNS})),
    st.builds(lambda values: {"enum": values},
              _drawn({"type": "array", "minItems": 1, "maxItems": 4, "uniqueItems": True,
                      "items": {"anyOf": [{"type": "string", "pattern": "^[a-z ]{0,6}$"},
                                          {"type": "integer", "minimum": -50, "maximum": 50}]}})),
    st.builds(lambda t: {"type": t}, _drawn({"enum": ["boolean", "null"]})),
    st.builds(lambda c: {"const": c}, _drawn({"type": "string", "pattern": "^[a-z]{1,5}$"})),
)
_KEYS = st.sampled_from(["id", "name", "tags", "kind", "size", "x", "y", "note"])


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw: st.DrawFn) -> dict:
        props = draw(st.dictionaries(_KEYS, children, min_size=1, max_size=3))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return build()


def _array(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        lambda items, lo, hi: {"type": "array", "items": items, "minItems": lo, "maxItems": hi},
        children, st.integers(0, 1), st.integers(1, 3),
    )


SCHEMAS = st.recursive(
    _LEAVES,
    lambda children: st.one_of(_object(children), _array(children)),
    max_leaves=6,
).map(lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s},
                                                       "required": ["v"], "additionalProperties": False})

# 4 batches of 50 = 200 schemas, each batch in one generate call.
_SETTINGS = settings(
    max_examples=4, derandomize=True, deadline=None, phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def _check_all_valid(outs, schemas) -> None:
    for out, schema in zip(outs, schemas, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@_SETTINGS
@given(st.lists(SCHEMAS, min_size=50, max_size=50))
def test_generated_json_schemas_always_valid(llm, schemas):
    params = [
        SamplingParams(max_tokens=400, temperature=0.0 if i % 4 == 0 else 1.0, seed=i,
                       structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        for i, schema in enumerate(schemas)
    ]
    outs = llm.generate(["{"] * len(schemas), params, use_tqdm=False)
    _check_all_valid(outs, schemas)


REGEXES = [r"[a-z]{3,8}", r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{1,6} [A-Z][a-z]{1,6}",
           r"0x[0-9a-f]{4}", r"(yes|no)!{0,3}", r"\w{1,5}@\w{1,5}\.(com|org)", r"-?[1-9][0-9]{0,3}"]


def test_regexes_and_choices_always_match(llm):
    choices = [["yes", "no"], ["red", "green", "blue", "dark blue"], ["α", "β γ", "{json}"], ["a" * 12]]
    params = [SamplingParams(max_tokens=40, temperature=t, seed=i,
                             structured_outputs=StructuredOutputsParams(regex=r))
              for i, r in enumerate(REGEXES) for t in (0.0, 1.0)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                              guided_decoding=GuidedDecodingParams(choice=c))
               for i, c in enumerate(choices)]
    outs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        text, spec = out.outputs[0].text, p.structured_outputs
        assert out.outputs[0].finish_reason == "stop"
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, text), (spec.regex, text)
        else:
            assert text in spec.choice


def test_unconstrained_outputs_are_not_json(llm):
    # The check above can fail: the same model without the constraint does not produce JSON.
    outs = llm.generate(["{"] * 8, SamplingParams(max_tokens=20, temperature=1.0, seed=3), use_tqdm=False)
    parsed = 0
    for out in outs:
        try:
            json.loads(out.outputs[0].text)
            parsed += 1
        except ValueError:
            pass
    assert parsed < 8


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _person(**kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                          max_tokens=60, **kwargs)


def test_mixed_batch_free_requests_unchanged(llm):
    prompts = ["once upon", "the cat", "hello world", "abc def"]
    free = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.9, seed=7)]
    alone = llm.generate(prompts[:2], free, use_tqdm=False)
    mixed = llm.generate(prompts, free + [_person(temperature=1.0, seed=1), _person(temperature=0.0)], use_tqdm=False)
    for a, m in zip(alone, mixed[:2], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for out in mixed[2:]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_n_best_of_each_sample_valid(llm):
    out = llm.generate("x", _person(n=3, best_of=4, temperature=1.0, seed=5, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), PERSON)
        # Logprobs come from the masked logits: a chosen token always had a finite one.
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert entry[token_id].logprob > float("-inf")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_validity(model_path, mode):
    llm = LLM(model_path(MODEL), max_model_len=128, num_gpu_blocks_override=10, enable_prefix_caching=False,
              preemption_mode=mode, block_size=16)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                         "minItems": 3, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False}
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    outs = llm.generate(["a b c d e f g h i j k l m n o p q r s t"] * 6, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().scheduler.num_preemptions_total > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_prefix_hit_and_chunked_prefill_keep_validity(model_path):
    llm = LLM(model_path(MODEL), max_model_len=256, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32)
    prompt = " ".join(["shared prefix words"] * 20)
    first = llm.generate(prompt, _person(temperature=0.0), use_tqdm=False)[0]
    second = llm.generate(prompt, _person(temperature=0.0), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    jsonschema.validate(json.loads(second.outputs[0].text), PERSON)


def test_bad_constraints_fail_alone_naming_the_kind(llm):
    bad = [StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="start: undefined_rule"),
           StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}})]
    for spec in bad:
        with pytest.raises(GrammarError, match=spec.kind):
            llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    # The engine keeps serving.
    assert llm.generate("x", _person(temperature=0.0), use_tqdm=False)[0].outputs[0].finish_reason == "stop"


def test_compile_timeout_fails_the_request(model_path):
    llm = LLM(model_path(MODEL), max_model_len=128, kv_cache_memory_bytes=4 << 20,
              structured_outputs_config='{"backend": "llguidance", "compile_timeout_s": 1e-6}')
    with pytest.raises(GrammarError, match="took longer"):
        llm.generate("x", _person(), use_tqdm=False)
    with pytest.raises(ValueError, match="backend"):
        LLM(model_path(MODEL), structured_outputs_config={"backend": "outlines"})


def test_gbnf_and_lark_grammars(llm):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/'
    gbnf = 'root ::= "<" [0-9] [0-9]? ">"'
    outs = llm.generate(["g"] * 2, [SamplingParams(max_tokens=60, temperature=1.0, seed=1,
                                                   structured_outputs=StructuredOutputsParams(grammar=g))
                                    for g in (lark, gbnf)], use_tqdm=False)
    assert re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3})*\)", outs[0].outputs[0].text)
    assert re.fullmatch(r"<[0-9]{1,2}>", outs[1].outputs[0].text)


def test_xgrammar_backend_same_validity(model_path):
    llm = LLM(model_path(MODEL), max_model_len=256, kv_cache_memory_bytes=8 << 20,
              structured_outputs_config={"backend": "xgrammar"})
    outs = llm.generate(["a", "b"], [_person(temperature=1.0, seed=4),
                                     SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,5}!"))],
                        use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    assert re.fullmatch(r"[a-c]{2,5}!", outs[1].outputs[0].text)


def test_lora_and_base_rows_constrained_in_one_batch(model_path, tmp_path):
    from pagedserve import LoRARequest

    from lora_utils import make_peft_adapter

    base = model_path(MODEL)
    adapter = LoRARequest("a", 1, make_peft_adapter(base, None, 8, ["q_proj", "v_proj", "down_proj"], seed=3))
    llm = LLM(base, max_model_len=256, kv_cache_memory_bytes=32 << 20, enable_lora=True, max_loras=2)
    params = [_person(temperature=1.0, seed=i) for i in range(4)]
    outs = llm.generate(["p"] * 4, params, use_tqdm=False, lora_request=[adapter, None, adapter, None])
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_chat_with_tools_renders_them(llm):
    from pagedserve.entrypoints.chat_utils import ChatTemplateError, builtin_template_path

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "weather?"}]
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        llm.chat(messages, SamplingParams(max_tokens=2), tools=tools, use_tqdm=False)
    with open(builtin_template_path()) as f:
        template = f.read()
    out = llm.chat(messages, SamplingParams(max_tokens=2), tools=tools, chat_template=template, use_tqdm=False)[0]
    assert '"name": "get_weather"' in out.prompt and "<tools>" in out.prompt


def test_a_temperature_past_float32_still_samples_inside_the_constraint(llm):
    """1.7e308 is inf in float32; a grammar-masked logit -inf / inf was NaN and the draw took a
    token outside the choices (the fuzz test's 500, "grammar rejected token 0"). Temperatures
    past sample.input_builder.MAX_TEMPERATURE sample as it does: flat over the allowed tokens."""
    choices = ["", "yes", "no"]
    params = [SamplingParams(temperature=t, max_tokens=8, seed=i,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for i, t in enumerate([1.7e308, 1e30, 3.5e38, 1e4])]
    outs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in choices


# ---- undeclared keys (issue 37.7) and constraints after reasoning (37.2) ------------------

from pagedserve.structured_outputs.llguidance_backend import LLGuidanceBackend  # noqa: E402
from pagedserve.structured_outputs.reasoning import after_reasoning  # noqa: E402
from pagedserve.structured_outputs.schema import close_objects  # noqa: E402


@pytest.fixture(scope="module")
def backend(model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path(MODEL))
    return tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _accepts(backend, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled grammar takes `text` whole and then lets the output end."""
    tokenizer, compiled = backend[0], backend[1].compile(spec)
    matcher = compiled.new_matcher()
    # Complete: the grammar has stopped (nothing may follow) or takes EOS now.
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and (
        matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id))


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "where": {"$ref": "#/$defs/place"}},
                  "required": ["city"], "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}}}}
DOCUMENTS = ['{"city": "Paris"}', '{"city": "Paris", "location": "Paris"}', '{"city": "Paris", "": 1}',
             '{"city": "Paris", "where": {"lat": 1.5}}', '{"city": "Paris", "where": {"lat": 1.5, "lon": 2}}']


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("extra", [None, True, False])
def test_undeclared_keys_follow_jsonschema_of_the_closed_schema(backend, document: str, extra: bool | None) -> None:
    """Absent additionalProperties reads as false (vLLM's default); an explicit value is kept.
    The oracle: jsonschema on the schema with that reading written out."""
    schema = json.loads(json.dumps(WEATHER_SCHEMA))
    if extra is not None:
        schema["additionalProperties"] = extra
        schema["$defs"]["place"]["additionalProperties"] = extra
    explicit = json.loads(json.dumps(schema))
    for node in (explicit, explicit["$defs"]["place"]):
        node.setdefault("additionalProperties", False)
    valid = jsonschema.Draft202012Validator(explicit).is_valid(json.loads(document))
    assert _accepts(backend, StructuredOutputsParams(json=schema), document) == valid
    assert close_objects(schema) == explicit


def test_free_form_objects_stay_open() -> None:
    assert close_objects({"type": "object"}) == {"type": "object"}
    assert close_objects({"enum": [{"properties": 1}]}) == {"enum": [{"properties": 1}]}  # data, not a schema


def test_random_model_forced_object_has_no_undeclared_keys(llm) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=8,
                            structured_outputs=StructuredOutputsParams(json=schema))
    (out,) = llm.generate(["weather:"], params)
    closed = {**schema, "additionalProperties": False}
    for sample in out.outputs:
        jsonschema.validate(json.loads(sample.text), closed)
    llm.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("opened", [False, True])
def test_constraint_after_a_reasoning_block(backend, opened: bool) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = after_reasoning(StructuredOutputsParams(json=schema), "<think>", "</think>", opened)
    assert _accepts(backend, spec, '<think>free text, even {"b": 1} </thi</think>\n\n{"a": 5}')
    assert _accepts(backend, spec, 'no start marker</think>{"a": 5}') == opened
    assert _accepts(backend, spec, '{"a": 5}') == (not opened)
    assert not _accepts(backend, spec, '<think>x</think>{"a": 5, "b": 1}')  # closed after the reasoning too
    regex = after_reasoning(StructuredOutputsParams(regex="[0-9]+/[0-9]+"), "<think>", "</think>", opened)
    assert _accepts(backend, regex, "<think>hm</think>12/34")
    choice = after_reasoning(StructuredOutputsParams(choice=["yes", "no"]), "<think>", "</think>", opened)
    assert _accepts(backend, choice, "<think>hm</think> no") and not _accepts(backend, choice, "<think>hm</think>maybe")
    grammar = StructuredOutputsParams(grammar='start: "x"')
    assert after_reasoning(grammar, "<think>", "</think>", opened) is grammar  # applies from the first token
