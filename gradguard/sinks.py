"""Sinks: where metrics and events go. JSONL and console here; TensorBoard and W&B load lazily."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, TextIO

from . import _io, errors, logdir
from .errors import warn
from .names import M

__all__ = ["Sink", "JSONLSink", "ConsoleSink", "MemorySink", "TensorBoardSink", "WandbSink", "M",
           "EVENT_SCHEMA_VERSION", "event_schema", "package_versions", "is_headline", "alert_text"]

EVENT_SCHEMA_VERSION = 1
"""Version of the JSONL event records (``gradguard/schema/events.schema.json``), in the ``start``
record; raised when a field changes meaning or goes away (new fields and record types keep it)."""


def event_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the JSONL event records, shipped with the package."""
    from importlib import resources

    return json.loads(resources.files("gradguard").joinpath("schema/events.schema.json").read_text("utf-8"))


def package_versions() -> dict[str, str]:
    """Versions of python, gradguard, torch and of the engines already imported (for the ``start`` record)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist, module in (("gradguard", "gradguard"), ("torch", "torch"), ("transformers", "transformers"),
                         ("accelerate", "accelerate"), ("lightning", "lightning"),
                         ("pytorch-lightning", "pytorch_lightning"), ("deepspeed", "deepspeed")):
        if module not in sys.modules:
            continue
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = getattr(sys.modules[module], "__version__", None)
            if isinstance(version, str):
                out[dist] = version
    return out


def is_headline(key: str) -> bool:
    """True for a run-level key (what an engine's printed log keeps, e.g. HF's progress bar);
    False for per-layer values (``grad_norm/<layer>``, ``update_ratio/<layer>``, ``param_norm/<layer>``)."""
    if key.startswith((M.LR + "/", M.ACTION + "/", M.EVENT + "/")) or key == M.GRAD_NORM:
        return True
    return key.count("/") < 2


def rename(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """``metrics`` with ``prefix`` put before every key (an engine's namespace, e.g. HF's ``train/``)."""
    return {prefix + k: v for k, v in metrics.items()} if prefix else dict(metrics)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf: keep them visible as strings
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Sink:
    """Interface: every method is optional to override.

    ``engine_bound`` is True for a sink that writes into the engine's own run or writer (HF's
    ``report_to`` integrations, Lightning's loggers): the engine then carries the regular rows at
    its own logging cadence and the core sends such a sink only the rows of steps with an event
    that the engine does not log (see ``GuardCore.attach_live``)."""

    engine_bound = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:  # noqa: B027
        pass

    def log_event(self, event: dict[str, Any]) -> None:  # noqa: B027
        pass

    def log_alert(self, level: str, title: str, text: str, step: int) -> None:  # noqa: B027
        """An alert (``level`` "ERROR" for a halt, "WARN" for a rollback or escalation); the core
        rate-limits them."""

    def end_step(self, step: int) -> None:  # noqa: B027
        """Called once per optimizer step after its events (buffered output may be flushed)."""

    def engine_logged(self, step: int, metrics: dict[str, float]) -> None:  # noqa: B027
        """An ``engine_bound`` sink only: the engine itself logged ``metrics`` (gradguard's keys, no
        prefix) at ``step`` (HF's ``report_to`` integrations write the Trainer's logs)."""

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
        #: an engine whose logger x axis differs from the guard's step (Lightning logs a batch at the
        #: optimizer steps before it) sets this: records then carry ``engine_step``, the x value the
        #: engine's loggers use for that step
        self.step_fn: Any = None
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
            if not getattr(self, "_reopen", False):
                return
            self._reopen = False  # a copy (pickle, deepcopy): the log is opened again, for appending
            try:
                _io.check_write(self.path)
                self._fh = logdir.open_append(self.path)  # type: ignore[assignment]
            except OSError as exc:
                self._fail("open", exc)
                return
        try:
            _io.check_write(self.path)
            self._fh.write(json.dumps(_clean(obj), sort_keys=False) + "\n")
            self._fh.flush()
        except OSError as exc:
            self._fail("write", exc)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics:
            self._write(self._with_engine_step({"type": "metrics", "step": step, **metrics}))

    def log_event(self, event: dict[str, Any]) -> None:
        self._write(self._with_engine_step(event))

    def _with_engine_step(self, record: dict[str, Any]) -> dict[str, Any]:
        step = record.get("step")
        if self.step_fn is None or not isinstance(step, int) or record.get("type") == "start":
            return record
        try:
            return {**record, "engine_step": int(self.step_fn(step))}
        except Exception:  # noqa: BLE001  (the log never fails over an engine's step)
            return record

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``pickle``, ``copy.deepcopy`` of a guard): the open file is not copied; a copy
        opens the log again, in append mode, at its first record (a closed log stays closed)."""
        state = dict(self.__dict__)
        state["_reopen"] = self._fh is not None or bool(state.get("_reopen"))
        state["_fh"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is not None:
            self._write({"type": "summary", **summary})
        self._reopen = False
        if self._remote:
            self._flush_remote()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as exc:
                self._fail("close", exc)
            self._fh = None


def console_writer() -> Any:
    """The default console writer: ``tqdm.write`` (it clears and redraws every live tqdm bar, HF's and
    Lightning's included, so no line mixes a bar and a message) when tqdm is installed, else print."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers and lightning
        return None

    def write(line: str, stream: TextIO) -> None:
        tqdm.write(line, file=stream)
        stream.flush()

    return write


class ConsoleSink(Sink):
    """Readable lines: one per escalation step (its actions together), one per skip (at most one
    every ``skip_every`` steps; the others are counted into the next line), the halt, and a summary
    with the final LR multiplier, clip, skipped steps and the paths of the log (and report).

    Lines go through ``write(line, stream)``: default ``tqdm.write`` (so a progress bar is cleared
    first); an engine with another progress display hands its writer (Lightning's Rich bar)."""

    def __init__(self, stream: TextIO | None = None, prefix: str = "[gradguard]", *, write: Any = None,
                 skip_every: int = 50) -> None:
        self.stream = stream or sys.stderr
        self.prefix = prefix
        self.write = write if write is not None else console_writer()
        self.skip_every = skip_every
        self._pending: tuple[int, str, list[str]] | None = None  # (step, reason, action texts)
        self._last_skip: int | None = None
        self._skips_unprinted = 0
        #: ``(label, path)`` lines added to the summary by other parts (e.g. an HTML report writer).
        self.extra_paths: list[tuple[str, str]] = []

    def _print(self, line: str) -> None:
        # Every line is also an INFO record of the "gradguard" logger; the logger's level above
        # WARNING (logging.getLogger("gradguard").setLevel(logging.ERROR)) quiets the console.
        if errors.logger.getEffectiveLevel() > logging.WARNING:
            return
        errors.logger.info(line)
        line = f"{self.prefix} {line}"
        if self.write is not None:
            try:
                self.write(line, self.stream)
                return
            except Exception:  # noqa: BLE001 - a broken display never stops training
                pass
        print(line, file=self.stream, flush=True)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            step, reason, parts = pending
            self._print(f"step {step}: {'; '.join(parts)}{' <- ' + reason if reason else ''}")

    def log_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "action":
            params = ", ".join(f"{k}={_fmt(v)}" for k, v in event.get("params", {}).items())
            text = f"{event['name']}{' (' + params + ')' if params else ''}"
            step, reason = int(event.get("step") or 0), str(event.get("reason", ""))
            if self._pending is not None and self._pending[0] == step and self._pending[1] == reason:
                self._pending[2].append(text)
            else:
                self._flush()
                self._pending = (step, reason, [text])
        elif kind == "skip":
            step = int(event.get("step") or 0)
            if self._pending is not None and self._pending[0] == step:
                return  # the step's action line says why (rollback, halt...)
            self._flush()
            if self._last_skip is not None and step - self._last_skip < self.skip_every:
                self._skips_unprinted += 1
                return
            more = f" (+{self._skips_unprinted} skipped since step {self._last_skip})" if self._skips_unprinted else ""
            self._last_skip, self._skips_unprinted = step, 0
            self._print(f"step {step}: skipped <- {event.get('reason', '')}{more}")
        elif kind == "halt":
            self._flush()
            self._print(f"HALT at step {event['step']}: {event.get('message', '')}")

    def end_step(self, step: int) -> None:
        self._flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._flush()
        if not summary:
            return
        acts = ", ".join(f"{k} x{v}" for k, v in summary.get("actions", {}).items()) or "none"
        parts = [f"{summary.get('steps', 0)} steps, {summary.get('skipped', 0)} skipped, "
                 f"{summary.get('findings', 0)} findings, actions: {acts}"]
        if summary.get("lr_multiplier") is not None:
            lr = summary.get("final_lr")
            mult, now = summary["lr_multiplier"], summary.get("lr_multiplier_now")
            if now is not None and not math.isclose(float(now), float(mult), rel_tol=1e-9):
                # a re-warm-up still under way: the LR in force is below the level it ramps to
                parts.append(f"final LR x{_fmt(now)}" + (f" = {_fmt(lr)}" if lr is not None else "")
                             + f" (re-warming up to x{_fmt(mult)})")
            else:
                parts.append(f"final LR x{_fmt(mult)}" + (f" = {_fmt(lr)}" if lr is not None else ""))
        if summary.get("max_grad_norm") is not None:
            parts.append(f"clip {_fmt(summary['max_grad_norm'])}")
        self._print("summary: " + "; ".join(parts))
        paths = [("log", summary.get("log")), ("report", summary.get("report")), *self.extra_paths]
        for label, path in paths:
            if path:
                self._print(f"{label}: {path}")
        if summary.get("log") and not summary.get("report"):
            self._print(f"report: gradguard report {_quote(str(summary['log']))}")
        advice = summary.get("advice") or {}
        if advice.get("settings"):  # only when the guard had to change something
            for line in advice.get("lines", []):
                self._print(f"next run: {line}")


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path)


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


def alert_text(title: str, text: str, level: str) -> str:
    """One Markdown line for an alert (TensorBoard's equivalent of ``run.alert``)."""
    return f"**{level}** {title}: {text}"


class TensorBoardSink(Sink):
    """Metrics as TensorBoard scalars; actions and halts as text under ``gradguard/events`` (one
    text entry per step, one line per action: a rollback, an LR cut and a clip change of one step
    are three lines), alerts under ``gradguard/alerts``.

    ``log_dir``: a writer of its own. ``writer``: an engine's ``SummaryWriter`` (HF's
    ``TensorBoardCallback.tb_writer``, Lightning's ``TensorBoardLogger.experiment``): flushed, never
    closed; ``prefix`` is the engine's namespace for the keys (HF: ``train/``) and ``step_fn`` maps
    the guard's step to the engine's step. The cumulative per-action counts are scalars
    (``gradguard/action/<name>``). Once per run the sink writes the "training stability"
    custom-scalars layout (:func:`gradguard.dashboards.tensorboard_layout`, the CUSTOM SCALARS tab);
    ``layout=False`` leaves the writer's layout alone.

    ``lines`` (default): a colour per series in the multi-line charts. TensorBoard colours lines by
    run, so the series of those charts are also written into at most 7 runs inside the run's
    folder, ``<run>/gradguard-lines/<0-6>``, the n-th series of a chart in run ``n mod 7`` under
    the tag ``gradguard-lines/<chart>/<key without gradguard/>`` (as ``add_scalars`` does, bounded;
    see :mod:`gradguard._tblines`: no extra thread, no file left open), and the layout draws those.
    ``lines=False``: one run, the layout draws its keys (one colour per run)."""

    TEXT_TAG = "gradguard/events"

    def __init__(self, log_dir: str | None = None, flush_secs: int = 10, *, writer: Any = None, prefix: str = "",
                 step_fn: Any = None, layout: bool = True, lines: bool = True) -> None:
        self.prefix = prefix
        self.step_fn = step_fn
        self.owns_writer = writer is None
        if writer is None:
            if log_dir is None:
                from .errors import ConfigError

                raise ConfigError("gradguard: TensorBoardSink(log_dir=None, writer=None): nothing to write to. "
                                  "Fix: pass log_dir='runs/...' (or an existing SummaryWriter as writer=)")
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("gradguard: TensorBoardSink needs tensorboard. "
                                  "Fix: pip install 'gradguard[tensorboard]'") from exc
            writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)
        self.log_dir = log_dir if log_dir is not None else _writer_dir(writer)
        self._writer: Any = writer
        self._lines: tuple[int, list[str]] | None = None  # (step, the step's action lines not yet written)
        #: the line runs (None: ``lines=False``, or no folder known, or no tensorboard protos)
        self.line_runs: Any = self._line_runs(flush_secs) if lines else None
        if layout:
            from .dashboards import tensorboard_layout

            self._writer.add_custom_scalars(tensorboard_layout(prefix, lines=self.line_runs is not None))

    def _line_runs(self, flush_secs: float) -> Any:
        if not self.log_dir:
            return None
        try:
            from ._tblines import LineRuns

            return LineRuns(str(self.log_dir), flush_secs=flush_secs)
        except ImportError:  # a tensorboardX writer without tensorboard: one colour per run
            return None

    def _x(self, step: int) -> int:
        return int(self.step_fn(step)) if self.step_fn is not None else int(step)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        x = self._x(step)
        for k, v in metrics.items():
            self._writer.add_scalar(self.prefix + k, float(v), global_step=x)
        if not self.owns_writer:
            self._writer.flush()
        if self.line_runs is not None:
            self.line_runs.add(x, metrics)  # after the run's own keys: an OSError here leaves them written

    def engine_logged(self, step: int, metrics: dict[str, float]) -> None:
        """The engine wrote ``metrics`` into this writer itself (HF's ``report_to``): only their line runs."""
        if self._writer is not None and self.line_runs is not None:
            self.line_runs.add(self._x(step), metrics)

    def log_event(self, event: dict[str, Any]) -> None:
        if self._writer is None or event.get("type") not in ("action", "halt"):
            return
        step = int(event.get("step") or 0)
        if self._lines is not None and self._lines[0] != step:
            self._flush_text()
        if self._lines is None:
            self._lines = (step, [])
        self._lines[1].append(_event_text(event))

    def _flush_text(self) -> None:
        """The step's actions as one text entry (TensorBoard keeps one text per tag and step), one
        Markdown line each."""
        pending, self._lines = self._lines, None
        if pending is None or self._writer is None:
            return
        step, lines = pending
        self._writer.add_text(self.prefix + self.TEXT_TAG, "  \n".join(lines), global_step=self._x(step))

    def end_step(self, step: int) -> None:
        self._flush_text()

    def log_alert(self, level: str, title: str, text: str, step: int) -> None:
        if self._writer is None:
            return
        self._writer.add_text(self.prefix + M.ALERTS_TEXT, alert_text(title, text, level), global_step=self._x(step))
        self._writer.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        try:
            self._flush_text()
            if summary:
                text = "```\n" + json.dumps(_clean(summary), indent=1, default=str) + "\n```"
                self._writer.add_text(self.prefix + "gradguard/summary", text,
                                      global_step=self._x(int(summary.get("steps", 0) or 0)))
            self._writer.flush()
            if self.owns_writer:
                self._writer.close()
        finally:
            self._writer = None
            if self.line_runs is not None:
                self.line_runs.close()


