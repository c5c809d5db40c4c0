"""Training data: a corpus that is always present, a deterministic split, and step-addressed batches.

The default corpus is the Python standard library's own source, so `moeserve train` works offline
with no download, and its SHA-256 lets a recipe record exactly which tokens a model saw. Batches are
a pure function of (seed, step): resuming a run at step N reproduces the uninterrupted run exactly,
with no sampler state to checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from moeserve.errors import UserError
from moeserve.tokenizer import ByteTokenizer

SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
MAX_FILE_BYTES = 200_000  # huge generated tables (e.g. unicode data) would dominate a small corpus
MIN_SPLIT_DOCS = 10  # below this a per-document split leaves val empty or absurdly lopsided


class DataError(UserError):
    """A corpus file is missing, unreadable or malformed, or the data is too small for the request."""


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(max_bytes: int = 12_000_000) -> list[Path]:
    """The stdlib .py files that make up the built-in corpus, in a fixed order.

    Directories and files are visited sorted so the list (and hence the corpus hash) depends only on
    the Python installation, never on filesystem order. Test suites are skipped because they are
    mostly repetitive assertions; files that are not UTF-8 would decode differently per platform.
    """
    files: list[Path] = []
    total = 0
    for path in _stdlib_sources():
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                continue
            path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + size > max_bytes:  # stop rather than skip, so a larger budget only appends
            return files
        files.append(path)
        total += size
    return files


def _stdlib_sources() -> Iterator[Path]:
    """Every stdlib .py file the corpus may draw from, sorted by directory then name."""
    for dirpath, dirnames, filenames in os.walk(_stdlib_root()):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        yield from (Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py"))


def default_corpus_fingerprint() -> str:
    """A cheap identity of the default corpus: the Python version and the names and sizes of the stdlib
    files it is drawn from. A stat per file, no reads (~15 ms, against ~2 s to read and hash the text),
    so that a start with the default model cached does not read the corpus; a Python upgrade or a
    patched stdlib changes it. The trained checkpoint's recipe records the corpus's content hash."""
    root = _stdlib_root()
    h = hashlib.sha256(sysconfig.get_python_version().encode())
    for path in _stdlib_sources():
        try:
            h.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\n".encode())
        except OSError:
            continue
    return h.hexdigest()


@dataclass
class Corpus:
    """Token ids of the train and val splits, with what is needed to record and cite them."""

    train: np.ndarray  # uint16 token ids, each document framed as <bos> text <eos>
    val: np.ndarray  # uint16
    n_documents: int
    sha256: str  # of train bytes + val bytes (little-endian uint16)
    sources: list[str]


def _read_text(path: Path) -> str:
    if not path.exists():
        raise DataError(f"{path}: corpus file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"{path}: cannot read corpus file: {e}") from e


def jsonl_objects(path: Path, lines: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """("path:line", object) for each non-blank line of a JSONL file; any other bad line is an error naming it.

    A bad line is fatal rather than skipped because silently dropping data changes what a model is
    trained on without anyone noticing.
    """
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _jsonl_documents(path: Path, text_field: str) -> list[tuple[str, str]]:
    """(key, text) per line of a corpus's JSONL file."""
    docs = []
    for where, record in jsonl_objects(path, _read_text(path).splitlines()):
        if text_field not in record:
            raise DataError(f"{where}: no field {text_field!r} (fields: {sorted(record)})")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, expected a string")
        docs.append((where, value))
    return docs


