"""One home for gradient clipping: the rule, the clip in force, and each engine's clip setting.

* :func:`resolve_clip`: which clip wins when the user's ``GuardConfig.clip`` and the engine's own
  setting (``TrainingArguments.max_grad_norm``, ``Trainer(gradient_clip_val)``, DeepSpeed's
  ``gradient_clipping``) are both given. Evaluated once per run, by the engine's clip object below.
* :func:`guard_clips` / :func:`check_ladder`: whether the guard owns clipping; a ladder that would
  tighten a clip that is off.
* The controller: the core's :class:`gradguard.act.ClipController` (``core.clip``), read through
  ``core.max_grad_norm`` (the threshold in force) and ``core.replay_engine_clip`` (an engine clip
  applied from the guard's own norm pass).
* :class:`HFClip`: ``TrainingArguments.max_grad_norm`` of one HF run; :meth:`HFClip._set` is the only
  place gradguard writes it.
* :class:`LightningClip`: ``trainer.gradient_clip_val`` of one Lightning run (the guard's clip handed
  to Lightning, or Lightning's own clip replayed from the guard's pass in monitor mode);
  :meth:`LightningClip._set` is the only place gradguard writes it.

DeepSpeed's ``gradient_clipping`` is set through the engine handle
(:class:`gradguard.deepspeed.DeepSpeedEngineHandle`, ``set_clip``/``release``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from ._compat import ds_clip, ds_set_clip, shadow_method, unshadow_method
from .config import ClipConfig, GuardConfig, explicit
from .errors import ConfigError, warn
from .measure import EngineClip

__all__ = ["resolve_clip", "guard_clips", "check_ladder", "HFClip", "LightningClip", "HF_DEFAULT_MAX_GRAD_NORM"]

HF_DEFAULT_MAX_GRAD_NORM = 1.0  # TrainingArguments.max_grad_norm's default


def guard_clips(config: GuardConfig) -> bool:
    """Whether the guard owns norm clipping (it acts and ``clip.mode`` is not ``"off"``)."""
    return bool(config.policy.act and config.clip.mode != "off")


def resolve_clip(config: GuardConfig, engine_value: float | None, *, engine_default: float | None,
                 setting: str) -> tuple[GuardConfig, float | None]:
    """The one clip rule. Returns (the config to build the core with, the engine clip value to leave
    in force or replay when the guard does not clip, else None).

    When the guard clips, what the user configured is what runs:

    * an engine setting left at its default (``max_grad_norm=1.0``) never overrides a
      ``clip.max_norm`` configured in gradguard (a dict/preset entry or a non-default value);
    * an engine setting the user changed becomes the starting ``clip.max_norm`` when gradguard's was
      not configured;
    * both configured to different values: :class:`ConfigError`, except when gradguard's value is the
      default 1.0 written out explicitly (a dumped full config): the engine's value wins, with a
      warning saying so.

    Evaluate it once per run (its warning is given here)."""
    v = float(engine_value) if engine_value not in (None, False) else 0.0
    engine_clips = 0 < v < math.inf
    if not guard_clips(config):
        return config, (v if engine_clips else None)
    if not engine_clips or v == config.clip.max_norm:
        return config, None
    user_set_engine = engine_default is None or v != float(engine_default)
    if not user_set_engine:  # the engine's default: what gradguard was given (or its own default) runs
        return config, None
    default_max = ClipConfig().max_norm
    if config.clip.max_norm != default_max:
        raise ConfigError(
            f"{setting}={v!r} conflicts with GuardConfig.clip.max_norm={config.clip.max_norm!r}: gradguard owns "
            "clipping and starts from one of them. Fix: set only one of the two (or make them equal)")
    if explicit(config.clip, "max_norm"):
        warn(f"gradguard: {setting}={v!r} and GuardConfig.clip.max_norm={config.clip.max_norm!r} were both set; "
             f"the guard clips at {setting}={v!r} (a clip.max_norm equal to the default cannot be told from an "
             "unset one). Fix: set only one of the two", stacklevel=4)
    clip = dataclasses.replace(config.clip, max_norm=v, floor=min(config.clip.floor, v))
    return dataclasses.replace(config, clip=clip), None


def check_ladder(config: GuardConfig) -> None:
    """A ladder with ``tighten_clip`` while the clip is off: :class:`ConfigError` (acting only)."""
    if config.policy.act and config.clip.mode == "off" and any("tighten_clip" in r for r in config.policy.ladder):
        raise ConfigError(
            f"GuardConfig.clip.mode={config.clip.mode!r} with 'tighten_clip' in GuardConfig.policy.ladder: "
            "the policy could not tighten a clip that is off. Fix: use clip.mode='fixed' or 'adaptive', or "
            "remove 'tighten_clip' from the ladder")


# -- the HF Trainer ------------------------------------------------------------------------------------
class HFClip:
    """``TrainingArguments.max_grad_norm`` for one ``train()``: the clip rule evaluated once, and the
    only writes of the setting. The Trainer keeps unscaling and measuring in its norm pass (taken
    over, :class:`gradguard._hf.norm.StepDecision`) but never clips itself (``inf``); the checkpoints
    it writes record the clip in force; the end of training puts the user's value back.

    Under DeepSpeed the engine clips (its ``gradient_clipping``, set through the engine handle):
    ``max_grad_norm`` is left as it is, and the rule reads the engine's value when it differs from
    the Trainer's (a ``gradient_clipping`` not filled in from ``max_grad_norm``)."""

    SETTING = "TrainingArguments.max_grad_norm"

    def __init__(self, args: Any, config: GuardConfig, deepspeed_engine: Any = None) -> None:
        self.args = args
        self.user_value = args.max_grad_norm
        self.deepspeed = deepspeed_engine is not None
        value, default, setting = args.max_grad_norm, HF_DEFAULT_MAX_GRAD_NORM, self.SETTING
        if deepspeed_engine is not None:
            engine_value = ds_clip(deepspeed_engine)
            if value is None or float(engine_value or 0.0) != float(value):
                value, default, setting = engine_value or None, 0.0, "gradient_clipping"
        self.config, self.replay = resolve_clip(copy.deepcopy(config), value, engine_default=default, setting=setting)

    def in_force(self, core: Any) -> float | None:
        """The clip in force: the guard's, or the Trainer's own (replayed) when the guard does not clip."""
        guard = core.max_grad_norm
        return guard if guard is not None or self.deepspeed else self.replay

    def _set(self, value: float | None) -> None:
        if not self.deepspeed:
            self.args.max_grad_norm = value  # the only write of TrainingArguments.max_grad_norm

    def take_over(self) -> None:
        """Attach: the Trainer never clips (its norm pass still unscales and measures)."""
        self._set(math.inf)

    def before_save(self, core: Any) -> None:
        """A checkpoint is about to be written: it records the clip in force (0 when none)."""
        clip = self.in_force(core)
        self._set(0.0 if clip is None else float(clip))

    def after_save(self) -> None:
        self._set(math.inf)

    def put_back(self) -> None:
        """End of training: the user's own value."""
        self._set(self.user_value)


