"""What a generation request asks for, and how one token is chosen from a row's logits.

Each sequence samples from its own seeded generator, so its tokens do not depend on what it is
batched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moeserve.errors import UserError


class EngineError(UserError):
    """A request the model cannot serve as asked (too long, empty, wrong task, no tokenizer)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None = fresh entropy
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    ignore_eos: bool = False
    logprobs: int | None = None  # record each new token's log-probability and its top N alternatives (0..20)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first, conditioned on nothing, has none)

    def validate(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise EngineError(f"max_new_tokens = {self.max_new_tokens!r}: expected an integer >= 0")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise EngineError(f"temperature = {self.temperature!r}: expected a finite number >= 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise EngineError(f"top_k = {self.top_k!r}: expected an integer >= 1 or None")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise EngineError(f"top_p = {self.top_p!r}: expected a number in (0, 1] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError(f"stop = {self.stop!r}: expected non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise EngineError(f"{name} = {n!r}: expected an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


MAX_LOGPROBS = 20  # alternatives per token at most, as vLLM and OpenAI's chat API

# Below this temperature sampling is the argmax in all but name, and logits / temperature would overflow
# float32 to inf (NaN probabilities): such temperatures are served greedily.
MIN_TEMPERATURE = 1e-6


def filter_logits(logits_V: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p (the smallest set of tokens whose mass reaches p; never empty)."""
    scaled = logits_V.float() / p.temperature
    if p.top_k is not None and p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1:
        sorted_V, idx = scaled.sort(descending=True)
        cum = sorted_V.softmax(-1).cumsum(-1)
        drop = cum - sorted_V.softmax(-1) >= p.top_p  # mass before this token already reaches p
        drop[0] = False  # the likeliest token stays, even for a top_p that float32 rounds to 0
        scaled = scaled.scatter(0, idx, sorted_V.masked_fill(drop, float("-inf")))
    return scaled


def sample(logits_V: Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """A token drawn from the filtered distribution with the sequence's own (CPU) generator."""
    probs = filter_logits(logits_V, p).softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class TokenLogprob:
    """A token's log-probability under the model, and the likeliest tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first


def token_logprobs(logits_NV: Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """Row i: the log-probability of tokens[i] and the top_n[i] likeliest tokens, from the model's own
    distribution: a float32 log-softmax of the raw logits, before temperature, top-k and top-p (what a
    client scoring text needs, and what vLLM reports by default). One host transfer for all rows."""
    lp = logits_NV.float().log_softmax(-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = min(max(top_n, default=0), lp.shape[-1])
    if k == 0:
        return [TokenLogprob(t, c, []) for t, c in zip(tokens, chosen)]
    top = lp.topk(k, dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(t, c, list(zip(ids[i][:n], values[i][:n])))
            for i, (t, c, n) in enumerate(zip(tokens, chosen, top_n))]
