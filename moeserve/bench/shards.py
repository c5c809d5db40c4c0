"""`moeserve bench shards`: what one MoE layer's expert exchange costs when the experts live in Ray
(serve/ray_app.py), against the same layer in this process, in one run.

Per token count T, over the same routed inputs:
  in process      ShardedExperts.split: dispatch -> each shard's experts -> combine, no Ray (the baseline)
  serve handles   RemoteExperts over Ray Serve deployment handles, as the ingress calls them
  ray actors      the ingress's shard actors called plainly (actor.method.remote + ray.get; --exchange actors)
  compiled graph  the same actors behind one Ray Compiled Graph (ray.dag, experimental_compile), channels set
                  up once (--exchange compiled)
  ray actors, sockets  the same actors sent their rows over a TCP connection each (--exchange sockets, the
                  default; serve/shard_socket.py)
Each remote path is timed on a Ray of its own, as each is deployed.
and what an exchange is made of: the compute of the slowest shard (timed in process), and turning the
rows into arrays and back (`to_wire` / `from_wire`), so that transport = exchange - compute - wire.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from moeserve.bench.report import check_plot, finish
from moeserve.bench.stats import percentile, timed_ms
from moeserve.checkpoint import save_checkpoint
from moeserve.config import preset
from moeserve.runtime.backends.expert_shards import ShardedExperts
from moeserve.runtime.experts import dispatch
from moeserve.runtime.model import Transformer


PATHS = ["in process", "serve handles", "ray actors", "ray compiled graph", "ray actors, sockets",
         "compute, slowest shard", "to/from arrays, both ways"]


def _row(path: str, tokens: int, ms: list[float], base: float | None) -> dict:
    p50 = statistics.median(ms)
    return {"path": path, "tokens": tokens, "p50_ms": round(p50, 3), "p99_ms": round(percentile(ms, 99), 3),
            "vs_in_process": round(p50 / base, 1) if base else None}


def bench_shards(n_shards: int, tokens: list[int], calls: int, model: str = "small", log=lambda msg: None) -> dict:
    torch.manual_seed(0)
    # one torch thread here, as in an ingress replica of one CPU: a second thread's OpenMP spin-wait after each op
    # would take a core from the shards on a small machine (measured: a compiled graph's exchange 5-10x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _bench(n_shards, tokens, calls, model, log)
    finally:
        torch.set_num_threads(threads)


def _bench(n_shards: int, tokens: list[int], calls: int, model: str, log) -> dict:
    import ray
    from ray import serve

    from moeserve.serve.ray_app import ExpertShardServer, RemoteExperts, ShardActors, shard_ranges
    from moeserve.serve.shard_socket import from_wire, to_wire

    cfg = preset(model)
    net = Transformer(cfg)
    layer = net.moe_layers[0]
    ranges = shard_ranges(cfg.n_experts, n_shards)
    local = ShardedExperts.split(layer.experts, n_shards)
    for shard in local.shards:  # computing as a shard actor does (the C kernel where it is built)
        shard.prepare_inference()
    cases = []  # per token count: (T, the layer's arguments, the routed rows per shard)
    for T in tokens:
        x = torch.randn(T, cfg.d_model)
        with torch.inference_mode():
            routing = layer.router(x)
        args = (x, routing.expert_ids, routing.gates, routing.keep)
        d = dispatch(x, routing.expert_ids, routing.gates, cfg.n_experts, routing.keep)
        blocks = d.blocks()
        cases.append((T, args, [(torch.cat([blocks[e] for e in r]), [d.counts[e] for e in r]) for r in ranges]))
    ms: dict[tuple[str, int], list[float]] = {}

    def measure(name: str, module) -> None:
        """`module` gives the in-process layer's output (checked first), then its timings per token count."""
        with torch.inference_mode():
            for T, args, _ in cases:
                torch.testing.assert_close(module(*args), local(*args), atol=1e-5, rtol=1e-5)
                log(f"timing {name}, {T} token(s), {calls} calls")
                ms[name, T] = timed_ms(lambda: module(*args), calls)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(save_checkpoint(Path(tmp) / "model", cfg, net.state_dict()))
        layer_id = cfg.moe_layer_ids[0]
        measure("in process", local)
        with torch.inference_mode():
            for T, _, inputs in cases:
                compute = [timed_ms(lambda s=s, i=i: s(*i), calls) for s, i in zip(local.shards, inputs)]
                ms["compute, slowest shard", T] = [max(c) for c in zip(*compute)]
                # rows out and as many back: each shard's input converted twice
                ms["to/from arrays, both ways", T] = timed_ms(
                    lambda: [from_wire(to_wire(x), torch.float32) for x, _ in inputs for _ in "ab"], calls)

        def serve_handles():
            handles = [serve.run(ExpertShardServer.options(name=f"experts-{s}", ray_actor_options={"num_cpus": 0.1})
                                 .bind(ckpt, r.start, r.stop, "float32"), name=f"bench-experts-{s}",
                                 route_prefix=None) for s, r in enumerate(ranges)]
            return RemoteExperts(layer_id, cfg.n_experts, handles, ranges, torch.float32, 60)

        def shard_actors(exchange: str):
            actors = ShardActors(ckpt, ranges, "float32", 0.1, 0.0, timeout_s=60, exchange=exchange)
            return RemoteExperts(layer_id, cfg.n_experts, actors, ranges, torch.float32)

        for name, make in (("serve handles", serve_handles), ("ray actors", lambda: shard_actors("actors")),
                           ("ray compiled graph", lambda: shard_actors("compiled")),
                           ("ray actors, sockets", lambda: shard_actors("sockets"))):
            ray.init(num_cpus=max(2, n_shards + 1), include_dashboard=False, log_to_driver=False)
            try:  # each path on a Ray of its own: nothing of another path's left running beside it
                log(f"setting up {name}")
                module = make()
                measure(name, module)
                if isinstance(module.handles, ShardActors):
                    module.handles.teardown()
            finally:
                serve.shutdown()
                ray.shutdown()
    rows = []
    for T in tokens:
        base = statistics.median(ms["in process", T])
        rows += [_row(path, T, ms[path, T], base) for path in PATHS]
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
