"""Sinks: where metrics and events go. JSONL and console here; TensorBoard and W&B load lazily."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

from . import _io, logdir
from .errors import warn

__all__ = ["Sink", "JSONLSink", "ConsoleSink", "MemorySink", "TensorBoardSink", "WandbSink", "M"]


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
    """One JSON object per line: every finding and action as an event; metrics on the interval.

    An I/O error (disk full, read-only or deleted folder) never reaches training: the log stops,
    a ``RuntimeWarning`` is issued and a ``sink_io_error`` event goes to ``on_error`` (the guard
    sets it to send the event to its other sinks).

    A URL path (``memory://``, ``s3://``...) is written through fsspec (see :mod:`gradguard.logdir`):
    lines are appended in batches (every event at once, metrics every ``REMOTE_BATCH`` lines, the
    rest at close), each batch with one open-append-close, as Lightning's CSV logger does."""

    REMOTE_BATCH = 50

    def __init__(self, path: str, metrics: bool = True) -> None:
        self.path = path
        self.metrics = metrics
        self.error: str | None = None
        self._on_error: Any = None
        self._pending: list[dict[str, Any]] = []
        self._fh: TextIO | None = None
        self._remote = logdir.is_url(path)
        self._lines: list[str] = []  # remote: not yet appended
        self._live = True
        try:
            if self._remote:
                with logdir.open_append(path):  # creates the folder and checks the file system takes appends
                    pass
            else:
                _io.check_write(path)
                self._fh = logdir.open_append(path)  # type: ignore[assignment]
        except Exception as exc:  # noqa: BLE001 - a remote file system raises its own errors
            self._fail("open", exc if isinstance(exc, OSError) else OSError(str(exc)))

    @property
    def on_error(self) -> Any:
        """Callable receiving the ``sink_io_error`` event (delivered late if set after the error)."""
        return self._on_error

    @on_error.setter
    def on_error(self, fn: Any) -> None:
        self._on_error = fn
        pending, self._pending = self._pending, []
        for ev in pending:
            fn(ev)

    def _fail(self, what: str, exc: OSError) -> None:
        self._live = False
        self._lines = []
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass
        self.error = f"could not {what} {self.path} ({exc})"
        warn(f"gradguard: the event log is off: {self.error}; training continues", category=RuntimeWarning,
             stacklevel=3)
        event = {"type": "sink_io_error", "step": None, "sink": "jsonl", "path": self.path, "operation": what,
                 "error": str(exc), "errno": exc.errno}
        if self._on_error is None:
            self._pending.append(event)
        else:
            self._on_error(event)

    def _flush_remote(self) -> None:
        lines, self._lines = self._lines, []
        if not lines or not self._live:
            return
        try:
            with logdir.open_append(self.path) as fh:
                fh.write("".join(lines))
        except Exception as exc:  # noqa: BLE001 - a remote file system raises its own errors
            self._fail("write", exc if isinstance(exc, OSError) else OSError(str(exc)))

    def _write(self, obj: dict[str, Any]) -> None:
        if self._remote:
            if self._live:
                self._lines.append(json.dumps(_clean(obj), sort_keys=False) + "\n")
                if obj.get("type") != "metrics" or len(self._lines) >= self.REMOTE_BATCH:
                    self._flush_remote()
            return
        if self._fh is None:
            return
        try:
            _io.check_write(self.path)
            self._fh.write(json.dumps(_clean(obj), sort_keys=False) + "\n")
            self._fh.flush()
        except OSError as exc:
            self._fail("write", exc)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics:
            self._write({"type": "metrics", "step": step, **metrics})

    def log_event(self, event: dict[str, Any]) -> None:
        self._write(event)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is not None:
            self._write({"type": "summary", **summary})
        if self._remote:
            self._flush_remote()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as exc:
                self._fail("close", exc)
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


def _event_text(event: dict[str, Any]) -> str:
    """One Markdown line for an action or halt event."""
    if event.get("type") == "halt":
        return f"**HALT** at step {event.get('step')}: {event.get('message', '')}"
    params = json.dumps(_clean(event.get("params", {})), sort_keys=True, default=str)
    return f"step {event.get('step')}: **{event.get('name')}** `{params}` <- {event.get('reason', '')}"


class TensorBoardSink(Sink):
    """Metrics as TensorBoard scalars; actions and halts as text under ``gradguard/events``.

    The cumulative per-action counts are already scalars (``gradguard/action/<name>``)."""

    TEXT_TAG = "gradguard/events"

    def __init__(self, log_dir: str, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("gradguard: TensorBoardSink needs tensorboard. "
                              "Fix: pip install 'gradguard[tensorboard]'") from exc
        self.log_dir = log_dir
        self._writer: Any = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for k, v in metrics.items():
            self._writer.add_scalar(k, float(v), global_step=step)

    def log_event(self, event: dict[str, Any]) -> None:
        if self._writer is None or event.get("type") not in ("action", "halt"):
            return
        self._writer.add_text(self.TEXT_TAG, _event_text(event), global_step=int(event.get("step", 0)))

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        if summary:
            self._writer.add_text("gradguard/summary", "```\n" + json.dumps(_clean(summary), indent=1,
                                                                         default=str) + "\n```",
                                  global_step=int(summary.get("steps", 0) or 0))
        self._writer.flush()
        self._writer.close()
        self._writer = None


def _flatten(prefix: str, d: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            _flatten(key, v, out)
        elif v is not None:
            out[key] = v
    return out


class WandbSink(Sink):
    """Metrics to a Weights & Biases run; actions and halts as a ``gradguard/actions`` table and the
    guard's summary as ``gradguard/summary/...`` keys, both written at close.

    Uses ``run``, else the active ``wandb.run``, else ``wandb.init(**init_kwargs)``; only a run it
    started itself is finished in ``close``. W&B steps cannot go back: metrics for a step below the
    last one logged are logged without a step, so they join the run's current row (replacing its
    values for the same keys) instead of being dropped by W&B."""

    TABLE_KEY = "gradguard/actions"
    COLUMNS = ["step", "name", "reason", "params"]

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("gradguard: WandbSink needs wandb. Fix: pip install 'gradguard[wandb]'") from exc
        self._wandb = wandb
        self.owns_run = False
        if run is None:
            run = wandb.run
        if run is None:
            run = wandb.init(**init_kwargs)
            self.owns_run = True
        self.run: Any = run
        self._last_step: int | None = None
        self._rows: list[list[Any]] = []
        self._closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            return
        if self._last_step is not None and step < self._last_step:
            self.run.log(dict(metrics))
            return
        self.run.log(dict(metrics), step=step)
        self._last_step = step

    def log_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "action":
            params = json.dumps(_clean(event.get("params", {})), sort_keys=True, default=str)
            self._rows.append([int(event.get("step", 0)), str(event.get("name", "")),
                               str(event.get("reason", "")), params])
        elif kind == "halt":
            self._rows.append([int(event.get("step", 0)), "HALT", str(event.get("message", "")), "{}"])

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._rows:
            self.run.log({self.TABLE_KEY: self._wandb.Table(columns=list(self.COLUMNS), data=self._rows)})
        if summary:
            for k, v in _flatten("gradguard/summary", summary, {}).items():
                self.run.summary[k] = v
        if self.owns_run:
            self.run.finish()
