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
    assert guard.core.step_count == 8
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


# -- 3. lines of the old loop left in (plain Guard) --------------------------------------------------------
def _misuse_events(guard) -> list[str]:
    return [e["kind"] for e in guard._misuse_sink.events if e.get("type") == "misuse"]


def _plain(quiet_cfg, scheduler=None, **over):
    from gradguard.sinks import MemorySink

    from .conftest import TinyNet

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = MemorySink()
    sched = scheduler(opt) if scheduler is not None else None
    guard = gg.Guard(model, opt, scheduler=sched, config=quiet_cfg(**over), sinks=[sink])
    guard._misuse_sink = sink
    return guard, model, opt, sched


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_stray_optimizer_step_after_a_skipped_nan_step_changes_nothing_and_warns(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    gen = torch.Generator().manual_seed(0)
    loss = model(*make_batch(gen))
    loss.backward()
    guard.step(loss)
    opt.zero_grad()
    loss = model(*make_batch(gen)) * float("nan")  # a NaN step: the guard skips it
    loss.backward()
    before = _flat(model)
    with pytest.warns(gg.GradGuardWarning, match=r"optimizer\.step\(\) was called after guard\.step\(\), which had "
                                                 r"skipped step 2.*changed nothing.*Fix: remove your optimizer\.step"):
        report = guard.step(loss)
        opt.step()  # the old loop's line
    assert report.skipped
    assert torch.equal(_flat(model), before) and torch.isfinite(_flat(model)).all()  # the NaN was never applied
    assert guard._misuse.loop.dropped_steps == 1 and "stray_optimizer_step" in _misuse_events(guard)
    guard.close()


def test_stray_optimizer_step_after_an_applied_step_is_a_no_op_and_warned_once(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    ref_guard, ref_model, ref_opt, _ = _plain(quiet_cfg)
    gen, gen2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            b = make_batch(gen)
            loss = model(*b)
            loss.backward()
            guard.step(loss)
            opt.step()  # left over from the old loop
            opt.zero_grad()
            loss = ref_model(*make_batch(gen2))
            loss.backward()
            ref_guard.step(loss)
            ref_opt.zero_grad()
    assert sum("optimizer.step() was called after guard.step()" in m for m in _messages(rec)) == 1
    assert torch.equal(_flat(model), _flat(ref_model))  # no double update
    guard.close()
    ref_guard.close()


def test_optimizer_step_without_a_guard_step_yet_or_after_close_is_left_alone(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no misuse warning: a warm-up before the guard's first step
        model(*make_batch(gen)).backward()
        before = _flat(model)
        opt.step()
        assert not torch.equal(_flat(model), before)
        opt.zero_grad()
    guard.close()
    model(*make_batch(gen)).backward()
    before = _flat(model)
    opt.step()  # after close the optimizer is the user's again
    assert not torch.equal(_flat(model), before)
    assert not opt._optimizer_step_pre_hooks  # the guard's hooks are gone


def test_scheduler_stepped_by_the_user_too_is_warned_once(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, sched = _plain(quiet_cfg, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.9))
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(4):
            loss = model(*make_batch(gen))
            loss.backward()
            guard.step(loss)
            sched.step()  # the old loop's line
            opt.zero_grad()
    hits = [m for m in _messages(rec) if "scheduler.step() was called 1 time(s) between two guard.step()" in m]
    assert len(hits) == 1 and "Fix: remove your scheduler.step()" in hits[0]
    guard.close()


def test_guard_step_twice_after_one_backward_is_warned(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    gen = torch.Generator().manual_seed(0)
    loss = model(*make_batch(gen))
    loss.backward()
    guard.step(loss)
    with pytest.warns(gg.GradGuardWarning, match=r"guard\.step\(\) was called again with no backward\(\).*Fix"):
        guard.step(loss)
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a normal step after it: no further warning
        for _ in range(2):
            loss = model(*make_batch(gen))
            loss.backward()
            guard.step(loss)
            opt.zero_grad(set_to_none=False)  # grads kept as tensors: backward adds in place
    guard.close()


def test_plateau_scheduler_warned_at_construction(quiet_cfg):
    with pytest.warns(gg.GradGuardWarning, match=r"scheduler=ReduceLROnPlateau.*scheduler\.step\(metric\)"):
        guard, *_ = _plain(quiet_cfg, scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o))
    guard.close()


def test_step_after_close_or_halt_raises_and_applies_nothing(quiet_cfg):
    from gradguard.misuse import GuardClosedError

    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    gen = torch.Generator().manual_seed(0)
    guard.close()
    loss = model(*make_batch(gen))
    loss.backward()
    before = _flat(model)
    with pytest.raises(GuardClosedError, match=r"closed guard \(close\(\) was called\).*Fix"):
        guard.step(loss)
    assert torch.equal(_flat(model), before)
    assert isinstance(GuardClosedError("x"), gg.GradGuardError)


def test_loss_given_as_a_list_is_a_clear_error(quiet_cfg):
    from .conftest import make_batch

    guard, model, opt, _ = _plain(quiet_cfg)
    gen = torch.Generator().manual_seed(0)
    losses = [model(*make_batch(gen)), model(*make_batch(gen))]
    sum(losses).backward()
    before = _flat(model)
    with pytest.raises(TypeError, match=r"guard\.step\(loss\): loss=list .*Fix: pass the step's total loss"):
        guard.step(losses)
    assert torch.equal(_flat(model), before) and guard.core.step_count == 0
    guard.step(sum(losses))  # the fix works
    assert guard.core.step_count == 1
    guard.close()


def _hf_trainer(tmp_path, callbacks, steps=3, **kw):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from .engines import BS, Data, Net

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=steps,
                             per_device_train_batch_size=BS, logging_steps=1, disable_tqdm=True, seed=0,
                             save_strategy="no", **kw)
    return Trainer(model=Net(), args=args, train_dataset=Data(), callbacks=callbacks)


def test_hf_same_callback_twice_is_refused_at_attach(tmp_path):
    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(config=cfg(tmp_path))
    with pytest.raises(gg.ConfigError, match=r"same callback instance is in the Trainer's callbacks 2 times.*Fix: "
                                             r"pass it once"):
        _hf_trainer(tmp_path, [cb, cb])
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = _hf_trainer(tmp_path, [cb])
    tr.add_callback(cb)
    with pytest.raises(gg.ConfigError, match=r"2 times"):
        tr.train()
    assert cb.core is None  # nothing was attached


def test_hf_same_callback_twice_in_monitor_mode_is_deduplicated_with_a_warning(tmp_path):
    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(config=cfg(tmp_path, "monitor"))
    tr = _hf_trainer(tmp_path, [cb])
    tr.add_callback(cb)
    with pytest.warns(gg.GradGuardWarning, match=r"2 times.*Monitor mode keeps the first"):
        tr.train()
    assert sum(c is cb for c in tr.callback_handler.callbacks) == 1
    assert cb.core.step_count == 3  # each step measured once


# -- 4. blind spots named ------------------------------------------------------------------------------------
class _LogitsNet(torch.nn.Module):
    """Returns logits, and a loss only when given labels (as transformers models do)."""

    def __init__(self) -> None:
        super().__init__()
        import types

        from .engines import VOCAB

        torch.manual_seed(0)
        self.config = types.SimpleNamespace(problem_type=None)  # read by the Trainer's label smoothing set-up
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return out


def _hf_logits_trainer(tmp_path, cb, trainer_cls=None, **kw):
    from transformers import Trainer, TrainingArguments

    from .engines import BS, Data

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=3,
                             per_device_train_batch_size=BS, logging_steps=1, disable_tqdm=True, seed=0,
                             save_strategy="no", **kw)
    return (trainer_cls or Trainer)(model=_LogitsNet(), args=args, train_dataset=Data(), callbacks=[cb])


def test_hf_label_smoothing_loss_blindness_is_named_with_the_fix(tmp_path):
    pytest.importorskip("transformers")
    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = _hf_logits_trainer(tmp_path, cb, label_smoothing_factor=0.1)
    with pytest.warns(gg.GradGuardWarning, match=r"loss is not visible.*label_smoothing_factor=0\.1.*"
                                                 r"Fix: .*callback\.observe_loss\(loss\)") as rec:
        tr.train()
    assert sum("loss is not visible" in m for m in _messages(rec)) == 1
    assert all(r.loss is None for r in cb.reports)  # what the warning says: blind


def test_hf_custom_compute_loss_feeding_the_loss_makes_the_guard_see_it(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer

    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(config=cfg(tmp_path))

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            logits = out["logits"]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) * 2
            if feed:
                cb.observe_loss(loss)
            return (loss, out) if return_outputs else loss

    feed = False
    with pytest.warns(gg.GradGuardWarning, match=r"loss is not visible.*MyTrainer\.compute_loss is overridden"):
        _hf_logits_trainer(tmp_path / "a", cb, MyTrainer).train()
    feed = True
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _hf_logits_trainer(tmp_path / "b", cb, MyTrainer).train()
    assert not [m for m in _messages(rec) if "loss is not visible" in m]
    assert all(r.loss is not None and r.loss > 0 for r in cb.reports) and len(cb.reports) == 3


def test_parameter_outside_the_model_is_measured_and_its_nan_gradient_skipped(quiet_cfg):
    from .conftest import TinyNet, make_batch

    torch.manual_seed(0)
    model = TinyNet()
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [temperature]}], lr=0.1)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    name = "optimizer.param_groups[1].params[0]"
    assert guard.core.layers.layer_names[-1] == name
    gen = torch.Generator().manual_seed(0)
    loss = model(*make_batch(gen)) * temperature
    loss.backward()
    report = guard.step(loss)
    assert report.applied and report.layer_norms[name] > 0 and temperature.item() != 1.0
    opt.zero_grad()
    before = temperature.detach().clone()
    loss = model(*make_batch(gen)) * temperature
    loss.backward()
    temperature.grad.fill_(float("nan"))  # only the temperature's gradient is poisoned
    report = guard.step(loss)
    assert report.skipped and torch.equal(temperature.detach(), before)
    assert any(name in f.layers for f in report.findings)
    guard.close()


