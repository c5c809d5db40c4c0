"""`moeserve serve --ray` as a user deploys it, on a real local Ray started once for the module (gloo on CPU):

- `--print-config` writes a file that `serve deploy` accepts, whose builder (ep_app.app_builder), given the file's
  args as Serve gives them, serves: here `--ray --data-parallel-groups 2` without --expert-parallel, so two groups of
  one rank each holding every expert (a gloo group of world size 1), answering as one process does;
- the CLI, `moeserve serve CKPT --ray --expert-parallel 2`, joins the cluster at $RAY_ADDRESS (this module's), says
  when it is ready, serves, and at SIGTERM deletes its application and exits 0, leaving the cluster running;
- the retired shard exchange's flags are named errors with exit status 2, and the groups' CPU bundles fit a small
  cluster or are refused by name.

The answers, requests over both ranks and the bad-input matrix are test_ep_serve.py's; faults test_ep_faults.py's;
a Hugging Face directory over two ranks (each reading its experts' tensors from it) is
tests/runtime/test_expert_parallel.py's."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
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
from moeserve.runtime.engine import Engine
from moeserve.runtime.model import Transformer
from moeserve.serve.config import ExpertParallelOptions

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest.py)
PROMPTS = ["def f(x):", "import os\n", "class A:", "x = [i for i"]
CLI = [sys.executable, "-m", "moeserve.cli"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))  # context 64, byte tokenizer, 2 MoE layers of 4 experts
    return save_checkpoint(tmp_path_factory.mktemp("epd") / "tiny", model.cfg, model.state_dict())


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def url(port):
    with ray_serve_on(port) as url:
        yield url


def ranks() -> list[dict]:
    return serve.get_deployment_handle("ingress", app_name="moeserve").ranks.remote().result()


def complete_all(url: str, prompts: list[str], max_tokens: int = 8) -> list[str]:
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the router spreads them over the groups' ranks
        got = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120),
                            prompts))
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    return [r.json()["choices"][0]["text"] for r in got]


def replica_log(deployment: str = "ingress") -> str:
    """The running replica of `deployment`'s Serve log file (Serve writes a file per replica, named by its id)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    assert len(names) == 1, names
    replica = names[0].rsplit("#", 1)[1]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    files = list(logs.glob(f"replica_moeserve_{deployment}_{replica}*.log"))
    assert files, sorted(p.name for p in logs.iterdir())
    return "".join(p.read_text() for p in files)


