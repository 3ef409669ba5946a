"""Every access to a private attribute of torch, transformers or Lightning, in one place.

Each function is named for what it does and feature-detects what it touches. Adapters call
:func:`check_features` once at attach time: a private piece missing in the installed version
disables the action that depends on it, with one warning naming the version and the action; nothing
here raises mid-run.

Supported versions, each end tested (CI runs the latest releases; the README's Development section
has the command that runs the contract suite against the oldest): torch >= 2.13 (the only version
testable here), transformers >= 4.57, lightning >= 2.4.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .errors import warn_once

__all__ = [
    "scaler_scale", "scaler_found_inf", "set_scaler_scale", "scaler_unscaled", "scalers_in_use",
    "shadow_method", "unshadow_method",
    "find_caller", "hf_callback_list", "pl_combined_loader", "pl_loader_iterator", "pl_iterator_drawn",
    "pl_restart_sampler_iter", "pl_data_fetcher", "pl_set_epoch_length", "pl_checkpoint_last_saved",
    "swap_class", "check_features", "versions",
]

_MISSING = object()


def versions() -> dict[str, str]:
    """Installed versions of the packages gradguard reaches into."""
    out = {"torch": torch.__version__}
    for name in ("transformers", "lightning", "pytorch_lightning", "accelerate"):
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
    the garbage collector's objects: call it once, not per step)."""
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


# -- call stack: objects an engine does not pass to its callbacks --------------------------------
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


def hf_callback_list(callback: Any) -> list[Any] | None:
    """The ``CallbackHandler.callbacks`` list that holds ``callback`` (found on the call stack)."""
    try:
        from transformers.trainer_callback import CallbackHandler
    except ImportError:  # pragma: no cover
        return None
    handler = find_caller(CallbackHandler, start=2)
    cbs = getattr(handler, "callbacks", None)
    return cbs if isinstance(cbs, list) and callback in cbs else None


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
