"""Reading and writing the small files pcie_allreduce keeps (the tuning cache, its lock, the
doctor's P2P record) and the table an operator names, so that none of them can be turned against
the process that reads it.

Every read opens without blocking (a FIFO at the path does not stall rank 0), insists on a
regular file (``/dev/zero`` behind a symlink is not read until memory runs out) and caps the
size. In the cache folder, which nobody names per call, the rules are stricter, as ssh's and
pip's are: the folder must be ours (or root's) and writable by nobody else, a file in it must be
ours (or root's), writable by nobody else and not a symlink; files are created 0600 in a folder
created 0700. Each refusal raises :class:`Refused`, saying what was found and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

# A tuning table or cache of every dtype, world and bucket is a few KiB; ten times the largest
# plausible one.
MAX_FILE_BYTES = 1 << 20


class Refused(OSError):
    """A file or folder that is not read or written, and why (the message names the path). An
    OSError, so whoever copes with an unreadable or unwritable cache copes with it too."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def folder_problem(folder: Path) -> str | None:
    """Why the cache folder ``folder`` is not trusted, or None (also None when it is missing:
    ``ensure_folder`` creates it)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cache folder {folder} cannot be examined ({error.strerror or error})"
    if not stat.S_ISDIR(st.st_mode):
        return f"cache folder {folder} is {_kind(st.st_mode)}, not a folder"
    if not _trusted_owner(st.st_uid):
        return (
            f"cache folder {folder} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}) or root: another user could plant a table in it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"cache folder {folder} is writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): another user could plant a table in it; "
            f"`chmod go-w {folder}` or point PCIE_ALLREDUCE_CACHE_DIR elsewhere"
        )
    return None


def ensure_folder(folder: Path) -> None:
    """Creates the cache folder (0700) when missing; Refused when it exists and is not trusted."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
    problem = folder_problem(folder)
    if problem is not None:
        raise Refused(problem)


def _open(path: Path, flags: int, in_cache: bool, mode: int = 0o600) -> int:
    """An fd of a regular file at ``path``, checked as the module says; Refused otherwise."""
    if in_cache:
        problem = folder_problem(Path(path).parent)
        if problem is not None:
            raise Refused(problem)
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP and in_cache:
            raise Refused(
                f"{path} is a symbolic link: files in the cache folder are read and "
                "written only as themselves"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is {_kind(st.st_mode)}, expected a regular file")
        if in_cache and not _trusted_owner(st.st_uid):
            raise Refused(
                f"{path} belongs to uid {st.st_uid}, not to this user (uid "
                f"{os.geteuid()}) or root: not trusted; delete it"
            )
        if in_cache and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise Refused(
                f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                "not trusted; delete it"
            )
        if st.st_size > MAX_FILE_BYTES:
            raise Refused(
                f"{path} holds {st.st_size} bytes, more than the {MAX_FILE_BYTES} any table needs"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, *, in_cache: bool) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES. ``in_cache``: a file of the cache
    folder (no symlink, owner and mode checked). FileNotFoundError when missing,
    IsADirectoryError for a folder, Refused when it is not to be read; other OSErrors as they
    come."""
    fd = _open(path, os.O_RDONLY, in_cache)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise Refused(f"{path} grew past the {MAX_FILE_BYTES} bytes any table needs while read")
    return data


def open_lock(path: Path) -> int:
    """The fd of the lock file ``path`` in the cache folder, created 0600 when missing, never
    through a symlink (a planted one would have it truncate any file this user can write)."""
    ensure_folder(Path(path).parent)
    return _open(path, os.O_RDWR | os.O_CREAT, in_cache=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes ``path`` in the cache folder atomically: a fresh 0600 temporary file beside it
    (a name nobody can have planted), fsynced, renamed over ``path`` (a rename replaces a
    symlink there, it never writes through one). A reader sees the old file or the new one."""
    path = Path(path)
    ensure_folder(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
