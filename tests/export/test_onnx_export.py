"""ONNX export (export/onnx_graph.py, moe_graph.py, onnx_export.py) run through real onnxruntime on CPU.

Parity: every router kind, in every mode that supports it, against Engine (the torch model) on batch
1 and right-padded batch 4 at lengths 1 to max_seq_len: logits within 1e-4 at real positions, the
per-layer expert choices equal token for token. The models' weights are re-initialised large enough
that the experts, the routing and every norm weight show in the logits (a test asserts it), and a
mutation check shows one perturbed expert weight breaks parity.

Forms: the fused graph reaches ONNX Runtime's com.microsoft MoE operator, the portable one stays in
the default domain (and in TensorRT's ONNX parser's list), fallbacks are reported; vq-table holds no
expert matrices. End to end: export_onnx writes the model and its report (its refusals are in
test_export_errors.py; quantized checkpoints are test_onnx_quantized.py's).
"""

from __future__ import annotations

import copy
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from moeserve.checkpoint import save_checkpoint  # noqa: E402
from moeserve.config import preset  # noqa: E402
from moeserve.export.onnx_export import export_onnx  # noqa: E402
from moeserve.export.onnx_graph import build_graph  # noqa: E402
from moeserve.runtime.backends.plan import DispatchPlan  # noqa: E402
from moeserve.runtime.engine import Engine  # noqa: E402
from moeserve.runtime.model import Transformer  # noqa: E402
from moeserve.runtime.backends.eager import EagerBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4  # fp32 parity, as the exporter's own check (parity.TOLERANCE["float32"])
TRT_OPS = Path(__file__).resolve().parents[2] / "moeserve" / "export" / "tensorrt_onnx_ops.json"

# One tiny model per config. The first nine are the router kinds the exporter has forms for; the next
# four reach the trunk's other branches (cosine VQ with a projection, erf-gelu experts, grouped-query
# attention + sliding window + a dense FFN layer + untied head, a bidirectional LayerNorm classifier); the
# last four the Hugging Face families' additions (MoEConfig.extensions) the graph writes: Qwen3-MoE's
# per-head QK-norm, head width of its own and renormalised gates; OLMoE's QK-norm over whole projections;
# Qwen2-MoE's q/k/v biases, gated shared expert and a dense layer wider than the experts; gpt-oss's
# sliding window per layer and biased output map; and a gated shared expert beside a VQ table.
CONFIGS: dict[str, dict] = {
    "softmax": dict(router="softmax"),
    "softmax-renorm": dict(router="softmax", renormalize=True),
    "sigmoid-k2": dict(router="sigmoid", top_k=2),
    "sigmoid-k1": dict(router="sigmoid", top_k=1),
    "xmoe": dict(router="xmoe"),
    "xmoe-sigmoid": dict(router="xmoe", xmoe_gate="sigmoid"),
    "vq-mixed": dict(router="vq", vq_mode="mixed"),
    "vq-code": dict(router="vq", vq_mode="discrete", vq_input="code"),
    "vq-blend": dict(router="vq", vq_mode="discrete", vq_input="blend"),
    "vq-code-cosine-proj": dict(router="vq", vq_mode="discrete", vq_input="code", vq_distance="cosine", vq_dim=16),
    "gelu": dict(router="softmax", expert_act="gelu"),
    "gqa-window-dense": dict(router="softmax", n_kv_heads=2, sliding_window=8, moe_layers=[1], tie_embeddings=False),
    "classify": dict(router="xmoe", task="classify", n_classes=3, causal=False, norm="layernorm"),
    "qwen3-like": dict(router="softmax", renormalize=True, qk_norm="head", d_head=24, n_kv_heads=2),
    "olmoe-like": dict(router="softmax", qk_norm="all", n_kv_heads=2),
    "qwen2-like": dict(router="softmax", qkv_bias=True, shared_d_ff=64, shared_gate=True, moe_layers=[1],
                       dense_d_ff=96, n_kv_heads=2),
    "windows": dict(router="softmax", layer_windows=[8, None], qkv_bias=True, o_bias=True),
    "vq-code-shared": dict(router="vq", vq_mode="discrete", vq_input="code", shared_d_ff=64, shared_gate=True),
    # gpt-oss's YaRN: only the RoPE tables change, and the graph takes them from the model
    "yarn": dict(router="softmax", rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "original_max_position_embeddings": 16, "truncate": False}),
}
FAMILY_CONFIGS = ["qwen3-like", "olmoe-like", "qwen2-like", "windows", "yarn"]


