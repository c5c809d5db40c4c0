"""The model-runner seam: the few calls the Engine makes into a model, whatever runs it.

    forward(ids, mask)                    a whole batch, no cache (scoring, classification, routes)
    new_cache(slots, max_len)             room for `slots` sequences of up to `max_len` positions
    prefill(cache, slot, ids, start)      a sequence's tokens start.. written into its slot (logits of
                                          the last at least)
    decode(cache, slots, ids, positions)  one token for each of a set of slots

Each call returns a ModelOutput (logits and per-MoE-layer aux); the Engine does the rest (sampling,
text, expert-load accounting). `TorchRunner` runs the Transformer; `runtime/onnx_runner.py`'s
`OnnxRunner` runs an exported graph on ONNX Runtime. Which slots a call touches is decided by the
caller on the host, so a runner never has to ask the device where a sequence is.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.model import KVCache, ModelOutput, Transformer


class ModelRunner(Protocol):
    cfg: MoEConfig

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput: ...

    def new_cache(self, slots: int, max_len: int) -> Any: ...

    def prefill(self, cache: Any, slot: int, ids_S: Tensor, start: int) -> ModelOutput: ...

    def decode(self, cache: Any, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput: ...


class TorchRunner:
    """The Transformer over a slot KV cache (model.KVCache)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.cfg = model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.tok_embeddings.weight.dtype

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> ModelOutput:
        return self.model(ids, attention_mask=attention_mask)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache.for_model(self.model, slots, max_len)

    def prefill(self, cache: KVCache, slot: int, ids_S: Tensor, start: int) -> ModelOutput:
        return self.model(ids_S[None], cache=cache.rows([slot], [start], ids_S.shape[0]), last_only=True)

    def decode(self, cache: KVCache, slots: list[int], ids_B: Tensor, positions: list[int]) -> ModelOutput:
        return self.model(ids_B[:, None], cache=cache.rows(slots, positions, 1))
