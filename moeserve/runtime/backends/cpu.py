"""The CPU-kernel backend: the parts of the model the calibration put on the C kernel (cpu_kernel.py) run there,
the rest as the torch backend runs it, and a decode step is one C call where every part of it is on the kernel.

The kernel's ops are what the model's modules compute, on the same roundings (the tests hold each against its
torch module, bit for bit where the arithmetic allows): GEMMs for the few rows of decode (KernelLinear), a MoE
layer's experts in one call (FusedExperts), the router (KernelRouted), RMSNorm (KernelRMSNorm) and attention
over the cache where it lies (KernelAttention). A prompt's queries on KernelAttention are each computed as a
decode step's, so a prompt's numbers do not depend on how it was chunked or which rows share its call.

The whole decode step (kernel_decode.KernelDecodeStep) is those ops composed in C, with no torch between them: a
step that streams the weights leaves every cache cold, and there each small torch operation between the C calls
cost more than it does warm (docs/design-notes.md). It is this backend's decode; a prompt, or a decode row that
rides in a prompt's call, runs the ops one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.eager import EagerBackend, is_linear
from moeserve.runtime.backends.experts import FusedExperts
from moeserve.runtime.backends.layout import Laid
from moeserve.runtime.backends.kernel_decode import DecodeAttention, KernelDecodeStep, KernelRouter
from moeserve.runtime.backends.quant_kernel import KernelQuantExperts, linear_q
from moeserve.runtime.experts import BiasedExperts
from moeserve.runtime.kv_cache import CacheRows, KVCache
from moeserve.runtime.model import Attention, ModelOutput, apply_rope
from moeserve.runtime.moe import MoEAux, MoELayer
from moeserve.runtime.quant import QuantExperts, QuantLinear
from moeserve.runtime.routing import Routing, SigmoidRouter, SoftmaxRouter, XMoERouter


# The additions of MoEConfig.extensions that the whole decode step computes (a head width of its own, QK-norm); a
# model with any other goes op by op (a dense layer's width never reaches the step: a dense FFN goes op by op anyway)
STEP_EXTENSIONS = {"d_head", "qk_norm", "dense_d_ff"}


class KernelLinear(Laid, nn.Linear):
    """A linear map (an nn.Linear or the tied head) on the kernel's GEMM, up to `max_rows` rows, its bias (Qwen2-MoE's
    q, k, v; gpt-oss's maps) added after; past them torch's GEMM on the same weight, faster there
    (DispatchPlan.dense_kernel_max_tokens), in float32 on an upcast copy where `upcast` (a CPU without bf16
    arithmetic: DispatchPlan.upcast_dense)."""

    weight: Tensor
    max_rows: int | None = None
    upcast: bool = False

    def forward(self, x: Tensor) -> Tensor:
        bias = self._parameters.get("bias")  # None: an unbiased map, or the tied head
        if self.max_rows is not None and x.numel() > self.max_rows * x.shape[-1]:
            if self.upcast:
                return F.linear(x.float(), self.weight.float(), None if bias is None else bias.float()).to(x.dtype)
            return F.linear(x, self.weight, bias)
        return kernel_linear(x, self.weight, bias)


def kernel_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x w^T on the kernel's GEMM, the bias added after (the kernel's GEMM has none)."""
    y = cpu_kernel.linear(x, w)
    return y if b is None else y + b


class KernelQuantLinear(Laid, QuantLinear):
    """A quantized linear map on the kernel's integer GEMM (quant_kernel.linear_q) at every row count: its activations
    are quantized per 32-element block, so a row's numbers must not depend on how many rows share its call (a
    dequantized float GEMM past some count would give a prompt other numbers than its decode steps)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear_q(x, self.qweight, self.scale, self.spec)


class KernelQuantMoE(Laid, QuantExperts):
    """A layer's quantized experts in one kernel call (KernelQuantExperts), dispatch included."""

    kernel: KernelQuantExperts

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if keep_TK is not None:  # a capacity limit drops assignments: the reference's dispatch
            return super().forward(x_TD, expert_ids_TK, gates_TK, keep_TK)
        return self.kernel.moe(x_TD, expert_ids_TK, gates_TK)


class KernelBiasedExperts(Laid, BiasedExperts):
    """gpt-oss's experts (BiasedExperts: biases, the clamped SwiGLU) with each expert's maps on the kernel's GEMM up to
    `max_rows` rows, its biases added after (torch's GEMMs past them, as KernelLinear): a decode step's few rows per
    expert read each weight once at the kernel's pace rather than through torch's addmm."""

    max_rows: int | None = None

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return super().linear(x, w, b)
        return kernel_linear(x, w, b)


