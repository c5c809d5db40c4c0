"""The C kernel on quantized weights (quant_kernel.py, kernels/quant.c): linear_q equal to reference_linear_q (the
same arithmetic in torch, the activations quantized as the C code does) within float32 rounding, one bf16 rounding
for bf16, at 1, 2-8, 9 and 64 rows, int8 and int4 (groups 32 and 64), float32 and bfloat16 rows; a row's output
bit for bit the same whatever rows share the call; both sides of the build (AVX512 with VNNI, and the AVX2 side
built here with -mno-avx512f, each checked in a fresh process); the quantized experts in one call against
reference_moe_q, and near the dequantized QuantExperts; a whole decode step on quantized weights against a
reference composed in torch; the refusals of what the kernel would misread."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.kernel_abi import KernelError
from moeserve.runtime.backends.quant_kernel import KernelQuantExperts, linear_q
from moeserve.runtime.backends.quant_reference import reference_linear_q, reference_moe_q
from moeserve.runtime.device import cpu_flags
from moeserve.runtime.experts import Experts
from moeserve.runtime.quant import QuantExperts, QuantSpec, quantize

from .test_cpu_kernel import _probe, requires_kernel, torch_threads

BF16 = torch.bfloat16
SPECS = {"int8": QuantSpec(8), "int4-g32": QuantSpec(4, 32), "int4-g64": QuantSpec(4, 64), "int6-g32": QuantSpec(6, 32),
         "int6-g128": QuantSpec(6, 128)}
ATTENTION = ("wq", "wk", "wv", "wo")


def assert_matches(y: torch.Tensor, want: torch.Tensor) -> None:
    """float32: the reference's exact value within float32 summation error; bf16: within one bf16 rounding."""
    assert y.dtype == want.dtype and y.shape == want.shape
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    else:
        torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-6)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 64])
@pytest.mark.parametrize("fmt", list(SPECS))
def test_linear_q_equals_the_reference_of_its_arithmetic(fmt, n, dtype):
    spec = SPECS[fmt]
    g = torch.Generator().manual_seed(n)
    I = 384 if spec.bits == 6 else 192  # int6 packs 128 elements at a time; 192 gives int4 a partial last step
    qw, sc = quantize(torch.randn(67, I, generator=g), spec)
    x = torch.randn(n, I, generator=g).to(dtype)
    x[0, :32] = 0  # a block of zeros: d = 0
    for threads in (1, 2):
        with torch_threads(threads):
            assert_matches(linear_q(x, qw, sc, spec), reference_linear_q(x, qw, sc, spec))


@requires_kernel
@pytest.mark.parametrize("fmt", list(SPECS))
def test_the_reference_is_near_the_dequantized_weights_product(fmt):
    """What the activations' quantization costs: the reference (and so the kernel) stays within ~1% of x @ w^T on
    the dequantized weight, which is what QuantLinear computes."""
    spec = SPECS[fmt]
    g = torch.Generator().manual_seed(1)
    qw, sc = quantize(torch.randn(64, 256, generator=g), spec)
    x = torch.randn(5, 256, generator=g)
    from moeserve.runtime.quant import dequantize

    exact = x.double() @ dequantize(qw, sc, spec).double().T
    err = (linear_q(x, qw, sc, spec).double() - exact).norm() / exact.norm()
    assert err < 1e-2


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int6-g32"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(fmt, dtype):
    spec = SPECS[fmt]
    g = torch.Generator().manual_seed(7)
    qw, sc = quantize(torch.randn(91, 128, generator=g), spec)
    x = torch.randn(40, 128, generator=g).to(dtype)
    alone = torch.cat([linear_q(x[j:j + 1], qw, sc, spec) for j in range(40)])
    for n in (2, 3, 5, 8, 9, 17, 40):
        assert torch.equal(linear_q(x[:n], qw, sc, spec), alone[:n]), n
        assert torch.equal(linear_q(x[n - 1:2 * n - 1], qw, sc, spec), alone[n - 1:2 * n - 1]), n


