"""Redundant experts (runtime/expert_replicas.py): the placement alone (deterministic, room respected, owners keep
their copy, a load skewed to 2 experts spread out); then two ranks on gloo over 127.0.0.1: the exchange with copies
placed equals the reference loop for several token patterns (bit for bit the exchange without copies where the C
kernel computes), the measured imbalance of a skewed load drops, and a rank loop whose copies are placed from the
live load mid-run gives the single-process engine's tokens (fp32), greedy and seeded, gpt-oss's biased experts
included (a copy carries its expert's biases)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moeserve.bench.server_process import free_port
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.backends.expert_shards import contiguous_ranges
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.ep_rank import RankOptions
from moeserve.runtime.expert_parallel import ExpertParallelError, ExpertParallelExperts, join_group
from moeserve.runtime.expert_replicas import (
    Replication, copies_of, imbalance, place_replicas, rank_rows, split_rows,
)
from moeserve.runtime.experts import Experts
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import QuantSpec, quantize_model_

from .hf_dirs import gpt_oss

HERE = Path(__file__).parent
RUN_TIMEOUT_S = 120
SKEWED = [400, 300] + [10] * 6  # 8 experts, 91% of the rows to experts 0 and 1


# ---- the placement ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R, room, want", [(2, 1, [[], [0]]), (2, 2, [[4, 5], [0, 1]]),
                                           (4, 1, [[], [0], [1], [0]]), (4, 2, [[2, 4], [0, 1], [0, 1], [0, 1]])])
def test_a_load_skewed_to_two_experts_is_spread(R, room, want):
    ranges = contiguous_ranges(8, R)
    got = place_replicas(SKEWED, ranges, room)
    assert got == want
    before, after = imbalance(rank_rows(SKEWED, ranges, [[]] * R)), imbalance(rank_rows(SKEWED, ranges, got))
    assert after < before
    assert (R, room, round(before, 3), round(after, 3)) in {(2, 1, 1.895, 1.368), (2, 2, 1.895, 1.0),
                                                             (4, 1, 3.684, 1.491), (4, 2, 3.684, 1.026)}


def test_the_placement_is_deterministic_respects_room_and_keeps_owners():
    rng = random.Random(0)
    for _ in range(300):
        R = rng.choice([2, 3, 4, 8])
        E = rng.choice([R, 8, 16, 17])
        if E < R:
            continue
        ranges, room = contiguous_ranges(E, R), rng.randint(0, 3)
        load = [int(rng.paretovariate(1.2) * 10) * rng.randint(0, 1) for _ in range(E)]
        got = place_replicas(load, ranges, room)
        assert got == place_replicas(list(load), list(ranges), room)  # the same numbers, the same placement
        assert len(got) == R and all(len(ids) <= room and ids == sorted(set(ids)) for ids in got)
        assert all(e not in ranges[r] for r, ids in enumerate(got) for e in ids)  # never a copy of its own
        copies = copies_of(ranges, got)
        assert all(copies[e][0] == r for r, rg in enumerate(ranges) for e in rg)  # the owner's copy first, kept
        assert imbalance(rank_rows(load, ranges, got)) <= imbalance(rank_rows(load, ranges, [[]] * R))


def test_nothing_to_place_when_balanced_or_idle():
    ranges = contiguous_ranges(8, 2)
    assert place_replicas([10] * 8, ranges, 2) == [[], []]  # any copy would move the busiest rank's load away
    assert place_replicas([0] * 8, ranges, 2) == [[], []]
    assert place_replicas(SKEWED, ranges, 0) == [[], []]
    assert imbalance([0, 0]) == 1.0 and imbalance([3, 1]) == 1.5
    for bad, match in (((SKEWED, ranges, -1), "room"), ((SKEWED, contiguous_ranges(6, 2), 1), "ranges"),
                       (([-1] + SKEWED[1:], ranges, 1), "load")):
        with pytest.raises(ValueError, match=match):
            place_replicas(*bad)


def test_split_rows_rotates_the_remainder():
    for n in range(12):
        for m in range(1, 5):
            parts = [split_rows(n, m, p) for p in range(m)]
            assert all(sum(s) == n and max(s) - min(s) <= 1 for s in parts)
            assert [sum(col) for col in zip(*parts)] == [n] * m  # over m calls, each copy gets n rows
    assert [split_rows(1, 2, p) for p in (0, 1)] == [[0, 1], [1, 0]]


# ---- one process -----------------------------------------------------------------------------------------------
def test_one_rank_has_nothing_to_replicate():
    group = join_group(f"tcp://127.0.0.1:{free_port()}", 0, 1, timeout_s=30)
    try:
        ep = ExpertParallelExperts.of(Experts(4, 8, 12, "gelu"), group)
        rep = Replication([ep], room=2, every=1)
        with torch.inference_mode():
            ep(torch.randn(5, 8), torch.tensor([[0, 1]] * 5), torch.rand(5, 2))
        report = rep.after_step()
        assert report.load == [[5, 5, 0, 0]] and report.before == report.after == [1.0] and report.moved == 0
        assert ep.placement == [[]] and ep.replicas is None
        with pytest.raises(ExpertParallelError, match="placement"):
            ep.set_replicas([[1]])  # its own expert
    finally:
        group.leave()
    with pytest.raises(ExpertParallelError, match="redundant_experts"):
        RankOptions(redundant_experts=-1)
    with pytest.raises(ExpertParallelError, match="rebalance_every"):
        RankOptions(redundant_experts=1, rebalance_every=0)


# ---- two ranks -------------------------------------------------------------------------------------------------
# gpt-oss: a Hugging Face directory (hf_dirs.gpt_oss) whose copies carry their experts' biases
CHECKPOINTS = {"softmax": dict(router="softmax"), "xmoe-int8": dict(router="xmoe", quantize="int8"),
               "gpt-oss": dict(family="gpt_oss")}
pytestmark = pytest.mark.xdist_group("expert-parallel")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("replicas")
    out = {}
    for name, kw in CHECKPOINTS.items():
        if kw.get("family") == "gpt_oss":
            out[name] = str(gpt_oss(root / name))
            continue
        torch.manual_seed(0)
        quantize = kw.pop("quantize", None)
        model = Transformer(preset("tiny", **kw))  # 2 MoE layers of 4 experts, top-2: 2 experts a rank
        if quantize is not None:
            quantize_model_(model, QuantSpec.parse(quantize))
        out[name] = str(save_checkpoint(root / name, model.cfg, model.state_dict()))
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints) -> dict[int, dict]:
    """Both ranks' reports (tests/runtime/replica_worker.py), from one run of two spawned processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))  # the spawned processes import the workers by name
        import ep_worker
        import replica_worker

        return ep_worker.spawn(replica_worker.main, 2, (checkpoints,), RUN_TIMEOUT_S)


