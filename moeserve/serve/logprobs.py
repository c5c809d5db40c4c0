"""Log-probability records (runtime.sampling.TokenLogprob) in the two shapes OpenAI clients read.

    completions (legacy)  {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
    chat                  {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

A token's text is what decoding its sequence gains by it, decoded in the context of the few tokens
before it (a tokenizer may render a token differently after another, e.g. a leading space), so that
the texts of a choice's tokens join into its text. A token that holds part of a multi-byte character
decodes to U+FFFD, and `bytes` are the UTF-8 of the text. An alternative token's text is decoded in
the same context as the token it stands beside.
"""

from __future__ import annotations

from moeserve.runtime.sampling import TokenLogprob
from moeserve.tokenizer import Tokenizer

CONTEXT = 4  # tokens before a token that its text is decoded after


class TokenTexts:
    """The text of each token of one sequence (prompt and generated tokens), and of its alternatives."""

    def __init__(self, tokenizer: Tokenizer, ids: list[int]):
        self.decode, self.ids = tokenizer.decode, ids

    def at(self, i: int, tokens: list[int]) -> list[str]:
        """The text of each of `tokens` if it stood at position i (after ids[:i])."""
        context = self.ids[max(0, i - CONTEXT):i]
        before = self.decode(context)
        out = []
        for t in tokens:
            after = self.decode([*context, t])
            out.append(after[len(before):] if after.startswith(before) else self.decode([t]))
        return out


def completion_logprobs(texts: TokenTexts, start: int, records: list[TokenLogprob | None]) -> dict:
    """The legacy shape for tokens start.. of the sequence, one record each (None: the prompt's first
    token, which nothing predicts). top_logprobs holds the alternatives and the token itself."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for k, record in enumerate(records):
        i = start + k
        if record is None:
            text = texts.at(i, [texts.ids[i]])[0]
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            text, *alternatives = texts.at(i, [record.token, *(t for t, _ in record.top)])
            top: dict[str, float] = {}
            for alt, (_, lp) in zip(alternatives, record.top):
                top.setdefault(alt, lp)  # two ids of the same text: the likelier one
            top.setdefault(text, record.logprob)
            token_logprobs.append(record.logprob)
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, start: int, records: list[TokenLogprob]) -> list[dict]:
    """The chat shape's `content` entries for generated tokens start.. of the sequence."""
    out = []
    for k, record in enumerate(records):
        text, *alternatives = texts.at(start + k, [record.token, *(t for t, _ in record.top)])
        out.append({"token": text, "logprob": record.logprob, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode("utf-8"))}
                                     for a, (_, lp) in zip(alternatives, record.top)]})
    return out
