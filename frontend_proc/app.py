"""HTTP routes of the OpenAI-compatible API (and Anthropic's messages), errors rendered in each one's shape."""

from __future__ import annotations

import json
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.frontend_proc.anthropic_messages import PATH_PREFIX as ANTHROPIC_PATH
from pagedserve.frontend_proc.anthropic_messages import add_anthropic_routes, anthropic_error
from pagedserve.frontend_proc.auth import make_api_key_check
from pagedserve.frontend_proc.embeddings_api import EmbeddingServing, add_embedding_routes, task_refusal
from pagedserve.frontend_proc.early_shed import EarlyShed
from pagedserve.frontend_proc.errors import APIError, InvalidRequest
from pagedserve.frontend_proc.generation import ClientDisconnected
from pagedserve.frontend_proc.lora_routes import add_lora_routes, runtime_updating_allowed
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, CompletionRequest
from pagedserve.frontend_proc.responses_api import add_responses_routes
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving, error_response
from pagedserve.frontend_proc.utility_routes import add_utility_routes

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as one sentence, and the field it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    return message, param


def build_app(serving: Serving, router: Router, metrics: FrontendMetrics,
              api_key: str | None, embeddings: EmbeddingServing | None = None) -> FastAPI:
    """``embeddings``: /v1/embeddings and this deployment's task (None: a generating one without it)."""
    task = "generate" if embeddings is None else embeddings.task
    # FastAPI's own schema of these routes (as vLLM serves it); like /health, no key needed.
    app = FastAPI(title="pagedserve", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    # Without a key there is nothing to check: no dependency for FastAPI to solve per request.
    authorized = [Depends(make_api_key_check(api_key))] if api_key else []
    started = int(time.time())

    def render(request: Request, exc: APIError) -> JSONResponse:
        """Each surface's errors in its own shape: Anthropic's on /v1/messages, else OpenAI's."""
        if request.url.path.startswith(ANTHROPIC_PATH):
            return anthropic_error(exc)
        return error_response(exc)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return render(request, InvalidRequest(message, param=param))

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = APIError(str(exc.detail)).body()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "error"
        return JSONResponse(body, status_code=exc.status_code)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        task_refusal(task, "generate", "/v1/completions")
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        task_refusal(task, "generate", "/v1/chat/completions")
        return await serving.chat(body, request)

    add_responses_routes(app, serving, authorized, task)
    add_anthropic_routes(app, serving, authorized, task)
    if embeddings is not None:
        add_embedding_routes(app, embeddings, authorized)

    add_utility_routes(app, serving, authorized, started)
    if serving.adapters is not None and runtime_updating_allowed():
        add_lora_routes(app, serving.engine, authorized)
    # Outermost but for Starlette's error handler: a 429 under a flood skips routing and the body's
    # validation (early_shed.py).
    app.add_middleware(EarlyShed, router=router, limit=serving.engine.max_waiting_requests, shed=metrics.shed,
                       api_key=api_key, tenant_header=serving.tenant_header)

    @app.get("/health")
    async def health() -> Response:
        live = router.any_live()
        body = {"status": "ok" if live else "unavailable", "scheduling_policy": serving.scheduling_policy,
                "replicas": router.describe(),
                **router.describe_deployment()}
        return Response(json.dumps(body), status_code=200 if live else 503,
                        media_type="application/json")

    @app.get("/metrics", dependencies=authorized)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
