"""FIT_START of the Lightning callback: what in a Lightning setup gradguard cannot guard, the guard's
core built on the LightningModule and the first optimizer (the clip rule, the log folder, the sinks
that feed the trainer's loggers), the engine-side pieces attached (loader handle, checkpoint
source, step wrappers, clip takeover), and their removal."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._compat import check_features, pl_log_step
from ..act import unwrap_optimizer
from ..adapter import (
    check_ladder,
    engine_refusal,
    may_wrap,
    refuse_unsupported,
    resolve_clip,
    sharding_problems,
    stand_aside,
)
from ..errors import ConfigError, warn
from ..guard import GuardCore
from ..logdir import choose_log_dir
from ..sinks import Sink, TensorBoardSink, WandbSink
from .boundary import engine_logs, skip_data, watch_optimizer_step
from .clip import hand_clip_to_lightning
from .loader import TrainerLoader
from .state import apply_pending

__all__ = ["unsupported", "nothing_to_watch", "LightningLoggerSink", "live_sinks", "console_writer", "start",
           "attach", "remove_wrappers", "teardown_core"]

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


def start(cb: Any, trainer: Any, pl_module: Any) -> None:
    """FIT_START: refusals, standing aside without an optimizer over the module, the core built (or
    kept, when fit runs again with the same optimizer), the guard state of a resumed run applied."""
    log_dir = trainer.log_dir  # a collective under DDP: called on every rank
    cb._trainer = trainer
    check_ladder(cb.config)
    why = nothing_to_watch(trainer)
    if why is not None:
        if cb.core is not None:
            teardown_core(cb)
        stand_aside(why)
        return
    if not refuse_unsupported(cb.config, unsupported(trainer)):
        return  # monitor mode on an unsupported setup: stand aside
    opt = unwrap_optimizer(trainer.optimizers[0])
    if len(trainer.optimizers) > 1:
        warn("gradguard: several optimizers: only the first one is guarded", stacklevel=3)
    if cb.core is not None and cb.core.optimizer is opt:
        hand_clip_to_lightning(cb, trainer)
        attach(cb, trainer, pl_module)
        return
    if cb.core is not None:
        teardown_core(cb)
    cb.core = _build_core(cb, trainer, pl_module, opt, log_dir)
    # after the core's LR-multiplier hooks: tells whether the core's pre-hook already ran when
    # on_before_optimizer_step fires (Lightning runs the closure inside optimizer.step()).
    cb._hook_handles = watch_optimizer_step(cb, opt)
    attach(cb, trainer, pl_module)
    one_counter = bool(pl_module.automatic_optimization) and len(trainer.optimizers) == 1  # global_step == guard steps
    if not apply_pending(cb, trainer.global_step if one_counter else None):
        cb.core.start_at(trainer.global_step)  # resumed without a guard state: follow global_step
    hand_clip_to_lightning(cb, trainer)


def _build_core(cb: Any, trainer: Any, pl_module: Any, opt: Any, log_dir: Any) -> GuardCore:
    """The core on the LightningModule and ``opt``: ``gradient_clip_val`` as the starting clip (when
    the guard clips), one event log and console (rank 0), the trainer's loggers as sinks."""
    cfg = cb.config
    rank0 = trainer.global_rank == 0
    cb._manage_clip = bool(cfg.policy.act and cfg.clip.mode != "off" and pl_module.automatic_optimization)
    if cb._manage_clip:
        algo = str(trainer.gradient_clip_algorithm or "norm").lower()
        value = trainer.gradient_clip_val if algo.endswith("norm") else None
        cfg, _ = resolve_clip(cfg, value, engine_default=None, setting="Trainer(gradient_clip_val)")
    if not rank0:  # one event log and one console per run
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False, console=False))
    sinks: list[Sink] = []
    if rank0:
        sinks = list(cb.extra_sinks)
        if cb.log_to_loggers and trainer.loggers:
            sinks.extend(live_sinks(trainer, sinks))
    out_dir = None
    if cfg.output.jsonl:  # rank 0: where the engine keeps its logs (gradguard.logdir)
        # without a logger Lightning keeps no log folder: default_root_dir is where its HPC
        # checkpoints (hpc_ckpt_*.ckpt) go, so it counts as a checkpoint folder
        out_dir = choose_log_dir(cb.out_dir or cfg.output.dir, [log_dir if trainer.loggers else None],
                                 engine="Lightning", how_to_name="GradGuardCallback(out_dir=...)",
                                 checkpoint_dirs=[trainer.default_root_dir,
                                                  *(getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks)])
        if out_dir is None:
            cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False))
    cb.scaler = getattr(trainer.precision_plugin, "scaler", None)
    sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
    core = GuardCore(pl_module, opt, config=cfg, sinks=sinks, out_dir=out_dir, layer_fn=cb.layer_fn,
                     scheduler=sched, scaler=cb.scaler, shard_root=trainer.strategy.model, engine="lightning")
    core.attach_data_skip(lambda action: skip_data(cb, action))
    core.set_engine_step(lambda _step: pl_log_step(trainer))  # the x of the user's self.log rows
    core.ratio_due = lambda _step: engine_logs(cb, trainer) is True
    write = console_writer(trainer)
    if write is not None:
        core.set_console_writer(write)
    return core


