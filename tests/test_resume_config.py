"""Resuming with a changed config (issue 12): the state comes back by a stable key, the new config
is in force, what the run learned is kept, and each conflict is warned once naming the field, the
saved value and the new value (the rule: gradguard/resume.py, README "Resuming with a changed
config")."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import gradguard as gg

from .conftest import TinyNet, make_batch
from .engines import RUNNERS, cfg, checkpoint_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _saved_state(tmp_path, tighten: bool, **over):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = gg.Guard(model, opt, config=gg.GuardConfig.preset(
        "default", output={"dir": str(tmp_path / "a"), "console": False}, **over))
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        loss = model(*make_batch(gen))
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    guard.core.lr.lower()  # the rescue a resume must keep
    if tighten:
        guard.core.clip.tighten()  # 1.0 -> 0.5
    state = json.loads(json.dumps(guard.state_dict()))
    guard.close()
    return state, model, opt


def _resume(tmp_path, state, model, opt, **over):
    sink = gg.MemorySink()
    config = gg.GuardConfig.preset(over.pop("preset", "default"),
                                   output={"dir": str(tmp_path / "b"), "console": False, **over.pop("output", {})},
                                   **over)
    guard = gg.Guard(model, opt, config=config, sinks=[sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.load_state_dict(state)
    return guard, [str(w.message) for w in caught if "resumed with" in str(w.message)], sink


def test_a_new_clip_max_norm_takes_effect_and_the_learned_state_is_kept(tmp_path):
    state, model, opt = _saved_state(tmp_path, tighten=False)
    mult = state["lr"]["global_mult"]
    guard, warned, sink = _resume(tmp_path, state, model, opt, clip={"max_norm": 2.0})
    assert guard.core.clip.max_norm == 2.0  # not ignored: a clip that was not tightened takes the new value
    assert guard.core.lr.global_mult == mult < 1 and guard.core.step_count == 4  # the rescue is kept
    assert warned == [w for w in warned if "clip.max_norm=2.0" in w and "clip.max_norm=1.0" in w] and len(warned) == 1
    ev = [e for e in sink.events if e["type"] == "resume_config_change"]
    assert [(e["field"], e["old"], e["new"]) for e in ev] == [("clip.max_norm", 1.0, 2.0)]
    guard.close()


def test_a_tightened_clip_is_kept_under_the_new_ceiling_and_relaxes_toward_it(tmp_path):
    state, model, opt = _saved_state(tmp_path, tighten=True, clip={"relax_after": 2})
    guard, warned, _ = _resume(tmp_path / "up", state, model, opt, clip={"max_norm": 3.0, "relax_after": 2})
    assert guard.core.clip.max_norm == 0.5 and len(warned) == 1 and "tightened clip 0.5 is kept" in warned[0]
    for _ in range(4):  # relaxes (x2 every 2 healthy steps) up to the new ceiling, not the old one
        guard.core.clip.tick_healthy()
    assert guard.core.clip.max_norm == 2.0
    guard.close()
    state, model, opt = _saved_state(tmp_path / "2", tighten=True)
    guard, warned, _ = _resume(tmp_path / "down", state, model, opt, clip={"max_norm": 0.2})
    assert guard.core.clip.max_norm == 0.2  # a lower ceiling wins over the tightened value
    guard.close()


def test_output_changes_are_silent_and_other_conflicts_each_warned_once(tmp_path):
    state, model, opt = _saved_state(tmp_path, tighten=False)
    guard, warned, _ = _resume(tmp_path, state, model, opt, output={"console": True, "metrics_interval": 3})
    assert warned == []  # where and how a run reports is no conflict
    guard.close()
    ladder = [["rollback", "lower_lr"], ["halt"]]
    guard, warned, _ = _resume(tmp_path / "c", state, model, opt, lr={"down_factor": 0.5, "min_multiplier": 0.5},
                               policy={"ladder": ladder}, detect={"loss_sigma": 4.0})
    fields = sorted(w.split("resumed with ")[1].split("=")[0] for w in warned)
    assert fields == ["detect.loss_sigma", "lr.down_factor", "lr.min_multiplier", "policy.ladder"]
    assert guard.core.lr.global_mult == 0.5  # raised to the new minimum multiplier
    assert guard.config.detect.loss_sigma == 4.0 and guard.core.policy.cfg.ladder == ladder  # in force
    guard.close()
    guard, warned, _ = _resume(tmp_path / "m", state, model, opt, preset="monitor")
    assert any("policy.act=False" in w and "only watches" in w for w in warned)
    guard.close()


@pytest.mark.parametrize("engine", ["lightning", "hf"])
def test_engine_resume_with_a_changed_config_keeps_the_guard_state(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    first = RUNNERS[engine](tmp_path, c, steps=6, faults={4: 50.0, 5: 50.0}, save_at=6)
    saved = first.saved_state
    assert saved is not None and saved["lr"]["global_mult"] < 1  # the rescue to keep
    # resumed with another console/output folder and another clip (HF: the Trainer's max_grad_norm)
    c2 = cfg(tmp_path / "b", recovery={"snapshot_interval": 2, "confirm_steps": 1},
             output={"console": True}, **({"clip": {"max_norm": 0.5}} if engine == "lightning" else {}))
    with pytest.warns(gg.GradGuardWarning, match=r"resumed with clip\.max_norm=0\.5, the saved run used "
                                                 r"clip\.max_norm=1\.0") as rec:
        resumed = RUNNERS[engine](tmp_path / "b", c2, steps=7, resume_from=checkpoint_of(engine, tmp_path, 6),
                                  engine_clip=0.5 if engine == "hf" else None)
    assert sum("resumed with" in str(w.message) for w in rec) == 1  # output.console: silent
    assert resumed.restored_state is not None  # found under the stable key despite the changed config
    assert resumed.restored_state["lr"]["global_mult"] == saved["lr"]["global_mult"]
    assert resumed.restored_state["action_counts"] == saved["action_counts"]
    assert resumed.core.clip.max_norm == 0.5 and resumed.core.step_count == 7


def test_lightning_checkpoint_keyed_by_a_config_hash_still_restores(tmp_path):
    """Checkpoints of gradguard <= 0.1 keyed the state by a hash of the config."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    first = RUNNERS["lightning"](tmp_path, c, steps=6, faults={4: 50.0, 5: 50.0}, save_at=6)
    path = checkpoint_of("lightning", tmp_path, 6)
    ck = torch.load(path, map_location="cpu", weights_only=True)
    (key,) = [k for k in ck["callbacks"] if k.startswith("GradGuardCallback")]
    assert key == "GradGuardCallback{'name': 'default'}"  # the stable key
    ck["callbacks"]["GradGuardCallback{'name': '0123456789'}"] = ck["callbacks"].pop(key)
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save(ck, legacy)
    resumed = RUNNERS["lightning"](tmp_path / "b", c, steps=7, resume_from=legacy)
    assert resumed.restored_state["lr"]["global_mult"] == first.saved_state["lr"]["global_mult"] < 1
    # resumed as a monitor (key 'monitor'): the acting guard's entry is the only one, it is adopted
    with pytest.warns(gg.GradGuardWarning, match=r"resumed with policy\.act=False.*only watches"):
        watched = RUNNERS["lightning"](tmp_path / "c", cfg(tmp_path / "c", "monitor"), steps=7, resume_from=path)
    assert watched.callback.state_key == "GradGuardCallback{'name': 'monitor'}"
    assert watched.restored_state["lr"]["global_mult"] == first.saved_state["lr"]["global_mult"]


def test_a_saved_config_of_the_wrong_kind_does_not_break_the_load(tmp_path):
    state, model, opt = _saved_state(tmp_path, tighten=False)
    state["config"]["clip"]["max_norm"] = "big"  # hand-edited: the new config simply holds
    guard, warned, _ = _resume(tmp_path, state, model, opt)
    assert guard.core.clip.max_norm == 1.0 and guard.core.step_count == 4 and len(warned) == 1
    guard.close()
