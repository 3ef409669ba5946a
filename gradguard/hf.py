"""gradguard for the Hugging Face ``transformers.Trainer``: one callback, nothing else changed.

``Trainer(..., callbacks=[GradGuardCallback()])``. The callback only translates Trainer events into
:class:`gradguard.guard.GuardCore` calls; detection and policy live in the core.

Every piece of per-run state lives in the run object, :class:`gradguard._hf.run.HFRun` (one per
``train()``); the callback maps each event to one of its methods. Event mapping, in short:
``on_train_begin`` builds the core (the Trainer's ``_clip_grad_norm`` is
taken over: one fused norm pass, ``args.max_grad_norm`` becomes the guard's starting clip); a forward
hook reads each micro-batch's loss; the norm pass / ``on_pre_optimizer_step`` runs
``core.before_step`` (a skip drops the grads and holds the scheduler); ``on_step_end`` runs
``core.after_step`` (a halt saves, then raises ``GradGuardHalt``); ``on_log`` adds gradguard's
metrics to the Trainer's logs. The full mapping and the plumbing are in :mod:`gradguard._hf`.
"""


from __future__ import annotations

from typing import Any

from ._compat import hf_restore_into_own_instances, hf_trainer
from ._hf import state as hf_state
from ._hf.checkpoints import STATE_FILE
from ._hf.live import move_ahead_of_reporters
from ._hf.norm import StepDecision
from ._hf.run import HFRun, trainer_callbacks
from ._hf.setup import once_in_callbacks, validate
from ._hf.steps import StepRunner
from .config import GuardConfig
from .guard import GuardCore, StepReport
from .sinks import M, Sink

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("gradguard.hf needs transformers: pip install 'gradguard[hf]'") from exc

__all__ = ["GradGuardCallback", "STATE_FILE", "NONFINITE_LOSS_STEPS"]

#: Steps with a non-finite loss in the logging window (added to the Trainer's logs).
NONFINITE_LOSS_STEPS = M.NONFINITE_LOSS_STEPS


