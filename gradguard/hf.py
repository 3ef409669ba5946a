"""gradguard for the Hugging Face ``transformers.Trainer``: one callback, nothing else changed.

``Trainer(..., callbacks=[GradGuardCallback()])``. The callback only translates Trainer events into
:class:`gradguard.guard.GuardCore` calls; detection and policy live in the core.

How the Trainer's events map onto the core:

* ``on_train_begin``: validates the setup, builds the core on the Trainer's model, optimizer, LR
  scheduler and GradScaler, and sets ``args.max_grad_norm = inf`` so the Trainer never clips by
  itself. The Trainer's norm pass (``_clip_grad_norm``) is taken over for the run: it unscales
  (fp16) and runs ``core.before_step``, whose one fused pass gives the per-layer norms, the guard's
  clip, and the ``grad_norm`` value the Trainer logs (in monitor mode the Trainer's own
  ``max_grad_norm`` clip is replayed from the same norms, bit-identical to ``clip_grad_norm_``).
  ``args.max_grad_norm`` (when finite and > 0) becomes the guard's starting ``clip.max_norm``; it is
  put back at the end of training, and written with the guard's current value into checkpoints.
* a forward hook on the model reads ``outputs.loss`` of every training micro-batch; the step's loss
  is their mean, or their sum when the Trainer passed ``num_items_in_batch`` (the loss is then
  already normalised by the whole accumulated batch).
* ``on_pre_optimizer_step`` (gradients accumulated, unscaled, not clipped): ``core.before_step``.
  A skipped step sets every ``p.grad = None`` (the optimizer step is a no-op, Adam's step count
  does not move) and holds the LR scheduler for that one ``step()`` call.
* ``on_step_end``: ``core.after_step``; a halt sets ``should_training_stop`` and ``should_save``
  and writes ``diagnosis.json`` beside the event log; ``GradGuardHalt`` is raised after the save.
* ``on_log``: the run-level ``gradguard/...`` metrics are added to the Trainer's logs (the callback
  moves itself ahead of the reporting integrations so that they receive them); so are the
  per-layer ones, which every integration receives (W&B, TensorBoard, MLflow, ...) and a filter
  placed right before the progress bar removes from the printed line. ``gradguard/loss`` is the mean guard loss of the logging window,
  non-finite values included (the Trainer's ``logging_nan_inf_filter`` hides them from ``loss``).
* a step with a finding, skip, action or halt that is not a logging step is written into the
  ``report_to`` W&B run / TensorBoard writer at that step (``gradguard/event/<name>`` points);
  alerts go there too (``gradguard._hf.live``).
* ``trainer.training_step`` is wrapped for the run (the Trainer is found on the call stack): an
  out-of-memory error retries the same samples in smaller chunks (and later micro-batches stay
  split); a data window skipped after a rollback is not computed; ``shrink_mode="micro"`` splits.
* the train dataloader is the core's batch controller: ``shrink_batch`` / grow-back change its
  batch size live (LR scaled linearly while it is small).
* rollback: the in-memory snapshot ring first, then the run's own ``checkpoint-*`` folders (a
  checkpoint is trusted once the step after it was healthy).
* checkpoints: the guard's state is an ``ExportableState`` entry of ``trainer_state.json`` and a
  ``gradguard_state.json`` file in the checkpoint folder; ``train(resume_from_checkpoint=...)``
  restores it.
"""


from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any

import torch

from ._compat import (
    HF_NORM_METHOD,
    check_features,
    find_caller,
    hf_callback_being_restored,
    hf_callback_list,
    hf_norm_pass_plain,
    shadow_method,
    unshadow_method,
)
from ._hf.checkpoints import STATE_FILE, TrainerCheckpoints, find_resume_state, write_state_file
from ._hf.live import bind_integrations, is_logging_step, layer_keys_out_of_print
from ._hf.loader import TrainerLoader
from ._hf.setup import log_entries, tensorboard_dir, unsupported
from ._hf.steps import StepRunner
from .act import drop_grads, unwrap_optimizer
from .adapter import (
    HaltLatch,
    SchedulerHold,
    check_ladder,
    halt_raises,
    may_wrap,
    refuse_unsupported,
    resolve_clip,
    unusable_resume_state,
)
from .config import GuardConfig
from .errors import StateError
from .guard import GuardCore, StepReport
from .logdir import choose_log_dir
from .measure import EngineClip
from .policy import Action
from .sinks import M, Sink, is_headline

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("gradguard.hf needs transformers: pip install 'gradguard[hf]'") from exc