class KernelRMSNorm(Laid, nn.RMSNorm):
    """nn.RMSNorm in one kernel call: the float32 sums of torch's, rounded once."""

    @property
    def epsilon(self) -> float:
        """nn.RMSNorm's eps, None meaning its dtype's machine epsilon (as torch resolves it)."""
        return self.eps if self.eps is not None else torch.finfo(self.weight.dtype).eps

    def forward(self, x: Tensor) -> Tensor:
        return cpu_kernel.rms_norm(x, self.weight, self.epsilon)


class KernelAttention(Laid, Attention):
    """Causal attention whose cached calls run on the kernel over the cache where it lies (no gather, no mask); an
    uncached call (scoring) is the module's own."""

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                is_causal: bool, cache: CacheRows | None) -> Tensor:
        if cache is None:
            return super()._attend(q, k, v, cos, sin, mask, is_causal, cache)
        B, S = q.shape[:2]
        H, G, Dh, kv = self.n_heads, self.n_kv_heads, self.head_dim, cache.cache
        lo, hi = cache.decode_bounds(self.window)
        if S == 1:  # RoPE, the cache write and attention in one call
            y = cpu_kernel.attend_decode(q.view(B, H, Dh), kv.k[self.layer_id], kv.v[self.layer_id], cache.slots, lo,
                                         hi, Dh**-0.5, new_kv=(k.view(B, G, Dh), v.view(B, G, Dh)),
                                         rope=(cos.reshape(B, Dh), sin.reshape(B, Dh)))
            return y.view(B, S, -1)
        # A prompt's queries each as a decode step's: its tokens' keys written first, then every query over its slot
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer_id, k, v)
        y = cpu_kernel.attend_decode(q.transpose(1, 2).reshape(B * S, H, Dh), kv.k[self.layer_id],
                                     kv.v[self.layer_id], cache.slots.repeat_interleave(S), lo, hi, Dh**-0.5)
        return y.view(B, S, -1)


class KernelRouted(Laid, nn.Module):
    """A router computed by the kernel (kernel_decode.KernelRouter), for any number of tokens."""

    kernel: KernelRouter

    def forward(self, x_TD: Tensor) -> Routing:
        return Routing(*self.kernel(x_TD))


def kernel_router(router: nn.Module) -> KernelRouter | None:
    """`router` on the C kernel, where it is one the kernel computes; else None. Its weights as they are now (X-MoE's
    tau is read here): a backend made after they change builds it again."""
    if isinstance(router, SoftmaxRouter) and router.gate.bias is None:  # the kernel's router has no bias (gpt-oss)
        return KernelRouter(router.gate.weight, router.top_k, "softmax", router.renormalize)
    if isinstance(router, SigmoidRouter):
        return KernelRouter(router.gate.weight, router.top_k, "sigmoid")
    if isinstance(router, XMoERouter):
        tau = float(router.tau.float().clamp(min=1e-3))  # as its forward clamps it
        return KernelRouter(router.proj.weight, router.top_k, router.gate_kind, embeddings=router.expert_embeddings,
                            tau=tau)
    return None


def lay_out_router(layer: MoELayer) -> None:
    """The router of a layer whose experts are on the kernel, on the kernel too (no capacity limit, not VQ)."""
    if (isinstance(layer.experts, (FusedExperts, KernelQuantMoE)) and layer.quantizer is None
            and layer.cfg.capacity_factor is None):
        kernel = kernel_router(layer.router)
        if kernel is not None:
            layer.router = KernelRouted.of(layer.router, kernel=kernel)