class GradGuardCallback(TrainerCallback, ExportableState):
    """gradguard inside an unmodified ``transformers.Trainer``.

    Args:
        config: a :class:`GuardConfig` (or its dict form); default ``GuardConfig()``.
        sinks: extra :class:`gradguard.Sink` objects (the JSONL log and the console are built in).
        out_dir: folder of the event log (``<out_dir>/gradguard/events.jsonl``); default
            ``config.output.dir``, else the Trainer's logging directory when it reports to
            TensorBoard (``<output_dir>/runs/<time>_<host>/gradguard/``), else no event log (one
            warning): never an entry among the ``checkpoint-*`` folders of ``output_dir``. The
            rule: :mod:`gradguard.logdir`.
        raise_on_halt: overrides ``config.output.halt_raises`` (None: the config decides): after a
            halt has stopped training and saved a checkpoint, raise :class:`GradGuardHalt` from
            ``trainer.train()`` (False: only stop; see ``.diagnosis``).
        print_metrics: False keeps every ``gradguard/...`` key off the Trainer's printed log line; they
            still reach every ``report_to`` integration (W&B, TensorBoard) and ``log_history``.
        layer_metrics: send per-layer values (``gradguard/grad_norm/<layer>``, ``update_ratio/<layer>``,
            ``param_norm/<layer>``) on logging steps to the ``report_to`` W&B run / TensorBoard writer
            (at the same ``train/global_step``; they stay out of the printed logs).

    With ``restore_callback_states_from_checkpoint=True`` the Trainer restores the saved guard state
    into this instance (its config, sinks and ``out_dir`` stay the user's): see
    :func:`gradguard._compat.hf_restore_into_own_instances`.
    """

    def __init__(self, config: GuardConfig | dict[str, Any] | None = None, *, sinks: list[Sink] | None = None,
                 out_dir: str | None = None, raise_on_halt: bool | None = None, layer_metrics: bool = True,
                 print_metrics: bool = True, _from_checkpoint: bool = False) -> None:
        # _from_checkpoint: set in the arguments saved with checkpoints (a callback rebuilt by the Trainer)
        self.config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.user_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.raise_on_halt = raise_on_halt
        self.layer_metrics = layer_metrics
        self.print_metrics = print_metrics
        self._resume_state: dict[str, Any] | None = None  # set by the Trainer's callback restore
        self._ordered = False
        self.run: HFRun | None = None  # the current train()'s state (gradguard._hf.run)

    # -- what the run holds, read-only ------------------------------------------------------------
    @property
    def core(self) -> GuardCore | None:
        return self.run.core if self.run is not None else None

    @property
    def runner(self) -> StepRunner | None:
        return self.run.runner if self.run is not None else None

    @property
    def decision(self) -> StepDecision | None:
        return self.run.decision if self.run is not None else None

    @property
    def reports(self) -> list[StepReport]:
        """This ``train()`` call's step reports (the last 1000)."""
        return self.run.reports if self.run is not None else []

    @property
    def diagnosis(self) -> dict[str, Any] | None:
        return self.run.diagnosis if self.run is not None else None

    @property
    def summary(self) -> dict[str, Any] | None:
        return self.run.summary if self.run is not None else None

    @property
    def _splits(self) -> int:
        return self.runner.splits if self.runner is not None else 1

    @property
    def _sum_semantics(self) -> bool:
        return bool(self.runner is not None and self.runner.sum_semantics)

    @property
    def max_grad_norm(self) -> float | None:
        """The max_grad_norm in force (the guard's, or the Trainer's own when the guard does not clip)."""
        return self.run.max_grad_norm() if self.run is not None else None

    def observe_loss(self, loss: Any) -> None:
        """Feed the guard one micro-batch's loss when the model's output holds none (a custom
        ``compute_loss``, ``compute_loss_func``, ``label_smoothing_factor``): call it from your
        ``compute_loss`` with the loss it returns (a tensor; the step's loss is the mean of the
        micro-batches'). Without such a loss the loss detector is blind (warned at the first step)."""
        if self.run is not None:
            self.run.observe_loss(loss)

    def _validate(self, args: Any, optimizer: Any) -> bool:
        return validate(self.config, args, optimizer, hf_trainer())

    # -- Trainer events -> the run -------------------------------------------------------------------
    def _join(self, trainer: Any) -> None:
        """Once in the Trainer's callback list, ahead of its reporters; its callback restore keeps
        this instance."""
        if trainer is None:
            return
        hf_restore_into_own_instances(trainer, type(self))
        once_in_callbacks(self, trainer.callback_handler, self.config)
        self._ordered = self._ordered or move_ahead_of_reporters(self, trainer_callbacks(trainer), self.print_metrics)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._join(hf_trainer())

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        trainer = hf_trainer()
        self._join(trainer)
        hf_state.ensure_state_entry(state, type(self).__name__, self.state)
        if self.run is not None and self.run.core is not None:
            self.run.teardown()
        self.run = HFRun(self.config, sinks=self.user_sinks, out_dir=self.out_dir, raise_on_halt=self.raise_on_halt,
                         layer_metrics=self.layer_metrics, name=type(self).__name__)
        resume = None
        if state.global_step > 0:  # the state the Trainer's callback restore set (see state())
            resume, self._resume_state = self._resume_state, None
        self.run.start(trainer, args, state, control, model, optimizer, lr_scheduler, train_dataloader, resume)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.pre_optimizer_step(control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.step_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.step_end(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.epoch_end(control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.save(args, state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.log(state, logs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.train_end()

    # -- state -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``ExportableState``: saved into ``trainer_state.json`` with every checkpoint. The guard state
        of a checkpoint lists that checkpoint in its rollback tier (as ``gradguard_state.json`` does),
        so a run resumed from it has the state of the run that wrote it. ``args`` rebuild the
        callback when the Trainer restores callbacks and this class is not among them."""
        if self.core is None:  # the Trainer builds its TrainerState (and restores callbacks) next
            trainer = hf_trainer()
            if trainer is not None:
                hf_restore_into_own_instances(trainer, type(self))
        export = self.run.export(self.run.saving_step()) if self.run is not None else {}
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics, "_from_checkpoint": True},
                "attributes": {"_resume_state": export or None}}
