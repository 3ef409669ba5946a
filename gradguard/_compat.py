"""Every access to a private attribute of torch, transformers or Lightning, in one place.

Each function is named for what it does and feature-detects what it touches. Adapters call
:func:`check_features` once at attach time: a private piece missing in the installed version
disables the action that depends on it, with one warning naming the version and the action; nothing
here raises mid-run.

Supported versions, each end tested (CI runs the latest releases; the README's Development section
has the command that runs the contract suite against the oldest): torch >= 2.13 (the only version
testable here), transformers >= 4.57, lightning >= 2.4, deepspeed 0.19 (its ZeRO 1/2 optimizer's fp32
partitions and ``clip_grad``: :func:`ds_zero_optimizer` refuses a version without them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import warn_once

__all__ = [
    "scaler_scale", "scaler_found_inf", "set_scaler_scale", "scaler_unscaled", "scalers_in_use",
    "shadow_method", "unshadow_method",
    "find_caller", "hf_trainer", "hf_restore_into_own_instances", "pl_combined_loader", "pl_loader_iterator", "pl_iterator_drawn",
    "pl_restart_sampler_iter", "pl_data_fetcher", "pl_set_epoch_length", "pl_checkpoint_last_saved",
    "pl_saving_checkpoint_path", "pl_callbacks_being_validated",
    "swap_class", "check_features", "versions", "has_foreach_support", "device_dtype_groups", "HF_NORM_METHOD", "hf_norm_pass_plain",
    "pl_log_step", "pl_should_update_logs",
    "swap_class", "check_features", "versions", "dtensor_type", "fsdp1_units", "fsdp1_uses_orig_params",
    "fsdp1_shard_size", "fsdp1_full_shapes", "fsdp1_flat_pieces", "FlatPiece", "is_flat_param", "local_optimizer", "sync_local_param_groups", "placement_shards", "ddp_wrapper", "ddp_broadcast_buffers_at_next_forward",
    "is_deepspeed_engine", "ds_stage", "ds_zero_optimizer", "ds_global_norm", "ds_overflow", "ds_loss_scale",
    "ds_scaler_state", "ds_load_scaler_state", "ds_master_partitions", "ds_clip", "ds_set_clip",
    "ds_partition_grads", "ds_pre_step_readable", "ds_forced_overflow", "ds_set_reported_norm",
]

_MISSING = object()


def versions() -> dict[str, str]:
    """Installed versions of the packages gradguard reaches into."""
    out = {"torch": torch.__version__}
    for name in ("transformers", "lightning", "pytorch_lightning", "accelerate", "deepspeed"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


# -- torch: GradScaler ---------------------------------------------------------------------------
def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The live scale tensor of an enabled GradScaler (``_scale``), without a host sync."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def scaler_found_inf(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """The found-inf tensor of ``optimizer`` after ``unscale_`` (``_per_optimizer_states``), no sync."""
    if scaler_scale(scaler) is None:
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    st = states.get(id(optimizer)) if isinstance(states, dict) else None
    per_device = st.get("found_inf_per_device") if isinstance(st, dict) else None
    if not per_device:
        return None
    vals = list(per_device.values())
    return vals[0] if len(vals) == 1 else torch.stack([v.to(vals[0].device) for v in vals]).sum()


def scaler_unscaled(scaler: Any, optimizer: Any) -> bool:
    """True when ``scaler.unscale_(optimizer)`` ran this step (its per-optimizer stage)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    st = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = st.get("stage") if isinstance(st, dict) else None
    return getattr(stage, "name", None) == "UNSCALED"


def scalers_in_use() -> list[Any]:
    """Every enabled ``torch.amp.GradScaler`` of the process that has scaled a loss (one walk over
    the garbage collector's objects: call it once, not per step).

    Only for the plain loop's misuse check (``scaler_not_passed``), once per run and only when one
    of the first steps has a non-finite or huge norm: the user did not pass the scaler, and torch
    2.13.0 keeps no registry of GradScalers and gives the loss no link to the scaler that scaled
    it, so there is no public way to name it."""
    import gc

    cls = getattr(torch.amp, "GradScaler", None)
    if cls is None:  # pragma: no cover - torch < 2.3
        return []
    # type(o), not isinstance: isinstance reads __class__, which some module proxies warn about
    return [o for o in gc.get_objects() if issubclass(type(o), cls) and scaler_scale(o) is not None]


