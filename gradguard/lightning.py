"""PyTorch Lightning adapter: ``Trainer(callbacks=[GradGuardCallback()])``.

The callback only translates Lightning's hooks into :class:`gradguard.guard.GuardCore` calls; the
detection, the policy and every action live in the core.

Hook mapping (automatic optimization, Lightning 2.4+):

* ``on_train_start``: builds the core on the LightningModule and the first optimizer (after a
  checkpoint restore, so the guard state of a resumed run is loaded into it), the scheduler and
  GradScaler of the run, a DDP all-reduce as the core's ``reduce``.
* ``on_before_backward(loss)``: records the micro-batch loss (Lightning passes it divided by
  ``accumulate_grad_batches`` and multiplied by the loss scale: both are undone, without a sync).
* ``on_before_optimizer_step``: gradients are accumulated, DDP-synced, unscaled, not yet clipped:
  ``core.before_step`` measures, decides, clips, acts; a skipped step has its gradients dropped
  (the optimizer step becomes a no-op: weights, Adam moments and step count untouched) and the
  ``interval="step"`` schedulers are held for that step.
* ``on_train_batch_end`` (accumulation boundary): releases the held schedulers, ``core.after_step``.

Use ``gradguard.lightning`` with ``lightning.pytorch`` (falls back to ``pytorch_lightning`` when only
that is installed) and ``gradguard.pytorch_lightning`` with the standalone ``pytorch_lightning``
package; :func:`make_callback_class` builds the callback for any Lightning module object.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from .act import drop_grads, unwrap_optimizer
from .config import GuardConfig
from .guard import GradGuardHalt, GuardCore, StepReport
from .policy import Action
from .sinks import Sink

__all__ = ["GradGuardCallback", "make_callback_class", "LightningLoggerSink", "GradGuardHalt"]

ADAPTER_STATE_VERSION = 1


class LightningLoggerSink(Sink):
    """Forwards the core's metrics to every logger of the trainer (CSV, TensorBoard, W&B...)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for lg in self.trainer.loggers:
            lg.log_metrics(dict(metrics), step=self.trainer.global_step)


def _ddp_mean(packed: torch.Tensor) -> torch.Tensor:
    """One all-reduce (sum, then divide) of the step's packed measurements: identical values, and so
    identical decisions, on every rank. Non-finite values propagate to every rank."""
    world = torch.distributed.get_world_size()
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM)
    return packed / world


