"""Setting up a run in the Trainer: what gradguard cannot guard, the clip rule, the event log's
folder, the callback's place in the Trainer's callback list; and the Trainer's log entries."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from .._compat import check_features, is_deepspeed_engine
from ..act import unwrap_optimizer
from ..adapter import SchedulerHold, engine_refusal, refuse_unsupported
from ..clip import check_ladder
from ..config import GuardConfig
from ..errors import ConfigError, warn
from ..guard import GuardCore
from ..logdir import choose_log_dir
from ..sinks import Sink
from .checkpoints import TrainerCheckpoints
from .loader import TrainerLoader
from .norm import StepDecision
from .steps import StepRunner

__all__ = ["once_in_callbacks", "unsupported", "validate", "per_process_config", "event_log_dir", "build", "log_entries", "tensorboard_dir"]

_UNSKIPPABLE_OPTIMS = ("lomo", "adalomo")  # update inside backward: no optimizer step to skip


def validate(config: GuardConfig, args: Any, optimizer: Any, trainer: Any = None) -> bool:
    """Whether gradguard guards this setup (False: monitor mode on an unsupported one, standing aside);
    a config or setup it refuses raises at ``on_train_begin`` (the clip rule: :class:`gradguard.clip.HFClip`,
    evaluated once, right after)."""
    check_ladder(config)
    return refuse_unsupported(config, unsupported(args, optimizer, trainer))


def per_process_config(config: GuardConfig, args: Any) -> GuardConfig:
    """The run's config (the clip rule applied: :class:`gradguard.clip.HFClip`) on this process: one
    event log and console per run (the main process writes them)."""
    if getattr(args, "process_index", 0) != 0:
        config.output = dataclasses.replace(config.output, jsonl=False, console=False)
    return config


def event_log_dir(cfg: GuardConfig, out_dir: str | None, callbacks: list[Any], args: Any) -> str | None:
    """The event log's folder on the main process: where the Trainer keeps its logs
    (:mod:`gradguard.logdir`); none found turns ``cfg.output.jsonl`` off."""
    if not cfg.output.jsonl:
        return None
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    found = choose_log_dir(out_dir or cfg.output.dir, [tensorboard_dir(callbacks, args)],
                           engine="HF Trainer", how_to_name="GradGuardCallback(out_dir=...)",
                           checkpoint_dirs=[args.output_dir], checkpoint_prefix=PREFIX_CHECKPOINT_DIR)
    if found is None:
        cfg.output = dataclasses.replace(cfg.output, jsonl=False)
    return found


def build(cfg: GuardConfig, replay_clip: float | None, args: Any, model: Any, optimizer: Any, lr_scheduler: Any,
          train_dataloader: Any, sinks: list[Sink], out_dir: str | None
          ) -> tuple[GuardCore, StepRunner, StepDecision, TrainerLoader]:
    """The run's core on the Trainer's model, optimizer, LR scheduler and GradScaler, with the
    Trainer's plumbing attached: the ``training_step`` runner (data skip), the ``checkpoint-*``
    folders (rollback), the train dataloader (batch size), and the step decisions."""
    scaler = getattr(optimizer, "scaler", None)
    opt = unwrap_optimizer(optimizer)
    core = GuardCore(model, opt, config=cfg, sinks=sinks, out_dir=out_dir, scheduler=lr_scheduler, scaler=scaler,
                     engine="hf")
    check_features("hf")
    runner = StepRunner(core, args, list(model.parameters()))
    decision = StepDecision(core, runner, scaler=scaler, replay_clip=replay_clip, held=SchedulerHold([lr_scheduler]))
    core.attach_data_skip(runner.skip_data)
    core.attach_checkpoints(TrainerCheckpoints(args.output_dir, model, opt, scaler=scaler, scheduler=lr_scheduler,
                                               restore_schedule=cfg.recovery.restore_schedule))
    batches = TrainerLoader(train_dataloader, args.gradient_accumulation_steps, runner)
    core.attach_batches(batches)
    return core, runner, decision, batches


def once_in_callbacks(callback: object, handler: Any, config: GuardConfig) -> None:
    """The same callback instance in the Trainer's callback list twice (``callbacks=[cb]`` and then
    ``trainer.add_callback(cb)``; the Trainer only warns): every event would reach it twice, each step
    measured and counted twice and its state saved under one key. Acting: :class:`ConfigError`;
    monitor mode: a warning, and the second entry is taken out (it must not stop the run).
    ``callback`` is only compared by identity."""
    callbacks = getattr(handler, "callbacks", None)
    if not isinstance(callbacks, list):
        return
    n = sum(c is callback for c in callbacks)
    if n < 2:
        return
    message = (f"GradGuardCallback: the same callback instance is in the Trainer's callbacks {n} times, so every "
               "step would be measured and acted on {n} times. Fix: pass it once (Trainer(callbacks=[cb]) or "
               "trainer.add_callback(cb), not both)").replace("{n}", str(n))
    if config.policy.act:
        raise ConfigError(f"gradguard: {message}")
    first = callbacks.index(callback)
    callbacks[:] = [c for i, c in enumerate(callbacks) if c is not callback or i == first]
    warn(f"gradguard: {message}. Monitor mode keeps the first and removed the others", stacklevel=4)


def unsupported(args: Any, optimizer: Any, trainer: Any = None) -> dict[str, str]:
    """What in this Trainer setup gradguard cannot guard (see ``gradguard.adapter.refuse_unsupported``).
    ``trainer``: also FSDP and DeepSpeed enabled outside ``TrainingArguments`` (``accelerate launch``
    with an FSDP or DeepSpeed config: the Trainer's ``is_fsdp_enabled`` / ``is_deepspeed_enabled``)."""
    out: dict[str, str] = {}
    engine = getattr(trainer, "model_wrapped", None)
    if getattr(trainer, "is_deepspeed_enabled", False) is True and is_deepspeed_engine(engine):
        from ..deepspeed import problems as deepspeed_problems

        out.update(deepspeed_problems(engine))  # ZeRO 1/2 guarded through the engine's signals
    elif getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        ds = args.deepspeed
        out.update(engine_refusal("deepspeed", f"TrainingArguments.deepspeed={ds!r}",
                                  " (the DeepSpeed engine was not found on the Trainer)"))
    elif getattr(trainer, "is_deepspeed_enabled", False) is True:
        out.update(engine_refusal("deepspeed", "Trainer.is_deepspeed_enabled=True (accelerate's DeepSpeed plugin)",
                                  " (the DeepSpeed engine was not found on the Trainer)"))
    if getattr(args, "fsdp", None) and args.fsdp not in ("", [], None):
        out.update(engine_refusal("fsdp", f"TrainingArguments.fsdp={args.fsdp!r}"))
    elif getattr(trainer, "is_fsdp_enabled", False) is True:
        out.update(engine_refusal("fsdp", "Trainer.is_fsdp_enabled=True (accelerate's FSDP plugin)"))
    optim_name = str(getattr(args, "optim", "")).lower()
    if any(optim_name.endswith(n) or optim_name == n for n in _UNSKIPPABLE_OPTIMS):
        out[f"TrainingArguments.optim={args.optim!r}"] = (
            "this optimizer updates the weights during backward, so a poisoned step cannot be skipped. Fix: use an "
            "optimizer with a step() (e.g. optim='adamw_torch')")
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        from ..act import unwrap_optimizer
        from ..misuse import closure_refusal

        out.update(closure_refusal(unwrap_optimizer(optimizer)))
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        out[f"optimizer={type(optimizer).__name__}"] = (
            "gradguard needs a torch optimizer with param_groups (to skip a step, apply LR multipliers and change "
            "Adam's betas). Fix: use a torch.optim optimizer")
    return out


def log_entries(metrics: dict[str, float], window: list[float], layer_metrics: bool, nonfinite_key: str) -> dict[str, float]:
    """The ``gradguard/...`` entries added to one Trainer log: the core's metrics (per-layer values
    only with ``layer_metrics``), the mean guard loss of the logging window (nan/inf stay visible)
    and the number of its non-finite steps."""
    m = dict(metrics)
    if not layer_metrics:
        m = {k: v for k, v in m.items() if k.count("/") < 2 or k.startswith("gradguard/lr/")
             or k.startswith("gradguard/action/") or k.endswith("/total")}
    if window:
        m["gradguard/loss"] = sum(window) / len(window)
        m[nonfinite_key] = float(sum(not math.isfinite(v) for v in window))
    else:
        m.pop("gradguard/loss", None)  # no step of this logging window was computed (a skipped data window)
    return m


def tensorboard_dir(callbacks: list[Any] | None, args: Any) -> str | None:
    """The Trainer's logging directory: the TensorBoard integration's (``TENSORBOARD_LOGGING_DIR``,
    else ``<output_dir>/runs/<time>_<host>``), None when the Trainer does not report to TensorBoard
    (transformers 5 has no ``TrainingArguments.logging_dir``). This callback runs before the
    reporters, so the default folder is computed here as the integration computes it and handed
    to it: both write to the same folder."""
    try:
        from transformers.integrations import TensorBoardCallback
        from transformers.integrations.integration_utils import default_logdir
    except ImportError:  # pragma: no cover - an older transformers
        return None
    tb = next((c for c in callbacks or [] if isinstance(c, TensorBoardCallback)), None)
    if tb is None:
        return None
    if getattr(tb, "logging_dir", None) is None:
        tb.logging_dir = os.path.join(args.output_dir, default_logdir())
    return str(tb.logging_dir)
