"""The backend seam: the few calls the Engine and the step engine make into a model, whatever runs it.

    forward(ids, mask)                    a whole batch, no cache (scoring, classification, routes)
    target_logprobs(ids, mask, targets)   forward's log p of `targets` only, [B, T] (scoring)
    new_cache(slots, max_len)             room for `slots` sequences of up to `max_len` positions
    prefill(cache, slot, ids, start)      a sequence's tokens start.. written into its slot (logits of
                                          the last at least; of every one with all_logits=True)
    decode(cache, slots, ids, positions)  one token for each of a set of slots
    step_rows(cache, slots, ids, starts)  where can_step_rows: rows of any lengths in one call, each its tokens ids[b]
                                          written into slot slots[b] from starts[b] (a step's prompt chunks
                                          and decode tokens together); logits of each row's last token
    copy_prefix(cache, src, dst, length)  where can_copy_prefix: positions 0..length-1 of slot src copied into slot dst
                                          (a prompt's n choices share one prefill)

    warm_up(slots, rows)                  build what the first requests would wait for (a compiled step's graphs:
                                          for every batch size up to `slots`, or for `rows` rows alone)

Each call returns a ModelOutput (logits and per-MoE-layer aux); the Engine does the rest (sampling,
text, expert-load accounting). Which slots a call touches is decided by the caller on the host, so a
backend never has to ask the device where a sequence is.

`TorchBackend` is these calls over the Transformer, whose modules are plain math; each backend built on it
(eager.py, cpu.py, compiled.py) lays the model out its own way once, when it is made, and may replace a call
(the CPU kernel's whole decode step, the compiled step's graphs). onnx.py's runs an exported graph instead.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.backends.layout import plain_
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import ModelOutput, Transformer


class ModelRunner(Protocol):
    """What the Engine and the step engine call. The optional calls are declared, not probed: a runner says
    whether it takes rows of any lengths in one call (`can_step_rows`), copies cache rows (`can_copy_prefix`)
    and decodes on a compiled graph (`graph_decode`, read each step: a graph that failed goes eager for good)."""

    cfg: MoEConfig
    can_step_rows: bool
    can_copy_prefix: bool
    graph_decode: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput: ...

    def new_cache(self, slots: int, max_len: int) -> Any: ...

    def prefill(self, cache: Any, slot: int, ids_S: Tensor, start: int, all_logits: bool = False) -> ModelOutput: ...

    def decode(self, cache: Any, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput: ...

    def target_logprobs(self, ids: Tensor, attention_mask: Tensor | None, targets: Tensor) -> ModelOutput: ...

    def step_rows(self, cache: Any, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput: ...

    def copy_prefix(self, cache: Any, src: int, dst: int, length: int) -> None: ...

    def warm_up(self, slots: int, rows: int | None = None) -> None: ...


class TorchBackend:
    """The calls over the Transformer on a slot KV cache (kv_cache.KVCache), laid out as `plan` says by `lay_out`,
    which each backend defines: the model's modules are put back to plain ones first, so a model can be laid out
    again (after its weights, dtype or device changed) by making a new backend of it."""

    name = "torch"
    can_step_rows = can_copy_prefix = True
    graph_decode = False

    def __init__(self, model: Transformer, plan: DispatchPlan):
        self.model, self.cfg, self.plan = model, model.cfg, plan
        with torch.no_grad():
            plain_(model)
            self.lay_out(plan)

    def lay_out(self, plan: DispatchPlan) -> None:
        """Replace the model's modules by the inference forms this backend runs (backends/layout.py)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.tok_embeddings.weight.dtype

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput:
        return self.model(ids, attention_mask=attention_mask)

    def target_logprobs(self, ids: Tensor, attention_mask: Tensor | None, targets: Tensor) -> ModelOutput:
        """forward whose `logits` are log p(targets) [B, T] (Transformer.forward's targets): no [B, S, V] logits."""
        return self.model(ids, attention_mask=attention_mask, targets=targets)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache.for_model(self.model, slots, max_len)

    def warm_up(self, slots: int, rows: int | None = None) -> None:
        """Build what the first requests would otherwise wait for (nothing, but for a compiled step)."""

    def prefill(self, cache: KVCache, slot: int, ids_S: Tensor, start: int, all_logits: bool = False) -> ModelOutput:
        return self.model(ids_S[None], cache=cache.rows([slot], [start], ids_S.shape[0]), last_only=not all_logits)

    def step_rows(self, cache: KVCache, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput:
        rows = cache.step_rows(slots, starts, [len(t) for t in ids])
        flat = torch.tensor([t for b in rows.order for t in ids[b]], device=self.device)
        return self.model(flat[None], cache=rows)

    def copy_prefix(self, cache: KVCache, src: int, dst: int, length: int) -> None:
        cache.copy_prefix(src, dst, length)

    def decode(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        return self.model(ids_B[:, None], cache=cache.rows(slots, positions, 1))
