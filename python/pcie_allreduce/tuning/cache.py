"""This host's tuning cache: ``$PCIE_ALLREDUCE_CACHE_DIR/<fingerprint>.csv`` (default
``~/.cache/pcie_allreduce``), one file per fingerprint (``policy.fingerprint``).

The file is the tuning-table format with the measured times as extra columns, a comment header
(magic line, format, library version, fingerprint, date, devices, the fingerprint's inputs) and
a checksum line last. It is written atomically under an ``flock``; a file that is truncated,
corrupt, foreign or of another format is reported and ignored, never trusted, never fatal. Every
file of the folder is opened through ``files`` (no FIFO, device or symlink; owner, mode and size
checked; a folder others can write is refused), so a second local user cannot feed a rank a
table or have a tune overwrite a file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__, files
from ..env import read_env
from ..native import _C
from ..policy import CACHE_FORMAT

CACHE_MAGIC = "# pcie_allreduce tuning cache"


def cache_path(fp: str, folder: Path | None = None) -> Path:
    """The cache file of fingerprint ``fp`` in ``folder`` (default: this process's cache folder,
    ``Env.tuning_cache_dir()``)."""
    return (read_env().tuning_cache_dir() if folder is None else Path(folder)) / f"{fp}.csv"


@dataclass
class CacheRead:
    """What ``read_cache`` found: ``text`` (the table) when the file is valid for this
    fingerprint; ``problem`` says why a file that exists was not used; both None: no file."""

    path: Path
    text: str | None = None
    problem: str | None = None
    header: dict[str, str] | None = None


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def read_cache(path: Path, fp: str) -> CacheRead:
    """Loads a cache file, or says why it cannot be used (missing trailer = truncated, a bad
    checksum = corrupt, another fingerprint or format = foreign). Never raises for content."""
    try:
        raw = files.read_small(Path(path), in_cache=True)
    except FileNotFoundError:
        return CacheRead(Path(path))
    except files.Refused as error:
        return CacheRead(Path(path), problem=f"refused: {error}")
    except OSError as error:
        return CacheRead(Path(path), problem=f"unreadable ({error.strerror or error})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return CacheRead(Path(path), problem=f"corrupt (not UTF-8 at byte {error.start})")
    if not text.startswith(CACHE_MAGIC + "\n"):
        return CacheRead(Path(path), problem="not a pcie_allreduce tuning cache (no header)")
    body, sep, trailer = text.rstrip("\n").rpartition("\n")
    if not sep or not trailer.startswith("# checksum "):
        return CacheRead(Path(path), problem="truncated (no checksum line at the end)")
    if trailer.split()[-1] != _checksum(body + "\n"):
        return CacheRead(Path(path), problem="corrupt (checksum does not match the contents)")
    header: dict[str, str] = {}
    for line in body.splitlines():
        if line.startswith("# ") and ": " in line:
            key, _, value = line[2:].partition(": ")
            header.setdefault(key.strip(), value.strip())
    if header.get("format") != str(CACHE_FORMAT):
        return CacheRead(
            Path(path),
            problem=f"format {header.get('format')!r}, this library reads {CACHE_FORMAT}",
            header=header,
        )
    if header.get("fingerprint") != fp:
        return CacheRead(
            Path(path),
            problem=f"foreign (fingerprint {header.get('fingerprint')!r}, this host is {fp!r})",
            header=header,
        )
    try:
        _C.TuningTable.parse(body + "\n", str(path))
    except ValueError as error:
        return CacheRead(Path(path), problem=f"corrupt ({error})", header=header)
    return CacheRead(Path(path), text=body + "\n", header=header)


def write_cache(path: Path, fp: str, fields: Mapping[str, Any], rows: str, measured: int) -> None:
    """Writes a cache file atomically: a temporary file in the same folder, fsynced, then
    renamed over ``path``, so a reader sees the old file or the new one, never a torn one.
    The last line is a checksum of everything before it (a truncated file has none). The
    caller holds the lock: a temporary file of ``path`` left beside it was left by a writer
    that was killed, and is removed. Raises OSError (``files.Refused`` for an untrusted
    folder, before anything is written)."""
    header = [
        CACHE_MAGIC,
        f"# format: {CACHE_FORMAT}",
        f"# library: {__version__}",
        f"# fingerprint: {fp}",
        f"# date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        f"# devices: {'; '.join(fields.get('devices', []))}",
        f"# measured: {measured} (bucket, tactic) pairs",
        f"# fields: {json.dumps(dict(fields), sort_keys=True)}",
        "# Written by `pcie-allreduce tune` / PcieAllReduce.tune(); delete it to measure again.",
    ]
    body = "\n".join(header) + "\n" + rows
    files.write_atomic(path, (body + f"# checksum {_checksum(body)}\n").encode("utf-8"))
    remove_stale_temporaries(path)  # ours was renamed over path; what is left, a killed one left


def remove_stale_temporaries(path: Path) -> int:
    """Removes what killed writers of ``path`` left (``.<name>.*.tmp``, regular files of this
    user); returns how many. Only under the lock: a live writer's file would go too."""
    removed = 0
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            st = os.lstat(tmp)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(tmp)
                removed += 1
    return removed


class CacheLock:
    """An advisory lock on ``<cache>.lock`` (flock), so two servers starting together on one
    host neither corrupt the cache nor both measure: the second waits, then finds the file."""

    def __init__(self, path: Path) -> None:
        self.path = path.with_name(path.name + ".lock")
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is None:
            self._fd = files.open_lock(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return files.read_small(self.path, in_cache=True).decode().strip() or "unknown"
        return "unknown"

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
