"""Misuse of the plain-loop :class:`~gradguard.Guard`, detected once, early, with a clear message.

* A closure optimizer (``torch.optim.LBFGS``: ``step(closure)`` re-evaluates the model several
  times per step) is refused at attach: the guard measures one set of gradients per step and
  cannot see or skip the closure's inner evaluations.
* ``guard.step()`` without a loss (none passed, none observed): the loss detector is blind, no
  snapshot is ever confirmed, so rollback is impossible. Warned at the first such step.
* Gradients all zero or absent for ``zero_grad_steps`` steps in a row (``backward()`` forgotten,
  or gradients zeroed before ``guard.step``): warned once.
* The user's own ``clip_grad_norm_`` before ``guard.step`` while the guard clips too (it then
  measures clipped norms and its spike detection goes blind): seen as the same round total norm
  (``max_norm``) in 3 of the last 20 steps, which unclipped gradients never do; warned once. Not
  with ``clip.mode='off'`` or the monitor preset, where clipping is left to the user.
* A ``GradScaler`` scaling the loss but not passed to the guard (``scaler=``): the guard would
  measure, clip and apply gradients ``scale`` times too large. When one of the first 20 steps has
  a non-finite or huge (> 1e3) total norm and the guard has no scaler, the process's objects are
  searched once for a GradScaler that has scaled a loss; warned once.
* ``scaler.unscale_(optimizer)`` called by the user before ``guard.step`` (the guard unscales
  itself; a second ``unscale_`` is a RuntimeError in torch): the guard uses the gradients as
  they are and warns once.

Each warning is also an event ``{"type": "misuse", "kind": ..., "message": ...}`` in the log.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from typing import Any

from .errors import warn

__all__ = ["needs_closure", "check_optimizer", "MisuseWatch"]


def needs_closure(optimizer: Any) -> bool:
    """True when ``optimizer.step`` requires a closure argument (LBFGS and the like)."""
    try:
        params = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    closure = params.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


_CLOSURE_WHY = ("needs a closure (step(closure) evaluates the model several times per step), which gradguard "
                "cannot measure or skip")
_CLOSURE_FIX = "Fix: use a first-order optimizer (SGD, Adam, AdamW...) with gradguard, or train without the guard"


def closure_refusal(optimizer: Any) -> dict[str, str]:
    """``{"optimizer=<name>": why + fix}`` for a closure optimizer, for the engines' refusal lists."""
    if not needs_closure(optimizer):
        return {}
    return {f"optimizer={type(optimizer).__name__}": f"it {_CLOSURE_WHY}. {_CLOSURE_FIX}"}


def check_optimizer(optimizer: Any) -> None:
    """Refuse optimizers the plain ``Guard`` cannot drive (raises ``AttachError``)."""
    from .act import AttachError

    if needs_closure(optimizer):
        raise AttachError(f"gradguard: optimizer={type(optimizer).__name__} {_CLOSURE_WHY}. {_CLOSURE_FIX}")


