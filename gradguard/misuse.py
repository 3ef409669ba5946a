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

Lines of the old loop left in after switching to ``guard.step`` (:class:`LoopWatch`):

* ``optimizer.step()`` after ``guard.step`` (an optimizer step the guard did not make, seen by the
  optimizer's step hooks): warned at the first one. When the guard had skipped the step and no
  ``backward()`` ran since, the gradients are dropped first, so the stray step changes nothing (a
  step reported skipped never ends up applied).
* ``scheduler.step()`` left in (the scheduler moved between two ``guard.step`` calls, which step it
  themselves): warned once.
* ``guard.step`` called again without a new ``backward()`` (the same gradients, unchanged since the
  previous ``guard.step``: their tensors' version counters, a host-side read of a few parameters,
  no device sync): warned once.
* ``ReduceLROnPlateau`` as ``scheduler=``: warned at construction (the guard cannot step it: it needs
  the metric).
* ``guard.step`` after ``close()`` (or after a halt): :class:`GuardClosedError`.
* A loss that is not a tensor or a number (a list of losses): :class:`ConfigTypeError` naming the
  argument and the fix.

Each warning is also an event ``{"type": "misuse", "kind": ..., "message": ...}`` in the log.
"""

from __future__ import annotations

import inspect
import math
import numbers
import weakref
from collections import deque
from typing import Any

from .errors import ConfigTypeError, GradGuardError, warn
from .sinks import Sink

__all__ = ["needs_closure", "check_optimizer", "MisuseWatch", "LoopWatch", "GuardClosedError", "check_loss"]


class GuardClosedError(GradGuardError, RuntimeError):
    """``guard.step`` on a guard that was closed (``close()``, the end of its ``with`` block, or a
    halt): nothing is measured or applied."""


def check_loss(loss: Any, where: str = "guard.step(loss)") -> None:
    """A loss the guard can read: None, a number or a tensor (one value, or several it averages).
    Anything else (a list or dict of losses) is a :class:`ConfigTypeError` naming the argument."""
    if loss is None or isinstance(loss, numbers.Real):
        return
    import torch

    if isinstance(loss, torch.Tensor):
        return
    raise ConfigTypeError(
        f"gradguard: {where}: loss={type(loss).__name__} ({str(loss)[:60]}) is not a tensor or a number. Fix: pass "
        "the step's total loss as one tensor (e.g. guard.step(sum(losses)) or guard.step(torch.stack(losses).mean())), "
        "or call guard.observe_loss(l) for each part and then guard.step()")


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

    # -- the plain Guard's loop (LoopWatch): called from Guard.__init__ and Guard.step -----------------
    def attach(self, guard: Any) -> None:
        self.loop = LoopWatch(self)
        self.loop.attach(guard)

    def step_begin(self, guard: Any, loss: Any) -> None:
        self.loop.begin(guard, loss)

    def step_end(self, guard: Any, report: Any) -> None:
        self.loop.end(guard, report)

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


class _Unhook(Sink):
    """A sink that only takes the :class:`LoopWatch`'s optimizer hook off when the guard closes."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.watch.remove()


#: Parameters whose gradient tensors are compared between two ``guard.step`` calls.
_MARKED_PARAMS = 4


class LoopWatch:
    """Lines of the old loop left in next to ``guard.step`` (see the module docstring). Installed
    by ``Guard.__init__`` (:meth:`attach`), told where each ``guard.step`` begins and ends; its
    optimizer hooks stand aside once the guard is closed (and take themselves off)."""

    def __init__(self, misuse: MisuseWatch) -> None:
        self.misuse = misuse
        self._guard: Any = None
        self._handles: list[Any] = []
        self.in_step = False
        self.stray_steps = 0
        self.dropped_steps = 0
        self._last: Any = None  # the previous guard.step's report
        self._marks: list[tuple[Any, Any, int]] = []  # (param, weakref to its grad, the grad's version)
        self._sched_count: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_marks"] = []  # weak references to this process's gradient tensors
        return state

    # -- wiring ---------------------------------------------------------------------------------
    def attach(self, guard: Any) -> None:
        """After the guard is built: the optimizer's step hooks and the construction-time checks."""
        import torch

        self._guard = guard
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        if isinstance(guard.scheduler, plateau):
            message = ("gradguard: scheduler=ReduceLROnPlateau: the guard cannot step it (it needs your metric), so it "
                       "is left to you. Fix: keep calling scheduler.step(metric) yourself (e.g. after validation); "
                       "the guard's LR multiplier applies on top of it")
            warn(message, stacklevel=4)
            guard.core.emit({"type": "misuse", "step": 0, "kind": "plateau_scheduler", "message": message})
        opt = guard.core.optimizer
        if guard.core.stepping is not None or not hasattr(opt, "register_step_pre_hook"):
            return
        self._handles = [opt.register_step_pre_hook(self._pre_step)]
        guard.core.sinks.append(_Unhook(self))  # the hooks come off when the guard closes (with its sinks)

    def _live_guard(self) -> Any:
        guard = self._guard
        if guard is None or guard.core.closed:
            return None
        return guard

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- guard.step -----------------------------------------------------------------------------
    def begin(self, guard: Any, loss: Any) -> None:
        """The start of ``guard.step``: refuse a closed guard and a loss it cannot read; a scheduler
        stepped, or no backward run, since the previous ``guard.step``."""
        if guard.core.closed:
            why = "it halted" if getattr(guard, "halted", None) is not None else "close() was called"
            raise GuardClosedError(
                f"gradguard: guard.step() on a closed guard ({why}): nothing was measured or applied. Fix: stop "
                "the loop when the guard halts or is closed, or build a new Guard to keep training guarded")
        check_loss(loss)
        self.in_step = True
        if self._last is None:
            return
        step = guard.core.step_count + 1
        sched = guard.scheduler if getattr(guard, "_step_scheduler", False) else None
        count = getattr(sched, "_step_count", None)
        if self._sched_count is not None and isinstance(count, int) and count > self._sched_count:
            self.misuse._report(guard.core, "stray_scheduler_step", step,
                                f"gradguard: scheduler.step() was called {count - self._sched_count} time(s) between "
                                "two guard.step() calls, but guard.step() steps the scheduler itself (only after "
                                "an applied step): the LR schedule runs ahead. Fix: remove your scheduler.step() call")
        if self._unchanged():
            self.misuse._report(guard.core, "no_backward", step,
                                "gradguard: guard.step() was called again with no backward() since the previous "
                                "guard.step(): the same gradients are measured and applied a second time. Fix: call "
                                "guard.step(loss) once per optimizer step, after loss.backward()")

    def end(self, guard: Any, report: Any) -> None:
        """The end of ``guard.step`` (its optimizer and scheduler steps done)."""
        self.in_step = False
        self._last = report
        sched = guard.scheduler if getattr(guard, "_step_scheduler", False) else None
        count = getattr(sched, "_step_count", None)
        self._sched_count = count if isinstance(count, int) else None
        self._marks = []
        params = guard.core.layers.params  # a few spread-out parameters: O(1) per step, host-side reads only
        n = len(params)
        for i in sorted({0, n - 1, n // 2, n // 3})[:_MARKED_PARAMS] if n else ():
            g = params[i].grad
            if g is not None:
                self._marks.append((params[i], weakref.ref(g), g._version))

    def _unchanged(self) -> bool:
        """True when every marked parameter still holds the very gradient tensor of the previous
        ``guard.step``, unmodified (no backward since: it would have replaced or added to it)."""
        if not self._marks:
            return False
        for p, ref, version in self._marks:
            g = p.grad
            if g is None or ref() is not g or g._version != version:
                return False
        return True

    # -- the optimizer's own steps ----------------------------------------------------------------
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.in_step:
            return
        guard = self._live_guard()
        if guard is None or self._last is None:  # before the first guard.step: not the old loop's line
            return
        self.stray_steps += 1
        report = self._last
        step = report.step
        if self._unchanged():
            # the gradients guard.step() already applied (or skipped) are still there: dropped, so the
            # stray step changes nothing (a step reported skipped never ends up applied)
            from .act import drop_grads

            drop_grads(guard.core.layers.params)
            self._marks = []
            self.dropped_steps += 1
            what = "applied" if report.applied else "skipped"
            guard.core.emit({"type": "misuse", "step": step, "kind": "stray_step_dropped",
                        "message": f"optimizer.step() after guard.step() ({what} step {step}): gradients dropped"})
            self.misuse._report(guard.core, "stray_optimizer_step", step,
                                f"gradguard: optimizer.step() was called after guard.step(), which had {what} step "
                                f"{step} itself; its gradients were dropped first, so that call changed nothing. "
                                "Fix: remove your optimizer.step() (and scaler.step/scaler.update, clip_grad_norm_) "
                                "after guard.step(loss)")
            return
        self.misuse._report(guard.core, "stray_optimizer_step", step,
                            "gradguard: optimizer.step() was called outside guard.step() (after step "
                            f"{step}), but guard.step() makes the optimizer step itself: that update was applied "
                            "on top of the guard's (or of a step it skipped). Fix: remove your optimizer.step() "
                            "(and scaler.step/scaler.update, clip_grad_norm_) after guard.step(loss)")
