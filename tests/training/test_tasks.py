"""Tests for moeserve.training.tasks: the built-in stdlib-package task and the JSONL classification reader."""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from pathlib import Path

import pytest

from moeserve.training import tasks
from moeserve.training.data import MAX_FILE_BYTES, DataError, _stdlib_root
from moeserve.training.tasks import (
    STDLIB_PACKAGES,
    _snippets,
    load_classification,
    stdlib_task,
)

SMALL = {"per_class_train": 24, "per_class_test": 8}  # ~0.1 s a call; the real packages all have more


@pytest.fixture(scope="module")
def small():
    return stdlib_task(**SMALL)


def _in_test(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 5 == 0


# ---------------------------------------------------------------------------------------------------
# The built-in task on the real stdlib


def test_deterministic_and_seeded(small):
    again = stdlib_task(**SMALL)
    assert again == small and again.sha256 == small.sha256 and len(small.sha256) == 64
    other = stdlib_task(**SMALL, seed=1)
    assert other.sha256 != small.sha256
    assert {e.text for e in other.train} != {e.text for e in small.train}
    assert small.source == tasks.BUILTIN_SOURCE and small.labels == list(STDLIB_PACKAGES)
    assert len(set(STDLIB_PACKAGES)) == 8


def test_examples_are_from_their_labelled_package_and_splits_share_no_file(small):
    root = _stdlib_root()
    texts: dict[str, str] = {}
    for ex in small.train + small.test:
        package = ex.source.split("/")[0]
        assert package == small.labels[ex.label], ex.source
        if ex.source not in texts:
            texts[ex.source] = (root / ex.source).read_text(encoding="utf-8")
        assert ex.text in texts[ex.source], (ex.source, ex.text)
    train_files = {e.source for e in small.train}
    test_files = {e.source for e in small.test}
    assert train_files and test_files and not train_files & test_files
    assert all(_in_test(f) for f in test_files) and not any(_in_test(f) for f in train_files)


@pytest.mark.parametrize("snippet_bytes", [64, 256])
def test_counts_per_label_and_snippet_lengths(snippet_bytes):
    data = stdlib_task(snippet_bytes=snippet_bytes, per_class_train=30, per_class_test=10, seed=3)
    assert Counter(e.label for e in data.train) == {i: 30 for i in range(8)}
    assert Counter(e.label for e in data.test) == {i: 10 for i in range(8)}
    for ex in data.train + data.test:
        n = len(ex.text.encode("utf-8"))
        assert snippet_bytes / 2 <= n <= snippet_bytes and ex.text.strip(), (n, ex.text)
    # Shuffled, not grouped by label.
    assert [e.label for e in data.train] != sorted(e.label for e in data.train)


def test_bad_arguments():
    with pytest.raises(DataError, match="snippet_bytes = 0"):
        stdlib_task(snippet_bytes=0)
    with pytest.raises(DataError, match="per_class_test = True"):
        stdlib_task(per_class_test=True)


# ---------------------------------------------------------------------------------------------------
# Snippet cutting and file selection, on text and a fake stdlib tree built here


def test_snippets_whole_lines_truncate_and_drop():
    text = "a = 1\n" * 10 + "x" * 100 + "\n" + "\n" * 30 + "b = 2\n"
    chunks = _snippets(text, 32)
    # 6-byte lines, 5 to a chunk (30 bytes): two chunks; the long line truncated to 32 bytes; the blank
    # run is whitespace and "b = 2\n" is under half the limit, so both go.
    assert chunks == ["a = 1\n" * 5, "a = 1\n" * 5, "x" * 32]
    assert _snippets("é" * 20, 9) == ["é" * 4]  # truncation never splits a character
    assert _snippets("   \n" * 8, 16) == []


def _name_in_split(package: str, test: bool, stem: str) -> str:
    return next(f"{stem}{i}.py" for i in range(1000) if _in_test(f"{package}/{stem}{i}.py") == test)


def _fake_stdlib(root: Path, packages: tuple[str, ...]) -> None:
    line = "value = compute(alpha, beta)  # ok\n"  # 35 bytes: 7 lines make one 245-byte snippet
    for package in packages:
        for test in (False, True):
            d = root / package
            d.mkdir(parents=True, exist_ok=True)
            (d / _name_in_split(package, test, "mod")).write_text(line * 7 * (3 if test else 5), encoding="utf-8")
        # None of these may contribute a snippet.
        (root / package / "tests").mkdir()
        (root / package / "tests" / _name_in_split(package, False, "t")).write_text(line * 70)
        (root / package / _name_in_split(package, False, "big")).write_text(line * (MAX_FILE_BYTES // 35 + 1))
        (root / package / _name_in_split(package, False, "latin")).write_bytes(b"# caf\xe9\n" + line.encode() * 70)
        (root / package / "notes.txt").write_text(line * 70)


def test_fewer_snippets_than_asked_gives_all_and_skips_excluded_files(tmp_path, monkeypatch):
    _fake_stdlib(tmp_path, STDLIB_PACKAGES)
    monkeypatch.setattr(tasks, "_stdlib_root", lambda: tmp_path)
    data = stdlib_task(per_class_train=4, per_class_test=100)
    assert Counter(e.label for e in data.train) == {i: 4 for i in range(8)}
    assert Counter(e.label for e in data.test) == {i: 3 for i in range(8)}  # all there are
    assert all(re.fullmatch(r"\w+/mod\d+\.py", e.source) for e in data.train + data.test)


def test_missing_package_is_named(tmp_path, monkeypatch):
    _fake_stdlib(tmp_path, tuple(p for p in STDLIB_PACKAGES if p != "xml"))
    monkeypatch.setattr(tasks, "_stdlib_root", lambda: tmp_path)
    with pytest.raises(DataError, match="'xml' not found"):
        stdlib_task()


# ---------------------------------------------------------------------------------------------------
# JSONL


def _write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_string_labels_sorted_and_test_file(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"text": "good", "label": "pos"}, "",
                                              {"text": "meh", "label": "neutral"}, {"text": "bad", "label": "neg"}])
    test = _write(tmp_path / "test.jsonl", [{"text": "fine", "label": "pos"}])
    data = load_classification(train, test)
    assert data.labels == ["neg", "neutral", "pos"]
    assert [(e.text, e.label) for e in data.train] == [("good", 2), ("meh", 1), ("bad", 0)]
    assert data.train[1].source == f"{train}:3"  # the blank line still counts
    assert [(e.text, e.label) for e in data.test] == [("fine", 2)]
    assert load_classification(train, test).sha256 == data.sha256


def test_integer_labels_sort_numerically_and_custom_fields(tmp_path):
    train = _write(tmp_path / "t.jsonl", [{"s": f"x{v}", "y": v} for v in (10, 2, -1, 2)])
    test = _write(tmp_path / "v.jsonl", [{"s": "q", "y": 10}])
    data = load_classification(train, test, text_field="s", label_field="y")
    assert data.labels == ["-1", "2", "10"]
    assert [e.label for e in data.train] == [2, 1, 0, 1]


def test_split_by_text_hash_keeps_duplicates_together(tmp_path):
    rows = [{"text": f"sample {i % 150}", "label": "ab"[i % 2]} for i in range(300)]
    path = _write(tmp_path / "d.jsonl", rows)
    data = load_classification(path, test_fraction=0.2)
    assert len(data.train) + len(data.test) == 300
    train_texts, test_texts = {e.text for e in data.train}, {e.text for e in data.test}
    assert not train_texts & test_texts and len(train_texts | test_texts) == 150
    assert all((zlib.crc32(t.encode()) / 2**32 < 0.2) for t in test_texts)
    assert 0.1 < len(test_texts) / 150 < 0.3
    assert load_classification(path, test_fraction=0.2) == data


def _text_in_test(fraction: float) -> str:
    return next(f"rare {i}" for i in range(1000) if zlib.crc32(f"rare {i}".encode()) / 2**32 < fraction)


OK = {"text": "fine", "label": "a"}
OTHER = {"text": "other", "label": "b"}


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"text": "no label"}, "no field 'label'"),
        ({"label": "a"}, "no field 'text'"),
        ({"text": "", "label": "a"}, "non-empty string"),
        ({"text": "  ", "label": "a"}, "non-empty string"),
        ({"text": 7, "label": "a"}, "'text' is int"),
        ({"text": "x", "label": 1.5}, "'label' is float .*expected a string or an integer"),
        ({"text": "x", "label": True}, "'label' is bool .*expected a string or an integer"),
        ({"text": "x", "label": None}, "'label' is NoneType .*expected a string or an integer"),
        ({"text": "x", "label": 3}, "one type for all labels"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, match):
    path = _write(tmp_path / "bad.jsonl", [OK, "", OTHER, bad_line, OK])
    with pytest.raises(DataError, match=re.escape(f"{path}:4: ") + ".*" + match):
        load_classification(path, _write(tmp_path / "ok.jsonl", [OK]))


