"""Lightning's own norm clipping, taken over by a guard that does not clip (monitor mode).

Lightning clips in ``precision_plugin.clip_grad_by_norm`` with ``clip_grad_norm_`` over the
optimizer's parameters, after the ``on_before_optimizer_step`` hooks. Unguarded, that is one norm
pass and one scale pass; a watching guard would add its own norm pass. Instead the guard's
measurement (in ``on_before_optimizer_step``) computes the per-tensor norms exactly as
``clip_grad_norm_`` does, and ``clip_grad_by_norm`` is shadowed for the run: at the moment Lightning
clips, the scale is applied from those norms, bit-identical to ``clip_grad_norm_``. Anything that
could change the gradients between the two (a LightningModule overriding ``on_before_optimizer_step``
or ``configure_gradient_clipping``), another clip value, or a step the measurement could not take
over: Lightning's own ``clip_grad_by_norm`` runs.
"""

from __future__ import annotations

from typing import Any

from .._compat import shadow_method, unshadow_method
from ..measure import EngineClip

__all__ = ["ClipTakeover", "hand_clip_to_lightning"]


def _overridden(name: str, pl_module: Any) -> bool:
    try:
        from lightning.pytorch.utilities.model_helpers import is_overridden
    except ImportError:  # pragma: no cover - standalone pytorch_lightning
        from pytorch_lightning.utilities.model_helpers import is_overridden  # type: ignore[no-redef]
    try:
        return bool(is_overridden(name, pl_module))
    except Exception:  # noqa: BLE001 - unknown module class: assume it does
        return True


class ClipTakeover:
    """Per-run state of the monitor-mode clip takeover."""

    def __init__(self) -> None:
        self._shadow: tuple[Any, Any, Any] | None = None  # (precision plugin, wrapper, previous)
        self._pending: tuple[Any, float, Any] | None = None  # (core, clip value, report) of this step

    def install(self, trainer: Any, pl_module: Any, core: Any) -> None:
        """Shadow ``clip_grad_by_norm`` when the guard does not clip and Lightning clips by norm."""
        self.remove()
        if core is None or (core.config.policy.act and core.config.clip.mode != "off"):
            return  # the guard clips (Lightning's clip is switched off by the adapter)
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


def hand_clip_to_lightning(cb: Any, trainer: Any) -> None:
    """A guard that clips (acting, ``clip.mode`` not ``"off"``) keeps Lightning's norm clip at its
    current ``max_norm``; switched off again inside each step it has clipped already."""
    if cb._manage_clip and cb.core is not None:
        trainer.gradient_clip_val = cb.core.max_grad_norm
        trainer.gradient_clip_algorithm = "norm"
