"""Training-state snapshots for rollback: a ring in host memory (optionally mirrored to disk).

A snapshot of the weights after update k is a *candidate* until the loss at step k+1 (its direct
test) comes back healthy; it becomes *confirmed* after ``confirm_steps`` healthy steps. Rollback
restores the newest confirmed snapshot, else the newest tested candidate; never an untested one.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Snapshot", "SnapshotRing", "DiskSnapshots", "copy_state", "copy_into", "state_nbytes"]


def copy_state(obj: Any, device: str | torch.device | None = "cpu", pin: bool = False) -> Any:
    """Deep copy of a (nested) state with every tensor cloned (to ``device`` if given)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if device is not None and t.device != torch.device(device):
            out = torch.empty(t.shape, dtype=t.dtype, device=device,
                              pin_memory=pin and t.is_cuda and torch.device(device).type == "cpu")
            out.copy_(t, non_blocking=pin)
            return out
        return t.clone()
    if isinstance(obj, dict):
        return {k: copy_state(v, device, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_state(v, device, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_state(v, device, pin) for v in obj)
    return copy.deepcopy(obj)


def copy_into(dst: Any, src: Any) -> Any:
    """Copy ``src`` into the tensors of a previous copy ``dst`` of the same structure (reusing its
    buffers, pinned ones included); falls back to a fresh copy where the structure differs."""
    if isinstance(src, torch.Tensor):
        if isinstance(dst, torch.Tensor) and dst.shape == src.shape and dst.dtype == src.dtype:
            dst.copy_(src.detach(), non_blocking=dst.is_pinned())
            return dst
        return copy_state(src, "cpu", pin=src.is_cuda)
    if isinstance(src, dict) and isinstance(dst, dict):
        return {k: copy_into(dst.get(k), v) for k, v in src.items()}
    if isinstance(src, (list, tuple)) and isinstance(dst, (list, tuple)) and len(dst) == len(src):
        out = [copy_into(d, v) for d, v in zip(dst, src)]
        return tuple(out) if isinstance(src, tuple) else out
    return copy_state(src, "cpu", pin=True)


class _HashingWriter:
    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskSnapshots:
    """Snapshots as files: ``snapshot-<step>.pt`` plus a ``.sha256`` written after it.

    Writes are atomic (temp file, fsync, rename; the checksum last), reads verify the checksum and
    use ``torch.load(weights_only=True)``. A file without a valid checksum (corrupt, or a process
    killed while writing) is skipped in favour of the next older one.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"snapshot-{step:09d}.pt")

    def write(self, step: int, state: dict[str, Any]) -> str:
        final = self.path(step)
        tmp = final + f".tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            torch.save(state, writer)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        digest_tmp = final + ".sha256.tmp"
        with open(digest_tmp, "w", encoding="ascii") as fh:
            fh.write(writer.hash.hexdigest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(digest_tmp, final + ".sha256")
        _fsync_dir(self.directory)
        return final

    def steps(self) -> list[int]:
        out = []
        for p in glob.glob(os.path.join(self.directory, "snapshot-*.pt")):
            name = os.path.basename(p)[len("snapshot-"):-len(".pt")]
            if name.isdigit():
                out.append(int(name))
        return sorted(out)

    def load(self, step: int) -> dict[str, Any]:
        """The verified state of one snapshot; raises ValueError if missing or corrupt."""
        path = self.path(step)
        try:
            with open(path + ".sha256", encoding="ascii") as fh:
                expected = fh.read().strip()
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ValueError(f"snapshot {path} is missing or incomplete ({exc})") from exc
        if hashlib.sha256(data).hexdigest() != expected:
            raise ValueError(f"snapshot {path} failed its checksum")
        import io

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def latest_valid(self, at_most: int | None = None) -> tuple[int, dict[str, Any], list[str]]:
        """(step, state, problems) of the newest loadable snapshot; problems lists what was skipped."""
        problems: list[str] = []
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            try:
                return step, self.load(step), problems
            except Exception as exc:  # corrupt zip, bad checksum, missing file
                problems.append(str(exc))
        raise FileNotFoundError(f"no valid snapshot in {self.directory}: " + "; ".join(problems))

    def remove(self, step: int) -> None:
        for suffix in ("", ".sha256"):
            try:
                os.remove(self.path(step) + suffix)
            except FileNotFoundError:
                pass


def state_nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclass
class Snapshot:
    """One saved training state."""

    step: int
    state: dict[str, Any]
    nbytes: int
    seconds: float
    healthy_steps: int = 0
    tested: bool = False
    confirmed: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class SnapshotRing:
    """Takes, confirms and restores snapshots of model, optimizer, scheduler, scaler, RNG and
    any extra state the engine registers (guard detectors, data position...)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, ring_size: int,
                 confirm_steps: int, scheduler: Any = None, scaler: Any = None,
                 disk_dir: str | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.ring_size = ring_size
        self.confirm_steps = confirm_steps
        self.candidates: list[Snapshot] = []
        self.ring: list[Snapshot] = []
        self.extra: dict[str, tuple[Any, Any]] = {}  # name -> (get_state, set_state)
        self.taken = 0
        self.restored = 0
        self.total_seconds = 0.0
        self.last_nbytes = 0
        self.disk = DiskSnapshots(disk_dir) if disk_dir else None
        self._spare: dict[str, Any] | None = None  # buffers of a dropped snapshot, reused by the next
        self.problems: list[str] = []

    def register(self, name: str, get_state: Any, set_state: Any) -> None:
        self.extra[name] = (get_state, set_state)

    def take(self, step: int) -> Snapshot:
        t0 = time.perf_counter()
        spare, self._spare = self._spare, None
        if spare is not None and self.disk is None:
            tensors = {"model": copy_into(spare["model"], self.model.state_dict()),
                       "optimizer": copy_into(spare["optimizer"], self.optimizer.state_dict())}
        else:
            tensors = {"model": copy_state(self.model.state_dict(), "cpu", pin=True),
                       "optimizer": copy_state(self.optimizer.state_dict(), "cpu", pin=True)}
        state: dict[str, Any] = {**tensors, "rng": _rng_state()}
        if self.scheduler is not None:
            state["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None:
            state["scaler"] = copy.deepcopy(self.scaler.state_dict())
        for name, (get, _) in self.extra.items():
            state[name] = copy.deepcopy(get())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        nbytes = state_nbytes(state)
        meta: dict[str, Any] = {}
        if self.disk is not None:
            meta["path"] = self.disk.write(step, state)
            state = {}  # the disk tier keeps no second copy in memory
        snap = Snapshot(step=step, state=state, nbytes=nbytes, seconds=time.perf_counter() - t0, meta=meta)
        self.candidates.append(snap)
        self.taken += 1
        self.total_seconds += snap.seconds
        self.last_nbytes = nbytes
        return snap

    def observe(self, step: int, healthy: bool) -> list[Snapshot]:
        """Feed one step's verdict. Returns the candidates confirmed by it."""
        confirmed = []
        keep = []
        for snap in self.candidates:
            if step <= snap.step:
                keep.append(snap)
                continue
            if not snap.tested:
                if not healthy:
                    continue  # its direct test failed: the update before it was bad; drop it
                snap.tested = True
            if healthy:
                snap.healthy_steps += 1
            if snap.healthy_steps >= self.confirm_steps:
                snap.confirmed = True
                self.ring.append(snap)
                confirmed.append(snap)
            else:
                keep.append(snap)
        dropped = [s for s in self.candidates if s not in keep and not s.confirmed]
        self.candidates = keep
        while len(self.ring) > self.ring_size:
            dropped.append(self.ring.pop(0))
        for snap in dropped:
            self._release(snap)
        return confirmed

    def drop_untested(self) -> None:
        """Forget the candidates not yet tested (after weights came back from elsewhere, they
        describe a discarded future)."""
        for snap in [s for s in self.candidates if not s.tested]:
            self.candidates.remove(snap)
            self._release(snap)

    def _release(self, snap: Snapshot) -> None:
        if self.disk is not None:
            self.disk.remove(snap.step)
        elif snap.state:
            self._spare = snap.state

    def best(self) -> Snapshot | None:
        """The newest restorable snapshot: confirmed, or a candidate whose direct test (the loss
        right after it) came back healthy. Never an untested candidate."""
        usable = self.ring + [s for s in self.candidates if s.tested]
        return max(usable, key=lambda s: s.step) if usable else None

    def load_state(self, snap: Snapshot) -> tuple[Snapshot, dict[str, Any]]:
        """The state of ``snap``; from disk, falling back to older snapshots if it is unreadable."""
        if self.disk is None:
            return snap, snap.state
        step, state, problems = self.disk.latest_valid(at_most=snap.step)
        self.problems.extend(problems)
        if step != snap.step:
            older = [s for s in self.ring + self.candidates if s.step == step]
            snap = older[0] if older else Snapshot(step=step, state={}, nbytes=0, seconds=0.0,
                                                   tested=True, meta={"recovered_from_disk": True})
        return snap, state

    @torch.no_grad()
    def restore(self, snap: Snapshot, *, restore_schedule: bool, restore_rng: bool = False) -> Snapshot:
        """Copy the snapshot back into training (the snapshot itself is never aliased). Returns
        the snapshot actually restored (an older one if the disk copy was unreadable)."""
        snap, st = self.load_state(snap)
        self.model.load_state_dict(st["model"])  # copies into the existing parameters
        # one restore for every tier: optimizer state back, its current settings kept (gradguard.recovery)
        from .recovery import load_optimizer_keeping_settings

        load_optimizer_keeping_settings(self.optimizer, st["optimizer"], restore_schedule=restore_schedule)
        if self.scheduler is not None and restore_schedule and "scheduler" in st:
            self.scheduler.load_state_dict(copy.deepcopy(st["scheduler"]))
        if self.scaler is not None and "scaler" in st:
            self.scaler.load_state_dict(copy.deepcopy(st["scaler"]))
        if restore_rng:
            torch.set_rng_state(st["rng"]["torch"])
            if "cuda" in st["rng"]:
                torch.cuda.set_rng_state_all(st["rng"]["cuda"])
        for name, (_, set_state) in self.extra.items():
            if name in st:
                set_state(copy.deepcopy(st[name]))
        # candidates taken after the restored point describe a discarded future
        self.candidates = [s for s in self.candidates if s.step <= snap.step]
        self.restored += 1
        return snap

    def stats(self) -> dict[str, Any]:
        return {"taken": self.taken, "restored": self.restored, "bytes": self.last_nbytes,
                "seconds_total": self.total_seconds, "ring": [s.step for s in self.ring],
                "candidates": [s.step for s in self.candidates]}

    def state_dict(self) -> dict[str, Any]:
        """Counters only: snapshots live in memory and are not part of a checkpoint."""
        return {"taken": self.taken, "restored": self.restored, "total_seconds": self.total_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken, self.restored, self.total_seconds = state["taken"], state["restored"], state["total_seconds"]
