"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine.

    /v1/completions /v1/chat/completions /v1/embeddings /v1/models
    /v1/responses /v1/responses/{id}  /v1/messages /v1/messages/count_tokens
    /tokenize /detokenize /load /metrics /v1/stats      (the key, when an API key is set)
    /health /ping /version  /  /playground/...  /docs   (public: no work, no data)

With --api-key every route that does work or tells something about the server needs the key
(`Authorization: Bearer <key>` or `x-api-key: <key>`); --public-metrics opens /metrics alone
to an unauthenticated scraper.

Life of a request: pydantic parses the body (errors -> 400), its undeclared fields meet the
field rule (request_fields.py: refused, accepted, or logged), the handler checks the model,
the input processor (engine/input_processor.py, in the tokenize worker) tokenizes and
validates each prompt into one engine request carrying the call's n / best_of, added as one
group; then the handler streams SSE chunks or collects the group while polling for a client
disconnect. Leaving early (disconnect, error, shutdown) aborts the group's requests.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedserve import __version__
from pagedserve.server.docs import install_docs
from pagedserve.server.errors import APIError, error_body, install_error_handlers
from pagedserve.server.limits import BodyLimit, default_body_limit
from pagedserve.server.lora_admin import (
    LoadLoRARequest,
    UnloadLoRARequest,
    load_adapter,
    unload_adapter,
)
from pagedserve.server.metrics import CONTENT_TYPE
from pagedserve.server.playground import install_playground
from pagedserve.server.protocol import (
    MAX_LOGPROBS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    now_s,
)
from pagedserve.server.protocol_messages import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from pagedserve.server.protocol_responses import ResponsesRequest
from pagedserve.server.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from pagedserve.server.serving_chat import create_chat_completion, render_chat
from pagedserve.server.serving_common import ServerContext
from pagedserve.server.serving_completion import create_completion
from pagedserve.server.serving_embedding import create_embedding
from pagedserve.server.serving_messages import AnthropicRoute, count_tokens, create_message
from pagedserve.server.serving_responses import create_response, retrieve

logger = logging.getLogger(__name__)

def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: the error envelope for each status a route can answer."""
    why = {
        400: "Invalid request: the error's `param` names the field",
        401: "Missing or wrong API key (when the server has one)",
        404: "Unknown model or adapter",
        500: "The request failed in the engine (the engine keeps serving others)",
        503: "Overloaded (with Retry-After), shutting down, or the engine is not running",
    }
    return {status: {"model": ErrorResponse, "description": why[status]} for status in statuses}


def _streamed(model: type, chunk: type) -> dict[int | str, dict[str, Any]]:
    sse = {"schema": {"type": "string", "description": f"server-sent events: `data: <{chunk.__name__}>` lines, "
                                                       "then `data: [DONE]`"}}
    return {200: {"model": model, "description": "The result, or an SSE stream with stream=true",
                  "content": {"text/event-stream": sse}}}


def _events(names: str) -> dict[int | str, dict[str, Any]]:
    """A route answering a JSON object, or with stream=true named SSE events (no [DONE])."""
    sse = {"schema": {"type": "string", "description": f"server-sent events `event: <type>` / `data: <json>`: {names}"}}
    return {200: {"description": "The result, or an SSE stream with stream=true",
                  "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": sse}}}


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def checked_ctx(request: Request, body: BaseModel) -> ServerContext:
    """The context, once the body's undeclared fields pass the field rule (request_fields.py)
    and its logprobs the server's --max-logprobs."""
    ctx = get_ctx(request)
    ctx.request_fields.check(body)
    check_max_logprobs(body, request.app.state.http_options.max_logprobs)
    return ctx


def check_max_logprobs(body: BaseModel, limit: int) -> None:
    """vLLM's --max-logprobs: a request for more (sampled or prompt) logprobs is a 400 naming
    the field; -1: no limit but the schema's (MAX_LOGPROBS)."""
    if limit < 0:
        return
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(body, name, None)
        if type(value) is int and value > limit:  # chat's `logprobs` is a bool: its count is top_logprobs
            raise APIError(400, f"{name}: {value} logprobs were requested; this server returns at most {limit} "
                           "(--max-logprobs)", name)


def check_api_key(request: Request) -> None:
    """The key as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
    (Anthropic's); constant-time comparison so the key cannot be timed out."""
    key = get_ctx(request).api_key
    if key is None:
        return
    keys = [key] if isinstance(key, str) else key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [token.strip().encode()] if scheme.lower() == "bearer" else []
    if "x-api-key" in request.headers:
        given.append(request.headers["x-api-key"].strip().encode())
    # Every key is compared (no early exit), so timing says nothing about which one matched.
    matches = [hmac.compare_digest(g, k.encode()) for g in given for k in keys]
    if not any(matches):
        raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                       None, "invalid_api_key")


