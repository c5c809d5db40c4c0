"""The statistics every bench reports, defined once."""

from __future__ import annotations

import math
import time


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in [0, 100]): the smallest value with at least q% of the values at or
    below it, always one of the values; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 2 decimals; None where either is missing or b is 0."""
    return round(a / b, 2) if a is not None and b else None


def timed_ms(call, calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls, after 5 untimed."""
    for _ in range(5):
        call()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1e3)
    return out
