"""`moeserve serve --ray --expert-parallel N` (serve/ep_app.py, ep_ranks.py, ep_router.py) on a real local Ray: two
rank actors in a placement group, gloo on CPU, behind the same FastAPI app as one process. Over HTTP with the openai
client, concurrent requests land on both ranks and answer as the single-process engine does (fp32: greedy and seeded
tokens identical, log-probabilities and scores within 1e-5, streamed text the same); each rank holds only its
experts; bad input gets the single-process server's answers; bad flags are named errors with exit status 2."""

from __future__ import annotations

import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from ..conftest import wait_for_ray_to_exit, wait_ready
from moeserve import cli
from moeserve.bench.server_process import free_port
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.model import Transformer
from moeserve.serve.config import ExpertParallelOptions
from moeserve.serve.state import ServeConfig

from . import test_bad_input as bad_input

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from moeserve.serve.ep_app import build_ep_app  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)
PROMPTS = ["def f(x):", "import os\n", "class A:", "x = [i for i", "# a comment", "return (a +"]
SEEDED = dict(max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
TEXTS = ["hello world", "def g():\n    return 1\n" * 8]  # the second is past the context of 64: 3 windows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax"))  # context 64, byte tokenizer, 2 MoE layers of 4 experts
    return save_checkpoint(tmp_path_factory.mktemp("ep") / "tiny", model.cfg, model.state_dict())


@pytest.fixture(scope="module")
def ref(ckpt) -> Engine:
    return Engine.load(ckpt, dtype="float32", device="cpu")


def deploy(url: str, ckpt: Path, serve_cfg: ServeConfig, **options) -> None:
    options = ExpertParallelOptions(**{"ranks": 2, "cpus_per_rank": 0.5, "ingress_cpus": 0.1, "ready_timeout_s": 120,
                                       **options})
    serve.run(build_ep_app(ckpt, serve_cfg, options), name="moeserve", route_prefix="/", blocking=False)
    assert wait_ready(url, 120) is not None, "the expert-parallel application did not become ready"


@pytest.fixture(scope="module")
def url(ckpt, tiny_chat_template):
    port = free_port()
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 500})  # Ray's export within a second of a change
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        deploy(url, ckpt, ServeConfig(model_name="tiny", kv_slots=4, chat_template=tiny_chat_template))
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        wait_for_ray_to_exit()


def ranks() -> list[dict]:
    return serve.get_deployment_handle("ingress", app_name="moeserve").ranks.remote().result()


def ray_export() -> dict[tuple, float]:
    """What Prometheus scrapes from this Ray: every node's metrics agent (its MetricsExportPort)."""
    from .test_server import parse

    out = {}
    for node in ray.nodes():
        if node["Alive"]:
            out.update(parse(httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                       timeout=10).text))
    return out


def test_concurrent_requests_on_both_ranks_answer_as_one_process(url, ref):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    before = [r["served"]["sequences"] for r in ranks()]

    def greedy(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)

    def seeded(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, **SEEDED)

    def streamed(prompt: str) -> str:
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(8) as pool:  # all at once: the router spreads them over the ranks
        greedy_f = [pool.submit(greedy, p) for p in PROMPTS]
        seeded_f = [pool.submit(seeded, p) for p in PROMPTS[:3]]
        stream_f = [pool.submit(streamed, p) for p in PROMPTS[:2]]
        got_greedy = [f.result() for f in greedy_f]
        got_seeded = [f.result() for f in seeded_f]
        got_stream = [f.result() for f in stream_f]

    want = ref.complete(PROMPTS, [SamplingParams(max_new_tokens=12, logprobs=2)] * len(PROMPTS))
    for got, w in zip(got_greedy, want):
        c = got.choices[0]
        assert c.text == w.text
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
    want = ref.complete(PROMPTS[:3], [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7)] * 3)
    assert [g.choices[0].text for g in got_seeded] == [w.text for w in want]
    assert got_stream == ref.generate(PROMPTS[:2], max_new_tokens=12)

    served = [r["served"]["sequences"] - b for r, b in zip(ranks(), before)]
    assert sum(served) == len(PROMPTS) + 3 + 2 and min(served) > 0, served  # both ranks served some


