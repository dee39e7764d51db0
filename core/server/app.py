"""The FastAPI application: routes, API-key check, and every error in OpenAI's shape."""

from __future__ import annotations

import hmac
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from candelabra.core.server.chat_page import add_chat_page
from candelabra.core.server.embeddings import create_embeddings
from candelabra.core.server.errors import ERROR_TYPES, APIError, error_body
from candelabra.core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from candelabra.core.server.serving import ServedModel, chat_completion, completion
from candelabra.core.server.tokenize_routes import detokenize, tokenize

log = logging.getLogger("candelabra")


def build_app(served: ServedModel, api_key: str | None = None, chat_page: bool = False,
              embedding_pooling: str = "mean") -> FastAPI:
    """The server for `served`; with `api_key`, every /v1 route (and /tokenize, /detokenize) wants
    `Authorization: Bearer KEY`; with `chat_page`, the web chat page is at `/`; `embedding_pooling`
    ("mean" or "last") is how /v1/embeddings pools where a request does not say."""
    app = FastAPI(title="candelabra", summary="OpenAI-compatible LLM server")
    _install_error_handlers(app)
    authorized = Depends(_key_check(api_key))

    @app.get("/health")
    async def health() -> Response:
        if served.engine.failure is not None:
            return JSONResponse({"status": "engine failed", "reason": served.engine.failure}, status_code=503)
        if not served.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[authorized])
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model:path}", dependencies=[authorized])
    async def model(model: str) -> dict:
        if model != served.name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {served.name!r}", "model",
                           "model_not_found")
        return _model_card(served)

    @app.post("/v1/chat/completions", dependencies=[authorized])
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_completion(served, body, request)

    @app.post("/v1/completions", dependencies=[authorized])
    async def completions(body: CompletionRequest, request: Request):
        return await completion(served, body, request)

    @app.post("/v1/embeddings", dependencies=[authorized])
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await create_embeddings(served, body, request, embedding_pooling)

    @app.post("/tokenize", dependencies=[authorized])
    async def tokenize_route(body: TokenizeRequest) -> dict:
        return tokenize(served, body)

    @app.post("/detokenize", dependencies=[authorized])
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        return detokenize(served, body)

    if chat_page:
        add_chat_page(app)
    return app


def _model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "candelabra",
            "max_model_len": served.max_model_len}


def _key_check(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    return check


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), ERROR_TYPES.get(exc.status_code, "invalid_request_error")),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                            status_code=500)


def _describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message for pydantic's errors, naming the field."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "is required"
    elif "input" in first and first.get("type") not in ("value_error",):
        message = f"{message} (got {first['input']!r})"
    text = f"{param}: {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text, param
