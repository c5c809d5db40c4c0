"""The Ray Serve application (`moeserve serve --ray --expert-shards S`) on a real local Ray, started once
for the module: over HTTP with the openai client its answers equal the single-process engine's (fp32,
1e-5) for S = 1, 2, 4 and the softmax, xmoe and vq (mixed and discrete) routers; each shard holds only
its slice of the experts and the ingress none; bad input gets the single-process server's 4xx answers."""

from __future__ import annotations

import importlib
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from ..conftest import wait_for_ray_to_exit, wait_ready
from moeserve.checkpoint import read_config, save_checkpoint
from moeserve.config import preset
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.model import Transformer
from moeserve.serve.state import ServeConfig

from . import test_bad_input as bad_input
from .test_server import parse

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
yaml = pytest.importorskip("yaml")

from moeserve.serve.config import RayServeOptions  # noqa: E402
from moeserve.serve.ray_app import build_app, shard_ranges  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)
PROMPTS = ["def f(x):", "import os\n", "class A:"]
TEXTS = ["hello world", "def g():\n    return 1\n" * 8]  # the second is past the context of 64: 3 windows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    port = free_port()
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 500})  # Ray's export within a second of a change
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    wait_for_ray_to_exit()


def checkpoint(root: Path, router: str, **kw) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router=router, **kw))  # context 64, byte tokenizer, 2 MoE layers of 4 experts
    if router == "vq":  # codes from real activations, so tokens spread over several experts
        with torch.no_grad():
            for layer in model.moe_layers:
                layer.quantizer.codebook.normal_()
                layer.quantizer.initialized.fill_(True)
    return save_checkpoint(root / f"{router}-{kw.get('vq_mode', '')}", model.cfg, model.state_dict())


def deploy(url: str, ckpt: Path, shards: int, serve_cfg: ServeConfig | None = None, app=None, name="moeserve",
           **options) -> None:
    opts = RayServeOptions(expert_shards=shards, cpus_per_shard=0.1, ingress_cpus=0.1, **options)
    app = app or build_app(ckpt, serve_cfg or ServeConfig(model_name="tiny"), opts)
    serve.run(app, name=name, route_prefix="/", blocking=False)
    assert wait_ready(url, 120) is not None, "the sharded application did not become ready"


@pytest.mark.cuda
def test_fractional_gpu_shards_share_one_gpu(url, tmp_path):
    """--gpus-per-shard 0.5: both shards of a 2-shard application on one GPU, each computing its experts there in
    fp32; the answers are the single-process CPU engine's."""
    ckpt = checkpoint(tmp_path, "softmax")
    deploy(url, ckpt, 2, exchange="handles", gpus_per_shard=0.5)
    placements = [serve.get_deployment_handle(f"experts-{s}", app_name="moeserve").placement.remote().result()
                  for s in range(2)]
    assert [p["device"] for p in placements] == ["cuda", "cuda"]
    assert len(placements[0]["gpu_ids"]) == 1 and placements[0]["gpu_ids"] == placements[1]["gpu_ids"]
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    greedy = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(greedy.choices, key=lambda c: c.index)] == ref.generate(PROMPTS, max_new_tokens=12)
    scores = httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": TEXTS}, timeout=60).json()["data"]
    for got, w in zip(scores, ref.score(TEXTS)):
        assert got["logprob"] == pytest.approx(w.logprob, abs=1e-5 * max(1.0, abs(w.logprob)))


