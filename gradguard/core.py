"""The core: measure -> detect -> decide -> act -> account, once per optimizer step.

:class:`GuardCore` is engine-agnostic. An engine adapter (the plain loop :class:`gradguard.Guard`,
the HF and Lightning callbacks, DeepSpeed) calls :meth:`GuardCore.before_step` when the gradients
are final (accumulated, unscaled, not yet clipped) and :meth:`GuardCore.after_step` once the
optimizer has (or has not) stepped; :mod:`gradguard.contract` lists the points of the loop.

One step reads straight through::

    before_step   measure: per-layer norms, loss, loss scale (one fused pass, one host read)
    decide        detect (findings) -> judge (the policy's decision) -> act (clip, skip, actuators)
    after_step    account: what the detectors learn (:func:`teaches`), counters, snapshots, metrics

The parts live beside it: :class:`gradguard.rollback.Rollback` (snapshots, trust tiers, the way
back), :class:`gradguard.reporting.Reporter` (sinks, events, metrics, alerts, diagnosis, summary),
:class:`gradguard.actuators.Actuators` (action name -> code), and the controllers of
:mod:`gradguard.act` (clip, LR multiplier, Adam).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import scaler_found_inf, scaler_scale
from ._shard import sharding
from .act import AdamTuner, ClipController, LRMultiplier, drop_grads, early_step_gain, unwrap_optimizer
from .actuators import Actuators, BatchResizer, OptimizerActuators
from .config import GuardConfig
from .contract import Collective, SteppingEngine
from .contract import collective as default_collective
from .detect import NORM_TAKEOVER, Detectors, Finding, Signals
from .engine_api import EngineAPI
from .errors import GradGuardHalt, UnsupportedSetupError, warn
from .measure import EngineClip, GradMeasurer, LayerMap, inner_norm_indices, metric_key, norm_layers
from .names import M
from .policy import Action, Decision, Policy
from .recovery import step_verdict
from .reporting import Reporter, optimizer_info
from .resume import reconcile
from .rollback import Rollback
from .running_stats import RunningStats
from .sinks import Sink
from .state import load_core_state, model_signature

#: the schedule position (LR / peak LR, decaying) below which a norm takeover is only reported
LATE_DECAY = 0.25

__all__ = ["GuardCore", "StepReport", "teaches", "STATE_VERSION"]

STATE_VERSION = 1


@dataclass
class StepReport:
    """What one guarded step did. ``applied`` is False when the optimizer step was skipped."""

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
    unstable: bool = False
    """The policy judged the step an instability (a confirmed spike, a takeover...), applied or not."""
    rolled_back: bool = False
    engine_norm: float | None = None
    """The engine's own total gradient norm (its log value) when ``before_step`` took the engine's
    norm pass over (``engine_clip``); else None."""
    engine_coef: float | None = None

    @property
    def skipped(self) -> bool:
        return not self.applied


def teaches(report: StepReport) -> bool:
    """THE rule of what the detectors learn from, for every detector (loss, grad norm, norm
    takeover, loss scale, and any added later): a step enters their baselines, windows and
    statistics only if its update was applied and nothing judged it bad. A skipped step (spike,
    non-finite values, an fp16 overflow, the engine's own overflow skip), a rolled-back step, a
    step blamed on the data, a step the policy judged an instability (a repeated spike whose update
    went through under a tighter clip) and a halting step teach nothing. Every detector *judges* every step
    (:meth:`Detectors.observe` stages what the step would teach); the core settles the lesson
    here, once the step's fate is final (:meth:`GuardCore.after_step`). An fp16 overflow is the
    loss-scale detector's event (its streak and rate count overflows), not a lesson."""
    return (report.applied and not report.halt and not report.overflow and not report.blamed_on_data
            and not report.rolled_back and not report.unstable)


def finish_halt(core: GuardCore, diagnosis: dict[str, Any]) -> None:
    """HALT in a loop the guard drives (plain, DeepSpeed): the guard is closed, then
    :class:`GradGuardHalt` is raised (``output.halt_raises=False``: a warning; the caller stops)."""
    core.close()
    if core.config.output.halt_raises:
        raise GradGuardHalt(diagnosis)
    warn(str(GradGuardHalt(diagnosis)), stacklevel=4)


class GuardCore(EngineAPI):
    """The engine-agnostic guard and the engine API (see :mod:`gradguard.contract`).
    ``collective`` (default: :func:`gradguard.contract.collective`) combines the step's measurement
    over processes and votes on checkpoint restores; ``reduce`` overrides only the former.
    ``shard_root``: the engine's wrapper around ``model`` when it shards from outside it (an FSDP1
    root unit around a LightningModule), read for the sharding layout. ``stepping``: an engine that
    runs the optimizer step itself (DeepSpeed, see :mod:`gradguard.deepspeed`)."""

    def __init__(self, model: nn.Module, optimizer: Any, *, config: GuardConfig | None = None,
                 sinks: list[Sink] | None = None, out_dir: str | None = None,
                 layer_fn: Callable[[str], str] | None = None, scheduler: Any = None,
                 scaler: Any = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 collective: Collective | None = None, shard_root: nn.Module | None = None,
                 stepping: SteppingEngine | None = None, engine: str = "plain") -> None:
        config = GuardConfig.coerce(config)
        if not isinstance(model, nn.Module):
            raise UnsupportedSetupError(f"gradguard: model={type(model).__name__} is not a torch.nn.Module. "
                                        "Fix: pass the module whose parameters the optimizer trains")
        self.config, self.model, self.stepping, self.scheduler = config, model, stepping, scheduler
        self.collective: Collective = collective if collective is not None else default_collective()
        # cross-rank combination of the step's packed measurements (DDP): one reduction per step
        self.reduce = reduce if reduce is not None else (
            self.collective.mean if self.collective.world_size > 1 else None)
        self.optimizer = unwrap_optimizer(optimizer)
        self.shard_root = shard_root
        self.layers, self.measurer = self._measurement(layer_fn)
        self.detectors = Detectors(config.detect)
        self._watch_norms()
        self._layers_version = self.layers.version
        self.policy = Policy(config.policy)
        self.clip = ClipController(config.clip)
        # a stepping engine may call the optimizer once per param group: the multiplier goes on
        # around the engine's whole step instead (LRMultiplier.engine_begin / engine_end)
        self.lr = LRMultiplier(config.lr, self.optimizer, self.layers, hooks=config.policy.act and stepping is None)
        self.adam = AdamTuner(config.adam, self.optimizer)
        self.reporter = Reporter(config, sinks, out_dir)
        #: the engine's name ("plain", "hf", "lightning", "deepspeed"): the advice names its settings
        self.engine = engine
        self._untaught_applied = 0  # applied steps that taught nothing since the last that did
        self.rollback = Rollback(config, model, self.optimizer, scheduler=scheduler, scaler=scaler,
                                 collective=self.collective, detectors=self.detectors, lr=self.lr, clip=self.clip,
                                 emit=self.reporter.emit,
                                 extra_state=stepping.snapshot_state() if stepping is not None else None)
        # the engine checkpoints' fingerprints go into gradguard's run folder, beside the event log
        self.rollback.checkpoint_tier.ledger_dir = self._run_folder
        self.actuators = Actuators(stepping.unavailable if stepping is not None else None)
        OptimizerActuators(config, lr=self.lr, clip=self.clip, adam=self.adam, layers=self.layers,
                           early=self._early, failed_at=self._failed_at, culprits=self._culprits).register(self.actuators)
        if self.rollback.snapshots is not None:
            self.actuators.register("rollback", self.rollback)
        self.rollback.weights_clean = self._weights_clean
        self.batches: BatchResizer | None = None
        #: BatchNorm-like statistics moved by a step's forward, put back when the step is skipped
        self.running_stats = RunningStats(model) if config.policy.act else None
        self._step_state()
        self.reporter.start(list(self.layers.layer_names), optimizer_info(self.optimizer), engine)

    def _step_state(self) -> None:
        """The counters and the per-step context of a fresh core."""
        self.step_count = self.applied_steps = self.skipped_steps = 0
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_n = 0
        self._before_params: list[torch.Tensor] | None = None
        self._step_lrs: list[float] = []
        self._ratios: dict[str, float] = {}  # the latest update ratios / param norms (kept for engines' log steps)
        #: engine hook: True for a step the engine will log (update ratios are measured for it)
        self.ratio_due: Callable[[int], bool] | None = None
        #: the full row of the latest step the engine logs itself (see ``after_step(engine_logs=True)``)
        self.pending_row: dict[str, float] | None = None
        self._failed_mult = 1.0  # LR multiplier level at which the current step's instability happened
        self._sched_pos: float | None = None  # the previous step's schedule position (see _ramp_position)
        self._sched_rising = False  # it rose at its last move (a held scheduler keeps the direction)
        self._sched_rose_at: int | None = None  # the last step at which it rose
        self._sched_peak = 0.0  # the highest schedule position seen
        self._early_now = False
        self._restored_now = False  # this step put earlier weights back (their statistics with them)
        self._last: StepReport | None = None
        self._own_clip_coef: float | None = None  # this step's coefficient of the guard's own clip
        self._clip_params: list[torch.Tensor] | None = None
        self._clip_params_version = -1

    def _measurement(self, layer_fn: Callable[[str], str] | None) -> tuple[LayerMap, GradMeasurer]:
        """The layer map and the measurer (FSDP: local pieces, summed by the step's one reduction).
        A stepping engine's optimizer holds its own flat copies of the parameters (ZeRO's fp32
        partitions): the layer map then names the module's parameters without following it."""
        model, stepping = self.model, self.stepping
        layers = LayerMap(model, layer_fn or self.config.measure.layer_pattern,
                          optimizer=self.optimizer if stepping is None else None, root=self.shard_root)
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if stepping is None and layers.params and not any(id(p) in in_opt for p in layers.params):
            raise UnsupportedSetupError("gradguard: none of the model's trainable parameters is in the optimizer. "
                                        "Fix: pass the same model the optimizer was built from")
        measurer = GradMeasurer(layers)
        measurer.sharding = sharding(self.shard_root if self.shard_root is not None else model,
                                     self.collective.world_size, self.reduce)
        return layers, measurer

    def _watch_norms(self) -> None:
        """The takeover rule's layers: the final norm, or (post-LN) the norms inside the blocks."""
        final = norm_layers(self.model, self.layers)
        inner = inner_norm_indices(self.model, self.layers) if not final and self.measurer.sharding is None else []
        self.measurer.set_watch(inner)
        self.detectors.takeover.set_layers(list(self.layers.layer_names), final, inner=bool(inner))

    def _layers_joined(self) -> None:
        """Parameters became trainable: the total-norm baseline starts over (a warm-up of its own)
        rather than reading the larger norm as a spike; the takeover rule sees the new layers."""
        self._layers_version = self.layers.version
        self.detectors.grad.restart_total()
        self._watch_norms()
        self.emit({"type": "layers_joined", "step": self.step_count + 1, "layers": list(self.layers.layer_names)})

    # -- measure -----------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Record one micro-batch loss (unscaled); the step's loss is their mean."""
        value = loss.detach().float() if isinstance(loss, torch.Tensor) else float(loss)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_n += 1

    @property
    def has_loss(self) -> bool:
        """Micro-batch losses were observed since the last step."""
        return self._loss_n > 0

    def take_loss(self, loss: torch.Tensor | float | None = None) -> torch.Tensor | float | None:
        """The step's loss (``loss``, else the mean of the observed micro-batch losses); forgets them."""
        if loss is None and self._loss_n:
            loss = self._loss_sum / self._loss_n  # type: ignore[operator]
        self._loss_sum, self._loss_n = None, 0
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().mean() if loss.numel() > 1 else loss.detach()
        return loss

    def before_step(self, loss: torch.Tensor | float | None = None, *, scaler: Any = None,
                    drop_on_skip: bool = False, engine_clip: EngineClip | None = None) -> StepReport:
        """BEFORE_OPTIMIZER_STEP, gradients final and unscaled: measure (one sync), then
        :meth:`decide`. ``drop_on_skip``: a skipped step also sets every grad to None (engines that
        call ``optimizer.step()`` anyway). ``engine_clip``: a guard that does not clip, in an engine
        that does: the same pass yields the engine's norm (:meth:`replay_engine_clip`)."""
        step = self.step_count + 1
        self.first_snapshot()
        loss_v = self.take_loss(loss)
        scale_t = scaler_scale(scaler)
        found_t = scaler_found_inf(scaler, self.optimizer)
        own = self._own_clip() if engine_clip is None else None
        meas = self.measurer.measure([loss_v, scale_t, found_t], reduce=self.reduce, engine=engine_clip or own)
        self._own_clip_coef = meas.engine_coef if own is not None else None
        grads, self.measurer.last_grads = self.measurer.last_grads, []  # never held past this step
        if self.layers.version != self._layers_version:
            self._layers_joined()
        loss_f, scale_f, found_f = meas.extras
        sig = Signals(step=step, loss=None if loss_v is None else loss_f, total_norm=meas.total_norm,
                      layer_norms=dict(zip(self.layers.layer_names, meas.layer_norms)),
                      nonfinite_layers=meas.nonfinite_layers, scale=None if scale_t is None else scale_f,
                      overflow=bool(found_t is not None and found_f > 0), inner_norm=meas.watched_norm)
        if own is not None:  # the guard's own clip: not an engine's, nothing for the engine to log
            return self.decide(sig, grads, drop_on_skip=drop_on_skip)
        return self.decide(sig, grads, drop_on_skip=drop_on_skip, engine_norm=meas.engine_norm,
                           engine_coef=meas.engine_coef)

    def _own_clip(self) -> EngineClip | None:
        """The guard's fixed clip, measured the way ``clip_grad_norm_(model.parameters(), max_norm)``
        computes it (see :class:`EngineClip`), so that a step the guard clips without acting scales
        the gradients bit-identically to that call: a run in which the guard takes no action is the
        user's clipped run, digit for digit (not one that drifts an ulp away each step and, in a
        chaotic run, ends 1% apart). Not for a stepping engine (it clips itself) nor adaptive mode
        (its threshold follows the norm just measured)."""
        cfg = self.config
        if not cfg.policy.act or cfg.clip.mode != "fixed" or self.stepping is not None:
            return None
        if self._clip_params is None or self._clip_params_version != self.layers.version:
            self._clip_params = [p for p in self.model.parameters() if p.requires_grad]
            self._clip_params_version = self.layers.version
        return EngineClip(self._clip_params, float(self.clip.max_norm))

    # -- detect -> decide -> act ---------------------------------------------------------------------
    def decide(self, sig: Signals, grads: list[torch.Tensor], *, drop_on_skip: bool = False,
               engine_norm: float | None = None, engine_coef: Any = None,
               engine_skipped: bool | None = None) -> StepReport:
        """Detect, decide and act on one step's signals (already combined over processes).
        ``grads``: this process's gradient tensors, clipped here in place. ``engine_skipped``:
        None before the optimizer step; True/False after a stepping engine stepped (it skipped on
        its own overflow, or applied the update: a skip then becomes a rollback)."""
        findings = self.detectors.observe(sig)
        decision = self._judge(sig, findings, engine_skipped)
        report = StepReport(step=sig.step, applied=not decision.skip, skip_reason=decision.skip_reason,
                            loss=sig.loss, total_norm=sig.total_norm, layer_norms=sig.layer_norms,
                            scale=sig.scale, overflow=sig.overflow, findings=findings,
                            blamed_on_data=decision.data_verdict, unstable=decision.unstable,
                            engine_norm=engine_norm, engine_coef=engine_coef)
        if engine_skipped is not None:
            report.applied = not engine_skipped and not decision.skip
        self._clip(sig, decision, report, grads, engine_skipped)
        self.reporter.findings(findings)
        self._verdicts(sig, decision, findings)
        self._act(decision, report, engine_skipped)
        self._settle_step(decision, report, drop_on_skip)
        self._prepare_update(sig, report, engine_skipped)
        self._last = report
        return report

    def _judge(self, sig: Signals, findings: list[Finding], engine_skipped: bool | None) -> Decision:
        """The policy's decision; under a stepping engine that applied the step, a skip becomes a rollback."""
        grad_ratio = self.detectors.grad.ratio(sig.total_norm)
        if self._late_in_decay():  # a takeover there is reported, not acted on (see _late_in_decay)
            findings = [f for f in findings if f.kind != NORM_TAKEOVER]
        decision = self.policy.decide(sig, findings, grad_ratio, weights_verified=self.rollback.verified,
                                      lr_rose=self._lr_rose(sig.step))
        if (engine_skipped is False and decision.skip and self.config.policy.act
                and not any(a.name == "rollback" for a in decision.actions)):
            name = self.stepping.name if self.stepping is not None else "engine"
            decision.actions.insert(0, Action("rollback", sig.step, f"{decision.skip_reason}: the engine ({name}) "
                                              "already applied the step", {"replaces": "skip"}))
        return decision

    def _clip(self, sig: Signals, decision: Decision, report: StepReport, grads: list[torch.Tensor],
              engine_skipped: bool | None) -> None:
        if not self.config.policy.act:
            return
        clip_to = report.clip_to = self.clip.threshold(sig.total_norm)
        if engine_skipped is not None and self.stepping is not None:
            before = self.stepping.clip()
            report.clipped = bool(not engine_skipped and before and sig.total_norm > before)
        elif not decision.skip:  # the gradients just measured (nothing ran in between)
            coef = self._own_clip_coef
            if (coef is not None and clip_to == self.clip.max_norm and math.isfinite(sig.total_norm)
                    and self.measurer.replay_clip(coef) is not None):  # as clip_grad_norm_ scales
                report.clipped = coef < 1.0
                self.clip.clipped += report.clipped
            else:
                report.clipped = self.clip.apply(grads, sig.total_norm, clip_to)
        self.clip.observe(sig.total_norm, clip_to)

    def _verdicts(self, sig: Signals, decision: Decision, findings: list[Finding]) -> None:
        """The step's verdict for the trust tiers, and the context the LR cut reads."""
        # a quiet stall in progress: weights saved now already carry it, so they are not confirmed
        suspect = decision.suspect or self.detectors.takeover.suspect
        healthy = not (decision.unstable or suspect) and sig.loss is not None and math.isfinite(sig.loss)
        ckpt_healthy, ckpt_bad = step_verdict(findings, sig.loss, unstable=decision.unstable, suspect=suspect)
        self.rollback.observe(sig.step, ring_healthy=healthy and not decision.skip, ckpt_healthy=ckpt_healthy,
                              ckpt_bad=ckpt_bad)
        # the level this step's instability happened at, in terms of the schedule's peak
        pos = self._ramp_position()
        if decision.unstable and pos < 1:  # RMSprop's first steps run hotter than its LR: see _ramp_position
            pos = min(1.0, pos * early_step_gain(self.optimizer))
        self._failed_mult = self.lr.level() * pos * pos  # pos**2: see _ramp_position
        # a takeover since the first steps (the body never learned): the LR is grossly too high, as
        # with a blow-up before the run learned anything, so the LR gets the same deep cut
        warm = self.config.detect.warmup_steps
        from_start = any(f.kind == NORM_TAKEOVER and f.baseline is not None
                         and (f.baseline <= 3 * warm or self._from_warmup(f.baseline)) for f in findings)
        # judged now, before a rollback restores earlier detector states
        self._early_now = from_start or (self.applied_steps < warm and not self.detectors.loss.progressed())
        decision.suspect = suspect

    def _warmup_window(self) -> int | None:
        """The last step a takeover can start at and still be the warm-up's: two takeover windows
        after the scheduled LR last rose (None: no rising schedule seen), and never past
        ``4 x recovery.snapshot_interval`` steps (a long warm-up keeps the ordinary rollback: going
        back to the start would throw away more than it was measured on). An LR far too high does
        its damage while the warm-up raises it; a takeover shows it once a window's median has risen."""
        if self._sched_rose_at is None:
            return None
        end = self._sched_rose_at + 2 * self.config.detect.takeover_window
        return end if end <= 4 * self.config.recovery.snapshot_interval else None

    def _from_warmup(self, onset: float) -> bool:
        """A takeover that began within :meth:`_warmup_window` while the initial weights are held:
        every later state carries the warm-up's damage (measured: an LR 3x too high cut x1/3 at the
        end of a 30-step warm-up ends where the run ends uncut; cut a third of the way in, it lands
        on the tuned run), so it goes back to the start with the deep cut, as a takeover since the
        first steps does (Llama at 33x the best LR, a takeover found at step 68 of 300: 2.854 with
        a rollback to step 40 and x0.3, 2.489 from the initial weights, 2.815 unguarded)."""
        end = self._warmup_window()
        return end is not None and onset <= end and self.rollback.initial_step() is not None

    def _late_in_decay(self) -> bool:
        """The schedule has decayed below a quarter of the highest position it reached (as of the
        last step).
        The takeover rule reads a quiet stall as an LR too high; this late the LR is small, and its
        remedy (a rollback to before the takeover's window, an LR cut) would throw away most of the
        run in its last steps: the finding is reported, not acted on."""
        pos = self._sched_pos
        return pos is not None and not self._sched_rising and pos < LATE_DECAY * self._sched_peak

    def _ramp_position(self) -> float:
        """Where a rising warm-up stands: the scheduler's LR over its peak (``initial_lr``) while it is
        below 1 and rose at its last move (a scheduler held on skipped steps keeps still), else 1. The multiplier scales the whole
        schedule, so an instability at 30% of a warm-up failed at 0.3 of the peak: a cut from the
        multiplier alone would take the ramp back up to the very LR that failed. The level treated
        as failed is the multiplier x pos**2, not x pos: a ramp blows up once the weights have moved
        far enough (the summed LR), so a steeper ramp (a higher peak) gets further before it fails and
        the LR at the failure overstates what the run tolerates. Measured on the LR-sensitivity
        benchmark (30 warm-up steps): peaks 0.03 / 0.1 / 0.3 failed at LRs 0.013 / 0.025 / 0.045 after
        summed LRs of 0.09 / 0.12 / 0.15; peak x pos**2 is 0.007 / 0.009 / 0.012 against a best LR of
        0.003. In a decay, a flat schedule, or one whose base is not its peak, the position is 1 and
        nothing changes. An optimizer whose first steps run hotter than its LR (RMSprop: no bias
        correction) failed further up than the LR says: :meth:`_verdicts` scales the position by
        :func:`gradguard.act.early_step_gain` (RMSprop at 10x its LR, a spike at step 9 of a 30-step
        warm-up, seeds 0-3: 2.388-2.463 against 2.543-2.767 with the user's clip; the cut read at
        the nominal LR ended at 2.564-2.683)."""
        g = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        base, now = g.get("initial_lr"), (self.lr.scheduled_lrs() or [None])[0]
        self.lr.observe_schedule(now)  # what a cut that the schedule passes reads (LRMultiplier.follow_schedule)
        if not isinstance(base, (int, float)) or not isinstance(now, (int, float)) or base <= 0:
            return 1.0
        pos, prev = float(now) / float(base), self._sched_pos
        if prev is not None and pos != prev:
            self._sched_rising = pos > prev
            if pos > prev:
                self._sched_rose_at = self.step_count + 1
        self._sched_pos, self._sched_peak = pos, max(self._sched_peak, pos)
        return pos if self._sched_rising and 0 < pos < 1 else 1.0

    def _lr_rose(self, step: int) -> bool:
        """Repeated spikes are the LR's, never ambiguous (:meth:`Policy._ambiguous`), while the
        scheduled LR rises, within ``policy.spike_confirm_window`` steps after it last rose (a glitch:
        x30 for a few steps, decaying inside it), and before the run made progress."""
        recent = (self._sched_rose_at is not None
                  and step - self._sched_rose_at <= self.config.policy.spike_confirm_window)
        return self._sched_rising or recent or self._before_progress()

    def _before_progress(self) -> bool:
        """Fewer applied steps than the detectors' warm-up: a blow-up this early is the LR's (an LR
        far too high spikes at once and may calm for a step), never ambiguous (:meth:`Policy._ambiguous`)."""
        return self.applied_steps < self.config.detect.warmup_steps

    def _early(self) -> bool:
        """The instability came before the run learned anything: a blow-up in the first steps of a
        run whose loss never fell, or a takeover since the first steps. The LR is then grossly too
        high and gets the deep cut (``lr.early_down_factor``); a warm-up overshoot after progress
        gets the ordinary one."""
        return self._early_now

    def _weights_clean(self) -> bool:
        return self._untaught_applied == 0

    def _failed_at(self) -> float:
        return self._failed_mult

    def _culprits(self) -> list[str]:
        return [n for n, _ in self.reporter.culprits.most_common(3)]

    def _act(self, decision: Decision, report: StepReport, engine_skipped: bool | None) -> None:
        """Run the decision's actions through the actuators; a rollback discards the step."""
        if any(a.name == "rollback" for a in decision.actions):
            if not decision.ambiguous:  # nothing to undo: an ambiguous rollback keeps the LR
                self.rollback.remember_escalation()
            self._rollback_target(decision, report)
            if self.running_stats is not None and self.stepping is None:
                self.running_stats.settle(False)  # the weights put aside keep their statistics, not this batch's
            for a in decision.actions:
                if a.name == "rollback":
                    self.rollback.hold(a)
        elif decision.data_verdict:
            for undone in (self.rollback.undo_escalation(report.step), self.rollback.return_to_held(report.step)):
                if undone is not None:
                    report.actions.append(self.record(undone))
                    self._restored_now = self._restored_now or undone.name == "undo_rollback"
        elif (self.rollback.trial_due and self.stepping is None and not decision.skip and not decision.halt
              and not decision.actions):
            self._trial_return(decision, report)
        for a in decision.actions:
            follow = self.execute(a)
            report.actions.extend([a, *follow])
            if a.name != "rollback":
                continue
            restored = "to_step" in a.params
            report.applied = False  # the gradients came from the discarded weights
            report.rolled_back = restored
            report.skip_reason = report.skip_reason or (
                "rolled back" if restored else "instability (no snapshot to roll back to)")
            decision.skip = True
            if engine_skipped is not None and not restored:
                report.applied = not engine_skipped  # nothing to go back to: the update stays
            if restored:
                self.policy.last_escalation = None  # restored weights: no cooldown
                if decision.ambiguous:
                    self.policy.extend_probation(a.params.get("steps_lost", 0))

    def _trial_return(self, decision: Decision, report: StepReport) -> None:
        """The batch after an ambiguous rollback was clean on the restored weights: that says nothing
        of the weights the rollback left (two or three bad batches in a row, or damaged weights?).
        Training goes back to them and this step is skipped (its gradients came from the restored
        weights); the next batch on them decides: clean, they were fine (one batch lost, not the
        rollback's steps); a spike, they are damaged and the ladder climbs (probation)."""
        undone = self.rollback.return_to_held(report.step, trial=True)
        if undone is None:
            return
        report.actions.append(self.record(undone))
        decision.skip = True
        report.applied = False
        report.skip_reason = "back to the weights the ambiguous rollback left (on trial)"
        self.policy.start_probation(report.step)
        self._restored_now = True

    def _rollback_target(self, decision: Decision, report: StepReport) -> None:
        """A norm takeover found now began before its window: snapshots taken since then already
        carry it, so the rollback goes to one from before (``not_after``). An instability before the
        run learned anything (:meth:`_early`) goes back to the initial weights while they are held
        (pinned for the first ``recovery.snapshot_interval`` applied steps, and through a warm-up and
        two takeover windows after it: :meth:`_warmup_window`): every later state carries the
        damage of the LR that was too high, and at the deep cut it does not heal (an LR
        33x too high through a warm-up, rolled back to step 10: 3.080 against 2.868 unguarded;
        restarted from the initial weights: 2.839)."""
        window = self.config.detect.takeover_window
        starts = [int(f.baseline) - window for f in report.findings if f.kind == NORM_TAKEOVER and f.baseline is not None]
        initial = self.rollback.initial_step() if self._early_now else None
        if initial is not None:  # the run never learned: every later state carries the bad LR's damage
            starts.append(initial)
        for a in decision.actions:
            if a.name == "rollback" and starts:
                a.params["not_after"] = max(0, min(starts))

    def _settle_step(self, decision: Decision, report: StepReport, drop_on_skip: bool) -> None:
        """Healthy-period bookkeeping, the skip and the halt."""
        causes = self.reporter.take_causes()  # later actions (relaxations, growth) answer none
        act = self.config.policy.act
        if decision.unstable:
            self.lr.mark_unstable(self._failed_mult)
            self.clip.reset_healthy()
        elif act and not decision.skip:
            relaxed = self.clip.tick_healthy()
            if relaxed:
                report.actions.append(self.record(Action("relax_clip", report.step, "stable period",
                                                         {"from": relaxed[0], "to": relaxed[1]})))
            moved = self.lr.follow_schedule()
            if moved:
                name, p = moved
                why = (f"the schedule fell to {p['scheduled_lr']:.3g}, below the cut of the LR that failed "
                       f"({p['failed_lr']:.3g}): that LR has passed" if name == "lift_lr" else
                       f"the schedule rose to {p['scheduled_lr']:.3g}, above the lifted cut of the LR that failed "
                       f"({p['failed_lr']:.3g})")
                report.actions.append(self.record(Action(name, report.step, why, p)))
            recovered = self.lr.tick_healthy()
            if recovered:
                report.actions.append(self.record(Action("recover_lr", report.step, "stable period", recovered)))
            report.healthy = not decision.suspect
        if decision.skip:
            self.skipped_steps += 1
            self.emit({"type": "skip", "step": report.step, "reason": report.skip_reason or "skipped",
                       "finding_ids": causes})
            if drop_on_skip:
                drop_grads(self.layers.params)
            report.clipped = False
        if decision.halt:
            report.halt, report.applied = True, False
            if drop_on_skip and not decision.skip:
                drop_grads(self.layers.params)  # the halting step is never applied, in any engine
            reason = next((a.reason for a in decision.actions if a.name == "halt"), "policy halt")
            report.diagnosis = self.reporter.diagnosis(report, reason, self.run_state())
            self.emit({"type": "halt", "step": report.step, "message": report.diagnosis["reason"],
                       "finding_ids": causes, "diagnosis": report.diagnosis})
            self.write_diagnosis(report.diagnosis)

    def _prepare_update(self, sig: Signals, report: StepReport, engine_skipped: bool | None) -> None:
        """What the optimizer step runs with: the LRs to log, a copy for the update ratios, the
        clip a stepping engine applies next."""
        report.lr_multiplier = self.lr.current()
        # the scheduler's LRs this optimizer step runs with (engines log after the scheduler moved on)
        self._step_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if engine_skipped is not None:
            if self.stepping is not None and self.config.policy.act and self.config.clip.mode != "off":
                self.stepping.set_clip(self.clip.threshold(sig.total_norm))
        elif report.applied and (sig.step % self.config.measure.log_interval == 0
                                 or (self.ratio_due is not None and self.ratio_due(sig.step))):
            self._before_params = [t.clone() for t in self.layers.tensors()]

    # -- account -----------------------------------------------------------------------------------
    def after_step(self, report: StepReport, *, engine_logs: bool | None = None) -> None:
        """AFTER_OPTIMIZER_STEP: what the detectors learn, counters, snapshots, metrics, alerts.

        ``engine_logs``: None for an engine without a logging cadence of its own (the plain loop:
        every sink gets the metrics every ``output.metrics_interval`` steps and at every step with an
        event). True/False from an adapter whose engine logs on its own cadence and says whether it
        logs this step: the engine-bound sinks then get a row only at an event step the engine does
        not log, and on a logged step the full row waits in :attr:`pending_row` for the adapter."""
        self.step_count = report.step
        taught = teaches(report)
        self.detectors.settle(taught)  # before a snapshot stores the detectors
        self._untaught_applied = 0 if taught else self._untaught_applied + int(report.applied)
        restored, self._restored_now = self._restored_now, False
        if self.running_stats is not None:  # a skipped step's forward moved them; a restore put back others
            self.running_stats.settle(report.applied or report.rolled_back or restored)
        if report.applied:
            self.applied_steps += 1
            if report.healthy and self.batches is not None:  # changes that wait for the next step's data
                grown = self.batches.maybe_grow(report.step)
                if grown is not None:
                    report.actions.append(self.record(grown))
            end = self._warmup_window()
            self.rollback.applied(report.step, self.applied_steps, hold_initial=end is not None and report.step <= end)
        if self._before_params is not None:
            self._measure_update()
        events = self.reporter.event_metrics(report)
        due = report.step % self.config.output.metrics_interval == 0
        self.pending_row = None
        if due or events or engine_logs:
            row = {**self.metrics(report), **events}
            self.reporter.log_row(report.step, row, due=due, events=bool(events), engine_logs=engine_logs)
            if engine_logs:
                self.pending_row = row
        self.reporter.alert(report, self.lr.global_mult, self.clip.max_norm)
        self.reporter.end_step(report.step)

    def metrics(self, report: StepReport) -> dict[str, float]:
        """The step's metric row (run-level values, per-layer norms, LRs, action counts, update ratios)."""
        lrs = self._step_lrs or [float(g["lr"]) for g in self.optimizer.param_groups]
        m = self.reporter.metrics(report, skipped=self.skipped_steps, level=self.policy.level,
                                  max_norm=self.clip.max_norm if self.config.clip.mode != "off" else None, lrs=lrs)
        if self._before_params is not None:
            self._measure_update()
        m.update(self._ratios)
        return m

    def _measure_update(self) -> None:
        """Update ratio and weight norm per layer from the copy taken before the optimizer step."""
        assert self._before_params is not None
        ratios, wn = self.measurer.update_ratios(self._before_params)
        self._before_params = None
        self._ratios = {}
        for name, r, w in zip(self.layers.layer_names, ratios, wn):
            self._ratios[f"{M.UPDATE_RATIO_LAYER}/{metric_key(name)}"] = r
            self._ratios[f"{M.PARAM_NORM_LAYER}/{metric_key(name)}"] = w

    def emit(self, event: dict[str, Any]) -> None:
        """Send an event to every sink (adapters' own events: saves, resizes...)."""
        self.reporter.emit(event)

    def execute(self, a: Action) -> list[Action]:
        """Carry action ``a`` out through the actuators and record it; returns the follow-up
        actions it caused (recorded too: the data window skipped after a rollback)."""
        follow = self.actuators.run(a)
        self.record(a)
        for f in follow:
            self.record(f)
        return follow

    def record(self, action: Action) -> Action:
        """Count and log an action (the core's, or one an adapter took: an out-of-memory retry)."""
        return self.reporter.record(action)

    def first_snapshot(self) -> None:
        """The initial (or resumed) weights, before any update: snapshotted once, before the first step."""
        self.rollback.first_snapshot(self.step_count)

    def run_state(self) -> dict[str, Any]:
        """The run's counters and settings now (for the diagnosis and the summary). ``final_lr``:
        the first group's LR the optimizer runs with now, the multiplier in force included."""
        groups = self.optimizer.param_groups
        final_lr = float(groups[0]["lr"]) * self.lr.current() if groups and "lr" in groups[0] else None
        return {"steps": self.step_count, "applied": self.applied_steps, "skipped": self.skipped_steps,
                "lr_multiplier": self.lr.global_mult, "lr_multiplier_now": self.lr.current(), "final_lr": final_lr,
                "max_grad_norm": self.clip.max_norm, "engine": self.engine}

    def summary(self) -> dict[str, Any]:
        return self.reporter.summary(self.run_state())

    def close(self) -> dict[str, Any]:
        """Write the summary, close the sinks and take the LR hooks off the optimizer (idempotent)."""
        summary = self.summary()
        self.lr.remove()  # the optimizer runs at the user's LR again
        if self.stepping is not None and hasattr(self.stepping, "release"):
            self.stepping.release()  # the engine clips as the user configured it again
        self.rollback.close()
        if self.running_stats is not None:
            self.running_stats.close()
        self.reporter.close(summary)
        return summary

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        rb = self.rollback.state_dict()
        rep = self.reporter
        return {
            "version": STATE_VERSION, "step_count": self.step_count, "applied_steps": self.applied_steps,
            "skipped_steps": self.skipped_steps, "n_findings": rep.n_findings, "verified": rb["verified"],
            "action_counts": dict(rep.action_counts), "culprits": dict(rep.culprits),
            "detectors": self.detectors.state_dict(), "policy": self.policy.state_dict(),
            "clip": self.clip.state_dict(), "lr": self.lr.state_dict(), "adam": self.adam.state_dict(),
            "snapshots": rb["snapshots"], "checkpoints": rb["checkpoints"],
            "grow_healthy": self.batches.healthy if self.batches is not None else 0,
            "model_signature": model_signature(self.model, self.shard_root),
            "config": self.config.to_dict(),  # compared on resume: gradguard.resume
            "action_log": rep.advice_log(),  # the advice of a resumed run still sees them
        }

    def checkpoint_state(self, step: int, paths: list[str] | tuple[str, ...] = ("",)) -> dict[str, Any]:
        """The state to write into the engine checkpoint being saved after update ``step`` at
        ``paths``: :meth:`state_dict` with that checkpoint already in the rollback tier (engines
        serialise their callbacks' state before announcing the save). Changes nothing."""
        state = self.state_dict()
        state["checkpoints"] = self.rollback.checkpoint_tier.state_with(step, list(paths))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate the whole state (version, model signature, every entry), then apply it; a
        ``gradguard.state.StateError`` means nothing was changed. A state saved with another config
        follows the resume rule of :mod:`gradguard.resume` (each conflict warned once)."""
        load_core_state(self, state, self._apply_state, STATE_VERSION)
        reconcile(self, state.get("config"))

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.step_count = state["step_count"]
        self.applied_steps = state["applied_steps"]
        self.skipped_steps = state["skipped_steps"]
        self.reporter.load_counts(state)
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])
        self.clip.load_state_dict(state["clip"])
        self.lr.load_state_dict(state["lr"])
        self.adam.load_state_dict(state["adam"])
        self.rollback.load_state_dict(state)
        if self.batches is not None:
            self.batches.healthy = int(state.get("grow_healthy", 0))

    def _run_folder(self) -> str | None:
        """gradguard's own folder of this run on this process (the event log's), None without one."""
        path = self.reporter.log_path
        return None if not path or "://" in path else os.path.dirname(os.path.abspath(path))

    def start_at(self, step: int) -> None:
        """A fresh guard joining a run after update ``step`` (resumed without a saved guard state):
        its step numbers follow the engine's; the detectors warm up as in a new run."""
        if self.step_count == 0 and step > 0:
            self.step_count = int(step)