def attach(cb: Any, trainer: Any, pl_module: Any) -> None:
    """Plug the engine-side pieces in: loader handle, checkpoint source, step wrappers, clip takeover."""
    core = cb.core
    assert core is not None
    cb.batches = None
    missing = check_features("lightning", trainer)
    if core.config.policy.act:
        sampler = TrainerLoader.find_sampler(trainer) if "batch_resize" not in missing else None
        if sampler is not None:
            cb.batches = TrainerLoader(trainer, sampler)
            cb.batches.make_live()
            core.attach_batches(cb.batches)
        if getattr(trainer, "checkpoint_callbacks", None) and "checkpoint_rollback" not in missing:
            cb.ckpt_files.state_key = cb.state_key
            cb.ckpt_files.bind(trainer, cb.scaler, core.config.recovery.restore_schedule)
            core.attach_checkpoints(cb.ckpt_files)
    cb.steps.remove()
    if may_wrap(core.config):  # monitor mode wraps nothing
        cb.steps.install(trainer, pl_module)
    cb.clip_takeover.install(trainer, pl_module, core)


def remove_wrappers(cb: Any) -> None:
    """The step wrappers and the clip takeover removed (the end of fit, an exception, teardown)."""
    cb.steps.remove()
    cb.clip_takeover.remove()


def teardown_core(cb: Any) -> None:
    """The core detached and dropped, with every hook and wrapper the callback installed."""
    for h in cb._hook_handles:
        h.remove()
    cb._hook_handles = []
    remove_wrappers(cb)
    if cb.core is not None:
        cb.core.detach()
    cb.core = None


def check_unique_names(cb: Any, callbacks: Any) -> None:
    """Two guards of one Trainer under one ``name`` (two default ``GradGuardCallback()``s, or one
    instance passed twice) would share one checkpoint entry: :class:`ConfigError` naming the
    ``name=`` fix (before Lightning's own "more than one stateful callback" error)."""
    if not isinstance(callbacks, (list, tuple)):
        return
    same = [c for c in callbacks if getattr(c, "_gradguard_callback", False) and getattr(c, "name", None) == cb.name]
    if len(same) < 2:
        return
    if all(c is cb for c in same):
        raise ConfigError(
            f"gradguard: the same GradGuardCallback (name={cb.name!r}) is in the Trainer's callbacks {len(same)} times. "
            "Fix: pass it once")
    raise ConfigError(
        f"gradguard: {len(same)} GradGuardCallbacks named {cb.name!r} in one Trainer: their states would share one "
        "checkpoint entry. Fix: give each its own name, e.g. GradGuardCallback(config_a, name='main') and "
        "GradGuardCallback(config_b, name='second') (a watcher: the 'monitor' preset is named 'monitor' by default)")
