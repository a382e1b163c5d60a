# One base model, a LoRA adapter fetched from the hub cache, requests with and without it
# (vLLM: examples/offline_inference/multilora_inference.py).
from huggingface_hub import snapshot_download
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

adapter_path = snapshot_download(repo_id="yard1/llama-2-7b-sql-lora-test")
llm = LLM(model="meta-llama/Llama-2-7b-hf", enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=4)
greedy = SamplingParams(temperature=0.0, max_tokens=10)
prompt = "[user] Write a SQL query to list every table [/user] [assistant]"
with_adapter = llm.generate(prompt, greedy, lora_request=LoRARequest("sql-lora", 1, adapter_path))
without = llm.generate(prompt, greedy)
print(repr(with_adapter[0].outputs[0].text), repr(without[0].outputs[0].text))
