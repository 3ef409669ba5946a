"""The plain-loop Guard end to end on real optimizers (tiny models, CPU)."""

import copy
import json
import os

import pytest
import torch

import gradguard as gg
from gradguard.act import AdamTuner, ClipController, LRMultiplier
from gradguard.config import GuardConfig
from gradguard.detect import Detectors
from gradguard.measure import LayerMap
from gradguard.policy import Policy
from gradguard.snapshot import SnapshotRing

from .conftest import TinyNet, make_batch


def _train(model, opt, steps, guard=None, gen_seed=0, poison_at=(), sched=None):
    gen = torch.Generator().manual_seed(gen_seed)
    reports = []
    for i in range(1, steps + 1):
        x, y = make_batch(gen)
        loss = model(x, y)
        if i in poison_at:
            loss = loss * float("inf")
        loss.backward()
        if guard is None:
            opt.step()
            if sched:
                sched.step()
        else:
            reports.append(guard.step(loss))
        opt.zero_grad(set_to_none=True)
    return reports


def test_monitor_mode_is_bit_identical(quiet_cfg):
    torch.manual_seed(0)
    a = TinyNet()
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=3e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=3e-2)
    sa = torch.optim.lr_scheduler.CosineAnnealingLR(oa, 40)
    sb = torch.optim.lr_scheduler.CosineAnnealingLR(ob, 40)
    _train(a, oa, 40, sched=sa)
    guard = gg.Guard(b, ob, scheduler=sb, config=quiet_cfg("monitor"))
    reports = _train(b, ob, 40, guard=guard)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert all(r.applied and not r.actions for r in reports)
    assert reports[-1].total_norm > 0 and len(reports[-1].layer_norms) == 5


