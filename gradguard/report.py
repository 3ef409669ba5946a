"""``gradguard report RUN_DIR -o report.html``: one self-contained HTML file from the JSONL event log.

Loss with event markers, a per-layer grad-norm heatmap (layer x step, log colour), clip / LR /
loss-scale timelines, the findings -> actions table, a written diagnosis and the advice for the
next run. Plots are plotly figures. Where plotly.js comes from (``plotlyjs=``):

* ``"directory"`` (default): ``plotly.min.js`` is written once per folder next to the report (4.8 MB,
  shared by every report in that folder) and referenced by a relative path: opens offline as long
  as the two files stay together;
* ``"inline"``: embedded in the HTML: one self-contained file (about 5 MB) that opens offline
  anywhere (to mail or attach);
* ``"cdn"``: loaded from the plotly CDN: the smallest file, needs network to open.
"""

from __future__ import annotations

import glob
import html
import json
import math
import os
from collections.abc import Iterable
from typing import Any

from ._io import atomic_write
from .advice import UNSTABLE_ACTIONS, advise_from_records
from .errors import ConfigError
from .measure import metric_key
from .sinks import M

__all__ = ["find_log", "read_log", "diagnose", "pre_instability_level", "build_report", "write_report", "PLOTLYJS_MODES"]

PLOTLYJS_MODES = ("directory", "inline", "cdn")
"""Where the report's plotly.js comes from (see the module docstring)."""
PLOTLYJS_FILE = "plotly.min.js"

_SEVERE = ("warning", "critical")


def find_log(run_dir: str) -> str:
    """The event log of a run: ``run_dir`` itself if it is a file, else ``events.jsonl`` in it or in
    its ``gradguard`` / ``gradguard_runs`` folder, else the newest ``events*.jsonl`` there."""
    if os.path.isfile(run_dir):
        return run_dir
    if not os.path.isdir(run_dir):
        raise ConfigError(f"gradguard report: RUN_DIR={run_dir!r} does not exist. Fix: pass the run's output folder "
                          "or its events.jsonl")
    for sub in ("", "gradguard", "gradguard_runs"):
        path = os.path.join(run_dir, sub, "events.jsonl")
        if os.path.isfile(path):
            return path
    found = sorted(glob.glob(os.path.join(run_dir, "**", "events*.jsonl"), recursive=True), key=os.path.getmtime)
    if not found:
        raise ConfigError(f"gradguard report: no events*.jsonl under RUN_DIR={run_dir!r}. Fix: pass the folder "
                          "given as the guard's output dir (output.dir / out_dir) or the log file itself")
    return found[-1]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)  # "nan" / "inf" strings come back as floats
    except (TypeError, ValueError):
        return None


