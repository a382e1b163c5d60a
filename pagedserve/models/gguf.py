"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights.

Parsing and dequantizing are the `gguf` package's; the metadata -> config mapping, the
GGUF -> Hugging Face tensor names and the Llama q/k row order are transformers' GGUF
utilities (`modeling_gguf_pytorch_utils`), the same code `from_pretrained(gguf_file=...)`
runs, so our weights are the ones transformers' reference model gets.

    metadata  llama.block_count, llama.rope.freq_base, ...  -> LlamaConfig (+ architectures)
              tokenizer.ggml.*, tokenizer.chat_template      -> a fast tokenizer
    tensors   blk.N.attn_q.weight (Q4_1 blocks) -> model.layers.N.self_attn.q_proj.weight

Weights are yielded one at a time as `(hf_name, tensor)` for the loader's `load_weights`,
dequantized to the serving dtype. Every tensor type the installed `gguf` package can
dequantize loads (K-quants, I-quants, Q5_*, ...: `dequantizable_types()`); one log line per
load names the quantized types dequantized and what that cost (seconds, bytes in and out).
With `keep_quantized`, weights of QUANTIZED_TYPES (Q8_0, Q4_K, Q6_K, ...) come as
`GGUFQuantizedTensor` (the raw llama.cpp blocks, rows already in HF order) instead: the seam
for linear methods that take those blocks as they are (quantization/gguf_blocks.py), which
the loader uses by default.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the HF class our registry serves.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's model sizes whose attention scale is 1/sqrt(hidden / heads) rather than
# 1/sqrt(head_dim): the 27B models, told apart by block count (llama-model.cpp, LLM_TYPE_27B).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Architectures whose experts are stacked 3-D tensors (blk.N.ffn_gate_exps, ...); they load
# dequantized (the raw-block methods take 2-D linear weights).
STACKED_EXPERT_ARCHS = ("qwen3moe",)
FLOAT_TYPES = ("F32", "F16", "BF16")
# The types `keep_quantized` hands over as raw blocks (a native kernel serves them,
# quantization/gguf_decode.py); every other quantized type is dequantized at load.
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


@dataclasses.dataclass(frozen=True)
class GGUFQuantizedTensor:
    """One weight in llama.cpp's block layout, as stored in the file.

    Each row of `blocks` is the row of the (out, in) weight: in // 32 blocks of 32 weights
    (Q8_0 = fp16 scale + 32 int8; Q4_0 = fp16 scale + 16 bytes of nibbles, w = s * (q - 8);
    ...) or in // 256 super-blocks (Q4_K, Q6_K, ...); quantization/gguf_decode.py has them all.
    """

    qtype: str  # one of QUANTIZED_TYPES
    shape: tuple[int, int]  # (out_features, in_features), the HF weight's shape
    blocks: torch.Tensor  # uint8 (out_features, bytes per row)

    def dequantize(self) -> torch.Tensor:
        """float32 (out_features, in_features)."""
        from gguf import GGMLQuantizationType, dequantize

        data = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.require(data, requirements=["C", "W"])).reshape(self.shape)


@functools.cache
def dequantizable_types() -> tuple[str, ...]:
    """Every GGUF tensor type the installed `gguf` package can dequantize, e.g. ("F32", ...,
    "Q4_K", "IQ4_XS"). Asked of the package (one zero block each) rather than copied, so a
    newer `gguf` brings its new types with it; integer tensors (I8..I64) are not among them."""
    from gguf import GGML_QUANT_SIZES, dequantize

    types = []
    for qtype, (_, type_size) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        types.append(qtype.name)
    return tuple(types)


def _reader(path: Path) -> Any:
    # Parsing the metadata (a 49k-token vocabulary is ~100k fields) takes seconds: once per file.
    return _cached_reader(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is "not a GGUF file" to the user
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from exc


def _architecture(reader: Any, path: Path) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int) -> dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _architecture(_reader(Path(path)), Path(path))
    return load_gguf_checkpoint(path, return_tensors=False)


def _metadata(path: Path) -> dict[str, Any]:
    return _parsed(str(path), path.stat().st_mtime_ns)


def load_gguf_config(path: str | Path) -> PretrainedConfig:
    """The HF config the GGUF metadata describes (dims, rope, norm eps, vocab, tied
    embeddings, special token ids), with `architectures` set for our registry.

    Raises:
        ValueError: not a GGUF file, or an architecture we do not serve (named).
    """
    from transformers import AutoConfig

    path = Path(path)
    values = dict(_metadata(path)["config"])
    values.pop("_model_name_or_path", None)
    model_type = values.pop("model_type")
    reader = _reader(path)
    arch = _architecture(reader, path)
    values.update(_derived_config(arch, values, lambda key: _field(reader, f"{arch}.{key}")))
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = [ARCHITECTURES[arch]]
    return config