BOTH_SIDES = """
import torch
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.quant_kernel import linear_q
from moeserve.runtime.backends.quant_reference import reference_linear_q
from moeserve.runtime.quant import QuantSpec, quantize
print(cpu_kernel.unavailable_reason())
g = torch.Generator().manual_seed(0)
ok = []
for spec in (QuantSpec(8), QuantSpec(4, 32), QuantSpec(4, 64)):
    qw, sc = quantize(torch.randn(45, 320, generator=g), spec)
    for n in (1, 5, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n, 320, generator=g).to(dtype)
            y, want = linear_q(x, qw, sc, spec).double(), reference_linear_q(x, qw, sc, spec).double()
            tol = (1e-5, 1e-6 * want.abs().max().item()) if dtype == torch.float32 else (2**-7, 1e-6)
            ok.append(torch.allclose(y, want, rtol=tol[0], atol=tol[1]))
            ok.append(torch.equal(linear_q(x[-1:], qw, sc, spec).double(), y[-1:]))
# widths whose blocks are 1, 3, 4, 7 and 9 (the int4 kernels' steps of four blocks and pairs of blocks, and their
# partial last steps), groups of 32, 64 and 96, 1 to 9 rows
for I, groups in ((32, (32,)), (96, (32, 96)), (128, (32, 64)), (224, (32,)), (288, (32, 96))):
    for spec in (QuantSpec(8), *(QuantSpec(4, G) for G in groups)):
        qw, sc = quantize(torch.randn(13, I, generator=g), spec)
        x = torch.randn(9, I, generator=g)
        want = reference_linear_q(x, qw, sc, spec).double()
        ys = [linear_q(x[:n], qw, sc, spec).double() for n in range(1, 10)]
        ok.append(all(torch.allclose(y, want[:len(y)], rtol=1e-5, atol=1e-6 * want.abs().max().item()) for y in ys))
        ok.append(all(torch.equal(y, ys[-1][:len(y)]) for y in ys))
# int6: one and three chunks of 128 elements, groups of 32 to 128, 1 to 9 and 64 rows
for I, groups in ((128, (32, 64, 128)), (384, (32, 128))):
    for spec in (QuantSpec(6, G) for G in groups):
        qw, sc = quantize(torch.randn(13, I, generator=g), spec)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(64, I, generator=g).to(dtype)
            want = reference_linear_q(x, qw, sc, spec).double()
            tol = (1e-5, 1e-6 * want.abs().max().item()) if dtype == torch.float32 else (2**-7, 1e-6)
            ys = [linear_q(x[:n], qw, sc, spec).double() for n in (*range(1, 10), 64)]
            ok.append(all(torch.allclose(y, want[:len(y)], rtol=tol[0], atol=tol[1]) for y in ys))
            ok.append(all(torch.equal(y, ys[-1][:len(y)]) for y in ys))
print(all(ok), len(ok))
"""


@requires_kernel
def test_both_sides_of_the_build(tmp_path):
    """-march=native on this CPU (vpdpbusd where it has AVX512-VNNI), the AVX2 side (maddubs + madd) built with
    -mno-avx512f, and the plain-C side built with -mno-avx2: each against the reference in a fresh process and
    cache, at widths of 1 to 10 blocks (the partial last steps of the int4 kernels) and 1 to 9 rows."""
    if "avx2" not in cpu_flags():
        pytest.skip("the vector paths need AVX2")
    native = _probe({"MOESERVE_CACHE": str(tmp_path / "native")}, BOTH_SIDES)
    assert native == "None\nTrue 82"
    if "avx512f" in cpu_flags():
        avx2 = _probe({"MOESERVE_CACHE": str(tmp_path / "avx2"), cpu_kernel.CFLAGS_ENV: "-mno-avx512f"}, BOTH_SIDES)
        assert avx2 == "None\nTrue 82"
    plain = _probe({"MOESERVE_CACHE": str(tmp_path / "plain"), cpu_kernel.CFLAGS_ENV: "-mno-avx2"}, BOTH_SIDES)
    assert plain == "None\nTrue 82"  # the plain-C lanes (no AVX2) of the same arithmetic


def _experts(E: int, D: int, F: int, act: str, spec: QuantSpec, g: torch.Generator) -> QuantExperts:
    ex = Experts(E, D, F, act)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            w = getattr(ex, name)
            if w is not None:
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5)
    return QuantExperts.of(ex, spec)


