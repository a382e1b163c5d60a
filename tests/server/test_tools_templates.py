"""Each tool parser's family template renders an agent loop, and the parser reads the
assistant turn back (issue 37.3).

The templates are written here in each family's published prompt layout (tools in the
prompt, the assistant's calls in the format its parser reads, results in the family's tool
role); no hub downloads. The conversation goes through pagedserve's own renderer
(chat_utils.render_chat: OpenAI-shaped messages, arguments given as JSON text), and the
rendered assistant turn must parse to the calls the conversation holds.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagedserve.demo_models import get_model_path
from pagedserve.entrypoints.chat_utils import render_chat
from pagedserve.tool_parsers import get_tool_parser

LLAMA31_JSON = """{{- bos_token }}
{%- set tools = tools or [] %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\nYou are a helpful assistant.<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'user' and loop.first and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for tc in message.tool_calls %}{%- if not loop.first %}{{- '; ' }}{%- endif %}
{{- '{"name": "' + tc.function.name + '", "parameters": ' + (tc.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

MISTRAL_V3 = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last or tools and loop.index0 == 0 %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for tc in message.tool_calls %}
{%- if tc.id is not defined or tc.id | length != 9 %}{{- raise_exception('Tool call ids must be 9 alphanumeric characters') }}{%- endif %}
{%- if not loop.first %}{{- ', ' }}{%- endif %}
{{- '{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + ', "id": "' + tc.id + '"}' }}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- endif %}
{%- endfor %}"""

LLAMA4_PYTHONIC = """{{- bos_token }}
{{- '<|header_start|>system<|header_end|>\\n\\n' }}
{%- if tools %}
{{- 'You are a helpful assistant with tool calling capabilities. If you decide to invoke any of the function(s), put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. You SHOULD NOT include any other text in the response if you call a function.\\nHere is a list of functions in JSON format that you can invoke.\\n[' }}
{%- for t in tools %}{{- (t | tojson) + (', ' if not loop.last else '') }}{%- endfor %}
{{- ']\\n' }}
{%- endif %}
{{- '<|eot|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|header_start|>assistant<|header_end|>\\n\\n[' }}
{%- for tc in message.tool_calls %}{%- if not loop.first %}{{- ', ' }}{%- endif %}
{{- tc.function.name + '(' }}
{%- for name, value in tc.function.arguments | items %}{%- if not loop.first %}{{- ', ' }}{%- endif %}{{- name + '=' + (value | tojson) }}{%- endfor %}
{{- ')' }}
{%- endfor %}
{{- ']<|eot|>' }}
{%- elif message.role == 'tool' %}
{{- '<|header_start|>ipython<|header_end|>\\n\\n' + message.content + '<|eot|>' }}
{%- else %}
{{- '<|header_start|>' + message.role + '<|header_end|>\\n\\n' + message.content + '<|eot|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"""

QWEN3_CODER = """{%- if tools %}
{{- '<|im_start|>system\\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n<function>\\n<name>' + tool.function.name + '</name>\\n<parameters>' }}
{%- for name, fields in tool.function.parameters.properties | items %}
{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + fields.type + '</type>\\n</parameter>' }}
{%- endfor %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tc in message.tool_calls %}
{{- '\\n<tool_call>\\n<function=' + tc.function.name + '>\\n' }}
{%- for name, value in tc.function.arguments | items %}
{{- '<parameter=' + name + '>\\n' + (value | tojson if value is mapping or (value is sequence and value is not string) else value | string) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "opts": {"type": "object"}}, "required": ["city"]}}}]
CALLS = [("get_weather", {"city": "Paris", "days": 2, "opts": {"metric": "yes"}}), ("get_weather", {"city": "Lyon"})]

# (parser, template, where the assistant's calls start, where they end)
FAMILIES = [
    ("llama3_json", LLAMA31_JSON, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ("mistral", MISTRAL_V3, "[/INST]", "</s>"),
    ("pythonic", LLAMA4_PYTHONIC, "<|header_start|>assistant<|header_end|>\n\n", "<|eot|>"),
    ("qwen3_coder", QWEN3_CODER, "<|im_start|>assistant", "<|im_end|>"),
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(get_model_path("llama-gqa"))


@pytest.mark.parametrize(("parser", "template", "start", "end"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_family_template_round_trip(tokenizer, parser: str, template: str, start: str, end: str) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call{i}abcd", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(CALLS)]},
        {"role": "tool", "tool_call_id": "call0abcd", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call1abcd", "content": "19 C"},
    ]
    text, _ = render_chat(tokenizer, messages, chat_template=template, tools=TOOLS)
    assert "get_weather" in text.split(start)[0]  # the tools are in the prompt
    assert "21 C" in text and "19 C" in text  # and the results after the calls
    turn = text.split(start, 1)[1].split(end, 1)[0]
    found = get_tool_parser(parser)(TOOLS).extract(turn)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == CALLS
    assert found.content is None