def set_scaler_scale(scaler: Any, value: float) -> bool:
    """Put ``value`` back as the scaler's scale (after its update halved it). False when impossible."""
    scale = scaler_scale(scaler)
    if scale is None:
        return False
    scale.fill_(value)
    return True


# -- torch: foreach kernels ----------------------------------------------------------------------
def has_foreach_support(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether ``clip_grad_norm_`` would use the fused ``_foreach`` kernels for these tensors
    (``torch.utils._foreach_utils._has_foreach_support``); plain CPU/CUDA tensors when unknown."""
    try:
        from torch.utils._foreach_utils import _has_foreach_support
    except ImportError:  # pragma: no cover - older or newer torch
        return device.type in ("cpu", "cuda") and all(type(t) is torch.Tensor for t in tensors)
    return bool(_has_foreach_support(tensors, device))


def device_dtype_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype) in the order ``clip_grad_norm_`` groups and
    concatenates them (``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``; its
    group order is not first appearance); first appearance when that is unavailable."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
        return [list(idx) for _, idx in _group_tensors_by_device_and_dtype([tensors], with_indices=True).values()]
    except Exception:  # noqa: BLE001 - pragma: no cover - older or newer torch
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(i)
        return list(groups.values())


# -- transformers: the Trainer's norm pass ---------------------------------------------------------
#: The Trainer method that unscales, measures and clips the gradients before ``optimizer.step()``
#: (transformers >= 4.57); the HF adapter takes it over for the run.
HF_NORM_METHOD = "_clip_grad_norm"

_PLAIN_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA",
                      "MULTI_MUSA", "MULTI_HPU")


def hf_norm_pass_plain(trainer: Any, model: Any) -> bool:
    """Whether the Trainer's norm pass is a plain ``clip_grad_norm_`` over ``model.parameters()``
    after unscaling (no DeepSpeed, FSDP, XLA, SageMaker model parallelism or DTensor gradients), so
    gradguard can take it over; otherwise the Trainer's own pass runs. Static for a run: checked
    once, on its first step."""
    acc = getattr(trainer, "accelerator", None)
    dist = getattr(getattr(acc, "distributed_type", None), "name", None)
    if dist not in _PLAIN_DISTRIBUTED or not hasattr(acc, "unscale_gradients"):
        return False
    try:
        from transformers.trainer import is_sagemaker_mp_enabled
        sagemaker = bool(is_sagemaker_mp_enabled())
    except ImportError:
        sagemaker = False
    return not sagemaker and all(type(p.grad) is torch.Tensor for p in model.parameters() if p.grad is not None)


# -- instance-level method shadowing (schedulers, strategy.backward, training_step) ---------------
def shadow_method(obj: Any, name: str, fn: Callable[..., Any]) -> Any:
    """Set ``fn`` as an instance attribute over ``obj.name``; returns what to pass to
    :func:`unshadow_method` (the previous instance attribute, or a marker)."""
    previous = vars(obj).get(name, _MISSING)
    object.__setattr__(obj, name, fn)
    return previous


def unshadow_method(obj: Any, name: str, fn: Callable[..., Any], previous: Any) -> bool:
    """Undo :func:`shadow_method` if ``fn`` is still in place (someone else's later wrapper is left)."""
    if vars(obj).get(name) is not fn:
        return False
    if previous is _MISSING:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, previous)
    return True


def swap_class(obj: Any, cls: type) -> None:
    """Give ``obj`` the subclass ``cls`` of its class (same layout; e.g. a re-reading BatchSampler)."""
    obj.__class__ = cls


# -- call stack: the one object an engine does not pass to its callbacks ---------------------------
def find_caller(cls: type, *, start: int = 2, depth: int = 12) -> Any:
    """The nearest ``self`` on the call stack that is an instance of ``cls`` (``sys._getframe``)."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:  # pragma: no cover - other Python implementations
        return None
    try:
        frame = getframe(start)
    except ValueError:
        return None
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, cls):
            return obj
        frame = frame.f_back
    return None


def hf_trainer() -> Any:
    """The ``transformers.Trainer`` whose event (or ``TrainerState`` construction) is running, None
    outside a Trainer.

    transformers 5.24.0 hands a callback ``args``, ``state``, ``control`` and the model, optimizer,
    scheduler and dataloaders (``CallbackHandler.call_event``), never the Trainer or its callback
    list; the adapter needs the Trainer once per run (its ``training_step`` and norm pass, the
    DeepSpeed engine, the FSDP/DeepSpeed flags, ``callback_handler.callbacks``), so it is found on
    the call stack: the only call-stack inspection of the HF adapter."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover
        return None
    return find_caller(Trainer, start=2, depth=16)


_RESTORE_MARK = "_gradguard_restores"


def hf_restore_into_own_instances(trainer: Any, cls: type) -> None:
    """``TrainingArguments(restore_callback_states_from_checkpoint=True)``: the Trainer's
    ``_load_callback_state`` rebuilds every stateful callback from the arguments saved in
    ``trainer_state.json`` (``type(cb)(**args)``), sets the saved attributes on the new instance and
    swaps it for the one the user passed, dropping that instance's sinks, ``out_dir`` and config.
    transformers 5.24.0 has no public way to restore into the existing instance, so
    ``_load_callback_state`` is shadowed on this Trainer instance: the entries of ``cls`` (by class
    name, as the Trainer matches them) have their saved attributes set on the user's own instances,
    in list order; the Trainer restores every other callback as before. Idempotent."""
    orig = getattr(trainer, "_load_callback_state", None)
    name = cls.__name__
    if orig is None or name in getattr(orig, _RESTORE_MARK, ()):
        return

    def load_callback_state() -> None:
        entries = getattr(getattr(trainer, "state", None), "stateful_callbacks", None)
        restore = bool(getattr(trainer.args, "restore_callback_states_from_checkpoint", False))
        mine = entries.pop(name, None) if restore and isinstance(entries, dict) else None
        try:
            orig()
        finally:
            if mine is not None:
                entries[name] = mine
        if mine is None:
            return
        own = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == name]
        for callback, data in zip(own, mine if isinstance(mine, list) else [mine]):
            for attribute, value in (data.get("attributes") or {}).items():
                setattr(callback, attribute, value)

    setattr(load_callback_state, _RESTORE_MARK, (*getattr(orig, _RESTORE_MARK, ()), name))
    shadow_method(trainer, "_load_callback_state", load_callback_state)


