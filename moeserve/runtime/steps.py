"""The step engine: the executor of the scheduler's plans (scheduler.py) on the model runner.

The scheduler decides each step on the host: which sequences prefill how many prompt tokens in which slots,
which running sequences ride in a prompt's call or decode after it, whose slot takes a copy of a prompt's
cache rows. The step engine runs that plan (the runner's prefill, step_rows, copy_prefix and decode calls),
chooses each row's token, and feeds it back: to the sequence's output processor (output.py: text, stop
strings, stream events, log-probabilities), and to the scheduler when the sequence ends.

Everything that makes a sequence's tokens its own lives on the sequence: its seeded generator, its output,
the log-probabilities it asked for (of the model's own distribution, before temperature and filtering). A
prompt's tokens therefore do not depend on which other sequences share its steps, up to the rounding of
batched GEMMs (fp32 on CPU: exact in the tests).
"""

from __future__ import annotations

import secrets
from typing import Any, Callable

import torch
from torch import Tensor

from moeserve.config import MoEConfig
from moeserve.runtime.moe import MoEAux
from moeserve.runtime.backends.base import ModelRunner
from moeserve.runtime.output import Completion, OutputProcessor
from moeserve.runtime.profiling import DECODE, OUTPUT, PREFILL, SAMPLE, phase
from moeserve.runtime.sampling import EngineError, SamplingParams, TokenLogprob, sample_rows, token_logprobs
from moeserve.runtime.scheduler import Plan, Prefill, Scheduler, Sequence
from moeserve.runtime.validate import check_token_ids
from moeserve.tokenizer import Tokenizer

__all__ = ["Completion", "Sequence", "StepEngine", "check_request"]


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


