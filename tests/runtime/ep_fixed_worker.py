"""What each rank process of tests/runtime/test_expert_parallel_fixed.py runs (a module of its own, importable by a
spawned process): the fixed-size exchange compiled with torch.compile(fullgraph=True) on gloo, where a graph break
(a host sync: .item(), .tolist(), a size read from the counts) fails the compile, compared with the variable
exchange and the single-process layer. Everything it reports is plain data."""

from __future__ import annotations

import copy
import traceback

import torch

from moeserve.config import preset
from moeserve.runtime.backends.compiled import CompiledDecode
from moeserve.runtime.engine import SamplingParams
from moeserve.runtime.ep_rank import EPRank, RankOptions
from moeserve.runtime.expert_parallel import ExpertParallelExperts, join_group, use_fixed_exchange
from moeserve.runtime.experts import Experts, moe_reference
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import Transformer
from moeserve.runtime.moe import MoELayer

WAIT_S = 120  # a collective that waits longer fails the run (a peer compiling on a loaded machine takes ~30 s)
MAX_TOKENS = 8  # use_fixed's: the same on both ranks
ROUTERS = ("softmax", "xmoe")
LAYER_TOKENS = {0: 6, 1: 3}  # per rank: different shapes, one buffer size
SLOTS = 2  # the compiled decode step's: batch buckets 1 and 2
DECODE_ROWS = {0: [[1, 5, 9, 14, 3], [1, 7, 7, 2, 8]], 1: [[1, 40, 41, 42, 43]]}  # fed one token a step: bucket 2 | 1


def layer_cases(group) -> dict[str, dict[str, float]]:
    """Per router, max |difference| of the compiled fixed exchange's layer output from the single-process layer's
    and the variable exchange's, and of the eager fixed exchange from the single-process layer."""
    out = {}
    for router in ROUTERS:
        torch.manual_seed(0)  # the same layer on every rank
        layer = MoELayer(preset("tiny", router=router)).eval()
        variable, fixed = copy.deepcopy(layer), copy.deepcopy(layer)
        variable.experts = ExpertParallelExperts.of(layer.experts, group)
        fixed.experts = ExpertParallelExperts.of(layer.experts, group).use_fixed(MAX_TOKENS)
        compiled = torch.compile(fixed, fullgraph=True, dynamic=False)
        g = torch.Generator().manual_seed(20 + group.rank)  # each rank its own tokens
        x = torch.randn(1, LAYER_TOKENS[group.rank], layer.cfg.d_model, generator=g)
        with torch.inference_mode():
            want, _ = layer(x)
            var, _ = variable(x)
            eager, _ = fixed(x)
            got, aux = compiled(x)
            _, want_aux = layer(x)
        out[router] = {"compiled_vs_layer": float((got - want).abs().max()),
                       "compiled_vs_variable": float((got - var).abs().max()),
                       "eager_vs_layer": float((eager - want).abs().max()),
                       "counts_equal": bool(torch.equal(aux.counts, want_aux.counts)),
                       "fixed_calls": fixed.experts.stats.calls}
    return out