def test_running_stats_of_a_skipped_step_are_put_back_exactly():
    from gradguard.running_stats import RunningStats

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    stats = RunningStats(model)
    assert stats.active and len(stats.modules) == 2
    model.train()
    model(torch.randn(16, 4))
    stats.settle(True)  # an applied step: its statistics stay
    bns = [model[1], model[4]]
    kept = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in bns]
    ids = [id(m.running_var) for m in bns]
    for _ in range(2):  # a step of two micro-batches on huge inputs, then skipped
        model(torch.randn(16, 4) * 1e6)
    assert not torch.equal(bns[0].running_var, kept[0][1])  # the forward moved them
    stats.settle(False)
    for m, (mean, var, n) in zip(bns, kept):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
        assert torch.equal(m.num_batches_tracked, n)
    assert [id(m.running_var) for m in bns] == ids and stats.restored == 1
    model(torch.randn(16, 4))  # re-armed: the next step is copied again
    stats.settle(True)
    assert not torch.equal(bns[0].running_var, kept[0][1])
    model.eval()
    model(torch.randn(16, 4) * 1e6)  # evaluation moves nothing and takes no copy
    stats.settle(False)
    stats.close()
    assert not model[1]._forward_pre_hooks and not model[4]._forward_pre_hooks


def test_running_stats_costs_nothing_without_batchnorm():
    from gradguard.running_stats import RunningStats

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                torch.nn.InstanceNorm1d(4), torch.nn.BatchNorm1d(4, track_running_stats=False))
    stats = RunningStats(model)
    assert not stats.active and stats.modules == []
    assert not any(m._forward_pre_hooks for m in model.modules())
    stats.settle(False)
    stats.close()
    tracked = torch.nn.InstanceNorm1d(4, track_running_stats=True)
    s2 = RunningStats(tracked)
    assert s2.active
    tracked.train()
    before = tracked.running_var.clone()
    tracked(torch.randn(2, 4, 5) * 100)
    s2.settle(False)
    assert torch.equal(tracked.running_var, before)
    s2.close()