# -- Lightning: the fit loop's data plumbing -------------------------------------------------------
def pl_combined_loader(trainer: Any) -> Any:
    """``trainer.fit_loop._combined_loader`` (None when absent)."""
    return getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)


def pl_loader_iterator(trainer: Any) -> Any:
    """The train DataLoader's live iterator inside the combined loader (``_iterator.iterators[0]``)."""
    mode_iter = getattr(pl_combined_loader(trainer), "_iterator", None)
    its = getattr(mode_iter, "iterators", None)
    return its[0] if its else None


def pl_iterator_drawn(it: Any) -> int | None:
    """Batches the DataLoader iterator has drawn from its sampler (``_send_idx`` of a multi-worker
    iterator, which draws ahead; ``_num_yielded`` otherwise), or None."""
    if it is None:
        return None
    if hasattr(it, "_send_idx"):
        return int(it._send_idx)
    if hasattr(it, "_num_yielded"):
        return int(it._num_yielded)
    return None


def pl_restart_sampler_iter(it: Any) -> bool:
    """Restart a single-process iterator's sampler iterator if nothing was drawn yet (so a resized
    batch sampler applies from the first batch). False when it cannot."""
    if (it is None or hasattr(it, "_send_idx") or not hasattr(it, "_num_yielded") or it._num_yielded != 0
            or not hasattr(it, "_index_sampler") or not hasattr(it, "_sampler_iter")):
        return False
    it._sampler_iter = iter(it._index_sampler)
    return True