def skewed_cases(group) -> list[dict]:
    """The experts alone, compiled, under loads a router would rarely give: every row to rank 0's experts (rank 1
    receives zero rows) with a capacity mask dropping some, then rank 0 at the buffers' full size with all its
    rows for rank 1 (C rows exactly to another rank) beside rank 1 with no tokens at all (rank 0 receives
    none). `received_rows`: what the variable exchange beside it counted, after each case."""
    torch.manual_seed(0)
    ex = Experts(8, 16, 24, "swiglu")
    variable = ExpertParallelExperts.of(ex, group)
    fixed = ExpertParallelExperts.of(ex, group).use_fixed(MAX_TOKENS)
    compiled = torch.compile(fixed, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(30 + group.rank)
    out = []
    for name, T, masked in (("all_to_rank_0", 5, True), ("full_beside_empty", MAX_TOKENS if group.rank == 0 else 0,
                                                          False)):
        x = torch.randn(T, 16, generator=g)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)]) if T else torch.zeros(0, 2).long()
        ids = ids + (4 if name == "full_beside_empty" else 0)  # rank 1's experts: C rows exactly to another rank
        gates = torch.rand(T, 2, generator=g)
        keep = torch.rand(T, 2, generator=g) < 0.7 if masked else None
        with torch.inference_mode():
            want = moe_reference(x, ids, gates, ex.w1, ex.w2, ex.w3, keep)
            var = variable(x, ids, gates, keep)
            got = compiled(x, ids, gates, keep)
        out.append({"case": name, "tokens": T, "shape": list(got.shape),
                    "compiled_vs_reference": float((got - want).abs().max()) if T else 0.0,
                    "compiled_vs_variable": float((got - var).abs().max()) if T else 0.0,
                    "received_rows": variable.stats.rows_received})
    return out


def decode_cases(group) -> dict:
    """The whole decode step (compiled.CompiledDecode: the model and its KV cache in one fullgraph compile) with
    the fixed exchange in every MoE layer, rank 0 at batch bucket 2 beside rank 1 at bucket 1: the logits of
    each token fed one step at a time, against the single-process model's over the whole rows."""
    torch.manual_seed(0)  # the same model on every rank
    model = Transformer(preset("tiny")).eval()
    ep = copy.deepcopy(model)
    for layer, whole in zip(ep.moe_layers, model.moe_layers):
        layer.experts = ExpertParallelExperts.of(whole.experts, group)
    assert use_fixed_exchange(ep, SLOTS) == len(ep.moe_layers)
    step = CompiledDecode(ep, KVCache.for_model(ep, SLOTS + 1, spare=1))
    rows = DECODE_ROWS[group.rank]
    with torch.inference_mode():
        want = model(torch.tensor(rows)).logits
        got = torch.stack([step(list(range(len(rows))), torch.tensor([r[p] for r in rows]), [p] * len(rows))[0][:, 0]
                           for p in range(len(rows[0]))], dim=1)
    return {"max_diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "graphs": sorted({b for b, _ in step.steps}), "steps": sum(step.steps.values())}


def compiled_ranks(ckpt: str, group) -> dict:
    """ep_worker's requests (prompts written in chunks beside the other rank's decodes, n = 2, logprobs, scoring)
    served by ranks whose decode step is compiled (RankOptions.compile 'on'): how their decodes ran (`graph`: the
    compiled step, in steps where every rank only decoded; `eager`: the others) and the ranks' passes."""
    import ep_worker

    ep = EPRank.load(ckpt, group, RankOptions(slots=SLOTS, prefill_chunk=ep_worker.PREFILL_CHUNK, compile="on"))
    ep.start()
    futures = [ep.submit(p, SamplingParams(**kw)) for p, kw in ep_worker.REQUESTS[group.rank]]
    rows = ep_worker.SCORE_ROWS[group.rank]
    scores = ep.submit_scores(rows) if rows else None
    done = [ep_worker.completion_record(f.result(WAIT_S)) for f in futures]
    row_scores = [s.logprob for s in scores.result(WAIT_S)] if scores is not None else []
    ep.stop()
    ep.thread.join(WAIT_S)
    return {"completions": done, "scores": row_scores, "stopped": not ep.thread.is_alive(), "graph": ep.graph,
            "decode_tokens": dict(ep.engine.executor.decode_tokens), **ep_worker.stats_record(ep)}


def main(rank: int, world: int, port: int, ckpt: str, results) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    try:
        group = join_group(f"tcp://127.0.0.1:{port}", rank, world, timeout_s=WAIT_S)
        out = {"layers": layer_cases(group), "skewed": skewed_cases(group), "decode": decode_cases(group),
               "ranks": compiled_ranks(ckpt, group)}
        group.leave()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
