"""The server end to end over real sockets: answers equal the engine's, the real `openai` client works
(streaming too), batching changes nothing per request, metrics count exactly the routed tokens,
overload gets fast 429s, deadlines give 504 and drop the work, readiness, classification, and the
`moeserve serve` process (the default model, SIGTERM draining)."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from moeserve.bench.server_process import free_port, wait_ready
from moeserve.checkpoint import save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.model import Transformer
from moeserve.serve.state import ServeConfig
from moeserve.serve.batcher import BatchConfig

from .conftest import live_server, wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ref(tiny_ckpt) -> Engine:
    """A second engine on the same checkpoint, in this process: what the server must answer."""
    return Engine.load(tiny_ckpt, dtype="float32", device="cpu")


class SlowRunner:
    """A model runner whose every call takes at least `delay_s` longer."""

    def __init__(self, runner, delay_s: float):
        self.runner, self.delay_s, self.cfg = runner, delay_s, runner.cfg
        self.device, self.dtype = runner.device, runner.dtype
        self.can_step_rows, self.can_copy_prefix = runner.can_step_rows, runner.can_copy_prefix

    @property
    def graph_decode(self) -> bool:
        return self.runner.graph_decode

    def new_cache(self, slots, max_len):
        return self.runner.new_cache(slots, max_len)

    def __getattr__(self, name):  # forward, prefill, decode: slowed
        call = getattr(self.runner, name)

        def slowed(*args, **kwargs):
            time.sleep(self.delay_s)
            return call(*args, **kwargs)

        return slowed


class SlowEngine(Engine):
    """Each model call takes at least 20 ms longer: requests stay in flight long enough to overload,
    time out, or be abandoned on purpose."""

    delay_s = 0.02

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner = SlowRunner(self.runner, self.delay_s)


class SlowerEngine(SlowEngine):
    delay_s = 0.05


def parse(text: str) -> dict[tuple, float]:
    """Prometheus text, parsed by prometheus_client's own parser: {(name, labels...): value}."""
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def samples(live) -> dict[tuple, float]:
    """Every sample of the live server's /metrics (parse)."""
    return parse(live.client.get("/metrics").text)


def routed(live) -> torch.Tensor:
    """moeserve_expert_routed_tokens_total as an [L, E] tensor."""
    eng = live.engine
    layers = eng.cfg.moe_layer_ids
    out = torch.zeros(len(layers), eng.cfg.n_experts, dtype=torch.int64)
    for key, v in samples(live).items():
        if key[0] == "moeserve_expert_routed_tokens_total":
            labels = dict(key[1:])
            out[layers.index(int(labels["layer"])), int(labels["expert"])] = int(v)
    return out


# ---- answers ------------------------------------------------------------------------------------
def test_openai_client_completion_equals_engine(live, ref):
    r = live.openai().completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0)
    want = ref.complete(["def f(x):"], [SamplingParams(12, 0.0)])[0]
    assert r.choices[0].text == want.text and want.completion_tokens > 0
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    assert r.model == "tiny" and r.object == "text_completion"


