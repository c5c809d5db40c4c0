"""Rolling windows: scoring a text longer than the model's context, every token once.

A row of n tokens (the first, <bos>, only conditions) fits the context C when n <= C and is one
window. A longer row is cut as lm-evaluation-harness and Hugging Face's perplexity guide cut it: the
first window is ids[0:C], scoring tokens 1..C-1; each later window ends `stride` tokens further on
(the last one at n), is C tokens long, and scores only the tokens past the previous window's end.
So every token is scored exactly once, and a token scored by a later window sees at least C - stride
tokens before it (at most C - 1). A small stride gives every token nearly the whole context and
costs n / stride windows; stride C - 1 gives disjoint windows (lm-evaluation-harness's
`loglikelihood_rolling`), the fewest, where a window's first scored token sees one token.
"""

from __future__ import annotations

from moeserve.errors import UserError


def default_stride(context: int) -> int:
    """Half the context: each token keeps at least C/2 tokens of context, at about 2x the disjoint cost."""
    return max(1, context // 2)


def check_stride(stride: int, context: int) -> None:
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride < context:
        raise UserError(f"stride = {stride!r}: expected an integer in [1, {context - 1}] (the model's context of "
                        f"{context} tokens, less the one a window's first scored token needs)")


def rolling_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, scored) per window over a row of n tokens: ids[start:end] runs through the model and
    its last `scored` tokens are scored."""
    if n <= context:
        return [(0, n, n - 1)]
    check_stride(stride, context)
    windows, end = [(0, context, context - 1)], context
    while end < n:
        new_end = min(end + stride, n)
        windows.append((new_end - context, new_end, new_end - end))
        end = new_end
    return windows


def batch_end(widths: list[int], start: int, max_tokens: int) -> int:
    """The end of the consecutive run of items from `start` that is at most `max_tokens` once padded to its widest
    item (at least one item: an item wider than that goes alone)."""
    widest, end = widths[start], start + 1
    while end < len(widths) and (end - start + 1) * max(widest, widths[end]) <= max_tokens:
        widest, end = max(widest, widths[end]), end + 1
    return end


def consecutive_batches(widths: list[int], max_tokens: int) -> list[range]:
    """Consecutive runs of items, each at most `max_tokens` once padded to its widest item (an item wider
    than that goes alone). In order, unlike a length-sorted plan: windows of one row stay together."""
    batches, start = [], 0
    while start < len(widths):
        end = batch_end(widths, start, max_tokens)
        batches.append(range(start, end))
        start = end
    return batches