# -- 5. trust and files ----------------------------------------------------------------------------------------
def test_hf_forked_run_does_not_roll_back_into_the_original_runs_checkpoints(tmp_path):
    """Run A saved checkpoints 2 and 4; its folder is copied to B and B resumes from its copy of
    checkpoint-4. The guard state lists A's checkpoint-2 (by A's path); checkpoint-4 turns bad at
    once, so checkpoint-2 is the only candidate: B must not read A's files."""
    import shutil

    from .engines import actions

    c = cfg(tmp_path / "a", recovery={"snapshot_interval": 0, "confirm_steps": 1})
    first = RUNNERS["hf"](tmp_path / "a", c, steps=4, save_at=2, opt_kind="sgd")
    assert first.error is None
    shutil.copytree(tmp_path / "a" / "hf", tmp_path / "b" / "hf")
    c2 = cfg(tmp_path / "b", recovery={"snapshot_interval": 0, "confirm_steps": 1})
    forked = RUNNERS["hf"](tmp_path / "b", c2, steps=8, faults={5: 50.0, 6: 50.0}, opt_kind="sgd",
                           resume_from=str(tmp_path / "b" / "hf" / "checkpoint-4"))
    paths = [e["path"] for e in forked.restored_state["checkpoints"]]
    assert str(tmp_path / "a" / "hf" / "checkpoint-2") in paths  # the copied state names A's folder
    rb = actions(forked, "rollback")
    assert rb and all(a["params"].get("source") != "checkpoint" for a in rb)  # not restored from A
    fallbacks = [e for e in forked.sink.events if e["type"] == "snapshot_fallback"]
    assert any("outside this run's checkpoint folder" in p and str(tmp_path / "a") in p
               for e in fallbacks for p in e["problems"])


