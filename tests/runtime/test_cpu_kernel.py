"""The C GEMM of cpu_kernel.py, and its MoE layer in one call: x @ w^T to fp32 tolerance at every row count and shape it branches on
(1-8 rows in one pass, more in L2 blocks; tails of I; thread splits; strided and unaligned operands);
a row's output bit for bit the same whatever rows share the call; the probe's both sides (built here,
and off or without a compiler: named reasons, torch's kernels instead); and a model laid out on it
gives the plain model's logits and tokens, alone and in a batch."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.calibration import ExpertShape, calibrate, choose
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.cpu import FusedExperts, KernelLinear
from moeserve.runtime.backends.cpu_kernel import KernelError
from moeserve.runtime.engine import Engine
from moeserve.runtime.experts import moe_reference
from moeserve.runtime.backends.experts import fuse_expert_weights, moe_gather, moe_grouped
from moeserve.tokenizer import ByteTokenizer

from .test_engine import PROMPTS, make_engine

requires_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                     reason=f"the C kernel is not built here: {cpu_kernel.unavailable_reason()}")

ROWS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 40)  # every one-pass row count, the blocked path and its tails


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's (and so the kernel's) thread count set to n for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@requires_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("O,I", [(1, 8), (13, 37), (50, 64), (97, 200)])
@pytest.mark.parametrize("n", ROWS)
def test_equals_a_double_precision_matmul(n, O, I, threads):
    """Tolerance: fp32 sums of I products of N(0, 1) terms, |y| ~ sqrt(I) <= 15; error ~ I * 2^-24 * |y|."""
    g = torch.Generator().manual_seed(n * 1000 + O)
    x, w = torch.randn(n, I, generator=g), torch.randn(O, I, generator=g)
    with torch_threads(threads):
        y = cpu_kernel.linear(x, w)
    assert y.shape == (n, O) and y.dtype == torch.float32
    torch.testing.assert_close(y, exact(x, w), atol=2e-5 * I**0.5, rtol=0)


@requires_kernel
def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: row j alone, in every batch size of the one-pass path and the blocked one, at 1 and
    2 threads (the property that keeps a sequence's logits independent of its batch)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 203, generator=g), torch.randn(91, 203, generator=g)
    alone = torch.cat([cpu_kernel.linear(x[j:j + 1], w) for j in range(40)])
    for n in (2, 3, 5, 8, 9, 17, 40):
        assert torch.equal(cpu_kernel.linear(x[:n], w), alone[:n]), n
        assert torch.equal(cpu_kernel.linear(x[n - 1:2 * n - 1], w), alone[n - 1:2 * n - 1]), n
    with torch_threads(1):
        assert torch.equal(cpu_kernel.linear(x, w), alone)


@requires_kernel
def test_strided_unaligned_and_batched_operands():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 30, 41, generator=g)
    x = wide[0, :5, 1:33]  # rows 41 floats apart, starting one float in: unaligned
    stacked = torch.randn(4, 24, 33, generator=g)
    w = stacked.view(-1)[1:1 + 24 * 32].view(24, 32)  # unaligned start, like a weight mapped from a file
    rows = stacked[2, :, :32]  # row stride 33
    torch.testing.assert_close(cpu_kernel.linear(x, w), exact(x, w), atol=1e-4, rtol=0)
    torch.testing.assert_close(cpu_kernel.linear(x, rows), exact(x, rows), atol=1e-4, rtol=0)
    x3 = torch.randn(2, 3, 32, generator=g)  # leading dims, as a linear layer gets [B, S, D]
    torch.testing.assert_close(cpu_kernel.linear(x3, w), exact(x3.reshape(6, 32), w).view(2, 3, 24), atol=1e-4, rtol=0)
    torch.testing.assert_close(cpu_kernel.linear(x.T.contiguous().T, w), exact(x, w), atol=1e-4, rtol=0)


@requires_kernel
def test_what_it_cannot_take_is_named():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(KernelError, match="float32 or bfloat16 CPU tensors of one dtype"):
        cpu_kernel.linear(x.half(), w.half())
    with pytest.raises(KernelError, match=r"shapes do not match: x \[2, 16\] and w \[8, 15\]"):
        cpu_kernel.linear(x, w[:, :15].contiguous())
    with pytest.raises(KernelError, match="contiguous rows"):
        cpu_kernel.linear(x, torch.randn(16, 8).T)


def _probe(env: dict[str, str], code: str) -> str:
    """Run `code` in a fresh process (the probe is cached per process) with `env` added."""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


PROBE = """
import torch
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.calibration import calibrate, ExpertShape
print(cpu_kernel.available(), cpu_kernel.unavailable_reason(), sep=" | ")
plan = calibrate(ExpertShape(16, 24, 4, 2, "swiglu"), torch.float32, max_s=0.5)
print(plan.kernel_experts, plan.kernel_dense or plan.kernel_norms, sorted(plan.timings),
      plan.reason.split("not candidates: ")[-1], sep=" | ")
