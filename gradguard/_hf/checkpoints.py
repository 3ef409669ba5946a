"""The Trainer's ``checkpoint-*`` folders as a :class:`gradguard.contract.CheckpointSource`."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .._io import atomic_write
from ..errors import StateError
from ..recovery import check_weights, restore_training_state, safe_load

__all__ = ["TrainerCheckpoints", "STATE_FILE", "read_weights", "find_resume_state", "read_state_file",
           "write_state_file"]

#: Name of the guard's state file inside each ``checkpoint-*`` folder.
STATE_FILE = "gradguard_state.json"


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The model weights of a Trainer checkpoint folder (safetensors or .bin, sharded or not);
    ``.bin`` files are read with ``weights_only=True`` only."""
    for name, kind in (("model.safetensors", "st"), ("pytorch_model.bin", "bin")):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return _read_one(f, kind)
    for index, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
        f = os.path.join(path, index)
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for shard in files:
                out.update(_read_one(os.path.join(path, shard), kind))
            return out
    raise FileNotFoundError("no model.safetensors / pytorch_model.bin (adapter-only checkpoints are not restorable)")


def _read_one(f: str, kind: str) -> dict[str, torch.Tensor]:
    if kind == "st":
        from safetensors.torch import load_file

        return load_file(f, device="cpu")
    return safe_load(f)


class TrainerCheckpoints:
    """Reads a ``checkpoint-<step>`` folder (weights, ``optimizer.pt``, ``scaler.pt``,
    ``scheduler.pt``, the guard's ``gradguard_state.json``) and puts it back into training."""

    def __init__(self, output_dir: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 scaler: Any = None, scheduler: Any = None, restore_schedule: bool = False) -> None:
        self.output_dir = output_dir
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.restore_schedule = restore_schedule

    @property
    def roots(self) -> list[str]:
        """The run's checkpoint folder: only checkpoints inside it are rolled back to."""
        return [self.output_dir]

    def saved_paths(self, step: int) -> list[str]:
        return [os.path.join(self.output_dir, f"checkpoint-{step}")]

    def read(self, path: str, step: int) -> dict[str, Any]:
        path = path or self.saved_paths(step)[0]
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: folder is gone")
        weights = read_weights(path)
        check_weights(weights, self.model.state_dict(), exact=False)  # tied weights may be absent
        out: dict[str, Any] = {"model": weights, "scaler": None, "scheduler": None, "guard": None,
                               "optimizer": safe_load(os.path.join(path, "optimizer.pt"))}
        if self.scaler is not None and os.path.isfile(os.path.join(path, "scaler.pt")):
            out["scaler"] = safe_load(os.path.join(path, "scaler.pt"))
        if self.restore_schedule and self.scheduler is not None and os.path.isfile(os.path.join(path, "scheduler.pt")):
            out["scheduler"] = safe_load(os.path.join(path, "scheduler.pt"))
        if os.path.isfile(os.path.join(path, STATE_FILE)):
            try:
                saved = read_state_file(os.path.join(path, STATE_FILE))
            except StateError:
                saved = {}  # the weights are still good: only the detectors' baselines are not put back
            guard = saved.get("guard")
            out["guard"] = guard if isinstance(guard, dict) else None
        return out

    def restore(self, payload: dict[str, Any]) -> None:
        restore_training_state(self.model, self.optimizer, payload, restore_schedule=self.restore_schedule,
                               scheduler=self.scheduler, scaler=self.scaler)


def write_state_file(folder: str, state: dict[str, Any]) -> str:
    """Write the guard's state into a checkpoint folder atomically (never a half-written file)."""
    final = os.path.join(folder, STATE_FILE)
    return atomic_write(final, json.dumps(state))  # a fresh temp file, never through a symlink


def read_state_file(path: str) -> dict[str, Any]:
    """The guard state of a ``gradguard_state.json``; a file that is not the JSON object gradguard
    wrote (truncated by a killed writer, overwritten) is a :class:`StateError` naming it and the fix."""
    fix = (f"Fix: delete {path} to resume with a fresh guard state (its LR and clip adjustments and "
           "its detectors' baselines start over), or put back an intact copy")
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except json.JSONDecodeError as exc:
        raise StateError(f"gradguard state file {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno}: truncated or overwritten). {fix}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise StateError(f"gradguard state file {path} cannot be read ({type(exc).__name__}: {exc}). {fix}") from exc
    if not isinstance(state, dict):
        raise StateError(f"gradguard state file {path} holds a {type(state).__name__}, not the object gradguard "
                         f"writes. {fix}")
    return state


def find_resume_state(restored: Any, args: Any, state: Any, name: str) -> dict[str, Any] | None:
    """The guard state of a resumed run: the one the Trainer restored into the callback
    (``ExportableState``), else the ``stateful_callbacks`` entry of ``trainer_state.json``, else the
    ``gradguard_state.json`` of the checkpoint resumed from. Raises :class:`StateError` (naming where
    it came from) for a state that is not a dict or a file that does not read."""
    where = f"checkpoint-{state.global_step}/trainer_state.json stateful_callbacks[{name!r}]"
    saved = restored
    if saved is None:
        entry = (getattr(state, "stateful_callbacks", None) or {}).get(name)
        if isinstance(entry, list):
            entry = entry[0] if entry else None
        if isinstance(entry, dict):
            saved = (entry.get("attributes") or {}).get("_resume_state")
    if saved is None:
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
        return read_state_file(path) if os.path.isfile(path) else None
    if not isinstance(saved, dict):
        raise StateError(f"gradguard state {where}={str(saved)[:80]!r}: not the object gradguard writes. Fix: remove "
                         "that entry to resume with a fresh guard state")
    return saved
