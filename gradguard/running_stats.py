"""Running statistics (BatchNorm's ``running_mean`` / ``running_var`` / ``num_batches_tracked``) of a
skipped step put back.

A skipped step is not applied to the weights, but its forward already moved the running statistics
of every BatchNorm layer in training mode: a poisoned batch (huge or non-finite activations) leaves
them broken, and evaluation reads them. :class:`RunningStats` copies those buffers at the first
forward of each optimizer step and restores them when the step is not applied.

Interface (called by the core, once per optimizer step)::

    stats = RunningStats(model)   # forward pre-hooks on the BatchNorm-like modules (none: no hooks)
    ...forward/backward of the step's micro-batches...
    stats.settle(applied)         # False: the buffers go back to the copy; then re-armed
    stats.close()                 # hooks removed

Modules covered: ``torch.nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, the
lazy variants) and ``_InstanceNorm`` with ``track_running_stats=True``: the modules whose forward
updates float buffers in training mode. A model without them gets no hooks and costs nothing.
The copy is taken once per step (at the first forward in training mode after :meth:`settle`), on
the buffers' own device (no host sync); it holds one extra copy of those buffers (small).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["RunningStats", "tracks_running_stats"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module``'s forward moves running statistics (a BatchNorm or an InstanceNorm with
    ``track_running_stats=True`` and its buffers allocated)."""
    if not isinstance(module, (_BatchNorm, _InstanceNorm)):
        return False
    return bool(getattr(module, "track_running_stats", False)) and getattr(module, "running_mean", None) is not None


class RunningStats:
    """Copies the running statistics of ``model``'s BatchNorm-like modules at the first forward of a
    step and puts them back with ``settle(applied=False)``."""

    def __init__(self, model: nn.Module) -> None:
        self.modules: list[nn.Module] = [m for m in model.modules() if tracks_running_stats(m)]
        self._saved: dict[int, dict[str, torch.Tensor]] = {}
        self._armed = True
        self._handles: list[Any] = [m.register_forward_pre_hook(self._pre_forward) for m in self.modules]
        self.restored = 0  # steps whose statistics were put back

    @property
    def active(self) -> bool:
        """Whether any module is watched (False: no hooks were installed)."""
        return bool(self._handles)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._armed or not module.training:
            return
        # the first training forward of the step: copy every watched module's buffers at once (a
        # module that runs later in this step must be copied before any of them moves)
        self._armed = False
        self._saved = {}
        with torch.no_grad():
            for m in self.modules:
                bufs = {}
                for name in _BUFFERS:
                    b = getattr(m, name, None)
                    if isinstance(b, torch.Tensor):
                        bufs[name] = b.detach().clone()
                self._saved[id(m)] = bufs

    def settle(self, applied: bool) -> None:
        """End of an optimizer step: ``applied=False`` puts the copied statistics back (exactly, in
        place: the buffers keep their identity, device and dtype). Re-armed for the next step."""
        if not applied and self._saved:
            with torch.no_grad():
                for m in self.modules:
                    for name, saved in self._saved.get(id(m), {}).items():
                        b = getattr(m, name, None)
                        if isinstance(b, torch.Tensor) and b.shape == saved.shape:
                            b.copy_(saved)
            self.restored += 1
        self._saved = {}
        self._armed = True

    def close(self) -> None:
        """Remove the hooks and drop the copy."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._saved = {}
