"""The step's decision in the Trainer: ``core.before_step`` once the gradients are accumulated and
unscaled, taken inside the Trainer's own norm pass (``_clip_grad_norm``) when that pass can be taken
over, else in ``on_pre_optimizer_step``."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._compat import HF_NORM_METHOD, hf_norm_pass_plain, shadow_method, unshadow_method
from ..act import drop_grads
from ..adapter import SchedulerHold
from ..guard import GuardCore, StepReport
from ..measure import EngineClip
from .steps import StepRunner

__all__ = ["StepDecision", "loss_blind_warning"]


def loss_blind_warning(core: GuardCore, runner: StepRunner) -> None:
    """A step computed without a loss in the model's output (the Trainer computed it from the logits:
    ``label_smoothing_factor > 0``, ``compute_loss_func``, an overridden ``compute_loss``): the loss
    detector is blind, and no snapshot is ever confirmed. Warned once, naming the cause and the fix
    (``GradGuardCallback.observe_loss``), also as a ``misuse`` event."""
    from ..errors import warn

    trainer = getattr(runner, "trainer", None)
    args = getattr(runner, "args", None) or getattr(trainer, "args", None)
    causes = []
    smoothing = getattr(args, "label_smoothing_factor", 0) or 0
    if smoothing > 0:
        causes.append(f"TrainingArguments.label_smoothing_factor={smoothing!r} (the Trainer takes the labels out and "
                      "computes the smoothed loss from the logits)")
    if getattr(trainer, "compute_loss_func", None) is not None:
        causes.append("Trainer(compute_loss_func=...) computes the loss")
    try:
        from transformers import Trainer

        if trainer is not None and type(trainer).compute_loss is not Trainer.compute_loss:
            causes.append(f"{type(trainer).__name__}.compute_loss is overridden")
    except ImportError:  # pragma: no cover - the callback needs transformers
        pass
    why = "; ".join(causes) or "the model's forward output holds no loss (outputs.loss / output['loss'])"
    message = (f"gradguard: the step's loss is not visible to the guard ({why}), so loss spikes cannot be detected "
               "and no snapshot is ever confirmed (rollback is impossible). Fix: have the model return its loss "
               "(outputs.loss), or feed it: call callback.observe_loss(loss) in your compute_loss for every "
               "micro-batch (the GradGuardCallback instance)")
    warn(message, stacklevel=2)
    core.emit({"type": "misuse", "step": core.step_count + 1, "kind": "loss_not_visible", "message": message})


class StepDecision:
    """One run's step decisions. ``replay_clip``: the Trainer's own ``max_grad_norm`` clip, re-applied
    from the same norms when the guard does not clip (monitor mode). ``held``: the LR scheduler
    whose next ``step()`` a skipped step swallows."""

    def __init__(self, core: GuardCore, runner: StepRunner, *, scaler: Any, replay_clip: float | None,
                 held: SchedulerHold) -> None:
        self.core = core
        self.runner = runner
        self.scaler = scaler
        self.replay_clip = replay_clip
        self.held = held
        self.report: StepReport | None = None  # this step's, until on_step_end takes it
        self.decided = False  # this step's decision was taken in the Trainer's norm pass
        self.norm_plain: bool | None = None  # the Trainer's norm pass can be taken over (first step)
        self._shadow: tuple[Any, Any, Any] | None = None  # (trainer, wrapper, previous)
        self.loss_blind_warned = False

    def pre_step(self) -> StepReport | None:
        """The step's decision (gradients accumulated and unscaled): ``core.before_step``, the
        Trainer's own clip replayed when the guard does not clip. None for a step whose data was
        skipped."""
        core, runner = self.core, self.runner
        loss = runner.take_step_loss()
        runner.micro_in_step = 0
        if runner.close_step():  # recovery.oom_all_ranks under DDP: every rank skips this step
            runner.poisoned = True
        if runner.discard_left > 0 or runner.poisoned:
            # a data window skipped after a rollback, or a step broken by an out-of-memory error
            if runner.poisoned:
                runner.poisoned = False
            else:
                runner.discard_left -= 1
            drop_grads(runner.params)
            self.held.hold()
            core.discard_step()
            return None
        if loss is None and not self.loss_blind_warned:
            self.loss_blind_warned = True
            loss_blind_warning(core, runner)
        replay = self.replay_clip
        engine = EngineClip(runner.params, replay) if replay is not None else None
        report = core.before_step(loss=loss, scaler=self.scaler, drop_on_skip=True, engine_clip=engine)
        if report.applied and replay is not None and core.replay_engine_clip(report) is None:
            report.engine_norm = float(torch.nn.utils.clip_grad_norm_(runner.params, replay))
        if report.skipped:
            self.held.hold()
        return report

    def decide(self) -> StepReport | None:
        """``on_pre_optimizer_step``: the decision the norm pass took, else take it now."""
        if self.decided:
            self.decided = False
            return self.report
        self.report = self.pre_step()
        return self.report

    def finish(self, *, engine_logs: bool) -> StepReport | None:
        """``on_step_end``: the held scheduler is released (only the skipped step's ``step()`` is
        swallowed), and the step's report, if any, goes through ``core.after_step``."""
        self.held.release()
        report, self.report = self.report, None
        if report is None:
            return None
        self.core.keep_scale(report, self.scaler)  # the Trainer's scaler.update() may have halved it once more
        if report.applied and report.loss is not None and math.isfinite(report.loss):
            self.runner.last_step_loss = report.loss
        self.core.after_step(report, engine_logs=engine_logs)
        return report

    # -- the Trainer's norm pass ------------------------------------------------------------------
    def take_over(self, trainer: Any) -> None:
        """Shadow the Trainer's ``_clip_grad_norm`` for the run (put back by :meth:`release`)."""
        if not hasattr(trainer, HF_NORM_METHOD):
            return
        orig = getattr(trainer, HF_NORM_METHOD)

        def norm_pass(model: Any) -> Any:
            return self.engine_norm_pass(orig, model)

        self._shadow = (trainer, norm_pass, shadow_method(trainer, HF_NORM_METHOD, norm_pass))

    def release(self) -> None:
        """End of the run: the norm pass and the LR scheduler are the Trainer's again."""
        self.held.release()
        if self._shadow is not None:
            unshadow_method(self._shadow[0], HF_NORM_METHOD, self._shadow[1], self._shadow[2])
            self._shadow = None

    def engine_norm_pass(self, orig: Any, model: Any) -> Any:
        """The Trainer's ``_clip_grad_norm``, taken over: unscale (fp16), then the step's one pass over
        the gradients in ``core.before_step`` (the guard's clip, or the Trainer's replayed bit for bit);
        returns the total norm for the Trainer's ``grad_norm`` log."""
        trainer = self.runner.trainer
        if self.norm_plain is None and trainer is not None:
            self.norm_plain = hf_norm_pass_plain(trainer, model)
        if trainer is None or self.decided or not self.norm_plain:
            return orig(model)
        trainer.accelerator.unscale_gradients()
        report = self.report = self.pre_step()
        self.decided = True
        if report is None:
            return None  # no gradients this step: the Trainer logs no grad_norm for it
        return report.engine_norm if report.engine_norm is not None else report.total_norm
