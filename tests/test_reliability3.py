"""Reliability, round three (issue 28): what the user configured is what runs, states checked
against their range and checkpoint, forgotten lines of the old loop, blind spots named, files that
are not followed through symlinks, clear errors, dead runs' snapshot folders reclaimed."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradguard as gg

from .engines import RUNNERS, cfg, checkpoint_of


def _messages(rec) -> list[str]:
    return [str(w.message) for w in rec]


# -- 1. the configured clip runs ------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["hf", "lightning"])
@pytest.mark.parametrize("preset,clip,expected", [("default", {"max_norm": 0.3}, 0.3), ("conservative", {}, 0.5)])
def test_configured_clip_wins_over_the_engine_default(tmp_path, engine, preset, clip, expected):
    """The engine's clip left at its default (HF max_grad_norm=1.0, Lightning gradient_clip_val=None):
    gradguard's configured clip is the one in force and in the report, with no warning."""
    over = {"clip": clip} if clip else {}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run = RUNNERS[engine](tmp_path, cfg(tmp_path, preset, **over), steps=3, faults={2: 40.0})
    assert run.error is None
    assert run.core.clip.max_norm == expected and run.core.max_grad_norm == expected
    assert run.core.config.clip.max_norm == expected
    logged = [m.get("gradguard/max_grad_norm") for _, m in run.sink.metrics]
    assert logged and all(v == expected for v in logged)  # what the report/metrics say is what ran
    if engine == "hf":
        assert [r.clip_to for r in run.callback.reports] == [expected] * 3
    assert not [m for m in _messages(rec) if "max_grad_norm" in m or "gradient_clip_val" in m]


def test_hf_clip_explicit_default_value_vs_trainer_setting_warns_which_won(tmp_path):
    """clip.max_norm written out as 1.0 (a dumped full config) with max_grad_norm=0.4: the Trainer's
    value runs and a warning names both and the winner."""
    with pytest.warns(gg.GradGuardWarning, match=r"max_grad_norm=0\.4 and GuardConfig\.clip\.max_norm=1\.0 were "
                                                 r"both set; the guard clips at .*0\.4"):
        run = RUNNERS["hf"](tmp_path, cfg(tmp_path, clip={"max_norm": 1.0}), steps=2, engine_clip=0.4)
    assert run.core.clip.max_norm == 0.4


@pytest.mark.parametrize("engine", ["hf", "lightning"])
def test_resume_with_a_new_configured_clip_applies_it_and_warns(tmp_path, engine):
    """Saved with the default clip (tightened by the policy), resumed with clip.max_norm=0.3 and the
    engine's clip at its default: 0.3 is in force and the change is among the resume warnings."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    first = RUNNERS[engine](tmp_path, c, steps=6, faults={4: 50.0, 5: 50.0}, save_at=6)
    assert first.saved_state is not None
    c2 = cfg(tmp_path / "b", recovery={"snapshot_interval": 2, "confirm_steps": 1}, clip={"max_norm": 0.3})
    with pytest.warns(gg.GradGuardWarning, match=r"resumed with clip\.max_norm=0\.3, the saved run used "
                                                 r"clip\.max_norm=1\.0"):
        resumed = RUNNERS[engine](tmp_path / "b", c2, steps=7, resume_from=checkpoint_of(engine, tmp_path, 6))
    assert resumed.core.clip.max_norm <= 0.3 and resumed.core.config.clip.max_norm == 0.3
