"""What in a Lightning setup gradguard cannot guard, and the sink that feeds the trainer's loggers."""

from __future__ import annotations

from typing import Any

from ..adapter import engine_refusal
from ..sinks import Sink

__all__ = ["unsupported", "LightningLoggerSink"]

# strategy class names (substring) -> ENGINE_REFUSALS kind; ModelParallelStrategy is FSDP2 (+ TP)
_REFUSED_STRATEGIES = {"DeepSpeed": "deepspeed", "FSDP": "fsdp", "ModelParallel": "fsdp"}

class LightningLoggerSink(Sink):
    """Forwards the core's metrics to every logger of the trainer (CSV, TensorBoard, W&B...)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for lg in self.trainer.loggers:
            lg.log_metrics(dict(metrics), step=self.trainer.global_step)


def unsupported(trainer: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    strategy = type(trainer.strategy).__name__
    for key, kind in _REFUSED_STRATEGIES.items():
        if key.lower() in strategy.lower():
            out.update(engine_refusal(kind, f"Trainer(strategy={strategy})"))
            break
    module = trainer.lightning_module
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    in_opt = {id(p) for opt in trainer.optimizers for g in getattr(opt, "param_groups", []) for p in g["params"]}
    if not trainer.optimizers or not trained & in_opt:
        out["configure_optimizers"] = ("the trainer has no optimizer over the module's parameters (Lightning trains "
                                       "with a mock optimizer). Fix: return one from configure_optimizers")
    return out
