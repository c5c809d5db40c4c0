"""The ONNX backend end to end: an exported file behind the Engine's calls (score, generate, classify, route,
expert load) equals the torch Engine on the same checkpoint; the CLI's export / score / serve over it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import onnx
import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.export.onnx_export import export_onnx
from moeserve.export.tensorrt import build_engine, unsupported_ops
from moeserve.runtime.engine import Engine, EngineError, SamplingParams, load_engine
from moeserve.runtime.model import Transformer
from moeserve.runtime.backends.onnx import OnnxBackend
from moeserve.serve.state import ServeConfig

from ..serve.conftest import live_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["import os\nprint(os.getcwd())", "x", "def f(a, b):\n    return a + b\n", "héllo ✓"]


def checkpoint(root: Path, name: str, **overrides) -> Path:
    """Random weights with init_std 0.1: logits spread enough that greedy choices are not near-ties."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", init_std=0.1, **overrides))
    if model.cfg.router == "vq":
        for layer in model.moe_layers:
            layer.quantizer.initialized.fill_(True)
    return save_checkpoint(root / name, model.cfg, model.state_dict())


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, its fused export)."""
    root = tmp_path_factory.mktemp("onnx-backend")
    ckpt = checkpoint(root, "xmoe", router="xmoe")
    return ckpt, Path(export_onnx(ckpt, root / "xmoe.onnx", "fused").output)


def test_scores_generations_routes_and_load_equal_the_torch_engine(lm):
    ckpt, onnx_path = lm
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(onnx_path)
    assert isinstance(got.runner, OnnxBackend) and got.runner.mode == "fused"
    for a, b in zip(got.score(TEXTS), ref.score(TEXTS)):
        assert a.n_tokens == b.n_tokens and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    ref.expert_load.reset(), got.expert_load.reset()
    prompts = ["def ", "import numpy as np\n", "x"]  # unequal lengths: left padding, recomputed every step
    assert got.generate(prompts, max_new_tokens=12) == ref.generate(prompts, max_new_tokens=12)
    assert torch.equal(got.expert_load.snapshot(), ref.expert_load.snapshot())  # padding and recompute not counted
    assert got.route("a route") == ref.route("a route")
    logits = got.forward(torch.tensor([[1, 5, 9]]))
    assert torch.allclose(logits, ref.forward(torch.tensor([[1, 5, 9]])), atol=1e-4)


@pytest.mark.parametrize("mode", ["portable", "fused"])
def test_kv_cache_export_decodes_like_the_torch_engine(lm, tmp_path, mode):
    ckpt, _ = lm
    report = export_onnx(ckpt, tmp_path / "kv.onnx", mode, kv_cache=True)
    assert report.kv_cache and report.outputs["logits, cached step"]["max_abs_diff"] <= 1e-4
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(report.output)
    assert got.runner.kv_cache
    prompts = ["def ", "import numpy as np\n", "x"]
    assert got.generate(prompts, max_new_tokens=12) == ref.generate(prompts, max_new_tokens=12)
    assert torch.equal(got.expert_load.snapshot(), ref.expert_load.snapshot())  # each token routed once
    for a, b in zip(got.score(TEXTS), ref.score(TEXTS)):  # scoring feeds an empty cache
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    names = {i.name for i in got.runner.session.get_inputs()}
    assert {"past_key.0", "past_value.1"} <= names
    if mode == "portable":
        assert unsupported_ops(onnx.load(report.output)) == []
        with pytest.raises(ValueError, match="KV-cache graph"):
            build_engine(report.output, tmp_path / "kv.plan")


class CountedSession:
    """An onnxruntime session with its calls counted by kind: run (numpy in and out) or run_with_iobinding."""

    def __init__(self, session):
        self.session, self.calls = session, {"run": 0, "run_with_iobinding": 0}

    def __getattr__(self, name):
        if name in self.calls:
            self.calls[name] += 1
        return getattr(self.session, name)


@pytest.mark.parametrize("kv", [True, False], ids=["kv-cache", "plain"])
def test_a_decode_step_is_one_session_call_for_every_sequence(lm, tmp_path, kv):
    """Sequences join, finish and give their slots to others mid-flight: each decode step is one session call
    whatever its batch, its cache bound on the device, and the tokens are the torch engine's."""
    from moeserve.runtime.steps import Sequence

    ckpt, fused = lm
    path = export_onnx(ckpt, tmp_path / "kv.onnx", "fused", kv_cache=True).output if kv else fused
    ref, got = Engine.load(ckpt, dtype="float32", device="cpu"), load_engine(path)
    got.runner.session = session = CountedSession(got.runner.session)
    prompts = ["def ", "import numpy as np\n", "x", "class A:\n    pass\n", "héllo"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 4, 12, 6, 7)]
    want = [ref.complete([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    steps = got.step_engine(slots=3, prefill_chunk=6)
    seqs = [Sequence(got.encode(p), sp) for p, sp in zip(prompts, params)]
    steps.add(seqs[0])
    steps.step(), steps.step()
    for seq in seqs[1:]:  # 3 slots, 5 sequences: two wait for a slot to come free
        steps.add(seq)
    decodes = []
    runner = steps.runner
    decode = runner.decode

    def counted(cache, slots, ids_B, positions):
        before = session.calls["run_with_iobinding"]
        out = decode(cache, slots, ids_B, positions)
        decodes.append((len(slots), session.calls["run_with_iobinding"] - before))
        if kv:  # the batch's keys and values are this call's present outputs, on the runner's device, its rows
            # in the step engine's order (which appends joiners, as the batch does: no reorder a step)
            assert cache.rows.slots == slots and cache.rows.past[0].shape[0] == len(slots)
            assert cache.rows.past[0].device == runner.device
        return out

    runner.decode = counted
    while not steps.idle:
        steps.step()
    assert [s.out for s in seqs] == want
    assert max(rows for rows, _ in decodes) == 3 and {calls for _, calls in decodes} == {1}
    assert session.calls["run"] == 0  # nothing through numpy
    assert session.calls["run_with_iobinding"] == steps.model_calls == runner.session_calls


def test_the_decode_batch_answers_in_the_callers_order(lm, tmp_path):
    """The batch keeps its own row order (joiners appended), so the caller's order may differ from it: the logits
    and expert choices come back in the caller's order, exactly as from a batch made in that order."""
    ckpt, _ = lm
    runner = load_engine(export_onnx(ckpt, tmp_path / "kv.onnx", "fused", kv_cache=True).output).runner
    prompts = [torch.tensor(t) for t in ([5, 9, 2, 7], [3, 3], [8, 1, 4, 4, 6, 2])]
    caches = [runner.new_cache(3, 64), runner.new_cache(3, 64)]
    for cache in caches:
        for slot, ids in enumerate(prompts):
            runner.prefill(cache, slot, ids, 0)
    a, b = caches
    runner.decode(a, [0, 1, 2], torch.tensor([1, 2, 3]), [4, 2, 6])  # a's batch: rows 0, 1, 2
    runner.decode(b, [1, 2], torch.tensor([2, 3]), [2, 6])
    runner.prefill(b, 0, torch.tensor([1]), 4)  # the same token for slot 0, as a prompt's last chunk
    steps = [([0, 1, 2], [7, 8, 9], [5, 3, 7]), ([2, 0, 1], [4, 6, 5], [8, 6, 4])]
    for k, (order, ids, positions) in enumerate(steps):
        want = runner.decode(a, order, torch.tensor(ids), positions)
        got = runner.decode(b, order, torch.tensor(ids), positions)
        assert (a.rows.slots, b.rows.slots) == ([0, 1, 2], [1, 2, 0])  # b: 1 and 2 stayed, 0 joined
        assert torch.allclose(got.logits, want.logits, atol=1e-5), k
        for x, y in zip(got.aux, want.aux):
            assert torch.equal(x.routing.expert_ids, y.routing.expert_ids), k
            assert torch.equal(x.counts, y.counts), k
    fresh = runner.new_cache(3, 64)
    for slot in (1, 2, 0):  # each slot given a new prompt: out of the batch, the last one leaving it empty
        runner.prefill(b, slot, torch.tensor([4, 4, slot]), 0)
        runner.prefill(fresh, slot, torch.tensor([4, 4, slot]), 0)
    assert b.rows is None and sorted(b.alone) == [0, 1, 2]
    want = runner.decode(fresh, [0, 1, 2], torch.tensor([5, 6, 7]), [3, 3, 3])
    assert torch.allclose(runner.decode(b, [0, 1, 2], torch.tensor([5, 6, 7]), [3, 3, 3]).logits, want.logits,
                          atol=1e-6)


def test_a_kv_graph_without_positions_is_refused(tmp_path):
    """An export from before moeserve-onnx/2 takes one past length for every row, so it cannot batch a step."""
    from onnx import TensorProto, helper

    cfg = preset("tiny")
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]),
              helper.make_tensor_value_info("past_key.0", TensorProto.FLOAT, ["b", cfg.kv_heads, "p", cfg.head_dim])]
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.INT64, ["b", "s"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {"moeserve.config": cfg.to_json(), "moeserve.format": "moeserve-onnx/1"})
    (tmp_path / "old.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(EngineError, match="export it again with moeserve export onnx --kv-cache"):
        load_engine(tmp_path / "old.onnx")


def test_classifier_probabilities_equal_the_torch_engine(tmp_path):
    ckpt = checkpoint(tmp_path, "cls", task="classify", n_classes=3, causal=False, router="softmax")
    onnx_path = Path(export_onnx(ckpt, tmp_path / "cls.onnx", "fused").output)
    got, ref = load_engine(onnx_path).classify(TEXTS), Engine.load(ckpt, dtype="float32").classify(TEXTS)
    assert torch.allclose(torch.tensor(got), torch.tensor(ref), atol=1e-5)
    with pytest.raises(EngineError, match="language model"):
        load_engine(onnx_path).score(["x"])
    with pytest.raises(ValueError, match="--kv-cache is for language models"):
        export_onnx(ckpt, tmp_path / "cls-kv.onnx", "fused", kv_cache=True)
    assert not (tmp_path / "cls-kv.onnx").exists()


def test_load_errors_are_named(lm, tmp_path):
    ckpt, onnx_path = lm
    with pytest.raises(EngineError, match="no such ONNX file"):
        load_engine(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(EngineError, match="onnxruntime cannot load it"):
        load_engine(tmp_path / "junk.onnx")
    with pytest.raises(EngineError, match="float32"):
        load_engine(onnx_path, dtype="bfloat16")
    with pytest.raises(EngineError, match="--backend onnx"):
        load_engine(onnx_path, backend="torch")
    with pytest.raises(EngineError, match="backend 'tensorflow'"):
        load_engine(ckpt, backend="tensorflow")
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        with pytest.raises(EngineError, match="no CUDA provider"):
            load_engine(onnx_path, device="cuda")


def test_cuda_needs_a_torch_that_sees_the_gpu(monkeypatch):
    """onnxruntime-gpu beside a CPU-only torch: the runner binds its tensors with torch, so 'cuda' is refused by
    name and 'auto' stays on the CPU (a GPU cannot be had here, so the provider list is what is faked)."""
    import onnxruntime as ort

    from moeserve.runtime.backends.onnx import onnx_providers

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match="sees no CUDA device"):
        onnx_providers("cuda")
    assert onnx_providers("auto") == (["CPUExecutionProvider"], torch.device("cpu"), None)


def test_a_foreign_onnx_file_is_refused(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "foreign.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(EngineError, match="not written by moeserve export onnx"):
        load_engine(tmp_path / "foreign.onnx")


@pytest.fixture
def two_torch_threads():
    """Torch at two threads while a test runs (this module's others run with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_serving_an_export_over_http(lm, two_torch_threads):
    ckpt, onnx_path = lm
    ref = Engine.load(ckpt, dtype="float32", device="cpu")
    with live_server(lambda: load_engine(onnx_path), ServeConfig(model_name="tiny-onnx")) as live:
        r = live.post("/v1/completions", {"model": "tiny-onnx", "prompt": "def ", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.generate("def ", max_new_tokens=8)[0]
        r = live.post("/v1/score", {"model": "tiny-onnx", "input": TEXTS[:2]}).json()
        for item, want in zip(r["data"], ref.score(TEXTS[:2])):
            assert item["logprob"] == pytest.approx(want.logprob, abs=1e-3)
        metrics = live.client.get("/metrics").text
        assert 'moeserve_expert_routed_tokens_total{expert="0",layer="0"}' in metrics
        assert live.state.torch_threads == 1  # the session has the threads; torch, which only samples, one


# ---- the command line ------------------------------------------------------------------------------
def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_cli_export_score_and_failures(lm, tmp_path, capsys):
    """Export and score as real processes; the export's refusals through main() in this process (a process each
    would cost ~3 s of imports), but for the last, whose exit status 2 is a real process's."""
    from moeserve.cli import main

    ckpt, _ = lm
    out = tmp_path / "m.onnx"
    p = cli("export", "onnx", ckpt, "--out", out, "--mode", "portable", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "parity PASSED" in p.stdout and "top-1 agreement" in p.stdout
    report = json.loads((tmp_path / "m.onnx.report.json").read_text())
    assert report["passed"] and report["mode"] == "portable" and report["opset"] == 17

    lines = ["import os", "x = 1", "héllo ✓"]
    texts = tmp_path / "in.txt"
    texts.write_text("\n".join(lines) + "\n")
    p = cli("score", out, "--input", texts, "--output", tmp_path / "scores.jsonl", "--quiet")
    assert p.returncode == 0, p.stderr
    scores = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    want = Engine.load(ckpt, dtype="float32").score(lines)
    assert [s["logprob"] for s in scores] == pytest.approx([w.logprob for w in want], abs=1e-3)

    before = sorted(p.name for p in tmp_path.iterdir())
    for args, needle in [(("onnx", tmp_path / "nope", "--out", tmp_path / "a.onnx"), "does not exist"),
                         (("onnx", ckpt, "--out", tmp_path / "a.onnx", "--mode", "vq-table"), "vq-table"),
                         (("onnx", ckpt, "--out", tmp_path / "no" / "a.onnx"), "does not exist"),
                         (("onnx", ckpt, "--out", tmp_path), "is a directory")]:
        assert main(["export", *map(str, args), "--quiet"]) == 2, args
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (args, err)
    p = cli("export", "onnx", ckpt, "--out", tmp_path / "a.onnx", "--mode", "turbo")
    assert p.returncode == 2 and "invalid choice: 'turbo'" in p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def test_cli_serves_an_export(lm):
    """`moeserve serve model.onnx`, as the README has it: a real server over a socket, the torch engine's text."""
    from moeserve.bench.server_process import MODEL_NAME, ServerLog, running_server

    ckpt, onnx_path = lm
    log = ServerLog()
    with running_server(onnx_path, "float32", ["--kv-slots", "2"], log) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "def ", "max_tokens": 8,
                                                       "temperature": 0}, timeout=60)
    assert r.status_code == 200, (r.text, log.text)
    assert r.json()["choices"][0]["text"] == Engine.load(ckpt, dtype="float32").generate("def ", max_new_tokens=8)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cli_tensorrt_without_a_gpu_names_what_is_missing(lm, tmp_path):
    p = cli("export", "tensorrt", lm[0], "--out", tmp_path / "m.plan")
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr
    assert list(tmp_path.iterdir()) == []
