"""The Transformer (runtime/model.py) as an ONNX graph: input ids and attention mask in; logits (and
class probabilities for classifiers) and each MoE layer's expert choices out; batch and sequence axes
dynamic. Optionally with KV-cache inputs and outputs, for decoding.

Rows are right-padded (`attention_mask` 0 after each row's tokens, as Engine.score and classify
batch them); positions run 0..S-1 in every row. Padding is never attended to; unlike the torch model
the graph routes padding tokens too (every op but attention is per token, so real tokens' outputs are
unchanged), and the expert-choice outputs hold an entry for them that readers mask out.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import torch

from moeserve.config import MoEConfig
from moeserve.export import MODES
from moeserve.export.graph import FLOAT, INT64, Graph
from moeserve.export.moe_graph import LayerForm, feed_forward, linear, moe_layer, np32
from moeserve.runtime.model import Transformer
from moeserve.runtime.moe import MoELayer

FORMAT = "moeserve-onnx/2"  # 2: KV-cache graphs take position_ids


def norm(g: Graph, x: str, module: torch.nn.Module, hint: str) -> str:
    """RMSNorm or LayerNorm written as the patterns ONNX Runtime fuses back into one kernel."""
    eps = g.const(module.eps, np.float32)
    two = g.const(2.0, np.float32)
    if isinstance(module, torch.nn.RMSNorm):
        ms = g.op("ReduceMean", g.op("Pow", x, two), axes=[-1], keepdims=1)
        y = g.op("Div", x, g.op("Sqrt", g.op("Add", ms, eps)))
        return g.op("Mul", y, g.weight(np32(module.weight), f"{hint}.weight"))
    d = g.op("Sub", x, g.op("ReduceMean", x, axes=[-1], keepdims=1))
    var = g.op("ReduceMean", g.op("Pow", d, two), axes=[-1], keepdims=1)
    y = g.op("Div", d, g.op("Sqrt", g.op("Add", var, eps)))
    y = g.op("Mul", y, g.weight(np32(module.weight), f"{hint}.weight"))
    return g.op("Add", y, g.weight(np32(module.bias), f"{hint}.bias"))


def rope(g: Graph, x: str, cos: str, sin: str, head_dim: int) -> str:
    """Rotate-half RoPE (model.apply_rope): x cos + [-x2, x1] sin."""
    half = head_dim // 2
    axes = g.const([-1])
    x1 = g.op("Slice", x, g.const([0]), g.const([half]), axes)
    x2 = g.op("Slice", x, g.const([half]), g.const([head_dim]), axes)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def attention(g: Graph, x: str, block, cfg: MoEConfig, cos: str, sin: str, bias: str, hint: str,
              past: tuple[str, str] | None = None, nbits: bool = False) -> tuple[str, tuple[str, str] | None]:
    """Multi-head or grouped-query attention over [B, S, D]; bias [B, 1, S, L] (0 or -inf) holds the mask.
    Grouped queries are laid out [B, G, H/G, S, Dh] so one broadcasting MatMul meets their kv head.
    With `past` (keys and values [B, G, P, Dh] of earlier positions) the new ones are appended and
    returned as the present cache; L = P + S."""
    a = block.attention
    H, G, Dh = a.n_heads, a.n_kv_heads, a.head_dim

    def heads(w, n: int, name: str, qk_norm: torch.nn.Module | None = None) -> str:
        """[B, n, S, Dh] of one projection, QK-normed as Attention._project: over the whole projection ("all",
        OLMoE) before the split into heads, or over each head's Dh ("head", Qwen3) after it."""
        y = linear(g, x, w, f"{hint}.{name}", nbits)
        if qk_norm is not None and a.qk_norm == "all":
            y = norm(g, y, qk_norm, f"{hint}.{name[1]}_norm")
        y = g.reshape(y, [0, 0, n, Dh])
        if qk_norm is not None and a.qk_norm == "head":
            y = norm(g, y, qk_norm, f"{hint}.{name[1]}_norm")
        return g.op("Transpose", y, perm=[0, 2, 1, 3])

    q = rope(g, heads(a.wq, H, "wq", getattr(a, "q_norm", None)), cos, sin, Dh)
    k = rope(g, heads(a.wk, G, "wk", getattr(a, "k_norm", None)), cos, sin, Dh)
    v = heads(a.wv, G, "wv")
    present = None
    if past is not None:
        k, v = g.op("Concat", past[0], k, axis=2), g.op("Concat", past[1], v, axis=2)
        present = (k, v)
    if G != H:
        q = g.reshape(q, [0, G, H // G, -1, Dh])
        k, v = g.unsqueeze(k, [2]), g.unsqueeze(v, [2])
        bias = g.unsqueeze(bias, [1])
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 2, 4, 3] if G != H else [0, 1, 3, 2])),
                  g.const(Dh ** -0.5, np.float32))
    o = g.op("MatMul", g.op("Softmax", g.op("Add", scores, bias), axis=-1), v)
    if G != H:
        o = g.reshape(o, [0, H, -1, Dh])
    o = g.reshape(g.op("Transpose", o, perm=[0, 2, 1, 3]), [0, 0, H * Dh])
    return linear(g, o, a.wo, f"{hint}.wo", nbits), present