def test_n_choices_and_scores_and_chat(url, ref):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    want = ref.complete([PROMPTS[0]] * 2, [SamplingParams(max_new_tokens=8, temperature=0.8, seed=s) for s in (3, 4)])
    assert [c["text"] for c in sorted(got, key=lambda c: c["index"])] == [w.text for w in want]

    scores = httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": TEXTS}, timeout=60).json()["data"]
    for got, w in zip(scores, ref.score(TEXTS)):
        assert got["logprob"] == pytest.approx(w.logprob, abs=1e-5 * max(1.0, abs(w.logprob)))
        assert (got["n_tokens"], got["windows"]) == (w.n_tokens, w.windows)

    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "max_tokens": 6, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1, chat.text


def test_each_rank_holds_only_its_experts(url, ref):
    cfg = ref.model.cfg
    whole = sum(p.numel() for p in ref.model.parameters()) + sum(b.numel() for b in ref.model.buffers())
    per_expert = sum(p[0].numel() for p in ref.model.moe_layers[0].experts.parameters())
    info = ranks()
    assert [(r["group"], r["rank"], r["backend"], r["device"]) for r in info] == [(0, 0, "gloo", "cpu"),
                                                                                  (0, 1, "gloo", "cpu")]
    assert [r["experts"] for r in info] == [[[0, 1]] * 2, [[2, 3]] * 2]
    others = (cfg.n_experts - 2) * per_expert * len(cfg.moe_layer_ids)  # the experts a rank does not hold
    assert [r["parameters"] for r in info] == [whole - others] * 2


def test_metrics_count_the_ranks_work(url):
    from .test_server import parse

    before = parse(httpx.get(f"{url}/metrics", timeout=10).text)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    after = parse(httpx.get(f"{url}/metrics", timeout=10).text)
    assert after[("moeserve_generation_tokens_total",)] - before.get(("moeserve_generation_tokens_total",), 0) == 5
    assert after[("moeserve_time_to_first_token_seconds_count",)] > 0
    assert after[("moeserve_queue_depth",)] == 0


def test_metrics_per_rank_and_group(url):
    """The ranks' counters, brought back by the supervisor's health probe (serve/ep_metrics.py): both ranks' series,
    the rows their tokens routed all computed by some rank, the all-to-all histogram, and the imbalance."""
    from .test_server import parse

    def rank_series(got: dict, name: str) -> dict[str, float]:
        return {dict(k[1:])["rank"]: v for k, v in got.items() if k[0] == name and dict(k[1:]).get("group") == "0"}

    def settled() -> dict:
        """/metrics once both ranks are idle and two probes apart show the same counters."""
        deadline, last = time.monotonic() + 30, None
        while True:
            got = parse(httpx.get(f"{url}/metrics", timeout=10).text)
            now = [rank_series(got, n) for n in ("moeserve_ep_routed_rows_total", "moeserve_ep_computed_rows_total")]
            busy = rank_series(got, "moeserve_ep_running_sequences"), rank_series(got, "moeserve_ep_queue_depth")
            if now == last and all(set(b) == {"0", "1"} and not any(b.values()) for b in busy):
                return got
            assert time.monotonic() < deadline, (now, busy)
            last = now
            time.sleep(1.0)  # two probes (probe_every_s 0.5)

    before = settled()
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=60),
                                PROMPTS[:4]))
    assert all(a.status_code == 200 for a in answers)
    got = settled()
    routed, computed = (rank_series(got, n) for n in ("moeserve_ep_routed_rows_total",
                                                      "moeserve_ep_computed_rows_total"))
    assert set(routed) == set(computed) == {"0", "1"}
    assert all(v > 0 for v in (*routed.values(), *computed.values())), (routed, computed)
    assert sum(routed.values()) > sum(rank_series(before, "moeserve_ep_routed_rows_total").values())
    assert sum(computed.values()) == sum(routed.values())  # every routed row computed once, on some rank
    calls = rank_series(got, "moeserve_ep_all_to_all_seconds_count")
    assert set(calls) == {"0", "1"} and calls["0"] == calls["1"] > 0  # the lockstep: every rank at each layer call
    assert set(rank_series(got, "moeserve_ep_exchanged_rows_total")) == {"0", "1"}
    assert got[("moeserve_ep_expert_imbalance", ("group", "0"))] >= 1

    # and the same values in Ray's metrics export, once Ray has them
    def exported(samples: dict, name: str) -> dict[str, float]:
        return {dict(k[1:])["rank"]: v for k, v in samples.items()
                if k[0] == name and dict(k[1:]).get("group") == "0" and dict(k[1:]).get("application") == "moeserve"}

    deadline = time.monotonic() + 30
    while True:
        samples = ray_export()
        ray_got = (exported(samples, "ray_moeserve_ep_computed_rows_total"),
                   exported(samples, "ray_moeserve_ep_all_to_all_seconds_count"))
        if ray_got == (computed, calls):
            break
        assert time.monotonic() < deadline, (ray_got, computed, calls)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ep_server(url):
    return types.SimpleNamespace(url=url)


