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
    assert torch.equal(_flat(model), before) and guard.step_count == 0
    guard.step(sum(losses))  # the fix works
    assert guard.step_count == 1
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
    assert guard.layers.layer_names[-1] == name
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
