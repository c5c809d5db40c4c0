"""The HTTP handlers: OpenAI-style completions, scoring, classification, health, readiness, metrics.

Module-level, on one APIRouter, each reading the server's state from `request.app.state.serve`
(state.py), so that they can be imported and addressed on their own. The checks here are those that
need the model (its context, tokenizer and task); the schemas (protocol.py) and the gate (gate.py)
have refused everything else before a handler runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from moeserve.runtime.engine import Completion, Engine, EngineError, SamplingParams
from moeserve.serve.batcher import Closed, DeadlineExceeded, Job
from moeserve.serve.protocol import (ApiError, ClassifyItem, ClassifyResponse, CompletionChoice, CompletionRequest,
                                     CompletionResponse, ModelCard, ModelList, ScoreItem, ScoreResponse, TextsRequest,
                                     Usage)
from moeserve.serve.state import ServeConfig, ServerState
from moeserve.serve.stream import TextStream

log = logging.getLogger("moeserve.serve")
MAX_STOP = 4  # stop strings per request, as OpenAI
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.serve


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


# ---- the handlers ----------------------------------------------------------------------------------
@router.get("/healthz", summary="the process is alive")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="200 once the model is loaded and warmed up; 503 before and while shutting down")
async def readyz(request: Request) -> JSONResponse:
    state = _state(request)
    if state.ready and not state.draining:
        return JSONResponse({"status": "ready", "model": state.name})
    status = "draining" if state.draining else "failed" if state.load_error else "loading"
    return JSONResponse({"status": status, "error": state.load_error}, status_code=503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def prometheus(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    state = _state(request)
    engine = state.require_ready()
    c = engine.cfg
    return ModelList(data=[ModelCard(id=state.name, created=state.created, task=c.task, max_model_len=c.max_seq_len,
                                     router=c.router, n_experts=c.n_experts, top_k=c.top_k)])


@router.post("/v1/completions", response_model=CompletionResponse,
          summary="continue prompts (OpenAI completions; stream=true for server-sent events)",
          responses={200: {"content": {"text/event-stream": {"schema": {
              "type": "string", "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`"}}}}})
async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    cfg, engine = state.cfg, state.require_ready()
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


async def _texts_job(req: TextsRequest, request: Request, kind: str) -> tuple[list[str], list[list[int]], list]:
    state = _state(request)
    cfg, engine = state.cfg, state.require_ready()
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


@router.post("/v1/score", response_model=ScoreResponse,
          summary="log-probability, perplexity and bits per byte of each text under the model")
async def score(req: TextsRequest, request: Request) -> ScoreResponse:
    texts, rows, results = await _texts_job(req, request, "score")
    data = [ScoreItem(index=i, logprob=lp, n_tokens=n, perplexity=math.exp(min(-lp / n, 709.0)),
                      bits_per_byte=-lp / math.log(2) / len(t.encode("utf-8")))
            for i, ((lp, n), t) in enumerate(zip(results, texts))]
    used = sum(len(r) for r in rows)
    return ScoreResponse(model=_state(request).name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))


@router.post("/v1/classify", response_model=ClassifyResponse, summary="class probabilities of each text")
async def classify(req: TextsRequest, request: Request) -> ClassifyResponse:
    _, rows, results = await _texts_job(req, request, "classify")
    data = [ClassifyItem(index=i, label=max(range(len(p)), key=p.__getitem__), probs=p)
            for i, p in enumerate(results)]
    used = sum(len(r) for r in rows)
    return ClassifyResponse(model=_state(request).name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))
