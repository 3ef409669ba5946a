"""gradguard's errors and warnings, in one place.

Hierarchy (every error gradguard raises for a user's mistake or setup is a :class:`GradGuardError`)::

    GradGuardError
    +-- ConfigError            (also ValueError)  a configuration value is invalid
    |   +-- ConfigTypeError    (also TypeError)   a value of the wrong type where a config was expected
    |   +-- UnsupportedSetupError (also TypeError) the engine setup cannot be guarded (DeepSpeed, FSDP,
    |       |                                      an optimizer without step(), a model that is no Module...)
    |       +-- AttachError                        a guard cannot be attached as asked (a second guard...)
    +-- StateError             (also ValueError)  a saved guard state cannot be loaded (nothing changed)
    +-- SnapshotUnavailable    (also RuntimeError) no snapshot could be restored (nothing changed)
    +-- GradGuardHalt          (also RuntimeError) the policy stopped training (``.diagnosis``)

The built-in bases are kept so that code written against earlier versions (``except ValueError``,
``except TypeError``, ``except RuntimeError``) still catches what it used to.

:func:`warn` is the only way gradguard warns: on the process of global rank 0 only (one warning
per run, not one per GPU), and :func:`warn_once` at most once per key and process. Every warning is
also a record of the ``gradguard`` logger (:data:`logger`), and the logger's level is the one switch
that quiets gradguard: ``logging.getLogger("gradguard").setLevel(logging.ERROR)`` silences its
warnings and its console lines (the JSONL event log is still written).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

__all__ = [
    "GradGuardError", "ConfigError", "ConfigTypeError", "UnsupportedSetupError", "AttachError", "StateError",
    "SnapshotUnavailable", "GradGuardHalt",
    "GradGuardWarning", "is_rank0", "warn", "warn_once", "logger", "user_stacklevel",
]

logger = logging.getLogger("gradguard")
"""The ``gradguard`` logger: every warning (level WARNING) and console line (level INFO) goes through
it. ``logger.setLevel(logging.ERROR)`` quiets gradguard; a ``NullHandler`` keeps Python's last-resort
handler from printing a warning twice (it is already shown by :mod:`warnings`)."""
logger.addHandler(logging.NullHandler())


class GradGuardError(Exception):
    """Base of every error gradguard raises on purpose."""


class ConfigError(GradGuardError, ValueError):
    """A configuration value is invalid. The message names the field, the value and the fix."""


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type was passed where a configuration was expected."""


class UnsupportedSetupError(ConfigError, TypeError):
    """The engine's setup cannot be guarded (e.g. DeepSpeed or FSDP, an optimizer that updates
    inside backward, a model that is not a ``torch.nn.Module``). The message names the setting and
    the fix. A ``ConfigError`` too: the fix is always a change of the run's configuration."""


class AttachError(UnsupportedSetupError):
    """A guard cannot be attached as asked (e.g. a second guard on one optimizer, a closure
    optimizer in a plain loop). The message names the object, what is wrong and the fix."""


class StateError(GradGuardError, ValueError):
    """A saved gradguard state cannot be loaded (wrong version, another model, garbled). Nothing
    was changed. The message names the entry, the value and the fix."""


class SnapshotUnavailable(GradGuardError, RuntimeError):
    """No snapshot could be restored (missing, corrupt, from another model or optimizer layout).
    Raised before anything was changed: training state is as it was."""


class GradGuardHalt(GradGuardError, RuntimeError):
    """Raised when the policy stops training. ``.diagnosis`` holds what happened, when, in which
    layers and what was tried; ``str(exc)`` is a readable summary."""

    def __init__(self, diagnosis: dict[str, Any]) -> None:
        self.diagnosis = diagnosis
        tried = ", ".join(f"{k} x{v}" for k, v in diagnosis.get("actions_tried", {}).items()) or "nothing"
        layers = ", ".join(diagnosis.get("culprit_layers", [])[:8]) or "none named"
        super().__init__(
            f"gradguard halted training at step {diagnosis.get('step')}: {diagnosis.get('reason')}. "
            f"Culprit layers: {layers}. Tried: {tried}. Last findings: "
            + "; ".join(f"step {f['step']} {f['kind']}" for f in diagnosis.get("recent_findings", [])[-5:])
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (multiprocessing, DDP workers)
        return (type(self), (self.diagnosis,))


class GradGuardWarning(UserWarning):
    """Category of gradguard's warnings (filter with ``warnings.filterwarnings(..., GradGuardWarning)``)."""


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def is_rank0() -> bool:
    """True on the process of global rank 0 (or when not distributed).

    With ``torch.distributed`` initialized its rank decides. Before that (a launcher started the
    process: ``torchrun``, ``accelerate``, ``deepspeed``) the ``RANK`` environment variable is
    trusted only together with a consistent ``WORLD_SIZE`` > 1 (``0 <= RANK < WORLD_SIZE``): a
    ``RANK=3`` left in the environment of a single process does not silence it."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # pragma: no cover - a broken distributed install must not stop a warning path
        pass
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None or world <= 1 or not 0 <= rank < world:
        return True
    return rank == 0


_WARNED: set[str] = set()

# Frames of these packages are not the user's line: a warning points past them (an HF or Lightning
# callback warns from inside the engine's loop; the user's line is ``trainer.train()``/``fit()``).
_LIBRARY_PACKAGES = ("gradguard", "torch", "transformers", "accelerate", "lightning", "pytorch_lightning",
                     "lightning_fabric", "deepspeed")


def _is_library(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _LIBRARY_PACKAGES)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by this function's caller that points at
    the first frame outside gradguard and the engines it runs in (the user's line)."""
    frame = sys._getframe(1)  # the caller of user_stacklevel(): the frame that calls warnings.warn
    level = 1
    while frame is not None and _is_library(str(frame.f_globals.get("__name__", ""))):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def warn(message: str, *, stacklevel: int | None = None, category: type[Warning] = GradGuardWarning) -> None:
    """Warn on global rank 0 only, as a :mod:`warnings` warning that points at the user's line (the
    first frame outside gradguard and the training engine) and as a WARNING record of the
    ``gradguard`` logger. Nothing when that logger's level is above WARNING. ``message`` should
    start with ``gradguard:``. ``stacklevel`` is accepted for compatibility and ignored."""
    if not is_rank0() or not logger.isEnabledFor(logging.WARNING):
        return
    logger.warning(message)
    warnings.warn(message, category, stacklevel=user_stacklevel())


def warn_once(key: str, message: str, *, stacklevel: int | None = None,
              category: type[Warning] = GradGuardWarning) -> None:
    """Like :func:`warn`, at most once per ``key`` in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warn(message, category=category)
