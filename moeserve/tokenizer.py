"""Tokenizers: the built-in byte-level one, and a checkpoint's own tokenizer.json.

The byte tokenizer needs no vocabulary file and no download, encodes any text losslessly, and makes
bits-per-byte a direct function of the loss (one token = one byte).

`load_checkpoint_tokenizer(path, config)` is what loaders call: the tokenizer a checkpoint's config
names, with a Hugging Face config's bos/eos token ids, or None for a checkpoint without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moeserve.config import MoEConfig


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str, bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, then <bos>=256, <eos>=257, <pad>=258."""

    n_bytes = 256
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        # Special ids carry no text; a cut in the middle of a multi-byte character decodes to U+FFFD
        # rather than raising, because generation can stop anywhere.
        return bytes(i for i in ids if 0 <= i < self.n_bytes).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json, read with the `tokenizers` package (no download).

    bos_id / eos_id, where given (a Hugging Face config.json's bos_token_id / eos_token_id), win over
    looking up the bos_token / eos_token strings in the vocabulary."""

    def __init__(self, path: str | Path, bos_token: str | None = "<s>", eos_token: str | None = "</s>", *,
                 bos_id: int | None = None, eos_id: int | None = None):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"{path} needs the 'tokenizers' package: pip install tokenizers") from e
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"{path}: {name} = {value!r}: expected a token id in [0, {self.vocab_size})")
        self.bos_id = bos_id if bos_id is not None else self._tok.token_to_id(bos_token) if bos_token else None
        self.eos_id = eos_id if eos_id is not None else self._tok.token_to_id(eos_token) if eos_token else None
        self.pad_id = self.eos_id if self.eos_id is not None else 0

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDecoder:
    """One sequence's text, decoded as its tokens arrive, at a cost per token that does not grow with
    the text: each push decodes only the tokens since the last settled point (a tokenizer may need a
    token's left neighbour to render it, e.g. a leading space), and the difference is the new text.
    Text that ends in U+FFFD (a multi-byte character cut in half) is held until the next token settles
    it, so no delta ever shows half a character; `flush` gives what is held when generation ends."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already given out, the context for what follows
        self._read = 0
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, token_id: int) -> str:
        """Add a token; the text it settles ('' while a character is incomplete)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held (a character left incomplete decodes as U+FFFD, as `decode` would)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read])
        after = decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self._parts.append(delta)
        return delta


def load_tokenizer(kind: str, checkpoint_dir: str | Path | None = None, *, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer:
    """The tokenizer of `kind`; bos_id / eos_id apply to 'hf' only (the byte tokenizer's are fixed)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if checkpoint_dir is None:
            raise ValueError("tokenizer kind 'hf' needs the checkpoint directory holding tokenizer.json")
        path = Path(checkpoint_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config says tokenizer 'hf' but there is no tokenizer.json")
        return HFTokenizer(path, bos_id=bos_id, eos_id=eos_id)
    if kind == "none":
        raise ValueError(f"{checkpoint_dir or 'this checkpoint'}: has no tokenizer (tokenizer 'none', no "
                         f"tokenizer.json); give token ids instead of text")
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte', 'hf' or 'none'")


def load_checkpoint_tokenizer(path: str | Path, config: MoEConfig) -> Tokenizer | None:
    """The tokenizer of the checkpoint at `path` whose config is `config`; None when it has none.
    A Hugging Face directory's config.json bos_token_id / eos_token_id (kept in config.extra) set the
    special ids, not the '<s>' / '</s>' strings."""
    if config.tokenizer == "none":
        return None
    return load_tokenizer(config.tokenizer, path, bos_id=config.extra.get("bos_token_id"),
                          eos_id=config.extra.get("eos_token_id"))
