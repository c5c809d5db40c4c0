"""The step engine: generation as a sequence of steps over a slot KV cache, which sequences join
and leave at any step (continuous batching).

A step (1) drops cancelled sequences, (2) admits waiting sequences into free slots and prefills
them, at most `prefill_chunk` prompt tokens per step while others are decoding (a long prompt is
written over several steps, so running streams keep flowing), and (3) decodes one token for every
running sequence. Where the runner takes rows of any lengths in one call (`step_rows`), the prompts'
chunks and the running sequences' tokens share one model call: a model call reads every expert's
weights whatever its rows, so the decode rows ride on the prompt's read instead of a read of their
own, and the step stalls the running streams for one call, not two. A sequence leaves the step it
ends (end-of-sequence, its token budget, a stop string, cancellation) and its slot is free for the
next step. When a prompt's prefill ends, waiting
sequences with the same prompt (a request's n choices) start from a copy of its cache rows instead of
prefilling it again.

Everything that makes a sequence's tokens its own lives on the sequence: its seeded generator, its
incremental decoder (text is decoded once per token, not re-decoded in full), its stop strings, the
log-probabilities it asked for (of the model's own distribution, before temperature and filtering). A
prompt's tokens therefore do not depend on which other sequences share its steps, up to the
rounding of batched GEMMs (fp32 on CPU: exact in the tests).
"""

from __future__ import annotations

import heapq
import math
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.runner import ModelRunner
from moeserve.runtime.sampling import EngineError, SamplingParams, TokenLogprob, sample, token_logprobs
from moeserve.runtime.validate import check_token_ids
from moeserve.tokenizer import IncrementalDecoder, Tokenizer

# on_token(token_id, text, logprob): called on the engine's thread as each token is chosen, with the text it
# settles and its log-probability record (None unless the sequence's params ask for log-probabilities).
TokenCallback = Callable[[int, str, TokenLogprob | None], None]


