"""The plain-PyTorch engine: ``report = guard.step(loss)`` after ``backward()`` replaces
``clip_grad_norm_`` + ``optimizer.step()`` (+ ``scaler.step/update``) + ``scheduler.step()``.

:class:`Guard` composes a :class:`gradguard.core.GuardCore` (``guard.core``), where all behaviour
lives. For a DeepSpeed engine use :class:`gradguard.deepspeed.DeepSpeedGuard`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._compat import ddp_wrapper, fsdp1_units, is_deepspeed_engine
from .act import unwrap_optimizer
from .adapter import refuse_setup
from .config import GuardConfig
from .core import GuardCore, StepReport, finish_halt
from .errors import ConfigError, GradGuardHalt, UnsupportedSetupError, is_rank0
from .measure import EngineClip
from .misuse import MisuseWatch, check_optimizer
from .oom import SKIPPED, EveryRank, OomRecovery, PieceFailed
from .policy import Action
from .sinks import Sink

__all__ = ["GradGuardHalt", "StepReport", "GuardCore", "Guard", "LoopGuard"]


class LoopGuard:
    """What every guard that drives its own loop (:class:`Guard`, the DeepSpeed one) shares: the
    core it composes (``core``), the optional batch controller (``batches``), the state of both,
    ``close`` and the context manager."""

    core: GuardCore
    batches: Any

    @property
    def log_path(self) -> str | None:
        """The JSONL event log of this run (None when ``output.jsonl`` is off)."""
        return self.core.log_path

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Record one micro-batch loss (unscaled); the step's loss is their mean."""
        self.core.observe_loss(loss)

    def _skip_data(self, a: Action) -> dict[str, Any]:
        assert self.batches is not None
        preceding = [list(b) for b in self.batches.recent]
        skipped = self.batches.skip(int(a.params.get("batches", 0)))
        return {"skipped_indices": skipped, "preceding_indices": preceding}

    def close(self) -> dict[str, Any]:
        """Write the summary, close the sinks and take the LR hooks off the optimizer (idempotent)."""
        return self.core.close()

    def state_dict(self) -> dict[str, Any]:
        """The guard's whole state (the core's, and the batch controller's)."""
        state = self.core.state_dict()
        if self.batches is not None:
            state["batches"] = self.batches.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate, then apply a state from :meth:`state_dict` (nothing changes on a ``StateError``)."""
        if self.batches is not None and isinstance(state, dict) and hasattr(self.batches, "check_state") \
                and "batches" in state:
            self.batches.check_state(state["batches"])  # before anything is applied
        self.core.load_state_dict(state)
        if self.batches is not None and "batches" in state:
            self.batches.load_state_dict(state["batches"])

    def __enter__(self) -> LoopGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Guard(LoopGuard):
    """gradguard for a hand-written PyTorch loop.

    ``report = guard.step(loss)`` after ``backward()`` replaces gradient clipping,
    ``optimizer.step()``, ``scaler.step/update`` and ``scheduler.step()``. Rules:

    * Gradient accumulation: call ``guard.step`` only on the accumulation boundary, passing the
      mean micro-batch loss, or call ``guard.observe_loss(l)`` per micro-batch and ``guard.step()``.
    * Pass the *unscaled* loss; with a GradScaler the guard unscales the gradients itself.
    * A skipped step does not advance the scheduler (nor Adam's step count); the scheduler is
      stepped only after an applied optimizer step. ``ReduceLROnPlateau`` is left to the caller.
    * On a halt the step is not applied, ``diagnosis.json`` is written next to the event log and
      ``GradGuardHalt`` is raised (``output.halt_raises=False``: ``report.halt`` is True and
      ``guard.halted`` holds the diagnosis; stop the loop yourself).

    The public surface is :meth:`step`, :meth:`accumulate`, :meth:`observe_loss`,
    :meth:`state_dict`, :meth:`load_state_dict` and :meth:`close`, plus ``config``, ``log_path``,
    ``halted`` and ``core`` (the :class:`gradguard.core.GuardCore`, for inspection).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 out_dir: str | None = None, layer_fn: Callable[[str], str] | None = None,
                 batches: Any = None) -> None:
        if is_deepspeed_engine(model):
            raise UnsupportedSetupError(
                "gradguard: model=DeepSpeedEngine: a DeepSpeed engine steps the optimizer itself. Fix: "
                "gradguard.deepspeed.DeepSpeedGuard(engine), and call guard.step(loss) in place of engine.step()")
        if type(optimizer).__module__.startswith("deepspeed") or is_deepspeed_engine(getattr(model, "module", None)):
            raise UnsupportedSetupError(
                f"gradguard: optimizer={type(optimizer).__name__}: a DeepSpeed optimizer is stepped by its engine. "
                "Fix: pass the engine deepspeed.initialize returned, gradguard.deepspeed.DeepSpeedGuard(engine), "
                "and call guard.step(loss) in place of engine.step()")
        check_optimizer(unwrap_optimizer(optimizer))  # closure optimizers (LBFGS) are refused
        refuse_setup(model)  # sharded layouts gradguard cannot measure (FSDP1 flat parameters of an unknown layout)
        self._misuse = MisuseWatch()
        config = GuardConfig.coerce(config)
        if not is_rank0():  # several processes: one event log and one console per run, as in every engine
            config = dataclasses.replace(config, output=dataclasses.replace(config.output, jsonl=False, console=False))
        self.core = core = GuardCore(model, optimizer, config=config, sinks=sinks, out_dir=out_dir,
                                     layer_fn=layer_fn, scheduler=scheduler, scaler=scaler)
        self.config = core.config
        self.model = model
        self.user_optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        self._step_scheduler = scheduler is not None and not isinstance(scheduler, plateau)
        self.batches = batches
        self.halted: dict[str, Any] | None = None
        self._clip_params: list[nn.Parameter] | None = None  # monitor with a fixed clip: see _users_clip
        # ... under sharded FSDP1, clipped by the measured global norm (see step)
        self._fsdp1 = core.measurer.sharding is not None and bool(fsdp1_units(model))
        self.oom = OomRecovery(core, lambda: list(model.parameters()), self._shrink_micro_to, monitor_too=True)
        if batches is not None:
            # after a rollback the data position keeps moving forward: the controller is not rewound
            core.attach_data_skip(self._skip_data)
            core.attach_batches(batches)
        self._misuse.attach(self)

    # -- batch controller actuators ----------------------------------------------------------
    def accumulate(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor]) -> float:
        """Forward and backward over one step's samples (a ``StepBatch`` from the batch controller)
        in micro-batches, each loss weighted by its share of the step. On an out-of-memory error the
        partial gradients are dropped, the micro-batch is halved (the global batch is kept through
        more accumulation) and the same samples are tried again. Returns the step's mean loss;
        follow with ``guard.step()``."""
        if self.batches is None:
            raise ConfigError("gradguard: Guard.accumulate needs a batch controller. Fix: "
                             "Guard(..., batches=gradguard.data.BatchController(dataset, batch_size))")
        total = len(batch)
        ctl = self.batches

        def run(micro: int) -> torch.Tensor | None:
            return self._forward_backward(batch, micro, total, loss_fn)

        # several DDP processes: the core's every-rank rule (gradguard.oom.EveryRank): the step's
        # backwards without DDP's sync, a rank that runs out of memory retries alone, one vote, the
        # gradients averaged by the guard
        core = self.core
        ddp = ddp_wrapper(self.model) if core.collective.world_size > 1 else None
        ranks = EveryRank(self.oom, ddp, core.collective) if ddp is not None else None
        micro, message = ctl.micro_batch_size, ""
        samples = min(micro, total)

        def attempt(parts: int) -> torch.Tensor | None:
            try:
                return run(-(-micro // parts))
            except torch.OutOfMemoryError:
                raise PieceFailed(True) from None

        if ranks is not None:
            ranks.open_step()
        try:
            try:
                acc = run(micro)
            except torch.OutOfMemoryError as exc:
                if ranks is None and not self.oom.can_recover(samples, core.collective.world_size):
                    raise
                message = f"{type(exc).__name__}: {exc}"[:160]
                acc = None
            # the core's rule (gradguard.oom): the whole step is run again (nothing earlier to keep),
            # its micro-batches split into pieces until they fit; the controller's micro-batch follows
            if message and ranks is not None:
                acc = ranks.retry(attempt, samples=samples, message=message, touched=True)
                acc = None if acc is SKIPPED else acc
            elif message:
                acc = self.oom.recover(attempt, samples=samples, message=message, touched=True, earlier_grads=False)
            if ranks is not None:
                ranks.close_step([p for p in self.model.parameters() if p.requires_grad], samples)
        finally:
            if ranks is not None:
                ranks.release()
        core.take_loss(None)
        if acc is not None:
            core.observe_loss(acc)
        return float("nan") if acc is None else float(acc)

    def _forward_backward(self, batch: Any, micro: int, total: int,
                          loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor | None:
        """Forward and backward over ``batch`` in micro-batches of ``micro``, each loss weighted by
        its share of the step; returns the weighted loss sum."""
        acc: torch.Tensor | None = None
        for mb, n in batch.micro_batches(micro):
            loss = loss_fn(mb)
            weighted = loss * (n / total)
            (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            acc = weighted.detach() if acc is None else acc + weighted.detach()
            del loss, weighted
        return acc

    def _users_clip(self) -> EngineClip | None:
        """A guard that does not act (monitor) but has ``clip.mode="fixed"`` applies that fixed clip
        the way ``clip_grad_norm_(model.parameters(), clip.max_norm)`` does, bit-identically, from
        the step's one norm pass (instead of the user's own ``clip_grad_norm_``: a second pass)."""
        clip = self.config.clip
        if self.config.policy.act or clip.mode != "fixed":
            return None
        if self._clip_params is None:
            self._clip_params = list(self.model.parameters())
        return EngineClip(self._clip_params, float(clip.max_norm))

    def _shrink_micro_to(self, fits: int) -> tuple[int, int] | None:
        ctl = self.batches
        start = ctl.micro_batch_size
        while ctl.micro_batch_size > fits and ctl.shrink_micro() is not None:
            pass
        return (start, ctl.micro_batch_size) if ctl.micro_batch_size < start else None

    def step(self, loss: torch.Tensor | float | None = None) -> StepReport:
        """One optimizer step after ``backward()``: measure, decide, clip, step (or skip), schedule."""
        core = self.core
        self._misuse.step_begin(self, loss)
        opt = self.user_optimizer
        if self.scaler is not None and not self._misuse.already_unscaled(core, self.scaler, opt):
            self.scaler.unscale_(opt)
        self._misuse.before(core, loss)
        own_clip = self._users_clip()
        report = core.before_step(loss, scaler=self.scaler, engine_clip=own_clip)
        self._misuse.after(core, report)
        if self.scaler is None:
            self._misuse.scaler_not_passed(core, report)
        if report.applied and own_clip is not None and core.replay_engine_clip(report) is None:
            if self._fsdp1:
                # FSDP1: clip_grad_norm_ would see this rank's shards only (each rank its own
                # coefficient: the replicas drift apart); torch's clip with the global norm just
                # measured, as FSDP1's own model.clip_grad_norm_ does
                report.engine_norm = report.total_norm
                torch.nn.utils.clip_grads_with_norm_(core.layers.unique_params(), own_clip.max_norm,
                                                     torch.tensor(report.total_norm))
            else:
                report.engine_norm = float(torch.nn.utils.clip_grad_norm_(own_clip.params, own_clip.max_norm))
        if report.applied:
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
        if self.scaler is not None:  # also after a skip: it resets the scaler's per-step state
            self.scaler.update(new_scale=core.scale_to_keep(report))
        if report.applied and self._step_scheduler:
            self.scheduler.step()
        self._misuse.step_end(self, report)
        return self._finish(report)

    def _finish(self, report: StepReport) -> StepReport:
        """AFTER_OPTIMIZER_STEP of the plain loop: counters, metrics; a halt closes the guard and
        raises :class:`GradGuardHalt` (``output.halt_raises=False``: a warning)."""
        self.core.after_step(report)
        if report.halt:
            self.halted = report.diagnosis or {}
            finish_halt(self.core, self.halted)
        return report
