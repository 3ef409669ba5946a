"""PyTorch Lightning adapter: ``Trainer(callbacks=[GradGuardCallback()])``.

The callback translates Lightning's hooks into the engine contract's events
(:class:`gradguard.contract.Event`) and calls :class:`gradguard.guard.GuardCore`; detection, policy,
trust tier, rollback loop, halting and the clip/refusal rules live in the core
(:mod:`gradguard.recovery`, :mod:`gradguard.adapter`, :mod:`gradguard.clip`). This file only maps hooks
to methods of the run object, :class:`gradguard._lightning.run.LightningRun`, which holds the per-run
state (FIT_START, attach and teardown, the optimizer-step boundary, the checkpoint entry and its
restore); Lightning plumbing lives beside it in ``gradguard/_lightning/``: setup checks and logger
sinks (``setup.py``), the DataLoader as loader handle (``loader.py``), the ``ModelCheckpoint`` files as checkpoint source
(``checkpoints.py``), the step wrappers (``steps.py``); Lightning's clip: :class:`gradguard.clip.LightningClip`.

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

from types import ModuleType
from typing import Any

import torch

from ._compat import pl_callbacks_being_validated, pl_saving_checkpoint_path
from ._lightning.run import LightningRun, adopt_unclaimed
from ._lightning.setup import LightningLoggerSink, check_unique_names
from ._lightning.steps import StepWrappers
from .config import GuardConfig
from .errors import GradGuardHalt
from .guard import GuardCore, StepReport
from .sinks import Sink

__all__ = ["GradGuardCallback", "make_callback_class", "LightningLoggerSink", "GradGuardHalt"]


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
            log_to_loggers: send the core's metrics to the trainer's loggers, straight into each
                logger at Lightning's step for that batch (the x of the user's ``self.log`` values):
                the regular rows at Lightning's cadence (``log_every_n_steps``), the rows of event
                steps whatever the cadence; never through ``self.log``, so ``trainer.logged_metrics``,
                ``callback_metrics`` and the progress bar hold only the user's values; alerts into a ``WandbLogger``'s run
                (``run.alert``) and a ``TensorBoardLogger``'s writer (text).
        """
        super().__init__()
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.name = name or ("default" if config.policy.act else "monitor")
        self.extra_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.layer_fn = layer_fn
        self.log_to_loggers = log_to_loggers
        #: every piece of per-run state, and what each hook does (gradguard._lightning.run)
        self.run = LightningRun(config, sinks=self.extra_sinks, out_dir=out_dir, layer_fn=layer_fn,
                                log_to_loggers=log_to_loggers)

    # -- what the run holds, read-only -------------------------------------------------------------
    @property
    def core(self) -> GuardCore | None:
        return self.run.core

    @property
    def scaler(self) -> Any:
        return self.run.scaler

    @property
    def last_report(self) -> StepReport | None:
        return self.run.last_report

    @property
    def reports(self) -> int:
        return self.run.reports

    @property
    def batches(self) -> Any:
        return self.run.batches

    @property
    def steps(self) -> StepWrappers:
        return self.run.steps

    @property
    def data_skipped_steps(self) -> int:
        return self.run.data_skipped_steps

    @property
    def halted(self) -> dict[str, Any] | None:
        """The diagnosis of a halt (None while training runs normally)."""
        return self.run.halt.diagnosis

    diagnosis = halted

    @property
    def diagnosis_path(self) -> str | None:
        return self.core.diagnosis_path if self.core is not None else None

    @property
    def oom_events(self) -> int:
        return self.run.steps.oom.events if self.run.steps.oom is not None else 0

    # -- identity / checkpoint state ------------------------------------------------------------------
    _gradguard_callback = True  # marks the guard callbacks (check_unique_names)

    @property
    def state_key(self) -> str:
        # Lightning's check of Trainer(callbacks=...) reads state_key: gradguard's own, clearer error first
        check_unique_names(self, self.name, pl_callbacks_being_validated())
        return self._generate_state_key(name=self.name)  # type: ignore[attr-defined]

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        check_unique_names(self, self.name, getattr(trainer, "callbacks", None))  # callbacks added after the Trainer's init

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Adopt the one unclaimed guard entry of an older checkpoint; Lightning loads callback states
        right after this."""
        adopt_unclaimed(self.state_key, type(self).__qualname__, trainer, checkpoint)

    def state_dict(self) -> dict[str, Any]:
        return self.run.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run.keep_pending(state_dict)  # applied in on_train_start: the optimizers do not exist yet

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``torch.save(trainer)``, ``copy.deepcopy``) keeps the callback as constructed
        and the guard's state (:meth:`state_dict`); the attached run (core, hooks, wrappers, the
        trainer) is not pickled: an unpickled callback attaches afresh and applies that state."""
        return {"init": {"config": self.config, "name": self.name, "sinks": self.extra_sinks,
                         "out_dir": self.out_dir, "layer_fn": self.layer_fn,
                         "log_to_loggers": self.log_to_loggers},
                "state": self.state_dict() if (self.core is not None or self.run.pending_state) else None}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        _GradGuardMixin.__init__(self, **saved["init"])
        if saved.get("state") is not None:
            self.load_state_dict(saved["state"])

    # -- hooks -> the run ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.run.start(trainer, pl_module, self.state_key)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run.batches is not None:
            self.run.batches.epoch_start()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Lightning collects the callbacks' state_dict() before this hook: the file being written is
        # recorded in the trust tier now and this callback's entry of the checkpoint is written again,
        # so the checkpoint lists itself (a run resumed from it keeps it in its rollback tier, as the
        # run that wrote it does)
        if not self.run.checkpoint_saved(trainer, pl_saving_checkpoint_path(trainer)):
            return
        entries = checkpoint.get("callbacks")
        if isinstance(entries, dict) and self.state_key in entries:
            entries[self.state_key] = self.state_dict()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.run.train_end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.run.exception()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.run.teardown()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.run.batch_start(trainer, pl_module, batch_idx)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.run.observe_loss(trainer, pl_module, loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.run.before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.run.batch_end(trainer)


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
