"""The FastAPI app: OpenAI-style completions, scoring, classification, health, readiness, metrics.

    request -> Gate (metrics, body size, content type, bearer token) -> FastAPI validation (strict
    schemas) -> handler (model, prompt and token limits; encode) -> Batcher queue -> the model's own
    thread -> Engine -> future / token stream -> JSON or server-sent events

The model loads (and runs one warm-up batch) after the server starts listening, so /healthz answers
at once and /readyz says 503 until the model can serve. Every refusal is an `ApiError`, turned into
its status and JSON body in one handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.runtime.engine import Completion, Engine, EngineError, SamplingParams
from moeserve.serve.batcher import BatchConfig, Batcher, Closed, DeadlineExceeded, Job, QueueFull
from moeserve.serve.continuous import StepBatcher
from moeserve.serve.gate import Gate
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import (ERROR_RESPONSES, ApiError, ClassifyItem,
                                     ClassifyResponse, CompletionChoice, CompletionRequest, CompletionResponse,
                                     ModelCard, ModelList, ScoreItem, ScoreResponse, StreamOptions, TextsRequest,
                                     Usage)
from moeserve.serve.stream import TextStream

log = logging.getLogger("moeserve.serve")
API_KEY_ENV = "MOESERVE_API_KEY"
MAX_STOP = 4  # stop strings per request, as OpenAI
SCHEDULERS = ("continuous", "batch")
OBJECT_FIELDS = {"stream_options": set(StreamOptions.model_fields)}  # request fields whose value is an object


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: a model server is not a public service by default
    port: int = 8000
    model_name: str | None = None  # the id clients send as `model` (default: the checkpoint's directory name)
    api_key: str | None = None  # bearer token required on /v1/* (default: $MOESERVE_API_KEY, else none)
    batch: BatchConfig = field(default_factory=BatchConfig)
    request_timeout_s: float = 60.0  # arrival to last token; past it, 504 and the work is dropped
    max_body_bytes: int = 1 << 20  # 413 past this
    body_timeout_s: float = 10.0  # a body that has not all arrived this long after its last part: 408
    max_inputs: int = 32  # prompts or texts per request
    max_tokens: int | None = None  # largest max_tokens accepted (default: the model's context)
    expert_metrics: bool | None = None  # per-(layer, expert) series; None: on unless layers x experts > 4096
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    threads: int | None = None  # torch threads of the model (default: torch's, one per core)
    scheduler: str = "continuous"  # continuous: requests join running steps; batch: run-to-completion batches
    kv_slots: int = 8  # continuous: sequences generating at once (cache slots of the model's context each)
    prefill_chunk: int = 256  # continuous: prompt tokens per step while others are generating

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        for name in ("request_timeout_s", "max_body_bytes", "max_inputs", "shutdown_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected a positive number")
        b = self.batch
        for name in ("max_batch_size", "max_batch_tokens", "max_queue"):
            if isinstance(getattr(b, name), bool) or not isinstance(getattr(b, name), int) or getattr(b, name) < 1:
                raise ValueError(f"{name} = {getattr(b, name)!r}: expected an integer >= 1")
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens = {self.max_tokens!r}: expected an integer >= 1 or None")
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(f"threads = {self.threads!r}: expected an integer >= 1 or None")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port = {self.port!r}: expected 0..65535")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler = {self.scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
        for name in ("kv_slots", "prefill_chunk"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected an integer >= 1")
        if not b.wait_s >= 0:
            raise ValueError(f"batch wait = {b.wait_s!r}: expected a number of seconds >= 0")


class ServerState:
    """What the handlers share: the engine once loaded, its batcher, and the lifecycle flags."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.name = cfg.model_name or "model"
        self.created = int(time.time())
        self.on_fatal: Callable[[], None] | None = None  # the server's exit, called if the model fails to load
        self._thread: threading.Thread | None = None

    def start(self, source: Engine | Callable[[], Engine]) -> None:
        """Start the one thread that owns the model: it loads it (given a loader), warms it up, then runs
        the batcher. One thread for all model work, because each thread that runs torch ops gets its own
        OpenMP team, and a second team spinning beside the first makes both slower (2.5x measured)."""
        self._thread = threading.Thread(target=self._own_model, args=(source,), name="moeserve-model", daemon=True)
        self._thread.start()

    def _own_model(self, source: Engine | Callable[[], Engine]) -> None:
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        try:
            engine = source if isinstance(source, Engine) else source()
            self.name = self.cfg.model_name or engine.name
            self.metrics.watch_experts(lambda: self.engine.expert_load if self.engine else None,
                                       engine.cfg.moe_layer_ids, engine.cfg.n_experts, self.cfg.expert_metrics)
            self._warm_up(engine)
            self.engine = engine
            self.batcher = self._batcher(engine)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("moeserve: the model failed to load: %s", self.load_error)
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.ready = True
        self.metrics.ready.set(1)
        log.info("moeserve: %s is ready", self.name)
        self.batcher.run()

    def _batcher(self, engine: Engine) -> Batcher:
        """The continuous scheduler for a language model, unless the run-to-completion one was asked for (or
        the model generates nothing: a classifier's requests are whole batches either way)."""
        cfg = self.cfg
        if cfg.scheduler == "continuous" and engine.cfg.task == "lm":
            log.info("moeserve: continuous batching over %d cache slots of %d positions", cfg.kv_slots,
                     engine.cfg.max_seq_len)
            return StepBatcher(engine, cfg.batch, self.metrics, slots=cfg.kv_slots, prefill_chunk=cfg.prefill_chunk)
        return Batcher(engine, cfg.batch, self.metrics)

    def stop(self, timeout: float) -> None:
        self.draining = True
        if self.batcher is not None:
            self.batcher.close()
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def _warm_up(engine: Engine) -> None:
        """One batch of each kind the model serves, so the first request does not pay for first-call
        allocations; its expert load is not traffic and is reset."""
        bos = [engine.tokenizer.bos_id] if engine.tokenizer is not None and engine.tokenizer.bos_id is not None else []
        rows = [bos + [1, 2, 3], bos + [4]]
        if engine.cfg.task == "lm":
            if engine.tokenizer is not None:  # complete_ids decodes text
                engine.complete_ids(rows, [SamplingParams(max_new_tokens=2)] * 2)
            engine.score_ids(rows)
        else:
            engine.classify_ids(rows)
        engine.expert_load.reset()

    def require_ready(self) -> Engine:
        if self.draining:
            raise ApiError("shutting_down", "the server is shutting down", headers={"Retry-After": "5"})
        if not self.ready:
            msg = f"the model failed to load ({self.load_error})" if self.load_error else "the model is still loading"
            raise ApiError("not_ready", msg, headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError("model_not_found", f"model {model!r} is not served here; this server serves "
                           f"{self.name!r}", param="model")

    def submit(self, job: Job):
        try:
            return self.batcher.submit(job)
        except QueueFull as e:
            raise ApiError("queue_full", str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
        except Closed as e:
            raise ApiError("shutting_down", str(e)) from e

    def admission(self) -> ApiError | None:
        """The refusal a model request would get now whatever its body says (shutting down, not ready, queue
        full), so that the gate can answer it before reading the body."""
        try:
            self.require_ready()
            self.batcher.check_room()
        except ApiError as e:
            return e
        except QueueFull as e:
            return ApiError("queue_full", str(e), headers={"Retry-After": str(e.retry_after_s)})
        except Closed as e:
            return ApiError("shutting_down", str(e))
        return None


# ---- request checks that need the model ------------------------------------------------------------
def _inputs(value, field: str, cfg: ServeConfig) -> list:
    """A single input or a list of them -> a non-empty list within the per-request limit."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not items:
        raise ApiError("invalid_value", f"{field} is an empty list", param=field)
    if len(items) > cfg.max_inputs:
        raise ApiError("invalid_value", f"{field} has {len(items)} entries; at most {cfg.max_inputs} per request",
                       param=field, limit=cfg.max_inputs)
    return items


def _check_unicode(text: str, field: str) -> None:
    """JSON may escape a lone surrogate ("\\ud800"): a str that is no UTF-8 text, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError("invalid_value", f"{field} is not valid Unicode: a lone surrogate "
                       f"U+{ord(text[e.start]):04X} at character {e.start}", param=field) from None


def _encode(engine: Engine, item: str | list[int], field: str, max_len: int) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise ApiError("invalid_value", f"{field} is empty", param=field)
        if engine.tokenizer is None:
            raise ApiError("invalid_value", f"this model has no tokenizer; send {field} as token ids", param=field)
        _check_unicode(item, field)
        ids = engine.tokenizer.encode(item, bos=True)
    else:
        ids, V = item, engine.cfg.vocab_size
        if not ids:
            raise ApiError("invalid_value", f"{field} has no token ids", param=field)
        if any(t < 0 or t >= V for t in ids):
            raise ApiError("invalid_value", f"{field} has a token id outside [0, {V})", param=field, limit=V - 1)
    if len(ids) > max_len:
        raise ApiError("invalid_value", f"{field} is {len(ids)} tokens; at most {max_len} fit this model's context "
                       f"of {engine.cfg.max_seq_len}", param=field, limit=max_len)
    return ids


def _sampling(req: CompletionRequest, prompt_len: int, engine: Engine, cfg: ServeConfig) -> SamplingParams:
    ctx = engine.cfg.max_seq_len
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    limit = min(cfg.max_tokens or ctx, ctx - prompt_len)
    if max_tokens > limit:
        why = (f"the prompt's {prompt_len} tokens leave {ctx - prompt_len} of the context of {ctx}"
               if limit == ctx - prompt_len else "the server's limit")
        raise ApiError("invalid_value", f"max_tokens = {max_tokens} is more than {limit} ({why})",
                       param="max_tokens", limit=limit)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError("invalid_value", f"stop has {len(stop)} strings; at most {MAX_STOP}", param="stop",
                       limit=MAX_STOP)
    if any(not s for s in stop):
        raise ApiError("invalid_value", "stop strings must not be empty", param="stop")
    for s in stop:  # a stop string that is no text could never match
        _check_unicode(s, "stop")
    return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                          top_p=None if req.top_p >= 1 else req.top_p, seed=req.seed, stop=stop)


# ---- waiting for results ---------------------------------------------------------------------------
async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result_error(e: BaseException) -> ApiError:
    if isinstance(e, DeadlineExceeded):
        return ApiError("deadline_exceeded", str(e))
    if isinstance(e, Closed):
        return ApiError("shutting_down", str(e))
    if isinstance(e, EngineError):
        return ApiError("invalid_value", str(e))
    log.error("request failed", exc_info=e)
    return ApiError("internal_error", f"the model failed on this request ({type(e).__name__})")


async def _wait(job: Job, request: Request, timeout_s: float):
    """The job's result; 504 at its deadline, and the job is dropped if the client leaves first."""
    result = asyncio.wrap_future(job.future)
    gone = asyncio.create_task(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({result, gone}, timeout=max(0.0, job.deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if result in done:
        if result.exception() is not None:
            raise _result_error(result.exception())
        return result.result()
    job.cancelled = True
    raise ApiError("deadline_exceeded", f"no answer within the server's {timeout_s:g} s request timeout")


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream(job: Job, events: asyncio.Queue, streams: list[TextStream], head: dict,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per text delta, the finish reasons, usage if asked, [DONE].
    A deadline or a failure after the stream started can only be told in the stream: an error event."""
    def chunk(index: int, text: str, finish: str | None) -> bytes:
        return _sse({**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]})

    try:
        while True:
            try:
                item = await asyncio.wait_for(events.get(), timeout=max(0.0, job.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                job.cancelled = True
                raise DeadlineExceeded("no answer within the server's request timeout") from None
            if item is None:  # the job finished
                break
            i, text = item
            if delta := streams[i].push(text):
                yield chunk(i, delta, None)
        if job.future.exception() is not None:
            raise job.future.exception()
        completions: list[Completion] = job.future.result()
        for i, c in enumerate(completions):
            yield chunk(i, streams[i].finish(c.text), c.finish_reason)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(completions)})
        yield _sse("[DONE]")
    except Exception as e:
        yield _sse(_result_error(e).body())
    finally:
        job.cancelled = True  # a no-op once finished; stops the generation if the client left


def _usage(completions: list[Completion]) -> dict:
    p, c = sum(x.prompt_tokens for x in completions), sum(x.completion_tokens for x in completions)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- the app -----------------------------------------------------------------------------------
def create_app(source: Engine | Callable[[], Engine], cfg: ServeConfig | None = None) -> FastAPI:
    """An app serving `source`: a loaded Engine, or a function that loads one (run after start-up)."""
    cfg = cfg or ServeConfig()
    metrics = Metrics()
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
    metrics.queue_depth.set_function(lambda: state.batcher.depth if state.batcher else 0)

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

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return await api_error(request, ApiError("internal_error", f"internal error ({type(e).__name__})"))

    @app.get("/healthz", summary="the process is alive")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="200 once the model is loaded and warmed up; 503 before and while shutting down")
    async def readyz() -> JSONResponse:
        if state.ready and not state.draining:
            return JSONResponse({"status": "ready", "model": state.name})
        status = "draining" if state.draining else "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        engine = state.require_ready()
        c = engine.cfg
        return ModelList(data=[ModelCard(id=state.name, created=state.created, task=c.task, max_model_len=c.max_seq_len,
                                         router=c.router, n_experts=c.n_experts, top_k=c.top_k)])

    @app.post("/v1/completions", response_model=CompletionResponse,
              summary="continue prompts (OpenAI completions; stream=true for server-sent events)",
              responses={200: {"content": {"text/event-stream": {"schema": {
                  "type": "string", "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`"}}}}})
    async def completions(req: CompletionRequest, request: Request):
        engine = state.require_ready()
        state.check_model(req.model)
        if engine.cfg.task != "lm":
            raise ApiError("invalid_value", f"{state.name} is a {engine.cfg.task} model; completions need a "
                           "language model", param="model")
        ctx = engine.cfg.max_seq_len
        rows = [_encode(engine, p, "prompt", ctx - 1) for p in _inputs(req.prompt, "prompt", cfg)]
        params = [_sampling(req, len(r), engine, cfg) for r in rows]
        job = Job("complete", rows, params, deadline=time.monotonic() + cfg.request_timeout_s)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": state.name}
        if not req.stream:
            state.submit(job)
            done: list[Completion] = await _wait(job, request, cfg.request_timeout_s)
            return CompletionResponse(**head, usage=Usage(**_usage(done)), choices=[
                CompletionChoice(text=c.text, index=i, finish_reason=c.finish_reason) for i, c in enumerate(done)])
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job.on_token = lambda i, token, text: loop.call_soon_threadsafe(events.put_nowait, (i, text))
        state.submit(job)
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        streams = [TextStream(p.stop) for p in params]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(job, events, streams, head, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def texts_job(req: TextsRequest, request: Request, kind: str) -> tuple[list[str], list[list[int]], list]:
        engine = state.require_ready()
        state.check_model(req.model)
        wanted = "lm" if kind == "score" else "classify"
        if engine.cfg.task != wanted:
            raise ApiError("invalid_value", f"{state.name} is a {engine.cfg.task} model; /v1/{kind} needs a "
                           f"{wanted} model", param="model")
        texts = _inputs(req.input, "input", cfg)
        rows = [_encode(engine, t, "input", engine.cfg.max_seq_len) for t in texts]
        if kind == "score" and any(len(r) < 2 for r in rows):
            raise ApiError("invalid_value", "an input has no token to score after <bos>", param="input")
        job = Job(kind, rows, deadline=time.monotonic() + cfg.request_timeout_s)
        state.submit(job)
        return texts, rows, await _wait(job, request, cfg.request_timeout_s)

    @app.post("/v1/score", response_model=ScoreResponse,
              summary="log-probability, perplexity and bits per byte of each text under the model")
    async def score(req: TextsRequest, request: Request) -> ScoreResponse:
        texts, rows, results = await texts_job(req, request, "score")
        data = [ScoreItem(index=i, logprob=lp, n_tokens=n, perplexity=math.exp(min(-lp / n, 709.0)),
                          bits_per_byte=-lp / math.log(2) / len(t.encode("utf-8")))
                for i, ((lp, n), t) in enumerate(zip(results, texts))]
        used = sum(len(r) for r in rows)
        return ScoreResponse(model=state.name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))

    @app.post("/v1/classify", response_model=ClassifyResponse, summary="class probabilities of each text")
    async def classify(req: TextsRequest, request: Request) -> ClassifyResponse:
        _, rows, results = await texts_job(req, request, "classify")
        data = [ClassifyItem(index=i, label=max(range(len(p)), key=p.__getitem__), probs=p)
                for i, p in enumerate(results)]
        used = sum(len(r) for r in rows)
        return ClassifyResponse(model=state.name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))

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