class CpuKernelBackend(EagerBackend):
    name = "cpu-kernel"

    def lay_out(self, plan: DispatchPlan) -> None:
        if not cpu_kernel.available():
            parts = [name for on, name in ((plan.kernel_experts, "experts"), (plan.kernel_dense, "dense layers"),
                                           (plan.kernel_norms, "norms and decode attention")) if on]
            raise cpu_kernel.KernelError(f"the plan runs {' and '.join(parts)} on the CPU kernel, which is not "
                                         f"available here: {cpu_kernel.unavailable_reason()}")
        super().lay_out(plan)
        for layer in self.model.moe_layers:
            if plan.kernel_experts and type(layer.experts) is QuantExperts:
                layer.experts = KernelQuantMoE.of(layer.experts, kernel=KernelQuantExperts.of(layer.experts))
            lay_out_router(layer)
        self.step = self._step(plan)
        self.moe_layers = self.model.moe_layers  # decode's, once: the property walks the blocks

    def experts(self, plan: DispatchPlan) -> dict:
        if not plan.kernel_experts:
            return super().experts(plan)
        return dict(pack=False, grouped_mm=False, sync_free=False, gather_max=plan.gather_max, kernel=True,
                    kernel_max_tokens=plan.kernel_max_tokens, upcast=plan.upcast_experts)

    def form(self, m: nn.Module, plan: DispatchPlan) -> nn.Module | None:
        if plan.kernel_dense and (is_linear(m) or type(m) is nn.Linear):
            return KernelLinear.of(m, weight=m.weight, max_rows=plan.dense_kernel_max_tokens, upcast=plan.upcast_dense)
        if plan.kernel_dense and type(m) is QuantLinear:
            return KernelQuantLinear.of(m)
        if plan.kernel_norms and type(m) is nn.RMSNorm and m.weight is not None:
            return KernelRMSNorm.of(m)
        if plan.kernel_experts and type(m) is BiasedExperts:
            return KernelBiasedExperts.of(m, max_rows=plan.dense_kernel_max_tokens)
        if plan.kernel_norms and type(m) is Attention and m.causal and m.sinks is None:
            return KernelAttention.of(m)  # the kernel's softmax has no sink (gpt-oss): that attention stays torch's
        return super().form(m, plan)

    def _step(self, plan: DispatchPlan) -> KernelDecodeStep | None:
        """The whole decode step in one call, where every part of it is on the kernel: each layer's attention half,
        router and experts, the final norm and the LM head. Else None: the ops one by one."""
        model = self.model
        if (not (plan.kernel_dense and plan.kernel_norms) or self.cfg.task != "lm"
                or set(self.cfg.extensions) - STEP_EXTENSIONS):
            return None  # the C step composes moeserve's blocks and these additions only: the others go op by op
        parts = []
        for block in model.layers:
            ffn, norms, a = block.ffn, (block.attention_norm, block.ffn_norm), block.attention
            if (not isinstance(ffn, MoELayer) or not isinstance(ffn.router, KernelRouted) or ffn.shared is not None
                    or not all(isinstance(n, KernelRMSNorm) for n in norms) or not isinstance(a, KernelAttention)):
                return None  # a dense FFN, a VQ layer, a capacity limit, a shared expert, LayerNorm: ops one by one
            n = ((norms[0].weight, norms[0].epsilon), (norms[1].weight, norms[1].epsilon))
            linears = (a.wq, a.wk, a.wv, a.wo)
            if any(m._parameters.get("bias") is not None for m in linears):
                return None  # the step's GEMVs add no bias
            qk = None
            if a.qk_norm is not None:
                if not all(isinstance(m, KernelRMSNorm) for m in (a.q_norm, a.k_norm)):
                    return None
                qk = (a.qk_norm, a.q_norm.weight, a.k_norm.weight, a.q_norm.epsilon)
            if isinstance(ffn.experts, KernelQuantMoE) and all(isinstance(m, KernelQuantLinear) for m in linears):
                attention = DecodeAttention(n, tuple(m.qweight for m in linears), a.n_heads, a.n_kv_heads,
                                            tuple(m.spec for m in linears), tuple(m.scale for m in linears), qk)
                parts.append((attention, ffn.router.kernel, ffn.experts.kernel))
            elif isinstance(ffn.experts, FusedExperts) and all(isinstance(m, KernelLinear) for m in linears):
                attention = DecodeAttention(n, tuple(m.weight for m in linears), a.n_heads, a.n_kv_heads, qk_norm=qk)
                parts.append((attention, ffn.router.kernel, ffn.experts.w.fused))
            else:
                return None
        norm, head = model.norm, model.output
        if not isinstance(norm, KernelRMSNorm) or not isinstance(head, (KernelLinear, KernelQuantLinear)):
            return None
        quantized = isinstance(head, KernelQuantLinear)
        return KernelDecodeStep(parts, (norm.weight, norm.epsilon), head.qweight if quantized else head.weight,
                                model.tok_embeddings.weight, (model.rope_cos, model.rope_sin), self.cfg.sliding_window,
                                head_quant=(head.scale, head.spec) if quantized else None)

    def decode(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        """One token a row on the whole-step call, from the host's numbers: the rows are checked here and the C call
        looks up the embedding, the RoPE rows and the bounds, which a forward builds in torch."""
        if self.step is None:
            return super().decode(cache, slots, ids_B, positions)
        cache.claim(slots, positions, 1)
        rows = torch.tensor([*slots, *positions])
        logits_BV, ids, gates, counts = self.step(ids_B.long().contiguous(), rows[:len(slots)], rows[len(slots):],
                                                  cache.k, cache.v, self.cfg.head_dim**-0.5)
        aux = [MoEAux(c if layer.count_load else None, Routing(i, g))
               for layer, c, i, g in zip(self.moe_layers, counts, ids, gates)]
        return ModelOutput(logits_BV[:, None], aux)
