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
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _io
from ._compat import local_optimizer
from ._shard import load_model_state, local_state, model_state, rewrap_optimizer_state

__all__ = ["load_optimizer_keeping_settings", "Snapshot", "SnapshotRing", "DiskSnapshots", "SnapshotUnavailable", "copy_state", "copy_into",
           "state_nbytes", "model_fingerprint", "optimizer_structure", "clean_orphans",
           "reclaim_dead_runs", "write_owner", "OWNER_FILE"]

_TMP_MARK = ".tmp-"


from .errors import SnapshotUnavailable, warn  # noqa: E402  (one error hierarchy: gradguard.errors)


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model's state names and shapes: two runs of different models (or a
    model whose layout changed) never share one."""
    return _fingerprint(model_state(model))


def _fingerprint(model_state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name, t in model_state.items():
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        h.update(f"{name}:{shape};".encode())
    return h.hexdigest()[:16]


def optimizer_structure(optimizer: torch.optim.Optimizer) -> list[int]:
    """Parameters per param group: what ``Optimizer.load_state_dict`` insists on matching."""
    return [len(g["params"]) for g in optimizer.param_groups]


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


def _tmp_path(final: str) -> str:
    """A fresh temp-file name beside ``final`` naming the writer (host and pid, so only dead writers'
    files are removed) and a random part (the file is created with ``O_EXCL``: nothing planted at a
    guessable name is ever written through)."""
    return _io.temp_name(final, f"{_host()}-{os.getpid()}.")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # no write of ours is in progress while we look
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_orphans(root: str) -> list[str]:
    """Remove temp files left by snapshot writers that died mid-write (their host and pid are in
    the name; the pid no longer runs on this host), in ``root`` and its run folders. Returns the removed paths; files it
    cannot remove are left (and not reported)."""
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    for path in glob.glob(os.path.join(root, "*" + _TMP_MARK + "*")) + glob.glob(
            os.path.join(root, "*", "*" + _TMP_MARK + "*")):
        writer = path.rsplit(_TMP_MARK, 1)[1]
        host, _, pid_text = writer.rpartition("-")
        pid_text = pid_text.split(".", 1)[0]  # <host>-<pid>.<random>
        if (host and host != _host()) or not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue  # another machine's writer (cannot tell if it runs), or a live one
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed


#: The file naming a disk snapshot folder's owner (host, pid, the process's start time).
OWNER_FILE = "owner.json"


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux: field 22 of ``/proc/<pid>/stat``), None elsewhere:
    tells a live owner from a later process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_owner(directory: str) -> None:
    """Record this process as the owner of a run's snapshot folder (read by :func:`reclaim_dead_runs`)."""
    import json

    _io.atomic_write(os.path.join(directory, OWNER_FILE),
                     json.dumps({"host": _host(), "pid": os.getpid(), "start": _proc_start(os.getpid())}), fsync=False)


def _owner_dead(directory: str) -> bool:
    """Whether the folder's owner is known to be gone: it ran on this host and its pid no longer
    runs (or runs a later process: another start time). Unknown owners count as alive."""
    import json

    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as fh:
            owner = json.load(fh)
        host, pid, start = owner["host"], int(owner["pid"]), owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no owner file (an older gradguard) or unreadable: never touched
    if host != _host() or pid <= 0:
        return False  # another machine's run: cannot tell whether it still runs
    if pid == os.getpid():
        return False  # this process: a ring of ours
    if _pid_alive(pid):
        now = _proc_start(pid)
        return bool(start and now and now != start)  # the pid was reused by a later process
    return True


