"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine.

    /v1/completions /v1/chat/completions /v1/models    (Bearer auth when an API key is set)
    /health /metrics /tokenize /detokenize /version

Life of a request: pydantic parses the body (errors -> 400), the handler checks the model
and the context length, fans out n / best_of / several prompts into engine requests added
as one group, then streams SSE chunks or collects the group while polling for a client
disconnect. Leaving early (disconnect, error, shutdown) aborts the group's requests.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve import __version__
from pagedserve.server.errors import APIError, error_body, install_error_handlers
from pagedserve.server.lora_admin import (
    LoadLoRARequest,
    UnloadLoRARequest,
    load_adapter,
    unload_adapter,
)
from pagedserve.server.metrics import CONTENT_TYPE
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now_s,
)
from pagedserve.server.serving_chat import create_chat_completion, render_chat
from pagedserve.server.serving_common import ServerContext
from pagedserve.server.serving_completion import create_completion

logger = logging.getLogger(__name__)


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def check_api_key(request: Request) -> None:
    """Bearer auth for /v1; constant-time comparison so the key cannot be timed out."""
    key = get_ctx(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                       None, "invalid_api_key")


v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
root = APIRouter()


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(get_ctx(request), body, request)


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(get_ctx(request), body, request)


@v1.get("/models")
async def models(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    data = [
        {
            "id": name, "object": "model", "created": now_s(), "owned_by": "pagedserve",
            "root": ctx.model_path, "parent": None, "max_model_len": ctx.engine.max_model_len,
        }
        for name in ctx.model_names
    ]
    data += [
        {
            "id": name, "object": "model", "created": now_s(), "owned_by": "pagedserve",
            "root": lora.lora_path, "parent": ctx.model_names[0], "max_model_len": ctx.engine.max_model_len,
        }
        for name, lora in ctx.loras.adapters.items()
    ]
    return JSONResponse({"object": "list", "data": data})


@v1.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> JSONResponse:
    return JSONResponse(await load_adapter(get_ctx(request), body))


@v1.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> JSONResponse:
    return JSONResponse(await unload_adapter(get_ctx(request), body))


@root.get("/health")
async def health(request: Request) -> Response:
    problem = get_ctx(request).engine.health()
    if problem is not None:
        return JSONResponse(error_body(503, problem), status_code=503)
    return Response(status_code=200)


@root.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    body = ctx.metrics.render(ctx.engine.stats, ctx.engine.num_waiting)
    return Response(body, media_type=CONTENT_TYPE)


@root.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    ctx.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        tokens = render_chat(ctx, body)
    else:
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return JSONResponse({"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens})


@root.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    ctx.resolve_model(body.model)
    vocab = ctx.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})


@root.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


def build_app(ctx: ServerContext) -> FastAPI:
    """The ASGI app; starting it starts the engine thread, stopping it aborts in-flight requests."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            # Reached after uvicorn stopped accepting and waited (--shutdown-timeout) for
            # in-flight requests; whatever is still running is aborted here.
            await ctx.engine.shutdown()

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(root)
    return app
