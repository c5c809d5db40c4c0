"""Where moeserve keeps what it makes once per machine: the built-in default model, the dispatch
calibrations, the C kernel and the hashes of checkpoint files already read. $MOESERVE_CACHE, else
$XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 20  # hash 1 MiB at a time: weight files can be larger than memory
# A file changed less than this long ago is hashed but not remembered: within one tick of the file system's
# clock a write can leave its times as they were (git's "racily clean" entries), so they prove nothing yet.
RACY_S = 2.0


def cache_root() -> Path:
    if os.environ.get("MOESERVE_CACHE"):
        return Path(os.environ["MOESERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeserve"


def sha256_file(file: Path) -> str:
    """The file's sha256, streamed: a multi-GB shard is never held in memory."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def remembered_sha256(file: Path) -> str:
    """sha256_file, remembered per machine under the file's identity (device, inode) and its size, mtime and
    ctime: a server restarted on the same 2.6 GB checkpoint does not read it all again to check it (1.9 s of
    a 6 s start on 2 cores). Any write to the file moves its ctime, which no program can set back, so a file
    changed since it was hashed is hashed again; what this does not catch is the disk corrupting bytes
    behind the file system's back."""
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
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"file": str(Path(file).absolute()), "stat": key, "sha256": digest}))
            tmp.replace(memo)
        except OSError as e:  # a read-only cache costs the next start a hash, nothing else
            log.debug("hash of %s not remembered: %s", file, e)
    return digest


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