def test_openai_client_stream_adds_up_to_the_same_text(live):
    client = live.openai()
    whole = client.completions.create(model="tiny", prompt="import os\n", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="import os\n", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert sum(1 for t in texts if t) > 1  # it really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_prompt_list_gives_one_choice_each(live, ref):
    prompts = ["a = ", "class B:", "x"]
    r = live.post("/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0}).json()
    want = [ref.complete([p], [SamplingParams(6, 0.0)])[0] for p in prompts]
    assert [c["text"] for c in r["choices"]] == [w.text for w in want]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["prompt_tokens"] == sum(w.prompt_tokens for w in want)


def test_token_id_prompt_equals_text_prompt(live):
    text = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0}).json()
    ids = [256, ord("h"), ord("i")]  # <bos> h i, as the byte tokenizer encodes "hi"
    by_ids = live.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == text["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(live, ref, stream):
    full = ref.complete(["for i in"], [SamplingParams(30, 1.0, seed=7)])[0].text  # random weights: sample
    cut = next(k for k in range(3, len(full) - 1) if "\ufffd" not in full[k:k + 2] and full.index(full[k:k + 2]) == k)
    stop = full[cut:cut + 2]
    body = {"model": "tiny", "prompt": "for i in", "max_tokens": 30, "temperature": 1.0, "seed": 7, "stop": [stop]}
    if stream:
        with live.openai().completions.create(**body, stream=True) as s:
            chunks = [c.choices[0] for c in s]
        text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        choice = live.post("/v1/completions", body).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert (text, finish) == (full[:cut], "stop")


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_batched_requests_equal_requests_alone(tiny_ckpt, ref, scheduler):
    """Eight sampled requests sent at once are batched (a 200 ms batch wait makes sure; continuous: they
    share decode steps), and each gets exactly what it gets alone: its own seed, temperature and length."""
    bodies = [{"model": "tiny", "prompt": f"x{i} = ", "max_tokens": 6 + i, "temperature": 0.9, "seed": 100 + i}
              for i in range(8)]
    alone = [ref.complete([b["prompt"]], [SamplingParams(b["max_tokens"], 0.9, seed=b["seed"])])[0].text
             for b in bodies]
    cfg = ServeConfig(model_name="tiny", batch=BatchConfig(max_batch_size=8, wait_s=0.2), scheduler=scheduler)
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: s.post("/v1/completions", b).json(), bodies))
        m = samples(s)
    assert [a["choices"][0]["text"] for a in answers] == alone
    batches = m[("moeserve_batch_size_count", ("kind", "complete"))]
    rows = m[("moeserve_batch_size_sum", ("kind", "complete"))]
    if scheduler == "batch":
        assert rows == 8 and batches < 8  # at least one batch held several requests
    else:  # rows per step: a request is in one step per token, less one where its prefill's step also decoded its
        # second token (where no other row was running: else their decode tokens rode on its prefill's call)
        tokens = [a["usage"]["completion_tokens"] for a in answers]
        assert sum(tokens) - len(tokens) <= rows <= sum(tokens) and rows / batches > 2


class PoisonRunner:
    """A model runner whose prompt calls fail when a row writes the prompt `poison`."""

    def __init__(self, runner, poison: list[int]):
        self.runner, self.poison = runner, poison

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, cache, slot, ids_S, start, all_logits=False):
        if ids_S.tolist() == self.poison:
            raise RuntimeError("boom")
        return self.runner.prefill(cache, slot, ids_S, start, all_logits)

    def step_rows(self, cache, slots, ids, starts):
        if self.poison in ids:
            raise RuntimeError("boom")
        return self.runner.step_rows(cache, slots, ids, starts)


class PoisonEngine(Engine):
    """Fails any step that prefills the prompt "poison": a stand-in for a bug the handler's checks miss."""

    def step_engine(self, *args, **kwargs):
        steps = super().step_engine(*args, **kwargs)
        steps.runner = PoisonRunner(steps.runner, self.encode("poison"))
        return steps


