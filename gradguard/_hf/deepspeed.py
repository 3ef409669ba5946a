"""The HF callback under DeepSpeed ZeRO 1/2 (``TrainingArguments(deepspeed=...)``).

DeepSpeed steps inside ``accelerator.backward`` of the boundary micro-batch, before the Trainer's
``on_pre_optimizer_step``; the core is therefore driven as for a
:class:`gradguard.contract.SteppingEngine` (see :mod:`gradguard.deepspeed`):

* ``on_step_begin`` -> ENGINE_STEP_START (``core.engine_step_begin``: first snapshot, LR multiplier on)
* the model's forward hook -> MICRO_LOSS
* ``on_pre_optimizer_step`` -> ENGINE_STEP_END (``core.engine_step_end``: the engine's norm, loss
  scale and overflow flag; a halt stops the Trainer and saves)
* ``on_step_end`` -> AFTER_OPTIMIZER_STEP (``core.after_step``)

``TrainingArguments.max_grad_norm`` (DeepSpeed's ``gradient_clipping``) becomes the guard's starting
clip; the engine clips to the guard's threshold from then on.
"""

from __future__ import annotations

from typing import Any

import torch

from ..deepspeed import DeepSpeedEngineHandle, build_config
from ..guard import GuardCore, StepReport

__all__ = ["DeepSpeedRun"]


class DeepSpeedRun:
    """One ``train()`` of the callback over a DeepSpeed engine."""

    def __init__(self, config: Any, engine: Any, lr_scheduler: Any, sinks: list[Any], out_dir: str | None) -> None:
        self.handle = DeepSpeedEngineHandle(engine)
        self.engine = engine
        config = build_config(config, engine)
        self.core = GuardCore(engine.module, engine.optimizer, config=config, sinks=sinks, out_dir=out_dir,
                              scheduler=lr_scheduler, stepping=self.handle)
        self.core.emit(self.handle.describe())
        if config.policy.act and config.clip.mode != "off":
            self.handle.set_clip(self.core.clip.threshold(0.0))
        self._losses: list[torch.Tensor] = []
        self._hook = engine.module.register_forward_hook(self._forward_hook, with_kwargs=True)
        self.report: StepReport | None = None

    def _forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            self.core.observe_loss(loss.detach().float().mean())

    def step_begin(self) -> None:
        self.core.engine_step_begin()

    def pre_optimizer_step(self) -> StepReport:
        self.report = self.core.engine_step_end()
        return self.report

    def step_end(self, engine_logs: bool) -> StepReport | None:
        report, self.report = self.report, None
        if report is not None:
            self.core.after_step(report, engine_logs=engine_logs)
        return report

    def state(self) -> dict[str, Any]:
        return {"guard": self.core.state_dict()}

    def close(self) -> dict[str, Any]:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return self.core.detach()
