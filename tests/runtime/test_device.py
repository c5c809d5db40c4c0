"""The capability probes agree with what torch really does on this machine, and each side of every probe
is exercised on every machine: the side the CPU has for real, the other by forcing the probe.

Forcing a probe *off* is always safe (it only withholds a faster path). Forcing oneDNN bf16 packing *on*
is done only where the CPU really has it: elsewhere torch itself raises, which is what the probe is for.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

import moeserve.runtime.engine as engine_mod
from moeserve.cli import main as cli_main
from moeserve.runtime import device
from moeserve.runtime.engine import EngineError, resolve_dtype
from moeserve.runtime.backends.packing import PackingError, onednn_packing_available, pack_weight

X86_MKLDNN = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


def torch_accepts_bf16_packing() -> bool:
    """Ask torch itself: a tiny bf16 reorder either works or raises."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(16, 16).bfloat16(), 1)
    except RuntimeError as e:
        assert "bf16" in str(e), e  # the refusal the probe predicts, not some other failure
        return False
    return True


@pytest.mark.skipif(not X86_MKLDNN, reason="oneDNN weight packing exists only in x86 builds of torch with mkldnn")
def test_onednn_bf16_probe_agrees_with_torch():
    assert device.onednn_bf16_available() == torch_accepts_bf16_packing()
    assert onednn_packing_available("cpu", torch.bfloat16) == torch_accepts_bf16_packing()
    assert onednn_packing_available("cpu", torch.float32)  # fp32 packing needs no AVX512


def test_fast_bf16_probe_agrees_with_the_cpu_flags():
    """torch's answer includes the OS's consent (AMX needs the kernel to grant its tile state), so a CPU that
    lists amx_bf16 may still answer no; one that answers yes must list one of the two."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    if device.cpu_has_fast_bf16():
        assert "avx512_bf16" in flags or "amx_bf16" in flags
    else:
        assert "avx512_bf16" not in flags


def test_packing_follows_the_probe_when_forced_off(monkeypatch):
    monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    assert not onednn_packing_available("cpu", torch.bfloat16)
    with pytest.raises(PackingError, match=r"cannot pack bfloat16 weights .*\(pack=False\)"):
        pack_weight(torch.randn(8, 8).bfloat16())
    assert not onednn_packing_available("cpu", torch.float16)  # never packed
    assert not onednn_packing_available("meta", torch.float32)  # CPU only


@pytest.mark.skipif(not (X86_MKLDNN and torch_accepts_bf16_packing()),
                    reason="this CPU cannot pack bf16 weights (no AVX512 BW/VL/DQ, AVX-NE-CONVERT or AMX): the "
                           "packed bf16 path is forced on only where torch really runs it")
def test_packing_forced_on_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setattr(device, "onednn_bf16_available", lambda: True)
    w = torch.randn(32, 16).bfloat16()
    x = torch.randn(4, 16).bfloat16()
    from moeserve.runtime.backends.packing import packed_linear

    torch.testing.assert_close(packed_linear(x, pack_weight(w)).float(), (x.float() @ w.float().T), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_runs_every_dtype_on_this_cpu(dtype):
    """bf16 and fp16 run (slowly) on any CPU torch supports: nothing to refuse here."""
    assert device.dtype_unsupported("cpu", dtype) is None
    assert resolve_dtype(str(dtype).removeprefix("torch."), torch.device("cpu")) is dtype


def test_a_dtype_torch_cannot_run_is_a_named_error(monkeypatch, capsys):
    """Where torch cannot run a dtype (none such CPU here: simulated), loading says so and the CLI exits 2."""
    monkeypatch.setattr(engine_mod, "dtype_unsupported",
                        lambda dev, dt: "bf16 path needs the cpu support X" if dt is torch.bfloat16 else None)
    with pytest.raises(EngineError, match=r"dtype bfloat16 does not run on this cpu .*X\); use float32"):
        resolve_dtype("bfloat16", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)
    assert cli_main(["generate", "nowhere", "--dtype", "bfloat16", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "moeserve generate: error: dtype bfloat16 does not run on this cpu" in err and "Traceback" not in err


def test_machine_report_names_the_capabilities():
    m = device.machine()
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["onednn_bf16"] == device.onednn_bf16_available() and m["torch"] == torch.__version__