def test_a_failing_request_fails_alone_not_its_batch(tiny_ckpt, ref):
    """With run-to-completion batches (the continuous scheduler fails the requests of a failed step)."""
    cfg = ServeConfig(model_name="tiny", batch=BatchConfig(max_batch_size=8, wait_s=0.2), scheduler="batch")
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0} for p in ("ok", "poison", "fine")]
    with live_server(lambda: PoisonEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            ok, bad, fine = pool.map(lambda b: s.post("/v1/completions", b), bodies)
        batches = samples(s)[("moeserve_batch_size_count", ("kind", "complete"))]
    assert batches == 1  # one batch of three, failed, then each of the three run alone
    assert (bad.status_code, bad.json()["error"]["code"]) == (500, "internal_error")
    assert ok.json()["choices"][0]["text"] == ref.complete(["ok"], [SamplingParams(4, 0.0)])[0].text
    assert fine.status_code == 200


# ---- metrics ------------------------------------------------------------------------------------
def test_expert_counters_grow_by_exactly_the_routed_tokens(live, ref):
    text = "def g(a, b):\n    return a * b"
    before, m0 = routed(live), samples(live)
    assert live.post("/v1/score", {"model": "tiny", "input": text}).status_code == 200
    after, m1 = routed(live), samples(live)
    want = torch.stack([torch.bincount(torch.tensor(layer).flatten(), minlength=ref.cfg.n_experts)
                        for layer in ref.route(text)])
    assert torch.equal(after - before, want)  # per (layer, expert), exactly
    key = ("moeserve_requests_total", ("endpoint", "/v1/score"), ("status", "200"))
    assert m1[key] - m0.get(key, 0) == 1
    assert m1[("moeserve_prompt_tokens_total",)] - m0[("moeserve_prompt_tokens_total",)] == len(text) + 1
    for i, layer in enumerate(ref.cfg.moe_layer_ids):
        row = after[i].double()
        assert m1[("moeserve_expert_load_imbalance", ("layer", str(layer)))] == pytest.approx(
            float(row.max() / row.mean()))
        assert m1[("moeserve_dead_experts", ("layer", str(layer)))] == int((row == 0).sum())


def test_generation_routes_prompt_and_fed_back_tokens(live):
    before = routed(live)
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 7, "temperature": 0}).json()
    grown = (routed(live) - before).sum(-1)
    u, finish = r["usage"], r["choices"][0]["finish_reason"]
    fed = u["prompt_tokens"] + u["completion_tokens"] - (1 if finish == "length" else 0)  # the last is never fed
    assert grown.tolist() == [live.engine.cfg.top_k * fed] * len(grown)


def test_metrics_has_the_documented_families(live):
    live.post("/v1/completions", {"model": "tiny", "prompt": "q", "max_tokens": 2})
    names = {k[0] for k in samples(live)}
    for name in ("moeserve_request_duration_seconds_bucket", "moeserve_requests_total",
                 "moeserve_queue_depth", "moeserve_batch_size_count", "moeserve_time_to_first_token_seconds_count",
                 "moeserve_prompt_tokens_total", "moeserve_generation_tokens_total",
                 "moeserve_expert_routed_tokens_total", "moeserve_expert_load_imbalance", "moeserve_dead_experts",
                 "moeserve_ready"):
        assert name in names, name


