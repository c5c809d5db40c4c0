"""A group lives and dies as a unit (serve/ep_groups.py), on a real local Ray, gloo on CPU, the tiny preset, N = 2:
a rank actor killed with ray.kill under load.

- R = 2 groups, 8 streaming clients: requests not yet streaming when the rank dies succeed (on the other group, or
  moved there), those mid-stream on the killed group end with an error event, none hangs past its deadline; the
  group is torn down, started again, and serves again.
- R = 1: 503 within 2 s of being sent while the group is down (measured and asserted); serving again within 60 s
  of the kill, with the same tokens as before.
- Either way, the ingress's /metrics counts the killed group's teardown once (moeserve_ep_group_restarts_total).

The measured times are printed (pytest -s) and recorded in docs/bench/log.md."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from ..conftest import ray_serve_on, wait_ready
from moeserve.bench.server_process import free_port
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.serve.config import ExpertParallelOptions
from moeserve.serve.state import ServeConfig

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")

from moeserve.serve.ep_app import build_ep_app  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)
DEADLINE_S = 30.0  # the server's request timeout: no request may take longer
MAX_TOKENS = 150  # long streams (a few seconds each), so the kill can wait for one far from its end
SHORT = 12  # the requests that only check that a group answers
STREAM = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax", max_seq_len=256))
    return save_checkpoint(tmp_path_factory.mktemp("epf") / "tiny", model.cfg, model.state_dict())


@pytest.fixture(scope="module")
def url():
    with ray_serve_on(free_port()) as url:
        yield url


def deploy(url: str, ckpt: Path, groups: int, cpus_per_rank: float) -> None:
    options = ExpertParallelOptions(ranks=2, groups=groups, cpus_per_rank=cpus_per_rank, ingress_cpus=0.1,
                                    ready_timeout_s=120, collective_timeout_s=60, probe_every_s=0.5)
    serve_cfg = ServeConfig(model_name="tiny", kv_slots=4, request_timeout_s=DEADLINE_S)
    serve.run(build_ep_app(ckpt, serve_cfg, options), name="moeserve", route_prefix="/", blocking=False)
    assert wait_ready(url, 120) is not None, "the expert-parallel application did not become ready"


def ingress():
    return serve.get_deployment_handle("ingress", app_name="moeserve")


def kill_rank(group: int, rank: int) -> str:
    """ray.kill one rank actor of the serving group `group`; its name."""
    prefix = "moeserve-ep-"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix) and a["name"].endswith(f"-{group}-rank-{rank}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="moeserve"), no_restart=True)
    return names[0]


def restarts_metric(url: str) -> dict[str, float]:
    """moeserve_ep_group_restarts_total per group, from the ingress's /metrics."""
    from .test_server import parse

    got = parse(httpx.get(f"{url}/metrics", timeout=10).text)
    return {dict(k[1:])["group"]: v for k, v in got.items() if k[0] == "moeserve_ep_group_restarts_total"}


