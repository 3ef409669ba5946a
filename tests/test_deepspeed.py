"""DeepSpeed ZeRO 1/2 in a plain loop: ``gg.Guard(engine)``, two gloo processes on the CPU
(tests/ds_worker.py under torchrun). DeepSpeed steps the optimizer itself, so the guard reads the
engine's global norm, loss scale and overflow flag after each step; faults exist on rank 1 only (a
NaN loss at step 4, a garbage-label window at steps 6-7)."""

from __future__ import annotations

import pytest

from tests.test_scale import run

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

WORKER = "ds_worker.py"


@pytest.mark.parametrize("stage", ["1", "2"])
def test_fault_on_one_rank_same_actions_rollback_restores_each_rank_exactly(tmp_path_factory, stage):
    r0, r1 = run(tmp_path_factory, stage, "faults", worker=WORKER)
    for k in ("actions", "skipped", "overflow", "findings", "losses", "totals", "restored", "params", "master_matches"):
        assert r0[k] == r1[k], k
    assert r0["engine_class"] == "DeepSpeedGuard"
    # the NaN step: DeepSpeed's overflow check skipped it, the guard saw it (inf norm) and took no action
    assert r0["overflow"] == [4] and r0["totals"][3] == float("inf")
    assert [4, "nonfinite_loss"] in r0["findings"]
    # the spike window: the engine had applied the step, so the guard's skip became a rollback
    assert [a[1] for a in r0["actions"]] == ["rollback", "rollback"]
    assert r0["actions"][0][0] == 6 and r0["actions"][0][3] == "skip"
    assert r0["skipped"] == [4, 6, 7]
    # after each rollback every rank's weights are exactly those after the restored step, and the
    # fp32 master partition (what ZeRO updates) matches them: the next step does not undo the rollback
    assert r0["restored"] and all(ok for _, _, ok in r0["restored"])
    assert r0["master_matches"] == [True] * len(r0["restored"])
    assert all(x == x for x in r0["losses"][7:])  # training went on, finite
    assert r0["losses"][-1] < r0["losses"][4] * 2


def test_attach_states_the_available_actions_and_takes_over_the_engine_clip(tmp_path_factory):
    r0, _ = run(tmp_path_factory, "2", "faults", worker=WORKER)
    # gradient_clipping=1.0 in the DeepSpeed config became the guard's starting max_norm; the engine clips to it
    assert r0["engine_clip_at_attach"] == r0["max_norm_at_attach"] == 1.0
    (event,) = r0["engine_events"]
    assert event["engine"] == "DeepSpeed ZeRO-2"
    assert set(event["available"]) == {"lower_lr", "adam", "tighten_clip", "rollback", "skip_data", "halt"}
    assert set(event["unavailable"]) == {"skip", "lower_layer_lr", "shrink_batch"}


def test_lr_multiplier_and_clip_reach_the_engine_step(tmp_path_factory):
    half, _ = run(tmp_path_factory, "2", "lr", worker=WORKER)
    full, _ = run(tmp_path_factory, "2", "lr1", worker=WORKER)
    # SGD: the step with the multiplier at 0.5 moved every weight by half of what it moved without
    moved = [(a, b) for a, b in zip(half["delta"], full["delta"]) if abs(b) > 1e-6]
    assert len(moved) > 100
    assert all(a == pytest.approx(0.5 * b, rel=1e-3, abs=1e-7) for a, b in moved)
    # the scheduler's LR is back in the param groups after the step (the multiplier is never baked in)
    assert half["lr_after_step"] == half["lr_before_step"] == [0.1]
    # a tightened clip is what the engine clips the next step to
    max_norm, engine_clip = half["clip_after_tighten"]
    assert max_norm < 1.0 and engine_clip == pytest.approx(max_norm)


def test_resume_restores_the_guard_on_every_rank(tmp_path_factory):
    r0, r1 = run(tmp_path_factory, "2", "resume", worker=WORKER)
    assert r0["resumed_equal"] == r1["resumed_equal"] == []  # no entry of the guard state differs
    faults, _ = run(tmp_path_factory, "2", "faults", worker=WORKER)
    assert r0["actions"] == faults["actions"] and r0["skipped"] == faults["skipped"]


@pytest.mark.parametrize("stage,setting", [("0", "zero_optimization.stage=0"), ("3", "zero_optimization.stage=3")])
def test_stage_0_and_3_refused_at_attach_with_the_alternative(tmp_path_factory, stage, setting):
    r0, r1 = run(tmp_path_factory, stage, "faults", worker=WORKER)
    assert r0["refused"] == r1["refused"]
    assert setting in r0["refused"] and "Fix:" in r0["refused"]


def test_hf_trainer_with_deepspeed_zero2(tmp_path_factory):
    """The HF callback under TrainingArguments(deepspeed=...) (one process: accelerate on the CPU counts
    one DeepSpeed process only): the same decisions as the plain loop, in the Trainer's logs too."""
    (r,) = run(tmp_path_factory, "2", "faults", worker="hf_ds_worker.py", nproc=1)
    assert r["overflow"] == [4] and r["totals"][3] == float("inf")
    assert [a[:2] for a in r["actions"]] == [[6, "rollback"], [7, "rollback"]] and r["actions"][0][3] == "skip"
    assert r["skipped"] == [4, 6, 7]
    (event,) = r["engine_events"]
    assert event["engine"] == "DeepSpeed ZeRO-2" and event["clip"] == 0.5  # max_grad_norm became the guard's clip
    logs = {e["step"]: e for e in r["logs"] if "gradguard/grad_norm/total" in e}
    # the engine's global norm is what the guard reports; the LR multiplier re-warms after the rollback
    assert logs[2]["gradguard/grad_norm/total"] == pytest.approx(logs[2]["grad_norm"])
    assert logs[6]["gradguard/action/rollback"] == 1.0
    assert logs[8]["gradguard/lr/group0"] < 0.1 * logs[8]["gradguard/lr_scheduled/group0"]
    assert all(e["engine_clip"] == 0.5 for e in logs.values())
    # the checkpoint at step 10 carries the guard state (for a resumed run)
    assert r["state_file"]["guard"]["step_count"] == 10 and r["state_file"]["guard"]["snapshots"]["restored"] == 2
    assert all(x == x for x in r["losses"][7:]) and r["losses"][-1] < 6