def read_log(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL log; a truncated last line (a killed run) is ignored."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


class _Run:
    """The records of one run, sorted out for plotting."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        starts = [i for i, r in enumerate(records) if r.get("type") == "start"]
        if len(starts) > 1:  # an appended log (several runs in one file): report the last run
            records = records[starts[-1]:]
        self.records = records
        self.start = next((r for r in records if r.get("type") == "start"), {})
        self.metrics = sorted((r for r in records if r.get("type") == "metrics"), key=lambda r: r.get("step", 0))
        self.findings = [r for r in records if r.get("type") == "finding"]
        self.actions = [r for r in records if r.get("type") == "action"]
        self.skips = [r for r in records if r.get("type") == "skip"]
        self.halts = [r for r in records if r.get("type") == "halt"]
        self.summary = next((r for r in reversed(records) if r.get("type") == "summary"), None)
        layers = self.start.get("layers") or []
        self.layer_keys = {metric_key(n): n for n in layers}  # metric key -> layer name
        if not self.layer_keys:  # an old log without start layers: from the metric names
            prefix = M.GRAD_NORM_LAYER + "/"
            keys = {k[len(prefix):] for r in self.metrics for k in r if k.startswith(prefix)} - {"total"}
            self.layer_keys = {k: k for k in sorted(keys)}

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        xs, ys = [], []
        for r in self.metrics:
            if key in r:
                xs.append(int(r["step"]))
                v = _num(r[key])
                ys.append(v if v is not None and math.isfinite(v) else None)
        return xs, ys

    def prefixed(self, prefix: str) -> list[str]:
        keys: dict[str, None] = {}
        for r in self.metrics:
            for k in r:
                if k.startswith(prefix + "/"):
                    keys[k] = None
        return list(keys)

    def loss_at(self, step: int) -> float | None:
        best = None
        for r in self.metrics:
            if int(r["step"]) > step:
                break
            v = _num(r.get(M.LOSS))
            if v is not None and math.isfinite(v):
                best = v
        return best


# -- the written diagnosis ------------------------------------------------------------------------------
_WHAT = {"loss_spike": "the loss spiked", "grad_spike": "the gradient norm exploded",
         "nonfinite_loss": "the loss became non-finite", "nonfinite_grad": "gradients became non-finite",
         "norm_takeover": "a normalisation layer's gradient took over", "scale_collapse": "the loss scale collapsed",
         "overflow_streak": "fp16 overflows repeated"}
# kinds where the named layers' gradients really blew up (a quiet norm takeover with a falling loss did not)
_EXPLOSIVE = ("grad_spike", "nonfinite_grad")


def pre_instability_level(run_records: Iterable[dict[str, Any]]) -> float | None:
    """The loss level before the instability: the loss-spike detector's own baseline (its recent
    loss) when the first finding is a loss spike, else the median of the last 10 step losses before
    the first finding of any kind (never a spike's own loss). None without such losses."""
    run = run_records if isinstance(run_records, _Run) else _Run(list(run_records))
    if not run.findings:
        return None
    first = min(run.findings, key=lambda f: int(f.get("step", 0)))
    step0 = int(first.get("step", 0))
    if first.get("kind") == "loss_spike":
        base = _num(first.get("baseline"))
        if base is not None and math.isfinite(base):
            return base
    skipped = {int(r.get("step", -1)) for r in run.skips}
    before = [v for x, v in zip(*run.series(M.LOSS)) if x < step0 and x not in skipped and v is not None][-10:]
    if not before:
        return None
    return sorted(before)[len(before) // 2]


def _what_the_guard_did(run: _Run) -> list[str]:
    """One phrase per corrective action, in order."""
    did: list[str] = []
    for a in run.actions:
        if a.get("name") not in UNSTABLE_ACTIONS:
            continue
        p = a.get("params") or {}
        if a["name"] == "rollback" and "to_step" in p:
            did.append(f"rolled back to step {p['to_step']} at step {a['step']}")
        elif a["name"] == "lower_lr" and "to" in p:
            did.append(f"LR x{_num(p['to']):.3g} at step {a['step']}")
        elif a["name"] == "tighten_clip" and "to" in p:
            did.append(f"clip tightened to {_num(p['to']):.3g} at step {a['step']}")
        elif a["name"] == "adam" and "unavailable" not in p:
            did.append(f"Adam beta2/eps adjusted at step {a['step']}")
        elif a["name"] == "lower_layer_lr":
            did.append("layer LR lowered for " + ", ".join(k for k in p if k != "rung") + f" at step {a['step']}")
        elif a["name"] == "shrink_batch" and "batch" in p:
            did.append(f"batch shrunk to {p['batch'][1]} at step {a['step']}")
        elif a["name"] != "halt":
            did.append(f"{a['name']} at step {a['step']}")
    return did


def diagnose(records: Iterable[dict[str, Any]]) -> list[str]:
    """A few sentences on what happened: where it started, what the guard did, whether it recovered.

    Each sentence is checked against the event log: "Recovered by step N" only when the loss of a
    step after the last instability and after the last rollback is at or below the pre-instability
    level (:func:`pre_instability_level`: the loss before the first finding, not the spike)."""
    run = _Run(list(records))
    out: list[str] = []
    severe = [f for f in run.findings if f.get("severity") in _SEVERE]
    steps = int((run.summary or {}).get("steps") or (run.metrics[-1]["step"] if run.metrics else 0))
    if not severe and not run.halts:
        skipped = len(run.skips)
        out.append(f"No instability in {steps} steps" + (f"; {skipped} odd steps skipped." if skipped else "."))
        return out
    first = severe[0] if severe else run.halts[0]
    step0 = int(first.get("step", 0))
    kind = str(first.get("kind", ""))
    layers = first.get("layers") or first.get("moved_layers") or []
    what = _WHAT.get(kind, kind or "instability")
    if first.get("layers") and kind in _EXPLOSIVE:
        out.append(f"{', '.join(layers[:3])} exploded first at step {step0} ({what}: {first.get('message', '')}).")
    elif first.get("layers"):
        out.append(f"First instability at step {step0}: {what} in {', '.join(layers[:3])} "
                   f"({first.get('message', '')}).")
    elif layers:
        out.append(f"First instability at step {step0}: {what} ({first.get('message', '')}); the layers whose "
                   f"grad norm moved most: {', '.join(layers[:3])}.")
    else:
        out.append(f"First instability at step {step0}: {what} ({first.get('message', '')}).")
    did = _what_the_guard_did(run)
    if did:
        out.append("The guard " + "; ".join(did) + ".")
    if run.skips:
        out.append(f"{len(run.skips)} steps skipped ({', '.join(sorted({s.get('reason', '') for s in run.skips})[:3])}).")
    if run.halts:
        h = run.halts[-1]
        out.append(f"Halted at step {h.get('step')}: {h.get('message', '')}.")
        return out
    last = int(severe[-1].get("step", step0)) if severe else step0
    rollbacks = [int(a.get("step", 0)) for a in run.actions if a.get("name") == "rollback"]
    settled = max([last, *rollbacks])
    skipped = {int(r.get("step", -1)) for r in run.skips}
    ref = pre_instability_level(run)
    after = [(x, v) for x, v in zip(*run.series(M.LOSS)) if x > settled and x not in skipped and v is not None]
    if ref is not None and after:
        back = next((x for x, v in after if v <= ref), None)
        if back is not None:
            out.append(f"Recovered by step {back} (loss back to its pre-instability level {ref:.3g}); "
                       f"no instability after step {last} ({steps - last} steps).")
        else:
            out.append(f"No instability after step {last}, but the loss ({after[-1][1]:.3g}) has not returned to "
                       f"its pre-instability level ({ref:.3g}).")
    else:
        out.append(f"No instability after step {last} (of {steps}).")
    return out


# -- the figures --------------------------------------------------------------------------------------
def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError as exc:
        raise ImportError("gradguard report needs plotly. Fix: pip install 'gradguard[report]'") from exc
    return go, make_subplots


_PALETTE = {"rollback": "#d62728", "lower_lr": "#ff7f0e", "tighten_clip": "#9467bd", "adam": "#8c564b",
            "lower_layer_lr": "#e377c2", "shrink_batch": "#17becf", "halt": "#000000", "skip": "#7f7f7f",
            "recover_lr": "#2ca02c", "lift_lr": "#98df8a", "recut_lr": "#ffbb78", "relax_clip": "#bcbd22"}


def _loss_figure(run: _Run) -> Any:
    go, _ = _plotly()
    fig = go.Figure()
    xs, ys = run.series(M.LOSS)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="loss", line={"color": "#1f77b4"}))
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in run.actions:
        groups.setdefault(a.get("name", "?"), []).append(a)
    for s in run.skips:
        groups.setdefault("skip", []).append(s)
    for h in run.halts:
        groups.setdefault("halt", []).append(h)
    for name, evs in groups.items():
        ex = [int(e.get("step", 0)) for e in evs]
        ey = [run.loss_at(x) for x in ex]
        text = [f"step {e.get('step')}: {name} {json.dumps(e.get('params', {}))}<br>{e.get('reason', e.get('message', ''))}"
                for e in evs]
        fig.add_trace(go.Scatter(x=ex, y=ey, mode="markers", name=name, text=text, hoverinfo="text",
                                 marker={"size": 11, "symbol": "x" if name == "skip" else "diamond",
                                         "color": _PALETTE.get(name, "#333")}))
    fig.update_layout(title="Loss with gradguard's events", xaxis_title="optimizer step", yaxis_title="loss",
                      height=420, margin={"l": 60, "r": 20, "t": 50, "b": 40})
    return fig


