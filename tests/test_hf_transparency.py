"""The callback is invisible to the HF Trainer (issue 16) and survives its resume paths (issue 12).

Written after what transformers' own Trainer suite checks (``tests/trainer/``): a run resumed from
a mid checkpoint ends with the same ``dataclasses.asdict(trainer.state)`` as an uninterrupted one
(``test_can_resume_training`` and its accumulation / epoch variants); the log history;
``test_training_arguments_are_left_untouched``; reproducibility; the event flow; stateful
callbacks restored with ``restore_callback_states_from_checkpoint``. Tiny GPT-2, CPU, a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import gradguard as gg  # noqa: E402
from gradguard.hf import STATE_FILE, GradGuardCallback  # noqa: E402
from gradguard.sinks import MemorySink  # noqa: E402
from tests.test_hf import ByteDataset, cfg, inject, tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: what transformers' own resume tests leave out of the log history comparison (timings), and the
#: evaluation timings
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
               "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


def args_for(out, **kw) -> TrainingArguments:
    args = dict(output_dir=str(out), use_cpu=True, report_to=[], max_steps=10, per_device_train_batch_size=4,
                learning_rate=2e-3, logging_steps=5, save_strategy="steps", save_steps=5, disable_tqdm=True,
                seed=0, data_seed=0, dataloader_num_workers=0)
    args.update(kw)
    return TrainingArguments(**args)


def make(out, callbacks=(), n: int = 256, eval_dataset=None, **kw) -> Trainer:
    return Trainer(model=tiny_gpt2(), args=args_for(out, **kw), train_dataset=ByteDataset(n),
                   eval_dataset=eval_dataset, callbacks=list(callbacks))


def guard_of(trainer: Trainer) -> GradGuardCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, GradGuardCallback))


def comparable(trainer: Trainer) -> tuple[dict, list[dict]]:
    """``dataclasses.asdict(trainer.state)`` and its log history without the timings, as
    transformers' ``check_trainer_state_are_the_same`` compares them."""
    state = dataclasses.asdict(trainer.state)
    logs = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in state.pop("log_history")]
    return json.loads(json.dumps(state)), logs


def guard_entry(trainer: Trainer) -> dict:
    return trainer.state.stateful_callbacks["GradGuardCallback"]["attributes"]["_resume_state"]["guard"]


