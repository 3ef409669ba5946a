"""TensorBoardSink and WandbSink against the real libraries (W&B offline), read back from their files."""

import glob
import json
import math
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import gradguard as gg
from gradguard.sinks import M

from .wandb_log import read_runs

NAN_STEPS = (12, 13, 14)  # a 3-step non-finite streak: skips, then actions (rollback, lower_lr...)
NAN_STEP = NAN_STEPS[-1]
STEPS = 30


def _run_guard(tmp_path, sink):
    """A real Guard on a two-Linear model, NaN losses at NAN_STEPS; returns what a MemorySink saw."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), act=nn.Tanh(), head=nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mem = gg.MemorySink()
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False, "metrics_interval": 5})
    guard = gg.Guard(model, opt, config=cfg, sinks=[mem, *(sink if isinstance(sink, list) else [sink])])
    assert guard.core.layers.layer_names == ["fc1", "head"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)  # one fixed batch: a smooth loss, no spurious spikes
    for i in range(1, STEPS + 1):
        loss = nn.functional.mse_loss(model(x), y)
        if i in NAN_STEPS:
            loss = loss * float("nan")
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)
    guard.close()
    assert any(e["type"] == "action" and e["step"] == NAN_STEP for e in mem.events)
    assert mem.summary["skipped"] >= len(NAN_STEPS)
    return mem


def _expected(mem, key):
    return {step: m[key] for step, m in mem.metrics if key in m}


def _same(a, b):
    if math.isnan(b):
        return math.isnan(a)
    return a == pytest.approx(b, rel=1e-6, abs=1e-7)  # TensorBoard keeps float32


# -- TensorBoard -----------------------------------------------------------------------------

def test_tensorboard_sink_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    mem = _run_guard(tmp_path, gg.TensorBoardSink(str(tb_dir)))
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for key in (M.LOSS, M.GRAD_NORM, M.SKIPPED, f"{M.GRAD_NORM_LAYER}/fc1", f"{M.GRAD_NORM_LAYER}/head"):
        assert key in tags["scalars"], key
        want = _expected(mem, key)
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert sorted(got) == sorted(want) and NAN_STEP in got and 5 in got and STEPS in got
        for step, v in want.items():
            assert _same(got[step], v), (key, step, got[step], v)
    assert math.isnan(dict((e.step, e.value) for e in acc.Scalars(M.LOSS))[NAN_STEP])
    # the line runs of the multi-line charts (a colour per series): every key of those charts, the
    # same values at the same steps; a key of two charts (an event point) is in both
    from gradguard.dashboards import line_charts

    lines = _line_runs(tb_dir)
    logged = {k for _, m in mem.metrics for k in m}
    assert set(lines) == {(chart, k) for k in logged for chart in line_charts(k)}
    assert {("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/fc1"), ("grad_norm", M.GRAD_NORM), ("loss", M.LOSS),
            ("loss", f"{M.EVENT}/rollback"), ("events", f"{M.EVENT}/rollback"), ("lr_log10", f"{M.LR_LOG10}/group0"),
            ("lr", f"{M.LR}/group0"), ("lr", f"{M.LR_SCHEDULED}/group0")} <= set(lines)
    assert not [k for _, k in lines if k in (M.LR_MULT, M.LEVEL)]  # one-series charts draw the run's own key
    for (chart, key), got in lines.items():
        want = _expected(mem, key)
        assert sorted(got) == sorted(want), (chart, key)
        assert all(_same(got[s], v) for s, v in want.items()), (chart, key)
    # each chart's series sit in different runs (a colour each), at most 7 runs
    where = {}
    _line_runs(tb_dir, where)
    for chart in {c for c, _ in where}:
        runs = [run for (c, _), run in where.items() if c == chart]
        assert len(set(runs)) == len(runs), (chart, where)
    assert set(where.values()) <= {str(n) for n in range(7)}
    # the LR on a log axis (custom scalars have none): log10 of the applied LR, at every step the LR has
    lr = {e.step: e.value for e in acc.Scalars(f"{M.LR}/group0")}
    lr10 = {e.step: e.value for e in acc.Scalars(f"{M.LR_LOG10}/group0")}
    assert sorted(lr10) == sorted(lr) and len(set(lr10.values())) > 1  # the LR cut shows
    assert all(lr10[s] == pytest.approx(math.log10(lr[s]), abs=1e-5) for s in lr)
    action_tags = [t for t in tags["scalars"] if t.startswith(M.ACTION + "/")]
    assert action_tags  # the cumulative per-action counts
    text_tag = next(t for t in tags["tensors"] if t.startswith(gg.TensorBoardSink.TEXT_TAG + "/"))
    texts = acc.Tensors(text_tag)
    assert NAN_STEP in [e.step for e in texts]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert "**" in first and "step" in first


def _tb(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _line_runs(run_dir, where=None):
    """The line runs of a TensorBoard run folder: ``{(chart, key): {step: value}}`` from the tags
    ``gradguard-lines/<chart>/<key without gradguard/>`` of the runs ``gradguard-lines/<n>``;
    ``where`` (a dict) gets each series' run ``n``."""
    import os

    from gradguard.dashboards import LINES_DIR, LINES_TAG

    root = os.path.join(str(run_dir), LINES_DIR)
    out = {}
    for folder, _, files in os.walk(root):
        if not any("tfevents" in f for f in files):
            continue
        acc = _tb(folder)
        for tag in acc.Tags()["scalars"]:
            assert tag.startswith(LINES_TAG + "/"), (folder, tag)
            chart, label = tag[len(LINES_TAG) + 1:].split("/", 1)
            assert (chart, "gradguard/" + label) not in out, tag  # a series is in one run only
            out[(chart, "gradguard/" + label)] = {e.step: e.value for e in acc.Scalars(tag)}
            if where is not None:
                where[(chart, "gradguard/" + label)] = os.path.relpath(folder, root)
    return out


