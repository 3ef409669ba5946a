"""Reporting: everything the guard tells the outside world, in one object.

:class:`Reporter` owns the sinks (JSONL, console, TensorBoard, W&B, an engine's own), the event
stream (findings, actions, skips, halts), the metric rows, the alerts, the diagnosis written on a
halt and the summary (with the advice for the next run) written at the end. A sink that fails
(its service gone, its folder replaced by a file) never stops training: the failure is warned
once and becomes a ``sink_error`` event for the other sinks.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from .advice import ADVICE_ACTIONS, ADVICE_LOG_SIZE, advise
from .config import RUNG_ACTIONS, GuardConfig
from .detect import Finding
from .errors import is_rank0, warn
from .logdir import event_log_dir, is_url, join, write_text
from .measure import metric_key
from .policy import Action
from .sinks import EVENT_SCHEMA_VERSION, ConsoleSink, JSONLSink, M, Sink, _clean, package_versions

__all__ = ["Reporter", "event_log_path", "optimizer_info"]


def event_log_path(out_dir: str | None) -> str:
    """The JSONL event log: ``<event_log_dir(out_dir)>/events.jsonl``, or without ``out_dir``
    ``./gradguard_runs/events-<timestamp>-<pid>.jsonl``."""
    if out_dir is not None:
        return join(event_log_dir(out_dir), "events.jsonl")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.getcwd(), "gradguard_runs", f"events-{stamp}-{os.getpid()}.jsonl")


def optimizer_info(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class and each group's base LR (``initial_lr`` where a scheduler set one),
    betas, eps and weight decay: the settings the advice for the next run starts from."""
    groups = []
    for g in getattr(optimizer, "param_groups", []):
        entry: dict[str, Any] = {}
        values = {"lr": g.get("initial_lr", g.get("lr")), "eps": g.get("eps"),
                  "weight_decay": g.get("weight_decay"), "momentum": g.get("momentum")}
        for key, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                entry[key] = float(v)
        betas = g.get("betas")
        if isinstance(betas, (tuple, list)) and all(isinstance(b, (int, float)) for b in betas):
            entry["betas"] = [float(b) for b in betas]
        groups.append(entry)
    return {"class": type(optimizer).__name__, "groups": groups}


