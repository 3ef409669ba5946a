"""Out-of-memory recovery, written once for every engine.

An engine adapter catches ``torch.OutOfMemoryError`` from a micro-batch's forward or backward and
hands the rest to :class:`OomRecovery`:

* the failed micro-batch's samples are run again in 2, 4, 8 ... pieces until they fit, each
  piece's loss weighted by its share of the micro-batch, so the step's gradient equals the
  unsplit one up to float rounding (the adapter supplies ``attempt(parts)``, which runs the pieces
  the engine's way);
* gradients the failed attempt may have added are dropped first. That is exact when no earlier
  micro-batch of the same optimizer step holds gradients; otherwise the step's gradients cannot be
  separated, so they are all dropped and the step is skipped (``oom_skip_step``), never applied
  half-accumulated;
* afterwards the engine's micro-batch is made at most the size that fitted (the adapter's
  ``shrink_to``: the loader's micro-batch halves with more accumulation, or each micro-batch runs as
  more chunks), so the next batches do not fail again (``oom_shrink_micro``; ``oom_retry`` when the
  size was already small enough and only these samples were split);
* a single sample that does not fit is raised, as without gradguard. The adapters retry only when
  the policy acts and on one process (ranks must stay in lockstep).

Each recovered error is one action, with the same parameters in every engine: ``samples`` (the
failed micro-batch), ``pieces``, ``in`` (forward/backward), ``micro_batch`` ([old, new]) and
``step_skipped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .act import drop_grads
from .adapter import free_memory
from .policy import Action

__all__ = ["OomRecovery", "PieceFailed", "SKIPPED"]

T = TypeVar("T")

#: What :meth:`OomRecovery.recover` returns when the step had to be skipped.
SKIPPED: Any = object()


class PieceFailed(Exception):
    """Raised by an adapter's ``attempt`` when a piece ran out of memory again. ``touched``: the
    attempt may have added gradients (a backward ran, or failed half-way)."""

    def __init__(self, touched: bool) -> None:
        super().__init__(touched)
        self.touched = touched


class OomRecovery:
    """The out-of-memory rule of one run (see the module docstring).

    ``core``: the :class:`gradguard.guard.GuardCore` (its policy must act; actions are recorded on
    it). ``params``: the trainable parameters, whose gradients are dropped. ``shrink_to(fits)``:
    make the engine's micro-batch at most ``fits`` samples from now on; returns ``(old, new)``, or
    None when nothing changed (already small enough, or the engine cannot resize).
    ``monitor_too``: also recover in monitor mode (the plain loop's ``Guard.accumulate``, which the
    user calls to run the step's micro-batches: its retry is exact and changes no result; an
    engine's wrappers are not installed in monitor mode)."""

    def __init__(self, core: Any, params: Callable[[], list[torch.nn.Parameter]],
                 shrink_to: Callable[[int], tuple[int, int] | None], monitor_too: bool = False) -> None:
        self.core = core
        self.params = params
        self.shrink_to = shrink_to
        self.monitor_too = monitor_too
        self.events = 0

    def can_recover(self, samples: int, world_size: int = 1) -> bool:
        """Whether an error in a micro-batch of ``samples`` is handled (else the adapter re-raises)."""
        if self.core is None or not (self.monitor_too or self.core.config.policy.act):
            return False
        return world_size <= 1 and samples > 1

    def recover(self, attempt: Callable[[int], T], *, samples: int, message: str, touched: bool,
                earlier_grads: bool, where: str = "forward") -> T:
        """Run the failed micro-batch of ``samples`` again through ``attempt(parts)`` (which raises
        :class:`PieceFailed` when a piece fails too). ``touched``: the failed attempt may have added
        gradients; ``earlier_grads``: earlier micro-batches of this optimizer step hold gradients.
        Returns ``attempt``'s result, or :data:`SKIPPED` when the step's gradients were dropped
        (the adapter then skips the step). Raises ``torch.OutOfMemoryError`` when even single
        samples do not fit."""
        self.events += 1
        parts = 1
        while True:
            if touched:
                drop_grads(self.params())
                if earlier_grads:
                    return self._skip(samples, message, where)
            free_memory()  # outside any except block: the failed attempt's tensors can go
            parts *= 2
            if parts > samples:
                raise torch.OutOfMemoryError(message)
            try:
                result = attempt(parts)
                break
            except PieceFailed as failed:
                touched = touched or failed.touched
        fits = -(-samples // parts)
        moved = self.shrink_to(fits)
        params = {"samples": samples, "pieces": parts, "in": where, "step_skipped": False,
                  "micro_batch": list(moved) if moved else [samples, samples]}
        self._record("oom_shrink_micro" if moved else "oom_retry",
                     f"out of memory in {where} ({message}): the same {samples} samples ran again in {parts} "
                     "pieces" + (f"; the micro-batch is {moved[1]} from now on" if moved else ""), params)
        return result

    def _skip(self, samples: int, message: str, where: str) -> Any:
        moved = self.shrink_to(max(1, samples // 2))
        params = {"samples": samples, "pieces": 0, "in": where, "step_skipped": True,
                  "micro_batch": list(moved) if moved else [samples, samples]}
        self._record("oom_skip_step", f"out of memory in {where} ({message}) after earlier micro-batches of the "
                     "step had added gradients: they cannot be separated, so the step's gradients are dropped "
                     "and the step is skipped", params)
        return SKIPPED

    def _record(self, name: str, reason: str, params: dict[str, Any]) -> None:
        self.core.record(Action(name, self.core.step_count + 1, reason, params))
