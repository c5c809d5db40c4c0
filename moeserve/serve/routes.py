"""The HTTP handlers: scoring, classification, models, health, readiness, metrics, and what the generation
endpoints (completions.py) share with them: reading inputs, waiting for a job, server-sent events.

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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from moeserve.errors import UserError
from moeserve.runtime.engine import EngineError
from moeserve.runtime.profiling import ProfileStateError
from moeserve.serve.batcher import Closed, DeadlineExceeded, Job, Unavailable
from moeserve.runtime.scores import bits_per_byte
from moeserve.runtime.validate import check_text, check_token_ids, check_unicode
from moeserve.runtime.windows import check_stride
from moeserve.serve.runner import ServedModel
from moeserve.serve.protocol import (ApiError, ClassifyItem, ClassifyResponse, ModelCard, ModelList, ScoreItem,
                                     ScoreRequest, ScoreResponse, TextsRequest, Usage)
from moeserve.serve.state import ServeConfig, ServerState

log = logging.getLogger("moeserve.serve")
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
    """check_unicode, refused as the field's fault."""
    try:
        check_unicode(text, field)
    except EngineError as e:
        raise ApiError("invalid_value", str(e), param=field) from None


def _encode(engine: ServedModel, item: str | list[int], field: str, max_len: int | None) -> list[int]:
    """<bos> + the item's ids (a text, or ids as given), checked; at most `max_len` tokens unless None."""
    if isinstance(item, str):
        try:
            check_text(item, field)
        except EngineError as e:
            raise ApiError("invalid_value", str(e), param=field) from None
        if engine.tokenizer is None:
            raise ApiError("invalid_value", f"this model has no tokenizer; send {field} as token ids", param=field)
        ids = engine.tokenizer.encode(item, bos=True)
    else:
        ids, V = item, engine.cfg.vocab_size
        if not ids:
            raise ApiError("invalid_value", f"{field} has no token ids", param=field)
        try:
            check_token_ids(ids, V, field)
        except EngineError as e:
            raise ApiError("invalid_value", str(e), param=field, limit=V - 1) from None
    if max_len is not None and len(ids) > max_len:
        raise ApiError("invalid_value", f"{field} is {len(ids)} tokens; at most {max_len} fit this model's context "
                       f"of {engine.cfg.max_seq_len}", param=field, limit=max_len)
    return ids


# ---- waiting for results ---------------------------------------------------------------------------
async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result_error(e: BaseException) -> ApiError:
    if isinstance(e, DeadlineExceeded):
        return ApiError("deadline_exceeded", str(e))
    if isinstance(e, Closed):
        return ApiError("shutting_down", str(e))
    if isinstance(e, Unavailable):
        return ApiError("unavailable", str(e), headers={"Retry-After": "1"})
    if isinstance(e, UserError):  # the request's fault (EngineError among them); a bare ValueError is a bug: 500
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


# ---- the handlers ----------------------------------------------------------------------------------
@router.get("/healthz", summary="the process is alive")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="200 once the model is loaded and warmed up; 503 before and while shutting down")
async def readyz(request: Request) -> JSONResponse:
    state = _state(request)
    if state.ready and not state.draining:
        health = getattr(state.runner, "health", None)  # the expert-parallel groups' states (ep_groups.py)
        if health is None:
            return JSONResponse({"status": "ready", "model": state.name})
        groups = health()
        serving = any(g["state"] == "serving" for g in groups)
        return JSONResponse({"status": "ready" if serving else "unavailable", "model": state.name, "groups": groups},
                            status_code=200 if serving else 503)
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


