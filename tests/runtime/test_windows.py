"""Rolling-window scoring: texts longer than the context are scored, every token once, each with the
context the stride states; the scores equal a direct computation, one forward pass per token."""

import pytest
import torch

from moeserve.config import preset
from moeserve.runtime.engine import Engine, EngineError
from moeserve.runtime.model import Transformer
from moeserve.runtime.windows import check_stride, consecutive_batches, default_stride, rolling_windows
from moeserve.tokenizer import ByteTokenizer

CONTEXT = 32


@pytest.fixture(scope="module", params=["softmax", "xmoe", "vq"])
def engine(request) -> Engine:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router=request.param, max_seq_len=CONTEXT))
    return Engine.from_model(model, ByteTokenizer())


def direct_logprobs(engine: Engine, ids: list[int], stride: int) -> list[float]:
    """log p(ids[i] | the tokens before it that the rule gives it), one forward pass per token: within the
    context, all of them; past it, from the start of the first window ending at or after i + 1, where
    window ends are C, C + stride, C + 2 stride, ... and finally len(ids)."""
    C, out = engine.cfg.max_seq_len, []
    for i in range(1, len(ids)):
        end = len(ids) if len(ids) <= C else min(C + max(0, -(-(i + 1 - C) // stride)) * stride, len(ids))
        start = max(0, end - C)
        logits = engine.forward(torch.tensor([ids[start:i]]))[0, -1]
        out.append(torch.log_softmax(logits.float(), -1)[ids[i]].item())
    return out


def test_windows_cover_every_token_once():
    for n in (2, 31, 32, 33, 80, 320):
        for stride in (1, 5, 16, 31):
            windows = rolling_windows(n, CONTEXT, stride)
            scored = [t for a, b, k in windows for t in range(b - k, b)]
            assert scored == list(range(1, n)), (n, stride)
            assert all(b - a == min(n, CONTEXT) for a, b, _ in windows)
            # a token scored after the first window sees at least C - stride tokens before it
            assert all(b - k - a >= CONTEXT - stride for a, b, k in windows[1:])
    assert rolling_windows(100, 32, 16) == [(0, 32, 31), (16, 48, 16), (32, 64, 16), (48, 80, 16), (64, 96, 16), (68, 100, 4)]
    assert default_stride(CONTEXT) == 16


@pytest.mark.parametrize("stride", [0, 32, 40, -1, 2.5, True])
def test_bad_stride_is_named(stride):
    with pytest.raises(ValueError, match=r"stride = .*expected an integer in \[1, 31\]"):
        check_stride(stride, CONTEXT)


def test_consecutive_batches_keep_order_and_budget():
    assert consecutive_batches([4, 4, 4, 4, 4], 8) == [range(0, 2), range(2, 4), range(4, 5)]
    assert consecutive_batches([2, 10, 2], 8) == [range(0, 1), range(1, 2), range(2, 3)]  # wider than the budget: alone
    assert consecutive_batches([3, 1, 2], 100) == [range(0, 3)]
    assert consecutive_batches([], 8) == []


@pytest.mark.parametrize("times", [1, 2.5, 10])
@pytest.mark.parametrize("stride", [None, 7, 31])
def test_rolling_score_equals_direct_computation(engine, times, stride):
    n = int(CONTEXT * times)
    ids = [1] + [int(t) for t in torch.randint(3, 256, (n - 1,), generator=torch.Generator().manual_seed(n))]
    s = stride or default_stride(CONTEXT)
    want = direct_logprobs(engine, ids, s)
    got = engine.score_ids([ids], stride=stride)[0]
    assert got.n_tokens == n - 1
    assert got.windows == len(rolling_windows(n, CONTEXT, s))
    assert got.logprob == pytest.approx(sum(want), abs=2e-4)


def test_long_rows_batched_with_short_ones_score_as_alone(engine):
    """Windows of several rows in consecutive batches (a small budget cuts them across rows) give each
    row what it gets alone."""
    rows = [[1] + [(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((100, 5, 64, 31))]
    alone = [engine.score_ids([r])[0] for r in rows]
    together = engine.score_ids(rows, max_batch_tokens=3 * CONTEXT)
    assert [r.windows for r in together] == [6, 1, 4, 1]
    assert [r.n_tokens for r in together] == [100, 5, 64, 31]
    for a, b in zip(alone, together):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_text_longer_than_context_is_scored(engine):
    text = "def f(x):\n    return x + 1\n" * 11  # 308 bytes on a 32-token context
    score = engine.score([text], stride=8)[0]
    assert score.n_tokens == len(text) and score.windows == 1 + -(-(len(text) + 1 - CONTEXT) // 8)
    assert score.logprob == pytest.approx(engine.score_ids([engine.encode(text, any_length=True)], 8)[0].logprob)
    with pytest.raises(EngineError, match="stride = 32"):
        engine.score([text], stride=32)
    with pytest.raises(EngineError, match="tokens; the model's context is 32"):
        engine.encode(text)  # generation still refuses what does not fit
