"""Ready dashboards, as code: a W&B "training stability" workspace and a TensorBoard custom-scalars layout.

Both are built from the metric names in :class:`gradguard.sinks.M` (the one source of truth) and
one list of panels, :func:`panels`. The TensorBoard sink writes :func:`tensorboard_layout` once per
run; ``gradguard dashboard wandb --entity E --project P`` saves :func:`wandb_workspace` to W&B
(``--dry-run`` writes :func:`wandb_workspace_spec` without a server).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .names import M

__all__ = ["Panel", "EVENT_POINTS", "ANY_PREFIX", "LR_CHART", "LR_LOG10_CHART", "LINES_TAG", "LINES_DIR", "LINE_CHARTS",
           "LINE_COLOURS", "panels", "line_charts", "tensorboard_layout", "wandb_workspace", "wandb_workspace_spec",
           "create_wandb_workspace", "WORKSPACE_NAME"]

WORKSPACE_NAME = "gradguard: training stability"

EVENT_POINTS = ("skip", "rollback", "lower_lr", "tighten_clip", "adam", "lower_layer_lr", "shrink_batch", "halt")
"""Events drawn as points on the loss panel (``M.EVENT/<name>``); every other event is in the events panel."""


@dataclass
class Panel:
    """One chart: literal metric names (``y``) or a regular expression over metric names (``regex``)
    drawn as lines; or (``table``) a logged W&B table drawn as separate points (W&B only)."""

    section: str
    title: str
    y: list[str] = field(default_factory=list)
    regex: str | None = None
    log_y: bool = False
    table: str | None = None
    """A W&B table key: the panel is a scatter chart of its ``step`` and ``loss`` columns."""

    def names(self) -> list[str]:
        return list(self.y)


def _rx(prefix: str, family: str, tail: str = ".+") -> str:
    return "^" + re.escape(prefix + family + "/") + tail + "$"


def panels(prefix: str = "") -> list[Panel]:
    """The dashboard, engine-neutral. ``prefix``: what the engine puts before gradguard's keys
    (HF ``report_to`` logs ``train/gradguard/...``: ``prefix="train/"``)."""
    p = prefix
    main, layers = "gradguard: training stability", "gradguard: per layer"
    return [
        Panel(main, "loss with gradguard's events", [p + M.LOSS] + [f"{p}{M.EVENT}/{e}" for e in EVENT_POINTS]),
        Panel(main, "total grad norm vs clip threshold", [p + M.GRAD_NORM, p + M.MAX_NORM], log_y=True),
        Panel(main, LR_CHART, regex="^" + re.escape(p + "gradguard/lr") + r"(_scheduled)?/group\d+$",
              log_y=True),
        Panel(main, "LR multiplier", [p + M.LR_MULT], log_y=True),
        Panel(main, "loss scale (fp16)", [p + M.SCALE], log_y=True),
        Panel(main, "overflows, skipped steps, findings", [p + M.OVERFLOW, p + M.SKIPPED, p + M.FINDINGS]),
        Panel(main, "ladder level", [p + M.LEVEL]),
        Panel(main, "actions over time (cumulative)", regex=_rx(p, M.ACTION)),
        Panel(main, "every event (one series per name)", regex=_rx(p, M.EVENT)),
        Panel(main, "gradguard's events as points (W&B)", table=p + M.EVENT_POINTS + "_table"),
        # the per-layer lines only: the total (gradguard/grad_norm/total) has its own panel
        Panel(layers, "per-layer grad norm", regex=_rx(p, M.GRAD_NORM_LAYER, r"(?!total$).+"), log_y=True),
        Panel(layers, "per-layer update/weight ratio", regex=_rx(p, M.UPDATE_RATIO_LAYER), log_y=True),
        Panel(layers, "per-layer parameter norm", regex=_rx(p, M.PARAM_NORM_LAYER), log_y=True),
    ]


LR_CHART = "applied vs scheduled LR"
LR_LOG10_CHART = "applied LR, log10 (the LR on a log axis)"
"""TensorBoard only: custom scalars cannot set a log axis, so the layout draws the applied LR's
log10 (``gradguard/lr_log10/group<i>``) in a chart of its own; the W&B workspace sets a log axis on
its LR panel instead."""

ANY_PREFIX = "(?:[^/]+/)?"
"""What the TensorBoard layout allows before ``gradguard/``: nothing (plain loop, Lightning) or one
engine namespace (HF's ``train/``)."""

LINES_DIR = "gradguard-lines"
"""TensorBoard: the folder of the line runs inside the run's folder, ``<run>/gradguard-lines/<0-6>``
(a name no ``import`` can reach)."""
LINES_TAG = "gradguard-lines"
"""TensorBoard: what the tags of the line runs begin with, ``gradguard-lines/<chart>/<key without
gradguard/>`` (a tag group of its own, apart from the run's ``gradguard/...`` keys)."""
LINE_COLOURS = 7
"""TensorBoard's palette (``tensorboardColorBlindAssist``): 7 colours, handed out by run."""

LINE_CHARTS = {
    "loss with gradguard's events": "loss",
    "total grad norm vs clip threshold": "grad_norm",
    LR_CHART: "lr",
    LR_LOG10_CHART: "lr_log10",
    "overflows, skipped steps, findings": "counts",
    "actions over time (cumulative)": "actions",
    "every event (one series per name)": "events",
    "per-layer grad norm": "layer_grad_norm",
    "per-layer update/weight ratio": "layer_update_ratio",
    "per-layer parameter norm": "layer_param_norm",
}
"""TensorBoard's multi-line charts (title: name). TensorBoard colours the lines of a custom-scalars
chart by run, so the series of one run would share a colour: the n-th series of each of these
charts is also written into the line run ``<run>/gradguard-lines/<n mod 7>`` under the tag
``gradguard-lines/<chart>/<key without gradguard/>``, which the chart draws (see
:mod:`gradguard._tblines`). The run's own keys stay as they are; the other charts hold one series
and draw them."""


def _tb_charts() -> list[tuple[str, str, list[str], str | None]]:
    """Every TensorBoard chart, in layout order: (section, title, keys, regex), without prefix."""
    out: list[tuple[str, str, list[str], str | None]] = []
    for panel in panels(""):
        if panel.table:
            continue  # a W&B table: TensorBoard has the event tags in "every event (one series per name)"
        out.append((panel.section, panel.title, list(panel.y), panel.regex))
        if panel.title == LR_CHART:
            out.append((panel.section, LR_LOG10_CHART, [], "^" + re.escape(M.LR_LOG10) + r"/group\d+$"))
    return out


def line_charts(key: str) -> list[str]:
    """The names (:data:`LINE_CHARTS`) of the multi-line charts that draw ``key`` (without prefix)."""
    return [LINE_CHARTS[title] for _, title, keys, regex in _tb_charts()
            if title in LINE_CHARTS and (key in keys or (regex is not None and re.search(regex, key)))]


def tensorboard_layout(prefix: str = "", lines: bool = True) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout (``SummaryWriter.add_custom_scalars``): one category per section,
    one multiline chart per panel (TensorBoard treats every tag as a regular expression).

    The layout is the same for every engine (``prefix`` is accepted and ignored). TensorBoard
    merges the layouts of all runs in a folder, dropping identical charts, so runs of the plain
    loop, Lightning and HF (``train/gradguard/...``) in one folder share one set of charts instead
    of doubling them.

    Colours: TensorBoard colours lines by run. With ``lines`` (what ``TensorBoardSink`` writes) each
    multi-line chart (:data:`LINE_CHARTS`) draws the tags ``gradguard-lines/<name>/...``, whose
    series sit in 7 line runs, one colour each; a chart of one series draws the run's own key, with
    an optional engine namespace before ``gradguard/``. ``lines=False``: every chart draws the
    run's own keys (the series of one run share a colour, told apart by marker shape).

    What a layout cannot say: no axis settings, the y axis is linear: switch a chart to a log axis
    with its "log scale" toggle (the grad norm, loss scale and per-layer charts read best on one; the
    W&B workspace sets it). For the LR the layout has a chart of its own, :data:`LR_LOG10_CHART`,
    right after "applied vs scheduled LR": ``gradguard/lr_log10/group<i>``, the log10 of the applied
    LR, which reads as the LR on a log axis (-3 is 1e-3; an LR cut x0.1 is a step of -1)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for section, title, keys, regex in _tb_charts():
        if lines and title in LINE_CHARTS:
            tags = ["^" + re.escape(f"{LINES_TAG}/{LINE_CHARTS[title]}/")]
        elif regex:
            tags = ["^" + ANY_PREFIX + regex[1:]]
        else:
            tags = ["^" + ANY_PREFIX + re.escape(n) + "$" for n in keys]
        out.setdefault(section, {})[title] = ["Multiline", tags]
    return out


def _workspaces() -> tuple[Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise ImportError("gradguard: the W&B dashboard needs wandb-workspaces. "
                          "Fix: pip install 'gradguard[dashboards]'") from exc
    return ws, wr


def wandb_workspace(entity: str, project: str, prefix: str = "", name: str = WORKSPACE_NAME) -> Any:
    """The ``wandb_workspaces.workspaces.Workspace`` (not saved)."""
    ws, wr = _workspaces()
    sections: dict[str, list[Any]] = {}
    for panel in panels(prefix):
        if panel.table:  # W&B's scatter preset over the table WandbSink logs (M.EVENT_POINTS)
            sections.setdefault(panel.section, []).append(wr.CustomChart(
                query={"summaryTable": {"tableKey": panel.table}}, chart_name="wandb/scatter/v0",
                chart_fields={"x": "step", "y": "loss"}, chart_strings={"title": panel.title}))
            continue
        kw: dict[str, Any] = {"title": panel.title, "log_y": panel.log_y}
        if panel.regex:
            kw["metric_regex"] = panel.regex
        else:
            kw["y"] = list(panel.y)
        sections.setdefault(panel.section, []).append(wr.LinePlot(**kw))
    return ws.Workspace(entity=entity, project=project, name=name,
                        sections=[ws.Section(name=k, panels=v, is_open=True) for k, v in sections.items()])


def wandb_workspace_spec(entity: str = "ENTITY", project: str = "PROJECT", prefix: str = "") -> dict[str, Any]:
    """What ``--dry-run`` writes: the panel list and the workspace's view spec as W&B stores it."""
    from ._compat import wandb_view_dump

    return {"name": WORKSPACE_NAME, "entity": entity, "project": project, "prefix": prefix,
            "panels": [asdict(p) for p in panels(prefix)],
            "view": wandb_view_dump(wandb_workspace(entity, project, prefix))}


def create_wandb_workspace(entity: str, project: str, prefix: str = "") -> str:
    """Save the workspace to W&B (needs ``wandb login``); returns its URL."""
    return str(wandb_workspace(entity, project, prefix).save().url)