def check_request(cfg: MoEConfig, tokenizer: Tokenizer | None, prompt: list[int], params: SamplingParams,
                  what: str = "prompt") -> None:
    """Raise EngineError for a request the model cannot run, before anything runs."""
    params.validate()
    if not prompt:
        raise EngineError(f"{what} has no tokens")
    check_token_ids(prompt, cfg.vocab_size, what)
    if len(prompt) >= cfg.max_seq_len and params.max_new_tokens > 0:
        raise EngineError(f"{what} is {len(prompt)} tokens; the model's context is {cfg.max_seq_len}")
    if params.stop and tokenizer is None:
        raise EngineError("stop strings need a tokenizer; this model has none")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or a stop string), "length", or "cancelled"
    prompt_tokens: int
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, if asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), if asked

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Sequence:
    """One prompt being continued: what it asked for, and everything that is its own."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_token: TokenCallback | None = None
    cancelled: Callable[[], bool] | None = None  # asked before each step; True ends it ("cancelled")
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    slot: int | None = None
    prefilled: int = 0  # prompt tokens written to the cache so far
    budget: int = 0  # new tokens it may have: max_new_tokens, within the context
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token of `out`, if params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # if params.prompt_logprobs is set
    _tail: str = ""  # the end of the text, as long as the longest stop string less one: where a stop may begin

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> Completion:
        text = ""
        if self.decoder is not None:
            self.decoder.flush()
            text = self.decoder.text
            cut = min((text.index(s) for s in self.params.stop if s in text), default=None)
            if cut is not None:
                text = text[:cut]
        p = self.params
        return Completion(text, self.out, self.finish_reason or "length", len(self.prompt),
                          self.logprobs if p.logprobs is not None else None,
                          self.prompt_logprobs if p.prompt_logprobs is not None else None)


class StepEngine:
    """Sequences over `slots` cache slots of `max_len` positions each, advanced one `step` at a time.
    One thread calls it; `on_aux` gets each model call's MoE aux (for expert-load accounting).

    `share_prefill`: when a prompt's prefill ends, waiting sequences with the same prompt (a request's n
    choices) take free slots at once with a copy of its cache rows and its last logits, instead of
    computing them again (where the runner can copy cache rows: `copy_prefix`).

    Decode rows ride in the step's prompt chunk (one read of the weights for both) unless the runner decodes on a
    compiled graph (`graph_decode`): then they take the graph after the chunk, as vLLM runs its decode batch on a
    CUDA graph beside the prefill. `on_decode(path, n)`: n rows decoded on the "graph" or "eager"."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, eos_id: int | None, *, slots: int,
                 max_len: int, prefill_chunk: int = 512, on_aux: Callable[[list[MoEAux]], None] | None = None,
                 share_prefill: bool = True, on_decode: Callable[[str, int], None] | None = None):
        if slots < 1 or prefill_chunk < 1:
            raise ValueError(f"slots = {slots}, prefill_chunk = {prefill_chunk}: expected integers >= 1")
        self.runner, self.tokenizer, self.eos_id = runner, tokenizer, eos_id
        self.slots, self.max_len, self.prefill_chunk = slots, max_len, prefill_chunk
        self.on_aux, self.on_decode = on_aux, on_decode
        self.share_prefill = share_prefill and runner.can_copy_prefix
        self.cache: Any = runner.new_cache(slots, max_len)
        self._free = list(range(slots))  # a heap: the lowest free slot first, so live slots stay one range
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # holding a slot, prompt not yet fully written
        self.running: list[Sequence] = []  # decoding

    # ---- joining -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it joins at the next step with a free slot (at once if its budget is 0)."""
        check_request(self.runner.cfg, self.tokenizer, seq.prompt, seq.params)
        p = seq.params
        seq.budget = min(p.max_new_tokens, self.runner.cfg.max_seq_len - len(seq.prompt))
        if len(seq.prompt) + seq.budget > self.max_len:
            raise EngineError(f"{len(seq.prompt)} prompt tokens and {seq.budget} new ones do not fit the cache's "
                              f"{self.max_len} positions")
        seq.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        seq.decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        if seq.budget == 0 and p.prompt_logprobs is None:  # nothing to compute
            seq.finish_reason = "length"
            return
        self.waiting.append(seq)

    @property
    def graph_decode(self) -> bool:
        """Asked each step: a compiled runner whose graph failed goes eager for good (runner._guarded)."""
        return self.runner.graph_decode

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # ---- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Advance every live sequence by one step; the sequences that ended in it."""
        ended: list[Sequence] = []
        for seq in [*self.waiting, *self.prefilling, *self.running]:
            if seq.cancelled is not None and seq.cancelled():
                self._finish(seq, "cancelled", ended)
        decoding = [s for s in self.running if len(s.out) > 0 and not s.done]
        carry = self.runner.can_step_rows and not self.graph_decode
        if not self._prefill(ended, decoding if carry else []):
            self._decode(ended, decoding if self.graph_decode else None)
        return ended

    def _prefill(self, ended: list[Sequence], decoding: list[Sequence]) -> bool:
        """Prefill what the budget allows, the first call carrying `decoding`'s next tokens where it can;
        whether it did."""
        budget = self.prefill_chunk if self.running else math.inf  # nothing to keep flowing: no need to chunk
        carried = False
        while budget > 0:
            self._admit(budget)
            if not self.prefilling:
                break
            group, takes = self._prefill_group(budget)
            scored = group[0].params.prompt_logprobs is not None  # then alone: logits at every position
            carry = [] if carried or scored else decoding
            chunks = [s.prompt[s.prefilled:s.prefilled + t] for s, t in zip(group, takes)]
            if len(group) == 1 and not carry:
                out = self.runner.prefill(self.cache, group[0].slot, torch.tensor(chunks[0], device=self.runner.device),
                                          group[0].prefilled, all_logits=scored)
            else:
                rows = [*group, *carry]
                out = self.runner.step_rows(self.cache, [s.slot for s in rows], chunks + [[s.out[-1]] for s in carry],
                                            [s.prefilled for s in group] + [self._position(s) for s in carry])
            self._account(out.aux)
            if scored:
                self._score_prompt(group[0], out.logits[0, -takes[0]:])
            budget -= sum(takes)
            for b, seq in enumerate(group):
                seq.prefilled += takes[b]
                if seq.prefilled < len(seq.prompt):
                    continue
                self.prefilling.remove(seq)
                forked = [seq, *self._forks(seq)]
                for f in forked:
                    if f.budget == 0:  # scored, nothing to generate
                        self._finish(f, "length", ended)
                    else:
                        self.running.append(f)
                live = [f for f in forked if not f.done]
                if live:
                    self._choose(live, out.logits[b:b + 1, -1].expand(len(live), -1), ended)
            if carry:
                self._choose(carry, out.logits[len(group):, -1], ended)
                self._count("eager", len(carry))
                carried = True
        return carried

    def _admit(self, budget: float) -> None:
        """Waiting sequences take free slots, in arrival order, while this step's prompt budget has room for
        them; one with the prompt of a sequence being prefilled waits to start from its copy (`_forks`)."""
        pending = sum(len(s.prompt) - s.prefilled for s in self.prefilling)
        for seq in list(self.waiting):
            if not self._free or pending >= budget:
                return
            if self.share_prefill and any(p.prompt == seq.prompt for p in self.prefilling):
                continue
            self.waiting.remove(seq)
            seq.slot = heapq.heappop(self._free)
            self.prefilling.append(seq)
            pending += len(seq.prompt)

    def _prefill_group(self, budget: float) -> tuple[list[Sequence], list[int]]:
        """The sequences prefilled in one model call and how many prompt tokens each writes: prefilling
        sequences in order, each as much of its prompt as the budget has left. A model call reads every expert's
        weights whatever its rows, so prompts arriving together share one read instead of one each (on the
        644M Mixtral, 8 prompts of ~70 tokens were 8 calls of ~300 ms, stalling every running stream for 2 s).
        Rows that ask for prompt log-probabilities, or a runner that cannot write several slots at once, go
        alone."""
        head = self.prefilling[0]
        scored = head.params.prompt_logprobs is not None
        takes = [int(min(budget, len(head.prompt) - head.prefilled, self.prefill_chunk if scored else math.inf))]
        group = [head]
        if scored or not self.runner.can_step_rows:
            return group, takes
        left = budget - takes[0]
        for seq in self.prefilling[1:]:
            if left <= 0:
                break
            if seq.params.prompt_logprobs is None:
                group.append(seq)
                takes.append(int(min(len(seq.prompt) - seq.prefilled, left)))
                left -= takes[-1]
        return group, takes

    def _score_prompt(self, seq: Sequence, logits_NV: Tensor) -> None:
        """The prompt tokens that the rows of this chunk predict (the first token has no prediction)."""
        start = seq.prefilled
        if start == 0:
            seq.prompt_logprobs.append(None)
        targets = seq.prompt[start + 1:start + 1 + logits_NV.shape[0]]  # the chunk's last row predicts past it
        if targets:
            n = len(targets)
            seq.prompt_logprobs += token_logprobs(logits_NV[:n], targets, [seq.params.prompt_logprobs] * n)

    def _forks(self, seq: Sequence) -> list[Sequence]:
        """Waiting sequences with seq's prompt, given free slots holding a copy of its cache rows (its
        prompt log-probabilities too): they join without a prefill of their own."""
        if not self.share_prefill:
            return []
        forks = []
        for w in list(self.waiting):
            if not self._free:
                break
            if w.prompt == seq.prompt and w.params.prompt_logprobs == seq.params.prompt_logprobs:
                self.waiting.remove(w)
                w.slot = heapq.heappop(self._free)
                self.runner.copy_prefix(self.cache, seq.slot, w.slot, len(seq.prompt))
                w.prefilled = len(seq.prompt)
                w.prompt_logprobs = list(seq.prompt_logprobs)
                forks.append(w)
        return forks

    def _decode(self, ended: list[Sequence], rows: list[Sequence] | None = None) -> None:
        """A token for each of `rows` still running (default: every running sequence with a token to extend)."""
        if rows is None:
            rows = [s for s in self.running if len(s.out) > 0 and not s.done]
        else:  # the rows that were decoding when the step began, less those it ended
            rows = [s for s in rows if not s.done]
        if not rows:
            return
        ids = torch.tensor([s.out[-1] for s in rows], device=self.runner.device)
        out = self.runner.decode(self.cache, [s.slot for s in rows], ids, [self._position(s) for s in rows])
        self._account(out.aux)
        self._count("graph" if out.graph else "eager", len(rows))
        self._choose(rows, out.logits[:, -1], ended)

    @staticmethod
    def _position(seq: Sequence) -> int:
        """Where a running sequence's last token goes in its slot."""
        return len(seq.prompt) + len(seq.out) - 1

    def _count(self, path: str, rows: int) -> None:
        if self.on_decode is not None:
            self.on_decode(path, rows)

    def _account(self, aux: list[MoEAux]) -> None:
        if self.on_aux is not None:
            self.on_aux(aux)

    def _choose(self, rows: list[Sequence], logits_BV: Tensor, ended: list[Sequence]) -> None:
        """One token per row: the argmax of every row in one device call (the step's one host sync), and a
        draw from the row's own generator where it samples."""
        greedy = logits_BV.float().argmax(dim=-1).tolist()  # torch's bf16 argmax: 117 us over 32000 logits, 33 here
        tokens = [greedy[i] if seq.params.greedy else sample(logits_BV[i], seq.params, seq.generator)
                  for i, seq in enumerate(rows)]
        scored = [i for i, seq in enumerate(rows) if seq.params.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if scored:
            found = token_logprobs(logits_BV[scored], [tokens[i] for i in scored],
                                   [rows[i].params.logprobs for i in scored])
            for i, lp in zip(scored, found):
                logprobs[i] = lp
        for seq, t, lp in zip(rows, tokens, logprobs):
            self._accept(seq, t, lp, ended)

    def _accept(self, seq: Sequence, t: int, logprob: TokenLogprob | None, ended: list[Sequence]) -> None:
        if t == self.eos_id and not seq.params.ignore_eos:
            return self._finish(seq, "stop", ended)
        seq.out.append(t)
        if logprob is not None:
            seq.logprobs.append(logprob)
        delta = seq.decoder.push(t) if seq.decoder is not None else ""
        if seq.on_token is not None:
            seq.on_token(t, delta, logprob)
        if len(seq.out) >= seq.budget:
            self._finish(seq, "length", ended)
        elif seq.params.stop and delta:
            window = seq._tail + delta
            if any(s in window for s in seq.params.stop):
                return self._finish(seq, "stop", ended)
            keep = max(len(s) for s in seq.params.stop) - 1
            seq._tail = window[len(window) - keep:] if keep else ""

    def _finish(self, seq: Sequence, reason: str, ended: list[Sequence]) -> None:
        seq.finish_reason = reason
        for queue in (self.waiting, self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
        if seq.slot is not None:
            heapq.heappush(self._free, seq.slot)
            seq.slot = None
        ended.append(seq)

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Add `seqs` and step until every one has ended (a static batch)."""
        for seq in seqs:
            self.add(seq)
        while not self.idle:
            self.step()
        return seqs
