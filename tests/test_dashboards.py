"""The ready dashboards: the W&B workspace spec (round trip through wandb-workspaces, offline) and the
TensorBoard custom-scalars layout, both checked against the metric constants and a real run's keys."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

import gradguard as gg
from gradguard.cli import main as cli_main
from gradguard.dashboards import EVENT_POINTS, LINES_TAG, panels, tensorboard_layout
from gradguard.sinks import M

from .conftest import TinyNet, make_batch
from .test_sinks import _line_runs, _read_wandb_run

FIXED = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str)}
FAMILIES = (M.GRAD_NORM_LAYER, M.PARAM_NORM_LAYER, M.UPDATE_RATIO_LAYER, M.LR, M.LR_LOG10, M.LR_SCHEDULED, M.ACTION,
            M.EVENT)
NOT_IN_AN_FP32_RUN = {M.SCALE, M.OVERFLOW}


def known(name: str) -> bool:
    """A metric name the guard can log: a constant of M, or a constant family + one more segment."""
    return name in FIXED or any(name.startswith(f + "/") and "/" not in name[len(f) + 1:] for f in FAMILIES)


def test_every_panel_names_only_metric_constants():
    for panel in panels():
        for name in panel.y:
            assert known(name) and "." not in name, (panel.title, name)
        if panel.regex:
            assert any(re.search(panel.regex, f"{f}/{x}") for f in FAMILIES for x in ("h_0", "group0")), panel
    assert all(f"{M.EVENT}/{e}" in panels()[0].y for e in EVENT_POINTS)
    prefixed = panels("train/")
    assert all(n.startswith("train/gradguard/") for p in prefixed for n in p.y)
    assert re.search(prefixed[2].regex, "train/gradguard/lr_scheduled/group0")
    assert not re.search(prefixed[2].regex, "gradguard/lr_scheduled/group0")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_workspace_spec_round_trips_through_wandb_workspaces(tmp_path):
    pytest.importorskip("wandb_workspaces")
    from gradguard._compat import wandb_workspace_load

    out = tmp_path / "spec.json"
    assert cli_main(["dashboard", "wandb", "--dry-run", "--entity", "me", "--project", "p", "-o", str(out)]) == 0
    spec = json.loads(out.read_text())
    assert spec["entity"] == "me" and spec["view"]["project"] == "p"
    ws = wandb_workspace_load(spec["view"])  # what W&B would store, rebuilt by the library itself
    assert ws.entity == "me" and ws.name == "gradguard: training stability"
    def described(s, p):  # a line plot, or the scatter chart over the event-points table
        if hasattr(p, "query"):
            return (s.name, p.chart_strings["title"], p.query["summaryTable"]["tableKey"], p.chart_name,
                    p.chart_fields)
        return (s.name, p.title, [m.name for m in p.y], p.metric_regex, bool(p.log_y))

    got = [described(s, p) for s in ws.sections for p in s.panels]
    want = [(p.section, p.title, p.table, "wandb/scatter/v0", {"x": "step", "y": "loss"}) if p.table
            else (p.section, p.title, list(p.y), p.regex, p.log_y) for p in panels()]
    assert got == want
    assert any(p.table == M.EVENT_POINTS + "_table" for p in panels())
    assert [p["title"] for p in spec["panels"]] == [p.title for p in panels()]


def _real_run(tmp_path, sinks):
    """A real Guard on a tiny transformer-named net: a NaN step (skip), then two 50x loss steps
    (rollback, lower_lr, tighten_clip), per-layer update ratios every 5 steps."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False, "metrics_interval": 1},
                                measure={"log_interval": 5}, recovery={"snapshot_interval": 3, "confirm_steps": 1})
    guard = gg.Guard(model, opt, scheduler=sched, config=cfg, sinks=sinks)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen)
    for i in range(1, 31):
        loss = model(*batch)
        if i == 6:
            loss = loss * float("nan")
        elif i in (21, 22):
            loss = loss * 50
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)
    return guard.close()


def _check_against(keys: set[str], panel_list) -> None:
    assert keys, "the run logged nothing"
    for panel in panel_list:
        if panel.table:
            continue  # checked against the run's tables in the test below
        for name in panel.y:
            fired = not name.startswith(M.EVENT + "/") or name in keys
            if name not in NOT_IN_AN_FP32_RUN and fired:
                assert name in keys, (panel.title, name)
        if panel.regex:
            assert any(re.search(panel.regex, k) for k in keys), (panel.title, panel.regex)


