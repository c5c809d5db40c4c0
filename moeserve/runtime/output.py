"""One sequence's output: its tokens in; its text, stream events and final completion out.

Everything about what a sequence's tokens *say* lives here, once: the end-of-sequence token, the token
budget, incremental detokenising (tokenizer.IncrementalDecoder never gives out half a character), stop
strings, and the log-probability records. The streamed text and the final completion's text are the
same text, cut in the same place, because both come from this one processor.

A stop string ends the text *before* it, so text that could be the start of one is held back until the
next token settles it: a streamed prefix of a stop string could not be taken back. Tokens whose text is
held ride with the next event. Work per token is bounded by the stop strings' length, not the text's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from moeserve.runtime.sampling import SamplingParams, TokenLogprob
from moeserve.tokenizer import IncrementalDecoder, Tokenizer


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


@dataclass
class StreamEvent:
    """Text that is final since the last event, the tokens that brought it (with their log-probability records,
    where asked), and on a sequence's last event its finish reason."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


EventCallback = Callable[[StreamEvent], None]


def held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that could begin a stop string: the longest suffix of text that is a
    proper prefix of one."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = max(held, n)
                break
    return held


class OutputProcessor:
    """A sequence's output: `accept` each chosen token; `finish` ends it from outside (cancellation). Events go to
    `on_event` as text becomes final; `completion` is the whole answer."""

    def __init__(self, tokenizer: Tokenizer | None, eos_id: int | None, params: SamplingParams, prompt_tokens: int,
                 budget: int, on_event: EventCallback | None = None):
        self.eos_id, self.params, self.prompt_tokens, self.budget = eos_id, params, prompt_tokens, budget
        self.on_event = on_event
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # per token of token_ids, if params.logprobs is set
        self.prompt_logprobs: list[TokenLogprob | None] = []  # if params.prompt_logprobs is set
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None  # time.monotonic() of the first token chosen (time to first token)
        self._parts: list[str] = []  # the text given out
        self._held = ""  # text not yet given out: at most a stop string's length less one
        self._stopped = False  # a stop string was found; nothing after it is text
        self._tokens: list[int] = []  # tokens (and their records) not yet in an event
        self._records: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def accept(self, token: int, logprob: TokenLogprob | None) -> str | None:
        """Add a chosen token; the finish reason if it ended the sequence. The end-of-sequence token ends it
        without being part of it."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if token == self.eos_id and not self.params.ignore_eos:
            return self._end("stop", "")
        self.token_ids.append(token)
        self._tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self._records.append(logprob)
        ready = self._settle(self.decoder.push(token)) if self.decoder is not None else ""
        if len(self.token_ids) >= self.budget:
            return self._end("length", ready)
        if self._stopped:
            return self._end("stop", ready)
        if ready:
            self._event(ready, None)
        return None

    def finish(self, reason: str) -> None:
        """End the sequence for a reason of the caller's ("cancelled", "length" when nothing is to be generated)."""
        if not self.done:
            self._end(reason, "")

    def completion(self) -> Completion:
        p = self.params
        return Completion(self.text, self.token_ids, self.finish_reason or "length", self.prompt_tokens,
                          self.logprobs if p.logprobs is not None else None,
                          self.prompt_logprobs if p.prompt_logprobs is not None else None)

    def _settle(self, delta: str) -> str:
        """Add new text; the part that is final now. A stop string ends the text before the earliest one."""
        if self._stopped or not delta:
            return ""
        pending, stop = self._held + delta, self.params.stop
        cut = min((pending.index(s) for s in stop if s in pending), default=None)
        if cut is not None:
            self._stopped, self._held = True, ""
            return pending[:cut]
        end = len(pending) - held_back(pending, stop)
        self._held = pending[end:]
        return pending[:end]

    def _end(self, reason: str, ready: str) -> str:
        """Finish with `reason`: what the decoder still holds, and any text held at a possible stop string, is text
        after all (unless a stop string was found); the last event carries the finish reason."""
        if self.decoder is not None:
            ready += self._settle(self.decoder.flush())
        ready, self._held = ready + self._held, ""
        self.finish_reason = reason
        self._event(ready, reason)
        return reason

    def _event(self, text: str, finish_reason: str | None) -> None:
        self._parts.append(text)
        if self.on_event is not None:
            self.on_event(StreamEvent(text, self._tokens, self._records, finish_reason))
        self._tokens, self._records = [], []
