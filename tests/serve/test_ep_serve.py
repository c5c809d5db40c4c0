"""`moeserve serve --ray --expert-parallel N` (serve/ep_app.py, ep_ranks.py, ep_router.py) on a real local Ray: two
rank actors in a placement group, gloo on CPU, behind the same FastAPI app as one process. Over HTTP with the openai
client, concurrent requests land on both ranks and answer as the single-process engine does (fp32: greedy and seeded
tokens identical, log-probabilities and scores within 1e-5, streamed text the same), for the softmax router and
discrete VQ (code tables built through the exchange at load); with N = 4, one rank busy for seconds beside idle ones
neither hangs nor stalls; each rank holds only its experts; bad input gets the single-process server's answers; bad
flags are named errors with exit status 2. The softmax tests share the module's application; the later ones each
deploy their own on the same Ray."""

from __future__ import annotations

import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from ..conftest import ray_serve_on, wait_ready
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
    # Ray's export within a second of a change
    with ray_serve_on(free_port(), _system_config={"metrics_report_interval_ms": 500}) as url:
        deploy(url, ckpt, ServeConfig(model_name="tiny", kv_slots=4, chat_template=tiny_chat_template))
        yield url


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


def served_in_parallel(url: str, ref: Engine, ranks_before: list[dict], prompts: list[str] = PROMPTS) -> None:
    """Greedy completions with log-probabilities, seeded ones and scores, all sent at once with the openai client
    (and /v1/score), answer as `ref` (fp32: tokens identical, log-probabilities and scores within 1e-5); every rank
    served some of them, so concurrent requests landed on different ranks at once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    def greedy(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)

    def seeded(prompt: str):
        return client.completions.create(model="tiny", prompt=prompt, **SEEDED)

    def scored(text: str):
        return httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": [text]}, timeout=120).json()["data"][0]

    with ThreadPoolExecutor(8) as pool:
        greedy_f = [pool.submit(greedy, p) for p in prompts]
        seeded_f = [pool.submit(seeded, p) for p in prompts[:3]]
        score_f = [pool.submit(scored, t) for t in TEXTS]
        got_greedy, got_seeded, got_scores = ([f.result() for f in fs] for fs in (greedy_f, seeded_f, score_f))

    want = ref.complete(prompts, [SamplingParams(max_new_tokens=10, logprobs=2)] * len(prompts))
    for got, w in zip(got_greedy, want):
        assert got.choices[0].text == w.text
        assert got.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
    want = ref.complete(prompts[:3], [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7)] * 3)
    assert [g.choices[0].text for g in got_seeded] == [w.text for w in want]
    for got, w in zip(got_scores, ref.score(TEXTS)):
        assert got["logprob"] == pytest.approx(w.logprob, abs=1e-5 * max(1.0, abs(w.logprob)))
        assert (got["n_tokens"], got["windows"]) == (w.n_tokens, w.windows)
    served = [r["served"]["sequences"] + r["served"]["score_rows"] - b["served"]["sequences"]
              - b["served"]["score_rows"] for r, b in zip(ranks(), ranks_before)]
    assert sum(served) == len(prompts) + 3 + len(TEXTS) and min(served) > 0, served


def a2a_calls(url: str) -> dict[str, tuple[float, float]]:
    """Per rank of group 0, from /metrics: (all-to-all calls, rows computed by its experts), once the ranks are idle
    and two reads a second apart (two probes: the second is after whatever was answered before the call) agree."""
    from .test_server import parse

    deadline, last = time.monotonic() + 30, None
    while True:
        got = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        series = {name: {dict(k[1:])["rank"]: v for k, v in got.items() if k[0] == name}
                  for name in ("moeserve_ep_all_to_all_seconds_count", "moeserve_ep_computed_rows_total",
                               "moeserve_ep_running_sequences", "moeserve_ep_queue_depth")}
        now = {r: (n, series["moeserve_ep_computed_rows_total"][r])
               for r, n in series["moeserve_ep_all_to_all_seconds_count"].items()}
        idle = not any(series["moeserve_ep_running_sequences"].values()) and \
            not any(series["moeserve_ep_queue_depth"].values())
        if now and idle and now == last:
            return now
        assert time.monotonic() < deadline, series
        last = now
        time.sleep(1.0)  # two probes (probe_every_s 0.5)


def test_the_discrete_vq_table_is_built_through_the_exchange_then_served_without_it(url, tmp_path):
    """VQ (paper 002) in its discrete form (eq. 5), whose MoE layers are code tables: built through the exchange while
    each rank loads (one all-to-all per layer, every rank computing every code through all the experts), then served
    with no exchange at all: the calls stay at one per layer whatever is served, and the answers are the engine's,
    whose table is computed with every expert in one process. (Replaces the module's application.) The other routers
    answer over two ranks as one process in tests/runtime/test_expert_parallel.py, through the same rank loop this
    application runs: the ingress and its requests do not depend on the router or on how the experts are stored, so
    the softmax model's parity above stands for them here (quantized checkpoints too: int8 xmoe and int4 there, with
    each rank's parameters counted; two groups: test_ep_faults.py and test_ep_deploy.py)."""
    from ..runtime.test_expert_parallel import checkpoint as router_checkpoint

    ckpt = router_checkpoint(tmp_path, "vq-discrete", router="vq", vq_mode="discrete")
    serve.delete("moeserve")
    deploy(url, ckpt, ServeConfig(model_name="tiny", kv_slots=4))
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    before, calls_before = ranks(), a2a_calls(url)
    served_in_parallel(url, ref, before)
    calls = a2a_calls(url)
    n_layers = len(ref.model.cfg.moe_layer_ids)
    # the table: one exchange per layer at load, in which each rank's experts computed every rank's E codes
    assert calls == calls_before == {r: (n_layers, n_layers * ref.model.cfg.n_experts) for r in "01"}, calls


LONG = dict(max_tokens=440, temperature=0, extra_body={"ignore_eos": True})  # a context of 512: seconds on one rank
IDLE_S = 2.0  # the other ranks' idle spell beside it (440 steps of 4 ranks take longer even on a fast machine)
STALL_S = 3.0  # the probe's stall limit (ExpertParallelOptions.stall_s): far past a step, short of the generation


def test_four_ranks_and_one_busy_beside_idle_ones(url, tmp_path):
    """N = 4, one expert a rank, and the lockstep (runtime/ep_rank.py): one long generation, sent alone, keeps one
    rank busy for seconds while the other three have nothing of their own; they keep stepping with it (empty passes
    in the same collectives), none is taken for stalled by the supervisor's probe (a stall limit shorter than the
    generation) and no group restarts. Then requests land on every rank at once beside the long one, and every answer,
    the long one's included, is the single-process engine's. (Replaces the module's application.)"""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax", max_seq_len=512))
    ckpt = save_checkpoint(tmp_path / "long", model.cfg, model.state_dict())
    serve.delete("moeserve")
    t0 = time.monotonic()
    deploy(url, ckpt, ServeConfig(model_name="tiny", kv_slots=4, request_timeout_s=120), ranks=4, cpus_per_rank=0.4,
           stall_s=STALL_S, probe_every_s=0.25)
    up_s = time.monotonic() - t0
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    with ThreadPoolExecutor(1) as pool:
        sent = time.monotonic()
        long = pool.submit(lambda: client.completions.create(model="tiny", prompt="def f(x):", **LONG))
        deadline = time.monotonic() + 30
        while not any(r["running"] for r in ranks()):
            assert time.monotonic() < deadline and not long.done(), long.done() and long.result()
            time.sleep(0.05)
        info = ranks()
        busy = next(r["rank"] for r in info if r["running"])
        time.sleep(IDLE_S)
        idle = ranks()
        assert idle[busy]["running"] == 1 and not long.done(), "the long generation ended before the idle spell did"
        for before, after in zip(info, idle):  # every rank stepped through the spell, the idle ones on empty passes
            assert after["iterations"] > before["iterations"], (before, after)
            if after["rank"] != busy:
                assert after["served"] == before["served"] and after["empty_passes"] > before["empty_passes"]
        served_in_parallel(url, ref, idle)  # sent while the long one runs (above)
        got = long.result()
    took = time.monotonic() - sent
    print(f"\nN=4: up in {up_s:.1f} s; {LONG['max_tokens']} tokens on rank {busy} in {took:.1f} s")
    want = ref.complete(["def f(x):"], SamplingParams(max_new_tokens=LONG["max_tokens"], ignore_eos=True))[0]
    assert got.choices[0].text == want.text and got.usage.completion_tokens == LONG["max_tokens"]
    assert [(g["state"], g["restarts"]) for g in serve.get_deployment_handle("ingress", app_name="moeserve")
            .groups.remote().result()] == [("serving", 0)]


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
    (["--expert-parallel", "2", "--compile", "on", "--redundant-experts", "1"], "--compile on with "
                                                                             "--redundant-experts 1: a compiled rank"),
    (["--print-config", "--expert-parallel", "2", "--device", "cuda:0"], "--device 'cuda:0' with --ray"),
])
def test_bad_flags_are_named_errors(ckpt, capsys, argv, message):
    assert cli.main(["serve", str(ckpt), "--ray", *argv]) == 2
    assert message in capsys.readouterr().err


def test_compile_on_refuses_a_quantized_checkpoint_over_ranks(tmp_path, capsys):
    """A compiled rank exchanges through fixed-size buffers, which int8 / int4 experts (rows counted on the host) do
    not have: named before Ray starts."""
    from moeserve.runtime.quant import QuantSpec, quantize_model_

    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    quantize_model_(model, QuantSpec.parse("int8"))
    ckpt = save_checkpoint(tmp_path / "int8", model.cfg, model.state_dict())
    assert cli.main(["serve", str(ckpt), "--ray", "--expert-parallel", "2", "--compile", "on"]) == 2
    assert "--compile on with --expert-parallel 2" in capsys.readouterr().err
    # the ranks' own refusal (ep_rank.uncompilable_experts), made here too: a capacity limit's dropped rows
    capped = save_checkpoint(tmp_path / "capped", preset("tiny", capacity_factor=1.5), Transformer(
        preset("tiny", capacity_factor=1.5)).state_dict())
    assert cli.main(["serve", str(capped), "--ray", "--expert-parallel", "2", "--compile", "on"]) == 2
    assert "capacity_factor have no compiled exchange" in capsys.readouterr().err
