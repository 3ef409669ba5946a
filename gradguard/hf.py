"""gradguard for the Hugging Face ``transformers.Trainer``: one callback, nothing else changed.

``Trainer(..., callbacks=[GradGuardCallback()])``. The callback only translates Trainer events into
:class:`gradguard.guard.GuardCore` calls; detection and policy live in the core.

How the Trainer's events map onto the core:

* ``on_train_begin``: validates the setup, builds the core on the Trainer's model, optimizer, LR
  scheduler and GradScaler, and sets ``args.max_grad_norm = inf`` so the Trainer still unscales
  and measures the gradients but never clips them (gradguard clips, reusing its own norms).
  ``args.max_grad_norm`` (when finite and > 0) becomes the guard's starting ``clip.max_norm``; it is
  put back at the end of training, and written with the guard's current value into checkpoints.
* a forward hook on the model reads ``outputs.loss`` of every training micro-batch; the step's loss
  is their mean, or their sum when the Trainer passed ``num_items_in_batch`` (the loss is then
  already normalised by the whole accumulated batch).
* ``on_pre_optimizer_step`` (gradients accumulated, unscaled, not clipped): ``core.before_step``.
  A skipped step sets every ``p.grad = None`` (the optimizer step is a no-op, Adam's step count
  does not move) and holds the LR scheduler for that one ``step()`` call.
* ``on_step_end``: ``core.after_step``; a halt sets ``should_training_stop`` and ``should_save``
  and writes ``<out>/gradguard/diagnosis.json``; ``GradGuardHalt`` is raised after the save.
* ``on_log``: ``gradguard/...`` metrics are added to the Trainer's logs (the callback moves itself
  ahead of the reporting integrations so that they receive them). ``gradguard/loss`` is the mean
  guard loss of the logging window, non-finite values included (the Trainer's
  ``logging_nan_inf_filter`` hides them from ``loss``).
* checkpoints: the guard's state is an ``ExportableState`` entry of ``trainer_state.json`` and a
  ``gradguard_state.json`` file in the checkpoint folder; ``train(resume_from_checkpoint=...)``
  restores it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

from .act import unwrap_optimizer
from .config import ClipConfig, ConfigError, GuardConfig
from .guard import GradGuardHalt, GuardCore, StepReport
from .policy import Action
from .sinks import M, Sink, _clean

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("gradguard.hf needs transformers: pip install 'gradguard[hf]'") from exc

__all__ = ["GradGuardCallback", "STATE_FILE", "NONFINITE_LOSS_STEPS"]

#: Name of the guard's state file inside each ``checkpoint-*`` folder.
STATE_FILE = "gradguard_state.json"
#: Steps with a non-finite loss in the logging window (added to the Trainer's logs).
NONFINITE_LOSS_STEPS = M.NONFINITE_LOSS_STEPS

_UNSKIPPABLE_OPTIMS = ("lomo", "adalomo")  # update inside backward: no optimizer step to skip


class _HeldScheduler:
    """Makes the next ``scheduler.step()`` call a no-op (a skipped optimizer step must not move the
    LR schedule), by shadowing the bound method on the instance until released."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.held = False
        self.swallowed = 0

    def hold(self) -> None:
        if self.scheduler is None or self.held or not hasattr(self.scheduler, "step"):
            return

        def _skip(*args: Any, **kwargs: Any) -> None:
            self.swallowed += 1
            self.release()

        self.scheduler.step = _skip
        self.held = True

    def release(self) -> None:
        if self.held:
            try:
                del self.scheduler.step
            except AttributeError:
                pass
            self.held = False


