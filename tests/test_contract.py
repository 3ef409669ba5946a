"""The engine contract: each scenario written once, run against every engine.

Engines: the plain loop (``gradguard.Guard``), a real ``transformers.Trainer`` and a real
``lightning.Trainer``, all training the same tiny network (same parameter names, so the same layer
names and metric names) on the same byte data, a few CPU steps each. A new engine joins by adding
one runner to ``tests/engines.py``; the scenarios do not change.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import gradguard as gg

from .engines import BS, ENGINES, RUNNERS, Data, Net, _build, _loss, actions, cfg, checkpoint_of, normalised, run_plain

pytestmark = pytest.mark.usefixtures("one_thread")


# -- scenarios -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_nan_step_is_skipped_with_weights_and_optimizer_state_bit_identical(tmp_path, engine):
    rec = RUNNERS[engine](tmp_path, cfg(tmp_path), steps=6, faults={4: float("nan")})
    assert rec.error is None
    assert torch.equal(rec.weights[4], rec.weights[3])  # the NaN step changed no weight
    assert torch.equal(rec.opt_state[4], rec.opt_state[3])  # nor Adam's moments or step count
    assert not torch.equal(rec.weights[5], rec.weights[4])  # training went on
    assert rec.core.skipped_steps == 1 and rec.core.applied_steps == 5
    assert rec.scheduler.last_epoch == 5  # the schedule did not move for the skipped step
    assert any(e["type"] == "finding" and e["kind"] == "nonfinite_loss" and e["step"] == 4 for e in rec.sink.events)


@pytest.mark.parametrize("engine", ENGINES)
def test_spike_rolls_back_and_the_lr_multiplier_survives_the_scheduler(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1}, lr={"rewarm_steps": 2})
    rec = RUNNERS[engine](tmp_path, c, steps=12, faults={7: 50.0, 8: 50.0}, opt_kind="sgd")
    assert rec.error is None
    rb = actions(rec, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == 8 and rb[0]["params"]["to_step"] == 3
    assert torch.equal(rec.weights[8], rec.weights[3])  # exactly the healthy snapshot's weights
    assert len(actions(rec, "lower_lr")) == 1
    mult = rec.core.lr.current()
    assert mult < 0.5
    for k in (11, 12):  # after the re-warm-up: effective LR = the scheduler's LR x the multiplier
        assert rec.eff_lr[k] == pytest.approx(rec.sched_lr[k] * mult, rel=1e-3)
    assert rec.sched_lr[12] < rec.sched_lr[9]  # the scheduler kept its own course (decaying)
    # never baked into the schedule: outside a step the optimizer holds the scheduler's own value
    assert rec.optimizer.param_groups[0]["lr"] == pytest.approx(rec.scheduler.get_last_lr()[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_three_spikes_on_unchanged_weights_roll_back_without_a_cut_and_return_on_trial(tmp_path, engine):
    """Past the detectors' warm-up at a decaying LR: the first two spikes are skipped, the third
    rolls back without an LR cut, and the next (clean) batch takes training back to the weights the
    rollback left, on trial (that step skipped): the weights of the last applied step before the spikes."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1}, detect={"warmup_steps": 3})
    rec = RUNNERS[engine](tmp_path, c, steps=13, faults={8: 50.0, 9: 50.0, 10: 50.0}, opt_kind="sgd")
    assert rec.error is None
    rb = actions(rec, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == 10 and rb[0]["params"]["ambiguous"] is True
    undo = actions(rec, "undo_rollback")
    assert len(undo) == 1 and undo[0]["step"] == 11 and undo[0]["params"]["trial"] is True
    assert not actions(rec, "lower_lr") and rec.core.lr.current() == 1.0
    assert torch.equal(rec.weights[11], rec.weights[7])  # back on the weights the spikes came on
    assert not torch.equal(rec.weights[12], rec.weights[11])  # and training went on from them
    assert rec.core.skipped_steps == 4


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("raises", [True, False])
def test_halt_writes_the_diagnosis_then_raises_or_only_stops(tmp_path, engine, raises):
    c = cfg(tmp_path, policy={"ladder": [["halt"]]}, recovery={"snapshot_interval": 0},
            output={"halt_raises": raises})
    if raises:
        rec = RUNNERS[engine](tmp_path, c, steps=12, faults={6: 50.0, 7: 50.0})
    else:
        with pytest.warns(gg.GradGuardWarning, match="gradguard halted"):
            rec = RUNNERS[engine](tmp_path, c, steps=12, faults={6: 50.0, 7: 50.0})
    assert isinstance(rec.error, gg.GradGuardHalt) is raises
    assert max(rec.weights) == 7  # training stopped at the halting step
    assert torch.equal(rec.weights[7], rec.weights[6])  # which was not applied
    path = rec.core.diagnosis_path
    assert path is not None and os.path.isfile(path)
    with open(path, encoding="utf-8") as fh:
        diag = json.load(fh)
    assert diag["step"] == 7 and diag["recent_findings"][-1]["kind"] == "loss_spike"
    if raises:
        assert rec.error.diagnosis["step"] == 7
    halts = [e for e in rec.sink.events if e["type"] == "halt"]
    assert len(halts) == 1 and halts[0]["step"] == 7


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_restores_the_guard_exactly(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    first = RUNNERS[engine](tmp_path, c, steps=8, faults={4: 50.0, 5: 50.0}, save_at=6)
    assert first.error is None and first.saved_state is not None
    assert first.saved_state["action_counts"].get("rollback") == 1  # a non-trivial state to restore
    resumed = RUNNERS[engine](tmp_path / "b", c, steps=7, resume_from=checkpoint_of(engine, tmp_path, 6))
    assert resumed.restored_state is not None
    want, got = normalised(first.saved_state), normalised(resumed.restored_state)
    if engine != "plain":
        # saved_state was read at the end of step 6, before the save: the checkpoint resumed from
        # joins the rollback tier (its step 6 entry, not yet confirmed), as in the run that wrote it
        ckpt = [e for e in got["checkpoints"] if e["step"] == 6]
        assert [(e["healthy"], e["tested"], e["bad"]) for e in ckpt] == [(0, False, False)]
        assert ckpt[0]["path"] == checkpoint_of(engine, tmp_path, 6)
        got["checkpoints"] = [e for e in got["checkpoints"] if e["step"] != 6]
    assert got == want
    assert resumed.core.step_count == 7 and resumed.core.lr.global_mult == first.saved_state["lr"]["global_mult"]


@pytest.mark.parametrize("engine", ENGINES)
def test_monitor_mode_is_bit_identical_to_no_guard(tmp_path, engine):
    faults = {4: 5.0}
    plain = RUNNERS[engine](tmp_path / "a", None, steps=6, faults=faults, guard=False)
    mon = RUNNERS[engine](tmp_path / "b", cfg(tmp_path, "monitor"), steps=6, faults=faults)
    for k in range(1, 7):
        assert torch.equal(plain.weights[k], mon.weights[k]) and torch.equal(plain.opt_state[k], mon.opt_state[k])
    assert mon.core.step_count == 6 and mon.core.skipped_steps == 0 and not mon.core.action_counts
    assert not any(mon.wrapped_training_step)  # monitor mode installs no training_step wrapper


def test_metric_names_are_identical_across_engines(tmp_path):
    names = {}
    for engine in ENGINES:
        # update ratios every step in every engine (HF measures them on its logging steps too)
        rec = RUNNERS[engine](tmp_path / engine, cfg(tmp_path / engine, measure={"log_interval": 1}), steps=3)
        assert rec.sink.metrics, engine
        names[engine] = set().union(*(m.keys() for _, m in rec.sink.metrics))
    assert names["plain"] == names["hf"] == names["lightning"]
    assert "gradguard/grad_norm/total" in names["plain"] and any("/grad_norm/block" in n for n in names["plain"])


@pytest.mark.parametrize("preset", ["default", "monitor"])
@pytest.mark.parametrize("engine", ENGINES)
def test_trust_rule_is_the_same_in_every_engine(tmp_path, engine, preset):
    """A checkpoint is trusted after recovery.confirm_steps healthy steps (3 here), in every engine;
    monitor mode judges checkpoints as the default does (it observes everything, only does not act)."""
    c = cfg(tmp_path, preset, recovery={"snapshot_interval": 0, "confirm_steps": 3})
    rec = RUNNERS[engine](tmp_path, c, steps=6, save_at=2)
    tier = {e["step"]: e for e in rec.core.checkpoint_tier.state_dict()}
    assert tier[2]["tested"] and tier[2]["healthy"] == 3  # steps 3, 4, 5 confirmed it
    assert 4 in tier and not tier[4]["tested"] and tier[4]["healthy"] == 2  # only steps 5 and 6 so far
    assert all(not math.isnan(e["step"]) for e in tier.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_the_guard_takes_no_action_in_is_the_users_clipped_run_bit_for_bit(tmp_path, engine):
    """Default preset, a healthy run clipped at every step: the guard's own clip scales the
    gradients exactly as ``clip_grad_norm_(model.parameters(), max_norm)`` does (same norms, same
    coefficient, same kernels), so the weights and the optimizer state equal, digit for digit, those
    of the run without a guard that clips at the same norm (not an ulp away, which a long chaotic
    run turns into a different final loss)."""
    max_norm = 1e-3  # below every step's norm: every step is clipped
    ref = RUNNERS[engine](tmp_path / "a", None, steps=6, engine_clip=max_norm, guard=False)
    over = {"engine_clip": max_norm} if engine != "plain" else {}
    rec = RUNNERS[engine](tmp_path / "b", cfg(tmp_path / "b", clip={"max_norm": max_norm, "floor": max_norm}), steps=6, **over)
    assert not rec.core.action_counts and rec.core.skipped_steps == 0
    assert rec.core.clip.clipped == 6  # the guard clipped every step itself
    for k in range(1, 7):
        assert torch.equal(ref.weights[k], rec.weights[k]) and torch.equal(ref.opt_state[k], rec.opt_state[k]), k


@pytest.mark.parametrize("engine", ["hf", "lightning"])
def test_clip_conflict_is_resolved_the_same_way_in_every_engine(tmp_path, engine):
    """The engine's clip setting becomes the guard's starting clip.max_norm; set both differently: error."""
    adopted = RUNNERS[engine](tmp_path / "a", cfg(tmp_path / "a"), steps=2, engine_clip=0.3)
    assert adopted.core.clip.max_norm == 0.3 and adopted.core.max_grad_norm == 0.3
    with pytest.raises(gg.ConfigError, match=r"0\.3.*conflicts with GuardConfig.clip.max_norm=0\.5.*Fix:"):
        RUNNERS[engine](tmp_path / "b", cfg(tmp_path / "b", clip={"max_norm": 0.5}), steps=2, engine_clip=0.3)
    # the guard does not clip (monitor): the engine's own clipping is left in force, as without a guard
    mon = RUNNERS[engine](tmp_path / "c", cfg(tmp_path / "c", "monitor"), steps=3, engine_clip=0.3, faults={2: 5.0})
    ref = RUNNERS[engine](tmp_path / "d", None, steps=3, engine_clip=0.3, guard=False, faults={2: 5.0})
    assert mon.core.max_grad_norm is None and torch.equal(mon.weights[3], ref.weights[3])


def test_refusal_is_an_error_when_acting_and_a_stand_aside_warning_in_monitor_mode():
    """The refusal rule every adapter applies to a setup it cannot guard (DeepSpeed, FSDP, LOMO)."""
    from gradguard.adapter import refuse_unsupported

    problems = {"Trainer(strategy=DeepSpeedStrategy)": "DeepSpeed steps inside its engine. Fix: train with DDP"}
    with pytest.raises(gg.UnsupportedSetupError, match="DeepSpeedStrategy.*Fix: train with DDP"):
        refuse_unsupported(gg.GuardConfig(), problems)
    with pytest.warns(gg.GradGuardWarning, match="stands aside"):
        assert refuse_unsupported(gg.GuardConfig.preset("monitor"), problems) is False
    assert refuse_unsupported(gg.GuardConfig(), {}) is True


@pytest.mark.parametrize("preset", ["default", "monitor"])
def test_an_optimizer_less_module_trains_with_one_warning_and_the_guard_aside(tmp_path, monkeypatch, preset):
    """configure_optimizers returning None: Lightning trains with its mock optimizer (and a warning of
    its own); the guard has nothing to watch, says so once and stands aside in every mode: fit is never
    stopped by it."""
    import warnings

    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    class NoOpt(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            _build(self)

        def training_step(self, batch, batch_idx):
            return _loss(self, batch["input_ids"], batch["labels"])

        def configure_optimizers(self):
            return None

    monkeypatch.chdir(tmp_path)
    cb = GradGuardCallback(gg.GuardConfig.preset(preset))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[cb], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NoOpt(), torch.utils.data.DataLoader(Data(16), batch_size=BS))
    ours = [w for w in caught if issubclass(w.category, gg.GradGuardWarning)]
    assert len(ours) == 1 and "stands aside" in str(ours[0].message), [str(w.message) for w in ours]
    assert "configure_optimizers" in str(ours[0].message)
    assert cb.core is None and trainer.global_step == 2  # the run Lightning accepts is not stopped
    assert os.listdir(tmp_path) == []  # and nothing of gradguard's was written


def test_stateful_pieces_round_trip_their_state(tmp_path):
    from gradguard._hf.steps import StepRunner
    from gradguard.recovery import CheckpointTier

    tier = CheckpointTier(2)
    tier.saved(3, ["a.ckpt"])
    tier.saved(6, ["b.ckpt"])
    tier.observe(4, healthy=True, bad=False)
    tier.observe(5, healthy=True, bad=False)
    tier.observe(7, healthy=False, bad=True)
    again = CheckpointTier(2)
    again.load_state_dict(json.loads(json.dumps(tier.state_dict())))
    assert again.state_dict() == tier.state_dict() and [e["step"] for e in again.candidates()] == [3]
    runner = StepRunner(core=None, args=None, params=[])
    runner.discard_left, runner.splits, runner.last_step_loss = 2, 4, 1.5
    other = StepRunner(core=None, args=None, params=[])
    other.load_state_dict(json.loads(json.dumps(runner.state_dict())))
    assert other.state_dict() == runner.state_dict()
    rec = run_plain(tmp_path, cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1}), steps=6,
                    faults={3: 50.0, 4: 50.0})
    state = json.loads(json.dumps(rec.guard.state_dict()))
    net = Net()
    from gradguard.data import BatchController

    fresh = gg.Guard(net, torch.optim.AdamW(net.parameters()), config=cfg(tmp_path / "x"),
                     batches=BatchController(Data(), BS, shuffle=False))
    with pytest.warns(gg.GradGuardWarning, match="resumed with recovery.snapshot_interval=50"):
        fresh.load_state_dict(state)  # another config: each changed field is warned (gradguard.resume)
    got = normalised(fresh.state_dict())
    assert got.pop("config") == fresh.config.to_dict()  # the config in force is the new guard's own
    state.pop("config")
    assert got == normalised(state)


@pytest.mark.parametrize("engine", ENGINES)
def test_rollback_falls_back_to_the_newest_trusted_engine_checkpoint(tmp_path, engine):
    """No in-memory snapshot: the rollback restores the engine's own checkpoint through its
    CheckpointSource (the plain loop's is the test's ``PlainCheckpoints``), the newest one that
    a healthy step confirmed (checkpoint 4 was followed by a spike: bad for good)."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 1})
    rec = RUNNERS[engine](tmp_path, c, steps=8, faults={5: 50.0, 6: 50.0}, opt_kind="sgd", save_at=2)
    assert rec.error is None
    rb = actions(rec, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == 6
    assert rb[0]["params"]["to_step"] == 2 and rb[0]["params"]["source"] == "checkpoint"
    assert torch.equal(rec.weights[6], rec.weights[2])  # exactly the checkpoint's weights
    assert torch.equal(rec.opt_state[6], rec.opt_state[2])
    assert not torch.equal(rec.weights[8], rec.weights[6])  # training went on from there
    tier = {e["step"]: e for e in rec.core.checkpoint_tier.state_dict()}
    assert 4 not in tier  # the bad one was dropped with everything after the restored step


def oom_above(limit: int, from_step: int, fired: list[int]):
    """A hook that makes the model's embedding raise ``torch.OutOfMemoryError`` for micro-batches
    larger than ``limit`` from optimizer step ``from_step`` on."""

    def install(model: nn.Module, step_fn) -> None:
        def pre(module, args):
            if module.training and step_fn() >= from_step and args[0].shape[0] > limit:
                fired.append(step_fn())
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {args[0].shape[0]} samples)")

        model.embed.register_forward_pre_hook(pre)

    return install


@pytest.mark.parametrize("engine", ENGINES)
def test_out_of_memory_is_retried_in_pieces_with_the_same_result(tmp_path, engine):
    """One rule (gradguard.oom) in every engine: the failed samples run again in halves, weighted
    by their share, and the engine's micro-batch shrinks to what fitted; nothing is lost or skipped."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 0})
    ref = RUNNERS[engine](tmp_path / "ref", c, steps=6, opt_kind="sgd")
    fired: list[int] = []
    rec = RUNNERS[engine](tmp_path / "oom", c, steps=6, opt_kind="sgd", hooks=[oom_above(BS // 2, 3, fired)])
    assert rec.error is None and fired and fired[0] == 3
    ooms = [e for e in rec.sink.events if e["type"] == "action" and e["name"].startswith("oom")]
    first = ooms[0]
    assert first["name"] == "oom_shrink_micro" and first["step"] == 3
    assert first["params"]["micro_batch"] == [BS, BS // 2] and first["params"]["pieces"] == 2
    assert first["params"]["in"] == "forward" and not first["params"]["step_skipped"]
    # a batch the engine had already drawn at the old size is split the same way (Lightning prefetches)
    assert all(e["name"] == "oom_retry" and e["params"]["micro_batch"] == [BS, BS] for e in ooms[1:])
    assert rec.core.skipped_steps == 0 and rec.core.step_count == 6
    for k in range(1, 7):  # the same samples, the same weights (up to float rounding of the split sums)
        assert torch.allclose(rec.weights[k], ref.weights[k], atol=1e-6), k


@pytest.mark.parametrize("engine", ENGINES)
def test_batch_shrinks_with_linear_lr_scaling_and_grows_back(tmp_path, engine):
    """The ``shrink_batch`` rung halves the engine's batch through its loader handle with the LR
    scaled linearly, and a stable period doubles it back."""
    c = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]},
            recovery={"snapshot_interval": 0, "grow_after": 3, "grow_clip": 0.1, "grow_clip_steps": 2})
    rec = RUNNERS[engine](tmp_path, c, steps=11, faults={4: 50.0, 5: 50.0}, opt_kind="sgd")
    assert rec.error is None
    shrink, grow = actions(rec, "shrink_batch"), actions(rec, "grow_batch")
    assert len(shrink) == 1 and shrink[0]["step"] == 5 and shrink[0]["params"]["batch"] == [BS, BS // 2]
    assert len(grow) == 1 and grow[0]["step"] == 8 and grow[0]["params"]["batch"] == [BS // 2, BS]
    for k in (6, 7, 8):  # half the batch, half the LR (inside the step only)
        assert rec.eff_lr[k] / rec.sched_lr[k] == pytest.approx(0.5, rel=1e-3)
    for k in (10, 11):
        assert rec.eff_lr[k] > 0 and rec.sched_lr[k] > 0
    assert rec.core.lr.batch_scale == 1.0


@pytest.mark.parametrize("engine", ENGINES)
def test_an_lr_cut_lifts_once_the_glitch_it_answered_has_passed(tmp_path, engine):
    """The scheduler's LR x30 for its steps 5-8, spikes at steps 7 and 8: a rollback with an LR
    cut, and once the schedule falls back (the scheduler held on the two skipped steps) the cut
    lifts: the updates run at the schedule's own LR again."""
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1}, lr={"rewarm_steps": 0})
    rec = RUNNERS[engine](tmp_path, c, steps=14, faults={7: 50.0, 8: 50.0}, opt_kind="sgd", glitch=(5, 9))
    assert rec.error is None
    assert [a["step"] for a in actions(rec, "lower_lr")] == [8]
    assert [a["step"] for a in actions(rec, "lift_lr")] == [12]  # the scheduler's step 9
    assert rec.eff_lr[9] < 0.31 * rec.sched_lr[9]  # inside the glitch: the cut (this early, the deep one)
    for k in (12, 13, 14):  # after it: the schedule's own LR
        assert rec.eff_lr[k] == pytest.approx(rec.sched_lr[k], rel=1e-6)
    assert rec.core.lr.global_mult == 1.0
