"""The Lightning callback's entry in a checkpoint (``checkpoint["callbacks"][state_key]``): what it
holds, the entry of an older gradguard adopted under this guard's key, and a restored entry applied
once the guard's core exists (Lightning restores callback states before ``on_train_start``, when
the optimizers do not exist yet)."""

from __future__ import annotations

import copy
from typing import Any

from ..adapter import restore_guard_state, unusable_resume_state
from ..errors import StateError
from ..state import check_resume_step

__all__ = ["ADAPTER_STATE_VERSION", "adopt_unclaimed", "adapter_state", "keep_pending", "apply_pending"]

ADAPTER_STATE_VERSION = 1


def adopt_unclaimed(cb: Any, trainer: Any, checkpoint: dict[str, Any]) -> None:
    """No entry under this guard's key, but exactly one guard entry no other guard of this Trainer
    claims (a checkpoint of gradguard <= 0.1, keyed by a hash of the config, or a guard resumed in
    the other mode): adopt it."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict) or cb.state_key in states:
        return
    prefix = type(cb).__qualname__ + "{"
    claimed = {getattr(other, "state_key", None) for other in getattr(trainer, "callbacks", [])}
    free = [k for k in states if isinstance(k, str) and k.startswith(prefix) and k not in claimed]
    if len(free) == 1:
        states[cb.state_key] = states[free[0]]


def adapter_state(cb: Any) -> dict[str, Any]:
    """The entry: the core's state, the data window left to skip, the loader's micro-batch, the trust
    tier (a state restored but not applied yet is written back as it came)."""
    pending = cb._pending_state or {}
    core = cb.core
    core_state = core.state_dict() if core is not None else pending.get("core")
    batches = cb.batches.state_dict() if cb.batches is not None else pending.get("batches")
    checkpoints = core.checkpoint_tier.state_dict() if core is not None else pending.get("checkpoints")
    return {"version": ADAPTER_STATE_VERSION, "core": core_state, "skip_left": cb._skip_left,
            "data_skipped_steps": cb.data_skipped_steps, "batches": batches, "checkpoints": checkpoints}


def keep_pending(cb: Any, state_dict: dict[str, Any]) -> None:
    """Keep a restored entry until the core exists (applied at once when it does)."""
    cb._pending_state = copy.deepcopy(state_dict)
    if cb.core is not None:
        apply_pending(cb)


def apply_pending(cb: Any, engine_step: int | None = None) -> bool:
    """Apply the state restored from the checkpoint (True when a guard state was applied). One that
    cannot be used: ``StateError`` when acting (the core torn down), a warning and a fresh guard in
    monitor mode. ``engine_step``: the Trainer's global step resumed at; a guard state saved at
    another step (another checkpoint's) cannot be used either."""
    st, cb._pending_state = cb._pending_state, None
    if not st or cb.core is None:
        return False
    try:
        if engine_step is not None and st.get("core") is not None:
            try:
                check_resume_step(st["core"], engine_step, "the checkpoint's GradGuardCallback entry")
            except StateError as exc:
                unusable_resume_state(cb.config, exc)  # raises when the policy acts
                return False
        usable = restore_guard_state(cb.core, cb.config, st.get("core"), legacy_checkpoints=st.get("checkpoints"))
    except StateError:
        cb._teardown_core()
        raise
    if not usable:
        return False
    cb._skip_left = int(st.get("skip_left", 0))
    cb.data_skipped_steps = int(st.get("data_skipped_steps", 0))
    if st.get("batches") and cb.batches is not None:
        cb.batches.load_state_dict(st["batches"])
        # the LR's linear scaling follows the batch the run resumes with
        cb.core.lr.batch_scale = cb.batches.batch_size / cb.batches.base_batch_size
    return st.get("core") is not None