def _heatmap_figure(run: _Run) -> Any:
    go, _ = _plotly()
    steps = [int(r["step"]) for r in run.metrics]
    names, z = [], []
    for key, layer in run.layer_keys.items():
        metric = f"{M.GRAD_NORM_LAYER}/{key}"
        row = []
        for r in run.metrics:
            v = _num(r.get(metric))
            row.append(math.log10(v) if v is not None and math.isfinite(v) and v > 0 else None)
        if any(v is not None for v in row):
            names.append(layer)
            z.append(row)
    fig = go.Figure(go.Heatmap(x=steps, y=names, z=z, colorscale="Viridis", colorbar={"title": "log10 norm"},
                               hovertemplate="step %{x}<br>%{y}<br>log10 grad norm %{z:.2f}<extra></extra>"))
    fig.update_layout(title="Per-layer gradient norm (log colour)", xaxis_title="optimizer step",
                      height=max(300, 60 + 22 * len(names)), margin={"l": 160, "r": 20, "t": 50, "b": 40})
    return fig


def _timelines_figure(run: _Run) -> Any:
    go, make_subplots = _plotly()
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=("total grad norm vs clip threshold (log)", "applied vs scheduled LR, multiplier (log)",
                                        "loss scale (fp16)", "ladder level and skipped steps"))

    def line(key: str, row: int, name: str, dash: str | None = None, secondary: bool = False) -> None:
        xs, ys = run.series(key)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, line={"dash": dash} if dash else {}),
                          row=row, col=1)

    line(M.GRAD_NORM, 1, "grad norm")
    line(M.MAX_NORM, 1, "max_grad_norm", dash="dash")
    fig.update_yaxes(type="log", row=1, col=1)
    for key in run.prefixed(M.LR):
        line(key, 2, key.rsplit("/", 1)[-1] + " LR (applied)")
    for key in run.prefixed(M.LR_SCHEDULED):
        line(key, 2, key.rsplit("/", 1)[-1] + " LR (scheduled)", dash="dash")
    line(M.LR_MULT, 2, "LR multiplier", dash="dot")
    fig.update_yaxes(type="log", row=2, col=1)
    line(M.SCALE, 3, "loss scale")
    line(M.OVERFLOW, 3, "overflow", dash="dot")
    if not run.series(M.SCALE)[0]:
        lo, hi = fig.layout.yaxis3.domain  # paper coordinates: plotly.js draws no axes for an empty subplot
        fig.add_annotation(text="no loss scale logged (no fp16 GradScaler in this run)", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=(lo + hi) / 2)
    line(M.LEVEL, 4, "ladder level")
    line(M.SKIPPED, 4, "skipped steps", dash="dot")
    fig.update_layout(height=900, margin={"l": 60, "r": 20, "t": 50, "b": 40})
    fig.update_xaxes(title_text="optimizer step", row=4, col=1)
    return fig


