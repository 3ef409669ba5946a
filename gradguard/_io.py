"""The I/O boundary of gradguard's own files (snapshots, event log), with a switchboard for
``gradguard.testing``'s I/O fault injectors.

Every read or write gradguard makes of its own files first asks :func:`check_write` /
:func:`check_read`; an active injected fault on a folder makes them raise the same ``OSError``
the operating system would (``ENOSPC`` for a full disk, ``EROFS`` for a read-only folder), so the
real error-handling paths run. With no fault active they cost one empty-list test.
"""

from __future__ import annotations

import errno as _errno
import os
import secrets
import stat
import threading
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["IOFault", "add_fault", "remove_fault", "check_write", "check_read", "open_append", "create_new",
           "temp_name", "atomic_write", "TMP_MARK"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: What every temp file gradguard writes has in its name (``<final>.tmp-<random>``).
TMP_MARK = ".tmp-"


def _regular(fd: int, path: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(_errno.EINVAL, "not a regular file (gradguard writes only its own regular files)", path)


def open_append(path: str, binary: bool = False) -> IO[Any]:
    """``path`` opened for appending text (bytes with ``binary``), created if missing; a symlink or a
    non-regular file there is an ``OSError`` (never followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
    _regular(fd, path)
    return os.fdopen(fd, "ab") if binary else os.fdopen(fd, "a", encoding="utf-8")


def create_new(path: str, binary: bool = False) -> IO[Any]:
    """A new file at ``path`` for writing: ``FileExistsError`` if anything (a symlink included)
    is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")


def temp_name(final: str, tag: str = "") -> str:
    """A fresh temp-file name beside ``final``: ``<final>.tmp-<tag><random>``."""
    return f"{final}{TMP_MARK}{tag}{secrets.token_hex(8)}"


def atomic_write(final: str, data: str | bytes, *, fsync: bool = True) -> str:
    """Write a whole file atomically without following any link: a new temp file of a random name
    in the same folder (``O_EXCL``), fsync, then ``os.replace`` over ``final``. On an error the temp
    file is removed and the ``OSError`` propagates."""
    check_write(final)
    tmp = temp_name(final)
    try:
        with create_new(tmp, binary=isinstance(data, bytes)) as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return final


@dataclass
class IOFault:
    """One injected failure: operations on paths under ``root`` raise ``OSError(errno)``."""

    root: str
    errno: int = _errno.ENOSPC
    reads: bool = False
    """Reads fail too (a folder that became unreachable); default: writes only."""

    def matches(self, path: str) -> bool:
        root = os.path.abspath(self.root)
        p = os.path.abspath(path)
        return p == root or p.startswith(root.rstrip(os.sep) + os.sep)

    def error(self, path: str) -> OSError:
        return OSError(self.errno, f"{os.strerror(self.errno)} (injected by gradguard.testing)", path)


_lock = threading.Lock()
_faults: list[IOFault] = []


def add_fault(fault: IOFault) -> IOFault:
    with _lock:
        _faults.append(fault)
    return fault


def remove_fault(fault: IOFault) -> None:
    with _lock:
        if fault in _faults:
            _faults.remove(fault)


def check_write(path: str) -> None:
    """Raise the injected ``OSError`` for a write under a faulty folder (no-op otherwise)."""
    if not _faults:
        return
    for f in list(_faults):
        if f.matches(path):
            raise f.error(path)


def check_read(path: str) -> None:
    """Raise the injected ``OSError`` for a read under a folder whose reads fail."""
    if not _faults:
        return
    for f in list(_faults):
        if f.reads and f.matches(path):
            raise f.error(path)
