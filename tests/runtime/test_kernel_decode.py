"""The router and the whole decode step on the C kernel (kernel_decode.py): the router against routing.py's
torch routers (softmax, renormalized softmax, sigmoid, X-MoE's two gates; float32 and bfloat16) to the last bits
of exp; a decode step in one call bit for bit the layers' calls one by one (logits, cache, routes and expert
counts) for every router it takes, tied and untied heads, gelu experts and a sliding window, alone and in a batch
of rows at different positions; the plain model's tokens in float32; the models it does not take keep the calls
one by one; and the refusals of what it would misread."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.runtime.backends.cpu import KernelLinear
from moeserve.runtime.backends.cpu_kernel import KernelError
from moeserve.runtime.engine import Engine
from moeserve.runtime.backends.kernel_decode import DecodeAttention, KernelDecodeStep, KernelRouter
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.backends.cpu import kernel_router
from moeserve.runtime.routing import SigmoidRouter, SoftmaxRouter, XMoERouter
from moeserve.tokenizer import ByteTokenizer

from .test_cpu_kernel import KERNEL_PLAN, requires_kernel
from .test_engine import PROMPTS, make_engine

ROUTERS = {  # name: (router factory over (D, E, K), its ranking of the experts from its own scores)
    "softmax": lambda D, E, K: SoftmaxRouter(D, E, K),
    "softmax-renormalized": lambda D, E, K: SoftmaxRouter(D, E, K, renormalize=True),
    "sigmoid": lambda D, E, K: SigmoidRouter(D, E, K),
    "xmoe-softmax": lambda D, E, K: XMoERouter(D, E, K, 4, "softmax", 0.3, 0.1),
    "xmoe-sigmoid": lambda D, E, K: XMoERouter(D, E, K, 4, "sigmoid", 0.07, 0.1),
}


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_the_kernel_router_is_the_torch_router(name, dtype):
    """The torch router with its linear map on the kernel too, so both see the same scores, bit for bit: the experts
    chosen are the same wherever the ranking has no tie at 1e-5 (a tie may break either way), and the gates agree
    to the last bits of exp in float32 and to one rounding in bfloat16."""
    torch.manual_seed(0)
    D, E, K, T = 48, 8, 2, 200
    router = ROUTERS[name](D, E, K).to(dtype).eval()
    with torch.no_grad():
        if isinstance(router, XMoERouter):
            router.tau.fill_(0.5)
            router.proj = KernelLinear.of(router.proj)
        else:
            router.gate = KernelLinear.of(router.gate)
    x = torch.randn(T, D, dtype=dtype)
    with torch.no_grad():
        ref = router(x)
        ids, gates = kernel_router(router)(x)
    assert ids.dtype == torch.int64 and gates.dtype == dtype and ids.shape == gates.shape == (T, K)
    rank = ref.scores.float()
    if isinstance(router, XMoERouter) and router.gate_kind == "softmax" or isinstance(router, SoftmaxRouter):
        rank = rank.softmax(-1) if isinstance(router, SoftmaxRouter) else (rank / 0.5).softmax(-1)
    top = rank.sort(dim=-1, descending=True).values[:, : K + 1]
    clear = (top[:, :-1] - top[:, 1:]).abs().min(dim=-1).values > 1e-5
    assert clear.sum() > 0.9 * T
    assert torch.equal(ids[clear], ref.expert_ids[clear])
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=0)
    torch.testing.assert_close(gates[clear].float(), ref.gates[clear].float(), **tol)
    assert ((ids >= 0) & (ids < E)).all() and (ids[:, 0] != ids[:, 1]).all()


@requires_kernel
def test_the_kernel_router_chooses_experts_in_range_from_any_scores():
    """NaN or infinite scores (a model gone wrong) still give K distinct ids in [0, E): nothing reads out of bounds."""
    router = SoftmaxRouter(8, 4, 3)
    x = torch.tensor([[float("nan")] * 8, [float("inf")] * 8, [0.0] * 8])
    ids, _ = kernel_router(router)(x)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2]]


def kernel_engine(router: str, dtype: str, **overrides) -> Engine:
    return Engine.from_model(make_engine(router, **overrides).model, ByteTokenizer(), dtype=dtype, plan=KERNEL_PLAN)


def step_outputs(engine: Engine, ids: torch.Tensor, host: bool = False) -> tuple:
    """A decode step of two rows at different positions (slots 2 and 0) after their prefills: logits, the routes,
    the expert counts and the cache the step wrote. `host`: the backend's decode (the whole step in one C call, from
    the host's numbers) rather than the model's forward with CacheRows (the ops one by one)."""
    model, n = engine.model, len(ids)
    cache = KVCache.for_model(model, 3)
    with torch.no_grad():
        model(ids[None, :-1], cache=cache.rows([2], [0], n - 1))
        model(ids[None, :-4], cache=cache.rows([0], [0], n - 4))
        if host:
            out = engine.runner.decode(cache, [2, 0], torch.stack([ids[-1], ids[-4]]), [n - 1, n - 4])
        else:
            out = model(torch.stack([ids[-1:], ids[-4:-3]]), cache=cache.rows([2, 0], [n - 1, n - 4], 1))
    return (out.logits, [a.routing.expert_ids for a in out.aux], [a.routing.gates for a in out.aux],
            [a.counts for a in out.aux], [t[[0, 2], :, :n] for t in cache.k + cache.v])  # the used slots


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("router,overrides", [
    ("softmax", {}), ("softmax", dict(renormalize=True, tie_embeddings=False, n_kv_heads=2, sliding_window=5)),
    ("sigmoid", dict(expert_act="gelu")), ("xmoe", {}), ("xmoe", dict(xmoe_gate="sigmoid")),
    ("softmax", dict(renormalize=True, n_kv_heads=2, qk_norm="head", d_head=24)),  # Qwen3-MoE's attention
    ("softmax", dict(qk_norm="all")),  # OLMoE's
], ids=["softmax", "renormalized-untied-gqa-window", "sigmoid-gelu", "xmoe", "xmoe-sigmoid", "qk-norm-per-head-wide",
        "qk-norm-whole"])
def test_a_decode_step_in_one_call_is_the_layers_calls(router, overrides, dtype, monkeypatch):
    """torch.equal with and without the one-call step (both on the kernel); generation takes it at every decode
    step, alone and in a batch, giving the same tokens."""
    engine = kernel_engine(router, dtype, **overrides)
    step = engine.runner.step
    assert isinstance(step, KernelDecodeStep)
    with torch.no_grad():  # norms of their own (a new model's are ones): the step holds the parameters
        for p in engine.model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ids = torch.tensor(engine.encode("import os\nimport sys\n"))  # 19 tokens: past the window
    one_call, layer_by_layer = step_outputs(engine, ids, host=True), step_outputs(engine, ids)
    for a, b in zip(one_call, layer_by_layer):
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    engine.runner.step = None
    assert one_call[3][0].sum() == 2 * engine.model.cfg.top_k  # two rows' choices counted

    unfused = [engine.generate([p], max_new_tokens=10)[0] for p in PROMPTS]
    engine.runner.step = step
    calls = []
    call = KernelDecodeStep.__call__
    monkeypatch.setattr(KernelDecodeStep, "__call__", lambda self, x, *a: calls.append(x.shape[0]) or call(self, x, *a))
    assert [engine.generate([p], max_new_tokens=10)[0] for p in PROMPTS] == unfused
    assert calls == [1] * 9 * len(PROMPTS)  # 9 decode steps after each prefill
    assert engine.generate(PROMPTS, max_new_tokens=10) == unfused  # rows at different positions in one call


@requires_kernel
@pytest.mark.parametrize("router,overrides", [("softmax", {}), ("sigmoid", {}), ("xmoe", {}),
                                              ("softmax", dict(qk_norm="head", d_head=24, n_kv_heads=2))])
def test_a_model_on_the_kernel_gives_the_plain_models_tokens(router, overrides):
    """In float32, the kernel's routing and whole step give torch's greedy tokens, alone and in a batch; the step's
    logits within float32 sums of torch's."""
    plain = make_engine(router, **overrides)
    kern = kernel_engine(router, "float32", **overrides)
    assert kern.runner.step is not None and not hasattr(plain.runner, "step")
    alone = [plain.generate([p], max_new_tokens=16)[0] for p in PROMPTS]
    assert [kern.generate([p], max_new_tokens=16)[0] for p in PROMPTS] == alone
    assert kern.generate(PROMPTS, max_new_tokens=16) == alone
    ids = torch.tensor(plain.encode("import os\nimport sys\n"))
    torch.testing.assert_close(step_outputs(kern, ids, host=True)[0], step_outputs(plain, ids)[0], atol=1e-4, rtol=0)


