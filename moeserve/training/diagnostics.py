"""The papers' own measures of routing and experts, computed on a checkpoint's forward pass.

  RC           Tr(Sigma_W Sigma_B^+) of router inputs grouped by top-1 expert      X-MoE 4.5, eq. 11
  RF ratio     share of tokens whose top-1 expert differs between two checkpoints   X-MoE 4.5, Fig. 3a
  consistency  mean of the Pearson correlation matrix of m runs' expert loads       X-MoE 4.5, Fig. 3b
  diversity    share of parameters differing by > 1e-3 between two experts, and    OMoE 4.2, Table 1
               the variance of the experts' outputs on the same input
  load         entropy of the expert load, max / mean, dead experts, VQ code use    (the balance losses' target)

Each measure is a plain function of tensors, so a test can hand it inputs whose answer is known; `collect`
runs a model (the runtime's forward pass, unchanged) and gathers what they read: each MoE layer's input (the
router's input) and its aux.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from moeserve.runtime.model import Transformer
from moeserve.training.losses import load_entropy

PARAM_DIFF_THRESHOLD = 1e-3  # OMoE 4.2: "parameters ... similar if their differences ... are below 1E-3"


def representation_collapse(x_TD: Tensor, groups_T: Tensor, rtol: float = 1e-10) -> float:
    """RC = Tr(Sigma_W Sigma_B^+) (X-MoE section 4.5, eq. 11, the neural-collapse measure of Zhu et al. 2021).

    Sigma_W is the covariance of each token around its group's mean (over all tokens), Sigma_B the covariance
    of the group means around their mean (over groups). Small RC: tokens have collapsed onto their expert's
    centroid; the X-MoE paper reads a larger RC as less collapse. Groups are the top-1 experts that received
    tokens; with fewer than two, Sigma_B is zero and RC is undefined (nan). float64, and Sigma_B's
    pseudo-inverse drops eigenvalues below rtol of the largest (it has rank at most groups - 1)."""
    x = x_TD.double()
    names, groups = groups_T.unique(return_inverse=True)
    if len(names) < 2:
        return math.nan
    means_GD = torch.zeros(len(names), x.shape[1], dtype=x.dtype).index_add_(0, groups, x)
    means_GD /= torch.bincount(groups, minlength=len(names)).to(x.dtype)[:, None]
    within = x - means_GD[groups]
    sigma_w = within.T @ within / x.shape[0]
    between = means_GD - means_GD.mean(dim=0)
    sigma_b = between.T @ between / len(names)
    return float(torch.trace(sigma_w @ torch.linalg.pinv(sigma_b, rtol=rtol, hermitian=True)))


def routing_fluctuation(top1_a: Tensor, top1_b: Tensor) -> float:
    """RF ratio (X-MoE section 4.5, Fig. 3a): the share of the same tokens whose top-1 expert changed between
    two checkpoints. 0 is perfectly stable routing."""
    if top1_a.shape != top1_b.shape:
        raise ValueError(f"routing of {tuple(top1_a.shape)} and {tuple(top1_b.shape)} tokens: not the same tokens")
    return float((top1_a != top1_b).double().mean())


def inter_run_consistency(loads_ME: Tensor) -> float:
    """IC = sum_ij rho(l_i, l_j) / m^2 (X-MoE section 4.5, Fig. 3b): the mean of the Pearson correlation
    matrix of m runs' expert-load vectors (tokens per expert). 1 when every run loads the experts alike.
    Undefined (nan) when a run's load is exactly uniform: a constant vector has no correlation."""
    if loads_ME.dim() != 2 or loads_ME.shape[0] < 2:
        raise ValueError(f"inter-run consistency needs the loads of at least 2 runs, got shape {tuple(loads_ME.shape)}")
    return float(torch.corrcoef(loads_ME.double()).mean())


def parameter_difference(w_EP: Tensor, threshold: float = PARAM_DIFF_THRESHOLD) -> float:
    """OMoE section 4.2 ("Similarity over experts"): the share of parameters at the same position that differ
    by more than `threshold` between two experts, averaged over every pair (the paper samples pairs; all 28 of
    8 experts cost nothing here). 0 for identical experts. w_EP: each expert's parameters flattened."""
    E = w_EP.shape[0]
    if E < 2:
        return math.nan
    shares = [float(((w_EP[i] - w_EP[j]).abs() > threshold).double().mean())
              for i, j in itertools.combinations(range(E), 2)]
    return sum(shares) / len(shares)


def output_variance(y_ETD: Tensor) -> tuple[float, float]:
    """OMoE section 4.2: the variance of every expert's output on the same inputs, across experts, averaged
    over tokens and features; and that variance relative to the outputs' mean square, which does not change
    when a model's scale does. 0 for identical experts."""
    y = y_ETD.double()
    var = float(y.var(dim=0, unbiased=False).mean())
    return var, var / max(float(y.pow(2).mean()), 1e-300)


