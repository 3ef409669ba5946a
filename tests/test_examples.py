"""The examples the README points to, run end to end (shortened where they take long)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _examples_own_environ():
    """The examples run in this process and set variables for their run (TENSORBOARD_LOGGING_DIR,
    WANDB_*), as a script may: they are put back after each test so no later test inherits them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_hf_example_unguarded_diverges_guarded_recovers(capsys, tmp_path, monkeypatch, wandb_offline):
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out_dir = tmp_path / "out"
    # the README's command: 60 steps each, TensorBoard and offline W&B
    res = load("hf_trainer").main(["--compare", "--out", str(out_dir), "--tensorboard", "--wandb"])
    u, g = res["unguarded"], res["guarded"]
    assert g["eval_loss"] < 0.9 * u["eval_loss"], (u, g)
    assert g["actions"].get("rollback", 0) >= 1
    out = capsys.readouterr().out
    assert "unguarded: final eval loss" in out and "guarded  : final eval loss" in out
    summary = [line for line in out.splitlines() if line.startswith(("unguarded:", "guarded  :"))]
    assert len(summary) == 2 and not any("{" in line for line in summary)  # readable lines, not a raw dict
    log = out_dir / "guarded" / "gradguard" / "events.jsonl"
    assert g["log"] == str(log) and log.is_file() and f"gradguard report {log}" in out
    from .test_diagnosis import check_log_file

    lines = check_log_file(log)  # the written diagnosis, each sentence true of the guarded run's log
    assert "The guard rolled back" in " ".join(lines)
    assert list((out_dir / "guarded" / "tb").glob("events.out.tfevents.*"))
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2  # one W&B run per arm
    assert not list(cwd.iterdir())  # nothing left in the working directory


@pytest.mark.slow
def test_lightning_example_unguarded_vs_guarded(tmp_path):
    pytest.importorskip("lightning")
    ex = load("lightning_gpt")
    import gradguard as gg

    data = ex.ByteBatches(ex.load_corpus(), 32)
    kw = dict(steps=25, batch_size=64, seed=0, data=data, out=str(tmp_path))
    u = ex.run(None, **kw)
    g = ex.run(gg.GuardConfig.preset("default", output={"dir": str(tmp_path / "guarded"), "console": False}), **kw)
    assert u["steps"] == g["steps"] == 25
    assert g["eval_loss"] < 0.95 * u["eval_loss"], (u["eval_loss"], g["eval_loss"])
    assert g["guard"]["actions"]


@pytest.mark.slow
def test_lightning_example_main_prints_a_summary_line_and_writes_under_out(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r = load("lightning_gpt").main(["--steps", "12", "--out", str(tmp_path / "out"), "--tensorboard"])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("guarded    final eval loss")]
    assert "{" not in line and "gradguard actions: " in line  # a readable line, not a raw dict
    log = tmp_path / "out" / "guarded" / "gradguard" / "events.jsonl"
    assert r["guard"]["log"] == str(log) and f"gradguard report {log}" in out
    assert list((tmp_path / "out" / "tb").rglob("events.out.tfevents.*"))
    assert not list(cwd.iterdir())


@pytest.mark.slow
def test_rehearse_example_every_fault_fires_and_is_handled(tmp_path, capsys):
    ex = load("rehearse")
    res = ex.main(["--steps", "120", "--out", str(tmp_path / "run"), "--no-progress"])
    assert res["halted"] is None and res["finite"] and res["summary"]["steps"] == 120
    f = res["faults"]
    assert all(v["fired"] for v in f.values()), f
    assert "nonfinite_loss" in f["nan_loss"]["reaction"]
    assert {"rollback", "lower_lr"} <= set(f["lr_spike"]["reaction"])
    assert "oom_shrink_micro" in f["out_of_memory"]["reaction"]
    assert "overflow_streak" in f["overflow_streak"]["reaction"]
    assert "snapshot_io_error" in f["io_fault"]["reaction"]
    assert "fired at" in capsys.readouterr().out
    # monitor: every fault still fires (they are placed at fractions of the run), none is acted on
    mon = ex.main(["--steps", "60", "--monitor", "--out", str(tmp_path / "mon"), "--tensorboard"])
    assert all(v["fired"] for v in mon["faults"].values()), mon["faults"]
    assert list((tmp_path / "mon" / "tb").glob("events.out.tfevents.*"))
    acted = {a for v in mon["faults"].values() for a in v["reaction"]} & {"rollback", "lower_lr", "tighten_clip", "adam"}
    assert mon["halted"] is None and not acted
