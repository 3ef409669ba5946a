"""Resuming with a changed config: which changes take effect, which saved state is kept.

The guard's state (``GuardCore.state_dict()``) carries the config it was running with. When a run
is resumed with a different config, :func:`reconcile` compares the two after the state was loaded
and applies the rule below; every changed field outside ``output`` is warned about once (a
``GradGuardWarning`` naming the field, the saved value and the new value, and what happens) and
recorded as a ``resume_config_change`` event.

The rule:

* **The new config is the config in force.** Every field takes effect from the first resumed step
  (thresholds, ladder, factors, intervals, the output folder, sinks and console). ``output.*`` and
  ``measure.log_interval`` change silently: where and how often a run reports is no conflict.
* **What the run learned is kept from the saved state**: the LR multiplier, its ceiling and its
  re-warm-up; the ladder level and escalation history; the detectors' baselines; an Adam tuning in
  force; a tightened clip; the counters and the checkpoint trust tier.
* **Where the two meet** (a changed field that governs kept state):

  - ``clip.max_norm`` is the new ceiling. A clip that was not tightened takes the new value at
    once; a tightened clip is kept if it is below the new ceiling (else the new value) and
    relaxes toward the new ceiling after ``clip.relax_after`` healthy steps.
  - ``lr.*``: the new factors apply to the next LR action; the saved multiplier is kept (raised to
    a larger new ``lr.min_multiplier``).
  - ``policy.ladder``: the saved level is kept; the next escalation takes rung
    ``min(level, len(ladder) - 1)`` of the new ladder.
  - ``policy.act`` turned off (resumed in monitor mode): nothing is applied any more, so the saved
    LR multiplier and Adam tuning stop acting; the state is kept for a later acting resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import warn

__all__ = ["reconcile", "SILENT"]

#: Config fields (prefixes) whose change on resume is no conflict: taken without a warning.
SILENT = ("output.", "measure.log_interval")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "layer_groups":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def changes(saved: Any, current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) of every field that differs (fields one side lacks, from an
    older or newer gradguard, are left out)."""
    if not isinstance(saved, Mapping):
        return []
    old, new = _flatten(saved), _flatten(current)
    return [(k, old[k], new[k]) for k in new if k in old and not _same(old[k], new[k])]


def reconcile(core: Any, saved_config: Any) -> list[dict[str, Any]]:
    """Apply the resume rule to ``core`` (its state just loaded) for the config it was saved with;
    returns the conflicts (also warned about and emitted as events)."""
    out: list[dict[str, Any]] = []
    for field, old, new in changes(saved_config, core.config.to_dict()):
        if field.startswith(SILENT):
            continue
        try:
            effect = _apply(core, field, old, new)
        except (TypeError, ValueError):  # a saved value of the wrong kind: the new one simply holds
            effect = "takes effect"
        message = (f"gradguard: resumed with {field}={new!r}, the saved run used {field}={old!r}: {effect}. "
                   "Fix: nothing if the change is deliberate; else resume with the saved value")
        warn(message, stacklevel=4)
        event = {"type": "resume_config_change", "step": core.step_count, "field": field, "old": old, "new": new,
                 "effect": effect}
        core.emit(event)
        out.append(event)
    return out


def _apply(core: Any, field: str, old: Any, new: Any) -> str:
    if field == "clip.max_norm":
        kept = float(core.clip.max_norm)
        if kept >= float(old):  # not tightened: the new value at once
            core.clip.max_norm = float(new)
            return f"the clip is now {float(new):g}"
        core.clip.max_norm = min(kept, float(new))
        return (f"the tightened clip {kept:g} is kept under the new ceiling (now {core.clip.max_norm:g}) and "
                f"relaxes toward {float(new):g}")
    if field == "lr.min_multiplier":
        lr = core.lr
        if lr.global_mult < float(new):
            lr.global_mult = float(new)
            return f"the saved LR multiplier was raised to the new minimum {float(new):g}"
        return f"takes effect; the saved LR multiplier {lr.global_mult:g} is kept"
    if field.startswith("lr."):
        return f"takes effect for the next LR action; the saved LR multiplier {core.lr.global_mult:g} is kept"
    if field == "policy.ladder":
        level = core.policy.level
        return (f"takes effect; the saved ladder level {level} is kept (the next escalation takes rung "
                f"{min(level, len(new) - 1) + 1} of {len(new)})")
    if field == "policy.act" and not new:
        return (f"the guard now only watches: the saved LR multiplier {core.lr.global_mult:g} and any Adam "
                "tuning are no longer applied (kept in the state)")
    if field.startswith("clip."):
        return f"takes effect; the clip in force {float(core.clip.max_norm):g} is kept"
    return "takes effect"
