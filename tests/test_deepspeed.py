"""DeepSpeed ZeRO 1/2 in a plain loop (``gradguard.deepspeed.DeepSpeedGuard(engine)``, two gloo processes on the CPU,
tests/ds_worker.py under torchrun) and under the HF Trainer (tests/hf_ds_worker.py, one process).
The guard reads each rank's partition of the reduced gradients before DeepSpeed's step (per-layer
norms, clip, skip through DeepSpeed's overflow path); with the optimizer offloaded it reads the
engine's norm after the step. Faults exist on rank 1 only (a NaN loss at step 4, a garbage-label
window at steps 6-7)."""

from __future__ import annotations

import json

import pytest

from gradguard.config import LRConfig
from tests.test_scale import run

#: the LR cut for an instability before the run learned anything (the default config)
EARLY = LRConfig().early_down_factor

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

WORKER = "ds_worker.py"
SAME = ("actions", "skipped", "overflow", "findings", "losses", "totals", "restored", "params", "master_matches",
        "norms", "mult")


@pytest.mark.parametrize("stage", ["1", "2"])
def test_fault_on_one_rank_same_actions_norms_of_one_process_exact_rollback(tmp_path_factory, stage):
    r0, r1 = run(tmp_path_factory, stage, "faults", worker=WORKER)
    for k in SAME:
        assert r0[k] == r1[k], k
    assert r0["engine_class"] == "DeepSpeedGuard"
    # as with DDP: the NaN step and the spike window skipped before DeepSpeed applied them; the
    # repeated spike escalates (rollback + lower LR), on both ranks at the same step
    assert r0["skipped"] == [4, 6, 7]
    assert [a[:2] for a in r0["actions"]] == [[7, "rollback"], [7, "lower_lr"]] and r0["actions"][0][2] == 2
    assert r0["mult"] < 1
    # per-layer norms from the ranks' disjoint partitions = one process on both ranks' batches
    assert set(r0["norms"]) == set(r0["ref"]) == {"layers.0", "layers.1", "layers.2"}
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-5)
    # after the rollback every rank's weights are exactly those after the restored step, and the
    # fp32 master partition (what ZeRO updates) matches them: the next step does not undo it
    assert r0["restored"] == [[7, 2, True]] and r0["master_matches"] == [True]
    assert all(x == x for x in r0["losses"][7:]) and r0["losses"][-1] < r0["losses"][4] * 2


def test_bf16_skip_goes_through_deepspeeds_overflow_path(tmp_path_factory):
    """bf16 (no loss scale; the skip goes through DeepSpeed's overflow path, whose check the guard
    turns on for that step should a bf16 configuration have it off): the same decisions as fp32,
    the norms of one process to bf16 precision."""
    r0, r1 = run(tmp_path_factory, "2", "bf16", worker=WORKER)
    for k in SAME:
        assert r0[k] == r1[k], k
    assert r0["skipped"] == [4, 6, 7]
    assert [a[:2] for a in r0["actions"]] == [[7, "rollback"], [7, "lower_lr"]]
    assert all(x == x for x in r0["losses"][4:5] + r0["losses"][7:])  # the NaN step left no NaN behind
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=2e-2)
    assert r0["restored"] == [[7, 2, True]] and r0["master_matches"] == [True]
    assert all(s == [1.0, None] for s in r0["scales"])  # no fp16 loss scale in bf16


def test_attach_states_the_available_actions_and_the_guard_clips(tmp_path_factory):
    r0, _ = run(tmp_path_factory, "2", "faults", worker=WORKER)
    # gradient_clipping=1.0 became the guard's starting max_norm; the guard clips the partitions
    # itself, so the engine's own clip is off
    assert r0["max_norm_at_attach"] == 1.0 and r0["engine_clip_at_attach"] == 0.0
    assert r0["engine_clip_after_close"] == 1.0  # closed: the engine clips as configured again
    (event,) = r0["engine_events"]
    assert event["engine"] == "DeepSpeed ZeRO-2" and "before the step" in event["measures"]
    assert set(event["available"]) == {"lower_lr", "adam", "tighten_clip", "rollback", "skip_data", "halt", "skip"}
    assert set(event["unavailable"]) == {"lower_layer_lr", "shrink_batch"}
    # every record of the run's event log validates against the shipped schema
    jsonschema = pytest.importorskip("jsonschema")
    from gradguard.sinks import event_schema

    validator = jsonschema.Draft202012Validator(event_schema())
    records = [json.loads(line) for line in open(r0["log"], encoding="utf-8")]
    assert {"start", "engine", "finding", "action", "skip", "summary"} <= {r["type"] for r in records}
    for rec in records:
        assert not [e.message for e in validator.iter_errors(rec)], rec