def modes_of(name: str) -> list[str]:
    return ["portable", "fused"] + (["vq-table"] if CONFIGS[name]["router"] == "vq" else [])


MATRIX = [(name, mode) for name in CONFIGS for mode in modes_of(name)]


# ---- models whose weights matter -------------------------------------------------------------------
@torch.no_grad()
def make_weights_matter(model: Transformer, std: float = 0.1, seed: int = 0) -> Transformer:
    """Transformer.reset_parameters gives N(0, 0.02) weights and residual projections scaled down further:
    the MoE layers' outputs are then so small that a wrong expert or gate would hide under a 1e-4
    tolerance. Here every matrix is N(0, std) (0.1: logits of std ~0.8, every expert's output visible in
    them), norm weights and biases are moved off 1 / 0 so an export that dropped them would show, each
    VQ codebook is set to real encoder outputs of its layer (layer by layer, as each layer's inputs
    depend on the codes before it) so that the codes are all in use, and a code projection `up` is
    scaled so that x~ = up(v_k) has unit RMS, as the layer's normalised input has.

    X-MoE keeps its constraint, and its tau is moved off the config's initial value (so an export that
    read the config instead of the parameter would show) upwards: its tiny model routes on a 2-d
    hypersphere (d_e = E/2 = 2), where a token whose projection W h is short has an ill-conditioned
    angle, and at std 0.2 or tau below the paper's value the fp32 torch model itself is ~1e-4 away from
    an fp64 run. As set here: torch fp32 vs fp64 <= 4e-5 (X-MoE) and ~3e-6 (the rest); graph vs torch
    <= 2.4e-5 (X-MoE sigmoid) and ~3e-6 (the rest)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "expert_embeddings" in name or "codebook" in name or p.dim() == 0:
            continue
        noise = torch.randn(p.shape, generator=gen) * std
        p.copy_(noise if p.dim() >= 2 or name.endswith("bias") else 1.0 + noise)
    model.constrain_()
    for layer in model.moe_layers:
        if getattr(layer.router, "tau", None) is not None:
            layer.router.tau.mul_(1.25)
    ids = torch.randint(0, model.cfg.vocab_size, (4, 32), generator=gen)
    for layer in model.moe_layers:
        if layer.quantizer is None:
            continue
        seen = []
        hook = layer.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
        model.eval()(ids)
        hook.remove()
        z = layer.quantizer.encode(seen[0].reshape(-1, seen[0].shape[-1]))
        pick = torch.randperm(z.shape[0], generator=gen)[: layer.n_experts]
        q = layer.quantizer
        q.codebook.copy_(z[pick])
        q.initialized.fill_(True)
        if q.up is not None:  # x~ = up(v_k): as large as the layer's (normalised) input, not std times that
            q.up.weight.div_(q.up(q.vectors()).pow(2).mean().sqrt())
    return model.eval()


def make_model(name: str) -> Transformer:
    torch.manual_seed(0)
    return make_weights_matter(Transformer(preset("tiny", **CONFIGS[name])))


def engine_of(model: Transformer) -> Engine:
    """The torch reference, on a copy: the engine lays the model out (packs its weights) in place."""
    return Engine.from_model(copy.deepcopy(model), dtype="float32")


def session_of(proto) -> "ort.InferenceSession":
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # tiny graphs; two threads on a busy 2-core machine only spin-wait
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


# ---- held-out inputs and the torch model's answers on them -------------------------------------------
def shapes(max_seq_len: int) -> list[tuple[int, int]]:
    lengths = [n for n in (1, 7, 33, max_seq_len) if n <= max_seq_len]
    return [(1, n) for n in lengths] + [(4, n) for n in lengths if n > 1]


def case_inputs(batch: int, seq: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids everywhere (padding too: it must not matter); batch-4 rows keep seq, seq-2, seq/2, 1 tokens."""
    gen = np.random.default_rng(seed)
    ids = gen.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for b, n in enumerate([seq] if batch == 1 else [seq, seq - 2, seq // 2, 1]):
        mask[b, :n] = 1
    return ids, mask


@dataclass
class Case:
    ids: np.ndarray  # [B, S]
    mask: np.ndarray  # [B, S], right padding
    logits: np.ndarray  # Engine.forward: [B, S, V] or [B, C]
    experts: list[np.ndarray]  # per MoE layer: [real tokens, K] expert ids (codes [T, 1] for discrete VQ)

    @property
    def real(self) -> np.ndarray:
        return self.mask.astype(bool)

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.ids, "attention_mask": self.mask}


def torch_cases(engine: Engine) -> list[Case]:
    cases = []
    for i, (batch, seq) in enumerate(shapes(engine.cfg.max_seq_len)):
        ids, mask = case_inputs(batch, seq, engine.cfg.vocab_size, seed=1000 + i)
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        logits = engine.forward(t_ids, t_mask).numpy()
        with torch.inference_mode():
            out = engine.executor.run(t_ids, attention_mask=t_mask)
        experts = [(a.routing.expert_ids if a.routing is not None else a.codes[:, None]).numpy() for a in out.aux]
        cases.append(Case(ids, mask, logits, experts))
    return cases


def logits_diff(got: np.ndarray, case: Case, classify: bool) -> float:
    if classify:
        return float(np.abs(got.astype(np.float64) - case.logits).max())
    return float(np.abs(got[case.real].astype(np.float64) - case.logits[case.real]).max())


def run(session, case: Case) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, case.feeds)))