@pytest.mark.parametrize("router, vq_mode, shards, exchange", [  # S = 1, 2, 4; every router; every exchange
    ("softmax", None, 1, "compiled"), ("xmoe", None, 2, "handles"), ("vq", "mixed", 2, "actors"),
    ("vq", "discrete", 4, "sockets"),  # one expert a shard, one a token: most shards have no rows to be sent
])
def test_sharded_answers_equal_the_single_process_engine(url, tmp_path, router, vq_mode, shards, exchange):
    ckpt = checkpoint(tmp_path, router, **({"vq_mode": vq_mode} if vq_mode else {}))
    deploy(url, ckpt, shards, exchange=exchange)
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    greedy = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    want = ref.generate(PROMPTS, max_new_tokens=12)
    assert [c.text for c in sorted(greedy.choices, key=lambda c: c.index)] == want
    seeded = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, top_p=0.95,
                                       seed=7)
    want = ref.complete([PROMPTS[0]], [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7)])
    assert seeded.choices[0].text == want[0].text

    scores = httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": TEXTS}, timeout=60).json()["data"]
    for got, w in zip(scores, ref.score(TEXTS)):
        assert got["logprob"] == pytest.approx(w.logprob, abs=1e-5 * max(1.0, abs(w.logprob)))
        assert (got["n_tokens"], got["windows"]) == (w.n_tokens, w.windows)

    # no process holds all the experts: each shard its slice, the ingress none
    cfg = ref.cfg
    per_expert = sum(p[0].numel() for p in ref.model.moe_layers[0].experts.parameters())
    ingress = serve.get_deployment_handle("ingress", app_name="moeserve")
    if exchange != "handles":  # the shards are the ingress's actors
        held = ingress.shard_parameter_counts.remote().result()
    else:
        places = [serve.get_deployment_handle(f"experts-{s}", app_name="moeserve").placement.remote().result()
                  for s in range(shards)]
        assert all(p["device"] == "cpu" and p["gpu_ids"] == [] for p in places)  # --gpus-per-shard 0
        held = [p["parameters"] for p in places]
    assert held == [len(r) * per_expert * len(cfg.moe_layer_ids) for r in shard_ranges(cfg.n_experts, shards)]
    dense = ingress.parameter_count.remote().result()
    assert dense == sum(p.numel() for p in ref.model.parameters()) - cfg.n_experts * per_expert * len(cfg.moe_layer_ids)


def series(samples: dict[tuple, float], name: str, *keys: str, **match: str) -> dict[tuple, float]:
    """`name`'s samples whose labels include `match`, by the values of `keys`."""
    out = {}
    for (n, *labels), v in samples.items():
        labels = dict(labels)
        if n == name and all(labels.get(k) == want for k, want in match.items()):
            out[tuple(labels[k] for k in keys)] = v
    return out


def ray_export() -> dict[tuple, float]:
    """What Prometheus scrapes from this Ray: every node's metrics agent (its MetricsExportPort)."""
    out = {}
    for node in ray.nodes():
        if node["Alive"]:
            addr = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            out.update(parse(httpx.get(addr, timeout=10).text))
    return out