def load_stats(counts_E: Tensor) -> dict:
    """The load of one layer: entropy over log2(E) (1 is perfect balance), the busiest expert's tokens over
    the mean, and the experts that received no token."""
    counts = counts_E.double()
    E = counts.shape[0]
    return {"entropy": load_entropy(counts_E) / math.log2(E) if E > 1 else 1.0,
            "max_over_mean": float(counts.max() / counts.mean().clamp(min=1e-12)),
            "dead": [int(e) for e in (counts_E == 0).nonzero().flatten()]}


@dataclass
class LayerRouting:
    """What one MoE layer saw and chose over the tokens of `collect`."""

    layer: int  # index of the block in the model
    inputs: Tensor  # [T, D] float32: the router's input (the layer's input after its norm)
    top1: Tensor  # [T] each token's first expert (the VQ code for a discrete VQ layer)
    counts: Tensor  # [E] tokens per expert, as the runtime accounts them (kept assignments)
    codes: Tensor | None  # [T] VQ codes, for VQ layers


@torch.no_grad()
def collect(model: Transformer, batches: Iterable[Tensor]) -> list[LayerRouting]:
    """Run `batches` ([B, S] token ids) through the model and gather, per MoE layer, its inputs and routing.
    The layers' inputs are read by a forward hook: the forward pass stays the runtime's own."""
    layers = model.moe_layers
    index = {id(m): i for i, m in enumerate(layers)}
    ids = [i for i, block in enumerate(model.layers) if getattr(block, "ffn", None) in layers]
    inputs: list[list[Tensor]] = [[] for _ in layers]
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs[index[id(mod)]].append(
        args[0].reshape(-1, args[0].shape[-1]).float())) for m in layers]
    top1: list[list[Tensor]] = [[] for _ in layers]
    codes: list[list[Tensor]] = [[] for _ in layers]
    counts = [torch.zeros(m.n_experts, dtype=torch.long) for m in layers]
    was_training = model.training
    model.eval()
    try:
        for x in batches:
            out = model(x)
            for i, aux in enumerate(out.aux):
                first = aux.routing.expert_ids[:, 0] if aux.routing is not None else aux.codes
                top1[i].append(first.reshape(-1).cpu())
                if aux.codes is not None:
                    codes[i].append(aux.codes.reshape(-1).cpu())
                if aux.counts is not None:
                    counts[i] += aux.counts.cpu()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return [LayerRouting(ids[i], torch.cat(inputs[i]) if inputs[i] else torch.empty(0), torch.cat(top1[i]),
                         counts[i], torch.cat(codes[i]) if codes[i] else None) for i in range(len(layers))]


def expert_weights(model: Transformer) -> list[Tensor]:
    """Per MoE layer, [E, P]: each expert's parameters (w1, w2, w3) flattened, in float32."""
    out = []
    for layer in model.moe_layers:
        ws = [w for w in (layer.experts.w1, layer.experts.w2, getattr(layer.experts, "w3", None)) if w is not None]
        out.append(torch.cat([w.detach().float().reshape(w.shape[0], -1) for w in ws], dim=1))
    return out


@torch.no_grad()
def expert_outputs(model: Transformer, layer_inputs: list[Tensor], max_tokens: int = 1024) -> list[Tensor]:
    """Per MoE layer, [E, T, D]: every expert's output on the same (first max_tokens) inputs of that layer."""
    out = []
    for layer, x in zip(model.moe_layers, layer_inputs):
        x = x[:max_tokens].to(layer.experts.w1.dtype)
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype)
        out.append(torch.stack([layer.experts(x, torch.full((x.shape[0], 1), e), ones).float()
                                for e in range(layer.n_experts)]))
    return out


# ---- moeserve diagnose: every measure for one or more checkpoints on the same tokens -------------------------
def data_batches(tokenizer, data: list[str] | None, tokens: int, seq_len: int, batch_size: int = 8) -> list[Tensor]:
    """[B, seq_len] windows spread over the data: the built-in corpus's validation split (text no model trained
    on), or every token of the user's files (`load_corpus` reads them: text, or JSONL with a `text` field)."""
    import numpy as np

    from moeserve.training.data import eval_batches, load_corpus

    corpus = load_corpus(data or None, tokenizer=tokenizer)
    stream = corpus.val if not data else np.concatenate([corpus.train, corpus.val])
    n_batches = max(1, math.ceil(tokens / (batch_size * seq_len)))
    return [x for x, _ in eval_batches(stream, batch_size, seq_len, n_batches)]


