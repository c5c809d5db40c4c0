"""The C kernel in bfloat16: x @ w^T to bf16 rounding of the exact product at every row count it branches on; a
row's output bit for bit the same whatever rows share the call; both sides of its probe (AVX512-BF16 dot
products where the CPU has them, bf16 widened to float32 elsewhere: the second built here with
-mno-avx512bf16), each against the exact product; a layer's experts in one call against the float32
reference; a bf16 model on the kernel against torch's bf16 model, and its tokens alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.cpu import FusedExperts, KernelLinear
from moeserve.runtime.backends.calibration import ExpertShape, calibrate
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.cpu_kernel import KernelError
from moeserve.runtime.device import cpu_flags
from moeserve.runtime.engine import Engine
from moeserve.runtime.experts import moe_reference
from moeserve.runtime.backends.experts import fuse_expert_weights, moe_grouped
from moeserve.tokenizer import ByteTokenizer

from .test_cpu_kernel import KERNEL_PLAN, ROWS, _probe, requires_kernel, torch_threads
from .test_engine import PROMPTS, make_engine

BF16 = torch.bfloat16


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def assert_rounded(y: torch.Tensor, want: torch.Tensor, I: int) -> None:
    """y is bf16: within half a bf16 step of the exact value (2^-9 relative), plus float32 summation error."""
    assert y.dtype == BF16
    torch.testing.assert_close(y.double(), want, rtol=2**-8, atol=1e-5 * I**0.5)


@requires_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("O,I", [(1, 8), (13, 37), (50, 64), (97, 200)])
@pytest.mark.parametrize("n", ROWS)
def test_equals_the_exact_product_to_bf16_rounding(n, O, I, threads):
    g = torch.Generator().manual_seed(n * 1000 + O)
    x, w = torch.randn(n, I, generator=g).to(BF16), torch.randn(O, I, generator=g).to(BF16)
    with torch_threads(threads):
        y = cpu_kernel.linear(x, w)
    assert y.shape == (n, O)
    assert_rounded(y, exact(x, w), I)


@requires_kernel
def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 203, generator=g).to(BF16), torch.randn(91, 203, generator=g).to(BF16)
    alone = torch.cat([cpu_kernel.linear(x[j:j + 1], w) for j in range(40)])
    for n in (2, 3, 5, 8, 9, 17, 40):
        assert torch.equal(cpu_kernel.linear(x[:n], w), alone[:n]), n
        assert torch.equal(cpu_kernel.linear(x[n - 1:2 * n - 1], w), alone[n - 1:2 * n - 1]), n


@requires_kernel
def test_dtypes_it_cannot_take_are_named():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(KernelError, match="float32 or bfloat16 CPU tensors of one dtype, not torch.float16"):
        cpu_kernel.linear(x.half(), w.half())
    with pytest.raises(KernelError, match="of one dtype, not torch.bfloat16 x torch.float32"):
        cpu_kernel.linear(x.to(BF16), w)
    assert cpu_kernel.unavailable_for(torch.float16) == "float32 and bfloat16 only, not float16"
    assert cpu_kernel.unavailable_for(BF16) is None
    with pytest.raises(KernelError, match="one dtype"):
        cpu_kernel.KernelExperts(torch.randn(2, 4, 8).to(BF16), torch.randn(2, 8, 4))


BOTH_SIDES = """
import torch
from moeserve.runtime.backends import cpu_kernel
g = torch.Generator().manual_seed(0)
x, w = torch.randn(11, 301, generator=g).bfloat16(), torch.randn(67, 301, generator=g).bfloat16()
want = x.double() @ w.double().T
y = cpu_kernel.linear(x, w).double()
ok = torch.allclose(y, want, rtol=2**-8, atol=1e-5 * 301**0.5)
alone = torch.equal(cpu_kernel.linear(x[3:4], w).double(), y[3:4])
print(cpu_kernel.bf16_native(), ok, alone)
"""


@requires_kernel
def test_both_sides_of_the_avx512_bf16_probe(tmp_path):
    """-march=native takes AVX512-BF16 where the CPU has it; -mno-avx512bf16 builds the widening path on the
    same CPU. Each is checked against the exact product, in a fresh process and cache."""
    has = "avx512_bf16" in cpu_flags()
    native = _probe({"MOESERVE_CACHE": str(tmp_path / "native")}, BOTH_SIDES)
    assert native == f"{has} True True"
    widened = _probe({"MOESERVE_CACHE": str(tmp_path / "widened"), cpu_kernel.CFLAGS_ENV: "-mno-avx512bf16"},
                     BOTH_SIDES)
    assert widened == "False True True"


@requires_kernel
@pytest.mark.parametrize("T", [1, 2, 7, 64])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_a_layers_experts_in_one_call_equal_the_reference(act, T):
    """bf16 weights and rows against the float32 reference on the same (bf16-valued) numbers: the kernel
    rounds the activation and the output once each."""
    g = torch.Generator().manual_seed(T)
    E, D, Fh, K = 8, 64, 96, 2
    w1, w2 = torch.randn(E, Fh, D, generator=g) / D**0.5, torch.randn(E, D, Fh, generator=g) / Fh**0.5
    w3 = torch.randn(E, Fh, D, generator=g) / D**0.5 if act == "swiglu" else None
    w1, w2, w3 = (None if t is None else t.to(BF16) for t in (w1, w2, w3))
    x = torch.randn(T, D, generator=g).to(BF16)
    ids = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :K]
    gates = (torch.rand(T, K, generator=g) + 0.1).to(BF16)
    w = fuse_expert_weights(w1, w2, w3, act, pack=False, kernel=True)
    assert w.fused is not None and w.fused.dtype == BF16
    f32 = [None if t is None else t.float() for t in (w1, w2, w3)]
    with torch.no_grad():
        got = moe_grouped(x, ids, gates, w)
        want = moe_reference(x.float(), ids, gates.float(), *f32)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def bf16_engines() -> tuple[Engine, Engine]:
    """The same tiny model in bf16 twice: torch's plain GEMMs, and every linear map on the kernel."""
    model = make_engine("softmax").model
    plain = Engine.from_model(model, ByteTokenizer(), dtype="bfloat16", plan=DispatchPlan())
    return plain, Engine.from_model(make_engine("softmax").model, ByteTokenizer(), dtype="bfloat16", plan=KERNEL_PLAN)


@requires_kernel
def test_a_bf16_model_on_the_kernel_is_torchs_bf16_model_to_rounding(bf16_engines):
    plain, kern = bf16_engines
    assert all(isinstance(layer.experts, FusedExperts) for layer in kern.model.moe_layers)
    assert isinstance(kern.model.output, KernelLinear)
    ids = torch.tensor([plain.encode("def f(x):\n    return x")])
    with torch.no_grad():
        a, b = kern.model(ids).logits.float(), plain.model(ids).logits.float()
    # bf16 rounds every layer's output (2^-8 relative): logits of this model differ by a few such steps
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


@requires_kernel
def test_in_bf16_a_prompts_tokens_are_the_same_alone_and_in_a_batch(bf16_engines):
    _, kern = bf16_engines
    alone = [kern.generate([p], max_new_tokens=20)[0] for p in PROMPTS]
    assert kern.generate(PROMPTS, max_new_tokens=20) == alone


@requires_kernel
def test_calibration_times_the_kernel_in_bf16(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    plan = calibrate(ExpertShape(16, 24, 4, 2, "swiglu"), BF16, max_s=0.5)
    assert {"gather/kernel", "grouped/kernel", "linear/kernel"} <= set(plan.timings)
    assert "not candidates: kernel" not in plan.reason
