"""PyTorch Lightning adapter: ``Trainer(callbacks=[GradGuardCallback()])``.

Each hook is one call on the run object, :class:`gradguard._lightning.run.LightningRun` (the per-run
state); detection, policy, rollback and halting live in the core (:class:`gradguard.guard.GuardCore`).
Hook -> event and the Lightning plumbing: :mod:`gradguard._lightning`. ``gradguard.lightning`` serves
``lightning.pytorch`` (else ``pytorch_lightning``), ``gradguard.pytorch_lightning`` the standalone
``pytorch_lightning``; :func:`make_callback_class` builds the callback for any Lightning module object.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ._compat import pl_callbacks_being_validated
from ._lightning.run import LightningRun, adopt_unclaimed
from ._lightning.setup import LightningLoggerSink, check_unique_names, import_lightning
from .config import GuardConfig
from .errors import GradGuardHalt
from .sinks import Sink

__all__ = ["GradGuardCallback", "make_callback_class", "LightningLoggerSink", "GradGuardHalt"]


class _GradGuardMixin:
    """The adapter; combined with a Lightning ``Callback`` base by :func:`make_callback_class`."""

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
                else ``trainer.log_dir`` with a logger (its version folder) unless that is the working
                directory or a checkpoint folder (``default_root_dir``, a ``ModelCheckpoint.dirpath``);
                else no event log (one warning). Remote roots are written through fsspec. The rule:
                :mod:`gradguard.logdir`.
            layer_fn: parameter name -> layer name (see ``gradguard.measure.LayerMap``).
            log_to_loggers: write the core's metrics straight into the trainer's loggers at Lightning's
                step and cadence (event steps always), never through ``self.log`` (``logged_metrics``,
                ``callback_metrics`` and the progress bar keep only the user's values); alerts into a
                ``WandbLogger``'s run and a ``TensorBoardLogger``'s writer.
        """
        super().__init__()
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.name = name or ("default" if config.policy.act else "monitor")
        self.extra_sinks, self.out_dir, self.layer_fn = list(sinks or []), out_dir, layer_fn
        self.log_to_loggers = log_to_loggers
        self.run = LightningRun(config, sinks=self.extra_sinks, out_dir=out_dir, layer_fn=layer_fn,
                                log_to_loggers=log_to_loggers)  # the per-run state and what each hook does

    # -- what the run holds, read-only -------------------------------------------------------------
    core = property(lambda self: self.run.core, doc="The run's :class:`gradguard.guard.GuardCore` (None before fit).")
    last_report = property(lambda self: self.run.last_report, doc="The last step's :class:`gradguard.StepReport`.")
    reports = property(lambda self: self.run.reports, doc="The number of steps the guard has decided.")
    batches = property(lambda self: self.run.batches, doc="The train DataLoader's handle (batch size), if any.")
    data_skipped_steps = property(lambda self: self.run.data_skipped_steps, doc="Steps of skipped data windows.")
    halted = diagnosis = property(lambda self: self.run.halt.diagnosis, doc="The diagnosis of a halt (None without).")
    diagnosis_path = property(lambda self: self.run.diagnosis_path, doc="Where ``diagnosis.json`` was written.")
    oom_events = property(lambda self: self.run.oom_events, doc="Out-of-memory errors handled.")

    # -- identity, the checkpoint entry, pickling ---------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Lightning's check of Trainer(callbacks=...) reads state_key: gradguard's own, clearer error first
        check_unique_names(self, self.name, pl_callbacks_being_validated(), _GradGuardMixin)
        return self._generate_state_key(name=self.name)  # type: ignore[attr-defined]

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:  # callbacks added after the Trainer's init
        check_unique_names(self, self.name, getattr(trainer, "callbacks", None), _GradGuardMixin)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        adopt_unclaimed(self.state_key, type(self).__qualname__, trainer, checkpoint)  # states are loaded next

    def state_dict(self) -> dict[str, Any]:
        return self.run.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run.keep_pending(state_dict)  # applied in on_train_start: the optimizers do not exist yet

    def __getstate__(self) -> dict[str, Any]:  # torch.save(trainer), copy.deepcopy: LightningRun.pickled
        return self.run.pickled({"config": self.config, "name": self.name, "sinks": self.extra_sinks,
                                 "out_dir": self.out_dir, "layer_fn": self.layer_fn, "log_to_loggers": self.log_to_loggers})

    def __setstate__(self, saved: dict[str, Any]) -> None:
        _GradGuardMixin.__init__(self, **saved["init"])
        self.run.unpickled(saved)

    # -- hooks -> the run ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.run.start(trainer, pl_module, self.state_key)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.run.epoch_start()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.run.checkpoint_saved(trainer, checkpoint, self.state_key)

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
    doc = (_GradGuardMixin.__doc__ or "") + "\n\n" + (__doc__ or "")
    return type("GradGuardCallback", (_GradGuardMixin, pl.Callback),
                {"__module__": __name__, "__doc__": doc, "__qualname__": "GradGuardCallback"})


GradGuardCallback = make_callback_class(import_lightning())
