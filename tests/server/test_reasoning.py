"""Reasoning parsers (issue 37.2): recorded outputs of each family, whole and streamed
token by token through a real tokenizer, and a live server read by the openai client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedserve.demo_models import get_model_path
from pagedserve.reasoning import REASONING_PARSERS, ReasoningCounter, get_reasoning_parser

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

# (parser, prompt tail, recorded output, expected reasoning, expected content); outputs as
# each family writes them (DeepSeek-R1-Distill's template opens <think> in the prompt).
RECORDED = [
    ("qwen3", "<|im_start|>assistant\n",
     "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
     "\nThe user asks for 2+2. That is 4.\n", "2 + 2 = 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello! How can I help?",
     None, "Hello! How can I help?"),
    ("qwen3", "<|im_start|>assistant\n<think>\n",  # Qwen3-Thinking-2507 opens the block itself
     "Greeting. Reply briefly.\n</think>\n\nHi there.", "Greeting. Reply briefly.\n", "Hi there."),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Okay, 3 * 7 = 21.\n</think>\n\nThe answer is 21.",
     "Okay, 3 * 7 = 21.\n", "The answer is 21."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nSo x = 2.\n</think>\n\nx = 2", "\nSo x = 2.\n", "x = 2"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Cut off by max_tokens while still thinking",
     "Cut off by max_tokens while still thinking", None),
    ("think", "", "<think>plan: use a list</think>Use a list.", "plan: use a list", "Use a list."),
    ("think", "", "No reasoning block; a stray </think> stays content.", None,
     "No reasoning block; a stray </think> stays content."),
    ("think", "", "  <think>a < b and </thin k> is not the end</think>  ok", "a < b and </thin k> is not the end",
     "ok"),
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(get_model_path(TEST_MODEL))


def _stream(parser_name: str, prompt: str, pieces: list[str], counts: list[int]) -> tuple[str, str, int]:
    counter = ReasoningCounter(get_reasoning_parser(parser_name)(prompt))
    reasoning = content = ""
    for piece, count in zip(pieces, counts, strict=True):
        out = counter.feed(piece, count)
        reasoning, content = reasoning + out.reasoning, content + out.content
    tail = counter.parser.finish()
    return reasoning + tail.reasoning, content + tail.content, counter.num_tokens


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content"), RECORDED)
def test_recorded_outputs_whole_and_streamed(tokenizer, name: str, prompt: str, output: str,  # type: ignore[no-untyped-def]
                                             reasoning: str | None, content: str | None) -> None:
    assert get_reasoning_parser(name)(prompt).extract(output) == (reasoning, content)
    # Streamed as the engine streams it: one token's text at a time (incremental decoding).
    ids = tokenizer.encode(output, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    pieces = [texts[i + 1][len(texts[i]):] for i in range(len(ids))]
    assert "".join(pieces) == output
    got_reasoning, got_content, num_tokens = _stream(name, prompt, pieces, [1] * len(pieces))
    assert (got_reasoning, got_content or None) == (reasoning or "", content)
    # reasoning_tokens: every token up to the one that completes the end marker (the
    # tokenizer's own decode finds it), or all of them when the output never leaves it.
    if reasoning is None:
        assert num_tokens == 0
    else:
        ends = [i for i in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:i])]
        assert num_tokens == (ends[0] if ends else len(ids))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(RECORDED), st.lists(st.integers(0, 120), max_size=10))
def test_any_split_equals_whole(case: tuple, cuts: list[int]) -> None:  # type: ignore[type-arg]
    name, prompt, output, reasoning, content = case
    bounds = sorted({0, len(output), *[c % (len(output) + 1) for c in cuts]})
    pieces = [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got_reasoning, got_content, _ = _stream(name, prompt, pieces, [1] * len(pieces))
    assert (got_reasoning, got_content or None) == (reasoning or "", content)


def test_qwen3_enable_thinking_false_is_all_content() -> None:
    parser = get_reasoning_parser("qwen3")("", {"enable_thinking": False})
    assert parser.extract("<think>x</think>y") == (None, "<think>x</think>y")
    assert get_reasoning_parser("think")("", {"enable_thinking": False}).extract("<think>x</think>y") == ("x", "y")
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3", "think"]
    with pytest.raises(ValueError, match="reasoning-parser"):
        get_reasoning_parser("nope")


# ---- a live server, read by the openai client --------------------------------------------

# A template that shows what reached it: enable_thinking and reasoning_effort.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}{% endif %}"
)
# The random model writes what this grammar allows (a request's own Lark grammar is not
# wrapped by the reasoning parser: it applies from the first token).
GRAMMAR = 'start: "<think>" /[a-z]{3,6}/ "</think>" "\\n\\n" /[a-z]{2,5}/'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("tpl") / "think.jinja"
    path.write_text(TEMPLATE)
    with running_server([TEST_MODEL, *SERVE_ARGS, "--reasoning-parser", "qwen3", "--chat-template", str(path)]) as live:
        yield live



def test_live_reasoning_whole_and_streamed(server: LiveServer, tokenizer) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    kwargs = dict(model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0.0,
                  extra_body={"structured_outputs": {"grammar": GRAMMAR}, "return_token_ids": True})
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    message = whole.choices[0].message
    text = tokenizer.decode(whole.choices[0].token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    thought, answer = text.removeprefix("<think>").split("</think>\n\n")
    assert message.reasoning_content == message.reasoning == thought  # type: ignore[attr-defined]
    assert message.content == answer
    ids = whole.choices[0].token_ids  # type: ignore[attr-defined]
    expected = next(i for i in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:i]))
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == expected

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))  # type: ignore[call-overload]
    streamed_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                 for c in chunks if c.choices)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed_content) == (thought, answer)
    assert all("</think>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == expected
    server.assert_no_leaks()


def test_live_template_kwargs_and_effort(server: LiveServer, tokenizer) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    reply = client.chat.completions.create(
        model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True,
                    "structured_outputs": {"grammar": 'start: "<think>x</think>y"'}})
    prompt = tokenizer.decode(reply.prompt_token_ids)  # type: ignore[attr-defined]
    assert prompt.endswith("<think></think>effort=low\n")
    # enable_thinking false: qwen3 leaves the whole output as content.
    assert reply.choices[0].message.content == "<think>x</think>y"
    assert reply.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    server.assert_no_leaks()


def test_tool_calls_are_read_after_the_reasoning_only() -> None:
    """A call the model mulls over while thinking is not a call; the one after it is."""
    from pagedserve.server.chat_output import OutputParsing
    from pagedserve.server.tool_calls import ToolMode
    from pagedserve.tool_parsers import get_tool_parser

    output = ('<think>Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.</think>\n\n'
              'Calling. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    parsing = OutputParsing(ToolMode("auto", "auto", parser=get_tool_parser("hermes")),
                            get_reasoning_parser("qwen3"), "<|im_start|>assistant\n")
    whole = parsing.parse([output], [1])
    assert whole.reasoning == 'Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.'
    assert whole.content == "Calling."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    stream = parsing.stream()
    reasoning, content, names, arguments = "", "", [], ""
    for i, char in enumerate(output):
        delta = stream.feed(char, 1, i == len(output) - 1)
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        names += [c.name for c in delta.tool_calls if c.name]
        arguments += "".join(c.arguments or "" for c in delta.tool_calls)
    assert (reasoning, content.strip(), names, arguments) == (whole.reasoning, "Calling.", ["get_weather"],
                                                              '{"city": "Paris"}')
    assert stream.num_calls == 1 and stream.reasoning_tokens == output.index("</think>") + len("</think>")
