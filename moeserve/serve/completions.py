"""The generation endpoints: OpenAI's /v1/completions and /v1/chat/completions.

Both become the same job: each prompt `best_of` times (choice j samples with seed + j), whose rows
the scheduler runs with one prefill per prompt (runtime/scheduler.py, `share_prefill`). Answers go back as `n`
choices per prompt (the likeliest n of best_of, by mean token log-probability), indexed
prompt * n + j as OpenAI does, whole or as server-sent events. Chat differs only at the edges: the
messages become the prompt through the model's chat template (chat.py), and the answers are messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from moeserve.chat import ChatTemplateError
from moeserve.runtime.engine import Completion, SamplingParams
from moeserve.runtime.sampling import TokenLogprob
from moeserve.runtime.output import StreamEvent
from moeserve.serve.batcher import DeadlineExceeded, Job
from moeserve.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from moeserve.serve.runner import ServedModel
from moeserve.serve.protocol import (ApiError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                     CompletionResponse)
from moeserve.serve.routes import _check_unicode, _encode, _inputs, _result_error, _sse, _state, _wait
from moeserve.serve.state import ServeConfig, ServerState

MAX_STOP = 4  # stop strings per request, as OpenAI
router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DEADLINE = object()  # queued by a stream's deadline timer
STREAM_DOC = {200: {"content": {"text/event-stream": {"schema": {
    "type": "string", "description": "with stream=true: `data: {chunk}` events, then `data: [DONE]`"}}}}}


# ---- what a request asks for -------------------------------------------------------------------------
def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, prompt_len: int,
              engine: ServedModel, cfg: ServeConfig, param: str) -> SamplingParams:
    """The request's sampling parameters for one prompt; max_tokens None: as many as the context allows."""
    ctx = engine.cfg.max_seq_len
    limit = min(cfg.max_tokens or ctx, ctx - prompt_len)
    if max_tokens is None:
        max_tokens = limit
    if max_tokens > limit:
        why = (f"the prompt's {prompt_len} tokens leave {ctx - prompt_len} of the context of {ctx}"
               if limit == ctx - prompt_len else "the server's limit")
        raise ApiError("invalid_value", f"{param} = {max_tokens} is more than {limit} ({why})", param=param,
                       limit=limit)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError("invalid_value", f"stop has {len(stop)} strings; at most {MAX_STOP}", param="stop",
                       limit=MAX_STOP)
    if any(not s for s in stop):
        raise ApiError("invalid_value", "stop strings must not be empty", param="stop")
    for s in stop:  # a stop string that is no text could never match
        _check_unicode(s, "stop")
    return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                          top_p=None if req.top_p >= 1 else req.top_p, seed=req.seed, stop=stop,
                          ignore_eos=req.ignore_eos)


