"""Chat templates and EOS lists of the 2026 families through a live server (issue 36.7).

Each family's official chat template (from its tokenizer_config.json: google/gemma-3-*-it,
Qwen/Qwen3-8B) rides on a small random model the test builds: the project's byte-level BPE
tokenizer (Qwen2 style) plus the family's turn tokens, and the family's EOS wiring:

* Gemma 3: config.json ends on `</s>` only; generation_config.json lists `<end_of_turn>` too
  (as google/gemma-3-*-it's [1, 106] does), so a generated `<end_of_turn>` must stop.
* Qwen3: config.json's eos is `<|im_end|>`, generation_config.json adds `<|endoftext|>`'s
  counterpart; `enable_thinking` reaches the template through `chat_template_kwargs`.

The prompt the server builds equals transformers' `apply_chat_template` with the same
template; the openai client reads the replies; every test ends with no KV block held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from pagedserve.demo_models import get_tokenizer_path

from server_fixtures import SERVE_ARGS, LiveServer, running_server

# google/gemma-3-*-it tokenizer_config.json "chat_template" (text only: images are another issue).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Qwen/Qwen3-8B tokenizer_config.json "chat_template".
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "the cat sat"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\non the mat"},
    {"role": "user", "content": "and then?"},
]


def _build(path: Path, family: str) -> Path:
    """A random model of `family` with the family's turn tokens, template and EOS ids."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(get_tokenizer_path(1024, style="qwen2")))
    if family == "gemma3":
        tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        template, stop = GEMMA3_TEMPLATE, "<end_of_turn>"
    else:  # Qwen3's <think> / </think> are added, not special: they show in the content
        tok.add_tokens(["<think>", "</think>"])
        template, stop = QWEN3_TEMPLATE, "<|im_end|>"
    tok.chat_template = template
    tok.save_pretrained(str(path), save_jinja_files=False)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>", stop)}
    common = dict(TINY, vocab_size=len(tok), bos_token_id=ids["<s>"], pad_token_id=ids["<pad>"])
    config: PretrainedConfig
    if family == "gemma3":
        config = Gemma3TextConfig(**common, eos_token_id=ids["</s>"], sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
        generation_eos = [ids["</s>"], ids[stop]]
    else:
        config = Qwen3Config(**common, eos_token_id=ids[stop])
        generation_eos = [ids[stop], ids["</s>"]]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def family(request, tmp_path_factory) -> Iterator[tuple[str, LiveServer, Path]]:  # type: ignore[no-untyped-def]
    path = _build(tmp_path_factory.mktemp(request.param), request.param)
    with running_server([str(path), *SERVE_ARGS, "--served-model-name", request.param]) as live:
        yield request.param, live, path


def _reference_ids(path: Path, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    assert isinstance(ids, list)
    return [int(i) for i in ids]  # type: ignore[arg-type]


def test_prompt_renders_as_transformers(family: tuple[str, LiveServer, Path]) -> None:
    name, live, path = family
    client = openai.OpenAI(base_url=live.v1, api_key="EMPTY", max_retries=0)
    messages = CHAT if name == "qwen3" else [m | {"content": m["content"].split("\n")[-1]} for m in CHAT]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                           extra_body={"return_token_ids": True})
    assert reply.prompt_token_ids == _reference_ids(path, messages)  # type: ignore[attr-defined]
    live.assert_no_leaks()


def test_qwen3_enable_thinking_reaches_the_template(family: tuple[str, LiveServer, Path]) -> None:
    name, live, path = family
    if name != "qwen3":
        pytest.skip("Qwen3's template reads enable_thinking")
    client = openai.OpenAI(base_url=live.v1, api_key="EMPTY", max_retries=0)
    tok = AutoTokenizer.from_pretrained(str(path))
    for thinking in (False, True):
        reply = client.chat.completions.create(
            model=name, messages=CHAT, max_tokens=1,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": thinking}})
        ids = reply.prompt_token_ids  # type: ignore[attr-defined]
        assert ids == _reference_ids(path, CHAT, enable_thinking=thinking)
        empty_thought = str(tok.decode(ids)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert empty_thought is not thinking
    live.assert_no_leaks()


def test_turn_end_token_stops_the_answer(family: tuple[str, LiveServer, Path]) -> None:
    """The family's end-of-turn token, made the likeliest after three tokens (min_tokens holds
    it back until then), ends the answer: finish_reason "stop", not in the text; without the
    bias the answer runs to max_tokens."""
    name, live, path = family
    tok = AutoTokenizer.from_pretrained(str(path))
    stop = tok.convert_tokens_to_ids("<end_of_turn>" if name == "gemma3" else "<|im_end|>")
    client = openai.OpenAI(base_url=live.v1, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "the cat sat"}]
    free = client.chat.completions.create(model=name, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                          temperature=0.0, extra_body={"return_token_ids": True})
    assert free.choices[0].finish_reason == "length"
    assert stop not in free.choices[0].token_ids  # type: ignore[attr-defined]
    for stream in (False, True):
        kwargs = dict(model=name, messages=messages, max_tokens=12, temperature=0.0, logit_bias={str(stop): 100},
                      extra_body={"min_tokens": 3, "return_token_ids": True})
        if not stream:
            reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
            choice = reply.choices[0]
            assert choice.finish_reason == "stop"
            assert choice.token_ids[-1] == stop and len(choice.token_ids) == 4  # type: ignore[attr-defined]
            assert choice.message.content == tok.decode(choice.token_ids[:3])  # type: ignore[attr-defined]
            assert reply.usage is not None and reply.usage.completion_tokens == 4
        else:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finishes == ["stop"]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == choice.message.content
    live.assert_no_leaks()
