"""The KV cache of the step engine: a slot per sequence, preallocated, and where a call's rows lie in it.

Shape legend: B rows, S tokens a row, G kv heads, L key/value length, Dh head dim.

`KVCache` holds the keys and values; `KVCache.rows` says where the rows of a call of equal lengths sit
(`CacheRows`), `KVCache.step_rows` where the rows of a call of any lengths sit and how their tokens are laid out
(`StepRows`). The model (model.py) reads and writes the cache only through these, and the host decides every
position, so a forward pass never asks the device where a sequence is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch
from torch import Tensor, nn


class KVCache:
    """Keys and values of `slots` sequences, one [slots, G, max_len, Dh] pair per layer, allocated once
    and passed into the forward pass (never installed into modules). A sequence owns a slot from its
    prefill to its last token; a freed slot is reused without zeroing, because a sequence writes
    positions 0..p before any query of it reads them, and no query reads past its own position.

    Positions a query does not read still enter its masked product with a weight of 0, so they must
    hold finite numbers: a slot is zeroed the first time it is used (`touch`), not at allocation, so
    that start-up does not write the whole cache (1 GiB for 8 slots of a 4096-token Mixtral context)
    and a slot no request ever takes is never written at all.

    `spare` positions past max_len are allocated and never used: a compiled step slices the keys to a symbolic
    span (compiled.py), and a slice as long as its dimension is a case torch.compile specializes on, compiling the
    longest span again as a constant."""

    def __init__(self, n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None, spare: int = 0):
        shape = (slots, n_kv_heads, max_len + spare, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.slots, self.max_len = slots, max_len
        self._untouched = set(range(slots))

    def touch(self, slots: list[int]) -> None:
        """Zero the slots among `slots` that no call has used yet."""
        for slot in self._untouched.intersection(slots):
            for t in (*self.k, *self.v):
                t[slot].zero_()
            self._untouched.discard(slot)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot dst's positions 0..length-1 become slot src's (a sequence starting from the same prompt)."""
        if src == dst or not (0 <= src < self.slots and 0 <= dst < self.slots) or not 0 < length <= self.max_len:
            raise ValueError(f"copy of {length} positions from slot {src} to slot {dst} in a cache of {self.slots} "
                             f"slots x {self.max_len}")
        self.touch([dst])
        for t in (*self.k, *self.v):
            t[dst, :, :length] = t[src, :, :length]

    @classmethod
    def for_model(cls, model: nn.Module, slots: int, max_len: int | None = None, spare: int = 0) -> "KVCache":
        """Room for `slots` sequences of the Transformer `model` (its config and its embedding's dtype and device);
        a module, not model.Transformer, so that this file does not import the model that imports it."""
        cfg, w = model.cfg, model.tok_embeddings.weight
        max_len = max_len or cfg.max_seq_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds max_seq_len={cfg.max_seq_len}")
        return cls(cfg.n_layers, slots, max_len, cfg.kv_heads, cfg.head_dim, w.dtype, w.device, spare)

    def claim(self, slots: list[int], starts: list[int], n_tokens: int) -> int:
        """Check that rows of `n_tokens` from `starts` fit their distinct `slots` (a ValueError if not), zero the
        slots' rows if they are new (`touch`); the number of positions the call attends over."""
        if len(slots) != len(starts) or not slots:
            raise ValueError(f"{len(slots)} slots for {len(starts)} start positions")
        if min(slots) < 0 or max(slots) >= self.slots or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots}: expected distinct slots in [0, {self.slots})")
        length = max(starts) + n_tokens
        if min(starts) < 0 or length > self.max_len:
            raise ValueError(f"positions up to {length - 1} do not fit a cache of {self.max_len}")
        self.touch(slots)
        return length

    def rows(self, slots: list[int], starts: list[int], n_tokens: int) -> "CacheRows":
        """Row b of the next call is slot `slots[b]`, its tokens at positions starts[b] .. starts[b] + n_tokens - 1.
        Built on the host from host-side numbers, so the forward pass never asks the device where it is."""
        length = self.claim(slots, starts, n_tokens)
        device = self.k[0].device
        offsets = torch.arange(n_tokens)
        positions = (torch.tensor(starts)[:, None] + offsets[None]).to(device)
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        return CacheRows(self, torch.tensor(slots, device=device), positions, length,
                         slice(first, first + len(slots)) if contiguous else None)

    def step_rows(self, slots: list[int], starts: list[int], lengths: list[int]) -> "StepRows":
        """Rows of any lengths in one call, their tokens laid end to end ([1, sum(lengths)], no padding): row b
        is lengths[b] tokens of slot slots[b] from position starts[b]. The one-token rows (decode steps) attend
        together as a decode call would; each longer row (a prompt's chunk) on its own, as its prefill alone
        would. Only the attention is split: every other layer runs once over all the tokens."""
        if not (len(slots) == len(starts) == len(lengths)) or not slots or min(lengths) < 1:
            raise ValueError(f"{len(slots)} slots, {len(starts)} starts and lengths {lengths}: one each, >= 1")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots}: a slot takes one row of a call")
        single = [b for b, n in enumerate(lengths) if n == 1]
        longer = [b for b, n in enumerate(lengths) if n > 1]
        parts, offset, at = [], 0, {}
        if single:
            parts.append(RowsPart(self.rows([slots[b] for b in single], [starts[b] for b in single], 1),
                                  slice(0, len(single))))
            at |= {b: i for i, b in enumerate(single)}
            offset = len(single)
        for b in longer:
            parts.append(RowsPart(self.rows([slots[b]], [starts[b]], lengths[b]), slice(offset, offset + lengths[b])))
            offset += lengths[b]
            at[b] = offset - 1
        order = [at[b] for b in range(len(slots))]  # where each row's last token lies among the call's tokens
        return StepRows(parts, torch.tensor(order, device=self.k[0].device), single + longer)