@dataclasses.dataclass
class Choices:
    """A request's rows: each prompt best_of times, choice j of a prompt sampling with seed + j."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # per prompt
    n: int
    best_of: int

    @classmethod
    def of(cls, prompts: list[list[int]], params: list[SamplingParams], n: int, best_of: int | None,
           cfg: ServeConfig) -> "Choices":
        best_of = n if best_of is None else best_of
        if best_of < n:
            raise ApiError("invalid_value", f"best_of = {best_of} is less than n = {n}", param="best_of", limit=n)
        if len(prompts) * best_of > cfg.max_inputs:
            param = "best_of" if best_of > n else "n"
            raise ApiError("invalid_value", f"{len(prompts)} prompt(s) x {param} = {best_of} is "
                           f"{len(prompts) * best_of} sequences; at most {cfg.max_inputs} per request", param=param,
                           limit=cfg.max_inputs)
        if best_of > n:  # the ranking needs every token's log-probability
            params = [p if p.logprobs is not None else dataclasses.replace(p, logprobs=0) for p in params]
        return cls(prompts, params, n, best_of)

    def job(self, timeout_s: float) -> Job:
        rows, params = [], []
        for prompt, p in zip(self.prompts, self.params):
            for j in range(self.best_of):
                rows.append(prompt)
                params.append(p if p.seed is None else dataclasses.replace(p, seed=p.seed + j))
        return Job("complete", rows, params, deadline=time.monotonic() + timeout_s)

    def pick(self, done: list[Completion]) -> list[tuple[int, Completion]]:
        """(prompt index, completion) of each returned choice, in choice-index order."""
        out = []
        for i in range(len(self.prompts)):
            mine = done[i * self.best_of:(i + 1) * self.best_of]
            if self.best_of > self.n:
                mine = sorted(mine, key=_mean_logprob, reverse=True)[:self.n]
            out += [(i, c) for c in mine]
        return out

    def usage(self, done: list[Completion]) -> dict:
        """Each prompt counted once; every generated token, returned or not (best_of), counted."""
        p, c = sum(len(r) for r in self.prompts), sum(x.completion_tokens for x in done)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _mean_logprob(c: Completion) -> float:
    return sum(lp.logprob for lp in c.logprobs) / len(c.logprobs) if c.logprobs else 0.0


def _tokenizer(engine: ServedModel, why: str, param: str):
    if engine.tokenizer is None:
        raise ApiError("invalid_value", f"{why}; this model has none", param=param)
    return engine.tokenizer


def _check_streamable(req, choices: Choices) -> None:
    if req.stream and choices.best_of > choices.n:
        raise ApiError("invalid_value", "best_of > n cannot be streamed: the best choices are known only at the end",
                       param="best_of")


def _head(kind: str, state: ServerState) -> dict:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": state.name}


def _lm_engine(state: ServerState, model: str) -> ServedModel:
    engine = state.require_ready()
    state.check_model(model)
    if engine.cfg.task != "lm":
        raise ApiError("invalid_value", f"{state.name} is a {engine.cfg.task} model; completions need a "
                       "language model", param="model")
    return engine


# ---- /v1/completions --------------------------------------------------------------------------------
@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_DOC,
             summary="continue prompts (OpenAI completions; stream=true for server-sent events)")
async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    cfg, engine = state.cfg, _lm_engine(state, req.model)
    ctx = engine.cfg.max_seq_len
    prompts = _inputs(req.prompt, "prompt", cfg)
    rows = [_encode(engine, p, "prompt", ctx - 1) for p in prompts]
    if req.echo and req.stream:
        raise ApiError("invalid_value", "echo cannot be streamed here; ask without stream", param="echo")
    if req.echo or req.logprobs is not None:
        _tokenizer(engine, "echo and logprobs need the model's tokenizer (to give token texts)", "logprobs")
    params = []
    for r in rows:
        p = _sampling(req, 16 if req.max_tokens is None else req.max_tokens, len(r), engine, cfg, "max_tokens")
        scored = req.echo and req.logprobs is not None
        params.append(dataclasses.replace(p, logprobs=req.logprobs, prompt_logprobs=req.logprobs if scored else None))
    choices = Choices.of(rows, params, req.n, req.best_of, cfg)
    _check_streamable(req, choices)
    job, head = choices.job(cfg.request_timeout_s), _head("text_completion", state)
    if req.stream:
        return _streaming(state, request, job, head, choices,
                          _CompletionChunks(engine, job, req.logprobs is not None), req.stream_options)
    state.submit(job, request.scope)
    done: list[Completion] = await _wait(job, request, cfg.request_timeout_s)
    out = []
    for index, (i, c) in enumerate(choices.pick(done)):
        echo = (prompts[i] if isinstance(prompts[i], str) else engine.tokenizer.decode(rows[i])) if req.echo else ""
        choice = {"text": echo + c.text, "index": index, "logprobs": None, "finish_reason": c.finish_reason}
        if req.logprobs is not None:
            texts = TokenTexts(engine.tokenizer, rows[i] + c.token_ids)
            records = (c.prompt_logprobs if req.echo else []) + c.logprobs
            choice["logprobs"] = completion_logprobs(texts, 0 if req.echo else len(rows[i]), records)
        out.append(choice)
    return CompletionResponse(**head, choices=out, usage=choices.usage(done))


# ---- /v1/chat/completions ---------------------------------------------------------------------------
# the variables render() itself passes, which a request cannot set
TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def _template_variables(req: ChatCompletionRequest) -> dict:
    """chat_template_kwargs and reasoning_effort, as apply_chat_template's keyword arguments."""
    variables = dict(req.chat_template_kwargs or {})
    for name, value in variables.items():
        if name in TEMPLATE_RESERVED:
            raise ApiError("invalid_value", f"chat_template_kwargs cannot set {name!r} (the server passes it)",
                           param=f"chat_template_kwargs.{name}")
        _check_unicode(name, "chat_template_kwargs")
        if isinstance(value, str):
            _check_unicode(value, f"chat_template_kwargs.{name}")
    if req.reasoning_effort is not None:
        variables["reasoning_effort"] = req.reasoning_effort
    return variables


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_DOC,
             summary="answer a conversation (OpenAI chat completions), through the model's chat template")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = _state(request)
    cfg, engine = state.cfg, _lm_engine(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("invalid_value", "top_logprobs needs logprobs: true", param="top_logprobs")
    if state.chat_template is None:
        raise ApiError("no_chat_template", f"{state.name} has no chat template to turn messages into a prompt (no "
                       "chat_template.jinja, no chat_template in tokenizer_config.json); start the server with "
                       "--chat-template FILE, or send the prompt to /v1/completions", param="messages")
    messages = [{"role": m.role, "name": m.name,
                 "content": m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)}
                for m in req.messages]
    for i, m in enumerate(messages):
        _check_unicode(m["content"], f"messages[{i}].content")
    variables = _template_variables(req)
    try:
        text = state.chat_template.render(messages, add_generation_prompt=True, **variables)
    except ChatTemplateError as e:
        raise ApiError("invalid_value", str(e), param="messages") from None
    tokenizer = _tokenizer(engine, "the rendered conversation needs the model's tokenizer", "messages")
    row = tokenizer.encode(text, bos=state.chat_template.needs_bos)
    ctx = engine.cfg.max_seq_len
    if len(row) > ctx - 1:
        raise ApiError("invalid_value", f"the conversation (messages) is {len(row)} tokens; at most {ctx - 1} fit this "
                       f"model's context of {ctx}", param="messages", limit=ctx - 1)
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    p = _sampling(req, max_tokens, len(row), engine, cfg, param)
    if req.logprobs:
        p = dataclasses.replace(p, logprobs=req.top_logprobs or 0)
    choices = Choices.of([row], [p], req.n, None, cfg)
    job, head = choices.job(cfg.request_timeout_s), _head("chat.completion", state)
    if req.stream:
        return _streaming(state, request, job, head | {"object": "chat.completion.chunk"}, choices,
                          _ChatChunks(engine, job, req.logprobs), req.stream_options)
    state.submit(job, request.scope)
    done: list[Completion] = await _wait(job, request, cfg.request_timeout_s)
    out = []
    for index, (_, c) in enumerate(choices.pick(done)):
        logprobs = None
        if req.logprobs:
            logprobs = {"content": chat_logprobs(TokenTexts(tokenizer, row + c.token_ids), len(row), c.logprobs),
                        "refusal": None}
        out.append({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                    "finish_reason": c.finish_reason})
    return ChatCompletionResponse(**head, choices=out, usage=choices.usage(done))