def test_changed_or_foreign_checkpoint_is_not_trusted(tmp_path):
    from gradguard.contract import collective
    from gradguard.recovery import CheckpointTier, rollback_from_checkpoints

    class Source:
        roots = [str(tmp_path / "run")]
        reads: list[str] = []

        def read(self, path, step):
            self.reads.append(path)
            return {"model": {}, "guard": {}}

        def restore(self, payload):
            pass

    (tmp_path / "run").mkdir()
    (tmp_path / "other").mkdir()
    own, foreign = tmp_path / "run" / "ck-2.pt", tmp_path / "other" / "ck-4.pt"
    own.write_bytes(b"x" * 10)
    foreign.write_bytes(b"y" * 10)
    tier = CheckpointTier(1)
    tier.saved(2, [str(own)])
    tier.saved(4, [str(foreign)])
    tier.observe(5, True, False)  # both trusted by the trust rule, both fingerprinted
    assert all(tier.fingerprints.values()) and len(tier.fingerprints) == 2
    assert all(set(e) == {"step", "path", "healthy", "tested", "bad"} for e in tier.state_dict())  # state unchanged
    own.write_bytes(b"z" * 11)  # rewritten since (another run wrote the same name)
    events: list[dict] = []
    src = Source()
    assert rollback_from_checkpoints(tier, src, collective(), events.append, 6) is None
    assert src.reads == []  # neither the foreign file nor the rewritten one was read (checked before the load)
    problems = [p for e in events for p in e["problems"]]
    assert any("outside this run's checkpoint folder" in p for p in problems)
    assert any("changed since it was saved" in p for p in problems)
    # the intact own checkpoint is trusted
    tier = CheckpointTier(1)
    tier.saved(2, [str(own)])
    tier.observe(3, True, False)
    assert rollback_from_checkpoints(tier, src, collective(), events.append, 4)["to_step"] == 2
    assert src.reads == [str(own)]