def _checkpoint_layers(model: Transformer, routing: list[LayerRouting], output_tokens: int) -> list[dict]:
    outputs = expert_outputs(model, [r.inputs for r in routing], output_tokens)
    rows = []
    for r, w, y in zip(routing, expert_weights(model), outputs):
        var, rel = output_variance(y)
        row = {"layer": r.layer, "rc": representation_collapse(r.inputs, r.top1), **load_stats(r.counts),
               "param_diff": parameter_difference(w), "output_var": var, "output_var_rel": rel}
        if r.codes is not None:
            used = torch.bincount(r.codes, minlength=r.counts.shape[0])
            row["vq_codes_used"] = float((used > 0).double().mean())
        rows.append(row)
    return rows


def diagnose(paths: list[str], data: list[str] | None = None, tokens: int = 16384, seq_len: int = 256,
             output_tokens: int = 1024, log=lambda msg: None) -> dict:
    """Every measure for each checkpoint on the same tokens, and between them: the RF ratio of each checkpoint
    against the one before it (checkpoints of one run, in training order), and the inter-run consistency of
    all of them (runs of one recipe with different seeds)."""
    from moeserve.runtime.loading import load_model
    from moeserve.tokenizer import load_checkpoint_tokenizer

    report: dict = {"tokens": 0, "data": data or "built-in corpus (validation split)", "checkpoints": []}
    batches, shape, loads, firsts = None, None, [], []
    for path in paths:
        model, ckpt = load_model(path)
        cfg = ckpt.config
        if not model.moe_layers:
            raise ValueError(f"{path}: has no MoE layer to diagnose")
        this = (cfg.vocab_size, cfg.tokenizer, [len(m.experts.w1) for m in model.moe_layers])
        if shape is not None and this != shape:
            raise ValueError(f"{path}: a different vocabulary or expert layout from {paths[0]}; checkpoints "
                             "diagnosed together must route the same tokens to the same experts")
        if batches is None:
            shape = this
            tokenizer = load_checkpoint_tokenizer(path, cfg)
            if tokenizer is None:
                raise ValueError(f"{path}: has no tokenizer (tokenizer 'none'); diagnose reads text")
            batches = data_batches(tokenizer, data, tokens, min(seq_len, cfg.max_seq_len))
            report["tokens"] = sum(x.numel() for x in batches)
            log(f"{report['tokens']} tokens")
        log(f"{path}: {cfg.router} router, {len(model.moe_layers)} MoE layers")
        routing = collect(model, batches)
        report["checkpoints"].append({"path": str(path), "router": cfg.router,
                                      "layers": _checkpoint_layers(model, routing, output_tokens)})
        loads.append([r.counts for r in routing])
        firsts.append([r.top1 for r in routing])
    report["fluctuation"] = [{"from": str(paths[i - 1]), "to": str(paths[i]),
                              "layers": [routing_fluctuation(a, b) for a, b in zip(firsts[i - 1], firsts[i])]}
                             for i in range(1, len(paths))]
    if len(paths) >= 2:
        report["consistency"] = [inter_run_consistency(torch.stack([run[i] for run in loads]))
                                 for i in range(len(loads[0]))]
    return report


def strict_json(obj):
    """`obj` with every nan (an undefined measure) as None, so the JSON is valid for any reader."""
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def table(report: dict) -> str:
    """The report as text for a terminal: one row per checkpoint and MoE layer, then the measures between them."""
    def f(v, spec=".3f"):
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    lines = [f"{report['tokens']} tokens of {report['data']}", "",
             f"{'checkpoint':<28} {'layer':>5} {'RC':>9} {'load H':>7} {'max/mean':>8} {'dead':>5} "
             f"{'param diff':>10} {'out var':>9} {'rel var':>8} {'VQ codes':>8}"]
    for c in report["checkpoints"]:
        name = c["path"] if len(c["path"]) <= 28 else "..." + c["path"][-25:]
        for r in c["layers"]:
            lines.append(f"{name:<28} {r['layer']:>5} {f(r['rc'], '.4g'):>9} {f(r['entropy']):>7} "
                         f"{f(r['max_over_mean'], '.2f'):>8} {len(r['dead']):>5} {f(r['param_diff']):>10} "
                         f"{f(r['output_var'], '.3g'):>9} {f(r['output_var_rel']):>8} "
                         f"{f(r.get('vq_codes_used'), '.2f') if 'vq_codes_used' in r else '-':>8}")
    for fl in report["fluctuation"]:
        lines.append(f"RF ratio {fl['from']} -> {fl['to']}: " + ", ".join(f(v) for v in fl["layers"]))
    if "consistency" in report:
        lines.append(f"inter-run consistency over {len(report['checkpoints'])} checkpoints: "
                     + ", ".join(f(v) for v in report["consistency"]))
    return "\n".join(lines)
