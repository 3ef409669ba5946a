"""Advice for the next run: what the guard had to do, turned into settings to start from.

:func:`advise` is the one place this is computed. The guard calls it at close (the summary's
``advice``, also in the JSONL ``summary`` record); :func:`advise_from_records` computes the same
from a JSONL event log (the report, ``gradguard report``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["advise", "advise_from_records", "UNSTABLE_ACTIONS", "ADVICE_ACTIONS", "ADVICE_LOG_SIZE", "ENGINES"]

ENGINES = ("plain", "hf", "lightning")
"""The engines whose own setting names the advice uses (``engine=``); any other value (or None)
names all three."""

# where each engine takes the setting: the clip threshold, the peak LR and the warm-up
_CLIP = {"plain": "clip_grad_norm_(model.parameters(), max_norm={v:g})", "hf": "TrainingArguments(max_grad_norm={v:g})",
         "lightning": "Trainer(gradient_clip_val={v:g})"}
_LR = {"plain": "optimizer lr", "hf": "TrainingArguments(learning_rate=...)", "lightning": "optimizer lr in configure_optimizers"}
_WARMUP = {"plain": "a linear LR warm-up over {v} steps (e.g. a LambdaLR)", "hf": "TrainingArguments(warmup_steps={v})",
           "lightning": "a linear LR warm-up over {v} steps (a step-interval scheduler in configure_optimizers)"}

UNSTABLE_ACTIONS = frozenset({"rollback", "lower_lr", "tighten_clip", "adam", "lower_layer_lr", "shrink_batch",
                              "skip_data", "halt"})
"""Actions that answer an instability (not a skip of one odd batch, not a stable-period relaxation)."""

ADVICE_ACTIONS = UNSTABLE_ACTIONS | {"revert_lr", "lift_lr", "recut_lr"}
"""The actions the advice reads; the guard's state keeps the latest of them (``action_log``), so a
resumed run still advises from what happened before the resume."""

#: How many of those actions the guard's state keeps.
ADVICE_LOG_SIZE = 200


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _round_sig(x: float, digits: int = 2) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + digits - 1)


def _clip_text(v: float, engine: str | None) -> str:
    if engine in _CLIP:
        return _CLIP[engine].format(v=v)
    return (f"max grad norm {v:g} (HF: max_grad_norm={v:g}; Lightning: gradient_clip_val={v:g}; plain loop: "
            f"clip_grad_norm_(..., max_norm={v:g}))")


def _warmup_text(v: int, engine: str | None) -> str:
    if engine in _WARMUP:
        return _WARMUP[engine].format(v=v)
    return f"linear LR warm-up over {v} steps (HF: warmup_steps={v})"


def _lr_text(base: list[float], new: list[float]) -> str:
    """Each distinct change once: ``0.1 -> 0.003`` for one value shared by every param group,
    ``group 0: 0.1 -> 0.003, group 1: ...`` only where the groups differ."""
    pairs = list(dict.fromkeys(zip(base, new)))
    if len(pairs) == 1:
        return f"{pairs[0][0]:g} -> {pairs[0][1]:g}"
    return ", ".join(f"group {i}: {b:g} -> {n:g}" for i, (b, n) in enumerate(zip(base, new)))


def _advise_lr(actions: list[dict[str, Any]], summary: dict[str, Any], groups: list[dict[str, Any]],
               engine: str | None, settings: dict[str, Any], lines: list[str]) -> None:
    """The peak LR: the base LR x the multiplier set by the guard's last LR cut (or its revert, or
    its lift once the schedule passed the LR that failed)."""
    cuts = [a for a in actions if a.get("name") in ("lower_lr", "revert_lr", "lift_lr", "recut_lr")]
    mult = None
    if cuts:
        p = cuts[-1].get("params") or {}
        mult = _num(p.get("to", p.get("lr_multiplier")))
    final = _num(summary.get("lr_multiplier"))
    if mult is not None and mult < 1:
        settings["lr_factor"] = _round_sig(mult)
        later = f"; the guard raised it to x{final:.3g} by the end" if final is not None and final > mult else ""
        base = [_num(g.get("lr")) for g in groups]
        if base and all(b is not None for b in base):
            settings["lr"] = [_round_sig(b * mult) for b in base]  # type: ignore[operator]
            shown = _lr_text(base, settings["lr"])  # type: ignore[arg-type]
            where = f" as {_LR[engine]}" if engine in _LR else ""
            lines.append(f"peak LR x{settings['lr_factor']:g} ({shown}{where}): the level that restored stability at "
                         f"step {cuts[-1].get('step')}{later}")
        else:
            lines.append(f"peak LR x{settings['lr_factor']:g}: the level that restored stability at step "
                         f"{cuts[-1].get('step')}{later}")


def _advise_optimizer(actions: list[dict[str, Any]], settings: dict[str, Any], lines: list[str]) -> None:
    """Adam's beta2/eps, per-layer LR factors and the batch size the guard had to set."""
    adam = [a for a in actions if a.get("name") == "adam" and "unavailable" not in (a.get("params") or {})]
    if adam:
        change = next(iter(v for v in (adam[-1].get("params") or {}).values() if isinstance(v, dict)), None)
        if change:
            settings["beta2"] = change["beta2"][1]
            settings["eps"] = change["eps"][1]
            lines.append(f"Adam beta2={settings['beta2']:g}, eps={settings['eps']:g}: the guard had to set them")
    layer = {}
    for a in actions:
        if a.get("name") == "lower_layer_lr":
            for k, v in (a.get("params") or {}).items():
                if _num(v) is not None and k != "rung":
                    layer[k] = _round_sig(float(v))
    if layer:
        settings["layer_lr_factor"] = layer
        lines.append("a lower LR for " + ", ".join(f"{k} (x{v:g})" for k, v in layer.items())
                     + ": these layers spiked (e.g. a separate param group for embeddings / lm_head)")
    shrinks = [a for a in actions if a.get("name") == "shrink_batch" and "batch" in (a.get("params") or {})]
    if shrinks:
        settings["batch_size"] = int(shrinks[-1]["params"]["batch"][1])
        lines.append(f"batch size {settings['batch_size']}: the guard had to shrink it "
                     f"(from {shrinks[0]['params']['batch'][0]})")