def _writer_dir(writer: Any) -> str | None:
    """The folder of a ``SummaryWriter`` (torch's ``log_dir``, tensorboardX's ``logdir``)."""
    for name in ("log_dir", "logdir"):
        value = getattr(writer, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def _flatten(prefix: str, d: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            _flatten(key, v, out)
        elif v is not None:
            out[key] = v
    return out


class WandbSink(Sink):
    """Metrics to a Weights & Biases run; alerts as ``run.alert``; actions and halts as a
    ``gradguard/actions`` table and the guard's summary as ``gradguard/summary/...`` keys, both
    written at close. ``define_metric`` makes the run summary show the peak of the grad norms, loss
    scale and ladder level and the count of each action.

    Uses ``run``, else the active ``wandb.run``, else ``wandb.init(**init_kwargs)``; only a run it
    started itself is finished in ``close``. Inside an engine that already logs to the run (HF's
    ``report_to="wandb"``, Lightning's ``WandbLogger``) the adapter binds the sink to the engine's
    x axis (:meth:`bind`): rows then carry the engine's step key (``train/global_step``,
    ``trainer/global_step``) and prefix instead of W&B's own step, and the engine carries the
    regular rows. Unbound, W&B steps cannot go back: metrics for a step below the last one logged
    are logged without a step, so they join the run's current row instead of being dropped."""

    TABLE_KEY = "gradguard/actions"
    COLUMNS = ["step", "name", "reason", "params"]
    #: the events as separate points (a scatter chart over a ``step, loss, event`` table): W&B line
    #: plots join the sparse ``gradguard/event/<name>`` values into lines, a scatter chart does not.
    #: Logged with the row of a step with events, at most every ``POINTS_EVERY_S`` seconds, and at close.
    POINT_COLUMNS = ["step", "loss", "event"]
    POINTS_EVERY_S = 30.0
    MAX_POINTS = 5000
    #: key prefixes (below the engine's prefix) whose run summary is the peak: norms, the scale, the
    #: ladder level, and the cumulative action counts (their peak is the count)
    PEAKS = ("gradguard/grad_norm/", "gradguard/loss_scale", "gradguard/ladder_level", "gradguard/action/",
             "gradguard/skipped_steps", "gradguard/findings")

    def __init__(self, run: Any = None, *, step_key: str | None = None, prefix: str = "", step_fn: Any = None,
                 **init_kwargs: Any) -> None:
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
        self.step_key: str | None = step_key
        self.prefix = prefix
        self.step_fn: Any = step_fn
        self.engine_bound = step_key is not None
        self._last_step: int | None = None
        self._rows: list[list[Any]] = []
        self._closed = False
        self._defined: set[str] = set()
        self._define_failed = False
        self._points: list[list[Any]] = []
        self._points_logged = 0  # len(self._points) when the chart was last logged
        self._points_at: float | None = None  # time.monotonic() of that

    def bind(self, run: Any, *, step_key: str, prefix: str = "", step_fn: Any = None) -> WandbSink:
        """Write into an engine's run on its x axis: every row gets ``{step_key: engine step}``
        (``step_fn(guard step)``, default the guard's step) and keys get ``prefix``."""
        self.run = run
        self.step_key, self.prefix, self.step_fn = step_key, prefix, step_fn
        self.engine_bound = True
        self._defined = set()
        return self

    def _define(self, keys: Any = ()) -> None:
        """``define_metric`` for each new key with a peak summary, named one by one (W&B matches a
        glob only when no earlier glob, such as HF's ``*``, does)."""
        define = getattr(self.run, "define_metric", None)
        if define is None or self._define_failed:
            return
        for key in keys:
            if key in self._defined:
                continue
            self._defined.add(key)
            if not key[len(self.prefix):].startswith(self.PEAKS):
                continue
            try:
                if self.step_key:
                    define(key, summary="max", step_metric=self.step_key, step_sync=True)
                else:
                    define(key, summary="max")
            except Exception as exc:  # noqa: BLE001 - an older wandb: only the summaries are missing
                self._define_failed = True
                warn(f"gradguard: wandb define_metric failed ({exc}); run summaries show last values", stacklevel=3)
                return

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            return
        # W&B draws no point for nan/inf and a nan would poison the run summary's peak (max); the
        # step's event points and the JSONL log keep them visible
        row = {k: v for k, v in rename(metrics, self.prefix).items()
               if not (isinstance(v, float) and not math.isfinite(v))}
        self._define(row)
        x = int(self.step_fn(step)) if self.step_key is not None and self.step_fn is not None else int(step)
        self._add_points(x, metrics, row)
        if self.step_key is not None:
            row[self.step_key] = x
            self.run.log(row)
            return
        if self._last_step is not None and step < self._last_step:
            self.run.log(row)
            return
        self.run.log(row, step=step)
        self._last_step = step

    def _add_points(self, x: int, metrics: dict[str, float], row: dict[str, Any]) -> None:
        """Collect the step's event points; put the scatter chart into ``row`` when due."""
        start = M.EVENT + "/"
        for key, value in metrics.items():
            if key.startswith(start):
                self._points.append([x, float(value), key[len(start):]])
        if len(self._points) > self.MAX_POINTS:
            drop = len(self._points) - self.MAX_POINTS
            del self._points[:drop]
            self._points_logged = max(0, self._points_logged - drop)
        now = time.monotonic()
        due = self._points_at is None or now - self._points_at >= self.POINTS_EVERY_S
        if len(self._points) > self._points_logged and due:
            chart = self._points_chart()
            if chart is not None:
                row[self.prefix + M.EVENT_POINTS] = chart
            self._points_logged, self._points_at = len(self._points), now

    def _points_chart(self) -> Any:
        try:
            table = self._wandb.Table(columns=list(self.POINT_COLUMNS), data=[list(p) for p in self._points])
            return self._wandb.plot.scatter(table, "step", "loss", title="gradguard: events on the loss")
        except Exception as exc:  # noqa: BLE001 - a chart never stops training
            warn(f"gradguard: the wandb event chart failed ({exc})", stacklevel=4)
            return None

    def log_alert(self, level: str, title: str, text: str, step: int) -> None:
        if self._closed:
            return
        alert_level = getattr(getattr(self._wandb, "AlertLevel", None), level, level)
        try:
            self.run.alert(title=title, text=text, level=alert_level)
        except Exception as exc:  # noqa: BLE001 - an alert never stops training
            warn(f"gradguard: wandb alert failed ({exc})", stacklevel=3)

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
            # under the engine's prefix like every other key (HF: train/gradguard/actions)
            table = {self.prefix + self.TABLE_KEY: self._wandb.Table(columns=list(self.COLUMNS), data=self._rows)}
            self.run.log(table)
        if len(self._points) > self._points_logged:
            chart = self._points_chart()
            if chart is not None:
                self.run.log({self.prefix + M.EVENT_POINTS: chart})
        if summary:
            for k, v in _flatten("gradguard/summary", summary, {}).items():
                self.run.summary[k] = v
        if self.owns_run:
            self.run.finish()