def test_tensorboard_text_is_one_line_per_action(tmp_path):
    """A rollback, an LR cut and a clip change at one step: one text entry for the step with three
    lines (TensorBoard shows one text per tag and step), each naming its action; read back."""
    sink = gg.TensorBoardSink(str(tmp_path / "tb"), layout=False)
    for name in ("rollback", "lower_lr", "tighten_clip"):
        sink.log_event({"type": "action", "name": name, "step": 7, "params": {"rung": 1}, "reason": "loss spike"})
    sink.end_step(7)
    sink.log_event({"type": "action", "name": "recover_lr", "step": 40, "params": {}, "reason": "stable period"})
    sink.log_event({"type": "halt", "step": 41, "message": "gave up"})
    sink.close()
    acc = _tb(tmp_path / "tb")
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith(gg.TensorBoardSink.TEXT_TAG + "/")]
    entries = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
    assert sorted(entries) == [7, 40, 41] and len(acc.Tensors(tag)) == 3
    lines = entries[7].split("  \n")
    assert len(lines) == 3 and ["rollback" in lines[0], "lower_lr" in lines[1], "tighten_clip" in lines[2]] == [True] * 3
    assert "recover_lr" in entries[40] and "HALT" in entries[41]


def test_tensorboard_layout_is_one_set_of_charts_for_every_engine(tmp_path):
    """Runs of the plain loop (no prefix) and of HF (``train/``) in one folder: their layouts are
    identical (TensorBoard merges identical charts, so nothing is doubled); each multi-line chart
    draws one tag, written by the line runs inside each run's own folder (so each run's series have
    colours of their own, none drawn twice); a one-series chart draws both runs' keys; the total
    grad norm is not among the per-layer lines."""
    import re

    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    from gradguard.dashboards import LINES_TAG, tensorboard_layout

    plain = gg.TensorBoardSink(str(tmp_path / "runs" / "plain"))
    hf = gg.TensorBoardSink(str(tmp_path / "runs" / "hf"), prefix="train/")
    for sink in (plain, hf):
        sink.log_metrics(1, {M.LOSS: 2.0, M.GRAD_NORM: 1.0, f"{M.GRAD_NORM_LAYER}/fc1": 0.5, M.LR_MULT: 1.0})
        sink.close()
    layouts = []
    for run in ("plain", "hf"):
        (cfg,) = _tb(tmp_path / "runs" / run).Tensors(metadata.CONFIG_SUMMARY_TAG)
        layout = layout_pb2.Layout()
        layout.ParseFromString(cfg.tensor_proto.string_val[0])
        layouts.append(layout)
        assert _line_runs(tmp_path / "runs" / run) == {
            ("loss", M.LOSS): {1: 2.0}, ("grad_norm", M.GRAD_NORM): {1: 1.0},
            ("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/fc1"): {1: 0.5}}
    assert layouts[0] == layouts[1]
    charts = {title: tags for c in tensorboard_layout().values() for title, (_, tags) in c.items()}
    assert charts["loss with gradguard's events"] == ["^" + re.escape(LINES_TAG + "/loss/")]
    assert charts["per-layer grad norm"] == ["^" + re.escape(LINES_TAG + "/layer_grad_norm/")]
    (loss_chart,) = charts["loss with gradguard's events"]
    assert not re.match(loss_chart, f"{LINES_TAG}/lr/lr/group0")
    (mult,) = charts["LR multiplier"]
    assert re.match(mult, M.LR_MULT) and re.match(mult, "train/" + M.LR_MULT)
    # the run's own keys are drawn by no multi-line chart (no line twice, no one-colour series)
    for key in (M.LOSS, M.GRAD_NORM, f"{M.GRAD_NORM_LAYER}/fc1"):
        for prefix in ("", "train/"):
            assert not any(re.match(t, prefix + key) for tags in charts.values() for t in tags), key
    # lines=False: one run, the charts draw its keys (with the engine's prefix or none)
    plain_layout = {title: tags for c in tensorboard_layout(lines=False).values() for title, (_, tags) in c.items()}
    (per_layer,) = plain_layout["per-layer grad norm"]
    assert re.match(per_layer, f"train/{M.GRAD_NORM_LAYER}/fc1") and re.match(per_layer, f"{M.GRAD_NORM_LAYER}/fc1")
    assert not re.match(per_layer, M.GRAD_NORM) and not re.match(per_layer, "train/" + M.GRAD_NORM)


