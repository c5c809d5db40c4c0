"""Bounded work: a request's model work is capped before it is queued (413), a long scoring request runs a slice
between decode steps so streams beside it keep their pace, it stops at the next slice once its deadline passes,
and a batch that cannot run (a shard unavailable) answers every one of its requests at once. Over real sockets."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from moeserve.runtime.engine import Engine
from moeserve.runtime.windows import rolling_windows
from moeserve.serve.batcher import BatchConfig, Unavailable
from moeserve.serve.state import ServeConfig

from .conftest import HeldStep, live_server, wait_until
from .test_server import SlowRunner, samples

CONTEXT = 64  # tiny_ckpt's
TEXT = "def f(x):\n    return x * 2\n" * 60  # 1620 bytes: 1621 tokens with <bos>


def window_tokens(n: int, stride: int = CONTEXT // 2) -> int:
    return sum(end - start for start, end, _ in rolling_windows(n, CONTEXT, stride))


class ScoringTakesTime(Engine):
    """A whole-batch forward (scoring, classification) takes at least `delay_s` per 256 padded tokens longer, and
    every prefill or decode step `step_s` longer: a CPU's times, scaled down, whatever the machine."""

    delay_s, step_s = 0.15, 0.05

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner = SlowRunner(self.runner, self.step_s)

    def run(self, input_ids, attention_mask=None):  # classification, routes
        time.sleep(self.delay_s * input_ids.numel() / 256)
        return super().run(input_ids, attention_mask)

    def _token_logp(self, rows):  # scoring: log-probabilities straight from the runner, not through run
        time.sleep(self.delay_s * len(rows) * max(map(len, rows)) / 256)
        return super()._token_logp(rows)


def score_body(text: str = TEXT) -> dict:
    return {"model": "tiny", "input": text}


def test_a_request_past_the_work_cap_gets_413_naming_it_before_any_model_work(tiny_ckpt):
    work = window_tokens(len(TEXT.encode()) + 1)
    assert work == 50 * 64  # the first window, then one every 32 tokens to the 1621st: ceil(1557 / 32) = 49 more
    cfg = ServeConfig(model_name="tiny", max_request_tokens=work - 1)
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        r = s.post("/v1/score", score_body())
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["code"], err["limit"]) == ("too_much_work", work - 1)
        assert f"asks for {work} tokens of model work (every window of each text)" in err["message"]
        assert s.post("/v1/score", score_body("short text")).status_code == 200  # under the cap
        batches = samples(s).get(("moeserve_batch_size_count", ("kind", "score")))
    assert batches == 1  # the refused request ran nothing: only the short one was a batch

    # a completion: 4 sequences x (<bos> + 20 prompt tokens + max_tokens 40), within the context of 64
    body = {"model": "tiny", "prompt": "x" * 20, "max_tokens": 40, "n": 4, "temperature": 0.5}
    small = ServeConfig(model_name="tiny", max_request_tokens=4 * (21 + 40) - 1)
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), small) as s:
        r = s.post("/v1/completions", body)
        assert r.status_code == 413 and f"asks for {4 * 61} tokens" in r.json()["error"]["message"], r.text
        assert s.post("/v1/completions", {**body, "max_tokens": 39}).status_code == 200
    with pytest.raises(ValueError, match="max_request_tokens = 0: expected a positive number"):
        ServeConfig(max_request_tokens=0)


