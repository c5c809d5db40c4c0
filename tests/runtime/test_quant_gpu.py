"""Quantized weights on torch's own quantized ops (backends/quant_gpu.py) and the fp8 format (runtime/quant_fp8.py).

On a CPU: the formats' conversions against quant.py's dequantize (tinygemm's tiles through its CPU twin, int8pack's
and _scaled_mm's CPU kernels), the indexed experts against the reference, a fullgraph compile of every form, the plan
and the backend's wiring, and the refusal of fp8. Marked `cuda` (README, "On a GPU": `pytest -m cuda`): each form on
CUDA against the reference at 1, 2-8 and 64 rows, generation through the engine with --quantize int8|int4|fp8
against the dequantized reference, and the compiled step (CUDA graphs) on them with no host sync.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from moeserve.checkpoint import save_checkpoint
from moeserve.config import MoEConfig, preset
from moeserve.runtime.backends import compiled as compiled_mod
from moeserve.runtime.backends import quant_gpu
from moeserve.runtime.backends.layout import plain_
from moeserve.runtime.backends.plan import DispatchPlan, quantized_plan
from moeserve.runtime.backends.quant_gpu import (
    DequantizedLinear, Fp8ScaledLinear, IndexedQuantExperts, Int4PackLinear, Int8PackLinear, describe_forms,
    indexed_experts, linear_form, tinygemm_bytes, tinygemm_scales, tinygemm_unfit,
)
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.experts import Experts
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import QuantExperts, QuantLinear, QuantSpec, describe, unpack_int4
from moeserve.runtime.quant_fp8 import (
    FP8_MAX, Fp8Experts, Fp8Linear, Fp8Unavailable, dequantize_fp8, quantize_fp8, quantize_model_fp8_,
    quantize_rows_fp8,
)

FORMATS = ["int8", "int4", "fp8"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _linear(fmt: str, O: int, I: int, seed: int = 0, device: str = "cpu") -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(O, I, generator=g) * I**-0.5).to(device)
    return Fp8Linear.of(w) if fmt == "fp8" else QuantLinear.of(w, QuantSpec.parse(fmt))


def _experts(fmt: str, act: str = "swiglu", E: int = 4, D: int = 64, Fh: int = 96) -> QuantExperts:
    torch.manual_seed(1)
    ex = Experts(E, D, Fh, act)
    return Fp8Experts.of(ex) if fmt == "fp8" else QuantExperts.of(ex, QuantSpec.parse(fmt))


def _routing(T: int, E: int = 4, K: int = 2, D: int = 64, device: str = "cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K].to(device)
    gates = torch.rand(T, K, generator=g).to(device, dtype)
    return x, ids, gates


# ---- fp8: the format ----------------------------------------------------------------------------
def test_fp8_on_known_values():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.6, -2.0, 1e-4]])
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([1 / FP8_MAX, 0.0, 2 / FP8_MAX])
    # 448, 224 and 112 are e4m3 values: exact; 0.6 * 224 = 134.4 rounds to 128 (e4m3 steps by 16 in [128, 256));
    # 1e-4 * 224 = 0.0224 is below e4m3's smallest normal (2^-6) and rounds to the subnormal 0.021484375 (11 * 2^-9)
    assert q.float().tolist() == [[448, -224, 112, 0], [0, 0, 0, 0], [448, 128, -448, 0.021484375]]
    d = dequantize_fp8(q, scale)
    assert torch.equal(d[0], w[0]) and d[1].abs().sum() == 0  # a zero row stays zero, no division by zero
    assert d[2, 1].item() == pytest.approx(128 / 224)
    # random weights: no NaN (a quotient a hair past 448 is clamped first), error within half an e4m3 step (2^-4)
    w = torch.randn(64, 256)
    q, scale = quantize_fp8(w)
    assert not q.float().isnan().any() and q.float().abs().max() == FP8_MAX
    err = (dequantize_fp8(q, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + scale[:, None] * 2**-9 + 1e-12).all()


def test_fp8_rows_are_quantized_per_row_and_a_zero_row_stays_zero():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.1]], dtype=torch.bfloat16)
    xq, a = quantize_rows_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and a.shape == (3, 1) and a.dtype == torch.float32
    assert a[:, 0].tolist() == pytest.approx([1 / FP8_MAX, 1e-12, 3 / FP8_MAX])
    assert xq[0].float().tolist() == [224, -448, 112, 0] and xq[1].float().abs().sum() == 0
    assert xq[2].float().tolist()[:3] == [448, 224, -112]


def test_fp8_modules_keep_their_bits_through_dtype_casts_and_say_fp8():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    model.to(torch.float32)
    from moeserve.runtime import quant_fp8

    # quantize_fp8_ is the device-free part (quantize_model_fp8_ checks the device first: refused on a CPU)
    quant_fp8.quantize_fp8_(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).half().float()
    for k, v in model.state_dict().items():
        if k.endswith(("scale", "qweight")):
            assert v.dtype == before[k].dtype and torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
    assert MoEConfig(quantization={"format": "fp8"}).quantization == {"format": "fp8"}
    assert describe({"format": "fp8"}) == "fp8"
    assert "fp8" in repr(model.layers[0].attention.wq)
    # a config that says fp8 builds fp8 modules for the loader to fill
    built = Transformer(MoEConfig(**{**preset("tiny").to_dict(), "quantization": {"format": "fp8"}}))
    assert isinstance(built.layers[0].attention.wq, Fp8Linear) and isinstance(built.moe_layers[0].experts, Fp8Experts)


# ---- int4: tinygemm's layout --------------------------------------------------------------------
def test_tinygemm_bytes_hold_the_even_element_high_and_the_odd_low():
    u = torch.arange(64, dtype=torch.uint8).remainder(16)[None].repeat(3, 1)
    u[1] = torch.randint(0, 16, (64,), dtype=torch.uint8)
    from moeserve.runtime.quant import pack_int4

    b = tinygemm_bytes(pack_int4(u))
    assert b.shape == (3, 32) and b.dtype == torch.uint8
    assert torch.equal(b >> 4, u[:, 0::2]) and torch.equal(b & 0xF, u[:, 1::2])
    assert b[0, :3].tolist() == [0x01, 0x23, 0x45]


def test_tinygemm_scales_are_ours_in_bfloat16_with_zero_zeros():
    m = _linear("int4", 16, 128)
    sz = tinygemm_scales(m.scale)
    assert sz.shape == (128 // 32, 16, 2) and sz.dtype == torch.bfloat16 and sz.is_contiguous()
    assert torch.equal(sz[..., 0], m.scale.t().to(torch.bfloat16)) and sz[..., 1].abs().sum() == 0
    # the only change: the float16 scale rounded to bfloat16, at most 2^-9 relative
    assert ((sz[..., 0].float() - m.scale.t().float()).abs() <= m.scale.t().float().abs() * 2**-8).all()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_tinygemm_repacking_on_the_cpu_op_equals_our_dequantized_weight(group, rows):
    """The weight converted once (tiles and scales_and_zeros) computes x @ w^T with w = (u - 8) * bf16(scale): our
    dequantized weight with its scales in bfloat16, within the output's bfloat16 rounding (the op accumulates in
    float32); and the weight-only reference within the scales' rounding too."""
    m = QuantLinear.of(torch.randn(48, 256) * 256**-0.5, QuantSpec(4, group))
    laid = linear_form(m, torch.bfloat16)
    assert isinstance(laid, Int4PackLinear) and laid.tiles.dtype in (torch.uint8, torch.int32)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    u = unpack_int4(m.qweight).float() - 8
    w = (u.view(48, -1, group) * m.scale.to(torch.bfloat16).float()[..., None]).view(48, 256)
    want = x.float() @ w.t()
    got = laid(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(got.float(), m(x).float(), rtol=2**-6, atol=2e-2)


def test_shapes_tinygemm_does_not_take_keep_the_reference():
    assert "group size 96" in tinygemm_unfit(64, 192, 96)
    assert "multiple of 8" in tinygemm_unfit(259, 64, 32)
    assert linear_form(QuantLinear.of(torch.randn(259, 64), QuantSpec(4, 32)), torch.bfloat16) is None
    assert linear_form(_linear("int4", 64, 64), torch.float32) is None  # tinygemm takes bfloat16 rows only
    assert linear_form(Fp8Linear.of(torch.randn(259, 64)), torch.bfloat16) is None  # _scaled_mm: multiples of 16


# ---- int6: no torch kernel, dequantized once ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int6_is_dequantized_once_at_lay_out_and_is_the_reference_bit_for_bit(dtype):
    """torch has no 6-bit kernel: an int6 linear map (an int4 model's head) is laid out as its weight dequantized
    once to the model's dtype, torch's GEMM on it: the weight-only reference's numbers exactly, on any device and
    dtype; its state (the int6 bytes) and its plain module unchanged."""
    m = QuantLinear.of(torch.randn(40, 256) * 256**-0.5, QuantSpec(6, 32))
    laid = linear_form(m, dtype)
    assert type(laid) is DequantizedLinear and laid.weight_OI.dtype == dtype and laid.weight_OI.shape == (40, 256)
    x = torch.randn(5, 256).to(dtype)
    assert torch.equal(laid(x), m(x))
    assert laid.state_dict().keys() == m.state_dict().keys() == {"qweight", "scale"}
    assert type(laid.plain()) is QuantLinear
    assert "int6 dequantized once" in describe_forms(QuantSpec.parse("int4").as_dict())
    assert "int6" not in describe_forms(QuantSpec.parse("int4", int6=()).as_dict())


# ---- int8 and fp8 on their CPU kernels ----------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_int8pack_is_the_float32_sum_scaled_once(rows):
    m = _linear("int8", 48, 128)
    laid = linear_form(m, torch.bfloat16, max_rows=16)
    assert isinstance(laid, Int8PackLinear)
    x = torch.randn(2, rows, 128).to(torch.bfloat16)
    got = laid(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
    if 2 * rows > 16:  # past max_rows: the reference itself
        assert torch.equal(got, m(x))
        return
    want = (x.float() @ m.qweight.float().t()) * m.scale.to(torch.bfloat16).float()  # the CPU op's bf16 scales
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fp8_scaled_mm_is_the_row_quantized_product(rows):
    m = _linear("fp8", 48, 128)
    laid = linear_form(m, torch.bfloat16)
    assert isinstance(laid, Fp8ScaledLinear) and laid.scale_1O.shape == (1, 48)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    xq, a = quantize_rows_fp8(x)
    want = (xq.float() * a) @ dequantize_fp8(m.qweight, m.scale).t()
    got = laid(x)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)
    # against the weight-only reference: the activations' e4m3 rounding (3 bits of mantissa) shows
    ref = m(x).float()
    assert (got.float() - ref).abs().max() <= 0.1 * ref.abs().max()


# ---- the experts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_indexed_experts_equal_the_reference(fmt, act):
    ref = _experts(fmt, act)
    for gather_max, T in ((64, 1), (64, 5), (64, 64), (1, 5)):  # the last: past gather_max, the reference's path
        laid = indexed_experts(ref, gather_max)
        x, ids, gates = _routing(T)
        torch.testing.assert_close(laid(x, ids, gates), ref(x, ids, gates), rtol=1e-5, atol=1e-5)


# ---- no host sync: each form compiles whole -------------------------------------------------------
class _AllForms(torch.nn.Module):
    def __init__(self, forms, experts):
        super().__init__()
        self.forms, self.experts = torch.nn.ModuleList(forms), torch.nn.ModuleList(experts)

    def forward(self, x, ids, gates):
        return [f(x) for f in self.forms] + [e(x, ids, gates) for e in self.experts]


@pytest.mark.slow
def test_the_forms_compile_whole_on_a_cpu():
    """torch.compile(fullgraph=True) of every form on its CPU op (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu,
    _scaled_mm) and of the indexed experts: no graph break, so no host sync and no data-dependent shape; the compiled
    numbers are the eager ones."""
    why = compiled_mod.compile_unavailable(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    forms = [linear_form(_linear(f, 64, 64), torch.bfloat16) for f in FORMATS]
    assert [type(f) for f in forms] == [Int8PackLinear, Int4PackLinear, Fp8ScaledLinear]
    experts = [indexed_experts(_experts(f, Fh=64), 1) for f in FORMATS]
    module = _AllForms(forms, experts).to(torch.bfloat16)
    x, ids, gates = _routing(4, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = module(x, ids, gates)
        got = torch.compile(module, fullgraph=True, dynamic=False)(x, ids, gates)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2e-2)


# ---- the plan, the backend and the refusals -------------------------------------------------------
def test_the_plan_on_cuda_lays_out_the_quantized_forms():
    for fmt in ("int8", "int4"):
        cfg = preset("tiny", quantization=QuantSpec.parse(fmt).as_dict())
        plan = quantized_plan(cfg, "cuda", torch.bfloat16)
        assert plan.quant_ops and plan.gather_max == 1 and not plan.kernel_experts
        assert plan.reason.startswith("quantized weights on a GPU")
        if not torch.cuda.is_available():  # a CPU-only torch has no CUDA kernels: named, the reference runs
            assert "no CUDA kernel" in plan.reason
    assert not quantized_plan(preset("tiny", quantization={"bits": 8, "group": None}), "cpu", torch.float32).quant_ops
    with pytest.raises(Fp8Unavailable, match="fp8 .* GPU format"):
        quantized_plan(preset("tiny", quantization={"format": "fp8"}), "cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax"))
    return save_checkpoint(tmp_path_factory.mktemp("quant_gpu") / "tiny", model.cfg, model.state_dict())


PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A"]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-uniform"])
def test_an_engine_on_the_quantized_ops_is_the_reference_within_rounding(float_ckpt, fmt):
    """The plan a GPU gets (quant_ops), run on a CPU with the ops' CPU twins: each linear map laid out on its op where
    the shape fits (an int4 LM head's 259 outputs do not fit tinygemm's tiles: reference; int4 keeps wk, wv and the head
    at int8 by default), the experts indexed; the logits of the weight-only reference within bfloat16's rounding."""
    spec = QuantSpec(4, 32) if fmt == "int4-uniform" else QuantSpec.parse(fmt)
    plan = DispatchPlan(gather_max=1, quant_ops=True)
    engine = Engine.load(float_ckpt, dtype="bfloat16", device="cpu", quantize=spec, plan=plan)
    ref = Engine.load(float_ckpt, dtype="bfloat16", device="cpu", quantize=spec, plan=DispatchPlan(gather_max=0))
    attention, head = engine.model.layers[0].attention, engine.model.output
    assert type(attention.wq) is (Int8PackLinear if fmt == "int8" else Int4PackLinear)
    assert type(attention.wv) is (Int4PackLinear if fmt == "int4-uniform" else Int8PackLinear)
    assert type(head) is (QuantLinear if fmt == "int4-uniform" else Int8PackLinear)
    assert all(isinstance(layer.experts, IndexedQuantExperts) for layer in engine.model.moe_layers)
    ids = torch.tensor([engine.encode(p)[:8] for p in PROMPTS if len(engine.encode(p)) >= 8])
    got, want = engine.forward(ids), ref.forward(ids)
    assert (got - want).abs().max() <= 2**-6 * want.abs().max()
    params = SamplingParams(6, ignore_eos=True)
    assert all(len(c.token_ids) == 6 for c in engine.complete(PROMPTS, params))  # prompts and decode steps run


