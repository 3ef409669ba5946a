"""Deterministic fault injectors: rehearse a failure before a long run.

Each injector fires a fault at a chosen optimizer step (for ``steps`` steps) through PyTorch's
own hooks on the model and optimizer, so it works the same under a plain loop, the HF Trainer and
Lightning::

    from gradguard.testing import NaNLoss, GradFault, LRSpike

    guard = gradguard.Guard(model, optimizer, config=cfg)
    with NaNLoss(at_step=50).attach(model, guard=guard), \\
         GradFault("transformer.h.3", at_step=120, kind="inf").attach(model, guard=guard):
        train(...)                      # the guard must skip, roll back or halt with a diagnosis

Injectors:

* :class:`NaNLoss` -- the model output (the loss, or logits) becomes NaN.
* :class:`GradFault` -- inf, NaN or huge (x ``factor``) gradients in the parameters of one layer.
* :class:`LRSpike` -- the LR multiplied by ``factor`` (a scheduler glitch).
* :class:`CorruptBatch` -- inputs and labels replaced by garbage (random ids, scaled floats).
* :class:`OutOfMemory` -- ``torch.OutOfMemoryError`` in the forward, at a step or above a batch size.
* :class:`OverflowStreak` -- inf gradients everywhere, as an fp16 overflow streak (use with a
  real ``GradScaler``: the scaler sees the overflow and halves its scale).
* :class:`SnapshotIOFault` -- the snapshot folder (or the event log) fails with ``ENOSPC`` /
  ``EROFS``, or its files are deleted.
* :class:`SinkFault` -- a metrics sink that raises on every call (a W&B run finished by user code,
  a TensorBoard folder replaced by a file).

**Which step.** With ``guard=`` (a ``Guard``, a ``GuardCore`` or an engine callback with a
``.core``) the step is the guard's (``report.step`` in the log); without one, training forward
passes are counted, ``forwards_per_step`` of them per optimizer step. Each firing is recorded in
``injector.fired`` and, with a guard, as a ``fault_injected`` event in its log.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _io
from .errors import ConfigError, ConfigTypeError

__all__ = ["Injector", "NaNLoss", "GradFault", "LRSpike", "CorruptBatch", "OutOfMemory", "OverflowStreak",
           "SnapshotIOFault", "SinkFault", "INJECTORS"]


def _core(guard: Any) -> Any:
    core = getattr(guard, "core", guard)
    return core


def _map_floats(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_floats(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_floats(v, fn) for v in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = _map_floats(obj[k], fn)  # in place: keeps HF ModelOutput attributes in sync
        return obj
    return obj


class Injector:
    """Base class: a fault active at steps ``at_step .. at_step + steps - 1`` (``steps=None``:
    from ``at_step`` on). Use as a context manager, or call :meth:`detach`."""

    name = "fault"

    def __init__(self, *, at_step: int, steps: int | None = 1) -> None:
        if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 1:
            raise ConfigError(f"{type(self).__name__}.at_step={at_step!r}: must be an int >= 1. "
                             "Fix: pass the optimizer step (1-based) at which the fault starts")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"{type(self).__name__}.steps={steps!r}: must be an int >= 1 or None. "
                             "Fix: pass how many steps the fault lasts (None: until detached)")
        self.at_step = at_step
        self.steps = steps
        self.fired: list[int] = []
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self.guard: Any = None
        self.forwards_per_step = 1
        self._forwards = 0
        self._handles: list[Any] = []

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: Any = None, *, guard: Any = None,
               forwards_per_step: int = 1) -> Injector:
        """Install the hooks. ``guard`` supplies the step numbering (and receives a
        ``fault_injected`` event per firing); without it training forwards are counted."""
        if not isinstance(model, nn.Module):
            raise ConfigTypeError(f"{type(self).__name__}.attach: model={type(model).__name__} is not a torch.nn.Module. "
                            "Fix: pass the model being trained")
        if self.model is not None:
            raise RuntimeError(f"{type(self).__name__} is already attached. Fix: detach() it first")
        from .act import unwrap_optimizer

        self.model = model
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.guard = guard
        self.forwards_per_step = forwards_per_step
        if guard is None:
            self._handles.append(model.register_forward_pre_hook(self._count_forward))
        self._install()
        return self

    def detach(self) -> None:
        """Remove every hook and undo any lasting change (idempotent)."""
        self._uninstall()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model = None

    def __enter__(self) -> Injector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _install(self) -> None:  # pragma: no cover - every injector overrides it
        raise NotImplementedError

    def _uninstall(self) -> None:
        pass

    # -- clock ---------------------------------------------------------------------------------
    def _count_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._forwards += 1

    def step(self) -> int:
        """The optimizer step in progress (1-based)."""
        if self.guard is not None:
            core = _core(self.guard)
            if core is not None and hasattr(core, "step_count"):
                return int(core.step_count) + 1
        return max(0, self._forwards - 1) // max(1, self.forwards_per_step) + 1

    def active(self, step: int | None = None) -> bool:
        step = self.step() if step is None else step
        return step >= self.at_step and (self.steps is None or step < self.at_step + self.steps)

    def _fire(self, **detail: Any) -> None:
        step = self.step()
        if step in self.fired:
            return
        self.fired.append(step)
        core = _core(self.guard) if self.guard is not None else None
        if core is not None and hasattr(core, "emit"):
            core.emit({"type": "fault_injected", "step": step, "fault": self.name, **detail})


class NaNLoss(Injector):
    """The output of the model (or of submodule ``module``) becomes NaN: a NaN loss."""

    name = "nan_loss"

    def __init__(self, *, at_step: int, steps: int | None = 1, module: str | None = None) -> None:
        super().__init__(at_step=at_step, steps=steps)
        self.module = module

    def _install(self) -> None:
        assert self.model is not None
        target = self.model.get_submodule(self.module) if self.module else self.model
        self._handles.append(target.register_forward_hook(self._hook))

    def _hook(self, module: nn.Module, args: Any, out: Any) -> Any:
        if not (self.model is not None and self.model.training and self.active()):
            return None
        self._fire(module=self.module or "model")
        return _map_floats(out, lambda t: t + float("nan"))


class GradFault(Injector):
    """Gradients of the parameters under ``layer`` (a name prefix such as ``"transformer.h.3"``;
    None: every parameter) become inf, NaN, or ``factor`` times larger ('huge')."""

    name = "grad_fault"
    KINDS = ("inf", "nan", "huge")

    def __init__(self, layer: str | None, *, at_step: int, steps: int | None = 1, kind: str = "inf",
                 factor: float = 1e4) -> None:
        super().__init__(at_step=at_step, steps=steps)
        if kind not in self.KINDS:
            raise ConfigError(f"GradFault.kind={kind!r}: unknown. Fix: use one of {list(self.KINDS)}")
        self.layer = layer
        self.kind = kind
        self.factor = factor

    def _install(self) -> None:
        assert self.model is not None
        prefix = self.layer
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and (
            prefix is None or n == prefix or n.startswith(prefix + "."))]
        if not params:
            names = sorted({n.rsplit(".", 1)[0] for n, _ in self.model.named_parameters()})[:10]
            raise ConfigError(f"GradFault.layer={self.layer!r}: no trainable parameter under it. "
                             f"Fix: use a module path of the model, e.g. one of {names}")
        for _, p in params:
            self._handles.append(p.register_hook(self._hook))

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self.active():
            return None
        self._fire(layer=self.layer or "all", kind=self.kind)
        if self.kind == "huge":
            return grad * self.factor
        return torch.full_like(grad, float("inf") if self.kind == "inf" else float("nan"))


class OverflowStreak(GradFault):
    """An fp16 overflow streak: inf gradients everywhere for ``steps`` steps. With a real
    ``GradScaler`` the scaler finds them (``found_inf``), skips and halves its scale."""

    name = "overflow_streak"

    def __init__(self, *, at_step: int, steps: int | None = 6) -> None:
        super().__init__(None, at_step=at_step, steps=steps, kind="inf")


class LRSpike(Injector):
    """The optimizer's LR multiplied by ``factor`` for ``steps`` steps, as a scheduler glitch
    would (re-applied if a scheduler resets the LR; undone afterwards). Needs the optimizer."""

    name = "lr_spike"

    def __init__(self, *, factor: float = 100.0, at_step: int, steps: int | None = 5) -> None:
        super().__init__(at_step=at_step, steps=steps)
        self.factor = float(factor)
        self._spiked: list[float] | None = None
        self._clean: list[float] | None = None
        self._opt_calls = 0

    def step(self) -> int:
        """Without a guard: the number of ``optimizer.step()`` calls so far, this one included (an
        engine that runs the forward inside ``optimizer.step(closure)``, as Lightning does, has not
        counted this step's forward yet when the LR is set)."""
        if self.guard is None:
            return max(1, self._opt_calls)
        return super().step()

    def _install(self) -> None:
        self._opt_calls = 0
        if self.optimizer is None:
            raise ConfigError("LRSpike.attach: optimizer=None. Fix: attach(model, optimizer, ...)")
        handle = self.optimizer.register_step_pre_hook(self._pre)
        hooks = getattr(self.optimizer, "_optimizer_step_pre_hooks", None)
        if hooks is not None and hasattr(hooks, "move_to_end"):
            hooks.move_to_end(handle.id, last=False)  # before a guard's own LR hook, whenever attached
        self._handles.append(handle)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_calls += 1
        groups = optimizer.param_groups
        if self.active():
            if self._spiked is None or any(g["lr"] != s for g, s in zip(groups, self._spiked)):
                self._clean = [g["lr"] for g in groups]  # a scheduler may have set a new clean LR
                for g in groups:
                    g["lr"] = g["lr"] * self.factor
                self._spiked = [g["lr"] for g in groups]
            self._fire(factor=self.factor)
        elif self._spiked is not None:
            self._restore()

    def _restore(self) -> None:
        if self.optimizer is not None and self._spiked is not None and self._clean is not None:
            for g, s, c in zip(self.optimizer.param_groups, self._spiked, self._clean):
                if g["lr"] == s:  # untouched since the spike: put the clean value back
                    g["lr"] = c
        self._spiked = self._clean = None

    def _uninstall(self) -> None:
        self._restore()


class CorruptBatch(Injector):
    """The batch fed to the model is garbage: integer inputs (token ids, labels) replaced by
    random ids in their range, floating inputs multiplied by ``scale``. Deterministic (seeded)."""

    name = "corrupt_batch"

    def __init__(self, *, at_step: int, steps: int | None = 10, scale: float = 1e3, seed: int = 0) -> None:
        super().__init__(at_step=at_step, steps=steps)
        self.scale = scale
        self.gen = torch.Generator().manual_seed(seed)

    def _install(self) -> None:
        assert self.model is not None
        self._handles.append(self.model.register_forward_pre_hook(self._hook, with_kwargs=True))

    def _garble(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                return obj * self.scale
            if obj.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8) and obj.numel():
                high = int(obj.max().item()) + 1
                low = int(obj.min().item())
                if high - low > 1:
                    noise = torch.randint(max(low, 0), high, obj.shape, generator=self.gen)
                    return noise.to(device=obj.device, dtype=obj.dtype)
            return obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._garble(v) for v in obj)
        if isinstance(obj, dict):
            return type(obj)({k: self._garble(v) for k, v in obj.items()})
        return obj

    def _hook(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not (module.training and self.active()):
            return None
        self._fire()
        return self._garble(args), self._garble(kwargs)


class OutOfMemory(Injector):
    """``torch.OutOfMemoryError`` raised in the forward: the first ``times`` training forwards of
    step ``at_step``, or (with ``above_batch``) every forward from ``at_step`` on whose batch has
    more than ``above_batch`` samples (a smaller micro-batch then succeeds)."""

    name = "out_of_memory"

    def __init__(self, *, at_step: int, times: int = 1, above_batch: int | None = None) -> None:
        super().__init__(at_step=at_step, steps=None if above_batch is not None else 1)
        self.times = times
        self.above_batch = above_batch
        self.raised = 0

    def _install(self) -> None:
        assert self.model is not None
        self._handles.append(self.model.register_forward_pre_hook(self._hook, with_kwargs=True))

    @staticmethod
    def _batch(args: Any, kwargs: Any) -> int | None:
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return int(v.shape[0])
            if isinstance(v, dict):
                n = OutOfMemory._batch((), v)
                if n is not None:
                    return n
        return None

    def _hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not (module.training and self.active()):
            return
        if self.above_batch is not None:
            n = self._batch(args, kwargs)
            if n is None or n <= self.above_batch:
                return
        elif self.raised >= self.times:
            return
        self.raised += 1
        self._fire(above_batch=self.above_batch)
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by gradguard.testing at step {self.step()})")