"""


@pytest.mark.parametrize("env,why", [({"MOESERVE_CPU_KERNEL": "off"}, "$MOESERVE_CPU_KERNEL=off"),
                                     ({"MOESERVE_CPU_KERNEL": "", "CC": "/no/such/cc"}, "no C compiler ('/no/such/cc' not found; set $CC)")],
                         ids=["off", "no-compiler"])
def test_without_the_kernel_calibration_keeps_torchs_kernels_and_says_why(tmp_path, env, why):
    out = _probe({**env, "MOESERVE_CACHE": str(tmp_path)}, PROBE).splitlines()
    assert out[0] == f"False | {why}"
    kernel_experts, kernel_dense, names, skipped = out[1].split(" | ")
    assert (kernel_experts, kernel_dense) == ("False", "False")
    assert "kernel" not in names and f"kernel: {why}" in skipped
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").glob("*.so"))


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None or os.environ.get(cpu_kernel.ENV) == "off",
                    reason="no C compiler, or $MOESERVE_CPU_KERNEL=off: the kernel is not asked to build")
def test_the_kernel_builds_wherever_a_compiler_is_present():
    """About 45 tests skip where the kernel is not available; where a compiler is present, that would hide a
    kernel that fails to build or to pass its self-check behind a green run, so it fails here instead."""
    assert cpu_kernel.available(), f"the C kernel did not build here: {cpu_kernel.unavailable_reason()}"


@requires_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_and_a_cached_build(tmp_path):
    """The library's OpenMP is the libgomp torch loaded (one thread pool); a second process loads the
    cached library without compiling (no compiler on its PATH)."""
    code = """
