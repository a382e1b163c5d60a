"""Small random-weight demo models, built locally and cached on disk.

The test suite, the README demo and the benchmarks need real Hugging Face model folders
(``config.json`` + ``model.safetensors`` + tokenizer files), but this project must run with
no network access, so nothing can be downloaded.  This module *builds* such folders instead:

* a byte-level BPE tokenizer trained with the ``tokenizers`` library on a pseudo-English
  corpus generated in code from a fixed seed (syllable words, digits, punctuation, newlines),
  with special tokens ``<unk>``, ``<s>``, ``</s>``, ``<pad>``, ``<|im_start|>``, ``<|im_end|>``
  and a ChatML ``chat_template``;
* a model created with ``AutoModelForCausalLM.from_config`` after ``torch.manual_seed``,
  saved with ``save_pretrained(..., safe_serialization=True)`` in fp32.

**The weights are random, so the generated text is random gibberish.**  The folders are
nevertheless ordinary Hugging Face checkpoints: the engine loads them exactly like a real
Llama/Qwen2/OPT/GPT-2 checkpoint, and ``transformers`` loads them too, which is what lets the tests
compare the engine's greedy output with ``transformers``' ``generate`` token for token.
Point the engine at a real checkpoint folder to get meaningful text.

The weights are random but not *default* random: plain ``from_config`` init yields a model
whose attention is uniform, whose MLP is linear and whose logits are flat, so tests on it
would miss RoPE/KV-cache/MLP/bias/norm-loading bugs and greedy decoding loops on one token.
:class:`_Init` rescales q/k/gate/up (OPT/GPT-2: q/k/fc1/c_fc) to unit scale, randomises
norms and biases and sets the logit scale; see its docstring.  Greedy decoding is then diverse and context-dependent.
Two correct fp32 implementations can still disagree on a greedy step whose top-2 logits
are closer than their float noise (~1e-5 here).  That is rare (no flips in ~30k measured
steps between sdpa, eager and fp64 runs; top-2 gaps < 1e-3 on ~0.1% of steps) but not
impossible, so token-for-token comparisons should tolerate a first mismatch at a step where
the reference's top-2 gap is tiny, rather than blame the engine.

Tokenizer conventions: encoding adds no BOS/EOS (``tokenizer(text)`` returns just the text's
tokens) and ``decode(encode(text)) == text`` for any string.  ``config.eos_token_id`` is
``</s>``; the chat template ends turns with ``<|im_end|>``.

Folders are cached under :func:`default_cache_dir` (``$PAGEDSERVE_CACHE_DIR``, else
``~/.cache/pagedserve``) in a directory whose name contains a hash of the full spec (config,
seed, init, tokenizer, format version), so editing a spec makes a new folder rather than
reusing a stale one.  Builds go to a temporary directory next to the target that is renamed
into place, so concurrent processes (e.g. parallel test workers) never see a half-written
folder; a file lock additionally keeps them from building the same thing twice.

Run ``python -m pagedserve.demo_models [name ...]`` to build models and print their paths.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagedserve import envs
from pagedserve.file_lock import file_lock

__all__ = [
    "DEMO_MODEL",
    "model_names",
    "get_model_path",
    "get_tokenizer_path",
    "default_cache_dir",
    "truncated_copy",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
]

DEMO_MODEL = "demo"

# Bump when the on-disk layout or the build procedure changes in a way the spec dicts
# below do not capture; every cached folder is then rebuilt.
_FORMAT_VERSION = 1
_TOKENIZER_FORMAT_VERSION = 1

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3, <|im_start|>=4, <|im_end|>=5.
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_SMALL_VOCAB = 1024
_DEMO_VOCAB = 4096
_BENCH_VOCAB = 32000


@dataclass(frozen=True)
class _Init:
    """How the random weights are scaled after ``from_config`` (see :func:`_init_weights`).

    Plain ``from_config`` init (every matrix N(0, 0.02)) gives a model that is almost
    linear and almost position-blind: attention scores are ~0.1 so attention is uniform,
    gate/up pre-activations are ~0.16 so SiLU is linear (swapping gate and up changes
    nothing), biases are zero, and the logits are nearly flat (entropy ~ln(vocab)).  Tests
    run against such a model cannot catch RoPE, KV-cache, MLP or bias bugs, and greedy
    decoding falls into repetition.  These knobs put the model in a regime where every
    component matters while keeping the residual stream small enough that float noise is
    not amplified much.
    """

    initializer_range: float = 0.02  # std of embeddings, v/o/down projections, lm_head
    qk_std: float = 1.0  # target std of q/k entries -> attention scores of order 1
    mlp_in_std: float = 1.0  # target std of gate/up pre-activations -> SiLU is non-linear
    # Biases (where the config has them) are random rather than zero, so a loader that
    # drops them fails the tests.  Biases of v/o/down add a constant vector to the residual
    # stream at every position, which drives greedy decoding into repetition, so they are
    # kept small (relative to those projections' outputs, ~0.1-0.2).
    bias_std: float = 0.1  # q/k/gate/up
    out_bias_std: float = 0.002  # v/o/down
    logit_std: float = 2.5  # std of the logits -> entropy of a few nats, like real LMs
    # RMSNorm weights are random (U(1-j, 1+j)) rather than all ones, so a loader that
    # ignores them fails.  The final norm also gets random signs: with tied embeddings an
    # all-positive final norm makes logits ~ e_in . e_out, a near-symmetric score that
    # locks greedy decoding into repeating one token or bouncing between two.
    norm_jitter: float = 0.5
    random_sign_final_norm: bool = True
    # Output rows of <unk>/<s>/<pad> are shrunk so greedy decoding (practically) never
    # emits them, as with a trained model; </s> and the chat markers keep normal rows.
    quiet_special_rows: float = 0.1

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class _ModelSpec:
    model_type: str  # "llama" | "qwen2" | "opt" | "gpt2"
    vocab_size: int
    config: dict[str, Any]
    seed: int = 0
    init: _Init = _Init()
    tokenizer_style: str = "gpt2"
    description: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "config": self.config,
            "seed": self.seed,
            "init": self.init.as_dict(),
            "tokenizer": _tokenizer_spec(self.vocab_size, self.tokenizer_style),
            "format": _FORMAT_VERSION,
        }


_SMALL_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_SPECS: dict[str, _ModelSpec] = {
    "llama-gqa": _ModelSpec(
        "llama",
        _SMALL_VOCAB,
        dict(_SMALL_LLAMA),
        seed=1,
        description="tiny Llama, GQA (4 query / 2 KV heads), untied embeddings",
    ),
    "llama-tied": _ModelSpec(
        "llama",
        _SMALL_VOCAB,
        {**_SMALL_LLAMA, "tie_word_embeddings": True},
        # Seed 2 happened to make </s> a greedy attractor (28% of prompts stopped early).
        seed=22,
        description="tiny Llama, GQA, lm_head tied to the input embeddings",
    ),
    "llama3-rope": _ModelSpec(
        "llama",
        _SMALL_VOCAB,
        {
            **_SMALL_LLAMA,
            "num_hidden_layers": 3,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "attention_bias": True,
            "mlp_bias": True,
        },
        seed=3,
        description="tiny Llama with llama3 RoPE scaling and attention/MLP biases",
    ),
    "qwen2": _ModelSpec(
        "qwen2",
        _SMALL_VOCAB,
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        },
        seed=4,
        # transformers v5's AutoTokenizer always builds Qwen2Tokenizer for model_type qwen2,
        # which imposes Qwen2's pre-tokenizer and NFC normaliser; training with the same
        # pipeline keeps AutoTokenizer and the saved tokenizer.json in agreement.
        tokenizer_style="qwen2",
        description="tiny Qwen2 (QKV bias), GQA, Qwen2-style tokenizer",
    ),
    "demo": _ModelSpec(
        "llama",
        _DEMO_VOCAB,
        {
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        seed=5,
        description="small Llama for the README demo and the server (~5M params)",
    ),
    "bench-125m": _ModelSpec(
        "llama",
        _BENCH_VOCAB,
        {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        seed=6,
        description="~125M-parameter Llama for benchmarks",
    ),
    "opt": _ModelSpec(
        "opt",
        _SMALL_VOCAB,
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 2048,
            # != hidden_size, so project_in / project_out are exercised (like opt-350m).
            "word_embed_proj_dim": 48,
            "do_layer_norm_before": True,
        },
        # Logits of rank word_embed_proj_dim repeat more under greedy decoding; of seeds
        # 7/17/27/37 x dims 32/48 this one gave the most diverse greedy outputs.
        seed=27,
        description="tiny OPT: learned positions (offset 2), ReLU MLP, biases, projections, tied",
    ),
    "gpt2": _ModelSpec(
        "gpt2",
        _SMALL_VOCAB,
        {"n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4, "n_positions": 2048},
        seed=8,
        description="tiny GPT-2: Conv1D weights, fused c_attn, learned positions, gelu_new, tied",
    ),
    "opt-125m": _ModelSpec(
        "opt",
        _BENCH_VOCAB,  # facebook/opt-125m has 50272 (padded); the local tokenizer has 32000
        {
            "hidden_size": 768,
            "ffn_dim": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 2048,
            "word_embed_proj_dim": 768,
            "do_layer_norm_before": True,
        },
        seed=9,
        description="~110M-parameter OPT shaped like facebook/opt-125m, for benchmarks",
    ),
}


def model_names() -> list[str]:
    """Names accepted by :func:`get_model_path`."""
    return list(_SPECS)


def default_cache_dir() -> pathlib.Path:
    """``$PAGEDSERVE_CACHE_DIR`` if set, else ``~/.cache/pagedserve`` (`envs.cache_dir`)."""
    return envs.cache_dir()


def get_model_path(
    name: str = DEMO_MODEL, cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Return the folder of demo model ``name``, building it first if it is not cached.

    The folder is a regular Hugging Face checkpoint (config, safetensors weights, tokenizer)
    with **random weights**; see the module docstring.
    """
    try:
        spec = _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown demo model {name!r}; choose from {model_names()}") from None
    root = _resolve_cache_dir(cache_dir)
    target = root / "models" / f"{name}-{_hash(spec.as_dict())}"
    return _build_once(target, lambda tmp: _build_model(spec, tmp, root))


