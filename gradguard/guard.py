"""The guard: measure -> detect -> decide -> act, once per optimizer step.

:class:`GuardCore` is engine-agnostic: an engine (plain loop, HF Trainer, Lightning) calls
:meth:`GuardCore.before_step` when gradients are final (accumulated, unscaled, not yet clipped)
and :meth:`GuardCore.after_step` once the optimizer has (or has not) stepped.
:class:`Guard` is the plain-PyTorch engine: ``guard.step(loss)`` replaces
``clip_grad_norm_`` + ``optimizer.step()`` (+ ``scaler.step/update``) + ``scheduler.step()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import (
    ddp_wrapper,
    fsdp1_units,
    is_deepspeed_engine,
    scaler_found_inf,
    scaler_scale,
    set_scaler_scale,
    sync_local_param_groups,
)
from ._shard import sharding
from .act import AdamTuner, ClipController, LRMultiplier, drop_grads, unwrap_optimizer
from .advice import ADVICE_ACTIONS, ADVICE_LOG_SIZE, advise
from .config import RUNG_ACTIONS, GuardConfig
from .contract import CheckpointSource, Collective, SteppingEngine
from .contract import collective as default_collective
from .detect import NORM_TAKEOVER, Detectors, Finding, Signals
from .errors import ConfigError, GradGuardHalt, UnsupportedSetupError, is_rank0, warn
from .logdir import event_log_dir, is_url, join, write_text
from .measure import EngineClip, GradMeasurer, LayerMap, metric_key, norm_layers
from .oom import SKIPPED, EveryRank, OomRecovery, PieceFailed
from .policy import Action, Policy
from .recovery import CheckpointTier, rollback_from_checkpoints, step_verdict
from .sinks import EVENT_SCHEMA_VERSION, ConsoleSink, JSONLSink, M, Sink, _clean, package_versions
from .snapshot import SnapshotRing, SnapshotUnavailable
from .state import model_signature

__all__ = ["GradGuardHalt", "StepReport", "GuardCore", "Guard"]

STATE_VERSION = 1


@dataclass
class StepReport:
    """What ``guard.step`` did. ``applied`` is False when the optimizer step was skipped."""

    step: int
    applied: bool
    skip_reason: str = ""
    loss: float | None = None
    total_norm: float = 0.0
    layer_norms: dict[str, float] = field(default_factory=dict)
    clip_to: float | None = None
    clipped: bool = False
    scale: float | None = None
    overflow: bool = False
    lr_multiplier: float = 1.0
    findings: list[Finding] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    halt: bool = False
    diagnosis: dict[str, Any] | None = None
    healthy: bool = False
    blamed_on_data: bool = False
    engine_norm: float | None = None
    """The engine's own total gradient norm (its log value) when ``before_step`` took the engine's
    norm pass over (``engine_clip``); else None."""
    engine_coef: float | None = None

    @property
    def skipped(self) -> bool:
        return not self.applied


def _scaler_state(scaler: Any, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(scale tensor, found_inf tensor) of an enabled GradScaler after unscale_, without a sync."""
    return scaler_scale(scaler), scaler_found_inf(scaler, optimizer)