def test_tensorboard_line_runs_switch_engine_writer_and_files(tmp_path):
    """``lines=False``: no line runs, the layout draws the run's keys. With an engine's writer the
    line runs go inside the writer's folder, at the engine's x; ``engine_logged`` (what HF's
    integrations write themselves) reaches only the line runs. No file stays open between flushes."""
    import os

    from torch.utils.tensorboard import SummaryWriter

    from gradguard.dashboards import LINES_DIR, tensorboard_layout

    off = gg.TensorBoardSink(str(tmp_path / "off"), lines=False)
    off.log_metrics(1, {M.LOSS: 1.0})
    off.close()
    assert off.line_runs is None and not os.path.exists(tmp_path / "off" / LINES_DIR)

    writer = SummaryWriter(str(tmp_path / "engine"))
    sink = gg.TensorBoardSink(writer=writer, prefix="train/", step_fn=lambda step: step * 10, layout=False)
    sink.line_runs.flush_secs = 0  # append at every row
    sink.log_metrics(1, {f"{M.GRAD_NORM_LAYER}/fc1": 0.5, M.LR_MULT: 1.0})
    sink.engine_logged(2, {f"{M.GRAD_NORM_LAYER}/fc1": 0.25, M.LOSS: 3.0})
    fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else None
    opened = [os.readlink(f"/proc/self/fd/{fd}") for fd in fds or []
              if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [p for p in opened if LINES_DIR in p]
    sink.close()
    writer.close()
    assert _line_runs(tmp_path / "engine") == {("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/fc1"): {10: 0.5, 20: 0.25},
                                               ("loss", M.LOSS): {20: 3.0}}
    main = _tb(tmp_path / "engine")
    assert main.Tags()["scalars"] == [f"train/{M.GRAD_NORM_LAYER}/fc1", f"train/{M.LR_MULT}"]  # the engine's own rows
    assert tensorboard_layout(lines=False) != tensorboard_layout()


def test_tensorboard_line_runs_are_at_most_seven_runs(tmp_path):
    """40 layers: the per-layer series go to 7 line runs (TensorBoard's 7 colours), the n-th
    series of a chart to run n mod 7, in the order the keys first came; a run of the guard adds at
    most 7 runs, so a folder of several runs stays under TensorBoard's 40 runs enabled by default."""
    import os

    from gradguard.dashboards import LINES_DIR

    sink = gg.TensorBoardSink(str(tmp_path / "tb"))
    layers = [f"h_{i}" for i in range(40)]
    for step in (1, 2):
        sink.log_metrics(step, {M.LOSS: 1.0, M.GRAD_NORM: 2.0, **{f"{M.GRAD_NORM_LAYER}/{x}": 0.1 * step for x in layers},
                                **{f"{M.UPDATE_RATIO_LAYER}/{x}": 1e-3 for x in layers}})
    sink.close()
    where = {}
    lines = _line_runs(tmp_path / "tb", where)
    assert sorted(os.listdir(tmp_path / "tb" / LINES_DIR)) == [str(n) for n in range(7)]
    assert [where[("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/{x}")] for x in layers] == [str(i % 7) for i in range(40)]
    assert where[("loss", M.LOSS)] == where[("grad_norm", M.GRAD_NORM)] == "0"
    assert lines[("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/h_39")] == pytest.approx({1: 0.1, 2: 0.2})
    assert len(lines) == 2 + 2 * len(layers)


def test_tensorboard_line_runs_fail_alone_and_training_goes_on(tmp_path):
    """An I/O error in the line runs: one warning and one ``sink_error`` event (in the event log);
    the line runs are off, the run's own scalars, text and summary go on to the end."""
    from gradguard import _io
    from gradguard.dashboards import LINES_DIR

    tb = gg.TensorBoardSink(str(tmp_path / "tb"))
    tb.line_runs.flush_secs = 0
    fault = _io.add_fault(_io.IOFault(str(tmp_path / "tb" / LINES_DIR)))
    try:
        with pytest.warns(UserWarning, match="TensorBoard line runs under .* are off") as caught:
            mem = _run_guard(tmp_path, tb)
    finally:
        _io.remove_fault(fault)
    assert len([w for w in caught if "line runs" in str(w.message)]) == 1
    errors = [e for e in mem.events if e["type"] == "sink_error"]
    assert len(errors) == 1 and errors[0]["sink"] == "TensorBoardSink" and "line runs" in errors[0]["error"]
    assert tb.line_runs.error is not None and _line_runs(tmp_path / "tb") == {}
    acc = _tb(tmp_path / "tb")
    assert sorted(e.step for e in acc.Scalars(M.LOSS)) == sorted(_expected(mem, M.LOSS))
    assert [t for t in acc.Tags()["tensors"] if t.startswith("gradguard/summary")]


def test_tensorboard_sink_missing_dependency(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"gradguard\[tensorboard\]"):
        gg.TensorBoardSink(str(tmp_path / "tb"))


# -- W&B (offline) ---------------------------------------------------------------------------



def _read_wandb_run(tmp_path):
    """History rows and summary of the one offline run, read once its exit record is written
    (the wandb service writes the file asynchronously, after ``finish`` returns). Nested keys
    (a table's ``path``, ``nrows``) read as W&B shows them: ``a.b``."""
    (run,) = read_runs(str(tmp_path), sep=".")
    assert run.finished, f"{run.path}: no exit record after a minute"
    return run.history, run.summary


def test_wandb_sink_round_trip(wandb_offline, tmp_path):
    sink = gg.WandbSink(project="gradguard-test", dir=str(tmp_path))
    assert sink.owns_run
    mem = _run_guard(tmp_path, sink)
    assert sink.run._is_finished and wandb_offline.run is None  # it started the run, so it finished it
    history, summary = _read_wandb_run(tmp_path)
    for key in (M.LOSS, M.GRAD_NORM, f"{M.GRAD_NORM_LAYER}/fc1"):
        # nan/inf values stay out of W&B (they would poison the run summary's peak)
        want = {s: v for s, v in _expected(mem, key).items() if math.isfinite(v)}
        got = {row["_step"]: row[key] for row in history if key in row}
        assert sorted(got) == sorted(want) and len(want) < len(_expected(mem, key))
        for step, v in want.items():
            assert _same(got[step], v), (key, step, got[step], v)
    # the non-finite steps are marked by their event points instead
    assert NAN_STEP in {row["_step"] for row in history if f"{M.EVENT}/skip" in row or f"{M.EVENT}/rollback" in row}
    table_rows = [row for row in history if any(k.startswith(gg.WandbSink.TABLE_KEY + ".") for k in row)]
    assert len(table_rows) == 1 and table_rows[0][gg.WandbSink.TABLE_KEY + ".nrows"] >= 1
    (files_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files"))
    table = json.load(open(f"{files_dir}/{table_rows[0][gg.WandbSink.TABLE_KEY + '.path']}"))
    assert table["columns"] == ["step", "name", "reason", "params"]
    assert NAN_STEP in [r[0] for r in table["data"]]
    assert all(isinstance(json.loads(r[3]), dict) for r in table["data"])
    assert summary["gradguard/summary/skipped"] == mem.summary["skipped"]
    assert summary["gradguard/summary/steps"] == STEPS
    for name, count in mem.summary["actions"].items():
        assert summary[f"gradguard/summary/actions/{name}"] == count


def test_wandb_sink_existing_run_and_backward_step(wandb_offline, tmp_path):
    run = wandb_offline.init(project="gradguard-test", dir=str(tmp_path))
    sink = gg.WandbSink()  # picks up the active wandb.run
    assert sink.run is run and not sink.owns_run
    sink.log_metrics(10, {M.LOSS: 1.0})
    sink.log_metrics(4, {M.LOSS: 2.0, "gradguard/extra": 5.0})  # behind: logged without a step
    sink.log_metrics(11, {M.LOSS: 3.0})
    sink.close({"steps": 11, "actions": {"skip": 1}})
    assert not run._is_finished and wandb_offline.run is run  # not its run: left open
    run.log({"user/after": 1.0})
    run.finish()
    history, summary = _read_wandb_run(tmp_path)
    steps = [(row["_step"], row[M.LOSS]) for row in history if M.LOSS in row]
    # W&B cannot go back: the late metrics join the run's pending row (step 10), whose values for the
    # same keys they replace; nothing is dropped and step 11 still lands on its own row
    assert steps == [(10, 2.0), (11, 3.0)]
    assert [row["_step"] for row in history if "gradguard/extra" in row] == [10]
    assert summary["gradguard/summary/actions/skip"] == 1


def test_wandb_sink_missing_dependency(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"gradguard\[wandb\]"):
        gg.WandbSink()


def test_console_summary_final_lr_reads_as_a_true_product():
    """``final LR xM = LR``: M is the multiplier in force (``lr_multiplier_now``, the re-warm-up
    ramp included) when the summary gives it, with the level it ramps to named."""
    import io

    out = io.StringIO()
    gg.ConsoleSink(stream=out, write=lambda line, s: s.write(line + "\n")).close(
        {"steps": 20, "lr_multiplier": 0.03, "lr_multiplier_now": 0.01962, "final_lr": 0.001962})
    assert "final LR x0.01962 = 0.001962 (re-warming up to x0.03)" in out.getvalue()
    out = io.StringIO()
    gg.ConsoleSink(stream=out, write=lambda line, s: s.write(line + "\n")).close(
        {"steps": 20, "lr_multiplier": 0.03, "final_lr": 0.003})
    assert "final LR x0.03 = 0.003;" in out.getvalue() or out.getvalue().rstrip().endswith("final LR x0.03 = 0.003")