def test_offloaded_optimizer_reads_the_engine_after_its_step(tmp_path_factory):
    """offload_optimizer: the partition lives on the host and is not readable before the step, so
    the guard reads DeepSpeed's global norm and overflow flag after it; a skip becomes a rollback."""
    r0, r1 = run(tmp_path_factory, "2", "offload", worker=WORKER)
    for k in ("actions", "skipped", "overflow", "totals", "restored", "params"):
        assert r0[k] == r1[k], k
    (event,) = r0["engine_events"]
    assert "after its step" in event["measures"] and "skip" in event["unavailable"]
    assert r0["engine_clip_at_attach"] == 1.0  # the engine clips, to the guard's threshold
    assert r0["overflow"] == [4] and r0["totals"][3] == float("inf")  # DeepSpeed skipped the NaN step itself
    assert [a[1] for a in r0["actions"]] == ["rollback", "rollback"] and r0["actions"][0][3] == "skip"
    assert r0["skipped"] == [4, 6, 7]
    assert r0["restored"] and all(ok for _, _, ok in r0["restored"])
    assert r0["master_matches"] == [True] * len(r0["restored"])
    # the engine's norms are the pre-step partition norms of the readable run, to float rounding
    faults, _ = run(tmp_path_factory, "2", "faults", worker=WORKER)
    assert r0["totals"][:3] == pytest.approx(faults["totals"][:3], rel=1e-6)


def test_lr_multiplier_and_clip_reach_the_engine_step(tmp_path_factory):
    half, _ = run(tmp_path_factory, "2", "lr", worker=WORKER)
    full, _ = run(tmp_path_factory, "2", "lr1", worker=WORKER)
    # SGD: the step with the multiplier at 0.5 moved every weight by half of what it moved without
    moved = [(a, b) for a, b in zip(half["delta"], full["delta"]) if abs(b) > 1e-6]
    assert len(moved) > 100
    assert all(a == pytest.approx(0.5 * b, rel=1e-3, abs=1e-7) for a, b in moved)
    # the scheduler's LR is back in the param groups after the step (the multiplier is never baked in)
    assert half["lr_after_step"] == half["lr_before_step"] == [0.1]
    # a tightened clip is the guard's; the engine's own stays off
    max_norm, engine_clip = half["clip_after_tighten"]
    assert max_norm < 1.0 and engine_clip == 0.0


def test_resume_restores_the_guard_on_every_rank(tmp_path_factory):
    r0, r1 = run(tmp_path_factory, "2", "resume", worker=WORKER)
    assert r0["resumed_equal"] == r1["resumed_equal"] == []  # no entry of the guard state differs
    faults, _ = run(tmp_path_factory, "2", "faults", worker=WORKER)
    assert r0["actions"] == faults["actions"] and r0["skipped"] == faults["skipped"]


@pytest.mark.parametrize("stage,scenario,setting", [("0", "faults", "zero_optimization.stage=0"),
                                                    ("3", "faults", "zero_optimization.stage=3"),
                                                    ("2", "wrong", "optimizer=DeepSpeedZeroOptimizer")])
def test_unsupported_setups_refused_at_attach_with_the_alternative(tmp_path_factory, stage, scenario, setting):
    """Stage 0 and 3; and ``gg.Guard(engine.module, engine.optimizer)`` (the fix: pass the engine)."""
    r0, r1 = run(tmp_path_factory, stage, scenario, worker=WORKER)
    assert r0["refused"] == r1["refused"]
    assert setting in r0["refused"] and "Fix:" in r0["refused"]


def test_hf_trainer_with_deepspeed_zero2(tmp_path_factory):
    """The HF callback under TrainingArguments(deepspeed=...) (one process: accelerate on the CPU counts
    one DeepSpeed process only): the same decisions as the plain loop, in the Trainer's logs too."""
    (r,) = run(tmp_path_factory, "2", "faults", worker="hf_ds_worker.py", nproc=1)
    assert r["skipped"] == [4, 6, 7]
    assert [a[:2] for a in r["actions"]] == [[7, "rollback"], [7, "lower_lr"]]
    (event,) = r["engine_events"]
    assert event["engine"] == "DeepSpeed ZeRO-2" and "skip" in event["available"]
    logs = {e["step"]: e for e in r["logs"] if "gradguard/grad_norm/total" in e}
    # per-layer norms reach the Trainer's logs; the Trainer's grad_norm is the norm before the guard's
    # clip (max_grad_norm 0.5), as in an unguarded DeepSpeed run
    assert any(k.startswith("gradguard/grad_norm/") and not k.endswith("/total") for k in logs[2])
    assert logs[2]["gradguard/grad_norm/total"] == pytest.approx(logs[2]["grad_norm"], rel=1e-6)
    assert logs[2]["grad_norm"] > 0.5
    assert logs[7]["gradguard/action/rollback"] == 1.0
    assert logs[9]["gradguard/lr/group0"] < 0.5 * logs[9]["gradguard/lr_scheduled/group0"]
    assert all(e["engine_clip"] == 0.0 for e in logs.values())
    # the checkpoint at step 10 carries the guard state (for a resumed run)
    assert r["state_file"]["guard"]["step_count"] == 10 and r["state_file"]["guard"]["snapshots"]["restored"] == 1
    assert all(x == x for x in r["losses"][7:]) and r["losses"][-1] < 6


