"""Plots for the benches: matplotlib (the `bench` extra), drawn off-screen into PNG files. Each bench module
has a `plot(report, path)` drawn from its JSON report alone, so `moeserve bench docs` can draw it again."""

from __future__ import annotations

from pathlib import Path

from moeserve.errors import UserError


class PlotUnavailable(UserError):
    """--plot without matplotlib (a user error: the CLI exits 2)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), or PlotUnavailable saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'moeserve[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str,
         log: bool = False, errors: dict[str, list[float | None]] | None = None) -> None:
    """Grouped bars: one group per x label, one bar per series (None: no bar), with error bars from `errors`."""
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        err = [e or 0 for e in errors[name]] if errors and name in errors else None
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name, yerr=err, capsize=3 if err else 0)
    ax.set_xticks(range(len(groups)), groups, fontsize=8, rotation=20 if len(groups) > 4 else 0)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=7)


def save(fig, path: Path | str, title: str) -> None:
    plt = pyplot()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