def test_metrics_reach_the_ingress_and_rays_export(url, tmp_path):
    """The ingress's /metrics has the single-process series plus each shard's exchange and routed rows, the
    rows per shard adding up to the per-expert load; Ray's metrics export, which Prometheus scrapes, has the
    same series under `ray_` with the same values once Ray has reported them."""
    serve.delete("moeserve")  # an application of its own: Ray's export may still hold earlier replicas' series
    try:
        ckpt = checkpoint(tmp_path, "softmax")
        deploy(url, ckpt, 2, name="metrics")
        before = parse(httpx.get(f"{url}/metrics", timeout=10).text)  # the warm-up's exchanges are counted
        for prompt in PROMPTS:
            assert complete(url, prompt).status_code == 200
        assert httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": TEXTS}, timeout=60).status_code == 200
        own = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        answered = series(own, "moeserve_requests_total", "endpoint", status="200")
        assert (answered[("/v1/completions",)], answered[("/v1/score",)]) == (3.0, 1.0)

        load = series(own, "moeserve_expert_routed_tokens_total", "layer", "expert")  # since the warm-up
        rows = {k: v - series(before, "moeserve_shard_routed_tokens_total", "shard")[k]
                for k, v in series(own, "moeserve_shard_routed_tokens_total", "shard").items()}
        ranges = shard_ranges(read_config(ckpt).n_experts, 2)
        assert rows == {(str(s),): sum(v for (_, e), v in load.items() if int(e) in r) for s, r in enumerate(ranges)}
        assert all(v > 0 for v in rows.values())
        exchanges = series(own, "moeserve_shard_exchange_seconds_count", "shard")
        assert exchanges == series(own, "moeserve_shard_compute_seconds_count", "shard") and min(exchanges.values()) > 0
        for s in ("0", "1"):  # an exchange is its shard's compute plus transport
            wall = series(own, "moeserve_shard_exchange_seconds_sum", "shard")[s,]
            assert 0 < series(own, "moeserve_shard_compute_seconds_sum", "shard")[s,] < wall

        wanted = {  # Ray's name -> (the ingress's name, label keys)
            "ray_moeserve_requests_total": ("moeserve_requests_total", ("endpoint", "status")),
            "ray_moeserve_expert_routed_tokens_total": ("moeserve_expert_routed_tokens_total", ("layer", "expert")),
            "ray_moeserve_shard_routed_tokens_total": ("moeserve_shard_routed_tokens_total", ("shard",)),
            "ray_moeserve_shard_exchange_seconds_count": ("moeserve_shard_exchange_seconds_count", ("shard",)),
            "ray_moeserve_time_to_first_token_seconds_count": ("moeserve_time_to_first_token_seconds_count", ()),
            "ray_moeserve_ready": ("moeserve_ready", ()),
        }
        def view(samples: dict, name: str, keys: tuple, **match) -> dict:  # scrapes of /metrics count as they go
            return {k: v for k, v in series(samples, name, *keys, **match).items() if "/metrics" not in k}

        want = {name: view(own, mine, keys) for name, (mine, keys) in wanted.items()}
        deadline, got = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            exported = ray_export()
            got = {name: view(exported, name, keys, application="metrics", deployment="ingress")
                   for name, (_, keys) in wanted.items()}
            if got == want:
                break
            time.sleep(0.5)
        assert got == want
    finally:
        serve.delete("metrics")


def test_serve_lets_the_ingress_fill_its_cache_slots(url, tmp_path):
    """Serve lets in every request the app can hold, so 16 concurrent requests share steps of up to 16 rows
    (Serve's default of 5 requests per replica kept the others waiting in Ray's proxy: never more than 5 rows
    a step, and the app's queue bound never reached)."""
    from concurrent.futures import ThreadPoolExecutor

    deploy(url, checkpoint(tmp_path, "softmax"), 1, ServeConfig(model_name="tiny", kv_slots=16))
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(16)))
    assert [r.status_code for r in answers] == [200] * 16
    steps = series(parse(httpx.get(f"{url}/metrics", timeout=10).text), "moeserve_batch_size_bucket", "le",
                   kind="complete")
    assert steps[("+Inf",)] - steps[("8.0",)] >= 10, steps  # steps of more than 8 rows