def mask_bias(g: Graph, cfg: MoEConfig, q_pos: str, k_pos: str, attention_mask: str, window: int | None,
              self_keys: str) -> str:
    """[B, 1, S, L]: 0 where query i may see key j, -inf elsewhere (model._mask), from each row's positions,
    q_pos [B, S] and k_pos [B, L] (or [1, ...] for all rows): causal (and within the sliding `window`,
    i - window < j) for language models, padding keys never. self_keys [S, L] is true at each query's own key,
    which it always sees, so no row is all -inf (a padding query's either)."""
    i, j = g.unsqueeze(q_pos, [1, 3]), g.unsqueeze(k_pos, [1, 2])  # [B, 1, S, 1], [B, 1, 1, L]
    allowed = g.unsqueeze(g.op("Cast", attention_mask, to=onnx.TensorProto.BOOL), [1, 2])  # [B, 1, 1, L]
    if cfg.causal:
        causal = g.op("LessOrEqual", j, i)
        if window is not None:
            causal = g.op("And", causal, g.op("Greater", j, g.op("Sub", i, g.const(window))))
        allowed = g.op("And", allowed, causal)
    allowed = g.op("Or", allowed, self_keys)
    return g.op("Where", allowed, g.const(0.0, np.float32), g.const(-np.inf, np.float32))