def test_checkpoint_fingerprints_are_written_into_the_run_folder_and_checked_after_a_resume(tmp_path):
    """The fingerprint of each engine checkpoint goes into gradguard's own file in its run folder (not
    into the guard state, nor among the checkpoints); a resumed run trusts only the checkpoints whose
    files still match a record of its own run: changed, unrecorded or recorded by another run -> an
    event (warned by the rollback), forgotten. The checkpoint resumed from is vouched for by the resume."""
    import json
    import os

    from gradguard.recovery import LEDGER, CheckpointTier, read_ledger

    run, guard_dir = tmp_path / "run", tmp_path / "guard"
    run.mkdir()
    ledger = guard_dir / LEDGER

    def tier_of(state=None):
        t = CheckpointTier(1)
        t.ledger_dir = lambda: str(guard_dir)
        t.roots = lambda: [str(run)]
        if state is not None:
            t.load_state_dict(state)
        return t

    ck = {s: run / f"ck-{s}.pt" for s in (2, 4, 6, 8)}
    for s, f in ck.items():
        f.write_bytes(b"w" * s)
    tier = tier_of()
    for s in (2, 4, 6):
        tier.saved(s, [str(ck[s])])
        tier.observe(s + 1, True, False)  # fingerprinted (and recorded) at the step after the save
    tier.saved(8, [str(ck[8])])
    saved_state = tier.state_dict()
    assert all(set(e) == {"step", "path", "healthy", "tested", "bad"} for e in saved_state)  # no fingerprint in it
    book = read_ledger(str(ledger))
    assert sorted(book) == [str(ck[s]) for s in (2, 4, 6)] and {r["run"] for r in book.values()} == {tier.run_id}
    tier.fingerprint_saved()  # the run's end: the last checkpoint too
    assert str(ck[8]) in read_ledger(str(ledger)) and sorted(os.listdir(run)) == sorted(f.name for f in ck.values())
    # another run reuses the folder: rewrites ck-4 and records it under its own id; ck-6 changes under us;
    # ck-2's record is lost
    other = tier_of()
    ck[4].write_bytes(b"v" * 40)
    other.saved(4, [str(ck[4])])
    other.observe(5, True, False)
    os.utime(ck[6], ns=(1, 1))
    data = json.loads(ledger.read_text())
    del data["checkpoints"][str(ck[2])]
    ledger.write_text(json.dumps(data))
    resumed = tier_of(saved_state)
    resumed.observe(9, True, False)  # resumed from ck-8 (step 8): checked before anything else
    events = resumed.take_events()
    reasons = {e["wanted"]: e["reason"] for e in events if e["type"] == "checkpoint_untrusted"}
    assert "no fingerprint" in reasons[2] and "another run" in reasons[4] and "changed since" in reasons[6]
    assert [e["step"] for e in resumed.entries] == [8] and resumed.run_id == tier.run_id  # the run's id goes on
    assert all(e["message"].startswith("gradguard: ") for e in events)
    # the resume vouches for the checkpoint it came from even when its writer died before recording it
    data = json.loads(ledger.read_text())
    del data["checkpoints"][str(ck[8])]
    ledger.write_text(json.dumps(data))
    again = tier_of(saved_state)
    again.observe(9, True, False)
    assert 8 in [e["step"] for e in again.entries] and str(ck[8]) in read_ledger(str(ledger))
    # no run folder on this process: nothing but the checkpoint resumed from is trusted
    bare = CheckpointTier(1)
    bare.load_state_dict(saved_state)
    bare.observe(9, True, False)
    assert [e["step"] for e in bare.entries] == [8]
    assert all("no gradguard run folder" in e["reason"] for e in bare.take_events())
    # a planted link in place of the file is replaced, never written through
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.remove(ledger)
    os.symlink(victim, ledger)
    assert read_ledger(str(ledger)) == {}
    last = tier_of()
    last.saved(8, [str(ck[8])])
    last.observe(9, True, False)
    assert victim.read_text() == "precious" and not os.path.islink(ledger)
    assert list(read_ledger(str(ledger))) == [str(ck[8])]