def optimizer_info(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class and each group's base LR (``initial_lr`` where a scheduler set one),
    betas, eps and weight decay: the settings the advice for the next run starts from."""
    groups = []
    for g in getattr(optimizer, "param_groups", []):
        entry: dict[str, Any] = {}
        values = {"lr": g.get("initial_lr", g.get("lr")), "eps": g.get("eps"),
                  "weight_decay": g.get("weight_decay"), "momentum": g.get("momentum")}
        for key, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                entry[key] = float(v)
        betas = g.get("betas")
        if isinstance(betas, (tuple, list)) and all(isinstance(b, (int, float)) for b in betas):
            entry["betas"] = [float(b) for b in betas]
        groups.append(entry)
    return {"class": type(optimizer).__name__, "groups": groups}


def event_log_path(out_dir: str | None) -> str:
    """The JSONL event log: ``<event_log_dir(out_dir)>/events.jsonl``, or without ``out_dir``
    ``./gradguard_runs/events-<timestamp>-<pid>.jsonl``."""
    if out_dir is not None:
        return join(event_log_dir(out_dir), "events.jsonl")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.getcwd(), "gradguard_runs", f"events-{stamp}-{os.getpid()}.jsonl")


class GuardCore:
    """The engine-agnostic guard and the engine API: adapters map their engine's hooks onto
    :class:`gradguard.contract.Event` and call these methods (see the README, "Adding an engine").
    ``collective`` (default: :func:`gradguard.contract.collective`) combines the step's measurement
    over processes and votes on checkpoint restores; ``reduce`` overrides only the former.
    ``shard_root``: the engine's wrapper around ``model`` when it shards from outside it (an FSDP1
    root unit around a LightningModule), read for the sharding layout."""

    def __init__(self, model: nn.Module, optimizer: Any, *, config: GuardConfig | None = None,
                 sinks: list[Sink] | None = None, out_dir: str | None = None,
                 layer_fn: Callable[[str], str] | None = None, scheduler: Any = None,
                 scaler: Any = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 collective: Collective | None = None, shard_root: nn.Module | None = None,
                 stepping: SteppingEngine | None = None) -> None:
        config = GuardConfig.coerce(config)
        if not isinstance(model, nn.Module):
            raise UnsupportedSetupError(f"gradguard: model={type(model).__name__} is not a torch.nn.Module. "
                            "Fix: pass the module whose parameters the optimizer trains")
        self.config = config
        self.model = model
        self.collective: Collective = collective if collective is not None else default_collective()
        # cross-rank combination of the step's packed measurements (DDP): one reduction per step
        self.reduce = reduce if reduce is not None else (
            self.collective.mean if self.collective.world_size > 1 else None)
        self.optimizer = unwrap_optimizer(optimizer)
        #: an engine that steps the optimizer itself (DeepSpeed): it measures its own gradient
        #: buffers and calls decide(), or the core reads its signals after its step
        #: (engine_step_begin/engine_step_end); its unavailable actions are recorded as such
        self.stepping = stepping
        # a stepping engine's optimizer holds its own flat copies of the parameters (ZeRO's fp32
        # partitions): the layer map names the module's parameters without following it
        self.layers = LayerMap(model, layer_fn or config.measure.layer_pattern,
                               optimizer=self.optimizer if stepping is None else None, root=shard_root)
        if stepping is None:
            self._check_optimizer_covers_model()
        self.measurer = GradMeasurer(self.layers)
        # FSDP: local pieces measured, summed by the step's one reduction (gradguard._shard)
        # shard_root: the engine's wrapper around ``model`` (Lightning's FSDP1 root unit), where the
        # sharding is read when the engine wraps the module from outside
        self.shard_root = shard_root
        self.measurer.sharding = sharding(shard_root if shard_root is not None else model,
                                          self.collective.world_size, self.reduce)
        self.detectors = Detectors(config.detect)
        self.detectors.takeover.set_layers(list(self.layers.layer_names), norm_layers(model, self.layers))
        self._layers_version = self.layers.version
        self.policy = Policy(config.policy)
        self.clip = ClipController(config.clip)
        # a stepping engine may call the optimizer once per param group: the multiplier goes on
        # around the engine's whole step instead (LRMultiplier.engine_begin / engine_end)
        self.lr = LRMultiplier(config.lr, self.optimizer, self.layers, hooks=config.policy.act and stepping is None)
        self.adam = AdamTuner(config.adam, self.optimizer)
        self.actuators: dict[str, Callable[[Action], dict[str, Any]]] = {}
        self.healthy_hooks: list[Callable[[int], Action | None]] = []
        self.rollback_sources: list[Callable[[Action], dict[str, Any] | None]] = []
        self.checkpoint_tier = CheckpointTier(config.recovery.confirm_steps)  # the engine's checkpoints
        self.checkpoint_source: CheckpointSource | None = None
        self.data_skip: Callable[[Action], dict[str, Any]] | None = None  # see attach_data_skip
        self.scheduler = scheduler
        self.scaler_ref = scaler
        self.diagnosis_path: str | None = None
        self.batch_control: Any = None  # see attach_batches
        self._grow_healthy = 0
        self.snapshots: SnapshotRing | None = None
        rc = config.recovery
        if rc.snapshot_interval > 0 and config.policy.act:
            self.snapshots = SnapshotRing(model, self.optimizer, ring_size=rc.ring_size,
                                          confirm_steps=rc.confirm_steps, scheduler=scheduler, scaler=scaler,
                                          disk_dir=rc.disk_dir)
            self.snapshots.register("gradguard_detectors", self.detectors.state_dict,
                                    self.detectors.load_state_dict)
            for name, (get, put) in (stepping.snapshot_state() if stepping is not None else {}).items():
                self.snapshots.register(name, get, put)
            self.register_actuator("rollback", self._rollback)
        self.step_count = 0
        self.applied_steps = 0
        self.skipped_steps = 0
        self.n_findings = 0
        self.action_counts: Counter[str] = Counter()
        self.recent_findings: deque[dict[str, Any]] = deque(maxlen=50)
        self.culprits: Counter[str] = Counter()
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_n = 0
        self._before_params: list[torch.Tensor] | None = None
        self._step_lrs: list[float] = []
        self._ratios: dict[str, float] = {}  # the latest update ratios / param norms (kept for engines' log steps)
        #: engine hook: True for a step the engine will log (update ratios are measured for it)
        self.ratio_due: Callable[[int], bool] | None = None
        #: the full row of the latest step the engine logs itself (see ``after_step(engine_logs=True)``)
        self.pending_row: dict[str, float] | None = None
        self._last_finite_loss: float | None = None
        self._alert_last: int | None = None
        self._alerts_held = 0
        self.report_path: str | None = None  # an HTML report written for this run (shown in the summary)
        self._verified = False  # no update applied since the weights were restored from a snapshot
        self._undo: tuple[dict[str, Any], float] | None = None  # LR/clip before the last rollback rung
        self._extra_actions: list[Action] = []
        self._failed_mult = 1.0  # LR multiplier level at which the current step's instability happened
        self._takeover_from_start = False
        self._last: StepReport | None = None
        self.sinks: list[Sink] = list(sinks or [])
        self.out_dir = out_dir if out_dir is not None else config.output.dir
        self.log_path: str | None = None
        if config.output.jsonl:
            self.log_path = event_log_path(self.out_dir)
            self.sinks.append(JSONLSink(self.log_path))
        if config.output.console:
            self.sinks.append(ConsoleSink())
        self._closed = False
        for sink in self.sinks:  # the event log's I/O errors become events for the other sinks
            if isinstance(sink, JSONLSink):
                sink.on_error = self._emit
        if self.snapshots is not None:
            self.snapshots.on_event = self._emit  # I/O errors and invalidations become events
        self._cause_ids: list[int] = []  # ids of the findings that the step's actions answer
        self._optimizer_at_start = optimizer_info(self.optimizer)
        self._action_log: deque[dict[str, Any]] = deque(maxlen=10_000)  # for the advice at close
        self._emit({"type": "start", "step": 0, "schema_version": EVENT_SCHEMA_VERSION,
                    "versions": package_versions(), "layers": list(self.layers.layer_names),
                    "optimizer": self._optimizer_at_start, "config": config.to_dict()})

    # -- validation ------------------------------------------------------------------------
    def _check_optimizer_covers_model(self) -> None:
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if not self.layers.params:
            return  # everything frozen for now: the layer map follows the optimizer (LayerMap.sync)
        if not any(id(p) in in_opt for p in self.layers.params):
            raise UnsupportedSetupError("gradguard: none of the model's trainable parameters is in the optimizer. "
                             "Fix: pass the same model the optimizer was built from")

    def _layers_joined(self) -> None:
        """Parameters became trainable (unfrozen or added to the optimizer): the total grad norm
        now sums more layers, so its baseline starts over (a warm-up of its own) rather than
        reading the larger norm as a spike; the takeover rule sees the new layers."""
        self._layers_version = self.layers.version
        self.detectors.grad.restart_total()
        self.detectors.takeover.set_layers(list(self.layers.layer_names), norm_layers(self.model, self.layers))
        self._emit({"type": "layers_joined", "step": self.step_count + 1, "layers": list(self.layers.layer_names)})

    # -- engine API ------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Record one micro-batch loss (unscaled); the step's loss is their mean."""
        value = loss.detach().float() if isinstance(loss, torch.Tensor) else float(loss)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_n += 1

    def _take_loss(self, loss: torch.Tensor | float | None) -> torch.Tensor | float | None:
        if loss is None and self._loss_n:
            loss = self._loss_sum / self._loss_n  # type: ignore[operator]
        self._loss_sum, self._loss_n = None, 0
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().mean() if loss.numel() > 1 else loss.detach()
        return loss

    def before_step(self, loss: torch.Tensor | float | None = None, *, scaler: Any = None,
                    drop_on_skip: bool = False, engine_clip: EngineClip | None = None) -> StepReport:
        """Call once per optimizer step, gradients final and unscaled. Measures (one sync),
        detects, decides; clips in place unless the step is to be skipped. With
        ``drop_on_skip`` a skipped step also sets every grad to None (for engines that will call
        ``optimizer.step()`` anyway). With ``engine_clip`` (a guard that does not clip, in an engine
        that does) the same pass also yields the engine's own total norm, and
        :meth:`replay_engine_clip` then applies the engine's clip without a second pass."""
        step = self.step_count + 1
        self.first_snapshot()
        loss_v = self._take_loss(loss)
        scale_t, found_t = _scaler_state(scaler, self.optimizer)
        meas = self.measurer.measure([loss_v, scale_t, found_t], reduce=self.reduce, engine=engine_clip)
        grads, self.measurer.last_grads = self.measurer.last_grads, []  # never held past this step
        if self.layers.version != self._layers_version:
            self._layers_joined()
        loss_f, scale_f, found_f = meas.extras
        scale = None if scale_t is None else scale_f
        overflow = bool(found_t is not None and found_f > 0)
        layer_norms = dict(zip(self.layers.layer_names, meas.layer_norms))
        sig = Signals(step=step, loss=None if loss_v is None else loss_f, total_norm=meas.total_norm,
                      layer_norms=layer_norms, nonfinite_layers=meas.nonfinite_layers, scale=scale,
                      overflow=overflow)
        return self._conclude(sig, grads, drop_on_skip=drop_on_skip, engine_norm=meas.engine_norm,
                              engine_coef=meas.engine_coef)

    def _conclude(self, sig: Signals, grads: list[torch.Tensor], *, drop_on_skip: bool = False,
                  engine_norm: float | None = None, engine_coef: Any = None,
                  engine_skipped: bool | None = None) -> StepReport:
        """Detect, decide and act on one step's signals (shared by :meth:`before_step` and
        :meth:`engine_step_end`). ``engine_skipped``: None before the optimizer step (the core
        clips ``grads`` and may skip); True/False after a :class:`SteppingEngine` stepped (it
        skipped on its own overflow, or applied the update: a skip then becomes a rollback)."""
        cfg = self.config
        step = sig.step
        stepped = engine_skipped is not None
        grad_ratio = self.detectors.grad.ratio(sig.total_norm)
        findings = self.detectors.observe(sig)
        decision = self.policy.decide(sig, findings, grad_ratio, weights_verified=self._verified)
        if stepped and decision.skip and not engine_skipped and cfg.policy.act:
            # the engine already applied this step: undoing it means going back to a snapshot
            if not any(a.name == "rollback" for a in decision.actions):
                decision.actions.insert(0, Action("rollback", step, f"{decision.skip_reason}: the engine "
                                                  "(" + self.stepping.name + ") already applied the step",  # type: ignore[union-attr]
                                                  {"replaces": "skip"}))
        report = StepReport(step=step, applied=not decision.skip, skip_reason=decision.skip_reason,
                            loss=sig.loss, total_norm=sig.total_norm, layer_norms=sig.layer_norms,
                            scale=sig.scale, overflow=sig.overflow, findings=findings,
                            blamed_on_data=decision.data_verdict, engine_norm=engine_norm,
                            engine_coef=engine_coef)
        if stepped:
            report.applied = not engine_skipped and not decision.skip
        if cfg.policy.act:
            clip_to = self.clip.threshold(sig.total_norm)
            report.clip_to = clip_to
            if stepped:
                before = self.stepping.clip()  # type: ignore[union-attr]
                report.clipped = bool(not engine_skipped and before and sig.total_norm > before)
            elif not decision.skip:  # the gradients just measured (nothing ran in between)
                report.clipped = self.clip.apply(grads, sig.total_norm, clip_to)
            self.clip.observe(sig.total_norm, clip_to)
        self._cause_ids = []
        for f in findings:
            self.n_findings += 1
            self.culprits.update(f.layers)
            fd = {"type": "finding", "id": self.n_findings, **f.to_dict()}
            self._cause_ids.append(self.n_findings)
            self.recent_findings.append(fd)
            self._emit(fd)
        # a quiet stall in progress: weights saved now already carry it, so they are not confirmed
        suspect = decision.suspect or self.detectors.takeover.suspect
        if self.snapshots is not None:
            healthy = not (decision.unstable or suspect) and sig.loss is not None and math.isfinite(sig.loss)
            self.snapshots.observe(step, healthy and not decision.skip)
        healthy_ckpt, bad_ckpt = step_verdict(findings, sig.loss, unstable=decision.unstable, suspect=suspect)
        self.checkpoint_tier.observe(step, healthy_ckpt, bad_ckpt)
        self._failed_mult = self.lr.level()  # the level this step's instability happened at
        # a takeover since the first steps (the body never learned): the LR is grossly too high, as
        # with a blow-up before the loss baseline exists, so the LR gets the same deep cut
        self._takeover_from_start = any(f.kind == NORM_TAKEOVER and f.baseline is not None
                                       and f.baseline <= 3 * cfg.detect.warmup_steps for f in findings)
        if any(a.name == "rollback" for a in decision.actions):
            # if the restored weights then meet bad data, this escalation was the data's fault
            self._undo = (self.lr.state_dict(), self.clip.max_norm)
        elif decision.data_verdict and self._undo is not None:
            lr_state, max_norm = self._undo
            self._undo = None
            self.lr.load_state_dict({**lr_state, "warm_left": self.lr.warm_left})
            self.clip.max_norm = max_norm
            report.actions.append(self._record(Action(
                "revert_lr", step, "spike on restored, verified weights: the data was bad, not the LR",
                {"lr_multiplier": self.lr.global_mult, "max_grad_norm": max_norm})))
        for a in decision.actions:
            self._extra_actions = []
            self._execute(a)
            report.actions.append(a)
            report.actions.extend(self._extra_actions)
            if a.name == "rollback":
                report.applied = False  # the gradients came from the discarded weights
                report.skip_reason = report.skip_reason or (
                    "rolled back" if "to_step" in a.params else "instability (no snapshot to roll back to)")
                decision.skip = True
                if stepped and "to_step" not in a.params:
                    report.applied = not engine_skipped  # nothing to go back to: the update stays
                if "to_step" in a.params:
                    self.policy.last_escalation = None  # restored weights: no cooldown
                    self._verified = True
        step_ids, self._cause_ids = self._cause_ids, []  # later actions (relaxations, growth) answer none
        if decision.unstable:
            self.lr.mark_unstable(self._failed_mult)
            self.clip.reset_healthy()
        elif cfg.policy.act and not decision.skip:
            relaxed = self.clip.tick_healthy()
            if relaxed:
                report.actions.append(self._record(Action("relax_clip", step, "stable period",
                                                          {"from": relaxed[0], "to": relaxed[1]})))
            recovered = self.lr.tick_healthy()
            if recovered:
                report.actions.append(self._record(Action("recover_lr", step, "stable period", recovered)))
            report.healthy = not suspect
        if decision.skip:
            self.skipped_steps += 1
            self._emit({"type": "skip", "step": step, "reason": report.skip_reason or "skipped",
                        "finding_ids": step_ids})
            if drop_on_skip:
                drop_grads(self.layers.params)
            report.clipped = False
        if decision.halt:
            report.halt = True
            report.applied = False
            if drop_on_skip and not decision.skip:
                drop_grads(self.layers.params)  # the halting step is never applied, in any engine
            report.diagnosis = self.diagnosis(report, next((a.reason for a in decision.actions
                                                            if a.name == "halt"), "policy halt"))
            self._emit({"type": "halt", "step": step, "message": report.diagnosis["reason"],
                        "finding_ids": step_ids, "diagnosis": report.diagnosis})
            self.write_diagnosis(report.diagnosis)
        report.lr_multiplier = self.lr.current()
        # the scheduler's LRs this optimizer step runs with (engines log after the scheduler moved on)
        self._step_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if stepped:
            if cfg.policy.act and cfg.clip.mode != "off":  # the engine clips the next step to the guard's threshold
                self.stepping.set_clip(self.clip.threshold(sig.total_norm))  # type: ignore[union-attr]
        elif report.applied and (step % cfg.measure.log_interval == 0
                               or (self.ratio_due is not None and self.ratio_due(step))):
            self._before_params = [t.clone() for t in self.layers.tensors()]
        self._last = report
        return report

    def first_snapshot(self) -> None:
        """The initial (or resumed) weights, before any update: snapshotted once, before the first step."""
        if self.snapshots is not None and not (self.snapshots.ring or self.snapshots.candidates):
            self.take_snapshot(self.step_count)

    def decide(self, sig: Signals, grads: list[torch.Tensor]) -> StepReport:
        """BEFORE_OPTIMIZER_STEP for an engine that measures its own gradients (DeepSpeed ZeRO's
        partitions: see :mod:`gradguard.deepspeed`): ``sig`` already combined over processes,
        ``grads`` this process's gradient tensors, clipped here in place. The engine then skips
        the step when the report is not ``applied``."""
        return self._conclude(sig, grads)

    def engine_skipped(self, report: StepReport, reason: str) -> None:
        """The engine skipped a step the guard let through (DeepSpeed's own overflow check): the
        report, the counters and the event log say so."""
        if not report.applied:
            return
        report.applied = False
        report.skip_reason = reason
        report.clipped = False
        self.skipped_steps += 1
        self._emit({"type": "skip", "step": report.step, "reason": reason, "finding_ids": []})

    # -- engines that step the optimizer themselves (contract.SteppingEngine) -------------
    def engine_step_begin(self) -> None:
        """ENGINE_STEP_START: before a :class:`SteppingEngine` runs its optimizer step (before
        the boundary micro-batch's backward where the engine steps inside it): the first snapshot
        (the weights before any update) and the LR multiplier put on the optimizer's groups."""
        self.first_snapshot()
        if self.config.policy.act:
            self.lr.engine_begin()

    def engine_step_end(self, loss: torch.Tensor | float | None = None) -> StepReport:
        """ENGINE_STEP_END: after a :class:`SteppingEngine` stepped. Reads its global norm, loss
        scale and overflow flag, combines them and the loss over processes (one reduction), detects
        and decides like :meth:`before_step`; the engine's next step clips to the guard's
        threshold. A skip the engine did not make itself becomes a rollback to the last healthy
        snapshot. Then call :meth:`after_step` as usual."""
        assert self.stepping is not None, "engine_step_end needs a stepping engine (GuardCore(stepping=...))"
        self.lr.engine_end()
        step = self.step_count + 1
        loss_v = self._take_loss(loss)
        got = self.stepping.signals()
        norm = got.total_norm if got.total_norm is not None else float("nan")
        values = [float("nan") if loss_v is None else loss_v, norm, got.scale or 0.0, 1.0 if got.overflow else 0.0]
        packed = torch.stack([v.detach().float().reshape(()).cpu() if isinstance(v, torch.Tensor)
                              else torch.tensor(float(v)) for v in values])
        if self.reduce is not None:
            packed = self.reduce(packed)
        loss_f, norm_f, scale_f, overflow_f = packed.tolist()  # the step's one host read
        sig = Signals(step=step, loss=None if loss_v is None else loss_f, total_norm=norm_f, layer_norms={},
                      nonfinite_layers=[], scale=None if got.scale is None else scale_f, overflow=overflow_f > 0)
        return self._conclude(sig, [], engine_skipped=overflow_f > 0)

    def replay_engine_clip(self, report: StepReport) -> torch.Tensor | None:
        """Apply the engine's own clip measured by ``before_step(engine_clip=...)``, bit-identical to
        ``torch.nn.utils.clip_grad_norm_`` on the same gradients (its total-norm tensor is reused, the
        scale pass is left out when the coefficient is exactly 1). Returns that total-norm tensor,
        or None when the engine's pass could not be taken over this step (the caller then runs
        ``clip_grad_norm_`` itself)."""
        return self.measurer.replay_clip(report.engine_coef)

    @property
    def last_report(self) -> StepReport | None:
        """The report of the latest ``before_step``."""
        return self._last

    def emit(self, event: dict[str, Any]) -> None:
        """Send an event to every sink (adapters' own events: saves, resizes...)."""
        self._emit(event)

    def discard_loss(self) -> None:
        """Forget the micro-batch losses observed since the last step."""
        self._take_loss(None)

    def discard_step(self) -> None:
        """Count an optimizer step whose data was discarded without calling ``before_step``
        (e.g. an engine that cannot skip a batch before computing it)."""
        self.step_count += 1
        self.skipped_steps += 1
        self._emit({"type": "skip", "step": self.step_count, "reason": "batch discarded by the engine",
                    "finding_ids": []})

    def after_step(self, report: StepReport, *, engine_logs: bool | None = None) -> None:
        """Call after the optimizer stepped (or not): counters, metrics, alerts.

        ``engine_logs``: None for an engine without a logging cadence of its own (the plain loop:
        every sink gets the metrics every ``output.metrics_interval`` steps and at every step with an
        event). True/False from an adapter whose engine logs on its own cadence (HF's
        ``logging_steps``, Lightning's ``log_every_n_steps``) and says whether it logs this step: then
        the engine-bound sinks (:attr:`Sink.engine_bound`) get a row only at an event step the engine
        does not log, and on a logged step the full row waits in :attr:`pending_row` for the adapter
        to hand to the engine's own log call."""
        self.step_count = report.step
        if report.applied:
            self.applied_steps += 1
            self._verified = False
            self._undo = None
            if report.healthy:  # changes that must wait for the next step's data (batch growth)
                for hook in self.healthy_hooks:
                    moved = hook(report.step)
                    if moved is not None:
                        report.actions.append(self._record(moved))
            interval = self.config.recovery.snapshot_interval
            if self.snapshots is not None and self.applied_steps % interval == 0:
                self.take_snapshot(report.step)
        if self._before_params is not None:
            self._measure_update()
        if report.loss is not None and math.isfinite(report.loss):
            self._last_finite_loss = report.loss
        events = self.event_metrics(report)
        due = report.step % self.config.output.metrics_interval == 0
        self.pending_row = None
        if due or events or engine_logs:
            m = self.metrics(report)
            m.update(events)
            for s in self.sinks:
                if s.engine_bound and engine_logs is not None:
                    if events and not engine_logs:
                        s.log_metrics(report.step, m)  # an event step the engine does not log
                elif due or events:
                    s.log_metrics(report.step, m)
            if engine_logs:
                self.pending_row = m
        self._alert(report)
        for s in self.sinks:
            s.end_step(report.step)

    def send_live(self, step: int, metrics: dict[str, float]) -> None:
        """Send a row to the engine-bound sinks only (what an adapter keeps out of the engine's own,
        printed log at a logging step: the per-layer values)."""
        if metrics:
            for s in self.sinks:
                if s.engine_bound:
                    s.log_metrics(step, metrics)

    def add_live_sinks(self, sinks: list[Sink]) -> None:
        """Add sinks an adapter built around the engine's own run or writer (after construction)."""
        for sink in sinks:
            if sink not in self.sinks:
                self.sinks.append(sink)

    def set_console_writer(self, write: Callable[[str, Any], None]) -> None:
        """Route the console lines through the engine's progress display (``write(line, stream)``)."""
        for s in self.sinks:
            if isinstance(s, ConsoleSink):
                s.write = write

    def event_metrics(self, report: StepReport) -> dict[str, float]:
        """``gradguard/event/<name>`` for each finding kind, action, skip and halt of the step; the
        value is the step's loss (the last finite one when it is not), so the points sit on the
        loss curve when overlaid."""
        names = [f.kind for f in report.findings] + [a.name for a in report.actions]
        if report.skipped and not report.halt:
            names.append("skip")
        if report.halt:
            names.append("halt")
        if not names:
            return {}
        y = report.loss if report.loss is not None and math.isfinite(report.loss) else self._last_finite_loss
        y = 0.0 if y is None else float(y)
        return {f"{M.EVENT}/{n}": y for n in dict.fromkeys(names)}

    def _alert(self, report: StepReport) -> None:
        """``ERROR`` on a halt, ``WARN`` on a rollback or escalation (rate-limited by ``output.alert_every``)."""
        escalations = [a for a in report.actions if a.name in RUNG_ACTIONS and a.name != "halt"]
        if report.halt:
            level, title = "ERROR", "gradguard: training halted"
        elif escalations:
            rollback = any(a.name == "rollback" for a in escalations)
            level, title = "WARN", "gradguard: rollback" if rollback else "gradguard: escalation"
            if self._alert_last is not None and report.step - self._alert_last < self.config.output.alert_every:
                self._alerts_held += 1
                return
        else:
            return
        layers = sorted({n for f in report.findings for n in f.layers}) or [n for n, _ in self.culprits.most_common(3)]
        if report.halt and report.diagnosis:
            reason = str(report.diagnosis.get("reason", ""))
        else:
            reason = next((a.reason for a in escalations if a.reason), "")
        acts = ", ".join(a.name for a in escalations) or "halt"
        text = (f"step {report.step}: {reason}. Actions: {acts}. Culprit layers: {', '.join(layers) or 'none named'}. "
                f"LR x{self.lr.global_mult:.4g}, clip {self.clip.max_norm:.4g}.")
        if self._alerts_held:
            text += f" ({self._alerts_held} more since the last alert.)"
        self._alert_last, self._alerts_held = report.step, 0
        for s in self.sinks:
            try:
                s.log_alert(level, title, text, report.step)
            except Exception as exc:  # noqa: BLE001 - an alert never stops training
                warn(f"gradguard: alert to {type(s).__name__} failed ({exc})", stacklevel=2)

    # -- actions ---------------------------------------------------------------------------
    def register_actuator(self, name: str, fn: Callable[[Action], dict[str, Any]]) -> None:
        """Plug an action in (rollback, shrink_batch...): ``fn(action)`` acts and returns its params."""
        self.actuators[name] = fn

    def take_snapshot(self, step: int) -> None:
        """Snapshot the training state now (as after update ``step``)."""
        assert self.snapshots is not None
        snap = self.snapshots.take(step)
        self._emit({"type": "snapshot", "step": step, "bytes": snap.nbytes, "seconds": snap.seconds})

    def add_rollback_source(self, fn: Callable[[Action], dict[str, Any] | None]) -> None:
        """Add a fallback tier for the 'rollback' rung, used when the in-memory ring has no tested
        snapshot (or snapshots are off): typically the engine's own checkpoints. ``fn(action)``
        restores the model and optimizer (and scaler) to an earlier healthy state and returns at
        least ``{"to_step": step}``, or returns None when it has nothing to restore."""
        self.rollback_sources.append(fn)
        if self.config.policy.act:
            self.register_actuator("rollback", self._rollback)

    def attach_data_skip(self, fn: Callable[[Action], dict[str, Any]]) -> None:
        """The engine's "skip upcoming samples" (contract): after a rollback, ``fn(action)`` makes the
        data of the next ``action.params["batches"]`` optimizer steps not computed (or its gradients
        dropped) and returns how; the core counts and logs it as ``skip_data``."""
        self.data_skip = fn

    def attach_checkpoints(self, source: CheckpointSource) -> None:
        """Use the engine's own checkpoints as the rollback disk tier (after the in-memory ring). The
        adapter reports each save with :meth:`checkpoint_saved`; the core applies the trust rule
        (``recovery.confirm_steps`` healthy steps) and runs the rollback loop. Sharded parameters
        (FSDP): not used; every process rolls back to its own snapshots (memory ring,
        ``recovery.disk_dir``), since an engine's checkpoint holds gathered or distributed state
        that the engine alone knows how to load into the shards."""
        if self.measurer.sharding is not None:
            return
        self.checkpoint_source = source
        if self.config.policy.act:
            self.register_actuator("rollback", self._rollback)

    def checkpoint_saved(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> None:
        """The engine wrote a checkpoint after update ``step`` (on every process: decisions must match)."""
        self.checkpoint_tier.saved(step, list(paths))

    def _rollback_from_checkpoints(self, a: Action) -> dict[str, Any] | None:
        if self.checkpoint_source is None:
            return None
        return rollback_from_checkpoints(self.checkpoint_tier, self.checkpoint_source, self.collective, self._emit,
                                         a.step, detectors=self.detectors)

    def write_diagnosis(self, diagnosis: dict[str, Any], folder: str | None = None) -> str | None:
        """Write ``diagnosis.json`` (next to the event log unless ``folder``; on rank 0 only)."""
        if folder is None:
            if self.log_path is not None:
                folder = self.log_path.rsplit("/", 1)[0] if is_url(self.log_path) else os.path.dirname(self.log_path)
            elif self.out_dir is not None:
                folder = event_log_dir(self.out_dir)
        if folder is None or not is_rank0():
            return None
        path = join(folder, "diagnosis.json")
        write_text(path, json.dumps(_clean(diagnosis), indent=2))
        self.diagnosis_path = path
        return path

    def _agreed_snapshot(self) -> tuple[Any, dict[str, Any] | None, str | None]:
        """Several processes: the newest snapshot every process can read (one vote per snapshot
        tried, in the same order everywhere: the rings hold the same steps on every rank), so all
        ranks restore the same step even when one rank's file is damaged."""
        assert self.snapshots is not None
        usable = self.snapshots.usable()
        problems: list[str] = []
        for snap in usable:
            try:
                state: dict[str, Any] | None = self.snapshots.load_exact(snap)
            except SnapshotUnavailable as exc:
                state = None
                problems.append(str(exc))
            if self.collective.all_agree(state is not None):
                if snap is not usable[0]:
                    self.snapshots.problems.extend(problems or [f"snapshot of step {usable[0].step} unreadable "
                                                                "on another process"])
                return snap, state, None
            if state is not None:
                problems.append(f"snapshot of step {snap.step} unreadable on another process")
        return None, None, "; ".join(problems) or "no snapshot readable on every process"

    def _rollback(self, a: Action) -> dict[str, Any]:
        snap = self.snapshots.best() if self.snapshots is not None else None
        problem = None
        agreed_state = None
        if snap is not None and self.collective.world_size > 1:
            wanted = snap.step
            snap, agreed_state, problem = self._agreed_snapshot()
            if snap is None:
                self._emit({"type": "snapshot_fallback", "step": a.step, "wanted": wanted, "restored": None,
                            "problems": [problem]})
        if snap is not None:
            wanted = snap.step if agreed_state is None else wanted
            try:  # all or nothing: files, model and optimizer layout are checked before any change
                snap = self.snapshots.restore(snap, restore_schedule=self.config.recovery.restore_schedule,  # type: ignore[union-attr]
                                              restore_rng=self.config.recovery.restore_rng, state=agreed_state)
            except SnapshotUnavailable as exc:
                problem = str(exc)
                self._emit({"type": "snapshot_fallback", "step": a.step, "wanted": wanted, "restored": None,
                            "problems": [*self.snapshots.problems, problem]})  # type: ignore[union-attr]
                self.snapshots.problems.clear()  # type: ignore[union-attr]
                snap = None
        if snap is None:
            out = self._rollback_from_checkpoints(a)
            for source in ([] if out else self.rollback_sources):
                out = source(a)
                if out:
                    break
            if not out:
                return {"unavailable": f"rollback unavailable ({problem}): step skipped instead" if problem
                        else "no healthy snapshot yet: step skipped instead"}
            out.setdefault("confirmed", True)
            out["steps_lost"] = a.step - 1 - int(out["to_step"])
            if self.snapshots is not None:  # untested candidates hold weights from after the restored state
                self.snapshots.drop_untested()
        else:
            if snap.step != wanted or self.snapshots.problems:  # type: ignore[union-attr]
                self._emit({"type": "snapshot_fallback", "step": a.step, "wanted": wanted, "restored": snap.step,
                            "problems": list(self.snapshots.problems)})  # type: ignore[union-attr]
                self.snapshots.problems.clear()  # type: ignore[union-attr]
            out = {"to_step": snap.step, "confirmed": snap.confirmed, "steps_lost": a.step - 1 - snap.step}
        self.lr.reapply_after_restore()
        self.lr.rewarm()
        self.detectors.takeover.reset()  # the restored weights get a fresh window
        n_skip = self.config.recovery.skip_batches
        skipper = self.data_skip or self.actuators.get("skip_data")
        if n_skip and skipper is not None:
            skip = Action("skip_data", a.step, f"after rollback to step {out['to_step']}", {"batches": n_skip})
            skip.params.update(skipper(skip) or {})
            self._record(skip)
            self._extra_actions.append(skip)
            out["skipped_batches"] = n_skip
        return out

    # -- batch size --------------------------------------------------------------------------
    def attach_batches(self, controller: Any) -> None:
        """Let the policy resize the batch. ``controller`` has ``batch_size`` and ``base_batch_size``
        (samples per optimizer step), ``shrink_global()`` and ``grow_global()`` returning
        ``(old, new)`` or None, and ``shrink_micro()`` (same, or None when it cannot);
        ``gradguard.data.BatchController`` is one, the adapters wrap their engine's data loader.
        'shrink_batch' then halves the batch (global mode: LR scaled linearly) and a stable period
        doubles it back, with max_grad_norm held at ``recovery.grow_clip`` for a while."""
        self.batch_control = controller
        self.register_actuator("shrink_batch", self._shrink_batch)
        if self._maybe_grow not in self.healthy_hooks:
            self.healthy_hooks.append(self._maybe_grow)

    def _shrink_batch(self, a: Action) -> dict[str, Any]:
        ctl = self.batch_control
        if self.config.recovery.shrink_mode == "micro":
            moved = ctl.shrink_micro()
            if moved is None:
                return {"unavailable": "the micro-batch cannot be made smaller"}
            return {"micro_batch": list(moved), "accumulation": getattr(ctl, "accumulation_steps", None)}
        moved = ctl.shrink_global()
        if moved is None:
            return {"unavailable": f"the batch cannot be made smaller than {ctl.batch_size}"}
        self.lr.batch_scale = ctl.batch_size / ctl.base_batch_size  # linear scaling
        self._grow_healthy = 0
        return {"batch": list(moved), "lr_scale": self.lr.batch_scale}

    def _maybe_grow(self, step: int) -> Action | None:
        ctl = self.batch_control
        if ctl is None or ctl.batch_size >= ctl.base_batch_size:
            return None
        self._grow_healthy += 1
        if self._grow_healthy < self.config.recovery.grow_after:
            return None
        self._grow_healthy = 0
        moved = ctl.grow_global()
        if moved is None:
            return None
        self.lr.batch_scale = ctl.batch_size / ctl.base_batch_size
        rc = self.config.recovery
        self.clip.hold(rc.grow_clip, rc.grow_clip_steps)
        return Action("grow_batch", step, "stable period",
                      {"batch": list(moved), "lr_scale": self.lr.batch_scale,
                       "clip_held": rc.grow_clip, "for_steps": rc.grow_clip_steps})

    def scale_to_keep(self, report: StepReport) -> float | None:
        """The loss scale to put back after the engine's GradScaler update, or None to let it halve.
        Overflows that several halvings did not cure (a streak), or that restored weights meet,
        come from the forward pass or the data, not from the scale: halving it further would only
        underflow the healthy steps' gradients."""
        if not (self.config.policy.act and report.overflow and report.scale):
            return None
        if report.blamed_on_data or any(f.kind == "overflow_streak" for f in report.findings):
            return float(report.scale)
        return None

    def keep_scale(self, report: StepReport, scaler: Any) -> bool:
        """After the engine's GradScaler update: put back the scale :meth:`scale_to_keep` wants.
        True when it did."""
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
        closure without a GradScaler): the LR multiplier's pre-hook already ran with the multiplier
        of before this step's decision; it is undone for the decision and applied again after it."""
        if not active:
            yield
            return
        self.lr.suspend()
        try:
            yield
        finally:
            self.lr.rearm()
            sync_local_param_groups(self.optimizer)  # ZeroRedundancyOptimizer: this step's settings

    def detach(self) -> dict[str, Any]:
        """Remove the guard's optimizer hooks and close its sinks (end of an engine run)."""
        summary = self.close()
        self.lr.remove()
        return summary

    def record(self, action: Action) -> Action:
        """Count and log an action an adapter took by itself (e.g. an out-of-memory retry)."""
        return self._record(action)

    def _execute(self, a: Action) -> None:
        why_not = self.stepping.unavailable.get(a.name) if self.stepping is not None else None
        if why_not:
            a.params["unavailable"] = why_not
        elif a.name == "lower_lr":
            # not rewound by a rollback
            early = self.applied_steps < self.config.detect.warmup_steps or self._takeover_from_start
            factor = self.config.lr.early_down_factor if early else self.config.lr.down_factor
            old, new = self.lr.lower(failed_at=self._failed_mult, factor=factor)
            a.params["early"] = early
            a.params.update({"from": old, "to": new})
        elif a.name == "tighten_clip":
            if self.config.clip.mode == "off":
                a.params["unavailable"] = "clip.mode is 'off'"
            else:
                old, new = self.clip.tighten()
                a.params.update({"from": old, "to": new})
        elif a.name == "adam":
            if not self.adam.supported():
                a.params["unavailable"] = "optimizer has no betas/eps"
            else:
                a.params.update(self.adam.apply())
        elif a.name == "lower_layer_lr":
            named = [n for n, _ in self.culprits.most_common(3)]
            if not named:
                for pattern in self.config.lr.layer_groups.values():
                    named.extend(self.layers.match(pattern))
            a.params.update(self.lr.lower_layers(sorted(set(named))) if named else {"unavailable": "no layers"})
        elif a.name == "halt":
            pass
        elif a.name in self.actuators:
            a.params.update(self.actuators[a.name](a) or {})
        else:
            a.params["unavailable"] = f"no {a.name} actuator attached"
        self._record(a)

    def _record(self, a: Action) -> Action:
        self.action_counts[a.name] += 1
        event = {"type": "action", **a.to_dict(), "finding_ids": list(self._cause_ids)}
        self._action_log.append(event)
        self._emit(event)
        return a

    # -- reporting -------------------------------------------------------------------------
    def _emit(self, event: dict[str, Any]) -> None:
        event.setdefault("time", time.time())
        for s in self.sinks:
            s.log_event(event)

    def metrics(self, report: StepReport) -> dict[str, float]:
        m: dict[str, float] = {M.GRAD_NORM: report.total_norm, M.LR_MULT: report.lr_multiplier,
                               M.SKIPPED: float(self.skipped_steps), M.FINDINGS: float(self.n_findings),
                               M.LEVEL: float(self.policy.level)}
        if report.loss is not None:
            m[M.LOSS] = report.loss
        if self.config.clip.mode != "off":
            m[M.MAX_NORM] = self.clip.max_norm
        if report.scale is not None:
            m[M.SCALE] = report.scale
            m[M.OVERFLOW] = float(report.overflow)
        for name, v in report.layer_norms.items():
            m[f"{M.GRAD_NORM_LAYER}/{metric_key(name)}"] = v
        lrs = self._step_lrs or [float(g["lr"]) for g in self.optimizer.param_groups]
        for i, lr in enumerate(lrs):  # the LR applied at this step: the scheduler's x the multiplier
            m[f"{M.LR}/group{i}"] = lr * report.lr_multiplier
            m[f"{M.LR_SCHEDULED}/group{i}"] = lr
        for name, c in self.action_counts.items():
            m[f"{M.ACTION}/{name}"] = float(c)
        if self._before_params is not None:
            self._measure_update()
        m.update(self._ratios)
        return m

    def _measure_update(self) -> None:
        """Update ratio and weight norm per layer from the copy taken before the optimizer step
        (kept until the next measurement, so that an engine's later log call carries them)."""
        assert self._before_params is not None
        ratios, wn = self.measurer.update_ratios(self._before_params)
        self._before_params = None
        self._ratios = {}
        for name, r, w in zip(self.layers.layer_names, ratios, wn):
            self._ratios[f"{M.UPDATE_RATIO_LAYER}/{metric_key(name)}"] = r
            self._ratios[f"{M.PARAM_NORM_LAYER}/{metric_key(name)}"] = w

    def _emit_metrics(self, report: StepReport) -> None:
        m = self.metrics(report)
        for s in self.sinks:
            s.log_metrics(report.step, m)

    def diagnosis(self, report: StepReport, reason: str) -> dict[str, Any]:
        return {
            "step": report.step, "reason": reason, "loss": report.loss, "grad_norm": report.total_norm,
            "culprit_layers": [n for n, _ in self.culprits.most_common(8)],
            "actions_tried": dict(self.action_counts), "skipped_steps": self.skipped_steps,
            "lr_multiplier": self.lr.global_mult, "max_grad_norm": self.clip.max_norm,
            "recent_findings": list(self.recent_findings)[-10:],
            "advice": self.summary()["advice"],
        }

    def summary(self) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        final_lr = float(groups[0]["lr"]) * self.lr.current() if groups and "lr" in groups[0] else None
        out = {"steps": self.step_count, "applied": self.applied_steps, "skipped": self.skipped_steps,
               "findings": self.n_findings, "actions": dict(self.action_counts),
               "lr_multiplier": self.lr.global_mult, "final_lr": final_lr, "max_grad_norm": self.clip.max_norm,
               "log": self.log_path, "report": self.report_path}
        out["advice"] = advise(actions=list(self._action_log), summary=out, config=self.config.to_dict(),
                               optimizer=self._optimizer_at_start)
        return out

    def close(self) -> dict[str, Any]:
        """Write the summary, close the sinks and take the LR hooks off the optimizer (idempotent)."""
        summary = self.summary()
        self.lr.remove()  # the optimizer runs at the user's LR again
        if self.stepping is not None and hasattr(self.stepping, "release"):
            self.stepping.release()  # the engine clips as the user configured it again
        if self.snapshots is not None:
            self.snapshots.close()  # this run's snapshot files are of no use after it
        if not self._closed:
            self._closed = True
            for s in self.sinks:
                s.close(summary)
        return summary

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "step_count": self.step_count, "applied_steps": self.applied_steps,
            "skipped_steps": self.skipped_steps, "n_findings": self.n_findings, "verified": self._verified,
            "action_counts": dict(self.action_counts), "culprits": dict(self.culprits),
            "detectors": self.detectors.state_dict(), "policy": self.policy.state_dict(),
            "clip": self.clip.state_dict(), "lr": self.lr.state_dict(), "adam": self.adam.state_dict(),
            "snapshots": self.snapshots.state_dict() if self.snapshots is not None else None,
            "grow_healthy": self._grow_healthy, "model_signature": model_signature(self.model, self.shard_root),
            "checkpoints": self.checkpoint_tier.state_dict(),
            "config": self.config.to_dict(),  # compared on resume: gradguard.resume
            "action_log": self._advice_log(),  # the advice of a resumed run still sees them
        }

    def _advice_log(self) -> list[dict[str, Any]]:
        kept = [a for a in self._action_log if a.get("name") in ADVICE_ACTIONS][-ADVICE_LOG_SIZE:]
        return [_clean({"name": a["name"], "step": a.get("step"),
                        "params": {k: v for k, v in (a.get("params") or {}).items()
                                   if k not in ("skipped_indices", "preceding_indices")}}) for a in kept]

    def set_engine_step(self, fn: Callable[[int], int]) -> None:
        """For an engine whose loggers put a step at another x value (Lightning: the optimizer steps
        before the batch): the event log's records carry ``engine_step = fn(step)`` next to
        ``step``, so a JSONL record and the engine's logged row of the same batch can be matched."""
        for sink in self.sinks:
            if isinstance(sink, JSONLSink):
                sink.step_fn = fn

    def start_at(self, step: int) -> None:
        """A fresh guard joining a run after update ``step`` (resumed without a saved guard state: the
        callback was added on resume, or its state could not be used): its step numbers follow the
        engine's, so its reports, metrics and checkpoint entries name the engine's steps. Nothing
        else is assumed: no update has been seen, the detectors warm up as in a new run."""
        if self.step_count == 0 and step > 0:
            self.step_count = int(step)

    def checkpoint_state(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> dict[str, Any]:
        """The state to write into the engine checkpoint being saved after update ``step`` at
        ``paths``: :meth:`state_dict` with that checkpoint already in the rollback tier (engines
        serialise their callbacks' state before announcing the save). A run resumed from the
        checkpoint then holds exactly the state of the run that wrote it, the checkpoint it resumed
        from included. Changes nothing: the adapter still reports the save with
        :meth:`checkpoint_saved`."""
        state = self.state_dict()
        state["checkpoints"] = self.checkpoint_tier.state_with(step, list(paths))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate the whole state (version, model signature, every entry), then apply it; a
        ``gradguard.state.StateError`` means nothing was changed. A state saved with another config
        follows the resume rule of :mod:`gradguard.resume` (each conflict warned once)."""
        from .resume import reconcile
        from .state import load_core_state

        load_core_state(self, state, self._apply_state, STATE_VERSION)
        reconcile(self, state.get("config"))  # resumed with a changed config: the rule of gradguard.resume

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.step_count = state["step_count"]
        self.applied_steps = state["applied_steps"]
        self.skipped_steps = state["skipped_steps"]
        self._verified = state["verified"]
        self.n_findings = state["n_findings"]
        self.action_counts = Counter(state["action_counts"])
        self.culprits = Counter(state["culprits"])
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])
        self.clip.load_state_dict(state["clip"])
        self.lr.load_state_dict(state["lr"])
        self.adam.load_state_dict(state["adam"])
        if self.snapshots is not None and state.get("snapshots"):
            self.snapshots.load_state_dict(state["snapshots"])
        self._grow_healthy = int(state.get("grow_healthy", 0))
        if "checkpoints" in state:
            self.checkpoint_tier.load_state_dict(state["checkpoints"])
        self._action_log = deque((dict(a) for a in state.get("action_log") or []
                                  if isinstance(a, dict) and isinstance(a.get("name"), str)),
                                 maxlen=self._action_log.maxlen)


class Guard(GuardCore):
    """gradguard for a hand-written PyTorch loop.

    ``report = guard.step(loss)`` after ``backward()`` replaces gradient clipping,
    ``optimizer.step()``, ``scaler.step/update`` and ``scheduler.step()``. Rules:

    * Gradient accumulation: call ``guard.step`` only on the accumulation boundary, passing the
      mean micro-batch loss, or call ``guard.observe_loss(l)`` per micro-batch and ``guard.step()``.
    * Pass the *unscaled* loss; with a GradScaler the guard unscales the gradients itself.
    * A skipped step does not advance the scheduler (nor Adam's step count); the scheduler is
      stepped only after an applied optimizer step. ``ReduceLROnPlateau`` is left to the caller.
    * On a halt the step is not applied, ``diagnosis.json`` is written next to the event log and
      ``GradGuardHalt`` is raised (``output.halt_raises=False``: ``report.halt`` is True and
      ``guard.halted`` holds the diagnosis; stop the loop yourself).
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Guard:
        if cls is Guard and is_deepspeed_engine(model):  # gradguard.Guard(engine): see gradguard.deepspeed
            from .deepspeed import DeepSpeedGuard

            return super().__new__(DeepSpeedGuard)
        return super().__new__(cls)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, config: GuardConfig | None = None, sinks: list[Sink] | None = None,
                 out_dir: str | None = None, layer_fn: Callable[[str], str] | None = None,
                 batches: Any = None) -> None:
        from .adapter import refuse_setup
        from .misuse import MisuseWatch, check_optimizer

        if type(optimizer).__module__.startswith("deepspeed") or is_deepspeed_engine(getattr(model, "module", None)):
            raise UnsupportedSetupError(
                f"gradguard: optimizer={type(optimizer).__name__}: a DeepSpeed optimizer is stepped by its engine. "
                "Fix: pass the engine deepspeed.initialize returned, gradguard.Guard(engine), and call "
                "guard.step(loss) in place of engine.step()")
        check_optimizer(unwrap_optimizer(optimizer))  # closure optimizers (LBFGS) are refused
        refuse_setup(model)  # sharded layouts gradguard cannot measure (FSDP1 flat parameters of an unknown layout)
        self._misuse = MisuseWatch()
        config = GuardConfig.coerce(config)
        if not is_rank0():  # several processes: one event log and one console per run, as in every engine
            config = dataclasses.replace(config, output=dataclasses.replace(config.output, jsonl=False, console=False))
        super().__init__(model, optimizer, config=config, sinks=sinks, out_dir=out_dir, layer_fn=layer_fn,
                         scheduler=scheduler, scaler=scaler)
        self.user_optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        self._step_scheduler = scheduler is not None and not isinstance(scheduler, plateau)
        self.batches = batches
        self.halted: dict[str, Any] | None = None
        self._clip_params: list[nn.Parameter] | None = None  # monitor with a fixed clip: see _users_clip
        # ... under sharded FSDP1, clipped by the measured global norm (see step)
        self._fsdp1 = self.measurer.sharding is not None and bool(fsdp1_units(self.model))
        self.oom = OomRecovery(self, lambda: list(self.model.parameters()), self._shrink_micro_to, monitor_too=True)
        if batches is not None:
            self.attach_data_skip(self._skip_data)
            self.attach_batches(batches)
            # after a rollback the data position keeps moving forward: the controller is not rewound
        self._misuse.attach(self)  # misuse

    # -- batch controller actuators ----------------------------------------------------------
    def _skip_data(self, a: Action) -> dict[str, Any]:
        assert self.batches is not None
        preceding = [list(b) for b in self.batches.recent]
        skipped = self.batches.skip(int(a.params.get("batches", 0)))
        return {"skipped_indices": skipped, "preceding_indices": preceding}

    def accumulate(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor]) -> float:
        """Forward and backward over one step's samples (a ``StepBatch`` from the batch controller)
        in micro-batches, each loss weighted by its share of the step. On an out-of-memory error the
        partial gradients are dropped, the micro-batch is halved (the global batch is kept through
        more accumulation) and the same samples are tried again. Returns the step's mean loss;
        follow with ``guard.step()``."""
        if self.batches is None:
            raise ConfigError("gradguard: Guard.accumulate needs a batch controller. Fix: "
                             "Guard(..., batches=gradguard.data.BatchController(dataset, batch_size))")
        total = len(batch)
        ctl = self.batches

        def run(micro: int) -> torch.Tensor | None:
            acc: torch.Tensor | None = None
            for mb, n in batch.micro_batches(micro):
                loss = loss_fn(mb)
                weighted = loss * (n / total)
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
                acc = weighted.detach() if acc is None else acc + weighted.detach()
                del loss, weighted
            return acc

        # several DDP processes: the core's every-rank rule (gradguard.oom.EveryRank): the step's
        # backwards without DDP's sync, a rank that runs out of memory retries alone, one vote, the
        # gradients averaged by the guard
        ddp = ddp_wrapper(self.model) if self.collective.world_size > 1 else None
        ranks = EveryRank(self.oom, ddp, self.collective) if ddp is not None else None
        micro, message = ctl.micro_batch_size, ""
        samples = min(micro, total)

        def attempt(parts: int) -> torch.Tensor | None:
            try:
                return run(-(-micro // parts))
            except torch.OutOfMemoryError:
                raise PieceFailed(True) from None

        if ranks is not None:
            ranks.open_step()
        try:
            try:
                acc = run(micro)
            except torch.OutOfMemoryError as exc:
                if ranks is None and not self.oom.can_recover(samples, self.collective.world_size):
                    raise
                message = f"{type(exc).__name__}: {exc}"[:160]
                acc = None
            # the core's rule (gradguard.oom): the whole step is run again (nothing earlier to keep),
            # its micro-batches split into pieces until they fit; the controller's micro-batch follows
            if message and ranks is not None:
                acc = ranks.retry(attempt, samples=samples, message=message, touched=True)
                acc = None if acc is SKIPPED else acc
            elif message:
                acc = self.oom.recover(attempt, samples=samples, message=message, touched=True, earlier_grads=False)
            if ranks is not None:
                ranks.close_step([p for p in self.model.parameters() if p.requires_grad], samples)
        finally:
            if ranks is not None:
                ranks.release()
        self._loss_sum, self._loss_n = acc, 1
        return float("nan") if acc is None else float(acc)

    def _users_clip(self) -> EngineClip | None:
        """A guard that does not act (monitor) but has ``clip.mode="fixed"`` applies that fixed clip
        the way ``clip_grad_norm_(model.parameters(), clip.max_norm)`` does, bit-identically, from
        the step's one norm pass (instead of the user's own ``clip_grad_norm_``: a second pass)."""
        clip = self.config.clip
        if self.config.policy.act or clip.mode != "fixed":
            return None
        if self._clip_params is None:
            self._clip_params = list(self.model.parameters())
        return EngineClip(self._clip_params, float(clip.max_norm))

    def _shrink_micro_to(self, fits: int) -> tuple[int, int] | None:
        ctl = self.batches
        start = ctl.micro_batch_size
        while ctl.micro_batch_size > fits and ctl.shrink_micro() is not None:
            pass
        return (start, ctl.micro_batch_size) if ctl.micro_batch_size < start else None

    def step(self, loss: torch.Tensor | float | None = None) -> StepReport:
        self._misuse.step_begin(self, loss)  # misuse
        opt = self.user_optimizer
        if self.scaler is not None and not self._misuse.already_unscaled(self, self.scaler, opt):
            self.scaler.unscale_(opt)
        self._misuse.before(self, loss)
        own_clip = self._users_clip()
        report = self.before_step(loss, scaler=self.scaler, engine_clip=own_clip)
        self._misuse.after(self, report)
        if self.scaler is None:
            self._misuse.scaler_not_passed(self, report)
        if report.applied and own_clip is not None and self.replay_engine_clip(report) is None:
            if self._fsdp1:
                # FSDP1: clip_grad_norm_ would see this rank's shards only (each rank its own
                # coefficient: the replicas drift apart); torch's clip with the global norm just
                # measured, as FSDP1's own model.clip_grad_norm_ does
                report.engine_norm = report.total_norm
                torch.nn.utils.clip_grads_with_norm_(self.layers.unique_params(), own_clip.max_norm,
                                                     torch.tensor(report.total_norm))
            else:
                report.engine_norm = float(torch.nn.utils.clip_grad_norm_(own_clip.params, own_clip.max_norm))
        if report.applied:
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
        if self.scaler is not None:  # also after a skip: it resets the scaler's per-step state
            self.scaler.update(new_scale=self.scale_to_keep(report))
        if report.applied and self._step_scheduler:
            self.scheduler.step()
        self._misuse.step_end(self, report)  # misuse
        return self._finish(report)

    def _finish(self, report: StepReport) -> StepReport:
        """AFTER_OPTIMIZER_STEP of the plain loop: counters, metrics; a halt closes the guard and
        raises :class:`GradGuardHalt` (``output.halt_raises=False``: a warning)."""
        self.after_step(report)
        if report.halt:
            self.halted = report.diagnosis or {}
            self.close()
            if self.config.output.halt_raises:
                raise GradGuardHalt(self.halted)
            warn(str(GradGuardHalt(self.halted)), stacklevel=3)
        return report

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.batches is not None:
            state["batches"] = self.batches.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.batches is not None and isinstance(state, dict) and hasattr(self.batches, "check_state") \
                and "batches" in state:
            self.batches.check_state(state["batches"])  # before anything is applied
        super().load_state_dict(state)
        if self.batches is not None and "batches" in state:
            self.batches.load_state_dict(state["batches"])

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
