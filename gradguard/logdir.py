"""Where gradguard's files go: one rule for every engine, and the file system that writes them.

The rule (:func:`choose_log_dir`), in order:

1. A folder the user names (the callback's ``out_dir``, or ``GuardConfig.output.dir``): used as given.
2. Else the folder where the engine keeps its own logs: Lightning's ``trainer.log_dir`` (the
   logger's version folder; none without a logger), the HF Trainer's TensorBoard logging directory
   (``<output_dir>/runs/<time>_<host>`` or ``TENSORBOARD_LOGGING_DIR``; none without TensorBoard).
   Such a folder is not used when it is the working directory (what the engines fall back to when
   no root folder was given), when it is a folder of checkpoints (Lightning's ``default_root_dir``,
   where its HPC checkpoints go, and ``ModelCheckpoint.dirpath``; the HF ``output_dir`` that holds
   ``checkpoint-*``: something of gradguard's there would sit among the checkpoints, which scripts
   list and load one by one), or when it lies inside one checkpoint.
3. Else nothing is written: one warning says why and how to name a folder. gradguard's findings
   still reach the console and the engine's loggers.

Under the chosen folder the files go to ``<folder>/gradguard/`` (``events.jsonl``,
``diagnosis.json``), or ``<folder>/gradguard_runs/`` where a ``gradguard`` folder would shadow the
package (the folder is the working directory or on ``sys.path``).

A folder given as a URL (``memory://``, ``s3://``, ``gs://``...: the remote roots Lightning's
loggers and checkpoints accept) is written through fsspec, as Lightning's loggers do; without
fsspec, or when the file system refuses, the event log is off with one warning (training goes on).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import IO, Any

from . import _io
from .errors import warn

__all__ = ["choose_log_dir", "event_log_dir", "is_url", "open_append", "write_text", "join"]


def is_url(path: str | None) -> bool:
    """A remote or virtual file-system path (``protocol://...``, not ``file://``)."""
    if not path or "://" not in str(path):
        return False
    return str(path).split("://", 1)[0] not in ("", "file", "local")


def join(folder: str, *names: str) -> str:
    if is_url(folder):
        return "/".join([folder.rstrip("/"), *names])
    return os.path.join(folder, *names)


def _norm(path: str) -> str:
    if is_url(path):
        return path.rstrip("/")
    if path.startswith("file://"):
        path = path[len("file://"):]
    return os.path.realpath(os.path.expanduser(path))


def _inside(path: str, folder: str) -> str | None:
    """The relative path of ``path`` under ``folder`` ("" when equal), None when not inside."""
    p, f = _norm(path), _norm(folder)
    if p == f:
        return ""
    sep = "/" if is_url(p) else os.sep
    if p.startswith(f.rstrip(sep) + sep):
        return p[len(f.rstrip(sep)) + 1:]
    return None


def event_log_dir(out_dir: str) -> str:
    """The folder of gradguard's files under ``out_dir``: ``<out_dir>/gradguard``, except where a
    folder of that name would shadow the ``gradguard`` package (``out_dir`` is the working
    directory or on ``sys.path``): then ``<out_dir>/gradguard_runs``."""
    if is_url(out_dir):
        return join(out_dir, "gradguard")
    real = os.path.realpath(out_dir)
    importable = {os.path.realpath(p or os.getcwd()) for p in sys.path if isinstance(p, str)}
    importable.add(os.path.realpath(os.getcwd()))
    return os.path.join(out_dir, "gradguard_runs" if real in importable else "gradguard")


def choose_log_dir(named: str | None, engine_dirs: Iterable[str | None], *, engine: str,
                   checkpoint_dirs: Iterable[str | None] = (), checkpoint_prefix: str | None = None,
                   how_to_name: str = "GradGuardCallback(out_dir=...)") -> str | None:
    """The folder under which gradguard writes its files (see the module docstring), or None (one
    warning issued). ``engine_dirs``: the engine's log folders, best first. ``checkpoint_dirs``:
    folders whose entries are checkpoints; ``checkpoint_prefix``: how a checkpoint entry's name
    starts (HF: ``checkpoint-``), so that a folder inside one is refused too."""
    if named:
        return str(named)
    cwd = os.path.realpath(os.getcwd())
    containers = [str(c) for c in checkpoint_dirs if c]
    why = "the engine keeps no log folder of its own"
    for d in engine_dirs:
        if not d:
            continue
        d = str(d)
        if not is_url(d) and _norm(d) == cwd:
            why = "the engine's log folder is the working directory (no logger folder, no root folder given)"
            continue
        clash = None
        for c in containers:
            rel = _inside(d, c)
            if rel == "":
                clash = f"{d} holds the checkpoints"
            elif rel is not None and checkpoint_prefix and rel.split("/" if is_url(d) else os.sep)[0].startswith(
                    checkpoint_prefix):
                clash = f"{d} lies inside a checkpoint"
            if clash:
                break
        if clash:
            why = f"the engine's log folder {clash}"
            continue
        return d
    warn(f"gradguard: no event log for this {engine} run: {why}. Findings still reach the console and the "
         f"engine's loggers; to keep gradguard's files, name a folder: {how_to_name} or "
         "GuardConfig(output={'dir': ...})")
    return None


def _fs(path: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:  # pragma: no cover - fsspec comes with Lightning and transformers
        raise OSError(f"writing to {path} needs fsspec (pip install fsspec)") from exc
    fs, p = url_to_fs(path)
    return fs, p


def open_append(path: str, binary: bool = False) -> IO[Any]:
    """A text file (bytes with ``binary``) opened for appending; remote paths through fsspec (the
    parent folder is created)."""
    if is_url(path):
        fs, p = _fs(path)
        parent = p.rsplit("/", 1)[0]
        if parent:
            fs.makedirs(parent, exist_ok=True)
        return fs.open(p, "ab") if binary else fs.open(p, "a", encoding="utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return _io.open_append(path, binary)  # never through a symlink planted at the log's name


def write_text(path: str, text: str) -> None:
    """Write a whole file (atomically on a local disk: a temporary file, then a rename). An I/O
    error (disk full, read-only folder, a symlink gradguard will not follow) is a ``RuntimeWarning``,
    never an exception: gradguard's own files never stop training."""
    try:
        _write_text(path, text)
    except Exception as exc:  # noqa: BLE001 - remote file systems raise their own errors
        warn(f"gradguard: could not write {path} ({type(exc).__name__}: {exc}); training continues",
             category=RuntimeWarning, stacklevel=3)


def _write_text(path: str, text: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        parent = p.rsplit("/", 1)[0]
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(p, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _io.atomic_write(path, text)  # a fresh temp file (O_EXCL, no symlink followed), then a rename
