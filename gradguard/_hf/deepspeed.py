"""The HF callback under DeepSpeed ZeRO 1/2 (``TrainingArguments(deepspeed=...)``).

DeepSpeed steps inside ``accelerator.backward`` of the boundary micro-batch (accelerate calls
``engine.step()`` after ``engine.backward``), before the Trainer's ``on_pre_optimizer_step``. The
callback therefore shadows ``engine.step`` on the engine instance for the run (removed at the end)
and drives the core there, as the plain loop does (:func:`gradguard.deepspeed.run_engine_step`):

* the model's forward hook -> MICRO_LOSS
* ``engine.step()`` at an accumulation boundary -> BEFORE_OPTIMIZER_STEP (the partition's
  per-layer norms, decide, clip, skip through DeepSpeed's overflow path), the engine's own step
  with the LR multiplier on; or, where the partition cannot be read, ENGINE_STEP_START/END
* ``on_pre_optimizer_step`` -> a halt stops the Trainer and saves
* ``on_step_end`` -> AFTER_OPTIMIZER_STEP (``core.after_step``)

``TrainingArguments.max_grad_norm`` (DeepSpeed's ``gradient_clipping``) becomes the guard's starting
clip; the engine clips to the guard's threshold from then on.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import shadow_method, unshadow_method
from ..deepspeed import DeepSpeedEngineHandle, run_engine_step
from ..guard import GuardCore, StepReport
from .steps import output_loss

__all__ = ["DeepSpeedRun"]


class DeepSpeedRun:
    """One ``train()`` of the callback over a DeepSpeed engine."""

    def __init__(self, config: Any, engine: Any, lr_scheduler: Any, sinks: list[Any], out_dir: str | None) -> None:
        """``config``: the clip rule applied already (:class:`gradguard.clip.HFClip`, which reads the
        engine's ``gradient_clipping`` where it is not the Trainer's ``max_grad_norm``)."""
        self.handle = DeepSpeedEngineHandle(engine)
        self.engine = engine
        self.core = GuardCore(engine.module, engine.optimizer, config=config, sinks=sinks, out_dir=out_dir,
                              scheduler=lr_scheduler, stepping=self.handle, engine="hf")
        self.handle.attach(self.core)
        self._hook = engine.module.register_forward_hook(self._forward_hook, with_kwargs=True)
        self.report: StepReport | None = None
        original = engine.step

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if not engine.is_gradient_accumulation_boundary():
                return original(*args, **kwargs)
            self.report, out = run_engine_step(self.core, self.handle, lambda: original(*args, **kwargs))
            return out

        self._step = guarded_step
        self._previous = shadow_method(engine, "step", guarded_step)

    def _forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        loss = output_loss(output, kwargs)
        if isinstance(loss, torch.Tensor):
            self.core.observe_loss(loss.detach().float().mean())

    def pre_optimizer_step(self) -> StepReport | None:
        """The report of the step the engine has just taken (None if it took none)."""
        return self.report

    def step_end(self, engine_logs: bool) -> StepReport | None:
        report, self.report = self.report, None
        if report is not None:
            self.core.after_step(report, engine_logs=engine_logs)
        return report

    def close(self) -> dict[str, Any]:
        unshadow_method(self.engine, "step", self._step, self._previous)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return self.core.detach()
