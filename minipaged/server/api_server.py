"""The FastAPI application: routes, API-key check, limits, OpenAI-shaped errors. Lesson 07
explains it.

    GET  /v1/models             the served model name(s) and LoRA adapters      (API key)
    POST /v1/completions        prompt -> text, or a server-sent event stream   (API key)
    POST /v1/chat/completions   messages -> reply, through the chat template    (API key)
    POST /tokenize, /detokenize text <-> token ids with the server's tokenizer  (API key)
    GET  /health                200 while the engine core runs, else 503       (open)
    GET  /metrics               Prometheus text format (metrics.py)            (open)
    GET  /version               minipaged's version                            (open)
    GET  /docs, /openapi.json   Swagger UI and the schema FastAPI derives from protocol.py

With an API key (`minipaged serve --api-key KEY`, or $MINIPAGED_API_KEY) every /v1 route and
/tokenize, /detokenize want `Authorization: Bearer KEY` and answer 401 otherwise; the comparison
uses `hmac.compare_digest` (its time does not depend on how many characters matched). /health,
/metrics and /version stay open, as in vLLM, so load balancers and Prometheus need no key.

A request body larger than `max_request_body_bytes` is refused with a 413 before it is parsed.
Every error, whatever raised it, leaves in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: bad JSON or a bad field is a 400 (FastAPI would
say 422; OpenAI and vLLM say 400), an unknown model a 404, a prompt longer than max_model_len a
400 whose message has the numbers. A failing request never disturbs the others.
"""
from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Optional

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import minipaged
from minipaged.server.async_llm import AsyncLLM
from minipaged.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionRequest, CompletionResponse, DetokenizeRequest,
                                       DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                                       TokenizeRequest, TokenizeResponse)
from minipaged.server.reasoning import ThinkTagReasoningParser
from minipaged.server.serving_chat import OpenAIServingChat
from minipaged.server.serving_completion import OpenAIServingCompletion
from minipaged.server.serving_engine import OpenAIError
from minipaged.server.serving_tokenization import OpenAIServingTokenization

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024

ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
          404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
          503: {"model": ErrorResponse}}


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: a body over `max_bytes` is refused by its Content-Length at once, or, if
    it comes in chunks without one, as soon as the chunks pass the limit (413 either way)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = too_large(int(length), self.max_bytes)
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(received)
            return message
        await self.app(scope, limited_receive, send)


def too_large(size: int, limit: int):
    return OpenAIError(f"the request body has {size:,} bytes{' or more' if size else ''}; this "
                       f"server accepts at most {limit:,} (--max-request-body-bytes)", 413,
                       code="request_too_large").response()


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('msg')}", None
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {str(err.get('msg')).removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts), param


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema, saying what this server answers: a bad body is a 400 in OpenAI's error
    shape (FastAPI would document its own 422, which this server never sends)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        error = {"description": "Bad request (OpenAI's error shape)", "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = error
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(llm: AsyncLLM, served_model_names: list[str], *,
              api_key: Optional[str] = None, chat_template: Optional[str] = None,
              reasoning_parser: Optional[type[ThinkTagReasoningParser]] = None,
              model_root: Optional[str] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              tool_parser=None, lora_requests=()) -> FastAPI:
    """An app around an `AsyncLLM` (whose engine core is already running); it starts reading the
    core's outputs on startup and stops the core on shutdown. `app.state.llm` is the AsyncLLM."""
    args = (llm, served_model_names, chat_template, reasoning_parser)
    completions = OpenAIServingCompletion(*args, lora_requests=lora_requests)
    chat = OpenAIServingChat(*args, tool_parser=tool_parser,  # tool_parsers.py
                             lora_requests=lora_requests)
    tokenization = OpenAIServingTokenization(*args, lora_requests=lora_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        yield
        llm.shutdown()

    # Swagger UI (/docs) and ReDoc (/redoc) from the files fastapi-offline packages, not a CDN:
    # the pages work on a machine without internet access.
    app = FastAPIOffline(title="minipaged", version=minipaged.__version__, lifespan=lifespan,
                         description="An OpenAI-compatible server for minipaged, a small "
                                     "vLLM-style engine. Lesson 07 (notebooks/07_serving.ipynb) "
                                     "walks through it.")
    app.openapi = lambda: openapi_schema(app)
    app.state.llm = llm
    app.state.chat = chat
    app.state.metrics = llm.metrics
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    # --- errors, all in OpenAI's shape ------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return OpenAIError(message, 400, param=param).response()

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return too_large(exc.args[0], max_request_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return OpenAIError(str(exc.detail), exc.status_code,
                           type="invalid_request_error" if exc.status_code < 500
                           else "server_error").response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return OpenAIError(f"internal error: {exc!r}", 500, type="server_error").response()

    # --- API key ----------------------------------------------------------------------------
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key")

    async def check_api_key(creds: Optional[HTTPAuthorizationCredentials] = Depends(bearer)):
        if api_key is None:
            return
        given = creds.credentials if creds is not None else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise OpenAIError("Incorrect or missing API key: send the header "
                              "`Authorization: Bearer <key>` with the server's --api-key.",
                              401, code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)], responses=ERRORS)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [ModelCard(id=name, root=model_root, max_model_len=completions.max_model_len)
                 for name in served_model_names]
        cards += [ModelCard(id=r.lora_name, root=r.lora_path, parent=served_model_names[0],
                            max_model_len=completions.max_model_len) for r in lora_requests]
        return ModelList(data=cards)

    @v1.post("/completions", response_model=CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def create_completion(body: CompletionRequest, request: Request):
        """Text completion. With `"stream": true` the answer is a stream of server-sent events,
        one `data: {...}` per generated token, ending with `data: [DONE]`."""
        return await completions.create_completion(body, request)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        """Chat: the messages go through the chat template (the tokenizer's, or --chat-template),
        then the engine generates as for a completion."""
        return await chat.create_chat_completion(body, request)

    app.include_router(v1)

    tok_routes = APIRouter(dependencies=[Depends(check_api_key)], responses=ERRORS)

    @tok_routes.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt (or chat messages, through the template) to token ids."""
        return await tokenization.tokenize(body)

    @tok_routes.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids to text."""
        return await tokenization.detokenize(body)

    app.include_router(tok_routes)

    # --- open routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """200 while the engine core runs (for load balancers); 503 once it has stopped or the
        server is shutting down."""
        return Response(status_code=200 if llm.is_running and not llm.draining else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (see minipaged/server/metrics.py for the list)."""
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        """minipaged's version (vLLM's /version)."""
        return {"version": minipaged.__version__}

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, plus a drain on SIGTERM/SIGINT: stop accepting connections, let in-flight requests
    finish for `drain_timeout` seconds (new ones on open connections get 503), end the rest with
    an OpenAI-shaped error event and `[DONE]` (or a 503 response), stop the core, exit 0."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, drain_timeout: float):
        super().__init__(config)
        self.llm, self.drain_timeout = llm, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a drained shutdown is a clean exit: do not re-raise

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self.llm.drain(self.drain_timeout))
        await super().shutdown(sockets)  # waits for the connections the drain lets finish
        drain.cancel()
