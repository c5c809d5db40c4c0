"""`moeserve bench serve`'s reports as people read them: the table, two runs side by side, the plot. Drawn
from the JSON alone, so `moeserve bench docs` renders any report again."""

from __future__ import annotations

from pathlib import Path

from moeserve.bench.stats import ratio


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def level_name(level: dict) -> str:
    value = level["value"] if level["value"] == "inf" else f"{level['value']:g}"
    return f"{'C' if level['kind'] == 'concurrency' else 'R'}={value}"


def markdown(report: dict) -> str:
    procs = report["config"].get("client_procs", 1)  # older reports: one
    client = f"client ({procs} processes)" if procs > 1 else "client"
    lines = [f"{report['server']['url']} ({report['model']}), {report['config']['endpoint']}, ignore_eos "
             f"{'on' if report['ignore_eos'] else 'off'}; {client} on {report['machine']['cpu']}, "
             f"{report['machine']['cores']} cores", "",
             "| level | ok / sent | errors | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "E2E p50 / p99 ms | goodput |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for lv in report["levels"]:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(lv["errors"].items())) or "-"
        if lv.get("retries"):  # not errors: sent again after a kept-alive connection closed unanswered
            errors += f" ({lv['retries']} retried)"
        lines.append(f"| {level_name(lv)} | {lv['ok']} / {lv['requests']} | {errors} | {_f(lv['requests_per_s'], 2)} | "
                     f"{_f(lv['output_tokens_per_s'])} | {_f(lv['ttft_ms']['p50'])} / {_f(lv['ttft_ms']['p99'])} | "
                     f"{_f(lv['itl_ms']['p50'])} / {_f(lv['itl_ms']['p99'])} | {_f(lv['e2e_ms']['p50'])} / "
                     f"{_f(lv['e2e_ms']['p99'])} | {_f(None if lv['goodput'] is None else 100 * lv['goodput'])}% |")
    if not report["complete"]:
        lines += ["", f"INCOMPLETE: {report['error']}"]
    return "\n".join(lines)


def compare(a: dict, b: dict) -> str:
    """Two runs' levels side by side (matched by kind and value), with B / A ratios."""
    lines = [f"A: {a['server']['url']} ({a['model']}); B: {b['server']['url']} ({b['model']})", "",
             "| level | req/s A / B | ratio | out tok/s A / B | ratio | TTFT p50 ms A / B | ITL p50 ms A / B | "
             "E2E p99 ms A / B |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    theirs = {(lv["kind"], lv["value"]): lv for lv in b["levels"]}
    for x in a["levels"]:
        y = theirs.get((x["kind"], x["value"]))
        if y is None:
            continue
        lines.append(f"| {level_name(x)} | {_f(x['requests_per_s'], 2)} / {_f(y['requests_per_s'], 2)} | "
                     f"{_f(ratio(y['requests_per_s'], x['requests_per_s']), 2)} | {_f(x['output_tokens_per_s'])} / "
                     f"{_f(y['output_tokens_per_s'])} | {_f(ratio(y['output_tokens_per_s'], x['output_tokens_per_s']), 2)} | "
                     f"{_f(x['ttft_ms']['p50'])} / {_f(y['ttft_ms']['p50'])} | {_f(x['itl_ms']['p50'])} / "
                     f"{_f(y['itl_ms']['p50'])} | {_f(x['e2e_ms']['p99'])} / {_f(y['e2e_ms']['p99'])} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Latency against throughput across the levels, and the TTFT / ITL percentiles per level."""
    from moeserve.bench.plots import pyplot, save

    levels = [lv for lv in report["levels"] if lv["ok"]]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for kind, marker in (("concurrency", "o-"), ("rate", "s--")):
        xs = [lv for lv in levels if lv["kind"] == kind]
        if xs:
            left.plot([lv["output_tokens_per_s"] for lv in xs], [lv["e2e_ms"]["p50"] for lv in xs], marker,
                      label=f"{kind}: E2E p50")
            for lv in xs:
                left.annotate(level_name(lv), (lv["output_tokens_per_s"], lv["e2e_ms"]["p50"]), fontsize=8)
    left.set_xlabel("output tokens/s")
    left.set_ylabel("end-to-end latency p50 (ms)")
    left.set_title("latency against throughput")
    left.legend()
    names = [level_name(lv) for lv in levels]
    width = 0.13
    for j, (metric, q) in enumerate([(m, q) for m in ("ttft_ms", "itl_ms") for q in ("p50", "p90", "p99")]):
        right.bar([i + (j - 2.5) * width for i in range(len(levels))], [lv[metric][q] or 0 for lv in levels], width,
                  label=f"{metric.removesuffix('_ms').upper()} {q}")
    right.set_xticks(range(len(levels)), names)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("TTFT and ITL percentiles")
    right.legend(fontsize=7)
    save(fig, path, f"moeserve bench serve: {report['model']} at {report['server']['url']}")