def reclaim_dead_runs(root: str) -> list[str]:
    """Remove the snapshot folders (``<root>/run-*``) of runs that died without closing (killed,
    crashed) on this host: their snapshots are of no use to anyone, and they hold disk space. Only
    gradguard's own files are removed (the folder stays if anything else is in it); a live
    process's folder, another host's and one without an owner file are never touched. Returns the
    removed folders."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(root, name)
        if not name.startswith("run-") or os.path.islink(folder) or not os.path.isdir(folder):
            continue
        if not _owner_dead(folder):
            continue
        try:
            for f in os.listdir(folder):
                if f.startswith("snapshot-") or f == OWNER_FILE:
                    os.remove(os.path.join(folder, f))
            os.rmdir(folder)
            removed.append(folder)
        except OSError:
            pass
    return removed


@torch.no_grad()
def _copy_params(params: list[torch.Tensor], saved: Any) -> None:
    if isinstance(saved, list) and len(saved) == len(params):
        for p, v in zip(params, saved):
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                p.copy_(v)


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
    """File wrapper hashing what is written. An ``OSError`` of the file (disk full...) is kept in
    ``error``: ``torch.save`` turns it into a bare ``RuntimeError`` ("unexpected pos")."""

    def __init__(self, fh: Any, path: str | None = None) -> None:
        self.fh = fh
        self.path = path
        self.hash = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            if self.path is not None:
                _io.check_write(self.path)
            self.hash.update(data)
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

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
        """Write one snapshot atomically. On an I/O error (read-only folder, disk full) the temp
        files are removed and the ``OSError`` propagates; no partial snapshot is left behind."""
        final = self.path(step)
        tmp = _tmp_path(final)
        digest_tmp = _tmp_path(final + ".sha256")
        try:
            with _io.create_new(tmp, binary=True) as fh:
                writer = _HashingWriter(fh, final)
                try:
                    torch.save(state, writer)
                except Exception as exc:
                    if writer.error is not None:  # the disk failed mid-write: report the OSError
                        raise writer.error from exc
                    raise
                fh.flush()
                os.fsync(fh.fileno())
            with _io.create_new(digest_tmp) as fh:
                fh.write(writer.hash.hexdigest())
                fh.flush()
                os.fsync(fh.fileno())
            # the data first, its checksum last: a checksum always describes a complete file
            os.replace(tmp, final)
            os.replace(digest_tmp, final + ".sha256")
            _fsync_dir(self.directory)
        except BaseException:
            for path in (tmp, digest_tmp):
                try:
                    os.remove(path)
                except OSError:
                    pass
            raise
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
            _io.check_read(path)
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

    def latest_valid(self, at_most: int | None = None,
                     check: Any = None) -> tuple[int, dict[str, Any], list[str]]:
        """(step, state, problems) of the newest loadable snapshot that passes ``check(state)``
        (a callable raising ``ValueError`` for an unusable one); problems lists what was skipped."""
        problems: list[str] = []
        try:
            steps = self.steps()
        except OSError as exc:  # pragma: no cover - glob swallows most errors
            steps = []
            problems.append(f"cannot list {self.directory} ({exc})")
        for step in reversed(steps):
            if at_most is not None and step > at_most:
                continue
            try:
                state = self.load(step)
                if check is not None:
                    check(state)
                return step, state, problems
            except Exception as exc:  # corrupt zip, bad checksum, missing file, other model
                problems.append(str(exc))
        raise FileNotFoundError(f"no valid snapshot in {self.directory}: " + ("; ".join(problems) or "none left"))

    def remove(self, step: int) -> None:
        """Delete one snapshot's files; an I/O error propagates (the caller decides)."""
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
    any extra state the engine registers (guard detectors, data position...).

    With ``disk_dir`` the files of this ring go to a folder of their own,
    ``<disk_dir>/run-<run_id>/`` (two runs sharing ``disk_dir`` never touch each other's files),
    each holding the fingerprint of the model it was taken from, and an ``owner.json`` naming the
    host and process. Temp files of writers that died mid-write, and the folders of runs that died
    without closing on this host (:func:`reclaim_dead_runs`), are removed at start. An I/O error (read-only folder, disk full, files deleted)
    never propagates: it becomes a ``snapshot_io_error`` event and a warning, and snapshots
    continue in host memory."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, ring_size: int,
                 confirm_steps: int, scheduler: Any = None, scaler: Any = None,
                 disk_dir: str | None = None, run_id: str | None = None) -> None:
        self.model = model
        # the state this process holds (ZeroRedundancyOptimizer: its local partition's optimizer; the
        # settings live in the outer one's param groups, which it copies into the local one each step)
        self.optimizer = local_optimizer(optimizer)
        self.scheduler = scheduler
        self.scaler = scaler
        self.ring_size = ring_size
        self.confirm_steps = confirm_steps
        self.candidates: list[Snapshot] = []
        self.ring: list[Snapshot] = []
        #: a snapshot's step kept beside the ring (not counted in ``ring_size``, never evicted) until
        #: :meth:`unpin`: the initial weights, while the run may still turn out never to have learned
        self.pinned: int | None = None
        self.extra: dict[str, tuple[Any, Any]] = {}  # name -> (get_state, set_state)
        # trainable parameters the optimizer steps that are not the model's (a learnable temperature):
        # not in the model's state, so snapshotted beside it and put back by a rollback too
        model_ids = {id(p) for p in model.parameters()}
        outside = [p for g in self.optimizer.param_groups for p in g["params"]
                   if isinstance(p, torch.Tensor) and id(p) not in model_ids]
        if outside and any(id(p) in model_ids for g in self.optimizer.param_groups for p in g["params"]):
            self.register("optimizer_only_params", lambda: [p.detach().to("cpu", copy=True) for p in outside],
                          lambda saved: _copy_params(outside, saved))
        self.taken = 0
        self.restored = 0
        self.total_seconds = 0.0
        self.last_nbytes = 0
        self._spare: dict[str, Any] | None = None  # buffers of a dropped snapshot, reused by the next
        self.problems: list[str] = []
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
        self.fingerprint = model_fingerprint(model)
        self._structure = optimizer_structure(self.optimizer)
        self._pending: list[dict[str, Any]] = []
        self._on_event: Any = None
        self.disk: DiskSnapshots | None = None
        self.disk_writable = False
        if disk_dir:
            orphans = clean_orphans(disk_dir)
            if orphans:
                self._event({"type": "snapshot_orphans_removed", "step": 0, "paths": orphans})
            dead = reclaim_dead_runs(disk_dir)
            if dead:
                self._event({"type": "snapshot_orphans_removed", "step": 0, "paths": dead})
            try:
                _io.check_write(disk_dir)
                self.disk = DiskSnapshots(os.path.join(disk_dir, f"run-{self.run_id}"))
                write_owner(self.disk.directory)
                self.disk_writable = True
            except OSError as exc:
                self._io_error("create the snapshot folder", exc, 0)

    # -- events ------------------------------------------------------------------------------
    @property
    def on_event(self) -> Any:
        """Callable receiving this ring's events (I/O errors, invalidations); events raised before
        it is set are delivered when it is."""
        return self._on_event

    @on_event.setter
    def on_event(self, fn: Any) -> None:
        self._on_event = fn
        pending, self._pending = self._pending, []
        for ev in pending:
            fn(ev)

    def _event(self, event: dict[str, Any]) -> None:
        if self._on_event is None:
            self._pending.append(event)
        else:
            self._on_event(event)

    def _io_error(self, what: str, exc: OSError, step: int) -> None:
        had_disk = self.disk_writable
        self.disk_writable = False
        msg = (f"gradguard: could not {what} ({exc}); snapshots continue in host memory"
               if had_disk or self.disk is None else f"gradguard: could not {what} ({exc})")
        warn(msg, category=RuntimeWarning, stacklevel=2)
        self._event({"type": "snapshot_io_error", "step": step, "operation": what, "error": str(exc),
                     "errno": exc.errno, "memory_only": not self.disk_writable})

    def register(self, name: str, get_state: Any, set_state: Any) -> None:
        self.extra[name] = (get_state, set_state)

    # -- taking ------------------------------------------------------------------------------
    def _with_rest(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The model/optimizer ``tensors`` with the RNG, scheduler, scaler and registered extras."""
        state: dict[str, Any] = {**tensors, "rng": _rng_state(), "fingerprint": self.fingerprint}
        if self.scheduler is not None:
            state["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None:
            state["scaler"] = copy.deepcopy(self.scaler.state_dict())
        for name, (get, _) in self.extra.items():
            state[name] = copy.deepcopy(get())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return state

    def capture(self, step: int) -> Snapshot:
        """The training state now, in host memory, outside the ring (not confirmed, never on disk):
        what a rollback puts aside in case the restored weights show the data was to blame."""
        tensors = {"model": copy_state(model_state(self.model), "cpu"),
                   "optimizer": copy_state(local_state(self.optimizer.state_dict()), "cpu")}
        state = self._with_rest(tensors)
        return Snapshot(step=step, state=state, nbytes=state_nbytes(state), seconds=0.0, tested=True)

    def take(self, step: int) -> Snapshot:
        t0 = time.perf_counter()
        spare, self._spare = self._spare, None
        to_disk = self.disk is not None and self.disk_writable
        # sharded (FSDP): this process's own pieces, as plain tensors (gradguard._shard)
        model_sd, opt_sd = model_state(self.model), local_state(self.optimizer.state_dict())
        if spare is not None and not to_disk:
            tensors = {"model": copy_into(spare["model"], model_sd),
                       "optimizer": copy_into(spare["optimizer"], opt_sd)}
        else:
            tensors = {"model": copy_state(model_sd, "cpu", pin=True),
                       "optimizer": copy_state(opt_sd, "cpu", pin=True)}
        state = self._with_rest(tensors)
        nbytes = state_nbytes(state)
        meta: dict[str, Any] = {"structure": optimizer_structure(self.optimizer)}
        if to_disk:
            assert self.disk is not None
            try:
                meta["path"] = self.disk.write(step, state)
                state = {}  # the disk tier keeps no second copy in memory
            except OSError as exc:
                self._io_error(f"write snapshot {self.disk.path(step)}", exc, step)
        snap = Snapshot(step=step, state=state, nbytes=nbytes, seconds=time.perf_counter() - t0, meta=meta)
        self.candidates.append(snap)
        self.taken += 1
        self.total_seconds += snap.seconds
        self.last_nbytes = nbytes
        return snap

    def observe(self, step: int, healthy: bool) -> list[Snapshot]:
        """Feed one step's verdict. Returns the candidates confirmed by it."""
        self._check_structure(step)
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
        for snap in dropped + self._evict():
            self._release(snap)
        return confirmed

    def _evict(self) -> list[Snapshot]:
        """Take the oldest snapshots beyond ``ring_size`` out of the ring (the pinned one is not
        counted and stays); the caller releases them."""
        evictable = [x for x in self.ring if x.step != self.pinned]  # oldest first
        out = evictable[:max(0, len(evictable) - self.ring_size)]
        self.ring = [x for x in self.ring if x not in out]
        return out

    def unpin(self) -> None:
        """Release the pinned snapshot: it is evicted like any other once the ring is full."""
        self.pinned = None
        for snap in self._evict():
            self._release(snap)

    def _check_structure(self, step: int) -> None:
        """Parameter groups added (``add_param_group``) since the snapshots were taken: they can no
        longer be restored into this optimizer; drop them (the guard takes a fresh one)."""
        structure = optimizer_structure(self.optimizer)
        if structure == self._structure:
            return
        old, self._structure = self._structure, structure
        self.fingerprint = model_fingerprint(self.model)
        stale = self.ring + self.candidates
        if stale:
            self._event({"type": "snapshot_invalidated", "step": step, "steps": [s.step for s in stale],
                         "reason": f"optimizer param groups changed from {old} to {structure} parameters"})
        self.clear()

    def clear(self) -> None:
        """Forget every snapshot."""
        for snap in self.ring + self.candidates:
            self._release(snap)
        self.ring, self.candidates = [], []
        self._spare = None

    def drop_untested(self) -> None:
        """Forget the candidates not yet tested (after weights came back from elsewhere, they
        describe a discarded future)."""
        for snap in [s for s in self.candidates if not s.tested]:
            self.candidates.remove(snap)
            self._release(snap)

    def _release(self, snap: Snapshot) -> None:
        if "path" in snap.meta and self.disk is not None:
            try:
                self.disk.remove(snap.step)
            except OSError as exc:
                if self.disk_writable:
                    self._io_error(f"remove snapshot {snap.meta['path']}", exc, snap.step)
        elif snap.state:
            self._spare = snap.state

    def best(self) -> Snapshot | None:
        """The newest restorable snapshot: confirmed, or a candidate whose direct test (the loss
        right after it) came back healthy. Never an untested candidate."""
        usable = self.ring + [s for s in self.candidates if s.tested]
        return max(usable, key=lambda s: s.step) if usable else None

    # -- restoring ---------------------------------------------------------------------------
    def live_layout(self) -> tuple[str, dict[str, Any]]:
        """The model's fingerprint and its state's local tensors (:func:`gradguard._shard.model_state`,
        no collective: a rank with a damaged file leaves no other waiting)."""
        live = model_state(self.model)
        return _fingerprint(live), live

    def check_restorable(self, state: dict[str, Any], layout: tuple[str, dict[str, Any]] | None = None) -> None:
        """Raise ``ValueError`` naming the problem unless ``state`` fits this model and optimizer
        exactly (fingerprint, every model tensor's name and shape, the optimizer's param-group
        layout); called before anything is changed. ``layout``: :meth:`live_layout`, when already read."""
        current, live = layout if layout is not None else self.live_layout()
        if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
            raise ValueError("snapshot has no model/optimizer state")
        fp = state.get("fingerprint")
        if fp != current:
            raise ValueError(f"snapshot is from another model (fingerprint {fp!r}, this model {current!r})")
        saved = state["model"]
        if not isinstance(saved, dict) or set(saved) != set(live):
            raise ValueError("snapshot's model tensors do not match this model's")
        for k, v in live.items():
            sv = saved[k]
            if isinstance(v, torch.Tensor) and (not isinstance(sv, torch.Tensor) or sv.shape != v.shape):
                raise ValueError(f"snapshot's {k} does not match this model's shape {tuple(v.shape)}")
        opt = state["optimizer"]
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        if not isinstance(groups, list) or not isinstance(opt.get("state"), dict):
            raise ValueError("snapshot's optimizer state is malformed")
        structure = [len(g.get("params", ())) for g in groups]
        if structure != optimizer_structure(self.optimizer):
            raise ValueError(f"snapshot's optimizer has param groups of {structure} parameters, "
                             f"this optimizer {optimizer_structure(self.optimizer)}")
        for name in ("scheduler", "scaler"):
            if getattr(self, name) is not None and name not in state:
                raise ValueError(f"snapshot has no {name} state")

    def load_state(self, snap: Snapshot) -> tuple[Snapshot, dict[str, Any]]:
        """The checked state of ``snap``; from disk, falling back to older snapshots if it is
        unreadable. Raises :class:`SnapshotUnavailable` when nothing usable is left."""
        if not (snap.state or "path" in snap.meta):
            raise SnapshotUnavailable(f"snapshot of step {snap.step} holds no state")
        if snap.state:
            try:
                self.check_restorable(snap.state)
            except ValueError as exc:
                raise SnapshotUnavailable(f"snapshot of step {snap.step}: {exc}") from exc
            return snap, snap.state
        assert self.disk is not None
        try:
            step, state, problems = self.disk.latest_valid(at_most=snap.step, check=self.check_restorable)
        except FileNotFoundError as exc:
            raise SnapshotUnavailable(str(exc)) from exc
        self.problems.extend(problems)
        if step != snap.step:
            older = [s for s in self.ring + self.candidates if s.step == step]
            snap = older[0] if older else Snapshot(step=step, state={}, nbytes=0, seconds=0.0,
                                                   tested=True, meta={"recovered_from_disk": True})
        return snap, state

    def usable(self) -> list[Snapshot]:
        """Every restorable snapshot (see :meth:`best`), newest first."""
        return sorted(self.ring + [s for s in self.candidates if s.tested], key=lambda s: s.step, reverse=True)

    def load_exact(self, snap: Snapshot) -> dict[str, Any]:
        """The checked state of exactly ``snap`` (no fallback to an older one), changing nothing;
        :class:`SnapshotUnavailable` when it cannot be read or does not fit."""
        if snap.state:
            return self.load_state(snap)[1]
        if self.disk is None or "path" not in snap.meta:
            raise SnapshotUnavailable(f"snapshot of step {snap.step} holds no state")
        layout = self.live_layout()
        try:
            state = self.disk.load(snap.step)
            self.check_restorable(state, layout)
        except Exception as exc:  # corrupt zip, bad checksum, missing file, other model
            raise SnapshotUnavailable(f"snapshot of step {snap.step}: {exc}") from exc
        return state

    @torch.no_grad()
    def restore(self, snap: Snapshot, *, restore_schedule: bool, restore_rng: bool = False,
                state: dict[str, Any] | None = None) -> Snapshot:
        """Copy the snapshot back into training (the snapshot itself is never aliased). Returns
        the snapshot actually restored (an older one if the disk copy was unreadable). All or
        nothing: everything is read and checked first; :class:`SnapshotUnavailable` means
        nothing was changed. ``state``: ``snap``'s state already read by :meth:`load_exact`."""
        if state is not None:
            st = state
        else:
            snap, st = self.load_state(snap)
        # copies into the existing parameters (sharded: each piece back into its DTensor or FSDP1 shard)
        load_model_state(self.model, st["model"])
        # one restore for every tier: optimizer state back, its current settings kept
        load_optimizer_keeping_settings(self.optimizer, rewrap_optimizer_state(st["optimizer"], self.optimizer),
                                        restore_schedule=restore_schedule)
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
        # snapshots taken after the restored point describe a discarded future (a rollback to an
        # older one than the newest: a quiet failure's drift, a run that never learned)
        for later in [s for s in self.ring + self.candidates if s.step > snap.step]:
            self._release(later)
        self.ring = [s for s in self.ring if s.step <= snap.step]
        self.candidates = [s for s in self.candidates if s.step <= snap.step]
        self.restored += 1
        return snap

    def close(self) -> None:
        """Forget every snapshot and remove this run's snapshot folder (its files are of no use
        once the run is over: they are not part of a checkpoint). Best effort, never raises."""
        self.clear()
        if self.disk is not None:
            try:
                for name in os.listdir(self.disk.directory):
                    if name.startswith("snapshot-") or name == OWNER_FILE:
                        os.remove(os.path.join(self.disk.directory, name))
                os.rmdir(self.disk.directory)
            except OSError:
                pass

    def stats(self) -> dict[str, Any]:
        return {"taken": self.taken, "restored": self.restored, "bytes": self.last_nbytes,
                "seconds_total": self.total_seconds, "ring": [s.step for s in self.ring],
                "candidates": [s.step for s in self.candidates],
                "disk": None if self.disk is None else self.disk.directory, "disk_writable": self.disk_writable}

    def state_dict(self) -> dict[str, Any]:
        """The rollback count only. Snapshots live in this process's memory and are not part of a
        checkpoint; so are their costs (``taken``, ``total_seconds``: see :meth:`stats`), which
        would make a resumed run's state differ from an uninterrupted one's (a resumed process
        snapshots its starting weights again, and timings never repeat)."""
        return {"restored": self.restored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .state import SNAPSHOT_FIELDS, SNAPSHOT_OPTIONAL, StateError, check_fields

        check_fields("snapshots", state, SNAPSHOT_FIELDS, SNAPSHOT_OPTIONAL)  # older states carry the costs too
        if state["restored"] < 0:
            raise StateError(f"gradguard state snapshots={state!r}: counters must be >= 0. "
                             "Fix: load a state saved by gradguard.Guard.state_dict()")
        self.restored = state["restored"]


def load_optimizer_keeping_settings(optimizer: torch.optim.Optimizer, state: dict[str, Any], *,
                                    restore_schedule: bool) -> None:
    """Load an optimizer state (moments, step counts) but keep the current settings of every param
    group: the policy's Adam moves, weight decay, and the schedule's ``lr``/``initial_lr`` unless
    ``restore_schedule``. The state is copied (the optimizer never aliases the given tensors)."""
    current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(copy_state(state, device=None))
    for g, kept in zip(optimizer.param_groups, current):
        if restore_schedule:
            kept = {k: v for k, v in kept.items() if k not in ("lr", "initial_lr")}
        g.update(kept)
