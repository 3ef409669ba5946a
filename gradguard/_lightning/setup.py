"""What in a Lightning setup gradguard cannot guard, and the sink that feeds the trainer's loggers."""

from __future__ import annotations

from typing import Any

from ..sinks import Sink

__all__ = ["unsupported", "LightningLoggerSink"]

_REFUSED_STRATEGIES = {"DeepSpeed": "DeepSpeed steps the optimizer and clips inside its engine, so gradguard can "
                                    "neither measure the pre-clip gradients nor skip a step safely",
                       "FSDP": "FSDP shards the gradients, so per-layer norms measured on one rank are partial"}


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
    for key, why in _REFUSED_STRATEGIES.items():
        if key.lower() in strategy.lower():
            out[f"Trainer(strategy={strategy})"] = f"{why}. Fix: train with DDP or a single device when using " \
                                                   "GradGuardCallback, or remove the callback"
    module = trainer.lightning_module
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    in_opt = {id(p) for opt in trainer.optimizers for g in getattr(opt, "param_groups", []) for p in g["params"]}
    from ..misuse import closure_refusal

    for opt in trainer.optimizers[:1]:
        out.update(closure_refusal(opt))
    if not trainer.optimizers or not trained & in_opt:
        out["configure_optimizers"] = ("the trainer has no optimizer over the module's parameters (Lightning trains "
                                       "with a mock optimizer). Fix: return one from configure_optimizers")
    return out