class SnapshotIOFault(Injector):
    """gradguard's own files fail from ``at_step`` on: ``target='snapshots'`` (the recovery
    ``disk_dir``), ``'events'`` (the JSONL log's folder) or a path. ``mode='error'`` makes every
    write there fail with ``errno`` (``ENOSPC``: disk full, ``EROFS``: read-only; ``reads=True``
    fails reads too); ``mode='delete'`` deletes the snapshot files once. Needs ``guard=`` unless
    ``target`` is a path."""

    name = "io_fault"

    def __init__(self, *, at_step: int, steps: int | None = None, target: str = "snapshots",
                 mode: str = "error", errno: int = _errno.ENOSPC, reads: bool = False) -> None:
        super().__init__(at_step=at_step, steps=steps)
        if mode not in ("error", "delete"):
            raise ConfigError(f"SnapshotIOFault.mode={mode!r}: unknown. Fix: use 'error' or 'delete'")
        self.target = target
        self.mode = mode
        self.errno = errno
        self.reads = reads
        self._fault: _io.IOFault | None = None
        self._done = False

    def _install(self) -> None:
        assert self.model is not None
        if self.target in ("snapshots", "events") and self.guard is None:
            raise ConfigError(f"SnapshotIOFault(target={self.target!r}).attach: guard=None. "
                             "Fix: attach(model, guard=guard), or pass target=<a folder path>")
        self._handles.append(self.model.register_forward_pre_hook(self._tick))

    def root(self) -> str | None:
        """The folder that fails."""
        if self.target == "snapshots":
            core = _core(self.guard)
            return None if core is None else core.config.recovery.disk_dir
        if self.target == "events":
            core = _core(self.guard)
            log = None if core is None else core.log_path
            return None if log is None else os.path.dirname(log)
        return self.target

    def _tick(self, module: nn.Module, args: Any) -> None:
        if not module.training:
            return
        active = self.active()
        if active and not self._done:
            root = self.root()
            if root is None:
                return
            self._done = True
            self._fire(target=self.target, mode=self.mode, errno=self.errno)
            if self.mode == "delete":
                for dirpath, _, files in os.walk(root):
                    for f in files:
                        if f.startswith("snapshot-"):
                            try:
                                os.remove(os.path.join(dirpath, f))
                            except OSError:
                                pass
            else:
                self._fault = _io.add_fault(_io.IOFault(root, errno=self.errno, reads=self.reads))
        elif not active and self._fault is not None:
            self._uninstall()

    def _uninstall(self) -> None:
        if self._fault is not None:
            _io.remove_fault(self._fault)
            self._fault = None