def check_metrics_key(request: Request) -> None:
    """/metrics needs the key unless the server was started with --public-metrics."""
    if not request.app.state.http_options.public_metrics:
        check_api_key(request)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
# Routes outside /v1 that do work (tokenizing) or tell about the server's load: the key too.
keyed = APIRouter(dependencies=[Depends(check_api_key)])
root = APIRouter()

GENERATE_ERRORS = _errors(400, 401, 404, 500, 503)


@v1.post("/completions", responses={**_streamed(CompletionResponse, CompletionResponse), **GENERATE_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(checked_ctx(request, body), body, request)


@v1.post("/embeddings", responses={200: {"model": EmbeddingResponse}, **GENERATE_ERRORS})
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await create_embedding(checked_ctx(request, body), body, request)


@v1.post("/chat/completions", responses={**_streamed(ChatCompletionResponse, ChatCompletionChunk), **GENERATE_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(checked_ctx(request, body), body, request)


@v1.post("/responses", responses={**_events("response.*"), **GENERATE_ERRORS})
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API (serving_responses.py), served by the chat pipeline."""
    return await create_response(checked_ctx(request, body), request.app.state.response_store, body, request)


@v1.get("/responses/{response_id}", responses=_errors(401, 404))
async def get_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(retrieve(request.app.state.response_store, response_id))


# Anthropic's Messages API: its errors in Anthropic's shape (AnthropicRoute).
anthropic = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)], route_class=AnthropicRoute)
ANTHROPIC_ERRORS = {status: {**spec, "model": AnthropicErrorResponse} for status, spec in GENERATE_ERRORS.items()}


@anthropic.post("/messages", responses={**_events("message_start ... message_stop"), **ANTHROPIC_ERRORS})
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Anthropic's Messages API (serving_messages.py), served by the chat pipeline."""
    return await create_message(checked_ctx(request, body), body, request)


@anthropic.post("/messages/count_tokens", responses={200: {"model": CountTokensResponse}, **ANTHROPIC_ERRORS})
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    return await count_tokens(checked_ctx(request, body), body)


@v1.get("/models", responses=_errors(401))
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
            "root": lora.lora_path, "parent": lora.base_model_name or ctx.model_names[0], "max_model_len": ctx.engine.max_model_len,
        }
        for name, lora in ctx.loras.adapters.items()
    ]
    return JSONResponse({"object": "list", "data": data})


@v1.get("/models/{model_id}", responses=_errors(401, 404))
async def model_card(model_id: str, request: Request) -> JSONResponse:
    """One entry of /v1/models (OpenAI's retrieve-model call); 404 for an unknown id."""
    listing = json.loads(bytes((await models(request)).body))
    for card in listing["data"]:
        if card["id"] == model_id:
            return JSONResponse(card)
    raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")


@v1.post("/load_lora_adapter", responses=_errors(400, 401, 404, 503))
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> JSONResponse:
    return JSONResponse(await load_adapter(checked_ctx(request, body), body))


@v1.post("/unload_lora_adapter", responses=_errors(400, 401, 404, 503))
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> JSONResponse:
    return JSONResponse(await unload_adapter(checked_ctx(request, body), body))


@root.get("/health", response_class=Response,
          responses={200: {"description": "Healthy (empty body)", "content": {}}, **_errors(503)})
async def health(request: Request) -> Response:
    problem = get_ctx(request).engine.health()
    if problem is not None:
        return JSONResponse(error_body(503, problem), status_code=503)
    return Response(status_code=200)


@root.api_route("/ping", methods=["GET", "POST"], response_class=Response,
                responses={200: {"description": "Healthy (empty body)", "content": {}}, **_errors(503)})
async def ping(request: Request) -> Response:
    """vLLM's /ping (SageMaker's health check): the same answer as /health."""
    return await health(request)


@keyed.get("/load", responses=_errors(401))
async def load(request: Request) -> JSONResponse:
    """vLLM's /load: generation requests the server is handling now (streams until their end)."""
    return JSONResponse({"server_load": request.app.state.server_load.value})


@root.get("/metrics", response_class=Response, dependencies=[Depends(check_metrics_key)],
          responses={**_errors(401), 200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    body = ctx.metrics.render(ctx.engine.stats, ctx.engine.num_waiting)
    return Response(body, media_type=CONTENT_TYPE)


@keyed.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_errors(400, 401, 404)})
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = checked_ctx(request, body)
    ctx.resolve_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        _, tokens = await render_chat(ctx, body)
    else:
        processor, text = ctx.processor, body.prompt
        tokens = await ctx.process_off_loop(body, lambda: processor.encode(text, "prompt", body.add_special_tokens))
    return JSONResponse({"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens})


@keyed.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_errors(400, 401, 404)})
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    ctx = checked_ctx(request, body)
    ctx.resolve_model(body.model)
    vocab = ctx.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": await ctx.off_loop(ctx.tokenizer.decode, body.tokens)})


@root.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


def _request_middleware(options: HTTPOptions) -> Any:
    """X-Request-Id (the client's, or a new one) and/or one log line per request."""

    async def middleware(request: Request, call_next: Any) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        if options.request_id_headers:
            response.headers["X-Request-Id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
        if options.log_requests:
            logger.info("%s %s -> %d in %.1f ms", request.method, request.url.path, response.status_code,
                        (time.perf_counter() - start) * 1e3)
        return response

    return middleware


class ServerLoad:
    """vLLM's server load: HTTP generation requests from arrival until their response (a
    stream: its last byte) has been sent."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")

    def __init__(self) -> None:
        self.value = 0


class _LoadTracking:
    """Plain ASGI middleware, so a streaming body counts while it streams."""

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].endswith(ServerLoad.PATHS):
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


class _App(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """The document, less FastAPI's automatic 422 (this server answers 400 instead)."""
        if self.openapi_schema is None:
            doc = get_openapi(title=self.title, version=self.version, routes=self.routes)
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            self.openapi_schema = doc
        return self.openapi_schema


@dataclass(frozen=True)
class HTTPOptions:
    """How the app speaks HTTP (vLLM's frontend flags); the defaults are vLLM's."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    request_id_headers: bool = False  # X-Request-Id on every response
    root_path: str | None = None
    docs: bool = True  # /docs, /redoc, /openapi.json
    log_requests: bool = False
    public_metrics: bool = False  # /metrics without the API key (for a scraper that has none)
    # Request bodies past this many bytes are a 413 (None: limits.default_body_limit).
    max_request_body_bytes: int | None = None
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES  # /v1/responses' store
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs (-1: no limit but the schema's)

    @classmethod
    def from_cli_args(cls, args: Any) -> HTTPOptions:
        return cls(
            allowed_origins=tuple(getattr(args, "allowed_origins", ["*"])),
            allowed_methods=tuple(getattr(args, "allowed_methods", ["*"])),
            allowed_headers=tuple(getattr(args, "allowed_headers", ["*"])),
            allow_credentials=getattr(args, "allow_credentials", False),
            request_id_headers=getattr(args, "enable_request_id_headers", False),
            root_path=getattr(args, "root_path", None),
            docs=not getattr(args, "disable_fastapi_docs", False),
            log_requests=getattr(args, "enable_log_requests", False),
            public_metrics=getattr(args, "public_metrics", False),
            max_request_body_bytes=getattr(args, "max_request_body_bytes", None),
            max_stored_responses=getattr(args, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES),
            max_logprobs=getattr(args, "max_logprobs", MAX_LOGPROBS),
        )


def build_app(ctx: ServerContext, options: HTTPOptions | None = None) -> FastAPI:
    """The ASGI app; starting it starts the engine thread, stopping it aborts in-flight requests."""
    options = options or HTTPOptions()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            # Reached after uvicorn stopped accepting and waited (--shutdown-timeout) for
            # in-flight requests; whatever is still running is aborted here.
            await ctx.engine.shutdown()
            ctx.tokenize_pool.shutdown(wait=False)

    app = _App(
        title="pagedserve", version=__version__, lifespan=lifespan, root_path=options.root_path or "",
        docs_url=None, redoc_url=None, openapi_url="/openapi.json" if options.docs else None,
    )
    if options.docs:
        install_docs(app)
    app.state.ctx = ctx
    app.state.http_options = options
    app.state.response_store = ResponseStore(options.max_stored_responses)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers), allow_credentials=options.allow_credentials,
    )
    if options.request_id_headers or options.log_requests:
        app.middleware("http")(_request_middleware(options))
    app.state.server_load = ServerLoad()
    app.add_middleware(_LoadTracking, load=app.state.server_load)
    body_limit = options.max_request_body_bytes or default_body_limit(ctx.processor.char_limit)
    app.add_middleware(BodyLimit, max_bytes=body_limit)  # added last: the outermost
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(anthropic)
    app.include_router(keyed)
    app.include_router(root)
    install_playground(app, check_api_key)
    return app
