"""The Trainer's own reporting integrations (``report_to``) as the guard's live sinks.

The Trainer already writes to a W&B run (``WandbCallback``) and a TensorBoard writer
(``TensorBoardCallback``) at its ``logging_steps``, keys prefixed ``train/`` and the x axis
``train/global_step``. gradguard writes into the same run and writer, on the same axis and
prefix: never a second run, never the same key twice (see ``GuardCore.after_step``)."""

from __future__ import annotations

from typing import Any

from ..sinks import Sink, TensorBoardSink, WandbSink

__all__ = ["PREFIX", "STEP_KEY", "bind_integrations", "is_logging_step"]

PREFIX = "train/"  # transformers' rewrite_logs
STEP_KEY = "train/global_step"  # the x axis WandbCallback defines


def bind_integrations(callbacks: list[Any], sinks: list[Sink]) -> list[Sink]:
    """Sinks bound to the integrations found among ``callbacks`` (the Trainer's callback list).
    A user's unbound ``WandbSink`` on the same run is bound in place (so the run is not logged
    twice); returns the new sinks to add. Call once the integrations are set up (after the first
    step: they initialise in their own ``on_train_begin``)."""
    names = {type(cb).__name__: cb for cb in callbacks}
    new: list[Sink] = []
    if "WandbCallback" in names:
        try:
            import wandb
        except ImportError:  # pragma: no cover - the integration needs it
            wandb = None  # type: ignore[assignment]
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            mine = [s for s in sinks if isinstance(s, WandbSink) and s.run is run]
            if mine:
                for s in mine:
                    s.bind(run, step_key=STEP_KEY, prefix=PREFIX)
            else:
                new.append(WandbSink(run=run, step_key=STEP_KEY, prefix=PREFIX))
    tb = names.get("TensorBoardCallback")
    writer = getattr(tb, "tb_writer", None)
    if writer is not None:
        sink = TensorBoardSink(writer=writer, prefix=PREFIX)
        sink.engine_bound = True
        new.append(sink)
    return new


def is_logging_step(args: Any, state: Any, step: int) -> bool:
    """Whether the Trainer logs at ``step`` (``logging_strategy="steps"``; the decision
    ``DefaultFlowCallback`` takes in ``on_step_end``)."""
    if str(getattr(args, "logging_strategy", "steps")).split(".")[-1].lower() != "steps":
        return False
    every = int(getattr(state, "logging_steps", 0) or getattr(args, "logging_steps", 0) or 0)
    if step == 1 and getattr(args, "logging_first_step", False):
        return True
    return every > 0 and step % every == 0