# ---- streaming ----------------------------------------------------------------------------------------
class _CompletionChunks:
    """Chunks of /v1/completions: text deltas, each with the log-probabilities of the tokens it carries
    (tokens whose text is held back, at a possible stop string, ride with the next delta: output.StreamEvent)."""

    def __init__(self, engine: ServedModel, job: Job, logprobs: bool):
        self.tokenizer, self.logprobs = engine.tokenizer, logprobs
        self.ids = [list(r) for r in job.rows]  # each row's prompt and its tokens so far
        self.offset = [0] * len(job.rows)  # characters of each choice's text sent

    def first(self, i: int) -> dict | None:
        return None

    def choice(self, i: int, text: str, records: list[TokenLogprob], finish: str | None) -> dict:
        lp = None
        if self.logprobs:
            start = len(self.ids[i]) - len(records)
            lp = completion_logprobs(TokenTexts(self.tokenizer, self.ids[i]), start, records)
            lp["text_offset"] = [o + self.offset[i] for o in lp["text_offset"]]
        self.offset[i] += len(text)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}


class _ChatChunks(_CompletionChunks):
    """Chunks of /v1/chat/completions: the role first, then content deltas, then the finish reason."""

    def first(self, i: int) -> dict:
        return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def choice(self, i: int, text: str, records: list[TokenLogprob], finish: str | None) -> dict:
        lp = None
        if self.logprobs:
            start = len(self.ids[i]) - len(records)
            lp = {"content": chat_logprobs(TokenTexts(self.tokenizer, self.ids[i]), start, records), "refusal": None}
        return {"index": i, "delta": {"content": text} if text or finish is None else {}, "logprobs": lp,
                "finish_reason": finish}