def get_tokenizer_path(
    vocab_size: int,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    style: str = "gpt2",
) -> pathlib.Path:
    """Return a folder with a byte-level BPE tokenizer of exactly ``vocab_size`` tokens.

    ``style`` picks the pre-tokenization: ``"gpt2"`` (GPT-2 regex, no normaliser: every
    string round-trips exactly) or ``"qwen2"`` (Qwen2's regex and NFC normalisation, which
    is what ``Qwen2Tokenizer`` rebuilds on load).  Loadable with
    ``PreTrainedTokenizerFast.from_pretrained``; trained locally, cached like models.
    """
    if style not in _TOKENIZER_STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; choose from {_TOKENIZER_STYLES}")
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256} (specials + bytes)")
    root = _resolve_cache_dir(cache_dir)
    spec = _tokenizer_spec(vocab_size, style)
    target = root / "tokenizers" / f"bpe{vocab_size}-{style}-{_hash(spec)}"
    return _build_once(target, lambda tmp: _build_tokenizer(spec, tmp))


# --------------------------------------------------------------------------- caching


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    return pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def truncated_copy(source: pathlib.Path, num_layers: int) -> pathlib.Path:
    """A draft model (speculative decoding tests and benchmark): `source` with only its first
    `num_layers` decoder layers, same tokenizer; built once under the demo-model cache."""
    target = default_cache_dir() / "models" / f"{source.name}-first{num_layers}"
    return _build_once(target, lambda tmp: _truncate(source, num_layers, tmp))


