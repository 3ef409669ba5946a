"""The engine-facing surface of the core: what an adapter calls besides the step itself.

:class:`EngineAPI` is a mixin of :class:`gradguard.core.GuardCore`: attaching an engine's data,
checkpoints and batches; the fp16 loss scale to keep; the guard's clip and parameters; routing
rows and lines to the engine's own loggers. Each method is a thin door onto the part that owns the
behaviour (:class:`gradguard.rollback.Rollback`, :class:`gradguard.reporting.Reporter`,
:mod:`gradguard.act`), so the core's own file holds only the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._compat import set_scaler_scale, sync_local_param_groups
from .act import drop_grads
from .actuators import BatchResizer
from .contract import CheckpointSource, DataSkip
from .sinks import Sink

__all__ = ["EngineAPI"]


class EngineAPI:
    """Engine-facing methods of :class:`gradguard.core.GuardCore` (see there for the attributes)."""

    config: Any
    reporter: Any
    rollback: Any
    measurer: Any
    layers: Any
    lr: Any
    clip: Any
    optimizer: Any
    actuators: Any
    batches: Any
    step_count: int
    skipped_steps: int
    _last: Any
    emit: Callable[[dict[str, Any]], None]  # GuardCore's
    close: Callable[[], dict[str, Any]]
    take_loss: Callable[..., Any]

    def open_event_log(self, path: str) -> Any:
        """Open the run's event log at ``path`` after attach (see :meth:`Reporter.open_event_log`)."""
        return self.reporter.open_event_log(path)

    def engine_skipped(self, report: Any, reason: str) -> None:
        """The engine skipped a step the guard let through (DeepSpeed's own overflow check)."""
        if not report.applied:
            return
        report.applied, report.skip_reason, report.clipped = False, reason, False
        self.skipped_steps += 1
        self.emit({"type": "skip", "step": report.step, "reason": reason, "finding_ids": []})

    def discard_loss(self) -> None:
        """Forget the micro-batch losses observed since the last step."""
        self.take_loss(None)

    def discard_step(self) -> None:
        """Count an optimizer step whose data was discarded without calling ``before_step``."""
        self.step_count += 1
        self.skipped_steps += 1
        self.emit({"type": "skip", "step": self.step_count, "reason": "batch discarded by the engine",
                   "finding_ids": []})

    def replay_engine_clip(self, report: Any) -> torch.Tensor | None:
        """Apply the engine's own clip measured by ``before_step(engine_clip=...)``, bit-identical to
        ``clip_grad_norm_``; returns its total-norm tensor, or None (the caller then clips itself)."""
        return self.measurer.replay_clip(report.engine_coef)

    @property
    def last_report(self) -> Any:
        """The report of the latest ``before_step``."""
        return self._last

    def attach_data_skip(self, fn: DataSkip) -> None:
        """The engine's "skip upcoming samples": after a rollback, ``fn(action)`` makes the data of
        the next ``action.params["batches"]`` optimizer steps not computed and returns how."""
        self.rollback.data_skip = fn

    def attach_checkpoints(self, source: CheckpointSource) -> None:
        """Use the engine's own checkpoints as the rollback disk tier (not with sharded parameters).
        The adapter reports each save with :meth:`checkpoint_saved`."""
        if self.rollback.attach_checkpoints(source, sharded=self.measurer.sharding is not None) \
                and self.config.policy.act:
            self.actuators.register("rollback", self.rollback)

    def checkpoint_saved(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> None:
        """The engine wrote a checkpoint after update ``step`` (on every process: decisions must match)."""
        self.rollback.checkpoint_saved(step, paths)

    def attach_batches(self, controller: Any) -> None:
        """Let the policy resize the batch (``controller``: a :class:`gradguard.contract.LoaderHandle`)."""
        self.batches = BatchResizer(controller, self.config, self.lr, self.clip)
        self.actuators.register("shrink_batch", self.batches.shrink)

    def scale_to_keep(self, report: Any) -> float | None:
        """The loss scale to put back after the engine's GradScaler update, or None to let it halve.
        Overflows that several halvings did not cure (a streak), or that restored weights meet,
        come from the forward pass or the data, not from the scale."""
        if not (self.config.policy.act and report.overflow and report.scale):
            return None
        if report.blamed_on_data or any(f.kind == "overflow_streak" for f in report.findings):
            return float(report.scale)
        return None

    def keep_scale(self, report: Any, scaler: Any) -> bool:
        """After the engine's GradScaler update: put back the scale :meth:`scale_to_keep` wants."""
        keep = self.scale_to_keep(report)
        return keep is not None and set_scaler_scale(scaler, keep)

    @property
    def max_grad_norm(self) -> float | None:
        """The clip threshold the guard applies now (None when it does not clip)."""
        if not self.config.policy.act or self.config.clip.mode == "off":
            return None
        return float(self.clip.max_norm)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters the guard watches (in layer-map order)."""
        return list(self.layers.params)

    def drop_grads(self) -> None:
        """Set every watched parameter's grad to None (the engine's optimizer step becomes a no-op)."""
        drop_grads(self.layers.params)

    @contextlib.contextmanager
    def deciding_inside_step(self, active: bool = True) -> Iterator[None]:
        """For engines that call the pre-step hook from inside ``optimizer.step()`` (Lightning's
        closure without a GradScaler): the LR multiplier's pre-hook already ran; it is undone for
        the decision and applied again after it."""
        if not active:
            yield
            return
        self.lr.suspend()
        try:
            yield
        finally:
            self.lr.rearm()
            sync_local_param_groups(self.optimizer)  # ZeroRedundancyOptimizer: this step's settings

    @property
    def sinks(self) -> list[Sink]:
        return self.reporter.sinks

    @property
    def log_path(self) -> str | None:
        return self.reporter.log_path

    @property
    def diagnosis_path(self) -> str | None:
        return self.reporter.diagnosis_path

    @property
    def closed(self) -> bool:
        """``close()`` was called (the summary written, the sinks closed)."""
        return self.reporter.closed

    @property
    def action_counts(self) -> Any:
        """How many times each action was taken (a Counter)."""
        return self.reporter.action_counts

    @property
    def n_findings(self) -> int:
        return self.reporter.n_findings

    @property
    def snapshots(self) -> Any:
        return self.rollback.snapshots

    @property
    def checkpoint_tier(self) -> Any:
        return self.rollback.checkpoint_tier

    def send_live(self, step: int, metrics: dict[str, float]) -> None:
        """Send a row to the engine-bound sinks only (the per-layer values kept off an engine's printed log)."""
        self.reporter.send_live(step, metrics)

    def engine_logged(self, step: int, metrics: dict[str, float]) -> None:
        """The engine logged gradguard's ``metrics`` (no prefix) itself at ``step`` (HF's logs, written by
        its ``report_to`` integrations): the engine-bound sinks add what they draw from them."""
        self.reporter.engine_logged(step, metrics)

    def add_live_sinks(self, sinks: list[Sink]) -> None:
        """Add sinks an adapter built around the engine's own run or writer (after construction)."""
        self.reporter.add_sinks(sinks)

    def set_console_writer(self, write: Callable[[str, Any], None]) -> None:
        """Route the console lines through the engine's progress display (``write(line, stream)``)."""
        self.reporter.set_console_writer(write)

    def set_engine_step(self, fn: Callable[[int], int]) -> None:
        """The event log's records carry ``engine_step = fn(step)`` (Lightning logs at another x)."""
        self.reporter.set_engine_step(fn)

    def write_diagnosis(self, diagnosis: dict[str, Any], folder: str | None = None) -> str | None:
        """Write ``diagnosis.json`` (next to the event log unless ``folder``; on rank 0 only)."""
        return self.reporter.write_diagnosis(diagnosis, folder)

    def detach(self) -> dict[str, Any]:
        """Remove the guard's optimizer hooks and close its sinks (end of an engine run)."""
        return self.close()