def test_unseen_test_label_is_named_with_its_line(tmp_path):
    train = _write(tmp_path / "train.jsonl", [OK, OTHER])
    test = _write(tmp_path / "test.jsonl", [OK, {"text": "new", "label": "zzz"}])
    with pytest.raises(DataError, match=re.escape(f"{test}:2: test label 'zzz'")):
        load_classification(train, test)
    # Without a test file, a label whose only example hashes into test is caught the same way.
    rows = [{"text": f"t{i}", "label": "ab"[i % 2]} for i in range(40)] + [{"text": _text_in_test(0.2), "label": "c"}]
    path = _write(tmp_path / "auto.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(f"{path}:41: test label 'c'")):
        load_classification(path, test_fraction=0.2)


def test_file_level_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{missing}: file not found")):
        load_classification(missing)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match=re.escape(f"{empty}: empty file")):
        load_classification(empty)
    with pytest.raises(DataError, match=re.escape(f"{empty}: empty file")):
        load_classification(_write(tmp_path / "train.jsonl", [OK, OTHER]), empty)
    one = _write(tmp_path / "one.jsonl", [OK, OK, {"text": "again", "label": "a"}])
    with pytest.raises(DataError, match=re.escape(f"{one}: 3 examples with only 1 distinct label")):
        load_classification(one)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(OK).encode() + b'\n{"text": "caf\xe9", "label": "b"}\n')
    with pytest.raises(DataError, match=re.escape(f"{latin}:2: not valid UTF-8")):
        load_classification(latin)
    with pytest.raises(DataError, match="test_fraction = 1.0"):
        load_classification(one, test_fraction=1.0)