def max_diff(session, engine: Engine, cases: list[Case]) -> float:
    """Graph vs `engine` logits over `cases` (the engine is run afresh: it may differ from the cases')."""
    classify = engine.cfg.task == "classify"
    worst = 0.0
    for case in cases:
        ref = engine.forward(torch.from_numpy(case.ids), torch.from_numpy(case.mask)).numpy()
        worst = max(worst, logits_diff(run(session, case)["logits"], Case(case.ids, case.mask, ref, []), classify))
    return worst


class Zoo:
    """Models, graphs, sessions and torch answers, each made once per module and shared by the tests."""

    def __init__(self):
        self._models, self._engines, self._graphs, self._sessions, self._cases = {}, {}, {}, {}, {}

    def model(self, name: str) -> Transformer:
        if name not in self._models:
            model = make_model(name)
            EagerBackend(model, DispatchPlan())  # builds the VQ tables build_graph reads
            self._models[name] = model
        return self._models[name]

    def engine(self, name: str) -> Engine:
        if name not in self._engines:
            self._engines[name] = engine_of(self.model(name))
        return self._engines[name]

    def graph(self, name: str, mode: str):
        if (name, mode) not in self._graphs:
            with torch.no_grad():
                self._graphs[name, mode] = build_graph(self.model(name), mode)
        return self._graphs[name, mode]

    def session(self, name: str, mode: str):
        if (name, mode) not in self._sessions:
            self._sessions[name, mode] = session_of(self.graph(name, mode)[0])
        return self._sessions[name, mode]

    def cases(self, name: str) -> list[Case]:
        if name not in self._cases:
            self._cases[name] = torch_cases(self.engine(name))
        return self._cases[name]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


def n_moe(cfg) -> int:
    return len(cfg.moe_layer_ids)


def ms_moe_nodes(proto) -> int:
    return sum(1 for n in proto.graph.node if n.op_type == "MoE" and n.domain == "com.microsoft")