def test_per_expert_series_can_be_switched_off(tiny_ckpt):
    cfg = ServeConfig(model_name="tiny", expert_metrics=False)
    with live_server(lambda: Engine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        names = {k[0] for k in samples(s)}
    assert "moeserve_expert_routed_tokens_total" not in names and "moeserve_expert_load_imbalance" in names


# ---- limits -------------------------------------------------------------------------------------
def test_overload_gets_fast_429_while_accepted_requests_succeed(tiny_ckpt):
    cfg = ServeConfig(model_name="tiny", batch=BatchConfig(max_batch_size=2, wait_s=0, max_queue=4))
    body = {"model": "tiny", "prompt": "load", "max_tokens": 20, "temperature": 0}

    def call(_):
        t0 = time.perf_counter()
        r = s.post("/v1/completions", body)
        return r, time.perf_counter() - t0

    with live_server(lambda: SlowEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            results = list(pool.map(call, range(40)))
        rejected = samples(s).get(("moeserve_requests_rejected_total", ("reason", "queue_full")), 0)
    ok = [t for r, t in results if r.status_code == 200]
    busy = [(r, t) for r, t in results if r.status_code == 429]
    assert len(ok) + len(busy) == 40 and len(ok) >= 5 and len(busy) >= 20  # at least 1 running + 4 queued
    assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full" for r, _ in busy)
    assert max(t for _, t in busy) < min(ok)  # refused at once, not after waiting
    assert rejected == len(busy)


def test_deadline_gives_504_and_drops_the_work(tiny_ckpt):
    cfg = ServeConfig(model_name="tiny", request_timeout_s=0.5, batch=BatchConfig(max_batch_size=1, wait_s=0),
                      kv_slots=1)
    long = {"model": "tiny", "prompt": "slow", "max_tokens": 50, "temperature": 0}  # >= 2.5 s of 50 ms steps
    with live_server(lambda: SlowerEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            first, queued = pool.map(lambda b: s.post("/v1/completions", b), [long, long])
            elapsed = time.perf_counter() - t0
        assert (first.status_code, queued.status_code) == (504, 504)
        # answered at the 0.5 s deadline, not after the 2.5 s the request would have run
        assert first.json()["error"]["code"] == "deadline_exceeded" and elapsed < 2.0
        wait_until(lambda: s.state.batcher.steps.idle, "the model thread idle")
        generated = samples(s)[("moeserve_generation_tokens_total",)]
        assert generated < 50  # the running request was cut off, the queued one never ran
        short = s.post("/v1/completions", {**long, "max_tokens": 3})
        assert short.status_code == 200
        # A stream has sent its 200 already: the deadline arrives as an error event, and the stream ends.
        with s.client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1]["error"]["code"] == "deadline_exceeded" and "choices" in events[0]


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_stops_its_generation(tiny_ckpt, stream):
    cfg = ServeConfig(model_name="tiny")
    with live_server(lambda: SlowEngine.load(tiny_ckpt, dtype="float32", device="cpu"), cfg) as s:
        body = {"model": "tiny", "prompt": "leave", "max_tokens": 50, "temperature": 0, "stream": stream}
        if stream:
            with s.client.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data:"))
        else:  # the client gives up after 0.2 s (about 10 of the 50 tokens) and closes the connection
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/completions", json=body, timeout=0.2)
        # the server notices at its next write (stream) or receive (not streaming), and the model thread stops
        wait_until(lambda: s.state.batcher.steps.idle and s.state.batcher.depth == 0, "the model thread idle")
        tokens = samples(s)[("moeserve_generation_tokens_total",)]
        assert 1 <= tokens < 50  # 50: it ran to the end


# ---- readiness and task -------------------------------------------------------------------------
def test_not_ready_until_loaded_then_ready(tiny_ckpt):
    release = threading.Event()

    def slow_load() -> Engine:
        release.wait(30)
        return Engine.load(tiny_ckpt, dtype="float32", device="cpu")

    with live_server(slow_load, ServeConfig(model_name="tiny"), ready=False) as s:
        assert s.client.get("/healthz").status_code == 200
        r = s.client.get("/readyz")
        assert (r.status_code, r.json()["status"]) == (503, "loading")
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "x"})
        assert (r.status_code, r.json()["error"]["code"], r.headers["Retry-After"]) == (503, "not_ready", "1")
        gc.unfreeze()  # what an earlier server of this test process froze
        release.set()
        for _ in range(500):
            if s.client.get("/readyz").status_code == 200:
                break
            time.sleep(0.02)
        # ready: the loaded heap moved out of the collector's way (state.freeze_loaded_heap), this process's included
        assert gc.get_freeze_count() > 10_000
        assert s.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_load_failure_is_reported_not_served(tmp_path):
    def broken() -> Engine:
        return Engine.load(tmp_path / "missing", dtype="float32", device="cpu")

    with live_server(broken, ServeConfig(model_name="tiny"), ready=False) as s:
        for _ in range(200):
            if s.state.load_error:
                break
            time.sleep(0.02)
        r = s.client.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "missing" in r.json()["error"]
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


def test_classifier_serves_classify_only(tmp_path):
    torch.manual_seed(0)
    names = ["neg", "neu", "pos"]
    model = Transformer(preset("tiny", router="softmax", task="classify", n_classes=3, labels=names))
    ckpt = save_checkpoint(tmp_path / "cls", model.cfg, model.state_dict())
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    texts = ["good", "bad movie", "x" * 40]
    with live_server(lambda: Engine.load(ckpt, dtype="float32", device="cpu"), ServeConfig(model_name="cls")) as s:
        r = s.post("/v1/classify", {"model": "cls", "input": texts}).json()
        wrong = s.post("/v1/completions", {"model": "cls", "prompt": "x"})
        wrong_score = s.post("/v1/score", {"model": "cls", "input": "x"})
    want = ref.classify(texts)
    for item, probs in zip(r["data"], want):
        assert item["probs"] == pytest.approx(probs, abs=1e-5)
        assert item["label"] == max(range(3), key=probs.__getitem__)
        assert item["label_name"] == names[item["label"]]
    assert (wrong.status_code, wrong.json()["error"]["param"]) == (422, "model")
    assert (wrong_score.status_code, wrong_score.json()["error"]["param"]) == (422, "model")