def test_printed_config_is_a_serve_deploy_file_whose_builder_serves(url, ckpt):
    """`--ray` alone is --expert-parallel 1: two groups (--data-parallel-groups 2) of one rank with every expert."""
    from ray.serve.schema import ServeDeploySchema

    r = subprocess.run([*CLI, "serve", str(ckpt), "--ray", "--print-config", "--data-parallel-groups", "2",
                        "--model-name", "tiny", "--kv-slots", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    config = yaml.safe_load(r.stdout)
    schema = ServeDeploySchema.model_validate(config)
    assert [d.name for d in schema.applications[0].deployments] == ["ingress"]  # the ranks are the ingress's actors
    app = config["applications"][0]
    assert app["import_path"] == "moeserve.serve.ep_app:app_builder" and app["route_prefix"] == "/"
    options = app["args"]["options"]
    assert (options["ranks"], options["groups"], options["cpus_per_rank"], options["placement"]) == (1, 2, 1.0,
                                                                                                      "strict-pack")
    assert options["compile"] == "auto"  # --compile's default: a group of one rank loads as one process does
    assert app["args"]["device"] == "auto" and app["args"]["serve"]["api_key"] is None  # never written to a file
    # Serve lets in all that the app can hold: its queue, every rank's cache slots (or a batch's rows), and probes
    assert app["deployments"][0]["max_ongoing_requests"] == 256 + max(4 * 2, 32) + 32
    assert app["deployments"][0]["num_replicas"] == 1
    assert app["deployments"][0]["graceful_shutdown_wait_loop_s"] == 0.25  # an idle ingress stops in ~0.25 s, not 2

    module, name = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    args = {**app["args"], "options": {**options, "cpus_per_rank": 0.5, "ingress_cpus": 0.1,
                                       "ready_timeout_s": 120}}  # a 2-CPU Ray
    serve.run(builder(args), name="moeserve", route_prefix="/", blocking=False)
    assert wait_ready(url, 120) is not None, "the application from the printed config did not become ready"

    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    assert complete_all(url, PROMPTS) == ref.generate(PROMPTS, max_new_tokens=8)
    info = ranks()
    assert [(r["group"], r["rank"], r["world"], r["backend"]) for r in info] == [(0, 0, 1, "gloo"), (1, 0, 1, "gloo")]
    assert all(r["experts"] == [[0, 1, 2, 3]] * 2 for r in info)  # one rank: every expert of both MoE layers
    assert all(r["served"]["sequences"] > 0 for r in info), info  # both groups served
    deadline = time.monotonic() + 10  # the access log is on by default (the CLI test below turns it off)
    while "POST /v1/completions" not in replica_log():
        assert time.monotonic() < deadline, replica_log()[-2000:]
        time.sleep(0.5)


def test_cli_joins_the_cluster_at_ray_address_and_serves_until_sigterm(url, port, ckpt):
    """`moeserve serve CKPT --ray --expert-parallel 2` with $RAY_ADDRESS: its application runs on this module's Ray
    (seen here, and answering on this Ray's Serve port), `--no-access-log` reaches its replica, and SIGTERM deletes
    the application and exits 0 with the cluster still up."""
    serve.delete("moeserve")  # the CPUs for the CLI's groups
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen([*CLI, "serve", str(ckpt), "--ray", "--expert-parallel", "2", "--cpus-per-rank", "0.5",
                             "--port", str(port), "--model-name", "tiny", "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while "is ready on" not in (line := proc.stderr.readline()):
            assert line or proc.poll() is None, f"exited {proc.returncode} before it was ready"
            assert time.monotonic() < deadline, "not ready in 180 s"
        assert "1 expert-parallel group(s) of 2 rank(s), 0.5 CPU each (gloo)" in line, line
        assert "moeserve" in serve.status().applications  # deployed on this module's cluster, not a Ray of its own
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert [(i["group"], i["rank"], i["world"]) for i in ranks()] == [(0, 0, 2), (0, 1, 2)]
        time.sleep(1.0)  # an access log line, were there one, is written as the request ends
        assert "POST /v1/completions" not in replica_log()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
        assert "moeserve" not in serve.status().applications
        assert ray.cluster_resources().get("CPU") == 2  # the cluster outlives the CLI that joined it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag, value", [("--expert-shards", "2"), ("--shard-replicas", "2"),
                                         ("--cpus-per-shard", "0.5"), ("--gpus-per-shard", "0.5"),
                                         ("--ingress-gpus", "1"), ("--shard-timeout", "10"),
                                         ("--exchange", "sockets")])
def test_the_shard_exchanges_flags_are_retired_by_name(ckpt, capsys, flag, value):
    assert cli.main(["serve", str(ckpt), "--ray", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} was the shard exchange's, which is retired: serve with --ray --expert-parallel N" in err, err
    assert flag not in " ".join(build_help().split())  # not offered


def build_help() -> str:
    p = cli.build_parser()
    return next(a for a in p._actions if a.dest == "command").choices["serve"].format_help()


def test_rank_bundles_fit_the_cluster():
    assert ExpertParallelOptions(ranks=2).fitted(2).cpus_per_rank == 0.7  # (2 - the ingress's 0.5) / 2, floored
    assert ExpertParallelOptions(ranks=2).fitted(16).cpus_per_rank == 1.0
    assert ExpertParallelOptions(ranks=4, groups=2).fitted(2).cpus_per_rank == 0.1  # at least 0.1 each
    assert ExpertParallelOptions(ranks=2, cpus_per_rank=2.0).fitted(2).cpus_per_rank == 2.0  # asked: kept
    assert ExpertParallelOptions(ranks=2, gpus=True).fitted(2).cpus_per_rank == 0.0  # a GPU rank takes no CPU bundle
    ExpertParallelOptions(ranks=2).fitted(2).check_fits(2, 0)
    with pytest.raises(ValueError, match=r"1 group\(s\) x 2 ranks need 2.5 CPUs and 0 GPUs \(--cpus-per-rank 1, and "
                                         r"the ingress's 0.5\); the cluster has 2 CPUs and 0 GPUs"):
        ExpertParallelOptions(ranks=2, cpus_per_rank=1.0).check_fits(2, 0)
    with pytest.raises(ValueError, match="need 0.5 CPUs and 4 GPUs"):
        ExpertParallelOptions(ranks=2, groups=2, gpus=True).fitted(8).check_fits(8, 2)