def test_the_exchange_with_copies_equals_the_reference(ranks):
    for rank in (0, 1):
        got = ranks[rank]["exchange"]
        assert max(got["diffs"]) <= 1e-5
        half = len(got["identical"]) // 4  # per act: torch's experts, then the C kernel's
        by_kernel = got["identical"][half:2 * half] + got["identical"][3 * half:]
        if all(got["kernel"]):  # each row computed alone: a copy's result is its owner's, bit for bit
            assert all(by_kernel)


def test_the_measured_imbalance_of_a_skewed_load_drops(ranks):
    for room, (first, second) in ((r, ranks[0]["imbalance"][r]["reports"]) for r in (1, 2)):
        assert ranks[0]["imbalance"][room] == ranks[1]["imbalance"][room]  # every rank placed the same copies
        assert first["before"] == first["owners_only"]  # measured = predicted with the owners alone
        assert first["before"][0] > 1.7  # experts 0 and 1 are rank 0's
        assert first["moved"] > 0 and second["before"][0] < first["before"][0] - 0.3  # measured with the copies
        assert abs(second["before"][0] - first["after"][0]) < 0.1  # as the placement predicted


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_copies_placed_mid_run_leave_the_tokens_unchanged(ranks, checkpoints, name):
    import replica_worker

    engine = Engine.load(checkpoints[name], dtype="float32", device="cpu")
    for rank in (0, 1):
        got = ranks[rank][name]
        for (prompt, kw), tokens, lps in zip(replica_worker.REQUESTS[rank], got["tokens"], got["logprobs"]):
            want = engine.complete([prompt], SamplingParams(**kw))[0]
            assert tokens == want.token_ids, (name, rank, prompt)
            if lps is not None:
                assert max(abs(a - b.logprob) for a, b in zip(lps, want.logprobs)) <= 1e-5
        assert got["stopped"]
        assert got["rebalances"] == ranks[1 - rank][name]["rebalances"]  # the same placements on both ranks
        assert any(ids for r in got["rebalances"][:-1] for layer in r["replicas"] for ids in layer)  # mid-run
    assert ranks[0][name]["a2a_calls"] == ranks[1][name]["a2a_calls"]
    model, cfg = engine.model, engine.cfg
    whole = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    per_expert = sum(t.numel() for k, t in model.state_dict().items() if ".ffn.experts." in k) // (
        cfg.n_experts * len(cfg.moe_layer_ids))
    for rank in (0, 1):  # its own experts and its copies, nothing else
        held = ranks[rank][name]["held"]
        assert ranks[rank][name]["parameters"] == whole - per_expert * cfg.n_experts * len(held) + per_expert * sum(
            map(len, held))