def _without_data_faults(actions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The actions without those the data was to blame for: a rollback the guard held as ambiguous
    (spikes on unchanged weights at a steady LR: ``params.ambiguous``), and an escalation (its
    rollback, LR cut, clip...) undone once the restored weights met bad data too (a ``revert_lr``
    or a ``undo_rollback`` that is not a trial). What is left answered real instabilities."""
    undone_steps: set[int] = set()
    for i, a in enumerate(actions):
        p = a.get("params") or {}
        if a.get("name") == "revert_lr" or (a.get("name") == "undo_rollback" and not p.get("trial")):
            earlier = [b for b in actions[:i] if b.get("name") == "rollback"
                       and int(b.get("step", 0)) < int(a.get("step", 0))]
            if earlier and not (earlier[-1].get("params") or {}).get("ambiguous"):
                undone_steps.add(int(earlier[-1].get("step", 0)))
    return [a for a in actions
            if not (a.get("name") == "rollback" and (a.get("params") or {}).get("ambiguous"))
            and not (int(a.get("step", 0)) in undone_steps and a.get("name") in UNSTABLE_ACTIONS)]


def advise(*, actions: list[dict[str, Any]], summary: dict[str, Any], config: dict[str, Any] | None = None,
           optimizer: dict[str, Any] | None = None, engine: str | None = None) -> dict[str, Any]:
    """Concrete settings for the next run, from the actions the guard took (JSONL ``action``
    records, oldest first), its summary (``lr_multiplier``, ``max_grad_norm``, ``steps``), its
    config (``GuardConfig.to_dict()``) and the optimizer's groups as the run started (the
    ``start`` record's ``optimizer``). The LR is the base LR x the multiplier set by the guard's
    last LR cut (the level that restored stability). Returns ``{"settings": {...}, "lines": [...]}``: settings
    only for what the guard had to change, one readable line per setting with the reason, each
    value stated once and named as ``engine`` (``"plain"``, ``"hf"``, ``"lightning"``) takes it."""
    config = config or {}
    groups = (optimizer or {}).get("groups") or []
    steps = int(summary.get("steps") or 0)
    settings: dict[str, Any] = {}
    lines: list[str] = []
    actions = _without_data_faults(actions)
    unstable = [a for a in actions if a.get("name") in UNSTABLE_ACTIONS]
    names = {a.get("name") for a in actions}
    if not unstable:
        skips = int(summary.get("skipped") or 0)
        lines.append("nothing to change: the guard took no corrective action"
                     + (f" ({skips} odd steps skipped)" if skips else ""))
        return {"settings": settings, "lines": lines}
    first = min(int(a.get("step", 0)) for a in unstable)
    # the level that restored stability: set by the last LR cut (or its revert). The guard raises
    # it again in stable periods, but that later level was only probed, late in training: on the
    # demo's explosive setting, a rerun at the end level lands 7-10% above the tuned run, one at
    # this level within 1% (benchmarks/advice.py)
    _advise_lr(actions, summary, groups, engine, settings, lines)
    warmup_cfg = int((config.get("detect") or {}).get("warmup_steps") or 20)
    rewarm = int((config.get("lr") or {}).get("rewarm_steps") or 25)
    if first <= 3 * warmup_cfg and (not steps or first <= steps // 4):
        settings["warmup_steps"] = max(rewarm, 2 * first)
        lines.append(f"{_warmup_text(settings['warmup_steps'], engine)}: the first instability came "
                     f"early (step {first})")
    clip_cfg = config.get("clip") or {}
    max_norm = _num(summary.get("max_grad_norm"))
    if clip_cfg.get("mode", "fixed") != "off" and max_norm is not None:
        tightened = [_num((a.get("params") or {}).get("to")) for a in actions if a.get("name") == "tighten_clip"]
        tightened = [t for t in tightened if t is not None]
        clip = min([max_norm, *tightened]) if tightened else max_norm
        settings["max_grad_norm"] = _round_sig(clip)
        why = "the tightest threshold the guard needed" if tightened else "the threshold the guard clipped at"
        lines.append(f"{_clip_text(settings['max_grad_norm'], engine)}: {why}")
    _advise_optimizer(actions, settings, lines)
    if "halt" in names:
        lines.append("the run halted: start from these settings and a checkpoint before the first instability "
                     f"(step {first})")
    return {"settings": settings, "lines": lines}


def advise_from_records(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """:func:`advise` from the records of a JSONL event log."""
    actions: list[dict[str, Any]] = []
    start: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    last_metrics: dict[str, Any] = {}
    for r in records:
        kind = r.get("type")
        if kind == "start" and not start:
            start = r
        elif kind == "action":
            actions.append(r)
        elif kind == "summary":
            summary = r
        elif kind == "metrics":
            last_metrics = r
    if not summary:  # a run that did not close (killed): the last metrics stand in
        summary = {"steps": last_metrics.get("step", 0),
                   "lr_multiplier": last_metrics.get("gradguard/lr_multiplier"),
                   "max_grad_norm": last_metrics.get("gradguard/max_grad_norm")}
    return advise(actions=actions, summary=summary, config=start.get("config"), optimizer=start.get("optimizer"),
                  engine=start.get("engine"))
