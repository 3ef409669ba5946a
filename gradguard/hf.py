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
* ``trainer.training_step`` is wrapped for the run (the Trainer is found on the call stack): an
  out-of-memory error retries the same samples in smaller chunks (and later micro-batches stay
  split); a data window skipped after a rollback is not computed; ``shrink_mode="micro"`` splits.
* the train dataloader is the core's batch controller: ``shrink_batch`` / grow-back change its
  batch size live (LR scaled linearly while it is small).
* rollback: the in-memory snapshot ring first, then the run's own ``checkpoint-*`` folders (a
  checkpoint is trusted once the step after it was healthy).
* checkpoints: the guard's state is an ``ExportableState`` entry of ``trainer_state.json`` and a
  ``gradguard_state.json`` file in the checkpoint folder; ``train(resume_from_checkpoint=...)``
  restores it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import sys
from typing import Any

import torch

from .act import drop_grads, unwrap_optimizer
from .config import ClipConfig, GuardConfig
from .data import batch_len, split_batch
from .errors import ConfigError, GradGuardHalt, UnsupportedSetupError
from .guard import GuardCore, StepReport
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


def _find_trainer() -> Any:
    """The ``Trainer`` whose callback handler is calling us (callbacks are not given it)."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover
        return None
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """The model weights of a Trainer checkpoint folder (safetensors or .bin, sharded or not)."""
    single = [("model.safetensors", "st"), ("pytorch_model.bin", "bin")]
    for name, kind in single:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return _read_one(f, kind)
    for index, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
        f = os.path.join(path, index)
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for shard in files:
                out.update(_read_one(os.path.join(path, shard), kind))
            return out
    raise FileNotFoundError("no model.safetensors / pytorch_model.bin (adapter-only checkpoints are not restorable)")


def _read_one(f: str, kind: str) -> dict[str, torch.Tensor]:
    if kind == "st":
        from safetensors.torch import load_file

        return load_file(f, device="cpu")
    return torch.load(f, map_location="cpu", weights_only=True)


def _all_ranks(ok: bool) -> bool:
    """True when ``ok`` holds on every process (one all-reduce under torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class _LoaderBatches:
    """The Trainer's train dataloader as a gradguard batch controller (``GuardCore.attach_batches``).

    Global size = loader batch x gradient accumulation steps (per device). ``shrink_global`` /
    ``grow_global`` change the loader's batch size live (the batch sampler re-reads it between
    batches; accelerate's ``BatchSamplerShard`` of a multi-process run is updated with its inner
    sampler); ``shrink_micro`` splits every micro-batch into more chunks inside ``training_step``
    (global batch and samples unchanged)."""

    def __init__(self, cb: GradGuardCallback, dataloader: Any, accumulation: int) -> None:
        self.cb = cb
        self.dl = dataloader
        self.accumulation = max(1, int(accumulation))
        self.base_loader_batch = self.loader_batch or 1

    def _holders(self) -> list[Any]:
        bs = getattr(self.dl, "batch_sampler", None)
        holders = []
        if bs is not None and hasattr(bs, "batch_size"):
            holders.append(bs)
            inner = getattr(bs, "batch_sampler", None)
            if inner is not None and hasattr(inner, "batch_size"):
                holders.append(inner)
        return holders

    @property
    def resizable(self) -> bool:
        return bool(self._holders())

    @property
    def loader_batch(self) -> int:
        h = self._holders()
        return int(h[-1].batch_size) if h else 0

    def set_loader_batch(self, size: int) -> None:
        for h in self._holders():
            h.batch_size = size

    @property
    def batch_size(self) -> int:
        return self.loader_batch * self.accumulation

    @property
    def base_batch_size(self) -> int:
        return self.base_loader_batch * self.accumulation

    @property
    def accumulation_steps(self) -> int:
        return self.accumulation * self.cb._splits

    def shrink_global(self) -> tuple[int, int] | None:
        old = self.loader_batch
        if not self.resizable or old <= 1:
            return None
        self.set_loader_batch(old // 2)
        self.cb._splits = max(1, min(self.cb._splits, old // 2))
        return old * self.accumulation, self.batch_size

    def grow_global(self) -> tuple[int, int] | None:
        old = self.loader_batch
        if not self.resizable or old >= self.base_loader_batch:
            return None
        self.set_loader_batch(min(self.base_loader_batch, old * 2))
        return old * self.accumulation, self.batch_size

    def shrink_micro(self) -> tuple[int, int] | None:
        if self.cb._orig_training_step is None:
            return None  # training_step is not wrapped (the Trainer was not found): no chunking
        size = self.loader_batch or self.cb._last_micro
        old = -(-size // self.cb._splits) if size else 0
        if old <= 1:
            return None
        self.cb._splits *= 2
        return old, -(-size // self.cb._splits)


class _CheckpointTier:
    """The Trainer's own ``checkpoint-*`` folders as the rollback disk tier. A checkpoint becomes
    restorable once the step right after it was healthy (like an in-memory snapshot); one followed
    by an unstable step is never used."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []  # {"step", "tested", "bad"}

    def saved(self, step: int) -> None:
        self.entries = [e for e in self.entries if e["step"] != step]
        self.entries.append({"step": step, "tested": False, "bad": False})

    def observe(self, step: int, healthy: bool) -> None:
        for e in self.entries:
            if e["tested"] or e["bad"] or step <= e["step"]:
                continue
            e["tested"] = healthy
            e["bad"] = not healthy

    def candidates(self) -> list[int]:
        return sorted((e["step"] for e in self.entries if e["tested"] and not e["bad"]), reverse=True)

    def forget(self, step: int) -> None:
        self.entries = [e for e in self.entries if e["step"] != step]

    def state_dict(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.entries = [dict(e) for e in (state or [])]


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
        self._trainer: Any = None
        self._args: Any = None
        self._orig_training_step: Any = None
        self._had_instance_step = False
        self._splits = 1  # every micro-batch runs as this many chunks (after an out-of-memory error)
        self._micro_in_step = 0
        self._last_micro = 0
        self._poisoned = False  # an out-of-memory error left this step's gradients half-accumulated
        self._last_step_loss: float | None = None
        self._batches: _LoaderBatches | None = None
        self._ckpts = _CheckpointTier()

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
            raise UnsupportedSetupError(
                f"TrainingArguments.deepspeed={ds!r}: DeepSpeed steps the optimizer and clips inside its engine "
                f"(gradient_clipping={clip!r}), so gradguard can neither measure the pre-clip gradients nor skip a "
                "step safely. Fix: train without DeepSpeed when using GradGuardCallback, or remove the callback")
        if getattr(args, "fsdp", None) and args.fsdp not in ("", [], None):
            raise UnsupportedSetupError(
                f"TrainingArguments.fsdp={args.fsdp!r}: FSDP shards the gradients, so per-layer norms measured on "
                "one rank are partial. Fix: train with DDP or a single device when using GradGuardCallback")
        optim_name = str(getattr(args, "optim", "")).lower()
        if any(optim_name.endswith(n) or optim_name == n for n in _UNSKIPPABLE_OPTIMS):
            raise UnsupportedSetupError(
                f"TrainingArguments.optim={args.optim!r}: this optimizer updates the weights during backward, so "
                "a poisoned step cannot be skipped. Fix: use an optimizer with a step() (e.g. optim='adamw_torch')")
        if optimizer is None or not hasattr(optimizer, "param_groups"):
            raise UnsupportedSetupError(
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
        if not self._sum_semantics:
            return stacked.mean()
        # with num_items_in_batch each micro-batch loss is already divided by the whole step's count;
        # with average_tokens_across_devices that count spans every process (the Trainer multiplies
        # the loss by the process count afterwards; the mean over ranks then gives the true loss)
        loss = stacked.sum()
        args = self._args
        world = int(getattr(args, "world_size", 1) or 1)
        if world > 1 and getattr(args, "average_tokens_across_devices", False):
            loss = loss * world
        return loss

    # -- actuators -------------------------------------------------------------------------
    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        self._discard_left += n
        return {"mode": "the batches of the next optimizer steps are drawn but not computed (no forward/backward)",
                "optimizer_steps": n}

    def _rollback_to_checkpoint(self, action: Action) -> dict[str, Any] | None:
        """Disk tier: restore the newest healthy ``checkpoint-*`` of this run. Every process reads
        the same folder; it is used only if all of them could read it (one all-reduce, at a rollback
        only: the decision to roll back is the same on every rank)."""
        assert self.core is not None
        for step in self._ckpts.candidates():
            path = os.path.join(self._args.output_dir, f"checkpoint-{step}")
            problem = None
            try:
                loaded = self._read_checkpoint(path)
            except Exception as exc:  # unreadable or deleted (save_total_limit)
                loaded, problem = None, f"{path}: {type(exc).__name__}: {exc}"[:300]
            if not _all_ranks(loaded is not None):
                self._ckpts.forget(step)  # try the next older one
                self.core.emit({"type": "snapshot_fallback", "step": action.step, "wanted": step,
                                 "problems": [problem or f"{path}: unreadable on another process"]})
                continue
            self._apply_checkpoint(loaded)
            return {"to_step": step, "path": path, "source": "checkpoint"}
        return None

    def _read_checkpoint(self, path: str) -> dict[str, Any]:
        """Read and check everything a Trainer checkpoint holds for a rollback; changes nothing."""
        core = self.core
        assert core is not None
        if not os.path.isdir(path):
            raise FileNotFoundError("folder is gone")
        weights = _read_weights(path)
        own = core.model.state_dict()
        unexpected = [k for k in weights if k not in own]
        if unexpected or not weights:
            raise ValueError(f"weights do not match the model (unexpected keys {unexpected[:3]})")
        for k, v in weights.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"weight {k} has shape {tuple(v.shape)}, the model {tuple(own[k].shape)}")
        out: dict[str, Any] = {"weights": weights, "scaler": None, "scheduler": None, "guard": None,
                               "optimizer": torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu",
                                                       weights_only=True)}
        if self._scaler is not None and os.path.isfile(os.path.join(path, "scaler.pt")):
            out["scaler"] = torch.load(os.path.join(path, "scaler.pt"), map_location="cpu", weights_only=True)
        sched = self._held.scheduler if self._held is not None else None
        if (core.config.recovery.restore_schedule and sched is not None
                and os.path.isfile(os.path.join(path, "scheduler.pt"))):
            out["scheduler"] = torch.load(os.path.join(path, "scheduler.pt"), map_location="cpu", weights_only=True)
        if os.path.isfile(os.path.join(path, STATE_FILE)):
            with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
                out["guard"] = (json.load(fh) or {}).get("guard")
        return out

    def _apply_checkpoint(self, loaded: dict[str, Any]) -> None:
        core = self.core
        assert core is not None
        own = core.model.state_dict()
        weights, opt_state, scaler_state = loaded["weights"], loaded["optimizer"], loaded["scaler"]
        sched_state, guard_state = loaded["scheduler"], loaded["guard"]
        restore_schedule = core.config.recovery.restore_schedule
        sched = self._held.scheduler if self._held is not None else None
        with torch.no_grad():
            for k, v in weights.items():
                own[k].copy_(v)
        opt = core.optimizer
        current = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(opt_state)
        for g, kept in zip(opt.param_groups, current):
            # the guard's own moves (beta2/eps) and, by default, the schedule's position are kept
            if restore_schedule:
                kept = {k: v for k, v in kept.items() if k not in ("lr", "initial_lr")}
            g.update(kept)
        if scaler_state is not None:
            self._scaler.load_state_dict(scaler_state)
        if sched_state is not None:
            sched.load_state_dict(sched_state)
        if guard_state and guard_state.get("detectors"):
            core.detectors.load_state_dict(guard_state["detectors"])

    # -- training_step wrapper (out-of-memory retry, data-window skip without compute) -------------
    def _wrap_training_step(self, trainer: Any) -> None:
        self._had_instance_step = "training_step" in vars(trainer)
        orig = trainer.training_step
        self._orig_training_step = orig

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None, *args: Any, **kwargs: Any) -> Any:
            return self._guarded_training_step(orig, model, inputs, num_items_in_batch, *args, **kwargs)

        trainer.training_step = training_step

    def _unwrap_training_step(self) -> None:
        trainer, orig = self._trainer, self._orig_training_step
        if trainer is None or orig is None:
            return
        if self._had_instance_step:
            trainer.training_step = orig
        elif "training_step" in vars(trainer):
            del trainer.training_step
        self._orig_training_step = None

    def _placeholder_loss(self) -> torch.Tensor:
        """What a not-computed micro-batch reports to the Trainer's loss log: the last healthy
        step's loss, spread over the step's micro-batches (so the logged loss stays truthful)."""
        tr = self._trainer
        g = getattr(tr, "current_gradient_accumulation_steps", None) or tr.args.gradient_accumulation_steps
        v = self._last_step_loss if self._last_step_loss is not None else 0.0
        return torch.tensor(v / max(1, g), device=tr.args.device)

    def _guarded_training_step(self, orig: Any, model: Any, inputs: Any, num_items_in_batch: Any,
                               *args: Any, **kwargs: Any) -> Any:
        core = self.core
        if core is None:
            return orig(model, inputs, num_items_in_batch, *args, **kwargs)
        if self._discard_left > 0 or self._poisoned:
            return self._placeholder_loss()  # this step's data is skipped: no forward, no backward
        first = self._micro_in_step == 0
        self._micro_in_step += 1
        size = batch_len(inputs)
        self._last_micro = size or self._last_micro
        while True:
            start = len(self._losses)
            try:
                return self._run_chunks(orig, model, inputs, num_items_in_batch, *args, **kwargs)
            except torch.OutOfMemoryError as exc:
                touched = len(self._losses) > start  # a forward finished: backward may have touched grads
                del self._losses[start:]
                old = -(-size // self._splits) if size else 0
                if old <= 1 or getattr(self._args, "world_size", 1) > 1:
                    raise  # nothing left to split; or several processes, which must stay in lockstep
                message = f"{type(exc).__name__}: {exc}"[:160]
            # outside the except block, so the failed attempt's tensors can be freed
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._splits *= 2
            params: dict[str, Any] = {"micro_batch": [old, -(-size // self._splits)], "splits": self._splits}
            step = core.step_count + 1
            if touched and not first:
                # earlier micro-batches' gradients are mixed with a half-finished backward
                drop_grads(self._params)
                self._poisoned = True
                core.record(Action("oom_shrink_micro", step, f"out of memory during backward ({message}): the "
                                   "step's gradients are dropped and the step skipped", {**params, "step_skipped": True}))
                return self._placeholder_loss()
            if touched:
                drop_grads(self._params)  # first micro-batch of the step: nothing else is lost
            core.record(Action("oom_shrink_micro", step, f"out of memory ({message}): the same samples are "
                               "retried in smaller chunks", {**params, "retried": True}))

    def _run_chunks(self, orig: Any, model: Any, inputs: Any, num_items_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
        tr = self._trainer
        attr = "current_gradient_accumulation_steps"
        n = batch_len(inputs)
        chunks = split_batch(inputs, n, self._splits) if n and self._splits > 1 and hasattr(tr, attr) else []
        if len(chunks) <= 1:
            return orig(model, inputs, num_items_in_batch, *args, **kwargs)
        total = sum(n for _, n in chunks)
        g = getattr(tr, attr)
        start = len(self._losses)
        out = None
        try:
            for chunk, n in chunks:
                # mean-loss semantics: each chunk weighs n / total of the micro-batch (the Trainer
                # divides by this attribute); with num_items_in_batch the loss is already exact
                setattr(tr, attr, g * total / n)
                r = orig(model, chunk, num_items_in_batch, *args, **kwargs)
                out = r if out is None else out + r
        finally:
            setattr(tr, attr, g)
        vals = self._losses[start:]
        if len(vals) == len(chunks):
            if self._sum_semantics:
                self._losses[start:] = [torch.stack(vals).sum()]
            else:
                self._losses[start:] = [sum(v * (n / total) for v, (_, n) in zip(vals, chunks))]
        return out

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
        self.core.register_actuator("skip_data", self._skip_data)
        self.core.add_rollback_source(self._rollback_to_checkpoint)
        self._scaler = scaler
        self._args = args
        self._params = [p for p in model.parameters()]
        self._dataloader = train_dataloader
        self._batches = _LoaderBatches(self, train_dataloader, args.gradient_accumulation_steps)
        self.core.attach_batches(self._batches)
        self._trainer = _find_trainer()
        if self._trainer is not None and cfg.policy.act:  # monitor mode changes nothing, OOM handling included
            self._wrap_training_step(self._trainer)
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
        self._splits = int(saved.get("splits", 1))
        self._last_step_loss = saved.get("last_step_loss")
        self._ckpts.load_state_dict(saved.get("checkpoints"))
        bs = saved.get("batch_size")
        if self._batches is not None and self._batches.resizable:
            self._batches.base_loader_batch = int(saved.get("base_batch_size") or self._batches.base_loader_batch)
            if bs and self._batches.loader_batch != bs:
                self._batches.set_loader_batch(int(bs))
        if self.core.snapshots is not None:  # the resumed weights are the rollback target until the next one
            self.core.take_snapshot(self.core.step_count)
        self.core.emit({"type": "resume", "step": state.global_step, "restored": True,
                         "guard_step": self.core.step_count})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None:
            return
        loss = self._take_step_loss()
        self._micro_in_step = 0
        if self._discard_left > 0 or self._poisoned:
            # a data window skipped after a rollback, or a step broken by an out-of-memory error
            if self._poisoned:
                self._poisoned = False
            else:
                self._discard_left -= 1
            drop_grads(self._params)
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

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro_in_step = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        core = self.core
        if core is None:
            return
        if self._held is not None:
            self._held.release()  # only the skipped step's scheduler.step() is swallowed
        report = self._report
        self._report = None
        if report is not None:
            keep = core.scale_to_keep(report)
            if keep is not None and getattr(self._scaler, "_scale", None) is not None:
                self._scaler._scale.fill_(keep)  # the Trainer's scaler.update() halved it once more
            self._ckpts.observe(state.global_step, report.healthy)
            if report.applied and report.loss is not None and math.isfinite(report.loss):
                self._last_step_loss = report.loss
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
        self._ckpts.saved(state.global_step)  # on every process: rollback decisions must match
        if not getattr(args, "should_save", True):
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt):
            tmp = os.path.join(ckpt, STATE_FILE + ".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self._export(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, os.path.join(ckpt, STATE_FILE))  # never a half-written state file
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
        else:
            m.pop("gradguard/loss", None)  # no step of this logging window was computed (a skipped data window)
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
        self._unwrap_training_step()
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
        b = self._batches
        return {"guard": self.core.state_dict(), "discard_left": self._discard_left,
                "batch_size": b.loader_batch if b is not None and b.resizable else None,
                "base_batch_size": b.base_loader_batch if b is not None else None,
                "splits": self._splits, "last_step_loss": self._last_step_loss,
                "checkpoints": self._ckpts.state_dict()}

    def state(self) -> dict[str, Any]:
        """``ExportableState``: saved into ``trainer_state.json`` with every checkpoint."""
        return {"args": {"config": self.config.to_dict(), "raise_on_halt": self.raise_on_halt,
                         "layer_metrics": self.layer_metrics},
                "attributes": {"_resume_state": self._export() or None}}
