"""The FastAPI application: routes, API-key check, OpenAI-shaped errors. Lesson 07 explains it.

    GET  /v1/models             the served model name(s)                        (API key)
    POST /v1/completions        prompt -> text, or a server-sent event stream   (API key)
    POST /v1/chat/completions   messages -> reply, through the chat template    (API key)
    GET  /health                200 while the engine thread runs, else 503     (open)
    GET  /metrics               Prometheus text format (metrics.py)            (open)
    GET  /docs, /openapi.json   Swagger UI and the schema FastAPI derives from protocol.py

With an API key (`minipaged serve --api-key KEY`, or $MINIPAGED_API_KEY) every /v1 route wants
`Authorization: Bearer KEY` and answers 401 otherwise; the comparison uses
`hmac.compare_digest` (its time does not depend on how many characters matched). /health and
/metrics stay open, as in vLLM, so load balancers and Prometheus need no key.

Every error, whatever raised it, leaves in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: bad JSON or a bad field is a 400 (FastAPI would
say 422; OpenAI and vLLM say 400), an unknown model a 404, a prompt longer than max_model_len a
400 whose message has the numbers. A failing request never disturbs the others.
"""
from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import minipaged
from minipaged.server.async_engine import AsyncLLMEngine
from minipaged.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionRequest, CompletionResponse, ErrorResponse,
                                       ModelCard, ModelList)
from minipaged.server.reasoning import ThinkTagReasoningParser
from minipaged.server.serving import OpenAIError, OpenAIServing

ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
          404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('msg')}", None
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], *,
              api_key: Optional[str] = None, chat_template: Optional[str] = None,
              reasoning_parser: Optional[type[ThinkTagReasoningParser]] = None,
              model_root: Optional[str] = None) -> FastAPI:
    """An app around an `AsyncLLMEngine`; it starts the engine thread on startup and stops it on
    shutdown. `app.state.engine` is the `AsyncLLMEngine` (its `.engine` the `LLMEngine`)."""
    serving = OpenAIServing(engine, served_model_names, chat_template, reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="minipaged", version=minipaged.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server for minipaged, a small vLLM-style "
                              "engine. Lesson 07 (notebooks/07_serving.ipynb) walks through it.")
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = engine.metrics

    # --- errors, all in OpenAI's shape ------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return OpenAIError(message, 400, param=param).response()

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
        return ModelList(data=[ModelCard(id=name, root=model_root,
                                         max_model_len=serving.max_model_len)
                               for name in served_model_names])

    @v1.post("/completions", response_model=CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def create_completion(body: CompletionRequest, request: Request):
        """Text completion. With `"stream": true` the answer is a stream of server-sent events,
        one `data: {...}` per generated token, ending with `data: [DONE]`."""
        return await serving.create_completion(body, request)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        """Chat: the messages go through the chat template (the tokenizer's, or --chat-template),
        then the engine generates as for a completion."""
        return await serving.create_chat_completion(body, request)

    app.include_router(v1)

    # --- open routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread is running (for load balancers), 503 otherwise."""
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (see minipaged/server/metrics.py for the list)."""
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