def _truncate(source: pathlib.Path, num_layers: int, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="float32")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(out)


def _build_once(target: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Only spares N workers building the same folder; correctness comes from the atomic rename.
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process built it while we waited
            return target
        # Leftovers of builds that were killed (we hold the lock, so none is running).
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            # mkdtemp makes the folder 0700; give it the usual permissions of a cache dir.
            os.chmod(tmp, 0o755)
            build(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                # Lost a race with a process that did not take the lock: theirs is complete.
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- tokenizer

_ONSETS = (
    "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl "
    "sm sn sp st str sw th tr wh"
).split() + [""] * 6
_VOWELS = "a e i o u y a e i o ai ea ee ie oa oo ou au".split()
_CODAS = "n r s t l m nd ng nt rd rt st ck sh th x".split() + [""] * 12
_FUNCTION_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by not but what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would"
).split()


_TOKENIZER_STYLES = ("gpt2", "qwen2")
# Qwen2's pre-tokenization regex (transformers.models.qwen2.tokenization_qwen2).
_QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tokenizer_spec(vocab_size: int, style: str = "gpt2") -> dict[str, Any]:
    # The corpus grows with the vocabulary so BPE finds enough distinct merges to reach
    # vocab_size exactly (the lexicon bounds how many multi-byte tokens can exist).
    return {
        "vocab_size": vocab_size,
        "style": style,
        "corpus_words": 20_000 + 8 * vocab_size,
        "lexicon": max(1_000, vocab_size),
        "seed": 1234,
        "specials": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "format": _TOKENIZER_FORMAT_VERSION,
    }


def _make_corpus(n_words: int, lexicon_size: int, seed: int) -> Iterator[str]:
    """Pseudo-English paragraphs: Zipf-distributed syllable words, numbers, punctuation."""
    rng = random.Random(seed)
    lexicon: set[str] = set(_FUNCTION_WORDS)
    while len(lexicon) < lexicon_size:
        n_syll = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(n_syll)
            )
        )
    rest = sorted(lexicon - set(_FUNCTION_WORDS))
    rng.shuffle(rest)
    words = _FUNCTION_WORDS + rest
    weights = [1.0 / (rank + 8) for rank in range(len(words))]
    stream = rng.choices(words, weights, k=n_words)

    parts: list[str] = []
    i = 0
    while i < len(stream):
        n = rng.randint(3, 18)
        sentence = []
        for w in stream[i : i + n]:
            r = rng.random()
            if r < 0.04:
                w = str(rng.randint(0, 10 ** rng.randint(1, 6)))
            elif r < 0.05:
                w = f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"
            elif r < 0.06:
                w = f'"{w}"'
            elif r < 0.07:
                w = f"({w})"
            elif r < 0.10:
                w += ","
            sentence.append(w)
        i += n
        if sentence:
            sentence[0] = sentence[0][:1].upper() + sentence[0][1:]
        parts.append(" ".join(sentence) + rng.choice(".....?!:;"))
        r = rng.random()
        parts.append("\n\n" if r < 0.1 else "\n" if r < 0.15 else " ")
        if len(parts) >= 200:  # feed the trainer in chunks instead of one huge string
            yield "".join(parts)
            parts = []
    if parts:
        yield "".join(parts)