@requires_kernel
@pytest.mark.parametrize("router,overrides,why", [
    ("vq", {}, "VQ layers route by code"),
    ("softmax", dict(capacity_factor=1.0), "a capacity limit drops assignments"),
    ("softmax", dict(moe_layers=[1]), "a dense FFN layer"),
    ("softmax", dict(qkv_bias=True), "biased maps (Qwen2-MoE)"),
    ("softmax", dict(layer_windows=[None, 4]), "a window per layer (gpt-oss)"),
])
def test_models_the_step_does_not_take_keep_the_layers_calls(router, overrides, why):
    engine = kernel_engine(router, "float32", **overrides)
    assert engine.runner.step is None, why
    plain = make_engine(router, **overrides)
    assert engine.generate(PROMPTS, max_new_tokens=8) == plain.generate(PROMPTS, max_new_tokens=8)


@requires_kernel
def test_the_step_is_left_out_where_its_parts_are_not_on_the_kernel():
    engine = make_engine("softmax")
    for plan in (dataclasses.replace(KERNEL_PLAN, kernel_norms=False),
                 dataclasses.replace(KERNEL_PLAN, kernel_dense=False),
                 dataclasses.replace(KERNEL_PLAN, kernel_experts=False)):
        engine.executor.lay_out(plan)
        assert engine.runner.step is None, plan
    engine.executor.lay_out(KERNEL_PLAN)
    assert engine.runner.step is not None


