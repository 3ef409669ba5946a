"""The examples the README points to, run end to end (shortened where they take long)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_hf_example_unguarded_diverges_guarded_recovers(capsys):
    pytest.importorskip("transformers")
    res = load("hf_trainer").main(["--compare"])  # the README's command: 60 steps each
    u, g = res["unguarded"], res["guarded"]
    assert g["eval_loss"] < 0.9 * u["eval_loss"], (u, g)
    assert g["actions"].get("rollback", 0) >= 1
    out = capsys.readouterr().out
    assert "unguarded: final eval loss" in out and "guarded  : final eval loss" in out


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
def test_rehearse_example_every_fault_fires_and_is_handled(tmp_path, capsys):
    ex = load("rehearse")
    res = ex.main(["--steps", "160", "--out", str(tmp_path / "run")])
    assert res["halted"] is None and res["finite"] and res["summary"]["steps"] == 160
    f = res["faults"]
    assert all(v["fired"] for v in f.values()), f
    assert "nonfinite_loss" in f["nan_loss"]["reaction"]
    assert {"rollback", "lower_lr"} <= set(f["lr_spike"]["reaction"])
    assert "oom_shrink_micro" in f["out_of_memory"]["reaction"]
    assert "overflow_streak" in f["overflow_streak"]["reaction"]
    assert "snapshot_io_error" in f["io_fault"]["reaction"]
    assert "fired at" in capsys.readouterr().out
    mon = ex.main(["--steps", "160", "--monitor", "--out", str(tmp_path / "mon")])
    acted = {a for v in mon["faults"].values() for a in v["reaction"]} & {"rollback", "lower_lr", "tighten_clip", "adam"}
    assert mon["halted"] is None and not acted
