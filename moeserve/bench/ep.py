"""`moeserve bench ep`: what one MoE layer's expert-parallel exchange costs (runtime/expert_parallel.py), per rank,
at each token count: N processes on gloo over 127.0.0.1, each routing its own tokens through the same layer.

Per token count T, exchange and rank:
  exchange        variable (three all_to_all_single calls: counts, rows out, rows back) or packed (two: the counts
                  in the rows' header, the rows back; blocks sized for a step of T tokens, as a rank's steps run it)
  all-to-all      those calls of one layer call
  layer           the whole experts call: dispatch, exchange, this rank's experts, combine
  in process      the same layer with every expert in this process (no exchange), on the same compute path
and the bytes of rows that left the rank per call (there and back), so the all-to-all time reads against them.
Before anything is timed, each rank checks its layer's output against the in-process one.
"""

from __future__ import annotations

import multiprocessing
import statistics
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from moeserve.bench.report import BenchError, run_bench
from moeserve.bench.server_process import free_port
from moeserve.bench.stats import percentile, timed_ms
from moeserve.config import preset
from moeserve.runtime.backends.expert_shards import ExpertShard
from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group
from moeserve.runtime.experts import combine, dispatch
from moeserve.runtime.moe import MoELayer

WAIT_S = 300  # for the ranks' reports: a rank that died or hung ends the bench instead of stalling it
EXCHANGES = ("variable", "packed")


def spawn_ranks(target: Callable, world: int, args: tuple, timeout_s: float) -> dict[int, Any]:
    """{rank: what it reported} from `target(rank, world, port, *args, results)` run in one spawned process a rank,
    each putting (rank, report) on `results`; the ranks join a group at a free port of this host. A rank that sends
    nothing within timeout_s ends the wait (queue.Empty); every process is joined or killed on the way out."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _rank(rank: int, world: int, port: int, model: str, tokens: list[int], calls: int, results) -> None:
    """One rank's measurements (a spawned process): its rows per token count, or its traceback."""
    try:
        torch.set_num_threads(1)  # N ranks on a small machine: one thread each, as the tests run them
        group = join_group(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=WAIT_S)
        cfg = preset(model)
        torch.manual_seed(0)  # the same layer on every rank
        layer = MoELayer(cfg).eval()
        ep = ExpertParallelExperts.of(layer.experts, group)
        ep.prepare_inference()
        whole = ExpertShard.of(layer.experts, range(cfg.n_experts))  # every expert here, computed as a rank does
        whole.prepare_inference()
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
        rows = []
        with torch.inference_mode():
            for T, exchange in ((T, exchange) for T in tokens for exchange in EXCHANGES):
                ep.step_tokens = T if exchange == "packed" else None  # as the lockstep sets it for a step of T
                x = torch.randn(T, cfg.d_model, generator=g)
                r = layer.router(x)
                args = (x, r.expert_ids, r.gates, r.keep)
                want = _in_process(whole, cfg.n_experts, *args)
                torch.testing.assert_close(ep(*args), want, atol=1e-5, rtol=1e-5)
                calls0, sent0, a2a = ep.stats.calls, ep.stats.rows_sent, []

                def call() -> None:
                    s = ep.stats.all_to_all_s
                    ep(*args)
                    a2a.append((ep.stats.all_to_all_s - s) * 1e3)

                layer_ms = timed_ms(call, calls)
                a2a = a2a[5:]  # the untimed warm-up calls' too
                sent = (ep.stats.rows_sent - sent0) / (ep.stats.calls - calls0)  # rows to other ranks, per call
                rows.append({"tokens": T, "exchange": exchange, "rank": rank,
                             "a2a_p50_ms": round(statistics.median(a2a), 3),
                             "a2a_p99_ms": round(percentile(a2a, 99), 3),
                             "layer_p50_ms": round(statistics.median(layer_ms), 3),
                             "in_process_p50_ms": round(statistics.median(
                                 timed_ms(lambda: _in_process(whole, cfg.n_experts, *args), calls)), 3),
                             "kb_out_and_back": round(2 * sent * cfg.d_model * x.element_size() / 1024, 2)})
        group.leave()
        results.put((rank, rows))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _in_process(whole: ExpertShard, n_experts: int, x, ids, gates, keep):
    """The layer with every expert here: dispatch, the experts' compute as a rank runs it, combine."""
    d = dispatch(x, ids, gates, n_experts, keep)
    return combine(d, whole(d.x_ND, d.counts), x)