def test_an_int6_head_on_the_quantized_ops_is_laid_out_dequantized(tmp_path):
    """A model 128 wide, so its int4 recipe's head is int6 (quant.py): under the GPU's plan (CPU twins here) the head
    is DequantizedLinear, wk and wv int8pack, wq tinygemm; the logits of the weight-only reference within bfloat16's
    rounding, and the plain modules are put back by a new backend."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(preset("tiny", router="softmax"), d_model=128, n_heads=4, n_kv_heads=2))
    ckpt = save_checkpoint(tmp_path / "w128", model.cfg, model.state_dict())
    engine = Engine.load(ckpt, dtype="bfloat16", device="cpu", quantize="int4", plan=DispatchPlan(gather_max=1,
                                                                                                   quant_ops=True))
    ref = Engine.load(ckpt, dtype="bfloat16", device="cpu", quantize="int4", plan=DispatchPlan(gather_max=0))
    attention = engine.model.layers[0].attention
    assert type(engine.model.output) is DequantizedLinear and engine.model.output.spec == QuantSpec(6, 32)
    assert type(attention.wv) is Int8PackLinear and type(attention.wq) is Int4PackLinear
    ids = torch.tensor([engine.encode(p)[:8] for p in PROMPTS if len(engine.encode(p)) >= 8])
    got, want = engine.forward(ids), ref.forward(ids)
    assert (got - want).abs().max() <= 2**-6 * want.abs().max()
    plain_(engine.model)
    assert type(engine.model.output) is QuantLinear


def test_fp8_on_a_cpu_is_refused_by_name(float_ckpt):
    with pytest.raises(Fp8Unavailable, match="--quantize fp8: fp8 .e4m3. weights are a GPU format.*not on a CPU"):
        Engine.load(float_ckpt, dtype="float32", device="cpu", quantize="fp8")
    model = Transformer(preset("tiny"))
    with pytest.raises(Fp8Unavailable, match="use --quantize int8 or int4"):
        quantize_model_fp8_(model)
    assert model.cfg.quantization is None and type(model.layers[0].attention.wq) is torch.nn.Linear  # untouched


def test_the_cli_refuses_fp8_on_a_cpu_with_exit_2(float_ckpt):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a GPU machine runs this as a CPU one
    p = subprocess.run([sys.executable, "-m", "moeserve.cli", "generate", str(float_ckpt), "--quantize", "fp8",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    assert "moeserve generate: error: --quantize fp8: fp8 (e4m3) weights are a GPU format" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4"])
def test_a_compiled_step_on_a_cpu_runs_quantized_experts_indexed(float_ckpt, fmt):
    """The compiled backend lays quantized experts out indexed per token on any device (the reference's dispatch
    reads its counts on the host): the compiled step gives eager's greedy tokens (float32)."""
    why = compiled_mod.compile_unavailable(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    eager = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt, plan=DispatchPlan())
    fast = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt, plan=DispatchPlan(), compile="on")
    assert all(isinstance(layer.experts, IndexedQuantExperts) for layer in fast.model.moe_layers)
    params = SamplingParams(8, ignore_eos=True)
    rows = PROMPTS[:2]
    assert [c.token_ids for c in fast.complete(rows, params)] == [c.token_ids for c in eager.complete(rows, params)]
    assert fast.runner.graph_decode and fast.runner._decode is not None