class _GradGuardMixin:
    """The adapter logic; combined with a Lightning ``Callback`` base by :func:`make_callback_class`."""

    def __init__(self, config: GuardConfig | None = None, *, name: str | None = None,
                 sinks: list[Sink] | None = None, out_dir: str | None = None, layer_fn: Any = None,
                 log_to_loggers: bool = True) -> None:
        """
        Args:
            config: the guard's configuration (default ``GuardConfig()``).
            name: distinguishes the checkpoint state of several guards; default a hash of the config.
            sinks: extra sinks (on global rank 0 only).
            out_dir: folder of the JSONL log (``<out_dir>/gradguard/``); default ``config.output.dir``,
                else ``trainer.log_dir`` (the logger's version folder), else ``default_root_dir``.
            layer_fn: parameter name -> layer name (see ``gradguard.measure.LayerMap``).
            log_to_loggers: send the core's metrics to the trainer's loggers.
        """
        super().__init__()
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.name = name or hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str)
                                         .encode()).hexdigest()[:10]
        self.extra_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.layer_fn = layer_fn
        self.log_to_loggers = log_to_loggers
        self.core: GuardCore | None = None
        self.scaler: Any = None
        self.last_report: StepReport | None = None
        self.reports: int = 0
        self.halted: dict[str, Any] | None = None
        self.diagnosis_path: str | None = None
        self._pending_state: dict[str, Any] | None = None
        self._trainer: Any = None
        self._manage_clip = False
        self._hook_handles: list[Any] = []
        self._in_opt_step = False
        self._report: StepReport | None = None
        self._held: list[tuple[Any, dict[str, Any], list[float]]] = []
        self._skip_left = 0
        self._window_step = False
        self._stepped = False
        self.data_skipped_steps = 0

    # -- identity / checkpoint state --------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        core_state = self.core.state_dict() if self.core is not None else (
            (self._pending_state or {}).get("core"))
        return {"version": ADAPTER_STATE_VERSION, "core": core_state, "skip_left": self._skip_left,
                "data_skipped_steps": self.data_skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before the optimizers exist: applied in on_train_start.
        self._pending_state = copy.deepcopy(state_dict)
        if self.core is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        st, self._pending_state = self._pending_state, None
        if not st:
            return
        if st.get("core") is not None and self.core is not None:
            self.core.load_state_dict(st["core"])
        self._skip_left = int(st.get("skip_left", 0))
        self.data_skipped_steps = int(st.get("data_skipped_steps", 0))

    # -- lifecycle -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.optimizers:
            raise ValueError("gradguard: the trainer has no optimizer. Fix: return one from configure_optimizers")
        opt = unwrap_optimizer(trainer.optimizers[0])
        if len(trainer.optimizers) > 1:
            warnings.warn("gradguard: several optimizers: only the first one is guarded", stacklevel=2)
        log_dir = trainer.log_dir  # a collective under DDP: called on every rank
        if self.core is not None and self.core.optimizer is opt:
            self._setup_clip(trainer)
            return
        if self.core is not None:
            self._teardown_core()
        cfg = self.config
        rank0 = trainer.global_rank == 0
        self._manage_clip = bool(cfg.policy.act and cfg.clip.mode != "off" and pl_module.automatic_optimization)
        if self._manage_clip and trainer.gradient_clip_val:
            algo = str(trainer.gradient_clip_algorithm or "norm").lower()
            if algo.endswith("norm"):
                val = float(trainer.gradient_clip_val)
                if val != cfg.clip.max_norm:
                    warnings.warn(f"gradguard: Trainer(gradient_clip_val={val:g}) becomes the guard's clip.max_norm "
                                  "(the guard owns norm clipping and tightens/relaxes it)", stacklevel=2)
                    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(
                        cfg.clip, max_norm=val, floor=min(cfg.clip.floor, val)))
        if not rank0:  # one event log and one console per run
            cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False, console=False))
        sinks: list[Sink] = []
        if rank0:
            sinks = list(self.extra_sinks)
            if self.log_to_loggers and trainer.loggers:
                sinks.append(LightningLoggerSink(trainer))
        out_dir = self.out_dir or cfg.output.dir or log_dir or trainer.default_root_dir
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        reduce = _ddp_mean if (trainer.world_size > 1 and torch.distributed.is_available()
                               and torch.distributed.is_initialized()) else None
        self.core = GuardCore(pl_module, opt, config=cfg, sinks=sinks, out_dir=out_dir, layer_fn=self.layer_fn,
                              scheduler=sched, scaler=self.scaler, reduce=reduce)
        self.core.register_actuator("skip_data", self._skip_data)
        # after the core's LR-multiplier hooks: tells whether the core's pre-hook already ran when
        # on_before_optimizer_step fires (Lightning runs the closure inside optimizer.step()).
        self._hook_handles = [opt.register_step_pre_hook(self._pre_hook),
                              opt.register_step_post_hook(self._post_hook)]
        self._trainer = trainer
        self._apply_pending()
        self._setup_clip(trainer)

    def _setup_clip(self, trainer: Any) -> None:
        if self._manage_clip and self.core is not None:
            trainer.gradient_clip_val = self.core.clip.max_norm
            trainer.gradient_clip_algorithm = "norm"

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.core is not None:
            self.core.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.core is not None:
            self.core.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.core is not None:
            self.core.close()

    def _teardown_core(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        if self.core is not None:
            self.core.lr.remove()
            self.core.close()
        self.core = None

    # -- per step --------------------------------------------------------------------------
    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = True

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._skip_left > 0:
            self._skip_left -= 1
            self._window_step = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.core is None or self._window_step or not trainer.training:
            return
        value = loss.detach()
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
            value = value * trainer.accumulate_grad_batches
        if self.scaler is not None and self.scaler.is_enabled() and getattr(self.scaler, "_scale", None) is not None:
            value = value.float() / self.scaler._scale.to(value.device)  # no host sync
        self.core.observe_loss(value)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        core = self.core
        if core is None or unwrap_optimizer(optimizer) is not core.optimizer:
            return
        lrm = core.lr
        rearm = self._in_opt_step
        if rearm:
            # Without a GradScaler, Lightning calls the closure (and so this hook) inside
            # optimizer.step(): the core's LR pre-hook already multiplied the LRs with the
            # multiplier of *before* this step's decision. Undo it, decide, then apply it again.
            lrm.suspend()
        skip = False
        self._stepped = True
        if self._window_step:  # a batch of the data window skipped after a rollback
            core.discard_loss()  # forget the observed losses of this step
            drop_grads(core.layers.params)
            self.data_skipped_steps += 1
            skip = True
            self._report = None
        else:
            report = core.before_step(scaler=self.scaler, drop_on_skip=True)
            self._report = report
            self.last_report = report
            self.reports += 1
            if report.halt:
                drop_grads(core.layers.params)
                self._halt(trainer, report)
            skip = report.skipped
        if skip and pl_module.automatic_optimization:
            self._hold_schedulers(trainer)
        if self._manage_clip:
            trainer.gradient_clip_val = None  # clipped by the core already: no second pass
        if rearm:
            lrm.rearm()

    def _hold_schedulers(self, trainer: Any) -> None:
        """Lightning steps the schedulers after every optimizer step, skipped or not: remember
        the state of the ``interval='step'`` ones, put back in on_train_batch_end."""
        self._held = []
        for c in trainer.lr_scheduler_configs:
            if c.interval != "step" or c.reduce_on_plateau:
                continue
            s = c.scheduler
            self._held.append((s, copy.deepcopy(s.state_dict()), [g["lr"] for g in s.optimizer.param_groups]))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        core = self.core
        if core is None:
            return
        if not self._stepped:  # not an optimizer-step boundary (accumulating), or another optimizer
            return
        self._stepped = False
        for sched, state, lrs in self._held:
            sched.load_state_dict(state)
            for g, lr in zip(sched.optimizer.param_groups, lrs):
                g["lr"] = lr
        self._held = []
        report = self._report
        if report is not None:
            core.after_step(report)
        self._report = None
        self._window_step = False
        self._setup_clip(trainer)

    # -- actions ---------------------------------------------------------------------------
    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        self._skip_left += n
        return {"mode": "the next batches run but their gradients are dropped"}

    def _halt(self, trainer: Any, report: StepReport) -> None:
        self.halted = report.diagnosis or {}
        trainer.should_stop = True
        core = self.core
        if trainer.global_rank == 0 and core is not None and core.log_path is not None:
            path = os.path.join(os.path.dirname(core.log_path), "diagnosis.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(self.halted, fh, indent=1, default=str)
            self.diagnosis_path = path
        warnings.warn(str(GradGuardHalt(self.halted)), stacklevel=2)


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