def test_streams_keep_their_pace_beside_the_largest_score_request(tiny_ckpt):
    """A stream is running when the largest score request the cap allows arrives: 50 windows, run in slices of 4
    (256 tokens, 0.15 s each) between its decode steps, 13 turns of about 0.2 s. The stream gets a token every
    turn; a 4-token completion sent 1 s in finishes within 2 s, before the scoring request (run as one batch, the
    scoring request held both for all of its 1.9 s)."""
    work = window_tokens(len(TEXT.encode()) + 1)
    cfg = ServeConfig(model_name="tiny", max_request_tokens=work, batch=BatchConfig(slice_tokens=256, wait_s=0))
    with live_server(lambda: ScoringTakesTime.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        stream_body = {"model": "tiny", "prompt": "a", "max_tokens": 30, "temperature": 0, "stream": True,
                       "ignore_eos": True}
        short = {"model": "tiny", "prompt": "b", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

        def stream() -> list[float]:
            times = []
            with httpx.stream("POST", s.url + "/v1/completions", json=stream_body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        times.append(time.perf_counter())
            return times

        def timed(path: str, body: dict, after_s: float) -> tuple[int, float, float]:
            time.sleep(after_s)
            t0 = time.perf_counter()
            r = httpx.post(s.url + path, json=body, timeout=60)
            return r.status_code, t0, time.perf_counter()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streamed = pool.submit(stream)
            wait_until(lambda: s.state.batcher.steps.running, "the stream generating")
            scored = pool.submit(timed, "/v1/score", score_body(), 0.0)
            short_f = pool.submit(timed, "/v1/completions", short, 1.0)
            (score_status, score_start, score_end) = scored.result()
            short_status, short_start, short_end = short_f.result()
            tokens = streamed.result()
    assert (score_status, short_status) == (200, 200)
    assert short_end - short_start < 2.0 and short_end < score_end
    running = [b - a for a, b in zip(tokens, tokens[1:]) if score_start < a and b < score_end]
    assert len(running) >= 5 and max(running) < 1.0, running


def test_a_score_request_past_its_deadline_stops_at_the_next_slice(tiny_ckpt):
    """With nothing else running a batch runs in calls of up to --max-batch-tokens (here 256: 13 calls of 0.15 s);
    504 at the 1 s deadline, and the model stops at the next call."""
    cfg = ServeConfig(model_name="tiny", request_timeout_s=1.0,
                      batch=BatchConfig(max_batch_tokens=256, slice_tokens=256, wait_s=0))
    with live_server(lambda: ScoringTakesTime.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        t0 = time.perf_counter()
        r = s.post("/v1/score", score_body())
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert time.perf_counter() - t0 < 2.0
        wait_until(lambda: s.state.batcher.scheduler.work is None, "the scoring batch dropped")
        got = samples(s)
    # model time: the calls until the deadline (1 s) and at most the one running then, not all 13 (1.95 s)
    assert got[("moeserve_batch_size_count", ("kind", "score"))] == 1
    assert got[("moeserve_batch_duration_seconds_sum", ("kind", "score"))] < 1.0 + 2 * ScoringTakesTime.delay_s + 0.2


class ShardGone(Engine):
    """A model a part of which has stopped answering (`gone`, set once the server is up): it raises Unavailable, the
    runners' "no request can run now" (runner.py; the expert-parallel router raises it for a failed group, and the
    retired shard exchange raised it for a shard)."""

    gone = False

    def score_slices(self, rows, stride=None, max_batch_tokens=16384):
        if self.gone:
            raise Unavailable("expert shard 1 did not answer within 10 s")
        return (yield from super().score_slices(rows, stride, max_batch_tokens))


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_every_request_of_a_batch_that_meets_an_unavailable_shard_gets_503_at_once(tiny_ckpt, scheduler):
    """Three scoring requests in one batch: each gets 503 with Retry-After as soon as the batch fails (before,
    only the first did; the other two waited for their 30 s deadline and got 504). Under the continuous scheduler
    the three queue while a completion's step is held, so that they are taken as one batch."""
    cfg = ServeConfig(model_name="tiny", scheduler=scheduler, request_timeout_s=30,
                      batch=BatchConfig(wait_s=0.5 if scheduler == "batch" else 0, max_batch_size=8))
    with live_server(lambda: ShardGone.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        s.engine.gone = True
        held = HeldStep(s.state.batcher) if scheduler == "continuous" else None
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            if held is not None:
                running = pool.submit(s.post, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 3})
                held.wait()
            scores = [pool.submit(s.post, "/v1/score", score_body(t)) for t in ("one", "two", "three")]
            if held is not None:
                wait_until(lambda: s.state.batcher.depth == 3, "the three scoring requests queued")
                held.release()
                assert running.result().status_code == 200
            answers = [f.result() for f in scores]
        elapsed = time.perf_counter() - t0
        batches = samples(s)[("moeserve_batch_size_count", ("kind", "score"))]
    assert [a.status_code for a in answers] == [503] * 3, [a.text for a in answers]
    assert all(a.json()["error"]["code"] == "unavailable" and a.headers["retry-after"] == "1" for a in answers)
    assert batches == 1 and elapsed < 10  # one batch, answered at once: not at the 30 s deadline
