"""Training-state snapshots for rollback: a ring in host memory (optionally mirrored to disk).

A snapshot of the weights after update k is a *candidate* until the loss at step k+1 (its direct
test) comes back healthy; it becomes *confirmed* after ``confirm_steps`` healthy steps. Rollback
restores the newest confirmed snapshot, else the newest tested candidate; never an untested one.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Snapshot", "SnapshotRing", "copy_state", "state_nbytes"]


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
                 confirm_steps: int, scheduler: Any = None, scaler: Any = None) -> None:
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

    def register(self, name: str, get_state: Any, set_state: Any) -> None:
        self.extra[name] = (get_state, set_state)

    def take(self, step: int) -> Snapshot:
        t0 = time.perf_counter()
        dev = "cpu"
        state: dict[str, Any] = {
            "model": copy_state(self.model.state_dict(), dev, pin=True),
            "optimizer": copy_state(self.optimizer.state_dict(), dev, pin=True),
            "rng": _rng_state(),
        }
        if self.scheduler is not None:
            state["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None:
            state["scaler"] = copy.deepcopy(self.scaler.state_dict())
        for name, (get, _) in self.extra.items():
            state[name] = copy.deepcopy(get())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        nbytes = state_nbytes(state)
        snap = Snapshot(step=step, state=state, nbytes=nbytes, seconds=time.perf_counter() - t0)
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
        self.candidates = keep
        while len(self.ring) > self.ring_size:
            self.ring.pop(0)
        return confirmed

    def best(self) -> Snapshot | None:
        if self.ring:
            return self.ring[-1]
        tested = [s for s in self.candidates if s.tested]
        return tested[-1] if tested else None

    @torch.no_grad()
    def restore(self, snap: Snapshot, *, restore_schedule: bool, restore_rng: bool = False) -> None:
        """Copy the snapshot back into training (the snapshot itself is never aliased)."""
        st = snap.state
        self.model.load_state_dict(st["model"])  # copies into the existing parameters
        keep_hparams = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        # Optimizer.load_state_dict keeps tensors it is given when device and dtype match: clone.
        self.optimizer.load_state_dict(copy_state(st["optimizer"], device=None))
        for g, hp in zip(self.optimizer.param_groups, keep_hparams):
            for k in ("betas", "eps"):
                if k in hp:
                    g[k] = hp[k]  # policy changes to Adam survive a rollback
            if not restore_schedule:
                for k in ("lr", "initial_lr"):
                    if k in hp:
                        g[k] = hp[k]
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

    def stats(self) -> dict[str, Any]:
        return {"taken": self.taken, "restored": self.restored, "bytes": self.last_nbytes,
                "seconds_total": self.total_seconds, "ring": [s.step for s in self.ring],
                "candidates": [s.step for s in self.candidates]}

    def state_dict(self) -> dict[str, Any]:
        """Counters only: snapshots live in memory and are not part of a checkpoint."""
        return {"taken": self.taken, "restored": self.restored, "total_seconds": self.total_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken, self.restored, self.total_seconds = state["taken"], state["restored"], state["total_seconds"]
