"""moeserve finetune: frozen routing leaves routers and experts bit-identical, discrete VQ runs one expert per token
and no router, the checkpoint is served and exported as a classifier with its labels, and resume is exact."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moeserve.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.engine import Engine
from moeserve.runtime.loading import load_model
from moeserve.runtime.model import Transformer
from moeserve.serve.state import ServeConfig
from moeserve.training import finetune as ft
from moeserve.training.finetune import FinetuneConfig, finetune
from moeserve.training.tasks import ClassificationData, Example
from moeserve.training.trainer import TrainConfig

from ..serve.conftest import live_server


def task(n: int = 48) -> ClassificationData:
    """Two classes a model tells apart from the bytes alone."""
    def ex(i: int) -> Example:
        return Example(("x = 1\n" if i % 2 else "y: str\n") * (1 + i % 5), i % 2)

    return ClassificationData(["annotate", "assign"], [ex(i) for i in range(n)], [ex(i) for i in range(n, n + 16)],
                              sha256=f"toy{n}", source="test")


def tc(steps: int = 6, **kw) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=steps, dtype="float32", **kw)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    out = {}
    for router, extra in (("softmax", {}), ("xmoe", {}), ("vq", {"vq_mode": "mixed"})):
        torch.manual_seed(0)
        model = Transformer(preset("tiny", router=router, **extra))
        out[router] = save_checkpoint(root / router, model.cfg, model.state_dict())
    return out


def params(path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_checkpoint(path).state_dict.items()}


def test_frozen_routing_keeps_routers_and_experts_bit_identical(bases, tmp_path):
    for router in ("softmax", "xmoe"):
        before = params(bases[router])
        out = tmp_path / router
        m = finetune(bases[router], task(), tc(), FinetuneConfig(routing="frozen"), out, progress=False)
        after = params(out)
        moe = [k for k in after if ".ffn.router." in k or ".ffn.experts." in k]
        assert moe and all(torch.equal(before[k], after[k]) for k in moe), router
        trunk = [k for k in after if ".attention." in k]
        assert any(not torch.equal(before[k], after[k]) for k in trunk)  # the rest did train
        assert m["test_examples"] == 16 and 0 <= m["test_accuracy"] <= 1
        cfg = load_checkpoint(out).config
        assert (cfg.task, cfg.labels, cfg.n_classes) == ("classify", ["annotate", "assign"], 2)
        recipe = json.loads((out / "moeserve.json").read_text())["recipe"]
        assert recipe["finetune"]["routing"] == "frozen" and recipe["frozen_parameters"] == len(
            [k for k in moe if k in dict(Transformer(cfg).named_parameters())])


def test_full_finetuning_learns_the_task_and_is_served_and_exported_with_labels(bases, tmp_path):
    out = tmp_path / "cls"
    m = finetune(bases["softmax"], task(), tc(steps=30), FinetuneConfig(), out, progress=False)
    assert m["test_accuracy"] == 1.0  # the two classes differ in every byte pattern
    before, after = params(bases["softmax"]), params(out)
    assert not torch.equal(before["layers.0.ffn.experts.w1"], after["layers.0.ffn.experts.w1"])
    texts = ["x = 1\nx = 1\n", "y: str\n"]
    engine = Engine.load(out, dtype="float32", device="cpu")
    want = engine.classify(texts)
    assert [max(range(2), key=p.__getitem__) for p in want] == [1, 0]
    with live_server(lambda: Engine.load(out, dtype="float32", device="cpu"), ServeConfig(model_name="cls")) as s:
        r = s.post("/v1/classify", {"model": "cls", "input": texts}).json()
    assert [d["label_name"] for d in r["data"]] == ["assign", "annotate"]
    assert [d["probs"] for d in r["data"]] == [pytest.approx(p, abs=1e-5) for p in want]
    pytest.importorskip("onnxruntime")
    from moeserve.export.onnx_export import export_onnx

    report = export_onnx(out, tmp_path / "cls.onnx", "portable")
    assert report.passed and (tmp_path / "cls.onnx").exists()


def count_expert_calls(model: Transformer) -> list[int]:
    calls = [0]
    for layer in model.moe_layers:
        layer.experts.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_discrete_vq_runs_no_router_and_one_expert_per_token(bases, tmp_path):
    out = tmp_path / "discrete"
    before = params(bases["vq"])
    calls = {}
    real_build = ft.build_classifier

    def counting_build(base, cfg):  # count the expert calls of the model that fine-tuning trains
        model = real_build(base, cfg)
        calls["n"] = count_expert_calls(model)
        return model

    ft.build_classifier = counting_build
    try:
        finetune(bases["vq"], task(), tc(steps=3), FinetuneConfig(vq="discrete"), out, progress=False)
    finally:
        ft.build_classifier = real_build
    model, ckpt = load_model(out)
    n_layers = len(model.moe_layers)
    # 3 training steps and 1 evaluation batch, one expert call per layer each: no continuous top-k path
    assert calls["n"][0] == 4 * n_layers
    assert ckpt.config.vq_mode == "discrete" and all(m.router is None and m.mix is None for m in model.moe_layers)
    assert not any(".ffn.router." in k or ".ffn.mix." in k for k in ckpt.state_dict)
    assert all(torch.equal(before[k], ckpt.state_dict[k]) for k in before if k.endswith("quantizer.codebook"))
    # FLOPs per token of one MoE layer: discrete against the mixed layer it came from
    mixed, _ = load_model(bases["vq"])
    x = torch.randn(1, 64, mixed.cfg.d_model)

    def flops(layer) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(x)
        return counter.get_total_flops()

    ratio = flops(model.moe_layers[0]) / flops(mixed.moe_layers[0])
    # mixed runs top-2 experts, the discrete expert, the router and the gate; discrete runs one expert
    assert 0.2 < ratio < 0.4, ratio
    # a discrete model as-is: the vq-table export folds each layer into a table, with parity
    pytest.importorskip("onnxruntime")
    from moeserve.export.onnx_export import export_onnx

    report = export_onnx(out, tmp_path / "discrete.onnx", "vq-table")
    assert report.passed and {layer["form"] for layer in report.layers} == {"table"}


def test_resume_repeats_the_uninterrupted_run(bases, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    finetune(bases["softmax"], task(), tc(steps=4, save_every=2), FinetuneConfig(), whole, progress=False)
    part = tmp_path / "part"
    real_get = ft.Batches.get

    def stop_at_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_get(self, step)

    monkeypatch.setattr(ft.Batches, "get", stop_at_3)
    with pytest.raises(KeyboardInterrupt):
        finetune(bases["softmax"], task(), tc(steps=4, save_every=2), FinetuneConfig(), part, progress=False)
    monkeypatch.setattr(ft.Batches, "get", real_get)
    finetune(bases["softmax"], task(), tc(steps=4, save_every=2), FinetuneConfig(), part, resume=True,
             progress=False)
    a, b = params(whole), params(part)
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (part / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    with pytest.raises(CheckpointError, match="resume with the same flags"):
        finetune(bases["softmax"], task(n=40), tc(steps=4), FinetuneConfig(), part, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="resume with the same flags"):  # same config, other recipe
        finetune(bases["softmax"], task(), tc(steps=4), FinetuneConfig(routing="frozen"), part, resume=True,
                 progress=False)


def test_cli_finetunes_jsonl_and_names_bad_input(bases, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": e.text, "label": ["neg", "pos"][e.label]}) + "\n"
                            for e in task().train))
    out = tmp_path / "cli"
    assert main(["finetune", str(bases["softmax"]), "--out", str(out), "--data", str(data), "--steps", "2",
                 "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["labels"] == ["neg", "pos"] and load_checkpoint(out).config.labels == ["neg", "pos"]
    assert main(["finetune", str(bases["softmax"]), "--out", str(tmp_path / "x"), "--data", str(data), "--vq",
                 "discrete", "--quiet"]) == 2
    assert "--vq discrete needs a VQ checkpoint" in capsys.readouterr().err
    assert main(["finetune", str(bases["softmax"]), "--out", str(out), "--data", str(data), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["finetune", str(out), "--out", str(tmp_path / "y"), "--data", str(data), "--quiet"]) == 2
    assert "fine-tune a language model" in capsys.readouterr().err
    assert main(["finetune", str(bases["softmax"]), "--out", str(tmp_path / "z"), "--test-data", str(data)]) == 2