# ---- 1. parity -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_matter(zoo, name):
    """What makes the parity matrix mean something: logits well above the tolerance, at least 3 experts
    chosen as top-1 in every MoE layer, and the experts' output visible in the logits."""
    cfg, cases = zoo.model(name).cfg, zoo.cases(name)
    real_logits = np.concatenate([c.logits.reshape(-1) if cfg.task == "classify" else c.logits[c.real].reshape(-1)
                                  for c in cases])
    assert real_logits.std() > 0.1 and np.abs(real_logits).max() > 0.5, real_logits.std()
    for n in range(n_moe(cfg)):
        top1 = np.concatenate([c.experts[n][:, 0] for c in cases])
        assert len(np.unique(top1)) >= 3, (n, np.bincount(top1))
    silent = copy.deepcopy(zoo.model(name))
    with torch.no_grad():
        for layer in silent.moe_layers:
            layer.experts.w2.zero_()
    case = cases[-2]  # batch 4, padded
    ref = engine_of(silent).forward(torch.from_numpy(case.ids), torch.from_numpy(case.mask)).numpy()
    assert logits_diff(ref, case, cfg.task == "classify") > 0.1


@pytest.mark.parametrize(("name", "mode"), MATRIX)
def test_parity_with_torch(zoo, name, mode):
    cfg = zoo.model(name).cfg
    session = zoo.session(name, mode)
    classify = cfg.task == "classify"
    k = cfg.experts_per_token
    expected_outputs = ["logits"] + (["probs"] if classify else []) + [f"expert_ids.{n}" for n in range(n_moe(cfg))]
    assert [o.name for o in session.get_outputs()] == expected_outputs
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]

    worst = 0.0
    for case in zoo.cases(name):
        B, S = case.ids.shape
        got = run(session, case)
        if classify:
            assert got["logits"].shape == (B, cfg.n_classes)
            probs = torch.from_numpy(case.logits).softmax(-1).numpy()
            np.testing.assert_allclose(got["probs"], probs, rtol=0, atol=TOL)
        else:
            assert got["logits"].shape == (B, S, cfg.vocab_size)
        worst = max(worst, logits_diff(got["logits"], case, classify))
        for n in range(n_moe(cfg)):
            ids = got[f"expert_ids.{n}"]
            assert ids.shape == (B, S, k)
            graph_TK, torch_TK = ids[case.real], case.experts[n]
            top1_agree = (graph_TK[:, 0] == torch_TK[:, 0]).mean()
            assert top1_agree == 1.0, f"layer {n}, shape {B}x{S}: top-1 agreement {top1_agree:.4f}"
            np.testing.assert_array_equal(graph_TK, torch_TK, err_msg=f"layer {n}, shape {B}x{S}: top-k ids")
    assert worst <= TOL, f"{name} {mode}: max |logits diff| {worst:.3g} > {TOL}"


# vq-code-shared: its shared expert's output, beside one table row per code, scales the residual stream up, and the
# final RMSNorm shrinks this 1e-2 change to ~7e-4 in the logits (still 7x the tolerance); vq-code checks that layer
# form, and the no-op shared expert of test_each_family_addition_shows_in_the_logits the shared part
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "vq-code-shared"])
def test_parity_fails_after_perturbing_one_expert_weight(zoo, name):
    """The parity check can fail: one row of the down projection of the most used expert of the last MoE
    layer (output dim 0; a change along all dims alike would vanish in a LayerNorm), +1e-2 on each of its
    elements in the torch model after export, puts the graph well past tolerance."""
    model, cases = zoo.model(name), zoo.cases(name)
    session = zoo.session(name, "portable")
    some = [cases[-1], cases[-2]]  # batch 4 at max_seq_len and at 33
    assert max_diff(session, zoo.engine(name), some) <= TOL
    last = len(model.moe_layers) - 1
    expert = int(np.bincount(np.concatenate([c.experts[last][:, 0] for c in some])).argmax())
    mutated = copy.deepcopy(model)
    with torch.no_grad():
        mutated.moe_layers[last].experts.w2[expert, 0] += 1e-2
    assert max_diff(session, engine_of(mutated), some) > 10 * TOL


