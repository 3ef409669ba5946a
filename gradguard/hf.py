"""gradguard for the Hugging Face ``transformers.Trainer``: ``Trainer(..., callbacks=[GradGuardCallback()])``,
nothing else changed.

Each Trainer event is one call on the run object, :class:`gradguard._hf.run.HFRun` (one per
``train()``, every piece of per-run state); detection and policy live in the core
(:class:`gradguard.guard.GuardCore`). How the events map onto the core, and the Trainer plumbing
(the norm pass taken over, the loss hook, the checkpoints, the logs): :mod:`gradguard._hf`.
"""

from __future__ import annotations

from typing import Any

from ._compat import hf_trainer
from ._hf.checkpoints import STATE_FILE
from ._hf.run import HFRun, join_trainer
from ._hf.state import ensure_state_entry
from .config import GuardConfig
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
        self.user_sinks, self.out_dir, self.raise_on_halt = list(sinks or []), out_dir, raise_on_halt
        self.layer_metrics, self.print_metrics = layer_metrics, print_metrics
        self._resume_state: dict[str, Any] | None = None  # set by the Trainer's callback restore (see state())
        self._ordered = False  # moved ahead of the Trainer's reporters
        self.run = self._new_run()  # the current train()'s state (gradguard._hf.run)

    def _new_run(self) -> HFRun:
        return HFRun(self.config, sinks=self.user_sinks, out_dir=self.out_dir, raise_on_halt=self.raise_on_halt,
                     layer_metrics=self.layer_metrics, name=type(self).__name__)

    # -- what the run holds, read-only (None / [] before train()) ----------------------------------
    core = property(lambda self: self.run.core)
    """The run's :class:`gradguard.guard.GuardCore`."""
    reports = property(lambda self: self.run.reports)
    """This ``train()`` call's step reports (the last 1000)."""
    diagnosis = property(lambda self: self.run.diagnosis)
    """The diagnosis of a halt (None without one)."""
    summary = property(lambda self: self.run.summary)
    """The run's summary, once ``train()`` has ended."""
    max_grad_norm = property(lambda self: self.run.max_grad_norm())
    """The max_grad_norm in force (the guard's, or the Trainer's own when the guard does not clip)."""

    def observe_loss(self, loss: Any) -> None:
        """Feed the guard one micro-batch's loss when the model's output holds none (a custom
        ``compute_loss``, ``compute_loss_func``, ``label_smoothing_factor``): call it from your
        ``compute_loss`` with the loss it returns (a tensor; the step's loss is the mean of the
        micro-batches'). Without such a loss the loss detector is blind (warned at the first step)."""
        self.run.observe_loss(loss)

    # -- Trainer events -> the run -------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ordered = join_trainer(self, hf_trainer(), self.config, self.print_metrics, self._ordered)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        trainer = hf_trainer()
        self._ordered = join_trainer(self, trainer, self.config, self.print_metrics, self._ordered)
        ensure_state_entry(state, type(self).__name__, self.state)
        self.run.teardown()  # the previous train()'s run, if it is still attached
        self.run, resume = self._new_run(), None
        if state.global_step > 0:  # the state the Trainer's callback restore set (see state())
            resume, self._resume_state = self._resume_state, None
        self.run.start(trainer, args, state, control, model, optimizer, lr_scheduler, train_dataloader, resume)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.pre_optimizer_step(control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.step_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.step_end(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.epoch_end(control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.save(args, state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.run.log(state, logs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.train_end()

    def state(self) -> dict[str, Any]:
        """``ExportableState``, saved into ``trainer_state.json`` with every checkpoint: the guard state of
        that checkpoint (:meth:`HFRun.exported`) and the arguments that rebuild the callback when the
        Trainer restores callbacks and this class is not among them."""
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics, "_from_checkpoint": True},
                "attributes": {"_resume_state": self.run.exported(type(self))}}
