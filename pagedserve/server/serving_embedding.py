"""/v1/embeddings: one pooling request per input, in one engine group.

The inputs take the completion prompt's four shapes (text, texts, token ids, lists of ids);
text is tokenized by the input processor in the tokenize worker, as for completions. Each input
runs as a pooling request (pagedserve/pooling_params.py): its embedding is the final hidden
state at its last token, L2-normalized unless `normalize` is false.
"""

from __future__ import annotations

import base64
import struct
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from pagedserve.server.serving_common import (
    ServerContext,
    process,
    request_failed,
    submit,
    watch_client,
)

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


async def create_embedding(ctx: ServerContext, body: EmbeddingRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(body.model)
    # Resolved once, now: an unload meanwhile makes the submission a 404, never the base model.
    lora = ctx.lora_for(model)
    hidden_size = ctx.engine.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise APIError(400, f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot "
                            "be shortened (not a Matryoshka model)", "dimensions")
    prompts = await _inputs(ctx, body, body.input)
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(prompts)}", "input")
    if body.truncate_prompt_tokens is not None:
        prompts = [(text if len(ids) <= body.truncate_prompt_tokens else None, ids[-body.truncate_prompt_tokens:])
                   for text, ids in prompts]
    params = PoolingParams(normalize=body.normalize if body.normalize is not None else True)
    engine_prompts = [{"prompt": text, "prompt_token_ids": ids} for text, ids in prompts]
    inputs = await process(ctx, body, engine_prompts, params, 1, "input")
    group = await submit(ctx, body, inputs, arrival, lora)
    outputs: list[RequestOutput | None] = [None] * len(inputs)

    async def consume() -> None:
        async for index, output in group:
            if output.finished:
                outputs[index] = output

    async with group:  # aborts the unfinished requests however we leave (a client gone too)
        await watch_client(raw_request, consume())
    data = []
    for index, finished in enumerate(outputs):
        assert finished is not None
        output = finished
        completion = output.outputs[0]
        if completion.finish_reason == "error" or output.pooled is None:
            raise request_failed(completion.stop_reason)
        vector = output.pooled
        encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() \
            if body.encoding_format == "base64" else vector
        data.append(EmbeddingData(index=index, embedding=encoded))
    num_tokens = sum(len(ids) for _, ids in prompts)
    response = EmbeddingResponse(id=random_id("embd"), created=int(time.time()), model=model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
    return JSONResponse(response.model_dump())


async def _inputs(ctx: ServerContext, body: EmbeddingRequest, given: str | list[str] | list[int] | list[list[int]]
                  ) -> list[tuple[str | None, list[int]]]:
    items = [given] if isinstance(given, str) else given
    if isinstance(items[0], int):
        return [(None, list(items))]  # type: ignore[arg-type]
    processor = ctx.processor
    return await ctx.process_off_loop(body, lambda: [processor.tokenize(item, "input") for item in items])
