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


def filter_logits(logits_NV: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k (the k likeliest, and any tied with the k-th), then top-p (the smallest set of tokens
    whose mass reaches p, and any tied with its least likely; never empty), for each row of `logits_NV` (any
    leading dimensions; each row on its own, as if alone)."""
    scaled = logits_NV.float() / p.temperature
    V = scaled.shape[-1]
    if p.top_k is not None and p.top_k < V:
        kth = scaled.topk(p.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1:
        probs = scaled.softmax(-1)
        n = _top_p_width(probs, p.top_p) if probs.device.type == "cpu" else V
        mass = probs.topk(n, dim=-1).values if n < V else probs.sort(dim=-1, descending=True).values
        # the tokens whose likelier tokens' mass is below p (the likeliest always), then every token as likely as the
        # least likely of them: tokens tied with it are kept together, so the set is the same whatever order a sort
        # or top-k left ties in (bf16 logits tie often), and whatever n is
        cut = ((mass.cumsum(-1) - mass) < p.top_p).sum(-1, keepdim=True).clamp_(min=1)
        scaled = scaled.masked_fill(probs < mass.gather(-1, cut - 1), float("-inf"))
    return scaled


def _top_p_width(probs_NV: Tensor, top_p: float) -> int:
    """How many of each row's likeliest tokens top-p has to sort: those with any probability (what top-k left, its
    k-th value's ties included), or only the likeliest 64 or 1024 where in every row they already hold top_p of the
    mass (a margin over the cumulative sum's rounding), since the cut falls inside them. Read on the host, which a
    CPU's tensors cost nothing for; a 32k vocabulary's full sort is ~1 ms a row there."""
    live = int((probs_NV > 0).sum(-1).max())
    for m in (64, 1024):
        if m >= live:
            break
        if float(probs_NV.topk(m, dim=-1).values.sum(-1).min()) >= top_p + 1e-4:
            return m
    return live


def sample_rows(logits_BV: Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """A token for each row, drawn from its filtered distribution with its own (CPU) generator, one uniform number a
    draw (inverse CDF: the first token whose cumulative probability passes u times the total).

    Rows asking for the same filtering are filtered as one block where the logits are; the uniforms go to them, and
    the tokens come back in one transfer: on a GPU one host sync a step, not one a row (each row's probabilities
    copied out), and on a CPU no per-row multinomial, which draws one random number per vocabulary entry. Each
    row's arithmetic is its own, so its token does not depend on what it is batched with."""
    out = [0] * len(params)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    for rows in groups.values():
        cdf_NV = filter_logits(logits_BV[rows], params[rows[0]]).softmax(-1).cumsum(-1)
        u_N = torch.cat([torch.rand(1, generator=gens[i]) for i in rows])
        x_N1 = (u_N.to(cdf_NV.device, non_blocking=True) * cdf_NV[:, -1])[:, None]
        # right=True: a token of probability 0 (cdf equal to its predecessor's) is never the first to pass x
        drawn = torch.searchsorted(cdf_NV, x_N1, right=True)[:, 0].clamp_(max=cdf_NV.shape[-1] - 1).tolist()
        for i, t in zip(rows, drawn):
            out[i] = t
    return out


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