# -- Lightning -----------------------------------------------------------------------------------------
def _overridden(name: str, pl_module: Any) -> bool:
    try:
        from lightning.pytorch.utilities.model_helpers import is_overridden
    except ImportError:  # pragma: no cover - standalone pytorch_lightning
        from pytorch_lightning.utilities.model_helpers import is_overridden  # type: ignore[no-redef]
    try:
        return bool(is_overridden(name, pl_module))
    except Exception:  # noqa: BLE001 - unknown module class: assume it does
        return True


class LightningClip:
    """``trainer.gradient_clip_val`` for one Lightning run.

    A guard that clips (acting, ``clip.mode`` not ``"off"``, automatic optimization) takes Lightning's
    norm clip over: ``gradient_clip_val`` becomes the starting ``clip.max_norm`` (the rule, evaluated
    once in :meth:`resolve`); between steps Lightning holds the guard's current threshold, and inside a
    step the guard has clipped already it is None (no second pass).

    A guard that does not clip (monitor mode) replays Lightning's own norm clip: Lightning clips in
    ``precision_plugin.clip_grad_by_norm`` with ``clip_grad_norm_``, after the
    ``on_before_optimizer_step`` hooks. The guard's measurement computes the per-tensor norms exactly
    as ``clip_grad_norm_`` does, and ``clip_grad_by_norm`` is shadowed for the run: at the moment
    Lightning clips, the scale is applied from those norms, bit-identical to ``clip_grad_norm_``.
    Anything that could change the gradients between the two (a LightningModule overriding
    ``on_before_optimizer_step`` or ``configure_gradient_clipping``), another clip value, or a step
    the measurement could not take over: Lightning's own ``clip_grad_by_norm`` runs."""

    SETTING = "Trainer(gradient_clip_val)"

    def __init__(self) -> None:
        self.manage = False  # the guard clips: gradient_clip_val is the guard's
        self._shadow: tuple[Any, Any, Any] | None = None  # (precision plugin, wrapper, previous)
        self._pending: tuple[Any, float, Any] | None = None  # (core, clip value, report) of this step

    def resolve(self, config: GuardConfig, trainer: Any, pl_module: Any) -> GuardConfig:
        """The config to build the core with (the rule, evaluated once per core)."""
        self.manage = bool(guard_clips(config) and pl_module.automatic_optimization)
        if not self.manage:
            return config
        algo = str(trainer.gradient_clip_algorithm or "norm").lower()
        value = trainer.gradient_clip_val if algo.endswith("norm") else None
        config, _ = resolve_clip(config, value, engine_default=None, setting=self.SETTING)
        return config

    def _set(self, trainer: Any, value: float | None) -> None:
        trainer.gradient_clip_val = value  # the only write of Trainer.gradient_clip_val
        if value is not None:
            trainer.gradient_clip_algorithm = "norm"

    def hand_to_lightning(self, trainer: Any, core: Any) -> None:
        """Between steps: Lightning's norm clip at the guard's current threshold."""
        if self.manage and core is not None:
            self._set(trainer, core.max_grad_norm)

    def clipped(self, trainer: Any) -> None:
        """Inside a step the core has clipped: no second pass by Lightning."""
        if self.manage:
            self._set(trainer, None)

    # -- monitor mode: Lightning's clip replayed from the guard's pass ----------------------------------
    def install(self, trainer: Any, pl_module: Any, core: Any) -> None:
        """Shadow ``clip_grad_by_norm`` when the guard does not clip and Lightning clips by norm."""
        self.remove()
        if core is None or guard_clips(core.config):
            return  # the guard clips (Lightning's clip is switched off inside each step)
        if not pl_module.automatic_optimization or _overridden("on_before_optimizer_step", pl_module) \
                or _overridden("configure_gradient_clipping", pl_module):
            return
        plugin = getattr(trainer, "precision_plugin", None)
        orig = getattr(plugin, "clip_grad_by_norm", None)
        if orig is None or not hasattr(plugin, "main_params"):
            return

        def clip_grad_by_norm(optimizer: Any, clip_val: Any) -> None:
            pending, self._pending = self._pending, None
            if pending is not None and float(clip_val) == pending[1]:
                core_, _, report = pending
                if core_.replay_engine_clip(report) is not None:
                    return
            orig(optimizer, clip_val)

        self._shadow = (plugin, clip_grad_by_norm, shadow_method(plugin, "clip_grad_by_norm", clip_grad_by_norm))

    def engine_clip(self, trainer: Any, optimizer: Any) -> EngineClip | None:
        """What the step's measurement should take over: Lightning's clip of this step, if any."""
        self._pending = None
        if self._shadow is None:
            return None
        value = trainer.gradient_clip_val
        algo = str(trainer.gradient_clip_algorithm or "norm").lower()
        if value is None or not algo.endswith("norm") or not float(value) > 0:
            return None
        return EngineClip(list(self._shadow[0].main_params(optimizer)), float(value))

    def measured(self, core: Any, engine: EngineClip | None, report: Any) -> None:
        """The step was measured with ``engine``: Lightning's coming clip replays from it."""
        if engine is not None and report is not None and report.engine_norm is not None:
            self._pending = (core, engine.max_norm, report)

    def remove(self) -> None:
        if self._shadow is not None:
            plugin, wrapper, previous = self._shadow
            unshadow_method(plugin, "clip_grad_by_norm", wrapper, previous)
        self._shadow = None
        self._pending = None


class DeepSpeedClip:
    """The DeepSpeed engine's ``gradient_clipping``: the one place gradguard writes it. At attach the
    engine clips to the guard's threshold after its step, or not at all when the guard clips the
    partitions itself before it (``pre_step``); each step the core moves it with the controller; at
    close the user's own value is put back."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._user: float | None = None  # the engine's own clip at attach, put back at close

    def current(self) -> float | None:
        return ds_clip(self.engine) or None

    def set(self, max_norm: float | None) -> None:
        ds_set_clip(self.engine, max_norm)

    def take_over(self, config: GuardConfig, threshold: float, pre_step: bool) -> None:
        self._user = ds_clip(self.engine)
        if config.policy.act and config.clip.mode != "off":
            self.set(None if pre_step else threshold)

    def release(self) -> None:
        if self._user is not None:
            self.set(self._user or None)
            self._user = None