class SinkFault(Injector):
    """A sink of the guard fails from ``at_step`` on: every call raises (``error``), as a W&B sink
    does once user code called ``wandb.finish()``, or a TensorBoard writer whose folder became a
    file. The failing sink is added to the guard's sinks (the others keep working). Needs ``guard=``."""

    name = "sink_fault"

    def __init__(self, *, at_step: int, steps: int | None = None,
                 error: str = "You must call wandb.init() before wandb.log()") -> None:
        super().__init__(at_step=at_step, steps=steps)
        self.error = error
        self._sink: Any = None

    def _install(self) -> None:
        assert self.model is not None
        if self.guard is None:
            raise ConfigError("SinkFault.attach: guard=None. Fix: attach(model, guard=guard)")
        self._handles.append(self.model.register_forward_pre_hook(self._tick))

    def _tick(self, module: nn.Module, args: Any) -> None:
        core = _core(self.guard)
        if not module.training or core is None or not hasattr(core, "add_live_sinks"):
            return
        if self._sink is None:
            from .sinks import Sink

            fault = self

            class FailingSink(Sink):
                def _check(self) -> None:
                    if fault.model is not None and fault.active():
                        fault._fire(error=fault.error)
                        raise RuntimeError(f"{fault.error} (injected by gradguard.testing)")

                def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
                    self._check()

                def log_event(self, event: dict[str, Any]) -> None:
                    if event.get("type") != "fault_injected":
                        self._check()

            self._sink = FailingSink()
            core.add_live_sinks([self._sink])


#: Every injector class, by name (for parametrized rehearsals).
INJECTORS: dict[str, type[Injector]] = {
    cls.name: cls for cls in (NaNLoss, GradFault, LRSpike, CorruptBatch, OutOfMemory, OverflowStreak,
                              SnapshotIOFault, SinkFault)
}