def _build_tokenizer(spec: dict[str, Any], out_dir: pathlib.Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = spec["vocab_size"]
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Byte-level pre-tokenizer + decoder: every string is encodable, decode() inverts
    # encode(), and every single id decodes (partial UTF-8 becomes U+FFFD).
    if spec["style"] == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        _make_corpus(spec["corpus_words"], spec["lexicon"], spec["seed"]), trainer
    )
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        # Safety net if the corpus ran out of merges: pad with inert special tokens so the
        # size is exact (they never appear in normal text and still decode fine).
        tok.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json (transformers
    # v5 otherwise writes chat_template.jinja), where older loaders and our engine look.
    hf_tok.save_pretrained(str(out_dir), save_jinja_files=False)

    # transformers v5 records tokenizer_class "TokenizersBackend", which v4 does not know;
    # "PreTrainedTokenizerFast" loads in both (and Qwen2Tokenizer is what real Qwen2
    # checkpoints declare).  v5 also no longer writes special_tokens_map.json, which some
    # loaders still read.
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = (
        "Qwen2Tokenizer" if spec["style"] == "qwen2" else "PreTrainedTokenizerFast"
    )
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# --------------------------------------------------------------------------- models


def _make_config(spec: _ModelSpec, tokenizer: Any) -> Any:
    from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "opt": OPTConfig, "gpt2": GPT2Config}
    cls = classes[spec.model_type]
    # OPT calls its init std `init_std`; the others `initializer_range`.
    std_key = "init_std" if spec.model_type == "opt" else "initializer_range"
    return cls(
        vocab_size=spec.vocab_size,
        **{std_key: spec.init.initializer_range},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Deep copy: config classes normalise nested dicts (rope_scaling) in place, which
        # would silently change the spec and therefore its cache hash.
        **copy.deepcopy(spec.config),
    )