async def _texts_job(req: TextsRequest | ScoreRequest, request: Request,
                     kind: str) -> tuple[list[str], list[list[int]], list]:
    state = _state(request)
    cfg, engine = state.cfg, state.require_ready()
    state.check_model(req.model)
    wanted = "lm" if kind == "score" else "classify"
    if engine.cfg.task != wanted:
        raise ApiError("invalid_value", f"{state.name} is a {engine.cfg.task} model; /v1/{kind} needs a "
                       f"{wanted} model", param="model")
    texts = _inputs(req.input, "input", cfg)
    stride = getattr(req, "stride", None)
    if stride is not None:
        try:
            check_stride(stride, engine.cfg.max_seq_len)
        except UserError as e:
            raise ApiError("invalid_value", str(e), param="stride", limit=engine.cfg.max_seq_len - 1) from None
    # a text longer than the context is scored in windows; classified, it would be cut, so it is refused
    max_len = None if kind == "score" else engine.cfg.max_seq_len
    rows = [_encode(engine, t, "input", max_len) for t in texts]
    if kind == "score" and any(len(r) < 2 for r in rows):
        raise ApiError("invalid_value", "an input has no token to score after <bos>", param="input")
    job = Job(kind, rows, stride=stride, deadline=time.monotonic() + cfg.request_timeout_s)
    state.submit(job, request.scope)
    return texts, rows, await _wait(job, request, cfg.request_timeout_s)


@router.post("/v1/score", response_model=ScoreResponse,
          summary="log-probability, perplexity and bits per byte of each text under the model")
async def score(req: ScoreRequest, request: Request) -> ScoreResponse:
    texts, rows, results = await _texts_job(req, request, "score")
    data = [ScoreItem(index=i, logprob=lp, n_tokens=n, perplexity=math.exp(min(-lp / n, 709.0)),
                      bits_per_byte=bits_per_byte(lp, t), windows=w)
            for i, ((lp, n, w), t) in enumerate(zip(results, texts))]
    used = sum(len(r) for r in rows)
    return ScoreResponse(model=_state(request).name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))


@router.post("/v1/classify", response_model=ClassifyResponse, summary="class probabilities of each text")
async def classify(req: TextsRequest, request: Request) -> ClassifyResponse:
    _, rows, results = await _texts_job(req, request, "classify")
    names = _state(request).require_ready().cfg.labels
    best = [max(range(len(p)), key=p.__getitem__) for p in results]
    data = [ClassifyItem(index=i, label=b, label_name=names[b] if names else None, probs=p)
            for i, (b, p) in enumerate(zip(best, results))]
    used = sum(len(r) for r in rows)
    return ClassifyResponse(model=_state(request).name, data=data, usage=Usage(prompt_tokens=used, total_tokens=used))


# ---- profiling (--profile-dir) ---------------------------------------------------------------------
@router.post("/start_profile", summary="start a torch profiler trace of the model thread's steps (--profile-dir)")
async def start_profile(request: Request) -> dict:
    return await _profile(request, "start")


@router.post("/stop_profile", summary="stop the trace: where it was written, and each step phase's time")
async def stop_profile(request: Request) -> dict:
    return await _profile(request, "stop")


async def _profile(request: Request, action: str) -> dict:
    """Start or stop the profile on the model thread, between two of its turns (torch's profiler records the ops
    of the thread that starts it), and write a stopped one on a worker thread. 404 where the server does not
    profile, 409 for a start while one runs or a stop while none does."""
    state = _state(request)
    state.require_ready()
    batcher = state.batcher
    if batcher is None or batcher.profiler is None:
        why = ("start the server with --profile-dir DIR" if state.cfg.profile_dir is None else
               "this server's model runs in other processes (expert-parallel ranks)")
        raise ApiError("not_found", f"profiling is off: {why}")
    try:
        if action == "start":
            return await asyncio.wrap_future(batcher.call(batcher.profiler.start))
        halted = await asyncio.wrap_future(batcher.call(batcher.profiler.stop))
    except ProfileStateError as e:
        raise ApiError("conflict", str(e)) from None
    except Closed as e:
        raise ApiError("shutting_down", str(e)) from None
    return (await asyncio.to_thread(halted.write)).to_dict()  # not on the model thread: seconds for a GPU trace