# -- the HTML -----------------------------------------------------------------------------------------
def _table(run: _Run) -> str:
    by_id = {f.get("id"): f for f in run.findings}
    rows = []
    for a in run.actions + run.halts:
        ids = a.get("finding_ids") or []
        causes = "<br>".join(html.escape(_finding_text(by_id[i])) for i in ids if i in by_id)
        causes = causes or html.escape(a.get("reason", "") or "")
        name = a.get("name", "HALT" if a.get("type") == "halt" else "?")
        params = json.dumps(a.get("params", {}), default=str) if a.get("type") == "action" else a.get("message", "")
        rows.append(f"<tr><td>{a.get('step')}</td><td>{causes}</td><td><b>{html.escape(name)}</b></td>"
                    f"<td><code>{html.escape(str(params))}</code></td></tr>")
    if not rows:
        return "<p>No actions.</p>"
    return ("<table class='gg'><thead><tr><th>step</th><th>findings</th><th>action</th><th>parameters</th></tr>"
            "</thead><tbody>" + "".join(rows) + "</tbody></table>")


def _finding_text(f: dict[str, Any]) -> str:
    text = f"#{f.get('id')} {f.get('kind')} ({f.get('severity')}): {f.get('message', '')}"
    if f.get("layers"):
        text += f" [layers: {', '.join(f['layers'])}]"
    elif f.get("moved_layers"):
        text += f" [grad norm moved most: {', '.join(f['moved_layers'])}]"
    return text


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table.gg{border-collapse:collapse;font-size:13px}
table.gg td,table.gg th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}
.diag{background:#f6f8fa;border-left:4px solid #d62728;padding:8px 14px}.meta{color:#666;font-size:12px}"""


def build_report(records: list[dict[str, Any]], title: str = "gradguard report", *,
                 plotlyjs: str = "inline") -> str:
    """The HTML text of the report. ``plotlyjs``: ``"inline"`` (embedded, no external resource),
    ``"directory"`` (a ``<script src="plotly.min.js">`` next to the file; :func:`write_report`
    writes that file) or ``"cdn"``."""
    if plotlyjs not in PLOTLYJS_MODES:
        raise ConfigError(f"gradguard report: plotlyjs={plotlyjs!r} is not one of {', '.join(PLOTLYJS_MODES)}")
    run = _Run(records)
    figs = [("loss", _loss_figure(run)), ("heatmap", _heatmap_figure(run)), ("timelines", _timelines_figure(run))]
    parts = []
    first = {"inline": True, "cdn": "cdn", "directory": False}[plotlyjs]
    for i, (name, fig) in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=first if i == 0 else False, div_id=f"gg-{name}",
                                 config={"displaylogo": False, "responsive": True}))
    if plotlyjs == "directory":
        parts[0] = f'<script charset="utf-8" src="{PLOTLYJS_FILE}"></script>' + parts[0]
    diag = "".join(f"<li>{html.escape(s)}</li>" for s in diagnose(run.records))
    advice = advise_from_records(run.records)
    adv = "".join(f"<li>{html.escape(s)}</li>" for s in advice["lines"])
    versions = ", ".join(f"{k} {v}" for k, v in (run.start.get("versions") or {}).items())
    s = run.summary or {}
    meta = (f"{s.get('steps', '?')} steps, {s.get('skipped', len(run.skips))} skipped, "
            f"{s.get('findings', len(run.findings))} findings; {versions}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><p class='meta'>{html.escape(meta)}</p>"
            f"<h2>Diagnosis</h2><ul class='diag' id='gg-diagnosis'>{diag}</ul>"
            f"<h2>Advice for the next run</h2><ul id='gg-advice'>{adv}</ul>"
            f"{parts[0]}<h2>Per-layer gradient norms</h2>{parts[1]}<h2>Timelines</h2>{parts[2]}"
            f"<h2>Findings &rarr; actions</h2><div id='gg-table'>{_table(run)}</div></body></html>")