def _init_weights(model: Any, init: _Init) -> None:
    """Rescale a freshly ``from_config``-initialised model (all matrices N(0, ir)).

    Llama/Qwen2 here; OPT and GPT-2 (LayerNorm models) in :func:`_init_layernorm_model`.

    Runs under the global torch RNG seeded by the caller, so it is deterministic.
    """
    import torch

    cfg = model.config
    if cfg.model_type in ("opt", "gpt2"):
        _init_layernorm_model(model, init)
        return
    hidden = cfg.hidden_size
    ir = init.initializer_range
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # The inputs of these projections are RMS-normalised (entries ~1), so a std of
            # target/sqrt(hidden) gives outputs with std ~target.
            for proj, target in (
                (attn.q_proj, init.qk_std),
                (attn.k_proj, init.qk_std),
                (mlp.gate_proj, init.mlp_in_std),
                (mlp.up_proj, init.mlp_in_std),
            ):
                proj.weight.normal_(0.0, target / hidden**0.5)
            for proj, std in (
                (attn.q_proj, init.bias_std),
                (attn.k_proj, init.bias_std),
                (attn.v_proj, init.out_bias_std),
                (attn.o_proj, init.out_bias_std),
                (mlp.gate_proj, init.bias_std),
                (mlp.up_proj, init.bias_std),
                (mlp.down_proj, init.out_bias_std),
            ):
                if getattr(proj, "bias", None) is not None:
                    proj.bias.normal_(0.0, std)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(1.0 - init.norm_jitter, 1.0 + init.norm_jitter)
        # The final norm feeds only lm_head and its normalised input has RMS 1, so the
        # logits have std ~ rms(weight) * ir * sqrt(hidden).  Scaling here (not lm_head)
        # leaves the residual stream alone and works the same for tied embeddings.
        norm_w = model.model.norm.weight
        norm_w.uniform_(1.0 - init.norm_jitter, 1.0 + init.norm_jitter)
        if init.random_sign_final_norm:
            norm_w.mul_(torch.randint(0, 2, norm_w.shape).mul_(2).sub_(1).to(norm_w.dtype))
        norm_w.mul_(init.logit_std / (ir * hidden**0.5 * norm_w.pow(2).mean().sqrt()))
        quiet_ids = [SPECIAL_TOKENS.index(t) for t in (UNK, BOS, PAD)]
        model.get_output_embeddings().weight[quiet_ids] *= init.quiet_special_rows


def _layernorm_parts(model: Any) -> tuple[list[dict[str, Any]], Any, Any]:
    """Per layer {"q", "k", "v", "o", "fc_in", "fc_out", "norms"} as (weight view (out, in),
    bias view) pairs, plus the final norm and OPT's project_out (or None).

    GPT-2's fused Conv1D c_attn stores (in, 3 * hidden): q/k/v are column ranges, viewed
    transposed so every weight here reads (out, in) like nn.Linear.
    """
    layers = []
    if model.config.model_type == "gpt2":
        e = model.config.hidden_size
        for block in model.transformer.h:
            w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
            qkv = [(w[:, i * e : (i + 1) * e].t(), b[i * e : (i + 1) * e]) for i in range(3)]
            layers.append({
                "q": qkv[0], "k": qkv[1], "v": qkv[2],
                "o": (block.attn.c_proj.weight.t(), block.attn.c_proj.bias),
                "fc_in": (block.mlp.c_fc.weight.t(), block.mlp.c_fc.bias),
                "fc_out": (block.mlp.c_proj.weight.t(), block.mlp.c_proj.bias),
                "norms": [block.ln_1, block.ln_2],
            })
        return layers, model.transformer.ln_f, None
    decoder = model.model.decoder
    for layer in decoder.layers:
        a = layer.self_attn
        layers.append({
            **{n: (getattr(a, f"{n}_proj").weight, getattr(a, f"{n}_proj").bias) for n in "qkv"},
            "o": (a.out_proj.weight, a.out_proj.bias),
            "fc_in": (layer.fc1.weight, layer.fc1.bias),
            "fc_out": (layer.fc2.weight, layer.fc2.bias),
            "norms": [layer.self_attn_layer_norm, layer.final_layer_norm],
        })
    return layers, decoder.final_layer_norm, decoder.project_out