@dataclass
class CacheRows:
    """Where the rows of one forward call live in a KVCache (KVCache.rows makes one)."""

    cache: KVCache
    slots: Tensor  # [B] the slot of each row
    positions: Tensor  # [B, S] the position of each token: its RoPE angle and where its key and value are written
    length: int  # keys attended over: the largest position + 1
    contiguous: slice | None = None  # the slots as one range, when they are one: read in place, not gathered
    _bounds: tuple[Tensor, Tensor] | None = field(default=None, repr=False)  # decode_bounds, once a call

    def write(self, layer: int, k_BGSDh: Tensor, v_BGSDh: Tensor) -> None:
        """Write this call's keys and values at their slots and positions."""
        index = (self.slots[:, None], slice(None), self.positions)  # advanced indices -> [B, S, G, Dh]
        self.cache.k[layer][index] = k_BGSDh.transpose(1, 2)
        self.cache.v[layer][index] = v_BGSDh.transpose(1, 2)

    def decode_bounds(self, window: int | None) -> tuple[Tensor, Tensor]:
        """(lo, hi) [B * S] int64: the keys each causal query sees (row by row), positions lo .. hi - 1 (its own
        and those before it, within `window`). Computed and checked against the cache once per call."""
        if self._bounds is None:
            hi = self.positions.reshape(-1) + 1
            lo = (hi - window).clamp(min=0) if window is not None else torch.zeros_like(hi)
            if not bool((hi <= self.cache.max_len).all() & (lo >= 0).all() & (self.slots >= 0).all()
                        & (self.slots < self.cache.slots).all()):
                raise ValueError("decode positions or slots outside the cache")
            self._bounds = lo.contiguous(), hi.contiguous()
        return self._bounds

    def update(self, layer: int, k_BGSDh: Tensor, v_BGSDh: Tensor) -> tuple[Tensor, Tensor]:
        """Write this call's keys and values; return every row's keys and values 0..length-1, [B, G, L, Dh]."""
        self.write(layer, k_BGSDh, v_BGSDh)
        k_all, v_all = self.cache.k[layer], self.cache.v[layer]
        if self.contiguous is not None:
            return k_all[self.contiguous, :, : self.length], v_all[self.contiguous, :, : self.length]
        return (k_all[:, :, : self.length].index_select(0, self.slots),
                v_all[:, :, : self.length].index_select(0, self.slots))


@dataclass
class RowsPart:
    """Rows of a StepRows call that attend together: its one-token rows, or one longer row."""

    rows: CacheRows
    tokens: slice  # where its tokens lie among the call's
    cos: Tensor | None = None  # the attention's inputs, set by Transformer.forward (_rope_and_masks)
    sin: Tensor | None = None
    masks: dict[int | None, Tensor] | None = None  # by sliding window (Transformer.windows)


@dataclass
class StepRows:
    """Where the rows of a call of any lengths live in a KVCache, and how its tokens are laid out
    (KVCache.step_rows makes one)."""

    parts: list[RowsPart]
    last: Tensor  # [R] the position of each row's last token among the call's tokens, in the rows' order
    order: list[int]  # the rows in the order their tokens are laid out

    @property
    def n_tokens(self) -> int:
        return self.parts[-1].tokens.stop
