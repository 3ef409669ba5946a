"""One ``train()`` of the HF callback: :class:`HFRun` holds every piece of per-run state (the core,
the Trainer and its arguments, the step runner and decisions, the loader, the clip, the DeepSpeed
run, the logging window, the halt) and implements what each Trainer event does with it;
``gradguard.hf.GradGuardCallback`` only calls it (and keeps what outlives a run: its arguments and
the state the Trainer restores into it)."""

from __future__ import annotations

from typing import Any

import torch

from .._compat import hf_restore_into_own_instances, hf_trainer, is_deepspeed_engine
from ..adapter import HaltLatch, halt_raises, may_wrap
from ..clip import HFClip
from ..config import GuardConfig
from ..errors import StateError
from ..guard import GuardCore, StepReport
from ..sinks import Sink
from . import state as hf_state
from .deepspeed import DeepSpeedRun
from .live import add_to_logs, bind_integrations, is_logging_step, move_ahead_of_reporters
from .loader import TrainerLoader
from .norm import StepDecision
from .setup import build, event_log_dir, once_in_callbacks, per_process_config, validate
from .steps import StepRunner

__all__ = ["HFRun", "join_trainer", "trainer_callbacks"]


def trainer_callbacks(trainer: Any) -> list[Any]:
    """The Trainer's callback list (its ``report_to`` integrations among them), or []."""
    cbs = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    return cbs if isinstance(cbs, list) else []


def join_trainer(callback: object, trainer: Any, config: GuardConfig, print_metrics: bool, ordered: bool) -> bool:
    """``callback`` (compared by identity) once in the Trainer's callback list, ahead of its reporters
    (``ordered``: moved already); the Trainer's callback restore keeps this instance. Returns whether
    it is in its place ahead of the reporters."""
    if trainer is None:
        return ordered
    hf_restore_into_own_instances(trainer, type(callback))
    once_in_callbacks(callback, trainer.callback_handler, config)
    return ordered or move_ahead_of_reporters(callback, trainer_callbacks(trainer), print_metrics)


