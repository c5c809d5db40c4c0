"""The plan a backend lays a model out by (backends/: which weights are packed, which run on the C kernel, which
path an MoE layer's tokens take at each count), and the plans made without measuring: `default_plan`, and a
quantized model's `quantized_plan`. calibration.py measures this machine to choose one."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.config import MoEConfig
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.packing import onednn_packing_available
from moeserve.runtime.backends.quant_gpu import describe_forms, quantized_ops_unavailable
from moeserve.runtime.quant_fp8 import check_fp8, is_fp8_config

__all__ = ["DispatchPlan", "QUANT_GATHER_MAX", "default_plan", "quantized_plan"]

# A quantized model on a GPU: up to this many tokens its experts are indexed per token (quant_gpu.py), each
# assignment's expert dequantized: what one decode row reads anyway, as the float default's gather_max of 1
QUANT_GATHER_MAX = 1


@dataclass
class DispatchPlan:
    """The choices the model's inference layout is built from (backends/: a backend lays the model out by it)."""

    pack_dense: bool = False  # attention, dense FFN and tied LM-head weights oneDNN-packed
    pack_experts: bool = False  # expert weights oneDNN-packed
    grouped_mm: bool = False  # many tokens: one grouped_mm call instead of a loop over the experts
    gather_max: int = 1  # at most this many tokens: the gather path
    source: str = "default"  # default (not measured), measured (now), cached (measured before, on this machine)
    reason: str = ""  # the measurements that decided, in words
    timings: dict[str, dict[int, float]] = field(default_factory=dict, repr=False)  # ms per candidate per count
    kernel_experts: bool = False  # expert weights plain, a layer's experts in one call (cpu_kernel.KernelExperts)
    kernel_dense: bool = False  # the other linear maps too (never with pack_dense)
    kernel_norms: bool = False  # RMSNorm and decode attention on the C kernel, whatever the GEMMs' layout
    decode_grouped: bool = False  # a compiled decode step's experts: one grouped_mm call, not indexed per token
    # a compiled decode step of at most this many rows: its experts as GEMVs on the indexed weights (moe_reduced;
    # 0: never). Measured on a GPU where the step's experts are grouped_mm (decode_calibration.py); 0 elsewhere
    decode_reduce_max: int = 0
    # more tokens than this in one call: the C kernel's experts (dense layers) run torch's GEMMs on the same plain
    # weights, faster there (None: the kernel at every count)
    kernel_max_tokens: int | None = None
    dense_kernel_max_tokens: int | None = None
    # past those counts, torch's GEMMs in float32 on upcast weights: a bf16 model on a CPU without bf16 arithmetic
    upcast_experts: bool = False
    upcast_dense: bool = False
    # quantized weights on torch's quantized ops where they take them, the experts indexed per token up to gather_max
    # tokens (quant_gpu.py): a GPU's layout of a quantized model
    quant_ops: bool = False

    def describe(self) -> str:
        grouped = "one grouped_mm call" if self.grouped_mm else "a loop over experts"
        layout = "packed" if self.pack_experts else "plain, C kernel" if self.kernel_experts else "plain"
        dense = "packed" if self.pack_dense else "C kernel" if self.kernel_dense else "plain"
        parts = [f"experts {layout}, gather path up to {self.gather_max} token{'s' if self.gather_max != 1 else ''} "
                 f"then {grouped}; dense layers {dense}"]
        if self.kernel_norms:
            parts.append("; norms and decode attention C kernel")
        if self.kernel_experts and self.kernel_max_tokens is not None:
            parts.append(f"; torch GEMMs past {self.kernel_max_tokens} tokens (experts)")
        if self.kernel_dense and self.dense_kernel_max_tokens is not None:
            parts.append(f", {self.dense_kernel_max_tokens} (dense)")
        if self.upcast_experts or self.upcast_dense:
            parts.append(" in float32 on upcast weights")
        if self.decode_grouped:
            parts.append("; compiled decode: grouped_mm")
        if self.decode_reduce_max:
            parts.append(f", GEMVs up to {self.decode_reduce_max} rows")
        if self.quant_ops:
            parts.append("; quantized weights on torch quantized ops, experts indexed")
        return "".join(parts) + f" ({self.source})"


def default_plan(device: torch.device | str, dtype: torch.dtype, reason: str = "not measured") -> DispatchPlan:
    """Without measuring: packed wherever oneDNN can pack, gather for one token, grouped_mm on CUDA, and in
    bf16 on CUDA a compiled decode step's experts as one grouped_mm call: it reads each hit expert once where
    indexing copies an expert's weights per routed row (on an H100, faster at batch 1 and far faster at 32:
    docs/bench/engine-2.4b-h100*)."""
    pack = onednn_packing_available(device, dtype)
    cuda = torch.device(device).type == "cuda"
    return DispatchPlan(pack, pack, cuda, 1, "default", reason, decode_grouped=cuda and dtype == torch.bfloat16)


def quantized_plan(cfg: MoEConfig, device: torch.device | str, dtype: torch.dtype) -> DispatchPlan:
    """A quantized model's plan, not measured: on a CPU the C kernel's integer GEMMs (quant_kernel.py), at every row
    count; on a GPU torch's quantized ops (quant_gpu.py: _weight_int8pack_mm, tinygemm, _scaled_mm) with the experts
    indexed per token for a decode step's row; torch dequantizing the weights (QuantLinear's own forward) where
    neither runs (the CPU kernel's widths are multiples of 32; tinygemm takes bfloat16 on compute capability 8.0+).
    fp8 weights anywhere but a GPU with fp8 arithmetic: Fp8Unavailable."""
    if is_fp8_config(cfg.quantization):
        check_fp8(device)
    if torch.device(device).type != "cpu":
        why = quantized_ops_unavailable(cfg.quantization, device, dtype)
        reason = (f"quantized weights on a GPU: {describe_forms(cfg.quantization)}" if why is None else
                  f"quantized weights on a GPU: dense layers dequantized by torch ({why}); experts indexed and "
                  "dequantized per token for few rows, each hit expert dequantized once for many")
        return DispatchPlan(False, False, False, QUANT_GATHER_MAX, "quantized", reason, quant_ops=True)
    why = cpu_kernel.unavailable_for(dtype)
    widths = [cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim]
    if why is None and any(w % 32 for w in widths):
        why = f"the kernel's quantized GEMMs take widths that are multiples of 32, not {widths}"
    if why is not None:
        return DispatchPlan(False, False, False, 0, "quantized", f"quantized weights dequantized by torch: {why}")
    return DispatchPlan(False, False, False, 0, "quantized", "quantized weights on the C kernel's integer GEMMs",
                        kernel_experts=True, kernel_dense=True, kernel_norms=True)
