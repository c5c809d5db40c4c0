"""Tests for moeserve.training.data: corpus files, split, batches, errors and the unigram baseline."""

from __future__ import annotations

import json
import math
import zlib
from collections import Counter

import numpy as np
import pytest

from moeserve.tokenizer import ByteTokenizer
import torch

from moeserve.training.data import (
    Batcher,
    DataError,
    bits_per_byte,
    default_corpus_files,
    eval_batches,
    load_corpus,
    unigram_bits_per_byte,
)

EOS = 257


def test_default_files_deterministic_nonempty_within_budget():
    budget = 300_000  # small budget keeps the test fast and exercises the stop rule
    a = default_corpus_files(max_bytes=budget)
    b = default_corpus_files(max_bytes=budget)
    assert a == b and len(a) > 0
    sizes = [p.stat().st_size for p in a]
    assert sum(sizes) <= budget
    assert all(s <= 200_000 for s in sizes)
    assert all(p.suffix == ".py" for p in a)
    full = default_corpus_files()  # ~0.1 s: sizes only, plus one UTF-8 read per file
    assert 0 < sum(p.stat().st_size for p in full) <= 12_000_000
    parts = {part for p in full for part in p.parts}
    assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    # A larger budget extends the same ordered list rather than choosing different files.
    bigger = default_corpus_files(max_bytes=2 * budget)
    assert bigger[: len(a)] == a and len(bigger) > len(a)


def _write_docs(tmp_path, n):
    paths = []
    for i in range(n):
        p = tmp_path / f"doc{i:02d}.txt"
        p.write_text(f"document number {i} " + chr(ord("a") + i % 26) * (20 + i), encoding="utf-8")
        paths.append(p)
    return paths


def _docs_of(ids: np.ndarray) -> list[bytes]:
    """Split a stream of <bos> text <eos> frames back into the documents' bytes."""
    out, cur = [], []
    for t in ids.tolist():
        if t == ByteTokenizer.bos_id:
            cur = []
        elif t == EOS:
            out.append(bytes(cur))
        else:
            cur.append(t)
    return out


def test_split_deterministic_disjoint_by_document(tmp_path):
    paths = _write_docs(tmp_path, 40)
    c1 = load_corpus(paths, val_fraction=0.2)
    c2 = load_corpus([str(p) for p in paths], val_fraction=0.2)
    assert c1.sha256 == c2.sha256 and len(c1.sha256) == 64
    assert np.array_equal(c1.train, c2.train) and np.array_equal(c1.val, c2.val)
    assert c1.train.dtype == np.uint16 and c1.val.dtype == np.uint16
    assert c1.n_documents == 40
    train_docs, val_docs = set(_docs_of(c1.train)), set(_docs_of(c1.val))
    assert train_docs and val_docs and not train_docs & val_docs
    assert len(train_docs) + len(val_docs) == 40
    # Membership follows the documented crc32 rule, independently recomputed here.
    expected_val = {p.read_bytes() for p in paths if zlib.crc32(str(p).encode()) % 5 == 0}
    assert val_docs == expected_val


def test_few_documents_split_within_each_document(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("x" * 100, encoding="utf-8")
    c = load_corpus([p], val_fraction=0.1)
    # 90 and 10 bytes of text, each framed as <bos> text <eos>
    assert len(c.train) == 92 and len(c.val) == 12 and c.n_documents == 1


def test_sha256_changes_with_content(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello world, this is text", encoding="utf-8")
    h1 = load_corpus([p]).sha256
    p.write_text("hello world, this is texT", encoding="utf-8")
    assert load_corpus([p]).sha256 != h1


def test_jsonl_documents_and_eos(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"row {i}"}) for i in range(3)) + "\n", encoding="utf-8")
    c = load_corpus([p], text_field="body", val_fraction=0.5)
    assert c.n_documents == 3
    # fewer than 10 documents: each is split in two, so train holds 3 framed pieces <bos> text <eos>
    assert int((c.train == EOS).sum()) == 3 and int((c.train == ByteTokenizer.bos_id).sum()) == 3
    assert c.train[0] == ByteTokenizer.bos_id and c.train[-1] == EOS


@pytest.mark.parametrize(
    "bad_line, problem",
    [("{not json", "invalid JSON"), ('{"other": "x"}', "no field"), ('{"text": 5}', "int")],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "ok"}) + "\n" + bad_line + "\n")
    with pytest.raises(DataError) as e:
        load_corpus([p])
    msg = str(e.value)
    assert f"{p}:3" in msg and problem in msg


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"nope\.txt.*not found"):
        load_corpus([missing])
    assert issubclass(DataError, ValueError)


def test_empty_corpus_raises(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="empty.txt"):
        load_corpus([p])


def test_batcher_pure_function_of_step():
    tokens = np.arange(5000, dtype=np.uint16) % 259
    b1, b2 = Batcher(tokens, 4, 16, seed=7), Batcher(tokens, 4, 16, seed=7)
    x5, y5 = b1.get(5)
    b1.get(6)  # calls in between must not matter
    x5b, y5b = b2.get(5)
    assert torch.equal(x5, x5b) and torch.equal(y5, y5b)
    assert x5.shape == (4, 16) and y5.shape == (4, 16) and x5.dtype == torch.long
    assert not torch.equal(b1.get(6)[0], x5)
    assert not torch.equal(Batcher(tokens, 4, 16, seed=8).get(5)[0], x5)
    assert torch.equal(x5[:, 1:], y5[:, :-1])
    # Each row of (x, y) is one contiguous window of the token array.
    t = torch.from_numpy(tokens.astype(np.int64))
    for row_x, row_y in zip(x5, y5):
        s = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 16) == row_x.numpy(), axis=1))[0])
        assert torch.equal(row_y, t[s + 1 : s + 17])


def test_too_short_array_raises():
    with pytest.raises(DataError, match=r"10.*17|17.*10"):
        Batcher(np.zeros(10, dtype=np.uint16), 2, 16, seed=0)
    with pytest.raises(DataError):
        Batcher(np.zeros(16, dtype=np.uint16), 2, 16, seed=0)  # boundary: one short
    x, y = Batcher(np.arange(17, dtype=np.uint16), 2, 16, seed=0).get(0)  # exactly one window fits
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[1], torch.arange(1, 17))
    with pytest.raises(DataError):
        eval_batches(np.zeros(10, dtype=np.uint16), 2, 16, 4)


def test_eval_batches_disjoint_and_spread():
    tokens = np.arange(1000, dtype=np.uint16)
    batches = eval_batches(tokens, 2, 9, 3)
    assert len(batches) == 3 and eval_batches(tokens, 2, 9, 3)[0][0].equal(batches[0][0])
    starts = sorted(int(x[i, 0]) for x, _ in batches for i in range(x.shape[0]))
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:]))
    assert starts[0] == 0 and starts[-1] == 1000 - 10
    for x, y in batches:
        assert x.shape == (2, 9) and torch.equal(y, x + 1)


def test_unigram_bits_per_byte_matches_hand_computation():
    train = np.array([97, 97, 98, EOS, 99, 97, 256], dtype=np.uint16)
    val = np.array([97, 98, EOS, 100], dtype=np.uint16)
    counts = Counter(t for t in train.tolist() if t < 256)
    total = sum(counts.values()) + 256
    val_bytes = [t for t in val.tolist() if t < 256]
    expected = -sum(math.log2((counts[t] + 1) / total) for t in val_bytes) / len(val_bytes)
    assert unigram_bits_per_byte(train, val) == pytest.approx(expected, rel=1e-12)
    assert bits_per_byte(math.log(2) * 3.5) == pytest.approx(3.5)