def _encode(tokenizer: Any, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # same ids as encode(), ~50x faster than a list of ints
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return np.asarray(tokenizer.encode(text), dtype=np.uint16)


def _join(pieces: list[np.ndarray], bos: int | None, eos: int | None) -> np.ndarray:
    """Frame each document as <bos> text <eos>: the model learns where documents start and end, and a
    prompt encoded with <bos> (as generation does) looks like the start of a training document."""
    head = np.array([bos], dtype=np.uint16) if bos is not None else np.zeros(0, dtype=np.uint16)
    tail = np.array([eos], dtype=np.uint16) if eos is not None else np.zeros(0, dtype=np.uint16)
    parts = [p for piece in pieces for p in (head, piece, tail)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def load_corpus(
    paths: list[str | Path] | None = None,
    *,
    text_field: str = "text",
    val_fraction: float = 0.05,
    tokenizer: Any = None,
) -> Corpus:
    """Read, tokenize and split a corpus (None = the stdlib default corpus).

    `.jsonl` files give one document per line (from `text_field`); any other file is one document.
    With >= 10 documents the split is by document (crc32 of its key), so val text is never seen in
    training; otherwise each document's tokens are cut at (1 - val_fraction).
    """
    if not (isinstance(val_fraction, (int, float)) and 0 < val_fraction < 1):
        raise DataError(f"val_fraction = {val_fraction!r}: expected a number in (0, 1)")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if tokenizer.vocab_size > 65536:
        raise DataError(f"tokenizer vocab_size {tokenizer.vocab_size} does not fit the uint16 token arrays")

    docs: list[tuple[str, str]] = []  # (split key, text)
    sources: list[str] = []
    if paths is None:
        root = _stdlib_root()
        files = default_corpus_files()
        for f in files:
            docs.append((_stdlib_key(f, root), _read_text(f)))
        n_bytes = sum(f.stat().st_size for f in files)
        sources.append(f"python{sysconfig.get_python_version()} stdlib {root}: {len(files)} .py files, {n_bytes} bytes")
    else:
        if not paths:
            raise DataError("no corpus files given")
        for p in paths:
            path = Path(p)
            if path.suffix.lower() == ".jsonl":
                file_docs = _jsonl_documents(path, text_field)
                sources.append(f"{path} ({len(file_docs)} documents, field {text_field!r})")
            else:
                file_docs = [(str(path), _read_text(path))]
                sources.append(str(path))
            docs.extend(file_docs)

    encoded = [(key, _encode(tokenizer, text)) for key, text in docs]
    encoded = [(key, ids) for key, ids in encoded if ids.size]
    if not encoded:
        where = "the default corpus" if paths is None else ", ".join(str(p) for p in paths)
        raise DataError(f"corpus is empty: no text in {where}")

    modulus = round(1 / val_fraction)
    train_docs: list[np.ndarray] = []
    val_docs: list[np.ndarray] = []
    if len(encoded) >= MIN_SPLIT_DOCS:
        for key, ids in encoded:
            (val_docs if _in_val(key, modulus) else train_docs).append(ids)
    if not train_docs or not val_docs:
        train_docs, val_docs = [], []
        for _, ids in encoded:
            cut = int(len(ids) * (1 - val_fraction))
            cut = min(max(cut, 1), len(ids) - 1) if len(ids) >= 2 else len(ids)
            train_docs.append(ids[:cut])
            if cut < len(ids):
                val_docs.append(ids[cut:])
    train = _join(train_docs, tokenizer.bos_id, tokenizer.eos_id)
    val = _join(val_docs, tokenizer.bos_id, tokenizer.eos_id)
    if not train.size or not val.size:
        raise DataError(f"corpus too small to split: {sum(len(i) for _, i in encoded)} tokens in total")

    digest = hashlib.sha256(train.astype("<u2").tobytes() + val.astype("<u2").tobytes()).hexdigest()
    return Corpus(train=train, val=val, n_documents=len(encoded), sha256=digest, sources=sources)


def _check_window(tokens: np.ndarray, batch_size: int, seq_len: int) -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise DataError(f"{name} = {v!r}: expected a positive integer")
    if len(tokens) < seq_len + 1:
        raise DataError(f"token array has {len(tokens)} tokens; a window needs seq_len + 1 = {seq_len + 1}")


class Batcher:
    """Random training windows whose content depends only on (seed, step).

    No iterator state means nothing to save in a checkpoint: the data position of a run is its step.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
        _check_window(tokens, batch_size, seq_len)
        # int32 halves the memory of int64; windows are widened to int64 only when sampled.
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32))
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._offsets = torch.arange(seq_len + 1)

    def _generator(self, step: int) -> torch.Generator:
        # SeedSequence mixes (seed, step) without the collisions of seed * C + step.
        state = np.random.SeedSequence([self.seed & (2**64 - 1), step]).generate_state(2, np.uint32)
        g = torch.Generator()
        g.manual_seed((int(state[0]) << 31) ^ int(state[1]))
        return g

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape [batch_size, seq_len], int64, with y[:, t] == x[:, t + 1] of the same window."""
        if step < 0:
            raise DataError(f"step = {step}: expected >= 0")
        n_starts = len(self.tokens) - self.seq_len
        starts = torch.randint(0, n_starts, (self.batch_size,), generator=self._generator(step))
        window = self.tokens[starts[:, None] + self._offsets].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _stdlib_key(f: Path, root: Path) -> str:
    """A default-corpus document's split key: relative to the stdlib, so the split is the same wherever Python is
    installed."""
    return f"stdlib/{f.relative_to(root).as_posix()}"


def _in_val(key: str, modulus: int) -> bool:
    return zlib.crc32(key.encode("utf-8")) % modulus == 0


def default_val_texts(max_chars: int, val_fraction: float = 0.05) -> list[str]:
    """The default corpus's validation documents (load_corpus's split: text no model trained on it has seen), in
    corpus order, until `max_chars` characters: held-out text for an evaluation that needs text, not token ids."""
    root, modulus = _stdlib_root(), round(1 / val_fraction)
    texts, total = [], 0
    for f in default_corpus_files():
        if total >= max_chars:
            break
        if _in_val(_stdlib_key(f, root), modulus):
            texts.append(_read_text(f))
            total += len(texts[-1])
    return texts


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, disjoint windows spread evenly over `tokens`, for a validation loss comparable across runs.

    Spreading (rather than taking the first windows) samples every part of the val split. Only full
    batches are returned, so each batch weighs the same in a mean; if fewer than `batch_size` windows
    fit, one smaller batch holds them all.
    """
    _check_window(tokens, batch_size, seq_len)
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches <= 0:
        raise DataError(f"max_batches = {max_batches!r}: expected a positive integer")
    width = seq_len + 1
    available = len(tokens) // width
    n_windows = min(max_batches, available // batch_size) * batch_size or available
    span = len(tokens) - width
    # Consecutive starts differ by >= floor(span / (n - 1)) >= width, so windows never overlap.
    starts = [i * span // (n_windows - 1) for i in range(n_windows)] if n_windows > 1 else [0]
    data = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    windows = data[torch.tensor(starts)[:, None] + torch.arange(width)]
    out = []
    for b in range(0, n_windows, batch_size):
        w = windows[b : b + batch_size]
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray, tokenizer: Any = None) -> float:
    """Cross-entropy (bits/byte) of val bytes under train's add-one-smoothed byte frequencies.

    A model that does not beat this has learned nothing beyond which characters are common.
    Special ids (>= 256) are not bytes and are ignored on both sides.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    n_bytes = getattr(tokenizer, "n_bytes", None)
    if n_bytes is None:
        raise DataError("unigram_bits_per_byte needs a byte-level tokenizer (one token = one byte)")
    train = np.asarray(train)
    val = np.asarray(val)
    val_bytes = val[val < n_bytes].astype(np.int64)
    if not val_bytes.size:
        raise DataError("val holds no byte tokens")
    counts = np.bincount(train[train < n_bytes].astype(np.int64), minlength=n_bytes).astype(np.float64) + 1.0
    log2p = np.log2(counts / counts.sum())
    return float(-log2p[val_bytes].mean())


def bits_per_byte(loss_nats_per_token: float) -> float:
    """Nats per token to bits per byte; equal units for the byte tokenizer (one token = one byte)."""
    return loss_nats_per_token / math.log(2)
