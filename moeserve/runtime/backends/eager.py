"""The torch backend: the model's own modules on torch's kernels, the reference every other backend is tested
against, with the layouts of the calibration's plan that stay in torch: experts with fused gate-up weights run by
token count (backends/experts.py), oneDNN-packed weights where they were measured faster (packing.py), and a
quantized model's weights on torch's quantized ops where the plan says (a GPU: quant_gpu.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moeserve.runtime.backends.base import TorchBackend
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.experts import lay_out_experts
from moeserve.runtime.backends.layout import Laid, lay_out_
from moeserve.runtime.backends.packing import PackedLinear, pack_weight
from moeserve.runtime.backends.quant_gpu import indexed_experts, linear_form
from moeserve.runtime.experts import Experts
from moeserve.runtime.model import TiedHead
from moeserve.runtime.moe import MoELayer
from moeserve.runtime.quant import QuantExperts, QuantLinear
from moeserve.runtime.quant_fp8 import Fp8Experts, Fp8Linear


class TableMoELayer(Laid, MoELayer):
    """A VQ layer with vq_input='code' whose discrete path is a lookup: x~ = up(v_k) is one of E vectors, so
    f_k(x~) is too (paper 002, eq. 5), and `table` [E, D] holds f_j(x~_j), computed once."""

    table: Tensor

    def _discrete(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        z = self.quantizer.encode(x_TD)
        codes_T = self.quantizer.nearest(z)
        return self.table[codes_T], codes_T, z, self.quantizer.vectors()[codes_T].to(z.dtype)


def code_table(layer: MoELayer) -> Tensor:
    """f_j(x~_j) [E, D] for every code j, through the layer's experts as laid out."""
    q = layer.quantizer
    v_EC = q.vectors()
    x_tilde_ED = q.up(v_EC) if q.up is not None else v_EC
    E = layer.n_experts
    return layer.experts(x_tilde_ED, torch.arange(E, device=v_EC.device)[:, None],
                         torch.ones(E, 1, dtype=x_tilde_ED.dtype, device=v_EC.device))


@torch.no_grad()
def lay_out_moe(layer: MoELayer, **experts_kwargs) -> MoELayer:
    """A MoE layer laid out for inference: its own `Experts` as `lay_out_experts(**experts_kwargs)` lays them out
    (experts of a factory's, such as an expert-parallel rank's, stay as they are), and for a VQ code layer the table
    of its discrete path (TableMoELayer). A layer with VQ tables is a new module: put it where the old one was."""
    if type(layer.experts) is Experts:
        layer.experts = lay_out_experts(layer.experts, **experts_kwargs)
    if layer.quantizer is not None and layer.cfg.vq_input == "code":
        return TableMoELayer.of(layer, table=code_table(layer))
    return layer


def is_linear(m: nn.Module) -> bool:
    """A bias-free linear map a backend may lay out: a plain nn.Linear, or the tied LM head."""
    return (type(m) is nn.Linear and m.bias is None) or type(m) is TiedHead


class EagerBackend(TorchBackend):
    name = "eager"

    def lay_out(self, plan: DispatchPlan) -> None:
        lay_out_(self.model, lambda m: self.form(m, plan))
        for block in self.model.layers:
            if isinstance(block.ffn, MoELayer):
                block.ffn = lay_out_moe(block.ffn, **self.experts(plan))

    def experts(self, plan: DispatchPlan) -> dict:
        """How this backend lays out a layer's experts (lay_out_experts' arguments)."""
        return dict(pack=plan.pack_experts, grouped_mm=plan.grouped_mm, gather_max=plan.gather_max)

    def form(self, m: nn.Module, plan: DispatchPlan) -> nn.Module | None:
        """The inference form of module m under `plan`, or None to keep it."""
        if plan.pack_dense and is_linear(m):
            return PackedLinear.of(m, packed=pack_weight(m.weight), weight=m.weight)
        if plan.quant_ops and type(m) in (QuantLinear, Fp8Linear):
            return linear_form(m, self.dtype)
        if plan.quant_ops and type(m) in (QuantExperts, Fp8Experts):
            return indexed_experts(m, plan.gather_max)
        return None