@pytest.mark.parametrize("stride", [None, 8])
def test_score_matches_engine(live, ref, stride):
    texts = ["import sys", "héllo ✓", "def f(x):\n    return x\n" * 12]  # the last: 277 tokens, context 64
    body = {"model": "tiny", "input": texts, **({"stride": stride} if stride else {})}
    r = live.post("/v1/score", body).json()
    want_windows = [1, 1, 1 + -(-(277 - 64) // (stride or 32))]
    for item, want, windows in zip(r["data"], ref.score(texts, stride), want_windows):
        assert item["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert item["n_tokens"] == want.n_tokens and item["windows"] == want.windows == windows
        assert item["bits_per_byte"] == pytest.approx(want.bits_per_byte, abs=1e-5)
        assert item["perplexity"] == pytest.approx(float(torch.exp(torch.tensor(-want.logprob / want.n_tokens))),
                                                   rel=1e-4)


# ---- the process --------------------------------------------------------------------------------
def start(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", *args, "--port", str(port),
                             "--no-access-log", "--dtype", "float32"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout_s=30)
    except RuntimeError as e:
        proc.kill()
        raise AssertionError(f"{e}\n{proc.stdout.read()}") from None
    return proc, url


def test_sigterm_finishes_requests_in_flight(tiny_ckpt):
    proc, url = start([str(tiny_ckpt), "--max-batch-size", "1", "--kv-slots", "1"])
    body = {"model": tiny_ckpt.name, "prompt": "drain", "max_tokens": 55, "temperature": 0}
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=30) for _ in range(12)]
            # SIGTERM only once all 12 have reached the server (one running, the rest queued or done): a request
            # that arrives after it is refused with 503 by design, and would say nothing about draining.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                m = {s.name: s for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                     for s in f.samples if s.labels.get("endpoint") in (None, "/v1/completions")}
                done = m["moeserve_requests_total"].value if "moeserve_requests_total" in m else 0
                if m["moeserve_queue_depth"].value + done + 1 >= 12:
                    break
            proc.send_signal(signal.SIGTERM)
            in_flight = sum(not f.done() for f in futures)
            codes = [f.result().status_code for f in futures]
        assert in_flight >= 4
        assert codes == [200] * 12  # queued and running requests all finished
        proc.wait(20)
        assert proc.returncode in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz")
    finally:
        proc.kill()


def test_serve_without_checkpoint_serves_the_cached_default_model(tiny_ckpt, tmp_path):
    from moeserve.training.default_model import default_model_dir

    shutil.copytree(tiny_ckpt, default_model_dir(root=tmp_path))  # as if trained before: no training here
    proc, url = start([], env={"MOESERVE_CACHE": str(tmp_path)})
    try:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "moeserve-default"
        r = httpx.post(url + "/v1/completions", json={"model": "moeserve-default", "prompt": "def ", "max_tokens": 4,
                                                      "ignore_eos": True})  # a sampled first <eos> would give none
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_serve_cli_errors(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_serve_exits_2_naming_a_config_it_cannot_run(tmp_path, capsys):
    """Read before the server starts: a directory with no config.json, or a Hugging Face one with a setting the
    runtime lacks (issue 41: a RoPE scaling type), exits 2 naming the file and the field."""
    assert main(["serve", str(tmp_path)]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert main(["serve", str(tmp_path)]) == 2
    assert "field 'rope_scaling' has rope_type 'yarn'" in capsys.readouterr().err


def test_serve_exits_1_when_the_model_fails_to_load(tmp_path):
    """A config and nothing else: the server starts, the load fails, the process says why and exits 1."""
    (tmp_path / "config.json").write_text(preset("tiny").to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", str(tmp_path), "--port", str(free_port())],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "failed to load" in r.stderr and "moeserve.json: missing" in r.stderr
