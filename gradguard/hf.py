"""gradguard for the Hugging Face ``transformers.Trainer``: one callback, nothing else changed.

``Trainer(..., callbacks=[GradGuardCallback()])``. The callback only translates Trainer events into
:class:`gradguard.guard.GuardCore` calls; detection and policy live in the core.

Event mapping, in short: ``on_train_begin`` builds the core (the Trainer's ``_clip_grad_norm`` is
taken over: one fused norm pass, ``args.max_grad_norm`` becomes the guard's starting clip); a forward
hook reads each micro-batch's loss; the norm pass / ``on_pre_optimizer_step`` runs
``core.before_step`` (a skip drops the grads and holds the scheduler); ``on_step_end`` runs
``core.after_step`` (a halt saves, then raises ``GradGuardHalt``); ``on_log`` adds gradguard's
metrics to the Trainer's logs. The full mapping and the plumbing are in :mod:`gradguard._hf`.
"""


from __future__ import annotations

from typing import Any

from ._compat import find_caller, hf_callback_being_restored, is_deepspeed_engine
from ._hf import state as hf_state
from ._hf.checkpoints import STATE_FILE
from ._hf.deepspeed import DeepSpeedRun
from ._hf.live import add_to_logs, bind_integrations, is_logging_step, move_ahead_of_reporters
from ._hf.loader import TrainerLoader
from ._hf.norm import StepDecision
from ._hf.setup import build, event_log_dir, once_in_callbacks, per_process_config, validate
from ._hf.steps import StepRunner
from .adapter import HaltLatch, halt_raises, may_wrap
from .clip import HFClip
from .config import GuardConfig
from .errors import StateError
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
    """

    def __new__(cls, *args: Any, _from_checkpoint: bool = False, **kwargs: Any) -> GradGuardCallback:
        # restore_callback_states_from_checkpoint=True: the Trainer rebuilds every stateful callback
        # from the arguments saved in trainer_state.json and drops the instance the user passed (its
        # sinks, out_dir, a new config). The "rebuilt" callback is the user's own instance instead;
        # the Trainer then sets the saved state on it (see __init__ and state()).
        if _from_checkpoint:
            mine = hf_callback_being_restored(cls)
            if mine is not None:
                return mine
        return super().__new__(cls)

    def __init__(self, config: GuardConfig | dict[str, Any] | None = None, *, sinks: list[Sink] | None = None,
                 out_dir: str | None = None, raise_on_halt: bool | None = None, layer_metrics: bool = True,
                 print_metrics: bool = True, _from_checkpoint: bool = False) -> None:
        if _from_checkpoint and getattr(self, "_built", False):
            # the user's instance, handed back by __new__ to the Trainer's callback restore: keep it as
            # it is (the user's config wins); the Trainer re-adds it at the end of its callback list
            self._ordered = False
            return
        self._built = True
        self.config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.user_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.raise_on_halt = raise_on_halt
        self.layer_metrics = layer_metrics
        self.print_metrics = print_metrics
        self.core: GuardCore | None = None
        self.reports: list[StepReport] = []  # this train() call's step reports (the last 1000)
        self.diagnosis: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None  # set by the Trainer's callback restore
        self._control: Any = None  # the Trainer's TrainerControl and TrainerState while training runs
        self._tstate: Any = None
        self._ordered = False
        self.runner: StepRunner | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self._hook: Any = None
        self.decision: StepDecision | None = None  # the run's step decisions (gradguard._hf.norm)
        self._clip: HFClip | None = None  # TrainingArguments.max_grad_norm for this run (gradguard.clip)
        self._window_losses: list[float] = []
        self._halt = HaltLatch(halt_raises(self.config, self.raise_on_halt))
        self._args: Any = None
        self._batches: TrainerLoader | None = None
        self._callbacks: list[Any] = []  # the Trainer's callback list (its report_to integrations)
        self._live_bound = False
        self._ds: DeepSpeedRun | None = None  # DeepSpeed ZeRO 1/2: the engine steps itself (gradguard._hf.deepspeed)

    # -- compatibility with earlier attribute names ----------------------------------------------
    @property
    def _splits(self) -> int:
        return self.runner.splits if self.runner is not None else 1

    @property
    def _sum_semantics(self) -> bool:
        return bool(self.runner is not None and self.runner.sum_semantics)

    @property
    def max_grad_norm(self) -> float | None:
        """The max_grad_norm in force (the guard's, or the Trainer's own when the guard does not clip)."""
        if self.core is None:
            return None
        return self._clip.in_force(self.core) if self._clip is not None else self.core.max_grad_norm

    def observe_loss(self, loss: Any) -> None:
        """Feed the guard one micro-batch's loss when the model's output holds none (a custom
        ``compute_loss``, ``compute_loss_func``, ``label_smoothing_factor``): call it from your
        ``compute_loss`` with the loss it returns (a tensor; the step's loss is the mean of the
        micro-batches'). Without such a loss the loss detector is blind (warned at the first step)."""
        import torch

        if self.runner is None or not isinstance(loss, torch.Tensor):
            if self._ds is not None and isinstance(loss, torch.Tensor):
                self._ds.core.observe_loss(loss.detach().float().mean())
            return
        if torch.is_grad_enabled():  # a training micro-batch (evaluation runs under no_grad)
            self.runner.losses.append(loss.detach().float().mean())

    def _validate(self, args: Any, optimizer: Any) -> bool:
        from transformers import Trainer

        return validate(self.config, args, optimizer, find_caller(Trainer, start=2))

    # -- Trainer events --------------------------------------------------------------------
    def _once_in_callbacks(self) -> None:
        from transformers.trainer_callback import CallbackHandler

        once_in_callbacks(self, find_caller(CallbackHandler, start=3), self.config)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._once_in_callbacks()
        self._ordered = self._ordered or move_ahead_of_reporters(self)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        self._once_in_callbacks()
        self._ordered = self._ordered or move_ahead_of_reporters(self)
        hf_state.ensure_state_entry(state, type(self).__name__, self.state)
        if self.core is not None:
            self._teardown()
        self._reset_run()
        self.diagnosis = None
        self.reports = []
        if not self._validate(args, optimizer):
            return  # monitor mode on an unsupported setup: stand aside
        from transformers import Trainer

        trainer = find_caller(Trainer, start=2)
        engine = getattr(trainer, "model_wrapped", None)
        ds_engine = engine if getattr(trainer, "is_deepspeed_enabled", False) is True and is_deepspeed_engine(engine) \
            else None
        self._clip = clip = HFClip(args, self.config, ds_engine)  # the clip rule, evaluated once
        cfg = per_process_config(clip.config, args)
        out_dir = event_log_dir(cfg, self.out_dir, self, args)
        self._args = args
        if ds_engine is not None:
            self._ds = DeepSpeedRun(cfg, engine, lr_scheduler, list(self.user_sinks), out_dir)
            self.core = self._ds.core
            if state.global_step > 0:
                self._restore(args, state)  # the guard state of the checkpoint resumed from
            self._control, self._tstate = control, state
            self._callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or [])
            return
        core, runner, decision, self._batches = build(cfg, clip.replay, args, model, optimizer, lr_scheduler,
                                                      train_dataloader, list(self.user_sinks), out_dir)
        self.core, self.runner, self.decision = core, runner, decision
        if state.global_step > 0:
            self._restore(args, state)  # before anything of the Trainer's is changed: a StateError leaves it as it was
        self._control, self._tstate = control, state
        runner.trainer = trainer
        self._callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or [])
        core.ratio_due = lambda step: self.layer_metrics and is_logging_step(args, state, step)
        if trainer is not None and may_wrap(cfg):  # monitor mode changes nothing, OOM handling included
            runner.wrap(trainer)
        if trainer is not None:
            decision.take_over(trainer)  # the Trainer's norm pass becomes the step's decision
        self._hook = model.register_forward_hook(runner.forward_hook, with_kwargs=True)
        clip.take_over()  # keep unscaling + measuring in the Trainer, never its clipping

    def _restore(self, args: Any, state: Any) -> None:
        assert self.core is not None and (self.runner is not None or self._ds is not None)
        resume, self._resume_state = self._resume_state, None
        try:
            hf_state.resume(self.core, self.runner, self._batches, self.config, resume, args, state, type(self).__name__)
        except StateError:
            self._teardown()
            self.core = None
            raise

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._ds is not None:
            report: StepReport | None = self._ds.pre_optimizer_step()  # DeepSpeed has stepped already
        elif self.core is None or self.decision is None:
            return
        else:
            report = self.decision.decide()
        if report is not None and report.halt:
            self._halt.trip(report.diagnosis)
            self.diagnosis = self._halt.diagnosis
            control.should_training_stop = True
            control.should_save = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.decision is not None:
            self.decision.decided = False  # a step interrupted earlier (an exception) never leaves its decision behind
        if self.runner is not None:
            self.runner.micro_in_step = 0
            self.runner.open_step()  # recovery.oom_all_ranks under DDP: this step's backwards sync nothing

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core, decision = self.core, self.decision
        if core is None or ((self.runner is None or decision is None) and self._ds is None):
            return
        self._control = control
        if not self._live_bound and getattr(state, "is_world_process_zero", True):
            self._live_bound = True  # the integrations set themselves up in their on_train_begin
            core.add_live_sinks(bind_integrations(self._callbacks, core.sinks))
        # DefaultFlowCallback (ahead of this callback) has decided whether this step is logged
        if self._ds is not None:
            report = self._ds.step_end(engine_logs=bool(control.should_log))
        else:
            assert decision is not None
            report = decision.finish(engine_logs=bool(control.should_log))
        if report is not None:
            self.reports.append(report)
            if len(self.reports) > 1000:
                del self.reports[:-1000]
            if report.loss is not None:
                self._window_losses.append(report.loss)
        if self._halt.halted:
            control.should_training_stop = True
            control.should_save = True
        if control.should_save and self._clip is not None:
            self._clip.before_save(core)  # the checkpoint records the clip in force

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is not None and control.should_save and self._clip is not None:
            self._clip.before_save(self.core)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is not None:
            if self._clip is not None:
                self._clip.after_save()
            hf_state.saved(self.core, args, state.global_step, self._export, self.diagnosis)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.core is None or logs is None or self.core.last_report is None:
            return
        if "loss" not in logs and "grad_norm" not in logs:
            return  # evaluation and end-of-training summaries
        window, self._window_losses = self._window_losses, []
        add_to_logs(self.core, state, logs, window, self.layer_metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is None:
            return
        if self._clip is not None:
            self._clip.put_back()
        self._teardown()
        self._halt.finish()  # GradGuardHalt after the save, unless output.halt_raises is False

    def _teardown(self) -> None:
        self._control = self._tstate = None
        if self.runner is not None:
            self.runner.unwrap()
        if self.decision is not None:
            self.decision.release()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._ds is not None:
            self.summary = self._ds.close()
        elif self.core is not None:
            self.summary = self.core.detach()

    # -- state -----------------------------------------------------------------------------
    def _export(self, saving: int | None = None) -> dict[str, Any]:
        out_dir = self._args.output_dir if self._args is not None else None
        return hf_state.export_state(self.core, self.runner, self._batches, out_dir, saving)

    def state(self) -> dict[str, Any]:
        """``ExportableState``: saved into ``trainer_state.json`` with every checkpoint. The guard state
        of a checkpoint lists that checkpoint in its rollback tier (as ``gradguard_state.json`` does),
        so a run resumed from it has the state of the run that wrote it. ``args`` rebuild the
        callback when there is no user instance to restore into (see ``__new__``)."""
        saving = hf_state.saving_step(self._tstate, self._control) if self.core is not None else None
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics, "_from_checkpoint": True},
                "attributes": {"_resume_state": self._export(saving) or None}}