class Stream:
    """One streaming request as its client sees it: when it was sent, its first token, the tokens so far, its end,
    and how it ended. `into` gets it before it is sent, so that the test sees the streams still going."""

    def __init__(self, url: str, prompt: str, into: list | None = None, max_tokens: int = MAX_TOKENS):
        self.sent = time.monotonic()
        self.first: float | None = None
        self.status, self.ended, self.text, self.error, self.tokens = None, None, "", None, 0
        if into is not None:
            into.append(self)
        try:
            body = {**STREAM, "prompt": prompt, "max_tokens": max_tokens}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S + 10) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    self.error = r.text
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.error = data["error"]
                        continue
                    if data["choices"] and data["choices"][0]["text"]:
                        self.first = self.first or time.monotonic()
                        self.text += data["choices"][0]["text"]
                        self.tokens += 1
        except httpx.HTTPError as e:
            self.error = f"client: {type(e).__name__}: {e}"
        finally:
            self.ended = time.monotonic()

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def test_a_rank_killed_under_load_with_two_groups(url, ckpt):
    deploy(url, ckpt, groups=2, cpus_per_rank=0.4)
    want, want_short = Stream(url, "def f(x):").text, Stream(url, "def f(x):", max_tokens=SHORT).text
    streams: list[Stream] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            Stream(url, "def f(x):", into=streams)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(3.0)  # every client streaming
        # The kill must find the busy group mid-stream. A group's sequences run in step and end together, so a look
        # that finds them running could be their last step's, and their clients' next requests, sent while the look
        # came back, are not streaming yet (a group's death moves those). So kill only when the streams going are
        # the same before and after the look (none ended meanwhile) and each has streamed, but not past two thirds
        # of its tokens: the busy group's sequences then have at least 50 token times left, not one look's few ms.
        deadline = time.monotonic() + 30
        while True:
            before = [s for s in streams if s.ended is None]
            info = ingress().ranks.remote().result()
            busy = max((0, 1), key=lambda g: sum(r["running"] for r in info if r["group"] == g))
            going = [s for s in streams if s.ended is None]
            far = going == before and all(0 < s.tokens < MAX_TOKENS * 2 // 3 for s in going)
            if sum(r["running"] for r in info if r["group"] == busy) > 0 and far or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sum(r["running"] for r in info if r["group"] == busy) > 0 and far, (info, [s.tokens for s in going])
        killed_at = time.monotonic()
        kill_rank(busy, 1)
        back_s = wait_ready(url, 60)
        time.sleep(2.0)  # a few more requests, some on the restarted group
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S + 20)
    assert back_s is not None, ingress().groups.remote().result()
    slack = 0.5  # a token the killed rank sent just before it died may reach its client just after the kill
    mid = [s for s in streams if s.first is not None and s.first < killed_at + slack and s.ended > killed_at]
    later = [s for s in streams if s not in mid]
    errors = [s for s in streams if not s.ok]
    print(f"\nR=2: {len(streams)} streams, {len(mid)} mid-stream at the kill, {len(errors)} ended with an error "
          f"event; group back in {back_s:.1f} s; longest request {max(s.ended - s.sent for s in streams):.1f} s")
    assert all(s.ok and s.text == want for s in later), [(s.status, s.error) for s in later if not s.ok]
    assert errors and all(s in mid and s.status == 200 and "unavailable" in json.dumps(s.error) for s in errors), \
        ([(s.status, s.error) for s in errors], [(s.tokens, s.first - killed_at, s.ended - killed_at) for s in mid])
    assert all(s.ended - s.sent < DEADLINE_S for s in streams)
    groups = ingress().groups.remote().result()
    assert [(g["state"], g["restarts"]) for g in groups] == [("serving", 1 if g["group"] == busy else 0)
                                                              for g in groups], groups
    assert restarts_metric(url) == {str(g): 1 if g == busy else 0 for g in (0, 1)}  # the killed group's, once
    # the restarted group serves: one request at a time, with every rank idle, goes round robin over the four ranks
    # (ep_router's tie rule), so these reach both groups whatever the load above left on each
    for _ in range(4):
        assert Stream(url, "def f(x):", max_tokens=SHORT).text == want_short
    info = ingress().ranks.remote().result()
    assert sum(r["served"]["sequences"] for r in info if r["group"] == busy) > 0, info
    ingress().check_health.remote().result()


def test_one_group_answers_503_at_once_until_it_is_back(url, ckpt):
    serve.delete("moeserve")
    deploy(url, ckpt, groups=1, cpus_per_rank=0.5)
    body = {"model": "tiny", "prompt": "class A:", "max_tokens": 12, "temperature": 0}
    before = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert before.status_code == 200
    killed_at = time.monotonic()
    kill_rank(0, 0)
    refused: list[float] = []
    while True:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        took = time.monotonic() - t0
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
        assert took < 2.0, f"503 after {took:.2f} s"
        refused.append(took)
        assert time.monotonic() - killed_at < 60, "the group was not back within 60 s"
        if len(refused) == 1:  # while it is down: the detail says so, and Serve's health check still passes
            ready = httpx.get(f"{url}/readyz", timeout=5)
            groups = ready.json()["groups"]
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable", ready.text
            assert groups[0]["state"] == "restarting" and "rank" in groups[0]["last_error"], groups
            ingress().check_health.remote().result()
        time.sleep(0.2)
    back_s = time.monotonic() - killed_at
    print(f"\nR=1: {len(refused)} requests refused, 503 in at most {max(refused):.2f} s "
          f"(mean {sum(refused) / len(refused):.2f} s); serving again {back_s:.1f} s after the kill")
    assert refused, "no request was refused while the group was down"
    assert back_s < 60
    assert r.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert [g["restarts"] for g in ingress().groups.remote().result()] == [1]
    assert restarts_metric(url) == {"0": 1}
