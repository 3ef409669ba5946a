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


# -- 2. guard states range-checked and tied to their checkpoint -----------------------------------------
def _guard(quiet_cfg, **over):
    from .conftest import TinyNet

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return gg.Guard(model, opt, config=quiet_cfg(**over)), model, opt


def _trained_state(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt = _guard(quiet_cfg, detect={"warmup_steps": 2})
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        loss = model(*make_batch(gen))
        (loss * (float("nan") if i == 4 else 30.0 if i == 6 else 1.0)).backward()  # a NaN step and a spike
        guard.step(loss * (float("nan") if i == 4 else 1.0))
        opt.zero_grad()
    state = guard.state_dict()
    guard.close()
    return state


@pytest.mark.parametrize("path,value", [
    ("lr.global_mult", 1e6), ("lr.global_mult", float("nan")), ("lr.global_ceiling", 2.0), ("lr.batch_scale", float("inf")),
    ("step_count", 10 ** 30), ("applied_steps", -1), ("skipped_steps", 10 ** 6), ("n_findings", -3),
    ("clip.max_norm", float("nan")), ("clip.count", -2), ("clip.var", float("inf")), ("policy.level", -1),
    ("policy.skip_streak", 10 ** 20), ("detectors.loss.base.mean", float("nan")), ("lr.warm_left", -5),
    ("action_counts.skip", 10 ** 40),
])
def test_out_of_range_state_is_refused_naming_the_field_before_anything_is_applied(quiet_cfg, path, value):
    import copy

    state = _trained_state(quiet_cfg)
    bad = copy.deepcopy(state)
    *parents, leaf = path.split(".")
    node = bad
    for p in parents:
        node = node[p]
    node[leaf] = value
    guard, _, _ = _guard(quiet_cfg)
    before = guard.state_dict()
    name = leaf if not parents or parents[0] in ("action_counts",) else path
    with pytest.raises(gg.StateError, match=rf"{name.split('.')[-1]}.*must be"):
        guard.load_state_dict(bad)
    assert guard.state_dict() == before  # nothing applied
    guard.load_state_dict(state)  # the intact state (after a NaN step and a spike) loads
    assert guard.step_count == 8
    guard.close()


@pytest.mark.parametrize("engine", ["hf", "lightning"])
@pytest.mark.parametrize("preset", ["default", "monitor"])
def test_guard_state_of_another_checkpoint_is_refused_or_started_fresh(tmp_path, engine, preset):
    """checkpoint-4 resumed with the guard state of checkpoint-8 (copied over it): acting, a StateError
    naming both steps before anything is changed; monitor mode, a warning and a fresh guard."""
    import json
    import os
    import shutil

    c = cfg(tmp_path, preset, recovery={"snapshot_interval": 0})
    RUNNERS[engine](tmp_path, c, steps=8, save_at=4)
    old, new = checkpoint_of(engine, tmp_path, 4), checkpoint_of(engine, tmp_path, 8)
    if engine == "hf":
        shutil.copy(os.path.join(new, "gradguard_state.json"), os.path.join(old, "gradguard_state.json"))
        with open(os.path.join(old, "trainer_state.json")) as fh:
            ts = json.load(fh)
        with open(os.path.join(new, "trainer_state.json")) as fh:
            ts["stateful_callbacks"] = json.load(fh)["stateful_callbacks"]
        with open(os.path.join(old, "trainer_state.json"), "w") as fh:
            json.dump(ts, fh)
    else:
        a = torch.load(old, weights_only=True)
        b = torch.load(new, weights_only=True)
        a["callbacks"] = {k: v for k, v in b["callbacks"].items() if k.startswith("GradGuard")} | {
            k: v for k, v in a["callbacks"].items() if not k.startswith("GradGuard")}
        torch.save(a, old)
    c2 = cfg(tmp_path / "b", preset, recovery={"snapshot_interval": 0})
    if preset == "default":
        with pytest.raises(gg.StateError, match=r"step_count=8 .*global step is 4.*Fix: resume from the checkpoint"):
            RUNNERS[engine](tmp_path / "b", c2, steps=6, resume_from=old)
        return
    with pytest.warns(gg.GradGuardWarning, match=r"step_count=8 .*global step is 4.*fresh guard state"):
        run = RUNNERS[engine](tmp_path / "b", c2, steps=6, resume_from=old)
    assert run.error is None and run.core.step_count == 6
