"""The guard's state in the Trainer's checkpoints: what is exported (``trainer_state.json`` entry and
``gradguard_state.json``), and what a resumed run puts back."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..adapter import restore_guard_state, unusable_resume_state
from ..config import GuardConfig
from ..errors import StateError, warn
from ..guard import GuardCore
from ..state import check_resume_step
from .checkpoints import find_resume_state, write_state_file
from .loader import TrainerLoader
from .steps import StepRunner

__all__ = ["checkpoint_dir", "export_state", "saving_step", "ensure_state_entry", "resume", "saved"]


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def export_state(core: GuardCore | None, runner: StepRunner | None, batches: TrainerLoader | None,
                 output_dir: str | None, saving: int | None = None) -> dict[str, Any]:
    """The state saved with a checkpoint; with ``saving`` (the step of the checkpoint being written)
    the guard state lists that checkpoint in its rollback tier."""
    if core is None:
        return {}
    guard = (core.state_dict() if saving is None
             else core.checkpoint_state(saving, [checkpoint_dir(str(output_dir), saving)]))
    return {"guard": guard, **(runner.state_dict() if runner is not None else {}),
            **(batches.state_dict() if batches is not None else {"batch_size": None, "base_batch_size": None})}


def saving_step(tstate: Any, control: Any) -> int | None:
    """The step of the checkpoint the Trainer is writing now, else None. The Trainer serialises
    its callbacks' ``state()`` into ``trainer_state.json`` before it calls ``on_save``."""
    if tstate is None or control is None or not control.should_save:
        return None
    return int(tstate.global_step)


def ensure_state_entry(state: Any, name: str, export: Callable[[], dict[str, Any]]) -> None:
    """A callback added when resuming has no entry in the checkpoint's ``stateful_callbacks``;
    the Trainer's next save looks its name up there and fails (``KeyError``). Add the entry
    (``export()``: the callback's ``state()``)."""
    entries = getattr(state, "stateful_callbacks", None)
    if isinstance(entries, dict) and name not in entries:
        entries[name] = export()


def resume(core: GuardCore, runner: StepRunner | None, batches: TrainerLoader | None, config: GuardConfig,
           restored: dict[str, Any] | None, args: Any, state: Any, name: str) -> None:
    """Put back the guard state of the checkpoint resumed from (see ``find_resume_state``). One that
    cannot be used: ``StateError`` when acting (nothing changed yet), a warning in monitor mode."""
    try:
        found = find_resume_state(restored, args, state, name)
    except StateError as exc:
        unusable_resume_state(config, exc)  # raises when the policy acts
        found = None
    guard = found.get("guard") if found else None
    if guard:
        try:  # a guard state of another checkpoint (checkpoint-10's state with checkpoint-5): not applied
            check_resume_step(guard, state.global_step, f"the guard state of checkpoint-{state.global_step}")
        except StateError as exc:
            unusable_resume_state(config, exc)  # raises when the policy acts; monitor mode: a fresh guard
            found = guard = None
    if not found or not guard or not restore_guard_state(core, config, guard):
        core.start_at(state.global_step)
        core.emit({"type": "resume", "step": state.global_step, "restored": False})
        return
    if runner is not None:  # None under DeepSpeed (no step runner: the engine steps itself)
        runner.load_state_dict(found)
    if batches is not None:
        batches.load_state_dict(found)
        if batches.resizable:  # the LR's linear scaling follows the batch the run resumes with
            core.lr.batch_scale = batches.batch_size / batches.base_batch_size
    core.emit({"type": "resume", "step": state.global_step, "restored": True, "guard_step": core.step_count})


def saved(core: GuardCore, args: Any, step: int, export: Callable[[], dict[str, Any]],
          diagnosis: dict[str, Any] | None) -> None:
    """``on_save``: the checkpoint joins the rollback tier (on every process); the main process writes
    ``gradguard_state.json`` (and ``diagnosis.json`` after a halt) into the folder."""
    ckpt = checkpoint_dir(args.output_dir, step)
    core.checkpoint_saved(step, [ckpt])
    if not getattr(args, "should_save", True):
        return
    if os.path.isdir(ckpt):
        try:
            write_state_file(ckpt, export())  # after checkpoint_saved: the tier lists it
        except OSError as exc:  # gradguard's own file: never what stops training
            warn(f"gradguard: could not write the guard state into {ckpt} ({exc}); training continues (a resume "
                 "from this checkpoint starts with a fresh guard state)", category=RuntimeWarning)
        if diagnosis is not None:
            core.write_diagnosis(diagnosis, ckpt)
