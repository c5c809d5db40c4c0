"""Where moeserve keeps what it makes once per machine: the built-in default model, the dispatch
calibrations, the C kernel and the hashes of checkpoint files already read. $MOESERVE_CACHE, else
$XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Iterable

from moeserve.files import atomic_write

log = logging.getLogger(__name__)

_HASH_SLICE = 64 << 20
# A file changed less than this long ago is hashed but not remembered: within one tick of the file system's
# clock a write can leave its times as they were (git's "racily clean" entries), so they prove nothing yet.
RACY_S = 2.0


def cache_root() -> Path:
    if os.environ.get("MOESERVE_CACHE"):
        return Path(os.environ["MOESERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeserve"


def sha256_file(file: Path) -> str:
    """The file's sha256, from a memory map in slices of 64 MiB: a multi-GB shard is never copied into memory,
    and the GIL is let go for each slice's whole hash. It is taken again between slices; with 1 MiB reads
    (the first version) a hash on a thread beside a thread running Python waited ~5 ms (the switch
    interval) for it after each: 27 s instead of 2 s for 2.6 GB, measured."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # nothing to map
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, len(view), _HASH_SLICE):
                h.update(view[start:start + _HASH_SLICE])
    return h.hexdigest()


_ahead: dict[Path, concurrent.futures.Future] = {}  # hashes started by hash_ahead, not yet asked for
_ahead_lock = threading.Lock()


def hash_ahead(files: Iterable[Path]) -> None:
    """Start `remembered_sha256` of each file now, one after the other on a thread of their own. A server's start
    goes on to import torch and build its app (~2 s, on one core), and a first hash of a 2.6 GB checkpoint takes
    ~2.5 s on another: run side by side rather than one after the other. `remembered_sha256` of a file hashed
    ahead waits for that hash instead of starting its own."""
    mine = {}
    with _ahead_lock:
        for file in map(Path.absolute, map(Path, files)):
            if file not in _ahead:
                mine[file] = _ahead[file] = concurrent.futures.Future()

    def run() -> None:
        for file, future in mine.items():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(_remembered_sha256(file))
                except BaseException as e:  # noqa: BLE001 -- handed to whoever asks for this hash
                    future.set_exception(e)

    if mine:
        threading.Thread(target=run, name="moeserve-hash-ahead", daemon=True).start()


def remembered_sha256(file: Path) -> str:
    """sha256_file, remembered per machine under the file's identity (device, inode) and its size, mtime and
    ctime: a server restarted on the same 2.6 GB checkpoint does not read it all again to check it (1.9 s of
    a 6 s start on 2 cores). Any write to the file moves its ctime, which no program can set back, so a file
    changed since it was hashed is hashed again; what this does not catch is the disk corrupting bytes
    behind the file system's back."""
    with _ahead_lock:
        ahead = _ahead.pop(Path(file).absolute(), None)
    if ahead is not None:
        try:
            return ahead.result()
        except OSError:
            pass  # read again here, so that the error is the caller's own
    return _remembered_sha256(file)


def _remembered_sha256(file: Path) -> str:
    st = os.stat(file)
    key = _stat_key(st)
    memo = cache_root() / "hashes" / f"{st.st_dev}-{st.st_ino}.json"
    try:
        seen = json.loads(memo.read_text())
        if seen["stat"] == key:
            return seen["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(file)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9 and _stat_key(os.stat(file)) == key:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(memo, json.dumps({"file": str(Path(file).absolute()), "stat": key, "sha256": digest}))
        except OSError as e:  # a read-only cache costs the next start a hash, nothing else
            log.debug("hash of %s not remembered: %s", file, e)
    return digest


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
