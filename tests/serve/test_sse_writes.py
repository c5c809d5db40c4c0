"""completions._stream, the server-sent events of a streamed completion, driven directly on a queue: the events
a stream finds queued when it runs go out in one write (a server bound by its host work sends fewer, larger
writes; docs/bench/log.md, "the server's host work"), each still its own `data:` event in order; and the
request's deadline, one timer, ends the stream with the error event."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

from moeserve.runtime.output import Completion, StreamEvent
from moeserve.runtime.sampling import SamplingParams
from moeserve.serve.batcher import Job
from moeserve.serve.completions import Choices, _CompletionChunks, _stream
from moeserve.tokenizer import ByteTokenizer

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}


def writes(job: Job, queued: list, later: list | None = None) -> list[bytes]:
    """What _stream yields for `job` with `queued` in its queue before it starts, and `later` put after its first
    write."""
    async def main() -> list[bytes]:
        events = asyncio.Queue()
        for item in queued:
            events.put_nowait(item)
        chunks = _CompletionChunks(SimpleNamespace(tokenizer=ByteTokenizer()), job, logprobs=False)
        choices = Choices([job.rows[0]], job.params, 1, 1)
        out, pending = [], list(later or [])
        async for data in _stream(job, events, HEAD, choices, chunks, include_usage=False):
            out.append(data)
            for item in pending:
                events.put_nowait(item)
            pending = []
        return out

    return asyncio.run(main())


def events_of(data: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]


def test_queued_events_go_out_in_one_write_each_its_own_event():
    job = Job("complete", [[1, 2]], [SamplingParams(max_new_tokens=3)])
    job.future.set_result([Completion("abc", [97, 98, 99], "length", prompt_tokens=2)])
    got = writes(job, [(0, StreamEvent("a", [97])), (0, StreamEvent("b", [98]))],
                 later=[(0, StreamEvent("c", [99], finish_reason="length")), None])
    assert len(got) == 2, got  # the two queued tokens together; then the last one with [DONE]
    first = [json.loads(e)["choices"][0]["text"] for e in events_of(got[0])]
    assert first == ["a", "b"]
    tail = events_of(got[1])
    assert [json.loads(tail[0])["choices"][0]["finish_reason"], tail[1]] == ["length", "[DONE]"]


def test_the_deadline_ends_the_stream_with_its_error_event():
    job = Job("complete", [[1, 2]], [SamplingParams(max_new_tokens=3)], deadline=time.monotonic() + 0.05)
    job.future = concurrent.futures.Future()  # never answered
    got = writes(job, [(0, StreamEvent("a", [97]))])
    assert [json.loads(e)["choices"][0]["text"] for e in events_of(got[0])] == ["a"]
    error = json.loads(events_of(got[-1])[0])["error"]
    assert "deadline" in error["message"] or "timeout" in error["message"], error
    assert job.cancelled
