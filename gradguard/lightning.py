"""PyTorch Lightning adapter: ``Trainer(callbacks=[GradGuardCallback()])``.

The callback translates Lightning's hooks into the engine contract's events
(:class:`gradguard.contract.Event`) and calls :class:`gradguard.guard.GuardCore`; detection, policy,
trust tier, rollback loop, halting and the clip/refusal rules live in the core
(:mod:`gradguard.recovery`, :mod:`gradguard.adapter`). Lightning plumbing lives beside this file in
``gradguard/_lightning/``: the DataLoader as loader handle (``loader.py``), the ``ModelCheckpoint``
files as checkpoint source (``checkpoints.py``), the step wrappers (``steps.py``).

Hook -> event (automatic optimization, Lightning 2.4+):

* ``on_train_start`` -> FIT_START: refusals (DeepSpeed/FSDP strategies), standing aside without an
  optimizer over the module (Lightning's mock optimizer: one warning), the clip rule
  (``gradient_clip_val`` becomes the guard's starting ``clip.max_norm``), the core on the
  LightningModule and the first optimizer, the guard state of a resumed run (RESUME); the loader
  handle, the checkpoint source and (when the policy acts) the step wrappers are attached.
* ``on_train_epoch_start`` -> EPOCH_START; ``on_train_batch_start`` -> STEP_START (a data window
  skipped after a rollback: ``training_step`` returns None, no forward/backward).
* ``on_before_backward(loss)`` -> MICRO_LOSS (Lightning's division by ``accumulate_grad_batches``
  and the loss scale are undone, without a sync).
* ``on_before_optimizer_step`` -> BEFORE_OPTIMIZER_STEP (gradients accumulated, DDP-synced,
  unscaled, not yet clipped): ``core.before_step``; a skipped step has its gradients dropped and the
  ``interval="step"`` schedulers held for that step.
* ``on_train_batch_end`` (accumulation boundary) -> AFTER_OPTIMIZER_STEP: ``core.after_step``, the
  fp16 scale the core wants kept is put back, pending micro-batch changes apply.
* ``on_save_checkpoint`` -> CHECKPOINT_SAVED (the file being written, read from ``Trainer.save_checkpoint``;
  the checkpoint's own guard state lists it); ``on_train_end`` -> FIT_END (after a halt:
  :class:`gradguard.GradGuardHalt`, unless ``output.halt_raises`` is False).

Use ``gradguard.lightning`` with ``lightning.pytorch`` (falls back to ``pytorch_lightning`` when only
that is installed) and ``gradguard.pytorch_lightning`` with the standalone ``pytorch_lightning``
package; :func:`make_callback_class` builds the callback for any Lightning module object.
"""

from __future__ import annotations

import copy
import dataclasses
from types import ModuleType
from typing import Any

import torch

from ._compat import check_features, pl_log_step, pl_saving_checkpoint_path, pl_should_update_logs, scaler_scale
from ._lightning.checkpoints import ModelCheckpointFiles
from ._lightning.clip import ClipTakeover
from ._lightning.loader import TrainerLoader
from ._lightning.setup import LightningLoggerSink, console_writer, live_sinks, nothing_to_watch, unsupported
from ._lightning.steps import StepWrappers
from .act import unwrap_optimizer
from .adapter import (
    HaltLatch,
    SchedulerHold,
    check_ladder,
    halt_raises,
    may_wrap,
    refuse_unsupported,
    resolve_clip,
    stand_aside,
    unusable_resume_state,
)
from .config import GuardConfig
from .errors import GradGuardHalt, StateError, warn
from .guard import GuardCore, StepReport
from .logdir import choose_log_dir
from .policy import Action
from .sinks import Sink

__all__ = ["GradGuardCallback", "make_callback_class", "LightningLoggerSink", "GradGuardHalt"]

ADAPTER_STATE_VERSION = 1


