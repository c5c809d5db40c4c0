"""What a score is reported in, written once for the engine and the HTTP server."""

from __future__ import annotations

import math


def bits_per_byte(logprob: float, text: str) -> float:
    """-logprob / ln 2 / the text's UTF-8 bytes: comparable across tokenizers, as bits per token is not."""
    return -logprob / math.log(2) / len(text.encode("utf-8"))
