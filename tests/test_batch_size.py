"""BatchSizer: the scoring batch size follows measured throughput, deterministically given the times."""

from __future__ import annotations

import pytest

from moeserve.batch_size import BatchSizer


def feed(sizer: BatchSizer, rate: dict[int, float], first_s: float = 100.0, batches: int = 40) -> list[int]:
    """Score `batches` full batches at the sizer's caps, each taking cap / rate[cap] seconds (the first
    `first_s`); the caps used, in order."""
    caps = []
    for i in range(batches):
        cap = sizer.tokens
        caps.append(cap)
        sizer.record(cap, first_s if i == 0 else cap / rate[cap])
    return caps


def test_grows_while_a_doubling_gains_and_settles_on_the_smaller_size_at_the_knee():
    rate = {1024: 100.0, 2048: 150.0, 4096: 160.0, 8192: 163.0, 16384: 170.0}
    s = BatchSizer(start=1024)
    caps = feed(s, rate)
    # first batch unmeasured, then 2 batches a size: 1024, 2048, 4096 (+6.7%: kept), 8192 (+1.9%: back to 4096)
    assert caps[:9] == [1024, 1024, 1024, 2048, 2048, 4096, 4096, 8192, 8192]
    assert s.settled == 4096 and set(caps[9:]) == {4096}
    assert s.rates == pytest.approx({1024: 100.0, 2048: 150.0, 4096: 160.0, 8192: 163.0})


def test_flat_throughput_keeps_the_first_size_and_rising_throughput_reaches_the_limit():
    flat = BatchSizer(start=1024)
    feed(flat, {1024: 100.0, 2048: 102.0})
    assert flat.settled == 1024
    rising = BatchSizer(start=256, limit=2048)
    caps = feed(rising, {256: 1.0, 512: 2.0, 1024: 3.0, 2048: 4.0})
    assert rising.settled == 2048 and caps[-1] == 2048 and max(caps) == 2048


def test_the_first_batch_of_a_process_is_not_measured():
    s = BatchSizer(start=1024)  # a first batch 100x slower than the rest does not make 1024 look slow
    feed(s, {1024: 100.0, 2048: 101.0}, first_s=1024 / 1.0)
    assert s.settled == 1024


def test_fixed_and_settled_sizers_never_move():
    fixed = BatchSizer.fixed(300)
    assert set(feed(fixed, {300: 1.0})) == {300} and fixed.rates == {}
    resumed = BatchSizer(settled=2048)
    assert set(feed(resumed, {2048: 1.0})) == {2048}


@pytest.mark.parametrize("kw,needle", [({"start": 0}, "start"), ({"limit": -1}, "limit"), ({"batches": 0}, "batches"),
                                        ({"gain": 0.5}, "gain"), ({"start": True}, "start")])
def test_bad_settings_are_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        BatchSizer(**kw)
