"""Rollback: the trust tiers and the way back to the last healthy state, in one object.

Two tiers hold earlier training states:

1. the in-memory snapshot ring (:class:`gradguard.snapshot.SnapshotRing`, spilled to
   ``recovery.disk_dir`` when set): a snapshot is *confirmed* after ``recovery.confirm_steps``
   healthy steps; one taken while the run was suspect never is;
2. the engine's own checkpoints (a :class:`gradguard.contract.CheckpointSource`), trusted by the
   same rule (:class:`gradguard.recovery.CheckpointTier`).

A rollback restores the newest confirmed state (all processes agree on which one), puts the LR
multiplier back on the restored optimizer, re-warms it, restarts the detectors' windows and skips
the next ``recovery.skip_batches`` batches of data. Until an update is applied the weights are
*verified*: a spike then is the data's fault, not the LR's, and the escalation that led to the
rollback is undone (:meth:`Rollback.undo_escalation`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from .act import ClipController, LRMultiplier
from .config import GuardConfig
from .contract import CheckpointSource, Collective, DataSkip
from .detect import Detectors
from .errors import warn
from .policy import Action
from .recovery import CheckpointTier, rollback_from_checkpoints
from .snapshot import SnapshotRing, SnapshotUnavailable

__all__ = ["Rollback"]


class Rollback:
    """The snapshot ring, the engine's checkpoint tier and the rollback actuator."""

    def __init__(self, config: GuardConfig, model: nn.Module, optimizer: Any, *, scheduler: Any, scaler: Any,
                 collective: Collective, detectors: Detectors, lr: LRMultiplier, clip: ClipController,
                 emit: Callable[[dict[str, Any]], None], extra_state: dict[str, Any] | None = None) -> None:
        self.config = config
        self.collective = collective
        self.detectors = detectors
        self.lr = lr
        self.clip = clip
        self.emit = emit
        rc = config.recovery
        self.snapshots: SnapshotRing | None = None
        if rc.snapshot_interval > 0 and config.policy.act:
            self.snapshots = SnapshotRing(model, optimizer, ring_size=rc.ring_size, confirm_steps=rc.confirm_steps,
                                          scheduler=scheduler, scaler=scaler, disk_dir=rc.disk_dir)
            self.snapshots.register("gradguard_detectors", detectors.state_dict, detectors.load_state_dict)
            for name, (get, put) in (extra_state or {}).items():
                self.snapshots.register(name, get, put)
            self.snapshots.on_event = emit  # I/O errors and invalidations become events
        self.checkpoint_tier = CheckpointTier(rc.confirm_steps)
        self.checkpoint_source: CheckpointSource | None = None
        self.data_skip: DataSkip | None = None
        #: no update applied since the weights were restored: a spike now is the data's fault
        self.verified = False
        self._undo: tuple[dict[str, Any], float] | None = None  # LR/clip before the last rollback rung
        #: the state a rollback left (when nothing bad had been applied to it), returned to if the
        #: restored weights show the data was to blame
        self._held: Any = None
        #: an ambiguous rollback restored weights and put the ones it left aside: a clean batch next
        #: takes training back to them on trial (:meth:`return_to_held`)
        self.trial_due = False
        #: core hook: no update that taught nothing was applied since the last step that taught
        self.weights_clean: Callable[[], bool] | None = None

    @property
    def available(self) -> bool:
        """Whether a rollback can be attempted at all (a ring, or the engine's checkpoints)."""
        return self.snapshots is not None or self.checkpoint_source is not None

    # -- the tiers ------------------------------------------------------------------------------
    def first_snapshot(self, step: int) -> None:
        """The initial (or resumed) weights, before any update: snapshotted once."""
        if self.snapshots is not None and not (self.snapshots.ring or self.snapshots.candidates):
            self.take(step)
            self.snapshots.pinned = step

    def initial_step(self) -> int | None:
        """The step of the initial weights' snapshot while it is held (pinned for the first
        ``recovery.snapshot_interval`` applied steps, or longer: ``applied(hold_initial=True)``) and
        restorable, else None."""
        ring = self.snapshots
        if ring is None or ring.pinned is None:
            return None
        return ring.pinned if any(s.step == ring.pinned for s in ring.usable()) else None

    def take(self, step: int) -> None:
        """Snapshot the training state now (as after update ``step``)."""
        assert self.snapshots is not None
        snap = self.snapshots.take(step)
        self.emit({"type": "snapshot", "step": step, "bytes": snap.nbytes, "seconds": snap.seconds})

    def observe(self, step: int, *, ring_healthy: bool, ckpt_healthy: bool, ckpt_bad: bool) -> None:
        """The step's verdict for both tiers (confirms older states after enough healthy steps)."""
        if self.snapshots is not None:
            self.snapshots.observe(step, ring_healthy)
        self.checkpoint_tier.observe(step, ckpt_healthy, ckpt_bad)
        self._tier_events(step)

    def _tier_events(self, step: int | None) -> None:
        """The checkpoint tier's news (a checkpoint not trusted after a resume, a fingerprint file that
        could not be written): a warning and an event each."""
        for ev in self.checkpoint_tier.take_events():
            message = ev.pop("message")
            warn(message, category=RuntimeWarning)
            self.emit({**ev, "step": step})

    def hold(self, a: Action) -> None:
        """Before a rollback for a spike: put the current state aside when every update in it
        taught the detectors (the spikes came on weights nothing bad was applied to). Not for a
        norm takeover (``not_after``: its weights were already drifting)."""
        self._held = None
        clean = self.weights_clean is not None and self.weights_clean()
        if self.snapshots is not None and clean and "not_after" not in a.params:
            self._held = self.snapshots.capture(a.step - 1)

    def return_to_held(self, step: int, trial: bool = False) -> Action | None:
        """A spike on restored, verified weights: the data was bad, so the weights the rollback left
        were not to blame either; training goes back to them (steps not lost), still verified.
        ``trial``: after an ambiguous rollback (:attr:`trial_due`) the restored weights met a clean
        batch, which says nothing of the weights left; training goes back to them unverified (the
        step is skipped): a spike on them next blames them, a clean batch clears them."""
        held, self._held = self._held, None
        self.trial_due = False
        if held is None or self.snapshots is None:
            return None
        try:
            self.snapshots.restore(held, restore_schedule=True, state=held.state)
        except SnapshotUnavailable:
            return None
        self.lr.reapply_after_restore()
        self.lr.warm_left = 0  # back at the weights that ran at this LR: no re-warm-up
        self.detectors.restart()
        self.verified = not trial
        if trial:
            return Action("undo_rollback", step, "a clean batch on the weights an ambiguous rollback restored: back "
                          f"to the weights of step {held.step} on trial (a spike on them next climbs the ladder)",
                          {"to_step": held.step, "trial": True})
        return Action("undo_rollback", step, "spike on restored, verified weights: the data was bad, so the "
                      f"weights of step {held.step} were not to blame", {"to_step": held.step})

    def applied(self, step: int, applied_steps: int, hold_initial: bool = False) -> None:
        """An update was applied: the weights are no longer verified; a snapshot every
        ``recovery.snapshot_interval`` applied steps, and every ``recovery.confirm_steps`` before the
        first interval (when that is less than half of it): a fault in the first steps then rolls back a few steps, to weights whose
        detectors have a baseline (a spike on them can be blamed on the data), not to the initial ones.
        ``hold_initial``: the initial weights stay held past the first interval (the core holds them
        through a warm-up and two takeover windows after it: see ``GuardCore._from_warmup``)."""
        self.verified = False
        self._undo = None
        self._held = None
        self.trial_due = False
        rc = self.config.recovery
        if self.snapshots is None:
            return
        dense = rc.confirm_steps if rc.snapshot_interval > 2 * rc.confirm_steps > 0 else rc.snapshot_interval
        due = applied_steps % rc.snapshot_interval == 0 or (applied_steps < rc.snapshot_interval
                                                            and applied_steps % dense == 0)
        if due:
            self.take(step)
        if applied_steps >= rc.snapshot_interval and self.snapshots.pinned is not None and not hold_initial:
            self.snapshots.unpin()  # past its first interval and the warm-up: the initial weights go

    def attach_checkpoints(self, source: CheckpointSource, sharded: bool) -> bool:
        """Use the engine's own checkpoints as the disk tier (not with sharded parameters: each
        process then rolls back to its own snapshots). True when attached."""
        if sharded:
            return False
        self.checkpoint_source = source
        self.checkpoint_tier.roots = functools.partial(getattr, source, "roots", None)
        return True

    def checkpoint_saved(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> None:
        self.checkpoint_tier.saved(step, list(paths))

    # -- the escalation that a data verdict undoes ----------------------------------------------
    def remember_escalation(self) -> None:
        """A rollback rung: if the restored weights then meet bad data, this escalation was the data's fault."""
        self._undo = (self.lr.state_dict(), self.clip.max_norm)

    def undo_escalation(self, step: int) -> Action | None:
        """A spike on restored, verified weights: the LR and clip go back to before the rollback rung."""
        if self._undo is None:
            return None
        lr_state, max_norm = self._undo
        self._undo = None
        self.lr.load_state_dict({**lr_state, "warm_left": self.lr.warm_left})
        self.clip.max_norm = max_norm
        return Action("revert_lr", step, "spike on restored, verified weights: the data was bad, not the LR",
                      {"lr_multiplier": self.lr.global_mult, "max_grad_norm": max_norm})

    # -- the actuator -----------------------------------------------------------------------------
    def __call__(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        """Roll back for action ``a``: returns its params and the follow-up actions (data skip).
        ``a.params["not_after"]``: restore no snapshot taken after that step (a quiet failure's
        weights were already drifting before it was found)."""
        out = self._restore(a)
        if "to_step" not in out:
            return out, []
        self.lr.reapply_after_restore()
        if not a.params.get("ambiguous"):  # an ambiguous rollback does not suspect the LR: no re-warm-up
            self.lr.rewarm()
        self.detectors.restart()  # the restored weights get fresh windows
        self.verified = True
        self.trial_due = bool(a.params.get("ambiguous")) and self._held is not None
        n_skip = self.config.recovery.skip_batches
        if not (n_skip and self.data_skip is not None):
            return out, []
        skip = Action("skip_data", a.step, f"after rollback to step {out['to_step']}", {"batches": n_skip})
        skip.params.update(self.data_skip(skip) or {})
        out["skipped_batches"] = n_skip
        return out, [skip]

    def _restore(self, a: Action) -> dict[str, Any]:
        snap = self._restore_snapshot(a)
        if snap is not None:
            return {"to_step": snap.step, "confirmed": snap.confirmed, "steps_lost": a.step - 1 - snap.step}
        out = None
        if self.checkpoint_source is not None:
            if self.checkpoint_tier.claimed:  # a rollback at the first step after a resume
                self.checkpoint_tier.verify_claimed(a.step - 1)
                self._tier_events(a.step)
            out = rollback_from_checkpoints(self.checkpoint_tier, self.checkpoint_source, self.collective, self.emit,
                                            a.step, detectors=self.detectors)
        if not out:
            problem = self._problem
            return {"unavailable": f"rollback unavailable ({problem}): step skipped instead" if problem
                    else "no healthy snapshot yet: step skipped instead"}
        out.setdefault("confirmed", True)
        out["steps_lost"] = a.step - 1 - int(out["to_step"])
        if self.snapshots is not None:  # untested candidates hold weights from after the restored state
            self.snapshots.drop_untested()
        return out

    def _restore_snapshot(self, a: Action) -> Any:
        """The newest confirmed snapshot restored (all or nothing), or None."""
        self._problem: str | None = None
        ring = self.snapshots
        not_after = a.params.get("not_after")
        usable = [] if ring is None else [s for s in ring.usable() if not_after is None or s.step <= not_after]
        if not usable or ring is None:
            return None
        snap = usable[0]
        wanted, agreed_state = snap.step, None
        if self.collective.world_size > 1:
            snap, agreed_state, self._problem = self._agreed_snapshot(ring, usable)
            if snap is None:
                self._fallback(a.step, wanted, None, [self._problem])
                return None
        try:  # all or nothing: files, model and optimizer layout are checked before any change
            rc = self.config.recovery
            snap = ring.restore(snap, restore_schedule=rc.restore_schedule, restore_rng=rc.restore_rng,
                                state=agreed_state)
        except SnapshotUnavailable as exc:
            self._problem = str(exc)
            self._fallback(a.step, wanted, None, [*ring.problems, self._problem])
            return None
        if snap.step != wanted or ring.problems:
            self._fallback(a.step, wanted, snap.step, list(ring.problems))
        return snap

    def _fallback(self, step: int, wanted: int, restored: int | None, problems: list[Any]) -> None:
        self.emit({"type": "snapshot_fallback", "step": step, "wanted": wanted, "restored": restored,
                   "problems": problems})
        if self.snapshots is not None:
            self.snapshots.problems.clear()

    def _agreed_snapshot(self, ring: SnapshotRing, usable: list[Any]) -> tuple[Any, dict[str, Any] | None, str | None]:
        """Several processes: the newest snapshot every process can read (one vote per snapshot
        tried, in the same order everywhere: the rings hold the same steps on every rank), so all
        ranks restore the same step even when one rank's file is damaged."""
        problems: list[str] = []
        for snap in usable:
            try:
                state: dict[str, Any] | None = ring.load_exact(snap)
            except SnapshotUnavailable as exc:
                state = None
                problems.append(str(exc))
            if self.collective.all_agree(state is not None):
                if snap is not usable[0]:
                    ring.problems.extend(problems or [f"snapshot of step {usable[0].step} unreadable "
                                                      "on another process"])
                return snap, state, None
            if state is not None:
                problems.append(f"snapshot of step {snap.step} unreadable on another process")
        return None, None, "; ".join(problems) or "no snapshot readable on every process"

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots.state_dict() if self.snapshots is not None else None,
                "checkpoints": self.checkpoint_tier.state_dict(), "verified": self.verified}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.verified = state["verified"]
        if self.snapshots is not None and state.get("snapshots"):
            self.snapshots.load_state_dict(state["snapshots"])
        if "checkpoints" in state:
            self.checkpoint_tier.load_state_dict(state["checkpoints"])

    def close(self) -> None:
        # the last checkpoints' files are complete now: their fingerprints are written for a later resume
        self.checkpoint_tier.fingerprint_saved()
        self._tier_events(None)
        if self.snapshots is not None:
            self.snapshots.close()  # this run's snapshot files are of no use after it
