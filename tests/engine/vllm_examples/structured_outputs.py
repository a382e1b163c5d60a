# Constrained generation: a choice, a regex, a JSON schema from a pydantic model, a grammar
# (vLLM: examples/offline_inference/structured_outputs.py).
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams


class Shape(str, Enum):
    circle = "circle"
    square = "square"


class Drawing(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no keys beyond these three
    title: str = Field(max_length=16)
    shape: Shape
    sides: int = Field(ge=0, le=12)


llm = LLM(model="facebook/opt-125m", max_model_len=512)
choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]{3,8}\.com"),
                       stop=["\n"], max_tokens=40)
schema = SamplingParams(structured_outputs=StructuredOutputsParams(json=Drawing.model_json_schema()),
                        max_tokens=300)
grammar = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="""
root ::= "SELECT " column " FROM " table
column ::= "name" | "age" | "city"
table ::= "users" | "orders"
"""), max_tokens=30)
answers = {
    name: llm.generate("Answer: ", params)[0].outputs[0].text
    for name, params in (("choice", choice), ("regex", regex), ("json", schema), ("grammar", grammar))
}
print(answers)
