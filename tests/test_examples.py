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