import torch
from moeserve.runtime.backends import cpu_kernel
assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
maps = open("/proc/self/maps").read().splitlines()
print(len({l.split()[-1] for l in maps if "libgomp" in l}), len({l.split()[-1] for l in maps if "/kernels-" in l}))
"""
    assert _probe({"MOESERVE_CACHE": str(tmp_path)}, code) == "1 1"
    built = list((tmp_path / "kernels").glob("kernels-*.so"))
    assert len(built) == 1
    cc = os.environ.get("CC") or "cc"
    (tmp_path / "version").write_text(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout)
    # The same compiler version and CPU, so the same cache key; a "compiler" that fails whenever it is asked
    # to build shows that the second process builds nothing.
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec cat {tmp_path / "version"}\nexit 1\n')
    fake.chmod(0o755)
    assert _probe({"MOESERVE_CACHE": str(tmp_path), "CC": str(fake)}, code) == "1 1"
    (tmp_path / "version").write_text("another compiler 1.0\n")  # a new key: it must build, and cannot
    assert _probe({"MOESERVE_CACHE": str(tmp_path), "CC": str(fake)}, code.replace("assert cpu_kernel", "#")) == "1 0"


# ---- the layouts built on it ---------------------------------------------------------------------
@requires_kernel
@pytest.mark.parametrize("T", [1, 2, 7, 64, 513])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("fn", [moe_gather, moe_grouped], ids=["gather", "grouped"])
def test_expert_paths_on_the_kernel_equal_the_reference(fn, act, T):
    g = torch.Generator().manual_seed(T)
    E, D, Fh, K = 8, 32, 48, 2
    w1, w2 = torch.randn(E, Fh, D, generator=g) / D**0.5, torch.randn(E, D, Fh, generator=g) / Fh**0.5
    w3 = torch.randn(E, Fh, D, generator=g) / D**0.5 if act == "swiglu" else None
    x = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :K]
    gates = torch.rand(T, K, generator=g) + 0.1
    w = fuse_expert_weights(w1, w2, w3, act, pack=False, kernel=True)
    assert w.kernel and not w.packed and w.fused is not None  # the layer's experts in one call
    with torch.no_grad():
        torch.testing.assert_close(fn(x, ids, gates, w), moe_reference(x, ids, gates, w1, w2, w3), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not with pack, grouped_mm or sync_free"):
        fuse_expert_weights(w1, w2, w3, act, pack=True, kernel=True)


@requires_kernel
def test_the_kernel_runs_the_experts_where_they_lie(monkeypatch):
    """No [w1; w3] copy (1.2 s of a 644M model's start): the kernel reads the parameters' own memory."""
    E, D, Fh = 4, 16, 24
    w1, w2, w3 = torch.randn(E, Fh, D), torch.randn(E, D, Fh), torch.randn(E, Fh, D)
    w = fuse_expert_weights(w1, w2, w3, "swiglu", pack=False, kernel=True)
    assert w.w13 == [] and w.w13_EFD is None
    assert [t.data_ptr() for t in (w.fused.w1, w.fused.w2, w.fused.w3)] == [t.data_ptr() for t in (w1, w2, w3)]
    w13 = torch.randn(E, 2 * Fh, D)  # a Mixtral import: w1 and w3 the halves of one tensor, neither contiguous
    w = fuse_expert_weights(w13[:, :Fh], w2, w13[:, Fh:], "swiglu", pack=False, kernel=True)
    assert w.fused.w3.data_ptr() == w13[0, Fh:].data_ptr() and w.fused.w3.stride(0) == 2 * Fh * D
    x, ids, gates = torch.randn(5, D), torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1], [0, 2]]), torch.rand(5, 2)
    want = moe_reference(x, ids, gates, w13[:, :Fh], w2, w13[:, Fh:])
    torch.testing.assert_close(moe_grouped(x, ids, gates, w), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(KernelError, match=r"expert w3 of shape \(4, 24, 15\): expected \(4, 24, 16\)"):
        cpu_kernel.KernelExperts(w1, w2, torch.randn(E, Fh, 15))
    with pytest.raises(KernelError, match="contiguous rows"):
        cpu_kernel.KernelExperts(w1.transpose(1, 2).contiguous().transpose(1, 2), w2)
    with pytest.raises(KernelError, match=r"5 rows and expert counts \[2, 2, 2, 2\] do not match"):
        w.fused(x, torch.tensor([2, 2, 2, 2]))
    with pytest.raises(KernelError, match=r"float32 rows of 16, not torch.float32 rows of 15"):  # it would read past x
        w.fused(torch.randn(5, 15), torch.tensor([2, 1, 1, 1]))
    with pytest.raises(KernelError, match=r"float32 rows of 16, not torch.bfloat16 rows of 16"):
        w.fused(x.bfloat16(), torch.tensor([2, 1, 1, 1]))
    monkeypatch.setenv(cpu_kernel.ENV, "off")  # built, but switched off: the layer is refused by name
    with pytest.raises(KernelError, match=r"not available: \$MOESERVE_CPU_KERNEL=off"):
        fuse_expert_weights(w1, w2, w3, "swiglu", pack=False, kernel=True)


def routed_in_torch(k: cpu_kernel.KernelExperts, x_TD, ids_TK, gates_TK):
    """The torch operations KernelExperts.moe replaced around the experts call (sort, bincount, gather, gated
    scatter-add): what it must equal bit for bit."""
    T, K = ids_TK.shape
    order = ids_TK.reshape(-1).argsort(stable=True)
    y_ND = k(x_TD[order // K], torch.bincount(ids_TK.reshape(-1), minlength=k.w1.shape[0]))
    gates_N = gates_TK.reshape(-1)[order].to(y_ND.dtype)
    return torch.zeros_like(x_TD).index_add_(0, order // K, y_ND * gates_N[:, None])


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("T,K,E", [(1, 2, 8), (5, 2, 8), (16, 3, 6), (40, 1, 4), (3, 4, 4), (70, 2, 8), (6, 4, 2)])
def test_the_routed_experts_call_is_the_torch_operations_it_replaced(T, K, E, act, dtype):
    g = torch.Generator().manual_seed(T * 10 + K)
    D, Fh = 40, 72
    w1, w2 = torch.randn(E, Fh, D, generator=g).to(dtype), torch.randn(E, D, Fh, generator=g).to(dtype)
    k = cpu_kernel.KernelExperts(w1, w2, torch.randn(E, Fh, D, generator=g).to(dtype) if act == "swiglu" else None)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if K <= E else (
        torch.randint(0, E, (T, K), generator=g))  # a token's expert more than once: the order of its sum matters
    gates = torch.rand(T, K, generator=g).to(dtype)
    y = k.moe(x, ids, gates)
    assert y.dtype == dtype and torch.equal(y, routed_in_torch(k, x, ids, gates))
    if dtype == torch.float32 and act == "swiglu":
        torch.testing.assert_close(y, moe_reference(x, ids, gates, k.w1, k.w2, k.w3), atol=1e-3, rtol=1e-4)


@requires_kernel
def test_the_routed_experts_call_refuses_what_it_would_misread():
    E, D, Fh = 4, 16, 24
    k = cpu_kernel.KernelExperts(torch.randn(E, Fh, D), torch.randn(E, D, Fh), torch.randn(E, Fh, D))
    x, gates = torch.randn(2, D), torch.rand(2, 2)
    for bad in ([[0, 4], [1, 2]], [[0, 1], [-1, 2]]):  # it would read an expert past the stack
        with pytest.raises(KernelError, match=r"expert ids outside \[0, 4\)"):
            k.moe(x, torch.tensor(bad), gates)
    with pytest.raises(KernelError, match=r"gates \[2, 1\] for ids \[2, 2\]"):
        k.moe(x, torch.tensor([[0, 1], [1, 2]]), gates[:, :1])
    with pytest.raises(KernelError, match=r"float32 rows of 16 and \[T, K\] ids, not torch.float32 \[2, 15\]"):
        k.moe(torch.randn(2, 15), torch.tensor([[0, 1], [1, 2]]), gates)
    assert k.moe(x, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), gates).shape == (2, D)  # ids widened


KERNEL_PLAN = DispatchPlan(kernel_experts=True, kernel_dense=True, kernel_norms=True, gather_max=1)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """The same tiny model twice: torch's plain GEMMs, and every linear map on the kernel."""
    return make_engine("softmax"), Engine.from_model(make_engine("softmax").model, ByteTokenizer(), plan=KERNEL_PLAN)


@requires_kernel
def test_a_model_on_the_kernel_gives_the_plain_models_logits_and_tokens(engines):
    plain, kern = engines
    assert {type(m) for m in kern.model.modules()} >= {KernelLinear} and isinstance(kern.model.output, KernelLinear)
    assert all(isinstance(layer.experts, FusedExperts) for layer in kern.model.moe_layers)
    assert "experts plain, C kernel" in kern.plan.describe() and "dense layers C kernel" in kern.plan.describe()
    ids = torch.tensor([plain.encode("def f(x):\n    return x")])
    with torch.no_grad():
        torch.testing.assert_close(kern.model(ids).logits, plain.model(ids).logits, atol=1e-4, rtol=0)
    assert kern.generate(PROMPTS, max_new_tokens=16) == plain.generate(PROMPTS, max_new_tokens=16)


@requires_kernel
def test_past_the_kernels_limits_the_same_weights_run_torchs_gemms(engines, monkeypatch):
    """kernel_max_tokens / dense_kernel_max_tokens: a call of more tokens runs torch's GEMMs on the weights the
    kernel reads (no copy), a call of as many or fewer the kernel; the logits are the kernel's within 1e-4."""
    plain, kern = engines
    limited = Engine.from_model(make_engine("softmax").model, ByteTokenizer(),
                                plan=dataclasses.replace(KERNEL_PLAN, kernel_max_tokens=4, dense_kernel_max_tokens=4))
    assert "torch GEMMs past 4 tokens (experts), 4 (dense)" in limited.plan.describe()
    calls = {"moe": 0, "linear": 0}
    moe, linear = cpu_kernel.KernelExperts.moe, cpu_kernel.linear
    monkeypatch.setattr(cpu_kernel.KernelExperts, "moe", lambda *a: calls.__setitem__("moe", calls["moe"] + 1) or moe(*a))
    monkeypatch.setattr(cpu_kernel, "linear", lambda *a: calls.__setitem__("linear", calls["linear"] + 1) or linear(*a))
    for n_tokens, on_kernel in ((4, True), (9, False)):
        ids = torch.tensor([plain.encode("def f(x):\n    return x")[:n_tokens]])
        calls.update(moe=0, linear=0)
        with torch.inference_mode():
            got = limited.model(ids).logits
        assert (calls["moe"] > 0, calls["linear"] > 0) == (on_kernel, on_kernel), (n_tokens, calls)
        with torch.inference_mode():
            torch.testing.assert_close(got, kern.model(ids).logits, atol=1e-4, rtol=0)


def test_float32_gemms_on_upcast_bf16_weights_are_the_float32_reference_rounded_once():
    """moe_sorted_fp32 and KernelLinear(upcast) past its rows: the bf16 weights and rows upcast exactly, so each
    result is the float32 computation on them, cast to bf16 (per expert, before the gated sum)."""
    from moeserve.runtime.backends.experts import moe_sorted_fp32

    g = torch.Generator().manual_seed(0)
    E, D, Fh, T = 4, 32, 48, 40
    w1, w2, w3 = (torch.randn(*dims, generator=g).mul(0.2).bfloat16() for dims in ((E, Fh, D), (E, D, Fh), (E, Fh, D)))
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :2]
    gates = torch.rand(T, 2, generator=g).bfloat16()
    got = moe_sorted_fp32(x, ids, gates, w1, w2, w3)
    want = moe_reference(x.float(), ids, gates.float(), w1.float(), w2.float(), w3.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert (got.float() - want).abs().max() < (moe_reference(x, ids, gates, w1, w2, w3).float() - want).abs().max() * 2
    lin = torch.nn.Linear(D, Fh, bias=False).bfloat16()
    k = KernelLinear.of(lin, weight=lin.weight, max_rows=0, upcast=True)
    with torch.no_grad():
        y = k(x)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, F.linear(x.float(), lin.weight.float()).bfloat16())


