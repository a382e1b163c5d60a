# Plain batched generation with sampling (vLLM: examples/offline_inference/basic/basic.py).
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "In a small village by the sea,",
    "The best way to learn a language is",
]
params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model="facebook/opt-125m")
outputs = llm.generate(prompts, params)
for out in outputs:
    print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