def _weights(qe: QuantExperts) -> dict:
    return {n: (getattr(qe, f"{n}_qweight"), getattr(qe, f"{n}_scale")) if n != "w3" or qe.has_w3 else None
            for n in ("w1", "w2", "w3")}


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("T", [1, 3, 64])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_quantized_experts_equal_the_reference(fmt, act, T, dtype):
    """Against reference_moe_q: in float32 nearly all outputs within float32 rounding; an activation whose float32
    value lies at a half int8 step may round the other way in one of the two, which moves its token's outputs by
    ~1e-3 of their size: allowed, in a few outputs only. bf16 within its roundings. And near the dequantized
    QuantExperts (the cost of quantizing the activations)."""
    spec = SPECS[fmt]
    g = torch.Generator().manual_seed(T)
    E, D, F_, K = 8, 64, 96, 2
    qe = _experts(E, D, F_, act, spec, g)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :K]
    gates = (torch.rand(T, K, generator=g) + 0.1).to(dtype)
    got = KernelQuantExperts.of(qe).moe(x, ids, gates)
    want = reference_moe_q(x, ids, gates, _weights(qe), spec)
    assert got.dtype == dtype
    scale = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert diff.max() <= 2e-3 * scale
        assert (diff > 1e-5 * scale).float().mean() <= 0.05
    else:
        assert diff.max() <= 2e-2 * scale
    with torch.no_grad():
        plain = qe(x.float(), ids, gates.float())
    assert (got.float() - plain).norm() / plain.norm() < 3e-2