def _init_layernorm_model(model: Any, init: _Init) -> None:
    """:func:`_init_weights` for OPT / GPT-2 (pre-LN, LayerNorm with bias, ReLU/GELU MLP).

    Same targets as for Llama: unit-scale q/k and MLP pre-activations (the LayerNorm output
    has unit-RMS features), random biases (LayerNorm biases too), random norm weights, and
    a final norm scaled (with random signs) to give logits of std ``logit_std``. OPT's
    project_in/project_out get unit-gain weights so the logit scale still follows the norm.
    """
    import torch

    cfg = model.config
    hidden = cfg.hidden_size
    ir = init.initializer_range
    layers, final_norm, project_out = _layernorm_parts(model)
    with torch.no_grad():
        for parts in layers:
            for name, target in (("q", init.qk_std), ("k", init.qk_std), ("fc_in", init.mlp_in_std)):
                parts[name][0].normal_(0.0, target / hidden**0.5)
            for name in ("q", "k", "fc_in", "v", "o", "fc_out"):
                std = init.bias_std if name in ("q", "k", "fc_in") else init.out_bias_std
                bias = parts[name][1]
                if bias is not None:
                    bias.normal_(0.0, std)
            for norm in parts["norms"]:
                norm.weight.uniform_(1.0 - init.norm_jitter, 1.0 + init.norm_jitter)
                norm.bias.normal_(0.0, init.bias_std)
        out_dim = hidden
        if project_out is not None:  # OPT with word_embed_proj_dim != hidden_size
            project_out.weight.normal_(0.0, 1.0 / hidden**0.5)
            model.model.decoder.project_in.weight.normal_(0.0, 1.0 / cfg.word_embed_proj_dim**0.5)
            out_dim = cfg.word_embed_proj_dim
        norm_w = final_norm.weight
        norm_w.uniform_(1.0 - init.norm_jitter, 1.0 + init.norm_jitter)
        if init.random_sign_final_norm:
            norm_w.mul_(torch.randint(0, 2, norm_w.shape).mul_(2).sub_(1).to(norm_w.dtype))
        norm_w.mul_(init.logit_std / (ir * out_dim**0.5 * norm_w.pow(2).mean().sqrt()))
        final_norm.bias.normal_(0.0, init.out_bias_std)
        quiet_ids = [SPECIAL_TOKENS.index(t) for t in (UNK, BOS, PAD)]
        model.get_output_embeddings().weight[quiet_ids] *= init.quiet_special_rows


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_model(spec: _ModelSpec, out_dir: pathlib.Path, cache_root: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok_dir = get_tokenizer_path(spec.vocab_size, cache_root, style=spec.tokenizer_style)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    if len(tokenizer) != spec.vocab_size:
        raise RuntimeError(f"tokenizer at {tok_dir} has {len(tokenizer)} tokens")
    config = _make_config(spec, tokenizer)

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, spec.init)
    model.eval()
    with _quiet_progress_bars():
        # One file: the engine's loader and the tests expect model.safetensors, not shards.
        model.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size="20GB")
    if not (out_dir / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {out_dir / 'model.safetensors'}")
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out_dir / f.name)
    info = {
        "note": "random weights, built by pagedserve.demo_models; outputs are gibberish",
        "description": spec.description,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "spec": spec.as_dict(),
    }
    (out_dir / "demo_model.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print("usage: python -m pagedserve.demo_models [name ...]")
        print(f"names: {', '.join(model_names())} (default: {DEMO_MODEL})")
        print(f"cache: {default_cache_dir()} (override with PAGEDSERVE_CACHE_DIR)")
        return 0
    for name in args or [DEMO_MODEL]:
        if name == "all":
            for n in model_names():
                print(f"{n}\t{get_model_path(n)}")
            continue
        print(f"{name}\t{get_model_path(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