# -- 1. a resumed run ends where an uninterrupted one does --------------------------------------------
RESUME_CASES = {
    # name: (preset, Trainer arguments, loss faults by step, restore_callback_states_from_checkpoint)
    "default_after_a_rollback": ("default", {}, {3: 4.0, 4: 4.0}, False),
    "monitor": ("monitor", {}, {}, False),
    "monitor_accumulation_restored_callbacks": ("monitor", {"gradient_accumulation_steps": 2}, {}, True),
    "default_across_epochs": ("default", {"max_steps": -1, "num_train_epochs": 3}, {}, False),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resumed_run_ends_with_the_uninterrupted_runs_trainer_state(tmp_path, case):
    preset, kw, faults, restore_cbs = RESUME_CASES[case]
    n = 24 if "num_train_epochs" in kw else 256  # 6 steps an epoch: checkpoint-5 is mid-epoch, the run spans 3
    full = make(tmp_path, [GradGuardCallback(config=cfg(tmp_path, preset))], n=n, **kw)
    inject(full, faults)
    full.train()
    want_state, want_logs = comparable(full)
    ck5 = tmp_path / "checkpoint-5"
    if faults:
        assert guard_of(full).core.action_counts  # a non-trivial guard state
    # the Trainer writes trainer_state.json before on_save: the checkpoint still lists itself
    tier = json.loads((ck5 / "trainer_state.json").read_text())["stateful_callbacks"]["GradGuardCallback"]
    assert [e["step"] for e in tier["attributes"]["_resume_state"]["guard"]["checkpoints"]] == [5]
    assert json.loads((ck5 / STATE_FILE).read_text())["guard"]["checkpoints"] == \
        tier["attributes"]["_resume_state"]["guard"]["checkpoints"]

    cb = GradGuardCallback(config=cfg(tmp_path, preset))
    resumed = make(tmp_path, [cb], n=n, restore_callback_states_from_checkpoint=restore_cbs, **kw)
    inject(resumed, faults)  # steps before 5 are not run again
    resumed.train(resume_from_checkpoint=str(ck5))
    got_state, got_logs = comparable(resumed)
    assert got_state == want_state  # the whole Trainer state, gradguard's exported state included
    assert got_logs == want_logs  # gradguard's log entries included
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    # the checkpoint resumed from stays in the rollback tier, judged as in the uninterrupted run
    steps = [e["step"] for e in cb.core.checkpoint_tier.state_dict()]
    assert 5 in steps and steps == [e["step"] for e in guard_entry(full)["checkpoints"]]
    assert cb.core.state_dict() == json.loads(json.dumps(guard_entry(full)))


def test_monitor_judges_checkpoints_like_the_default(tmp_path):
    """Monitor mode observes everything and only does not act: the same checkpoints are trusted or
    marked bad as with the default preset (a loss spike after checkpoint-6 marks it bad)."""
    tiers = {}
    for preset in ("default", "monitor"):
        c = cfg(tmp_path, preset, recovery={"confirm_steps": 2})
        cb = GradGuardCallback(config=c)
        tr = make(tmp_path / preset, [cb], max_steps=12, save_steps=3)
        inject(tr, {7: 4.0})
        tr.train()
        assert any(f.kind == "loss_spike" for r in cb.reports for f in r.findings if r.step == 7)
        tiers[preset] = {e["step"]: (e["tested"], e["bad"]) for e in cb.core.checkpoint_tier.state_dict()}
    assert tiers["monitor"] == tiers["default"]
    assert tiers["monitor"] == {3: (True, False), 6: (False, True), 9: (True, False), 12: (False, False)}


# -- 2. transparency in monitor mode ------------------------------------------------------------------
class Recorder(TrainerCallback):
    """Every event the Trainer sends to a callback, in order (as transformers' event-flow test records)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str):
        attr = object.__getattribute__(self, name)
        if name.startswith("on_") and callable(attr):
            def record(*args, **kwargs):
                object.__getattribute__(self, "events").append(name)
                return attr(*args, **kwargs)
            return record
        return attr


MONITOR_RUN = dict(logging_steps=1, eval_strategy="steps", eval_steps=4, save_steps=4, max_steps=8, max_grad_norm=0.7)


def monitor_run(out, with_guard: bool):
    rec = Recorder()
    c = cfg(out, "monitor", output={"metrics_interval": 1})
    cbs = [GradGuardCallback(config=c, sinks=[MemorySink()])] if with_guard else []
    tr = make(out, [*cbs, rec], eval_dataset=ByteDataset(8), **MONITOR_RUN)
    tr.train()
    return tr, rec, (cbs[0] if cbs else None)


def test_monitor_leaves_log_history_event_flow_and_arguments_as_without_it(tmp_path):
    plain, rec_plain, _ = monitor_run(tmp_path / "plain", False)
    guarded, rec_guarded, cb = monitor_run(tmp_path / "guarded", True)
    # log history: the Trainer's own entries unchanged; gradguard adds only gradguard/... keys, to
    # the training log entries (the callback is a monitor: its readings are what it is for, and
    # reporters read them from these logs), never to evaluation entries or the end-of-train summary
    _, logs_plain = comparable(plain)
    _, logs_guarded = comparable(guarded)
    assert len(logs_plain) == len(logs_guarded)
    for a, b in zip(logs_plain, logs_guarded):
        assert {k: v for k, v in b.items() if not k.startswith("gradguard/")} == a
        added = set(b) - set(a)
        assert all(k.startswith("gradguard/") for k in added)
        assert bool(added) == ("loss" in a)
    # event flow: every other callback sees exactly the events it sees without gradguard
    assert rec_guarded.events == rec_plain.events
    assert rec_plain.events.count("on_save") == 2 and "on_evaluate" in rec_plain.events
    # training arguments: untouched after training, and as the user set them in every checkpoint
    for tr in (plain, guarded):
        out = tr.args.output_dir
        assert tr.args.to_dict() == args_for(out, **MONITOR_RUN).to_dict()
        assert tr.args.max_grad_norm == 0.7
        for step in (4, 8):
            saved = torch.load(os.path.join(out, f"checkpoint-{step}", "training_args.bin"), weights_only=False)
            assert saved.to_dict() == tr.args.to_dict()
    # and the trained weights are the same
    for p, q in zip(plain.model.parameters(), guarded.model.parameters()):
        assert torch.equal(p, q)
    # the guard's own events in order: start, the steps in order (each save after its step), summary
    ev = cb.user_sinks[0].events
    assert ev[0]["type"] == "start" and cb.user_sinks[0].summary["steps"] == 8
    metric_steps = [s for s, _ in cb.user_sinks[0].metrics]
    assert metric_steps == sorted(metric_steps) and metric_steps[-1] == 8


def test_two_monitor_runs_are_identical(tmp_path):
    a, _, cba = monitor_run(tmp_path / "a", True)
    b, _, cbb = monitor_run(tmp_path / "b", True)
    sa, la = comparable(a)
    sb, lb = comparable(b)
    assert la == lb  # gradguard's entries included
    sa.pop("best_model_checkpoint"), sb.pop("best_model_checkpoint")
    guard_a, guard_b = (s["stateful_callbacks"]["GradGuardCallback"]["attributes"]["_resume_state"]["guard"]
                        for s in (sa, sb))
    for g in (guard_a, guard_b):  # the tier names each run's own folders
        for e in g["checkpoints"]:
            e["path"] = os.path.basename(e["path"])
    for s in (sa, sb):  # and each run names its own log folder (output.dir)
        s["stateful_callbacks"]["GradGuardCallback"]["args"]["config"]["output"].pop("dir")
    for g in (guard_a, guard_b):
        g["config"]["output"].pop("dir")
    assert sa == sb
    assert cba.core.state_dict()["detectors"] == cbb.core.state_dict()["detectors"]
    assert cba.user_sinks[0].metrics == cbb.user_sinks[0].metrics


# -- 3. state round trip and the Trainer's callback restore (issue 12) -----------------------------
def test_state_round_trips_through_json_and_a_resume(tmp_path):
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make(tmp_path, [cb], max_steps=5)
    inject(tr, {3: 4.0, 4: 4.0})
    tr.train()
    exported = cb.state()
    text = json.dumps(exported)
    assert json.loads(text) == exported  # plain JSON: trainer_state.json holds it
    ck5 = tmp_path / "checkpoint-5"
    _strip_guard_from_trainer_state(ck5)  # the state comes from the round trip only
    os.remove(ck5 / STATE_FILE)
    other = GradGuardCallback(**json.loads(text)["args"])  # what the Trainer does without a user instance
    assert other.config == cb.config and other.layer_metrics == cb.layer_metrics
    other._resume_state = json.loads(text)["attributes"]["_resume_state"]

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.restored = other.core.state_dict()

    probe = AtStart()
    make(tmp_path / "b", [other, probe], max_steps=6, save_strategy="no").train(resume_from_checkpoint=str(ck5))
    assert json.dumps(probe.restored) == json.dumps(cb.core.state_dict())
    assert other.core.step_count == 6


def test_restoring_callback_states_keeps_the_users_callback_config_sinks_and_out_dir(tmp_path):
    acting = GradGuardCallback(config=cfg(tmp_path))
    tr = make(tmp_path, [acting], max_steps=5)
    inject(tr, {3: 4.0, 4: 4.0})
    tr.train()
    assert acting.core.lr.global_mult < 1  # the saved state carries an LR cut

    sink = MemorySink()
    mine = GradGuardCallback(config=cfg(tmp_path, "monitor"), sinks=[sink], out_dir=str(tmp_path / "logs"),
                             layer_metrics=False)
    tr2 = make(tmp_path, [mine], max_steps=10, restore_callback_states_from_checkpoint=True)
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    guards = [c for c in tr2.callback_handler.callbacks if isinstance(c, GradGuardCallback)]
    assert guards == [mine]  # the user's instance, not one rebuilt from the checkpoint's arguments
    assert mine.core is not None and not mine.core.config.policy.act  # monitor, as asked
    assert mine.core.step_count == 10 and mine.core.n_findings >= acting.core.n_findings  # the state was restored
    assert mine.core.lr.global_mult == acting.core.lr.global_mult
    assert any(e["type"] == "resume" and e["restored"] for e in sink.events)  # the user's sink got the events
    assert mine.core.log_path.startswith(str(tmp_path / "logs"))
    new_logs = [h for h in tr2.state.log_history if h["step"] > 5 and "loss" in h]
    assert new_logs and all("gradguard/grad_norm/total" in h for h in new_logs)
    assert not any(k.startswith("gradguard/grad_norm/transformer") for h in new_logs for k in h)  # layer_metrics=False
    # still ahead of the reporting integrations (the Trainer re-added it at the end of its list)
    names = [type(c).__name__ for c in tr2.callback_handler.callbacks]
    assert names.index("GradGuardCallback") == names.index("DefaultFlowCallback") + 1


def _strip_guard_from_trainer_state(folder) -> None:
    path = folder / "trainer_state.json"
    ts = json.loads(path.read_text())
    ts["stateful_callbacks"].pop("GradGuardCallback")
    path.write_text(json.dumps(ts))


@pytest.mark.parametrize("preset", ["default", "monitor"])
def test_a_truncated_state_file_is_a_clear_error_when_acting_and_a_warning_in_monitor_mode(tmp_path, preset):
    tr = make(tmp_path, [GradGuardCallback(config=cfg(tmp_path, preset))], max_steps=5)
    tr.train()
    ck5 = tmp_path / "checkpoint-5"
    state_file = ck5 / STATE_FILE
    state_file.write_text(state_file.read_text()[:50])  # a writer killed mid-file
    _strip_guard_from_trainer_state(ck5)  # so the resume has to read the file
    cb = GradGuardCallback(config=cfg(tmp_path, preset))
    tr2 = make(tmp_path, [cb], max_steps=7, max_grad_norm=0.7)
    if preset == "default":
        with pytest.raises(gg.StateError) as err:
            tr2.train(resume_from_checkpoint=str(ck5))
        msg = str(err.value)
        assert str(state_file) in msg and "not valid JSON" in msg and "Fix: delete" in msg
        assert tr2.args.max_grad_norm == 0.7 and "training_step" not in vars(tr2)  # the Trainer left as it was
    else:
        with pytest.warns(gg.GradGuardWarning, match="not valid JSON.*fresh guard state"):
            tr2.train(resume_from_checkpoint=str(ck5))
        assert tr2.state.global_step == 7 and cb.core.step_count == 7  # trained on, with a fresh guard
        assert cb.core.applied_steps == 2 and [e["step"] for e in cb.core.checkpoint_tier.state_dict()] == [7]


def test_garbage_guard_entry_in_trainer_state_names_where_it_is(tmp_path):
    tr = make(tmp_path, [GradGuardCallback(config=cfg(tmp_path))], max_steps=5)
    tr.train()
    path = tmp_path / "checkpoint-5" / "trainer_state.json"
    ts = json.loads(path.read_text())
    ts["stateful_callbacks"]["GradGuardCallback"]["attributes"]["_resume_state"] = "garbage"
    path.write_text(json.dumps(ts))
    with pytest.raises(gg.StateError, match=r"trainer_state.json stateful_callbacks\['GradGuardCallback'\].*Fix"):
        make(tmp_path, [GradGuardCallback(config=cfg(tmp_path))], max_steps=7).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def test_callback_added_on_resume_saves_its_state(tmp_path):
    make(tmp_path, max_steps=5).train()  # no gradguard: trainer_state.json has no entry for it
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make(tmp_path, [cb], max_steps=10)
    tr.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))  # the save at step 10 used to KeyError
    saved = json.loads((tmp_path / "checkpoint-10" / "trainer_state.json").read_text())
    guard = saved["stateful_callbacks"]["GradGuardCallback"]["attributes"]["_resume_state"]["guard"]
    # a fresh guard, numbering steps as the Trainer does (its checkpoint entries name the Trainer's steps)
    assert guard["step_count"] == 10 and guard["applied_steps"] == 5
    assert [e["step"] for e in guard["checkpoints"]] == [10]
    assert [r.step for r in cb.reports] == [6, 7, 8, 9, 10]
    assert any(e["type"] == "resume" and not e["restored"] for e in
               (json.loads(x) for x in open(cb.core.log_path, encoding="utf-8")))
