"""Writing a file so that no reader ever sees it half-written: the one way moeserve does it.

The new content goes to a temporary file beside the destination (the same directory, so the same file
system, so the rename is atomic), is flushed to disk, and is renamed over the destination; then the
directory is flushed, so that the rename itself survives a crash. A crash or a full disk at any point
leaves the old file or the new one, never a mix, and at worst a stray `.NAME.*.tmp` beside it.

Top-level, importing nothing of moeserve, so that every part (runtime included) may use it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (renames), to disk; Windows cannot open directories."""
    if os.name == "posix" or not path.is_dir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary_beside(path: Path) -> Path:
    """A new empty file `.NAME.<random>.tmp` in `path`'s directory, for a writer that needs a path of its own (a
    compiler, onnx.save_model); `publish` then renames it over `path`. Created with a new file's permissions
    (0666 less the umask), so that the published file has them too."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # O_EXCL: never another's file
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Flush the finished temporary file `tmp` to disk, rename it over `path`, and flush the directory."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace the file at `path` with `data` (a str is written as UTF-8) atomically; the temporary file is
    removed if anything fails. The directory must exist."""
    path = Path(path)
    tmp = temporary_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
