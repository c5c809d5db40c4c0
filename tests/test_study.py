"""moeserve study: the verdict rule on known numbers, and the quick study end to end (every step of the full one)."""

from __future__ import annotations

import json

import pytest

from pathlib import Path

from moeserve.cli import main
from moeserve.study import claims, markdown, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_verdict_needs_a_difference_larger_than_the_spread():
    assert verdict([0.10, 0.12], [0.30, 0.32], higher=False)[0] == "supported"
    assert verdict([0.30, 0.32], [0.10, 0.12], higher=False)[0] == "contradicted"
    assert verdict([0.10, 0.30], [0.15, 0.25], higher=False)[0] == "inconclusive"
    status, text = verdict([2.0, 2.0], [1.0, 1.0], higher=True)
    assert status == "supported" and text == "2 ± 0 vs 1 ± 0"


def fake(rc_x: float, rc_s: float) -> dict:
    def seeds(rc: float, rf: float, acc: float) -> list[dict]:
        return [{"rc": rc + d, "fluctuation": [(10, 0.5), (20, rf + d), (30, rf - d)], "param_diff": 0.5,
                 "output_var_rel": 0.1, "acc_full": acc, "acc_discrete": acc} for d in (0.0, 0.001)]

    return {"recipes": {"softmax": {"seeds": seeds(rc_s, 0.2, 0.5), "consistency": 0.8},
                        "xmoe": {"seeds": seeds(rc_x, 0.1, 0.6), "consistency": 0.9},
                        "vq": {"seeds": seeds(1.0, 0.1, 0.55), "consistency": 0.7, "discrete_flops_ratio": 0.34}}}


def test_claims_read_the_right_numbers():
    got = {c: v for c, v, _ in claims(fake(rc_x=5.0, rc_s=1.0))}
    assert got["X-MoE routes more stably than softmax: lower RF ratio (second half of pre-training)"] == "supported"
    assert got["X-MoE collapses less than softmax: larger RC of router inputs"] == "supported"
    assert got["X-MoE fine-tunes more consistently than softmax: larger inter-run consistency"] == "supported"
    assert got["VQMoE fine-tunes the discrete path alone at lower cost and comparable accuracy"] == "supported"
    flipped = {c: v for c, v, _ in claims(fake(rc_x=1.0, rc_s=5.0))}
    assert flipped["X-MoE collapses less than softmax: larger RC of router inputs"] == "contradicted"


@pytest.mark.slow
def test_quick_study_writes_the_page_plots_and_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = tmp_path / "study.md"
    assert main(["study", "--quick", "--quiet", "--out", str(out)]) == 0
    page = out.read_text()
    results = json.loads((tmp_path / "study" / "study.json").read_text())
    assert set(results["recipes"]) == {"softmax", "sigmoid", "xmoe", "vq", "xmoe+omoe"}
    for claim, status, _ in claims(results):
        assert f"| {claim} | **{status}** |" in page
    assert len(claims(results)) == 7
    for name in ("pretraining", "routing", "finetuning"):
        assert f"(study/{name}.png)" in page and imread(tmp_path / "study" / f"{name}.png").shape[0] > 300
    vq = results["recipes"]["vq"]
    assert 0.2 < vq["discrete_flops_ratio"] < 0.4 and all("acc_discrete" in s for s in vq["seeds"])
    assert all(len(s["fluctuation"]) == 3 for r in results["recipes"].values() for s in r["seeds"])
    assert main(["study", "--quick", "--seeds", "1", "--out", str(out)]) == 2
    out.write_text("edited by hand")
    assert main(["study", "--render", "--out", str(out)]) == 0 and out.read_text() == page  # drawn from the JSON


def test_the_committed_study_page_is_rendered_from_its_json():
    results = json.loads((ROOT / "docs" / "study" / "study.json").read_text())
    plots = [f"study/{name}.png" for name in ("pretraining", "routing", "finetuning")]
    assert (ROOT / "docs" / "study.md").read_text() == markdown(results, plots, results["command"]), (
        "docs/study.md is stale: run `moeserve study --render` and commit the result")
    assert all((ROOT / "docs" / p).exists() for p in plots)