@pytest.mark.parametrize("engine", ["plain", "hf", "lightning"])
def test_resumed_run_rolls_back_only_into_checkpoints_whose_fingerprint_matches(tmp_path, engine):
    """Run A saves checkpoints 2 and 4; resumed from checkpoint 4, a spike at 5 makes checkpoint 4 bad,
    so checkpoint 2 is the rollback's only candidate. Intact, it is restored (its fingerprint, written
    by A beside it, matches); touched since the save, the resumed run warns at once, emits
    ``checkpoint_untrusted`` and never reads it (the step is skipped instead)."""
    import os

    from .engines import actions

    c = cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 1})
    first = RUNNERS[engine](tmp_path, c, steps=4, save_at=2, opt_kind="sgd")
    assert first.error is None
    resume = checkpoint_of(engine, tmp_path, 4)
    # save_at=100: the engine's checkpointing stays on (Lightning attaches the tier to its ModelCheckpoint)
    intact = RUNNERS[engine](tmp_path, c, steps=8, faults={5: 50.0, 6: 50.0}, opt_kind="sgd", resume_from=resume,
                             save_at=100)
    assert not [e for e in intact.sink.events if e["type"] == "checkpoint_untrusted"]
    rb = actions(intact, "rollback")
    assert rb and rb[0]["params"].get("source") == "checkpoint" and rb[0]["params"]["to_step"] == 2
    two = checkpoint_of(engine, tmp_path, 2)
    for folder, _, files in (os.walk(two) if os.path.isdir(two) else [(os.path.dirname(two), [], [os.path.basename(two)])]):
        for name in files:
            os.utime(os.path.join(folder, name), ns=(10**9, 10**9))  # touched since the save
    with pytest.warns(RuntimeWarning, match=r"changed since it was saved.*not trusted for a rollback"):
        tampered = RUNNERS[engine](tmp_path, c, steps=8, faults={5: 50.0, 6: 50.0}, opt_kind="sgd",
                                   resume_from=resume, save_at=100)
    untrusted = [e for e in tampered.sink.events if e["type"] == "checkpoint_untrusted"]
    assert [e["wanted"] for e in untrusted] == [2] and untrusted[0]["step"] == 5
    rb = actions(tampered, "rollback")
    assert rb and all(a["params"].get("source") != "checkpoint" for a in rb)


def _plant(link, target) -> None:
    os = __import__("os")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(target, link)


def test_planted_event_log_symlink_is_not_followed(tmp_path, quiet_cfg):
    import os

    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    guard, model, opt = _guard(quiet_cfg, output={"jsonl": True})
    path = guard.log_path
    guard.close()
    os.remove(path)
    _plant(path, str(target))
    with pytest.warns(RuntimeWarning, match="event log is off"):
        guard, model, opt = _guard(quiet_cfg, output={"jsonl": True})
        from .conftest import make_batch

        loss = model(*make_batch(torch.Generator().manual_seed(0)))
        loss.backward()
        guard.step(loss)  # training goes on
        guard.close()
    assert target.read_text() == "precious\n" and os.path.islink(path)


