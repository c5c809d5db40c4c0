"""Backends: one class per way of executing a model, chosen once when it is loaded (`backend_for`).

    eager        torch's kernels on the model's modules: the reference (eager.py), with the plan's torch layouts
    cpu-kernel   the parts the calibration put on the C kernel, and a decode step in one C call (cpu.py)
    compiled     plain weights, the decode step one torch.compile graph per batch bucket, CUDA graphs on a GPU
                 (compiled.py)
    onnx         an exported graph on ONNX Runtime (onnx.py; load_engine makes it from a .onnx path)

Each implements the calls of base.ModelRunner and owns its weight layout (layout.py: inference forms of the
model's modules, put in place once); the model's modules stay plain math. A new way of running a model (a
quantized one, another GPU step) is a new class here.
"""

from __future__ import annotations

from moeserve.runtime.backends.base import ModelRunner, TorchBackend
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.compiled import CompiledBackend
from moeserve.runtime.backends.cpu import CpuKernelBackend
from moeserve.runtime.backends.eager import EagerBackend
from moeserve.runtime.model import Transformer

__all__ = ["CompiledBackend", "CpuKernelBackend", "EagerBackend", "ModelRunner", "TorchBackend", "backend_for"]


def backend_for(model: Transformer, plan: DispatchPlan, compiled: bool = False, fallback: bool = False) -> TorchBackend:
    """The backend that runs `model` as `plan` says (calibration.py), laid out now: compiled where asked for, the CPU
    kernel where the plan puts any part there, else eager. `fallback`: a compiled step that fails goes eager."""
    if compiled:
        return CompiledBackend(model, plan, fallback)
    if plan.kernel_experts or plan.kernel_dense or plan.kernel_norms:
        return CpuKernelBackend(model, plan)
    return EagerBackend(model, plan)
