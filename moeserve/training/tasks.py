"""Classification data for fine-tuning: a built-in task that needs no download, and a JSONL reader.

The built-in task asks "which standard-library package does this snippet come from?", cut from the
Python installation's own source (like the built-in corpus in `data.py`), so `moeserve finetune` works
offline and every machine with the same Python builds the same examples. The split is by file, so a
test snippet's neighbouring lines were never seen in training. User data is read from JSONL files of
{"text": ..., "label": ...} objects; every bad line is an error naming the file and line, never skipped.
Both return a `ClassificationData` whose SHA-256 lets a checkpoint record exactly what it was tuned on.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moeserve.training.data import MAX_FILE_BYTES, SKIP_DIRS, DataError, _stdlib_root, jsonl_objects

# Label id -> stdlib package. Each exists in CPython 3.9-3.13; on 3.11 (the only one checked) each has
# >= 150 KB of .py outside SKIP_DIRS and files in both splits of the path-hash rule below. Left out: logging and
# urllib (big enough, but none of their files hash into the test split), concurrent, ctypes, json,
# collections and sqlite3 (under 70 KB). encodings is mostly codec tables, the easy class of the eight.
STDLIB_PACKAGES: tuple[str, ...] = (
    "asyncio",
    "email",
    "encodings",
    "http",
    "importlib",
    "multiprocessing",
    "unittest",
    "xml",
)
BUILTIN_SOURCE = "builtin:stdlib-packages"
TEST_MODULUS = 5  # a file is in the test split when crc32(its relative path) % 5 == 0: about 1 in 5


@dataclass(frozen=True)
class Example:
    """One labelled text."""

    text: str
    label: int  # index into ClassificationData.labels
    source: str = ""  # built-in: the file's path relative to the stdlib root; JSONL: "path:line"


@dataclass
class ClassificationData:
    """Train and test examples over a fixed label set, with what is needed to record and cite them."""

    labels: list[str]  # label id -> name
    train: list[Example]
    test: list[Example]
    sha256: str  # of the label names and each example's (split, label, text); not of `source`
    source: str  # BUILTIN_SOURCE, or the JSONL path(s)


def _fingerprint(labels: list[str], train: list[Example], test: list[Example]) -> str:
    """SHA-256 of what a model sees: renaming a label or moving an example between splits changes it."""
    h = hashlib.sha256(json.dumps(labels).encode())
    for split, examples in (("train", train), ("test", test)):
        for ex in examples:
            h.update(json.dumps([split, ex.label, ex.text]).encode() + b"\n")
    return h.hexdigest()


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataError(f"{name} = {value!r}: expected an integer >= {minimum}")
    return value


# ---------------------------------------------------------------------------------------------------
# The built-in task


def _snippets(text: str, snippet_bytes: int) -> list[str]:
    """Cut `text` into runs of whole consecutive lines of at most `snippet_bytes` UTF-8 bytes.

    A line longer than the limit becomes a snippet of its own, truncated (at a character boundary) to
    the limit. Snippets under half the limit, or all whitespace, are dropped: too little to classify.
    Lines end at "\\n" only (not at the form feeds the stdlib uses as page breaks), so every snippet is
    a substring of `text`.
    """
    pieces = text.split("\n")
    lines = [p + "\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in lines:
        n = len(line.encode("utf-8"))
        if size + n > snippet_bytes and current:
            chunks.append("".join(current))
            current, size = [], 0
        if n > snippet_bytes:
            chunks.append(line.encode("utf-8")[:snippet_bytes].decode("utf-8", errors="ignore"))
            continue
        current.append(line)
        size += n
    if current:
        chunks.append("".join(current))
    return [c for c in chunks if 2 * len(c.encode("utf-8")) >= snippet_bytes and c.strip()]


def _package_files(root: Path, package: str) -> list[Path]:
    """A package's .py files, sorted by directory then name, outside SKIP_DIRS and under MAX_FILE_BYTES."""
    top = root / package
    if not top.is_dir():
        raise DataError(
            f"stdlib package {package!r} not found under {root} (python {sysconfig.get_python_version()}); "
            f"the built-in task needs all of {list(STDLIB_PACKAGES)}"
        )
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and path.stat().st_size <= MAX_FILE_BYTES:
                files.append(path)
    return files