def _field(reader: Any, key: str) -> Any:
    """A scalar metadata value, or None when the file does not have the key."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return value.tolist()[0] if len(value) == 1 else bytes(value).decode()


def _derived_config(arch: str, values: dict[str, Any], meta: Any) -> dict[str, Any]:
    """Config values transformers' GGUF mapping leaves out (or leaves at the HF defaults of
    the full-size model), read or derived as llama.cpp's llama-model.cpp does for `arch`.
    `meta(key)` is the file's `<arch>.<key>` value or None."""
    derived: dict[str, Any] = {}
    head_dim = meta("attention.key_length")
    if head_dim is not None:  # Qwen3's head_dim is not hidden / heads (0.6B: 128 vs 64)
        derived["head_dim"] = head_dim
    head_dim = head_dim or values["hidden_size"] // values["num_attention_heads"]
    if arch == "phi3":
        rot = meta("rope.dimension_count")
        if rot is not None and rot != head_dim:  # Phi-4-mini rotates 3/4 of each head
            derived["rope_parameters"] = {"rope_type": "default", "rope_theta": values.get(
                "rope_theta", 10000.0), "partial_rotary_factor": rot / head_dim}
        if meta("attention.sliding_window"):  # every layer windowed, as llama.cpp's phi3
            derived["sliding_window"] = meta("attention.sliding_window")
    if arch == "qwen3moe":
        # transformers maps expert_count / expert_used_count (and norm_topk_prob = True, as
        # llama.cpp's build_moe_ffn call has it) but not the experts' width; llama.cpp's
        # qwen3moe makes every layer sparse (no mlp_only_layers).
        if meta("expert_feed_forward_length") is not None:
            derived["moe_intermediate_size"] = meta("expert_feed_forward_length")
        derived |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch in ("gemma2", "gemma3"):
        # The file has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim),
        # 1/sqrt(hidden / heads) for the 27B models.
        big = values["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        derived["query_pre_attn_scalar"] = (
            values["hidden_size"] // values["num_attention_heads"] if big else head_dim)
    if arch == "gemma2":
        # llama.cpp: swa pattern 2 (even layers windowed, transformers' default layer_types);
        # the softcaps from the file when it has them, else 50 / 30 (both defaults agree).
        for key, name in (("attn_logit_softcapping", "attn_logit_softcapping"),
                          ("final_logit_softcapping", "final_logit_softcapping")):
            if meta(key) is not None:
                derived[name] = float(meta(key))
    if arch == "gemma3":
        # llama.cpp (LLM_ARCH_GEMMA3): set_swa_pattern(6), i.e. 5 windowed layers : 1 full,
        # and rope_freq_base_train_swa = 10000 for the windowed layers (a newer file may say
        # rope.freq_base_swa); the file's rope.freq_base (1e6) and rope.scaling.factor
        # (linear, 4B and up) are the full layers'. Gemma-3 files carry neither the pattern
        # nor the local base, so they are written out here.
        layers = values["num_hidden_layers"]
        derived["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": values.get("rope_theta", 1e6)}
        factor = meta("rope.scaling.factor")
        if factor is not None and factor != 1.0:
            full = full | {"rope_type": "linear", "factor": float(factor)}
        derived["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(meta("rope.freq_base_swa") or 10000.0)},
            "full_attention": full,
        }
    return derived


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The fast tokenizer (vocabulary, merges, special tokens, chat template) in the metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# Token texts llama.cpp treats as end of generation whatever the file's eos id is
# (llama-vocab.cpp, `special_eog_ids`): Gemma's <end_of_turn>, ChatML's <|im_end|>, ...
EOG_TOKEN_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                   "<|endoftext|>", "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>")


def gguf_eog_token_ids(path: str | Path) -> tuple[int, ...]:
    """Ids of the vocabulary's end-of-generation tokens (EOG_TOKEN_TEXTS), in id order: a
    GGUF file stores one eos id (Gemma 3: <eos>) and no generation_config.json, so an
    instruct model's <end_of_turn> would otherwise never end a reply."""
    field = _reader(Path(path)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return ()
    wanted = {t.encode() for t in EOG_TOKEN_TEXTS}
    return tuple(i for i, part in enumerate(field.data) if bytes(field.parts[part]) in wanted)


def gguf_weight_types(path: str | Path) -> set[str]:
    """The tensor types of the file's matrices (2-D tensors), e.g. {"Q4_1", "Q8_0"}."""
    reader = _reader(Path(path))
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}


def gguf_tensor_types(path: str | Path, config: PretrainedConfig) -> dict[str, str]:
    """HF parameter name -> GGUF tensor type ("Q8_0", "F16", ...) for every mapped tensor."""
    path = Path(path)
    reader = _reader(path)
    names = _gguf_to_hf_names(_architecture(reader, path), config)
    return {names[t.name]: t.tensor_type.name for t in reader.tensors if t.name in names}


