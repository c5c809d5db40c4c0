"""The model-runner seam: the few calls the Engine makes into a model, whatever runs it.

    forward(ids, mask)                    a whole batch, no cache (scoring, classification, routes)
    target_logprobs(ids, mask, targets)   optional: forward's log p of `targets` only, [B, T] (scoring)
    new_cache(slots, max_len)             room for `slots` sequences of up to `max_len` positions
    prefill(cache, slot, ids, start)      a sequence's tokens start.. written into its slot (logits of
                                          the last at least; of every one with all_logits=True)
    decode(cache, slots, ids, positions)  one token for each of a set of slots
    step_rows(cache, slots, ids, starts)  optional: rows of any lengths in one call, each its tokens ids[b]
                                          written into slot slots[b] from starts[b] (a step's prompt chunks
                                          and decode tokens together); logits of each row's last token
    copy_prefix(cache, src, dst, length)  optional: positions 0..length-1 of slot src copied into slot dst
                                          (a prompt's n choices share one prefill)

Each call returns a ModelOutput (logits and per-MoE-layer aux); the Engine does the rest (sampling,
text, expert-load accounting). `TorchRunner` runs the Transformer; `runtime/onnx_runner.py`'s
`OnnxRunner` runs an exported graph on ONNX Runtime. Which slots a call touches is decided by the
caller on the host, so a runner never has to ask the device where a sequence is.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.backends.compiled import CompiledDecode
from moeserve.runtime.kv_cache import KVCache
from moeserve.runtime.model import ModelOutput, Transformer

log = logging.getLogger("moeserve.runtime")


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

    def warm_up(self, slots: int) -> None: ...


class TorchRunner:
    """The Transformer over a slot KV cache (kv_cache.KVCache); with `compiled`, its decode step is one
    compiled graph per batch bucket (compiled.py), over a cache kept from one call to the next so that
    the graphs are built once. `fallback`: if building the graph fails, say so and run eager."""

    can_step_rows = can_copy_prefix = True

    def __init__(self, model: Transformer, compiled: bool = False, fallback: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.compiled, self.fallback = compiled, fallback
        self._decode: CompiledDecode | None = None

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
        if not self.compiled:
            return KVCache.for_model(self.model, slots, max_len)
        if self._decode is None or self._decode.scratch < slots:  # one slot more: the padding rows' scratch
            self._decode = CompiledDecode(self.model, KVCache.for_model(self.model, slots + 1, spare=1))
        return self._decode.cache

    @property
    def graph_decode(self) -> bool:
        """Decode rows run on the compiled step, apart from a prompt's chunk (StepEngine): riding in the chunk's
        eager call would take them off the graph whenever prompts arrive."""
        return self.compiled

    def warm_up(self, slots: int) -> None:
        """Build the compiled decode step's graphs now, for up to `slots` rows (nothing to do when eager)."""
        if self.compiled:
            self.new_cache(slots, self.cfg.max_seq_len)
            self._guarded(self._decode.warm_up)

    def prefill(self, cache: KVCache, slot: int, ids_S: Tensor, start: int, all_logits: bool = False) -> ModelOutput:
        return self.model(ids_S[None], cache=cache.rows([slot], [start], ids_S.shape[0]), last_only=not all_logits)

    def step_rows(self, cache: KVCache, slots: list[int], ids: list[list[int]], starts: list[int]) -> ModelOutput:
        rows = cache.step_rows(slots, starts, [len(t) for t in ids])
        flat = torch.tensor([t for b in rows.order for t in ids[b]], device=self.device)
        return self.model(flat[None], cache=rows)

    def copy_prefix(self, cache: KVCache, src: int, dst: int, length: int) -> None:
        cache.copy_prefix(src, dst, length)

    def decode(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        if self.compiled and self._decode is not None and cache is self._decode.cache:
            out = self._guarded(self._decode, slots, ids_B, positions)
            if out is not None:
                return ModelOutput(*out, graph=True)
        if self.model.step_kernel is not None:
            return self.model.decode_step(cache, slots, ids_B, positions)
        return self.model(ids_B[:, None], cache=cache.rows(slots, positions, 1))

    def _guarded(self, fn, *args):
        """fn(*args); if it fails and the compiled step was only asked for where it may help ('auto'),
        log why, go eager for good, and return None."""
        try:
            return fn(*args)
        except Exception as e:
            if not self.fallback:
                raise
            log.warning("moeserve: the compiled decode step failed (%s: %s); running eager", type(e).__name__, e)
            self.compiled = False
            return None
