"""vLLM's chat-template controls, offline and over HTTP, checked against transformers'
own `apply_chat_template` on the same tokenizer and template (the oracle).

continue_final_message, add_generation_prompt, chat_template_kwargs (and the server's
--default-chat-template-kwargs), chat_template_content_format, content given as parts.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.chat_utils import content_format

from server_fixtures import SERVE_ARGS, TEST_MODEL, running_server

# A template that reads an extra variable (`persona`) and takes content as a plain string.
PERSONA_TEMPLATE = (
    "{% if persona is defined %}[persona: {{ persona }}]\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if not loop.last or not continue_final_message"
    " is defined or not continue_final_message %}</{{ m['role'] }}>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# A template that iterates over content parts (OpenAI's format).
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
PARTS = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
PREFILLED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path(TEST_MODEL), kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path(TEST_MODEL))


def _prompt_ids(llm, messages, **kwargs) -> list[int]:
    return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)[0].prompt_token_ids


def _hf(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_continue_final_message_matches_transformers(llm, tokenizer) -> None:
    got = _prompt_ids(llm, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert got == _hf(tokenizer, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(got).endswith("The colour is")
    assert got != _prompt_ids(llm, PREFILLED)  # the default closes the turn and opens a new one
    with pytest.raises(ValueError, match="continue_final_message"):
        _prompt_ids(llm, PREFILLED, continue_final_message=True)  # add_generation_prompt is True


def test_content_parts_offline(llm, tokenizer) -> None:
    """Parts are joined for a string template (the default ChatML one): no crash inside it."""
    got = _prompt_ids(llm, [{"role": "user", "content": PARTS}])
    assert got == _hf(tokenizer, [{"role": "user", "content": "first\nsecond"}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="only text parts"):
        _prompt_ids(llm, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_content_format_auto_detects_a_parts_template(llm, tokenizer) -> None:
    assert content_format(PARTS_TEMPLATE) == "openai" and content_format(PERSONA_TEMPLATE) == "string"
    messages = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "ok"}]
    got = _prompt_ids(llm, messages, chat_template=PARTS_TEMPLATE)
    want = _hf(tokenizer, [{"role": "user", "content": PARTS}, {"role": "assistant", "content": [
        {"type": "text", "text": "ok"}]}], chat_template=PARTS_TEMPLATE, add_generation_prompt=True)
    assert got == want and "[first][second]" in tokenizer.decode(got)
    # Forced to "string", a parts template iterates over the characters of the joined text.
    forced = _prompt_ids(llm, messages, chat_template=PARTS_TEMPLATE, chat_template_content_format="string")
    assert forced != got


def test_chat_template_kwargs(llm, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    got = _prompt_ids(llm, messages, chat_template=PERSONA_TEMPLATE, chat_template_kwargs={"persona": "pirate"})
    assert got == _hf(tokenizer, messages, chat_template=PERSONA_TEMPLATE, add_generation_prompt=True,
                      persona="pirate")
    assert "[persona: pirate]" in tokenizer.decode(got)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        _prompt_ids(llm, messages, chat_template_kwargs={"add_generation_prompt": False})


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    argv = [TEST_MODEL, *SERVE_ARGS, "--chat-template", PERSONA_TEMPLATE,
            "--default-chat-template-kwargs", '{"persona": "sailor"}']
    with running_server(argv) as live:
        yield live


def _tokenize(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/tokenize", json={"model": TEST_MODEL, **body})


def test_server_defaults_and_request_kwargs(server, tokenizer) -> None:
    messages = [{"role": "user", "content": PARTS}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    default = _tokenize(server, messages=messages).json()["tokens"]
    assert default == _hf(tokenizer, joined, chat_template=PERSONA_TEMPLATE, add_generation_prompt=True,
                          persona="sailor")
    own = _tokenize(server, messages=messages, chat_template_kwargs={"persona": "pirate"}).json()["tokens"]
    assert own == _hf(tokenizer, joined, chat_template=PERSONA_TEMPLATE, add_generation_prompt=True,
                      persona="pirate")
    continued = _tokenize(server, messages=PREFILLED, add_generation_prompt=False,
                          continue_final_message=True).json()["tokens"]
    assert continued == _hf(tokenizer, PREFILLED, chat_template=PERSONA_TEMPLATE, add_generation_prompt=False,
                            continue_final_message=True, persona="sailor")


def test_server_chat_continues_the_final_message(server) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=TEST_MODEL, messages=PREFILLED, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.usage.completion_tokens == 3 or out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TEST_MODEL, messages=PREFILLED, max_tokens=3,
                                       extra_body={"continue_final_message": True})
    assert caught.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TEST_MODEL, messages=PREFILLED, max_tokens=3,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert caught.value.body["param"] == "chat_template_kwargs"
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