def pl_data_fetcher(trainer: Any) -> Any:
    """``trainer.fit_loop._data_fetcher`` (None when absent)."""
    return getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)


def pl_set_epoch_length(trainer: Any, total: int) -> None:
    """Make the fit loop's cached epoch length ``total`` batches (combined loader limits, max_batches,
    the data fetcher's length, a fractional val_check_batch)."""
    fl = trainer.fit_loop
    loader = pl_combined_loader(trainer)
    if loader is not None and hasattr(loader, "limits"):
        loader.limits = [total]
    if fl.max_batches != float("inf"):
        fl.max_batches = total
    fetcher = pl_data_fetcher(trainer)
    if fetcher is not None and getattr(fetcher, "length", None) is not None:
        fetcher.length = total
        fetcher.done = fetcher.fetched >= total
    vci = trainer.val_check_interval
    if (isinstance(vci, float) and getattr(trainer, "_val_check_time_interval", None) is None
            and trainer.val_check_batch not in (None, float("inf"))):
        trainer.val_check_batch = max(1, int(total * vci))


def pl_checkpoint_last_saved(cb: Any) -> tuple[int | None, list[str]]:
    """(step, paths) of the last save of a ``ModelCheckpoint`` (``_last_global_step_saved``,
    ``_last_checkpoint_saved``, ``best_k_models``)."""
    step = getattr(cb, "_last_global_step_saved", None)
    paths = [getattr(cb, "_last_checkpoint_saved", "") or getattr(cb, "last_model_path", "")]
    paths += list(getattr(cb, "best_k_models", None) or {})
    return (None if step is None else int(step)), [str(p) for p in paths if p]