def _package_snippets(root: Path, package: str, snippet_bytes: int) -> tuple[list[Example], list[Example]]:
    """(train, test) snippets of one package, label 0 (set by the caller), in file then line order.

    Files that are not UTF-8 are skipped, as in the built-in corpus: they would decode differently
    per platform.
    """
    train: list[Example] = []
    test: list[Example] = []
    for path in _package_files(root, package):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        split = test if zlib.crc32(rel.encode("utf-8")) % TEST_MODULUS == 0 else train
        split.extend(Example(text=s, label=0, source=rel) for s in _snippets(text, snippet_bytes))
    return train, test


def stdlib_task(
    snippet_bytes: int = 256, per_class_train: int = 400, per_class_test: int = 100, seed: int = 0
) -> ClassificationData:
    """The built-in task: snippets of stdlib source, labelled by the package (STDLIB_PACKAGES) they are from.

    Balanced: per label, `per_class_train` train and `per_class_test` test snippets are drawn without
    replacement with `random.Random(seed)`; a label with fewer snippets in a split contributes all of
    them, so the classes are unequal when asking for more than a package has: at 256 bytes on Python
    3.11, every package has >= 660 train snippets and all but unittest >= 180 test snippets; unittest
    has 86, so the default test split holds 786 examples, not 800. The split is by file (crc32 of the
    path relative to the stdlib root), so no file gives examples to both. Both lists are then shuffled
    with the same Random. Only the eight packages' files are read (~2.5 MB, ~0.1 s).
    """
    _positive_int("snippet_bytes", snippet_bytes, minimum=16)
    _positive_int("per_class_train", per_class_train)
    _positive_int("per_class_test", per_class_test)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"seed = {seed!r}: expected an integer")
    root = _stdlib_root()
    rng = random.Random(seed)
    train: list[Example] = []
    test: list[Example] = []
    for label, package in enumerate(STDLIB_PACKAGES):
        package_train, package_test = _package_snippets(root, package, snippet_bytes)
        for split_name, pool, k, out in (
            ("train", package_train, per_class_train, train),
            ("test", package_test, per_class_test, test),
        ):
            if not pool:
                raise DataError(
                    f"stdlib package {package!r} under {root} gives no {split_name} snippets of "
                    f"{snippet_bytes // 2}-{snippet_bytes} bytes"
                )
            chosen = rng.sample(pool, k) if len(pool) > k else pool
            out.extend(Example(text=ex.text, label=label, source=ex.source) for ex in chosen)
    rng.shuffle(train)
    rng.shuffle(test)
    labels = list(STDLIB_PACKAGES)
    return ClassificationData(
        labels=labels, train=train, test=test, sha256=_fingerprint(labels, train, test), source=BUILTIN_SOURCE
    )


# ---------------------------------------------------------------------------------------------------
# User data (JSONL)


@dataclass(frozen=True)
class _Record:
    where: str  # "path:line"
    text: str
    label: str | int


def _decoded_lines(path: Path, raw: bytes) -> Iterator[str]:
    """Each line decoded on its own, so that bad UTF-8 is an error naming its line."""
    for lineno, raw_line in enumerate(raw.split(b"\n"), start=1):
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
        yield line.removeprefix("\ufeff") if lineno == 1 else line  # a byte-order mark some editors write


