"""atomic_write: the new content or the old, never a mix, and nothing left beside it."""

from __future__ import annotations

import os
import stat

import pytest

from moeserve import files
from moeserve.files import atomic_write, publish, temporary_beside


def test_writes_text_as_utf8_and_bytes_as_they_are(tmp_path):
    atomic_write(tmp_path / "a.txt", "é\n")
    atomic_write(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "a.txt").read_bytes() == "é\n".encode("utf-8")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]


def test_replaces_a_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    atomic_write(str(path), "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_failed_rename_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_text("old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_the_file_has_a_new_files_permissions(tmp_path):
    """Not the 0600 of a mkstemp file: 0666 less the umask, as open() would have made it."""
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "f", "x")
        tmp = temporary_beside(tmp_path / "g")
        tmp.write_bytes(b"y")
        publish(tmp, tmp_path / "g")
    finally:
        os.umask(umask)
    if os.name == "posix":
        assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "g").stat().st_mode) == 0o644


def test_temporary_files_are_hidden_siblings_and_never_shared(tmp_path):
    a, b = temporary_beside(tmp_path / "m.onnx"), temporary_beside(tmp_path / "m.onnx")
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(".m.onnx.") and a.name.endswith(".tmp")