def write_report(run_dir: str, out: str | None = None, *, plotlyjs: str = "directory") -> str:
    """Write the report of the run whose log is in ``run_dir`` (or is ``run_dir``); returns its path
    (default: ``report.html`` next to the log). ``plotlyjs="directory"`` (default) also writes
    ``plotly.min.js`` into the report's folder unless it is there already; ``"inline"`` makes one
    self-contained file; ``"cdn"`` loads plotly.js from the network."""
    log = find_log(run_dir)
    records = read_log(log)
    if not any(r.get("type") in ("start", "metrics") for r in records):
        raise ConfigError(f"gradguard report: {log} holds no gradguard records. Fix: pass a gradguard events.jsonl")
    out = out or os.path.join(os.path.dirname(os.path.abspath(log)), "report.html")
    text = build_report(records, title=f"gradguard report: {os.path.basename(os.path.dirname(os.path.abspath(log)))}"
                        f"/{os.path.basename(log)}", plotlyjs=plotlyjs)
    folder = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(folder, exist_ok=True)
    if plotlyjs == "directory":
        _write_plotlyjs(folder)
    atomic_write(out, text, fsync=False)  # a random temp name, then a rename: never through a planted link
    return out


def _write_plotlyjs(folder: str) -> str:
    """``plotly.min.js`` of the installed plotly in ``folder``, once (kept when it is there and of the
    same size); written to a temporary name first so a reader never sees half a file."""
    from plotly.offline import get_plotlyjs

    path = os.path.join(folder, PLOTLYJS_FILE)
    js = get_plotlyjs()
    if os.path.isfile(path) and os.path.getsize(path) == len(js.encode("utf-8")):
        return path
    atomic_write(path, js, fsync=False)
    return path
