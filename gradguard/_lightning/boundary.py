"""The optimizer-step boundary of the Lightning callback: the loss of each micro-batch, the guard's
decision before the optimizer step (``core.before_step``, or a step dropped: a data window skipped
after a rollback, a step an out-of-memory error broke), and what follows the step
(``core.after_step``, the logged row, the fp16 scale, the clip for the next step)."""

from __future__ import annotations

from typing import Any

import torch

from .._compat import pl_should_update_logs, scaler_scale
from ..act import unwrap_optimizer
from ..adapter import SchedulerHold
from ..policy import Action
from .clip import hand_clip_to_lightning

__all__ = ["watch_optimizer_step", "batch_start", "observe_loss", "before_optimizer_step", "after_optimizer_step",
           "engine_logs", "skip_data"]


def watch_optimizer_step(cb: Any, opt: Any) -> list[Any]:
    """Hooks telling whether ``on_before_optimizer_step`` fires inside ``optimizer.step()`` (Lightning
    runs the closure there without a GradScaler); registered after the core's LR-multiplier hooks."""

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        cb._in_opt_step = True

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        cb._in_opt_step = False

    return [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]


def batch_start(cb: Any, trainer: Any, pl_module: Any, batch_idx: int) -> None:
    """A batch opening an optimizer step of a skipped data window counts down the window."""
    acc = int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1
    if batch_idx % acc == 0:
        cb.steps.open_step()  # recovery.oom_all_ranks under DDP: this step's backwards sync nothing
    if cb._skip_left > 0 and batch_idx % acc == 0:  # a window counts optimizer steps
        cb._skip_left -= 1
        cb._window_step = True


def observe_loss(cb: Any, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
    """The micro-batch's loss for the core: Lightning's division by ``accumulate_grad_batches`` and
    the loss scale undone, without a host sync."""
    if cb.core is None or cb._window_step or cb._poisoned or not trainer.training:
        return
    value = loss.detach()
    if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
        value = value * trainer.accumulate_grad_batches
    scale = scaler_scale(cb.scaler)
    if scale is not None:
        value = value.float() / scale.to(value.device)  # no host sync
    cb.core.observe_loss(value)


def before_optimizer_step(cb: Any, trainer: Any, pl_module: Any, optimizer: Any) -> None:
    """Gradients accumulated, DDP-synced, unscaled, not yet clipped: the guard decides; a skipped
    step has its gradients dropped and the ``interval="step"`` schedulers held for that step."""
    core = cb.core
    if core is None or unwrap_optimizer(optimizer) is not core.optimizer:
        return
    cb.steps.restore_stash()
    cb._stepped = True
    cb.steps.close_step()  # recovery.oom_all_ranks under DDP: one vote, then the gradients averaged
    # without a GradScaler Lightning calls the closure (and so this hook) inside optimizer.step()
    with core.deciding_inside_step(cb._in_opt_step):
        if cb._window_step or cb._poisoned:
            # a step of the data window skipped after a rollback, or one an out-of-memory error broke
            core.discard_loss()
            core.drop_grads()
            if cb._window_step:
                cb.data_skipped_steps += 1
            core.discard_step()  # the guard's step count follows Lightning's global_step
            skip = True
            cb._report = None
        else:
            engine = cb.clip_takeover.engine_clip(trainer, optimizer)
            report = core.before_step(scaler=cb.scaler, drop_on_skip=True, engine_clip=engine)
            cb.clip_takeover.measured(core, engine, report)
            cb._report = cb.last_report = report
            cb.reports += 1
            if report.halt:
                cb._halt.trip(report.diagnosis)
                trainer.should_stop = True
            skip = report.skipped
        if skip and pl_module.automatic_optimization:
            cb._held = SchedulerHold([c.scheduler for c in trainer.lr_scheduler_configs
                                      if c.interval == "step" and not c.reduce_on_plateau])
            cb._held.hold()  # Lightning steps the schedulers after every optimizer step, skipped or not
        if cb._manage_clip:
            trainer.gradient_clip_val = None  # clipped by the core already: no second pass


def after_optimizer_step(cb: Any, trainer: Any, pl_module: Any) -> None:
    """The end of a batch that closed an optimizer step of the guarded optimizer: ``core.after_step``,
    its row sent to the loggers at Lightning's cadence, the fp16 scale the core wants kept put back."""
    cb._stepped = False
    cb.steps.restore_stash()
    cb._held.release()
    core = cb.core
    report, cb._report = cb._report, None
    if report is not None:
        core.after_step(report, engine_logs=engine_logs(cb, trainer))
        row, core.pending_row = core.pending_row, None
        if row:  # Lightning's cadence, at its step for this batch: straight into each logger (not
            # through self.log, which would add gradguard's keys to the user's logged/callback metrics)
            core.send_live(report.step, row)
        core.keep_scale(report, cb.scaler)  # the GradScaler updated inside the optimizer step
    cb._window_step = False
    cb._poisoned = False
    hand_clip_to_lightning(cb, trainer)


def engine_logs(cb: Any, trainer: Any) -> bool | None:
    """Whether Lightning logs this batch's step metrics (None: the loggers are not used)."""
    if not (cb.log_to_loggers and trainer.loggers):
        return None
    return pl_should_update_logs(trainer)


def skip_data(cb: Any, action: Action) -> dict[str, Any]:
    """The core's data-skip action: the next ``batches`` optimizer steps' data is not trained on."""
    n = int(action.params.get("batches", 0))
    cb._skip_left += n
    trainer = cb._trainer
    automatic = trainer is not None and trainer.lightning_module.automatic_optimization
    if automatic and cb.steps._wrapped:
        mode = ("the next optimizer steps' batches are drawn but not computed (training_step returns None)"
                if trainer.world_size == 1 else
                "the next optimizer steps' batches are drawn but not computed (a zero loss keeps DDP in step)")
    else:
        mode = "the next optimizer steps' batches run but their gradients are dropped"
    return {"mode": mode, "optimizer_steps": n}
