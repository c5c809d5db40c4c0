"""The FastAPI app: the gate, the handlers' router, the error handlers and the model's lifespan.

    request -> Gate (metrics, admission, body size, content type, bearer token) -> FastAPI validation
    (strict schemas) -> handler (routes.py: model, prompt and token limits; encode) -> runner (runner.py): the
    Batcher queue -> the model's own thread -> Engine, or an expert-parallel rank (ep_router.py) -> future /
    token stream -> JSON or server-sent events

The model loads (and runs one warm-up batch) after the server starts listening, so /healthz answers
at once and /readyz says 503 until the model can serve. Every refusal is an `ApiError`, turned into
its status and JSON body in one handler; a `UserError` (the caller's fault) is a 422, and any other
exception, a bare ValueError included, a 500, logged.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.errors import UserError
from moeserve.runtime.engine import Engine
from moeserve.serve.gate import Gate
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import ERROR_RESPONSES, ApiError, StreamOptions
from moeserve.serve.completions import router as generation
from moeserve.serve.routes import router
from moeserve.serve.runner import Runner
from moeserve.serve.state import ServeConfig, ServerState

__all__ = ["ServeConfig", "ServerState", "create_app"]

log = logging.getLogger("moeserve.serve")
OBJECT_FIELDS = {"stream_options": set(StreamOptions.model_fields)}  # request fields whose value is an object


def create_app(source: Engine | Callable[[], Engine | Runner], cfg: ServeConfig | None = None,
               metrics: Metrics | None = None) -> FastAPI:
    """An app serving `source`: a loaded Engine, or a function that loads one (run after start-up), or one that
    returns the runner its requests go to (runner.py: the expert-parallel ranks)."""
    cfg = cfg or ServeConfig()
    metrics = metrics or Metrics()
    state = ServerState(cfg, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start(source)
        yield
        await asyncio.to_thread(state.stop, cfg.shutdown_timeout_s)

    app = FastAPI(title="moeserve", version=_version(), lifespan=lifespan, responses=ERROR_RESPONSES,
                  description="OpenAI-compatible completions, scoring and classification for Mixture-of-Experts "
                  "models, with Prometheus latency and expert-load metrics at /metrics.")
    app.state.serve = state
    app.add_middleware(Gate, state=state)
    metrics.queue_depth.set_function(lambda: state.runner.depth if state.runner else 0)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_value")
        msg = "the body is not valid UTF-8 JSON" if e.status_code == 400 else str(e.detail)
        err = ApiError(code, msg, param="body" if e.status_code == 400 else None)
        err.status = e.status_code
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError) -> JSONResponse:
        """The caller asked for what cannot be done (an EngineError, say): 422 with its message. A bare
        ValueError is no such thing: it is a bug, and `crashed` answers it."""
        return await api_error(request, ApiError("invalid_value", str(e)))

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return await api_error(request, ApiError("internal_error", f"internal error ({type(e).__name__})"))

    app.include_router(generation)
    app.include_router(router)
    return app


def _validation_error(e: RequestValidationError) -> ApiError:
    """Pydantic's first complaint as one ApiError: the field, what was wrong, the limit if there is one."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    loc = loc[1:] if loc[:1] == ["body"] else loc  # FastAPI's prefix only: a field may be named "body" too
    if err.get("type") == "json_invalid":
        return ApiError("invalid_json", f"the body is not valid JSON ({err.get('msg', '')})", param="body")
    if err.get("type") == "missing" and not loc:  # an empty body is no JSON either, as for any other parser
        return ApiError("invalid_json", "the body is empty; expected a JSON object", param="body")
    # a key inside an object field is named by its path ("stream_options.include_usage"), not by the field; the
    # union labels ("list[int]") and list indices pydantic adds after other fields name no field and are left out
    inner = len(loc) > 1 and (err.get("type") == "extra_forbidden" or loc[1] in OBJECT_FIELDS.get(loc[0], ()))
    param = ".".join(loc[:2]) if inner else loc[0] if loc else "body"
    if loc[:1] == ["messages"] and len(loc) > 2 and loc[1].isdigit():  # the message and its field: messages[2].role
        param = f"messages[{loc[1]}].{loc[2]}"
    ctx = err.get("ctx") or {}
    limit = next((v for k, v in ctx.items() if k in ("ge", "gt", "le", "lt", "max_length", "min_length")), None)
    if err.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif err.get("type") == "missing":
        msg = f"{param} is required"
    elif param == "body":
        msg = "the body must be a JSON object"
    else:
        msg = f"{param}: {err.get('msg', 'invalid value')}"
    return ApiError("invalid_value", msg, param=param, limit=limit if isinstance(limit, (int, float, str)) else None)


def _version() -> str:
    from moeserve import __version__

    return __version__
