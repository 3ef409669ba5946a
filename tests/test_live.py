"""Live on the user's own run: W&B (offline, read back from the ``.wandb`` log), TensorBoard (event
files, and the real ``tensorboard`` server), Lightning's loggers and the console, for HF, Lightning
and the plain loop. Real stacks, tiny models."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections import Counter

import pytest
import torch

import gradguard as gg
from gradguard.sinks import M, is_headline

from .test_sinks import _line_runs
from .wandb_log import read_runs

pytestmark = pytest.mark.usefixtures("one_thread")




def jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def event_steps(records: list[dict]) -> dict[int, set[str]]:
    """step -> the ``gradguard/event/<name>`` names the JSONL log implies for it."""
    out: dict[int, set[str]] = {}
    for r in records:
        if r["type"] == "finding":
            out.setdefault(r["step"], set()).add(r["kind"])
        elif r["type"] in ("action",):
            out.setdefault(r["step"], set()).add(r["name"])
        elif r["type"] in ("skip", "halt"):
            out.setdefault(r["step"], set()).add(r["type"])
    return out


def leet_counts(run_dir: str) -> Counter | None:
    """Record counts by type as wandb's own ``wandb leet inspect --json`` prints them (None when the
    command is missing)."""
    exe = shutil.which("wandb")
    if exe is None:
        return None
    proc = subprocess.run([exe, "leet", "inspect", "--json", run_dir], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None
    counts: Counter = Counter()
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            counts[json.loads(line).get("type")] += 1
    return counts


def peak(value):
    return value["max"] if isinstance(value, dict) else value


def no_duplicate_points(history: list[dict], step_key: str, prefix: str) -> None:
    seen = Counter((k, row[step_key]) for row in history if step_key in row for k in row if k.startswith(prefix))
    assert not [kv for kv, n in seen.items() if n > 1], [kv for kv, n in seen.items() if n > 1][:5]


# -- HF: report_to=["wandb", "tensorboard"] -------------------------------------------------------
HF_NAN, HF_SPIKE = (12, 45), (30, 31)


def test_hf_wandb_and_tensorboard_show_every_event_at_its_step(wandb_offline, tmp_path, monkeypatch):
    """Default logging_steps=500 on a 60-step run: no regular log at all, yet every step with a
    finding, skip or action is on the user's W&B run (one run: the README's ``WandbSink()`` is bound
    to it, not doubled) and TensorBoard writer, at ``train/global_step`` == the JSONL step."""
    from gradguard.hf import GradGuardCallback
    from tests.test_hf import cfg, inject, make_trainer

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    sink = gg.WandbSink()  # as the README suggests: started before the Trainer, which reuses the run
    # the 2-step spike escalates at its second step (an action to show), not held as ambiguous
    cb = GradGuardCallback(cfg(tmp_path, policy={"ambiguous_spikes": False}), sinks=[sink])
    trainer = make_trainer(tmp_path, [cb], steps=60, logging_steps=500, report_to=["wandb", "tensorboard"])
    inject(trainer, {**{s: float("nan") for s in HF_NAN}, **{s: 300.0 for s in HF_SPIKE}})
    trainer.train()
    wandb_offline.finish()
    records = jsonl(cb.core.log_path)
    actions = [r for r in records if r["type"] == "action"]
    assert len(actions) >= 3 and {a["step"] for a in actions} <= set(HF_SPIKE)
    want = event_steps(records)
    assert set(want) == {12, 30, 31, 45}

    (run,) = read_runs(str(tmp_path))  # one run: the sink's and the Trainer's are the same
    leet = leet_counts(os.path.dirname(run.path))
    if leet is not None:  # wandb's own reader agrees with ours
        assert (leet["history"], leet["alert"]) == (len(run.history), len(run.alerts))
    assert not [k for row in run.history for k in row if k.startswith("gradguard/") and
                not k.startswith(gg.WandbSink.TABLE_KEY)], "keys logged outside HF's train/ namespace"
    no_duplicate_points(run.history, "train/global_step", "train/gradguard/")
    got: dict[int, set[str]] = {}
    for row in run.history:
        names = {k.rsplit("/", 1)[1] for k in row if k.startswith("train/" + M.EVENT + "/")}
        if names:
            got.setdefault(row["train/global_step"], set()).update(names)
    assert got == want
    rows = {row["train/global_step"]: row for row in run.history if "train/" + M.GRAD_NORM in row}
    assert set(rows) == {30, 31}  # the non-finite steps' norms are left out of W&B (the event points stay)
    spike_loss = next(r for r in records if r["type"] == "finding" and r["step"] == 31 and r["kind"] == "loss_spike")
    assert rows[31]["train/" + M.EVENT + "/rollback"] == pytest.approx(spike_loss["value"], rel=1e-5)
    # alerts: one WARN for the escalation at 31, naming its reason and the culprit layers
    (alert,) = run.alerts
    assert alert["level"] == "WARN" and alert["title"] == "gradguard: rollback"
    assert "step 31" in alert["text"] and "Culprit layers: transformer." in alert["text"]
    # define_metric: peaks for the norms, counts for the actions, on HF's x axis
    defs = {m["name"]: m for m in run.metrics if m["name"]}
    assert defs["train/" + M.GRAD_NORM]["summary"] == ["max"]
    assert defs["train/" + M.GRAD_NORM]["step_metric"] == "train/global_step"
    assert peak(run.summary["train/" + M.GRAD_NORM]) == pytest.approx(max(r["train/" + M.GRAD_NORM]
                                                                          for r in rows.values()))
    assert peak(run.summary["train/gradguard/action/rollback"]) == 1
    assert run.summary["gradguard/summary/actions/rollback"] == 1

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert [e.step for e in acc.Scalars("train/gradguard/event/rollback")] == [31]
    assert sorted({e.step for t in tags["scalars"] if t.startswith("train/gradguard/event/")
                   for e in acc.Scalars(t)}) == [12, 30, 31, 45]
    (alert_t,) = [t for t in tags["tensors"] if t.startswith("train/" + M.ALERTS_TEXT)]
    (entry,) = acc.Tensors(alert_t)
    assert entry.step == 31 and b"rollback" in entry.tensor_proto.string_val[0]


def test_hf_logging_steps_carry_layer_values_to_report_to_not_to_the_printed_logs(tmp_path, monkeypatch, capsys):
    """On logging steps the run-level keys go through the Trainer's logs (printed, in log_history);
    per-layer grad norms, update ratios and weight norms reach every ``report_to`` integration at
    the same step (TensorBoard, and MLflow when installed: not only the ones gradguard knows), the
    served TensorBoard shows them, and the printed lines do not carry them."""
    from gradguard.hf import GradGuardCallback
    from tests.test_hf import cfg, inject, make_trainer

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    report_to = ["tensorboard"]
    try:
        import mlflow  # noqa: F401  (the [dev] extra installs mlflow-skinny)
    except ImportError:
        mlflow = None
    if mlflow is not None:  # a local file store, no server
        monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gradguard-test")
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        report_to.append("mlflow")
    cb = GradGuardCallback(cfg(tmp_path))
    trainer = make_trainer(tmp_path, [cb], steps=25, logging_steps=10, report_to=report_to)
    inject(trainer, {13: float("nan")})
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == 2 and all(M.GRAD_NORM in line for line in printed), printed  # PrinterCallback's dicts
    assert not any(M.GRAD_NORM_LAYER + "/transformer" in line or M.UPDATE_RATIO_LAYER in line for line in printed)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [10, 20]
    for h in logs:  # the applied LR next to the scheduler's: learning_rate x the multiplier
        assert h[f"{M.LR}/group0"] == pytest.approx(h["learning_rate"] * h[M.LR_MULT], rel=1e-6)
        gg_keys = [k for k in h if k.startswith("gradguard/")]
        assert M.LOSS in gg_keys and M.GRAD_NORM in gg_keys and f"{M.LR}/group0" in gg_keys
        assert all(is_headline(k) for k in gg_keys) and len(gg_keys) < 15, gg_keys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    ratio_tags = [t for t in scalars if t.startswith("train/" + M.UPDATE_RATIO_LAYER + "/")]
    assert ratio_tags and [t for t in scalars if t.startswith("train/" + M.PARAM_NORM_LAYER + "/")]
    for t in ratio_tags:
        points = {e.step: e.value for e in acc.Scalars(t)}
        assert {10, 20} <= set(points) and all(v > 0 for s, v in points.items() if s in (10, 20))
    layer = [t for t in scalars if t.startswith("train/" + M.GRAD_NORM_LAYER + "/") and not t.endswith("/total")][0]
    assert sorted(e.step for e in acc.Scalars(layer)) == [10, 13, 20]  # logging steps + the event step
    assert sorted(e.step for e in acc.Scalars("train/gradguard/event/skip")) == [13]
    assert sorted(e.step for e in acc.Scalars("train/loss")) == [10, 20]  # the Trainer's own rows, unchanged

    if mlflow is not None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
        exp = client.get_experiment_by_name("gradguard-test")
        (run,) = client.search_runs([exp.experiment_id])
        keys = set(run.data.metrics)
        per_layer = sorted(k for k in keys if k.startswith(M.GRAD_NORM_LAYER + "/transformer"))
        assert per_layer and any(k.startswith(M.UPDATE_RATIO_LAYER + "/") for k in keys), sorted(keys)[:20]
        assert [m.step for m in client.get_metric_history(run.info.run_id, per_layer[0])] == [10, 20]
        assert [m.step for m in client.get_metric_history(run.info.run_id, M.LOSS)] == [10, 20]

    exe = shutil.which("tensorboard")
    if exe is None:
        pytest.skip("the tensorboard command is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--logdir", str(tmp_path / "tb"), "--host", "127.0.0.1", "--port", str(port),
                             "--load_fast", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        runs = None
        for _ in range(120):
            try:
                runs = json.load(urllib.request.urlopen(f"{base}/data/runs", timeout=2))
                if runs:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert runs, "tensorboard did not come up"
        tags = json.load(urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=10))
        run = next(r for r in tags if "train/gradguard/event/skip" in tags[r])
        query = urllib.parse.urlencode({"run": run, "tag": "train/gradguard/event/skip"})
        points = json.load(urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{query}", timeout=10))
        assert [p[1] for p in points] == [13]  # [wall_time, step, value]
        assert layer in tags[run]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# -- Lightning ------------------------------------------------------------------------------------
def _lit():
    pytest.importorskip("lightning.pytorch")
    from tests import test_lightning as tl

    return tl


def test_lightning_wandb_rows_share_the_users_step_and_events_land_between_logging_steps(wandb_offline, tmp_path):
    tl = _lit()
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import WandbLogger

    from gradguard.lightning import GradGuardCallback

    module = tl.LitGPT(lr=3e-3, spike_at=(17, 18), spike=300.0)
    cb = GradGuardCallback(tl.cfg(tmp_path, output={"metrics_interval": 10}))
    logger = WandbLogger(project="gradguard-test", save_dir=str(tmp_path), offline=True)
    tl.fit(module, [cb, LearningRateMonitor("step")], tmp_path=tmp_path, steps=30, logger=logger,
           log_every_n_steps=5)
    wandb_offline.finish()
    records = jsonl(cb.core.log_path)
    want = event_steps(records)
    assert 18 in want and "rollback" in want[18]
    (run,) = read_runs(str(tmp_path))
    x = "trainer/global_step"
    no_duplicate_points(run.history, x, "gradguard/")
    user = {r[x]: r["train_loss"] for r in run.history if "train_loss" in r}
    mine = {r[x]: r[M.LOSS] for r in run.history if M.LOSS in r}
    assert sorted(user) == [4, 9, 14, 19, 24, 29]  # Lightning's log_every_n_steps, 0-based
    for step, loss in user.items():  # the same batch's values on the same x (the old code was one step late)
        assert mine[step] == pytest.approx(loss, rel=1e-5)
    got: dict[int, set[str]] = {}
    for row in run.history:
        names = {k.rsplit("/", 1)[1] for k in row if k.startswith(M.EVENT + "/")}
        if names:
            got.setdefault(row[x], set()).update(names)
    # Lightning's x for a batch is the number of optimizer steps before it: the JSONL step - 1,
    # which every JSONL record carries as engine_step (the row of the same batch in the loggers)
    assert got == {s - 1: names for s, names in want.items()}
    stepped = [r for r in records if r["type"] in ("metrics", "finding", "action", "skip")]
    assert stepped and all(r["engine_step"] == r["step"] - 1 for r in stepped)
    jsonl_rows = {r["engine_step"]: r[M.LOSS] for r in records if r["type"] == "metrics" and M.LOSS in r}
    for step, loss in user.items():  # the JSONL row and the logger row of one batch: one x value
        if step in jsonl_rows:
            assert jsonl_rows[step] == pytest.approx(loss, rel=1e-5)
    assert any((s - 1) % 5 != 4 for s in want)  # event rows between logging steps
    # LearningRateMonitor shows the scheduler's LR; the applied one sits next to it on the same x
    sched = {r[x]: r["lr-AdamW"] for r in run.history if "lr-AdamW" in r}
    applied = {r[x]: (r[f"{M.LR}/group0"], r[M.LR_MULT]) for r in run.history if r.get(x) in user and M.LR_MULT in r}
    assert sorted(applied) == sorted(user) and applied[29][1] < 1
    for step, (lr, mult) in applied.items():
        assert lr == pytest.approx(sched[step] * mult, rel=1e-6)
    assert [a["level"] for a in run.alerts] == ["WARN"] and "step 18" in run.alerts[0]["text"]
    assert peak(run.summary["gradguard/action/rollback"]) == 1


class CountingLogger:
    """Factory for a real Lightning CSVLogger that records how ``log_metrics`` is called."""

    @staticmethod
    def make(save_dir: str):
        from lightning.pytorch.loggers import CSVLogger

        class Counting(CSVLogger):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.calls: list[tuple[tuple, dict]] = []

            def log_metrics(self, *args, **kwargs):
                self.calls.append((args, dict(kwargs)))
                metrics = kwargs["metrics"] if "metrics" in kwargs else args[0]
                return super().log_metrics(metrics, kwargs.get("step"))

        return Counting(save_dir)


def test_lightning_logger_calls_follow_log_every_n_steps(tmp_path):
    """12 optimizer steps of 2 micro-batches, log_every_n_steps=4, no event: gradguard's values
    reach each logger at Lightning's 3 logging steps (keyword arguments, the step of the user's
    train_loss), never through ``self.log``: the user's logged / callback metrics hold none of
    them; TensorBoardLogger with accumulation works."""
    tl = _lit()
    from lightning.pytorch.loggers import TensorBoardLogger

    from gradguard.lightning import GradGuardCallback

    counting = CountingLogger.make(str(tmp_path / "csv"))
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    cb = GradGuardCallback(tl.cfg(tmp_path, "monitor", output={"metrics_interval": 1}))
    trainer = tl.fit(tl.LitGPT(lr=1e-3), [cb], tmp_path=tmp_path, steps=12, logger=[counting, tb],
                     log_every_n_steps=4, accumulate_grad_batches=2)
    assert not event_steps(jsonl(cb.core.log_path))  # a quiet run: no event rows
    calls = counting.calls
    assert all(not args and set(kw) == {"metrics", "step"} for args, kw in calls)
    mine = [kw for _, kw in calls if any(k.startswith("gradguard/") for k in kw["metrics"])]
    assert [kw["step"] for kw in mine] == [3, 7, 11]
    users = [kw for _, kw in calls if "train_loss" in kw["metrics"]]
    assert [kw["step"] for kw in users] == [3, 7, 11]  # the same x as the user's self.log of that batch
    assert not any(k.startswith("gradguard/") for kw in users for k in kw["metrics"])
    assert not any(k.startswith("gradguard/") for k in [*trainer.logged_metrics, *trainer.callback_metrics,
                                                         *trainer.progress_bar_metrics])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars(M.GRAD_NORM)] == [3, 7, 11]
    assert [e.step for e in acc.Scalars("train_loss")] == [3, 7, 11]
    # the line runs (a colour per series) in the logger's version folder, the same points
    lines = _line_runs(tb.log_dir)
    assert lines[("grad_norm", M.GRAD_NORM)] == pytest.approx({e.step: e.value for e in acc.Scalars(M.GRAD_NORM)})


# -- plain loop -----------------------------------------------------------------------------------
def test_plain_loop_wandb_alerts_and_peaks(wandb_offline, tmp_path):
    from tests.test_sinks import NAN_STEP, _run_guard

    sink = gg.WandbSink(project="gradguard-test", dir=str(tmp_path))
    mem = _run_guard(tmp_path, sink)
    (run,) = read_runs(str(tmp_path))
    assert run.alerts and all(a["level"] == "WARN" for a in run.alerts)
    assert f"step {NAN_STEP}" in run.alerts[0]["text"]
    norms = [m[M.GRAD_NORM] for _, m in mem.metrics if M.GRAD_NORM in m and math.isfinite(m[M.GRAD_NORM])]
    assert peak(run.summary[M.GRAD_NORM]) == pytest.approx(max(norms))
    events = {row["_step"] for row in run.history if any(k.startswith(M.EVENT + "/") for k in row)}
    assert NAN_STEP in events


# -- console ----------------------------------------------------------------------------------------
def test_console_one_line_per_escalation_a_line_per_skip_and_a_full_summary(tmp_path):
    from tests.test_sinks import NAN_STEP, NAN_STEPS, _run_guard

    out = io.StringIO()
    console = gg.ConsoleSink(stream=out, skip_every=2)
    mem = _run_guard(tmp_path, console)
    lines = out.getvalue().splitlines()
    acted = {e["step"] for e in mem.events if e["type"] == "action" and e["name"] != "skip_data"}
    for step in acted:
        assert sum(line.startswith(f"[gradguard] step {step}:") for line in lines) == 1
    skip_lines = [line for line in lines if "skipped <-" in line]
    assert skip_lines and all(int(re.search(r"step (\d+)", line).group(1)) in NAN_STEPS for line in skip_lines)
    summary = next(line for line in lines if "summary:" in line)
    assert "final LR x" in summary and "clip " in summary and f"{mem.summary['skipped']} skipped" in summary
    assert any(line.startswith("[gradguard] log: ") and line.endswith(".jsonl") for line in lines)
    assert NAN_STEP in acted


_PTY_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    from tests.test_hf import make_trainer, inject, cfg
    from gradguard.hf import GradGuardCallback
    import pathlib
    tmp = pathlib.Path({tmp!r})
    cb = GradGuardCallback(cfg(tmp, output={{"console": True}}))
    from transformers import TrainerCallback
    import time

    class Slow(TrainerCallback):  # steps long enough for tqdm to redraw the bar between events
        def on_step_end(self, *a, **k):
            time.sleep(0.12)

    tr = make_trainer(tmp, [cb, Slow()], steps=40, logging_steps=10, disable_tqdm=False)
    inject(tr, {{15: 300.0, 16: 300.0, 27: float("nan")}})
    tr.train()
""")


