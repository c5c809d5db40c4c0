"""Sampling: a batch's rows drawn together equal each row drawn alone (its own generator), top-p's set (and its
ties), the draws' frequencies, and the width that lets top-p sort less on a CPU."""

from __future__ import annotations

import math

import torch

from moeserve.runtime.sampling import SamplingParams, _top_p_width, filter_logits, sample_rows

PARAMS = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.8),
          SamplingParams(temperature=0.9, top_k=50, top_p=0.95), SamplingParams(temperature=1.2)]


def test_rows_drawn_together_equal_each_row_drawn_alone():
    """9 rows of 4 kinds of filtering, logits rounded to bf16 (ties at top-k's and top-p's edges), 20 steps: the
    batch's tokens are each row's alone, with generators seeded alike."""
    torch.manual_seed(0)
    B, V = 9, 1000
    params = [PARAMS[i % len(PARAMS)] for i in range(B)]
    together = [torch.Generator().manual_seed(100 + i) for i in range(B)]
    alone = [torch.Generator().manual_seed(100 + i) for i in range(B)]
    for _ in range(20):
        logits = (torch.randn(B, V) * 3).to(torch.bfloat16)
        got = sample_rows(logits, params, together)
        want = [sample_rows(logits[i:i + 1], [params[i]], [alone[i]])[0] for i in range(B)]
        assert got == want


def kept(logits_V: torch.Tensor, **kw) -> list[int]:
    return torch.isfinite(filter_logits(logits_V, SamplingParams(temperature=1.0, **kw))).nonzero()[:, 0].tolist()


def test_top_p_keeps_the_smallest_set_reaching_p_and_its_ties():
    logits = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).log()
    assert kept(logits, top_p=0.3) == [0]
    assert kept(logits, top_p=0.5) == [0, 1, 2]  # 0.4 + 0.2 reach it; the other 0.2 is as likely as the last kept
    assert kept(logits, top_p=0.65) == [0, 1, 2]
    assert kept(logits, top_p=0.85) == [0, 1, 2, 3, 4]
    assert kept(logits, top_p=5e-324) == [0]  # rounds to 0 in float32: the likeliest stays
    assert kept(logits, top_k=2, top_p=0.9) == [0, 1, 2]  # top-k keeps the 2nd's tie; top-p all three


def reference_top_p(logits_V: torch.Tensor, top_p: float) -> list[int]:
    """The rule as first written: sort the whole row, drop each token whose likelier tokens' mass reaches p."""
    sorted_V, idx = logits_V.sort(descending=True)
    mass = sorted_V.softmax(-1)
    drop = mass.cumsum(-1) - mass >= top_p
    drop[0] = False
    return sorted(idx[~drop].tolist())


def test_top_p_sorts_less_where_the_likeliest_hold_the_mass():
    """A peaked 32k vocabulary: top-p looks at the likeliest 64 or 1024 (a sort of the whole row costs ~1 ms a row
    on a CPU) and keeps what sorting every token keeps; a flat row needs them all."""
    torch.manual_seed(1)
    peaked = torch.randn(4, 32000) * 6
    flat = torch.randn(4, 32000) * 0.1
    assert _top_p_width(peaked.softmax(-1), 0.9) in (64, 1024)
    assert _top_p_width(flat.softmax(-1), 0.9) == 32000
    for rows in (peaked, flat):
        out = filter_logits(rows, SamplingParams(temperature=1.0, top_p=0.9))
        for i in range(len(rows)):
            assert torch.isfinite(out[i]).nonzero()[:, 0].tolist() == reference_top_p(rows[i], 0.9)


def test_draws_follow_the_distribution_and_never_a_masked_token():
    probs = [0.5, 0.3, 0.2, 0.0]
    logits = torch.tensor([math.log(p) if p else float("-inf") for p in probs])[None]
    gen = torch.Generator().manual_seed(0)
    draws = [sample_rows(logits, [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(6000)]
    counts = [draws.count(t) / len(draws) for t in range(4)]
    assert counts[3] == 0
    assert all(abs(c - p) < 0.03 for c, p in zip(counts, probs)), counts
