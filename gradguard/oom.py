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

from ._compat import ddp_broadcast_buffers_at_next_forward
from .act import drop_grads
from .adapter import free_memory
from .policy import Action

__all__ = ["OomRecovery", "PieceFailed", "SKIPPED", "EveryRank", "average_gradients"]

T = TypeVar("T")

#: What :meth:`OomRecovery.recover` returns when the step had to be skipped.
SKIPPED: Any = object()


class PieceFailed(Exception):
    """Raised by an adapter's ``attempt`` when a piece ran out of memory again. ``touched``: the
    attempt may have added gradients (a backward ran, or failed half-way)."""

    def __init__(self, touched: bool) -> None:
        super().__init__(touched)
        self.touched = touched


class _ModelParams:
    """``core.model``'s parameters, as a picklable callable."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __call__(self) -> list[torch.nn.Parameter]:
        return list(self.core.model.parameters())


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

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``pickle`` / ``copy.deepcopy`` of a guard): a ``params`` that is a local
        function (the plain Guard's ``lambda: list(model.parameters())``) is stored as the model's
        parameters read from the core's model, rebuilt the same way on load."""
        state = dict(self.__dict__)
        if getattr(state["params"], "__qualname__", "").endswith("<lambda>"):
            state["params"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.params is None:
            self.params = _ModelParams(self.core)

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
        result, parts = self.split(attempt, samples=samples, message=message, touched=touched,
                                   keep_earlier=earlier_grads)
        if result is SKIPPED:
            self._skip(samples, where, f"out of memory in {where} ({message}) after earlier micro-batches of the "
                       "step had added gradients: they cannot be separated, so the step's gradients are dropped "
                       "and the step is skipped")
            return SKIPPED
        fits = -(-samples // parts)
        moved = self.shrink_to(fits)
        params = {"samples": samples, "pieces": parts, "in": where, "step_skipped": False,
                  "micro_batch": list(moved) if moved else [samples, samples]}
        self._record("oom_shrink_micro" if moved else "oom_retry",
                     f"out of memory in {where} ({message}): the same {samples} samples ran again in {parts} "
                     "pieces" + (f"; the micro-batch is {moved[1]} from now on" if moved else ""), params)
        return result

    def split(self, attempt: Callable[[int], T], *, samples: int, message: str, touched: bool,
              keep_earlier: bool = False) -> tuple[T, int]:
        """The retry loop alone: ``attempt(parts)`` with 2, 4, 8 ... parts until it fits, the
        gradients a failed attempt may have added dropped first. Returns ``(result, parts)``, or
        ``(SKIPPED, 0)`` with every gradient dropped when ``keep_earlier`` (earlier micro-batches'
        gradients are in) and an attempt touched them; raises ``torch.OutOfMemoryError`` when even
        single samples do not fit."""
        parts = 1
        while True:
            if touched:
                drop_grads(self.params())
                if keep_earlier:
                    return SKIPPED, 0
            free_memory()  # outside any except block: the failed attempt's tensors can go
            parts *= 2
            if parts > samples:
                raise torch.OutOfMemoryError(message)
            try:
                return attempt(parts), parts
            except PieceFailed as failed:
                touched = touched or failed.touched

    def agree(self, collective: Any, *, samples: int, parts: int, failed: bool, skipped: bool = False,
              where: str = "forward", params: list[torch.nn.Parameter] | None = None) -> tuple[list[bool], bool]:
        """Several processes under DDP (:class:`EveryRank`: ``Guard.accumulate``; HF and Lightning
        with ``recovery.oom_all_ranks``): what every rank's step did with an out-of-memory error, agreed
        in one reduction, and the same response on every rank.

        Each rank gives its own outcome: ``samples`` (its micro-batch), ``parts`` (1: no error; else
        the pieces its samples fitted in), ``failed`` (even one sample did not fit) and ``skipped``
        (its step's gradients had to be dropped: the error hit after earlier micro-batches had added
        theirs). The reduction also
        carries which of ``params`` hold a gradient on each rank. Then, on every rank alike: if a
        rank failed, gradients are dropped everywhere and ``torch.OutOfMemoryError`` is raised on
        every rank (no rank is left waiting in a collective); if a rank skipped, every rank drops
        its gradients and skips the step (one ``oom_skip_step``); else, if a rank ran out of memory,
        every rank's micro-batch shrinks to the smallest piece that fitted on a rank, with one
        identical action (``ranks``: the ranks that ran out of memory). Returns ``(held,
        skip)``: per parameter, whether a gradient is held on any rank, and whether the step is
        skipped on every rank."""
        world = int(collective.world_size)
        pieces, failed_ranks, skipped_ranks, sizes, has_grad = _vote(collective, world, samples=samples, parts=parts,
                                                                     failed=failed, skipped=skipped, params=params or [])
        params = params or []
        if failed_ranks:
            drop_grads(self.params())
            raise torch.OutOfMemoryError(
                f"gradguard: out of memory on rank(s) {failed_ranks} of {world} with a single sample of the step "
                "(nothing left to split); every rank stops here so that none waits in a collective. Fix: a "
                "smaller model or sequence, activation checkpointing, or more memory")
        oom_ranks = [r for r in range(world) if pieces[r] > 1 or r in skipped_ranks]
        if not oom_ranks:
            return has_grad, False
        self.events += 1
        samples = max(sizes[r] for r in oom_ranks)  # the failed micro-batch (the same size on every rank, usually)
        if skipped_ranks:
            drop_grads(self.params())
            self._skip(samples, where, f"out of memory on rank(s) {skipped_ranks} of {world} after earlier "
                       "micro-batches of the step had added gradients: they cannot be separated, so every rank "
                       "drops the step's gradients and skips it", ranks=oom_ranks)
            return [False] * len(params), True
        most = max(pieces)
        fits = min(-(-sizes[r] // pieces[r]) for r in oom_ranks)
        moved = self.shrink_to(fits)
        self._record("oom_shrink_micro" if moved else "oom_retry",
                     f"out of memory on rank(s) {oom_ranks} of {world}: their samples ran again in up to {most} "
                     "pieces; every rank " + (f"runs micro-batches of {moved[1]} from now on" if moved
                                              else "keeps its micro-batch"),
                     {"samples": samples, "pieces": most, "in": where, "step_skipped": False,
                      "micro_batch": list(moved) if moved else [samples, samples], "ranks": oom_ranks})
        return has_grad, False

    def _skip(self, samples: int, where: str, reason: str, **extra: Any) -> None:
        """The step's gradients could not be kept: the micro-batch halves and ``oom_skip_step`` is recorded."""
        moved = self.shrink_to(max(1, samples // 2))
        self._record("oom_skip_step", reason, {"samples": samples, "pieces": 0, "in": where, "step_skipped": True,
                                               "micro_batch": list(moved) if moved else [samples, samples], **extra})

    def _record(self, name: str, reason: str, params: dict[str, Any]) -> None:
        self.core.record(Action(name, self.core.step_count + 1, reason, params))


def _vote(collective: Any, world: int, *, samples: int, parts: int, failed: bool, skipped: bool,
          params: list[torch.nn.Parameter]) -> tuple[list[int], list[int], list[int], list[int], list[bool]]:
    """One reduction of every rank's outcome: (pieces, failed ranks, skipped ranks, sizes, has_grad)."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    device = params[0].device if params else torch.device("cpu")
    k = 4
    packed = torch.zeros(k * world + len(params), dtype=torch.float64, device=device)
    packed[k * rank] = float(parts if parts > 1 else 0)
    packed[k * rank + 1] = 1.0 if failed else 0.0
    packed[k * rank + 2] = 1.0 if skipped else 0.0
    packed[k * rank + 3] = float(samples)
    if params:
        packed[k * world:] = torch.tensor([p.grad is not None for p in params], dtype=torch.float64, device=device)
    got = (collective.mean(packed) * world).tolist()  # the one host read of the vote
    return ([round(got[k * r]) for r in range(world)], [r for r in range(world) if got[k * r + 1] > 0.5],
            [r for r in range(world) if got[k * r + 2] > 0.5], [round(got[k * r + 3]) for r in range(world)],
            [v > 0.5 / world for v in got[k * world:]])


def average_gradients(collective: Any, params: list[torch.nn.Parameter], has_grad: list[bool],
                      bucket_elements: int = 1 << 24) -> None:
    """Average the gradients of ``params`` over the processes, as DDP's reducer does, in buckets
    of at most ``bucket_elements`` per device and dtype (one reduction each). A parameter with a
    gradient on some rank only counts zeros on the others; one with none anywhere stays None."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for p, held in zip(params, has_grad):
        if not held:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    for group in groups.values():
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in group:  # in order; a bucket never grows past bucket_elements (unless one tensor does)
            if buckets[-1] and size + p.numel() > bucket_elements:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel()
        for bucket in buckets:
            flat = collective.mean(torch.cat([q.grad.reshape(-1) for q in bucket]))
            for q, piece in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(piece.view_as(q.grad))


class EveryRank:
    """An out-of-memory error on one DDP rank, handled on every rank alike (the plain loop's
    ``Guard.accumulate``; the HF and Lightning adapters with ``recovery.oom_all_ranks``). Written once
    for every engine; the adapter calls :meth:`open_step` before the step's first forward,
    :meth:`retry` where it catches the error, and :meth:`close_step` once the step's gradients are
    in, before the guard measures them.

    * :meth:`open_step`: DDP syncs no gradient in this step's backwards (``require_backward_grad_sync``
      off, what ``no_sync()`` does; the engine's own ``no_sync`` for earlier micro-batches keeps it
      off), so a rank can run its samples again alone with no other rank waiting for it inside a
      gradient all-reduce; DDP's first forward of the step still broadcasts rank 0's buffers.
    * :meth:`retry`: the core's retry loop (:meth:`OomRecovery.split`) on this rank only; its outcome
      is kept for the vote, nothing is recorded or resized yet.
    * :meth:`close_step`: one reduction (:meth:`OomRecovery.agree`) gives every rank the same action,
      micro-batch shrink, skip or error, then the gradients are averaged over the ranks as DDP's
      reducer would (:func:`average_gradients`). The price: that all-reduce no longer overlaps the
      last backward.
    """

    def __init__(self, oom: OomRecovery, ddp: Any, collective: Any) -> None:
        self.oom = oom
        self.ddp = ddp
        self.collective = collective
        self._outcome: tuple[int, bool, bool, int, str] | None = None  # (parts, failed, skipped, samples, in)

    def open_step(self) -> None:
        self.ddp.require_backward_grad_sync = False
        ddp_broadcast_buffers_at_next_forward(self.ddp, True)
        self._outcome = None

    def retry(self, attempt: Callable[[int], T], *, samples: int, message: str, touched: bool,
              keep_earlier: bool = False, where: str = "forward") -> Any:
        """This rank's retry of a failed micro-batch of ``samples``: ``attempt``'s result, or
        :data:`SKIPPED` when this rank's step cannot be kept (its gradients could not be separated,
        or even one sample did not fit); the vote in :meth:`close_step` makes every rank respond."""
        # the failed forward already broadcast the buffers (DDP does it before the module runs)
        ddp_broadcast_buffers_at_next_forward(self.ddp, False)
        try:
            out, parts = self.oom.split(attempt, samples=samples, message=message, touched=touched,
                                        keep_earlier=keep_earlier)
        except torch.OutOfMemoryError:
            drop_grads(self.oom.params())
            out, parts = SKIPPED, -1
        prev = self._outcome[0] if self._outcome else 1
        self._outcome = (max(prev, parts), parts < 0, parts == 0, samples, where)
        return out

    def close_step(self, params: list[torch.nn.Parameter], samples: int) -> bool:
        """The vote and the gradient average. ``samples``: this rank's micro-batch (used when it had
        no error). Returns True when every rank skips the step (its gradients are dropped); raises
        ``torch.OutOfMemoryError`` on every rank when a sample fitted on none."""
        parts, failed, skipped, size, where = self._outcome or (1, False, False, samples, "forward")
        self._outcome = None
        held, skip = self.oom.agree(self.collective, samples=size, parts=parts, failed=failed, skipped=skipped,
                                    where=where, params=params)
        if not skip:
            average_gradients(self.collective, params, held)
        return skip

    def release(self) -> None:
        """DDP syncs its gradients itself again (after the step, or the run)."""
        self.ddp.require_backward_grad_sync = True
