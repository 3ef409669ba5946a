"""Sinks: where metrics and events go. JSONL and console here; TensorBoard and W&B load lazily."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

__all__ = ["Sink", "JSONLSink", "ConsoleSink", "MemorySink", "M"]


class M:
    """Metric names (slash-separated, no dots). Per-layer names append ``/<layer>``."""

    LOSS = "gradguard/loss"
    GRAD_NORM = "gradguard/grad_norm/total"
    GRAD_NORM_LAYER = "gradguard/grad_norm"  # + /<layer>
    PARAM_NORM_LAYER = "gradguard/param_norm"  # + /<layer>
    UPDATE_RATIO_LAYER = "gradguard/update_ratio"  # + /<layer>
    LR = "gradguard/lr"  # + /group<i>
    LR_MULT = "gradguard/lr_multiplier"
    MAX_NORM = "gradguard/max_grad_norm"
    SCALE = "gradguard/loss_scale"
    OVERFLOW = "gradguard/overflow"
    SKIPPED = "gradguard/skipped_steps"
    NONFINITE_LOSS_STEPS = "gradguard/nonfinite_loss_steps"
    FINDINGS = "gradguard/findings"
    ACTION = "gradguard/action"  # + /<name>: cumulative count
    LEVEL = "gradguard/ladder_level"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf: keep them visible as strings
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Sink:
    """Interface: every method is optional to override."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:  # noqa: B027
        pass

    def log_event(self, event: dict[str, Any]) -> None:  # noqa: B027
        pass

    def close(self, summary: dict[str, Any] | None = None) -> None:  # noqa: B027
        pass


class MemorySink(Sink):
    """Keeps everything in lists (tests, notebooks)."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.events: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.summary = summary


class JSONLSink(Sink):
    """One JSON object per line: every finding and action as an event; metrics on the interval."""

    def __init__(self, path: str, metrics: bool = True) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._fh: TextIO | None = open(path, "a", encoding="utf-8")
        self.metrics = metrics

    def _write(self, obj: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps(_clean(obj), sort_keys=False) + "\n")
        self._fh.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics:
            self._write({"type": "metrics", "step": step, **metrics})

    def log_event(self, event: dict[str, Any]) -> None:
        self._write(event)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is not None:
            self._write({"type": "summary", **summary})
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class ConsoleSink(Sink):
    """One readable line per action (and halt), a summary at the end."""

    def __init__(self, stream: TextIO | None = None, prefix: str = "[gradguard]") -> None:
        self.stream = stream or sys.stderr
        self.prefix = prefix

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "action":
            params = ", ".join(f"{k}={_fmt(v)}" for k, v in event.get("params", {}).items())
            print(f"{self.prefix} step {event['step']}: {event['name']}"
                  f"{' (' + params + ')' if params else ''} <- {event.get('reason', '')}",
                  file=self.stream, flush=True)
        elif event.get("type") == "halt":
            print(f"{self.prefix} HALT at step {event['step']}: {event.get('message', '')}",
                  file=self.stream, flush=True)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if not summary:
            return
        acts = ", ".join(f"{k} x{v}" for k, v in summary.get("actions", {}).items()) or "none"
        print(f"{self.prefix} summary: {summary.get('steps', 0)} steps, {summary.get('skipped', 0)} skipped, "
              f"{summary.get('findings', 0)} findings, actions: {acts}", file=self.stream, flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
