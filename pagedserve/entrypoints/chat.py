"""`pagedserve chat`: a terminal chat against a running server (like `vllm chat`).

Reads one user message per line from stdin, streams the assistant's answer from
/v1/chat/completions, keeps the conversation; EOF (Ctrl-D) or Ctrl-C ends it.
`--quick MESSAGE` sends one message, prints the answer and exits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pagedserve import envs


def add_chat_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("chat", help="chat with a running server in the terminal",
                            description="Chat with a running pagedserve (or any OpenAI-compatible) server.")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL")
    parser.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
    parser.add_argument("--api-key", default=envs.api_key() or "EMPTY",
                        help="bearer key (default: $PAGEDSERVE_API_KEY)")
    parser.add_argument("--system-prompt", default=None, help="a system message opening the conversation")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest answer in tokens")
    parser.add_argument("--temperature", type=float, default=None, help="default: the server's")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="send one message, print the answer, exit")
    return parser


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key)
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIError as exc:
        print(f"pagedserve chat: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if args.quick is not None:
        messages.append({"role": "user", "content": args.quick})
        _answer(client, model, messages, args, stdout)
        return 0
    print(f"Chatting with {model!r} at {args.url}; Ctrl-D to quit.", file=sys.stderr)
    try:
        while True:
            stdout.write("> ")
            stdout.flush()
            line = stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            messages.append({"role": "assistant", "content": _answer(client, model, messages, args, stdout)})
    except KeyboardInterrupt:
        pass
    stdout.write("\n")
    return 0


def _answer(client: Any, model: str, messages: list[dict[str, str]], args: argparse.Namespace,
            stdout: TextIO) -> str:
    """Streams one answer to `stdout` and returns its text."""
    extra = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
             if v is not None}
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **extra)
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            stdout.write(parts[-1])
            stdout.flush()
    stdout.write("\n")
    return "".join(parts)