def bench_ep(ranks: int, tokens: list[int], calls: int, model: str = "small", log=lambda msg: None) -> dict:
    """Each of `ranks` processes' timings of one MoE layer of preset `model` at each token count."""
    cfg = preset(model)
    if not 1 <= ranks <= cfg.n_experts:
        raise BenchError(f"--ranks {ranks}: expected 1..{cfg.n_experts} (the layer's experts)")
    if not tokens or min(tokens) < 1 or calls < 1:
        raise BenchError(f"--tokens {tokens} and --calls {calls}: expected counts >= 1")
    log(f"starting {ranks} ranks on gloo (127.0.0.1), {calls} calls per token count")
    out = spawn_ranks(_rank, ranks, (model, tokens, calls), WAIT_S)
    failed = {r: tb for r, tb in out.items() if isinstance(tb, str)}
    if failed:
        raise RuntimeError(f"rank {min(failed)} failed:\n{failed[min(failed)]}")
    rows = sorted((row for r in out.values() for row in r),
                  key=lambda row: (row["tokens"], EXCHANGES.index(row["exchange"]), row["rank"]))
    return {"model": model, "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_experts": cfg.n_experts, "top_k": cfg.top_k,
            "ranks": ranks, "backend": "gloo", "calls": calls, "torch": torch.__version__, "results": rows}


def markdown(report: dict) -> str:
    lines = [f"One MoE layer ({report['model']}: D {report['d_model']}, F {report['d_ff']}, E {report['n_experts']}, "
             f"top-{report['top_k']}) over {report['ranks']} expert-parallel ranks on {report['backend']}, "
             f"{report['calls']} calls, torch {report['torch']}.", "",
             "| tokens | exchange | rank | all-to-all p50 ms | all-to-all p99 ms | layer p50 ms | in process p50 ms | "
             "KiB out and back |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['tokens']} | {r.get('exchange', 'variable')} | {r['rank']} | {r['a2a_p50_ms']} | "
                     f"{r['a2a_p99_ms']} | {r['layer_p50_ms']} | {r['in_process_p50_ms']} | {r['kb_out_and_back']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from moeserve.bench.plots import bars, pyplot, save

    groups = [f"{t} token(s)" for t in dict.fromkeys(r["tokens"] for r in report["results"])]
    series = {}
    for key, name in (("a2a_p50_ms", "all-to-all"), ("layer_p50_ms", "layer")):
        for exchange in EXCHANGES:
            for rank in range(report["ranks"]):
                by_t = {f"{r['tokens']} token(s)": r[key] for r in report["results"]
                        if r["rank"] == rank and r.get("exchange", "variable") == exchange}
                series[f"{name}, {exchange}, rank {rank}"] = [by_t.get(g) for g in groups]
    for rank in range(report["ranks"]):  # the same for both exchanges: the variable rows'
        by_t = {f"{r['tokens']} token(s)": r["in_process_p50_ms"] for r in report["results"]
                if r["rank"] == rank and r.get("exchange", "variable") == "variable"}
        series[f"in process, rank {rank}"] = [by_t.get(g) for g in groups]
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    bars(ax, groups, series, "p50 ms per layer call", "expert-parallel exchange", log=True)
    save(fig, path, f"moeserve bench ep: {report['ranks']} ranks, {report['model']} layer")


def main(args) -> int:
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"moeserve bench ep: {msg}", flush=True))
    report = run_bench(args, "ep", lambda progress: bench_ep(args.ranks, args.tokens, args.calls, args.model, log))
    return 0 if report is not None else 2
