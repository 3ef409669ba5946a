"""Configuration: one dataclass per concern, grouped in :class:`GuardConfig`.

Every field is documented in place and validated in ``__post_init__``. A bad value raises
:class:`ConfigError` naming the field, the value and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, ConfigTypeError  # one error hierarchy: gradguard.errors

__all__ = [
    "ConfigError", "MeasureConfig", "DetectConfig", "ClipConfig", "LRConfig", "AdamConfig",
    "RecoveryConfig", "PolicyConfig", "OutputConfig", "GuardConfig", "PRESETS",
]

#: Actions a ladder rung may name (the policy maps each to an actuator).
RUNG_ACTIONS = (
    "tighten_clip", "lower_lr", "lower_layer_lr", "adam", "rollback", "shrink_batch", "halt",
)


def _fail(path: str, value: Any, problem: str, fix: str) -> None:
    raise ConfigError(f"{path}={value!r}: {problem}. Fix: {fix}")


def _number_from_text(obj: Any, name: str, integer: bool = False) -> Any:
    """A numeric string (PyYAML reads ``1e-6`` as the string ``'1e-6'``) becomes the number it
    spells and is stored back on the field; anything else is returned unchanged."""
    value = getattr(obj, name)
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        number: Any = int(text) if integer else float(text)
    except ValueError:
        if not integer:
            return value
        try:
            as_float = float(text)
        except ValueError:
            return value
        if not as_float.is_integer():
            return value
        number = int(as_float)
    setattr(obj, name, number)
    return number


def _flag(obj: Any, name: str) -> None:
    """On/off fields take real booleans only (YAML's true/false/yes/no already load as bool):
    ``"false"`` or ``0`` would otherwise read as True or be ambiguous."""
    value = getattr(obj, name)
    if not isinstance(value, bool):
        _fail(f"{obj._path}.{name}", value, "must be a bool (True or False), not "
              f"{type(value).__name__}", "pass True or False (in YAML: true or false, unquoted)")


def _optional_text(obj: Any, name: str, what: str) -> None:
    value = getattr(obj, name)
    if value is None:
        return
    if isinstance(value, os.PathLike):
        setattr(obj, name, os.fspath(value))
        return
    if not isinstance(value, str) or not value.strip():
        _fail(f"{obj._path}.{name}", value, f"must be {what} or None", f"pass {what} as a string, or None")


def _positive(obj: Any, name: str, *, allow_zero: bool = False, integer: bool = False) -> None:
    value = _number_from_text(obj, name, integer)
    path = f"{obj._path}.{name}"
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int)
    ):
        _fail(path, value, f"must be {kind}", f"pass {kind} such as {_example(obj, name)}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        _fail(path, value, f"must be finite and {bound}", f"use e.g. {_example(obj, name)}")


def _fraction(obj: Any, name: str, *, open_low: bool = True, open_high: bool = True) -> None:
    value = _number_from_text(obj, name)
    path = f"{obj._path}.{name}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, value, "must be a number", f"use e.g. {_example(obj, name)}")
    low_ok = value > 0 if open_low else value >= 0
    high_ok = value < 1 if open_high else value <= 1
    if not (low_ok and high_ok):
        lo = "(0" if open_low else "[0"
        hi = "1)" if open_high else "1]"
        _fail(path, value, f"must lie in {lo}, {hi}", f"use e.g. {_example(obj, name)}")


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        _fail(f"{obj._path}.{name}", value, f"must be one of {list(choices)}",
              f"pick one of {list(choices)}")


def _example(obj: Any, name: str) -> Any:
    for f in dataclasses.fields(obj):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return 1


@dataclass(kw_only=True)
class MeasureConfig:
    """What is measured and how parameters are grouped into layers."""

    _path = "GuardConfig.measure"

    layer_pattern: str | None = None
    """Regex applied to each parameter name; its first group (or whole match) names the layer.
    None uses the built-in rule: module path up to and including the first numeric index
    (``transformer.h.3``), else the owning module (``lm_head``)."""

    log_interval: int = 50
    """Every this many steps, parameter norms and update-to-weight ratios are measured per layer
    (one extra copy of the parameters on those steps only)."""

    def __post_init__(self) -> None:
        _positive(self, "log_interval", integer=True)
        if self.layer_pattern is not None:
            try:
                re.compile(self.layer_pattern)
            except (re.error, TypeError) as exc:
                _fail(f"{self._path}.layer_pattern", self.layer_pattern,
                      f"is not a valid regular expression ({exc})",
                      "pass a Python regex such as r'^(.*?\\.\\d+)\\.' or None for the built-in rule")


@dataclass(kw_only=True)
class DetectConfig:
    """Detector thresholds. Baselines are EMAs of value and absolute deviation (a robust spread);
    values flagged as spikes enter the baseline clipped to the threshold."""

    _path = "GuardConfig.detect"

    warmup_steps: int = 20
    """Healthy steps observed before the sigma-based spike detectors are armed (the loss detector
    also arms after 3x this many steps of any kind)."""

    ema_alpha: float = 0.05
    """Weight of the newest value in the loss and grad-norm baselines (about 1/alpha steps of memory)."""

    loss_sigma: float = 6.0
    """A loss is a spike when it exceeds the baseline by this many robust standard deviations..."""

    loss_ratio: float = 1.2
    """...and by this factor of the baseline (both must hold)."""

    early_loss_ratio: float = 1.5
    """During warm-up: a loss above this factor of the recent healthy loss (the lower of the last
    one and their mean) is a spike, if it is also ``loss_sigma`` robust deviations above the mean."""

    grad_sigma: float = 6.0
    """A total grad norm is a spike beyond this many robust standard deviations of its baseline..."""

    grad_ratio: float = 3.0
    """...and beyond this factor of the baseline (both must hold)."""

    layer_grad_sigma: float = 8.0
    """Per-layer grad-norm spike threshold in robust standard deviations."""

    layer_grad_ratio: float = 10.0
    """Per-layer grad-norm spike threshold as a factor of the layer's baseline. Per-layer spikes
    name culprit layers; on their own they are informational and never escalate (embedding
    gradients are sparse and spiky by nature)."""

    min_rel_spread: float = 0.01
    """Lower bound of the spread as a fraction of the baseline, so a flat series is not hair-trigger."""

    overflow_streak: int = 5
    """Consecutive GradScaler overflows that make a finding."""

    overflow_window: int = 100
    """Window (steps) for the overflow rate."""

    overflow_rate: float = 0.2
    """Overflow fraction over the window that makes a finding (after a full window)."""

    scale_floor: float = 1.0
    """A GradScaler scale below this is a collapse (fp16 can no longer represent the gradients)."""

    takeover_share: float = 0.2
    """Quiet-degradation rule (a *norm takeover*): a finding when the model's final normalization
    layer(s) (``ln_f``, ``model.norm``) carry more than this fraction of the squared gradient norm,
    as a median over ``takeover_window`` steps. Healthy runs put at most ~2% there, runs whose LR is
    far too high 60-99%. A takeover found once the LR schedule has decayed below a quarter of its
    peak is reported, not acted on (no rollback in a run's last steps). 1 disables the rule."""

    takeover_window: int = 20
    """Steps in the median of the norm layers' gradient share (a finding needs a full window above
    ``takeover_share``; a persistent takeover is reported once per window)."""

    def __post_init__(self) -> None:
        _positive(self, "warmup_steps", allow_zero=True, integer=True)
        _fraction(self, "takeover_share", open_high=False)
        _positive(self, "takeover_window", integer=True)
        _fraction(self, "ema_alpha")
        for name in ("loss_sigma", "grad_sigma", "layer_grad_sigma", "scale_floor"):
            _positive(self, name)
        for name in ("loss_ratio", "early_loss_ratio", "grad_ratio", "layer_grad_ratio"):
            value = getattr(self, name)
            _positive(self, name)
            if value < 1:
                _fail(f"{self._path}.{name}", value, "must be >= 1 (a spike is above the baseline)",
                      f"use e.g. {_example(self, name)}")
        _positive(self, "min_rel_spread", allow_zero=True)
        _positive(self, "overflow_streak", integer=True)
        _positive(self, "overflow_window", integer=True)
        _fraction(self, "overflow_rate", open_high=False)


@dataclass(kw_only=True)
class ClipConfig:
    """Gradient clipping owned by gradguard (it reuses the measured norms: no second pass)."""

    _path = "GuardConfig.clip"

    mode: str = "fixed"
    """'off' (never clip), 'fixed' (clip at max_norm, tightened/relaxed by the policy) or
    'adaptive' (ZClip: clip to mean + z*std of an EMA of the total norm, never above max_norm)."""

    max_norm: float = 1.0
    """Starting max_grad_norm (the value users pass to clip_grad_norm_)."""

    tighten_factor: float = 0.5
    """Each 'tighten_clip' action multiplies max_norm by this."""

    floor: float = 0.1
    """max_norm is never tightened below this."""

    relax_after: int = 200
    """Healthy steps after which a tightened max_norm is relaxed by 1/tighten_factor (up to max_norm)."""

    adaptive_z: float = 2.5
    """Adaptive mode: z-score above which the norm is clipped (ZClip's default)."""

    adaptive_alpha: float = 0.97
    """Adaptive mode: EMA decay of the norm's mean and variance (ZClip's default)."""

    adaptive_warmup: int = 25
    """Adaptive mode: steps that only seed the EMA before adaptive clipping starts."""

    def __post_init__(self) -> None:
        _choice(self, "mode", ("off", "fixed", "adaptive"))
        _positive(self, "max_norm")
        _fraction(self, "tighten_factor")
        _positive(self, "floor")
        if self.floor > self.max_norm:
            _fail(f"{self._path}.floor", self.floor, f"is above max_norm={self.max_norm}",
                  "set floor <= max_norm, e.g. floor=0.1 with max_norm=1.0")
        _positive(self, "relax_after", integer=True)
        _positive(self, "adaptive_z")
        _fraction(self, "adaptive_alpha")
        _positive(self, "adaptive_warmup", allow_zero=True, integer=True)


@dataclass(kw_only=True)
class LRConfig:
    """The LR multiplier: applied around every optimizer step, so any scheduler keeps its own course."""

    _path = "GuardConfig.lr"

    down_factor: float = 0.3
    """Each 'lower_lr' action multiplies the global LR multiplier (the level that failed) by this.
    The level that failed is read against the schedule's peak: during a rising warm-up at 30% of
    ``initial_lr`` it is 0.3**2 = 0.09 x the multiplier (a steeper ramp fails at a higher LR than
    the run tolerates: see ``GuardCore._ramp_position``), so the ramp cannot climb back to the LR
    that failed. Under RMSprop the position is first scaled by its early-step gain (its first steps
    run hotter than its LR: ``gradguard.act.early_step_gain``)."""

    early_down_factor: float = 0.03
    """'lower_lr' factor for an instability before the run learned anything (in the first
    ``detect.warmup_steps`` healthy steps with the loss never 10% below its first value, or a norm
    takeover since the first steps): a blow-up from the start means the LR is grossly too high;
    the rollback to the initial weights makes a deep cut cheap and recovery raises the LR again if
    the cut was too deep. A blow-up after progress (a warm-up ramp overshooting) gets
    ``down_factor``. The initial weights are kept for this (see ``recovery.snapshot_interval``).
    (0.1 was measured: better for models whose best LR is 3x the usual, worse on the demo's
    explosive run and the rescue benchmark: docs/benchmarks.md.)"""

    recover_ceiling: float = 0.5
    """Recovery never raises a multiplier above this fraction of the level that failed (until the
    ceiling itself recovers, after 4 x recover_after healthy steps)."""

    min_multiplier: float = 0.01
    """The global multiplier never goes below this."""

    layer_factor: float = 0.1
    """'lower_layer_lr' multiplies the targeted layers' LR by this (the seed's embedding/lm_head x0.1)."""

    layer_groups: dict[str, str] = field(
        default_factory=lambda: {"embeddings": r"(^|\.)(wte|wpe|embed\w*|\w*_emb\w*|word_embeddings)(\.|$)",
                                 "lm_head": r"(^|\.)(lm_head|output_layer|embed_out)(\.|$)"}
    )
    """Named layer groups (name -> regex on layer names) targeted by 'lower_layer_lr' when no
    culprit layer was named by a finding."""

    rewarm_steps: int = 25
    """After a rollback the LR ramps linearly back up to its (lowered) multiplier over this many
    steps, as a fresh warm-up would (0 disables)."""

    recover_after: int = 100
    """Healthy steps between two recovery moves of the multipliers back towards their ceiling."""

    recover_factor: float = 1.5
    """Each recovery move multiplies a lowered multiplier by this, up to its ceiling (the multiplier
    in force at the last instability, at most 1)."""

    glitch_window: int = 8
    """An LR cut lifts when the schedule itself passed the LR that failed: if, within this many
    steps, the scheduled LR fell in one step by ``1/down_factor`` or more from (half or more of)
    the highest LR among the steps that failed, and now runs below ``down_factor`` x that LR (an LR
    glitch ending; a step schedule dropping 10x), the global multiplier goes back to its level
    before the cut (action ``lift_lr``): the scheduler alone then runs below the level the cut set.
    A smooth decay never falls that far in one step, so a cut in it stays. If the schedule climbs
    back above the cut's level, the cut comes back (``recut_lr``). Measured on an LR x30 for 4
    steps late in a cosine decay: the cut kept for the rest of the run cost 0.4-1.7% on every such
    run of the unseen benchmark (docs/benchmarks.md). 0 keeps every cut."""

    def __post_init__(self) -> None:
        _fraction(self, "down_factor")
        _fraction(self, "early_down_factor")
        _fraction(self, "recover_ceiling", open_high=False)
        _fraction(self, "min_multiplier", open_high=False)
        _fraction(self, "layer_factor", open_high=False)
        if not isinstance(self.layer_groups, dict):
            _fail(f"{self._path}.layer_groups", self.layer_groups, "must be a dict name -> regex",
                  "pass e.g. {'embeddings': r'embed'}")
        for name, pattern in self.layer_groups.items():
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                _fail(f"{self._path}.layer_groups[{name!r}]", pattern,
                      f"is not a valid regex ({exc})", "pass a Python regular expression string")
        _positive(self, "rewarm_steps", integer=True, allow_zero=True)
        _positive(self, "glitch_window", integer=True, allow_zero=True)
        _positive(self, "recover_after", integer=True)
        _positive(self, "recover_factor")
        if self.recover_factor <= 1:
            _fail(f"{self._path}.recover_factor", self.recover_factor, "must be > 1",
                  "use e.g. 1.5 (each recovery raises the multiplier by 50%)")


@dataclass(kw_only=True)
class AdamConfig:
    """Live Adam hyperparameter changes made by the 'adam' action (the seed's beta2/eps move)."""

    _path = "GuardConfig.adam"

    beta2: float = 0.95
    """New beta2 (only lowered, never raised)."""

    eps: float = 1e-6
    """New eps (only raised, never lowered)."""

    def __post_init__(self) -> None:
        _fraction(self, "beta2")
        _positive(self, "eps")


@dataclass(kw_only=True)
class RecoveryConfig:
    """Snapshots and rollback (used by the 'rollback' rung)."""

    _path = "GuardConfig.recovery"

    snapshot_interval: int = 50
    """Take a snapshot every this many applied steps (0 disables snapshots and rollback). During the
    first interval the initial weights are kept beside the ring (one snapshot more than
    ``ring_size``), so a run that blows up before it learned anything restarts from them; while the
    scheduler's LR still rises and for two ``detect.takeover_window`` after it stops (up to step
    4 x this interval), they are kept too, so a norm takeover the warm-up caused restarts from them."""

    ring_size: int = 2
    """How many healthy snapshots are kept."""

    confirm_steps: int = 10
    """Healthy steps after a snapshot before it becomes restorable."""

    skip_batches: int = 0
    """Steps' worth of batches skipped after a rollback, as PaLM did (needs a batch controller,
    ``Guard(batches=gradguard.data.BatchController(...))``, or an adapter that can skip)."""

    restore_schedule: bool = False
    """False: the LR schedule keeps its current position after a rollback; True: it is restored too."""

    restore_rng: bool = False
    """Restore the RNG states saved with the snapshot. Off by default: it would replay the same
    random stream (dropout masks, and data shuffles drawn from the global RNG)."""

    disk_dir: str | None = None
    """If set, snapshots go to this folder instead of host memory (atomic write, sha256 checksum,
    ``torch.load(weights_only=True)``; an unreadable one falls back to the next older)."""

    shrink_mode: str = "global"
    """What 'shrink_batch' halves: 'global' (the optimizer-step batch, LR scaled linearly, the
    user's 128 -> 64) or 'micro' (the micro-batch, accumulation doubled, global batch kept).
    Needs a batch controller (``Guard(batches=...)``) or an adapter that can resize."""

    grow_after: int = 200
    """Healthy steps after which a shrunk global batch doubles back towards its original size."""

    grow_clip: float = 0.1
    """max_grad_norm held for ``grow_clip_steps`` after the batch grows back (the user's recipe:
    back to 128 with max_grad_norm 0.1 for a while, then normal)."""

    grow_clip_steps: int = 100
    """Steps the tight clip is held after the batch grows back."""

    oom_all_ranks: bool = False
    """HF and Lightning under DDP (several processes): an out-of-memory error on one rank
    is handled on every rank alike (that rank runs its samples again in pieces, then every rank's
    micro-batch shrinks the same way), instead of being raised on that rank. To let one rank retry
    alone, every micro-batch of a step runs without DDP's gradient sync and gradguard averages the
    gradients over the ranks before the optimizer step (one all-reduce per bucket): that all-reduce
    no longer overlaps the last backward. The plain loop's ``guard.accumulate`` on a DDP model always
    works this way."""

    def __post_init__(self) -> None:
        _positive(self, "snapshot_interval", allow_zero=True, integer=True)
        _positive(self, "ring_size", integer=True)
        _positive(self, "confirm_steps", integer=True)
        _positive(self, "skip_batches", allow_zero=True, integer=True)
        _choice(self, "shrink_mode", ("global", "micro"))
        _positive(self, "grow_after", integer=True)
        _positive(self, "grow_clip")
        _positive(self, "grow_clip_steps", integer=True, allow_zero=True)
        _flag(self, "restore_schedule")
        _flag(self, "restore_rng")
        _flag(self, "oom_all_ranks")
        _optional_text(self, "disk_dir", "a folder path")


@dataclass(kw_only=True)
class PolicyConfig:
    """The escalation ladder from findings to actions."""

    _path = "GuardConfig.policy"

    act: bool = True
    """False observes only (the 'monitor' preset): nothing about training changes."""

    skip_nonfinite: bool = True
    """Skip a step whose loss or gradients are non-finite."""

    skip_grad_ratio: float = 50.0
    """Skip a step whose total grad norm exceeds this factor of its baseline (clipping alone would
    still apply a full-size update in a corrupted direction)."""

    ladder: list[list[str]] = field(
        default_factory=lambda: [
            ["rollback", "lower_lr", "tighten_clip"],
            ["rollback", "adam", "lower_lr"],
            ["rollback", "lower_lr", "lower_layer_lr"],
            ["rollback", "shrink_batch", "lower_lr", "tighten_clip"],
            ["rollback", "lower_lr"],
        ]
    )
    """Rungs climbed one per escalation; the last rung repeats. 'rollback' restores the newest healthy
    snapshot and skips the step (without a snapshot it only skips the step). Actions: """ + ", ".join(RUNG_ACTIONS)

    spike_confirm_window: int = 5
    """A loss spike with no other spike in the previous this-many steps is only skipped (it may be
    one bad batch); a repeated spike escalates the ladder. A spike on weights just restored from a
    healthy snapshot is blamed on the data: skipped, never escalated. Past the first
    ``detect.warmup_steps`` applied steps, at an LR that did not rise, spikes on weights no update
    changed (each one skipped) are ambiguous (bad batches in a row, or damaged weights): the second
    is skipped too, the third rolls back without an LR cut; if the next batch is clean, training
    goes back to the weights left, on trial; a spike on them, or a recurrence within twice this
    window, climbs the ladder."""

    ambiguous_spikes: bool = True
    """Repeated loss spikes on weights no update changed, at an LR that did not rise, past the first
    ``detect.warmup_steps`` applied steps, cannot tell bad batches in a row from damaged weights.
    True waits for evidence (see ``spike_confirm_window``: a rollback without an LR cut, a return on
    trial); False climbs the ladder at the second spike, as for any repeated spike."""

    cooldown: int = 5
    """Steps after an escalation during which new findings do not escalate again (a rollback ends
    the cooldown: findings after it come from restored, healthy weights)."""

    repeats_to_escalate: int = 3
    """Non-finite steps (skipped) and severe grad-norm spikes (10x their threshold; clipped or
    skipped) within escalation_window that together count as instability; one alone is handled by
    skip/clip. Moderate grad-norm spikes are only clipped: they are routine with small batches."""

    escalation_window: int = 200
    """Window (steps) for counting spikes and escalations."""

    max_escalations: int = 12
    """More escalations than this within escalation_window halt the run with a diagnosis."""

    max_skip_streak: int = 25
    """This many consecutive skipped steps halt the run with a diagnosis."""

    def __post_init__(self) -> None:
        _flag(self, "act")
        _flag(self, "skip_nonfinite")
        _flag(self, "ambiguous_spikes")
        _positive(self, "skip_grad_ratio")
        if not isinstance(self.ladder, list) or not self.ladder or not all(
            isinstance(r, (list, tuple)) and r for r in self.ladder
        ):
            _fail(f"{self._path}.ladder", self.ladder, "must be a non-empty list of non-empty lists",
                  "pass e.g. [['lower_lr', 'tighten_clip'], ['adam', 'lower_lr']]")
        for i, rung in enumerate(self.ladder):
            for action in rung:
                if action not in RUNG_ACTIONS:
                    _fail(f"{self._path}.ladder[{i}]", action, "is not a known action",
                          f"use actions from {list(RUNG_ACTIONS)}")
        self.ladder = [list(r) for r in self.ladder]
        for name in ("spike_confirm_window", "cooldown", "repeats_to_escalate", "escalation_window",
                     "max_escalations", "max_skip_streak"):
            _positive(self, name, integer=True, allow_zero=(name == "cooldown"))


@dataclass(kw_only=True)
class OutputConfig:
    """Where events and metrics go."""

    _path = "GuardConfig.output"

    dir: str | None = None
    """Folder for the JSONL event log (``<dir>/gradguard/events.jsonl``; a URL such as
    ``memory://...`` or ``s3://...`` is written through fsspec); None: where the engine keeps its
    own logs (see :mod:`gradguard.logdir`: never the working directory nor a checkpoint folder;
    without such a folder no event log, one warning), or
    ``./gradguard_runs/events-<timestamp>-<pid>.jsonl`` for plain loops."""

    jsonl: bool = True
    """Write the JSONL event log."""

    console: bool = True
    """Print one line per action and a summary at the end."""

    metrics_interval: int = 10
    """Per-step metrics are sent to metric sinks every this many steps (events are never delayed)."""

    halt_raises: bool = True
    """After a halt (the step is not applied, training stops, ``diagnosis.json`` is written next to
    the event log and the engine saves), raise :class:`gradguard.GradGuardHalt` from the engine's
    entry point (``guard.step``, ``trainer.train()``, ``trainer.fit()``). False: only stop; the
    diagnosis is on the adapter's ``.diagnosis`` (and ``report.diagnosis``). Same in every engine."""

    alert_every: int = 50
    """Alerts (W&B ``run.alert``, a TensorBoard text entry) on a rollback or escalation: at most one
    every this many steps (the ones in between are counted into the next); a halt always alerts."""

    def __post_init__(self) -> None:
        _positive(self, "metrics_interval", integer=True)
        _positive(self, "alert_every", integer=True)
        _flag(self, "jsonl")
        _flag(self, "console")
        _optional_text(self, "dir", "a folder path")
        _flag(self, "halt_raises")


_SECTIONS = {
    "measure": MeasureConfig, "detect": DetectConfig, "clip": ClipConfig, "lr": LRConfig,
    "adam": AdamConfig, "recovery": RecoveryConfig, "policy": PolicyConfig, "output": OutputConfig,
}


@dataclass(kw_only=True)
class GuardConfig:
    """All of gradguard's settings. ``GuardConfig()`` is the ``"default"`` preset."""

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """Measurement and layer grouping."""

    detect: DetectConfig = field(default_factory=DetectConfig)
    """Detector thresholds."""

    clip: ClipConfig = field(default_factory=ClipConfig)
    """Clipping owned by gradguard."""

    lr: LRConfig = field(default_factory=LRConfig)
    """LR multiplier behaviour."""

    adam: AdamConfig = field(default_factory=AdamConfig)
    """Adam beta2/eps targets."""

    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Snapshots and rollback."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Escalation ladder."""

    output: OutputConfig = field(default_factory=OutputConfig)
    """Sinks."""

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build(cls, value, f"GuardConfig.{name}"))
            elif not isinstance(value, cls):
                _fail(f"GuardConfig.{name}", value, f"must be a {cls.__name__} or a dict",
                      f"pass gradguard.config.{cls.__name__}(...) or a dict of its fields")

    # -- construction helpers -------------------------------------------------------------
    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> GuardConfig:
        """A named preset (see ``PRESETS``); keyword overrides are sections as dicts or objects,
        e.g. ``GuardConfig.preset("default", clip={"max_norm": 0.5})``."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ConfigError(f"GuardConfig.preset name={name!r}: unknown preset. "
                              f"Fix: use one of {sorted(PRESETS)}")
        data = copy.deepcopy(PRESETS[name])
        for section, value in overrides.items():
            if section not in _SECTIONS:
                raise ConfigError(f"GuardConfig.preset {section}={value!r}: unknown section. "
                                  f"Fix: use one of {sorted(_SECTIONS)}")
            if dataclasses.is_dataclass(value):
                value = _asdict(value)
            elif not isinstance(value, dict):
                raise ConfigError(
                    f"GuardConfig.{section}={value!r} (with preset {name!r}): must be a dict of fields, not a "
                    f"{type(value).__name__}. Fix: write the section as a mapping, e.g. "
                    f"{section}: {{{next(iter(f.name for f in dataclasses.fields(_SECTIONS[section])))}: ...}}")
            data.setdefault(section, {}).update(value)
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: GuardConfig | dict[str, Any] | None, where: str = "config") -> GuardConfig:
        """None -> the default preset, a dict -> ``from_dict``, a GuardConfig as is; anything else
        is a ConfigTypeError (a TypeError) naming ``where``."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        if not isinstance(value, cls):
            raise ConfigTypeError(f"gradguard: {where}={type(value).__name__} is not a GuardConfig. "
                            "Fix: pass gradguard.GuardConfig(...), GuardConfig.preset(name) or a dict of sections")
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GuardConfig:
        """Build from nested dicts (as loaded from JSON/YAML). A ``preset`` key starts from a preset."""
        if not isinstance(data, dict):
            raise ConfigError(f"GuardConfig data={data!r}: must be a dict. Fix: pass a mapping of sections")
        data = dict(data)
        preset = data.pop("preset", None)
        if preset is not None:
            return cls.preset(preset, **data)
        for key in data:
            if key not in _SECTIONS:
                raise ConfigError(f"GuardConfig.{key}={data[key]!r}: unknown section. "
                                  f"Fix: use one of {sorted(_SECTIONS)}")
        return cls(**{k: _build(_SECTIONS[k], v, f"GuardConfig.{k}") for k, v in data.items()})

    @classmethod
    def from_yaml(cls, path: str) -> GuardConfig:
        """Load from a YAML (or JSON) file of nested sections."""
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if path.endswith(".json"):
            import json

            return cls.from_dict(json.loads(text))
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - PyYAML ships with most setups
            raise ImportError("loading YAML configs needs PyYAML: pip install pyyaml") from exc
        return cls.from_dict(yaml.safe_load(text) or {})

    def to_dict(self) -> dict[str, Any]:
        return {name: _asdict(getattr(self, name)) for name in _SECTIONS}


def _asdict(obj: Any) -> dict[str, Any]:
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _build(cls: type, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{path}={value!r}: must be a dict of fields. Fix: pass e.g. {{}} for defaults")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in names:
            raise ConfigError(f"{path}.{key}={value[key]!r}: unknown field. Fix: use one of {sorted(names)}")
    return cls(**value)


def _track_given(cls: type) -> None:
    """``obj._given``: the names of the fields passed to the constructor (a dict section, a preset's
    entries, keyword arguments), so "configured explicitly" can be told from "left at the default"
    even when the value equals the default (see :func:`explicit`)."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_given", frozenset(kwargs))
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__  # type: ignore[method-assign]


for _cls in _SECTIONS.values():
    _track_given(_cls)


def explicit(section: Any, name: str) -> bool:
    """Whether ``section.name`` was configured by the user: passed to the constructor (a dict, a
    preset, a keyword) or different from the field's default."""
    if name in getattr(section, "_given", ()):
        return True
    for f in dataclasses.fields(section):
        if f.name == name:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            return bool(getattr(section, name) != default)
    raise AttributeError(name)


#: Named presets as nested dicts over the defaults.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "monitor": {"policy": {"act": False}, "clip": {"mode": "off"}, "recovery": {"snapshot_interval": 0}},
    "adaptive": {"clip": {"mode": "adaptive"}},
    "conservative": {
        "detect": {"loss_sigma": 5.0, "grad_sigma": 5.0, "loss_ratio": 1.1},
        "clip": {"max_norm": 0.5},
        "policy": {"cooldown": 10},
    },
}