def _streaming(state: ServerState, request: Request, job: Job, head: dict, choices: Choices,
               chunks: _CompletionChunks, stream_options) -> StreamingResponse:
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    job.on_event = lambda i, event: loop.call_soon_threadsafe(events.put_nowait, (i, event))
    state.submit(job, request.scope)
    job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
    include_usage = bool(stream_options and stream_options.include_usage)
    return StreamingResponse(_stream(job, events, head, choices, chunks, include_usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _stream(job: Job, events: asyncio.Queue, head: dict, choices: Choices, chunks: _CompletionChunks,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: each choice's opening chunk (chat), a chunk per stream event of its sequence
    (runtime/output.py: text as it becomes final, stop strings already cut), the finish reasons once the whole
    request has ended, usage if asked, [DONE]. A deadline or a failure after the stream started can only be
    told in the stream: an error event. Rows are choices here (best_of == n).

    The events queued when the loop gets to this stream go out in one write: a loop that keeps up wakes once a
    token, one that falls behind (a fast model's server is bound by its host work) sends fewer, larger writes
    rather than falling further behind. The deadline is one timer that queues DEADLINE, not a timeout a token."""
    def event(choice: dict) -> bytes:
        return _sse({**head, "choices": [choice]})

    def chunk(i: int, e: StreamEvent) -> bytes:
        chunks.ids[i] += e.token_ids
        return event(chunks.choice(i, e.text, e.logprobs, e.finish_reason))

    last: dict[int, StreamEvent] = {}  # each choice's last event, sent once the request has succeeded
    loop = asyncio.get_running_loop()
    timer = (loop.call_later(max(0.0, job.deadline - time.monotonic()), events.put_nowait, DEADLINE)
             if math.isfinite(job.deadline) else None)
    try:
        for i in range(len(job.rows)):
            if (opening := chunks.first(i)) is not None:
                yield event(opening)
        while True:
            items = [await events.get()]
            while not events.empty():
                items.append(events.get_nowait())
            # None: the job finished; DEADLINE: it ran out of time
            end = next((k for k, item in enumerate(items) if item is None or item is DEADLINE), len(items))
            out = []
            for i, e in items[:end]:
                if e.finish_reason is not None:
                    last[i] = e
                else:
                    out.append(chunk(i, e))
            if out:
                yield b"".join(out)
            if end < len(items):
                break
        if items[end] is DEADLINE:
            job.cancelled = True
            raise DeadlineExceeded("no answer within the server's request timeout")
        if job.future.exception() is not None:
            raise job.future.exception()
        done: list[Completion] = job.future.result()
        tail = [chunk(i, last[i]) for i in range(len(done))]
        if include_usage:
            tail.append(_sse({**head, "choices": [], "usage": choices.usage(done)}))
        yield b"".join(tail) + _sse("[DONE]")
    except Exception as e:
        yield _sse(_result_error(e).body())
    finally:
        if timer is not None:
            timer.cancel()
        job.cancelled = True  # a no-op once finished; stops the generation if the client left
