"""What `moeserve bench http` reports: its tables and its plot, drawn from the JSON report alone (bench/http.py
measures), so that `moeserve bench docs` renders any report again."""

from __future__ import annotations

from pathlib import Path

def _cell(x) -> str:
    return "-" if x is None else str(x)


def loop_table(rows: list[dict]) -> list[str]:
    lines = ["| server | requests | errors | req/s | gen tokens/s | p50 ms | p90 ms | p99 ms | p50 ms by max_tokens "
             "| mean batch |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        by = ", ".join(f"{k}: {_cell(v['p50_ms'])}" for k, v in r["by_max_tokens"].items())
        lines.append(f"| {r['config']} ({r['flags']}) | {r['requests']} | {r['errors']} | {r['rps']} | "
                     f"{r['tokens_per_s']} | {_cell(r['p50_ms'])} | {_cell(r['p90_ms'])} | {_cell(r['p99_ms'])} | "
                     f"{by} | {_cell(r['mean_batch_size'])} |")
    return lines


def throughput_markdown(t: dict, cfg: dict) -> list[str]:
    lines = [f"Throughput: {cfg['clients']} clients, closed loop, {cfg['duration_s']:g} s after "
             f"{cfg['warmup_s']:g} s warm-up, max_tokens {cfg['max_tokens']}, temperature 0.8", ""]
    goal = "met" if t["speedup"] is not None and t["speedup"] >= 4 else "not met"
    return lines + loop_table(t["rows"]) + [
        "", f"Batching vs batch size 1 (req/s): {_cell(t['speedup'])}x (goal >= 4x: {goal}); continuous vs batch: "
        f"{_cell(t['continuous_vs_batch'])}x"]


def mixed_markdown(t: dict, cfg: dict) -> list[str]:
    lines = [f"Mixed: {cfg['clients']} clients, half asking max_tokens {cfg['max_tokens']}, half "
             f"{cfg['long_tokens']}, closed loop, {cfg['duration_s']:g} s after {cfg['warmup_s']:g} s warm-up", ""]
    rps_goal = "met" if t["rps_ratio"] is not None and t["rps_ratio"] >= 1.5 else "not met"
    p50_goal = "met" if t["short_p50_ratio"] is not None and t["short_p50_ratio"] <= 0.5 else "not met"
    return lines + loop_table(t["rows"]) + [
        "", f"Continuous vs batch: req/s {_cell(t['rps_ratio'])}x (goal >= 1.5x: {rps_goal}); p50 latency of the "
        f"{cfg['max_tokens']}-token requests {_cell(t['short_p50_ratio'])}x (goal <= 0.5x: {p50_goal})"]


def overhead_markdown(rows: list[dict]) -> list[str]:
    lines = ["HTTP overhead: one client, the same greedy request, paired with a direct Engine.complete call", "",
             "| server | rounds | p50 HTTP ms | p50 direct ms | p50 overhead ms | p90 overhead ms | same text |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| --batch-wait-ms {r['batch_wait_ms']:g} | {r['requests']} | {r['p50_http_ms']} | "
                     f"{r['p50_direct_ms']} | {r['p50_overhead_ms']} | {r['p90_overhead_ms']} | "
                     f"{'yes' if r['same_text'] else 'no'} |")
    return lines


def overload_markdown(r: dict) -> list[str]:
    return [f"Overload: {r['requests']} requests at once, --max-queue {r['max_queue']} --max-batch-size "
            f"{r['max_batch_size']}, max_tokens {r['max_tokens']}", "",
            "| 200 | 429 | other | p50 429 ms | p99 429 ms | p50 200 ms | every 429 has Retry-After |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
            f"| {r['ok']} | {r['rejected_429']} | {r['other']} | {_cell(r['p50_429_ms'])} | {_cell(r['p99_429_ms'])} | "
            f"{_cell(r['p50_200_ms'])} | {'yes' if r['all_429_retry_after'] else 'no'} |"]


def choices_markdown(r: dict) -> list[str]:
    n, separate = r["choices_per_s"]  # "n=4", "4 requests", in the order bench/http.py measured them
    return [f"Choices and log-probabilities: a prompt of about {r['prompt_tokens']} tokens, {r['rounds']} alternating "
            "rounds", "",
            f"| {n}: choices/s | {separate} at once: choices/s | ratio | expert tokens per round ({n} / {separate}) | "
            "same choices | tokens/s logprobs 5 | tokens/s none | ratio | same text |",
            "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
            f"| {r['choices_per_s'][n]} | {r['choices_per_s'][separate]} | {_cell(r['n_vs_separate'])} | "
            f"{r['routed_per_round'][n]:g} / {r['routed_per_round'][separate]:g} | "
            f"{'yes' if r['same_choices'] else 'no'} | {r['tokens_per_s']['logprobs 5']} | "
            f"{r['tokens_per_s']['no logprobs']} | {_cell(r['logprobs_cost'])} | {'yes' if r['same_text'] else 'no'} |"]


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"`{report['checkpoint']}`, {report['dtype']}, on {m['cpu']}, {m['cores']} cores, torch {m['torch']}; "
             f"load average before {report['load_average_before']}, after {report['load_average_after']}"]
    if "throughput" in report:
        lines += [""] + throughput_markdown(report["throughput"], report["settings"])
    if "mixed" in report:
        lines += [""] + mixed_markdown(report["mixed"], report["settings"])
    if "overhead" in report:
        lines += [""] + overhead_markdown(report["overhead"])
    if "overload" in report:
        lines += [""] + overload_markdown(report["overload"])
    if "choices" in report:
        lines += [""] + choices_markdown(report["choices"])
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Requests/s and p50 latency of each server configuration and workload, and the choices measure."""
    from moeserve.bench.plots import bars, pyplot, save

    loops = [(part, r) for part in ("throughput", "mixed") if part in report for r in report[part]["rows"]]
    panels = 2 + ("choices" in report)
    fig, axes = pyplot().subplots(1, panels, figsize=(5.5 * panels, 4.5), squeeze=False)
    configs = list(dict.fromkeys(r["config"] for _, r in loops))
    parts = list(dict.fromkeys(part for part, _ in loops))
    by = {(part, r["config"]): r for part, r in loops}
    for ax, key, label in ((axes[0][0], "rps", "requests/s"), (axes[0][1], "p50_ms", "p50 latency ms")):
        bars(ax, configs, {part: [(by.get((part, c)) or {}).get(key) for c in configs] for part in parts}, label,
             label)
    if "choices" in report:
        c = report["choices"]
        bars(axes[0][2], list(c["choices_per_s"]), {"choices/s": list(c["choices_per_s"].values())}, "choices/s",
             f"n choices, prompt of {c['prompt_tokens']} tokens")
    save(fig, path, f"moeserve bench http: {Path(report['checkpoint']).name}, {report['dtype']}")