def test_planted_diagnosis_and_state_file_symlinks_are_not_followed(tmp_path, quiet_cfg):
    import json
    import os

    from gradguard._hf.checkpoints import STATE_FILE, read_state_file, write_state_file

    victims = [tmp_path / f"victim{i}.txt" for i in range(4)]
    for v in victims:
        v.write_text("precious")
    guard, *_ = _guard(quiet_cfg)
    folder = tmp_path / "diag"
    _plant(str(folder / "diagnosis.json.tmp"), str(victims[0]))
    _plant(str(folder / "diagnosis.json"), str(victims[1]))
    path = guard.core.write_diagnosis({"reason": "test"}, str(folder))
    assert json.loads(open(path).read())["reason"] == "test" and not os.path.islink(path)
    ck = tmp_path / "checkpoint-3"
    _plant(str(ck / (STATE_FILE + ".tmp")), str(victims[2]))
    _plant(str(ck / STATE_FILE), str(victims[3]))
    write_state_file(str(ck), {"guard": {"x": 1}})
    assert read_state_file(str(ck / STATE_FILE)) == {"guard": {"x": 1}}
    assert all(v.read_text() == "precious" for v in victims)
    assert os.path.islink(ck / (STATE_FILE + ".tmp"))  # left alone, not written through
    guard.close()


def test_planted_snapshot_symlink_is_not_followed(tmp_path):
    import os

    from gradguard.snapshot import DiskSnapshots

    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    disk = DiskSnapshots(str(tmp_path / "snaps"))
    _plant(disk.path(2), str(victim))
    _plant(disk.path(2) + ".sha256", str(victim))
    disk.write(2, {"w": torch.ones(3)})
    assert victim.read_bytes() == b"precious" and not os.path.islink(disk.path(2))
    assert torch.equal(disk.load(2)["w"], torch.ones(3))


# -- 6. clear errors ---------------------------------------------------------------------------------------------
def test_lightning_two_default_callbacks_get_gradguards_error_naming_the_fix(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path))
    with pytest.raises(gg.ConfigError, match=r"2 GradGuardCallbacks named 'default' in one Trainer.*Fix: give each "
                                             r"its own name.*name='main'"):
        L.Trainer(callbacks=[GradGuardCallback(cfg(tmp_path)), GradGuardCallback(cfg(tmp_path))], **kw)
    cb = GradGuardCallback(cfg(tmp_path))
    with pytest.raises(gg.ConfigError, match=r"same GradGuardCallback \(name='default'\).*2 times.*Fix: pass it once"):
        L.Trainer(callbacks=[cb, cb], **kw)
    # added after the Trainer was built: caught when fit sets up, before any step
    trainer = L.Trainer(callbacks=[GradGuardCallback(cfg(tmp_path))], max_steps=1, **kw)
    trainer.callbacks.append(GradGuardCallback(cfg(tmp_path)))
    from .engines import BS, Data

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            return self.lin(batch["input_ids"].float()).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(gg.ConfigError, match=r"named 'default'.*Fix: give each its own name"):
        trainer.fit(Lit(), torch.utils.data.DataLoader(Data(), batch_size=BS))
    # distinct names: fine
    L.Trainer(callbacks=[GradGuardCallback(cfg(tmp_path)), GradGuardCallback(cfg(tmp_path), name="second")], **kw)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_plain_guard_with_an_event_log_is_picklable_and_the_copy_appends(quiet_cfg, how):
    import copy
    import json
    import pickle

    from .conftest import make_batch

    guard, model, opt = _guard(quiet_cfg, output={"jsonl": True, "metrics_interval": 1})
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        loss = model(*make_batch(gen))
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    before = open(guard.log_path).read().count("\n")
    twin = pickle.loads(pickle.dumps(guard)) if how == "pickle" else copy.deepcopy(guard)
    guard.close()
    loss = twin.model(*make_batch(gen))
    loss.backward()
    report = twin.step(loss)
    twin.close()
    assert report.step == 3 and twin.core.step_count == 3
    lines = [json.loads(x) for x in open(guard.log_path).read().splitlines()]
    assert len(lines) > before + 1 and lines[-1]["type"] == "summary"
    assert any(r.get("step") == 3 for r in lines[before:])  # the copy appended, nothing was truncated


@pytest.mark.parametrize("text,field", [("preset: default\nclip: 5\n", r"GuardConfig\.clip=5"),
                                        ("preset: conservative\nclip: [1]\n", r"GuardConfig\.clip=\[1\]"),
                                        ("preset: default\nlr: true\n", r"GuardConfig\.lr=True")])