def test_the_dashboards_match_a_real_runs_keys_in_wandb_and_tensorboard(wandb_offline, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    wb = gg.WandbSink(project="gradguard-test", dir=str(tmp_path))
    tb = gg.TensorBoardSink(str(tmp_path / "tb"))
    summary = _real_run(tmp_path, [wb, tb])
    assert {"rollback", "lower_lr", "tighten_clip"} <= set(summary["actions"])
    history, wsummary = _read_wandb_run(tmp_path)  # once the file is complete (its exit record)
    tables = (gg.WandbSink.TABLE_KEY, M.EVENT_POINTS)  # the actions table, the event points (nested keys)
    keys = {k for row in history for k in row if k.startswith("gradguard/") and not k.startswith(tables)} | {
        k for k in wsummary if k.startswith("gradguard/") and not k.startswith(("gradguard/summary/",) + tables)}
    assert {f"{M.EVENT}/skip", f"{M.EVENT}/rollback", f"{M.EVENT}/lower_lr"} <= keys
    # the advice for the next run reaches the W&B summary
    assert wsummary["gradguard/summary/advice/settings/lr_factor"] == summary["advice"]["settings"]["lr_factor"]
    assert all(known(k) for k in keys), sorted(k for k in keys if not known(k))
    _check_against(keys, panels())
    # event points sit on the loss curve: the value is the step's loss (the last finite one for a NaN step)
    rows = {r["_step"]: r for r in history if "_step" in r}
    (rb_step,) = [s for s, r in rows.items() if f"{M.EVENT}/rollback" in r]
    assert rows[rb_step][f"{M.EVENT}/rollback"] == pytest.approx(rows[rb_step][M.LOSS])
    # ... and they are also one table of separate points (W&B joins a sparse series into lines):
    # logged at the first event's row, then at close, with every event of the run
    charted = [r for r in history if f"{M.EVENT_POINTS}_table._type" in r]  # nested keys read as a.b
    assert charted and charted[0]["_step"] == min(s for s, r in rows.items() if any(k.startswith(M.EVENT + "/")
                                                                                      for k in r))
    last = charted[-1][f"{M.EVENT_POINTS}_table.path"]
    run_dir = os.path.dirname(glob.glob(str(tmp_path / "wandb" / "*" / "files"))[0])
    with open(os.path.join(run_dir, "files", last), encoding="utf-8") as fh:
        table_json = json.load(fh)
    assert table_json["columns"] == ["step", "loss", "event"]
    points = {(s, e) for s, _, e in table_json["data"]}
    want_points = {(s, k[len(M.EVENT) + 1:]) for s, r in rows.items() for k in r if k.startswith(M.EVENT + "/")}
    assert points == want_points
    for s, y, e in table_json["data"]:
        assert y == pytest.approx(rows[s][f"{M.EVENT}/{e}"])

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    (cfg_event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)  # written once per run
    layout = layout_pb2.Layout()
    layout.ParseFromString(cfg_event.tensor_proto.string_val[0])
    got = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    want = {cat: {title: spec[1] for title, spec in charts.items()} for cat, charts in tensorboard_layout().items()}
    assert got == want
    # the run's own keys and the line runs' tags (a run per series of a multi-line chart)
    scalars = set(acc.Tags()["scalars"]) | {f"{LINES_TAG}/{chart}/{key[len('gradguard/'):]}"
                                            for chart, key in _line_runs(tmp_path / "tb")}
    for charts in got.values():
        for title, tags in charts.items():
            if title != "loss scale (fp16)":
                assert any(re.search(t, s) for t in tags for s in scalars), (title, tags)


def test_the_committed_dashboard_files_are_up_to_date():
    """dashboards/tensorboard/layout.json and dashboards/wandb/ are generated (dashboards/screenshots.py)."""
    from dataclasses import asdict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(f"{root}/dashboards/tensorboard/layout.json", encoding="utf-8") as fh:
        assert json.load(fh) == tensorboard_layout()
    with open(f"{root}/dashboards/wandb/workspace.json", encoding="utf-8") as fh:
        assert json.load(fh)["panels"] == [asdict(p) for p in panels()]
    with open(f"{root}/dashboards/wandb/panels.md", encoding="utf-8") as fh:
        table = fh.read()
    assert all(p.title in table for p in panels())