def _read_jsonl(path: Path, text_field: str, label_field: str) -> list[_Record]:
    """One record per non-blank line; any bad line is an error naming the file and line, since silently
    dropping data would change what a model is tuned on without anyone noticing."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from e
    records: list[_Record] = []
    for where, obj in jsonl_objects(path, _decoded_lines(path, raw)):
        for field in (text_field, label_field):
            if field not in obj:
                raise DataError(f"{where}: no field {field!r} (fields: {sorted(obj)})")
        text, label = obj[text_field], obj[label_field]
        if not isinstance(text, str) or not text.strip():
            got = type(text).__name__ if not isinstance(text, str) else "an empty or blank string"
            raise DataError(f"{where}: field {text_field!r} is {got}, expected a non-empty string")
        # bool is an int subclass, but true/false as a class label is almost always a mistake.
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise DataError(
                f"{where}: field {label_field!r} is {type(label).__name__} ({label!r}), expected a string or an integer"
            )
        records.append(_Record(where=where, text=text, label=label))
    if not records:
        raise DataError(f"{path}: empty file: no JSON lines")
    return records


def _check_label_types(records: list[_Record], label_field: str) -> None:
    """All string or all integer: 1 and "1" would otherwise be one class by name and two by value."""
    first = records[0]
    for r in records:
        if isinstance(r.label, str) != isinstance(first.label, str):
            raise DataError(
                f"{r.where}: field {label_field!r} is {type(r.label).__name__} ({r.label!r}) but "
                f"{first.where} has {type(first.label).__name__} ({first.label!r}); use one type for all labels"
            )


def load_classification(
    train_path: str | Path,
    test_path: str | Path | None = None,
    *,
    text_field: str = "text",
    label_field: str = "label",
    test_fraction: float = 0.2,
    seed: int = 0,
) -> ClassificationData:
    """Read classification examples from JSONL: one {text_field: str, label_field: str | int} per line.

    Label ids follow the sorted labels (strings in code-point order, integers numerically), so the
    same data always gives the same ids. Without `test_path`, an example goes to test when
    crc32(text) / 2**32 < test_fraction: deterministic, about `test_fraction` of the examples, and
    duplicate texts always land in the same split. Examples keep file order; the trainer shuffles.
    `seed` is accepted for symmetry with `stdlib_task` and does not change the result.
    """
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise DataError(f"test_fraction = {test_fraction!r}: expected a number in (0, 1)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"seed = {seed!r}: expected an integer")
    train_file = Path(train_path)
    records = _read_jsonl(train_file, text_field, label_field)
    distinct = {r.label for r in records}
    if len(distinct) < 2:
        raise DataError(
            f"{train_file}: {len(records)} examples with only 1 distinct label ({records[0].label!r}); "
            "classification needs at least 2"
        )
    if test_path is not None:
        test_file = Path(test_path)
        train_records, test_records = records, _read_jsonl(test_file, text_field, label_field)
        source = f"{train_file} + {test_file}"
    else:
        train_records, test_records = [], []
        for r in records:
            in_test = zlib.crc32(r.text.encode("utf-8")) / 2**32 < test_fraction
            (test_records if in_test else train_records).append(r)
        for name, split in (("train", train_records), ("test", test_records)):
            if not split:
                raise DataError(
                    f"{train_file}: the split by text hash (test_fraction={test_fraction}) leaves {name} empty "
                    f"with {len(records)} examples; add examples or pass a test file"
                )
        source = str(train_file)
    _check_label_types(train_records + test_records, label_field)

    train_labels = {r.label for r in train_records}
    for r in test_records:
        if r.label not in train_labels:
            raise DataError(f"{r.where}: test label {r.label!r} does not occur in the train split")
    names = sorted(train_labels)  # one type (checked above): numeric for integers, code points for strings
    ids = {label: i for i, label in enumerate(names)}
    train = [Example(text=r.text, label=ids[r.label], source=r.where) for r in train_records]
    test = [Example(text=r.text, label=ids[r.label], source=r.where) for r in test_records]
    labels = [str(v) for v in names]
    return ClassificationData(
        labels=labels, train=train, test=test, sha256=_fingerprint(labels, train, test), source=source
    )