@requires_kernel
def test_on_the_kernel_a_prompts_tokens_are_the_same_alone_and_in_a_batch(engines):
    _, kern = engines
    alone = [kern.generate([p], max_new_tokens=20)[0] for p in PROMPTS]
    assert kern.generate(PROMPTS, max_new_tokens=20) == alone


def test_a_kernel_linear_keeps_its_weight_and_gives_back_a_plain_linear_that_trains():
    lin = torch.nn.Linear(16, 8, bias=False)
    k = KernelLinear.of(lin, weight=lin.weight, max_rows=None)
    assert list(k.state_dict()) == ["weight"] and k.weight is lin.weight
    x = torch.randn(3, 16, requires_grad=True)
    if cpu_kernel.available():
        with torch.no_grad():
            torch.testing.assert_close(k(x), F.linear(x, lin.weight), atol=1e-5, rtol=0)
    back = k.plain()
    assert type(back) is torch.nn.Linear and back.weight is lin.weight and not hasattr(back, "max_rows")
    back(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_choose_runs_dense_layers_on_the_kernel_only_when_it_is_faster():
    counts = {1: 1.0, 2: 2.0}
    base = {"gather/plain": counts, "grouped/plain": counts, "linear/plain": {1: 1.0, 16: 2.0}}
    fast = choose({**base, "linear/packed": {1: 0.9, 16: 1.8}, "linear/kernel": {1: 0.5, 16: 1.0}})
    assert fast.kernel_dense and not fast.pack_dense and "kernel/plain time 0.50x" in fast.reason
    slow = choose({**base, "linear/packed": {1: 0.9, 16: 1.8}, "linear/kernel": {1: 1.5, 16: 3.0}})
    assert slow.pack_dense and not slow.kernel_dense
    tie = choose({**base, "linear/packed": {1: 0.5, 16: 1.0}, "linear/kernel": {1: 0.495, 16: 0.99}})
    assert tie.pack_dense and not tie.kernel_dense  # within 2%: the torch-native layout
    experts = choose({**base, "gather/kernel": {1: 0.5, 2: 1.0}, "grouped/kernel": {1: 0.6, 2: 0.9}})
    assert experts.kernel_experts and not experts.pack_experts and experts.gather_max == 1
    # norms and decode attention go on the kernel wherever it ran, whichever layout the GEMMs took
    assert fast.kernel_norms and slow.kernel_norms and tie.kernel_norms and experts.kernel_norms
    assert "norms and decode attention on the C kernel" in slow.reason
    assert not choose({**base, "linear/packed": {1: 0.9, 16: 1.8}}).kernel_norms


@requires_kernel
def test_calibration_times_the_kernel_where_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    plan = calibrate(ExpertShape(16, 24, 4, 2, "swiglu"), torch.float32, max_s=0.5)
    assert {"gather/kernel", "grouped/kernel", "linear/kernel"} <= set(plan.timings)
    assert "not candidates: kernel" not in plan.reason
    half = calibrate(ExpertShape(16, 24, 4, 2, "swiglu"), torch.float16, max_s=0.5)
    assert "gather/kernel" not in half.timings and "kernel: float32 and bfloat16 only, not float16" in half.reason


def test_a_kernel_plan_where_the_kernel_is_off_is_refused_by_name(tmp_path):
    code = """
import torch
from moeserve.config import preset
from moeserve.runtime.backends import backend_for
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.cpu_kernel import KernelError
from moeserve.runtime.model import Transformer
for plan in (DispatchPlan(kernel_dense=True), DispatchPlan(kernel_norms=True)):
    try:
        backend_for(Transformer(preset("tiny", router="softmax")), plan)
    except KernelError as e:
        print(e)
"""
    out = _probe({"MOESERVE_CPU_KERNEL": "off", "MOESERVE_CACHE": str(tmp_path)}, code).splitlines()
    assert out == ["the plan runs dense layers on the CPU kernel, which is not available here: $MOESERVE_CPU_KERNEL=off",
                   "the plan runs norms and decode attention on the CPU kernel, which is not available here: "
                   "$MOESERVE_CPU_KERNEL=off"]


@requires_kernel
def test_a_cached_calibration_is_keyed_by_the_built_kernel(monkeypatch):
    """A new kernel (source, compiler, flags, CPU: the library's name) is measured again, not read from a plan
    measured with the old one."""
    from moeserve.runtime.backends.calibration import calibration_key

    shape = ExpertShape(16, 24, 4, 2, "swiglu")
    built = calibration_key(shape, torch.float32)["kernel"]
    assert built == cpu_kernel.identity() and built.startswith("kernels-") and built.endswith(".so")
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    assert calibration_key(shape, torch.float32)["kernel"] is None


# ---- RMSNorm ---------------------------------------------------------------------------------
@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 7, 8, 37, 512])
def test_rms_norm_equals_torchs(D, dtype):
    """fp32: to float rounding; bf16: within one bf16 step (the kernel rounds once, torch twice)."""
    g = torch.Generator().manual_seed(D)
    x, w = (torch.randn(3, 5, D, generator=g) * 3).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)
    got, want = cpu_kernel.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (D,), w.float(), 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(cpu_kernel.rms_norm(x.transpose(0, 1), w, 1e-5).float(), want.transpose(0, 1), **tol)
    alone = torch.stack([cpu_kernel.rms_norm(x[:, j], w, 1e-5) for j in range(5)], dim=1)
    assert torch.equal(alone, got)  # a row's result does not depend on the rows beside it