def _render(raw: str) -> list[str]:
    """What a terminal shows in the end: a small screen model applying carriage returns, newlines,
    cursor up/down and line erasure (what tqdm and Rich use); other escapes are dropped."""
    screen: list[list[str]] = [[]]
    row = col = 0
    for tok in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[^\[]|\r|\n|[^\x1b\r\n]+", raw):
        if tok == "\r":
            col = 0
        elif tok == "\n":
            row += 1
            col = 0
            while len(screen) <= row:
                screen.append([])
        elif tok.startswith("\x1b["):
            n = int(re.sub(r"\D", "", tok[2:-1]) or 1) if tok[-1] in "AB" else 0
            if tok[-1] == "A":
                row = max(0, row - n)
            elif tok[-1] == "B":
                row += n
                while len(screen) <= row:
                    screen.append([])
            elif tok[-1] == "K":
                if tok[2:-1] == "2":
                    screen[row] = []
                elif tok[2:-1] in ("", "0"):
                    del screen[row][col:]
        elif not tok.startswith("\x1b"):
            line = screen[row]
            for ch in tok:
                if col < len(line):
                    line[col] = ch
                else:
                    line.extend(" " * (col - len(line)))
                    line.append(ch)
                col += 1
    return ["".join(line).rstrip() for line in screen]


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script is not installed")
def test_console_lines_never_share_a_line_with_the_progress_bar(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = tmp_path / "child.py"
    child.write_text(_PTY_CHILD.format(root=root, tmp=str(tmp_path)))
    # the pty that script opens has no size here: stty gives it one, else tqdm draws an empty bar
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    proc = subprocess.run(["script", "-q", "-e", "-c", f"stty cols 120 rows 40; {sys.executable} {child}", "/dev/null"], env=env,
                          capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    raw = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, raw[-3000:]
    lines = _render(raw)
    mine = [line for line in lines if "[gradguard]" in line]
    assert any("rollback" in line for line in mine) and any("summary:" in line for line in mine)
    bar = re.compile(r"\d+%\||it/s|s/it")
    mixed = [line for line in mine if bar.search(line) or not line.lstrip().startswith("[gradguard]")]
    assert not mixed, mixed[:3]
    printed = [line for line in lines if "'loss':" in line]
    assert len(printed) == 4 and all("gradguard/loss" in line for line in printed)
    assert not [line for line in lines if re.search(r"gradguard/(grad_norm/transformer|update_ratio|param_norm)", line)]


@pytest.mark.filterwarnings("ignore:gradguard halted training")
def test_plain_loop_halt_alert_is_a_tensorboard_text_entry(tmp_path):
    """A halt (a skip streak) sends an ERROR alert: in TensorBoard a text entry under
    ``gradguard/alerts`` at the halting step; the event row marks the halt there too."""
    from collections import OrderedDict

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), act=nn.Tanh(), head=nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False, "halt_raises": False},
                                policy={"max_skip_streak": 3})
    guard = gg.Guard(model, opt, config=cfg, sinks=[gg.TensorBoardSink(str(tmp_path / "tb"))])
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for i in range(1, 20):
        loss = nn.functional.mse_loss(model(x), y) * (float("nan") if i >= 6 else 1.0)
        loss.backward()
        report = guard.step(loss)
        opt.zero_grad(set_to_none=True)
        if report.halt:
            break
    assert report.halt
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith(M.ALERTS_TEXT)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    assert texts[-1][0] == report.step and texts[-1][1].startswith("**ERROR** gradguard: training halted")
    assert [e.step for e in acc.Scalars(f"{M.EVENT}/halt")] == [report.step]