def test_nonfinite_steps_are_skipped_and_logged(quiet_cfg, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    guard = gg.Guard(model, opt, scheduler=sched, config=quiet_cfg())
    reports = _train(model, opt, 12, guard=guard, poison_at={5, 9})
    assert [r.step for r in reports if r.skipped] == [5, 9]
    assert sched.last_epoch == 10  # the scheduler did not advance on skipped steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    guard.close()
    events = [json.loads(line) for line in open(guard.log_path)]
    kinds = [e.get("kind") for e in events if e["type"] == "finding"]
    assert kinds.count("nonfinite_loss") == 2
    assert events[-1]["type"] == "summary" and events[-1]["skipped"] == 2
    assert guard.log_path == os.path.join(str(tmp_path), "gradguard", "events.jsonl")


def test_persistent_nan_halts_with_diagnosis(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = gg.Guard(model, opt, config=quiet_cfg(policy={"max_skip_streak": 4}))
    with pytest.raises(gg.GradGuardHalt) as info:
        _train(model, opt, 30, guard=guard, poison_at=set(range(10, 30)))
    d = info.value.diagnosis
    assert d["step"] == 13 and "consecutive skipped" in d["reason"]
    assert {f["kind"] for f in d["recent_findings"] if f["step"] == 13} == {"nonfinite_loss", "nonfinite_grad"}
    assert "halted training at step 13" in str(info.value)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_accumulation_loss(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        loss = model(*make_batch(gen))
        (loss / 4).backward()
        guard.observe_loss(loss)
        losses.append(loss.item())
    rep = guard.step()
    assert rep.loss == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert rep.applied and guard.core.step_count == 1


def test_layer_lr_targets_culprits_or_named_groups(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    a = gg.Action("lower_layer_lr", 1)
    guard.core.execute(a)
    assert set(a.params) == {"embed", "lm_head"}  # the seed's embedding/lm_head x0.1
    assert guard.core.lr.layer_mult["embed"] == pytest.approx(0.1)


STATEFUL = {
    "Detectors": lambda m, o: Detectors(GuardConfig().detect),
    "Policy": lambda m, o: Policy(GuardConfig().policy),
    "ClipController": lambda m, o: ClipController(GuardConfig.preset("adaptive").clip),
    "LRMultiplier": lambda m, o: LRMultiplier(GuardConfig().lr, o, LayerMap(m)),
    "AdamTuner": lambda m, o: AdamTuner(GuardConfig().adam, o),
    "SnapshotRing": lambda m, o: SnapshotRing(m, o, ring_size=2, confirm_steps=2),
}


@pytest.fixture(scope="module")
def stateful_run(tmp_path_factory):
    """One real guarded run shared by every class of ``STATEFUL``: each object's state after it (the
    snapshot ring's after a restore, taken last: a restore puts earlier detector states back)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    cfg = gg.GuardConfig.preset("adaptive", output={"dir": str(tmp_path_factory.mktemp("stateful")), "console": False})
    guard = gg.Guard(model, opt, config=cfg)
    _train(model, opt, 40, guard=guard, poison_at={30})
    guard.core.lr.lower()
    guard.core.lr.lower_layers(["lm_head"])
    core = guard.core
    states = {"Detectors": core.detectors.state_dict(), "Policy": core.policy.state_dict(),
              "ClipController": core.clip.state_dict(), "LRMultiplier": core.lr.state_dict(),
              "AdamTuner": core.adam.state_dict()}
    states = {k: json.loads(json.dumps(v)) for k, v in states.items()}  # states are plain JSON-able data
    core.snapshots.restore(core.snapshots.best(), restore_schedule=False)  # its saved state is the rollback count
    states["SnapshotRing"] = json.loads(json.dumps(core.snapshots.state_dict()))
    guard.close()  # one guard per optimizer: the LR hooks come off on close
    return model, opt, states


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_dict_round_trip_every_stateful_class(name, stateful_run):
    """Drive the object through a real guarded run, save, load into a fresh one, compare."""
    model, opt, states = stateful_run
    state = states[name]
    fresh = STATEFUL[name](model, opt)
    assert fresh.state_dict() != state or name == "AdamTuner"
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    if name == "LRMultiplier":
        fresh.remove()  # the fixture's optimizer is shared: no hook of a fresh multiplier stays on it


def test_resume_mid_run_continues_exactly(quiet_cfg, tmp_path):
    def fresh():
        torch.manual_seed(0)
        m = TinyNet()
        o = torch.optim.AdamW(m.parameters(), lr=5e-2)
        return m, o

    m1, o1 = fresh()
    g1 = gg.Guard(m1, o1, config=quiet_cfg())
    _train(m1, o1, 20, guard=g1, gen_seed=1, poison_at={7})
    ckpt = {"model": copy.deepcopy(m1.state_dict()), "opt": copy.deepcopy(o1.state_dict()),
            "guard": copy.deepcopy(g1.state_dict())}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    r1 = _train(m1, o1, 20, guard=g1, gen_seed=2, poison_at={5})

    m2, o2 = fresh()
    g2 = gg.Guard(m2, o2, config=quiet_cfg())
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    m2.load_state_dict(loaded["model"])
    o2.load_state_dict(loaded["opt"])
    g2.load_state_dict(loaded["guard"])
    r2 = _train(m2, o2, 20, guard=g2, gen_seed=2, poison_at={5})
    assert [r.step for r in r1] == [r.step for r in r2] == list(range(21, 41))
    assert [r.applied for r in r1] == [r.applied for r in r2]
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert g1.state_dict() == g2.state_dict()  # the whole state, snapshot counter included


def test_bad_inputs_fail_at_construction(quiet_cfg):
    model = TinyNet()
    other = TinyNet()
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="none of the model's trainable parameters is in the optimizer"):
        gg.Guard(model, opt, config=quiet_cfg())
    with pytest.raises(TypeError, match="config=str is not a GuardConfig"):
        gg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config="default")
    with pytest.raises(TypeError, match="is not a torch.optim.Optimizer"):
        gg.Guard(model, object(), config=quiet_cfg())
