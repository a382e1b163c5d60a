# Driving LLMEngine step by step (vLLM: examples/offline_inference/llm_engine_example.py).
from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams

engine = LLMEngine.from_engine_args(EngineArgs(model="facebook/opt-125m"))
requests = [
    ("A robot may not injure", SamplingParams(temperature=0.0, max_tokens=12)),
    ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
    ("It is only with the heart", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
]
finished: dict[str, RequestOutput] = {}
next_id = 0
while requests or engine.has_unfinished_requests():
    if requests:
        prompt, params = requests.pop(0)
        engine.add_request(str(next_id), prompt, params)
        next_id += 1
    for output in engine.step():
        if output.finished:
            finished[output.request_id] = output
            print(output.request_id, [c.text for c in output.outputs])