def build_graph(model: Transformer, mode: str, metadata: dict[str, str] | None = None, kv_cache: bool = False
                ) -> tuple[onnx.ModelProto, list[LayerForm]]:
    """The model's forward graph in `mode` (moe_graph.py), and how each MoE layer was written.
    Call on a model laid out by EagerBackend(model, DispatchPlan()), which builds the VQ tables on plain weights.

    kv_cache: the graph also takes `past_key.N` / `past_value.N` [B, G, P, Dh] (P = 0 for a prompt) and
    `position_ids` [B, S], and returns `present_key.N` / `present_value.N` [B, G, P + S, Dh], the new keys and
    values appended to the past; `attention_mask` [B, P + S] covers past and new, and its zeros may fall
    anywhere (rows of unequal lengths in one call: a decode step of every sequence at once)."""
    if mode not in MODES:
        raise ValueError(f"unknown export mode {mode!r}; expected one of: {', '.join(MODES)}")
    cfg = model.cfg
    nbits = mode != "portable"  # ONNX Runtime's graphs: quantized linear maps as its MatMulNBits
    if kv_cache and cfg.task != "lm":
        raise ValueError(f"a KV-cache graph decodes a language model; this model's task is {cfg.task!r}")
    g = Graph("moeserve")
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    attention_mask = g.input("attention_mask", INT64, ["batch", "total" if kv_cache else "seq"])
    pasts: list[tuple[str, str] | None] = [None] * cfg.n_layers
    cache_shape = ["batch", cfg.kv_heads, "past", cfg.head_dim]
    if kv_cache:
        position_ids = g.input("position_ids", INT64, ["batch", "seq"])
        pasts = [(g.input(f"past_key.{b}", FLOAT, cache_shape), g.input(f"past_value.{b}", FLOAT, cache_shape))
                 for b in range(cfg.n_layers)]

    x = g.op("Gather", g.weight(np32(model.tok_embeddings.weight), "tok_embeddings.weight"), ids, axis=0)
    seq = g.op("Gather", g.op("Shape", ids), g.const(1), axis=0)
    if kv_cache:
        # Each row's own positions, so that rows of any lengths share a call: the queries' from `position_ids`,
        # the keys' counted along the mask (a key's position is the number of real keys before it), so a row's
        # cache may hold padding anywhere, a shorter row's padding in the middle included.
        past_len = g.op("Gather", g.op("Shape", pasts[0][0]), g.const(2), axis=0)
        total = g.op("Add", past_len, seq)
        q_pos = position_ids
        k_pos = g.op("Sub", g.op("CumSum", attention_mask, g.const(1)), g.const(1))
        q_index = g.op("Range", past_len, total, g.const(1))
        k_index = g.op("Range", g.const(0), total, g.const(1))
    else:
        q_index = k_index = g.op("Range", g.const(0), seq, g.const(1), hint="positions")
        q_pos = k_pos = g.unsqueeze(q_index, [0])  # [1, S]: 0..S-1 in every row
    self_keys = g.op("Equal", g.unsqueeze(q_index, [1]), g.unsqueeze(k_index, [0]))  # [S, L]
    # [B, 1, S, Dh] (or [1, 1, S, Dh]): one row of each table per query, broadcast over the heads
    cos = g.unsqueeze(g.op("Gather", g.weight(np32(model.rope_cos), "rope_cos"), q_pos, axis=0), [1])
    sin = g.unsqueeze(g.op("Gather", g.weight(np32(model.rope_sin), "rope_sin"), q_pos, axis=0), [1])
    # one mask per distinct sliding window (gpt-oss alternates windowed and full layers), as Transformer.windows
    biases = {w: mask_bias(g, cfg, q_pos, k_pos, attention_mask, w, self_keys) for w in model.windows}
    ids_shape = g.op("Shape", ids)

    forms, expert_outputs, presents = [], [], []
    for b, block in enumerate(model.layers):
        hint = f"layers.{b}"
        h, present = attention(g, norm(g, x, block.attention_norm, f"{hint}.attention_norm"), block, cfg,
                               cos, sin, biases[block.attention.window], f"{hint}.attention", pasts[b], nbits)
        presents.append(present)
        x = g.op("Add", x, h)
        h = norm(g, x, block.ffn_norm, f"{hint}.ffn_norm")
        if isinstance(block.ffn, MoELayer):
            y_TD, experts_TK, form = moe_layer(g, g.reshape(h, [-1, cfg.d_model]), block.ffn, mode, b)
            y = g.op("Reshape", y_TD, g.op("Shape", h))
            k = cfg.experts_per_token
            expert_outputs.append(g.op("Reshape", experts_TK, g.op("Concat", ids_shape, g.const([k]), axis=0)))
            forms.append(form)
        else:
            y = feed_forward(g, h, block.ffn, f"{hint}.ffn")  # its own width (dense_d_ff) from its weights
        x = g.op("Add", x, y)
    x = norm(g, x, model.norm, "norm")

    if cfg.task == "classify":
        m = g.unsqueeze(g.op("Cast", attention_mask, to=FLOAT), [-1])
        total = g.op("ReduceSum", g.op("Mul", x, m), g.const([1]), keepdims=0)
        count = g.op("Max", g.op("ReduceSum", m, g.const([1]), keepdims=0), g.const(1.0, np.float32))
        logits = g.op("Add", g.linear(g.op("Div", total, count), np32(model.classifier.weight), "classifier.weight"),
                      g.weight(np32(model.classifier.bias), "classifier.bias"))
        g.output(logits, "logits", FLOAT, ["batch", cfg.n_classes])
        g.output(g.op("Softmax", logits, axis=-1), "probs", FLOAT, ["batch", cfg.n_classes])
    else:
        g.output(linear(g, x, model.output, "output.weight", nbits), "logits", FLOAT, ["batch", "seq", cfg.vocab_size])
    for n, (value, form) in enumerate(zip(expert_outputs, forms)):
        g.output(value, expert_output_name(n), INT64, ["batch", "seq", cfg.experts_per_token])
    if kv_cache:
        for b, (k, v) in enumerate(presents):
            g.output(k, f"present_key.{b}", FLOAT, ["batch", cfg.kv_heads, "total", cfg.head_dim])
            g.output(v, f"present_value.{b}", FLOAT, ["batch", cfg.kv_heads, "total", cfg.head_dim])

    meta = {"moeserve.format": FORMAT, "moeserve.mode": mode, "moeserve.config": cfg.to_json(),
            "moeserve.kv_cache": str(kv_cache).lower(),
            "moeserve.layers": json.dumps([f.__dict__ for f in forms])}
    return g.model({**meta, **(metadata or {})}), forms


def expert_output_name(moe_index: int) -> str:
    """Graph output holding MoE layer `moe_index`'s (0-based among MoE layers) expert ids [B, S, K]."""
    return f"expert_ids.{moe_index}"
