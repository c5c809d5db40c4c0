"""Text deltas for streaming: turn a growing list of token ids into the new text to send.

Two things must never reach the client early: half of a multi-byte character (a byte tokenizer
decodes it as U+FFFD until the rest arrives) and the start of a stop string (the engine ends the
text *before* a stop string, so a streamed prefix of one would have to be taken back). Both are held
back until the next token settles them; `finish` sends whatever the engine's final text adds.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already sent

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that are not safe to send yet."""
        held = 0
        if text.endswith("\ufffd"):  # possibly an incomplete UTF-8 sequence
            held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:  # the longest suffix of text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def push(self, token_id: int) -> str:
        """Add one token; the text that is now safe to send ('' if none)."""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        cut = min((text.index(s) for s in self.stop if s in text), default=None)
        end = cut if cut is not None else len(text) - self._held(text)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at any stop string)."""
        delta = final_text[self.sent:]
        self.sent = len(final_text)
        return delta
