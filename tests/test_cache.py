"""The per-machine memo of checkpoint hashes: a file read once is not read again, and any change to it is."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from moeserve import cache


@pytest.fixture
def memo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hashes"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files actually hashed (read), in order."""
    seen: list[Path] = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda f: seen.append(Path(f)) or real(f))
    return seen


def old_file(path: Path, data: bytes, age_s: float = 60.0) -> Path:
    path.write_bytes(data)
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_a_settled_file_is_hashed_once(tmp_path: Path, memo_dir: Path, reads: list[Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "RACY_S", 0.0)  # utime just moved the ctime; the file is otherwise settled
    f = old_file(tmp_path / "w.safetensors", b"weights" * 1000)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert cache.remembered_sha256(f) == want
    assert cache.remembered_sha256(f) == want
    assert reads == [f]
    assert len(list(memo_dir.glob("*.json"))) == 1


def test_a_changed_file_is_hashed_again(tmp_path: Path, memo_dir: Path, reads: list[Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    f = old_file(tmp_path / "w.safetensors", b"A" * 4096)
    cache.remembered_sha256(f)
    st = f.stat()
    time.sleep(0.05)  # past the file system's clock tick, so the write moves the ctime
    f.write_bytes(b"B" * 4096)  # same size; mtime put back as it was: only the ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.remembered_sha256(f) == hashlib.sha256(b"B" * 4096).hexdigest()
    assert reads == [f, f]


def test_a_fresh_file_is_not_remembered(tmp_path: Path, memo_dir: Path, reads: list[Path]) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 100)  # written just now: its times cannot vouch for its bytes yet
    cache.remembered_sha256(f)
    cache.remembered_sha256(f)
    assert reads == [f, f]
    assert not memo_dir.exists()


def test_a_damaged_memo_is_ignored(tmp_path: Path, memo_dir: Path, reads: list[Path],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    f = old_file(tmp_path / "w.safetensors", b"y" * 100)
    cache.remembered_sha256(f)
    (memo,) = memo_dir.glob("*.json")
    memo.write_text("{not json")
    assert cache.remembered_sha256(f) == hashlib.sha256(b"y" * 100).hexdigest()
    assert len(reads) == 2


def test_an_unwritable_cache_costs_only_the_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 reads: list[Path]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("MOESERVE_CACHE", str(blocker))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    f = old_file(tmp_path / "w.safetensors", b"z" * 100)
    assert cache.remembered_sha256(f) == hashlib.sha256(b"z" * 100).hexdigest()
    assert cache.remembered_sha256(f) == hashlib.sha256(b"z" * 100).hexdigest()
    assert len(reads) == 2


@pytest.mark.parametrize("size", [0, 1, 6, 7, 8, 20, 21])
def test_sha256_file_is_hashlibs_across_slice_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        size: int) -> None:
    monkeypatch.setattr(cache, "_HASH_SLICE", 7)  # slices of 7 bytes: empty, partial, exact and ragged ends
    data = bytes(range(size))
    (tmp_path / "f").write_bytes(data)
    assert cache.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_file_hashed_ahead_is_read_once_and_its_hash_waited_for(tmp_path: Path, memo_dir: Path,
                                                                   reads: list[Path]) -> None:
    files = [old_file(tmp_path / f"w{i}.safetensors", bytes([i]) * 1000) for i in range(3)]
    cache.hash_ahead(files)
    cache.hash_ahead(files[:1])  # asked twice: still one hash
    assert [cache.remembered_sha256(f) for f in files] == [hashlib.sha256(bytes([i]) * 1000).hexdigest()
                                                            for i in range(3)]
    assert sorted(reads) == files  # each read once, by the thread, and none again when asked for
    assert cache._ahead == {}


def test_a_hash_ahead_that_failed_is_tried_again_by_the_caller(tmp_path: Path, memo_dir: Path,
                                                               reads: list[Path]) -> None:
    missing = tmp_path / "gone.safetensors"
    cache.hash_ahead([missing])
    assert isinstance(cache._ahead[missing.absolute()].exception(timeout=10), FileNotFoundError)
    old_file(missing, b"late")  # there now: the caller reads it itself
    assert cache.remembered_sha256(missing) == hashlib.sha256(b"late").hexdigest()
    with pytest.raises(FileNotFoundError):  # nothing ahead any more: the caller's own error
        cache.remembered_sha256(tmp_path / "never.safetensors")
