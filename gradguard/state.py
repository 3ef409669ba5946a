"""Validation of saved guard state before any of it is applied.

``GuardCore.load_state_dict`` hands the whole state to :func:`load_core_state`, which checks the
version, the fingerprint of the model it was saved from, and every key and type, and only then
applies it; if applying still fails part-way, the guard is put back as it was. Every problem is
one :class:`StateError` naming the entry, the value and the fix (never a ``KeyError`` or a half
load).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from .measure import _WRAPPER_PREFIXES

__all__ = ["StateError", "model_signature", "check_fields", "validate_core_state", "load_core_state", "check_ranges",
           "check_resume_step", "MAX_COUNT"]

_FIX = "Fix: load a state saved by gradguard's state_dict() for this model (or start without it)"

#: Top-level entries of ``GuardCore.state_dict()`` and their types.
_CORE_FIELDS: dict[str, Any] = {
    "version": int, "step_count": int, "applied_steps": int, "skipped_steps": int, "n_findings": int,
    "verified": bool, "action_counts": dict, "culprits": dict, "detectors": dict, "policy": dict,
    "clip": dict, "lr": dict, "adam": dict, "snapshots": (dict, type(None)), "model_signature": str,
}
#: Entries that older states may lack (filled with their defaults on load).
_OPTIONAL = {"grow_healthy": int, "checkpoints": list, "config": dict, "action_log": list}
#: The snapshot ring's saved counter; states of earlier versions also carry its per-process costs.
SNAPSHOT_FIELDS: dict[str, Any] = {"restored": int}
SNAPSHOT_OPTIONAL: dict[str, Any] = {"taken": int, "total_seconds": (int, float)}


from .errors import StateError  # noqa: E402  (one error hierarchy: gradguard.errors)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".")


def model_signature(model: nn.Module, root: nn.Module | None = None) -> str:
    """Hash of the model's parameter names and shapes (wrapper prefixes such as DDP's
    ``module.`` dropped, so a state saved unwrapped loads under DDP and vice versa). Sharded
    parameters count with their unsharded shapes (FSDP2 DTensors have them; FSDP1's local flat
    pieces differ by rank), so every rank of a sharded run has the unsharded model's signature.
    ``root``: the engine's FSDP1 wrapper around ``model``, if any (where those shapes are kept)."""
    from ._compat import fsdp1_flat_pieces, fsdp1_full_shapes

    where = root if root is not None else model
    full = fsdp1_full_shapes(where)
    h = hashlib.sha256()
    # FSDP1 flat parameters (use_orig_params=False): their original parameters, unsharded
    pieces = fsdp1_flat_pieces(where) or []
    for piece in pieces:
        h.update(f"{piece.name}:{piece.shape};".encode())
    flat = {id(piece.flat) for piece in pieces}
    for name, p in model.named_parameters():
        if id(p) not in flat:
            h.update(f"{_strip(name)}:{full.get(id(p), tuple(p.shape))};".encode())
    return h.hexdigest()[:16]