class GradGuardCallback(TrainerCallback, ExportableState):
    """gradguard inside an unmodified ``transformers.Trainer``.

    Args:
        config: a :class:`GuardConfig` (or its dict form); default ``GuardConfig()``.
        sinks: extra :class:`gradguard.Sink` objects (the JSONL log and the console are built in).
        out_dir: folder of the event log (``<out_dir>/gradguard/events.jsonl``); default
            ``config.output.dir``, else the Trainer's ``output_dir``.
        raise_on_halt: after a halt has stopped training and saved a checkpoint, raise
            :class:`GradGuardHalt` from ``trainer.train()`` (False: only stop; see ``.diagnosis``).
        layer_metrics: add per-layer ``gradguard/grad_norm/<layer>`` values to the Trainer's logs.
    """

    def __init__(self, config: GuardConfig | dict[str, Any] | None = None, *, sinks: list[Sink] | None = None,
                 out_dir: str | None = None, raise_on_halt: bool = True, layer_metrics: bool = True) -> None:
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.user_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.raise_on_halt = raise_on_halt
        self.layer_metrics = layer_metrics
        self.core: GuardCore | None = None
        self.reports: list[StepReport] = []  # this train() call's step reports (the last 1000)
        self.diagnosis: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None  # set by the Trainer's callback restore
        self._ordered = False
        self._reset_run()

    def _reset_run(self) -> None:
        self._hook = None
        self._losses: list[torch.Tensor] = []
        self._sum_semantics = False
        self._report: StepReport | None = None
        self._held: _HeldScheduler | None = None
        self._discard_left = 0  # upcoming optimizer steps whose data is skipped (after a rollback)
        self._user_max_grad_norm: float | None = None
        self._replay_clip: float | None = None  # the Trainer's own clipping, re-applied when the guard does not clip
        self._window_losses: list[float] = []
        self._dataloader: Any = None
        self._halted = False

    # -- helpers ---------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        """The max_grad_norm in force (the guard's, or the Trainer's own when the guard does not clip)."""
        if self.core is None:
            return None
        if self.core.config.clip.mode != "off":
            return self.core.clip.max_norm
        return self._replay_clip

    def _move_ahead_of_reporters(self) -> None:
        """User callbacks run after the reporting integrations; metrics added to ``logs`` in
        ``on_log`` would miss them. Move this callback right after ``DefaultFlowCallback``."""
        if self._ordered:
            return
        frame = sys._getframe(2)  # _move_ahead_of_reporters <- on_* <- CallbackHandler.call_event
        handler = frame.f_locals.get("self")
        cbs = getattr(handler, "callbacks", None)
        if not isinstance(cbs, list) or self not in cbs:
            return
        from transformers.trainer_callback import DefaultFlowCallback

        cbs.remove(self)
        pos = next((i + 1 for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)), 0)
        cbs.insert(pos, self)
        self._ordered = True

    def _validate(self, args: Any, optimizer: Any) -> None:
        if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
            ds = args.deepspeed
            clip = None
            if isinstance(ds, dict):
                clip = ds.get("gradient_clipping")
            raise ConfigError(
                f"TrainingArguments.deepspeed={ds!r}: DeepSpeed steps the optimizer and clips inside its engine "
                f"(gradient_clipping={clip!r}), so gradguard can neither measure the pre-clip gradients nor skip a "
                "step safely. Fix: train without DeepSpeed when using GradGuardCallback, or remove the callback")
        if getattr(args, "fsdp", None) and args.fsdp not in ("", [], None):
            raise ConfigError(
                f"TrainingArguments.fsdp={args.fsdp!r}: FSDP shards the gradients, so per-layer norms measured on "
                "one rank are partial. Fix: train with DDP or a single device when using GradGuardCallback")
        optim_name = str(getattr(args, "optim", "")).lower()
        if any(optim_name.endswith(n) or optim_name == n for n in _UNSKIPPABLE_OPTIMS):
            raise ConfigError(
                f"TrainingArguments.optim={args.optim!r}: this optimizer updates the weights during backward, so "
                "a poisoned step cannot be skipped. Fix: use an optimizer with a step() (e.g. optim='adamw_torch')")
        if optimizer is None or not hasattr(optimizer, "param_groups"):
            raise ConfigError(
                f"optimizer={type(optimizer).__name__}: gradguard needs a torch optimizer with param_groups "
                "(to skip a step, apply LR multipliers and change Adam's betas). Fix: use a torch.optim optimizer")
        user = float(args.max_grad_norm) if args.max_grad_norm is not None else 0.0
        default_max = ClipConfig().max_norm
        if (self.config.clip.mode != "off" and 0 < user < math.inf and user != default_max
                and self.config.clip.max_norm != default_max and self.config.clip.max_norm != user):
            raise ConfigError(
                f"TrainingArguments.max_grad_norm={user!r} conflicts with GuardConfig.clip.max_norm="
                f"{self.config.clip.max_norm!r}: gradguard owns clipping and starts from one of them. Fix: set only "
                "one of the two (or make them equal)")
        if (self.config.policy.act and self.config.clip.mode == "off"
                and any("tighten_clip" in r for r in self.config.policy.ladder)):
            raise ConfigError(
                f"GuardConfig.clip.mode={self.config.clip.mode!r} with 'tighten_clip' in GuardConfig.policy.ladder: "
                "the policy could not tighten a clip that is off. Fix: use clip.mode='fixed' or 'adaptive', or "
                "remove 'tighten_clip' from the ladder")

    def _effective_config(self, args: Any) -> GuardConfig:
        """The user's config with ``args.max_grad_norm`` as the starting clip and the run directory."""
        cfg = copy.deepcopy(self.config)
        user = float(args.max_grad_norm) if args.max_grad_norm is not None else 0.0
        if cfg.clip.mode != "off" and 0 < user < math.inf and user != cfg.clip.max_norm:
            cfg.clip = dataclasses.replace(cfg.clip, max_norm=user, floor=min(cfg.clip.floor, user))
        if getattr(args, "process_index", 0) != 0:  # one event log per run: the main process writes it
            cfg.output = dataclasses.replace(cfg.output, jsonl=False, console=False)
        return cfg

    @staticmethod
    def _reduce() -> Any:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        world = torch.distributed.get_world_size()
        if world <= 1:
            return None

        def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(t)
            return t / world

        return mean_over_ranks

    def _forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and isinstance(output, (tuple, list)) and output and kwargs.get("labels") is not None:
            loss = output[0]
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().float().mean())
            self._sum_semantics = kwargs.get("num_items_in_batch") is not None

    def _take_step_loss(self) -> torch.Tensor | None:
        if not self._losses:
            return None
        stacked = torch.stack(self._losses)
        self._losses = []
        # with num_items_in_batch each micro-batch loss is already divided by the whole step's count
        return stacked.sum() if self._sum_semantics else stacked.mean()

    # -- actuators -------------------------------------------------------------------------
    def _shrink_batch(self, action: Action) -> dict[str, Any]:
        dl = self._dataloader
        bs_holder = getattr(dl, "batch_sampler", None)
        if bs_holder is None or type(bs_holder).__name__ == "BatchSamplerShard" or not hasattr(bs_holder, "batch_size"):
            return {"unavailable": f"train_dataloader.batch_sampler={type(bs_holder).__name__} cannot be resized "
                                   "live (multi-process runs wrap it in accelerate's BatchSamplerShard)"}
        old = int(bs_holder.batch_size)
        new = max(1, old // 2)
        bs_holder.batch_size = new
        return {"from": old, "to": new, "note": "takes effect after one batch of look-ahead"}

    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        self._discard_left += n
        return {"mode": "gradients of the next optimizer steps are discarded (forward/backward still run)",
                "optimizer_steps": n}

    # -- Trainer events --------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._move_ahead_of_reporters()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        self._move_ahead_of_reporters()
        if self.core is not None:
            self._teardown()
        self._reset_run()
        self._validate(args, optimizer)
        self.diagnosis = None
        self.reports = []
        cfg = self._effective_config(args)
        user = float(args.max_grad_norm) if args.max_grad_norm is not None else 0.0
        self._user_max_grad_norm = args.max_grad_norm
        if cfg.clip.mode == "off" and 0 < user < math.inf:
            self._replay_clip = user  # the guard does not clip: re-apply the Trainer's clipping after measuring
        scaler = getattr(optimizer, "scaler", None)
        out_dir = self.out_dir or cfg.output.dir or args.output_dir
        self.core = GuardCore(model, unwrap_optimizer(optimizer), config=cfg, sinks=list(self.user_sinks), out_dir=out_dir,
                              scheduler=lr_scheduler, scaler=scaler, reduce=self._reduce())
        self.core.register_actuator("shrink_batch", self._shrink_batch)
        self.core.register_actuator("skip_data", self._skip_data)
        self._scaler = scaler
        self._params = [p for p in model.parameters()]
        self._dataloader = train_dataloader
        self._held = _HeldScheduler(lr_scheduler)
        self._hook = model.register_forward_hook(self._forward_hook, with_kwargs=True)
        args.max_grad_norm = math.inf  # keep unscaling + measuring in the Trainer, never its clipping
        if state.global_step > 0:
            self._restore(args, state)

    def _restore(self, args: Any, state: Any) -> None:
        assert self.core is not None
        saved = self._resume_state
        if saved is None:
            entry = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
            if isinstance(entry, list):
                entry = entry[0] if entry else None
            if isinstance(entry, dict):
                saved = entry.get("attributes", {}).get("_resume_state")
        if saved is None:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as fh:
                    saved = json.load(fh)
        self._resume_state = None
        if not saved or not saved.get("guard"):
            self.core.emit({"type": "resume", "step": state.global_step, "restored": False})
            return
        self.core.load_state_dict(saved["guard"])
        self._discard_left = int(saved.get("discard_left", 0))
        bs = saved.get("batch_size")
        holder = getattr(self._dataloader, "batch_sampler", None)
        if bs and holder is not None and hasattr(holder, "batch_size") and holder.batch_size != bs:
            holder.batch_size = bs
        if self.core.snapshots is not None:  # the resumed weights are the rollback target until the next one
            self.core.take_snapshot(self.core.step_count)
        self.core.emit({"type": "resume", "step": state.global_step, "restored": True,
                         "guard_step": self.core.step_count})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None:
            return
        loss = self._take_step_loss()
        if self._discard_left > 0:  # a data window skipped after a rollback: its gradients never apply
            self._discard_left -= 1
            for p in self._params:
                p.grad = None
            self._held.hold()
            self._report = None
            core.discard_step()
            return
        report = core.before_step(loss=loss, scaler=self._scaler, drop_on_skip=True)
        self._report = report
        if report.applied and self._replay_clip is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self._replay_clip)
        if report.skipped:
            self._held.hold()
        if report.halt:
            self._halted = True
            self.diagnosis = report.diagnosis
            control.should_training_stop = True
            control.should_save = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None:
            return
        if self._held is not None:
            self._held.release()  # only the skipped step's scheduler.step() is swallowed
        report = self._report
        self._report = None
        if report is not None:
            core.after_step(report)
            self.reports.append(report)
            if len(self.reports) > 1000:
                del self.reports[:-1000]
            if report.loss is not None:
                self._window_losses.append(report.loss)
        if self._halted:
            control.should_training_stop = True
            control.should_save = True
            self._write_diagnosis(os.path.join(core.out_dir or args.output_dir, "gradguard"))
        if control.should_save:
            args.max_grad_norm = self._saved_max_grad_norm()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is not None and control.should_save:
            args.max_grad_norm = self._saved_max_grad_norm()

    def _saved_max_grad_norm(self) -> float:
        """What checkpoints record as max_grad_norm: the clip in force (0 when none)."""
        v = self.max_grad_norm
        return 0.0 if v is None else float(v)

    def _write_diagnosis(self, folder: str) -> str | None:
        if self.diagnosis is None:
            return None
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "diagnosis.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(_clean(self.diagnosis), fh, indent=2)
        return path

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is None:
            return
        args.max_grad_norm = math.inf
        if not getattr(args, "should_save", True):
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt):
            with open(os.path.join(ckpt, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self._export(), fh)
            if self.diagnosis is not None:
                self._write_diagnosis(ckpt)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.core is None or logs is None or self.core.last_report is None:
            return
        if "loss" not in logs and "grad_norm" not in logs:
            return  # evaluation and end-of-training summaries
        m = self.core.metrics(self.core.last_report)
        if not self.layer_metrics:
            m = {k: v for k, v in m.items() if k.count("/") < 2 or k.startswith("gradguard/lr/")
                 or k.startswith("gradguard/action/") or k.endswith("/total")}
        window = self._window_losses
        self._window_losses = []
        if window:
            m["gradguard/loss"] = sum(window) / len(window)  # nan/inf stay visible
            m[NONFINITE_LOSS_STEPS] = float(sum(not math.isfinite(v) for v in window))
        logs.update(m)
        hist = getattr(state, "log_history", None)
        if hist and hist[-1].get("step") == state.global_step and "loss" in hist[-1]:
            hist[-1].update(m)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core is None:
            return
        if self._user_max_grad_norm is not None:
            args.max_grad_norm = self._user_max_grad_norm
        self._teardown()
        if self._halted and self.raise_on_halt:
            raise GradGuardHalt(self.diagnosis or {})

    def _teardown(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._held is not None:
            self._held.release()
        if self.core is not None:
            self.summary = self.core.close()
            self.core.lr.remove()

    # -- state -----------------------------------------------------------------------------
    def _export(self) -> dict[str, Any]:
        if self.core is None:
            return {}
        holder = getattr(self._dataloader, "batch_sampler", None)
        return {"guard": self.core.state_dict(), "discard_left": self._discard_left,
                "batch_size": getattr(holder, "batch_size", None)}

    def state(self) -> dict[str, Any]:
        """``ExportableState``: saved into ``trainer_state.json`` with every checkpoint."""
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics},
                "attributes": {"_resume_state": self._export() or None}}