@requires_kernel
def test_the_router_and_step_refuse_what_they_would_misread():
    w = torch.randn(4, 8)
    with pytest.raises(KernelError, match="gate 'relu' \\(one of \\('softmax', 'sigmoid'\\)\\), top_k 2 of 4"):
        KernelRouter(w, 2, "relu")
    with pytest.raises(KernelError, match="top_k 5 of 4 experts"):
        KernelRouter(w, 5)
    with pytest.raises(KernelError, match="embeddings \\[3, 4\\] for a projection to 4, not \\[3, 5\\]"):
        KernelRouter(w, 2, embeddings=torch.randn(3, 5))
    with pytest.raises(KernelError, match="w must be a contiguous torch.float32 CPU tensor of shape \\[4, 8\\]"):
        KernelRouter(w.T.contiguous().T, 2)
    with pytest.raises(KernelError, match="router: torch.float32 CPU rows of 8, not torch.bfloat16 \\[2, 8\\]"):
        KernelRouter(w, 2)(torch.randn(2, 8).bfloat16())

    engine = kernel_engine("softmax", "float32")
    step, cfg = engine.runner.step, engine.model.cfg
    cache = KVCache.for_model(engine.model, 2, 16)
    cache.touch([0, 1])
    zero = torch.zeros(1, dtype=torch.int64)
    args = dict(tokens_B=zero + 65, slots_B=zero + 1, positions_B=zero + 15, k_cache=cache.k, v_cache=cache.v,
                scale=0.5)
    logits, ids, gates, counts = step(**args)
    assert logits.shape == (1, cfg.vocab_size) and ids.shape == gates.shape == (cfg.n_layers, 1, cfg.top_k)
    assert counts.sum(-1).tolist() == [cfg.top_k] * cfg.n_layers
    with pytest.raises(KernelError, match="decode step: tokens, slots and positions are 1 contiguous int64s, not "
                                          "torch.int32"):
        step(**{**args, "tokens_B": args["tokens_B"].int()})
    with pytest.raises(KernelError, match=f"{cfg.n_layers} layers' caches of contiguous torch.float32"):
        step(**{**args, "k_cache": cache.k[:1]})
    before = [t.clone() for t in cache.k + cache.v]
    for name, bad in (("tokens_B", cfg.vocab_size), ("tokens_B", -1), ("slots_B", 2), ("positions_B", 16)):
        with pytest.raises(ValueError, match=f"expected tokens below {cfg.vocab_size}, slots below 2 and positions "
                                             "below 16"):
            step(**{**args, name: zero + bad})
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))  # a refused row wrote nothing
    with pytest.raises(KernelError, match="rope cos must be a contiguous torch.float32 CPU tensor of shape"):
        model = engine.model
        parts = [(DecodeAttention(((b.attention_norm.weight, 1e-5), (b.ffn_norm.weight, 1e-5)),
                                  (b.attention.wq.weight, b.attention.wk.weight, b.attention.wv.weight,
                                   b.attention.wo.weight), cfg.n_heads, cfg.kv_heads), b.ffn.router.kernel,
                  b.ffn.experts.w.fused) for b in model.layers]
        KernelDecodeStep(parts, (model.norm.weight, 1e-5), model.tok_embeddings.weight, model.tok_embeddings.weight,
                         (torch.ones(8, 3), torch.ones(8, 3)))


