"""The checks on what a caller hands the model, written once: the HTTP server, the engine, the step engine
and batch scoring each call these, so that one input gets one verdict and one message wherever it arrives.

Each raises EngineError (a UserError: the caller's fault) naming `what` was wrong.
"""

from __future__ import annotations

from typing import Any

from moeserve.runtime.sampling import EngineError


def check_unicode(text: str, what: str = "text") -> None:
    """JSON may escape a lone surrogate ("\\ud800"): a str that is no UTF-8 text, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EngineError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                          f"{e.start}") from None


def check_text(text: Any, what: str = "text") -> str:
    """`text` if it is a non-empty string of valid Unicode: something a tokenizer can encode."""
    if not isinstance(text, str):
        raise EngineError(f"{what} must be a string, got {type(text).__name__}")
    if not text:
        raise EngineError(f"{what} is empty")
    check_unicode(text, what)
    return text


def check_token_ids(ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    """Every id an int (not a bool) in [0, vocab_size): anything else would index past the embedding."""
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
        raise EngineError(f"{what} has a token id outside [0, {vocab_size})")