class Reporter:
    """Sinks, events, metrics, alerts, diagnosis and summary of one guarded run."""

    def __init__(self, config: GuardConfig, sinks: list[Sink] | None, out_dir: str | None) -> None:
        self.config = config
        self.sinks: list[Sink] = list(sinks or [])
        self.out_dir = out_dir if out_dir is not None else config.output.dir
        self.log_path: str | None = None
        if config.output.jsonl:
            self.log_path = event_log_path(self.out_dir)
            self.sinks.append(JSONLSink(self.log_path))
        if config.output.console:
            self.sinks.append(ConsoleSink())
        for sink in self.sinks:  # the event log's I/O errors become events for the other sinks
            if isinstance(sink, JSONLSink):
                sink.on_error = self.emit
        self.n_findings = 0
        self.action_counts: Counter[str] = Counter()
        self.culprits: Counter[str] = Counter()
        self.recent_findings: deque[dict[str, Any]] = deque(maxlen=50)
        self.action_log: deque[dict[str, Any]] = deque(maxlen=10_000)  # for the advice at close
        self.cause_ids: list[int] = []  # ids of the findings that the step's actions answer
        self.last_finite_loss: float | None = None
        self.report_path: str | None = None  # an HTML report written for this run (shown in the summary)
        self.diagnosis_path: str | None = None
        self._alert_last: int | None = None
        self._alerts_held = 0
        self._failed: set[int] = set()  # sinks that failed once (warned once each)
        self._closed = False

    # -- the sinks, each call absorbed ----------------------------------------------------------
    def _call(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a sink never stops training
            if id(sink) in self._failed:
                return
            self._failed.add(id(sink))
            text = f"{type(exc).__name__}: {exc}"[:300]
            warn(f"gradguard: {type(sink).__name__}.{method} failed ({text}); training goes on, this sink may "
                 "miss records from now on", stacklevel=3)
            event = {"type": "sink_error", "step": args[0] if method == "log_metrics" else None,
                     "sink": type(sink).__name__, "call": method, "error": text, "time": time.time()}
            for other in self.sinks:
                if other is not sink:
                    self._call(other, "log_event", event)

    def emit(self, event: dict[str, Any]) -> None:
        """Send an event to every sink."""
        event.setdefault("time", time.time())
        for s in self.sinks:
            self._call(s, "log_event", event)

    def start(self, layers: list[str], optimizer: dict[str, Any], engine: str = "plain") -> None:
        self.optimizer_at_start = optimizer
        self.start_event = {"type": "start", "step": 0, "schema_version": EVENT_SCHEMA_VERSION, "engine": engine,
                            "versions": package_versions(), "layers": layers, "optimizer": optimizer,
                            "config": self.config.to_dict()}
        self.emit(dict(self.start_event))

    def open_event_log(self, path: str) -> JSONLSink | None:
        """An event log opened after the start (an engine's run folder known only then: the W&B
        run's files): it begins with the run's ``start`` record and becomes the run's log (the
        summary names it). None when it cannot be opened (warned by the sink)."""
        sink = JSONLSink(path)
        if sink.error is not None:
            return None
        sink.on_error = self.emit
        self._call(sink, "log_event", {**self.start_event, "time": time.time()})
        self.sinks.append(sink)
        self.log_path = path
        return sink

    def log_row(self, step: int, row: dict[str, float], *, due: bool, events: bool,
                engine_logs: bool | None) -> None:
        """``engine_logs``: see ``GuardCore.after_step``."""
        for s in self.sinks:
            if s.engine_bound and engine_logs is not None:
                if events and not engine_logs:
                    self._call(s, "log_metrics", step, row)  # an event step the engine does not log
            elif due or events:
                self._call(s, "log_metrics", step, row)

    def send_live(self, step: int, metrics: dict[str, float]) -> None:
        """Send a row to the engine-bound sinks only."""
        if metrics:
            for s in self.sinks:
                if s.engine_bound:
                    self._call(s, "log_metrics", step, metrics)

    def engine_logged(self, step: int, metrics: dict[str, float]) -> None:
        """The engine logged ``metrics`` itself at ``step``: tell the engine-bound sinks."""
        if metrics:
            for s in self.sinks:
                if s.engine_bound:
                    self._call(s, "engine_logged", step, metrics)

    def end_step(self, step: int) -> None:
        for s in self.sinks:
            self._call(s, "end_step", step)

    def add_sinks(self, sinks: list[Sink]) -> None:
        for sink in sinks:
            if sink not in self.sinks:
                self.sinks.append(sink)

    def set_console_writer(self, write: Callable[[str, Any], None]) -> None:
        for s in self.sinks:
            if isinstance(s, ConsoleSink):
                s.write = write

    def set_engine_step(self, fn: Callable[[int], int]) -> None:
        for sink in self.sinks:
            if isinstance(sink, JSONLSink):
                sink.step_fn = fn

    # -- findings and actions ---------------------------------------------------------------------
    def findings(self, findings: list[Finding]) -> None:
        """Log the step's findings; the actions recorded next answer them (``finding_ids``)."""
        self.cause_ids = []
        for f in findings:
            self.n_findings += 1
            self.culprits.update(f.layers)
            fd = {"type": "finding", "id": self.n_findings, **f.to_dict()}
            self.cause_ids.append(self.n_findings)
            self.recent_findings.append(fd)
            self.emit(fd)

    def take_causes(self) -> list[int]:
        """The step's finding ids; actions recorded after this answer none (relaxations, growth)."""
        ids, self.cause_ids = self.cause_ids, []
        return ids

    def record(self, a: Action) -> Action:
        """Count and log an action."""
        self.action_counts[a.name] += 1
        event = {"type": "action", **a.to_dict(), "finding_ids": list(self.cause_ids)}
        self.action_log.append(event)
        self.emit(event)
        return a

    # -- metric rows ------------------------------------------------------------------------------
    def metrics(self, report: Any, *, skipped: int, level: int, max_norm: float | None,
                lrs: list[float]) -> dict[str, float]:
        m: dict[str, float] = {M.GRAD_NORM: report.total_norm, M.LR_MULT: report.lr_multiplier,
                               M.SKIPPED: float(skipped), M.FINDINGS: float(self.n_findings), M.LEVEL: float(level)}
        if report.loss is not None:
            m[M.LOSS] = report.loss
        if max_norm is not None:
            m[M.MAX_NORM] = max_norm
        if report.scale is not None:
            m[M.SCALE] = report.scale
            m[M.OVERFLOW] = float(report.overflow)
        for name, v in report.layer_norms.items():
            m[f"{M.GRAD_NORM_LAYER}/{metric_key(name)}"] = v
        for i, lr in enumerate(lrs):  # the LR applied at this step: the scheduler's x the multiplier
            applied = lr * report.lr_multiplier
            m[f"{M.LR}/group{i}"] = applied
            if applied > 0 and math.isfinite(applied):  # an LR of 0 (a warm-up's first step) has no log
                m[f"{M.LR_LOG10}/group{i}"] = math.log10(applied)
            m[f"{M.LR_SCHEDULED}/group{i}"] = lr
        for name, c in self.action_counts.items():
            m[f"{M.ACTION}/{name}"] = float(c)
        return m

    def event_metrics(self, report: Any) -> dict[str, float]:
        """``gradguard/event/<name>`` for each finding kind, action, skip and halt of the step; the
        value is the step's loss (the last finite one when it is not), so the points sit on the
        loss curve when overlaid."""
        if report.loss is not None and math.isfinite(report.loss):
            self.last_finite_loss = report.loss
        names = [f.kind for f in report.findings] + [a.name for a in report.actions]
        if report.skipped and not report.halt:
            names.append("skip")
        if report.halt:
            names.append("halt")
        if not names:
            return {}
        y = report.loss if report.loss is not None and math.isfinite(report.loss) else self.last_finite_loss
        y = 0.0 if y is None else float(y)
        return {f"{M.EVENT}/{n}": y for n in dict.fromkeys(names)}

    # -- alerts -----------------------------------------------------------------------------------
    def alert(self, report: Any, lr_mult: float, max_norm: float) -> None:
        """``ERROR`` on a halt, ``WARN`` on a rollback or escalation (rate-limited by ``output.alert_every``)."""
        escalations = [a for a in report.actions if a.name in RUNG_ACTIONS and a.name != "halt"]
        if report.halt:
            level, title = "ERROR", "gradguard: training halted"
        elif escalations:
            rollback = any(a.name == "rollback" for a in escalations)
            level, title = "WARN", "gradguard: rollback" if rollback else "gradguard: escalation"
            if self._alert_last is not None and report.step - self._alert_last < self.config.output.alert_every:
                self._alerts_held += 1
                return
        else:
            return
        layers = sorted({n for f in report.findings for n in f.layers}) or [n for n, _ in self.culprits.most_common(3)]
        if report.halt and report.diagnosis:
            reason = str(report.diagnosis.get("reason", ""))
        else:
            reason = next((a.reason for a in escalations if a.reason), "")
        acts = ", ".join(a.name for a in escalations) or "halt"
        text = (f"step {report.step}: {reason}. Actions: {acts}. Culprit layers: {', '.join(layers) or 'none named'}. "
                f"LR x{lr_mult:.4g}, clip {max_norm:.4g}.")
        if self._alerts_held:
            text += f" ({self._alerts_held} more since the last alert.)"
        self._alert_last, self._alerts_held = report.step, 0
        for s in self.sinks:
            self._call(s, "log_alert", level, title, text, report.step)

    # -- diagnosis and summary --------------------------------------------------------------------
    def diagnosis(self, report: Any, reason: str, state: dict[str, Any]) -> dict[str, Any]:
        """``state``: the run's counters and settings now (see ``GuardCore.run_state``)."""
        return {
            "step": report.step, "reason": reason, "loss": report.loss, "grad_norm": report.total_norm,
            "culprit_layers": [n for n, _ in self.culprits.most_common(8)],
            "actions_tried": dict(self.action_counts), "skipped_steps": state["skipped"],
            "lr_multiplier": state["lr_multiplier"], "max_grad_norm": state["max_grad_norm"],
            "recent_findings": list(self.recent_findings)[-10:],
            "advice": self.summary(state)["advice"],
        }

    def write_diagnosis(self, diagnosis: dict[str, Any], folder: str | None = None) -> str | None:
        """Write ``diagnosis.json`` (next to the event log unless ``folder``; on rank 0 only)."""
        if folder is None:
            if self.log_path is not None:
                folder = self.log_path.rsplit("/", 1)[0] if is_url(self.log_path) else os.path.dirname(self.log_path)
            elif self.out_dir is not None:
                folder = event_log_dir(self.out_dir)
        if folder is None or not is_rank0():
            return None
        path = join(folder, "diagnosis.json")
        try:
            write_text(path, json.dumps(_clean(diagnosis), indent=2))
        except OSError as exc:  # the diagnosis is also in the halt event
            warn(f"gradguard: could not write {path} ({exc})", stacklevel=3)
            return None
        self.diagnosis_path = path
        return path

    def summary(self, state: dict[str, Any]) -> dict[str, Any]:
        out = {"steps": state["steps"], "applied": state["applied"], "skipped": state["skipped"],
               "findings": self.n_findings, "actions": dict(self.action_counts),
               "lr_multiplier": state["lr_multiplier"], "lr_multiplier_now": state["lr_multiplier_now"],
               "final_lr": state["final_lr"], "max_grad_norm": state["max_grad_norm"], "log": self.log_path,
               "report": self.report_path}
        out["advice"] = advise(actions=list(self.action_log), summary=out, config=self.config.to_dict(),
                               optimizer=self.optimizer_at_start, engine=state.get("engine"))
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, summary: dict[str, Any]) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self.sinks:
            self._call(s, "close", summary)

    # -- state ------------------------------------------------------------------------------------
    def advice_log(self) -> list[dict[str, Any]]:
        kept = [a for a in self.action_log if a.get("name") in ADVICE_ACTIONS][-ADVICE_LOG_SIZE:]
        return [_clean({"name": a["name"], "step": a.get("step"),
                        "params": {k: v for k, v in (a.get("params") or {}).items()
                                   if k not in ("skipped_indices", "preceding_indices")}}) for a in kept]

    def load_counts(self, state: dict[str, Any]) -> None:
        self.n_findings = state["n_findings"]
        self.action_counts = Counter(state["action_counts"])
        self.culprits = Counter(state["culprits"])
        self.action_log = deque((dict(a) for a in state.get("action_log") or []
                                 if isinstance(a, dict) and isinstance(a.get("name"), str)),
                                maxlen=self.action_log.maxlen)