class HFRun:
    """The per-run state of one ``train()`` of the HF ``GradGuardCallback``."""

    def __init__(self, config: GuardConfig, *, sinks: list[Sink], out_dir: str | None, raise_on_halt: bool | None,
                 layer_metrics: bool, name: str) -> None:
        self.config = config
        self.user_sinks = sinks
        self.out_dir = out_dir
        self.layer_metrics = layer_metrics
        self.name = name  # the callback's entry in the Trainer's stateful_callbacks
        self.trainer: Any = None
        self.args: Any = None
        self.core: GuardCore | None = None
        self.runner: StepRunner | None = None
        self.decision: StepDecision | None = None  # the run's step decisions (gradguard._hf.norm)
        self.batches: TrainerLoader | None = None
        self.ds: DeepSpeedRun | None = None  # DeepSpeed ZeRO 1/2: the engine steps itself (gradguard._hf.deepspeed)
        self.clip: HFClip | None = None  # TrainingArguments.max_grad_norm for this run (gradguard.clip)
        self.hook: Any = None
        self.halt = HaltLatch(halt_raises(config, raise_on_halt))
        self.window_losses: list[float] = []
        self.callbacks: list[Any] = []  # the Trainer's callback list (its report_to integrations)
        self.live_bound = False
        self.control: Any = None  # the Trainer's TrainerControl and TrainerState while training runs
        self.tstate: Any = None
        self.reports: list[StepReport] = []  # this train() call's step reports (the last 1000)
        self.summary: dict[str, Any] | None = None

    @property
    def diagnosis(self) -> dict[str, Any] | None:
        return self.halt.diagnosis

    # -- on_train_begin ------------------------------------------------------------------------------
    def start(self, trainer: Any, args: Any, state: Any, control: Any, model: Any, optimizer: Any,
              lr_scheduler: Any, train_dataloader: Any, resume_state: dict[str, Any] | None) -> None:
        """Build the core on the Trainer's pieces (or stand aside: monitor mode on an unsupported
        setup), put back the guard state resumed from, and take the Trainer's step over."""
        if not validate(self.config, args, optimizer, trainer):
            return  # monitor mode on an unsupported setup: stand aside
        engine = getattr(trainer, "model_wrapped", None)
        ds_engine = engine if getattr(trainer, "is_deepspeed_enabled", False) is True and is_deepspeed_engine(engine) \
            else None
        self.clip = clip = HFClip(args, self.config, ds_engine)  # the clip rule, evaluated once
        self.trainer, self.args, self.callbacks = trainer, args, list(trainer_callbacks(trainer))
        cfg = per_process_config(clip.config, args)
        out_dir = event_log_dir(cfg, self.out_dir, trainer_callbacks(trainer), args)
        if ds_engine is not None:
            self.ds = DeepSpeedRun(cfg, engine, lr_scheduler, list(self.user_sinks), out_dir)
            self.core = self.ds.core
        else:
            self.core, self.runner, self.decision, self.batches = build(
                cfg, clip.replay, args, model, optimizer, lr_scheduler, train_dataloader, list(self.user_sinks), out_dir)
        if state.global_step > 0:
            self.restore(args, state, resume_state)  # before anything of the Trainer's is changed
        self.control, self.tstate = control, state
        if self.ds is not None:
            return
        core, runner, decision = self.core, self.runner, self.decision
        assert core is not None and runner is not None and decision is not None
        runner.trainer = trainer
        core.ratio_due = lambda step: self.layer_metrics and is_logging_step(args, state, step)
        if trainer is not None and may_wrap(cfg):  # monitor mode changes nothing, OOM handling included
            runner.wrap(trainer)
        if trainer is not None:
            decision.take_over(trainer)  # the Trainer's norm pass becomes the step's decision
        self.hook = model.register_forward_hook(runner.forward_hook, with_kwargs=True)
        clip.take_over()  # keep unscaling + measuring in the Trainer, never its clipping

    def restore(self, args: Any, state: Any, resume_state: dict[str, Any] | None) -> None:
        """The guard state of the checkpoint resumed from; one that cannot be used: ``StateError``
        when acting (the run torn down, nothing of the Trainer's changed)."""
        assert self.core is not None
        try:
            hf_state.resume(self.core, self.runner, self.batches, self.config, resume_state, args, state, self.name)
        except StateError:
            self.teardown()
            self.core = None
            raise

    # -- per step ------------------------------------------------------------------------------------
    def observe_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            return
        if self.runner is None:
            if self.ds is not None:
                self.ds.core.observe_loss(loss.detach().float().mean())
            return
        if torch.is_grad_enabled():  # a training micro-batch (evaluation runs under no_grad)
            self.runner.losses.append(loss.detach().float().mean())

    def step_begin(self) -> None:
        if self.decision is not None:
            self.decision.decided = False  # a step interrupted earlier (an exception) never leaves its decision behind
        if self.runner is not None:
            self.runner.micro_in_step = 0
            self.runner.open_step()  # recovery.oom_all_ranks under DDP: this step's backwards sync nothing

    def pre_optimizer_step(self, control: Any) -> None:
        if self.ds is not None:
            report: StepReport | None = self.ds.pre_optimizer_step()  # DeepSpeed has stepped already
        elif self.core is None or self.decision is None:
            return
        else:
            report = self.decision.decide()
        if report is not None and report.halt:
            self.halt.trip(report.diagnosis)
            control.should_training_stop = True
            control.should_save = True

    def step_end(self, state: Any, control: Any) -> None:
        core = self.core
        if core is None or ((self.runner is None or self.decision is None) and self.ds is None):
            return
        self.control = control
        if not self.live_bound and getattr(state, "is_world_process_zero", True):
            self.live_bound = True  # the integrations set themselves up in their on_train_begin
            core.add_live_sinks(bind_integrations(self.callbacks, core.sinks))
        # DefaultFlowCallback (ahead of this callback) has decided whether this step is logged
        if self.ds is not None:
            report = self.ds.step_end(engine_logs=bool(control.should_log))
        else:
            assert self.decision is not None
            report = self.decision.finish(engine_logs=bool(control.should_log))
        if report is not None:
            self.reports.append(report)
            if len(self.reports) > 1000:
                del self.reports[:-1000]
            if report.loss is not None:
                self.window_losses.append(report.loss)
        if self.halt.halted:
            control.should_training_stop = True
            control.should_save = True
        self.epoch_end(control)

    def epoch_end(self, control: Any) -> None:
        if self.core is not None and control.should_save and self.clip is not None:
            self.clip.before_save(self.core)  # the checkpoint records the clip in force

    # -- checkpoints, logs, the end ----------------------------------------------------------------
    def save(self, args: Any, state: Any) -> None:
        if self.core is None:
            return
        if self.clip is not None:
            self.clip.after_save()
        hf_state.saved(self.core, args, state.global_step, self.export, self.diagnosis)

    def export(self, saving: int | None = None) -> dict[str, Any]:
        """The state saved with a checkpoint (``saving``: the step of the checkpoint being written)."""
        out_dir = self.args.output_dir if self.args is not None else None
        return hf_state.export_state(self.core, self.runner, self.batches, out_dir, saving)

    def saving_step(self) -> int | None:
        return hf_state.saving_step(self.tstate, self.control) if self.core is not None else None

    def exported(self, callback_class: type) -> dict[str, Any] | None:
        """The callback's ``_resume_state`` in ``trainer_state.json``: the guard state of the checkpoint
        being written (it lists that checkpoint in its rollback tier). None before the core exists: the
        Trainer builds its TrainerState and restores callbacks next, into the user's own instances."""
        if self.core is None:
            trainer = hf_trainer()
            if trainer is not None:
                hf_restore_into_own_instances(trainer, callback_class)
            return None
        return self.export(self.saving_step()) or None

    def log(self, state: Any, logs: dict[str, Any] | None) -> None:
        if self.core is None or logs is None or self.core.last_report is None:
            return
        if "loss" not in logs and "grad_norm" not in logs:
            return  # evaluation and end-of-training summaries
        window, self.window_losses = self.window_losses, []
        add_to_logs(self.core, state, logs, window, self.layer_metrics)
        # what the report_to integrations write from these logs (TensorBoard's line runs draw it too)
        self.core.engine_logged(state.global_step, {k: float(v) for k, v in logs.items() if k.startswith("gradguard/")
                                                     and isinstance(v, (int, float))})

    def train_end(self) -> None:
        if self.core is None:
            return
        if self.clip is not None:
            self.clip.put_back()
        self.teardown()
        self.halt.finish()  # GradGuardHalt after the save, unless output.halt_raises is False

    def teardown(self) -> None:
        """Every wrapper, hook and shadow of the run removed; the core detached (its summary kept)."""
        self.control = self.tstate = None
        if self.runner is not None:
            self.runner.unwrap()
        if self.decision is not None:
            self.decision.release()
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.ds is not None:
            self.summary = self.ds.close()
        elif self.core is not None:
            self.summary = self.core.detach()

    def max_grad_norm(self) -> float | None:
        if self.core is None:
            return None
        return self.clip.in_force(self.core) if self.clip is not None else self.core.max_grad_norm
