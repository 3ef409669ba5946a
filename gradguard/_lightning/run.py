"""One Lightning run of the guard: :class:`LightningRun` holds every piece of per-run state of the
Lightning callback (the core, the trainer, the step wrappers, the clip, the checkpoint entry, the
data window, the halt) and implements each hook; ``gradguard.lightning.GradGuardCallback`` only
calls it.

* FIT_START (:meth:`LightningRun.start`): refusals, standing aside without an optimizer over the
  module, the core built (or kept, when fit runs again with the same optimizer), the engine-side
  pieces attached (loader handle, checkpoint source, step wrappers, clip), the guard state of a
  resumed run applied.
* The optimizer-step boundary: the loss of each micro-batch (:meth:`observe_loss`), the decision
  before the optimizer step (:meth:`before_optimizer_step`: ``core.before_step``, or a step dropped:
  a data window skipped after a rollback, a step an out-of-memory error broke), and what follows
  the step (:meth:`after_optimizer_step`: ``core.after_step``, the logged row, the fp16 scale, the
  clip for the next step).
* The checkpoint entry (``checkpoint["callbacks"][state_key]``, :meth:`state_dict`: the core's state,
  its trust tier the one copy, and the data window): rewritten by :meth:`checkpoint_saved` so a
  checkpoint lists itself; restored entries are kept until the core exists (Lightning restores
  callback states before ``on_train_start``, when the optimizers do not exist yet); a pickled
  callback carries it (:meth:`pickled`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from .._compat import check_features, pl_log_step, pl_saving_checkpoint_path, pl_should_update_logs, scaler_scale
from ..act import unwrap_optimizer
from ..adapter import (
    HaltLatch,
    SchedulerHold,
    halt_raises,
    may_wrap,
    refuse_unsupported,
    restore_guard_state,
    stand_aside,
    unusable_resume_state,
)
from ..clip import LightningClip, check_ladder
from ..config import GuardConfig
from ..errors import StateError, warn
from ..guard import GuardCore, StepReport
from ..logdir import choose_log_dir
from ..policy import Action
from ..sinks import Sink
from ..state import check_resume_step
from .checkpoints import ModelCheckpointFiles
from .loader import TrainerLoader
from .setup import console_writer, live_sinks, nothing_to_watch, unsupported
from .steps import StepWrappers

__all__ = ["LightningRun", "ADAPTER_STATE_VERSION"]

ADAPTER_STATE_VERSION = 1


class LightningRun:
    """The per-run state of one Lightning ``GradGuardCallback`` and what each hook does with it."""

    def __init__(self, config: GuardConfig, *, sinks: list[Sink], out_dir: str | None, layer_fn: Any,
                 log_to_loggers: bool) -> None:
        self.config = config
        self.extra_sinks = sinks
        self.out_dir = out_dir
        self.layer_fn = layer_fn
        self.log_to_loggers = log_to_loggers
        self.trainer: Any = None
        self.core: GuardCore | None = None
        self.scaler: Any = None
        self.last_report: StepReport | None = None
        self.reports = 0
        self.batches: TrainerLoader | None = None
        self.steps = StepWrappers(self)
        self.clip = LightningClip()  # Lightning's gradient_clip_val for this run (gradguard.clip)
        self.ckpt_files = ModelCheckpointFiles("")
        self.halt = HaltLatch(halt_raises(config))
        self.pending_state: dict[str, Any] | None = None  # restored, applied once the core exists
        self.hook_handles: list[Any] = []
        self.in_opt_step = False  # on_before_optimizer_step fires inside optimizer.step()
        self.report: StepReport | None = None  # this step's, until the batch's end
        self.held = SchedulerHold()
        self.skip_left = 0  # optimizer steps of a data window still to skip (after a rollback)
        self.window_step = False  # this optimizer step's data is skipped
        self.stepped = False  # this batch closed an optimizer step of the guarded optimizer
        self.data_skipped_steps = 0

    @property
    def diagnosis_path(self) -> str | None:
        return self.core.diagnosis_path if self.core is not None else None

    @property
    def oom_events(self) -> int:
        return self.steps.oom.events if self.steps.oom is not None else 0

    # -- FIT_START ---------------------------------------------------------------------------------
    def start(self, trainer: Any, pl_module: Any, state_key: str) -> None:
        """FIT_START: refusals, standing aside without an optimizer over the module, the core built (or
        kept, when fit runs again with the same optimizer), the guard state of a resumed run applied."""
        log_dir = trainer.log_dir  # a collective under DDP: called on every rank
        self.trainer = trainer
        check_ladder(self.config)
        why = nothing_to_watch(trainer)
        if why is not None:
            if self.core is not None:
                self.teardown_core()
            stand_aside(why)
            return
        if not refuse_unsupported(self.config, unsupported(trainer)):
            return  # monitor mode on an unsupported setup: stand aside
        opt = unwrap_optimizer(trainer.optimizers[0])
        if len(trainer.optimizers) > 1:
            warn("gradguard: several optimizers: only the first one is guarded", stacklevel=3)
        if self.core is not None and self.core.optimizer is opt:
            self.clip.hand_to_lightning(trainer, self.core)
            self.attach(trainer, pl_module, state_key)
            return
        if self.core is not None:
            self.teardown_core()
        self.core = self.build_core(trainer, pl_module, opt, log_dir)
        # after the core's LR-multiplier hooks: tells whether the core's pre-hook already ran when
        # on_before_optimizer_step fires (Lightning runs the closure inside optimizer.step()).
        self.hook_handles = self.watch_optimizer_step(opt)
        self.attach(trainer, pl_module, state_key)
        one_counter = bool(pl_module.automatic_optimization) and len(trainer.optimizers) == 1  # global_step == guard steps
        if not self.apply_pending(trainer.global_step if one_counter else None):
            self.core.start_at(trainer.global_step)  # resumed without a guard state: follow global_step
        self.clip.hand_to_lightning(trainer, self.core)

    def build_core(self, trainer: Any, pl_module: Any, opt: Any, log_dir: Any) -> GuardCore:
        """The core on the LightningModule and ``opt``: ``gradient_clip_val`` as the starting clip (when
        the guard clips), one event log and console (rank 0), the trainer's loggers as sinks."""
        cfg = self.clip.resolve(self.config, trainer, pl_module)  # the clip rule, evaluated once per core
        rank0 = trainer.global_rank == 0
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
        core = GuardCore(pl_module, opt, config=cfg, sinks=sinks, out_dir=out_dir, layer_fn=self.layer_fn,
                         scheduler=sched, scaler=self.scaler, shard_root=trainer.strategy.model, engine="lightning")
        core.attach_data_skip(self.skip_data)
        core.set_engine_step(lambda _step: pl_log_step(trainer))  # the x of the user's self.log rows
        core.ratio_due = lambda _step: self.engine_logs(trainer) is True
        write = console_writer(trainer)
        if write is not None:
            core.set_console_writer(write)
        return core

    def watch_optimizer_step(self, opt: Any) -> list[Any]:
        """Hooks telling whether ``on_before_optimizer_step`` fires inside ``optimizer.step()`` (Lightning
        runs the closure there without a GradScaler); registered after the core's LR-multiplier hooks."""

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.in_opt_step = True

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.in_opt_step = False

        return [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]

    def attach(self, trainer: Any, pl_module: Any, state_key: str) -> None:
        """Plug the engine-side pieces in: loader handle, checkpoint source, step wrappers, clip takeover."""
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
                self.ckpt_files.state_key = state_key
                self.ckpt_files.bind(trainer, self.scaler, core.config.recovery.restore_schedule)
                core.attach_checkpoints(self.ckpt_files)
        self.steps.remove()
        if may_wrap(core.config):  # monitor mode wraps nothing
            self.steps.install(trainer, pl_module)
        self.clip.install(trainer, pl_module, core)

    # -- the end of fit ----------------------------------------------------------------------------
    def remove_wrappers(self) -> None:
        """The step wrappers and the clip takeover removed (the end of fit, an exception, teardown)."""
        self.steps.remove()
        self.clip.remove()

    def teardown_core(self) -> None:
        """The core detached and dropped, with every hook and wrapper the run installed."""
        for h in self.hook_handles:
            h.remove()
        self.hook_handles = []
        self.remove_wrappers()
        if self.core is not None:
            self.core.detach()
        self.core = None

    def close(self) -> None:
        if self.core is not None:
            self.core.close()

    def train_end(self) -> None:
        self.close()
        self.remove_wrappers()
        self.halt.finish()  # GradGuardHalt after the save, unless output.halt_raises is False

    def exception(self) -> None:
        self.remove_wrappers()
        self.close()

    def teardown(self) -> None:
        self.remove_wrappers()
        self.held.release()
        self.close()

    # -- per step ----------------------------------------------------------------------------------
    def epoch_start(self) -> None:
        if self.batches is not None:
            self.batches.epoch_start()

    def batch_start(self, trainer: Any, pl_module: Any, batch_idx: int) -> None:
        """A batch opening an optimizer step of a skipped data window counts down the window."""
        self.ckpt_files.resolve(trainer, self.core)
        acc = int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1
        if batch_idx % acc == 0:
            self.steps.open_step()  # recovery.oom_all_ranks under DDP: this step's backwards sync nothing
        if self.skip_left > 0 and batch_idx % acc == 0:  # a window counts optimizer steps
            self.skip_left -= 1
            self.window_step = True

    def observe_loss(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        """The micro-batch's loss for the core: Lightning's division by ``accumulate_grad_batches`` and
        the loss scale undone, without a host sync."""
        self.steps.restore_stash()  # gradients of a micro-batch retried in pieces (after Lightning's zero_grad)
        if self.core is None or self.window_step or self.steps.poisoned or not trainer.training:
            return
        value = loss.detach()
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
            value = value * trainer.accumulate_grad_batches
        scale = scaler_scale(self.scaler)
        if scale is not None:
            value = value.float() / scale.to(value.device)  # no host sync
        self.core.observe_loss(value)

    def before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Gradients accumulated, DDP-synced, unscaled, not yet clipped: the guard decides; a skipped
        step has its gradients dropped and the ``interval="step"`` schedulers held for that step."""
        core = self.core
        if core is None or unwrap_optimizer(optimizer) is not core.optimizer:
            return
        self.steps.restore_stash()
        self.stepped = True
        self.steps.close_step()  # recovery.oom_all_ranks under DDP: one vote, then the gradients averaged
        # without a GradScaler Lightning calls the closure (and so this hook) inside optimizer.step()
        with core.deciding_inside_step(self.in_opt_step):
            skip = self._drop_step() if self.window_step or self.steps.poisoned else self._decide(trainer, optimizer)
            if skip and pl_module.automatic_optimization:
                self.held = SchedulerHold([c.scheduler for c in trainer.lr_scheduler_configs
                                           if c.interval == "step" and not c.reduce_on_plateau])
                self.held.hold()  # Lightning steps the schedulers after every optimizer step, skipped or not
            self.clip.clipped(trainer)  # clipped by the core already: no second pass

    def _drop_step(self) -> bool:
        """A step of the data window skipped after a rollback, or one an out-of-memory error broke."""
        core = self.core
        assert core is not None
        core.discard_loss()
        core.drop_grads()
        if self.window_step:
            self.data_skipped_steps += 1
        core.discard_step()  # the guard's step count follows Lightning's global_step
        self.report = None
        return True

    def _decide(self, trainer: Any, optimizer: Any) -> bool:
        core = self.core
        assert core is not None
        engine = self.clip.engine_clip(trainer, optimizer)
        report = core.before_step(scaler=self.scaler, drop_on_skip=True, engine_clip=engine)
        self.clip.measured(core, engine, report)
        self.report = self.last_report = report
        self.reports += 1
        if report.halt:
            self.halt.trip(report.diagnosis)
            trainer.should_stop = True
        return report.skipped

    def batch_end(self, trainer: Any) -> None:
        """The end of a batch: after an optimizer step of the guarded optimizer, :meth:`after_optimizer_step`."""
        self.steps.end_batch()
        if self.core is None:
            return
        if self.stepped:  # an optimizer-step boundary (not accumulating, the guarded optimizer)
            self.after_optimizer_step(trainer)
        if self.batches is not None:
            self.batches.poll()

    def after_optimizer_step(self, trainer: Any) -> None:
        """The end of a batch that closed an optimizer step of the guarded optimizer: ``core.after_step``,
        its row sent to the loggers at Lightning's cadence, the fp16 scale the core wants kept put back."""
        self.stepped = False
        self.steps.restore_stash()
        self.held.release()
        core = self.core
        assert core is not None
        report, self.report = self.report, None
        if report is not None:
            core.after_step(report, engine_logs=self.engine_logs(trainer))
            row, core.pending_row = core.pending_row, None
            if row:  # Lightning's cadence, at its step for this batch: straight into each logger (not
                # through self.log, which would add gradguard's keys to the user's logged/callback metrics)
                core.send_live(report.step, row)
            core.keep_scale(report, self.scaler)  # the GradScaler updated inside the optimizer step
        self.window_step = False
        self.steps.poisoned = False
        self.clip.hand_to_lightning(trainer, core)

    def engine_logs(self, trainer: Any) -> bool | None:
        """Whether Lightning logs this batch's step metrics (None: the loggers are not used)."""
        if not (self.log_to_loggers and trainer.loggers):
            return None
        return pl_should_update_logs(trainer)

    def skip_data(self, action: Action) -> dict[str, Any]:
        """The core's data-skip action: the next ``batches`` optimizer steps' data is not trained on."""
        n = int(action.params.get("batches", 0))
        self.skip_left += n
        trainer = self.trainer
        automatic = trainer is not None and trainer.lightning_module.automatic_optimization
        if automatic and self.steps.wrapped:
            mode = ("the next optimizer steps' batches are drawn but not computed (training_step returns None)"
                    if trainer.world_size == 1 else
                    "the next optimizer steps' batches are drawn but not computed (a zero loss keeps DDP in step)")
        else:
            mode = "the next optimizer steps' batches run but their gradients are dropped"
        return {"mode": mode, "optimizer_steps": n}

    # -- the checkpoint entry ------------------------------------------------------------------------
    def checkpoint_saved(self, trainer: Any, checkpoint: dict[str, Any], state_key: str) -> None:
        """``on_save_checkpoint``: the file being written joins the trust tier, and the entry ``state_key``
        of ``checkpoint`` is written again (Lightning collects the callbacks' ``state_dict()`` before this
        hook), so the checkpoint lists itself: a run resumed from it keeps it in its rollback tier, as the
        run that wrote it does. Path not known (or no core): read from ``ModelCheckpoint`` at the next batch."""
        path = pl_saving_checkpoint_path(trainer)
        if self.core is None or path is None:
            self.ckpt_files.saved(trainer.global_step)
            return
        self.core.checkpoint_saved(trainer.global_step, [path])
        entries = checkpoint.get("callbacks")
        if isinstance(entries, dict) and state_key in entries:
            entries[state_key] = self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The entry: the core's state (its trust tier included: the one copy), the data window left to
        skip, the loader's micro-batch (a state restored but not applied yet is written back as it came)."""
        pending = self.pending_state or {}
        core_state = self.core.state_dict() if self.core is not None else pending.get("core")
        batches = self.batches.state_dict() if self.batches is not None else pending.get("batches")
        return {"version": ADAPTER_STATE_VERSION, "core": core_state, "skip_left": self.skip_left,
                "data_skipped_steps": self.data_skipped_steps, "batches": batches}

    def pickled(self, init: dict[str, Any]) -> dict[str, Any]:
        """What a pickled callback carries (``torch.save(trainer)``, ``copy.deepcopy``): its constructor
        arguments ``init`` and the guard's state (:meth:`state_dict`; None while there is none). The
        attached run (core, hooks, wrappers, the trainer) is not pickled: an unpickled callback attaches
        afresh and applies that state (:meth:`unpickled`)."""
        return {"init": init, "state": self.state_dict() if (self.core is not None or self.pending_state) else None}

    def unpickled(self, saved: dict[str, Any]) -> None:
        if saved.get("state") is not None:
            self.keep_pending(saved["state"])

    def keep_pending(self, state_dict: dict[str, Any]) -> None:
        """Keep a restored entry until the core exists (applied at once when it does)."""
        self.pending_state = copy.deepcopy(state_dict)
        if self.core is not None:
            self.apply_pending()

    def apply_pending(self, engine_step: int | None = None) -> bool:
        """Apply the state restored from the checkpoint (True when a guard state was applied). One that
        cannot be used: ``StateError`` when acting (the core torn down), a warning and a fresh guard in
        monitor mode. ``engine_step``: the Trainer's global step resumed at; a guard state saved at
        another step (another checkpoint's) cannot be used either."""
        st, self.pending_state = self.pending_state, None
        if not st or self.core is None:
            return False
        try:
            if engine_step is not None and st.get("core") is not None:
                try:
                    check_resume_step(st["core"], engine_step, "the checkpoint's GradGuardCallback entry")
                except StateError as exc:
                    unusable_resume_state(self.config, exc)  # raises when the policy acts
                    return False
            usable = restore_guard_state(self.core, self.config, st.get("core"))
        except StateError:
            self.teardown_core()
            raise
        if not usable:
            return False
        self.skip_left = int(st.get("skip_left", 0))
        self.data_skipped_steps = int(st.get("data_skipped_steps", 0))
        if st.get("batches") and self.batches is not None:
            self.batches.load_state_dict(st["batches"])
            # the LR's linear scaling follows the batch the run resumes with
            self.core.lr.batch_scale = self.batches.batch_size / self.batches.base_batch_size
        return st.get("core") is not None


def adopt_unclaimed(state_key: str, class_name: str, trainer: Any, checkpoint: dict[str, Any]) -> None:
    """No entry under this guard's key, but exactly one guard entry no other guard of this Trainer
    claims (a guard resumed in the other mode, whose key differs): adopt it."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict) or state_key in states:
        return
    prefix = class_name + "{"
    claimed = {getattr(other, "state_key", None) for other in getattr(trainer, "callbacks", [])}
    free = [k for k in states if isinstance(k, str) and k.startswith(prefix) and k not in claimed]
    if len(free) == 1:
        states[state_key] = states[free[0]]
