"""`moeserve bench shards`: what one MoE layer's expert exchange costs when the experts live in Ray
(serve/ray_app.py), against the same layer in this process, in one run.

Per token count T, over the same routed inputs:
  in process      ShardedExperts.split: dispatch -> each shard's experts -> combine, no Ray (the baseline)
  serve handles   RemoteExperts over Ray Serve deployment handles, as the ingress calls them
  ray actors      the same shards as plain Ray actors (actor.method.remote + ray.get), without Serve's router
  compiled graph  those actors behind one Ray Compiled Graph (ray.dag, experimental_compile): channels set up
                  once, no task submission per call
and what an exchange is made of: the compute of the slowest shard (timed in process), and turning the
rows into arrays and back (`to_wire` / `from_wire`), so that transport = exchange - compute - wire.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeserve.bench.report import check_plot, finish
from moeserve.bench.stats import percentile
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.expert_shards import ShardedExperts
from moeserve.runtime.experts import dispatch
from moeserve.runtime.model import Transformer


def _timed(call, calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls, after 5 untimed."""
    for _ in range(5):
        call()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _row(path: str, tokens: int, ms: list[float], base: float | None) -> dict:
    p50 = statistics.median(ms)
    return {"path": path, "tokens": tokens, "p50_ms": round(p50, 3), "p99_ms": round(percentile(ms, 99), 3),
            "vs_in_process": round(p50 / base, 1) if base else None}


def bench_shards(n_shards: int, tokens: list[int], calls: int, model: str = "small", log=lambda msg: None) -> dict:
    import ray
    from ray import serve

    from moeserve.serve.ray_app import ExpertShardServer, RemoteExperts, from_wire, shard_ranges, to_wire

    torch.manual_seed(0)
    cfg = preset(model)
    net = Transformer(cfg)
    layer = net.moe_layers[0]
    ranges = shard_ranges(cfg.n_experts, n_shards)
    local = ShardedExperts.split(layer.experts, n_shards)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(Path(tmp) / "model", cfg, net.state_dict())
        ray.init(num_cpus=max(2, n_shards + 1), include_dashboard=False, log_to_driver=False)
        try:
            log(f"deploying {n_shards} expert shards on Ray Serve")
            handles = [serve.run(ExpertShardServer.options(name=f"experts-{s}", ray_actor_options={"num_cpus": 0.1})
                                 .bind(str(ckpt), r.start, r.stop, "float32"), name=f"bench-experts-{s}",
                                 route_prefix=None) for s, r in enumerate(ranges)]
            actor = ray.remote(num_cpus=0.1)(ExpertShardServer.func_or_class)
            actors = [actor.remote(str(ckpt), r.start, r.stop, "float32") for r in ranges]
            remote = RemoteExperts(cfg.moe_layer_ids[0], cfg.n_experts, handles, ranges, torch.float32, timeout_s=60)
            layer_id = cfg.moe_layer_ids[0]

            def via_actors(inputs):
                refs = [a.forward.remote(layer_id, to_wire(x), c) for a, (x, c) in zip(actors, inputs)]
                return [from_wire(y, torch.float32) for y in ray.get(refs)]

            by_actors = RemoteExperts(layer_id, cfg.n_experts, actors, ranges, torch.float32)
            by_actors.run_shards = via_actors
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:  # one compiled graph: (x, counts) per shard in, each shard's rows out
                graph = MultiOutputNode([a.forward.bind(layer_id, inp[2 * s], inp[2 * s + 1])
                                         for s, a in enumerate(actors)]).experimental_compile()

            def via_graph(inputs):
                flat = [v for x, c in inputs for v in (to_wire(x), c)]
                return [from_wire(y, torch.float32) for y in ray.get(graph.execute(*flat))]

            by_graph = RemoteExperts(layer_id, cfg.n_experts, actors, ranges, torch.float32)
            by_graph.run_shards = via_graph
            for T in tokens:
                x = torch.randn(T, cfg.d_model)
                with torch.inference_mode():
                    routing = layer.router(x)
                    args = (x, routing.expert_ids, routing.gates, routing.keep)
                    want = local(*args)
                    for module in (remote, by_actors, by_graph):
                        torch.testing.assert_close(module(*args), want, atol=1e-5, rtol=1e-5)  # same answer
                    log(f"timing {T} token(s), {calls} calls per path")
                    base = _timed(lambda: local(*args), calls)
                    b50 = statistics.median(base)
                    rows.append(_row("in process", T, base, b50))
                    rows.append(_row("serve handles", T, _timed(lambda: remote(*args), calls), b50))
                    rows.append(_row("ray actors", T, _timed(lambda: by_actors(*args), calls), b50))
                    rows.append(_row("ray compiled graph", T, _timed(lambda: by_graph(*args), calls), b50))
                    d = dispatch(x, routing.expert_ids, routing.gates, cfg.n_experts, routing.keep)
                    blocks = d.blocks()
                    inputs = [(torch.cat([blocks[e] for e in r]), [d.counts[e] for e in r]) for r in ranges]
                    compute = [_timed(lambda s=s, i=i: s(*i), calls) for s, i in zip(local.shards, inputs)]
                    rows.append(_row("compute, slowest shard", T, [max(c) for c in zip(*compute)], b50))
                    # rows out and the same number back: each shard's input converted twice
                    wire = _timed(lambda: [from_wire(to_wire(x_), torch.float32) for x_, _ in inputs for _ in "ab"],
                                  calls)
                    rows.append(_row("to/from arrays, both ways", T, wire, b50))
            graph.teardown()
        finally:
            serve.shutdown()
            ray.shutdown()
    return {"model": model, "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_experts": cfg.n_experts,
            "top_k": cfg.top_k, "shards": n_shards, "calls": calls, "ray": ray.__version__, "results": rows}


def markdown(report: dict) -> str:
    lines = [f"One MoE layer ({report['model']}: D {report['d_model']}, F {report['d_ff']}, E {report['n_experts']}, "
             f"top-{report['top_k']}) over {report['shards']} shards, {report['calls']} calls per path, Ray "
             f"{report['ray']}.", "", "| path | tokens | p50 ms | p99 ms | p50 vs in process |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['path']} | {r['tokens']} | {r['p50_ms']} | {r['p99_ms']} | {r['vs_in_process']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from moeserve.bench.plots import bars, pyplot, save

    groups = [f"{t} token(s)" for t in dict.fromkeys(r["tokens"] for r in report["results"])]
    paths = list(dict.fromkeys(r["path"] for r in report["results"]))
    p50 = {(f"{r['tokens']} token(s)", r["path"]): r["p50_ms"] for r in report["results"]}
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    bars(ax, groups, {p: [p50.get((g, p)) for g in groups] for p in paths}, "p50 ms per layer", "expert exchange",
         log=True)
    save(fig, path, f"moeserve bench shards: {report['shards']} shards, {report['model']} layer")


def main(args) -> int:
    check_plot(args)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"moeserve bench shards: {msg}", flush=True))
    try:
        import ray  # noqa: F401
    except ImportError:
        print("moeserve bench shards: error: needs Ray: pip install -e '.[ray]'")
        return 2
    report = bench_shards(args.shards, args.tokens, args.calls, args.model, log=log)
    print(markdown(report))
    finish(report, args, "shards")
    return 0
