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
import threading
from dataclasses import dataclass

__all__ = ["IOFault", "add_fault", "remove_fault", "check_write", "check_read"]


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
