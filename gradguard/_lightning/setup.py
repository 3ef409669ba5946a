"""Lightning setup helpers of the callback's run (:class:`gradguard._lightning.run.LightningRun`): what
in a Lightning setup gradguard cannot guard, a run with nothing to watch, the sinks that feed the
trainer's loggers, the Rich progress bar's console, and two guards under one name."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._compat import pl_log_step
from ..adapter import engine_refusal, sharding_problems
from ..errors import ConfigError
from ..sinks import Sink, TensorBoardSink, WandbSink

__all__ = ["unsupported", "nothing_to_watch", "LightningLoggerSink", "live_sinks", "console_writer",
           "check_unique_names", "import_lightning"]

# strategy class names (substring) -> ENGINE_REFUSALS kind. FSDPStrategy (FSDP1) and ModelParallelStrategy
# (FSDP2 via fully_shard in configure_model) are guarded: the core measures and snapshots the shards
_REFUSED_STRATEGIES = {"DeepSpeed": "deepspeed"}

class LightningLoggerSink(Sink):
    """Rows for one Lightning logger (CSV, MLflow, ...: any without a W&B run or a SummaryWriter),
    at Lightning's step for the current batch, with ``log_metrics(metrics=..., step=...)`` as
    Lightning calls it: the regular rows at Lightning's cadence, and the rows of event steps."""

    engine_bound = True

    def __init__(self, trainer: Any, logger: Any = None) -> None:
        self.trainer = trainer
        self.logger = logger

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        loggers = [self.logger] if self.logger is not None else list(self.trainer.loggers)
        x = pl_log_step(self.trainer)
        for lg in loggers:
            lg.log_metrics(metrics=dict(metrics), step=x)


def live_sinks(trainer: Any, user_sinks: list[Sink]) -> list[Sink]:
    """One engine-bound sink per logger of the trainer: a ``WandbLogger``'s run (a user's unbound
    ``WandbSink`` on that run is bound in place, not doubled), a ``TensorBoardLogger``'s writer,
    else the logger itself; all on Lightning's x axis (``trainer/global_step`` for W&B)."""
    out: list[Sink] = []
    step_fn = lambda _step: pl_log_step(trainer)  # noqa: E731
    for lg in trainer.loggers:
        kind = type(lg).__name__
        if kind == "WandbLogger":
            run = lg.experiment
            mine = [s for s in user_sinks if isinstance(s, WandbSink) and s.run is run]
            for s in mine:
                s.bind(run, step_key="trainer/global_step", step_fn=step_fn)
            if not mine:
                out.append(WandbSink(run=run, step_key="trainer/global_step", step_fn=step_fn))
        elif kind == "TensorBoardLogger" and hasattr(lg.experiment, "add_scalar"):
            sink = TensorBoardSink(writer=lg.experiment, step_fn=step_fn)
            sink.engine_bound = True
            out.append(sink)
        else:
            out.append(LightningLoggerSink(trainer, lg))
    return out


def unsupported(trainer: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    strategy = type(trainer.strategy).__name__
    for key, kind in _REFUSED_STRATEGIES.items():
        if key.lower() in strategy.lower():
            out.update(engine_refusal(kind, f"Trainer(strategy={strategy})"))
            break
    # FSDP1 flat parameters of an unknown layout, as in every engine (FSDPStrategy wraps the LightningModule from outside)
    out.update(sharding_problems(getattr(trainer.strategy, "model", None) or trainer.lightning_module))
    from ..misuse import closure_refusal

    for opt in trainer.optimizers[:1]:
        out.update(closure_refusal(opt))
    return out


def console_writer(trainer: Any) -> Any:
    """The writer of Lightning's Rich progress bar (its console prints above the live bar), or None
    (the default ``tqdm.write`` serves the TQDM bar)."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is None or type(bar).__name__ != "RichProgressBar":
        return None

    def write(line: str, stream: Any) -> None:
        progress = getattr(bar, "progress", None)
        console = getattr(progress, "console", None)
        if console is None:
            print(line, file=stream, flush=True)
        else:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    return write


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


def check_unique_names(me: object, name: str, callbacks: Any, kind: type) -> None:
    """Two guards (instances of ``kind``) of one Trainer under one ``name`` (two default
    ``GradGuardCallback()``s, or ``me`` passed twice: compared by identity) would share one checkpoint
    entry: :class:`ConfigError` naming the ``name=`` fix (before Lightning's own "more than one stateful
    callback" error)."""
    if not isinstance(callbacks, (list, tuple)):
        return
    same = [c for c in callbacks if isinstance(c, kind) and getattr(c, "name", None) == name]
    if len(same) < 2:
        return
    if all(c is me for c in same):
        raise ConfigError(
            f"gradguard: the same GradGuardCallback (name={name!r}) is in the Trainer's callbacks {len(same)} times. "
            "Fix: pass it once")
    raise ConfigError(
        f"gradguard: {len(same)} GradGuardCallbacks named {name!r} in one Trainer: their states would share one "
        "checkpoint entry. Fix: give each its own name, e.g. GradGuardCallback(config_a, name='main') and "
        "GradGuardCallback(config_b, name='second') (a watcher: the 'monitor' preset is named 'monitor' by default)")


def import_lightning() -> ModuleType:
    """``lightning.pytorch``, else the standalone ``pytorch_lightning``."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[no-redef]
        except ImportError as exc:
            raise ImportError("gradguard.lightning needs Lightning: pip install 'gradguard[lightning]' "
                              "(or pytorch-lightning)") from exc
    return pl
