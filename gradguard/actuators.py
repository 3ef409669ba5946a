"""Actuators: one registry from an action's name to the code that carries it out.

The policy names actions (``lower_lr``, ``tighten_clip``, ``adam``, ``lower_layer_lr``, ``rollback``,
``shrink_batch``, ``halt``...); :class:`Actuators` runs each through the function registered for
it. The built-in ones are registered by the core; an engine adds what it can do (a rollback
source, a batch controller). An action an engine cannot take is recorded with the reason
(``params["unavailable"]``), never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .act import AdamTuner, ClipController, LRMultiplier
from .config import GuardConfig
from .measure import LayerMap
from .policy import Action

__all__ = ["Actuators", "Actuator", "OptimizerActuators", "BatchResizer"]

#: ``fn(action) -> (params, follow-up actions)``
Actuator = Callable[[Action], "tuple[dict[str, Any], list[Action]]"]


class Actuators:
    """Name -> actuator. ``unavailable``: ``{name: why}`` an engine cannot take (DeepSpeed)."""

    def __init__(self, unavailable: dict[str, str] | None = None) -> None:
        self._fns: dict[str, Actuator] = {}
        self.unavailable = dict(unavailable or {})

    def register(self, name: str, fn: Actuator) -> None:
        self._fns[name] = fn

    def has(self, name: str) -> bool:
        return name in self._fns

    def run(self, a: Action) -> list[Action]:
        """Carry ``a`` out (its params get what was done); returns the follow-up actions."""
        why_not = self.unavailable.get(a.name)
        fn = self._fns.get(a.name)
        if why_not:
            a.params["unavailable"] = why_not
        elif fn is None:
            a.params["unavailable"] = f"no {a.name} actuator attached"
        else:
            params, follow = fn(a)
            a.params.update(params or {})
            return follow
        return []


class OptimizerActuators:
    """The optimizer-side actuators (LR, clip, Adam, per-layer LR), registered by the core.
    ``early()``: the instability came before the run learned anything (the LR gets the deep cut);
    ``failed_at()``: the LR multiplier level the instability happened at; ``culprits()``: the
    layers the findings named most."""

    def __init__(self, config: GuardConfig, *, lr: LRMultiplier, clip: ClipController, adam: AdamTuner,
                 layers: LayerMap, early: Callable[[], bool], failed_at: Callable[[], float],
                 culprits: Callable[[], list[str]]) -> None:
        self.config, self.lr, self.clip, self._adam, self.layers = config, lr, clip, adam, layers
        self.early, self.failed_at, self.culprits = early, failed_at, culprits

    def register(self, actuators: Actuators) -> None:
        for name in ("lower_lr", "tighten_clip", "adam", "lower_layer_lr", "halt"):
            actuators.register(name, getattr(self, name))

    def lower_lr(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        is_early = self.early()
        cfg = self.config.lr
        old, new = self.lr.lower(failed_at=self.failed_at(), factor=cfg.early_down_factor if is_early else cfg.down_factor)
        return {"early": is_early, "from": old, "to": new}, []

    def tighten_clip(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        if self.config.clip.mode == "off":
            return {"unavailable": "clip.mode is 'off'"}, []
        old, new = self.clip.tighten()
        return {"from": old, "to": new}, []

    def adam(self, a: Action) -> tuple[dict[str, Any], list[Action]]:  # noqa: F811 - the action's name
        if not self._adam.supported():
            return {"unavailable": "optimizer has no betas/eps"}, []
        return self._adam.apply(), []

    def lower_layer_lr(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        named = self.culprits()
        if not named:
            for pattern in self.config.lr.layer_groups.values():
                named.extend(self.layers.match(pattern))
        return (self.lr.lower_layers(sorted(set(named))) if named else {"unavailable": "no layers"}), []

    def halt(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        return {}, []


class BatchResizer:
    """'shrink_batch' halves the batch (global mode: the LR scaled linearly; micro mode: more
    accumulation, same samples per step), and a stable period doubles it back with max_grad_norm
    held at ``recovery.grow_clip`` for a while. ``controller``: a
    :class:`gradguard.contract.LoaderHandle` (``gradguard.data.BatchController`` is one)."""

    def __init__(self, controller: Any, config: GuardConfig, lr: LRMultiplier, clip: ClipController) -> None:
        self.controller = controller
        self.config = config
        self.lr = lr
        self.clip = clip
        self.healthy = 0

    def shrink(self, a: Action) -> tuple[dict[str, Any], list[Action]]:
        ctl = self.controller
        if self.config.recovery.shrink_mode == "micro":
            moved = ctl.shrink_micro()
            if moved is None:
                return {"unavailable": "the micro-batch cannot be made smaller"}, []
            return {"micro_batch": list(moved), "accumulation": getattr(ctl, "accumulation_steps", None)}, []
        moved = ctl.shrink_global()
        if moved is None:
            return {"unavailable": f"the batch cannot be made smaller than {ctl.batch_size}"}, []
        self.lr.batch_scale = ctl.batch_size / ctl.base_batch_size  # linear scaling
        self.healthy = 0
        return {"batch": list(moved), "lr_scale": self.lr.batch_scale}, []

    def maybe_grow(self, step: int) -> Action | None:
        """After a healthy applied step: doubles the batch back once ``recovery.grow_after`` in a row."""
        ctl = self.controller
        if ctl.batch_size >= ctl.base_batch_size:
            return None
        self.healthy += 1
        rc = self.config.recovery
        if self.healthy < rc.grow_after:
            return None
        self.healthy = 0
        moved = ctl.grow_global()
        if moved is None:
            return None
        self.lr.batch_scale = ctl.batch_size / ctl.base_batch_size
        self.clip.hold(rc.grow_clip, rc.grow_clip_steps)
        return Action("grow_batch", step, "stable period",
                      {"batch": list(moved), "lr_scale": self.lr.batch_scale,
                       "clip_held": rc.grow_clip, "for_steps": rc.grow_clip_steps})