def test_a_layers_attention_weights_are_refused_where_the_step_would_misread_them():
    D, H, G, Dh = 16, 4, 2, 4
    w = {n: torch.randn(*shape) for n, shape in
         dict(wq=(H * Dh, D), wk=(G * Dh, D), wv=(G * Dh, D), wo=(D, H * Dh)).items()}
    norms = ((torch.ones(D), 1e-5), (torch.ones(D), 1e-5))
    a = DecodeAttention(norms, tuple(w.values()), H, G)
    assert (a.dtype, a.D, a.Dh) == (torch.float32, D, Dh)
    with pytest.raises(KernelError, match="wk must be a contiguous torch.float32 CPU tensor of shape \\[8, 16\\]"):
        DecodeAttention(norms, (w["wq"], w["wq"], w["wv"], w["wo"]), H, G)
    with pytest.raises(KernelError, match="wq must be a contiguous torch.float32"):
        DecodeAttention(norms, (w["wq"].bfloat16(), w["wk"], w["wv"], w["wo"]), H, G)
    with pytest.raises(KernelError, match="the kv heads must divide the query heads"):
        DecodeAttention(norms, (w["wq"], torch.randn(3 * 4, D), torch.randn(3 * 4, D), w["wo"]), H, 3)


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_biased_maps_and_experts_run_on_the_kernels_gemm(dtype):
    """Qwen2-MoE's q/k/v biases and gpt-oss's biased, clamped experts: their maps on the kernel's GEMM with the bias
    added after (KernelLinear, KernelBiasedExperts), the plain model's logits within the roundings of the GEMM, and
    its greedy tokens; past the kernel's row count (a long prompt) torch's GEMM as before."""
    from moeserve.runtime.backends.cpu import KernelBiasedExperts

    overrides = dict(qkv_bias=True, o_bias=True, expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=1.5)
    plain, kern = make_engine("softmax", **overrides), make_engine("softmax", **overrides)
    with torch.no_grad():  # biases of their own (a new model's are zeros), the same in both
        torch.manual_seed(3)
        for (name, p), q in zip(plain.model.named_parameters(), kern.model.parameters()):
            if p.dim() == 1 or name.endswith(("experts.b1", "experts.b2", "experts.b3")):
                p.copy_(torch.randn_like(p) * 0.3)
                q.copy_(p)
    assert plain.model.layers[0].ffn.experts.b2.abs().sum() > 0
    plain = Engine.from_model(plain.model, ByteTokenizer(), dtype=dtype)
    kern = Engine.from_model(kern.model, ByteTokenizer(), dtype=dtype, plan=KERNEL_PLAN)
    layer = kern.model.layers[0]
    assert isinstance(layer.attention.wq, KernelLinear) and layer.attention.wq.bias is not None
    assert isinstance(layer.ffn.experts, KernelBiasedExperts) and kern.runner.step is None
    ids = torch.tensor([kern.encode("def f(x):\n    return x")])
    atol = 1e-4 if dtype == "float32" else 5e-2
    with torch.no_grad():
        torch.testing.assert_close(kern.model(ids).logits, plain.model(ids).logits, atol=atol, rtol=0)
    if dtype == "float32":
        assert kern.generate(PROMPTS, max_new_tokens=10) == plain.generate(PROMPTS, max_new_tokens=10)