_PTY_LIGHTNING = textwrap.dedent("""
    import sys, time, pathlib
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    import lightning.pytorch as L
    from tests import test_lightning as tl
    from gradguard.lightning import GradGuardCallback

    class Slow(L.Callback):  # batches long enough for the bar to redraw between events
        def on_train_batch_end(self, *a, **k):
            time.sleep(0.12)

    tmp = pathlib.Path({tmp!r})
    bar = L.callbacks.RichProgressBar() if {rich!r} else L.callbacks.TQDMProgressBar()
    cb = GradGuardCallback(tl.cfg(tmp, output={{"console": True}}))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=30, callbacks=[cb, Slow(), bar], logger=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp),
                        num_sanity_val_steps=0)
    trainer.fit(tl.LitGPT(lr=3e-3, spike_at=(12, 13), spike=300.0), tl.loader(8, 256))
""")


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script is not installed")
@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_lightning_console_lines_never_share_a_line_with_the_progress_bar(tmp_path, bar):
    _lit()
    if bar == "rich":
        pytest.importorskip("rich")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = tmp_path / "child.py"
    child.write_text(_PTY_LIGHTNING.format(root=root, tmp=str(tmp_path), rich=bar == "rich"))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    proc = subprocess.run(["script", "-q", "-e", "-c", f"stty cols 120 rows 40; {sys.executable} {child}", "/dev/null"],
                          env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    raw = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, raw[-3000:]
    lines = _render(raw)
    assert "12/30" in raw  # the bar was drawn around the events
    mine = [line for line in lines if "[gradguard]" in line]
    assert any("step 13: rollback" in line for line in mine) and any("summary:" in line for line in mine)
    bar_re = re.compile(r"\d+%\||it/s|s/it|━")
    mixed = [line for line in mine if bar_re.search(line) or not line.lstrip().startswith("[gradguard]")]
    assert not mixed, mixed[:3]
    assert sum("step 13:" in line for line in mine) == 1  # one line for the escalation step


def test_hf_wandb_only_run_keeps_its_event_log_in_the_wandb_run_files(wandb_offline, tmp_path, monkeypatch, capsys):
    """report_to=["wandb"] and no out_dir: the Trainer keeps no log folder, yet the event log is
    written into the W&B run's files folder (uploaded with the run), from its ``start`` record on,
    and the console summary names it and the ``gradguard report`` command."""
    from gradguard.hf import GradGuardCallback
    from gradguard.report import diagnose, read_log
    from tests.test_hf import inject, make_trainer

    monkeypatch.chdir(tmp_path)
    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": True}))
    trainer = make_trainer(tmp_path, [cb], steps=40, logging_steps=5, report_to=["wandb"])
    inject(trainer, {20: 300.0, 21: 300.0})
    trainer.train()
    run_dir = wandb_offline.run.dir
    wandb_offline.finish()
    log = cb.core.log_path
    assert log == os.path.join(run_dir, "gradguard", "events.jsonl")
    records = read_log(log)
    assert records[0]["type"] == "start" and records[0]["layers"] and records[-1]["type"] == "summary"
    assert records[-1]["log"] == log and cb.summary["log"] == log
    assert any(r["type"] == "action" for r in records) and diagnose(records)
    err = capsys.readouterr().err
    assert f"[gradguard] log: {log}" in err and f"[gradguard] report: gradguard report {log}" in err


def test_an_event_log_elsewhere_is_saved_to_the_wandb_run(wandb_offline, tmp_path):
    from gradguard.hf import GradGuardCallback
    from tests.test_hf import cfg, make_trainer

    cb = GradGuardCallback(cfg(tmp_path))
    make_trainer(tmp_path, [cb], steps=6, report_to=["wandb"]).train()
    files = wandb_offline.run.dir
    wandb_offline.finish()
    assert cb.core.log_path.startswith(str(tmp_path / "logs"))
    saved = os.path.join(files, "gradguard", "events.jsonl")
    assert os.path.exists(saved) and os.path.realpath(saved) == os.path.realpath(cb.core.log_path)


def test_hf_gradguard_loss_is_the_steps_loss_in_every_sink_and_the_print_switch(tmp_path, monkeypatch, capsys):
    """One meaning per key: ``train/gradguard/loss`` in TensorBoard (through HF's report_to) at a
    logging step is that step's loss, the JSONL value of the same step, not the window's mean (that
    is ``gradguard/loss_window_mean``, HF's own ``loss``). ``print_metrics=False`` keeps every
    gradguard key off the printed line; report_to still gets them."""
    from gradguard.hf import GradGuardCallback
    from tests.test_hf import cfg, make_trainer

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cb = GradGuardCallback(cfg(tmp_path, output={"metrics_interval": 1}))
    cb.print_metrics = False  # the switch (see docs/metrics.md)
    trainer = make_trainer(tmp_path, [cb], steps=20, logging_steps=5, report_to=["tensorboard"],
                           learning_rate=5e-3)
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == 4 and not any("gradguard/" in line for line in printed), printed
    jsonl_loss = {r["step"]: r[M.LOSS] for r in jsonl(cb.core.log_path) if r["type"] == "metrics" and M.LOSS in r}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_loss = {e.step: e.value for e in acc.Scalars("train/" + M.LOSS)}
    tb_mean = {e.step: e.value for e in acc.Scalars("train/" + M.LOSS_WINDOW_MEAN)}
    assert sorted(tb_loss) == [5, 10, 15, 20]
    # the Trainer writes these rows itself: the line runs (a colour per series) get the same points
    assert _line_runs(tmp_path / "tb")[("loss", M.LOSS)] == pytest.approx(tb_loss)
    for step, value in tb_loss.items():
        assert value == pytest.approx(jsonl_loss[step], rel=1e-6)
        window = [jsonl_loss[s] for s in range(step - 4, step + 1)]
        assert tb_mean[step] == pytest.approx(sum(window) / 5, rel=1e-5)
    assert any(abs(tb_loss[s] - tb_mean[s]) > 1e-4 for s in tb_loss)  # the two keys really differ


def test_every_sink_writes_the_same_value_for_the_same_key_at_the_same_step(wandb_offline, tmp_path):
    """A plain-loop run with JSONL, TensorBoard and W&B: every key every sink has, at every step,
    is the same value (TensorBoard keeps float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from .test_sinks import _read_wandb_run, _run_guard

    tb = gg.TensorBoardSink(str(tmp_path / "tb"))
    wb = gg.WandbSink(project="gradguard-test", dir=str(tmp_path))
    mem = _run_guard(tmp_path, [tb, wb])  # + the run's own JSONL log and a MemorySink
    log = next(p for p in (tmp_path / "gradguard").glob("*.jsonl"))
    jsonl_rows = {r["step"]: r for r in jsonl(str(log)) if r["type"] == "metrics"}
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    history, _ = _read_wandb_run(tmp_path)
    wb_rows = {r["_step"]: r for r in history if "_step" in r}
    checked = 0
    for step, m in mem.metrics:
        for key, value in m.items():
            want = float(value)
            j = jsonl_rows[step][key]
            j = float(j) if isinstance(j, str) else j
            assert (math.isnan(j) and math.isnan(want)) or j == pytest.approx(want, rel=1e-9), (key, step)
            t = {e.step: e.value for e in acc.Scalars(key)}[step]
            assert (math.isnan(t) and math.isnan(want)) or t == pytest.approx(want, rel=1e-6, abs=1e-7), (key, step)
            if math.isfinite(want):  # W&B leaves nan/inf out (the JSONL and the event points keep them)
                assert wb_rows[step][key] == pytest.approx(want, rel=1e-9), (key, step)
            checked += 1
    assert checked > 100
    assert any(key.startswith(M.LR_LOG10 + "/") for _, m in mem.metrics for key in m)  # the LR's log10 too
    # TensorBoard's line runs (a run per series of a multi-line chart): the same value, key and step
    lines = _line_runs(tmp_path / "tb")
    for (chart, key), points in lines.items():
        for step, t in points.items():
            want = float(dict(mem.metrics)[step][key])
            assert (math.isnan(t) and math.isnan(want)) or t == pytest.approx(want, rel=1e-6, abs=1e-7), (chart, key)
    assert sum(map(len, lines.values())) > 100