def test_a_hugging_face_mixtral_directory_is_sharded_as_it_is(url, tmp_path):
    """A transformers-written Mixtral (per-expert tensors, no conversion step): each shard reads its experts'
    tensors from the directory, the ingress everything else, and the answers are the single process's."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    words = ["<unk>", "<bos>", "<eos>", *[f"w{i}" for i in range(61)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))

    deploy(url, tmp_path / "hf", 2)
    ref = Engine.load(tmp_path / "hf", dtype="float32", device="cpu")
    prompts = ["w1 w2 w3", "w40 w7"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
    assert [c["text"] for c in sorted(got, key=lambda c: c["index"])] == ref.generate(prompts, max_new_tokens=8)
    held = serve.get_deployment_handle("ingress", app_name="moeserve").shard_parameter_counts.remote().result()
    per_expert = 3 * 96 * 64 * 2  # w1, w2, w3 of each of 2 layers
    assert held == [2 * per_expert, 2 * per_expert]


def test_expert_shard_ranges():
    assert shard_ranges(8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert shard_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="--expert-shards 5: expected 1..4"):
        shard_ranges(4, 5)
    with pytest.raises(ValueError, match="shard_replicas = 0"):
        RayServeOptions(shard_replicas=0)
    with pytest.raises(ValueError, match="gpus_per_shard = -0.5"):
        RayServeOptions(gpus_per_shard=-0.5)
    for exchange in ("sockets", "compiled", "actors"):
        with pytest.raises(ValueError, match=f"needs --exchange handles: with {exchange}, the shards are single"):
            RayServeOptions(shard_replicas=2, exchange=exchange)
    with pytest.raises(ValueError, match="exchange = 'graph': expected one of sockets, compiled, actors, handles"):
        RayServeOptions(exchange="graph")


def test_shard_cpus_fit_the_cluster():
    assert RayServeOptions(expert_shards=2).fitted(2).cpus_per_shard == 0.5  # a 2-core machine: the ingress has 1
    assert RayServeOptions(expert_shards=2).fitted(16).cpus_per_shard == 1.0
    assert RayServeOptions(expert_shards=4, shard_replicas=2, exchange="handles").fitted(2).cpus_per_shard == 0.1
    assert RayServeOptions(expert_shards=2, cpus_per_shard=2.0).fitted(2).cpus_per_shard == 2.0  # asked: kept
    RayServeOptions(expert_shards=2).fitted(2).check_fits(2, 0)
    with pytest.raises(ValueError, match=r"needs 3 CPUs and 0 GPUs \(2 shards x 1 replicas at --cpus-per-shard 1 "
                                         r"--gpus-per-shard 0, and the ingress\); the cluster has 2 CPUs and 0 GPUs"):
        RayServeOptions(expert_shards=2, cpus_per_shard=1.0).check_fits(2, 0)
    with pytest.raises(ValueError, match="needs 1 CPUs and 1 GPUs"):
        RayServeOptions(expert_shards=2, cpus_per_shard=0.0, gpus_per_shard=0.5).check_fits(4, 0)


def test_printed_config_is_a_serve_deploy_file_whose_builder_serves(url, tmp_path):
    """`--print-config` writes what `serve deploy` accepts, and its import_path builds from its args an
    application that serves (deployed here from those args, as `serve deploy` would)."""
    from ray.serve.schema import ServeDeploySchema

    ckpt = checkpoint(tmp_path, "xmoe")
    r = subprocess.run([sys.executable, "-m", "moeserve.cli", "serve", str(ckpt), "--print-config", "--expert-shards",
                        "2", "--gpus-per-shard", "0.5", "--model-name", "tiny", "--exchange", "handles"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    config = yaml.safe_load(r.stdout)
    schema = ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert [d.name for d in schema.applications[0].deployments] == ["ingress", "experts-0", "experts-1"]
    assert app["deployments"][1]["ray_actor_options"]["num_gpus"] == 0.5
    assert app["deployments"][0]["max_ongoing_requests"] == 256 + 32 + 32  # queue, batch rows, probes
    module, name = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    args = {**app["args"], "options": {**app["args"]["options"], "gpus_per_shard": 0.0, "cpus_per_shard": 0.1,
                                       "ingress_cpus": 0.1}}  # this machine has no GPU
    deploy(url, ckpt, 2, app=builder(args))
    got = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8,
                                                     "temperature": 0}, timeout=60).json()
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    assert got["choices"][0]["text"] == ref.generate([PROMPTS[0]], max_new_tokens=8)[0]


# ---- bad input: the single-process server's matrix (test_bad_input.py) through Ray Serve ------------
@pytest.fixture(scope="module")
def sharded_tiny(url, tiny_ckpt, tiny_chat_template):
    deploy(url, tiny_ckpt, 2, ServeConfig(model_name="tiny", chat_template=tiny_chat_template))
    return types.SimpleNamespace(url=url)


@pytest.mark.parametrize("case", [c for c in bad_input.CASES if c.values[0].server == "live"])
def test_bad_input_gets_the_same_answers(sharded_tiny, case):
    bad_input.assert_answer(bad_input.send(sharded_tiny, case), case)


def test_cli_serves_until_sigterm(tmp_path):
    """`moeserve serve CKPT --ray`: its own Ray, ready, serving, and gone at SIGTERM with exit status 0;
    `--no-access-log` reaches the replicas (no line per request)."""
    ckpt, port = checkpoint(tmp_path, "softmax"), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", str(ckpt), "--ray", "--expert-shards", "2",
                             "--cpus-per-shard", "0.1", "--port", str(port), "--model-name", "tiny",
                             "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while "is ready on" not in (line := proc.stderr.readline()):
            assert line or proc.poll() is None, f"exited {proc.returncode} before it was ready"
            assert time.monotonic() < deadline, "not ready in 180 s"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4,
                                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
        assert "Deleting app" in rest and "POST /v1/completions" not in rest, rest[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- faults --------------------------------------------------------------------------------------
def kill_a_replica(deployment: str) -> int:
    """Kill one replica of `deployment` as a crash would (Serve's own fault-tolerance recipe); how many it had.
    (With --exchange handles: the shards are deployments.)"""
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    return len(replicas)


def complete(url: str, prompt: str = "def f(x):") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0}, timeout=60)


def test_a_killed_shard_replica_with_a_second_one_fails_no_request(url, tmp_path):
    ckpt = checkpoint(tmp_path, "softmax")
    deploy(url, ckpt, 2, shard_replicas=2, exchange="handles")
    want = Engine.load(ckpt, dtype="float32", device="cpu").generate(["def f(x):"], max_new_tokens=16)[0]
    answers, killed = [], 0
    for i in range(12):
        if i == 4:
            killed = kill_a_replica("experts-0")
        answers.append(complete(url))
    assert killed == 2
    assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers if r.status_code != 200]
    assert {r.json()["choices"][0]["text"] for r in answers} == {want}


def test_with_one_replica_requests_fail_fast_with_503_until_it_is_replaced(url, tmp_path):
    """The default exchange (the ingress's shard actors over sockets): an actor killed is restarted by Ray, and
    connected to again."""
    deploy(url, checkpoint(tmp_path, "softmax"), 2, ServeConfig(model_name="tiny", request_timeout_s=20),
           shard_timeout_s=2.0)
    assert complete(url).status_code == 200
    ray.kill(ray.get_actor("moeserve-experts-1", namespace="moeserve"), no_restart=False)
    killed_at, seen = time.monotonic(), []
    while time.monotonic() - killed_at < 60:
        t = time.monotonic()
        r = complete(url)
        seen.append((round(t - killed_at, 1), r.status_code, round(time.monotonic() - t, 1)))
        if r.status_code == 200:
            break
        err = r.json()["error"]
        assert (r.status_code, err["code"], r.headers.get("retry-after")) == (503, "unavailable", "1"), r.text
        assert time.monotonic() - t < 2.0 + 3.0, seen  # the shard timeout and a little, never the 20 s deadline
    assert seen[-1][1] == 200 and seen[-1][0] < 30, seen  # whole again within 30 s of the kill
    assert any(status == 503 for _, status, _ in seen), seen  # the outage was seen, and answered fast


def test_a_scoring_batch_that_meets_a_killed_shard_answers_every_request_at_once(url, tmp_path):
    """Four scoring requests in flight when a shard dies: each is answered within the shard timeout and a little,
    503 while the shard is away (or 200 once Ray has restarted it), never the 20 s deadline's 504: a batch whose
    exchange fails answers every request in it, not only the first."""
    import concurrent.futures

    deploy(url, checkpoint(tmp_path, "softmax"), 2, ServeConfig(model_name="tiny", request_timeout_s=20),
           shard_timeout_s=2.0)
    texts = ["def f(x):\n    return x\n" * k for k in (1, 2, 3, 4)]

    def score(text: str) -> tuple[int, str, float]:
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/score", json={"model": "tiny", "input": text}, timeout=60)
        return r.status_code, r.json().get("error", {}).get("code", ""), time.monotonic() - t

    assert score(texts[0])[0] == 200
    ray.kill(ray.get_actor("moeserve-experts-1", namespace="moeserve"), no_restart=False)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(score, texts))
    assert all(status in (200, 503) for status, _, _ in answers), answers
    assert all(code == "unavailable" for status, code, _ in answers if status == 503), answers
    assert any(status == 503 for status, _, _ in answers), answers  # the outage was met
    # one shard timeout for the batch that met it, one more for a batch taken meanwhile, and a little
    assert max(took for *_, took in answers) < 2 * 2.0 + 3.0, answers