# ---- 2. forms ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "per_layer", "form"), [
    ("softmax", 1, "fused"), ("softmax-renorm", 1, "fused"), ("sigmoid-k1", 1, "fused"), ("xmoe", 1, "fused"),
    ("vq-mixed", 2, "fused+fused"), ("vq-code", 1, "fused"), ("vq-blend", 1, "fused"),
    *[(name, 1, "fused") for name in FAMILY_CONFIGS],
])
def test_fused_graph_uses_the_onnxruntime_moe_operator(zoo, name, per_layer, form):
    proto, forms = zoo.graph(name, "fused")
    cfg = zoo.model(name).cfg
    assert ms_moe_nodes(proto) == per_layer * n_moe(cfg)
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 17), ("com.microsoft", 1)}
    assert [(f.layer, f.form, f.fallback) for f in forms] == [(i, form, None) for i in cfg.moe_layer_ids]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_portable_graph_is_default_domain_only(zoo, name):
    proto, forms = zoo.graph(name, "portable")
    assert [(n.op_type, n.domain) for n in proto.graph.node if n.domain not in ("", "ai.onnx")] == []
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 17)]
    assert proto.ir_version == 8
    expected = "portable+portable" if zoo.model(name).moe_layers[0].mix is not None else "portable"
    assert {(f.form, f.fallback) for f in forms} == {(expected, None)}
    onnx.checker.check_model(proto, full_check=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_portable_graph_ops_are_in_tensorrt_parser_list(zoo, name):
    if not TRT_OPS.is_file():
        pytest.skip(f"{TRT_OPS} (TensorRT's ONNX parser's operator list) is absent from this checkout")
    supported = set(json.loads(TRT_OPS.read_text())["supported"])
    used = {n.op_type for n in zoo.graph(name, "portable")[0].graph.node}
    assert used - supported == set()


@pytest.mark.parametrize(("name", "reason"), [("sigmoid-k2", "sigmoid"), ("xmoe-sigmoid", "sigmoid"),
                                              ("gelu", "gelu")])
def test_fused_mode_falls_back_to_portable_with_a_reason(zoo, name, reason):
    proto, forms = zoo.graph(name, "fused")
    assert ms_moe_nodes(proto) == 0
    assert [f.layer for f in forms] == zoo.model(name).cfg.moe_layer_ids
    for f in forms:
        assert f.form == "portable"
        assert f.fallback and reason in f.fallback.lower(), f.fallback


# ---- 2b. the Hugging Face families' additions -------------------------------------------------------------
def without(model: Transformer, name: str) -> Transformer:
    """A copy of `model` with one family addition turned into a no-op (zero bias, unit norm, silent shared expert,
    no window), for the check that parity would notice a graph that dropped it."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for block in m.layers:
            a = block.attention
            if name == "bias":
                for lin in (a.wq, a.wk, a.wv, a.wo):
                    if lin.bias is not None:
                        lin.bias.zero_()
            elif name == "qk_norm":
                a.q_norm.weight.fill_(1.0), a.k_norm.weight.fill_(1.0)
            elif name == "window":
                a.window = None
        for layer in m.moe_layers:
            if name == "shared":
                layer.shared.w2.weight.zero_()
            elif name == "shared_gate":
                layer.shared_gate.weight.zero_()  # sigmoid(0) = 1/2 for every token
    return m


@pytest.mark.parametrize(("name", "addition"), [
    ("qwen3-like", "qk_norm"), ("olmoe-like", "qk_norm"), ("qwen2-like", "bias"), ("qwen2-like", "shared"),
    ("qwen2-like", "shared_gate"), ("windows", "bias"), ("windows", "window"), ("vq-code-shared", "shared"),
])
def test_each_family_addition_shows_in_the_logits(zoo, name, addition):
    """The parity of the family configs means something: each addition, made a no-op in the torch model, moves its
    logits far past the tolerance (a graph that left it out would fail parity); a window of 8 needs the 33- and
    64-token cases."""
    cases = zoo.cases(name)[-2:]
    assert max_diff(zoo.session(name, "portable"), engine_of(without(zoo.model(name), addition)), cases) > 100 * TOL


def initializer_shapes(proto) -> dict[str, list[int]]:
    return {t.name: list(t.dims) for t in proto.graph.initializer}


def test_family_additions_are_written_where_the_model_has_them(zoo):
    """What each addition puts in the graph: biases and norm weights as initializers of their width (d_head 24: q is
    4 x 24 = 96 wide), the dense layer at its own width (dense_d_ff 96, the experts' 128), the shared expert and its
    [1, D] gate; one mask per distinct window."""
    q3 = initializer_shapes(zoo.graph("qwen3-like", "fused")[0])
    assert q3["layers.0.attention.wq"] == [64, 96] and q3["layers.0.attention.wk"] == [64, 48]
    assert q3["layers.0.attention.q_norm.weight"] == [24] and q3["layers.1.attention.k_norm.weight"] == [24]
    ol = initializer_shapes(zoo.graph("olmoe-like", "fused")[0])
    assert ol["layers.0.attention.q_norm.weight"] == [64] and ol["layers.0.attention.k_norm.weight"] == [32]
    q2 = initializer_shapes(zoo.graph("qwen2-like", "fused")[0])
    assert [q2[f"layers.0.attention.{n}.bias"] for n in ("wq", "wk", "wv")] == [[64], [32], [32]]
    assert "layers.0.attention.wo.bias" not in q2
    assert q2["layers.0.ffn.w13"] == [64, 2 * 96] and q2["layers.0.ffn.w2"] == [96, 64]
    assert q2["layers.1.moe.shared.w13"] == [64, 2 * 64] and q2["layers.1.moe.shared_gate"] == [64, 1]
    for mode in ("portable", "fused"):
        assert "layers.1.moe.shared.w2" in initializer_shapes(zoo.graph("qwen2-like", mode)[0])
    windows = zoo.graph("windows", "portable")[0]
    assert initializer_shapes(windows)["layers.1.attention.wo.bias"] == [64]
    assert sum(n.op_type == "Where" for n in windows.graph.node) == 2  # window 8 (layer 0) and none (layer 1)
    assert sum(n.op_type == "Where" for n in zoo.graph("softmax", "portable")[0].graph.node) == 1


@pytest.mark.parametrize("mode", ["portable", "fused"])
@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_family_kv_cache_graph_decodes_with_parity(zoo, name, mode):
    """The KV-cache graph of each family config through the exporter's own parity check (export/parity.py): every
    held-out shape from an empty cache, and its last token as a decode step on the cache of the others (a window of
    8 cuts into the 64-token case's cache)."""
    from moeserve.export.parity import check

    with torch.no_grad():
        proto, _ = build_graph(zoo.model(name), mode, kv_cache=True)
    parity = check(session_of(proto), zoo.engine(name))
    assert set(parity.outputs) == {"logits", "logits, cached step"}
    worst = {k: d.max_abs for k, d in parity.outputs.items()}
    assert max(worst.values()) <= TOL, worst
    assert parity.top1_agreement() == [1.0] * n_moe(zoo.model(name).cfg)


# ---- 3. vq-table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vq-code", "vq-code-cosine-proj", "vq-code-shared"])
def test_vq_table_holds_no_expert_matrices(zoo, name):
    model = zoo.model(name)
    cfg = model.cfg
    proto, forms = zoo.graph(name, "vq-table")
    assert [(f.layer, f.form, f.fallback) for f in forms] == [(i, "table", None) for i in cfg.moe_layer_ids]
    assert ms_moe_nodes(proto) == 0
    inits = {t.name: t for t in proto.graph.initializer}
    expert_size = cfg.n_experts * cfg.d_ff * cfg.d_model
    bulky = [(t.name, list(t.dims)) for t in inits.values() if len(t.dims) >= 3 or int(np.prod(t.dims)) == expert_size]
    assert bulky == []
    for block, layer in zip(cfg.moe_layer_ids, model.moe_layers):
        table = inits.get(f"layers.{block}.moe.discrete.table")
        assert table is not None, sorted(inits)
        assert list(table.dims) == [cfg.n_experts, cfg.d_model]
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(table), layer.table.numpy())
    # The portable graph of the same model does hold the experts: the check above can tell them apart.
    portable = zoo.graph(name, "portable")[0]
    assert any(int(np.prod(t.dims)) >= expert_size for t in portable.graph.initializer)

    table_s, portable_s = zoo.session(name, "vq-table"), zoo.session(name, "portable")
    for case in zoo.cases(name):
        a, b = run(table_s, case), run(portable_s, case)
        np.testing.assert_allclose(a["logits"][case.real], b["logits"][case.real], rtol=0, atol=1e-5)
        for n in range(n_moe(cfg)):
            np.testing.assert_array_equal(a[f"expert_ids.{n}"], b[f"expert_ids.{n}"])
        assert logits_diff(a["logits"], case, False) <= TOL


def test_vq_table_keeps_experts_where_the_input_is_blended(zoo):
    proto, forms = zoo.graph("vq-blend", "vq-table")
    cfg = zoo.model("vq-blend").cfg
    assert [(f.form, f.fallback) for f in forms] == [("fused", None)] * n_moe(cfg)
    assert ms_moe_nodes(proto) == n_moe(cfg)
    assert not any(t.name.endswith(".table") for t in proto.graph.initializer)
    mixed = zoo.graph("vq-mixed", "vq-table")[1]
    assert [f.form for f in mixed] == ["fused+table"] * n_moe(zoo.model("vq-mixed").cfg)


# ---- 4. export_onnx end to end -------------------------------------------------------------------------
def write_checkpoint(directory: Path, model: Transformer) -> Path:
    return save_checkpoint(directory, model.cfg, model.state_dict())


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize(("name", "mode", "form"), [
    ("xmoe", "portable", "portable"), ("xmoe", "fused", "fused"), ("vq-code", "vq-table", "table"),
    ("classify", "fused", "fused"),
])
def test_export_onnx_writes_model_and_report(zoo, tmp_path, name, mode, form):
    ckpt = write_checkpoint(tmp_path / "ckpt", zoo.model(name))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.onnx"
    report = export_onnx(ckpt, out, mode)

    assert listing(out_dir) == ["model.onnx", "model.onnx.report.json"]
    data = json.loads((out_dir / "model.onnx.report.json").read_text())
    assert data["passed"] is True and report.passed
    assert data["mode"] == mode and data["output"] == str(out)
    cfg = zoo.model(name).cfg
    assert sorted(data["outputs"]) == (["logits", "probs"] if cfg.task == "classify" else ["logits"])
    assert all(0 <= d["max_abs_diff"] <= TOL for d in data["outputs"].values())
    assert data["outputs"]["logits"]["mean_abs_diff"] <= data["outputs"]["logits"]["max_abs_diff"]
    assert [(d["layer"], d["form"], d["fallback"], d["top1_agreement"]) for d in data["layers"]] == \
        [(i, form, None, 1.0) for i in cfg.moe_layer_ids]
    assert data["fallbacks"] == []
    assert data["onnxruntime_version"] == ort.__version__ and data["onnx_version"] == onnx.__version__
    assert data["opset"] == 17
    assert data["tokens"] > 0 and data["file_bytes"] == out.stat().st_size
    assert data["outputs"] == report.outputs and data["layers"] == report.layers

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600

    written = onnx.load(str(out))
    meta = {p.key: p.value for p in written.metadata_props}
    assert json.loads(meta["moeserve.config"]) == json.loads((ckpt / "config.json").read_text())
    assert meta["moeserve.mode"] == mode
    # The file on disk is the model whose parity was checked: run it against the torch model here too.
    assert max_diff(session_of(written), zoo.engine(name), zoo.cases(name)[-2:]) <= TOL
