"""What in a Lightning setup gradguard cannot guard, and the sink that feeds the trainer's loggers."""

from __future__ import annotations

from typing import Any

from ..sinks import Sink

__all__ = ["unsupported", "nothing_to_watch", "LightningLoggerSink"]

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
    return out


def nothing_to_watch(trainer: Any) -> str | None:
    """Why this run has no optimizer step over the module's parameters to watch (None: it has).

    ``configure_optimizers`` returning None makes Lightning train with a mock optimizer that
    updates nothing. Parameters that are all frozen when training starts are not a reason: a
    fine-tuning callback (``BaseFinetuning``) unfreezes them later, and the guard follows them as
    long as the optimizer holds them or gets them with ``add_param_group``."""
    module = trainer.lightning_module
    params = {id(p) for p in module.parameters()}
    in_opt = {id(p) for opt in trainer.optimizers for g in getattr(opt, "param_groups", []) for p in g["params"]}
    if not trainer.optimizers or not params & in_opt:
        return ("configure_optimizers returned no optimizer over the module's parameters (Lightning trains with a "
                "mock optimizer that updates nothing)")
    return None
