"""Recovery from the engine's own checkpoints, once for every engine.

* :class:`CheckpointTier`: which checkpoints may be rolled back to (the one trust rule).
* :func:`rollback_from_checkpoints`: the rollback loop (newest trusted first; every process reads
  the same file or none is used; an unusable file is skipped with a ``snapshot_fallback`` event).
* :func:`restore_training_state` / :func:`load_optimizer_keeping_settings`: the restore that puts
  weights and optimizer state back but keeps the optimizer's current settings (the schedule's LRs
  unless ``recovery.restore_schedule``, the policy's Adam beta2/eps, weight decay...).
* :func:`safe_load`: the only way a checkpoint file is read: ``torch.load(weights_only=True)``.

Only this run's checkpoints are trusted: a checkpoint is rolled back to only when its path lies inside
the run's own checkpoint folder(s) (``source.roots``: the Trainer's ``output_dir``, the
``ModelCheckpoint`` folders; symlinks resolved; a file elsewhere is never read), and only while its
files match their fingerprint (the names, sizes and modification times of its files, no file read).
The fingerprint is taken once the checkpoint is complete (the first step after the save, or the
run's end) and written, with the id of the run, into gradguard's own file :data:`LEDGER` in its run
folder (beside the event log; never into the engine's checkpoint or its checkpoint folders: identical
runs save identical states, and a checkpoint folder holds checkpoints only).
A resumed run checks every checkpoint its saved guard state lists against that file before the
first rollback can use it: a checkpoint changed since its save, without a fingerprint, or
fingerprinted by another run (a later run reusing the folder) is not trusted (a warning and a
``checkpoint_untrusted`` event; the rollback falls back to the next source). The checkpoint the run
resumed from is vouched for by the resume itself (fingerprinted then if its writer died before it
could). Remote checkpoints (URLs) have no fingerprint: their location is the only check. A run
forked by copying its folder, or a tampered guard state naming another path, does not roll back
into someone else's files (a ``snapshot_fallback`` event says why).

The trust rule (every engine, and the in-memory snapshot ring): a checkpoint written after step
``s`` becomes trusted once ``recovery.confirm_steps`` healthy steps have followed it; an unstable
step first (a spike, a non-finite loss or gradient, an overflow rate, a scale collapse) marks it bad
for good. Suspect steps count neither way.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch

from . import _io
from .contract import CheckpointSource, Collective
from .policy import INSTABILITY_KINDS
from .snapshot import load_optimizer_keeping_settings  # the one optimizer restore, beside copy_state

__all__ = ["CheckpointTier", "checkpoint_fingerprint", "LEDGER", "read_ledger", "BAD_KINDS", "step_verdict", "rollback_from_checkpoints", "restore_training_state",
           "load_optimizer_keeping_settings", "safe_load", "UnsafeCheckpoint"]

#: findings that make a checkpoint written just before them unusable for a rollback
BAD_KINDS = INSTABILITY_KINDS | {"nonfinite_loss", "nonfinite_grad"}


def step_verdict(findings: list[Any], loss: float | None, *, unstable: bool = False,
                 suspect: bool = False) -> tuple[bool, bool]:
    """(healthy, bad) of one step for the trust rule. Bad: a finding of :data:`BAD_KINDS`, or the
    policy judged the step unstable. Healthy: neither bad nor suspect, and the loss is finite. The
    verdict does not depend on whether the policy acts (monitor mode judges like the default)."""
    bad = unstable or any(f.kind in BAD_KINDS for f in findings)
    healthy = not bad and not suspect and loss is not None and math.isfinite(loss)
    return healthy, bad


#: Files of a checkpoint folder left out of its fingerprint: gradguard's own state file (written
#: after the save) and the Trainer's bookkeeping that a later save may touch; temp files.
_UNFINGERPRINTED = frozenset({"gradguard_state.json", "trainer_state.json"})
_MAX_FILES = 10_000


#: gradguard's own file of engine-checkpoint fingerprints, in its run folder (beside the event log):
#: ``{"version": 1, "checkpoints": {absolute path: {"step", "fingerprint", "run"}}}``.
LEDGER = "checkpoint_fingerprints.json"


def ledger_key(path: str) -> str:
    return os.path.abspath(path)


def read_ledger(ledger: str) -> dict[str, dict[str, Any]]:
    """The records of a :data:`LEDGER` file (``{}`` when missing, a symlink, unreadable or malformed:
    then no checkpoint of that folder has a fingerprint)."""
    try:
        _io.check_read(ledger)
        fd = os.open(ledger, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, encoding="utf-8") as fh:
            book = json.load(fh)
    except (OSError, ValueError):
        return {}
    records = book.get("checkpoints") if isinstance(book, dict) else None
    if not isinstance(records, dict):
        return {}
    return {k: v for k, v in records.items() if isinstance(k, str) and isinstance(v, dict)
            and isinstance(v.get("fingerprint"), str) and isinstance(v.get("step"), int)}


def _is_url(path: str) -> bool:
    return "://" in path


def checkpoint_fingerprint(path: str, key: str = "") -> str | None:
    """sha256 of ``key`` and the (relative name, size, mtime) of the checkpoint's files (a folder:
    every file under it but :data:`_UNFINGERPRINTED` and temp files), None when it cannot be taken
    (missing, a URL). Cheap: no file is read."""
    if not path or _is_url(path):
        return None
    try:
        items: list[tuple[str, int, int]] = []
        if os.path.isdir(path):
            for folder, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    if name in _UNFINGERPRINTED or ".tmp" in name:
                        continue
                    f = os.path.join(folder, name)
                    st = os.stat(f)
                    items.append((os.path.relpath(f, path), st.st_size, st.st_mtime_ns))
                    if len(items) > _MAX_FILES:
                        return None
        else:
            st = os.stat(path)
            items.append((os.path.basename(path), st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    h = hashlib.sha256(key.encode())
    for name, size, mtime in items:
        h.update(f"{name}\0{size}\0{mtime};".encode())
    return h.hexdigest()


def _inside(path: str, roots: list[str]) -> bool:
    if _is_url(path):
        return any(r and path.startswith(r.rstrip("/") + "/") for r in roots)
    real = os.path.realpath(path)
    for root in roots:
        if not root or _is_url(root):
            continue
        r = os.path.realpath(root)
        if real == r or real.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


def _nothing() -> None:
    """The default of a callable setting that names nothing (a module function: a guard pickles)."""
    return None


class CheckpointTier:
    """The engine's checkpoints as the rollback disk tier, with the one trust rule (and only this
    run's checkpoints: see :meth:`untrusted`)."""

    def __init__(self, confirm_steps: int) -> None:
        self.confirm_steps = max(1, int(confirm_steps))
        self.entries: list[dict[str, Any]] = []  # {"step", "path", "healthy", "tested", "bad"}
        #: this run's id in the fingerprint files (a resumed run continues the id of the run it resumed)
        self.run_id = secrets.token_hex(8)
        #: "<step>:<path>" -> the checkpoint's fingerprint, taken once its files are complete and written
        #: to its folder's :data:`LEDGER` (never into the guard state: identical runs save identical states)
        self.fingerprints: dict[str, str | None] = {}
        #: entries loaded from a saved guard state, checked against their fingerprint files at the next step
        self.claimed = False
        #: the run's checkpoint folders (set by the rollback from its checkpoint source)
        self.roots: Callable[[], list[str] | None] = _nothing
        #: gradguard's run folder that holds the :data:`LEDGER` (None: none on this process, fingerprints
        #: are then kept in memory only and a resumed run trusts only the checkpoint it resumed from)
        self.ledger_dir: Callable[[], str | None] = _nothing
        #: events for the owner to emit (untrusted checkpoints, fingerprint files that could not be written)
        self.events: list[dict[str, Any]] = []

    def saved(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> None:
        """The engine wrote a checkpoint after update ``step`` (one entry per file; a re-used name
        replaces the entry: the old content is gone)."""
        for path in paths or ("",):
            path = str(path)
            self.entries = [e for e in self.entries if not (e["path"] == path and (path or e["step"] == step))]
            self.fingerprints.pop(f"{int(step)}:{path}", None)
            self.entries.append({"step": int(step), "path": path, "healthy": 0, "tested": False, "bad": False})

    def state_with(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> list[dict[str, Any]]:
        """The state this tier will have once the checkpoint after update ``step`` at ``paths`` is
        recorded (nothing changes here). What a checkpoint stores of the tier: it lists the
        checkpoint itself, so a run resumed from it keeps it in its rollback tier, exactly as the
        run that wrote it does."""
        ahead = CheckpointTier(self.confirm_steps)
        ahead.load_state_dict(self.state_dict())
        ahead.saved(step, paths)
        return ahead.state_dict()

    def observe(self, step: int, healthy: bool, bad: bool) -> None:
        """One step's verdict (see :func:`step_verdict`). A checkpoint saved before this step is
        fingerprinted now (its files are complete), once; entries loaded from a saved state are
        checked first (:meth:`verify_claimed`)."""
        if self.claimed:
            self.verify_claimed(step - 1)
        self.fingerprint_saved(before=step)
        for e in self.entries:
            if e["tested"] or e["bad"] or step <= e["step"]:
                continue
            if bad:
                e["bad"] = True
            elif healthy:
                e["healthy"] += 1
                e["tested"] = e["healthy"] >= self.confirm_steps

    def fingerprint_saved(self, before: int | None = None) -> None:
        """Fingerprint the checkpoints saved before step ``before`` (None: all, the run's end) that
        have none yet, and write each into its folder's :data:`LEDGER`."""
        for e in self.entries:
            key = f"{e['step']}:{e['path']}"
            if (before is None or before > e["step"]) and key not in self.fingerprints:
                fp = self.fingerprints[key] = checkpoint_fingerprint(str(e["path"]))
                if fp:
                    self._record(e, fp)

    def ledger(self) -> str | None:
        """The :data:`LEDGER` file of this run (None: no local run folder on this process)."""
        folder = self.ledger_dir()
        return None if not folder or _is_url(folder) else os.path.join(folder, LEDGER)

    def _record(self, entry: dict[str, Any], fp: str) -> None:
        """Write ``entry``'s fingerprint into the run's :data:`LEDGER` (atomically, no link followed;
        records of checkpoints gone are dropped). An I/O error is an event, never raised."""
        path, ledger = str(entry["path"]), self.ledger()
        if ledger is None:
            return
        record = {"step": int(entry["step"]), "fingerprint": fp, "run": self.run_id}
        try:
            book = read_ledger(ledger)
            if book.get(ledger_key(path)) == record:
                return
            book[ledger_key(path)] = record
            book = {k: v for k, v in book.items() if os.path.exists(k)}
            os.makedirs(os.path.dirname(ledger), exist_ok=True)
            _io.atomic_write(ledger, json.dumps({"version": 1, "checkpoints": book}, indent=1, sort_keys=True))
        except OSError as exc:
            self.events.append({"type": "checkpoint_fingerprint_error", "path": path, "error": str(exc),
                                "message": f"gradguard: could not write the fingerprint of {path} into {ledger} ({exc}); "
                                           "a run resumed later will not trust this checkpoint for a rollback"})

    def verify_claimed(self, resume_step: int) -> None:
        """Check the entries a saved guard state listed (a resumed run) against the run's :data:`LEDGER`,
        once. The checkpoint the run resumed from (saved at ``resume_step``) is vouched for by
        the resume and fingerprinted now if it has no record; any other one without a record, with
        files that changed since, or recorded by another run is forgotten (a ``checkpoint_untrusted``
        event). Checkpoints gone, remote (URLs), outside the run's folders (refused at the rollback)
        or without a path are left as they are."""
        self.claimed = False
        roots, ledger = self.roots(), self.ledger()
        book = read_ledger(ledger) if ledger is not None else {}
        checked: list[tuple[dict[str, Any], str | None, dict[str, Any] | None]] = []
        for e in self.entries:
            path = str(e.get("path") or "")
            if not path or _is_url(path) or self.outside(e, roots):
                continue
            current = checkpoint_fingerprint(path)
            if current is None:
                continue  # gone (rotated away): a rollback cannot read it anyway
            record = book.get(ledger_key(path))
            checked.append((e, current, record))
        # the run continues the id of the run that wrote the checkpoint it resumed from (else of the newest
        # other record that matches its files)
        lineage = None
        for _e, current, record in sorted(checked, key=lambda c: (c[0]["step"] == resume_step, c[0]["step"]), reverse=True):
            if record is not None and record["fingerprint"] == current and isinstance(record.get("run"), str):
                lineage = record["run"]
                break
        if lineage is not None:
            self.run_id = lineage
        for e, current, record in checked:
            key, path = f"{e['step']}:{e['path']}", str(e["path"])
            if e["step"] == resume_step:  # the checkpoint the run resumed from
                self.fingerprints[key] = current
                if record is None or record["fingerprint"] != current:
                    self._record(e, str(current))
                continue
            if record is None:
                why = (f"{path} has no fingerprint in {ledger} (not saved by this run, or its record was lost)"
                       if ledger is not None else f"{path} has no fingerprint (this process has no gradguard run "
                                                  "folder to keep one in: name one with output.dir)")
            elif record["fingerprint"] != current or record["step"] != e["step"]:
                why = f"{path} changed since it was saved (its files' sizes or times differ from its fingerprint)"
            elif record.get("run") != self.run_id:
                why = f"{path} was fingerprinted by another run ({record.get('run')!r}, this run {self.run_id!r})"
            else:
                self.fingerprints[key] = current
                continue
            self.forget(e)
            self.events.append({"type": "checkpoint_untrusted", "wanted": e["step"], "path": path, "reason": why,
                                "message": f"gradguard: {why}: not trusted for a rollback; the rollback uses the "
                                           "next checkpoint or snapshot"})

    def take_events(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out

    def candidates(self) -> list[dict[str, Any]]:
        """Trusted entries, newest first."""
        return sorted((e for e in self.entries if e["tested"] and not e["bad"]), key=lambda e: e["step"], reverse=True)

    def forget(self, entry: dict[str, Any]) -> None:
        self.entries = [e for e in self.entries if e is not entry]

    def drop_after(self, step: int) -> None:
        """Entries newer than a restored one describe a discarded future."""
        self.entries = [e for e in self.entries if e["step"] <= step]

    def state_dict(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    def outside(self, entry: dict[str, Any], roots: list[str] | None) -> str:
        """Why ``entry`` is not this run's checkpoint by its place ('' when it is): a path outside the
        run's checkpoint folders ``roots`` (None: the source names none, no location check)."""
        path = str(entry.get("path") or "")
        if path and roots is not None and not _inside(path, [str(r) for r in roots if r]):
            return (f"{path} lies outside this run's checkpoint folder(s) {[str(r) for r in roots if r]} (a copied run "
                    "or an edited guard state names another run's checkpoint): not trusted")
        return ""

    def changed(self, entry: dict[str, Any]) -> str:
        """Why ``entry``'s files are not the ones saved ('' when they are, or could not be fingerprinted)."""
        path = str(entry.get("path") or "")
        fp = self.fingerprints.get(f"{entry['step']}:{path}")
        if fp and checkpoint_fingerprint(path) != fp:
            return f"{path} changed since it was saved (its files' sizes or times differ): not trusted"
        return ""

    def untrusted(self, entry: dict[str, Any], roots: list[str] | None) -> str:
        """:meth:`outside` or :meth:`changed` ('' for a checkpoint of this run, as saved)."""
        return self.outside(entry, roots) or self.changed(entry)

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.entries = []
        self.fingerprints = {}
        for e in state or []:
            e = dict(e)
            e.setdefault("path", "")
            e.setdefault("healthy", 1 if e.get("tested") else 0)
            self.entries.append(e)
        self.claimed = bool(self.entries)


class UnsafeCheckpoint(Exception):
    """A checkpoint file does not load with ``weights_only=True`` (it holds pickled objects)."""


def safe_load(path_or_bytes: str | bytes | io.BytesIO, *, loader: Callable[..., Any] | None = None) -> Any:
    """``torch.load(..., map_location="cpu", weights_only=True)``: tensors, containers and
    primitives only; a pickled object is refused, never executed. ``loader`` (an engine's own reader,
    e.g. for remote filesystems) is called with ``weights_only=True``. Raises :class:`UnsafeCheckpoint`
    naming the refused content."""
    try:
        if loader is not None:
            return loader(path_or_bytes, weights_only=True)
        src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
        return torch.load(src, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "weights_only" in text or "Unpickl" in type(exc).__name__ or "Unsupported global" in text:
            first = text.splitlines()[0] if text else ""
            raise UnsafeCheckpoint(f"not loadable with weights_only=True, skipped unread ({first[:200]})") from exc
        raise


@torch.no_grad()
def restore_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any], *,
                           restore_schedule: bool, scheduler: Any = None, scaler: Any = None) -> None:
    """Put a checkpoint read by a :class:`~gradguard.contract.CheckpointSource` back into training:
    weights copied into the existing parameters (keys absent from the file, e.g. tied weights, are
    left alone), optimizer state with the current settings kept, scheduler state only with
    ``restore_schedule``, the GradScaler state when there is one."""
    own = model.state_dict()
    for k, v in payload["model"].items():
        own[k].copy_(v)
    load_optimizer_keeping_settings(optimizer, payload["optimizer"], restore_schedule=restore_schedule)
    if restore_schedule and scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if scaler is not None and payload.get("scaler"):
        scaler.load_state_dict(payload["scaler"])


def check_weights(weights: dict[str, torch.Tensor], own: dict[str, torch.Tensor], *, exact: bool) -> None:
    """Raise ValueError when ``weights`` do not fit the model (unknown keys, other shapes; with
    ``exact`` also missing keys)."""
    unexpected = [k for k in weights if k not in own]
    missing = [k for k in own if k not in weights] if exact else []
    if unexpected or missing or not weights:
        raise ValueError(f"weights do not match the model (unexpected keys {unexpected[:3]}, missing {missing[:3]})")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"weight {k} has shape {tuple(v.shape)}, the model {tuple(own[k].shape)}")


def rollback_from_checkpoints(tier: CheckpointTier, source: CheckpointSource, collective: Collective,
                              emit: Callable[[dict[str, Any]], None], step: int,
                              detectors: Any = None) -> dict[str, Any] | None:
    """The rollback loop over the engine's checkpoints: the newest trusted one that every process
    can read is restored (one vote per file tried). Unusable files (gone, overwritten, unsafe,
    mismatched) are forgotten with a ``snapshot_fallback`` event naming the file and why. Returns
    ``{"to_step", "path", "source": "checkpoint"}`` or None."""
    roots = getattr(source, "roots", None)
    for entry in tier.candidates():
        path = entry["path"]
        payload, problem = None, ""
        try:
            why = tier.untrusted(entry, roots)  # never read another run's files, nor files changed since the save
            if why:
                raise PermissionError(why)
            payload = source.read(path, int(entry["step"]))  # weights_only=True: reading is safe
            why = tier.changed(entry)  # rewritten while it was read: not restored
            if why:
                payload = None
                raise PermissionError(why)
        except Exception as exc:
            problem = f"{path}: {type(exc).__name__}: {exc}"[:400]
        if not collective.all_agree(payload is not None):  # every process restores, or none does
            tier.forget(entry)
            emit({"type": "snapshot_fallback", "step": step, "wanted": entry["step"], "path": path,
                  "problems": [problem or f"{path}: unreadable on another process"]})
            continue
        assert payload is not None
        source.restore(payload)
        guard = payload.get("guard") or {}
        if detectors is not None and guard.get("detectors"):
            detectors.load_state_dict(guard["detectors"])
        tier.drop_after(int(entry["step"]))
        return {"to_step": int(entry["step"]), "path": path, "source": "checkpoint"}
    return None