# ---- on a GPU ------------------------------------------------------------------------------------
def _gpu_form_or_skip(fmt: str):
    dev = torch.device("cuda")
    why = quant_gpu.quantized_ops_unavailable(QuantSpec.parse(fmt).as_dict() if fmt != "fp8" else {"format": "fp8"},
                                              dev, torch.bfloat16)
    if why is not None:
        pytest.skip(why)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 64])
def test_each_cuda_form_is_the_reference_within_rounding(fmt, rows):
    """int8 on _weight_int8pack_mm (and the reference past its rows), int4 on tinygemm, fp8 on _scaled_mm: against
    QuantLinear's forward (the weight dequantized, cuBLAS in bfloat16) at a decode step's rows and a prompt's."""
    _gpu_form_or_skip(fmt)
    m = _linear(fmt, 1024, 2048, device="cuda")
    laid = linear_form(m, torch.bfloat16)
    assert type(laid) is {"int8": Int8PackLinear, "int4": Int4PackLinear, "fp8": Fp8ScaledLinear}[fmt]
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = laid(x).float(), m(x).float()
    tol = {"int8": 2**-7, "int4": 2**-6, "fp8": 2**-3}[fmt]  # fp8: the activations' e4m3 rounding
    assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()
    experts = _experts(fmt).cuda().to(torch.bfloat16)
    x, ids, gates = _routing(rows, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = indexed_experts(experts, 64)(x, ids, gates).float()
        want = experts(x, ids, gates).float()
    assert (got - want).abs().max() <= 2**-6 * want.abs().max()


@pytest.mark.cuda
def test_the_int6_cuda_form_is_the_reference_bit_for_bit(tmp_path):
    """An int6 weight on CUDA: dequantized once at lay-out (torch has no 6-bit kernel), cuBLAS on it, as the
    reference computes at every call; an int4 model 128 wide (its head int6) generates the reference's tokens."""
    _gpu_form_or_skip("int4")
    g = torch.Generator().manual_seed(0)
    m = QuantLinear.of((torch.randn(1024, 2048, generator=g) * 2048**-0.5).cuda(), QuantSpec(6, 32))
    laid = linear_form(m, torch.bfloat16)
    assert type(laid) is DequantizedLinear and laid.weight_OI.is_cuda
    x = torch.randn(5, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(laid(x), m(x))
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(preset("tiny", router="softmax"), d_model=128, n_heads=4, n_kv_heads=2))
    ckpt = save_checkpoint(tmp_path / "w128", model.cfg, model.state_dict())
    engine = Engine.load(ckpt, dtype="bfloat16", device="cuda", quantize="int4", compile="off")
    assert type(engine.model.output) is DequantizedLinear
    ref = _dequantized_reference(engine)
    params = SamplingParams(4, ignore_eos=True)
    assert [c.token_ids for c in engine.complete(PROMPTS, params)] == \
        [c.token_ids for c in ref.complete(PROMPTS, params)]


def _dequantized_reference(engine: Engine) -> Engine:
    """The bfloat16 engine on `engine`'s quantized weights and the reference forwards (a new backend puts the plain
    modules back before it lays a model out; this plan lays out nothing)."""
    return Engine.from_model(copy.deepcopy(engine.model), engine.tokenizer, dtype="bfloat16", device="cuda",
                             plan=DispatchPlan(gather_max=0))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_generation_on_cuda_is_the_dequantized_reference(float_ckpt, fmt):
    """--quantize int8|int4|fp8 on CUDA (bfloat16, eager): laid out on torch's quantized ops by the plan; the logits
    of the weight-only reference within the formats' rounding, and the greedy tokens of the first steps."""
    _gpu_form_or_skip(fmt)
    engine = Engine.load(float_ckpt, dtype="bfloat16", device="cuda", quantize=fmt, compile="off")
    assert engine.plan.quant_ops and engine.runner.name == "eager"
    assert type(engine.model.layers[0].attention.wq) in (Int8PackLinear, Int4PackLinear, Fp8ScaledLinear)
    ref = _dequantized_reference(engine)
    ids = torch.tensor([engine.encode(p)[:8] for p in PROMPTS if len(engine.encode(p)) >= 8], device="cuda")
    got, want = engine.forward(ids), ref.forward(ids)
    tol = 2**-3 if fmt == "fp8" else 2**-5
    assert (got - want).abs().max() <= tol * want.abs().max()
    if fmt != "fp8":  # fp8 quantizes the activations too: its tokens may part from the weight-only reference's
        params = SamplingParams(4, ignore_eos=True)
        assert [c.token_ids for c in engine.complete(PROMPTS, params)] == \
            [c.token_ids for c in ref.complete(PROMPTS, params)]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compiled_cuda_step_runs_the_quantized_forms_without_a_host_sync(float_ckpt, fmt):
    """compile on: the decode step traced over the quantized forms and replayed as CUDA graphs, under sync debug
    mode 'error'; its greedy tokens are eager's on the same forms (bfloat16: within a token or two of rounding, so
    the first steps are compared)."""
    _gpu_form_or_skip(fmt)
    why = compiled_mod.compile_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    eager = Engine.load(float_ckpt, dtype="bfloat16", device="cuda", quantize=fmt, compile="off")
    fast = Engine.load(float_ckpt, dtype="bfloat16", device="cuda", quantize=fmt, compile="on")
    params = SamplingParams(4, ignore_eos=True)
    want = [c.token_ids for c in eager.complete(PROMPTS[:2], params)]
    assert [c.token_ids for c in fast.complete(PROMPTS[:2], params)] == want
    runner, tok = fast.runner, fast.tokenizer
    cache = runner.new_cache(2, 32)
    rows = [tok.encode(t, bos=True) for t in ("def f(x):", "import")]
    with torch.inference_mode():
        for slot, r in enumerate(rows):
            runner.prefill(cache, slot, torch.tensor(r, device="cuda"), 0)
        ids = torch.tensor([7, 11], device="cuda")
        runner.decode(cache, [0, 1], ids, [len(r) for r in rows])  # builds and captures the graph
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(3):
                runner.decode(cache, [0, 1], ids, [len(r) + 1 + i for r in rows])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert runner.graph_decode and runner._decode is not None