class MisuseWatch:
    """Per-step checks of how ``Guard.step`` is called; each problem is reported once."""

    def __init__(self, zero_grad_steps: int = 3) -> None:
        self.zero_grad_steps = zero_grad_steps
        self.reported: set[str] = set()
        self._zero_streak = 0
        self._loss_seen = False
        self._norms: deque[float] = deque(maxlen=20)
        self._scaler_looked = False
        self.scaler_steps = 20  # the first steps are checked for a GradScaler not passed to the guard
        self.huge_norm = 1e3  # a total norm this large (or non-finite) prompts the look

    def _report(self, core: Any, kind: str, step: int, message: str) -> None:
        if kind in self.reported:
            return
        self.reported.add(kind)
        warn(message, stacklevel=3)  # rank 0 only; a GradGuardWarning (a UserWarning)
        core.emit({"type": "misuse", "step": step, "kind": kind, "message": message})

    def before(self, core: Any, loss: Any) -> None:
        """Call before the step is measured, with the ``loss`` given to ``guard.step``."""
        if loss is not None or core._loss_n:
            self._loss_seen = True
        elif not self._loss_seen:
            self._report(core, "no_loss", core.step_count + 1,
                         "gradguard: guard.step() was called without a loss, so loss spikes cannot be detected and no "
                         "snapshot is ever confirmed (rollback is impossible). Fix: pass the step's loss, "
                         "guard.step(loss), or call guard.observe_loss(loss) per micro-batch")

    def already_unscaled(self, core: Any, scaler: Any, optimizer: Any) -> bool:
        """True (and warned once) when the user already called ``scaler.unscale_(optimizer)``."""
        from ._compat import scaler_unscaled

        if not scaler_unscaled(scaler, optimizer):
            return False
        self._report(core, "user_unscale", core.step_count + 1,
                     "gradguard: scaler.unscale_(optimizer) was called before guard.step(); the guard unscales "
                     "(and clips) itself. Fix: remove your scaler.unscale_ and clip_grad_norm_ calls and pass "
                     "scaler= to the Guard")
        return True

    def scaler_not_passed(self, core: Any, report: Any) -> None:
        """A GradScaler scaled the loss but was not given to the guard: the guard measures, clips and
        applies gradients that are ``scale`` times too large. Looked for (one walk over the
        process's objects) only when one of the first steps has a non-finite or huge total norm."""
        norm = report.total_norm
        if self._scaler_looked or report.step > self.scaler_steps or (math.isfinite(norm) and norm < self.huge_norm):
            return
        self._scaler_looked = True
        from ._compat import scaler_scale, scalers_in_use

        found = scalers_in_use()
        if not found:
            return
        scale = float(scaler_scale(found[0]))  # once per run: a host read is fine here
        self._report(core, "scaler_not_passed", report.step,
                     f"gradguard: a torch.amp.GradScaler (scale {scale:g}) scaled the loss but was not passed to the "
                     f"Guard, so the guard measured, clipped and applied scaled gradients (total norm {norm:.3g} at "
                     "step " f"{report.step}). Fix: Guard(model, optimizer, scaler=scaler), keep "
                     "scaler.scale(loss).backward() and let guard.step(loss) replace scaler.step/update")

    def after(self, core: Any, report: Any) -> None:
        """Call with the step's report."""
        if report.total_norm == 0.0 and core.layers.params:  # (nothing trainable yet: a frozen start)
            self._zero_streak += 1
            if self._zero_streak >= self.zero_grad_steps:
                self._report(core, "no_gradients", report.step,
                             f"gradguard: the gradients were all zero or absent for {self._zero_streak} steps in a row, "
                             "so nothing is trained. Fix: call loss.backward() before guard.step(loss), and call "
                             "optimizer.zero_grad() after it, not between backward() and guard.step()")
        else:
            self._zero_streak = 0
        norm = report.total_norm
        clip = core.config.clip.mode
        # the guard clips when it acts (any mode but off) and, in monitor mode, with a fixed clip it replays
        owns_clip = clip != "off" and (core.config.policy.act or clip == "fixed")
        if owns_clip and math.isfinite(norm) and norm > 0:
            self._norms.append(norm)
            clip_at = _round_value(norm)
            if clip_at is not None and sum(abs(v - clip_at) <= 1e-4 * clip_at for v in self._norms) >= 3:
                self._report(core, "user_clip", report.step,
                             f"gradguard: the total grad norm was exactly {clip_at:g} in 3 of the last "
                             f"{len(self._norms)} steps: the gradients look clipped before guard.step(), which "
                             "hides spikes from the guard. Fix: remove your clip_grad_norm_ call and set "
                             f"GuardConfig clip={{'max_norm': {clip_at:g}}} (the guard clips after measuring)")


def _round_value(x: float) -> float | None:
    """``x`` when it is within 1e-4 of a number with at most 3 significant digits (a max_norm a
    user would type: 1.0, 0.5, 0.25, 5.0), else None."""
    exp = math.floor(math.log10(x)) - 2
    rounded = round(x / 10 ** exp) * 10 ** exp
    return rounded if abs(rounded - x) <= 1e-4 * rounded else None