def test_yaml_preset_with_a_malformed_section_is_a_config_error(tmp_path, text, field):
    pytest.importorskip("yaml")
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    with pytest.raises(gg.ConfigError, match=rf"{field} \(with preset .*must be a dict of fields.*Fix: write the "
                                             r"section as a mapping"):
        gg.GuardConfig.from_yaml(str(path))


# -- 7. a dead run's snapshot folder is reclaimed ------------------------------------------------------------
def test_dead_runs_snapshot_folder_is_reclaimed_at_the_next_start(tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys

    from gradguard.snapshot import OWNER_FILE, _proc_start

    from .conftest import TinyNet, make_batch

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    host = socket.gethostname()
    snaps = tmp_path / "snaps"

    def folder(name, owner):
        d = snaps / name
        d.mkdir(parents=True)
        (d / "snapshot-000000004.pt").write_bytes(b"x" * 100)
        (d / "snapshot-000000004.pt.sha256").write_text("abc")
        if owner is not None:
            (d / OWNER_FILE).write_text(json.dumps(owner))
        return d

    gone = folder("run-killed", {"host": host, "pid": dead, "start": None})
    reused = folder("run-reused", {"host": host, "pid": os.getppid(), "start": "1"})  # pid now runs another process
    live = folder("run-live", {"host": host, "pid": os.getppid(), "start": _proc_start(os.getppid())})
    other_host = folder("run-elsewhere", {"host": "another-machine", "pid": dead, "start": None})
    legacy = folder("run-legacy", None)  # no owner file: an older gradguard
    mine = folder("run-extra", {"host": host, "pid": dead, "start": None})
    (mine / "notes.txt").write_text("the user's")  # not gradguard's: the folder stays
    sink = gg.MemorySink()
    torch.manual_seed(0)
    model = TinyNet()
    cfg_ = gg.GuardConfig.preset("default", output={"dir": str(tmp_path / "out"), "console": False},
                                 recovery={"snapshot_interval": 1, "confirm_steps": 1, "disk_dir": str(snaps)})
    guard = gg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg_, sinks=[sink])
    assert not gone.exists()
    assert (not reused.exists()) == (_proc_start(os.getppid()) is not None)  # start times known on Linux
    assert live.exists() and other_host.exists() and legacy.exists() and (legacy / "snapshot-000000004.pt").exists()
    assert (mine / "notes.txt").exists()
    removed = [p for e in sink.events if e["type"] == "snapshot_orphans_removed" for p in e["paths"]]
    assert str(gone) in removed
    own = guard.core.snapshots.disk.directory
    owner = json.loads(open(os.path.join(own, OWNER_FILE)).read())
    assert owner["host"] == host and owner["pid"] == os.getpid()
    loss = model(*make_batch(torch.Generator().manual_seed(0)))
    loss.backward()
    guard.step(loss)
    guard.close()
    assert not os.path.exists(own)  # a closed run removes its own folder, owner file included


def test_parameter_outside_the_model_is_put_back_by_a_rollback(quiet_cfg):
    from .conftest import TinyNet, make_batch

    torch.manual_seed(0)
    model = TinyNet()
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD(list(model.parameters()) + [temperature], lr=0.1)
    guard = gg.Guard(model, opt, config=quiet_cfg(recovery={"snapshot_interval": 1, "confirm_steps": 1}))
    gen = torch.Generator().manual_seed(0)
    seen = {}
    for k in range(1, 5):
        loss = model(*make_batch(gen)) * temperature
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
        seen[k] = temperature.item()
    with torch.no_grad():
        temperature.fill_(123.0)  # blown up
    action = gg.Action("rollback", guard.core.step_count + 1)
    (model(*make_batch(gen)) * temperature).backward()
    guard.core.execute(action)
    assert temperature.item() == seen[action.params["to_step"]] != 123.0
    guard.close()
