"""Plots for the benches: matplotlib (the `bench` extra), drawn off-screen into files."""

from __future__ import annotations


class PlotUnavailable(Exception):
    """--plot without matplotlib."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), or PlotUnavailable saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'moeserve[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