def gguf_raw_tensor(path: str | Path, config: PretrainedConfig, hf_name: str) -> GGUFQuantizedTensor:
    """One quantized matrix's blocks as stored, by HF name (the LM head or the token embedding:
    tensors whose rows the converter did not permute).

    Raises:
        KeyError: no such tensor, or not of QUANTIZED_TYPES.
    """
    path = Path(path)
    reader = _reader(path)
    names = _gguf_to_hf_names(_architecture(reader, path), config)
    for tensor in reader.tensors:
        if names.get(tensor.name) == hf_name and tensor.tensor_type.name in QUANTIZED_TYPES:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
            blocks = torch.from_numpy(np.require(tensor.data, requirements=["C", "W"]))
            return GGUFQuantizedTensor(tensor.tensor_type.name, shape, blocks)
    raise KeyError(f"{path}: no quantized tensor for {hf_name}")


def iter_gguf_tensors(
    path: str | Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    keep_quantized: bool | Collection[str] = False,
) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
    """(HF name, tensor) for every weight of the file, dequantized into `dtype`.

    With `keep_quantized`, matrices of QUANTIZED_TYPES come as `GGUFQuantizedTensor` instead:
    every one (True), or those of these HF names (what the loader's GGUF methods take).
    Once the last tensor is out, one INFO line says which quantized types were dequantized
    here and what it cost.

    Raises:
        ValueError: a tensor type the `gguf` package cannot dequantize (named with the
            tensor), or an architecture we do not serve.
    """
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    path = Path(path)
    reader = _reader(path)
    arch = _architecture(reader, path)
    _check_tensor_types(reader, path)
    metadata = _metadata(path)
    # transformers' qwen3moe processor keeps the stacked experts in its own dict rather than
    # returning them; we name them (_gguf_to_hf_names) and pass them through as stored.
    processor_cls = TensorProcessor if arch in STACKED_EXPERT_ARCHS else TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_cls(config=metadata["config"])
    names = _gguf_to_hf_names(arch, config)
    cost = _DequantCost()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        raw = qtype in QUANTIZED_TYPES and keep_quantized
        raw = raw and (keep_quantized is True or names.get(tensor.name) in keep_quantized)
        raw = raw and len(tensor.shape) == 2  # stacked experts (3-D) load dequantized
        start = time.perf_counter()
        data = tensor.data if raw else dequantize(tensor.data, tensor.tensor_type)
        # Llama's q/k rows were permuted by llama.cpp's converter; the processor undoes it.
        # Rows are whole blocks, so the same row permutation applies to raw blocks.
        result = processor.process(weights=data, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=metadata)
        hf_name = names.get(result.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: derived at run time from the config
        weights = torch.from_numpy(np.require(result.weights, requirements=["C", "W"]))
        if raw:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
            yield hf_name, GGUFQuantizedTensor(qtype, shape, weights)
            continue
        weights = weights.to(dtype)
        if qtype not in FLOAT_TYPES:
            cost.add(qtype, int(tensor.n_bytes), weights.numel() * weights.element_size(),
                     time.perf_counter() - start)
        yield hf_name, weights
    cost.log(path, dtype)


@dataclasses.dataclass
class _DequantCost:
    """What dequantizing at load cost, summed over one file's quantized tensors."""

    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    file_bytes: int = 0
    out_bytes: int = 0
    seconds: float = 0.0

    def add(self, qtype: str, file_bytes: int, out_bytes: int, seconds: float) -> None:
        self.counts[qtype] += 1
        self.file_bytes += file_bytes
        self.out_bytes += out_bytes
        self.seconds += seconds

    def log(self, path: Path, dtype: torch.dtype) -> None:
        if not self.counts:
            return
        types = ", ".join(f"{qtype} x{n}" for qtype, n in sorted(self.counts.items()))
        logger.info(
            "%s: dequantized at load to %s (no native kernel serves them): %s; %.1f MiB of blocks "
            "-> %.1f MiB in %.2f s", path.name, str(dtype).removeprefix("torch."), types,
            self.file_bytes / 2**20, self.out_bytes / 2**20, self.seconds,
        )


def _check_tensor_types(reader: Any, path: Path) -> None:
    known = dequantizable_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in known:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which "
                f"the installed gguf package cannot dequantize; supported: {', '.join(known)}"
            )


def _gguf_to_hf_names(arch: str, config: PretrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name of the transformers model (on the meta device).

    This is transformers' `get_gguf_hf_weights_map` minus its recursion into every submodule,
    which rebuilds gguf's name table per module (seconds for a 30-layer model); the HF
    names of a causal LM are all reachable from the root.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    gguf_arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    table = get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    names = {}
    for hf_name in reference.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(stem)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    if arch in STACKED_EXPERT_ARCHS:
        # ffn_{gate,up,down}_exps: every expert of layer N in one (E, out, in) tensor, named
        # as one stacked tensor that the model cuts per expert (models/qwen3_moe.py).
        for i in range(config.num_hidden_layers):
            for proj in ("gate", "up", "down"):
                names[f"blk.{i}.ffn_{proj}_exps.weight"] = f"model.layers.{i}.mlp.experts.{proj}_proj.weight"
    return names