@requires_kernel
def test_the_model_runs_its_norms_on_the_kernel_where_the_plan_says(monkeypatch):
    from moeserve.config import preset
    from moeserve.runtime.backends import backend_for
    from moeserve.runtime.backends.cpu import KernelAttention, KernelRMSNorm
    from moeserve.runtime.model import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="softmax")).eval()
    n_norms = 2 * model.cfg.n_layers + 1
    assert sum(type(m) is torch.nn.RMSNorm for m in model.modules()) == n_norms  # plain: torch's norm
    backend_for(model, KERNEL_PLAN)
    norms = [m for m in model.modules() if isinstance(m, KernelRMSNorm)]
    assert len(norms) == n_norms and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    x = torch.randn(2, 3, model.cfg.d_model)
    norm, calls = norms[0], []
    kernel_rms_norm = cpu_kernel.rms_norm
    monkeypatch.setattr(cpu_kernel, "rms_norm", lambda *a: calls.append(1) or kernel_rms_norm(*a))
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps))
    assert calls == [1]
    monkeypatch.undo()
    backend_for(model, DispatchPlan())
    assert not any(isinstance(m, KernelRMSNorm) for m in model.modules())
    backend_for(model, DispatchPlan(kernel_norms=True))  # dense layers plain, norms on the kernel
    assert sum(isinstance(m, KernelRMSNorm) for m in model.modules()) == n_norms
    assert all(isinstance(layer.attention, KernelAttention) for layer in model.layers)
    assert not any(isinstance(m, KernelLinear) for m in model.modules())
    with pytest.raises(KernelError, match="a weight of their width"):
        cpu_kernel.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
