"""Text deltas for streaming: what of a sequence's new text may be sent now.

The engine's incremental decoder (tokenizer.IncrementalDecoder) never gives out half a character. What
must still not reach the client early is the start of a stop string: the engine ends the text *before*
a stop string, so a streamed prefix of one would have to be taken back. It is held until the next
delta settles it; `finish` sends whatever the engine's final text adds. Work per delta is bounded by
the stop strings' length, not the text's.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, stop: list[str]):
        self.stop = stop
        self.pending = ""  # text received but not sent: at most a stop string's length, or the rest after a stop
        self.sent = 0  # characters of the text already sent
        self.stopped = False

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that could begin a stop string."""
        held = 0
        for s in self.stop:  # the longest suffix of text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def push(self, delta: str) -> str:
        """Add the sequence's next text; the text that is now safe to send ('' if none)."""
        if self.stopped:
            return ""
        self.pending += delta
        cut = min((self.pending.index(s) for s in self.stop if s in self.pending), default=None)
        if cut is not None:
            self.stopped = True
            end = cut
        else:
            end = len(self.pending) - self._held(self.pending)
        out, self.pending = self.pending[:end], self.pending[end:]
        self.sent += len(out)
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at any stop string)."""
        delta = final_text[self.sent:]
        self.sent = len(final_text)
        return delta
