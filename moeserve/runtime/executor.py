"""The executor: token ids to logits over one backend, for one loaded model.

It holds what every call into the model shares: the backend (backends/: chosen once, from the calibration plan,
when the model is loaded), the lock that keeps the model to one caller at a time, the expert-load counter, and
the decode tokens counted by how they ran. Text, sampling and the arithmetic of scores are the Engine's
(engine.py), which holds one of these; the server's model thread and the step engine call it directly.
"""

from __future__ import annotations

import collections
import threading

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.backends import ModelRunner, backend_for
from moeserve.runtime.backends.calibration import ExpertShape, plan_for
from moeserve.runtime.backends.decode_calibration import gpu_decode_plan
from moeserve.runtime.backends.plan import DispatchPlan, quantized_plan
from moeserve.runtime.backends.compiled import CompileError, model_uncompilable, resolve_compile
from moeserve.runtime.model import ModelOutput, Transformer
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.quant import is_quantized
from moeserve.runtime.sampling import EngineError
from moeserve.runtime.steps import StepEngine
from moeserve.tokenizer import Tokenizer


class ExpertLoad:
    """Tokens routed to each (MoE layer, expert) since the last reset: one [L, E] int64 counter on the
    model's device that every forward adds its per-layer bincounts to, without waiting for the device;
    read (one copy to the host) only when asked. Thread-safe, so a metrics endpoint can read it while
    the model's thread runs."""

    def __init__(self, n_layers: int, n_experts: int, device: torch.device | str = "cpu"):
        self._counts = torch.zeros(n_layers, n_experts, dtype=torch.int64, device=device)
        self._lock = threading.Lock()

    def add(self, aux: list[MoEAux]) -> None:
        if not aux or any(a.counts is None for a in aux):
            return
        counts = torch.stack([a.counts for a in aux])
        if counts.device != self._counts.device:
            counts = counts.to(self._counts.device, non_blocking=True)
        with self._lock:
            self._counts += counts

    def snapshot(self) -> Tensor:
        with self._lock:
            return self._counts.cpu()

    def reset(self) -> Tensor:
        """Return the counts so far and start again from zero."""
        with self._lock:
            out, self._counts = self._counts, torch.zeros_like(self._counts)
        return out.cpu()


class Executor:
    """One model's calls, over its backend. A torch model is laid out by a DispatchPlan (backends/plan.py): `plan` if
    given, else the one measured for this model's shapes on this machine (cached after the first time;
    `calibration` 'off' takes the unmeasured defaults, 'redo' measures again; None: $MOESERVE_CALIBRATION, else
    'auto'). `compile`: the decode step as a compiled graph (compiled.py: 'on', 'off', or 'auto': on CUDA only,
    and eager for good if the graph fails). A ModelRunner given instead (an ONNX Runtime session) runs as it is."""

    def __init__(self, model: Transformer | ModelRunner, plan: DispatchPlan | None = None,
                 calibration: str | None = None, compile: str = "off"):
        self.model: Transformer | None = None
        self.plan: DispatchPlan | None = None
        self._fallback = compile == "auto"
        if isinstance(model, Transformer):
            self.model = model.eval()
            w = model.tok_embeddings.weight
            if plan is None and is_quantized(model):
                plan = quantized_plan(model.cfg, w.device, w.dtype)
            elif plan is None:  # measured here (CPU: the layouts and paths; GPU: the decode step's GEMV rows)
                measured = gpu_decode_plan if w.device.type == "cuda" else plan_for
                plan = measured(ExpertShape.of(model.cfg) if model.moe_layers else None, w.device, w.dtype, calibration)
            model = backend_for(self.model, plan, self._compiled(compile), self._fallback)
            self.plan = model.plan
        self.runner: ModelRunner = model
        self.cfg: MoEConfig = model.cfg
        n_moe = len(self.cfg.moe_layer_ids) if self.model is None else len(self.model.moe_layers)
        self.expert_load = ExpertLoad(n_moe, self.cfg.n_experts, self.device)
        # decode and prompt tokens by how their call ran: "graph" (a compiled step's replay) or "eager"
        # (moeserve_decode_tokens_total, moeserve_prefill_tokens_total)
        self.decode_tokens: collections.Counter[str] = collections.Counter()
        self.prefill_tokens: collections.Counter[str] = collections.Counter()
        self.lock = threading.RLock()

    def _compiled(self, mode: str) -> bool:
        try:
            compiled = resolve_compile(mode, self.model.tok_embeddings.weight.device)
        except CompileError as e:
            raise EngineError(str(e)) from None
        why = model_uncompilable(self.model) if compiled else None
        if why is not None and mode == "on":
            raise EngineError(f"--compile on: {why}")
        return compiled and why is None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def lay_out(self, plan: DispatchPlan | None = None) -> None:
        """Lay the torch model out again, as `plan` says (default: as now): after its weights were changed in place,
        which a layout's copies (packed or fused weights, VQ tables) do not follow, or to run another plan. A
        compiled model stays compiled."""
        if self.model is None:
            raise EngineError(f"this model runs on {self.runner.name}, whose layout is its own")
        with self.lock:
            self.runner = backend_for(self.model, plan or self.plan, self.runner.name == "compiled", self._fallback)
            self.plan = self.runner.plan

    @torch.inference_mode()
    def run(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput:
        """The backend's forward on a whole batch, its expert load counted (callers hold no lock: this takes it).
        Never with autograd: the backends' layouts are inference-only, and a graph nobody asked for costs time."""
        with self.lock:
            out = self.runner.forward(ids.to(self.device),
                                      None if attention_mask is None else attention_mask.to(self.device))
        self.expert_load.add(out.aux)
        return out

    @torch.inference_mode()
    def token_logprobs(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """log p(ids[:, t + 1] | ids[:, :t + 1]) [B, S - 1] float32 of right-padded rows (the padding's terms are
        garbage: the caller masks them), the head a few rows at a time: never [B, S, V] logits."""
        with self.lock:
            out = self.runner.target_logprobs(ids.to(self.device), attention_mask.to(self.device),
                                              ids[:, 1:].to(self.device))
        self.expert_load.add(out.aux)
        return out.logits

    def warm_up(self, slots: int, rows: int | None = None) -> None:
        """Build what the first requests would otherwise wait for: the compiled decode step's graphs for up to
        `slots` rows (nothing when eager); with `rows`, only the graph of a step of that many (a static batch, as
        the benches decode: one compile, where every bucket up to 32 rows is six)."""
        with self.lock, torch.inference_mode():
            self.runner.warm_up(slots, rows)

    def step_engine(self, tokenizer: Tokenizer | None, eos_id: int | None, slots: int, max_len: int | None = None,
                    prefill_chunk: int = 512, share_prefill: bool = True) -> StepEngine:
        """A step engine over this backend with a cache of `slots` sequences of `max_len` positions (default: the
        model's context), its expert load and its calls' paths counted here. The caller steps it on one thread (the
        server's model thread) and holds `lock` around each step if others use the model."""
        return StepEngine(self.runner, tokenizer, eos_id, slots=slots, max_len=max_len or self.cfg.max_seq_len,
                          prefill_chunk=prefill_chunk, on_aux=self.expert_load.add, share_prefill=share_prefill,
                          on_decode=self._count_decode, on_prefill=self._count_prefill)

    def _count_decode(self, path: str, rows: int) -> None:
        self.decode_tokens[path] += rows

    def _count_prefill(self, path: str, tokens: int) -> None:
        self.prefill_tokens[path] += tokens