__all__ = ["GradGuardCallback", "STATE_FILE", "NONFINITE_LOSS_STEPS"]

#: Steps with a non-finite loss in the logging window (added to the Trainer's logs).
NONFINITE_LOSS_STEPS = M.NONFINITE_LOSS_STEPS

_HF_DEFAULT_MAX_GRAD_NORM = 1.0


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
                 _from_checkpoint: bool = False) -> None:
        if _from_checkpoint and getattr(self, "_built", False):
            # the user's instance, handed back by __new__ to the Trainer's callback restore: keep it as
            # it is (the user's config wins); the Trainer re-adds it at the end of its callback list
            self._ordered = False
            return
        self._built = True
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.user_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.raise_on_halt = raise_on_halt
        self.layer_metrics = layer_metrics
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
        self._hook = None
        self._report: StepReport | None = None
        self._held = SchedulerHold()
        self._user_max_grad_norm: float | None = None
        self._replay_clip: float | None = None  # the Trainer's own clipping, re-applied when the guard does not clip
        self._window_losses: list[float] = []
        self._halt = HaltLatch(halt_raises(self.config, self.raise_on_halt))
        self._args: Any = None
        self._batches: TrainerLoader | None = None
        self._decided = False  # this step's decision was taken in the Trainer's norm pass
        self._norm_plain: bool | None = None  # the Trainer's norm pass can be taken over (first step)
        self._norm_shadow: tuple[Any, Any, Any] | None = None  # (trainer, wrapper, previous)
        self._callbacks: list[Any] = []  # the Trainer's callback list (its report_to integrations)
        self._live_bound = False

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
        guard = self.core.max_grad_norm
        return guard if guard is not None else self._replay_clip

    def _move_ahead_of_reporters(self) -> None:
        """User callbacks run after the reporting integrations; metrics added to ``logs`` in
        ``on_log`` would miss them. Move this callback right after ``DefaultFlowCallback``."""
        if self._ordered:
            return
        cbs = hf_callback_list(self)
        if cbs is None:
            return
        from transformers.trainer_callback import DefaultFlowCallback

        cbs.remove(self)
        pos = next((i + 1 for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)), 0)
        cbs.insert(pos, self)
        layer_keys_out_of_print(cbs)
        self._ordered = True

    def _validate(self, args: Any, optimizer: Any) -> bool:
        check_ladder(self.config)
        ok = refuse_unsupported(self.config, unsupported(args, optimizer))
        if ok:
            resolve_clip(self.config, args.max_grad_norm, engine_default=_HF_DEFAULT_MAX_GRAD_NORM,
                         setting="TrainingArguments.max_grad_norm")
        return ok

    def _effective_config(self, args: Any) -> tuple[GuardConfig, float | None]:
        """The user's config with the clip rule applied (``gradguard.adapter.resolve_clip``); one event
        log per run (the main process writes it)."""
        cfg, replay = resolve_clip(copy.deepcopy(self.config), args.max_grad_norm,
                                   engine_default=_HF_DEFAULT_MAX_GRAD_NORM, setting="TrainingArguments.max_grad_norm")
        if getattr(args, "process_index", 0) != 0:
            cfg.output = dataclasses.replace(cfg.output, jsonl=False, console=False)
        return cfg, replay

    def _forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled() or self.runner is None:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and isinstance(output, (tuple, list)) and output and kwargs.get("labels") is not None:
            loss = output[0]
        if isinstance(loss, torch.Tensor):
            self.runner.losses.append(loss.detach().float().mean())
            self.runner.sum_semantics = kwargs.get("num_items_in_batch") is not None

    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        assert self.runner is not None
        self.runner.discard_left += n
        return {"mode": "the batches of the next optimizer steps are drawn but not computed (no forward/backward)",
                "optimizer_steps": n}

    # -- Trainer events --------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._move_ahead_of_reporters()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        self._move_ahead_of_reporters()
        self._ensure_state_entry(state)
        if self.core is not None:
            self._teardown()
        self._reset_run()
        self.diagnosis = None
        self.reports = []
        if not self._validate(args, optimizer):
            return  # monitor mode on an unsupported setup: stand aside
        cfg, self._replay_clip = self._effective_config(args)
        self._user_max_grad_norm = args.max_grad_norm
        scaler = getattr(optimizer, "scaler", None)
        out_dir = None
        if cfg.output.jsonl:  # the main process: where the Trainer keeps its logs (gradguard.logdir)
            out_dir = choose_log_dir(self.out_dir or cfg.output.dir, [tensorboard_dir(hf_callback_list(self), args)],
                                     engine="HF Trainer", how_to_name="GradGuardCallback(out_dir=...)",
                                     checkpoint_dirs=[args.output_dir], checkpoint_prefix=PREFIX_CHECKPOINT_DIR)
            if out_dir is None:
                cfg.output = dataclasses.replace(cfg.output, jsonl=False)
        opt = unwrap_optimizer(optimizer)
        self.core = core = GuardCore(model, opt, config=cfg, sinks=list(self.user_sinks), out_dir=out_dir,
                                     scheduler=lr_scheduler, scaler=scaler)
        check_features("hf")
        self._scaler = scaler
        self._args = args
        self.runner = runner = StepRunner(core, args, list(model.parameters()))
        core.attach_data_skip(self._skip_data)
        core.attach_checkpoints(TrainerCheckpoints(args.output_dir, model, opt, scaler=scaler, scheduler=lr_scheduler,
                                                   restore_schedule=cfg.recovery.restore_schedule))
        self._batches = TrainerLoader(train_dataloader, args.gradient_accumulation_steps, runner)
        core.attach_batches(self._batches)
        if state.global_step > 0:
            self._restore(args, state)  # before anything of the Trainer's is changed: a StateError leaves it as it was
        self._control, self._tstate = control, state
        from transformers import Trainer

        trainer = find_caller(Trainer, start=2)
        runner.trainer = trainer
        self._callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or [])
        core.ratio_due = lambda step: self.layer_metrics and is_logging_step(args, state, step)
        if trainer is not None and may_wrap(cfg):  # monitor mode changes nothing, OOM handling included
            runner.wrap(trainer)
        if trainer is not None and hasattr(trainer, HF_NORM_METHOD):
            orig_norm = getattr(trainer, HF_NORM_METHOD)

            def norm_pass(model: Any) -> Any:
                return self._engine_norm_pass(orig_norm, model)

            self._norm_shadow = (trainer, norm_pass, shadow_method(trainer, HF_NORM_METHOD, norm_pass))
        self._held = SchedulerHold([lr_scheduler])
        self._hook = model.register_forward_hook(self._forward_hook, with_kwargs=True)
        args.max_grad_norm = math.inf  # keep unscaling + measuring in the Trainer, never its clipping

    def _ensure_state_entry(self, state: Any) -> None:
        """A callback added when resuming has no entry in the checkpoint's ``stateful_callbacks``;
        the Trainer's next save looks its name up there and fails (``KeyError``). Add the entry."""
        entries = getattr(state, "stateful_callbacks", None)
        if isinstance(entries, dict) and type(self).__name__ not in entries:
            entries[type(self).__name__] = self.state()

    def _restore(self, args: Any, state: Any) -> None:
        """The guard state of the checkpoint resumed from (see ``find_resume_state``). One that cannot
        be used: ``StateError`` when acting (nothing changed yet), a warning in monitor mode."""
        assert self.core is not None and self.runner is not None
        resume, self._resume_state = self._resume_state, None
        try:
            saved = find_resume_state(resume, args, state, type(self).__name__)
            guard = saved.get("guard") if saved else None
            if guard:
                self.core.load_state_dict(guard)  # validated whole first: a StateError changed nothing
        except StateError as exc:
            try:
                unusable_resume_state(self.config, exc)
            except StateError:
                self._teardown()
                self.core = None
                raise
            saved = guard = None
        if not guard:
            self.core.start_at(state.global_step)
            self.core.emit({"type": "resume", "step": state.global_step, "restored": False})
            return
        assert saved is not None
        if "checkpoints" in saved and "checkpoints" not in guard:  # written by gradguard <= 0.1
            self.core.checkpoint_tier.load_state_dict(saved["checkpoints"])
        self.runner.load_state_dict(saved)
        if self._batches is not None:
            self._batches.load_state_dict(saved)
        self.core.emit({"type": "resume", "step": state.global_step, "restored": True,
                         "guard_step": self.core.step_count})

    def _pre_step(self) -> StepReport | None:
        """The step's decision (gradients accumulated and unscaled): ``core.before_step``, the
        Trainer's own clip replayed when the guard does not clip. None for a step whose data was
        skipped."""
        core, runner = self.core, self.runner
        assert core is not None and runner is not None
        loss = runner.take_step_loss()
        runner.micro_in_step = 0
        if runner.discard_left > 0 or runner.poisoned:
            # a data window skipped after a rollback, or a step broken by an out-of-memory error
            if runner.poisoned:
                runner.poisoned = False
            else:
                runner.discard_left -= 1
            drop_grads(runner.params)
            self._held.hold()
            core.discard_step()
            return None
        replay = self._replay_clip
        engine = EngineClip(runner.params, replay) if replay is not None else None
        report = core.before_step(loss=loss, scaler=self._scaler, drop_on_skip=True, engine_clip=engine)
        if report.applied and replay is not None and core.replay_engine_clip(report) is None:
            report.engine_norm = float(torch.nn.utils.clip_grad_norm_(runner.params, replay))
        if report.skipped:
            self._held.hold()
        return report

    def _engine_norm_pass(self, orig: Any, model: Any) -> Any:
        """The Trainer's ``_clip_grad_norm``, taken over: unscale (fp16), then the step's one pass over
        the gradients in ``core.before_step`` (the guard's clip, or the Trainer's replayed bit for bit);
        returns the total norm for the Trainer's ``grad_norm`` log."""
        trainer = self.runner.trainer if self.runner is not None else None
        if self._norm_plain is None and trainer is not None:
            self._norm_plain = hf_norm_pass_plain(trainer, model)
        if self.core is None or trainer is None or self._decided or not self._norm_plain:
            return orig(model)
        trainer.accelerator.unscale_gradients()
        report = self._report = self._pre_step()
        self._decided = True
        if report is None:
            return None  # no gradients this step: the Trainer logs no grad_norm for it
        return report.engine_norm if report.engine_norm is not None else report.total_norm

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is None or self.runner is None:
            return
        if self._decided:  # the Trainer's norm pass was taken over: decided there
            self._decided = False
            report = self._report
        else:
            report = self._report = self._pre_step()
        if report is not None and report.halt:
            self._halt.trip(report.diagnosis)
            self.diagnosis = self._halt.diagnosis
            control.should_training_stop = True
            control.should_save = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._decided = False  # a step interrupted earlier (an exception) never leaves its decision behind
        if self.runner is not None:
            self.runner.micro_in_step = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None or self.runner is None:
            return
        self._control = control
        self._held.release()  # only the skipped step's scheduler.step() is swallowed
        report, self._report = self._report, None
        if not self._live_bound and getattr(state, "is_world_process_zero", True):
            self._live_bound = True  # the integrations set themselves up in their on_train_begin
            core.add_live_sinks(bind_integrations(self._callbacks, core.sinks))
        if report is not None:
            core.keep_scale(report, self._scaler)  # the Trainer's scaler.update() may have halved it once more
            if report.applied and report.loss is not None and math.isfinite(report.loss):
                self.runner.last_step_loss = report.loss
            # DefaultFlowCallback (ahead of this callback) has decided whether this step is logged
            core.after_step(report, engine_logs=bool(control.should_log))
            self.reports.append(report)
            if len(self.reports) > 1000:
                del self.reports[:-1000]
            if report.loss is not None:
                self._window_losses.append(report.loss)
        if self._halt.halted:
            control.should_training_stop = True
            control.should_save = True
        if control.should_save:
            args.max_grad_norm = self._saved_max_grad_norm()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is not None and control.should_save:
            args.max_grad_norm = self._saved_max_grad_norm()

    def _saved_max_grad_norm(self) -> float:
        """What checkpoints record as max_grad_norm: the clip in force (0 when none)."""
        v = self.max_grad_norm
        return 0.0 if v is None else float(v)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None:
            return
        args.max_grad_norm = math.inf
        step = state.global_step
        core.checkpoint_saved(step, [os.path.join(args.output_dir, f"checkpoint-{step}")])  # on every process
        if not getattr(args, "should_save", True):
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{step}")
        if os.path.isdir(ckpt):
            write_state_file(ckpt, self._export())
            if self.diagnosis is not None:
                core.write_diagnosis(self.diagnosis, ckpt)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.core is None or logs is None or self.core.last_report is None:
            return
        if "loss" not in logs and "grad_norm" not in logs:
            return  # evaluation and end-of-training summaries
        window, self._window_losses = self._window_losses, []
        core = self.core
        row = core.pending_row if core.pending_row is not None else core.metrics(core.last_report)
        core.pending_row = None
        m = log_entries(row, window, True, NONFINITE_LOSS_STEPS)
        head = {k: v for k, v in m.items() if is_headline(k)}
        logs.update(head)  # what the Trainer prints and hands to every report_to integration
        if self.layer_metrics:  # per-layer values: to every report_to integration, not printed
            logs.update({k: v for k, v in m.items() if not is_headline(k)})
        hist = getattr(state, "log_history", None)
        if hist and hist[-1].get("step") == state.global_step and "loss" in hist[-1]:
            hist[-1].update(head)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is None:
            return
        if self._user_max_grad_norm is not None:
            args.max_grad_norm = self._user_max_grad_norm
        self._teardown()
        self._halt.finish()  # GradGuardHalt after the save, unless output.halt_raises is False

    def _teardown(self) -> None:
        self._control = self._tstate = None
        if self.runner is not None:
            self.runner.unwrap()
        if self._norm_shadow is not None:
            unshadow_method(self._norm_shadow[0], HF_NORM_METHOD, self._norm_shadow[1], self._norm_shadow[2])
            self._norm_shadow = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._held.release()
        if self.core is not None:
            self.summary = self.core.detach()

    # -- state -----------------------------------------------------------------------------
    def _checkpoint_dir(self, step: int) -> str:
        return os.path.join(self._args.output_dir, f"checkpoint-{step}")

    def _saving_step(self) -> int | None:
        """The step of the checkpoint the Trainer is writing now, else None. The Trainer serialises
        its callbacks' ``state()`` into ``trainer_state.json`` before it calls ``on_save``."""
        if self.core is None or self._tstate is None or self._control is None or not self._control.should_save:
            return None
        return int(self._tstate.global_step)

    def _export(self, saving: int | None = None) -> dict[str, Any]:
        if self.core is None or self.runner is None:
            return {}
        b = self._batches
        guard = (self.core.state_dict() if saving is None
                 else self.core.checkpoint_state(saving, [self._checkpoint_dir(saving)]))
        return {"guard": guard, **self.runner.state_dict(),
                **(b.state_dict() if b is not None else {"batch_size": None, "base_batch_size": None})}

    def state(self) -> dict[str, Any]:
        """``ExportableState``: saved into ``trainer_state.json`` with every checkpoint. The guard state
        of a checkpoint lists that checkpoint in its rollback tier (as ``gradguard_state.json`` does),
        so a run resumed from it has the state of the run that wrote it. ``args`` rebuild the
        callback when there is no user instance to restore into (see ``__new__``)."""
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics, "_from_checkpoint": True},
                "attributes": {"_resume_state": self._export(self._saving_step()) or None}}