@pytest.mark.parametrize("case", [c for c in bad_input.CASES if c.values[0].server == "live"])
def test_bad_input_gets_the_same_answers(ep_server, case):
    bad_input.assert_answer(bad_input.send(ep_server, case), case)


def test_an_int8_checkpoint_over_two_groups(url, tmp_path):
    """A quantized checkpoint's ranks load their experts' integers and scales (QuantExpertShard); with R = 2 groups,
    requests go to both groups, and the answers are the single-process engine's of the same checkpoint. (Last of
    the Ray tests: it replaces the module's application.)"""
    from moeserve.runtime.quant import QuantSpec, quantize_model_

    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))
    quantize_model_(model, QuantSpec.parse("int8"))
    ckpt = save_checkpoint(tmp_path / "int8", model.cfg, model.state_dict())
    serve.delete("moeserve")
    deploy(url, ckpt, ServeConfig(model_name="tiny", kv_slots=4), groups=2, cpus_per_rank=0.4)
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120),
                            PROMPTS * 2))
    assert [r.json()["choices"][0]["text"] for r in got] == ref.generate(PROMPTS * 2, max_new_tokens=10)
    info = ranks()
    assert [(r["group"], r["rank"]) for r in info] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(sum(r["served"]["sequences"] for r in info if r["group"] == g) > 0 for g in (0, 1)), info
    whole = sum(p.numel() for p in ref.model.parameters()) + sum(b.numel() for b in ref.model.buffers())
    experts = sum(t.numel() for k, t in ref.model.state_dict().items() if ".ffn.experts." in k)
    assert [r["parameters"] for r in info] == [whole - experts // 2] * 4


@pytest.mark.parametrize("argv, message", [
    (["--expert-parallel", "3"], "--expert-parallel 3: the model's 4 experts do not split evenly over 3 ranks; use "
                                 "a divisor of 4 (1, 2, 4)"),
    (["--expert-parallel", "0"], "--expert-parallel 0: expected an integer >= 1"),
    (["--expert-parallel", "2", "--expert-shards", "2"], "--expert-shards was the shard exchange's, which is "
                                                         "retired: serve with --ray --expert-parallel N"),
    (["--expert-parallel", "2", "--exchange", "handles"], "--exchange was the shard exchange's"),
    (["--data-parallel-groups", "0"], "--data-parallel-groups 0: expected an integer >= 1"),
    (["--expert-parallel", "2", "--quantize", "int8"], "--ray: quantize the checkpoint first"),
    (["--expert-parallel", "2", "--device", "cuda:1"], "--device 'cuda:1' with --ray: expected auto, cpu or cuda"),
    (["--expert-parallel", "2", "--redundant-experts", "-1"], "--redundant-experts -1: expected an integer >= 0"),
    (["--expert-parallel", "2", "--rebalance-every", "8"], "--rebalance-every is --redundant-experts's"),
    (["--redundant-experts", "1"], "--redundant-experts needs --expert-parallel N >= 2"),
    (["--print-config", "--expert-parallel", "2", "--device", "cuda:0"], "--device 'cuda:0' with --ray"),
])
def test_bad_flags_are_named_errors(ckpt, capsys, argv, message):
    assert cli.main(["serve", str(ckpt), "--ray", *argv]) == 2
    assert message in capsys.readouterr().err