def test_hf_deepspeed_quiet_failure_is_found_from_the_partition_norms(tmp_path_factory):
    """The quiet failure of tests/test_quiet.py (GPT-2, AdamW at lr 0.1 without warm-up, clip 1.0: no
    spike) under DeepSpeed ZeRO-2: the per-layer norms read from the gradient partition show the final
    norm taking the gradient; the default callback rolls back and cuts the LR, as without DeepSpeed."""
    (r,) = run(tmp_path_factory, "2", "quiet", worker="hf_ds_worker.py", nproc=1)
    assert not [f for f in r["findings"] if f[1] in ("loss_spike", "nonfinite_loss")]
    (step, layers, value, threshold), *_ = r["takeover"]
    assert layers == ["transformer.ln_f"] and value > threshold == 0.2
    acts = {name: params for s, name, params in r["action_params"] if s == step}
    assert acts["rollback"]["to_step"] == 0 and acts["lower_lr"]["to"] == pytest.approx(EARLY)
    assert r["mult"] == pytest.approx(EARLY) and len(r["losses"]) == 45


def test_hf_deepspeed_resume_restores_the_guard(tmp_path):
    """A checkpoint of the HF + DeepSpeed run (step 10) resumed in a new process with a new callback:
    the guard state saved with it is restored (the counters and the rollback from step 7 carried on)."""
    import os
    import socket
    import subprocess
    import sys

    from tests.test_scale import ROOT

    def launch(scenario: str) -> dict:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
               os.path.join(ROOT, "tests", "hf_ds_worker.py"), str(tmp_path), "2", scenario]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / f"{scenario}.json").read_text())

    first = launch("faults")
    resumed = launch("resume")
    (event,) = resumed["resume_events"]
    assert event["restored"] is True and event["step"] == 10 and event["guard_step"] == 10
    assert resumed["steps"] == [11, 12, 13, 14]
    saved = first["state_file"]["guard"]
    state = resumed["guard_state"]
    assert state["step_count"] == 14 and state["skipped_steps"] == saved["skipped_steps"] == 3
    assert state["action_counts"] == saved["action_counts"] == {"rollback": 1, "lower_lr": 1}
    assert state["lr"]["global_mult"] == saved["lr"]["global_mult"] < 1


def test_gradient_accumulation_two_micro_batches_per_step(tmp_path_factory):
    """gradient_accumulation_steps=2: ``guard.step`` on every micro-batch steps the engine's micro
    count and returns None between boundaries; at the boundary the norms are those of the whole
    step's samples in one process and the loss is the mean over micro-batches and ranks."""
    r0, r1 = run(tmp_path_factory, "2", "gas", worker=WORKER)
    assert r0["micro_returns"] == [None] * 14 and len(r0["losses"]) == 14
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-5)
    micro = [r["micro_losses"][0] + r["micro_losses2"][0] for r in (r0, r1)]
    assert r0["losses"][0] == pytest.approx(sum(micro) / 4, rel=1e-6)
    assert r0["params"] == r1["params"] and not r0["skipped"]


def test_monitor_watches_without_changing_the_engine(tmp_path_factory):
    """The monitor preset: per-layer findings on both ranks, no action, DeepSpeed's own clip left in
    force; the NaN step DeepSpeed skips on its own is reported as skipped."""
    r0, r1 = run(tmp_path_factory, "2", "monitor", worker=WORKER)
    for k in ("findings", "skipped", "totals", "params"):
        assert r0[k] == r1[k], k
    assert r0["actions"] == [] and r0["mult"] == 1.0
    assert r0["engine_clip_at_attach"] == r0["engine_clip"] == 1.0
    assert r0["skipped"] == [4] and [6, "loss_spike"] in r0["findings"]
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-5)
