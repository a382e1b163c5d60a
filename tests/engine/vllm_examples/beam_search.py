# Beam search over a prompt (vLLM: LLM.beam_search with BeamSearchParams).
from vllm import LLM
from vllm.sampling_params import BeamSearchParams

llm = LLM(model="facebook/opt-125m")
params = BeamSearchParams(beam_width=3, max_tokens=8)
results = llm.beam_search([{"prompt": "The quick brown fox"}], params)
for sequence in results[0].sequences:
    print(sequence.cum_logprob, repr(sequence.text))
