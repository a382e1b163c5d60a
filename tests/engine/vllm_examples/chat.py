# Multi-turn chat, one conversation then a batch (vLLM: examples/offline_inference/basic/chat.py).
from vllm import LLM, SamplingParams

llm = LLM(model="facebook/opt-125m")
params = SamplingParams(max_tokens=12, temperature=0.5, top_p=0.9, top_k=20)
conversation = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! What can I do for you?"},
    {"role": "user", "content": "Explain why the sea is salty."},
]
single = llm.chat(conversation, params, use_tqdm=False)
batch = llm.chat([conversation] * 5, params, use_tqdm=True)
for out in single + batch:
    print(repr(out.outputs[0].text))