class StepEngine:
    """Sequences over `slots` cache slots of `max_len` positions each, advanced one `step` at a time: the
    scheduler's plan, run. One thread calls it; `on_aux` gets each model call's MoE aux (for expert-load
    accounting), `on_decode(path, n)` the n rows each decode ran on the "graph" or "eager", `on_prefill(path, n)`
    the n prompt tokens each prefill call wrote.

    `share_prefill`: a request's n choices share one prefill where the runner can copy cache rows
    (`can_copy_prefix`). Decode rows ride in a step's prompt chunk where the runner takes rows of any lengths
    (`can_step_rows`), unless it decodes on a compiled graph (`graph_decode`, read each step)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, eos_id: int | None, *, slots: int,
                 max_len: int, prefill_chunk: int = 512, on_aux: Callable[[list[MoEAux]], None] | None = None,
                 share_prefill: bool = True, on_decode: Callable[[str, int], None] | None = None,
                 on_prefill: Callable[[str, int], None] | None = None):
        if slots < 1 or prefill_chunk < 1:
            raise ValueError(f"slots = {slots}, prefill_chunk = {prefill_chunk}: expected integers >= 1")
        self.runner, self.tokenizer, self.eos_id = runner, tokenizer, eos_id
        self.max_len = max_len
        self.on_aux, self.on_decode, self.on_prefill = on_aux, on_decode, on_prefill
        self.scheduler = Scheduler(slots, prefill_chunk, share_prefill=share_prefill and runner.can_copy_prefix)
        self.cache: Any = runner.new_cache(slots, max_len)
        self.model_calls = 0  # the runner's calls so far, whatever path each took (C step, graph, eager)

    @property
    def slots(self) -> int:
        return self.scheduler.slots

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def free_slots(self) -> int:
        return self.scheduler.free_slots

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def graph_decode(self) -> bool:
        """Asked each step: a compiled runner whose graph failed goes eager for good (runner._guarded)."""
        return self.runner.graph_decode

    # ---- joining -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Check a sequence, give it its generator and output, and queue it (it ends at once with nothing to
        compute: a budget of 0 and no prompt log-probabilities)."""
        check_request(self.runner.cfg, self.tokenizer, seq.prompt, seq.params)
        p = seq.params
        seq.budget = min(p.max_new_tokens, self.runner.cfg.max_seq_len - len(seq.prompt))
        if len(seq.prompt) + seq.budget > self.max_len:
            raise EngineError(f"{len(seq.prompt)} prompt tokens and {seq.budget} new ones do not fit the cache's "
                              f"{self.max_len} positions")
        seq.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        seq.output = OutputProcessor(self.tokenizer, self.eos_id, p, len(seq.prompt), seq.budget, seq.on_event)
        self.scheduler.add(seq)

    def reset(self) -> list[Sequence]:
        """A fresh cache and no live sequences (after a failed step, which leaves the cache in an unknown state);
        the sequences dropped."""
        self.cache = self.runner.new_cache(self.slots, self.max_len)
        return self.scheduler.drop_sequences()

    # ---- a step --------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The scheduler's next step for this runner."""
        return self.scheduler.schedule(self.runner.can_step_rows, self.graph_decode)

    def step(self) -> list[Sequence]:
        """Advance every live sequence by one step; the sequences that ended in it."""
        return self.execute(self.plan())

    @torch.inference_mode()
    def execute(self, plan: Plan) -> list[Sequence]:
        """Run a plan's model calls; the sequences that ended in its step (cancelled ones first)."""
        ended = list(plan.ended)
        for call in plan.prefills:
            self._prefill(call, ended)
        self._decode([s for s in plan.decode if not s.done], ended)
        return ended

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Add `seqs` and step until every one has ended (a static batch)."""
        for seq in seqs:
            self.add(seq)
        while not self.idle:
            self.step()
        return seqs

    def _prefill(self, call: Prefill, ended: list[Sequence]) -> None:
        """One call writing prompt chunks (and carrying running rows' tokens); rows whose prompt it completes, and
        their forks, choose their first token from its logits."""
        seqs, carry = call.seqs, call.carry
        chunks = [s.prompt[a:a + t] for s, a, t in zip(seqs, call.starts, call.takes)]
        with phase(PREFILL):
            if len(seqs) == 1 and not carry:
                ids = torch.tensor(chunks[0], device=self.runner.device)
                out = self.runner.prefill(self.cache, seqs[0].slot, ids, call.starts[0], all_logits=call.scored)
            else:
                rows = [*seqs, *carry]
                out = self.runner.step_rows(self.cache, [s.slot for s in rows],
                                            chunks + [[s.out[-1]] for s in carry],
                                            call.starts + [self._position(s) for s in carry])
            self.model_calls += 1
            self._account(out.aux)
        if self.on_prefill is not None:
            self.on_prefill("graph" if out.graph else "eager", sum(call.takes))
        if call.scored:
            self._score_prompt(seqs[0], call.starts[0], out.logits[0, -call.takes[0]:])
        for b, seq in enumerate(seqs):
            if not call.complete(b):
                continue
            for fork in call.forks[b]:
                self.runner.copy_prefix(self.cache, seq.slot, fork.slot, len(seq.prompt))
                fork.output.prompt_logprobs[:] = seq.prompt_logprobs
            live = []
            for s in [seq, *call.forks[b]]:
                if s.budget == 0:  # scored, nothing to generate
                    self._end(s, "length", ended)
                else:
                    live.append(s)
            if live:
                self._choose(live, out.logits[b:b + 1, -1].expand(len(live), -1), ended)
        if carry:
            self._choose(carry, out.logits[len(seqs):, -1], ended)
            self._count("eager", len(carry))

    def _score_prompt(self, seq: Sequence, start: int, logits_NV: Tensor) -> None:
        """The prompt tokens that the rows of this chunk predict (the first token has no prediction)."""
        if start == 0:
            seq.prompt_logprobs.append(None)
        targets = seq.prompt[start + 1:start + 1 + logits_NV.shape[0]]  # the chunk's last row predicts past it
        if targets:
            n = len(targets)
            seq.prompt_logprobs.extend(token_logprobs(logits_NV[:n], targets, [seq.params.prompt_logprobs] * n))

    def _decode(self, rows: list[Sequence], ended: list[Sequence]) -> None:
        if not rows:
            return
        with phase(DECODE):
            ids = torch.tensor([s.out[-1] for s in rows], device=self.runner.device)
            out = self.runner.decode(self.cache, [s.slot for s in rows], ids, [self._position(s) for s in rows])
            self.model_calls += 1
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
        """One token per row (`_tokens`), each to its row's output: two phases of a profile, the second the host's
        alone (detokenising, stop checks, stream events)."""
        with phase(SAMPLE):
            tokens, logprobs = self._tokens(rows, logits_BV)
        with phase(OUTPUT):
            for seq, t, lp in zip(rows, tokens, logprobs):
                if seq.output.accept(t, lp) is not None:
                    self._end(seq, None, ended)

    @staticmethod
    def _tokens(rows: list[Sequence], logits_BV: Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        """The argmax of the greedy rows in one device call, and the sampling rows' draws, each from the row's own
        generator, in another (sample_rows): a host sync each; the log-probabilities of the rows that ask."""
        sampled = [i for i, seq in enumerate(rows) if not seq.params.greedy]
        tokens = ([0] * len(rows) if len(sampled) == len(rows) else  # in fp32: torch's bf16 argmax is slower
                  logits_BV.float().argmax(dim=-1).tolist())
        if sampled:  # every sampling row in one call: one host sync, not one a row
            drawn = sample_rows(logits_BV[sampled], [rows[i].params for i in sampled],
                                [rows[i].generator for i in sampled])
            for i, t in zip(sampled, drawn):
                tokens[i] = t
        scored = [i for i, seq in enumerate(rows) if seq.params.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if scored:
            found = token_logprobs(logits_BV[scored], [tokens[i] for i in scored],
                                   [rows[i].params.logprobs for i in scored])
            for i, lp in zip(scored, found):
                logprobs[i] = lp
        return tokens, logprobs

    def _end(self, seq: Sequence, reason: str | None, ended: list[Sequence]) -> None:
        self.scheduler.end(seq, reason)
        ended.append(seq)
