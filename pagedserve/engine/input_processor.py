"""Input processing: everything a request needs before it may enter the engine, in one place.

    LLM.generate / LLM.chat ─┐                              ┌─► LLMEngine.add_request(EngineInput)
                             ├─► InputProcessor.process() ──┤     (engine thread: ids, adapter,
    server handlers ─────────┘   tokenize, chat template,   │      grammar from the cache, Requests)
      (tokenize worker thread)   length checks, validation  └─► or queued through AsyncLLMEngine

Both the offline `LLM` and the server call it; the server calls it in its tokenize worker,
so no tokenizer, template or O(prompt) check ever runs on the event loop or the engine
thread. Its state is read-only after construction (the tokenizer aside, which only
`set_tokenizer` replaces), so any thread may call it. Errors are `InputError`s (ValueErrors
whose message starts with the field at fault; `param` and `code` say it for the server).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagedserve.config import SchedulerConfig
from pagedserve.entrypoints import chat_utils
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]

# A tokenizer normalizer may fold several characters into one before tokens are cut, so a
# text is refused unseen only beyond this many times the longest token's length per token.
NORMALIZER_SLACK = 2
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InputError(ValueError):
    """A request's input is invalid; `param` names the field, `code` is OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True)
class EngineInput:
    """A processed request: what the engine thread needs, nothing left to tokenize or check.

    Plain data (picklable: the replicas of `distributed/` receive it through Ray).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the model's extra EOS ids as stop ids
    max_output_tokens: int
    bad_words_token_ids: list[list[int]]
    cache_salt: str | None = None
    priority: int = 0
    # An embedding request: the runner pools its prompt's last hidden state.
    pooling: PoolingParams | None = None


class InputProcessor:
    """Tokenizes, renders chat templates, checks lengths and validates requests.

    Args:
        tokenizer: the model's tokenizer, or None (skip_tokenizer_init: token ids only).
        vocab_size: token ids must be below it.
        max_model_len: prompt plus output must fit in it.
        eos_token_ids: the model's EOS ids; the first is the requests' eos_token_id, the
            others end a sequence as extra stop ids.
        sampling_defaults: generation_config.json's sampling fields (a request given no
            SamplingParams gets them).
        scheduling_policy: "fcfs" or "priority" (only then may a priority be non-zero).
        hidden_size: the model's; a pooling request's parameters are checked against it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        sampling_defaults: dict[str, Any] | None = None,
        scheduling_policy: str = SchedulerConfig.scheduling_policy,
        hidden_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.scheduling_policy = scheduling_policy
        self.hidden_size = hidden_size
        self._char_limit: int | None = None

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._char_limit = None

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's generation_config.json (if any)."""
        return SamplingParams(**self.sampling_defaults)

    # ---- the whole request ----------------------------------------------------------------

    def process(
        self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None, priority: int = 0
    ) -> EngineInput:
        """Validates and prepares one request; raises InputError / ValueError naming the field."""
        pooling = None
        if isinstance(params, PoolingParams):
            # An embedding: the prompt runs, one (discarded) token ends it, the runner pools.
            pooling = params
            pooling.validate(self.hidden_size or 0)
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True,
                                    truncate_prompt_tokens=pooling.truncate_prompt_tokens)
        params = self._with_extra_eos(params or self.default_sampling_params())
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InputError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InputError("priority: request priorities need scheduling_policy='priority' "
                             "(--scheduling-policy priority)", "priority")
        prompt_text, token_ids = self.tokenize(prompt)
        token_ids = self.truncate_prompt(token_ids, params.truncate_prompt_tokens)
        bad_words = self._bad_words_token_ids(params.bad_words)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InputError("cache_salt must be a non-empty string", "cache_salt")
        params.validate_vocab(self.vocab_size)
        self.validate_prompt(token_ids)
        if params.num_samples > params.n and params.output_kind == "delta":
            raise InputError("best_of > n cannot be streamed: the best samples are known only at the end", "best_of")
        max_output = min(params.max_tokens or self.max_model_len, self.max_model_len - len(token_ids))
        return EngineInput(prompt_text, token_ids, params, max_output, bad_words, cache_salt, priority, pooling)

    # ---- prompts ---------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput, what: str = "prompt") -> tuple[str | None, list[int]]:
        """(text if given as text, token ids) of any prompt shape; a text too long to fit
        whatever its tokens is refused by its length, before tokenizing it."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InputError("prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, what)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise InputError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                         "prompt")

    def encode(self, text: str, what: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        self.check_chars(len(text), what)
        tokenizer = self.require_tokenizer(what)
        return tokenizer.encode(text) if add_special_tokens else tokenizer.encode(text, add_special_tokens=False)

    def require_tokenizer(self, what: str = "prompt") -> Any:
        if self.tokenizer is None:
            raise InputError(f"{what}: text needs a tokenizer; pass prompt_token_ids (skip_tokenizer_init=True)",
                             what)
        return self.tokenizer

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> tuple[str, list[int]]:
        """(text, token ids) of the templated conversation; messages too long to fit are
        refused by their length first. `options`: those of `chat_utils.render_chat`
        (chat_template, tools, add_generation_prompt, continue_final_message, ...).
        Raises ChatTemplateError / InputError."""
        # Every text the template may render counts: contents, names, tool calls' arguments,
        # and the tools' own descriptions and schemas (issue 33.7: those escaped the check).
        text = [{k: v for k, v in m.items() if k != "role"} for m in messages]
        self.check_chars(_num_chars(text, keys=False) + _num_chars(options.get("tools")), "messages")
        tokenizer = self.require_tokenizer("messages")
        return chat_utils.render_chat(tokenizer, messages, **options)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InputError("prompt must not be empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise InputError(f"prompt_token_ids must be integers in [0, {self.vocab_size})", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{len(token_ids)} tokens, leaving no room to generate (prompt too long).", "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )

    # ---- length checks ---------------------------------------------------------------------

    @property
    def char_limit(self) -> int:
        """Characters beyond which a text surely has more than max_model_len tokens.

        No token covers more characters than its vocabulary entry has (a byte-level BPE
        entry has one character per byte), so a text this long cannot fit in
        max_model_len tokens; it is refused before tokenizing it.
        """
        if self._char_limit is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            longest = max((len(t) for t in vocab), default=1)
            self._char_limit = self.max_model_len * max(1, longest) * NORMALIZER_SLACK
        return self._char_limit

    def check_chars(self, num_chars: int, what: str) -> None:
        """InputError (vLLM's context-length wording) when `num_chars` proves the text too long."""
        if self.tokenizer is None or num_chars <= self.max_model_len:
            return  # cannot be too long yet: no need to read the vocabulary
        limit = self.char_limit
        if num_chars > limit:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                f"{what} has {num_chars} characters, more than that many tokens can hold ({limit}). "
                f"Please reduce the length of the {what}.",
                what, CONTEXT_LENGTH_EXCEEDED,
            )

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "prompt") -> None:
        """InputError unless the prompt plus max_tokens fit the model's context (vLLM's
        wording). The server's rule; the offline `LLM` caps max_tokens instead, as vLLM's does."""
        limit = self.max_model_len
        requested = num_prompt_tokens + (max_tokens or 1)
        if requested <= limit:
            return
        param = "max_tokens" if num_prompt_tokens < limit else what
        raise InputError(
            f"This model's maximum context length is {limit} tokens. However, you requested {requested} "
            f"tokens ({num_prompt_tokens} in the {what}, {max_tokens or 1} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param, CONTEXT_LENGTH_EXCEEDED,
        )

    # ---- sampling parameters ---------------------------------------------------------------

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        stop_ids = params.stop_token_ids or []
        extra = [t for t in self.eos_token_ids[1:] if t not in stop_ids]
        if not extra or params.ignore_eos:
            return params
        return replace(params, stop_token_ids=[*stop_ids, *extra])

    def truncate_prompt(self, token_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: the last `keep` tokens (-1: all that leave room for one output).

        Idempotent, so the server may cut a prompt first (its usage and length checks count
        the kept tokens) and `process` cut it again to the same list.
        """
        if keep is None:
            return token_ids
        keep = self.max_model_len - 1 if keep == -1 else keep
        return token_ids[-keep:]

    def _bad_words_token_ids(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word's token ids, as written and with a leading space (vLLM's semantics)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise InputError("bad_words needs a tokenizer (skip_tokenizer_init=True was given)", "bad_words")
        sequences: list[list[int]] = []
        for word in words:
            for variant in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences


def _num_chars(value: Any, keys: bool = True) -> int:
    """The characters of every string in `value` (list items, dict values and, with `keys`,
    dict keys: a schema's property names; nested); iterative, so a deeply nested body cannot
    exhaust the stack."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if keys:
                stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
