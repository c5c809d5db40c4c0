"""The papers' measures agree with direct computations on inputs whose answer is known, and `moeserve diagnose`
reports them for real checkpoints."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.cli import main
from moeserve.config import preset
from moeserve.runtime.model import Transformer
from moeserve.training.diagnostics import (collect, diagnose, expert_outputs, inter_run_consistency, load_stats,
                                           output_variance, parameter_difference, representation_collapse,
                                           routing_fluctuation)


def rc_numpy(x: np.ndarray, groups: np.ndarray) -> float:
    """Eq. 11 written out with loops over the groups, in numpy."""
    names = sorted(set(groups.tolist()))
    means = np.stack([x[groups == g].mean(axis=0) for g in names])
    sw = sum((x[groups == g] - means[i]).T @ (x[groups == g] - means[i]) for i, g in enumerate(names)) / len(x)
    d = means - means.mean(axis=0)
    sb = d.T @ d / len(names)
    return float(np.trace(sw @ np.linalg.pinv(sb, rcond=1e-10, hermitian=True)))


def clusters(spread: float, k: int = 4, n: int = 200, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(k, d, generator=g) * 5
    groups = torch.arange(n) % k
    return centres[groups] + spread * torch.randn(n, d, generator=g), groups


def test_rc_matches_the_direct_computation_and_measures_collapse():
    x, groups = clusters(1.0)
    assert representation_collapse(x, groups) == pytest.approx(rc_numpy(x.double().numpy(), groups.numpy()), rel=1e-9)
    collapsed, _ = clusters(0.0)  # every token on its expert's centroid
    assert representation_collapse(collapsed, groups) < 1e-20
    # RC grows with the square of the within-group spread, the means held fixed
    tight, wide = clusters(0.1), clusters(1.0)
    x64 = tight[0].double()
    means = torch.stack([x64[groups == g].mean(0) for g in range(4)])
    dev = x64 - means[groups]
    assert representation_collapse(means[groups] + 10 * dev, groups) == pytest.approx(
        100 * representation_collapse(means[groups] + dev, groups), rel=1e-9)
    assert representation_collapse(*tight) < representation_collapse(*wide)
    assert math.isnan(representation_collapse(x, torch.zeros(len(x), dtype=torch.long)))  # one group: undefined


def test_fluctuation_and_consistency_known_answers():
    a = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    assert routing_fluctuation(a, a.clone()) == 0.0
    assert routing_fluctuation(a, torch.tensor([1, 1, 2, 3, 0, 1, 2, 0])) == 0.25
    with pytest.raises(ValueError, match="not the same tokens"):
        routing_fluctuation(a, a[:4])
    load = torch.tensor([10.0, 3.0, 7.0, 1.0])
    assert inter_run_consistency(torch.stack([load, load, load])) == pytest.approx(1.0)
    # the second run's load is the first's mirror: rho = -1, IC = (1 + 1 - 1 - 1) / 4
    assert inter_run_consistency(torch.stack([load, 11 - load])) == pytest.approx(0.0, abs=1e-12)
    loads = torch.tensor([[5.0, 1, 2, 8], [4, 2, 2, 9], [1, 7, 3, 2]])
    assert inter_run_consistency(loads) == pytest.approx(np.corrcoef(loads.numpy()).mean(), rel=1e-12)
    assert math.isnan(inter_run_consistency(torch.stack([load, torch.full((4,), 5.0)])))
    with pytest.raises(ValueError, match="at least 2 runs"):
        inter_run_consistency(load[None])


def test_diversity_known_answers():
    base = torch.randn(3, 1000)
    same = base[0].expand(3, -1)
    assert parameter_difference(same) == 0.0 and output_variance(same[:, None, :].expand(3, 5, -1))[0] == 0.0
    w = same.clone()
    w[2, :300] += 0.01  # expert 2 differs from 0 and 1 at 30% of positions; 0 and 1 are equal
    assert parameter_difference(w) == pytest.approx((0 + 0.3 + 0.3) / 3)
    w[2, 300:400] += 1e-4  # below the paper's 1e-3 threshold: not a difference
    assert parameter_difference(w) == pytest.approx(0.2)
    y = torch.stack([torch.zeros(4, 2), torch.full((4, 2), 2.0)])  # two experts, outputs 0 and 2: variance 1
    var, rel = output_variance(y)
    assert var == pytest.approx(1.0) and rel == pytest.approx(1.0 / 2.0)


def test_load_stats():
    stats = load_stats(torch.tensor([4, 4, 0, 0]))
    assert stats == {"entropy": pytest.approx(0.5), "max_over_mean": pytest.approx(2.0), "dead": [2, 3]}
    assert load_stats(torch.tensor([3, 3, 3, 3]))["entropy"] == pytest.approx(1.0)


def tiny(router: str = "softmax", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", router=router, **overrides)).eval()


def tokens(n_batches: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(n_batches)]


def test_collect_reads_the_router_inputs_and_a_permuted_router_fluctuates_by_what_it_permuted():
    model, batches = tiny(), tokens()
    routing = collect(model, batches)
    assert len(routing) == len(model.moe_layers) and all(r.inputs.shape == (256, model.cfg.d_model) for r in routing)
    layer = model.moe_layers[0]
    # the hook saw the router's own input: routing it again gives the same top-1
    assert torch.equal(layer.router(routing[0].inputs).expert_ids[:, 0], routing[0].top1)
    assert int(routing[0].counts.sum()) == 256 * model.cfg.top_k
    # swap the gate rows of experts 0 and 1 in the last layer (the earlier layers' inputs stay the same): exactly
    # the tokens whose top-1 was 0 or 1 change expert
    last = model.moe_layers[-1]
    with torch.no_grad():
        last.router.gate.weight[[0, 1]] = last.router.gate.weight[[1, 0]].clone()
    after = collect(model, batches)
    before_top1 = routing[-1].top1
    assert routing_fluctuation(routing[0].top1, after[0].top1) == 0.0
    assert routing_fluctuation(before_top1, after[-1].top1) == pytest.approx(
        float(((before_top1 == 0) | (before_top1 == 1)).double().mean()))


def test_identical_experts_have_no_diversity():
    model, batches = tiny(), tokens(1)
    experts = model.moe_layers[0].experts
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w[:] = w[0]
    routing = collect(model, batches)
    y = expert_outputs(model, [r.inputs for r in routing])[0]
    assert output_variance(y)[0] < 1e-12 and parameter_difference(torch.cat(
        [w.detach().reshape(w.shape[0], -1) for w in (experts.w1, experts.w2, experts.w3)], 1)) == 0.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    out = {}
    for name, model in (("a", tiny(seed=0)), ("b", tiny(seed=1)), ("vq", tiny("vq", seed=0)),
                        ("wide", tiny(seed=0, n_experts=8))):
        out[name] = save_checkpoint(root / name, model.cfg, model.state_dict())
    data = root / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    out["data"] = data
    return out


def test_diagnose_one_checkpoint_twice_is_stable_and_consistent(checkpoints):
    a = str(checkpoints["a"])
    report = diagnose([a, a], data=[str(checkpoints["data"])], tokens=1024, seq_len=64)
    assert report["tokens"] == 1024
    assert report["checkpoints"][0]["layers"] == report["checkpoints"][1]["layers"]
    assert report["fluctuation"][0]["layers"] == [0.0] * len(report["checkpoints"][0]["layers"])
    assert report["consistency"] == pytest.approx([1.0] * len(report["consistency"]))
    layer = report["checkpoints"][0]["layers"][0]
    assert layer["rc"] > 0 and 0 < layer["entropy"] <= 1 and layer["param_diff"] > 0.5  # random experts differ


def test_diagnose_cli_writes_json_and_names_bad_input(checkpoints, tmp_path, capsys):
    out = tmp_path / "d.json"
    args = ["diagnose", str(checkpoints["a"]), str(checkpoints["b"]), str(checkpoints["vq"]), "--data",
            str(checkpoints["data"]), "--tokens", "512", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "RF ratio" in table and "inter-run consistency over 3 checkpoints" in table
    report = json.loads(out.read_text())
    assert [c["router"] for c in report["checkpoints"]] == ["softmax", "softmax", "vq"]
    assert 0 < report["fluctuation"][0]["layers"][0] <= 1  # two different seeds route differently
    vq = report["checkpoints"][2]["layers"][0]
    assert 0 < vq["vq_codes_used"] <= 1 and "vq_codes_used" not in report["checkpoints"][0]["layers"][0]
    assert main(["diagnose", str(checkpoints["a"]), str(checkpoints["wide"]), "--data",
                 str(checkpoints["data"])]) == 2
    assert "different vocabulary or expert layout" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    assert main(["diagnose", str(checkpoints["a"]), "--data", str(tmp_path / "none.txt")]) == 2
    assert "not found" in capsys.readouterr().err