def _type_ok(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if int in kinds and isinstance(value, int):
        return True
    if float in kinds and isinstance(value, (int, float)):
        return True
    return any(k not in (int, float, bool) and isinstance(value, k) for k in kinds)


def _kind_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def check_fields(where: str, state: Any, fields: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> None:
    """``state`` is a dict holding every key of ``fields`` with a value of its type (ints accepted
    for floats, bools only for bools); keys of ``optional`` are checked when present."""
    if not isinstance(state, Mapping):
        raise StateError(f"gradguard state {where}={_short(state)}: must be a dict "
                         f"(a {type(state).__name__} was given). {_FIX}")
    for key in fields:
        if key not in state:
            raise StateError(f"gradguard state {where or 'guard'}: entry {key!r} is missing. {_FIX}")
    for key, kind in {**fields, **(optional or {})}.items():
        if key in state and not _type_ok(state[key], kind):
            raise StateError(f"gradguard state {where + '.' if where else ''}{key}={_short(state[key])}: must be "
                             f"{_kind_name(kind)}. {_FIX}")


def _like(where: str, value: Any, live: Any) -> None:
    """``value`` has the shape of the live state ``live``: same kinds, and every key a live dict
    with fixed keys has (dicts keyed by data, such as per-layer baselines, are checked per value)."""
    if live is None or value is None:
        return
    if isinstance(live, bool):
        if not isinstance(value, bool):
            raise StateError(f"gradguard state {where}={_short(value)}: must be a bool. {_FIX}")
    elif isinstance(live, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StateError(f"gradguard state {where}={_short(value)}: must be a number. {_FIX}")
    elif isinstance(live, str):
        if not isinstance(value, str):
            raise StateError(f"gradguard state {where}={_short(value)}: must be a string. {_FIX}")
    elif isinstance(live, Mapping):
        if not isinstance(value, Mapping):
            raise StateError(f"gradguard state {where}={_short(value)}: must be a dict. {_FIX}")
        for key, sub in live.items():
            if key in value:
                _like(f"{where}.{key}", value[key], sub)
    elif isinstance(live, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise StateError(f"gradguard state {where}={_short(value)}: must be a list. {_FIX}")
        if live:
            for i, item in enumerate(value):
                _like(f"{where}[{i}]", item, live[0])


def _counts(where: str, value: Mapping[str, Any]) -> None:
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StateError(f"gradguard state {where}[{k!r}]={_short(v)}: must be a count (int >= 0) "
                             f"keyed by name. {_FIX}")


#: The largest count or step a state may hold (2**53: exact in a float, far beyond any real run).
MAX_COUNT = 2 ** 53
#: Where a state's numbers are range-checked (path -> (low, high, low_open)); every int elsewhere in
#: the guard's own entries must lie in [-MAX_COUNT, MAX_COUNT] and every float there be finite or None
#: (a hand-edited or corrupted state is refused before anything is applied).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "lr.global_mult": (0.0, 1.0, True), "lr.global_ceiling": (0.0, 1.0, True),
    "lr.batch_scale": (0.0, 1e6, True), "clip.max_norm": (0.0, 1e12, True), "clip.var": (0.0, math.inf, False),
    "clip.temp_norm": (0.0, 1e12, True),
}
_COUNT_KEYS = ("step_count", "applied_steps", "skipped_steps", "n_findings", "grow_healthy")
_RANGE_SECTIONS = ("detectors", "policy", "clip", "lr", "adam", "snapshots")


def _bad_number(where: str, value: Any, must: str) -> StateError:
    return StateError(f"gradguard state {where}={_short(value)}: must be {must}. {_FIX}")


def _check_numbers(where: str, value: Any) -> None:
    """Every number under ``value``: ints within +-MAX_COUNT, floats finite (None allowed), and the
    ranges of :data:`_RANGES`."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_numbers(f"{where}.{k}" if where else str(k), v)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_numbers(f"{where}[{i}]", v)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        raise _bad_number(where, value, f"at most {MAX_COUNT} in size")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad_number(where, value, "a finite number")
    bounds = _RANGES.get(where)
    if bounds is not None:
        low, high, low_open = bounds
        if value > high or value < low or (low_open and value == low):
            raise _bad_number(where, value, f"in {'(' if low_open else '['}{low:g}, {high:g}]")


def check_ranges(state: Mapping[str, Any]) -> None:
    """Range checks of a whole ``GuardCore`` state (its kinds already checked): counts are ints in
    [0, MAX_COUNT], LR multipliers in (0, 1], the clip finite and > 0, no NaN or infinity in the
    detectors' baselines, the policy, clip or LR state. Raises :class:`StateError` naming the entry."""
    for key in _COUNT_KEYS:
        if key in state and not 0 <= state[key] <= MAX_COUNT:
            raise _bad_number(key, state[key], f"an int in [0, {MAX_COUNT}]")
    for key in ("applied_steps", "skipped_steps"):
        if key in state and state[key] > state["step_count"]:
            raise _bad_number(key, state[key], f"at most step_count={state['step_count']}")
    for key in ("action_counts", "culprits"):
        for name, v in state[key].items():
            if v > MAX_COUNT:
                raise _bad_number(f"{key}[{name!r}]", v, f"an int in [0, {MAX_COUNT}]")
    for key in _RANGE_SECTIONS:
        if state.get(key) is not None:
            _check_numbers(key, state[key])
    for key in ("layer_mult", "layer_ceiling"):
        for name, v in state["lr"].get(key, {}).items():
            if isinstance(v, (int, float)) and not 0 < v <= 1:
                raise _bad_number(f"lr.{key}[{name!r}]", v, "in (0, 1]")
    policy = state["policy"]
    for key in ("level", "skip_streak", "healthy", "spike_chain"):
        v = policy.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise _bad_number(f"policy.{key}", v, "an int >= 0")
    for key in ("healthy", "count", "clipped", "temp_left"):
        v = state["clip"].get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise _bad_number(f"clip.{key}", v, "an int >= 0")
    for key in ("healthy", "ceiling_healthy", "warm_left"):
        v = state["lr"].get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise _bad_number(f"lr.{key}", v, "an int >= 0")


def check_resume_step(guard: Any, engine_step: int, where: str) -> None:
    """A guard state belongs to the checkpoint it is resumed with: its ``step_count`` is the engine's
    step counter at that save. A state of another checkpoint (``checkpoint-10``'s state with
    ``checkpoint-5``'s weights) would put back LR cuts, clips and baselines of a future the weights
    have not lived: :class:`StateError` naming both steps."""
    if not isinstance(guard, Mapping):
        return
    saved = guard.get("step_count")
    if isinstance(saved, bool) or not isinstance(saved, int) or saved == int(engine_step):
        return
    raise StateError(
        f"gradguard state step_count={saved!r} from {where} does not match the checkpoint resumed from "
        f"(the engine's global step is {int(engine_step)}): the guard state belongs to another checkpoint. "
        "Fix: resume from the checkpoint this guard state was saved with, or remove the guard state "
        "(gradguard_state.json / the callback's entry) to resume with a fresh guard")


def validate_core_state(core: Any, state: Any, version: int) -> None:
    """Check a whole ``GuardCore`` state against ``core`` without changing anything."""
    if not isinstance(state, Mapping):
        raise StateError(f"gradguard state={_short(state)}: must be the dict returned by state_dict() "
                         f"(a {type(state).__name__} was given). {_FIX}")
    if state.get("version") != version:
        raise StateError(f"gradguard state version={_short(state.get('version'))}: this gradguard reads "
                         f"version {version}. Fix: load a state saved by this gradguard version")
    if "model_signature" not in state:
        raise StateError("gradguard state: entry 'model_signature' is missing (no value): the state does not name the "
                         "model it was saved from, so it cannot be checked against this one (a state written before "
                         f"gradguard recorded model signatures, or edited by hand). {_FIX}")
    check_fields("", state, _CORE_FIELDS, _OPTIONAL)
    for key in _COUNT_KEYS:
        if key in state and state[key] < 0:
            raise StateError(f"gradguard state {key}={state[key]!r}: must be >= 0. {_FIX}")
    sig = state["model_signature"]
    mine = model_signature(core.model, getattr(core, "shard_root", None))
    if sig != mine:
        raise StateError(
            f"gradguard state model_signature={sig!r}: saved from another model (this model's parameter "
            f"names and shapes give {mine!r}). Fix: load the state saved with this "
            "model, or start this run's guard without it")
    _counts("action_counts", state["action_counts"])
    _counts("culprits", state["culprits"])
    live = core.state_dict()
    for key in ("detectors", "policy", "clip", "lr", "adam"):
        _like(key, state[key], live[key])
    for key in ("clip", "lr", "adam"):  # ClipController, LRMultiplier, AdamTuner check their own part
        type(getattr(core, key)).check_state(state[key])
    if state["snapshots"] is not None:
        check_fields("snapshots", state["snapshots"], SNAPSHOT_FIELDS, SNAPSHOT_OPTIONAL)
    for key, value in state["lr"].get("layer_mult", {}).items():
        if not math.isfinite(value) or value <= 0:
            raise StateError(f"gradguard state lr.layer_mult[{key!r}]={value!r}: must be finite and > 0. {_FIX}")
    check_ranges(state)


def load_core_state(core: Any, state: Any, apply: Callable[[Mapping[str, Any]], None], version: int) -> None:
    """Validate ``state`` for ``core``, then ``apply`` it; if applying fails part-way the guard's
    previous state is applied back and a :class:`StateError` is raised (all or nothing)."""
    validate_core_state(core, state, version)
    backup = core.state_dict()
    try:
        apply(state)
    except Exception as exc:
        apply(backup)
        raise StateError(f"gradguard state could not be applied ({type(exc).__name__}: {exc}); the guard "
                         f"was left as it was. {_FIX}") from exc
