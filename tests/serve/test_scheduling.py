"""Continuous batching seen from a client, and admission before the body: a short request sent while a
long one is generating is answered long before it (and not under `--scheduler batch`, the baseline);
a request the server will refuse is refused before its body is read; a stalled body gets 408."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time

import httpx
import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.serve.state import ServeConfig
from moeserve.serve.batcher import BatchConfig

from .conftest import HeldStep, live_server, wait_until
from .test_server import SlowEngine


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax", max_seq_len=256))
    return save_checkpoint(tmp_path_factory.mktemp("sched") / "tiny256", model.cfg, model.state_dict())


class StepEngine(SlowEngine):
    delay_s = 0.01  # 200 tokens: at least 2 s


def timed_pair(url: str) -> tuple[float, float, float]:
    """A 200-token request, and 100 ms later a 4-token one: (long done, short done, short's first token), in
    seconds from the start."""
    long = {"model": "tiny", "prompt": "x = ", "max_tokens": 200, "temperature": 0}
    short = {"model": "tiny", "prompt": "y = ", "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()

    def run_long() -> float:
        r = httpx.post(url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200, r.text
        return time.perf_counter() - t0

    def run_short() -> tuple[float, float]:
        time.sleep(0.1)
        first = None
        with httpx.stream("POST", url + "/v1/completions", json=short, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and first is None:
                    first = time.perf_counter() - t0
        return time.perf_counter() - t0, first

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_f, short_f = pool.submit(run_long), pool.submit(run_short)
        long_done, (short_done, short_first) = long_f.result(), short_f.result()
    return long_done, short_done, short_first


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_a_short_request_does_not_wait_for_a_long_one(long_ckpt, scheduler):
    cfg = ServeConfig(model_name="tiny", scheduler=scheduler, batch=BatchConfig(wait_s=0))
    with live_server(lambda: StepEngine.load(long_ckpt, dtype="float32", device="cpu"), cfg) as s:
        long_done, short_done, short_first = timed_pair(s.url)
        chunk = s.state.batcher.steps.prefill_chunk if scheduler == "continuous" else None
    assert long_done > 2.0
    if scheduler == "continuous":
        assert chunk == 64  # no --prefill-chunk on a CPU (scheduler.default_prefill_chunk)
        assert short_done < 0.5 * long_done and short_first < 0.5 * long_done
    else:  # the baseline: the short request waits for the running batch to end
        assert short_first > long_done - 0.2


def raw_request(port: int, body_sent: bytes, declared: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {declared}\r\n\r\n".encode() + body_sent)
    return sock


def status_of(sock: socket.socket) -> tuple[int, float]:
    t0 = time.perf_counter()
    head = sock.recv(4096).decode("latin-1")
    return int(head.split()[1]), time.perf_counter() - t0


def test_stalled_body_gets_408_and_a_full_queue_429_before_the_body(tiny_ckpt):
    cfg = ServeConfig(model_name="tiny", body_timeout_s=0.3, kv_slots=1, batch=BatchConfig(max_queue=1, wait_s=0))
    with live_server(lambda: StepEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        port = int(s.url.rsplit(":", 1)[1])
        stalled = raw_request(port, b'{"model": "tiny", "pro', 200)
        code, waited = status_of(stalled)
        assert code == 408 and 0.25 < waited < 3
        body = {"model": "tiny", "prompt": "q", "max_tokens": 40, "temperature": 0}
        held = HeldStep(s.state.batcher)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            try:
                busy = [pool.submit(s.post, "/v1/completions", body)]  # runs in the one slot
                held.wait()
                busy.append(pool.submit(s.post, "/v1/completions", body))  # waits in the queue of 1
                wait_until(lambda: s.state.batcher.depth == 1, "the second request in the queue")
                half = raw_request(port, b'{"model": "tiny", "prompt": "never fin', 500)  # never sends the rest
                code, waited = status_of(half)
                # 429, not the 408 of the 0.3 s body timeout: the body was never waited for
                assert code == 429 and waited < 3
            finally:
                held.release()
            assert [f.result().status_code for f in busy] == [200, 200]


def test_a_burst_lets_through_only_what_the_queue_holds(tiny_ckpt):
    """One cache slot, held, and a queue of 2: of a burst of 39 requests the gate admits exactly the two the queue
    has room for, answers the other 37 with 429 and Retry-After at once, and parses none of them only to refuse it
    at submit (before places were held: several were). The slot's request is held inside its first step until the
    37 refusals are in, so the counts do not depend on how fast the model thread drains the queue (on a slow or
    busy CPU it had not taken the first request out of the queue before the burst filled it)."""
    from moeserve.bench.client import read_response
    from moeserve.serve.batcher import QueueFull

    cfg = ServeConfig(model_name="tiny", kv_slots=1, batch=BatchConfig(max_queue=2, wait_s=0))
    with live_server(lambda: StepEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        batcher, late = s.state.batcher, []
        submit, held = batcher.submit, HeldStep(batcher)

        def spied(job, *place):
            try:
                return submit(job, *place)
            except QueueFull:
                late.append(job)
                raise

        batcher.submit = spied
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "tiny", "prompt": "q", "max_tokens": 30, "temperature": 0}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

        async def send() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            return reader, writer

        async def burst() -> tuple[tuple[int, dict], list[tuple[int, dict]]]:
            first = await send()
            await asyncio.to_thread(held.wait)  # the first request holds the slot, inside its first step
            conns = [await send() for _ in range(39)]
            try:
                reads = [asyncio.ensure_future(read_response(reader)) for reader, _ in conns]
                deadline = time.monotonic() + 60
                while sum(r.done() for r in reads) < 37 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # the refusals, while nothing can leave the queue
                held.release()
                return await read_response(first[0]), list(await asyncio.gather(*reads))
            finally:
                held.release()
                for _, writer in [first, *conns]:
                    writer.close()

        (first_status, _), answers = asyncio.run(burst())
    assert first_status == 200
    assert sorted(status for status, _ in answers) == [200] * 2 + [429] * 37
    assert all(headers.get("retry-after") for status, headers in answers if status == 429)
    assert late == []


def test_the_prefill_chunk_is_a_positive_integer_or_the_devices_default():
    from moeserve.runtime.scheduler import default_prefill_chunk

    assert ServeConfig().prefill_chunk is None
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"prefill_chunk = {bad!r}: expected an integer >= 1"):
            ServeConfig(prefill_chunk=bad)
    with pytest.raises(ValueError, match="kv_slots = None: expected an integer >= 1"):
        ServeConfig(kv_slots=None)
    assert (default_prefill_chunk(torch.device("cpu")), default_prefill_chunk(torch.device("cuda"))) == (64, 512)
