"""How many tokens a scoring batch holds: chosen by the throughput the run measures, not only capped.

A forward pass's tokens per second rise with its rows until the GEMMs are as efficient as they get, and then
stay flat while its activations keep growing. Where that knee lies depends on the model, the dtype, the
backend and the CPU, so `BatchSizer` finds it from the batches the run scores anyway, with no extra work:

    start at `start` tokens -> score batches at that cap -> tokens/s over them
      -> a doubling that gains at least `gain` is kept and the next one tried (up to `limit`, the memory bound)
      -> one that gains less settles on the smaller size: the same throughput in less memory

The first batch of a process is not measured: it pays for first touches of the weights and the allocator's
growth, which would make the first size look slow. Once settled the size stays for the run, and the scoring
progress file records it, so a resumed run scores its remaining chunks with the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO_START = 2048
AUTO_LIMIT = 16384


@dataclass
class BatchSizer:
    start: int = field(default_factory=lambda: AUTO_START)
    limit: int = field(default_factory=lambda: AUTO_LIMIT)  # the most tokens a batch may hold, padding included
    gain: float = 1.05  # what a doubling must buy in tokens/s to be kept
    batches: int = 2  # batches measured at a size before it is judged
    settled: int | None = None  # the chosen size, once chosen
    _size: int = field(init=False)
    _skip: int = field(init=False, default=1)  # batches still to leave unmeasured
    _seen: list[tuple[int, float]] = field(init=False, default_factory=list)  # (tokens, seconds) at _size
    _rates: dict[int, float] = field(init=False, default_factory=dict)  # size -> tokens/s

    def __post_init__(self) -> None:
        for name in ("start", "limit", "batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected an integer >= 1")
        if self.gain < 1:
            raise ValueError(f"gain = {self.gain!r}: expected >= 1")
        self._size = min(self.start, self.limit)
        if self.settled is not None:
            self._size = self.settled

    @classmethod
    def fixed(cls, tokens: int) -> "BatchSizer":
        """Every batch at most `tokens`: no search."""
        return cls(start=tokens, limit=tokens, settled=tokens)

    @property
    def tokens(self) -> int:
        """The cap of the next batch."""
        return self._size

    @property
    def rates(self) -> dict[int, float]:
        """Tokens per second measured at each size tried."""
        return dict(self._rates)

    def record(self, tokens: int, seconds: float) -> None:
        """A batch scored `tokens` tokens in `seconds` at the current cap."""
        if self.settled is not None:
            return
        if self._skip:
            self._skip -= 1
            return
        self._seen.append((tokens, seconds))
        if len(self._seen) < self.batches:
            return
        rate = sum(t for t, _ in self._seen) / max(sum(s for _, s in self._seen), 1e-9)
        self._rates[self._size] = rate
        self._seen = []
        smaller = self._size // 2
        if smaller in self._rates and rate < self.gain * self._rates[smaller]:
            self._settle(smaller)  # the doubling bought too little: keep the smaller batches' memory
        elif self._size * 2 > self.limit:
            self._settle(self._size)
        else:
            self._size *= 2

    def _settle(self, size: int) -> None:
        self.settled = self._size = size
