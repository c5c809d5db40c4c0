"""Some of a layer's experts, computed on the rows routed to them: what an expert-parallel rank holds of each MoE
layer (runtime/expert_parallel.py, which dispatches, exchanges and combines around it).

    rows of this shard's experts, in its own expert order, `counts` rows each -> shard(x_ND, counts) -> y_ND

`ExpertShard` holds float weights (the CPU kernel's one-call layer where it runs, else torch's loop over experts);
`QuantExpertShard` an int8 / int4 checkpoint's slice as stored; `BiasedExpertShard` a slice of experts with biases or
the clamped SwiGLU (gpt-oss's BiasedExperts), computed by BiasedExperts' own math. `contiguous_ranges` says which
experts each of S shards (ranks) gets.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.quant_kernel import KernelQuantExperts
from moeserve.runtime.experts import BiasedExperts, Dispatch, Experts, compute
from moeserve.runtime.quant import QuantExperts, QuantSpec


def contiguous_ranges(n_experts: int, n_shards: int) -> list[range]:
    """Shard s gets experts [s*E/S, (s+1)*E/S): as even as they divide, each a contiguous range (a slice of
    the stacked expert tensors)."""
    return [range(n_experts * s // n_shards, n_experts * (s + 1) // n_shards) for s in range(n_shards)]


class ExpertShard(nn.Module):
    """Some of a layer's experts (global ids `expert_ids`), stacked [E_local, out, in] as in Experts."""

    def __init__(self, expert_ids: Sequence[int], w1: Tensor, w2: Tensor, w3: Tensor | None):
        super().__init__()
        if len(expert_ids) != w1.shape[0]:
            raise ValueError(f"{len(expert_ids)} expert ids for {w1.shape[0]} stacked experts")
        self.expert_ids = list(expert_ids)
        self.w1, self.w2 = nn.Parameter(w1, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        self.w3 = nn.Parameter(w3, requires_grad=False) if w3 is not None else None
        self.kernel: cpu_kernel.KernelExperts | None = None

    @classmethod
    def of(cls, experts: Experts, expert_ids: Sequence[int]) -> "ExpertShard":
        """A copy of `expert_ids`' weights out of a whole layer's experts."""
        ids = torch.tensor(list(expert_ids), device=experts.w1.device)
        w3 = experts.w3.detach()[ids].clone() if experts.w3 is not None else None
        return cls(expert_ids, experts.w1.detach()[ids].clone(), experts.w2.detach()[ids].clone(), w3)

    def prepare_inference(self) -> bool:
        """Compute with the CPU kernel's one-call layer where it runs (float32 or bf16 weights on a CPU with a C
        compiler; cpu_kernel.py): a shard is asked for a few rows per layer at a decode step, where the kernel
        reads the weights at copy bandwidth and torch's per-expert loop costs a dozen calls an expert. Whether it
        did."""
        if self.w1.device.type == "cpu" and cpu_kernel.unavailable_for(self.w1.dtype) is None:
            self.kernel = cpu_kernel.KernelExperts(self.w1, self.w2, self.w3)
        return self.kernel is not None

    def forward(self, x_ND: Tensor, counts: list[int]) -> Tensor:
        if self.kernel is not None and not torch.is_grad_enabled():
            return self.kernel(x_ND, torch.tensor(counts, dtype=torch.int64))
        d = Dispatch(x_ND, counts, tok_N=x_ND.new_empty(0), gates_N=x_ND.new_empty(0))
        return compute(d, self.w1, self.w2, self.w3, expert_ids=self.expert_ids)


class QuantExpertShard(nn.Module):
    """Some of a layer's experts on quantized weights (runtime/quant.py): the slice an expert-parallel rank loads of a
    quantized checkpoint, its `experts` a QuantExperts of just these (global ids `expert_ids`). Called as ExpertShard
    is; each row goes through its expert with gate 1, so the rows' outputs are the experts' own and the caller's
    combine weighs them."""

    def __init__(self, expert_ids: Sequence[int], experts: QuantExperts):
        super().__init__()
        if len(expert_ids) != experts.n_experts:
            raise ValueError(f"{len(expert_ids)} expert ids for {experts.n_experts} stacked experts")
        self.expert_ids, self.experts = list(expert_ids), experts
        self.kernel: KernelQuantExperts | None = None

    @classmethod
    def of_tensors(cls, expert_ids: Sequence[int], spec: QuantSpec, act: str, tensors: dict[str, Tensor]
                   ) -> "QuantExpertShard":
        """From a checkpoint's slice: tensors "w1_qweight", "w1_scale", ... ([E_local, ...] each, as stored)."""
        E = len(expert_ids)
        q1 = tensors["w1_qweight"]
        F_, D = q1.shape[1], q1.shape[2] * 8 // spec.bits  # the packed width: I bits / 8 bytes
        experts = QuantExperts(E, D, F_, act, spec, device=q1.device)
        for name, buf in experts.named_buffers():
            if name not in tensors or tensors[name].shape != buf.shape or tensors[name].dtype != buf.dtype:
                raise ValueError(f"a {spec.name} expert slice needs {name} {buf.dtype} {list(buf.shape)}")
            setattr(experts, name, tensors[name])
        return cls(expert_ids, experts)

    def prepare_inference(self) -> bool:
        """The C kernel's quantized layer (quant_kernel.KernelQuantExperts) where it runs, as the single-process
        model's experts use it; whether it does."""
        e = self.experts
        F_, D = e.w1_qweight.shape[1], e.w2_qweight.shape[1]
        if e.w1_qweight.device.type == "cpu" and cpu_kernel.unavailable_reason() is None and D % 32 == F_ % 32 == 0:
            self.kernel = KernelQuantExperts.of(e)
        return self.kernel is not None

    def forward(self, x_ND: Tensor, counts: list[int]) -> Tensor:
        ids_N1 = torch.repeat_interleave(torch.arange(len(counts), device=x_ND.device),
                                         torch.tensor(counts, device=x_ND.device))[:, None]
        ones = x_ND.new_ones(x_ND.shape[0], 1)
        return (self.kernel.moe if self.kernel is not None else self.experts)(x_ND, ids_N1, ones)


class BiasedExpertShard(nn.Module):
    """Some of a layer's experts with biases or the clamped SwiGLU (gpt-oss): `experts` a BiasedExperts of just these
    (global ids `expert_ids`), with the whole layer's activation, limit and alpha. Called as ExpertShard is; each row's
    output is its expert's whole output, down bias included, so the caller's combine multiplies all of it by the gate,
    as BiasedExperts does. No kernel computes biases: torch's loop over experts (BiasedExperts.compute)."""

    kernel = None  # as the other shards' (expert_replicas.shard_like reads it): none computes biases

    def __init__(self, expert_ids: Sequence[int], experts: BiasedExperts):
        super().__init__()
        if len(expert_ids) != experts.n_experts:
            raise ValueError(f"{len(expert_ids)} expert ids for {experts.n_experts} stacked experts")
        self.expert_ids, self.experts = list(expert_ids), experts

    @classmethod
    def of(cls, experts: BiasedExperts, expert_ids: Sequence[int]) -> "BiasedExpertShard":
        """A copy of `expert_ids`' weights and biases out of a whole layer's experts."""
        ids = torch.tensor(list(expert_ids), device=experts.w1.device)
        return cls.of_tensors(expert_ids, experts.act, experts.limit, experts.alpha,
                              {n: p.detach()[ids].clone() for n, p in experts.named_parameters()})

    @classmethod
    def of_tensors(cls, expert_ids: Sequence[int], act: str, limit: float, alpha: float, tensors: dict[str, Tensor]
                   ) -> "BiasedExpertShard":
        """From a checkpoint's slice: "w1", "w2", "w3", "b1", "b2", "b3" ([E_local, ...] each; no "w3", "b3" for
        gelu, no biases for experts without), computed with the layer's activation `act`, `limit` and `alpha`."""
        E, (F_, D) = len(expert_ids), tensors["w1"].shape[1:]
        with torch.device("meta"):  # shapes only: the slice's tensors become the parameters
            experts = BiasedExperts(E, D, F_, act, "b2" in tensors, limit, alpha)
        if set(tensors) != {name for name, _ in experts.named_parameters()}:
            raise ValueError(f"a biased {act} expert slice has tensors {sorted(tensors)}; expected "
                             f"{sorted(name for name, _ in experts.named_parameters())}")
        for name, p in list(experts.named_parameters()):
            if tensors[name].shape != p.shape:
                raise ValueError(f"a biased expert slice needs {name} {list(p.shape)}, not {list(tensors[name].shape)}")
            setattr(experts, name, nn.Parameter(tensors[name], requires_grad=False))
        return cls(expert_ids, experts)

    def prepare_inference(self) -> bool:
        return False

    def forward(self, x_ND: Tensor, counts: list[int]) -> Tensor:
        return self.experts.compute(x_ND, counts)