class _GradGuardMixin:
    """The adapter logic; combined with a Lightning ``Callback`` base by :func:`make_callback_class`."""

    def __init__(self, config: GuardConfig | None = None, *, name: str | None = None,
                 sinks: list[Sink] | None = None, out_dir: str | None = None, layer_fn: Any = None,
                 log_to_loggers: bool = True) -> None:
        """
        Args:
            config: the guard's configuration (default ``GuardConfig()``).
            name: the key of the guard's state in Lightning checkpoints (``state_key``); stable across
                config changes, so a run resumed with another config gets its guard state back (see
                :mod:`gradguard.resume` for which changes take effect). Default ``"default"``
                (``"monitor"`` for a guard that only watches, so one of each fits in a Trainer).
            sinks: extra sinks (on global rank 0 only).
            out_dir: folder of the JSONL log (``<out_dir>/gradguard/``); default ``config.output.dir``,
                else ``trainer.log_dir`` (the logger's version folder); without a logger, or when
                that folder is the working directory or a checkpoint folder (``default_root_dir``,
                where Lightning writes its HPC checkpoints, or a ``ModelCheckpoint.dirpath``), no
                event log (one warning). Remote roots (``memory://``, ``s3://``) are written
                through fsspec. The rule: :mod:`gradguard.logdir`.
            layer_fn: parameter name -> layer name (see ``gradguard.measure.LayerMap``).
            log_to_loggers: send the core's metrics to the trainer's loggers: the regular rows with
                ``pl_module.log_dict`` (Lightning's ``log_every_n_steps`` and step, next to the
                user's ``self.log``), the rows of event steps Lightning does not log straight into
                each logger at Lightning's step for that batch, alerts into a ``WandbLogger``'s run
                (``run.alert``) and a ``TensorBoardLogger``'s writer (text).
        """
        super().__init__()
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.name = name or ("default" if config.policy.act else "monitor")
        self.extra_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.layer_fn = layer_fn
        self.log_to_loggers = log_to_loggers
        self.core: GuardCore | None = None
        self.scaler: Any = None
        self.last_report: StepReport | None = None
        self.reports: int = 0
        self.batches: TrainerLoader | None = None
        self.steps = StepWrappers(self)
        self.clip_takeover = ClipTakeover()  # monitor mode: Lightning's norm clip replayed from the guard's pass
        self.ckpt_files = ModelCheckpointFiles("")
        self._halt = HaltLatch(halt_raises(config))
        self._pending_state: dict[str, Any] | None = None
        self._trainer: Any = None
        self._manage_clip = False
        self._hook_handles: list[Any] = []
        self._in_opt_step = False
        self._report: StepReport | None = None
        self._held = SchedulerHold()
        self._skip_left = 0
        self._window_step = False
        self._stepped = False
        self.data_skipped_steps = 0

    # -- names kept from earlier versions ------------------------------------------------------------
    @property
    def halted(self) -> dict[str, Any] | None:
        """The diagnosis of a halt (None while training runs normally)."""
        return self._halt.diagnosis

    diagnosis = halted

    @property
    def diagnosis_path(self) -> str | None:
        return self.core.diagnosis_path if self.core is not None else None

    @property
    def oom_events(self) -> int:
        return self.steps.oom.events if self.steps.oom is not None else 0

    @property
    def _poisoned(self) -> bool:
        return self.steps._poisoned

    @_poisoned.setter
    def _poisoned(self, value: bool) -> None:
        self.steps._poisoned = value

    # -- identity / checkpoint state --------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)  # type: ignore[attr-defined]

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """No entry under this guard's key, but exactly one guard entry no other guard of this
        Trainer claims (a checkpoint of gradguard <= 0.1, keyed by a hash of the config, or a guard
        resumed in the other mode): adopt it. Lightning loads callback states right after this."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict) or self.state_key in states:
            return
        prefix = type(self).__qualname__ + "{"
        claimed = {getattr(cb, "state_key", None) for cb in getattr(trainer, "callbacks", [])}
        free = [k for k in states if isinstance(k, str) and k.startswith(prefix) and k not in claimed]
        if len(free) == 1:
            states[self.state_key] = states[free[0]]

    def state_dict(self) -> dict[str, Any]:
        pending = self._pending_state or {}
        core_state = self.core.state_dict() if self.core is not None else pending.get("core")
        batches = self.batches.state_dict() if self.batches is not None else pending.get("batches")
        checkpoints = self.core.checkpoint_tier.state_dict() if self.core is not None else pending.get("checkpoints")
        return {"version": ADAPTER_STATE_VERSION, "core": core_state, "skip_left": self._skip_left,
                "data_skipped_steps": self.data_skipped_steps, "batches": batches, "checkpoints": checkpoints}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before the optimizers exist: applied in on_train_start.
        self._pending_state = copy.deepcopy(state_dict)
        if self.core is not None:
            self._apply_pending()

    def _apply_pending(self) -> bool:
        """Apply the state restored from the checkpoint (True when a guard state was applied). One
        that cannot be used: ``StateError`` when acting, a warning and a fresh guard in monitor mode."""
        st, self._pending_state = self._pending_state, None
        if not st or self.core is None:
            return False
        if st.get("core") is not None:
            try:
                self.core.load_state_dict(st["core"])  # validated whole first: a StateError changed nothing
            except StateError as exc:
                try:
                    unusable_resume_state(self.config, exc)
                except StateError:
                    self._teardown_core()
                    raise
                return False
        if st.get("checkpoints") is not None and "checkpoints" not in (st.get("core") or {}):
            self.core.checkpoint_tier.load_state_dict(st["checkpoints"])  # written by gradguard <= 0.1
        self._skip_left = int(st.get("skip_left", 0))
        self.data_skipped_steps = int(st.get("data_skipped_steps", 0))
        if st.get("batches") and self.batches is not None:
            self.batches.load_state_dict(st["batches"])
        return st.get("core") is not None

    # -- lifecycle -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        log_dir = trainer.log_dir  # a collective under DDP: called on every rank
        self._trainer = trainer
        check_ladder(self.config)
        why = nothing_to_watch(trainer)
        if why is not None:
            if self.core is not None:
                self._teardown_core()
            stand_aside(why)
            return
        if not refuse_unsupported(self.config, unsupported(trainer)):
            return  # monitor mode on an unsupported setup: stand aside
        opt = unwrap_optimizer(trainer.optimizers[0])
        if len(trainer.optimizers) > 1:
            warn("gradguard: several optimizers: only the first one is guarded", stacklevel=2)
        if self.core is not None and self.core.optimizer is opt:
            self._setup_clip(trainer)
            self._attach(trainer, pl_module)
            return
        if self.core is not None:
            self._teardown_core()
        cfg = self.config
        rank0 = trainer.global_rank == 0
        self._manage_clip = bool(cfg.policy.act and cfg.clip.mode != "off" and pl_module.automatic_optimization)
        if self._manage_clip:
            algo = str(trainer.gradient_clip_algorithm or "norm").lower()
            value = trainer.gradient_clip_val if algo.endswith("norm") else None
            cfg, _ = resolve_clip(cfg, value, engine_default=None, setting="Trainer(gradient_clip_val)")
        if not rank0:  # one event log and one console per run
            cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False, console=False))
        sinks: list[Sink] = []
        if rank0:
            sinks = list(self.extra_sinks)
            if self.log_to_loggers and trainer.loggers:
                sinks.extend(live_sinks(trainer, sinks))
        out_dir = None
        if cfg.output.jsonl:  # rank 0: where the engine keeps its logs (gradguard.logdir)
            # without a logger Lightning keeps no log folder: default_root_dir is where its HPC
            # checkpoints (hpc_ckpt_*.ckpt) go, so it counts as a checkpoint folder
            out_dir = choose_log_dir(self.out_dir or cfg.output.dir, [log_dir if trainer.loggers else None],
                                     engine="Lightning", how_to_name="GradGuardCallback(out_dir=...)",
                                     checkpoint_dirs=[trainer.default_root_dir,
                                                      *(getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks)])
            if out_dir is None:
                cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False))
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self.core = GuardCore(pl_module, opt, config=cfg, sinks=sinks, out_dir=out_dir, layer_fn=self.layer_fn,
                              scheduler=sched, scaler=self.scaler)
        self.core.attach_data_skip(self._skip_data)
        self.core.set_engine_step(lambda _step: pl_log_step(trainer))  # the x of the user's self.log rows
        self.core.ratio_due = lambda _step: self._engine_logs(trainer) is True
        write = console_writer(trainer)
        if write is not None:
            self.core.set_console_writer(write)
        # after the core's LR-multiplier hooks: tells whether the core's pre-hook already ran when
        # on_before_optimizer_step fires (Lightning runs the closure inside optimizer.step()).
        self._hook_handles = [opt.register_step_pre_hook(self._pre_hook),
                              opt.register_step_post_hook(self._post_hook)]
        self._attach(trainer, pl_module)
        if not self._apply_pending():
            self.core.start_at(trainer.global_step)  # resumed without a guard state: follow global_step
        self._setup_clip(trainer)

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        """Plug the engine-side pieces in: loader handle, checkpoint source, step wrappers."""
        core = self.core
        assert core is not None
        self.batches = None
        missing = check_features("lightning", trainer)
        if core.config.policy.act:
            sampler = TrainerLoader.find_sampler(trainer) if "batch_resize" not in missing else None
            if sampler is not None:
                self.batches = TrainerLoader(trainer, sampler)
                self.batches.make_live()
                core.attach_batches(self.batches)
            if getattr(trainer, "checkpoint_callbacks", None) and "checkpoint_rollback" not in missing:
                self.ckpt_files.state_key = self.state_key
                self.ckpt_files.bind(trainer, self.scaler, core.config.recovery.restore_schedule)
                core.attach_checkpoints(self.ckpt_files)
        self.steps.remove()
        if may_wrap(core.config):  # monitor mode wraps nothing
            self.steps.install(trainer, pl_module)
        self.clip_takeover.install(trainer, pl_module, core)

    def _setup_clip(self, trainer: Any) -> None:
        if self._manage_clip and self.core is not None:
            trainer.gradient_clip_val = self.core.max_grad_norm
            trainer.gradient_clip_algorithm = "norm"

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.batches is not None:
            self.batches.epoch_start()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Lightning collects the callbacks' state_dict() before this hook: the file being written is
        # recorded in the trust tier now and this callback's entry of the checkpoint is written again,
        # so the checkpoint lists itself (a run resumed from it keeps it in its rollback tier, as the
        # run that wrote it does)
        path = pl_saving_checkpoint_path(trainer)
        if self.core is None or path is None:
            self.ckpt_files.saved(trainer.global_step)  # paths known at the next batch (ModelCheckpoint's record)
            return
        self.core.checkpoint_saved(trainer.global_step, [path])
        entries = checkpoint.get("callbacks")
        if isinstance(entries, dict) and self.state_key in entries:
            entries[self.state_key] = self.state_dict()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.core is not None:
            self.core.close()
        self.steps.remove()
        self.clip_takeover.remove()
        self._halt.finish()  # GradGuardHalt after the save, unless output.halt_raises is False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.remove()
        self.clip_takeover.remove()
        if self.core is not None:
            self.core.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.steps.remove()
            self.clip_takeover.remove()
            self._held.release()
            if self.core is not None:
                self.core.close()

    def _teardown_core(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self.steps.remove()
        self.clip_takeover.remove()
        if self.core is not None:
            self.core.detach()
        self.core = None

    # -- per step --------------------------------------------------------------------------
    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = True

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.ckpt_files.resolve(trainer, self.core)
        acc = int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1
        if self._skip_left > 0 and batch_idx % acc == 0:  # a window counts optimizer steps
            self._skip_left -= 1
            self._window_step = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.steps.restore_stash()  # gradients of a micro-batch retried in pieces (after Lightning's zero_grad)
        if self.core is None or self._window_step or self._poisoned or not trainer.training:
            return
        value = loss.detach()
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
            value = value * trainer.accumulate_grad_batches
        scale = scaler_scale(self.scaler)
        if scale is not None:
            value = value.float() / scale.to(value.device)  # no host sync
        self.core.observe_loss(value)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        core = self.core
        if core is None or unwrap_optimizer(optimizer) is not core.optimizer:
            return
        self.steps.restore_stash()
        self._stepped = True
        # without a GradScaler Lightning calls the closure (and so this hook) inside optimizer.step()
        with core.deciding_inside_step(self._in_opt_step):
            if self._window_step or self._poisoned:
                # a step of the data window skipped after a rollback, or one an out-of-memory error broke
                core.discard_loss()
                core.drop_grads()
                if self._window_step:
                    self.data_skipped_steps += 1
                core.discard_step()  # the guard's step count follows Lightning's global_step
                skip = True
                self._report = None
            else:
                engine = self.clip_takeover.engine_clip(trainer, optimizer)
                report = core.before_step(scaler=self.scaler, drop_on_skip=True, engine_clip=engine)
                self.clip_takeover.measured(core, engine, report)
                self._report = self.last_report = report
                self.reports += 1
                if report.halt:
                    self._halt.trip(report.diagnosis)
                    trainer.should_stop = True
                skip = report.skipped
            if skip and pl_module.automatic_optimization:
                self._held = SchedulerHold([c.scheduler for c in trainer.lr_scheduler_configs
                                            if c.interval == "step" and not c.reduce_on_plateau])
                self._held.hold()  # Lightning steps the schedulers after every optimizer step, skipped or not
            if self._manage_clip:
                trainer.gradient_clip_val = None  # clipped by the core already: no second pass

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps._current = None
        core = self.core
        if core is None:
            return
        if self._stepped:  # an optimizer-step boundary (not accumulating, the guarded optimizer)
            self._stepped = False
            self.steps.restore_stash()
            self._held.release()
            report, self._report = self._report, None
            if report is not None:
                core.after_step(report, engine_logs=self._engine_logs(trainer))
                row, core.pending_row = core.pending_row, None
                if row:  # Lightning's cadence and step, in the same row as the user's self.log
                    pl_module.log_dict(row, on_step=True, on_epoch=False, prog_bar=False, logger=True,
                                       batch_size=1)
                core.keep_scale(report, self.scaler)  # the GradScaler updated inside the optimizer step
            self._window_step = False
            self._poisoned = False
            self._setup_clip(trainer)
        if self.batches is not None:
            self.batches.poll()

    def _engine_logs(self, trainer: Any) -> bool | None:
        """Whether Lightning logs this batch's step metrics (None: the loggers are not used)."""
        if not (self.log_to_loggers and trainer.loggers):
            return None
        return pl_should_update_logs(trainer)

    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        self._skip_left += n
        trainer = self._trainer
        automatic = trainer is not None and trainer.lightning_module.automatic_optimization
        if automatic and self.steps._wrapped:
            mode = ("the next optimizer steps' batches are drawn but not computed (training_step returns None)"
                    if trainer.world_size == 1 else
                    "the next optimizer steps' batches are drawn but not computed (a zero loss keeps DDP in step)")
        else:
            mode = "the next optimizer steps' batches run but their gradients are dropped"
        return {"mode": mode, "optimizer_steps": n}


def make_callback_class(pl: ModuleType) -> type:
    """``GradGuardCallback`` for a Lightning package: ``lightning.pytorch`` or ``pytorch_lightning``."""
    base = pl.Callback
    doc = (_GradGuardMixin.__doc__ or "") + "\n\n" + (__doc__ or "")
    return type("GradGuardCallback", (_GradGuardMixin, base),
                {"__module__": __name__, "__doc__": doc, "__qualname__": "GradGuardCallback"})


def _import_lightning() -> ModuleType:
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[no-redef]
        except ImportError as exc:
            raise ImportError("gradguard.lightning needs Lightning: pip install 'gradguard[lightning]' "
                              "(or pytorch-lightning)") from exc
    return pl


GradGuardCallback = make_callback_class(_import_lightning())