def pl_callbacks_being_validated() -> list[Any] | None:
    """While Lightning checks ``Trainer(callbacks=...)`` for duplicate state keys
    (``_validate_callbacks_list``, which reads each stateful callback's ``state_key``): the callback
    list it checks, so gradguard's clearer error for two guards under one name comes first. None
    otherwise. Call it from the ``state_key`` property only (it reads the frame that reads the key).

    lightning 2.6.6 runs that check inside ``Trainer.__init__`` before any callback hook and passes the
    list to no callback, so the caller's frame is the only way to see it (``sys._getframe``); callbacks
    added after the Trainer's init are checked again in the ``setup`` hook."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:  # pragma: no cover - other Python implementations
        return None
    try:
        caller = getframe(2)  # 0: here, 1: state_key, 2: whoever reads the key
    except ValueError:  # pragma: no cover
        return None
    if caller.f_code.co_name != "_validate_callbacks_list":
        return None
    callbacks = caller.f_locals.get("callbacks")
    return callbacks if isinstance(callbacks, list) else None


def pl_saving_checkpoint_path(trainer: Any, depth: int = 16) -> str | None:
    """While ``trainer.save_checkpoint(filepath)`` runs (callbacks' ``on_save_checkpoint``): the
    file being written (the ``filepath`` argument of that frame). None when not found.

    lightning 2.6.6 passes ``on_save_checkpoint`` the checkpoint dict but not the path it goes to
    (``ModelCheckpoint`` records it only after the write), so the frame of ``save_checkpoint`` is
    the only way to let a checkpoint list itself in the guard state it carries; when not found, the
    path is taken from ``ModelCheckpoint``'s record at the next batch."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:  # pragma: no cover - other Python implementations
        return None
    frame = getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "save_checkpoint" and frame.f_locals.get("self") is trainer:
            path = frame.f_locals.get("filepath")
            return str(path) if path else None
        frame = frame.f_back
    return None


# -- feature detection at attach time --------------------------------------------------------------
def _has_scaler_internals() -> bool:
    try:
        s = torch.amp.GradScaler("cpu", enabled=True)
    except Exception:  # pragma: no cover
        return True  # no CPU scaler to probe: assume (the reads are guarded anyway)
    return hasattr(s, "_per_optimizer_states") and hasattr(s, "_scale")


def _pl_fit_loop_ok(trainer: Any) -> bool:
    fl = getattr(trainer, "fit_loop", None)
    return fl is not None and hasattr(fl, "_combined_loader") and hasattr(fl, "_data_fetcher") and hasattr(fl, "max_batches")


def _pl_checkpoint_ok(trainer: Any) -> bool:
    cbs = getattr(trainer, "checkpoint_callbacks", None) or []
    return all(hasattr(cb, "_last_global_step_saved") for cb in cbs)


def check_features(engine: str, trainer: Any = None) -> dict[str, str]:
    """Private pieces the adapter of ``engine`` ('plain', 'hf', 'lightning') needs that are missing
    in the installed versions: ``{action: why}``. Each is warned about once (rank 0), naming the
    version and the action that is disabled."""
    missing: dict[str, str] = {}
    if not _has_scaler_internals():
        missing["scale_freeze"] = "torch.amp.GradScaler has no _scale/_per_optimizer_states"
    if engine == "hf" and getattr(sys, "_getframe", None) is None:  # pragma: no cover
        missing["training_step_wrapper"] = "sys._getframe is unavailable (the Trainer cannot be found)"
    if engine == "lightning" and trainer is not None:
        if not _pl_fit_loop_ok(trainer):
            missing["batch_resize"] = "Lightning's fit_loop has no _combined_loader/_data_fetcher/max_batches"
        if not _pl_checkpoint_ok(trainer):
            missing["checkpoint_rollback"] = "ModelCheckpoint has no _last_global_step_saved"
    v = versions()
    for action, why in missing.items():
        warn_once(f"compat:{engine}:{action}",
                  f"gradguard: {why} ({', '.join(f'{k} {x}' for k, x in v.items())}): '{action}' is disabled "
                  "for this run. Fix: install a supported version (see the README's version table)")
    return missing


# -- wandb-workspaces: the view a Workspace saves, as JSON, and back (no server involved) --------------
def wandb_view_dump(workspace: Any) -> dict[str, Any]:
    """The view spec ``Workspace.save()`` uploads (``Workspace._to_model()``), as JSON data."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def wandb_workspace_load(view: dict[str, Any]) -> Any:
    """A ``Workspace`` rebuilt from a view spec (``internal.View`` + ``Workspace._from_model``)."""
    from wandb_workspaces.workspaces import Workspace, internal

    return Workspace._from_model(internal.View.model_validate(view))


# -- Lightning: the logging cadence ---------------------------------------------------------------
def pl_log_step(trainer: Any) -> int:
    """The step Lightning logs the current batch's ``self.log`` values at (``_batches_that_stepped``:
    the optimizer steps before this batch's; it moves after ``on_train_batch_end``)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if value is not None else max(0, int(trainer.global_step) - 1)


def pl_should_update_logs(trainer: Any) -> bool:
    """Whether Lightning sends this batch's step metrics to its loggers (``log_every_n_steps``,
    ``_logger_connector.should_update_logs``)."""
    connector = getattr(trainer, "_logger_connector", None)
    value = getattr(connector, "should_update_logs", None)
    if value is None:
        every = int(getattr(trainer, "log_every_n_steps", 50) or 0)
        return bool(every) and (pl_log_step(trainer) + 1) % every == 0
    return bool(value)


# -- torch.distributed: DDP ------------------------------------------------------------------------
def ddp_wrapper(model: Any) -> Any | None:
    """``model`` when it is a ``DistributedDataParallel`` wrapper (it has ``no_sync``), else None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # pragma: no cover - torch built without distributed
        return None
    return model if isinstance(model, DistributedDataParallel) else None


def ddp_broadcast_buffers_at_next_forward(ddp: Any, on: bool) -> bool:
    """Whether DDP's next forward broadcasts rank 0's buffers. DDP decides it by its attribute
    ``require_forward_param_sync`` (set by each forward: True after a synchronizing forward, False
    after one under ``no_sync``). Returns False (nothing set) where the attribute is missing."""
    if not hasattr(ddp, "require_forward_param_sync"):
        warn_once("ddp-buffer-flag", "gradguard: this torch's DistributedDataParallel has no "
                  "require_forward_param_sync; gradguard's out-of-memory rule under DDP leaves its buffer broadcast as it is")
        return False
    ddp.require_forward_param_sync = bool(on)
    return True


# -- torch.distributed: sharded parameters (FSDP2 DTensors, FSDP1) ----------------------------------
def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` (FSDP2 parameters and gradients), or None."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def fsdp1_units(model: Any) -> list[Any]:
    """The ``FullyShardedDataParallel`` (FSDP1) modules inside ``model`` (empty without FSDP1)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def fsdp1_uses_orig_params(unit: Any) -> bool:
    """Whether an FSDP1 unit exposes the original parameters (``use_orig_params=True``: private
    ``_use_orig_params``) rather than one flat parameter per unit."""
    return bool(getattr(unit, "_use_orig_params", False))


def fsdp1_shard_size(unit: Any) -> int:
    """How many processes one FSDP1 unit spreads each parameter over (1: ``NO_SHARD``; its shard
    group's size otherwise, which is the node for hybrid sharding)."""
    strategy = getattr(getattr(unit, "sharding_strategy", None), "name", "FULL_SHARD")
    if strategy == "NO_SHARD":
        return 1
    group = getattr(unit, "process_group", None)
    return int(torch.distributed.get_world_size(group)) if group is not None else 1


@dataclass(frozen=True)
class FlatPiece:
    """One original parameter inside an FSDP1 flat parameter (``use_orig_params=False``).

    ``name``: its path in the unwrapped model (FSDP wrapper segments dropped). ``offset`` /
    ``numel``: where its elements lie in this process's local flat shard (``numel`` 0 when none of
    it is on this process). ``shape``: its unsharded shape. ``module``: the module that owns it."""

    flat: Any
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    module: Any


def placement_shards(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor over its mesh dimension: ``Shard``, and the
    private ``_StridedShard`` that FSDP2 puts on a dimension tensor parallelism already shards (it is
    not a ``Shard`` subclass, and its ``is_shard()`` answers False in torch 2.13)."""
    return bool(placement.is_shard()) or type(placement).__name__ in ("_StridedShard", "StridedShard") \
        or hasattr(placement, "split_factor")


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer whose state this process holds: under torch's ``ZeroRedundancyOptimizer``
    (ZeRO-1: the state sharded over the ranks) its local optimizer over this rank's partition
    (``.optim``), whose ``state_dict()`` needs no collective; else ``optimizer`` itself."""
    inner = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def sync_local_param_groups(optimizer: Any) -> None:
    """After a change to ``optimizer.param_groups`` made *inside* its ``step`` (Lightning's closure
    runs there): a ``ZeroRedundancyOptimizer`` copied its groups' settings into its local optimizer
    when the step began, so copy them again (every key but ``params``), or the change would reach
    the local optimizer one step late. Nothing for other optimizers."""
    inner = local_optimizer(optimizer)
    if inner is optimizer:
        return
    for outer, local in zip(optimizer.param_groups, inner.param_groups):
        for k, v in outer.items():
            if k != "params":
                local[k] = v


def is_flat_param(p: Any) -> bool:
    """Whether ``p`` is an FSDP1 ``FlatParameter`` (private ``_is_flat_param`` flag, else the class name)."""
    return bool(getattr(p, "_is_flat_param", False)) or type(p).__name__ == "FlatParameter"


def fsdp1_flat_pieces(model: Any) -> list[FlatPiece] | None:
    """Every original parameter of the FSDP1 flat parameters in ``model`` (``use_orig_params=False``),
    in the order of ``model.named_parameters()``: ``[]`` without flat parameters, None when this
    torch's private ``FlatParameter`` layout (``_fqns``, ``_shapes``, ``_param_infos``,
    ``_shard_param_infos``) is not the one gradguard knows."""
    units = [u for u in fsdp1_units(model) if not fsdp1_uses_orig_params(u)]
    if not units:
        return []
    flats = {id(getattr(u, "_flat_param", None)) for u in units} - {id(None)}
    out: list[FlatPiece] = []
    for pname, flat in model.named_parameters():
        if id(flat) not in flats:
            continue
        fqns = getattr(flat, "_fqns", None)
        shapes = getattr(flat, "_shapes", None)
        infos = getattr(flat, "_param_infos", None)
        shard = getattr(flat, "_shard_param_infos", None)
        if not (fqns and shapes and infos and shard) or not len(fqns) == len(shapes) == len(infos) == len(shard):
            return None
        prefix = pname[: -len("_flat_param")] if pname.endswith("_flat_param") else None
        if prefix is None:
            return None
        for fqn, shape, info, sh in zip(fqns, shapes, infos, shard):
            try:
                in_shard = bool(sh.in_shard)
                offset, numel = (int(sh.offset_in_shard), int(sh.numel_in_shard)) if in_shard else (0, 0)
                module = info.module
            except (AttributeError, TypeError):
                return None
            name = _unwrapped_name(prefix + fqn)
            out.append(FlatPiece(flat, name, offset, numel, tuple(int(d) for d in shape), module))
    return out


def _unwrapped_name(name: str) -> str:
    for seg in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(seg, "")
    return name


def fsdp1_full_shapes(model: Any) -> dict[int, tuple[int, ...]]:
    """``{id(parameter): its unsharded shape}`` for the original parameters of FSDP1 units with
    ``use_orig_params=True`` (each process sees only its flat piece of them: private
    ``FlatParameter._params`` / ``_shapes``); empty without FSDP1."""
    out: dict[int, tuple[int, ...]] = {}
    for unit in fsdp1_units(model):
        flat = getattr(unit, "_flat_param", None)
        params, shapes = getattr(flat, "_params", None), getattr(flat, "_shapes", None)
        if params and shapes and len(params) == len(shapes):
            out.update({id(p): tuple(int(d) for d in s) for p, s in zip(params, shapes)})
    return out


# -- DeepSpeed (its engine steps the optimizer; gradguard reads its signals, see gradguard.deepspeed) ---
def is_deepspeed_engine(obj: Any) -> bool:
    """A ``deepspeed.DeepSpeedEngine`` (or a subclass), detected without importing deepspeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
               for c in type(obj).__mro__)


def ds_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0: no ZeRO)."""
    return int(engine.zero_optimization_stage())


def ds_zero_optimizer(engine: Any) -> Any | None:
    """The engine's ZeRO stage 1/2 optimizer when it has the pieces gradguard reads (the fp32
    master partitions and the ``clip_grad`` it clips with), else None."""
    opt = getattr(engine, "optimizer", None)
    if opt is None or not isinstance(getattr(opt, "single_partition_of_fp32_groups", None), list):
        return None
    if not isinstance(getattr(opt, "clip_grad", None), (int, float)):
        return None
    if not isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        return None
    return opt


def ds_global_norm(engine: Any) -> float | None:
    """The global gradient norm of the engine's last step, before clipping and unscaled (inf after
    an overflow); None when the engine did not compute one."""
    value = engine.get_global_grad_norm()
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def ds_overflow(engine: Any) -> bool:
    """Whether the engine skipped its last step on an overflow (non-finite gradients)."""
    return bool(getattr(engine.optimizer, "overflow", False))


def ds_loss_scale(engine: Any) -> float | None:
    """The fp16 loss scale of the engine (None without fp16)."""
    if not engine.fp16_enabled():
        return None
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scale = getattr(scaler, "cur_scale", None)
    return None if scale is None else float(scale)


_DS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def ds_scaler_state(engine: Any) -> dict[str, float]:
    """The fp16 loss scaler's counters (for snapshots); empty without fp16."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not engine.fp16_enabled():
        return {}
    return {k: getattr(scaler, k) for k in _DS_SCALER_FIELDS if hasattr(scaler, k)}


def ds_load_scaler_state(engine: Any, state: dict[str, float]) -> None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for k, v in state.items():
        if scaler is not None and k in _DS_SCALER_FIELDS:
            setattr(scaler, k, v)


def ds_master_partitions(engine: Any) -> list[torch.Tensor]:
    """This process's fp32 master partitions (ZeRO 1/2): what the optimizer updates, copied into
    the module's parameters after each step."""
    return list(engine.optimizer.single_partition_of_fp32_groups)


def ds_clip(engine: Any) -> float:
    """The max norm the engine clips to (0: no clipping)."""
    return float(engine.optimizer.clip_grad)


def ds_set_clip(engine: Any, max_norm: float | None) -> None:
    """Set the max norm the engine clips to from its next step (None: no clipping)."""
    engine.optimizer.clip_grad = 0.0 if max_norm is None else float(max_norm)


def ds_partition_grads(engine: Any) -> list[tuple[Any, torch.Tensor]] | None:
    """This process's partition of the reduced gradients at an accumulation boundary, before the
    engine's step (ZeRO 1/2 without offload): ``[(module parameter, its piece)]``, the pieces
    disjoint across the data-parallel ranks and, under fp16, still multiplied by the loss scale.
    None when the layout is not the one gradguard reads (offload, another DeepSpeed version)."""
    opt = engine.optimizer
    groups = getattr(opt, "averaged_gradients", None)
    params = getattr(opt, "params_in_partition", None)
    if getattr(opt, "cpu_offload", False) or not isinstance(groups, dict) or not isinstance(params, list):
        return None
    out: list[tuple[Any, torch.Tensor]] = []
    for i, group_params in enumerate(params):
        grads = groups.get(i)
        if grads is None:
            if group_params:
                return None
            continue
        pieces = [g for g in grads if isinstance(g, torch.Tensor) and not getattr(g, "_zero_padding", False)]
        # the last partition may end with an unflagged padding piece, after the parameters' pieces
        if len(pieces) < len(group_params) or any(g.numel() > p.numel() for g, p in zip(pieces, group_params)):
            return None
        out.extend(zip(group_params, pieces[:len(group_params)]))
    return out


def ds_pre_step_readable(engine: Any) -> bool:
    """Whether :func:`ds_partition_grads` can read this engine's gradients before its step."""
    opt = engine.optimizer
    return (not getattr(opt, "cpu_offload", False) and isinstance(getattr(opt, "averaged_gradients", None), dict)
            and isinstance(getattr(opt, "params_in_partition", None), list)
            and hasattr(opt, "check_grad_overflow"))


class ds_forced_overflow:
    """Make the engine's next step skip itself through its own overflow path (all its buffers
    cleared, its scheduler held, ``skipped_steps`` counted): a NaN in this process's gradient
    partition, with the overflow check on for that step (bf16 turns it off). ``keep_scale``: put the
    fp16 loss scaler back afterwards (a skip gradguard decided is no overflow)."""

    def __init__(self, engine: Any, pieces: list[torch.Tensor], keep_scale: bool) -> None:
        self.engine, self.pieces, self.keep_scale = engine, pieces, keep_scale

    def __enter__(self) -> ds_forced_overflow:
        opt = self.engine.optimizer
        self._check = opt.check_grad_overflow
        opt.check_grad_overflow = True
        self._scaler = ds_scaler_state(self.engine) if self.keep_scale else {}
        if self.pieces:
            self.pieces[0].view(-1)[:1].fill_(float("nan"))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.optimizer.check_grad_overflow = self._check
        if self._scaler:
            ds_load_scaler_state(self.engine, self._scaler)


def ds_set_reported_norm(engine: Any, norm: float) -> None:
    """Make ``engine.get_global_grad_norm()`` (what the HF Trainer logs as ``grad_norm``) return the
    step's norm before gradguard clipped the partition, as in an unguarded run."""
    for holder in (engine, engine.optimizer):  # the engine copies its optimizer's value after each step
        if hasattr(holder, "_global_grad_norm"):
            holder._global_grad_norm = float(norm)