@requires_kernel
def test_refusals_are_named():
    g = torch.Generator().manual_seed(0)
    qw, sc = quantize(torch.randn(8, 96, generator=g), QuantSpec(4, 32))
    x = torch.randn(2, 96)
    with pytest.raises(KernelError, match="group size 64 does not divide its input width 96"):
        linear_q(x, qw, sc, QuantSpec(4, 64))
    with pytest.raises(KernelError, match="float32 or bfloat16 CPU rows, not torch.float16"):
        linear_q(x.half(), qw, sc, QuantSpec(4, 32))
    w8, s8 = quantize(torch.randn(8, 96, generator=g), QuantSpec(8))
    with pytest.raises(KernelError, match="int8 takes a torch.int8 weight and torch.float32 scales"):
        linear_q(x, w8.view(torch.uint8), s8, QuantSpec(8))
    with pytest.raises(KernelError, match="int4 takes a torch.uint8 weight and torch.float16 scales"):
        linear_q(x, qw, sc.float(), QuantSpec(4, 32))
    q8, s8 = quantize(torch.randn(8, 48, generator=g), QuantSpec(8))
    with pytest.raises(KernelError, match="widths that are multiples of 32, not 48"):
        linear_q(torch.randn(2, 48), q8, s8, QuantSpec(8))
    with pytest.raises(KernelError, match="shapes do not match"):
        linear_q(torch.randn(2, 64), qw, sc, QuantSpec(4, 32))
    # the C calls themselves refuse a format or group they cannot read, writing nothing
    lib = cpu_kernel._library()
    y = torch.full((2, 8), 7.0)
    for fmt, group in ((2, 48), (2, 0), (3, 32), (0, 32)):
        assert lib.linear_q(x.data_ptr(), 96, qw.data_ptr(), sc.data_ptr(), fmt, group, y.data_ptr(), 8, 2, 8, 96,
                            1) == -4
    assert torch.equal(y, torch.full((2, 8), 7.0))
    qe = _experts(4, 32, 64, "swiglu", QuantSpec(8), g)
    with pytest.raises(KernelError, match="expert ids outside"):
        KernelQuantExperts.of(qe).moe(torch.randn(2, 32), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(KernelError, match=r"w2 \[E, D, F\] of one E, D and F"):
        KernelQuantExperts(QuantSpec(8), (qe.w1_qweight, qe.w1_scale), (qe.w2_qweight[:, :16], qe.w2_scale[:, :16]))


# ---- the whole decode step on quantized weights ---------------------------------------------------------------------
def _step_model(spec: QuantSpec, dtype: torch.dtype, quant_head: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    nL, D, H, G, Dh, E, K, F_, V, P = 2, 128, 4, 2, 32, 4, 2, 96, 50, 16  # D 128: a head int6 can pack
    mk = lambda *shape, scale=None: (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5))  # noqa: E731
    layers = []
    for _ in range(nL):
        ly = {"n1": (1 + mk(D, scale=0.1)).to(dtype), "n2": (1 + mk(D, scale=0.1)).to(dtype),
              "gate": mk(E, D).to(dtype)}
        for name, shape in (("wq", (H * Dh, D)), ("wk", (G * Dh, D)), ("wv", (G * Dh, D)), ("wo", (D, H * Dh)),
                            ("w1", (E, F_, D)), ("w3", (E, F_, D)), ("w2", (E, D, F_))):
            ly[name] = quantize(mk(*shape), spec.for_weight(name if name in ATTENTION else "experts", shape[-1]))
        layers.append(ly)
    head = mk(V, D)
    return dict(nL=nL, D=D, H=H, G=G, Dh=Dh, E=E, K=K, F=F_, V=V, P=P, spec=spec, dtype=dtype, layers=layers,
                norm=(1 + mk(D, scale=0.1)).to(dtype),
                head=quantize(head, spec.for_weight("output", D)) if quant_head else head.to(dtype),
                emb=mk(V, D, scale=1.0).to(dtype), cos=mk(P, Dh, scale=1.0).to(dtype), sin=mk(P, Dh, scale=1.0).to(dtype))


def _kernel_step(m: dict):
    from moeserve.runtime.backends.kernel_decode import DecodeAttention, KernelDecodeStep, KernelRouter

    parts = []
    for ly in m["layers"]:
        att = DecodeAttention(((ly["n1"], 1e-5), (ly["n2"], 1e-6)), tuple(ly[n][0] for n in ATTENTION), m["H"],
                              m["G"], tuple(m["spec"].for_weight(n, m["D"]) for n in ATTENTION),
                              tuple(ly[n][1] for n in ATTENTION))
        parts.append((att, KernelRouter(ly["gate"], m["K"], "softmax"),
                      KernelQuantExperts(m["spec"].for_weight("experts", m["D"]), ly["w1"], ly["w2"], ly["w3"])))
    quant_head = isinstance(m["head"], tuple)
    head = m["head"][0] if quant_head else m["head"]
    return KernelDecodeStep(parts, (m["norm"], 1e-5), head, m["emb"], (m["cos"], m["sin"]),
                            head_quant=(m["head"][1], m["spec"].for_weight("output", m["D"])) if quant_head else None)


def _reference_step(m: dict, tokens, slots, pos, kc: list, vc: list):
    """The step composed in torch from the same quantized weights: F.rms_norm, reference_linear_q, apply_rope, the
    cache write, attention (kernel_checks' SDPA reference), a softmax router's top-k, reference_moe_q."""
    import torch.nn.functional as F

    from moeserve.runtime.backends.kernel_checks import attention_reference
    from moeserve.runtime.model import apply_rope

    dt, B, spec = m["dtype"], tokens.shape[0], m["spec"]
    rms = lambda x, w, eps: F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(dt)  # noqa: E731
    x = m["emb"][tokens]
    cs, sn = m["cos"][pos][:, None], m["sin"][pos][:, None]
    all_ids = []
    for ly, k, v in zip(m["layers"], kc, vc):
        xn = rms(x, ly["n1"], 1e-5)
        q, kn, vn = (reference_linear_q(xn, *ly[n], spec.for_weight(n, m["D"])) for n in ("wq", "wk", "wv"))
        q = apply_rope(q.view(B, m["H"], m["Dh"]), cs, sn)
        kn = apply_rope(kn.view(B, m["G"], m["Dh"]), cs, sn)
        k[slots, :, pos], v[slots, :, pos] = kn, vn.view(B, m["G"], m["Dh"])
        att = attention_reference(q, k, v, slots, torch.zeros_like(pos), pos + 1, m["Dh"] ** -0.5).to(dt)
        h = x + reference_linear_q(att.reshape(B, -1), *ly["wo"], spec.for_weight("wo", m["H"] * m["Dh"]))
        hn = rms(h, ly["n2"], 1e-6)
        probs = (hn.float() @ ly["gate"].float().T).softmax(-1)
        gates, ids = probs.topk(m["K"], dim=-1)
        all_ids.append(ids)
        x = h + reference_moe_q(hn, ids, gates.to(dt), {n: ly[n] for n in ("w1", "w2", "w3")},
                                spec.for_weight("experts", m["D"]))
    xn = rms(x, m["norm"], 1e-5)
    head = m["head"]
    logits = reference_linear_q(xn, *head, spec.for_weight("output", m["D"])) if isinstance(head, tuple) else \
        (xn.float() @ head.float().T).to(dt)
    return logits, torch.stack(all_ids)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-recipe", "int4-head-int8"])
def test_a_decode_step_on_quantized_weights_equals_its_torch_composition(fmt, B, dtype):
    """Logits, expert choices and the caches written, against the step composed in torch from the same quantized
    weights (quantized head too for int8; a float head beside int4 layers; int4's recipe, wk and wv at int8 and the
    head at int6, the formats mixed within a layer; and with the head at int8). Within float32 rounding but for an activation rounded to the neighbouring
    int8 step (see test_quantized_experts_equal_the_reference); in bf16 within a few bf16 roundings carried
    through two layers."""
    spec = {"int4-recipe": QuantSpec.parse("int4"), "int4-head-int8": QuantSpec(4, 32, ("wk", "wv", "output"))}.get(
        fmt) or SPECS[fmt]
    m = _step_model(spec, dtype, quant_head=fmt != "int4-g32", seed=B)
    step = _kernel_step(m)
    S = 4
    g = torch.Generator().manual_seed(1)
    kc = [(torch.randn(S, m["G"], m["P"], m["Dh"], generator=g)).to(dtype) for _ in range(m["nL"])]
    vc = [(torch.randn(S, m["G"], m["P"], m["Dh"], generator=g)).to(dtype) for _ in range(m["nL"])]
    tokens, slots, pos = torch.tensor([3, 7, 11][:B]), torch.tensor([1, 0, 3][:B]), torch.tensor([5, 2, 9][:B])
    rk, rv = [t.clone() for t in kc], [t.clone() for t in vc]
    logits, ids, gates, counts = step(tokens, slots, pos, kc, vc, m["Dh"] ** -0.5)
    want, want_ids = _reference_step(m, tokens, slots, pos, rk, rv)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    tol = 3e-3 if dtype == torch.float32 else 5e-2
    scale = want.float().abs().max().item()
    assert (logits.float() - want.float()).abs().max() <= tol * scale
    for got, ref in ((kc, rk), (vc, rv)):
        for a, b in zip(got, ref):
            assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    assert torch.equal(counts.sum(-1), torch.full((m["nL"],), B * m["K"]))


@requires_kernel
def test_a_decode_step_refuses_float_attention_beside_quantized_experts():
    from moeserve.runtime.backends.kernel_decode import DecodeAttention, KernelDecodeStep, KernelRouter

    m = _step_model(QuantSpec(8), torch.float32, quant_head=False)
    ly = m["layers"][0]
    g = torch.Generator().manual_seed(3)
    floats = tuple(torch.randn(*shape, generator=g) for shape in (
        (m["H"] * m["Dh"], m["D"]), (m["G"] * m["Dh"], m["D"]), (m["G"] * m["Dh"], m["D"]), (m["D"], m["H"] * m["Dh"])))
    att = DecodeAttention(((ly["n1"], 1e-5), (ly["n2"], 1e-6)), floats, m["H"], m["G"])
    experts = KernelQuantExperts(QuantSpec(8), ly["w1"], ly["w2"], ly["w3"])
    with pytest.raises(KernelError, match="attention is float and its experts int8: both or neither"):
        KernelDecodeStep([(att, KernelRouter(ly["gate"], m["K"]), experts)], (m["norm"], 1e-5), m["head"], m["emb"],
                         (m["cos"], m["sin"]))
    with pytest.raises(KernelError, match="quantized weights need their four scales"):
        DecodeAttention(((ly["n1"], 1e-5), (ly["n2"], 1e-6)), tuple(ly[n][0] for n in ATTENTION),
                        m["H"], m["G"], (QuantSpec(8),) * 4)
